// mtrl-test: cpu
// The learner's data-parallel ranks in one process (learner/learner_ranks.h, issue 27), on CPU
// models over the local backend, through the API the learner calls, on one fixed batch
// (tests/testdp.h's ten episodes: the actors' batches are not reproducible from the seed, since
// their task seeds follow the actor's incarnation, which comes from its clock):
//   1. two RL steps on 2 and 3 ranks against one rank's mtrl_train_rl_step: loss, grad_norm and
//      the other statistics within 1e-5 relative, token counts exact, rank 0's parameters
//      within 1e-5 relative or 0.01 lr of one rank's; the supervised step likewise;
//   2. a checkpoint of the 2-rank state (mtrl_learner_ranks_save: the moments sharded over 2
//      files, the parameters as a one-rank file) resumed on 1 and on 3 ranks: the moments read
//      back equal the 2-rank run's bit for bit and one rank's within 1e-5 of the largest, and a
//      third step from there matches the unsharded continuation (one rank's three steps):
//      loss and norm within 1e-5, the parameters as above, the moments (all shards of the
//      3-rank state, written and read back once more) within 1e-5 of the largest;
//   3. a rank that fails a step (the test hook: it skips its step, as a dead rank would): the
//      call returns an error naming that rank and the cause within the rank timeout (300 ms
//      here), later jobs are refused (MTRL_ERR_STATE), and freeing the ranks does not hang;
//   4. the configurations the ranks refuse (the load, naming the keys; a model on another
//      device than the keys say), and mtrl_learner_ranks_describe.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/checkpoint.h"
#include "learner/dist_ckpt.h"
#include "learner/learner_ranks.h"
#include "tests/testdp.h"
#include "tests/testproc.h"

static char dir_[256];

typedef struct run_ {
    mtrl_config cfg;
    mtrl_algo_config algo;
    mtrl_traj tr[TDP_NEP], *eps[TDP_NEP];
} run_;

// timeout_ms: the ranks' collectives' limit; 300 ms where a rank is made to fail (the
// others' timeouts are checked), longer elsewhere, since on 2 shared cores under ctest -j 2 a
// thread of a healthy 3-rank step was seen to arrive more than 300 ms after the others.
static void run_init_(run_ *x, int ranks, int timeout_ms) {
    char extra[128];
    snprintf(extra, sizeof extra, "ranks = %d\nrank_timeout_ms = %d\n", ranks, timeout_ms);
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

// Parameters of a against b: the count beyond 1e-5 relative and 0.01 lr (testdp.h says why lr).
static size_t params_far_(const mtrl_model *a, const mtrl_model *b, double lr, double *worst_rel) {
    size_t n = a->params.total / sizeof(real), far = 0;
    const real *p = (const real *)a->params.base, *q = (const real *)b->params.base;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)p[i] - (double)q[i]), w = fabs((double)q[i]);
        far += d > 1e-5 * w + 0.01 * lr;
    }
    *worst_rel = tdp_block_rel_(p, q, 0, a->params.total);
    return far;
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

// ---- 1. the same steps as one rank ----------------------------------------------------------------

static void test_steps_(int R) {
    run_ x;
    run_init_(&x, R, 10000);
    mtrl_model ref, m0;
    model_(&ref, &x);
    model_(&m0, &x);
    mtrl_learner_ranks *rk = NULL;
    mtrl_error err = {0};
    TEST_CHECKF(mtrl_learner_ranks_init(&rk, &m0, &x.cfg, &err) == MTRL_OK, "%s", err.msg);
    if (!rk) return;
    TEST_EQ_INT(mtrl_learner_ranks_count(rk), R);
    TEST_EQ_STR(mtrl_learner_ranks_backend(rk), "local");
    for (int s = 0; s < 2; s++) {
        mtrl_step_stats w = {0}, g = {0};
        mtrl_train_rl_step(&ref, &x.cfg, &x.algo, x.eps, TDP_NEP, &w);
        TEST_CHECKF(mtrl_learner_ranks_rl_step(rk, &x.cfg, &x.algo, x.eps, TDP_NEP, &g, &err) == MTRL_OK, "%s", err.msg);
        char what[64];
        snprintf(what, sizeof what, "%d ranks, RL step %d", R, s + 1);
        stats_close_(&g, &w, what);
        double worst;
        size_t far = params_far_(&m0, &ref, x.cfg.learner.lr, &worst);
        printf("  rank 0's parameters: %zu beyond 1e-5 relative and 0.01 lr, largest difference %.3g of the largest\n", far, worst);
        TEST_EQ_INT(far, 0);
        TEST_EQ_INT(m0.version, ref.version);
        TEST_EQ_INT(m0.step, ref.step);
    }
    double lw = mtrl_train_sft_step(&ref, &x.cfg, x.eps, TDP_NEP, 3e-3), lg = 0;
    TEST_CHECKF(mtrl_learner_ranks_sft_step(rk, &x.cfg, x.eps, TDP_NEP, 3e-3, &lg, &err) == MTRL_OK, "%s", err.msg);
    printf("%d ranks, supervised step: loss %.9g (one rank: %.9g)\n", R, lg, lw);
    TEST_CLOSE(lg, lw, 1e-5, 1e-9);
    double worst;
    TEST_EQ_INT(params_far_(&m0, &ref, 3e-3, &worst), 0);
    mtrl_learner_ranks_free(rk);
    mtrl_model_free(&m0);
    mtrl_model_free(&ref);
    run_free_(&x);
}

// ---- 2. a 2-rank checkpoint resumed on 1 and 3 ranks -------------------------------------------

// The full parameter file (what learner.c writes beside the shards) read into a fresh model,
// then the moments from the shards.
static void resume_(mtrl_model *m, const run_ *x, const char *params_path, const char *index) {
    model_(m, x);
    mtrl_ckpt c;
    mtrl_error err = {0};
    TEST_CHECKF(mtrl_ckpt_open_file(&c, params_path, &err) == MTRL_OK, "%s", err.msg);
    TEST_CHECKF(mtrl_model_load(m, &c, 0, &err) == MTRL_OK, "%s", err.msg);
    mtrl_ckpt_close(&c);
    TEST_CHECKF(mtrl_learner_ranks_load_moments(m, index, &err) == MTRL_OK, "%s", err.msg);
}

static double moments_rel_(const mtrl_model *a, const mtrl_model *b) {
    double em = tdp_block_rel_(a->adam_m, b->adam_m, 0, a->params.total);
    double ev = tdp_block_rel_(a->adam_v, b->adam_v, 0, a->params.total);
    return em > ev ? em : ev;
}

static void test_resume_(void) {
    run_ x2;
    run_init_(&x2, 2, 10000);
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
    // What the 2 ranks hold, assembled: every rank's shard of the moments.
    mtrl_model two;
    resume_(&two, &x2, params, index);
    TEST_EQ_INT(two.step, 2);
    double e = moments_rel_(&two, &ref);
    printf("2-rank moments after 2 steps, read back: %.3g of the largest from one rank's\n", e);
    TEST_CHECKF(e <= 1e-5, "moments off by %.3g", e);
    mtrl_train_rl_step(&ref, &x2.cfg, &x2.algo, x2.eps, TDP_NEP, &st); // the unsharded continuation
    mtrl_step_stats want = st;
    for (int R = 1; R <= 3; R += 2) {
        run_ x;
        run_init_(&x, R, 10000);
        mtrl_model m;
        resume_(&m, &x, params, index);
        TEST_CHECK(!memcmp(m.adam_m, two.adam_m, m.params.total) && !memcmp(m.adam_v, two.adam_v, m.params.total));
        TEST_CHECK(!memcmp(m.params.base, m0.params.base, m.params.total));
        mtrl_step_stats g = {0};
        char what[64];
        snprintf(what, sizeof what, "resumed on %d rank%s, step 3", R, R == 1 ? "" : "s");
        if (R == 1) {
            mtrl_train_rl_step(&m, &x.cfg, &x.algo, x.eps, TDP_NEP, &g);
            stats_close_(&g, &want, what);
            double er = moments_rel_(&m, &ref);
            printf("  moments after step 3: %.3g of the largest from one rank's\n", er);
            TEST_CHECKF(er <= 1e-5, "moments off by %.3g", er);
        } else {
            mtrl_learner_ranks *r3 = NULL;
            TEST_CHECKF(mtrl_learner_ranks_init(&r3, &m, &x.cfg, &err) == MTRL_OK, "%s", err.msg);
            if (!r3) continue;
            TEST_CHECKF(mtrl_learner_ranks_rl_step(r3, &x.cfg, &x.algo, x.eps, TDP_NEP, &g, &err) == MTRL_OK, "%s", err.msg);
            stats_close_(&g, &want, what);
            TEST_CHECKF(mtrl_learner_ranks_save(r3, index3, meta, 1, &err) == MTRL_OK, "%s", err.msg);
            mtrl_learner_ranks_free(r3);
            for (int r = 0; r < 3; r++) {
                mtrl_dist_ckpt_rank_path(path, sizeof path, index3, r, 3);
                TEST_CHECKF(access(path, F_OK) == 0, "no rank file %s", path);
            }
            mtrl_model three;
            resume_(&three, &x, params, index3); // the parameters of this file are replaced: only the moments count
            double er = moments_rel_(&three, &ref);
            printf("  moments after step 3 (all 3 shards): %.3g of the largest from one rank's\n", er);
            TEST_CHECKF(er <= 1e-5, "moments off by %.3g", er);
            TEST_EQ_INT(three.step, 3);
            mtrl_model_free(&three);
        }
        double worst;
        size_t far = params_far_(&m, &ref, x.cfg.learner.lr, &worst);
        printf("  parameters: %zu beyond 1e-5 relative and 0.01 lr, largest difference %.3g of the largest\n", far, worst);
        TEST_EQ_INT(far, 0);
        mtrl_model_free(&m);
        run_free_(&x);
    }
    // A rank file changed after the index was written is refused (the digests of dist_ckpt.h).
    mtrl_dist_ckpt_rank_path(path, sizeof path, index, 1, 2);
    FILE *f = fopen(path, "r+b");
    if (f) {
        fseek(f, -4, SEEK_END);
        fputc('x', f);
        fclose(f);
    }
    mtrl_model bad;
    model_(&bad, &x2);
    TEST_CHECK(mtrl_learner_ranks_load_moments(&bad, index, &err) != MTRL_OK);
    TEST_CONTAINS(err.msg, "rank1of2");
    mtrl_model_free(&bad);
    mtrl_model_free(&two);
    mtrl_learner_ranks_free(rk);
    mtrl_model_free(&m0);
    mtrl_model_free(&ref);
    run_free_(&x2);
}

// ---- 3. a rank that fails ----------------------------------------------------------------------

static void test_failing_rank_(void) {
    run_ x;
    run_init_(&x, 3, 300);
    mtrl_model m0;
    model_(&m0, &x);
    mtrl_learner_ranks *rk = NULL;
    mtrl_error err = {0};
    TEST_CHECKF(mtrl_learner_ranks_init(&rk, &m0, &x.cfg, &err) == MTRL_OK, "%s", err.msg);
    if (!rk) return;
    mtrl_learner_ranks_test_fail(rk, 1, 2);
    mtrl_step_stats st;
    TEST_CHECKF(mtrl_learner_ranks_rl_step(rk, &x.cfg, &x.algo, x.eps, TDP_NEP, &st, &err) == MTRL_OK, "%s", err.msg);
    TEST_EQ_INT(mtrl_learner_ranks_failed(rk), 0);
    mtrl_status s = mtrl_learner_ranks_rl_step(rk, &x.cfg, &x.algo, x.eps, TDP_NEP, &st, &err);
    printf("a failing rank: %s\n", err.msg);
    TEST_EQ_INT(s, MTRL_ERR_PEER);
    TEST_CONTAINS(err.msg, "learner rank 1 of 3 failed its RL step: failure injected by a test");
    TEST_CONTAINS(err.msg, "3 of the 3 ranks failed"); // the others timed out waiting for it
    TEST_CONTAINS(err.msg, "300 ms");
    TEST_EQ_INT(mtrl_learner_ranks_failed(rk), 1);
    TEST_EQ_INT(mtrl_learner_ranks_rl_step(rk, &x.cfg, &x.algo, x.eps, TDP_NEP, &st, &err), MTRL_ERR_STATE);
    TEST_CONTAINS(err.msg, "no RL step after a failed step: learner rank 1 of 3");
    char index[400];
    snprintf(index, sizeof index, "%s/dead.safetensors", dir_);
    TEST_EQ_INT(mtrl_learner_ranks_save(rk, index, NULL, 0, &err), MTRL_ERR_STATE);
    TEST_CHECK(access(index, F_OK) != 0);
    mtrl_learner_ranks_free(rk); // returns: the followers are idle again
    mtrl_model_free(&m0);
    run_free_(&x);
}

// ---- 4. configurations -----------------------------------------------------------------------------

static void config_refused_(const char *learner, const char *device, const char *says) {
    char text[512];
    snprintf(text, sizeof text, "[model]\ndevice = %s\n[env]\nname = calc\n[learner]\n%s", device, learner);
    mtrl_config cfg;
    mtrl_config_errors errs = {0};
    mtrl_status s = mtrl_config_load_text(&cfg, "r.ini", text, NULL, 0, &errs);
    TEST_CHECKF(s != MTRL_OK && errs.n == 1 && strstr(errs.msgs[0], says), "%s: %s", learner,
                errs.n ? errs.msgs[0] : "(accepted)");
    mtrl_config_errors_free(&errs);
}

static void test_config_(void) {
    config_refused_("ranks = -1\n", "cpu", "[learner] ranks: -1 is out of range");
    config_refused_("ranks = 65\n", "cpu", "[learner] ranks: 65 is out of range");
    config_refused_("ranks = 2\ngpus = 0,1\n", "cpu", "[learner] gpus = 0,1 lists CUDA devices, but [model] device = cpu");
    config_refused_("ranks = 3\ngpus = 0,1\n", "cuda", "[learner] ranks = 3, but [learner] gpus = 0,1 lists 2 GPUs");
    config_refused_("ranks = 2\ngpus = 1,0\n", "cuda", "[learner] gpus = 1,0 puts rank 0 on GPU 1");
    config_refused_("rank_timeout_ms = 10\n", "cpu", "[learner] rank_timeout_ms: 10 is out of range");
    static const struct { const char *learner, *device; int R; const char *says; } ok[] = {
        {"", "cpu", 1, "1 data-parallel learner rank: the learner's own thread on the CPU"},
        {"ranks = 3\n", "cpu", 3, "3 data-parallel learner ranks: threads of one process on the CPU (local backend)"},
        {"gpus = 0,2,3\n", "cuda", 3, "3 data-parallel learner ranks on GPUs 0,2,3 (one thread each, NCCL)"},
        {"ranks = 2\n", "cuda", 2, "2 data-parallel learner ranks on GPUs 0,1 (one thread each, NCCL)"},
        {"gpus = 0\n", "cuda", 1, "1 data-parallel learner rank on GPU 0"},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        char text[512], line[400];
        snprintf(text, sizeof text, "[model]\ndevice = %s\n[env]\nname = calc\n[learner]\n%s", ok[i].device, ok[i].learner);
        mtrl_config cfg;
        mtrl_config_errors errs = {0};
        TEST_CHECKF(mtrl_config_load_text(&cfg, "r.ini", text, NULL, 0, &errs) == MTRL_OK, "%s", errs.n ? errs.msgs[0] : "");
        mtrl_config_errors_free(&errs);
        int gpu[MTRL_CFG_GPUS_MAX];
        TEST_EQ_INT(mtrl_config_ranks(&cfg, gpu, line, sizeof line), ok[i].R);
        TEST_EQ_INT(mtrl_learner_ranks_describe(&cfg, line, sizeof line), ok[i].R);
        TEST_EQ_STR(line, ok[i].says);
    }
    // A CPU model for ranks the keys put on GPUs is refused before anything starts.
    run_ x;
    run_init_(&x, 2, 300);
    mtrl_model m0;
    model_(&m0, &x);
    snprintf(x.cfg.model.device, sizeof x.cfg.model.device, "cuda");
    mtrl_learner_ranks *rk = NULL;
    mtrl_error err = {0};
    TEST_EQ_INT(mtrl_learner_ranks_init(&rk, &m0, &x.cfg, &err), MTRL_ERR_USAGE);
    TEST_CHECK(rk == NULL);
    TEST_CONTAINS(err.msg, "rank 0's model is on the CPU");
    mtrl_model_free(&m0);
    run_free_(&x);
}

int main(void) {
    snprintf(dir_, sizeof dir_, "/tmp/mtrl_ranks_XXXXXX");
    if (!mkdtemp(dir_)) {
        perror("mkdtemp");
        return 1;
    }
    test_config_();
    test_steps_(2);
    test_steps_(3);
    test_resume_();
    test_failing_rank_();
    test_tmpdir_done(dir_, test_failed_);
    return test_report();
}
