// mtrl-test: cpu
// The data-parallel learner's data path on threads (issue 27): the local communicator
// (learner/dist_comm.h) and the DP step (learner/dist_dp.h).
//   * every local collective's result, exactly (values whose sums are exact, and a sum whose
//     value depends on the order: rank order, the same bits on every rank), in place and not;
//     the all-to-all-v with the counts and offsets of learner/dist_plan.h's exchange;
//   * a rank that never arrives: the others return MTRL_ERR_TIMEOUT within the 200 ms timeout
//     naming the op, themselves, the timeout and the missing rank; the late rank then gets
//     MTRL_ERR_STATE; ranks calling different collectives get MTRL_ERR_MISMATCH;
//   * the DP RL step over 2 and 3 ranks against one rank's mtrl_train_rl_step on the same
//     batch of mixed-length episodes (groups interleaved, a truncated one masked, tool
//     tokens, stale tokens at the second step): the loss and the other statistics, the
//     gradient norm (clipping active), each rank's reduced and clipped gradient shard, every
//     parameter after each of two steps, and each rank's shard of both AdamW moments after
//     the second; the replicas' parameters equal bit for bit; a second configuration
//     (seq_mean_token_mean, entropy bonus, segments of 64 tokens) over 2 ranks; the DP
//     supervised step against mtrl_train_sft_step;
//   * with QB on, the routing loads summed over the ranks equal one rank's, and β is the same
//     on every rank, bit for bit.
// Tolerances: the ranks' gradients are summed in another order than one rank's backward sums
// them (fp32), so values are compared with a relative tolerance (TOL_REL below, stated per
// check); equality across ranks is exact.
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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
#include "tests/testlocal.h"

// fp32 rounding of a sum in another order, through one AdamW step (lr-sized, so parameters
// move by at most lr per step and differ by rounding of that).
#define TOL_REL 1e-5

// ---- the collectives (tests/testdist.h) on host memory ------------------------------------------

static void *host_alloc_(size_t n) { return calloc(1, n); }
static void host_copy_(void *dst, const void *src, size_t n) { memcpy(dst, src, n); }
static const test_dist_mem host_mem_ = {host_alloc_, host_copy_, host_copy_, free};

static void test_ops_(int R) {
    test_dist_ops *x = calloc(1, sizeof *x);
    x->mem = &host_mem_;
    test_local_run(R, 5000, test_dist_ops_rank, x);
    test_dist_ops_check(x, R, 1, "local");
    free(x);
}

// One rank never arrives; it calls only after the others returned.
typedef struct timeout_ctx {
    mtrl_status st[3], late;
    char msg[3][MTRL_ERROR_MSG_MAX], late_msg[MTRL_ERROR_MSG_MAX];
    double waited[3];
    atomic_int returned;
} timeout_ctx;

static void timeout_rank_(mtrl_dist_comm *c, void *p) {
    timeout_ctx *x = p;
    int r = mtrl_dist_comm_rank(c);
    mtrl_error err = {0};
    float v = 1;
    if (r == 2) {
        while (atomic_load(&x->returned) < 2) nanosleep(&(struct timespec){0, 1000000}, NULL);
        x->late = mtrl_dist_comm_allreduce(c, &v, 1, MTRL_DT_F32, &err);
        snprintf(x->late_msg, sizeof x->late_msg, "%s", err.msg);
        return;
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    x->st[r] = mtrl_dist_comm_allreduce(c, &v, 1, MTRL_DT_F32, &err);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    x->waited[r] = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
    snprintf(x->msg[r], sizeof x->msg[r], "%s", err.msg);
    atomic_fetch_add(&x->returned, 1);
}

// Two ranks calling different collectives.
typedef struct mismatch_ctx {
    mtrl_status st[2], op[2];
    char msg[2][MTRL_ERROR_MSG_MAX];
} mismatch_ctx;

static void mismatch_rank_(mtrl_dist_comm *c, void *p) {
    mismatch_ctx *x = p;
    int r = mtrl_dist_comm_rank(c);
    float v[5] = {0};
    mtrl_error err = {0};
    x->st[r] = mtrl_dist_comm_allreduce(c, v, r ? 5 : 4, MTRL_DT_F32, &err);
    snprintf(x->msg[r], sizeof x->msg[r], "%s", err.msg);
}

static void mismatch_op_rank_(mtrl_dist_comm *c, void *p) {
    mismatch_ctx *x = p;
    int r = mtrl_dist_comm_rank(c);
    unsigned char b[4] = {0};
    x->op[r] = r ? mtrl_dist_comm_broadcast(c, b, 4, 0, NULL) : mtrl_dist_comm_barrier(c, NULL);
}

static void test_failures_(void) {
    timeout_ctx *x = calloc(1, sizeof *x);
    test_local_run(3, 200, timeout_rank_, x);
    for (int r = 0; r < 2; r++) {
        TEST_EQ_INT(x->st[r], MTRL_ERR_TIMEOUT);
        char me[32];
        snprintf(me, sizeof me, "rank %d of 3", r);
        TEST_CONTAINS(x->msg[r], "all_reduce");
        TEST_CONTAINS(x->msg[r], me);
        TEST_CONTAINS(x->msg[r], "200 ms");
        TEST_CONTAINS(x->msg[r], "rank(s) 2 did not arrive");
        printf("timeout: rank %d returned after %.0f ms: %s\n", r, x->waited[r], x->msg[r]);
    }
    TEST_EQ_INT(x->late, MTRL_ERR_STATE);
    TEST_CONTAINS(x->late_msg, "failed earlier");
    free(x);

    mismatch_ctx *m = calloc(1, sizeof *m);
    test_local_run(2, 2000, mismatch_rank_, m);
    test_local_run(2, 2000, mismatch_op_rank_, m);
    for (int r = 0; r < 2; r++) {
        TEST_EQ_INT(m->st[r], MTRL_ERR_MISMATCH);
        TEST_CONTAINS(m->msg[r], "different collectives");
        TEST_EQ_INT(m->op[r], MTRL_ERR_MISMATCH);
    }
    free(m);

    mtrl_dist_world *w = NULL;
    mtrl_error err;
    TEST_EQ_INT(mtrl_dist_world_init(&w, 0, 100, &err), MTRL_ERR_USAGE);
    TEST_EQ_INT(mtrl_dist_world_init(&w, 2, 0, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "timeout");
    TEST_EQ_INT(mtrl_dist_world_init(&w, 2, 100, &err), MTRL_OK);
    mtrl_dist_comm *a = NULL, *b = NULL;
    TEST_EQ_INT(mtrl_dist_comm_init_local(&a, w, 1, &err), MTRL_OK);
    TEST_EQ_INT(mtrl_dist_comm_init_local(&b, w, 1, &err), MTRL_ERR_USAGE);
    TEST_EQ_INT(mtrl_dist_comm_init_local(&b, w, 2, &err), MTRL_ERR_USAGE);
    mtrl_dist_comm_free(a);
    mtrl_dist_world_free(w);
}

// The file bootstrap of the NCCL backend's id (plain files: no GPU needed).
static void test_bootstrap_(void) {
    char path[256];
    snprintf(path, sizeof path, "/tmp/mtrl_test_dist_dp_id.%ld", (long)getpid());
    unlink(path);
    unsigned char id[128], got[128] = {0};
    for (int i = 0; i < 128; i++) id[i] = (unsigned char)(i * 13 + 5);
    mtrl_error err;
    TEST_EQ_INT(mtrl_dist_bootstrap_file(path, 0, 2, id, sizeof id, 100, &err), MTRL_OK);
    TEST_EQ_INT(mtrl_dist_bootstrap_file(path, 1, 2, got, sizeof got, 100, &err), MTRL_OK);
    TEST_CHECK(!memcmp(id, got, sizeof id));
    TEST_EQ_INT(mtrl_dist_bootstrap_file(path, 0, 2, id, sizeof id, 100, &err), MTRL_ERR_STATE); // another world's
    TEST_CONTAINS(err.msg, "exists");
    unlink(path);
    TEST_EQ_INT(mtrl_dist_bootstrap_file(path, 1, 2, got, sizeof got, 100, &err), MTRL_ERR_TIMEOUT);
    TEST_CONTAINS(err.msg, path);
    TEST_CONTAINS(err.msg, "100 ms");
}

// ---- the DP step ------------------------------------------------------------------------------

enum { NEP = 10 };
static const int lens_[NEP] = {17, 40, 95, 130, 23, 64, 8, 150, 33, 77};

// Episode i: BOS and a prompt, then model tokens with a tool result in the middle, behaviour
// log-probs away from the learner's (ratios off 1, clipping and TIS at work), groups
// interleaved (group_id i % 3), episode 5 truncated (masked by mask_truncated).
static void episode_(mtrl_traj *t, int i) {
    mtrl_traj_reset(t);
    t->episode_id = (uint64_t)i;
    t->group_id = (uint64_t)(i % 3);
    uint64_t s = mtrl_rng_stream("test.dist_dp", (uint64_t)i, 0);
    int prompt = 3 + i % 5;
    for (int j = 0; j < lens_[i]; j++) {
        uint32_t id = j == 0 ? MTRL_TOK_BOS : (uint32_t)(mtrl_rng_u64(5, s, (uint64_t)j) % 256);
        uint8_t kind = j < prompt ? MTRL_TOK_PROMPT : (j / 11) % 3 == 2 ? MTRL_TOK_TOOL : MTRL_TOK_MODEL;
        float lp = kind == MTRL_TOK_MODEL ? (float)(-4.0 - 2.0 * mtrl_rng_uniform(5, s, 1000 + (uint64_t)j)) : 0.0f;
        mtrl_traj_append(t, id, lp, 0, kind, NULL);
    }
    t->reward = (double)(i * 7 % 5) / 4.0;
    t->status = i == 5 ? MTRL_EP_TRUNCATED : MTRL_EP_COMPLETE;
}

static void config_(mtrl_config *cfg, const char *extra) {
    char text[1024];
    snprintf(text, sizeof text,
             "[run]\nseed = 1\n[model]\npreset = tiny\n[env]\nname = calc\n[learner]\nlr = 0.003\nweight_decay = 0.1\n"
             "%s", extra);
    mtrl_config_errors errs = {0};
    mtrl_status s = mtrl_config_load_text(cfg, "t.ini", text, NULL, 0, &errs);
    if (s != MTRL_OK) mtrl_config_errors_print(&errs, stderr);
    mtrl_config_errors_free(&errs);
    TEST_EQ_INT(s, MTRL_OK);
}

static void model_(mtrl_model *m, const mtrl_config *cfg, int qb_mode) {
    mtrl_model_dims d;
    TEST_EQ_INT(mtrl_model_dims_from_config(&d, cfg, MTRL_VOCAB, NULL), MTRL_OK);
    mtrl_model_init(m, &d, 11);
    // β changes with QB on from the units a rank runs (dist_dp.h), so the comparisons with one
    // rank over two steps keep it frozen; test_qb_ checks the reduction with QB on.
    mtrl_qb_set_mode(m, qb_mode);
}

// What one rank (or the one-rank reference) leaves after each step.
typedef struct step_out {
    mtrl_status st[2];
    char msg[MTRL_ERROR_MSG_MAX];
    mtrl_step_stats stats[2];
    real *params[2], *grads[2], *adam_m, *adam_v, *qb_beta;
    long *loads;
    size_t lo, hi;            // the bytes of its shard (one rank: the whole block)
} step_out;

typedef struct dp_ctx {
    const mtrl_config *cfg;
    const mtrl_algo_config *algo;
    mtrl_traj *const *eps;
    int steps, qb_mode, sft;
    int odd_rank;             // > 0: rank odd_rank - 1 is given the batch less its first episode
    step_out out[MTRL_DIST_RANKS_MAX];
} dp_ctx;

static real *copy_(const void *p, size_t bytes) {
    real *c = malloc(bytes);
    memcpy(c, p, bytes);
    return c;
}

static void snapshot_(step_out *o, const mtrl_model *m, int step) {
    size_t n = m->params.total;
    o->params[step] = copy_(m->params.base, n);
    o->grads[step] = copy_(m->grads, n);
    o->adam_m = copy_(m->adam_m, n);
    o->adam_v = copy_(m->adam_v, n);
    o->qb_beta = copy_(m->qb_beta, sizeof(real) * (size_t)m->dims.L * m->dims.E);
}

static void step_out_free_(step_out *o) {
    for (int s = 0; s < 2; s++) free(o->params[s]), free(o->grads[s]);
    free(o->adam_m), free(o->adam_v), free(o->qb_beta), free(o->loads);
}

static void dp_rank_(mtrl_dist_comm *c, void *p) {
    dp_ctx *x = p;
    int r = mtrl_dist_comm_rank(c);
    step_out *o = &x->out[r];
    mtrl_model m;
    model_(&m, x->cfg, x->qb_mode);
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
        if (x->sft) o->st[s] = mtrl_dist_dp_sft_step(&dp, &m, x->cfg, eps, NEP - odd, 3e-3, &o->stats[s].loss, &err);
        else o->st[s] = mtrl_dist_dp_rl_step(&dp, &m, x->cfg, x->algo, eps, NEP - odd, &o->stats[s], &err);
        if (o->st[s] != MTRL_OK) snprintf(o->msg, sizeof o->msg, "%s", err.msg);
        snapshot_(o, &m, s);
    }
    mtrl_dist_dp_free(&dp);
    mtrl_model_free(&m);
}

static void reference_(dp_ctx *x, step_out *o) {
    mtrl_model m;
    model_(&m, x->cfg, x->qb_mode);
    o->lo = 0;
    o->hi = m.params.total;
    o->loads = calloc((size_t)m.dims.L * m.dims.E, sizeof(long));
    for (int s = 0; s < x->steps; s++) {
        o->stats[s].loads = o->loads;
        if (x->sft) o->stats[s].loss = mtrl_train_sft_step(&m, x->cfg, x->eps, NEP, 3e-3);
        else mtrl_train_rl_step(&m, x->cfg, x->algo, x->eps, NEP, &o->stats[s]);
        snapshot_(o, &m, s);
    }
    mtrl_model_free(&m);
}

// max |a - b| / max |b| over bytes [lo, hi) of two blocks (0 for an empty range).
static double block_rel_(const real *a, const real *b, size_t lo, size_t hi) {
    double num = 0, den = 0;
    for (size_t i = lo / sizeof(real); i < hi / sizeof(real); i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (d > num) num = d;
        if (fabs((double)b[i]) > den) den = fabs((double)b[i]);
    }
    return den > 0 ? num / den : num;
}

// One comparison: the config, the batch, the ranks' outputs and one rank's (ref).
typedef struct dp_case {
    mtrl_config cfg;
    mtrl_algo_config algo;
    mtrl_traj tr[NEP], *eps[NEP];
    dp_ctx x;
    step_out ref;
} dp_case;

// Runs the DP step on R ranks (timeout_ms) and, with ref, one rank's step on the same batch.
static dp_case *dp_case_run_(int R, int timeout_ms, const char *extra, dp_ctx x, int ref) {
    dp_case *c = calloc(1, sizeof *c);
    config_(&c->cfg, extra);
    TEST_EQ_INT(mtrl_train_algo_config(&c->cfg, &c->algo, NULL), MTRL_OK);
    for (int i = 0; i < NEP; i++) mtrl_traj_init(&c->tr[i]), episode_(&c->tr[i], i), c->eps[i] = &c->tr[i];
    c->x = x;
    c->x.cfg = &c->cfg;
    c->x.algo = &c->algo;
    c->x.eps = c->eps;
    if (ref) reference_(&c->x, &c->ref);
    test_local_run(R, timeout_ms, dp_rank_, &c->x);
    return c;
}

static void dp_case_free_(dp_case *c, int R) {
    for (int r = 0; r < R; r++) step_out_free_(&c->x.out[r]);
    step_out_free_(&c->ref);
    for (int i = 0; i < NEP; i++) mtrl_traj_free(&c->tr[i]);
    free(c);
}

// The DP step on R ranks against one rank, for config text `extra`.
static void test_dp_(int R, const char *extra, int steps, int sft, const char *what) {
    dp_case *c = dp_case_run_(R, 60000, extra, (dp_ctx){.steps = steps, .qb_mode = MTRL_QB_FROZEN, .sft = sft}, 1);
    dp_ctx *x = &c->x;
    const mtrl_config cfg = c->cfg;
    step_out ref = c->ref;
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
            step_out *o = &x->out[r];
            TEST_CHECKF(o->st[s] == MTRL_OK, "%s rank %d step %d: %s", what, r, s + 1, o->msg);
            const mtrl_step_stats *g = &o->stats[s];
            TEST_CLOSE(g->loss, w->loss, TOL_REL, 1e-9);
            if (!sft) {
                TEST_CLOSE(g->grad_norm, w->grad_norm, TOL_REL, 0);
                TEST_CLOSE(g->pg_loss, w->pg_loss, TOL_REL, 1e-9);
                TEST_CLOSE(g->entropy_mean, w->entropy_mean, TOL_REL, 0);
                TEST_CLOSE(g->ratio_mean, w->ratio_mean, TOL_REL, 0);
                TEST_CLOSE(g->kl_k3, w->kl_k3, TOL_REL, 1e-12);
                TEST_CLOSE(g->clip_low + g->clip_high + g->clip_dual, w->clip_low + w->clip_high + w->clip_dual, 0, 1e-12);
                TEST_EQ_INT(g->tokens, w->tokens);
                TEST_EQ_INT(g->model_tokens, w->model_tokens);
                TEST_EQ_INT(g->groups, w->groups);
                TEST_CLOSE(g->staleness_mean, w->staleness_mean, 0, 1e-12);
                TEST_CLOSE(g->reward_mean, w->reward_mean, 0, 1e-12);
                // The rank's shard of the reduced gradients, clipped as one rank clips them.
                double eg = block_rel_(o->grads[s], ref.grads[s], o->lo, o->hi);
                TEST_CHECKF(eg <= TOL_REL, "%s rank %d step %d: gradient shard off by %.3g (relative to its largest)",
                            what, r, s + 1, eg);
            }
            double ep = block_rel_(o->params[s], ref.params[s], 0, total);
            if (ep > worst_p) worst_p = ep;
            // Elementwise. AdamW moves a parameter by lr g / (|g| + eps) at the first step: a
            // gradient of about eps (1e-8), left by cancellation, changes its update by a
            // fraction of lr when the two summation orders round it differently (a few in
            // 10^4 of the parameters here, by up to ~1.5e-3 lr). So every parameter within
            // TOL_REL or 0.01 lr, and all but 0.01% within TOL_REL or 1e-4 lr.
            size_t np = total / sizeof(real), off = 0;
            TEST_ARRAY_CLOSE(o->params[s], ref.params[s], np, TOL_REL, 0.01 * cfg.learner.lr);
            for (size_t i = 0; i < np; i++)
                off += fabs((double)o->params[s][i] - (double)ref.params[s][i]) > TOL_REL * fabs((double)ref.params[s][i]) + 1e-4 * cfg.learner.lr;
            TEST_CHECKF(off * 10000 <= np, "%s rank %d step %d: %zu of %zu parameters beyond %g relative and 1e-4 lr", what,
                        r, s + 1, off, np, TOL_REL);
            if (r == 0) printf("  %zu of %zu parameters beyond %g relative and 1e-4 lr\n", off, np, TOL_REL);
            if (r) TEST_CHECKF(!memcmp(o->params[s], x->out[0].params[s], total), "%s step %d: rank %d's parameters "
                               "differ from rank 0's", what, s + 1, r);
        }
        printf("  parameters: largest difference from one rank %.3g of the largest parameter\n", worst_p);
    }
    if (steps == 2)
        for (int r = 0; r < R; r++) {
            step_out *o = &x->out[r];
            double em = block_rel_(o->adam_m, ref.adam_m, o->lo, o->hi), ev = block_rel_(o->adam_v, ref.adam_v, o->lo, o->hi);
            printf("  rank %d moments of bytes [%zu, %zu): m off by %.3g, v by %.3g\n", r, o->lo, o->hi, em, ev);
            TEST_CHECKF(em <= TOL_REL && ev <= TOL_REL, "%s rank %d: moments off by %.3g, %.3g", what, r, em, ev);
            TEST_ARRAY_CLOSE(o->adam_m + o->lo / sizeof(real), ref.adam_m + o->lo / sizeof(real),
                             (o->hi - o->lo) / sizeof(real), 1e-4, 1e-9);
        }
    dp_case_free_(c, R);
}

// With QB on: the loads of the ranks' shares add up to one rank's, and β is the same on every
// rank.
static void test_qb_(int R) {
    dp_case *c = dp_case_run_(R, 60000, "", (dp_ctx){.steps = 1, .qb_mode = MTRL_QB_TRAIN}, 1);
    dp_ctx *x = &c->x;
    const mtrl_config cfg = c->cfg;
    step_out ref = c->ref;
    mtrl_model_dims d;
    TEST_EQ_INT(mtrl_model_dims_from_config(&d, &cfg, MTRL_VOCAB, NULL), MTRL_OK);
    size_t LE = (size_t)d.L * d.E;
    int changed = 0;
    for (size_t i = 0; i < LE; i++) changed += x->out[0].qb_beta[i] != 0;
    TEST_CHECKF(changed > 0, "QB did not move β");
    for (int r = 0; r < R; r++) {
        TEST_EQ_INT(x->out[r].st[0], MTRL_OK);
        TEST_CHECKF(!memcmp(x->out[r].loads, ref.loads, sizeof(long) * LE), "rank %d: loads differ from one rank's", r);
        TEST_CHECKF(!memcmp(x->out[r].qb_beta, x->out[0].qb_beta, sizeof(real) * LE), "rank %d: β differs from rank 0's", r);
        for (int l = d.first_dense; l < d.L; l++)
            TEST_CLOSE(x->out[r].stats[0].max_violation[l], ref.stats[0].max_violation[l], 0, 1e-12);
    }
    dp_case_free_(c, R);
}

// Ranks given different batches: every rank's step fails (the count check, or a peer that left
// at it), at least one naming the cause; none returns MTRL_OK.
static void test_odd_batch_(void) {
    dp_case *c = dp_case_run_(2, 1000, "", (dp_ctx){.steps = 1, .qb_mode = MTRL_QB_FROZEN, .odd_rank = 2}, 0);
    int named = 0;
    for (int r = 0; r < 2; r++) {
        TEST_CHECKF(c->x.out[r].st[0] != MTRL_OK, "rank %d took a step on a batch the other rank did not have", r);
        named += c->x.out[r].st[0] == MTRL_ERR_MISMATCH && strstr(c->x.out[r].msg, "different batches");
    }
    TEST_CHECKF(named >= 1, "no rank named the different batches: %s / %s", c->x.out[0].msg, c->x.out[1].msg);
    dp_case_free_(c, 2);
}

int main(void) {
    for (int R = 1; R <= 4; R++) test_ops_(R);
    test_failures_();
    test_bootstrap_();
    // Clipping on (the norm of this batch is well above 0.05), segments planned.
    const char *clip = "grad_clip = 0.05\n[algo]\nmask_truncated = true\n";
    test_dp_(2, clip, 2, 0, "rl token_mean clipped");
    test_dp_(3, clip, 2, 0, "rl token_mean clipped");
    test_dp_(2, "grad_clip = 0\nsegment = 64\n[algo]\naggregation = seq_mean_token_mean\nentropy_coef = 0.01\n", 1, 0,
             "rl seq_mean entropy seg64");
    test_dp_(3, "grad_clip = 0.05\n", 1, 1, "sft");
    test_qb_(3);
    test_odd_batch_();
    return test_report();
}
