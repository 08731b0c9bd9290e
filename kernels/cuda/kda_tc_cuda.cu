// kda_tc_cuda.cu: KDA chunked forward v3, the tile products on tensor cores (mma.sync m16n8k16,
// bf16 operands, split in two by default (bf16x3, below), fp32 accumulation; the state, G, T and
// every accumulator stay fp32). mtrl_kda_chunk_fwd (kda_cuda.cu) dispatches here for K = V = 128
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
//      −W, Q⁺, K^e, U, P as bf16 and e^γ as fp32.
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
//      16-column k-step (the FA2 register trick, acc_to_a in attn_tc_cuda.cu). So the state is
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
// are shared through kda_tc.cuh with the backward's state-gradient pass (kda_tc_bwd_cuda.cu,
// kda_bwd = auto), which reads the bf16x3 record.
// The result does not depend on WPB (each warp's arithmetic is the same), so the variants are
// bit-identical (in either precision); kda_warps = 1|2|4|8 (kernel_opts.h) picks one (read at
// each call, for measuring), default 4.
// kda_cluster = 8 (the option, kernel_opts.h; opt-in) runs the state pass as
// kda3_state_cl_k instead: the 8 warps of a head in a thread-block cluster of 8 blocks of 1 warp,
// the K side of each tile record multicast once per cluster into every block's ring (see its
// comment); bit-identical to the default in either precision (tests/test_cuda_kda.cu checks it).
#include <math.h>
#include <stdlib.h>

#include "kernels/cuda/kda_tc.cuh"

namespace {

// ---- pass 1: the per-tile record ---------------------------------------------------------------

// KDA3_PREP_TILE_ (kda_tc.cuh) for tiles n_lo .. n_hi - 1 of the nt of one sequence, every head.
template <bool X>
__global__ void __launch_bounds__(128) kda3_prep_k(int T, int H, int nt, int n_lo, int n_hi,
                                                   const float *__restrict__ q,
                                                   const float *__restrict__ k,
                                                   const float *__restrict__ v,
                                                   const float *__restrict__ g,
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

// StCfg and KDA3_STATE_TILE_ (one ring stage, one tile of the pass): kda_tc.cuh, which the
// chunk-parallel forward (kda_cp_cuda.cu) shares.

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

#pragma unroll 1
    for (int n = n_lo; n < n_hi; n++) {
        cp_async_wait<NST3 - 2>();  // tile n's group has landed (this thread's copies)
        __syncthreads();            // everyone's copies visible; everyone is done with tile n - 1
        if (n + NST3 - 1 < n_hi) issue(n + NST3 - 1);  // into tile n - 1's stage
        cp_async_commit();
        const unsigned char *sb = sm3_ + (n % NST3) * Cf::STAGE;
        const uint16_t *sW = reinterpret_cast<const uint16_t *>(sb + Cf::SW),
                       *sQ = reinterpret_cast<const uint16_t *>(sb + Cf::SQ),
                       *sE = reinterpret_cast<const uint16_t *>(sb + Cf::SE),
                       *sP = reinterpret_cast<const uint16_t *>(sb + Cf::SP),
                       *sU = reinterpret_cast<const uint16_t *>(sb + Cf::SU);
        const float *sEG = reinterpret_cast<const float *>(sb + Cf::SEG);
        KDA3_STATE_TILE_();
    }
    cp_async_wait<0>();
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

// ---- pass 2, cluster form (opt-in: kda_cluster = 8) -------------------------------------------
//
// kda3_state_cl_k<CL, WO, X>: the state pass with the CL blocks of one head in a thread-block
// cluster (sm_90, __cluster_dims__(CL, 1, 1), grid (CL, H)), WPB = 8 / CL warps per block, so the
// V / 16 = 8 warps of a head are spread over CL SMs instead of V / (16 WPB) independent blocks
// that each load the whole K-side record. CL = 8 (the default of the switch): 8 blocks of 1 warp
// per head, 128 blocks at H = 16 instead of kda3_state_k's 32 blocks of 4 warps.
//
// Design: the K-side part of each tile record (−W, Q⁺, K^e with their lo planes, P, e^γ: 26,112 B
// of the 34,304 with bf16x3, 13,312 of 17,408 without) is read from global memory once per
// cluster with the Hopper bulk-copy engine, cp.async.bulk ... .multicast::cluster: one copy
// lands at the same offset in the shared memory of all CL blocks and signals each block's own
// mbarrier (complete_tx). The copies of a tile are split over the cluster (piece i of the tile's
// 3 NP 16 rows of 256 B (−W, Q⁺, K^e, padded to LD3 in the stage), NP 16 rows of 32 B (P, padded
// to LDP3) and one 512 B piece (e^γ) is issued by rank i mod CL, one piece per thread), so every
// block gets a full local copy of the K side in exactly kda3_state_k's stage layout (StCfg<WPB,
// X>), and its own U columns come in through a plain (not multicast) bulk copy per row. Why
// multicast into every block rather than one slice per block read by the peers through DSMEM:
// the B operands are read with ldmatrix, which takes only the CTA's own shared memory (DSMEM is
// reachable by ld/st.shared::cluster only: 4-byte scalar fragment loads at remote latency on the
// critical chain of a latency-bound pass); with a local copy each warp runs kda3_state_k's
// arithmetic verbatim (the body below is a copy: same products, same order), so the results are
// bit-identical to the default (either precision, any WPB) and the L2 → SM traffic of the K side
// is once per cluster, as at WPB = 8, not once per block (WPB = 1's 4x). PTX notes that
// .multicast::cluster "is optimized for sm_90a" and may be slower on other targets; this project
// builds sm_90 (CMAKE_CUDA_ARCHITECTURES 90), so kernels/CMakeLists.txt passes ptxas
// --suppress-async-bulk-multicast-advisory-warning for this file (ptxas's advisory is about the
// compute_90 PTX JIT-compiled for future architectures, not the sm_90 SASS an H200 runs). Measure
// it first (bench ops --only kda prints the ratio); if the multicast is the cost, build for 90a.
//
// Synchronisation (ring of NST3 = 6 stages, 5 tiles in flight, as kda3_state_k):
//   * full[s] (one mbarrier per stage and block, count 1): for each tile m put in stage s, the
//     block's thread 0 arrives with expect_tx(all bytes the block receives for the tile: the K
//     side from every rank's multicasts plus its own U rows), and every copy landing in this
//     block's stage completes its bytes there. Peers' bytes may land before the expect_tx (the
//     tx-count may go negative; the phase cannot complete before thread 0's arrival). Consumers
//     wait on the phase parity (m / NST3) & 1 (all threads: no block barrier is needed).
//   * stage reuse (the WAR between a peer still reading stage s and my multicast overwriting
//     it): tile n + 5 goes into the stage of tile n − 1, in every block of the cluster. Each
//     thread arrives on the cluster barrier (barrier.cluster.arrive.release) at the end of tile
//     n − 1, after its last read of that stage (the ldmatrix of K^e and the e^γ loads, volatile
//     asm / memory clobber keep them before the arrive), and waits on it
//     (barrier.cluster.wait.acquire) in tile n, after the Δ and O products and just before it
//     issues tile n + 5: no block can write into any block's stage (n − 1) % 6 before all
//     threads of the cluster finished reading it. The wait sits half a tile after the arrive,
//     so the barrier's latency hides behind the Δ products unless the blocks drift apart. It is
//     skipped (arrive and wait both) where there is nothing to issue (the last 5 tiles). The
//     mbarrier phase can't be confused: a block's full[s] for tile m + 6 receives bytes only
//     after that cluster barrier, i.e. after the block itself completed tile m's phase and read it.
//   * start: thread 0 initialises the mbarriers, fence.mbarrier_init.release.cluster, then a
//     full cluster barrier before any copy is issued (a peer's multicast signals my mbarriers).
//     End: a full cluster barrier before exit, so no block leaves while a copy it issued may
//     still be landing in a peer, or a peer's copy in it (every block waits for all its tiles).
//
// Shared memory per block: NST3 x StCfg<WPB, X>::STAGE + 6 mbarriers: bf16x3 178,224 /
// 184,368 / 196,656 B at CL = 8 / 4 / 2 (WPB = 1 / 2 / 4); bf16 (X = false) 6 x 15,104 + 48 =
// 90,672 at CL = 8; one block per SM either way, the 8 blocks of a cluster on 8 SMs of one GPC
// (an H200 GPC has 16–18 SMs, so 2 clusters of 8 per GPC: 16 heads at once; the launch reports
// an error if a cluster cannot be placed).
// Registers (ptxas, sm_90, nvcc 13.0, -Xptxas -v; no spills, 0-byte stack): bf16x3 with O 238 at
// CL = 8 / 4 / 2, without O 213 / 211 / 211; bf16 with O 211 / 211 / 213, without O 227 (all
// three); against kda3_state_k's 252 / 254 / 254 / 245 (bf16x3 with O, WPB = 1 / 2 / 4 / 8), which
// this change leaves as they were. One warp per block, so registers do not limit anything.
// Expected cost per tile (not measured: the first GPU run is the next session's): each warp runs
// kda3_state_k's chain (bf16x3 with O: 150 mma, 50 ldmatrix.x4, the A-operand packing), which is
// what bounds the default (Nsight Compute, bf16 v3 at T = 64K: 4.87 ms / 4,096 tiles = 1.19 µs per tile; one warp per
// scheduler, an instruction every 3.7 cycles). Moving the 4 warps of a default block onto 4 SMs
// does not shorten that chain; what it removes from it, per warp and tile: the default's ~12.5
// 16-byte cp.async per thread (1,600 per tile over 128 threads) and their address arithmetic
// (here ~1 bulk copy and ~1 U row per thread), the block barrier, and 3 of the 4 warps' share of
// one SM's shared-memory pipe (4 x 25.6 KB of ldmatrix per tile at WPB = 4, plus the 34 KB the
// cp.async write: roughly 40% of the SM's 128 B/clk at 1.19 µs; here a quarter of that). What it
// adds: one cluster barrier per tile (arrive at the end of tile n − 1, wait half a tile later:
// hidden unless the 8 blocks drift apart by more than that) and the multicast copies' latency
// (5 tiles ahead, as before). Estimate: 0.75–1.0x the default's state-pass time (the chain's
// share of memory-pipe stalls is what the profile should confirm); at H = 16 the 16 clusters of 8
// need 2 per GPC (an H200 GPC has 16–18 SMs usable; the launch fails with an error, not a wrong
// result, if a cluster cannot be placed, and it queues when H x 8 exceeds the resident clusters).
template <int CL, bool X>
struct ClCfg {
    static constexpr int WPB = 8 / CL, NP = Rec<X>::NP;
    using St = StCfg<WPB, X>;
    static constexpr int NROW = 3 * NP * C3,       // −W, Q⁺, K^e rows of 256 B
        NPR = NP * C3,                              // P rows of 32 B
        NPC = NROW + NPR + 1,                       // + e^γ (512 B): multicast pieces per tile
        KBYTES = NROW * K3 * 2 + NPR * C3 * 2 + K3 * 4,  // K side received per tile
        UROW = 16 * WPB * 2,                        // bytes of one of the block's U rows
        TX = KBYTES + NP * C3 * UROW;               // bytes a block receives per tile
    static constexpr int BAR = NST3 * St::STAGE;    // mbarriers after the ring
    static constexpr size_t smem() { return (size_t)BAR + NST3 * 8; }
    static_assert(BAR % 16 == 0 && UROW % 16 == 0 && TX < (1 << 20), "bulk copy sizes");
    static_assert(smem() <= 232448, "the sm_90 opt-in shared memory per block");
    static_assert((CL == 2 || CL == 4 || CL == 8) && 8 % CL == 0, "cluster sizes");
};

__device__ __forceinline__ uint32_t smem_u32_(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
// Bulk copy global -> the same shared offset in every block of `mask`, completing bytes on the
// mbarrier at the same offset in each.
__device__ __forceinline__ void bulk_mc_(uint32_t dst, const void *src, unsigned bytes, uint32_t bar,
                                         uint16_t mask) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
        "[%0], [%1], %2, [%3], %4;\n" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar), "h"(mask)
        : "memory");
}
// Bulk copy global -> this block's shared memory.
__device__ __forceinline__ void bulk_(uint32_t dst, const void *src, unsigned bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

template <int CL, bool WO, bool X>
__global__ void __cluster_dims__(CL, 1, 1) __launch_bounds__(32 * (8 / CL), 1)
    kda3_state_cl_k(int T, int H, int nt, const unsigned char *__restrict__ rec,
                    const float *S0, float *__restrict__ o, float *S_final,
                    float *__restrict__ S_tiles) {
    using Cc = ClCfg<CL, X>;
    constexpr int WPB = Cc::WPB;
    using Cf = StCfg<WPB, X>;
    using Rc = Rec<X>;
    constexpr int NTH = 32 * WPB, LDU = Cf::LDU, NB = K3 / 8;
    constexpr int LO3 = Cf::LO3 / 2, LOP = Cf::LOP / 2, LOU = Cf::LOU / 2;  // lo parts (elements)
    extern __shared__ __align__(16) unsigned char sm3_[];
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, gq = lane >> 2, tq = lane & 3;
    const int h = blockIdx.y, jb = blockIdx.x * 16 * WPB;  // the block's first value column
    const int jw = 16 * w, j0 = jb + jw;                     // the warp's, in the block / global
    const int rank = (int)cluster_rank();
    const uint32_t bar0 = smem_u32_(sm3_ + Cc::BAR);

    if (tid == 0) {
        for (int s = 0; s < NST3; s++) mbar_init(bar0 + 8 * s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    cluster_arrive();  // every block's mbarriers initialised before any copy signals them
    cluster_wait();

    // Tile m into stage m % NST3 of every block: this block's share of the multicast pieces, its
    // own U rows, and its own expect_tx.
    auto issue = [&](int m) {
        const unsigned char *R = rec + ((size_t)h * nt + m) * Rc::BYTES;
        const int s = m % NST3;
        const uint32_t st = smem_u32_(sm3_ + s * Cf::STAGE), bar = bar0 + 8 * s;
        if (tid == 0) mbar_expect_tx(bar, Cc::TX);
        for (int i = rank + CL * tid; i < Cc::NPC; i += CL * NTH) {
            if (i < Cc::NROW)  // row i of [3 NP][16][K]
                bulk_mc_(st + i * LD3 * 2, R + i * K3 * 2, K3 * 2, bar, (uint16_t)((1u << CL) - 1));
            else if (i < Cc::NROW + Cc::NPR)  // P (then its lo part) row i − NROW
                bulk_mc_(st + Cf::SP + (i - Cc::NROW) * LDP3 * 2, R + Rc::P + (i - Cc::NROW) * C3 * 2, C3 * 2,
                         bar, (uint16_t)((1u << CL) - 1));
            else
                bulk_mc_(st + Cf::SEG, R + Rc::EG, K3 * 4, bar, (uint16_t)((1u << CL) - 1));
        }
        for (int r = tid; r < Cf::NP * C3; r += NTH)  // r = part * 16 + row
            bulk_(st + Cf::SU + r * LDU * 2, R + Rc::U + (r * V3 + jb) * 2, Cc::UROW, bar);
    };
#pragma unroll 1
    for (int s = 0; s < NST3 - 1 && s < nt; s++) issue(s);

    float st[NB][4];  // Sᵀ in the accumulator layout (KDA3_STATE_LOAD_)
    KDA3_STATE_LOAD_(st, S0, h, j0, gq, tq);

#pragma unroll 1
    for (int n = 0; n < nt; n++) {
        mbar_wait(bar0 + 8 * (n % NST3), (unsigned)(n / NST3) & 1u);  // tile n has landed here
        const bool refill = n + NST3 - 1 < nt;  // tile n + 5 goes into tile n − 1's stage
        const unsigned char *sb = sm3_ + (n % NST3) * Cf::STAGE;
        const uint16_t *sW = reinterpret_cast<const uint16_t *>(sb + Cf::SW),
                       *sQ = reinterpret_cast<const uint16_t *>(sb + Cf::SQ),
                       *sE = reinterpret_cast<const uint16_t *>(sb + Cf::SE),
                       *sP = reinterpret_cast<const uint16_t *>(sb + Cf::SP),
                       *sU = reinterpret_cast<const uint16_t *>(sb + Cf::SU);
        const float *sEG = reinterpret_cast<const float *>(sb + Cf::SEG);

        // kda3_state_k's tile, with the refill between its Δ / Q⁺S products and the rest: every
        // thread of the cluster is done with tile n − 1's stage (its arrive at the end of tile
        // n − 1), then tile n + 5 into it
        KDA3_STATE_TILE_(if (refill) {
            if (n > 0) cluster_wait();
            issue(n + NST3 - 1);
        });
        // done reading this stage; the wait that pairs with this arrive is in tile n + 1, which
        // refills this stage iff n + 1 + 5 < nt
        if (n + NST3 < nt) cluster_arrive();
    }
    if (S_final) KDA3_STATE_STORE_(S_final, st, h, j0, gq, tq);
    cluster_arrive();  // no block exits while a copy it issued, or one into it, may be in flight
    cluster_wait();
}

template <int CL, bool WO, bool X>
void launch_state3_cl_(mtrl_cuda_ctx *c, int T, int H, int nt, const unsigned char *rec,
                       const float *S0, float *o, float *S_final, float *S_tiles) {
    const size_t sh = ClCfg<CL, X>::smem();
    set_smem(kda3_state_cl_k<CL, WO, X>, sh);
    kda3_state_cl_k<CL, WO, X><<<dim3(CL, H), 32 * (8 / CL), sh, c->stream>>>(T, H, nt, rec, S0, o, S_final,
                                                                             S_tiles);
    CUDA_LAUNCH_CHECK();
}
template <int CL, bool X>
void launch_state3_cl_wo_(mtrl_cuda_ctx *c, int T, int H, int nt, const unsigned char *rec,
                          const float *S0, float *o, float *S_final, float *S_tiles) {
    if (o) launch_state3_cl_<CL, true, X>(c, T, H, nt, rec, S0, o, S_final, S_tiles);
    else launch_state3_cl_<CL, false, X>(c, T, H, nt, rec, S0, o, S_final, S_tiles);
}
// How many clusters of the with-O kernel the device holds at once (cudaOccupancyMaxActiveClusters;
// -1 if the query fails): H of them run concurrently only if this is >= H.
template <int CL, bool X>
int cl_max_active_() {
    const size_t sh = ClCfg<CL, X>::smem();
    set_smem(kda3_state_cl_k<CL, true, X>, sh);
    cudaLaunchAttribute a = {};
    a.id = cudaLaunchAttributeClusterDimension;
    a.val.clusterDim.x = CL;
    a.val.clusterDim.y = 1;
    a.val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(CL, 1, 1);
    cfg.blockDim = dim3(32 * (8 / CL), 1, 1);
    cfg.dynamicSmemBytes = sh;
    cfg.attrs = &a;
    cfg.numAttrs = 1;
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, kda3_state_cl_k<CL, true, X>, &cfg) != cudaSuccess) {
        (void)cudaGetLastError();
        return -1;
    }
    return n;
}
int kda3_last_cluster_ = 0;  // the cluster size of the last state pass launched (0: kda3_state_k)
// The option kda_cluster: 8 (or 1): the cluster state pass with 8 blocks of 1 warp per head;
// 4 / 2: clusters of 4 blocks of 2 warps / 2 blocks of 4 warps (for measuring); anything else:
// 0, kda3_state_k (the default).
inline int opt_cluster_(const mtrl_cuda_ctx *c) {
    const int n = c->opts.kda_cluster;
    return n == 1 || n == 8 ? 8 : n == 4 || n == 2 ? n : 0;
}

// The prep (one record per head and tile into rec) over tiles n_lo .. n_hi - 1 on `stream`, and
// the state pass over the records of tiles n_lo .. n_hi - 1 (S0: the state entering tile n_lo,
// S_final: the one leaving tile n_hi - 1), at one precision (X: bf16x3). The cluster form takes
// whole sequences only (n_lo = 0, n_hi = nt).
template <bool X>
void kda3_prep_(mtrl_cuda_ctx *c, cudaStream_t stream, int T, int H, int n_lo, int n_hi, const float *q,
                const float *k, const float *v, const float *g, const float *beta, unsigned char *rec) {
    const int nt = (T + C3 - 1) / C3;
    const size_t shp = 4 * (size_t)PrepCfg<X>::WARP_BYTES;
    set_smem(kda3_prep_k<X>, shp);
    kda3_prep_k<X><<<dim3((n_hi - n_lo + 3) / 4, H), 128, shp, stream>>>(T, H, nt, n_lo, n_hi, q, k, v, g,
                                                                        beta, rec);
    CUDA_LAUNCH_CHECK();
}
template <bool X>
void kda3_state_(mtrl_cuda_ctx *c, int T, int H, int n_lo, int n_hi, const unsigned char *rec, const float *S0,
                 float *o, float *S_final, float *S_tiles) {
    const int nt = (T + C3 - 1) / C3;
    kda3_last_cluster_ = n_lo == 0 && n_hi == nt ? opt_cluster_(c) : 0;
    switch (kda3_last_cluster_) {  // opt-in: kda_cluster (then kda_warps is not read)
    case 8: launch_state3_cl_wo_<8, X>(c, T, H, nt, rec, S0, o, S_final, S_tiles); return;
    case 4: launch_state3_cl_wo_<4, X>(c, T, H, nt, rec, S0, o, S_final, S_tiles); return;
    case 2: launch_state3_cl_wo_<2, X>(c, T, H, nt, rec, S0, o, S_final, S_tiles); return;
    default: break;
    }
    switch (opt_wpb_(c)) {
    case 1: launch_state3_wo_<1, X>(c, T, H, nt, n_lo, n_hi, rec, S0, o, S_final, S_tiles); break;
    case 2: launch_state3_wo_<2, X>(c, T, H, nt, n_lo, n_hi, rec, S0, o, S_final, S_tiles); break;
    case 8: launch_state3_wo_<8, X>(c, T, H, nt, n_lo, n_hi, rec, S0, o, S_final, S_tiles); break;
    default: launch_state3_wo_<4, X>(c, T, H, nt, n_lo, n_hi, rec, S0, o, S_final, S_tiles); break;
    }
}

int kda3_aligned16_(const void *p) { return ((uintptr_t)p & 15u) == 0; }

}  // namespace

// Whether v3 takes this call (kda_cuda.cu applies the kda_fwd option).
int kda3_supports(int H, int K, int V, const float *q, const float *k, const float *v,
                  const float *g) {
    return K == K3 && V == V3 && H > 0 && H <= 65535 && kda3_aligned16_(q) && kda3_aligned16_(k) &&
           kda3_aligned16_(v) && kda3_aligned16_(g);
}

// The cluster size of the last forward state pass launched (0: kda3_state_k), for the tests to see
// that kda_cluster took effect (the results are bit-identical by design).
int kda3_last_state_cluster() { return kda3_last_cluster_; }
// The cluster state pass's resident clusters (cl = 8, 4, 2; split: bf16x3), for bench ops.
int kda3_cluster_max_active(int cl, int split) {
    if (cl == 8) return split ? cl_max_active_<8, true>() : cl_max_active_<8, false>();
    if (cl == 4) return split ? cl_max_active_<4, true>() : cl_max_active_<4, false>();
    if (cl == 2) return split ? cl_max_active_<2, true>() : cl_max_active_<2, false>();
    return -1;
}

// bf16x3 operands (1, the default) or plain bf16 (0: MTRL_KDA3_SPLIT=0, read at each call); the
// chunk-parallel forward (kda_cp_cuda.cu) follows the same switch.
size_t kda3_rec_bytes(int split) { return split ? Rec<true>::BYTES : Rec<false>::BYTES; }
static void kda3_prep_range_(mtrl_cuda_ctx *c, cudaStream_t stream, int T, int H, int n_lo, int n_hi,
                             const float *q, const float *k, const float *v, const float *g,
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
// The option kda_fwd_pieces = N forces N (1: one piece), for the benchmarks and tests; the
// cluster form (kda_cluster) runs one piece.
static int kda3_fwd_pieces_(const mtrl_cuda_ctx *c, int H, int nt) {
    if (opt_cluster_(c)) return 1;
    return opt_count(c->opts.kda_fwd_pieces, 8 * H <= c->sms ? nt / 128 : 1, 1, nt < 8 ? nt : 8);
}

void kda3_prep_launch(mtrl_cuda_ctx *c, int T, int H, const float *q, const float *k, const float *v,
                      const float *g, const float *beta, unsigned char *rec, int split) {
    kda3_prep_range_(c, c->stream, T, H, 0, (T + C3 - 1) / C3, q, k, v, g, beta, rec, split);
}
void kda3_state_fwd_launch(mtrl_cuda_ctx *c, int T, int H, const unsigned char *rec, const float *S0,
                           float *o, float *S_final, float *S_tiles, int split) {
    kda3_state_range_(c, T, H, 0, (T + C3 - 1) / C3, rec, S0, o, S_final, S_tiles, split);
}

// The v3 forward (T >= 1; shapes checked by kda3_supports); bf16x3 unless the option kda_plain_bf16. The
// records live at the start of the context's scratch, then (pieces > 1) the state between pieces
// [H][K][V]: each warp reads its columns of it first and writes them last, so one buffer serves
// every boundary, and the pieces give the same bits as one.
int kda3_chunk_fwd(mtrl_cuda_ctx *c, int T, int H, const float *q, const float *k,
                   const float *v, const float *g, const float *beta, const float *S0, float *o,
                   float *S_final, float *S_tiles) {
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
