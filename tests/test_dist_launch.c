// mtrl-test: cpu
// How the ranks of the multi-GPU learner start (issue 27, learner/dist_launch.h):
//   * the launch from torchrun's variables, srun's (nodelists and tasks-per-node in Slurm's
//     compact forms, a node found by block placement) and none; torchrun's winning over Slurm's;
//     every inconsistent or malformed value refused, the message naming the variable and value;
//   * the local rank's GPU with and without [learner] gpus, and a local rank or node beyond it;
//   * NCCL's unique id over ZeroMQ on 127.0.0.1 with real sockets, the ranks as threads: worlds
//     of 1, 2 and 4, every rank's copy equal to rank 0's bit for bit, also with the rendezvous
//     taken from each rank's own torchrun variables; a rank that never asks (rank 0 times out
//     naming it), a rank with no rank 0 (times out naming host:port and the timeout), a rank
//     with another world size and one that asks twice refused, a stranger's message refused,
//     an address rank 0 cannot listen at.
// Timeouts are asserted by their errors and messages, never by how long they took.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zmq.h>

#include "learner/dist_launch.h"
#include "testhelp.h"
#include "testproc.h"

// ---- the launch from the environment ------------------------------------------------------------

static mtrl_dist_launch launch_ok_(const char *const *env) {
    mtrl_dist_launch l;
    mtrl_error err = {0};
    mtrl_status s = mtrl_dist_launch_from_env(&l, env, &err);
    TEST_CHECKF(s == MTRL_OK, "%s", err.msg);
    return l;
}

// The launch is refused with a message containing want1 and want2 (NULL: only want1).
static void launch_bad_(const char *const *env, const char *want1, const char *want2) {
    mtrl_dist_launch l;
    mtrl_error err = {0};
    TEST_EQ_INT(mtrl_dist_launch_from_env(&l, env, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, want1);
    if (want2) TEST_CONTAINS(err.msg, want2);
}

#define ENV(...) ((const char *const[]){__VA_ARGS__, NULL})

// The launch of env, every field, as mtrl_dist_launch_describe writes them.
static void launch_is_(const char *const *env, const char *want) {
    mtrl_dist_launch l = launch_ok_(env);
    char line[512];
    mtrl_dist_launch_describe(&l, line, sizeof line);
    TEST_EQ_STR(line, want);
}

static void test_torchrun_(void) {
    // MASTER_PORT is torchrun's own store's: the id goes one port above.
    launch_is_(ENV("PATH=/bin", "RANK=5", "WORLD_SIZE=8", "LOCAL_RANK=1", "LOCAL_WORLD_SIZE=4", "GROUP_RANK=1",
                   "MASTER_ADDR=node01", "MASTER_PORT=29500"),
               "torchrun: rank 5 of 8 (local 1 of 4, node 1), rendezvous node01:29501");
    mtrl_dist_launch l = launch_ok_(ENV("RANK=5", "WORLD_SIZE=8", "LOCAL_RANK=1", "LOCAL_WORLD_SIZE=4",
                                        "MASTER_ADDR=node01", "MASTER_PORT=29500"));
    TEST_EQ_STR(l.rank_var, "RANK");
    TEST_EQ_STR(l.local_rank_var, "LOCAL_RANK");
    TEST_EQ_INT(l.node, 1); // RANK / LOCAL_WORLD_SIZE without GROUP_RANK
    // Defaults: one node; the node and local rank from RANK.
    launch_is_(ENV("RANK=2", "WORLD_SIZE=3", "MASTER_ADDR=10.1.2.3", "MASTER_PORT=1234"),
               "torchrun: rank 2 of 3 (local 2 of 3, node 0), rendezvous 10.1.2.3:1235");
    launch_is_(ENV("RANK=6", "WORLD_SIZE=8", "LOCAL_WORLD_SIZE=4", "MASTER_ADDR=h", "MASTER_PORT=9"),
               "torchrun: rank 6 of 8 (local 2 of 4, node 1), rendezvous h:10");
    // One rank needs no rendezvous.
    l = launch_ok_(ENV("RANK=0", "WORLD_SIZE=1"));
    TEST_CHECK(l.world == 1 && l.host[0] == 0 && l.port == 0 && !strcmp(l.source, "torchrun"));
    // torchrun's variables win over Slurm's (srun torchrun ...).
    launch_is_(ENV("SLURM_PROCID=0", "SLURM_NTASKS=2", "RANK=1", "WORLD_SIZE=2", "MASTER_ADDR=a", "MASTER_PORT=5"),
               "torchrun: rank 1 of 2 (local 1 of 2, node 0), rendezvous a:6");
}

static void test_slurm_(void) {
    // The fourth node's one task; the port from the job id.
    launch_is_(ENV("SLURM_PROCID=6", "SLURM_NTASKS=7", "SLURM_LOCALID=0", "SLURM_NODEID=3", "SLURM_TASKS_PER_NODE=2(x3),1",
                   "SLURM_STEP_NODELIST=gpu[01-03,07]", "SLURM_JOB_ID=123456"),
               "slurm: rank 6 of 7 (local 0 of 1, node 3), rendezvous gpu01:18456");
    // The step's tasks per node first; the node by block placement; the job's nodelist.
    launch_is_(ENV("SLURM_PROCID=3", "SLURM_NTASKS=5", "SLURM_LOCALID=1", "SLURM_STEP_TASKS_PER_NODE=2,3",
                   "SLURM_TASKS_PER_NODE=4(x2)", "SLURM_JOB_NODELIST=a[1-2]-ib[3-4]", "SLURM_JOBID=7"),
               "slurm: rank 3 of 5 (local 1 of 3, node 1), rendezvous a1-ib3:15007");
    // One number for every node; MASTER_ADDR and MASTER_PORT from the job script win.
    launch_is_(ENV("SLURM_PROCID=5", "SLURM_NPROCS=8", "SLURM_LOCALID=1", "SLURM_NTASKS_PER_NODE=4", "SLURM_NODELIST=n7",
                   "MASTER_ADDR=head", "MASTER_PORT=40000"),
               "slurm: rank 5 of 8 (local 1 of 4, node 1), rendezvous head:40001");
    // One task is one rank, whatever else is missing.
    launch_is_(ENV("SLURM_PROCID=0", "SLURM_NTASKS=1"), "slurm: one rank (rank 0 of 1)");
    mtrl_dist_launch l = launch_ok_(ENV("SLURM_PROCID=0", "SLURM_NTASKS=1"));
    TEST_EQ_STR(l.local_rank_var, "SLURM_LOCALID");

    // Nodelists: the first host of each form.
    static const char *const lists[][2] = {
        {"node[01-03,07]", "node01"}, {"node[07,01-03]", "node07"}, {"x[009-012]", "x009"}, {"n7", "n7"},
        {"h1,h2[3-4]", "h1"},         {"gpu-a[1-2],gpu-b[5]", "gpu-a1"}, {"r[2]-n[10-11]", "r2-n10"},
        {"tail[5]x", "tail5x"},
    };
    for (size_t i = 0; i < sizeof lists / sizeof *lists; i++) {
        char host[64];
        mtrl_error err = {0};
        TEST_CHECKF(mtrl_dist_nodelist_first("L", lists[i][0], host, sizeof host, &err) == MTRL_OK, "%s: %s", lists[i][0],
                    err.msg);
        TEST_EQ_STR(host, lists[i][1]);
    }
    static const char *const bad_lists[] = {"", "node[01-03", "node[a-b]", "node[01-]", "]x", "n[[1]]", ",n1", "n[01,]",
                                            "n[]"};
    for (size_t i = 0; i < sizeof bad_lists / sizeof *bad_lists; i++) {
        char host[64];
        mtrl_error err = {0};
        TEST_EQ_INT(mtrl_dist_nodelist_first("SLURM_NODELIST", bad_lists[i], host, sizeof host, &err), MTRL_ERR_USAGE);
        TEST_CONTAINS(err.msg, "SLURM_NODELIST");
        char quoted[64];
        snprintf(quoted, sizeof quoted, "'%s'", bad_lists[i]);
        TEST_CONTAINS(err.msg, quoted);
    }
    char small[4];
    mtrl_error err;
    TEST_EQ_INT(mtrl_dist_nodelist_first("L", "longname", small, sizeof small, &err), MTRL_ERR_USAGE);
}

static void test_none_(void) {
    mtrl_dist_launch l = launch_ok_(NULL);
    TEST_EQ_STR(l.source, "none");
    TEST_EQ_INT(l.rank, 0);
    TEST_EQ_INT(l.world, 1);
    TEST_EQ_INT(l.local_world, 1);
    l = launch_ok_(ENV("HOME=/root", "RANKS=3", "XRANK=2", "MASTER_ADDR=x", "LOCAL_RANK=1")); // not a launch
    TEST_EQ_STR(l.source, "none");
    TEST_EQ_INT(l.world, 1);
    char line[128];
    mtrl_dist_launch_describe(&l, line, sizeof line);
    TEST_EQ_STR(line, "none: one rank (rank 0 of 1)");
}

static void test_errors_(void) {
    // torchrun
    launch_bad_(ENV("RANK=4", "WORLD_SIZE=4", "MASTER_ADDR=a", "MASTER_PORT=1"), "RANK = 4", "WORLD_SIZE = 4");
    launch_bad_(ENV("RANK=1"), "RANK = 1", "WORLD_SIZE is not");
    launch_bad_(ENV("WORLD_SIZE=2"), "WORLD_SIZE = 2", "RANK is not");
    launch_bad_(ENV("RANK=x", "WORLD_SIZE=2"), "RANK = 'x'", "not a number");
    launch_bad_(ENV("RANK=1 ", "WORLD_SIZE=2"), "RANK = '1 '", NULL);
    launch_bad_(ENV("RANK=-1", "WORLD_SIZE=2"), "RANK = '-1'", NULL);
    launch_bad_(ENV("RANK=0", "WORLD_SIZE=0"), "WORLD_SIZE = 0", "out of range");
    launch_bad_(ENV("RANK=0", "WORLD_SIZE=65"), "WORLD_SIZE = 65", "1 .. 64");
    launch_bad_(ENV("RANK=0", "WORLD_SIZE=2", "MASTER_PORT=1"), "MASTER_ADDR", "WORLD_SIZE = 2");
    launch_bad_(ENV("RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=a"), "MASTER_PORT", NULL);
    launch_bad_(ENV("RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=a", "MASTER_PORT=abc"), "MASTER_PORT = 'abc'", NULL);
    launch_bad_(ENV("RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=a", "MASTER_PORT=0"), "MASTER_PORT = 0", NULL);
    launch_bad_(ENV("RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=a", "MASTER_PORT=65535"), "MASTER_PORT = 65535", NULL);
    launch_bad_(ENV("RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=::1", "MASTER_PORT=9"), "MASTER_ADDR = '::1'", "IPv6");
    launch_bad_(ENV("RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=a b", "MASTER_PORT=9"), "MASTER_ADDR = 'a b'", NULL);
    launch_bad_(ENV("RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=", "MASTER_PORT=9"), "MASTER_ADDR = ''", NULL);
    launch_bad_(ENV("RANK=1", "WORLD_SIZE=4", "LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2", "MASTER_ADDR=a", "MASTER_PORT=9"),
                "LOCAL_RANK = 2", "LOCAL_WORLD_SIZE = 2");
    launch_bad_(ENV("RANK=1", "WORLD_SIZE=6", "LOCAL_WORLD_SIZE=4"), "WORLD_SIZE = 6", "LOCAL_WORLD_SIZE = 4");
    launch_bad_(ENV("RANK=1", "WORLD_SIZE=4", "LOCAL_WORLD_SIZE=5"), "LOCAL_WORLD_SIZE = 5", NULL);
    launch_bad_(ENV("RANK=1", "WORLD_SIZE=4", "LOCAL_WORLD_SIZE=2", "GROUP_RANK=2"), "GROUP_RANK = 2", NULL);
    launch_bad_(ENV("RANK=1", "WORLD_SIZE=4", "LOCAL_RANK=one"), "LOCAL_RANK = 'one'", NULL);
    // slurm
    const char *base = "SLURM_STEP_NODELIST=n[1-2]";
    launch_bad_(ENV("SLURM_PROCID=0"), "SLURM_PROCID = 0", "SLURM_NTASKS");
    launch_bad_(ENV("SLURM_PROCID=2", "SLURM_NTASKS=2"), "SLURM_PROCID = 2", "SLURM_NTASKS = 2");
    launch_bad_(ENV("SLURM_PROCID=0", "SLURM_NTASKS=two"), "SLURM_NTASKS = 'two'", NULL);
    launch_bad_(ENV("SLURM_PROCID=1", "SLURM_NTASKS=2", base), "SLURM_LOCALID is not set", NULL);
    launch_bad_(ENV("SLURM_PROCID=1", "SLURM_NTASKS=2", "SLURM_LOCALID=1", base), "SLURM_TASKS_PER_NODE", NULL);
    launch_bad_(ENV("SLURM_PROCID=1", "SLURM_NTASKS=2", "SLURM_LOCALID=1", "SLURM_TASKS_PER_NODE=2(x", base),
                "SLURM_TASKS_PER_NODE = '2(x'", NULL);
    launch_bad_(ENV("SLURM_PROCID=1", "SLURM_NTASKS=2", "SLURM_LOCALID=1", "SLURM_TASKS_PER_NODE=1,0", base),
                "SLURM_TASKS_PER_NODE = '1,0'", NULL);
    launch_bad_(ENV("SLURM_PROCID=1", "SLURM_NTASKS=4", "SLURM_LOCALID=2", "SLURM_TASKS_PER_NODE=2(x2)", base),
                "SLURM_LOCALID = 2", "SLURM_TASKS_PER_NODE = '2(x2)'");
    launch_bad_(ENV("SLURM_PROCID=1", "SLURM_NTASKS=4", "SLURM_LOCALID=0", "SLURM_NODEID=2", "SLURM_TASKS_PER_NODE=2(x2)",
                    base), "SLURM_NODEID = 2", NULL);
    launch_bad_(ENV("SLURM_PROCID=1", "SLURM_NTASKS=2", "SLURM_LOCALID=1", "SLURM_NTASKS_PER_NODE=2", "SLURM_JOB_ID=1"),
                "SLURM_STEP_NODELIST", "MASTER_ADDR");
    launch_bad_(ENV("SLURM_PROCID=1", "SLURM_NTASKS=2", "SLURM_LOCALID=1", "SLURM_NTASKS_PER_NODE=2",
                    "SLURM_STEP_NODELIST=n[1-2"), "SLURM_STEP_NODELIST = 'n[1-2'", NULL);
    launch_bad_(ENV("SLURM_PROCID=1", "SLURM_NTASKS=2", "SLURM_LOCALID=1", "SLURM_NTASKS_PER_NODE=2", base),
                "SLURM_JOB_ID", "MASTER_PORT");
    launch_bad_(ENV("SLURM_PROCID=1", "SLURM_NTASKS=2", "SLURM_LOCALID=1", "SLURM_NTASKS_PER_NODE=2", base,
                    "SLURM_JOB_ID=x1"), "SLURM_JOB_ID = 'x1'", NULL);
}

static void test_gpu_(void) {
    mtrl_dist_launch l = launch_ok_(ENV("RANK=3", "WORLD_SIZE=4", "LOCAL_RANK=1", "LOCAL_WORLD_SIZE=2",
                                        "MASTER_ADDR=a", "MASTER_PORT=9"));
    int gpu;
    mtrl_error err = {0};
    TEST_EQ_INT(mtrl_dist_launch_gpu(&l, (const int[]){3, 5}, 2, &gpu, &err), MTRL_OK);
    TEST_EQ_INT(gpu, 5);
    TEST_EQ_INT(mtrl_dist_launch_gpu(&l, NULL, 0, &gpu, &err), MTRL_OK);
    TEST_EQ_INT(gpu, 1);
    TEST_EQ_INT(mtrl_dist_launch_gpu(&l, (const int[]){4}, 1, &gpu, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "LOCAL_RANK = 1");
    TEST_CONTAINS(err.msg, "[learner] gpus = 4");
    TEST_EQ_INT(gpu, -1);
    l = launch_ok_(ENV("RANK=1", "WORLD_SIZE=4", "MASTER_ADDR=a", "MASTER_PORT=9")); // four on this node
    TEST_EQ_INT(mtrl_dist_launch_gpu(&l, (const int[]){0, 1}, 2, &gpu, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "4 ranks on this node (LOCAL_WORLD_SIZE)");
    TEST_CONTAINS(err.msg, "0,1");
    l = launch_ok_(ENV("SLURM_PROCID=2", "SLURM_NTASKS=4", "SLURM_LOCALID=2", "SLURM_NTASKS_PER_NODE=4",
                       "SLURM_NODELIST=n1", "SLURM_JOB_ID=1"));
    TEST_EQ_INT(mtrl_dist_launch_gpu(&l, (const int[]){6, 7}, 2, &gpu, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "SLURM_LOCALID = 2");
    l = launch_ok_(NULL);
    TEST_EQ_INT(mtrl_dist_launch_gpu(&l, (const int[]){6, 7}, 2, &gpu, &err), MTRL_OK);
    TEST_EQ_INT(gpu, 6);
}

// ---- the id over ZeroMQ -------------------------------------------------------------------------

enum { ID_BYTES = 128 }; // NCCL's ncclUniqueId

// A TCP port on 127.0.0.1 that nothing listens on now (the kernel's choice, given back).
static int free_port_(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t n = sizeof a;
    int ok = fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &n) == 0;
    if (fd >= 0) close(fd);
    TEST_CHECK(ok);
    return ok ? ntohs(a.sin_port) : 0;
}

typedef struct rank_job {
    const mtrl_dist_rendezvous *rv; // or NULL: from the torchrun variables in env
    const char *const *env;
    int rank, ranks, timeout_ms;
    size_t id_bytes;
    unsigned char id[ID_BYTES];
    mtrl_status st;
    mtrl_error err;
} rank_job;

static void *rank_main_(void *p) {
    rank_job *j = p;
    mtrl_dist_rendezvous rv;
    if (j->rv) rv = *j->rv;
    else {
        mtrl_dist_launch l;
        j->st = mtrl_dist_launch_from_env(&l, j->env, &j->err);
        if (j->st != MTRL_OK) return NULL;
        j->rank = l.rank, j->ranks = l.world;
        rv = mtrl_dist_rendezvous_of(&l);
    }
    j->st = mtrl_dist_bootstrap_zmq(&rv, j->rank, j->ranks, j->id, j->id_bytes ? j->id_bytes : ID_BYTES, j->timeout_ms,
                                    &j->err);
    return NULL;
}

// Runs the jobs as threads and waits for them all.
static void run_ranks_(rank_job *jobs, int n) {
    pthread_t th[8];
    for (int i = 0; i < n; i++) pthread_create(&th[i], NULL, rank_main_, &jobs[i]);
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
}

static void id_fill_(unsigned char *id, unsigned seed) {
    for (int i = 0; i < ID_BYTES; i++) id[i] = (unsigned char)((i * 131u + seed * 7919u) >> 3 ^ (i * seed));
}

static void test_round_trip_(int ranks) {
    mtrl_dist_rendezvous rv = {.host = "127.0.0.1", .port = free_port_()};
    rank_job jobs[8];
    memset(jobs, 0, sizeof jobs);
    for (int r = 0; r < ranks; r++) {
        jobs[r] = (rank_job){.rv = &rv, .rank = r, .ranks = ranks, .timeout_ms = 10000};
        id_fill_(jobs[r].id, (unsigned)(r + 1)); // rank 0's is the id; the others' are overwritten
    }
    unsigned char want[ID_BYTES];
    memcpy(want, jobs[0].id, sizeof want);
    run_ranks_(jobs, ranks);
    for (int r = 0; r < ranks; r++) {
        TEST_CHECKF(jobs[r].st == MTRL_OK, "%d ranks: rank %d: %s", ranks, r, jobs[r].err.msg);
        TEST_CHECKF(!memcmp(jobs[r].id, want, sizeof want), "%d ranks: rank %d's id differs from rank 0's", ranks, r);
    }
}

// Two ranks that find each other through their own torchrun variables.
static void test_from_launch_(void) {
    char port[32];
    snprintf(port, sizeof port, "MASTER_PORT=%d", free_port_() - 1); // the id goes to MASTER_PORT + 1
    const char *const env0[] = {"RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=localhost", port, NULL};
    const char *const env1[] = {"RANK=1", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", port, NULL};
    rank_job jobs[2] = {{.env = env0, .timeout_ms = 10000}, {.env = env1, .timeout_ms = 10000}};
    id_fill_(jobs[0].id, 42);
    run_ranks_(jobs, 2);
    for (int r = 0; r < 2; r++) TEST_CHECKF(jobs[r].st == MTRL_OK, "rank %d: %s", r, jobs[r].err.msg);
    TEST_CHECK(!memcmp(jobs[0].id, jobs[1].id, ID_BYTES));
    TEST_EQ_INT(jobs[1].rank, 1);
}

// Runs one world on a fresh port of 127.0.0.1: job i is rank who[i][0] of who[i][1] ranks, with
// a timeout of who[i][2] ms and an id of who[i][3] bytes (0: ID_BYTES).
static void run_world_(rank_job *jobs, int n, mtrl_dist_rendezvous *rv, const int (*who)[4]) {
    rv->port = free_port_();
    for (int i = 0; i < n; i++)
        jobs[i] = (rank_job){.rv = rv, .rank = who[i][0], .ranks = who[i][1], .timeout_ms = who[i][2],
                             .id_bytes = (size_t)who[i][3]};
    id_fill_(jobs[0].id, (unsigned)n);
    run_ranks_(jobs, n);
}

static void test_failures_(void) {
    // A world of 3 whose rank 2 never comes: rank 0 names it; rank 1 has its id.
    mtrl_dist_rendezvous rv = {.host = "127.0.0.1"};
    rank_job jobs[3];
    run_world_(jobs, 2, &rv, (const int[][4]){{0, 3, 400, 0}, {1, 3, 5000, 0}});
    TEST_EQ_INT(jobs[0].st, MTRL_ERR_TIMEOUT);
    TEST_CONTAINS(jobs[0].err.msg, "rank(s) 2 never asked");
    TEST_CONTAINS(jobs[0].err.msg, "400 ms");
    TEST_CHECKF(jobs[1].st == MTRL_OK, "%s", jobs[1].err.msg);
    TEST_CHECK(!memcmp(jobs[0].id, jobs[1].id, ID_BYTES));

    // A rank with no rank 0: it names the address and the timeout.
    run_world_(jobs, 1, &rv, (const int[][4]){{1, 2, 300, 0}});
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", rv.port);
    TEST_EQ_INT(jobs[0].st, MTRL_ERR_TIMEOUT);
    TEST_CONTAINS(jobs[0].err.msg, addr);
    TEST_CONTAINS(jobs[0].err.msg, "within 300 ms");
    TEST_CONTAINS(jobs[0].err.msg, "rank 1 of 2");

    // Another world size is refused (the asker says why); rank 0 goes on waiting for a real
    // rank 1 and names the refusal when none comes.
    run_world_(jobs, 2, &rv, (const int[][4]){{0, 2, 1000, 0}, {1, 3, 5000, 0}});
    TEST_EQ_INT(jobs[1].st, MTRL_ERR_MISMATCH);
    TEST_CONTAINS(jobs[1].err.msg, "refused");
    TEST_CONTAINS(jobs[1].err.msg, "world has 3 ranks; rank 0's has 2");
    TEST_EQ_INT(jobs[0].st, MTRL_ERR_TIMEOUT);
    TEST_CONTAINS(jobs[0].err.msg, "rank(s) 1 never asked");
    TEST_CONTAINS(jobs[0].err.msg, "refused: rank 1 says the world has 3 ranks");

    // Two processes claiming rank 1 (and no rank 2): one has the id, the other is refused.
    run_world_(jobs, 3, &rv, (const int[][4]){{0, 3, 1000, 0}, {1, 3, 5000, 0}, {1, 3, 5000, 0}});
    TEST_EQ_INT(jobs[0].st, MTRL_ERR_TIMEOUT);
    TEST_CONTAINS(jobs[0].err.msg, "rank(s) 2 never asked");
    TEST_CONTAINS(jobs[0].err.msg, "rank 1 has had the id already");
    int ok = (jobs[1].st == MTRL_OK) + (jobs[2].st == MTRL_OK);
    int dup = (jobs[1].st == MTRL_ERR_STATE) + (jobs[2].st == MTRL_ERR_STATE);
    TEST_EQ_INT(ok, 1);
    TEST_EQ_INT(dup, 1);
    TEST_CHECK(!memcmp(jobs[0].id, jobs[jobs[1].st == MTRL_OK ? 1 : 2].id, ID_BYTES));

    // Another id size is refused too.
    run_world_(jobs, 2, &rv, (const int[][4]){{0, 2, 1000, 0}, {1, 2, 5000, 64}});
    TEST_EQ_INT(jobs[1].st, MTRL_ERR_MISMATCH);
    TEST_CONTAINS(jobs[1].err.msg, "64-byte id; rank 0's is 128 bytes");
    TEST_EQ_INT(jobs[0].st, MTRL_ERR_TIMEOUT);
}

// A stranger's message (not the bootstrap's) gets a refusal, and rank 0 names it.
static void test_stranger_(void) {
    mtrl_dist_rendezvous rv = {.host = "127.0.0.1", .port = free_port_()};
    rank_job job = {.rv = &rv, .rank = 0, .ranks = 2, .timeout_ms = 1000};
    pthread_t th;
    pthread_create(&th, NULL, rank_main_, &job);
    void *ctx = zmq_ctx_new(), *s = zmq_socket(ctx, ZMQ_DEALER);
    char ep[64], reply[256];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", rv.port);
    int ms = 5000, zero = 0;
    zmq_setsockopt(s, ZMQ_RCVTIMEO, &ms, sizeof ms);
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
    TEST_EQ_INT(zmq_connect(s, ep), 0);
    TEST_EQ_INT(zmq_send(s, "GET / HTTP/1.0\r\n\r\n", 18, 0), 18);
    int n = zmq_recv(s, reply, sizeof reply - 1, 0);
    TEST_CHECK(n > 24 && !memcmp(reply, "MTBS", 4) && reply[6] == 3); // kind 3: refused
    if (n > 24) {
        reply[n] = 0;
        TEST_CONTAINS(reply + 24, "not a bootstrap request");
    }
    zmq_close(s);
    zmq_ctx_term(ctx);
    pthread_join(th, NULL);
    TEST_EQ_INT(job.st, MTRL_ERR_TIMEOUT);
    TEST_CONTAINS(job.err.msg, "a message of 18 bytes that is not a bootstrap request");
}

static void test_bad_address_(void) {
    mtrl_error err = {0};
    unsigned char id[ID_BYTES] = {0};
    mtrl_dist_rendezvous rv = {.host = "no-such-host.invalid", .port = 5555};
    TEST_EQ_INT(mtrl_dist_bootstrap_zmq(&rv, 0, 2, id, sizeof id, 200, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "no-such-host.invalid");
    rv = (mtrl_dist_rendezvous){.host = "192.0.2.1", .port = 5555}; // TEST-NET-1: not this machine's
    TEST_EQ_INT(mtrl_dist_bootstrap_zmq(&rv, 0, 2, id, sizeof id, 200, &err), MTRL_ERR_IO);
    TEST_CONTAINS(err.msg, "cannot listen at 192.0.2.1:5555");
    rv = (mtrl_dist_rendezvous){.host = "", .port = 0};
    TEST_EQ_INT(mtrl_dist_bootstrap_zmq(&rv, 1, 2, id, sizeof id, 200, &err), MTRL_ERR_USAGE);
    TEST_EQ_INT(mtrl_dist_bootstrap_zmq(&rv, 0, 1, id, sizeof id, 200, &err), MTRL_OK); // one rank: nothing to do
    TEST_EQ_INT(mtrl_dist_bootstrap_zmq(&rv, 2, 2, id, sizeof id, 200, &err), MTRL_ERR_USAGE);
}

// `mtrl check` under a launcher (of a GPU model: mtrl run refuses it, test_run_procs runs the CPU
// one) says which rank and GPU it would take, and refuses a local rank
// beyond [learner] gpus (ctest sets MTRL_BIN and MTRL_SRC).
static void check_cmd_(const char *vars, const char *gpus, int want_rc, const char *want) {
    const char *bin = getenv("MTRL_BIN"), *src = getenv("MTRL_SRC");
    if (!bin || !src) {
        printf("mtrl check not run: MTRL_BIN / MTRL_SRC not set (run through ctest)\n");
        return;
    }
    char cmd[2048], out[32768];
    snprintf(cmd, sizeof cmd, "env -u RANK -u WORLD_SIZE -u SLURM_PROCID %s '%s' check '%s/experiments/quickstart.ini' "
             "--set model.device=cuda --set learner.gpus=%s 2>&1", vars, bin, src, gpus);
    int rc = test_shell(cmd, out, sizeof out);
    TEST_CHECKF(rc == want_rc, "%s: exit %d, want %d:\n%s", cmd, rc, want_rc, out);
    if (want) TEST_CHECKF(strstr(out, want) != NULL, "%s: no '%s' in:\n%s", cmd, want, out);
    else TEST_CHECKF(strstr(out, "; launch:") == NULL, "%s: a launch line without a launcher:\n%s", cmd, out);
}

static void test_check_command_(void) {
    check_cmd_("RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500", "3,5", 0,
               "; launch: torchrun: rank 1 of 2 (local 1 of 2, node 0), rendezvous 127.0.0.1:29501; GPU 5 (mtrl run "
               "refuses a launch of a GPU model: learner ranks as processes run on the CPU only today");
    check_cmd_("SLURM_PROCID=0 SLURM_NTASKS=1", "", 0, "; launch: slurm: one rank (rank 0 of 1); GPU 0\n");
    check_cmd_("RANK=2 WORLD_SIZE=3 MASTER_ADDR=h MASTER_PORT=9", "3,5", 2, "LOCAL_RANK = 2, but [learner] gpus = 3,5");
    check_cmd_("RANK=2 WORLD_SIZE=2", "", 2, "RANK = 2 is not below WORLD_SIZE = 2");
    check_cmd_("", "", 0, NULL);
}

int main(void) {
    test_torchrun_();
    test_slurm_();
    test_none_();
    test_errors_();
    test_gpu_();
    test_round_trip_(1);
    test_round_trip_(2);
    test_round_trip_(4);
    test_from_launch_();
    test_failures_();
    test_stranger_();
    test_bad_address_();
    test_check_command_();
    return test_report();
}
