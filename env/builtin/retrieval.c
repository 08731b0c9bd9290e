// retrieval.c: the built-in `retrieval` env: find one fact in a long generated document.
//
// The document is doc_tokens bytes (1 byte = 1 token for the byte-level tokenizer) of lines
//     k004821=v930511\n
// with unique keys of fixed width (a seeded permutation of 0 .. 10^w - 1, w >= 3 so keys are
// sparse and cannot be guessed from their neighbours) and random 6-digit values. The queried
// line is drawn uniformly from all lines, so the fact sits anywhere in the document. The same
// seed gives the same document and question. Generation is a tight loop without printf: about
// 10 ms for 1M tokens.
//
// Prompt, inline_doc=0 (tools needed):
//     "A document of 4096 bytes holds lines key=value. Tools: search(text) returns the lines
//      containing text with their byte offsets; read(offset,length) returns bytes of the
//      document. What is the value of k004821?\n"
// Prompt, inline_doc=1 (long-context recall): the whole document, then
//     "What is the value of k004821?\n"
// (with max_tool_calls=0: "... k004821? Answer from the document above; no tool is available.\n")
// Answer: the value exactly as written ("v930511"); surrounding whitespace is ignored.
// Reward 1 for the exact value, else 0, or with credit=c > 0: c times the fraction of the six
// value digits the answer has in place, when it has the value's shape ('v' and six digits;
// anything else earns 0), at most c < 1, so the full reward (success) is still the exact value
// alone (env_credit_reward, the rule corpus's credit follows). Why: recall is learnt digit by
// digit (the warm-up's loss falls one digit at a time, docs/long-episodes.md), and a model that
// recalls four digits of six gets 0 from an all-or-nothing reward: every group's rewards are
// equal and RL has no gradient (recall-1m on the H200, 2026-12-02: reward 0 at every step).
// In place, not a prefix or an edit distance: each digit position is copied on its own and
// the model learnt the last ones first. A guess earns c/10 a digit on average.
// Tools (observations capped at max_obs_bytes):
//     search(text)         "<offset>: <line>\n" per matching line, at most 16 lines;
//                          "no match for 'text'" when none
//     read(offset,length)  the raw bytes doc[offset .. offset+length), length cut to
//                          max_obs_bytes and to the end of the document
// A tool call past max_tool_calls ends the episode with reward 0. max_tool_calls=0 is recall
// alone: it needs inline_doc=1 (else the fact is nowhere in the context) and demo_search=0 (the
// demo's search would end the episode); the prompt then says no tool is available.
// Config: doc_tokens=16..16777216 (4096), inline_doc=0|1 (0), demo_search=0|1 (0),
//         key_digits=0|3..15 (0: the smallest width >= 3 with at least 4 unused keys per line, so
//         it grows with the document: 4 digits at 5.6K tokens, 6 at 1M; a context ladder fixes it
//         so that only the length changes between stages, not the format the model copies),
//         max_obs_bytes=1..16777216 (2048), max_tool_calls=0..1000 (8), credit=0..0.9 (0). Keys
//         of other built-ins are ignored (env_util.h).
// demo: search(<key>) then the answer; with inline_doc=1 only the answer (the point of that
// mode is recall from the context, and a warm start should teach exactly that), unless
// demo_search=1: then search(<key>) first there too, so a warm start teaches the tool that
// finds the fact at any document length (what a context ladder trained at short documents
// needs at 1M, where recall is hardest).
#ifndef _GNU_SOURCE
#define _GNU_SOURCE // memmem
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/rng.h"
#include "env/builtin/builtin.h"
#include "env/env_util.h"

#define RETRIEVAL_TOOLS "search, read"
#define RETRIEVAL_MAX_HITS 16
#define RETRIEVAL_VALUE_DIGITS 6

typedef struct retrieval_env {
    size_t doc_tokens, max_obs_bytes;
    int inline_doc, demo_search, max_tool_calls, key_digits;
    double credit;   // weight of the digits in place in a wrong answer's reward (0: exact or 0)
    env_buf doc;     // the document; with inline_doc the question follows it (the prompt)
    size_t doc_len;  // bytes of doc that are the document
    env_buf prompt;  // the prompt when !inline_doc
    env_buf obs;
    char key[16], value[16];
    char demo_call[32];
    mtrl_env_action demo[2];
    int tool_calls, done;
} retrieval_env;

static int retrieval_create_(const char *config, void **self, char *err, size_t cap) {
    env_config cfg;
    if (env_config_parse(&cfg, "retrieval", config, err, cap)) return MTRL_ENV_ERR;
    long long doc_tokens, max_obs, mtc, kd;
    int inline_doc, demo_search;
    double credit;
    int bad = env_config_int(&cfg, "doc_tokens", 4096, 16, 1 << 24, &doc_tokens, err, cap) ||
              env_config_bool(&cfg, "inline_doc", 0, &inline_doc, err, cap) ||
              env_config_bool(&cfg, "demo_search", 0, &demo_search, err, cap) ||
              env_config_int(&cfg, "max_obs_bytes", 2048, 1, 1 << 24, &max_obs, err, cap) ||
              env_config_int(&cfg, "max_tool_calls", 8, 0, 1000, &mtc, err, cap) ||
              env_config_int(&cfg, "key_digits", 0, 0, 15, &kd, err, cap) ||
              env_config_double(&cfg, "credit", 0.0, 0.0, ENV_CREDIT_MAX, &credit, err, cap) ||
              env_config_finish(&cfg, "doc_tokens, inline_doc, demo_search, key_digits, max_obs_bytes, max_tool_calls, credit",
                                err, cap);
    env_config_free(&cfg);
    if (bad) return MTRL_ENV_ERR;
    // No tools: recall alone. The fact must be in the context, and the demo must not call a tool
    // (a call past the limit ends the episode with reward 0).
    if (mtc == 0 && !inline_doc) {
        snprintf(err, cap, "retrieval: max_tool_calls=0 with inline_doc=0 puts the fact nowhere the model can see; "
                           "set inline_doc=1 (recall from the context) or allow tool calls");
        return MTRL_ENV_ERR;
    }
    if (mtc == 0 && demo_search) {
        snprintf(err, cap, "retrieval: max_tool_calls=0 with demo_search=1: the demo's search would end the episode; "
                           "set demo_search=0 (the demo is then the answer alone)");
        return MTRL_ENV_ERR;
    }
    if (kd > 0 && kd < 3) {
        snprintf(err, cap, "retrieval: key_digits=%lld: use 0 (automatic) or 3..15", kd);
        return MTRL_ENV_ERR;
    }
    retrieval_env *e = xcalloc(1, sizeof *e);
    e->doc_tokens = (size_t)doc_tokens;
    e->inline_doc = inline_doc;
    e->demo_search = demo_search;
    e->max_obs_bytes = (size_t)max_obs;
    e->max_tool_calls = (int)mtc;
    e->key_digits = (int)kd;
    e->credit = credit;
    e->done = 1;
    *self = e;
    return MTRL_ENV_OK;
}

static void retrieval_destroy_(void *self) {
    retrieval_env *e = self;
    if (!e) return;
    env_buf_free(&e->doc);
    env_buf_free(&e->prompt);
    env_buf_free(&e->obs);
    free(e);
}

// ---- document generation --------------------------------------------------------------------

// A keyed permutation of [0, range): a 4-round Feistel network on 2*half bits (a bijection on
// [0, 4^half)), walked until the value falls inside the range (cycle walking keeps it a
// bijection on the range). 4^half < 4*range, so the walk takes under 4 steps on average.
static uint64_t permute_(uint64_t x, uint64_t range, int half, const uint64_t rk[4]) {
    uint64_t mask = (1ull << half) - 1;
    do {
        uint64_t l = x >> half, r = x & mask;
        for (int k = 0; k < 4; k++) {
            uint64_t t = l ^ (env_mix64(r ^ rk[k]) & mask);
            l = r;
            r = t;
        }
        x = (l << half) | r;
    } while (x >= range);
    return x;
}

static void put_digits_(char *p, uint64_t v, int width) {
    for (int i = width - 1; i >= 0; i--) {
        p[i] = (char)('0' + v % 10);
        v /= 10;
    }
}

static void retrieval_generate_(retrieval_env *e, uint64_t seed) {
    // Key width w: key_digits, or the smallest >= 3 with at least 4 unused keys per used one.
    // A fixed width too small for the document gives fewer lines (one per key) and a shorter
    // document, never a repeated key.
    int w = e->key_digits ? e->key_digits : 3;
    size_t lines;
    uint64_t range;
    for (;;) {
        lines = e->doc_tokens / (size_t)(w + 4 + RETRIEVAL_VALUE_DIGITS); // "k" w "=v" 6 "\n"
        range = 1;
        for (int i = 0; i < w; i++) range *= 10;
        if (e->key_digits) {
            if (lines > range) lines = (size_t)range;
            break;
        }
        if (range >= 4 * (uint64_t)lines || w == 15) break;
        w++;
    }
    if (lines == 0) lines = 1;
    int half = 1;
    while ((1ull << (2 * half)) < range) half++;
    uint64_t stream = mtrl_rng_stream("env.retrieval", 0, 0);
    uint64_t rk[4];
    for (int k = 0; k < 4; k++) rk[k] = mtrl_rng_u64(seed, stream, (uint64_t)k);
    uint64_t vseed = mtrl_rng_u64(seed, stream, 4);
    size_t q = (size_t)(mtrl_rng_uniform(seed, stream, 5) * (double)lines);
    if (q >= lines) q = lines - 1;

    size_t line_len = (size_t)w + 4 + RETRIEVAL_VALUE_DIGITS;
    env_buf_clear(&e->doc);
    char *p = env_buf_reserve(&e->doc, lines * line_len + 128);
    for (size_t i = 0; i < lines; i++) {
        uint64_t key = permute_(i, range, half, rk);
        uint64_t val = env_mix64(vseed + i) % 1000000u;
        p[0] = 'k';
        put_digits_(p + 1, key, w);
        p[1 + w] = '=';
        p[2 + w] = 'v';
        put_digits_(p + 3 + w, val, RETRIEVAL_VALUE_DIGITS);
        p[line_len - 1] = '\n';
        if (i == q) {
            memcpy(e->key, p, (size_t)w + 1);
            e->key[w + 1] = 0;
            memcpy(e->value, p + 2 + w, 1 + RETRIEVAL_VALUE_DIGITS);
            e->value[1 + RETRIEVAL_VALUE_DIGITS] = 0;
        }
        p += line_len;
    }
    e->doc.len = e->doc_len = lines * line_len;
    e->doc.data[e->doc.len] = 0;
}

static int retrieval_reset_(void *self, uint64_t seed, mtrl_env_bytes *prompt, char *err, size_t cap) {
    (void)err, (void)cap;
    retrieval_env *e = self;
    retrieval_generate_(e, seed);
    e->tool_calls = 0;
    e->done = 0;
    snprintf(e->demo_call, sizeof e->demo_call, "search(%s)", e->key);
    if (e->inline_doc) {
        env_buf_printf(&e->doc, e->max_tool_calls ? "What is the value of %s?\n"
                                                  : "What is the value of %s? Answer from the document above; no tool is available.\n",
                       e->key);
        prompt->data = e->doc.data;
        prompt->len = e->doc.len;
    } else {
        env_buf_clear(&e->prompt);
        env_buf_printf(&e->prompt,
                       "A document of %zu bytes holds lines key=value. Tools: search(text) returns the lines "
                       "containing text with their byte offsets; read(offset,length) returns bytes of the "
                       "document. What is the value of %s?\n",
                       e->doc_len, e->key);
        prompt->data = e->prompt.data;
        prompt->len = e->prompt.len;
    }
    return MTRL_ENV_OK;
}

// ---- tools ----------------------------------------------------------------------------------

static int tool_search_(retrieval_env *e, const char *text, size_t n) {
    if (n == 0) {
        env_buf_puts(&e->obs, "error: search needs text, e.g. search(k1234)");
        return 1;
    }
    if (n > 256) {
        env_buf_puts(&e->obs, "error: search text longer than 256 bytes");
        return 1;
    }
    const char *doc = e->doc.data, *end = doc + e->doc_len, *at = doc;
    int hits = 0;
    while (at < end) {
        const char *m = memmem(at, (size_t)(end - at), text, n);
        if (!m) break;
        const char *ls = m;
        while (ls > doc && ls[-1] != '\n') ls--;
        const char *le = memchr(m, '\n', (size_t)(end - m));
        le = le ? le : end;
        char head[32];
        int hn = snprintf(head, sizeof head, "%zu: ", (size_t)(ls - doc));
        size_t need = (size_t)hn + (size_t)(le - ls) + 1;
        if (hits == RETRIEVAL_MAX_HITS || e->obs.len + need + 32 > e->max_obs_bytes) {
            env_buf_puts(&e->obs, "(more matches not shown)\n");
            break;
        }
        env_buf_append(&e->obs, head, (size_t)hn);
        env_buf_append(&e->obs, ls, (size_t)(le - ls));
        env_buf_puts(&e->obs, "\n");
        hits++;
        at = le < end ? le + 1 : end; // one entry per line, however often it matches
    }
    if (hits == 0 && e->obs.len == 0) {
        env_buf_puts(&e->obs, "no match for '");
        env_buf_append_shown(&e->obs, text, n, 40);
        env_buf_puts(&e->obs, "'");
    }
    return 0;
}

static int tool_read_(retrieval_env *e, const char *args, size_t n) {
    const char *comma = memchr(args, ',', n);
    int64_t off, len;
    if (!comma || env_parse_i64(args, (size_t)(comma - args), &off) ||
        env_parse_i64(comma + 1, n - (size_t)(comma - args) - 1, &len)) {
        env_buf_puts(&e->obs, "error: read needs two integers, read(offset,length), e.g. read(0,64)");
        return 1;
    }
    if (off < 0 || len < 0) {
        env_buf_puts(&e->obs, "error: read offset and length must not be negative");
        return 1;
    }
    if ((uint64_t)off >= e->doc_len) {
        env_buf_printf(&e->obs, "error: offset %lld is past the end of the document (%zu bytes)", (long long)off,
                       e->doc_len);
        return 1;
    }
    size_t l = (size_t)len;
    if (l > e->max_obs_bytes) l = e->max_obs_bytes;
    if (l > e->doc_len - (size_t)off) l = e->doc_len - (size_t)off;
    env_buf_append(&e->obs, e->doc.data + off, l);
    return 0;
}

static int retrieval_step_(void *self, uint32_t kind, const char *action, size_t len, mtrl_env_step_out *out,
                           char *err, size_t cap) {
    retrieval_env *e = self;
    env_tool_call c;
    env_step_kind k = env_step_begin("retrieval", &e->done, &e->tool_calls, e->max_tool_calls, RETRIEVAL_TOOLS, kind,
                                     action, len, &e->obs, out, &c, err, cap);
    if (k == ENV_STEP_ERR) return MTRL_ENV_ERR;
    if (k == ENV_STEP_ANSWER) {
        int right = env_answer_is(action, len, e->value);
        int got = right || e->credit == 0 ? 0 : env_digits_in_place(action, len, e->value);
        out->reward = env_credit_reward(right, e->credit, got > 0 ? got : 0, RETRIEVAL_VALUE_DIGITS);
    } else if (k == ENV_STEP_TOOL) {
        if (env_tool_is(&c, "search")) {
            out->tool_error = tool_search_(e, c.args, c.args_len);
        } else if (env_tool_is(&c, "read")) {
            out->tool_error = tool_read_(e, c.args, c.args_len);
        } else {
            env_tool_error_unknown(&e->obs, &c, RETRIEVAL_TOOLS);
            out->tool_error = 1;
        }
    }
    env_step_end(&e->obs, e->max_obs_bytes, out);
    return MTRL_ENV_OK;
}

static int retrieval_demo_(void *self, mtrl_env_demo_out *out, char *err, size_t cap) {
    retrieval_env *e = self;
    const char *call = !e->inline_doc || e->demo_search ? e->demo_call : NULL; // inline: the answer alone
    return env_demo_call_answer("retrieval", e->done, e->demo, call, e->value, out, err, cap);
}

static int retrieval_describe_(void *self, mtrl_env_bytes *out, char *err, size_t cap) {
    (void)self, (void)err, (void)cap;
    static const char text[] = "search(text): the document's lines containing text, with their byte offsets\n"
                               "read(offset,length): length bytes of the document from offset\n";
    out->data = text;
    out->len = sizeof text - 1;
    return MTRL_ENV_OK;
}

const mtrl_env_api env_retrieval_api = {
    .abi_version = MTRL_ENV_ABI_VERSION,
    .struct_size = sizeof(mtrl_env_api),
    .name = "retrieval",
    .version = "1",
    .flags = MTRL_ENV_FLAG_THREAD_SAFE,
    .create = retrieval_create_,
    .destroy = retrieval_destroy_,
    .reset = retrieval_reset_,
    .step = retrieval_step_,
    .demo = retrieval_demo_,
    .describe = retrieval_describe_,
};
