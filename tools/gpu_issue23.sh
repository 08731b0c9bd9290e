#!/usr/bin/env bash
# gpu_issue23.sh: on the GPU machine, issue 23's long runs from the binaries that
# `tools/gpu_run.sh prepare` carried in .carry/dev, as resumable steps: each call does the next
# steps not yet done while they fit before its deadline (DEADLINE_S seconds from the start,
# default 560), so the same command on the warm machine (which keeps the ignored .runs/) goes on
# where the last one stopped. Logs go to $OUT and to .runs/<verb>/log.txt (the whole history).
#   tools/gpu_issue23.sh recall   experiments/recall-1m.ini, the protocol of its header:
#       train1  mtrl run --set run.stop_before_stage=4      (warm-up and stages 1-3: 8K..64K)
#       e1s4    mtrl eval --stage 4 --episodes ${R_EVAL4:-8}  (256K, the checkpoint of train1)
#       e1s5    mtrl eval --stage 5 --episodes 32            (1M)
#       train2  mtrl run --resume                            (stages 4 and 5: 256K, then 1M)
#       e2s5, e2s4  the two evals again, on the final checkpoint
#   tools/gpu_issue23.sh agent    experiments/agent-1m.ini:
#       train   mtrl run (the warm-up, then the ladder 16K .. 1M; resumed across calls)
#       e0s4    mtrl eval --stage 4 --episodes ${A_EVAL:-32} of ckpt-000000 (after the warm-up,
#               before any RL step), ${A_INFLIGHT:-16} episodes in flight, one per task: 32 fresh tasks
#               (16 episodes took 73-79 s at 900K tokens each on an H200, 2026-12-03; then in
#               groups of 2, 8 tasks, which could not tell 6/16 from 7/16)
#       e1s4    the same on the last checkpoint (after RL)
#       e0s3, e1s3  the same two at stage 3 (256K, 16-36 hops), cheaper, for a second look
#   A training step cut by the deadline is resumed by the next call (the run checkpoints when it
#   is stopped); an eval runs only when its estimate (EST_<step>, seconds) fits.
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh" 560
verb=${1:-recall}
case $verb in
recall) ini=$repo/experiments/recall-1m.ini
        steps="train1 e1s4 e1s5 train2 e2s5 e2s4"; train_args=(--set run.stop_before_stage=4) ;;
agent)  ini=$repo/experiments/agent-1m.ini
        # every checkpoint kept: e0 evaluates ckpt-000000, which keep_checkpoints = 3 deleted by
        # step 30 of the run of 2026-12-03 14:19 (4 GB each, 7 of them at 55 steps)
        steps="train e0s4 e1s4 e0s3 e1s3"; train_args=(--set run.keep_checkpoints=0) ;;
*) echo "gpu_issue23.sh: unknown verb $verb (recall, agent)" >&2; exit 2 ;;
esac
dir=$repo/.runs/$verb
mkdir -p "$dir"
log=$dir/log.txt
nvidia-smi --query-compute-apps=timestamp,pid,process_name,used_memory --format=csv,noheader -l 2 \
  >> "$dir/gpu_mem.csv" 2>/dev/null &
memlog=$!
say() { echo "$(date -u +%H:%M:%S) $*" | tee -a "$log"; }
last_ckpt() { ls "$dir"/runs/runs-run*/ckpt-*.safetensors 2>/dev/null | tail -n 1; }
for s in $steps; do
  [ -f "$dir/done.$s" ] && continue
  case $s in
  train*)
    [ "$(left)" -gt 60 ] || break
    args=("${train_args[@]}")
    [ -f "$dir/runs.db" ] && args+=(--resume)
    say "$s: mtrl run ${args[*]} (up to $(( $(left) - 20 )) s)"
    (cd "$dir" && timeout "$(( $(left) - 20 ))" "$b" run "$ini" --db runs.db --set run.out_dir="$dir/runs" \
      "${args[@]}" >> "$dir/run.log" 2>&1)
    rc=$?
    say "$s: exit $rc; $(grep -cE 'step [0-9]+' "$dir/run.log") step lines in run.log; last checkpoint $(last_ckpt)"
    python3 "$repo/tools/run_summary.py" "$dir/runs.db" > "$dir/summary.txt" 2>&1
    # exit 0 is the run's own end (the stop before stage 4, or the ladder's end); 124 the deadline
    [ $rc = 0 ] && touch "$dir/done.$s" || break
    ;;
  e*)
    st=${s#e?s}; n=32; [ "$st" = 4 ] && n=${R_EVAL4:-8}
    ck=$(last_ckpt); extra=()
    if [ $verb = agent ]; then
      # one episode per task, 16 in flight (16 1M-token states are ~18 GiB: the account's budget
      # is raised past the training run's, which shares the GPU with the learner)
      n=${A_EVAL:-32}; extra=(--set stage.$st.episodes_in_flight=${A_INFLIGHT:-16} --set stage.$st.group_size=1
                             --set actor.device_budget_mb=49152)
      [ ${s:0:2} = e0 ] && ck=$(ls "$dir"/runs/runs-run*/ckpt-000000.safetensors | head -n 1)
    fi
    est_var=EST_$s; est=${!est_var:-$([ "$st" = 5 ] || [ $verb = agent ] && echo 300 || echo 60)}
    [ "$(left)" -gt "$est" ] || { say "$s: $(left) s left, estimate $est: next call"; break; }
    say "$s: mtrl eval --stage $st --episodes $n --checkpoint $ck"
    (cd "$dir" && timeout "$(( $(left) - 10 ))" "$b" eval "$ini" --checkpoint "$ck" --stage "$st" \
      --episodes "$n" "${extra[@]}" > "$dir/$s.txt" 2>&1)
    rc=$?
    say "$s: exit $rc: $(grep -E '^[0-9]+ episodes in' "$dir/$s.txt" | tail -n 1)"
    [ $rc = 0 ] && touch "$dir/done.$s" || break
    ;;
  esac
done
kill $memlog 2>/dev/null
python3 "$repo/tools/gpu_mem_peaks.py" "$dir/gpu_mem.csv" > "$dir/mem_peaks.txt"
cp "$log" "$dir/summary.txt" "$dir/mem_peaks.txt" "$out/" 2>/dev/null
tail -c 4000000 "$dir/run.log" > "$out/run_log_tail.txt" 2>/dev/null
cat "$dir"/e*s*.txt > "$out/evals.txt" 2>/dev/null
cat "$log"; tail -n 30 "$dir/summary.txt" 2>/dev/null; cat "$dir/mem_peaks.txt"
