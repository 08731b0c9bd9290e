// calc.c: the built-in `calc` env: arithmetic problems with a calculator tool.
//
// Task: an integer expression of `ops` operators (+ - *, chosen uniformly) over operands of
// up to `digits` digits (uniform in 0 .. 10^digits - 1), evaluated with the usual precedence.
// The prompt is as short as possible so a tiny byte-level model can learn the easiest
// setting from scratch on a CPU:
//     prompt:  "37*12+5=?"
//     answer:  "449"          (the number only; surrounding whitespace ignored)
// Reward 1 for exactly the right integer, 0 otherwise (no partial credit).
// Tool: calc(expr), a real parser: + - * /, unary minus, parentheses, integer arithmetic
// (division truncates toward zero); errors come back as observations ("error: division by
// zero", "error: unexpected 'x' at position 3"). A tool call past max_tool_calls ends the
// episode with reward 0.
// Config: digits=1..6 (1), ops=1..4 (1), max_tool_calls=0..1000 (4; 0: any tool call ends the
// episode). Keys of other built-ins are ignored (env_util.h).
// demo: calc(<the problem's expression>), then the answer.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/rng.h"
#include "env/builtin/builtin.h"
#include "env/env_util.h"

#define CALC_TOOLS "calc"
#define CALC_MAX_DEPTH 64

// ---- the expression parser ------------------------------------------------------------------

typedef struct calc_parser {
    const char *s;
    size_t n, i;
    int depth;
    char *err;
    size_t cap;
    int failed;
} calc_parser;

static void skip_ws_(calc_parser *p) {
    while (p->i < p->n && (p->s[p->i] == ' ' || p->s[p->i] == '\t')) p->i++;
}

static int fail_(calc_parser *p, const char *msg) {
    if (!p->failed) snprintf(p->err, p->cap, "%s", msg);
    p->failed = 1;
    return -1;
}

static int fail_here_(calc_parser *p) {
    if (p->failed) return -1;
    if (p->i >= p->n) return fail_(p, "unexpected end of expression");
    unsigned char c = (unsigned char)p->s[p->i];
    if (c >= 0x20 && c < 0x7f) snprintf(p->err, p->cap, "unexpected '%c' at position %zu", c, p->i + 1);
    else snprintf(p->err, p->cap, "unexpected byte 0x%02x at position %zu", c, p->i + 1);
    p->failed = 1;
    return -1;
}

static int parse_expr_(calc_parser *p, int64_t *out);

static int parse_primary_(calc_parser *p, int64_t *out) {
    skip_ws_(p);
    if (p->i < p->n && p->s[p->i] == '(') {
        if (++p->depth > CALC_MAX_DEPTH) return fail_(p, "parentheses nested too deeply");
        p->i++;
        if (parse_expr_(p, out)) return -1;
        skip_ws_(p);
        if (p->i >= p->n || p->s[p->i] != ')') {
            if (p->i >= p->n) return fail_(p, "missing ')'");
            return fail_here_(p);
        }
        p->i++;
        p->depth--;
        return 0;
    }
    if (p->i >= p->n || p->s[p->i] < '0' || p->s[p->i] > '9') return fail_here_(p);
    int64_t v = 0;
    while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') {
        if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, p->s[p->i] - '0', &v))
            return fail_(p, "overflow (number beyond 64-bit integers)");
        p->i++;
    }
    *out = v;
    return 0;
}

static int parse_unary_(calc_parser *p, int64_t *out) {
    skip_ws_(p);
    if (p->i < p->n && (p->s[p->i] == '-' || p->s[p->i] == '+')) {
        char op = p->s[p->i++];
        if (++p->depth > CALC_MAX_DEPTH) return fail_(p, "too many signs in a row");
        int64_t v;
        if (parse_unary_(p, &v)) return -1;
        p->depth--;
        if (op == '-' && __builtin_sub_overflow((int64_t)0, v, &v))
            return fail_(p, "overflow (result beyond 64-bit integers)");
        *out = v;
        return 0;
    }
    return parse_primary_(p, out);
}

static int parse_term_(calc_parser *p, int64_t *out) {
    int64_t a;
    if (parse_unary_(p, &a)) return -1;
    for (;;) {
        skip_ws_(p);
        if (p->i >= p->n || (p->s[p->i] != '*' && p->s[p->i] != '/')) break;
        char op = p->s[p->i++];
        int64_t b;
        if (parse_unary_(p, &b)) return -1;
        if (op == '*') {
            if (__builtin_mul_overflow(a, b, &a)) return fail_(p, "overflow (result beyond 64-bit integers)");
        } else {
            if (b == 0) return fail_(p, "division by zero");
            if (a == INT64_MIN && b == -1) return fail_(p, "overflow (result beyond 64-bit integers)");
            a /= b;
        }
    }
    *out = a;
    return 0;
}

static int parse_expr_(calc_parser *p, int64_t *out) {
    int64_t a;
    if (parse_term_(p, &a)) return -1;
    for (;;) {
        skip_ws_(p);
        if (p->i >= p->n || (p->s[p->i] != '+' && p->s[p->i] != '-')) break;
        char op = p->s[p->i++];
        int64_t b;
        if (parse_term_(p, &b)) return -1;
        int ovf = op == '+' ? __builtin_add_overflow(a, b, &a) : __builtin_sub_overflow(a, b, &a);
        if (ovf) return fail_(p, "overflow (result beyond 64-bit integers)");
    }
    *out = a;
    return 0;
}

int env_calc_eval(const char *s, size_t n, int64_t *out, char *err, size_t cap) {
    calc_parser p = {.s = s, .n = n, .err = err, .cap = cap};
    skip_ws_(&p);
    if (p.i >= n) {
        snprintf(err, cap, "empty expression");
        return -1;
    }
    int64_t v;
    if (parse_expr_(&p, &v)) return -1;
    skip_ws_(&p);
    if (p.i < n) {
        if (p.s[p.i] == ')') {
            snprintf(err, cap, "unmatched ')' at position %zu", p.i + 1);
            return -1;
        }
        return fail_here_(&p);
    }
    *out = v;
    return 0;
}

// ---- the env --------------------------------------------------------------------------------

typedef struct calc_env {
    int digits, ops, max_tool_calls;
    char problem[128]; // the expression, e.g. "37*12+5"
    char prompt[160];  // "37*12+5=?"
    char answer[32];
    char demo_call[160];
    mtrl_env_action demo[2];
    int tool_calls;
    int done;
    env_buf obs;
} calc_env;

static int calc_create_(const char *config, void **self, char *err, size_t cap) {
    env_config cfg;
    if (env_config_parse(&cfg, "calc", config, err, cap)) return MTRL_ENV_ERR;
    long long digits, ops, mtc;
    int bad = env_config_int(&cfg, "digits", 1, 1, 6, &digits, err, cap) ||
              env_config_int(&cfg, "ops", 1, 1, 4, &ops, err, cap) ||
              env_config_int(&cfg, "max_tool_calls", 4, 0, 1000, &mtc, err, cap) ||
              env_config_finish(&cfg, "digits, ops, max_tool_calls", err, cap);
    env_config_free(&cfg);
    if (bad) return MTRL_ENV_ERR;
    calc_env *e = xcalloc(1, sizeof *e);
    e->digits = (int)digits;
    e->ops = (int)ops;
    e->max_tool_calls = (int)mtc;
    e->done = 1;
    *self = e;
    return MTRL_ENV_OK;
}

static void calc_destroy_(void *self) {
    calc_env *e = self;
    if (!e) return;
    env_buf_free(&e->obs);
    free(e);
}

static int calc_reset_(void *self, uint64_t seed, mtrl_env_bytes *prompt, char *err, size_t cap) {
    calc_env *e = self;
    uint64_t stream = mtrl_rng_stream("env.calc", 0, 0);
    uint64_t ctr = 0, range = 1;
    for (int d = 0; d < e->digits; d++) range *= 10;
    static const char opchars[] = "+-*";
    // With 6 digits and 4 multiplications a problem can leave 64-bit integers; draw again
    // (deterministically, further along the same stream) until it fits.
    for (int attempt = 0;; attempt++) {
        if (attempt == 1000) {
            snprintf(err, cap, "calc: could not draw a problem that fits 64-bit integers");
            return MTRL_ENV_ERR;
        }
        int len = 0;
        for (int k = 0; k <= e->ops; k++) {
            uint64_t v = mtrl_rng_u64(seed, stream, ctr++) % range;
            len += snprintf(e->problem + len, sizeof e->problem - (size_t)len, "%llu", (unsigned long long)v);
            if (k < e->ops) e->problem[len++] = opchars[mtrl_rng_u64(seed, stream, ctr++) % 3];
        }
        e->problem[len] = 0;
        int64_t v;
        char why[128];
        if (env_calc_eval(e->problem, (size_t)len, &v, why, sizeof why) == 0) {
            snprintf(e->answer, sizeof e->answer, "%lld", (long long)v);
            break;
        }
    }
    snprintf(e->prompt, sizeof e->prompt, "%s=?", e->problem);
    snprintf(e->demo_call, sizeof e->demo_call, "calc(%s)", e->problem);
    e->tool_calls = 0;
    e->done = 0;
    prompt->data = e->prompt;
    prompt->len = strlen(e->prompt);
    return MTRL_ENV_OK;
}

static int calc_step_(void *self, uint32_t kind, const char *action, size_t len, mtrl_env_step_out *out,
                      char *err, size_t cap) {
    calc_env *e = self;
    env_tool_call c;
    switch (env_step_begin("calc", &e->done, &e->tool_calls, e->max_tool_calls, CALC_TOOLS, kind, action, len, &e->obs,
                           out, &c, err, cap)) {
    case ENV_STEP_ERR: return MTRL_ENV_ERR;
    case ENV_STEP_DONE: break;
    case ENV_STEP_ANSWER: {
        int64_t got, want;
        env_parse_i64(e->answer, strlen(e->answer), &want);
        out->reward = (env_parse_i64(action, len, &got) == 0 && got == want) ? 1.0 : 0.0;
        break;
    }
    case ENV_STEP_TOOL:
        if (!env_tool_is(&c, "calc")) {
            env_tool_error_unknown(&e->obs, &c, CALC_TOOLS);
            out->tool_error = 1;
        } else {
            int64_t v;
            char why[160];
            if (env_calc_eval(c.args, c.args_len, &v, why, sizeof why) == 0) {
                env_buf_printf(&e->obs, "%lld", (long long)v);
            } else {
                env_buf_printf(&e->obs, "error: %s", why);
                out->tool_error = 1;
            }
        }
        break;
    }
    env_step_end(&e->obs, 0, out);
    return MTRL_ENV_OK;
}

static int calc_demo_(void *self, mtrl_env_demo_out *out, char *err, size_t cap) {
    calc_env *e = self;
    return env_demo_call_answer("calc", e->done, e->demo, e->demo_call, e->answer, out, err, cap);
}

static int calc_describe_(void *self, mtrl_env_bytes *out, char *err, size_t cap) {
    (void)self, (void)err, (void)cap;
    static const char text[] = "calc(expr): the value of an integer expression with + - * / and parentheses\n";
    out->data = text;
    out->len = sizeof text - 1;
    return MTRL_ENV_OK;
}

const mtrl_env_api env_calc_api = {
    .abi_version = MTRL_ENV_ABI_VERSION,
    .struct_size = sizeof(mtrl_env_api),
    .name = "calc",
    .version = "1",
    .flags = MTRL_ENV_FLAG_THREAD_SAFE,
    .create = calc_create_,
    .destroy = calc_destroy_,
    .reset = calc_reset_,
    .step = calc_step_,
    .demo = calc_demo_,
    .describe = calc_describe_,
};
