// dist_bootstrap.c: NCCL's unique id from rank 0 to the other ranks over ZeroMQ
// (mtrl_dist_bootstrap_zmq, dist_launch.h).
//
// The sockets come from common/wire (mtrl_wire_router_open / mtrl_wire_dealer_open: bounded
// linger, a frame cap, heartbeats, CURVE when asked), but the message is this file's own, one
// frame of 24 bytes and the id: the actor protocol's header and types are for actors and
// learners, and a rank that speaks it to the wrong port should be refused, not parsed.
#include "learner/dist_launch.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <zmq.h>

#include "common/timeutil.h"
#include "learner/dist_plan.h"

#define BOOT_MAGIC "MTBS"
#define BOOT_VERSION 1
#define BOOT_HDR 24
#define BOOT_MAX 4096 // the largest message: a header, an id (NCCL's: 128 bytes) or a reason
enum { BOOT_ASK = 1, BOOT_ID = 2, BOOT_REFUSED = 3 };

typedef struct boot_msg {
    unsigned version, kind, world, rank, id_bytes;
    int code;
    const uint8_t *body; // the id or the reason (not NUL-terminated)
    size_t body_len;
} boot_msg;

static void put_u16_(uint8_t *p, unsigned v) { p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8); }
static void put_u32_(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static unsigned get_u16_(const uint8_t *p) { return p[0] | (unsigned)p[1] << 8; }
static uint32_t get_u32_(const uint8_t *p) {
    return p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

// Encodes into buf[BOOT_MAX]; returns the length.
static size_t boot_encode_(uint8_t *buf, unsigned kind, int world, int rank, size_t id_bytes, int code,
                           const void *body, size_t n) {
    if (n > BOOT_MAX - BOOT_HDR) n = BOOT_MAX - BOOT_HDR; // a reason is cut, an id always fits
    memcpy(buf, BOOT_MAGIC, 4);
    put_u16_(buf + 4, BOOT_VERSION);
    put_u16_(buf + 6, kind);
    put_u32_(buf + 8, (uint32_t)world);
    put_u32_(buf + 12, (uint32_t)rank);
    put_u32_(buf + 16, (uint32_t)id_bytes);
    put_u32_(buf + 20, (uint32_t)code);
    if (n) memcpy(buf + BOOT_HDR, body, n);
    return BOOT_HDR + n;
}

// Decodes the header; the version is returned, not checked (the caller refuses another).
static int boot_decode_(const uint8_t *p, size_t n, boot_msg *m) {
    if (n < BOOT_HDR || memcmp(p, BOOT_MAGIC, 4)) return 0;
    m->version = get_u16_(p + 4);
    m->kind = get_u16_(p + 6);
    m->world = get_u32_(p + 8);
    m->rank = get_u32_(p + 12);
    m->id_bytes = get_u32_(p + 16);
    m->code = (int)get_u32_(p + 20);
    m->body = p + BOOT_HDR;
    m->body_len = n - BOOT_HDR;
    return 1;
}

// Receives one message (its last frame; a ROUTER's identity into peer) within the deadline.
// 1: got one; 0: the deadline passed; -1: a receive error (err set).
static int boot_recv_(void *sock, double deadline, zmq_msg_t *peer, uint8_t *buf, size_t *n, mtrl_error *err) {
    for (;;) {
        double left = deadline - mtrl_time_mono();
        if (left <= 0) return 0;
        zmq_pollitem_t item = {sock, 0, ZMQ_POLLIN, 0};
        int rc = zmq_poll(&item, 1, (long)(left * 1e3) + 1);
        if (rc < 0 && zmq_errno() == EINTR) continue;
        if (rc < 0) return mtrl_error_set(err, MTRL_ERR_IO, "zmq: poll: %s", zmq_strerror(zmq_errno())), -1;
        if (rc == 0) continue; // the loop's check ends it at the deadline
        // Frames: [identity] body; anything else arrives as more frames and the last one wins
        // (a malformed message then fails to decode).
        int more = 1, frames = 0;
        *n = 0;
        while (more) {
            zmq_msg_t m;
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, sock, 0) < 0) {
                zmq_msg_close(&m);
                if (zmq_errno() == EINTR) continue;
                return mtrl_error_set(err, MTRL_ERR_IO, "zmq: receive: %s", zmq_strerror(zmq_errno())), -1;
            }
            more = zmq_msg_more(&m);
            if (frames++ == 0 && peer) zmq_msg_copy(peer, &m);
            else {
                size_t k = zmq_msg_size(&m);
                *n = k > BOOT_MAX ? BOOT_MAX + 1 : k; // oversized: refused by its length
                if (k <= BOOT_MAX) memcpy(buf, zmq_msg_data(&m), k);
            }
            zmq_msg_close(&m);
        }
        return 1;
    }
}

// The socket options of a bootstrap: the caller's (CURVE) or the defaults, reconnecting at
// most every 500 ms, so a rank that started before rank 0 listens finds it soon after.
static mtrl_wire_sockopts boot_opts_(const mtrl_dist_rendezvous *rv) {
    mtrl_wire_sockopts o = rv->opts ? *rv->opts : mtrl_wire_sockopts_default();
    o.reconnect_ivl_max_ms = 500;
    return o;
}

static mtrl_wire_limits boot_limits_(void) {
    mtrl_wire_limits lim = mtrl_wire_limits_default();
    lim.max_payload = BOOT_MAX; // a larger frame disconnects its sender
    return lim;
}

// ---- rank 0 --------------------------------------------------------------------------------------

typedef struct boot_server {
    int ranks;
    size_t id_bytes;
    char refused[512]; // the requests refused, for the timeout's message
} boot_server;

// Answers one request: the id, or a refusal with its reason. Returns 1 when rank r got the id.
static int serve_one_(mtrl_wire_sock *s, boot_server *b, const int *served, const void *id, zmq_msg_t *peer,
                      const uint8_t *buf, size_t n, int *who) {
    boot_msg m = {0};
    char why[256] = "";
    mtrl_status code = MTRL_ERR_FORMAT;
    if (n > BOOT_MAX || !boot_decode_(buf, n, &m) || m.kind != BOOT_ASK)
        snprintf(why, sizeof why, "a message of %zu bytes that is not a bootstrap request", n);
    else if (m.version != BOOT_VERSION)
        code = MTRL_ERR_MISMATCH,
        snprintf(why, sizeof why, "bootstrap version %u; rank 0 speaks version %d", m.version, BOOT_VERSION);
    else if ((int)m.world != b->ranks || m.world > MTRL_DIST_RANKS_MAX)
        code = MTRL_ERR_MISMATCH,
        snprintf(why, sizeof why, "rank %u says the world has %u ranks; rank 0's has %d (the ranks were started with "
                 "different world sizes)", m.rank, m.world, b->ranks);
    else if (m.id_bytes != b->id_bytes)
        code = MTRL_ERR_MISMATCH,
        snprintf(why, sizeof why, "rank %u wants a %u-byte id; rank 0's is %zu bytes", m.rank, m.id_bytes, b->id_bytes);
    else if (m.rank < 1 || (int)m.rank >= b->ranks)
        code = MTRL_ERR_USAGE, snprintf(why, sizeof why, "rank %u is not one of ranks 1 .. %d", m.rank, b->ranks - 1);
    else if (served[m.rank])
        code = MTRL_ERR_STATE,
        snprintf(why, sizeof why, "rank %u has had the id already (two processes with one rank?)", m.rank);
    uint8_t out[BOOT_MAX];
    size_t len = why[0] ? boot_encode_(out, BOOT_REFUSED, b->ranks, m.rank, b->id_bytes, code, why, strlen(why))
                        : boot_encode_(out, BOOT_ID, b->ranks, (int)m.rank, b->id_bytes, 0, id, b->id_bytes);
    if (why[0]) {
        size_t at = strlen(b->refused);
        if (at + 8 < sizeof b->refused) snprintf(b->refused + at, sizeof b->refused - at, "%s%s", at ? "; " : "", why);
    }
    // The reply goes to the asker's identity; a peer gone meanwhile (ROUTER_MANDATORY) asks again
    // if it was a real rank, so a failed send only leaves it unserved.
    int ok = zmq_send(s->sock, zmq_msg_data(peer), zmq_msg_size(peer), ZMQ_SNDMORE) >= 0 &&
             zmq_send(s->sock, out, len, 0) >= 0;
    *who = (int)m.rank;
    return ok && !why[0];
}

static mtrl_status serve_(const mtrl_dist_rendezvous *rv, void *zctx, int ranks, const void *id, size_t id_bytes,
                          int timeout_ms, mtrl_error *err) {
    // ZeroMQ binds addresses, not names: resolve the host to the IPv4 address the others reach.
    struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    int g = getaddrinfo(rv->host, NULL, &hints, &ai);
    if (g != 0)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "dist bootstrap: rank 0 of %d: cannot resolve the rendezvous host '%s': "
                              "%s", ranks, rv->host, gai_strerror(g));
    char ip[INET_ADDRSTRLEN], ep[64];
    inet_ntop(AF_INET, &((struct sockaddr_in *)ai->ai_addr)->sin_addr, ip, sizeof ip);
    freeaddrinfo(ai);
    snprintf(ep, sizeof ep, "tcp://%s:%d", ip, rv->port);
    mtrl_wire_sockopts o = boot_opts_(rv);
    mtrl_wire_limits lim = boot_limits_();
    mtrl_wire_sock s;
    mtrl_error e2;
    if (mtrl_wire_router_open(&s, zctx, ep, &lim, &o, &e2) != MTRL_OK)
        return mtrl_error_set(err, MTRL_ERR_IO, "dist bootstrap: rank 0 of %d cannot listen at %s:%d (%s): %s (is the "
                              "rendezvous host this node, and the port free?)", ranks, rv->host, rv->port, ip, e2.msg);
    boot_server b = {.ranks = ranks, .id_bytes = id_bytes};
    int served[MTRL_DIST_RANKS_MAX] = {0}, n_served = 0;
    double deadline = mtrl_time_mono() + timeout_ms / 1e3;
    mtrl_status st = MTRL_OK;
    zmq_msg_t peer;
    zmq_msg_init(&peer);
    uint8_t buf[BOOT_MAX];
    while (n_served < ranks - 1) {
        size_t n;
        int got = boot_recv_(s.sock, deadline, &peer, buf, &n, err);
        if (got < 0) {
            st = MTRL_ERR_IO;
            break;
        }
        if (got == 0) {
            char miss[256];
            size_t at = 0;
            miss[0] = 0;
            for (int r = 1; r < ranks && at + 16 < sizeof miss; r++)
                if (!served[r]) at += (size_t)snprintf(miss + at, sizeof miss - at, "%s%d", at ? ", " : "", r);
            st = mtrl_error_set(err, MTRL_ERR_TIMEOUT, "dist bootstrap: rank 0 of %d at %s:%d: rank(s) %s never asked for "
                                "the id within %d ms%s%s", ranks, rv->host, rv->port, miss, timeout_ms,
                                b.refused[0] ? "; refused: " : "", b.refused);
            break;
        }
        int who;
        if (serve_one_(&s, &b, served, id, &peer, buf, n, &who)) served[who] = 1, n_served++;
    }
    zmq_msg_close(&peer);
    mtrl_wire_sock_close(&s); // the replies still queued go out within the linger
    return st;
}

// ---- the other ranks -----------------------------------------------------------------------------

static mtrl_status ask_(const mtrl_dist_rendezvous *rv, void *zctx, int rank, int ranks, void *id, size_t id_bytes,
                        int timeout_ms, mtrl_error *err) {
    char ep[MTRL_DIST_HOST_MAX + 32];
    snprintf(ep, sizeof ep, "tcp://%s:%d", rv->host, rv->port);
    mtrl_wire_sockopts o = boot_opts_(rv);
    mtrl_wire_limits lim = boot_limits_();
    mtrl_wire_sock s;
    mtrl_error e2;
    if (mtrl_wire_dealer_open(&s, zctx, ep, (uint32_t)rank, 0, &lim, &o, &e2) != MTRL_OK)
        return mtrl_error_set(err, MTRL_ERR_IO, "dist bootstrap: rank %d of %d: cannot connect to %s:%d: %s", rank, ranks,
                              rv->host, rv->port, e2.msg);
    uint8_t buf[BOOT_MAX];
    size_t n = boot_encode_(buf, BOOT_ASK, ranks, rank, id_bytes, 0, NULL, 0);
    double deadline = mtrl_time_mono() + timeout_ms / 1e3;
    mtrl_status st = MTRL_OK;
    // The request waits in the DEALER's queue until the connection is up (ZMQ_IMMEDIATE off).
    if (zmq_send(s.sock, buf, n, 0) < 0)
        st = mtrl_error_set(err, MTRL_ERR_IO, "dist bootstrap: rank %d of %d: sending to %s:%d: %s", rank, ranks, rv->host,
                            rv->port, zmq_strerror(zmq_errno()));
    int got = st == MTRL_OK ? boot_recv_(s.sock, deadline, NULL, buf, &n, err) : -1;
    boot_msg m;
    if (got < 0 && st == MTRL_OK) st = MTRL_ERR_IO;
    else if (got == 0)
        st = mtrl_error_set(err, MTRL_ERR_TIMEOUT, "dist bootstrap: rank %d of %d: no answer from rank 0 at %s:%d within %d "
                            "ms (is rank 0 running, and the rendezvous host and port the same on every rank?)", rank,
                            ranks, rv->host, rv->port, timeout_ms);
    else if (got > 0 && (n > BOOT_MAX || !boot_decode_(buf, n, &m) || m.version != BOOT_VERSION))
        st = mtrl_error_set(err, MTRL_ERR_FORMAT, "dist bootstrap: rank %d of %d: %s:%d answered with %zu bytes that are "
                            "not a version %d bootstrap message", rank, ranks, rv->host, rv->port, n, BOOT_VERSION);
    else if (got > 0 && m.kind == BOOT_REFUSED) {
        mtrl_status code = m.code == MTRL_ERR_MISMATCH || m.code == MTRL_ERR_USAGE || m.code == MTRL_ERR_STATE
                               ? (mtrl_status)m.code : MTRL_ERR_PEER;
        st = mtrl_error_set(err, code, "dist bootstrap: rank %d of %d: rank 0 at %s:%d refused: %.*s", rank, ranks,
                            rv->host, rv->port, (int)m.body_len, (const char *)m.body);
    } else if (got > 0 && (m.kind != BOOT_ID || (int)m.world != ranks || m.id_bytes != id_bytes ||
                           m.body_len != id_bytes))
        st = mtrl_error_set(err, MTRL_ERR_MISMATCH, "dist bootstrap: rank %d of %d: rank 0 at %s:%d answered with a "
                            "%zu-byte id for a world of %u (kind %u); expected %zu bytes for %d", rank, ranks, rv->host,
                            rv->port, m.body_len, m.world, m.kind, id_bytes, ranks);
    else if (got > 0) memcpy(id, m.body, id_bytes);
    mtrl_wire_sock_close(&s);
    return st;
}

mtrl_status mtrl_dist_bootstrap_zmq(void *user, int rank, int ranks, void *id, size_t id_bytes, int timeout_ms,
                                    mtrl_error *err) {
    const mtrl_dist_rendezvous *rv = user;
    if (ranks < 1 || ranks > MTRL_DIST_RANKS_MAX || rank < 0 || rank >= ranks || timeout_ms <= 0 ||
        id_bytes > BOOT_MAX - BOOT_HDR)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "dist bootstrap: rank %d of %d, timeout %d ms, a %zu-byte id: out of "
                              "range", rank, ranks, timeout_ms, id_bytes);
    if (ranks == 1) return MTRL_OK; // nobody to tell
    if (!rv->host[0] || rv->port < 1 || rv->port > 65535)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "dist bootstrap: rank %d of %d: rendezvous '%s' port %d: a host and a "
                              "port 1 .. 65535 are needed", rank, ranks, rv->host, rv->port);
    void *zctx = rv->zmq_ctx ? rv->zmq_ctx : zmq_ctx_new();
    if (!zctx) return mtrl_error_set(err, MTRL_ERR_IO, "zmq: cannot create a context: %s", zmq_strerror(zmq_errno()));
    mtrl_status st = rank == 0 ? serve_(rv, zctx, ranks, id, id_bytes, timeout_ms, err)
                               : ask_(rv, zctx, rank, ranks, id, id_bytes, timeout_ms, err);
    if (!rv->zmq_ctx) zmq_ctx_term(zctx); // waits for the last replies (bounded by the linger)
    return st;
}
