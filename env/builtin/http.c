// http.c: the built-in `http` env: answer a question from pages behind an HTTP base URL, with
// a tool get(path) that performs a guarded GET through libcurl.
//
// The server at base_url publishes an index (index_path, default /index.txt) of tasks, one per
// line, "<path> <key>" (blank lines and lines starting with '#' are skipped), and pages of
// "key=value" lines. reset(seed) fetches the index, picks a task uniformly by seed, fetches
// its page and reads the expected value (so the answer is whatever the server serves now);
// a failure there is an env error and aborts the episode.
//     prompt:  "What is the value of capital in /facts/3? Tool: get(path) fetches a page of the
//               server.\n"
//     get(/facts/3)  -> the page body (at most max_bytes), or "error: ..." (HTTP status, refused
//                       address, timeout, over the size cap)
//     answer:  the value exactly ("paris"; surrounding whitespace ignored) -> reward 1, else 0.
// demo: get(<path>) then the answer. A tool call past max_tool_calls ends the episode with 0.
//
// Every request (the env's own and the model's) goes through env_http_fetch: a fresh easy
// handle per call; only http and https, also on redirects (CURLOPT_PROTOCOLS_STR /
// CURLOPT_REDIR_PROTOCOLS_STR, libcurl >= 7.85); at most max_redirects redirects; connect and
// total timeouts; CURLOPT_NOSIGNAL (no SIGALRM in a host process); no proxy, whatever the
// environment says (a proxy would hide the real target address); the body cap counted in the
// write callback on decoded bytes (CURLOPT_MAXFILESIZE does not stop unknown-length bodies in
// libcurl < 8.4, and counting decoded bytes also stops compression bombs); and the address
// policy (env_http_addr_allowed) applied after DNS and before connect in
// CURLOPT_OPENSOCKETFUNCTION, so no packet reaches a refused address, and again on every
// connection in CURLOPT_PREREQFUNCTION. Checking the URL string instead would miss "0x7f.1"
// spellings, DNS names that resolve inward and DNS rebinding.
// Config: base_url (required), index_path (/index.txt), allow_loopback=0|1 (0),
//         connect_timeout_ms=1..60000 (2000), timeout_ms=1..600000 (5000),
//         max_bytes=16..67108864 (65536), max_redirects=0..10 (3), max_tool_calls=0..1000 (8).
//         Keys of other built-ins are ignored (env_util.h).
// Without an asynchronous resolver in libcurl, name resolution cannot time out (NOSIGNAL);
// this is logged once. Run the env isolated (env_host.h) to bound it from outside.
#include <arpa/inet.h>
#include <curl/curl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>

#include "common/check.h"
#include "common/log.h"
#include "common/rng.h"
#include "env/builtin/builtin.h"
#include "env/env_util.h"

#define HTTP_TOOLS "get"

// ---- the address policy ---------------------------------------------------------------------

static void why_(char *why, size_t cap, const char *addr, const char *what) {
    if (why && cap) snprintf(why, cap, "%s is %s", addr, what);
}

// IPv4 in host byte order. Returns 1 allowed, 0 refused.
static int v4_allowed_(uint32_t a, int allow_loopback, const char *shown, char *why, size_t cap) {
    uint32_t b0 = a >> 24, b1 = (a >> 16) & 0xff;
    if (b0 == 0) return why_(why, cap, shown, "an unspecified/this-network address (0.0.0.0/8)"), 0;
    if (b0 == 127) {
        if (allow_loopback) return 1;
        return why_(why, cap, shown, "a loopback address (set allow_loopback=1 to allow it)"), 0;
    }
    if (b0 == 10 || (b0 == 172 && (b1 & 0xf0) == 16) || (b0 == 192 && b1 == 168))
        return why_(why, cap, shown, "a private (RFC 1918) address"), 0;
    if (b0 == 100 && (b1 & 0xc0) == 64) return why_(why, cap, shown, "a shared (CGNAT, 100.64.0.0/10) address"), 0;
    if (b0 == 169 && b1 == 254)
        return why_(why, cap, shown, "a link-local address (169.254.0.0/16, cloud metadata lives here)"), 0;
    if ((b0 & 0xf0) == 224) return why_(why, cap, shown, "a multicast address"), 0;
    if ((b0 & 0xf0) == 240) return why_(why, cap, shown, "a reserved or broadcast address (240.0.0.0/4)"), 0;
    return 1;
}

int env_http_addr_allowed(const struct sockaddr *sa, socklen_t len, int allow_loopback, char *why, size_t cap) {
    char shown[INET6_ADDRSTRLEN + 2] = "?";
    if (sa->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        const struct sockaddr_in *s4 = (const struct sockaddr_in *)sa;
        inet_ntop(AF_INET, &s4->sin_addr, shown, sizeof shown);
        return v4_allowed_(ntohl(s4->sin_addr.s_addr), allow_loopback, shown, why, cap);
    }
    if (sa->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        const struct sockaddr_in6 *s6 = (const struct sockaddr_in6 *)sa;
        const uint8_t *b = s6->sin6_addr.s6_addr;
        inet_ntop(AF_INET6, &s6->sin6_addr, shown, sizeof shown);
        static const uint8_t zero10[10] = {0};
        int first80_zero = !memcmp(b, zero10, 10);
        if (first80_zero && b[10] == 0xff && b[11] == 0xff)
            return why_(why, cap, shown, "a v4-mapped IPv6 address (connect over IPv4 instead)"), 0;
        if (IN6_IS_ADDR_UNSPECIFIED(&s6->sin6_addr)) return why_(why, cap, shown, "the unspecified address"), 0;
        if (IN6_IS_ADDR_LOOPBACK(&s6->sin6_addr)) {
            if (allow_loopback) return 1;
            return why_(why, cap, shown, "a loopback address (set allow_loopback=1 to allow it)"), 0;
        }
        if (first80_zero && b[10] == 0 && b[11] == 0)
            return why_(why, cap, shown, "a v4-compatible IPv6 address (deprecated)"), 0;
        if ((b[0] & 0xfe) == 0xfc) return why_(why, cap, shown, "a unique-local address (fc00::/7)"), 0;
        if (b[0] == 0xfe && (b[1] & 0xc0) == 0x80) return why_(why, cap, shown, "a link-local address (fe80::/10)"), 0;
        if (b[0] == 0xfe && (b[1] & 0xc0) == 0xc0) return why_(why, cap, shown, "a site-local address (fec0::/10)"), 0;
        if (b[0] == 0xff) return why_(why, cap, shown, "a multicast address (ff00::/8)"), 0;
        // Prefixes that embed an IPv4 address (NAT64 64:ff9b::/96, 6to4 2002::/16) reach that
        // IPv4 host, so they get its verdict; loopback is never allowed through them.
        static const uint8_t nat64[12] = {0, 0x64, 0xff, 0x9b, 0, 0, 0, 0, 0, 0, 0, 0};
        uint32_t v4;
        if (!memcmp(b, nat64, 12)) {
            v4 = (uint32_t)b[12] << 24 | (uint32_t)b[13] << 16 | (uint32_t)b[14] << 8 | b[15];
            return v4_allowed_(v4, 0, shown, why, cap);
        }
        if (b[0] == 0x20 && b[1] == 0x02) {
            v4 = (uint32_t)b[2] << 24 | (uint32_t)b[3] << 16 | (uint32_t)b[4] << 8 | b[5];
            return v4_allowed_(v4, 0, shown, why, cap);
        }
        return 1;
    }
    if (why && cap) snprintf(why, cap, "address family %d is not IPv4 or IPv6", (int)sa->sa_family);
    return 0;
}

// ---- one guarded GET ------------------------------------------------------------------------

typedef struct fetch_ctx {
    env_buf body;
    size_t cap;
    int over_cap;
    int refused;
    int allow_loopback;
    char why[256];
} fetch_ctx;

static size_t fetch_write_(char *ptr, size_t size, size_t nmemb, void *ud) {
    fetch_ctx *c = ud;
    size_t n = size * nmemb;
    if (n > c->cap - c->body.len) {
        // Keep what fits, then abort: returning less than n makes libcurl stop with
        // CURLE_WRITE_ERROR before it reads more from the socket.
        env_buf_append(&c->body, ptr, c->cap - c->body.len);
        c->over_cap = 1;
        return 0;
    }
    env_buf_append(&c->body, ptr, n);
    return n;
}

static curl_socket_t fetch_opensocket_(void *ud, curlsocktype purpose, struct curl_sockaddr *a) {
    fetch_ctx *c = ud;
    if (purpose != CURLSOCKTYPE_IPCXN) {
        snprintf(c->why, sizeof c->why, "only plain outgoing connections are allowed");
        c->refused = 1;
        return CURL_SOCKET_BAD;
    }
    if (!env_http_addr_allowed(&a->addr, a->addrlen, c->allow_loopback, c->why, sizeof c->why)) {
        c->refused = 1;
        return CURL_SOCKET_BAD;
    }
    return socket(a->family, a->socktype | SOCK_CLOEXEC, a->protocol);
}

// Re-checks the address of every connection that is about to carry a request (redirects,
// reused connections): belt and braces over the open-socket check.
static int fetch_prereq_(void *ud, char *primary_ip, char *local_ip, int primary_port, int local_port) {
    (void)local_ip, (void)primary_port, (void)local_port;
    fetch_ctx *c = ud;
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;
    struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&ss;
    socklen_t len;
    if (inet_pton(AF_INET, primary_ip, &s4->sin_addr) == 1) {
        s4->sin_family = AF_INET;
        len = sizeof *s4;
    } else if (inet_pton(AF_INET6, primary_ip, &s6->sin6_addr) == 1) {
        s6->sin6_family = AF_INET6;
        len = sizeof *s6;
    } else {
        snprintf(c->why, sizeof c->why, "connected address '%s' could not be checked", primary_ip);
        c->refused = 1;
        return CURL_PREREQFUNC_ABORT;
    }
    if (!env_http_addr_allowed((struct sockaddr *)&ss, len, c->allow_loopback, c->why, sizeof c->why)) {
        c->refused = 1;
        return CURL_PREREQFUNC_ABORT;
    }
    return CURL_PREREQFUNC_OK;
}

static pthread_once_t curl_once_ = PTHREAD_ONCE_INIT;
static int curl_init_ok_;

static void curl_init_once_(void) {
    curl_init_ok_ = curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK;
    curl_version_info_data *v = curl_version_info(CURLVERSION_NOW);
    if (v && !(v->features & CURL_VERSION_ASYNCHDNS))
        LOG_WARN("http env: libcurl %s has no asynchronous resolver, so DNS lookups cannot time out; "
                 "run the env isolated", v->version);
}

int env_http_fetch(const env_http_opts *o, const char *url, env_http_result *r) {
    memset(r, 0, sizeof *r);
    pthread_once(&curl_once_, curl_init_once_);
    if (!curl_init_ok_) {
        snprintf(r->error, sizeof r->error, "libcurl could not be initialised");
        return -1;
    }
    CURL *h = curl_easy_init();
    if (!h) {
        snprintf(r->error, sizeof r->error, "libcurl could not make a handle");
        return -1;
    }
    fetch_ctx c = {.cap = o->max_bytes, .allow_loopback = o->allow_loopback};
    char errbuf[CURL_ERROR_SIZE] = "";
    CURLcode rc = CURLE_OK;
#define SETOPT_(opt, val) \
    if (rc == CURLE_OK) rc = curl_easy_setopt(h, opt, val)
    SETOPT_(CURLOPT_URL, url);
    SETOPT_(CURLOPT_PROTOCOLS_STR, "http,https");
    SETOPT_(CURLOPT_REDIR_PROTOCOLS_STR, "http,https");
    SETOPT_(CURLOPT_FOLLOWLOCATION, 1L);
    SETOPT_(CURLOPT_MAXREDIRS, o->max_redirects);
    SETOPT_(CURLOPT_NOSIGNAL, 1L);
    SETOPT_(CURLOPT_CONNECTTIMEOUT_MS, o->connect_timeout_ms);
    SETOPT_(CURLOPT_TIMEOUT_MS, o->timeout_ms);
    SETOPT_(CURLOPT_PROXY, "");
    SETOPT_(CURLOPT_ACCEPT_ENCODING, "");
    SETOPT_(CURLOPT_USERAGENT, "mtrl-env-http/1");
    SETOPT_(CURLOPT_ERRORBUFFER, errbuf);
    SETOPT_(CURLOPT_WRITEFUNCTION, fetch_write_);
    SETOPT_(CURLOPT_WRITEDATA, &c);
    SETOPT_(CURLOPT_OPENSOCKETFUNCTION, fetch_opensocket_);
    SETOPT_(CURLOPT_OPENSOCKETDATA, &c);
    SETOPT_(CURLOPT_PREREQFUNCTION, fetch_prereq_);
    SETOPT_(CURLOPT_PREREQDATA, &c);
#undef SETOPT_
    if (rc != CURLE_OK) {
        snprintf(r->error, sizeof r->error, "libcurl refused an option: %s", curl_easy_strerror(rc));
        curl_easy_cleanup(h);
        env_buf_free(&c.body);
        return -1;
    }
    rc = curl_easy_perform(h);
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &r->status);
    curl_easy_cleanup(h);
    env_buf_append(&c.body, "", 0); // a NUL-terminated body even when empty
    r->body = c.body.data;
    r->body_len = c.body.len;
    if (rc == CURLE_OK) return 0;
    if (c.over_cap) {
        r->over_cap = 1;
        snprintf(r->error, sizeof r->error, "response larger than %zu bytes; aborted at the cap", o->max_bytes);
    } else if (c.refused) {
        r->refused = 1;
        snprintf(r->error, sizeof r->error, "refused: %s", c.why);
    } else if (rc == CURLE_OPERATION_TIMEDOUT) {
        r->timed_out = 1;
        snprintf(r->error, sizeof r->error, "timed out (connect limit %ld ms, total limit %ld ms): %s",
                 o->connect_timeout_ms, o->timeout_ms, errbuf[0] ? errbuf : curl_easy_strerror(rc));
    } else if (rc == CURLE_UNSUPPORTED_PROTOCOL) {
        snprintf(r->error, sizeof r->error, "protocol not allowed (only http and https): %s",
                 errbuf[0] ? errbuf : curl_easy_strerror(rc));
    } else {
        snprintf(r->error, sizeof r->error, "%s", errbuf[0] ? errbuf : curl_easy_strerror(rc));
    }
    return -1;
}

void env_http_result_free(env_http_result *r) {
    free(r->body);
    r->body = NULL;
    r->body_len = 0;
}

// ---- the env --------------------------------------------------------------------------------

typedef struct http_env {
    env_http_opts o;
    char *base_url; // without a trailing '/'
    char *index_path;
    int max_tool_calls;
    char path[520], key[128], value[256];
    char prompt[1024], demo_call[530];
    mtrl_env_action demo[2];
    env_buf obs;
    int tool_calls, done;
} http_env;

static int http_create_(const char *config, void **self, char *err, size_t cap) {
    env_config cfg;
    if (env_config_parse(&cfg, "http", config, err, cap)) return MTRL_ENV_ERR;
    long long cto, to, maxb, redirs, mtc;
    int loop;
    const char *base = env_config_str(&cfg, "base_url", NULL);
    const char *index = env_config_str(&cfg, "index_path", "/index.txt");
    int bad = env_config_bool(&cfg, "allow_loopback", 0, &loop, err, cap) ||
              env_config_int(&cfg, "connect_timeout_ms", 2000, 1, 60000, &cto, err, cap) ||
              env_config_int(&cfg, "timeout_ms", 5000, 1, 600000, &to, err, cap) ||
              env_config_int(&cfg, "max_bytes", 65536, 16, 64 << 20, &maxb, err, cap) ||
              env_config_int(&cfg, "max_redirects", 3, 0, 10, &redirs, err, cap) ||
              env_config_int(&cfg, "max_tool_calls", 8, 0, 1000, &mtc, err, cap) ||
              env_config_finish(&cfg,
                                "base_url, index_path, allow_loopback, connect_timeout_ms, timeout_ms, max_bytes, "
                                "max_redirects, max_tool_calls",
                                err, cap);
    if (!bad && (!base || !base[0])) {
        snprintf(err, cap, "http: config base_url is required (e.g. base_url=https://example.org/data)");
        bad = 1;
    }
    if (!bad && strncasecmp(base, "http://", 7) && strncasecmp(base, "https://", 8)) {
        snprintf(err, cap, "http: base_url '%.200s' must start with http:// or https:// (other protocols are refused)",
                 base);
        bad = 1;
    }
    if (!bad && index[0] != '/') {
        snprintf(err, cap, "http: index_path '%.200s' must start with '/'", index);
        bad = 1;
    }
    if (bad) {
        env_config_free(&cfg);
        return MTRL_ENV_ERR;
    }
    http_env *e = xcalloc(1, sizeof *e);
    e->base_url = xstrdup(base);
    size_t bl = strlen(e->base_url);
    while (bl > 0 && e->base_url[bl - 1] == '/') e->base_url[--bl] = 0;
    e->index_path = xstrdup(index);
    e->o = (env_http_opts){.connect_timeout_ms = cto, .timeout_ms = to, .max_bytes = (size_t)maxb,
                           .max_redirects = redirs, .allow_loopback = loop};
    e->max_tool_calls = (int)mtc;
    e->done = 1;
    env_config_free(&cfg);
    *self = e;
    return MTRL_ENV_OK;
}

static void http_destroy_(void *self) {
    http_env *e = self;
    if (!e) return;
    free(e->base_url);
    free(e->index_path);
    env_buf_free(&e->obs);
    free(e);
}

// The characters a get() path may hold: unreserved, '/', and query punctuation. No spaces,
// controls, '#', '\\' or '@'-tricks can then change what the URL means.
static int path_ok_(const char *p, size_t n) {
    if (n == 0 || n > 512 || p[0] != '/') return 0;
    for (size_t i = 0; i < n; i++) {
        char c = p[i];
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || strchr("-._~/?=&%+,", c);
        if (!ok || c == 0) return 0;
    }
    return 1;
}

int env_http_path_confine(const char *p, size_t n, char *out, size_t cap, char *why, size_t wcap) {
    if (n == 0 || p[0] != '/' || cap < 2) {
        snprintf(why, wcap, "the path must start with '/'");
        return -1;
    }
    const char *q = memchr(p, '?', n);
    size_t pn = q ? (size_t)(q - p) : n; // the path part; the query follows unchanged
    for (size_t i = 0; i + 2 < pn; i++) {
        if (p[i] != '%') continue;
        char h[3] = {p[i + 1], p[i + 2], 0};
        if (!strcasecmp(h, "2e") || !strcasecmp(h, "2f") || !strcasecmp(h, "5c")) {
            snprintf(why, wcap, "'%%%s' in the path: write '.' and '/' as they are", h);
            return -1;
        }
    }
    // out holds "/seg/seg..." so far; each segment is copied in or, for "..", cut back.
    size_t o = 0;
    size_t i = 1;
    int trailing = 0; // the last segment was "." or "..": the result names a folder
    while (i <= pn) {
        size_t j = i;
        while (j < pn && p[j] != '/') j++;
        const char *seg = p + i;
        size_t sl = j - i;
        trailing = 0;
        if (sl == 1 && seg[0] == '.') {
            trailing = 1;
        } else if (sl == 2 && seg[0] == '.' && seg[1] == '.') {
            if (o == 0) {
                snprintf(why, wcap, "'..' climbs above the base URL's path");
                return -1;
            }
            while (o > 0 && out[o - 1] != '/') o--;
            if (o > 0) o--; // the '/' before the removed segment
            trailing = 1;
        } else {
            if (o + 1 + sl >= cap) goto too_long;
            out[o++] = '/';
            memcpy(out + o, seg, sl);
            o += sl;
        }
        i = j + 1;
    }
    if (trailing || o == 0) {
        if (o + 1 >= cap) goto too_long;
        out[o++] = '/';
    }
    if (q) {
        size_t ql = n - pn;
        if (o + ql >= cap) goto too_long;
        memcpy(out + o, q, ql);
        o += ql;
    }
    out[o] = 0;
    return 0;
too_long:
    snprintf(why, wcap, "the path is longer than %zu bytes", cap - 1);
    return -1;
}

// GET base_url + path, the path confined under base_url's (env_http_path_confine).
static int http_get_(http_env *e, const char *path, size_t n, env_http_result *r) {
    char safe[1024], why[128];
    if (env_http_path_confine(path, n, safe, sizeof safe, why, sizeof why)) {
        memset(r, 0, sizeof *r);
        snprintf(r->error, sizeof r->error, "refused path '%.*s': %s", (int)(n > 200 ? 200 : n), path, why);
        return -1;
    }
    char url[2048];
    snprintf(url, sizeof url, "%s%s", e->base_url, safe);
    return env_http_fetch(&e->o, url, r);
}

// Finds "key=value" in a page; copies the value (trimmed) into out.
static int page_value_(const char *body, size_t n, const char *key, char *out, size_t cap) {
    size_t kl = strlen(key);
    const char *p = body, *end = body + n;
    while (p < end) {
        const char *le = memchr(p, '\n', (size_t)(end - p));
        le = le ? le : end;
        const char *l = p;
        size_t ln = (size_t)(le - p);
        env_trim(&l, &ln);
        size_t at = kl;
        while (at < ln && (l[at] == ' ' || l[at] == '\t')) at++; // "key = value" is fine too
        if (at < ln && !memcmp(l, key, kl) && l[at] == '=') {
            const char *v = l + at + 1;
            size_t vn = ln - at - 1;
            env_trim(&v, &vn);
            if (vn == 0 || vn >= cap) return -1;
            memcpy(out, v, vn);
            out[vn] = 0;
            return 0;
        }
        p = le + 1;
    }
    return -1;
}

static int http_reset_(void *self, uint64_t seed, mtrl_env_bytes *prompt, char *err, size_t cap) {
    http_env *e = self;
    e->done = 1;
    env_http_result r;
    if (http_get_(e, e->index_path, strlen(e->index_path), &r) || r.status != 200) {
        if (r.error[0]) snprintf(err, cap, "http: could not fetch the index %s%s: %s", e->base_url, e->index_path, r.error);
        else snprintf(err, cap, "http: index %s%s answered HTTP %ld", e->base_url, e->index_path, r.status);
        env_http_result_free(&r);
        return MTRL_ENV_ERR;
    }
    // Count the tasks, pick one by seed, then parse that line.
    size_t ntask = 0;
    for (int pass = 0; pass < 2; pass++) {
        size_t pick = pass ? (size_t)(mtrl_rng_uniform(seed, mtrl_rng_stream("env.http", 0, 0), 0) * (double)ntask) : 0;
        size_t k = 0;
        const char *p = r.body, *end = r.body + r.body_len;
        while (p < end) {
            const char *le = memchr(p, '\n', (size_t)(end - p));
            le = le ? le : end;
            const char *l = p;
            size_t ln = (size_t)(le - p);
            p = le + 1;
            env_trim(&l, &ln);
            if (ln == 0 || l[0] == '#') continue;
            if (pass == 1 && k == pick) {
                const char *sp = memchr(l, ' ', ln);
                const char *key = sp ? sp + 1 : NULL;
                size_t pl = sp ? (size_t)(sp - l) : ln, kl = sp ? ln - pl - 1 : 0;
                if (key) env_trim(&key, &kl);
                if (!key || kl == 0 || kl >= sizeof e->key || !path_ok_(l, pl)) {
                    snprintf(err, cap, "http: index line '%.*s' is not '<path> <key>'", (int)(ln > 100 ? 100 : ln), l);
                    env_http_result_free(&r);
                    return MTRL_ENV_ERR;
                }
                memcpy(e->path, l, pl);
                e->path[pl] = 0;
                memcpy(e->key, key, kl);
                e->key[kl] = 0;
                break;
            }
            k++;
        }
        if (pass == 0) ntask = k;
        if (ntask == 0) {
            snprintf(err, cap, "http: the index %s%s lists no tasks; expected lines '<path> <key>'", e->base_url,
                     e->index_path);
            env_http_result_free(&r);
            return MTRL_ENV_ERR;
        }
    }
    env_http_result_free(&r);
    if (http_get_(e, e->path, strlen(e->path), &r) || r.status != 200) {
        if (r.error[0]) snprintf(err, cap, "http: could not fetch %s%s: %s", e->base_url, e->path, r.error);
        else snprintf(err, cap, "http: %s%s answered HTTP %ld", e->base_url, e->path, r.status);
        env_http_result_free(&r);
        return MTRL_ENV_ERR;
    }
    int found = page_value_(r.body, r.body_len, e->key, e->value, sizeof e->value);
    env_http_result_free(&r);
    if (found) {
        snprintf(err, cap, "http: page %s%s has no line '%s=<value>' (named by the index)", e->base_url, e->path,
                 e->key);
        return MTRL_ENV_ERR;
    }
    snprintf(e->prompt, sizeof e->prompt,
             "What is the value of %s in %s? Tool: get(path) fetches a page of the server.\n", e->key, e->path);
    snprintf(e->demo_call, sizeof e->demo_call, "get(%s)", e->path);
    e->tool_calls = 0;
    e->done = 0;
    prompt->data = e->prompt;
    prompt->len = strlen(e->prompt);
    return MTRL_ENV_OK;
}

static int http_step_(void *self, uint32_t kind, const char *action, size_t len, mtrl_env_step_out *out,
                      char *err, size_t cap) {
    http_env *e = self;
    env_tool_call c;
    env_step_kind k = env_step_begin("http", &e->done, &e->tool_calls, e->max_tool_calls, HTTP_TOOLS, kind, action, len,
                                     &e->obs, out, &c, err, cap);
    if (k == ENV_STEP_ERR) return MTRL_ENV_ERR;
    if (k == ENV_STEP_ANSWER) {
        out->reward = env_answer_is(action, len, e->value) ? 1.0 : 0.0;
    } else if (k == ENV_STEP_TOOL) {
        if (!env_tool_is(&c, "get")) {
            env_tool_error_unknown(&e->obs, &c, HTTP_TOOLS);
            out->tool_error = 1;
        } else if (!path_ok_(c.args, c.args_len)) {
            env_buf_puts(&e->obs, "error: get needs a path that starts with '/' and holds only letters, digits "
                                  "and -._~/?=&%+, e.g. get(/index.txt)");
            out->tool_error = 1;
        } else {
            env_http_result r;
            if (http_get_(e, c.args, c.args_len, &r)) {
                env_buf_printf(&e->obs, "error: %s", r.error);
                out->tool_error = 1;
            } else if (r.status < 200 || r.status > 299) {
                env_buf_printf(&e->obs, "error: HTTP %ld for ", r.status);
                env_buf_append(&e->obs, c.args, c.args_len);
                out->tool_error = 1;
            } else {
                env_buf_append(&e->obs, r.body, r.body_len);
            }
            env_http_result_free(&r);
        }
    }
    env_step_end(&e->obs, 0, out);
    return MTRL_ENV_OK;
}

static int http_demo_(void *self, mtrl_env_demo_out *out, char *err, size_t cap) {
    http_env *e = self;
    return env_demo_call_answer("http", e->done, e->demo, e->demo_call, e->value, out, err, cap);
}

static int http_describe_(void *self, mtrl_env_bytes *out, char *err, size_t cap) {
    (void)self, (void)err, (void)cap;
    static const char text[] = "get(path): the body of the server's page at path (e.g. get(/index.txt))\n";
    out->data = text;
    out->len = sizeof text - 1;
    return MTRL_ENV_OK;
}

const mtrl_env_api env_http_api = {
    .abi_version = MTRL_ENV_ABI_VERSION,
    .struct_size = sizeof(mtrl_env_api),
    .name = "http",
    .version = "1",
    .flags = MTRL_ENV_FLAG_THREAD_SAFE,
    .create = http_create_,
    .destroy = http_destroy_,
    .reset = http_reset_,
    .step = http_step_,
    .demo = http_demo_,
    .describe = http_describe_,
};
