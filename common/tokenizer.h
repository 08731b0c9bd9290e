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

#endif
