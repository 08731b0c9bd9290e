// reverse.c: an example mtrl env plug-in: reverse a short word.
//
// Built against env/mtrl_env.h alone (nothing else of mtrl), as any out-of-tree plug-in is:
//     cc -shared -fPIC -fvisibility=hidden -I<mtrl>/env -o reverse.so reverse.c
// Task (seeded, so the same seed gives the same word):
//     prompt:  "Reverse the word: kotabe\n"
//     answer:  "ebatok"  (reward 1; anything else 0; surrounding whitespace ignored)
// Tool, to show argument parsing and error observations:
//     letter(i)  -> the i-th letter of the word, counting from 0 ("error: ..." when i is bad)
// Config: min_len=1..32 (3), max_len=1..32 (6), max_tool_calls=1..100 (4).
// demo: the answer alone.
#if !defined(_GNU_SOURCE) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L // strtok_r under -std=c11
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mtrl_env.h"

typedef struct reverse_env {
    int min_len, max_len, max_tool_calls;
    char word[33], answer[33];
    char prompt[64];
    char obs[128];
    mtrl_env_action demo[1];
    int tool_calls, done;
} reverse_env;

// ---- config: "key=value" pairs separated by newlines or ';' ---------------------------------

static int parse_config(reverse_env *e, const char *config, char *err, size_t cap) {
    char buf[1024];
    if (strlen(config) >= sizeof buf) {
        snprintf(err, cap, "reverse: config longer than %zu bytes", sizeof buf - 1);
        return -1;
    }
    strcpy(buf, config);
    for (char *save = NULL, *item = strtok_r(buf, ";\n", &save); item; item = strtok_r(NULL, ";\n", &save)) {
        char key[32];
        int value, used = 0;
        while (*item == ' ' || *item == '\t' || *item == '\r') item++;
        if (*item == 0) continue; // blank entry ("a=1;;b=2", a trailing ';')
        if (sscanf(item, " %31[a-z_] =%n", key, &used) != 1 || used == 0) {
            snprintf(err, cap, "reverse: config entry '%.60s' is not key=value", item);
            return -1;
        }
        int *slot = !strcmp(key, "min_len") ? &e->min_len : !strcmp(key, "max_len") ? &e->max_len
                  : !strcmp(key, "max_tool_calls") ? &e->max_tool_calls : NULL;
        if (!slot) {
            snprintf(err, cap, "reverse: unknown config key '%s'; known keys: min_len, max_len, max_tool_calls", key);
            return -1;
        }
        const char *v = item + used;
        int vused = 0;
        if (sscanf(v, "%d %n", &value, &vused) != 1 || v[vused] != 0) {
            snprintf(err, cap, "reverse: config %s='%.40s' is not an integer", key, v);
            return -1;
        }
        *slot = value;
    }
    if (e->min_len < 1 || e->max_len > 32 || e->min_len > e->max_len) {
        snprintf(err, cap, "reverse: need 1 <= min_len <= max_len <= 32 (got %d, %d)", e->min_len, e->max_len);
        return -1;
    }
    if (e->max_tool_calls < 1 || e->max_tool_calls > 100) {
        snprintf(err, cap, "reverse: max_tool_calls=%d out of range 1..100", e->max_tool_calls);
        return -1;
    }
    return 0;
}

// ---- the callbacks --------------------------------------------------------------------------

static int reverse_create(const char *config, void **self, char *err, size_t cap) {
    reverse_env *e = calloc(1, sizeof *e);
    if (!e) {
        snprintf(err, cap, "reverse: out of memory");
        return MTRL_ENV_ERR;
    }
    e->min_len = 3;
    e->max_len = 6;
    e->max_tool_calls = 4;
    e->done = 1;
    if (parse_config(e, config ? config : "", err, cap)) {
        free(e);
        return MTRL_ENV_ERR;
    }
    *self = e;
    return MTRL_ENV_OK;
}

static void reverse_destroy(void *self) { free(self); }

// splitmix64: a tiny seeded generator, so the task is a pure function of the seed.
static uint64_t next_random(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int reverse_reset(void *self, uint64_t seed, mtrl_env_bytes *prompt, char *err, size_t cap) {
    (void)err, (void)cap;
    reverse_env *e = self;
    uint64_t s = seed;
    int n = e->min_len + (int)(next_random(&s) % (uint64_t)(e->max_len - e->min_len + 1));
    for (int i = 0; i < n; i++) e->word[i] = (char)('a' + next_random(&s) % 26);
    e->word[n] = 0;
    for (int i = 0; i < n; i++) e->answer[i] = e->word[n - 1 - i];
    e->answer[n] = 0;
    snprintf(e->prompt, sizeof e->prompt, "Reverse the word: %s\n", e->word);
    e->tool_calls = 0;
    e->done = 0;
    prompt->data = e->prompt; // owned by e, valid until the next call (the ABI's rule)
    prompt->len = strlen(e->prompt);
    return MTRL_ENV_OK;
}

static int reverse_step(void *self, uint32_t kind, const char *action, size_t len, mtrl_env_step_out *out, char *err,
                        size_t cap) {
    reverse_env *e = self;
    if (e->done) {
        snprintf(err, cap, "reverse: step after the episode ended; call reset first");
        return MTRL_ENV_ERR;
    }
    // Trim whitespace: the model's text may carry a newline.
    while (len && (*action == ' ' || *action == '\n' || *action == '\t')) action++, len--;
    while (len && (action[len - 1] == ' ' || action[len - 1] == '\n' || action[len - 1] == '\t')) len--;
    e->obs[0] = 0;
    if (kind == MTRL_ENV_ACTION_ANSWER) {
        out->reward = (len == strlen(e->answer) && !memcmp(action, e->answer, len)) ? 1.0 : 0.0;
        out->done = e->done = 1;
    } else if (++e->tool_calls > e->max_tool_calls) {
        snprintf(e->obs, sizeof e->obs, "error: tool call limit (%d) reached; episode over", e->max_tool_calls);
        out->done = e->done = 1;
        out->tool_error = 1;
    } else {
        // A malformed call is the model's mistake: answer with an error observation, never fail.
        char call[64];
        int i, used = 0;
        snprintf(call, sizeof call, "%.*s", (int)(len < 63 ? len : 63), action);
        if (len >= 7 && !memcmp(action, "letter(", 7) && action[len - 1] == ')') {
            if (sscanf(call, "letter(%d)%n", &i, &used) == 1 && (size_t)used == len && i >= 0 &&
                i < (int)strlen(e->word)) {
                snprintf(e->obs, sizeof e->obs, "%c", e->word[i]);
            } else {
                snprintf(e->obs, sizeof e->obs, "error: letter needs an index 0..%d, e.g. letter(0)",
                         (int)strlen(e->word) - 1);
                out->tool_error = 1;
            }
        } else {
            size_t n = strcspn(call, "(");
            snprintf(e->obs, sizeof e->obs, "error: unknown tool '%.*s'; tools: letter", (int)(n > 40 ? 40 : n), call);
            out->tool_error = 1;
        }
    }
    out->obs.data = e->obs;
    out->obs.len = strlen(e->obs);
    return MTRL_ENV_OK;
}

static int reverse_demo(void *self, mtrl_env_demo_out *out, char *err, size_t cap) {
    reverse_env *e = self;
    if (e->done) {
        snprintf(err, cap, "reverse: demo needs an episode; call reset first");
        return MTRL_ENV_ERR;
    }
    e->demo[0] = (mtrl_env_action){MTRL_ENV_ACTION_ANSWER, e->answer, strlen(e->answer)};
    out->actions = e->demo;
    out->count = 1;
    return MTRL_ENV_OK;
}

static int reverse_describe(void *self, mtrl_env_bytes *out, char *err, size_t cap) {
    (void)self, (void)err, (void)cap;
    static const char text[] = "letter(i): the i-th letter of the word, counting from 0\n";
    out->data = text;
    out->len = sizeof text - 1;
    return MTRL_ENV_OK;
}

// ---- the one exported symbol ----------------------------------------------------------------

static const mtrl_env_api reverse_api = {
    .abi_version = MTRL_ENV_ABI_VERSION,
    .struct_size = sizeof(mtrl_env_api),
    .name = "reverse",
    .version = "1.0",
    .flags = MTRL_ENV_FLAG_THREAD_SAFE, // instances share nothing
    .create = reverse_create,
    .destroy = reverse_destroy,
    .reset = reverse_reset,
    .step = reverse_step,
    .demo = reverse_demo,
    .describe = reverse_describe,
};

MTRL_ENV_EXPORT const mtrl_env_api *mtrl_env_plugin(uint32_t host_abi_version) {
    // The host checks our table's version; refusing here is for a plug-in that needs more
    // than a given host offers. Any 1.x host can run this table.
    if (MTRL_ENV_ABI_MAJOR_OF(host_abi_version) != MTRL_ENV_ABI_MAJOR) return NULL;
    return &reverse_api;
}
