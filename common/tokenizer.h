// tokenizer.h: bytes plus special tokens.
//
// Ids 0..255 are the bytes themselves; the specials follow. Text never round-trips through a
// chat template: the actor keeps the sampled ids, env observations (bytes) are tokenized once,
// and the learner trains on exactly the ids the actor produced (docs/architecture.md §3).
//
// An episode reads:  BOS prompt-bytes  [model turn: bytes ... TOOL_OPEN call-bytes TOOL_CLOSE]
//                    RESULT_OPEN observation-bytes RESULT_CLOSE  ...  answer-bytes EOS
#ifndef MTRL_TOKENIZER_H
#define MTRL_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "common/config.h"
#include "common/status.h"

enum {
    MTRL_TOK_BOS = 256,
    MTRL_TOK_EOS = 257,
    MTRL_TOK_PADDING = 258,
    MTRL_TOK_TOOL_OPEN = 259,    // the model starts a tool call
    MTRL_TOK_TOOL_CLOSE = 260,   // the model ends a tool call: the actor calls the env
    MTRL_TOK_RESULT_OPEN = 261,  // the env's observation follows (tool tokens, never trained on)
    MTRL_TOK_RESULT_CLOSE = 262,
    MTRL_TOK_RESERVED = 263,
    MTRL_VOCAB = 264,
};

// Appends the ids of n bytes to out (which must hold n ids). Returns n.
size_t mtrl_tok_encode(const void *bytes, size_t n, uint32_t *out);

// Decodes ids into text: bytes as themselves, specials as "<|name|>". Writes at most cap-1
// bytes plus a NUL; returns the length the full text would have (snprintf-style).
size_t mtrl_tok_decode(const uint32_t *ids, size_t n, char *out, size_t cap);

// Decodes only the byte tokens (specials dropped): what a tool receives as its argument.
size_t mtrl_tok_bytes(const uint32_t *ids, size_t n, char *out, size_t cap);

// "<|eos|>" etc., or NULL for a byte id or an id outside the vocabulary.
const char *mtrl_tok_special_name(uint32_t id);

// ---- the experiment's tokenizer -------------------------------------------------------------------
// [model] tokenizer picks it: "bytes" (the ids above), a tiktoken.model or tokenizer.json path
// (common/bpe.h; a tiktoken file reads the tokenizer_config.json beside it for Kimi's special
// tokens and reserved ids), or "auto": with [model] from set, that folder's tiktoken.model (+
// tokenizer_config.json) or else its tokenizer.json; without from, bytes. Immutable once open.
// The calls below take NULL as the bytes tokenizer.
typedef struct mtrl_tokenizer mtrl_tokenizer;

// Opens it. The vocabulary must fit the model's: a BPE id at or over vocab (the model's V) is
// refused naming the file and both sizes (MTRL_ERR_MISMATCH); a bad file as bpe.h says.
mtrl_status mtrl_tokenizer_open(mtrl_tokenizer **out, const mtrl_cfg_model *cfg, uint32_t vocab, mtrl_error *err);
void mtrl_tokenizer_free(mtrl_tokenizer *t); // NULL-safe
int mtrl_tokenizer_is_bytes(const mtrl_tokenizer *t);
const char *mtrl_tokenizer_source(const mtrl_tokenizer *t); // "bytes" or the file
// Ids of n bytes of text, special tokens' text as ordinary text (an env's prompt or tool result
// can never inject a control token). out holds n ids; returns the count.
size_t mtrl_tokenizer_encode(const mtrl_tokenizer *t, const void *text, size_t n, uint32_t *out);
// The bytes of ids snprintf-style, specials dropped (what an env receives); ids without bytes
// are dropped too. Returns the full length.
size_t mtrl_tokenizer_text(const mtrl_tokenizer *t, const uint32_t *ids, size_t n, char *out, size_t cap);
// One id as a reader sees it (mtrl replay): its bytes into out with *special = 0, a special
// token's text ("<|im_end|>", "<|eos|>") with *special = 1, or "" with *special = -1 for an id
// that has neither. snprintf-style; returns the full length.
size_t mtrl_tokenizer_piece(const mtrl_tokenizer *t, uint32_t id, char *out, size_t cap, int *special);
// The id of the special token written text ("<|im_end|>"), or MTRL_ERR_NOTFOUND naming it and
// the tokenizer. The bytes tokenizer knows its own names ("<|eos|>", ...).
mtrl_status mtrl_tokenizer_special(const mtrl_tokenizer *t, const char *text, uint32_t *id, mtrl_error *err);

#endif
