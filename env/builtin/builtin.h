// builtin.h: the built-in environments' tables and the pieces their tests call directly
// (internal to env/). Each built-in implements the same ABI as a plug-in (mtrl_env.h), so the
// host treats them alike, in-process or isolated.
//
//   retrieval  key=value document, tools search(text) and read(offset,length)  (retrieval.c)
//   calc       arithmetic problems, tool calc(expr)                              (calc.c)
//   http       values behind an HTTP base URL, tool get(path) through libcurl   (http.c)
//   picture    a digit to read out of a generated picture, tool crop(k)         (picture.c)
//   corpus     generated log files, tools list, open(id,offset), grep: many-turn  (corpus.c)
#ifndef MTRL_ENV_BUILTIN_H
#define MTRL_ENV_BUILTIN_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "env/mtrl_env.h"

extern const mtrl_env_api env_retrieval_api;
extern const mtrl_env_api env_calc_api;
extern const mtrl_env_api env_http_api;
extern const mtrl_env_api env_picture_api;
extern const mtrl_env_api env_corpus_api;

// ---- picture --------------------------------------------------------------------------------

// Draws one 6 x 6 box holding digit (0..9) in colour at rgb (stride_px pixels a row): the
// picture env's renderer, for its tests.
void env_picture_draw(uint8_t *rgb, uint32_t stride_px, int digit, const uint8_t colour[3]);

// ---- calc -----------------------------------------------------------------------------------

// Evaluates an integer expression over s[0..n): decimal literals, + - * /, unary minus,
// parentheses, spaces. Division truncates toward zero. Returns 0 and sets *out, or -1 and
// writes a message such as "division by zero", "unexpected 'x' at position 3",
// "overflow (result beyond 64-bit integers)" into err.
int env_calc_eval(const char *s, size_t n, int64_t *out, char *err, size_t cap);

// ---- http -----------------------------------------------------------------------------------

// The address policy checked at connect time (CURLOPT_OPENSOCKETFUNCTION). Returns 1 when a
// connection to sa is allowed; 0 otherwise with the reason in why ("10.1.2.3 is a private
// (RFC 1918) address"). Refused: unspecified/0.0.0.0/8, loopback (127/8, ::1) unless
// allow_loopback, RFC 1918, 100.64/10 (CGNAT), 169.254/16 and fe80::/10 (link-local, cloud
// metadata), 224/4 and ff00::/8 (multicast), 240/4 and broadcast, fc00::/7 (unique local),
// v4-mapped/compatible IPv6 (::ffff:a.b.c.d: checked as its IPv4 address would be, but
// refused even then, so a v4 rule cannot be dodged through v6), and any non-IP family.
int env_http_addr_allowed(const struct sockaddr *sa, socklen_t len, int allow_loopback, char *why, size_t cap);

typedef struct env_http_opts {
    long connect_timeout_ms;
    long timeout_ms;   // total, including the body
    size_t max_bytes;  // response body cap (decoded bytes), enforced while receiving
    long max_redirects;
    int allow_loopback;
} env_http_opts;

typedef struct env_http_result {
    long status;      // HTTP status, 0 when no response
    char *body;       // malloc'd, NUL-terminated, up to max_bytes; caller frees
    size_t body_len;
    int over_cap;     // the transfer was aborted because the body passed max_bytes
    int refused;      // the address policy refused a connection (no packet sent)
    int timed_out;
    char error[512];  // set when the fetch failed
} env_http_result;

// One GET of url with the policy above. Returns 0 on a completed transfer (any HTTP status),
// -1 when it failed (result->error says why). Only http and https, on every redirect too.
int env_http_fetch(const env_http_opts *o, const char *url, env_http_result *r);

// A get() path p[0..n) made safe to append to base_url: it must start with '/'; "." segments
// are dropped and ".." removes the segment before it, so the result names the same page the
// server would, written out; a ".." that would climb above base_url's own path is refused
// (curl and servers both resolve dot segments, so "/../x" under base_url ".../data" would
// otherwise fetch ".../x"). A percent escape of '.', '/' or '\\' (%2e, %2f, %5c, any case) in
// the path is refused too: servers decode it before resolving, so it could climb just the
// same. The query (from '?') is kept as it is. Returns 0 with the path in out (NUL-terminated,
// at most cap - 1 bytes), or -1 with the reason in why.
int env_http_path_confine(const char *p, size_t n, char *out, size_t cap, char *why, size_t wcap);
void env_http_result_free(env_http_result *r);

#endif
