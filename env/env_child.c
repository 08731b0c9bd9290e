// env_child.c: the isolated env's side: framing I/O and the serve loop (see env_wire.h).
//
// This code runs in a fresh process image (the host re-executed /proc/self/exe), so it may
// use everything: malloc, stdio, dlopen, libcurl. It owns one env instance, loads the
// plug-in itself (a plug-in's constructors and crashes stay in this process), answers the
// host's requests in order, and exits on CLOSE or when the host's end of the socket closes.
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/check.h"
#include "common/log.h"
#include "common/status.h"
#include "common/timeutil.h"
#include "env/env_loader.h"
#include "env/env_util.h"
#include "env/env_wire.h"

// ---- framing I/O ----------------------------------------------------------------------------

static int wait_fd_(int fd, short events, double deadline) {
    for (;;) {
        int ms = -1;
        if (deadline >= 0) {
            double left = deadline - mtrl_time_mono();
            if (left <= 0) return ENV_IO_TIMEOUT;
            ms = (int)(left * 1000.0) + 1;
        }
        struct pollfd p = {.fd = fd, .events = events};
        int r = poll(&p, 1, ms);
        if (r > 0) return ENV_IO_OK; // readable/writable, or HUP/ERR: the next call reports it
        if (r == 0) {
            if (deadline >= 0 && mtrl_time_mono() >= deadline) return ENV_IO_TIMEOUT;
            continue;
        }
        if (errno != EINTR) return ENV_IO_ERR;
    }
}

int env_wire_write(int fd, const void *p, size_t n, double deadline) {
    const char *c = p;
    while (n > 0) {
        ssize_t w = send(fd, c, n, MSG_NOSIGNAL | (deadline >= 0 ? MSG_DONTWAIT : 0));
        if (w > 0) {
            c += w;
            n -= (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int r = wait_fd_(fd, POLLOUT, deadline);
            if (r) return r;
            continue;
        }
        if (w < 0 && (errno == EPIPE || errno == ECONNRESET)) return ENV_IO_EOF;
        return ENV_IO_ERR;
    }
    return ENV_IO_OK;
}

int env_wire_read(int fd, void *p, size_t n, double deadline) {
    char *c = p;
    while (n > 0) {
        ssize_t r = recv(fd, c, n, deadline >= 0 ? MSG_DONTWAIT : 0);
        if (r > 0) {
            c += r;
            n -= (size_t)r;
            continue;
        }
        if (r == 0) return ENV_IO_EOF;
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int w = wait_fd_(fd, POLLIN, deadline);
            if (w) return w;
            continue;
        }
        if (errno == ECONNRESET) return ENV_IO_EOF;
        return ENV_IO_ERR;
    }
    return ENV_IO_OK;
}

// ---- the serve loop -------------------------------------------------------------------------

typedef struct env_child {
    int fd;
    env_loaded lib;
    void *self;
    env_buf out; // reply payload
    char err[MTRL_ERROR_MSG_MAX];
} env_child;

static int reply_(env_child *c, int32_t status, int32_t done, int32_t tool_error, double reward, const void *data,
                  size_t len) {
    env_wire_rep h = {.magic = ENV_WIRE_MAGIC, .status = status, .done = done, .tool_error = tool_error,
                      .reward = reward, .len = len};
    if (env_wire_write(c->fd, &h, sizeof h, -1)) return -1;
    if (len && env_wire_write(c->fd, data, len, -1)) return -1;
    return 0;
}

static int reply_err_(env_child *c, int32_t status, const char *msg) {
    return reply_(c, status, 0, 0, 0.0, msg, strlen(msg));
}

// The env's message, or a stand-in when it returned an error without one.
static const char *env_err_(env_child *c) { return c->err[0] ? c->err : "(the env gave no message)"; }

static int serve_open_(env_child *c, const char *payload, size_t len) {
    // payload: "name\0config\0"
    const char *name = payload;
    size_t nl = strnlen(payload, len);
    if (nl + 1 >= len || payload[len - 1] != 0) return reply_err_(c, MTRL_ERR_PEER, "malformed OPEN request");
    const char *config = payload + nl + 1;
    mtrl_error e;
    mtrl_error_clear(&e);
    if (c->self || c->lib.where) return reply_err_(c, MTRL_ERR_STATE, "env already open in this env host");
    mtrl_status st = env_loader_open(&c->lib, name, &e);
    if (st != MTRL_OK) return reply_err_(c, st, e.msg);
    c->err[0] = 0;
    if (c->lib.api.create(config, &c->self, c->err, sizeof c->err) != MTRL_ENV_OK) {
        char msg[MTRL_ERROR_MSG_MAX + 64];
        snprintf(msg, sizeof msg, "env '%s' refused its config: %s", c->lib.api.name, env_err_(c));
        c->self = NULL;
        return reply_err_(c, MTRL_ERR_USAGE, msg);
    }
    uint32_t caps = (c->lib.api.demo ? ENV_CAP_DEMO : 0) | (c->lib.api.describe ? ENV_CAP_DESCRIBE : 0) |
                    (c->lib.api.image ? ENV_CAP_IMAGE : 0);
    env_buf_clear(&c->out);
    env_buf_append(&c->out, &caps, sizeof caps);
    env_buf_append(&c->out, c->lib.api.name, strlen(c->lib.api.name) + 1);
    env_buf_append(&c->out, c->lib.api.version, strlen(c->lib.api.version) + 1);
    return reply_(c, 0, 0, 0, 0.0, c->out.data, c->out.len);
}

static int serve_one_(env_child *c, const env_wire_req *q, const char *payload) {
    if (q->op == ENV_OP_OPEN) return serve_open_(c, payload, q->len);
    if (!c->self) return reply_err_(c, MTRL_ERR_STATE, "env host has no env open");
    const mtrl_env_api *api = &c->lib.api;
    c->err[0] = 0;
    switch (q->op) {
    case ENV_OP_RESET: {
        mtrl_env_bytes p = {0};
        if (api->reset(c->self, q->seed, &p, c->err, sizeof c->err) != MTRL_ENV_OK)
            return reply_err_(c, MTRL_ERR_PLUGIN, env_err_(c));
        if (!p.data && p.len) return reply_err_(c, MTRL_ERR_PLUGIN, "reset returned a NULL prompt with a length");
        return reply_(c, 0, 0, 0, 0.0, p.data, p.len);
    }
    case ENV_OP_STEP: {
        mtrl_env_step_out o;
        memset(&o, 0, sizeof o);
        if (api->step(c->self, q->kind, payload, q->len, &o, c->err, sizeof c->err) != MTRL_ENV_OK)
            return reply_err_(c, MTRL_ERR_PLUGIN, env_err_(c));
        if (!o.obs.data && o.obs.len) return reply_err_(c, MTRL_ERR_PLUGIN, "step returned a NULL observation with a length");
        return reply_(c, 0, o.done ? 1 : 0, o.tool_error ? 1 : 0, o.reward, o.obs.data, o.obs.len);
    }
    case ENV_OP_DEMO: {
        if (!api->demo) return reply_err_(c, MTRL_ERR_NOTFOUND, "this env has no demo");
        mtrl_env_demo_out d = {0};
        if (api->demo(c->self, &d, c->err, sizeof c->err) != MTRL_ENV_OK)
            return reply_err_(c, MTRL_ERR_PLUGIN, env_err_(c));
        if (d.count && !d.actions) return reply_err_(c, MTRL_ERR_PLUGIN, "demo returned NULL actions with a count");
        env_buf_clear(&c->out);
        uint32_t n = (uint32_t)d.count;
        env_buf_append(&c->out, &n, sizeof n);
        for (size_t i = 0; i < d.count; i++) {
            uint32_t k = d.actions[i].kind;
            uint64_t l = d.actions[i].len;
            if (!d.actions[i].data && l) return reply_err_(c, MTRL_ERR_PLUGIN, "demo action with NULL bytes");
            env_buf_append(&c->out, &k, sizeof k);
            env_buf_append(&c->out, &l, sizeof l);
            env_buf_append(&c->out, d.actions[i].data, (size_t)l);
        }
        return reply_(c, 0, 0, 0, 0.0, c->out.data, c->out.len);
    }
    case ENV_OP_DESCRIBE: {
        if (!api->describe) return reply_err_(c, MTRL_ERR_NOTFOUND, "this env has no describe");
        mtrl_env_bytes t = {0};
        if (api->describe(c->self, &t, c->err, sizeof c->err) != MTRL_ENV_OK)
            return reply_err_(c, MTRL_ERR_PLUGIN, env_err_(c));
        return reply_(c, 0, 0, 0, 0.0, t.data, t.data ? t.len : 0);
    }
    case ENV_OP_IMAGE: {
        if (!api->image) return reply_err_(c, MTRL_ERR_NOTFOUND, "this env has no image");
        mtrl_env_image im;
        memset(&im, 0, sizeof im);
        if (api->image(c->self, &im, c->err, sizeof c->err) != MTRL_ENV_OK)
            return reply_err_(c, MTRL_ERR_PLUGIN, env_err_(c));
        if (im.width == 0 && im.height == 0 && im.len == 0) return reply_(c, 0, 0, 0, 0.0, NULL, 0);
        // The sizes travel as the env claimed them, with the bytes it really has (none for NULL
        // data); the host checks one against the other, with the same messages as in-process.
        env_buf_clear(&c->out);
        env_buf_append(&c->out, &im.width, sizeof im.width);
        env_buf_append(&c->out, &im.height, sizeof im.height);
        if (im.data) env_buf_append(&c->out, im.data, im.len);
        return reply_(c, 0, 0, 0, 0.0, c->out.data, c->out.len);
    }
    default:
        return reply_err_(c, MTRL_ERR_PEER, "unknown request");
    }
}

int env_child_serve(int fd) {
    // The host writes with MSG_NOSIGNAL; so do we, but a plug-in's own sockets should not kill
    // the child silently either: a write to a closed socket returns EPIPE.
    signal(SIGPIPE, SIG_IGN);
    mtrl_log_set_tag("env-host");
    env_child c = {.fd = fd};
    env_buf in = {0};
    int status = 0;
    for (;;) {
        env_wire_req q;
        int r = env_wire_read(fd, &q, sizeof q, -1);
        if (r == ENV_IO_EOF) break; // the host closed its end: nothing left to serve
        if (r != ENV_IO_OK || q.magic != ENV_WIRE_MAGIC || q.len > ENV_WIRE_MAX_REQUEST) {
            status = 3;
            break;
        }
        env_buf_clear(&in);
        env_buf_reserve(&in, (size_t)q.len);
        if (q.len && env_wire_read(fd, in.data, (size_t)q.len, -1) != ENV_IO_OK) {
            status = 3;
            break;
        }
        in.len = (size_t)q.len;
        in.data[in.len] = 0;
        if (q.op == ENV_OP_CLOSE) {
            if (c.self) c.lib.api.destroy(c.self);
            c.self = NULL;
            reply_(&c, 0, 0, 0, 0.0, NULL, 0);
            break;
        }
        if (serve_one_(&c, &q, in.data)) {
            status = 3;
            break;
        }
    }
    if (c.self) c.lib.api.destroy(c.self);
    // No dlclose: the process is about to end, and a plug-in's destructors are its own business.
    env_buf_free(&in);
    env_buf_free(&c.out);
    return status;
}
