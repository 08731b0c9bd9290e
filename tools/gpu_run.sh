#!/usr/bin/env bash
# gpu_run.sh: on a GPU machine, run what was built here for sm_90 and carried in .carry/dev
# (mtrl, the gpu tests, and the shared libraries the machine lacks: libzmq, libsodium, libinih...):
# every gpu test, the model benchmark, and the quickstart-gpu experiment. Logs go to $OUT.
#   here:   cmake --build build && tools/gpu_run.sh prepare
#   there:  tools/gpu_run.sh run
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
case "${1:-run}" in
prepare)
  rm -rf .carry/dev && mkdir -p .carry/dev/lib
  cp build/mtrl build/test_cuda_* .carry/dev/
  for l in libzmq.so.5 libsodium.so.23 libpgm-5.3.so.0 libnorm.so.1 libbsd.so.0 libmd.so.0 libinih.so.1; do
    cp -L "/lib/x86_64-linux-gnu/$l" .carry/dev/lib/
  done
  ;;
run)
  out=${OUT:-/tmp/out}
  mkdir -p "$out"
  export LD_LIBRARY_PATH=$repo/.carry/dev/lib:${LD_LIBRARY_PATH:-}
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
  if [ "${SKIP_TESTS:-0}" = 0 ]; then
  # TESTS="test_cuda_model test_cuda_kda" runs only those (default: every carried gpu test).
  for t in ${TESTS:-.carry/dev/test_cuda_*}; do
    [ -x "$t" ] || t=.carry/dev/$t
    n=$(basename "$t")
    timeout "${TEST_SECONDS:-300}" "$t" > "$out/$n.log" 2>&1
    echo "$n: exit $? | $(tail -n 1 "$out/$n.log")"
  done | tee "$out/tests.txt"
  .carry/dev/mtrl bench model --device cuda --preset small --tokens 8192 --seqs 4 --reps 2 2>&1 | tee "$out/bench_model_small.txt"
  fi
  # BENCH_LONG="--preset small --tokens 131072": one long episode (actor prefill and decode,
  # the learner's planned step, memory) before the quickstart.
  if [ -n "${BENCH_LONG:-}" ]; then
    timeout "${LONG_SECONDS:-300}" .carry/dev/mtrl bench long --device cuda $BENCH_LONG 2>&1 | tee "$out/bench_long.txt"
  fi
  [ "${SKIP_QG:-0}" = 1 ] && exit 0
  rm -rf /tmp/qg && mkdir -p /tmp/qg && cd /tmp/qg
  start=$(date +%s)
  timeout "${QG_SECONDS:-330}" "$repo/.carry/dev/mtrl" run "$repo/experiments/quickstart-gpu.ini" --db runs.db \
    --set run.out_dir=/tmp/qg/runs --set run.keep_checkpoints=1 > "$out/quickstart_gpu.log" 2>&1
  echo "quickstart-gpu: exit $? after $(( $(date +%s) - start )) s" | tee "$out/quickstart_gpu_summary.txt"
  python3 - >> "$out/quickstart_gpu_summary.txt" <<'PY'
import sqlite3
c = sqlite3.connect("runs.db")
q = lambda s: c.execute(s).fetchall()
print("run:", q("select id, status, round(ended - started, 1) from runs"))
print("episodes by status:", q("select status, count(*) from episodes group by status"))
print("reward by 5 steps:", q("select step/5, round(avg(value),3) from metrics where name='reward' group by step/5"))
for m in ("learner_tokens_per_s", "tokens_per_s", "episodes_per_s", "step_seconds"):
    print(m, q(f"select round(avg(value),1), round(max(value),1) from metrics where name='{m}'"))
print("reward per step:", [round(v, 3) for (v,) in q("select value from metrics where name='reward' order by step")])
# Why a run does or does not learn: the learner-vs-behaviour mismatch, clipping, gradient, entropy.
for m in ("mismatch_absdiff", "mismatch_k3", "clip_low", "clip_high", "ratio", "grad_norm", "entropy", "staleness_mean"):
    print(m, "per step:", [round(v, 4) for (v,) in q(f"select value from metrics where name='{m}' order by step")])
print("events (warnings):", q("select message from events where level in ('W','E','warn','error','WARN','ERROR') limit 12"))
print("warm-up loss first/last:", q("select value from metrics where name='warmup_loss' order by step limit 1"),
      q("select value from metrics where name='warmup_loss' order by step desc limit 1"))
e = q("select reward from episodes where status in ('complete','truncated') order by started")
n = len(e) // 5
if n: print("first 20%% of episodes %.3f, last 20%% %.3f (%d episodes)" % (sum(r for (r,) in e[:n]) / n, sum(r for (r,) in e[-n:]) / n, len(e)))
PY
  cat "$out/quickstart_gpu_summary.txt"
  ;;
esac
