// mtrl-test: cpu timeout=120
// The learner's ranks with [learner] expert_parallel (learner/learner_ranks.h, issue 27): the
// EP+DP step (learner/dist_dp.h mtrl_dist_dp_init_ep) through the API the learner calls, on
// CPU models of the tiny preset (8 experts) over the local backend, on testdp.h's fixed batch:
//   1. two RL steps on 2 and 3 ranks against one rank's mtrl_train_rl_step: loss, grad_norm and
//      the other statistics within 1e-5 relative, token counts exact; rank 0's WHOLE parameter
//      block (every expert, gathered from their owners after each step: what the learner
//      publishes) within 1e-5 relative or 0.01 lr of one rank's, element by element, and after
//      the first step also all but 0.01% within 1e-5 relative or 1e-4 lr (test_dist_ep_dp.c's
//      rules; params_close_ says why not later); a follower's copies of the others' experts are
//      stale, so the gather is what makes rank 0 whole; the supervised step likewise;
//   2. a checkpoint of the 2-rank EP state (mtrl_learner_ranks_save: the expert-parallel layout
//      of learner/dist_ckpt.h): read back into one model it is byte-equal to the unsharded state
//      assembled from what each rank owns (its experts' parameters and moments, its non-expert
//      shard's), its parameters byte-equal to rank 0's; resumed (the full parameter file plus
//      the moments) on 1 rank, on 3 ranks with expert parallel and on 3 without, a third step
//      matches the unsharded continuation (one rank's three steps): loss and norm within 1e-5,
//      the parameters as above, the moments within 1e-5 of the largest;
//   3. what [learner] expert_parallel refuses (naming the key: a GPU model, a dense model, more
//      ranks than experts) and how mtrl_learner_ranks_describe says it.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/check.h"
#include "common/checkpoint.h"
#include "learner/dist_ckpt.h"
#include "learner/dist_ep.h"
#include "learner/learner_ranks.h"
#include "tests/testdp.h"
#include "tests/testproc.h"

static char dir_[256];

typedef struct run_ {
    mtrl_config cfg;
    mtrl_algo_config algo;
    mtrl_traj tr[TDP_NEP], *eps[TDP_NEP];
} run_;

static void run_init_(run_ *x, int ranks, int ep) {
    char extra[160];
    snprintf(extra, sizeof extra, "ranks = %d\nrank_timeout_ms = 5000\nexpert_parallel = %s\n", ranks,
             ep ? "true" : "false");
    tdp_config_(&x->cfg, "", extra);
    TEST_EQ_INT(mtrl_train_algo_config(&x->cfg, &x->algo, NULL), MTRL_OK);
    for (int i = 0; i < TDP_NEP; i++) mtrl_traj_init(&x->tr[i]), tdp_episode_(&x->tr[i], i), x->eps[i] = &x->tr[i];
}

static void run_free_(run_ *x) {
    for (int i = 0; i < TDP_NEP; i++) mtrl_traj_free(&x->tr[i]);
}

static void model_(mtrl_model *m, const run_ *x) {
    char msg[1024];
    TEST_CHECKF(tdp_model_(m, &x->cfg, MTRL_QB_FROZEN, MTRL_DEVICE_CPU, 0, msg, sizeof msg) == 0, "%s", msg);
}

// Rank 0's parameters a against one rank's b: every element within 1e-5 relative or 0.01 lr
// (test_learner_ranks.c's rule); with `most` also all but 0.01% within 1e-5 relative or 1e-4 lr
// (test_dist_ep_dp.c's second rule, held after the first step: after more, AdamW's division by
// √v turns the rounding of the moments into more of them, as in a one-rank run resumed from
// the ranks' moments: 79 of 440736 after step 3, so it is printed, not held). Prints the counts.
static void params_close_(const mtrl_model *a, const mtrl_model *b, double lr, int most, const char *what) {
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

static void stats_close_(const mtrl_step_stats *g, const mtrl_step_stats *w, const char *what) {
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

static double moments_rel_(const mtrl_model *a, const mtrl_model *b) {
    double em = tdp_block_rel_(a->adam_m, b->adam_m, 0, a->params.total);
    double ev = tdp_block_rel_(a->adam_v, b->adam_v, 0, a->params.total);
    return em > ev ? em : ev;
}

// Bytes of tensor `name`'s expert rows e0 .. e1-1 of models a and b: 1 when equal.
static int experts_equal_(const mtrl_model *a, const mtrl_model *b, const char *name, int e0, int e1) {
    int i = mtrl_tt_find(&a->params, name);
    TEST_CHECKF(i >= 0, "no tensor %s", name);
    if (i < 0) return 0;
    const mtrl_tensor *t = &a->params.items[i];
    size_t per = t->nbytes / (size_t)t->shape[0];
    return !memcmp((const char *)a->params.base + t->offset + per * (size_t)e0,
                   (const char *)b->params.base + t->offset + per * (size_t)e0, per * (size_t)(e1 - e0));
}

// ---- 1. the same steps as one rank -------------------------------------------------------------

static void test_steps_(int R) {
    run_ x;
    run_init_(&x, R, 1);
    mtrl_model ref, m0;
    model_(&ref, &x);
    model_(&m0, &x);
    mtrl_learner_ranks *rk = NULL;
    mtrl_error err = {0};
    TEST_CHECKF(mtrl_learner_ranks_init(&rk, &m0, &x.cfg, &err) == MTRL_OK, "%s", err.msg);
    if (!rk) return;
    TEST_EQ_INT(mtrl_learner_ranks_expert_parallel(rk), 1);
    for (int s = 0; s < 2; s++) {
        mtrl_step_stats w = {0}, g = {0};
        mtrl_train_rl_step(&ref, &x.cfg, &x.algo, x.eps, TDP_NEP, &w);
        TEST_CHECKF(mtrl_learner_ranks_rl_step(rk, &x.cfg, &x.algo, x.eps, TDP_NEP, &g, &err) == MTRL_OK, "%s", err.msg);
        char what[64];
        snprintf(what, sizeof what, "%d ranks, expert parallel, RL step %d", R, s + 1);
        stats_close_(&g, &w, what);
        params_close_(&m0, &ref, x.cfg.learner.lr, s == 0, what);
        TEST_EQ_INT(m0.version, ref.version);
        TEST_EQ_INT(m0.step, ref.step);
    }
    // The last rank's copy of expert 0 (rank 0's) was never updated there: rank 0's is the
    // gathered one, the follower's stale (what a publish without the gather would send).
    const mtrl_model *last = mtrl_learner_ranks_test_model(rk, R - 1);
    TEST_CHECK(!experts_equal_(last, &m0, "layers.1.moe.w1", 0, 1));
    TEST_CHECK(experts_equal_(last, &m0, "layers.1.moe.w1", 8 - 8 / R, 8)); // its own: the same bits
    double lw = mtrl_train_sft_step(&ref, &x.cfg, x.eps, TDP_NEP, 3e-3), lg = 0;
    TEST_CHECKF(mtrl_learner_ranks_sft_step(rk, &x.cfg, x.eps, TDP_NEP, 3e-3, &lg, &err) == MTRL_OK, "%s", err.msg);
    printf("%d ranks, expert parallel, supervised step: loss %.9g (one rank: %.9g)\n", R, lg, lw);
    TEST_CLOSE(lg, lw, 1e-5, 1e-9);
    params_close_(&m0, &ref, 3e-3, 0, "supervised step");
    mtrl_learner_ranks_free(rk);
    mtrl_model_free(&m0);
    mtrl_model_free(&ref);
    run_free_(&x);
}

// ---- 2. a 2-rank EP checkpoint, read back and resumed ------------------------------------------

// The full parameter file read into a fresh model, then the moments from the shards.
static void resume_(mtrl_model *m, const run_ *x, const char *params_path, const char *index) {
    model_(m, x);
    mtrl_ckpt c;
    mtrl_error err = {0};
    TEST_CHECKF(mtrl_ckpt_open_file(&c, params_path, &err) == MTRL_OK, "%s", err.msg);
    TEST_CHECKF(mtrl_model_load(m, &c, 0, &err) == MTRL_OK, "%s", err.msg);
    mtrl_ckpt_close(&c);
    TEST_CHECKF(mtrl_learner_ranks_load_moments(m, index, &err) == MTRL_OK, "%s", err.msg);
}

// What the ranks own, assembled into whole blocks p, mo, v (each params.total bytes).
static void assemble_(mtrl_learner_ranks *rk, int R, char *p, char *mo, char *v) {
    const mtrl_model *m0 = mtrl_learner_ranks_test_model(rk, 0);
    const mtrl_tt *t = &m0->params;
    mtrl_dist_experts x;
    mtrl_dist_ep_layout L;
    mtrl_error err = {0};
    TEST_EQ_INT(mtrl_dist_experts_make(&x, m0->dims.E, R, &err), MTRL_OK);
    TEST_CHECKF(mtrl_dist_ep_layout_make(&L, t, &x, MTRL_DIST_SHARD_ALIGN, &err) == MTRL_OK, "%s", err.msg);
    memset(p, 0, t->total), memset(mo, 0, t->total), memset(v, 0, t->total);
    for (int r = 0; r < R; r++) {
        const mtrl_model *m = mtrl_learner_ranks_test_model(rk, r);
        for (int j = L.rank[r].first_piece; j < L.rank[r].first_piece + L.rank[r].n_piece; j++) {
            const mtrl_dist_piece *q = &L.piece[j];
            size_t es = mtrl_dtype_size(t->items[q->tensor].dtype), at = t->items[q->tensor].offset + q->begin * es,
                   n = (q->end - q->begin) * es;
            memcpy(p + at, (const char *)m->params.base + at, n);
            memcpy(mo + at, (const char *)m->adam_m + at, n);
            memcpy(v + at, (const char *)m->adam_v + at, n);
        }
    }
    mtrl_dist_ep_layout_free(&L);
}

static void test_checkpoint_(void) {
    run_ x2;
    run_init_(&x2, 2, 1);
    mtrl_model ref, m0;
    model_(&ref, &x2);
    model_(&m0, &x2);
    mtrl_learner_ranks *rk = NULL;
    mtrl_error err = {0};
    TEST_CHECKF(mtrl_learner_ranks_init(&rk, &m0, &x2.cfg, &err) == MTRL_OK, "%s", err.msg);
    if (!rk) return;
    mtrl_step_stats st;
    for (int s = 0; s < 2; s++) {
        mtrl_train_rl_step(&ref, &x2.cfg, &x2.algo, x2.eps, TDP_NEP, &st);
        TEST_CHECKF(mtrl_learner_ranks_rl_step(rk, &x2.cfg, &x2.algo, x2.eps, TDP_NEP, &st, &err) == MTRL_OK, "%s", err.msg);
    }
    char params[400], index[400], index3[400], path[480];
    snprintf(params, sizeof params, "%s/ckpt.safetensors", dir_);
    snprintf(index, sizeof index, "%s/optimizer2.safetensors", dir_);
    snprintf(index3, sizeof index3, "%s/optimizer3.safetensors", dir_);
    const char *meta[] = {"learner_step", "2"};
    TEST_CHECKF(mtrl_learner_ranks_save(rk, index, meta, 1, &err) == MTRL_OK, "%s", err.msg);
    TEST_CHECKF(mtrl_model_save(&m0, params, NULL, NULL, 0, NULL, 0, &err) == MTRL_OK, "%s", err.msg);
    for (int r = 0; r < 2; r++) {
        mtrl_dist_ckpt_rank_path(path, sizeof path, index, r, 2);
        TEST_CHECKF(access(path, F_OK) == 0, "no rank file %s", path);
    }
    mtrl_ckpt ic;
    TEST_CHECKF(mtrl_ckpt_open_file(&ic, index, &err) == MTRL_OK, "%s", err.msg);
    const char *kind = mtrl_ckpt_meta(&ic, "shard.kind");
    TEST_CHECKF(kind && !strcmp(kind, "expert_parallel"), "shard.kind %s", kind ? kind : "(none)");
    mtrl_ckpt_close(&ic);
    // Read back into one rank's whole blocks: byte-equal to what the ranks own, assembled.
    size_t total = m0.params.total;
    char *p = xmalloc(total), *mo = xmalloc(total), *v = xmalloc(total);
    assemble_(rk, 2, p, mo, v);
    mtrl_dist_ckpt c;
    mtrl_dist_shards one;
    TEST_CHECKF(mtrl_dist_ckpt_open(&c, index, &m0.params, &err) == MTRL_OK, "%s", err.msg);
    TEST_EQ_INT(c.ep, 1);
    TEST_EQ_INT(mtrl_dist_shards_make(&one, &m0.params, 1, MTRL_DIST_SHARD_ALIGN, &err), MTRL_OK);
    char *rp = xmalloc(total), *rm = xmalloc(total), *rv = xmalloc(total);
    TEST_CHECKF(mtrl_dist_ckpt_read_shard(&c, &one, 0, rp, rm, rv, &err) == MTRL_OK, "%s", err.msg);
    mtrl_dist_shards_free(&one);
    mtrl_dist_ckpt_close(&c);
    TEST_CHECKF(!memcmp(rp, p, total), "the parameters read back differ from the ranks' own");
    TEST_CHECKF(!memcmp(rm, mo, total) && !memcmp(rv, v, total), "the moments read back differ from the ranks' own");
    TEST_CHECKF(!memcmp(rp, m0.params.base, total), "the parameters read back differ from rank 0's (gathered)");
    printf("2-rank EP checkpoint read back on one rank: byte-equal to the ranks' own state (%zu bytes each block)\n", total);
    mtrl_model two;
    resume_(&two, &x2, params, index);
    TEST_EQ_INT(two.step, 2);
    TEST_CHECK(!memcmp(two.adam_m, mo, total) && !memcmp(two.adam_v, v, total));
    double e = moments_rel_(&two, &ref);
    printf("2-rank EP moments after 2 steps, read back: %.3g of the largest from one rank's\n", e);
    TEST_CHECKF(e <= 1e-5, "moments off by %.3g", e);
    free(p), free(mo), free(v), free(rp), free(rm), free(rv);
    mtrl_train_rl_step(&ref, &x2.cfg, &x2.algo, x2.eps, TDP_NEP, &st); // the unsharded continuation
    mtrl_step_stats want = st;
    static const struct { int R, ep; } to[] = {{1, 0}, {3, 1}, {3, 0}};
    for (size_t i = 0; i < sizeof to / sizeof to[0]; i++) {
        run_ x;
        run_init_(&x, to[i].R, to[i].ep);
        mtrl_model m;
        resume_(&m, &x, params, index);
        mtrl_step_stats g = {0};
        char what[80];
        snprintf(what, sizeof what, "resumed on %d rank%s%s, step 3", to[i].R, to[i].R == 1 ? "" : "s",
                 to[i].ep ? " with expert parallel" : to[i].R > 1 ? " without expert parallel" : "");
        if (to[i].R == 1) {
            mtrl_train_rl_step(&m, &x.cfg, &x.algo, x.eps, TDP_NEP, &g);
            stats_close_(&g, &want, what);
            double er = moments_rel_(&m, &ref);
            printf("  moments after step 3: %.3g of the largest from one rank's\n", er);
            TEST_CHECKF(er <= 1e-5, "moments off by %.3g", er);
        } else {
            mtrl_learner_ranks *r3 = NULL;
            TEST_CHECKF(mtrl_learner_ranks_init(&r3, &m, &x.cfg, &err) == MTRL_OK, "%s", err.msg);
            if (!r3) continue;
            TEST_EQ_INT(mtrl_learner_ranks_expert_parallel(r3), to[i].ep);
            TEST_CHECKF(mtrl_learner_ranks_rl_step(r3, &x.cfg, &x.algo, x.eps, TDP_NEP, &g, &err) == MTRL_OK, "%s", err.msg);
            stats_close_(&g, &want, what);
            TEST_CHECKF(mtrl_learner_ranks_save(r3, index3, meta, 1, &err) == MTRL_OK, "%s", err.msg);
            mtrl_learner_ranks_free(r3);
            mtrl_model three;
            resume_(&three, &x, params, index3); // only the moments count here
            double er = moments_rel_(&three, &ref);
            printf("  moments after step 3 (all 3 shards): %.3g of the largest from one rank's\n", er);
            TEST_CHECKF(er <= 1e-5, "moments off by %.3g", er);
            TEST_EQ_INT(three.step, 3);
            mtrl_model_free(&three);
        }
        params_close_(&m, &ref, x.cfg.learner.lr, 0, what);
        mtrl_model_free(&m);
        run_free_(&x);
    }
    mtrl_model_free(&two);
    mtrl_learner_ranks_free(rk);
    mtrl_model_free(&m0);
    mtrl_model_free(&ref);
    run_free_(&x2);
}

// ---- 3. refusals and the description ---------------------------------------------------------------

static void refused_(const char *model, const char *learner, const char *says) {
    char text[512];
    snprintf(text, sizeof text, "[model]\n%s[env]\nname = calc\n[learner]\nexpert_parallel = true\n%s", model, learner);
    mtrl_config cfg;
    mtrl_config_errors errs = {0};
    TEST_CHECKF(mtrl_config_load_text(&cfg, "e.ini", text, NULL, 0, &errs) == MTRL_OK, "%s", errs.n ? errs.msgs[0] : "");
    mtrl_config_errors_free(&errs);
    mtrl_model_dims d;
    mtrl_error err = {0};
    TEST_CHECKF(mtrl_model_dims_from_config(&d, &cfg, MTRL_VOCAB, &err) == MTRL_OK, "%s", err.msg);
    TEST_EQ_INT(mtrl_learner_ranks_check_ep(&cfg, &d, &err), MTRL_ERR_USAGE);
    printf("refused: %s\n", err.msg);
    TEST_CONTAINS(err.msg, "[learner] expert_parallel = true");
    TEST_CONTAINS(err.msg, says);
}

static void test_config_(void) {
    refused_("device = cuda\n", "gpus = 0,1\n", "docs/multi-gpu.md §3");
    refused_("dense_layers = 4\n", "ranks = 2\n", "no MoE layer");
    refused_("", "ranks = 9\n", "9 learner ranks, but the model has 8 routed experts");
    // The learner's start refuses it too, before any rank starts.
    run_ x;
    run_init_(&x, 9, 1);
    mtrl_model m0;
    model_(&m0, &x);
    mtrl_learner_ranks *rk = NULL;
    mtrl_error err = {0};
    TEST_EQ_INT(mtrl_learner_ranks_init(&rk, &m0, &x.cfg, &err), MTRL_ERR_USAGE);
    TEST_CHECK(rk == NULL);
    TEST_CONTAINS(err.msg, "[learner] expert_parallel = true with 9 learner ranks");
    char line[400];
    TEST_EQ_INT(mtrl_learner_ranks_describe(&x.cfg, line, sizeof line), 9);
    TEST_CONTAINS(line, "the routed experts expert parallel over them ([learner] expert_parallel");
    mtrl_model_free(&m0);
    run_free_(&x);
}

int main(void) {
    snprintf(dir_, sizeof dir_, "/tmp/mtrl_ranks_ep_XXXXXX");
    if (!mkdtemp(dir_)) {
        perror("mkdtemp");
        return 1;
    }
    test_config_();
    test_steps_(2);
    test_steps_(3);
    test_checkpoint_();
    test_tmpdir_done(dir_, test_failed_);
    return test_report();
}
