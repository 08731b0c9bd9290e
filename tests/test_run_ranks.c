// mtrl-test: cpu timeout=240
// `mtrl run` with several data-parallel learner ranks on the CPU ([learner] ranks, issue 27):
// the real command in a temporary folder, its actor processes over ZeroMQ on loopback, real
// SQLite files.
//   1. ranks = 2 learns as ranks = 1 does on the same seed: the warm-up (supervised steps on
//      the env's demonstrations, the one part of a run whose batches follow from the seed
//      alone) gives the same losses, all falling: with [learner] qb off every one within 1e-5
//      relative (fp32 sums in another order; measured 5e-9 at worst over 8 steps); with QB on
//      (the default) within 1e-2, since β after a step is the mean over the ranks' units, not
//      one rank's (learner/dist_dp.h), and the routing then drifts apart (measured 6.4e-4). The
//      RL steps after it run and log their loss and gradient norm. (The RL batches come from
//      the actors, whose tasks follow their incarnation, a clock: test_learner_ranks compares
//      the RL step itself on a fixed batch.)
//   2. the 2-rank run's checkpoints hold the parameters as one file (what mtrl eval reads: it
//      runs on one) and the moments as 2 rank files and an index; --resume continues it on 1
//      rank, then on 3 (3 rank files), to the steps asked.
//   3. a rank whose checkpoint shard cannot be written (a folder where its file's temporary
//      name goes: the file cannot be created; the learner writes its files through stdio, which
//      tests/fixtures/fault's write shim does not see) stops the run, exit 1, with an error
//      naming the rank and the cause; the checkpoint of that step is not in the store and has
//      no index; --resume, the obstacle gone, continues from the previous checkpoint (and
//      [run] keep_checkpoints removes the older checkpoints' shard folders with them).
//   4. mtrl check and mtrl run refuse ranks the keys disagree about (exit 2, naming the keys;
//      run writes nothing); mtrl check and mtrl plan describe the ranks.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/testhelp.h"
#include "tests/testproc.h"

static char dir_[256];
static const char *bin_, *build_;

static const char *INI =
    "[run]\nname = ranks\nseed = 7\nsteps = 3\nout_dir = out\ncheckpoint_every = 2\nkeep_checkpoints = 0\n"
    "[model]\npreset = tiny\n"
    "[env]\nname = calc\ndigits = 1\nops = 1\nmax_tool_calls = 2\n"
    "[warmup]\nsteps = 8\nbatch = 8\nlr = 5e-3\n"
    "[actor]\ncount = 1\nepisodes_in_flight = 8\nmax_tokens = 48\nmax_turn_tokens = 16\n"
    "[learner]\nbatch_groups = 2\nthreads = 1\n"
    "[algo]\ngroup_size = 4\n";

static test_result mtrl_(char *const *args) {
    char *argv[16] = {(char *)bin_};
    int n = 1;
    for (; args[n - 1] && n < 15; n++) argv[n] = args[n - 1];
    argv[n] = NULL;
    return test_run_in(dir_, argv);
}

// The values of a metric by step (up to cap), from the store; returns how many.
static int metric_(const char *db, const char *name, double *v, int cap) {
    char path[400], sql[200];
    snprintf(path, sizeof path, "%s/%s", dir_, db);
    snprintf(sql, sizeof sql, "SELECT value FROM metrics WHERE name = '%s' ORDER BY step", name);
    return test_query_doubles(path, sql, v, cap);
}

static long long query_(const char *db, const char *sql) {
    char path[400];
    snprintf(path, sizeof path, "%s/%s", dir_, db);
    return test_query_int(path, sql);
}

static int exists_(const char *rel) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s", dir_, rel);
    return access(path, F_OK) == 0;
}

// ---- 1. learns as one rank does ---------------------------------------------------------------------

// The warm-up losses of the runs into db1 (1 rank) and db2 (2 ranks), each step within tol
// relative (the first, before any step, within 1e-5), both falling.
static void warmup_close_(const char *db1, const char *db2, double tol, const char *what) {
    double a[16], b[16];
    int na = metric_(db1, "warmup_loss", a, 16), nb = metric_(db2, "warmup_loss", b, 16);
    TEST_EQ_INT(na, 8);
    TEST_EQ_INT(nb, 8);
    double worst = 0;
    for (int i = 0; i < na && i < nb; i++) {
        double rel = fabs(b[i] - a[i]) / fabs(a[i]);
        if (rel > worst) worst = rel;
        printf("%s, warm-up step %d: loss %.7f on 2 ranks, %.7f on 1 (relative difference %.2g)\n", what, i + 1, b[i], a[i], rel);
        TEST_CHECKF(rel <= (i == 0 ? 1e-5 : tol), "%s, warm-up step %d: %.7f on 2 ranks, %.7f on 1", what, i + 1, b[i], a[i]);
    }
    printf("%s: the warm-up losses' largest relative difference %.2g\n", what, worst);
    if (na == 8 && nb == 8)
        TEST_CHECKF(a[7] < 0.9 * a[0] && b[7] < 0.9 * b[0], "%s: the warm-up did not learn: %.3f -> %.3f (1 rank), %.3f -> "
                    "%.3f (2 ranks)", what, a[0], a[7], b[0], b[7]);
}

static void test_learns(void) {
    static const struct { const char *db, *ranks, *qb; } runs[] = {
        {"one.db", "learner.ranks=1", "learner.qb=true"}, {"two.db", "learner.ranks=2", "learner.qb=true"},
        {"oneq.db", "learner.ranks=1", "learner.qb=false"}, {"twoq.db", "learner.ranks=2", "learner.qb=false"},
    };
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        test_result r = mtrl_((char *[]){"run", "ranks.ini", "--db", (char *)runs[i].db, "--set", (char *)runs[i].ranks,
                                         "--set", (char *)runs[i].qb, NULL});
        TEST_CHECKF(r.rc == 0, "%s %s: exit %d\n%s", runs[i].ranks, runs[i].qb, r.rc, r.err);
        if (i == 1) TEST_CONTAINS(r.err, "2 data-parallel learner ranks: threads of one process on the CPU (local backend)");
        test_result_free(&r);
    }
    warmup_close_("oneq.db", "twoq.db", 1e-5, "QB off");
    warmup_close_("one.db", "two.db", 1e-2, "QB on");
    double g[8];
    int ng = metric_("two.db", "grad_norm", g, 8);
    TEST_EQ_INT(ng, 3);
    for (int i = 0; i < ng; i++) TEST_CHECKF(isfinite(g[i]), "RL step %d: grad_norm %g", i + 1, g[i]);
    TEST_EQ_INT(metric_("two.db", "loss", g, 8), 3);
    TEST_EQ_INT(query_("two.db", "SELECT count(*) FROM runs WHERE status = 'finished'"), 1);
}

// ---- 2. the checkpoints of 2 ranks, resumed on 1 and on 3 -------------------------------------------------

static void test_resume(void) {
    // ckpt-000002 of the 2-rank run: parameters in one file, the moments in 2 shards and an index.
    TEST_CHECK(exists_("out/two-run1/ckpt-000002.safetensors"));
    TEST_CHECK(exists_("out/two-run1/ckpt-000002.shards/optimizer.safetensors"));
    TEST_CHECK(exists_("out/two-run1/ckpt-000002.shards/optimizer.safetensors.rank0of2"));
    TEST_CHECK(exists_("out/two-run1/ckpt-000002.shards/optimizer.safetensors.rank1of2"));
    TEST_CHECK(exists_("out/two-run1/ckpt-000003.shards/optimizer.safetensors"));
    // mtrl eval reads the parameter file as it reads a one-rank checkpoint.
    test_result e = mtrl_((char *[]){"eval", "ranks.ini", "--checkpoint", "out/two-run1/ckpt-000003.safetensors",
                                     "--episodes", "4", NULL});
    TEST_CHECKF(e.rc == 0, "mtrl eval of a 2-rank checkpoint: exit %d\n%s", e.rc, e.err);
    test_result_free(&e);
    test_result r = mtrl_((char *[]){"run", "ranks.ini", "--db", "two.db", "--resume", "--set", "run.steps=5", NULL});
    TEST_CHECKF(r.rc == 0, "resumed on 1 rank: exit %d\n%s", r.rc, r.err);
    TEST_CONTAINS(r.err, "resumed run 1 at step 3");
    TEST_CHECKF(strstr(r.err, "data-parallel learner ranks") == NULL, "one rank described as several:\n%s", r.err);
    test_result_free(&r);
    TEST_CHECK(exists_("out/two-run1/ckpt-000005.safetensors"));
    TEST_CHECK(!exists_("out/two-run1/ckpt-000005.shards")); // one rank: the moments in the file itself
    r = mtrl_((char *[]){"run", "ranks.ini", "--db", "two.db", "--resume", "--set", "run.steps=7", "--set", "learner.ranks=3", NULL});
    TEST_CHECKF(r.rc == 0, "resumed on 3 ranks: exit %d\n%s", r.rc, r.err);
    TEST_CONTAINS(r.err, "resumed run 1 at step 5");
    TEST_CONTAINS(r.err, "3 data-parallel learner ranks");
    test_result_free(&r);
    TEST_CHECK(exists_("out/two-run1/ckpt-000007.shards/optimizer.safetensors.rank2of3"));
    TEST_EQ_INT(query_("two.db", "SELECT max(step) FROM checkpoints"), 7);
    TEST_EQ_INT(query_("two.db", "SELECT max(step) FROM metrics WHERE name = 'grad_norm'"), 7);
    TEST_EQ_INT(query_("two.db", "SELECT status = 'finished' FROM runs WHERE id = 1"), 1);
}

// ---- 3. a rank whose shard cannot be written -------------------------------------------------------------

static void test_failing_rank(void) {
    // Rank 1's file of the step-4 checkpoint cannot be created.
    char obstacle[600], cmd[700];
    snprintf(obstacle, sizeof obstacle, "%s/out/fail-run1/ckpt-000004.shards/optimizer.safetensors.rank1of2.tmp", dir_);
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", obstacle);
    TEST_EQ_INT(system(cmd), 0);
    test_result r = mtrl_((char *[]){"run", "ranks.ini", "--db", "fail.db", "--set", "learner.ranks=2", "--set", "run.steps=6",
                                     "--set", "warmup.steps=0", NULL});
    TEST_CHECKF(r.rc == 1, "a failing rank: exit %d, want 1\n%s", r.rc, r.err);
    TEST_CONTAINS(r.err, "learner rank 1 of 2 failed its checkpoint shards: ");
    TEST_CONTAINS(r.err, "optimizer.safetensors.rank1of2");
    const char *at = strstr(r.err, "learner rank 1 of 2 failed");
    if (at) printf("the failing rank's error: %.*s\n", (int)strcspn(at, "\n"), at);
    test_result_free(&r);
    TEST_EQ_INT(query_("fail.db", "SELECT status = 'failed' FROM runs WHERE id = 1"), 1);
    TEST_EQ_INT(query_("fail.db", "SELECT max(step) FROM checkpoints"), 2);
    TEST_EQ_INT(query_("fail.db", "SELECT count(*) FROM events WHERE message LIKE '%learner rank 1 of 2 failed%'") > 0, 1);
    TEST_CHECK(!exists_("out/fail-run1/ckpt-000004.shards/optimizer.safetensors"));
    TEST_CHECK(!exists_("out/fail-run1/ckpt-000004.safetensors"));
    TEST_EQ_INT(rmdir(obstacle), 0);
    // Resumed with 2 checkpoints kept: the older ones go with their shards.
    r = mtrl_((char *[]){"run", "ranks.ini", "--db", "fail.db", "--resume", "--set", "learner.ranks=2", "--set",
                         "run.steps=6", "--set", "warmup.steps=0", "--set", "run.keep_checkpoints=2", NULL});
    TEST_CHECKF(r.rc == 0, "resumed after the failure: exit %d\n%s", r.rc, r.err);
    TEST_CONTAINS(r.err, "resumed run 1 at step 2");
    test_result_free(&r);
    TEST_EQ_INT(query_("fail.db", "SELECT max(step) FROM checkpoints"), 6);
    TEST_CHECK(!exists_("out/fail-run1/ckpt-000002.safetensors") && !exists_("out/fail-run1/ckpt-000002.shards"));
    TEST_CHECK(exists_("out/fail-run1/ckpt-000004.shards/optimizer.safetensors.rank1of2"));
    TEST_CHECK(exists_("out/fail-run1/ckpt-000006.shards/optimizer.safetensors"));
    TEST_EQ_INT(query_("fail.db", "SELECT status = 'finished' FROM runs WHERE id = 1"), 1);
}

// ---- 4. configurations ---------------------------------------------------------------------------------

static void test_config(void) {
    static const struct { const char *set1, *set2, *set3, *says; } bad[] = {
        {"learner.ranks=-1", "learner.threads=1", "learner.threads=1", "[learner] ranks: -1 is out of range [0, 64]"},
        {"learner.ranks=2", "learner.gpus=0,1", "learner.threads=1",
         "[learner] gpus = 0,1 lists CUDA devices, but [model] device = cpu puts the learner and its actors on the CPU"},
        {"learner.ranks=3", "learner.gpus=0,1", "model.device=cuda", "[learner] ranks = 3, but [learner] gpus = 0,1 lists 2 GPUs"},
        {"learner.ranks=2", "learner.gpus=1,0", "model.device=cuda", "[learner] gpus = 1,0 puts rank 0 on GPU 1"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *s1 = (char *)bad[i].set1, *s2 = (char *)bad[i].set2, *s3 = (char *)bad[i].set3;
        test_result r = mtrl_((char *[]){"check", "ranks.ini", "--set", s1, "--set", s2, "--set", s3, NULL});
        TEST_CHECKF(r.rc == 2, "mtrl check --set %s --set %s: exit %d, want 2\n%s", s1, s2, r.rc, r.err);
        TEST_CONTAINS(r.err, bad[i].says);
        test_result_free(&r);
        r = mtrl_((char *[]){"run", "ranks.ini", "--db", "bad.db", "--set", s1, "--set", s2, "--set", s3, NULL});
        TEST_CHECKF(r.rc == 2, "mtrl run --set %s --set %s: exit %d, want 2\n%s", s1, s2, r.rc, r.err);
        TEST_CONTAINS(r.err, bad[i].says);
        test_result_free(&r);
        TEST_CHECK(!exists_("bad.db"));
    }
    test_result r = mtrl_((char *[]){"check", "ranks.ini", "--set", "learner.ranks=2", NULL});
    TEST_EQ_INT(r.rc, 0);
    TEST_CONTAINS(r.out, "\n; learner: 2 data-parallel learner ranks: threads of one process on the CPU (local backend)\n");
    TEST_CONTAINS(r.out, "\nranks = 2\n");
    test_result_free(&r);
    r = mtrl_((char *[]){"check", "ranks.ini", "--set", "model.device=cuda", "--set", "learner.gpus=0,2", NULL});
    TEST_EQ_INT(r.rc, 0);
    TEST_CONTAINS(r.out, "\n; learner: 2 data-parallel learner ranks on GPUs 0,2 (one thread each, NCCL)\n");
    test_result_free(&r);
    r = mtrl_((char *[]){"check", "ranks.ini", NULL});
    TEST_CHECKF(strstr(r.out, "; learner:") == NULL, "one rank described:\n%s", r.out);
    test_result_free(&r);
    r = mtrl_((char *[]){"plan", "ranks.ini", "--budget-gib", "8", "--set", "learner.ranks=2", NULL});
    TEST_EQ_INT(r.rc, 0);
    TEST_CONTAINS(r.out, "learner: 2 data-parallel learner ranks: threads of one process on the CPU (local backend)\n");
    TEST_CONTAINS(r.out, "per-rank plan (2 ranks)");
    test_result_free(&r);
}

int main(void) {
    bin_ = getenv("MTRL_BIN");
    build_ = getenv("MTRL_BUILD");
    if (!bin_ || !build_) {
        printf("SKIP: MTRL_BIN / MTRL_BUILD not set (run through ctest)\n");
        return 77;
    }
    snprintf(dir_, sizeof dir_, "/tmp/mtrl_run_ranks_XXXXXX");
    if (!mkdtemp(dir_)) {
        perror("mkdtemp");
        return 1;
    }
    char path[400];
    snprintf(path, sizeof path, "%s/ranks.ini", dir_);
    FILE *f = fopen(path, "w");
    fputs(INI, f);
    fclose(f);
    test_config();
    test_learns();
    test_resume();
    test_failing_rank();
    test_tmpdir_done(dir_, test_failed_);
    return test_report();
}
