// kda/chunk_parallel.cu: the chunk-parallel (sequence-parallel) KDA forward, mtrl_kda_chunk_fwd_cp.
//
// Why: the v3 forward's state pass (kda/chunk_mma.cu) walks the 16-token tiles of a sequence one
// after another on 2H blocks; at few heads and long sequences (H = 16, T = 64K and up) that leaves
// most SMs idle for the whole pass. The state recurrence is affine in the incoming state: per tile
// (model.md §2.3) Δ = U − W S and S' = diag(e^γ) S + K^eᵀ Δ = A S + K^eᵀ U with
// A = diag(e^γ) − K^eᵀ W, so over a run of tiles (a piece p) S_out = M_p S_in + B_p, where B_p is
// the piece's final state from S_in = 0 and M_p = Π A (K x K) is the piece's final "state" from
// S_in = I with U = 0 (the same recurrence: A acts on the rows of S, and K = V = 128 here, so the
// columns of I are value columns like any other). Three steps, after v3's prep (one record per
// head and tile, every tile in parallel):
//   1. pass 1, grid (2 V / (16 WPB), H, P − 1): for pieces 0 .. P − 2 at once, the first half of
//      the blocks run the state pass from zero (B_p), the second half from I with U read as zero
//      (M_p). No outputs, no tile states. The last piece needs neither.
//   2. combine: S_in(p + 1) = M_p S_in(p) + B_p for p = 0 .. P − 2 in sequence (P − 1 small fp32
//      SIMT launches, H products of 128 x 128 x 128 each, fixed summation order). With S0 = NULL
//      the first one is skipped: S_in(1) = B_0 exactly.
//   3. pass 3, grid (V / (16 WPB), H, P): every piece at once from its incoming state, writing o,
//      S_tiles and (the last piece) S_final: the sequential pass's arithmetic tile for tile.
// Pieces start on 16-token tile boundaries (tile bounds nt p / P), so piece 0 sees exactly the
// sequential pass's inputs and gives its bits, and with S0 = NULL so does piece 1 (B_0 is the
// sequential state at its boundary, bit for bit: same kernel body, same order); later pieces
// differ by the rounding of M_p and of the combine (kernels/ref/kda_cp_ref.h is the same
// decomposition in the reference; tests/test_kda_cp_ref.c and tests/test_cuda_kda.cu check both).
//
// Cost: pass 1 does twice the state work of the pieces it covers (B and M), pass 3 once, so the
// total is about 3x the sequential pass's mma work (a bit less: pass 1 computes no O), spread
// over P times more blocks. The kernel here keeps NSTC = 3 ring stages (98,304 B of shared memory
// at bf16x3, WPB = 4) instead of the sequential pass's 6 so that two blocks share an SM: the
// per-tile chain is latency-bound (one warp per scheduler in the sequential pass), so a second
// warp per scheduler fills its stalls; 2 tiles in flight still cover the records' latency.
// The chooser (mtrl_kda_cp_pieces) goes chunk-parallel only while the sequential pass's 2H blocks
// hold at most a quarter of the SMs (8H <= SMs: H <= 16 on an H200; above that the sequential pass
// already spreads over most SMs and the extra work cannot pay), with P = min(SMs / H, nt / 128),
// and only from 4 pieces on (at 2, pass 1 doubles half the work on a quarter of the GPU and the
// whole is slower than the sequential pass). P = SMs / H makes pass 3's 2 H P blocks fill the
// GPU's 2-per-SM slots once; pieces of at least 128 tiles keep the fixed costs (the combine, pass
// 1's extra work) small against the pass. The measurements behind the rule: docs/kernel-lab.md,
// "KDA chunk-parallel forward".
#include "kernels/cuda/kda/chunk_mma.cuh"

int kda3_supports(int H, int K, int V, const void *q, const void *k, const void *v,
                  const void *g);  // kda/chunk_mma.cu

namespace {

constexpr int WPBC = 4;  // warps per block (16 value columns each)
constexpr int NSTC = 3;  // ring stages: two blocks per SM (header comment)
constexpr int NBXC = V3 / (16 * WPBC);  // blocks per head and piece (value-column strips)

template <bool X>
constexpr size_t cp_smem() { return (size_t)NSTC * StCfg<WPBC, X>::STAGE; }
static_assert(2 * cp_smem<true>() + 2048 <= 233472, "two blocks per SM (sm_90: 228 KB per SM)");

// The tile bounds of piece p of np over nt tiles (integer, so every caller agrees).
__host__ __device__ __forceinline__ int cp_bound(int nt, int p, int np) { return (int)((long long)nt * p / np); }

// One launch of pass 1 (pass1 = 1) or pass 3 (pass1 = 0); blockIdx.z = piece.
//   pass 1: blocks x < NBXC: the state from zero over piece z (U as recorded) into Bout[z];
//           blocks x >= NBXC: the state from I over piece z with U = 0 into Mout[z] (K x K).
//   pass 3: piece z from S0 (z = 0, NULL = zero) or Sin[z − 1]: o (WO), S_tiles (nullable),
//           S_final (nullable; the last piece only).
// The loop body is kda3_state_k's (KDA3_STATE_TILE_), with NSTC stages instead of NST3.
template <bool WO, bool X>
__global__ void __launch_bounds__(32 * WPBC, 2)
    kda_cp_state_k(int T, int H, int nt, int np, int pass1, const unsigned char *__restrict__ rec,
                   const float *S0, const float *Sin, float *__restrict__ o, float *S_final,
                   float *__restrict__ S_tiles, float *Bout, float *Mout) {
    using Cf = StCfg<WPBC, X>;
    using Rc = Rec<X>;
    constexpr int WPB = WPBC, NTH = 32 * WPB, LDU = Cf::LDU, NB = K3 / 8;
    constexpr int LO3 = Cf::LO3 / 2, LOP = Cf::LOP / 2, LOU = Cf::LOU / 2;  // lo parts (elements)
    extern __shared__ __align__(16) unsigned char sm3_[];
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, gq = lane >> 2, tq = lane & 3;
    const int p = blockIdx.z, h = blockIdx.y;
    const bool tr = pass1 && blockIdx.x >= NBXC;  // a transition block (M_p)
    const int jb = (blockIdx.x % NBXC) * 16 * WPB;
    const int jw = 16 * w, j0 = jb + jw;
    const int n_lo = cp_bound(nt, p, np), n_hi = cp_bound(nt, p + 1, np);
    const size_t KV = (size_t)K3 * V3;

    if (tr)  // U = 0: its stage rows are zeroed once and never copied into
        for (int s = 0; s < NSTC; s++)
            for (int i = tid; i < Cf::NP * LOU / 8; i += NTH)
                reinterpret_cast<uint4 *>(sm3_ + s * Cf::STAGE + Cf::SU)[i] = make_uint4(0, 0, 0, 0);

    auto issue = [&](int n) {
        const unsigned char *R = rec + ((size_t)h * nt + n) * Rc::BYTES;
        unsigned char *st = sm3_ + (n % NSTC) * Cf::STAGE;
        KDA3_STAGE_KSIDE_(st, R, Cf::SP, Cf::SEG, tid, NTH, Cf::NP);
        if (!tr)
            for (int i = tid; i < Cf::NP * C3 * 2 * WPB; i += NTH) {
                const int r = i / (2 * WPB), c = i % (2 * WPB);  // r = part * 16 + row
                cp_async16(st + Cf::SU + r * LDU * 2 + c * 16, R + Rc::U + (r * V3 + jb) * 2 + c * 16);
            }
    };
#pragma unroll 1
    for (int s = 0; s < NSTC - 1; s++) {
        if (n_lo + s < n_hi) issue(n_lo + s);
        cp_async_commit();
    }

    float st[NB][4];  // Sᵀ in the accumulator layout (KDA3_STATE_LOAD_)
    if (tr) {
#pragma unroll
        for (int nd = 0; nd < NB; nd++)
#pragma unroll
            for (int c = 0; c < 4; c++)
                st[nd][c] = 8 * nd + 2 * tq + (c & 1) == j0 + gq + 8 * (c >> 1) ? 1.f : 0.f;
    } else {
        const float *Sp = pass1 ? nullptr : p == 0 ? S0 : Sin + (size_t)(p - 1) * H * KV;
        KDA3_STATE_LOAD_(st, Sp, h, j0, gq, tq);
    }

    KDA3_STATE_TILES_(NSTC, n_lo, n_hi);
    float *out = pass1 ? (tr ? Mout : Bout) + (size_t)p * H * KV : p == np - 1 ? S_final : nullptr;
    if (out) KDA3_STATE_STORE_(out, st, h, j0, gq, tq);
}

// SB = M Sin + SB for every head (M [H][K][K], Sin and SB [H][K][V]): one piece boundary of the
// combine. Block (r, h): rows 16 r .. 16 r + 15 of head h; thread t: column t % 128, 8 rows.
// Each output sums its 128 products in order, in fp32, then adds B.
constexpr int CMB_ROWS = 16;
__global__ void __launch_bounds__(256) kda_cp_combine_k(const float *__restrict__ M, const float *__restrict__ Sin,
                                                         float *SB) {
    __shared__ float sM[CMB_ROWS][K3];
    const int h = blockIdx.y, r0 = blockIdx.x * CMB_ROWS, tid = threadIdx.x;
    const float *Mh = M + (size_t)h * K3 * K3, *Sh = Sin + (size_t)h * K3 * V3;
    for (int i = tid; i < CMB_ROWS * K3; i += 256) sM[i / K3][i % K3] = Mh[(size_t)(r0 + i / K3) * K3 + i % K3];
    __syncthreads();
    const int j = tid % V3, rr = (tid / V3) * 8;
    float acc[8] = {};
    for (int e = 0; e < K3; e++) {
        const float s = Sh[(size_t)e * V3 + j];
#pragma unroll
        for (int r = 0; r < 8; r++) acc[r] = fmaf(sM[rr + r][e], s, acc[r]);
    }
    float *Bh = SB + (size_t)h * K3 * V3;
#pragma unroll
    for (int r = 0; r < 8; r++) {
        float *b = Bh + (size_t)(r0 + rr + r) * V3 + j;
        *b = acc[r] + *b;
    }
}

template <bool WO, bool X>
void cp_launch_(mtrl_cuda_ctx *c, dim3 grid, int T, int H, int nt, int np, int pass1, const unsigned char *rec,
                const float *S0, const float *Sin, float *o, float *S_final, float *S_tiles, float *Bb, float *Mb) {
    const size_t sh = cp_smem<X>();
    set_smem(kda_cp_state_k<WO, X>, sh);
    kda_cp_state_k<WO, X><<<grid, 32 * WPBC, sh, c->stream>>>(T, H, nt, np, pass1, rec, S0, Sin, o, S_final, S_tiles,
                                                             Bb, Mb);
    CUDA_LAUNCH_CHECK();
}

template <bool X>
void cp_run_(mtrl_cuda_ctx *c, int T, int H, int nt, int np, const unsigned char *rec, const float *S0, float *o,
             float *S_final, float *S_tiles, float *Bb, float *Mb) {
    cp_launch_<false, X>(c, dim3(2 * NBXC, H, np - 1), T, H, nt, np, 1, rec, nullptr, nullptr, nullptr, nullptr,
                         nullptr, Bb, Mb);
    const size_t HKV = (size_t)H * K3 * V3;
    for (int p = 0; p + 1 < np; p++) {  // Bb[p] becomes S_in(p + 1)
        const float *Sin = p == 0 ? S0 : Bb + (p - 1) * HKV;
        if (!Sin) continue;  // S_in(1) = B_0 exactly
        kda_cp_combine_k<<<dim3(K3 / CMB_ROWS, H), 256, 0, c->stream>>>(Mb + p * HKV, Sin, Bb + p * HKV);
        CUDA_LAUNCH_CHECK();
    }
    if (o)
        cp_launch_<true, X>(c, dim3(NBXC, H, np), T, H, nt, np, 0, rec, S0, Bb, o, S_final, S_tiles, nullptr, nullptr);
    else
        cp_launch_<false, X>(c, dim3(NBXC, H, np), T, H, nt, np, 0, rec, S0, Bb, o, S_final, S_tiles, nullptr,
                             nullptr);
}

}  // namespace

extern "C" int mtrl_kda_cp_pieces(const mtrl_cuda_ctx *ctx, int T, int H, int K, int V, int request) {
    if (T <= 0 || H <= 0 || K != K3 || V != V3 || mtrl_kda_chunk_fwd_version(ctx, H, K, V) != 3) return 1;
    const int nt = (T + C3 - 1) / C3;
    int np = request;
    if (request <= MTRL_KDA_CP_AUTO) {  // header comment: the rule and why
        const int by_sms = ctx->sms / H, by_len = nt / 128;
        np = by_sms < by_len ? by_sms : by_len;
        if (8 * H > ctx->sms || np < 4) np = 1;
    }
    if (np > nt) np = nt;
    if (np > MTRL_KDA_CP_MAX_PIECES) np = MTRL_KDA_CP_MAX_PIECES;
    return np < 1 ? 1 : np;
}

// The sequential forward of the same inputs (what mtrl_kda_chunk_fwd_cp runs at one piece).
static int kda_fwd_seq_(mtrl_cuda_ctx *c, int T, int H, int K, int V, const float *q, const float *k, const float *v,
                        const float *g, const float *beta, const float *S0, float *o, float *S_final,
                        float *S_tiles) {
    return mtrl_kda_chunk_fwd(c, T, H, K, V, q, k, v, g, beta, S0, o, S_final, S_tiles);
}
static int kda_fwd_seq_(mtrl_cuda_ctx *c, int T, int H, int K, int V, const mtrl_bf16 *q, const mtrl_bf16 *k,
                        const mtrl_bf16 *v, const mtrl_bf16 *g, const float *beta, const float *S0, float *o,
                        float *S_final, float *S_tiles) {
    return mtrl_kda_chunk_fwd_bf16(c, T, H, K, V, q, k, v, g, beta, S0, o, S_final, S_tiles);
}

// mtrl_kda_chunk_fwd_cp and its bf16-input form: q, k, v, g of type TI (float or mtrl_bf16) reach only
// the prep, which writes the same records from the same values either way.
template <typename TI>
static int kda_chunk_fwd_cp_(mtrl_cuda_ctx *c, int pieces, int T, int H, int K, int V, const TI *q, const TI *k,
                             const TI *v, const TI *g, const float *beta, const float *S0, float *o, float *S_final,
                             float *S_tiles) {
    MTRL_CUDA_REQUIRE(pieces >= 0, "pieces = %d (0: the chooser, 1: sequential, N >= 2: N pieces)", pieces);
    const int np = T > 0 && H > 0 && kda3_supports(H, K, V, q, k, v, g) ? mtrl_kda_cp_pieces(c, T, H, K, V, pieces)
                                                                        : 1;
    if (np <= 1) return kda_fwd_seq_(c, T, H, K, V, q, k, v, g, beta, S0, o, S_final, S_tiles);
    const int split = !c->opts.kda_plain_bf16, nt = (T + C3 - 1) / C3;
    const size_t HKV = (size_t)H * K3 * V3;
    auto carve = [&](ws_carver &cv, unsigned char **rec, float **Bb, float **Mb) {
        *rec = cv.take<unsigned char>((size_t)H * nt * kda3_rec_bytes(split));
        *Bb = cv.take<float>((np - 1) * HKV);
        *Mb = cv.take<float>((np - 1) * (size_t)H * K3 * K3);
    };
    unsigned char *rec;
    float *Bb, *Mb;
    ws_carver sz{nullptr, 0};
    carve(sz, &rec, &Bb, &Mb);
    ws_carver cv{(char *)mtrl_ctx_scratch(c, sz.off), 0};
    carve(cv, &rec, &Bb, &Mb);
    kda3_prep_launch(c, T, H, q, k, v, g, beta, rec, split);
    if (split) cp_run_<true>(c, T, H, nt, np, rec, S0, o, S_final, S_tiles, Bb, Mb);
    else cp_run_<false>(c, T, H, nt, np, rec, S0, o, S_final, S_tiles, Bb, Mb);
    return 0;
}

extern "C" int mtrl_kda_chunk_fwd_cp(mtrl_cuda_ctx *c, int pieces, int T, int H, int K, int V, const float *q,
                                     const float *k, const float *v, const float *g, const float *beta,
                                     const float *S0, float *o, float *S_final, float *S_tiles) {
    return kda_chunk_fwd_cp_(c, pieces, T, H, K, V, q, k, v, g, beta, S0, o, S_final, S_tiles);
}
extern "C" int mtrl_kda_chunk_fwd_cp_bf16(mtrl_cuda_ctx *c, int pieces, int T, int H, int K, int V,
                                          const mtrl_bf16 *q, const mtrl_bf16 *k, const mtrl_bf16 *v,
                                          const mtrl_bf16 *g, const float *beta, const float *S0, float *o,
                                          float *S_final, float *S_tiles) {
    return kda_chunk_fwd_cp_(c, pieces, T, H, K, V, q, k, v, g, beta, S0, o, S_final, S_tiles);
}
