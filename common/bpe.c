// bpe.c: the tokenizer's tables, encode and decode (see bpe.h; loaders in bpe_tiktoken.c and
// bpe_hf.c, the regex in bpe_regex.c).
#include "common/bpe_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/hash.h"

#define BPE_DEAD UINT32_MAX

// ---- building ------------------------------------------------------------------------------

mtrl_bpe *bpe_new(const char *source) {
    mtrl_bpe *t = xcalloc(1, sizeof *t);
    t->source = xstrdup(source);
    return t;
}

uint32_t bpe_pool_add(mtrl_bpe *t, const void *bytes, size_t len) {
    MTRL_CHECKF(t->pool_n + len < UINT32_MAX, "%s: token bytes over 4 GB", t->source);
    if (t->pool_n + len > t->pool_cap) {
        t->pool_cap = (t->pool_n + len) * 2 + 4096;
        t->pool = xrealloc(t->pool, t->pool_cap);
    }
    if (len) memcpy(t->pool + t->pool_n, bytes, len);
    uint32_t off = (uint32_t)t->pool_n;
    t->pool_n += len;
    return off;
}

int bpe_set_id(mtrl_bpe *t, uint32_t id, uint32_t off, uint32_t len, int kind) {
    MTRL_CHECK(id < MTRL_BPE_MAX_IDS);
    if (id >= t->ids_cap) {
        uint32_t cap = t->ids_cap ? t->ids_cap : 1024;
        while (cap <= id) cap *= 2;
        t->tok_off = xrealloc(t->tok_off, cap * sizeof *t->tok_off);
        t->tok_len = xrealloc(t->tok_len, cap * sizeof *t->tok_len);
        t->tok_kind = xrealloc(t->tok_kind, cap);
        memset(t->tok_kind + t->ids_cap, BPE_ABSENT, cap - t->ids_cap);
        t->ids_cap = cap;
    }
    if (t->tok_kind[id] != BPE_ABSENT) return 1;
    t->tok_off[id] = off;
    t->tok_len[id] = len;
    t->tok_kind[id] = (uint8_t)kind;
    if (id >= t->n_ids) t->n_ids = id + 1;
    return 0;
}

static uint64_t bpe_hash_(const void *key, size_t len) { return mtrl_hash64(key, len, 0x62706531u); }

static void map_grow_(bpe_map *m, const unsigned char *pool) {
    size_t cap = m->mask ? (m->mask + 1) * 2 : 1024;
    free(m->slot);
    m->slot = xcalloc(cap, sizeof *m->slot);
    m->mask = cap - 1;
    for (size_t e = 0; e < m->n; e++) {
        size_t h = bpe_hash_(pool + m->off[e], m->len[e]) & m->mask;
        while (m->slot[h]) h = (h + 1) & m->mask;
        m->slot[h] = (uint32_t)e + 1;
    }
}

static size_t map_find_(const bpe_map *m, const unsigned char *pool, const void *key, size_t len) {
    size_t h = bpe_hash_(key, len) & m->mask;
    for (;; h = (h + 1) & m->mask) {
        uint32_t s = m->slot[h];
        if (!s) return h;
        if (m->len[s - 1] == len && memcmp(pool + m->off[s - 1], key, len) == 0) return h;
    }
}

int bpe_map_put(bpe_map *m, const unsigned char *pool, uint32_t off, uint32_t len, uint32_t val, uint32_t *old) {
    if ((m->n + 1) * 2 > m->mask + 1) map_grow_(m, pool);
    size_t h = map_find_(m, pool, pool + off, len);
    if (m->slot[h]) {
        if (old) *old = m->val[m->slot[h] - 1];
        return 1;
    }
    if (m->n == m->cap) {
        m->cap = m->cap ? m->cap * 2 : 1024;
        m->off = xrealloc(m->off, m->cap * sizeof *m->off);
        m->len = xrealloc(m->len, m->cap * sizeof *m->len);
        m->val = xrealloc(m->val, m->cap * sizeof *m->val);
    }
    m->off[m->n] = off;
    m->len[m->n] = len;
    m->val[m->n] = val;
    m->slot[h] = (uint32_t)++m->n;
    return 0;
}

int bpe_map_get(const bpe_map *m, const unsigned char *pool, const void *key, size_t len, uint32_t *val) {
    if (!m->mask) return 0;
    uint32_t s = m->slot[map_find_(m, pool, key, len)];
    if (!s) return 0;
    *val = m->val[s - 1];
    return 1;
}

static void map_free_(bpe_map *m) {
    free(m->slot);
    free(m->off);
    free(m->len);
    free(m->val);
}

static size_t pair_slot_(const mtrl_bpe *t, uint64_t key) {
    size_t h = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 20) & t->pair_mask;
    while (t->pair_key[h] != UINT64_MAX && t->pair_key[h] != key) h = (h + 1) & t->pair_mask;
    return h;
}

void bpe_pair_put(mtrl_bpe *t, uint32_t left, uint32_t right, uint32_t prio, uint32_t id) {
    if ((t->pair_n + 1) * 2 > (t->pair_mask ? t->pair_mask + 1 : 0)) {
        size_t old_cap = t->pair_mask ? t->pair_mask + 1 : 0, cap = old_cap ? old_cap * 2 : 4096;
        uint64_t *ok = t->pair_key;
        uint32_t *op = t->pair_prio, *oi = t->pair_id;
        t->pair_key = xmalloc(cap * sizeof *t->pair_key);
        memset(t->pair_key, 0xff, cap * sizeof *t->pair_key);
        t->pair_prio = xmalloc(cap * sizeof *t->pair_prio);
        t->pair_id = xmalloc(cap * sizeof *t->pair_id);
        t->pair_mask = cap - 1;
        for (size_t i = 0; i < old_cap; i++) {
            if (ok[i] == UINT64_MAX) continue;
            size_t h = pair_slot_(t, ok[i]);
            t->pair_key[h] = ok[i];
            t->pair_prio[h] = op[i];
            t->pair_id[h] = oi[i];
        }
        free(ok);
        free(op);
        free(oi);
    }
    uint64_t key = (uint64_t)left << 32 | right;
    size_t h = pair_slot_(t, key);
    if (t->pair_key[h] == UINT64_MAX) t->pair_n++;
    t->pair_key[h] = key;
    t->pair_prio[h] = prio;
    t->pair_id[h] = id;
}

int bpe_pair_get(const mtrl_bpe *t, uint32_t left, uint32_t right, uint32_t *prio, uint32_t *id) {
    if (!t->pair_mask) return 0;
    size_t h = pair_slot_(t, (uint64_t)left << 32 | right);
    if (t->pair_key[h] == UINT64_MAX) return 0;
    *prio = t->pair_prio[h];
    *id = t->pair_id[h];
    return 1;
}

mtrl_status bpe_finish(mtrl_bpe *t, mtrl_error *err) {
    for (size_t e = 0; e < t->ordinary.n; e++)
        if (t->ordinary.len[e] > t->max_len) t->max_len = t->ordinary.len[e];
    for (int b = 0; b < 256; b++) {
        unsigned char c = (unsigned char)b;
        if (!bpe_map_get(&t->ordinary, t->pool, &c, 1, &t->byte_id[b]))
            return mtrl_error_set(err, MTRL_ERR_FORMAT,
                                  "%s: no token for the byte 0x%02x: a byte-level BPE needs all 256", t->source, b);
    }
    // The added tokens' texts are the keys of t->added; matchers over all of them and over those
    // that are not special.
    size_t n = t->added.n, n_always = 0;
    const unsigned char **lits = xmalloc((n + 1) * sizeof *lits);
    size_t *lens = xmalloc((n + 1) * sizeof *lens);
    mtrl_status st = MTRL_OK;
    for (int pass = 0; pass < 2 && st == MTRL_OK; pass++) {
        size_t k = 0;
        for (size_t e = 0; e < n; e++) {
            if (pass == 1 && t->tok_kind[t->added.val[e]] != BPE_ADDED) continue;
            lits[k] = t->pool + t->added.off[e];
            lens[k++] = t->added.len[e];
        }
        if (pass == 1) n_always = k;
        if (k) st = bpe_compile_literals(lits, lens, k, pass ? &t->special_always : &t->special_all, t->source, err);
    }
    (void)n_always;
    free(lits);
    free(lens);
    return st;
}

void mtrl_bpe_free(mtrl_bpe *t) {
    if (!t) return;
    for (int i = 0; i < t->n_split; i++) pcre2_code_free(t->split[i]);
    pcre2_code_free(t->special_all);
    pcre2_code_free(t->special_always);
    map_free_(&t->ordinary);
    map_free_(&t->added);
    free(t->pair_key);
    free(t->pair_prio);
    free(t->pair_id);
    free(t->tok_off);
    free(t->tok_len);
    free(t->tok_kind);
    free(t->pool);
    free(t->source);
    free(t);
}

mtrl_status bpe_read_file(const char *path, char **data, size_t *n, mtrl_error *err) {
    *data = NULL;
    *n = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    size_t cap = 1 << 16, len = 0;
    char *buf = xmalloc(cap);
    for (;;) {
        if (len + 1 >= cap) buf = xrealloc(buf, cap *= 2);
        size_t got = fread(buf + len, 1, cap - len - 1, f);
        len += got;
        if (got == 0) break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        return mtrl_error_set(err, MTRL_ERR_IO, "%s: read error", path);
    }
    buf[len] = '\0';
    *data = buf;
    *n = len;
    return MTRL_OK;
}

// ---- encode ---------------------------------------------------------------------------------

// A merge candidate: the part starting at byte `left` with the one after it, to become `id`.
typedef struct heap_ent {
    uint32_t prio, left, id;
} heap_ent;

// Per-call scratch: encode is reentrant (a tokenizer is shared between threads).
typedef struct enc_ctx {
    const mtrl_bpe *t;
    uint32_t *out;
    size_t n_out;
    pcre2_match_data *md[BPE_MAX_SPLITS];
    pcre2_match_data *md_special;
    pcre2_match_context *mctx;
    pcre2_jit_stack *jit;
    // merge state of one piece, indexed by the byte where a part starts
    uint32_t *id, *end, *prev;
    heap_ent *heap;
    size_t cap, heap_n, heap_cap;
    const unsigned char *text; // the caller's text (offsets in messages)
} enc_ctx;

static int heap_less_(const heap_ent *a, const heap_ent *b) {
    return a->prio < b->prio || (a->prio == b->prio && a->left < b->left);
}

static void heap_push_(enc_ctx *c, heap_ent e) {
    if (c->heap_n == c->heap_cap) {
        c->heap_cap = c->heap_cap ? c->heap_cap * 2 : 256;
        c->heap = xrealloc(c->heap, c->heap_cap * sizeof *c->heap);
    }
    size_t i = c->heap_n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!heap_less_(&e, &c->heap[p])) break;
        c->heap[i] = c->heap[p];
        i = p;
    }
    c->heap[i] = e;
}

static heap_ent heap_pop_(enc_ctx *c) {
    heap_ent top = c->heap[0], last = c->heap[--c->heap_n];
    size_t i = 0, n = c->heap_n;
    for (;;) {
        size_t l = 2 * i + 1, m = i;
        const heap_ent *best = &last;
        if (l < n && heap_less_(&c->heap[l], best)) best = &c->heap[m = l];
        if (l + 1 < n && heap_less_(&c->heap[l + 1], best)) best = &c->heap[m = l + 1];
        if (m == i) break;
        c->heap[i] = c->heap[m];
        i = m;
    }
    if (n) c->heap[i] = last;
    return top;
}

// What the parts at `left` and `right` (adjacent) merge into, if anything.
static int pair_of_(const enc_ctx *c, const unsigned char *p, uint32_t left, uint32_t right, uint32_t *prio,
                    uint32_t *id) {
    const mtrl_bpe *t = c->t;
    if (t->by_rank) {
        uint32_t len = c->end[right] - left;
        if (len > t->max_len || !bpe_map_get(&t->ordinary, t->pool, p + left, len, id)) return 0;
        *prio = *id;
        return 1;
    }
    return bpe_pair_get(t, c->id[left], c->id[right], prio, id);
}

static void push_pair_(enc_ctx *c, const unsigned char *p, uint32_t left, uint32_t m) {
    uint32_t right = c->end[left], prio, id;
    if (right >= m) return;
    if (pair_of_(c, p, left, right, &prio, &id)) heap_push_(c, (heap_ent){prio, left, id});
}

static void emit_(enc_ctx *c, uint32_t id) { c->out[c->n_out++] = id; }

// Step 3 of bpe.h: the merges of one piece.
static void encode_piece_(enc_ctx *c, const unsigned char *p, size_t m) {
    const mtrl_bpe *t = c->t;
    if (m == 0) return;
    if (m == 1) {
        emit_(c, t->byte_id[p[0]]);
        return;
    }
    uint32_t whole;
    if (t->whole_piece && m <= t->max_len && bpe_map_get(&t->ordinary, t->pool, p, m, &whole)) {
        emit_(c, whole);
        return;
    }
    MTRL_CHECKF(m < UINT32_MAX, "a piece of %zu bytes", m);
    if (m > c->cap) {
        c->cap = m * 2;
        c->id = xrealloc(c->id, c->cap * sizeof *c->id);
        c->end = xrealloc(c->end, c->cap * sizeof *c->end);
        c->prev = xrealloc(c->prev, c->cap * sizeof *c->prev);
    }
    uint32_t n = (uint32_t)m;
    for (uint32_t i = 0; i < n; i++) {
        c->id[i] = t->byte_id[p[i]];
        c->end[i] = i + 1;
        c->prev[i] = i - 1; // prev[0] wraps to BPE_DEAD: none
    }
    c->heap_n = 0;
    for (uint32_t i = 0; i + 1 < n; i++) push_pair_(c, p, i, n);
    while (c->heap_n) {
        heap_ent e = heap_pop_(c);
        // A candidate goes stale when a neighbour merged first; it still counts when the two
        // parts there now merge into the same id (as the tokenizers library checks it).
        if (c->id[e.left] == BPE_DEAD) continue;
        uint32_t right = c->end[e.left], prio, id;
        if (right >= n || !pair_of_(c, p, e.left, right, &prio, &id) || id != e.id) continue;
        c->id[e.left] = id;
        c->end[e.left] = c->end[right];
        c->id[right] = BPE_DEAD;
        if (c->end[e.left] < n) c->prev[c->end[e.left]] = e.left;
        if (c->prev[e.left] != BPE_DEAD) push_pair_(c, p, c->prev[e.left], n);
        push_pair_(c, p, e.left, n);
    }
    for (uint32_t i = 0; i < n; i = c->end[i]) emit_(c, c->id[i]);
}

static mtrl_status match_error_(const enc_ctx *c, int rc, const unsigned char *at, mtrl_error *err) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof msg);
    return mtrl_error_set(err, MTRL_ERR_LIMIT, "%s: the pre-tokenizer regex failed at byte %zu: %s",
                          c->t->source, (size_t)(at - c->text), (const char *)msg);
}

static size_t utf8_len_(unsigned char b) { return b < 0xc0 ? 1 : b < 0xe0 ? 2 : b < 0xf0 ? 3 : 4; }

// Step 2: split p[0, n) by t->split[level] and hand the matches and the gaps between them on.
static mtrl_status encode_split_(enc_ctx *c, int level, const unsigned char *p, size_t n, mtrl_error *err) {
    const mtrl_bpe *t = c->t;
    if (level == t->n_split) {
        encode_piece_(c, p, n);
        return MTRL_OK;
    }
    pcre2_match_data *md = c->md[level];
    size_t at = 0, gap = 0; // gap: where the text not yet handed on starts
    while (at < n) {
        int rc = pcre2_match(t->split[level], p, n, at, 0, md, c->mctx);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) return match_error_(c, rc, p + at, err);
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t s = ov[0], e = ov[1];
        if (e == s) { // an empty match consumes nothing: step over one character
            at = s + utf8_len_(p[s]);
            if (at > n) at = n;
            continue;
        }
        mtrl_status st = MTRL_OK;
        if (s > gap) st = encode_split_(c, level + 1, p + gap, s - gap, err);
        if (st == MTRL_OK) st = encode_split_(c, level + 1, p + s, e - s, err);
        if (st != MTRL_OK) return st;
        at = gap = e;
    }
    return gap < n ? encode_split_(c, level + 1, p + gap, n - gap, err) : MTRL_OK;
}

mtrl_status mtrl_bpe_encode(const mtrl_bpe *t, const void *text, size_t n, unsigned flags, uint32_t *out,
                            size_t *n_out, mtrl_error *err) {
    enc_ctx c = {.t = t, .out = out, .text = text};
    *n_out = 0;
    if (n >= UINT32_MAX) // parts are indexed by uint32 byte offsets
        return mtrl_error_set(err, MTRL_ERR_LIMIT, "%s: a text of %zu bytes is over the 4 GiB an encode takes",
                              t->source, n);
    // JIT matching of long pieces (a megabyte of letters) needs more than PCRE2's default 32 KB
    // stack; the stack grows on demand up to the cap.
    c.mctx = pcre2_match_context_create(NULL);
    c.jit = pcre2_jit_stack_create(32 * 1024, 64 * 1024 * 1024, NULL);
    MTRL_CHECK(c.mctx && c.jit);
    pcre2_jit_stack_assign(c.mctx, NULL, c.jit);
    for (int i = 0; i < t->n_split; i++) {
        c.md[i] = pcre2_match_data_create_from_pattern(t->split[i], NULL);
        MTRL_CHECK(c.md[i]);
    }
    const pcre2_code *special = (flags & MTRL_BPE_SPECIAL) ? t->special_all : t->special_always;
    const unsigned char *p = text;
    mtrl_status st = MTRL_OK;
    size_t at = 0;
    if (special) {
        c.md_special = pcre2_match_data_create_from_pattern(special, NULL);
        MTRL_CHECK(c.md_special);
        while (at < n && st == MTRL_OK) {
            int rc = pcre2_match(special, p, n, at, 0, c.md_special, c.mctx);
            if (rc == PCRE2_ERROR_NOMATCH) break;
            if (rc < 0) {
                st = match_error_(&c, rc, p + at, err);
                break;
            }
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(c.md_special);
            st = encode_split_(&c, 0, p + at, ov[0] - at, err);
            if (st != MTRL_OK) break;
            uint32_t id;
            MTRL_CHECK(bpe_map_get(&t->added, t->pool, p + ov[0], ov[1] - ov[0], &id));
            emit_(&c, id);
            at = ov[1];
        }
    }
    if (st == MTRL_OK && at < n) st = encode_split_(&c, 0, p + at, n - at, err);
    *n_out = c.n_out;
    for (int i = 0; i < t->n_split; i++) pcre2_match_data_free(c.md[i]);
    pcre2_match_data_free(c.md_special);
    pcre2_jit_stack_free(c.jit);
    pcre2_match_context_free(c.mctx);
    free(c.id);
    free(c.end);
    free(c.prev);
    free(c.heap);
    return st;
}

// ---- decode and lookups -----------------------------------------------------------------------

mtrl_status mtrl_bpe_decode(const mtrl_bpe *t, const uint32_t *ids, size_t n, unsigned flags, char *out,
                            size_t cap, size_t *len, mtrl_error *err) {
    size_t at = 0;
    mtrl_status st = MTRL_OK;
    for (size_t i = 0; i < n; i++) {
        uint32_t id = ids[i];
        if (id >= t->n_ids || t->tok_kind[id] == BPE_ABSENT) {
            st = mtrl_error_set(err, MTRL_ERR_FORMAT, "id %u (position %zu) is not a token of %s (%u ids)", id, i,
                                t->source, t->n_ids);
            break;
        }
        if ((flags & MTRL_BPE_SKIP_SPECIAL) && t->tok_kind[id] != BPE_ORDINARY) continue;
        size_t l = t->tok_len[id];
        if (at + 1 < cap) memcpy(out + at, t->pool + t->tok_off[id], at + l < cap ? l : cap - 1 - at);
        at += l;
    }
    if (cap) out[at < cap ? at : cap - 1] = '\0';
    if (len) *len = at;
    return st;
}

uint32_t mtrl_bpe_n_ids(const mtrl_bpe *t) { return t->n_ids; }

const unsigned char *mtrl_bpe_token_bytes(const mtrl_bpe *t, uint32_t id, size_t *len) {
    if (id >= t->n_ids || t->tok_kind[id] == BPE_ABSENT) return NULL;
    if (len) *len = t->tok_len[id];
    return t->pool + t->tok_off[id];
}

int mtrl_bpe_is_special(const mtrl_bpe *t, uint32_t id) {
    return id < t->n_ids && (t->tok_kind[id] == BPE_SPECIAL || t->tok_kind[id] == BPE_ADDED);
}

mtrl_status mtrl_bpe_special_id(const mtrl_bpe *t, const char *text, uint32_t *id, mtrl_error *err) {
    if (bpe_map_get(&t->added, t->pool, text, strlen(text), id)) return MTRL_OK;
    return mtrl_error_set(err, MTRL_ERR_NOTFOUND, "%s has no special token '%s'", t->source, text);
}

const char *mtrl_bpe_source(const mtrl_bpe *t) { return t->source; }
