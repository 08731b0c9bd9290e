// mtrl-test: cpu timeout=120
// The zmq backend of learner/dist_comm.h (issue 27): ranks as real processes (this binary run
// again, fork + exec, one per rank: "--rank CASE R r PORT ARG DIR"), real sockets on
// 127.0.0.1. Each rank process writes what it saw to DIR/CASE.r; the checks run here.
//   * every collective on 1, 2, 3 and 4 ranks with tests/testdist.h's exact checks (the
//     order-dependent sum in rank order included);
//   * a 64 MB all-reduce over 3 ranks (frames of MTRL_DIST_ZMQ_FRAME) with the bits of the
//     local backend's threads, on values whose sum depends on the order;
//   * a rank that never calls: rank 0 returns MTRL_ERR_TIMEOUT naming it, the other rank the
//     same code with rank 0's message, the late rank an error; later calls MTRL_ERR_STATE;
//   * a rank process killed (SIGKILL) between calls, rank 2 and then rank 0: the others fail
//     within their timeout, naming the rank or rank 0's address;
//   * different collectives, sizes or all-to-all counts: MTRL_ERR_MISMATCH on every rank;
//   * strangers on the port (raw TCP bytes, junk frames, an oversized frame, join requests
//     with another world size or a rank out of range, junk after the world formed): refused,
//     with a refusal answered where the stranger speaks the protocol; the world still works;
//     a world whose rank never comes names the refusals in rank 0's timeout;
//   * the DP RL step (learner/dist_dp.h) over 2 and 3 process ranks against one rank's
//     mtrl_train_rl_step on tests/testdp.h's batch, with test_dist_dp's tolerances, and the
//     parameters compared with the thread ranks' bit for bit.
#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/hash.h"
#include "common/timeutil.h"
#include "learner/dist_comm.h"
#include "learner/dist_launch.h"
#include "tests/testdist.h"
#include "tests/testdp.h"
#include "tests/testhelp.h"
#include "tests/testproc.h"

static char self_[4096], dir_[256];

// ---- the rank processes --------------------------------------------------------------------------

// A free port on 127.0.0.1 (bound, read back, closed: rank 0 binds it next).
static int free_port_(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t n = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) || getsockname(fd, (struct sockaddr *)&a, &n)) abort();
    close(fd);
    return ntohs(a.sin_port);
}

static pid_t spawn_(const char *kase, int R, int r, int port, const char *arg) {
    char sR[16], sr[16], sp[16];
    snprintf(sR, sizeof sR, "%d", R), snprintf(sr, sizeof sr, "%d", r), snprintf(sp, sizeof sp, "%d", port);
    fflush(NULL);
    pid_t p = fork();
    if (p == 0) {
        execl(self_, self_, "--rank", kase, sR, sr, sp, arg ? arg : "-", dir_, (char *)NULL);
        _exit(127);
    }
    return p;
}

// Waits for the ranks' processes (at most 60 s, then kills them); their wait statuses.
static void reap_(const pid_t *pid, int R, int *status) {
    double until = mtrl_time_mono() + 60;
    for (int r = 0; r < R; r++) {
        while (waitpid(pid[r], &status[r], WNOHANG) == 0) {
            if (mtrl_time_mono() > until) {
                kill(pid[r], SIGKILL);
                waitpid(pid[r], &status[r], 0);
                TEST_CHECKF(0, "rank %d's process hung (killed after 60 s)", r);
                break;
            }
            test_sleep_ms(5);
        }
    }
}

// Runs CASE on R rank processes (rank 0 first) on a fresh port; each one's exit checked.
static int world_(const char *kase, int R, const char *arg, int *status) {
    int port = free_port_();
    pid_t pid[MTRL_DIST_RANKS_MAX] = {0};
    for (int r = 0; r < R; r++) pid[r] = spawn_(kase, R, r, port, arg);
    int st[MTRL_DIST_RANKS_MAX];
    reap_(pid, R, status ? status : st);
    if (!status)
        for (int r = 0; r < R; r++)
            TEST_CHECKF(WIFEXITED(st[r]) && WEXITSTATUS(st[r]) == 0, "%s R=%d: rank %d's process ended with %#x", kase, R,
                        r, st[r]);
    return port;
}

static void path_(char *p, size_t cap, const char *kase, int r) { snprintf(p, cap, "%s/%s.%d", dir_, kase, r); }

// What rank r of CASE wrote (n bytes expected; zeros and a failed check when it is not there).
static void take_(const char *kase, int r, void *out, size_t n) {
    char p[512];
    path_(p, sizeof p, kase, r);
    FILE *f = fopen(p, "rb");
    size_t got = f ? fread(out, 1, n, f) : 0;
    if (f) fclose(f);
    TEST_CHECKF(got == n, "%s: rank %d wrote %zu of %zu bytes", kase, r, got, n);
    if (got != n) memset(out, 0, n);
    unlink(p);
}

// ---- what a rank process runs ------------------------------------------------------------------

// One call's outcome in a rank process.
typedef struct call_out {
    mtrl_status st[4];
    double ms[4];
    float sum;
    char msg[4][MTRL_ERROR_MSG_MAX];
} call_out;

static double now_ms_(void) { return mtrl_time_mono() * 1e3; }

static void *host_alloc_(size_t n) { return calloc(1, n); }
static void host_copy_(void *dst, const void *src, size_t n) { memcpy(dst, src, n); }
static const test_dist_mem host_mem_ = {host_alloc_, host_copy_, host_copy_, free};

// The values of the large all-reduce: magnitudes over 2^-20 .. 2^20, so the sum depends on the order.
enum { BIG_N = 16 << 20 }; // 64 MB of fp32
static void big_fill_(float *v, size_t n, int r) {
    for (size_t i = 0; i < n; i++) {
        uint64_t h = mtrl_hash64(&i, sizeof i, (uint64_t)r + 1);
        v[i] = ldexpf((float)((int64_t)(h % 1999999) - 999999), (int)((h >> 40) % 40) - 20);
    }
}

typedef struct big_out {
    mtrl_status st;
    char msg[MTRL_ERROR_MSG_MAX];
    uint64_t digest;
    double ms;
} big_out;

// Rank process main: the case's calls on this rank's handle; what it saw into DIR/CASE.r.
static int rank_main_(const char *kase, int R, int r, int port, const char *arg) {
    mtrl_dist_rendezvous rv = {.port = port};
    snprintf(rv.host, sizeof rv.host, "127.0.0.1");
    int timeout = !strcmp(kase, "timeout") ? 300 : !strcmp(kase, "kill") ? 400 : 10000;
    int join = !strcmp(kase, "lonely") ? 600 : 20000; // processes start at their own pace
    mtrl_dist_comm *c = NULL;
    mtrl_error err = {0};
    mtrl_status s = mtrl_dist_comm_init_zmq(&c, R, r, &rv, join, timeout, &err);
    char p[512];
    path_(p, sizeof p, kase, r);
    FILE *f = fopen(p, "wb");
    if (!f) return 3;
    if (!strcmp(kase, "lonely")) { // rank 0 of a world whose rank 1 never comes
        call_out o;
        memset(&o, 0, sizeof o);
        o.st[0] = s;
        snprintf(o.msg[0], sizeof o.msg[0], "%s", err.msg);
        fwrite(&o, sizeof o, 1, f);
        fclose(f);
        return 0;
    }
    if (s != MTRL_OK) {
        fprintf(stderr, "rank %d of %d: init: %s\n", r, R, err.msg);
        fclose(f);
        return 2;
    }
    int code = 0;
    if (!strcmp(kase, "ops")) {
        test_dist_ops *x = calloc(1, sizeof *x);
        x->mem = &host_mem_;
        test_dist_ops_rank(c, x);
        fwrite(x, sizeof *x, 1, f);
        free(x);
    } else if (!strcmp(kase, "big")) {
        float *v = malloc(sizeof(float) * BIG_N);
        big_fill_(v, BIG_N, r);
        big_out o = {0};
        double t0 = now_ms_();
        o.st = mtrl_dist_comm_allreduce(c, v, BIG_N, MTRL_DT_F32, &err);
        o.ms = now_ms_() - t0;
        snprintf(o.msg, sizeof o.msg, "%s", err.msg);
        o.digest = mtrl_hash64(v, sizeof(float) * BIG_N, 0);
        fwrite(&o, sizeof o, 1, f);
        free(v);
    } else if (!strcmp(kase, "timeout")) { // rank 2 calls only after the others gave up
        call_out o;
        memset(&o, 0, sizeof o);
        float v = 1;
        if (r == 2) test_sleep_ms(1000);
        double t0 = now_ms_();
        o.st[0] = mtrl_dist_comm_allreduce(c, &v, 1, MTRL_DT_F32, &err);
        o.ms[0] = now_ms_() - t0;
        snprintf(o.msg[0], sizeof o.msg[0], "%s", err.msg);
        o.st[1] = mtrl_dist_comm_barrier(c, &err);
        snprintf(o.msg[1], sizeof o.msg[1], "%s", err.msg);
        fwrite(&o, sizeof o, 1, f);
    } else if (!strcmp(kase, "kill")) { // rank `arg` dies after the first call
        call_out o;
        memset(&o, 0, sizeof o);
        float v = 1;
        o.st[0] = mtrl_dist_comm_allreduce(c, &v, 1, MTRL_DT_F32, &err);
        if (r == atoi(arg)) {
            test_sleep_ms(200); // its answers of the first call go out first
            fwrite(&o, sizeof o, 1, f);
            fclose(f);
            raise(SIGKILL);
        }
        test_sleep_ms(50);
        double t0 = now_ms_();
        o.st[1] = mtrl_dist_comm_allreduce(c, &v, 1, MTRL_DT_F32, &err);
        o.ms[1] = now_ms_() - t0;
        snprintf(o.msg[1], sizeof o.msg[1], "%s", err.msg);
        fwrite(&o, sizeof o, 1, f);
    } else if (!strcmp(kase, "mismatch")) { // arg: size, op or a2a
        call_out o;
        memset(&o, 0, sizeof o);
        float v[5] = {0};
        unsigned char b[4] = {0};
        if (!strcmp(arg, "size")) o.st[0] = mtrl_dist_comm_allreduce(c, v, r ? 5 : 4, MTRL_DT_F32, &err);
        else if (!strcmp(arg, "op")) o.st[0] = r ? mtrl_dist_comm_broadcast(c, b, 4, 0, &err) : mtrl_dist_comm_barrier(c, &err);
        else {
            int64_t sc[2] = {1, 1}, so[2] = {0, 1}, rc[2] = {r ? 2 : 1, 1}, ro[2] = {0, r ? 2 : 1};
            int32_t send[2] = {r, r}, recv[3] = {0};
            o.st[0] = mtrl_dist_comm_alltoallv(c, send, sc, so, recv, rc, ro, sizeof(int32_t), &err);
        }
        snprintf(o.msg[0], sizeof o.msg[0], "%s", err.msg);
        o.st[1] = mtrl_dist_comm_barrier(c, &err);
        fwrite(&o, sizeof o, 1, f);
    } else if (!strcmp(kase, "stranger")) { // the world after strangers poked it
        call_out o;
        memset(&o, 0, sizeof o);
        float v = (float)(r + 1);
        if (r == 1) test_sleep_ms(300); // junk arrives while rank 0 waits in the call
        o.st[0] = mtrl_dist_comm_allreduce(c, &v, 1, MTRL_DT_F32, &err);
        snprintf(o.msg[0], sizeof o.msg[0], "%s", err.msg);
        o.sum = v;
        fwrite(&o, sizeof o, 1, f);
    } else {
        fprintf(stderr, "unknown case %s\n", kase);
        code = 4;
    }
    fclose(f);
    mtrl_dist_comm_free(c);
    return code;
}

// ---- the collectives -------------------------------------------------------------------------------

static void test_ops_(int R) {
    test_dist_ops *all = calloc(1, sizeof *all), *one = calloc(1, sizeof *one);
    double t0 = now_ms_();
    world_("ops", R, NULL, NULL);
    for (int r = 0; r < R; r++) take_("ops", r, one, sizeof *one), test_dist_ops_take(all, one, r);
    test_dist_ops_check(all, R, 1, "zmq");
    printf("ops: %d process ranks, every collective exact, in %.0f ms (processes included)\n", R, now_ms_() - t0);
    free(all);
    free(one);
}

typedef struct big_local {
    float *v[3];
} big_local;
static void big_local_rank_(mtrl_dist_comm *c, void *p) {
    big_local *x = p;
    int r = mtrl_dist_comm_rank(c);
    x->v[r] = malloc(sizeof(float) * BIG_N);
    big_fill_(x->v[r], BIG_N, r);
    TEST_EQ_INT(mtrl_dist_comm_allreduce(c, x->v[r], BIG_N, MTRL_DT_F32, NULL), MTRL_OK);
}

static void test_big_(void) {
    world_("big", 3, NULL, NULL);
    big_out o[3];
    for (int r = 0; r < 3; r++) {
        take_("big", r, &o[r], sizeof o[r]);
        TEST_CHECKF(o[r].st == MTRL_OK, "big rank %d: %s", r, o[r].msg);
    }
    big_local x = {{0}};
    test_dist_run_local(3, 30000, -1, big_local_rank_, &x);
    uint64_t local = mtrl_hash64(x.v[0], sizeof(float) * BIG_N, 0);
    // The first 1M values summed in another order ((r2 + r1) + r0): other bits, so the check sees the order.
    enum { ORDER_N = 1 << 20 };
    float *a = malloc(sizeof(float) * ORDER_N), *b = malloc(sizeof(float) * ORDER_N);
    size_t differ = 0;
    for (int r = 2; r >= 0; r--) {
        big_fill_(b, ORDER_N, r);
        for (size_t i = 0; i < ORDER_N; i++) a[i] = r == 2 ? b[i] : a[i] + b[i];
    }
    for (size_t i = 0; i < ORDER_N; i++) differ += memcmp(&a[i], &x.v[0][i], sizeof(float)) != 0;
    for (int r = 0; r < 3; r++) {
        TEST_CHECKF(o[r].digest == local, "big rank %d: the 64 MB all-reduce differs from the local backend's bits", r);
        printf("big: rank %d all-reduced 64 MB in %.0f ms, digest %016llx (local threads %016llx)\n", r, o[r].ms,
               (unsigned long long)o[r].digest, (unsigned long long)local);
    }
    TEST_CHECKF(differ > 0, "the reversed order gave the same bits: the values do not test the order");
    printf("big: %zu of the first %d sums differ in the reversed rank order\n", differ, ORDER_N);
    for (int r = 0; r < 3; r++) free(x.v[r]);
    free(a), free(b);
}

// ---- failures ------------------------------------------------------------------------------------------

static void test_timeout_(void) {
    world_("timeout", 3, NULL, NULL);
    call_out o[3];
    for (int r = 0; r < 3; r++) take_("timeout", r, &o[r], sizeof o[r]);
    TEST_EQ_INT(o[0].st[0], MTRL_ERR_TIMEOUT);
    TEST_CONTAINS(o[0].msg[0], "rank 0 of 3");
    TEST_CONTAINS(o[0].msg[0], "all_reduce");
    TEST_CONTAINS(o[0].msg[0], "300 ms");
    TEST_CONTAINS(o[0].msg[0], "rank(s) 2 did not arrive");
    TEST_EQ_INT(o[1].st[0], MTRL_ERR_TIMEOUT); // rank 0's verdict reached it first
    TEST_CONTAINS(o[1].msg[0], "rank 1 of 3: rank 0 reports");
    TEST_CONTAINS(o[1].msg[0], "rank(s) 2 did not arrive");
    TEST_CHECKF(o[2].st[0] != MTRL_OK, "the late rank's call succeeded");
    for (int r = 0; r < 3; r++) {
        TEST_EQ_INT(o[r].st[1], MTRL_ERR_STATE);
        TEST_CONTAINS(o[r].msg[1], "failed earlier");
        printf("timeout: rank %d returned %d after %.0f ms: %s\n", r, o[r].st[0], o[r].ms[0], o[r].msg[0]);
    }
    TEST_CHECKF(o[0].ms[0] >= 280 && o[0].ms[0] < 1000, "rank 0 waited %.0f ms for a timeout of 300", o[0].ms[0]);
    TEST_CHECKF(o[1].ms[0] < 1500, "rank 1 waited %.0f ms", o[1].ms[0]);
}

static void test_kill_(int victim) {
    char arg[8];
    snprintf(arg, sizeof arg, "%d", victim);
    int status[3];
    int port = world_("kill", 3, arg, status);
    TEST_CHECKF(WIFSIGNALED(status[victim]) && WTERMSIG(status[victim]) == SIGKILL, "rank %d was not killed (%#x)", victim,
                status[victim]);
    call_out o[3];
    for (int r = 0; r < 3; r++) {
        take_("kill", r, &o[r], sizeof o[r]);
        TEST_EQ_INT(o[r].st[0], MTRL_OK);
        if (r == victim) continue;
        TEST_CHECKF(WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0, "rank %d ended with %#x", r, status[r]);
        TEST_EQ_INT(o[r].st[1], MTRL_ERR_TIMEOUT);
        printf("kill rank %d: rank %d returned after %.0f ms: %s\n", victim, r, o[r].ms[1], o[r].msg[1]);
        // Rank 0 waits 400 ms without a frame; the others 2 x 400 + 100.
        TEST_CHECKF(o[r].ms[1] < 2000, "rank %d took %.0f ms to fail", r, o[r].ms[1]);
        if (victim != 0) {
            TEST_CONTAINS(o[r].msg[1], "rank(s) 2 did not arrive");
        } else {
            char where[64];
            snprintf(where, sizeof where, "no answer from rank 0 at 127.0.0.1:%d", port);
            TEST_CONTAINS(o[r].msg[1], where);
        }
    }
}

static void test_mismatch_(void) {
    const char *what[] = {"size", "op", "a2a"};
    for (int k = 0; k < 3; k++) {
        world_("mismatch", 2, what[k], NULL);
        for (int r = 0; r < 2; r++) {
            call_out o;
            take_("mismatch", r, &o, sizeof o);
            TEST_EQ_INT(o.st[0], MTRL_ERR_MISMATCH);
            TEST_CONTAINS(o.msg[0], k < 2 ? "different collectives" : "all_to_all_v: rank 0 sends 1 rows to rank 1, which "
                                                                      "expects 2");
            TEST_EQ_INT(o.st[1], MTRL_ERR_STATE);
            if (r == 1) printf("mismatch %s: rank 1: %s\n", what[k], o.msg[0]);
        }
    }
}

// A join request of this protocol as a stranger writes it (dist_comm_zmq.c's layout).
static void hello_(uint8_t *p, unsigned ranks, unsigned rank) {
    memset(p, 0, 64);
    memcpy(p, "MTDC", 4);
    p[4] = 1;
    p[6] = 1; // HELLO
    p[8] = (uint8_t)ranks;
    p[12] = (uint8_t)rank;
    p[20] = 6; // join
}

// Pokes the port: raw TCP bytes, a DEALER's junk, a 17 MB frame, and join requests refused
// (answered with a FAIL: returned). 
static int poke_(int port, void *zctx, void **dealer) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    for (int i = 0; i < 200 && connect(fd, (struct sockaddr *)&a, sizeof a); i++) test_sleep_ms(10);
    const char junk[] = "GET / HTTP/1.0\r\n\r\nnot zeromq at all";
    TEST_CHECK(write(fd, junk, sizeof junk) > 0);
    void *d = zmq_socket(zctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof linger);
    char ep[64];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", port);
    zmq_connect(d, ep);
    zmq_send(d, "junk", 4, 0);
    uint8_t h[64];
    hello_(h, 3, 1); // another world size
    zmq_send(d, h, 64, 0);
    hello_(h, 2, 7); // a rank out of range
    zmq_send(d, h, 64, 0);
    // Two answers (FAIL, status in bytes 60..63).
    int refused = 0;
    for (int i = 0; i < 2; i++) {
        zmq_pollitem_t it = {d, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 3000) <= 0) break;
        uint8_t b[64];
        int n = zmq_recv(d, b, sizeof b, 0), more = 1;
        size_t ml = sizeof more;
        while (zmq_getsockopt(d, ZMQ_RCVMORE, &more, &ml) == 0 && more) { // the reason's frame
            char sink[1024];
            zmq_recv(d, sink, sizeof sink, 0);
        }
        refused += n == 64 && !memcmp(b, "MTDC", 4) && b[6] == 5;
    }
    // A frame over the cap: its sender is disconnected.
    void *big = zmq_socket(zctx, ZMQ_DEALER);
    zmq_setsockopt(big, ZMQ_LINGER, &linger, sizeof linger);
    zmq_connect(big, ep);
    size_t nbig = MTRL_DIST_ZMQ_FRAME + (1u << 20);
    char *blob = calloc(1, nbig);
    zmq_send(big, blob, nbig, 0);
    free(blob);
    test_sleep_ms(100);
    zmq_close(big);
    close(fd);
    *dealer = d;
    return refused;
}

static void test_stranger_(void) {
    void *zctx = zmq_ctx_new(), *d = NULL;
    // A world whose rank 1 never comes: rank 0's timeout names what it refused.
    int port = free_port_();
    pid_t p0 = spawn_("lonely", 2, 0, port, NULL);
    int refused = poke_(port, zctx, &d);
    zmq_close(d);
    int st;
    reap_(&p0, 1, &st);
    call_out o;
    take_("lonely", 0, &o, sizeof o);
    TEST_EQ_INT(refused, 2);
    TEST_EQ_INT(o.st[0], MTRL_ERR_TIMEOUT);
    TEST_CONTAINS(o.msg[0], "rank(s) 1 did not join within 600 ms");
    TEST_CONTAINS(o.msg[0], "not a join request");
    TEST_CONTAINS(o.msg[0], "says the world has 3 ranks");
    TEST_CONTAINS(o.msg[0], "rank 7 is not one of ranks 1 .. 1");
    printf("stranger: %s\n", o.msg[0]);

    // Strangers before and during a world of 2: refused, and the world works.
    port = free_port_();
    pid_t pid[2];
    pid[0] = spawn_("stranger", 2, 0, port, NULL);
    refused = poke_(port, zctx, &d);
    pid[1] = spawn_("stranger", 2, 1, port, NULL);
    test_sleep_ms(150);
    uint8_t h[64];
    hello_(h, 2, 1); // rank 1's again, while rank 0 waits in the all-reduce
    zmq_send(d, h, 64, 0);
    zmq_send(d, "more junk", 9, 0);
    int status[2];
    reap_(pid, 2, status);
    zmq_close(d);
    zmq_ctx_term(zctx);
    TEST_EQ_INT(refused, 2);
    for (int r = 0; r < 2; r++) {
        take_("stranger", r, &o, sizeof o);
        TEST_CHECKF(o.st[0] == MTRL_OK, "rank %d after the strangers: %s", r, o.msg[0]);
        TEST_CHECKF(o.sum == 3, "rank %d: the sum %g, not 3", r, o.sum);
    }
}

// ---- the DP step over process ranks (tests/testdp.h) ----------------------------------------------

// The cases the rank processes rebuild from their index.
typedef struct dp_spec {
    const char *extra;
    int steps, sft;
} dp_spec;
static const dp_spec dp_specs_[] = {{"grad_clip = 0.05\n[algo]\nmask_truncated = true\n", 2, 0}};
static int dp_current_;

static void put_arr_(FILE *f, const void *p, uint64_t n) {
    if (!p) n = 0;
    fwrite(&n, sizeof n, 1, f);
    if (n) fwrite(p, 1, n, f);
}
static void *get_arr_(FILE *f) {
    uint64_t n = 0;
    if (fread(&n, sizeof n, 1, f) != 1 || !n) return NULL;
    void *p = malloc(n);
    if (fread(p, 1, n, f) != n) TEST_CHECKF(0, "a DP result is cut");
    return p;
}

// A rank process of the DP case: tdp_rank_ on its zmq handle; its tdp_out into DIR/dp.r.
static int dp_rank_main_(int R, int r, int port, int spec) {
    const dp_spec *d = &dp_specs_[spec];
    static tdp_case k; // static: large
    static const test_dp_setup u = {.device = MTRL_DEVICE_CPU, .model_ini = "", .gpu_buffers = -1};
    tdp_config_(&k.cfg, u.model_ini, d->extra);
    if (mtrl_train_algo_config(&k.cfg, &k.algo, NULL) != MTRL_OK) return 5;
    for (int i = 0; i < TDP_NEP; i++) mtrl_traj_init(&k.tr[i]), tdp_episode_(&k.tr[i], i), k.eps[i] = &k.tr[i];
    k.x = (tdp_ctx){.cfg = &k.cfg, .algo = &k.algo, .eps = k.eps, .u = &u, .steps = d->steps,
                    .qb_mode = MTRL_QB_FROZEN, .sft = d->sft};
    mtrl_dist_rendezvous rv = {.port = port};
    snprintf(rv.host, sizeof rv.host, "127.0.0.1");
    mtrl_dist_comm *c = NULL;
    mtrl_error err = {0};
    if (mtrl_dist_comm_init_zmq(&c, R, r, &rv, 20000, 60000, &err) != MTRL_OK) {
        fprintf(stderr, "dp rank %d: %s\n", r, err.msg);
        return 2;
    }
    tdp_rank_(c, &k.x);
    mtrl_dist_comm_free(c);
    mtrl_model m; // the sizes of the blocks
    char msg[256];
    if (tdp_model_(&m, &k.cfg, MTRL_QB_FROZEN, MTRL_DEVICE_CPU, 0, msg, sizeof msg)) return 6;
    uint64_t n = m.params.total, le = (uint64_t)m.dims.L * m.dims.E;
    mtrl_model_free(&m);
    char p[512];
    path_(p, sizeof p, "dp", r);
    FILE *f = fopen(p, "wb");
    if (!f) return 3;
    tdp_out *o = &k.x.out[r];
    fwrite(o->st, sizeof o->st, 1, f);
    fwrite(o->msg, sizeof o->msg, 1, f);
    fwrite(o->stats, sizeof o->stats, 1, f);
    fwrite(&o->lo, sizeof o->lo, 1, f);
    fwrite(&o->hi, sizeof o->hi, 1, f);
    for (int s = 0; s < 2; s++) put_arr_(f, o->params[s], n), put_arr_(f, o->grads[s], n);
    put_arr_(f, o->adam_m, n), put_arr_(f, o->adam_v, n);
    put_arr_(f, o->qb_beta, sizeof(real) * le), put_arr_(f, o->loads, sizeof(long) * le);
    fclose(f);
    return 0;
}

// The setup's world: R rank processes; their outputs into the tdp_ctx.
static void world_procs_(int R, int timeout_ms, test_rank_fn fn, void *ctx, const test_dp_setup *u) {
    (void)timeout_ms, (void)fn, (void)u;
    char arg[16];
    snprintf(arg, sizeof arg, "%d", dp_current_);
    world_("dp", R, arg, NULL);
    tdp_ctx *x = ctx;
    for (int r = 0; r < R; r++) {
        char p[512];
        path_(p, sizeof p, "dp", r);
        FILE *f = fopen(p, "rb");
        TEST_CHECKF(f != NULL, "dp rank %d wrote nothing", r);
        if (!f) continue;
        tdp_out *o = &x->out[r];
        size_t ok = fread(o->st, sizeof o->st, 1, f) + fread(o->msg, sizeof o->msg, 1, f) +
                    fread(o->stats, sizeof o->stats, 1, f) + fread(&o->lo, sizeof o->lo, 1, f) +
                    fread(&o->hi, sizeof o->hi, 1, f);
        TEST_EQ_INT((int)ok, 5);
        for (int s = 0; s < 2; s++) o->params[s] = get_arr_(f), o->grads[s] = get_arr_(f);
        o->adam_m = get_arr_(f), o->adam_v = get_arr_(f), o->qb_beta = get_arr_(f), o->loads = get_arr_(f);
        for (int s = 0; s < 2; s++) o->stats[s].loads = o->loads;
        fclose(f);
        unlink(p);
    }
}

static void world_threads_(int R, int timeout_ms, test_rank_fn fn, void *ctx, const test_dp_setup *u) {
    (void)u;
    test_dist_run_local(R, timeout_ms, -1, fn, ctx);
}

// test_dist_dp's CPU tolerances (that file says why).
#define DP_TOL {.stats = 1e-5, .clip_abs = 1e-12, .grad = 1e-5, .param_rel = 1e-5, .param_lr_all = 0.01, \
                .param_lr_most = 1e-4, .param_frac = 1e-4, .moments = 1e-5, .m_elem_rel = 1e-4, .m_elem_abs = 1e-9}
static const test_dp_setup procs_ = {.device = MTRL_DEVICE_CPU, .model_ini = "", .world = world_procs_,
                                     .gpu_buffers = -1, .tol = DP_TOL};
static const test_dp_setup threads_ = {.device = MTRL_DEVICE_CPU, .model_ini = "", .world = world_threads_,
                                       .gpu_buffers = -1, .tol = DP_TOL};

static void test_dp_(int R) {
    const dp_spec *d = &dp_specs_[dp_current_];
    char what[64];
    snprintf(what, sizeof what, "zmq processes rl clipped");
    double t0 = now_ms_();
    tdp_ctx x = {.steps = d->steps, .qb_mode = MTRL_QB_FROZEN, .sft = d->sft};
    tdp_case *a = tdp_case_run_(&procs_, R, 60000, d->extra, x, 1);
    test_dp_check(&procs_, a, R, d->steps, d->sft, what);
    printf("dp: %d process ranks and one rank in %.0f ms\n", R, now_ms_() - t0);
    // The same step on thread ranks of the local backend: the same sums in the same order.
    tdp_case *b = tdp_case_run_(&threads_, R, 60000, d->extra, x, 0);
    mtrl_model m;
    char msg[256];
    TEST_EQ_INT(tdp_model_(&m, &a->cfg, MTRL_QB_FROZEN, MTRL_DEVICE_CPU, 0, msg, sizeof msg), 0);
    size_t n = m.params.total;
    mtrl_model_free(&m);
    for (int r = 0; r < R; r++)
        for (int s = 0; s < d->steps; s++) {
            int same = a->x.out[r].params[s] && b->x.out[r].params[s] &&
                       !memcmp(a->x.out[r].params[s], b->x.out[r].params[s], n);
            int same_stats = a->x.out[r].stats[s].loss == b->x.out[r].stats[s].loss &&
                             a->x.out[r].stats[s].grad_norm == b->x.out[r].stats[s].grad_norm;
            TEST_CHECKF(same && same_stats, "dp %d ranks: rank %d step %d: process ranks differ from thread ranks", R, r,
                        s + 1);
            if (r == 0) printf("dp: %d ranks step %d: process ranks %s the thread ranks' parameters (%zu bytes)\n", R,
                               s + 1, same ? "have the bits of" : "DIFFER from", n);
        }
    tdp_case_free_(a, R);
    tdp_case_free_(b, R);
}

int main(int argc, char **argv) {
    if (argc == 8 && !strcmp(argv[1], "--rank")) {
        snprintf(dir_, sizeof dir_, "%s", argv[7]);
        if (!strcmp(argv[2], "dp")) return dp_rank_main_(atoi(argv[3]), atoi(argv[4]), atoi(argv[5]), atoi(argv[6]));
        return rank_main_(argv[2], atoi(argv[3]), atoi(argv[4]), atoi(argv[5]), argv[6]);
    }
    ssize_t n = readlink("/proc/self/exe", self_, sizeof self_ - 1);
    if (n <= 0) return 1;
    self_[n] = 0;
    snprintf(dir_, sizeof dir_, "/tmp/mtrl_test_dist_zmq.%ld", (long)getpid());
    mkdir(dir_, 0700);
    signal(SIGPIPE, SIG_IGN);
    for (int R = 1; R <= 4; R++) test_ops_(R);
    test_big_();
    test_timeout_();
    test_kill_(2);
    test_kill_(0);
    test_mismatch_();
    test_stranger_();
    test_dp_(2);
    test_dp_(3);
    int failed = test_report();
    rmdir(dir_);
    return failed;
}
