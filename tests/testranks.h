// testranks.h: what test_learner_ranks.c and test_learner_ranks_ep.c share (header-only): the
// learner's ranks (learner/learner_ranks.h) on CPU models of testdp.h's fixed batch, against
// one rank's steps, and their sharded checkpoints read back and resumed.
#ifndef MTRL_TESTRANKS_H
#define MTRL_TESTRANKS_H

#include <stdio.h>
#include <unistd.h>

#include "common/checkpoint.h"
#include "learner/dist_ckpt.h"
#include "learner/learner_ranks.h"
#include "tests/testdp.h"

// One configuration of ranks and testdp.h's ten episodes.
typedef struct tr_run {
    mtrl_config cfg;
    mtrl_algo_config algo;
    mtrl_traj tr[TDP_NEP], *eps[TDP_NEP];
} tr_run;

// timeout_ms: the ranks' collectives' limit (short only where a rank is made to fail: on 2
// shared cores a thread of a healthy 3-rank step was seen to arrive 300 ms after the others);
// ep: [learner] expert_parallel.
static inline void tr_run_init(tr_run *x, int ranks, int timeout_ms, int ep) {
    char extra[160];
    snprintf(extra, sizeof extra, "ranks = %d\nrank_timeout_ms = %d\nexpert_parallel = %s\n", ranks, timeout_ms,
             ep ? "true" : "false");
    tdp_config_(&x->cfg, "", extra);
    TEST_EQ_INT(mtrl_train_algo_config(&x->cfg, &x->algo, NULL), MTRL_OK);
    for (int i = 0; i < TDP_NEP; i++) mtrl_traj_init(&x->tr[i]), tdp_episode_(&x->tr[i], i), x->eps[i] = &x->tr[i];
}

static inline void tr_run_free(tr_run *x) {
    for (int i = 0; i < TDP_NEP; i++) mtrl_traj_free(&x->tr[i]);
}

static inline void tr_model(mtrl_model *m, const tr_run *x) {
    char msg[1024];
    TEST_CHECKF(tdp_model_(m, &x->cfg, MTRL_QB_FROZEN, MTRL_DEVICE_CPU, 0, msg, sizeof msg) == 0, "%s", msg);
}

// Parameters a (rank 0's) against one rank's b: every element within 1e-5 relative or 0.01 lr
// (testdp.h says why lr); with `most` also all but 0.01% within 1e-5 relative or 1e-4 lr
// (test_dist_ep_dp.c's second rule). Prints the counts under `what`.
static inline void tr_params_close(const mtrl_model *a, const mtrl_model *b, double lr, int most, const char *what) {
    size_t n = a->params.total / sizeof(real), far = 0, off = 0;
    const real *p = (const real *)a->params.base, *q = (const real *)b->params.base;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)p[i] - (double)q[i]), v = fabs((double)q[i]);
        far += d > 1e-5 * v + 0.01 * lr;
        off += d > 1e-5 * v + 1e-4 * lr;
    }
    printf("  %s: rank 0's parameters: %zu of %zu beyond 1e-5 relative and 0.01 lr, %zu beyond 1e-4 lr; largest "
           "difference %.3g of the largest\n", what, far, n, off, tdp_block_rel_(p, q, 0, a->params.total));
    TEST_CHECKF(far == 0, "%s: %zu parameters beyond 1e-5 relative and 0.01 lr", what, far);
    if (most) TEST_CHECKF((double)off <= 1e-4 * (double)n, "%s: %zu of %zu parameters beyond 1e-5 relative and 1e-4 lr", what, off, n);
}

// The ranks' statistics g against one rank's w: within 1e-5 relative, the counts exact.
static inline void tr_stats_close(const mtrl_step_stats *g, const mtrl_step_stats *w, const char *what) {
    printf("%s: loss %.9g grad_norm %.9g (one rank: %.9g, %.9g)\n", what, g->loss, g->grad_norm, w->loss, w->grad_norm);
    TEST_CLOSE(g->loss, w->loss, 1e-5, 1e-9);
    TEST_CLOSE(g->grad_norm, w->grad_norm, 1e-5, 0);
    TEST_CLOSE(g->pg_loss, w->pg_loss, 1e-5, 1e-9);
    TEST_CLOSE(g->entropy_mean, w->entropy_mean, 1e-5, 0);
    TEST_CLOSE(g->ratio_mean, w->ratio_mean, 1e-5, 0);
    TEST_EQ_INT(g->tokens, w->tokens);
    TEST_EQ_INT(g->model_tokens, w->model_tokens);
    TEST_EQ_INT(g->groups, w->groups);
}

// The larger of both moments' worst difference, relative to the block's largest element.
static inline double tr_moments_rel(const mtrl_model *a, const mtrl_model *b) {
    double em = tdp_block_rel_(a->adam_m, b->adam_m, 0, a->params.total);
    double ev = tdp_block_rel_(a->adam_v, b->adam_v, 0, a->params.total);
    return em > ev ? em : ev;
}

// The full parameter file (what learner.c writes beside the shards) read into a fresh model,
// then the moments from the shards of `index`.
static inline void tr_resume(mtrl_model *m, const tr_run *x, const char *params_path, const char *index) {
    tr_model(m, x);
    mtrl_ckpt c;
    mtrl_error err = {0};
    TEST_CHECKF(mtrl_ckpt_open_file(&c, params_path, &err) == MTRL_OK, "%s", err.msg);
    TEST_CHECKF(mtrl_model_load(m, &c, 0, &err) == MTRL_OK, "%s", err.msg);
    mtrl_ckpt_close(&c);
    TEST_CHECKF(mtrl_learner_ranks_load_moments(m, index, &err) == MTRL_OK, "%s", err.msg);
}

// Each of the `ranks` rank files of `index` exists.
static inline void tr_rank_files(const char *index, int ranks) {
    char path[600];
    for (int r = 0; r < ranks; r++) {
        mtrl_dist_ckpt_rank_path(path, sizeof path, index, r, ranks);
        TEST_CHECKF(access(path, F_OK) == 0, "no rank file %s", path);
    }
}

// The checkpoint the resume cases start from: x's ranks (*rk, from m0) and one rank (ref) run
// the same two RL steps; the ranks' state is saved as the learner saves it, the moments into
// the shards of `index`, rank 0's parameters into `params` (meta: learner_step 2).
static inline void tr_two_steps_saved(const tr_run *x, mtrl_model *ref, mtrl_model *m0, mtrl_learner_ranks **rk,
                                      const char *params, const char *index) {
    mtrl_error err = {0};
    *rk = NULL;
    TEST_CHECKF(mtrl_learner_ranks_init(rk, m0, &x->cfg, &err) == MTRL_OK, "%s", err.msg);
    if (!*rk) return;
    mtrl_step_stats st;
    for (int s = 0; s < 2; s++) {
        mtrl_train_rl_step(ref, &x->cfg, &x->algo, x->eps, TDP_NEP, &st);
        TEST_CHECKF(mtrl_learner_ranks_rl_step(*rk, &x->cfg, &x->algo, x->eps, TDP_NEP, &st, &err) == MTRL_OK, "%s", err.msg);
    }
    const char *meta[] = {"learner_step", "2"};
    TEST_CHECKF(mtrl_learner_ranks_save(*rk, index, meta, 1, &err) == MTRL_OK, "%s", err.msg);
    TEST_CHECKF(mtrl_model_save(m0, params, NULL, NULL, 0, NULL, 0, &err) == MTRL_OK, "%s", err.msg);
    tr_rank_files(index, mtrl_learner_ranks_count(*rk));
}

// Step 3 of model m (resumed from the checkpoint) on x's ranks, against the unsharded
// continuation `want` (ref: one rank's model after it): on one rank mtrl_train_rl_step, with its
// moments against ref's; on several the ranks' step, their state saved into the shards of
// `index3` and read back once more, all shards' moments against ref's.
static inline void tr_step3(mtrl_model *m, const tr_run *x, const mtrl_model *ref, const mtrl_step_stats *want,
                            const char *params, const char *index3, const char *what) {
    mtrl_step_stats g = {0};
    mtrl_error err = {0};
    int R = (int)x->cfg.learner.ranks;
    if (R == 1) {
        mtrl_train_rl_step(m, &x->cfg, &x->algo, x->eps, TDP_NEP, &g);
        tr_stats_close(&g, want, what);
        double er = tr_moments_rel(m, ref);
        printf("  moments after step 3: %.3g of the largest from one rank's\n", er);
        TEST_CHECKF(er <= 1e-5, "moments off by %.3g", er);
        return;
    }
    mtrl_learner_ranks *r3 = NULL;
    TEST_CHECKF(mtrl_learner_ranks_init(&r3, m, &x->cfg, &err) == MTRL_OK, "%s", err.msg);
    if (!r3) return;
    TEST_EQ_INT(mtrl_learner_ranks_expert_parallel(r3), x->cfg.learner.expert_parallel);
    TEST_CHECKF(mtrl_learner_ranks_rl_step(r3, &x->cfg, &x->algo, x->eps, TDP_NEP, &g, &err) == MTRL_OK, "%s", err.msg);
    tr_stats_close(&g, want, what);
    const char *meta[] = {"learner_step", "2"};
    TEST_CHECKF(mtrl_learner_ranks_save(r3, index3, meta, 1, &err) == MTRL_OK, "%s", err.msg);
    mtrl_learner_ranks_free(r3);
    tr_rank_files(index3, R);
    mtrl_model three;
    tr_resume(&three, x, params, index3); // the parameters of this file are replaced: only the moments count
    double er = tr_moments_rel(&three, ref);
    printf("  moments after step 3 (all %d shards): %.3g of the largest from one rank's\n", R, er);
    TEST_CHECKF(er <= 1e-5, "moments off by %.3g", er);
    TEST_EQ_INT(three.step, 3);
    mtrl_model_free(&three);
}

#endif
