#!/usr/bin/env bash
# setup.sh: install what mtrl needs from Debian's packages and build it into ./build.
# Used by the README's two commands and by CI. Safe to run again: apt-get skips what is
# installed and the build is incremental. CUDA is built when nvcc is present (MTRL_CUDA=AUTO).
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(build-essential cmake ninja-build pkg-config python3 sqlite3
          libzmq3-dev libsqlite3-dev libcurl4-openssl-dev libinih-dev libsodium-dev
          libpcre2-dev libjansson-dev libpng-dev libssl-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo ${MTRL_CMAKE_ARGS:-}
cmake --build build -j "$(nproc)"
