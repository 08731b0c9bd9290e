#!/usr/bin/env bash
# gpu_verify.sh: on the GPU machine, after `PREP_REV=HEAD tools/gpu_run.sh prepare` here (the
# binaries and libraries carried in .carry/dev, or packed in .carry/dev.tar.xz, unpacked here
# first): the imported Kimi-Linear fixture on the GPU against transformers, every carried gpu test, the model benchmark's MFU at 64K (one sequence and 64
# packed), and the KDA forward's sequential and chunk-parallel times. Results go to $OUT:
# tests.txt (each test's last line and FAIL lines), hf.txt, bench.txt, kda.txt.
#   there:  OUT=... tools/gpu_verify.sh [TEST_SECONDS=150]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/.carry/dev/lib:${LD_LIBRARY_PATH:-}
bin=.carry/dev
# the carry limit is 64 MiB: the set travels packed when it is larger
[ -f .carry/dev.tar.xz ] && [ ! -d $bin ] && python3 -c "import tarfile; tarfile.open('.carry/dev.tar.xz').extractall('.carry')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
git log -1 --format='%H %cd' >> "$out/gpu.txt" 2>/dev/null
{
  $bin/mtrl import tests/fixtures/kimi_linear_tiny --device cuda --logits /tmp/kimi-cuda.st &&
    python3 tools/check_hf_export.py tests/fixtures/kimi_linear_tiny /tmp/kimi-cuda.st --atol 1e-3 --device cuda
  $bin/mtrl import tests/fixtures/kimi_linear_tiny --device cpu --logits /tmp/kimi-cpu.st &&
    python3 tools/check_hf_export.py tests/fixtures/kimi_linear_tiny /tmp/kimi-cpu.st --atol 1e-4
} > "$out/hf.txt" 2>&1
logs=${TEST_LOGS:-/tmp/mtrl-test-logs}
mkdir -p "$logs"
for t in ${TESTS:-$bin/test_cuda_*}; do
  n=$(basename "$t")
  s=$(date +%s%N)
  timeout "${TEST_SECONDS:-150}" "$t" > "$logs/$n.log" 2>&1
  rc=$?
  printf '%s: exit %d in %d ms | %s\n' "$n" "$rc" $(( ($(date +%s%N) - s) / 1000000 )) "$(tail -n 1 "$logs/$n.log")"
  grep -h "FAIL" "$logs/$n.log" | head -20 | sed 's/^/    /'
done | tee "$out/tests.txt"
{
  $bin/mtrl bench model --device cuda --preset small --tokens 65536 --seqs 1 --reps 2
  $bin/mtrl bench model --device cuda --preset small --tokens 65536 --seqs 64 --reps 2
} > "$out/bench.txt" 2>&1
$bin/mtrl bench ops --device cuda --only kda --kda-T 8192,65536,262144 --heads 16 --kda-fwd-only > "$out/kda.txt" 2>&1
echo "done" >> "$out/gpu.txt"
