#!/usr/bin/env bash
# device call 5 (2026-12-01, one H200): the MLA decode with one absorption kernel, the merge
# fused with W_UV and programmatic dependent launches (new) against cad17f8 (old), same call.
set -u
O=${OUT:-/tmp/out}; mkdir -p $O /tmp/b
tar -xJf .carry/bins.tar.xz -C /tmp/b
export LD_LIBRARY_PATH=/tmp/b/lib
date -u +%FT%TZ > $O/gpu.txt
run_test() { local t=$1 s=$2; local t0=$(date +%s); timeout $s /tmp/b/new/$t > /tmp/$t.log 2>&1; local rc=$?
  echo "$t: exit $rc in $(( $(date +%s) - t0 )) s | $(tail -n 1 /tmp/$t.log)"; grep -h FAIL /tmp/$t.log | head -20; }
{ run_test test_cuda_mla 120; run_test test_cuda_model 120; run_test test_cuda_kda 120; } > $O/tests.txt 2>&1
grep -h "decode" /tmp/test_cuda_mla.log | head -60 > $O/test_cuda_mla_decode.txt
S=1x8192,1x1048576,8x131072,64x32768,16x524288
for r in 1 2; do for v in old new; do
  timeout 100 /tmp/b/$v/mtrl bench ops --device cuda --only decode --decode-shapes $S > $O/bench_${v}_$r.txt 2>&1
done; done
for s in 1x1048576 8x131072 64x32768; do
  timeout 60 ncu --metrics gpu__time_duration.sum --csv --cache-control none --clock-control none \
    --launch-count 300 /tmp/b/new/mtrl bench ops --device cuda --only decode --decode-shapes $s > $O/ncu_$s.csv 2> /dev/null
done
run_test test_cuda_long 100 >> $O/tests.txt 2>&1
date -u +%FT%TZ >> $O/gpu.txt
