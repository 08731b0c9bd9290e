#!/usr/bin/env bash
# device call 9 (2026-12-01, one H200): every gpu test on 83c5e7a, then the KDA forward at 8K with
# the committed rule (4 pieces) beside one piece.
set -u
O=${OUT:-/tmp/out}; mkdir -p $O /tmp/b
tar -xJf .carry/bins.tar.xz -C /tmp/b
export LD_LIBRARY_PATH=/tmp/b/lib
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > $O/gpu.txt
date -u +%FT%TZ >> $O/gpu.txt
run_test() { local t=$1 s=$2; local t0=$(date +%s); timeout $s /tmp/b/new/$t > /tmp/$t.log 2>&1; local rc=$?
  echo "$t: exit $rc in $(( $(date +%s) - t0 )) s | $(tail -n 1 /tmp/$t.log)"; grep -h FAIL /tmp/$t.log | head -20; }
{ for t in test_cuda_gemm test_cuda_ops test_cuda_mla test_cuda_moe test_cuda_kda test_cuda_model; do run_test $t 120; done
  run_test test_cuda_long 100; } > $O/tests.txt 2>&1
timeout 40 /tmp/b/new/mtrl bench ops --device cuda --only kda --kda-T 8192 --kda-fwd-only > $O/bench_kda_8k.txt 2>&1
date -u +%FT%TZ >> $O/gpu.txt
