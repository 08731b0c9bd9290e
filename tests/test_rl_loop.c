// mtrl-test: cpu fault timeout=900
// The RL loop with real processes, real ZeroMQ on loopback and real SQLite files:
//  1. `mtrl run` of a short experiment finishes; the store has the run, reward per step, expert
//     loads and β, episodes by status; every committed episode's digest matches its file.
//  2. An actor killed with SIGKILL mid-episode: its open episodes become `aborted` (heartbeat
//     timeout), training continues, a restarted actor (new incarnation) rejoins.
//  3. Malformed and oversized messages sent to the learner are dropped without a crash.
//  4. The example plug-in (.so built against env/mtrl_env.h alone) runs in an experiment.
//  5. A crashing isolated plug-in aborts only its episodes; the run finishes.
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/store.h"
#include "common/traj.h"
#include "common/trajfile.h"
#include "tests/testhelp.h"
#include "tests/testproc.h"

static char dir_[256];
static const char *bin_;

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    fputs(text, f);
    fclose(f);
}

// Runs argv to completion with stdout/stderr to a log; returns the exit status (or 128 + signal).
static int run_cmd(char *const argv[], const char *log) {
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        FILE *f = freopen(log, "a", stderr);
        (void)f;
        dup2(2, 1);
        execv(argv[0], argv);
        _exit(127);
    }
    int st;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static pid_t start_cmd(char *const argv[], const char *log) {
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        FILE *f = freopen(log, "a", stderr);
        (void)f;
        f = freopen(log, "a", stdout);
        (void)f;
        execv(argv[0], argv);
        _exit(127);
    }
    return pid;
}

#define query_int test_query_int

static void query_text(const char *db, const char *sql, char *out, size_t cap) {
    sqlite3 *h;
    out[0] = '\0';
    if (sqlite3_open_v2(db, &h, SQLITE_OPEN_READONLY, NULL) != SQLITE_OK) return;
    sqlite3_busy_timeout(h, 5000);
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(h, sql, -1, &st, NULL) == SQLITE_OK && sqlite3_step(st) == SQLITE_ROW && sqlite3_column_text(st, 0))
        snprintf(out, cap, "%s", (const char *)sqlite3_column_text(st, 0));
    sqlite3_finalize(st);
    sqlite3_close(h);
}

static const char *BASE =
    "[run]\nname = test\nseed = 3\nsteps = %d\nout_dir = %s/runs-%s\ncheckpoint_every = 2\n"
    "[model]\npreset = tiny\n"
    "[env]\nname = %s\nplugin = %s\nisolate = %s\nstep_timeout_ms = 2000\nmax_tool_calls = 2\n"
    "[actor]\ncount = 2\nepisodes_in_flight = 4\nmax_tokens = 40\nmax_turn_tokens = 12\nheartbeat_ms = 200\n"
    "[learner]\nbatch_groups = 2\nheartbeat_timeout_ms = 1500\n"
    "[algo]\ngroup_size = 2\n";

static void make_experiment(const char *name, int steps, const char *env, const char *plugin, const char *isolate,
                            char *path, size_t cap, const char *extra) {
    char text[2048];
    int n = snprintf(text, sizeof text, BASE, steps, dir_, name, env, plugin, isolate);
    snprintf(text + n, sizeof text - (size_t)n, "%s", extra ? extra : "");
    snprintf(path, cap, "%s/%s.ini", dir_, name);
    write_file(path, text);
}

// Every committed episode with a trajectory file: the file's record decodes and its digest is
// the one in the store.
static void check_digests(const char *db) {
    mtrl_store *s;
    mtrl_error err;
    mtrl_status opened = mtrl_store_open(&s, db, 1, &err);
    TEST_EQ_INT(opened, MTRL_OK);
    if (opened != MTRL_OK) return;
    sqlite3 *h = mtrl_store_sqlite(s);
    sqlite3_stmt *st;
    sqlite3_prepare_v2(h, "SELECT traj_path, traj_offset, digest, tokens FROM episodes WHERE traj_path IS NOT NULL", -1, &st,
                       NULL);
    int n = 0, good = 0;
    mtrl_traj_limits lim = mtrl_traj_limits_default();
    while (sqlite3_step(st) == SQLITE_ROW) {
        const char *path = (const char *)sqlite3_column_text(st, 0);
        int64_t off = sqlite3_column_int64(st, 1);
        const char *digest = (const char *)sqlite3_column_text(st, 2);
        mtrl_trajfile_reader r;
        mtrl_traj t;
        mtrl_traj_init(&t);
        if (mtrl_trajfile_reader_open(&r, path, &err) == MTRL_OK) {
            if (mtrl_trajfile_read_traj_at(&r, (uint64_t)off, &lim, &t, &err) == MTRL_OK) {
                char hex[32];
                snprintf(hex, sizeof hex, "%016llx", (unsigned long long)mtrl_traj_digest_compute(&t));
                good += digest && !strcmp(hex, digest) && (int64_t)t.n_tokens == sqlite3_column_int64(st, 3);
            }
            mtrl_trajfile_reader_close(&r);
        }
        mtrl_traj_free(&t);
        n++;
    }
    sqlite3_finalize(st);
    mtrl_store_close(s);
    printf("digests: %d of %d episode files match the store\n", good, n);
    TEST_CHECK(n > 0);
    TEST_EQ_INT(good, n);
}

static void test_short_run(void) {
    char ini[512], db[512], log[512];
    make_experiment("short", 3, "calc", "", "false", ini, sizeof ini, NULL);
    snprintf(db, sizeof db, "%s/short.db", dir_);
    snprintf(log, sizeof log, "%s/short.log", dir_);
    // 66 episodes in flight per actor: more than the wire's default of 64 open episodes, which
    // the learner raises to what the experiment's actors keep open (none may be rejected).
    char *argv[] = {(char *)bin_, "run", ini, "--db", db, "--set", "actor.episodes_in_flight=66", NULL};
    int rc = run_cmd(argv, log);
    TEST_EQ_INT(rc, 0);
    char status[64];
    query_text(db, "SELECT status FROM runs WHERE id = 1", status, sizeof status);
    TEST_EQ_STR(status, "finished");
    TEST_EQ_INT(query_int(db, "SELECT count(*) FROM episodes WHERE status = 'rejected'"), 0);
    TEST_EQ_INT(query_int(db, "SELECT count(*) FROM metrics WHERE name = 'reward'"), 3);
    TEST_CHECK(query_int(db, "SELECT count(*) FROM episodes") >= 8);
    TEST_CHECK(query_int(db, "SELECT count(*) FROM experts") == 3 * 3 * 8); // steps x MoE layers x experts
    TEST_CHECK(query_int(db, "SELECT count(*) FROM checkpoints") >= 1);
    // The local actors got the weights through the same-host channel ([learner] publish = auto),
    // none over ZeroMQ (the publish_every run below checks the versions they generated with).
    char *text = test_slurp(log, NULL);
    TEST_CHECKF(strstr(text, "weights through the same-host channel /mtrl-w.") != NULL, "%s: no actor used the weight channel", log);
    TEST_CHECKF(strstr(text, "over ZeroMQ") == NULL, "%s: an actor asked for the weights over ZeroMQ", log);
    free(text);
    TEST_EQ_INT(query_int(db, "SELECT count(*) FROM episodes WHERE status NOT IN ('complete','truncated','aborted','rejected')"), 0);
    check_digests(db);
    // `mtrl run --resume` continues the same run from its last checkpoint to the new step count.
    // The resumed part also folds the actors' decode-time QB statistics into each update (six
    // steps: a step of this model can end before an actor's first statistics arrive).
    char *resume[] = {(char *)bin_, "run", ini, "--db", db, "--resume", "--set", "run.steps=9",
                      "--set", "learner.qb_actor_stats=true", NULL};
    TEST_EQ_INT(run_cmd(resume, log), 0);
    TEST_EQ_INT(query_int(db, "SELECT count(*) FROM runs"), 1);
    query_text(db, "SELECT status FROM runs WHERE id = 1", status, sizeof status);
    TEST_EQ_STR(status, "finished");
    TEST_EQ_INT(query_int(db, "SELECT max(step) FROM metrics WHERE name = 'reward'"), 9);
    TEST_EQ_INT(query_int(db, "SELECT count(*) FROM metrics WHERE name = 'reward'"), 9);
    TEST_EQ_INT(query_int(db, "SELECT max(value) FROM metrics WHERE name = 'version'"), 9);
    long long qb_actor = query_int(db, "SELECT count(*) FROM metrics WHERE name = 'qb_actor_batches' AND value > 0");
    printf("resumed run: %lld steps folded actor-side QB statistics in\n", qb_actor);
    TEST_CHECK(qb_actor >= 1);
}

// Episodes larger than the whole credit still stream (one message at a time when nothing else
// is in flight) instead of waiting forever: 4 KiB of credit (~300 tokens on the wire), and
// retrieval episodes of a ~200-token prompt plus turns of up to 500 tokens, each in one chunk.
// The weights go out with bf16 matrices here (publish_dtype = bf16), every second version.
static void test_small_credit(void) {
    char ini[512], db[512], log[512];
    make_experiment("credit", 3, "retrieval", "", "false", ini, sizeof ini, NULL);
    snprintf(db, sizeof db, "%s/credit.db", dir_);
    snprintf(log, sizeof log, "%s/credit.log", dir_);
    char *argv[] = {(char *)bin_, "run", ini, "--db", db, "--set", "learner.credit_bytes=4096", "--set", "actor.chunk_tokens=2048",
                    "--set", "actor.max_tokens=800", "--set", "actor.max_turn_tokens=500", "--set", "learner.publish_dtype=bf16",
                    "--set", "learner.publish_every=2", NULL};
    TEST_EQ_INT(run_cmd(argv, log), 0);
    // publish_every = 2: the actors only ever had the even versions (0, 2, ...)
    TEST_EQ_INT(query_int(db, "SELECT count(*) FROM episodes WHERE model_tokens > 0 AND (version_min % 2 = 1 OR "
                              "version_max % 2 = 1)"), 0);
    TEST_CHECK(query_int(db, "SELECT count(*) FROM episodes WHERE model_tokens > 0") > 0);
    TEST_CHECK(query_int(db, "SELECT max(tokens) FROM episodes") > 400); // over 4 KiB on the wire
    char status[64];
    query_text(db, "SELECT status FROM runs WHERE id = 1", status, sizeof status);
    TEST_EQ_STR(status, "finished");
}

// Backpressure reaches generation: an actor whose outbox holds messages the credit does not yet
// cover generates nothing more (actor.c's main loop). Without that it generated on under any
// remainder of credit, and at 1M tokens prefilled 18 documents during one learner step. Here
// 4 KiB of credit, 64-token chunks and 1000-token inline documents (each new episode queues
// BEGIN and ~16 prompt chunks at once): one rollout step of 4 slots can queue at most
// 4 × (ceil(1200 / 64) + 2) = 84 messages, and the outbox must never hold more. (docs/perf.md, "Measurements moved out of code comments")
static void test_backpressure(void) {
    char ini[512], db[512], log[512];
    make_experiment("backpressure", 8, "retrieval", "", "false", ini, sizeof ini, NULL);
    snprintf(db, sizeof db, "%s/backpressure.db", dir_);
    snprintf(log, sizeof log, "%s/backpressure.log", dir_);
    char *argv[] = {(char *)bin_, "run", ini, "--db", db, "--set", "learner.credit_bytes=4096", "--set", "actor.chunk_tokens=64",
                    "--set", "actor.max_tokens=1200", "--set", "actor.max_turn_tokens=8", "--set", "env.inline_doc=true",
                    "--set", "env.doc_tokens=1000", "--set", "env.max_tool_calls=0", NULL};
    TEST_EQ_INT(run_cmd(argv, log), 0);
    char *text = test_slurp(log, NULL);
    TEST_CHECK(text != NULL);
    int actors = 0;
    for (const char *p = text; p && (p = strstr(p, "outbox peak ")) != NULL; p++) {
        int peak = atoi(p + strlen("outbox peak "));
        printf("backpressure: an actor's outbox held at most %d messages (bound 84)\n", peak);
        TEST_CHECKF(peak >= 1 && peak <= 84, "outbox peak %d messages: the actor generated past its credit", peak);
        actors++;
    }
    TEST_EQ_INT(actors, 2);
    free(text);
    TEST_CHECK(query_int(db, "SELECT count(*) FROM episodes WHERE status IN ('complete', 'truncated')") >= 16);
}

// Sends garbage to the learner: a non-mtrl frame, a header claiming a payload far over the cap,
// a message with too many frames, and a chunk for an episode nobody began.
static void send_garbage(const char *endpoint) {
    void *ctx = zmq_ctx_new();
    void *s = zmq_socket(ctx, ZMQ_DEALER);
    int linger = 100;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    zmq_connect(s, endpoint);
    zmq_send(s, "hello there", 11, 0);
    unsigned char hdr[40] = {'M', 'T', 'R', 'L', 1, 0, 5, 0};
    for (int i = 16; i < 24; i++) hdr[i] = 0x7f; // payload length ~ 9e18
    zmq_send(s, hdr, sizeof hdr, 0);
    zmq_send(s, "a", 1, ZMQ_SNDMORE);
    zmq_send(s, "b", 1, ZMQ_SNDMORE);
    zmq_send(s, "c", 1, 0);
    sleep_ms(300);
    zmq_close(s);
    zmq_ctx_term(ctx);
}

// Whether dir holds a snapshot of an episode in flight of actor id (a<id>.r<run>.s<slot>.snap).
static int snapshot_of_actor_(const char *dir, int id) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    char prefix[32];
    snprintf(prefix, sizeof prefix, "a%d.r", id);
    int found = 0;
    for (struct dirent *e; !found && (e = readdir(d));) {
        size_t n = strlen(e->d_name);
        found = !strncmp(e->d_name, prefix, strlen(prefix)) && n > 5 && !strcmp(e->d_name + n - 5, ".snap");
    }
    closedir(d);
    return found;
}

static void test_actor_killed(void) {
    char ini[512], db[512], log[512], epfile[512];
    // Long episodes streamed in small chunks, so the actor is always in the middle of some.
    make_experiment("kill", 12, "calc", "", "false", ini, sizeof ini, NULL);
    snprintf(db, sizeof db, "%s/kill.db", dir_);
    snprintf(log, sizeof log, "%s/kill.log", dir_);
    snprintf(epfile, sizeof epfile, "%s/kill.endpoint", dir_);
    // The learner alone prints its endpoint on stdout.
    fflush(NULL);
    pid_t lp = fork();
    if (lp == 0) {
        FILE *f = freopen(log, "a", stderr);
        f = freopen(epfile, "w", stdout);
        (void)f;
        char snaps[600];
        snprintf(snaps, sizeof snaps, "actor.snapshot_dir=%s/snaps", dir_);
        execl(bin_, bin_, "learner", ini, "--db", db, "--set", "actor.max_tokens=1500", "--set",
              "actor.max_turn_tokens=1500", "--set", "actor.chunk_tokens=16", "--set", snaps, "--set",
              "actor.snapshot_tokens=32", (char *)NULL);
        _exit(127);
    }
    char endpoint[256] = "";
    for (int i = 0; i < 200 && !endpoint[0]; i++) {
        sleep_ms(50);
        FILE *f = fopen(epfile, "r");
        if (f) {
            if (fgets(endpoint, sizeof endpoint, f)) endpoint[strcspn(endpoint, "\n")] = '\0';
            fclose(f);
        }
    }
    TEST_CHECKF(endpoint[0], "the learner printed no endpoint");
    char *a1[] = {(char *)bin_, "actor", "--connect", endpoint, "--id", "1", NULL};
    char *a2[] = {(char *)bin_, "actor", "--connect", endpoint, "--id", "2", NULL};
    pid_t p1 = start_cmd(a1, log), p2 = start_cmd(a2, log);
    // Wait until actor 1 has committed episodes and snapshotted one in flight, then kill it in
    // the middle of its next ones (a fixed delay raced the snapshots on a loaded machine).
    for (int i = 0; i < 600 && query_int(db, "SELECT count(*) FROM episodes WHERE actor = 1") < 1; i++) sleep_ms(50);
    TEST_CHECK(query_int(db, "SELECT count(*) FROM episodes WHERE actor = 1") >= 1);
    char snapdir[600];
    snprintf(snapdir, sizeof snapdir, "%s/snaps", dir_);
    for (int i = 0; i < 600 && !snapshot_of_actor_(snapdir, 1); i++) sleep_ms(20);
    TEST_CHECKF(snapshot_of_actor_(snapdir, 1), "actor 1 wrote no snapshot of an episode in flight");
    kill(p1, SIGKILL);
    waitpid(p1, NULL, 0);
    send_garbage(endpoint);
    // The learner notices the silence, aborts the open episodes, and keeps training with actor 2.
    for (int i = 0; i < 200 && query_int(db, "SELECT count(*) FROM episodes WHERE status = 'aborted'") < 1; i++) sleep_ms(50);
    long long aborted = query_int(db, "SELECT count(*) FROM episodes WHERE status = 'aborted' AND actor = 1");
    TEST_CHECKF(aborted >= 1, "no aborted episode of the killed actor");
    char reason[256];
    query_text(db, "SELECT abort_reason FROM episodes WHERE status = 'aborted' AND actor = 1 LIMIT 1", reason, sizeof reason);
    TEST_CONTAINS(reason, "heartbeat");
    long long step_before = query_int(db, "SELECT max(step) FROM metrics WHERE name = 'reward'");
    // Actor 2 stopped (SIGSTOP) past the heartbeat timeout is declared dead although its process
    // lives; once continued it must notice (the learner answers "say HELLO", or the connection
    // dropped) and start over as a new incarnation instead of streaming into the void.
    long long inc2 = query_int(db, "SELECT count(DISTINCT incarnation) FROM episodes WHERE actor = 2");
    kill(p2, SIGSTOP);
    // Dead by the application's heartbeat, or by ZeroMQ's (a send to it then fails).
    const char *dead = "SELECT count(*) FROM events WHERE message LIKE 'actor 2 %' AND "
                       "(message LIKE '%dead%' OR message LIKE '%disconnected%')";
    for (int i = 0; i < 200 && query_int(db, dead) < 1; i++) sleep_ms(50);
    TEST_CHECK(query_int(db, dead) >= 1);
    kill(p2, SIGCONT);
    // A restarted actor 1 rejoins with a new incarnation.
    pid_t p1b = start_cmd(a1, log);
    int st;
    for (int i = 0; i < 1200; i++) {
        if (waitpid(lp, &st, WNOHANG) == lp) break;
        sleep_ms(50);
    }
    TEST_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    long long step_after = query_int(db, "SELECT max(step) FROM metrics WHERE name = 'reward'");
    printf("actor killed: %lld aborted episodes (%s); steps %lld -> %lld\n", aborted, reason, step_before, step_after);
    TEST_EQ_INT(step_after, 12);
    TEST_CHECK(query_int(db, "SELECT count(DISTINCT incarnation) FROM episodes WHERE actor = 1") >= 2);
    long long inc2_after = query_int(db, "SELECT count(DISTINCT incarnation) FROM episodes WHERE actor = 2");
    long long done2 = query_int(db, "SELECT count(*) FROM episodes e WHERE actor = 2 AND status = 'complete' AND "
                                    "incarnation = (SELECT max(incarnation) FROM episodes WHERE actor = 2)");
    printf("actor stopped: incarnations %lld -> %lld, %lld complete episodes of the newest\n", inc2, inc2_after, done2);
    TEST_CHECK(inc2_after > inc2);
    TEST_CHECK(done2 >= 1);
    char *text = test_slurp(log, NULL);
    TEST_CHECK(text != NULL);
    // (Messages the actor sent between the drop and noticing it may arrive without their BEGIN:
    // the learner drops them, and the new incarnation's HELLO aborts what it held of the old.)
    TEST_CONTAINS(text, "HELLO as incarnation");
    TEST_CONTAINS(text, "episodes in flight go on under new ids");
    // The killed actor's episodes in flight were snapshotted; its successor resumed them under
    // new ids and they finished (their tokens from before the kill included).
    const char *res = strstr(text, "actor 1: resumed episode ");
    TEST_CHECKF(res != NULL, "the restarted actor resumed no snapshot");
    if (res) {
        unsigned long long old_id = 0, new_id = 0, at = 0;
        TEST_EQ_INT(sscanf(res, "actor 1: resumed episode %llu as %llu at %llu tokens", &old_id, &new_id, &at), 3);
        char q[200];
        snprintf(q, sizeof q, "SELECT tokens FROM episodes WHERE id = %lld AND status IN ('complete','truncated')",
                 (long long)new_id);
        long long toks = query_int(db, q);
        snprintf(q, sizeof q, "SELECT count(*) FROM episodes WHERE id = %lld AND status = 'aborted'", (long long)old_id);
        printf("resumed episode %llu as %llu at %llu tokens: %s %lld tokens\n", old_id, new_id, at,
               toks >= 0 ? "finished with" : "still running at the end of the run; tokens", toks);
        TEST_CHECK(at >= 32);
        // It may still be running when the 12 steps are done (up to 1500 tokens); if it finished,
        // its tokens from before the kill are in it.
        TEST_CHECK(toks < 0 || toks >= (long long)at);
        // The old stream is on record as aborted, unless none of it had reached the learner yet
        // (its BEGIN still waiting for credit when the actor was killed).
        TEST_CHECK(query_int(db, q) <= 1);
    }
    free(text);
    char status[64];
    query_text(db, "SELECT status FROM runs WHERE id = 1", status, sizeof status);
    TEST_EQ_STR(status, "finished");
    kill(p2, SIGTERM);
    kill(p1b, SIGTERM);
    waitpid(p2, NULL, 0);
    waitpid(p1b, NULL, 0);
    check_digests(db);
}

// CURVE end to end: `mtrl run` with [learner] curve_key / curve_allow finishes (its local actors
// get a throw-away key the learner trusts), and while it runs an actor whose key is not on the
// allow-list is refused (the learner logs the refused key) and gets nothing through.
static void test_curve(void) {
    char ini[512], db[512], log[512], stem[512], allow[512];
    snprintf(allow, sizeof allow, "%s/allowed", dir_);
    TEST_CHECK(mkdir(allow, 0755) == 0);
    const char *names[] = {"learner", "stranger"};
    for (int i = 0; i < 2; i++) {
        snprintf(stem, sizeof stem, "%s/%s", dir_, names[i]);
        char *kg[] = {(char *)bin_, "keygen", stem, NULL};
        snprintf(log, sizeof log, "%s/keygen.log", dir_);
        TEST_EQ_INT(run_cmd(kg, log), 0);
    }
    make_experiment("curve", 30, "calc", "", "false", ini, sizeof ini, NULL);
    snprintf(db, sizeof db, "%s/curve.db", dir_);
    snprintf(log, sizeof log, "%s/curve.log", dir_);
    char key_set[700], allow_set[700];
    snprintf(key_set, sizeof key_set, "learner.curve_key=%s/learner.key", dir_);
    snprintf(allow_set, sizeof allow_set, "learner.curve_allow=%s", allow);
    char *argv[] = {(char *)bin_, "run", ini, "--db", db, "--set", key_set, "--set", allow_set, NULL};
    pid_t run = start_cmd(argv, log);
    // The endpoint the learner bound (an ephemeral port), from its log line.
    char endpoint[128] = "";
    for (int i = 0; i < 400 && !endpoint[0]; i++) {
        sleep_ms(50);
        char *t = test_slurp(log, NULL);
        const char *at = t ? strstr(t, "learner on tcp://") : NULL;
        if (at) sscanf(at + strlen("learner on "), "%127[^,]", endpoint);
        free(t);
    }
    TEST_CHECKF(endpoint[0], "the learner logged no endpoint");
    // A stranger with a valid key pair that is not on the list, holding the right learner key.
    char server_pub[600], stranger_key[600];
    snprintf(server_pub, sizeof server_pub, "%s/learner.pub", dir_);
    snprintf(stranger_key, sizeof stranger_key, "%s/stranger.key", dir_);
    for (int i = 0; i < 200 && query_int(db, "SELECT count(*) FROM episodes") < 1; i++) sleep_ms(50);
    char *st_argv[] = {(char *)bin_, "actor", "--connect", endpoint, "--id", "9", "--curve-server-key",
                       server_pub, "--curve-key", stranger_key, NULL};
    pid_t stranger = start_cmd(st_argv, log);
    int status;
    for (int i = 0; i < 2400; i++) {
        if (waitpid(run, &status, WNOHANG) == run) break;
        sleep_ms(50);
    }
    TEST_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    kill(stranger, SIGTERM);
    waitpid(stranger, NULL, 0);
    char st[64];
    query_text(db, "SELECT status FROM runs WHERE id = 1", st, sizeof st);
    TEST_EQ_STR(st, "finished");
    TEST_EQ_INT(query_int(db, "SELECT count(*) FROM episodes WHERE actor = 9"), 0);
    char *text = test_slurp(log, NULL);
    TEST_CHECK(text != NULL);
    TEST_CONTAINS(text, "refused CURVE client");
    printf("curve: run finished with %lld episodes; the stranger was refused\n",
           query_int(db, "SELECT count(*) FROM episodes"));
    free(text);
}

// SIGINT stops a run cleanly: exit code 1, the run marked killed, its actors gone.
static void test_sigint(void) {
    char ini[512], db[512], log[512];
    make_experiment("sigint", 100000, "calc", "", "false", ini, sizeof ini, NULL);
    snprintf(db, sizeof db, "%s/sigint.db", dir_);
    snprintf(log, sizeof log, "%s/sigint.log", dir_);
    char *argv[] = {(char *)bin_, "run", ini, "--db", db, NULL};
    pid_t p = start_cmd(argv, log);
    for (int i = 0; i < 600 && query_int(db, "SELECT count(*) FROM metrics WHERE name = 'reward'") < 2; i++) sleep_ms(50);
    kill(p, SIGINT);
    int st = 0;
    for (int i = 0; i < 400; i++) {
        if (waitpid(p, &st, WNOHANG) == p) break;
        sleep_ms(50);
    }
    TEST_CHECKF(WIFEXITED(st) && WEXITSTATUS(st) == 1, "mtrl run after SIGINT: status %d", st);
    char status[64];
    query_text(db, "SELECT status FROM runs WHERE id = 1", status, sizeof status);
    TEST_EQ_STR(status, "killed");
    // No actor of this run is left: no process has the run's endpoint on its command line.
    char endpoint[128] = "", line[1024];
    FILE *f = fopen(log, "r");
    while (f && fgets(line, sizeof line, f)) {
        char *at = strstr(line, "learner on ");
        if (at && sscanf(at + 11, "%127[^,]", endpoint) == 1) break;
    }
    if (f) fclose(f);
    TEST_CHECK(endpoint[0] != '\0');
    int left = 0;
    DIR *proc = opendir("/proc");
    struct dirent *de;
    while (proc && endpoint[0] && (de = readdir(proc))) {
        if (de->d_name[0] < '0' || de->d_name[0] > '9') continue;
        char path[300], cmdline[2048];
        snprintf(path, sizeof path, "/proc/%s/cmdline", de->d_name);
        FILE *c = fopen(path, "r");
        if (!c) continue;
        size_t n = fread(cmdline, 1, sizeof cmdline - 1, c);
        fclose(c);
        for (size_t i = 0; i < n; i++)
            if (!cmdline[i]) cmdline[i] = ' ';
        cmdline[n] = '\0';
        left += strstr(cmdline, endpoint) != NULL && strstr(cmdline, "actor") != NULL;
    }
    if (proc) closedir(proc);
    TEST_EQ_INT(left, 0);
}

// [stage.N]: the run moves through the context ladder at step boundaries; actors rebuild their
// episodes for each stage (with the stage's episodes_in_flight); per-stage metrics are logged.
// It runs in two sittings: run.stop_before_stage=2 stops it with a checkpoint before stage 2,
// and --resume (with the same setting) goes on into stage 2 and finishes.
static void test_stages(void) {
    char ini[512], db[512], log[512], text[2048];
    snprintf(ini, sizeof ini, "%s/stages.ini", dir_);
    snprintf(db, sizeof db, "%s/stages.db", dir_);
    snprintf(log, sizeof log, "%s/stages.log", dir_);
    snprintf(text, sizeof text,
             "[run]\nname = stages\nseed = 4\nout_dir = %s/runs-stages\n[model]\npreset = tiny\n"
             "[env]\nname = retrieval\ndoc_tokens = 32\ninline_doc = true\n[actor]\ncount = 2\nepisodes_in_flight = 8\nmax_turn_tokens = 24\n"
             "heartbeat_ms = 200\n[learner]\nbatch_groups = 2\n[algo]\ngroup_size = 2\n"
             "[stage.1]\ncontext = 300\ndoc_tokens = 32\nsteps = 2\n"
             "[stage.2]\ncontext = 600\ndoc_tokens = 300\nsteps = 2\nbatch_groups = 1\nepisodes_in_flight = 4\n",
             dir_);
    write_file(ini, text);
    // stop_before_stage = 1 stops a fresh run before its first stage: no RL step, the checkpoint
    // of step 0 (the policy before RL, which keep_checkpoints would otherwise delete in time)
    char db0[512];
    snprintf(db0, sizeof db0, "%s/stages0.db", dir_);
    char *argv0[] = {(char *)bin_, "run", ini, "--db", db0, "--set", "run.stop_before_stage=1", NULL};
    TEST_EQ_INT(run_cmd(argv0, log), 0);
    TEST_EQ_INT(query_int(db0, "SELECT count(*) FROM metrics WHERE name = 'stage'"), 0);
    TEST_EQ_INT(query_int(db0, "SELECT count(*) FROM checkpoints WHERE step = 0"), 1);
    TEST_EQ_INT(query_int(db0, "SELECT max(step) FROM checkpoints"), 0);
    char *zero = test_slurp(log, NULL);
    TEST_CHECKF(zero && strstr(zero, "stop_before_stage 1: stopping at step 0, before stage 1"), "no stop line in %s", log);
    free(zero);
    char *argv[] = {(char *)bin_, "run", ini, "--db", db, "--set", "run.stop_before_stage=2", NULL};
    TEST_EQ_INT(run_cmd(argv, log), 0);
    TEST_EQ_INT(query_int(db, "SELECT count(*) FROM metrics WHERE name = 'stage' AND value = 1"), 2);
    TEST_EQ_INT(query_int(db, "SELECT count(*) FROM metrics WHERE name = 'stage' AND value = 2"), 0);
    TEST_EQ_INT(query_int(db, "SELECT max(step) FROM checkpoints"), 2);
    char *first = test_slurp(log, NULL);
    TEST_CHECKF(first && strstr(first, "stop_before_stage 2: stopping at step 2"), "no stop_before_stage line in %s", log);
    TEST_CHECKF(first && !strstr(first, "4 episodes in flight"), "stage 2's episodes_in_flight before stage 2 (%s)", log);
    free(first);
    char *again[] = {(char *)bin_, "run", ini, "--db", db, "--resume", "--set", "run.stop_before_stage=2", NULL};
    TEST_EQ_INT(run_cmd(again, log), 0);
    char *second = test_slurp(log, NULL);
    TEST_CHECKF(second && strstr(second, "4 episodes in flight"), "the actors did not take stage 2's episodes_in_flight (%s)", log);
    free(second);
    TEST_EQ_INT(query_int(db, "SELECT count(*) FROM metrics WHERE name = 'stage' AND value = 1"), 2);
    TEST_EQ_INT(query_int(db, "SELECT count(*) FROM metrics WHERE name = 'stage' AND value = 2"), 2);
    TEST_EQ_INT(query_int(db, "SELECT max(value) FROM metrics WHERE name = 'context'"), 600);
    TEST_EQ_INT(query_int(db, "SELECT count(*) FROM metrics WHERE name = 'reward.stage2'"), 2);
    // each step trained its stage's batch: 2 groups of 2 in stage 1, 1 group of 2 in stage 2
    for (int stage = 1; stage <= 2; stage++) {
        char q[256];
        snprintf(q, sizeof q,
                 "SELECT count(*) FROM metrics m JOIN metrics s ON s.run = m.run AND s.step = m.step "
                 "WHERE m.name = 'episodes' AND s.name = 'stage' AND s.value = %d AND m.value = %d",
                 stage, stage == 1 ? 4 : 2);
        TEST_EQ_INT(query_int(db, q), 2);
    }
    // stage 2 episodes are longer (their prompt holds a longer document) and within the budget
    TEST_CHECK(query_int(db, "SELECT max(tokens) FROM episodes WHERE step >= 3") > 300);
    TEST_CHECK(query_int(db, "SELECT max(tokens) FROM episodes") <= 600);
    // every stage-2 step trained stage-2 episodes only (a 300-token document in each prompt), not
    // the stage-1 episodes the actors were finishing when the stage changed (8 in flight per actor
    // and one group size for both stages: their groups are complete as soon as they arrive)
    int short_len = query_int(db, "SELECT min(m.value) FROM metrics m JOIN metrics s ON s.run = m.run AND s.step = m.step "
                                  "WHERE m.name = 'episode_len' AND s.name = 'stage' AND s.value = 2");
    TEST_CHECKF(short_len > 300, "a stage-2 step trained episodes of %d tokens on average", short_len);
    char status[64];
    query_text(db, "SELECT status FROM runs WHERE id = 1", status, sizeof status);
    TEST_EQ_STR(status, "finished");
}

// A new stage's WELCOME while episode messages are in flight: the actor and the learner must
// agree on the actor's credit afterwards. Both reset it to the WELCOME's credit once, and the
// bytes in flight at each stage change then counted twice against it on the learner's side: at
// the third stage of recall-1m on an H200 (2026-12-02) an actor was refused for sending "beyond
// its credit" and its 18 open episodes were aborted. Four stages, 4 KiB of credit and 64-token
// chunks keep messages in flight at every change.
static void test_stage_credit(void) {
    char ini[512], db[512], log[512], text[2048];
    snprintf(ini, sizeof ini, "%s/stagecredit.ini", dir_);
    snprintf(db, sizeof db, "%s/stagecredit.db", dir_);
    snprintf(log, sizeof log, "%s/stagecredit.log", dir_);
    snprintf(text, sizeof text,
             "[run]\nname = stagecredit\nseed = 5\nout_dir = %s/runs-stagecredit\n[model]\npreset = tiny\n"
             "[env]\nname = retrieval\ndoc_tokens = 200\ninline_doc = true\nmax_tool_calls = 0\n"
             "[actor]\ncount = 2\nepisodes_in_flight = 8\nmax_turn_tokens = 8\nchunk_tokens = 64\n"
             "[learner]\nbatch_groups = 2\ncredit_bytes = 4096\n[algo]\ngroup_size = 2\n"
             "[stage.1]\ncontext = 600\ndoc_tokens = 400\nsteps = 1\n"
             "[stage.2]\ncontext = 900\ndoc_tokens = 700\nsteps = 1\n"
             "[stage.3]\ncontext = 1200\ndoc_tokens = 1000\nsteps = 1\n"
             "[stage.4]\ncontext = 1500\ndoc_tokens = 1300\nsteps = 1\n",
             dir_);
    write_file(ini, text);
    char *argv[] = {(char *)bin_, "run", ini, "--db", db, NULL};
    TEST_EQ_INT(run_cmd(argv, log), 0);
    int refused = query_int(db, "SELECT count(*) FROM events WHERE message LIKE '%beyond its credit%'");
    TEST_CHECKF(refused == 0, "%d events of an actor refused for its credit across the stage changes (%s)", refused, log);
    TEST_EQ_INT(query_int(db, "SELECT count(*) FROM metrics WHERE name = 'stage' AND value = 4"), 1);
    char status[64];
    query_text(db, "SELECT status FROM runs WHERE id = 1", status, sizeof status);
    TEST_EQ_STR(status, "finished");
}

static void test_plugins(void) {
    const char *build = getenv("MTRL_BUILD");
    char so[512], ini[512], db[512], log[512];
    // 4. the example plug-in
    snprintf(so, sizeof so, "%s/lib/libmtrl_env_example.so", build);
    make_experiment("plugin", 2, "plugin", so, "false", ini, sizeof ini, NULL);
    snprintf(db, sizeof db, "%s/plugin.db", dir_);
    snprintf(log, sizeof log, "%s/plugin.log", dir_);
    char *argv[] = {(char *)bin_, "run", ini, "--db", db, NULL};
    TEST_EQ_INT(run_cmd(argv, log), 0);
    char env[64];
    query_text(db, "SELECT env FROM episodes LIMIT 1", env, sizeof env);
    TEST_EQ_STR(env, "reverse");
    // 5. a plug-in that segfaults on a third of its episodes, isolated
    snprintf(so, sizeof so, "%s/lib/libmtrl_env_bad_segv_sometimes.so", build);
    make_experiment("crash", 3, "plugin", so, "true", ini, sizeof ini, NULL);
    snprintf(db, sizeof db, "%s/crash.db", dir_);
    snprintf(log, sizeof log, "%s/crash.log", dir_);
    char *argv2[] = {(char *)bin_, "run", ini, "--db", db, NULL};
    TEST_EQ_INT(run_cmd(argv2, log), 0);
    long long crashed = query_int(db, "SELECT count(*) FROM episodes WHERE status = 'aborted' AND abort_reason LIKE '%crashed%'");
    long long fine = query_int(db, "SELECT count(*) FROM episodes WHERE status IN ('complete','truncated')");
    printf("crashing plug-in: %lld episodes aborted by the crash, %lld finished\n", crashed, fine);
    TEST_CHECK(crashed >= 1);
    TEST_CHECK(fine >= 4);
    char status[64];
    query_text(db, "SELECT status FROM runs WHERE id = 1", status, sizeof status);
    TEST_EQ_STR(status, "finished");
    // 6. a plug-in path that does not load is a config error: `mtrl run` loads the env in a
    // child process before anything else and exits 2 with the loader's message, writing nothing
    // (issue 28 item 14; test_cli_user covers the other broken [env] sections).
    make_experiment("noplugin", 3, "plugin", "/nonexistent/env.so", "false", ini, sizeof ini, NULL);
    snprintf(db, sizeof db, "%s/noplugin.db", dir_);
    snprintf(log, sizeof log, "%s/noplugin.log", dir_);
    char *argv3[] = {(char *)bin_, "run", ini, "--db", db, NULL};
    TEST_EQ_INT(run_cmd(argv3, log), 2);
    TEST_CHECK(access(db, F_OK) != 0);
    char *text = test_slurp(log, NULL);
    TEST_CHECK(text != NULL);
    TEST_CONTAINS(text, "/nonexistent/env.so");
    TEST_CONTAINS(text, "1 problem in");
    free(text);
    // 7. an actor slow to set up (its first env takes 4 s to create, as a model build on a GPU
    // takes seconds) is silent after its WELCOME for longer than heartbeat_timeout_ms (2.5 s):
    // it is not dead under actor_start_timeout_ms (default 120 s); with 1 s it is (declared
    // dead, then it says HELLO again and the run still finishes)
    snprintf(so, sizeof so, "%s/lib/libmtrl_env_bad_slow_start.so", build);
    for (int strict = 0; strict <= 1; strict++) {
        make_experiment(strict ? "slowstart1" : "slowstart0", 3, "plugin", so, "false", ini, sizeof ini, NULL);
        snprintf(db, sizeof db, "%s/slowstart%d.db", dir_, strict);
        snprintf(log, sizeof log, "%s/slowstart%d.log", dir_, strict);
        // 2.5 s heartbeat timeout: well under the 4 s setup, and well over a heartbeat (200 ms)
        // delayed on a loaded machine
        char *argv4[] = {(char *)bin_, "run", ini, "--db", db, "--set", "learner.heartbeat_timeout_ms=2500",
                         "--set", "learner.actor_start_timeout_ms=1000", NULL};
        if (!strict) argv4[7] = NULL;
        TEST_EQ_INT(run_cmd(argv4, log), 0);
        text = test_slurp(log, NULL);
        int dead = text && strstr(text, "s: dead") != NULL;
        TEST_CHECKF(dead == strict, "actor_start_timeout_ms %s: an actor slow to start was%s declared dead (%s)",
                    strict ? "1000" : "default", dead ? "" : " not", log);
        free(text);
    }
}

// The length of the line at p up to its ", N.N s since start" (the whole line without one).
static size_t eval_line_len_(const char *p) {
    size_t n = strcspn(p, "\n");
    for (size_t i = n; i-- > 0;)
        if (p[i] == ',' && !strncmp(p + i, ", ", 2) && strstr(p + i, " s since start") &&
            (size_t)(strstr(p + i, " s since start") - p) < n)
            return i;
    return n;
}

// `mtrl eval`: the stage run's last checkpoint on fresh tasks at stage 2 (its 600-token context):
// the episodes asked for, each printed, the totals; the same checkpoint gives the same episodes
// (sampling is a function of counters); bad input is refused naming it. And `mtrl report` of the
// stage run: its context-ladder table.
static void test_eval(void) {
    char ini[512], ckpt[512], log[2][512];
    snprintf(ini, sizeof ini, "%s/stages.ini", dir_);
    snprintf(ckpt, sizeof ckpt, "%s/runs-stages/stages-run1/ckpt-000004.safetensors", dir_);
    char *out[2];
    for (int i = 0; i < 2; i++) {
        snprintf(log[i], sizeof log[i], "%s/eval%d.log", dir_, i);
        char *argv[] = {(char *)bin_, "eval", ini, "--checkpoint", ckpt, "--stage", "2", "--episodes", "6", NULL};
        TEST_EQ_INT(run_cmd(argv, log[i]), 0);
        out[i] = test_slurp(log[i], NULL);
    }
    TEST_CHECK(out[0] && out[1]);
    if (out[0] && out[1]) {
        TEST_CONTAINS(out[0], "up to 600 tokens each");
        TEST_CONTAINS(out[0], "episode 6: ");
        TEST_CONTAINS(out[0], "6 episodes in "); // 3 groups of 2, no more
        TEST_CHECK(strstr(out[0], "episode 7: ") == NULL);
        // the same lines but for the timings (", N.N s since start"; the totals line has them too)
        const char *a = out[0], *b = out[1];
        int same = 1;
        while (*a && *b && same && strncmp(a, "6 episodes in", 13)) {
            size_t la = eval_line_len_(a), lb = eval_line_len_(b);
            same = la == lb && !memcmp(a, b, la);
            a += strcspn(a, "\n") + (a[strcspn(a, "\n")] != 0);
            b += strcspn(b, "\n") + (b[strcspn(b, "\n")] != 0);
        }
        TEST_CHECKF(same, "two evaluations of one checkpoint differ (%s, %s)", log[0], log[1]);
    }
    free(out[0]);
    free(out[1]);
    // the report of the stage run has its ladder table: stage 2 at a 600-token context, 2 steps
    char db[512], rep[512], page[600], rlog[512];
    snprintf(db, sizeof db, "%s/stages.db", dir_);
    snprintf(rep, sizeof rep, "%s/report-stages", dir_);
    snprintf(rlog, sizeof rlog, "%s/report-stages.log", dir_);
    char *argv5[] = {(char *)bin_, "report", "--db", db, "--out", rep, NULL};
    TEST_EQ_INT(run_cmd(argv5, rlog), 0);
    snprintf(page, sizeof page, "%s/index.html", rep);
    char *html = test_slurp(page, NULL);
    TEST_CHECK(html != NULL);
    if (html) {
        TEST_CONTAINS(html, "<h2 id=\"ladder\">Context ladder</h2>");
        TEST_CONTAINS(html, "</span>run 1</td><td>1</td><td>300</td><td>2</td>");
        TEST_CONTAINS(html, "</span>run 1</td><td>2</td><td>600</td><td>2</td>");
    }
    free(html);
    char bad[512];
    snprintf(bad, sizeof bad, "%s/eval-bad.log", dir_);
    char *argv3[] = {(char *)bin_, "eval", ini, "--stage", "3", NULL};
    TEST_EQ_INT(run_cmd(argv3, bad), 2);
    char *argv4[] = {(char *)bin_, "eval", ini, "--checkpoint", "/nonexistent/ckpt.safetensors", NULL};
    TEST_EQ_INT(run_cmd(argv4, bad), 1);
    char *text = test_slurp(bad, NULL);
    TEST_CHECK(text != NULL);
    if (text) {
        TEST_CONTAINS(text, "has 2 stages");
        TEST_CONTAINS(text, "/nonexistent/ckpt.safetensors");
    }
    free(text);
}

int main(void) {
    bin_ = getenv("MTRL_BIN");
    if (!bin_ || access(bin_, X_OK) != 0) test_skip("MTRL_BIN (the mtrl command) is not set");
    snprintf(dir_, sizeof dir_, "/tmp/mtrl-rl-XXXXXX");
    TEST_CHECK(mkdtemp(dir_) != NULL);
    setenv("OMP_NUM_THREADS", "1", 1);
    test_short_run();
    test_small_credit();
    test_backpressure();
    test_actor_killed();
    test_plugins();
    test_curve();
    test_stages();
    test_stage_credit();
    test_eval();
    test_sigint();
    int rc = test_report();
    if (rc == 0) {
        char cmd[600];
        snprintf(cmd, sizeof cmd, "rm -rf %s", dir_);
        if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir_);
    } else {
        fprintf(stderr, "logs kept in %s\n", dir_);
    }
    return rc;
}
