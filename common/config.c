// config.c: typed INI experiment configuration (see config.h and config_schema.h).
#include "common/config.h"

#include <ctype.h>
#include <errno.h>
#include <ini.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/check.h"
#include "common/hash.h"
#include "common/hf_config.h"

// ---- the schema as a table --------------------------------------------------------------------

typedef enum { CFG_INT, CFG_FLOAT, CFG_BOOL, CFG_STR, CFG_ENUM } cfg_type;

typedef struct cfg_field {
    const char *section; // "stage" for the fields of every [stage.N]
    const char *key;
    cfg_type type;
    const char *def;     // "!" = required
    double lo, hi;
    const char *choices;
    const char *help;
    size_t offset;       // in mtrl_config, or in mtrl_cfg_stage for stage fields
} cfg_field;

#define CFG_ROW(sec, k, type, def, lo, hi, choices, help) \
    {#sec, #k, CFG_##type, def, lo, hi, choices, help, offsetof(mtrl_config, sec.k)},
#define CFG_STAGE_ROW(sec, k, type, def, lo, hi, choices, help) \
    {#sec, #k, CFG_##type, def, lo, hi, choices, help, offsetof(mtrl_cfg_stage, k)},

static const cfg_field cfg_fields_[] = {
    MTRL_CFG_RUN(CFG_ROW) MTRL_CFG_MODEL(CFG_ROW) MTRL_CFG_ENV(CFG_ROW) MTRL_CFG_ACTOR(CFG_ROW)
    MTRL_CFG_LEARNER(CFG_ROW) MTRL_CFG_ALGO(CFG_ROW) MTRL_CFG_WARMUP(CFG_ROW) MTRL_CFG_KERNELS(CFG_ROW)
};
static const cfg_field cfg_stage_fields_[] = {MTRL_CFG_STAGE(CFG_STAGE_ROW)};

#define N_FIELDS ((int)(sizeof cfg_fields_ / sizeof cfg_fields_[0]))
#define N_STAGE_FIELDS ((int)(sizeof cfg_stage_fields_ / sizeof cfg_stage_fields_[0]))

static const char *cfg_sections_[] = {"run", "model", "env", "actor", "learner", "algo", "warmup", "kernels"};
#define N_SECTIONS ((int)(sizeof cfg_sections_ / sizeof cfg_sections_[0]))

// ---- errors ---------------------------------------------------------------------------------------

static void errs_add(mtrl_config_errors *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void errs_add(mtrl_config_errors *e, const char *fmt, ...) {
    if (!e) return;
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (e->n == e->cap) {
        e->cap = e->cap ? 2 * e->cap : 8;
        e->msgs = xrealloc(e->msgs, sizeof(char *) * (size_t)e->cap);
    }
    e->msgs[e->n++] = xstrdup(buf);
}

void mtrl_config_errors_print(const mtrl_config_errors *errs, FILE *f) {
    for (int i = 0; i < errs->n; i++) fprintf(f, "%s\n", errs->msgs[i]);
}

void mtrl_config_errors_free(mtrl_config_errors *errs) {
    if (!errs) return;
    for (int i = 0; i < errs->n; i++) free(errs->msgs[i]);
    free(errs->msgs);
    memset(errs, 0, sizeof *errs);
}

// ---- nearest valid name (Levenshtein) ----------------------------------------------------------

static int edit_distance_(const char *a, const char *b) {
    int la = (int)strlen(a), lb = (int)strlen(b);
    if (la > 64 || lb > 64) return 99;
    int prev[65], cur[65];
    for (int j = 0; j <= lb; j++) prev[j] = j;
    for (int i = 1; i <= la; i++) {
        cur[0] = i;
        for (int j = 1; j <= lb; j++) {
            int sub = prev[j - 1] + (tolower((unsigned char)a[i - 1]) != tolower((unsigned char)b[j - 1]));
            int del = prev[j] + 1, ins = cur[j - 1] + 1;
            cur[j] = sub < del ? (sub < ins ? sub : ins) : (del < ins ? del : ins);
        }
        memcpy(prev, cur, sizeof(int) * (size_t)(lb + 1));
    }
    return prev[lb];
}

static const char *nearest_key_(const char *section, const char *key) {
    const char *best = NULL;
    int bestd = 1 << 30;
    int stage = !strcmp(section, "stage");
    int n = stage ? N_STAGE_FIELDS : N_FIELDS;
    const cfg_field *tab = stage ? cfg_stage_fields_ : cfg_fields_;
    for (int i = 0; i < n; i++) {
        if (strcmp(tab[i].section, section)) continue;
        int d = edit_distance_(key, tab[i].key);
        if (d < bestd) { bestd = d; best = tab[i].key; }
    }
    return best;
}

static const char *nearest_section_(const char *name) {
    const char *best = "run";
    int bestd = 1 << 30;
    for (int i = 0; i < N_SECTIONS; i++) {
        int d = edit_distance_(name, cfg_sections_[i]);
        if (d < bestd) { bestd = d; best = cfg_sections_[i]; }
    }
    if (edit_distance_(name, "stage.1") < bestd) best = "stage.1";
    return best;
}

// ---- values -----------------------------------------------------------------------------------------

static void *field_ptr_(mtrl_config *cfg, const cfg_field *f, int stage) {
    if (stage >= 0) return (char *)&cfg->stage[stage] + f->offset;
    return (char *)cfg + f->offset;
}

static const char *type_name_(cfg_type t) {
    switch (t) {
    case CFG_INT: return "integer";
    case CFG_FLOAT: return "number";
    case CFG_BOOL: return "boolean";
    case CFG_STR: return "string";
    case CFG_ENUM: return "choice";
    }
    return "?";
}

static int choice_ok_(const char *choices, const char *v) {
    size_t n = strlen(v);
    const char *p = choices;
    while (*p) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && !strncmp(p, v, n)) return 1;
        if (!bar) break;
        p = bar + 1;
    }
    return 0;
}

// Parses `value` into the field. On failure writes a reason (without location) into why.
static int field_set_(mtrl_config *cfg, const cfg_field *f, int stage, const char *value, char *why, size_t cap) {
    void *p = field_ptr_(cfg, f, stage);
    int bounded = f->lo != f->hi;
    switch (f->type) {
    case CFG_INT: {
        char *end;
        errno = 0;
        long long v = strtoll(value, &end, 10);
        if (!*value || *end || errno) {
            snprintf(why, cap, "expected an integer, got '%s'", value);
            return 0;
        }
        if (bounded && ((double)v < f->lo || (double)v > f->hi)) {
            snprintf(why, cap, "%lld is out of range [%.15g, %.15g]", v, f->lo, f->hi);
            return 0;
        }
        *(long *)p = (long)v;
        return 1;
    }
    case CFG_FLOAT: {
        char *end;
        errno = 0;
        double v = strtod(value, &end);
        if (!*value || *end || errno || !isfinite(v)) {
            snprintf(why, cap, "expected a finite number, got '%s'", value);
            return 0;
        }
        if (bounded && (v < f->lo || v > f->hi)) {
            snprintf(why, cap, "%g is out of range [%g, %g]", v, f->lo, f->hi);
            return 0;
        }
        *(double *)p = v;
        return 1;
    }
    case CFG_BOOL: {
        static const char *yes[] = {"true", "yes", "on", "1"}, *no[] = {"false", "no", "off", "0"};
        for (int i = 0; i < 4; i++) {
            if (!strcasecmp(value, yes[i])) { *(int *)p = 1; return 1; }
            if (!strcasecmp(value, no[i])) { *(int *)p = 0; return 1; }
        }
        snprintf(why, cap, "expected true or false, got '%s'", value);
        return 0;
    }
    case CFG_ENUM:
        if (!choice_ok_(f->choices, value)) {
            snprintf(why, cap, "'%s' is not one of %s", value, f->choices);
            return 0;
        }
        /* fall through */
    case CFG_STR:
        if (strlen(value) >= MTRL_CFG_STR_MAX) {
            snprintf(why, cap, "value is longer than %d bytes", MTRL_CFG_STR_MAX - 1);
            return 0;
        }
        snprintf((char *)p, MTRL_CFG_STR_MAX, "%s", value);
        return 1;
    }
    return 0;
}

void mtrl_config_defaults(mtrl_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    char why[256];
    for (int i = 0; i < N_FIELDS; i++) {
        const cfg_field *f = &cfg_fields_[i];
        if (!strcmp(f->def, "!")) continue;
        MTRL_CHECKF(field_set_(cfg, f, -1, f->def, why, sizeof why), "[%s] %s default: %s", f->section, f->key, why);
    }
    for (int s = 0; s < MTRL_CFG_MAX_STAGES; s++)
        for (int i = 0; i < N_STAGE_FIELDS; i++)
            MTRL_CHECK(field_set_(cfg, &cfg_stage_fields_[i], s, cfg_stage_fields_[i].def, why, sizeof why));
}

// ---- parsing ------------------------------------------------------------------------------------------

typedef struct cfg_parse {
    mtrl_config *cfg;
    mtrl_config_errors *errs;
    const char *name;      // file name for messages
    // the input: a FILE or a string
    FILE *f;
    const char *text;
    size_t text_pos;
    char *linebuf;
    size_t linecap;
    int line;              // physical line just handed to inih
    // the current section: -2 none yet, -1 invalid (already reported), else a kind
    int sec_kind;          // 0..N_SECTIONS-1, or N_SECTIONS for a stage
    int sec_stage;         // stage index for a stage section
    int sec_line[N_SECTIONS];
    int stage_line[MTRL_CFG_MAX_STAGES];
    int seen[N_FIELDS];    // line where each key was set (0 = not yet)
    int stage_seen[MTRL_CFG_MAX_STAGES][N_STAGE_FIELDS];
} cfg_parse;

static int parse_section_name_(cfg_parse *ps, const char *name) {
    ps->sec_kind = -1;
    for (int i = 0; i < N_SECTIONS; i++) {
        if (strcmp(name, cfg_sections_[i])) continue;
        if (ps->sec_line[i]) {
            errs_add(ps->errs, "%s:%d: duplicate section [%s] (first on line %d); merge the two", ps->name, ps->line,
                     name, ps->sec_line[i]);
            return 0;
        }
        ps->sec_line[i] = ps->line;
        ps->sec_kind = i;
        return 1;
    }
    if (!strncmp(name, "stage.", 6)) {
        char *end;
        long n = strtol(name + 6, &end, 10);
        if (name[6] && !*end && n >= 1 && n <= MTRL_CFG_MAX_STAGES) {
            if (ps->stage_line[n - 1]) {
                errs_add(ps->errs, "%s:%d: duplicate section [%s] (first on line %d)", ps->name, ps->line, name,
                         ps->stage_line[n - 1]);
                return 0;
            }
            ps->stage_line[n - 1] = ps->line;
            ps->sec_kind = N_SECTIONS;
            ps->sec_stage = (int)n - 1;
            return 1;
        }
        errs_add(ps->errs, "%s:%d: bad stage section [%s]; stages are [stage.1] .. [stage.%d]", ps->name, ps->line,
                 name, MTRL_CFG_MAX_STAGES);
        return 0;
    }
    errs_add(ps->errs, "%s:%d: unknown section [%s]; did you mean [%s]?", ps->name, ps->line, name,
             nearest_section_(name));
    return 0;
}

// Reads one physical line into ps->linebuf; returns its length or -1 at the end.
static long read_physical_line_(cfg_parse *ps) {
    if (ps->f) {
        ssize_t n = getline(&ps->linebuf, &ps->linecap, ps->f);
        return n < 0 ? -1 : (long)n;
    }
    if (!ps->text[ps->text_pos]) return -1;
    const char *s = ps->text + ps->text_pos;
    const char *nl = strchr(s, '\n');
    size_t n = nl ? (size_t)(nl - s) + 1 : strlen(s);
    if (n + 1 > ps->linecap) {
        ps->linecap = n + 1;
        ps->linebuf = xrealloc(ps->linebuf, ps->linecap);
    }
    memcpy(ps->linebuf, s, n);
    ps->linebuf[n] = '\0';
    ps->text_pos += n;
    return (long)n;
}

// The ini_reader: one physical line per call, so ps->line is the line of whatever inih does
// next. Lines we reject are reported here and handed to inih as blank lines, so inih's own
// error path (which has no line numbers to share with us) never runs.
static char *cfg_reader_(char *str, int num, void *stream) {
    cfg_parse *ps = stream;
    long n = read_physical_line_(ps);
    if (n < 0) return NULL;
    ps->line++;
    char *s = ps->linebuf;
    size_t len = (size_t)n;
    while (len && (s[len - 1] == '\n' || s[len - 1] == '\r')) s[--len] = '\0';
    if (ps->line == 1 && len >= 3 && !memcmp(s, "\xEF\xBB\xBF", 3)) { s += 3; len -= 3; } // UTF-8 BOM
    str[0] = '\n';
    str[1] = '\0';
    if (len + 2 > (size_t)num) {
        errs_add(ps->errs, "%s:%d: line is %zu bytes long; the limit is %d", ps->name, ps->line, len, num - 2);
        return str;
    }
    const char *p = s;
    while (*p == ' ' || *p == '\t') p++;
    if (!*p || *p == ';' || *p == '#') return str; // blank or comment
    if (p != s) {
        errs_add(ps->errs, "%s:%d: indented line; continuation lines are not supported, put the key at the start of the line",
                 ps->name, ps->line);
        return str;
    }
    if (*p == '[') {
        const char *close = strchr(p, ']');
        const char *after = close ? close + 1 : NULL;
        while (after && (*after == ' ' || *after == '\t')) after++;
        if (!close || (after && *after && *after != ';' && *after != '#')) {
            errs_add(ps->errs, "%s:%d: malformed section header '%s'; write [name]", ps->name, ps->line, s);
            ps->sec_kind = -1;
            return str;
        }
        char name[128];
        size_t nl = (size_t)(close - p - 1);
        if (nl >= sizeof name) nl = sizeof name - 1;
        memcpy(name, p + 1, nl);
        name[nl] = '\0';
        parse_section_name_(ps, name);
        memcpy(str, s, len);
        str[len] = '\n';
        str[len + 1] = '\0';
        return str;
    }
    if (!strchr(p, '=') && !strchr(p, ':')) {
        errs_add(ps->errs, "%s:%d: expected 'key = value', got '%s'", ps->name, ps->line, s);
        return str;
    }
    if (ps->sec_kind == -2) {
        errs_add(ps->errs, "%s:%d: key outside any section; put it under [run], [model], ...", ps->name, ps->line);
        return str;
    }
    memcpy(str, s, len);
    str[len] = '\n';
    str[len + 1] = '\0';
    return str;
}

static int find_field_(const char *section, const char *key) {
    int stage = !strcmp(section, "stage");
    int n = stage ? N_STAGE_FIELDS : N_FIELDS;
    const cfg_field *tab = stage ? cfg_stage_fields_ : cfg_fields_;
    for (int i = 0; i < n; i++)
        if (!strcmp(tab[i].section, section) && !strcmp(tab[i].key, key)) return i;
    return -1;
}

// Sets section.key = value from line `where` ("file:12" or "--set x.y"). Returns 1 when set.
static int assign_(cfg_parse *ps, const char *where, const char *section, int stage, const char *key,
                   const char *value, int line) {
    const char *tabsec = stage >= 0 ? "stage" : section;
    int idx = find_field_(tabsec, key);
    if (idx < 0 && !strcmp(section, "model") && !strcmp(key, "segment")) {
        errs_add(ps->errs, "%s: [model] segment has moved to [learner] segment (auto, or a token count N; the old 0 "
                 "is auto)", where);
        return 0;
    }
    if (idx < 0) {
        const char *near = nearest_key_(tabsec, key);
        errs_add(ps->errs, "%s: unknown key '%s' in [%s]; did you mean '%s'?", where, key, section,
                 near ? near : "?");
        return 0;
    }
    const cfg_field *f = stage >= 0 ? &cfg_stage_fields_[idx] : &cfg_fields_[idx];
    int *seen = stage >= 0 ? &ps->stage_seen[stage][idx] : &ps->seen[idx];
    if (line > 0 && *seen > 0) {
        errs_add(ps->errs, "%s: duplicate key '%s' in [%s] (first set on line %d)", where, key, section, *seen);
        return 0;
    }
    // Recorded before the value is checked: a second line with the same key is a duplicate
    // whether or not the first value was valid.
    if (*seen <= 0) *seen = line > 0 ? line : -1;
    char why[512];
    if (!field_set_(ps->cfg, f, stage, value, why, sizeof why)) {
        errs_add(ps->errs, "%s: [%s] %s: %s (%s)", where, section, key, why, f->help);
        return 0;
    }
    return 1;
}

// A path written in a file is relative to the file's folder, not to wherever mtrl was started:
// "sub/x" is <folder>/sub/x. With bare_search ([env] plugin), a bare "env.so" is <folder>/env.so
// only when that file exists (otherwise it stays bare, for dlopen's library search path). The
// folder is made absolute, so actors and the env host started elsewhere find the same file.
static void resolve_rel_path_(cfg_parse *ps, char *v, const char *what, int bare_search) {
    if (!v[0] || v[0] == '/' || !ps->f) return;
    const char *slash = strrchr(ps->name, '/');
    char dir[MTRL_CFG_STR_MAX * 4], real[PATH_MAX], joined[PATH_MAX + MTRL_CFG_STR_MAX + 2];
    snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - ps->name) : 1, slash ? ps->name : ".");
    if (!dir[0]) snprintf(dir, sizeof dir, "/");
    if (!realpath(dir, real)) return;
    snprintf(joined, sizeof joined, "%s%s%s", real, strcmp(real, "/") ? "/" : "", v);
    if (bare_search && !strchr(v, '/') && access(joined, F_OK) != 0) return;
    if (strlen(joined) >= MTRL_CFG_STR_MAX) {
        errs_add(ps->errs, "%s:%d: %s: %s is longer than %d bytes", ps->name, ps->line, what, joined, MTRL_CFG_STR_MAX - 1);
        return;
    }
    snprintf(v, MTRL_CFG_STR_MAX, "%s", joined);
}

static int cfg_handler_(void *user, const char *section, const char *name, const char *value) {
    cfg_parse *ps = user;
    if (ps->sec_kind < 0) return 1; // section already reported
    char where[512];
    snprintf(where, sizeof where, "%s:%d", ps->name, ps->line);
    int stage = ps->sec_kind == N_SECTIONS ? ps->sec_stage : -1;
    if (assign_(ps, where, section, stage, name, value, ps->line) && stage < 0) {
        mtrl_cfg_model *m = &ps->cfg->model;
        if (!strcmp(section, "env") && !strcmp(name, "plugin")) resolve_rel_path_(ps, ps->cfg->env.plugin, "[env] plugin", 1);
        if (!strcmp(section, "model") && !strcmp(name, "from")) resolve_rel_path_(ps, m->from, "[model] from", 0);
        if (!strcmp(section, "model") && !strcmp(name, "tokenizer") && strcmp(m->tokenizer, "auto") &&
            strcmp(m->tokenizer, "bytes"))
            resolve_rel_path_(ps, m->tokenizer, "[model] tokenizer", 0);
    }
    return 1; // keep going: we collect every error
}

static void apply_set_(cfg_parse *ps, const char *set) {
    char where[600];
    snprintf(where, sizeof where, "--set %s", set);
    const char *eq = strchr(set, '=');
    // The key is after the last dot before '=' (sections may contain a dot: stage.2.steps).
    const char *kdot = NULL;
    for (const char *p = set; eq && p < eq; p++)
        if (*p == '.') kdot = p;
    if (!eq || !kdot) {
        errs_add(ps->errs, "%s: expected section.key=value", where);
        return;
    }
    char section[128], key[128];
    size_t sl = (size_t)(kdot - set), kl = (size_t)(eq - kdot - 1);
    if (!sl || !kl || sl >= sizeof section || kl >= sizeof key) {
        errs_add(ps->errs, "%s: expected section.key=value", where);
        return;
    }
    memcpy(section, set, sl);
    section[sl] = '\0';
    memcpy(key, kdot + 1, kl);
    key[kl] = '\0';
    int stage = -1, known = 0;
    for (int i = 0; i < N_SECTIONS; i++) known |= !strcmp(section, cfg_sections_[i]);
    if (!known && !strncmp(section, "stage.", 6)) {
        char *end;
        long n = strtol(section + 6, &end, 10);
        if (section[6] && !*end && n >= 1 && n <= MTRL_CFG_MAX_STAGES) {
            stage = (int)n - 1;
            known = 1;
            if (!ps->stage_line[stage]) ps->stage_line[stage] = -1;
        }
    }
    if (!known) {
        errs_add(ps->errs, "%s: unknown section [%s]; did you mean [%s]?", where, section, nearest_section_(section));
        return;
    }
    assign_(ps, where, section, stage, key, eq + 1, -1);
}

// "file:12" for a key set on line 12, "--set" for one set on the command line.
static void key_where_(const cfg_parse *ps, int seen, char *out, size_t cap) {
    if (seen > 0) snprintf(out, cap, "%s:%d", ps->name, seen);
    else snprintf(out, cap, "%s: --set", ps->name);
}

// 1 when field f (of the top-level sections) holds the same value in a and b.
static int field_same_(const mtrl_config *x, const mtrl_config *y, const cfg_field *f) {
    const char *a = (const char *)x + f->offset, *b = (const char *)y + f->offset;
    switch (f->type) {
    case CFG_INT: return *(const long *)a == *(const long *)b;
    case CFG_FLOAT: return *(const double *)a == *(const double *)b;
    case CFG_BOOL: return *(const int *)a == *(const int *)b;
    default: return !strcmp(a, b);
    }
}

// 1 when the field holds its default value.
static int field_is_default_(const mtrl_config *cfg, const cfg_field *f) {
    mtrl_config d;
    mtrl_config_defaults(&d);
    return field_same_(cfg, &d, f);
}

static size_t field_size_(const cfg_field *f) {
    switch (f->type) {
    case CFG_INT: return sizeof(long);
    case CFG_FLOAT: return sizeof(double);
    case CFG_BOOL: return sizeof(int);
    default: return MTRL_CFG_STR_MAX;
    }
}

// [model] from = DIR: the [model] keys its config.json maps (hf_config.h) are set here, before
// the preset fills the rest. A key the experiment sets itself must agree: a different value is
// an error naming both, never a silent override either way.
static void resolve_from_(cfg_parse *ps) {
    mtrl_cfg_model *m = &ps->cfg->model;
    if (!m->from[0]) return;
    mtrl_hf_config h;
    mtrl_error err;
    if (mtrl_hf_config_read(&h, m->from, &err) != MTRL_OK) {
        errs_add(ps->errs, "%s: [model] from = %s: %s", ps->name, m->from, err.msg);
        return;
    }
    mtrl_config *tmp = xmalloc(sizeof *tmp);
    for (int i = 0; i < h.n_keys; i++) {
        const mtrl_hf_key *k = &h.keys[i];
        int idx = find_field_("model", k->key);
        if (idx < 0) {
            errs_add(ps->errs, "%s: [model] from: %s maps %s onto [model] %s, which this build does not have", ps->name,
                     h.path, k->field, k->key);
            continue;
        }
        const cfg_field *f = &cfg_fields_[idx];
        char why[512], where[600];
        *tmp = *ps->cfg;
        if (!field_set_(tmp, f, -1, k->value, why, sizeof why)) {
            errs_add(ps->errs, "%s: [model] from: %s: %s gives [model] %s = %s: %s", ps->name, h.path, k->field, k->key,
                     k->value, why);
            continue;
        }
        if (ps->seen[idx] && !field_same_(ps->cfg, tmp, f)) {
            key_where_(ps, ps->seen[idx], where, sizeof where);
            errs_add(ps->errs, "%s: [model] %s conflicts with from = %s: its config.json has %s, which is %s = %s; remove "
                     "the key or make it agree", where, k->key, m->from, k->field, k->key, k->value);
            continue;
        }
        memcpy((char *)ps->cfg + f->offset, (char *)tmp + f->offset, field_size_(f));
    }
    free(tmp);
}

// [env] keys that only one built-in reads do nothing beside a plug-in (it gets `args` alone),
// and `plugin` does nothing beside a built-in: either is a mistake worth stopping for.
static void check_env_keys_(cfg_parse *ps) {
    static const struct { const char *key, *env; } own[] = {
        {"digits", "calc"},          {"ops", "calc"},           {"doc_tokens", "retrieval"},
        {"inline_doc", "retrieval"}, {"demo_search", "retrieval"}, {"key_digits", "retrieval"},
        {"base_url", "http"},        {"allow_loopback", "http"},   {"timeout_ms", "http"},
        {"task", "corpus"},          {"hops", "corpus"},           {"files", "corpus"},
        {"file_tokens", "corpus"},   {"credit", "corpus or retrieval"}, {"hops_min", "corpus"},
    };
    const char *name = ps->cfg->env.name;
    char where[600];
    if (!strcmp(name, "plugin")) {
        for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) {
            int idx = find_field_("env", own[i].key);
            // A resolved config (mtrl check's output, what actors receive) lists every key; only
            // a value other than the default says somebody meant it.
            if (idx < 0 || !ps->seen[idx] || field_is_default_(ps->cfg, &cfg_fields_[idx])) continue;
            key_where_(ps, ps->seen[idx], where, sizeof where);
            errs_add(ps->errs, "%s: [env] %s is a key of the built-in %s env and does nothing with name = plugin; "
                     "give a plug-in its keys in args = key=value;...", where, own[i].key, own[i].env);
        }
        return;
    }
    int idx = find_field_("env", "plugin");
    if (idx >= 0 && ps->seen[idx] && ps->cfg->env.plugin[0]) {
        key_where_(ps, ps->seen[idx], where, sizeof where);
        errs_add(ps->errs, "%s: [env] plugin is set but name = %s, a built-in; set name = plugin to use the plug-in, "
                 "or remove plugin", where, name);
    }
}

// Checks that need the whole file: required keys, stage numbering, cross-field rules.
static void check_whole_(cfg_parse *ps) {
    mtrl_config *cfg = ps->cfg;
    for (int i = 0; i < N_FIELDS; i++)
        if (!strcmp(cfg_fields_[i].def, "!") && !ps->seen[i])
            errs_add(ps->errs, "%s: [%s] missing required key '%s' (%s)", ps->name, cfg_fields_[i].section,
                     cfg_fields_[i].key, cfg_fields_[i].help);
    cfg->n_stages = 0;
    for (int s = 0; s < MTRL_CFG_MAX_STAGES; s++)
        if (ps->stage_line[s]) cfg->n_stages = s + 1;
    for (int s = 0; s < cfg->n_stages; s++)
        if (!ps->stage_line[s])
            errs_add(ps->errs, "%s: [stage.%d] is missing; stages must be numbered 1, 2, 3, ... without gaps", ps->name,
                     s + 1);
    const char *kt = cfg->run.keep_trajectories;
    if (strcmp(kt, "all") && strcmp(kt, "failures")) {
        char *end;
        long n = !strncmp(kt, "every_", 6) ? strtol(kt + 6, &end, 10) : 0;
        if (n < 1 || *end)
            errs_add(ps->errs, "%s: [run] keep_trajectories: '%s' is not all, failures or every_N (N >= 1)", ps->name, kt);
    }
    if (!strcmp(cfg->env.name, "plugin") && !cfg->env.plugin[0])
        errs_add(ps->errs, "%s: [env] name = plugin needs plugin = path/to/env.so", ps->name);
    check_env_keys_(ps);
    if (cfg->learner.curve_key[0] && !cfg->learner.curve_allow[0])
        errs_add(ps->errs, "%s: [learner] curve_key needs curve_allow: the actors' public keys (a file, one key a "
                 "line, or a folder of .pub files)", ps->name);
    if (cfg->learner.curve_allow[0] && !cfg->learner.curve_key[0])
        errs_add(ps->errs, "%s: [learner] curve_allow has no effect without curve_key (the learner's key file, from "
                 "mtrl keygen)", ps->name);
    if (mtrl_config_segment(cfg) == 0)
        errs_add(ps->errs, "%s: [learner] segment: '%s' is not auto or a token count 1..%d", ps->name,
                 cfg->learner.segment, 1 << 30);
    if (!strcmp(cfg->kernels.attn_operands, "fp32") && strcmp(cfg->kernels.latent, "fp32"))
        errs_add(ps->errs, "%s: [kernels] attn_operands = fp32 needs latent = fp32 (the keys and values are read "
                 "from the latent caches)", ps->name);
    if (!strcmp(cfg->actor.weights, "bf16") &&
        (strcmp(cfg->kernels.gemm, "bf16") || strncmp(cfg->model.device, "cuda", 4)))
        errs_add(ps->errs, "%s: [actor] weights = bf16 needs [model] device = cuda and [kernels] gemm = bf16 (the "
                 "GEMM weights are kept as bf16 only)", ps->name);
    char why[400];
    int gpus[MTRL_CFG_GPUS_MAX];
    if (mtrl_config_gpus(cfg, gpus, why, sizeof why) < 0)
        errs_add(ps->errs, "%s: [learner] gpus = %s: %s", ps->name, cfg->learner.gpus, why);
    int n_actor_gpus = mtrl_config_actor_gpus(cfg, gpus, why, sizeof why);
    if (n_actor_gpus < 0)
        errs_add(ps->errs, "%s: [actor] gpus = %s: %s", ps->name, cfg->actor.gpus, why);
    else if (n_actor_gpus > 0 && strncmp(cfg->model.device, "cuda", 4))
        errs_add(ps->errs, "%s: [actor] gpus = %s needs [model] device = cuda (it is %s: the actors run where the "
                 "model does)", ps->name, cfg->actor.gpus, cfg->model.device);
    else if (cfg->learner.ranks != 0 && mtrl_config_ranks(cfg, NULL, why, sizeof why) < 0)
        errs_add(ps->errs, "%s: %s", ps->name, why);
    if (cfg->algo.eps_low >= 1.0)
        errs_add(ps->errs, "%s: [algo] eps_low must be below 1 (ratios are clipped to [1 - eps_low, 1 + eps_high])", ps->name);
}

long mtrl_config_segment(const mtrl_config *cfg) {
    const char *s = cfg->learner.segment;
    if (!strcmp(s, "auto")) return MTRL_CFG_SEGMENT_AUTO;
    char *end;
    errno = 0;
    long n = strtol(s, &end, 10);
    return *s && !*end && !errno && n >= 1 && n <= (1L << 30) ? n : 0;
}

// A comma-separated list of GPU ids (spaces allowed) into ids: the count, or -1 with the reason
// (entries not numbers, out of 0..MTRL_CFG_GPU_ID_MAX, more than MTRL_CFG_GPUS_MAX, one listed
// twice unless repeats are allowed). An empty list is 0.
static int gpu_list_parse_(const char *s, int repeats, int *ids, char *why, size_t why_cap) {
    int n = 0; // why may be NULL with why_cap 0: snprintf then writes nothing
    while (*s == ' ') s++;
    if (!*s) return 0;
    for (;;) {
        while (*s == ' ') s++;
        char *end;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (end == s || errno || (*s != '-' && (*s < '0' || *s > '9'))) {
            snprintf(why, why_cap, "expected GPU ids separated by commas, e.g. 0,1 (entry %d is not a number)", n + 1);
            return -1;
        }
        if (v < 0 || v > MTRL_CFG_GPU_ID_MAX) {
            snprintf(why, why_cap, "%ld is not a GPU id (0..%d)", v, MTRL_CFG_GPU_ID_MAX);
            return -1;
        }
        for (int i = 0; i < n && !repeats; i++)
            if (ids[i] == v) {
                snprintf(why, why_cap, "GPU %ld is listed twice (one rank per GPU)", v);
                return -1;
            }
        if (n == MTRL_CFG_GPUS_MAX) {
            snprintf(why, why_cap, "more than %d GPUs", MTRL_CFG_GPUS_MAX);
            return -1;
        }
        ids[n++] = (int)v;
        s = end;
        while (*s == ' ') s++;
        if (!*s) return n;
        if (*s != ',') {
            snprintf(why, why_cap, "expected a comma after %ld, found '%c'", v, *s);
            return -1;
        }
        s++;
    }
}

int mtrl_config_gpus(const mtrl_config *cfg, int *ids, char *why, size_t why_cap) {
    return gpu_list_parse_(cfg->learner.gpus, 0, ids, why, why_cap);
}

int mtrl_config_actor_gpus(const mtrl_config *cfg, int *ids, char *why, size_t why_cap) {
    return gpu_list_parse_(cfg->actor.gpus, 1, ids, why, why_cap);
}

int mtrl_config_actor_gpu(const mtrl_config *cfg, int actor_id) {
    int ids[MTRL_CFG_GPUS_MAX], n = mtrl_config_actor_gpus(cfg, ids, NULL, 0);
    return n > 0 && actor_id >= 1 ? ids[(actor_id - 1) % n] : -1;
}

int mtrl_config_ranks(const mtrl_config *cfg, int *gpu, char *why, size_t why_cap) {
    int ids[MTRL_CFG_GPUS_MAX], own[MTRL_CFG_GPUS_MAX];
    char w[160];
    int n = mtrl_config_gpus(cfg, ids, w, sizeof w);
    if (!gpu) gpu = own;
    if (n < 0) {
        snprintf(why, why_cap, "[learner] gpus = %s: %s", cfg->learner.gpus, w);
        return -1;
    }
    long ranks = cfg->learner.ranks;
    if (ranks < 0 || ranks > MTRL_CFG_GPUS_MAX) {
        snprintf(why, why_cap, "[learner] ranks = %ld: expected 0..%d", ranks, MTRL_CFG_GPUS_MAX);
        return -1;
    }
    if (strcmp(cfg->model.device, "cuda") != 0) { // the CPU: the ranks are threads
        if (n > 0) {
            snprintf(why, why_cap, "[learner] gpus = %s lists CUDA devices, but [model] device = %s puts the learner "
                     "and its actors on the CPU%s; remove gpus, or set device = cuda", cfg->learner.gpus,
                     cfg->model.device, ranks > 1 ? " ([learner] ranks runs its ranks as threads there)" : "");
            return -1;
        }
        int R = ranks ? (int)ranks : 1;
        for (int r = 0; r < R; r++) gpu[r] = -1;
        return R;
    }
    if (n == 0) { // devices 0 .. R-1; [model] device = cuda is GPU 0, rank 0's
        int R = ranks ? (int)ranks : 1;
        for (int r = 0; r < R; r++) gpu[r] = r;
        return R;
    }
    if (ranks && ranks != n) {
        snprintf(why, why_cap, "[learner] ranks = %ld, but [learner] gpus = %s lists %d GPU%s: one rank per listed GPU "
                 "(set ranks = %d, or 0)", ranks, cfg->learner.gpus, n, n == 1 ? "" : "s", n);
        return -1;
    }
    if (ids[0] != 0) {
        snprintf(why, why_cap, "[learner] gpus = %s puts rank 0 on GPU %d, but [model] device = %s puts rank 0 and "
                 "the actors on GPU 0; list GPU 0 first", cfg->learner.gpus, ids[0], cfg->model.device);
        return -1;
    }
    memcpy(gpu, ids, sizeof(int) * (size_t)n);
    return n;
}

// ---- model presets ---------------------------------------------------------------------------------------

typedef struct model_preset {
    const char *name;
    long layers, d_model, kda_heads, kda_head_dim, mla_heads, mla_nope, mla_rope, mla_v, mla_latent, dense_inter,
        experts, top_k, shared, expert_inter, attnres_block;
} model_preset;

// tiny: a laptop CPU and CI (quickstart in minutes). small: one GPU.
static const model_preset presets_[] = {
    {"tiny", 4, 64, 2, 16, 2, 16, 8, 16, 32, 128, 8, 2, 1, 64, 2},
    {"small", 12, 1024, 8, 128, 8, 128, 64, 128, 512, 2816, 64, 6, 1, 512, 4},
};

static void resolve_model_(cfg_parse *ps) {
    mtrl_cfg_model *m = &ps->cfg->model;
    const model_preset *p = !strcmp(m->preset, "small") ? &presets_[1] : &presets_[0];
    int custom = !strcmp(m->preset, "custom");
#define FILL(field, val)                                                                                   \
    if (m->field == 0) {                                                                                   \
        if (custom) errs_add(ps->errs, "%s: [model] preset = custom needs %s", ps->name, #field);        \
        m->field = (val);                                                                                  \
    }
    FILL(layers, p->layers)
    FILL(d_model, p->d_model)
    FILL(kda_heads, p->kda_heads)
    FILL(kda_head_dim, p->kda_head_dim)
    FILL(mla_heads, p->mla_heads)
    FILL(mla_nope_dim, p->mla_nope)
    FILL(mla_rope_dim, p->mla_rope)
    FILL(mla_v_dim, p->mla_v)
    FILL(mla_latent_dim, p->mla_latent)
    FILL(dense_inter, p->dense_inter)
    FILL(experts, p->experts)
    FILL(top_k, p->top_k)
    FILL(expert_inter, p->expert_inter)
#undef FILL
    // Without AttnRes the block size is never read, so a custom model need not give it.
    if (m->attnres_block == 0) {
        if (custom && m->attnres) errs_add(ps->errs, "%s: [model] preset = custom needs attnres_block", ps->name);
        m->attnres_block = p->attnres_block;
    }
    if (m->shared_experts < 0) m->shared_experts = p->shared;
    if (m->dense_layers == 0) m->dense_layers = 1; // every preset: layer 0 alone
    if (m->dense_layers > m->layers)
        errs_add(ps->errs, "%s: [model] dense_layers = %ld exceeds layers = %ld", ps->name, m->dense_layers, m->layers);
    if (m->top_k > m->experts)
        errs_add(ps->errs, "%s: [model] top_k = %ld exceeds experts = %ld", ps->name, m->top_k, m->experts);
    if (!strcmp(m->hybrid, "default")) {
        // Layer l (1-based) is MLA when l % 4 == 0 or l == L (docs/model.md §0.1).
        long L = m->layers < MTRL_CFG_STR_MAX - 1 ? m->layers : MTRL_CFG_STR_MAX - 1;
        for (long l = 1; l <= L; l++) m->hybrid[l - 1] = (l % 4 == 0 || l == L) ? 'M' : 'K';
        m->hybrid[L] = '\0';
    } else {
        size_t n = strlen(m->hybrid);
        int bad = 0;
        for (size_t i = 0; i < n; i++) bad |= m->hybrid[i] != 'K' && m->hybrid[i] != 'M';
        if (bad || (long)n != m->layers)
            errs_add(ps->errs, "%s: [model] hybrid = '%s' must be 'default' or %ld letters K (KDA) / M (MLA), one per layer",
                     ps->name, m->hybrid, m->layers);
    }
}

static mtrl_status load_(mtrl_config *cfg, cfg_parse *ps, const char *const *sets, int n_sets) {
    int before = ps->errs ? ps->errs->n : 0;
    mtrl_config_defaults(cfg);
    ps->cfg = cfg;
    ps->sec_kind = -2;
    // INI_MAX_LINE of the linked inih (200 in Debian's build) is the buffer inih gives us.
    ini_parse_stream(cfg_reader_, ps, cfg_handler_, ps);
    free(ps->linebuf);
    for (int i = 0; i < n_sets; i++) apply_set_(ps, sets[i]);
    check_whole_(ps);
    resolve_from_(ps);
    resolve_model_(ps);
    return (ps->errs ? ps->errs->n : 0) > before ? MTRL_ERR_USAGE : MTRL_OK;
}

mtrl_status mtrl_config_load(mtrl_config *cfg, const char *path, const char *const *sets, int n_sets,
                             mtrl_config_errors *errs) {
    FILE *f = fopen(path, "r");
    if (!f) {
        errs_add(errs, "%s: cannot open: %s", path, strerror(errno));
        return MTRL_ERR_IO;
    }
    cfg_parse ps = {0};
    ps.errs = errs;
    ps.name = path;
    ps.f = f;
    mtrl_status st = load_(cfg, &ps, sets, n_sets);
    fclose(f);
    snprintf(cfg->path, sizeof cfg->path, "%s", path);
    return st;
}

mtrl_status mtrl_config_load_text(mtrl_config *cfg, const char *name, const char *text, const char *const *sets,
                                  int n_sets, mtrl_config_errors *errs) {
    cfg_parse ps = {0};
    ps.errs = errs;
    ps.name = name;
    ps.text = text;
    mtrl_status st = load_(cfg, &ps, sets, n_sets);
    snprintf(cfg->path, sizeof cfg->path, "%s", name);
    return st;
}

// ---- printing ------------------------------------------------------------------------------------------------

typedef struct strbuf { char *s; size_t n, cap; } strbuf;

static void sb_printf_(strbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf_(strbuf *b, const char *fmt, ...) {
    va_list ap;
    for (;;) {
        va_start(ap, fmt);
        int need = vsnprintf(b->s ? b->s + b->n : NULL, b->s ? b->cap - b->n : 0, fmt, ap);
        va_end(ap);
        if (b->s && b->n + (size_t)need < b->cap) { b->n += (size_t)need; return; }
        b->cap = (b->cap + (size_t)need + 1) * 2;
        b->s = xrealloc(b->s, b->cap);
    }
}

static void print_value_(strbuf *b, const cfg_field *f, const void *p) {
    switch (f->type) {
    case CFG_INT: sb_printf_(b, "%ld", *(const long *)p); break;
    case CFG_FLOAT: sb_printf_(b, "%.10g", *(const double *)p); break;
    case CFG_BOOL: sb_printf_(b, "%s", *(const int *)p ? "true" : "false"); break;
    default: sb_printf_(b, "%s", (const char *)p); break;
    }
}

char *mtrl_config_to_ini(const mtrl_config *cfg) {
    strbuf b = {0};
    const char *cur = NULL;
    for (int i = 0; i < N_FIELDS; i++) {
        const cfg_field *f = &cfg_fields_[i];
        if (!cur || strcmp(cur, f->section)) {
            sb_printf_(&b, "%s[%s]\n", cur ? "\n" : "", f->section);
            cur = f->section;
        }
        sb_printf_(&b, "%s = ", f->key);
        print_value_(&b, f, (const char *)cfg + f->offset);
        sb_printf_(&b, "\n");
    }
    for (int s = 0; s < cfg->n_stages; s++) {
        sb_printf_(&b, "\n[stage.%d]\n", s + 1);
        for (int i = 0; i < N_STAGE_FIELDS; i++) {
            const cfg_field *f = &cfg_stage_fields_[i];
            sb_printf_(&b, "%s = ", f->key);
            print_value_(&b, f, (const char *)&cfg->stage[s] + f->offset);
            sb_printf_(&b, "\n");
        }
    }
    return b.s;
}

uint64_t mtrl_config_hash(const mtrl_config *cfg) {
    char *s = mtrl_config_to_ini(cfg);
    uint64_t h = mtrl_hash64_str(s, 0x636f6e666967ULL);
    free(s);
    return h;
}

static void print_key_rows_(FILE *f, const cfg_field *tab, int n, const char *secname) {
    for (int i = 0; i < n; i++) {
        const cfg_field *x = &tab[i];
        char range[128] = "";
        if (x->type == CFG_ENUM) snprintf(range, sizeof range, " {%s}", x->choices);
        else if ((x->type == CFG_INT || x->type == CFG_FLOAT) && x->lo != x->hi)
            snprintf(range, sizeof range, " [%.10g, %.10g]", x->lo, x->hi);
        fprintf(f, "  [%s] %-20s %-8s default %-10s%s\n      %s\n", secname ? secname : x->section, x->key,
                type_name_(x->type), !strcmp(x->def, "!") ? "(required)" : (x->def[0] ? x->def : "\"\""), range,
                x->help);
    }
}

void mtrl_config_print_keys(FILE *f) {
    print_key_rows_(f, cfg_fields_, N_FIELDS, NULL);
    print_key_rows_(f, cfg_stage_fields_, N_STAGE_FIELDS, "stage.N");
}

int mtrl_config_threads(const mtrl_config *cfg) {
    if (cfg->learner.threads > 0) return (int)cfg->learner.threads;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    long share = cores / (1 + (cfg->actor.count > 0 ? cfg->actor.count : 0));
    return share < 1 ? 1 : (int)share;
}

int mtrl_config_stage_of_step(const mtrl_config *base, long step) {
    long end = 0;
    for (int s = 0; s < base->n_stages; s++) {
        end += base->stage[s].steps;
        if (step < end) return s;
    }
    return base->n_stages > 0 ? base->n_stages - 1 : 0;
}

mtrl_config mtrl_config_stage(const mtrl_config *base, int s) {
    mtrl_config c = *base;
    const mtrl_cfg_stage *st = &base->stage[s];
    if (st->context > 0) c.actor.max_tokens = st->context;
    if (st->doc_tokens > 0) c.env.doc_tokens = st->doc_tokens;
    if (st->hops > 0) c.env.hops = st->hops;
    if (st->hops_min > 0) c.env.hops_min = st->hops_min;
    if (st->files > 0) c.env.files = st->files;
    if (st->max_obs_bytes > 0) c.env.max_obs_bytes = st->max_obs_bytes;
    if (st->max_tool_calls > 0) c.env.max_tool_calls = st->max_tool_calls;
    if (st->group_size > 0) c.algo.group_size = st->group_size;
    if (st->batch_groups > 0) c.learner.batch_groups = st->batch_groups;
    if (st->episodes_in_flight > 0) c.actor.episodes_in_flight = st->episodes_in_flight;
    if (c.actor.max_turn_tokens > c.actor.max_tokens) c.actor.max_turn_tokens = c.actor.max_tokens;
    return c;
}
