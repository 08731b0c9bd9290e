#!/usr/bin/env bash
# gpu_run.sh: on a GPU machine, run what was built here for sm_90 and carried in .carry/dev
# (mtrl, the gpu tests, and the shared libraries the machine lacks: libzmq, libsodium, libinih...):
# every gpu test, the model benchmark, and the quickstart-gpu experiment. Logs go to $OUT.
#   here:   cmake --build build && tools/gpu_run.sh prepare
#           (PREP_REV=HEAD tools/gpu_run.sh prepare: build that commit in a clean worktree,
#           ../mtrl-gpu-build, so that uncommitted work in this tree does not travel in the binaries)
#   there:  tools/gpu_run.sh run
#           tools/gpu_run.sh session   (two GPUs: the tests and benchmarks on one, the experiment on
#           the other, in one call; see the verb)
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
case "${1:-run}" in
prepare)
  bld=build
  if [ -n "${PREP_REV:-}" ]; then
    wt=$(cd .. && pwd)/mtrl-gpu-build
    rev=$(git rev-parse "$PREP_REV") || exit 1
    [ -d "$wt" ] || git worktree add -f --detach "$wt" "$rev" || exit 1
    git -C "$wt" checkout -q --detach "$rev" || exit 1
    # sm_90 machine code only (no PTX): the binaries are carried, and the carry limit is 64 MiB
    cmake -S "$wt" -B "$wt/build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DMTRL_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real >/dev/null || exit 1
    ninja -C "$wt/build" mtrl $(cd "$wt/tests" && ls test_cuda_*.c* | sed 's/\.cu\?$//; s/\.c$//') || exit 1
    bld=$wt/build
    echo "built $rev in $wt"
  fi
  rm -rf .carry/dev && mkdir -p .carry/dev/lib
  cp "$bld"/mtrl "$bld"/test_cuda_* .carry/dev/
  # the carry limit is 64 MiB with the tracked tree: the binaries travel without debug sections
  # or symbol tables (the sm_90a attention kernels took the set past it with symbols)
  strip --strip-all .carry/dev/mtrl .carry/dev/test_cuda_*
  for l in libzmq.so.5 libsodium.so.23 libpgm-5.3.so.0 libnorm.so.1 libbsd.so.0 libmd.so.0 libinih.so.1 libjansson.so.4 libpcre2-8.so.0 libpng16.so.16 libcrypto.so.3; do
    cp -L "/lib/x86_64-linux-gnu/$l" .carry/dev/lib/
  done
  ;;
run)
  out=${OUT:-/tmp/out}
  mkdir -p "$out"
  export LD_LIBRARY_PATH=$repo/.carry/dev/lib:${LD_LIBRARY_PATH:-}
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
  # TEST_GPU=N runs the tests and the model benchmark on GPU N only.
  [ -n "${TEST_GPU:-}" ] && export CUDA_VISIBLE_DEVICES=$TEST_GPU
  if [ "${SKIP_TESTS:-0}" = 0 ]; then
  # TESTS="test_cuda_model test_cuda_kda" runs only those (default: every carried gpu test).
  # The device returns at most 8 files from $OUT: each test's whole log stays in $TEST_LOGS
  # (default /tmp/mtrl-test-logs); $out/tests.txt gets each test's result line and its FAIL lines.
  logs=${TEST_LOGS:-/tmp/mtrl-test-logs}
  mkdir -p "$logs"
  for t in ${TESTS:-.carry/dev/test_cuda_*}; do
    [ -x "$t" ] || t=.carry/dev/$t
    n=$(basename "$t")
    timeout "${TEST_SECONDS:-300}" "$t" > "$logs/$n.log" 2>&1
    echo "$n: exit $? | $(tail -n 1 "$logs/$n.log")"
    grep -h "FAIL" "$logs/$n.log" | head -20 | sed 's/^/    /'
  done | tee "$out/tests.txt"
  .carry/dev/mtrl bench model --device cuda --preset small --tokens 8192 --seqs 4 --reps 2 >> "$out/tests.txt" 2>&1
  fi
  # BENCH_LONG="--preset small --tokens 131072": one long episode (actor prefill and decode,
  # the learner's planned step, memory) before the quickstart.
  if [ -n "${BENCH_LONG:-}" ]; then
    timeout "${LONG_SECONDS:-300}" .carry/dev/mtrl bench long --device cuda $BENCH_LONG 2>&1 | tee "$out/bench_long.txt"
  fi
  [ "${SKIP_QG:-0}" = 1 ] && exit 0
  unset CUDA_VISIBLE_DEVICES
  # QG_INI=experiments/retrieval-1m.ini runs another experiment (default quickstart-gpu.ini).
  # QG_SETS="learner.lr=2e-5;learner.lr=6e-5 warmup.steps=8": variants of the experiment run at
  # once, variant i on GPU i mod (GPUs) with those --set overrides (default: one, as written);
  # "run.seed=1 OMP_NUM_THREADS=4": upper-case NAME=VALUE words are that variant's environment.
  # Each runs in $QG_DIR<i> (default /tmp/qg<i>); its log and summary are $out/quickstart_gpu<i>.log
  # / _summary<i>.txt. QG_GPU=N starts the variants at GPU N (e.g. the gpu tests on GPU 0, the
  # experiment on GPU 1). QG_DIR=$PWD/.runs/qg with QG_RESUME=1: a run stopped by QG_SECONDS goes
  # on from its last checkpoint at the next call (a warm machine keeps the ignored .runs/).
  # Every 2 s the GPU memory of each process goes to $out/gpu_mem.csv; the summary has each
  # process's peak.
  # MPS=1: the learner and actor processes share each GPU through CUDA MPS (their kernels run
  # side by side instead of in alternating time slices); the daemon is stopped afterwards.
  if [ "${MPS:-0}" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && echo "CUDA MPS daemon started" | tee -a "$out/gpu.txt"
  fi
  ngpu=$(nvidia-smi -L | wc -l)
  ini=$repo/${QG_INI:-experiments/quickstart-gpu.ini}
  nvidia-smi --query-compute-apps=timestamp,pid,process_name,used_memory --format=csv,noheader -l 2 \
    > "$out/gpu_mem.csv" 2>/dev/null &
  memlog=$!
  IFS=';' read -r -a sets <<< "${QG_SETS:-}"
  [ ${#sets[@]} -eq 0 ] && sets=("")
  pids=()
  for i in "${!sets[@]}"; do
    (
      dir=${QG_DIR:-/tmp/qg}$i
      args=()
      if [ "${QG_RESUME:-0}" = 1 ] && [ -f "$dir/runs.db" ]; then args+=(--resume); else rm -rf "$dir"; fi
      mkdir -p "$dir" && cd "$dir" || exit 1
      # a word NAME=VALUE with an upper-case NAME is an environment variable of that variant
      # (e.g. OMP_NUM_THREADS=4: the learner and its actors inherit it), others are --set
      for kv in ${sets[$i]}; do
        if [[ $kv =~ ^[A-Z_][A-Z0-9_]*= ]]; then export "$kv"; else args+=(--set "$kv"); fi
      done
      start=$(date +%s)
      CUDA_VISIBLE_DEVICES=$(( (${QG_GPU:-0} + i) % ngpu )) timeout "${QG_SECONDS:-330}" "$repo/.carry/dev/mtrl" run \
        "$ini" --db runs.db --set run.out_dir=$dir/runs --set run.keep_checkpoints=1 \
        "${args[@]}" >> "$out/quickstart_gpu$i.log" 2>&1
      echo "$(basename "$ini") variant $i [${sets[$i]}]: exit $? after $(( $(date +%s) - start )) s" > "$out/quickstart_gpu_summary$i.txt"
      python3 "$repo/tools/run_summary.py" runs.db >> "$out/quickstart_gpu_summary$i.txt" 2>&1
      # EVAL_ARGS="--stage 4 --episodes 8": then `mtrl eval` of the run's last checkpoint on fresh
      # tasks (within EVAL_SECONDS, default 150), its totals into the summary
      ck=$(ls runs/runs-run*/ckpt-*.safetensors 2>/dev/null | tail -n 1)
      if [ -n "${EVAL_ARGS:-}" ] && [ -n "$ck" ]; then
        CUDA_VISIBLE_DEVICES=$(( (${QG_GPU:-0} + i) % ngpu )) timeout "${EVAL_SECONDS:-150}" "$repo/.carry/dev/mtrl" eval \
          "$ini" --checkpoint "$ck" $EVAL_ARGS >> "$out/quickstart_gpu$i.log" 2>&1
        echo "eval of $ck ($EVAL_ARGS): exit $?: $(grep -E '^[0-9]+ episodes in' "$out/quickstart_gpu$i.log" | tail -n 1)" \
          >> "$out/quickstart_gpu_summary$i.txt"
      fi
    ) &
    pids+=($!)
  done
  wait "${pids[@]}"
  kill "$memlog" 2>/dev/null
  [ "${MPS:-0}" = 1 ] && echo quit | nvidia-cuda-mps-control 2>/dev/null
  python3 "$repo/tools/gpu_mem_peaks.py" "$out/gpu_mem.csv" >> "$out"/quickstart_gpu_summary0.txt
  cat "$out"/quickstart_gpu_summary*.txt
  ;;
session)
  # One call of a two-GPU machine (nvidia-h200-x2) that ends within SESSION_SECONDS (default 560):
  # GPU 0 runs every gpu test, then SESSION_EXTRA, the model benchmark of `small` at 65,536
  # tokens (fp32 with its per-phase profile, [kernels] gemm = tf32 and bf16 GEMMs, and
  # the latter two at 4 x 2048) and
  # the KDA forward benchmark (v2, v3 and v3 bf16x3);
  # GPU 1 runs the experiment (QG_INI, QG_SETS, QG_DIR, QG_RESUME as for `run`) until the
  # deadline. A device returns at most 8 files: $OUT/tests.txt, $OUT/bench.txt and the
  # experiment's four under $OUT/x (log, summary, gpu.txt, gpu_mem.csv).
  out=${OUT:-/tmp/out}
  mkdir -p "$out/x"
  secs=${SESSION_SECONDS:-560}
  end=$(( $(date +%s) + secs ))
  ( OUT=$out/x SKIP_TESTS=1 QG_GPU=1 QG_SECONDS=$(( secs - 15 )) "$0" run > /dev/null 2>&1 ) &
  (
    OUT=/tmp/mtrl-session-tests TEST_GPU=0 SKIP_QG=1 "$0" run > /dev/null 2>&1
    cp /tmp/mtrl-session-tests/tests.txt "$out/tests.txt"
    export CUDA_VISIBLE_DEVICES=0 LD_LIBRARY_PATH=$repo/.carry/dev/lib:${LD_LIBRARY_PATH:-}
    left() { echo $(( end - $(date +%s) - 10 )); }
    b=.carry/dev/mtrl
    {
      # SESSION_EXTRA=".carry/dev/test_cuda_model; ...": commands run first here
      # (GPU 0, after the tests), their output into bench.txt
      [ -n "${SESSION_EXTRA:-}" ] && timeout "$(left)" bash -c "$SESSION_EXTRA"
      # --profile: one more step timed per phase (device synchronised at each boundary): where the
      # 64K step's time goes (P7)
      [ "$(left)" -gt 60 ] && timeout "$(left)" $b bench model --device cuda --preset small --tokens 65536 --seqs 1 --reps 2 --profile
      [ "$(left)" -gt 30 ] && timeout "$(left)" $b bench model --device cuda --preset small --tokens 8192 --seqs 4 --reps 2 --set kernels.gemm=tf32
      [ "$(left)" -gt 60 ] && timeout "$(left)" $b bench model --device cuda --preset small --tokens 65536 --seqs 1 --reps 2 --set kernels.gemm=tf32
      [ "$(left)" -gt 30 ] && timeout "$(left)" $b bench model --device cuda --preset small --tokens 8192 --seqs 4 --reps 2 --set kernels.gemm=bf16
      [ "$(left)" -gt 60 ] && timeout "$(left)" $b bench model --device cuda --preset small --tokens 65536 --seqs 1 --reps 2 --set kernels.gemm=bf16
      [ "$(left)" -gt 30 ] && timeout "$(left)" $b bench ops --device cuda --only kda --kda-T 8192,65536,262144
      # PROFILE=1: Nsight Compute on the KDA v3 kernels (the first 4 launches at T = 65,536: the
      # prep and state passes), stall reasons and throughputs as text (issue 7: why 1.44 us per
      # tile, not the predicted 0.2-0.28)
      ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
      if [ "${PROFILE:-0}" = 1 ] && [ "$(left)" -gt 60 ] && [ -n "$ncu" ]; then
        timeout "$(left)" "$ncu" --clock-control none --kernel-name regex:kda3 --launch-count 4 \
          --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
          --section SchedulerStats --section MemoryWorkloadAnalysis \
          $b bench ops --device cuda --only kda --kda-T 65536 2>&1 | tail -400
      fi
    } > "$out/bench.txt" 2>&1
  ) &
  wait
  cat "$out/tests.txt"
  grep -E "^model:|^forward|^model FLOPs|KDA chunk fwd|  v3" "$out/bench.txt"
  tail -25 "$out/x/quickstart_gpu_summary0.txt" 2>/dev/null
  ;;
esac
