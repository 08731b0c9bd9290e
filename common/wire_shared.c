// wire_shared.c: one encoded message sent to many peers without copying (see wire_shared.h).
#include "common/wire_shared.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/check.h"

struct mtrl_wire_shared {
    atomic_int refs;
    uint8_t hdr[MTRL_WIRE_HDR_SIZE];
    uint8_t *payload;
    size_t len;
};

mtrl_wire_shared *mtrl_wire_shared_take(mtrl_wire_out *o) {
    mtrl_wire_shared *m = xcalloc(1, sizeof *m);
    atomic_init(&m->refs, 1);
    memcpy(m->hdr, o->hdr, sizeof m->hdr);
    m->payload = o->payload.data;
    m->len = o->payload.len;
    mtrl_wbuf_init(&o->payload);
    return m;
}

void mtrl_wire_shared_release(mtrl_wire_shared *m) {
    if (!m || atomic_fetch_sub(&m->refs, 1) != 1) return;
    free(m->payload);
    free(m);
}

// Called by ZeroMQ (any thread) when it no longer needs the payload.
static void zmq_free_(void *data, void *hint) {
    (void)data;
    mtrl_wire_shared_release(hint);
}

static mtrl_status send_err_(mtrl_error *err, int first) {
    int e = zmq_errno();
    if (e == EHOSTUNREACH) return mtrl_error_set(err, MTRL_ERR_PEER, "zmq: the peer is unknown or gone (ROUTER_MANDATORY)");
    if (e == EAGAIN)
        return mtrl_error_set(err, MTRL_ERR_TIMEOUT, "zmq: send %s: the peer is not taking messages (queue full)",
                              first ? "refused" : "stalled mid-message");
    return mtrl_error_set(err, MTRL_ERR_IO, "zmq: send failed: %s", zmq_strerror(e));
}

static int send_retry_(void *sock, const void *p, size_t n, int flags) {
    int rc;
    do rc = zmq_send(sock, p, n, flags);
    while (rc < 0 && zmq_errno() == EINTR);
    return rc;
}

mtrl_status mtrl_wire_shared_send(mtrl_wire_sock *s, const mtrl_wire_peer *peer, mtrl_wire_shared *m, mtrl_error *err) {
    if (!s->sock) return mtrl_error_set(err, MTRL_ERR_STATE, "wire: socket is not open");
    int has_payload = m->len > 0;
    if (s->router) {
        if (!peer || peer->len == 0) return mtrl_error_set(err, MTRL_ERR_STATE, "wire: ROUTER send needs a peer");
        if (send_retry_(s->sock, peer->id, peer->len, ZMQ_SNDMORE) < 0) return send_err_(err, 1);
    }
    if (send_retry_(s->sock, m->hdr, sizeof m->hdr, has_payload ? ZMQ_SNDMORE : 0) < 0) return send_err_(err, !s->router);
    if (!has_payload) return MTRL_OK;
    zmq_msg_t msg;
    atomic_fetch_add(&m->refs, 1);
    if (zmq_msg_init_data(&msg, m->payload, m->len, zmq_free_, m) != 0) {
        mtrl_wire_shared_release(m);
        return mtrl_error_set(err, MTRL_ERR_NOMEM, "zmq: cannot wrap a payload: %s", zmq_strerror(zmq_errno()));
    }
    int rc;
    do rc = zmq_msg_send(&msg, s->sock, 0);
    while (rc < 0 && zmq_errno() == EINTR);
    if (rc < 0) {
        mtrl_status st = send_err_(err, 0);
        zmq_msg_close(&msg); // drops our reference through zmq_free_
        return st;
    }
    return MTRL_OK;
}
