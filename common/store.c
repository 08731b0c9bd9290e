// store.c: the SQLite run store (see store.h).
#include "common/store.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#include "common/check.h"
#include "common/fsutil.h"
#include "common/hash.h"
#include "common/log.h"
#include "common/timeutil.h"
#include "common/version.h"

// ---- schema ----------------------------------------------------------------------------------

static const char *const schema_v1_ =
    "CREATE TABLE runs ("
    "  id INTEGER PRIMARY KEY,"
    "  name TEXT NOT NULL,"
    "  status TEXT NOT NULL CHECK (status IN ('running','finished','failed','killed')),"
    "  config TEXT, config_hash TEXT, started REAL NOT NULL, ended REAL, host TEXT, git_rev TEXT);"
    "CREATE TABLE params ("
    "  run INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,"
    "  key TEXT NOT NULL, value TEXT, PRIMARY KEY (run, key));"
    "CREATE TABLE metrics ("
    "  run INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,"
    "  step INTEGER NOT NULL, name TEXT NOT NULL, value REAL, wall_time REAL NOT NULL,"
    "  PRIMARY KEY (run, name, step));"
    "CREATE TABLE episodes ("
    "  run INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,"
    "  id INTEGER NOT NULL, group_id INTEGER, actor INTEGER, incarnation INTEGER, env TEXT, seed INTEGER,"
    "  status TEXT NOT NULL CHECK (status IN ('open','complete','truncated','aborted','rejected')),"
    "  reward REAL, tokens INTEGER, model_tokens INTEGER, tool_calls INTEGER,"
    "  version_min INTEGER, version_max INTEGER, traj_path TEXT, traj_offset INTEGER, digest TEXT,"
    "  started REAL, ended REAL, abort_reason TEXT, step INTEGER, trained_step INTEGER,"
    "  PRIMARY KEY (run, id));"
    "CREATE INDEX episodes_run_status ON episodes(run, status);"
    "CREATE INDEX episodes_run_step ON episodes(run, step);"
    "CREATE INDEX episodes_run_group ON episodes(run, group_id);"
    "CREATE TABLE tool_calls ("
    "  run INTEGER NOT NULL, episode INTEGER NOT NULL, turn INTEGER, name TEXT, latency REAL,"
    "  status INTEGER, bytes_in INTEGER, bytes_out INTEGER, error TEXT,"
    "  FOREIGN KEY (run, episode) REFERENCES episodes(run, id) ON DELETE CASCADE);"
    "CREATE INDEX tool_calls_episode ON tool_calls(run, episode);"
    "CREATE INDEX tool_calls_name ON tool_calls(run, name);"
    "CREATE TABLE experts ("
    "  run INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,"
    "  step INTEGER NOT NULL, layer INTEGER NOT NULL, expert INTEGER NOT NULL, load REAL, bias REAL,"
    "  PRIMARY KEY (run, step, layer, expert));"
    "CREATE TABLE checkpoints ("
    "  run INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,"
    "  step INTEGER NOT NULL, version INTEGER, path TEXT NOT NULL, digest TEXT,"
    "  PRIMARY KEY (run, step));"
    "CREATE TABLE events ("
    "  run INTEGER REFERENCES runs(id) ON DELETE CASCADE,"
    "  time REAL NOT NULL, level TEXT NOT NULL, message TEXT NOT NULL);"
    "CREATE INDEX events_run_time ON events(run, time);";

// ---- prepared statements ---------------------------------------------------------------------

enum {
    Q_RUN_INSERT,
    Q_RUN_STATUS,
    Q_PARAM,
    Q_METRIC,
    Q_EPISODE,
    Q_TOOL,
    Q_EXPERT,
    Q_CHECKPOINT,
    Q_EVENT,
    Q_RUN_LATEST,
    Q_RUN_GET,
    Q_RUNS,
    Q_EPISODE_GET,
    Q_METRIC_NAMES,
    Q_METRIC_SERIES,
    Q_EPISODE_COUNTS,
    Q_CHECKPOINTS,
    Q_TRAINED,
    Q_UNTRAIN,
    Q_MAX_TRAINED,
    Q_COUNT_
};

static const char *const sql_[Q_COUNT_] = {
    [Q_RUN_INSERT] = "INSERT INTO runs(name, status, config, config_hash, started, host, git_rev) "
                     "VALUES (?1, 'running', ?2, ?3, ?4, ?5, ?6)",
    [Q_RUN_STATUS] = "UPDATE runs SET status = ?2, ended = ?3 WHERE id = ?1",
    [Q_PARAM] = "INSERT OR REPLACE INTO params(run, key, value) VALUES (?1, ?2, ?3)",
    [Q_METRIC] = "INSERT OR REPLACE INTO metrics(run, step, name, value, wall_time) VALUES (?1, ?2, ?3, ?4, ?5)",
    [Q_EPISODE] = "INSERT INTO episodes(run, id, group_id, actor, incarnation, env, seed, status, reward, tokens, "
                  "model_tokens, tool_calls, version_min, version_max, traj_path, traj_offset, digest, started, "
                  "ended, abort_reason, step) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, "
                  "?15, ?16, ?17, ?18, ?19, ?20, ?21)",
    [Q_TOOL] = "INSERT INTO tool_calls(run, episode, turn, name, latency, status, bytes_in, bytes_out, error) "
               "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
    [Q_EXPERT] = "INSERT OR REPLACE INTO experts(run, step, layer, expert, load, bias) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    [Q_CHECKPOINT] = "INSERT OR REPLACE INTO checkpoints(run, step, version, path, digest) VALUES (?1, ?2, ?3, ?4, ?5)",
    [Q_EVENT] = "INSERT INTO events(run, time, level, message) VALUES (?1, ?2, ?3, ?4)",
    [Q_RUN_LATEST] = "SELECT max(id) FROM runs",
    [Q_RUN_GET] = "SELECT id, name, status, config_hash, started, ended, host, git_rev, config FROM runs WHERE id = ?1",
    [Q_RUNS] = "SELECT id, name, status, config_hash, started, ended, host, git_rev, NULL FROM runs ORDER BY id",
    [Q_EPISODE_GET] = "SELECT run, id, group_id, actor, incarnation, env, seed, status, reward, tokens, model_tokens, "
                      "tool_calls, version_min, version_max, traj_path, traj_offset, digest, started, ended, "
                      "abort_reason, step FROM episodes WHERE run = ?1 AND id = ?2",
    [Q_METRIC_NAMES] = "SELECT DISTINCT name FROM metrics WHERE run = ?1 ORDER BY name",
    [Q_METRIC_SERIES] = "SELECT step, value FROM metrics WHERE run = ?1 AND name = ?2 ORDER BY step",
    [Q_EPISODE_COUNTS] = "SELECT status, count(*) FROM episodes WHERE run = ?1 GROUP BY status",
    [Q_CHECKPOINTS] = "SELECT step, version, path, digest FROM checkpoints WHERE run = ?1 ORDER BY step",
    [Q_TRAINED] = "UPDATE episodes SET trained_step = ?3 WHERE run = ?1 AND id = ?2",
    [Q_UNTRAIN] = "UPDATE episodes SET trained_step = NULL WHERE run = ?1 AND trained_step > ?2",
    [Q_MAX_TRAINED] = "SELECT max(trained_step) FROM episodes WHERE run = ?1",
};

struct mtrl_store {
    sqlite3 *db;
    char *path;
    int readonly;
    int lock_fd;      // flock'ed "<db>.lock" while writing; -1 for readers
    int in_batch;     // inside mtrl_store_begin
    sqlite3_stmt *q[Q_COUNT_];
};

const char *mtrl_run_status_name(mtrl_run_status s) {
    switch (s) {
    case MTRL_RUN_RUNNING: return "running";
    case MTRL_RUN_FINISHED: return "finished";
    case MTRL_RUN_FAILED: return "failed";
    case MTRL_RUN_KILLED: return "killed";
    }
    return "unknown";
}

int mtrl_run_status_parse(const char *name) {
    if (!name) return -1;
    for (int s = MTRL_RUN_RUNNING; s <= MTRL_RUN_KILLED; s++)
        if (strcmp(name, mtrl_run_status_name((mtrl_run_status)s)) == 0) return s;
    return -1;
}

static mtrl_status code_of_(int rc) {
    switch (rc & 0xff) {
    case SQLITE_BUSY:
    case SQLITE_LOCKED: return MTRL_ERR_TIMEOUT;
    case SQLITE_CONSTRAINT: return MTRL_ERR_STATE;
    case SQLITE_NOMEM: return MTRL_ERR_NOMEM;
    case SQLITE_CORRUPT:
    case SQLITE_NOTADB: return MTRL_ERR_FORMAT;
    default: return MTRL_ERR_IO;
    }
}

static mtrl_status sqlerr_(mtrl_store *s, int rc, mtrl_error *err, const char *what) {
    const char *msg = s->db ? sqlite3_errmsg(s->db) : sqlite3_errstr(rc);
    return mtrl_error_set(err, code_of_(rc), "%s: %s: %s", s->path, what, msg);
}

static mtrl_status exec_(mtrl_store *s, const char *sql, mtrl_error *err, const char *what) {
    char *msg = NULL;
    int rc = sqlite3_exec(s->db, sql, NULL, NULL, &msg);
    if (rc == SQLITE_OK) return MTRL_OK;
    mtrl_status st = mtrl_error_set(err, code_of_(rc), "%s: %s: %s", s->path, what, msg ? msg : sqlite3_errstr(rc));
    sqlite3_free(msg);
    return st;
}

// The prepared statement for id, reset and ready to bind; NULL with err set on failure.
static sqlite3_stmt *stmt_(mtrl_store *s, int id, mtrl_error *err) {
    if (!s->q[id]) {
        int rc = sqlite3_prepare_v3(s->db, sql_[id], -1, SQLITE_PREPARE_PERSISTENT, &s->q[id], NULL);
        if (rc != SQLITE_OK) {
            sqlerr_(s, rc, err, "prepare");
            s->q[id] = NULL;
            return NULL;
        }
    }
    sqlite3_reset(s->q[id]);
    sqlite3_clear_bindings(s->q[id]);
    return s->q[id];
}

// Steps a write statement to completion.
static mtrl_status run_(mtrl_store *s, sqlite3_stmt *q, mtrl_error *err, const char *what) {
    int rc = sqlite3_step(q);
    mtrl_status st = MTRL_OK;
    if (rc != SQLITE_DONE) st = sqlerr_(s, rc, err, what);
    sqlite3_reset(q);
    return st;
}

static int64_t pragma_int_(mtrl_store *s, const char *sql) {
    sqlite3_stmt *q = NULL;
    int64_t v = -1;
    if (sqlite3_prepare_v2(s->db, sql, -1, &q, NULL) == SQLITE_OK && sqlite3_step(q) == SQLITE_ROW)
        v = sqlite3_column_int64(q, 0);
    sqlite3_finalize(q);
    return v;
}

static void bind_text_(sqlite3_stmt *q, int i, const char *v) {
    if (v) sqlite3_bind_text(q, i, v, -1, SQLITE_TRANSIENT);
    else sqlite3_bind_null(q, i);
}

static mtrl_status writable_(mtrl_store *s, mtrl_error *err) {
    if (s->readonly)
        return mtrl_error_set(err, MTRL_ERR_STATE, "%s: the run store was opened read-only", s->path);
    return MTRL_OK;
}

// A write outside a batch gets its own BEGIN IMMEDIATE ... COMMIT.
static mtrl_status txn_enter_(mtrl_store *s, int *own, mtrl_error *err) {
    *own = 0;
    mtrl_status st = writable_(s, err);
    // Inside a batch, or inside one of our own multi-row writes: join that transaction.
    if (st || s->in_batch || !sqlite3_get_autocommit(s->db)) return st;
    st = exec_(s, "BEGIN IMMEDIATE", err, "begin");
    if (!st) *own = 1;
    return st;
}

static mtrl_status txn_leave_(mtrl_store *s, int own, mtrl_status st, mtrl_error *err) {
    if (!own) return st;
    if (st) {
        sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
        return st;
    }
    st = exec_(s, "COMMIT", err, "commit");
    if (st) sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
    return st;
}

// ---- open / close ----------------------------------------------------------------------------

// The lock is named after the database's real path (mtrl_path_real), not the name it was
// opened by: a symlink, "./runs.db" or an absolute spelling of the same file reach the same
// lock, so a second learner cannot slip past it and mark the live run failed. (SQLite itself
// resolves symlinks, so its -wal and -shm files sit beside the real file too.)
static mtrl_status lock_(mtrl_store *s, mtrl_error *err) {
    char real[4096], lp[4200];
    if (mtrl_path_real(s->path, real, sizeof real) != 0)
        return mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot resolve the run store's path: %s", s->path, strerror(errno));
    snprintf(lp, sizeof lp, "%s.lock", real);
    int fd = open(lp, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot open the lock file: %s", lp, strerror(errno));
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        char pid[32] = "";
        ssize_t k = pread(fd, pid, sizeof pid - 1, 0);
        pid[k > 0 ? k : 0] = '\0';
        pid[strcspn(pid, "\n")] = '\0';
        close(fd);
        if (e == EWOULDBLOCK)
            return mtrl_error_set(err, MTRL_ERR_STATE,
                                  "%s: another process%s%s%s is writing this run store (it holds %s); only one "
                                  "learner may write a run store - stop it, or use another --db",
                                  s->path, pid[0] ? " (pid " : "", pid, pid[0] ? ")" : "", lp);
        return mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot lock: %s", lp, strerror(e));
    }
    // Our pid, for the message a refused second writer prints.
    char pid[32];
    int n = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, (size_t)n, 0) != n) {
        // The pid is only for messages; the lock itself is held.
    }
    s->lock_fd = fd;
    return MTRL_OK;
}

static mtrl_status create_schema_(mtrl_store *s, mtrl_error *err) {
    mtrl_status st = exec_(s, "BEGIN IMMEDIATE", err, "begin schema");
    if (st) return st;
    // Check again inside the transaction: the file may have been set up since we looked.
    if (pragma_int_(s, "PRAGMA user_version") == 0) {
        char sql[128];
        st = exec_(s, schema_v1_, err, "create schema");
        snprintf(sql, sizeof sql, "PRAGMA application_id = %d; PRAGMA user_version = %d", MTRL_STORE_APP_ID,
                 MTRL_STORE_SCHEMA);
        if (!st) st = exec_(s, sql, err, "set schema version");
    }
    if (st) {
        sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
        return st;
    }
    return exec_(s, "COMMIT", err, "commit schema");
}

// Version and identity checks shared by readers and writers.
static mtrl_status check_schema_(mtrl_store *s, int64_t *version, mtrl_error *err) {
    int64_t app = pragma_int_(s, "PRAGMA application_id");
    int64_t ver = pragma_int_(s, "PRAGMA user_version");
    int64_t tables = pragma_int_(s, "SELECT count(*) FROM sqlite_master");
    if (app < 0 || ver < 0 || tables < 0)
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: cannot read the database header: %s", s->path,
                              sqlite3_errmsg(s->db));
    if (app != MTRL_STORE_APP_ID && (app != 0 || ver != 0 || tables != 0))
        return mtrl_error_set(err, MTRL_ERR_MISMATCH,
                              "%s: not an mtrl run store (application_id 0x%08llx, user_version %lld); "
                              "pass another --db", s->path, (unsigned long long)app, (long long)ver);
    if (ver > MTRL_STORE_SCHEMA)
        return mtrl_error_set(err, MTRL_ERR_MISMATCH,
                              "%s: run store schema version %lld is newer than this mtrl understands (%d); "
                              "use a newer mtrl", s->path, (long long)ver, MTRL_STORE_SCHEMA);
    *version = ver;
    return MTRL_OK;
}

// Runs left 'running' while the lock was free belong to a writer that died.
static mtrl_status fail_stale_runs_(mtrl_store *s, mtrl_error *err) {
    sqlite3_stmt *q = NULL;
    int rc = sqlite3_prepare_v2(s->db, "SELECT id, name FROM runs WHERE status = 'running' ORDER BY id", -1, &q, NULL);
    if (rc != SQLITE_OK) return sqlerr_(s, rc, err, "find stale runs");
    int64_t ids[64];
    int n = 0, more = 0;
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        if (n < 64) ids[n++] = sqlite3_column_int64(q, 0);
        else more = 1;
    }
    sqlite3_finalize(q);
    if (n == 0) return MTRL_OK;
    int own = 0;
    mtrl_status st = txn_enter_(s, &own, err);
    if (st) return st;
    double now = mtrl_time_wall();
    for (int i = 0; i < n && !st; i++) {
        sqlite3_stmt *u = stmt_(s, Q_RUN_STATUS, err);
        if (!u) {
            st = MTRL_ERR_IO;
            break;
        }
        sqlite3_bind_int64(u, 1, ids[i]);
        sqlite3_bind_text(u, 2, "failed", -1, SQLITE_STATIC);
        sqlite3_bind_double(u, 3, now);
        st = run_(s, u, err, "mark stale run failed");
        if (st) break;
        char msg[256];
        snprintf(msg, sizeof msg,
                 "run %lld was left 'running' by a writer that exited without finishing it; marked failed",
                 (long long)ids[i]);
        LOG_WARN("%s: %s", s->path, msg);
        st = mtrl_store_event_log(s, ids[i], MTRL_LOG_WARN, msg, err);
    }
    st = txn_leave_(s, own, st, err);
    // More than 64 at once: loop (rare; each round fixes 64).
    if (!st && more) return fail_stale_runs_(s, err);
    return st;
}

mtrl_status mtrl_store_open(mtrl_store **out, const char *path, int readonly, mtrl_error *err) {
    *out = NULL;
    mtrl_store *s = xcalloc(1, sizeof *s);
    s->path = xstrdup(path);
    s->readonly = readonly;
    s->lock_fd = -1;
    mtrl_status st = MTRL_OK;
    int rc;
    if (readonly) {
        if (access(path, F_OK) != 0) {
            st = mtrl_error_set(err, MTRL_ERR_NOTFOUND, "%s: no such run store", path);
            goto fail;
        }
        rc = sqlite3_open_v2(path, &s->db, SQLITE_OPEN_READONLY, NULL);
    } else {
        st = lock_(s, err);
        if (st) goto fail;
        rc = sqlite3_open_v2(path, &s->db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, NULL);
    }
    if (rc != SQLITE_OK) {
        st = sqlerr_(s, rc, err, "open");
        goto fail;
    }
    sqlite3_extended_result_codes(s->db, 1);
    sqlite3_busy_timeout(s->db, 5000);
    int64_t version = 0;
    st = check_schema_(s, &version, err);
    if (st) goto fail;
    if (readonly) {
        if (version == 0) {
            st = mtrl_error_set(err, MTRL_ERR_MISMATCH, "%s: an empty database, not an mtrl run store yet", path);
            goto fail;
        }
        st = exec_(s, "PRAGMA query_only = ON", err, "set pragmas");
        if (st) goto fail;
        *out = s;
        return MTRL_OK;
    }
    // WAL first: it is a property of the file and must be set outside a transaction.
    sqlite3_stmt *q = NULL;
    const char *mode = NULL;
    if (sqlite3_prepare_v2(s->db, "PRAGMA journal_mode = WAL", -1, &q, NULL) == SQLITE_OK &&
        sqlite3_step(q) == SQLITE_ROW)
        mode = (const char *)sqlite3_column_text(q, 0);
    int wal = mode && strcmp(mode, "wal") == 0;
    sqlite3_finalize(q);
    if (!wal) {
        st = mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot switch to WAL mode (%s); is it on a network file system?",
                            path, sqlite3_errmsg(s->db));
        goto fail;
    }
    st = exec_(s, "PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON; PRAGMA journal_size_limit = 67108864",
               err, "set pragmas");
    if (st) goto fail;
    if (version == 0) {
        st = create_schema_(s, err);
        if (st) goto fail;
    }
    // Migrations from older schema versions, one transaction each.
    if (version == 1) {
        // 2: episodes.trained_step (issue 28, item 11); rows of version 1 say NULL, not known
        st = exec_(s, "BEGIN IMMEDIATE; ALTER TABLE episodes ADD COLUMN trained_step INTEGER; PRAGMA user_version = 2; COMMIT",
                   err, "migrate the schema to version 2");
        if (st) {
            sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
            goto fail;
        }
    }
    st = fail_stale_runs_(s, err);
    if (st) goto fail;
    *out = s;
    return MTRL_OK;
fail:
    mtrl_store_close(s);
    return st;
}

void mtrl_store_close(mtrl_store *s) {
    if (!s) return;
    if (s->in_batch) {
        LOG_WARN("%s: closing with an open batch; its rows are rolled back", s->path);
        sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
    }
    for (int i = 0; i < Q_COUNT_; i++) sqlite3_finalize(s->q[i]);
    if (s->db) sqlite3_close(s->db);
    if (s->lock_fd >= 0) close(s->lock_fd); // releases the flock; the file stays (removing it races)
    free(s->path);
    free(s);
}

const char *mtrl_store_path(const mtrl_store *s) { return s->path; }
struct sqlite3 *mtrl_store_sqlite(mtrl_store *s) { return s->db; }

// ---- batches ---------------------------------------------------------------------------------

mtrl_status mtrl_store_begin(mtrl_store *s, mtrl_error *err) {
    mtrl_status st = writable_(s, err);
    if (st) return st;
    if (s->in_batch) return mtrl_error_set(err, MTRL_ERR_STATE, "%s: a batch is already open", s->path);
    st = exec_(s, "BEGIN IMMEDIATE", err, "begin");
    if (!st) s->in_batch = 1;
    return st;
}

mtrl_status mtrl_store_commit(mtrl_store *s, mtrl_error *err) {
    if (!s->in_batch) return mtrl_error_set(err, MTRL_ERR_STATE, "%s: commit without a batch", s->path);
    mtrl_status st = exec_(s, "COMMIT", err, "commit");
    if (st) sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL); // never leave a half transaction open
    s->in_batch = 0;
    return st;
}

void mtrl_store_rollback(mtrl_store *s) {
    if (!s->in_batch) return;
    sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
    s->in_batch = 0;
}

mtrl_status mtrl_store_wal_checkpoint(mtrl_store *s, mtrl_error *err) {
    mtrl_status st = writable_(s, err);
    if (st) return st;
    int rc = sqlite3_wal_checkpoint_v2(s->db, NULL, SQLITE_CHECKPOINT_RESTART, NULL, NULL);
    if (rc != SQLITE_OK && rc != SQLITE_BUSY) return sqlerr_(s, rc, err, "wal checkpoint");
    return MTRL_OK;
}

// ---- writes ----------------------------------------------------------------------------------

// Runs one prepared single-row write in its own transaction unless a batch is open.
#define WRITE_BEGIN_(id)                                 \
    int own_ = 0;                                        \
    mtrl_status st_ = txn_enter_(s, &own_, err);         \
    if (st_) return st_;                                 \
    sqlite3_stmt *q = stmt_(s, (id), err);               \
    if (!q) return txn_leave_(s, own_, MTRL_ERR_IO, err);

#define WRITE_END_(what) return txn_leave_(s, own_, run_(s, q, err, (what)), err);

mtrl_status mtrl_store_run_create(mtrl_store *s, const mtrl_store_run_info *info, int64_t *run_id, mtrl_error *err) {
    char host[256] = "";
    if (!info->host) gethostname(host, sizeof host - 1);
    WRITE_BEGIN_(Q_RUN_INSERT);
    bind_text_(q, 1, info->name ? info->name : "unnamed");
    bind_text_(q, 2, info->config);
    bind_text_(q, 3, info->config_hash);
    sqlite3_bind_double(q, 4, info->started > 0 ? info->started : mtrl_time_wall());
    bind_text_(q, 5, info->host ? info->host : host);
    // The revision this binary was built from, unless the caller names one.
    bind_text_(q, 6, info->git_rev && info->git_rev[0] ? info->git_rev : mtrl_git_rev());
    mtrl_status st = run_(s, q, err, "create run");
    if (!st && run_id) *run_id = sqlite3_last_insert_rowid(s->db);
    return txn_leave_(s, own_, st, err);
}

mtrl_status mtrl_store_run_set_status(mtrl_store *s, int64_t run, mtrl_run_status status, mtrl_error *err) {
    WRITE_BEGIN_(Q_RUN_STATUS);
    sqlite3_bind_int64(q, 1, run);
    sqlite3_bind_text(q, 2, mtrl_run_status_name(status), -1, SQLITE_STATIC);
    if (status == MTRL_RUN_RUNNING) sqlite3_bind_null(q, 3);
    else sqlite3_bind_double(q, 3, mtrl_time_wall());
    mtrl_status st = run_(s, q, err, "set run status");
    if (!st && sqlite3_changes(s->db) == 0)
        st = mtrl_error_set(err, MTRL_ERR_NOTFOUND, "%s: no run %lld", s->path, (long long)run);
    return txn_leave_(s, own_, st, err);
}

mtrl_status mtrl_store_param_log(mtrl_store *s, int64_t run, const char *key, const char *value, mtrl_error *err) {
    WRITE_BEGIN_(Q_PARAM);
    sqlite3_bind_int64(q, 1, run);
    bind_text_(q, 2, key);
    bind_text_(q, 3, value);
    WRITE_END_("log param");
}

mtrl_status mtrl_store_metric_log(mtrl_store *s, int64_t run, int64_t step, const char *name, double value,
                                  double wall_time, mtrl_error *err) {
    WRITE_BEGIN_(Q_METRIC);
    sqlite3_bind_int64(q, 1, run);
    sqlite3_bind_int64(q, 2, step);
    bind_text_(q, 3, name);
    sqlite3_bind_double(q, 4, value); // SQLite stores NaN as NULL
    sqlite3_bind_double(q, 5, wall_time > 0 ? wall_time : mtrl_time_wall());
    WRITE_END_("log metric");
}

mtrl_status mtrl_store_expert_log(mtrl_store *s, int64_t run, int64_t step, int layer, int expert, double load,
                                  double bias, mtrl_error *err) {
    WRITE_BEGIN_(Q_EXPERT);
    sqlite3_bind_int64(q, 1, run);
    sqlite3_bind_int64(q, 2, step);
    sqlite3_bind_int(q, 3, layer);
    sqlite3_bind_int(q, 4, expert);
    sqlite3_bind_double(q, 5, load);
    sqlite3_bind_double(q, 6, bias);
    WRITE_END_("log expert");
}

mtrl_status mtrl_store_checkpoint_log(mtrl_store *s, int64_t run, int64_t step, uint32_t version, const char *path,
                                      const char *digest, mtrl_error *err) {
    WRITE_BEGIN_(Q_CHECKPOINT);
    sqlite3_bind_int64(q, 1, run);
    sqlite3_bind_int64(q, 2, step);
    sqlite3_bind_int64(q, 3, version);
    bind_text_(q, 4, path ? path : "");
    bind_text_(q, 5, digest);
    WRITE_END_("log checkpoint");
}

mtrl_status mtrl_store_episodes_trained(mtrl_store *s, int64_t run, int64_t step, const uint64_t *ids, size_t n,
                                        mtrl_error *err) {
    int own = 0;
    mtrl_status st = txn_enter_(s, &own, err);
    for (size_t i = 0; i < n && !st; i++) {
        sqlite3_stmt *q = stmt_(s, Q_TRAINED, err);
        if (!q) {
            st = MTRL_ERR_IO;
            break;
        }
        sqlite3_bind_int64(q, 1, run);
        sqlite3_bind_int64(q, 2, (int64_t)ids[i]);
        sqlite3_bind_int64(q, 3, step);
        st = run_(s, q, err, "mark episodes trained");
    }
    return txn_leave_(s, own, st, err);
}

mtrl_status mtrl_store_episodes_untrain_after(mtrl_store *s, int64_t run, int64_t step, int64_t *changed,
                                              mtrl_error *err) {
    *changed = 0;
    WRITE_BEGIN_(Q_UNTRAIN);
    sqlite3_bind_int64(q, 1, run);
    sqlite3_bind_int64(q, 2, step);
    mtrl_status st = run_(s, q, err, "mark episodes untrained");
    if (!st) *changed = sqlite3_changes64(s->db);
    return txn_leave_(s, own_, st, err);
}

int64_t mtrl_store_max_trained_step(mtrl_store *s, int64_t run) {
    mtrl_error err;
    sqlite3_stmt *q = stmt_(s, Q_MAX_TRAINED, &err);
    if (!q) return -1;
    sqlite3_bind_int64(q, 1, run);
    int64_t v = -1;
    if (sqlite3_step(q) == SQLITE_ROW && sqlite3_column_type(q, 0) != SQLITE_NULL) v = sqlite3_column_int64(q, 0);
    sqlite3_reset(q);
    return v;
}

static const char *level_name_(mtrl_log_level l) {
    switch (l) {
    case MTRL_LOG_DEBUG: return "debug";
    case MTRL_LOG_INFO: return "info";
    case MTRL_LOG_WARN: return "warn";
    case MTRL_LOG_ERROR: return "error";
    }
    return "info";
}

mtrl_status mtrl_store_event_log(mtrl_store *s, int64_t run, mtrl_log_level level, const char *message,
                                 mtrl_error *err) {
    WRITE_BEGIN_(Q_EVENT);
    if (run > 0) sqlite3_bind_int64(q, 1, run);
    else sqlite3_bind_null(q, 1);
    sqlite3_bind_double(q, 2, mtrl_time_wall());
    sqlite3_bind_text(q, 3, level_name_(level), -1, SQLITE_STATIC);
    // Escaped as the log is (mtrl_text_escape): events quote peers' and envs' words, and the
    // sqlite3 shell prints them raw to a terminal.
    char esc[4096];
    mtrl_text_escape(esc, sizeof esc, message ? message : "", message ? strlen(message) : 0);
    bind_text_(q, 4, esc);
    WRITE_END_("log event");
}

mtrl_status mtrl_store_episode_log(mtrl_store *s, int64_t run, const mtrl_traj *t, const char *traj_path,
                                   int64_t traj_offset, int64_t step, mtrl_error *err) {
    int own = 0;
    mtrl_status st = txn_enter_(s, &own, err);
    if (st) return st;
    // Inside a caller's batch, a savepoint keeps the episode and its tool calls together.
    st = exec_(s, "SAVEPOINT episode", err, "savepoint");
    if (st) return txn_leave_(s, own, st, err);
    sqlite3_stmt *q = stmt_(s, Q_EPISODE, err);
    if (!q) st = MTRL_ERR_IO;
    if (!st) {
        char hex[17];
        mtrl_hash64_hex(mtrl_traj_digest_compute(t), hex);
        sqlite3_bind_int64(q, 1, run);
        sqlite3_bind_int64(q, 2, (int64_t)t->episode_id);
        sqlite3_bind_int64(q, 3, (int64_t)t->group_id);
        sqlite3_bind_int64(q, 4, t->actor_id);
        sqlite3_bind_int64(q, 5, t->incarnation);
        bind_text_(q, 6, t->env ? t->env : "");
        sqlite3_bind_int64(q, 7, (int64_t)t->task_seed);
        sqlite3_bind_text(q, 8, mtrl_ep_status_name(t->status), -1, SQLITE_STATIC);
        sqlite3_bind_double(q, 9, t->reward);
        sqlite3_bind_int64(q, 10, (int64_t)t->n_tokens);
        sqlite3_bind_int64(q, 11, (int64_t)t->n_model);
        sqlite3_bind_int64(q, 12, t->n_tools);
        if (t->n_model) {
            sqlite3_bind_int64(q, 13, t->version_min);
            sqlite3_bind_int64(q, 14, t->version_max);
        }
        bind_text_(q, 15, traj_path);
        if (traj_offset >= 0) sqlite3_bind_int64(q, 16, traj_offset);
        sqlite3_bind_text(q, 17, hex, -1, SQLITE_TRANSIENT);
        if (t->start_wall > 0) sqlite3_bind_double(q, 18, t->start_wall);
        if (t->end_wall > 0) sqlite3_bind_double(q, 19, t->end_wall);
        bind_text_(q, 20, t->reason);
        if (step >= 0) sqlite3_bind_int64(q, 21, step);
        int rc = sqlite3_step(q);
        if (rc != SQLITE_DONE) {
            if ((rc & 0xff) == SQLITE_CONSTRAINT)
                st = mtrl_error_set(err, MTRL_ERR_STATE, "%s: episode %llu of run %lld: %s", s->path,
                                    (unsigned long long)t->episode_id, (long long)run, sqlite3_errmsg(s->db));
            else
                st = sqlerr_(s, rc, err, "log episode");
        }
        sqlite3_reset(q);
    }
    for (uint32_t i = 0; i < t->n_tools && !st; i++) {
        const mtrl_tool_call *c = &t->tools[i];
        q = stmt_(s, Q_TOOL, err);
        if (!q) {
            st = MTRL_ERR_IO;
            break;
        }
        sqlite3_bind_int64(q, 1, run);
        sqlite3_bind_int64(q, 2, (int64_t)t->episode_id);
        sqlite3_bind_int64(q, 3, c->turn);
        bind_text_(q, 4, c->name ? c->name : "");
        sqlite3_bind_double(q, 5, c->latency);
        sqlite3_bind_int64(q, 6, c->status);
        sqlite3_bind_int64(q, 7, c->args_len);
        sqlite3_bind_int64(q, 8, c->result_len);
        bind_text_(q, 9, c->error);
        st = run_(s, q, err, "log tool call");
    }
    if (st) sqlite3_exec(s->db, "ROLLBACK TO episode; RELEASE episode", NULL, NULL, NULL);
    else st = exec_(s, "RELEASE episode", err, "release savepoint");
    return txn_leave_(s, own, st, err);
}

// ---- queries ---------------------------------------------------------------------------------

static void col_text_(sqlite3_stmt *q, int i, char *buf, size_t cap) {
    const unsigned char *v = sqlite3_column_text(q, i);
    snprintf(buf, cap, "%s", v ? (const char *)v : "");
}

static mtrl_status step_row_(mtrl_store *s, sqlite3_stmt *q, int *row, mtrl_error *err, const char *what) {
    int rc = sqlite3_step(q);
    if (rc == SQLITE_ROW) {
        *row = 1;
        return MTRL_OK;
    }
    *row = 0;
    if (rc == SQLITE_DONE) return MTRL_OK;
    mtrl_status st = sqlerr_(s, rc, err, what);
    sqlite3_reset(q);
    return st;
}

mtrl_status mtrl_store_run_latest(mtrl_store *s, int64_t *run, mtrl_error *err) {
    sqlite3_stmt *q = stmt_(s, Q_RUN_LATEST, err);
    if (!q) return MTRL_ERR_IO;
    int row = 0;
    mtrl_status st = step_row_(s, q, &row, err, "latest run");
    if (st) return st;
    if (!row || sqlite3_column_type(q, 0) == SQLITE_NULL) {
        sqlite3_reset(q);
        return mtrl_error_set(err, MTRL_ERR_NOTFOUND, "%s: no runs yet", s->path);
    }
    *run = sqlite3_column_int64(q, 0);
    sqlite3_reset(q);
    return MTRL_OK;
}

static void run_row_(sqlite3_stmt *q, mtrl_store_run *r) {
    memset(r, 0, sizeof *r);
    r->id = sqlite3_column_int64(q, 0);
    col_text_(q, 1, r->name, sizeof r->name);
    char status[32];
    col_text_(q, 2, status, sizeof status);
    int st = mtrl_run_status_parse(status);
    r->status = st < 0 ? MTRL_RUN_FAILED : (mtrl_run_status)st;
    col_text_(q, 3, r->config_hash, sizeof r->config_hash);
    r->started = sqlite3_column_double(q, 4);
    r->ended = sqlite3_column_double(q, 5);
    col_text_(q, 6, r->host, sizeof r->host);
    col_text_(q, 7, r->git_rev, sizeof r->git_rev);
}

mtrl_status mtrl_store_run_get(mtrl_store *s, int64_t run, mtrl_store_run *row, char **config, mtrl_error *err) {
    if (config) *config = NULL;
    sqlite3_stmt *q = stmt_(s, Q_RUN_GET, err);
    if (!q) return MTRL_ERR_IO;
    sqlite3_bind_int64(q, 1, run);
    int have = 0;
    mtrl_status st = step_row_(s, q, &have, err, "get run");
    if (st) return st;
    if (!have) {
        sqlite3_reset(q);
        return mtrl_error_set(err, MTRL_ERR_NOTFOUND, "%s: no run %lld", s->path, (long long)run);
    }
    run_row_(q, row);
    if (config && sqlite3_column_type(q, 8) != SQLITE_NULL) *config = xstrdup((const char *)sqlite3_column_text(q, 8));
    sqlite3_reset(q);
    return MTRL_OK;
}

mtrl_status mtrl_store_runs(mtrl_store *s, mtrl_store_run **rows, size_t *n, mtrl_error *err) {
    *rows = NULL;
    *n = 0;
    sqlite3_stmt *q = stmt_(s, Q_RUNS, err);
    if (!q) return MTRL_ERR_IO;
    size_t cap = 0;
    for (;;) {
        int have = 0;
        mtrl_status st = step_row_(s, q, &have, err, "list runs");
        if (st) {
            free(*rows);
            *rows = NULL;
            *n = 0;
            return st;
        }
        if (!have) break;
        if (*n == cap) {
            cap = cap ? 2 * cap : 16;
            *rows = xrealloc(*rows, cap * sizeof **rows);
        }
        run_row_(q, &(*rows)[(*n)++]);
    }
    sqlite3_reset(q);
    return MTRL_OK;
}

mtrl_status mtrl_store_episode_get(mtrl_store *s, int64_t run, uint64_t id, mtrl_store_episode *e, mtrl_error *err) {
    sqlite3_stmt *q = stmt_(s, Q_EPISODE_GET, err);
    if (!q) return MTRL_ERR_IO;
    sqlite3_bind_int64(q, 1, run);
    sqlite3_bind_int64(q, 2, (int64_t)id);
    int have = 0;
    mtrl_status st = step_row_(s, q, &have, err, "get episode");
    if (st) return st;
    if (!have) {
        sqlite3_reset(q);
        return mtrl_error_set(err, MTRL_ERR_NOTFOUND, "%s: no episode %llu in run %lld", s->path,
                              (unsigned long long)id, (long long)run);
    }
    memset(e, 0, sizeof *e);
    e->run = sqlite3_column_int64(q, 0);
    e->id = (uint64_t)sqlite3_column_int64(q, 1);
    e->group_id = (uint64_t)sqlite3_column_int64(q, 2);
    e->actor = (uint32_t)sqlite3_column_int64(q, 3);
    e->incarnation = (uint32_t)sqlite3_column_int64(q, 4);
    col_text_(q, 5, e->env, sizeof e->env);
    e->seed = (uint64_t)sqlite3_column_int64(q, 6);
    char status[32];
    col_text_(q, 7, status, sizeof status);
    int es = mtrl_ep_status_parse(status);
    e->status = es < 0 ? MTRL_EP_REJECTED : (mtrl_ep_status)es;
    e->reward = sqlite3_column_double(q, 8);
    e->tokens = sqlite3_column_int64(q, 9);
    e->model_tokens = sqlite3_column_int64(q, 10);
    e->tool_calls = sqlite3_column_int64(q, 11);
    e->version_min = (uint32_t)sqlite3_column_int64(q, 12);
    e->version_max = (uint32_t)sqlite3_column_int64(q, 13);
    col_text_(q, 14, e->traj_path, sizeof e->traj_path);
    e->traj_offset = sqlite3_column_type(q, 15) == SQLITE_NULL ? -1 : sqlite3_column_int64(q, 15);
    char hex[32];
    col_text_(q, 16, hex, sizeof hex);
    e->digest = strtoull(hex, NULL, 16);
    e->started = sqlite3_column_double(q, 17);
    e->ended = sqlite3_column_double(q, 18);
    col_text_(q, 19, e->abort_reason, sizeof e->abort_reason);
    e->step = sqlite3_column_type(q, 20) == SQLITE_NULL ? -1 : sqlite3_column_int64(q, 20);
    sqlite3_reset(q);
    return MTRL_OK;
}

void mtrl_store_strings_free(char **v, size_t n) {
    if (!v) return;
    for (size_t i = 0; i < n; i++) free(v[i]);
    free(v);
}

mtrl_status mtrl_store_metric_names(mtrl_store *s, int64_t run, char ***names, size_t *n, mtrl_error *err) {
    *names = NULL;
    *n = 0;
    sqlite3_stmt *q = stmt_(s, Q_METRIC_NAMES, err);
    if (!q) return MTRL_ERR_IO;
    sqlite3_bind_int64(q, 1, run);
    size_t cap = 0;
    for (;;) {
        int have = 0;
        mtrl_status st = step_row_(s, q, &have, err, "metric names");
        if (st) {
            mtrl_store_strings_free(*names, *n);
            *names = NULL;
            *n = 0;
            return st;
        }
        if (!have) break;
        if (*n == cap) {
            cap = cap ? 2 * cap : 16;
            *names = xrealloc(*names, cap * sizeof **names);
        }
        const unsigned char *v = sqlite3_column_text(q, 0);
        (*names)[(*n)++] = xstrdup(v ? (const char *)v : "");
    }
    sqlite3_reset(q);
    return MTRL_OK;
}

mtrl_status mtrl_store_metric_series(mtrl_store *s, int64_t run, const char *name, int64_t **steps, double **values,
                                     size_t *n, mtrl_error *err) {
    *steps = NULL;
    *values = NULL;
    *n = 0;
    sqlite3_stmt *q = stmt_(s, Q_METRIC_SERIES, err);
    if (!q) return MTRL_ERR_IO;
    sqlite3_bind_int64(q, 1, run);
    bind_text_(q, 2, name);
    size_t cap = 0;
    for (;;) {
        int have = 0;
        mtrl_status st = step_row_(s, q, &have, err, "metric series");
        if (st) {
            free(*steps);
            free(*values);
            *steps = NULL;
            *values = NULL;
            *n = 0;
            return st;
        }
        if (!have) break;
        if (*n == cap) {
            cap = cap ? 2 * cap : 64;
            *steps = xrealloc(*steps, cap * sizeof **steps);
            *values = xrealloc(*values, cap * sizeof **values);
        }
        (*steps)[*n] = sqlite3_column_int64(q, 0);
        (*values)[*n] = sqlite3_column_type(q, 1) == SQLITE_NULL ? NAN : sqlite3_column_double(q, 1);
        (*n)++;
    }
    sqlite3_reset(q);
    return MTRL_OK;
}

mtrl_status mtrl_store_episode_counts(mtrl_store *s, int64_t run, int64_t counts[MTRL_EP_REJECTED + 1],
                                      mtrl_error *err) {
    for (int i = 0; i <= MTRL_EP_REJECTED; i++) counts[i] = 0;
    sqlite3_stmt *q = stmt_(s, Q_EPISODE_COUNTS, err);
    if (!q) return MTRL_ERR_IO;
    sqlite3_bind_int64(q, 1, run);
    for (;;) {
        int have = 0;
        mtrl_status st = step_row_(s, q, &have, err, "episode counts");
        if (st) return st;
        if (!have) break;
        int es = mtrl_ep_status_parse((const char *)sqlite3_column_text(q, 0));
        if (es >= 0) counts[es] = sqlite3_column_int64(q, 1);
    }
    sqlite3_reset(q);
    return MTRL_OK;
}

mtrl_status mtrl_store_checkpoints(mtrl_store *s, int64_t run, mtrl_store_checkpoint **rows, size_t *n,
                                   mtrl_error *err) {
    *rows = NULL;
    *n = 0;
    sqlite3_stmt *q = stmt_(s, Q_CHECKPOINTS, err);
    if (!q) return MTRL_ERR_IO;
    sqlite3_bind_int64(q, 1, run);
    size_t cap = 0;
    for (;;) {
        int have = 0;
        mtrl_status st = step_row_(s, q, &have, err, "checkpoints");
        if (st) {
            free(*rows);
            *rows = NULL;
            *n = 0;
            return st;
        }
        if (!have) break;
        if (*n == cap) {
            cap = cap ? 2 * cap : 16;
            *rows = xrealloc(*rows, cap * sizeof **rows);
        }
        mtrl_store_checkpoint *c = &(*rows)[(*n)++];
        memset(c, 0, sizeof *c);
        c->step = sqlite3_column_int64(q, 0);
        c->version = (uint32_t)sqlite3_column_int64(q, 1);
        col_text_(q, 2, c->path, sizeof c->path);
        col_text_(q, 3, c->digest, sizeof c->digest);
    }
    sqlite3_reset(q);
    return MTRL_OK;
}
