// json_line.c: one JSON object on one line (see json_line.h).
#include "learner/json_line.h"

#include <math.h>
#include <string.h>

#include "common/log.h"

// The keys and the type are the program's own identifiers: written as they are.
static void key_(mtrl_json_line *j, const char *key) { fprintf(j->f, ",\"%s\":", key); }

static void text_(FILE *f, const char *s) {
    char esc[1024];
    mtrl_text_escape(esc, sizeof esc, s ? s : "", s ? strlen(s) : 0);
    fputc('"', f);
    for (const char *c = esc; *c; c++) {
        if (*c == '"' || *c == '\\') fputc('\\', f);
        fputc(*c, f);
    }
    fputc('"', f);
}

void mtrl_json_begin(mtrl_json_line *j, FILE *f, const char *type) {
    j->f = f;
    fprintf(f, "{\"type\":\"%s\"", type);
}

void mtrl_json_int(mtrl_json_line *j, const char *key, long long v) {
    key_(j, key);
    fprintf(j->f, "%lld", v);
}

// JSON has no NaN or infinity.
void mtrl_json_num(mtrl_json_line *j, const char *key, double v) {
    key_(j, key);
    if (isfinite(v)) fprintf(j->f, "%.6g", v);
    else fputs("null", j->f);
}

void mtrl_json_str(mtrl_json_line *j, const char *key, const char *text) {
    key_(j, key);
    text_(j->f, text);
}

void mtrl_json_end(mtrl_json_line *j) {
    fputs("}\n", j->f);
    fflush(j->f);
}
