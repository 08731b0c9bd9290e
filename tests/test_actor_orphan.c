// mtrl-test: cpu fault timeout=120
// test_actor_orphan: actors do not outlive their learner (issue 28, item 6: after a kill -9 of
// the learner, its actors had PPID 1 and still said HELLO to the dead port 14 minutes later).
//  1. `mtrl run` with two local actors, killed with SIGKILL once both actors joined: both actors
//     die too (SIGKILL from PR_SET_PDEATHSIG). This test is their subreaper, so it collects
//     them and sees how they ended.
//  2. A remote actor (`mtrl actor --connect`) of a `mtrl learner` that is killed with SIGKILL
//     gives up once the learner was silent for [actor] learner_patience_s (2 s here) and exits
//     with status 4 (MTRL_ACTOR_EXIT_LEARNER_LOST), saying so.
// Waits poll for a state with a generous deadline; nothing asserts how long anything took.
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "actor/actor.h"
#include "common/timeutil.h"
#include "tests/testhelp.h"
#include "tests/testproc.h"

static char dir_[256];
static const char *bin_;


// Waits until the file holds `count` lines containing `what` (up to 60 s); 1 when it does.
static int wait_for_lines(const char *path, const char *what, int count) {
    double until = mtrl_time_mono() + 60;
    while (mtrl_time_mono() < until) {
        char *text = test_slurp(path, NULL);
        int n = 0;
        for (const char *p = text; (p = strstr(p, what)); p++) n++;
        free(text);
        if (n >= count) return 1;
        test_sleep_ms(50);
    }
    return 0;
}

// The children of pid (from /proc), at most cap.
static int children_of(pid_t pid, pid_t *out, int cap) {
    int n = 0;
    DIR *d = opendir("/proc");
    struct dirent *e;
    while (d && (e = readdir(d)) && n < cap) {
        char path[300], buf[512];
        snprintf(path, sizeof path, "/proc/%s/stat", e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        size_t k = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[k] = 0;
        const char *rp = strrchr(buf, ')'); // the command name may hold spaces
        char state;
        int ppid;
        if (rp && sscanf(rp + 1, " %c %d", &state, &ppid) == 2 && ppid == pid) out[n++] = (pid_t)atoi(e->d_name);
    }
    if (d) closedir(d);
    return n;
}

// waitpid with a deadline (60 s); 1 and *status when it ended.
static int reap(pid_t pid, int *status) {
    double until = mtrl_time_mono() + 60;
    while (mtrl_time_mono() < until) {
        pid_t w = waitpid(pid, status, WNOHANG);
        if (w == pid) return 1;
        if (w < 0 && errno != EINTR) return 0;
        test_sleep_ms(20);
    }
    return 0;
}

// patience: [actor] learner_patience_s (0: the default).
static void write_experiment(const char *path, int actors, int patience) {
    char text[1024];
    snprintf(text, sizeof text,
             "[run]\nname = orphan\nsteps = 100000\nout_dir = %s/out\ncheckpoint_every = 0\n"
             "[model]\npreset = tiny\n[env]\nname = calc\n"
             "[actor]\ncount = %d\nepisodes_in_flight = 2\nmax_tokens = 24\nmax_turn_tokens = 8\nheartbeat_ms = 100\n"
             "learner_patience_s = %d\n"
             "[learner]\nbatch_groups = 1\nheartbeat_timeout_ms = 500\n[algo]\ngroup_size = 2\n",
             dir_, actors, patience ? patience : 3600);
    FILE *f = fopen(path, "w");
    fputs(text, f);
    fclose(f);
}

static void test_run_killed(void) {
    char ini[320], db[320], log[320];
    snprintf(ini, sizeof ini, "%s/run.ini", dir_);
    snprintf(db, sizeof db, "%s/run.db", dir_);
    snprintf(log, sizeof log, "%s/run.log", dir_);
    write_experiment(ini, 2, 0);
    pid_t run = test_start_logged((char *[]){(char *)bin_, "run", ini, "--db", db, NULL}, log);
    int joined = wait_for_lines(log, ") joined", 2);
    TEST_CHECKF(joined, "the actors did not join (%s)", log);
    pid_t kids[8];
    int n = children_of(run, kids, 8);
    TEST_EQ_INT(n, 2);
    kill(run, SIGKILL);
    int st;
    TEST_CHECK(reap(run, &st) && WIFSIGNALED(st));
    // This process is the subreaper: the orphaned actors come to it.
    for (int i = 0; i < n; i++) {
        int ended = reap(kids[i], &st);
        TEST_CHECKF(ended, "actor pid %d outlived its learner", (int)kids[i]);
        if (!ended) kill(kids[i], SIGKILL), reap(kids[i], &st);
        else TEST_CHECKF(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "actor pid %d ended with status 0x%x, not by SIGKILL",
                         (int)kids[i], st);
    }
    printf("mtrl run killed: %d actors died with it\n", n);
}

static void test_remote_gives_up(void) {
    char ini[320], db[320], llog[320], alog[320];
    snprintf(ini, sizeof ini, "%s/learner.ini", dir_);
    snprintf(db, sizeof db, "%s/learner.db", dir_);
    snprintf(llog, sizeof llog, "%s/learner.log", dir_);
    snprintf(alog, sizeof alog, "%s/actor.log", dir_);
    write_experiment(ini, 0, 2);
    pid_t learner = test_start_logged((char *[]){(char *)bin_, "learner", ini, "--db", db, NULL}, llog);
    TEST_CHECK(wait_for_lines(llog, "tcp://", 1));
    char *text, endpoint[128];
    test_log_endpoint(llog, endpoint, sizeof endpoint);
    pid_t actor = test_start_logged((char *[]){(char *)bin_, "actor", "--connect", endpoint, "--id", "7", NULL}, alog);
    TEST_CHECKF(wait_for_lines(llog, "actor 7 (incarnation", 1), "the actor did not join %s", endpoint);
    kill(learner, SIGKILL);
    int st;
    TEST_CHECK(reap(learner, &st));
    int ended = reap(actor, &st);
    TEST_CHECKF(ended, "the remote actor waited for its dead learner for over a minute");
    if (!ended) {
        kill(actor, SIGKILL);
        reap(actor, &st);
        return;
    }
    TEST_CHECKF(WIFEXITED(st) && WEXITSTATUS(st) == MTRL_ACTOR_EXIT_LEARNER_LOST, "actor ended with status 0x%x", st);
    text = test_slurp(alog, NULL);
    TEST_CONTAINS(text, "has been silent for");
    TEST_CONTAINS(text, "([actor] learner_patience_s = 2); giving up (exit 4)");
    free(text);
}

int main(void) {
    bin_ = getenv("MTRL_BIN");
    if (!bin_) {
        printf("SKIP: MTRL_BIN not set (run through ctest)\n");
        return 77;
    }
    if (prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) {
        perror("PR_SET_CHILD_SUBREAPER");
        return 1;
    }
    snprintf(dir_, sizeof dir_, "/tmp/mtrl_orphan_XXXXXX");
    if (!mkdtemp(dir_)) {
        perror("mkdtemp");
        return 1;
    }
    test_run_killed();
    test_remote_gives_up();
    test_tmpdir_done(dir_, test_failed_);
    return test_report();
}
