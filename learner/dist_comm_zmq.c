// dist_comm_zmq.c: the zmq backend of dist_comm.h: ranks as processes, host buffers, every
// collective a star through rank 0 over ZeroMQ TCP.
//
// The protocol, this file's own (the actor protocol's header and types are for actors and
// learners; a rank that speaks it to the wrong port is refused, not parsed). A message is one
// header frame of ZC_HDR bytes, then at most one data frame of `frame` bytes (1 ..
// MTRL_DIST_ZMQ_FRAME); on rank 0's ROUTER the peer's routing id comes first. Little-endian:
//     0 u8[4] magic "MTDC"   4 u16 version (1)   6 u16 kind   8 u32 world size
//     12 u32 rank (the sender's; rank 0's messages: the receiver's)   16 u32 call number
//     20 u32 op   24 u64 size   32 i64 aux (dtype, root)   40 u64 total bytes of the transfer
//     48 u64 offset of this frame's data in it   56 u32 frame bytes   60 i32 status (FAIL)
// Kinds: HELLO (a rank joins), WELCOME (the world is complete), DATA (a rank's input of a call,
// to rank 0), RESULT (rank 0's answer), FAIL (status and reason as text: the world failed).
// A transfer of `total` bytes is ceil(total / MTRL_DIST_ZMQ_FRAME) messages (one when empty),
// in order, every header the same but for offset and frame. Rank 0 checks each DATA header
// against its own call before it keeps a byte: the call number, op and sizes (a different call:
// MTRL_ERR_MISMATCH), the total the op implies (all_to_all_v: the counts in the first frame
// give it), the offsets in sequence. What each rank sends:
//     barrier         nothing; the answer is nothing
//     all_reduce      its buffer; the sum, to every rank
//     reduce_scatter  its ranks x count floats; rank r's chunk of the sum
//     all_gather      its bytes; everyone's, in rank order
//     broadcast       the root its bytes, the others nothing; the root's bytes (the root: nothing)
//     all_to_all_v    i64 send_count[R], i64 recv_count[R], then its rows grouped by destination
//                     in rank order; rank r gets the rows for it from every rank, in rank order
// The sums are rank 0's: acc = rank 0's values, then acc = acc + rank q's for q = 1, 2, ...,
// elementwise: the local backend's ((r0 + r1) + r2) ..., so the same bits.
#include "learner/dist_comm.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <zmq.h>

#include "common/check.h"
#include "common/timeutil.h"
#include "learner/dist_comm_impl.h"
#include "learner/dist_launch.h"
#include "learner/dist_plan.h"

#ifdef MTRL_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#define ZC_MAGIC "MTDC"
#define ZC_VERSION 1
#define ZC_HDR 64
#define ZC_TEXT_MAX 900 // a FAIL's reason
enum { ZC_HELLO = 1, ZC_WELCOME = 2, ZC_DATA = 3, ZC_RESULT = 4, ZC_FAIL = 5 };
enum { OP_BARRIER, OP_ALLREDUCE, OP_REDUCE_SCATTER, OP_ALLGATHER, OP_BROADCAST, OP_ALLTOALLV, OP_JOIN, OP_N };
static const char *const op_names_[] = {"barrier",   "all_reduce",   "reduce_scatter", "all_gather",
                                        "broadcast", "all_to_all_v", "join"};

typedef struct zc_hdr {
    unsigned version, kind, ranks, rank, seq, op;
    uint64_t size;
    int64_t aux;
    uint64_t total, offset;
    uint32_t frame;
    int32_t code;
} zc_hdr;

// A transfer being received from one rank (rank 0: each peer's input of the call).
typedef struct zc_in {
    uint8_t *buf;
    size_t cap;      // grow-only
    uint64_t got, total;
    int started;
    zc_hdr first;    // its first header (every later one must agree)
} zc_in;

typedef struct zc_state {
    void *ctx;
    int own_ctx;
    int open;                 // the socket is open (ranks > 1)
    mtrl_wire_sock s;
    char where[MTRL_DIST_HOST_MAX + 16]; // rank 0's host:port, for messages
    uint32_t seq;             // calls made
    int failed;
    mtrl_status fail_code;
    char fail_msg[ZC_TEXT_MAX + 1];
    // rank 0
    mtrl_wire_peer peer[MTRL_DIST_RANKS_MAX];
    int joined[MTRL_DIST_RANKS_MAX];
    zc_in in[MTRL_DIST_RANKS_MAX];
    char refused[512];        // what was refused, for the messages of a timeout
    // scratch: rank 0's results, a rank's packed all-to-all rows (grow-only)
    uint8_t *tmp;
    size_t tmp_cap;
} zc_state;

// ---- the header ----------------------------------------------------------------------------------

static void put_le_(uint8_t *p, uint64_t v, int n) {
    for (int i = 0; i < n; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint64_t get_le_(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static void hdr_encode_(uint8_t *p, const zc_hdr *h) {
    memcpy(p, ZC_MAGIC, 4);
    put_le_(p + 4, ZC_VERSION, 2);
    put_le_(p + 6, h->kind, 2);
    put_le_(p + 8, h->ranks, 4);
    put_le_(p + 12, h->rank, 4);
    put_le_(p + 16, h->seq, 4);
    put_le_(p + 20, h->op, 4);
    put_le_(p + 24, h->size, 8);
    put_le_(p + 32, (uint64_t)h->aux, 8);
    put_le_(p + 40, h->total, 8);
    put_le_(p + 48, h->offset, 8);
    put_le_(p + 56, h->frame, 4);
    put_le_(p + 60, (uint32_t)h->code, 4);
}

// 1 when p[n] is a header of this protocol (any version: the caller refuses another).
static int hdr_decode_(const uint8_t *p, size_t n, zc_hdr *h) {
    if (n != ZC_HDR || memcmp(p, ZC_MAGIC, 4)) return 0;
    h->version = (unsigned)get_le_(p + 4, 2);
    h->kind = (unsigned)get_le_(p + 6, 2);
    h->ranks = (unsigned)get_le_(p + 8, 4);
    h->rank = (unsigned)get_le_(p + 12, 4);
    h->seq = (unsigned)get_le_(p + 16, 4);
    h->op = (unsigned)get_le_(p + 20, 4);
    h->size = get_le_(p + 24, 8);
    h->aux = (int64_t)get_le_(p + 32, 8);
    h->total = get_le_(p + 40, 8);
    h->offset = get_le_(p + 48, 8);
    h->frame = (uint32_t)get_le_(p + 56, 4);
    h->code = (int32_t)get_le_(p + 60, 4);
    return 1;
}

static const char *op_name_(unsigned op) { return op < OP_N ? op_names_[op] : "an unknown op"; }

// ---- messages --------------------------------------------------------------------------------------

// Sends one message (to `to` on rank 0's ROUTER, to rank 0 on a DEALER) before the deadline.
// 0, or -1 with the reason in why (the peer gone, the deadline passed, a socket error).
static int send_msg_(zc_state *z, const mtrl_wire_peer *to, const zc_hdr *h, const void *data, double deadline,
                     char *why, size_t cap) {
    uint8_t hb[ZC_HDR];
    hdr_encode_(hb, h);
    const void *part[3] = {to ? to->id : NULL, hb, data};
    size_t len[3] = {to ? to->len : 0, ZC_HDR, h->frame};
    int first = to ? 0 : 1, last = h->frame ? 2 : 1;
    for (int i = first; i <= last; i++) {
        for (;;) {
            // Not blocking: a full queue (ZMQ_SNDHWM) is waited for here, up to the deadline.
            // After the first part the rest of a message always goes through.
            if (zmq_send(z->s.sock, part[i], len[i], (i < last ? ZMQ_SNDMORE : 0) | ZMQ_DONTWAIT) >= 0) break;
            int e = zmq_errno();
            if (e == EINTR) continue;
            if (e == EHOSTUNREACH) return snprintf(why, cap, "its connection is gone (the process exited?)"), -1;
            if (e != EAGAIN) return snprintf(why, cap, "zmq send: %s", zmq_strerror(e)), -1;
            if (mtrl_time_mono() > deadline) return snprintf(why, cap, "its queue stayed full until the timeout"), -1;
            zmq_pollitem_t item = {z->s.sock, 0, ZMQ_POLLOUT, 0};
            zmq_poll(&item, 1, 5);
        }
    }
    return 0;
}

// A transfer: data[total] in frames of at most MTRL_DIST_ZMQ_FRAME (one header-only message
// when empty). h gives every field but offset and frame. 0, or -1 with why.
static int send_xfer_(zc_state *z, const mtrl_wire_peer *to, zc_hdr h, const void *data, uint64_t total,
                      double deadline, char *why, size_t cap) {
    h.total = total;
    uint64_t at = 0;
    do {
        uint64_t n = total - at < MTRL_DIST_ZMQ_FRAME ? total - at : MTRL_DIST_ZMQ_FRAME;
        h.offset = at;
        h.frame = (uint32_t)n;
        if (send_msg_(z, to, &h, (const uint8_t *)data + at, deadline, why, cap)) return -1;
        at += n;
    } while (at < total);
    return 0;
}

// One message received before the deadline: the sender's routing id (ROUTER), the header and
// the data frame (data: initialised by the caller, empty when none). 1: a message of this
// protocol; 2: something else (frames or a header that are not this protocol's; *n_junk its
// size); 0: the deadline passed; -1: a socket error (why).
static int recv_msg_(zc_state *z, double deadline, mtrl_wire_peer *from, zc_hdr *h, zmq_msg_t *data, size_t *n_junk,
                     char *why, size_t cap) {
    for (;;) {
        double left = deadline - mtrl_time_mono();
        if (left <= 0) return 0;
        zmq_pollitem_t item = {z->s.sock, 0, ZMQ_POLLIN, 0};
        int rc = zmq_poll(&item, 1, (long)(left * 1e3) + 1);
        if (rc < 0 && zmq_errno() == EINTR) continue;
        if (rc < 0) return snprintf(why, cap, "zmq poll: %s", zmq_strerror(zmq_errno())), -1;
        if (rc == 0) continue;
        int frames = 0, more = 1, good = 1;
        size_t bytes = 0;
        int base = z->s.router ? 1 : 0; // frames before the header
        while (more) {
            zmq_msg_t m;
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, z->s.sock, 0) < 0) {
                zmq_msg_close(&m);
                if (zmq_errno() == EINTR) continue;
                return snprintf(why, cap, "zmq receive: %s", zmq_strerror(zmq_errno())), -1;
            }
            more = zmq_msg_more(&m);
            size_t k = zmq_msg_size(&m);
            int at = frames++;
            if (at >= base) bytes += k;
            if (at < base) {
                from->len = k < sizeof from->id ? k : sizeof from->id;
                memcpy(from->id, zmq_msg_data(&m), from->len);
            } else if (at == base) {
                good = good && hdr_decode_(zmq_msg_data(&m), k, h);
            } else if (at == base + 1 && good) {
                zmq_msg_move(data, &m);
            } else {
                good = 0; // a frame too many
            }
            zmq_msg_close(&m);
        }
        if (frames <= base) good = 0;
        if (good && h->frame != (frames > base + 1 ? zmq_msg_size(data) : 0)) good = 0;
        if (good && frames > base + 1 && (h->frame == 0 || h->frame > MTRL_DIST_ZMQ_FRAME)) good = 0;
        *n_junk = bytes;
        return good ? 1 : 2;
    }
}

// Appends a refusal to rank 0's list (for the messages of a timeout).
static void note_refused_(zc_state *z, const char *why) {
    size_t at = strlen(z->refused);
    if (at + 8 < sizeof z->refused) snprintf(z->refused + at, sizeof z->refused - at, "%s%s", at ? "; " : "", why);
}

// The rank of a routing id among the joined ranks, or -1.
static int peer_rank_(const zc_state *z, int ranks, const mtrl_wire_peer *p) {
    for (int q = 1; q < ranks; q++)
        if (z->joined[q] && z->peer[q].len == p->len && !memcmp(z->peer[q].id, p->id, p->len)) return q;
    return -1;
}

// ---- failing -----------------------------------------------------------------------------------------

// A FAIL carrying code and text, to `to` (ROUTER) or rank 0 (DEALER); best effort, at once.
static void send_fail_(zc_state *z, const mtrl_wire_peer *to, int ranks, int rank, uint32_t seq, mtrl_status code,
                       const char *text) {
    char why[128];
    size_t n = strlen(text);
    if (n > ZC_TEXT_MAX) n = ZC_TEXT_MAX;
    zc_hdr h = {.kind = ZC_FAIL, .ranks = (unsigned)ranks, .rank = (unsigned)rank, .seq = seq, .total = n,
                .frame = (uint32_t)n, .code = code};
    send_msg_(z, to, &h, text, mtrl_time_mono() + 0.2, why, sizeof why);
}

// The world failed in this call: it refuses every later call. Rank 0 tells every other rank;
// another rank tells rank 0 unless `from_root` (rank 0 told it). Returns code, err set.
static mtrl_status zc_fail_(mtrl_dist_comm *c, mtrl_status code, int from_root, mtrl_error *err, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static mtrl_status zc_fail_(mtrl_dist_comm *c, mtrl_status code, int from_root, mtrl_error *err, const char *fmt, ...) {
    zc_state *z = c->impl;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(z->fail_msg, sizeof z->fail_msg, fmt, ap);
    va_end(ap);
    z->failed = 1;
    z->fail_code = code;
    if (z->open && c->rank == 0) {
        for (int q = 1; q < c->ranks; q++)
            if (z->joined[q]) send_fail_(z, &z->peer[q], c->ranks, q, z->seq, code, z->fail_msg);
    } else if (z->open && !from_root) {
        send_fail_(z, NULL, c->ranks, c->rank, z->seq, code, z->fail_msg);
    }
    return mtrl_error_set(err, code, "dist_comm zmq: rank %d of %d: %s", c->rank, c->ranks, z->fail_msg);
}

// A code rank 0 sent, as this rank returns it (an unknown number: MTRL_ERR_PEER).
static mtrl_status code_of_(int32_t code) {
    switch (code) {
    case MTRL_ERR_TIMEOUT: case MTRL_ERR_MISMATCH: case MTRL_ERR_STATE: case MTRL_ERR_USAGE: case MTRL_ERR_FORMAT:
    case MTRL_ERR_IO: case MTRL_ERR_PEER: return (mtrl_status)code;
    default: return MTRL_ERR_PEER;
    }
}

// How long a rank other than 0 waits for rank 0 without a frame (dist_comm.h says why).
static double wait_s_(const mtrl_dist_comm *c) { return 2.0 * c->timeout_ms / 1e3 + 0.1; }
// ... and for the join, from its own timeout.
static double join_wait_s_(int join_ms) { return 2.0 * join_ms / 1e3 + 0.1; }

static void *grow_(uint8_t **buf, size_t *cap, size_t bytes) {
    if (bytes > *cap) {
        free(*buf);
        *cap = bytes + bytes / 8 + 64;
        *buf = xmalloc(*cap);
    }
    return *buf;
}

// ---- one call ----------------------------------------------------------------------------------------

// A call's identity and its input: op, sizes, and what this rank sends (in[in_bytes]).
typedef struct zc_call {
    unsigned op;
    uint64_t size;
    int64_t aux;
    const void *in;
    uint64_t in_bytes;
} zc_call;

// The bytes rank q must send for call k (rank 0's), or UINT64_MAX with why; all_to_all_v reads
// the counts at the head of its first frame (head[n]).
static uint64_t expected_in_(const mtrl_dist_comm *c, const zc_call *k, int q, const uint8_t *head, size_t n, char *why,
                             size_t cap) {
    uint64_t R = (uint64_t)c->ranks;
    switch (k->op) {
    case OP_BARRIER: return 0;
    case OP_ALLREDUCE: return k->size * mtrl_dtype_size((mtrl_dtype)k->aux);
    case OP_REDUCE_SCATTER: return k->size * R * sizeof(float);
    case OP_ALLGATHER: return k->size;
    case OP_BROADCAST: return q == k->aux ? k->size : 0;
    case OP_ALLTOALLV: {
        if (n < 16 * R) return snprintf(why, cap, "its all_to_all_v counts are cut (%zu bytes)", n), UINT64_MAX;
        uint64_t rows = 0;
        for (uint64_t d = 0; d < 2 * R; d++) {
            int64_t v = (int64_t)get_le_(head + 8 * d, 8);
            if (v < 0 || v > ((int64_t)1 << 40))
                return snprintf(why, cap, "an all_to_all_v count of %lld", (long long)v), UINT64_MAX;
            if (d < R) rows += (uint64_t)v;
        }
        return 16 * R + rows * k->size;
    }
    }
    return UINT64_MAX;
}

// The ranks rank 0 still waits for, as "2, 5".
static void missing_(const mtrl_dist_comm *c, char *buf, size_t cap) {
    zc_state *z = c->impl;
    size_t at = 0;
    buf[0] = 0;
    for (int q = 1; q < c->ranks && at + 16 < cap; q++)
        if (!z->in[q].started || z->in[q].got < z->in[q].total)
            at += (size_t)snprintf(buf + at, cap - at, "%s%d", at ? ", " : "", q);
}

// Rank 0: every other rank's input of call k into z->in[q]. MTRL_OK, or the world failed.
static mtrl_status gather_(mtrl_dist_comm *c, const zc_call *k, mtrl_error *err) {
    zc_state *z = c->impl;
    const char *op = op_names_[k->op];
    int owed = c->ranks - 1;
    for (int q = 1; q < c->ranks; q++) z->in[q].started = 0, z->in[q].got = z->in[q].total = 0;
    double deadline = mtrl_time_mono() + c->timeout_ms / 1e3;
    mtrl_status st = MTRL_OK;
    zmq_msg_t data;
    zmq_msg_init(&data);
    char why[256];
    while (owed > 0 && st == MTRL_OK) {
        mtrl_wire_peer from = {0};
        zc_hdr h;
        size_t junk = 0;
        zmq_msg_close(&data);
        zmq_msg_init(&data);
        int got = recv_msg_(z, deadline, &from, &h, &data, &junk, why, sizeof why);
        if (got == 0) {
            char miss[256];
            missing_(c, miss, sizeof miss);
            st = zc_fail_(c, MTRL_ERR_TIMEOUT, 0, err, "%s (call %u): rank(s) %s did not arrive within the timeout of %d "
                          "ms%s%s", op, z->seq, miss, c->timeout_ms, z->refused[0] ? "; refused: " : "", z->refused);
            break;
        }
        if (got < 0) {
            st = zc_fail_(c, MTRL_ERR_IO, 0, err, "%s (call %u): %s", op, z->seq, why);
            break;
        }
        int q = peer_rank_(z, c->ranks, &from);
        if (q < 0) { // not a rank of this world: dropped, noted
            char r[96];
            snprintf(r, sizeof r, "%zu bytes from a peer that is not a rank", junk);
            note_refused_(z, r);
            continue;
        }
        zc_in *in = &z->in[q];
        if (got == 2 || h.version != ZC_VERSION) {
            st = zc_fail_(c, MTRL_ERR_FORMAT, 0, err, "%s (call %u): rank %d sent %zu bytes that are not a version %d "
                          "message", op, z->seq, q, junk, ZC_VERSION);
        } else if (h.kind == ZC_FAIL) {
            st = zc_fail_(c, MTRL_ERR_PEER, 0, err, "%s (call %u): rank %d failed: %.*s", op, z->seq, q,
                          (int)(h.frame < ZC_TEXT_MAX ? h.frame : ZC_TEXT_MAX), h.frame ? (char *)zmq_msg_data(&data) : "");
        } else if (h.kind != ZC_DATA || h.ranks != (unsigned)c->ranks || h.rank != (unsigned)q) {
            st = zc_fail_(c, MTRL_ERR_FORMAT, 0, err, "%s (call %u): rank %d sent a message of kind %u for rank %u of %u",
                          op, z->seq, q, h.kind, h.rank, h.ranks);
        } else if (h.seq != z->seq) {
            st = zc_fail_(c, MTRL_ERR_MISMATCH, 0, err, "the ranks are at different calls: rank 0 at call %u (%s), rank %d "
                          "at call %u (%s)", z->seq, op, q, h.seq, op_name_(h.op));
        } else if (!in->started) {
            if (h.op != k->op || h.size != k->size || h.aux != k->aux) {
                st = zc_fail_(c, MTRL_ERR_MISMATCH, 0, err, "the ranks called different collectives: rank 0 %s (size "
                              "%llu, %lld), rank %d %s (size %llu, %lld)", op, (unsigned long long)k->size,
                              (long long)k->aux, q, op_name_(h.op), (unsigned long long)h.size, (long long)h.aux);
                break;
            }
            uint64_t want = expected_in_(c, k, q, h.frame ? zmq_msg_data(&data) : NULL, h.frame, why, sizeof why);
            if (want == UINT64_MAX || h.total != want || h.offset != 0)
                st = zc_fail_(c, MTRL_ERR_FORMAT, 0, err, "%s (call %u): rank %d sends %llu bytes at offset %llu; "
                              "expected %llu from 0%s%s", op, z->seq, q, (unsigned long long)h.total,
                              (unsigned long long)h.offset, (unsigned long long)(want == UINT64_MAX ? 0 : want),
                              want == UINT64_MAX ? ": " : "", want == UINT64_MAX ? why : "");
            else {
                in->started = 1;
                in->first = h;
                in->total = want;
                grow_(&in->buf, &in->cap, want);
            }
        } else if (h.op != in->first.op || h.size != in->first.size || h.aux != in->first.aux ||
                   h.total != in->total || h.offset != in->got) {
            st = zc_fail_(c, MTRL_ERR_FORMAT, 0, err, "%s (call %u): rank %d's frame at offset %llu does not continue its "
                          "transfer (at %llu of %llu)", op, z->seq, q, (unsigned long long)h.offset,
                          (unsigned long long)in->got, (unsigned long long)in->total);
        }
        if (st != MTRL_OK) break;
        if (h.offset + h.frame > in->total || (h.frame == 0 && in->total != 0)) {
            st = zc_fail_(c, MTRL_ERR_FORMAT, 0, err, "%s (call %u): rank %d sent %u bytes at offset %llu of a transfer of "
                          "%llu", op, z->seq, q, h.frame, (unsigned long long)h.offset, (unsigned long long)in->total);
            break;
        }
        if (h.frame) memcpy(in->buf + h.offset, zmq_msg_data(&data), h.frame);
        in->got += h.frame;
        if (in->got == in->total) owed--;
        deadline = mtrl_time_mono() + c->timeout_ms / 1e3; // data that keeps coming does not time out
    }
    zmq_msg_close(&data);
    return st;
}

// Rank 0: rank q's result out[bytes]. MTRL_OK, or the world failed.
static mtrl_status answer_(mtrl_dist_comm *c, const zc_call *k, int q, const void *out, uint64_t bytes, mtrl_error *err) {
    zc_state *z = c->impl;
    char why[256];
    zc_hdr h = {.kind = ZC_RESULT, .ranks = (unsigned)c->ranks, .rank = (unsigned)q, .seq = z->seq, .op = k->op,
                .size = k->size, .aux = k->aux};
    if (send_xfer_(z, &z->peer[q], h, out, bytes, mtrl_time_mono() + c->timeout_ms / 1e3, why, sizeof why))
        return zc_fail_(c, MTRL_ERR_PEER, 0, err, "%s (call %u): cannot answer rank %d: %s", op_names_[k->op], z->seq, q,
                        why);
    return MTRL_OK;
}

// A rank other than 0: sends its input of call k, then receives its result into out[bytes].
static mtrl_status exchange_(mtrl_dist_comm *c, const zc_call *k, void *out, uint64_t bytes, mtrl_error *err) {
    zc_state *z = c->impl;
    const char *op = op_names_[k->op];
    char why[256];
    zc_hdr h = {.kind = ZC_DATA, .ranks = (unsigned)c->ranks, .rank = (unsigned)c->rank, .seq = z->seq, .op = k->op,
                .size = k->size, .aux = k->aux};
    if (send_xfer_(z, NULL, h, k->in, k->in_bytes, mtrl_time_mono() + wait_s_(c), why, sizeof why))
        return zc_fail_(c, MTRL_ERR_TIMEOUT, 0, err, "%s (call %u): cannot send to rank 0 at %s: %s", op, z->seq,
                        z->where, why);
    double deadline = mtrl_time_mono() + wait_s_(c);
    uint64_t got = 0;
    mtrl_status st = MTRL_OK;
    zmq_msg_t data;
    zmq_msg_init(&data);
    for (;;) {
        zc_hdr r;
        size_t junk = 0;
        zmq_msg_close(&data);
        zmq_msg_init(&data);
        int n = recv_msg_(z, deadline, NULL, &r, &data, &junk, why, sizeof why);
        if (n == 0) {
            st = zc_fail_(c, MTRL_ERR_TIMEOUT, 0, err, "%s (call %u): no answer from rank 0 at %s within %d ms (is rank 0 "
                          "running, and in the same call?)", op, z->seq, z->where, (int)(wait_s_(c) * 1e3));
            break;
        }
        if (n < 0) {
            st = zc_fail_(c, MTRL_ERR_IO, 0, err, "%s (call %u): %s", op, z->seq, why);
            break;
        }
        if (n == 2 || r.version != ZC_VERSION) {
            st = zc_fail_(c, MTRL_ERR_FORMAT, 0, err, "%s (call %u): rank 0 at %s sent %zu bytes that are not a version "
                          "%d message", op, z->seq, z->where, junk, ZC_VERSION);
            break;
        }
        if (r.kind == ZC_FAIL) {
            st = zc_fail_(c, code_of_(r.code), 1, err, "rank 0 reports: %.*s",
                          (int)(r.frame < ZC_TEXT_MAX ? r.frame : ZC_TEXT_MAX), r.frame ? (char *)zmq_msg_data(&data) : "");
            break;
        }
        if (r.kind != ZC_RESULT || r.seq != z->seq || r.op != k->op || r.total != bytes || r.offset != got ||
            r.offset + r.frame > bytes || (r.frame == 0 && bytes != 0)) {
            st = zc_fail_(c, MTRL_ERR_FORMAT, 0, err, "%s (call %u): rank 0 at %s answered kind %u, call %u, %s, %u bytes at "
                          "%llu of %llu; expected %llu bytes from %llu", op, z->seq, z->where, r.kind, r.seq,
                          op_name_(r.op), r.frame, (unsigned long long)r.offset, (unsigned long long)r.total,
                          (unsigned long long)bytes, (unsigned long long)got);
            break;
        }
        if (r.frame) memcpy((uint8_t *)out + got, zmq_msg_data(&data), r.frame);
        got += r.frame;
        if (got == bytes) break;
        deadline = mtrl_time_mono() + wait_s_(c);
    }
    zmq_msg_close(&data);
    return st;
}

// Every call starts here: a failed world refuses it; device buffers are refused.
static mtrl_status begin_(mtrl_dist_comm *c, unsigned op, const void *const *bufs, int n, mtrl_error *err) {
    zc_state *z = c->impl;
    if (z->failed)
        return mtrl_error_set(err, MTRL_ERR_STATE, "dist_comm zmq: %s on rank %d of %d: the world failed earlier (%s)",
                              op_names_[op], c->rank, c->ranks, z->fail_msg);
#ifdef MTRL_HAVE_CUDA
    for (int i = 0; i < n; i++) {
        struct cudaPointerAttributes a;
        if (!bufs[i]) continue;
        if (cudaPointerGetAttributes(&a, bufs[i]) != cudaSuccess) {
            cudaGetLastError(); // a host pointer CUDA does not know: fine
            continue;
        }
        if (a.type == cudaMemoryTypeDevice)
            return zc_fail_(c, MTRL_ERR_USAGE, 0, err, "%s (call %u): a device buffer (the zmq backend takes host memory; "
                            "GPUs use nccl)", op_names_[op], z->seq);
    }
#else
    (void)bufs, (void)n;
#endif
    z->seq++;
    return MTRL_OK;
}

// ---- the ops -------------------------------------------------------------------------------------------

static mtrl_status zc_barrier_(mtrl_dist_comm *c, mtrl_error *err) {
    mtrl_status s = begin_(c, OP_BARRIER, NULL, 0, err);
    if (s != MTRL_OK) return s;
    zc_call k = {.op = OP_BARRIER};
    if (c->rank) return exchange_(c, &k, NULL, 0, err);
    if ((s = gather_(c, &k, err)) != MTRL_OK) return s;
    for (int q = 1; q < c->ranks && s == MTRL_OK; q++) s = answer_(c, &k, q, NULL, 0, err);
    return s;
}

static mtrl_status zc_allreduce_(mtrl_dist_comm *c, void *buf, size_t count, mtrl_dtype dtype, mtrl_error *err) {
    mtrl_status s = begin_(c, OP_ALLREDUCE, (const void *[]){buf}, 1, err);
    if (s != MTRL_OK) return s;
    zc_state *z = c->impl;
    uint64_t bytes = (uint64_t)count * mtrl_dtype_size(dtype);
    zc_call k = {.op = OP_ALLREDUCE, .size = count, .aux = dtype, .in = buf, .in_bytes = bytes};
    if (c->rank) return exchange_(c, &k, buf, bytes, err);
    if ((s = gather_(c, &k, err)) != MTRL_OK) return s;
    // In place on rank 0's buffer, one rank at a time: ((r0 + r1) + r2) ..., the local bits.
    for (int q = 1; q < c->ranks; q++) {
        if (dtype == MTRL_DT_F32) {
            float *a = buf;
            const float *b = (const float *)z->in[q].buf;
            for (size_t i = 0; i < count; i++) a[i] = a[i] + b[i];
        } else {
            double *a = buf;
            const double *b = (const double *)z->in[q].buf;
            for (size_t i = 0; i < count; i++) a[i] = a[i] + b[i];
        }
    }
    for (int q = 1; q < c->ranks && s == MTRL_OK; q++) s = answer_(c, &k, q, buf, bytes, err);
    return s;
}

static mtrl_status zc_reduce_scatter_(mtrl_dist_comm *c, const float *send, float *recv, size_t count, mtrl_error *err) {
    mtrl_status s = begin_(c, OP_REDUCE_SCATTER, (const void *[]){send, recv}, 2, err);
    if (s != MTRL_OK) return s;
    zc_state *z = c->impl;
    uint64_t chunk = (uint64_t)count * sizeof(float);
    zc_call k = {.op = OP_REDUCE_SCATTER, .size = count, .in = send, .in_bytes = chunk * (uint64_t)c->ranks};
    if (c->rank) return exchange_(c, &k, recv, chunk, err);
    if ((s = gather_(c, &k, err)) != MTRL_OK) return s;
    // Chunk r of the sum, rank by rank in rank order; rank 0's own straight into recv.
    for (int r = c->ranks - 1; r >= 0 && s == MTRL_OK; r--) {
        float *acc = r ? grow_(&z->tmp, &z->tmp_cap, chunk) : recv;
        size_t base = count * (size_t)r;
        for (size_t i = 0; i < count; i++) acc[i] = send[base + i];
        for (int q = 1; q < c->ranks; q++) {
            const float *b = (const float *)z->in[q].buf + base;
            for (size_t i = 0; i < count; i++) acc[i] = acc[i] + b[i];
        }
        if (r) s = answer_(c, &k, r, acc, chunk, err);
    }
    return s;
}

static mtrl_status zc_allgather_(mtrl_dist_comm *c, const void *send, void *recv, size_t bytes, mtrl_error *err) {
    mtrl_status s = begin_(c, OP_ALLGATHER, (const void *[]){send, recv}, 2, err);
    if (s != MTRL_OK) return s;
    zc_state *z = c->impl;
    uint64_t all = (uint64_t)bytes * (uint64_t)c->ranks;
    zc_call k = {.op = OP_ALLGATHER, .size = bytes, .in = send, .in_bytes = bytes};
    if (c->rank) return exchange_(c, &k, recv, all, err); // in place: the own chunk comes back as it was
    if ((s = gather_(c, &k, err)) != MTRL_OK) return s;
    if (recv != send && bytes) memmove(recv, send, bytes);
    for (int q = 1; q < c->ranks; q++)
        if (bytes) memcpy((uint8_t *)recv + (size_t)q * bytes, z->in[q].buf, bytes);
    for (int q = 1; q < c->ranks && s == MTRL_OK; q++) s = answer_(c, &k, q, recv, all, err);
    return s;
}

static mtrl_status zc_broadcast_(mtrl_dist_comm *c, void *buf, size_t bytes, int root, mtrl_error *err) {
    mtrl_status s = begin_(c, OP_BROADCAST, (const void *[]){buf}, 1, err);
    if (s != MTRL_OK) return s;
    zc_state *z = c->impl;
    int me_root = c->rank == root;
    zc_call k = {.op = OP_BROADCAST, .size = bytes, .aux = root, .in = buf, .in_bytes = me_root ? bytes : 0};
    if (c->rank) return exchange_(c, &k, buf, me_root ? 0 : bytes, err);
    if ((s = gather_(c, &k, err)) != MTRL_OK) return s;
    if (!me_root && bytes) memcpy(buf, z->in[root].buf, bytes);
    for (int q = 1; q < c->ranks && s == MTRL_OK; q++) s = answer_(c, &k, q, buf, q == root ? 0 : bytes, err);
    return s;
}

static mtrl_status zc_alltoallv_(mtrl_dist_comm *c, const void *send, const int64_t *send_count,
                                 const int64_t *send_offset, void *recv, const int64_t *recv_count,
                                 const int64_t *recv_offset, size_t eb, mtrl_error *err) {
    mtrl_status s = begin_(c, OP_ALLTOALLV, (const void *[]){send, recv}, 2, err);
    if (s != MTRL_OK) return s;
    zc_state *z = c->impl;
    int R = c->ranks;
    uint64_t n_send = 0, n_recv = 0;
    for (int q = 0; q < R; q++) n_send += (uint64_t)send_count[q], n_recv += (uint64_t)recv_count[q];
    // This rank's input: its counts, then its rows grouped by destination.
    uint64_t in_bytes = 16 * (uint64_t)R + n_send * eb;
    uint8_t *in = grow_(&z->tmp, &z->tmp_cap, in_bytes + n_recv * eb);
    for (int q = 0; q < R; q++) put_le_(in + 8 * q, (uint64_t)send_count[q], 8), put_le_(in + 8 * (R + q), (uint64_t)recv_count[q], 8);
    uint8_t *at = in + 16 * (size_t)R;
    for (int q = 0; q < R; q++) {
        size_t n = (size_t)send_count[q] * eb;
        if (n) memcpy(at, (const uint8_t *)send + (size_t)send_offset[q] * eb, n);
        at += n;
    }
    zc_call k = {.op = OP_ALLTOALLV, .size = eb, .in = in, .in_bytes = in_bytes};
    uint8_t *packed = in + in_bytes; // the rows for this rank, from every rank in rank order
    if (c->rank) {
        if ((s = exchange_(c, &k, packed, n_recv * eb, err)) != MTRL_OK) return s;
    } else {
        if ((s = gather_(c, &k, err)) != MTRL_OK) return s;
        // Every rank's counts: the rows q sends r must be the rows r expects from q.
        const uint8_t *inq[MTRL_DIST_RANKS_MAX];
        inq[0] = in;
        for (int q = 1; q < R; q++) inq[q] = z->in[q].buf;
        for (int q = 0; q < R; q++)
            for (int r = 0; r < R; r++) {
                int64_t sends = (int64_t)get_le_(inq[q] + 8 * r, 8), wants = (int64_t)get_le_(inq[r] + 8 * (R + q), 8);
                if (sends != wants)
                    return zc_fail_(c, MTRL_ERR_MISMATCH, 0, err, "all_to_all_v: rank %d sends %lld rows to rank %d, which "
                                    "expects %lld", q, (long long)sends, r, (long long)wants);
            }
        // The rows for destination r: from each q, at the rows q sends before r.
        uint8_t *out = NULL;
        size_t out_cap = 0;
        for (int r = R - 1; r >= 0 && s == MTRL_OK; r--) {
            uint64_t bytes = 0;
            for (int q = 0; q < R; q++) bytes += (uint64_t)get_le_(inq[r] + 8 * (R + q), 8) * eb;
            uint8_t *dst = r ? grow_(&out, &out_cap, bytes) : packed;
            for (int q = 0; q < R; q++) {
                uint64_t before = 0;
                for (int d = 0; d < r; d++) before += get_le_(inq[q] + 8 * d, 8);
                size_t n = (size_t)get_le_(inq[q] + 8 * r, 8) * eb;
                if (n) memcpy(dst, inq[q] + 16 * (size_t)R + before * eb, n);
                dst += n;
            }
            if (r) s = answer_(c, &k, r, out, bytes, err);
        }
        free(out);
        if (s != MTRL_OK) return s;
    }
    for (int q = 0; q < R; q++) {
        size_t n = (size_t)recv_count[q] * eb;
        if (n) memcpy((uint8_t *)recv + (size_t)recv_offset[q] * eb, packed, n);
        packed += n;
    }
    return MTRL_OK;
}

static void zc_free_(mtrl_dist_comm *c) {
    zc_state *z = c->impl;
    if (z->open) {
        // The last answers may still be queued: give them the world's timeout to go out.
        int linger = c->timeout_ms;
        zmq_setsockopt(z->s.sock, ZMQ_LINGER, &linger, sizeof linger);
        mtrl_wire_sock_close(&z->s);
    }
    if (z->ctx && z->own_ctx) zmq_ctx_term(z->ctx);
    for (int q = 0; q < MTRL_DIST_RANKS_MAX; q++) free(z->in[q].buf);
    free(z->tmp);
    free(z);
}

static const mtrl_dist_comm_ops zmq_ops_ = {"zmq",          zc_barrier_,   zc_allreduce_, zc_reduce_scatter_,
                                            zc_allgather_, zc_broadcast_, zc_alltoallv_, zc_free_};

// ---- joining -------------------------------------------------------------------------------------------

// Rank 0: every other rank's HELLO within the timeout, then a WELCOME to each.
static mtrl_status join_serve_(mtrl_dist_comm *c, int join_ms, mtrl_error *err) {
    zc_state *z = c->impl;
    double deadline = mtrl_time_mono() + join_ms / 1e3;
    int owed = c->ranks - 1;
    char why[256];
    zmq_msg_t data;
    zmq_msg_init(&data);
    while (owed > 0) {
        mtrl_wire_peer from = {0};
        zc_hdr h;
        size_t junk = 0;
        zmq_msg_close(&data);
        zmq_msg_init(&data);
        int got = recv_msg_(z, deadline, &from, &h, &data, &junk, why, sizeof why);
        if (got == 0) {
            char miss[256];
            size_t at = 0;
            miss[0] = 0;
            for (int q = 1; q < c->ranks && at + 16 < sizeof miss; q++)
                if (!z->joined[q]) at += (size_t)snprintf(miss + at, sizeof miss - at, "%s%d", at ? ", " : "", q);
            zmq_msg_close(&data);
            return zc_fail_(c, MTRL_ERR_TIMEOUT, 0, err, "join at %s: rank(s) %s did not join within %d ms%s%s", z->where,
                            miss, join_ms, z->refused[0] ? "; refused: " : "", z->refused);
        }
        if (got < 0) {
            zmq_msg_close(&data);
            return zc_fail_(c, MTRL_ERR_IO, 0, err, "join at %s: %s", z->where, why);
        }
        mtrl_status code = MTRL_ERR_FORMAT;
        why[0] = 0;
        if (got == 2 || h.kind != ZC_HELLO)
            snprintf(why, sizeof why, "a message of %zu bytes that is not a join request", junk);
        else if (h.version != ZC_VERSION)
            code = MTRL_ERR_MISMATCH, snprintf(why, sizeof why, "protocol version %u; rank 0 speaks %d", h.version, ZC_VERSION);
        else if (h.ranks != (unsigned)c->ranks)
            code = MTRL_ERR_MISMATCH, snprintf(why, sizeof why, "rank %u says the world has %u ranks; rank 0's has %d",
                                               h.rank, h.ranks, c->ranks);
        else if (h.rank < 1 || h.rank >= (unsigned)c->ranks)
            code = MTRL_ERR_USAGE, snprintf(why, sizeof why, "rank %u is not one of ranks 1 .. %d", h.rank, c->ranks - 1);
        else if (z->joined[h.rank])
            code = MTRL_ERR_STATE, snprintf(why, sizeof why, "rank %u has joined already (two processes with one rank?)",
                                            h.rank);
        if (why[0]) {
            note_refused_(z, why);
            if (got == 1) { // it speaks this protocol: tell it why
                mtrl_wire_peer *p = &from;
                send_fail_(z, p, c->ranks, (int)h.rank, 0, code, why);
            }
            continue;
        }
        z->peer[h.rank] = from;
        z->joined[h.rank] = 1;
        owed--;
    }
    zmq_msg_close(&data);
    for (int q = 1; q < c->ranks; q++) {
        zc_hdr h = {.kind = ZC_WELCOME, .ranks = (unsigned)c->ranks, .rank = (unsigned)q, .op = OP_JOIN};
        if (send_msg_(z, &z->peer[q], &h, NULL, mtrl_time_mono() + c->timeout_ms / 1e3, why, sizeof why))
            return zc_fail_(c, MTRL_ERR_PEER, 0, err, "join at %s: cannot welcome rank %d: %s", z->where, q, why);
    }
    return MTRL_OK;
}

// A rank other than 0: its HELLO, then rank 0's WELCOME (or refusal).
static mtrl_status join_ask_(mtrl_dist_comm *c, int join_ms, mtrl_error *err) {
    zc_state *z = c->impl;
    char why[256];
    zc_hdr h = {.kind = ZC_HELLO, .ranks = (unsigned)c->ranks, .rank = (unsigned)c->rank, .op = OP_JOIN};
    // Queued until the connection is up (ZeroMQ reconnects until rank 0 listens).
    if (send_msg_(z, NULL, &h, NULL, mtrl_time_mono() + join_wait_s_(join_ms), why, sizeof why))
        return zc_fail_(c, MTRL_ERR_IO, 1, err, "join: cannot send to rank 0 at %s: %s", z->where, why);
    zmq_msg_t data;
    zmq_msg_init(&data);
    zc_hdr r;
    size_t junk = 0;
    int got = recv_msg_(z, mtrl_time_mono() + join_wait_s_(join_ms), NULL, &r, &data, &junk, why, sizeof why);
    mtrl_status st = MTRL_OK;
    if (got == 0)
        st = zc_fail_(c, MTRL_ERR_TIMEOUT, 1, err, "join: no answer from rank 0 at %s within %d ms (is rank 0 running, and "
                      "the rendezvous host and port the same on every rank?)", z->where, (int)(join_wait_s_(join_ms) * 1e3));
    else if (got < 0)
        st = zc_fail_(c, MTRL_ERR_IO, 1, err, "join: %s", why);
    else if (got == 2 || r.version != ZC_VERSION)
        st = zc_fail_(c, MTRL_ERR_FORMAT, 1, err, "join: %s answered with %zu bytes that are not a version %d message",
                      z->where, junk, ZC_VERSION);
    else if (r.kind == ZC_FAIL)
        st = zc_fail_(c, code_of_(r.code), 1, err, "join: rank 0 at %s refused: %.*s", z->where,
                      (int)(r.frame < ZC_TEXT_MAX ? r.frame : ZC_TEXT_MAX), r.frame ? (char *)zmq_msg_data(&data) : "");
    else if (r.kind != ZC_WELCOME || r.ranks != (unsigned)c->ranks || r.rank != (unsigned)c->rank)
        st = zc_fail_(c, MTRL_ERR_FORMAT, 1, err, "join: rank 0 at %s answered kind %u for rank %u of %u", z->where, r.kind,
                      r.rank, r.ranks);
    zmq_msg_close(&data);
    return st;
}

mtrl_status mtrl_dist_comm_init_zmq(mtrl_dist_comm **out, int ranks, int rank, const mtrl_dist_rendezvous *rv,
                                    int join_timeout_ms, int timeout_ms, mtrl_error *err) {
    *out = NULL;
    if (ranks < 1 || ranks > MTRL_DIST_RANKS_MAX || rank < 0 || rank >= ranks)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "dist_comm zmq: rank %d of %d: the world must have 1 to %d ranks and "
                              "the rank be one of them", rank, ranks, MTRL_DIST_RANKS_MAX);
    if (timeout_ms <= 0 || join_timeout_ms <= 0)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "dist_comm zmq: timeouts %d ms (join), %d ms (calls): must be positive "
                              "(no call may wait forever)", join_timeout_ms, timeout_ms);
    if (ranks > 1 && (!rv || !rv->host[0] || rv->port < 1 || rv->port > 65535))
        return mtrl_error_set(err, MTRL_ERR_USAGE, "dist_comm zmq: rank %d of %d: rendezvous '%s' port %d: a host and a "
                              "port 1 .. 65535 are needed", rank, ranks, rv ? rv->host : "", rv ? rv->port : 0);
    zc_state *z = xcalloc(1, sizeof *z);
    mtrl_dist_comm *c = xcalloc(1, sizeof *c);
    *c = (mtrl_dist_comm){.ops = &zmq_ops_, .rank = rank, .ranks = ranks, .timeout_ms = timeout_ms, .impl = z, .gpu = -1};
    if (ranks == 1) {
        *out = c;
        return MTRL_OK;
    }
    snprintf(z->where, sizeof z->where, "%s:%d", rv->host, rv->port);
    z->ctx = rv->zmq_ctx;
    if (!z->ctx) z->ctx = zmq_ctx_new(), z->own_ctx = 1;
    mtrl_status st = MTRL_OK;
    char ep[MTRL_DIST_HOST_MAX + 32];
    mtrl_wire_sockopts o = rv->opts ? *rv->opts : mtrl_wire_sockopts_default();
    o.reconnect_ivl_max_ms = 500; // a rank started before rank 0 listens finds it soon after
    mtrl_wire_limits lim = mtrl_wire_limits_default();
    lim.max_payload = MTRL_DIST_ZMQ_FRAME; // a larger frame disconnects its sender
    mtrl_error e2 = {0};
    if (!z->ctx) {
        st = mtrl_error_set(err, MTRL_ERR_IO, "dist_comm zmq: cannot create a context: %s", zmq_strerror(zmq_errno()));
    } else if (rank == 0) {
        // ZeroMQ binds addresses, not names: the host's IPv4 address, which the others reach.
        struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *ai = NULL;
        int g = getaddrinfo(rv->host, NULL, &hints, &ai);
        if (g != 0) {
            st = mtrl_error_set(err, MTRL_ERR_USAGE, "dist_comm zmq: rank 0 of %d: cannot resolve the rendezvous host "
                                "'%s': %s", ranks, rv->host, gai_strerror(g));
        } else {
            char ip[INET_ADDRSTRLEN];
            inet_ntop(AF_INET, &((struct sockaddr_in *)ai->ai_addr)->sin_addr, ip, sizeof ip);
            freeaddrinfo(ai);
            snprintf(ep, sizeof ep, "tcp://%s:%d", ip, rv->port);
            if (mtrl_wire_router_open(&z->s, z->ctx, ep, &lim, &o, &e2) != MTRL_OK)
                st = mtrl_error_set(err, MTRL_ERR_IO, "dist_comm zmq: rank 0 of %d cannot listen at %s (%s): %s (is the "
                                    "rendezvous host this node, and the port free?)", ranks, z->where, ip, e2.msg);
            else z->open = 1, st = join_serve_(c, join_timeout_ms, err);
        }
    } else {
        snprintf(ep, sizeof ep, "tcp://%s:%d", rv->host, rv->port);
        if (mtrl_wire_dealer_open(&z->s, z->ctx, ep, (uint32_t)rank, 0, &lim, &o, &e2) != MTRL_OK)
            st = mtrl_error_set(err, MTRL_ERR_IO, "dist_comm zmq: rank %d of %d: cannot connect to %s: %s", rank, ranks,
                                z->where, e2.msg);
        else z->open = 1, st = join_ask_(c, join_timeout_ms, err);
    }
    if (st != MTRL_OK) {
        if (z->open) { // a refusal or a failure just sent should not wait out a long linger
            int linger = 200;
            zmq_setsockopt(z->s.sock, ZMQ_LINGER, &linger, sizeof linger);
            mtrl_wire_sock_close(&z->s);
            z->open = 0;
        }
        zc_free_(c);
        free(c);
        return st;
    }
    *out = c;
    return MTRL_OK;
}
