// corpus.c: the built-in `corpus` env: a generated corpus of log files explored through tools,
// where the answer needs facts gathered over many tool calls (long horizons, issue 23).
//
// The corpus: `files` files with ids f0000, f0001, ... (at least 4 digits, more for more
// files), each about file_tokens bytes (1 byte = 1 token for the byte-level tokenizer) of
// lines. Most lines are noise records of fixed width
//     t=0048213 k=k03381 v=492011\n
// and every file has, at a seeded line of its own, one line `next=f0042` (the files' next
// links form one seeded cycle through every file) and one line `code=193847`.
// The task (config task=chain|sum|latest, or mix: one of the three per seed):
//     chain   "Start at f0012, follow next= hops times, answer the code of the file you reach"
//             (a k-hop reference chain: each hop is a grep in the current file and an open)
//     sum     "Answer the sum of v over all records with k=k01234": the key is in `hops`
//             records spread over the corpus (aggregation over many files)
//     latest  "The key k01234 is set by `hops` records in no order; the one with the largest t is
//             current: answer its v" (contradicting updates, the latest wins)
//     trail   "Start at f0012; open the file next= names until a file says next=end; answer its
//             code": a chain whose every hop is one open(id,0), because each file's first page ends
//             with its code= and next= lines (not in mix). Why a second chain: in `chain` the id to
//             follow opens a page of noise, so the model must recall it from a page back and count
//             hops; the first GPU runs never learnt that (docs/long-episodes.md). Here each decision
//             is local (copy the id the page ended with, stop at `end`), so what a policy learns at
//             a few hops either holds at a hundred hops and 1M tokens or it does not: the
//             architecture's extrapolation, measured, not the copy from far back.
// The asked-for key never occurs in the noise; the times of its records are distinct.
// Tools (every observation capped at max_obs_bytes):
//     list(skip)                 "fNNNN SIZE\n" per file from the skip-th, as many as fit,
//                                then "more: list(K)" when files are left
//     open(id,offset)            "id @offset of SIZE\n" and the file's bytes from offset, as
//                                many as fit: the tool whose results grow the context
//     grep(scope,text[,skip])    the locations "id@offset\n" (offset of the line) of the lines
//                                containing text, in one file (scope = its id) or every file
//                                (scope = *), from the skip-th match, as many as fit, then
//                                "more: grep(scope,text,K)" when matches are left; text is
//                                1..64 bytes. Locations only: the facts come from open().
// A tool call past max_tool_calls ends the episode with reward 0. The answer is compared
// exactly (surrounding whitespace ignored): chain and latest a 6-digit value as written, sum a
// decimal integer. Reward 1 for the right answer, else 0, or with credit=c > 0: c times the
// fraction of the task's facts the episode's open() results showed whole (chain: the next= line
// of each file on the way and the code= line of the last; sum, latest: the key's records), at
// most c < 1, so the full reward (success) is still the right answer alone. Why: a
// policy that stops after a few calls and answers wrong gets 0 whatever it did, every group's
// rewards are equal and RL has no gradient toward the long horizons the env exists for (the
// first GPU run of experiments/agent-1m.ini: reward 0 at every stage, every gradient 0).
// hops_min=h (0: = hops) draws each episode's hops (records) uniformly in [h, hops] from the seed,
// so demos and tasks do not all take one length and a policy cannot stop by counting.
// Config: task=mix|chain|sum|latest|trail (mix), hops=1..4096 (4), hops_min=0..4096 (0),
//         files=2..65536 (64),
//         file_tokens=256..1048576 (4096; files * file_tokens at most 256 MiB),
//         max_obs_bytes=64..16777216 (2048), max_tool_calls=0..1000 (64), credit=0..0.9 (0).
//         Keys of other built-ins are ignored (env_util.h).
// demo: the tool calls a careful reader makes, then the answer: chain: grep(cur,next=) and
// open(cur,offset) per hop, then grep and open of the last file's code= line (2 hops + 2
// calls); sum and latest: the pages of grep(*,k=KEY) then one open per location (pages + hops
// calls). With max_obs_bytes of a few thousand, an episode grows by that much per open: hops
// of 64 at 8192 bytes is 130 calls and about 1M tokens.
// Generation is a loop over fixed-width fields without printf: ~40 ms for 16 MiB of corpus.
#ifndef _GNU_SOURCE
#define _GNU_SOURCE // memmem
#endif
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/rng.h"
#include "env/builtin/builtin.h"
#include "env/env_util.h"

#define CORPUS_TOOLS "list, open, grep"
#define CORPUS_REC_BYTES 27 // "t=" 7 " k=k" 5 " v=" 6 "\n"
#define CORPUS_MAX_BYTES ((size_t)256 << 20)
#define CORPUS_KEY_RANGE 100000u

enum { TASK_CHAIN, TASK_SUM, TASK_LATEST, TASK_MIX, TASK_TRAIL, TASK_COUNT_ };
static const char *const task_names_[] = {"chain", "sum", "latest", "mix", "trail"};

typedef struct corpus_env {
    int task_cfg, hops, hops_min, files, max_tool_calls, idw;
    size_t file_tokens, max_obs_bytes;
    double credit;    // weight of the facts gathered in the reward (0: the answer alone)
    size_t *fact_at;    // [hops + 1]: the task's fact lines, offsets into text, ...
    uint32_t *fact_len; // ... their bytes (without the newline) ...
    uint8_t *fact_seen; // ... and whether an open() showed each whole
    int n_facts, facts_seen;
    env_buf text;     // every file, end to end
    size_t *file_off; // [files + 1]: file f is text[file_off[f] .. file_off[f + 1])
    env_buf prompt, obs, scratch;
    char answer[32];
    // demo: the calls' text end to end (NUL-separated), and the actions pointing into it
    env_buf demo_text;
    mtrl_env_action *demo;
    size_t demo_cap;
    int tool_calls, done;
    // the episode's task and hops (hops_min..hops), for the demo
    int task, start, ep_hops;
    // trail: every file's size, and the bytes of its first page (open(id,0)) after the header
    size_t trail_size, trail_head;
    char key[8];
} corpus_env;

// trail: every file's size and the bytes of its first page after the header, alike for all files,
// so that open(id,0) shows "fNNNN @0 of SIZE\n" and then exactly the head, which ends with the
// code= and next= lines. SIZE's digits are part of the header, so the two are solved together.
static void trail_layout_(corpus_env *e) {
    size_t size = 0, head = 0;
    int digits = 1, settled = 0;
    for (int round = 0; round < 4 && !settled; round++) {
        head = e->max_obs_bytes - ((size_t)(1 + e->idw) + 7 + (size_t)digits + 1); // id, " @0 of ", SIZE, "\n"
        size_t tail = e->file_tokens > head ? (e->file_tokens - head + CORPUS_REC_BYTES - 1) / CORPUS_REC_BYTES : 0;
        size = head + tail * CORPUS_REC_BYTES;
        int d = 1;
        for (size_t x = size; x >= 10; x /= 10) d++;
        settled = d == digits;
        digits = d;
    }
    // max_obs_bytes >= 64 leaves a head of >= 41 bytes: a filler line, code= (12), next= (<= 13)
    MTRL_CHECKF(settled && head >= 2 + 12 + 7 + (size_t)e->idw, "corpus: trail layout of a %zu-byte page", e->max_obs_bytes);
    e->trail_size = size;
    e->trail_head = head;
}

static int corpus_create_(const char *config, void **self, char *err, size_t cap) {
    env_config cfg;
    if (env_config_parse(&cfg, "corpus", config, err, cap)) return MTRL_ENV_ERR;
    long long hops, hops_min, files, ft, max_obs, mtc;
    double credit;
    const char *task = env_config_str(&cfg, "task", "mix");
    int bad = env_config_int(&cfg, "hops", 4, 1, 4096, &hops, err, cap) ||
              env_config_int(&cfg, "hops_min", 0, 0, 4096, &hops_min, err, cap) ||
              env_config_int(&cfg, "files", 64, 2, 65536, &files, err, cap) ||
              env_config_int(&cfg, "file_tokens", 4096, 256, 1 << 20, &ft, err, cap) ||
              env_config_int(&cfg, "max_obs_bytes", 2048, 64, 1 << 24, &max_obs, err, cap) ||
              env_config_int(&cfg, "max_tool_calls", 64, 0, 1000, &mtc, err, cap) ||
              env_config_double(&cfg, "credit", 0.0, 0.0, ENV_CREDIT_MAX, &credit, err, cap);
    int t = -1;
    for (int i = 0; i < TASK_COUNT_; i++)
        if (!strcmp(task, task_names_[i])) t = i;
    if (!bad && t < 0) {
        snprintf(err, cap, "corpus: task='%.40s': use mix, chain, sum, latest or trail", task);
        bad = 1;
    }
    bad = bad || env_config_finish(&cfg, "task, hops, hops_min, files, file_tokens, max_obs_bytes, max_tool_calls, credit",
                                   err, cap);
    env_config_free(&cfg);
    if (bad) return MTRL_ENV_ERR;
    if ((size_t)files * (size_t)ft > CORPUS_MAX_BYTES) {
        snprintf(err, cap, "corpus: files=%lld x file_tokens=%lld is over the 256 MiB a corpus may take", files, ft);
        return MTRL_ENV_ERR;
    }
    if (hops > files * (ft / CORPUS_REC_BYTES)) {
        snprintf(err, cap, "corpus: hops=%lld records do not fit %lld files of %lld records", hops, files,
                 ft / CORPUS_REC_BYTES);
        return MTRL_ENV_ERR;
    }
    if (hops_min > hops) {
        snprintf(err, cap, "corpus: hops_min=%lld is above hops=%lld", hops_min, hops);
        return MTRL_ENV_ERR;
    }
    // A trail visits hops + 1 distinct files of the cycle: it must end before it comes round.
    if (t == TASK_TRAIL && hops >= files) {
        snprintf(err, cap, "corpus: task=trail with hops=%lld needs more than %lld files (hops + 1 distinct files)", hops,
                 files);
        return MTRL_ENV_ERR;
    }
    corpus_env *e = xcalloc(1, sizeof *e);
    e->task_cfg = t;
    e->hops = (int)hops;
    e->hops_min = hops_min > 0 ? (int)hops_min : (int)hops;
    e->files = (int)files;
    e->file_tokens = (size_t)ft;
    e->max_obs_bytes = (size_t)max_obs;
    e->max_tool_calls = (int)mtc;
    e->credit = credit;
    e->fact_at = xcalloc((size_t)hops + 1, sizeof(size_t));
    e->fact_len = xcalloc((size_t)hops + 1, sizeof(uint32_t));
    e->fact_seen = xcalloc((size_t)hops + 1, 1);
    e->idw = 4;
    for (long long r = 10000; r < files; r *= 10) e->idw++;
    e->file_off = xcalloc((size_t)files + 1, sizeof(size_t));
    if (t == TASK_TRAIL) trail_layout_(e);
    e->done = 1;
    *self = e;
    return MTRL_ENV_OK;
}

static void corpus_destroy_(void *self) {
    corpus_env *e = self;
    if (!e) return;
    env_buf_free(&e->text);
    env_buf_free(&e->prompt);
    env_buf_free(&e->obs);
    env_buf_free(&e->scratch);
    env_buf_free(&e->demo_text);
    free(e->file_off);
    free(e->fact_at);
    free(e->fact_len);
    free(e->fact_seen);
    free(e->demo);
    free(e);
}

// ---- generation -----------------------------------------------------------------------------

static void put_digits_(char *p, uint64_t v, int width) {
    for (int i = width - 1; i >= 0; i--) {
        p[i] = (char)('0' + v % 10);
        v /= 10;
    }
}

static void put_id_(const corpus_env *e, char *p, int f) {
    p[0] = 'f';
    put_digits_(p + 1, (uint64_t)f, e->idw);
}

// Writes the record "t=%07u k=k%05u v=%06u\n" at p; returns the end.
static char *put_record_(char *p, uint64_t t, uint64_t kk, uint64_t v) {
    memcpy(p, "t=", 2);
    put_digits_(p + 2, t, 7);
    memcpy(p + 9, " k=k", 4);
    put_digits_(p + 13, kk, 5);
    memcpy(p + 18, " v=", 3);
    put_digits_(p + 21, v, 6);
    p[CORPUS_REC_BYTES - 1] = '\n';
    return p + CORPUS_REC_BYTES;
}

// The r-th noise record of a file whose noise seed is `noise`.
static void noise_record_(uint64_t noise, int r, uint64_t *t, uint64_t *kk, uint64_t *v) {
    uint64_t r1 = env_mix64(noise + 2 * (uint64_t)r), r2 = env_mix64(noise + 2 * (uint64_t)r + 1);
    *t = r1 % 10000000u, *kk = (r1 >> 32) % CORPUS_KEY_RANGE, *v = r2 % 1000000u;
}

static char *put_line_(char *p, const char *what, const char *val, size_t n) {
    memcpy(p, what, 5);
    memcpy(p + 5, val, n);
    p[5 + n] = '\n';
    return p + 6 + n;
}

// A trail file: a filler line, records, code= and next= ending its first page exactly
// (trail_layout_), then records to its size. The last file of the trail says next=end.
static char *put_trail_file_(const corpus_env *e, char *p, int next_id, uint64_t code, uint64_t noise) {
    char *fb = p, id[16], cd[8];
    if (next_id >= 0) put_id_(e, id, next_id);
    put_digits_(cd, code, 6);
    size_t nl = next_id < 0 ? 9 : (size_t)(7 + e->idw), rest = e->trail_head - 12 - nl;
    size_t n1 = (rest - 2) / CORPUS_REC_BYTES, lf = rest - n1 * CORPUS_REC_BYTES;
    *p++ = '#';
    memset(p, '.', lf - 2);
    p += lf - 2;
    *p++ = '\n';
    uint64_t t, kk, v;
    int r = 0;
    for (; r < (int)n1; r++) noise_record_(noise, r, &t, &kk, &v), p = put_record_(p, t, kk, v);
    p = put_line_(p, "code=", cd, 6);
    p = next_id < 0 ? put_line_(p, "next=", "end", 3) : put_line_(p, "next=", id, (size_t)(1 + e->idw));
    MTRL_CHECK((size_t)(p - fb) == e->trail_head);
    for (size_t i = 0, n2 = (e->trail_size - e->trail_head) / CORPUS_REC_BYTES; i < n2; i++, r++)
        noise_record_(noise, r, &t, &kk, &v), p = put_record_(p, t, kk, v);
    return p;
}

// chain and trail follow the next= links (their facts: chain_facts_); sum and latest plant a key.
static int walks_links_(int task) { return task == TASK_CHAIN || task == TASK_TRAIL; }

// One planted record of the asked-for key: file, line index within it, time, value.
typedef struct planted {
    int file, line;
    uint64_t t, v;
} planted;

static void corpus_generate_(corpus_env *e, uint64_t seed) {
    uint64_t stream = mtrl_rng_stream("env.corpus", 0, 0);
    uint64_t ctr = 0;
#define RNG_() mtrl_rng_u64(seed, stream, ctr++)
    int F = e->files;
    e->task = e->task_cfg == TASK_MIX ? (int)(RNG_() % 3) : e->task_cfg;
    // Drawn only when it varies, so that a fixed hops keeps every seed's episode as it was.
    e->ep_hops = e->hops_min < e->hops ? e->hops_min + (int)(RNG_() % (uint64_t)(e->hops - e->hops_min + 1)) : e->hops;
    // The next links: one cycle through a seeded permutation of the files.
    int *perm = xmalloc(sizeof(int) * (size_t)F), *next = xmalloc(sizeof(int) * (size_t)F);
    for (int i = 0; i < F; i++) perm[i] = i;
    for (int i = F - 1; i > 0; i--) {
        int j = (int)(RNG_() % (uint64_t)(i + 1)), x = perm[i];
        perm[i] = perm[j];
        perm[j] = x;
    }
    for (int i = 0; i < F; i++) next[perm[i]] = perm[(i + 1) % F];
    int s = (int)(RNG_() % (uint64_t)F);
    e->start = perm[s];
    int last = perm[(s + e->ep_hops) % F];
    uint64_t key = RNG_() % CORPUS_KEY_RANGE;
    e->key[0] = 'k';
    put_digits_(e->key + 1, key, 5);
    e->key[6] = 0;
    // Lines per file: noise records, the next= and code= lines among them.
    int lines = (int)(e->file_tokens / CORPUS_REC_BYTES);
    // The asked-for key's records: hops of them at distinct record lines spread over the corpus
    // (one seeded line in each of hops equal bins of all record lines); times distinct (one per
    // stride, then shuffled, so file order says nothing about which record is the latest).
    int np = walks_links_(e->task) ? 0 : e->ep_hops;
    planted *pl = xmalloc(sizeof(planted) * (size_t)(np + 1));
    uint64_t stride = 10000000u / (uint64_t)(np + 1), total = (uint64_t)F * (uint64_t)lines;
    for (int i = 0; i < np; i++) {
        uint64_t b0 = total * (uint64_t)i / (uint64_t)np, b1 = total * (uint64_t)(i + 1) / (uint64_t)np;
        uint64_t g = b0 + RNG_() % (b1 - b0);
        pl[i].file = (int)(g / (uint64_t)lines);
        pl[i].line = (int)(g % (uint64_t)lines);
        pl[i].t = (uint64_t)i * stride + RNG_() % stride;
        pl[i].v = RNG_() % 1000000u;
    }
    for (int i = np - 1; i > 0; i--) {
        int j = (int)(RNG_() % (uint64_t)(i + 1));
        uint64_t x = pl[i].t;
        pl[i].t = pl[j].t;
        pl[j].t = x;
    }
    uint64_t sum = 0, best_t = 0, best_v = 0;
    for (int i = 0; i < np; i++) {
        sum += pl[i].v;
        if (i == 0 || pl[i].t > best_t) best_t = pl[i].t, best_v = pl[i].v;
    }
    env_buf_clear(&e->text);
    size_t most = e->task == TASK_TRAIL ? e->trail_size : (size_t)lines * CORPUS_REC_BYTES + 64;
    char *p = env_buf_reserve(&e->text, (size_t)F * most + 64);
    char *base = p;
    int k = 0;
    for (int f = 0; f < F; f++) {
        e->file_off[f] = (size_t)(p - base);
        // lines + 2 lines: the records, and next= and code= at two seeded places among them
        int at_next = (int)(RNG_() % (uint64_t)(lines + 2)), at_code = (int)(RNG_() % (uint64_t)(lines + 1));
        if (at_code >= at_next) at_code++;
        uint64_t code = RNG_() % 1000000u;
        if (f == last && walks_links_(e->task)) {
            put_digits_(e->answer, code, 6);
            e->answer[6] = 0;
        }
        uint64_t noise = RNG_();
        if (e->task == TASK_TRAIL) {
            p = put_trail_file_(e, p, f == last ? -1 : next[f], code, noise);
            continue;
        }
        for (int l = 0, rec = 0; l < lines + 2; l++) {
            if (l == at_next) {
                char id[16];
                put_id_(e, id, next[f]);
                p = put_line_(p, "next=", id, (size_t)(1 + e->idw));
                continue;
            }
            if (l == at_code) {
                char cd[8];
                put_digits_(cd, code, 6);
                p = put_line_(p, "code=", cd, 6);
                continue;
            }
            int r = rec++;
            uint64_t t, kk, v;
            noise_record_(noise, r, &t, &kk, &v);
            int mine = k < np && pl[k].file == f && pl[k].line == r;
            if (mine) {
                t = pl[k].t, kk = key, v = pl[k].v;
                e->fact_at[k] = (size_t)(p - base);
                e->fact_len[k++] = CORPUS_REC_BYTES - 1;
            }
            else if (kk == key) kk = (kk + 1) % CORPUS_KEY_RANGE; // the asked-for key only where planted
            p = put_record_(p, t, kk, v);
        }
    }
    e->file_off[F] = (size_t)(p - base);
    e->text.len = e->file_off[F];
    e->text.data[e->text.len] = 0;
    if (e->task == TASK_SUM) snprintf(e->answer, sizeof e->answer, "%llu", (unsigned long long)sum);
    if (e->task == TASK_LATEST) put_digits_(e->answer, best_v, 6), e->answer[6] = 0;
    e->n_facts = np;
    free(pl);
    free(perm);
    free(next);
#undef RNG_
}

// The location of the first line of file f starting with `what`.
static size_t line_at_(const corpus_env *e, int f, const char *what) {
    const char *fb = e->text.data + e->file_off[f];
    const char *m = memmem(fb, e->file_off[f + 1] - e->file_off[f], what, strlen(what));
    MTRL_CHECKF(m != NULL, "corpus: file %d has no %s line", f, what);
    return (size_t)(m - fb);
}

// The file holding byte pos of the text: the last f with file_off[f] <= pos.
static int file_at_(const corpus_env *e, size_t pos) {
    int lo = 0, hi = e->files - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (e->file_off[mid] <= pos) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// A chain's facts: the next= line of each file on the way, then the code= line of the last.
static void chain_facts_(corpus_env *e) {
    int cur = e->start;
    for (int h = 0; h <= e->ep_hops; h++) {
        const char *what = h < e->ep_hops ? "next=" : "code=";
        size_t off = line_at_(e, cur, what);
        e->fact_at[h] = e->file_off[cur] + off;
        e->fact_len[h] = h < e->ep_hops ? (uint32_t)(6 + e->idw) : 11u;
        if (h < e->ep_hops) {
            int64_t nx;
            MTRL_CHECK(env_parse_i64(e->text.data + e->fact_at[h] + 6, (size_t)e->idw, &nx) == 0);
            cur = (int)nx;
        }
    }
    e->n_facts = e->ep_hops + 1;
}

// Marks the facts that the shown bytes text[a, b) hold whole.
static void facts_shown_(corpus_env *e, size_t a, size_t b) {
    for (int i = 0; i < e->n_facts; i++)
        if (!e->fact_seen[i] && e->fact_at[i] >= a && e->fact_at[i] + e->fact_len[i] <= b) {
            e->fact_seen[i] = 1;
            e->facts_seen++;
        }
}

static int corpus_reset_(void *self, uint64_t seed, mtrl_env_bytes *prompt, char *err, size_t cap) {
    (void)err, (void)cap;
    corpus_env *e = self;
    corpus_generate_(e, seed);
    if (walks_links_(e->task)) chain_facts_(e);
    memset(e->fact_seen, 0, (size_t)e->n_facts);
    e->facts_seen = 0;
    e->tool_calls = 0;
    e->done = 0;
    char first[16], lastid[16], start[16];
    put_id_(e, first, 0);
    put_id_(e, lastid, e->files - 1);
    put_id_(e, start, e->start);
    first[1 + e->idw] = lastid[1 + e->idw] = start[1 + e->idw] = 0;
    env_buf_clear(&e->prompt);
    env_buf_printf(&e->prompt,
                   "A corpus of %d log files, ids %s to %s, about %zu bytes each. Tools: list(skip) lists the file ids; "
                   "open(id,offset) returns up to %zu bytes of a file from offset; grep(scope,text[,skip]) returns the "
                   "locations id@offset of the lines containing text, in one file (scope = its id) or in all (scope = *). "
                   "Records are lines t=<time> k=<key> v=<value>; every file also has one line next=<id> and one line "
                   "code=<6 digits>. ",
                   e->files, first, lastid, e->file_tokens, e->max_obs_bytes);
    if (e->task == TASK_CHAIN)
        env_buf_printf(&e->prompt, "Start at %s, follow next= %d times, and answer the code of the file you reach.\n", start,
                       e->ep_hops);
    else if (e->task == TASK_TRAIL)
        env_buf_printf(&e->prompt,
                       "The first page of a file, open(id,0), ends with its code= and next= lines. Start at %s: open the "
                       "file its next= names, and so on, until a file says next=end; answer that file's code.\n",
                       start);
    else if (e->task == TASK_SUM)
        env_buf_printf(&e->prompt, "Answer the sum of v over all records with k=%s.\n", e->key);
    else
        env_buf_printf(&e->prompt,
                       "The key %s is set by several records, in no order; the one with the largest t is current. "
                       "Answer its v.\n",
                       e->key);
    prompt->data = e->prompt.data;
    prompt->len = e->prompt.len;
    return MTRL_ENV_OK;
}

// ---- tools ----------------------------------------------------------------------------------

// The file an id names (f + digits, any width that parses), or -1.
static int file_of_(const corpus_env *e, const char *s, size_t n) {
    env_trim(&s, &n);
    int64_t f;
    if (n < 2 || s[0] != 'f' || (s[1] == '-' || s[1] == '+') || env_parse_i64(s + 1, n - 1, &f) || f < 0 || f >= e->files)
        return -1;
    return (int)f;
}

// Splits args at commas into at most `max` trimmed fields; returns their count (max + 1 when more).
static int split_(const char *a, size_t n, const char **f, size_t *fl, int max) {
    int k = 0;
    for (;;) {
        const char *c = memchr(a, ',', n);
        size_t l = c ? (size_t)(c - a) : n;
        if (k == max) return max + 1;
        f[k] = a;
        fl[k] = l;
        env_trim(&f[k], &fl[k]);
        k++;
        if (!c) return k;
        n -= l + 1;
        a = c + 1;
    }
}

static int tool_list_(corpus_env *e, const char *args, size_t n, env_buf *o) {
    int64_t skip = 0;
    if (n && (env_parse_i64(args, n, &skip) || skip < 0)) {
        env_buf_puts(o, "error: list needs a count of files to skip, e.g. list(0)");
        return 1;
    }
    for (int64_t f = skip; f < e->files; f++) {
        char line[48];
        put_id_(e, line, (int)f);
        int l = 1 + e->idw;
        l += snprintf(line + l, sizeof line - (size_t)l, " %zu\n", e->file_off[f + 1] - e->file_off[f]);
        if (o->len + (size_t)l + 24 > e->max_obs_bytes) {
            env_buf_printf(o, "more: list(%lld)\n", (long long)f);
            break;
        }
        env_buf_append(o, line, (size_t)l);
    }
    return 0;
}

static int tool_open_(corpus_env *e, const char *args, size_t n, env_buf *o) {
    const char *f[3];
    size_t fl[3];
    int k = split_(args, n, f, fl, 2);
    int file = k == 2 ? file_of_(e, f[0], fl[0]) : -1;
    int64_t off;
    if (k != 2 || env_parse_i64(f[1], fl[1], &off)) {
        env_buf_puts(o, "error: open needs a file id and an offset, open(id,offset), e.g. open(f0000,0)");
        return 1;
    }
    if (file < 0) {
        env_buf_puts(o, "error: no file '");
        env_buf_append_shown(o, f[0], fl[0], 40);
        env_buf_puts(o, "'; list(0) shows the ids");
        return 1;
    }
    size_t size = e->file_off[file + 1] - e->file_off[file];
    if (off < 0 || (uint64_t)off >= size) {
        env_buf_printf(o, "error: offset %lld is outside the file (%zu bytes)", (long long)off, size);
        return 1;
    }
    char head[64];
    put_id_(e, head, file);
    int hn = 1 + e->idw;
    hn += snprintf(head + hn, sizeof head - (size_t)hn, " @%lld of %zu\n", (long long)off, size);
    env_buf_append(o, head, (size_t)hn);
    size_t room = e->max_obs_bytes > (size_t)hn ? e->max_obs_bytes - (size_t)hn : 0, l = size - (size_t)off;
    size_t shown = l < room ? l : room, a = e->file_off[file] + (size_t)off;
    env_buf_append(o, e->text.data + a, shown);
    facts_shown_(e, a, a + shown);
    return 0;
}

// grep into o; returns the tool-error flag, and *next_skip the skip of the next page (-1: none).
static int tool_grep_(corpus_env *e, const char *args, size_t n, env_buf *o, int64_t *next_skip) {
    *next_skip = -1;
    const char *f[4];
    size_t fl[4];
    int k = split_(args, n, f, fl, 3);
    int64_t skip = 0;
    if (k < 2 || k > 3 || (k == 3 && (env_parse_i64(f[2], fl[2], &skip) || skip < 0))) {
        env_buf_puts(o, "error: grep needs a scope and text, grep(scope,text[,skip]), e.g. grep(*,code=) or grep(f0000,next=)");
        return 1;
    }
    if (fl[1] == 0 || fl[1] > 64) {
        env_buf_puts(o, "error: grep text must be 1 to 64 bytes");
        return 1;
    }
    int f0 = 0, f1 = e->files;
    if (!(fl[0] == 1 && f[0][0] == '*')) {
        f0 = file_of_(e, f[0], fl[0]);
        if (f0 < 0) {
            env_buf_puts(o, "error: grep scope must be * or a file id, not '");
            env_buf_append_shown(o, f[0], fl[0], 40);
            env_buf_puts(o, "'");
            return 1;
        }
        f1 = f0 + 1;
    }
    int64_t seen = 0;
    char more[128];
    int mn = snprintf(more, sizeof more, "more: grep(%.*s,%.*s,", (int)fl[0], f[0], (int)fl[1], f[1]);
    for (int file = f0; file < f1; file++) {
        const char *fb = e->text.data + e->file_off[file], *end = e->text.data + e->file_off[file + 1], *at = fb;
        while (at < end) {
            const char *m = memmem(at, (size_t)(end - at), f[1], fl[1]);
            if (!m) break;
            const char *ls = m;
            while (ls > fb && ls[-1] != '\n') ls--;
            const char *le = memchr(m, '\n', (size_t)(end - m));
            at = le ? le + 1 : end;
            if (seen++ < skip) continue;
            char loc[48];
            put_id_(e, loc, file);
            int l = 1 + e->idw;
            l += snprintf(loc + l, sizeof loc - (size_t)l, "@%zu\n", (size_t)(ls - fb));
            if (o->len + (size_t)l + (size_t)mn + 24 > e->max_obs_bytes) {
                *next_skip = seen - 1;
                env_buf_append(o, more, (size_t)mn);
                env_buf_printf(o, "%lld)\n", (long long)*next_skip);
                return 0;
            }
            env_buf_append(o, loc, (size_t)l);
        }
    }
    if (o->len == 0) {
        env_buf_puts(o, "no match for '");
        env_buf_append_shown(o, f[1], fl[1], 40);
        env_buf_puts(o, "'");
    }
    return 0;
}

static int corpus_step_(void *self, uint32_t kind, const char *action, size_t len, mtrl_env_step_out *out, char *err,
                        size_t cap) {
    corpus_env *e = self;
    env_tool_call c;
    env_step_kind k = env_step_begin("corpus", &e->done, &e->tool_calls, e->max_tool_calls, CORPUS_TOOLS, kind, action,
                                     len, &e->obs, out, &c, err, cap);
    if (k == ENV_STEP_ERR) return MTRL_ENV_ERR;
    if (k == ENV_STEP_ANSWER) {
        out->reward = env_credit_reward(env_answer_is(action, len, e->answer), e->credit, (long)e->facts_seen,
                                        (long)e->n_facts);
    } else if (k == ENV_STEP_TOOL) {
        int64_t next;
        if (env_tool_is(&c, "list")) out->tool_error = tool_list_(e, c.args, c.args_len, &e->obs);
        else if (env_tool_is(&c, "open")) out->tool_error = tool_open_(e, c.args, c.args_len, &e->obs);
        else if (env_tool_is(&c, "grep")) out->tool_error = tool_grep_(e, c.args, c.args_len, &e->obs, &next);
        else {
            env_tool_error_unknown(&e->obs, &c, CORPUS_TOOLS);
            out->tool_error = 1;
        }
    }
    env_step_end(&e->obs, e->max_obs_bytes, out);
    return MTRL_ENV_OK;
}

// ---- demo -----------------------------------------------------------------------------------

// Appends a call (NUL-terminated) to demo_text; the actions are pointed at it at the end.
static void demo_add_(corpus_env *e, size_t *count, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void demo_add_(corpus_env *e, size_t *count, const char *fmt, ...) {
    char call[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(call, sizeof call, fmt, ap);
    va_end(ap);
    env_buf_append(&e->demo_text, call, strlen(call) + 1);
    ++*count;
}

static int corpus_demo_(void *self, mtrl_env_demo_out *out, char *err, size_t cap) {
    corpus_env *e = self;
    if (e->done) {
        snprintf(err, cap, "corpus: demo needs an episode; call reset first");
        return MTRL_ENV_ERR;
    }
    env_buf_clear(&e->demo_text);
    size_t count = 0;
    int W = 1 + e->idw;
    if (e->task == TASK_TRAIL) {
        // the trail as reset walked it (chain_facts_): the first page of each file on it
        char id[16];
        for (int h = 0; h <= e->ep_hops; h++) {
            put_id_(e, id, file_at_(e, e->fact_at[h]));
            demo_add_(e, &count, "open(%.*s,0)", W, id);
        }
    } else if (e->task == TASK_CHAIN) {
        // the chain as reset walked it (chain_facts_): each hop's line, in its file
        char id[16];
        for (int h = 0; h <= e->ep_hops; h++) {
            const int cur = file_at_(e, e->fact_at[h]);
            put_id_(e, id, cur);
            demo_add_(e, &count, "grep(%.*s,%s)", W, id, h < e->ep_hops ? "next=" : "code=");
            demo_add_(e, &count, "open(%.*s,%zu)", W, id, e->fact_at[h] - e->file_off[cur]);
        }
    } else {
        // The grep pages as the tool cuts them, then one open per location they list.
        char args[96];
        int64_t skip = 0;
        size_t first_open = 0;
        env_buf locs = {0};
        do {
            int an = skip ? snprintf(args, sizeof args, "*,k=%s,%lld", e->key, (long long)skip)
                          : snprintf(args, sizeof args, "*,k=%s", e->key);
            demo_add_(e, &count, "grep(%s)", args);
            env_buf_clear(&e->scratch);
            tool_grep_(e, args, (size_t)an, &e->scratch, &skip);
            env_buf_append(&locs, e->scratch.data, e->scratch.len);
        } while (skip >= 0);
        first_open = count;
        for (const char *l = locs.data, *end = locs.data + locs.len; l && l < end;) {
            const char *nl = memchr(l, '\n', (size_t)(end - l));
            if (!nl) break;
            const char *at = memchr(l, '@', (size_t)(nl - l));
            if (at && l[0] == 'f') demo_add_(e, &count, "open(%.*s,%.*s)", (int)(at - l), l, (int)(nl - at - 1), at + 1);
            l = nl + 1;
        }
        env_buf_free(&locs);
        MTRL_CHECKF(count - first_open == (size_t)e->ep_hops, "corpus: demo found %zu of %d records", count - first_open,
                    e->ep_hops);
    }
    env_buf_append(&e->demo_text, e->answer, strlen(e->answer) + 1);
    count++;
    if (count > e->demo_cap) {
        e->demo_cap = count;
        e->demo = xrealloc(e->demo, sizeof(mtrl_env_action) * count);
    }
    const char *p = e->demo_text.data;
    for (size_t i = 0; i < count; i++) {
        size_t l = strlen(p);
        e->demo[i] = (mtrl_env_action){i + 1 < count ? MTRL_ENV_ACTION_TOOL : MTRL_ENV_ACTION_ANSWER, p, l};
        p += l + 1;
    }
    out->actions = e->demo;
    out->count = count;
    return MTRL_ENV_OK;
}

static int corpus_describe_(void *self, mtrl_env_bytes *out, char *err, size_t cap) {
    (void)self, (void)err, (void)cap;
    static const char text[] = "list(skip): the file ids and sizes, from the skip-th file\n"
                               "open(id,offset): the bytes of file id from offset\n"
                               "grep(scope,text[,skip]): locations id@offset of the lines containing text, in file "
                               "scope or in all files (scope = *)\n";
    out->data = text;
    out->len = sizeof text - 1;
    return MTRL_ENV_OK;
}

const mtrl_env_api env_corpus_api = {
    .abi_version = MTRL_ENV_ABI_VERSION,
    .struct_size = sizeof(mtrl_env_api),
    .name = "corpus",
    .version = "1",
    .flags = MTRL_ENV_FLAG_THREAD_SAFE,
    .create = corpus_create_,
    .destroy = corpus_destroy_,
    .reset = corpus_reset_,
    .step = corpus_step_,
    .demo = corpus_demo_,
    .describe = corpus_describe_,
};
