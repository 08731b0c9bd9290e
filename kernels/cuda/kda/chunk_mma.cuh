// kda/chunk_mma.cuh: what the tensor-core KDA kernels share (kda/chunk_mma.cu: the forward v3 and its
// per-tile record; kda/chunk_mma_bwd.cu: the backward's state-gradient pass, which reads the same
// record; kda/chunk_parallel.cu: the chunk-parallel forward, which runs the forward's state pass tile over
// the same records): the shape constants, the record layout, the split-bf16 (bf16x3) fragment
// helpers, the forward pass's ring stage (StCfg) and tile (KDA3_STATE_TILE_), and the launchers one
// file calls in another. Moved out of kda/chunk_mma.cu unchanged (tools/cubin_compare.py: every
// kernel of kda/chunk_mma.cu and kda/chunk_mma_bwd.cu the same machine code as before the move).
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
// k-step (the FA2 register trick, acc_to_a in attn/causal_mma.cu): a[0] = c0[0..1], a[1] = c0[2..3],
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

// What the sequential passes (kda/chunk_mma.cu's forward, kda/chunk_mma_bwd.cu's backward) share,
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

// One ring stage (bytes): −W, Q⁺, K^e [16][LD3] bf16, P [16][LDP3] bf16, e^γ [K] fp32, then the
// block's U columns [16][LDU] bf16 with LDU = 16 WPB + 8 (the scalar U reads of a warp then hit
// distinct banks: rows 2t + c are 2 (LDU / 2) words apart, ≡ 8 mod 32). With X each bf16 matrix
// has its lo part too (as in the record: the lo planes of −W, Q⁺, K^e after their hi planes, P's
// and U's after theirs): 32,768 B per stage at WPB = 4 instead of 16,640 (6 stages: 178,176 /
// 184,320 / 196,608 / 221,184 B at WPB = 1 / 2 / 4 / 8, within the 232,448 B an sm_90 block may
// opt in to).
template <int WPB, bool X>
struct StCfg : StKside<X> {
    using K = StKside<X>;
    static constexpr int LDU = 16 * WPB + 8;
    static constexpr int SU = K::KEND, LOU = C3 * LDU * 2, STAGE = SU + K::NP * LOU;
    static constexpr size_t smem() { return (size_t)NST3 * STAGE; }
    static_assert(STAGE % 16 == 0 && LOU % 16 == 0, "stage alignment");
    static_assert(NST3 * STAGE <= 232448, "the sm_90 opt-in shared memory per block");
};

// One tile of the forward state pass for one warp, shared by kda3_state_k, the chunk-parallel
// forward's kda_cp_state_k and the varlen forward's state pass (their arithmetic is the same by
// construction): the stage's pointers sW, sQ, sE, sP, sU, sEG, Sᵀ in st (updated to the tile's
// outgoing state); S_tiles gets the incoming state of tile n, o (WO) the tile's output rows. A
// macro, not an inline function: as a function the same arithmetic
// compiled to other machine code (tools/cubin_compare.py; docs/kernel-lab.md), and these kernels'
// times were measured as they are. Its steps (the algebra: the header comment at the top):
//   * S_tiles: the incoming state, fp32, each store filling four 32-byte sectors;
//   * Sᵀ as A fragments per k-step kd (columns d 16 kd.., rows j0 + g, + 8): bf16 packed for all
//     k-steps up front; bf16x3 packs hi and lo per k-step inside the loop, so the lo fragments
//     hold no registers across it;
//   * Δᵀ = Uᵀ + Sᵀ(−W)ᵀ (B = −W n-major), U read as hi + lo (exact: 16 bits), even and odd
//     k-steps in two accumulators (chains of 4, not 8); with WO, Oᵀ = Sᵀ Q⁺ᵀ in the same loop;
//   * Δᵀ as one A fragment (acc_to_a_split); with WO, Oᵀ += Δᵀ Pᵀ and the tile's rows of o
//     (tokens < T);
//   * S'ᵀ = Sᵀ diag(e^γ) + Δᵀ K^e (B = K^e k-major, ldmatrix .trans) in the accumulators.
#define KDA3_STATE_TILE_() \
        if (S_tiles) {                                                                                \
            float *Sd = S_tiles + ((size_t)n * H + h) * K3 * V3;                                      \
_Pragma("unroll")                                                                                     \
            for (int nd = 0; nd < NB; nd++)                                                           \
_Pragma("unroll")                                                                                     \
                for (int c = 0; c < 4; c++)                                                           \
                    __stcs(Sd + (size_t)(8 * nd + 2 * tq + (c & 1)) * V3 + j0 + gq + 8 * (c >> 1),    \
                           st[nd][c]);                                                                \
        }                                                                                             \
        uint32_t sa[X ? 1 : K3 / 16][4];                                                              \
        if constexpr (!X) {                                                                           \
_Pragma("unroll")                                                                                     \
            for (int kd = 0; kd < K3 / 16; kd++) {                                                    \
                sa[kd][0] = pack_bf16(st[2 * kd][0], st[2 * kd][1]);                                  \
                sa[kd][1] = pack_bf16(st[2 * kd][2], st[2 * kd][3]);                                  \
                sa[kd][2] = pack_bf16(st[2 * kd + 1][0], st[2 * kd + 1][1]);                          \
                sa[kd][3] = pack_bf16(st[2 * kd + 1][2], st[2 * kd + 1][3]);                          \
            }                                                                                         \
        }                                                                                             \
        float dl[2][4], dx[2][4] = {}, oa[2][4] = {};                                                 \
_Pragma("unroll")                                                                                     \
        for (int ns = 0; ns < 2; ns++)                                                                \
_Pragma("unroll")                                                                                     \
            for (int c = 0; c < 4; c++) {                                                             \
                const int iu = (8 * ns + 2 * tq + (c & 1)) * LDU + jw + gq + 8 * (c >> 1);            \
                dl[ns][c] = bf2f(sU[iu]);                                                             \
                if constexpr (X) dl[ns][c] += bf2f(sU[iu + LOU]);                                     \
            }                                                                                         \
_Pragma("unroll")                                                                                     \
        for (int kd = 0; kd < K3 / 16; kd++) {                                                        \
            uint32_t ah[4], al[4];                                                                    \
            if constexpr (X) acc_to_a_split(st[2 * kd], st[2 * kd + 1], ah, al);                      \
            const uint32_t *a = X ? ah : sa[X ? 0 : kd];                                              \
            uint32_t b[4], bl[4];                                                                     \
            ldsm_split<X>(b, bl, adr_b_nk(sW, LD3, 16 * kd, 0, lane), LO3);                           \
            float(*acc)[4] = (kd & 1) ? dx : dl;                                                      \
            mma_split<X>(acc[0], a, al, b, bl);                                                       \
            mma_split<X>(acc[1], a, al, b + 2, bl + 2);                                               \
            if (WO) {                                                                                 \
                uint32_t bq[4], bql[4];                                                               \
                ldsm_split<X>(bq, bql, adr_b_nk(sQ, LD3, 16 * kd, 0, lane), LO3);                     \
                mma_split<X>(oa[0], a, al, bq, bql);                                                  \
                mma_split<X>(oa[1], a, al, bq + 2, bql + 2);                                          \
            }                                                                                         \
        }                                                                                             \
_Pragma("unroll")                                                                                     \
        for (int ns = 0; ns < 2; ns++)                                                                \
_Pragma("unroll")                                                                                     \
            for (int c = 0; c < 4; c++) dl[ns][c] += dx[ns][c];                                       \
        uint32_t da[4], dal[4];                                                                       \
        acc_to_a_split(dl[0], dl[1], da, dal);                                                        \
        if (WO) {                                                                                     \
            uint32_t bp[4], bpl[4];                                                                   \
            ldsm_split<X>(bp, bpl, adr_b_nk(sP, LDP3, 0, 0, lane), LOP);                              \
            mma_split<X>(oa[0], da, dal, bp, bpl);                                                    \
            mma_split<X>(oa[1], da, dal, bp + 2, bpl + 2);                                            \
_Pragma("unroll")                                                                                     \
            for (int ns = 0; ns < 2; ns++)                                                            \
_Pragma("unroll")                                                                                     \
                for (int c = 0; c < 4; c++) {                                                         \
                    const int tok = n * C3 + 8 * ns + 2 * tq + (c & 1);                               \
                    if (tok < T) o[((size_t)tok * H + h) * V3 + j0 + gq + 8 * (c >> 1)] = oa[ns][c];  \
                }                                                                                     \
        }                                                                                             \
_Pragma("unroll")                                                                                     \
        for (int nd = 0; nd < NB; nd++) {                                                             \
            const float2 e = *reinterpret_cast<const float2 *>(sEG + 8 * nd + 2 * tq);                \
            st[nd][0] *= e.x;                                                                         \
            st[nd][1] *= e.y;                                                                         \
            st[nd][2] *= e.x;                                                                         \
            st[nd][3] *= e.y;                                                                         \
        }                                                                                             \
_Pragma("unroll")                                                                                     \
        for (int pp = 0; pp < K3 / 16; pp++) {                                                        \
            uint32_t b[4], bl[4];                                                                     \
            ldsm_split_t<X>(b, bl, adr_b_kn(sE, LD3, 0, 16 * pp, lane), LO3);                         \
            mma_split<X>(st[2 * pp], da, dal, b, bl);                                                 \
            mma_split<X>(st[2 * pp + 1], da, dal, b + 2, bl + 2);                                     \
        }                                                                                             \
        do {} while (0)

// The state pass's walk over tiles N0 .. N1 - 1 on a ring of NST shared-memory stages, the same in
// the three state passes: the caller has issued the first NST - 1 tiles' copies (its lambda
// issue(n) copies tile n into stage n % NST, one cp.async group each, empty groups included) and
// loaded Sᵀ into st; each tile waits for its group, refills the stage the previous tile used and
// runs KDA3_STATE_TILE_ on its stage; all copies have landed at the end. A macro for the reason
// KDA3_STATE_TILE_ is one.
#define KDA3_STATE_TILES_(NST, N0, N1)                                                                 \
_Pragma("unroll 1")                                                                                   \
    for (int n = (N0); n < (N1); n++) {                                                               \
        cp_async_wait<(NST) - 2>(); /* tile n's group has landed (this thread's copies) */            \
        __syncthreads();            /* everyone's copies visible; everyone is done with tile n - 1 */ \
        if (n + (NST) - 1 < (N1)) issue(n + (NST) - 1); /* into tile n - 1's stage */                 \
        cp_async_commit();                                                                            \
        const unsigned char *sb = sm3_ + (n % (NST)) * Cf::STAGE;                                     \
        const uint16_t *sW = reinterpret_cast<const uint16_t *>(sb + Cf::SW),                         \
                       *sQ = reinterpret_cast<const uint16_t *>(sb + Cf::SQ),                         \
                       *sE = reinterpret_cast<const uint16_t *>(sb + Cf::SE),                         \
                       *sP = reinterpret_cast<const uint16_t *>(sb + Cf::SP),                         \
                       *sU = reinterpret_cast<const uint16_t *>(sb + Cf::SU);                         \
        const float *sEG = reinterpret_cast<const float *>(sb + Cf::SEG);                             \
        KDA3_STATE_TILE_();                                                                           \
    }                                                                                                 \
    cp_async_wait<0>()

// ---- the forward's per-tile record (pass 1) --------------------------------------------------
//
// KDA3_PREP_TILE_(RI): warp w of a 4-warp block writes the record of tile n (tokens 16 n .. of a
// sequence of T tokens at q, k, v, g (fp32 or bf16: ldg4_or0), beta; head h) at rec + (h nt + RI) Rec<X>::BYTES, in its
// PrepCfg<X>::WARP_BYTES of the block's shared memory sm3_ (from w WARP_BYTES on); the enclosing
// scope defines T, H, nt, n, h, lane, w, q, k, v, g, beta, rec, sm3_, X, Rc = Rec<X> and
// LO = PrepCfg<X>::LO. The body of kda3_prep_k (kda/chunk_mma.cu), which runs it over every
// (tile, head) of one sequence (RI = n); the varlen forward (kda/chunk_varlen_mma.cu) runs it over every
// tile of many sequences in one launch (RI: the tile's place in the flat list), so a tile's record
// has the same bits whichever launch wrote it. A macro, as KDA3_STATE_TILE_ below and for the same
// reason: as an inline function the same code compiled to other machine code in kda3_prep_k
// (tools/cubin_compare.py), whose times were measured as it is.

// The macro's input loads (4 columns of one row of q, k, v or g; zeros for a padded row), by the
// inputs' type: fp32 as one 16-byte load; bf16 (mtrl_kda_chunk_fwd_bf16) as one 8-byte load widened
// exactly to fp32, so from there on the prep computes what it computes from the same values in fp32
// (the records, and so the forward, are bit for bit the fp32 prep's on the widened inputs).
__device__ __forceinline__ float4 ldg4_or0(const float *p, bool ok) {
    return ok ? __ldg(reinterpret_cast<const float4 *>(p)) : make_float4(0.f, 0.f, 0.f, 0.f);
}
__device__ __forceinline__ float4 ldg4_or0(const mtrl_bf16 *p, bool ok) {
    if (!ok) return make_float4(0.f, 0.f, 0.f, 0.f);
    const uint2 u = __ldg(reinterpret_cast<const uint2 *>(p));  // columns 0, 1 in u.x (0 in the low half)
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                       __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
}
__device__ __forceinline__ float comp(const float4 &x, int c) {
    return c == 0 ? x.x : c == 1 ? x.y : c == 2 ? x.z : x.w;
}

// Shared memory of one warp: K̂⁺ (later the −W staging), Q̂⁺ (later the U staging), K̂⁻, β K⁺,
// β V as bf16 [16][LD3] (with X, then their five lo planes, LO elements on); M and T as fp32
// [16][17].
template <bool X>
struct PrepCfg {
    static constexpr int LO = 5 * C3 * LD3;
    static constexpr int WARP_BYTES = Rec<X>::NP * LO * 2 + 2 * C3 * 17 * 4;  // 23936; bf16x3 45696
    static_assert(WARP_BYTES % 16 == 0 && (LO * 2) % 16 == 0, "per-warp shared memory alignment");
};

#define KDA3_PREP_TILE_(RI) \
    uint16_t *sKp = reinterpret_cast<uint16_t *>(sm3_ + w * PrepCfg<X>::WARP_BYTES);                        \
    uint16_t *sQh = sKp + C3 * LD3, *sKm = sQh + C3 * LD3, *sBK = sKm + C3 * LD3,                           \
             *sBV = sBK + C3 * LD3;                                                                         \
    float *sM = reinterpret_cast<float *>(sKp + Rc::NP * LO), *sT = sM + C3 * 17;                           \
    unsigned char *R = rec + ((size_t)h * nt + (RI)) * Rc::BYTES;                                           \
    /* the record's bf16 matrix at byte offset m, element e (R + m + 2e, as the bf16 path addressed it) */  \
    auto rec16 = [&](int m, int e) { return reinterpret_cast<uint16_t *>(R + m + e * 2); };                 \
                                                                                                            \
    const int t0 = n * C3, cr = min(C3, T - t0), m = min(8, cr - 1), d0 = 4 * lane;                         \
    const int gq = lane >> 2, tq = lane & 3;  /* fragment coordinates (g, t) */                             \
    const float bl = lane < cr ? beta[(size_t)(t0 + lane) * H + h] : 0.f;  /* β of row `lane` */            \
                                                                                                            \
    /* G = cumsum(g) over the tile's rows for this lane's 4 columns (padded rows: g = 0, so */              \
    /* G_15 = G_{c-1} = γ); Gm = G_m (selected, not indexed: m is not a compile-time constant). */          \
    float4 G[C3];                                                                                           \
_Pragma("unroll")                                                                                           \
    for (int r = 0; r < C3; r++) G[r] = ldg4_or0(g + ((size_t)(t0 + r) * H + h) * K3 + d0, r < cr);         \
_Pragma("unroll")                                                                                           \
    for (int r = 1; r < C3; r++) {                                                                          \
        G[r].x += G[r - 1].x; G[r].y += G[r - 1].y; G[r].z += G[r - 1].z; G[r].w += G[r - 1].w;             \
    }                                                                                                       \
    float4 Gm = G[0];                                                                                       \
_Pragma("unroll")                                                                                           \
    for (int r = 1; r <= 8; r++)                                                                            \
        if (r == m) Gm = G[r];                                                                              \
    const float4 gam = G[C3 - 1];                                                                           \
    /* e^γ (fp32) for the state pass */                                                                     \
    *reinterpret_cast<float4 *>(R + Rc::EG + 4 * d0) =                                                      \
        make_float4(e2x(gam.x), e2x(gam.y), e2x(gam.z), e2x(gam.w));                                        \
                                                                                                            \
    /* Scaled operands, 4 rows at a time (12 independent 16-byte loads in flight per lane): */              \
    /* to shared memory (bf16): K̂⁺ = k e^{G−Gm}, Q̂⁺ = q e^{G−Gm}, K̂⁻ = k e^{Gm−G}, β K⁺ = β k e^{G}, */  \
    /* β V; to the record (bf16): Q⁺ = q e^{G}, K^e = k e^{γ−G}. With X, each with its lo part. */          \
_Pragma("unroll")                                                                                           \
    for (int r0 = 0; r0 < C3; r0 += 4) {                                                                    \
        float4 qv[4], kv[4], vv[4];                                                                         \
_Pragma("unroll")                                                                                           \
        for (int i = 0; i < 4; i++) {                                                                       \
            const int r = r0 + i;                                                                           \
            const size_t row = (size_t)(t0 + r) * H + h;                                                    \
            qv[i] = ldg4_or0(q + row * K3 + d0, r < cr);                                                    \
            kv[i] = ldg4_or0(k + row * K3 + d0, r < cr);                                                    \
            vv[i] = ldg4_or0(v + row * V3 + d0, r < cr);                                                    \
        }                                                                                                   \
_Pragma("unroll")                                                                                           \
        for (int i = 0; i < 4; i++) {                                                                       \
            const int r = r0 + i;                                                                           \
            const float br = __shfl_sync(0xffffffffu, bl, r);                                               \
            float kp[4], qh[4], km[4], bk[4], qp[4], ke[4], bv[4];                                          \
_Pragma("unroll")                                                                                           \
            for (int c = 0; c < 4; c++) {                                                                   \
                const float Gc = comp(G[r], c), Gmc = comp(Gm, c), gc = comp(gam, c);                       \
                const float kc = comp(kv[i], c), qc = comp(qv[i], c);                                       \
                const float e1 = e2x(Gc - Gmc), e2 = e2x(Gmc - Gc), e3 = e2x(Gc), e4 = e2x(gc - Gc);        \
                kp[c] = kc * e1;                                                                            \
                qh[c] = qc * e1;                                                                            \
                km[c] = kc * e2;                                                                            \
                bk[c] = br * (kc * e3);                                                                     \
                qp[c] = qc * e3;                                                                            \
                ke[c] = kc * e4;                                                                            \
                bv[c] = br * comp(vv[i], c);                                                                \
            }                                                                                               \
            st4<X>(sKp + r * LD3 + d0, LO, kp);                                                             \
            st4<X>(sQh + r * LD3 + d0, LO, qh);                                                             \
            st4<X>(sKm + r * LD3 + d0, LO, km);                                                             \
            st4<X>(sBK + r * LD3 + d0, LO, bk);                                                             \
            st4<X>(sBV + r * LD3 + d0, LO, bv);                                                             \
            st4<X>(rec16(Rc::Q, r * K3 + d0), Rc::LO3 / 2, qp);                                             \
            st4<X>(rec16(Rc::E, r * K3 + d0), Rc::LO3 / 2, ke);                                             \
        }                                                                                                   \
    }                                                                                                       \
    __syncwarp();                                                                                           \
                                                                                                            \
    /* X = K̂⁺ K̂⁻ᵀ and P = Q̂⁺ K̂⁻ᵀ: A = K̂⁺ / Q̂⁺ (row i = token, col = d), B(k = d, n = token j) = */    \
    /* K̂⁻[j][d] (n-major). Accumulator x[nt][c] = X(i, j), i = g + 8 (c >> 1), j = 8 nt + 2t + (c & 1). */ \
    float x[2][4] = {}, p[2][4] = {};                                                                       \
_Pragma("unroll")                                                                                           \
    for (int kd = 0; kd < K3 / 16; kd++) {                                                                  \
        uint32_t a[4], aq[4], b[4], al[4], aql[4], bl[4];                                                   \
        ldsm_split<X>(a, al, adr_a(sKp, LD3, 16 * kd, lane), LO);                                           \
        ldsm_split<X>(aq, aql, adr_a(sQh, LD3, 16 * kd, lane), LO);                                         \
        ldsm_split<X>(b, bl, adr_b_nk(sKm, LD3, 16 * kd, 0, lane), LO);                                     \
        mma_split<X>(x[0], a, al, b, bl);                                                                   \
        mma_split<X>(x[1], a, al, b + 2, bl + 2);                                                           \
        mma_split<X>(p[0], aq, aql, b, bl);                                                                 \
        mma_split<X>(p[1], aq, aql, b + 2, bl + 2);                                                         \
    }                                                                                                       \
    /* M = StrictTril(diag(β) X) to shared memory (fp32), P = Tril(Q̂⁺K̂⁻ᵀ) to the record (bf16). */        \
    /* Masks by select, never by multiply: the upper entries may be as large as e^75 (§2.5). */             \
    {                                                                                                       \
        const float bg[2] = {__shfl_sync(0xffffffffu, bl, gq), __shfl_sync(0xffffffffu, bl, gq + 8)};       \
_Pragma("unroll")                                                                                           \
        for (int nt2 = 0; nt2 < 2; nt2++)                                                                   \
_Pragma("unroll")                                                                                           \
            for (int hf = 0; hf < 2; hf++) {                                                                \
                const int i = gq + 8 * hf, j = 8 * nt2 + 2 * tq;                                            \
                sM[i * 17 + j] = j < i ? bg[hf] * x[nt2][2 * hf] : 0.f;                                     \
                sM[i * 17 + j + 1] = j + 1 < i ? bg[hf] * x[nt2][2 * hf + 1] : 0.f;                         \
                st2<X>(rec16(Rc::P, i * C3 + j), Rc::LOP / 2, j <= i ? p[nt2][2 * hf] : 0.f,                \
                       j + 1 <= i ? p[nt2][2 * hf + 1] : 0.f);                                              \
            }                                                                                               \
    }                                                                                                       \
    __syncwarp();                                                                                           \
    /* T = (I + M)^-1 by forward substitution, fp32: lane j < 16 owns column j (as v2's tile_prep). */      \
    if (lane < C3) {                                                                                        \
        const int j = lane;                                                                                 \
        float col[C3];                                                                                      \
_Pragma("unroll")                                                                                           \
        for (int i = 0; i < C3; i++) {                                                                      \
            float acc = 0.f;                                                                                \
_Pragma("unroll")                                                                                           \
            for (int l = 0; l < i; l++) acc = fmaf(sM[i * 17 + l], col[l], acc);                            \
            col[i] = i == j ? 1.f : (i > j ? -acc : 0.f);                                                   \
        }                                                                                                   \
_Pragma("unroll")                                                                                           \
        for (int i = 0; i < C3; i++) sT[i * 17 + j] = col[i];                                               \
    }                                                                                                       \
    __syncwarp();                                                                                           \
    /* T as the A fragment (row i = token, col l = token): a[0] = T(g, 2t..2t+1), a[1] = T(g+8, 2t..), */   \
    /* a[2] = T(g, 2t+8..), a[3] = T(g+8, 2t+8..). */                                                       \
    uint32_t ta[4], tl[4];                                                                                  \
    pack_split(sT[gq * 17 + 2 * tq], sT[gq * 17 + 2 * tq + 1], ta[0], tl[0]);                               \
    pack_split(sT[(gq + 8) * 17 + 2 * tq], sT[(gq + 8) * 17 + 2 * tq + 1], ta[1], tl[1]);                   \
    pack_split(sT[gq * 17 + 2 * tq + 8], sT[gq * 17 + 2 * tq + 9], ta[2], tl[2]);                           \
    pack_split(sT[(gq + 8) * 17 + 2 * tq + 8], sT[(gq + 8) * 17 + 2 * tq + 9], ta[3], tl[3]);               \
    /* W = T (β K⁺) and U = T (β V): B(k = token l, n = column) = (β K⁺)[l][d], k-major (ldsm .trans). */   \
    /* Results (C layout: row i = g / g+8, columns 16 pp + 8 half + 2t..2t+1) are staged as bf16 */         \
    /* in the K̂⁺ (−W) and Q̂⁺ (U) buffers (and their lo planes), free since the barrier above, then */     \
    /* copied out in rows. */                                                                               \
_Pragma("unroll")                                                                                           \
    for (int pp = 0; pp < K3 / 16; pp++) {                                                                  \
        uint32_t b[4], bu[4], bl[4], bul[4];                                                                \
        ldsm_split_t<X>(b, bl, adr_b_kn(sBK, LD3, 0, 16 * pp, lane), LO);                                   \
        ldsm_split_t<X>(bu, bul, adr_b_kn(sBV, LD3, 0, 16 * pp, lane), LO);                                 \
        float w0[4] = {}, w1[4] = {}, u0[4] = {}, u1[4] = {};                                               \
        mma_split<X>(w0, ta, tl, b, bl);                                                                    \
        mma_split<X>(w1, ta, tl, b + 2, bl + 2);                                                            \
        mma_split<X>(u0, ta, tl, bu, bul);                                                                  \
        mma_split<X>(u1, ta, tl, bu + 2, bul + 2);                                                          \
        const int c0 = 16 * pp + 2 * tq, c1 = c0 + 8;                                                       \
        st2<X>(sKp + gq * LD3 + c0, LO, -w0[0], -w0[1]);                                                    \
        st2<X>(sKp + (gq + 8) * LD3 + c0, LO, -w0[2], -w0[3]);                                              \
        st2<X>(sKp + gq * LD3 + c1, LO, -w1[0], -w1[1]);                                                    \
        st2<X>(sKp + (gq + 8) * LD3 + c1, LO, -w1[2], -w1[3]);                                              \
        st2<X>(sQh + gq * LD3 + c0, LO, u0[0], u0[1]);                                                      \
        st2<X>(sQh + (gq + 8) * LD3 + c0, LO, u0[2], u0[3]);                                                \
        st2<X>(sQh + gq * LD3 + c1, LO, u1[0], u1[1]);                                                      \
        st2<X>(sQh + (gq + 8) * LD3 + c1, LO, u1[2], u1[3]);                                                \
    }                                                                                                       \
    __syncwarp();                                                                                           \
    /* Copy out −W and U (hi, then with X lo): rows of K (V) bf16 in 16-byte pieces, 256 contiguous */      \
    /* bytes per row. */                                                                                    \
_Pragma("unroll")                                                                                           \
    for (int i = lane; i < C3 * K3 / 8; i += 32) {                                                          \
        const int r = i / (K3 / 8), c = i % (K3 / 8);                                                       \
        *reinterpret_cast<uint4 *>(R + Rc::W + (r * K3 + c * 8) * 2) =                                      \
            *reinterpret_cast<const uint4 *>(sKp + r * LD3 + c * 8);                                        \
        *reinterpret_cast<uint4 *>(R + Rc::U + (r * V3 + c * 8) * 2) =                                      \
            *reinterpret_cast<const uint4 *>(sQh + r * LD3 + c * 8);                                        \
        if constexpr (X) {                                                                                  \
            *reinterpret_cast<uint4 *>(R + Rc::W + Rc::LO3 + (r * K3 + c * 8) * 2) =                        \
                *reinterpret_cast<const uint4 *>(sKp + LO + r * LD3 + c * 8);                               \
            *reinterpret_cast<uint4 *>(R + Rc::U + Rc::LOU + (r * V3 + c * 8) * 2) =                        \
                *reinterpret_cast<const uint4 *>(sQh + LO + r * LD3 + c * 8);                               \
        }                                                                                                   \
    }                                                                                                       \
    do {} while (0)

}  // namespace

// kda/chunk_mma.cu: the record's size per (head, tile) (split: bf16x3), the prep that writes it for
// every tile of every head (rec: H x tiles records, scratch the caller owns), and the forward state
// pass over it (o, S_final, S_tiles each optional, as kda3_chunk_fwd). T >= 1, K = V = 128, q, k,
// v, g 16-byte aligned (kda3_supports); the prep reads them as fp32 or as bf16 (the same records
// from the same values).
size_t kda3_rec_bytes(int split);
void kda3_prep_launch(mtrl_cuda_ctx *c, int T, int H, const float *q, const float *k, const float *v,
                      const float *g, const float *beta, unsigned char *rec, int split);
void kda3_prep_launch(mtrl_cuda_ctx *c, int T, int H, const mtrl_bf16 *q, const mtrl_bf16 *k, const mtrl_bf16 *v,
                      const mtrl_bf16 *g, const float *beta, unsigned char *rec, int split);
void kda3_state_fwd_launch(mtrl_cuda_ctx *c, int T, int H, const unsigned char *rec, const float *S0,
                           float *o, float *S_final, float *S_tiles, int split);

// The varlen backward's passes over a group of np consecutive pieces of a pack
// (kda/chunk_varlen_mma.cu's mtrl_kda_chunk_bwd_varlen; K = V = 128, bf16x3 records): ofs, ts
// [np + 1] (device) the pieces' first tokens and first tiles in the pack, the group's NT tiles
// from pack tile tb0; rec [H][NT] records, dD [H][16 NT][V], dSt [NT][H][K][V] and St (the tiles'
// incoming states) the group's, from its first tile; dout, q .. dbeta the pack's.
//   kda/chunk_mma_bwd.cu: the state-gradient pass, each piece from dS = 0 at its end, no dS0.
//   kda/chunk_simt.cu: pass 3 per tile (-1 when it does not fit in shared memory).
void kda3_state_bwd_varlen_launch(mtrl_cuda_ctx *c, int np, int NT, int tb0, int H, const int *ofs, const int *ts,
                                  const unsigned char *rec, const float *dout, float *dD, float *dSt);
int kda_tile_bwd_varlen_launch(mtrl_cuda_ctx *c, int np, int NT, int tb0, int H, const int *ofs, const int *ts,
                               const float *q, const float *k, const float *v, const float *g, const float *beta,
                               const float *St, const float *dout, const float *dD, const float *dSt, float *dq,
                               float *dk, float *dv, float *dg, float *dbeta);

#endif
