#!/usr/bin/env bash
# device call 2 (2026-12-01, one H200): per-kernel GPU time of the MLA absorbed decode (cad17f8),
# Nsight Compute gpu__time_duration with caches and clocks left as they are.
set -u
O=${OUT:-/tmp/out}; mkdir -p $O /tmp/b
tar -xJf .carry/bins.tar.xz -C /tmp/b
export LD_LIBRARY_PATH=/tmp/b/lib
date -u +%FT%TZ > $O/gpu.txt
for s in 1x8192 1x1048576 8x131072 64x32768; do
  timeout 100 ncu --metrics gpu__time_duration.sum --csv --cache-control none --clock-control none \
    --launch-count 400 /tmp/b/new/mtrl bench ops --device cuda --only decode --decode-shapes $s > $O/ncu_$s.csv 2> $O/ncu_$s.err
  timeout 60 /tmp/b/new/mtrl bench ops --device cuda --only decode --decode-shapes $s > $O/bench_$s.txt 2>&1
done
date -u +%FT%TZ >> $O/gpu.txt
