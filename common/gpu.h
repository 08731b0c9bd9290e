// gpu.h: what the host code needs to know about GPUs, in C, in every build.
#ifndef MTRL_GPU_H
#define MTRL_GPU_H

#include <stddef.h>

// Number of CUDA devices this process can use; 0 in a CPU-only build or without a driver.
int mtrl_gpu_count(void);
// "NVIDIA H200, 139.8 GiB, sm_90" for device i, or a reason ("no CUDA device").
void mtrl_gpu_describe(int i, char *buf, size_t cap);

#endif
