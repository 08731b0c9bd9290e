// bpe_internal.h: the tokenizer object shared by bpe.c (tables, encode, decode), bpe_regex.c
// (pattern translation for PCRE2) and the loaders bpe_tiktoken.c and bpe_hf.c. Not a public
// header: the loaders build a tokenizer through these calls, everyone else uses bpe.h.
#ifndef MTRL_BPE_INTERNAL_H
#define MTRL_BPE_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "common/bpe.h"

// Bytes -> id, open addressing over entries whose keys live in the tokenizer's pool (offsets, so
// the pool may grow while a file loads).
typedef struct bpe_map {
    uint32_t *slot; // entry index + 1, 0 empty
    size_t mask;
    uint32_t *off, *len, *val;
    size_t n, cap;
} bpe_map;

enum { BPE_ABSENT = 0, BPE_ORDINARY = 1, BPE_ADDED = 2, BPE_SPECIAL = 3 };
enum { BPE_MAX_SPLITS = 8 };

struct mtrl_bpe {
    char *source;
    uint32_t n_ids, ids_cap;
    uint32_t *tok_off, *tok_len; // by id: the bytes decode writes, in pool
    uint8_t *tok_kind;           // BPE_ABSENT, BPE_ORDINARY, BPE_ADDED, BPE_SPECIAL
    unsigned char *pool;
    size_t pool_n, pool_cap;
    bpe_map ordinary; // token bytes -> id (merges by rank, the whole-piece rule)
    uint32_t max_len; // the longest key of ordinary: longer byte runs need no lookup
    bpe_map added;    // text that stands for an added or special token -> id
    // tokenizer.json merges: (left id, right id) -> (priority, merged id); keys UINT64_MAX empty.
    uint64_t *pair_key;
    uint32_t *pair_prio, *pair_id;
    size_t pair_mask, pair_n;
    int by_rank;     // tiktoken: a pair merges when its concatenation is a token, priority its id
    int whole_piece; // a piece that is itself a token is that token (tiktoken; ignore_merges)
    uint32_t byte_id[256];
    pcre2_code *split[BPE_MAX_SPLITS]; // applied in order, each to the pieces of the one before
    int n_split;
    pcre2_code *special_all;    // every added token (MTRL_BPE_SPECIAL); NULL when none
    pcre2_code *special_always; // added tokens that are not special; NULL when none
};

mtrl_bpe *bpe_new(const char *source);
// Copies bytes into the pool and returns their offset.
uint32_t bpe_pool_add(mtrl_bpe *t, const void *bytes, size_t len);
// Gives id the bytes (pool offset, length) and a kind. Returns 0, or 1 when id already has bytes.
int bpe_set_id(mtrl_bpe *t, uint32_t id, uint32_t off, uint32_t len, int kind);
// Map calls. put returns 0, or 1 when the key is there already (*old gets its value; the map is
// unchanged). get returns 1 and *val when the key is there.
int bpe_map_put(bpe_map *m, const unsigned char *pool, uint32_t off, uint32_t len, uint32_t val, uint32_t *old);
int bpe_map_get(const bpe_map *m, const unsigned char *pool, const void *key, size_t len, uint32_t *val);
// Adds or replaces a merge (the last one given wins, as in the tokenizers library).
void bpe_pair_put(mtrl_bpe *t, uint32_t left, uint32_t right, uint32_t prio, uint32_t id);
int bpe_pair_get(const mtrl_bpe *t, uint32_t left, uint32_t right, uint32_t *prio, uint32_t *id);
// After the loader has given every token: the byte table (every byte needs an ordinary token of
// that one byte) and the special-token matchers.
mtrl_status bpe_finish(mtrl_bpe *t, mtrl_error *err);

// Compiles a pre-tokenizer pattern (tiktoken's Rust dialect or the Oniguruma one of
// tokenizer.json: the same for what they use) into t->split[t->n_split++]. what names the
// pattern in messages.
mtrl_status bpe_add_split(mtrl_bpe *t, const char *pattern, const char *what, mtrl_error *err);
// Compiles an alternation of literal byte strings (longest first), matched without UTF.
mtrl_status bpe_compile_literals(const unsigned char *const *lits, const size_t *lens, size_t n,
                                 pcre2_code **out, const char *what, mtrl_error *err);

// Reads a whole file (NUL-terminated for convenience); MTRL_ERR_IO naming it.
mtrl_status bpe_read_file(const char *path, char **data, size_t *n, mtrl_error *err);

#endif
