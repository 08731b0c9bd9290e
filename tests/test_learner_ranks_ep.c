// mtrl-test: cpu timeout=120
// The learner's ranks with [learner] expert_parallel (learner/learner_ranks.h, issue 27): the
// EP+DP step (learner/dist_dp.h mtrl_dist_dp_init_ep) through the API the learner calls, on
// CPU models of the tiny preset (8 experts) over the local backend, on testdp.h's fixed batch:
//   1. two RL steps on 2 and 3 ranks against one rank's mtrl_train_rl_step: loss, grad_norm and
//      the other statistics within 1e-5 relative, token counts exact; rank 0's WHOLE parameter
//      block (every expert, gathered from their owners after each step: what the learner
//      publishes) within 1e-5 relative or 0.01 lr of one rank's, element by element, and after
//      the first step also all but 0.01% within 1e-5 relative or 1e-4 lr (test_dist_ep_dp.c's
//      rules; test_steps_ says why not later); a follower's copies of the others' experts
//      are stale, so the gather is what makes rank 0 whole; the supervised step likewise;
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
#include "tests/testranks.h"
#include "tests/testproc.h"

static char dir_[256];

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
    tr_run x;
    tr_run_init(&x, R, 5000, 1);
    mtrl_model ref, m0;
    tr_model(&ref, &x);
    tr_model(&m0, &x);
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
        tr_stats_close(&g, &w, what);
        // The second rule after the first step only: after more, AdamW's division by √v turns
        // the rounding of the moments into more of them, as in a one-rank run resumed from the
        // ranks' moments (79 of 440736 after step 3), so later it is printed, not held.
        tr_params_close(&m0, &ref, x.cfg.learner.lr, s == 0, what);
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
    tr_params_close(&m0, &ref, 3e-3, 0, "supervised step");
    mtrl_learner_ranks_free(rk);
    mtrl_model_free(&m0);
    mtrl_model_free(&ref);
    tr_run_free(&x);
}

// ---- 2. a 2-rank EP checkpoint, read back and resumed ------------------------------------------

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
    tr_run x2;
    tr_run_init(&x2, 2, 5000, 1);
    mtrl_model ref, m0;
    tr_model(&ref, &x2);
    tr_model(&m0, &x2);
    mtrl_learner_ranks *rk;
    char params[400], index[400], index3[400];
    snprintf(params, sizeof params, "%s/ckpt.safetensors", dir_);
    snprintf(index, sizeof index, "%s/optimizer2.safetensors", dir_);
    snprintf(index3, sizeof index3, "%s/optimizer3.safetensors", dir_);
    tr_two_steps_saved(&x2, &ref, &m0, &rk, params, index);
    if (!rk) return;
    mtrl_error err = {0};
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
    tr_resume(&two, &x2, params, index);
    TEST_EQ_INT(two.step, 2);
    TEST_CHECK(!memcmp(two.adam_m, mo, total) && !memcmp(two.adam_v, v, total));
    double e = tr_moments_rel(&two, &ref);
    printf("2-rank EP moments after 2 steps, read back: %.3g of the largest from one rank's\n", e);
    TEST_CHECKF(e <= 1e-5, "moments off by %.3g", e);
    free(p), free(mo), free(v), free(rp), free(rm), free(rv);
    mtrl_step_stats want;
    mtrl_train_rl_step(&ref, &x2.cfg, &x2.algo, x2.eps, TDP_NEP, &want); // the unsharded continuation
    static const struct { int R, ep; } to[] = {{1, 0}, {3, 1}, {3, 0}};
    for (size_t i = 0; i < sizeof to / sizeof to[0]; i++) {
        tr_run x;
        tr_run_init(&x, to[i].R, 5000, to[i].ep);
        mtrl_model m;
        tr_resume(&m, &x, params, index);
        char what[80];
        snprintf(what, sizeof what, "resumed on %d rank%s%s, step 3", to[i].R, to[i].R == 1 ? "" : "s",
                 to[i].ep ? " with expert parallel" : to[i].R > 1 ? " without expert parallel" : "");
        tr_step3(&m, &x, &ref, &want, params, index3, what);
        tr_params_close(&m, &ref, x.cfg.learner.lr, 0, what);
        mtrl_model_free(&m);
        tr_run_free(&x);
    }
    mtrl_model_free(&two);
    mtrl_learner_ranks_free(rk);
    mtrl_model_free(&m0);
    mtrl_model_free(&ref);
    tr_run_free(&x2);
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
    tr_run x;
    tr_run_init(&x, 9, 5000, 1);
    mtrl_model m0;
    tr_model(&m0, &x);
    mtrl_learner_ranks *rk = NULL;
    mtrl_error err = {0};
    TEST_EQ_INT(mtrl_learner_ranks_init(&rk, &m0, &x.cfg, &err), MTRL_ERR_USAGE);
    TEST_CHECK(rk == NULL);
    TEST_CONTAINS(err.msg, "[learner] expert_parallel = true with 9 learner ranks");
    char line[400];
    TEST_EQ_INT(mtrl_learner_ranks_describe(&x.cfg, line, sizeof line), 9);
    TEST_CONTAINS(line, "the routed experts expert parallel over them ([learner] expert_parallel");
    mtrl_model_free(&m0);
    tr_run_free(&x);
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
