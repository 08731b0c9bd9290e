// core/model_ops.h: the small CUDA kernels and memory calls of the backbone's CUDA backend
// (backend_cuda.c), in core/model_ops.cu. Plain C; every pointer is device memory unless its name
// ends in _h; everything runs on the context's stream (kernels/cuda/kernels_cuda.h) in order.
// Built only with MTRL_HAVE_CUDA (kernels/CMakeLists.txt compiles it into mtrl_kernels_cuda).
#ifndef MTRL_MODEL_CUDA_H
#define MTRL_MODEL_CUDA_H

#include <stddef.h>

#include "kernels/cuda/kernels_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

// ---- memory (aborting on a CUDA error, like the kernels' launchers) -------------------------
void *mtrl_mc_malloc(size_t bytes);                                     // cudaMalloc, >= 1 byte
void mtrl_mc_free(mtrl_cuda_ctx *ctx, void *p);                         // waits for the stream first
void mtrl_mc_zero(mtrl_cuda_ctx *ctx, void *p, size_t bytes);
void mtrl_mc_copy(mtrl_cuda_ctx *ctx, void *dst, const void *src, size_t bytes);
void mtrl_mc_upload(mtrl_cuda_ctx *ctx, void *dst, const void *src_h, size_t bytes);   // src_h reusable on return
void mtrl_mc_download(mtrl_cuda_ctx *ctx, void *dst_h, const void *src, size_t bytes); // waits
// dst[r*ldd + j] = src[r*lds + j], r < rows, j < n (floats).
void mtrl_mc_copy_rows(mtrl_cuda_ctx *ctx, int rows, int n, const float *src, int lds, float *dst, int ldd);
// Free and total bytes of the context's GPU (cudaMemGetInfo on its device); the bytes of the
// context's own scratch (kernels_cuda.h: grown by the launchers, never shrunk).
void mtrl_mc_mem_info(mtrl_cuda_ctx *ctx, size_t *free_h, size_t *total_h);
size_t mtrl_mc_ctx_scratch_bytes(const mtrl_cuda_ctx *ctx);
// ptrs: a DEVICE array of B device pointers. gather: dst[b*n + i] = ptrs[b][i]; scatter: the inverse.
void mtrl_mc_gather(mtrl_cuda_ctx *ctx, int B, size_t n, const float *const *ptrs, float *dst);
void mtrl_mc_scatter(mtrl_cuda_ctx *ctx, int B, size_t n, const float *src, float *const *ptrs);
// start[b] = address of p[b] / row (p a DEVICE array of B pointers, each a multiple of row bytes
// from address 0): the rows of one pool based at address 0, for the batched MLA decode.
void mtrl_mc_ptr_rows(mtrl_cuda_ctx *ctx, int B, const void *const *p, size_t row, long long *start);
// MLA latent rows (backend.h latent_put): ptrs a DEVICE array of B pointers to elements of
// `type` (MTRL_F32, or MTRL_BF16 rounded to nearest even as mtrl_cuda_f32_to_bf16):
// ptrs[b][r*ldd + j] = src[(b*rows + r)*lds + j], r < rows, j < n.
void mtrl_mc_latent_put(mtrl_cuda_ctx *ctx, int B, int rows, int n, const float *src, int lds, void *const *ptrs,
                        int ldd, int type);
// The reverse (backend.h latent_get): dst[r*ldd + j] = src[r*lds + j] widened to fp32.
void mtrl_mc_latent_get(mtrl_cuda_ctx *ctx, int rows, int n, const void *src, int lds, float *dst, int ldd,
                        int type);
// Rows from anywhere (backend.h latent_gather): dst[r*ldd + j] = ptrs[r][j] widened to fp32, ptrs a
// DEVICE array of `rows` pointers to latent rows of `type`.
void mtrl_mc_latent_gather(mtrl_cuda_ctx *ctx, int rows, int n, const void *const *ptrs, float *dst, int ldd,
                           int type);
// dst[t*ldd + j] += Σ_h src[t*lds + h*hs + j] for t < N, j < n, the heads in order.
void mtrl_mc_sum_heads(mtrl_cuda_ctx *ctx, int N, int H, int n, const float *src, int lds, int hs, float *dst,
                       int ldd);

// ---- elementwise ------------------------------------------------------------------------------
void mtrl_mc_sigmoid(mtrl_cuda_ctx *ctx, size_t n, const float *x, float *y);
void mtrl_mc_sigmoid_mul(mtrl_cuda_ctx *ctx, size_t n, const float *x, const float *a, float *y);
void mtrl_mc_sigmoid_mul_bwd(mtrl_cuda_ctx *ctx, size_t n, const float *x, const float *a, const float *dy,
                             float *da, float *dx);
void mtrl_mc_dsigmoid(mtrl_cuda_ctx *ctx, size_t n, const float *s, float *dy);
void mtrl_mc_add(mtrl_cuda_ctx *ctx, size_t n, const float *a, const float *b, float *y); // a nullable
void mtrl_mc_scale(mtrl_cuda_ctx *ctx, size_t n, float *x, float s);

// ---- embedding (ids device int32; negative = padding) ----------------------------------------
void mtrl_mc_embedding_fwd(mtrl_cuda_ctx *ctx, int N, int D, const int *ids, const float *E, float *x);
// dE[ids[i]] += dx[i], tokens in order per column (deterministic, no atomics).
void mtrl_mc_embedding_bwd(mtrl_cuda_ctx *ctx, int N, int D, const int *ids, const float *dx, float *dE);

// ---- reductions --------------------------------------------------------------------------------
// Σ x² in double: fixed per-block partials written to part (>= MTRL_MC_SQ_BLOCKS doubles of
// device memory), summed on the host in order. Waits.
#define MTRL_MC_SQ_BLOCKS 256
double mtrl_mc_sq_norm(mtrl_cuda_ctx *ctx, size_t n, const float *x, double *part);

#ifdef __cplusplus
}
#endif

#endif
