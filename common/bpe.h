// bpe.h: byte-level BPE tokenizers of pretrained models (tiktoken files, Hugging Face
// tokenizer.json), a module of its own beside the byte tokenizer of tokenizer.h, which stays the
// default for models mtrl initialises itself (docs/tokenizer.md).
//
// Encoding is what tiktoken and the Hugging Face `tokenizers` library do, id for id:
//   1. special tokens: when allowed (MTRL_BPE_SPECIAL), every occurrence of a special token's
//      text becomes its id (leftmost, longest first); the text between is encoded as ordinary
//      text. Hugging Face added tokens that are not special are always matched, as there.
//   2. pre-split: the pre-tokenizer regex (Kimi's pat_str, or the tokenizer.json Split/ByteLevel
//      patterns) cuts the text into pieces, with PCRE2 in UTF mode (JIT where available). Text
//      that no match covers stays a piece of its own: bytes are never dropped. Invalid UTF-8 never
//      matches the regex, so each maximal run of it is one piece, encoded from its bytes (the
//      tiktoken library cannot take such text; mtrl keeps every byte so decode round-trips).
//   3. merges per piece: starting from one token per byte, the adjacent pair with the lowest
//      priority merges first (ties: the leftmost), until none is left. tiktoken: any pair whose
//      concatenation is a token, priority its rank; a piece that is itself a token is that token.
//      tokenizer.json: the pairs of model.merges, priority the line; ignore_merges as there.
//      A heap of candidate pairs over a linked list of parts: O(m log m) for a piece of m bytes.
// Decoding writes each token's bytes (special tokens as their text).
//
// A tokenizer is immutable once made: encode and decode may run on many threads at once.
// Ids are uint32; every id below mtrl_bpe_n_ids() that a file defines has bytes.
#ifndef MTRL_BPE_H
#define MTRL_BPE_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

// Kimi's pre-tokenizer pattern (the pat_str of Kimi-Linear's and Kimi-K2's tokenization_kimi.py),
// in the Rust-regex dialect that tiktoken compiles: `[A&&[^B]]` is a class intersection, `\s` the
// Unicode White_Space property, `\p{Han}` the Han script. mtrl translates it for PCRE2.
#define MTRL_BPE_PATTERN_KIMI                                                                  \
    "[\\p{Han}]+"                                                                              \
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*"                \
    "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"                 \
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+"                \
    "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"                 \
    "|\\p{N}{1,3}"                                                                             \
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"                                                          \
    "|\\s*[\\r\\n]+"                                                                           \
    "|\\s+(?!\\S)"                                                                             \
    "|\\s+"

// Kimi reserves this many special ids right after the ranks of its tiktoken.model.
#define MTRL_BPE_KIMI_RESERVED 256

// The most ids a tokenizer may have; a rank or id at or over it is refused (a garbage file must
// not make mtrl allocate gigabytes).
#define MTRL_BPE_MAX_IDS (1u << 26)

typedef struct mtrl_bpe mtrl_bpe;

typedef struct mtrl_bpe_special {
    const char *text; // NUL-terminated bytes that stand for the token in text
    uint32_t id;
} mtrl_bpe_special;

typedef struct mtrl_bpe_tiktoken_opts {
    // The pre-tokenizer regex in tiktoken's (Rust) dialect; NULL: MTRL_BPE_PATTERN_KIMI.
    const char *pattern;
    // A tokenizer_config.json whose added_tokens_decoder ({"ID": {"content": TEXT, ...}}) names
    // special tokens, as Kimi's; NULL: none.
    const char *config_path;
    // Kimi's layout: ids [R, R + n_reserved) after the R ranks are special tokens, named by the
    // config where it names them and "<|reserved_token_ID|>" otherwise. 0: only named ones.
    uint32_t n_reserved;
    // More special tokens, given by the caller (an id already taken is refused).
    const mtrl_bpe_special *specials;
    size_t n_specials;
} mtrl_bpe_tiktoken_opts;

// Loads a tiktoken file: one "base64(token bytes) rank" per line (empty lines skipped). Every
// byte must have a token. opts may be NULL (Kimi's pattern, no specials). A malformed line, bad
// base64, a repeated rank or token, a rank over MTRL_BPE_MAX_IDS, an id collision or a bad config
// returns MTRL_ERR_FORMAT (MTRL_ERR_LIMIT, MTRL_ERR_IO) with "PATH:LINE: what" in err; *out is
// then NULL.
mtrl_status mtrl_bpe_init_tiktoken(mtrl_bpe **out, const char *path, const mtrl_bpe_tiktoken_opts *opts,
                                   mtrl_error *err);

// Loads a Hugging Face tokenizer.json whose model is a byte-level BPE: model.type "BPE" with
// vocab and merges (either "a b" strings or ["a", "b"] pairs), a pre_tokenizer of ByteLevel
// (its GPT-2 regex when use_regex) or a Sequence of Split (Regex or String, behavior Isolated)
// ending in ByteLevel, and added_tokens. What the module does not implement yet is refused by
// name rather than approximated: a normalizer, BPE dropout, continuing_subword_prefix or
// end_of_word_suffix, byte_fallback, ByteLevel add_prefix_space, other pre-tokenizers, added
// tokens with lstrip/rstrip/single_word. The post_processor (e.g. a BOS template) is ignored: the
// caller adds such ids itself. Errors name the file and the entry ("tokenizer.json: merges[12]:
// 'a b': 'b' is not in the vocab", or the JSON parser's line and column).
mtrl_status mtrl_bpe_init_hf(mtrl_bpe **out, const char *path, mtrl_error *err);

void mtrl_bpe_free(mtrl_bpe *t); // NULL-safe

enum {
    MTRL_BPE_SPECIAL = 1u << 0,      // encode: special tokens in the text become their ids
    MTRL_BPE_SKIP_SPECIAL = 1u << 1, // decode: special tokens write nothing
};

// Encodes n bytes (any bytes; UTF-8 is split by the regex, anything else kept as is) into out,
// which must hold n ids (a token covers at least one byte, so n always suffices); *n_out gets
// the count. flags: MTRL_BPE_SPECIAL or 0 (special tokens' text is then ordinary text, as
// tiktoken's encode_ordinary). Fails only on a text of 4 GiB or more, or when PCRE2 does (a
// match or JIT stack limit on pathological text): MTRL_ERR_LIMIT naming the byte offset; out
// then holds nothing useful.
mtrl_status mtrl_bpe_encode(const mtrl_bpe *t, const void *text, size_t n, unsigned flags, uint32_t *out,
                            size_t *n_out, mtrl_error *err);

// Writes the bytes of ids into out snprintf-style: at most cap-1 bytes plus a NUL (out may be
// NULL when cap is 0); *len gets the length the whole text has. An id without bytes returns
// MTRL_ERR_FORMAT naming it and its position. flags: MTRL_BPE_SKIP_SPECIAL or 0.
mtrl_status mtrl_bpe_decode(const mtrl_bpe *t, const uint32_t *ids, size_t n, unsigned flags, char *out,
                            size_t cap, size_t *len, mtrl_error *err);

// One more than the largest id (ids below it that the files leave undefined have no bytes).
uint32_t mtrl_bpe_n_ids(const mtrl_bpe *t);

// The bytes of an id (not NUL-terminated) and their length, or NULL when the id has none.
const unsigned char *mtrl_bpe_token_bytes(const mtrl_bpe *t, uint32_t id, size_t *len);

// 1 when the id is a special (or added) token, 0 otherwise.
int mtrl_bpe_is_special(const mtrl_bpe *t, uint32_t id);

// The id of the special or added token whose text is exactly text ("[BOS]", "<|im_end|>");
// MTRL_ERR_NOTFOUND naming the text and the file when there is none.
mtrl_status mtrl_bpe_special_id(const mtrl_bpe *t, const char *text, uint32_t *id, mtrl_error *err);

// The file the tokenizer came from (for messages).
const char *mtrl_bpe_source(const mtrl_bpe *t);

#endif
