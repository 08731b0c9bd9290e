// kda/chunk_mma_bwd.cu: KDA chunked backward v3, the sequential state-gradient pass (pass 2 of
// mtrl_kda_chunk_bwd, kda/chunk_simt.cu's kda_state_bwd_k) on tensor cores: mma.sync m16n8k16 with
// split-bf16 operands (bf16x3: a = a_hi + a_lo, 3 mma per product, ~16 significant bits), fp32
// accumulation; dS, dΔ and every accumulator fp32. mtrl_kda_chunk_bwd (kda/chunk_simt.cu) takes this
// path for K = V = 128 (the default; kda_bwd = simt (the option, kernel_opts.h) runs v2's SIMT pass instead);
// passes 1 and 2 change as follows (pass 3, kda_tile_bwd_k, and its pieces beside pass 2: kda/chunk_simt.cu):
//
//   1. Operands: v3's per-tile record (kda/chunk_mma.cu's kda3_prep_k<bf16x3>, 34,304 B per head
//      and tile) instead of v2's fp32 prep buffers: it holds exactly what this pass reads — −W,
//      Q⁺, K^e and P as hi + lo bf16 planes and e^γ in fp32 — already split, laid out for
//      cp.async + ldmatrix, and its W, P carry the forward v3 bf16x3's own products (emulated
//      6.9e-6 of fp64). U, also in the record, is not read. The record's 34,304 B per head and
//      tile is exactly the scratch v2's prep buffers take (W, Q⁺, K^e, U, P, e^γ in fp32); pass 3
//      recomputes its own operands either way. When the caller passes no S_tiles, they are recomputed by the
//      v3 forward state pass (bf16x3) from the same record, not by v2.
//   2. kda3_state_bwd_k<WPB, X>, grid (V / (16 WPB), H), WPB warps (4, as for the forward), last
//      tile to first. Warp w owns 16 value columns
//      j0..j0+15 of one head and holds dSᵀ (16 x K, fp32: dS of the tile's OUTGOING state,
//      transposed, as the forward holds Sᵀ) as mma accumulators: st[nd][c] = dS(d, j) with
//      d = 8 nd + 2t + (c & 1), j = j0 + g + 8 (c >> 1) (g = lane/4, t = lane%4), 64 registers.
//      Per tile n (kda_state_bwd_k's algebra, transposed):
//        dS_tiles[n] = dS                                           (fp32 store)
//        dΔᵀ = dSᵀ K^eᵀ + dOᵀ P            16 x 16, k = K + 16 (A = dSᵀ, B = K^e n-major;
//                                                               A = dOᵀ, B = P k-major)
//        dD[n] = dΔ                                                 (fp32 store, all 16 rows)
//        dSᵀ ← dSᵀ diag(e^γ) + dOᵀ Q⁺ + dΔᵀ (−W)   16 x K, k = 16 + 16 (B = Q⁺, −W k-major)
//      dSᵀ and dΔᵀ enter the products as A operands straight from their accumulators (the C
//      layout of two adjacent n-tiles is the A layout of one k-step; acc_to_a_split), dOᵀ's A
//      fragments are built from fp32 dO in shared memory and split there. The record's −W is
//      the sign the update needs (− Wᵀ dΔ = (−W)ᵀ dΔ). Even and odd k-steps of dSᵀ K^eᵀ go to two
//      accumulators (chains of 4 instead of 8), as the forward's Δ. The block's warps share a ring
//      of NST3 = 6 shared-memory stages (one tile's −W, Q⁺, K^e, P with lo planes, e^γ, and the
//      block's 16 WPB columns of dO in fp32; cp.async, 5 tiles in flight), one barrier per tile.
//      Writes what kda_state_bwd_k writes, in its layouts: dD = dΔ [H][Tp][V] (padded rows
//      included; they are 0), dS_tiles [tiles][H][K][V] (tile n: the gradient of its outgoing
//      state) and dS0 [H][K][V] (optional); dS_final (optional) is read as [H][K][V].
//
// Stage (bytes, WPB = 4): −W, Q⁺, K^e hi then lo [6][16][LD3] bf16 26,112, P hi + lo
// [2][16][LDP3] bf16 1,536, e^γ [K] fp32 512, dO [16][LDO] fp32 with LDO = 16 WPB + 4 (the
// fragment reads of a warp, rows 2t + c and 8 consecutive columns, then hit 32 distinct banks:
// 2 LDO ≡ 8 mod 32) 4,352: 32,512 B; 6 stages 195,072 B (WPB = 1 / 2 / 8: 174,336 / 181,248 /
// 219,648 B), one block per SM as the forward's state pass.
// Registers (ptxas -v, sm_90, nvcc 13, bf16x3): 199 / 199 / 187 / 199 at WPB = 1 / 2 / 4 / 8,
// no spills, 0-byte stack frame.
// Precision: tests/test_kda_v3_bwd_emu.c emulates this pass's roundings (the emulated bf16x3 record,
// split operands, fp32 accumulation per mma, the tile order) against the same pass in fp64 on
// fp64 operands: worst of dD, dS_tiles, dS0 5.2e-6 relative (plain bf16 2.6e-3, fp32 operands
// 1.4e-7; checked there at 2e-5), and through an fp64 pass 3 the gradients dq, dk, dv, dg, dβ within
// 1.7e-5 (bf16 7.8e-3; checked at 5e-5); test_cuda_kda checks the whole backward with it at 1e-4 of
// fp64 (2e-4 at the decay's bound, as v2).
// Layout: tools/kda_v3/lanes_bwd.py transcribes this kernel's fragment index expressions (dSᵀ, dOᵀ,
// dΔᵀ as A operands; the K^e, P, Q⁺, −W fragment loads; the dD and dS stores) over a lane-level
// model of ldmatrix and mma and matches the step's matrix algebra at fp32 rounding (1e-7; a layout
// mistake gives O(1)).
// Cost (predicted): 150 mma per tile and warp (48 + 6 for dΔ, 96 for the update), as the forward
// bf16x3 state pass with O, the same ring and one block per SM; the SIMT pass it replaces was
// guessed at ~1/4 of the v2 backward's time. Measured, it saves little of the whole backward:
// pass 3 (per tile, in parallel) dominates, which is why its tensor-core form (kda_bwd_tile =
// auto) came next; both are the default, every gpu test passing with them (docs/perf.md).
// The pass's body is kda3_state_bwd_ (one block's columns over a range of a sequence's tiles):
// kda3_state_bwd_k runs it over one sequence, kda_vl_state_bwd_k over every piece of a pack on a
// grid with a pieces dimension (the varlen backward, kda/chunk_varlen_mma.cu), so both give the
// same bits per piece.
#include <math.h>
#include <stdlib.h>

#include "kernels/cuda/kda/chunk_mma.cuh"

namespace {

// One ring stage of the backward state pass (bytes), laid out as the forward's StCfg where they
// share a matrix: −W, Q⁺, K^e [16][LD3] bf16 (then their lo planes), P [16][LDP3] (then lo), e^γ,
// then dO (fp32, the block's 16 WPB columns).
template <int WPB, bool X>
struct StBwdCfg : StKside<X> {
    static constexpr int LDO = 16 * WPB + 4;
    static constexpr int SO = StKside<X>::KEND, STAGE = SO + C3 * LDO * 4;
    static constexpr size_t smem() { return (size_t)NST3 * STAGE; }
    static_assert(STAGE % 16 == 0 && (LDO * 4) % 16 == 0, "stage alignment");
    static_assert(NST3 * STAGE <= 232448, "the sm_90 opt-in shared memory per block");
};

// The pass for one block (value columns jb .. jb + 16 WPB − 1 of head h) over tiles [n_lo, n_hi)
// of a sequence of T tokens, last to first: dS_final is the gradient of the state leaving tile
// n_hi - 1, dS0 the one entering tile n_lo. The record of (h, n) is at rec + (h nrs + n)
// Rec<X>::BYTES, row r of tile n of dD [H][Tp][V] at dD + ((h Tp + 16 n + r) V): a whole sequence
// has nrs = nt, Tp = 16 nt; a piece of a pack (kda_vl_state_bwd_k) its group's, with rec and dD
// at the piece's first tile. kda3_state_bwd_k's body, a function so that the varlen pass runs the
// same code: both are inlined from here.
template <int WPB, bool X>
__device__ __forceinline__ void kda3_state_bwd_(int T, int H, int nrs, size_t Tp, int n_lo, int n_hi, int h, int jb,
                                                const unsigned char *__restrict__ rec,
                                                const float *__restrict__ dout, const float *dS_final,
                                                float *__restrict__ dD, float *__restrict__ dS_tiles, float *dS0) {
    using Cf = StBwdCfg<WPB, X>;
    using Rc = Rec<X>;
    constexpr int NTH = 32 * WPB, LDO = Cf::LDO, NB = K3 / 8;
    constexpr int LO3 = Cf::LO3 / 2, LOP = Cf::LOP / 2;  // lo parts (elements)
    extern __shared__ __align__(16) unsigned char sm3_[];
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, gq = lane >> 2, tq = lane & 3;
    const int jw = 16 * w, j0 = jb + jw;  // the warp's first value column, in the block / global

    // Step i (0 .. cnt-1) works on tile n_hi-1-i in stage i % NST3.
    const int cnt = n_hi - n_lo;
    auto issue = [&](int i) {
        const int n = n_hi - 1 - i;
        const unsigned char *R = rec + ((size_t)h * nrs + n) * Rc::BYTES;
        unsigned char *st = sm3_ + (i % NST3) * Cf::STAGE;
        KDA3_STAGE_KSIDE_(st, R, Cf::SP, Cf::SEG, tid, NTH, Cf::NP);
        // dO rows of the tile, the block's columns; rows past T as zeros
        for (int x = tid; x < C3 * 4 * WPB; x += NTH) {
            const int r = x / (4 * WPB), c = x % (4 * WPB), tok = n * C3 + r;
            const bool ok = tok < T;
            const float *src = ok ? dout + ((size_t)tok * H + h) * V3 + jb + 4 * c : dout;
            cp_async16_pred(st + Cf::SO + (r * LDO + 4 * c) * 4, src, ok);
        }
    };
#pragma unroll 1
    for (int s = 0; s < NST3 - 1; s++) {
        if (s < cnt) issue(s);
        cp_async_commit();  // empty groups keep the count uniform
    }

    // dSᵀ in the accumulator layout (as the forward's Sᵀ).
    float st[NB][4];
    KDA3_STATE_LOAD_(st, dS_final, h, j0, gq, tq);

#pragma unroll 1
    for (int i = 0; i < cnt; i++) {
        const int n = n_hi - 1 - i;
        cp_async_wait<NST3 - 2>();  // step i's group has landed (this thread's copies)
        __syncthreads();            // everyone's copies visible; everyone is done with step i - 1
        if (i + NST3 - 1 < cnt) issue(i + NST3 - 1);  // into step i - 1's stage
        cp_async_commit();
        const unsigned char *sb = sm3_ + (i % NST3) * Cf::STAGE;
        const uint16_t *sW = reinterpret_cast<const uint16_t *>(sb + Cf::SW),
                       *sQ = reinterpret_cast<const uint16_t *>(sb + Cf::SQ),
                       *sE = reinterpret_cast<const uint16_t *>(sb + Cf::SE),
                       *sP = reinterpret_cast<const uint16_t *>(sb + Cf::SP);
        const float *sEG = reinterpret_cast<const float *>(sb + Cf::SEG),
                    *sO = reinterpret_cast<const float *>(sb + Cf::SO);

        {  // the gradient of tile n's outgoing state (fp32)
            float *Sd = dS_tiles + ((size_t)n * H + h) * K3 * V3;
#pragma unroll
            for (int nd = 0; nd < NB; nd++)
#pragma unroll
                for (int c = 0; c < 4; c++)
                    __stcs(Sd + (size_t)(8 * nd + 2 * tq + (c & 1)) * V3 + j0 + gq + 8 * (c >> 1),
                           st[nd][c]);
        }
        // dOᵀ (rows j, columns = tokens l) as the A fragment of one k-step over the tile's tokens:
        // a[0] = (j0 + g, l = 2t..2t+1), a[1] = (j0 + g + 8, 2t..), a[2] = (j0 + g, 2t+8..),
        // a[3] = (j0 + g + 8, 2t+8..); element (j, l) = dO[l][j] (fp32, split here).
        uint32_t oh[4], ol[4];
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int l = 2 * tq + 8 * (r >> 1), j = jw + gq + 8 * (r & 1);
            pack_split(sO[l * LDO + j], sO[(l + 1) * LDO + j], oh[r], ol[r]);
        }
        // dΔᵀ (rows j, columns = tokens r) = dSᵀ K^eᵀ + dOᵀ P.
        // dSᵀ K^eᵀ: B(k = d, n = r) = K^e[r][d], n-major. dl[ns][c] = dΔᵀ(j0 + g + 8 (c >> 1),
        // 8 ns + 2t + (c & 1)); even / odd k-steps in two accumulators.
        float dl[2][4] = {}, dx[2][4] = {};
#pragma unroll
        for (int kd = 0; kd < K3 / 16; kd++) {
            uint32_t ah[4], al[4], b[4], bl[4];
            acc_to_a_split(st[2 * kd], st[2 * kd + 1], ah, al);
            ldsm_split<X>(b, bl, adr_b_nk(sE, LD3, 16 * kd, 0, lane), LO3);
            float(*acc)[4] = (kd & 1) ? dx : dl;
            mma_split<X>(acc[0], ah, al, b, bl);
            mma_split<X>(acc[1], ah, al, b + 2, bl + 2);
        }
        {  // dOᵀ P: B(k = token l, n = token r) = P[l][r], k-major (ldsm .trans); P is lower
           // triangular (diagonal included), so this is Σ_{l >= r} P[l][r] dO[l][j].
            uint32_t bp[4], bpl[4];
            ldsm_split_t<X>(bp, bpl, adr_b_kn(sP, LDP3, 0, 0, lane), LOP);
            mma_split<X>(dx[0], oh, ol, bp, bpl);
            mma_split<X>(dx[1], oh, ol, bp + 2, bpl + 2);
        }
#pragma unroll
        for (int ns = 0; ns < 2; ns++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                dl[ns][c] += dx[ns][c];
                const int r = 8 * ns + 2 * tq + (c & 1);
                dD[((size_t)h * Tp + (size_t)n * C3 + r) * V3 + j0 + gq + 8 * (c >> 1)] = dl[ns][c];
            }
        uint32_t da[4], dal[4];
        acc_to_a_split(dl[0], dl[1], da, dal);
        // dSᵀ ← dSᵀ diag(e^γ) + dOᵀ Q⁺ + dΔᵀ (−W): B(k = token l, n = d) = Q⁺[l][d], (−W)[l][d],
        // k-major (ldsm .trans).
#pragma unroll
        for (int nd = 0; nd < NB; nd++) {
            const float2 e = *reinterpret_cast<const float2 *>(sEG + 8 * nd + 2 * tq);
            st[nd][0] *= e.x;
            st[nd][1] *= e.y;
            st[nd][2] *= e.x;
            st[nd][3] *= e.y;
        }
#pragma unroll
        for (int pp = 0; pp < K3 / 16; pp++) {
            uint32_t bq[4], bql[4], bw[4], bwl[4];
            ldsm_split_t<X>(bq, bql, adr_b_kn(sQ, LD3, 0, 16 * pp, lane), LO3);
            ldsm_split_t<X>(bw, bwl, adr_b_kn(sW, LD3, 0, 16 * pp, lane), LO3);
            mma_split<X>(st[2 * pp], oh, ol, bq, bql);
            mma_split<X>(st[2 * pp + 1], oh, ol, bq + 2, bql + 2);
            mma_split<X>(st[2 * pp], da, dal, bw, bwl);
            mma_split<X>(st[2 * pp + 1], da, dal, bw + 2, bwl + 2);
        }
    }
    cp_async_wait<0>();
    if (dS0) KDA3_STATE_STORE_(dS0, st, h, j0, gq, tq);
}

// Tiles [n_lo, n_hi) of nt (the whole sequence: 0, nt), last to first: dS_final is the gradient
// of the state leaving tile n_hi - 1, dS0 the one entering tile n_lo.
template <int WPB, bool X>
__global__ void __launch_bounds__(32 * WPB, 1)
    kda3_state_bwd_k(int T, int H, int nt, int n_lo, int n_hi, const unsigned char *__restrict__ rec,
                     const float *__restrict__ dout, const float *dS_final, float *__restrict__ dD,
                     float *__restrict__ dS_tiles, float *dS0) {
    kda3_state_bwd_<WPB, X>(T, H, nt, (size_t)nt * C3, n_lo, n_hi, blockIdx.y, blockIdx.x * 16 * WPB, rec, dout,
                            dS_final, dD, dS_tiles, dS0);
}

// The varlen pass over a group of np consecutive pieces of a pack (kda/chunk_varlen_mma.cu): block
// (x, h, z) runs kda3_state_bwd_ over piece z's tiles from dS = 0 (no gradient arrives through a
// piece's final state) and gives no dS0 (none leaves through its zero initial state), as
// mtrl_kda_chunk_bwd per piece with dS_final = dS0 = NULL. ofs, ts [np + 1]: the pieces' first
// tokens and first tiles in the pack; the group's NT tiles start at pack tile tb0, its records
// rec [H][NT], dD [H][16 NT][V] and dS_tiles [NT][H][K][V] hold them in that order.
template <int WPB, bool X>
__global__ void __launch_bounds__(32 * WPB, 1)
    kda_vl_state_bwd_k(int NT, int tb0, int H, const int *__restrict__ ofs, const int *__restrict__ ts,
                       const unsigned char *__restrict__ rec, const float *__restrict__ dout_all,
                       float *__restrict__ dD, float *__restrict__ dS_tiles) {
    const int p = blockIdx.z, tb = ts[p] - tb0, nt = ts[p + 1] - ts[p], T = ofs[p + 1] - ofs[p];
    kda3_state_bwd_<WPB, X>(T, H, NT, (size_t)NT * C3, 0, nt, blockIdx.y, blockIdx.x * 16 * WPB,
                            rec + (size_t)tb * Rec<X>::BYTES, dout_all + (size_t)ofs[p] * H * V3, nullptr,
                            dD + (size_t)tb * C3 * V3, dS_tiles + (size_t)tb * H * K3 * V3, nullptr);
}

template <int WPB, bool X>
void launch_state_bwd3_(mtrl_cuda_ctx *c, int T, int H, int nt, int n_lo, int n_hi, const unsigned char *rec,
                        const float *dout, const float *dS_final, float *dD, float *dSt, float *dS0) {
    const size_t sh = StBwdCfg<WPB, X>::smem();
    set_smem(kda3_state_bwd_k<WPB, X>, sh);
    kda3_state_bwd_k<WPB, X><<<dim3(V3 / (16 * WPB), H), 32 * WPB, sh, c->stream>>>(T, H, nt, n_lo, n_hi, rec,
                                                                                   dout, dS_final, dD, dSt, dS0);
    CUDA_LAUNCH_CHECK();
}

}  // namespace

// The v3 state-gradient pass over records written by kda3_prep_launch(split = 1) (T >= 1,
// K = V = 128, dout 16-byte aligned): dD [H][Tp][V], dSt [tiles][H][K][V], dS0 (optional) as
// kda_state_bwd_k writes them. bf16x3 only: plain bf16 operands fail the model's tests in the
// forward (kda/chunk_simt.cu), and the backward's dg is the same cancelling sum.
// Tiles [n_lo, n_hi) only (kda3_state_bwd_k): dS_final leaves tile n_hi - 1, dS0 enters n_lo.
void kda3_state_bwd_launch(mtrl_cuda_ctx *c, int T, int H, int n_lo, int n_hi, const unsigned char *rec,
                           const float *dout, const float *dS_final, float *dD, float *dSt, float *dS0) {
    const int nt = (T + C3 - 1) / C3;
    launch_state_bwd3_<4, true>(c, T, H, nt, n_lo, n_hi, rec, dout, dS_final, dD, dSt, dS0);  // 4 warps a block
}

// The varlen form over a group of np pieces (kda_vl_state_bwd_k; records by kda/chunk_varlen_mma.cu's
// prep, split = 1), 4 warps a block as kda3_state_bwd_launch.
void kda3_state_bwd_varlen_launch(mtrl_cuda_ctx *c, int np, int NT, int tb0, int H, const int *ofs, const int *ts,
                                  const unsigned char *rec, const float *dout, float *dD, float *dSt) {
    const size_t sh = StBwdCfg<4, true>::smem();
    set_smem(kda_vl_state_bwd_k<4, true>, sh);
    kda_vl_state_bwd_k<4, true><<<dim3(V3 / 64, H, np), 128, sh, c->stream>>>(NT, tb0, H, ofs, ts, rec, dout, dD, dSt);
    CUDA_LAUNCH_CHECK();
}
