#!/usr/bin/env bash
# device call 1 (2026-12-01): gpu tests on the new tree; 64K step old vs new; ncu of the KDA backward's pass 3
set -u
START=$(date +%s); left() { echo $(( 575 - ($(date +%s) - START) )); }
O=${OUT:-/tmp/out}; mkdir -p $O /tmp/b
tar -xJf .carry/bins.tar.xz -C /tmp/b
export LD_LIBRARY_PATH=/tmp/b/lib
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader > $O/gpu.txt
date -u +%FT%TZ >> $O/gpu.txt
run_test() { local t=$1 s=$2; local t0=$(date +%s); timeout $s /tmp/b/new/$t > /tmp/$t.log 2>&1; local rc=$?
  echo "$t: exit $rc in $(( $(date +%s) - t0 )) s | $(tail -n 1 /tmp/$t.log)"; grep -h FAIL /tmp/$t.log | head -20; }
{ run_test test_cuda_model 200; } > $O/tests.txt 2>&1
for v in new old; do
  /tmp/b/$v/mtrl bench model --device cuda --preset small --tokens 65536 --seqs 1 --reps 2 --profile > $O/small64k_$v.txt 2>&1
done
{ run_test test_cuda_long $(( $(left) - 60 )); } >> $O/tests.txt 2>&1
grep -E "^\s+\(|rel|GiB|seconds|tokens/s" /tmp/test_cuda_long.log | head -40 > $O/test_cuda_long_summary.txt
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
[ -n "$ncu" ] && [ $(left) -gt 40 ] && timeout $(left) $ncu --clock-control none --kernel-name-base demangled --kernel-name regex:'kda3_state_bwd_k|kda_tile_bwd_k' --launch-count 2 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  /tmp/b/new/mtrl bench ops --device cuda --only kda --kda-T 65536 > $O/ncu_kda_bwd.txt 2>&1
date -u +%FT%TZ >> $O/gpu.txt
