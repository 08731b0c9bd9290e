#!/usr/bin/env bash
# gpu_issue21.sh: on the GPU machine, issue 21's measurements from the binaries that
# `tools/gpu_run.sh prepare` carried in .carry/dev. Results go to $OUT.
#   tools/gpu_issue21.sh tests    the gpu tests of the changed paths (moe, kda, model, the decode graphs)
#   tools/gpu_issue21.sh moe      torch._grouped_mm anchors and `mtrl bench ops --only moe` side by side
#   tools/gpu_issue21.sh bench    R1 (bench learner), R2 (bench decode: launched and CUDA-graph steps side by side, DECODE_GRAPH=on|off|both, default both)
#   tools/gpu_issue21.sh varlen   the packed (varlen) KDA and conv forms against per-piece launches
#   tools/gpu_issue21.sh publish  R4 (mtrl bench publish --device cuda --preset small: ZeroMQ vs the channel)
#   tools/gpu_issue21.sh rl       R3 (bench rl experiments/quickstart-gpu.ini, RL_SECONDS, default 90;
#                                 RL_MPS=1 under CUDA MPS; RL_SETS="--set kernels.decode_graph=on" with
#                                 the actor's decode steps replayed from CUDA graphs)
# Several verbs run in the order given. TESTS_BUDGET_S=N: the tests verb starts no test after N
# seconds (a test skipped says so), so that the verbs after it fit the call.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/.carry/dev/lib:${LD_LIBRARY_PATH:-}
b=.carry/dev/mtrl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$out/gpu.txt"
for verb in "$@"; do
  echo "== $verb $(date -u +%H:%M:%S)" >> "$out/gpu.txt"
  case $verb in
  tests)
    t_end=$(( $(date +%s) + ${TESTS_BUDGET_S:-100000} ))
    for t in ${TESTS:-test_cuda_moe test_cuda_model test_cuda_kda test_cuda_wshm test_cuda_decode_graph}; do
      [ -x .carry/dev/$t ] || continue
      left=$(( t_end - $(date +%s) ))
      [ $left -gt 10 ] || { echo "$t: not run (TESTS_BUDGET_S spent)"; continue; }
      cap=${TEST_SECONDS:-240}; [ $cap -gt $left ] && cap=$left
      timeout "$cap" .carry/dev/$t > /tmp/$t.log 2>&1
      echo "$t: exit $? | $(tail -n 1 /tmp/$t.log)"
      grep -h "FAIL" /tmp/$t.log | head -20 | sed 's/^/    /'
    done | tee "$out/tests.txt"
    grep -hE "grouped|mtrl_model_train|rows" /tmp/test_cuda_moe.log /tmp/test_cuda_model.log 2>/dev/null | head -60 >> "$out/tests.txt"
    ;;
  publish)
    timeout 200 $b bench publish --device cuda --preset small --reps 5 > "$out/publish.txt" 2>&1
    ;;
  moe)
    timeout 240 python3 tools/anchors_grouped_mm.py --json /tmp/anchors_grouped_mm.json > "$out/moe.txt" 2>&1
    timeout 240 $b bench ops --device cuda --only moe --anchors /tmp/anchors_grouped_mm.json >> "$out/moe.txt" 2>&1
    ;;
  bench)
    timeout 200 $b bench learner --device cuda --preset small --batches 1x65536,64x1024,512x128,1x262144+200x512,64x25 --reps 1 > "$out/learner.txt" 2>&1
    timeout 200 $b bench decode --device cuda --preset small --batches 1,64,128,256 --ctx 1024:32768 --steps 8 --profile \
      --graph "${DECODE_GRAPH:-both}" > "$out/decode.txt" 2>&1
    ;;
  varlen)
    timeout 200 $b bench ops --device cuda --only varlen > "$out/varlen.txt" 2>&1
    ;;
  rl)
    # RL_MPS=1: the learner and actor processes share the GPU through CUDA MPS (kernels side by
    # side instead of alternating time slices), the daemon stopped afterwards
    if [ "${RL_MPS:-0}" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null; then
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      nvidia-cuda-mps-control -d && echo "CUDA MPS daemon started" >> "$out/gpu.txt"
    fi
    d=$(mktemp -d); (cd "$d" && timeout $(( ${RL_SECONDS:-90} + ${RL_SLACK:-200} )) "$OLDPWD/$b" bench rl "$OLDPWD/experiments/quickstart-gpu.ini" \
      --seconds "${RL_SECONDS:-90}" --db "$d/runs.db" ${RL_SETS:-}) > "$out/rl.txt" 2>&1
    [ "${RL_MPS:-0}" = 1 ] && echo quit | nvidia-cuda-mps-control 2>/dev/null
    ;;
  esac
done
grep -hE "exit|FAIL" "$out/tests.txt" 2>/dev/null
grep -hE "^batch|^B |TFLOP|chooser|episodes/s|busy|reward|GB/s|publish|train |waiting|decode:" "$out"/learner.txt "$out"/decode.txt "$out"/moe.txt "$out"/publish.txt "$out"/rl.txt "$out"/varlen.txt 2>/dev/null | head -80
