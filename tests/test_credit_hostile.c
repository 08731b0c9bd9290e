// mtrl-test: cpu fault timeout=120
// test_credit_hostile: the learner enforces credit (issue 28, item 3: a peer that ignored it
// queued 2 GiB in the learner, RSS 210 MB -> 2.94 GB with credit_bytes = 32768, and the aborted
// data was written to the trajectory file).
// A hostile actor written against the project's own wire encoders (common/wire/wire.h) says HELLO to
// a real `mtrl learner` ([learner] credit_bytes = 32768), gets its WELCOME, then streams 8
// episodes of 1.5 M tokens each (about 150 MB in 200 KB CHUNKs) without waiting for credit.
// Asserted: the learner disconnects it ("... bytes of credit left ... disconnected and refused", an
// event row too); the learner's peak RSS grows by less than 48 MB (the hostile bytes are 150 MB;
// before the fix the assembler held them all); no episode of the hostile actor has a trajectory
// and the trajectory file holds none of its bytes; the learner keeps running.
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/timeutil.h"
#include "common/traj.h"
#include "common/wire/wire.h"
#include "tests/testhelp.h"
#include "tests/testproc.h"

#define HOSTILE_ID 900
#define EPISODES 8
#define TOKENS 1500000u
#define CHUNK 16384u

static char dir_[256];

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

// A field of /proc/<pid>/status in kB (VmRSS, VmHWM), or -1.
static long proc_kb(pid_t pid, const char *field) {
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    long v = -1;
    size_t n = strlen(field);
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, field, n) && line[n] == ':') v = strtol(line + n + 1, NULL, 10);
    if (f) fclose(f);
    return v;
}

// Sends o, retrying while the socket is full (the hostile peer never gives up on its own).
static int send_hard(mtrl_wire_sock *s, const mtrl_wire_out *o, double until) {
    mtrl_error err;
    while (mtrl_time_mono() < until)
        if (mtrl_wire_send(s, NULL, o, &err) == MTRL_OK) return 1;
    return 0;
}

int main(void) {
    const char *bin = getenv("MTRL_BIN");
    if (!bin) {
        printf("SKIP: MTRL_BIN not set (run through ctest)\n");
        return 77;
    }
    snprintf(dir_, sizeof dir_, "/tmp/mtrl_credit_XXXXXX");
    if (!mkdtemp(dir_)) {
        perror("mkdtemp");
        return 1;
    }
    char ini[320], db[320], log[320], traj[400];
    snprintf(ini, sizeof ini, "%s/learner.ini", dir_);
    snprintf(db, sizeof db, "%s/hostile.db", dir_);
    snprintf(log, sizeof log, "%s/learner.log", dir_);
    snprintf(traj, sizeof traj, "%s/out/hostile-run1/traj-run1.bin", dir_);
    FILE *f = fopen(ini, "w");
    fprintf(f,
            "[run]\nname = hostile\nsteps = 1000\nout_dir = %s/out\ncheckpoint_every = 0\nkeep_trajectories = all\n"
            "[model]\npreset = tiny\n[env]\nname = calc\n[actor]\ncount = 0\n"
            "[learner]\ncredit_bytes = 32768\nbatch_groups = 1\n[algo]\ngroup_size = 2\n",
            dir_);
    fclose(f);
    fflush(NULL);
    pid_t learner = fork();
    if (learner == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 1);
        dup2(fd, 2);
        setenv("OMP_NUM_THREADS", "1", 1);
        execl(bin, bin, "learner", ini, "--db", db, (char *)NULL);
        _exit(127);
    }
    // The endpoint from the learner's first line.
    char endpoint[128] = "";
    for (double until = mtrl_time_mono() + 60; !endpoint[0] && mtrl_time_mono() < until; sleep_ms(50)) {
        char *text = test_slurp(log, NULL);
        const char *p = strstr(text, "tcp://");
        if (p && strchr(p, ',')) snprintf(endpoint, sizeof endpoint, "%.*s", (int)strcspn(p, ",\n "), p);
        free(text);
    }
    TEST_CHECKF(endpoint[0], "the learner did not start (%s)", log);

    // The hostile actor: HELLO, wait for the WELCOME, then stream regardless of credit.
    void *ctx = zmq_ctx_new();
    mtrl_wire_sock s;
    mtrl_error err;
    mtrl_wire_limits lim = mtrl_wire_limits_default();
    TEST_EQ_INT(mtrl_wire_dealer_open(&s, ctx, endpoint, HOSTILE_ID, 1, &lim, NULL, &err), MTRL_OK);
    mtrl_wire_out o;
    mtrl_wire_out_init(&o);
    mtrl_wire_encode_hello(&o, HOSTILE_ID, 1, 0);
    double until = mtrl_time_mono() + 30;
    TEST_CHECK(send_hard(&s, &o, until));
    int welcomed = 0;
    mtrl_wire_in in;
    while (!welcomed && mtrl_time_mono() < until)
        if (mtrl_wire_recv(&s, 100, &in, NULL, &err) == MTRL_OK) welcomed = in.hdr.type == MTRL_WIRE_WELCOME;
    TEST_CHECKF(welcomed, "no WELCOME from %s", endpoint);
    long rss0 = proc_kb(learner, "VmRSS");

    mtrl_traj t;
    mtrl_traj_init(&t);
    mtrl_traj_set_env(&t, "calc");
    for (uint32_t i = 0; i < TOKENS; i++) mtrl_traj_append(&t, 5 + i % 40, -1.0f, 0, i < 8 ? MTRL_TOK_PROMPT : MTRL_TOK_MODEL, NULL);
    t.actor_id = HOSTILE_ID;
    t.incarnation = 1;
    t.status = MTRL_EP_COMPLETE;
    t.reward = 1;
    size_t sent = 0;
    until = mtrl_time_mono() + 40;
    for (int e = 0; e < EPISODES && mtrl_time_mono() < until; e++) {
        t.episode_id = 0x4854000000ull + (uint64_t)e;
        t.group_id = t.episode_id;
        mtrl_wire_encode_begin(&o, &t);
        sent += send_hard(&s, &o, until) ? o.payload.len : 0;
        uint32_t seq = 0;
        for (uint32_t first = 0; first < TOKENS && mtrl_time_mono() < until; first += CHUNK, seq++) {
            mtrl_wire_encode_chunk(&o, &t, seq, first, TOKENS - first < CHUNK ? TOKENS - first : CHUNK);
            sent += send_hard(&s, &o, until) ? o.payload.len : 0;
        }
        mtrl_wire_encode_end(&o, &t, seq);
        sent += send_hard(&s, &o, until) ? o.payload.len : 0;
    }
    printf("hostile peer sent %.1f MB against 32 KB of credit\n", sent / 1e6);
    TEST_CHECKF(sent > 100000000, "only %zu bytes sent", sent);
    // The learner says it refused the peer (an event row), and sends it a BYE.
    long long refused = 0;
    for (double u = mtrl_time_mono() + 20; refused < 1 && mtrl_time_mono() < u; sleep_ms(100))
        refused = test_query_int(db, "SELECT COUNT(*) FROM events WHERE message LIKE '%bytes of credit left%disconnected and refused%'");
    TEST_CHECKF(refused >= 1, "no event says the peer was refused (%s)", log);
    int bye = 0;
    for (double u = mtrl_time_mono() + 5; !bye && mtrl_time_mono() < u;)
        if (mtrl_wire_recv(&s, 100, &in, NULL, &err) == MTRL_OK) bye = in.hdr.type == MTRL_WIRE_BYE;
    TEST_CHECKF(bye, "the refused peer got no BYE");
    // Give the learner time to drain what ZeroMQ still holds (the messages are dropped unread).
    sleep_ms(1500);
    long hwm = proc_kb(learner, "VmHWM");
    printf("learner RSS %ld kB before the flood, peak %ld kB\n", rss0, hwm);
    TEST_CHECKF(rss0 > 0 && hwm - rss0 < 48 * 1024, "learner peak RSS grew by %ld kB over the flood of %zu bytes", hwm - rss0, sent);
    TEST_CHECKF(kill(learner, 0) == 0, "the learner died");
    kill(learner, SIGINT);
    int st;
    waitpid(learner, &st, 0);
    TEST_EQ_INT(test_query_int(db, "SELECT COUNT(*) FROM episodes WHERE actor = 900 AND traj_path IS NOT NULL"), 0);
    struct stat sb;
    long long tsize = stat(traj, &sb) == 0 ? (long long)sb.st_size : 0;
    TEST_CHECKF(tsize < 1000000, "the trajectory file holds %lld bytes (the hostile peer's)", tsize);
    char *text = test_slurp(log, NULL);
    TEST_CONTAINS(text, "actor 900 (incarnation 1) sent a ");
    free(text);
    mtrl_wire_out_free(&o);
    mtrl_traj_free(&t);
    mtrl_wire_sock_close(&s);
    zmq_ctx_term(ctx);
    test_tmpdir_done(dir_, test_failed_);
    return test_report();
}
