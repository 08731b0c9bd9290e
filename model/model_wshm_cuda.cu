// model_wshm_cuda.cu: the CUDA pieces of the device weight channel (model_wshm_cuda.h).
#include <stdio.h>
#include <string.h>

#include "model/model_wshm_cuda.h"
#include "kernels/cuda/cuda_common.cuh"

#define MW_T 256
#define MW_BLOCKS_PER_ITEM 64

// One launch for the whole slot: blockIdx.y picks the item, the x blocks stride over it.
// Large items (the expert matrices) get 64 blocks each, enough to stream at full bandwidth with
// hundreds of items in flight; small ones finish in one pass.
__global__ void mw_pack_k(const mtrl_wshm_item *items, const float *params, const float *beta, char *slot) {
    mtrl_wshm_item it = items[blockIdx.y];
    const float *src = (const float *)((it.kind == MTRL_WSHM_ITEM_BETA ? (const char *)beta : (const char *)params) + it.src);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < it.n; i += (size_t)gridDim.x * blockDim.x) {
        if (it.kind == MTRL_WSHM_ITEM_BF16) ((__nv_bfloat16 *)(slot + it.dst))[i] = __float2bfloat16_rn(src[i]);
        else ((float *)(slot + it.dst))[i] = src[i];
    }
}

__global__ void mw_unpack_k(const mtrl_wshm_item *items, const char *slot, float *params, float *beta, char *w16) {
    mtrl_wshm_item it = items[blockIdx.y];
    if (it.kind & MTRL_WSHM_ITEM_TO_BF16) { // a bf16-resident weight: the slot's bf16 bits as they are
        __nv_bfloat16 *dst = (__nv_bfloat16 *)(w16 + it.src);
        int b16 = (it.kind & ~MTRL_WSHM_ITEM_TO_BF16) == MTRL_WSHM_ITEM_BF16;
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < it.n; i += (size_t)gridDim.x * blockDim.x)
            dst[i] = b16 ? ((const __nv_bfloat16 *)(slot + it.dst))[i]
                         : __float2bfloat16_rn(((const float *)(slot + it.dst))[i]);
        return;
    }
    float *dst = (float *)((it.kind == MTRL_WSHM_ITEM_BETA ? (char *)beta : (char *)params) + it.src);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < it.n; i += (size_t)gridDim.x * blockDim.x) {
        if (it.kind == MTRL_WSHM_ITEM_BF16) dst[i] = __bfloat162float(((const __nv_bfloat16 *)(slot + it.dst))[i]);
        else dst[i] = ((const float *)(slot + it.dst))[i];
    }
}

extern "C" void mtrl_mw_pack(mtrl_cuda_ctx *c, const mtrl_wshm_item *items, int n, const float *params,
                             const float *beta, void *slot) {
    if (n <= 0) return;
    mw_pack_k<<<dim3(MW_BLOCKS_PER_ITEM, (unsigned)n), MW_T, 0, c->stream>>>(items, params, beta, (char *)slot);
    CUDA_LAUNCH_CHECK();
}

extern "C" void mtrl_mw_unpack(mtrl_cuda_ctx *c, const mtrl_wshm_item *items, int n, const void *slot, float *params,
                               float *beta, void *w16) {
    if (n <= 0) return;
    mw_unpack_k<<<dim3(MW_BLOCKS_PER_ITEM, (unsigned)n), MW_T, 0, c->stream>>>(items, (const char *)slot, params, beta,
                                                                              (char *)w16);
    CUDA_LAUNCH_CHECK();
}

extern "C" void mtrl_mw_ipc_get(const void *p, void *handle) {
    cudaIpcMemHandle_t h;
    static_assert(sizeof h == MTRL_WSHM_IPC_BYTES, "cudaIpcMemHandle_t is 64 bytes");
    CUDA_CHECK(cudaIpcGetMemHandle(&h, (void *)p));
    memcpy(handle, &h, sizeof h);
}

extern "C" void *mtrl_mw_ipc_open(const void *handle, int device, char *why, size_t cap) {
    cudaIpcMemHandle_t h;
    memcpy(&h, handle, sizeof h);
    CUDA_CHECK(cudaSetDevice(device));
    void *p = NULL;
    cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
        cudaGetLastError(); // not sticky: clear it for the calls that follow
        snprintf(why, cap, "cudaIpcOpenMemHandle on GPU %d: %s (%s)", device, cudaGetErrorName(e), cudaGetErrorString(e));
        return NULL;
    }
    return p;
}

extern "C" void mtrl_mw_ipc_close(void *p) {
    if (p) CUDA_CHECK(cudaIpcCloseMemHandle(p));
}

extern "C" void mtrl_mw_host_func(mtrl_cuda_ctx *c, void (*fn)(void *), void *user) {
    CUDA_CHECK(cudaLaunchHostFunc(c->stream, fn, user));
}

extern "C" void mtrl_mw_event_record(mtrl_cuda_ctx *c, void **ev) {
    if (!*ev) {
        cudaEvent_t e;
        CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        *ev = (void *)e;
    }
    CUDA_CHECK(cudaEventRecord((cudaEvent_t)*ev, c->stream));
}

extern "C" void mtrl_mw_event_wait(void *ev) {
    if (ev) CUDA_CHECK(cudaEventSynchronize((cudaEvent_t)ev));
}

extern "C" void mtrl_mw_event_free(void *ev) {
    if (ev) CUDA_CHECK(cudaEventDestroy((cudaEvent_t)ev));
}

extern "C" void *mtrl_mw_host_alloc(size_t bytes) {
    void *p = NULL;
    CUDA_CHECK(cudaMallocHost(&p, bytes ? bytes : 1));
    return p;
}

extern "C" void mtrl_mw_host_free(void *p) {
    if (p) CUDA_CHECK(cudaFreeHost(p));
}
