#!/usr/bin/env bash
# device call 1 (session 2026-12-01 02:30 UTC, one H200): every gpu test on the final tree (cad17f8),
# then `mtrl bench ops --device cuda` (every section), then fla's KDA anchors in the same call.
set -u
START=$(date +%s); left() { echo $(( 575 - ($(date +%s) - START) )); }
O=${OUT:-/tmp/out}; mkdir -p $O /tmp/b
tar -xJf .carry/bins.tar.xz -C /tmp/b
export LD_LIBRARY_PATH=/tmp/b/lib
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > $O/gpu.txt
date -u +%FT%TZ >> $O/gpu.txt
run_test() { local t=$1 s=$2; local t0=$(date +%s); timeout $s /tmp/b/new/$t > $O/$t.log 2>&1; local rc=$?
  echo "$t: exit $rc in $(( $(date +%s) - t0 )) s | $(tail -n 1 $O/$t.log)"; grep -h FAIL $O/$t.log | head -20; }
{ for t in test_cuda_gemm test_cuda_ops test_cuda_mla test_cuda_moe test_cuda_kda test_cuda_model; do run_test $t 120; done
  run_test test_cuda_long 100; } > $O/tests.txt 2>&1
for f in $O/test_cuda_*.log; do [ $(stat -c %s $f) -gt 200000 ] && { tail -c 200000 $f > $f.t; mv $f.t $f; }; done
date -u +%FT%TZ >> $O/gpu.txt
timeout $(( $(left) - 150 )) /tmp/b/new/mtrl bench ops --device cuda > $O/bench_ops.txt 2>&1; echo "bench ops exit $?" >> $O/bench_ops.txt
date -u +%FT%TZ >> $O/gpu.txt
FLA_PATH=.fla PYTHONUNBUFFERED=1 timeout $(( $(left) )) python3 .carry/anchors_gpu.py --skip attn,moe --kda-T 8192,65536,262144 --json $O/anchors.json > $O/anchors.txt 2>&1; echo "anchors exit $?" >> $O/anchors.txt
date -u +%FT%TZ >> $O/gpu.txt
