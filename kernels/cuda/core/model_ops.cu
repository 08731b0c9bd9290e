// core/model_ops.cu: the small kernels of the backbone's CUDA backend (core/model_ops.h): elementwise
// ops between the kernels of kernels/cuda, the embedding, pointer-array gathers, Σ x².
#include <math.h>
#include <string.h>

#include "kernels/cuda/core/model_ops.h"
#include "kernels/cuda/cuda_common.cuh"

#define MC_T 256

// The host-side calls a graph recording cannot contain (kernels_cuda.h, CUDA graphs): they fail
// the recording and run `skip` instead.
#define MTRL_CUDA_CHECK_NOT_RECORDING_(c, skip) \
    do {                                       \
        if ((c)->capturing) {                  \
            (c)->capture_bad = 1;              \
            skip;                              \
        }                                      \
    } while (0)

static unsigned grid_(size_t n) {
    size_t b = (n + MC_T - 1) / MC_T;
    return (unsigned)(b < 65536 ? (b ? b : 1) : 65536);
}
#define FOR_I(n) for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n); i += (size_t)gridDim.x * blockDim.x)

// ---- memory ---------------------------------------------------------------------------------------

extern "C" void *mtrl_mc_malloc(size_t bytes) {
    void *p = NULL;
    CUDA_CHECK(cudaMalloc(&p, bytes ? bytes : 1));
    return p;
}
extern "C" void mtrl_mc_free(mtrl_cuda_ctx *c, void *p) {
    if (!p) return;
    MTRL_CUDA_CHECK_NOT_RECORDING_(c, return);
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    CUDA_CHECK(cudaFree(p));
}
extern "C" void mtrl_mc_zero(mtrl_cuda_ctx *c, void *p, size_t bytes) {
    if (bytes) CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, c->stream));
}
extern "C" void mtrl_mc_copy(mtrl_cuda_ctx *c, void *dst, const void *src, size_t bytes) {
    if (bytes && dst != src) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->stream));
}
extern "C" void mtrl_mc_upload(mtrl_cuda_ctx *c, void *dst, const void *src, size_t bytes) {
    // From pageable memory the copy is staged before the call returns: src may be reused. A
    // recorded copy would read src again at every replay: not while recording.
    MTRL_CUDA_CHECK_NOT_RECORDING_(c, return);
    if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream));
}
extern "C" void mtrl_mc_download(mtrl_cuda_ctx *c, void *dst, const void *src, size_t bytes) {
    MTRL_CUDA_CHECK_NOT_RECORDING_(c, memset(dst, 0, bytes); return);
    if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream));
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
}
extern "C" void mtrl_mc_copy_rows(mtrl_cuda_ctx *c, int rows, int n, const float *src, int lds, float *dst,
                                  int ldd) {
    if (rows <= 0 || n <= 0) return;
    CUDA_CHECK(cudaMemcpy2DAsync(dst, sizeof(float) * (size_t)ldd, src, sizeof(float) * (size_t)lds,
                                 sizeof(float) * (size_t)n, (size_t)rows, cudaMemcpyDeviceToDevice, c->stream));
}

extern "C" void mtrl_mc_mem_info(mtrl_cuda_ctx *c, size_t *free_h, size_t *total_h) {
    int cur = 0;
    CUDA_CHECK(cudaGetDevice(&cur));
    if (cur != c->device) CUDA_CHECK(cudaSetDevice(c->device));
    size_t fr = 0, tot = 0;
    CUDA_CHECK(cudaMemGetInfo(&fr, &tot));
    if (cur != c->device) CUDA_CHECK(cudaSetDevice(cur));
    *free_h = fr;
    *total_h = tot;
}
extern "C" size_t mtrl_mc_ctx_scratch_bytes(const mtrl_cuda_ctx *c) { return c->scratch ? c->scratch_bytes : 0; }

__global__ void mc_gather_k(size_t n, const float *const *ptrs, float *dst) {
    const float *s = ptrs[blockIdx.y];
    float *d = dst + (size_t)blockIdx.y * n;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        d[i] = s[i];
}
__global__ void mc_scatter_k(size_t n, const float *src, float *const *ptrs) {
    float *d = ptrs[blockIdx.y];
    const float *s = src + (size_t)blockIdx.y * n;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        d[i] = s[i];
}
static dim3 rows_grid_(int B, size_t n) {
    size_t b = (n + MC_T - 1) / MC_T;
    return dim3((unsigned)(b < 1024 ? (b ? b : 1) : 1024), (unsigned)B);
}
extern "C" void mtrl_mc_gather(mtrl_cuda_ctx *c, int B, size_t n, const float *const *ptrs, float *dst) {
    if (B <= 0 || !n) return;
    mc_gather_k<<<rows_grid_(B, n), MC_T, 0, c->stream>>>(n, ptrs, dst);
    CUDA_LAUNCH_CHECK();
}
extern "C" void mtrl_mc_scatter(mtrl_cuda_ctx *c, int B, size_t n, const float *src, float *const *ptrs) {
    if (B <= 0 || !n) return;
    mc_scatter_k<<<rows_grid_(B, n), MC_T, 0, c->stream>>>(n, src, ptrs);
    CUDA_LAUNCH_CHECK();
}

// One thread per element of the B x rows x n block; blockIdx.y picks the destination pointer.
template <typename T>
__device__ __forceinline__ T latent_of_(float x);
template <>
__device__ __forceinline__ float latent_of_<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 latent_of_<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename T>
__global__ void mc_latent_put_k(int rows, int n, const float *src, int lds, void *const *ptrs, int ldd) {
    T *d = (T *)ptrs[blockIdx.y];
    const float *s = src + (size_t)blockIdx.y * rows * lds;
    size_t m = (size_t)rows * n;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < m; i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / (size_t)n, j = i % (size_t)n;
        d[r * ldd + j] = latent_of_<T>(s[r * lds + j]);
    }
}
extern "C" void mtrl_mc_latent_put(mtrl_cuda_ctx *c, int B, int rows, int n, const float *src, int lds,
                                   void *const *ptrs, int ldd, int type) {
    if (B <= 0 || rows <= 0 || n <= 0) return;
    dim3 g = rows_grid_(B, (size_t)rows * n);
    if (type == MTRL_BF16) mc_latent_put_k<__nv_bfloat16><<<g, MC_T, 0, c->stream>>>(rows, n, src, lds, ptrs, ldd);
    else mc_latent_put_k<float><<<g, MC_T, 0, c->stream>>>(rows, n, src, lds, ptrs, ldd);
    CUDA_LAUNCH_CHECK();
}

template <typename T>
__global__ void mc_latent_get_k(int rows, int n, const T *src, int lds, float *dst, int ldd) {
    size_t m = (size_t)rows * n;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < m; i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / (size_t)n, j = i % (size_t)n;
        dst[r * ldd + j] = (float)src[r * lds + j];
    }
}
extern "C" void mtrl_mc_latent_get(mtrl_cuda_ctx *c, int rows, int n, const void *src, int lds, float *dst,
                                   int ldd, int type) {
    if (rows <= 0 || n <= 0) return;
    size_t m = (size_t)rows * n;
    if (type == MTRL_BF16)
        mc_latent_get_k<<<grid_(m), MC_T, 0, c->stream>>>(rows, n, (const __nv_bfloat16 *)src, lds, dst, ldd);
    else mc_latent_get_k<<<grid_(m), MC_T, 0, c->stream>>>(rows, n, (const float *)src, lds, dst, ldd);
    CUDA_LAUNCH_CHECK();
}

// One thread per element of the rows x n block; row r's source is ptrs[r] (rows of different caches).
template <typename T>
__global__ void mc_latent_gather_k(int rows, int n, const void *const *ptrs, float *dst, int ldd) {
    size_t m = (size_t)rows * n;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < m; i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / (size_t)n, j = i % (size_t)n;
        dst[r * ldd + j] = (float)((const T *)ptrs[r])[j];
    }
}
extern "C" void mtrl_mc_latent_gather(mtrl_cuda_ctx *c, int rows, int n, const void *const *ptrs, float *dst,
                                      int ldd, int type) {
    if (rows <= 0 || n <= 0) return;
    size_t m = (size_t)rows * n;
    if (type == MTRL_BF16) mc_latent_gather_k<__nv_bfloat16><<<grid_(m), MC_T, 0, c->stream>>>(rows, n, ptrs, dst, ldd);
    else mc_latent_gather_k<float><<<grid_(m), MC_T, 0, c->stream>>>(rows, n, ptrs, dst, ldd);
    CUDA_LAUNCH_CHECK();
}

// One thread per (row, column): the H heads summed in order (deterministic).
__global__ void mc_sum_heads_k(int N, int H, int n, const float *src, int lds, int hs, float *dst, int ldd) {
    size_t m = (size_t)N * n;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < m; i += (size_t)gridDim.x * blockDim.x) {
        size_t t = i / (size_t)n, j = i % (size_t)n;
        const float *s = src + t * lds + j;
        float acc = dst[t * ldd + j];
        for (int h = 0; h < H; h++) acc += s[(size_t)h * hs];
        dst[t * ldd + j] = acc;
    }
}
extern "C" void mtrl_mc_sum_heads(mtrl_cuda_ctx *c, int N, int H, int n, const float *src, int lds, int hs,
                                  float *dst, int ldd) {
    if (N <= 0 || n <= 0) return;
    mc_sum_heads_k<<<grid_((size_t)N * n), MC_T, 0, c->stream>>>(N, H, n, src, lds, hs, dst, ldd);
    CUDA_LAUNCH_CHECK();
}

// ---- elementwise (sigmoid_acc: expf, as the kernels compared closely with the oracle) -------------

__global__ void mc_sigmoid_k(size_t n, const float *x, float *y) { FOR_I(n) y[i] = sigmoid_acc(x[i]); }
__global__ void mc_sigmoid_mul_k(size_t n, const float *x, const float *a, float *y) {
    FOR_I(n) y[i] = sigmoid_acc(x[i]) * a[i];
}
__global__ void mc_sigmoid_mul_bwd_k(size_t n, const float *x, const float *a, const float *dy, float *da,
                                     float *dx) {
    FOR_I(n) {
        float s = sigmoid_acc(x[i]), g = dy[i];
        da[i] = g * s;
        dx[i] = g * a[i] * s * (1.f - s);
    }
}
__global__ void mc_dsigmoid_k(size_t n, const float *s, float *dy) { FOR_I(n) dy[i] *= s[i] * (1.f - s[i]); }
__global__ void mc_add_k(size_t n, const float *a, const float *b, float *y) {
    FOR_I(n) y[i] = (a ? a[i] : 0.f) + b[i];
}
__global__ void mc_scale_k(size_t n, float *x, float s) { FOR_I(n) x[i] *= s; }

#define LAUNCH_EW(kernel, n, ...)                                                  \
    do {                                                                           \
        if (!(n)) return;                                                          \
        kernel<<<grid_(n), MC_T, 0, c->stream>>>((n), __VA_ARGS__);                \
        CUDA_LAUNCH_CHECK();                                                       \
    } while (0)

extern "C" void mtrl_mc_sigmoid(mtrl_cuda_ctx *c, size_t n, const float *x, float *y) { LAUNCH_EW(mc_sigmoid_k, n, x, y); }
extern "C" void mtrl_mc_sigmoid_mul(mtrl_cuda_ctx *c, size_t n, const float *x, const float *a, float *y) {
    LAUNCH_EW(mc_sigmoid_mul_k, n, x, a, y);
}
extern "C" void mtrl_mc_sigmoid_mul_bwd(mtrl_cuda_ctx *c, size_t n, const float *x, const float *a, const float *dy,
                                        float *da, float *dx) {
    LAUNCH_EW(mc_sigmoid_mul_bwd_k, n, x, a, dy, da, dx);
}
extern "C" void mtrl_mc_dsigmoid(mtrl_cuda_ctx *c, size_t n, const float *s, float *dy) { LAUNCH_EW(mc_dsigmoid_k, n, s, dy); }
extern "C" void mtrl_mc_add(mtrl_cuda_ctx *c, size_t n, const float *a, const float *b, float *y) {
    LAUNCH_EW(mc_add_k, n, a, b, y);
}
extern "C" void mtrl_mc_scale(mtrl_cuda_ctx *c, size_t n, float *x, float s) { LAUNCH_EW(mc_scale_k, n, x, s); }

// ---- embedding --------------------------------------------------------------------------------------

__global__ void mc_embed_fwd_k(int N, int D, const int *ids, const float *E, float *x) {
    size_t n = (size_t)N * D;
    FOR_I(n) {
        int t = (int)(i / D), j = (int)(i % D), id = ids[t];
        x[i] = id >= 0 ? E[(size_t)id * D + j] : 0.f;
    }
}
// One thread per column: the tokens are added in order (repeated ids sum deterministically).
__global__ void mc_embed_bwd_k(int N, int D, const int *ids, const float *dx, float *dE) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= D) return;
    for (int t = 0; t < N; t++) {
        int id = ids[t];
        if (id >= 0) dE[(size_t)id * D + j] += dx[(size_t)t * D + j];
    }
}
extern "C" void mtrl_mc_embedding_fwd(mtrl_cuda_ctx *c, int N, int D, const int *ids, const float *E, float *x) {
    if (N <= 0 || D <= 0) return;
    mc_embed_fwd_k<<<grid_((size_t)N * D), MC_T, 0, c->stream>>>(N, D, ids, E, x);
    CUDA_LAUNCH_CHECK();
}
extern "C" void mtrl_mc_embedding_bwd(mtrl_cuda_ctx *c, int N, int D, const int *ids, const float *dx, float *dE) {
    if (N <= 0 || D <= 0) return;
    mc_embed_bwd_k<<<cdiv(D, 64), 64, 0, c->stream>>>(N, D, ids, dx, dE);
    CUDA_LAUNCH_CHECK();
}

// ---- Σ x² ---------------------------------------------------------------------------------------------

__global__ void mc_sq_k(size_t n, const float *x, double *part) {
    __shared__ double red[33];
    double s = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        double v = x[i];
        s += v * v;
    }
    s = block_sum_d(s, red);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}
extern "C" double mtrl_mc_sq_norm(mtrl_cuda_ctx *c, size_t n, const float *x, double *part) {
    if (!n) return 0;
    mc_sq_k<<<MTRL_MC_SQ_BLOCKS, MC_T, 0, c->stream>>>(n, x, part);
    CUDA_LAUNCH_CHECK();
    double h[MTRL_MC_SQ_BLOCKS], s = 0;
    mtrl_mc_download(c, h, part, sizeof h);
    for (int b = 0; b < MTRL_MC_SQ_BLOCKS; b++) s += h[b];
    return s;
}

// ---- row offsets of pointers (the decode's pooled latent caches) ------------------------------------

static __global__ void ptr_rows_k(int B, const void *const *p, unsigned long long row, long long *start) {
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b < B) start[b] = (long long)((unsigned long long)(uintptr_t)p[b] / row);
}

extern "C" void mtrl_mc_ptr_rows(mtrl_cuda_ctx *c, int B, const void *const *p, size_t row, long long *start) {
    if (B <= 0) return;
    ptr_rows_k<<<(unsigned)((B + MC_T - 1) / MC_T), MC_T, 0, c->stream>>>(B, p, (unsigned long long)row, start);
    CUDA_LAUNCH_CHECK();
}
