// store.h: the SQLite run store (architecture §6). One writer (the learner); readers (replay,
// report, anyone with the sqlite3 shell) open it read-only.
//
// Open for writing: takes an exclusive flock on "<db>.lock" first, where <db> is the database's
// real path (symlinks resolved), so a second writer (a second learner on the same database, by
// any name of it but a hard link) is refused with a clear message instead of interleaving runs;
// then WAL, synchronous=NORMAL (durable across process crashes; a power cut may lose the last
// commits), busy_timeout=5000, foreign_keys=ON, journal_size_limit. The schema version lives
// in PRAGMA user_version and the file is marked with application_id MTRL_STORE_APP_ID; a newer
// schema, or a database that is not a run store, is refused. A fresh file gets the schema in
// one transaction. Because the lock was free, any run still marked 'running' belonged to a
// writer that died: it becomes 'failed' with an event saying so.
//
// Writes use BEGIN IMMEDIATE. The learner batches a step's rows into one transaction with
// mtrl_store_begin / mtrl_store_commit; a log call outside a batch runs in its own transaction.
// Statements are prepared once and reused. Episode rows and their tool calls go in together
// (a savepoint), so a failure never leaves an episode without its tool calls.
//
// Schema (version 1):
//   runs(id INTEGER PRIMARY KEY, name, status ∈ running/finished/failed/killed, config,
//        config_hash, started, ended, host, git_rev)
//   params(run, key, value)                         PK (run, key)
//   metrics(run, step, name, value, wall_time)      PK (run, name, step); NaN is stored as NULL
//   episodes(run, id, group_id, actor, incarnation, env, seed, status, reward, tokens,
//            model_tokens, tool_calls, version_min, version_max, traj_path, traj_offset,
//            digest, started, ended, abort_reason, step)        PK (run, id)
//   tool_calls(run, episode, turn, name, latency, status, bytes_in, bytes_out, error)
//   experts(run, step, layer, expert, load, bias)   PK (run, step, layer, expert)
//   checkpoints(run, step, version, path, digest)   PK (run, step)
//   events(run, time, level, message)
// Times are wall-clock seconds since the epoch (REAL). Episode ids, group ids and seeds are
// 64-bit unsigned on our side and stored as SQLite's signed INTEGER with the same bits (values
// >= 2^63 read back negative in the shell); episode digests are 16 lowercase hex digits.
//
// Ownership: mtrl_store is opaque; mtrl_store_close releases it. Query results are either
// fixed-size rows (strings truncated to their arrays) or arrays the caller frees with free()
// (mtrl_store_strings_free for string lists).
// Errors: MTRL_ERR_STATE (second writer, write on a read-only store, duplicate episode),
// MTRL_ERR_MISMATCH (newer schema, not a run store), MTRL_ERR_NOTFOUND, MTRL_ERR_TIMEOUT
// (database busy past busy_timeout), MTRL_ERR_IO (anything else SQLite reports), each with the
// database path and SQLite's message. Never share an mtrl_store across fork() or threads.
#ifndef MTRL_STORE_H
#define MTRL_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "common/log.h"
#include "common/status.h"
#include "common/traj.h"

#define MTRL_STORE_SCHEMA 2 // 2: episodes.trained_step (a writer migrates a store of 1)
#define MTRL_STORE_APP_ID 0x4d54524c // "MTRL"

typedef enum mtrl_run_status {
    MTRL_RUN_RUNNING = 0,
    MTRL_RUN_FINISHED = 1,
    MTRL_RUN_FAILED = 2,
    MTRL_RUN_KILLED = 3,
} mtrl_run_status;

const char *mtrl_run_status_name(mtrl_run_status s); // "running", "finished", "failed", "killed"
int mtrl_run_status_parse(const char *name);         // -1 when unknown

typedef struct mtrl_store mtrl_store;

// readonly = 1: no lock, no schema changes, writes refused. The file must exist.
mtrl_status mtrl_store_open(mtrl_store **out, const char *path, int readonly, mtrl_error *err);
void mtrl_store_close(mtrl_store *s); // NULL-safe; an open batch is rolled back (with a warning)
const char *mtrl_store_path(const mtrl_store *s);
// The underlying connection, for ad-hoc SQL (report). Do not close it.
struct sqlite3 *mtrl_store_sqlite(mtrl_store *s);

// ---- batches ---------------------------------------------------------------------------------
mtrl_status mtrl_store_begin(mtrl_store *s, mtrl_error *err);   // BEGIN IMMEDIATE
mtrl_status mtrl_store_commit(mtrl_store *s, mtrl_error *err);
void mtrl_store_rollback(mtrl_store *s);
// Checkpoints the WAL into the database (RESTART), so long readers do not grow it forever.
mtrl_status mtrl_store_wal_checkpoint(mtrl_store *s, mtrl_error *err);

// ---- writes ----------------------------------------------------------------------------------
typedef struct mtrl_store_run_info {
    const char *name;         // required
    const char *config;       // resolved experiment text (may be NULL)
    const char *config_hash;  // hex (may be NULL)
    const char *host;         // NULL = gethostname()
    const char *git_rev;      // NULL = the revision this mtrl was built from (mtrl_git_rev)
    double started;           // 0 = now
} mtrl_store_run_info;

// A new run with status 'running'.
mtrl_status mtrl_store_run_create(mtrl_store *s, const mtrl_store_run_info *info, int64_t *run_id, mtrl_error *err);
// Sets the status; 'ended' becomes now (NULL again for running).
mtrl_status mtrl_store_run_set_status(mtrl_store *s, int64_t run, mtrl_run_status status, mtrl_error *err);
// Replaces an earlier value of the same key.
mtrl_status mtrl_store_param_log(mtrl_store *s, int64_t run, const char *key, const char *value, mtrl_error *err);
// wall_time 0 = now. Replaces an earlier value of the same (name, step).
mtrl_status mtrl_store_metric_log(mtrl_store *s, int64_t run, int64_t step, const char *name, double value,
                                  double wall_time, mtrl_error *err);
// One episode row from t (status, reason, counts, versions, digest of its tokens) plus one row
// per tool call. traj_path NULL / traj_offset < 0 when the episode was not written to a file.
mtrl_status mtrl_store_episode_log(mtrl_store *s, int64_t run, const mtrl_traj *t, const char *traj_path,
                                   int64_t traj_offset, int64_t step, mtrl_error *err);
mtrl_status mtrl_store_expert_log(mtrl_store *s, int64_t run, int64_t step, int layer, int expert, double load,
                                  double bias, mtrl_error *err);
mtrl_status mtrl_store_checkpoint_log(mtrl_store *s, int64_t run, int64_t step, uint32_t version, const char *path,
                                      const char *digest, mtrl_error *err);
// episodes.trained_step: the RL step whose batch trained on the episode; NULL for one never
// trained on (dropped as stale, of a dropped group, aborted, rejected, or trained in steps a
// --resume went back past). Marks ids[0..n) as trained at step.
mtrl_status mtrl_store_episodes_trained(mtrl_store *s, int64_t run, int64_t step, const uint64_t *ids, size_t n,
                                        mtrl_error *err);
// --resume from the checkpoint of step: the training of later steps was lost with the process,
// so their episodes are marked untrained again (*changed of them).
mtrl_status mtrl_store_episodes_untrain_after(mtrl_store *s, int64_t run, int64_t step, int64_t *changed,
                                              mtrl_error *err);
// The latest step that trained an episode of run; -1 when none did (or it cannot be read).
int64_t mtrl_store_max_trained_step(mtrl_store *s, int64_t run);
// run <= 0 = an event of no run (stored as NULL). Level as text: debug, info, warn, error.
mtrl_status mtrl_store_event_log(mtrl_store *s, int64_t run, mtrl_log_level level, const char *message,
                                 mtrl_error *err);

// ---- queries ---------------------------------------------------------------------------------
typedef struct mtrl_store_run {
    int64_t id;
    char name[256];
    mtrl_run_status status;
    char config_hash[128];
    double started, ended;    // ended 0 while running
    char host[256];
    char git_rev[128];
} mtrl_store_run;

typedef struct mtrl_store_episode {
    int64_t run;
    uint64_t id, group_id, seed;
    uint32_t actor, incarnation;
    char env[256];
    mtrl_ep_status status;
    double reward;
    int64_t tokens, model_tokens, tool_calls;
    uint32_t version_min, version_max;
    char traj_path[4096];     // "" when not written
    int64_t traj_offset;      // -1 when not written
    uint64_t digest;
    double started, ended;
    char abort_reason[1024];
    int64_t step;             // -1 when NULL
} mtrl_store_episode;

typedef struct mtrl_store_checkpoint {
    int64_t step;
    uint32_t version;
    char path[4096];
    char digest[128];
} mtrl_store_checkpoint;

mtrl_status mtrl_store_run_latest(mtrl_store *s, int64_t *run, mtrl_error *err); // NOTFOUND when empty
// *config (may be NULL) receives the run's config text (free()).
mtrl_status mtrl_store_run_get(mtrl_store *s, int64_t run, mtrl_store_run *row, char **config, mtrl_error *err);
mtrl_status mtrl_store_runs(mtrl_store *s, mtrl_store_run **rows, size_t *n, mtrl_error *err);
mtrl_status mtrl_store_episode_get(mtrl_store *s, int64_t run, uint64_t id, mtrl_store_episode *row,
                                   mtrl_error *err);
mtrl_status mtrl_store_metric_names(mtrl_store *s, int64_t run, char ***names, size_t *n, mtrl_error *err);
void mtrl_store_strings_free(char **v, size_t n);
// (step, value) ordered by step; NULL values read back as NaN.
mtrl_status mtrl_store_metric_series(mtrl_store *s, int64_t run, const char *name, int64_t **steps, double **values,
                                     size_t *n, mtrl_error *err);
// counts[status] for every mtrl_ep_status.
mtrl_status mtrl_store_episode_counts(mtrl_store *s, int64_t run, int64_t counts[MTRL_EP_REJECTED + 1],
                                      mtrl_error *err);
mtrl_status mtrl_store_checkpoints(mtrl_store *s, int64_t run, mtrl_store_checkpoint **rows, size_t *n,
                                   mtrl_error *err);

#endif
