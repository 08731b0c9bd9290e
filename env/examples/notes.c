// notes.c: an example mtrl env plug-in of the many-turn kind: follow references through a
// generated set of notes, reading them page by page.
//
// Built against env/mtrl_env.h alone (nothing else of mtrl), as any out-of-tree plug-in is:
//     cc -shared -fPIC -fvisibility=hidden -I<mtrl>/env -o notes.so notes.c
// The task (seeded: the same seed gives the same notes and question):
//     `notes` notes n000, n001, ... of about note_bytes bytes of filler words each. Each note
//     holds, somewhere inside, one line "see nXXX" (the references form one seeded cycle through
//     all notes) and one line "key: <word>". The prompt names a start note and a hop count:
//     "Start at n012, follow `see` 5 times and answer the key of the note you reach."
//     Answer: that key word (reward 1; anything else 0; surrounding whitespace ignored).
// Tools (results capped at page_bytes):
//     find(id,text)    the byte offsets in note id of the lines containing text
//     read(id,offset)  page_bytes bytes of note id from offset
// So each hop is a find and a read, and an episode of h hops makes 2h + 2 calls; the context
// grows by about page_bytes per read.
// Config: hops=1..500 (4), notes=2..4096 (32), note_bytes=128..65536 (2048),
//         page_bytes=64..65536 (1024), max_tool_calls=1..1000 (64).
// demo: find(cur,see) and read(cur,offset) per hop, then find and read of the key line, then
// the key.
#if !defined(_GNU_SOURCE) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L // strtok_r under -std=c11
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mtrl_env.h"

typedef struct notes_env {
    int hops, notes, note_bytes, page_bytes, max_tool_calls;
    char *text;    // every note end to end
    size_t *off;   // [notes + 1]
    int start, tool_calls, done;
    char key[16], prompt[256], *obs;
    size_t obs_len;
    char *demo_text;
    mtrl_env_action *demo;
} notes_env;

static uint64_t mix(uint64_t x) { // splitmix64
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// ---- config: "key=value" pairs separated by newlines or ';' ---------------------------------

static int parse_config(notes_env *e, const char *config, char *err, size_t cap) {
    static const struct { const char *key; int lo, hi; size_t at; } keys[] = {
        {"hops", 1, 500, offsetof(notes_env, hops)},
        {"notes", 2, 4096, offsetof(notes_env, notes)},
        {"note_bytes", 128, 65536, offsetof(notes_env, note_bytes)},
        {"page_bytes", 64, 65536, offsetof(notes_env, page_bytes)},
        {"max_tool_calls", 1, 1000, offsetof(notes_env, max_tool_calls)},
    };
    char buf[1024];
    if (strlen(config) >= sizeof buf) {
        snprintf(err, cap, "notes: config longer than %zu bytes", sizeof buf - 1);
        return -1;
    }
    strcpy(buf, config);
    for (char *save = NULL, *item = strtok_r(buf, ";\n", &save); item; item = strtok_r(NULL, ";\n", &save)) {
        char key[32];
        int value, used = 0, vused = 0;
        while (*item == ' ' || *item == '\t' || *item == '\r') item++;
        if (*item == 0) continue;
        if (sscanf(item, " %31[a-z_] =%n", key, &used) != 1 || used == 0) {
            snprintf(err, cap, "notes: config entry '%.60s' is not key=value", item);
            return -1;
        }
        size_t k = 0;
        while (k < sizeof keys / sizeof keys[0] && strcmp(keys[k].key, key)) k++;
        if (k == sizeof keys / sizeof keys[0]) {
            snprintf(err, cap, "notes: unknown config key '%s'; known keys: hops, notes, note_bytes, page_bytes, "
                               "max_tool_calls", key);
            return -1;
        }
        const char *v = item + used;
        if (sscanf(v, "%d %n", &value, &vused) != 1 || v[vused] != 0 || value < keys[k].lo || value > keys[k].hi) {
            snprintf(err, cap, "notes: %s='%.40s' must be an integer in %d..%d", key, v, keys[k].lo, keys[k].hi);
            return -1;
        }
        *(int *)((char *)e + keys[k].at) = value;
    }
    return 0;
}

// ---- generation -----------------------------------------------------------------------------

static const char *const words_[] = {"amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor",
                                     "indigo", "juniper", "kelp", "lumen", "marble", "nectar", "onyx", "pepper"};

static void generate(notes_env *e, uint64_t seed) {
    int N = e->notes;
    int *perm = malloc(sizeof(int) * (size_t)N), *next = malloc(sizeof(int) * (size_t)N);
    uint64_t c = seed * 0x2545f4914f6cdd1dull;
    for (int i = 0; i < N; i++) perm[i] = i;
    for (int i = N - 1; i > 0; i--) {
        int j = (int)(mix(c++) % (uint64_t)(i + 1)), x = perm[i];
        perm[i] = perm[j];
        perm[j] = x;
    }
    for (int i = 0; i < N; i++) next[perm[i]] = perm[(i + 1) % N];
    int s = (int)(mix(c++) % (uint64_t)N);
    e->start = perm[s];
    int last = perm[(s + e->hops) % N];
    char *p = e->text;
    for (int n = 0; n < N; n++) {
        e->off[n] = (size_t)(p - e->text);
        char *end = e->text + e->off[n] + (size_t)e->note_bytes;
        int line = 0, at_see = (int)(mix(c++) % 8), at_key = 8 + (int)(mix(c++) % 8);
        char key[16];
        uint64_t kw = mix(c++), kn = mix(c++);
        snprintf(key, sizeof key, "%s%02d", words_[kw % 16], (int)(kn % 100));
        if (n == last) strcpy(e->key, key);
        while (p < end || line <= at_key) {
            if (line == at_see) p += sprintf(p, "see n%03d\n", next[n]);
            else if (line == at_key) p += sprintf(p, "key: %s\n", key);
            else {
                for (int w = 0; w < 6; w++) p += sprintf(p, "%s%s", w ? " " : "", words_[mix(c++) % 16]);
                *p++ = '\n';
            }
            line++;
        }
    }
    e->off[N] = (size_t)(p - e->text);
    *p = 0; // the demo's strstr stops here at the latest
    free(perm);
    free(next);
}

// ---- the callbacks --------------------------------------------------------------------------

static int notes_create(const char *config, void **self, char *err, size_t cap) {
    notes_env *e = calloc(1, sizeof *e);
    if (!e) {
        snprintf(err, cap, "notes: out of memory");
        return MTRL_ENV_ERR;
    }
    e->hops = 4, e->notes = 32, e->note_bytes = 2048, e->page_bytes = 1024, e->max_tool_calls = 64;
    if (parse_config(e, config, err, cap)) {
        free(e);
        return MTRL_ENV_ERR;
    }
    // Lines are at most 64 bytes, and a note ends after its key line (line 15 at the latest).
    size_t bytes = (size_t)e->notes * ((size_t)e->note_bytes + 16 * 64) + 1;
    e->text = malloc(bytes);
    e->off = calloc((size_t)e->notes + 1, sizeof(size_t));
    e->obs = malloc((size_t)e->page_bytes + 128);
    size_t calls = 2 * (size_t)e->hops + 3;
    e->demo_text = malloc(calls * 48);
    e->demo = calloc(calls, sizeof *e->demo);
    if (!e->text || !e->off || !e->obs || !e->demo_text || !e->demo) {
        free(e->text), free(e->off), free(e->obs), free(e->demo_text), free(e->demo), free(e);
        snprintf(err, cap, "notes: out of memory for %zu bytes of notes", bytes);
        return MTRL_ENV_ERR;
    }
    e->done = 1;
    *self = e;
    return MTRL_ENV_OK;
}

static void notes_destroy(void *self) {
    notes_env *e = self;
    if (!e) return;
    free(e->text), free(e->off), free(e->obs), free(e->demo_text), free(e->demo);
    free(e);
}

static int notes_reset(void *self, uint64_t seed, mtrl_env_bytes *prompt, char *err, size_t cap) {
    (void)err, (void)cap;
    notes_env *e = self;
    generate(e, seed);
    e->tool_calls = 0;
    e->done = 0;
    snprintf(e->prompt, sizeof e->prompt,
             "Notes n000 to n%03d. Tools: find(id,text) gives the offsets of the lines of note id containing text; "
             "read(id,offset) gives %d bytes of it. Start at n%03d, follow `see` %d times and answer the key of the "
             "note you reach.\n",
             e->notes - 1, e->page_bytes, e->start, e->hops);
    prompt->data = e->prompt;
    prompt->len = strlen(e->prompt);
    return MTRL_ENV_OK;
}

// Parses "nNNN" into a note index, or -1.
static int note_of(const notes_env *e, const char *s, size_t n) {
    while (n && (*s == ' ')) s++, n--;
    while (n && s[n - 1] == ' ') n--;
    if (n < 2 || s[0] != 'n') return -1;
    int v = 0;
    for (size_t i = 1; i < n; i++) {
        if (s[i] < '0' || s[i] > '9' || v > 100000) return -1;
        v = v * 10 + (s[i] - '0');
    }
    return v < e->notes ? v : -1;
}

#define OBS(...) (e->obs_len += (size_t)snprintf(e->obs + e->obs_len, (size_t)e->page_bytes + 128 - e->obs_len, __VA_ARGS__))

static void tool(notes_env *e, const char *a, size_t n, mtrl_env_step_out *out) {
    const char *open = memchr(a, '(', n);
    const char *comma = open ? memchr(open, ',', n - (size_t)(open - a)) : NULL;
    if (!open || !comma || a[n - 1] != ')') {
        OBS("error: expected find(id,text) or read(id,offset)");
        out->tool_error = 1;
        return;
    }
    size_t name_len = (size_t)(open - a);
    int id = note_of(e, open + 1, (size_t)(comma - open - 1));
    const char *arg = comma + 1;
    size_t arg_len = n - 1 - (size_t)(arg - a);
    int is_find = name_len == 4 && !memcmp(a, "find", 4), is_read = name_len == 4 && !memcmp(a, "read", 4);
    if (!is_find && !is_read) {
        OBS("error: unknown tool '%.*s'; tools: find, read", (int)(name_len < 40 ? name_len : 40), a);
        out->tool_error = 1;
        return;
    }
    if (id < 0) {
        OBS("error: no note '%.*s'", (int)((size_t)(comma - open - 1) < 40 ? (size_t)(comma - open - 1) : 40), open + 1);
        out->tool_error = 1;
        return;
    }
    const char *nb = e->text + e->off[id], *ne = e->text + e->off[id + 1];
    if (is_find) {
        if (arg_len == 0 || arg_len > 32) {
            OBS("error: find text must be 1 to 32 bytes");
            out->tool_error = 1;
            return;
        }
        for (const char *l = nb; l < ne;) {
            const char *nl = memchr(l, '\n', (size_t)(ne - l));
            size_t ll = nl ? (size_t)(nl - l) : (size_t)(ne - l);
            int hit = 0;
            for (size_t k = 0; k + arg_len <= ll && !hit; k++) hit = !memcmp(l + k, arg, arg_len);
            if (hit && e->obs_len + 16 < (size_t)e->page_bytes) OBS("%zu\n", (size_t)(l - nb));
            l += ll + 1;
        }
        if (e->obs_len == 0) OBS("no line of n%03d contains that", id);
        return;
    }
    char num[24];
    if (arg_len == 0 || arg_len >= sizeof num) {
        OBS("error: read needs an offset, e.g. read(n000,0)");
        out->tool_error = 1;
        return;
    }
    memcpy(num, arg, arg_len);
    num[arg_len] = 0;
    char *endp;
    long off = strtol(num, &endp, 10);
    if (*endp || off < 0 || off >= ne - nb) {
        OBS("error: offset '%s' is outside note n%03d (%zu bytes)", num, id, (size_t)(ne - nb));
        out->tool_error = 1;
        return;
    }
    size_t len = (size_t)(ne - nb) - (size_t)off;
    if (len > (size_t)e->page_bytes) len = (size_t)e->page_bytes;
    memcpy(e->obs, nb + off, len);
    e->obs_len = len;
}

static int notes_step(void *self, uint32_t kind, const char *action, size_t len, mtrl_env_step_out *out, char *err,
                      size_t cap) {
    notes_env *e = self;
    if (e->done) {
        snprintf(err, cap, "notes: step after the episode ended; call reset first");
        return MTRL_ENV_ERR;
    }
    e->obs_len = 0;
    if (kind == MTRL_ENV_ACTION_ANSWER) {
        while (len && (*action == ' ' || *action == '\n')) action++, len--;
        while (len && (action[len - 1] == ' ' || action[len - 1] == '\n')) len--;
        out->reward = len == strlen(e->key) && !memcmp(action, e->key, len) ? 1.0 : 0.0;
        out->done = e->done = 1;
    } else if (kind == MTRL_ENV_ACTION_TOOL) {
        if (++e->tool_calls > e->max_tool_calls) {
            OBS("error: tool call limit (%d) reached; episode over", e->max_tool_calls);
            out->done = e->done = 1;
            out->tool_error = 1;
        } else {
            tool(e, action, len, out);
        }
    } else {
        snprintf(err, cap, "notes: unknown action kind %u", kind);
        return MTRL_ENV_ERR;
    }
    out->obs.data = e->obs;
    out->obs.len = e->obs_len;
    return MTRL_ENV_OK;
}

static int notes_demo(void *self, mtrl_env_demo_out *out, char *err, size_t cap) {
    notes_env *e = self;
    if (e->done) {
        snprintf(err, cap, "notes: demo needs an episode; call reset first");
        return MTRL_ENV_ERR;
    }
    char *p = e->demo_text;
    size_t k = 0;
    int cur = e->start;
    for (int h = 0; h <= e->hops; h++) {
        const char *what = h < e->hops ? "see n" : "key: ", *word = h < e->hops ? "see" : "key";
        const char *nb = e->text + e->off[cur], *l = strstr(nb, what); // every note has both lines
        size_t at = (size_t)(l - nb);
        e->demo[k++] = (mtrl_env_action){MTRL_ENV_ACTION_TOOL, p, (size_t)sprintf(p, "find(n%03d,%s)", cur, word)};
        p += e->demo[k - 1].len + 1;
        e->demo[k++] = (mtrl_env_action){MTRL_ENV_ACTION_TOOL, p, (size_t)sprintf(p, "read(n%03d,%zu)", cur, at)};
        p += e->demo[k - 1].len + 1;
        if (h < e->hops) cur = atoi(l + 5);
    }
    e->demo[k++] = (mtrl_env_action){MTRL_ENV_ACTION_ANSWER, e->key, strlen(e->key)};
    out->actions = e->demo;
    out->count = k;
    return MTRL_ENV_OK;
}

static int notes_describe(void *self, mtrl_env_bytes *out, char *err, size_t cap) {
    (void)self, (void)err, (void)cap;
    static const char text[] = "find(id,text): offsets of the lines of note id containing text\n"
                               "read(id,offset): a page of note id from offset\n";
    out->data = text;
    out->len = sizeof text - 1;
    return MTRL_ENV_OK;
}

static const mtrl_env_api notes_api = {
    .abi_version = MTRL_ENV_ABI_VERSION,
    .struct_size = sizeof(mtrl_env_api),
    .name = "notes",
    .version = "1.0",
    .flags = MTRL_ENV_FLAG_THREAD_SAFE,
    .create = notes_create,
    .destroy = notes_destroy,
    .reset = notes_reset,
    .step = notes_step,
    .demo = notes_demo,
    .describe = notes_describe,
};

MTRL_ENV_EXPORT const mtrl_env_api *mtrl_env_plugin(uint32_t host_abi_version) {
    if (MTRL_ENV_ABI_MAJOR_OF(host_abi_version) != MTRL_ENV_ABI_MAJOR) return NULL;
    return &notes_api;
}
