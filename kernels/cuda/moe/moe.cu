// moe/moe.cu: the sparse-MoE FFN on the GPU (docs/model.md §4; the oracle is kernels/ref/moe_ref.c):
// router top-k with the QB bias, dispatch by a stable counting sort, gather, grouped SwiGLU
// experts as a loop of cuBLAS GEMMs over the expert segments, deterministic combine, every
// backward, load counts and the QB column quantile by exact radix selection.
#include <math.h>

#include "kernels/cuda/cuda_common.cuh"

#define MAXK 16  // experts per token
#define MAXE 1024
// The router's form bits, as moe_ref.h's MOE_ROUTER_*.
#define ROUTER_SOFTMAX 1
#define ROUTER_SELECT_SCORE 2
#define ROUTER_NO_RENORM 4

// ---- router -----------------------------------------------------------------------------------

// (a, ia) ranks before (b, ib): higher score first, then the lower expert id (moe_better_).
__device__ __forceinline__ bool better_(float a, int ia, float b, int ib) {
    return a > b || (a == b && ia < ib);
}

// Warp-wide argmax over the experts this lane owns (e = lane + 32 i) that are not yet taken
// (bit i of `taken`); returns the winning expert (uniform across the warp) and its value.
__device__ __forceinline__ int warp_pick_(const float *val, int E, unsigned long long taken,
                                          float &best_v) {
    int lane = threadIdx.x & 31;
    float bv = -INFINITY;
    int be = 0x7fffffff;
    for (int i = 0; lane + 32 * i < E; i++) {
        if (taken >> i & 1ull) continue;
        int e = lane + 32 * i;
        float v = val[e];
        if (be == 0x7fffffff || better_(v, e, bv, be)) {
            bv = v;
            be = e;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oe = __shfl_xor_sync(0xffffffffu, be, o);
        if (oe != 0x7fffffff && (be == 0x7fffffff || better_(ov, oe, bv, be))) {
            bv = ov;
            be = oe;
        }
    }
    best_v = bv;
    return be;
}

// One warp per token; shared scratch per warp: E selection scores.
__global__ void moe_router_fwd_k(int N, int E, int K, const float *z, const float *beta,
                                 int form, float rho, int replay, int *sel, float *w,
                                 float *s) {
    int score_softmax = form & ROUTER_SOFTMAX;
    extern __shared__ float rsm[];
    int wl = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int t = blockIdx.x * (blockDim.x >> 5) + wl;
    if (t >= N) return;
    float *val = rsm + (size_t)wl * E;
    const float *zt = z + (size_t)t * E;
    float *st = s + (size_t)t * E;
    int *selt = sel + (size_t)t * K;
    // scores
    if (score_softmax) {
        float mx = -INFINITY;
        for (int e = lane; e < E; e += 32) mx = fmaxf(mx, zt[e]);
        mx = warp_max(mx);
        float sum = 0.f;
        for (int e = lane; e < E; e += 32) sum += expf(zt[e] - mx);
        sum = warp_sum(sum);
        for (int e = lane; e < E; e += 32) st[e] = expf(zt[e] - mx) / sum;
    } else {
        for (int e = lane; e < E; e += 32) st[e] = sigmoid_acc(zt[e]);
    }
    int chosen[MAXK];
    if (!replay) {
        // each lane reads back the scores it wrote itself
        const float *xt = form & ROUTER_SELECT_SCORE ? st : zt;
        for (int e = lane; e < E; e += 32) val[e] = xt[e] - (beta ? beta[e] : 0.f);
        __syncwarp();
        unsigned long long taken = 0;
        for (int j = 0; j < K; j++) {
            float bv;
            int be = warp_pick_(val, E, taken, bv);
            if ((be & 31) == lane) taken |= 1ull << (be >> 5);
            chosen[j] = be;
            if (lane == 0) selt[j] = be;
        }
    } else {
        for (int j = 0; j < K; j++) chosen[j] = selt[j];
    }
    __syncwarp();
    // weights (renormalised over the chosen set); every lane computes them, lane j writes slot j
    float Z = 1.f;
    if (!(form & ROUTER_NO_RENORM)) {
        Z = 0.f;
        for (int j = 0; j < K; j++) Z += st[chosen[j]];
        Z += 1e-20f;
    }
    for (int j = lane; j < K; j += 32) {
        int e = 0;
#pragma unroll
        for (int jj = 0; jj < MAXK; jj++)
            if (jj == j) e = chosen[jj];
        w[(size_t)t * K + j] = rho * st[e] / Z;
    }
}

__global__ void moe_router_bwd_k(int N, int E, int K, const float *s, const int *sel,
                                 const float *w, int form, float rho, const float *dw,
                                 float *dz) {
    int score_softmax = form & ROUTER_SOFTMAX;
    int wl = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int t = blockIdx.x * (blockDim.x >> 5) + wl;
    if (t >= N) return;
    const float *st = s + (size_t)t * E;
    const int *selt = sel + (size_t)t * K;
    float *dzt = dz + (size_t)t * E;
    float Z = 1e-20f, dww = 0.f;
    for (int j = 0; j < K; j++) {
        Z += st[selt[j]];
        dww += dw[(size_t)t * K + j] * w[(size_t)t * K + j];
    }
    if (form & ROUTER_NO_RENORM) { // w = rho s: ds = rho dw
        Z = 1.f;
        dww = 0.f;
    }
    // ds of the chosen experts; softmax needs Σ_chosen s ds
    float dot = 0.f;
    for (int j = 0; j < K; j++) dot += st[selt[j]] * ((rho * dw[(size_t)t * K + j] - dww) / Z);
    for (int e = lane; e < E; e += 32) {
        float ds = 0.f;
        for (int j = 0; j < K; j++)
            if (selt[j] == e) ds = (rho * dw[(size_t)t * K + j] - dww) / Z;
        float se = st[e];
        dzt[e] = score_softmax ? se * (ds - dot) : ds * se * (1.f - se);
    }
}

// ---- dispatch: stable counting sort -------------------------------------------------------------

#define DCHUNK 1024  // (token, slot) pairs per chunk

__global__ void moe_count_k(long R, int E, const int *sel, int *counts) {
    extern __shared__ int hist[];
    for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
    __syncthreads();
    long r0 = (long)blockIdx.x * DCHUNK;
    for (int i = threadIdx.x; i < DCHUNK; i += blockDim.x)
        if (r0 + i < R) atomicAdd(&hist[sel[r0 + i]], 1);  // integer counts: order-independent
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) counts[(size_t)blockIdx.x * E + e] = hist[e];
}

// One block: base[c][e] = offsets[e] + Σ_{c' < c} counts[c'][e]; offsets [E+1].
__global__ void moe_scan_k(int nchunks, int E, long R, int *counts, int *offsets) {
    extern __shared__ int tot[];
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int run = 0;
        for (int c = 0; c < nchunks; c++) {
            int v = counts[(size_t)c * E + e];
            counts[(size_t)c * E + e] = run;
            run += v;
        }
        tot[e] = run;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int run = 0;
        for (int e = 0; e < E; e++) {
            int v = tot[e];
            tot[e] = run;
            offsets[e] = run;
            run += v;
        }
        offsets[E] = (int)R;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        for (int c = 0; c < nchunks; c++) counts[(size_t)c * E + e] += tot[e];
}

// One warp per chunk, pairs in (token, slot) order, 32 at a time: lanes with the same expert
// take consecutive slots in lane order (match_any + popc), so the sort is stable.
__global__ void moe_place_k(long R, int E, int K, const int *sel, const int *base,
                            int *perm_token, int *pos) {
    extern __shared__ int cur[];
    int lane = threadIdx.x;
    for (int e = lane; e < E; e += 32) cur[e] = base[(size_t)blockIdx.x * E + e];
    __syncwarp();
    long r0 = (long)blockIdx.x * DCHUNK;
    for (int b = 0; b < DCHUNK; b += 32) {
        long r = r0 + b + lane;
        bool ok = r < R;
        unsigned act = __ballot_sync(0xffffffffu, ok);
        if (!act) break;
        int e = ok ? sel[r] : -1;
        int p = 0;
        unsigned peers = 0;
        if (ok) {
            peers = __match_any_sync(act, e);
            int rank = __popc(peers & ((1u << lane) - 1));
            p = cur[e] + rank;
            perm_token[p] = (int)(r / K);
            pos[r] = p;
        }
        __syncwarp();
        if (ok && (peers & ((1u << lane) - 1)) == 0) cur[e] += __popc(peers);  // group leader
        __syncwarp();
    }
}

// ---- gather / combine / scatter (one block per token) ------------------------------------------

__device__ __forceinline__ void store_t(float *p, float v) { *p = v; }
__device__ __forceinline__ void store_t(__nv_bfloat16 *p, float v) { *p = __float2bfloat16_rn(v); }

template <class T>
__global__ void moe_gather_k(int K, int D, const int *pos, const float *x, T *X_perm) {
    int t = blockIdx.x;
    for (int j = 0; j < K; j++) {
        size_t p = (size_t)pos[(size_t)t * K + j];
        for (int d = threadIdx.x; d < D; d += blockDim.x) store_t(X_perm + p * D + d, x[(size_t)t * D + d]);
    }
}

__global__ void moe_combine_fwd_k(int K, int D, const int *pos, const float *w,
                                  const float *Y_perm, float *y) {
    int t = blockIdx.x;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.f;
        for (int j = 0; j < K; j++)
            acc = fmaf(w[(size_t)t * K + j], Y_perm[(size_t)pos[(size_t)t * K + j] * D + d], acc);
        y[(size_t)t * D + d] = acc;
    }
}

__global__ void moe_combine_bwd_k(int K, int D, const int *pos, const float *w,
                                  const float *Y_perm, const float *dy, float *dY_perm,
                                  float *dw) {
    __shared__ float red[33];
    int t = blockIdx.x;
    for (int j = 0; j < K; j++) {
        size_t p = (size_t)pos[(size_t)t * K + j];
        float wj = w[(size_t)t * K + j], dot = 0.f;
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            float g = dy[(size_t)t * D + d];
            dot = fmaf(g, Y_perm[p * D + d], dot);
            dY_perm[p * D + d] = wj * g;
        }
        dot = block_sum(dot, red);
        if (threadIdx.x == 0) dw[(size_t)t * K + j] = dot;
    }
}

__global__ void moe_scatter_bwd_k(int K, int D, const int *pos, const float *dX_perm, float *dx) {
    int t = blockIdx.x;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = dx[(size_t)t * D + d];
        for (int j = 0; j < K; j++) acc += dX_perm[(size_t)pos[(size_t)t * K + j] * D + d];
        dx[(size_t)t * D + d] = acc;
    }
}

// ---- SwiGLU between the expert GEMMs ------------------------------------------------------------

template <class T>
__global__ void moe_swiglu_k(size_t n, const float *u1, const float *u3, T *m) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float a = u1[i];
        store_t(m + i, a * sigmoid_acc(a) * u3[i]);
    }
}
// From dm: m (for dW2), du1, du3 (typed operands of the next GEMMs).
template <class T>
__global__ void moe_swiglu_bwd_k(size_t n, const float *u1, const float *u3, const float *dm,
                                 T *m, T *du1, T *du3) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float a = u1[i], b = u3[i], sg = sigmoid_acc(a), silu = a * sg, g = dm[i];
        store_t(m + i, silu * b);
        store_t(du3 + i, g * silu);
        store_t(du1 + i, g * b * sg * (1.f + a * (1.f - sg)));
    }
}

// ---- load counts and QB ---------------------------------------------------------------------------

__global__ void moe_load_k(long R, const int *sel, int *load) {
    for (long r = blockIdx.x * (long)blockDim.x + threadIdx.x; r < R; r += (long)gridDim.x * blockDim.x)
        atomicAdd(&load[sel[r]], 1);
}

// alpha_i = (K+1)-th largest of z_i − beta_old (one warp per token).
__global__ void qb_alpha_k(int N, int E, int K, const float *z, const float *beta_old,
                           float *alpha) {
    extern __shared__ float qsm[];
    int wl = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int t = blockIdx.x * (blockDim.x >> 5) + wl;
    if (t >= N) return;
    float *val = qsm + (size_t)wl * E;
    for (int e = lane; e < E; e += 32) val[e] = z[(size_t)t * E + e] - (beta_old ? beta_old[e] : 0.f);
    __syncwarp();
    unsigned long long taken = 0;
    float bv = 0.f;
    for (int j = 0; j <= K; j++) {
        int be = warp_pick_(val, E, taken, bv);
        if ((be & 31) == lane) taken |= 1ull << (be >> 5);
    }
    if (lane == 0) alpha[t] = bv;
}

__device__ __forceinline__ uint32_t fkey_(float f) {  // order-preserving map to uint32
    uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float fkey_inv_(uint32_t k) {
    uint32_t u = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
    return __uint_as_float(u);
}

// beta_new[e] = (q+1)-th largest over tokens of z_ie − alpha_i: radix select, 8 bits a pass from
// the top (one block per expert; the histogram counts are integers, so the result is exact).
__global__ void qb_beta_k(int N, int E, int kth, const float *z, const float *alpha,
                          float *beta_new) {
    __shared__ int hist[256];
    __shared__ uint32_t s_prefix;
    __shared__ int s_k;
    int e = blockIdx.x;
    uint32_t prefix = 0;
    int k = kth;
    for (int pass = 0; pass < 4; pass++) {
        int shift = 24 - 8 * pass;
        uint32_t mask_hi = pass == 0 ? 0u : (0xffffffffu << (32 - 8 * pass));
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < N; i += blockDim.x) {
            uint32_t key = fkey_(z[(size_t)i * E + e] - alpha[i]);
            if ((key & mask_hi) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int run = 0, d = 255;
            for (; d > 0; d--) {
                if (run + hist[d] >= k) break;
                run += hist[d];
            }
            s_k = k - run;
            s_prefix = prefix | ((uint32_t)d << shift);
        }
        __syncthreads();
        prefix = s_prefix;
        k = s_k;
        __syncthreads();
    }
    if (threadIdx.x == 0) beta_new[e] = fkey_inv_(prefix);
}

// ---- launchers --------------------------------------------------------------------------------

extern "C" int mtrl_moe_router_fwd(mtrl_cuda_ctx *c, int N, int E, int K, const float *z,
                                   const float *beta, int form, float rho, int replay,
                                   int *sel, float *w, float *s) {
    MTRL_CUDA_REQUIRE(N >= 0 && E >= 1 && E <= MAXE && K >= 1 && K <= MAXK && K <= E,
                      "N=%d E=%d K=%d", N, E, K);
    if (!N) return 0;
    size_t sh = sizeof(float) * 8 * (size_t)E;
    set_smem(moe_router_fwd_k, sh);
    moe_router_fwd_k<<<cdiv(N, 8), 256, sh, c->stream>>>(N, E, K, z, beta, form, rho,
                                                         replay, sel, w, s);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int mtrl_moe_router_bwd(mtrl_cuda_ctx *c, int N, int E, int K, const float *s,
                                   const int *sel, const float *w, int form, float rho,
                                   const float *dw, float *dz) {
    MTRL_CUDA_REQUIRE(N >= 0 && E >= 1 && K >= 1 && K <= E, "N=%d E=%d K=%d", N, E, K);
    if (!N) return 0;
    moe_router_bwd_k<<<cdiv(N, 8), 256, 0, c->stream>>>(N, E, K, s, sel, w, form, rho,
                                                        dw, dz);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int mtrl_moe_dispatch(mtrl_cuda_ctx *c, int N, int E, int K, const int *sel,
                                 int *offsets, int *perm_token, int *pos) {
    MTRL_CUDA_REQUIRE(N >= 0 && E >= 1 && E <= 12 * 1024 && K >= 1, "N=%d E=%d K=%d", N, E, K);
    long R = (long)N * K;
    int nchunks = (int)((R + DCHUNK - 1) / DCHUNK);
    if (nchunks == 0) {
        CUDA_CHECK(cudaMemsetAsync(offsets, 0, sizeof(int) * (E + 1), c->stream));
        return 0;
    }
    int *counts = (int *)mtrl_ctx_scratch(c, sizeof(int) * (size_t)nchunks * E);
    moe_count_k<<<nchunks, 256, sizeof(int) * E, c->stream>>>(R, E, sel, counts);
    CUDA_LAUNCH_CHECK();
    moe_scan_k<<<1, 1024, sizeof(int) * E, c->stream>>>(nchunks, E, R, counts, offsets);
    CUDA_LAUNCH_CHECK();
    moe_place_k<<<nchunks, 32, sizeof(int) * E, c->stream>>>(R, E, K, sel, counts, perm_token, pos);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int mtrl_moe_gather(mtrl_cuda_ctx *c, int N, int K, int D, const int *pos,
                               const float *x, void *X_perm, int x_type) {
    MTRL_CUDA_REQUIRE(N >= 0 && K >= 1 && D >= 1 && (x_type == MTRL_F32 || x_type == MTRL_BF16),
                      "N=%d K=%d D=%d type=%d", N, K, D, x_type);
    if (!N) return 0;
    if (x_type == MTRL_BF16)
        moe_gather_k<__nv_bfloat16><<<N, 256, 0, c->stream>>>(K, D, pos, x, (__nv_bfloat16 *)X_perm);
    else
        moe_gather_k<float><<<N, 256, 0, c->stream>>>(K, D, pos, x, (float *)X_perm);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int mtrl_moe_combine_fwd(mtrl_cuda_ctx *c, int N, int K, int D, const int *pos,
                                    const float *w, const float *Y_perm, float *y) {
    MTRL_CUDA_REQUIRE(N >= 0 && K >= 1 && D >= 1, "N=%d K=%d D=%d", N, K, D);
    if (!N) return 0;
    moe_combine_fwd_k<<<N, 256, 0, c->stream>>>(K, D, pos, w, Y_perm, y);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int mtrl_moe_combine_bwd(mtrl_cuda_ctx *c, int N, int K, int D, const int *pos,
                                    const float *w, const float *Y_perm, const float *dy,
                                    float *dY_perm, float *dw) {
    MTRL_CUDA_REQUIRE(N >= 0 && K >= 1 && D >= 1, "N=%d K=%d D=%d", N, K, D);
    if (!N) return 0;
    moe_combine_bwd_k<<<N, 256, 0, c->stream>>>(K, D, pos, w, Y_perm, dy, dY_perm, dw);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int mtrl_moe_scatter_bwd(mtrl_cuda_ctx *c, int N, int K, int D, const int *pos,
                                    const float *dX_perm, float *dx) {
    MTRL_CUDA_REQUIRE(N >= 0 && K >= 1 && D >= 1, "N=%d K=%d D=%d", N, K, D);
    if (!N) return 0;
    moe_scatter_bwd_k<<<N, 256, 0, c->stream>>>(K, D, pos, dX_perm, dx);
    CUDA_LAUNCH_CHECK();
    return 0;
}

static unsigned ew_grid_(size_t n) {
    size_t b = (n + 255) / 256;
    return (unsigned)(b < 65536 ? (b ? b : 1) : 65536);
}

// The experts run as per-expert chains (their GEMMs and their rows' SwiGLU) on nl GEMM lanes at
// once (cuda_common.cuh mtrl_ctx_lanes): one cuBLAS call per expert has too few tiles to fill the
// GPU (`small` at 64K: ~4,800 rows by 512 or 1,024, about a wave; the weight gradients' 512 x
// 1,024 outputs, 32 tiles), and a chain's elementwise pass overlaps the other lanes' GEMMs.
extern "C" int mtrl_moe_experts_fwd(mtrl_cuda_ctx *c, int E, int D, int I, const int *offsets_host,
                                    const void *X_perm, const void *W1, const void *W3,
                                    const void *W2, int type, float *u1, float *u3,
                                    float *Y_perm) {
    MTRL_CUDA_REQUIRE(E >= 1 && D >= 1 && I >= 1 && (type == MTRL_F32 || type == MTRL_BF16),
                      "E=%d D=%d I=%d type=%d", E, D, I, type);
    size_t R = (size_t)offsets_host[E], es = type == MTRL_BF16 ? 2 : 4;
    if (!R) return 0;
    const char *X = (const char *)X_perm, *w1 = (const char *)W1, *w3 = (const char *)W3,
               *w2 = (const char *)W2;
    char *m = (char *)mtrl_ctx_scratch(c, R * I * es);
    const int nl = mtrl_ctx_lanes(c);
    mtrl_ctx_lanes_fork(c, nl);
    for (int e = 0; e < E; e++) {
        int r0 = offsets_host[e], rows = offsets_host[e + 1] - r0, ln = e % nl;
        if (rows <= 0) continue;
        const char *Xe = X + (size_t)r0 * D * es;
        float *u1e = u1 + (size_t)r0 * I, *u3e = u3 + (size_t)r0 * I;
        char *me = m + (size_t)r0 * I * es;
        size_t n = (size_t)rows * I;
        mtrl_gemm_lane(c, ln, 0, 1, rows, I, D, 1.f, Xe, D, w1 + (size_t)e * I * D * es, D, type, 0.f, u1e, I, MTRL_F32);
        mtrl_gemm_lane(c, ln, 0, 1, rows, I, D, 1.f, Xe, D, w3 + (size_t)e * I * D * es, D, type, 0.f, u3e, I, MTRL_F32);
        cudaStream_t st = mtrl_ctx_lane_stream(c, ln);
        if (type == MTRL_BF16) moe_swiglu_k<<<ew_grid_(n), 256, 0, st>>>(n, u1e, u3e, (__nv_bfloat16 *)me);
        else moe_swiglu_k<<<ew_grid_(n), 256, 0, st>>>(n, u1e, u3e, (float *)me);
        CUDA_LAUNCH_CHECK();
        mtrl_gemm_lane(c, ln, 0, 1, rows, D, I, 1.f, me, I, w2 + (size_t)e * D * I * es, I, type, 0.f,
                       Y_perm + (size_t)r0 * D, D, MTRL_F32);
    }
    mtrl_ctx_lanes_join(c, nl);
    return 0;
}

extern "C" int mtrl_moe_experts_bwd(mtrl_cuda_ctx *c, int E, int D, int I, const int *offsets_host,
                                    const void *X_perm, const void *W1, const void *W3,
                                    const void *W2, int type, const float *u1, const float *u3,
                                    const float *dY_perm, float *dX_perm, float *dW1, float *dW3,
                                    float *dW2) {
    MTRL_CUDA_REQUIRE(E >= 1 && D >= 1 && I >= 1 && (type == MTRL_F32 || type == MTRL_BF16),
                      "E=%d D=%d I=%d type=%d", E, D, I, type);
    size_t R = (size_t)offsets_host[E], es = type == MTRL_BF16 ? 2 : 4;
    if (!R) return 0;
    const char *X = (const char *)X_perm, *w1 = (const char *)W1, *w3 = (const char *)W3,
               *w2 = (const char *)W2;
    // dY in the operand type: bf16 operands convert it into the scratch, fp32 ones read dY_perm.
    ws_carver sz{nullptr, 0};
    if (type == MTRL_BF16) sz.take<char>(R * D * es);
    sz.take<float>(R * I);
    sz.take<char>(3 * R * I * es);
    ws_carver cv{(char *)mtrl_ctx_scratch(c, sz.off), 0};
    const char *dY = (const char *)dY_perm;
    if (type == MTRL_BF16) {
        char *h = cv.take<char>(R * D * es);
        mtrl_cuda_f32_to_bf16(c, R * D, dY_perm, (mtrl_bf16 *)h);
        dY = h;
    }
    float *dm = cv.take<float>(R * I);
    char *m = cv.take<char>(3 * R * I * es), *du1 = m + R * I * es, *du3 = du1 + R * I * es;
    const int nl = mtrl_ctx_lanes(c);
    mtrl_ctx_lanes_fork(c, nl);
    for (int e = 0; e < E; e++) {
        int r0 = offsets_host[e], rows = offsets_host[e + 1] - r0, ln = e % nl;
        if (rows <= 0) continue;
        const char *dYe = dY + (size_t)r0 * D * es, *Xe = X + (size_t)r0 * D * es;
        char *me = m + (size_t)r0 * I * es, *d1 = du1 + (size_t)r0 * I * es, *d3 = du3 + (size_t)r0 * I * es;
        float *dme = dm + (size_t)r0 * I;
        const float *u1e = u1 + (size_t)r0 * I, *u3e = u3 + (size_t)r0 * I;
        size_t n = (size_t)rows * I;
        // dm = dY W2[e], then m (for dW2), du1, du3
        mtrl_gemm_lane(c, ln, 0, 0, rows, I, D, 1.f, dYe, D, w2 + (size_t)e * D * I * es, I, type, 0.f, dme, I,
                       MTRL_F32);
        cudaStream_t st = mtrl_ctx_lane_stream(c, ln);
        if (type == MTRL_BF16)
            moe_swiglu_bwd_k<<<ew_grid_(n), 256, 0, st>>>(n, u1e, u3e, dme, (__nv_bfloat16 *)me, (__nv_bfloat16 *)d1,
                                                          (__nv_bfloat16 *)d3);
        else
            moe_swiglu_bwd_k<<<ew_grid_(n), 256, 0, st>>>(n, u1e, u3e, dme, (float *)me, (float *)d1, (float *)d3);
        CUDA_LAUNCH_CHECK();
        if (dW2)  // dW2[e] += dYᵀ m
            mtrl_gemm_lane(c, ln, 1, 0, D, I, rows, 1.f, dYe, D, me, I, type, 1.f, dW2 + (size_t)e * D * I, I,
                           MTRL_F32);
        // dX = du1 W1[e] + du3 W3[e]
        mtrl_gemm_lane(c, ln, 0, 0, rows, D, I, 1.f, d1, I, w1 + (size_t)e * I * D * es, D, type, 0.f,
                       dX_perm + (size_t)r0 * D, D, MTRL_F32);
        mtrl_gemm_lane(c, ln, 0, 0, rows, D, I, 1.f, d3, I, w3 + (size_t)e * I * D * es, D, type, 1.f,
                       dX_perm + (size_t)r0 * D, D, MTRL_F32);
        if (dW1)
            mtrl_gemm_lane(c, ln, 1, 0, I, D, rows, 1.f, d1, I, Xe, D, type, 1.f, dW1 + (size_t)e * I * D, D, MTRL_F32);
        if (dW3)
            mtrl_gemm_lane(c, ln, 1, 0, I, D, rows, 1.f, d3, I, Xe, D, type, 1.f, dW3 + (size_t)e * I * D, D, MTRL_F32);
    }
    mtrl_ctx_lanes_join(c, nl);
    return 0;
}

extern "C" int mtrl_moe_load_count(mtrl_cuda_ctx *c, int N, int E, int K, const int *sel,
                                   int *load) {
    MTRL_CUDA_REQUIRE(N >= 0 && E >= 1 && K >= 1, "N=%d E=%d K=%d", N, E, K);
    CUDA_CHECK(cudaMemsetAsync(load, 0, sizeof(int) * E, c->stream));
    long R = (long)N * K;
    if (!R) return 0;
    moe_load_k<<<ew_grid_(R), 256, 0, c->stream>>>(R, sel, load);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int mtrl_qb_beta_from_batch(mtrl_cuda_ctx *c, int N, int E, int K, const float *z,
                                       const float *beta_old, float *beta_new) {
    MTRL_CUDA_REQUIRE(N >= 0 && E >= 1 && E <= MAXE && K >= 1 && K <= 63, "N=%d E=%d K=%d", N, E, K);
    long q = (long)N * K / E;
    if (q == 0 || q + 1 > N || K >= E) {
        if (beta_new != beta_old) {
            if (beta_old)
                CUDA_CHECK(cudaMemcpyAsync(beta_new, beta_old, sizeof(float) * E,
                                           cudaMemcpyDeviceToDevice, c->stream));
            else CUDA_CHECK(cudaMemsetAsync(beta_new, 0, sizeof(float) * E, c->stream));
        }
        return 1;
    }
    float *alpha = (float *)mtrl_ctx_scratch(c, sizeof(float) * (size_t)N);
    size_t sh = sizeof(float) * 8 * (size_t)E;
    set_smem(qb_alpha_k, sh);
    qb_alpha_k<<<cdiv(N, 8), 256, sh, c->stream>>>(N, E, K, z, beta_old, alpha);
    CUDA_LAUNCH_CHECK();
    qb_beta_k<<<E, 256, 0, c->stream>>>(N, E, (int)q + 1, z, alpha, beta_new);
    CUDA_LAUNCH_CHECK();
    return 0;
}
