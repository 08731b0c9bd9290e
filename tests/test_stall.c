// mtrl-test: cpu fault timeout=120
// test_stall: a run that makes no progress fails, naming why (issue 28, item 12: a network that
// dropped full-size packets gave 0 steps in 8 minutes, and the run never failed).
//  1. `mtrl learner` with [learner] stall_timeout_s = 2 and no actor: it exits 1 with "no
//     progress: no RL step for 2 s ([learner] stall_timeout_s)" and "no actor has connected",
//     and the run is `failed` in the store.
//  2. `mtrl run` with an actor whose episodes finish but never make a batch (batch_groups far
//     above what arrives in the time): the same failure, naming the connected actors and the
//     episodes that did finish.
// The learner ends by itself (a 60 s guard kills it otherwise); nothing asserts how long it took.
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/timeutil.h"
#include "tests/testhelp.h"
#include "tests/testproc.h"

static char dir_[256];
static const char *bin_;

// Runs argv to its end (killed after 60 s); its exit status, the log's text in *log_text.
static int run_logged(char *const argv[], const char *log, char **log_text) {
    pid_t pid = test_start_logged(argv, log);
    int st = 0;
    double until = mtrl_time_mono() + 60;
    while (waitpid(pid, &st, WNOHANG) == 0) {
        if (mtrl_time_mono() > until) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            break;
        }
        test_sleep_ms(50);
    }
    *log_text = test_slurp(log, NULL);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static void write_ini(const char *path, int actors, int batch_groups) {
    FILE *f = fopen(path, "w");
    fprintf(f,
            "[run]\nname = stall\nsteps = 1000\nout_dir = %s/out%d\ncheckpoint_every = 0\n"
            "[model]\npreset = tiny\n[env]\nname = calc\n"
            "[actor]\ncount = %d\nepisodes_in_flight = 2\nmax_tokens = 24\nmax_turn_tokens = 8\nheartbeat_ms = 100\n"
            "[learner]\nbatch_groups = %d\nstall_timeout_s = 2\n[algo]\ngroup_size = 2\n",
            dir_, actors, actors, batch_groups);
    fclose(f);
}

static void test_no_actor(void) {
    char ini[320], db[320], log[320], *text;
    snprintf(ini, sizeof ini, "%s/alone.ini", dir_);
    snprintf(db, sizeof db, "%s/alone.db", dir_);
    snprintf(log, sizeof log, "%s/alone.log", dir_);
    write_ini(ini, 0, 1);
    int rc = run_logged((char *[]){(char *)bin_, "learner", ini, "--db", db, NULL}, log, &text);
    TEST_CHECKF(rc == 1, "a learner with no actor ended with status %d, not 1 (%s)", rc, log);
    TEST_CONTAINS(text, "no progress: no RL step for 2 s ([learner] stall_timeout_s) at step 0");
    TEST_CONTAINS(text, "no actor has connected");
    free(text);
    TEST_EQ_INT((int)test_query_int(db, "SELECT count(*) FROM runs WHERE status = 'failed'"), 1);
}

static void test_no_batch(void) {
    char ini[320], db[320], log[320], *text;
    snprintf(ini, sizeof ini, "%s/starved.ini", dir_);
    snprintf(db, sizeof db, "%s/starved.db", dir_);
    snprintf(log, sizeof log, "%s/starved.log", dir_);
    write_ini(ini, 1, 100000);
    int rc = run_logged((char *[]){(char *)bin_, "run", ini, "--db", db, NULL}, log, &text);
    TEST_CHECKF(rc != 0 && rc < 128, "a run that never takes a step ended with status %d (%s)", rc, log);
    TEST_CONTAINS(text, "no progress: no RL step for 2 s ([learner] stall_timeout_s) at step 0");
    TEST_CONTAINS(text, "1 actors are connected but too few episodes make a batch");
    free(text);
}

int main(void) {
    bin_ = getenv("MTRL_BIN");
    if (!bin_) {
        printf("SKIP: MTRL_BIN not set (run through ctest)\n");
        return 77;
    }
    snprintf(dir_, sizeof dir_, "/tmp/mtrl_stall_XXXXXX");
    if (!mkdtemp(dir_)) {
        perror("mkdtemp");
        return 1;
    }
    test_no_actor();
    test_no_batch();
    test_tmpdir_done(dir_, test_failed_);
    return test_report();
}
