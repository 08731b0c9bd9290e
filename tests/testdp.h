// testdp.h: the data-parallel step (learner/dist_dp.h) against one rank's step on one fixed
// batch (header-only; test_dist_dp runs it on CPU models over host buffers, test_cuda_dist_dp
// on GPU models of one device over device buffers, the local backend and NCCL).
//
// The batch: ten episodes of 8 to 150 tokens, BOS and a prompt, then model tokens with tool
// results in the middle, behaviour log-probs away from the learner's (ratios off 1, clipping
// and TIS at work), groups interleaved (group_id i % 3), episode 5 truncated. Each rank builds
// its replica from one seed; the one-rank reference runs mtrl_train_rl_step (or
// mtrl_train_sft_step) on a model of the same device. What is compared and how closely is
// test_dp_tol: fp32 sums in another order (the ranks' partial gradients added; on a GPU also
// the units' GEMMs over other row counts) differ by rounding, and an AdamW first step turns a
// gradient of about eps, what cancellation leaves, into an update that such rounding moves by
// a fraction of lr; equality across ranks (the parameters after the all-gather) is exact.
// A failing check names the step, the rank and, for blocks, the tensor of the worst element
// with its two values.
#ifndef MTRL_TESTDP_H
#define MTRL_TESTDP_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "common/rng.h"
#include "common/tokenizer.h"
#include "learner/dist_comm.h"
#include "learner/dist_dp.h"
#include "learner/dist_plan.h"
#include "learner/train.h"
#include "model/model.h"
#include "model/qb.h"
#include "tests/testdist.h"
#include "tests/testhelp.h"

enum { TDP_NEP = 10 };
static const int tdp_lens_[TDP_NEP] = {17, 40, 95, 130, 23, 64, 8, 150, 33, 77};

// How closely the DP step must follow one rank's (relative unless named otherwise).
typedef struct test_dp_tol {
    double stats;          // loss, pg loss, entropy, ratio, KL, grad norm
    double clip_abs;       // the clip fractions' sum, absolute (a token's ratio on the other side)
    double grad;           // each rank's reduced, clipped gradient shard, relative to its largest
    double param_rel;      // every parameter within param_rel or param_lr_all x lr of one rank's,
    double param_lr_all;   // ...
    double param_lr_most;  // and all but param_frac of them within param_rel or param_lr_most x lr
    double param_frac;
    double moments;        // each rank's shard of both moments after step 2, relative to its largest
    double m_elem_rel, m_elem_abs; // and the first moment elementwise
} test_dp_tol;

// Where the ranks and the reference run: the model's device, and how the ranks' world is made.
typedef struct test_dp_setup {
    int device, gpu;              // MTRL_DEVICE_*
    const char *model_ini;        // [model] lines after preset = tiny ("" for none)
    void (*world)(int R, int timeout_ms, test_rank_fn fn, void *ctx, const struct test_dp_setup *u);
    int gpu_buffers;              // the world's buffers: -1 host, else that GPU's
    test_dp_tol tol;
} test_dp_setup;

// Episode i of the batch.
static inline void tdp_episode_(mtrl_traj *t, int i) {
    mtrl_traj_reset(t);
    t->episode_id = (uint64_t)i;
    t->group_id = (uint64_t)(i % 3);
    uint64_t s = mtrl_rng_stream("test.dist_dp", (uint64_t)i, 0);
    int prompt = 3 + i % 5;
    for (int j = 0; j < tdp_lens_[i]; j++) {
        uint32_t id = j == 0 ? MTRL_TOK_BOS : (uint32_t)(mtrl_rng_u64(5, s, (uint64_t)j) % 256);
        uint8_t kind = j < prompt ? MTRL_TOK_PROMPT : (j / 11) % 3 == 2 ? MTRL_TOK_TOOL : MTRL_TOK_MODEL;
        float lp = kind == MTRL_TOK_MODEL ? (float)(-4.0 - 2.0 * mtrl_rng_uniform(5, s, 1000 + (uint64_t)j)) : 0.0f;
        mtrl_traj_append(t, id, lp, 0, kind, NULL);
    }
    t->reward = (double)(i * 7 % 5) / 4.0;
    t->status = i == 5 ? MTRL_EP_TRUNCATED : MTRL_EP_COMPLETE;
}

static inline void tdp_config_(mtrl_config *cfg, const char *model_ini, const char *extra) {
    char text[1024];
    snprintf(text, sizeof text,
             "[run]\nseed = 1\n[model]\npreset = tiny\n%s[env]\nname = calc\n[learner]\nlr = 0.003\nweight_decay = 0.1\n"
             "%s", model_ini ? model_ini : "", extra);
    mtrl_config_errors errs = {0};
    mtrl_status s = mtrl_config_load_text(cfg, "t.ini", text, NULL, 0, &errs);
    if (s != MTRL_OK) mtrl_config_errors_print(&errs, stderr);
    mtrl_config_errors_free(&errs);
    TEST_EQ_INT(s, MTRL_OK);
}

// A replica (seed 11) on the setup's device; 0 or a message.
static inline int tdp_model_(mtrl_model *m, const mtrl_config *cfg, int qb_mode, int device, int gpu, char *msg,
                             size_t cap) {
    mtrl_model_dims d;
    mtrl_error err = {0};
    if (mtrl_model_dims_from_config(&d, cfg, MTRL_VOCAB, &err) != MTRL_OK ||
        mtrl_model_init_on(m, &d, 11, device, gpu, &err) != MTRL_OK) {
        snprintf(msg, cap, "model: %.900s", err.msg);
        return -1;
    }
    // β changes with QB on from the units a rank runs (dist_dp.h), so the comparisons with one
    // rank over two steps keep it frozen; test_dist_dp's QB case checks the reduction with QB on.
    mtrl_qb_set_mode(m, qb_mode);
    return 0;
}

// What one rank (or the one-rank reference) leaves after each step (host copies).
typedef struct tdp_out {
    mtrl_status st[2];
    char msg[MTRL_ERROR_MSG_MAX];
    mtrl_step_stats stats[2];
    real *params[2], *grads[2], *adam_m, *adam_v, *qb_beta;
    long *loads;
    size_t lo, hi;            // the bytes of its shard (one rank: the whole block)
} tdp_out;

typedef struct tdp_ctx {
    const mtrl_config *cfg;
    const mtrl_algo_config *algo;
    mtrl_traj *const *eps;
    const test_dp_setup *u;
    int steps, qb_mode, sft;
    int odd_rank;             // > 0: rank odd_rank - 1 is given the batch less its first episode
    tdp_out out[MTRL_DIST_RANKS_MAX];
} tdp_ctx;

static inline real *tdp_copy_(const void *p, size_t bytes) {
    real *c = malloc(bytes);
    memcpy(c, p, bytes);
    return c;
}

// The model's state after a step, through the host mirror (a no-op copy on the CPU).
static inline void tdp_snapshot_(tdp_out *o, mtrl_model *m, int step) {
    mtrl_model_to_host(m);
    size_t n = m->params.total;
    o->params[step] = tdp_copy_(m->params.base, n);
    o->grads[step] = tdp_copy_(m->grads, n);
    free(o->adam_m), free(o->adam_v), free(o->qb_beta);
    o->adam_m = tdp_copy_(m->adam_m, n);
    o->adam_v = tdp_copy_(m->adam_v, n);
    o->qb_beta = tdp_copy_(m->qb_beta, sizeof(real) * (size_t)m->dims.L * m->dims.E);
}

static inline void tdp_out_free_(tdp_out *o) {
    for (int s = 0; s < 2; s++) free(o->params[s]), free(o->grads[s]);
    free(o->adam_m), free(o->adam_v), free(o->qb_beta), free(o->loads);
}

static inline void tdp_rank_(mtrl_dist_comm *c, void *p) {
    tdp_ctx *x = p;
    int r = mtrl_dist_comm_rank(c);
    tdp_out *o = &x->out[r];
    mtrl_model m;
    if (tdp_model_(&m, x->cfg, x->qb_mode, x->u->device, x->u->gpu, o->msg, sizeof o->msg)) {
        o->st[0] = o->st[1] = MTRL_ERR_USAGE;
        return;
    }
    mtrl_dist_dp dp;
    mtrl_error err = {0};
    o->st[0] = mtrl_dist_dp_init(&dp, c, &m, &err);
    if (o->st[0] != MTRL_OK) {
        snprintf(o->msg, sizeof o->msg, "%s", err.msg);
        mtrl_model_free(&m);
        return;
    }
    const mtrl_dist_shard *sh = &dp.shards.rank[r];
    o->lo = sh->begin < dp.shards.total ? sh->begin : dp.shards.total;
    o->hi = sh->end < dp.shards.total ? sh->end : dp.shards.total;
    o->loads = calloc((size_t)m.dims.L * m.dims.E, sizeof(long));
    int odd = x->odd_rank == r + 1;
    for (int s = 0; s < x->steps; s++) {
        o->stats[s].loads = o->loads;
        mtrl_traj *const *eps = x->eps + odd;
        if (x->sft) o->st[s] = mtrl_dist_dp_sft_step(&dp, &m, x->cfg, eps, TDP_NEP - odd, 3e-3, &o->stats[s].loss, &err);
        else o->st[s] = mtrl_dist_dp_rl_step(&dp, &m, x->cfg, x->algo, eps, TDP_NEP - odd, &o->stats[s], &err);
        if (o->st[s] != MTRL_OK) snprintf(o->msg, sizeof o->msg, "%s", err.msg);
        tdp_snapshot_(o, &m, s);
    }
    mtrl_dist_dp_free(&dp);
    mtrl_model_free(&m);
}

static inline void tdp_reference_(tdp_ctx *x, tdp_out *o) {
    mtrl_model m;
    if (tdp_model_(&m, x->cfg, x->qb_mode, x->u->device, x->u->gpu, o->msg, sizeof o->msg)) {
        fprintf(stderr, "reference: %s\n", o->msg);
        abort();
    }
    o->lo = 0;
    o->hi = m.params.total;
    o->loads = calloc((size_t)m.dims.L * m.dims.E, sizeof(long));
    for (int s = 0; s < x->steps; s++) {
        o->stats[s].loads = o->loads;
        if (x->sft) o->stats[s].loss = mtrl_train_sft_step(&m, x->cfg, x->eps, TDP_NEP, 3e-3);
        else mtrl_train_rl_step(&m, x->cfg, x->algo, x->eps, TDP_NEP, &o->stats[s]);
        tdp_snapshot_(o, &m, s);
    }
    mtrl_model_free(&m);
}

// max |a - b| / max |b| over bytes [lo, hi) of two blocks (0 for an empty range).
static inline double tdp_block_rel_(const real *a, const real *b, size_t lo, size_t hi) {
    double num = 0, den = 0;
    for (size_t i = lo / sizeof(real); i < hi / sizeof(real); i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (d > num) num = d;
        if (fabs((double)b[i]) > den) den = fabs((double)b[i]);
    }
    return den > 0 ? num / den : num;
}

// Where the largest |a - b| over bytes [lo, hi) is: "tensor[element] a vs b" (for messages).
static inline const char *tdp_worst_(const mtrl_config *cfg, const real *a, const real *b, size_t lo, size_t hi,
                                     char *buf, size_t cap) {
    size_t at = lo / sizeof(real);
    double worst = -1;
    for (size_t i = lo / sizeof(real); i < hi / sizeof(real); i++)
        if (fabs((double)a[i] - (double)b[i]) > worst) worst = fabs((double)a[i] - (double)b[i]), at = i;
    mtrl_model_dims d;
    mtrl_tt t;
    snprintf(buf, cap, "element %zu", at);
    if (mtrl_model_dims_from_config(&d, cfg, MTRL_VOCAB, NULL) != MTRL_OK) return buf;
    mtrl_model_param_table(&t, &d);
    for (int k = 0; k < t.n; k++) {
        size_t first = t.items[k].offset / sizeof(real);
        if (at >= first && at < first + t.items[k].numel)
            snprintf(buf, cap, "%s[%zu]: %.9g vs one rank's %.9g (|diff| %.3g)", t.items[k].name, at - first,
                     (double)a[at], (double)b[at], worst);
    }
    mtrl_tt_free(&t);
    return buf;
}

// One comparison: the config, the batch, the ranks' outputs and one rank's (ref).
typedef struct tdp_case {
    mtrl_config cfg;
    mtrl_algo_config algo;
    mtrl_traj tr[TDP_NEP], *eps[TDP_NEP];
    tdp_ctx x;
    tdp_out ref;
} tdp_case;

// Runs the DP step on R ranks of the setup's world (timeout_ms) and, with ref, one rank's step
// on the same batch.
static inline tdp_case *tdp_case_run_(const test_dp_setup *u, int R, int timeout_ms, const char *extra, tdp_ctx x,
                                      int ref) {
    tdp_case *c = calloc(1, sizeof *c);
    tdp_config_(&c->cfg, u->model_ini, extra);
    TEST_EQ_INT(mtrl_train_algo_config(&c->cfg, &c->algo, NULL), MTRL_OK);
    for (int i = 0; i < TDP_NEP; i++) mtrl_traj_init(&c->tr[i]), tdp_episode_(&c->tr[i], i), c->eps[i] = &c->tr[i];
    c->x = x;
    c->x.cfg = &c->cfg;
    c->x.algo = &c->algo;
    c->x.eps = c->eps;
    c->x.u = u;
    if (ref) tdp_reference_(&c->x, &c->ref);
    u->world(R, timeout_ms, tdp_rank_, &c->x, u);
    return c;
}

static inline void tdp_case_free_(tdp_case *c, int R) {
    for (int r = 0; r < R; r++) tdp_out_free_(&c->x.out[r]);
    tdp_out_free_(&c->ref);
    for (int i = 0; i < TDP_NEP; i++) mtrl_traj_free(&c->tr[i]);
    free(c);
}

// The DP step on R ranks against one rank over `steps` steps, for config text `extra`
// ([learner] lines and later sections); sft: the supervised step. `what` names the case in
// every message ("clipped" in it: the norm must be above the clip of 0.05).
// test_dp_check: the checks of test_dp_compare on a case already run (with ref); c is kept.
static inline void test_dp_check(const test_dp_setup *u, tdp_case *c, int R, int steps, int sft, const char *what) {
    const test_dp_tol *tol = &u->tol;
    tdp_ctx *x = &c->x;
    const mtrl_config cfg = c->cfg;
    tdp_out ref = c->ref;
    char where[512];
    size_t total = x->out[0].hi - x->out[0].lo;
    for (int r = 0; r < R; r++) total = x->out[r].hi > total ? x->out[r].hi : total;
    for (int s = 0; s < steps; s++) {
        const mtrl_step_stats *w = &ref.stats[s];
        printf("%s, %d ranks, step %d: loss %.9g grad_norm %.9g (one rank: %.9g, %.9g)\n", what, R, s + 1,
               x->out[0].stats[s].loss, x->out[0].stats[s].grad_norm, w->loss, w->grad_norm); // sft: no norm (0)
        if (strstr(what, "clipped"))
            TEST_CHECKF(w->grad_norm > 0.05, "%s: norm %.3g, clipping at 0.05 not active", what, w->grad_norm);
        double worst_p = 0;
        for (int r = 0; r < R; r++) {
            tdp_out *o = &x->out[r];
            TEST_CHECKF(o->st[s] == MTRL_OK, "%s rank %d step %d: %s", what, r, s + 1, o->msg);
            if (o->st[s] != MTRL_OK || !o->params[s]) continue;
            const mtrl_step_stats *g = &o->stats[s];
            TEST_CLOSE(g->loss, w->loss, tol->stats, 1e-9);
            if (!sft) {
                TEST_CLOSE(g->grad_norm, w->grad_norm, tol->stats, 0);
                TEST_CLOSE(g->pg_loss, w->pg_loss, tol->stats, 1e-9);
                TEST_CLOSE(g->entropy_mean, w->entropy_mean, tol->stats, 0);
                TEST_CLOSE(g->ratio_mean, w->ratio_mean, tol->stats, 0);
                TEST_CLOSE(g->kl_k3, w->kl_k3, tol->stats, 1e-12);
                TEST_CLOSE(g->clip_low + g->clip_high + g->clip_dual, w->clip_low + w->clip_high + w->clip_dual, 0,
                           tol->clip_abs);
                TEST_EQ_INT(g->tokens, w->tokens);
                TEST_EQ_INT(g->model_tokens, w->model_tokens);
                TEST_EQ_INT(g->groups, w->groups);
                TEST_CLOSE(g->staleness_mean, w->staleness_mean, 0, 1e-12);
                TEST_CLOSE(g->reward_mean, w->reward_mean, 0, 1e-12);
                // The rank's shard of the reduced gradients, clipped as one rank clips them.
                double eg = tdp_block_rel_(o->grads[s], ref.grads[s], o->lo, o->hi);
                TEST_CHECKF(eg <= tol->grad, "%s rank %d step %d: gradient shard off by %.3g of its largest (limit %g); "
                            "worst %s", what, r, s + 1, eg, tol->grad,
                            tdp_worst_(&cfg, o->grads[s], ref.grads[s], o->lo, o->hi, where, sizeof where));
                if (r == 0) printf("  rank 0 gradient shard: off by %.3g of its largest\n", eg);
            }
            double ep = tdp_block_rel_(o->params[s], ref.params[s], 0, total);
            if (ep > worst_p) worst_p = ep;
            // Elementwise: every parameter within param_rel or param_lr_all lr, and all but
            // param_frac of them within param_rel or param_lr_most lr (testdp.h says why).
            size_t np = total / sizeof(real), off = 0, far = 0;
            double lr = cfg.learner.lr, beyond = 0; // the largest excess over param_rel, in lr
            for (size_t i = 0; i < np; i++) {
                double d = fabs((double)o->params[s][i] - (double)ref.params[s][i]), a = fabs((double)ref.params[s][i]);
                off += d > tol->param_rel * a + tol->param_lr_most * lr;
                far += d > tol->param_rel * a + tol->param_lr_all * lr;
                if ((d - tol->param_rel * a) / lr > beyond) beyond = (d - tol->param_rel * a) / lr;
            }
            TEST_CHECKF(far == 0, "%s rank %d step %d: %zu of %zu parameters beyond %g relative and %g lr; worst %s", what,
                        r, s + 1, far, np, tol->param_rel, tol->param_lr_all,
                        tdp_worst_(&cfg, o->params[s], ref.params[s], 0, total, where, sizeof where));
            TEST_CHECKF((double)off <= tol->param_frac * (double)np, "%s rank %d step %d: %zu of %zu parameters beyond %g "
                        "relative and %g lr (at most %.3g%% may be)", what, r, s + 1, off, np, tol->param_rel,
                        tol->param_lr_most, 100 * tol->param_frac);
            if (r == 0)
                printf("  %zu of %zu parameters beyond %g relative and %g lr; the worst %.3g lr beyond %g relative\n",
                       off, np, tol->param_rel, tol->param_lr_most, beyond, tol->param_rel);
            if (r && x->out[0].params[s])
                TEST_CHECKF(!memcmp(o->params[s], x->out[0].params[s], total), "%s step %d: rank %d's parameters "
                            "differ from rank 0's (first at %s)", what, s + 1, r,
                            tdp_worst_(&cfg, o->params[s], x->out[0].params[s], 0, total, where, sizeof where));
        }
        printf("  parameters: largest difference from one rank %.3g of the largest parameter\n", worst_p);
    }
    if (steps == 2)
        for (int r = 0; r < R; r++) {
            tdp_out *o = &x->out[r];
            if (!o->adam_m) continue;
            double em = tdp_block_rel_(o->adam_m, ref.adam_m, o->lo, o->hi), ev = tdp_block_rel_(o->adam_v, ref.adam_v, o->lo, o->hi);
            printf("  rank %d moments of bytes [%zu, %zu): m off by %.3g, v by %.3g\n", r, o->lo, o->hi, em, ev);
            TEST_CHECKF(em <= tol->moments, "%s rank %d: first moment off by %.3g of its largest (limit %g); worst %s",
                        what, r, em, tol->moments, tdp_worst_(&cfg, o->adam_m, ref.adam_m, o->lo, o->hi, where, sizeof where));
            TEST_CHECKF(ev <= tol->moments, "%s rank %d: second moment off by %.3g of its largest (limit %g); worst %s",
                        what, r, ev, tol->moments, tdp_worst_(&cfg, o->adam_v, ref.adam_v, o->lo, o->hi, where, sizeof where));
            TEST_ARRAY_CLOSE(o->adam_m + o->lo / sizeof(real), ref.adam_m + o->lo / sizeof(real),
                             (o->hi - o->lo) / sizeof(real), tol->m_elem_rel, tol->m_elem_abs);
        }
}

static inline void test_dp_compare(const test_dp_setup *u, int R, const char *extra, int steps, int sft,
                                   const char *what) {
    tdp_case *c = tdp_case_run_(u, R, 60000, extra, (tdp_ctx){.steps = steps, .qb_mode = MTRL_QB_FROZEN, .sft = sft}, 1);
    test_dp_check(u, c, R, steps, sft, what);
    tdp_case_free_(c, R);
}

#endif
