// model_moe.h: one MoE layer of the backbone in phases (docs/model.md §4), so that its routed
// experts can run somewhere else between the routing and the combine: expert parallel
// (learner/dist_ep_moe.h) sends each expert's rows to the rank that owns the expert. The
// model's own FFN (model_fwd.c ffn_forward_, model_bwd.c ffn_backward_) is these phases back to
// back on every expert (mtrl_model_moe_layer_fwd / _bwd), so a layer split over ranks routes,
// runs its experts, combines and differentiates with the same functions, on the same kernels,
// as one rank. (The mtrl_moe_* names are the CUDA kernels', kernels/cuda/kernels_cuda.h.)
//
// Forward of MoE layer l on T rows x [T][d] (the FFN's RMSNorm-ed input), mtrl_model_moe_...:
//     route_fwd     router logits, top-k of z − β (or a replayed routing, R3), the T K rows
//                   (token x chosen expert) grouped by expert: r->X, r->offsets
//     observe       the QB statistics of the batch (loads, the β it implies)
//     experts_fwd   experts e0 .. e1−1 on their rows (all E for one rank)
//     combine_fwd   y = Σ_j w_j Y[row of (t, j)] + the shared experts of x
// Backward, given dy [T][d] (parameter gradients accumulate into m->dG):
//     combine_bwd   dY [T K][d], dw [T][K]
//     experts_bwd   dX of the rows of experts e0 .. e1−1; their dW1, dW3, dW2 +=
//     route_bwd     dx = the rows' dX gathered back + the router's + the shared experts'
// Arrays are the model's backend memory (backend.h) unless named _h; shapes: E experts, K =
// top_k, I = the expert width, d = d_model. Not part of the public API (model.h): the model's
// FFN and the expert-parallel layer are its only users.
#ifndef MTRL_MODEL_MOE_H
#define MTRL_MODEL_MOE_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/ref/real.h"
#include "model/model.h"

// One MoE layer's arrays for T tokens: what the forward computes and the backward reads.
typedef struct mtrl_model_moe_rows {
    real *z, *s;            // [T][E] router logits, scores
    real *w;                // [T][K] combine weights
    int *sel;               // [T][K] chosen experts (slot 0 the best)
    int *offsets;           // [E+1] expert e's rows: offsets[e] .. offsets[e+1]−1
    int *perm, *pos;        // [T K] the token of each row; the row of each (token, slot)
    real *X, *u1, *u3, *Y;  // [T K][d], [T K][I] x2, [T K][d]: rows grouped by expert, the
                            // experts' saved activations and outputs
    real *su1, *su3;        // [T][n_shared I] the shared experts' activations (n_shared > 0)
} mtrl_model_moe_rows;

// Carves r's arrays for T tokens, in the order (and sizes) model_fwd.c's arena accounting
// mirrors: z, s, w, sel, offsets, perm, pos, X, u1, u3, Y, then su1, su3 when the layer has
// shared experts. alloc(user, bytes) returns backend memory.
void mtrl_model_moe_rows_carve(const mtrl_model_dims *d, int T, void *(*alloc)(void *user, size_t bytes), void *user,
                               mtrl_model_moe_rows *r);

// ---- forward -------------------------------------------------------------------------------------

// Routes T rows x of MoE layer l: z = x W_rᵀ, the top-K of z − β (β the model's m->d_qb_beta of
// layer l; s − β with router_bias = score), the scores and weights; then the rows grouped by
// expert (a stable counting sort: within an expert, token order) into r->X. routing_in
// (nullable, host, [T][n_moe][K] as seg_out carries it): the recorded routing to replay instead
// of choosing (routing replay, R3: β is not read). routing_out (nullable, host, same layout):
// the routing written back.
void mtrl_model_moe_route_fwd(mtrl_model *m, int l, int T, const real *x, const uint8_t *routing_in,
                              uint8_t *routing_out, mtrl_model_moe_rows *r);

// The QB statistics of layer l's routed batch (docs/model.md §4.3) as one vector st
// [MTRL_MODEL_MOE_STATS(E)] = loads [E] (slots per expert), β sums [E], batches [1]: with level >= 2
// and a batch large enough, the β it implies (routed with the old β) and 1 batch, else zeros.
// fp64, so that a sum over ranks (one all-reduce) stays exact for the loads.
#define MTRL_MODEL_MOE_STATS(E) (2 * (E) + 1)
void mtrl_model_moe_observe(mtrl_model *m, int l, int T, const mtrl_model_moe_rows *r, int level, double *st);
// Adds st (one batch's, or the sum over ranks) to the step's counters of layer l (m->load,
// m->qb_sum, m->qb_count), which mtrl_qb_apply reads (qb.h).
void mtrl_model_moe_observe_add(mtrl_model *m, int l, const double *st);

// The routed experts e0 .. e1−1 of layer l (their rows of the model's ew1 / ew3 / ew2) on
// `rows` rows X [rows][d] grouped by expert: offsets [e1−e0+1] (backend memory, offsets[0] = 0,
// offsets[e1−e0] = rows). Saves u1, u3 [rows][I]; Y [rows][d] overwritten. Each row's output is
// a function of the row and its expert alone.
void mtrl_model_moe_experts_fwd(mtrl_model *m, int l, int e0, int e1, int rows, const int *offsets, const real *X,
                                real *u1, real *u3, real *Y);

// y [T][d] (overwritten) = the combine of r->Y with r->w, plus the shared experts of x (their
// activations saved in r->su1 / su3; ys [T][d] their output, scratch; unused without them).
void mtrl_model_moe_combine_fwd(mtrl_model *m, int l, int T, const real *x, mtrl_model_moe_rows *r, real *ys, real *y);

// The whole layer on one rank, every expert here: route, observe (level > 0: the statistics
// added to the model's counters), experts, combine. r's arrays and the scratch come from ar.
// What model_fwd.c runs for a MoE layer of a training or prefill segment.
void mtrl_model_moe_layer_fwd(mtrl_model *m, mtrl_arena *ar, int l, int T, const real *x, const uint8_t *routing_in,
                              uint8_t *routing_out, int level, mtrl_model_moe_rows *r, real *y);

// ---- backward ------------------------------------------------------------------------------------

// dY [T K][d] (every row written) and dw [T][K] of the combine, given dy [T][d].
void mtrl_model_moe_combine_bwd(mtrl_model *m, int l, int T, const mtrl_model_moe_rows *r, const real *dy, real *dY,
                                real *dw);
// The backward of mtrl_model_moe_experts_fwd: dX [rows][d] overwritten; the gradients of experts
// e0 .. e1−1 (their rows of m->dG's ew1 / ew3 / ew2) +=, nothing else of m->dG touched.
void mtrl_model_moe_experts_bwd(mtrl_model *m, int l, int e0, int e1, const int *offsets, const real *X, const real *u1,
                                const real *u3, const real *dY, real *dX);
// dx [T][d] (overwritten) = Σ_j dX[row of (t, j)] + the router's (through dw) + the shared
// experts' (through dy); the router's and shared experts' weight gradients +=. Scratch: dz
// [T][E], dxs [T][d] (unused without shared experts).
void mtrl_model_moe_route_bwd(mtrl_model *m, int l, int T, const real *x, const mtrl_model_moe_rows *r, const real *dy,
                              const real *dX, const real *dw, real *dz, real *dxs, real *dx);
// The whole layer's backward on one rank (the scratch from ar): what model_bwd.c runs.
void mtrl_model_moe_layer_bwd(mtrl_model *m, mtrl_arena *ar, int l, int T, const real *x, const mtrl_model_moe_rows *r,
                              const real *dy, real *dx);

#endif
