// peer_guard.h: which peers of the learner's ROUTER send so many refused messages (malformed,
// or from a peer that has not said HELLO, or an impostor's HELLO) that the learner hangs up on
// them (issue 28, item 2: a flood of 10^6 tiny garbage frames). A real actor sends a refused
// message only briefly (the rest of its credit after the learner declared it dead, before it
// hears so), far fewer than the limit.
//     mtrl_peer_guard g;  mtrl_peer_guard_init(&g, 1000, 2.0);
//     switch (mtrl_peer_guard_note(&g, &in.peer, now)) { case MTRL_PEER_GUARD_LOG: ...;
//     case MTRL_PEER_GUARD_HANG_UP: mtrl_wire_sock_disconnect_last(...); }
#ifndef MTRL_PEER_GUARD_H
#define MTRL_PEER_GUARD_H

#include <stdint.h>

#include "common/wire/wire.h"

#define MTRL_PEER_GUARD_SLOTS 16

typedef enum {
    MTRL_PEER_GUARD_QUIET = 0,   // counted; say nothing (the peer's first refusal was logged)
    MTRL_PEER_GUARD_LOG = 1,     // the peer's first refused message in this window: log it
    MTRL_PEER_GUARD_HANG_UP = 2, // over the limit: disconnect the peer (its count starts over)
} mtrl_peer_guard_verdict;

typedef struct mtrl_peer_guard {
    struct {
        mtrl_wire_peer peer;
        uint32_t refused; // in the window that began at `since`
        double since;
    } slot[MTRL_PEER_GUARD_SLOTS];
    uint32_t limit;  // refused messages a peer may send in one window
    double window_s;
    long hung_up;    // peers disconnected so far
} mtrl_peer_guard;

void mtrl_peer_guard_init(mtrl_peer_guard *g, uint32_t limit, double window_s);
// Counts one refused message from p at time now (seconds, monotonic). Peers beyond the slots
// take the slot whose window is oldest (a flood comes from few connections at a time).
mtrl_peer_guard_verdict mtrl_peer_guard_note(mtrl_peer_guard *g, const mtrl_wire_peer *p, double now);
// The refused messages counted for p in its current window (0 when it has no slot).
uint32_t mtrl_peer_guard_count(const mtrl_peer_guard *g, const mtrl_wire_peer *p);

#endif
