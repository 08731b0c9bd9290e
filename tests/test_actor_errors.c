// mtrl-test: cpu timeout=120
// test_actor_errors: when the actors cannot run an experiment, the run store says why in their
// own words (issue 28, item 17: its events said only "no actor can run this experiment (see the
// actors' errors)", the errors being only on the actors' stderr).
//
// A plug-in whose create() fails only in an `mtrl actor` process (bad_env.c, BAD_ACTOR_CREATE;
// `mtrl run`'s own check creates it elsewhere and passes) with an error holding an escape
// sequence, run by `mtrl run` with two actors and isolate = false (the error comes from the
// actor's process itself): the run fails (exit 1) and is `failed`; runs.db's events hold each
// actor's error ("actor N: ... licence server 10.9.8.7 unreachable \x1b[31mfrom this actor"),
// escaped like all peer text (no ESC byte); the final failure event names the last actor error;
// each actor said why it left ("left: cannot run this experiment").
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/testhelp.h"
#include "tests/testproc.h"

static char dir_[256];

static void test_plugin_fails_in_actors(const char *bin, const char *build) {
    char ini[320], db[320], text[2048];
    snprintf(ini, sizeof ini, "%s/fail.ini", dir_);
    snprintf(db, sizeof db, "%s/fail.db", dir_);
    snprintf(text, sizeof text,
             "[run]\nname = fail\nsteps = 2\nout_dir = %s/out\ncheckpoint_every = 0\n"
             "[model]\npreset = tiny\n"
             "[env]\nname = plugin\nplugin = %s/lib/libmtrl_env_bad_actor_create.so\nisolate = false\n"
             "[actor]\ncount = 2\nepisodes_in_flight = 2\nmax_tokens = 24\nmax_turn_tokens = 8\n"
             "[learner]\nbatch_groups = 1\nthreads = 1\n[algo]\ngroup_size = 2\n",
             dir_, build);
    FILE *f = fopen(ini, "w");
    fputs(text, f);
    fclose(f);
    test_result r = test_run_in(dir_, (char *[]){(char *)bin, "run", ini, "--db", db, NULL});
    TEST_EQ_INT(r.rc, 1);
    TEST_CONTAINS(r.err, "no actor can run this experiment");
    char status[64] = "";
    FILE *p;
    char cmd[600];
    snprintf(cmd, sizeof cmd, "sqlite3 '%s' \"SELECT status FROM runs WHERE id = 1\"", db);
    if ((p = popen(cmd, "r"))) {
        if (!fgets(status, sizeof status, p)) status[0] = '\0';
        pclose(p);
    }
    status[strcspn(status, "\n")] = '\0';
    TEST_EQ_STR(status, "failed");
    const char *want = "licence server 10.9.8.7 unreachable \\x1b[31mfrom this actor";
    char sql[600];
    for (int id = 1; id <= 2; id++) {
        snprintf(sql, sizeof sql,
                 "SELECT count(*) FROM events WHERE run = 1 AND level = 'error' AND message LIKE 'actor %d: %%' "
                 "AND instr(message, '%s') > 0", id, want);
        long long n = test_query_int(db, sql);
        TEST_CHECKF(n == 1, "actor %d's error stored %lld times", id, n);
        snprintf(sql, sizeof sql,
                 "SELECT count(*) FROM events WHERE run = 1 AND message LIKE 'actor %d left: cannot run this experiment%%'", id);
        TEST_EQ_INT(test_query_int(db, sql), 1);
    }
    snprintf(sql, sizeof sql,
             "SELECT count(*) FROM events WHERE run = 1 AND message LIKE 'run 1 failed at step 0: no actor can run "
             "this experiment%%the last actor error: actor _: %%' AND instr(message, '%s') > 0", want);
    TEST_EQ_INT(test_query_int(db, sql), 1);
    TEST_EQ_INT(test_query_int(db, "SELECT count(*) FROM events WHERE instr(message, char(27)) > 0"), 0);
    if (test_failed_) {
        fprintf(stderr, "--- mtrl run stderr ---\n%s\n", r.err);
        snprintf(cmd, sizeof cmd, "sqlite3 '%s' 'SELECT level, message FROM events' >&2", db);
        if (system(cmd) != 0) fprintf(stderr, "(no events)\n");
    }
    test_result_free(&r);
}

int main(void) {
    const char *bin = getenv("MTRL_BIN"), *build = getenv("MTRL_BUILD");
    if (!bin || !build) {
        test_skip("MTRL_BIN / MTRL_BUILD not set (run through ctest)");
    }
    snprintf(dir_, sizeof dir_, "/tmp/mtrl_actor_err_XXXXXX");
    if (!mkdtemp(dir_)) {
        perror("mkdtemp");
        return 1;
    }
    test_plugin_fails_in_actors(bin, build);
    test_tmpdir_done(dir_, test_failed_);
    return test_report();
}
