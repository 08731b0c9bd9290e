// kda_ref.h: CPU reference of the Kimi Delta Attention (KDA) core, forward and backward.
//
// This is the oracle the CUDA kernels are checked against (design: model.md §2.2-2.6, tests
// I1, I2, I5, I6, I7 of §8). It implements, per head, the gated delta rule
//
//     S̃ = diag(e^{g_t}) S_{t-1};  r_t = v_t − S̃ᵀ k_t;  S_t = S̃ + β_t k_t r_tᵀ;  o_t = S_tᵀ q_t
//
// three ways: the token recurrence (the definition, plus BPTT), one decode step, and the
// chunked WY/UT form in 16-token tiles where every product goes through mtrl_ref_gemm (so the CUDA
// port can mirror it GEMM for GEMM). Plus the lower-bounded decay gate of §2.1.
//
// Shapes (one sequence, token-major; T tokens, H heads, K = d_k, V = d_v):
//     q, k, dq, dk, g, dg : [T][H][K]      q already scaled by d_k^-1/2 and L2-normalised, k
//                                          L2-normalised (the layer does both); the core takes
//                                          them as given
//     v, dv               : [T][H][V]
//     beta, dbeta         : [T][H]         in (0, 1)
//     o, dout             : [T][H][V]
//     S0, S_final, dS0, dS_final : [H][K][V]   state, row d of S is key dimension d
//     g                   : log-decay, every entry <= 0. The factored chunked form relies on
//                           g >= KDA_G_CHUNK_MIN = -11 (see §2.5) so that e^{±88} bounds every
//                           factor; a chunk with any g below it (Kimi's unbounded gate) runs the
//                           token recurrence of that chunk instead, forward and backward: the
//                           same numbers, exact for any decay, O(chunk) states of scratch
// All pointers are borrowed, caller-owned, and must not alias one another. Functions allocate
// their own scratch once per call (malloc; aborts on out-of-memory) and free it before return.
// T = 0 is allowed everywhere: no tokens are touched and S_final = S0 (zeros if S0 is NULL).
// Work is parallel over heads (OpenMP).
//
// Precision: `real` is float or double (kernels/ref/real.h). Dot products of the recurrence and
// every mtrl_ref_gemm accumulate in double; stored operands (scaled Q⁺, K̂⁻, ...) and states are
// `real`, as on the GPU where they are fp32.
#ifndef MTRL_KDA_REF_H
#define MTRL_KDA_REF_H

#include "kernels/ref/real.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KDA_TILE 16        // rows of one tile (C of §2.3)
#define KDA_G_CHUNK_MIN (-11.0) // the factored chunk form's smallest log-decay (§2.5)
#define KDA_SUPER_CHUNK 64 // rows of a §2.6 super-chunk (four 16-tiles)

// ---- gate (§2.1) ------------------------------------------------------------------------------
// g = g_min * σ(exp(A_log[h]) * (f + dt_bias)), elementwise. f, g: [T][H*K]; A_log: [H];
// dt_bias: [H*K]; g_min < 0 (the project uses -5).
void mtrl_ref_kda_gate_fwd(int T, int H, int K, const real *f, const real *A_log, const real *dt_bias,
                  real g_min, real *g);
// Backward of mtrl_ref_kda_gate_fwd given dg [T][H*K]: df [T][H*K] is overwritten; dA_log [H] and
// ddt_bias [H*K] are ACCUMULATED (+=) so several sequences can share one gradient buffer.
void mtrl_ref_kda_gate_bwd(int T, int H, int K, const real *f, const real *A_log, const real *dt_bias,
                  real g_min, const real *dg, real *df, real *dA_log, real *ddt_bias);

// Kimi Linear's gate (transformers' KimiLinearForgetGate): g = max(−exp(A_log[h]) ·
// softplus(f + dt_bias), g_floor), softplus(x) = x above 20, unbounded below without the floor
// (g_floor = −INFINITY: the exact form, the CPU model's). A floor >= KDA_G_CHUNK_MIN puts every
// g in the range of the GPU's chunked kernels (the CUDA model clamps at dims.g_min); a clamped
// entry has no gradient. Backward as mtrl_ref_kda_gate_bwd's (df overwritten, dA_log and ddt_bias +=).
void mtrl_ref_kda_gate_kimi_fwd(int T, int H, int K, const real *f, const real *A_log, const real *dt_bias,
                       real g_floor, real *g);
void mtrl_ref_kda_gate_kimi_bwd(int T, int H, int K, const real *f, const real *A_log, const real *dt_bias,
                       real g_floor, const real *dg, real *df, real *dA_log, real *ddt_bias);

// ---- recurrence (§2.2): the definition ---------------------------------------------------------
// S0 may be NULL (zeros). S_final [H][K][V] may be NULL. S_all, if non-NULL, receives
// [T+1][H][K][V] = S_0 .. S_T, which mtrl_ref_kda_recurrent_bwd needs.
void mtrl_ref_kda_recurrent_fwd(int T, int H, int K, int V, const real *q, const real *k, const real *v,
                       const real *g, const real *beta, const real *S0, real *o, real *S_final,
                       real *S_all);
// BPTT of §2.2 from S_all (required, as written by mtrl_ref_kda_recurrent_fwd). Loss gradient inputs:
// dout [T][H][V] and dS_final [H][K][V] (NULL = zero). All outputs are overwritten; dS0 may be
// NULL.
void mtrl_ref_kda_recurrent_bwd(int T, int H, int K, int V, const real *q, const real *k, const real *v,
                       const real *g, const real *beta, const real *S_all, const real *dout,
                       const real *dS_final, real *dq, real *dk, real *dv, real *dg, real *dbeta,
                       real *dS0);
// One decode token for H heads: q, k, g [H][K]; v [H][V]; beta [H]; S [H][K][V] is updated in
// place; o [H][V]. Same arithmetic as one step of mtrl_ref_kda_recurrent_fwd.
void mtrl_ref_kda_step(int H, int K, int V, const real *q, const real *k, const real *v, const real *g,
              const real *beta, real *S, real *o);

// ---- chunked form (§2.3, §2.4, §2.6) -----------------------------------------------------------
// Options, zero-initialised = defaults (`kda_chunk_opts o = {0};`, or pass NULL):
//   ref:      reference row of the diagonal 16x16 block, whose cumulative decay is subtracted
//             from the exponents (it cancels in exact arithmetic; it only sets the range).
//             KDA_REF_MID (default): row m = min(8, c-1) of the tile, factors within e^{±40},
//             which avoids subnormal products (§2.5). KDA_REF_START: the tile's incoming
//             boundary (Ĝ = G inside a 16-tile), factors up to e^{80}; kept for test I6.
//   solve:    how T = (I + M)^{-1} of a 16x16 diagonal block is formed. KDA_SOLVE_FSUB
//             (default): forward substitution, one 1 x i by i x i product per row. It is the
//             reference because it is the textbook definition, costs c³/6 instead of the ~6c³
//             of the nilpotent form, and has no error growth from squaring M. KDA_SOLVE_NILPOTENT:
//             T = (I − M)(I + M²)(I + M⁴)(I + M⁸), the all-GEMM form a tensor-core kernel uses
//             (exact since M^16 = 0 for c <= 16); test I5 checks the two agree.
//   pad_tail: 0 (default): a partial last chunk is processed with c < chunk rows as written.
//             1: it is zero-padded to the full chunk (k = q = v = 0, β = 0, g = 0), as a GPU
//             kernel with fixed tiles does; outputs are unchanged.
//   chunk:    0 or 16 (default): 16-token tiles, states carried tile to tile. 64: §2.6 super-
//             chunks of four 16-tiles; off-diagonal blocks of M and P are referenced at the
//             first row of the block row (exponents <= 0), T by block forward substitution.
//             Same numbers, 4x fewer sequential state steps (test I7).
enum { KDA_REF_MID = 0, KDA_REF_START = 1 };
enum { KDA_SOLVE_FSUB = 0, KDA_SOLVE_NILPOTENT = 1 };
typedef struct kda_chunk_opts {
    int ref;      // KDA_REF_MID or KDA_REF_START
    int solve;    // KDA_SOLVE_FSUB or KDA_SOLVE_NILPOTENT
    int pad_tail; // 0 or 1
    int chunk;    // 0 (= 16), 16 or 64
} kda_chunk_opts;

static inline int mtrl_ref_kda_tile_count(int T) { return (T + KDA_TILE - 1) / KDA_TILE; }
// Number of stored incoming states (S_tiles rows) for these options: ceil(T / chunk).
int mtrl_ref_kda_chunk_state_count(int T, const kda_chunk_opts *opts);

// Chunked forward with default options. S0 and S_final are nullable (o too, when only the state
// is wanted). S_tiles, if non-NULL, receives the incoming state of every tile:
// [mtrl_ref_kda_tile_count(T)][H][K][V]; tile n starts at token 16 n, so S_tiles[n] = S_{16 n}.
void mtrl_ref_kda_chunk_fwd(int T, int H, int K, int V, const real *q, const real *k, const real *v,
                   const real *g, const real *beta, const real *S0, real *o, real *S_final,
                   real *S_tiles);
// Chunked backward (§2.4) with default options. S_tiles is what mtrl_ref_kda_chunk_fwd stored, or NULL
// (then it is recomputed from S0 by a forward pass). dS_final NULL = zero. Every output is
// overwritten; dS0 may be NULL.
void mtrl_ref_kda_chunk_bwd(int T, int H, int K, int V, const real *q, const real *k, const real *v,
                   const real *g, const real *beta, const real *S0, const real *S_tiles,
                   const real *dout, const real *dS_final, real *dq, real *dk, real *dv, real *dg,
                   real *dbeta, real *dS0);
// n packed sequences, each from the zero state (cu_seqlens style): piece i is tokens offs[i] ..
// offs[i+1] - 1 of the packed q, k, v, g, beta (offs [n + 1], non-decreasing), and its outputs go
// to the same rows of o; S_final (nullable) [n][H][K][V] gets each piece's final state; S_tiles
// (nullable) every piece's tile states one piece after another (mtrl_ref_kda_tile_count(len)
// each). Exactly mtrl_ref_kda_chunk_fwd per piece with S0 = NULL (a loop over the pieces: the
// contract of the GPU's one-launch form, kernels_cuda.h mtrl_kda_chunk_fwd_varlen).
void mtrl_ref_kda_chunk_fwd_varlen(int n, const int *offs, int H, int K, int V, const real *q, const real *k,
                                   const real *v, const real *g, const real *beta, real *o, real *S_final,
                                   real *S_tiles);
// The piece_io form (the actor's prefill of several sequences at once, each continuing its own
// state): piece i from S0[i] and its final state to S_final[i] (S0, S_final: arrays [n] of
// pointers to [H][K][V], NULL for none, entries nullable; S_final[i] may be S0[i]: in place).
// Exactly mtrl_ref_kda_chunk_fwd per piece with those states (kernels_cuda.h
// mtrl_kda_chunk_fwd_varlen_io is the one-launch form).
void mtrl_ref_kda_chunk_fwd_varlen_io(int n, const int *offs, int H, int K, int V, const real *q, const real *k,
                                      const real *v, const real *g, const real *beta, const real *const *S0,
                                      real *o, real *const *S_final, real *S_tiles);
// Its backward: mtrl_ref_kda_chunk_bwd per piece with S0 = NULL, dS_final = NULL (each piece ends
// its sequence) and no dS0; S_tiles as the varlen forward stored them, or NULL.
void mtrl_ref_kda_chunk_bwd_varlen(int n, const int *offs, int H, int K, int V, const real *q, const real *k,
                                   const real *v, const real *g, const real *beta, const real *S_tiles,
                                   const real *dout, real *dq, real *dk, real *dv, real *dg, real *dbeta);
// The same with options (NULL = defaults). S_tiles then holds mtrl_ref_kda_chunk_state_count(T, opts)
// states, one per chunk of opts->chunk tokens; fwd and bwd must be given the same options.
void mtrl_ref_kda_chunk_fwd_ex(int T, int H, int K, int V, const real *q, const real *k, const real *v,
                      const real *g, const real *beta, const real *S0, real *o, real *S_final,
                      real *S_tiles, const kda_chunk_opts *opts);
void mtrl_ref_kda_chunk_bwd_ex(int T, int H, int K, int V, const real *q, const real *k, const real *v,
                      const real *g, const real *beta, const real *S0, const real *S_tiles,
                      const real *dout, const real *dS_final, real *dq, real *dk, real *dv,
                      real *dg, real *dbeta, real *dS0, const kda_chunk_opts *opts);

// UT transform of one tile: T = (I + M)^{-1} for a strictly lower triangular M (c x c, c <= 16,
// row stride ldm); T (c x c, row stride ldt) is overwritten, unit lower triangular with zeros
// above the diagonal. method: KDA_SOLVE_FSUB or KDA_SOLVE_NILPOTENT. M and T must not overlap.
void mtrl_ref_kda_ut_solve(int c, const real *M, int ldm, real *T, int ldt, int method);

#ifdef __cplusplus
}
#endif

#endif
