// core/ops_simt.cu: the per-token operators of ops_ref.h and attnres_ref.h on the GPU (fp32):
// RMSNorm, L2Norm, gated RMSNorm, SwiGLU, causal short conv (+ decode window), log-prob and
// entropy over a vocabulary row, AdamW, and one Block-AttnRes site.
// Row operators run one block per row; weight gradients ("+=" over rows) are summed per column
// over fixed row ranges, then the ranges in order: bit-reproducible, no atomics.
#include <math.h>

#include "kernels/cuda/cuda_common.cuh"

#define OPS_T 256

static unsigned ew_grid(size_t n) {
    size_t b = (n + OPS_T - 1) / OPS_T;
    return (unsigned)(b < 65536 ? (b ? b : 1) : 65536);
}

// Splits N rows into nsplit ranges for the column reductions (enough blocks to fill the chip).
static int row_splits(const mtrl_cuda_ctx *c, int N, int D) {
    int cols = (D + OPS_T - 1) / OPS_T;
    int ns = (c->sms * 4 + cols - 1) / cols;
    if (ns > N) ns = N;
    return ns < 1 ? 1 : ns;
}

// ---- norms ------------------------------------------------------------------------------------

__global__ void rstd_k(int D, const float *x, float eps, float *rstd) {
    __shared__ float red[33];
    const float *xi = x + (size_t)blockIdx.x * D;
    float s = 0.f;
    for (int j = threadIdx.x; j < D; j += blockDim.x) s = fmaf(xi[j], xi[j], s);
    s = block_sum(s, red);
    if (threadIdx.x == 0) rstd[blockIdx.x] = rsqrtf(s / D + eps);
}

__global__ void rmsnorm_fwd_k(int D, const float *x, const float *w, float eps, float *y,
                              float *rstd) {
    __shared__ float red[33];
    const float *xi = x + (size_t)blockIdx.x * D;
    float *yi = y + (size_t)blockIdx.x * D;
    float s = 0.f;
    for (int j = threadIdx.x; j < D; j += blockDim.x) s = fmaf(xi[j], xi[j], s);
    s = block_sum(s, red);
    float r = rsqrtf(s / D + eps);
    for (int j = threadIdx.x; j < D; j += blockDim.x) yi[j] = w[j] * (xi[j] * r);
    if (rstd && threadIdx.x == 0) rstd[blockIdx.x] = r;
}

// dx = r (u − x̂ mean(u ⊙ x̂)), u = w ⊙ dy (⊙ σ(z) when gated; dz written then).
__global__ void norm_bwd_k(int D, const float *x, const float *z, const float *w,
                           const float *rstd, float eps, const float *dy, float *dx, float *dz) {
    __shared__ float red[33];
    size_t o = (size_t)blockIdx.x * D;
    const float *xi = x + o, *dyi = dy + o;
    float r;
    if (rstd) {
        r = rstd[blockIdx.x];
    } else {
        float s = 0.f;
        for (int j = threadIdx.x; j < D; j += blockDim.x) s = fmaf(xi[j], xi[j], s);
        s = block_sum(s, red);
        r = rsqrtf(s / D + eps);
    }
    float dot = 0.f;
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
        float xh = xi[j] * r, gy = dyi[j] * w[j];
        if (z) {
            float sg = sigmoid_acc(z[o + j]);
            dot = fmaf(gy * sg, xh, dot);
            dz[o + j] = gy * xh * sg * (1.f - sg);
        } else {
            dot = fmaf(gy, xh, dot);
        }
    }
    dot = block_sum(dot, red);
    float mean = dot / D;
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
        float u = dyi[j] * w[j];
        if (z) u *= sigmoid_acc(z[o + j]);
        dx[o + j] = r * (u - xi[j] * r * mean);
    }
}

// part[split][j] = Σ_{rows of split} dy x r (σ(z)).
__global__ void norm_dw_part_k(int N, int D, int rows_per, const float *x, const float *z,
                               const float *rstd, const float *dy, float *part) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= D) return;
    int i0 = blockIdx.y * rows_per, i1 = i0 + rows_per < N ? i0 + rows_per : N;
    float acc = 0.f;
    for (int i = i0; i < i1; i++) {
        size_t o = (size_t)i * D + j;
        float v = dy[o] * x[o] * rstd[i];
        if (z) v *= sigmoid_acc(z[o]);
        acc += v;
    }
    part[(size_t)blockIdx.y * D + j] = acc;
}

// out[j] += Σ_s part[s][j] (s in order); out2 (nullable) likewise with scale2[j] ⊙, and out's
// contribution scaled by scale1[j] when given.
__global__ void col_reduce_k(int D, int ns, const float *part, const float *scale1, float *out,
                             const float *scale2, float *out2) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= D) return;
    float s = 0.f;
    for (int i = 0; i < ns; i++) s += part[(size_t)i * D + j];
    if (out) out[j] += scale1 ? scale1[j] * s : s;
    if (out2) out2[j] += scale2 ? scale2[j] * s : s;
}

static void norm_dw_(mtrl_cuda_ctx *c, int N, int D, const float *x, const float *z,
                     const float *rstd, float eps, const float *dy, float *dw) {
    int ns = row_splits(c, N, D), rows_per = (N + ns - 1) / ns;
    ns = (N + rows_per - 1) / rows_per;
    ws_carver sz{nullptr, 0};
    sz.take<float>((size_t)ns * D);
    sz.take<float>((size_t)N);
    ws_carver cv{(char *)mtrl_ctx_scratch(c, sz.off), 0};
    float *part = cv.take<float>((size_t)ns * D), *r = cv.take<float>((size_t)N);
    if (!rstd) {
        rstd_k<<<N, OPS_T, 0, c->stream>>>(D, x, eps, r);
        CUDA_LAUNCH_CHECK();
        rstd = r;
    }
    norm_dw_part_k<<<dim3(cdiv(D, OPS_T), ns), OPS_T, 0, c->stream>>>(N, D, rows_per, x, z, rstd,
                                                                      dy, part);
    CUDA_LAUNCH_CHECK();
    col_reduce_k<<<cdiv(D, OPS_T), OPS_T, 0, c->stream>>>(D, ns, part, nullptr, dw, nullptr,
                                                          nullptr);
    CUDA_LAUNCH_CHECK();
}

extern "C" int mtrl_rmsnorm_fwd(mtrl_cuda_ctx *c, int N, int D, const float *x, const float *w,
                                float eps, float *y, float *rstd) {
    MTRL_CUDA_REQUIRE(N >= 0 && D >= 1, "N=%d D=%d", N, D);
    if (!N) return 0;
    rmsnorm_fwd_k<<<N, OPS_T, 0, c->stream>>>(D, x, w, eps, y, rstd);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int mtrl_rmsnorm_bwd(mtrl_cuda_ctx *c, int N, int D, const float *x, const float *w,
                                const float *rstd, float eps, const float *dy, float *dx,
                                float *dw) {
    MTRL_CUDA_REQUIRE(N >= 0 && D >= 1, "N=%d D=%d", N, D);
    if (!N) return 0;
    if (dw) norm_dw_(c, N, D, x, nullptr, rstd, eps, dy, dw);  // before dx: dx may alias dy
    norm_bwd_k<<<N, OPS_T, 0, c->stream>>>(D, x, nullptr, w, rstd, eps, dy, dx, nullptr);
    CUDA_LAUNCH_CHECK();
    return 0;
}

__global__ void gated_fwd_k(int D, const float *x, const float *z, const float *w, float eps,
                            float *y) {
    __shared__ float red[33];
    size_t o = (size_t)blockIdx.x * D;
    float s = 0.f;
    for (int j = threadIdx.x; j < D; j += blockDim.x) s = fmaf(x[o + j], x[o + j], s);
    s = block_sum(s, red);
    float r = rsqrtf(s / D + eps);
    for (int j = threadIdx.x; j < D; j += blockDim.x)
        y[o + j] = w[j] * (x[o + j] * r) * sigmoid_acc(z[o + j]);
}
extern "C" int mtrl_gated_rmsnorm_fwd(mtrl_cuda_ctx *c, int N, int D, const float *x,
                                      const float *z, const float *w, float eps, float *y) {
    MTRL_CUDA_REQUIRE(N >= 0 && D >= 1, "N=%d D=%d", N, D);
    if (!N) return 0;
    gated_fwd_k<<<N, OPS_T, 0, c->stream>>>(D, x, z, w, eps, y);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int mtrl_gated_rmsnorm_bwd(mtrl_cuda_ctx *c, int N, int D, const float *x,
                                      const float *z, const float *w, float eps, const float *dy,
                                      float *dx, float *dz, float *dw) {
    MTRL_CUDA_REQUIRE(N >= 0 && D >= 1, "N=%d D=%d", N, D);
    if (!N) return 0;
    if (dw) norm_dw_(c, N, D, x, z, nullptr, eps, dy, dw);
    norm_bwd_k<<<N, OPS_T, 0, c->stream>>>(D, x, z, w, nullptr, eps, dy, dx, dz);
    CUDA_LAUNCH_CHECK();
    return 0;
}

__global__ void l2norm_fwd_k(int D, const float *x, float eps, float *y, float *rnorm) {
    __shared__ float red[33];
    size_t o = (size_t)blockIdx.x * D;
    float s = 0.f;
    for (int j = threadIdx.x; j < D; j += blockDim.x) s = fmaf(x[o + j], x[o + j], s);
    s = block_sum(s, red);
    float r = rsqrtf(s + eps);
    for (int j = threadIdx.x; j < D; j += blockDim.x) y[o + j] = x[o + j] * r;
    if (rnorm && threadIdx.x == 0) rnorm[blockIdx.x] = r;
}
__global__ void l2norm_bwd_k(int D, const float *x, float eps, const float *dy, float *dx) {
    __shared__ float red[33];
    size_t o = (size_t)blockIdx.x * D;
    float s = 0.f, dot = 0.f;
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
        s = fmaf(x[o + j], x[o + j], s);
        dot = fmaf(dy[o + j], x[o + j], dot);
    }
    s = block_sum(s, red);
    dot = block_sum(dot, red);
    float r = rsqrtf(s + eps), dyy = dot * r;
    for (int j = threadIdx.x; j < D; j += blockDim.x) dx[o + j] = r * (dy[o + j] - x[o + j] * r * dyy);
}
extern "C" int mtrl_l2norm_fwd(mtrl_cuda_ctx *c, int N, int D, const float *x, float eps, float *y,
                               float *rnorm) {
    MTRL_CUDA_REQUIRE(N >= 0 && D >= 1, "N=%d D=%d", N, D);
    if (!N) return 0;
    l2norm_fwd_k<<<N, D <= 128 ? 128 : OPS_T, 0, c->stream>>>(D, x, eps, y, rnorm);
    CUDA_LAUNCH_CHECK();
    return 0;
}
extern "C" int mtrl_l2norm_bwd(mtrl_cuda_ctx *c, int N, int D, const float *x, float eps,
                               const float *dy, float *dx) {
    MTRL_CUDA_REQUIRE(N >= 0 && D >= 1, "N=%d D=%d", N, D);
    if (!N) return 0;
    l2norm_bwd_k<<<N, D <= 128 ? 128 : OPS_T, 0, c->stream>>>(D, x, eps, dy, dx);
    CUDA_LAUNCH_CHECK();
    return 0;
}

// ---- SwiGLU -----------------------------------------------------------------------------------

__global__ void swiglu_fwd_k(size_t n, const float *u1, const float *u3, float *m) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float a = u1[i];
        m[i] = a * sigmoid_acc(a) * u3[i];
    }
}
__global__ void swiglu_bwd_k(size_t n, const float *u1, const float *u3, const float *dm,
                             float *du1, float *du3) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float a = u1[i], b = u3[i], g = dm[i], s = sigmoid_acc(a);
        float g1 = g * b * s * (1.f + a * (1.f - s)), g3 = g * a * s;
        du1[i] = g1;
        du3[i] = g3;
    }
}
extern "C" int mtrl_swiglu_fwd(mtrl_cuda_ctx *c, int N, int I, const float *u1, const float *u3,
                               float *m) {
    MTRL_CUDA_REQUIRE(N >= 0 && I >= 0, "N=%d I=%d", N, I);
    size_t n = (size_t)N * I;
    if (!n) return 0;
    swiglu_fwd_k<<<ew_grid(n), OPS_T, 0, c->stream>>>(n, u1, u3, m);
    CUDA_LAUNCH_CHECK();
    return 0;
}
extern "C" int mtrl_swiglu_bwd(mtrl_cuda_ctx *c, int N, int I, const float *u1, const float *u3,
                               const float *dm, float *du1, float *du3) {
    MTRL_CUDA_REQUIRE(N >= 0 && I >= 0, "N=%d I=%d", N, I);
    size_t n = (size_t)N * I;
    if (!n) return 0;
    swiglu_bwd_k<<<ew_grid(n), OPS_T, 0, c->stream>>>(n, u1, u3, dm, du1, du3);
    CUDA_LAUNCH_CHECK();
    return 0;
}

// ---- short conv -------------------------------------------------------------------------------

// Input at stream position t (t < 0: state_in row t + W − 1, or 0 without a state).
__device__ __forceinline__ float conv_in_(int t, int c, int C, int W, const float *x,
                                          const float *st) {
    if (t >= 0) return x[(size_t)t * C + c];
    return st ? st[(size_t)(t + W - 1) * C + c] : 0.f;
}
__device__ __forceinline__ float conv_pre_(int t, int c, int C, int W, const float *x,
                                           const float *w, const float *st) {
    float p = 0.f;
    for (int j = 0; j < W; j++) p = fmaf(w[(size_t)c * W + j], conv_in_(t - W + 1 + j, c, C, W, x, st), p);
    return p;
}

__global__ void conv_fwd_k(int T, int C, int W, const float *x, const float *w, const float *st,
                           float *y) {
    size_t n = (size_t)T * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        int t = (int)(i / C), c = (int)(i % C);
        float p = conv_pre_(t, c, C, W, x, w, st);
        y[i] = p * sigmoid_acc(p);
    }
}
// state_out row r = input at position T − (W−1) + r; one thread per channel, rows ascending, so
// state_out may alias state_in (rows move towards lower indices).
__global__ void conv_state_k(int T, int C, int W, const float *x, const float *st, float *so) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    for (int r = 0; r < W - 1; r++) so[(size_t)r * C + c] = conv_in_(T - (W - 1) + r, c, C, W, x, st);
}
__global__ void conv_dp_k(int T, int C, int W, const float *x, const float *w, const float *st,
                          const float *dy, float *dp) {
    size_t n = (size_t)T * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        int t = (int)(i / C), c = (int)(i % C);
        float p = conv_pre_(t, c, C, W, x, w, st), s = sigmoid_acc(p);
        dp[i] = dy[i] * s * (1.f + p * (1.f - s));
    }
}
// dx_s = Σ_j w_j dp_{s+W−1−j} for s in [s_lo, T); rows s < 0 go to dstate_in.
__global__ void conv_dx_k(int T, int C, int W, int s_lo, const float *w, const float *dp,
                          float *dx, float *dsi) {
    size_t n = (size_t)(T - s_lo) * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        int s = (int)(i / C) + s_lo, c = (int)(i % C);
        float g = 0.f;
        for (int j = 0; j < W; j++) {
            int t = s + W - 1 - j;
            if (t >= 0 && t < T) g = fmaf(w[(size_t)c * W + j], dp[(size_t)t * C + c], g);
        }
        if (s >= 0) dx[(size_t)s * C + c] = g;
        else dsi[(size_t)(s + W - 1) * C + c] = g;
    }
}
#define CONV_MAXW 8
__global__ void conv_dw_part_k(int T, int C, int W, int rows_per, const float *x,
                               const float *st, const float *dp, float *part) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    int t0 = blockIdx.y * rows_per, t1 = t0 + rows_per < T ? t0 + rows_per : T;
    float acc[CONV_MAXW];
#pragma unroll
    for (int j = 0; j < CONV_MAXW; j++) acc[j] = 0.f;
    for (int t = t0; t < t1; t++) {
        float g = dp[(size_t)t * C + c];
#pragma unroll
        for (int j = 0; j < CONV_MAXW; j++)
            if (j < W) acc[j] = fmaf(g, conv_in_(t - W + 1 + j, c, C, W, x, st), acc[j]);
    }
#pragma unroll
    for (int j = 0; j < CONV_MAXW; j++)
        if (j < W) part[((size_t)blockIdx.y * C + c) * W + j] = acc[j];
}
__global__ void conv_state_bwd_k(int T, int C, int W, const float *dso, float *dx, float *dsi) {
    size_t n = (size_t)(W - 1) * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        int r = (int)(i / C), c = (int)(i % C), t = T - (W - 1) + r;
        float *dst = t >= 0 ? dx + (size_t)t * C + c : (dsi ? dsi + (size_t)(t + W - 1) * C + c : nullptr);
        if (dst) *dst += dso[i];
    }
}
__global__ void conv_step_k(int B, int C, int W, const float *x1, const float *w, float *win,
                            float *y1) {
    size_t n = (size_t)B * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        int b = (int)(i / C), c = (int)(i % C);
        float *wb = win + (size_t)b * (W - 1) * C;
        float xv = x1[i];
        float p = w[(size_t)c * W + W - 1] * xv;
        for (int j = 0; j < W - 1; j++) p = fmaf(w[(size_t)c * W + j], wb[(size_t)j * C + c], p);
        y1[i] = p * sigmoid_acc(p);
        for (int j = 0; j + 1 < W - 1; j++) wb[(size_t)j * C + c] = wb[(size_t)(j + 1) * C + c];
        if (W > 1) wb[(size_t)(W - 2) * C + c] = xv;
    }
}

extern "C" int mtrl_shortconv_fwd(mtrl_cuda_ctx *c, int T, int C, int W, const float *x,
                                  const float *w, const float *state_in, float *y,
                                  float *state_out) {
    MTRL_CUDA_REQUIRE(T >= 0 && C >= 1 && W >= 1 && W <= CONV_MAXW, "T=%d C=%d W=%d", T, C, W);
    if (T) {
        conv_fwd_k<<<ew_grid((size_t)T * C), OPS_T, 0, c->stream>>>(T, C, W, x, w, state_in, y);
        CUDA_LAUNCH_CHECK();
    }
    if (state_out && W > 1) {
        conv_state_k<<<cdiv(C, OPS_T), OPS_T, 0, c->stream>>>(T, C, W, x, state_in, state_out);
        CUDA_LAUNCH_CHECK();
    }
    return 0;
}

extern "C" int mtrl_shortconv_bwd(mtrl_cuda_ctx *c, int T, int C, int W, const float *x,
                                  const float *w, const float *state_in, const float *dy,
                                  float *dx, float *dw, float *dstate_in) {
    MTRL_CUDA_REQUIRE(T >= 0 && C >= 1 && W >= 1 && W <= CONV_MAXW, "T=%d C=%d W=%d", T, C, W);
    int ns = T ? row_splits(c, T, C) : 1, rows_per = T ? (T + ns - 1) / ns : 1;
    if (T) ns = (T + rows_per - 1) / rows_per;
    ws_carver sz{nullptr, 0};
    sz.take<float>((size_t)T * C + 1);
    sz.take<float>((size_t)ns * C * W);
    ws_carver cv{(char *)mtrl_ctx_scratch(c, sz.off), 0};
    float *dp = cv.take<float>((size_t)T * C + 1), *part = cv.take<float>((size_t)ns * C * W);
    if (T) {
        conv_dp_k<<<ew_grid((size_t)T * C), OPS_T, 0, c->stream>>>(T, C, W, x, w, state_in, dy, dp);
        CUDA_LAUNCH_CHECK();
    }
    int s_lo = dstate_in ? -(W - 1) : 0;
    if ((size_t)(T - s_lo) * C) {
        conv_dx_k<<<ew_grid((size_t)(T - s_lo) * C), OPS_T, 0, c->stream>>>(T, C, W, s_lo, w, dp,
                                                                            dx, dstate_in);
        CUDA_LAUNCH_CHECK();
    }
    if (T) {
        conv_dw_part_k<<<dim3(cdiv(C, OPS_T), ns), OPS_T, 0, c->stream>>>(T, C, W, rows_per, x,
                                                                          state_in, dp, part);
        CUDA_LAUNCH_CHECK();
        col_reduce_k<<<cdiv((size_t)C * W, OPS_T), OPS_T, 0, c->stream>>>(C * W, ns, part, nullptr,
                                                                          dw, nullptr, nullptr);
        CUDA_LAUNCH_CHECK();
    }
    return 0;
}

extern "C" int mtrl_shortconv_state_bwd(mtrl_cuda_ctx *c, int T, int C, int W,
                                        const float *dstate_out, float *dx, float *dstate_in) {
    MTRL_CUDA_REQUIRE(T >= 0 && C >= 1 && W >= 1, "T=%d C=%d W=%d", T, C, W);
    if (W < 2) return 0;
    conv_state_bwd_k<<<ew_grid((size_t)(W - 1) * C), OPS_T, 0, c->stream>>>(T, C, W, dstate_out,
                                                                            dx, dstate_in);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int mtrl_shortconv_step(mtrl_cuda_ctx *c, int B, int C, int W, const float *x1,
                                   const float *w, float *window, float *y1) {
    MTRL_CUDA_REQUIRE(B >= 0 && C >= 1 && W >= 1, "B=%d C=%d W=%d", B, C, W);
    if (!B) return 0;
    conv_step_k<<<ew_grid((size_t)B * C), OPS_T, 0, c->stream>>>(B, C, W, x1, w, window, y1);
    CUDA_LAUNCH_CHECK();
    return 0;
}

// ---- log-prob / entropy over the vocabulary ------------------------------------------------------
//
// One block per row, one pass over the row: each thread keeps the online statistics
// (m, s = Σ e^{l−m}, a = Σ e^{l−m}(l − m)) of its strided part, then the block merges them in
// a fixed order. lse = M + log s, μ = M + a/s (so H = lse − μ).

struct SoftStat {
    float m, s, a;
};
__device__ __forceinline__ SoftStat stat_merge_(SoftStat x, SoftStat y) {
    if (x.m == -INFINITY) return y;
    if (y.m == -INFINITY) return x;
    float M = fmaxf(x.m, y.m), ex = expf(x.m - M), ey = expf(y.m - M);
    SoftStat r;
    r.m = M;
    r.s = x.s * ex + y.s * ey;
    r.a = ex * (x.a + (x.m - M) * x.s) + ey * (y.a + (y.m - M) * y.s);
    return r;
}
__device__ void row_stats_(int V, const float *l, float *lse, float *mu) {
    __shared__ SoftStat sh[32];
    SoftStat st = {-INFINITY, 0.f, 0.f};
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        float x = l[v];
        if (x > st.m) {  // rescale to the new max
            if (st.m != -INFINITY) {
                float e = expf(st.m - x);
                st.a = e * (st.a + (st.m - x) * st.s);
                st.s *= e;
            }
            st.m = x;
        }
        float d = x - st.m, e = expf(d);
        st.s += e;
        st.a = fmaf(e, d, st.a);
    }
    for (int o = 16; o > 0; o >>= 1) {
        SoftStat y;
        y.m = __shfl_xor_sync(0xffffffffu, st.m, o);
        y.s = __shfl_xor_sync(0xffffffffu, st.s, o);
        y.a = __shfl_xor_sync(0xffffffffu, st.a, o);
        st = stat_merge_(st, y);
    }
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) sh[w] = st;
    __syncthreads();
    if (w == 0) {
        SoftStat x = lane < nw ? sh[lane] : SoftStat{-INFINITY, 0.f, 0.f};
        for (int o = 16; o > 0; o >>= 1) {
            SoftStat y;
            y.m = __shfl_xor_sync(0xffffffffu, x.m, o);
            y.s = __shfl_xor_sync(0xffffffffu, x.s, o);
            y.a = __shfl_xor_sync(0xffffffffu, x.a, o);
            x = stat_merge_(x, y);
        }
        if (lane == 0) sh[0] = x;
    }
    __syncthreads();
    SoftStat f = sh[0];
    *lse = f.m + logf(f.s);
    *mu = f.m + f.a / f.s;
}

__global__ void logprob_fwd_k(int V, const float *logits, const int *targets, float *logp,
                              float *entropy) {
    const float *l = logits + (size_t)blockIdx.x * V;
    float lse, mu;
    row_stats_(V, l, &lse, &mu);
    if (threadIdx.x == 0) {
        int t = targets[blockIdx.x];
        logp[blockIdx.x] = t >= 0 ? l[t] - lse : 0.f;
        if (entropy) entropy[blockIdx.x] = lse - mu;
    }
}
__global__ void logprob_bwd_k(int V, const float *logits, const int *targets, const float *dlogp,
                              const float *dentropy, float *dlogits) {
    size_t o = (size_t)blockIdx.x * V;
    const float *l = logits + o;
    float lse, mu;
    row_stats_(V, l, &lse, &mu);
    int t = targets[blockIdx.x];
    float cc = t >= 0 ? dlogp[blockIdx.x] : 0.f, e = dentropy ? dentropy[blockIdx.x] : 0.f;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        float lv = l[v], p = expf(lv - lse);
        float g = -cc * p - e * p * (lv - mu);
        if (v == t) g += cc;
        dlogits[o + v] = g;  // may alias logits: l[v] was read above by this thread only
    }
}
extern "C" int mtrl_logprob_fwd(mtrl_cuda_ctx *c, int N, int V, const float *logits,
                                const int *targets, float *logp, float *entropy) {
    MTRL_CUDA_REQUIRE(N >= 0 && V >= 1, "N=%d V=%d", N, V);
    if (!N) return 0;
    logprob_fwd_k<<<N, 512, 0, c->stream>>>(V, logits, targets, logp, entropy);
    CUDA_LAUNCH_CHECK();
    return 0;
}
extern "C" int mtrl_logprob_bwd(mtrl_cuda_ctx *c, int N, int V, const float *logits,
                                const int *targets, const float *dlogp, const float *dentropy,
                                float *dlogits) {
    MTRL_CUDA_REQUIRE(N >= 0 && V >= 1, "N=%d V=%d", N, V);
    if (!N) return 0;
    logprob_bwd_k<<<N, 512, 0, c->stream>>>(V, logits, targets, dlogp, dentropy, dlogits);
    CUDA_LAUNCH_CHECK();
    return 0;
}

// ---- AdamW --------------------------------------------------------------------------------------

__global__ void adamw_k(size_t n, float *param, const float *grad, float *m, float *v, float lr,
                        float b1, float b2, float eps, float wd, float c1, float c2) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float g = grad[i];
        float mi = b1 * m[i] + (1.f - b1) * g;
        float vi = b2 * v[i] + (1.f - b2) * g * g;
        m[i] = mi;
        v[i] = vi;
        float p = param[i];
        float upd = (mi / c1) / (sqrtf(vi / c2) + eps) + wd * p;
        param[i] = p - lr * upd;
    }
}
extern "C" int mtrl_adamw(mtrl_cuda_ctx *c, size_t n, float *param, const float *grad, float *m,
                          float *v, float lr, float beta1, float beta2, float eps,
                          float weight_decay, long step) {
    MTRL_CUDA_REQUIRE(step >= 1, "step=%ld", step);
    if (!n) return 0;
    float c1 = (float)(1.0 - pow((double)beta1, (double)step)),
          c2 = (float)(1.0 - pow((double)beta2, (double)step));
    adamw_k<<<ew_grid(n), OPS_T, 0, c->stream>>>(n, param, grad, m, v, lr, beta1, beta2, eps,
                                                 weight_decay, c1, c2);
    CUDA_LAUNCH_CHECK();
    return 0;
}

// ---- Block AttnRes site --------------------------------------------------------------------------

#define AR_MAXS 64
struct SrcPtrs {
    const float *p[AR_MAXS];
};
struct DstPtrs {
    float *p[AR_MAXS];
};

// Per token: r_i, z_i = r_i (u · V_i), a = softmax(z) into shared arrays (u = gamma ⊙ w).
__device__ void ar_token_(int D, int S, const SrcPtrs &V, size_t t, const float *w,
                          const float *gamma, float eps, float *r, float *z, float *a,
                          float *red) {
    for (int i = 0; i < S; i++) {
        const float *v = V.p[i] + t * D;
        float ss = 0.f, dot = 0.f;
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            float x = v[d];
            ss = fmaf(x, x, ss);
            dot = fmaf(gamma[d] * w[d], x, dot);
        }
        ss = block_sum(ss, red);
        dot = block_sum(dot, red);
        if (threadIdx.x == 0) {
            r[i] = rsqrtf(ss / D + eps);
            z[i] = r[i] * dot;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float mx = -INFINITY, sum = 0.f;
        for (int i = 0; i < S; i++) mx = fmaxf(mx, z[i]);
        for (int i = 0; i < S; i++) sum += (a[i] = expf(z[i] - mx));
        for (int i = 0; i < S; i++) a[i] /= sum;
    }
    __syncthreads();
}

__global__ void attnres_fwd_k(int D, int S, SrcPtrs V, const float *w, const float *gamma,
                              float eps, float *h, float *alpha) {
    __shared__ float red[33], r[AR_MAXS], z[AR_MAXS], a[AR_MAXS];
    size_t t = blockIdx.x;
    ar_token_(D, S, V, t, w, gamma, eps, r, z, a, red);
    if (alpha && threadIdx.x < S) alpha[t * S + threadIdx.x] = a[threadIdx.x];
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.f;
        for (int i = 0; i < S; i++) acc = fmaf(a[i], V.p[i][t * D + d], acc);
        h[t * D + d] = acc;
    }
}

// dV_i += a_i dh + c_i (u − V_i r_i z_i / D) with c_i = dz_i r_i; cbuf[t][i] = c_i.
__global__ void attnres_bwd_k(int D, int S, SrcPtrs V, const float *w, const float *gamma,
                              float eps, const float *alpha, const float *dh, DstPtrs dV,
                              float *cbuf) {
    __shared__ float red[33], r[AR_MAXS], z[AR_MAXS], a[AR_MAXS], da[AR_MAXS];
    size_t t = blockIdx.x;
    ar_token_(D, S, V, t, w, gamma, eps, r, z, a, red);
    if (alpha) {
        if (threadIdx.x < S) a[threadIdx.x] = alpha[t * S + threadIdx.x];
        __syncthreads();
    }
    for (int i = 0; i < S; i++) {
        const float *v = V.p[i] + t * D;
        float dot = 0.f;
        for (int d = threadIdx.x; d < D; d += blockDim.x) dot = fmaf(dh[t * D + d], v[d], dot);
        dot = block_sum(dot, red);
        if (threadIdx.x == 0) da[i] = dot;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float sad = 0.f;
        for (int i = 0; i < S; i++) sad += a[i] * da[i];
        for (int i = 0; i < S; i++) {
            float dz = a[i] * (da[i] - sad);
            da[i] = dz * r[i];  // c_i
            cbuf[t * S + i] = da[i];
        }
    }
    __syncthreads();
    for (int i = 0; i < S; i++) {
        if (!dV.p[i]) continue;
        const float *v = V.p[i] + t * D;
        float *g = dV.p[i] + t * D;
        float ci = da[i], proj = r[i] * z[i] / D, ai = a[i];
        for (int d = threadIdx.x; d < D; d += blockDim.x)
            g[d] += ai * dh[t * D + d] + ci * (gamma[d] * w[d] - proj * v[d]);
    }
}

// part[split][d] = Σ_{t in split} Σ_i c[t][i] V_i[t][d]
__global__ void attnres_g_part_k(int N, int D, int S, int rows_per, SrcPtrs V, const float *cbuf,
                                 float *part) {
    int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= D) return;
    int t0 = blockIdx.y * rows_per, t1 = t0 + rows_per < N ? t0 + rows_per : N;
    float acc = 0.f;
    for (int t = t0; t < t1; t++)
        for (int i = 0; i < S; i++) acc = fmaf(cbuf[(size_t)t * S + i], V.p[i][(size_t)t * D + d], acc);
    part[(size_t)blockIdx.y * D + d] = acc;
}

extern "C" int mtrl_attnres_site_fwd(mtrl_cuda_ctx *c, int N, int D, int S,
                                     const float *const *V_host, const float *w,
                                     const float *gamma, float eps, float *h, float *alpha) {
    MTRL_CUDA_REQUIRE(N >= 0 && D >= 1 && S >= 1 && S <= AR_MAXS, "N=%d D=%d S=%d", N, D, S);
    if (!N) return 0;
    SrcPtrs V;
    for (int i = 0; i < AR_MAXS; i++) V.p[i] = i < S ? V_host[i] : nullptr;
    attnres_fwd_k<<<N, OPS_T, 0, c->stream>>>(D, S, V, w, gamma, eps, h, alpha);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int mtrl_attnres_site_bwd(mtrl_cuda_ctx *c, int N, int D, int S,
                                     const float *const *V_host, const float *w,
                                     const float *gamma, float eps, const float *alpha,
                                     const float *dh, float *const *dV_host, float *dw,
                                     float *dgamma) {
    MTRL_CUDA_REQUIRE(N >= 0 && D >= 1 && S >= 1 && S <= AR_MAXS, "N=%d D=%d S=%d", N, D, S);
    if (!N) return 0;
    SrcPtrs V;
    DstPtrs dV;
    for (int i = 0; i < AR_MAXS; i++) {
        V.p[i] = i < S ? V_host[i] : nullptr;
        dV.p[i] = i < S ? dV_host[i] : nullptr;
    }
    int ns = row_splits(c, N, D), rows_per = (N + ns - 1) / ns;
    ns = (N + rows_per - 1) / rows_per;
    ws_carver sz{nullptr, 0};
    sz.take<float>((size_t)N * S);
    sz.take<float>((size_t)ns * D);
    ws_carver cv{(char *)mtrl_ctx_scratch(c, sz.off), 0};
    float *cbuf = cv.take<float>((size_t)N * S), *part = cv.take<float>((size_t)ns * D);
    attnres_bwd_k<<<N, OPS_T, 0, c->stream>>>(D, S, V, w, gamma, eps, alpha, dh, dV, cbuf);
    CUDA_LAUNCH_CHECK();
    if (dw || dgamma) {
        attnres_g_part_k<<<dim3(cdiv(D, OPS_T), ns), OPS_T, 0, c->stream>>>(N, D, S, rows_per, V,
                                                                            cbuf, part);
        CUDA_LAUNCH_CHECK();
        // dw += gamma ⊙ G, dgamma += w ⊙ G
        col_reduce_k<<<cdiv(D, OPS_T), OPS_T, 0, c->stream>>>(D, ns, part, gamma, dw, w, dgamma);
        CUDA_LAUNCH_CHECK();
    }
    return 0;
}
