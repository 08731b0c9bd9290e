// mtrl-test: cpu fault timeout=120
// test_store: the SQLite run store (common/store.h): schema and header (user_version,
// application_id, WAL), every insert and query, batches and rollback, a second writer refused,
// runs left 'running' by a dead writer become 'failed', newer or foreign databases refused, and
// the sqlite3 shell can read the result. The lock is the real file's (issue 28, item 5): while
// another process writes live.db, opening it through a symlink, through "dir/./live.db" or a
// dangling symlink to a database not created yet is refused (MTRL_ERR_STATE) and the live run
// stays 'running'.
#include <math.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/fsutil.h"
#include "common/store.h"
#include "tests/fuzz/trajgen.h"
#include "tests/testhelp.h"
#include "tests/testproc.h"

static char dir_[256], db_[320];

static int64_t sql_int(mtrl_store *s, const char *sql) {
    sqlite3_stmt *q = NULL;
    int64_t v = -999;
    if (sqlite3_prepare_v2(mtrl_store_sqlite(s), sql, -1, &q, NULL) == SQLITE_OK && sqlite3_step(q) == SQLITE_ROW)
        v = sqlite3_column_int64(q, 0);
    else
        fprintf(stderr, "query failed: %s: %s\n", sql, sqlite3_errmsg(mtrl_store_sqlite(s)));
    sqlite3_finalize(q);
    return v;
}

static void sql_text(mtrl_store *s, const char *sql, char *buf, size_t cap) {
    sqlite3_stmt *q = NULL;
    buf[0] = '\0';
    if (sqlite3_prepare_v2(mtrl_store_sqlite(s), sql, -1, &q, NULL) == SQLITE_OK && sqlite3_step(q) == SQLITE_ROW &&
        sqlite3_column_text(q, 0))
        snprintf(buf, cap, "%s", (const char *)sqlite3_column_text(q, 0));
    sqlite3_finalize(q);
}

static int64_t run1_;
static mtrl_traj ep_ok_, ep_bad_;

static void test_schema_and_writes(void) {
    mtrl_store *s = NULL;
    mtrl_error err;
    TEST_EQ_INT(mtrl_store_open(&s, db_, 0, &err), MTRL_OK);
    if (!s) {
        fprintf(stderr, "open: %s\n", err.msg);
        return;
    }
    TEST_EQ_INT(sql_int(s, "PRAGMA user_version"), MTRL_STORE_SCHEMA);
    TEST_EQ_INT(sql_int(s, "PRAGMA application_id"), MTRL_STORE_APP_ID);
    TEST_EQ_INT(sql_int(s, "PRAGMA foreign_keys"), 1);
    TEST_EQ_INT(sql_int(s, "PRAGMA synchronous"), 1); // NORMAL
    char buf[256];
    sql_text(s, "PRAGMA journal_mode", buf, sizeof buf);
    TEST_EQ_STR(buf, "wal");
    TEST_EQ_INT(sql_int(s, "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name IN "
                           "('runs','params','metrics','episodes','tool_calls','experts','checkpoints','events')"),
                8);
    int64_t none = 0;
    TEST_EQ_INT(mtrl_store_run_latest(s, &none, &err), MTRL_ERR_NOTFOUND);

    mtrl_store_run_info info = {.name = "quickstart", .config = "[model]\npreset = tiny\n", .config_hash = "00ab",
                                .git_rev = "deadbeef"};
    TEST_EQ_INT(mtrl_store_run_create(s, &info, &run1_, &err), MTRL_OK);
    TEST_CHECK(run1_ > 0);
    TEST_EQ_INT(mtrl_store_param_log(s, run1_, "learner.lr", "1e-4", &err), MTRL_OK);
    TEST_EQ_INT(mtrl_store_param_log(s, run1_, "learner.lr", "3e-4", &err), MTRL_OK); // replaces
    TEST_EQ_INT(mtrl_store_param_log(s, run1_, "model.preset", "tiny", &err), MTRL_OK);

    // One batch per step, as the learner does it.
    for (int step = 0; step < 20; step++) {
        TEST_EQ_INT(mtrl_store_begin(s, &err), MTRL_OK);
        mtrl_store_metric_log(s, run1_, step, "loss", 2.0 / (1 + step), 0, &err);
        mtrl_store_metric_log(s, run1_, step, "reward", step == 7 ? NAN : 0.1 * step, 0, &err);
        for (int layer = 0; layer < 2; layer++)
            for (int e = 0; e < 4; e++)
                TEST_EQ_INT(mtrl_store_expert_log(s, run1_, step, layer, e, 0.25 + 0.01 * e, -0.1 * e, &err), MTRL_OK);
        TEST_EQ_INT(mtrl_store_commit(s, &err), MTRL_OK);
    }
    TEST_EQ_INT(mtrl_store_begin(s, &err), MTRL_OK);
    TEST_EQ_INT(mtrl_store_begin(s, &err), MTRL_ERR_STATE); // no nesting
    mtrl_store_metric_log(s, run1_, 99, "loss", 123, 0, &err);
    mtrl_store_rollback(s);
    TEST_EQ_INT(sql_int(s, "SELECT count(*) FROM metrics WHERE step = 99"), 0);
    TEST_EQ_INT(mtrl_store_commit(s, &err), MTRL_ERR_STATE);

    // Episodes with tool calls; one with a 64-bit id above 2^63.
    tg_rng r = {5};
    mtrl_traj_init(&ep_ok_);
    mtrl_traj_init(&ep_bad_);
    tg_traj(&ep_ok_, &r, 300, 4, 0, 3);
    ep_ok_.episode_id = 0xfedcba9876543210ULL;
    ep_ok_.status = MTRL_EP_COMPLETE;
    tg_traj(&ep_bad_, &r, 10, 0, 0, 0);
    ep_bad_.status = MTRL_EP_REJECTED;
    mtrl_traj_set_reason(&ep_bad_, "digest mismatch: END says 1, tokens hash to 2");
    TEST_EQ_INT(mtrl_store_episode_log(s, run1_, &ep_ok_, "runs/traj.bin", 18234, 12, &err), MTRL_OK);
    TEST_EQ_INT(mtrl_store_episode_log(s, run1_, &ep_bad_, NULL, -1, -1, &err), MTRL_OK);
    TEST_EQ_INT(sql_int(s, "SELECT count(*) FROM tool_calls"), 3);
    // The same episode twice is refused, and its tool calls are not doubled.
    TEST_EQ_INT(mtrl_store_episode_log(s, run1_, &ep_ok_, "runs/traj.bin", 18234, 12, &err), MTRL_ERR_STATE);
    TEST_CONTAINS(err.msg, "episode 18364758544493064720 of run");
    TEST_EQ_INT(sql_int(s, "SELECT count(*) FROM tool_calls"), 3);
    // ... also inside a batch: the batch survives, without the duplicate's rows.
    TEST_EQ_INT(mtrl_store_begin(s, &err), MTRL_OK);
    mtrl_store_metric_log(s, run1_, 20, "loss", 0.5, 0, &err);
    TEST_EQ_INT(mtrl_store_episode_log(s, run1_, &ep_ok_, "x", 0, 20, &err), MTRL_ERR_STATE);
    TEST_EQ_INT(mtrl_store_commit(s, &err), MTRL_OK);
    TEST_EQ_INT(sql_int(s, "SELECT count(*) FROM metrics WHERE step = 20"), 1);
    TEST_EQ_INT(sql_int(s, "SELECT count(*) FROM tool_calls"), 3);

    TEST_EQ_INT(mtrl_store_checkpoint_log(s, run1_, 10, 10, "runs/ckpt-10.bin", "ab12", &err), MTRL_OK);
    TEST_EQ_INT(mtrl_store_checkpoint_log(s, run1_, 20, 20, "runs/ckpt-20.bin", "cd34", &err), MTRL_OK);
    TEST_EQ_INT(mtrl_store_event_log(s, run1_, MTRL_LOG_INFO, "step 20 done", &err), MTRL_OK);
    TEST_EQ_INT(mtrl_store_event_log(s, 0, MTRL_LOG_WARN, "no run", &err), MTRL_OK);
    TEST_EQ_INT(sql_int(s, "SELECT count(*) FROM events WHERE run IS NULL"), 1);

    // A second writer is refused while this one is open, in this process and in another.
    mtrl_store *s2 = NULL;
    TEST_EQ_INT(mtrl_store_open(&s2, db_, 0, &err), MTRL_ERR_STATE);
    TEST_CHECK(s2 == NULL);
    TEST_CONTAINS(err.msg, "is writing this run store");
    TEST_CONTAINS(err.msg, "only one learner may write a run store");
    char pidtxt[32];
    snprintf(pidtxt, sizeof pidtxt, "pid %ld", (long)getpid());
    TEST_CONTAINS(err.msg, pidtxt);
    fflush(NULL);
    pid_t child = fork();
    if (child == 0) {
        mtrl_store *c = NULL;
        mtrl_error e2;
        mtrl_status st = mtrl_store_open(&c, db_, 0, &e2);
        _exit(st == MTRL_ERR_STATE ? 0 : 1);
    }
    int ws = 0;
    waitpid(child, &ws, 0);
    TEST_CHECKF(WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "a second writer in another process was not refused");

    // Readers are welcome meanwhile, and cannot write.
    mtrl_store *ro = NULL;
    TEST_EQ_INT(mtrl_store_open(&ro, db_, 1, &err), MTRL_OK);
    if (ro) {
        int64_t latest = 0;
        TEST_EQ_INT(mtrl_store_run_latest(ro, &latest, &err), MTRL_OK);
        TEST_EQ_INT(latest, run1_);
        TEST_EQ_INT(mtrl_store_metric_log(ro, run1_, 1, "x", 1, 0, &err), MTRL_ERR_STATE);
        TEST_CONTAINS(err.msg, "read-only");
        TEST_EQ_INT(mtrl_store_begin(ro, &err), MTRL_ERR_STATE);
        mtrl_store_close(ro);
    }
    TEST_EQ_INT(mtrl_store_run_set_status(s, run1_, MTRL_RUN_FINISHED, &err), MTRL_OK);
    TEST_EQ_INT(mtrl_store_run_set_status(s, 999, MTRL_RUN_FINISHED, &err), MTRL_ERR_NOTFOUND);
    mtrl_store_close(s);
}

static void test_queries(void) {
    mtrl_store *s = NULL;
    mtrl_error err;
    TEST_EQ_INT(mtrl_store_open(&s, db_, 1, &err), MTRL_OK);
    if (!s) return;
    int64_t latest = 0;
    TEST_EQ_INT(mtrl_store_run_latest(s, &latest, &err), MTRL_OK);
    TEST_EQ_INT(latest, run1_);

    mtrl_store_run run;
    char *config = NULL;
    TEST_EQ_INT(mtrl_store_run_get(s, run1_, &run, &config, &err), MTRL_OK);
    TEST_EQ_STR(run.name, "quickstart");
    TEST_EQ_INT(run.status, MTRL_RUN_FINISHED);
    TEST_EQ_STR(run.config_hash, "00ab");
    TEST_EQ_STR(run.git_rev, "deadbeef");
    TEST_CHECK(run.host[0] != '\0');
    TEST_CHECK(run.started > 1e9 && run.ended >= run.started);
    TEST_EQ_STR(config, "[model]\npreset = tiny\n");
    free(config);
    TEST_EQ_INT(mtrl_store_run_get(s, 12345, &run, NULL, &err), MTRL_ERR_NOTFOUND);

    mtrl_store_run *runs = NULL;
    size_t nr = 0;
    TEST_EQ_INT(mtrl_store_runs(s, &runs, &nr, &err), MTRL_OK);
    TEST_EQ_INT(nr, 1);
    if (nr) TEST_EQ_INT(runs[0].id, run1_);
    free(runs);

    char **names = NULL;
    size_t nn = 0;
    TEST_EQ_INT(mtrl_store_metric_names(s, run1_, &names, &nn, &err), MTRL_OK);
    TEST_EQ_INT(nn, 2);
    if (nn == 2) {
        TEST_EQ_STR(names[0], "loss");
        TEST_EQ_STR(names[1], "reward");
    }
    mtrl_store_strings_free(names, nn);

    int64_t *steps = NULL;
    double *vals = NULL;
    size_t ns = 0;
    TEST_EQ_INT(mtrl_store_metric_series(s, run1_, "reward", &steps, &vals, &ns, &err), MTRL_OK);
    TEST_EQ_INT(ns, 20);
    if (ns == 20) {
        TEST_EQ_INT(steps[0], 0);
        TEST_EQ_INT(steps[19], 19);
        TEST_NEAR(vals[3], 0.3, 1e-12);
        TEST_CHECK(isnan(vals[7]));
    }
    free(steps);
    free(vals);
    TEST_EQ_INT(mtrl_store_metric_series(s, run1_, "loss", &steps, &vals, &ns, &err), MTRL_OK);
    TEST_EQ_INT(ns, 21);
    free(steps);
    free(vals);

    mtrl_store_episode e;
    TEST_EQ_INT(mtrl_store_episode_get(s, run1_, ep_ok_.episode_id, &e, &err), MTRL_OK);
    TEST_EQ_INT(e.id, ep_ok_.episode_id);
    TEST_EQ_INT(e.group_id, ep_ok_.group_id);
    TEST_EQ_INT(e.seed, ep_ok_.task_seed);
    TEST_EQ_INT(e.actor, ep_ok_.actor_id);
    TEST_EQ_INT(e.incarnation, ep_ok_.incarnation);
    TEST_EQ_STR(e.env, ep_ok_.env);
    TEST_EQ_INT(e.status, MTRL_EP_COMPLETE);
    TEST_NEAR(e.reward, ep_ok_.reward, 0);
    TEST_EQ_INT(e.tokens, 300);
    TEST_EQ_INT(e.model_tokens, ep_ok_.n_model);
    TEST_EQ_INT(e.tool_calls, 3);
    TEST_EQ_INT(e.version_min, ep_ok_.version_min);
    TEST_EQ_INT(e.version_max, ep_ok_.version_max);
    TEST_EQ_STR(e.traj_path, "runs/traj.bin");
    TEST_EQ_INT(e.traj_offset, 18234);
    TEST_EQ_INT(e.digest, mtrl_traj_digest_compute(&ep_ok_));
    TEST_NEAR(e.started, ep_ok_.start_wall, 0);
    TEST_NEAR(e.ended, ep_ok_.end_wall, 0);
    TEST_EQ_INT(e.step, 12);
    TEST_EQ_INT(mtrl_store_episode_get(s, run1_, ep_bad_.episode_id, &e, &err), MTRL_OK);
    TEST_EQ_INT(e.status, MTRL_EP_REJECTED);
    TEST_EQ_STR(e.abort_reason, "digest mismatch: END says 1, tokens hash to 2");
    TEST_EQ_INT(e.traj_offset, -1);
    TEST_EQ_STR(e.traj_path, "");
    TEST_EQ_INT(e.step, -1);
    TEST_EQ_INT(mtrl_store_episode_get(s, run1_, 42, &e, &err), MTRL_ERR_NOTFOUND);
    TEST_CONTAINS(err.msg, "no episode 42 in run");

    int64_t counts[MTRL_EP_REJECTED + 1];
    TEST_EQ_INT(mtrl_store_episode_counts(s, run1_, counts, &err), MTRL_OK);
    TEST_EQ_INT(counts[MTRL_EP_COMPLETE], 1);
    TEST_EQ_INT(counts[MTRL_EP_REJECTED], 1);
    TEST_EQ_INT(counts[MTRL_EP_ABORTED], 0);

    mtrl_store_checkpoint *ck = NULL;
    size_t nc = 0;
    TEST_EQ_INT(mtrl_store_checkpoints(s, run1_, &ck, &nc, &err), MTRL_OK);
    TEST_EQ_INT(nc, 2);
    if (nc == 2) {
        TEST_EQ_INT(ck[0].step, 10);
        TEST_EQ_STR(ck[1].path, "runs/ckpt-20.bin");
        TEST_EQ_STR(ck[1].digest, "cd34");
        TEST_EQ_INT(ck[1].version, 20);
    }
    free(ck);
    TEST_EQ_INT(sql_int(s, "SELECT count(*) FROM experts WHERE run = 1"), 20 * 8);
    char buf[64];
    sql_text(s, "SELECT value FROM params WHERE key = 'learner.lr'", buf, sizeof buf);
    TEST_EQ_STR(buf, "3e-4");
    // The tool-call rows carry sizes, not payloads.
    TEST_EQ_INT(sql_int(s, "SELECT sum(bytes_in) FROM tool_calls"),
                (int64_t)(ep_ok_.tools[0].args_len + ep_ok_.tools[1].args_len + ep_ok_.tools[2].args_len));
    mtrl_store_close(s);
}

// A writer that dies (here: _exit without closing) leaves its run 'running'; the next writer
// marks it failed and says why in events.
static void test_stale_run(void) {
    fflush(NULL);
    pid_t child = fork();
    if (child == 0) {
        mtrl_store *c = NULL;
        mtrl_error e2;
        int64_t id = 0;
        mtrl_store_run_info info = {.name = "crashy"};
        if (mtrl_store_open(&c, db_, 0, &e2) != MTRL_OK) _exit(2);
        if (mtrl_store_run_create(c, &info, &id, &e2) != MTRL_OK) _exit(3);
        _exit(0); // no close: the lock goes with the process, the run stays 'running'
    }
    int ws = 0;
    waitpid(child, &ws, 0);
    TEST_CHECKF(WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "child writer failed (%d)", WEXITSTATUS(ws));
    mtrl_store *s = NULL;
    mtrl_error err;
    TEST_EQ_INT(mtrl_store_open(&s, db_, 1, &err), MTRL_OK); // a reader changes nothing
    if (s) {
        TEST_EQ_INT(sql_int(s, "SELECT count(*) FROM runs WHERE name = 'crashy' AND status = 'running'"), 1);
        mtrl_store_close(s);
    }
    TEST_EQ_INT(mtrl_store_open(&s, db_, 0, &err), MTRL_OK);
    if (!s) return;
    TEST_EQ_INT(sql_int(s, "SELECT count(*) FROM runs WHERE status = 'running'"), 0);
    TEST_EQ_INT(sql_int(s, "SELECT count(*) FROM runs WHERE name = 'crashy' AND status = 'failed' AND ended > 0"), 1);
    TEST_EQ_INT(sql_int(s, "SELECT count(*) FROM runs WHERE id = 1 AND status = 'finished'"), 1);
    TEST_EQ_INT(sql_int(s, "SELECT count(*) FROM events e JOIN runs r ON e.run = r.id WHERE r.name = 'crashy' "
                           "AND e.level = 'warn' AND e.message LIKE '%left ''running''%marked failed%'"),
                1);
    mtrl_store_run *runs = NULL;
    size_t nr = 0;
    TEST_EQ_INT(mtrl_store_runs(s, &runs, &nr, &err), MTRL_OK);
    TEST_EQ_INT(nr, 2);
    if (nr == 2) TEST_EQ_INT(runs[1].status, MTRL_RUN_FAILED);
    free(runs);
    mtrl_store_close(s);
}

// A writer in another process holds `path` (with one run 'running') until the test writes to
// its pipe; returns its pid, -1 when it could not start. *go is the pipe's write end.
static pid_t hold_writer(const char *path, int *go) {
    int p[2], ready[2];
    if (pipe(p) || pipe(ready)) return -1;
    fflush(NULL);
    pid_t child = fork();
    if (child == 0) {
        close(p[1]);
        close(ready[0]);
        mtrl_store *c = NULL;
        mtrl_error e2;
        int64_t id = 0;
        mtrl_store_run_info info = {.name = "live"};
        char ok = mtrl_store_open(&c, path, 0, &e2) == MTRL_OK && mtrl_store_run_create(c, &info, &id, &e2) == MTRL_OK;
        if (write(ready[1], &ok, 1) != 1) _exit(3);
        char b;
        if (read(p[0], &b, 1) < 0) _exit(4);
        mtrl_store_close(c);
        _exit(ok ? 0 : 2);
    }
    close(p[0]);
    close(ready[1]);
    char ok = 0;
    if (read(ready[0], &ok, 1) != 1) ok = 0;
    close(ready[0]);
    *go = p[1];
    TEST_CHECKF(ok, "the holding writer could not open %s", path);
    return child;
}

static void release_writer(pid_t child, int go) {
    if (write(go, "x", 1) != 1) fprintf(stderr, "release_writer: write failed\n");
    close(go);
    int ws = 0;
    waitpid(child, &ws, 0);
    TEST_CHECK(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
}

static void refused_by(const char *live, const char *other) {
    mtrl_store *s = NULL;
    mtrl_error err;
    TEST_EQ_INT(mtrl_store_open(&s, other, 0, &err), MTRL_ERR_STATE);
    TEST_CONTAINS(err.msg, "another process");
    if (s) mtrl_store_close(s);
    // The live run was not touched.
    TEST_EQ_INT(mtrl_store_open(&s, live, 1, &err), MTRL_OK);
    if (s) {
        TEST_EQ_INT(sql_int(s, "SELECT count(*) FROM runs WHERE name = 'live' AND status = 'running'"), 1);
        TEST_EQ_INT(sql_int(s, "SELECT count(*) FROM runs WHERE status = 'failed'"), 0);
        mtrl_store_close(s);
    }
}

static void test_lock_real_file(void) {
    char live[400], link[400], dotted[400], real1[4096], real2[4096];
    snprintf(live, sizeof live, "%s/live.db", dir_);
    snprintf(link, sizeof link, "%s/link.db", dir_);
    snprintf(dotted, sizeof dotted, "%s/./live.db", dir_);
    int go;
    pid_t w = hold_writer(live, &go);
    if (w < 0) return;
    TEST_CHECK(symlink("live.db", link) == 0);
    TEST_EQ_INT(mtrl_path_real(link, real1, sizeof real1), 0);
    TEST_EQ_INT(mtrl_path_real(dotted, real2, sizeof real2), 0);
    TEST_EQ_STR(real1, real2);
    refused_by(live, link);
    refused_by(live, dotted);
    release_writer(w, go);
    // A dangling symlink to a database that does not exist yet: the writer creates it through
    // the link; the target's own name is then locked.
    char fresh[400], dangling[400];
    snprintf(fresh, sizeof fresh, "%s/fresh.db", dir_);
    snprintf(dangling, sizeof dangling, "%s/dangling.db", dir_);
    TEST_CHECK(symlink("fresh.db", dangling) == 0);
    TEST_EQ_INT(mtrl_path_real(dangling, real1, sizeof real1), 0);
    TEST_EQ_INT(mtrl_path_real(fresh, real2, sizeof real2), 0);
    TEST_EQ_STR(real1, real2);
    w = hold_writer(dangling, &go);
    if (w < 0) return;
    refused_by(fresh, fresh);
    release_writer(w, go);
    // The holder is gone: the link opens for writing again.
    mtrl_store *s = NULL;
    mtrl_error err;
    TEST_EQ_INT(mtrl_store_open(&s, link, 0, &err), MTRL_OK);
    mtrl_store_close(s);
}

// A store of schema 1 (no episodes.trained_step) is migrated by the next writer; its rows stay.
static void test_migrate_v1(void) {
    char p[400];
    mtrl_error err;
    mtrl_store *s = NULL;
    snprintf(p, sizeof p, "%s/v1.db", dir_);
    TEST_EQ_INT(mtrl_store_open(&s, p, 0, &err), MTRL_OK);
    int64_t run = 0;
    mtrl_store_run_info info = {.name = "old"};
    if (s) TEST_EQ_INT(mtrl_store_run_create(s, &info, &run, &err), MTRL_OK);
    mtrl_store_close(s);
    sqlite3 *db = NULL;
    sqlite3_open(p, &db);
    TEST_EQ_INT(sqlite3_exec(db, "ALTER TABLE episodes DROP COLUMN trained_step; PRAGMA user_version = 1", NULL, NULL, NULL),
                SQLITE_OK);
    sqlite3_close(db);
    s = NULL;
    TEST_EQ_INT(mtrl_store_open(&s, p, 0, &err), MTRL_OK);
    if (s) {
        uint64_t ids[1] = {7};
        TEST_EQ_INT(mtrl_store_episodes_trained(s, run, 3, ids, 1, &err), MTRL_OK);
        TEST_EQ_INT(mtrl_store_max_trained_step(s, run), -1); // no episode 7: nothing marked
    }
    mtrl_store_close(s);
    TEST_EQ_INT(test_query_int(p, "PRAGMA user_version"), 2);
    TEST_EQ_INT(test_query_int(p, "SELECT count(*) FROM pragma_table_info('episodes') WHERE name = 'trained_step'"), 1);
    TEST_EQ_INT(test_query_int(p, "SELECT count(*) FROM runs WHERE name = 'old'"), 1);
}

static void test_foreign_and_newer(void) {
    char p[400];
    mtrl_error err;
    mtrl_store *s = NULL;
    // A newer schema.
    snprintf(p, sizeof p, "%s/newer.db", dir_);
    sqlite3 *db = NULL;
    sqlite3_open(p, &db);
    sqlite3_exec(db, "PRAGMA application_id = 1297371724; PRAGMA user_version = 3; CREATE TABLE runs(id)", NULL, NULL,
                 NULL);
    sqlite3_close(db);
    TEST_EQ_INT(mtrl_store_open(&s, p, 0, &err), MTRL_ERR_MISMATCH);
    TEST_CONTAINS(err.msg, "schema version 3 is newer than this mtrl understands (2)");
    TEST_EQ_INT(mtrl_store_open(&s, p, 1, &err), MTRL_ERR_MISMATCH);
    // Somebody else's database.
    snprintf(p, sizeof p, "%s/other.db", dir_);
    sqlite3_open(p, &db);
    sqlite3_exec(db, "CREATE TABLE photos(id, path)", NULL, NULL, NULL);
    sqlite3_close(db);
    TEST_EQ_INT(mtrl_store_open(&s, p, 0, &err), MTRL_ERR_MISMATCH);
    TEST_CONTAINS(err.msg, "not an mtrl run store");
    // Not a database at all.
    snprintf(p, sizeof p, "%s/junk.db", dir_);
    FILE *f = fopen(p, "wb");
    for (int i = 0; i < 200; i++) fputs("this is not sqlite ", f);
    fclose(f);
    TEST_CHECK(mtrl_store_open(&s, p, 0, &err) != MTRL_OK);
    TEST_CONTAINS(err.msg, "junk.db");
    // Missing, read-only.
    snprintf(p, sizeof p, "%s/missing.db", dir_);
    TEST_EQ_INT(mtrl_store_open(&s, p, 1, &err), MTRL_ERR_NOTFOUND);
    TEST_CHECK(s == NULL);
}

static void test_cli(void) {
    if (system("command -v sqlite3 >/dev/null 2>&1") != 0) {
        printf("SKIP part: no sqlite3 shell on PATH; not checking that it can read the store\n");
        return;
    }
    char cmd[600];
    snprintf(cmd, sizeof cmd, "sqlite3 -readonly '%s' 'select count(*) from episodes' 2>&1", db_);
    FILE *p = popen(cmd, "r");
    TEST_CHECK(p != NULL);
    if (!p) return;
    char out[256] = "";
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = '\0';
    int rc = pclose(p);
    TEST_EQ_INT(rc, 0);
    TEST_EQ_STR(out, "2\n");
    snprintf(cmd, sizeof cmd, "sqlite3 -readonly '%s' \"select status from runs order by id\" 2>&1", db_);
    p = popen(cmd, "r");
    n = fread(out, 1, sizeof out - 1, p);
    out[n] = '\0';
    pclose(p);
    TEST_EQ_STR(out, "finished\nfailed\n");
}

int main(void) {
    snprintf(dir_, sizeof dir_, "/tmp/mtrl_store_XXXXXX");
    if (!mkdtemp(dir_)) {
        perror("mkdtemp");
        return 1;
    }
    snprintf(db_, sizeof db_, "%s/runs.db", dir_);
    test_schema_and_writes();
    test_queries();
    test_stale_run();
    test_lock_real_file();
    test_foreign_and_newer();
    test_migrate_v1();
    test_cli();
    mtrl_traj_free(&ep_ok_);
    mtrl_traj_free(&ep_bad_);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir_);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir_);
    return test_report();
}
