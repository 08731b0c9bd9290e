#!/usr/bin/env bash
# gpu_bench.sh: build the CUDA kernels and their tests with nvcc directly (no CMake: the GPU
# machine lacks libzmq, libinih and libsodium, which the full configure requires), run every
# tests/test_cuda_*.cu against the fp64 CPU reference, run `mtrl bench ops` (through a small
# driver around mtrl_bench_ops_cuda) and, when present, the anchors script
# (shared/bench/anchors_gpu.py, copied to .carry/; fla source in .fla/) in the same command,
# the anchors first so that `bench ops --anchors` prints each kernel's ratio to its anchor.
#
#   usage (repository root): tools/gpu_bench.sh [tests] [bench] [anchors]   (default: all three)
#                            tools/gpu_bench.sh model-prepare | model      (the backbone; see below)
#   env: OUT (log folder, default /tmp/mtrl-gpu-out), BENCH_ARGS (extra `bench ops` arguments),
#        ANCHOR_ARGS (extra anchors_gpu.py arguments), JOBS (parallel compiles, default nproc)
# Logs: $OUT/gpu.log (everything, in order), $OUT/anchors.json. A failing test is rerun once
# under compute-sanitizer memcheck (first lines kept in the log).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mtrl-gpu-out}
B=/tmp/mtrl-gpu-build
JOBS=${JOBS:-$(nproc)}
mkdir -p "$OUT" "$B"
LOG=$OUT/gpu.log
what=${*:-tests bench anchors}
has() { [[ " $what " == *" $1 "* ]]; }
log() { echo "$@" | tee -a "$LOG"; }

# ---- the backbone on the GPU: `model-prepare` here, `model` on the GPU machine ------------------
# The model links common/ (inih, libsodium), which the GPU machine lacks, so it is built on a
# CUDA build machine: `tools/gpu_bench.sh model-prepare` (MODEL_BUILD: a -DMTRL_CUDA=ON build
# folder, default build-gpum) puts tests/test_cuda_model, a `mtrl bench model` driver and the two
# shared libraries into .carry/gpu (git-ignored: pass it as carry). On the GPU machine
# `tools/gpu_bench.sh model` runs the test (one process per case; a failing case again under
# compute-sanitizer memcheck), then `mtrl bench model --device cuda` for tiny and small.
# Env: CASES (default "0 1 2"), NO_BENCH=1, MODEL_BENCH_ARGS. Logs: $OUT/model.log, $OUT/test_N.log.
if has model-prepare; then
  MB=${MODEL_BUILD:-build-gpum}; C=.carry/gpu
  ninja -C "$MB" test_cuda_model mtrl_model mtrl_common mtrl_kernels mtrl_kernels_cuda || exit 1
  mkdir -p "$C" "$B"
  cp "$MB/test_cuda_model" "$C/"
  printf 'int cmd_bench(int, char **);\nint main(int c, char **v) { return cmd_bench(c, v); }\n' >"$B/bench_main.c"
  for f in "$B/bench_main.c" tools/cmd_bench.c tools/cli.c; do
    gcc -O2 -std=c11 -D_GNU_SOURCE -DMTRL_HAVE_CUDA=1 -I. -c "$f" -o "$B/$(basename "$f" .c).o" || exit 1
  done
  g++ -o "$C/bench_model" "$B/bench_main.o" "$B/cmd_bench.o" "$B/cli.o" "$MB/common/libmtrl_model.a" \
    "$MB/kernels/libmtrl_kernels_cuda.a" "$MB/kernels/libmtrl_kernels.a" "$MB/common/libmtrl_common.a" -fopenmp -lm \
    -Wl,--as-needed $(pkg-config --libs inih libsodium) -L/usr/local/cuda/lib64 -lcudart -lcublas -lcublasLt || exit 1
  for l in $(ldd "$C/test_cuda_model" "$C/bench_model" | awk '/libinih|libsodium/ {print $3}' | sort -u); do cp -L "$l" "$C/"; done
  ls -la "$C"
  exit 0
fi
if has model; then
  C=$PWD/.carry/gpu; ML=$OUT/model.log
  export LD_LIBRARY_PATH=$C:/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; ldd "$C/test_cuda_model" | grep -i "not found\|cuda\|cublas"; } >"$ML" 2>&1
  for c in ${CASES:-0 1 2}; do
    t0=$(date +%s)
    timeout -s KILL "${TEST_TIMEOUT:-200}" "$C/test_cuda_model" "$c" >"$OUT/test_$c.log" 2>&1
    rc=$?
    echo "== test_cuda_model case $c: exit $rc ($(( $(date +%s) - t0 )) s)" >>"$ML"
    grep -v "^    " "$OUT/test_$c.log" | tail -25 >>"$ML"
    if [ $rc -ne 0 ] && [ $rc -ne 77 ] && command -v compute-sanitizer >/dev/null; then
      echo "-- case $c under compute-sanitizer memcheck" >>"$ML"
      timeout -s KILL 120 compute-sanitizer --tool memcheck --print-limit 10 "$C/test_cuda_model" "$c" 2>&1 | grep -v "^    " | head -60 >>"$ML"
    fi
  done
  if [ -z "${NO_BENCH:-}" ]; then
    echo "== mtrl bench model --device cuda --preset tiny" >>"$ML"
    timeout -s KILL 60 "$C/bench_model" model --device cuda --preset tiny --tokens 8192 --seqs 8 --reps 3 ${MODEL_BENCH_ARGS:-} >>"$ML" 2>&1
    echo "== mtrl bench model --device cuda --preset small" >>"$ML"
    timeout -s KILL 150 "$C/bench_model" model --device cuda --preset small --tokens 16384 --seqs 8 --reps 3 ${MODEL_BENCH_ARGS:-} >>"$ML" 2>&1
  fi
  echo "== done $(date -u)" >>"$ML"
  cat "$ML"
  exit 0
fi

log "== $(date -u '+%Y-%m-%d %H:%M:%S UTC') $(git rev-parse --short HEAD 2>/dev/null) (+ working tree)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.sm --format=csv >>"$LOG" 2>&1
nvcc --version | tail -1 >>"$LOG"

# ---- build ------------------------------------------------------------------------------------
NVFLAGS="-O2 -std=c++17 -arch=sm_90 -I. --expt-relaxed-constexpr -lineinfo"
t0=$(date +%s)
pids=()
for f in kernels/ref/*.c; do
  gcc -O2 -std=c11 -fopenmp -D_GNU_SOURCE -DMTRL_REAL_F64=1 -I. -c "$f" -o "$B/ref_$(basename "$f" .c).o" &
  pids+=($!)
done
for f in $(find kernels/cuda -name '*.cu' -not -path '*/sm90a/*' | sort) tests/test_cuda_*.cu; do
  while (( $(jobs -rp | wc -l) >= JOBS )); do sleep 0.2; done
  n=$(basename "$f" .cu)
  [[ $f == kernels/cuda/* ]] && n=$(dirname "${f#kernels/cuda/}")_$n  # kernels/cuda/OP/FILE.cu: OP_FILE.o
  extra=""
  [[ $n == test_cuda_* ]] && extra="-DMTRL_REAL_F64=1"  # the tests link the fp64 reference
  nvcc $NVFLAGS $extra -Xptxas -v -c "$f" -o "$B/$n.o" >"$B/$n.build" 2>&1 &
  pids+=($!)
done
fail=0
for p in "${pids[@]}"; do wait "$p" || fail=1; done
for f in "$B"/*.build; do
  if grep -q "error" "$f"; then log "BUILD ERROR in $f"; cat "$f" >>"$LOG"; fi
done
# register / spill report of the kernels (one line per kernel)
grep -h "Compiling entry function\|Used [0-9]* registers" "$B"/*_cuda.build 2>/dev/null |
  awk '/Compiling entry/{f=$0; sub(/.*function ./,"",f); sub(/. for.*/,"",f)} /registers/{print f ": " $0}' |
  sed 's/ptxas info    : //' >"$OUT/ptxas.txt"
grep -h "spill" "$B"/*_cuda.build | grep -v " 0 bytes spill stores, 0 bytes spill loads" >>"$OUT/ptxas.txt"
KOBJ=$(ls "$B"/*_cuda.o | grep -v test_cuda_)
for t in tests/test_cuda_*.cu; do
  n=$(basename "$t" .cu)
  nvcc -arch=sm_90 "$B/$n.o" $KOBJ "$B"/ref_*.o -lcublas -lcublasLt -Xcompiler -fopenmp -o "$B/$n" >>"$LOG" 2>&1 || { log "LINK ERROR $n"; fail=1; }
done
printf 'extern "C" int mtrl_bench_ops_cuda(int, char **);\nint main(int c, char **v) { return mtrl_bench_ops_cuda(c - 1, v + 1); }\n' >"$B/bench_main.cu"
nvcc $NVFLAGS -o "$B/mtrl_bench" "$B/bench_main.cu" $KOBJ -lcublas -lcublasLt >>"$LOG" 2>&1 || { log "LINK ERROR bench"; fail=1; }
log "== build: $(( $(date +%s) - t0 )) s, status $fail"

# ---- tests ------------------------------------------------------------------------------------
if has tests; then
  for t in tests/test_cuda_*.cu; do
    n=$(basename "$t" .cu)
    [ -x "$B/$n" ] || { log "== $n: not built"; continue; }
    t1=$(date +%s)
    timeout -s KILL 300 "$B/$n" >"$B/$n.log" 2>&1
    rc=$?
    cat "$B/$n.log" >>"$LOG"
    log "== $n: exit $rc ($(( $(date +%s) - t1 )) s)"
    if [ $rc -ne 0 ] && [ $rc -ne 77 ] && command -v compute-sanitizer >/dev/null; then
      log "-- $n under compute-sanitizer memcheck (first 80 lines)"
      timeout -s KILL 240 compute-sanitizer --tool memcheck --print-limit 20 "$B/$n" 2>&1 | head -80 >>"$LOG"
    fi
  done
  grep -E "FAIL|passed, " "$LOG" | grep -v "^  .* ok$" >"$OUT/summary.txt"
fi

# ---- anchors (first: the benchmarks print their ratios to them) -----------------------------
if has anchors && [ -f .carry/anchors_gpu.py ]; then
  log "== anchors (shared/bench/anchors_gpu.py)"
  FLA_PATH=${FLA_PATH:-.fla} PYTHONUNBUFFERED=1 timeout -s KILL 480 python3 .carry/anchors_gpu.py \
    --json "$OUT/anchors.json" ${ANCHOR_ARGS:-} 2>&1 | grep -v "Warning\|warn(" | tee -a "$LOG" >>"$OUT/anchors.txt"
fi

# ---- benchmarks -------------------------------------------------------------------------------
if has bench; then
  # One process per section, so a crash in one section still leaves the others.
  # With the anchors of this run (above), every kernel's row is followed by its ratio to them.
  AARG=(); [ -s "$OUT/anchors.json" ] && AARG=(--anchors "$OUT/anchors.json")
  for sec in copy,gemm kda step attn decode moe ops; do
    log "== bench $sec"
    timeout -s KILL 400 "$B/mtrl_bench" ops --device cuda --only "$sec" "${AARG[@]}" ${BENCH_ARGS:-} 2>&1 | tee -a "$LOG" >>"$OUT/bench.txt"
  done
fi

log "== done $(date -u '+%H:%M:%S')"
