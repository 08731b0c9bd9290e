#!/usr/bin/env bash
# device call 8 (2026-12-01, one H200): the KDA bench (forward in pieces) and fla's anchors in the
# same call (the anchors with their ceilings: the two runs that skipped them died after 8K).
set -u
O=${OUT:-/tmp/out}; mkdir -p $O /tmp/b
tar -xJf .carry/bins.tar.xz -C /tmp/b
export LD_LIBRARY_PATH=/tmp/b/lib
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > $O/gpu.txt
date -u +%FT%TZ >> $O/gpu.txt
timeout 150 /tmp/b/new/mtrl bench ops --device cuda --only kda --kda-T 8192,65536,262144 > $O/bench_kda_h16.txt 2>&1
date -u +%FT%TZ >> $O/gpu.txt
FLA_PATH=.fla PYTHONUNBUFFERED=1 timeout 150 python3 .carry/anchors_gpu.py --skip attn,moe --kda-T 8192,65536,262144 --json $O/anchors.json > $O/anchors.txt 2>&1; echo "anchors exit $?" >> $O/anchors.txt
date -u +%FT%TZ >> $O/gpu.txt
