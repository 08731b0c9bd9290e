// json_line.h: one JSON object on one line, written field by field: `mtrl run --json`'s progress
// (learner/learner.h lists its lines and fields).
//
//     mtrl_json_line j;
//     mtrl_json_begin(&j, stdout, "step");   // {"type":"step"
//     mtrl_json_int(&j, "step", 12);         // ,"step":12
//     mtrl_json_num(&j, "reward", 0.5);      // ,"reward":0.5   (not finite: null)
//     mtrl_json_str(&j, "reason", text);     // ,"reason":"..." (escaped, see below)
//     mtrl_json_end(&j);                     // }\n, flushed: a reader sees whole lines
//
// Strings may hold anything (a failure reason quotes peers and envs): they are escaped to
// printable text first (mtrl_text_escape, common/log.h), then for JSON.
#ifndef MTRL_LEARNER_JSON_LINE_H
#define MTRL_LEARNER_JSON_LINE_H

#include <stdio.h>

typedef struct mtrl_json_line {
    FILE *f;
} mtrl_json_line;

void mtrl_json_begin(mtrl_json_line *j, FILE *f, const char *type);
void mtrl_json_int(mtrl_json_line *j, const char *key, long long v);
void mtrl_json_num(mtrl_json_line *j, const char *key, double v);
void mtrl_json_str(mtrl_json_line *j, const char *key, const char *text);
void mtrl_json_end(mtrl_json_line *j);

#endif
