// causal_f32.cu: the causal attention of mla_ref.h (attn_causal_fwd / _bwd) on fp32 operands,
// for checking a model against an fp32 reference ([kernels] attn_operands = fp32): an imported
// checkpoint's logits against transformers', where the bf16 operands of the tiled kernels
// (mla/attn_decode.cu, causal_mma.cu, sm90a/) leave ~5e-3 in the logits.
//
// Plain and exact rather than fast: one block of AF_T threads per (query row, head). The forward
// walks the row's keys in tiles of AF_T (one key per thread: its score as an fp32 dot product),
// with the online softmax over tiles; each thread owns output columns tid, tid + AF_T, ... The
// backward recomputes each row's probabilities from the saved log-sum-exp, adds its dK / dV
// contributions with atomics (so dK, dV are not bit-reproducible; dQ is) and forms dQ in
// registers. Work is O(Tq·Tk·(Dk + Dv)) per head with no reuse of K and V across rows: fine for
// checks and short sequences, far slower than the tiled kernels at training lengths.
#include <math.h>

#include "kernels/cuda/cuda_common.cuh"

#define AF_T 128
#define AF_MAXC 5 // output columns per thread: Dk <= 576 = AF_T * 4.5, Dv <= 512

namespace {

struct F32Args {
    int Tq, Tk, H, G, Dk, Dv, ldk, ldv;
    float scale;
    const float *q, *k, *v;
};

// smem: q row [Dk], p [AF_T], red [33] (block_max / block_sum, cuda_common.cuh)
__global__ void attn_f32_fwd_k(F32Args a, float *o, float *lse) {
    extern __shared__ float sm[];
    float *qs = sm, *ps = sm + a.Dk, *red = ps + AF_T;
    int i = blockIdx.x, h = blockIdx.y, j = h / a.G, tid = threadIdx.x;
    const float *qi = a.q + ((size_t)i * a.H + h) * a.Dk;
    for (int c = tid; c < a.Dk; c += AF_T) qs[c] = qi[c];
    __syncthreads();
    int nk = a.Tk - a.Tq + i + 1; // keys 0 .. the row's position
    float m = -INFINITY, l = 0.f, acc[AF_MAXC];
    for (int r = 0; r < AF_MAXC; r++) acc[r] = 0.f;
    for (int t0 = 0; t0 < nk; t0 += AF_T) {
        int t = t0 + tid;
        float s = -INFINITY;
        if (t < nk) {
            const float *kt = a.k + (size_t)t * a.ldk + (size_t)j * a.Dk;
            double d = 0; // the dot product in fp64: the reference's accumulation
            for (int c = 0; c < a.Dk; c++) d += (double)qs[c] * kt[c];
            s = a.scale * (float)d;
        }
        float mt = block_max(s, red), mn = fmaxf(m, mt);
        float p = t < nk ? expf(s - mn) : 0.f;
        float ls = block_sum(p, red);
        ps[tid] = p;
        __syncthreads();
        float f = m == -INFINITY ? 0.f : expf(m - mn);
        l = l * f + ls;
        int n = min(AF_T, nk - t0);
        for (int r = 0; r < AF_MAXC; r++) {
            int c = tid + r * AF_T;
            if (c >= a.Dv) break;
            float x = acc[r] * f;
            for (int u = 0; u < n; u++) x += ps[u] * a.v[(size_t)(t0 + u) * a.ldv + (size_t)j * a.Dv + c];
            acc[r] = x;
        }
        m = mn;
        __syncthreads();
    }
    float *oi = o + ((size_t)i * a.H + h) * a.Dv;
    for (int r = 0; r < AF_MAXC; r++) {
        int c = tid + r * AF_T;
        if (c < a.Dv) oi[c] = acc[r] / l;
    }
    if (tid == 0) lse[(size_t)i * a.H + h] = m + logf(l);
}

// smem: q row [Dk], dout row [Dv], ds [AF_T], red [33]
__global__ void attn_f32_bwd_k(F32Args a, const float *o, const float *lse, const float *dout, float *dq,
                               float *dk, float *dv) {
    extern __shared__ float sm[];
    float *qs = sm, *dos = qs + a.Dk, *dss = dos + a.Dv, *red = dss + AF_T;
    int i = blockIdx.x, h = blockIdx.y, j = h / a.G, tid = threadIdx.x;
    size_t row = (size_t)i * a.H + h;
    for (int c = tid; c < a.Dk; c += AF_T) qs[c] = a.q[row * a.Dk + c];
    for (int c = tid; c < a.Dv; c += AF_T) dos[c] = dout[row * a.Dv + c];
    __syncthreads();
    float Dp = 0.f; // D = dout · o
    for (int c = tid; c < a.Dv; c += AF_T) Dp += dos[c] * o[row * a.Dv + c];
    Dp = block_sum(Dp, red);
    float L = lse[row], dqa[AF_MAXC];
    for (int r = 0; r < AF_MAXC; r++) dqa[r] = 0.f;
    int nk = a.Tk - a.Tq + i + 1;
    for (int t0 = 0; t0 < nk; t0 += AF_T) {
        int t = t0 + tid;
        float ds = 0.f;
        if (t < nk) {
            const float *kt = a.k + (size_t)t * a.ldk + (size_t)j * a.Dk;
            const float *vt = a.v + (size_t)t * a.ldv + (size_t)j * a.Dv;
            double s = 0, dp = 0;
            for (int c = 0; c < a.Dk; c++) s += (double)qs[c] * kt[c];
            for (int c = 0; c < a.Dv; c++) dp += (double)dos[c] * vt[c];
            float p = expf(a.scale * (float)s - L);
            ds = p * ((float)dp - Dp);
            float *dvt = dv + (size_t)t * a.ldv + (size_t)j * a.Dv, *dkt = dk + (size_t)t * a.ldk + (size_t)j * a.Dk;
            for (int c = 0; c < a.Dv; c++) atomicAdd(&dvt[c], p * dos[c]);
            for (int c = 0; c < a.Dk; c++) atomicAdd(&dkt[c], a.scale * ds * qs[c]);
        }
        dss[tid] = ds;
        __syncthreads();
        int n = min(AF_T, nk - t0);
        for (int r = 0; r < AF_MAXC; r++) {
            int c = tid + r * AF_T;
            if (c >= a.Dk) break;
            float x = dqa[r];
            for (int u = 0; u < n; u++) x += dss[u] * a.k[(size_t)(t0 + u) * a.ldk + (size_t)j * a.Dk + c];
            dqa[r] = x;
        }
        __syncthreads();
    }
    for (int r = 0; r < AF_MAXC; r++) {
        int c = tid + r * AF_T;
        if (c < a.Dk) dq[row * a.Dk + c] = a.scale * dqa[r];
    }
}

int args_(F32Args &a, int Tq, int Tk, int H, int Hk, int Dk, int Dv, float scale, const float *q, const float *k,
          int ldk, const float *v, int ldv) {
    MTRL_CUDA_REQUIRE(Tq >= 0 && Tq <= Tk && H >= 1 && Hk >= 1 && H % Hk == 0 && Dk >= 1 && Dv >= 1 &&
                          Dk <= AF_T * AF_MAXC && Dv <= AF_T * AF_MAXC && ldk >= Hk * Dk && ldv >= Hk * Dv,
                      "Tq=%d Tk=%d H=%d Hk=%d Dk=%d Dv=%d ldk=%d ldv=%d", Tq, Tk, H, Hk, Dk, Dv, ldk, ldv);
    a = F32Args{Tq, Tk, H, H / Hk, Dk, Dv, ldk, ldv, scale, q, k, v};
    return 0;
}

} // namespace

extern "C" int mtrl_attn_causal_fwd_f32(mtrl_cuda_ctx *c, int Tq, int Tk, int H, int Hk, int Dk, int Dv, float scale,
                                        const float *q, const float *k, int ldk, const float *v, int ldv, float *o,
                                        float *lse) {
    F32Args a;
    if (args_(a, Tq, Tk, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv)) return -1;
    if (Tq == 0) return 0;
    size_t sh = sizeof(float) * ((size_t)Dk + AF_T + 33);
    attn_f32_fwd_k<<<dim3(Tq, H), AF_T, sh, c->stream>>>(a, o, lse);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int mtrl_attn_causal_bwd_f32(mtrl_cuda_ctx *c, int Tq, int Tk, int H, int Hk, int Dk, int Dv, float scale,
                                        const float *q, const float *k, int ldk, const float *v, int ldv,
                                        const float *o, const float *lse, const float *dout, float *dq, float *dk,
                                        float *dv) {
    F32Args a;
    if (args_(a, Tq, Tk, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv)) return -1;
    if (Tq == 0) return 0;
    size_t sh = sizeof(float) * ((size_t)Dk + Dv + AF_T + 33);
    attn_f32_bwd_k<<<dim3(Tq, H), AF_T, sh, c->stream>>>(a, o, lse, dout, dq, dk, dv);
    CUDA_LAUNCH_CHECK();
    return 0;
}
