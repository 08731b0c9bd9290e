// kda/chunk_mma.cu: KDA chunked forward v3, the tile products on tensor cores (mma.sync m16n8k16,
// bf16 operands, split in two by default (bf16x3, below), fp32 accumulation; the state, G, T and
// every accumulator stay fp32). mtrl_kda_chunk_fwd (kda/chunk_simt.cu) dispatches here for K = V = 128
// (the default; kda_fwd = simt (kernel_opts.h) forces v2).
//
// The algebra is v2's and the reference's, tile for tile (model.md §2.3: 16-token tiles, the
// midpoint reference row m = min(8, c-1) for the diagonal products, padded rows k = q = v = 0,
// β = 0, g = 0). Two launches:
//
//   1. kda3_prep_k, grid (ceil(tiles/4), H), 4 warps, one warp per (tile, head), no block
//      barriers. Lane l owns the columns 4l..4l+3 (K = V = 128 = 32 x 4) of all 16 rows:
//      G = cumsum(g) in fp32 (in registers), the scaled operands (ex2.approx, exponents within
//      ±40 on the diagonal products and <= 0 elsewhere, §2.5), then on tensor cores
//      X = K̂⁺K̂⁻ᵀ and P = Q̂⁺K̂⁻ᵀ (16 x 16, k = 128), M = StrictTril(diag(β) X) and
//      T = (I + M)^-1 by fp32 forward substitution (16 lanes, as v2), then W = T (β K⁺) and
//      U = T (β V) (16 x 128, k = 16; T rounded to bf16 for this product, as fla does).
//      It writes one record per (head, tile) to scratch, 17 KB for K = V = 128 (Rec below):
//      −W, Q⁺, K^e, U, P as bf16 and e^γ as fp32. q, k, v, g are read as fp32 or, for
//      mtrl_kda_chunk_fwd_bf16 / _cp_bf16, as bf16 (TI; widened exactly as loaded, the same arithmetic
//      after, so the same records from the same values; the fp32 instance compiles to the machine
//      code it had before the template, tools/cubin_compare.py with the renamed kernel matched).
//   2. kda3_state_k<WPB, WO>, grid (V / (16 WPB), H), WPB warps: the sequential pass. Warp w owns
//      16 value columns j0..j0+15 of one head and holds the transposed state Sᵀ (16 x K, fp32) as
//      mma accumulators: st[nd][0..3] = Sᵀ(j0+g, 8nd+2t), Sᵀ(j0+g, 8nd+2t+1), Sᵀ(j0+g+8, 8nd+2t),
//      Sᵀ(j0+g+8, 8nd+2t+1) (g = lane/4, t = lane%4), 64 registers at K = 128. The warp owns all K
//      rows of its columns, so nothing is reduced across warps. Per tile (transposed §2.3):
//        Δᵀ  = Uᵀ + Sᵀ (−W)ᵀ                  16 x 16, k = K   (A = Sᵀ, B = −W from smem)
//        Oᵀ  = Sᵀ Q⁺ᵀ + Δᵀ Pᵀ                 16 x 16          (A = Sᵀ, then A = Δᵀ)
//        S'ᵀ = Sᵀ diag(e^γ) + Δᵀ K^e           16 x K, k = 16   (A = Δᵀ, B = K^e)
//      Sᵀ and Δᵀ enter the next products as A operands straight from their accumulators: the
//      C layout of two adjacent 8-column n-tiles, packed to bf16 pairs, is the A layout of one
//      16-column k-step (the FA2 register trick, acc_to_a in attn/causal_mma.cu). So the state is
//      rounded to bf16 only as an operand (as fla's chunk_gated_delta_rule_fwd_h does) and is
//      accumulated in fp32. The block's warps share one ring of NST = 6 shared-memory stages
//      (one tile record each, the block's U columns only; cp.async, 5 tiles in flight), one
//      block barrier per tile. WO = false skips O (o == NULL).
//
// Accuracy: bf16 operands (8 significant bits) against the fp64 reference, ‖out − ref‖/‖ref‖
// about 2e-3 (o, S_final, S_tiles; tests/test_cuda_kda.cu checks 1e-2, the project's bf16
// tolerance). tf32 (m16n8k8) would halve the error's exponent but has half the mma rate and no
// ldmatrix / accumulator-to-operand reuse, and fla, the anchor, is bf16.
// bf16x3 (the default; kda_records = bf16 (the option, kernel_opts.h) turns it off): every
// product — X, P, W, U in the prep, Δ, O and S' in the state pass — takes split-bf16 operands,
// a = a_hi + a_lo with a_hi = bf16(a), a_lo = bf16(a − a_hi) (~16 significant bits), as
// a_lo b_hi + a_hi b_lo + a_hi b_hi into the same fp32 accumulator (a_lo b_lo dropped), and the
// record carries the lo part of −W, Q⁺, K^e, U, P. Why all of them: tests/test_kda_v3_emu.c
// emulates the roundings against an fp64 recurrence (worst of o, S_final, S_tiles): bf16 3.7e-3,
// splitting every group 6.9e-6 (fp32's own forward 4.0e-7), splitting only the state pass, only
// the prep, or any two of {X and P, W and U, state pass} 1.7e-3–3.4e-3. At the model level (the
// `reduced small` case the GPU tests failed) the split brings decode vs prefill from 0.116 to
// 4.7e-4 of max |logit| and segmented vs whole gradients (worst tensor) from 0.112 to 2.1e-4, with
// no routing flips (bf16: 22). test_cuda_kda checks it at 1e-4. Cost (predicted, not measured):
// 3x the mma (150 instead of 50 per tile and warp in the state pass), twice the B-fragment loads,
// the record 34,304 B instead of 17,408 (9.2 GB of scratch at T = 256K, H = 16), the state pass's
// shared memory 196,608 B at WPB = 4 (one block per SM, as before), the prep's 182,784 B (one
// block of 4 warps per SM instead of two). ptxas (sm_90, nvcc 13): state pass with O 252 / 254 /
// 254 / 245 registers at WPB = 1 / 2 / 4 / 8, without O 223 / 223 / 223 / 219, prep 147; no
// spills. The state pass is latency-bound (1.44 µs per tile measured for bf16) and the three mma
// of a product accumulate into one register set, so its dependent chains triple: expect it 2–3x
// slower, v3 bf16x3 ≈ 0.8–1.2x v2's time. Measured, it came out faster than v2 and within
// test_cuda_kda's 1e-4 of fp64; Nsight Compute shows the state pass latency-bound (2H blocks of
// 4 warps, one warp per scheduler) and the prep near the DRAM rate (docs/perf.md), which is why
// the prep of later pieces runs beside the state pass (kda3_fwd_pieces_ below).
// The bf16 path compiles to the PTX it had before this mode (state pass identical; prep the same
// instructions, a few address computations reordered), so its results are unchanged.
// The record layout, the split helpers and the launchers kda3_prep_launch / kda3_state_fwd_launch
// are shared through kda/chunk_mma.cuh with the backward's state-gradient pass (kda/chunk_mma_bwd.cu,
// kda_bwd = auto), which reads the bf16x3 record.
// The result does not depend on WPB (each warp's arithmetic is the same); the launch takes 4, the
// fastest measured (docs/kernel-lab.md: 1, 2, 8 and the thread-block-cluster form measured slower
// and left the tree).
#include <math.h>
#include <stdlib.h>

#include "kernels/cuda/kda/chunk_mma.cuh"

namespace {

// ---- pass 1: the per-tile record ---------------------------------------------------------------

// KDA3_PREP_TILE_ (chunk_mma.cuh) for tiles n_lo .. n_hi - 1 of the nt of one sequence, every head;
// q, k, v, g of type TI: float, or mtrl_bf16 (widened to fp32 as loaded, the arithmetic unchanged).
template <bool X, typename TI>
__global__ void __launch_bounds__(128) kda3_prep_k(int T, int H, int nt, int n_lo, int n_hi,
                                                   const TI *__restrict__ q,
                                                   const TI *__restrict__ k,
                                                   const TI *__restrict__ v,
                                                   const TI *__restrict__ g,
                                                   const float *__restrict__ beta,
                                                   unsigned char *__restrict__ rec) {
    using Rc = Rec<X>;
    constexpr int LO = PrepCfg<X>::LO;  // lo planes in shared memory (elements)
    extern __shared__ __align__(16) unsigned char sm3_[];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int n = n_lo + blockIdx.x * 4 + w, h = blockIdx.y;  // tiles n_lo .. n_hi - 1 of nt
    if (n >= n_hi) return;  // no block barriers in this kernel
    KDA3_PREP_TILE_(n);
}

// ---- pass 2: the sequential state pass ----------------------------------------------------------

// StCfg and KDA3_STATE_TILE_ (one ring stage, one tile of the pass): kda/chunk_mma.cuh, which the
// chunk-parallel forward (kda/chunk_parallel.cu) shares.

template <int WPB, bool WO, bool X>
__global__ void __launch_bounds__(32 * WPB, 1)
    kda3_state_k(int T, int H, int nt, int n_lo, int n_hi, const unsigned char *__restrict__ rec,
                 const float *S0, float *__restrict__ o, float *S_final,
                 float *__restrict__ S_tiles) {
    using Cf = StCfg<WPB, X>;
    using Rc = Rec<X>;
    constexpr int NTH = 32 * WPB, LDU = Cf::LDU, NB = K3 / 8;
    constexpr int LO3 = Cf::LO3 / 2, LOP = Cf::LOP / 2, LOU = Cf::LOU / 2;  // lo parts (elements)
    extern __shared__ __align__(16) unsigned char sm3_[];
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, gq = lane >> 2, tq = lane & 3;
    const int h = blockIdx.y, jb = blockIdx.x * 16 * WPB;  // the block's first value column
    const int jw = 16 * w, j0 = jb + jw;                     // the warp's, in the block / global

    auto issue = [&](int n) {
        const unsigned char *R = rec + ((size_t)h * nt + n) * Rc::BYTES;
        unsigned char *st = sm3_ + (n % NST3) * Cf::STAGE;
        KDA3_STAGE_KSIDE_(st, R, Cf::SP, Cf::SEG, tid, NTH, Cf::NP);
        // U: the block's columns, the lo part's rows after the hi part's (in the record and here)
        for (int i = tid; i < Cf::NP * C3 * 2 * WPB; i += NTH) {
            const int r = i / (2 * WPB), c = i % (2 * WPB);  // r = part * 16 + row
            cp_async16(st + Cf::SU + r * LDU * 2 + c * 16, R + Rc::U + (r * V3 + jb) * 2 + c * 16);
        }
    };
#pragma unroll 1
    for (int s = 0; s < NST3 - 1; s++) {
        if (n_lo + s < n_hi) issue(n_lo + s);
        cp_async_commit();  // empty groups keep the count uniform
    }

    float st[NB][4];  // Sᵀ in the accumulator layout (KDA3_STATE_LOAD_)
    KDA3_STATE_LOAD_(st, S0, h, j0, gq, tq);

    KDA3_STATE_TILES_(NST3, n_lo, n_hi);
    if (S_final) KDA3_STATE_STORE_(S_final, st, h, j0, gq, tq);
}


template <int WPB, bool WO, bool X>
void launch_state3_(mtrl_cuda_ctx *c, int T, int H, int nt, int n_lo, int n_hi, const unsigned char *rec,
                    const float *S0, float *o, float *S_final, float *S_tiles) {
    const size_t sh = StCfg<WPB, X>::smem();
    set_smem(kda3_state_k<WPB, WO, X>, sh);
    kda3_state_k<WPB, WO, X><<<dim3(V3 / (16 * WPB), H), 32 * WPB, sh, c->stream>>>(T, H, nt, n_lo, n_hi, rec,
                                                                                  S0, o, S_final, S_tiles);
    CUDA_LAUNCH_CHECK();
}
template <int WPB, bool X>
void launch_state3_wo_(mtrl_cuda_ctx *c, int T, int H, int nt, int n_lo, int n_hi, const unsigned char *rec,
                       const float *S0, float *o, float *S_final, float *S_tiles) {
    if (o) launch_state3_<WPB, true, X>(c, T, H, nt, n_lo, n_hi, rec, S0, o, S_final, S_tiles);
    else launch_state3_<WPB, false, X>(c, T, H, nt, n_lo, n_hi, rec, S0, o, S_final, S_tiles);
}

// The prep (one record per head and tile into rec) over tiles n_lo .. n_hi - 1 on `stream`, and
// the state pass over the records of tiles n_lo .. n_hi - 1 (S0: the state entering tile n_lo,
// S_final: the one leaving tile n_hi - 1), at one precision (X: bf16x3).
template <bool X, typename TI>
void kda3_prep_(mtrl_cuda_ctx *c, cudaStream_t stream, int T, int H, int n_lo, int n_hi, const TI *q,
                const TI *k, const TI *v, const TI *g, const float *beta, unsigned char *rec) {
    const int nt = (T + C3 - 1) / C3;
    const size_t shp = 4 * (size_t)PrepCfg<X>::WARP_BYTES;
    set_smem(kda3_prep_k<X, TI>, shp);
    kda3_prep_k<X, TI><<<dim3((n_hi - n_lo + 3) / 4, H), 128, shp, stream>>>(T, H, nt, n_lo, n_hi, q, k, v, g,
                                                                            beta, rec);
    CUDA_LAUNCH_CHECK();
}
template <bool X>
void kda3_state_(mtrl_cuda_ctx *c, int T, int H, int n_lo, int n_hi, const unsigned char *rec, const float *S0,
                 float *o, float *S_final, float *S_tiles) {
    const int nt = (T + C3 - 1) / C3;
    launch_state3_wo_<4, X>(c, T, H, nt, n_lo, n_hi, rec, S0, o, S_final, S_tiles);  // 4 warps a block
}

int kda3_aligned16_(const void *p) { return ((uintptr_t)p & 15u) == 0; }

}  // namespace

// Whether v3 takes this call (kda/chunk_simt.cu applies the kda_fwd option); q, k, v, g fp32 or bf16.
int kda3_supports(int H, int K, int V, const void *q, const void *k, const void *v, const void *g) {
    return K == K3 && V == V3 && H > 0 && H <= 65535 && kda3_aligned16_(q) && kda3_aligned16_(k) &&
           kda3_aligned16_(v) && kda3_aligned16_(g);
}

// bf16x3 operands (1, the default) or plain bf16 (0: MTRL_KDA3_SPLIT=0, read at each call); the
// chunk-parallel forward (kda/chunk_parallel.cu) follows the same switch.
size_t kda3_rec_bytes(int split) { return split ? Rec<true>::BYTES : Rec<false>::BYTES; }
template <typename TI>
static void kda3_prep_range_(mtrl_cuda_ctx *c, cudaStream_t stream, int T, int H, int n_lo, int n_hi,
                             const TI *q, const TI *k, const TI *v, const TI *g,
                             const float *beta, unsigned char *rec, int split) {
    if (split) kda3_prep_<true>(c, stream, T, H, n_lo, n_hi, q, k, v, g, beta, rec);
    else kda3_prep_<false>(c, stream, T, H, n_lo, n_hi, q, k, v, g, beta, rec);
}
static void kda3_state_range_(mtrl_cuda_ctx *c, int T, int H, int n_lo, int n_hi, const unsigned char *rec,
                              const float *S0, float *o, float *S_final, float *S_tiles, int split) {
    if (split) kda3_state_<true>(c, T, H, n_lo, n_hi, rec, S0, o, S_final, S_tiles);
    else kda3_state_<false>(c, T, H, n_lo, n_hi, rec, S0, o, S_final, S_tiles);
}

// Pieces of the v3 forward: the state pass runs 2H blocks (K = V = 128, 4 warps each) over the
// tiles in sequence and leaves the other SMs idle; the prep of the next pieces runs there, on GEMM
// lane 1, ahead of it. The forward then takes about prep / pieces + state instead of prep + state
// (the prep is a large part of the forward at few heads). Taken while the state pass's 2H
// blocks hold at most a quarter of the SMs (H <= 16 on 132 SMs; measured at H = 8 and 16). Pieces
// of at least 128 tiles, at most 8: the counts that measured fastest (docs/perf.md).
// The option kda_fwd_pieces = N forces N (1: one piece), for the benchmarks and tests.
static int kda3_fwd_pieces_(const mtrl_cuda_ctx *c, int H, int nt) {
    return opt_count(c->opts.kda_fwd_pieces, 8 * H <= c->sms ? nt / 128 : 1, 1, nt < 8 ? nt : 8);
}

void kda3_prep_launch(mtrl_cuda_ctx *c, int T, int H, const float *q, const float *k, const float *v,
                      const float *g, const float *beta, unsigned char *rec, int split) {
    kda3_prep_range_(c, c->stream, T, H, 0, (T + C3 - 1) / C3, q, k, v, g, beta, rec, split);
}
void kda3_prep_launch(mtrl_cuda_ctx *c, int T, int H, const mtrl_bf16 *q, const mtrl_bf16 *k, const mtrl_bf16 *v,
                      const mtrl_bf16 *g, const float *beta, unsigned char *rec, int split) {
    kda3_prep_range_(c, c->stream, T, H, 0, (T + C3 - 1) / C3, q, k, v, g, beta, rec, split);
}
void kda3_state_fwd_launch(mtrl_cuda_ctx *c, int T, int H, const unsigned char *rec, const float *S0,
                           float *o, float *S_final, float *S_tiles, int split) {
    kda3_state_range_(c, T, H, 0, (T + C3 - 1) / C3, rec, S0, o, S_final, S_tiles, split);
}

// The v3 forward (T >= 1; shapes checked by kda3_supports); bf16x3 unless the option kda_plain_bf16. The
// records live at the start of the context's scratch, then (pieces > 1) the state between pieces
// [H][K][V]: each warp reads its columns of it first and writes them last, so one buffer serves
// every boundary, and the pieces give the same bits as one. q, k, v, g fp32 or bf16 (TI).
template <typename TI>
static int kda3_chunk_fwd_(mtrl_cuda_ctx *c, int T, int H, const TI *q, const TI *k, const TI *v, const TI *g,
                           const float *beta, const float *S0, float *o, float *S_final, float *S_tiles) {
    const int split = !c->opts.kda_plain_bf16, nt = (T + C3 - 1) / C3;
    const int np = kda3_fwd_pieces_(c, H, nt);
    ws_carver sz{nullptr, 0};
    sz.take<unsigned char>((size_t)H * nt * kda3_rec_bytes(split));
    if (np > 1) sz.take<float>((size_t)H * K3 * V3);
    ws_carver cv{(char *)mtrl_ctx_scratch(c, sz.off), 0};
    unsigned char *rec = cv.take<unsigned char>((size_t)H * nt * kda3_rec_bytes(split));
    if (np <= 1) {
        kda3_prep_range_(c, c->stream, T, H, 0, nt, q, k, v, g, beta, rec, split);
        kda3_state_range_(c, T, H, 0, nt, rec, S0, o, S_final, S_tiles, split);
        return 0;
    }
    float *smid = cv.take<float>((size_t)H * K3 * V3);
    auto bound = [&](int p) { return (int)((long)nt * p / np); };
    kda3_prep_range_(c, c->stream, T, H, 0, bound(1), q, k, v, g, beta, rec, split);
    mtrl_ctx_lanes_fork(c, 2);
    cudaStream_t side = mtrl_ctx_lane_stream(c, 1);
    for (int p = 0; p < np; p++) {
        if (p + 1 < np) kda3_prep_range_(c, side, T, H, bound(p + 1), bound(p + 2), q, k, v, g, beta, rec, split);
        kda3_state_range_(c, T, H, bound(p), bound(p + 1), rec, p == 0 ? S0 : smid, o,
                          p == np - 1 ? S_final : smid, S_tiles, split);
        if (p + 1 < np) mtrl_ctx_lanes_join(c, 2);  // the next state piece waits for its records
    }
    return 0;
}
int kda3_chunk_fwd(mtrl_cuda_ctx *c, int T, int H, const float *q, const float *k,
                   const float *v, const float *g, const float *beta, const float *S0, float *o,
                   float *S_final, float *S_tiles) {
    return kda3_chunk_fwd_(c, T, H, q, k, v, g, beta, S0, o, S_final, S_tiles);
}
int kda3_chunk_fwd(mtrl_cuda_ctx *c, int T, int H, const mtrl_bf16 *q, const mtrl_bf16 *k,
                   const mtrl_bf16 *v, const mtrl_bf16 *g, const float *beta, const float *S0, float *o,
                   float *S_final, float *S_tiles) {
    return kda3_chunk_fwd_(c, T, H, q, k, v, g, beta, S0, o, S_final, S_tiles);
}
