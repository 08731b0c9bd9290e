// mtrl-test: cpu
// The data-parallel RL step with expert-parallel experts (learner/dist_dp.h
// mtrl_dist_dp_init_ep, learner/dist_ep_wire.h) on CPU models over the local communicator's
// threads, against one rank's mtrl_train_rl_step on tests/testdp.h's batch (ten episodes of 8 to
// 150 tokens, groups interleaved, a truncated one masked, tool tokens, behaviour log-probs away
// from the learner's), the tiny preset (8 experts in its MoE layers: 4 each over 2 ranks, 3/3/2
// over 3, 2 each over 4), weight decay and clipping active, over two steps:
//   * the loss, pg loss, entropy, ratio, KL and the gradient norm within TOL_REL of one rank's,
//     the clip fractions' sum within 1e-12, token and group counts exact;
//   * each rank's OWN pieces of the reduced, clipped gradients (its experts' rows of every MoE
//     layer's moe.w1 / w3 / w2, complete from the exchange, and its shard of the non-expert
//     block) within TOL_REL of one rank's, relative to their largest; every other expert's
//     gradient on that rank exactly zero (only owners compute an expert's gradient);
//   * every parameter of the rank's own experts and every non-expert parameter within testdp.h's
//     tolerances (TOL_REL or 0.01 lr each, all but 0.01% within TOL_REL or 1e-4 lr); the
//     non-expert parameters equal on every rank bit for bit (all-gathered);
//   * after the second step each rank's own pieces of both AdamW moments within TOL_REL;
//   * every rank asked rounds and served rows (the experts really ran on their owners);
// over 1, 2, 3 and 4 ranks, over 2 ranks with segments of 64 tokens (sequences recomputed segment
// by segment: forward, recompute and backward rounds of different ranks mixed), and over 3
// ranks with a recorded routing replayed (R3: the episodes carry routing, [algo]
// routing_replay on); the supervised step over 3 ranks against mtrl_train_sft_step (its loss,
// gradients and parameters); with QB on over 3 and 4 ranks, and over 3 with the routing replayed:
// the loads equal one rank's exactly, β the same bits on every rank. Refusals: a dense model (no MoE layer), more ranks than experts.
// Each check was seen to fail with the exchange or the step broken on purpose (docs/multi-gpu.md
// §2 lists how). The model without experts elsewhere is the one-rank reference of every comparison here
// (mtrl_train_rl_step) and of tests/test_dist_dp.c, test_dist_ep.c and test_model.c.
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "common/rng.h"
#include "learner/dist_comm.h"
#include "learner/dist_dp.h"
#include "learner/dist_ep.h"
#include "learner/dist_plan.h"
#include "learner/train.h"
#include "model/model.h"
#include "model/qb.h"
#include "tests/testdist.h"
#include "tests/testdp.h"
#include "tests/testhelp.h"

// fp32 rounding of sums in another order (the ranks' units, the experts' rows source by source),
// through AdamW steps: as tests/test_dist_dp.c.
#define TOL_REL 1e-5
#define RMAX 4

static const test_dp_tol tol_ = {.stats = TOL_REL, .clip_abs = 1e-12, .grad = TOL_REL, .param_rel = TOL_REL,
                                 .param_lr_all = 0.01, .param_lr_most = 1e-4, .param_frac = 1e-4,
                                 .moments = TOL_REL, .m_elem_rel = 1e-4, .m_elem_abs = 1e-9};

// The reference's device (testdp.h reads it from the setup).
static const test_dp_setup cpu_ = {.device = MTRL_DEVICE_CPU, .model_ini = "", .gpu_buffers = -1};

typedef struct ep_ctx {
    tdp_ctx x;                   // what testdp.h's reference takes; out[r] each rank's state
    long rounds[RMAX], asked[RMAX], served[RMAX];
    int detached[RMAX];          // the model had no experts elsewhere after mtrl_dist_dp_free
} ep_ctx;

static void ep_rank_(mtrl_dist_comm *c, void *p) {
    ep_ctx *e = p;
    tdp_ctx *x = &e->x;
    int r = mtrl_dist_comm_rank(c);
    tdp_out *o = &x->out[r];
    mtrl_model m;
    if (tdp_model_(&m, x->cfg, x->qb_mode, MTRL_DEVICE_CPU, 0, o->msg, sizeof o->msg)) {
        o->st[0] = o->st[1] = MTRL_ERR_USAGE;
        return;
    }
    mtrl_dist_dp dp;
    mtrl_error err = {0};
    o->st[0] = mtrl_dist_dp_init_ep(&dp, c, &m, &err);
    if (o->st[0] != MTRL_OK) {
        snprintf(o->msg, sizeof o->msg, "%s", err.msg);
        mtrl_model_free(&m);
        return;
    }
    o->loads = calloc((size_t)m.dims.L * m.dims.E, sizeof(long));
    for (int s = 0; s < x->steps; s++) {
        o->stats[s].loads = o->loads;
        if (x->sft) o->st[s] = mtrl_dist_dp_sft_step(&dp, &m, x->cfg, x->eps, TDP_NEP, 3e-3, &o->stats[s].loss, &err);
        else o->st[s] = mtrl_dist_dp_rl_step(&dp, &m, x->cfg, x->algo, x->eps, TDP_NEP, &o->stats[s], &err);
        if (o->st[s] != MTRL_OK) snprintf(o->msg, sizeof o->msg, "%s", err.msg);
        tdp_snapshot_(o, &m, s);
    }
    e->rounds[r] = dp.wire.rounds;
    e->asked[r] = dp.wire.asked;
    e->served[r] = dp.wire.served;
    mtrl_dist_dp_free(&dp);
    e->detached[r] = m.experts == NULL; // checked on the main thread (the test counters are not atomic)
    mtrl_model_free(&m);
}

// Episode i with a recorded routing: K distinct experts per MoE layer and token.
static void routed_episode_(mtrl_traj *t, int i, int n_moe, int K, int E) {
    mtrl_traj src;
    mtrl_traj_init(&src);
    tdp_episode_(&src, i);
    mtrl_traj_reset(t);
    mtrl_traj_set_routing(t, (uint32_t)(n_moe * K), 0);
    t->episode_id = src.episode_id;
    t->group_id = src.group_id;
    uint64_t s = mtrl_rng_stream("test.dist_ep_dp.routing", (uint64_t)i, 0);
    uint8_t row[256];
    for (uint64_t j = 0; j < src.n_tokens; j++) {
        for (int l = 0; l < n_moe; l++) {
            int first = (int)(mtrl_rng_u64(3, s, j * 64 + (uint64_t)l) % (uint64_t)E);
            for (int k = 0; k < K; k++) row[l * K + k] = (uint8_t)((first + k * 3) % E); // distinct: E = 8, K = 2
        }
        mtrl_traj_append(t, src.ids[j], src.logprob[j], src.version[j], src.kind[j], row);
    }
    t->reward = src.reward;
    t->status = src.status;
    mtrl_traj_free(&src);
}

// Byte ranges of the parameter block (element pieces of the table).
typedef struct ranges {
    size_t n, *lo, *hi;
} ranges;

static void ranges_add_(ranges *g, const mtrl_tt *t, int tensor, size_t begin, size_t end) {
    g->lo = realloc(g->lo, sizeof(size_t) * (g->n + 1));
    g->hi = realloc(g->hi, sizeof(size_t) * (g->n + 1));
    g->lo[g->n] = t->items[tensor].offset + begin * sizeof(real);
    g->hi[g->n] = t->items[tensor].offset + end * sizeof(real);
    g->n++;
}

static void ranges_free_(ranges *g) {
    free(g->lo), free(g->hi);
    memset(g, 0, sizeof *g);
}

// max |a - b| / max |b| over the ranges.
static double ranges_rel_(const ranges *g, const real *a, const real *b) {
    double num = 0, den = 0;
    for (size_t k = 0; k < g->n; k++)
        for (size_t i = g->lo[k] / sizeof(real); i < g->hi[k] / sizeof(real); i++) {
            double d = fabs((double)a[i] - (double)b[i]);
            if (d > num) num = d;
            if (fabs((double)b[i]) > den) den = fabs((double)b[i]);
        }
    return den > 0 ? num / den : num;
}

// Rank r's pieces of the layout: own (experts + non-expert shard), cmp (own experts + every
// non-expert tensor: what it must hold right), other (the other ranks' experts), dense (every
// non-expert tensor).
typedef struct rank_sets {
    ranges own, cmp, other, dense;
} rank_sets;

static void rank_sets_(rank_sets *s, const mtrl_dist_ep_layout *l, const mtrl_tt *t, int r) {
    memset(s, 0, sizeof *s);
    const mtrl_dist_ep_rank *h = &l->rank[r];
    for (int j = h->first_piece; j < h->first_piece + h->n_piece; j++) {
        const mtrl_dist_piece *p = &l->piece[j];
        ranges_add_(&s->own, t, p->tensor, p->begin, p->end);
        if (j < h->first_piece + h->n_expert_piece) ranges_add_(&s->cmp, t, p->tensor, p->begin, p->end);
    }
    for (int i = 0; i < t->n; i++) {
        size_t n = t->items[i].numel;
        if (!mtrl_model_param_is_routed_expert(t->items[i].name)) {
            ranges_add_(&s->cmp, t, i, 0, n);
            ranges_add_(&s->dense, t, i, 0, n);
            continue;
        }
        size_t per = n / (size_t)l->experts.E, b = per * (size_t)l->experts.first[r],
               e = per * (size_t)l->experts.first[r + 1];
        if (b > 0) ranges_add_(&s->other, t, i, 0, b);
        if (e < n) ranges_add_(&s->other, t, i, e, n);
    }
}

static void rank_sets_free_(rank_sets *s) {
    ranges_free_(&s->own), ranges_free_(&s->cmp), ranges_free_(&s->other), ranges_free_(&s->dense);
}

typedef struct ep_case {
    mtrl_config cfg;
    mtrl_algo_config algo;
    mtrl_traj tr[TDP_NEP], *eps[TDP_NEP];
    ep_ctx e;
    tdp_out ref;
    mtrl_model_dims d;
    mtrl_tt t;
    mtrl_dist_ep_layout l;
} ep_case;

// The step over R ranks and one rank's on the same batch; routed: the episodes carry routing.
static ep_case *ep_case_run_(int R, const char *extra, int steps, int qb_mode, int routed, int sft) {
    ep_case *c = calloc(1, sizeof *c);
    tdp_config_(&c->cfg, "", extra);
    TEST_EQ_INT(mtrl_train_algo_config(&c->cfg, &c->algo, NULL), MTRL_OK);
    TEST_EQ_INT(mtrl_model_dims_from_config(&c->d, &c->cfg, MTRL_VOCAB, NULL), MTRL_OK);
    for (int i = 0; i < TDP_NEP; i++) {
        mtrl_traj_init(&c->tr[i]);
        if (routed) routed_episode_(&c->tr[i], i, c->d.n_moe, c->d.k, c->d.E);
        else tdp_episode_(&c->tr[i], i);
        c->eps[i] = &c->tr[i];
    }
    c->e.x = (tdp_ctx){.cfg = &c->cfg, .algo = &c->algo, .eps = c->eps, .steps = steps, .qb_mode = qb_mode,
                        .sft = sft, .u = &cpu_};
    tdp_reference_(&c->e.x, &c->ref);
    test_dist_run_local(R, 60000, -1, ep_rank_, &c->e);
    mtrl_model_param_table(&c->t, &c->d);
    mtrl_dist_experts x;
    mtrl_error err = {0};
    TEST_EQ_INT(mtrl_dist_experts_make(&x, c->d.E, R, &err), MTRL_OK);
    TEST_EQ_INT(mtrl_dist_ep_layout_make(&c->l, &c->t, &x, MTRL_DIST_SHARD_ALIGN, &err), MTRL_OK);
    return c;
}

static void ep_case_free_(ep_case *c, int R) {
    for (int r = 0; r < R; r++) tdp_out_free_(&c->e.x.out[r]);
    tdp_out_free_(&c->ref);
    for (int i = 0; i < TDP_NEP; i++) mtrl_traj_free(&c->tr[i]);
    mtrl_dist_ep_layout_free(&c->l);
    mtrl_tt_free(&c->t);
    free(c);
}

// Every element of g within tol (testdp.h's rule); returns the number beyond param_lr_most.
static size_t params_check_(const ranges *g, const real *a, const real *b, double lr, const char *what, int r, int s,
                            size_t *count, double *beyond) {
    size_t off = 0, far = 0, n = 0;
    for (size_t k = 0; k < g->n; k++)
        for (size_t i = g->lo[k] / sizeof(real); i < g->hi[k] / sizeof(real); i++, n++) {
            double d = fabs((double)a[i] - (double)b[i]), v = fabs((double)b[i]);
            off += d > tol_.param_rel * v + tol_.param_lr_most * lr;
            far += d > tol_.param_rel * v + tol_.param_lr_all * lr;
            if ((d - tol_.param_rel * v) / lr > *beyond) *beyond = (d - tol_.param_rel * v) / lr;
        }
    TEST_CHECKF(far == 0, "%s rank %d step %d: %zu of %zu parameters beyond %g relative and %g lr", what, r, s + 1, far, n,
                tol_.param_rel, tol_.param_lr_all);
    TEST_CHECKF((double)off <= tol_.param_frac * (double)n, "%s rank %d step %d: %zu of %zu parameters beyond %g "
                "relative and %g lr (at most %.3g%% may be)", what, r, s + 1, off, n, tol_.param_rel,
                tol_.param_lr_most, 100 * tol_.param_frac);
    *count = n;
    return off;
}

// The checks of the file's header over R ranks.
// sft: the supervised step (its loss alone of the statistics).
static void ep_compare_(int R, const char *extra, int steps, int routed, int sft, const char *what) {
    ep_case *c = ep_case_run_(R, extra, steps, MTRL_QB_FROZEN, routed, sft);
    tdp_ctx *x = &c->e.x;
    const tdp_out *ref = &c->ref;
    double lr = c->cfg.learner.lr;
    char where[512];
    for (int s = 0; s < steps; s++) {
        const mtrl_step_stats *w = &ref->stats[s];
        printf("%s, %d ranks, step %d: loss %.9g grad_norm %.9g (one rank: %.9g, %.9g)\n", what, R, s + 1,
               x->out[0].stats[s].loss, x->out[0].stats[s].grad_norm, w->loss, w->grad_norm);
        if (strstr(what, "clipped"))
            TEST_CHECKF(w->grad_norm > 0.05, "%s: norm %.3g, clipping at 0.05 not active", what, w->grad_norm);
        for (int r = 0; r < R; r++) {
            tdp_out *o = &x->out[r];
            TEST_CHECKF(o->st[s] == MTRL_OK, "%s rank %d step %d: %s", what, r, s + 1, o->msg);
            if (o->st[s] != MTRL_OK || !o->params[s]) continue;
            const mtrl_step_stats *g = &o->stats[s];
            TEST_CLOSE(g->loss, w->loss, tol_.stats, 1e-9);
            if (!sft) {
                TEST_CLOSE(g->grad_norm, w->grad_norm, tol_.stats, 0);
                TEST_CLOSE(g->pg_loss, w->pg_loss, tol_.stats, 1e-9);
                TEST_CLOSE(g->entropy_mean, w->entropy_mean, tol_.stats, 0);
                TEST_CLOSE(g->ratio_mean, w->ratio_mean, tol_.stats, 0);
                TEST_CLOSE(g->kl_k3, w->kl_k3, tol_.stats, 1e-12);
                TEST_CLOSE(g->clip_low + g->clip_high + g->clip_dual, w->clip_low + w->clip_high + w->clip_dual, 0,
                           tol_.clip_abs);
                TEST_EQ_INT(g->tokens, w->tokens);
                TEST_EQ_INT(g->model_tokens, w->model_tokens);
                TEST_EQ_INT(g->groups, w->groups);
            }
            rank_sets k;
            rank_sets_(&k, &c->l, &c->t, r);
            double eg = ranges_rel_(&k.own, o->grads[s], ref->grads[s]);
            TEST_CHECKF(eg <= tol_.grad, "%s rank %d step %d: its own gradients (experts + shard) off by %.3g of their "
                        "largest (limit %g)", what, r, s + 1, eg, tol_.grad);
            int nonzero = 0;
            for (size_t q = 0; q < k.other.n; q++)
                for (size_t i = k.other.lo[q] / sizeof(real); i < k.other.hi[q] / sizeof(real); i++)
                    nonzero += o->grads[s][i] != 0;
            TEST_CHECKF(nonzero == 0, "%s rank %d step %d: %d gradient elements of other ranks' experts are not zero",
                        what, r, s + 1, nonzero);
            size_t n = 0;
            double beyond = 0;
            size_t off = params_check_(&k.cmp, o->params[s], ref->params[s], lr, what, r, s, &n, &beyond);
            double ep = ranges_rel_(&k.cmp, o->params[s], ref->params[s]);
            printf("  rank %d: own gradients off by %.3g; %zu of %zu parameters (own experts + non-expert) beyond %g "
                   "relative and %g lr, the worst %.3g lr beyond; largest difference %.3g of the largest\n",
                   r, eg, off, n, tol_.param_rel, tol_.param_lr_most, beyond, ep);
            if (r && x->out[0].params[s]) {
                int same = 1;
                for (size_t q = 0; q < k.dense.n; q++)
                    same &= !memcmp((char *)o->params[s] + k.dense.lo[q], (char *)x->out[0].params[s] + k.dense.lo[q],
                                    k.dense.hi[q] - k.dense.lo[q]);
                TEST_CHECKF(same, "%s step %d: rank %d's non-expert parameters differ from rank 0's (worst %s)", what,
                            s + 1, r, tdp_worst_(&c->cfg, o->params[s], x->out[0].params[s], 0, c->t.total, where,
                                                 sizeof where));
            }
            if (s == 1) {
                double em = ranges_rel_(&k.own, o->adam_m, ref->adam_m), ev = ranges_rel_(&k.own, o->adam_v, ref->adam_v);
                printf("  rank %d own moments after step 2: m off by %.3g, v by %.3g\n", r, em, ev);
                TEST_CHECKF(em <= tol_.moments && ev <= tol_.moments, "%s rank %d: own moments off by %.3g (m), %.3g "
                            "(v) of their largest (limit %g)", what, r, em, ev, tol_.moments);
            }
            rank_sets_free_(&k);
        }
    }
    for (int r = 0; r < R; r++) {
        printf("  rank %d: %ld rounds, %ld asked, %ld rows served\n", r, c->e.rounds[r], c->e.asked[r], c->e.served[r]);
        TEST_CHECKF(c->e.asked[r] > 0 && c->e.served[r] > 0, "%s rank %d: asked %ld rounds, served %ld rows", what, r,
                    c->e.asked[r], c->e.served[r]);
        TEST_CHECKF(c->e.detached[r], "%s rank %d: the model keeps its experts elsewhere after mtrl_dist_dp_free", what,
                    r);
    }
    ep_case_free_(c, R);
}

// QB on: the loads of the ranks equal one rank's, β the same bits on every rank (and moved).
// routed: with a recorded routing replayed (R3): the loads are the replayed routing's.
static void ep_qb_(int R, int routed) {
    ep_case *c = ep_case_run_(R, routed ? "[algo]\nrouting_replay = true\n" : "", 1, MTRL_QB_TRAIN, routed, 0);
    tdp_ctx *x = &c->e.x;
    size_t LE = (size_t)c->d.L * c->d.E;
    int changed = 0;
    for (size_t i = 0; i < LE; i++) changed += x->out[0].qb_beta && x->out[0].qb_beta[i] != 0;
    TEST_CHECKF(changed > 0, "QB did not move β over %d ranks", R);
    for (int r = 0; r < R; r++) {
        TEST_CHECKF(x->out[r].st[0] == MTRL_OK, "QB rank %d: %s", r, x->out[r].msg);
        if (x->out[r].st[0] != MTRL_OK) continue;
        TEST_CHECKF(!memcmp(x->out[r].loads, c->ref.loads, sizeof(long) * LE), "QB %d ranks: rank %d's loads differ from "
                    "one rank's", R, r);
        TEST_CHECKF(!memcmp(x->out[r].qb_beta, x->out[0].qb_beta, sizeof(real) * LE), "QB %d ranks: rank %d's β differs "
                    "from rank 0's", R, r);
        for (int l = c->d.first_dense; l < c->d.L; l++)
            TEST_CLOSE(x->out[r].stats[0].max_violation[l], c->ref.stats[0].max_violation[l], 0, 1e-12);
    }
    printf("QB over %d ranks%s: loads equal one rank's, β the same on every rank (%d of %zu entries moved)\n", R,
           routed ? " (R3)" : "", changed, LE);
    ep_case_free_(c, R);
}

// Refusals, each with its message.
typedef struct refuse_ctx {
    mtrl_config cfg;
    mtrl_status st[RMAX];
    char msg[RMAX][MTRL_ERROR_MSG_MAX];
    int detached[RMAX];
} refuse_ctx;

static void refuse_rank_(mtrl_dist_comm *c, void *p) {
    refuse_ctx *x = p;
    int r = mtrl_dist_comm_rank(c);
    mtrl_model m;
    if (tdp_model_(&m, &x->cfg, MTRL_QB_FROZEN, MTRL_DEVICE_CPU, 0, x->msg[r], sizeof x->msg[r])) {
        x->st[r] = MTRL_ERR_USAGE;
        return;
    }
    mtrl_dist_dp dp;
    mtrl_error err = {0};
    x->st[r] = mtrl_dist_dp_init_ep(&dp, c, &m, &err);
    snprintf(x->msg[r], sizeof x->msg[r], "%s", err.msg);
    if (x->st[r] == MTRL_OK) mtrl_dist_dp_free(&dp);
    x->detached[r] = m.experts == NULL;
    mtrl_model_free(&m);
}

static void test_refusals_(void) {
    static refuse_ctx x, y;
    tdp_config_(&x.cfg, "dense_layers = 4\n", ""); // loaded here: the test counters are not atomic
    tdp_config_(&y.cfg, "experts = 3\ntop_k = 2\n", "");
    test_dist_run_local(2, 5000, -1, refuse_rank_, &x);
    for (int r = 0; r < 2; r++) {
        TEST_EQ_INT(x.st[r], MTRL_ERR_USAGE);
        TEST_CONTAINS(x.msg[r], "no MoE layer");
        TEST_CHECK(x.detached[r]);
    }
    test_dist_run_local(4, 5000, -1, refuse_rank_, &y);
    for (int r = 0; r < 4; r++) {
        TEST_EQ_INT(y.st[r], MTRL_ERR_USAGE);
        TEST_CONTAINS(y.msg[r], "3");
        TEST_CONTAINS(y.msg[r], "4");
        TEST_CHECK(y.detached[r]);
    }
    printf("refused: %s / %s\n", x.msg[0], y.msg[0]);
}

int main(void) {
    test_refusals_();
    const char *clip = "grad_clip = 0.05\n[algo]\nmask_truncated = true\n";
    ep_compare_(1, clip, 2, 0, 0, "ep rl clipped");
    ep_compare_(2, clip, 2, 0, 0, "ep rl clipped");
    ep_compare_(3, clip, 2, 0, 0, "ep rl clipped");
    ep_compare_(4, clip, 2, 0, 0, "ep rl clipped");
    ep_compare_(2, "grad_clip = 0.05\nsegment = 64\n", 1, 0, 0, "ep rl clipped seg64");
    ep_compare_(3, "grad_clip = 0.05\n[algo]\nrouting_replay = true\n", 2, 1, 0, "ep rl clipped R3");
    ep_compare_(3, "grad_clip = 0.05\n", 1, 0, 1, "ep sft");
    ep_qb_(3, 0);
    ep_qb_(4, 0);
    ep_qb_(3, 1);
    return test_report();
}
