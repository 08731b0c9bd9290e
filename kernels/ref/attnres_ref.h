// attnres_ref.h: CPU reference of one Block Attention Residual site (docs/model.md §6.1, §6.3) and
// of its two-phase, online-softmax evaluation (§6.2).
//
// A site mixes S sources V_0..V_{S-1} (each [N][D]: N tokens, width D) per token with a softmax
// over the sources, driven by one learned pseudo-query w [D] and a key RMSNorm weight gamma [D]:
//     r_i = (mean_d(V_i²) + eps)^(-1/2),  x̂_i = r_i V_i,  z_i = (gamma ⊙ w) · x̂_i,
//     alpha = softmax_i(z),               h = Σ_i alpha_i V_i
// Keys are the RMS-normalised sources, values the raw sources. Sources are passed as an array
// of S pointers so the stack can point at its committed block sums and the partial sum without
// copying. The order of the sources is the caller's (the stack uses blocks b_0..b_n, then the
// partial sum) and fixes the order of every reduction, so results are deterministic.
// Row-major; "+=" outputs accumulate, others are overwritten. The caller owns all arrays; the
// functions allocate only internal scratch. Which sources a site sees, block commits and the
// backward walk over the stack (§6.2-§6.3) are the model's job (model), not this file's.
#ifndef MTRL_ATTNRES_REF_H
#define MTRL_ATTNRES_REF_H

#include "real.h"

#ifdef __cplusplus
extern "C" {
#endif

// ---- one site, direct form (training) ------------------------------------------------------

// h [N][D] overwritten. alpha [N][S] (nullable) receives the softmax weights, saved for the
// backward. Requires S >= 1. With w = 0 every alpha is 1/S and h is the mean of the sources.
void mtrl_ref_attnres_site_fwd(int N, int D, int S, const real *const *V, const real *w,
                      const real *gamma, real eps, real *h, real *alpha);

// Site backward (docs/model.md §6.3), u = gamma ⊙ w:
//     dalpha_i = dh · V_i,   dz_i = alpha_i (dalpha_i − Σ_j alpha_j dalpha_j)
//     dV_i += alpha_i dh + dz_i r_i (u − x̂_i (u · x̂_i) / D)
//     dw += Σ_{t,i} dz_i (gamma ⊙ x̂_i),   dgamma += Σ_{t,i} dz_i (w ⊙ x̂_i)
// dV is an array of S pointers, each [N][D] ACCUMULATED; a NULL entry skips that source. dw,
// dgamma [D] accumulate (each nullable). alpha is the forward's [N][S], or NULL to recompute
// it. The sums over tokens are done in a fixed order (independent of the thread count).
void mtrl_ref_attnres_site_bwd(int N, int D, int S, const real *const *V, const real *w,
                      const real *gamma, real eps, const real *alpha, const real *dh,
                      real *const *dV, real *dw, real *dgamma);

// ---- two-phase evaluation (inference / prefill; docs/model.md §6.2) -----------------------------
//
// Inside a block of the stack the committed block sums b_0..b_{nb-1} are fixed for all P = 2S
// (layers) sites of the block; only the partial sum changes from site to site. So:
//   Phase 1, once per block: normalise each committed block, compute the logits of all P sites
//     at once with one GEMM ([nb·N × D] normalised blocks against the [P × D] queries gamma⊙w),
//     and keep per site and token the online-softmax state
//         m   = max_i z_i,   l = Σ_i exp(z_i − m),   acc = Σ_i exp(z_i − m) V_i.
//   Phase 2, per site as its sublayer runs: merge the partial-sum source p with one
//     online-softmax step and finalise:
//         m' = max(m, z_p),  l' = l e^{m−m'} + e^{z_p−m'},  acc' = acc e^{m−m'} + e^{z_p−m'} V_p,
//         h  = acc' / l'.
// The result equals mtrl_ref_attnres_site_fwd over (b_0, .., b_{nb-1}, p) up to rounding.
//
// State layout, caller-owned, indexed by site so site p's slices are m + p*N, l + p*N and
// acc + p*N*D: m [P][N], l [P][N], acc [P][N][D].

// Phase 1. B: nb >= 1 pointers to the committed blocks (each [N][D]); w, gamma [P][D] (row p =
// site p's pseudo-query and key-norm weight). Writes m, l, acc (overwritten).
void mtrl_ref_attnres_phase1(int N, int D, int nb, const real *const *B, int P, const real *w,
                    const real *gamma, real eps, real *m, real *l, real *acc);

// Phase 2 for one site: m, l, acc are that site's slices from phase 1 (read only, so a site
// can be re-evaluated); Vp [N][D] is the partial-sum source, or NULL when the site has none
// (the first sublayer of a block). w, gamma [D] are the site's. h [N][D] overwritten.
// lse [N] (nullable) receives log Σ_i exp(z_i) over all the site's sources, from which a caller
// recovers any alpha_i = exp(z_i − lse).
void mtrl_ref_attnres_phase2(int N, int D, const real *m, const real *l, const real *acc,
                    const real *Vp, const real *w, const real *gamma, real eps, real *h,
                    real *lse);

#ifdef __cplusplus
}
#endif

#endif
