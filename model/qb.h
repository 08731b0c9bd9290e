// qb.h: Quantile Balancing's one owner (docs/model.md §4.3). The router's bias β lives in the
// model (m->qb_beta [L][E], the dense layers' rows unused) outside the gradient path; this module
// decides when it is observed, sends and merges its statistics, and sets it.
//
// Modes, set once when a process opens its model (mtrl_qb_set_mode):
//   MTRL_QB_TRAIN   the learner with [learner] qb on: every training forward computes the β its
//                   batch implies (routed with the OLD β) and sums it; mtrl_qb_apply sets β after
//                   the optimizer step.
//   MTRL_QB_DECODE  an actor with [learner] qb_actor_stats: its decode batches sum the β they
//                   imply; mtrl_qb_export sends the sums to the learner, which mtrl_qb_merge-s
//                   them. The actor's own β only ever comes with the weights.
//   MTRL_QB_FROZEN  everyone else (the learner with qb off, actors, eval, replay): no β is
//                   computed, β never changes. Routing loads (metrics) are counted in every mode
//                   by the training forward.
// β is centred: mtrl_qb_apply makes each layer's β sum to 0 over its experts. The top-k of z − β
// (or s − β) is the same for any common shift, so only differences matter; without centring every
// expert's β drifts together and hides the signal (and could push a sigmoid router into
// saturation).
#ifndef MTRL_QB_H
#define MTRL_QB_H

#include <stdint.h>

struct mtrl_model;

enum { MTRL_QB_TRAIN = 0, MTRL_QB_DECODE = 1, MTRL_QB_FROZEN = 2 };

void mtrl_qb_set_mode(struct mtrl_model *m, int mode);
int mtrl_qb_mode(const struct mtrl_model *m);

// What a forward records (seg_out.qb_stats, model_ws.h): 0 nothing, 1 the routing loads, 2 the
// loads and the β its batch implies. decode: a decode batch (else a training forward).
int mtrl_qb_observe_level(const struct mtrl_model *m, int decode);

// The β sums and batch counts gathered since the last export or apply (sums [L][E], batches [L]),
// then cleared. Returns 1 when any layer has a batch, 0 when there is nothing to send.
int mtrl_qb_export(struct mtrl_model *m, double *sums, uint32_t *batches);

// Adds one batch's β (beta [E], e.g. the mean of what the actors sent) to MoE layer `layer`.
void mtrl_qb_merge(struct mtrl_model *m, int layer, const double *beta);

// In MTRL_QB_TRAIN: sets each MoE layer's β to the mean of the β summed this step, centred (sum 0
// over the experts). Call after the optimizer step, so a step never routes with β from its own
// scores. In every mode the step's sums and loads are cleared (read the loads before). Returns
// the number of layers updated.
int mtrl_qb_apply(struct mtrl_model *m);

#endif
