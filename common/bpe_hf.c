// bpe_hf.c: loads a Hugging Face tokenizer.json byte-level BPE (see bpe.h).
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bpe_internal.h"
#include "common/check.h"

// The ByteLevel pre-tokenizer's own split (GPT-2's pattern) when use_regex is on.
#define HF_BYTELEVEL_PATTERN "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"

typedef struct hf_load {
    mtrl_bpe *t;
    const char *path;
    int16_t byte_of[324]; // GPT-2's printable stand-in code point -> byte, -1 for none
    json_t *vocab;
} hf_load;

// GPT-2's table: printable Latin-1 bytes stand for themselves, the other 68 for U+0100.. in order.
static void byte_table_(hf_load *h) {
    for (int i = 0; i < 324; i++) h->byte_of[i] = -1;
    int extra = 0;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae);
        h->byte_of[printable ? b : 256 + extra++] = (int16_t)b;
    }
}

// The bytes a vocab string stands for, into buf (which holds at least strlen(s) bytes): each
// character through the table; a string with a character outside it stands for its own UTF-8
// (what the ByteLevel decoder does). Returns the length.
static size_t unmap_(const hf_load *h, const char *s, unsigned char *buf) {
    const unsigned char *p = (const unsigned char *)s;
    size_t n = 0;
    while (*p) {
        uint32_t cp;
        int k;
        if (*p < 0x80) cp = *p, k = 1;
        else if ((*p & 0xe0) == 0xc0) cp = *p & 0x1f, k = 2;
        else if ((*p & 0xf0) == 0xe0) cp = *p & 0x0f, k = 3;
        else cp = *p & 0x07, k = 4;
        for (int j = 1; j < k; j++) cp = cp << 6 | (p[j] & 0x3f);
        if (cp >= 324 || h->byte_of[cp] < 0) {
            size_t len = strlen(s);
            memcpy(buf, s, len);
            return len;
        }
        buf[n++] = (unsigned char)h->byte_of[cp];
        p += k;
    }
    return n;
}

static int json_true_(json_t *o, const char *key) { return json_is_true(json_object_get(o, key)); }

// A key that must be absent, null, false or "" (the module does not implement it yet).
static int unsupported_(json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v) || json_is_false(v)) return 0;
    if (json_is_string(v) && json_string_length(v) == 0) return 0;
    return 1;
}

static mtrl_status pre_tokenizer_(hf_load *h, json_t *pt, int *byte_level, mtrl_error *err) {
    const char *type = json_string_value(json_object_get(pt, "type"));
    if (!type) return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: pre_tokenizer has no \"type\"", h->path);
    if (strcmp(type, "Sequence") == 0) {
        json_t *list = json_object_get(pt, "pretokenizers");
        if (!json_is_array(list))
            return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: pre_tokenizer Sequence has no \"pretokenizers\" list",
                                  h->path);
        size_t i;
        json_t *step;
        json_array_foreach(list, i, step) {
            if (*byte_level)
                return mtrl_error_set(err, MTRL_ERR_FORMAT,
                                      "%s: pre_tokenizer.pretokenizers[%zu]: a step after ByteLevel is not supported",
                                      h->path, i);
            mtrl_status st = pre_tokenizer_(h, step, byte_level, err);
            if (st != MTRL_OK) return mtrl_error_wrap(err, "pre_tokenizer.pretokenizers[%zu]: ", i);
        }
        return MTRL_OK;
    }
    if (strcmp(type, "Split") == 0) {
        json_t *pat = json_object_get(pt, "pattern");
        const char *re = json_string_value(json_object_get(pat, "Regex"));
        const char *lit = json_string_value(json_object_get(pat, "String"));
        const char *behavior = json_string_value(json_object_get(pt, "behavior"));
        if (!re && !lit)
            return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: Split has no pattern {\"Regex\": ..} or {\"String\": ..}",
                                  h->path);
        if (!behavior || strcmp(behavior, "Isolated") != 0 || json_true_(pt, "invert"))
            return mtrl_error_set(err, MTRL_ERR_FORMAT,
                                  "%s: Split with behavior '%s'%s is not supported (only Isolated, not inverted)",
                                  h->path, behavior ? behavior : "(none)", json_true_(pt, "invert") ? ", inverted" : "");
        if (re) return bpe_add_split(h->t, re, "pre_tokenizer Split regex", err);
        // A literal: every byte escaped, so nothing in it is syntax.
        size_t n = strlen(lit);
        char *esc = xmalloc(n * 6 + 1);
        for (size_t i = 0; i < n; i++) snprintf(esc + 6 * i, 7, "\\x{%02x}", (unsigned char)lit[i]);
        esc[6 * n] = '\0';
        mtrl_status st = n ? bpe_add_split(h->t, esc, "pre_tokenizer Split string", err)
                           : mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: Split with an empty string", h->path);
        free(esc);
        return st;
    }
    if (strcmp(type, "ByteLevel") == 0) {
        if (json_true_(pt, "add_prefix_space"))
            return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: ByteLevel add_prefix_space is not supported yet", h->path);
        *byte_level = 1;
        json_t *use_regex = json_object_get(pt, "use_regex"); // the library's default is true
        if (!use_regex || json_is_true(use_regex))
            return bpe_add_split(h->t, HF_BYTELEVEL_PATTERN, "the ByteLevel pattern", err);
        return MTRL_OK;
    }
    return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: pre_tokenizer '%s' is not supported yet", h->path, type);
}

static mtrl_status vocab_(hf_load *h, mtrl_error *err) {
    mtrl_bpe *t = h->t;
    const char *key;
    json_t *v;
    unsigned char *buf = NULL;
    size_t cap = 0;
    json_object_foreach(h->vocab, key, v) {
        json_int_t id = json_integer_value(v);
        if (!json_is_integer(v) || id < 0)
            return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: model.vocab['%s'] is not an id", h->path, key);
        if (id >= MTRL_BPE_MAX_IDS)
            return mtrl_error_set(err, MTRL_ERR_LIMIT, "%s: model.vocab['%s']: id %lld is over the limit of %u",
                                  h->path, key, (long long)id, MTRL_BPE_MAX_IDS);
        size_t kl = strlen(key);
        if (kl + 1 > cap) buf = xrealloc(buf, cap = kl * 2 + 16);
        size_t n = unmap_(h, key, buf);
        uint32_t off = bpe_pool_add(t, buf, n), other;
        mtrl_status st = MTRL_OK;
        if (n == 0)
            st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: model.vocab has an empty token (id %lld)", h->path,
                                (long long)id);
        else if (bpe_set_id(t, (uint32_t)id, off, (uint32_t)n, BPE_ORDINARY))
            st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: model.vocab['%s']: id %lld is given twice", h->path, key,
                                (long long)id);
        else if (bpe_map_put(&t->ordinary, t->pool, off, (uint32_t)n, (uint32_t)id, &other))
            st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: model.vocab['%s'] (id %lld) has the bytes of id %u",
                                h->path, key, (long long)id, other);
        if (st != MTRL_OK) {
            free(buf);
            return st;
        }
    }
    free(buf);
    return MTRL_OK;
}

static mtrl_status vocab_id_(hf_load *h, size_t i, const char *a, const char *b, const char *s, uint32_t *id,
                             mtrl_error *err) {
    json_t *v = json_object_get(h->vocab, s);
    if (!v)
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: model.merges[%zu]: '%s %s': '%s' is not in the vocab",
                              h->path, i, a, b, s);
    *id = (uint32_t)json_integer_value(v);
    return MTRL_OK;
}

static mtrl_status merges_(hf_load *h, json_t *merges, mtrl_error *err) {
    size_t i;
    json_t *m;
    char *both = NULL;
    size_t cap = 0;
    mtrl_status st = MTRL_OK;
    json_array_foreach(merges, i, m) {
        const char *a = NULL, *b = NULL;
        char *split = NULL;
        if (json_is_array(m) && json_array_size(m) == 2) {
            a = json_string_value(json_array_get(m, 0));
            b = json_string_value(json_array_get(m, 1));
        } else if (json_is_string(m)) { // the older "a b" form
            split = xstrdup(json_string_value(m));
            char *sp = strchr(split, ' ');
            if (sp && !strchr(sp + 1, ' ')) *sp = '\0', a = split, b = sp + 1;
        }
        if (!a || !b || !*a || !*b) {
            free(split);
            st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: model.merges[%zu] is not a pair of tokens", h->path, i);
            break;
        }
        size_t la = strlen(a), lb = strlen(b);
        if (la + lb + 1 > cap) both = xrealloc(both, cap = (la + lb) * 2 + 16);
        memcpy(both, a, la);
        memcpy(both + la, b, lb + 1);
        uint32_t ia = 0, ib = 0, im = 0;
        st = vocab_id_(h, i, a, b, a, &ia, err);
        if (st == MTRL_OK) st = vocab_id_(h, i, a, b, b, &ib, err);
        if (st == MTRL_OK) st = vocab_id_(h, i, a, b, both, &im, err);
        free(split);
        if (st != MTRL_OK) break;
        if (i >= UINT32_MAX) {
            st = mtrl_error_set(err, MTRL_ERR_LIMIT, "%s: more than 2^32 merges", h->path);
            break;
        }
        bpe_pair_put(h->t, ia, ib, (uint32_t)i, im);
    }
    free(both);
    return st;
}

static mtrl_status added_tokens_(hf_load *h, json_t *list, mtrl_error *err) {
    mtrl_bpe *t = h->t;
    size_t i;
    json_t *a;
    json_array_foreach(list, i, a) {
        json_t *jid = json_object_get(a, "id");
        const char *content = json_string_value(json_object_get(a, "content"));
        json_int_t id = json_integer_value(jid);
        if (!json_is_integer(jid) || id < 0 || !content || !*content)
            return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: added_tokens[%zu] needs an \"id\" and a \"content\"",
                                  h->path, i);
        if (id >= MTRL_BPE_MAX_IDS)
            return mtrl_error_set(err, MTRL_ERR_LIMIT, "%s: added_tokens[%zu]: id %lld is over the limit of %u",
                                  h->path, i, (long long)id, MTRL_BPE_MAX_IDS);
        static const char *const flags[] = {"lstrip", "rstrip", "single_word"};
        for (int f = 0; f < 3; f++)
            if (json_true_(a, flags[f]))
                return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: added_tokens[%zu] ('%s'): %s is not supported yet",
                                      h->path, i, content, flags[f]);
        int kind = json_true_(a, "special") ? BPE_SPECIAL : BPE_ADDED;
        size_t len = strlen(content);
        unsigned char *buf = xmalloc(len + 1);
        size_t n = unmap_(h, content, buf); // decode goes through the ByteLevel decoder, as there
        uint32_t dec = bpe_pool_add(t, buf, n), match = bpe_pool_add(t, content, len), other;
        free(buf);
        if (bpe_set_id(t, (uint32_t)id, dec, (uint32_t)n, kind)) { // also a vocab token: now an added one
            t->tok_off[id] = dec;
            t->tok_len[id] = (uint32_t)n;
            t->tok_kind[id] = (uint8_t)kind;
        }
        if (bpe_map_put(&t->added, t->pool, match, (uint32_t)len, (uint32_t)id, &other))
            return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: added_tokens[%zu]: '%s' is already id %u", h->path, i,
                                  content, other);
    }
    return MTRL_OK;
}

static mtrl_status load_(hf_load *h, json_t *root, mtrl_error *err) {
    json_t *model = json_object_get(root, "model");
    if (!json_is_object(model)) return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: no \"model\" object", h->path);
    const char *type = json_string_value(json_object_get(model, "type"));
    if (type && strcmp(type, "BPE") != 0)
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: model.type '%s' is not supported (only BPE)", h->path, type);
    static const char *const unsupported[] = {"dropout", "continuing_subword_prefix", "end_of_word_suffix",
                                              "byte_fallback"};
    for (int i = 0; i < 4; i++)
        if (unsupported_(model, unsupported[i]))
            return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: model.%s is not supported yet", h->path, unsupported[i]);
    json_t *norm = json_object_get(root, "normalizer");
    if (norm && !json_is_null(norm)) {
        const char *nt = json_string_value(json_object_get(norm, "type"));
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: normalizer '%s' is not supported yet", h->path,
                              nt ? nt : "?");
    }
    h->vocab = json_object_get(model, "vocab");
    json_t *merges = json_object_get(model, "merges");
    if (!json_is_object(h->vocab))
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: model.vocab is missing or not an object", h->path);
    if (!json_is_array(merges))
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: model.merges is missing or not a list", h->path);
    h->t->whole_piece = json_true_(model, "ignore_merges");
    json_t *pt = json_object_get(root, "pre_tokenizer");
    int byte_level = 0;
    mtrl_status st = pt && !json_is_null(pt) ? pre_tokenizer_(h, pt, &byte_level, err) : MTRL_OK;
    if (st != MTRL_OK) return st;
    if (!byte_level)
        return mtrl_error_set(err, MTRL_ERR_FORMAT,
                              "%s: the pre_tokenizer has no ByteLevel step: only byte-level BPE is supported", h->path);
    if ((st = vocab_(h, err)) != MTRL_OK) return st;
    if ((st = merges_(h, merges, err)) != MTRL_OK) return st;
    json_t *added = json_object_get(root, "added_tokens");
    if (added && !json_is_array(added))
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: added_tokens is not a list", h->path);
    if (added && (st = added_tokens_(h, added, err)) != MTRL_OK) return st;
    return bpe_finish(h->t, err);
}

mtrl_status mtrl_bpe_init_hf(mtrl_bpe **out, const char *path, mtrl_error *err) {
    *out = NULL;
    json_error_t jerr;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) {
        if (jerr.line < 0)
            return mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot read: %s", path, jerr.text);
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s:%d:%d: bad JSON: %s", path, jerr.line, jerr.column,
                              jerr.text);
    }
    hf_load h = {.t = bpe_new(path), .path = path};
    byte_table_(&h);
    mtrl_status st = load_(&h, root, err);
    json_decref(root);
    if (st != MTRL_OK) {
        mtrl_bpe_free(h.t);
        return st;
    }
    *out = h.t;
    return MTRL_OK;
}
