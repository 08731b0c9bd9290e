#!/usr/bin/env bash
# device call 2 (2026-12-01, one H200): KDA backward pass 3 with 512 threads, prefetched chunks, K = V = 128
# folded (new) against 2f0d8cf (old); fla's anchors in the same call; gpu tests; 64K step.
set -u
START=$(date +%s); left() { echo $(( 570 - ($(date +%s) - START) )); }
O=${OUT:-/tmp/out}; mkdir -p $O /tmp/b
tar -xJf .carry/bins.tar.xz -C /tmp/b
export LD_LIBRARY_PATH=/tmp/b/lib
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > $O/gpu.txt
date -u +%FT%TZ >> $O/gpu.txt
run_test() { local t=$1 s=$2; local t0=$(date +%s); timeout $s /tmp/b/new/$t > /tmp/$t.log 2>&1; local rc=$?
  echo "$t: exit $rc in $(( $(date +%s) - t0 )) s | $(tail -n 1 /tmp/$t.log)"; grep -h FAIL /tmp/$t.log | head -20; }
run_test test_cuda_kda 200 > $O/tests.txt 2>&1
grep -E "tile TC" /tmp/test_cuda_kda.log | grep -E "K = 128|128" | head -20 >> $O/tests.txt
FLA_PATH=.fla PYTHONUNBUFFERED=1 timeout 200 python3 .carry/anchors_gpu.py --skip ceil,attn,moe \
    --kda-T 8192,65536,262144 --json $O/anchors.json 2>&1 | grep -v "Warning\|warn(" > $O/anchors.txt
A=(); [ -s $O/anchors.json ] && A=(--anchors $O/anchors.json)
{
for v in old new; do echo "== $v"; timeout 120 /tmp/b/$v/mtrl bench ops --device cuda --only kda --kda-T 8192,65536,262144 "${A[@]}"; done
echo "== new MTRL_KDA_TILE_THREADS=256"; MTRL_KDA_TILE_THREADS=256 timeout 60 /tmp/b/new/mtrl bench ops --device cuda --only kda --kda-T 65536 "${A[@]}"
} > $O/bench_kda.txt 2>&1
timeout $(( $(left) - 60 )) /tmp/b/new/mtrl bench model --device cuda --preset small --tokens 65536 --seqs 1 --reps 2 --profile > $O/small64k_new.txt 2>&1
run_test test_cuda_model $(( $(left) )) >> $O/tests.txt 2>&1
date -u +%FT%TZ >> $O/gpu.txt
