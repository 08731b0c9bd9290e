// attn/args.cuh: the arguments of one causal attention call as the tensor-core kernels see them
// (v2 in attn/causal_mma.cu, the sm_90a wgmma kernels in attn/sm90a/), and the packing of query rows.
//
// Query rows are packed per key head j: row ρ = (token ρ / G, head j G + ρ % G), G = H / Hk, so
// MHA (G = 1) rows are consecutive tokens of one head and MQA rows are all heads of a token.
#ifndef MTRL_ATTN_ARGS_CUH
#define MTRL_ATTN_ARGS_CUH
#include <stdint.h>

#include "kernels/cuda/attn/varlen.cuh"
#include "kernels/cuda/cuda_common.cuh"

struct A2 {
    int Tq, Tk, H, G, off, nrows, Dk, Dv;  // off = Tk - Tq: position of query row 0
    int ldk, ldv;
    float scale, sl2;  // softmax scale, scale * log2(e)
    const uint16_t *q, *k, *v;
};

constexpr float kAttnLog2e = 1.4426950408889634f;

// Index (token * H + head) of packed row rho of key head j.
__device__ __forceinline__ size_t row_ih(const A2 &a, int j, int rho) {
    int i = rho / a.G;
    return (size_t)i * a.H + (size_t)j * a.G + (rho - i * a.G);
}

// lse (base 2, +inf past the last row) and D of packed row rho.
__device__ __forceinline__ void row_lse_d(const A2 &a, int j, int rho, const float *lse,
                                          const float *Dd, float *L, float *D) {
    const size_t ih = rho < a.nrows ? row_ih(a, j, rho) : 0;
    *L = rho < a.nrows ? lse[ih] * kAttnLog2e : INFINITY;
    *D = rho < a.nrows ? Dd[ih] : 0.f;
}

// A varlen block's piece p (attn/varlen.cuh): the pack's arguments narrowed to what the piece's
// own call is given (its Tq, Tk and rows of q, k, v). Returns (first query token, first key) of
// the piece, by which the block offsets its outputs.
__device__ __forceinline__ int2 attn_vl_piece(A2 &a, const AttnVl &vl, int p) {
    const int q0 = vl.qo[p], k0 = vl.ko[p];
    a.Tq = vl.qo[p + 1] - q0;
    a.Tk = vl.ko[p + 1] - k0;
    a.off = a.Tk - a.Tq;
    a.nrows = a.Tq * a.G;
    a.q += (size_t)q0 * a.H * a.Dk;
    a.k += (size_t)k0 * a.ldk;
    a.v += (size_t)k0 * a.ldv;
    return make_int2(q0, k0);
}

static inline A2 attn_args_make(int Tq, int Tk, int H, int Hk, int Dk, int Dv, float scale,
                                const mtrl_bf16 *q, const mtrl_bf16 *k, int ldk,
                                const mtrl_bf16 *v, int ldv) {
    A2 a;
    a.Tq = Tq; a.Tk = Tk; a.H = H; a.G = H / Hk; a.off = Tk - Tq; a.nrows = Tq * (H / Hk);
    a.Dk = Dk; a.Dv = Dv; a.ldk = ldk; a.ldv = ldv;
    a.scale = scale; a.sl2 = scale * kAttnLog2e;
    a.q = (const uint16_t *)q; a.k = (const uint16_t *)k; a.v = (const uint16_t *)v;
    return a;
}

// The sm_90a dK / dV kernel (attn/sm90a/causal_wgmma.cu): launched for Dk = 128 or 192 with Dv = 128
// on a compute capability 9.0 device; returns 1 without launching anything otherwise (the caller
// runs v2), 0 when launched, -1 on a launch error. D = rowsum(dO ⊙ O) per packed row.
// Lt, Dt (MHA rows, else null): lse log2(e) and D head-major, npad rows per head (a multiple of
// 64, +inf and 0 past Tq), which the ping-pong kernel streams by bulk copies.
// vt (nullable): a varlen call's tables (attn/varlen.cuh); a is then the whole pack's (Tq, Tk
// its totals), Lt / Dt per piece at the tables' lo (npad unused).
int attn3_dkv_launch(mtrl_cuda_ctx *c, const A2 &a, int Hk, const uint16_t *dout,
                     const float *lse, const float *D, const float *Lt, const float *Dt, int npad,
                     float *dk, float *dv, const AttnVlTab *vt = nullptr);
// The same for the forward (o, lse overwritten).
int attn3_fwd_launch(mtrl_cuda_ctx *c, const A2 &a, int Hk, float *o, float *lse, const AttnVlTab *vt = nullptr);
// The same for dQ (overwritten).
int attn3_dq_launch(mtrl_cuda_ctx *c, const A2 &a, int Hk, const uint16_t *dout,
                    const float *lse, const float *D, float *dq, const AttnVlTab *vt = nullptr);

#endif
