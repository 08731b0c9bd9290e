// env_util.c: buffers, config strings and tool-call parsing for env/ (see env_util.h).
#include "env/env_util.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/check.h"

// ---- growable buffer ------------------------------------------------------------------------

void env_buf_clear(env_buf *b) {
    b->len = 0;
    if (b->data) b->data[0] = 0;
}

void env_buf_free(env_buf *b) {
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

char *env_buf_reserve(env_buf *b, size_t extra) {
    MTRL_CHECK(extra < SIZE_MAX / 2 - b->len);
    size_t need = b->len + extra + 1; // +1 keeps room for the terminating NUL
    if (need > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < need) cap *= 2;
        b->data = xrealloc(b->data, cap);
        b->cap = cap;
    }
    return b->data + b->len;
}

void env_buf_append(env_buf *b, const void *data, size_t n) {
    char *p = env_buf_reserve(b, n);
    if (n) memcpy(p, data, n);
    b->len += n;
    b->data[b->len] = 0;
}

void env_buf_puts(env_buf *b, const char *s) { env_buf_append(b, s, strlen(s)); }

void env_buf_printf(env_buf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char small[256];
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    MTRL_CHECK(n >= 0);
    if ((size_t)n < sizeof small) {
        env_buf_append(b, small, (size_t)n);
        return;
    }
    char *p = env_buf_reserve(b, (size_t)n);
    va_start(ap, fmt);
    vsnprintf(p, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

// ---- config strings -------------------------------------------------------------------------

static int is_space_(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

void env_trim(const char **s, size_t *n) {
    while (*n && is_space_((*s)[0])) { (*s)++; (*n)--; }
    while (*n && is_space_((*s)[*n - 1])) (*n)--;
}

static char *dup_range_(const char *s, size_t n) {
    char *p = xmalloc(n + 1);
    memcpy(p, s, n);
    p[n] = 0;
    return p;
}

int env_config_parse(env_config *cfg, const char *env, const char *text, char *err, size_t cap) {
    memset(cfg, 0, sizeof *cfg);
    cfg->env = env;
    if (!text) return 0;
    const char *p = text;
    while (*p) {
        size_t n = strcspn(p, "\n;");
        const char *item = p;
        size_t item_len = n;
        p += n;
        if (*p) p++;
        env_trim(&item, &item_len);
        if (item_len == 0) continue; // blank entries ("a=1;;b=2", trailing ';') are fine
        const char *eq = memchr(item, '=', item_len);
        if (!eq) {
            snprintf(err, cap, "%s: config entry '%.*s' is not key=value", env, (int)(item_len > 60 ? 60 : item_len),
                     item);
            env_config_free(cfg);
            return -1;
        }
        const char *k = item, *v = eq + 1;
        size_t kn = (size_t)(eq - item), vn = item_len - kn - 1;
        env_trim(&k, &kn);
        env_trim(&v, &vn);
        if (kn == 0) {
            snprintf(err, cap, "%s: config entry '%.*s' has an empty key", env, (int)(item_len > 60 ? 60 : item_len),
                     item);
            env_config_free(cfg);
            return -1;
        }
        for (int i = 0; i < cfg->count; i++) {
            if (strlen(cfg->items[i].key) == kn && !memcmp(cfg->items[i].key, k, kn)) {
                snprintf(err, cap, "%s: config key '%.*s' given twice", env, (int)kn, k);
                env_config_free(cfg);
                return -1;
            }
        }
        cfg->items = xrealloc(cfg->items, (size_t)(cfg->count + 1) * sizeof *cfg->items);
        cfg->items[cfg->count].key = dup_range_(k, kn);
        cfg->items[cfg->count].value = dup_range_(v, vn);
        cfg->items[cfg->count].used = 0;
        cfg->count++;
    }
    return 0;
}

void env_config_free(env_config *cfg) {
    for (int i = 0; i < cfg->count; i++) {
        free(cfg->items[i].key);
        free(cfg->items[i].value);
    }
    free(cfg->items);
    cfg->items = NULL;
    cfg->count = 0;
}

static env_config_item *config_find_(env_config *cfg, const char *key) {
    for (int i = 0; i < cfg->count; i++)
        if (!strcmp(cfg->items[i].key, key)) {
            cfg->items[i].used = 1;
            return &cfg->items[i];
        }
    return NULL;
}

int env_config_int(env_config *cfg, const char *key, long long def, long long min, long long max,
                   long long *out, char *err, size_t cap) {
    env_config_item *it = config_find_(cfg, key);
    if (!it) {
        *out = def;
        return 0;
    }
    int64_t v;
    if (env_parse_i64(it->value, strlen(it->value), &v) != 0) {
        snprintf(err, cap, "%s: config %s='%s' is not an integer; use a value in %lld..%lld", cfg->env, key,
                 it->value, min, max);
        return -1;
    }
    if (v < min || v > max) {
        snprintf(err, cap, "%s: config %s=%lld out of range %lld..%lld", cfg->env, key, (long long)v, min, max);
        return -1;
    }
    *out = v;
    return 0;
}

int env_config_double(env_config *cfg, const char *key, double def, double min, double max, double *out, char *err,
                      size_t cap) {
    env_config_item *it = config_find_(cfg, key);
    if (!it) {
        *out = def;
        return 0;
    }
    char *end;
    double v = strtod(it->value, &end);
    if (!it->value[0] || *end || !isfinite(v)) {
        snprintf(err, cap, "%s: config %s='%s' is not a number; use a value in %g..%g", cfg->env, key, it->value, min, max);
        return -1;
    }
    if (v < min || v > max) {
        snprintf(err, cap, "%s: config %s=%g out of range %g..%g", cfg->env, key, v, min, max);
        return -1;
    }
    *out = v;
    return 0;
}

int env_config_bool(env_config *cfg, const char *key, int def, int *out, char *err, size_t cap) {
    env_config_item *it = config_find_(cfg, key);
    if (!it) {
        *out = def;
        return 0;
    }
    static const char *yes[] = {"1", "true", "yes", "on"}, *no[] = {"0", "false", "no", "off"};
    for (int i = 0; i < 4; i++) {
        if (!strcasecmp(it->value, yes[i])) return *out = 1, 0;
        if (!strcasecmp(it->value, no[i])) return *out = 0, 0;
    }
    snprintf(err, cap, "%s: config %s='%s' is not a boolean; use 1/0, true/false, yes/no or on/off", cfg->env, key,
             it->value);
    return -1;
}

const char *env_config_str(env_config *cfg, const char *key, const char *def) {
    env_config_item *it = config_find_(cfg, key);
    return it ? it->value : def;
}

int env_config_finish(env_config *cfg, const char *known, char *err, size_t cap) {
    static const char *shared[] = {ENV_CONFIG_SHARED_KEYS};
    for (int i = 0; i < cfg->count; i++) {
        int is_shared = 0;
        for (size_t k = 0; k < sizeof shared / sizeof shared[0]; k++) is_shared |= !strcmp(cfg->items[i].key, shared[k]);
        if (!cfg->items[i].used && !is_shared) {
            snprintf(err, cap, "%s: unknown config key '%s'; known keys: %s", cfg->env, cfg->items[i].key, known);
            return -1;
        }
    }
    return 0;
}

// ---- tool calls -----------------------------------------------------------------------------

static int is_name0_(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static int is_name_(char c) { return is_name0_(c) || (c >= '0' && c <= '9'); }

int env_tool_parse(const char *s, size_t n, env_tool_call *out) {
    memset(out, 0, sizeof *out);
    env_trim(&s, &n);
    if (n < 3 || !is_name0_(s[0]) || s[n - 1] != ')') return -1;
    size_t i = 1;
    while (i < n && is_name_(s[i])) i++;
    if (i >= n || s[i] != '(') return -1;
    out->name = s;
    out->name_len = i;
    out->args = s + i + 1;
    out->args_len = n - i - 2;
    env_trim(&out->args, &out->args_len);
    return 0;
}

int env_tool_is(const env_tool_call *c, const char *name) {
    return strlen(name) == c->name_len && !memcmp(c->name, name, c->name_len);
}

void env_buf_append_shown(env_buf *b, const char *s, size_t n, size_t max) {
    size_t m = n < max ? n : max;
    char *p = env_buf_reserve(b, m + 3);
    for (size_t i = 0; i < m; i++) {
        unsigned char c = (unsigned char)s[i];
        p[i] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
    }
    b->len += m;
    b->data[b->len] = 0;
    if (m < n) env_buf_puts(b, "...");
}

void env_tool_error_malformed(env_buf *b, const char *action, size_t n, const char *tools) {
    env_buf_clear(b);
    env_trim(&action, &n);
    env_buf_puts(b, "error: malformed tool call '");
    env_buf_append_shown(b, action, n, 40);
    env_buf_printf(b, "'; expected name(args); tools: %s", tools);
}

void env_tool_error_unknown(env_buf *b, const env_tool_call *c, const char *tools) {
    env_buf_clear(b);
    env_buf_puts(b, "error: unknown tool '");
    env_buf_append_shown(b, c->name, c->name_len, 40);
    env_buf_printf(b, "'; tools: %s", tools);
}

// ---- small parsers --------------------------------------------------------------------------

int env_parse_i64(const char *s, size_t n, int64_t *out) {
    env_trim(&s, &n);
    if (n == 0 || n > 40) return -1;
    char tmp[48];
    memcpy(tmp, s, n);
    tmp[n] = 0;
    // strtoll accepts leading spaces and "0x"; require a plain decimal.
    size_t i = (tmp[0] == '-' || tmp[0] == '+') ? 1 : 0;
    if (i == n) return -1;
    for (size_t j = i; j < n; j++)
        if (tmp[j] < '0' || tmp[j] > '9') return -1;
    errno = 0;
    char *end;
    long long v = strtoll(tmp, &end, 10);
    if (errno == ERANGE || *end) return -1;
    *out = v;
    return 0;
}

env_step_kind env_step_begin(const char *env, int *done, int *tool_calls, int max_tool_calls, const char *tools,
                             uint32_t kind, const char *action, size_t len, env_buf *obs, mtrl_env_step_out *out,
                             env_tool_call *c, char *err, size_t cap) {
    if (*done) {
        snprintf(err, cap, "%s: step after the episode ended; call reset first", env);
        return ENV_STEP_ERR;
    }
    if (kind != MTRL_ENV_ACTION_ANSWER && kind != MTRL_ENV_ACTION_TOOL) {
        snprintf(err, cap, "%s: unknown action kind %u (expected TOOL=1 or ANSWER=2)", env, kind);
        return ENV_STEP_ERR;
    }
    env_buf_clear(obs);
    env_buf_puts(obs, "");
    if (kind == MTRL_ENV_ACTION_ANSWER) {
        out->done = *done = 1;
        return ENV_STEP_ANSWER;
    }
    if (++*tool_calls > max_tool_calls) {
        env_buf_printf(obs, "error: tool call limit (%d) reached; episode over", max_tool_calls);
        out->done = *done = 1;
        out->tool_error = 1;
        return ENV_STEP_DONE;
    }
    if (env_tool_parse(action, len, c)) {
        env_tool_error_malformed(obs, action, len, tools);
        out->tool_error = 1;
        return ENV_STEP_DONE;
    }
    return ENV_STEP_TOOL;
}

void env_step_end(env_buf *obs, size_t max_obs, mtrl_env_step_out *out) {
    if (max_obs > 0 && obs->len > max_obs) { // the cap holds for every observation, notes included
        obs->len = max_obs;
        obs->data[obs->len] = 0;
    }
    out->obs.data = obs->data;
    out->obs.len = obs->len;
}

int env_demo_call_answer(const char *env, int done, mtrl_env_action demo[2], const char *call, const char *answer,
                         mtrl_env_demo_out *out, char *err, size_t cap) {
    if (done) {
        snprintf(err, cap, "%s: demo needs an episode; call reset first", env);
        return MTRL_ENV_ERR;
    }
    size_t k = 0;
    if (call) demo[k++] = (mtrl_env_action){MTRL_ENV_ACTION_TOOL, call, strlen(call)};
    demo[k++] = (mtrl_env_action){MTRL_ENV_ACTION_ANSWER, answer, strlen(answer)};
    out->actions = demo;
    out->count = k;
    return MTRL_ENV_OK;
}

int env_answer_is(const char *action, size_t len, const char *expected) {
    const char *a = action;
    size_t n = len;
    env_trim(&a, &n);
    return n == strlen(expected) && !memcmp(a, expected, n);
}

double env_credit_reward(int right, double credit, long got, long of) {
    if (right) return 1.0;
    return credit > 0 && of > 0 ? credit * (double)got / (double)of : 0.0;
}

int env_digits_in_place(const char *action, size_t len, const char *expected) {
    const char *a = action;
    size_t n = len;
    env_trim(&a, &n);
    if (n != strlen(expected)) return -1;
    int same = 0;
    for (size_t i = 0; i < n; i++) {
        int want_digit = expected[i] >= '0' && expected[i] <= '9';
        if (!want_digit) {
            if (a[i] != expected[i]) return -1;
        } else if (a[i] < '0' || a[i] > '9') {
            return -1;
        } else {
            same += a[i] == expected[i];
        }
    }
    return same;
}

uint64_t env_mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}
