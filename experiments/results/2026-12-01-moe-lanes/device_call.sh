#!/usr/bin/env bash
# device call 3 (2026-12-01, one H200): the MoE experts on 4 GEMM lanes (streams) against 1 lane;
# torch._grouped_mm in the same call; gpu tests; 64K step with 4 lanes and with 1.
set -u
START=$(date +%s); left() { echo $(( 570 - ($(date +%s) - START) )); }
O=${OUT:-/tmp/out}; mkdir -p $O /tmp/b
tar -xJf .carry/bins.tar.xz -C /tmp/b
export LD_LIBRARY_PATH=/tmp/b/lib
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > $O/gpu.txt
date -u +%FT%TZ >> $O/gpu.txt
run_test() { local t=$1 s=$2; local t0=$(date +%s); timeout $s /tmp/b/new/$t > /tmp/$t.log 2>&1; local rc=$?
  echo "$t: exit $rc in $(( $(date +%s) - t0 )) s | $(tail -n 1 /tmp/$t.log)"; grep -h FAIL /tmp/$t.log | head -20; }
{ run_test test_cuda_moe 120; run_test test_cuda_model 120; } > $O/tests.txt 2>&1
PYTHONUNBUFFERED=1 timeout 120 python3 .carry/anchors_gpu.py --skip ceil,kda,attn --json $O/anchors.json 2>&1 | grep -v "Warning\|warn(" > $O/anchors.txt
A=(); [ -s $O/anchors.json ] && A=(--anchors $O/anchors.json)
timeout 150 /tmp/b/new/mtrl bench ops --device cuda --only moe "${A[@]}" > $O/bench_moe.txt 2>&1
for L in 4 1; do
  MTRL_MOE_LANES=$L timeout 100 /tmp/b/new/mtrl bench model --device cuda --preset small --tokens 65536 --seqs 1 --reps 2 --profile > $O/small64k_lanes$L.txt 2>&1
done
run_test test_cuda_long $(( $(left) - 5 )) >> $O/tests.txt 2>&1
grep -E "^\s+\(|rel|GiB|seconds|tokens/s" /tmp/test_cuda_long.log | head -40 > $O/test_cuda_long_summary.txt
date -u +%FT%TZ >> $O/gpu.txt
