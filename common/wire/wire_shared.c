// wire_shared.c: one encoded message sent to many peers without copying (see wire_shared.h).
#include "common/wire/wire_shared.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

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

mtrl_status mtrl_wire_shared_send(mtrl_wire_sock *s, const mtrl_wire_peer *peer, mtrl_wire_shared *m, mtrl_error *err) {
    atomic_fetch_add(&m->refs, 1); // given back by zmq_free_, whatever happens to the send
    return mtrl_wire_send_borrowed(s, peer, m->hdr, m->payload, m->len, zmq_free_, m, err);
}
