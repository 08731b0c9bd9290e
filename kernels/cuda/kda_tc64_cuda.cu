// kda_tc64_cuda.cu: KDA chunked forward v4, 64-token chunks over v3's 16-token tiles: a kernel-lab
// variant, measured slower than v3 and kept opt-in (MTRL_KDA_FWD=4 in the environment, read at
// each call; forms without S_tiles only, the rest runs v3). tests/test_cuda_kda.cu checks it.
//
// Measured (one H200, 2026-11-30 23:2x UTC, `mtrl bench ops --device cuda --only kda`, H = 16,
// experiments/results/2026-11-30-kda-v4/): bf16x3 2.09 / 16.66 / 66.20 ms at T = 8K / 64K / 256K,
// 1.92x v3's time; plain bf16 0.97 / 7.70 / 30.56 ms, 1.30x v3's. Nsight Compute at 64K, bf16x3:
// the prep 9.49 ms (v3's 2.41: one block of 4 warps per SM through three barriers and serial
// phases, warp 3 doing three times warp 1's chunk products; memory throughput 10%), the state
// pass 7.20 ms (v3's 6.22). So v3's state pass is not bound by its per-tile chain but by one
// warp's issue rate per scheduler: per token, the chunk form issues the same mma and ldmatrix
// (plus P̄'s wider row blocks), and packing the state once per chunk does not pay for that. What
// would: more warps on the sequential pass (the K dimension of the state split over warps, Δ's
// partial sums exchanged per piece), which v3's layout allows as well.
//
// The idea: v3's sequential state pass (kda_tc_cuda.cu) is bound by its per-tile chain: every tile's
// Δ waits for the previous tile's state update, and the state's re-packing into bf16 operands,
// its decay and the ring barrier are paid per 16 tokens (Nsight Compute at T = 64K: one warp per
// scheduler issuing every 3.7 cycles, 32 blocks on 132 SMs). Here a chunk of 4 tiles takes its
// Δ for all 64 rows from the state at the chunk's start, so the chain is per 64 tokens and the
// state is packed, decayed and passed once per chunk (what fla's chunk size 64 does; model.md
// §2.3's tile algebra composed 4 times, below).
//
// Algebra (per chunk and head; tiles t = 0..3 of v3's algebra: −W_t, U_t, Q⁺_t, K^e_t, P_t, γ_t
// relative to the tile's start; D_t = diag(e^{γ_t}), D_(s,t) = D_{t-1}..D_{s+1}, D_[0,t) =
// D_{t-1}..D_0, Γ_<t = γ_0 + .. + γ_{t-1} per column, Γ = Γ_<4):
//   v3: Δ_t = U_t − W_t S_t, S_{t+1} = D_t S_t + K^e_tᵀ Δ_t, O_t = Q⁺_t S_t + P_t Δ_t.
//   Unrolled over the chunk from its start state S: Δ_t + Σ_{s<t} L_ts Δ_s = U_t − W_t D_[0,t) S
//   with L_ts = W_t D_(s,t) K^e_sᵀ (16 x 16), so with T̃ = (I + L)^-1 (block unit lower, 64 x 64):
//     Δ = Ũ + (−W̃) S,   Ũ = T̃ U,   −W̃ = T̃ [(−W_s) D_[0,s)]_s
//     O = Q̄ S + P̄ Δ,    Q̄_t = Q⁺_t D_[0,t) = q e^{G + Γ_<t},  P̄_tt = P_t,  P̄_ts = Q⁺_t D_(s,t) K^e_sᵀ (s < t)
//     S' = e^Γ S + K̄^eᵀ Δ,  K̄^e_s = K^e_s D_(s,4) = k e^{Γ − Γ_<s − G}
//   Every exponent is <= 0 (G falls within a tile, Γ within the chunk; the products with D_(s,t)
//   scale one operand by e^{<= 0}), so nothing overflows however long the chunk's decay.
//   T̃ by blocks: T̃_ts = N_ts + Σ_{s<r<t} N_tr T̃_rs with N = −L: T̃_10 = N_10, T̃_21 = N_21,
//   T̃_20 = N_20 + N_21 N_10, T̃_32 = N_32, T̃_31 = N_31 + N_32 N_21, T̃_30 = N_30 + N_31 N_10 + N_32 T̃_20.
//
// Two launches:
//   1. kda4_prep_k, grid (chunks, H), 4 warps, warp t = tile t of the chunk: v3's per-tile prep
//      (prep_tile_, kda_tc.cuh) leaves −W_t, U_t in the warp's shared memory and P_t in the record;
//      block barrier; the tile's Q⁺_t, K^e_t (shared) and Q̄_t, K̄^e_t (record) from q, k, g again;
//      barrier; N_ts and P̄_ts (warp t, s < t, k = 128 products with K^e_s scaled per column by
//      D_(s,t)); barrier; warp t's row of T̃ (16 x 16 products) and its rows of −W̃, Ũ
//      (products over the tiles s <= t with (−W_s) scaled per column by D_[0,s)).
//      Record: 4 pieces per chunk, piece t = rows 16t..16t+15 of −W̃, Q̄, K̄^e, Ũ, P̄ (16 x 64,
//      blocks s > t zero) and e^Γ: Rec<X, 64>, v3's tile record with a 64-wide P (37,376 B with
//      bf16x3, 18,944 without: the chunk's 4 pieces are 9% more bytes than v3's 4 tile records).
//   2. kda4_state_k<WPB, WO, X>, grid (V / (16 WPB), H): v3's state pass (the same warp layout,
//      Sᵀ as mma accumulators, the same ring of 6 stages of one piece each), but per chunk: Sᵀ is
//      packed into bf16 A fragments (hi and lo) once, then decayed by e^Γ in its accumulators, and
//      each piece i adds Δ_iᵀ K̄^e_i to them; Δ_i and O_i take the packed start state, O_i also
//      Δ_s (s <= i, kept as A fragments) through P̄'s row block i. No piece waits on another's
//      state update; only the next chunk waits on this one's.
// Precision as v3 (bf16x3 by default, MTRL_KDA3_SPLIT=0 plain bf16): the chunk's extra products
// (N, P̄ off the diagonal, T̃, W̃, Ũ) take split operands too, fp32 accumulation; T̃ and the
// per-column rescalings in fp32.
#include <math.h>
#include <stdlib.h>

#include "kernels/cuda/kda_tc.cuh"

namespace {

constexpr int CH4 = 4;         // tiles per chunk
constexpr int C4 = CH4 * C3;   // tokens per chunk
constexpr int LDP4 = C4 + 8;   // P̄ rows in shared memory (144 B: ldmatrix conflict-free)
constexpr int LB4 = C3 * 17;   // one fp32 16 x 16 block in shared memory (row stride 17)

template <bool X>
using Rec4 = Rec<X, C4>;  // one piece (16 rows) of a chunk's record

// hi (and with X lo) bf16 pairs scaled by f0 (low half) and f1 (high half), split again.
template <bool X>
__device__ __forceinline__ void scale_split_(uint32_t &hi, uint32_t &lo, float f0, float f1) {
    float a = bf2f((uint16_t)(hi & 0xffffu)), b = bf2f((uint16_t)(hi >> 16));
    if (X) {  // exact: hi + lo has at most 16 significant bits
        a += bf2f((uint16_t)(lo & 0xffffu));
        b += bf2f((uint16_t)(lo >> 16));
        pack_split(a * f0, b * f1, hi, lo);
    } else {
        hi = pack_bf16(a * f0, b * f1);
    }
}
// The value at element e of a bf16 matrix with its lo plane lo elements on (X).
template <bool X>
__device__ __forceinline__ float unsplit_(const uint16_t *p, int lo) {
    return X ? bf2f(p[0]) + bf2f(p[lo]) : bf2f(p[0]);
}
// C-layout accumulators (c[nt][e]: row g + 8 (e >> 1), column 8 nt + 2t + (e & 1)) of a 16 x 16
// fp32 block at M (row stride 17): load, store.
__device__ __forceinline__ void ldc16_(float (*c)[4], const float *M, int gq, int tq) {
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) c[nt][e] = M[(gq + 8 * (e >> 1)) * 17 + 8 * nt + 2 * tq + (e & 1)];
}
__device__ __forceinline__ void stc16_(float *M, const float (*c)[4], int gq, int tq) {
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) M[(gq + 8 * (e >> 1)) * 17 + 8 * nt + 2 * tq + (e & 1)] = c[nt][e];
}
// c += A B for fp32 16 x 16 blocks A, B in shared memory (row stride 17), split operands.
template <bool X>
__device__ __forceinline__ void mm16_(float (*c)[4], const float *A, const float *B, int gq, int tq) {
    uint32_t ah[4], al[4];
    pack_split(A[gq * 17 + 2 * tq], A[gq * 17 + 2 * tq + 1], ah[0], al[0]);
    pack_split(A[(gq + 8) * 17 + 2 * tq], A[(gq + 8) * 17 + 2 * tq + 1], ah[1], al[1]);
    pack_split(A[gq * 17 + 2 * tq + 8], A[gq * 17 + 2 * tq + 9], ah[2], al[2]);
    pack_split(A[(gq + 8) * 17 + 2 * tq + 8], A[(gq + 8) * 17 + 2 * tq + 9], ah[3], al[3]);
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
        const int n = 8 * nt + gq;
        uint32_t bh[2], bl[2];
        pack_split(B[(2 * tq) * 17 + n], B[(2 * tq + 1) * 17 + n], bh[0], bl[0]);
        pack_split(B[(2 * tq + 8) * 17 + n], B[(2 * tq + 9) * 17 + n], bh[1], bl[1]);
        mma_split<X>(c[nt], ah, al, bh, bl);
    }
}

// ---- pass 1: the chunk records ---------------------------------------------------------------

// Shared memory: the 4 warps' PrepCfg areas (K̂⁺ → −W_t, Q̂⁺ → U_t, K̂⁻ → Q⁺_t, then −W̃_t
// staging, β K⁺ → K^e_t, then Ũ_t staging; M → T̃_20 for warp 3), then N [4][4] fp32 16 x 16
// blocks (N_ts at t * 4 + s, t > s), then γ [4][K] fp32.
template <bool X>
struct Prep4Cfg {
    static constexpr int WB = PrepCfg<X>::WARP_BYTES;
    static constexpr int SN = CH4 * WB, SG = SN + CH4 * CH4 * LB4 * 4;
    static constexpr size_t BYTES = (size_t)SG + CH4 * K3 * 4;  // 202,240 B bf16x3; 97,024 bf16
    static_assert(BYTES <= 232448, "the sm_90 opt-in shared memory per block");
};

// Warp t's part of the chunk's algebra after the N blocks: its row of T̃ (TW = t >= 1), then its
// rows of −W̃ and Ũ staged in its own K̂⁻ / β K⁺ buffers (the other warps read its −W_t and U_t).
template <bool X, int TW>
__device__ __forceinline__ void chunk_rows_(unsigned char *sm, int lane) {
    using Cf = Prep4Cfg<X>;
    constexpr int LO = PrepCfg<X>::LO;
    const int gq = lane >> 2, tq = lane & 3;
    const float *sN = reinterpret_cast<const float *>(sm + Cf::SN), *sG = reinterpret_cast<const float *>(sm + Cf::SG);
    auto N = [&](int t, int s) { return sN + (t * CH4 + s) * LB4; };
    auto buf = [&](int w, int b) { return reinterpret_cast<uint16_t *>(sm + w * Cf::WB) + b * C3 * LD3; };
    // T̃_{TW,s}, s < TW, as C-layout accumulators
    float Tm[TW][2][4];
    if constexpr (TW == 1) {
        ldc16_(Tm[0], N(1, 0), gq, tq);
    } else if constexpr (TW == 2) {
        ldc16_(Tm[1], N(2, 1), gq, tq);
        ldc16_(Tm[0], N(2, 0), gq, tq);
        mm16_<X>(Tm[0], N(2, 1), N(1, 0), gq, tq);
    } else {
        ldc16_(Tm[2], N(3, 2), gq, tq);
        ldc16_(Tm[1], N(3, 1), gq, tq);
        mm16_<X>(Tm[1], N(3, 2), N(2, 1), gq, tq);
        float t20[2][4];
        ldc16_(t20, N(2, 0), gq, tq);
        mm16_<X>(t20, N(2, 1), N(1, 0), gq, tq);
        float *sT20 = reinterpret_cast<float *>(buf(3, 0) + Rec<X>::NP * LO);  // warp 3's M area
        stc16_(sT20, t20, gq, tq);
        __syncwarp();
        ldc16_(Tm[0], N(3, 0), gq, tq);
        mm16_<X>(Tm[0], N(3, 1), N(1, 0), gq, tq);
        mm16_<X>(Tm[0], N(3, 2), sT20, gq, tq);
    }
    uint32_t ta[TW][4], tl[TW][4];
#pragma unroll
    for (int s = 0; s < TW; s++) acc_to_a_split(Tm[s][0], Tm[s][1], ta[s], tl[s]);
    // Γ_<s of column d
    auto gsum = [&](int s, int d) {
        float x = 0.f;
#pragma unroll
        for (int r = 0; r < CH4; r++)
            if (r < s) x += sG[r * K3 + d];
        return x;
    };
    uint16_t *wt = buf(TW, 0), *ut = buf(TW, 1), *sw = buf(TW, 2), *su = buf(TW, 3);
#pragma unroll
    for (int pp = 0; pp < K3 / 16; pp++) {
        // the identity block: (−W_TW) D_[0,TW) and U_TW at the accumulators' places
        float w[2][4], u[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = gq + 8 * (e >> 1), col = 16 * pp + 8 * nt + 2 * tq + (e & 1);
                w[nt][e] = unsplit_<X>(wt + r * LD3 + col, LO) * e2x(gsum(TW, col));
                u[nt][e] = unsplit_<X>(ut + r * LD3 + col, LO);
            }
#pragma unroll
        for (int s = 0; s < TW; s++) {
            uint32_t b[4], bl[4], bu[4], bul[4];
            ldsm_split_t<X>(b, bl, adr_b_kn(buf(s, 0), LD3, 0, 16 * pp, lane), LO);
            if (s > 0) {  // (−W_s) D_[0,s): column n = 16 pp + g (b[0], b[1]) and + 8 (b[2], b[3])
                const float f0 = e2x(gsum(s, 16 * pp + gq)), f1 = e2x(gsum(s, 16 * pp + 8 + gq));
                scale_split_<X>(b[0], bl[0], f0, f0);
                scale_split_<X>(b[1], bl[1], f0, f0);
                scale_split_<X>(b[2], bl[2], f1, f1);
                scale_split_<X>(b[3], bl[3], f1, f1);
            }
            mma_split<X>(w[0], ta[s], tl[s], b, bl);
            mma_split<X>(w[1], ta[s], tl[s], b + 2, bl + 2);
            ldsm_split_t<X>(bu, bul, adr_b_kn(buf(s, 1), LD3, 0, 16 * pp, lane), LO);
            mma_split<X>(u[0], ta[s], tl[s], bu, bul);
            mma_split<X>(u[1], ta[s], tl[s], bu + 2, bul + 2);
        }
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
            const int c0 = 16 * pp + 8 * nt + 2 * tq;
            st2<X>(sw + gq * LD3 + c0, LO, w[nt][0], w[nt][1]);
            st2<X>(sw + (gq + 8) * LD3 + c0, LO, w[nt][2], w[nt][3]);
            st2<X>(su + gq * LD3 + c0, LO, u[nt][0], u[nt][1]);
            st2<X>(su + (gq + 8) * LD3 + c0, LO, u[nt][2], u[nt][3]);
        }
    }
}

template <bool X>
__global__ void __launch_bounds__(128, 1) kda4_prep_k(int T, int H, int nc, const float *__restrict__ q,
                                                      const float *__restrict__ k,
                                                      const float *__restrict__ v,
                                                      const float *__restrict__ g,
                                                      const float *__restrict__ beta,
                                                      unsigned char *__restrict__ rec) {
    using Rc = Rec4<X>;
    using Cf = Prep4Cfg<X>;
    constexpr int LO = PrepCfg<X>::LO;
    extern __shared__ __align__(16) unsigned char sm4_[];
    const int lane = threadIdx.x & 31, t = threadIdx.x >> 5, gq = lane >> 2, tq = lane & 3;
    const int h = blockIdx.y, n = blockIdx.x * CH4 + t, d0 = 4 * lane;
    unsigned char *R = rec + (((size_t)h * nc + blockIdx.x) * CH4 + t) * Rc::BYTES;  // piece t
    auto rec16 = [&](int m, int e) { return reinterpret_cast<uint16_t *>(R + m + e * 2); };
    auto buf = [&](int w, int b) { return reinterpret_cast<uint16_t *>(sm4_ + w * Cf::WB) + b * C3 * LD3; };
    float *sN = reinterpret_cast<float *>(sm4_ + Cf::SN), *sG = reinterpret_cast<float *>(sm4_ + Cf::SG);

    // 1. v3's tile algebra (tiles past T: all rows padded, so W = U = P = 0 and γ = 0)
    prep_tile_<X, true>(T, H, n, h, lane, q, k, v, g, beta, sm4_ + t * Cf::WB, R, C3 * t, sG + t * K3);
    __syncthreads();

    // 2. Γ_<t and Γ for this lane's 4 columns; e^Γ into the piece; G of the tile again; Q⁺_t and
    //    K^e_t (tile-relative) to the K̂⁻ and β K⁺ buffers, Q̄_t and K̄^e_t to the record.
    float4 Gb = make_float4(0.f, 0.f, 0.f, 0.f), Ga = Gb;
#pragma unroll
    for (int r = 0; r < CH4; r++) {
        const float4 y = *reinterpret_cast<const float4 *>(sG + r * K3 + d0);
        if (r < t) { Gb.x += y.x; Gb.y += y.y; Gb.z += y.z; Gb.w += y.w; }
        Ga.x += y.x; Ga.y += y.y; Ga.z += y.z; Ga.w += y.w;
    }
    *reinterpret_cast<float4 *>(R + Rc::EG + 4 * d0) = make_float4(e2x(Ga.x), e2x(Ga.y), e2x(Ga.z), e2x(Ga.w));
    {
        const int t0 = n * C3, cr = min(C3, T - t0);
        const float4 gam = *reinterpret_cast<const float4 *>(sG + t * K3 + d0);  // G of the tile's last row
        float4 G = make_float4(0.f, 0.f, 0.f, 0.f);  // G of row r, summed as prep_tile_ sums it
        uint16_t *sQp = buf(t, 2), *sKe = buf(t, 3);
#pragma unroll 4
        for (int r = 0; r < C3; r++) {
            const size_t row = (size_t)(t0 + r) * H + h;
            const float4 gv = ldg4_or0(g + row * K3 + d0, r < cr);
            G.x += gv.x; G.y += gv.y; G.z += gv.z; G.w += gv.w;
            const float4 qv = ldg4_or0(q + row * K3 + d0, r < cr), kv = ldg4_or0(k + row * K3 + d0, r < cr);
            float qp[4], ke[4], qb[4], kb[4];
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const float Gc = comp(G, c), qc = comp(qv, c), kc = comp(kv, c);
                qp[c] = qc * e2x(Gc);
                ke[c] = kc * e2x(comp(gam, c) - Gc);
                qb[c] = qc * e2x(Gc + comp(Gb, c));
                kb[c] = kc * e2x(comp(Ga, c) - comp(Gb, c) - Gc);
            }
            st4<X>(sQp + r * LD3 + d0, LO, qp);
            st4<X>(sKe + r * LD3 + d0, LO, ke);
            st4<X>(rec16(Rc::Q, r * K3 + d0), Rc::LO3 / 2, qb);
            st4<X>(rec16(Rc::E, r * K3 + d0), Rc::LO3 / 2, kb);
        }
    }
    __syncthreads();

    // 3. N_ts = (−W_t) (K^e_s D_(s,t))ᵀ and P̄_ts = Q⁺_t (K^e_s D_(s,t))ᵀ, s < t (k = d); P̄'s blocks
    //    s > t zero.
#pragma unroll 1
    for (int s = 0; s < t; s++) {
        float nl[2][4] = {}, pr[2][4] = {};
#pragma unroll
        for (int kd = 0; kd < K3 / 16; kd++) {
            uint32_t aw[4], awl[4], aq[4], aql[4], b[4], bl[4];
            ldsm_split<X>(aw, awl, adr_a(buf(t, 0), LD3, 16 * kd, lane), LO);
            ldsm_split<X>(aq, aql, adr_a(buf(t, 2), LD3, 16 * kd, lane), LO);
            ldsm_split<X>(b, bl, adr_b_nk(buf(s, 3), LD3, 16 * kd, 0, lane), LO);
            if (s + 1 < t) {  // columns d = 16 kd + 2t + {0, 1} (b[0], b[2]) and + 8 (b[1], b[3])
                float f[4];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int d = 16 * kd + 2 * tq + (i & 1) + 8 * (i >> 1);
                    float x = 0.f;
                    for (int r = s + 1; r < t; r++) x += sG[r * K3 + d];
                    f[i] = e2x(x);
                }
                scale_split_<X>(b[0], bl[0], f[0], f[1]);
                scale_split_<X>(b[2], bl[2], f[0], f[1]);
                scale_split_<X>(b[1], bl[1], f[2], f[3]);
                scale_split_<X>(b[3], bl[3], f[2], f[3]);
            }
            mma_split<X>(nl[0], aw, awl, b, bl);
            mma_split<X>(nl[1], aw, awl, b + 2, bl + 2);
            mma_split<X>(pr[0], aq, aql, b, bl);
            mma_split<X>(pr[1], aq, aql, b + 2, bl + 2);
        }
        stc16_(sN + (t * CH4 + s) * LB4, nl, gq, tq);
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++)
                st2<X>(rec16(Rc::P, (gq + 8 * hf) * C4 + C3 * s + 8 * nt + 2 * tq), Rc::LOP / 2, pr[nt][2 * hf],
                       pr[nt][2 * hf + 1]);
    }
    for (int i = lane; i < C3 * C3 * (CH4 - 1 - t); i += 32) {  // P̄ blocks right of the diagonal
        const int r = i / (C3 * (CH4 - 1 - t)), col = C3 * (t + 1) + i % (C3 * (CH4 - 1 - t));
        *rec16(Rc::P, r * C4 + col) = 0;
        if constexpr (X) *rec16(Rc::P + Rc::LOP, r * C4 + col) = 0;
    }
    __syncthreads();

    // 4. Warp t's rows of T̃, −W̃ and Ũ (warp 0's are −W_0 and U_0 as they are), to the record.
    const uint16_t *sw = buf(t, 0), *su = buf(t, 1);
    switch (t) {
    case 1: chunk_rows_<X, 1>(sm4_, lane); break;
    case 2: chunk_rows_<X, 2>(sm4_, lane); break;
    case 3: chunk_rows_<X, 3>(sm4_, lane); break;
    default: break;
    }
    if (t > 0) sw = buf(t, 2), su = buf(t, 3);
    __syncwarp();
#pragma unroll
    for (int i = lane; i < C3 * K3 / 8; i += 32) {
        const int r = i / (K3 / 8), c = i % (K3 / 8);
        *reinterpret_cast<uint4 *>(R + Rc::W + (r * K3 + c * 8) * 2) =
            *reinterpret_cast<const uint4 *>(sw + r * LD3 + c * 8);
        *reinterpret_cast<uint4 *>(R + Rc::U + (r * V3 + c * 8) * 2) =
            *reinterpret_cast<const uint4 *>(su + r * LD3 + c * 8);
        if constexpr (X) {
            *reinterpret_cast<uint4 *>(R + Rc::W + Rc::LO3 + (r * K3 + c * 8) * 2) =
                *reinterpret_cast<const uint4 *>(sw + LO + r * LD3 + c * 8);
            *reinterpret_cast<uint4 *>(R + Rc::U + Rc::LOU + (r * V3 + c * 8) * 2) =
                *reinterpret_cast<const uint4 *>(su + LO + r * LD3 + c * 8);
        }
    }
}

// ---- pass 2: the state pass over chunks -------------------------------------------------------

// One ring stage = one piece (bytes): −W̃, Q̄, K̄^e [16][LD3] bf16 (then their lo planes), P̄ rows
// [16][LDP4] (then lo), e^Γ [K] fp32, the block's Ũ columns [16][LDU] (then lo). bf16x3: 35,840 B
// at WPB = 4, 6 stages 215,040 B (WPB = 8 would not fit; it runs WPB = 4).
template <int WPB, bool X>
struct St4Cfg {
    static constexpr int NP = Rec<X>::NP, LDU = 16 * WPB + 8;
    static constexpr int SW = 0, SQ = SW + C3 * LD3 * 2, SE = SQ + C3 * LD3 * 2, LO3 = 3 * C3 * LD3 * 2,
                         SP = NP * LO3, LOP = C3 * LDP4 * 2, SEG = SP + NP * LOP, SU = SEG + K3 * 4,
                         LOU = C3 * LDU * 2, STAGE = SU + NP * LOU;
    static constexpr size_t smem() { return (size_t)NST3 * STAGE; }
    static_assert(STAGE % 16 == 0 && SP % 16 == 0 && SEG % 16 == 0 && SU % 16 == 0 && LOP % 16 == 0 &&
                      LOU % 16 == 0 && LO3 % 16 == 0,
                  "stage alignment");
    static_assert(NST3 * STAGE <= 232448, "the sm_90 opt-in shared memory per block");
};

template <int WPB, bool WO, bool X>
__global__ void __launch_bounds__(32 * WPB, 1)
    kda4_state_k(int T, int H, int nc, const unsigned char *__restrict__ rec, const float *S0,
                 float *__restrict__ o, float *S_final) {
    using Cf = St4Cfg<WPB, X>;
    using Rc = Rec4<X>;
    constexpr int NTH = 32 * WPB, LDU = Cf::LDU, NB = K3 / 8;
    constexpr int LO3 = Cf::LO3 / 2, LOP = Cf::LOP / 2, LOU = Cf::LOU / 2;  // lo parts (elements)
    extern __shared__ __align__(16) unsigned char sm4_[];
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, gq = lane >> 2, tq = lane & 3;
    const int h = blockIdx.y, jb = blockIdx.x * 16 * WPB;
    const int jw = 16 * w, j0 = jb + jw;
    const int np = nc * CH4;  // pieces

    auto issue = [&](int n) {
        const unsigned char *R = rec + ((size_t)h * np + n) * Rc::BYTES;
        unsigned char *st = sm4_ + (n % NST3) * Cf::STAGE;
        for (int i = tid; i < 3 * Cf::NP * C3 * (K3 / 8); i += NTH) {
            const int r = i / (K3 / 8), c = i % (K3 / 8);
            cp_async16(st + r * LD3 * 2 + c * 16, R + r * K3 * 2 + c * 16);
        }
        for (int i = tid; i < Cf::NP * C3 * (C4 / 8); i += NTH) {
            const int r = i / (C4 / 8), c = i % (C4 / 8);  // r = part * 16 + row
            cp_async16(st + Cf::SP + r * LDP4 * 2 + c * 16, R + Rc::P + r * C4 * 2 + c * 16);
        }
        for (int i = tid; i < K3 / 4; i += NTH) cp_async16(st + Cf::SEG + i * 16, R + Rc::EG + i * 16);
        for (int i = tid; i < Cf::NP * C3 * 2 * WPB; i += NTH) {
            const int r = i / (2 * WPB), c = i % (2 * WPB);
            cp_async16(st + Cf::SU + r * LDU * 2 + c * 16, R + Rc::U + (r * V3 + jb) * 2 + c * 16);
        }
    };
#pragma unroll 1
    for (int s = 0; s < NST3 - 1; s++) {
        if (s < np) issue(s);
        cp_async_commit();
    }

    float st[NB][4];  // Sᵀ: st[nd][c] = S(d, j), d = 8 nd + 2t + (c & 1), j = j0 + g + 8 (c >> 1)
#pragma unroll
    for (int nd = 0; nd < NB; nd++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int d = 8 * nd + 2 * tq + (c & 1), j = j0 + gq + 8 * (c >> 1);
            st[nd][c] = S0 ? S0[((size_t)h * K3 + d) * V3 + j] : 0.f;
        }

#pragma unroll 1
    for (int ch = 0; ch < nc; ch++) {
        uint32_t sa[K3 / 16][4], sal[X ? K3 / 16 : 1][4];  // the chunk's start state as A fragments
        uint32_t da[CH4][4], dal[CH4][4];                   // Δ_iᵀ as A fragments
#pragma unroll
        for (int i = 0; i < CH4; i++) {
            const int n = ch * CH4 + i;
            cp_async_wait<NST3 - 2>();
            __syncthreads();
            if (n + NST3 - 1 < np) issue(n + NST3 - 1);
            cp_async_commit();
            const unsigned char *sb = sm4_ + (n % NST3) * Cf::STAGE;
            const uint16_t *sW = reinterpret_cast<const uint16_t *>(sb + Cf::SW),
                           *sQ = reinterpret_cast<const uint16_t *>(sb + Cf::SQ),
                           *sE = reinterpret_cast<const uint16_t *>(sb + Cf::SE),
                           *sP = reinterpret_cast<const uint16_t *>(sb + Cf::SP),
                           *sU = reinterpret_cast<const uint16_t *>(sb + Cf::SU);
            if (i == 0) {
                // pack Sᵀ (hi, lo), then decay it by e^Γ: the accumulators become S' = e^Γ S + ...
                const float *sEG = reinterpret_cast<const float *>(sb + Cf::SEG);
#pragma unroll
                for (int kd = 0; kd < K3 / 16; kd++) {
                    uint32_t hl[4];
                    acc_to_a_split(st[2 * kd], st[2 * kd + 1], sa[kd], hl);
                    if constexpr (X) {
#pragma unroll
                        for (int e = 0; e < 4; e++) sal[kd][e] = hl[e];
                    }
                }
#pragma unroll
                for (int nd = 0; nd < NB; nd++) {
                    const float2 e = *reinterpret_cast<const float2 *>(sEG + 8 * nd + 2 * tq);
                    st[nd][0] *= e.x;
                    st[nd][1] *= e.y;
                    st[nd][2] *= e.x;
                    st[nd][3] *= e.y;
                }
            }
            // Δ_iᵀ = Ũ_iᵀ + Sᵀ(−W̃_i)ᵀ; Oᵀ = Sᵀ Q̄_iᵀ (+ below)
            float dl[2][4], dx[2][4] = {}, oa[2][4] = {};
#pragma unroll
            for (int ns = 0; ns < 2; ns++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    const int iu = (8 * ns + 2 * tq + (c & 1)) * LDU + jw + gq + 8 * (c >> 1);
                    dl[ns][c] = bf2f(sU[iu]);
                    if constexpr (X) dl[ns][c] += bf2f(sU[iu + LOU]);
                }
#pragma unroll
            for (int kd = 0; kd < K3 / 16; kd++) {
                const uint32_t *a = sa[kd], *al = sal[X ? kd : 0];
                uint32_t b[4], bl[4];
                ldsm_split<X>(b, bl, adr_b_nk(sW, LD3, 16 * kd, 0, lane), LO3);
                float(*acc)[4] = (kd & 1) ? dx : dl;
                mma_split<X>(acc[0], a, al, b, bl);
                mma_split<X>(acc[1], a, al, b + 2, bl + 2);
                if (WO) {
                    uint32_t bq[4], bql[4];
                    ldsm_split<X>(bq, bql, adr_b_nk(sQ, LD3, 16 * kd, 0, lane), LO3);
                    mma_split<X>(oa[0], a, al, bq, bql);
                    mma_split<X>(oa[1], a, al, bq + 2, bql + 2);
                }
            }
#pragma unroll
            for (int ns = 0; ns < 2; ns++)
#pragma unroll
                for (int c = 0; c < 4; c++) dl[ns][c] += dx[ns][c];
            acc_to_a_split(dl[0], dl[1], da[i], dal[i]);
            if (WO) {
                // Oᵀ += Σ_{s <= i} Δ_sᵀ P̄_isᵀ: B(k = token of tile s, n = token r of this piece) = P̄[r][16 s + k]
#pragma unroll
                for (int s = 0; s <= i; s++) {
                    uint32_t bp[4], bpl[4];
                    ldsm_split<X>(bp, bpl, adr_b_nk(sP, LDP4, C3 * s, 0, lane), LOP);
                    mma_split<X>(oa[0], da[s], dal[s], bp, bpl);
                    mma_split<X>(oa[1], da[s], dal[s], bp + 2, bpl + 2);
                }
#pragma unroll
                for (int ns = 0; ns < 2; ns++)
#pragma unroll
                    for (int c = 0; c < 4; c++) {
                        const int tok = n * C3 + 8 * ns + 2 * tq + (c & 1);
                        if (tok < T) o[((size_t)tok * H + h) * V3 + j0 + gq + 8 * (c >> 1)] = oa[ns][c];
                    }
            }
            // S'ᵀ += Δ_iᵀ K̄^e_i: B(k = token, n = d) = K̄^e[token][d], k-major
#pragma unroll
            for (int pp = 0; pp < K3 / 16; pp++) {
                uint32_t b[4], bl[4];
                ldsm_split_t<X>(b, bl, adr_b_kn(sE, LD3, 0, 16 * pp, lane), LO3);
                mma_split<X>(st[2 * pp], da[i], dal[i], b, bl);
                mma_split<X>(st[2 * pp + 1], da[i], dal[i], b + 2, bl + 2);
            }
        }
    }
    cp_async_wait<0>();
    if (S_final) {
#pragma unroll
        for (int nd = 0; nd < NB; nd++)
#pragma unroll
            for (int c = 0; c < 4; c++)
                S_final[((size_t)h * K3 + 8 * nd + 2 * tq + (c & 1)) * V3 + j0 + gq + 8 * (c >> 1)] =
                    st[nd][c];
    }
}

template <int WPB, bool X>
void launch_state4_(mtrl_cuda_ctx *c, int T, int H, int nc, const unsigned char *rec, const float *S0,
                    float *o, float *S_final) {
    const size_t sh = St4Cfg<WPB, X>::smem();
    if (o) {
        set_smem(kda4_state_k<WPB, true, X>, sh);
        kda4_state_k<WPB, true, X><<<dim3(V3 / (16 * WPB), H), 32 * WPB, sh, c->stream>>>(T, H, nc, rec, S0, o,
                                                                                         S_final);
    } else {
        set_smem(kda4_state_k<WPB, false, X>, sh);
        kda4_state_k<WPB, false, X><<<dim3(V3 / (16 * WPB), H), 32 * WPB, sh, c->stream>>>(T, H, nc, rec, S0, o,
                                                                                          S_final);
    }
    CUDA_LAUNCH_CHECK();
}

template <bool X>
void kda4_run_(mtrl_cuda_ctx *c, int T, int H, const float *q, const float *k, const float *v, const float *g,
               const float *beta, const float *S0, float *o, float *S_final) {
    const int nc = (T + C4 - 1) / C4;
    unsigned char *rec = (unsigned char *)mtrl_ctx_scratch(c, (size_t)H * nc * CH4 * Rec4<X>::BYTES);
    const size_t shp = Prep4Cfg<X>::BYTES;
    set_smem(kda4_prep_k<X>, shp);
    kda4_prep_k<X><<<dim3(nc, H), 128, shp, c->stream>>>(T, H, nc, q, k, v, g, beta, rec);
    CUDA_LAUNCH_CHECK();
    switch (env_wpb_()) {
    case 1: launch_state4_<1, X>(c, T, H, nc, rec, S0, o, S_final); break;
    case 2: launch_state4_<2, X>(c, T, H, nc, rec, S0, o, S_final); break;
    default: launch_state4_<4, X>(c, T, H, nc, rec, S0, o, S_final); break;  // 4, and 8 (does not fit)
    }
}

}  // namespace

// The v4 forward (T >= 1; shapes checked by kda3_supports; no tile states): bf16x3 unless
// MTRL_KDA3_SPLIT=0. The chunk records live at the start of the context's scratch.
int kda4_chunk_fwd(mtrl_cuda_ctx *c, int T, int H, const float *q, const float *k, const float *v,
                   const float *g, const float *beta, const float *S0, float *o, float *S_final) {
    if (!env_is("MTRL_KDA3_SPLIT", "0")) kda4_run_<true>(c, T, H, q, k, v, g, beta, S0, o, S_final);
    else kda4_run_<false>(c, T, H, q, k, v, g, beta, S0, o, S_final);
    return 0;
}
