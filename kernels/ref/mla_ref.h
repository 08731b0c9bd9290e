// mla_ref.h: causal attention and the gated-MLA latent algebra of the CPU reference
// (docs/model.md §3: NoPE multi-head latent attention, expanded and absorbed forms).
//
// What it is: one causal softmax attention, general over H query heads and Hk key heads,
// that serves both forms of the MLA layer, plus the projections between them:
//
//   expanded (§3.1):  k_h = [W_UK,h ĉ ; k^r], v_h = W_UV,h ĉ, attention with Hk = H, Dk = dn+dr.
//   absorbed (§3.3):  q̃_h = [W_UK,hᵀ q^n_h ; q^r_h]; MQA (Hk = 1) over the latent
//                     L_s = [ĉ_s ; k^r_s] (dc+dr = 576 wide), whose first dc dims are also the
//                     value; then a_h = W_UV,h ĉ*_h.
//
// Both give the same a (exactly, in exact arithmetic: q^n·(W_UK ĉ) = (W_UKᵀ q^n)·ĉ and NoPE puts
// nothing position-dependent between). A long episode keeps only the 576-wide latent per token;
// the model decodes (and prefills) in the absorbed form, and trains in the expanded ("naive")
// one by default, expanding every key so far from the latents per segment ([model] mla_train:
// 2 (dn+dr+dv) instead of 2 (dc+dr+dc) FLOPs per query-key pair and head, 3.4x fewer at
// small's widths), or absorbed (mla_train = absorbed). The tests compare the two (invariant I4).
//
// Shapes and symbols: Tq query rows, Tk key rows, H query heads, Hk key heads (H % Hk == 0;
// query head h reads key head h / (H/Hk)), Dk key width, Dv value width; MLA: dn (nope), dr
// (the un-rotated "rope" slice), dv, dc (kv_lora_rank). W_kvb [H*(dn+dv)][dc]: for head h,
// rows h*(dn+dv) .. +dn are W_UK,h [dn][dc], the next dv rows are W_UV,h [dv][dc].
// Everything is row-major; outputs overwritten unless marked "+=". Caller owns all buffers;
// scratch is allocated per call and freed before return. Every product is mtrl_ref_gemm.
// The attention is flash-style: it never holds more than a (row block × key block) tile of
// scores; the backward recomputes them from the saved log-sum-exp. OpenMP parallel over
// (head, row block) and (key block, key head); results do not depend on the thread count.
#ifndef MTRL_MLA_REF_H
#define MTRL_MLA_REF_H

#include "kernels/ref/real.h"

#ifdef __cplusplus
extern "C" {
#endif

// ---- causal attention ----------------------------------------------------------------------
//
// q [Tq][H][Dk]. Key of token s for key head j at k + s*ldk + j*Dk; its value at
// v + s*ldv + j*Dv (v may alias k: the absorbed form passes v = k, ldv = ldk, Dv = dc < Dk).
// Query row i sits at absolute position Tk − Tq + i (Tq <= Tk) and sees keys 0..that
// position, so a segment of Tq new tokens attends to the whole prefix.
// One sequence per call (a packed batch: the varlen forms below, the mask restarting per piece).
// o [Tq][H][Dv]; lse [Tq][H]: log Σ_s exp(scale q·k_s), saved for the backward.
void mtrl_ref_attn_causal_fwd(int Tq, int Tk, int H, int Hk, int Dk, int Dv, real scale, const real *q,
                     const real *k, int ldk, const real *v, int ldv, real *o, real *lse);

// dq [Tq][H][Dk] overwritten. dk, dv ACCUMULATED (+=) with the same strides as k, v, so the
// segments of an episode accumulate into whole-episode latent gradients; dk and dv may alias
// exactly as k and v do (the absorbed form: dv = dk, same ld). o and lse are the forward's.
void mtrl_ref_attn_causal_bwd(int Tq, int Tk, int H, int Hk, int Dk, int Dv, real scale, const real *q,
                     const real *k, int ldk, const real *v, int ldv, const real *o,
                     const real *lse, const real *dout, real *dq, real *dk, real *dv);

// n packed pieces in one call (the cu_seqlens form of a packed segment, model_ws.h): piece i's
// queries are rows qoffs[i] .. qoffs[i+1]-1 of q, o, lse (and dq, dout), its keys rows
// koffs[i] .. koffs[i+1]-1 of k, v (and dk, dv); koffs NULL: the same rows as its queries (a
// pack of sequences from the zero state, whose keys are their own rows). Each piece attends
// causally to its own keys only, as mtrl_ref_attn_causal_fwd / _bwd called on it alone (Tq_i =
// qoffs[i+1] - qoffs[i] <= Tk_i = koffs[i+1] - koffs[i]; query row r of the piece at position
// Tk_i - Tq_i + r): that is what these do, piece by piece, so the results are those calls' bits.
// Both offset arrays [n + 1], non-decreasing; pieces must not share key rows in the backward
// (dk, dv += per piece).
void mtrl_ref_attn_causal_fwd_varlen(int n, const int *qoffs, const int *koffs, int H, int Hk, int Dk, int Dv,
                                     real scale, const real *q, const real *k, int ldk, const real *v, int ldv,
                                     real *o, real *lse);
void mtrl_ref_attn_causal_bwd_varlen(int n, const int *qoffs, const int *koffs, int H, int Hk, int Dk, int Dv,
                                     real scale, const real *q, const real *k, int ldk, const real *v, int ldv,
                                     const real *o, const real *lse, const real *dout, real *dq, real *dk,
                                     real *dv);

// ---- absorbed <-> expanded helpers (N tokens) -----------------------------------------------

// Absorb the query: qt[t][h] = [ W_UK,hᵀ q^n_{t,h} ; q^r_{t,h} ].
// q [N][H][dn+dr]  ->  qt [N][H][dc+dr].
void mtrl_ref_mla_absorb_q(int N, int H, int dn, int dr, int dv, int dc, const real *q, const real *W_kvb,
                  real *qt);
// Backward: dq [N][H][dn+dr] overwritten; dW_kvb += only in the W_UK rows (nullable: skip).
void mtrl_ref_mla_absorb_q_bwd(int N, int H, int dn, int dr, int dv, int dc, const real *q,
                      const real *W_kvb, const real *dqt, real *dq, real *dW_kvb);

// Value up-projection: a[t][h] = W_UV,h cstar[t][h].  cstar [N][H][dc] -> a [N][H][dv].
void mtrl_ref_mla_up_v(int N, int H, int dn, int dv, int dc, const real *cstar, const real *W_kvb, real *a);
// Backward: dcstar [N][H][dc] overwritten; dW_kvb += only in the W_UV rows (nullable: skip).
void mtrl_ref_mla_up_v_bwd(int N, int H, int dn, int dv, int dc, const real *cstar, const real *W_kvb,
                  const real *da, real *dcstar, real *dW_kvb);

// Expanded keys and values from the latent: k[t][h] = [W_UK,h ĉ_t ; k^r_t],
// v[t][h] = W_UV,h ĉ_t. c: ĉ_t at c + t*ldc (dc wide); kr: k^r_t at kr + t*ldr (dr wide),
// so an interleaved latent [N][dc+dr] passes c = L, kr = L + dc, ldc = ldr = dc+dr.
// k [N][H][dn+dr], v [N][H][dv].
void mtrl_ref_mla_expand_kv(int N, int H, int dn, int dr, int dv, int dc, const real *c, int ldc,
                   const real *kr, int ldr, const real *W_kvb, real *k, real *v);
// Backward, given dk [N][H][dn+dr] and dvals [N][H][dv] (the gradients of k and v):
//     dlat_c  += Σ_h (dk^n_h W_UK,h + dvals_h W_UV,h)   at dlat_c + t*ld_c (dc wide)
//     dlat_kr += Σ_h dk_h[dn:]                          at dlat_kr + t*ld_kr (dr wide)
//     dW_kvb  += the outer products (nullable: skip)
// dlat_c and dlat_kr may be the two parts of one interleaved latent gradient.
void mtrl_ref_mla_expand_kv_bwd(int N, int H, int dn, int dr, int dv, int dc, const real *c, int ldc,
                       const real *W_kvb, const real *dk, const real *dvals, real *dlat_c,
                       int ld_c, real *dlat_kr, int ld_kr, real *dW_kvb);

// ---- absorbed decode (docs/model.md §3.3) ---------------------------------------------------------
//
// One query token against a latent cache of Tk tokens (the token itself included as the last
// cache row): q [H][dn+dr]; cache_c [Tk][dc] (ĉ), cache_kr [Tk][dr] (k^r); a [H][dv], the
// attention output before the output gate and W_o. scale = (dn+dr)^-1/2 in the model.
// Split over fixed key chunks merged in order (thread-count independent results).
void mtrl_ref_mla_decode_absorbed(int H, int dn, int dr, int dv, int dc, real scale, const real *q,
                         const real *W_kvb, const real *cache_c, const real *cache_kr, int Tk,
                         real *a);
// The same with row strides for the cache (an interleaved [Tk][dc+dr] latent cache passes
// cache_c = L, cache_kr = L + dc, ldc = ldr = dc + dr).
void mtrl_ref_mla_decode_absorbed_ld(int H, int dn, int dr, int dv, int dc, real scale, const real *q,
                            const real *W_kvb, const real *cache_c, int ldc,
                            const real *cache_kr, int ldr, int Tk, real *a);

#ifdef __cplusplus
}
#endif

#endif
