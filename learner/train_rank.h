// train_rank.h: the parts of a learner step that each rank runs (learner-internal). train.c
// runs them on one rank over the whole batch (mtrl_train_rl_step, mtrl_train_sft_step);
// learner/dist_dp.c on each of R ranks over its share, so the two paths are one code.
//
// An RL step in parts:
//     mtrl_train_rl_batch_init     the whole batch's per-token arrays, group advantages and
//                                  episode statistics (every rank alike: they come from the
//                                  trajectories alone)
//     mtrl_train_rl_backward       forward, loss and backward of some of its episodes, with the
//                                  WHOLE batch's loss denominators, so the ranks' gradients add
//                                  up to the batch's; their log-probs land in the batch arrays
//     (optimizer)                  one rank: mtrl_model_optimizer_step; DP: the sharded one
//     mtrl_train_rl_stats          loss and statistics over the whole batch's arrays
//     mtrl_train_step_end          loads, QB β, version + 1
#ifndef MTRL_LEARNER_TRAIN_RANK_H
#define MTRL_LEARNER_TRAIN_RANK_H

#include "learner/train.h"

// The AdamW settings of a step: [learner] beta1, beta2, eps, weight_decay, grad_clip, and lr.
typedef struct mtrl_train_adamw {
    real lr, beta1, beta2, eps, weight_decay, clip;
} mtrl_train_adamw;
mtrl_train_adamw mtrl_train_adamw_of(const mtrl_config *cfg, double lr);

// The per-token arrays of an RL step over a batch of n episodes, token j of an episode at
// off[i] + j (the model's position j - 1 predicts it; BOS has none).
typedef struct mtrl_train_rl_batch {
    int n;
    size_t T;                            // Σ tokens
    size_t *off;                         // [n+1]
    float *logp, *logp_old, *behav, *ent, *adv, *dlogp, *dent; // [T+1]
    uint8_t *mask;                       // loss mask: model tokens (DAPO drops truncated episodes)
    uint32_t *stale;                     // versions each masked token is behind the learner
    long n_mask;                         // Σ mask: token_mean's denominator
    double stale_sum;
} mtrl_train_rl_batch;

// The batch arrays of eps[0..n-1] at m's version, advantages by group ([algo] advantage), and
// the episode statistics of st (episodes, groups, tokens, model_tokens, reward and success
// means, tool calls, lengths, staleness_max; st->loads is kept, the rest zeroed).
void mtrl_train_rl_batch_init(mtrl_train_rl_batch *b, const mtrl_model *m, const mtrl_config *cfg,
                              const mtrl_algo_config *a, mtrl_traj *const *eps, int n, mtrl_step_stats *st);
void mtrl_train_rl_batch_free(mtrl_train_rl_batch *b);

// Forward, loss and backward of episodes idx[0..k-1] of b (ascending batch indices; idx NULL:
// all, k = n), unit by unit (model.h mtrl_model_train) with the whole batch's denominators;
// gradients ACCUMULATE into m. Writes their logp, logp_old and ent into b.
void mtrl_train_rl_backward(mtrl_model *m, const mtrl_config *cfg, const mtrl_algo_config *a, mtrl_traj *const *eps,
                            mtrl_train_rl_batch *b, const int *idx, int k);

// The step's loss and statistics (loss, pg_loss, entropy, clip fractions, ratio, masks, KL,
// staleness_mean) over the whole batch: b's logp and ent written for every episode.
void mtrl_train_rl_stats(const mtrl_algo_config *a, mtrl_train_rl_batch *b, mtrl_step_stats *st);

// After the optimizer: with st (nullable) the step's expert loads and load violations read,
// then QB β (model/qb.h) and the version + 1.
void mtrl_train_step_end(mtrl_model *m, mtrl_step_stats *st);

// The supervised step's denominator: the MODEL tokens (after the first) of eps[0..n-1].
size_t mtrl_train_sft_count(mtrl_traj *const *eps, int n);
// Forward and backward of episodes idx[0..k-1] (idx NULL: all) of the mean NLL over `count`
// MODEL tokens; gradients ACCUMULATE. Returns their Σ -logp over MODEL tokens.
double mtrl_train_sft_backward(mtrl_model *m, const mtrl_config *cfg, mtrl_traj *const *eps, const int *idx, int k,
                               size_t count);

#endif
