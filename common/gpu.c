// gpu.c: device discovery (see gpu.h). Every CUDA call goes through CUDA_CHECK, except the
// first query, whose failure means "no usable device" rather than a bug.
#include "common/gpu.h"

#include <stdio.h>

#ifdef MTRL_HAVE_CUDA
#include "common/check_cuda.h"

int mtrl_gpu_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); // clear the sticky "no driver" error
        return 0;
    }
    return n;
}

void mtrl_gpu_describe(int i, char *buf, size_t cap) {
    if (i >= mtrl_gpu_count()) {
        snprintf(buf, cap, "no CUDA device %d", i);
        return;
    }
    struct cudaDeviceProp p;
    CUDA_CHECK(cudaGetDeviceProperties(&p, i));
    snprintf(buf, cap, "%s, %.1f GiB, sm_%d%d, %d SMs", p.name, p.totalGlobalMem / 1073741824.0, p.major, p.minor,
             p.multiProcessorCount);
}
#else
int mtrl_gpu_count(void) { return 0; }
void mtrl_gpu_describe(int i, char *buf, size_t cap) { snprintf(buf, cap, "no CUDA device %d: built without CUDA", i); }
#endif
