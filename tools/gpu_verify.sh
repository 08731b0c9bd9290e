#!/usr/bin/env bash
# gpu_verify.sh: on the GPU machine, after `PREP_REV=HEAD tools/gpu_run.sh prepare` here (the
# binaries and libraries carried in .carry/dev, or packed in .carry/dev.tar.xz, unpacked here
# first): the imported Kimi-Linear fixture on the GPU against transformers (fp32, then the training
# kernels' bf16 operands), every carried gpu test, the model benchmark's MFU at 64K (one sequence and 64
# packed), and the KDA forward's sequential and chunk-parallel times. Results go to $OUT:
# tests.txt (each test's last line and FAIL lines), hf.txt, bench.txt, kda.txt; with PARTS naming
# gmin and image also gmin.txt (the KDA kernels' bound cases at decays below the floor, a
# measurement) and image.txt (experiments/image-gpu.ini run, then one of its picture episodes
# re-executed with `mtrl replay --reexec`).
#   there:  OUT=... tools/gpu_verify.sh [TEST_SECONDS=150] [PARTS="hf tests gmin image bench kda"]
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
parts=" ${PARTS:-hf tests bench kda} "
has() { [[ $parts == *" $1 "* ]]; }
has hf && {
  $bin/mtrl import tests/fixtures/kimi_linear_tiny --device cuda --logits /tmp/kimi-cuda.st &&
    python3 tools/check_hf_export.py tests/fixtures/kimi_linear_tiny /tmp/kimi-cuda.st --atol 1e-4 --device cpu
  echo "--- the same on the training kernels' precisions: bf16 attention operands, then bf16 latents too"
  $bin/mtrl import tests/fixtures/kimi_linear_tiny --device cuda --set kernels.attn_operands=bf16 --logits /tmp/kimi-cuda-a16.st &&
    python3 tools/check_hf_export.py tests/fixtures/kimi_linear_tiny /tmp/kimi-cuda-a16.st --atol 5e-3 --device cpu
  $bin/mtrl import tests/fixtures/kimi_linear_tiny --device cuda --set kernels.attn_operands=bf16 --set kernels.latent=bf16 \
    --logits /tmp/kimi-cuda-l16.st && python3 tools/check_hf_export.py tests/fixtures/kimi_linear_tiny /tmp/kimi-cuda-l16.st --atol 5e-3 --device cpu
  echo "--- the CPU"
  $bin/mtrl import tests/fixtures/kimi_linear_tiny --device cpu --logits /tmp/kimi-cpu.st &&
    python3 tools/check_hf_export.py tests/fixtures/kimi_linear_tiny /tmp/kimi-cpu.st --atol 1e-4
  echo "--- the CPU's logits against transformers on the GPU (its own kernels: fla, cuDNN's conv)"
  python3 tools/check_hf_export.py tests/fixtures/kimi_linear_tiny /tmp/kimi-cpu.st --atol 1e-4 --device cuda
} > "$out/hf.txt" 2>&1
logs=${TEST_LOGS:-/tmp/mtrl-test-logs}
mkdir -p "$logs"
has tests && for t in ${TESTS:-$bin/test_cuda_*}; do
  n=$(basename "$t")
  s=$(date +%s%N)
  timeout "${TEST_SECONDS:-150}" "$t" > "$logs/$n.log" 2>&1
  rc=$?
  printf '%s: exit %d in %d ms | %s\n' "$n" "$rc" $(( ($(date +%s%N) - s) / 1000000 )) "$(tail -n 1 "$logs/$n.log")"
  grep -h "FAIL" "$logs/$n.log" | head -20 | sed 's/^/    /'
done | tee "$out/tests.txt"
has gmin && for gm in ${GMINS:--11 -10 -9}; do
  echo "--- test_cuda_kda gmin $gm"
  timeout 120 $bin/test_cuda_kda gmin "$gm" 2>&1 | grep -E "FAIL|passed|^chunk|^step|bound" | head -40
done > "$out/gmin.txt" 2>&1
has image && {
  rm -rf /tmp/img && mkdir -p /tmp/img && cd /tmp/img || exit 1
  s=$(date +%s)
  timeout "${IMAGE_SECONDS:-240}" "$OLDPWD/$bin/mtrl" run "$OLDPWD/experiments/image-gpu.ini" --db runs.db \
    --set run.out_dir=/tmp/img/runs --set run.keep_checkpoints=2 --set run.checkpoint_every=30 > run.log 2>&1
  echo "image-gpu: exit $? after $(( $(date +%s) - s )) s"
  python3 "$OLDPWD/tools/run_summary.py" runs.db
  ep=$(python3 -c "import sqlite3; c = sqlite3.connect('runs.db'); print(c.execute('select id from episodes where version_min = version_max and version_min = (select version from checkpoints order by version desc limit 1 offset 1) order by reward desc, tool_calls desc, id desc limit 1').fetchone()[0])")
  echo "--- replay --reexec of episode $ep"
  timeout 90 "$OLDPWD/$bin/mtrl" replay --db runs.db --episode "$ep" --reexec 2>&1 | tail -30
  grep -E "warm-up|step 1 |error|ERROR" run.log | head -20
  cd "$OLDPWD"
} > "$out/image.txt" 2>&1
# variants of the fixture (tools/kimi_variants.py), each imported on the CPU and the GPU (fp32
# latents) and compared with transformers: which part makes the GPU differ
has variants && {
  python3 tools/kimi_variants.py /tmp/kv > /dev/null 2>&1 || echo "kimi_variants.py failed"
  for v in $(ls /tmp/kv | grep -v '^_'); do
    for dev in ${VARIANT_DEVICES:-cuda}; do
      r=$($bin/mtrl import /tmp/kv/$v --device $dev --set kernels.latent=fp32 --logits /tmp/kv-$v-$dev.st 2>&1 | tail -n 1)
      c=$(python3 tools/check_hf_export.py /tmp/kv/$v /tmp/kv-$v-$dev.st --atol 1e-4 --device cpu 2>&1 | grep -E "max|differ|logit" | tr '\n' ' ')
      echo "$v $dev: $c"
    done
  done
} >> "$out/hf.txt" 2>&1
has bench && {
  $bin/mtrl bench model --device cuda --preset small --tokens 65536 --seqs 1 --reps 2
  $bin/mtrl bench model --device cuda --preset small --tokens 65536 --seqs 64 --reps 2
} > "$out/bench.txt" 2>&1
has kda && $bin/mtrl bench ops --device cuda --only kda --kda-T 8192,65536,262144 --heads 16 --kda-fwd-only > "$out/kda.txt" 2>&1
echo "done" >> "$out/gpu.txt"
