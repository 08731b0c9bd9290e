// mtrl-test: cpu timeout=240
// `mtrl run` with [learner] ranks = 2 and expert_parallel = true on the CPU (issue 27): the real
// command in a temporary folder, its actor process over ZeroMQ on loopback, a real SQLite file.
//   1. the run (a short warm-up, then RL steps) finishes; its log says the experts are expert
//      parallel; its checkpoint's index is of the expert-parallel layout (learner/dist_ckpt.h:
//      shard.kind), with 2 rank files;
//   2. the full parameter file (what mtrl eval, replay and --resume open) holds every expert's
//      current weights: byte-equal to the parameters the shards hold (each expert from its
//      owner's file, the rest from each rank's non-expert shard); mtrl eval opens it;
//   3. mtrl check and mtrl run refuse expert_parallel with more ranks than experts and for a
//      dense model (exit 2, naming the key; run writes no store); check and plan describe it.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/checkpoint.h"
#include "common/config.h"
#include "common/tokenizer.h"
#include "learner/dist_ckpt.h"
#include "model/model.h"
#include "tests/testhelp.h"
#include "tests/testproc.h"

static char dir_[256];
static const char *bin_;

static const char *INI =
    "[run]\nname = ep\nseed = 7\nsteps = 2\nout_dir = out\ncheckpoint_every = 2\nkeep_checkpoints = 0\n"
    "[model]\npreset = tiny\n"
    "[env]\nname = calc\ndigits = 1\nops = 1\nmax_tool_calls = 2\n"
    "[warmup]\nsteps = 2\nbatch = 8\nlr = 5e-3\n"
    "[actor]\ncount = 1\nepisodes_in_flight = 8\nmax_tokens = 48\nmax_turn_tokens = 16\n"
    "[learner]\nbatch_groups = 2\nthreads = 1\nranks = 2\nexpert_parallel = true\n"
    "[algo]\ngroup_size = 4\n";

static test_result mtrl_(char *const *args) {
    char *argv[16] = {(char *)bin_};
    int n = 1;
    for (; args[n - 1] && n < 15; n++) argv[n] = args[n - 1];
    argv[n] = NULL;
    return test_run_in(dir_, argv);
}

static int exists_(const char *rel) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s", dir_, rel);
    return access(path, F_OK) == 0;
}

// The full parameter file against the parameters of the shards, read as one rank's block.
static void params_match_shards_(const char *params_rel, const char *index_rel) {
    char params[600], index[600], text[200];
    snprintf(params, sizeof params, "%s/%s", dir_, params_rel);
    snprintf(index, sizeof index, "%s/%s", dir_, index_rel);
    snprintf(text, sizeof text, "[model]\npreset = tiny\n[env]\nname = calc\n");
    mtrl_config cfg;
    mtrl_config_errors errs = {0};
    TEST_EQ_INT(mtrl_config_load_text(&cfg, "p.ini", text, NULL, 0, &errs), MTRL_OK);
    mtrl_config_errors_free(&errs);
    mtrl_model_dims d;
    mtrl_model m;
    mtrl_error err = {0};
    TEST_EQ_INT(mtrl_model_dims_from_config(&d, &cfg, MTRL_VOCAB, &err), MTRL_OK);
    TEST_CHECKF(mtrl_model_init_on(&m, &d, 1, MTRL_DEVICE_CPU, 0, &err) == MTRL_OK, "%s", err.msg);
    mtrl_ckpt c;
    TEST_CHECKF(mtrl_ckpt_open_file(&c, params, &err) == MTRL_OK, "%s", err.msg);
    TEST_CHECKF(mtrl_model_load(&m, &c, 0, &err) == MTRL_OK, "%s", err.msg);
    mtrl_ckpt_close(&c);
    mtrl_dist_ckpt dc;
    TEST_CHECKF(mtrl_dist_ckpt_open(&dc, index, &m.params, &err) == MTRL_OK, "%s", err.msg);
    TEST_EQ_INT(dc.ep, 1);
    TEST_EQ_INT(dc.ranks, 2);
    const char *kind = mtrl_ckpt_meta(&dc.index, "shard.kind");
    TEST_CHECKF(kind && !strcmp(kind, "expert_parallel"), "shard.kind %s", kind ? kind : "(none)");
    mtrl_dist_shards one;
    TEST_EQ_INT(mtrl_dist_shards_make(&one, &m.params, 1, MTRL_DIST_SHARD_ALIGN, &err), MTRL_OK);
    char *p = malloc(m.params.total);
    TEST_CHECKF(mtrl_dist_ckpt_read_shard(&dc, &one, 0, p, NULL, NULL, &err) == MTRL_OK, "%s", err.msg);
    size_t diff = 0;
    for (size_t i = 0; i < m.params.total; i++) diff += p[i] != ((const char *)m.params.base)[i];
    printf("%s against the parameters of its shards: %zu of %zu bytes differ\n", params_rel, diff, m.params.total);
    TEST_CHECKF(diff == 0, "the full parameter file is not the ranks' current state: %zu bytes differ", diff);
    free(p);
    mtrl_dist_shards_free(&one);
    mtrl_dist_ckpt_close(&dc);
    mtrl_model_free(&m);
}

static void test_run(void) {
    test_result r = mtrl_((char *[]){"run", "ep.ini", "--db", "ep.db", NULL});
    TEST_CHECKF(r.rc == 0, "mtrl run with expert_parallel: exit %d\n%s", r.rc, r.err);
    TEST_CONTAINS(r.err, "2 data-parallel learner ranks: threads of one process on the CPU (local backend); the routed "
                         "experts expert parallel over them");
    test_result_free(&r);
    char db[400];
    snprintf(db, sizeof db, "%s/ep.db", dir_);
    TEST_EQ_INT(test_query_int(db, "SELECT count(*) FROM runs WHERE status = 'finished'"), 1);
    TEST_EQ_INT(test_query_int(db, "SELECT max(step) FROM metrics WHERE name = 'grad_norm'"), 2);
    TEST_CHECK(exists_("out/ep-run1/ckpt-000002.shards/optimizer.safetensors.rank0of2"));
    TEST_CHECK(exists_("out/ep-run1/ckpt-000002.shards/optimizer.safetensors.rank1of2"));
    params_match_shards_("out/ep-run1/ckpt-000002.safetensors", "out/ep-run1/ckpt-000002.shards/optimizer.safetensors");
    test_result e = mtrl_((char *[]){"eval", "ep.ini", "--checkpoint", "out/ep-run1/ckpt-000002.safetensors", "--episodes",
                                     "4", NULL});
    TEST_CHECKF(e.rc == 0, "mtrl eval of a 2-rank expert-parallel checkpoint: exit %d\n%s", e.rc, e.err);
    test_result_free(&e);
}

static void test_config(void) {
    static const struct { const char *set, *says; } bad[] = {
        {"learner.ranks=9", "[learner] expert_parallel = true with 9 learner ranks, but the model has 8 routed experts"},
        {"model.dense_layers=4", "[learner] expert_parallel = true, but the model has no MoE layer"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *s = (char *)bad[i].set;
        test_result r = mtrl_((char *[]){"check", "ep.ini", "--set", s, NULL});
        TEST_CHECKF(r.rc == 2, "mtrl check --set %s: exit %d, want 2\n%s", s, r.rc, r.err);
        TEST_CONTAINS(r.err, bad[i].says);
        test_result_free(&r);
        r = mtrl_((char *[]){"run", "ep.ini", "--db", "bad.db", "--set", s, NULL});
        TEST_CHECKF(r.rc == 2, "mtrl run --set %s: exit %d, want 2\n%s", s, r.rc, r.err);
        TEST_CONTAINS(r.err, bad[i].says);
        test_result_free(&r);
        TEST_CHECK(!exists_("bad.db"));
    }
    test_result r = mtrl_((char *[]){"check", "ep.ini", NULL});
    TEST_EQ_INT(r.rc, 0);
    TEST_CONTAINS(r.out, "; learner: 2 data-parallel learner ranks: threads of one process on the CPU (local backend); "
                         "the routed experts expert parallel over them");
    test_result_free(&r);
    r = mtrl_((char *[]){"plan", "ep.ini", "--budget-gib", "8", NULL});
    TEST_EQ_INT(r.rc, 0);
    TEST_CONTAINS(r.out, "expert-parallel ownership");
    TEST_CONTAINS(r.out, "mtrl run trains this split with [learner] expert_parallel");
    test_result_free(&r);
}

int main(void) {
    bin_ = getenv("MTRL_BIN");
    if (!bin_ || !getenv("MTRL_BUILD")) {
        printf("SKIP: MTRL_BIN / MTRL_BUILD not set (run through ctest)\n");
        return 77;
    }
    snprintf(dir_, sizeof dir_, "/tmp/mtrl_run_ranks_ep_XXXXXX");
    if (!mkdtemp(dir_)) {
        perror("mkdtemp");
        return 1;
    }
    char path[400];
    snprintf(path, sizeof path, "%s/ep.ini", dir_);
    FILE *f = fopen(path, "w");
    fputs(INI, f);
    fclose(f);
    test_config();
    test_run();
    test_tmpdir_done(dir_, test_failed_);
    return test_report();
}
