// mtrl-test: cpu timeout=120
// `mtrl run` as a launcher's world of processes (issue 27, docs/multi-gpu.md §3): two real
// `mtrl run` processes started as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
// [model] device = cpu, the zmq backend between them on loopback, a real actor and SQLite store.
//   1. both exit 0, the run finishes, and its warm-up losses are those of a [learner] ranks = 2
//      run of threads (the zmq backend sums in rank order as the local one does: measured
//      equal to the bit; checked within test_run_ranks' 1e-5 with QB off); its checkpoints hold
//      both rank files; the follower opened no store (one run in it) and says it was stopped.
//   2. --resume under the same launch continues the run to the steps asked.
//   3. mtrl check under the launch says which rank mtrl run would be; a [learner] ranks that
//      disagrees with WORLD_SIZE is refused by check and run (exit 2, naming both).
//   4. rank 0 killed (SIGKILL) mid-run: rank 1 exits 1 within its limit (2 x rank_timeout_ms
//      + 100 ms after its last answer, plus the step it may be computing) with a message naming
//      rank 0's address.
#include <math.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tests/testhelp.h"
#include "tests/testproc.h"

static char dir_[256];
static const char *bin_;

static const char *INI =
    "[run]\nname = procs\nseed = 7\nsteps = 3\nout_dir = out\ncheckpoint_every = 2\nkeep_checkpoints = 0\n"
    "[model]\npreset = tiny\ndevice = cpu\n"
    "[env]\nname = calc\ndigits = 1\nops = 1\nmax_tool_calls = 2\n"
    "[warmup]\nsteps = 8\nbatch = 8\nlr = 5e-3\n"
    "[actor]\ncount = 1\nepisodes_in_flight = 8\nmax_tokens = 48\nmax_turn_tokens = 16\n"
    "[learner]\nbatch_groups = 2\nthreads = 1\nqb = false\nrank_timeout_ms = 2000\n"
    "[algo]\ngroup_size = 4\n";

// A free port p on 127.0.0.1 with p - 1 >= 1024: MASTER_PORT = p - 1, the rendezvous p.
static int free_port_(void) {
    for (;;) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        socklen_t n = sizeof a;
        if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) || getsockname(fd, (struct sockaddr *)&a, &n)) abort();
        close(fd);
        if (ntohs(a.sin_port) > 1025) return ntohs(a.sin_port);
    }
}

// `mtrl ARGS` as rank `rank` of `world` (rank < 0: no launcher), in dir_, output to log.
static pid_t start_(int rank, int world, int port, const char *log, char *const *args) {
    char *argv[24] = {(char *)bin_};
    int n = 1;
    for (; args[n - 1] && n < 23; n++) argv[n] = args[n - 1];
    argv[n] = NULL;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        if (chdir(dir_) != 0) _exit(126);
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 1);
        dup2(fd, 2);
        setenv("OMP_NUM_THREADS", "1", 1);
        if (rank >= 0) {
            char r[16], w[16], p[16];
            snprintf(r, sizeof r, "%d", rank), snprintf(w, sizeof w, "%d", world), snprintf(p, sizeof p, "%d", port - 1);
            setenv("RANK", r, 1), setenv("WORLD_SIZE", w, 1), setenv("MASTER_ADDR", "127.0.0.1", 1);
            setenv("MASTER_PORT", p, 1);
        }
        execv(argv[0], argv);
        _exit(127);
    }
    return pid;
}

static double now_(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

// The exit status of pid (128 + signal), or -1 when it runs past `seconds` (then killed).
static int wait_(pid_t pid, double seconds) {
    double t0 = now_();
    for (;;) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        if (now_() - t0 > seconds) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            return -1;
        }
        test_sleep_ms(20);
    }
}

static char *log_(const char *name) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s", dir_, name);
    return test_slurp(path, NULL);
}

// Both ranks of `mtrl ARGS` under a fresh launch; their exit codes into rc[2].
static void world_(char *const *args, int rc[2]) {
    int port = free_port_();
    pid_t p1 = start_(1, 2, port, "rank1.log", args), p0 = start_(0, 2, port, "rank0.log", args);
    rc[0] = wait_(p0, 60);
    rc[1] = wait_(p1, 30);
}

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

// ---- 1. and 2. a world of two processes, then resumed ----------------------------------------------

static void test_world(void) {
    int rc[2];
    world_((char *[]){"run", "procs.ini", "--db", "procs.db", NULL}, rc);
    char *l0 = log_("rank0.log"), *l1 = log_("rank1.log");
    TEST_CHECKF(rc[0] == 0 && rc[1] == 0, "2 processes: exits %d and %d\nrank 0:\n%s\nrank 1:\n%s", rc[0], rc[1], l0, l1);
    TEST_CONTAINS(l0, "2 data-parallel learner ranks: processes of a torchrun launch, rank 0 here (zmq backend");
    TEST_CONTAINS(l1, "learner rank 1 of 2: joined rank 0 at 127.0.0.1:");
    TEST_CONTAINS(l1, "learner rank 1 of 2: rank 0 stopped the world after");
    free(l0), free(l1);
    TEST_EQ_INT(query_("procs.db", "SELECT count(*) FROM runs"), 1);
    TEST_EQ_INT(query_("procs.db", "SELECT status = 'finished' FROM runs WHERE id = 1"), 1);
    TEST_CHECK(exists_("out/procs-run1/ckpt-000002.shards/optimizer.safetensors.rank0of2"));
    TEST_CHECK(exists_("out/procs-run1/ckpt-000002.shards/optimizer.safetensors.rank1of2"));
    TEST_CHECK(exists_("out/procs-run1/ckpt-000003.shards/optimizer.safetensors"));
    // The same experiment as 2 threads of one process.
    char *argv[] = {(char *)bin_, "run", "procs.ini", "--db", "threads.db", "--set", "learner.ranks=2", NULL};
    test_result r = test_run_in(dir_, argv);
    TEST_CHECKF(r.rc == 0, "ranks = 2 as threads: exit %d\n%s", r.rc, r.err);
    test_result_free(&r);
    double a[16], b[16];
    int na = metric_("threads.db", "warmup_loss", a, 16), nb = metric_("procs.db", "warmup_loss", b, 16);
    TEST_EQ_INT(na, 8);
    TEST_EQ_INT(nb, 8);
    double worst = 0;
    for (int i = 0; i < na && i < nb; i++) {
        double rel = fabs(b[i] - a[i]) / fabs(a[i]);
        if (rel > worst) worst = rel;
        TEST_CHECKF(rel <= 1e-5, "warm-up step %d: %.7f on 2 processes, %.7f on 2 threads", i + 1, b[i], a[i]);
    }
    printf("warm-up losses, 2 processes vs 2 threads: largest relative difference %.2g (first %.7f, last %.7f)\n", worst,
           nb ? b[0] : 0, nb ? b[nb - 1] : 0);
    if (nb == 8) TEST_CHECKF(b[7] < 0.9 * b[0], "the warm-up did not learn: %.3f -> %.3f", b[0], b[7]);
    double g[8];
    TEST_EQ_INT(metric_("procs.db", "grad_norm", g, 8), 3);
    for (int i = 0; i < 3; i++) TEST_CHECKF(isfinite(g[i]), "RL step %d: grad_norm %g", i + 1, g[i]);

    world_((char *[]){"run", "procs.ini", "--db", "procs.db", "--resume", "--set", "run.steps=5", NULL}, rc);
    l0 = log_("rank0.log"), l1 = log_("rank1.log");
    TEST_CHECKF(rc[0] == 0 && rc[1] == 0, "resumed: exits %d and %d\nrank 0:\n%s\nrank 1:\n%s", rc[0], rc[1], l0, l1);
    TEST_CONTAINS(l0, "resumed run 1 at step 3");
    free(l0), free(l1);
    TEST_EQ_INT(query_("procs.db", "SELECT max(step) FROM checkpoints"), 5);
    TEST_EQ_INT(query_("procs.db", "SELECT max(step) FROM metrics WHERE name = 'grad_norm'"), 5);
    TEST_EQ_INT(query_("procs.db", "SELECT status = 'finished' FROM runs WHERE id = 1"), 1);
    TEST_CHECK(exists_("out/procs-run1/ckpt-000005.shards/optimizer.safetensors.rank1of2"));
}

// ---- 3. mtrl check, and ranks that disagree with the launch -------------------------------------------

static void test_check(void) {
    int port = free_port_();
    pid_t p = start_(1, 2, port, "check.log", (char *[]){"check", "procs.ini", NULL});
    TEST_EQ_INT(wait_(p, 20), 0);
    char *t = log_("check.log");
    TEST_CONTAINS(t, "mtrl run joins this world as learner rank 1 of 2: a follower");
    free(t);
    static char *const bad[][8] = {{"check", "procs.ini", "--set", "learner.ranks=3", NULL},
                                   {"run", "procs.ini", "--db", "bad.db", "--set", "learner.ranks=3", NULL}};
    for (int i = 0; i < 2; i++) {
        p = start_(i, 2, port, "bad.log", (char *const *)bad[i]);
        TEST_EQ_INT(wait_(p, 20), 2);
        t = log_("bad.log");
        TEST_CONTAINS(t, "[learner] ranks = 3, but the launch (torchrun) says WORLD_SIZE = 2");
        free(t);
    }
    TEST_CHECK(!exists_("bad.db"));
}

// ---- 4. rank 0 killed mid-run -------------------------------------------------------------------------

static void test_kill(void) {
    int port = free_port_();
    char *args[] = {"run", "procs.ini", "--db", "kill.db", "--set", "run.steps=100000", "--set", "warmup.steps=0", NULL};
    pid_t p1 = start_(1, 2, port, "kill1.log", args), p0 = start_(0, 2, port, "kill0.log", args);
    // Killed once RL steps are being taken (a step metric in the store), between or inside one.
    double t0 = now_();
    while (query_("kill.db", "SELECT count(*) FROM metrics WHERE name = 'grad_norm'") < 2 && now_() - t0 < 30)
        test_sleep_ms(50);
    TEST_CHECKF(query_("kill.db", "SELECT count(*) FROM metrics WHERE name = 'grad_norm'") >= 2, "no RL step in 30 s");
    kill(p0, SIGKILL);
    double killed = now_();
    int rc0 = wait_(p0, 10);
    TEST_EQ_INT(rc0, 128 + SIGKILL);
    // 2 x 2000 + 100 ms without an answer, after the step it may be computing (well under 1 s).
    int rc1 = wait_(p1, 15);
    double took = now_() - killed;
    char *t = log_("kill1.log");
    printf("rank 0 killed: rank 1 exited %d after %.2f s\n", rc1, took);
    TEST_CHECKF(rc1 == 1, "rank 1 after rank 0 was killed: exit %d, want 1\n%s", rc1, t);
    char where[64];
    snprintf(where, sizeof where, "rank 0 at 127.0.0.1:%d", port);
    TEST_CONTAINS(t, where);
    TEST_CONTAINS(t, "mtrl run (learner rank 1 of 2): ");
    TEST_CHECKF(took < 12, "rank 1 took %.2f s to give up", took);
    free(t);
    // rank 0's actor dies with it (PR_SET_PDEATHSIG); nothing else to reap.
}

int main(void) {
    bin_ = getenv("MTRL_BIN");
    if (!bin_) {
        printf("SKIP: MTRL_BIN not set (run through ctest)\n");
        return 77;
    }
    static const char *const launch[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                         "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NPROCS"};
    for (size_t i = 0; i < sizeof launch / sizeof launch[0]; i++) unsetenv(launch[i]);
    snprintf(dir_, sizeof dir_, "/tmp/mtrl_run_procs_XXXXXX");
    if (!mkdtemp(dir_)) {
        perror("mkdtemp");
        return 1;
    }
    char path[400];
    snprintf(path, sizeof path, "%s/procs.ini", dir_);
    FILE *f = fopen(path, "w");
    fputs(INI, f);
    fclose(f);
    test_check();
    test_world();
    test_kill();
    test_tmpdir_done(dir_, test_failed_);
    return test_report();
}
