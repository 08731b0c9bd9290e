// mtrl-test: cpu timeout=240
// `mtrl bench rl` end to end (fork/exec of MTRL_BIN in a mkdtemp directory, real actor
// processes, ZeroMQ on loopback, a real SQLite store): a tiny experiment with a short warm-up
// and checkpoints runs for --seconds of RL and the report has every line; the learner's parts
// add up to its wall time and the actors' to theirs; the actors' summed wall is about
// [actor] count x the RL wall; the RL window is at least --seconds; the store has the per-step
// split of every RL step and the totals the report printed; the temporary folder is gone
// afterwards. Bad usage exits 2 naming the input.
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/testhelp.h"
#include "tests/testproc.h"

static char dir_[256];
static const char *bin_;

#define SECONDS 6.0

static const char *EXPERIMENT =
    "[run]\nname = bench\nseed = 5\nsteps = 3\ncheckpoint_every = 4\nkeep_checkpoints = 2\n"
    "[model]\npreset = tiny\n"
    "[env]\nname = calc\ndigits = 1\nops = 1\nmax_tool_calls = 2\n"
    "[actor]\ncount = 2\nepisodes_in_flight = 4\nmax_tokens = 48\nmax_turn_tokens = 12\nheartbeat_ms = 200\n"
    "[learner]\nbatch_groups = 2\ncredit_bytes = 32768\n"
    "[algo]\ngroup_size = 2\n"
    "[warmup]\nsteps = 4\nbatch = 8\n";

// The number after `label` on the report line that starts with two spaces and label (NAN when
// there is none); *second (nullable): the number after that one.
static double num_(const char *out, const char *label, double *second) {
    char needle[96];
    snprintf(needle, sizeof needle, "\n  %s ", label);
    const char *p = strstr(out, needle);
    if (!p) {
        fprintf(stderr, "no line '  %s' in the report\n", label);
        return NAN;
    }
    char *end;
    double v = strtod(p + strlen(needle), &end);
    if (second) {
        while (*end == ' ' || *end == 's') end++;
        *second = strtod(end, NULL);
    }
    return v;
}

// The number after `prefix` anywhere in out (NAN when absent).
static double after_(const char *out, const char *prefix) {
    const char *p = strstr(out, prefix);
    return p ? strtod(p + strlen(prefix), NULL) : NAN;
}

static double metric_(const char *db, const char *sql) {
    long long v = test_query_int(db, sql);
    return (double)v;
}

// How many entries of dir start with prefix.
static int count_prefixed_(const char *dir, const char *prefix) {
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d));) n += !strncmp(e->d_name, prefix, strlen(prefix));
    if (d) closedir(d);
    return n;
}

static void test_report_and_store(void) {
    char ini[512], db[512];
    snprintf(ini, sizeof ini, "%s/bench.ini", dir_);
    snprintf(db, sizeof db, "%s/runs.db", dir_);
    FILE *f = fopen(ini, "w");
    fputs(EXPERIMENT, f);
    fclose(f);
    char secs[16];
    snprintf(secs, sizeof secs, "%g", SECONDS);
    test_result r = test_run_in(dir_, (char *[]){(char *)bin_, "bench", "rl", "bench.ini", "--seconds", secs, "--db",
                                                 "runs.db", NULL});
    TEST_EQ_INT(r.rc, 0);
    if (r.rc != 0) fprintf(stderr, "--- stderr ---\n%s\n", r.err);
    const char *o = r.out;
    printf("%s", o);
    // Every line of the report.
    const char *lines[] = {"mtrl bench rl bench.ini --seconds 6\n", "machine: ", "experiment: model tiny on cpu; 2 actors",
                           "run store: runs.db\n", "warm-up: ", "RL: ", "  episodes/s ", "  generated tokens/s ",
                           "  trained tokens/s ", "learner (", "  train ", "  waiting for episodes ", "  publish ",
                           "  checkpoint ", "  other ", "  learner busy ", "actors (2, summed over their reports: ",
                           "  prefill ", "  decode ", "  tools ", "  waiting (weights, credit) ", "  decode: ",
                           "reward: ", " (first 20% of RL episodes) -> "};
    for (size_t i = 0; i < sizeof lines / sizeof *lines; i++) TEST_CONTAINS(o, lines[i]);
    TEST_CHECK(strstr(o, "note:") == NULL); // ran its whole --seconds, cleanly

    // The learner's split adds up to its wall time (each part rounded to 0.01 s).
    double wall = after_(o, "\nRL: "), lwall = after_(o, "\nlearner (");
    TEST_NEAR(lwall, wall, 0.006);
    TEST_CHECKF(wall >= SECONDS && wall < SECONDS + 30, "RL wall %.2f s for --seconds %g", wall, SECONDS);
    double pct[5], sum = 0, sum_pct = 0;
    const char *parts[] = {"train", "waiting for episodes", "publish", "checkpoint", "other"};
    double part[5];
    for (int i = 0; i < 5; i++) {
        part[i] = num_(o, parts[i], &pct[i]);
        TEST_CHECKF(part[i] >= -0.005, "learner %s: %.2f s", parts[i], part[i]);
        sum += part[i];
        sum_pct += pct[i];
    }
    TEST_NEAR(sum, wall, 0.03);
    TEST_NEAR(sum_pct, 100.0, 0.3);
    TEST_CHECK(part[0] > 0); // trained
    TEST_CHECK(part[2] > 0); // published every step
    TEST_CHECK(part[3] > 0); // checkpoint_every = 4 within 6 s of tiny steps
    double busy = num_(o, "learner busy", NULL);
    // busy is printed to 0.1 % from the unrounded parts; three parts rounded to 0.01 s each
    TEST_NEAR(busy, 100.0 * (part[0] + part[2] + part[3]) / wall, 0.05 + 100.0 * 3 * 0.005 / wall + 1e-9);

    // The actors' split adds up to their summed wall, which is about 2 actors x the RL wall (a
    // report covers the heartbeat of 0.2 s before it arrived; the last ones may be in flight).
    const char *actors = strstr(o, "\nactors (");
    if (!actors) actors = o + strlen(o);
    double awall = after_(actors, "summed over their reports: ");
    TEST_CHECKF(awall > 0.6 * 2 * wall && awall < 1.1 * 2 * wall + 1, "actors' wall %.2f s, RL wall %.2f s", awall, wall);
    const char *aparts[] = {"prefill", "decode", "tools", "waiting (weights, credit)", "other"};
    double asum = 0, apct = 0, ap[5];
    for (int i = 0; i < 5; i++) {
        double pc;
        ap[i] = num_(actors, aparts[i], &pc);
        TEST_CHECKF(ap[i] >= -0.005, "actors %s: %.2f s", aparts[i], ap[i]);
        asum += ap[i];
        apct += pc;
    }
    TEST_NEAR(asum, awall, 0.03);
    TEST_NEAR(apct, 100.0, 0.3);
    TEST_CHECK(ap[0] > 0 && ap[1] > 0); // prefilled prompts and tool results, decoded tokens

    double eps = num_(o, "episodes/s", NULL), gen = num_(o, "generated tokens/s", NULL),
           trained = num_(o, "trained tokens/s", NULL);
    TEST_CHECK(eps > 0 && gen > 0 && trained > 0);

    // The store: the per-step split at every RL step, and the totals the report printed.
    long long steps = test_query_int(db, "SELECT value FROM metrics WHERE run = 1 AND name = 'rl.steps'");
    TEST_CHECK(steps > 3); // time ends the run, not [run] steps = 3
    TEST_EQ_INT(test_query_int(db, "SELECT count(*) FROM metrics WHERE run = 1 AND name = 'learner_train_seconds'"), steps);
    TEST_EQ_INT(test_query_int(db, "SELECT count(*) FROM metrics WHERE run = 1 AND name = 'actor_decode_seconds'"), steps);
    TEST_EQ_INT(test_query_int(db, "SELECT count(DISTINCT name) FROM metrics WHERE run = 1 AND name LIKE 'rl.%'"),
                24);
    // Each step's split adds up to its cycle.
    TEST_EQ_INT(test_query_int(db, "SELECT count(*) FROM metrics w JOIN metrics o ON o.run = w.run AND o.step = w.step "
                                   "AND o.name = 'learner_other_seconds' WHERE w.run = 1 AND w.name = "
                                   "'learner_wall_seconds' AND o.value < -1e-9"),
                0);
    // Totals, in milliseconds, against the report's rounding.
    double ms_wall = metric_(db, "SELECT round(1000 * value) FROM metrics WHERE run = 1 AND name = 'rl.learner_wall_seconds'");
    TEST_NEAR(ms_wall / 1000, wall, 0.006);
    double ms_steps = metric_(db, "SELECT round(1000 * sum(value)) FROM metrics WHERE run = 1 AND name = 'learner_wall_seconds'");
    TEST_CHECK(ms_steps <= ms_wall + 1); // the steps' cycles, and the tail after the last step
    double ms_train = metric_(db, "SELECT round(1000 * value) FROM metrics WHERE run = 1 AND name = 'rl.learner_train_seconds'");
    TEST_NEAR(ms_train / 1000, part[0], 0.006);
    TEST_EQ_INT(test_query_int(db, "SELECT count(*) FROM metrics WHERE run = 1 AND name IN ('rl.reward_first', 'rl.reward_last')"), 2);
    TEST_EQ_INT(test_query_int(db, "SELECT round(value) FROM metrics WHERE run = 1 AND name = 'rl.episodes_committed'"),
                test_query_int(db, "SELECT count(*) FROM episodes WHERE run = 1"));
    TEST_EQ_INT(test_query_int(db, "SELECT round(value) FROM metrics WHERE run = 1 AND name = 'rl.trained_episodes'"),
                test_query_int(db, "SELECT round(sum(value)) FROM metrics WHERE run = 1 AND name = 'episodes'"));
    TEST_EQ_INT(test_query_int(db, "SELECT status = 'finished' FROM runs WHERE id = 1"), 1);
    // The temporary folder (its out_dir with the checkpoints) is gone.
    TEST_EQ_INT(count_prefixed_(dir_, "mtrl-bench-rl-"), 0);
    test_result_free(&r);
}

static void test_usage(void) {
    test_result r = test_run_in(dir_, (char *[]){(char *)bin_, "bench", "rl", "bench.ini", "--seconds", "0", NULL});
    TEST_EQ_INT(r.rc, 2);
    TEST_CONTAINS(r.err, "--seconds 0: expected a number of seconds > 0");
    test_result_free(&r);
    r = test_run_in(dir_, (char *[]){(char *)bin_, "bench", "rl", NULL});
    TEST_EQ_INT(r.rc, 2);
    TEST_CONTAINS(r.err, "no experiment file given");
    test_result_free(&r);
    r = test_run_in(dir_, (char *[]){(char *)bin_, "bench", "rl", "missing.ini", "--seconds", "1", NULL});
    TEST_EQ_INT(r.rc, 2);
    TEST_CONTAINS(r.err, "missing.ini");
    test_result_free(&r);
    r = test_run_in(dir_, (char *[]){(char *)bin_, "bench", "rl", "bench.ini", "--set", "actor.count=zero", NULL});
    TEST_EQ_INT(r.rc, 2);
    TEST_CONTAINS(r.err, "count");
    test_result_free(&r);
    // `mtrl --help` and `mtrl bench --help` name rl, and nothing this build lacks.
    r = test_run_in(dir_, (char *[]){(char *)bin_, "--help", NULL});
    TEST_CONTAINS(r.out, "benchmarks: model, long, learner, decode, publish, rl");
    test_result_free(&r);
    r = test_run_in(dir_, (char *[]){(char *)bin_, "bench", "--help", NULL});
    TEST_CONTAINS(r.out, "mtrl bench rl EXPERIMENT.ini [--seconds N]");
    test_result_free(&r);
    TEST_EQ_INT(count_prefixed_(dir_, "mtrl-bench-rl-"), 0);
}

int main(void) {
    bin_ = getenv("MTRL_BIN");
    if (!bin_) {
        fprintf(stderr, "MTRL_BIN must be set (ctest sets it)\n");
        return 1;
    }
    snprintf(dir_, sizeof dir_, "/tmp/mtrl-test-bench-rl-XXXXXX");
    TEST_CHECK(mkdtemp(dir_) != NULL);
    setenv("TMPDIR", dir_, 1); // the bench's temporary folder goes here, where the test looks for it
    test_report_and_store();
    test_usage();
    if (test_failed_ == 0) {
        char cmd[300];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir_);
        if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir_);
    }
    return test_report();
}
