// moe_ref.h: CPU reference of the sparse-MoE FFN (docs/model.md §4): router, Quantile-Balancing
// (QB) bias, dispatch by expert, grouped SwiGLU experts, combine, and every backward.
//
// This is the oracle the CUDA MoE kernels are compared with and the path the fp64 gradient
// tests run; it is written for clarity and exactness, not speed. Everything is row-major,
// `real` is float or double (kernels/ref/real.h). Shape letters, used in every comment:
//     N tokens, E routed experts, K experts per token (top-k), D model width,
//     I expert intermediate width, R = N*K permuted rows (one per (token, slot) pair).
// Output arrays are overwritten unless the comment says "+=" (then accumulated, so a caller
// can sum gradients over micro-batches). The caller owns every array; the functions allocate
// only internal scratch and free it before returning. Arguments never alias unless stated.
//
// One MoE block, forward (x [N][D] the RMSNorm-ed input, W_r [E][D] the router):
//     z = x W_rᵀ                                  (caller: mtrl_ref_gemm(0,1, N,E,D, 1, x,D, W_r,D, 0, z,E))
//     mtrl_ref_moe_router_fwd(N,E,K, z, beta, softmax, rho, 0, sel, w, s)
//     mtrl_ref_moe_dispatch(N,E,K, sel, offsets, perm_token, pos)
//     mtrl_ref_moe_gather(N,K,D, pos, x, X_perm)
//     mtrl_ref_moe_experts_fwd(E,D,I, offsets, X_perm, W1,W3,W2, u1,u3, Y_perm)
//     mtrl_ref_moe_combine_fwd(N,K,D, pos, w, Y_perm, y)
//     mtrl_ref_moe_swiglu_fwd(N,D,I_s, x, S1,S3,S2, su1,su3, ys);  y += ys      (shared expert(s))
// Backward, given dy [N][D] (dx, dW_r, dW*, dS* accumulate):
//     mtrl_ref_moe_combine_bwd(N,K,D, pos, w, Y_perm, dy, dY_perm, dw)
//     mtrl_ref_moe_experts_bwd(E,D,I, offsets, X_perm, W1,W3,W2, u1,u3, dY_perm, dX_perm, dW1,dW3,dW2)
//     mtrl_ref_moe_scatter_bwd(N,K,D, pos, dX_perm, dx)
//     mtrl_ref_moe_router_bwd(N,E,K, s, sel, w, softmax, rho, dw, dz)
//     mtrl_ref_gemm(1,0, E,D,N, 1, dz,E, x,D, 1, dW_r,D);  mtrl_ref_gemm(0,0, N,D,E, 1, dz,E, W_r,D, 1, dx,D)
//     mtrl_ref_moe_swiglu_bwd(N,D,I_s, x, S1,S3,S2, su1,su3, dy, dxs, dS1,dS3,dS2);  dx += dxs
// Several shared experts are one SwiGLU of intermediate I × n_shared (their rows concatenated).
//
// The QB bias beta [E] only changes which experts are selected (top-k of z − beta, or s − beta);
// it never enters w or y, so it has no gradient (docs/model.md §4.1) and there is no backward for it.
#ifndef MTRL_MOE_REF_H
#define MTRL_MOE_REF_H

#include "real.h"

#ifdef __cplusplus
extern "C" {
#endif

// ---- router ---------------------------------------------------------------------------------

// The router's form, bits of `form` (0: sigmoid scores, selection on z − beta, renormalised):
//   MOE_ROUTER_SOFTMAX       scores s = softmax(z) over all E instead of sigmoid(z)
//   MOE_ROUTER_SELECT_SCORE  the top-K of s − beta instead of z − beta (Kimi Linear / DeepSeek-V3:
//                            their e_score_correction_bias is −beta); QB then runs on s
//   MOE_ROUTER_NO_RENORM     w = rho · s of the chosen experts, not renormalised to sum rho
// (form = 1 is the old score_softmax = 1.)
enum { MOE_ROUTER_SOFTMAX = 1, MOE_ROUTER_SELECT_SCORE = 2, MOE_ROUTER_NO_RENORM = 4 };

// Router forward on logits z [N][E] (computed by the caller as x W_rᵀ, fp32 or better).
// Selection: the K largest of (z − beta) per token (QB on logits, docs/model.md §4.3), or of
// (s − beta) with MOE_ROUTER_SELECT_SCORE; beta [E] may be NULL (no bias). Ties are broken by
// the lower expert id; the K slots of a token are stored in descending selection score, so
// slot 0 is the best expert.
// Scores s = sigmoid(z) (Kimi) or softmax(z) over all E (MOE_ROUTER_SOFTMAX), saved in s [N][E]
// for the backward. Weights over the chosen set E_t:
//     w[t][j] = rho * s[t][e] / (Σ_{e' ∈ E_t} s[t][e'] + 1e-20),   e = sel[t][j]
// or w[t][j] = rho * s[t][e] with MOE_ROUTER_NO_RENORM.
// replay != 0: sel [N][K] is an INPUT (a recorded routing, K distinct ids in [0, E) per token)
// and only s and w are computed; beta is not read. replay = 0: sel is written.
// Requires 1 <= K <= E and finite z.
void mtrl_ref_moe_router_fwd(int N, int E, int K, const real *z, const real *beta, int form,
                    real rho, int replay, int *sel, real *w, real *s);

// Router backward: dw [N][K] → dz [N][E] (overwritten; 0 for unchosen experts with sigmoid).
// With Z = Σ_{chosen} s + 1e-20 (docs/model.md §4.2):
//     ds_f = (ρ/Z)(dw_f − Σ_{e ∈ E_t} dw_e w_e / ρ) for f chosen, 0 otherwise
//     (MOE_ROUTER_NO_RENORM: ds_f = ρ dw_f);
//     sigmoid: dz = ds ⊙ s(1 − s);   softmax: dz = s ⊙ (ds − Σ_e s_e ds_e) over all E.
// s, sel, w are the forward's. The caller then forms dW_r += dzᵀ x and dx += dz W_r.
void mtrl_ref_moe_router_bwd(int N, int E, int K, const real *s, const int *sel, const real *w,
                    int form, real rho, const real *dw, real *dz);

// ---- dispatch / combine -------------------------------------------------------------------

// Counting sort of the R = N*K (token, slot) pairs by expert, stable in (token, slot) order, so
// the permutation is a deterministic function of sel alone (docs/model.md §4.2 steps 1-2).
// offsets [E+1]: expert e owns permuted rows offsets[e] .. offsets[e+1]−1, offsets[E] = R.
// perm_token [R]: the token of each permuted row. pos [N][K]: the permuted row of (t, slot),
// i.e. the inverse permutation. Every row 0..R−1 is hit exactly once.
void mtrl_ref_moe_dispatch(int N, int E, int K, const int *sel, int *offsets, int *perm_token, int *pos);

// X_perm [R][D]: X_perm[pos[t][j]] = x[t] for every slot j (x [N][D]).
void mtrl_ref_moe_gather(int N, int K, int D, const int *pos, const real *x, real *X_perm);

// y [N][D] (overwritten): y_t = Σ_j w[t][j] Y_perm[pos[t][j]], summed in slot order j = 0..K−1
// (a gather, not a scatter-add, so the result is deterministic; docs/model.md §4.2 step 4).
void mtrl_ref_moe_combine_fwd(int N, int K, int D, const int *pos, const real *w, const real *Y_perm,
                     real *y);

// Combine backward (both overwritten): dY_perm[pos[t][j]] = w[t][j] dy_t (every row of the
// R-row dY_perm is written once) and dw[t][j] = dy_t · Y_perm[pos[t][j]].
void mtrl_ref_moe_combine_bwd(int N, int K, int D, const int *pos, const real *w, const real *Y_perm,
                     const real *dy, real *dY_perm, real *dw);

// Gather backward: dx_t += Σ_j dX_perm[pos[t][j]] (dx [N][D] accumulated, slot order fixed).
void mtrl_ref_moe_scatter_bwd(int N, int K, int D, const int *pos, const real *dX_perm, real *dx);

// ---- experts --------------------------------------------------------------------------------

// Grouped SwiGLU over the permuted rows X_perm [R][D], R = offsets[E], expert e on its segment:
//     u1 = X W1[e]ᵀ, u3 = X W3[e]ᵀ   (W1, W3: [E][I][D]),   m = SiLU(u1) ⊙ u3,
//     Y  = m W2[e]ᵀ                  (W2: [E][D][I]).
// Saves u1, u3 [R][I] for the backward; Y_perm [R][D] overwritten. An expert with no rows is
// skipped. Parallel over experts (OpenMP); each product is one mtrl_ref_gemm call.
void mtrl_ref_moe_experts_fwd(int E, int D, int I, const int *offsets, const real *X_perm,
                     const real *W1, const real *W3, const real *W2, real *u1, real *u3,
                     real *Y_perm);

// Grouped SwiGLU backward (docs/model.md §1): dX_perm [R][D] overwritten; dW1, dW3 [E][I][D] and
// dW2 [E][D][I] +=. Any of dW1, dW3, dW2 may be NULL to skip that weight's gradient (frozen
// weights). An expert with no rows leaves its weight gradients untouched.
void mtrl_ref_moe_experts_bwd(int E, int D, int I, const int *offsets, const real *X_perm,
                     const real *W1, const real *W3, const real *W2, const real *u1,
                     const real *u3, const real *dY_perm, real *dX_perm, real *dW1, real *dW3,
                     real *dW2);

// Dense SwiGLU on all N rows (the shared expert, or a dense FFN): the E = 1 case of the grouped
// functions above. W1, W3 [I][D], W2 [D][I]; u1, u3 [N][I] saved; y [N][D] overwritten.
void mtrl_ref_moe_swiglu_fwd(int N, int D, int I, const real *x, const real *W1, const real *W3,
                    const real *W2, real *u1, real *u3, real *y);
// dx [N][D] overwritten; dW1, dW3, dW2 += (each nullable).
void mtrl_ref_moe_swiglu_bwd(int N, int D, int I, const real *x, const real *W1, const real *W3,
                    const real *W2, const real *u1, const real *u3, const real *dy, real *dx,
                    real *dW1, real *dW3, real *dW2);

// ---- load statistics and Quantile Balancing ------------------------------------------------

// load [E] (overwritten): how many of the N*K slots went to each expert.
void mtrl_ref_moe_load_count(int N, int E, int K, const int *sel, int *load);

// Max violation of a routing: max_e load_e / (total_slots / E) − 1 (0 = perfectly balanced;
// total_slots = N*K). Returns 0 when total_slots <= 0.
double mtrl_ref_moe_max_violation(int E, const int *load, long total_slots);

// One practical-form QB iteration (docs/model.md §4.3) on this batch's router logits z [N][E], or
// whatever the router selected on (its scores s with MOE_ROUTER_SELECT_SCORE): the same scores:
//     alpha_i    = (K+1)-th largest over experts of (z_ij − beta_old_j)
//     beta_new_j = (⌊N K / E⌋ + 1)-th largest over tokens of (z_ij − alpha_i)
// beta_new [E] is SET (no step size). beta_old may be NULL (zeros). beta_new may alias beta_old
// (every alpha is computed before beta_new is written). Column and row selection are
// quickselects (no full sort); the k-th largest value is unique, so the result does not depend
// on the algorithm or the thread count. Requires finite z.
// Returns 0, or 1 when the update is skipped and beta_new = beta_old: ⌊NK/E⌋ = 0 (tiny batch),
// ⌊NK/E⌋ + 1 > N, or K >= E (every expert is chosen; nothing to balance).
//
// Caller's contract (not done here):
//   * Order: route step t with the OLD beta (mtrl_ref_moe_router_fwd), and only then call this on the
//     same z; the new beta is used from step t+1 on. Updating first leaks the batch into its
//     own routing and breaks train/inference consistency.
//   * Large or distributed batches: call this per micro-batch or rank and average the
//     resulting betas (plain mean, no EMA by default) before storing them for the next step.
//   * Eval / inference: beta is frozen; never call this.
//   * A common shift of beta changes no routing (top-k is shift invariant), so recentering
//     (subtracting the mean over experts) is allowed and harmless.
int mtrl_ref_qb_beta_from_batch(int N, int E, int K, const real *z, const real *beta_old, real *beta_new);

#ifdef __cplusplus
}
#endif

#endif
