#!/usr/bin/env bash
# device call 7 (2026-12-01, one H200): the KDA forward in pieces (prep of later pieces on a second
# stream beside the state pass); gpu tests; bench kda (pieces 1 / 4 / default rows in the same
# run), H = 8; the 64K small step; fla's anchors in the same call.
set -u
START=$(date +%s); left() { echo $(( 570 - ($(date +%s) - START) )); }
O=${OUT:-/tmp/out}; mkdir -p $O /tmp/b
tar -xJf .carry/bins.tar.xz -C /tmp/b
export LD_LIBRARY_PATH=/tmp/b/lib
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > $O/gpu.txt
date -u +%FT%TZ >> $O/gpu.txt
run_test() { local t=$1 s=$2; local t0=$(date +%s); timeout $s /tmp/b/new/$t > /tmp/$t.log 2>&1; local rc=$?
  echo "$t: exit $rc in $(( $(date +%s) - t0 )) s | $(tail -n 1 /tmp/$t.log)"; grep -h FAIL /tmp/$t.log | head -20; }
{ run_test test_cuda_kda 120; run_test test_cuda_model 120; } > $O/tests.txt 2>&1
grep -h "PIECES" /tmp/test_cuda_kda.log | head -4 >> $O/tests.txt
timeout 150 /tmp/b/new/mtrl bench ops --device cuda --only kda --kda-T 8192,65536,262144 > $O/bench_kda_h16.txt 2>&1
timeout 60 /tmp/b/new/mtrl bench ops --device cuda --only kda --kda-T 65536 --heads 8 > $O/bench_kda_h8.txt 2>&1
timeout 90 /tmp/b/new/mtrl bench model --device cuda --preset small --tokens 65536 --seqs 1 --reps 2 --profile > $O/small64k.txt 2>&1
MTRL_KDA_FWD_PIECES=1 timeout 80 /tmp/b/new/mtrl bench model --device cuda --preset small --tokens 65536 --seqs 1 --reps 2 > $O/small64k_pieces1.txt 2>&1
date -u +%FT%TZ >> $O/gpu.txt
FLA_PATH=.fla PYTHONUNBUFFERED=1 timeout 100 python3 .carry/anchors_gpu.py --skip attn,moe,ceil --kda-T 8192,65536,262144 --json $O/anchors.json > $O/anchors.txt 2>&1
date -u +%FT%TZ >> $O/gpu.txt
run_test test_cuda_long $(( $(left) - 5 )) >> $O/tests.txt 2>&1
date -u +%FT%TZ >> $O/gpu.txt
