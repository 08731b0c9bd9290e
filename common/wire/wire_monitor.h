// wire_monitor.h: connection events of a wire socket (zmq_socket_monitor), so the actor and
// the learner see what ZeroMQ does underneath them.
//
// Why: a ZeroMQ connection that drops and comes back (heartbeat timeout, a peer restart)
// silently loses the messages that were in flight on it, in both directions. The DEALER then
// reconnects on its own and nothing tells the application - unless it watches the monitor.
// The actor resynchronises on DISCONNECTED (see actor.c); both sides log what happened
// (CONNECT_RETRIED, DISCONNECTED, HANDSHAKE_FAILED_*: what an operator needs to see).
//
//   mtrl_wire_monitor mon;
//   mtrl_wire_monitor_open(&mon, &sock, MTRL_WIRE_MON_DEFAULT, &err);
//   mtrl_wire_event ev;
//   while (mtrl_wire_monitor_next(&mon, &ev)) ...   // never blocks
//   mtrl_wire_monitor_close(&mon);                  // before closing the socket
#ifndef MTRL_WIRE_MONITOR_H
#define MTRL_WIRE_MONITOR_H

#include <stdint.h>

#include "common/status.h"
#include "common/wire/wire.h"

typedef struct mtrl_wire_monitor {
    void *pair;          // PAIR socket receiving the events (NULL: not open)
    void *watched;       // the monitored zmq socket (borrowed)
    char endpoint[64];   // inproc endpoint of the monitor
} mtrl_wire_monitor;

typedef struct mtrl_wire_event {
    uint16_t event;      // ZMQ_EVENT_*
    uint32_t value;      // fd, errno or reconnect interval, per event
    const char *name;    // "connected", "disconnected", "handshake failed (auth)", ...
    char address[256];   // the endpoint or peer address the event is about
} mtrl_wire_event;

// Connection lifecycle events worth acting on or logging.
#define MTRL_WIRE_MON_DEFAULT 0xffffu

mtrl_status mtrl_wire_monitor_open(mtrl_wire_monitor *m, mtrl_wire_sock *s, int events, mtrl_error *err);
// Takes the next pending event without waiting: 1 and *ev filled, or 0 when none is pending.
int mtrl_wire_monitor_next(mtrl_wire_monitor *m, mtrl_wire_event *ev);
void mtrl_wire_monitor_close(mtrl_wire_monitor *m); // NULL-safe, idempotent

#endif
