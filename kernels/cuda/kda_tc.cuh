// kda_tc.cuh: what the tensor-core KDA kernels share (kda_tc_cuda.cu: the forward v3 and its
// per-tile record; kda_tc_bwd_cuda.cu: the backward's state-gradient pass, which reads the same
// record): the shape constants, the record layout, the split-bf16 (bf16x3) fragment helpers, and the
// launchers one file calls in the other. Moved out of kda_tc_cuda.cu unchanged.
#ifndef MTRL_KDA_TC_CUH
#define MTRL_KDA_TC_CUH

#include "kernels/cuda/cuda_common.cuh"

namespace {

constexpr int C3 = 16;   // tile rows
constexpr int K3 = 128;  // the only K and V this version takes
constexpr int V3 = 128;
constexpr int LD3 = K3 + 8;  // bf16 row stride in shared memory (272 B: ldmatrix conflict-free)
constexpr int LDP3 = 24;     // P rows in shared memory (48 B: the 8 row addresses of an ldmatrix
                             // hit 8 distinct 16-byte bank groups)
constexpr int NST3 = 6;      // ring stages of the state pass
constexpr float kLog2e3 = 1.4426950408889634f;

// One (head, tile) record in scratch; byte offsets, all 16-byte aligned. With bf16x3 (X = true,
// below) every bf16 matrix also has its lo part: the lo planes of −W, Q⁺, K^e follow their three
// hi planes (so the state pass copies the [3 NP][16][K] block in one loop), U's and P's lo part
// follows their hi part. Without X the layout is v3's as measured.
template <bool X>
struct Rec {
    static constexpr int NP = X ? 2 : 1;           // parts of each bf16 matrix: hi (, lo)
    static constexpr int PL = C3 * K3 * 2;         // one [16][K] bf16 plane
    static constexpr int W = 0;                    // −W  [16][K] bf16
    static constexpr int Q = W + PL;               // Q⁺  [16][K] bf16
    static constexpr int E = Q + PL;               // K^e [16][K] bf16
    static constexpr int LO3 = 3 * PL;             // lo of −W, Q⁺, K^e at W, Q, E + LO3
    static constexpr int U = NP * LO3;             // U   [16][V] bf16, lo at U + LOU
    static constexpr int LOU = C3 * V3 * 2;
    static constexpr int P = U + NP * LOU;         // P   [16][16] bf16 (lower triangle, diagonal
    static constexpr int LOP = C3 * C3 * 2;        //     incl.), lo at P + LOP
    static constexpr int EG = P + NP * LOP;        // e^γ [K] fp32
    static constexpr int BYTES = EG + K3 * 4;      // 17408; bf16x3 34304
};
static_assert(Rec<false>::BYTES == 17408 && Rec<true>::BYTES == 34304, "record sizes (documented)");
static_assert(Rec<true>::P % 16 == 0 && Rec<true>::EG % 16 == 0 && Rec<false>::P % 16 == 0 &&
                  Rec<false>::EG % 16 == 0 && Rec<true>::BYTES % 16 == 0,
              "record alignment");

__device__ __forceinline__ float e2x(float x) { return ex2(x * kLog2e3); }  // e^x, ~2 ulp + arg rounding

// bf16x3 (the default; the option kda_plain_bf16 turns it off): x = hi + lo with hi = bf16(x) and lo = bf16(x − hi) (x − hi is exact
// in fp32), ~16 significant bits. pack_split packs a pair (the lower column in the low half) as a
// hi and a lo word; where only hi is used (X = false) the lo arithmetic is dead code, so the bf16
// path compiles to what it was.
__device__ __forceinline__ void pack_split(float a, float b, uint32_t &hi, uint32_t &lo) {
    hi = pack_bf16(a, b);
    lo = pack_bf16(a - bf2f((uint16_t)(hi & 0xffffu)), b - bf2f((uint16_t)(hi >> 16)));
}
// Two adjacent accumulator n-tiles c0, c1 (8 columns each) as the A fragment of one 16-wide
// k-step (the FA2 register trick, acc_to_a in attn_tc_cuda.cu): a[0] = c0[0..1], a[1] = c0[2..3],
// a[2] = c1[0..1], a[3] = c1[2..3]; hi and lo parts.
__device__ __forceinline__ void acc_to_a_split(const float *c0, const float *c1, uint32_t *hi,
                                               uint32_t *lo) {
    pack_split(c0[0], c0[1], hi[0], lo[0]);
    pack_split(c0[2], c0[3], hi[1], lo[1]);
    pack_split(c1[0], c1[1], hi[2], lo[2]);
    pack_split(c1[2], c1[3], hi[3], lo[3]);
}
// Stores two (st2) or four (st4) values as bf16 at p and, with X, their lo parts at p + lo.
template <bool X>
__device__ __forceinline__ void st2(uint16_t *p, int lo, float a, float b) {
    uint32_t h, l;
    pack_split(a, b, h, l);
    *reinterpret_cast<uint32_t *>(p) = h;
    if (X) *reinterpret_cast<uint32_t *>(p + lo) = l;
}
template <bool X>
__device__ __forceinline__ void st4(uint16_t *p, int lo, const float *x) {
    uint32_t h0, l0, h1, l1;
    pack_split(x[0], x[1], h0, l0);
    pack_split(x[2], x[3], h1, l1);
    *reinterpret_cast<uint2 *>(p) = make_uint2(h0, h1);
    if (X) *reinterpret_cast<uint2 *>(p + lo) = make_uint2(l0, l1);
}
// Fragment loads of the hi part at p and, with X, the lo part at p + lo (ldmatrix, .trans).
template <bool X>
__device__ __forceinline__ void ldsm_split(uint32_t *hi, uint32_t *lo, const uint16_t *p, int off) {
    ldsm_x4(hi, p);
    if (X) ldsm_x4(lo, p + off);
}
template <bool X>
__device__ __forceinline__ void ldsm_split_t(uint32_t *hi, uint32_t *lo, const uint16_t *p, int off) {
    ldsm_x4_t(hi, p);
    if (X) ldsm_x4_t(lo, p + off);
}
// c += a b on one m16n8k16 tile. With X, from hi / lo fragments: a_lo b_hi + a_hi b_lo + a_hi b_hi
// (the small terms first; a_lo b_lo, 2^-16 relative, is dropped): 3 mma instead of 1. Without X
// the lo fragments are not read.
template <bool X>
__device__ __forceinline__ void mma_split(float *c, const uint32_t *ah, const uint32_t *al,
                                          const uint32_t *bh, const uint32_t *bl) {
    if (X) {
        mma_bf16_16816(c, al, bh);
        mma_bf16_16816(c, ah, bl);
    }
    mma_bf16_16816(c, ah, bh);
}

// The K side of a ring stage of the sequential passes (bytes; the forward's StCfg and the
// backward's StBwdCfg put their own part after KEND): −W, Q⁺, K^e [16][LD3] bf16 (then, with X,
// their lo planes: LO3 on), P [16][LDP3] (then lo), e^γ [K] fp32.
template <bool X>
struct StKside {
    static constexpr int NP = Rec<X>::NP;
    static constexpr int SW = 0, SQ = SW + C3 * LD3 * 2, SE = SQ + C3 * LD3 * 2,
                         LO3 = 3 * C3 * LD3 * 2,  // lo of −W, Q⁺, K^e at SW, SQ, SE + LO3
                         SP = NP * LO3, LOP = C3 * LDP3 * 2, SEG = SP + NP * LOP, KEND = SEG + K3 * 4;
    static_assert(SP % 16 == 0 && SEG % 16 == 0 && LOP % 16 == 0 && LO3 % 16 == 0 && KEND % 16 == 0,
                  "stage alignment");
};

// What the sequential passes (kda_tc_cuda.cu's forward, kda_tc_bwd_cuda.cu's backward) share,
// as macros because the same code as inline functions compiled to other machine code in them
// (tools/cubin_compare.py), and their times were measured as they are:
//   KDA3_STAGE_KSIDE_: the K side of tile record R into ring stage st by cp.async (thread tid of
//     nth; np parts of each bf16 matrix): −W, Q⁺, K^e (then their lo planes), contiguous in the
//     record ([3 np][16][K]), padded to LD3 rows at the stage's start; P (its lo rows after its hi
//     rows) padded to LDP3 rows at byte sp; e^γ at byte seg.
//   KDA3_STATE_LOAD_ / _STORE_: a warp's state (16 value columns j0.., all K rows) in the mma
//     accumulator layout, st[nd][c] = S(d, j), d = 8 nd + 2t + (c & 1), j = j0 + g + 8 (c >> 1),
//     from / to head h of S [H][K][V] (fp32); the load gives zeros where S is NULL.
#define KDA3_STAGE_KSIDE_(st, R, sp, seg, tid, nth, np)                                          \
    do {                                                                                          \
        for (int i_ = (tid); i_ < 3 * (np) * C3 * (K3 / 8); i_ += (nth)) {                        \
            const int r_ = i_ / (K3 / 8), c_ = i_ % (K3 / 8);                                     \
            cp_async16((st) + r_ * LD3 * 2 + c_ * 16, (R) + r_ * K3 * 2 + c_ * 16);               \
        }                                                                                         \
        for (int i_ = (tid); i_ < (np) * C3 * 2; i_ += (nth))                                     \
            cp_async16((st) + (sp) + (i_ >> 1) * LDP3 * 2 + (i_ & 1) * 16, (R) + Rec<X>::P + i_ * 16); \
        for (int i_ = (tid); i_ < K3 / 4; i_ += (nth)) cp_async16((st) + (seg) + i_ * 16, (R) + Rec<X>::EG + i_ * 16); \
    } while (0)
#define KDA3_STATE_LOAD_(st, S, h, j0, gq, tq)                                                    \
    do {                                                                                          \
        _Pragma("unroll") for (int nd_ = 0; nd_ < K3 / 8; nd_++)                                  \
        _Pragma("unroll") for (int c_ = 0; c_ < 4; c_++) {                                        \
            const int d_ = 8 * nd_ + 2 * (tq) + (c_ & 1), j_ = (j0) + (gq) + 8 * (c_ >> 1);       \
            (st)[nd_][c_] = (S) ? (S)[((size_t)(h) * K3 + d_) * V3 + j_] : 0.f;                 \
        }                                                                                         \
    } while (0)
#define KDA3_STATE_STORE_(S, st, h, j0, gq, tq)                                                   \
    do {                                                                                          \
        _Pragma("unroll") for (int nd_ = 0; nd_ < K3 / 8; nd_++)                                  \
        _Pragma("unroll") for (int c_ = 0; c_ < 4; c_++)                                          \
            (S)[((size_t)(h) * K3 + 8 * nd_ + 2 * (tq) + (c_ & 1)) * V3 + (j0) + (gq) + 8 * (c_ >> 1)] = \
                (st)[nd_][c_];                                                                    \
    } while (0)

// The option kda_warps = 1|2|4|8: warps per block of the state passes; default (0) 4.
inline int opt_wpb_(const mtrl_cuda_ctx *c) {
    const int x = c->opts.kda_warps;
    return x == 1 || x == 2 || x == 4 || x == 8 ? x : 4;
}

}  // namespace

// kda_tc_cuda.cu: the record's size per (head, tile) (split: bf16x3), the prep that writes it for
// every tile of every head (rec: H x tiles records, scratch the caller owns), and the forward state
// pass over it (o, S_final, S_tiles each optional, as kda3_chunk_fwd). T >= 1, K = V = 128, q, k,
// v, g 16-byte aligned (kda3_supports).
size_t kda3_rec_bytes(int split);
void kda3_prep_launch(mtrl_cuda_ctx *c, int T, int H, const float *q, const float *k, const float *v,
                      const float *g, const float *beta, unsigned char *rec, int split);
void kda3_state_fwd_launch(mtrl_cuda_ctx *c, int T, int H, const unsigned char *rec, const float *S0,
                           float *o, float *S_final, float *S_tiles, int split);

#endif
