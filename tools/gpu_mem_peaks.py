#!/usr/bin/env python3
"""gpu_mem_peaks.py CSV: each process's peak GPU memory from the samples of
`nvidia-smi --query-compute-apps=timestamp,pid,process_name,used_memory --format=csv,noheader -l N`
(the device scripts tools/gpu_run.sh and tools/gpu_issue23.sh take them every 2 s)."""
import collections
import sys

peak = collections.defaultdict(int)
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    if len(f) == 4 and f[3].endswith("MiB"):
        k = f[1] + " " + f[2]
        peak[k] = max(peak[k], int(f[3].split()[0]))
for k, v in sorted(peak.items()):
    print("GPU memory peak: pid %s: %.2f GiB" % (k, v / 1024))
