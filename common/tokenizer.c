// tokenizer.c: bytes plus special tokens (see tokenizer.h).
#include "common/tokenizer.h"

#include <string.h>

static const char *specials_[] = {"<|bos|>", "<|eos|>", "<|pad|>", "<|tool|>", "<|/tool|>",
                                  "<|result|>", "<|/result|>", "<|reserved|>"};

size_t mtrl_tok_encode(const void *bytes, size_t n, uint32_t *out) {
    const unsigned char *b = bytes;
    for (size_t i = 0; i < n; i++) out[i] = b[i];
    return n;
}

const char *mtrl_tok_special_name(uint32_t id) {
    if (id < 256 || id >= MTRL_VOCAB) return NULL;
    return specials_[id - 256];
}

static size_t put_(char *out, size_t cap, size_t at, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++, at++)
        if (at + 1 < cap) out[at] = s[i];
    return at;
}

size_t mtrl_tok_decode(const uint32_t *ids, size_t n, char *out, size_t cap) {
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 256) {
            char c = (char)ids[i];
            at = put_(out, cap, at, &c, 1);
        } else {
            const char *s = mtrl_tok_special_name(ids[i]);
            if (!s) s = "<|?|>";
            at = put_(out, cap, at, s, strlen(s));
        }
    }
    if (cap) out[at < cap ? at : cap - 1] = '\0';
    return at;
}

size_t mtrl_tok_bytes(const uint32_t *ids, size_t n, char *out, size_t cap) {
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] >= 256) continue;
        char c = (char)ids[i];
        at = put_(out, cap, at, &c, 1);
    }
    if (cap) out[at < cap ? at : cap - 1] = '\0';
    return at;
}
