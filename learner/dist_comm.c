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
//
// A rank of device buffers (mtrl_dist_comm_init_local_device) posts host copies of its inputs
// (its stage) instead of the buffers, and copies what it reads between the meetings into its
// device buffers; so the meetings and the sums are the host ranks' own, on host memory. Its
// stage is read by the peers between the meetings only, so it may grow before the next post.
#include "learner/dist_comm.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/check.h"
#include "common/gpu.h"
#include "common/timeutil.h"
#include "learner/dist_comm_impl.h"
#include "learner/dist_plan.h"

#ifdef MTRL_HAVE_CUDA
#include <cuda_runtime.h>
#endif

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

// ---- device buffers: staged through host memory --------------------------------------------------

// The rank's stage, at least `bytes` (grow-only). Only before the rank posts: from the second
// meeting of its last call on, no peer reads it.
static char *stage_(mtrl_dist_comm *c, size_t bytes) {
    if (bytes > c->stage_cap) {
        free(c->stage);
        c->stage_cap = bytes + bytes / 4 + 256;
        c->stage = xmalloc(c->stage_cap);
    }
    return c->stage;
}

// dst = src[bytes] on c's stream, waited for; to_device: dst is device memory of c's GPU, else
// src is. Returns 0, or -1 with CUDA's reason in why.
static int dev_copy_(mtrl_dist_comm *c, void *dst, const void *src, size_t bytes, int to_device, char *why, size_t cap) {
    if (!bytes) return 0;
#ifdef MTRL_HAVE_CUDA
    cudaStream_t st = (cudaStream_t)c->stream;
    cudaError_t e = cudaSetDevice(c->gpu);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(dst, src, bytes, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, st);
    if (e == cudaSuccess) e = cudaStreamSynchronize(st);
    if (e == cudaSuccess) return 0;
    snprintf(why, cap, "%s %zu bytes %s GPU %d: %s", to_device ? "copying" : "reading", bytes,
             to_device ? "to" : "from", c->gpu, cudaGetErrorString(e));
#else
    (void)c, (void)dst, (void)src, (void)to_device;
    snprintf(why, cap, "device buffers in a build without CUDA");
#endif
    return -1;
}

// dst[bytes] = host src into the rank's buffer (device memory for a device rank). 0 or -1, why.
static int put_(mtrl_dist_comm *c, void *dst, const void *src, size_t bytes, char *why, size_t cap) {
    if (c->gpu >= 0) return dev_copy_(c, dst, src, bytes, 1, why, cap);
    if (bytes) memcpy(dst, src, bytes);
    return 0;
}

// A device copy of this rank failed in op: the world fails (the peers' calls return its
// message), and this rank's call returns MTRL_ERR_PEER.
static mtrl_status rank_fail_(mtrl_dist_comm *c, const char *op, const char *why, mtrl_error *err) {
    mtrl_dist_world *w = c->impl;
    pthread_mutex_lock(&w->mu);
    if (!w->failed) world_fail_(w, MTRL_ERR_PEER, "%s: rank %d: %s", op, c->rank, why);
    pthread_mutex_unlock(&w->mu);
    return mtrl_error_set(err, MTRL_ERR_PEER, "dist_comm local: %s on rank %d of %d: %s", op, c->rank, w->ranks, why);
}

// What the rank posts of its input src[bytes]: src itself (host buffers), or its host copy at
// byte `at` of the stage (the stage sized by the caller).
static mtrl_status post_in_(mtrl_dist_comm *c, const char *op, const void *src, size_t at, size_t bytes,
                            const void **posted, mtrl_error *err) {
    *posted = src;
    if (c->gpu < 0) return MTRL_OK;
    char why[256];
    *posted = c->stage + at;
    if (dev_copy_(c, c->stage + at, src, bytes, 0, why, sizeof why)) return rank_fail_(c, op, why, err);
    return MTRL_OK;
}

// The second meeting of a call whose copies between the meetings may have failed (bad, why):
// the rank meets first (its peers may still be reading its stage), then fails the world.
static mtrl_status meet_after_copies_(mtrl_dist_comm *c, const char *op, int bad, const char *why, mtrl_error *err) {
    mtrl_status s = world_meet_(c, 0, 0, err);
    if (bad) return rank_fail_(c, op, why, err);
    return s;
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
    if (c->gpu >= 0) stage_(c, count * es);
    const void *in;
    mtrl_status s = post_in_(c, "all_reduce", buf, 0, count * es, &in, err);
    if (s != MTRL_OK) return s;
    s = world_enter_(c, &(comm_call){.op = OP_ALLREDUCE, .size = count, .aux = (int)dtype, .recv = (void *)in},
                     count * es, err);
    if (s != MTRL_OK) return s;
    // Each rank sums its slice of the elements into the scratch; all copy the whole out.
    size_t lo = count * (size_t)c->rank / (size_t)w->ranks, hi = count * (size_t)(c->rank + 1) / (size_t)w->ranks;
    for (size_t i = lo; i < hi; i++) {
        if (dtype == MTRL_DT_F32) ((float *)w->scratch)[i] = sum_f32_(w, 0, i);
        else ((double *)w->scratch)[i] = sum_f64_(w, i);
    }
    if ((s = world_meet_(c, 0, 0, err)) != MTRL_OK) return s;
    char why[256];
    if (put_(c, buf, w->scratch, count * es, why, sizeof why)) return rank_fail_(c, "all_reduce", why, err);
    return MTRL_OK;
}

static mtrl_status local_reduce_scatter_(mtrl_dist_comm *c, const float *send, float *recv, size_t count,
                                         mtrl_error *err) {
    mtrl_dist_world *w = c->impl;
    size_t in_bytes = sizeof(float) * count * (size_t)w->ranks, out_bytes = sizeof(float) * count;
    if (c->gpu >= 0) stage_(c, in_bytes + out_bytes);
    const void *in;
    mtrl_status s = post_in_(c, "reduce_scatter", send, 0, in_bytes, &in, err);
    if (s != MTRL_OK) return s;
    float *out = c->gpu >= 0 ? (float *)(c->stage + in_bytes) : recv; // device: the sums on the host first
    s = world_enter_(c, &(comm_call){.op = OP_REDUCE_SCATTER, .size = count, .send = in, .recv = out}, 0, err);
    if (s != MTRL_OK) return s;
    size_t base = count * (size_t)c->rank;
    for (size_t i = 0; i < count; i++) out[i] = sum_f32_(w, 1, base + i);
    char why[256] = "";
    int bad = out != recv && put_(c, recv, out, out_bytes, why, sizeof why);
    return meet_after_copies_(c, "reduce_scatter", bad, why, err);
}

static mtrl_status local_allgather_(mtrl_dist_comm *c, const void *send, void *recv, size_t bytes, mtrl_error *err) {
    mtrl_dist_world *w = c->impl;
    if (c->gpu >= 0) stage_(c, bytes);
    const void *in;
    mtrl_status s = post_in_(c, "all_gather", send, 0, bytes, &in, err);
    if (s != MTRL_OK) return s;
    s = world_enter_(c, &(comm_call){.op = OP_ALLGATHER, .size = bytes, .send = in, .recv = recv}, 0, err);
    if (s != MTRL_OK) return s;
    char why[256] = "";
    int bad = 0;
    for (int q = 0; q < w->ranks && !bad; q++) {
        char *dst = (char *)recv + (size_t)q * bytes;
        if (q == c->rank && dst == send) continue; // in place: the own chunk is there
        bad = put_(c, dst, w->call[q].send, bytes, why, sizeof why);
    }
    return meet_after_copies_(c, "all_gather", bad, why, err);
}

static mtrl_status local_broadcast_(mtrl_dist_comm *c, void *buf, size_t bytes, int root, mtrl_error *err) {
    mtrl_dist_world *w = c->impl;
    const void *in = buf;
    mtrl_status s = MTRL_OK;
    if (c->rank == root && c->gpu >= 0) {
        stage_(c, bytes);
        s = post_in_(c, "broadcast", buf, 0, bytes, &in, err);
    }
    if (s != MTRL_OK) return s;
    s = world_enter_(c, &(comm_call){.op = OP_BROADCAST, .size = bytes, .aux = root, .send = in, .recv = buf}, 0, err);
    if (s != MTRL_OK) return s;
    char why[256] = "";
    int bad = c->rank != root && put_(c, buf, w->call[root].send, bytes, why, sizeof why);
    return meet_after_copies_(c, "broadcast", bad, why, err);
}

static mtrl_status local_alltoallv_(mtrl_dist_comm *c, const void *send, const int64_t *send_count,
                                    const int64_t *send_offset, void *recv, const int64_t *recv_count,
                                    const int64_t *recv_offset, size_t eb, mtrl_error *err) {
    mtrl_dist_world *w = c->impl;
    size_t extent = 0; // the rows of send that the peers read
    for (int q = 0; q < w->ranks; q++) {
        size_t end = (size_t)(send_offset[q] + send_count[q]) * eb;
        if (send_count[q] && end > extent) extent = end;
    }
    if (c->gpu >= 0) stage_(c, extent);
    const void *in;
    mtrl_status s = post_in_(c, "all_to_all_v", send, 0, extent, &in, err);
    if (s != MTRL_OK) return s;
    comm_call call = {.op = OP_ALLTOALLV, .size = eb, .send = in, .recv = recv, .send_count = send_count,
                      .send_offset = send_offset, .recv_count = recv_count, .recv_offset = recv_offset};
    s = world_enter_(c, &call, 0, err);
    if (s != MTRL_OK) return s;
    char why[256] = "";
    int bad = 0;
    for (int q = 0; q < w->ranks && !bad; q++) {
        const comm_call *p = &w->call[q];
        size_t n = (size_t)recv_count[q] * eb;
        bad = put_(c, (char *)recv + (size_t)recv_offset[q] * eb, (const char *)p->send + (size_t)p->send_offset[c->rank] * eb,
                   n, why, sizeof why);
    }
    return meet_after_copies_(c, "all_to_all_v", bad, why, err);
}

static void local_free_(mtrl_dist_comm *c) {
    mtrl_dist_world *w = c->impl;
    pthread_mutex_lock(&w->mu);
    w->taken[c->rank] = 0;
    pthread_mutex_unlock(&w->mu);
    free(c->stage);
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
    *c = (mtrl_dist_comm){.ops = &local_ops_, .rank = rank, .ranks = w->ranks, .timeout_ms = w->timeout_ms, .impl = w,
                          .gpu = -1};
    *out = c;
    return MTRL_OK;
}

mtrl_status mtrl_dist_comm_init_local_device(mtrl_dist_comm **out, mtrl_dist_world *w, int rank, int gpu, void *stream,
                                             mtrl_error *err) {
    *out = NULL;
    int n = mtrl_gpu_count();
    if (gpu < 0 || gpu >= n)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "dist_comm local: rank %d on GPU %d: %s", rank, gpu,
                              n ? "no such device" : "no CUDA device (or a build without CUDA)");
    mtrl_status s = mtrl_dist_comm_init_local(out, w, rank, err);
    if (s != MTRL_OK) return s;
    (*out)->gpu = gpu;
    (*out)->stream = stream;
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
int mtrl_dist_comm_gpu(const mtrl_dist_comm *c) { return c->gpu; }

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
