// tokenizer.c: bytes plus special tokens (see tokenizer.h).
#include "common/tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/bpe.h"
#include "common/check.h"

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

// ---- the experiment's tokenizer -------------------------------------------------------------------

struct mtrl_tokenizer {
    mtrl_bpe *bpe; // NULL: bytes
    char source[MTRL_CFG_STR_MAX + 32];
};

static int ends_with_(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !strcmp(s + a - b, suffix);
}

static mtrl_status open_file_(mtrl_tokenizer *t, const char *path, mtrl_error *err) {
    snprintf(t->source, sizeof t->source, "%s", path);
    if (ends_with_(path, ".json")) return mtrl_bpe_init_hf(&t->bpe, path, err);
    // A tiktoken file: Kimi's specials come from the tokenizer_config.json beside it.
    char cfgp[MTRL_CFG_STR_MAX + 64];
    const char *slash = strrchr(path, '/');
    snprintf(cfgp, sizeof cfgp, "%.*stokenizer_config.json", slash ? (int)(slash - path + 1) : 0, path);
    mtrl_bpe_tiktoken_opts o = {0};
    if (access(cfgp, F_OK) == 0) {
        o.config_path = cfgp;
        o.n_reserved = MTRL_BPE_KIMI_RESERVED;
    }
    return mtrl_bpe_init_tiktoken(&t->bpe, path, &o, err);
}

mtrl_status mtrl_tokenizer_open(mtrl_tokenizer **out, const mtrl_cfg_model *cfg, uint32_t vocab, mtrl_error *err) {
    *out = NULL;
    mtrl_tokenizer *t = xcalloc(1, sizeof *t);
    snprintf(t->source, sizeof t->source, "bytes");
    const char *want = cfg->tokenizer;
    mtrl_status st = MTRL_OK;
    char path[MTRL_CFG_STR_MAX + 32];
    if (!strcmp(want, "bytes") || (!strcmp(want, "auto") && !cfg->from[0])) {
        if (vocab < MTRL_VOCAB)
            st = mtrl_error_set(err, MTRL_ERR_MISMATCH, "[model] tokenizer = bytes has %d ids, more than the model's vocabulary of %u",
                                MTRL_VOCAB, vocab);
    } else if (!strcmp(want, "auto")) {
        snprintf(path, sizeof path, "%s/tiktoken.model", cfg->from);
        if (access(path, F_OK) != 0) snprintf(path, sizeof path, "%s/tokenizer.json", cfg->from);
        if (access(path, F_OK) != 0)
            st = mtrl_error_set(err, MTRL_ERR_NOTFOUND, "[model] tokenizer = auto: %s has neither tiktoken.model nor tokenizer.json; "
                                "set [model] tokenizer", cfg->from);
        else st = open_file_(t, path, err);
    } else {
        st = open_file_(t, want, err);
    }
    if (st == MTRL_OK && t->bpe && mtrl_bpe_n_ids(t->bpe) > vocab)
        st = mtrl_error_set(err, MTRL_ERR_MISMATCH, "%s: the tokenizer has ids up to %u, the model's vocabulary only %u",
                            t->source, mtrl_bpe_n_ids(t->bpe) - 1, vocab);
    if (st != MTRL_OK) {
        mtrl_tokenizer_free(t);
        return st;
    }
    *out = t;
    return MTRL_OK;
}

void mtrl_tokenizer_free(mtrl_tokenizer *t) {
    if (!t) return;
    mtrl_bpe_free(t->bpe);
    free(t);
}

int mtrl_tokenizer_is_bytes(const mtrl_tokenizer *t) { return !t || !t->bpe; }
const char *mtrl_tokenizer_source(const mtrl_tokenizer *t) { return t ? t->source : "bytes"; }

size_t mtrl_tokenizer_encode(const mtrl_tokenizer *t, const void *text, size_t n, uint32_t *out) {
    if (!t || !t->bpe) return mtrl_tok_encode(text, n, out);
    size_t k = 0;
    mtrl_error err;
    mtrl_status st = mtrl_bpe_encode(t->bpe, text, n, 0, out, &k, &err);
    // Only a text of 4 GiB or more, or PCRE2's match limit on pathological text, fails: the
    // callers' texts (prompts, observations capped by [env] max_obs_bytes) are far below.
    MTRL_CHECKF(st == MTRL_OK, "%s", err.msg);
    return k;
}

size_t mtrl_tokenizer_text(const mtrl_tokenizer *t, const uint32_t *ids, size_t n, char *out, size_t cap) {
    if (!t || !t->bpe) return mtrl_tok_bytes(ids, n, out, cap);
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        size_t len = 0;
        const unsigned char *b = mtrl_bpe_is_special(t->bpe, ids[i]) ? NULL : mtrl_bpe_token_bytes(t->bpe, ids[i], &len);
        for (size_t j = 0; b && j < len; j++, at++)
            if (at + 1 < cap) out[at] = (char)b[j];
    }
    if (cap) out[at < cap ? at : cap - 1] = '\0';
    return at;
}

size_t mtrl_tokenizer_piece(const mtrl_tokenizer *t, uint32_t id, char *out, size_t cap, int *special) {
    unsigned char byte = (unsigned char)id;
    const unsigned char *b = NULL;
    size_t len = 0;
    *special = -1;
    if (t && t->bpe) {
        b = mtrl_bpe_token_bytes(t->bpe, id, &len);
        if (b) *special = mtrl_bpe_is_special(t->bpe, id) ? 1 : 0;
    } else if (id < 256) {
        b = &byte;
        len = 1;
        *special = 0;
    } else if (mtrl_tok_special_name(id)) {
        b = (const unsigned char *)mtrl_tok_special_name(id);
        len = strlen((const char *)b);
        *special = 1;
    }
    if (cap) {
        size_t k = len < cap - 1 ? len : cap - 1;
        if (k) memcpy(out, b, k);
        out[k] = '\0';
    }
    return len;
}

mtrl_status mtrl_tokenizer_special(const mtrl_tokenizer *t, const char *text, uint32_t *id, mtrl_error *err) {
    if (t && t->bpe) return mtrl_bpe_special_id(t->bpe, text, id, err);
    for (uint32_t i = MTRL_TOK_BOS; i < MTRL_VOCAB; i++)
        if (!strcmp(specials_[i - 256], text)) {
            *id = i;
            return MTRL_OK;
        }
    return mtrl_error_set(err, MTRL_ERR_NOTFOUND, "the bytes tokenizer has no special token %s", text);
}
