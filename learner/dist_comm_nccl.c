// dist_comm_nccl.c: the NCCL backend of dist_comm.h (one rank per GPU) and the file bootstrap
// of its unique id. Without MTRL_HAVE_NCCL only the bootstrap exists and init is refused.
//
// The communicator is non-blocking (ncclConfig_t.blocking = 0): an NCCL call returns at once,
// possibly ncclInProgress, and ncclCommGetAsyncError says when it is done or failed. So every
// wait below has a deadline: the call's own (init, a collective being enqueued), then the
// stream's (cudaStreamQuery) while the collective runs, still asking NCCL for an asynchronous
// error (a peer that aborted). Past the deadline the communicator is aborted (ncclCommAbort,
// the only way to get the GPU's kernels off a collective whose peers never come) and the rank
// returns MTRL_ERR_TIMEOUT; the handle is dead from then on.
#include "learner/dist_comm.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/check.h"
#include "common/timeutil.h"
#include "learner/dist_comm_impl.h"
#include "learner/dist_plan.h"

static void sleep_us_(long us) {
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

mtrl_status mtrl_dist_bootstrap_file(void *user, int rank, int ranks, void *id, size_t id_bytes, int timeout_ms,
                                     mtrl_error *err) {
    const char *path = user;
    if (rank == 0) {
        // Written under a temporary name, then linked into place: a reader sees the whole id or
        // no file, and an existing file (another world's id) is refused rather than replaced.
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s.tmp%ld", path, (long)getpid());
        int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL, 0600); // the id lets anyone join the world
        if (fd < 0) return mtrl_error_set(err, MTRL_ERR_IO, "dist_comm bootstrap: %s: %s", tmp, strerror(errno));
        ssize_t w = write(fd, id, id_bytes);
        int bad = w != (ssize_t)id_bytes || close(fd) != 0;
        int e = errno;
        if (!bad && link(tmp, path) != 0) bad = 2, e = errno;
        unlink(tmp);
        if (bad == 2 && e == EEXIST)
            return mtrl_error_set(err, MTRL_ERR_STATE, "dist_comm bootstrap: %s exists (another world's id?): remove it or "
                                  "give each world a fresh path", path);
        if (bad) return mtrl_error_set(err, MTRL_ERR_IO, "dist_comm bootstrap: writing %s: %s", path, strerror(e));
        return MTRL_OK;
    }
    double deadline = mtrl_time_mono() + timeout_ms / 1e3;
    for (;;) {
        int fd = open(path, O_RDONLY);
        if (fd >= 0) {
            ssize_t r = read(fd, id, id_bytes);
            close(fd);
            if (r == (ssize_t)id_bytes) return MTRL_OK;
            return mtrl_error_set(err, MTRL_ERR_FORMAT, "dist_comm bootstrap: %s holds %zd bytes, not a %zu-byte id", path,
                                  r, id_bytes);
        }
        if (errno != ENOENT)
            return mtrl_error_set(err, MTRL_ERR_IO, "dist_comm bootstrap: %s: %s", path, strerror(errno));
        if (mtrl_time_mono() > deadline)
            return mtrl_error_set(err, MTRL_ERR_TIMEOUT, "dist_comm bootstrap: rank %d of %d: no id from rank 0 at %s "
                                  "within %d ms", rank, ranks, path, timeout_ms);
        sleep_us_(10000);
    }
}

#ifndef MTRL_HAVE_NCCL

mtrl_status mtrl_dist_comm_init_nccl(mtrl_dist_comm **c, int ranks, int rank, int gpu, void *stream, int timeout_ms,
                                     mtrl_dist_bootstrap_fn boot, void *boot_user, mtrl_error *err) {
    (void)ranks, (void)rank, (void)gpu, (void)stream, (void)timeout_ms, (void)boot, (void)boot_user;
    *c = NULL;
    return mtrl_error_set(err, MTRL_ERR_USAGE, "dist_comm: this build has no NCCL (the backend 'nccl' needs CUDA and NCCL "
                          "when configuring)");
}

#else

#include <cuda_runtime.h>
#include <nccl.h>

typedef struct nccl_comm {
    ncclComm_t comm;
    cudaStream_t stream;
    int gpu;
    float *d_token;   // one float: the barrier's all-reduce
    int dead;         // aborted after a failure: every later call is refused
    char why[512];
} nccl_comm;

// Aborts the communicator after a failure of op and returns code with a message naming them.
static mtrl_status nccl_fail_(mtrl_dist_comm *c, const char *op, mtrl_status code, const char *what, mtrl_error *err) {
    nccl_comm *n = c->impl;
    snprintf(n->why, sizeof n->why, "%s: %s", op, what);
    if (!n->dead) ncclCommAbort(n->comm);
    n->dead = 1;
    return mtrl_error_set(err, code, "dist_comm nccl: rank %d of %d (GPU %d): %s", c->rank, c->ranks, n->gpu, n->why);
}

static mtrl_status nccl_error_(mtrl_dist_comm *c, const char *op, ncclResult_t r, mtrl_error *err) {
    nccl_comm *n = c->impl;
    char what[400];
    const char *last = n->comm ? ncclGetLastError(n->comm) : NULL;
    snprintf(what, sizeof what, "%s%s%s", ncclGetErrorString(r), last && *last ? ": " : "", last ? last : "");
    return nccl_fail_(c, op, MTRL_ERR_PEER, what, err);
}

static mtrl_status nccl_timeout_(mtrl_dist_comm *c, const char *op, mtrl_error *err) {
    char what[128];
    snprintf(what, sizeof what, "not done within the timeout of %d ms (a peer did not arrive); communicator aborted",
             c->timeout_ms);
    return nccl_fail_(c, op, MTRL_ERR_TIMEOUT, what, err);
}

// Until the NCCL call that returned r is done (not ncclInProgress), at most until deadline.
static mtrl_status nccl_settle_(mtrl_dist_comm *c, const char *op, ncclResult_t r, double deadline, mtrl_error *err) {
    nccl_comm *n = c->impl;
    while (r == ncclInProgress) {
        if (mtrl_time_mono() > deadline) return nccl_timeout_(c, op, err);
        sleep_us_(20);
        ncclResult_t q = ncclCommGetAsyncError(n->comm, &r);
        if (q != ncclSuccess) r = q;
    }
    return r == ncclSuccess ? MTRL_OK : nccl_error_(c, op, r, err);
}

// After a collective's call returned r: it is enqueued, then its work on the stream is done.
static mtrl_status nccl_wait_(mtrl_dist_comm *c, const char *op, ncclResult_t r, mtrl_error *err) {
    nccl_comm *n = c->impl;
    double deadline = mtrl_time_mono() + c->timeout_ms / 1e3;
    mtrl_status s = nccl_settle_(c, op, r, deadline, err);
    if (s != MTRL_OK) return s;
    for (;;) {
        cudaError_t q = cudaStreamQuery(n->stream);
        if (q == cudaSuccess) return MTRL_OK;
        if (q != cudaErrorNotReady) return nccl_fail_(c, op, MTRL_ERR_PEER, cudaGetErrorString(q), err);
        ncclResult_t a = ncclSuccess;
        ncclCommGetAsyncError(n->comm, &a);
        if (a != ncclSuccess && a != ncclInProgress) return nccl_error_(c, op, a, err);
        if (mtrl_time_mono() > deadline) return nccl_timeout_(c, op, err);
        sleep_us_(20);
    }
}

// The checks before every call: a dead handle, the rank's device current on this thread.
static mtrl_status nccl_enter_(mtrl_dist_comm *c, const char *op, mtrl_error *err) {
    nccl_comm *n = c->impl;
    if (n->dead)
        return mtrl_error_set(err, MTRL_ERR_STATE, "dist_comm nccl: %s on rank %d of %d: the communicator failed earlier "
                              "(%s)", op, c->rank, c->ranks, n->why);
    cudaError_t e = cudaSetDevice(n->gpu);
    if (e != cudaSuccess) return nccl_fail_(c, op, MTRL_ERR_PEER, cudaGetErrorString(e), err);
    return MTRL_OK;
}

static mtrl_status nccl_barrier_(mtrl_dist_comm *c, mtrl_error *err) {
    nccl_comm *n = c->impl;
    mtrl_status s = nccl_enter_(c, "barrier", err);
    if (s != MTRL_OK) return s;
    return nccl_wait_(c, "barrier", ncclAllReduce(n->d_token, n->d_token, 1, ncclFloat, ncclSum, n->comm, n->stream), err);
}

static mtrl_status nccl_allreduce_(mtrl_dist_comm *c, void *buf, size_t count, mtrl_dtype dtype, mtrl_error *err) {
    nccl_comm *n = c->impl;
    mtrl_status s = nccl_enter_(c, "all_reduce", err);
    if (s != MTRL_OK) return s;
    ncclDataType_t t = dtype == MTRL_DT_F32 ? ncclFloat : ncclDouble;
    return nccl_wait_(c, "all_reduce", ncclAllReduce(buf, buf, count, t, ncclSum, n->comm, n->stream), err);
}

static mtrl_status nccl_reduce_scatter_(mtrl_dist_comm *c, const float *send, float *recv, size_t count,
                                        mtrl_error *err) {
    nccl_comm *n = c->impl;
    mtrl_status s = nccl_enter_(c, "reduce_scatter", err);
    if (s != MTRL_OK) return s;
    return nccl_wait_(c, "reduce_scatter", ncclReduceScatter(send, recv, count, ncclFloat, ncclSum, n->comm, n->stream),
                      err);
}

static mtrl_status nccl_allgather_(mtrl_dist_comm *c, const void *send, void *recv, size_t bytes, mtrl_error *err) {
    nccl_comm *n = c->impl;
    mtrl_status s = nccl_enter_(c, "all_gather", err);
    if (s != MTRL_OK) return s;
    return nccl_wait_(c, "all_gather", ncclAllGather(send, recv, bytes, ncclUint8, n->comm, n->stream), err);
}

static mtrl_status nccl_broadcast_(mtrl_dist_comm *c, void *buf, size_t bytes, int root, mtrl_error *err) {
    nccl_comm *n = c->impl;
    mtrl_status s = nccl_enter_(c, "broadcast", err);
    if (s != MTRL_OK) return s;
    return nccl_wait_(c, "broadcast", ncclBroadcast(buf, buf, bytes, ncclUint8, root, n->comm, n->stream), err);
}

// Point-to-point sends and receives in one group (NCCL has no all-to-all-v of its own).
static mtrl_status nccl_alltoallv_(mtrl_dist_comm *c, const void *send, const int64_t *send_count,
                                   const int64_t *send_offset, void *recv, const int64_t *recv_count,
                                   const int64_t *recv_offset, size_t eb, mtrl_error *err) {
    nccl_comm *n = c->impl;
    mtrl_status s = nccl_enter_(c, "all_to_all_v", err);
    if (s != MTRL_OK) return s;
    ncclResult_t first = ncclGroupStart();
    for (int q = 0; q < c->ranks && first == ncclSuccess; q++) {
        ncclResult_t r = ncclSuccess;
        if (send_count[q])
            r = ncclSend((const char *)send + (size_t)send_offset[q] * eb, (size_t)send_count[q] * eb, ncclUint8, q,
                         n->comm, n->stream);
        if (r == ncclSuccess && recv_count[q])
            r = ncclRecv((char *)recv + (size_t)recv_offset[q] * eb, (size_t)recv_count[q] * eb, ncclUint8, q, n->comm,
                         n->stream);
        if (r != ncclSuccess && r != ncclInProgress) first = r;
    }
    ncclResult_t end = ncclGroupEnd(); // always closes the group it opened
    return nccl_wait_(c, "all_to_all_v", first != ncclSuccess ? first : end, err);
}

static void nccl_free_(mtrl_dist_comm *c) {
    nccl_comm *n = c->impl;
    cudaSetDevice(n->gpu);
    if (!n->dead) {
        // Finalize flushes what was issued (nothing: every call waited); bounded like a call.
        double deadline = mtrl_time_mono() + c->timeout_ms / 1e3;
        if (nccl_settle_(c, "finalize", ncclCommFinalize(n->comm), deadline, NULL) == MTRL_OK) ncclCommDestroy(n->comm);
    }
    cudaFree(n->d_token);
    free(n);
}

static const mtrl_dist_comm_ops nccl_ops_ = {"nccl",           nccl_barrier_,   nccl_allreduce_, nccl_reduce_scatter_,
                                             nccl_allgather_, nccl_broadcast_, nccl_alltoallv_, nccl_free_};

mtrl_status mtrl_dist_comm_init_nccl(mtrl_dist_comm **out, int ranks, int rank, int gpu, void *stream, int timeout_ms,
                                     mtrl_dist_bootstrap_fn boot, void *boot_user, mtrl_error *err) {
    *out = NULL;
    if (ranks < 1 || ranks > MTRL_DIST_RANKS_MAX || rank < 0 || rank >= ranks || timeout_ms <= 0 || !boot)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "dist_comm nccl: rank %d of %d ranks, timeout %d ms%s: out of range",
                              rank, ranks, timeout_ms, boot ? "" : ", no bootstrap");
    // NVLink multicast (NVLS) stays off: it is unreliable on the machines this project is lent
    // (their notes say to leave it off), and these reductions (one step's gradient shards, a
    // few scalars) do not need its bandwidth. A caller who sets the variable decides.
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    cudaError_t ce = cudaSetDevice(gpu);
    if (ce != cudaSuccess)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "dist_comm nccl: rank %d: GPU %d: %s", rank, gpu, cudaGetErrorString(ce));
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (rank == 0) {
        ncclResult_t r = ncclGetUniqueId(&id);
        if (r != ncclSuccess)
            return mtrl_error_set(err, MTRL_ERR_PEER, "dist_comm nccl: ncclGetUniqueId: %s", ncclGetErrorString(r));
    }
    mtrl_status s = boot(boot_user, rank, ranks, &id, sizeof id, timeout_ms, err);
    if (s != MTRL_OK) return s;
    nccl_comm *n = xcalloc(1, sizeof *n);
    n->stream = (cudaStream_t)stream;
    n->gpu = gpu;
    mtrl_dist_comm *c = xcalloc(1, sizeof *c);
    *c = (mtrl_dist_comm){.ops = &nccl_ops_, .rank = rank, .ranks = ranks, .timeout_ms = timeout_ms, .impl = n, .gpu = gpu,
                          .stream = stream};
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&n->comm, ranks, id, rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        s = mtrl_error_set(err, MTRL_ERR_PEER, "dist_comm nccl: rank %d of %d (GPU %d): init: %s", rank, ranks, gpu,
                           ncclGetErrorString(r));
        if (n->comm) ncclCommAbort(n->comm);
    } else {
        s = nccl_settle_(c, "init", r, mtrl_time_mono() + timeout_ms / 1e3, err);
    }
    if (s == MTRL_OK && (ce = cudaMalloc((void **)&n->d_token, sizeof(float))) != cudaSuccess)
        s = nccl_fail_(c, "init", MTRL_ERR_NOMEM, cudaGetErrorString(ce), err);
    if (s == MTRL_OK && (ce = cudaMemset(n->d_token, 0, sizeof(float))) != cudaSuccess)
        s = nccl_fail_(c, "init", MTRL_ERR_PEER, cudaGetErrorString(ce), err);
    if (s != MTRL_OK) {
        cudaFree(n->d_token);
        free(n);
        free(c);
        return s;
    }
    *out = c;
    return MTRL_OK;
}

#endif
