// dist_comm.c: the collectives' public calls (dist_comm.h) and the local backend: R threads
// of one process meeting at a barrier of a mutex and a condition variable.
//
// A local collective is one or two meetings. At the first, every rank has posted its
// arguments (call[rank]); the last to arrive checks that they agree (same op, same sizes, the
// all-to-all counts of both sides) and sizes the shared scratch, with the mutex held. Between
// the meetings each rank reads the others' buffers and writes only its own output (or its
// slice of the scratch). The second meeting lets the callers reuse their inputs. A reduction
// in place (all-reduce) sums into the scratch first, so no rank reads a buffer its owner has
// already overwritten; the scratch is safe to copy out after the second meeting because the
// next collective's first meeting waits for every rank.
#include "learner/dist_comm.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/check.h"
#include "common/timeutil.h"
#include "learner/dist_comm_impl.h"
#include "learner/dist_plan.h"

enum { OP_BARRIER, OP_ALLREDUCE, OP_REDUCE_SCATTER, OP_ALLGATHER, OP_BROADCAST, OP_ALLTOALLV };
static const char *const op_names_[] = {"barrier", "all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                        "all_to_all_v"};

// One rank's arguments of the collective in progress.
typedef struct comm_call {
    int op;
    size_t size;         // elements (all_reduce, reduce_scatter), bytes (all_gather, broadcast), row bytes
    int aux;             // the dtype (all_reduce), the root (broadcast)
    const void *send;
    void *recv;
    const int64_t *send_count, *send_offset, *recv_count, *recv_offset;
} comm_call;

struct mtrl_dist_world {
    int ranks, timeout_ms;
    pthread_mutex_t mu;
    pthread_cond_t cv;          // on CLOCK_MONOTONIC: the timeout ignores wall-clock jumps
    int arrived;                // ranks at the current meeting
    unsigned long generation;   // meetings completed
    int here[MTRL_DIST_RANKS_MAX];
    int taken[MTRL_DIST_RANKS_MAX];
    comm_call call[MTRL_DIST_RANKS_MAX];
    int failed;                 // a call failed: every later call is refused
    mtrl_status fail_code;
    char fail_msg[MTRL_ERROR_MSG_MAX / 2];
    void *scratch;
    size_t scratch_cap;
};

mtrl_status mtrl_dist_world_init(mtrl_dist_world **out, int ranks, int timeout_ms, mtrl_error *err) {
    *out = NULL;
    if (ranks < 1 || ranks > MTRL_DIST_RANKS_MAX)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "dist_comm: %d ranks: must be 1 to %d", ranks, MTRL_DIST_RANKS_MAX);
    if (timeout_ms <= 0)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "dist_comm: timeout %d ms: must be positive (no call may wait forever)",
                              timeout_ms);
    mtrl_dist_world *w = xcalloc(1, sizeof *w);
    w->ranks = ranks;
    w->timeout_ms = timeout_ms;
    pthread_mutex_init(&w->mu, NULL);
    mtrl_time_cond_init_mono(&w->cv);
    *out = w;
    return MTRL_OK;
}

void mtrl_dist_world_free(mtrl_dist_world *w) {
    if (!w) return;
    for (int r = 0; r < w->ranks; r++) MTRL_CHECKF(!w->taken[r], "dist_comm: world freed before rank %d's handle", r);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    free(w->scratch);
    free(w);
}

// ---- the meeting ---------------------------------------------------------------------------------

// The ranks not at the current meeting, as "2, 5" (mutex held).
static void missing_ranks_(const mtrl_dist_world *w, char *buf, size_t cap) {
    size_t at = 0;
    buf[0] = 0;
    for (int r = 0; r < w->ranks && at + 16 < cap; r++)
        if (!w->here[r]) at += (size_t)snprintf(buf + at, cap - at, "%s%d", at ? ", " : "", r);
}

static void world_fail_(mtrl_dist_world *w, mtrl_status code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void world_fail_(mtrl_dist_world *w, mtrl_status code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->fail_msg, sizeof w->fail_msg, fmt, ap);
    va_end(ap);
    w->failed = 1;
    w->fail_code = code;
    pthread_cond_broadcast(&w->cv);
}

// The first meeting's checks (the last rank to arrive, mutex held): every rank called the same
// op with the same sizes, and each all-to-all count matches its peer's.
static void calls_check_(mtrl_dist_world *w) {
    const comm_call *a = &w->call[0];
    for (int r = 1; r < w->ranks; r++) {
        const comm_call *b = &w->call[r];
        if (b->op != a->op || b->size != a->size || b->aux != a->aux) {
            world_fail_(w, MTRL_ERR_MISMATCH, "the ranks called different collectives: rank 0 %s (size %zu, %d), rank %d "
                        "%s (size %zu, %d)", op_names_[a->op], a->size, a->aux, r, op_names_[b->op], b->size, b->aux);
            return;
        }
    }
    if (a->op != OP_ALLTOALLV) return;
    for (int r = 0; r < w->ranks; r++)
        for (int q = 0; q < w->ranks; q++)
            if (w->call[q].send_count[r] != w->call[r].recv_count[q]) {
                world_fail_(w, MTRL_ERR_MISMATCH, "all_to_all_v: rank %d sends %lld rows to rank %d, which expects %lld", q,
                            (long long)w->call[q].send_count[r], r, (long long)w->call[r].recv_count[q]);
                return;
            }
}

// Waits until every rank has reached this meeting of the collective in progress, at most the
// world's timeout. first: the collective's first meeting, whose last arrival checks the calls
// and grows the scratch to scratch_bytes.
static mtrl_status world_meet_(mtrl_dist_comm *c, int first, size_t scratch_bytes, mtrl_error *err) {
    mtrl_dist_world *w = c->impl;
    const char *op = op_names_[w->call[c->rank].op];
    struct timespec deadline = mtrl_time_mono_deadline(w->timeout_ms);
    pthread_mutex_lock(&w->mu);
    if (w->failed) {
        mtrl_status s = mtrl_error_set(err, MTRL_ERR_STATE, "dist_comm local: %s on rank %d of %d: the world failed earlier (%s)",
                                       op, c->rank, w->ranks, w->fail_msg);
        pthread_mutex_unlock(&w->mu);
        return s;
    }
    w->here[c->rank] = 1;
    if (++w->arrived == w->ranks) {
        if (first) calls_check_(w);
        if (!w->failed && scratch_bytes > w->scratch_cap) {
            free(w->scratch);
            w->scratch = xmalloc(scratch_bytes);
            w->scratch_cap = scratch_bytes;
        }
        if (!w->failed) {
            w->arrived = 0;
            memset(w->here, 0, sizeof w->here);
            w->generation++;
            pthread_cond_broadcast(&w->cv);
            pthread_mutex_unlock(&w->mu);
            return MTRL_OK;
        }
    }
    unsigned long gen = w->generation;
    while (w->generation == gen && !w->failed) {
        int rc = pthread_cond_timedwait(&w->cv, &w->mu, &deadline);
        if (rc == ETIMEDOUT && w->generation == gen && !w->failed) {
            char miss[256];
            missing_ranks_(w, miss, sizeof miss);
            world_fail_(w, MTRL_ERR_TIMEOUT, "%s: rank(s) %s did not arrive within the timeout of %d ms", op, miss,
                        w->timeout_ms);
        }
    }
    mtrl_status s = MTRL_OK;
    if (w->generation == gen)
        s = mtrl_error_set(err, w->fail_code, "dist_comm local: rank %d of %d: %s", c->rank, w->ranks, w->fail_msg);
    pthread_mutex_unlock(&w->mu);
    return s;
}

// Posts this rank's arguments and meets the others.
static mtrl_status world_enter_(mtrl_dist_comm *c, const comm_call *call, size_t scratch_bytes, mtrl_error *err) {
    mtrl_dist_world *w = c->impl;
    w->call[c->rank] = *call; // only this rank writes its slot, and only outside a collective
    return world_meet_(c, 1, scratch_bytes, err);
}

// ---- the local ops -------------------------------------------------------------------------------

static mtrl_status local_barrier_(mtrl_dist_comm *c, mtrl_error *err) {
    return world_enter_(c, &(comm_call){.op = OP_BARRIER}, 0, err);
}

// Σ over the ranks, in rank order, of element i of each rank's buffer (send or recv).
static float sum_f32_(const mtrl_dist_world *w, int of_send, size_t i) {
    float s = 0;
    for (int q = 0; q < w->ranks; q++) {
        const float *p = of_send ? w->call[q].send : w->call[q].recv;
        s = q ? s + p[i] : p[i];
    }
    return s;
}
static double sum_f64_(const mtrl_dist_world *w, size_t i) {
    double s = 0;
    for (int q = 0; q < w->ranks; q++) s = q ? s + ((const double *)w->call[q].recv)[i] : ((const double *)w->call[q].recv)[i];
    return s;
}

static mtrl_status local_allreduce_(mtrl_dist_comm *c, void *buf, size_t count, mtrl_dtype dtype, mtrl_error *err) {
    mtrl_dist_world *w = c->impl;
    size_t es = mtrl_dtype_size(dtype);
    mtrl_status s = world_enter_(c, &(comm_call){.op = OP_ALLREDUCE, .size = count, .aux = (int)dtype, .recv = buf},
                                 count * es, err);
    if (s != MTRL_OK) return s;
    // Each rank sums its slice of the elements into the scratch; all copy the whole out.
    size_t lo = count * (size_t)c->rank / (size_t)w->ranks, hi = count * (size_t)(c->rank + 1) / (size_t)w->ranks;
    for (size_t i = lo; i < hi; i++) {
        if (dtype == MTRL_DT_F32) ((float *)w->scratch)[i] = sum_f32_(w, 0, i);
        else ((double *)w->scratch)[i] = sum_f64_(w, i);
    }
    if ((s = world_meet_(c, 0, 0, err)) != MTRL_OK) return s;
    if (count) memcpy(buf, w->scratch, count * es);
    return MTRL_OK;
}

static mtrl_status local_reduce_scatter_(mtrl_dist_comm *c, const float *send, float *recv, size_t count,
                                         mtrl_error *err) {
    mtrl_dist_world *w = c->impl;
    mtrl_status s = world_enter_(c, &(comm_call){.op = OP_REDUCE_SCATTER, .size = count, .send = send, .recv = recv}, 0,
                                 err);
    if (s != MTRL_OK) return s;
    size_t base = count * (size_t)c->rank;
    for (size_t i = 0; i < count; i++) recv[i] = sum_f32_(w, 1, base + i);
    return world_meet_(c, 0, 0, err);
}

static mtrl_status local_allgather_(mtrl_dist_comm *c, const void *send, void *recv, size_t bytes, mtrl_error *err) {
    mtrl_dist_world *w = c->impl;
    mtrl_status s = world_enter_(c, &(comm_call){.op = OP_ALLGATHER, .size = bytes, .send = send, .recv = recv}, 0, err);
    if (s != MTRL_OK) return s;
    for (int q = 0; q < w->ranks; q++) {
        char *dst = (char *)recv + (size_t)q * bytes;
        if (dst != w->call[q].send && bytes) memcpy(dst, w->call[q].send, bytes);
    }
    return world_meet_(c, 0, 0, err);
}

static mtrl_status local_broadcast_(mtrl_dist_comm *c, void *buf, size_t bytes, int root, mtrl_error *err) {
    mtrl_dist_world *w = c->impl;
    mtrl_status s =
        world_enter_(c, &(comm_call){.op = OP_BROADCAST, .size = bytes, .aux = root, .send = buf, .recv = buf}, 0, err);
    if (s != MTRL_OK) return s;
    if (c->rank != root && bytes) memcpy(buf, w->call[root].send, bytes);
    return world_meet_(c, 0, 0, err);
}

static mtrl_status local_alltoallv_(mtrl_dist_comm *c, const void *send, const int64_t *send_count,
                                    const int64_t *send_offset, void *recv, const int64_t *recv_count,
                                    const int64_t *recv_offset, size_t eb, mtrl_error *err) {
    mtrl_dist_world *w = c->impl;
    comm_call call = {.op = OP_ALLTOALLV, .size = eb, .send = send, .recv = recv, .send_count = send_count,
                      .send_offset = send_offset, .recv_count = recv_count, .recv_offset = recv_offset};
    mtrl_status s = world_enter_(c, &call, 0, err);
    if (s != MTRL_OK) return s;
    for (int q = 0; q < w->ranks; q++) {
        const comm_call *p = &w->call[q];
        size_t n = (size_t)recv_count[q] * eb;
        if (n) memcpy((char *)recv + (size_t)recv_offset[q] * eb, (const char *)p->send + (size_t)p->send_offset[c->rank] * eb, n);
    }
    return world_meet_(c, 0, 0, err);
}

static void local_free_(mtrl_dist_comm *c) {
    mtrl_dist_world *w = c->impl;
    pthread_mutex_lock(&w->mu);
    w->taken[c->rank] = 0;
    pthread_mutex_unlock(&w->mu);
}

static const mtrl_dist_comm_ops local_ops_ = {"local",           local_barrier_,   local_allreduce_,
                                              local_reduce_scatter_, local_allgather_, local_broadcast_,
                                              local_alltoallv_,  local_free_};

mtrl_status mtrl_dist_comm_init_local(mtrl_dist_comm **out, mtrl_dist_world *w, int rank, mtrl_error *err) {
    *out = NULL;
    if (rank < 0 || rank >= w->ranks)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "dist_comm local: rank %d of a world of %d", rank, w->ranks);
    pthread_mutex_lock(&w->mu);
    int taken = w->taken[rank];
    w->taken[rank] = 1;
    pthread_mutex_unlock(&w->mu);
    if (taken) return mtrl_error_set(err, MTRL_ERR_USAGE, "dist_comm local: rank %d has a handle already", rank);
    mtrl_dist_comm *c = xcalloc(1, sizeof *c);
    *c = (mtrl_dist_comm){&local_ops_, rank, w->ranks, w->timeout_ms, w};
    *out = c;
    return MTRL_OK;
}

// ---- the public calls ------------------------------------------------------------------------------

void mtrl_dist_comm_free(mtrl_dist_comm *c) {
    if (!c) return;
    c->ops->free(c);
    free(c);
}

int mtrl_dist_comm_rank(const mtrl_dist_comm *c) { return c->rank; }
int mtrl_dist_comm_ranks(const mtrl_dist_comm *c) { return c->ranks; }
const char *mtrl_dist_comm_backend(const mtrl_dist_comm *c) { return c->ops->name; }

mtrl_status mtrl_dist_comm_barrier(mtrl_dist_comm *c, mtrl_error *err) { return c->ops->barrier(c, err); }

mtrl_status mtrl_dist_comm_allreduce(mtrl_dist_comm *c, void *buf, size_t count, mtrl_dtype dtype, mtrl_error *err) {
    if (dtype != MTRL_DT_F32 && dtype != MTRL_DT_F64)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "dist_comm %s: all_reduce of %s: only F32 and F64 are summed",
                              c->ops->name, mtrl_dtype_name(dtype));
    return c->ops->allreduce(c, buf, count, dtype, err);
}

mtrl_status mtrl_dist_comm_reduce_scatter(mtrl_dist_comm *c, const float *send, float *recv, size_t count,
                                          mtrl_error *err) {
    return c->ops->reduce_scatter(c, send, recv, count, err);
}

mtrl_status mtrl_dist_comm_allgather(mtrl_dist_comm *c, const void *send, void *recv, size_t bytes, mtrl_error *err) {
    return c->ops->allgather(c, send, recv, bytes, err);
}

mtrl_status mtrl_dist_comm_broadcast(mtrl_dist_comm *c, void *buf, size_t bytes, int root, mtrl_error *err) {
    if (root < 0 || root >= c->ranks)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "dist_comm %s: broadcast from root %d of %d ranks", c->ops->name, root,
                              c->ranks);
    return c->ops->broadcast(c, buf, bytes, root, err);
}

mtrl_status mtrl_dist_comm_alltoallv(mtrl_dist_comm *c, const void *send, const int64_t *send_count,
                                     const int64_t *send_offset, void *recv, const int64_t *recv_count,
                                     const int64_t *recv_offset, size_t elem_bytes, mtrl_error *err) {
    for (int q = 0; q < c->ranks; q++)
        if (send_count[q] < 0 || send_offset[q] < 0 || recv_count[q] < 0 || recv_offset[q] < 0)
            return mtrl_error_set(err, MTRL_ERR_USAGE, "dist_comm %s: all_to_all_v on rank %d: a negative count or offset "
                                  "for peer %d", c->ops->name, c->rank, q);
    return c->ops->alltoallv(c, send, send_count, send_offset, recv, recv_count, recv_offset, elem_bytes, err);
}
