#!/usr/bin/env bash
# device call 7 (2026-12-01, one H200): KDA backward pass 3 with its A fragments split once a
# block (split_a16); gpu tests; KDA bench at H = 16 and 8; the 64K step.
set -u
START=$(date +%s); left() { echo $(( 570 - ($(date +%s) - START) )); }
O=${OUT:-/tmp/out}; mkdir -p $O /tmp/b
tar -xJf .carry/bins.tar.xz -C /tmp/b
export LD_LIBRARY_PATH=/tmp/b/lib
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > $O/gpu.txt
date -u +%FT%TZ >> $O/gpu.txt
run_test() { local t=$1 s=$2; local t0=$(date +%s); timeout $s /tmp/b/new/$t > /tmp/$t.log 2>&1; local rc=$?
  echo "$t: exit $rc in $(( $(date +%s) - t0 )) s | $(tail -n 1 /tmp/$t.log)"; grep -h FAIL /tmp/$t.log | head -20; }
{ run_test test_cuda_kda 150; run_test test_cuda_model 120; } > $O/tests.txt 2>&1
grep -E "pieces|256 threads" /tmp/test_cuda_kda.log | head -6 >> $O/tests.txt
timeout 110 /tmp/b/new/mtrl bench ops --device cuda --only kda --kda-T 8192,65536,262144 > $O/bench_kda_h16.txt 2>&1
timeout 60 /tmp/b/new/mtrl bench ops --device cuda --only kda --kda-T 65536 --heads 8 > $O/bench_kda_h8.txt 2>&1
timeout 100 /tmp/b/new/mtrl bench model --device cuda --preset small --tokens 65536 --seqs 1 --reps 2 --profile > $O/small64k.txt 2>&1
run_test test_cuda_long $(( $(left) - 5 )) >> $O/tests.txt 2>&1
grep -E "^\s+\(|rel|GiB|seconds|tokens/s" /tmp/test_cuda_long.log | head -40 > $O/test_cuda_long_summary.txt
date -u +%FT%TZ >> $O/gpu.txt
