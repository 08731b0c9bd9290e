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
#include "tests/testranks.h"
#include "tests/testproc.h"

static char dir_[256];

// ---- 1. the same steps as one rank ----------------------------------------------------------------

static void test_steps_(int R) {
    tr_run x;
    tr_run_init(&x, R, 10000, 0);
    mtrl_model ref, m0;
    tr_model(&ref, &x);
    tr_model(&m0, &x);
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
        tr_stats_close(&g, &w, what);
        tr_params_close(&m0, &ref, x.cfg.learner.lr, 0, what);
        TEST_EQ_INT(m0.version, ref.version);
        TEST_EQ_INT(m0.step, ref.step);
    }
    double lw = mtrl_train_sft_step(&ref, &x.cfg, x.eps, TDP_NEP, 3e-3), lg = 0;
    TEST_CHECKF(mtrl_learner_ranks_sft_step(rk, &x.cfg, x.eps, TDP_NEP, 3e-3, &lg, &err) == MTRL_OK, "%s", err.msg);
    printf("%d ranks, supervised step: loss %.9g (one rank: %.9g)\n", R, lg, lw);
    TEST_CLOSE(lg, lw, 1e-5, 1e-9);
    tr_params_close(&m0, &ref, 3e-3, 0, "supervised step");
    mtrl_learner_ranks_free(rk);
    mtrl_model_free(&m0);
    mtrl_model_free(&ref);
    tr_run_free(&x);
}

// ---- 2. a 2-rank checkpoint resumed on 1 and 3 ranks -------------------------------------------

static void test_resume_(void) {
    tr_run x2;
    tr_run_init(&x2, 2, 10000, 0);
    mtrl_model ref, m0;
    tr_model(&ref, &x2);
    tr_model(&m0, &x2);
    mtrl_learner_ranks *rk;
    char params[400], index[400], index3[400], path[480];
    snprintf(params, sizeof params, "%s/ckpt.safetensors", dir_);
    snprintf(index, sizeof index, "%s/optimizer2.safetensors", dir_);
    snprintf(index3, sizeof index3, "%s/optimizer3.safetensors", dir_);
    tr_two_steps_saved(&x2, &ref, &m0, &rk, params, index);
    if (!rk) return;
    mtrl_error err = {0};
    // What the 2 ranks hold, assembled: every rank's shard of the moments.
    mtrl_model two;
    tr_resume(&two, &x2, params, index);
    TEST_EQ_INT(two.step, 2);
    double e = tr_moments_rel(&two, &ref);
    printf("2-rank moments after 2 steps, read back: %.3g of the largest from one rank's\n", e);
    TEST_CHECKF(e <= 1e-5, "moments off by %.3g", e);
    mtrl_step_stats want;
    mtrl_train_rl_step(&ref, &x2.cfg, &x2.algo, x2.eps, TDP_NEP, &want); // the unsharded continuation
    for (int R = 1; R <= 3; R += 2) {
        tr_run x;
        tr_run_init(&x, R, 10000, 0);
        mtrl_model m;
        tr_resume(&m, &x, params, index);
        TEST_CHECK(!memcmp(m.adam_m, two.adam_m, m.params.total) && !memcmp(m.adam_v, two.adam_v, m.params.total));
        TEST_CHECK(!memcmp(m.params.base, m0.params.base, m.params.total));
        char what[64];
        snprintf(what, sizeof what, "resumed on %d rank%s, step 3", R, R == 1 ? "" : "s");
        tr_step3(&m, &x, &ref, &want, params, index3, what);
        tr_params_close(&m, &ref, x.cfg.learner.lr, 0, what);
        mtrl_model_free(&m);
        tr_run_free(&x);
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
    tr_model(&bad, &x2);
    TEST_CHECK(mtrl_learner_ranks_load_moments(&bad, index, &err) != MTRL_OK);
    TEST_CONTAINS(err.msg, "rank1of2");
    mtrl_model_free(&bad);
    mtrl_model_free(&two);
    mtrl_learner_ranks_free(rk);
    mtrl_model_free(&m0);
    mtrl_model_free(&ref);
    tr_run_free(&x2);
}

// ---- 3. a rank that fails ----------------------------------------------------------------------

static void test_failing_rank_(void) {
    tr_run x;
    tr_run_init(&x, 3, 300, 0);
    mtrl_model m0;
    tr_model(&m0, &x);
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
    tr_run_free(&x);
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
    tr_run x;
    tr_run_init(&x, 2, 300, 0);
    mtrl_model m0;
    tr_model(&m0, &x);
    snprintf(x.cfg.model.device, sizeof x.cfg.model.device, "cuda");
    mtrl_learner_ranks *rk = NULL;
    mtrl_error err = {0};
    TEST_EQ_INT(mtrl_learner_ranks_init(&rk, &m0, &x.cfg, &err), MTRL_ERR_USAGE);
    TEST_CHECK(rk == NULL);
    TEST_CONTAINS(err.msg, "rank 0's model is on the CPU");
    mtrl_model_free(&m0);
    tr_run_free(&x);
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
