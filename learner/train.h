// train.h: one optimizer step of the learner, RL or supervised, on committed trajectories.
//
// RL step (docs/architecture.md §3): the episodes of complete groups → group-relative advantages from
// their rewards → learner log-probs and entropies of every token (forward, segmented by
// [learner] segment) → the policy loss of [algo] (learner/algo.h) over MODEL tokens, with
// the behaviour log-probs of the actor for importance correction → backward → AdamW → QB β
// from this batch's routing (after the step) → weight version + 1.
//
// Token j of an episode is predicted at position j − 1, so the model's per-position arrays are
// shifted by one against the trajectory's per-token arrays; the first token (BOS) has none.
// π_old of the ratio is the learner's own log-prob at the start of the step (one optimizer step
// per batch), so the PPO ratio is 1 at the gradient point and the correction weights compare the
// learner with the behaviour policy (decoupled PPO: the behaviour policy corrects, the proximal policy clips).
//
// Both steps are made of per-rank parts (learner/train_rank.h) that the data-parallel step
// (learner/dist_dp.h) runs on each of R ranks.
#ifndef MTRL_LEARNER_TRAIN_H
#define MTRL_LEARNER_TRAIN_H

#include "common/config.h"
#include "model/model.h"
#include "common/traj.h"
#include "env/env_host.h"
#include "learner/algo.h"

typedef struct mtrl_step_stats {
    int episodes, groups;
    long tokens, model_tokens;
    double reward_mean, success_rate;
    double loss, pg_loss, entropy_mean;
    double clip_low, clip_high, clip_dual, ratio_mean, masked_frac;
    double token_masked_frac;                // model tokens dropped by [algo] token_mask
    double kl_k1, kl_k3, logp_absdiff;       // learner vs behaviour, over model tokens
    double grad_norm;
    double staleness_mean, staleness_max;    // versions between a token's and the learner's
    double tool_calls_mean, episode_len_mean;
    double seconds;
    long *loads;                             // caller's [L][E] buffer (nullable): expert loads of the step
    double max_violation[MTRL_MAX_LAYERS];   // per MoE layer, of this step's routing
} mtrl_step_stats;

// [algo] of a config as the algorithm's own struct; MTRL_ERR_USAGE with a message when the
// combination is invalid.
mtrl_status mtrl_train_algo_config(const mtrl_config *cfg, mtrl_algo_config *a, mtrl_error *err);

// One RL step over n finished episodes (COMPLETE or TRUNCATED; grouped by group_id in any
// order). Fills st (set st->loads before the call to receive the expert loads). The model's
// version is incremented.
void mtrl_train_rl_step(mtrl_model *m, const mtrl_config *cfg, const mtrl_algo_config *a, mtrl_traj *const *eps, int n,
                        mtrl_step_stats *st);

// One supervised step (the [warmup] stage): mean negative log-likelihood of the MODEL tokens.
// Returns the loss before the step. The version is incremented.
double mtrl_train_sft_step(mtrl_model *m, const mtrl_config *cfg, mtrl_traj *const *eps, int n, double lr);

// A demonstration episode from env.demo(): the prompt, then each action as the model would
// have written it (tool calls between TOOL_OPEN/TOOL_CLOSE with their observations, the answer
// and EOS), within max_tokens. MTRL_ERR_PLUGIN when the env has no demo.
mtrl_status mtrl_train_demo_episode(mtrl_env *env, uint64_t seed, int max_tokens, mtrl_traj *out, mtrl_error *err);
// The same for a model that takes pictures ([model] image_patch = image_patch > 0): a prompt's
// or observation's picture becomes its tokens (common/image.h) after its text, as the actor
// feeds them, and joins the trajectory's pictures. With image_patch 0 a picture is an error
// (MTRL_ERR_USAGE), as it aborts an actor's episode.
mtrl_status mtrl_train_demo_episode_images(mtrl_env *env, uint64_t seed, int max_tokens, int image_patch,
                                           mtrl_traj *out, mtrl_error *err);
// The same in a chat template's tokens (common/chat.h; NULL or bytes: exactly the above), so
// that a model imported with its own tokenizer ([model] from) can be warmed up on the env's
// demos. Pictures only with the bytes template.
struct mtrl_chat;
mtrl_status mtrl_train_demo_episode_chat(mtrl_env *env, uint64_t seed, int max_tokens, int image_patch,
                                         const struct mtrl_chat *chat, mtrl_traj *out, mtrl_error *err);

#endif
