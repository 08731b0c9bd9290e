// mtrl-test: cpu fault timeout=120
// test_env_hang: a plug-in whose every step hangs (issue 28, item 7: with the default isolate =
// false the hung actors were declared dead but never killed or restarted, 0 steps in 150 s;
// with isolate = true the watchdog worked but healthy episodes were aborted as "actor stopped
// heartbeating" while a step waited for it).
//  1. isolate = false: `mtrl run`'s supervisor kills the actor that the learner declared dead
//     (it fell silent in the hung step) and restarts it: the new process joins again.
//  2. isolate = true, step_timeout_ms = 3000 (three heartbeat timeouts): the hung step is killed
//     at its deadline, and the actor is never declared dead meanwhile (the env host's wait keeps
//     its heartbeats going).
// Waits poll for a state with a deadline; nothing asserts how long anything took.
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
static const char *bin_, *build_;


static pid_t start_run(const char *tag, int isolate, const char *log) {
    char ini[320], db[320];
    snprintf(ini, sizeof ini, "%s/%s.ini", dir_, tag);
    snprintf(db, sizeof db, "%s/%s.db", dir_, tag);
    FILE *f = fopen(ini, "w");
    fprintf(f,
            "[run]\nname = hang\nsteps = 1000\nout_dir = %s/out-%s\ncheckpoint_every = 0\n"
            "[model]\npreset = tiny\n"
            "[env]\nname = plugin\nplugin = %s/lib/libmtrl_env_bad_hang_step.so\nisolate = %s\nstep_timeout_ms = 3000\n"
            "[actor]\ncount = 1\nepisodes_in_flight = 2\nmax_tokens = 16\nmax_turn_tokens = 4\nheartbeat_ms = 100\n"
            "[learner]\nbatch_groups = 1\nheartbeat_timeout_ms = 1000\n[algo]\ngroup_size = 2\n",
            dir_, tag, build_, isolate ? "true" : "false");
    fclose(f);
    return test_start_logged((char *[]){(char *)bin_, "run", ini, "--db", db, NULL}, log);
}

static void stop_run(pid_t pid) {
    kill(pid, SIGTERM);
    int st;
    double until = mtrl_time_mono() + 20;
    while (waitpid(pid, &st, WNOHANG) == 0) {
        if (mtrl_time_mono() > until) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            return;
        }
        test_sleep_ms(50);
    }
}

static void test_in_process(void) {
    char log[320];
    snprintf(log, sizeof log, "%s/inproc.log", dir_);
    pid_t run = start_run("inproc", 0, log);
    TEST_CHECKF(test_log_wait(log, ") joined", 1, 30), "the actor never joined (%s)", log);
    int killed = test_log_wait(log, "fell silent and the learner declared it dead: killing it", 1, 15);
    TEST_CHECKF(killed, "the supervisor did not kill the actor hung in its env step (%s)", log);
    if (killed) {
        TEST_CHECKF(test_log_wait(log, "died: signal 9; restarting", 1, 10), "the killed actor was not restarted (%s)", log);
        TEST_CHECKF(test_log_wait(log, ") joined", 2, 30), "the restarted actor did not join again (%s)", log);
    }
    stop_run(run);
}

static void test_isolated(void) {
    char log[320];
    snprintf(log, sizeof log, "%s/iso.log", dir_);
    pid_t run = start_run("iso", 1, log);
    TEST_CHECKF(test_log_wait(log, ") joined", 1, 30), "the actor never joined (%s)", log);
    TEST_CHECKF(test_log_wait(log, "timed out after 3000 ms", 1, 20), "the hung isolated step was not stopped (%s)", log);
    TEST_CHECKF(test_log_count(log, "silent for") == 0, "the actor was declared dead while an isolated step hung (%s)", log);
    stop_run(run);
}

int main(void) {
    bin_ = getenv("MTRL_BIN");
    build_ = getenv("MTRL_BUILD");
    if (!bin_ || !build_) {
        printf("SKIP: MTRL_BIN / MTRL_BUILD not set (run through ctest)\n");
        return 77;
    }
    snprintf(dir_, sizeof dir_, "/tmp/mtrl_hang_XXXXXX");
    if (!mkdtemp(dir_)) {
        perror("mkdtemp");
        return 1;
    }
    test_in_process();
    test_isolated();
    test_tmpdir_done(dir_, test_failed_);
    return test_report();
}
