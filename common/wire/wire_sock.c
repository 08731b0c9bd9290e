// wire_sock.c: ROUTER/DEALER helpers over libzmq (see wire.h, part 2).
//
// Options: ROUTER_MANDATORY so a send to a vanished actor
// fails instead of being dropped silently, ROUTER_HANDOVER so a restarted actor reusing an id is
// accepted, MAXMSGSIZE so one oversized frame disconnects its peer before it is buffered,
// bounded LINGER so zmq_ctx_term cannot hang, ZMTP heartbeats for dead-peer detection, and a
// fresh ROUTING_ID per actor incarnation. CURVE options are set here too, before bind/connect;
// keys, allow-lists and the ZAP handler live in wire_auth.c.
#include "common/wire/wire.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zmq.h>

#include "common/check.h"
#include "common/hash.h"
#include "common/timeutil.h"

mtrl_wire_sockopts mtrl_wire_sockopts_default(void) {
    mtrl_wire_sockopts o;
    memset(&o, 0, sizeof o); // CURVE off
    o.linger_ms = 500;
    o.send_timeout_ms = 5000;
    o.heartbeat_ivl_ms = 1000;
    o.heartbeat_timeout_ms = 5000;
    o.reconnect_ivl_ms = 100;
    o.reconnect_ivl_max_ms = 32000;
    return o;
}

static mtrl_status zerr_(mtrl_error *err, mtrl_status code, const char *what) {
    return mtrl_error_set(err, code, "zmq: %s: %s", what, zmq_strerror(zmq_errno()));
}

#define SETOPT_(s, opt, val, err)                                                    \
    do {                                                                             \
        __typeof__(val) v_ = (val);                                                  \
        if (zmq_setsockopt((s)->sock, (opt), &v_, sizeof v_) != 0) {                 \
            mtrl_status st_ = zerr_((err), MTRL_ERR_IO, "setsockopt " #opt);         \
            mtrl_wire_sock_close(s);                                                 \
            return st_;                                                              \
        }                                                                            \
    } while (0)

static void sock_clear_(mtrl_wire_sock *s) {
    memset(s, 0, sizeof *s);
}

static mtrl_status sock_new_(mtrl_wire_sock *s, void *ctx, int type, const mtrl_wire_limits *lim, mtrl_error *err) {
    sock_clear_(s);
    s->ctx = ctx;
    s->lim = lim ? *lim : mtrl_wire_limits_default();
    s->sock = zmq_socket(ctx, type);
    if (!s->sock) return zerr_(err, MTRL_ERR_IO, "cannot create a socket");
    for (int i = 0; i < 3; i++) {
        s->in[i] = xmalloc(sizeof(zmq_msg_t));
        zmq_msg_init((zmq_msg_t *)s->in[i]);
    }
    return MTRL_OK;
}

static mtrl_status common_opts_(mtrl_wire_sock *s, const mtrl_wire_sockopts *o, mtrl_error *err) {
    SETOPT_(s, ZMQ_LINGER, (int)o->linger_ms, err);
    SETOPT_(s, ZMQ_SNDTIMEO, (int)o->send_timeout_ms, err);
    // Per frame; the header frame is tiny, so this is the payload cap (plus the identity).
    SETOPT_(s, ZMQ_MAXMSGSIZE, (int64_t)s->lim.max_payload, err);
    if (o->heartbeat_ivl_ms > 0) {
        SETOPT_(s, ZMQ_HEARTBEAT_IVL, (int)o->heartbeat_ivl_ms, err);
        SETOPT_(s, ZMQ_HEARTBEAT_TIMEOUT, (int)o->heartbeat_timeout_ms, err);
        // TTL travels in deciseconds and caps at 6553.5 s.
        int ttl = o->heartbeat_timeout_ms > 655350 ? 655350 : o->heartbeat_timeout_ms;
        SETOPT_(s, ZMQ_HEARTBEAT_TTL, ttl, err);
    }
    return MTRL_OK;
}

// ZMQ_ZAP_ENFORCE_DOMAIN is still a draft option in libzmq 4.3 (zmq.h declares it only under
// ZMQ_BUILD_DRAFT_API); Debian's libzmq5 is built with the drafts and accepts it.
#ifndef ZMQ_ZAP_ENFORCE_DOMAIN
#define ZMQ_ZAP_ENFORCE_DOMAIN 93
#endif

static int key_is_zero_(const uint8_t k[32]) {
    uint8_t acc = 0;
    for (int i = 0; i < 32; i++) acc |= k[i];
    return acc == 0;
}

// 1 when something is bound at the ZAP endpoint of ctx. Binding a probe is the only way to ask
// libzmq: it fails with EADDRINUSE when a handler holds the endpoint. The probe gives the
// endpoint back at once (zmq_unbind of an inproc endpoint is synchronous).
static int zap_handler_present_(void *ctx) {
    void *probe = zmq_socket(ctx, ZMQ_PAIR);
    if (!probe) return 0;
    int present = 0;
    if (zmq_bind(probe, "inproc://zeromq.zap.01") == 0) zmq_unbind(probe, "inproc://zeromq.zap.01");
    else present = zmq_errno() == EADDRINUSE;
    int zero = 0;
    zmq_setsockopt(probe, ZMQ_LINGER, &zero, sizeof zero);
    zmq_close(probe);
    return present;
}

#define SETKEY_(s, opt, key, err)                                                    \
    do {                                                                             \
        if (zmq_setsockopt((s)->sock, (opt), (key), 32) != 0) {                      \
            mtrl_status st_ = zerr_((err), MTRL_ERR_IO, "setsockopt " #opt);         \
            mtrl_wire_sock_close(s);                                                 \
            return st_;                                                              \
        }                                                                            \
    } while (0)

// Server side of CURVE, before the bind (options set after a bind apply to later connections
// only, and a connection accepted in between would be plain text).
static mtrl_status curve_server_opts_(mtrl_wire_sock *s, const mtrl_wire_sockopts *o, mtrl_error *err) {
    mtrl_status st = MTRL_OK;
    if (!zmq_has("curve"))
        st = mtrl_error_set(err, MTRL_ERR_USAGE, "zmq: this libzmq has no CURVE support (built without libsodium)");
    else if (key_is_zero_(o->curve_secret_key))
        st = mtrl_error_set(err, MTRL_ERR_USAGE, "wire: CURVE server without a secret key");
    else if (!zap_handler_present_(s->ctx))
        st = mtrl_error_set(err, MTRL_ERR_STATE,
                            "wire: refusing a CURVE server with no ZAP handler in its zmq context: any client knowing "
                            "the server's public key would be let in; start one first (mtrl_wire_auth_server_init)");
    if (st) {
        mtrl_wire_sock_close(s);
        return st;
    }
    if (zmq_setsockopt(s->sock, ZMQ_ZAP_DOMAIN, MTRL_WIRE_ZAP_DOMAIN, strlen(MTRL_WIRE_ZAP_DOMAIN)) != 0) {
        st = zerr_(err, MTRL_ERR_IO, "setsockopt ZMQ_ZAP_DOMAIN");
        mtrl_wire_sock_close(s);
        return st;
    }
    // Without it a handler that went away would again mean "let everyone in" (src/curve_server.cpp).
    int one = 1;
    if (zmq_setsockopt(s->sock, ZMQ_ZAP_ENFORCE_DOMAIN, &one, sizeof one) != 0) {
        st = mtrl_error_set(err, MTRL_ERR_USAGE,
                            "zmq: this libzmq does not support ZMQ_ZAP_ENFORCE_DOMAIN (built without the draft API): %s; "
                            "refusing CURVE, since a missing ZAP handler would then admit any client",
                            zmq_strerror(zmq_errno()));
        mtrl_wire_sock_close(s);
        return st;
    }
    SETOPT_(s, ZMQ_CURVE_SERVER, 1, err);
    SETKEY_(s, ZMQ_CURVE_SECRETKEY, o->curve_secret_key, err);
    return MTRL_OK;
}

// Client side of CURVE, before the connect.
static mtrl_status curve_client_opts_(mtrl_wire_sock *s, const mtrl_wire_sockopts *o, mtrl_error *err) {
    mtrl_status st = MTRL_OK;
    if (!zmq_has("curve"))
        st = mtrl_error_set(err, MTRL_ERR_USAGE, "zmq: this libzmq has no CURVE support (built without libsodium)");
    else if (key_is_zero_(o->curve_server_key) || key_is_zero_(o->curve_public_key) ||
             key_is_zero_(o->curve_secret_key))
        st = mtrl_error_set(err, MTRL_ERR_USAGE, "wire: CURVE client needs the server's public key and its own keypair");
    if (st) {
        mtrl_wire_sock_close(s);
        return st;
    }
    SETKEY_(s, ZMQ_CURVE_SERVERKEY, o->curve_server_key, err);
    SETKEY_(s, ZMQ_CURVE_PUBLICKEY, o->curve_public_key, err);
    SETKEY_(s, ZMQ_CURVE_SECRETKEY, o->curve_secret_key, err);
    return MTRL_OK;
}

static void last_endpoint_(mtrl_wire_sock *s) {
    size_t n = sizeof s->endpoint;
    if (zmq_getsockopt(s->sock, ZMQ_LAST_ENDPOINT, s->endpoint, &n) != 0) s->endpoint[0] = '\0';
    s->endpoint[sizeof s->endpoint - 1] = '\0';
}

mtrl_status mtrl_wire_router_open(mtrl_wire_sock *s, void *zmq_ctx, const char *endpoint,
                                  const mtrl_wire_limits *lim, const mtrl_wire_sockopts *opts, mtrl_error *err) {
    mtrl_wire_sockopts o = opts ? *opts : mtrl_wire_sockopts_default();
    mtrl_status st = sock_new_(s, zmq_ctx, ZMQ_ROUTER, lim, err);
    if (st) return st;
    s->router = 1;
    SETOPT_(s, ZMQ_ROUTER_MANDATORY, 1, err);
    SETOPT_(s, ZMQ_ROUTER_HANDOVER, 1, err);
    st = common_opts_(s, &o, err);
    if (st) return st;
    if (o.curve_server) {
        st = curve_server_opts_(s, &o, err);
        if (st) return st;
    }
    if (zmq_bind(s->sock, endpoint) != 0) {
        st = mtrl_error_set(err, MTRL_ERR_IO, "zmq: cannot bind %s: %s", endpoint, zmq_strerror(zmq_errno()));
        mtrl_wire_sock_close(s);
        return st;
    }
    last_endpoint_(s);
    return MTRL_OK;
}

mtrl_status mtrl_wire_dealer_open(mtrl_wire_sock *s, void *zmq_ctx, const char *endpoint, uint32_t actor_id,
                                  uint32_t incarnation, const mtrl_wire_limits *lim, const mtrl_wire_sockopts *opts,
                                  mtrl_error *err) {
    mtrl_wire_sockopts o = opts ? *opts : mtrl_wire_sockopts_default();
    mtrl_status st = sock_new_(s, zmq_ctx, ZMQ_DEALER, lim, err);
    if (st) return st;
    // A fresh id per incarnation: the ROUTER never confuses a restarted actor with its
    // predecessor's half-closed connection. The random part guards against a reused
    // incarnation number (a supervisor that forgot to bump it).
    static unsigned counter;
    uint64_t salt[3] = {(uint64_t)getpid(), (uint64_t)(mtrl_time_wall() * 1e9), (uint64_t)++counter};
    uint32_t rnd = (uint32_t)mtrl_hash64(salt, sizeof salt, actor_id);
    int n = snprintf((char *)s->self_id.id, sizeof s->self_id.id, "a%u.i%u.%08x", actor_id, incarnation, rnd);
    s->self_id.len = (size_t)n;
    if (zmq_setsockopt(s->sock, ZMQ_ROUTING_ID, s->self_id.id, s->self_id.len) != 0) {
        st = zerr_(err, MTRL_ERR_IO, "setsockopt ZMQ_ROUTING_ID");
        mtrl_wire_sock_close(s);
        return st;
    }
    SETOPT_(s, ZMQ_RECONNECT_IVL, (int)o.reconnect_ivl_ms, err);
    SETOPT_(s, ZMQ_RECONNECT_IVL_MAX, (int)o.reconnect_ivl_max_ms, err);
    st = common_opts_(s, &o, err);
    if (st) return st;
    if (o.curve_client) {
        st = curve_client_opts_(s, &o, err);
        if (st) return st;
    }
    if (zmq_connect(s->sock, endpoint) != 0) {
        st = mtrl_error_set(err, MTRL_ERR_IO, "zmq: cannot connect to %s: %s", endpoint, zmq_strerror(zmq_errno()));
        mtrl_wire_sock_close(s);
        return st;
    }
    snprintf(s->endpoint, sizeof s->endpoint, "%s", endpoint);
    return MTRL_OK;
}

void mtrl_wire_sock_close(mtrl_wire_sock *s) {
    if (!s) return;
    for (int i = 0; i < 3; i++) {
        if (!s->in[i]) continue;
        zmq_msg_close((zmq_msg_t *)s->in[i]);
        free(s->in[i]);
    }
    if (s->sock) zmq_close(s->sock);
    sock_clear_(s);
}

static mtrl_status send_err_(mtrl_error *err, int first) {
    int e = zmq_errno();
    if (e == EHOSTUNREACH)
        return mtrl_error_set(err, MTRL_ERR_PEER, "zmq: the peer is unknown or gone (ROUTER_MANDATORY)");
    if (e == EAGAIN)
        return mtrl_error_set(err, MTRL_ERR_TIMEOUT, "zmq: send %s: the peer is not taking messages (queue full)",
                              first ? "refused" : "stalled mid-message");
    return mtrl_error_set(err, MTRL_ERR_IO, "zmq: send failed: %s", zmq_strerror(e));
}

static mtrl_status send_frame_(mtrl_wire_sock *s, const void *p, size_t n, int more, int first, mtrl_error *err) {
    for (;;) {
        if (zmq_send(s->sock, p, n, more ? ZMQ_SNDMORE : 0) >= 0) return MTRL_OK;
        if (zmq_errno() != EINTR) return send_err_(err, first);
    }
}

// The identity frame (ROUTER) and the header; then the payload goes as a copy (data, n) or, with
// ffn, borrowed: ZeroMQ calls ffn(data, hint) when done with it, also when the send fails.
static mtrl_status send_(mtrl_wire_sock *s, const mtrl_wire_peer *peer, const uint8_t *hdr, void *data, size_t n,
                         void (*ffn)(void *, void *), void *hint, mtrl_error *err) {
    mtrl_status st = MTRL_OK;
    if (!s->sock) st = mtrl_error_set(err, MTRL_ERR_STATE, "wire: socket is not open");
    else if (s->router && (!peer || peer->len == 0)) st = mtrl_error_set(err, MTRL_ERR_STATE, "wire: ROUTER send needs a peer");
    if (!st && s->router) st = send_frame_(s, peer->id, peer->len, 1, 1, err);
    if (!st) st = send_frame_(s, hdr, MTRL_WIRE_HDR_SIZE, n > 0, !s->router, err);
    if (st || n == 0 || !ffn) {
        if (!st && n > 0) st = send_frame_(s, data, n, 0, 0, err);
        if (ffn) ffn(data, hint);
        return st;
    }
    zmq_msg_t m;
    if (zmq_msg_init_data(&m, data, n, ffn, hint) != 0) {
        ffn(data, hint);
        return mtrl_error_set(err, MTRL_ERR_NOMEM, "zmq: cannot wrap a payload: %s", zmq_strerror(zmq_errno()));
    }
    for (;;) {
        if (zmq_msg_send(&m, s->sock, 0) >= 0) return MTRL_OK;
        if (zmq_errno() != EINTR) break;
    }
    st = send_err_(err, 0);
    zmq_msg_close(&m); // releases the payload through ffn
    return st;
}

mtrl_status mtrl_wire_send(mtrl_wire_sock *s, const mtrl_wire_peer *peer, const mtrl_wire_out *o, mtrl_error *err) {
    return send_(s, peer, o->hdr, o->payload.data, o->payload.len, NULL, NULL, err);
}

mtrl_status mtrl_wire_send_borrowed(mtrl_wire_sock *s, const mtrl_wire_peer *peer, const uint8_t *hdr, void *payload,
                                    size_t n, void (*ffn)(void *data, void *hint), void *hint, mtrl_error *err) {
    return send_(s, peer, hdr, payload, n, ffn, hint, err);
}

static void peer_text_(const mtrl_wire_peer *p, char *buf, size_t cap) {
    size_t k = 0;
    for (size_t i = 0; i < p->len && k + 5 < cap; i++) {
        uint8_t c = p->id[i];
        if (c >= 0x20 && c < 0x7f) buf[k++] = (char)c;
        else k += (size_t)snprintf(buf + k, cap - k, "\\x%02x", c);
    }
    buf[k < cap ? k : cap - 1] = '\0';
}

mtrl_status mtrl_wire_recv(mtrl_wire_sock *s, int timeout_ms, mtrl_wire_in *in, mtrl_wire_stats *stats,
                           mtrl_error *err) {
    memset(in, 0, sizeof *in);
    if (!s->sock) return mtrl_error_set(err, MTRL_ERR_STATE, "wire: socket is not open");
    zmq_pollitem_t item = {s->sock, 0, ZMQ_POLLIN, 0};
    int rc = zmq_poll(&item, 1, timeout_ms);
    if (rc < 0) {
        if (zmq_errno() == EINTR) return mtrl_error_set(err, MTRL_ERR_TIMEOUT, "wire: receive interrupted");
        return zerr_(err, MTRL_ERR_IO, "poll");
    }
    if (rc == 0 || !(item.revents & ZMQ_POLLIN))
        return mtrl_error_set(err, MTRL_ERR_TIMEOUT, "wire: nothing received in %d ms", timeout_ms);

    // Take every part of the message; keep the first three, drop the rest.
    int want = s->router ? 3 : 2, parts = 0, more = 1;
    zmq_msg_t extra;
    zmq_msg_init(&extra);
    while (more) {
        zmq_msg_t *m = parts < want ? (zmq_msg_t *)s->in[parts] : &extra;
        if (zmq_msg_recv(m, s->sock, parts == 0 ? ZMQ_DONTWAIT : 0) < 0) {
            int e = zmq_errno();
            if (e == EINTR) continue;
            zmq_msg_close(&extra);
            if (e == EAGAIN && parts == 0)
                return mtrl_error_set(err, MTRL_ERR_TIMEOUT, "wire: nothing received in %d ms", timeout_ms);
            return mtrl_error_set(err, MTRL_ERR_IO, "zmq: receive failed: %s", zmq_strerror(e));
        }
        parts++;
        more = zmq_msg_more(m);
    }
    zmq_msg_close(&extra);

    int base = 0;
    if (s->router) {
        zmq_msg_t *idm = (zmq_msg_t *)s->in[0];
        size_t n = zmq_msg_size(idm);
        if (n > sizeof in->peer.id) n = sizeof in->peer.id;
        memcpy(in->peer.id, zmq_msg_data(idm), n);
        in->peer.len = n;
        base = 1;
    }
    if (stats) stats->messages++;
    char why[MTRL_ERROR_MSG_MAX];
    mtrl_error e2;
    mtrl_status st = MTRL_OK;
    int frames = parts - base;
    if (frames < 1 || frames > 2) {
        st = mtrl_error_set(&e2, MTRL_ERR_FORMAT, "wire: message of %d frames; expected a header and at most one payload",
                            frames);
    } else {
        zmq_msg_t *hm = (zmq_msg_t *)s->in[base];
        st = mtrl_wire_hdr_decode(zmq_msg_data(hm), zmq_msg_size(hm), &s->lim, &in->hdr, &e2);
        if (!st) {
            in->hdr_bytes = zmq_msg_data(hm);
            if (frames == 2) {
                zmq_msg_t *pm = (zmq_msg_t *)s->in[base + 1];
                in->payload = zmq_msg_data(pm);
                in->payload_len = zmq_msg_size(pm);
            }
            if (stats) stats->bytes += in->payload_len;
            st = mtrl_wire_payload_check(&in->hdr, in->payload, in->payload_len, &e2);
        }
    }
    if (st) {
        char peer[96] = "";
        if (s->router) peer_text_(&in->peer, peer, sizeof peer);
        snprintf(why, sizeof why, "%s%s%s", peer[0] ? "from " : "", peer, peer[0] ? ": " : "");
        size_t k = strlen(why);
        snprintf(why + k, sizeof why - k, "%s", e2.msg);
        mtrl_wire_stats_invalid(stats, why);
        return mtrl_error_set(err, st, "%s", why);
    }
    return MTRL_OK;
}

// The address of a connected socket as libzmq writes Peer-Address (the IP, no port); 0 when fd
// is not a connected IP socket.
static int fd_peer_ip_(int fd, char *buf, size_t cap) {
    struct sockaddr_storage ss;
    socklen_t n = sizeof ss;
    if (getpeername(fd, (struct sockaddr *)&ss, &n) != 0) return 0;
    const void *a = NULL;
    if (ss.ss_family == AF_INET) a = &((struct sockaddr_in *)&ss)->sin_addr;
    else if (ss.ss_family == AF_INET6) a = &((struct sockaddr_in6 *)&ss)->sin6_addr;
    return a && inet_ntop(ss.ss_family, a, buf, (socklen_t)cap) != NULL;
}

mtrl_status mtrl_wire_sock_disconnect_last(mtrl_wire_sock *s, mtrl_error *err) {
    if (!s->sock || !s->router) return mtrl_error_set(err, MTRL_ERR_STATE, "wire: disconnect needs an open ROUTER");
    // The header frame carries the engine's metadata (the identity frame is the ROUTER's own).
    zmq_msg_t *m = (zmq_msg_t *)s->in[1];
    const char *fds = zmq_msg_gets(m, "__fd"), *addr = zmq_msg_gets(m, "Peer-Address");
    if (!fds || !addr) return mtrl_error_set(err, MTRL_ERR_STATE, "wire: the last message came from no TCP peer");
    int fd = atoi(fds);
    char ip[INET6_ADDRSTRLEN + 1];
    if (fd < 0 || !fd_peer_ip_(fd, ip, sizeof ip) || strcmp(ip, addr) != 0)
        return mtrl_error_set(err, MTRL_ERR_PEER, "wire: the connection from %s is gone already", addr);
    if (shutdown(fd, SHUT_RDWR) != 0)
        return mtrl_error_set(err, MTRL_ERR_PEER, "wire: cannot hang up on %s: %s", addr, strerror(errno));
    return MTRL_OK;
}
