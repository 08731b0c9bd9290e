// ops_ref.h: shared primitives of the CPU reference (docs/model.md §1, §5), forward and backward.
//
// What it is: the small per-token operators every layer uses (norms, SwiGLU, causal short
// conv, embedding, log-softmax statistics, sampling, AdamW), written once over `real` (float
// in the programs, double in the gradient-check tests; see real.h). These are the oracle the
// CUDA kernels are compared against, so each follows the formulas of docs/model.md literally and
// accumulates reductions in double.
//
// Conventions (every function):
//   * Row-major; "N rows of width D" means x[i*D + j]. Shapes are given per argument.
//   * Outputs are OVERWRITTEN unless marked "+=" (accumulated), which is how parameter
//     gradients are summed over calls (segments, micro-batches). Zero them once per step.
//   * Caller owns every buffer; nothing is allocated that outlives a call, nothing is kept.
//     Outputs must not alias inputs unless stated.
//   * Reductions over rows (the "+=" weight gradients, mtrl_ref_grad_sq_norm) run in a fixed order,
//     independent of the OpenMP thread count, so results are bit-reproducible.
//   * Nullable pointers are marked; everything else must be valid.
#ifndef MTRL_OPS_REF_H
#define MTRL_OPS_REF_H

#include <stddef.h>

#include "kernels/ref/real.h"

#ifdef __cplusplus
extern "C" {
#endif

// ---- norms ---------------------------------------------------------------------------------

// RMSNorm per row: r = (mean(x²) + eps)^-1/2, y = w ⊙ x r.  x, y [N][D], w [D].
// rstd [N] (nullable) receives r for the backward. y may alias x.
void mtrl_ref_rmsnorm_fwd(int N, int D, const real *x, const real *w, real eps, real *y, real *rstd);
// dx = r (u − x̂ mean(u ⊙ x̂)) with u = w ⊙ dy;  dw += Σ_rows dy ⊙ x̂.
// rstd (nullable): the r saved by the forward; NULL recomputes it from x and eps.
// dw (nullable): skip the weight gradient. dx may alias dy.
void mtrl_ref_rmsnorm_bwd(int N, int D, const real *x, const real *w, const real *rstd, real eps,
                 const real *dy, real *dx, real *dw);

// L2Norm per row (KDA q, k): r = (Σ x² + eps)^-1/2 with eps inside the sum (model uses 1e-6),
// y = x r.  x, y [N][D]; rnorm [N] nullable (receives r).
void mtrl_ref_l2norm_fwd(int N, int D, const real *x, real eps, real *y, real *rnorm);
// dx = r (dy − y (dy·y)), recomputing r and y from x.
void mtrl_ref_l2norm_bwd(int N, int D, const real *x, real eps, const real *dy, real *dx);

// Gated RMSNorm per row (KDA output, one row per token and head): y = w ⊙ x̂ ⊙ σ(z),
// x̂ = x (mean(x²) + eps)^-1/2.  x, z, y [N][D], w [D].
void mtrl_ref_gated_rmsnorm_fwd(int N, int D, const real *x, const real *z, const real *w, real eps,
                       real *y);
// dz = dy ⊙ w ⊙ x̂ ⊙ s(1−s) with s = σ(z);  dw += Σ_rows dy ⊙ x̂ ⊙ s;  dx = RMSNorm backward
// with u = dy ⊙ w ⊙ s.  dw nullable (skip).
void mtrl_ref_gated_rmsnorm_bwd(int N, int D, const real *x, const real *z, const real *w, real eps,
                       const real *dy, real *dx, real *dz, real *dw);

// ---- SwiGLU (the activation between W1/W3 and W2; the projections are mtrl_ref_gemm) ------------

// m = SiLU(u1) ⊙ u3.  u1, u3, m [N][I]. m may alias u1 or u3.
void mtrl_ref_swiglu_fwd(int N, int I, const real *u1, const real *u3, real *m);
// du3 = dm ⊙ SiLU(u1);  du1 = dm ⊙ u3 ⊙ σ(u1)(1 + u1(1 − σ(u1))).  du1/du3 may alias dm
// only if they are not both the same buffer.
void mtrl_ref_swiglu_bwd(int N, int I, const real *u1, const real *u3, const real *dm, real *du1,
                real *du3);

// ---- causal depthwise short conv + SiLU (docs/model.md §1) --------------------------------------
//
// One sequence of T tokens over C channels, kernel width W (4 in the model), no bias:
//     p_t[c] = Σ_{j=0}^{W−1} w[c][j] · x_{t−W+1+j}[c],   y_t = SiLU(p_t)
// Inputs before x[0] come from state_in: its row r (0..W−2) is the input at position
// r − (W−1), oldest first (NULL = zeros, a sequence start). The same [W−1][C] layout is the
// decode window of mtrl_ref_shortconv_step, so a prefill's state_out is the decode window as is.
// Packed batches call these once per sequence (the padding restarts at each start).

// n packed sequences each from the zero window (cu_seqlens style): piece i is rows offs[i] ..
// offs[i+1] − 1 of x and y (offs [n + 1], non-decreasing); exactly mtrl_ref_shortconv_fwd per
// piece with state_in = NULL and no state_out.
void mtrl_ref_shortconv_fwd_varlen(int n, const int *offs, int C, int W, const real *x, const real *w, real *y);
// The piece_io form: piece i continues the window win_in[i] and leaves its new one at win_out[i]
// (arrays [n] of [W−1][C] windows, NULL for none, entries nullable; win_out[i] may be
// win_in[i]): exactly mtrl_ref_shortconv_fwd per piece with those states.
void mtrl_ref_shortconv_fwd_varlen_io(int n, const int *offs, int C, int W, const real *x, const real *w,
                                      const real *const *win_in, real *const *win_out, real *y);
// x, y [T][C]; w [C][W]; state_in [W−1][C] nullable; state_out [W−1][C] nullable: the last
// W−1 inputs of the stream state_in ++ x (rows of state_in when T < W−1). state_out may alias
// state_in. T >= 0 (T = 0 just copies the state).
void mtrl_ref_shortconv_fwd(int T, int C, int W, const real *x, const real *w, const real *state_in,
                   real *y, real *state_out);
// dx [T][C] overwritten; dw [C][W] +=; dstate_in [W−1][C] nullable, overwritten: exact
// ∂L/∂state_in through this segment's outputs (zero rows where no output reads them).
// This does not include a gradient arriving through state_out; see mtrl_ref_shortconv_state_bwd.
void mtrl_ref_shortconv_bwd(int T, int C, int W, const real *x, const real *w, const real *state_in,
                   const real *dy, real *dx, real *dw, real *dstate_in);
// The backward of mtrl_ref_shortconv_fwd_varlen: dx [offs[n]][C] overwritten on the pieces' rows,
// dw [C][W] += each piece's in turn; exactly mtrl_ref_shortconv_bwd per piece with state_in =
// NULL and no dstate_in.
void mtrl_ref_shortconv_bwd_varlen(int n, const int *offs, int C, int W, const real *x, const real *w, const real *dy,
                                   real *dx, real *dw);
// The backward of the state_out copy: adds dstate_out [W−1][C] (= ∂L/∂state_out, i.e. the
// next segment's dstate_in) into the inputs it was copied from: rows of dx (+=) and, when
// T < W−1, rows of dstate_in (+=, nullable when T >= W−1). Call after mtrl_ref_shortconv_bwd of the
// same segment. A segmented backward walks segments last to first:
//     mtrl_ref_shortconv_bwd(seg k) -> dstate_in_k;  mtrl_ref_shortconv_bwd(seg k−1); mtrl_ref_shortconv_state_bwd(seg k−1, dstate_in_k)
void mtrl_ref_shortconv_state_bwd(int T, int C, int W, const real *dstate_out, real *dx, real *dstate_in);

// One decode token: x1 [C]; window [W−1][C] (the last W−1 inputs, oldest first) is read and
// then shifted in place to include x1; y1 [C] = SiLU(Σ_j w[c][j] · (window ++ x1)[j][c]).
void mtrl_ref_shortconv_step(int C, int W, const real *x1, const real *w, real *window, real *y1);

// ---- embedding -----------------------------------------------------------------------------

// x[i] = E[ids[i]].  E [V][D], x [N][D]. ids[i] < 0 (padding) gives a zero row.
void mtrl_ref_embedding_fwd(int N, int D, const int *ids, const real *E, real *x);
// dE[ids[i]] += dx[i] (rows in order i = 0..N−1, so repeated ids sum deterministically);
// negative ids are skipped.
void mtrl_ref_embedding_bwd(int N, int D, const int *ids, const real *dx, real *dE);

// ---- log-softmax statistics of logits (docs/model.md §5; the RL loss reads these) -------------

// logits [N][V]. logp[i] = log softmax(logits_i)[targets[i]]; targets[i] = −1 means ignored
// and gives logp[i] = 0. entropy [N] nullable: H_i = −Σ_v p_v log p_v, computed for every row
// (ignored targets included; it does not depend on the target).
void mtrl_ref_logits_logprob_fwd(int N, int V, const real *logits, const int *targets, real *logp,
                        real *entropy);
// Backward of L = Σ_i dlogp[i]·logp_i + dentropy[i]·H_i (dentropy nullable = 0):
//     dlogits_iv = dlogp_i (δ_{v,t_i} − p_v) − dentropy_i · p_v (log p_v + H_i)
// (the dlogp term is absent for ignored rows). dlogits [N][V] overwritten; may alias logits.
void mtrl_ref_logits_logprob_bwd(int N, int V, const real *logits, const int *targets, const real *dlogp,
                        const real *dentropy, real *dlogits);

// ---- sampling ------------------------------------------------------------------------------

// Draws one token from a row of logits [V], deterministically from one uniform u in [0, 1)
// that the caller takes from the counter RNG (common/rng.h), so a sample can be replayed.
//
//   temperature <= 0: greedy. Returns argmax (the lowest index among ties); u is unused;
//       *logp_out = log softmax(logits)[argmax] (temperature 1).
//   temperature > 0: the sampling distribution is
//       p = softmax(logits / temperature), then, if top_p < 1, restricted to the nucleus and
//       renormalised. The nucleus is the smallest set of highest-p tokens (ordered by p
//       descending, ties by lower index first) whose mass is >= top_p (always >= 1 token).
//       The token is found by inverse CDF: walk the candidates (token order 0..V−1 when
//       top_p >= 1, nucleus order when top_p < 1) and return the first whose cumulative
//       mass exceeds u · (total mass).
//       *logp_out = log of the probability of the returned token under that distribution,
//       i.e. log(softmax(logits/temperature)_i / nucleus mass).
//
// This *logp_out is the behaviour log-prob the learner compares with its own log π(token)
// (at temperature 1, without top-p): they agree only when temperature = 1 and top_p = 1.
// logp_out nullable. With top_p < 1 the call allocates a V-int scratch (freed before
// return). Returns −1 only if V <= 0.
int mtrl_ref_sample_logits(int V, const real *logits, real temperature, real top_p, double u,
                  real *logp_out);

// ---- optimizer -----------------------------------------------------------------------------

// AdamW with decoupled weight decay and bias correction (Loshchilov & Hutter; PyTorch AdamW):
//     m ← β1 m + (1−β1) g;   v ← β2 v + (1−β2) g²
//     m̂ = m / (1 − β1^step);  v̂ = v / (1 − β2^step)
//     param ← param − lr (m̂ / (√v̂ + eps) + weight_decay · param)
// step counts from 1 (the first update uses step = 1). param, grad, m, v [n]; m, v start at 0.
void mtrl_ref_adamw_update(size_t n, real *param, const real *grad, real *m, real *v, real lr,
                  real beta1, real beta2, real eps, real weight_decay, long step);
// Σ g² accumulated in double over fixed-size blocks summed in order (thread-count
// independent), for global-norm clipping: scale = min(1, max_norm / sqrt(Σ over tensors)).
double mtrl_ref_grad_sq_norm(size_t n, const real *grad);
// x *= s.
void mtrl_ref_scale_inplace(size_t n, real *x, real s);

#ifdef __cplusplus
}
#endif

#endif
