#!/usr/bin/env bash
# gpu_issue25.sh: on the GPU machine, issue 25's rows beside their anchors measured in the same
# call, from the binaries that `tools/gpu_run.sh prepare` carried in .carry/dev, and the anchors'
# sources carried as .carry/fla.tar.xz (flash-linear-attention's `fla` package, fla-src/) and
# .carry/fkda.tar.xz (FlashKDA + the cutlass headers it needs, fkda/; built here from source).
# Nothing is fetched from the network. Results go to $OUT (at most 8 files):
#   issue25.txt (log + the side-by-side summary), anchors25.json, anchors.txt, bench.txt,
#   learner1m.txt, ncu_summary.txt, ncu_raw.txt
#   tools/gpu_issue25.sh anchors  unpack fla and FlashKDA, build FlashKDA in the background while
#                                 tools/anchors_kda_attn.py times SDPA (cuDNN, FA2), then fla
#                                 chunk_kda and FlashKDA on the same inputs -> anchors25.json
#                                 (fla's Triton autotuning, ~5 min on a fresh machine, is paid once:
#                                 its cache lives in .runs/issue25/triton, kept on a warm machine)
#   tools/gpu_issue25.sh bench    mtrl bench ops --anchors anchors25.json: KDA H 16 at 8K..1M (fwd,
#                                 fwd+bwd; 1M fwd+bwd in 64K segments with its memory), H 64 and 96
#                                 at 8K (fwd), attention MHA and naive MLA (H 16) at 8K, 32K, 128K;
#                                 then P8: the 1M-token learner step of experiments/retrieval-1m.ini
#   tools/gpu_issue25.sh ncu      Nsight Compute on mtrl's kernels of the rows that miss (KDA v3
#                                 prep / state pass / chunk-parallel passes and the backward at H 16
#                                 64K; attention v3 forward and backward at 32K, MHA and naive)
#   tools/gpu_issue25.sh all      anchors, bench, ncu in turn, each only if it is not done yet
#                                 (.runs/issue25/done.<verb>: a second call on the warm machine goes
#                                 on where the last stopped) and while the deadline leaves room
# Several verbs run in the order given. DEADLINE_S (default 570): seconds from the start after
# which no step starts (each step's timeout is cut to what is left). Every step's failure is logged
# and the next step still runs.
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh" 570
work=$repo/.runs/issue25  # git-ignored: kept between calls on a warm machine
mkdir -p "$work"
export TRITON_CACHE_DIR=$work/triton FLA_FLASH_KDA=0
log=$out/issue25.txt
say() { echo "$(date -u +%H:%M:%S) [$(left) s left] $*" | tee -a "$log"; }
# cap SECONDS MARGIN: the timeout of a step: SECONDS, cut to what is left minus MARGIN (>= 1)
cap() { local c=$1 l=$(( $(left) - ${2:-10} )); [ "$l" -lt "$c" ] && c=$l; [ "$c" -lt 1 ] && c=1; echo "$c"; }
# step NAME MIN_LEFT: whether a step that needs MIN_LEFT seconds may start
step() { [ "$(left)" -ge "$2" ] && return 0; say "$1: not started ($(left) s left, needs $2)"; return 1; }
anchors_json=$work/anchors25.json

unpack() {
  if [ ! -f "$work/fla-src/fla/ops/kda/__init__.py" ]; then
    tar -xJf "$repo/.carry/fla.tar.xz" -C "$work" && say "fla: unpacked ($(cat "$work/fla-src/COMMIT" 2>/dev/null))" \
      || say "fla: .carry/fla.tar.xz did not unpack"
  fi
  if [ ! -f "$work/fkda/setup.py" ]; then
    tar -xJf "$repo/.carry/fkda.tar.xz" -C "$work" && say "FlashKDA: unpacked ($(cat "$work/fkda/COMMIT" 2>/dev/null))" \
      || say "FlashKDA: .carry/fkda.tar.xz did not unpack"
  fi
}

fkda_built() { ls "$work"/fkda/flash_kda_C*.so >/dev/null 2>&1; }

# FlashKDA's build in the background (CPU only; ~90 s at 16 jobs). setup.py's `git submodule
# update` must not find this repository's git directory: GIT_CEILING_DIRECTORIES stops it at fkda/.
fkda_build_start() {
  fkda_pid=
  if fkda_built; then say "FlashKDA: already built"; return; fi
  [ -f "$work/fkda/setup.py" ] || return
  say "FlashKDA: build started (background)"
  ( cd "$work/fkda" || exit
    GIT_CEILING_DIRECTORIES=$work FLASH_KDA_CUDA_ARCHS=90a NVCC_THREADS=4 MAX_JOBS=16 \
      timeout 420 python3 setup.py build_ext --inplace > "$work/fkda_build.log" 2>&1 &
    echo $! > "$work/fkda_build.tpid"
    wait $!; echo $? > "$work/fkda_build.rc" ) &
  fkda_pid=$!
}

do_anchors() {
  step anchors 120 || return
  unpack
  rm -f "$work/fkda_build.rc"
  fkda_build_start
  local t0; t0=$(date +%s)
  say "anchors: SDPA (cuDNN, FA2; MHA and naive MLA at H 16; 8K, 32K, 128K)"
  timeout "$(cap 240 200)" python3 tools/anchors_kda_attn.py --json "$anchors_json" --parts sdpa \
    >> "$work/anchors.txt" 2>&1
  say "anchors: SDPA exit $? after $(( $(date +%s) - t0 )) s"
  if [ -n "${fkda_pid:-}" ]; then
    # wait for the build, but leave fla its time
    while kill -0 "$fkda_pid" 2>/dev/null && [ "$(left)" -gt 240 ]; do sleep 2; done
    if kill -0 "$fkda_pid" 2>/dev/null; then
      say "FlashKDA: build still running with $(left) s left: stopped (fla only)"
      # the build's `timeout` (its pid, written by the subshell) passes the signal to setup.py
      kill "$(cat "$work/fkda_build.tpid" 2>/dev/null)" 2>/dev/null
    fi
    wait "$fkda_pid" 2>/dev/null
    say "FlashKDA: build exit $(cat "$work/fkda_build.rc" 2>/dev/null || echo '?'); $(fkda_built && echo built || echo 'not built')"
    fkda_built || tail -n 30 "$work/fkda_build.log" >> "$work/anchors.txt" 2>/dev/null
  fi
  step "anchors: fla + FlashKDA" 60 || return
  t0=$(date +%s)
  say "anchors: fla chunk_kda (fwd H 16 8K..1M, fwd+bwd 8K..1M where it fits; fwd H 64, 96 at 8K) and FlashKDA fwd"
  FLA_PATH=$work/fla-src FKDA_PATH=$work/fkda timeout "$(cap 520 15)" python3 tools/anchors_kda_attn.py \
    --json "$anchors_json" --parts fla,flashkda >> "$work/anchors.txt" 2>&1
  local rc=$?
  say "anchors: fla + FlashKDA exit $rc after $(( $(date +%s) - t0 )) s"
  [ $rc = 0 ] && touch "$work/done.anchors"
  cp "$anchors_json" "$out/anchors25.json" 2>/dev/null
  cp "$work/anchors.txt" "$out/anchors.txt" 2>/dev/null
}

do_bench() {
  step bench 60 || return
  [ -f "$anchors_json" ] || say "bench: no anchors25.json yet (run the anchors verb first): rows without their anchors"
  local A=(); [ -f "$anchors_json" ] && A=(--anchors "$anchors_json")
  local bo=$work/bench.txt rc=0 r
  : > "$bo"
  run_b() {  # run_b CAP MARGIN LABEL args...
    local c=$1 m=$2 l=$3; shift 3
    step "bench: $l" $(( m + 20 )) || { rc=1; return; }
    echo "== $l: mtrl $* ($(date -u +%H:%M:%S))" >> "$bo"
    timeout "$(cap "$c" "$m")" "$b" "$@" >> "$bo" 2>&1
    r=$?; say "bench: $l exit $r"; [ $r = 0 ] || rc=1
  }
  run_b 300 100 "KDA H16" bench ops --device cuda --only kda --kda-T 8192,65536,262144,1048576 --heads 16 "${A[@]}"
  run_b 90 90 "KDA H64" bench ops --device cuda --only kda --kda-T 8192 --heads 64 --kda-fwd-only "${A[@]}"
  run_b 90 90 "KDA H96" bench ops --device cuda --only kda --kda-T 8192 --heads 96 --kda-fwd-only "${A[@]}"
  run_b 200 60 "attention" bench ops --device cuda --only attn --heads 16 --attn-T 8192,32768,131072 \
    --attn-shapes mha,naive --naive-heads 16 --attn-v1 0 "${A[@]}"
  cp "$bo" "$out/bench.txt"
  # P8: the 1M-token learner step of retrieval-1m's model (target <= 8 s)
  if step "P8 learner step" 120; then
    say "P8: mtrl bench long --config experiments/retrieval-1m.ini --tokens 1048576 --decode 4 --profile"
    timeout "$(cap 300 10)" "$b" bench long --device cuda --config experiments/retrieval-1m.ini --tokens 1048576 \
      --decode 4 --profile > "$work/learner1m.txt" 2>&1
    r=$?; say "P8: exit $r"; [ $r = 0 ] || rc=1
    cp "$work/learner1m.txt" "$out/learner1m.txt"
    grep -E '^learner:' "$work/learner1m.txt" | sed -E 's/.*forward ([0-9.]+) s, backward ([0-9.]+) s.*/\1 \2/' | \
      awk '{t=$1+$2; printf "P8: the 1M learner step %.2f s (forward %.2f + backward %.2f) = %.2fx the target 8 s: %s\n", t, $1, $2, t/8, t<=8?"met":"missed"}' | tee -a "$log"
  fi
  # done (for `all`) only when its rows had the anchors of a finished anchors step beside them
  [ $rc = 0 ] && [ -f "$work/done.anchors" ] && touch "$work/done.bench"
}

do_ncu() {
  step ncu 60 || return
  local ncu; ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
  [ -n "$ncu" ] || { say "ncu: Nsight Compute not found"; return; }
  # the tensor pipes' active cycles, where this ncu knows the metrics (--query-metrics needs no GPU)
  local mets="" m q
  q=$(timeout 60 "$ncu" --query-metrics --chip gh100 2>/dev/null)
  for m in sm__pipe_tensor_cycles_active sm__pipe_tensor_op_hmma_cycles_active sm__pipe_tensor_op_gmma_cycles_active; do
    grep -qw "$m" <<< "$q" && mets="$mets,$m.avg.pct_of_peak_sustained_active"
  done
  say "ncu: $ncu; tensor-pipe metrics: ${mets#,}"
  local M=(); [ -n "$mets" ] && M=(--metrics "${mets#,}")
  local raw=$work/ncu_raw.txt files=() rc=0
  : > "$raw"
  prof() {  # prof TAG REGEX SKIP COUNT bench-args...
    local tag=$1 re=$2 s=$3 c=$4; shift 4
    step "ncu $tag" 45 || { rc=1; return; }
    local f=$work/ncu_$tag.txt
    timeout "$(cap 90 15)" "$ncu" --clock-control none -k "regex:$re" --launch-skip "$s" --launch-count "$c" \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats "${M[@]}" \
      "$b" "$@" --reps 1 > "$f" 2>&1
    local r=$?; say "ncu $tag ($re, skip $s, count $c): exit $r"; [ $r = 0 ] || rc=1
    { echo "===== $tag: ncu -k regex:$re --launch-skip $s --launch-count $c; mtrl $* --reps 1"; cat "$f"; } >> "$raw"
    files+=("$f")
  }
  local kf=(bench ops --device cuda --only kda --kda-T 65536 --heads 16 --kda-fwd-only)
  local kb=(bench ops --device cuda --only kda --kda-T 65536 --heads 16)
  local am=(bench ops --device cuda --only attn --heads 16 --attn-T 32768 --attn-shapes mha --attn-v1 0)
  local an=(bench ops --device cuda --only attn --heads 16 --attn-T 32768 --attn-shapes naive --naive-heads 16 --attn-v1 0)
  # the order: what the misses are most about first. kda3_state_k / kda3_prep_k: the sequential
  # forward's first launches (piece 1 of its pieces); kda_cp_state_k: pass 1 and pass 2 of the
  # first chunk-parallel call; attention: skip the forward's warm-up and 2 of its 3 repeats (3
  # launches), then the forward, dK/dV and dQ
  prof kda_state kda3_state_k 0 1 "${kf[@]}"
  prof kda_prep kda3_prep_k 0 1 "${kf[@]}"
  prof kda_cp_state kda_cp_state_k 0 2 "${kf[@]}"
  prof attn_mha attn3_ 3 3 "${am[@]}"
  prof attn_naive attn3_ 3 3 "${an[@]}"
  prof kda_bwd_state kda3_state_bwd_k 0 1 "${kb[@]}"
  prof kda_bwd_tile kda_tile_bwd_k 0 1 "${kb[@]}"
  prof kda_cp_combine kda_cp_combine_k 0 1 "${kf[@]}"
  [ ${#files[@]} -gt 0 ] && python3 tools/ncu_summary.py "${files[@]}" > "$out/ncu_summary.txt" 2>&1
  tail -c 3000000 "$raw" > "$out/ncu_raw.txt"
  [ $rc = 0 ] && touch "$work/done.ncu"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader >> "$log" 2>&1
say "gpu_issue25.sh $* (commit $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo '?'); binaries $(ls -l --time-style=+%FT%T "$b" 2>/dev/null | awk '{print $6}'))"
[ -x "$b" ] || say "no $b: run tools/gpu_run.sh prepare here first (.carry/dev.tar.xz unpacked)"
[ $# -gt 0 ] || set -- all
for verb in "$@"; do
  case $verb in
  anchors) do_anchors ;;
  bench) do_bench ;;
  ncu) do_ncu ;;
  all)
    for v in anchors bench ncu; do
      if [ -f "$work/done.$v" ]; then say "$v: done in an earlier call ($work/done.$v)"; continue; fi
      do_$v
    done ;;
  *) say "unknown verb $verb (anchors, bench, ncu, all)" ;;
  esac
done
# the side by side: every row's ratio line, the anchors, the memory lines, P8
{
  echo "---- anchors ($anchors_json)"
  python3 - "$anchors_json" <<'EOF' 2>&1
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print('  none:', e); sys.exit()
for k in sorted(r):
    v = r[k]
    print(f'  {k}: {v:.4g}' if isinstance(v, float) else f'  {k}: {v}')
EOF
  echo "---- mtrl rows and their anchors (bench.txt)"
  grep -E '^== |^KDA |^  chunk-parallel, auto|^attention|^MLA attention|^  fwd\+bwd|x the |-- the|does not fit|segments of|device memory|P2 ' "$work/bench.txt" 2>/dev/null
  grep -E '^learner:|^actor:' "$work/learner1m.txt" 2>/dev/null
  echo "---- Nsight Compute"
  cat "$out/ncu_summary.txt" 2>/dev/null
} >> "$log"
cat "$log"
