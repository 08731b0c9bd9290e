// peer_guard.c: see peer_guard.h.
#include "learner/peer_guard.h"

#include <string.h>

void mtrl_peer_guard_init(mtrl_peer_guard *g, uint32_t limit, double window_s) {
    memset(g, 0, sizeof *g);
    g->limit = limit;
    g->window_s = window_s;
}

static int same_(const mtrl_wire_peer *a, const mtrl_wire_peer *b) {
    return a->len == b->len && memcmp(a->id, b->id, a->len) == 0;
}

static int find_(const mtrl_peer_guard *g, const mtrl_wire_peer *p) {
    for (int i = 0; i < MTRL_PEER_GUARD_SLOTS; i++)
        if (g->slot[i].refused && same_(&g->slot[i].peer, p)) return i;
    return -1;
}

uint32_t mtrl_peer_guard_count(const mtrl_peer_guard *g, const mtrl_wire_peer *p) {
    int i = find_(g, p);
    return i < 0 ? 0 : g->slot[i].refused;
}

mtrl_peer_guard_verdict mtrl_peer_guard_note(mtrl_peer_guard *g, const mtrl_wire_peer *p, double now) {
    int i = find_(g, p);
    if (i >= 0 && now - g->slot[i].since > g->window_s) g->slot[i].refused = 0; // a new window
    if (i < 0 || g->slot[i].refused == 0) {
        if (i < 0) {
            i = 0;
            for (int k = 0; k < MTRL_PEER_GUARD_SLOTS; k++) {
                if (!g->slot[k].refused) { i = k; break; }
                if (g->slot[k].since < g->slot[i].since) i = k;
            }
        }
        g->slot[i].peer = *p;
        g->slot[i].refused = 1;
        g->slot[i].since = now;
        return MTRL_PEER_GUARD_LOG;
    }
    if (++g->slot[i].refused <= g->limit) return MTRL_PEER_GUARD_QUIET;
    g->slot[i].refused = 0;
    g->hung_up++;
    return MTRL_PEER_GUARD_HANG_UP;
}
