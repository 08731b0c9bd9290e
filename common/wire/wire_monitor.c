// wire_monitor.c: connection events of a wire socket (see wire_monitor.h).
#include "common/wire/wire_monitor.h"

#include <stdio.h>
#include <string.h>
#include <zmq.h>

static const char *event_name_(uint16_t e) {
    switch (e) {
    case ZMQ_EVENT_CONNECTED: return "connected";
    case ZMQ_EVENT_CONNECT_DELAYED: return "connect delayed";
    case ZMQ_EVENT_CONNECT_RETRIED: return "connect retried";
    case ZMQ_EVENT_LISTENING: return "listening";
    case ZMQ_EVENT_BIND_FAILED: return "bind failed";
    case ZMQ_EVENT_ACCEPTED: return "accepted";
    case ZMQ_EVENT_ACCEPT_FAILED: return "accept failed";
    case ZMQ_EVENT_CLOSED: return "closed";
    case ZMQ_EVENT_CLOSE_FAILED: return "close failed";
    case ZMQ_EVENT_DISCONNECTED: return "disconnected";
    case ZMQ_EVENT_MONITOR_STOPPED: return "monitor stopped";
    case ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL: return "handshake failed";
    case ZMQ_EVENT_HANDSHAKE_SUCCEEDED: return "handshake succeeded";
    case ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL: return "handshake failed (protocol)";
    case ZMQ_EVENT_HANDSHAKE_FAILED_AUTH: return "handshake failed (auth)";
    default: return "event";
    }
}

mtrl_status mtrl_wire_monitor_open(mtrl_wire_monitor *m, mtrl_wire_sock *s, int events, mtrl_error *err) {
    memset(m, 0, sizeof *m);
    if (!s->sock) return mtrl_error_set(err, MTRL_ERR_STATE, "wire monitor: the socket is not open");
    snprintf(m->endpoint, sizeof m->endpoint, "inproc://mtrl-monitor-%p", s->sock);
    if (zmq_socket_monitor(s->sock, m->endpoint, events) != 0)
        return mtrl_error_set(err, MTRL_ERR_IO, "wire monitor: %s", zmq_strerror(zmq_errno()));
    m->pair = zmq_socket(s->ctx, ZMQ_PAIR);
    int linger = 0;
    if (!m->pair || zmq_setsockopt(m->pair, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
        zmq_connect(m->pair, m->endpoint) != 0) {
        mtrl_status st = mtrl_error_set(err, MTRL_ERR_IO, "wire monitor: %s", zmq_strerror(zmq_errno()));
        if (m->pair) zmq_close(m->pair);
        zmq_socket_monitor(s->sock, NULL, 0);
        memset(m, 0, sizeof *m);
        return st;
    }
    m->watched = s->sock;
    return MTRL_OK;
}

int mtrl_wire_monitor_next(mtrl_wire_monitor *m, mtrl_wire_event *ev) {
    if (!m || !m->pair) return 0;
    // Two frames: u16 event + u32 value, then the address.
    zmq_msg_t f;
    zmq_msg_init(&f);
    if (zmq_msg_recv(&f, m->pair, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&f);
        return 0;
    }
    memset(ev, 0, sizeof *ev);
    if (zmq_msg_size(&f) >= 6) {
        const uint8_t *p = zmq_msg_data(&f);
        memcpy(&ev->event, p, 2);
        memcpy(&ev->value, p + 2, 4);
    }
    int more = zmq_msg_more(&f);
    zmq_msg_close(&f);
    while (more) {
        zmq_msg_init(&f);
        if (zmq_msg_recv(&f, m->pair, 0) < 0) {
            zmq_msg_close(&f);
            break;
        }
        size_t n = zmq_msg_size(&f);
        if (!ev->address[0]) {
            if (n >= sizeof ev->address) n = sizeof ev->address - 1;
            memcpy(ev->address, zmq_msg_data(&f), n);
            ev->address[n] = '\0';
        }
        more = zmq_msg_more(&f);
        zmq_msg_close(&f);
    }
    ev->name = event_name_(ev->event);
    return 1;
}

void mtrl_wire_monitor_close(mtrl_wire_monitor *m) {
    if (!m || !m->pair) return;
    if (m->watched) zmq_socket_monitor(m->watched, NULL, 0);
    zmq_close(m->pair);
    memset(m, 0, sizeof *m);
}
