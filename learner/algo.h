// algo.h: RL algorithm math: group-relative advantages, the per-token policy losses with their
// gradient, importance correction against the actor's log-probs, and mismatch reports.
//
// Pure computation over plain arrays, shared by the learner, `mtrl replay` and the tests: no
// allocation, no globals, no I/O, double precision inside. Token arrays are f32 (what the
// model's log-softmax and the trajectory wire carry); per-episode rewards and advantages are
// f64. Each function states its formula; where published variants disagree, the choice is stated here.
//
// ---- shapes -----------------------------------------------------------------------------------
//     G        episodes in one group (same task and seed group)
//     N        episodes in one loss call ("sequences"); episode i owns tokens [off[i], off[i+1])
//     T        tokens in one call, T = off[N]; every token of the episode, prompt and tool
//              tokens included, so positions line up with the trajectory
//     M_t      loss mask: 1 for tokens the policy sampled (MTRL_TOK_MODEL), 0 otherwise
//     n_i      Σ_{t in i} M_t, the model tokens of episode i
//
// ---- the step, as the learner runs it ---------------------------------------------------------
//     for each group: mtrl_algo_advantages(cfg.advantage, rewards, G, adv_ep)
//     mtrl_algo_advantages_broadcast(adv_ep, off, N, adv_tok)     episode Â onto its tokens
//     forward over every segment of every episode -> logp[T] (and entropy[T])
//     mtrl_algo_policy_loss(&cfg, &batch, &loss, dlogp, dentropy, &stats)
//     segmented backward, seeding each token's log-prob with dlogp[t] (entropy with dentropy[t])
// The loss needs the log-probs of every token of an episode before any gradient is known (the
// GSPO sequence ratio, the seq_mask decision and the seq_mean denominators are whole-episode
// quantities), so a call must hold whole episodes; a 1M-token episode costs 4 MiB per array.
//
// ---- which log-prob is π_old ------------------------------------------------------------------
// Three log-probs per token: logp (learner, current weights; the only one differentiated),
// logp_old (π_old of the PPO/CISPO/GSPO ratio) and logp_behav (the actor's, from the
// trajectory). logp_old and logp_behav are constants (stop-gradient) even when they alias logp.
//   * What our learner passes: logp_old = logp_behav (the same pointer), because the async
//     learner has no separate proximal policy. The ratio r = π_θ/π_behav then holds both the
//     staleness and the train/inference numerical mismatch, the clip bounds both, and the
//     correction is a no-op: the TIS weight is exactly 1 and seq_mask never drops (its ratio is
//     1, inside any [low <= 1 <= high]). correction = tis (the config default) changes nothing
//     in this mode; the mismatch statistics are still measured against logp_behav.
//   * logp_old = a recomputed proximal log-prob (decoupled PPO, AReaL), or logp itself when the
//     learner takes one optimizer step per batch and so is its own proximal policy (verl and
//     slime with recomputed old log-probs: r = 1 and only the correction sees the mismatch).
//     Then w_t = π_old/π_behav is the off-policy weight and tis/seq_mask do their job.
//
// ---- the per-token loss -----------------------------------------------------------------------
// ratio   ppo, cispo:  r_t = exp(logp_t - logp_old_t)
//         gspo:        s_i = exp(Σ_t M_t (logp_t - logp_old_t) / n_i), the same for every token
//                      of episode i (slime compute_gspo_kl)
// clipped term for a ratio x and advantage A (ppo on r_t, gspo on s_i):
//         ℓ = -min(x A, clip(x, 1-eps_low, 1+eps_high) A)
//         and, when A < 0 and dual_clip = c > 0:  ℓ = min(ℓ, -c A)   (c must exceed 1)
//         ppo: dℓ/dlogp_t = -A r_t when the unclipped branch is taken, else 0.
//         gspo: the gradient reaches every model token u of the episode through s_i:
//               dL/dlogp_u = (s_i / n_i) Σ_{t in i} a_t w_t (-A_t) [t unclipped]
// cispo   ℓ_t = -sg(clip(r_t, 1-eps_low, 1+eps_high)) A_t logp_t  (MiniMax-M1)
//         dℓ/dlogp_t = -clip(r_t) A_t: the gradient never vanishes, clipped or not. The loss
//         VALUE is this surrogate (it depends on logp_t itself), not a PPO-like objective.
// Tokens with A_t = 0 contribute 0 and no gradient (no 0 * inf).
//
// ---- importance correction (constant weights w_t, stop-gradient) ------------------------------
//     none      w_t = 1
//     tis       w_t = min(exp(logp_old_t - logp_behav_t), tis_cap)     (slime vanilla TIS; no
//               lower clamp). ℓ_t <- w_t ℓ_t. With logp_old == logp_behav, w_t = 1.
//     seq_mask  w_t = 0 for every token of episode i when the geometric-mean ratio
//               exp(Σ_t M_t (logp_old_t - logp_behav_t) / n_i) is outside [seq_mask_low,
//               seq_mask_high] (bounds included), else 1.
// token mask (IcePop-style, on top of any correction; token_mask = 1): w_t = 0 for a model token
//               whose ratio k_t = exp(logp_old_t - logp_behav_t) is outside [token_mask_low,
//               token_mask_high] (bounds included; NaN is outside), or, with token_mask_stale
//               = s > 0 and batch.stale given, whose weights are more than s versions behind
//               the learner's. TIS truncates a large ratio and keeps the token; the mask drops
//               it: a token the actor sampled at a probability the learner disagrees with by
//               more than the bounds (numerical mismatch of long contexts, or weights many
//               versions old in an episode that spans them) gives a gradient of the wrong
//               policy whose size the truncation only bounds, while dropping a few such tokens
//               loses little (IcePop: Ring-1T; ratio bounds [0.5, 5] as there). The per-token
//               decision is local, so a 1M-token episode loses only its mismatched tokens,
//               where seq_mask drops it whole.
// A dropped episode or token keeps its place in every denominator (its terms are multiplied by 0, as TRL
// and OpenRLHF do), so dropping cannot inflate the remaining tokens' step size.
//
// ---- aggregation: L_pg = Σ_t a_t w_t ℓ_t with a_t = M_t / D_t ----------------------------------
//     token_mean           D = Σ_all M                     (DAPO; verl token-mean)
//     seq_mean_token_mean  D_t = N · n_i for t in i        (original GRPO; slime default)
//     constant             D = N · agg_constant            (Dr.GRPO, L_const = max length)
// The aggregation applies to every loss. GSPO as published is seq_mean_token_mean (each
// episode counts once); with token_mean an episode's sequence term is weighted by its length.
// Episodes with n_i = 0 add nothing but still count in N. Σ_all M = 0 gives loss 0.
// For data parallelism the caller may replace the local denominators by global ones
// (batch.token_denom, batch.seq_denom); summing the ranks' losses and gradients then gives the
// loss and gradient of the whole batch.
//
// ---- entropy bonus -----------------------------------------------------------------------------
//     L = L_pg - entropy_coef · Σ_t a_t H_t,   dL/dH_t = -entropy_coef · a_t
// The bonus is aggregated like the loss over the model tokens but ignores the correction
// weights: it regularises the current policy, it is not an off-policy estimate.
#ifndef MTRL_ALGO_H
#define MTRL_ALGO_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

// ---- configuration ----------------------------------------------------------------------------

typedef enum mtrl_algo_advantage {
    MTRL_ALGO_ADV_GRPO = 0,    // (R_i - mean) / (std + MTRL_ALGO_GRPO_EPS), population std
    MTRL_ALGO_ADV_DR_GRPO = 1, // R_i - mean
    MTRL_ALGO_ADV_RLOO = 2,    // R_i - mean of the other G-1 = G/(G-1) · (R_i - mean)
} mtrl_algo_advantage;

typedef enum mtrl_algo_loss {
    MTRL_ALGO_LOSS_PPO = 0,
    MTRL_ALGO_LOSS_CISPO = 1,
    MTRL_ALGO_LOSS_GSPO = 2,
} mtrl_algo_loss;

typedef enum mtrl_algo_correction {
    MTRL_ALGO_CORR_NONE = 0,
    MTRL_ALGO_CORR_TIS = 1,
    MTRL_ALGO_CORR_SEQ_MASK = 2,
} mtrl_algo_correction;

typedef enum mtrl_algo_agg {
    MTRL_ALGO_AGG_TOKEN_MEAN = 0,
    MTRL_ALGO_AGG_SEQ_MEAN_TOKEN_MEAN = 1,
    MTRL_ALGO_AGG_CONSTANT = 2,
} mtrl_algo_agg;

// The [algo] section of the config (config_schema.h), typed. Field names match the schema keys.
typedef struct mtrl_algo_config {
    mtrl_algo_advantage advantage;
    mtrl_algo_loss loss;
    mtrl_algo_correction correction;
    mtrl_algo_agg aggregation;
    double eps_low;       // lower clip: ratios below 1 - eps_low are clipped; in [0, 1)
    double eps_high;      // upper clip: 1 + eps_high; eps_high > eps_low is DAPO clip-higher
    double dual_clip;     // c for A < 0: ℓ <= -c A; 0 = off, otherwise > 1
    double tis_cap;       // TIS truncation C > 0
    double seq_mask_low;  // seq_mask bounds on the geometric-mean ratio, 0 <= low <= high
    double seq_mask_high;
    double agg_constant;  // L_const of the constant aggregation, >= 1 (tokens)
    double entropy_coef;  // entropy bonus coefficient (0 = off)
    int token_mask;           // 1: the per-token mask above
    double token_mask_low;    // its ratio bounds, 0 <= low <= 1 <= high < inf
    double token_mask_high;
    long token_mask_stale;    // versions a token may be behind the learner (0 = no limit)
} mtrl_algo_config;

// The schema defaults: grpo, ppo, tis, token_mean, eps 0.2/0.28, dual clip 3, tis_cap 2,
// seq_mask [0.5, 2], agg_constant 1024, entropy_coef 0, token_mask off ([0.5, 5], no age limit).
mtrl_algo_config mtrl_algo_config_default(void);

// Checks ranges and enum values. Returns MTRL_OK, or MTRL_ERR_USAGE with a message in msg
// (cap bytes, NUL-terminated; msg may be NULL) naming the field, e.g.
//     "algo.dual_clip = 0.5: must be 0 (off) or greater than 1"
mtrl_status mtrl_algo_config_check(const mtrl_algo_config *cfg, char *msg, size_t cap);

// Name <-> enum, with the config schema's spellings:
//     advantage   grpo | dr_grpo | rloo
//     loss        ppo | cispo | gspo
//     correction  none | tis | seq_mask
//     aggregation token_mean | seq_mean_token_mean | constant
// The parsers return the enum value, or -1 for an unknown (or NULL) name; names are exact
// (case-sensitive). The name functions return "?" for an out-of-range value.
int mtrl_algo_advantage_parse(const char *name);
int mtrl_algo_loss_parse(const char *name);
int mtrl_algo_correction_parse(const char *name);
int mtrl_algo_agg_parse(const char *name);
const char *mtrl_algo_advantage_name(mtrl_algo_advantage a);
const char *mtrl_algo_loss_name(mtrl_algo_loss l);
const char *mtrl_algo_correction_name(mtrl_algo_correction c);
const char *mtrl_algo_agg_name(mtrl_algo_agg g);

// ---- advantages -------------------------------------------------------------------------------

#define MTRL_ALGO_GRPO_EPS 1e-6

// Group-relative advantages of one group of G episode rewards into adv[G] (adv may alias
// rewards). GRPO divides by the POPULATION std, sqrt(Σ (R_i - mean)^2 / G), plus 1e-6; TRL and
// verl use torch.std (unbiased, G-1), whose advantages are smaller by sqrt((G-1)/G). A group
// whose rewards are all equal gets 0 from every estimator, and G = 1 gives 0 (no baseline to
// compare with; RLOO is undefined there). G = 0 is a no-op.
void mtrl_algo_advantages(mtrl_algo_advantage kind, const double *rewards, size_t G, double *adv);

// adv_tok[t] = adv_ep[i] for every token t of episode i, t in [off[i], off[i+1]) (tokens with
// M = 0 get it too; the mask keeps them out of the loss).
void mtrl_algo_advantages_broadcast(const double *adv_ep, const size_t *off, size_t n_seq, float *adv_tok);

// ---- policy loss ------------------------------------------------------------------------------

// One loss call: whole episodes, arrays borrowed for the duration of the call.
typedef struct mtrl_algo_batch {
    size_t n_seq;             // N episodes
    const size_t *off;        // (N+1) token offsets, off[0] = 0, non-decreasing; T = off[N]
    const float *logp;        // (T) learner log-prob of each token, current weights
    const float *logp_old;    // (T) π_old of the ratio; constant; may alias logp_behav or logp
    const float *logp_behav;  // (T) the actor's behaviour log-prob (trajectory `logprob`)
    const float *adv;         // (T) advantage per token (the episode's Â, broadcast)
    const uint8_t *mask;      // (T) M_t: nonzero = model token
    const float *entropy;     // (T) learner entropy per token, or NULL (required when
                              //     entropy_coef != 0)
    double token_denom;       // > 0: replaces Σ_all M in token_mean (global count over ranks)
    double seq_denom;         // > 0: replaces N in seq_mean_token_mean and constant
    const uint32_t *stale;    // (T) versions between the learner and the weights that sampled
                              //     each token, or NULL (token_mask_stale then does nothing)
} mtrl_algo_batch;

// Statistics of one call. Fractions and means are over this call's model tokens (Σ M); to
// combine calls, weight them by n_tokens.
typedef struct mtrl_algo_stats {
    double loss;              // L (the value also returned through *loss)
    double pg_loss;           // L_pg, the policy term
    double entropy_bonus;     // Σ_t a_t H_t (0 without entropy); L = pg_loss - coef · this
    size_t n_tokens;          // Σ M
    size_t n_seq;             // N
    // ppo and gspo: tokens whose gradient the clip removed: low = A < 0 and x < 1-eps_low,
    // high = A > 0 and x > 1+eps_high, dual = A < 0 and -xA > -cA (x > c). gspo counts every
    // model token of a clipped episode. cispo: tokens whose weight clip(r) was truncated below
    // (low) or above (high), whatever the sign of A; dual is 0. Tokens dropped by seq_mask are
    // never counted as clipped.
    double clip_low_frac;
    double clip_high_frac;
    double dual_clip_frac;
    double ratio_mean;        // mean of the ratio the loss used (r_t; gspo: s_i per token)
    // Mismatch between learner and actor, lr_t = logp_t - logp_behav_t:
    double kl_k1;             // mean(logp_behav - logp) = mean(-lr): unbiased for
                              // KL(behav || learner), tokens being sampled from behav
    double kl_k3;             // mean(e^{-lr} - 1 + lr) >= 0 (slime compute_approx_kl's k3). verl's
                              // rollout_corr k3 is e^{lr} - 1 - lr; both are lr^2/2 + O(lr^3)
    double logp_absdiff_mean; // mean |logp - logp_behav|
    double masked_frac;       // model tokens dropped by seq_mask
    size_t n_seq_masked;      // episodes dropped by seq_mask
    double tis_capped_frac;   // model tokens whose TIS weight hit tis_cap
    double tis_weight_mean;   // mean w_t (1 with correction none; seq_mask: kept fraction)
    double entropy_mean;      // plain mean of H over model tokens (0 without entropy)
    double token_masked_frac; // model tokens dropped by token_mask (ratio or age)
    double token_stale_frac;  // ... of which for their age
} mtrl_algo_stats;

// Computes the loss L (above) into *loss, and, when the pointers are non-NULL, dlogp[t] =
// dL/dlogp_t and dentropy[t] = dL/dH_t for every token (0 where M = 0) and the statistics.
// Returns MTRL_OK; MTRL_ERR_USAGE when cfg fails mtrl_algo_config_check, a required array
// (off, logp, logp_old, logp_behav, adv, mask) is NULL, or entropy is NULL with
// entropy_coef != 0; MTRL_ERR_MISMATCH when off[0] != 0 or off decreases. On error nothing is
// written.
mtrl_status mtrl_algo_policy_loss(const mtrl_algo_config *cfg, const mtrl_algo_batch *batch, double *loss,
                                  float *dlogp, float *dentropy, mtrl_algo_stats *stats);

// ---- mismatch report (learner vs actor log-probs, shared with replay) -------------------------

#define MTRL_ALGO_MISMATCH_BINS 16     // the bin count reports use
#define MTRL_ALGO_MISMATCH_MAX_BINS 64

// Model-token statistics of Δ_t = logp_t - logp_behav_t (lr above) over a range of positions.
typedef struct mtrl_algo_mismatch_bin {
    size_t begin, end;     // positions [begin, end) of the episode
    size_t n;              // model tokens in the range
    double absdiff_mean;   // mean |Δ|      (all four are 0 when n = 0)
    double absdiff_max;    // max |Δ|
    double k1;             // mean(-Δ)
    double k3;             // mean(e^{-Δ} - 1 + Δ)
} mtrl_algo_mismatch_bin;

typedef struct mtrl_algo_mismatch {
    mtrl_algo_mismatch_bin all;                          // the whole episode [0, T)
    size_t n_bins;
    mtrl_algo_mismatch_bin bins[MTRL_ALGO_MISMATCH_MAX_BINS];
    size_t n_worst;                                      // indices written to worst[]
} mtrl_algo_mismatch;

// Mismatch report of one episode of T tokens. Bin b covers positions
// [floor(b·T/n_bins), floor((b+1)·T/n_bins)), so bins differ in size by at most one token and
// are empty only when T < n_bins. worst[0..n_worst) receives the positions of the
// min(n_worst_cap, model tokens) model tokens with the largest |Δ|, largest first, ties to the
// earlier position; a NaN Δ ranks above everything (and makes the means NaN), so a broken token
// is never hidden. worst may be NULL when n_worst_cap = 0. O(T log n_worst_cap), no allocation.
// Returns MTRL_OK, or MTRL_ERR_USAGE when n_bins is 0 or over MTRL_ALGO_MISMATCH_MAX_BINS or a
// required pointer is NULL.
mtrl_status mtrl_algo_mismatch_report(const float *logp, const float *logp_behav, const uint8_t *mask, size_t T,
                                      size_t n_bins, size_t *worst, size_t n_worst_cap, mtrl_algo_mismatch *out);

#endif
