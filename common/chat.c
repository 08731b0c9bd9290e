// chat.c: episode framing and tool-call parsing per chat template (see chat.h).
#include "common/chat.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"

const mtrl_chat mtrl_chat_bytes = {
    .tok = NULL, .kind = MTRL_CHAT_BYTES, .end = MTRL_TOK_EOS, .end2 = MTRL_TOK_EOS,
    .call_open = MTRL_TOK_TOOL_OPEN, .call_close = MTRL_TOK_TOOL_CLOSE,
};

static mtrl_status special_(const mtrl_chat *c, const char *text, uint32_t *id, mtrl_error *err) {
    mtrl_status st = mtrl_tokenizer_special(c->tok, text, id, err);
    if (st != MTRL_OK)
        mtrl_error_wrap(err, "[model] chat_template = kimi needs Kimi's special token %s in %s", text,
                        mtrl_tokenizer_source(c->tok));
    return st;
}

mtrl_status mtrl_chat_init(mtrl_chat *c, const mtrl_cfg_model *cfg, uint32_t vocab, mtrl_error *err) {
    memset(c, 0, sizeof *c);
    mtrl_status st = mtrl_tokenizer_open(&c->tok, cfg, vocab, err);
    if (st != MTRL_OK) return st;
    int bytes = mtrl_tokenizer_is_bytes(c->tok);
    uint32_t probe;
    int has_kimi = !bytes && mtrl_tokenizer_special(c->tok, "<|im_middle|>", &probe, NULL) == MTRL_OK;
    const char *want = cfg->chat_template;
    c->kind = !strcmp(want, "kimi") || (!strcmp(want, "auto") && has_kimi) ? MTRL_CHAT_KIMI : MTRL_CHAT_BYTES;
    if (c->kind == MTRL_CHAT_BYTES && !bytes)
        st = mtrl_error_set(err, MTRL_ERR_USAGE, "[model] chat_template = bytes needs [model] tokenizer = bytes (the tokenizer is %s: "
                            "set chat_template = kimi for Kimi's tokens)", mtrl_tokenizer_source(c->tok));
    else if (c->kind == MTRL_CHAT_KIMI && bytes)
        st = mtrl_error_set(err, MTRL_ERR_USAGE, "[model] chat_template = kimi needs Kimi's tokenizer, not bytes");
    if (st == MTRL_OK && c->kind == MTRL_CHAT_BYTES) {
        c->end = c->end2 = MTRL_TOK_EOS;
        c->call_open = MTRL_TOK_TOOL_OPEN;
        c->call_close = MTRL_TOK_TOOL_CLOSE;
    }
    if (st == MTRL_OK && c->kind == MTRL_CHAT_KIMI) {
        struct { const char *text; uint32_t *id; } need[] = {
            {"<|im_end|>", &c->im_end},           {"<|im_user|>", &c->user},
            {"<|im_assistant|>", &c->assistant},  {"<|im_system|>", &c->system},
            {"<|im_middle|>", &c->middle},        {"<|tool_calls_section_end|>", &c->section_end},
            {"<|tool_call_begin|>", &c->call_open}, {"<|tool_call_end|>", &c->call_close},
            {"<|tool_call_argument_begin|>", &c->arg}, {"<|tool_calls_section_begin|>", &c->section_begin},
        };
        for (size_t i = 0; i < sizeof need / sizeof need[0] && st == MTRL_OK; i++) st = special_(c, need[i].text, need[i].id, err);
        c->end = c->im_end;
        if (st == MTRL_OK && mtrl_tokenizer_special(c->tok, "[EOS]", &c->end2, NULL) != MTRL_OK) c->end2 = c->im_end;
    }
    if (st != MTRL_OK) mtrl_chat_free(c);
    return st;
}

void mtrl_chat_free(mtrl_chat *c) {
    mtrl_tokenizer_free(c->tok);
    memset(c, 0, sizeof *c);
}

// A growing list of ids bounded by cap.
typedef struct ids_ {
    uint32_t *out;
    size_t n, cap;
    int over;
} ids_;

static void put_id_(ids_ *b, uint32_t id) {
    if (b->n < b->cap) b->out[b->n] = id;
    else b->over = 1;
    b->n++;
}

static void put_text_(const mtrl_chat *c, ids_ *b, const char *text, size_t n) {
    uint32_t *tmp = xmalloc(sizeof(uint32_t) * (n + 1));
    size_t k = mtrl_tokenizer_encode(c->tok, text, n, tmp);
    for (size_t i = 0; i < k; i++) put_id_(b, tmp[i]);
    free(tmp);
}

static void open_assistant_(const mtrl_chat *c, ids_ *b) {
    put_id_(b, c->assistant);
    put_text_(c, b, "assistant", 9);
    put_id_(b, c->middle);
}

long mtrl_chat_prompt(const mtrl_chat *c, const char *prompt, size_t n, uint32_t *out, size_t cap) {
    ids_ b = {out, 0, cap, 0};
    if (c->kind == MTRL_CHAT_BYTES) {
        put_id_(&b, MTRL_TOK_BOS);
        put_text_(c, &b, prompt, n);
    } else {
        put_id_(&b, c->user);
        put_text_(c, &b, "user", 4);
        put_id_(&b, c->middle);
        put_text_(c, &b, prompt, n);
        put_id_(&b, c->im_end);
        open_assistant_(c, &b);
    }
    return b.over ? -1 : (long)b.n;
}

long mtrl_chat_demo_call(const mtrl_chat *c, const char *action, size_t n, int idx, uint32_t *out, size_t cap,
                         char *call_id, size_t idcap) {
    ids_ b = {out, 0, cap, 0};
    if (idcap) call_id[0] = 0;
    if (c->kind == MTRL_CHAT_KIMI) put_id_(&b, c->section_begin); // one call per section
    put_id_(&b, c->call_open);
    if (c->kind == MTRL_CHAT_BYTES) {
        put_text_(c, &b, action, n);
    } else {
        // NAME(ARGS) -> functions.NAME:IDX <arg> ARGS; an action without that shape goes as text
        const char *lp = memchr(action, '(', n);
        if (lp && n > 0 && action[n - 1] == ')') {
            snprintf(call_id, idcap, "functions.%.*s:%d", (int)(lp - action), action, idx);
            put_text_(c, &b, call_id, strlen(call_id));
            put_id_(&b, c->arg);
            put_text_(c, &b, lp + 1, (size_t)(action + n - 1 - (lp + 1)));
        } else {
            put_text_(c, &b, action, n);
        }
    }
    put_id_(&b, c->call_close);
    return b.over ? -1 : (long)b.n;
}

long mtrl_chat_demo_answer(const mtrl_chat *c, const char *answer, size_t n, uint32_t *out, size_t cap) {
    ids_ b = {out, 0, cap, 0};
    put_text_(c, &b, answer, n);
    put_id_(&b, c->end);
    return b.over ? -1 : (long)b.n;
}

int mtrl_chat_role(const mtrl_chat *c, uint32_t id) {
    if (id == c->end || id == c->end2) return MTRL_CHAT_END;
    if (id == c->call_open) return MTRL_CHAT_CALL_OPEN;
    if (id == c->call_close) return MTRL_CHAT_CALL_CLOSE;
    return MTRL_CHAT_TEXT;
}

size_t mtrl_chat_text(const mtrl_chat *c, const uint32_t *ids, size_t n, char *out, size_t cap) {
    return mtrl_tokenizer_text(c->tok, ids, n, out, cap);
}

size_t mtrl_chat_call(const mtrl_chat *c, const uint32_t *ids, size_t n, char *out, size_t cap, char *call_id,
                      size_t idcap) {
    if (idcap) call_id[0] = 0;
    size_t arg = n;
    for (size_t i = 0; c->kind == MTRL_CHAT_KIMI && i < n && arg == n; i++)
        if (ids[i] == c->arg) arg = i;
    if (c->kind == MTRL_CHAT_BYTES || arg == n) return mtrl_chat_text(c, ids, n, out, cap);
    char head[256];
    mtrl_tokenizer_text(c->tok, ids, arg, head, sizeof head);
    const char *colon = strrchr(head, ':');
    if (strncmp(head, "functions.", 10) || !colon || colon == head + 10) return mtrl_chat_text(c, ids, n, out, cap);
    snprintf(call_id, idcap, "%s", head);
    size_t at = (size_t)snprintf(out, cap, "%.*s(", (int)(colon - head - 10), head + 10);
    if (at >= cap) return at;
    at += mtrl_tokenizer_text(c->tok, ids + arg + 1, n - arg - 1, out + at, cap - at);
    if (at + 1 < cap) {
        out[at] = ')';
        out[at + 1] = 0;
    }
    return at + 1;
}

long mtrl_chat_result(const mtrl_chat *c, const char *call_id, const char *obs, size_t n, uint32_t *out, size_t cap) {
    ids_ b = {out, 0, cap, 0};
    if (c->kind == MTRL_CHAT_BYTES) {
        put_id_(&b, MTRL_TOK_RESULT_OPEN);
        put_text_(c, &b, obs, n);
        put_id_(&b, MTRL_TOK_RESULT_CLOSE);
    } else {
        put_id_(&b, c->section_end);
        put_id_(&b, c->im_end);
        put_id_(&b, c->system);
        put_text_(c, &b, "tool", 4);
        put_id_(&b, c->middle);
        // One text between the specials, encoded whole as the template's rendering would be.
        size_t hn = strlen(call_id) + 16;
        char *text = xmalloc(hn + n + 1);
        int k = snprintf(text, hn, "## Return of %s\n", call_id);
        memcpy(text + k, obs, n);
        put_text_(c, &b, text, (size_t)k + n);
        free(text);
        put_id_(&b, c->im_end);
        open_assistant_(c, &b);
    }
    return b.over ? -1 : (long)b.n;
}
