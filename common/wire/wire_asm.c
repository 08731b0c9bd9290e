// wire_asm.c: the learner's episode assembler (see wire.h, part 3).
//
// Open episodes live in a flat array searched linearly: there are at most
// max_open_per_actor x actors of them (hundreds to a few thousand), and each CHUNK carries
// MiBs, so the scan is noise next to the copy.
#include "common/wire/wire.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/timeutil.h"

#define CLOSED_RING 1024 // recently closed episodes remembered, to tell late from unknown
#define POOL_MAX 4       // recycled trajectories kept for reuse (see mtrl_wire_asm_recycle)

typedef struct asm_key {
    uint32_t actor, inc;
    uint64_t id;
} asm_key;

typedef struct asm_ep {
    asm_key key;
    mtrl_traj t;
    uint32_t next_seq;     // the CHUNK seq expected next
    uint64_t bytes;        // payload bytes received
    mtrl_traj_digest dg;   // digest of the tokens received so far
} asm_ep;

typedef struct asm_actor {
    uint32_t actor;
    uint32_t inc;          // newest incarnation seen
} asm_actor;

struct mtrl_wire_asm {
    mtrl_wire_limits lim;
    asm_ep **open;
    size_t n_open, cap_open;
    mtrl_traj *done;       // closed episodes waiting for pop, [done_head, n_done)
    size_t done_head, n_done, cap_done;
    asm_key closed[CLOSED_RING];
    size_t closed_next, n_closed;
    asm_actor *actors;
    size_t n_actors, cap_actors;
    uint64_t open_bytes;
    mtrl_wire_stats stats;
    mtrl_traj pool[POOL_MAX]; // emptied trajectories whose buffers the next BEGINs reuse
    size_t n_pool;
};

mtrl_wire_asm *mtrl_wire_asm_new(const mtrl_wire_limits *lim) {
    mtrl_wire_asm *a = xcalloc(1, sizeof *a);
    a->lim = lim ? *lim : mtrl_wire_limits_default();
    return a;
}

static void ep_free_(asm_ep *e) {
    if (!e) return;
    mtrl_traj_free(&e->t);
    free(e);
}

void mtrl_wire_asm_free(mtrl_wire_asm *a) {
    if (!a) return;
    for (size_t i = 0; i < a->n_open; i++) ep_free_(a->open[i]);
    for (size_t i = a->done_head; i < a->n_done; i++) mtrl_traj_free(&a->done[i]); // popped ones belong to callers
    for (size_t i = 0; i < a->n_pool; i++) mtrl_traj_free(&a->pool[i]);
    free(a->open);
    free(a->done);
    free(a->actors);
    free(a);
}

const mtrl_wire_stats *mtrl_wire_asm_stats(const mtrl_wire_asm *a) { return &a->stats; }
uint64_t mtrl_wire_asm_open_bytes(const mtrl_wire_asm *a) { return a->open_bytes; }

size_t mtrl_wire_asm_open_count(const mtrl_wire_asm *a, uint32_t actor_id, uint32_t incarnation) {
    size_t n = 0;
    for (size_t i = 0; i < a->n_open; i++)
        if (a->open[i]->key.actor == actor_id &&
            (incarnation == MTRL_WIRE_ANY_INCARNATION || a->open[i]->key.inc == incarnation))
            n++;
    return n;
}

static int key_eq_(asm_key x, asm_key y) { return x.actor == y.actor && x.inc == y.inc && x.id == y.id; }

static asm_ep *find_open_(mtrl_wire_asm *a, asm_key k, size_t *at) {
    for (size_t i = 0; i < a->n_open; i++)
        if (key_eq_(a->open[i]->key, k)) {
            if (at) *at = i;
            return a->open[i];
        }
    return NULL;
}

static int recently_closed_(const mtrl_wire_asm *a, asm_key k) {
    for (size_t i = 0; i < a->n_closed; i++)
        if (key_eq_(a->closed[i], k)) return 1;
    return 0;
}

static void remember_closed_(mtrl_wire_asm *a, asm_key k) {
    a->closed[a->closed_next] = k;
    a->closed_next = (a->closed_next + 1) % CLOSED_RING;
    if (a->n_closed < CLOSED_RING) a->n_closed++;
}

// Appends t (moved; t is left empty) to the done queue.
static void push_done_(mtrl_wire_asm *a, mtrl_traj *t) {
    if (a->done_head == a->n_done) a->done_head = a->n_done = 0; // empty: reuse from the start
    if (a->n_done == a->cap_done) {
        if (a->done_head > 0) { // slide the live part down before growing
            memmove(a->done, a->done + a->done_head, (a->n_done - a->done_head) * sizeof *a->done);
            a->n_done -= a->done_head;
            a->done_head = 0;
        }
        if (a->n_done == a->cap_done) {
            a->cap_done = a->cap_done ? 2 * a->cap_done : 16;
            a->done = xrealloc(a->done, a->cap_done * sizeof *a->done);
        }
    }
    a->done[a->n_done++] = *t;
    mtrl_traj_init(t);
}

int mtrl_wire_asm_pop(mtrl_wire_asm *a, mtrl_traj *out) {
    if (a->done_head == a->n_done) return 0;
    mtrl_traj_free(out);
    *out = a->done[a->done_head++];
    return 1;
}

void mtrl_wire_asm_recycle(mtrl_wire_asm *a, mtrl_traj *t) {
    if (a->n_pool < POOL_MAX) {
        mtrl_traj_reset(t); // keeps the token and routing buffers
        a->pool[a->n_pool++] = *t;
        mtrl_traj_init(t);
    } else {
        mtrl_traj_free(t);
    }
}

static void count_close_(mtrl_wire_asm *a, mtrl_ep_status st) {
    if (st == MTRL_EP_REJECTED) a->stats.rejected++;
    else if (st == MTRL_EP_ABORTED) a->stats.aborted++;
    else a->stats.completed++;
}

// Closes the open episode at index i with its current status; moves it to the done queue.
static void close_at_(mtrl_wire_asm *a, size_t i) {
    asm_ep *e = a->open[i];
    a->open[i] = a->open[--a->n_open];
    a->open_bytes -= e->bytes;
    // An episode the learner ends (aborted, rejected) ends now; the actor's own summary stands.
    if (e->t.end_wall == 0 && (e->t.status == MTRL_EP_ABORTED || e->t.status == MTRL_EP_REJECTED))
        e->t.end_wall = mtrl_time_wall();
    count_close_(a, e->t.status);
    remember_closed_(a, e->key);
    push_done_(a, &e->t);
    ep_free_(e);
}

// Marks an episode REJECTED or ABORTED with a reason, and notes the reason in the stats.
static void set_fate_(mtrl_wire_asm *a, mtrl_traj *t, mtrl_ep_status st, const char *reason) {
    t->status = st;
    mtrl_traj_set_reason(t, "%s", reason);
    snprintf(a->stats.last_reason, sizeof a->stats.last_reason, "episode %llu (actor %u.%u): %s: %s",
             (unsigned long long)t->episode_id, t->actor_id, t->incarnation, mtrl_ep_status_name(st), reason);
}

// Rejects the open episode at index i: the message was valid enough to name it but breaks the
// episode. Counted as an invalid message too; returns the error for the caller.
static mtrl_status reject_at_(mtrl_wire_asm *a, size_t i, mtrl_status code, const char *reason, mtrl_error *err) {
    asm_ep *e = a->open[i];
    set_fate_(a, &e->t, MTRL_EP_REJECTED, reason);
    a->stats.invalid++;
    mtrl_error_set(err, code, "%s", a->stats.last_reason);
    close_at_(a, i);
    return code;
}

// Records an episode that never opened (bad or refused BEGIN) as REJECTED, so nothing is lost.
static mtrl_status reject_new_(mtrl_wire_asm *a, mtrl_traj *t, asm_key k, mtrl_status code, const char *reason,
                               mtrl_error *err) {
    t->episode_id = k.id;
    t->actor_id = k.actor;
    t->incarnation = k.inc;
    set_fate_(a, t, MTRL_EP_REJECTED, reason);
    a->stats.invalid++;
    if (t->end_wall == 0) t->end_wall = mtrl_time_wall();
    mtrl_error_set(err, code, "%s", a->stats.last_reason);
    count_close_(a, MTRL_EP_REJECTED);
    remember_closed_(a, k);
    push_done_(a, t);
    return code;
}

static mtrl_status invalid_(mtrl_wire_asm *a, mtrl_status code, mtrl_error *err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static mtrl_status invalid_(mtrl_wire_asm *a, mtrl_status code, mtrl_error *err, const char *fmt, ...) {
    char buf[MTRL_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    mtrl_wire_stats_invalid(&a->stats, buf);
    return mtrl_error_set(err, code, "%s", buf);
}

size_t mtrl_wire_asm_abort_actor(mtrl_wire_asm *a, uint32_t actor_id, uint32_t incarnation, const char *reason) {
    size_t n = 0;
    for (size_t i = a->n_open; i-- > 0;) {
        asm_ep *e = a->open[i];
        if (e->key.actor != actor_id) continue;
        if (incarnation != MTRL_WIRE_ANY_INCARNATION && e->key.inc != incarnation) continue;
        set_fate_(a, &e->t, MTRL_EP_ABORTED, reason ? reason : "actor gone");
        close_at_(a, i);
        n++;
    }
    return n;
}

// Tracks each actor's newest incarnation: a newer one aborts the older one's open episodes,
// an older one is stale. Returns 0 when the sender is current.
static int note_incarnation_(mtrl_wire_asm *a, uint32_t actor, uint32_t inc, uint32_t *current) {
    asm_actor *ac = NULL;
    for (size_t i = 0; i < a->n_actors; i++)
        if (a->actors[i].actor == actor) ac = &a->actors[i];
    if (!ac) {
        if (a->n_actors == a->cap_actors) {
            a->cap_actors = a->cap_actors ? 2 * a->cap_actors : 16;
            a->actors = xrealloc(a->actors, a->cap_actors * sizeof *a->actors);
        }
        ac = &a->actors[a->n_actors++];
        ac->actor = actor;
        ac->inc = inc;
        return 0;
    }
    *current = ac->inc;
    if (inc < ac->inc) return -1;
    if (inc > ac->inc) {
        char why[128];
        snprintf(why, sizeof why, "actor %u restarted (incarnation %u -> %u)", actor, ac->inc, inc);
        for (size_t i = a->n_open; i-- > 0;) {
            asm_ep *e = a->open[i];
            if (e->key.actor == actor && e->key.inc < inc) {
                set_fate_(a, &e->t, MTRL_EP_ABORTED, why);
                close_at_(a, i);
            }
        }
        ac->inc = inc;
    }
    return 0;
}

static mtrl_status feed_begin_(mtrl_wire_asm *a, asm_key k, const void *payload, size_t n, mtrl_error *err) {
    if (find_open_(a, k, NULL)) {
        a->stats.duplicates++;
        return MTRL_OK;
    }
    if (recently_closed_(a, k)) {
        a->stats.late++;
        return MTRL_OK;
    }
    mtrl_traj t;
    if (a->n_pool) t = a->pool[--a->n_pool]; // reuse a recycled trajectory's buffers
    else mtrl_traj_init(&t);
    mtrl_error e2;
    char why[MTRL_ERROR_MSG_MAX + 64];
    mtrl_status st = mtrl_traj_header_decode(&t, payload, n, &a->lim.traj, &e2);
    if (st) {
        snprintf(why, sizeof why, "bad BEGIN: %s", e2.msg);
        return reject_new_(a, &t, k, st, why, err);
    }
    if (t.actor_id != k.actor || t.incarnation != k.inc || t.episode_id != k.id) {
        snprintf(why, sizeof why,
                 "BEGIN names episode %llu of actor %u.%u but came as episode %llu from actor %u.%u",
                 (unsigned long long)t.episode_id, t.actor_id, t.incarnation, (unsigned long long)k.id, k.actor, k.inc);
        return reject_new_(a, &t, k, MTRL_ERR_PEER, why, err);
    }
    size_t open = mtrl_wire_asm_open_count(a, k.actor, k.inc);
    if (open >= a->lim.max_open_per_actor) {
        snprintf(why, sizeof why, "actor %u.%u already has %zu open episodes (max_open_per_actor=%u)", k.actor, k.inc,
                 open, a->lim.max_open_per_actor);
        return reject_new_(a, &t, k, MTRL_ERR_LIMIT, why, err);
    }
    if (n > a->lim.max_episode_bytes) {
        snprintf(why, sizeof why, "BEGIN of %zu bytes over max_episode_bytes=%llu", n,
                 (unsigned long long)a->lim.max_episode_bytes);
        return reject_new_(a, &t, k, MTRL_ERR_LIMIT, why, err);
    }
    asm_ep *e = xcalloc(1, sizeof *e);
    e->key = k;
    e->t = t; // moved
    e->bytes = n;
    mtrl_traj_digest_init(&e->dg);
    if (a->n_open == a->cap_open) {
        a->cap_open = a->cap_open ? 2 * a->cap_open : 16;
        a->open = xrealloc(a->open, a->cap_open * sizeof *a->open);
    }
    a->open[a->n_open++] = e;
    a->open_bytes += n;
    return MTRL_OK;
}

static mtrl_status feed_chunk_(mtrl_wire_asm *a, asm_ep *e, size_t i, const mtrl_wire_hdr *h, const void *payload,
                               size_t n, mtrl_error *err) {
    char why[MTRL_ERROR_MSG_MAX + 64];
    if (h->seq < e->next_seq) {
        a->stats.duplicates++;
        return MTRL_OK;
    }
    if (h->seq > e->next_seq) {
        snprintf(why, sizeof why, "gap: expected chunk %u, got chunk %u", e->next_seq, h->seq);
        return reject_at_(a, i, MTRL_ERR_PEER, why, err);
    }
    if (n > a->lim.max_episode_bytes - e->bytes) {
        snprintf(why, sizeof why, "chunk %u would bring the episode to %llu bytes, over max_episode_bytes=%llu", h->seq,
                 (unsigned long long)(e->bytes + n), (unsigned long long)a->lim.max_episode_bytes);
        return reject_at_(a, i, MTRL_ERR_LIMIT, why, err);
    }
    uint64_t before = e->t.n_tokens;
    mtrl_error e2;
    mtrl_status st = mtrl_traj_slice_decode(&e->t, payload, n, before, &a->lim.traj, NULL, &e2);
    if (st) {
        snprintf(why, sizeof why, "chunk %u: %s", h->seq, e2.msg);
        return reject_at_(a, i, st, why, err);
    }
    mtrl_traj_digest_update(&e->dg, &e->t, before, e->t.n_tokens - before);
    e->next_seq++;
    e->bytes += n;
    a->open_bytes += n;
    return MTRL_OK;
}

static mtrl_status feed_end_(mtrl_wire_asm *a, asm_ep *e, size_t i, const mtrl_wire_hdr *h, const void *payload,
                             size_t n, mtrl_error *err) {
    char why[MTRL_ERROR_MSG_MAX + 64];
    if (h->seq != e->next_seq) {
        snprintf(why, sizeof why, "END after %u chunks, but %u chunks arrived", h->seq, e->next_seq);
        return reject_at_(a, i, MTRL_ERR_PEER, why, err);
    }
    uint64_t total = 0, digest = 0;
    mtrl_error e2;
    mtrl_status st = mtrl_traj_summary_decode(&e->t, payload, n, &a->lim.traj, &total, &digest, &e2);
    if (st) {
        snprintf(why, sizeof why, "bad END: %s", e2.msg);
        return reject_at_(a, i, st, why, err);
    }
    if (total != e->t.n_tokens) {
        snprintf(why, sizeof why, "END says %llu tokens, %llu arrived", (unsigned long long)total,
                 (unsigned long long)e->t.n_tokens);
        return reject_at_(a, i, MTRL_ERR_MISMATCH, why, err);
    }
    uint64_t got = mtrl_traj_digest_final(&e->dg);
    if (got != digest) {
        snprintf(why, sizeof why, "digest mismatch: END says %016llx, the tokens received hash to %016llx",
                 (unsigned long long)digest, (unsigned long long)got);
        return reject_at_(a, i, MTRL_ERR_MISMATCH, why, err);
    }
    // Patch tokens must name the pictures the summary brought (the model would refuse them).
    if (mtrl_traj_images_check(&e->t, &e2) != MTRL_OK) {
        snprintf(why, sizeof why, "bad END: %s", e2.msg);
        return reject_at_(a, i, MTRL_ERR_FORMAT, why, err);
    }
    // The actor's own status stands (complete, truncated, or aborted by a crashed env).
    e->bytes += n;
    a->open_bytes += n;
    close_at_(a, i);
    return MTRL_OK;
}

mtrl_status mtrl_wire_asm_feed(mtrl_wire_asm *a, uint32_t actor_id, uint32_t incarnation, const mtrl_wire_hdr *h,
                               const void *payload, size_t n, mtrl_error *err) {
    a->stats.messages++;
    a->stats.bytes += n;
    if (h->type != MTRL_WIRE_BEGIN && h->type != MTRL_WIRE_CHUNK && h->type != MTRL_WIRE_END)
        return invalid_(a, MTRL_ERR_STATE, err, "assembler fed a %s message", mtrl_wire_type_name(h->type));
    if (n != h->length)
        return invalid_(a, MTRL_ERR_FORMAT, err, "wire %s: payload is %zu bytes, the header says %llu",
                        mtrl_wire_type_name(h->type), n, (unsigned long long)h->length);
    uint32_t current = incarnation;
    if (note_incarnation_(a, actor_id, incarnation, &current) != 0)
        return invalid_(a, MTRL_ERR_PEER, err, "wire %s for episode %llu from actor %u incarnation %u, "
                        "which was replaced by incarnation %u", mtrl_wire_type_name(h->type),
                        (unsigned long long)h->id, actor_id, incarnation, current);
    asm_key k = {actor_id, incarnation, h->id};
    if (h->type == MTRL_WIRE_BEGIN) return feed_begin_(a, k, payload, n, err);
    size_t i = 0;
    asm_ep *e = find_open_(a, k, &i);
    if (!e) {
        if (recently_closed_(a, k)) {
            a->stats.late++;
            return MTRL_OK;
        }
        return invalid_(a, MTRL_ERR_PEER, err, "wire %s for episode %llu of actor %u.%u, which has no BEGIN",
                        mtrl_wire_type_name(h->type), (unsigned long long)h->id, actor_id, incarnation);
    }
    if (h->type == MTRL_WIRE_CHUNK) return feed_chunk_(a, e, i, h, payload, n, err);
    return feed_end_(a, e, i, h, payload, n, err);
}
