// train.c: the learner's optimizer steps (see train.h).
#include "learner/train.h"
#include "learner/train_rank.h"
#include "model/qb.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/chat.h"
#include "common/check.h"
#include "common/image.h"
#include "common/log.h"
#include "model/model_plan.h"
#include "common/timeutil.h"
#include "common/tokenizer.h"

mtrl_status mtrl_train_algo_config(const mtrl_config *cfg, mtrl_algo_config *a, mtrl_error *err) {
    *a = mtrl_algo_config_default();
    a->advantage = (mtrl_algo_advantage)mtrl_algo_advantage_parse(cfg->algo.advantage);
    a->loss = (mtrl_algo_loss)mtrl_algo_loss_parse(cfg->algo.loss);
    a->correction = (mtrl_algo_correction)mtrl_algo_correction_parse(cfg->algo.correction);
    a->aggregation = (mtrl_algo_agg)mtrl_algo_agg_parse(cfg->algo.aggregation);
    a->eps_low = cfg->algo.eps_low;
    a->eps_high = cfg->algo.eps_high;
    a->dual_clip = cfg->algo.dual_clip;
    a->tis_cap = cfg->algo.tis_cap;
    a->seq_mask_low = cfg->algo.seq_mask_low;
    a->seq_mask_high = cfg->algo.seq_mask_high;
    a->agg_constant = (double)cfg->algo.agg_constant;
    a->entropy_coef = cfg->algo.entropy_coef;
    a->token_mask = cfg->algo.token_mask;
    a->token_mask_low = cfg->algo.token_mask_low;
    a->token_mask_high = cfg->algo.token_mask_high;
    a->token_mask_stale = cfg->algo.token_mask_stale;
    char msg[512];
    if (mtrl_algo_config_check(a, msg, sizeof msg) != MTRL_OK)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "%s: [algo]: %s", cfg->path, msg);
    return MTRL_OK;
}

// The batch of sequences the model sees: each episode's token ids.
typedef struct seq_batch {
    mtrl_batch b;
    const uint32_t **toks;
    const uint8_t **routing;
    int *len;
    size_t total;
    uint8_t *ptab;   // the batch's patch table: every episode's pictures, one after the other
    uint32_t **moved; // [n] an episode's ids with its patch tokens moved to its rows (NULL: as they are)
} seq_batch;

// The model's view of the episodes. Routing replay (R3): when every episode carries the
// actor's routing with the model's width, the learner's forward and backward use it.
static void seq_batch_init_(seq_batch *s, mtrl_traj *const *eps, int n, mtrl_model *m) {
    s->toks = xmalloc(sizeof(*s->toks) * (size_t)(n ? n : 1));
    s->routing = xmalloc(sizeof(*s->routing) * (size_t)(n ? n : 1));
    s->len = xmalloc(sizeof(int) * (size_t)(n ? n : 1));
    s->total = 0;
    int all_routed = n > 0;
    uint32_t width = (uint32_t)(m->dims.n_moe * m->dims.k);
    for (int i = 0; i < n; i++) {
        s->toks[i] = eps[i]->ids;
        s->routing[i] = eps[i]->routing;
        all_routed &= eps[i]->routing_width == width && !(eps[i]->flags & MTRL_TRAJ_ROUTING_U16) && eps[i]->routing;
        s->len[i] = (int)eps[i]->n_tokens;
        s->total += eps[i]->n_tokens;
    }
    s->b = (mtrl_batch){n, s->toks, s->len, all_routed ? s->routing : NULL};
    // Pictures (docs/multimodal.md): each episode's patch tokens name its own table; the model
    // sees one for the batch, so an episode's rows start after the earlier episodes' and a copy
    // of its ids is moved by that much.
    s->ptab = NULL;
    s->moved = NULL;
    mtrl_model_set_patches(m, NULL, 0);
    size_t rows = 0;
    int P = m->dims.image_patch;
    for (int i = 0; i < n; i++) rows += eps[i]->n_images ? mtrl_traj_patch_rows(eps[i]) : 0;
    if (!rows || P <= 0) return;
    size_t pb = (size_t)3 * P * P, at = 0;
    s->ptab = xmalloc(rows * pb);
    s->moved = xcalloc((size_t)n, sizeof *s->moved);
    for (int i = 0; i < n; i++) {
        const mtrl_traj *t = eps[i];
        if (!t->n_images) continue;
        MTRL_CHECKF(t->image_patch == (uint32_t)P, "episode %llu: pictures cut with patch %u, the model's is %d",
                    (unsigned long long)t->episode_id, t->image_patch, P);
        mtrl_traj_patch_table(t, s->ptab + at * pb);
        if (at) {
            uint32_t *c = xmalloc(sizeof(uint32_t) * (size_t)t->n_tokens + 1);
            for (uint64_t j = 0; j < t->n_tokens; j++)
                c[j] = mtrl_img_token_is_patch(t->ids[j]) ? t->ids[j] + (uint32_t)at : t->ids[j];
            s->moved[i] = c;
            s->toks[i] = c;
        }
        at += mtrl_traj_patch_rows(t);
    }
    mtrl_model_set_patches(m, s->ptab, (int)rows);
}

static void seq_batch_free_(seq_batch *s) {
    if (s->moved)
        for (int i = 0; i < s->b.n; i++) free(s->moved[i]);
    free(s->moved);
    free(s->ptab);
    free(s->toks);
    free(s->routing);
    free(s->len);
}

// The segment length of a step: [learner] segment through the planner's resolver
// (model/model_plan.h mtrl_model_segment_resolve; model.h: each unit's backward follows
// its forward, so only episodes longer than a segment are recomputed). A batch that fits at no
// segment stops the learner with the planner's message.
static int segment_of_(const mtrl_model *m, const mtrl_config *cfg, const mtrl_batch *b) {
    mtrl_model_plan p = {0};
    mtrl_error err;
    int seg = 0;
    mtrl_status st = mtrl_model_segment_resolve(m, b, mtrl_config_segment(cfg), &seg, &p, &err);
    MTRL_CHECKF(st == MTRL_OK, "learner: %s (set [learner] segment, or fewer or shorter episodes per step)", err.msg);
    if (p.seqs && seg > 0 && seg < p.tokens)
        LOG_DEBUG("learner: segment %d for %d episodes of up to %ld tokens (planned %.2f GiB of %.2f GiB)", seg, p.seqs,
                  p.tokens, (double)p.total / (1 << 30), (double)p.budget / (1 << 30));
    return seg;
}

mtrl_train_adamw mtrl_train_adamw_of(const mtrl_config *cfg, double lr) {
    return (mtrl_train_adamw){(real)lr, (real)cfg->learner.beta1, (real)cfg->learner.beta2, (real)cfg->learner.eps,
                              (real)cfg->learner.weight_decay, (real)cfg->learner.grad_clip};
}

// The episodes eps[idx[0..k-1]] (idx NULL: the first k) as an array of their own.
static mtrl_traj **episodes_of_(mtrl_traj *const *eps, const int *idx, int k) {
    mtrl_traj **sub = xmalloc(sizeof *sub * (size_t)(k ? k : 1));
    for (int j = 0; j < k; j++) sub[j] = eps[idx ? idx[j] : j];
    return sub;
}

// Arrays for n episodes of T tokens in all, zeroed.
static void rl_batch_alloc_(mtrl_train_rl_batch *b, int n, size_t T) {
    memset(b, 0, sizeof *b);
    b->n = n;
    b->T = T;
    b->off = xcalloc((size_t)n + 1, sizeof(size_t));
    float **f[] = {&b->logp, &b->logp_old, &b->behav, &b->ent, &b->adv, &b->dlogp, &b->dent};
    for (size_t i = 0; i < sizeof f / sizeof *f; i++) *f[i] = xcalloc(T + 1, sizeof(float));
    b->mask = xcalloc(T + 1, 1);
    b->stale = xcalloc(T + 1, sizeof(uint32_t));
}

void mtrl_train_rl_batch_free(mtrl_train_rl_batch *b) {
    free(b->off); free(b->logp); free(b->logp_old); free(b->behav); free(b->ent); free(b->adv); free(b->dlogp);
    free(b->dent); free(b->mask); free(b->stale);
    memset(b, 0, sizeof *b);
}

void mtrl_train_rl_batch_init(mtrl_train_rl_batch *b, const mtrl_model *m, const mtrl_config *cfg,
                              const mtrl_algo_config *a, mtrl_traj *const *eps, int n, mtrl_step_stats *st) {
    long *loads = st->loads;
    memset(st, 0, sizeof *st);
    st->loads = loads;
    size_t T = 0;
    for (int i = 0; i < n; i++) T += eps[i]->n_tokens;
    rl_batch_alloc_(b, n, T);
    double *rew = xmalloc(sizeof(double) * (size_t)(n ? n : 1)), *adv_ep = xmalloc(sizeof(double) * (size_t)(n ? n : 1));
    size_t o = 0;
    for (int i = 0; i < n; i++) {
        const mtrl_traj *t = eps[i];
        b->off[i] = o;
        for (uint64_t j = 0; j < t->n_tokens; j++) {
            b->behav[o + j] = t->logprob[j];
            // Overlong filtering (DAPO): a truncated episode's tokens carry no loss.
            b->mask[o + j] = j > 0 && t->kind[j] == MTRL_TOK_MODEL &&
                             !(cfg->algo.mask_truncated && t->status == MTRL_EP_TRUNCATED);
            if (b->mask[o + j]) {
                double s = (double)m->version - (double)t->version[j];
                b->stale[o + j] = s > 0 ? (uint32_t)s : 0;
                b->stale_sum += s;
                if (s > st->staleness_max) st->staleness_max = s;
                b->n_mask++;
            }
        }
        o += t->n_tokens;
        rew[i] = t->reward;
        st->reward_mean += t->reward;
        st->success_rate += mtrl_traj_success(t);
        st->tool_calls_mean += t->n_tools;
        st->episode_len_mean += (double)t->n_tokens;
        st->model_tokens += (long)t->n_model;
    }
    b->off[n] = o;
    // Group-relative advantages: groups are runs of equal group_id (in any order of arrival).
    int *done = xcalloc((size_t)(n ? n : 1), sizeof(int));
    int *idx = xmalloc(sizeof(int) * (size_t)(n ? n : 1));
    double *gr = xmalloc(sizeof(double) * (size_t)(n ? n : 1)), *ga = xmalloc(sizeof(double) * (size_t)(n ? n : 1));
    for (int i = 0; i < n; i++) {
        if (done[i]) continue;
        int g = 0;
        for (int j = i; j < n; j++)
            if (!done[j] && eps[j]->group_id == eps[i]->group_id) {
                done[j] = 1;
                idx[g] = j;
                gr[g++] = rew[j];
            }
        mtrl_algo_advantages(a->advantage, gr, (size_t)g, ga);
        for (int k = 0; k < g; k++) adv_ep[idx[k]] = ga[k];
        st->groups++;
    }
    mtrl_algo_advantages_broadcast(adv_ep, b->off, (size_t)n, b->adv);
    st->episodes = n;
    st->tokens = (long)T;
    if (n) {
        st->reward_mean /= n;
        st->success_rate /= n;
        st->tool_calls_mean /= n;
        st->episode_len_mean /= n;
    }
    free(rew); free(adv_ep); free(done); free(idx); free(gr); free(ga);
}

// What the loss of one unit of mtrl_model_train needs to run on its episodes alone: the
// arrays of the episodes being trained (laid end to end) and the whole batch's denominators.
typedef struct rl_loss {
    const mtrl_algo_config *a;
    mtrl_train_rl_batch *t;
    double token_denom, seq_denom;      // the whole batch's (algo.h: a unit's loss is its share)
} rl_loss;

// mtrl_model_loss_fn of an RL step: episodes i0 .. i0+n-1 have their log-probs; their share of
// the batch's policy loss gives their dlogp (and dentropy) per position.
static void rl_loss_unit_(void *user, int i0, int n, const real *logp_pos, const real *ent_pos, real *dlp, real *dep) {
    rl_loss *r = user;
    mtrl_train_rl_batch *t = r->t;
    size_t o0 = t->off[i0];
    size_t *loff = xmalloc(sizeof(size_t) * (size_t)(n + 1));
    for (int k = 0; k <= n; k++) loff[k] = t->off[i0 + k] - o0;
    for (int i = i0; i < i0 + n; i++)
        for (size_t j = t->off[i] + 1; j < t->off[i + 1]; j++) {
            t->logp[j] = (float)logp_pos[j - 1];
            t->ent[j] = (float)ent_pos[j - 1];
        }
    // π_old = the learner's own log-prob now (a detached copy).
    memcpy(t->logp_old + o0, t->logp + o0, sizeof(float) * loff[n]);
    mtrl_algo_batch ab = {(size_t)n, loff, t->logp + o0, t->logp_old + o0, t->behav + o0, t->adv + o0, t->mask + o0,
                          t->ent + o0, r->token_denom, r->seq_denom, t->stale + o0};
    mtrl_algo_stats as;
    double loss = 0;
    mtrl_status s = mtrl_algo_policy_loss(r->a, &ab, &loss, t->dlogp + o0, t->dent + o0, &as);
    MTRL_CHECKF(s == MTRL_OK, "policy loss refused a well-formed batch");
    // Back to per-position gradients.
    for (int i = i0; i < i0 + n; i++)
        for (size_t j = t->off[i] + 1; j < t->off[i + 1]; j++) {
            dlp[j - 1] = t->dlogp[j];
            if (dep) dep[j - 1] = t->dent[j];
        }
    free(loff);
}

// Episodes idx[0..k-1] between the whole batch's arrays and part's, where they lie end to end:
// their inputs (behaviour log-probs, advantages, mask, staleness) into part, or (to_whole)
// what their training wrote (logp, logp_old, entropy) back into the whole batch.
static void rl_batch_move_(mtrl_train_rl_batch *part, mtrl_train_rl_batch *whole, const int *idx, int k, int to_whole) {
    for (int j = 0; j < k; j++) {
        size_t p = part->off[j], w = whole->off[idx[j]], len = part->off[j + 1] - p;
        float *pf[] = {part->logp, part->logp_old, part->ent, part->behav, part->adv};
        float *wf[] = {whole->logp, whole->logp_old, whole->ent, whole->behav, whole->adv};
        for (int a = to_whole ? 0 : 3; a < (to_whole ? 3 : 5); a++)
            memcpy(to_whole ? wf[a] + w : pf[a] + p, to_whole ? pf[a] + p : wf[a] + w, sizeof(float) * len);
        if (!to_whole) {
            memcpy(part->mask + p, whole->mask + w, len);
            memcpy(part->stale + p, whole->stale + w, sizeof(uint32_t) * len);
        }
    }
}

void mtrl_train_rl_backward(mtrl_model *m, const mtrl_config *cfg, const mtrl_algo_config *a, mtrl_traj *const *eps,
                            mtrl_train_rl_batch *b, const int *idx, int k) {
    mtrl_traj **sub = episodes_of_(eps, idx, k);
    seq_batch sb;
    seq_batch_init_(&sb, sub, k, m);
    // A share of the batch runs on arrays of its own, laid end to end as the model's batch is.
    mtrl_train_rl_batch part, *t = b;
    if (idx) {
        rl_batch_alloc_(&part, k, sb.total);
        for (int j = 0; j < k; j++) part.off[j + 1] = part.off[j] + sub[j]->n_tokens;
        rl_batch_move_(&part, b, idx, k, 0);
        t = &part;
    }
    size_t T = sb.total;
    real *logp_pos = xcalloc(T + 1, sizeof(real)), *ent_pos = xcalloc(T + 1, sizeof(real));
    real *dlp = xcalloc(T + 1, sizeof(real)), *dep = xcalloc(T + 1, sizeof(real));
    // Forward, loss and backward unit by unit (model.h mtrl_model_train), each unit's loss with
    // the whole batch's denominators, so the gradients add up to the batch's.
    rl_loss rl = {a, t, (double)b->n_mask, (double)b->n};
    m->replay_routing = cfg->algo.routing_replay && sb.b.routing != NULL;
    mtrl_model_train(m, &sb.b, segment_of_(m, cfg, &sb.b), logp_pos, ent_pos, dlp, a->entropy_coef != 0 ? dep : NULL,
                     rl_loss_unit_, &rl);
    if (idx) {
        rl_batch_move_(&part, b, idx, k, 1);
        mtrl_train_rl_batch_free(&part);
    }
    free(logp_pos); free(ent_pos); free(dlp); free(dep);
    seq_batch_free_(&sb);
    free(sub);
}

void mtrl_train_rl_stats(const mtrl_algo_config *a, mtrl_train_rl_batch *b, mtrl_step_stats *st) {
    mtrl_algo_batch ab = {(size_t)b->n, b->off, b->logp, b->logp_old, b->behav, b->adv, b->mask, b->ent, 0, 0, b->stale};
    mtrl_algo_stats as;
    double loss = 0;
    mtrl_status s = mtrl_algo_policy_loss(a, &ab, &loss, b->dlogp, b->dent, &as);
    MTRL_CHECKF(s == MTRL_OK, "policy loss refused a well-formed batch");
    st->loss = loss;
    st->pg_loss = as.pg_loss;
    st->entropy_mean = as.entropy_mean;
    st->clip_low = as.clip_low_frac;
    st->clip_high = as.clip_high_frac;
    st->clip_dual = as.dual_clip_frac;
    st->ratio_mean = as.ratio_mean;
    st->masked_frac = as.masked_frac;
    st->token_masked_frac = as.token_masked_frac;
    st->kl_k1 = as.kl_k1;
    st->kl_k3 = as.kl_k3;
    st->logp_absdiff = as.logp_absdiff_mean;
    st->staleness_mean = as.n_tokens ? b->stale_sum / (double)as.n_tokens : 0;
}

void mtrl_train_step_end(mtrl_model *m, mtrl_step_stats *st) {
    // Loads of this step's routing, read before QB consumes them.
    if (st) {
        for (int l = m->dims.first_dense; l < m->dims.L; l++) st->max_violation[l] = mtrl_model_load_violation(m, l);
        if (st->loads) memcpy(st->loads, m->load, sizeof(long) * (size_t)m->dims.L * (size_t)m->dims.E);
    }
    mtrl_qb_apply(m); // model/qb.h: TRAIN with [learner] qb, FROZEN without (set at open)
    m->version++;
}

static double optimizer_step_(mtrl_model *m, const mtrl_train_adamw *o) {
    return mtrl_model_optimizer_step(m, o->lr, o->beta1, o->beta2, o->eps, o->weight_decay, o->clip);
}

void mtrl_train_rl_step(mtrl_model *m, const mtrl_config *cfg, const mtrl_algo_config *a, mtrl_traj *const *eps, int n,
                        mtrl_step_stats *st) {
    double t_start = mtrl_time_mono();
    mtrl_train_rl_batch b;
    mtrl_train_rl_batch_init(&b, m, cfg, a, eps, n, st);
    mtrl_model_zero_grads(m);
    mtrl_train_rl_backward(m, cfg, a, eps, &b, NULL, n);
    // The step's loss and statistics over the whole batch (the gradients are the units' already).
    mtrl_train_rl_stats(a, &b, st);
    mtrl_train_adamw o = mtrl_train_adamw_of(cfg, cfg->learner.lr);
    st->grad_norm = optimizer_step_(m, &o);
    mtrl_train_step_end(m, st);
    st->seconds = mtrl_time_mono() - t_start;
    mtrl_train_rl_batch_free(&b);
}

// The supervised loss of one unit: mean negative log-likelihood of the batch's MODEL tokens.
typedef struct sft_loss {
    mtrl_traj *const *eps;
    const size_t *off;      // [n+1] position offsets of the episodes
    size_t count;           // MODEL tokens of the whole batch
    double loss;            // Σ -logp so far
} sft_loss;

static void sft_loss_unit_(void *user, int i0, int n, const real *logp, const real *ent, real *dlp, real *dep) {
    (void)ent;
    (void)dep;
    sft_loss *f = user;
    for (int i = i0; i < i0 + n; i++) {
        size_t o = f->off[i];
        for (uint64_t j = 1; j < f->eps[i]->n_tokens; j++)
            if (f->eps[i]->kind[j] == MTRL_TOK_MODEL) {
                f->loss -= logp[o + j - 1];
                dlp[o + j - 1] = (real)(-1.0 / (double)(f->count ? f->count : 1));
            }
    }
}

size_t mtrl_train_sft_count(mtrl_traj *const *eps, int n) {
    size_t count = 0;
    for (int i = 0; i < n; i++)
        for (uint64_t j = 1; j < eps[i]->n_tokens; j++) count += eps[i]->kind[j] == MTRL_TOK_MODEL;
    return count;
}

double mtrl_train_sft_backward(mtrl_model *m, const mtrl_config *cfg, mtrl_traj *const *eps, const int *idx, int k,
                               size_t count) {
    mtrl_traj **sub = episodes_of_(eps, idx, k);
    seq_batch sb;
    seq_batch_init_(&sb, sub, k, m);
    sb.b.routing = NULL; // demonstrations carry no routing
    m->replay_routing = 0;
    size_t T = sb.total;
    real *logp = xcalloc(T + 1, sizeof(real)), *dlp = xcalloc(T + 1, sizeof(real));
    size_t *off = xmalloc(sizeof(size_t) * (size_t)(k + 1));
    sft_loss f = {sub, off, count, 0};
    off[0] = 0;
    for (int i = 0; i < k; i++) off[i + 1] = off[i] + sub[i]->n_tokens;
    mtrl_model_train(m, &sb.b, segment_of_(m, cfg, &sb.b), logp, NULL, dlp, NULL, sft_loss_unit_, &f);
    free(logp);
    free(dlp);
    free(off);
    seq_batch_free_(&sb);
    free(sub);
    return f.loss;
}

double mtrl_train_sft_step(mtrl_model *m, const mtrl_config *cfg, mtrl_traj *const *eps, int n, double lr) {
    size_t count = mtrl_train_sft_count(eps, n);
    mtrl_model_zero_grads(m);
    double loss = mtrl_train_sft_backward(m, cfg, eps, NULL, n, count);
    mtrl_train_adamw o = mtrl_train_adamw_of(cfg, lr);
    optimizer_step_(m, &o);
    mtrl_train_step_end(m, NULL);
    return count ? loss / (double)count : 0;
}

static void append_bytes_(mtrl_traj *t, const char *b, size_t n, uint8_t kind) {
    for (size_t i = 0; i < n; i++) mtrl_traj_append(t, (unsigned char)b[i], 0.0f, 0, kind, NULL);
}

// The picture of res, as tokens of kind (none without a picture).
static mtrl_status append_image_(mtrl_traj *t, int P, const mtrl_env_result *res, uint8_t kind, mtrl_env *env,
                                 mtrl_error *err) {
    if (!res->image) return MTRL_OK;
    if (P <= 0)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "env '%s' sent a %u x %u picture, but the model takes none ([model] "
                              "image_patch = 0)", mtrl_env_name(env), res->image_w, res->image_h);
    uint32_t first = mtrl_traj_add_image(t, P, res->image, res->image_w, res->image_h);
    size_t n = mtrl_image_token_count(res->image_w, res->image_h, P);
    uint32_t *ids = xmalloc(sizeof(uint32_t) * n);
    mtrl_image_tokens(res->image_w, res->image_h, P, first, ids);
    for (size_t i = 0; i < n; i++) mtrl_traj_append(t, ids[i], 0.0f, 0, kind, NULL);
    free(ids);
    return MTRL_OK;
}

mtrl_status mtrl_train_demo_episode(mtrl_env *env, uint64_t seed, int max_tokens, mtrl_traj *out, mtrl_error *err) {
    return mtrl_train_demo_episode_images(env, seed, max_tokens, 0, out, err);
}

// ids of kind, appended.
static void append_ids_(mtrl_traj *t, const uint32_t *ids, long n, uint8_t kind) {
    for (long i = 0; i < n; i++) mtrl_traj_append(t, ids[i], 0.0f, 0, kind, NULL);
}

static mtrl_status demo_too_long_(const mtrl_env *env, int max_tokens, mtrl_error *err) {
    return mtrl_error_set(err, MTRL_ERR_LIMIT, "a demo episode of env %s does not fit [actor] max_tokens = %d in the kimi template",
                          mtrl_env_name(env), max_tokens);
}

// The prompt in a chat template's tokens (chat.h), as the actors render it.
static mtrl_status demo_chat_prompt_(const mtrl_env *env, const mtrl_chat *chat, const mtrl_env_result *res, int max_tokens,
                                     mtrl_traj *out, mtrl_error *err) {
    size_t cap = (size_t)max_tokens + 16;
    uint32_t *ids = xmalloc(sizeof(uint32_t) * cap);
    long k = mtrl_chat_prompt(chat, res->obs, res->obs_len, ids, cap);
    if (k >= 0) append_ids_(out, ids, k, MTRL_TOK_PROMPT);
    free(ids);
    return k < 0 ? demo_too_long_(env, max_tokens, err) : MTRL_OK;
}

// The demo's actions in the template's tokens: each call and its framed result, the answer with
// its end token; max_tokens bounds every piece.
static mtrl_status demo_chat_(mtrl_env *env, const mtrl_chat *chat, const mtrl_env_action *acts, size_t na, int max_tokens,
                              mtrl_traj *out, mtrl_error *err) {
    size_t cap = (size_t)max_tokens + 16;
    uint32_t *ids = xmalloc(sizeof(uint32_t) * cap);
    mtrl_status s = MTRL_OK;
    long k = 0;
    for (size_t i = 0; i < na && s == MTRL_OK && k >= 0; i++) {
        const mtrl_env_action *a = &acts[i];
        mtrl_env_result res;
        if (a->kind == MTRL_ENV_ACTION_TOOL) {
            char call_id[256];
            k = mtrl_chat_demo_call(chat, a->data, a->len, (int)i, ids, cap, call_id, sizeof call_id);
            if (k < 0) break;
            append_ids_(out, ids, k, MTRL_TOK_MODEL);
            s = mtrl_env_step(env, a->kind, a->data, a->len, &res, err);
            if (s != MTRL_OK) break;
            k = mtrl_chat_result(chat, call_id, res.obs, res.obs_len, ids, cap);
            if (k >= 0) append_ids_(out, ids, k, MTRL_TOK_TOOL);
        } else {
            k = mtrl_chat_demo_answer(chat, a->data, a->len, ids, cap);
            if (k < 0) break;
            append_ids_(out, ids, k, MTRL_TOK_MODEL);
            s = mtrl_env_step(env, a->kind, a->data, a->len, &res, err);
            if (s == MTRL_OK) out->reward = res.reward;
        }
    }
    free(ids);
    return s == MTRL_OK && k < 0 ? demo_too_long_(env, max_tokens, err) : s;
}

mtrl_status mtrl_train_demo_episode_images(mtrl_env *env, uint64_t seed, int max_tokens, int image_patch,
                                           mtrl_traj *out, mtrl_error *err) {
    return mtrl_train_demo_episode_chat(env, seed, max_tokens, image_patch, NULL, out, err);
}

mtrl_status mtrl_train_demo_episode_chat(mtrl_env *env, uint64_t seed, int max_tokens, int image_patch,
                                         const mtrl_chat *chat, mtrl_traj *out, mtrl_error *err) {
    // A template other than bytes (an imported model's own tokens) frames the whole demo.
    int templated = chat && chat->kind != MTRL_CHAT_BYTES;
    if (templated && image_patch > 0)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "pictures in a kimi-template demo are not supported");
    mtrl_traj_reset(out);
    mtrl_env_result res;
    mtrl_status s = mtrl_env_reset(env, seed, &res, err);
    if (s != MTRL_OK) return s;
    out->task_seed = seed;
    mtrl_traj_set_env(out, mtrl_env_name(env));
    if (templated) {
        s = demo_chat_prompt_(env, chat, &res, max_tokens, out, err);
    } else {
        mtrl_traj_append(out, MTRL_TOK_BOS, 0.0f, 0, MTRL_TOK_PROMPT, NULL);
        append_bytes_(out, res.obs, res.obs_len, MTRL_TOK_PROMPT);
        s = append_image_(out, image_patch, &res, MTRL_TOK_PROMPT, env, err);
    }
    if (s != MTRL_OK) return s;
    mtrl_env_demo_out demo;
    if (!mtrl_env_has_demo(env))
        return mtrl_error_set(err, MTRL_ERR_PLUGIN, "env %s has no demo(); [warmup] steps needs one", mtrl_env_name(env));
    s = mtrl_env_demo(env, &demo, err);
    if (s != MTRL_OK) return s;
    // Copy the actions: the demo's memory is valid only until the next call on the env.
    size_t na = demo.count;
    mtrl_env_action *acts = xcalloc(na ? na : 1, sizeof *acts);
    for (size_t i = 0; i < na; i++) {
        acts[i].kind = demo.actions[i].kind;
        acts[i].len = demo.actions[i].len;
        char *d = xmalloc(acts[i].len + 1);
        memcpy(d, demo.actions[i].data, acts[i].len);
        acts[i].data = d;
    }
    if (templated) s = demo_chat_(env, chat, acts, na, max_tokens, out, err);
    for (size_t i = 0; !templated && i < na && s == MTRL_OK; i++) {
        const mtrl_env_action *a = &acts[i];
        if (a->kind == MTRL_ENV_ACTION_TOOL) {
            mtrl_traj_append(out, MTRL_TOK_TOOL_OPEN, 0.0f, 0, MTRL_TOK_MODEL, NULL);
            append_bytes_(out, a->data, a->len, MTRL_TOK_MODEL);
            mtrl_traj_append(out, MTRL_TOK_TOOL_CLOSE, 0.0f, 0, MTRL_TOK_MODEL, NULL);
            s = mtrl_env_step(env, a->kind, a->data, a->len, &res, err);
            if (s != MTRL_OK) break;
            mtrl_traj_append(out, MTRL_TOK_RESULT_OPEN, 0.0f, 0, MTRL_TOK_TOOL, NULL);
            append_bytes_(out, res.obs, res.obs_len, MTRL_TOK_TOOL);
            if ((s = append_image_(out, image_patch, &res, MTRL_TOK_TOOL, env, err)) != MTRL_OK) break;
            mtrl_traj_append(out, MTRL_TOK_RESULT_CLOSE, 0.0f, 0, MTRL_TOK_TOOL, NULL);
        } else {
            append_bytes_(out, a->data, a->len, MTRL_TOK_MODEL);
            mtrl_traj_append(out, MTRL_TOK_EOS, 0.0f, 0, MTRL_TOK_MODEL, NULL);
            s = mtrl_env_step(env, a->kind, a->data, a->len, &res, err);
            if (s == MTRL_OK) out->reward = res.reward;
        }
    }
    for (size_t i = 0; i < na; i++) free((void *)acts[i].data);
    free(acts);
    if (s != MTRL_OK) return s;
    if ((int)out->n_tokens > max_tokens)
        return mtrl_error_set(err, MTRL_ERR_LIMIT, "demo episode of %llu tokens exceeds [actor] max_tokens = %d",
                              (unsigned long long)out->n_tokens, max_tokens);
    out->status = MTRL_EP_COMPLETE;
    return MTRL_OK;
}
