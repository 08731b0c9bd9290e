// mtrl-test: cpu timeout=120
// test_cli_user: what a new user trips over at the command line (issue 28, items 14, 15, 18),
// with the real mtrl command in a temporary folder.
//  14. `mtrl check` loads and creates the [env] in a child process: an unknown env name, a
//      plug-in that is not there, one built for another ABI, one that refuses its args, calc
//      keys beside a plug-in and a [stage.N] whose env keys the env refuses are each exit 2 with a message naming the problem; `mtrl run` of
//      the same is exit 2 and writes nothing (no run store, no out_dir).
//  15. [env] plugin is relative to the experiment's folder: a bare "reverse.so" beside the INI
//      and "sub/r2.so" are found when mtrl starts elsewhere, and resolve to absolute paths.
//  16. `mtrl check` shows the env's describe() (its tool list) as comments of its output.
//  18. `mtrl --version` names the release and the git revision it was built from, and the run
//      store records that revision for a run (runs.git_rev); `mtrl run --help` describes the
//      options and exit codes; `mtrl bench long --help` is help, not an error; an option
//      missing its value says "missing value"; `mtrl run --json` writes its progress as one
//      JSON object a line on stdout.
//  20. [warmup] target_loss ends the warm-up at the first step whose last 10 losses average
//      below it.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/store.h"
#include "common/version.h"
#include "tests/testhelp.h"
#include "tests/testproc.h"

static char dir_[256];
static const char *bin_, *build_;

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    fputs(text, f);
    fclose(f);
}

static int copy_file(const char *from, const char *to) {
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "cp '%s' '%s'", from, to);
    return system(cmd);
}

// exp/NAME.ini with an [env] section body.
static void experiment(const char *name, const char *env) {
    char path[400], text[1024];
    snprintf(path, sizeof path, "%s/exp/%s.ini", dir_, name);
    snprintf(text, sizeof text, "[run]\nname = %s\nout_dir = out-%s\nsteps = 1\n[model]\npreset = tiny\n[env]\n%s\n"
             "[actor]\ncount = 1\n", name, name, env);
    write_file(path, text);
}

static test_result mtrl(char *a1, char *a2, char *a3, char *a4) {
    char *argv[] = {(char *)bin_, a1, a2, a3, a4, NULL};
    return test_run_in(dir_, argv);
}

static void test_broken_env(void) {
    static const struct { const char *name, *env, *says; } bad[] = {
        {"calcc", "name = calcc", "unknown env 'calcc'; built-in envs are retrieval, calc, http, picture, corpus"},
        {"nonexistent", "name = plugin\nplugin = /nonexistent.so", "env plug-in '/nonexistent.so' could not be loaded"},
        {"abi", "name = plugin\nplugin = abi.so", "was built for env ABI 99.0 but this host speaks"},
        {"refuses", "name = plugin\nplugin = reverse.so\nargs = bogus=1", "env 'reverse' refused its config: reverse: unknown config key 'bogus'"},
        {"calckeys", "name = plugin\nplugin = reverse.so\ndigits = 2",
         "exp/calckeys.ini:10: [env] digits is a key of the built-in calc env and does nothing with name = plugin"},
        {"notthere", "name = plugin\nplugin = missing.so", "env plug-in 'missing.so' could not be loaded"},
        // a later stage's env keys that the env refuses: found before the first stage runs
        {"stage", "name = corpus\ntask = trail\nhops = 4\nfiles = 16\n[stage.1]\ncontext = 2048\n[stage.2]\nhops = 3\nhops_min = 4",
         "[stage.2] with [env]: env 'corpus' refused its config: corpus: hops_min=4 is above hops=3"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        experiment(bad[i].name, bad[i].env);
        char ini[64], db[64], out[400];
        snprintf(ini, sizeof ini, "exp/%s.ini", bad[i].name);
        snprintf(db, sizeof db, "%s.db", bad[i].name);
        test_result r = mtrl("check", ini, NULL, NULL);
        TEST_CHECKF(r.rc == 2, "mtrl check %s: exit %d, want 2 (%s)", ini, r.rc, r.err);
        TEST_CONTAINS(r.err, bad[i].says);
        TEST_CONTAINS(r.err, "mtrl check: 1 problem in");
        if (i == 0) printf("mtrl check %s:\n%s", ini, r.err);
        test_result_free(&r);
        r = mtrl("run", ini, "--db", db);
        TEST_CHECKF(r.rc == 2, "mtrl run %s: exit %d, want 2 (%s)", ini, r.rc, r.err);
        TEST_CONTAINS(r.err, bad[i].says);
        test_result_free(&r);
        // Nothing written: no run store, no out_dir.
        snprintf(out, sizeof out, "%s/%s", dir_, db);
        TEST_CHECKF(access(out, F_OK) != 0, "mtrl run %s left %s", ini, out);
        snprintf(out, sizeof out, "%s/out-%s", dir_, bad[i].name);
        TEST_CHECKF(access(out, F_OK) != 0, "mtrl run %s left %s", ini, out);
    }
}

static void test_plugin_paths(void) {
    experiment("bare", "name = plugin\nplugin = reverse.so");
    experiment("sub", "name = plugin\nplugin = sub/r2.so");
    char want[600];
    // mtrl starts in dir_, the experiments live in dir_/exp.
    test_result r = mtrl("check", "exp/bare.ini", NULL, NULL);
    TEST_CHECKF(r.rc == 0, "mtrl check exp/bare.ini: exit %d: %s", r.rc, r.err);
    char real[300];
    TEST_CHECK(realpath(dir_, real) != NULL);
    snprintf(want, sizeof want, "\nplugin = %s/exp/reverse.so\n", real);
    TEST_CONTAINS(r.out, want);
    // Item 16: the env's describe() (its tool list) is shown, as comments.
    TEST_CONTAINS(r.out, "\n; the env's tools (its describe()):\n;   letter(i): ");
    // The resolved config lists every key (calc's too, at their defaults): it passes again, as
    // it must for the actors, which receive it.
    char resolved[400];
    snprintf(resolved, sizeof resolved, "%s/exp/resolved.ini", dir_);
    write_file(resolved, r.out);
    test_result_free(&r);
    r = mtrl("check", "exp/resolved.ini", NULL, NULL);
    TEST_CHECKF(r.rc == 0, "mtrl check of mtrl check's output: exit %d: %s", r.rc, r.err);
    test_result_free(&r);
    r = mtrl("check", "exp/sub.ini", NULL, NULL);
    TEST_CHECKF(r.rc == 0, "mtrl check exp/sub.ini: exit %d: %s", r.rc, r.err);
    snprintf(want, sizeof want, "\nplugin = %s/exp/sub/r2.so\n", real);
    TEST_CONTAINS(r.out, want);
    test_result_free(&r);
    // --set is the command line's: relative to where mtrl starts.
    r = mtrl("check", "exp/bare.ini", "--set", "env.plugin=exp/sub/r2.so");
    TEST_EQ_INT(r.rc, 0);
    TEST_CONTAINS(r.out, "\nplugin = exp/sub/r2.so\n");
    test_result_free(&r);
}

static void test_version_and_help(void) {
    test_result r = mtrl("--version", NULL, NULL, NULL);
    TEST_EQ_INT(r.rc, 0);
    char want[256], rev[128] = "";
    snprintf(want, sizeof want, "mtrl %s (git ", mtrl_version());
    TEST_CHECKF(!strncmp(r.out, want, strlen(want)), "mtrl --version said '%s'", r.out);
    if (!strncmp(r.out, want, strlen(want))) snprintf(rev, sizeof rev, "%.*s", (int)strcspn(r.out + strlen(want), ")"), r.out + strlen(want));
    TEST_CHECK(rev[0] != 0);
    printf("%s", r.out);
    test_result_free(&r);
    // Built in a git checkout: the revision is a commit of it, HEAD or one before (commits made
    // since the build do not rebuild it). `git describe` may say TAG-N-gHASH and -dirty.
    const char *src = getenv("MTRL_SRC");
    char cmd[800];
    char *dirty = strstr(rev, "-dirty");
    if (dirty) *dirty = 0;
    const char *g = strstr(rev, "-g");
    const char *hash = g ? g + 2 : rev;
    snprintf(cmd, sizeof cmd, "git -C '%s' rev-parse --git-dir >/dev/null 2>&1", src ? src : ".");
    if (system(cmd) == 0) {
        TEST_CHECKF(strcmp(rev, "unknown") != 0, "built in a git checkout, but the revision is unknown");
        snprintf(cmd, sizeof cmd, "git -C '%s' merge-base --is-ancestor '%s' HEAD", src ? src : ".", hash);
        TEST_CHECKF(system(cmd) == 0, "built from %s, which is not HEAD or an ancestor of it", hash);
    } else {
        printf("SKIP part: %s is not a git checkout\n", src ? src : ".");
    }
    // runs.git_rev: what the learner records (it passes no revision of its own).
    char db[400];
    snprintf(db, sizeof db, "%s/rev.db", dir_);
    mtrl_store *s = NULL;
    mtrl_error err;
    int64_t id = 0;
    TEST_EQ_INT(mtrl_store_open(&s, db, 0, &err), MTRL_OK);
    mtrl_store_run_info info = {.name = "rev"};
    if (s) TEST_EQ_INT(mtrl_store_run_create(s, &info, &id, &err), MTRL_OK);
    mtrl_store_run row;
    if (s) TEST_EQ_INT(mtrl_store_run_get(s, id, &row, NULL, &err), MTRL_OK);
    if (s) TEST_EQ_STR(row.git_rev, mtrl_git_rev());
    mtrl_store_close(s);

    r = mtrl("run", "--help", NULL, NULL);
    TEST_EQ_INT(r.rc, 0);
    TEST_CONTAINS(r.out, "usage: mtrl run EXPERIMENT.ini");
    TEST_CONTAINS(r.out, "  --resume ");
    TEST_CONTAINS(r.out, "  --set SECTION.KEY=V");
    TEST_CONTAINS(r.out, "exit codes: 0 finished, 1 the run failed or was killed, 2 bad usage or bad config");
    test_result_free(&r);
    r = mtrl("bench", "long", "--help", NULL);
    TEST_EQ_INT(r.rc, 0);
    TEST_CONTAINS(r.out, "mtrl bench long");
    TEST_EQ_STR(r.err, "");
    test_result_free(&r);
    r = mtrl("run", "exp/bare.ini", "--db", NULL);
    TEST_EQ_INT(r.rc, 2);
    TEST_CONTAINS(r.err, "mtrl run: --db: missing value");
    test_result_free(&r);
    r = mtrl("actor", "--connect", NULL, NULL);
    TEST_EQ_INT(r.rc, 2);
    TEST_CONTAINS(r.err, "mtrl actor: --connect: missing value");
    test_result_free(&r);
}

// Item 18's --json: `mtrl run --json` writes its progress to stdout as one JSON object a line
// (every warm-up step, every RL step, then one "end"), and no progress line to stderr.
static void test_json_progress(void) {
    char path[400];
    snprintf(path, sizeof path, "%s/exp/json.ini", dir_);
    write_file(path, "[run]\nname = json\nout_dir = out-json\nsteps = 3\ncheckpoint_every = 0\n[model]\npreset = tiny\n"
                     "[env]\nname = calc\n[warmup]\nsteps = 2\n[actor]\ncount = 1\nepisodes_in_flight = 4\n"
                     "max_tokens = 32\n[learner]\nbatch_groups = 1\nthreads = 1\n[algo]\ngroup_size = 2\n");
    char *argv[] = {(char *)bin_, "run", "exp/json.ini", "--db", "json.db", "--json", NULL};
    test_result r = test_run_in(dir_, argv);
    TEST_EQ_INT(r.rc, 0);
    int lines = 0, warmup = 0, steps = 0, ends = 0, bad = 0;
    const char *last = "";
    for (char *line = r.out, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = '\0';
        size_t n = strlen(line), quotes = 0;
        for (size_t i = 0; i < n; i++) quotes += line[i] == '"' && (i == 0 || line[i - 1] != '\\');
        if (n < 2 || line[0] != '{' || line[n - 1] != '}' || quotes % 2) bad++;
        lines++;
        if (strstr(line, "\"type\":\"warmup\"")) warmup++;
        if (strstr(line, "\"type\":\"step\"")) steps++;
        if (strstr(line, "\"type\":\"end\"")) ends++;
        last = line;
    }
    TEST_EQ_INT(bad, 0);
    TEST_EQ_INT(warmup, 2);
    TEST_EQ_INT(steps, 3);
    TEST_EQ_INT(ends, 1);
    TEST_EQ_INT(lines, 6);
    TEST_CONTAINS(last, "{\"type\":\"end\",\"run\":1,\"status\":\"finished\",\"step\":3,");
    TEST_CHECKF(strstr(r.err, "step 1/3 |") == NULL && strstr(r.err, "warm-up 1/2") == NULL,
                "a progress line on stderr in --json mode: %s", r.err);
    if (test_failed_) fprintf(stderr, "--- stdout ---\n%s\n--- stderr ---\n%s\n", r.out, r.err);
    test_result_free(&r);
    r = mtrl("run", "--help", NULL, NULL);
    TEST_CONTAINS(r.out, "  --json ");
    test_result_free(&r);
}

// [warmup] target_loss (the quickstart's, item 20): the warm-up ends at the first step whose
// last 10 losses average below it, here at once (a target no loss is above), and says so.
static void test_warmup_target(void) {
    char path[400];
    snprintf(path, sizeof path, "%s/exp/target.ini", dir_);
    write_file(path, "[run]\nname = target\nout_dir = out-target\nsteps = 1\ncheckpoint_every = 0\n[model]\npreset = tiny\n"
                     "[env]\nname = calc\n[warmup]\nsteps = 50\nbatch = 2\ntarget_loss = 1000\n[actor]\ncount = 1\n"
                     "episodes_in_flight = 4\nmax_tokens = 32\n[learner]\nbatch_groups = 1\nthreads = 1\n[algo]\ngroup_size = 2\n");
    char *argv[] = {(char *)bin_, "run", "exp/target.ini", "--db", "target.db", "--json", NULL};
    test_result r = test_run_in(dir_, argv);
    TEST_EQ_INT(r.rc, 0);
    int warmup = 0;
    for (const char *p = strstr(r.out, "{\"type\":\"warmup\""); p; p = strstr(p + 1, "{\"type\":\"warmup\"")) warmup++;
    TEST_EQ_INT(warmup, 10);
    TEST_CONTAINS(r.err, "< [warmup] target_loss 1000 at step 10 of 50: RL starts");
    char db[400];
    snprintf(db, sizeof db, "%s/target.db", dir_);
    TEST_EQ_INT(test_query_int(db, "SELECT count(*) FROM metrics WHERE name = 'warmup_loss'"), 10);
    test_result_free(&r);
}

int main(void) {
    bin_ = getenv("MTRL_BIN");
    build_ = getenv("MTRL_BUILD");
    if (!bin_ || !build_) {
        printf("SKIP: MTRL_BIN / MTRL_BUILD not set (run through ctest)\n");
        return 77;
    }
    snprintf(dir_, sizeof dir_, "/tmp/mtrl_cli_XXXXXX");
    if (!mkdtemp(dir_)) {
        perror("mkdtemp");
        return 1;
    }
    char p[600], q[1300];
    snprintf(p, sizeof p, "%s/exp/sub", dir_);
    snprintf(q, sizeof q, "mkdir -p '%s'", p);
    TEST_EQ_INT(system(q), 0);
    snprintf(p, sizeof p, "%s/lib/libmtrl_env_example.so", build_);
    snprintf(q, sizeof q, "%s/exp/reverse.so", dir_);
    TEST_EQ_INT(copy_file(p, q), 0);
    snprintf(q, sizeof q, "%s/exp/sub/r2.so", dir_);
    TEST_EQ_INT(copy_file(p, q), 0);
    snprintf(p, sizeof p, "%s/lib/libmtrl_env_bad_abi_major.so", build_);
    snprintf(q, sizeof q, "%s/exp/abi.so", dir_);
    TEST_EQ_INT(copy_file(p, q), 0);
    test_broken_env();
    test_plugin_paths();
    test_version_and_help();
    test_json_progress();
    test_warmup_target();
    snprintf(q, sizeof q, "rm -rf '%s'", dir_);
    if (test_failed_ == 0 && system(q) != 0) fprintf(stderr, "could not remove %s\n", dir_);
    return test_report();
}
