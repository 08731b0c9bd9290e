// mtrl-test: cpu timeout=600
// `mtrl replay` on real runs (fork/exec of MTRL_BIN in a mkdtemp directory):
//  1. a fresh quickstart run: an episode renders (header, prompt, turns, status), --tokens,
//     --json is well-formed JSON (a small syntax checker below), --rescore prints the mismatch
//     tables and its k3 is tiny for an on-policy episode, --reexec says "identical", other
//     weights (--version, --checkpoint) show a real mismatch, a missing version is exit 1;
//  2. damage: a copy of the run whose trajectory file is cut in the middle of the episode's
//     record gives the trajfile reader's precise message and exit 1, a flipped data byte gives a
//     CRC error and exit 1, a store row without a file is shown (and re-executed) from the row;
//  3. usage and lookup errors: unknown episode or run -> 1, bad usage -> 2;
//  4. a run with a supervised warm-up (which teaches the calc tool format): an episode with a
//     tool call renders the call, its arguments and result; rescore and re-execution run on it.
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/store.h"
#include "common/traj.h"
#include "common/trajfile.h"
#include "tests/testhelp.h"
#include "tests/testproc.h"

static const char *bin_, *src_;
static char dir_[256];

// ---- processes and files ------------------------------------------------------------------------

// The helpers of tests/testproc.h under this file's short names.
typedef test_result result;
#define result_free_ test_result_free
static result run_(char *const argv[]) { return test_run_in(dir_, argv); }
#define slurp_ test_slurp

#define RUN(...) run_((char *const[]){(char *)bin_, __VA_ARGS__, NULL})

#define q_int_ test_query_int

static int exec_sql_(const char *db, const char *sql) {
    sqlite3 *h;
    if (sqlite3_open(db, &h) != SQLITE_OK) return -1;
    int rc = sqlite3_exec(h, sql, NULL, NULL, NULL);
    sqlite3_close(h);
    return rc;
}

static int copy_file_(const char *from, const char *to) {
    size_t n;
    FILE *t;
    if (access(from, F_OK) != 0) return 0;
    char *b = slurp_(from, &n);
    t = fopen(to, "wb");
    if (!t) {
        free(b);
        return -1;
    }
    fwrite(b, 1, n, t);
    fclose(t);
    free(b);
    return 0;
}

// ---- a small JSON syntax checker (RFC 8259) ------------------------------------------------------

typedef struct jp {
    const char *s;
    size_t i, n;
    int depth;
} jp;

static void ws_(jp *p) {
    while (p->i < p->n && strchr(" \t\r\n", p->s[p->i])) p->i++;
}
static int value_(jp *p);
static int lit_(jp *p, const char *w) {
    size_t l = strlen(w);
    if (p->n - p->i < l || memcmp(p->s + p->i, w, l)) return 0;
    p->i += l;
    return 1;
}
static int string_(jp *p) {
    if (p->i >= p->n || p->s[p->i] != '"') return 0;
    p->i++;
    while (p->i < p->n) {
        unsigned char c = (unsigned char)p->s[p->i++];
        if (c == '"') return 1;
        if (c < 0x20) return 0;
        if (c == '\\') {
            if (p->i >= p->n) return 0;
            char e = p->s[p->i++];
            if (e == 'u') {
                for (int k = 0; k < 4; k++)
                    if (p->i >= p->n || !strchr("0123456789abcdefABCDEF", p->s[p->i++])) return 0;
            } else if (!strchr("\"\\/bfnrt", e)) return 0;
        } else if (c >= 0x80) {
            int len = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc2 ? 2 : 0;
            if (!len || c > 0xf4) return 0;
            for (int k = 1; k < len; k++)
                if (p->i >= p->n || ((unsigned char)p->s[p->i++] & 0xc0) != 0x80) return 0;
        }
    }
    return 0;
}
static int number_(jp *p) {
    size_t st = p->i;
    if (p->s[p->i] == '-') p->i++;
    if (p->i >= p->n) return 0;
    if (p->s[p->i] == '0') p->i++;
    else if (p->s[p->i] >= '1' && p->s[p->i] <= '9')
        while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') p->i++;
    else return 0;
    if (p->i < p->n && p->s[p->i] == '.') {
        p->i++;
        size_t d = p->i;
        while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') p->i++;
        if (p->i == d) return 0;
    }
    if (p->i < p->n && (p->s[p->i] == 'e' || p->s[p->i] == 'E')) {
        p->i++;
        if (p->i < p->n && (p->s[p->i] == '+' || p->s[p->i] == '-')) p->i++;
        size_t d = p->i;
        while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') p->i++;
        if (p->i == d) return 0;
    }
    return p->i > st;
}
static int value_(jp *p) {
    ws_(p);
    if (p->i >= p->n || ++p->depth > 200) return 0;
    char c = p->s[p->i];
    int ok;
    if (c == '{') {
        p->i++;
        ws_(p);
        ok = 1;
        if (p->i < p->n && p->s[p->i] == '}') p->i++;
        else
            for (;;) {
                ws_(p);
                if (!string_(p)) { ok = 0; break; }
                ws_(p);
                if (p->i >= p->n || p->s[p->i++] != ':' || !value_(p)) { ok = 0; break; }
                ws_(p);
                if (p->i < p->n && p->s[p->i] == ',') { p->i++; continue; }
                if (p->i < p->n && p->s[p->i] == '}') { p->i++; break; }
                ok = 0;
                break;
            }
    } else if (c == '[') {
        p->i++;
        ws_(p);
        ok = 1;
        if (p->i < p->n && p->s[p->i] == ']') p->i++;
        else
            for (;;) {
                if (!value_(p)) { ok = 0; break; }
                ws_(p);
                if (p->i < p->n && p->s[p->i] == ',') { p->i++; continue; }
                if (p->i < p->n && p->s[p->i] == ']') { p->i++; break; }
                ok = 0;
                break;
            }
    } else if (c == '"') ok = string_(p);
    else if (c == 't') ok = lit_(p, "true");
    else if (c == 'f') ok = lit_(p, "false");
    else if (c == 'n') ok = lit_(p, "null");
    else ok = number_(p);
    p->depth--;
    return ok;
}
// 1 when s is exactly one JSON value (surrounding whitespace allowed).
static int json_ok_(const char *s) {
    jp p = {s, 0, strlen(s), 0};
    if (!value_(&p)) return 0;
    ws_(&p);
    return p.i == p.n;
}

// The number after the first occurrence of key (e.g. "\"k3\":") after anchor; NAN when absent.
static double json_num_after_(const char *s, const char *anchor, const char *key) {
    const char *a = anchor ? strstr(s, anchor) : s;
    if (!a) return NAN;
    const char *k = strstr(a, key);
    if (!k) return NAN;
    return strtod(k + strlen(key), NULL);
}

// ---- the runs -----------------------------------------------------------------------------------

// `mtrl run` of the quickstart with our overrides (the quickstart itself may change: everything
// the checks rely on is set here), then up to 6 more "section.key=value" settings (NULL-ended).
static int make_run_(const char *steps, const char *const *extra) {
    char ini[1024], st[64];
    snprintf(ini, sizeof ini, "%s/experiments/quickstart.ini", src_);
    snprintf(st, sizeof st, "run.steps=%s", steps);
    char *argv[48] = {(char *)bin_, "run", ini, "--set", st, "--set", "run.out_dir=runs", "--set", "run.checkpoint_every=1",
                      "--set", "run.keep_checkpoints=0", "--set", "run.keep_trajectories=all", "--set", "run.max_minutes=5",
                      "--set", "actor.max_tokens=64", "--set", "actor.temperature=1", "--set", "actor.top_p=1",
                      "--db", "runs.db"};
    int n = 23;
    for (int i = 0; extra && extra[i] && i < 6; i++) {
        argv[n++] = "--set";
        argv[n++] = (char *)extra[i];
    }
    argv[n] = NULL;
    result r = run_(argv);
    int rc = r.rc;
    if (rc) fprintf(stderr, "mtrl run failed (%d):\n%s\n", rc, r.err);
    result_free_(&r);
    return rc;
}

int main(void) {
    bin_ = getenv("MTRL_BIN");
    src_ = getenv("MTRL_SRC");
    if (!bin_ || !src_) {
        fprintf(stderr, "MTRL_BIN and MTRL_SRC must be set (ctest sets them)\n");
        return 1;
    }
    snprintf(dir_, sizeof dir_, "/tmp/mtrl-replay-XXXXXX");
    TEST_CHECK(mkdtemp(dir_) != NULL);
    char db[512], id[32], buf[1024];
    snprintf(db, sizeof db, "%s/runs.db", dir_);

    // ---- 1. a fresh run -----------------------------------------------------------------------
    TEST_EQ_INT(make_run_("3", (const char *const[]){"warmup.steps=0", NULL}), 0);
    // an on-policy episode of the initial weights (version 0, re-created from the seed)
    long long ep = q_int_(db, "SELECT id FROM episodes WHERE run = 1 AND model_tokens > 0 AND version_max = 0 "
                              "AND status IN ('complete','truncated') ORDER BY tokens DESC LIMIT 1");
    TEST_CHECK(ep > 0);
    snprintf(id, sizeof id, "%lld", ep);
    result r = RUN("replay", "--db", "runs.db", "--episode", id);
    TEST_EQ_INT(r.rc, 0);
    snprintf(buf, sizeof buf, "episode %lld", ep);
    TEST_CONTAINS(r.out, buf);
    TEST_CONTAINS(r.out, "── prompt");
    TEST_CONTAINS(r.out, "<|bos|>");
    TEST_CONTAINS(r.out, "task seed");
    TEST_CONTAINS(r.out, "── end");
    TEST_CHECK(strstr(r.out, "── model turn") || strstr(r.out, "── answer"));
    TEST_CHECK(!strchr(r.out, '\033')); // no colour when stdout is not a terminal
    result_free_(&r);

    r = RUN("replay", "--db", "runs.db", "--episode", id, "--tokens");
    TEST_EQ_INT(r.rc, 0);
    TEST_CONTAINS(r.out, "index");
    TEST_CONTAINS(r.out, "version");
    TEST_CONTAINS(r.out, "<|bos|>      prompt");
    result_free_(&r);

    r = RUN("replay", "--db", "runs.db", "--episode", id, "--json");
    TEST_EQ_INT(r.rc, 0);
    TEST_CHECKF(json_ok_(r.out), "--json is not well-formed JSON:\n%.2000s", r.out);
    snprintf(buf, sizeof buf, "\"episode\":%lld,", ep);
    TEST_CONTAINS(r.out, buf);
    TEST_CONTAINS(r.out, "\"ids\":[256,");
    result_free_(&r);

    r = RUN("replay", "--db", "runs.db", "--episode", id, "--rescore");
    TEST_EQ_INT(r.rc, 0);
    TEST_CONTAINS(r.out, "mean |Δ log p|");
    TEST_CONTAINS(r.out, "by position (16 bins");
    TEST_CONTAINS(r.out, "by turn");
    TEST_CONTAINS(r.out, "worst tokens");
    TEST_CONTAINS(r.out, "initial weights re-created from [run] seed");
    result_free_(&r);

    r = RUN("replay", "--db", "runs.db", "--episode", id, "--rescore", "--reexec", "--json");
    TEST_EQ_INT(r.rc, 0);
    TEST_CHECKF(json_ok_(r.out), "--rescore --reexec --json is not well-formed JSON:\n%.2000s", r.out);
    double k3 = json_num_after_(r.out, "\"rescore\":", "\"k3\":");
    double amax = json_num_after_(r.out, "\"rescore\":", "\"absdiff_max\":");
    printf("on-policy episode %lld: rescore k3 %.3g, max |dlogp| %.3g\n", ep, k3, amax);
    TEST_CHECKF(k3 >= 0 && k3 < 1e-10, "k3 = %g", k3);
    TEST_CHECKF(amax >= 0 && amax < 1e-5, "max |dlogp| = %g", amax);
    TEST_CONTAINS(r.out, "\"identical\":true");
    result_free_(&r);

    r = RUN("replay", "--db", "runs.db", "--episode", id, "--reexec");
    TEST_EQ_INT(r.rc, 0);
    TEST_CONTAINS(r.out, "identical");
    result_free_(&r);

    // other weights: a real mismatch, reported as such
    r = RUN("replay", "--db", "runs.db", "--episode", id, "--rescore", "--version", "3", "--json");
    TEST_EQ_INT(r.rc, 0);
    double k3o = json_num_after_(r.out, "\"rescore\":", "\"absdiff_mean\":");
    TEST_CHECKF(k3o > 1e-5, "rescoring version-0 tokens with version 3 should show a mismatch, got mean |d| %g", k3o);
    result_free_(&r);
    r = RUN("replay", "--db", "runs.db", "--episode", id, "--rescore", "--checkpoint", "runs/runs-run1/ckpt-000002.safetensors");
    TEST_EQ_INT(r.rc, 0);
    TEST_CONTAINS(r.out, "--checkpoint runs/runs-run1/ckpt-000002.safetensors (version 2)");
    result_free_(&r);
    r = RUN("replay", "--db", "runs.db", "--episode", id, "--rescore", "--version", "99");
    TEST_EQ_INT(r.rc, 1);
    TEST_CONTAINS(r.err, "no retained checkpoint of that version");
    result_free_(&r);

    // an episode of a later version: rescored with its own checkpoint
    long long ep2 = q_int_(db, "SELECT id FROM episodes WHERE run = 1 AND model_tokens > 0 AND version_min = 2 "
                               "AND version_max = 2 LIMIT 1");
    if (ep2 > 0) {
        char id2[32];
        snprintf(id2, sizeof id2, "%lld", ep2);
        r = RUN("replay", "--db", "runs.db", "--episode", id2, "--rescore", "--json");
        TEST_EQ_INT(r.rc, 0);
        TEST_CONTAINS(r.out, "ckpt-000002.safetensors");
        double k3b = json_num_after_(r.out, "\"rescore\":", "\"k3\":");
        printf("on-policy episode %lld (version 2): rescore k3 %.3g\n", ep2, k3b);
        TEST_CHECKF(k3b >= 0 && k3b < 1e-10, "k3 = %g", k3b);
        result_free_(&r);
    }

    // ---- 2. damaged copies ----------------------------------------------------------------------
    char cdir[512], cdb[600], cbin[700], from[600];
    snprintf(cdir, sizeof cdir, "%s/copy", dir_);
    mkdir(cdir, 0755);
    snprintf(buf, sizeof buf, "%s/runs", cdir);
    mkdir(buf, 0755);
    snprintf(buf, sizeof buf, "%s/runs/runs-run1", cdir); // the run's folder (learner/run_dir.h)
    mkdir(buf, 0755);
    snprintf(cdb, sizeof cdb, "%s/runs.db", cdir);
    TEST_EQ_INT(copy_file_(db, cdb), 0);
    snprintf(from, sizeof from, "%s-wal", db);
    snprintf(buf, sizeof buf, "%s-wal", cdb);
    TEST_EQ_INT(copy_file_(from, buf), 0);
    snprintf(from, sizeof from, "%s/runs/runs-run1/traj-run1.bin", dir_);
    snprintf(cbin, sizeof cbin, "%s/runs/runs-run1/traj-run1.bin", cdir);
    TEST_EQ_INT(copy_file_(from, cbin), 0);
    long long off = q_int_(cdb, "SELECT traj_offset FROM episodes WHERE run = 1 AND traj_offset >= 0 ORDER BY traj_offset DESC LIMIT 1");
    long long dep = q_int_(cdb, "SELECT id FROM episodes WHERE run = 1 AND traj_offset >= 0 ORDER BY traj_offset DESC LIMIT 1");
    TEST_CHECK(off >= 0 && dep > 0);
    struct stat sb;
    TEST_EQ_INT(stat(cbin, &sb), 0);
    // the record runs from off to the end of the file: cut it in the middle
    long long cut = off + (sb.st_size - off) / 2;
    TEST_EQ_INT(truncate(cbin, cut), 0);
    char did[32];
    snprintf(did, sizeof did, "%lld", dep);
    r = RUN("replay", "--db", "copy/runs.db", "--episode", did);
    TEST_EQ_INT(r.rc, 1);
    snprintf(buf, sizeof buf, "record at byte %lld", off);
    TEST_CONTAINS(r.err, buf);
    TEST_CONTAINS(r.err, "truncated");
    TEST_CONTAINS(r.err, "copy/runs/runs-run1/traj-run1.bin");
    TEST_CHECK(r.out[0] == 0); // nothing half-rendered
    printf("torn file: %s", r.err);
    result_free_(&r);
    // a flipped byte in the data of the (intact) version-0 episode's record
    TEST_EQ_INT(copy_file_(from, cbin), 0);
    long long off0 = q_int_(cdb, "SELECT traj_offset FROM episodes WHERE run = 1 AND id = (SELECT id FROM episodes WHERE run = 1 "
                                 "AND model_tokens > 0 AND version_max = 0 AND status IN ('complete','truncated') "
                                 "ORDER BY tokens DESC LIMIT 1)");
    {
        FILE *f = fopen(cbin, "r+b");
        TEST_CHECK(f != NULL);
        fseek(f, off0 + 12 + 40, SEEK_SET);
        int c = fgetc(f);
        fseek(f, off0 + 12 + 40, SEEK_SET);
        fputc(c ^ 0x5a, f);
        fclose(f);
    }
    r = RUN("replay", "--db", "copy/runs.db", "--episode", id);
    TEST_EQ_INT(r.rc, 1);
    TEST_CONTAINS(r.err, "CRC");
    snprintf(buf, sizeof buf, "at byte %lld", off0);
    TEST_CONTAINS(r.err, buf);
    result_free_(&r);
    // a store row without a file: shown from the row, re-executed against its digest
    TEST_EQ_INT(copy_file_(from, cbin), 0);
    snprintf(buf, sizeof buf, "UPDATE episodes SET traj_path = NULL, traj_offset = NULL WHERE run = 1 AND id = %lld", ep);
    TEST_EQ_INT(exec_sql_(cdb, buf), SQLITE_OK);
    r = RUN("replay", "--db", "copy/runs.db", "--episode", id, "--reexec");
    TEST_EQ_INT(r.rc, 0);
    TEST_CONTAINS(r.out, "the learner kept no file");
    TEST_CONTAINS(r.out, "identical");
    TEST_CONTAINS(r.out, "digest");
    result_free_(&r);
    r = RUN("replay", "--db", "copy/runs.db", "--episode", id, "--rescore");
    TEST_EQ_INT(r.rc, 1);
    TEST_CONTAINS(r.err, "no trajectory file");
    result_free_(&r);

    // an aborted episode (its actor died half-way): the same episode cut in half, logged in a new
    // run of the copy with the same config; it renders with its reason, and re-executes to a
    // run whose first half is the recording
    {
        mtrl_store *st = NULL;
        mtrl_error err;
        TEST_EQ_INT(mtrl_store_open(&st, cdb, 0, &err), MTRL_OK);
        mtrl_store_run row;
        char *config = NULL;
        int64_t run2 = 0;
        mtrl_traj t, half;
        mtrl_traj_init(&t);
        mtrl_traj_init(&half);
        long long eoff = q_int_(cdb, "SELECT traj_offset FROM episodes WHERE run = 1 AND traj_offset >= 0 AND model_tokens > 4 "
                                     "AND version_max = 0 AND status = 'truncated' LIMIT 1");
        long long eid = q_int_(cdb, "SELECT id FROM episodes WHERE run = 1 AND traj_offset >= 0 AND model_tokens > 4 "
                                    "AND version_max = 0 AND status = 'truncated' LIMIT 1");
        mtrl_trajfile_reader rd;
        mtrl_traj_limits lim = mtrl_traj_limits_default();
        TEST_EQ_INT(mtrl_trajfile_reader_open(&rd, cbin, &err), MTRL_OK);
        TEST_EQ_INT(mtrl_trajfile_read_traj_at(&rd, (uint64_t)eoff, &lim, &t, &err), MTRL_OK);
        mtrl_trajfile_reader_close(&rd);
        TEST_EQ_INT(mtrl_store_run_get(st, 1, &row, &config, &err), MTRL_OK);
        mtrl_store_run_info info = {"aborted-copy", config, row.config_hash, NULL, NULL, 0};
        TEST_EQ_INT(mtrl_store_run_create(st, &info, &run2, &err), MTRL_OK);
        half.episode_id = t.episode_id;
        half.group_id = t.group_id;
        half.task_seed = t.task_seed;
        half.actor_id = t.actor_id;
        half.incarnation = t.incarnation;
        half.sample_seed = t.sample_seed;
        half.sample_stream = t.sample_stream;
        half.start_wall = t.start_wall;
        mtrl_traj_set_env(&half, t.env);
        mtrl_traj_set_routing(&half, t.routing_width, (t.flags & MTRL_TRAJ_ROUTING_U16) != 0);
        uint64_t k = t.n_tokens - 3;
        for (uint64_t i = 0; i < k; i++)
            mtrl_traj_append(&half, t.ids[i], t.logprob[i], t.version[i], t.kind[i],
                             t.routing_width ? t.routing + i * mtrl_traj_routing_row_bytes(&t) : NULL);
        half.status = MTRL_EP_ABORTED;
        mtrl_traj_set_reason(&half, "actor 1 (incarnation %u) lost: no heartbeat", t.incarnation);
        half.end_wall = t.end_wall;
        mtrl_trajfile_writer w;
        uint64_t hoff = 0;
        TEST_EQ_INT(mtrl_trajfile_writer_open(&w, cbin, 1, &err), MTRL_OK);
        TEST_EQ_INT(mtrl_trajfile_append_traj(&w, &half, NULL, &hoff, &err), MTRL_OK);
        mtrl_trajfile_writer_close(&w, &err);
        TEST_EQ_INT(mtrl_store_episode_log(st, run2, &half, "runs/runs-run1/traj-run1.bin", (int64_t)hoff, 0, &err), MTRL_OK);
        mtrl_store_close(st);
        char aid[32], rn[32];
        snprintf(aid, sizeof aid, "%lld", eid);
        snprintf(rn, sizeof rn, "%lld", (long long)run2);
        r = RUN("replay", "--db", "copy/runs.db", "--episode", aid, "--run", rn, "--reexec");
        TEST_EQ_INT(r.rc, 0);
        TEST_CONTAINS(r.out, "aborted: actor 1");
        TEST_CONTAINS(r.out, "no heartbeat");
        snprintf(buf, sizeof buf, "identical over the %llu recorded tokens", (unsigned long long)k);
        TEST_CONTAINS(r.out, buf);
        printf("%s", r.out);
        result_free_(&r);
        // without --run: the episode is in both runs; the newest is shown, and stderr says so
        r = RUN("replay", "--db", "copy/runs.db", "--episode", aid, "--json");
        TEST_EQ_INT(r.rc, 0);
        TEST_CHECK(json_ok_(r.out));
        TEST_CONTAINS(r.out, "\"status\":\"aborted\"");
        TEST_CONTAINS(r.err, "choose with --run");
        result_free_(&r);
        free(config);
        mtrl_traj_free(&t);
        mtrl_traj_free(&half);
    }

    // ---- 3. lookup and usage errors ---------------------------------------------------------------
    r = RUN("replay", "--db", "runs.db", "--episode", "12345");
    TEST_EQ_INT(r.rc, 1);
    TEST_CONTAINS(r.err, "episode 12345 not found");
    result_free_(&r);
    r = RUN("replay", "--db", "runs.db", "--episode", id, "--run", "7");
    TEST_EQ_INT(r.rc, 1);
    TEST_CONTAINS(r.err, "run 7 not found");
    result_free_(&r);
    r = RUN("replay", "--db", "nothere.db", "--episode", id);
    TEST_EQ_INT(r.rc, 1);
    result_free_(&r);
    r = RUN("replay", "--db", "runs.db");
    TEST_EQ_INT(r.rc, 2);
    TEST_CONTAINS(r.err, "--episode is required");
    result_free_(&r);
    r = RUN("replay", "--db", "runs.db", "--episode", "x12");
    TEST_EQ_INT(r.rc, 2);
    result_free_(&r);
    r = RUN("replay", "--db", "runs.db", "--episode", id, "--version", "1");
    TEST_EQ_INT(r.rc, 2);
    result_free_(&r);
    r = RUN("replay", "--db", "runs.db", "--episode", id, "--rescore", "--version", "1", "--checkpoint", "x");
    TEST_EQ_INT(r.rc, 2);
    result_free_(&r);
    r = RUN("replay", "--db", "runs.db", "--episode", id, "--frobnicate");
    TEST_EQ_INT(r.rc, 2);
    result_free_(&r);

    // ---- 4. tool calls, after a warm-up that teaches the calc tool format --------------------------
    char wdir[256];
    snprintf(wdir, sizeof wdir, "%.200s/warm", dir_);
    mkdir(wdir, 0755);
    char keep[256];
    snprintf(keep, sizeof keep, "%s", dir_);
    snprintf(dir_, sizeof dir_, "%s", wdir);
    TEST_EQ_INT(make_run_("5", (const char *const[]){"warmup.steps=40", "warmup.lr=1e-2", "warmup.batch=16", NULL}), 0);
    snprintf(db, sizeof db, "%s/runs.db", dir_);
    long long calls = q_int_(db, "SELECT count(*) FROM tool_calls WHERE run = 1");
    printf("warm-up run: %lld tool calls\n", calls);
    // prefer a complete episode whose weights were checkpointed (versions after the warm-up)
    long long tep = q_int_(db, "SELECT e.id FROM episodes e WHERE e.run = 1 AND e.tool_calls > 0 AND e.traj_offset >= 0 "
                               "ORDER BY (e.version_min = e.version_max AND e.version_min IN (SELECT version FROM checkpoints)) DESC, "
                               "e.status = 'complete' DESC, e.reward DESC LIMIT 1");
    TEST_CHECKF(tep > 0, "no episode with a tool call (SELECT episode FROM tool_calls LIMIT 1)");
    if (tep > 0) {
        char tid[32];
        snprintf(tid, sizeof tid, "%lld", tep);
        r = RUN("replay", "--db", "runs.db", "--episode", tid);
        TEST_EQ_INT(r.rc, 0);
        TEST_CONTAINS(r.out, "── tool call 1: ");
        TEST_CONTAINS(r.out, "<|tool|>");
        TEST_CONTAINS(r.out, "<|/tool|>");
        TEST_CONTAINS(r.out, "arguments");
        TEST_CONTAINS(r.out, "result");
        TEST_CONTAINS(r.out, "ms");
        printf("%s", r.out);
        result_free_(&r);
        r = RUN("replay", "--db", "runs.db", "--episode", tid, "--json");
        TEST_EQ_INT(r.rc, 0);
        TEST_CHECKF(json_ok_(r.out), "--json of a tool episode is not well-formed:\n%.2000s", r.out);
        TEST_CONTAINS(r.out, "\"arguments\":\"");
        TEST_CONTAINS(r.out, "\"type\":\"tool_call\"");
        result_free_(&r);
        // its weights: a checkpoint, or the warm-up's version, which the learner does not save
        snprintf(buf, sizeof buf, "SELECT count(*) FROM checkpoints WHERE run = 1 AND version = "
                                  "(SELECT version_min FROM episodes WHERE run = 1 AND id = %lld)", tep);
        int retained = q_int_(db, buf) > 0;
        r = RUN("replay", "--db", "runs.db", "--episode", tid, "--rescore");
        TEST_EQ_INT(r.rc, 0);
        TEST_CONTAINS(r.out, "by turn");
        if (!retained) TEST_CONTAINS(r.out, "nearest newer retained");
        printf("%s", strstr(r.out, "── rescore") ? strstr(r.out, "── rescore") : r.out);
        result_free_(&r);
        r = RUN("replay", "--db", "runs.db", "--episode", tid, "--reexec");
        if (retained) {
            TEST_EQ_INT(r.rc, 0);
            TEST_CONTAINS(r.out, "── re-execution");
            printf("%s", strstr(r.out, "── re-execution") ? strstr(r.out, "── re-execution") : r.out);
        } else {
            TEST_EQ_INT(r.rc, 1);
            TEST_CONTAINS(r.err, "retains no checkpoint of that version");
        }
        result_free_(&r);
    }
    // an episode the weights changed under (partial rollout): each token rescored under its own
    // version; re-execution states that it can use one version only
    long long sep = q_int_(db, "SELECT id FROM episodes WHERE run = 1 AND version_min < version_max AND traj_offset >= 0 "
                               "AND version_min IN (SELECT version FROM checkpoints WHERE run = 1) "
                               "AND version_max IN (SELECT version FROM checkpoints WHERE run = 1) LIMIT 1");
    if (sep > 0) {
        char sid[32];
        snprintf(sid, sizeof sid, "%lld", sep);
        r = RUN("replay", "--db", "runs.db", "--episode", sid, "--rescore", "--reexec");
        TEST_EQ_INT(r.rc, 0);
        // Two versions or more: a long episode can span several weight updates.
        const char *own = strstr(r.out, "each token under its own version (");
        TEST_CHECKF(own != NULL, "no per-version rescore in: %s", r.out);
        unsigned nv = 0;
        if (own) TEST_EQ_INT(sscanf(own, "each token under its own version (%u versions)", &nv), 1);
        TEST_CHECK(nv >= 2);
        TEST_CONTAINS(r.out, "the episode spans versions");
        result_free_(&r);
    } else {
        printf("note: no episode spans two retained versions in this run; multi-version rescore not exercised\n");
    }
    snprintf(dir_, sizeof dir_, "%s", keep);

    if (test_failed_ == 0) {
        snprintf(buf, sizeof buf, "rm -rf '%s'", dir_);
        if (system(buf) != 0) fprintf(stderr, "could not remove %s\n", dir_);
    } else {
        fprintf(stderr, "left %s for inspection\n", dir_);
    }
    return test_report();
}
