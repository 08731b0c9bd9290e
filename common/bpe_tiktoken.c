// bpe_tiktoken.c: loads a tiktoken file and Kimi's special-token layout (see bpe.h).
#include <jansson.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bpe_internal.h"
#include "common/check.h"

// One "base64 rank" line into *tok (a pool offset and length) and *rank.
static mtrl_status tiktoken_line_(mtrl_bpe *t, const char *path, size_t lineno, char *line, uint32_t *off,
                                  uint32_t *len, uint32_t *rank, mtrl_error *err) {
    char *sp = strchr(line, ' ');
    if (!sp || sp == line || sp[1] == '\0' || strchr(sp + 1, ' '))
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s:%zu: expected 'BASE64 RANK', got '%.60s'", path, lineno,
                              line);
    *sp = '\0';
    const char *num = sp + 1;
    uint64_t r = 0;
    for (const char *q = num; *q; q++) {
        if (*q < '0' || *q > '9')
            return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s:%zu: rank '%.30s' is not a number", path, lineno, num);
        r = r * 10 + (uint64_t)(*q - '0');
        if (r >= MTRL_BPE_MAX_IDS)
            return mtrl_error_set(err, MTRL_ERR_LIMIT, "%s:%zu: rank %.30s is over the limit of %u ids", path, lineno,
                                  num, MTRL_BPE_MAX_IDS);
    }
    size_t b64 = (size_t)(sp - line), n = 0;
    unsigned char *bin = xmalloc(b64 + 1);
    const char *end = NULL;
    int bad = sodium_base642bin(bin, b64 + 1, line, b64, NULL, &n, &end, sodium_base64_VARIANT_ORIGINAL) != 0 ||
              end != line + b64 || n == 0;
    if (bad) {
        free(bin);
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s:%zu: '%.60s' is not base64 of a non-empty token", path,
                              lineno, line);
    }
    *off = bpe_pool_add(t, bin, n);
    *len = (uint32_t)n;
    *rank = (uint32_t)r;
    free(bin);
    return MTRL_OK;
}

static mtrl_status load_ranks_(mtrl_bpe *t, const char *path, uint32_t *n_ranks, mtrl_error *err) {
    char *data;
    size_t n;
    mtrl_status st = bpe_read_file(path, &data, &n, err);
    if (st != MTRL_OK) return st;
    uint32_t *line_of = NULL; // by rank: the line that gave it (for the duplicate message)
    size_t line_cap = 0, lineno = 0;
    *n_ranks = 0;
    for (char *line = data; st == MTRL_OK && line < data + n;) {
        char *nl = memchr(line, '\n', (size_t)(data + n - line));
        char *next = nl ? nl + 1 : data + n;
        if (nl) *nl = '\0';
        lineno++;
        size_t ll = strlen(line);
        if ((size_t)(next - line) - (nl ? 1 : 0) != ll) {
            st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s:%zu: a NUL byte in the line", path, lineno);
            break;
        }
        if (ll && line[ll - 1] == '\r') line[--ll] = '\0';
        if (ll) {
            uint32_t off = 0, len = 0, rank = 0, other = 0;
            st = tiktoken_line_(t, path, lineno, line, &off, &len, &rank, err);
            if (st != MTRL_OK) break;
            if (rank >= line_cap) {
                size_t cap = line_cap ? line_cap : 4096;
                while (cap <= rank) cap *= 2;
                line_of = xrealloc(line_of, cap * sizeof *line_of);
                line_cap = cap;
            }
            if (bpe_set_id(t, rank, off, len, BPE_ORDINARY)) {
                st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s:%zu: rank %u was already given at line %u", path, lineno,
                                    rank, line_of[rank]);
            } else if (bpe_map_put(&t->ordinary, t->pool, off, len, rank, &other)) {
                st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s:%zu: token '%s' already has rank %u (line %u)", path,
                                    lineno, line, other, line_of[other]);
            }
            line_of[rank] = (uint32_t)lineno;
            (*n_ranks)++;
        }
        line = next;
    }
    if (st == MTRL_OK && *n_ranks == 0) st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: no ranks", path);
    free(line_of);
    free(data);
    return st;
}

static mtrl_status add_special_(mtrl_bpe *t, const char *text, uint32_t id, const char *from, mtrl_error *err) {
    size_t len = strlen(text);
    if (!len) return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: special token %u has no text", from, id);
    if (id >= MTRL_BPE_MAX_IDS)
        return mtrl_error_set(err, MTRL_ERR_LIMIT, "%s: special token '%s': id %u is over the limit of %u ids", from,
                              text, id, MTRL_BPE_MAX_IDS);
    uint32_t off = bpe_pool_add(t, text, len), other;
    if (bpe_set_id(t, id, off, (uint32_t)len, BPE_SPECIAL))
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: special token '%s': id %u is already a token of %s", from,
                              text, id, t->source);
    if (bpe_map_put(&t->added, t->pool, off, (uint32_t)len, id, &other))
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: special token '%s' (id %u) is also id %u", from, text, id,
                              other);
    return MTRL_OK;
}

// Kimi's tokenizer_config.json names its specials in added_tokens_decoder: {"ID": {"content": ..}}.
// Their names go to names[id - base] for ids in the reserved range, the others straight in.
static mtrl_status load_config_(mtrl_bpe *t, const char *path, uint32_t base, uint32_t n_reserved, char **names,
                                mtrl_error *err) {
    json_error_t jerr;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s:%d:%d: bad JSON: %s", path, jerr.line, jerr.column,
                              jerr.text);
    mtrl_status st = MTRL_OK;
    json_t *dec = json_object_get(root, "added_tokens_decoder");
    if (dec && !json_is_object(dec))
        st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: added_tokens_decoder is not an object", path);
    const char *key;
    json_t *v;
    json_object_foreach(dec, key, v) {
        if (st != MTRL_OK) break;
        char *endp;
        unsigned long id = strtoul(key, &endp, 10);
        const char *content = json_string_value(json_object_get(v, "content"));
        if (*key == '\0' || *endp != '\0' || id >= MTRL_BPE_MAX_IDS)
            st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: added_tokens_decoder['%s']: the key is not an id", path,
                                key);
        else if (!content)
            st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: added_tokens_decoder['%s']: no \"content\" string", path,
                                key);
        else if (id >= base && id < (unsigned long)base + n_reserved) {
            free(names[id - base]);
            names[id - base] = xstrdup(content);
        } else
            st = add_special_(t, content, (uint32_t)id, path, err);
    }
    json_decref(root);
    return st;
}

mtrl_status mtrl_bpe_init_tiktoken(mtrl_bpe **out, const char *path, const mtrl_bpe_tiktoken_opts *opts,
                                   mtrl_error *err) {
    static const mtrl_bpe_tiktoken_opts none = {0};
    if (!opts) opts = &none;
    *out = NULL;
    mtrl_bpe *t = bpe_new(path);
    t->by_rank = 1;
    t->whole_piece = 1;
    uint32_t n_ranks = 0;
    mtrl_status st = load_ranks_(t, path, &n_ranks, err);
    uint32_t n_res = opts->n_reserved;
    if (st == MTRL_OK && (uint64_t)n_ranks + n_res > MTRL_BPE_MAX_IDS)
        st = mtrl_error_set(err, MTRL_ERR_LIMIT, "%s: %u reserved ids after %u ranks are over the limit", path, n_res,
                            n_ranks);
    char **names = st == MTRL_OK ? xcalloc(n_res + 1, sizeof *names) : NULL;
    if (st == MTRL_OK && opts->config_path) st = load_config_(t, opts->config_path, n_ranks, n_res, names, err);
    for (uint32_t i = 0; st == MTRL_OK && i < n_res; i++) {
        char buf[48];
        if (!names[i]) snprintf(buf, sizeof buf, "<|reserved_token_%u|>", n_ranks + i);
        st = add_special_(t, names[i] ? names[i] : buf, n_ranks + i, opts->config_path ? opts->config_path : path,
                          err);
    }
    for (uint32_t i = 0; names && i < n_res; i++) free(names[i]);
    free(names);
    for (size_t i = 0; st == MTRL_OK && i < opts->n_specials; i++)
        st = add_special_(t, opts->specials[i].text, opts->specials[i].id, "the caller's special tokens", err);
    if (st == MTRL_OK)
        st = bpe_add_split(t, opts->pattern ? opts->pattern : MTRL_BPE_PATTERN_KIMI, "the pre-tokenizer pattern", err);
    if (st == MTRL_OK) st = bpe_finish(t, err);
    if (st != MTRL_OK) {
        mtrl_bpe_free(t);
        return st;
    }
    *out = t;
    return MTRL_OK;
}
