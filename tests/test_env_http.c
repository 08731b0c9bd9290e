// mtrl-test: cpu fault timeout=60
// test_env_http.c: the http env and its guarded fetch, against a small HTTP server written
// here (a thread listening on 127.0.0.1, ephemeral port). No traffic goes anywhere else: the
// address policy is tested by calling the policy function directly.
// - A GET works with allow_loopback=1; without it the same GET is refused before connect (the
//   server sees no connection) with a clear message.
// - A body over max_bytes is aborted at the cap; a stalled server hits the total timeout.
// - file:// and gopher:// base URLs are refused; so is a redirect to file://; redirect loops
//   stop at max_redirects.
// - The policy refuses 169.254.169.254, 10.1.2.3, 192.168.0.1, 100.64.0.1, 0.0.0.0, 224.0.0.1,
//   ::1, fe80::1, fc00::1, ::ffff:127.0.0.1 (and loopback unless allowed) and accepts public
//   addresses.
// - Whole episodes of the http env (demo reaches reward 1; wrong answer 0; HTTP errors, bad
//   paths and unknown tools are error observations), in-process and isolated.
// - get() stays under base_url's path (issue 28, item 10): with base_url .../data,
//   get(/../private/secret.txt), get(/facts/../../private/secret.txt) and %2e%2e spellings are
//   refused as error observations and the server never sees a request outside /data; dot
//   segments that stay inside are resolved (get(/x/../facts/1) fetches /data/facts/1).
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/timeutil.h"
#include "env/builtin/builtin.h"
#include "env/env_host.h"
#include "tests/testhelp.h"

// ---- the test server ------------------------------------------------------------------------

static int srv_fd = -1;
static int srv_port;
static atomic_int srv_conns;   // connections accepted
static atomic_int srv_stop;
static atomic_long srv_big_sent; // bytes of /big the server managed to send
static atomic_int srv_outside;   // requests for anything outside /data while base_url is .../data
static atomic_int srv_data_mode; // 1: the env's base_url is .../data

static void send_all(int fd, const void *p, size_t n) {
    const char *c = p;
    while (n > 0) {
        ssize_t w = send(fd, c, n, MSG_NOSIGNAL);
        if (w <= 0) return;
        c += w;
        n -= (size_t)w;
    }
}

static void respond(int fd, int code, const char *extra_headers, const char *body) {
    char head[512];
    int n = snprintf(head, sizeof head, "HTTP/1.1 %d X\r\nContent-Length: %zu\r\nConnection: close\r\n%s\r\n", code,
                     strlen(body), extra_headers ? extra_headers : "");
    send_all(fd, head, (size_t)n);
    send_all(fd, body, strlen(body));
}

// Waits until the client closes (or 5 s, or the test stops the server).
static void wait_client_gone(int fd) {
    double until = mtrl_time_mono() + 5.0;
    char buf[256];
    while (!atomic_load(&srv_stop) && mtrl_time_mono() < until) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 50) > 0 && recv(fd, buf, sizeof buf, 0) <= 0) return;
    }
}

static void serve_conn(int fd) {
    char req[8192];
    size_t n = 0;
    double until = mtrl_time_mono() + 2.0;
    while (n < sizeof req - 1 && mtrl_time_mono() < until) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 50) <= 0) continue;
        ssize_t r = recv(fd, req + n, sizeof req - 1 - n, 0);
        if (r <= 0) return;
        n += (size_t)r;
        req[n] = 0;
        if (strstr(req, "\r\n\r\n")) break;
    }
    char path[256] = "";
    if (sscanf(req, "GET %255s HTTP/1.", path) != 1) return;
    if (atomic_load(&srv_data_mode) && strncmp(path, "/data/", 6)) atomic_fetch_add(&srv_outside, 1);
    if (!strcmp(path, "/data/index.txt")) {
        respond(fd, 200, NULL, "/facts/1 capital\n");
    } else if (!strcmp(path, "/data/facts/1")) {
        respond(fd, 200, NULL, "capital=paris\n");
    } else if (!strcmp(path, "/private/secret.txt")) {
        respond(fd, 200, NULL, "secret=hunter2\n");
    } else if (!strcmp(path, "/index.txt")) {
        respond(fd, 200, NULL, "# path key\n/facts/1 capital\n\n/facts/2 color\n");
    } else if (!strcmp(path, "/facts/1")) {
        respond(fd, 200, NULL, "capital=paris\ncolor=blue\n");
    } else if (!strcmp(path, "/facts/2")) {
        respond(fd, 200, NULL, "name=two\ncolor = green\n");
    } else if (!strcmp(path, "/big")) {
        // No Content-Length: the client cannot know the size in advance.
        const char *head = "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n";
        send_all(fd, head, strlen(head));
        char chunk[4096];
        memset(chunk, 'x', sizeof chunk);
        for (int i = 0; i < 8192; i++) { // 32 MiB, more than loopback socket buffers hold
            ssize_t w = send(fd, chunk, sizeof chunk, MSG_NOSIGNAL);
            if (w <= 0) break;
            atomic_fetch_add(&srv_big_sent, (long)w);
        }
    } else if (!strcmp(path, "/stall")) {
        const char *head = "HTTP/1.1 200 OK\r\nContent-Length: 100\r\nConnection: close\r\n\r\n0123456789";
        send_all(fd, head, strlen(head));
        wait_client_gone(fd);
    } else if (!strcmp(path, "/to-file")) {
        respond(fd, 302, "Location: file:///etc/passwd\r\n", "");
    } else if (!strcmp(path, "/to-mapped")) {
        char loc[128];
        snprintf(loc, sizeof loc, "Location: http://[::ffff:127.0.0.1]:%d/facts/1\r\n", srv_port);
        respond(fd, 302, loc, "");
    } else if (!strcmp(path, "/loop")) {
        respond(fd, 302, "Location: /loop\r\n", "");
    } else {
        respond(fd, 404, NULL, "not found\n");
    }
}

static void *server_main(void *arg) {
    (void)arg;
    while (!atomic_load(&srv_stop)) {
        struct pollfd p = {.fd = srv_fd, .events = POLLIN};
        if (poll(&p, 1, 50) <= 0) continue;
        int c = accept(srv_fd, NULL, NULL);
        if (c < 0) continue;
        atomic_fetch_add(&srv_conns, 1);
        serve_conn(c);
        close(c);
    }
    return NULL;
}

static int server_start(pthread_t *t) {
    srv_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t al = sizeof a;
    if (srv_fd < 0 || bind(srv_fd, (struct sockaddr *)&a, sizeof a) || listen(srv_fd, 16) ||
        getsockname(srv_fd, (struct sockaddr *)&a, &al))
        return -1;
    srv_port = ntohs(a.sin_port);
    return pthread_create(t, NULL, server_main, NULL);
}

// ---- helpers --------------------------------------------------------------------------------

static env_http_opts opts(int allow_loopback) {
    return (env_http_opts){.connect_timeout_ms = 1000, .timeout_ms = 2000, .max_bytes = 65536, .max_redirects = 3,
                           .allow_loopback = allow_loopback};
}

static void url_of(char *buf, size_t cap, const char *path) {
    snprintf(buf, cap, "http://127.0.0.1:%d%s", srv_port, path);
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static int allowed(const char *ip, int allow_loopback, char *why, size_t cap) {
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;
    struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&ss;
    if (inet_pton(AF_INET, ip, &s4->sin_addr) == 1) {
        s4->sin_family = AF_INET;
        return env_http_addr_allowed((struct sockaddr *)s4, sizeof *s4, allow_loopback, why, cap);
    }
    if (inet_pton(AF_INET6, ip, &s6->sin6_addr) == 1) {
        s6->sin6_family = AF_INET6;
        return env_http_addr_allowed((struct sockaddr *)s6, sizeof *s6, allow_loopback, why, cap);
    }
    TEST_CHECKF(0, "bad test address %s", ip);
    return -1;
}

// ---- tests ----------------------------------------------------------------------------------

static void test_policy(void) {
    struct { const char *ip; const char *why; } refused[] = {
        {"169.254.169.254", "link-local"}, {"10.1.2.3", "private (RFC 1918)"}, {"192.168.0.1", "private"},
        {"172.16.5.4", "private"}, {"172.31.255.255", "private"}, {"100.64.0.1", "CGNAT"},
        {"0.0.0.0", "unspecified"}, {"0.1.2.3", "unspecified"}, {"224.0.0.1", "multicast"},
        {"239.255.255.250", "multicast"}, {"255.255.255.255", "broadcast"}, {"127.0.0.1", "loopback"},
        {"127.8.9.10", "loopback"}, {"::1", "loopback"}, {"::", "unspecified"}, {"fe80::1", "link-local"},
        {"fc00::1", "unique-local"}, {"fd12:3456::1", "unique-local"}, {"ff02::1", "multicast"},
        {"::ffff:127.0.0.1", "v4-mapped"}, {"::ffff:8.8.8.8", "v4-mapped"}, {"::127.0.0.1", "v4-compatible"},
        {"64:ff9b::a01:203", "private"}, {"2002:a9fe:a9fe::1", "link-local"},
    };
    char why[256];
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        why[0] = 0;
        TEST_CHECKF(allowed(refused[i].ip, 0, why, sizeof why) == 0, "%s should be refused", refused[i].ip);
        TEST_CONTAINS(why, refused[i].why);
        TEST_CONTAINS(why, refused[i].ip);
    }
    allowed("169.254.169.254", 0, why, sizeof why);
    printf("policy: %s\n", why);
    // Loopback only when allowed, and never through v4-mapped or embedded forms.
    TEST_EQ_INT(allowed("127.0.0.1", 1, why, sizeof why), 1);
    TEST_EQ_INT(allowed("::1", 1, why, sizeof why), 1);
    TEST_EQ_INT(allowed("::ffff:127.0.0.1", 1, why, sizeof why), 0);
    TEST_EQ_INT(allowed("64:ff9b::7f00:1", 1, why, sizeof why), 0);
    TEST_EQ_INT(allowed("10.1.2.3", 1, why, sizeof why), 0);
    // Public addresses pass.
    const char *ok[] = {"93.184.216.34", "8.8.8.8", "1.1.1.1", "172.32.0.1", "100.128.0.1", "2606:4700:4700::1111",
                        "2001:4860:4860::8888", "64:ff9b::808:808"};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++)
        TEST_CHECKF(allowed(ok[i], 0, why, sizeof why) == 1, "%s should pass: %s", ok[i], why);
    // Non-IP families are refused.
    struct sockaddr sa = {.sa_family = AF_UNIX};
    TEST_EQ_INT(env_http_addr_allowed(&sa, sizeof sa, 1, why, sizeof why), 0);
}

static void test_fetch(void) {
    char url[256];
    env_http_result r;
    env_http_opts o = opts(1);

    // A normal GET with loopback allowed.
    url_of(url, sizeof url, "/facts/1");
    TEST_CHECKF(env_http_fetch(&o, url, &r) == 0, "%s", r.error);
    TEST_EQ_INT(r.status, 200);
    TEST_EQ_STR(r.body, "capital=paris\ncolor=blue\n");
    env_http_result_free(&r);

    // The same GET without allow_loopback: refused before connect; the server sees nothing.
    sleep_ms(30);
    int before = atomic_load(&srv_conns);
    o = opts(0);
    TEST_EQ_INT(env_http_fetch(&o, url, &r), -1);
    TEST_EQ_INT(r.refused, 1);
    TEST_EQ_INT(r.status, 0);
    TEST_CONTAINS(r.error, "refused: 127.0.0.1 is a loopback address (set allow_loopback=1 to allow it)");
    printf("refused: %s\n", r.error);
    env_http_result_free(&r);
    // Other spellings of loopback are refused too: the check runs on the resolved address.
    const char *spellings[][2] = {{"http://0x7f.1:%d/facts/1", "127.0.0.1 is a loopback address"},
                                  {"http://2130706433:%d/facts/1", "127.0.0.1 is a loopback address"},
                                  {"http://localhost:%d/facts/1", "is a loopback address"},
                                  {"http://[::1]:%d/facts/1", "::1 is a loopback address"},
                                  {"http://[::ffff:127.0.0.1]:%d/facts/1", "is a v4-mapped IPv6 address"}};
    for (size_t i = 0; i < sizeof spellings / sizeof spellings[0]; i++) {
        snprintf(url, sizeof url, spellings[i][0], srv_port);
        TEST_EQ_INT(env_http_fetch(&o, url, &r), -1);
        TEST_CHECKF(r.refused == 1, "%s: %s", url, r.error);
        TEST_CONTAINS(r.error, spellings[i][1]);
        env_http_result_free(&r);
    }
    sleep_ms(100);
    TEST_EQ_INT(atomic_load(&srv_conns), before);

    // Over the size cap: aborted at the cap, on an unknown-length body.
    o = opts(1);
    o.max_bytes = 4096;
    url_of(url, sizeof url, "/big");
    TEST_EQ_INT(env_http_fetch(&o, url, &r), -1);
    TEST_EQ_INT(r.over_cap, 1);
    TEST_EQ_INT(r.body_len, 4096);
    TEST_CONTAINS(r.error, "response larger than 4096 bytes; aborted at the cap");
    env_http_result_free(&r);
    sleep_ms(100);
    // The client hung up mid-body: the server could not push all 32 MiB into the connection.
    printf("over cap: server got %ld of 33554432 bytes out before the client hung up\n", atomic_load(&srv_big_sent));
    TEST_CHECKF(atomic_load(&srv_big_sent) < 33554432, "the whole body went out: %ld", atomic_load(&srv_big_sent));

    // A stalling server hits the total timeout.
    o = opts(1);
    o.timeout_ms = 300;
    url_of(url, sizeof url, "/stall");
    double t0 = mtrl_time_mono();
    TEST_EQ_INT(env_http_fetch(&o, url, &r), -1);
    double dt = mtrl_time_mono() - t0;
    TEST_EQ_INT(r.timed_out, 1);
    TEST_CONTAINS(r.error, "timed out");
    TEST_CHECKF(dt >= 0.25 && dt < 1.5, "stall ended after %.3f s", dt);
    printf("stall: %s (%.0f ms)\n", r.error, dt * 1e3);
    env_http_result_free(&r);

    // Other protocols: refused by libcurl's protocol list, without a connection.
    sleep_ms(30);
    before = atomic_load(&srv_conns);
    o = opts(1);
    TEST_EQ_INT(env_http_fetch(&o, "file:///etc/passwd", &r), -1);
    TEST_CONTAINS(r.error, "protocol not allowed (only http and https)");
    TEST_CHECK(r.body_len == 0);
    env_http_result_free(&r);
    snprintf(url, sizeof url, "gopher://127.0.0.1:%d/1", srv_port);
    TEST_EQ_INT(env_http_fetch(&o, url, &r), -1);
    TEST_CONTAINS(r.error, "protocol not allowed");
    env_http_result_free(&r);
    sleep_ms(100);
    TEST_EQ_INT(atomic_load(&srv_conns), before);

    // A redirect to file:// is refused; a redirect loop stops at max_redirects.
    url_of(url, sizeof url, "/to-file");
    TEST_EQ_INT(env_http_fetch(&o, url, &r), -1);
    TEST_CONTAINS(r.error, "protocol not allowed");
    TEST_CHECK(strstr(r.body, "root:") == NULL);
    env_http_result_free(&r);
    before = atomic_load(&srv_conns);
    url_of(url, sizeof url, "/loop");
    TEST_EQ_INT(env_http_fetch(&o, url, &r), -1);
    TEST_CONTAINS(r.error, "redirect");
    env_http_result_free(&r);
    sleep_ms(50);
    TEST_EQ_INT(atomic_load(&srv_conns) - before, 4); // the first request and 3 redirects
}

static void run_env(int isolate) {
    mtrl_env_opts eo;
    mtrl_env_opts_default(&eo);
    eo.isolate = isolate;
    char config[512];
    snprintf(config, sizeof config, "base_url=http://127.0.0.1:%d/;allow_loopback=1;timeout_ms=2000;max_bytes=1024;max_tool_calls=10",
             srv_port);
    mtrl_env *e = NULL;
    mtrl_error err = {0};
    TEST_CHECKF(mtrl_env_open(&e, "http", config, &eo, &err) == MTRL_OK, "%s", err.msg);
    if (!e) return;
    int seen[2] = {0, 0};
    for (uint64_t seed = 0; seed < 8; seed++) {
        mtrl_env_result r;
        TEST_CHECKF(mtrl_env_reset(e, seed, &r, &err) == MTRL_OK, "reset: %s", err.msg);
        char prompt[256];
        snprintf(prompt, sizeof prompt, "%.*s", (int)r.obs_len, r.obs);
        if (seed == 0 && !isolate) printf("http prompt: %s", prompt);
        TEST_CONTAINS(prompt, "Tool: get(path)");
        int two = strstr(prompt, "/facts/2") != NULL;
        seen[two] = 1;
        TEST_CONTAINS(prompt, two ? "What is the value of color in /facts/2?" : "What is the value of capital in /facts/1?");
        mtrl_env_demo_out d;
        TEST_CHECK(mtrl_env_demo(e, &d, &err) == MTRL_OK);
        TEST_EQ_INT(d.count, 2);
        if (d.count != 2) continue;
        char call[64], ans[64];
        snprintf(call, sizeof call, "%.*s", (int)d.actions[0].len, d.actions[0].data);
        snprintf(ans, sizeof ans, "%.*s", (int)d.actions[1].len, d.actions[1].data);
        TEST_EQ_STR(call, two ? "get(/facts/2)" : "get(/facts/1)");
        TEST_EQ_STR(ans, two ? "green" : "paris");
        TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_TOOL, call, strlen(call), &r, &err) == MTRL_OK);
        TEST_CONTAINS(r.obs, ans);
        TEST_EQ_INT(r.tool_error, 0);
        TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_TOOL, "get(/nope)", 10, &r, &err) == MTRL_OK);
        TEST_CONTAINS(r.obs, "error: HTTP 404 for /nope");
        TEST_EQ_INT(r.tool_error, 1);
        TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_TOOL, "get(http://evil/)", 17, &r, &err) == MTRL_OK);
        TEST_CONTAINS(r.obs, "error: get needs a path that starts with '/'");
        TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_TOOL, "get(/big)", 9, &r, &err) == MTRL_OK);
        TEST_CONTAINS(r.obs, "error: response larger than 1024 bytes; aborted at the cap");
        // A redirect to a refused address: checked again at connect, reported to the model.
        TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_TOOL, "get(/to-mapped)", 15, &r, &err) == MTRL_OK);
        TEST_CONTAINS(r.obs, "error: refused: ::ffff:127.0.0.1 is a v4-mapped IPv6 address");
        TEST_EQ_INT(r.tool_error, 1);
        TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_TOOL, "post(/x)", 8, &r, &err) == MTRL_OK);
        TEST_CONTAINS(r.obs, "error: unknown tool 'post'; tools: get");
        if (seed == 0 && !isolate) printf("http observation: %.*s\n", (int)r.obs_len, r.obs);
        TEST_EQ_INT(r.done, 0);
        if (seed % 2) {
            TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_ANSWER, ans, strlen(ans), &r, &err) == MTRL_OK);
            TEST_EQ_INT(r.reward * 1000, 1000);
        } else {
            TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_ANSWER, "berlin", 6, &r, &err) == MTRL_OK);
            TEST_EQ_INT(r.reward * 1000, 0);
        }
        TEST_EQ_INT(r.done, 1);
    }
    TEST_CHECK(seen[0] && seen[1]); // both tasks of the index get picked
    mtrl_env_close(e);

    // Without allow_loopback the env cannot even fetch its index: reset fails, saying why.
    snprintf(config, sizeof config, "base_url=http://127.0.0.1:%d", srv_port);
    TEST_CHECK(mtrl_env_open(&e, "http", config, &eo, &err) == MTRL_OK);
    if (e) {
        mtrl_env_result r;
        TEST_EQ_INT(mtrl_env_reset(e, 0, &r, &err), MTRL_ERR_PLUGIN);
        TEST_CONTAINS(err.msg, "refused: 127.0.0.1 is a loopback address (set allow_loopback=1 to allow it)");
        mtrl_env_close(e);
    }
}

// env_http_path_confine on its own: what it resolves, what it refuses.
static void test_confine(void) {
    static const struct { const char *in, *out; } ok[] = {
        {"/facts/1", "/facts/1"}, {"/", "/"}, {"/a/", "/a/"}, {"/a/./b", "/a/b"}, {"/a/../b", "/b"},
        {"/a/b/..", "/a/"}, {"/a/.", "/a/"}, {"/a/..", "/"}, {"/x/../facts/1?q=../..", "/facts/1?q=../.."},
        {"/a%20b", "/a%20b"}, {"/..a/b..", "/..a/b.."},
    };
    static const char *bad[] = {"/..", "/../private/secret.txt", "/facts/../../private/secret.txt", "/./../x",
                                "/%2e%2e/private/secret.txt", "/%2E%2E/x", "/a%2f..%2f..%2fx", "/a%5c..", "facts/1", ""};
    char out[256], why[128];
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        int rc = env_http_path_confine(ok[i].in, strlen(ok[i].in), out, sizeof out, why, sizeof why);
        TEST_CHECKF(rc == 0 && !strcmp(out, ok[i].out), "%s -> rc %d '%s', want '%s'", ok[i].in, rc, rc ? why : out,
                    ok[i].out);
    }
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = env_http_path_confine(bad[i], strlen(bad[i]), out, sizeof out, why, sizeof why);
        TEST_CHECKF(rc == -1, "%s should be refused, got '%s'", bad[i], out);
    }
    TEST_EQ_INT(env_http_path_confine("/a/b", 4, out, 4, why, sizeof why), -1); // does not fit
    TEST_CONTAINS(why, "longer than 3 bytes");
}

// A whole episode with base_url .../data: a path that climbs out is refused before any request.
static void run_env_confined(int isolate) {
    mtrl_env_opts eo;
    mtrl_env_opts_default(&eo);
    eo.isolate = isolate;
    char config[512];
    snprintf(config, sizeof config, "base_url=http://127.0.0.1:%d/data/;allow_loopback=1;max_tool_calls=10", srv_port);
    mtrl_env *e = NULL;
    mtrl_error err = {0};
    TEST_CHECKF(mtrl_env_open(&e, "http", config, &eo, &err) == MTRL_OK, "%s", err.msg);
    if (!e) return;
    atomic_store(&srv_outside, 0);
    atomic_store(&srv_data_mode, 1);
    mtrl_env_result r;
    TEST_CHECKF(mtrl_env_reset(e, 0, &r, &err) == MTRL_OK, "reset: %s", err.msg);
    static const char *escapes[] = {"get(/../private/secret.txt)", "get(/facts/../../private/secret.txt)",
                                    "get(/%2e%2e/private/secret.txt)", "get(/..)"};
    for (size_t i = 0; i < sizeof escapes / sizeof escapes[0]; i++) {
        TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_TOOL, escapes[i], strlen(escapes[i]), &r, &err) == MTRL_OK);
        char obs[512];
        snprintf(obs, sizeof obs, "%.*s", (int)r.obs_len, r.obs);
        if (i == 0 && !isolate) printf("confined: %s -> %s\n", escapes[i], obs);
        TEST_CONTAINS(obs, "error: refused path");
        TEST_CHECKF(!strstr(obs, "hunter2"), "%s leaked the page outside base_url: %s", escapes[i], obs);
        TEST_EQ_INT(r.tool_error, 1);
    }
    const char *inside = "get(/x/../facts/1)";
    TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_TOOL, inside, strlen(inside), &r, &err) == MTRL_OK);
    TEST_CONTAINS(r.obs, "capital=paris");
    TEST_EQ_INT(r.tool_error, 0);
    TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_ANSWER, "paris", 5, &r, &err) == MTRL_OK);
    TEST_EQ_INT(r.reward * 1000, 1000);
    sleep_ms(50);
    TEST_EQ_INT(atomic_load(&srv_outside), 0); // no request ever left /data
    atomic_store(&srv_data_mode, 0);
    mtrl_env_close(e);
}

static void test_config(void) {
    mtrl_env *e = NULL;
    mtrl_error err = {0};
    TEST_EQ_INT(mtrl_env_open(&e, "http", "base_url=file:///etc/passwd", NULL, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "base_url 'file:///etc/passwd' must start with http:// or https://");
    TEST_EQ_INT(mtrl_env_open(&e, "http", "base_url=gopher://127.0.0.1:70/", NULL, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "must start with http:// or https://");
    TEST_EQ_INT(mtrl_env_open(&e, "http", "", NULL, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "base_url is required");
    TEST_EQ_INT(mtrl_env_open(&e, "http", "base_url=http://x;max_bytes=1", NULL, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "max_bytes=1 out of range");
}

int main(int argc, char **argv) {
    mtrl_env_host_main(argc, argv); // the isolated envs below start this program as their child
    pthread_t t;
    if (server_start(&t) != 0) {
        TEST_CHECKF(0, "could not start the test server: %s", strerror(errno));
        return test_report();
    }
    test_policy();
    test_config();
    test_fetch();
    run_env(0);
    run_env(1);
    test_confine();
    run_env_confined(0);
    run_env_confined(1);
    atomic_store(&srv_stop, 1);
    pthread_join(t, NULL);
    close(srv_fd);
    return test_report();
}
