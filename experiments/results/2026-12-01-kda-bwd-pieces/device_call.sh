#!/usr/bin/env bash
# device call 6 (2026-12-01, one H200): KDA backward pass 2 in pieces, each piece's pass 3 on a
# second stream (default at H <= 8) against one piece (MTRL_KDA_BWD_PIECES=1); gpu tests; 64K step.
set -u
START=$(date +%s); left() { echo $(( 570 - ($(date +%s) - START) )); }
O=${OUT:-/tmp/out}; mkdir -p $O /tmp/b
tar -xJf .carry/bins.tar.xz -C /tmp/b
export LD_LIBRARY_PATH=/tmp/b/lib
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > $O/gpu.txt
date -u +%FT%TZ >> $O/gpu.txt
run_test() { local t=$1 s=$2; local t0=$(date +%s); timeout $s /tmp/b/new/$t > /tmp/$t.log 2>&1; local rc=$?
  echo "$t: exit $rc in $(( $(date +%s) - t0 )) s | $(tail -n 1 /tmp/$t.log)"; grep -h FAIL /tmp/$t.log | head -20; }
{ run_test test_cuda_kda 150; run_test test_cuda_model 120; run_test test_cuda_moe 60; } > $O/tests.txt 2>&1
grep -E "pieces" /tmp/test_cuda_kda.log | head -12 >> $O/tests.txt
for P in default 1; do
  if [ $P = default ]; then unset MTRL_KDA_BWD_PIECES; else export MTRL_KDA_BWD_PIECES=$P; fi
  timeout 100 /tmp/b/new/mtrl bench model --device cuda --preset small --tokens 65536 --seqs 1 --reps 2 --profile > $O/small64k_pieces_$P.txt 2>&1
  timeout 60 /tmp/b/new/mtrl bench ops --device cuda --only kda --kda-T 65536 --heads 8 > $O/bench_kda_h8_pieces_$P.txt 2>&1
done
unset MTRL_KDA_BWD_PIECES
timeout 60 /tmp/b/new/mtrl bench ops --device cuda --only kda --kda-T 8192,65536,262144 > $O/bench_kda_h16.txt 2>&1
run_test test_cuda_long $(( $(left) - 5 )) >> $O/tests.txt 2>&1
grep -E "^\s+\(|rel|GiB|seconds|tokens/s" /tmp/test_cuda_long.log | head -40 > $O/test_cuda_long_summary.txt
date -u +%FT%TZ >> $O/gpu.txt
