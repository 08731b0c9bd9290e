// kda/chunk_simt.cu: Kimi Delta Attention on the GPU (model.md §2; the oracle is kernels/ref/kda_ref.c,
// whose chunked form this file mirrors product for product).
//
// Chunked forward, three passes over 16-token tiles (C = 16, midpoint reference row m =
// min(8, c-1), the lower-bounded gate makes every factor lie in [e^-40, e^40], so the diagonal
// tile uses the same "scale the operands, then multiply" path as everything else):
//   1. kda_prep_k, grid (tiles, heads): everything of a tile that does not depend on the state:
//      G = cumsum(g), the scaled operands, M, P, T = (I + M)^-1 (forward substitution, fp32),
//      W = T diag(β) K⁺, U = T diag(β) V, Q⁺, K^e, e^γ. Written to scratch.
//   2. kda_state_fwd_k, grid (V/16, heads): the only sequential part. Each block owns 16 columns
//      of the state (columns of S evolve independently), holds them in registers, and walks the
//      tiles: Δ = U − W S, O = Q⁺ S + P Δ, S' = diag(e^γ) S + K^eᵀ Δ. The next tile's operands
//      stream in with cp.async while the current one is computed.
// Backward (§2.4):
//   1. kda_prep_k again (W, Q⁺, K^e, P, e^γ);
//   2. kda_state_bwd_k, grid (V/16, heads), last tile to first: dΔ = Pᵀ dO + K^e dS',
//      dS ← diag(e^γ) dS' + Q⁺ᵀ dO − Wᵀ dΔ; stores dΔ and every tile's dS';
//   3. kda_tile_bwd_k, grid (tiles, heads): the rest of §2.4 for each tile in parallel, from the
//      tile's incoming S (S_tiles) and outgoing-state gradient dS'. Its default block is 512
//      threads (K = V = 128 folded at compile time), the faster of the two block sizes
//      measured. With v3's pass 2 and H <= 8, pass 2 runs in pieces and each piece's pass 3 on a
//      second stream beside the next piece (kda_bwd_pieces_), which fills the SMs the
//      sequential pass leaves idle.
// Arithmetic is fp32 throughout (SIMT); the state, G, T and all accumulators are fp32.
// Forward v3 (kda/chunk_mma.cu): the same tiles with the products on tensor cores, fp32 state and
// accumulators, for K = V = 128 (16-byte aligned q, k, v, g): the default there, with
// split-bf16 operands (bf16x3, ~16 significant bits), held by test_cuda_kda's v3 cases at 1e-4
// of fp64 and faster than v2 (docs/perf.md); from 256 tiles on at
// H <= 16 its prep runs in pieces beside the state pass (kda3_fwd_pieces_). the option kda_fwd = simt
// (kernel_opts.h) forces v2, the kernels above (fp32 SIMT; every other shape
// runs it). kda_records = bf16 runs v3 with plain bf16 operands (0.39x v2's time): it passes its
// kernel tests at 1e-2 but not the model's (segmented vs whole gradients 0.56 relative at 64K,
// decode vs prefill 0.17 of max |logit|: MoE routing flips and the decay gradient, a small sum of
// large terms, amplify its 4e-3; tests/test_kda_v3_emu.c reproduces this on the CPU).
// Backward v3 (kda/chunk_mma_bwd.cu; the default for K = V = 128, 16-byte aligned q, k, v, g, dout;
// kda_bwd = simt (the option, kernel_opts.h) runs v2's instead): pass 1 writes v3's bf16x3 records instead of v2's
// prep buffers and pass 2 runs on tensor cores with split-bf16 operands over them (recomputed
// states, when S_tiles is NULL, come from v3's bf16x3 forward state pass); pass 3 is unchanged.
// Pass 3 on tensor cores (the default, any shape, with either pass 2; kda_bwd_tile = simt, read at
// each call, runs the SIMT <false>; =3 names the default): pass 3's products
// with S, dS', Δ, dΔ, dO, W, K⁺, V and T (W, U, Δ, dP, dQ⁺, dK^e, dW, Y_W, Y_U, dT) on tensor cores,
// kda_tile_bwd_k<true> through smm16_tc: mma.sync m16n8k16 with bf16x3 operands split as they are
// gathered from fp32 shared memory (scalar loads, no ldmatrix: the staging and layouts stay v2's),
// fp32 accumulators; the intra-tile products (dA, dQ̂, dK̂⁻: operands scaled by e^{±40} at the
// decay's bound, then cancelled in dG) and those with T alone stay SIMT fp32. ptxas (sm_90, nvcc
// 13): 107 registers (<false>: 128), no spills; the same shared memory and grid. tests/test_kda_v3_bwd_emu.c
// emulates its operand rounding: gradients within 2e-5 of fp64 (1.3e-4 in dg at the bound with the
// intra-tile products on tensor cores too, hence SIMT there); test_cuda_kda checks it at v2's
// tolerances. tools/kda_v3/lanes_bwd.py checks smm16_tc's fragment indexing (1e-7). On an H200
// (7b96fd7): test_cuda_kda 2,151 passed, test_cuda_model 280 passed with kda_bwd = auto and with
// both switches; the backward takes 0.96x (pass 2 alone) and 0.88x (both) the SIMT backward's
// time at 8K-256K. test_cuda_long passed with both (88f894a, 18 checks), and both became the
// default (kda_bwd = auto and kda_bwd_tile = auto name it; =2 selects v2's kernels).
//
// Decode step (mtrl_kda_step), two kernels behind one launcher:
//   v2 kda_step2_k (default), grid (V/64, H, B), 256 threads: a block owns 64 columns of one
//      head's state; thread (warp w, lane l) holds rows r0 .. r0+K/16-1, r0 = (2w + l/16) K/16,
//      columns 4 (l%16) .. +3 of the slice as float4 registers. S is read once (16-byte loads,
//      all issued before any arithmetic) and written once; kᵀS̃ and qᵀS' are reduced over rows
//      in registers, across the two half-warps by one shuffle and across the 8 warps through
//      4 KB of shared memory (fixed order). Supports K in {64, 128, 256}, V % 64 == 0 and
//      16-byte aligned pointers; anything else runs v1.
//   v1 kda_step_k: the first version (one block per 32 columns, 4-byte accesses), kept as the
//      fallback and selected for every shape by the option decode = simt
//      (kernel_opts.h).
#include <math.h>
#include <stdlib.h>

#include "kernels/cuda/cuda_common.cuh"

#define KT 16  // tile rows

// ---- small products in shared memory --------------------------------------------------------
//
// C[m][n] = alpha Σ_k A(m,k) B(k,n) + beta C[m][n] with A(m,k) = A[m*sam + k*sak] and
// B(k,n) = B[k*sbk + n*sbn] (so any transpose is a choice of strides). Each thread owns an
// RM x RN micro-tile whose rows/columns are strided (m = mt + p*MT, n = nt + q*NT), so the
// threads of a warp read consecutive columns. beta = 0 overwrites (NaN in C is not kept).
// The caller synchronises before and after.
template <int RM, int RN>
__device__ void smm(int M, int N, int Kd, float alpha, const float *A, int sam, int sak,
                    const float *B, int sbk, int sbn, float beta, float *C, int ldc) {
    int MT = (M + RM - 1) / RM, NT = (N + RN - 1) / RN;
    for (int id = threadIdx.x; id < MT * NT; id += blockDim.x) {
        int mt = id / NT, nt = id % NT;
        float acc[RM][RN];
#pragma unroll
        for (int p = 0; p < RM; p++)
#pragma unroll
            for (int q = 0; q < RN; q++) acc[p][q] = 0.f;
        for (int kk = 0; kk < Kd; kk++) {
            float a[RM], b[RN];
#pragma unroll
            for (int p = 0; p < RM; p++) {
                int m = mt + p * MT;
                a[p] = m < M ? A[m * sam + kk * sak] : 0.f;
            }
#pragma unroll
            for (int q = 0; q < RN; q++) {
                int n = nt + q * NT;
                b[q] = n < N ? B[kk * sbk + n * sbn] : 0.f;
            }
#pragma unroll
            for (int p = 0; p < RM; p++)
#pragma unroll
                for (int q = 0; q < RN; q++) acc[p][q] = fmaf(a[p], b[q], acc[p][q]);
        }
#pragma unroll
        for (int p = 0; p < RM; p++) {
            int m = mt + p * MT;
            if (m >= M) continue;
#pragma unroll
            for (int q = 0; q < RN; q++) {
                int n = nt + q * NT;
                if (n >= N) continue;
                float r = alpha * acc[p][q];
                C[m * ldc + n] = beta == 0.f ? r : r + beta * C[m * ldc + n];
            }
        }
    }
}

// The same for M = 16 on tensor cores (mma.sync m16n8k16), operands split to bf16x3 as they are
// read (a = hi + lo, hi = bf16(a), lo = bf16(a − hi); a_lo b_hi + a_hi b_lo + a_hi b_hi into an fp32
// accumulator, as kda/chunk_mma.cu's bf16x3): ~16 significant bits per product instead of fp32's 24.
// N % 8 == 0, Kd % 16 == 0. Warp w computes the 8-column n-tiles w, w + 8, ... (each over all of
// Kd); fragments are gathered with scalar loads from fp32 shared memory (any strides), so this
// replaces smm call for call. The caller synchronises before and after.
__device__ __forceinline__ void split2_(float a, float b, uint32_t &hi, uint32_t &lo) {
    hi = pack_bf16(a, b);
    lo = pack_bf16(a - bf2f((uint16_t)(hi & 0xffffu)), b - bf2f((uint16_t)(hi >> 16)));
}
// The body of smm16_tc and smm16_tc_pa (a macro, not a function: an inline function or lambda
// changed the kernels' machine code); A_FRAG_ fills ah, al for the k-step at k0.
#define KDA_SMM16_TC_BODY_(A_FRAG_)                                                                     \
    const int lane = threadIdx.x & 31, nw = blockDim.x >> 5, g = lane >> 2, t = lane & 3;               \
    for (int nt = threadIdx.x >> 5; nt < N / 8; nt += nw) {                                             \
        const int n0 = 8 * nt;                                                                          \
        float c[4] = {0.f, 0.f, 0.f, 0.f};                                                              \
        for (int k0 = 0; k0 < Kd; k0 += 16) {                                                           \
            uint32_t ah[4], al[4], bh[2], bl[2];                                                        \
            A_FRAG_;                                                                                    \
            /* B: b[r] = (k = k0 + 2t + 8 r .. +1, column n0 + g) */                                    \
            _Pragma("unroll") for (int r = 0; r < 2; r++) {                                             \
                const int kk = k0 + 2 * t + 8 * r;                                                      \
                split2_(B[kk * sbk + (n0 + g) * sbn], B[(kk + 1) * sbk + (n0 + g) * sbn], bh[r], bl[r]); \
            }                                                                                           \
            mma_bf16_16816(c, al, bh);                                                                  \
            mma_bf16_16816(c, ah, bl);                                                                  \
            mma_bf16_16816(c, ah, bh);                                                                  \
        }                                                                                               \
        /* C: c[r] = (row g + 8 (r >> 1), column n0 + 2t + (r & 1)) */                                  \
        _Pragma("unroll") for (int r = 0; r < 4; r++) {                                                 \
            float *o = C + (g + 8 * (r >> 1)) * ldc + n0 + 2 * t + (r & 1);                             \
            const float v = alpha * c[r];                                                               \
            *o = beta == 0.f ? v : v + beta * *o;                                                       \
        }                                                                                               \
    }
// A: a[r] = (row g + 8 (r & 1), k = k0 + 2t + 8 (r >> 1) .. +1), gathered and split.
#define KDA_A_FRAG_GATHER_(A, sam, sak, g, t, k0, ah, al)                                               \
    _Pragma("unroll") for (int r_ = 0; r_ < 4; r_++) {                                                  \
        const int m_ = (g) + 8 * (r_ & 1), kk_ = (k0) + 2 * (t) + 8 * (r_ >> 1);                        \
        split2_((A)[m_ * (sam) + kk_ * (sak)], (A)[m_ * (sam) + (kk_ + 1) * (sak)], (ah)[r_], (al)[r_]); \
    }
__device__ void smm16_tc(int N, int Kd, float alpha, const float *A, int sam, int sak, const float *B,
                         int sbk, int sbn, float beta, float *C, int ldc) {
    KDA_SMM16_TC_BODY_(KDA_A_FRAG_GATHER_(A, sam, sak, g, t, k0, ah, al))
}
// The same with A's fragments split once for the whole block (split_a16) instead of by every warp
// as it gathers them: a block's warps share the A of a product of 16 rows (each takes its own
// n-tiles of B), so smm16_tc split the same A fragments once per warp. frag[ks * 32 + lane]
// holds, as two uint4 (hi, then lo), the registers lane `lane` passes as A at k-step ks
// (smm16_tc's a[r] = (row g + 8 (r & 1), k = 16 ks + 2t + 8 (r >> 1) .. +1)); the lanes of a warp
// read 32 consecutive 16-byte words. The same values and the same mma order as smm16_tc: the
// same bits. Kd % 16 == 0; the caller synchronises between the split and the product.
__device__ __forceinline__ void split_a16(int Kd, const float *A, int sam, int sak, uint4 *frag, int nth) {
    for (int id = threadIdx.x; id < (Kd / 16) * 32; id += nth) {
        const int ks = id >> 5, ln = id & 31, g = ln >> 2, t = ln & 3;
        uint32_t h[4], l[4];
        KDA_A_FRAG_GATHER_(A, sam, sak, g, t, 16 * ks, h, l)
        frag[2 * id] = make_uint4(h[0], h[1], h[2], h[3]);
        frag[2 * id + 1] = make_uint4(l[0], l[1], l[2], l[3]);
    }
}
__device__ __forceinline__ void smm16_tc_pa(int N, int Kd, float alpha, const uint4 *Af, const float *B, int sbk,
                                            int sbn, float beta, float *C, int ldc) {
    KDA_SMM16_TC_BODY_(const uint4 H = Af[2 * ((k0 >> 4) * 32 + lane)]; const uint4 L = Af[2 * ((k0 >> 4) * 32 + lane) + 1];
                       ah[0] = H.x; ah[1] = H.y; ah[2] = H.z; ah[3] = H.w;
                       al[0] = L.x; al[1] = L.y; al[2] = L.z; al[3] = L.w)
}
// smm with M = KT, on tensor cores (bf16x3) when TC.
template <bool TC, int RM, int RN>
__device__ __forceinline__ void mm16(int N, int Kd, float alpha, const float *A, int sam, int sak,
                                     const float *B, int sbk, int sbn, float beta, float *C, int ldc) {
    if constexpr (TC) smm16_tc(N, Kd, alpha, A, sam, sak, B, sbk, sbn, beta, C, ldc);
    else smm<RM, RN>(16, N, Kd, alpha, A, sam, sak, B, sbk, sbn, beta, C, ldc);
}

// ---- one tile's state-independent part (shared by the forward prep and the tile backward) --

struct TileSh {
    float *q, *k, *G, *v;  // [16][LK] (v: [16][LV]); G holds g, then its row cumsum
    float *A, *Qh, *B;     // K̂⁺, Q̂⁺, K̂⁻ [16][LK]
    float *X, *P, *M, *T;  // [16][17]: X = K̂⁺K̂⁻ᵀ (unmasked), P = Tril(Q̂⁺K̂⁻ᵀ), M, T
    float *b;              // β [16]
    float *Gm, *gam;       // reference row G_m and γ = G_15 [K]
};

// Loads rows t0 .. t0+cr-1 of head h; rows cr..15 are zero (k = q = v = 0, β = 0, g = 0), which
// leaves every real output and S' unchanged (§2.3).
__device__ void tile_load(const TileSh &s, int K, int V, int H, int h, int t0, int cr,
                          const float *q, const float *k, const float *v, const float *g,
                          const float *beta) {
    int LK = K + 1, LV = V + 1;
    for (int i = threadIdx.x; i < KT * K; i += blockDim.x) {
        int r = i / K, d = i % K;
        bool in = r < cr;
        size_t o = ((size_t)(t0 + r) * H + h) * K + d;
        s.q[r * LK + d] = in ? q[o] : 0.f;
        s.k[r * LK + d] = in ? k[o] : 0.f;
        s.G[r * LK + d] = in ? g[o] : 0.f;
    }
    for (int i = threadIdx.x; i < KT * V; i += blockDim.x) {
        int r = i / V, j = i % V;
        s.v[r * LV + j] = r < cr ? v[((size_t)(t0 + r) * H + h) * V + j] : 0.f;
    }
    if (threadIdx.x < KT) {
        int r = threadIdx.x;
        s.b[r] = r < cr ? beta[(size_t)(t0 + r) * H + h] : 0.f;
    }
}

// After tile_load and a barrier: G, γ, G_m, scaled operands, X, P, M, T. Ends with a barrier.
__device__ void tile_prep(const TileSh &s, int K, int cr) {
    int LK = K + 1;
    int m = cr - 1 < 8 ? cr - 1 : 8;
    for (int d = threadIdx.x; d < K; d += blockDim.x) {
        float acc = 0.f;
#pragma unroll
        for (int r = 0; r < KT; r++) {
            acc += s.G[r * LK + d];
            s.G[r * LK + d] = acc;
        }
        s.gam[d] = acc;  // padded rows have g = 0, so G_15 = G_{c-1}
        s.Gm[d] = s.G[m * LK + d];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < KT * K; i += blockDim.x) {
        int r = i / K, d = i % K;
        float G = s.G[r * LK + d], Gm = s.Gm[d];
        float e = expf(G - Gm), ei = expf(Gm - G);
        float kv = s.k[r * LK + d];
        s.A[r * LK + d] = kv * e;
        s.Qh[r * LK + d] = s.q[r * LK + d] * e;
        s.B[r * LK + d] = kv * ei;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < KT * KT; idx += blockDim.x) {
        int i = idx >> 4, j = idx & 15;
        float x = 0.f, p = 0.f;
        const float *a = s.A + i * LK, *qh = s.Qh + i * LK, *bb = s.B + j * LK;
        for (int d = 0; d < K; d++) {
            x = fmaf(a[d], bb[d], x);
            p = fmaf(qh[d], bb[d], p);
        }
        // Mask by select, never by multiply: the masked entries may be large (§2.5).
        s.X[i * 17 + j] = x;
        s.M[i * 17 + j] = j < i ? s.b[i] * x : 0.f;
        s.P[i * 17 + j] = j <= i ? p : 0.f;
    }
    __syncthreads();
    // T = (I + M)^-1 by forward substitution: lane j owns column j of T.
    if (threadIdx.x < KT) {
        int j = threadIdx.x;
        float col[KT];
#pragma unroll
        for (int i = 0; i < KT; i++) {
            float acc = 0.f;
#pragma unroll
            for (int l = 0; l < i; l++) acc = fmaf(s.M[i * 17 + l], col[l], acc);
            col[i] = i == j ? 1.f : (i > j ? -acc : 0.f);
        }
#pragma unroll
        for (int i = 0; i < KT; i++) s.T[i * 17 + j] = col[i];
    }
    __syncthreads();
}

__host__ __device__ static size_t tile_sh_floats(int K, int V) {
    return (size_t)6 * KT * (K + 1) + (size_t)KT * (V + 1) + 4 * KT * 17 + KT + 2 * K;
}
__device__ float *tile_sh_carve(TileSh &s, float *p, int K, int V) {
    int LK = K + 1, LV = V + 1;
    s.q = p; p += KT * LK;
    s.k = p; p += KT * LK;
    s.G = p; p += KT * LK;
    s.A = p; p += KT * LK;
    s.Qh = p; p += KT * LK;
    s.B = p; p += KT * LK;
    s.v = p; p += KT * LV;
    s.X = p; p += KT * 17;
    s.P = p; p += KT * 17;
    s.M = p; p += KT * 17;
    s.T = p; p += KT * 17;
    s.b = p; p += KT;
    s.Gm = p; p += K;
    s.gam = p; p += K;
    return p;
}

// ---- pass 1: per-tile preparation ------------------------------------------------------------
//
// Scratch layouts (Tp = 16 * tiles): Wk, Qp, Ke [H][Tp][K]; Uk [H][Tp][V]; Pm [H][tiles][16][16];
// eg [H][tiles][K] (= e^γ). Padded rows are written as zeros.
__global__ void __launch_bounds__(256) kda_prep_k(int T, int H, int K, int V, const float *q,
                                                  const float *k, const float *v,
                                                  const float *g, const float *beta, float *Wk,
                                                  float *Uk, float *Qp, float *Ke, float *Pm,
                                                  float *eg) {
    extern __shared__ float sm[];
    TileSh s;
    float *Ush = tile_sh_carve(s, sm, K, V);  // [16][LV] after the tile arrays
    int n = blockIdx.x, h = blockIdx.y, nt = gridDim.x, t0 = n * KT;
    int cr = T - t0 < KT ? T - t0 : KT;
    size_t Tp = (size_t)nt * KT;
    int LK = K + 1, LV = V + 1;
    tile_load(s, K, V, H, h, t0, cr, q, k, v, g, beta);
    __syncthreads();
    tile_prep(s, K, cr);
    // W = T diag(β) K⁺ and U = T diag(β) V (K̂⁺ and Q̂⁺ are no longer needed: reuse them).
    float *Kb = s.A, *Wsh = s.Qh;
    for (int i = threadIdx.x; i < KT * K; i += blockDim.x) {
        int r = i / K, d = i % K;
        Kb[r * LK + d] = s.b[r] * s.k[r * LK + d] * expf(s.G[r * LK + d]);
    }
    for (int i = threadIdx.x; i < KT * V; i += blockDim.x) {
        int r = i / V, j = i % V;
        s.v[r * LV + j] *= s.b[r];
    }
    __syncthreads();
    smm<1, 4>(KT, K, KT, 1.f, s.T, 17, 1, Kb, LK, 1, 0.f, Wsh, LK);
    smm<1, 4>(KT, V, KT, 1.f, s.T, 17, 1, s.v, LV, 1, 0.f, Ush, LV);
    __syncthreads();
    for (int i = threadIdx.x; i < KT * K; i += blockDim.x) {
        int r = i / K, d = i % K;
        Wk[((size_t)h * Tp + t0 + r) * K + d] = Wsh[r * LK + d];
    }
    for (int i = threadIdx.x; i < KT * V; i += blockDim.x) {
        int r = i / V, j = i % V;
        Uk[((size_t)h * Tp + t0 + r) * V + j] = Ush[r * LV + j];
    }
    for (int i = threadIdx.x; i < KT * K; i += blockDim.x) {
        int r = i / K, d = i % K;
        float G = s.G[r * LK + d];
        size_t o = ((size_t)h * Tp + t0 + r) * K + d;
        Qp[o] = s.q[r * LK + d] * expf(G);
        Ke[o] = s.k[r * LK + d] * expf(s.gam[d] - G);
    }
    for (int d = threadIdx.x; d < K; d += blockDim.x)
        eg[((size_t)h * nt + n) * K + d] = expf(s.gam[d]);
    for (int i = threadIdx.x; i < KT * KT; i += blockDim.x)
        Pm[((size_t)h * nt + n) * KT * KT + i] = s.P[(i >> 4) * 17 + (i & 15)];
}

// ---- pass 2: the sequential state pass, forward ------------------------------------------------

#define VS 16  // state columns per block
#define RGS 272  // stride of one row group in the reduction buffers (16 x 16 + 16: no conflicts)

// Per-tile operand buffer of the state passes (one of two, double-buffered).
struct StBuf {
    float *W, *Q, *E;  // [16][K]: W, Q⁺, K^e
    float *U;          // [16][16]: U (fwd) or dO (bwd), this block's 16 columns
    float *P;          // [16][16]
    float *eg;         // [K]
};
__host__ __device__ static size_t stbuf_floats(int K) { return (size_t)3 * KT * K + 2 * KT * KT + K; }
__device__ void stbuf_carve(StBuf &b, float *p, int K) {
    b.W = p; p += KT * K;
    b.Q = p; p += KT * K;
    b.E = p; p += KT * K;
    b.U = p; p += KT * KT;
    b.P = p; p += KT * KT;
    b.eg = p;
}
// Issues the cp.async copies of tile n into buffer b (uv: the [..][V] source of U or dO, with
// row index (uv_row0 + r) and a validity bound on rows for dO).
__device__ void stbuf_load(const StBuf &b, int K, int V, int h, int n, int nt, size_t Tp,
                           const float *Wk, const float *Qp, const float *Ke, const float *Pm,
                           const float *eg, const float *uv, size_t uv_stride_row,
                           size_t uv_off, int uv_rows, int j0) {
    size_t base = ((size_t)h * Tp + (size_t)n * KT) * K;
    int nk = KT * K / 4;
    for (int i = threadIdx.x; i < nk; i += blockDim.x) {
        cp_async16(b.W + 4 * i, Wk + base + 4 * i);
        cp_async16(b.Q + 4 * i, Qp + base + 4 * i);
        cp_async16(b.E + 4 * i, Ke + base + 4 * i);
    }
    for (int i = threadIdx.x; i < KT * 4; i += blockDim.x) {
        int r = i >> 2, c4 = (i & 3) * 4;
        bool ok = r < uv_rows;
        const float *src = ok ? uv + uv_off + (size_t)r * uv_stride_row + j0 + c4 : uv;
        cp_async16_pred(b.U + r * KT + c4, src, ok);
        cp_async16(b.P + 4 * i, Pm + ((size_t)h * nt + n) * KT * KT + 4 * i);
    }
    for (int i = threadIdx.x; i < K / 4; i += blockDim.x)
        cp_async16(b.eg + 4 * i, eg + ((size_t)h * nt + n) * K + 4 * i);
}

// NR consecutive floats from shared memory (16-byte loads when NR % 4 == 0; p aligned then).
template <int NR>
__device__ __forceinline__ void ld_part(float *x, const float *p) {
    if constexpr (NR % 4 == 0) {
#pragma unroll
        for (int i = 0; i < NR; i += 4) {
            float4 v = *reinterpret_cast<const float4 *>(p + i);
            x[i] = v.x; x[i + 1] = v.y; x[i + 2] = v.z; x[i + 3] = v.w;
        }
    } else if constexpr (NR % 2 == 0) {
#pragma unroll
        for (int i = 0; i < NR; i += 2) {
            float2 v = *reinterpret_cast<const float2 *>(p + i);
            x[i] = v.x; x[i + 1] = v.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < NR; i++) x[i] = p[i];
    }
}

// grid (V/16, H), 256 threads: thread t owns column jj = t & 15 of the block's 16 and the NR =
// K/16 consecutive state rows d = rg NR + i (rg = t >> 4), so its slices of the W, Q⁺, K^e rows
// are contiguous (vector loads).
template <int NR>
__global__ void __launch_bounds__(256) kda_state_fwd_k(int T, int H, int K, int V, int nt,
                                                       const float *Wk, const float *Uk,
                                                       const float *Qp, const float *Ke,
                                                       const float *Pm, const float *eg,
                                                       const float *S0, float *o,
                                                       float *S_final, float *S_tiles) {
    extern __shared__ __align__(16) float sm[];
    int h = blockIdx.y, j0 = blockIdx.x * VS;
    int jj = threadIdx.x & 15, rg = threadIdx.x >> 4, d0 = rg * NR;
    size_t Tp = (size_t)nt * KT;
    size_t stf = stbuf_floats(K);
    float *p = sm + 2 * stf;
    float *redW = p; p += 16 * RGS;
    float *redQ = p; p += 16 * RGS;
    float *sD = p;  // Δ [16][16]

    float s[NR];
#pragma unroll
    for (int i = 0; i < NR; i++) s[i] = S0 ? S0[((size_t)h * K + d0 + i) * V + j0 + jj] : 0.f;
    {
        StBuf b0;
        stbuf_carve(b0, sm, K);
        stbuf_load(b0, K, V, h, 0, nt, Tp, Wk, Qp, Ke, Pm, eg, Uk, V, (size_t)h * Tp * V, KT, j0);
        cp_async_commit();
    }
    for (int n = 0; n < nt; n++) {
        StBuf b, bn;
        stbuf_carve(b, sm + (n & 1) * stf, K);
        stbuf_carve(bn, sm + ((n + 1) & 1) * stf, K);
        cp_async_wait<0>();
        __syncthreads();
        if (n + 1 < nt) {
            stbuf_load(bn, K, V, h, n + 1, nt, Tp, Wk, Qp, Ke, Pm, eg, Uk, V,
                       ((size_t)h * Tp + (size_t)(n + 1) * KT) * V, KT, j0);
            cp_async_commit();
        }
        if (S_tiles) {
#pragma unroll
            for (int i = 0; i < NR; i++)
                S_tiles[(((size_t)n * H + h) * K + d0 + i) * V + j0 + jj] = s[i];
        }
        // Partial products over this thread's rows: W S and Q⁺ S for all 16 tile rows.
#pragma unroll
        for (int r = 0; r < KT; r++) {
            float wv[NR], qv[NR], pw = 0.f, pq = 0.f;
            ld_part<NR>(wv, b.W + r * K + d0);
            ld_part<NR>(qv, b.Q + r * K + d0);
#pragma unroll
            for (int i = 0; i < NR; i++) {
                pw = fmaf(wv[i], s[i], pw);
                pq = fmaf(qv[i], s[i], pq);
            }
            redW[rg * RGS + r * 16 + jj] = pw;
            redQ[rg * RGS + r * 16 + jj] = pq;
        }
        __syncthreads();
        // Thread (jj, r = rg): Δ[r][jj] = U − Σ (W S), and the Q⁺ S part of O.
        int r = rg;
        float ws = 0.f, qs = 0.f;
#pragma unroll
        for (int g2 = 0; g2 < 16; g2++) {
            ws += redW[g2 * RGS + r * 16 + jj];
            qs += redQ[g2 * RGS + r * 16 + jj];
        }
        sD[r * 16 + jj] = b.U[r * KT + jj] - ws;
        __syncthreads();
        if (o) {
            float acc = qs;
            for (int l = 0; l <= r; l++) acc = fmaf(b.P[r * KT + l], sD[l * 16 + jj], acc);
            int t = n * KT + r;
            if (t < T) o[((size_t)t * H + h) * V + j0 + jj] = acc;
        }
        // S' = diag(e^γ) S + K^eᵀ Δ.
        float ev[NR];
        ld_part<NR>(ev, b.eg + d0);
#pragma unroll
        for (int i = 0; i < NR; i++) s[i] *= ev[i];
#pragma unroll
        for (int l = 0; l < KT; l++) {
            float kv[NR], dl = sD[l * 16 + jj];
            ld_part<NR>(kv, b.E + l * K + d0);
#pragma unroll
            for (int i = 0; i < NR; i++) s[i] = fmaf(kv[i], dl, s[i]);
        }
    }
    if (S_final) {
#pragma unroll
        for (int i = 0; i < NR; i++) S_final[((size_t)h * K + d0 + i) * V + j0 + jj] = s[i];
    }
}

// ---- backward pass 2: the sequential state-gradient pass -------------------------------------
//
// grid (V/16, H), last tile to first. Writes dD = dΔ [H][Tp][V] and dS_tiles [tiles][H][K][V]
// (tile n's entry is ∂L/∂S' of tile n, i.e. the gradient of its OUTGOING state).
template <int NR>
__global__ void __launch_bounds__(256) kda_state_bwd_k(int T, int H, int K, int V, int nt,
                                                       const float *Wk, const float *Qp,
                                                       const float *Ke, const float *Pm,
                                                       const float *eg, const float *dout,
                                                       const float *dS_final, float *dD,
                                                       float *dS_tiles, float *dS0) {
    extern __shared__ __align__(16) float sm[];
    int h = blockIdx.y, j0 = blockIdx.x * VS;
    int jj = threadIdx.x & 15, rg = threadIdx.x >> 4, d0 = rg * NR;
    size_t Tp = (size_t)nt * KT;
    size_t stf = stbuf_floats(K);
    float *p = sm + 2 * stf;
    float *redE = p; p += 16 * RGS;
    float *sdD = p;  // dΔ [16][16]

    float s[NR];  // dS for rows d0 + i, column jj
#pragma unroll
    for (int i = 0; i < NR; i++)
        s[i] = dS_final ? dS_final[((size_t)h * K + d0 + i) * V + j0 + jj] : 0.f;
    auto load = [&](int n, const StBuf &b) {
        int rows = T - n * KT < KT ? T - n * KT : KT;
        stbuf_load(b, K, V, h, n, nt, Tp, Wk, Qp, Ke, Pm, eg, dout, (size_t)H * V,
                   ((size_t)n * KT * H + h) * V, rows, j0);
        cp_async_commit();
    };
    {
        StBuf b0;
        stbuf_carve(b0, sm + ((nt - 1) & 1) * stf, K);
        load(nt - 1, b0);
    }
    for (int n = nt - 1; n >= 0; n--) {
        StBuf b, bn;
        stbuf_carve(b, sm + (n & 1) * stf, K);
        stbuf_carve(bn, sm + ((n + 1) & 1) * stf, K);  // (n - 1) & 1 == (n + 1) & 1
        cp_async_wait<0>();
        __syncthreads();
        if (n > 0) load(n - 1, bn);
#pragma unroll
        for (int i = 0; i < NR; i++)
            dS_tiles[(((size_t)n * H + h) * K + d0 + i) * V + j0 + jj] = s[i];
#pragma unroll
        for (int r = 0; r < KT; r++) {
            float ev[NR], pe = 0.f;
            ld_part<NR>(ev, b.E + r * K + d0);
#pragma unroll
            for (int i = 0; i < NR; i++) pe = fmaf(ev[i], s[i], pe);
            redE[rg * RGS + r * 16 + jj] = pe;
        }
        __syncthreads();
        {
            int r = rg;
            float acc = 0.f;
#pragma unroll
            for (int g2 = 0; g2 < 16; g2++) acc += redE[g2 * RGS + r * 16 + jj];
            // + (Pᵀ dO)[r][jj] = Σ_{l >= r} P[l][r] dO[l][jj]
            for (int l = r; l < KT; l++) acc = fmaf(b.P[l * KT + r], b.U[l * KT + jj], acc);
            sdD[r * 16 + jj] = acc;
            dD[((size_t)h * Tp + (size_t)n * KT + r) * V + j0 + jj] = acc;
        }
        __syncthreads();
        // dS ← diag(e^γ) dS' + Q⁺ᵀ dO − Wᵀ dΔ
        float gv[NR];
        ld_part<NR>(gv, b.eg + d0);
#pragma unroll
        for (int i = 0; i < NR; i++) s[i] *= gv[i];
#pragma unroll
        for (int l = 0; l < KT; l++) {
            float qv[NR], wv[NR], go = b.U[l * KT + jj], gd = sdD[l * 16 + jj];
            ld_part<NR>(qv, b.Q + l * K + d0);
            ld_part<NR>(wv, b.W + l * K + d0);
#pragma unroll
            for (int i = 0; i < NR; i++) s[i] = fmaf(qv[i], go, fmaf(-wv[i], gd, s[i]));
        }
    }
    if (dS0) {
#pragma unroll
        for (int i = 0; i < NR; i++) dS0[((size_t)h * K + d0 + i) * V + j0 + jj] = s[i];
    }
}

// ---- backward pass 3: everything else, per tile in parallel ------------------------------------

#define CW 32  // state columns staged in shared memory at a time
#define LC 33

// Pre-split A fragments (split_a16) of W (K / 16 k-steps) and of a chunk of dO, Δ, dΔ (CW / 16
// each), 8 floats per lane and k-step, + 4 floats to align them to 16 bytes.
static size_t tile_bwd_frag_floats(int K) { return 4 + ((size_t)K / 16 + 3 * (CW / 16)) * 32 * 8; }
static size_t tile_bwd_floats(int K, int V) {
    size_t LK = K + 1, LV = V + 1;
    return tile_sh_floats(K, V) + 8 * KT * LK /* Kp Wm dQp dKe dW dA dQh dB */ +
           3 * KT * LV /* Dl dD dO */ + 2 * (size_t)K * LC + 5 * KT * 17 /* dP dT tmp dM ... */ +
           KT /* db */ + K /* dgS */ + tile_bwd_frag_floats(K);
}

// TC: the products of 16 rows on tensor cores with bf16x3 operands (smm16_tc; the default,
// kda_bwd_tile = simt runs <false>), except the two 16 x 16 x 16 with T and the four intra-tile ones (dA, dQ̂, dK̂⁻), which stay
// SIMT fp32 (smm) as without TC.
// NTH threads (the default 512 with TC; kda_tile_threads = 256 runs the earlier 256): the
// block takes the SM's shared memory alone (194 KB), so its warps are all the SM has to hide
// latency with (Nsight Compute at 256: 2 warps per scheduler, 0.27 eligible, 38% of the stalls on
// global loads). The column chunks of S and dS' are fetched into registers one chunk ahead (PF
// elements each a thread, K <= 128; larger K loads each chunk when it is used), so their global
// latency overlaps the previous chunk's products; chunk 0's is issued before the tile loads.
// KV = 128: K = V = 128 known at compile time (the default shape; the index arithmetic of every
// loop folds: no integer division by a runtime K or V), 0: K_ and V_ as passed.
// kda_tile_bwd_: tile n of head h of a sequence of T tokens; row r of the tile in dD [H][16 nt][V]
// at dD + (16 (h nt + n) + r) V (a whole sequence: its nt tiles; a piece of a pack,
// kda_vl_tile_bwd_k: its group's NT, with dD, S_tiles and dS_tiles at the piece's first tile). kda_tile_bwd_k's body, a
// function so that the varlen pass runs the same code: both are inlined from here.
template <bool TC, int NTH, int KV>
__device__ __forceinline__ void kda_tile_bwd_(int T, int H, int K_, int V_, int nt, int n, int h, const float *q,
                                              const float *k, const float *v, const float *g, const float *beta,
                                              const float *S_tiles, const float *dout, const float *dD,
                                              const float *dS_tiles, float *dq, float *dk, float *dv, float *dg,
                                              float *dbeta) {
    const int K = KV ? KV : K_, V = KV ? KV : V_;
    extern __shared__ float sm[];
    TileSh s;
    float *p = tile_sh_carve(s, sm, K, V);
    int LK = K + 1, LV = V + 1;
    float *Kp = p; p += KT * LK;
    float *Wm = p; p += KT * LK;   // W, then Y_W = Tᵀ dW
    float *dQp = p; p += KT * LK;  // dQ⁺, then dQ
    float *dKe = p; p += KT * LK;  // dK^e, then dK
    float *dW = p; p += KT * LK;   // dW, then dG
    float *dA = p; p += KT * LK;
    float *dQh = p; p += KT * LK;
    float *dB = p; p += KT * LK;
    float *Dl = p; p += KT * LV;   // U, then Δ
    float *sdD = p; p += KT * LV;  // dΔ
    float *sdO = p; p += KT * LV;  // dO, then Y_U
    float *Sc = p; p += K * LC;    // S[:, chunk]
    float *dSc = p; p += K * LC;   // dS'[:, chunk]
    float *dP = p; p += KT * 17;
    float *dT = p; p += KT * 17;
    float *tmp = p; p += KT * 17;
    float *dM = p; p += KT * 17;
    p += KT * 17;                  // spare
    float *db = p; p += KT;
    float *dgS = p; p += K;        // dγ_S, then dγ
    // PA (K = V = 128 on tensor cores): the chunk products' A operands split once a block
    // (split_a16): W for Δ; the chunk of dO (dP, dQ⁺), Δ (dK^e) and dΔ (dW).
    constexpr bool PA = TC && KV == 128;
    p = (float *)(((uintptr_t)p + 15) & ~(uintptr_t)15);
    uint4 *fW = (uint4 *)p, *fO = fW + 2 * 32 * (K / 16), *fL = fO + 2 * 32 * (CW / 16), *fD = fL + 2 * 32 * (CW / 16);

    int t0 = n * KT;
    int cr = T - t0 < KT ? T - t0 : KT;
    size_t Tp = (size_t)nt * KT;
    const float *S = S_tiles + ((size_t)n * H + h) * K * V;
    const float *dS = dS_tiles + ((size_t)n * H + h) * K * V;

    // Chunk prefetch: element u of this thread is i = tid + u NTH of the K x cw chunk (d = i / cw,
    // j = i % cw), as the direct copy below orders it.
    constexpr int PF = 128 * CW / NTH;
    const bool pf = K * CW <= PF * NTH;
    float rS[PF], rD[PF];
    auto fetch = [&](int c0) {
        const int cw = V - c0 < CW ? V - c0 : CW;
#pragma unroll
        for (int u = 0; u < PF; u++) {
            const int i = threadIdx.x + u * NTH, d = i / cw, j = i % cw;
            if (i < K * cw) {
                rS[u] = S[(size_t)d * V + c0 + j];
                rD[u] = dS[(size_t)d * V + c0 + j];
            }
        }
    };
    if (pf) fetch(0);

    tile_load(s, K, V, H, h, t0, cr, q, k, v, g, beta);
    for (int i = threadIdx.x; i < KT * V; i += NTH) {
        int r = i / V, j = i % V;
        sdO[r * LV + j] = r < cr ? dout[((size_t)(t0 + r) * H + h) * V + j] : 0.f;
        sdD[r * LV + j] = dD[((size_t)h * Tp + t0 + r) * V + j];
    }
    __syncthreads();
    tile_prep(s, K, cr);
    // K⁺, then W = T diag(β) K⁺ and U = T diag(β) V.
    for (int i = threadIdx.x; i < KT * K; i += NTH) {
        int r = i / K, d = i % K;
        Kp[r * LK + d] = s.k[r * LK + d] * expf(s.G[r * LK + d]);
    }
    for (int i = threadIdx.x; i < KT * KT; i += NTH) {
        int r = i >> 4, l = i & 15;
        tmp[r * 17 + l] = s.T[r * 17 + l] * s.b[l];  // T diag(β)
    }
    for (int i = threadIdx.x; i < KT * 17; i += NTH) dP[i] = 0.f;
    for (int i = threadIdx.x; i < KT * LK; i += NTH) dQp[i] = dKe[i] = dW[i] = 0.f;
    for (int d = threadIdx.x; d < K; d += NTH) dgS[d] = 0.f;
    __syncthreads();
    mm16<TC, 1, 4>(K, KT, 1.f, tmp, 17, 1, Kp, LK, 1, 0.f, Wm, LK);
    mm16<TC, 1, 4>(V, KT, 1.f, tmp, 17, 1, s.v, LV, 1, 0.f, Dl, LV);
    __syncthreads();
    if constexpr (PA) split_a16(K, Wm, LK, 1, fW, NTH);  // used after the chunk loop's first barrier
    // Column chunks of S and dS': Δ = U − W S, dP += dO Δᵀ, dQ⁺ += dO Sᵀ, dK^e += Δ dS'ᵀ,
    // dW −= dΔ Sᵀ, dγ_S += rowsum(S ⊙ dS').
    for (int c0 = 0; c0 < V; c0 += CW) {
        int cw = V - c0 < CW ? V - c0 : CW;
        if (pf) {
#pragma unroll
            for (int u = 0; u < PF; u++) {
                const int i = threadIdx.x + u * NTH, d = i / cw, j = i % cw;
                if (i < K * cw) {
                    Sc[d * LC + j] = rS[u];
                    dSc[d * LC + j] = rD[u];
                }
            }
        } else {
            for (int i = threadIdx.x; i < K * cw; i += NTH) {
                int d = i / cw, j = i % cw;
                Sc[d * LC + j] = S[(size_t)d * V + c0 + j];
                dSc[d * LC + j] = dS[(size_t)d * V + c0 + j];
            }
        }
        if constexpr (PA) {
            split_a16(cw, sdO + c0, LV, 1, fO, NTH);
            split_a16(cw, sdD + c0, LV, 1, fD, NTH);
        }
        __syncthreads();
        if (pf && c0 + CW < V) fetch(c0 + CW);  // in flight during this chunk's products
        if constexpr (PA) smm16_tc_pa(cw, K, -1.f, fW, Sc, LC, 1, 1.f, Dl + c0, LV);
        else mm16<TC, 1, 2>(cw, K, -1.f, Wm, LK, 1, Sc, LC, 1, 1.f, Dl + c0, LV);
        for (int d = threadIdx.x; d < K; d += NTH) {
            float acc = 0.f;
            for (int j = 0; j < cw; j++) acc = fmaf(Sc[d * LC + j], dSc[d * LC + j], acc);
            dgS[d] += acc;
        }
        __syncthreads();
        if constexpr (PA) {
            split_a16(cw, Dl + c0, LV, 1, fL, NTH);
            __syncthreads();
            smm16_tc_pa(KT, cw, 1.f, fO, Dl + c0, 1, LV, 1.f, dP, 17);
            smm16_tc_pa(K, cw, 1.f, fO, Sc, 1, LC, 1.f, dQp, LK);
            smm16_tc_pa(K, cw, 1.f, fL, dSc, 1, LC, 1.f, dKe, LK);
            smm16_tc_pa(K, cw, -1.f, fD, Sc, 1, LC, 1.f, dW, LK);
        } else {
            mm16<TC, 1, 1>(KT, cw, 1.f, sdO + c0, LV, 1, Dl + c0, 1, LV, 1.f, dP, 17);
            mm16<TC, 2, 4>(K, cw, 1.f, sdO + c0, LV, 1, Sc, 1, LC, 1.f, dQp, LK);
            mm16<TC, 2, 4>(K, cw, 1.f, Dl + c0, LV, 1, dSc, 1, LC, 1.f, dKe, LK);
            mm16<TC, 2, 4>(K, cw, -1.f, sdD + c0, LV, 1, Sc, 1, LC, 1.f, dW, LK);
        }
        __syncthreads();
    }
    // dγ_S = e^γ ⊙ rowsum(S ⊙ dS')
    for (int d = threadIdx.x; d < K; d += NTH) dgS[d] *= expf(s.gam[d]);
    // Y_W = Tᵀ dW (into Wm), Y_U = Tᵀ dΔ (into sdO), dT = dW (diag(β)K⁺)ᵀ + dΔ (diag(β)V)ᵀ.
    mm16<TC, 1, 4>(K, KT, 1.f, s.T, 1, 17, dW, LK, 1, 0.f, Wm, LK);
    mm16<TC, 1, 4>(V, KT, 1.f, s.T, 1, 17, sdD, LV, 1, 0.f, sdO, LV);
    mm16<TC, 1, 1>(KT, K, 1.f, dW, LK, 1, Kp, 1, LK, 0.f, dT, 17);
    __syncthreads();
    mm16<TC, 1, 1>(KT, V, 1.f, sdD, LV, 1, s.v, 1, LV, 1.f, dT, 17);
    __syncthreads();
    for (int i = threadIdx.x; i < KT * KT; i += NTH) {
        int r = i >> 4, l = i & 15;
        dT[r * 17 + l] *= s.b[l];
    }
    __syncthreads();
    // dM = StrictTril(−Tᵀ dT Tᵀ)
    smm<1, 1>(KT, KT, KT, 1.f, s.T, 1, 17, dT, 17, 1, 0.f, tmp, 17);
    __syncthreads();
    smm<1, 1>(KT, KT, KT, -1.f, tmp, 17, 1, s.T, 1, 17, 0.f, dM, 17);
    __syncthreads();
    // dβ_i = Σ K⁺⊙Y_W + Σ V⊙Y_U + Σ_{j<i} dM ⊙ X; then dM ← diag(β) dM (masked), dP masked.
    {
        int w = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = NTH >> 5;
        for (int i = w; i < KT; i += nw) {
            float acc = 0.f;
            for (int d = lane; d < K; d += 32) acc = fmaf(Kp[i * LK + d], Wm[i * LK + d], acc);
            for (int j = lane; j < V; j += 32) acc = fmaf(s.v[i * LV + j], sdO[i * LV + j], acc);
            if (lane < i) acc = fmaf(dM[i * 17 + lane], s.X[i * 17 + lane], acc);
            acc = warp_sum(acc);
            if (lane == 0) db[i] = acc;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < KT * KT; i += NTH) {
        int r = i >> 4, l = i & 15;
        dM[r * 17 + l] = l < r ? s.b[r] * dM[r * 17 + l] : 0.f;
        if (l > r) dP[r * 17 + l] = 0.f;
    }
    // dV = diag(β) Y_U
    for (int i = threadIdx.x; i < KT * V; i += NTH) {
        int r = i / V, j = i % V;
        if (r < cr) dv[((size_t)(t0 + r) * H + h) * V + j] = s.b[r] * sdO[r * LV + j];
    }
    // Inter-tile operands back to the unscaled inputs, one column d per thread:
    //   dQ = dQ⁺ e^G, dK = β Y_W e^G + dK^e e^{γ−G}, dG = Q tq + K tk − K te,
    //   dγ = dγ_S + Σ_r K te.
    for (int d = threadIdx.x; d < K; d += NTH) {
        float gsum = 0.f, gm = s.gam[d];
        for (int r = 0; r < KT; r++) {
            int i = r * LK + d;
            float G = s.G[i];
            float e1 = expf(G), e2 = expf(gm - G);
            float tq = dQp[i] * e1, tk = s.b[r] * Wm[i] * e1, te = dKe[i] * e2;
            float kv = s.k[i];
            dQp[i] = tq;
            dKe[i] = tk + te;
            dW[i] = s.q[i] * tq + kv * tk - kv * te;
            gsum = fmaf(kv, te, gsum);
        }
        dgS[d] += gsum;
    }
    __syncthreads();
    // Intra-tile blocks: dK̂⁺ = diag(β)dM K̂⁻, dQ̂⁺ = dP K̂⁻, dK̂⁻ = (diag(β)dM)ᵀ K̂⁺ + dPᵀ Q̂⁺.
    // fp32 SIMT even with TC: the scaled operands span e^{±40} at the decay's bound and dG
    // cancels their products (test_kda_v3_bwd_emu.c: bf16x3 here gives dg 1.3e-4 of fp64 there,
    // against 2e-5 with these four in fp32).
    smm<1, 4>(KT, K, KT, 1.f, dM, 17, 1, s.B, LK, 1, 0.f, dA, LK);
    smm<1, 4>(KT, K, KT, 1.f, dP, 17, 1, s.B, LK, 1, 0.f, dQh, LK);
    smm<1, 4>(KT, K, KT, 1.f, dM, 1, 17, s.A, LK, 1, 0.f, dB, LK);
    __syncthreads();
    smm<1, 4>(KT, K, KT, 1.f, dP, 1, 17, s.Qh, LK, 1, 1.f, dB, LK);
    __syncthreads();
    for (int d = threadIdx.x; d < K; d += NTH) {
        float Gm = s.Gm[d];
        float acc = 0.f;
        float col[KT];
#pragma unroll
        for (int r = 0; r < KT; r++) {
            int i = r * LK + d;
            float G = s.G[i];
            float eA = expf(G - Gm), eB = expf(Gm - G);
            float ta = dA[i] * eA, tq = dQh[i] * eA, tb = dB[i] * eB;
            float kv = s.k[i];
            float dqv = dQp[i] + tq, dkv = dKe[i] + ta + tb;
            float dG = dW[i] + kv * ta + s.q[i] * tq - kv * tb;
            if (r == KT - 1) dG += dgS[d];
            col[r] = dG;
            if (r < cr) {
                size_t o = ((size_t)(t0 + r) * H + h) * K + d;
                dq[o] = dqv;
                dk[o] = dkv;
            }
        }
        // dg_r = Σ_{r' >= r} dG_{r'}
#pragma unroll
        for (int r = KT - 1; r >= 0; r--) {
            acc += col[r];
            if (r < cr) dg[((size_t)(t0 + r) * H + h) * K + d] = acc;
        }
    }
    if (threadIdx.x < KT && (int)threadIdx.x < cr)
        dbeta[(size_t)(t0 + threadIdx.x) * H + h] = db[threadIdx.x];
}

// Grid (tiles, H): block x works on tile n0 + x of the sequence's nt.
template <bool TC, int NTH, int KV>
__global__ void __launch_bounds__(NTH, 1) kda_tile_bwd_k(int T, int H, int K_, int V_, int nt, int n0, const float *q,
                                                      const float *k, const float *v,
                                                      const float *g, const float *beta,
                                                      const float *S_tiles, const float *dout,
                                                      const float *dD, const float *dS_tiles,
                                                      float *dq, float *dk, float *dv, float *dg,
                                                      float *dbeta) {
    kda_tile_bwd_<TC, NTH, KV>(T, H, K_, V_, nt, n0 + blockIdx.x, blockIdx.y, q, k, v, g, beta, S_tiles,
                               dout, dD, dS_tiles, dq, dk, dv, dg, dbeta);
}

// The varlen pass 3 over a group of np consecutive pieces of a pack (kda/chunk_varlen_mma.cu):
// grid (NT, H), block x on tile x of the group's NT (pack tile tb0 + x), in the piece a binary
// search over the pieces' first tiles ts [np + 1] finds (ofs [np + 1]: their first tokens), as
// kda_tile_bwd_k on that piece would. St (the incoming tile states), dD [H][16 NT][V] and dSt
// [NT][H][K][V] hold the group's tiles from its first; q .. dbeta are the pack's.
template <bool TC, int NTH, int KV>
__global__ void __launch_bounds__(NTH, 1)
    kda_vl_tile_bwd_k(int np, int NT, int tb0, int H, int K_, int V_, const int *__restrict__ ofs,
                      const int *__restrict__ ts, const float *q, const float *k, const float *v, const float *g,
                      const float *beta, const float *St, const float *dout, const float *dD, const float *dSt,
                      float *dq, float *dk, float *dv, float *dg, float *dbeta) {
    const int K = KV ? KV : K_, V = KV ? KV : V_;
    const int gt = tb0 + blockIdx.x, pc = vl_piece_of(ts, np, gt), tb = ts[pc] - tb0;
    const size_t x = (size_t)ofs[pc], xk = x * H * K, xv = x * H * V, hkv = (size_t)H * K * V;
    kda_tile_bwd_<TC, NTH, KV>(ofs[pc + 1] - ofs[pc], H, K_, V_, NT, gt - ts[pc], blockIdx.y, q + xk,
                               k + xk, v + xv, g + xk, beta + x * H, St + tb * hkv, dout + xv,
                               dD + (size_t)tb * KT * V, dSt + tb * hkv, dq + xk, dk + xk, dv + xv, dg + xk,
                               dbeta + x * H);
}

// ---- decode step -------------------------------------------------------------------------------
//
// grid (V/32, H, B), 256 threads: lane = column j (32 per block), warp w = rows d = w + 8 i.
// Each column of S evolves on its own: S̃ = e^g S; r = v − S̃ᵀk; S = S̃ + β k r; o = Sᵀ q.
__global__ void __launch_bounds__(256) kda_step_k(int H, int K, int V, const float *q,
                                                  const float *k, const float *v,
                                                  const float *g, const float *beta, float *S,
                                                  float *o) {
    __shared__ float red[2][8][32];
    __shared__ float sk[256], sq[256], se[256];
    int b = blockIdx.z, h = blockIdx.y, j = blockIdx.x * 32 + (threadIdx.x & 31);
    int w = threadIdx.x >> 5, NR = K / 8;
    size_t bh = (size_t)b * H + h;
    for (int d = threadIdx.x; d < K; d += blockDim.x) {
        sk[d] = k[bh * K + d];
        sq[d] = q[bh * K + d];
        se[d] = expf(g[bh * K + d]);
    }
    __syncthreads();
    float *Sp = S + bh * K * V;
    bool col_ok = j < V;
    float sv[32];
    float kS = 0.f;
#pragma unroll
    for (int i = 0; i < 32; i++) {
        if (i < NR) {
            int d = w + 8 * i;
            float x = col_ok ? Sp[(size_t)d * V + j] * se[d] : 0.f;
            sv[i] = x;
            kS = fmaf(x, sk[d], kS);
        }
    }
    red[0][w][threadIdx.x & 31] = kS;
    __syncthreads();
    float tot = 0.f;
    for (int i = 0; i < 8; i++) tot += red[0][i][threadIdx.x & 31];
    float br = col_ok ? beta[bh] * (v[bh * V + j] - tot) : 0.f;
    float oq = 0.f;
#pragma unroll
    for (int i = 0; i < 32; i++) {
        if (i < NR) {
            int d = w + 8 * i;
            float x = fmaf(br, sk[d], sv[i]);
            if (col_ok) Sp[(size_t)d * V + j] = x;
            oq = fmaf(x, sq[d], oq);
        }
    }
    red[1][w][threadIdx.x & 31] = oq;
    __syncthreads();
    if (w == 0 && col_ok) {
        float acc = 0.f;
        for (int i = 0; i < 8; i++) acc += red[1][i][threadIdx.x & 31];
        o[bh * V + j] = acc;
    }
}

// ---- gate --------------------------------------------------------------------------------------

// softplus as transformers' KimiLinearForgetGate (kda_ref.c kda_softplus_)
__device__ __forceinline__ float kimi_softplus_(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// kimi = 0: g = g_min σ(a x); kimi = 1: g = max(−a softplus(x), g_min) (kda_gate_kimi_fwd with
// the floor g_min, the range of the chunked kernels).
__global__ void kda_gate_fwd_k(size_t n, int H, int K, const float *f, const float *A_log,
                               const float *dt_bias, float g_min, int kimi, float *g) {
    int HK = H * K;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        int c = (int)(i % HK), h = c / K;
        float a = expf(A_log[h]);
        if (kimi) g[i] = fmaxf(-a * kimi_softplus_(f[i] + dt_bias[c]), g_min);
        else g[i] = g_min * sigmoid_acc(a * (f[i] + dt_bias[c]));
    }
}

// Partial sums over a range of tokens, per column c = h*K + d: pdb = Σ df, pdA = Σ ∂L/∂A_log
// (bounded: a x dy with dy = ∂L/∂(a x); kimi: dg·g, 0 where the floor clamped g).
__global__ void kda_gate_bwd_k(int T, int H, int K, int tchunk, const float *f,
                               const float *A_log, const float *dt_bias, float g_min, int kimi,
                               const float *dg, float *df, double *pdb, double *pdA) {
    int HK = H * K, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= HK) return;
    int h = c / K, t0 = blockIdx.y * tchunk, t1 = t0 + tchunk < T ? t0 + tchunk : T;
    float a = expf(A_log[h]), bias = dt_bias[c];
    double sb = 0, sa = 0;
    for (int t = t0; t < t1; t++) {
        size_t i = (size_t)t * HK + c;
        float x = f[i] + bias;
        if (kimi) {
            float y = -a * kimi_softplus_(x);
            float dy = y < g_min ? 0.f : dg[i];
            float dx = -dy * a * (x > 20.f ? 1.f : sigmoid_acc(x));
            df[i] = dx;
            sb += (double)dx;
            sa += (double)dy * (double)y;
            continue;
        }
        float s = sigmoid_acc(a * x);
        float dy = dg[i] * g_min * s * (1.f - s);
        df[i] = a * dy;
        sb += (double)(a * dy);
        sa += (double)a * (double)x * (double)dy;
    }
    pdb[(size_t)blockIdx.y * HK + c] = sb;
    pdA[(size_t)blockIdx.y * HK + c] = sa;
}

// Fixed-order final sums: ddt_bias[c] += Σ_splits pdb; dA_log[h] += Σ_d Σ_splits pdA.
__global__ void kda_gate_bwd_reduce_k(int H, int K, int nsplit, const double *pdb,
                                      const double *pdA, float *dA_log, float *ddt_bias) {
    int HK = H * K;
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < HK) {
        double s = 0;
        for (int i = 0; i < nsplit; i++) s += pdb[(size_t)i * HK + c];
        ddt_bias[c] += (float)s;
    }
    if (c < H) {
        double s = 0;
        for (int d = 0; d < K; d++)
            for (int i = 0; i < nsplit; i++) s += pdA[(size_t)i * HK + c * K + d];
        dA_log[c] += (float)s;
    }
}

// ---- launchers ---------------------------------------------------------------------------------

static int kda_gate_fwd_launch_(mtrl_cuda_ctx *c, int T, int H, int K, const float *f,
                                const float *A_log, const float *dt_bias, float g_min, int kimi,
                                float *g) {
    MTRL_CUDA_REQUIRE(T >= 0 && H > 0 && K > 0, "T=%d H=%d K=%d", T, H, K);
    size_t n = (size_t)T * H * K;
    if (!n) return 0;
    unsigned grid = cdiv(n, 256) < 8192 ? cdiv(n, 256) : 8192;
    kda_gate_fwd_k<<<grid, 256, 0, c->stream>>>(n, H, K, f, A_log, dt_bias, g_min, kimi, g);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int mtrl_kda_gate_fwd(mtrl_cuda_ctx *c, int T, int H, int K, const float *f,
                                 const float *A_log, const float *dt_bias, float g_min,
                                 float *g) {
    return kda_gate_fwd_launch_(c, T, H, K, f, A_log, dt_bias, g_min, 0, g);
}

extern "C" int mtrl_kda_gate_kimi_fwd(mtrl_cuda_ctx *c, int T, int H, int K, const float *f,
                                      const float *A_log, const float *dt_bias, float g_floor,
                                      float *g) {
    return kda_gate_fwd_launch_(c, T, H, K, f, A_log, dt_bias, g_floor, 1, g);
}

static int kda_gate_bwd_launch_(mtrl_cuda_ctx *c, int T, int H, int K, const float *f,
                                const float *A_log, const float *dt_bias, float g_min, int kimi,
                                const float *dg, float *df, float *dA_log, float *ddt_bias) {
    MTRL_CUDA_REQUIRE(T >= 0 && H > 0 && K > 0, "T=%d H=%d K=%d", T, H, K);
    if (T == 0) return 0;
    int HK = H * K;
    int nsplit = (int)(((size_t)c->sms * 8 * 256 + HK - 1) / HK);
    if (nsplit > T) nsplit = T;
    if (nsplit < 1) nsplit = 1;
    int tchunk = (T + nsplit - 1) / nsplit;
    nsplit = (T + tchunk - 1) / tchunk;
    double *pdb = (double *)mtrl_ctx_scratch(c, sizeof(double) * 2 * (size_t)nsplit * HK);
    double *pdA = pdb + (size_t)nsplit * HK;
    dim3 grid(cdiv(HK, 256), nsplit);
    kda_gate_bwd_k<<<grid, 256, 0, c->stream>>>(T, H, K, tchunk, f, A_log, dt_bias, g_min, kimi,
                                                dg, df, pdb, pdA);
    CUDA_LAUNCH_CHECK();
    kda_gate_bwd_reduce_k<<<cdiv(HK, 256), 256, 0, c->stream>>>(H, K, nsplit, pdb, pdA, dA_log,
                                                                ddt_bias);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int mtrl_kda_gate_bwd(mtrl_cuda_ctx *c, int T, int H, int K, const float *f,
                                 const float *A_log, const float *dt_bias, float g_min,
                                 const float *dg, float *df, float *dA_log, float *ddt_bias) {
    return kda_gate_bwd_launch_(c, T, H, K, f, A_log, dt_bias, g_min, 0, dg, df, dA_log, ddt_bias);
}

extern "C" int mtrl_kda_gate_kimi_bwd(mtrl_cuda_ctx *c, int T, int H, int K, const float *f,
                                      const float *A_log, const float *dt_bias, float g_floor,
                                      const float *dg, float *df, float *dA_log,
                                      float *ddt_bias) {
    return kda_gate_bwd_launch_(c, T, H, K, f, A_log, dt_bias, g_floor, 1, dg, df, dA_log,
                                ddt_bias);
}

struct KdaWs {
    float *Wk, *Uk, *Qp, *Ke, *Pm, *eg;
};
static void kda_ws_take(ws_carver &cv, KdaWs &w, int H, int K, int V, int nt) {
    size_t Tp = (size_t)nt * KT;
    w.Wk = cv.take<float>((size_t)H * Tp * K);
    w.Uk = cv.take<float>((size_t)H * Tp * V);
    w.Qp = cv.take<float>((size_t)H * Tp * K);
    w.Ke = cv.take<float>((size_t)H * Tp * K);
    w.Pm = cv.take<float>((size_t)H * nt * KT * KT);
    w.eg = cv.take<float>((size_t)H * nt * K);
}

static int kda_check_(mtrl_cuda_ctx *c, int T, int H, int K, int V) {
    MTRL_CUDA_REQUIRE(T >= 0 && H > 0, "T=%d H=%d", T, H);
    MTRL_CUDA_REQUIRE(K % 16 == 0 && V % 16 == 0 && K >= 16 && V >= 16 && K <= 128 && V <= 128,
                      "K=%d V=%d (multiples of 16, at most 128)", K, V);
    size_t need = sizeof(float) * tile_bwd_floats(K, V);
    MTRL_CUDA_REQUIRE(need <= c->smem_optin, "shared memory %zu > %zu", need, c->smem_optin);
    return 0;
}

static void kda_launch_prep_(mtrl_cuda_ctx *c, int T, int H, int K, int V, int nt,
                             const float *q, const float *k, const float *v, const float *g,
                             const float *beta, const KdaWs &w) {
    size_t sh = sizeof(float) * (tile_sh_floats(K, V) + (size_t)KT * (V + 1));
    set_smem(kda_prep_k, sh);
    kda_prep_k<<<dim3(nt, H), 256, sh, c->stream>>>(T, H, K, V, q, k, v, g, beta, w.Wk, w.Uk,
                                                    w.Qp, w.Ke, w.Pm, w.eg);
    CUDA_LAUNCH_CHECK();
}

static size_t state_smem_(int K, int redbufs) {
    return sizeof(float) * (2 * stbuf_floats(K) + (size_t)redbufs * 16 * RGS + 16 * 16);
}

template <int NR>
static void state_fwd_nr_(mtrl_cuda_ctx *c, int T, int H, int K, int V, int nt, const KdaWs &w,
                          const float *S0, float *o, float *S_final, float *S_tiles) {
    size_t sh = state_smem_(K, 2);
    set_smem(kda_state_fwd_k<NR>, sh);
    kda_state_fwd_k<NR><<<dim3(V / VS, H), 256, sh, c->stream>>>(T, H, K, V, nt, w.Wk, w.Uk, w.Qp,
                                                                 w.Ke, w.Pm, w.eg, S0, o, S_final,
                                                                 S_tiles);
    CUDA_LAUNCH_CHECK();
}
template <int NR>
static void state_bwd_nr_(mtrl_cuda_ctx *c, int T, int H, int K, int V, int nt, const KdaWs &w,
                          const float *dout, const float *dS_final, float *dD, float *dSt,
                          float *dS0) {
    size_t sh = state_smem_(K, 1);
    set_smem(kda_state_bwd_k<NR>, sh);
    kda_state_bwd_k<NR><<<dim3(V / VS, H), 256, sh, c->stream>>>(T, H, K, V, nt, w.Wk, w.Qp, w.Ke,
                                                                 w.Pm, w.eg, dout, dS_final, dD,
                                                                 dSt, dS0);
    CUDA_LAUNCH_CHECK();
}
#define KDA_NR_SWITCH(F, ...)                          \
    switch (K / 16) {                                  \
    case 1: F<1>(__VA_ARGS__); break;                  \
    case 2: F<2>(__VA_ARGS__); break;                  \
    case 3: F<3>(__VA_ARGS__); break;                  \
    case 4: F<4>(__VA_ARGS__); break;                  \
    case 5: F<5>(__VA_ARGS__); break;                  \
    case 6: F<6>(__VA_ARGS__); break;                  \
    case 7: F<7>(__VA_ARGS__); break;                  \
    default: F<8>(__VA_ARGS__); break;                 \
    }
static void launch_state_fwd_(mtrl_cuda_ctx *c, int T, int H, int K, int V, int nt,
                              const KdaWs &w, const float *S0, float *o, float *S_final,
                              float *S_tiles) {
    KDA_NR_SWITCH(state_fwd_nr_, c, T, H, K, V, nt, w, S0, o, S_final, S_tiles)
}
static void launch_state_bwd_(mtrl_cuda_ctx *c, int T, int H, int K, int V, int nt,
                              const KdaWs &w, const float *dout, const float *dS_final,
                              float *dD, float *dSt, float *dS0) {
    KDA_NR_SWITCH(state_bwd_nr_, c, T, H, K, V, nt, w, dout, dS_final, dD, dSt, dS0)
}

// v3 (kda/chunk_mma.cu): tensor cores, K = V = 128; q, k, v, g fp32 or bf16.
int kda3_supports(int H, int K, int V, const void *q, const void *k, const void *v, const void *g);
int kda3_chunk_fwd(mtrl_cuda_ctx *c, int T, int H, const float *q, const float *k,
                   const float *v, const float *g, const float *beta, const float *S0, float *o,
                   float *S_final, float *S_tiles);
int kda3_chunk_fwd(mtrl_cuda_ctx *c, int T, int H, const mtrl_bf16 *q, const mtrl_bf16 *k,
                   const mtrl_bf16 *v, const mtrl_bf16 *g, const float *beta, const float *S0, float *o,
                   float *S_final, float *S_tiles);

// v3 backward state-gradient pass (kda/chunk_mma_bwd.cu) over v3's bf16x3 records (kda/chunk_mma.cu).
size_t kda3_rec_bytes(int split);
void kda3_prep_launch(mtrl_cuda_ctx *c, int T, int H, const float *q, const float *k, const float *v,
                      const float *g, const float *beta, unsigned char *rec, int split);
void kda3_state_fwd_launch(mtrl_cuda_ctx *c, int T, int H, const unsigned char *rec, const float *S0,
                           float *o, float *S_final, float *S_tiles, int split);
void kda3_state_bwd_launch(mtrl_cuda_ctx *c, int T, int H, int n_lo, int n_hi, const unsigned char *rec,
                           const float *dout, const float *dS_final, float *dD, float *dSt, float *dS0);

// Which pass 3 runs (KDA_TILE_BWD_(TC, NTH, KV), defined where it is used): the options' and the
// shape's, the same for a sequence (mtrl_kda_chunk_bwd) and a pack (kda_tile_bwd_varlen_launch).
#define KDA_TILE_BWD_PICK_(c, K, V)                                                                    \
    do {                                                                                               \
        if ((c)->opts.kda_bwd_tile == MTRL_KOPT_SIMT) KDA_TILE_BWD_(false, 256, 0); /* v2's SIMT pass 3 */ \
        else if ((c)->opts.kda_tile_threads == 256) KDA_TILE_BWD_(true, 256, 0);   /* tensor cores, 8 warps */ \
        else if ((K) == 128 && (V) == 128) KDA_TILE_BWD_(true, 512, 128);          /* the default */      \
        else KDA_TILE_BWD_(true, 512, 0);                                                              \
    } while (0)

// Pass 3 over a group of np pieces of a pack (kda_vl_tile_bwd_k, K = V = 128): the varlen
// backward's (kda/chunk_varlen_mma.cu); -1 when the shape's pass 3 does not fit in shared memory.
int kda_tile_bwd_varlen_launch(mtrl_cuda_ctx *c, int np, int NT, int tb0, int H, const int *ofs, const int *ts,
                               const float *q, const float *k, const float *v, const float *g, const float *beta,
                               const float *St, const float *dout, const float *dD, const float *dSt, float *dq,
                               float *dk, float *dv, float *dg, float *dbeta) {
    const int K = 128, V = 128;
    if (kda_check_(c, 1, H, K, V)) return -1;
    const size_t sh = sizeof(float) * tile_bwd_floats(K, V);
    const dim3 grid(NT, H);
#define KDA_TILE_BWD_(TC, NTH, KV)                                                                           \
    do {                                                                                                     \
        set_smem(kda_vl_tile_bwd_k<TC, NTH, KV>, sh);                                                        \
        kda_vl_tile_bwd_k<TC, NTH, KV><<<grid, NTH, sh, c->stream>>>(np, NT, tb0, H, K, V, ofs, ts, q, k, v, g, \
                                                                     beta, St, dout, dD, dSt, dq, dk, dv, dg,  \
                                                                     dbeta);                                  \
    } while (0)
    KDA_TILE_BWD_PICK_(c, K, V);
#undef KDA_TILE_BWD_
    CUDA_LAUNCH_CHECK();
    return 0;
}

// Pieces of the v3 backward's state-gradient pass (pass 2), each followed by pass 3 over its
// tiles on a second stream while pass 2 goes on with the next piece (mtrl_kda_chunk_bwd). Pass 2
// walks the tiles in sequence on 2H blocks (K = V = 128, 4 warps each) and leaves the other SMs
// idle; pass 3 over a piece's tiles can use them. Overlapped, the backward takes about
// P2 / pieces + P3 x SMs / (SMs - 2H) instead of P2 + P3, and P3 / P2 grows with H (on an H200
// at 64K: P2 8.9 ms whatever H, P3 28.5 ms at H = 16): it pays while pass 2 holds at most an
// eighth of the SMs (H <= 8 on 132 SMs: `small`'s 8 heads), not at H = 16. Pieces of at least 256
// tiles, at most 8. The option kda_bwd_pieces = N forces N (1: no overlap), for the benchmarks
// and tests.
static int kda_bwd_pieces_(const mtrl_cuda_ctx *c, int H, int nt) {
    return opt_count(c->opts.kda_bwd_pieces, 2 * H <= c->sms / 8 ? nt / 256 : 1, 1, nt < 8 ? nt : 8);
}

extern "C" int mtrl_kda_chunk_bwd_version(const mtrl_cuda_ctx *c, int H, int K, int V) {
    if (c->opts.kda_bwd == MTRL_KOPT_SIMT) return 2;
    return H > 0 && H <= 65535 && K == 128 && V == 128 ? 3 : 2;
}

extern "C" int mtrl_kda_chunk_fwd_version(const mtrl_cuda_ctx *c, int H, int K, int V) {
    if (c->opts.kda_fwd == MTRL_KOPT_SIMT) return 2;
    return H > 0 && H <= 65535 && K == 128 && V == 128 ? 3 : 2;
}

// The forward of no tokens: S_final = S0 (zero when S0 is NULL).
static void kda_fwd_empty_(mtrl_cuda_ctx *c, int H, int K, int V, const float *S0, float *S_final) {
    const size_t bytes = sizeof(float) * H * (size_t)K * V;
    if (!S_final) return;
    if (S0) CUDA_CHECK(cudaMemcpyAsync(S_final, S0, bytes, cudaMemcpyDeviceToDevice, c->stream));
    else CUDA_CHECK(cudaMemsetAsync(S_final, 0, bytes, c->stream));
}

extern "C" int mtrl_kda_chunk_fwd(mtrl_cuda_ctx *c, int T, int H, int K, int V, const float *q,
                                  const float *k, const float *v, const float *g,
                                  const float *beta, const float *S0, float *o, float *S_final,
                                  float *S_tiles) {
    if (kda_check_(c, T, H, K, V)) return -1;
    if (T == 0) {
        kda_fwd_empty_(c, H, K, V, S0, S_final);
        return 0;
    }
    if (mtrl_kda_chunk_fwd_version(c, H, K, V) == 3 && kda3_supports(H, K, V, q, k, v, g))
        return kda3_chunk_fwd(c, T, H, q, k, v, g, beta, S0, o, S_final, S_tiles);
    int nt = (T + KT - 1) / KT;
    ws_carver cv{nullptr, 0};
    KdaWs w;
    kda_ws_take(cv, w, H, K, V, nt);
    cv.base = (char *)mtrl_ctx_scratch(c, cv.off);
    cv.off = 0;
    kda_ws_take(cv, w, H, K, V, nt);
    kda_launch_prep_(c, T, H, K, V, nt, q, k, v, g, beta, w);
    launch_state_fwd_(c, T, H, K, V, nt, w, S0, o, S_final, S_tiles);
    return 0;
}

// v3 only (kernels_cuda.h): v2 reads fp32, and a widened copy of the inputs would cost the traffic
// the bf16 form exists to save.
extern "C" int mtrl_kda_chunk_fwd_bf16(mtrl_cuda_ctx *c, int T, int H, int K, int V, const mtrl_bf16 *q,
                                       const mtrl_bf16 *k, const mtrl_bf16 *v, const mtrl_bf16 *g,
                                       const float *beta, const float *S0, float *o, float *S_final,
                                       float *S_tiles) {
    if (kda_check_(c, T, H, K, V)) return -1;
    MTRL_CUDA_REQUIRE(mtrl_kda_chunk_fwd_version(c, H, K, V) == 3 && kda3_supports(H, K, V, q, k, v, g),
                      "H=%d K=%d V=%d kda_fwd=%d (v3 only: K = V = 128, 16-byte aligned q, k, v, g)", H, K, V,
                      c->opts.kda_fwd);
    if (T == 0) {
        kda_fwd_empty_(c, H, K, V, S0, S_final);
        return 0;
    }
    return kda3_chunk_fwd(c, T, H, q, k, v, g, beta, S0, o, S_final, S_tiles);
}

extern "C" int mtrl_kda_chunk_bwd(mtrl_cuda_ctx *c, int T, int H, int K, int V, const float *q,
                                  const float *k, const float *v, const float *g,
                                  const float *beta, const float *S0, const float *S_tiles,
                                  const float *dout, const float *dS_final, float *dq, float *dk,
                                  float *dv, float *dg, float *dbeta, float *dS0) {
    if (kda_check_(c, T, H, K, V)) return -1;
    size_t KV = (size_t)K * V;
    if (T == 0) {
        if (dS0) {
            if (dS_final) CUDA_CHECK(cudaMemcpyAsync(dS0, dS_final, sizeof(float) * H * KV,
                                                     cudaMemcpyDeviceToDevice, c->stream));
            else CUDA_CHECK(cudaMemsetAsync(dS0, 0, sizeof(float) * H * KV, c->stream));
        }
        return 0;
    }
    int nt = (T + KT - 1) / KT;
    size_t Tp = (size_t)nt * KT;
    // v3: the state-gradient pass on tensor cores from v3's bf16x3 records (which replace v2's
    // prep buffers; recomputed states come from v3's bf16x3 forward state pass).
    const bool v3 = mtrl_kda_chunk_bwd_version(c, H, K, V) == 3 && kda3_supports(H, K, V, q, k, v, g) &&
                    ((uintptr_t)dout & 15u) == 0;
    KdaWs w;
    unsigned char *rec = nullptr;
    float *dD = nullptr, *dSt = nullptr, *own = nullptr, *dmid = nullptr;
    auto carve = [&](ws_carver &cv) {
        if (v3) rec = cv.take<unsigned char>((size_t)H * nt * kda3_rec_bytes(1));
        else kda_ws_take(cv, w, H, K, V, nt);
        dD = cv.take<float>((size_t)H * Tp * V);
        dSt = cv.take<float>((size_t)nt * H * KV);
        own = S_tiles ? nullptr : cv.take<float>((size_t)nt * H * KV);
        if (v3) dmid = cv.take<float>((size_t)H * KV);
    };
    ws_carver sz{nullptr, 0};
    carve(sz);
    ws_carver cv{(char *)mtrl_ctx_scratch(c, sz.off), 0};
    carve(cv);
    if (v3) {
        kda3_prep_launch(c, T, H, q, k, v, g, beta, rec, 1);
        if (!S_tiles) {
            kda3_state_fwd_launch(c, T, H, rec, S0, nullptr, nullptr, own, 1);
            S_tiles = own;
        }
    } else {
        kda_launch_prep_(c, T, H, K, V, nt, q, k, v, g, beta, w);
        if (!S_tiles) {  // recompute every tile's incoming state (fla's disable_recompute=False)
            launch_state_fwd_(c, T, H, K, V, nt, w, S0, nullptr, nullptr, own);
            S_tiles = own;
        }
        launch_state_bwd_(c, T, H, K, V, nt, w, dout, dS_final, dD, dSt, dS0);
    }
    // Pass 3 over tiles [n0, n1) on stream st.
    size_t sh = sizeof(float) * tile_bwd_floats(K, V);
    auto pass3 = [&](int n0, int n1, cudaStream_t st) {
        const dim3 grid(n1 - n0, H);
#define KDA_TILE_BWD_(TC, NTH, KV)                                                                           \
    do {                                                                                                     \
        set_smem(kda_tile_bwd_k<TC, NTH, KV>, sh);                                                           \
        kda_tile_bwd_k<TC, NTH, KV><<<grid, NTH, sh, st>>>(T, H, K, V, nt, n0, q, k, v, g, beta, S_tiles, dout, \
                                                           dD, dSt, dq, dk, dv, dg, dbeta);                   \
    } while (0)
        KDA_TILE_BWD_PICK_(c, K, V);
#undef KDA_TILE_BWD_
        CUDA_LAUNCH_CHECK();
    };
    const int np = v3 ? kda_bwd_pieces_(c, H, nt) : 1;
    if (np <= 1) {
        if (v3) kda3_state_bwd_launch(c, T, H, 0, nt, rec, dout, dS_final, dD, dSt, dS0);
        pass3(0, nt, c->stream);
        return 0;
    }
    // Pass 2 in np pieces from the last tiles to the first on the context's stream (the gradient
    // entering one piece, dmid, leaves the next: each block reads its own columns of it first and
    // writes them last), each piece's pass 3 on GEMM lane 1 once that piece is done.
    mtrl_ctx_lanes_fork(c, 2);
    cudaStream_t side = mtrl_ctx_lane_stream(c, 1);
    for (int p = 0; p < np; p++) {
        const int n1 = nt - (int)((long)nt * p / np), n0 = nt - (int)((long)nt * (p + 1) / np);
        kda3_state_bwd_launch(c, T, H, n0, n1, rec, dout, p == 0 ? dS_final : dmid, dD, dSt,
                              p == np - 1 ? dS0 : dmid);
        mtrl_ctx_lane_after(c, 1);
        pass3(n0, n1, side);
    }
    mtrl_ctx_lanes_join(c, 2);
    return 0;
}

// ---- decode step, v2 --------------------------------------------------------------------------
//
// grid (V/64, H, B), 256 threads. NP = K/16 rows per thread (see the file comment). Per column j
// of the slice: S̃ = e^g ⊙ S (rows scaled), kS = S̃ᵀk, r = v − kS, S' = S̃ + β k rᵀ, o = S'ᵀq, the
// same operation order per element as the reference (kda_head_step_), fp32 with fma.
template <int NP>
__global__ void __launch_bounds__(256) kda_step2_k(int H, int K, int V,
                                                   const float *__restrict__ q,
                                                   const float *__restrict__ k,
                                                   const float *__restrict__ v,
                                                   const float *__restrict__ g,
                                                   const float *__restrict__ beta, float *S,
                                                   float *const *S_rows, float *o) {
    static_assert(NP % 4 == 0, "rows per thread are loaded as float4");
    __shared__ float4 red[2][8][16];  // [k S̃ | q S'][warp][column quad]
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, half = lane >> 4, c4 = lane & 15;
    const size_t bh = (size_t)blockIdx.z * H + blockIdx.y;
    const int col = blockIdx.x * 64 + c4 * 4;
    const int r0 = (w * 2 + half) * NP;
    // S_rows: row b's state is its own [H][K][V] block (decode states are separate
    // allocations), read and written in place instead of gathered into S first
    float *Sp = S_rows ? S_rows[blockIdx.z] + ((size_t)blockIdx.y * K + r0) * V + col : S + (bh * K + r0) * V + col;
    // State first (the bytes that matter), then the row parameters; all loads independent.
    float4 s[NP];
#pragma unroll
    for (int p = 0; p < NP; p++) s[p] = __ldcs(reinterpret_cast<const float4 *>(Sp + (size_t)p * V));
    float kk[NP], qq[NP], ee[NP];
    const float4 *k4 = reinterpret_cast<const float4 *>(k + bh * K + r0);
    const float4 *q4 = reinterpret_cast<const float4 *>(q + bh * K + r0);
    const float4 *g4 = reinterpret_cast<const float4 *>(g + bh * K + r0);
#pragma unroll
    for (int p = 0; p < NP / 4; p++) {
        float4 a = __ldg(k4 + p), c = __ldg(q4 + p), e = __ldg(g4 + p);
        kk[4 * p] = a.x; kk[4 * p + 1] = a.y; kk[4 * p + 2] = a.z; kk[4 * p + 3] = a.w;
        qq[4 * p] = c.x; qq[4 * p + 1] = c.y; qq[4 * p + 2] = c.z; qq[4 * p + 3] = c.w;
        ee[4 * p] = e.x; ee[4 * p + 1] = e.y; ee[4 * p + 2] = e.z; ee[4 * p + 3] = e.w;
    }
    const float4 vv = __ldg(reinterpret_cast<const float4 *>(v + bh * V + col));
    const float bt = __ldg(beta + bh);
    // S̃ = e^g S and the partial k·S̃ over this thread's rows
    float4 ks = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int p = 0; p < NP; p++) {
        const float e = expf(ee[p]);
        s[p].x *= e; s[p].y *= e; s[p].z *= e; s[p].w *= e;
        ks.x = fmaf(kk[p], s[p].x, ks.x);
        ks.y = fmaf(kk[p], s[p].y, ks.y);
        ks.z = fmaf(kk[p], s[p].z, ks.z);
        ks.w = fmaf(kk[p], s[p].w, ks.w);
    }
    ks.x += __shfl_xor_sync(0xffffffffu, ks.x, 16);
    ks.y += __shfl_xor_sync(0xffffffffu, ks.y, 16);
    ks.z += __shfl_xor_sync(0xffffffffu, ks.z, 16);
    ks.w += __shfl_xor_sync(0xffffffffu, ks.w, 16);
    if (!half) red[0][w][c4] = ks;
    __syncthreads();
    float4 tot = red[0][0][c4];
#pragma unroll
    for (int i = 1; i < 8; i++) {
        const float4 x = red[0][i][c4];
        tot.x += x.x; tot.y += x.y; tot.z += x.z; tot.w += x.w;
    }
    // β r, the rank-1 update, the write-back and the partial q·S'
    const float4 br = make_float4(bt * (vv.x - tot.x), bt * (vv.y - tot.y), bt * (vv.z - tot.z),
                                  bt * (vv.w - tot.w));
    float4 oq = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int p = 0; p < NP; p++) {
        s[p].x = fmaf(kk[p], br.x, s[p].x);
        s[p].y = fmaf(kk[p], br.y, s[p].y);
        s[p].z = fmaf(kk[p], br.z, s[p].z);
        s[p].w = fmaf(kk[p], br.w, s[p].w);
        __stcs(reinterpret_cast<float4 *>(Sp + (size_t)p * V), s[p]);
        oq.x = fmaf(qq[p], s[p].x, oq.x);
        oq.y = fmaf(qq[p], s[p].y, oq.y);
        oq.z = fmaf(qq[p], s[p].z, oq.z);
        oq.w = fmaf(qq[p], s[p].w, oq.w);
    }
    oq.x += __shfl_xor_sync(0xffffffffu, oq.x, 16);
    oq.y += __shfl_xor_sync(0xffffffffu, oq.y, 16);
    oq.z += __shfl_xor_sync(0xffffffffu, oq.z, 16);
    oq.w += __shfl_xor_sync(0xffffffffu, oq.w, 16);
    if (!half) red[1][w][c4] = oq;
    __syncthreads();
    if (w == 0 && !half) {
        float4 acc = red[1][0][c4];
#pragma unroll
        for (int i = 1; i < 8; i++) {
            const float4 x = red[1][i][c4];
            acc.x += x.x; acc.y += x.y; acc.z += x.z; acc.w += x.w;
        }
        *reinterpret_cast<float4 *>(o + bh * V + col) = acc;
    }
}

static int aligned16_(const void *p) { return ((uintptr_t)p & 15u) == 0; }

extern "C" int mtrl_kda_step_version(const mtrl_cuda_ctx *c, int H, int K, int V) {
    if (c->opts.decode == MTRL_KOPT_SIMT) return 1;
    return H > 0 && (K == 64 || K == 128 || K == 256) && V > 0 && V % 64 == 0 ? 2 : 1;
}

static void kda_step2_launch_(mtrl_cuda_ctx *c, int B, int H, int K, int V, const float *q, const float *k,
                              const float *v, const float *g, const float *beta, float *S,
                              float *const *S_rows, float *o) {
    dim3 grid(V / 64, H, B);
    if (K == 64)
        kda_step2_k<4><<<grid, 256, 0, c->stream>>>(H, K, V, q, k, v, g, beta, S, S_rows, o);
    else if (K == 128)
        kda_step2_k<8><<<grid, 256, 0, c->stream>>>(H, K, V, q, k, v, g, beta, S, S_rows, o);
    else
        kda_step2_k<16><<<grid, 256, 0, c->stream>>>(H, K, V, q, k, v, g, beta, S, S_rows, o);
    CUDA_LAUNCH_CHECK();
}

extern "C" int mtrl_kda_step_rows_ok(const mtrl_cuda_ctx *c, int B, int H, int K, int V, const float *q,
                                     const float *k, const float *v, const float *g, const float *const *S_h,
                                     const float *o) {
    if (B <= 0 || mtrl_kda_step_version(c, H, K, V) != 2 || H > 65535 || B > 65535) return 0;
    if (!aligned16_(q) || !aligned16_(k) || !aligned16_(v) || !aligned16_(g) || !aligned16_(o)) return 0;
    for (int b = 0; b < B; b++)
        if (!aligned16_(S_h[b])) return 0;
    return 1;
}

extern "C" int mtrl_kda_step_rows(mtrl_cuda_ctx *c, int B, int H, int K, int V, const float *q,
                                  const float *k, const float *v, const float *g,
                                  const float *beta, float *const *S_rows, float *o) {
    MTRL_CUDA_REQUIRE(B >= 0 && H > 0 && mtrl_kda_step_version(c, H, K, V) == 2 && H <= 65535 && B <= 65535,
                      "B=%d H=%d K=%d V=%d (the v2 shapes: K in {64, 128, 256}, V %% 64 == 0)", B, H, K, V);
    if (B == 0) return 0;
    kda_step2_launch_(c, B, H, K, V, q, k, v, g, beta, NULL, S_rows, o);
    return 0;
}

extern "C" int mtrl_kda_step(mtrl_cuda_ctx *c, int B, int H, int K, int V, const float *q,
                             const float *k, const float *v, const float *g, const float *beta,
                             float *S, float *o) {
    MTRL_CUDA_REQUIRE(B >= 0 && H > 0 && K % 8 == 0 && K >= 8 && K <= 256 && V > 0,
                      "B=%d H=%d K=%d V=%d (K a multiple of 8, at most 256)", B, H, K, V);
    if (B == 0) return 0;
    const int v2 = mtrl_kda_step_version(c, H, K, V) == 2 && aligned16_(q) && aligned16_(k) &&
                   aligned16_(v) && aligned16_(g) && aligned16_(S) && aligned16_(o) &&
                   H <= 65535 && B <= 65535;
    if (v2) {
        kda_step2_launch_(c, B, H, K, V, q, k, v, g, beta, S, NULL, o);
        return 0;
    }
    dim3 grid(cdiv(V, 32), H, B);
    kda_step_k<<<grid, 256, 0, c->stream>>>(H, K, V, q, k, v, g, beta, S, o);
    CUDA_LAUNCH_CHECK();
    return 0;
}
