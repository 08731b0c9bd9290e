#!/usr/bin/env bash
# device call 6 (2026-12-01, one H200): every gpu test on 633744e, then the MLA decode with the
# copy ceiling measured in the same run (twice).
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
grep -h "decode" /tmp/test_cuda_mla.log > $O/test_cuda_mla_decode.txt
S=1x8192,1x1048576,8x131072,64x32768,16x524288
for r in 1 2; do timeout 100 /tmp/b/new/mtrl bench ops --device cuda --only copy,decode --decode-shapes $S > $O/bench_decode_$r.txt 2>&1; done
date -u +%FT%TZ >> $O/gpu.txt
