// bpe_regex.c: pre-tokenizer patterns for PCRE2 (see bpe.h).
//
// tiktoken compiles its pat_str with Rust's regex (through fancy-regex) and the tokenizers
// library with Oniguruma; PCRE2 reads three things in those patterns differently, so they are
// rewritten before compiling (tests/test_bpe.c checks the result against both libraries' ids):
//   [A&&B]   a class intersection (Rust, Oniguruma); PCRE2 10.42 has none and would read '&&['
//            as literal characters. Written (?:(?=B)A): both sides match the same one character.
//   \s, \S   Unicode White_Space in Rust; PCRE2's \s (UCP) also takes U+180E, so the set is
//            spelled out.
//   \p{Han}  a bare script name is the Script property in Rust and Oniguruma, Script_Extensions
//            in PCRE2 >= 10.40 (which would put '、' with the Han characters): \p{sc:Han}.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bpe_internal.h"
#include "common/check.h"

// White_Space (Unicode PropList), as items of a character class.
#define WS_ITEMS "\\t-\\r\\x{20}\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}"

typedef struct sb {
    char *s;
    size_t n, cap;
} sb;

static void sb_put_(sb *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        b->cap = (b->n + n + 1) * 2 + 64;
        b->s = xrealloc(b->s, b->cap);
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = '\0';
}

static void sb_str_(sb *b, const char *s) { sb_put_(b, s, strlen(s)); }

typedef struct xlate {
    const char *pat;
    size_t bad_at; // where an unsupported construct starts
    const char *bad;
} xlate;

// A script name compiles as \p{sc:NAME}; general categories and binary properties do not.
static int is_script_(const char *name, size_t len) {
    char buf[96];
    if (len + 8 > sizeof buf) return 0;
    for (size_t i = 0; i < len; i++)
        if (name[i] == ':' || name[i] == '=' || name[i] == '^') return 0;
    int n = snprintf(buf, sizeof buf, "\\p{sc:%.*s}", (int)len, name);
    int code;
    PCRE2_SIZE off;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)buf, (PCRE2_SIZE)n, PCRE2_UTF | PCRE2_UCP, &code, &off, NULL);
    pcre2_code_free(re);
    return re != NULL;
}

// One escape at pat[i] == '\\'; returns the index after it, or 0 on an unsupported one.
static size_t escape_(xlate *x, size_t i, int in_class, sb *out) {
    const char *p = x->pat;
    char d = p[i + 1];
    if (d == '\0') {
        x->bad_at = i, x->bad = "a pattern that ends in a backslash";
        return 0;
    }
    if (d == 's') {
        sb_str_(out, in_class ? WS_ITEMS : "[" WS_ITEMS "]");
        return i + 2;
    }
    if (d == 'S') {
        if (in_class) {
            x->bad_at = i, x->bad = "\\S inside a character class";
            return 0;
        }
        sb_str_(out, "[^" WS_ITEMS "]");
        return i + 2;
    }
    if ((d == 'p' || d == 'P') && p[i + 2] == '{') {
        const char *close = strchr(p + i + 3, '}');
        if (!close) {
            x->bad_at = i, x->bad = "an unterminated \\p{";
            return 0;
        }
        size_t len = (size_t)(close - (p + i + 3));
        sb_put_(out, p + i, 3);
        if (is_script_(p + i + 3, len)) sb_str_(out, "sc:");
        sb_put_(out, p + i + 3, len + 1);
        return (size_t)(close - p) + 1;
    }
    sb_put_(out, p + i, 2); // \r, \n, \x{..} (its digits copy as plain characters), \d, ...
    return i + 2;
}

// A plain positive class "[...]" (no intersection, not negated) whose items can be inlined.
static int plain_class_(const char *frag) { return frag[0] == '[' && frag[1] != '^'; }

// A nested class beside other items is their union: its items join the enclosing operand cur
// (and it is emptied). Only a plain class can join; 0 marks anything else unsupported.
static int join_nested_(xlate *x, size_t at, sb *cur, sb *nested) {
    if (!nested->n) return 1;
    if (!plain_class_(nested->s)) {
        x->bad_at = at, x->bad = "a negated or intersected class nested beside other items";
        return 0;
    }
    sb_put_(cur, nested->s + 1, nested->n - 2);
    nested->n = 0;
    return 1;
}

// The class at pat[i] == '['; appends a fragment matching exactly one character to out and
// returns the index after the class, or 0 when it is not supported.
static size_t class_(xlate *x, size_t i, sb *out) {
    const char *p = x->pat;
    size_t start = i++;
    int neg = 0;
    if (p[i] == '^') neg = 1, i++;
    enum { MAX_OPS = 8 };
    sb ops[MAX_OPS] = {0};
    int n_ops = 0, first = 1;
    sb cur = {0}, nested = {0}; // the operand being read; a lone nested class it consists of
    int items = 0;
    size_t result = 0;
    sb_str_(&cur, "[");
    for (;;) {
        char ch = p[i];
        if (ch == '\0') {
            x->bad_at = start, x->bad = "an unterminated character class";
            goto done;
        }
        int closing = ch == ']' && !first;
        if (closing || (ch == '&' && p[i + 1] == '&')) {
            if (n_ops == MAX_OPS) {
                x->bad_at = start, x->bad = "more than 8 intersected classes";
                goto done;
            }
            sb *op = &ops[n_ops++];
            if (nested.n && !items) {
                sb_put_(op, nested.s, nested.n);
            } else if (nested.n) {
                x->bad_at = start, x->bad = "a negated or intersected class nested beside other items";
                goto done;
            } else {
                sb_put_(op, cur.s, cur.n);
                sb_str_(op, "]");
            }
            cur.n = 1, nested.n = 0, items = 0;
            i += closing ? 1 : 2;
            first = 0;
            if (closing) break;
            continue;
        }
        first = 0;
        if (ch == '[' && p[i + 1] == ':') { // POSIX [:alpha:] stays as it is
            const char *close = strstr(p + i, ":]");
            if (!close) {
                x->bad_at = i, x->bad = "an unterminated [: class";
                goto done;
            }
            sb_put_(&cur, p + i, (size_t)(close - (p + i)) + 2);
            i = (size_t)(close - p) + 2;
            items++;
        } else if (ch == '[') {
            sb inner = {0};
            size_t next = class_(x, i, &inner);
            if (!next) {
                free(inner.s);
                goto done;
            }
            int ok = 1;
            if (!items && !nested.n) {
                sb_put_(&nested, inner.s, inner.n);
            } else if ((ok = join_nested_(x, i, &cur, &nested) && join_nested_(x, i, &cur, &inner))) {
                items++;
            }
            free(inner.s);
            if (!ok) goto done;
            i = next;
        } else if (ch == '\\') {
            if (!join_nested_(x, i, &cur, &nested)) goto done;
            size_t next = escape_(x, i, 1, &cur);
            if (!next) goto done;
            i = next;
            items++;
        } else {
            if (!join_nested_(x, i, &cur, &nested)) goto done;
            sb_put_(&cur, &ch, 1);
            i++;
            items++;
        }
    }
    if (n_ops == 1 && !neg) {
        sb_put_(out, ops[0].s, ops[0].n);
    } else if (n_ops == 1 && plain_class_(ops[0].s)) {
        sb_str_(out, "[^");
        sb_put_(out, ops[0].s + 1, ops[0].n - 1);
    } else if (neg) {
        x->bad_at = start, x->bad = "a negated intersection or a negated negated class";
        goto done;
    } else {
        sb_str_(out, "(?:");
        for (int k = 1; k < n_ops; k++) {
            sb_str_(out, "(?=");
            sb_put_(out, ops[k].s, ops[k].n);
            sb_str_(out, ")");
        }
        sb_put_(out, ops[0].s, ops[0].n);
        sb_str_(out, ")");
    }
    result = i;
done:
    for (int k = 0; k < n_ops; k++) free(ops[k].s);
    free(cur.s);
    free(nested.s);
    return result;
}

mtrl_status bpe_add_split(mtrl_bpe *t, const char *pattern, const char *what, mtrl_error *err) {
    if (t->n_split == BPE_MAX_SPLITS)
        return mtrl_error_set(err, MTRL_ERR_LIMIT, "%s: %s: more than %d pre-tokenizer splits", t->source, what,
                              BPE_MAX_SPLITS);
    xlate x = {.pat = pattern};
    sb out = {0};
    sb_str_(&out, "");
    for (size_t i = 0; pattern[i];) {
        size_t next;
        if (pattern[i] == '\\') next = escape_(&x, i, 0, &out);
        else if (pattern[i] == '[') next = class_(&x, i, &out);
        else sb_put_(&out, pattern + i, 1), next = i + 1;
        if (!next) {
            free(out.s);
            return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: %s: %s at offset %zu is not supported", t->source, what,
                                  x.bad, x.bad_at);
        }
        i = next;
    }
    int code;
    PCRE2_SIZE off;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)out.s, out.n, PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &code,
                                   &off, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code, msg, sizeof msg);
        mtrl_status st = mtrl_error_set(err, MTRL_ERR_FORMAT,
                                        "%s: %s does not compile: %s at offset %zu of its PCRE2 form '%s'", t->source,
                                        what, (const char *)msg, (size_t)off, out.s);
        free(out.s);
        return st;
    }
    free(out.s);
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); // without JIT (an unsupported CPU) PCRE2 interprets
    t->split[t->n_split++] = re;
    return MTRL_OK;
}

typedef struct lits_ref {
    const unsigned char *const *lits;
    const size_t *lens;
} lits_ref;

static int lit_longest_first_(const void *a, const void *b, void *ctx) {
    const lits_ref *r = ctx;
    size_t i = *(const size_t *)a, j = *(const size_t *)b;
    if (r->lens[i] != r->lens[j]) return r->lens[i] > r->lens[j] ? -1 : 1;
    return memcmp(r->lits[i], r->lits[j], r->lens[i]);
}

mtrl_status bpe_compile_literals(const unsigned char *const *lits, const size_t *lens, size_t n,
                                 pcre2_code **out, const char *what, mtrl_error *err) {
    // Longest first: at the leftmost place where some literal matches, the longest one wins.
    size_t *order = xmalloc(n * sizeof *order);
    for (size_t i = 0; i < n; i++) order[i] = i;
    lits_ref ref = {lits, lens};
    qsort_r(order, n, sizeof *order, lit_longest_first_, &ref);
    sb re = {0};
    sb_str_(&re, "");
    for (size_t k = 0; k < n; k++) {
        if (k) sb_str_(&re, "|");
        for (size_t j = 0; j < lens[order[k]]; j++) {
            char hex[8];
            snprintf(hex, sizeof hex, "\\x{%02x}", lits[order[k]][j]);
            sb_str_(&re, hex);
        }
    }
    free(order);
    int code;
    PCRE2_SIZE off;
    *out = pcre2_compile((PCRE2_SPTR)re.s, re.n, 0, &code, &off, NULL);
    free(re.s);
    if (!*out) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code, msg, sizeof msg);
        return mtrl_error_set(err, MTRL_ERR_LIMIT, "%s: the special tokens' matcher does not compile: %s", what,
                              (const char *)msg);
    }
    pcre2_jit_compile(*out, PCRE2_JIT_COMPLETE);
    return MTRL_OK;
}
