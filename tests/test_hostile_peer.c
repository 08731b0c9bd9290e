// mtrl-test: cpu fault timeout=120
// test_hostile_peer: a peer speaking raw ZMTP at the learner's port (issue 28, items 2 and 4).
//  1. Flood (item 2): a raw TCP client does the ZMTP handshake, sends up to 10^6 tiny garbage
//     frames as fast as the learner takes them for at most 1 s, and hangs up; five times. Before
//     the fix libzmq 4.3.4 aborted the learner (`!_io_error`, stream_engine_base.cpp:331: a
//     connection whose input had stopped at the high-water mark was hung up on, and the ZMTP
//     heartbeat timer then wrote to it). The learner must keep running, say it disconnected the
//     flooder, and then serve a real actor (its episodes are committed to the store).
//  2. Forged HELLO (item 4): while that actor is live, a raw client says HELLO as the same actor
//     id with the highest incarnation, over and over for 2 s. The impostor is refused and the
//     real actor's episodes keep committing.
// Waits poll for a state with a generous deadline; nothing asserts how long anything took.
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/timeutil.h"
#include "common/wire/wire.h"
#include "tests/testhelp.h"
#include "tests/testproc.h"

static char dir_[256];
static const char *bin_;



static int status_;

static int alive(pid_t pid) { return waitpid(pid, &status_, WNOHANG) == 0; }

// A TCP connection to 127.0.0.1:port that has done the ZMTP 3.0 NULL handshake as a DEALER
// (-1 when it fails). Nonblocking afterwards.
static int zmtp_connect(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        close(fd);
        return -1;
    }
    uint8_t g[64] = {0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 0, 'N', 'U', 'L', 'L'};
    uint8_t ready[30] = {0x04, 28, 5, 'R', 'E', 'A', 'D', 'Y', 11, 'S', 'o', 'c', 'k', 'e', 't', '-', 'T', 'y', 'p', 'e',
                         0, 0, 0, 6, 'D', 'E', 'A', 'L', 'E', 'R'};
    uint8_t peer[64];
    size_t got = 0;
    if (write(fd, g, sizeof g) != (ssize_t)sizeof g) goto fail;
    while (got < sizeof peer) { // the learner's greeting
        ssize_t r = read(fd, peer + got, sizeof peer - got);
        if (r <= 0) goto fail;
        got += (size_t)r;
    }
    if (write(fd, ready, sizeof ready) != (ssize_t)sizeof ready) goto fail;
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    return fd;
fail:
    close(fd);
    return -1;
}

// Writes all of buf, waiting for room up to `until`; 0 when the time ran out or the peer is gone.
static int write_until(int fd, const uint8_t *buf, size_t n, double until) {
    while (n > 0) {
        ssize_t w = write(fd, buf, n);
        if (w > 0) {
            buf += w;
            n -= (size_t)w;
            continue;
        }
        if (w < 0 && errno != EAGAIN && errno != EINTR) return 0;
        if (mtrl_time_mono() > until) return 0;
        struct pollfd p = {fd, POLLOUT, 0};
        poll(&p, 1, 10);
    }
    return 1;
}

// Up to 10^6 one-byte frames in at most 1 s, then a hang-up; returns how many went out. With
// until_hung_up, frames go on (up to 30 s) until the learner hangs up: *hung_up = 1 when it did.
static long flood(int port, int until_hung_up, int *hung_up) {
    int fd = zmtp_connect(port);
    if (fd < 0) return -1;
    enum { PER = 4096 };
    static uint8_t buf[3 * PER];
    for (int i = 0; i < PER; i++) buf[3 * i] = 0, buf[3 * i + 1] = 1, buf[3 * i + 2] = 'x';
    long sent = 0;
    double until = mtrl_time_mono() + 1.0;
    while (sent < 1000000 && write_until(fd, buf, sizeof buf, until)) sent += PER;
    if (until_hung_up) {
        double end = mtrl_time_mono() + 30;
        *hung_up = 0;
        while (!*hung_up && mtrl_time_mono() < end) {
            if (write_until(fd, buf, sizeof buf, mtrl_time_mono() + 0.1)) sent += PER;
            else if (errno == EPIPE || errno == ECONNRESET) *hung_up = 1;
            uint8_t sink[256];
            ssize_t r = read(fd, sink, sizeof sink);
            if (r == 0 || (r < 0 && errno != EAGAIN)) *hung_up = 1;
        }
    }
    close(fd);
    return sent;
}

static int port_of(const char *endpoint) {
    const char *c = strrchr(endpoint, ':');
    return c ? atoi(c + 1) : 0;
}

static long long episodes(const char *db) { return test_query_int(db, "SELECT count(*) FROM episodes"); }

// Waits (up to 30 s) for more than `than` episodes in the store; the count.
static long long wait_episodes(const char *db, long long than) {
    double until = mtrl_time_mono() + 30;
    long long n = episodes(db);
    while (n <= than && mtrl_time_mono() < until) {
        test_sleep_ms(100);
        n = episodes(db);
    }
    return n;
}

// For 2 s, HELLO as actor `id` with incarnation 0xffffffff (and a few others) every 5 ms.
static int forge_hello(int port, uint32_t id) {
    int fd = zmtp_connect(port);
    if (fd < 0) return 0;
    double until = mtrl_time_mono() + 2.0;
    int sent = 0;
    while (mtrl_time_mono() < until) {
        mtrl_wire_out o;
        mtrl_wire_out_init(&o);
        mtrl_wire_encode_hello(&o, id, 0xffffffffu - (uint32_t)(sent % 3), 0);
        uint8_t msg[2 + MTRL_WIRE_HDR_SIZE + 2 + 255];
        size_t k = 0;
        msg[k++] = 0x01; // MORE, short frame
        msg[k++] = MTRL_WIRE_HDR_SIZE;
        memcpy(msg + k, o.hdr, MTRL_WIRE_HDR_SIZE);
        k += MTRL_WIRE_HDR_SIZE;
        if (o.payload.len > 255) {
            mtrl_wire_out_free(&o);
            break;
        }
        msg[k++] = 0x00;
        msg[k++] = (uint8_t)o.payload.len;
        memcpy(msg + k, o.payload.data, o.payload.len);
        k += o.payload.len;
        mtrl_wire_out_free(&o);
        if (!write_until(fd, msg, k, until + 1)) break;
        uint8_t sink[4096];
        while (read(fd, sink, sizeof sink) > 0) {
        }
        sent++;
        test_sleep_ms(5);
    }
    close(fd);
    return sent;
}

int main(void) {
    bin_ = getenv("MTRL_BIN");
    if (!bin_) {
        printf("SKIP: MTRL_BIN not set (run through ctest)\n");
        return 77;
    }
    signal(SIGPIPE, SIG_IGN);
    snprintf(dir_, sizeof dir_, "/tmp/mtrl_hostile_XXXXXX");
    if (!mkdtemp(dir_)) {
        perror("mkdtemp");
        return 1;
    }
    char ini[320], db[320], llog[320], alog[320];
    snprintf(ini, sizeof ini, "%s/learner.ini", dir_);
    snprintf(db, sizeof db, "%s/learner.db", dir_);
    snprintf(llog, sizeof llog, "%s/learner.log", dir_);
    snprintf(alog, sizeof alog, "%s/actor.log", dir_);
    FILE *f = fopen(ini, "w");
    fprintf(f,
            "[run]\nname = hostile\nsteps = 100000\nout_dir = %s/out\ncheckpoint_every = 0\n"
            "[model]\npreset = tiny\n[env]\nname = calc\n"
            "[actor]\ncount = 0\nepisodes_in_flight = 2\nmax_tokens = 24\nmax_turn_tokens = 8\nheartbeat_ms = 100\n"
            "[learner]\nbatch_groups = 1\nheartbeat_timeout_ms = 1000\n[algo]\ngroup_size = 2\n"
            "[warmup]\nsteps = 3\nbatch = 128\n",
            dir_);
    fclose(f);
    pid_t learner = test_start_logged((char *[]){(char *)bin_, "learner", ini, "--db", db, NULL}, llog);
    TEST_CHECK(test_log_wait(llog, "tcp://", 1, 30));
    char *text, endpoint[128];
    test_log_endpoint(llog, endpoint, sizeof endpoint);
    int port = port_of(endpoint);
    // The warm-up's steps are seconds without reading the socket: a flood fills the connection's
    // queue (the ZeroMQ high-water mark) and its engine stops reading, the state of the crash.
    TEST_CHECK(test_log_wait(llog, "warm-up:", 1, 30));
    TEST_CHECKF(port > 0, "no port in the learner's log (%s)", llog);

    // 1. the flood
    for (int round = 0; round < 5 && alive(learner); round++) {
        long n = flood(port, 0, NULL);
        TEST_CHECKF(n > 0, "round %d: could not connect to %s", round, endpoint);
        printf("flood %d: %ld frames sent\n", round, n);
        test_sleep_ms(300); // the learner's ZMTP timers get their chance to fire on the dead connection
    }
    test_sleep_ms(1200);
    int st = 0, up = alive(learner);
    TEST_CHECKF(up, "the learner died under the flood (status 0x%x; see %s)", status_, llog);
    if (!up) {
        printf("%s", (text = test_slurp(llog, NULL)));
        free(text);
        return test_report();
    }
    int hung_up = 0;
    long n = flood(port, 1, &hung_up);
    printf("flood until hung up on: %ld frames sent, hung up %d\n", n, hung_up);
    TEST_CHECKF(hung_up, "the learner did not hang up on a peer flooding it for 30 s (%s)", llog);
    TEST_CHECKF(test_log_wait(llog, "disconnected a peer that sent", 1, 30), "the learner never said it disconnected a flooder (%s)",
                llog);
    TEST_CHECKF(alive(learner), "the learner died under the flood (status 0x%x; see %s)", status_, llog);
    pid_t actor = test_start_logged((char *[]){(char *)bin_, "actor", "--connect", endpoint, "--id", "7", NULL}, alog);
    TEST_CHECKF(test_log_wait(llog, "actor 7 (incarnation", 1, 30), "the actor did not join %s after the flood", endpoint);
    long long n0 = wait_episodes(db, 0);
    TEST_CHECKF(n0 > 0, "no episode of the real actor was committed after the flood (%s)", llog);
    printf("after the flood: %lld episodes committed\n", n0);

    // 2. the forged HELLO
    int forged = forge_hello(port, 7);
    TEST_CHECKF(forged > 10, "the impostor could not send (%d HELLOs)", forged);
    long long n1 = episodes(db);
    long long n2 = wait_episodes(db, n1 + 4);
    printf("forged %d HELLOs as actor 7; episodes %lld -> %lld\n", forged, n1, n2);
    TEST_CHECKF(n2 > n1 + 4, "the real actor's episodes stopped committing after a forged HELLO (%lld -> %lld; %s)", n1, n2,
                llog);
    TEST_CHECKF(test_log_count(llog, "refused a HELLO as actor 7") > 0, "the impostor was not refused (%s)", llog);
    TEST_CHECKF(alive(actor), "the real actor exited (%s)", alog);
    // Not displaced: it was never told that the learner no longer knows it.
    TEST_CHECKF(test_log_count(alog, "the learner does not know this actor") == 0, "the impostor displaced the real actor (%s)", alog);

    kill(actor, SIGKILL);
    kill(learner, SIGKILL);
    waitpid(actor, &st, 0);
    waitpid(learner, &st, 0);
    test_tmpdir_done(dir_, test_failed_);
    return test_report();
}
