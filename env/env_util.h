// env_util.h: small pieces the built-in envs and the host share (internal to env/).
//
// - env_buf: a growable byte buffer (xrealloc: never fails), always NUL-terminated so text
//   can be printed, though lengths are explicit.
// - env_config: parses the ABI's config string (key=value pairs separated by newlines or ';')
//   and reads typed values with range checks. Errors name the env, the key and the allowed
//   range; unknown keys are refused with the list of known ones.
// - env_tool_parse: splits a tool call `name(args)` into name and args.
// - env_tool_error: formats the standard error observations for malformed/unknown calls.
// Error buffers follow the ABI: (char *err, size_t cap), NUL-terminated, may be truncated.
#ifndef MTRL_ENV_UTIL_H
#define MTRL_ENV_UTIL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "env/mtrl_env.h"
#include <stdint.h>

// ---- growable buffer ------------------------------------------------------------------------

typedef struct env_buf {
    char *data; // NUL-terminated after every append; NULL until the first append
    size_t len;
    size_t cap;
} env_buf;

void env_buf_clear(env_buf *b); // len = 0, keeps the memory
void env_buf_free(env_buf *b);
// Makes room for `extra` more bytes and returns a pointer to the end (len is not changed).
char *env_buf_reserve(env_buf *b, size_t extra);
void env_buf_append(env_buf *b, const void *data, size_t n);
void env_buf_puts(env_buf *b, const char *s);
void env_buf_printf(env_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

// ---- config strings -------------------------------------------------------------------------

typedef struct env_config_item {
    char *key;
    char *value;
    int used; // set when a getter read it; env_config_finish refuses unread keys
} env_config_item;

typedef struct env_config {
    const char *env; // env name for messages (not owned)
    env_config_item *items;
    int count;
} env_config;

// Parses text (may be NULL or empty). Refuses a pair without '=', an empty key and duplicates.
int env_config_parse(env_config *cfg, const char *env, const char *text, char *err, size_t cap);
void env_config_free(env_config *cfg);
// Integer value of key (decimal, strict: the whole value must be a number), or def when absent.
// Out of [min, max] or not a number: error naming the key and the range.
int env_config_int(env_config *cfg, const char *key, long long def, long long min, long long max,
                   long long *out, char *err, size_t cap);
// Real value of key (strtod, strict: the whole value must be a finite number), or def when
// absent. Out of [min, max] or not a number: error naming the key and the range.
int env_config_double(env_config *cfg, const char *key, double def, double min, double max, double *out, char *err,
                      size_t cap);
// Boolean value of key: 1/0, true/false, yes/no, on/off (any case), or def when absent.
int env_config_bool(env_config *cfg, const char *key, int def, int *out, char *err, size_t cap);
// String value of key, or def when absent (pointer into cfg, valid until env_config_free).
const char *env_config_str(env_config *cfg, const char *key, const char *def);
// Refuses keys no getter read: "calc: unknown config key 'digit'; known keys: digits, ops, ...".
// Keys of the experiment's [env] section that belong to another built-in or to the host
// (ENV_CONFIG_SHARED_KEYS) are ignored, so a caller may pass the whole section to any env.
int env_config_finish(env_config *cfg, const char *known, char *err, size_t cap);
#define ENV_CONFIG_SHARED_KEYS                                                                    \
    "name", "plugin", "args", "isolate", "step_timeout_ms", "digits", "ops", "doc_tokens", "inline_doc", "demo_search", \
        "key_digits", "max_tool_calls", "max_obs_bytes", "base_url", "index_path", "allow_loopback", "timeout_ms",     \
        "connect_timeout_ms", "max_bytes", "max_redirects", "task", "hops", "hops_min", "files", "file_tokens", "credit"

// ---- tool calls -----------------------------------------------------------------------------

typedef struct env_tool_call {
    const char *name; // points into the action bytes
    size_t name_len;
    const char *args; // between the parentheses, surrounding whitespace trimmed
    size_t args_len;
} env_tool_call;

// Parses `name(args)` with optional whitespace around the whole call. name is
// [A-Za-z_][A-Za-z0-9_]*, the call must end with ')'. Returns 0, or -1 when malformed.
int env_tool_parse(const char *s, size_t n, env_tool_call *out);
int env_tool_is(const env_tool_call *c, const char *name);

// Writes the standard error observations into b (cleared first):
//   "error: malformed tool call 'xy z'; expected name(args); tools: search, read"
//   "error: unknown tool 'foo'; tools: search, read"
// The quoted text is cut at 40 bytes and non-printable bytes become '?'.
void env_tool_error_malformed(env_buf *b, const char *action, size_t n, const char *tools);
void env_tool_error_unknown(env_buf *b, const env_tool_call *c, const char *tools);
// Appends s[0..n) quoted-safe (cut at max bytes, non-printables as '?').
void env_buf_append_shown(env_buf *b, const char *s, size_t n, size_t max);

// ---- small parsers --------------------------------------------------------------------------

// Strict decimal integer over s[0..n) (optional sign, digits, nothing else). Returns 0 or -1.
int env_parse_i64(const char *s, size_t n, int64_t *out);
// The splitmix64 finaliser: a cheap, good 64-bit mixer for generated documents.
uint64_t env_mix64(uint64_t x);
// Trims ASCII whitespace at both ends of s[0..*n) in place (advances *s, shrinks *n).
void env_trim(const char **s, size_t *n);

// The skeleton every built-in's step shares. It refuses a step after the episode ended and an
// unknown action kind (err set: ENV_STEP_ERR); starts the observation empty; for an ANSWER ends
// the episode (ENV_STEP_ANSWER: the caller sets the reward); for a TOOL call past max_tool_calls
// ends the episode with an error observation, and for a malformed call writes the error
// observation (both ENV_STEP_DONE: out is complete but for obs); otherwise fills c with the
// parsed call for the env to run (ENV_STEP_TOOL). `tools` is the env's tool list for messages.
typedef enum env_step_kind { ENV_STEP_ERR = -1, ENV_STEP_DONE = 0, ENV_STEP_TOOL = 1, ENV_STEP_ANSWER = 2 } env_step_kind;
env_step_kind env_step_begin(const char *env, int *done, int *tool_calls, int max_tool_calls, const char *tools,
                             uint32_t kind, const char *action, size_t len, env_buf *obs, mtrl_env_step_out *out,
                             env_tool_call *c, char *err, size_t cap);
// 1 when the answer, trimmed of surrounding whitespace, is exactly `expected`.
int env_answer_is(const char *action, size_t len, const char *expected);

// ---- partial credit ([env] credit) -----------------------------------------------------------
// The built-ins' one rule (corpus, retrieval): the right answer earns 1; a wrong one earns
// credit x got / of (of > 0; 0 when of is 0), where got of `of` parts of the task were done.
// credit is at most ENV_CREDIT_MAX < 1, so a reward of 1 (mtrl_traj_success: the learner's
// success, mtrl eval, the report) is still the right answer alone; credit = 0 gives 1 or 0.
#define ENV_CREDIT_MAX 0.9
double env_credit_reward(int right, double credit, long got, long of);
// The digits of `expected` that the answer (trimmed) has in place, when it has expected's shape:
// the same length, the same bytes where expected has a non-digit (the 'v' of v930511) and a
// digit where it has one. Anything else is malformed: -1.
int env_digits_in_place(const char *action, size_t len, const char *expected);
// Ends a step: out->obs points at obs (cut to max_obs bytes when max_obs > 0).
void env_step_end(env_buf *obs, size_t max_obs, mtrl_env_step_out *out);
// The demo() of an env whose reference solution is one tool call (call; NULL: none) and the
// answer: the actions written into demo[2] (the env's, so they outlive the call as the ABI
// asks), out pointing at them. An env between episodes (done) has none: MTRL_ENV_ERR with a
// message naming env.
int env_demo_call_answer(const char *env, int done, mtrl_env_action demo[2], const char *call, const char *answer,
                         mtrl_env_demo_out *out, char *err, size_t cap);

#endif
