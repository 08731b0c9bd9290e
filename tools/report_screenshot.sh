#!/usr/bin/env bash
# report_screenshot.sh: the README's picture of `mtrl report`, taken by a real browser (headless
# Chromium, Debian's `chromium` package) from a fresh CPU quickstart run.
#   tools/report_screenshot.sh [OUT.png]   (default docs/img/report.png; needs build/mtrl)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/img/report.png}
command -v chromium >/dev/null || { echo "report_screenshot: needs chromium (apt-get install chromium)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
build/mtrl run experiments/quickstart.ini --set run.db="$tmp/runs.db" --set run.out_dir="$tmp/runs" > "$tmp/run.log" 2>&1
build/mtrl report --db "$tmp/runs.db" --out "$tmp/report"
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1300,2400 \
  --screenshot="$out" "file://$tmp/report/index.html" 2>/dev/null
echo "report_screenshot: $out"
