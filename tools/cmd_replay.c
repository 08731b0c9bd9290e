// cmd_replay.c: `mtrl replay --db runs.db --episode ID` shows one recorded episode as a person
// reads it (header, prompt, model turns, tool calls with arguments/results/latency/errors, the
// answer, rewards and status), or as a per-token table (--tokens) or one JSON object (--json);
// --rescore and --reexec (tools/replay_model.c) compare it with the learner's log-probs and with
// a fresh run of the same episode.
//
// Exit codes: 0 ok; 1 the episode or run is not found, the trajectory file is torn or corrupt
// (the trajfile reader's message: which record, which byte), or the weights a rescore or
// re-execution needs are not retained; 2 bad usage.
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <sqlite3.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/check.h"
#include "common/hash.h"
#include "common/image.h"
#include "common/timeutil.h"
#include "common/tokenizer.h"
#include "common/trajfile.h"
#include "tools/cli.h"
#include "tools/replay.h"

#define REPLAY_USAGE                                                                                              \
    "mtrl replay --db runs.db --episode ID [--run RUN] [--tokens] [--json] [--images DIR]\n"                     \
    "                   [--rescore [--version V | --checkpoint PATH]] [--reexec]"

// ---- colour -------------------------------------------------------------------------------------

static int colour_;
#define C_(code) (colour_ ? "\033[" code "m" : "")
#define C_RESET C_("0")
#define C_BOLD C_("1")
#define C_DIM C_("2")
#define C_RED C_("31")
#define C_GREEN C_("32")
#define C_YELLOW C_("33")
#define C_BLUE C_("34")
#define C_MAGENTA C_("35")
#define C_CYAN C_("36")

// ---- text helpers -------------------------------------------------------------------------------

// Text the model or an env produced (a tool's name, an error, a reason) for a line of the
// view: control bytes become \xNN, so an escape sequence in it never reaches the terminal.
static const char *esc_(const char *s, char *buf, size_t cap) {
    size_t o = 0;
    for (; *s && o + 5 < cap; s++) {
        unsigned char c = (unsigned char)*s;
        if (c < 0x20 || c == 0x7f) o += (size_t)snprintf(buf + o, cap - o, "\\x%02x", c);
        else buf[o++] = (char)c;
    }
    buf[o] = 0;
    return buf;
}


static const char *kind_name_(uint8_t k) {
    switch (k) {
    case MTRL_TOK_PROMPT: return "prompt";
    case MTRL_TOK_MODEL: return "model";
    case MTRL_TOK_TOOL: return "tool";
    case MTRL_TOK_PAD: return "pad";
    default: return "?";
    }
}

// ---- JSON ---------------------------------------------------------------------------------------

// JSON's ASCII escapes.
static const char *json_ascii_(uint8_t c, char *buf, const void *u) {
    (void)u;
    switch (c) {
    case '"': return "\\\"";
    case '\\': return "\\\\";
    case '\n': return "\\n";
    case '\t': return "\\t";
    case '\r': return "\\r";
    default:
        if (c < 0x20 || c == 0x7f) {
            snprintf(buf, 16, "\\u%04x", c);
            return buf;
        }
        return NULL;
    }
}

static void json_bytes_(FILE *f, const uint8_t *b, size_t n) {
    fputc('"', f);
    replay_put_escaped(f, b, n, json_ascii_, NULL, "\\\\x%02x"); // invalid bytes: the text view's escape, as text
    fputc('"', f);
}

static void json_str_(FILE *f, const char *s) {
    if (!s) s = "";
    json_bytes_(f, (const uint8_t *)s, strlen(s));
}

// The display text of ids (specials as <|name|>) as a JSON string.
static void json_ids_text_(FILE *f, const uint32_t *ids, size_t n) {
    char *buf = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&buf, &len);
    replay_put_ids(m, ids, n, 0, 0);
    fclose(m);
    // replay_put_ids escaped invalid bytes as \xNN text already; emit that text as is.
    json_bytes_(f, (const uint8_t *)buf, len);
    free(buf);
}

static void json_num_(FILE *f, double v) {
    if (isfinite(v)) fprintf(f, "%.17g", v);
    else fputs("null", f);
}

static void json_f32_(FILE *f, float v) {
    if (isfinite(v)) fprintf(f, "%.9g", (double)v);
    else fputs("null", f);
}

// ---- session ------------------------------------------------------------------------------------

static void session_free_(replay_session *s) {
    replay_text_use(NULL);
    mtrl_tokenizer_free(s->tok);
    s->tok = NULL;
    mtrl_store_close(s->store);
    free(s->config_text);
    free(s->ckpts);
    mtrl_traj_free(&s->t);
}

// Finds the runs holding episode id, newest first. Returns the count (0 = none) and the newest.
static int runs_with_episode_(replay_session *s, uint64_t id, int64_t *newest, char *list, size_t cap) {
    sqlite3 *db = mtrl_store_sqlite(s->store);
    sqlite3_stmt *st = NULL;
    int n = 0;
    list[0] = 0;
    if (sqlite3_prepare_v2(db, "SELECT run FROM episodes WHERE id = ? ORDER BY run DESC", -1, &st, NULL) != SQLITE_OK)
        return -1;
    sqlite3_bind_int64(st, 1, (sqlite3_int64)id);
    while (sqlite3_step(st) == SQLITE_ROW) {
        int64_t r = sqlite3_column_int64(st, 0);
        if (n == 0) *newest = r;
        size_t l = strlen(list);
        snprintf(list + l, cap - l, "%s%lld", n ? ", " : "", (long long)r);
        n++;
    }
    sqlite3_finalize(st);
    return n;
}

// Opens everything about the episode. Returns -1 to go on, else the exit code.
static int session_open_(replay_session *s, const char *db, int have_run, int64_t run, uint64_t id, int quiet) {
    mtrl_error err;
    memset(s, 0, sizeof *s);
    mtrl_traj_init(&s->t);
    s->db = db;
    if (access(db, F_OK) != 0) {
        fprintf(stderr, "mtrl replay: %s: %s\n", db, strerror(errno));
        return 1;
    }
    if (mtrl_store_open(&s->store, db, 1, &err) != MTRL_OK) {
        fprintf(stderr, "mtrl replay: %s\n", err.msg);
        return 1;
    }
    if (!have_run) {
        char list[512];
        int n = runs_with_episode_(s, id, &run, list, sizeof list);
        if (n < 0) {
            fprintf(stderr, "mtrl replay: %s: %s\n", db, sqlite3_errmsg(mtrl_store_sqlite(s->store)));
            return 1;
        }
        if (n == 0) {
            fprintf(stderr, "mtrl replay: episode %" PRIu64 " not found in any run of %s\n", id, db);
            return 1;
        }
        if (n > 1 && !quiet)
            fprintf(stderr, "mtrl replay: episode %" PRIu64 " is in runs %s; showing run %lld (choose with --run)\n", id,
                    list, (long long)run);
    }
    s->run = run;
    if (mtrl_store_run_get(s->store, run, &s->run_row, &s->config_text, &err) != MTRL_OK) {
        if (err.code == MTRL_ERR_NOTFOUND) fprintf(stderr, "mtrl replay: run %lld not found in %s\n", (long long)run, db);
        else fprintf(stderr, "mtrl replay: %s\n", err.msg);
        return 1;
    }
    if (mtrl_store_episode_get(s->store, run, id, &s->row, &err) != MTRL_OK) {
        if (err.code == MTRL_ERR_NOTFOUND)
            fprintf(stderr, "mtrl replay: episode %" PRIu64 " not found in run %lld of %s\n", id, (long long)run, db);
        else fprintf(stderr, "mtrl replay: %s\n", err.msg);
        return 1;
    }
    if (s->config_text) {
        mtrl_config_errors errs = {0};
        char name[64];
        snprintf(name, sizeof name, "run %lld config", (long long)run);
        if (mtrl_config_load_text(&s->cfg, name, s->config_text, NULL, 0, &errs) == MTRL_OK) s->have_cfg = 1;
        else snprintf(s->cfg_err, sizeof s->cfg_err, "%s", errs.n ? errs.msgs[0] : "config refused");
        mtrl_config_errors_free(&errs);
        // The ids mean what the run's tokenizer says (a BPE for an imported model); a tokenizer
        // file that is gone leaves the bytes view, said once.
        mtrl_error terr;
        if (s->have_cfg && mtrl_tokenizer_open(&s->tok, &s->cfg.model, UINT32_MAX, &terr) != MTRL_OK) {
            fprintf(stderr, "mtrl replay: %s; showing the ids as bytes\n", terr.msg);
            s->tok = NULL;
        }
        replay_text_use(s->tok);
    } else {
        snprintf(s->cfg_err, sizeof s->cfg_err, "run %lld has no stored config", (long long)run);
    }
    if (mtrl_store_checkpoints(s->store, run, &s->ckpts, &s->n_ckpts, &err) != MTRL_OK) {
        s->ckpts = NULL;
        s->n_ckpts = 0;
    }
    if (s->row.traj_path[0] && s->row.traj_offset >= 0) {
        replay_resolve_path(s->db, s->row.traj_path, s->traj_file, sizeof s->traj_file);
        mtrl_trajfile_reader r;
        mtrl_traj_limits lim = mtrl_traj_limits_default();
        mtrl_status st = mtrl_trajfile_reader_open(&r, s->traj_file, &err);
        if (st == MTRL_OK) {
            st = mtrl_trajfile_read_traj_at(&r, (uint64_t)s->row.traj_offset, &lim, &s->t, &err);
            mtrl_trajfile_reader_close(&r);
        }
        if (st != MTRL_OK) {
            fprintf(stderr, "mtrl replay: episode %" PRIu64 " (run %lld): %s\n", id, (long long)run, err.msg);
            return 1;
        }
        if (s->t.episode_id != id) {
            fprintf(stderr,
                    "mtrl replay: %s: the record at byte %lld holds episode %" PRIu64 ", not %" PRIu64
                    ": the file does not match the run store\n",
                    s->traj_file, (long long)s->row.traj_offset, s->t.episode_id, id);
            return 1;
        }
        uint64_t dg = mtrl_traj_digest_compute(&s->t);
        if (dg != s->row.digest) {
            fprintf(stderr,
                    "mtrl replay: %s: the record at byte %lld has token digest %016" PRIx64
                    ", the run store says %016" PRIx64 ": the file does not match the run store\n",
                    s->traj_file, (long long)s->row.traj_offset, dg, s->row.digest);
            return 1;
        }
        s->have_traj = 1;
    }
    return -1;
}

// ---- turn structure -----------------------------------------------------------------------------

void replay_layout_build(const mtrl_traj *t, replay_layout *L) {
    memset(L, 0, sizeof *L);
    size_t n = (size_t)t->n_tokens, i = 0, cap = 0, calls = 0;
    while (i < n && t->kind[i] == MTRL_TOK_PROMPT) i++;
    L->prompt_end = i;
    while (i < n) {
        if (t->kind[i] != MTRL_TOK_MODEL) {
            L->n_other++;
            i++;
            continue;
        }
        if (L->n_turns == cap) {
            cap = cap ? 2 * cap : 8;
            L->turns = xrealloc(L->turns, sizeof *L->turns * cap);
        }
        replay_turn *u = &L->turns[L->n_turns++];
        memset(u, 0, sizeof *u);
        u->begin = i;
        u->open = u->close = -1;
        u->tool = -1;
        for (; i < n && t->kind[i] == MTRL_TOK_MODEL; i++) {
            uint32_t id = t->ids[i];
            if (id == MTRL_TOK_TOOL_OPEN && u->open < 0) u->open = (long)i;
            else if (id == MTRL_TOK_TOOL_CLOSE && u->open >= 0) {
                u->close = (long)i++;
                break;
            } else if (id == MTRL_TOK_EOS) {
                u->eos = 1;
                i++;
                break;
            }
        }
        u->end = i;
        if (u->close >= 0) {
            // the k-th closed call is the tool log entry of turn k
            for (uint32_t k = 0; k < t->n_tools; k++)
                if (t->tools[k].turn == calls) {
                    u->tool = (long)k;
                    break;
                }
            calls++;
        }
        u->obs_begin = i;
        while (i < n && t->kind[i] == MTRL_TOK_TOOL) i++;
        u->obs_end = i;
    }
}

void replay_layout_free(replay_layout *L) {
    free(L->turns);
    memset(L, 0, sizeof *L);
}

// ---- the human view -----------------------------------------------------------------------------

static void rule_(const char *title, const char *col, const char *extra) {
    printf("\n%s── %s%s", col, title, C_RESET);
    if (extra && extra[0]) printf(" %s(%s)%s", C_DIM, extra, C_RESET);
    printf("\n");
}

// Indented block: the ids' text with every new line indented.
static void block_ids_(const uint32_t *ids, size_t n, const char *col) {
    char *buf = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&buf, &len);
    replay_put_ids(m, ids, n, colour_, 0);
    fclose(m);
    printf("   %s", col);
    for (size_t i = 0; i < len; i++) {
        putchar(buf[i]);
        if (buf[i] == '\n') printf("%s   %s", C_RESET, col);
    }
    printf("%s\n", C_RESET);
    free(buf);
}

static void block_bytes_(const char *label, const uint8_t *b, size_t n, const char *col) {
    printf("   %-11s %s", label, col);
    char *buf = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&buf, &len);
    replay_put_bytes(m, b, n, 0);
    fclose(m);
    for (size_t i = 0; i < len; i++) {
        putchar(buf[i]);
        if (buf[i] == '\n') printf("%s   %-11s %s", C_RESET, "", col);
    }
    if (n == 0) printf("%s(empty)", C_DIM);
    printf("%s\n", C_RESET);
    free(buf);
}

static const char *status_col_(mtrl_ep_status st) {
    switch (st) {
    case MTRL_EP_COMPLETE: return C_GREEN;
    case MTRL_EP_TRUNCATED: return C_YELLOW;
    default: return C_RED;
    }
}

static void print_header_(const replay_session *s) {
    const mtrl_store_episode *e = &s->row;
    printf("%sepisode %" PRIu64 "%s  run %lld (%s, %s)", C_BOLD, e->id, C_RESET, (long long)s->run, s->run_row.name,
           mtrl_run_status_name(s->run_row.status));
    if (e->step >= 0) printf(", committed at learner step %lld", (long long)e->step);
    printf("\n");
    printf("   group       %" PRIu64 "\n", e->group_id);
    printf("   actor       %u, incarnation %u\n", e->actor, e->incarnation);
    printf("   env         %s, task seed %" PRIu64 "\n", e->env[0] ? e->env : "-", e->seed);
    printf("   status      %s%s%s", status_col_(e->status), mtrl_ep_status_name(e->status), C_RESET);
    char eb[512];
    if (e->abort_reason[0]) printf(": %s", esc_(e->abort_reason, eb, sizeof eb));
    printf("\n   reward      %g\n", e->reward);
    printf("   tokens      %lld, %lld of them model tokens", (long long)e->tokens, (long long)e->model_tokens);
    if (s->have_traj) {
        size_t nk[4] = {0};
        for (uint64_t i = 0; i < s->t.n_tokens; i++)
            if (s->t.kind[i] < 4) nk[s->t.kind[i]]++;
        printf(" (%zu prompt, %zu tool", nk[0], nk[2]);
        if (nk[3]) printf(", %zu pad", nk[3]);
        printf(")");
    }
    printf("\n   versions    ");
    if (e->model_tokens == 0) printf("- (no model tokens)");
    else if (e->version_min == e->version_max) printf("%u", e->version_min);
    else printf("%u..%u (the weights changed during the episode)", e->version_min, e->version_max);
    printf("\n   tool calls  %lld\n", (long long)e->tool_calls);
    char t0[64];
    mtrl_time_utc(e->started, t0, (int)sizeof t0);
    printf("   wall        %s", t0);
    if (e->ended > 0 && e->started > 0) printf(", %.3f s", e->ended - e->started);
    printf("\n");
    if (s->have_traj)
        printf("   trajectory  %s @ byte %lld, digest %016" PRIx64 "\n", s->traj_file, (long long)e->traj_offset, e->digest);
    else
        printf("   trajectory  %snone: the learner kept no file for this episode%s (digest %016" PRIx64 ")\n", C_YELLOW,
               C_RESET, e->digest);
}

static void print_tool_(const mtrl_traj *t, long k, size_t ordinal) {
    const mtrl_tool_call *c = &t->tools[k];
    char title[256], extra[256];
    char eb[512];
    snprintf(title, sizeof title, "tool call %zu: %s", ordinal,
             c->name && c->name[0] ? esc_(c->name, eb, sizeof eb) : "(unnamed)");
    if (c->error && c->error[0])
        snprintf(extra, sizeof extra, "status %d, error, %.3f ms", c->status, c->latency * 1e3);
    else snprintf(extra, sizeof extra, "ok, %.3f ms", c->latency * 1e3);
    rule_(title, C_MAGENTA, extra);
    block_bytes_("arguments", c->args, c->args_len, C_MAGENTA);
    block_bytes_("result", c->result, c->result_len, C_MAGENTA);
    if (c->error && c->error[0]) printf("   %-11s %s%s%s\n", "error", C_RED, esc_(c->error, eb, sizeof eb), C_RESET);
}

// Whether the observation tokens [b, e) are RESULT_OPEN result RESULT_CLOSE for this result.
static int obs_is_result_(const mtrl_traj *t, size_t b, size_t e, const mtrl_tool_call *c) {
    size_t pic = 0; // a picture that came with the result follows its text
    while (e >= b + 3 + pic && mtrl_img_token_is(t->ids[e - 2 - pic])) pic++;
    if (e - b != (size_t)c->result_len + 2 + pic) return 0;
    if (t->ids[b] != MTRL_TOK_RESULT_OPEN || t->ids[e - 1] != MTRL_TOK_RESULT_CLOSE) return 0;
    for (size_t i = 0; i < c->result_len; i++)
        if (t->ids[b + 1 + i] != c->result[i]) return 0;
    return 1;
}

// The episode's pictures (docs/multimodal.md): each once, with its size, patch rows and digest,
// a one-line summary of its colours, and with --images DIR the PNG written there.
static int print_pictures_(const mtrl_traj *t, const char *dir) {
    if (!t->n_images) return 0;
    char extra[64];
    snprintf(extra, sizeof extra, "%u stored once each, patches of %u x %u", t->n_images, t->image_patch,
             t->image_patch);
    rule_("pictures", C_MAGENTA, extra);
    int rc = 0;
    for (uint32_t i = 0; i < t->n_images; i++) {
        const mtrl_traj_image *im = &t->images[i];
        size_t np = mtrl_image_patch_count(im->width, im->height, (int)t->image_patch), px = (size_t)im->width * im->height;
        double sum[3] = {0, 0, 0};
        size_t lit = 0;
        for (size_t k = 0; k < px; k++) {
            const uint8_t *p = im->rgb + 3 * k;
            for (int c = 0; c < 3; c++) sum[c] += p[c];
            lit += p[0] + p[1] + p[2] > 0;
        }
        char hex[17];
        mtrl_hash64_hex(im->digest, hex);
        printf("   picture %u  %u x %u pixels, patch rows %u..%zu, digest %s, mean RGB (%.0f, %.0f, %.0f), %zu of %zu "
               "pixels not black\n", i + 1, im->width, im->height, im->first_patch, im->first_patch + np - 1, hex,
               sum[0] / (double)px, sum[1] / (double)px, sum[2] / (double)px, lit, px);
        if (!dir) continue;
        char path[4096], why[4200];
        snprintf(path, sizeof path, "%s/ep%llu-%s.png", dir, (unsigned long long)t->episode_id, hex);
        if (replay_png_write(path, im->rgb, im->width, im->height, why, sizeof why) == 0) {
            printf("               png %s\n", path);
        } else {
            fprintf(stderr, "mtrl replay: --images: %s\n", why);
            rc = 1;
        }
    }
    return rc;
}

static void print_versions_(const mtrl_traj *t, size_t b, size_t e, char *out, size_t cap) {
    uint32_t lo = UINT32_MAX, hi = 0;
    for (size_t i = b; i < e; i++) {
        if (t->version[i] < lo) lo = t->version[i];
        if (t->version[i] > hi) hi = t->version[i];
    }
    if (b >= e) out[0] = 0;
    else if (lo == hi) snprintf(out, cap, "v%u", lo);
    else snprintf(out, cap, "v%u..v%u", lo, hi);
}

static void print_body_(const replay_session *s) {
    const mtrl_traj *t = &s->t;
    replay_layout L;
    replay_layout_build(t, &L);
    char extra[256];
    snprintf(extra, sizeof extra, "%zu tokens", L.prompt_end);
    rule_("prompt", C_BLUE, extra);
    block_ids_(t->ids, L.prompt_end, "");
    size_t ordinal = 0;
    int *shown = xcalloc(t->n_tools ? t->n_tools : 1, sizeof(int));
    for (size_t k = 0; k < L.n_turns; k++) {
        const replay_turn *u = &L.turns[k];
        char ver[64];
        print_versions_(t, u->begin, u->end, ver, sizeof ver);
        const char *what = u->eos ? "answer, turn" : "model turn";
        char title[64];
        snprintf(title, sizeof title, "%s %zu%s", what, k + 1, !u->eos && u->close < 0 ? ", cut off" : "");
        snprintf(extra, sizeof extra, "%zu tokens, %s", u->end - u->begin, ver);
        rule_(title, C_GREEN, extra);
        if (u->close >= 0) {
            size_t pre = (size_t)u->open - u->begin;
            if (pre) block_ids_(t->ids + u->begin, pre, C_GREEN);
            printf("   %scall%s        %s", C_BOLD, C_RESET, C_CYAN);
            replay_put_ids(stdout, t->ids + u->open, (size_t)(u->close - u->open + 1), colour_, 1);
            printf("%s\n", C_RESET);
        } else {
            block_ids_(t->ids + u->begin, u->end - u->begin, C_GREEN);
        }
        if (u->close >= 0) {
            ordinal++;
            if (u->tool >= 0) {
                print_tool_(t, u->tool, ordinal);
                shown[u->tool] = 1;
            } else {
                snprintf(title, sizeof title, "tool call %zu", ordinal);
                rule_(title, C_MAGENTA, "no entry in the tool-call log");
            }
        }
        if (u->obs_end > u->obs_begin) {
            size_t no = u->obs_end - u->obs_begin;
            if (u->tool >= 0 && obs_is_result_(t, u->obs_begin, u->obs_end, &t->tools[u->tool])) {
                printf("   %-11s %s%zu tokens: the result between %s and %s%s\n", "observed", C_DIM, no, "<|result|>",
                       "<|/result|>", C_RESET);
            } else {
                printf("   %-11s %s%zu tokens%s", "observed", C_DIM, no, C_RESET);
                if (u->tool >= 0) printf(" %s(differs from the result: cut to the token budget)%s", C_YELLOW, C_RESET);
                printf("\n   %s", C_MAGENTA);
                replay_put_ids(stdout, t->ids + u->obs_begin, no, colour_, 1);
                printf("%s\n", C_RESET);
            }
        } else if (u->close >= 0 && u->tool >= 0 && !(t->tools[u->tool].error && t->tools[u->tool].error[0])) {
            printf("   %-11s %s(none: the env ended the episode, or no token budget was left)%s\n", "observed", C_DIM,
                   C_RESET);
        }
    }
    // tool-log entries no turn claimed (a call whose turn numbering disagrees with the tokens)
    for (uint32_t k = 0; k < t->n_tools; k++)
        if (!shown[k]) print_tool_(t, (long)k, ++ordinal);
    free(shown);
    if (L.n_other) printf("\n   %s%zu tokens outside the prompt/turn/observation pattern (see --tokens)%s\n", C_YELLOW,
                          L.n_other, C_RESET);
    rule_("end", status_col_(t->status), "");
    printf("   status      %s%s%s", status_col_(t->status), mtrl_ep_status_name(t->status), C_RESET);
    char eb[512];
    if (t->reason && t->reason[0]) printf(": %s", esc_(t->reason, eb, sizeof eb));
    printf("\n   reward      %g\n", t->reward);
    if (t->n_turn_rewards) {
        printf("   per turn    ");
        for (uint32_t k = 0; k < t->n_turn_rewards; k++) printf("%s%g", k ? ", " : "", t->turn_rewards[k]);
        printf("\n");
    }
    replay_layout_free(&L);
}

// The store row's tool calls, for an episode without a trajectory file.
static void print_row_tools_(replay_session *s) {
    sqlite3 *db = mtrl_store_sqlite(s->store);
    sqlite3_stmt *st = NULL;
    if (sqlite3_prepare_v2(db,
                           "SELECT turn, name, latency, status, bytes_in, bytes_out, error FROM tool_calls "
                           "WHERE run = ? AND episode = ? ORDER BY turn",
                           -1, &st, NULL) != SQLITE_OK)
        return;
    sqlite3_bind_int64(st, 1, s->run);
    sqlite3_bind_int64(st, 2, (sqlite3_int64)s->row.id);
    int n = 0;
    while (sqlite3_step(st) == SQLITE_ROW) {
        if (!n++) rule_("tool calls (from the run store; arguments and results live only in trajectory files)",
                        C_MAGENTA, "");
        const char *name = (const char *)sqlite3_column_text(st, 1), *e = (const char *)sqlite3_column_text(st, 6);
        printf("   turn %d  %-10s %8.3f ms  status %d  %lld bytes in, %lld bytes out%s%s%s%s\n", sqlite3_column_int(st, 0),
               name ? name : "", sqlite3_column_double(st, 2) * 1e3, sqlite3_column_int(st, 3),
               (long long)sqlite3_column_int64(st, 4), (long long)sqlite3_column_int64(st, 5), e ? "  " : "",
               e ? C_RED : "", e ? e : "", e ? C_RESET : "");
    }
    sqlite3_finalize(st);
}

static void print_tokens_(const replay_session *s, const replay_rescore *r) {
    const mtrl_traj *t = &s->t;
    rule_("tokens", C_BOLD, "logp = behaviour log-prob (the actor's); version = weights that produced it");
    printf("   %6s %5s  %-12s %-6s %12s %7s", "index", "id", "text", "kind", "logp", "version");
    if (r) printf(" %12s %11s", "learner", "delta");
    printf("\n");
    for (uint64_t i = 0; i < t->n_tokens; i++) {
        char txt[32], q[40];
        replay_token_text(t->ids[i], txt, sizeof txt);
        snprintf(q, sizeof q, t->ids[i] < 256 ? "'%s'" : "%s", txt);
        const char *col = t->kind[i] == MTRL_TOK_MODEL ? C_GREEN : t->kind[i] == MTRL_TOK_TOOL ? C_MAGENTA : "";
        printf("   %6" PRIu64 " %5u  %s%-12s%s %-6s", i, t->ids[i], col, q, C_RESET, kind_name_(t->kind[i]));
        if (t->kind[i] == MTRL_TOK_MODEL) printf(" %12.6f", (double)t->logprob[i]);
        else printf(" %12s", "-");
        printf(" %7u", t->version[i]);
        if (r && r->mask[i])
            printf(" %12.6f %11.3e", (double)r->learner[i], (double)r->learner[i] - (double)t->logprob[i]);
        printf("\n");
    }
}

// ---- rescore and re-execution views -------------------------------------------------------------

static void put_e_(double v, int n) {
    if (n == 0) printf(" %10s", "-");
    else printf(" %10.3e", v);
}

static void print_bin_row_(const char *label, const mtrl_algo_mismatch_bin *b) {
    char pos[48];
    snprintf(pos, sizeof pos, "[%zu, %zu)", b->begin, b->end);
    printf("   %6s %14s %6zu", label, pos, b->n);
    put_e_(b->absdiff_mean, (int)b->n);
    put_e_(b->absdiff_max, (int)b->n);
    put_e_(b->k1, (int)b->n);
    put_e_(b->k3, (int)b->n);
    printf("\n");
}

static void turn_mismatch_(const replay_rescore *r, const replay_turn *u, const mtrl_traj *t, mtrl_algo_mismatch *m,
                           const float *learner) {
    size_t b = u->begin, e = u->end;
    mtrl_algo_mismatch_report(learner + b, t->logprob + b, r->mask + b, e - b, 1, NULL, 0, m);
    m->all.begin = b;
    m->all.end = e;
}

static void print_rescore_(const replay_session *s, const replay_rescore *r) {
    const mtrl_traj *t = &s->t;
    rule_("rescore", C_BOLD, "learner log-probs of the recorded tokens vs the actor's behaviour log-probs");
    printf("   weights     %s\n", r->source);
    for (size_t i = 0; i < r->n_w; i++) {
        const replay_weights *w = &r->w[i];
        printf("               tokens of version %u: ", w->want);
        if (w->initial) printf("initial weights re-created from [run] seed (%s)\n", w->note);
        else if (w->found) printf("%s (%s)\n", w->path, w->note);
        else printf("%s%s%s: version %u, %s\n", C_YELLOW, w->note, C_RESET, w->used, w->path);
    }
    const mtrl_algo_mismatch_bin *a = &r->mm.all;
    printf("   scored      %zu model tokens of %zu (learner forward, [learner] segment %s)\n", a->n, r->T,
           s->have_cfg ? s->cfg.learner.segment : "auto");
    if (r->routing_note[0]) printf("   routing     %s\n", r->routing_note);
    if (a->n == 0) {
        printf("   mismatch    - (no model tokens)\n");
        return;
    }
    printf("   mismatch    mean |Δ log p| %s%.3e%s, max |Δ log p| %.3e, k1 %.3e, k3 %.3e\n", C_BOLD, a->absdiff_mean,
           C_RESET, a->absdiff_max, a->k1, a->k3);
    printf("               Δ = learner − behaviour per model token; k1 = mean(−Δ), k3 = mean(e^−Δ − 1 + Δ)\n");
    if (r->adjusted) {
        const mtrl_algo_mismatch_bin *b = &r->mm_adj.all;
        printf("   sampling    the actor sampled at temperature %g, top-p %g: its log-probs are of that distribution.\n"
               "               Under the same transform the learner gives mean |Δ| %.3e, max %.3e, k1 %.3e, k3 %.3e\n"
               "               (the figures above are against the learner's temperature-1 log-probs, as training uses).\n",
               r->temperature, r->top_p, b->absdiff_mean, b->absdiff_max, b->k1, b->k3);
    }
    printf("\n   by position (%zu bins over %zu tokens)\n", r->mm.n_bins, r->T);
    printf("   %6s %14s %6s %10s %10s %10s %10s\n", "bin", "positions", "model", "mean|Δ|", "max|Δ|", "k1", "k3");
    for (size_t b = 0; b < r->mm.n_bins; b++) {
        char lab[24];
        snprintf(lab, sizeof lab, "%zu", b);
        print_bin_row_(lab, &r->mm.bins[b]);
    }
    replay_layout L;
    replay_layout_build(t, &L);
    printf("\n   by turn\n");
    printf("   %6s %14s %6s %10s %10s %10s %10s\n", "turn", "positions", "model", "mean|Δ|", "max|Δ|", "k1", "k3");
    for (size_t k = 0; k < L.n_turns; k++) {
        mtrl_algo_mismatch m;
        turn_mismatch_(r, &L.turns[k], t, &m, r->learner);
        char lab[24];
        snprintf(lab, sizeof lab, "%zu", k + 1);
        print_bin_row_(lab, &m.all);
    }
    replay_layout_free(&L);
    printf("\n   worst tokens (largest |Δ|)\n");
    printf("   %4s %6s %5s  %-12s %12s %12s %11s %7s\n", "rank", "pos", "id", "text", "behaviour", "learner", "Δ",
           "version");
    for (size_t k = 0; k < r->mm.n_worst; k++) {
        size_t p = r->worst[k];
        char txt[32], q[40];
        replay_token_text(t->ids[p], txt, sizeof txt);
        snprintf(q, sizeof q, t->ids[p] < 256 ? "'%s'" : "%s", txt);
        printf("   %4zu %6zu %5u  %-12s %12.6f %12.6f %11.3e %7u", k + 1, p, t->ids[p], q, (double)t->logprob[p],
               (double)r->learner[p], (double)r->learner[p] - (double)t->logprob[p], t->version[p]);
        if (r->used[p] != t->version[p]) printf(" (scored with v%u)", r->used[p]);
        printf("\n");
    }
}

static const char *diverge_name_(replay_diverge k) {
    switch (k) {
    case REPLAY_SAME: return "identical";
    case REPLAY_DIV_LOGITS: return "logits";
    case REPLAY_DIV_ENV: return "env";
    case REPLAY_DIV_VERSION: return "version";
    case REPLAY_DIV_LENGTH: return "length";
    case REPLAY_DIV_SUMMARY: return "summary";
    case REPLAY_DIV_DIGEST: return "digest";
    case REPLAY_DIV_ROUTING: return "routing";
    }
    return "?";
}

static void print_reexec_(const replay_reexec *r) {
    rule_("re-execution", C_BOLD, "the episode run again from its env seed and sampling stream");
    printf("   weights     %s\n", r->weights);
    if (r->note[0]) printf("   note        %s%s%s\n", C_YELLOW, r->note, C_RESET);
    printf("   re-run      %" PRIu64 " tokens, %" PRIu64 " model, status %s, reward %g\n", r->re.n_tokens, r->re.n_model,
           mtrl_ep_status_name(r->re.status), r->re.reward);
    if (r->prefix_ok) {
        printf("   result      %sidentical over the %ld recorded tokens%s (the recording stopped early)\n", C_GREEN, r->at,
               C_RESET);
        printf("               %s\n", r->why);
    } else if (r->kind == REPLAY_SAME) {
        printf("   result      %sidentical%s", C_GREEN, C_RESET);
        printf(": every token id, kind, behaviour log-prob and version equal; same status, reward%s\n",
               r->re.n_images ? " and pictures" : "");
        if (r->why[0]) printf("               %s\n", r->why);
    } else {
        printf("   result      %sdiverges%s (%s)", C_RED, C_RESET, diverge_name_(r->kind));
        if (r->at >= 0) printf(" at token %ld", r->at);
        printf("\n");
        // indent each line of the explanation
        const char *p = r->why;
        while (*p) {
            const char *nl = strchr(p, '\n');
            int len = nl ? (int)(nl - p) : (int)strlen(p);
            printf("               %.*s\n", len, p);
            p += len + (nl ? 1 : 0);
        }
    }
}

// ---- JSON view ----------------------------------------------------------------------------------

static void json_bin_(FILE *f, const mtrl_algo_mismatch_bin *b) {
    fprintf(f, "{\"begin\":%zu,\"end\":%zu,\"n\":%zu,\"absdiff_mean\":", b->begin, b->end, b->n);
    json_num_(f, b->absdiff_mean);
    fputs(",\"absdiff_max\":", f);
    json_num_(f, b->absdiff_max);
    fputs(",\"k1\":", f);
    json_num_(f, b->k1);
    fputs(",\"k3\":", f);
    json_num_(f, b->k3);
    fputc('}', f);
}

static void json_tool_(FILE *f, const mtrl_tool_call *c) {
    fprintf(f, "{\"turn\":%u,\"name\":", c->turn);
    json_str_(f, c->name);
    fputs(",\"arguments\":", f);
    json_bytes_(f, c->args, c->args_len);
    fputs(",\"result\":", f);
    json_bytes_(f, c->result, c->result_len);
    fputs(",\"latency\":", f);
    json_num_(f, c->latency);
    fprintf(f, ",\"status\":%d,\"error\":", c->status);
    if (c->error && c->error[0]) json_str_(f, c->error);
    else fputs("null", f);
    fputc('}', f);
}

static void print_json_(const replay_session *s, const replay_rescore *rs, const char *rs_err, const replay_reexec *rx,
                        const char *rx_err) {
    FILE *f = stdout;
    const mtrl_store_episode *e = &s->row;
    fprintf(f, "{\"run\":%lld,\"run_name\":", (long long)s->run);
    json_str_(f, s->run_row.name);
    fprintf(f, ",\"episode\":%" PRIu64 ",\"group\":%" PRIu64 ",\"actor\":%u,\"incarnation\":%u,\"env\":", e->id,
            e->group_id, e->actor, e->incarnation);
    json_str_(f, e->env);
    fprintf(f, ",\"task_seed\":%" PRIu64 ",\"status\":", e->seed);
    json_str_(f, mtrl_ep_status_name(e->status));
    fputs(",\"reason\":", f);
    if (e->abort_reason[0]) json_str_(f, e->abort_reason);
    else fputs("null", f);
    fputs(",\"reward\":", f);
    json_num_(f, e->reward);
    fprintf(f, ",\"tokens\":%lld,\"model_tokens\":%lld,\"tool_calls\":%lld", (long long)e->tokens,
            (long long)e->model_tokens, (long long)e->tool_calls);
    if (e->model_tokens > 0) fprintf(f, ",\"version_min\":%u,\"version_max\":%u", e->version_min, e->version_max);
    else fputs(",\"version_min\":null,\"version_max\":null", f);
    fputs(",\"step\":", f);
    if (e->step >= 0) fprintf(f, "%lld", (long long)e->step);
    else fputs("null", f);
    fprintf(f, ",\"digest\":\"%016" PRIx64 "\",\"started\":", e->digest);
    json_num_(f, e->started);
    fputs(",\"ended\":", f);
    json_num_(f, e->ended);
    fputs(",\"trajectory\":", f);
    if (!s->have_traj) {
        fputs("null", f);
    } else {
        const mtrl_traj *t = &s->t;
        fputs("{\"path\":", f);
        json_str_(f, s->traj_file);
        fprintf(f, ",\"offset\":%lld,\"sample_seed\":%" PRIu64 ",\"sample_stream\":%" PRIu64 ",\"text\":",
                (long long)e->traj_offset, t->sample_seed, t->sample_stream);
        json_ids_text_(f, t->ids, (size_t)t->n_tokens);
        fputs(",\"turn_rewards\":[", f);
        for (uint32_t k = 0; k < t->n_turn_rewards; k++) {
            if (k) fputc(',', f);
            json_num_(f, t->turn_rewards[k]);
        }
        fputs("],\"segments\":[", f);
        replay_layout L;
        replay_layout_build(t, &L);
        fprintf(f, "{\"type\":\"prompt\",\"begin\":0,\"end\":%zu,\"text\":", L.prompt_end);
        json_ids_text_(f, t->ids, L.prompt_end);
        fputc('}', f);
        for (size_t k = 0; k < L.n_turns; k++) {
            const replay_turn *u = &L.turns[k];
            fprintf(f, ",{\"type\":\"%s\",\"turn\":%zu,\"begin\":%zu,\"end\":%zu,\"text\":",
                    u->eos ? "answer" : u->close >= 0 ? "tool_call" : "cut", k + 1, u->begin, u->end);
            json_ids_text_(f, t->ids + u->begin, u->end - u->begin);
            fputs(",\"tool\":", f);
            if (u->tool >= 0) json_tool_(f, &t->tools[u->tool]);
            else fputs("null", f);
            fputc('}', f);
            if (u->obs_end > u->obs_begin) {
                fprintf(f, ",{\"type\":\"observation\",\"turn\":%zu,\"begin\":%zu,\"end\":%zu,\"text\":", k + 1,
                        u->obs_begin, u->obs_end);
                json_ids_text_(f, t->ids + u->obs_begin, u->obs_end - u->obs_begin);
                fputc('}', f);
            }
        }
        replay_layout_free(&L);
        fputs("],\"tools\":[", f);
        for (uint32_t k = 0; k < t->n_tools; k++) {
            if (k) fputc(',', f);
            json_tool_(f, &t->tools[k]);
        }
        fputs("],\"ids\":[", f);
        for (uint64_t i = 0; i < t->n_tokens; i++) fprintf(f, "%s%u", i ? "," : "", t->ids[i]);
        fputs("],\"kind\":[", f);
        for (uint64_t i = 0; i < t->n_tokens; i++) fprintf(f, "%s\"%s\"", i ? "," : "", kind_name_(t->kind[i]));
        fputs("],\"logprob\":[", f);
        for (uint64_t i = 0; i < t->n_tokens; i++) {
            if (i) fputc(',', f);
            json_f32_(f, t->logprob[i]);
        }
        fputs("],\"version\":[", f);
        for (uint64_t i = 0; i < t->n_tokens; i++) fprintf(f, "%s%u", i ? "," : "", t->version[i]);
        fputs("]}", f);
    }
    if (rs || rs_err) {
        fputs(",\"rescore\":", f);
        if (!rs) {
            fputs("{\"error\":", f);
            json_str_(f, rs_err);
            fputc('}', f);
        } else {
            fputs("{\"source\":", f);
            json_str_(f, rs->source);
            fputs(",\"weights\":[", f);
            for (size_t i = 0; i < rs->n_w; i++) {
                const replay_weights *w = &rs->w[i];
                fprintf(f, "%s{\"version\":%u,\"used\":%u,\"exact\":%s,\"initial\":%s,\"path\":", i ? "," : "", w->want,
                        w->used, w->found ? "true" : "false", w->initial ? "true" : "false");
                json_str_(f, w->path);
                fputs(",\"note\":", f);
                json_str_(f, w->note);
                fputc('}', f);
            }
            fprintf(f, "],\"routing_replayed\":%s,\"all\":", rs->routing ? "true" : "false");
            json_bin_(f, &rs->mm.all);
            if (rs->adjusted) {
                fprintf(f, ",\"temperature\":%.17g,\"top_p\":%.17g,\"all_sampling_adjusted\":", rs->temperature,
                        rs->top_p);
                json_bin_(f, &rs->mm_adj.all);
            }
            fputs(",\"bins\":[", f);
            for (size_t b = 0; b < rs->mm.n_bins; b++) {
                if (b) fputc(',', f);
                json_bin_(f, &rs->mm.bins[b]);
            }
            fputs("],\"turns\":[", f);
            replay_layout L;
            replay_layout_build(&s->t, &L);
            for (size_t k = 0; k < L.n_turns; k++) {
                mtrl_algo_mismatch m;
                turn_mismatch_(rs, &L.turns[k], &s->t, &m, rs->learner);
                if (k) fputc(',', f);
                json_bin_(f, &m.all);
            }
            replay_layout_free(&L);
            fputs("],\"worst\":[", f);
            for (size_t k = 0; k < rs->mm.n_worst; k++) {
                size_t p = rs->worst[k];
                char txt[32];
                replay_token_text(s->t.ids[p], txt, sizeof txt);
                fprintf(f, "%s{\"pos\":%zu,\"id\":%u,\"text\":", k ? "," : "", p, s->t.ids[p]);
                json_str_(f, txt);
                fputs(",\"behaviour\":", f);
                json_f32_(f, s->t.logprob[p]);
                fputs(",\"learner\":", f);
                json_f32_(f, rs->learner[p]);
                fputs(",\"delta\":", f);
                json_num_(f, (double)rs->learner[p] - (double)s->t.logprob[p]);
                fprintf(f, ",\"version\":%u,\"scored_with\":%u}", s->t.version[p], rs->used[p]);
            }
            fputs("],\"learner\":[", f);
            for (size_t i = 0; i < rs->T; i++) {
                if (i) fputc(',', f);
                if (rs->mask[i]) json_f32_(f, rs->learner[i]);
                else fputs("null", f);
            }
            fputs("]}", f);
        }
    }
    if (rx || rx_err) {
        fputs(",\"reexec\":", f);
        if (!rx) {
            fputs("{\"error\":", f);
            json_str_(f, rx_err);
            fputc('}', f);
        } else {
            fprintf(f, "{\"identical\":%s,\"result\":\"%s\",\"at\":", rx->kind == REPLAY_SAME ? "true" : "false",
                    rx->prefix_ok ? "prefix" : diverge_name_(rx->kind));
            if (rx->at >= 0) fprintf(f, "%ld", rx->at);
            else fputs("null", f);
            fprintf(f, ",\"version\":%u,\"weights\":", rx->version);
            json_str_(f, rx->weights);
            fputs(",\"note\":", f);
            json_str_(f, rx->note);
            fputs(",\"why\":", f);
            json_str_(f, rx->why);
            fprintf(f, ",\"tokens\":%" PRIu64 ",\"status\":", rx->re.n_tokens);
            json_str_(f, mtrl_ep_status_name(rx->re.status));
            fputs(",\"reward\":", f);
            json_num_(f, rx->re.reward);
            fputc('}', f);
        }
    }
    fputs("}\n", f);
}

// ---- the command --------------------------------------------------------------------------------

static int parse_u64_(const char *s, uint64_t *out) {
    if (!s || !*s || *s == '-') return 0;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || *end) return 0;
    *out = (uint64_t)v;
    return 1;
}

int cmd_replay(int argc, char **argv) {
    const char *db = NULL, *ckpt = NULL, *images = NULL;
    uint64_t id = 0, u;
    int have_id = 0, have_run = 0, tokens = 0, json = 0, rescore = 0, reexec = 0, have_version = 0;
    int64_t run = 0;
    uint32_t version = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int has_val = i + 1 < argc;
        if (cli_is_help(a)) {
            printf("usage: %s\n\n"
                   "Shows one recorded episode: header, prompt, model turns, tool calls (arguments, result,\n"
                   "latency, error), the answer, rewards and status. Colour on a terminal unless NO_COLOR is set.\n"
                   "  --run RUN        the run (default: the newest run holding the episode)\n"
                   "  --tokens         a per-token table: index, id, text, kind, behaviour log-prob, version\n"
                   "  --json           one JSON object on stdout\n"
                   "  --images DIR     write each picture of the episode as DIR/ep<ID>-<digest>.png\n"
                   "  --rescore        the learner's log-probs of the tokens and the mismatch with the actor's\n"
                   "                   (by default under the weights of each token's own version)\n"
                   "  --version V      rescore under the retained checkpoint of version V\n"
                   "  --checkpoint P   rescore under the checkpoint file P\n"
                   "  --reexec         run the episode again (same env seed, sampling stream, weights) and\n"
                   "                   say whether it is identical or where and why it diverges\n"
                   "exit codes: 0 ok, 1 not found / corrupt file / missing checkpoint, 2 bad usage\n",
                   REPLAY_USAGE);
            return 0;
        }
        if (!strcmp(a, "--db")) {
            if (!has_val) return cli_usage_error("replay", REPLAY_USAGE, "--db needs a file");
            db = argv[++i];
        } else if (!strcmp(a, "--episode")) {
            if (!has_val || !parse_u64_(argv[i + 1], &id))
                return cli_usage_error("replay", REPLAY_USAGE, "--episode needs an episode id (an unsigned integer)");
            have_id = 1;
            i++;
        } else if (!strcmp(a, "--run")) {
            if (!has_val || !parse_u64_(argv[i + 1], &u) || u > INT64_MAX)
                return cli_usage_error("replay", REPLAY_USAGE, "--run needs a run id");
            run = (int64_t)u;
            have_run = 1;
            i++;
        } else if (!strcmp(a, "--version")) {
            if (!has_val || !parse_u64_(argv[i + 1], &u) || u > UINT32_MAX)
                return cli_usage_error("replay", REPLAY_USAGE, "--version needs a weight version");
            version = (uint32_t)u;
            have_version = 1;
            i++;
        } else if (!strcmp(a, "--checkpoint")) {
            if (!has_val) return cli_usage_error("replay", REPLAY_USAGE, "--checkpoint needs a file");
            ckpt = argv[++i];
        } else if (!strcmp(a, "--images")) {
            if (!has_val) return cli_usage_error("replay", REPLAY_USAGE, "--images needs a folder");
            images = argv[++i];
        } else if (!strcmp(a, "--tokens")) tokens = 1;
        else if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--rescore")) rescore = 1;
        else if (!strcmp(a, "--reexec")) reexec = 1;
        else return cli_usage_error("replay", REPLAY_USAGE, "unknown option '%s'", a);
    }
    if (!db) return cli_usage_error("replay", REPLAY_USAGE, "--db is required");
    if (!have_id) return cli_usage_error("replay", REPLAY_USAGE, "--episode is required");
    if (have_version && ckpt) return cli_usage_error("replay", REPLAY_USAGE, "--version and --checkpoint exclude each other");
    if ((have_version || ckpt) && !rescore)
        return cli_usage_error("replay", REPLAY_USAGE, "--version and --checkpoint choose the weights of --rescore");
    colour_ = !json && isatty(STDOUT_FILENO) && !getenv("NO_COLOR");

    replay_session s;
    int rc = session_open_(&s, db, have_run, run, id, 0);
    if (rc >= 0) {
        session_free_(&s);
        return rc;
    }
    rc = 0;
    replay_rescore rs;
    replay_reexec rx;
    memset(&rs, 0, sizeof rs);
    memset(&rx, 0, sizeof rx);
    mtrl_traj_init(&rx.re);
    int have_rs = 0, have_rx = 0;
    char rs_err[MTRL_ERROR_MSG_MAX + 64] = "", rx_err[MTRL_ERROR_MSG_MAX + 64] = "";
    mtrl_error err;
    if (rescore) {
        if (!s.have_traj) {
            snprintf(rs_err, sizeof rs_err, "--rescore needs the episode's tokens, and the learner kept no trajectory file for it");
        } else if (!s.have_cfg) {
            snprintf(rs_err, sizeof rs_err, "--rescore needs the run's config: %s", s.cfg_err);
        } else {
            replay_rescore_opts o = {have_version, version, ckpt};
            if (replay_rescore_run(&s, &o, &rs, &err) == MTRL_OK) have_rs = 1;
            else snprintf(rs_err, sizeof rs_err, "--rescore: %s", err.msg);
        }
        if (!have_rs) rc = 1;
    }
    if (reexec) {
        if (!s.have_cfg) snprintf(rx_err, sizeof rx_err, "--reexec needs the run's config: %s", s.cfg_err);
        else if (replay_reexec_run(&s, &rx, &err) == MTRL_OK) have_rx = 1;
        else snprintf(rx_err, sizeof rx_err, "--reexec: %s", err.msg);
        if (!have_rx) rc = 1;
    }

    if (json) {
        print_json_(&s, have_rs ? &rs : NULL, rs_err[0] ? rs_err : NULL, have_rx ? &rx : NULL, rx_err[0] ? rx_err : NULL);
    } else {
        print_header_(&s);
        if (s.have_traj) print_body_(&s);
        else print_row_tools_(&s);
        if (s.have_traj && print_pictures_(&s.t, images)) rc = 1;
        if (tokens && s.have_traj) print_tokens_(&s, have_rs ? &rs : NULL);
        else if (tokens) printf("\n   (--tokens: no trajectory file, no tokens to show)\n");
        if (have_rs) print_rescore_(&s, &rs);
        if (have_rx) print_reexec_(&rx);
    }
    fflush(stdout);
    if (rs_err[0]) fprintf(stderr, "mtrl replay: %s\n", rs_err);
    if (rx_err[0]) fprintf(stderr, "mtrl replay: %s\n", rx_err);
    if (have_rs) replay_rescore_free(&rs);
    replay_reexec_free(&rx);
    session_free_(&s);
    return rc;
}
