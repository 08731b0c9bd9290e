// testdist.h: every collective of learner/dist_comm.h checked exactly, for any backend
// (header-only; test_dist_dp runs it on the local communicator's threads, test_dist_zmq on
// the zmq backend's processes, test_cuda_dist_comm on NCCL with device buffers). A rank's function posts its inputs through the backend's
// memory (test_dist_mem), runs each op and reads the outputs back to the host; the checks run
// on the main thread after every rank returned (the counters of testhelp.h are not atomic).
// Values are chosen so that sums are exact in any order; the order-dependent sum is checked
// only where the backend promises rank order (test_dist_ops_check's rank_order).
// Also: a world of the local backend on threads (test_dist_run_local), and with CUDA the
// device memory of GPU buffers (test_dist_dev_mem).
#ifndef MTRL_TESTDIST_H
#define MTRL_TESTDIST_H

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "learner/dist_comm.h"
#include "learner/dist_plan.h"
#include "tests/testhelp.h"

#ifdef MTRL_HAVE_CUDA
#include <cuda_runtime.h>
#endif

// What a rank runs, on its own thread, with its handle.
typedef void (*test_rank_fn)(mtrl_dist_comm *c, void *ctx);

typedef struct td_job_ {
    mtrl_dist_world *w;
    int rank, gpu;
    test_rank_fn fn;
    void *ctx;
} td_job_;

static inline void *td_rank_main_(void *p) {
    td_job_ *j = p;
    mtrl_dist_comm *c = NULL;
    mtrl_error err;
    mtrl_status s = j->gpu < 0 ? mtrl_dist_comm_init_local(&c, j->w, j->rank, &err)
                               : mtrl_dist_comm_init_local_device(&c, j->w, j->rank, j->gpu, NULL, &err);
    if (s != MTRL_OK) {
        fprintf(stderr, "rank %d: %s\n", j->rank, err.msg);
        abort();
    }
    j->fn(c, j->ctx);
    mtrl_dist_comm_free(c);
    return NULL;
}

// Runs fn on R threads of a local world, rank r on thread r, its buffers host memory (gpu < 0)
// or GPU gpu's (every rank on that one device, copies on the legacy default stream); the
// checks run after, on the calling thread.
static inline void test_dist_run_local(int R, int timeout_ms, int gpu, test_rank_fn fn, void *ctx) {
    mtrl_dist_world *w;
    mtrl_error err;
    TEST_EQ_INT(mtrl_dist_world_init(&w, R, timeout_ms, &err), MTRL_OK);
    pthread_t th[MTRL_DIST_RANKS_MAX];
    td_job_ job[MTRL_DIST_RANKS_MAX];
    for (int r = 0; r < R; r++) {
        job[r] = (td_job_){w, r, gpu, fn, ctx};
        pthread_create(&th[r], NULL, td_rank_main_, &job[r]);
    }
    for (int r = 0; r < R; r++) pthread_join(th[r], NULL);
    mtrl_dist_world_free(w);
}

// Where a backend's buffers live: host memory (local) or a GPU's (nccl).
typedef struct test_dist_mem {
    void *(*alloc)(size_t bytes);                         // zeroed
    void (*put)(void *dst, const void *src, size_t bytes); // host -> buffer
    void (*get)(void *dst, const void *src, size_t bytes); // buffer -> host
    void (*release)(void *p);
} test_dist_mem;

#ifdef MTRL_HAVE_CUDA
// Device memory of the calling thread's current GPU; a failing CUDA call aborts the test.
static inline void *td_dev_alloc_(size_t n) {
    void *p = NULL;
    if (cudaMalloc(&p, n) != cudaSuccess || cudaMemset(p, 0, n) != cudaSuccess) abort();
    return p;
}
static inline void td_dev_put_(void *dst, const void *src, size_t n) {
    if (cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice) != cudaSuccess) abort();
}
static inline void td_dev_get_(void *dst, const void *src, size_t n) {
    if (cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost) != cudaSuccess) abort();
}
static inline void td_dev_free_(void *p) { cudaFree(p); }
static const test_dist_mem test_dist_dev_mem = {td_dev_alloc_, td_dev_put_, td_dev_get_, td_dev_free_};
#endif

#ifdef MTRL_HAVE_NCCL
// A world of the NCCL backend on threads: rank r on GPU r, its collectives on a stream of its
// own, the id through the file bootstrap (a fresh path per world); every rank's init checked.
typedef struct td_nccl_job_ {
    int rank, ranks, timeout_ms;
    const char *id_path;
    test_rank_fn fn;
    void *ctx;
    mtrl_status init;
    char msg[MTRL_ERROR_MSG_MAX];
} td_nccl_job_;

static inline void *td_nccl_main_(void *p) {
    td_nccl_job_ *j = p;
    mtrl_error err = {0};
    cudaSetDevice(j->rank);
    cudaStream_t s;
    cudaStreamCreate(&s);
    mtrl_dist_comm *c = NULL;
    j->init = mtrl_dist_comm_init_nccl(&c, j->ranks, j->rank, j->rank, s, j->timeout_ms, mtrl_dist_bootstrap_file,
                                       (void *)j->id_path, &err);
    snprintf(j->msg, sizeof j->msg, "%s", err.msg);
    if (j->init == MTRL_OK) j->fn(c, j->ctx);
    mtrl_dist_comm_free(c);
    cudaStreamDestroy(s);
    return NULL;
}

static inline void test_dist_run_nccl(int R, int timeout_ms, test_rank_fn fn, void *ctx) {
    static int world;
    char path[256];
    snprintf(path, sizeof path, "/tmp/mtrl_test_nccl_id.%ld.%d", (long)getpid(), world++);
    unlink(path);
    pthread_t th[MTRL_DIST_RANKS_MAX];
    td_nccl_job_ job[MTRL_DIST_RANKS_MAX];
    for (int r = 0; r < R; r++) {
        job[r] = (td_nccl_job_){r, R, timeout_ms, path, fn, ctx, MTRL_OK, {0}};
        pthread_create(&th[r], NULL, td_nccl_main_, &job[r]);
    }
    for (int r = 0; r < R; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < R; r++) TEST_CHECKF(job[r].init == MTRL_OK, "R=%d rank %d init: %s", R, r, job[r].msg);
    unlink(path);
}
#endif

enum { TD_ELEM = 37, TD_BYTES = 23, TD_E = 5, TD_OPS = 8 };

typedef struct test_dist_ops {
    const test_dist_mem *mem;
    mtrl_status st[MTRL_DIST_RANKS_MAX][TD_OPS];
    char msg[MTRL_DIST_RANKS_MAX][MTRL_ERROR_MSG_MAX];
    float ar[MTRL_DIST_RANKS_MAX][TD_ELEM], order[MTRL_DIST_RANKS_MAX];
    double ar64[MTRL_DIST_RANKS_MAX][TD_ELEM];
    float rs[MTRL_DIST_RANKS_MAX][TD_ELEM];
    unsigned char ag[MTRL_DIST_RANKS_MAX][MTRL_DIST_RANKS_MAX * TD_BYTES];
    unsigned char ag_in[MTRL_DIST_RANKS_MAX][MTRL_DIST_RANKS_MAX * TD_BYTES];
    unsigned char bc[MTRL_DIST_RANKS_MAX][TD_BYTES];
    int a2a_bad[MTRL_DIST_RANKS_MAX];
} test_dist_ops;

static inline float td_val_(int r, int i) { return (float)((r + 1) * 1000 + i) * 0.25f; } // exact sums
static inline unsigned char td_byte_(int r, int i) { return (unsigned char)(r * 31 + i * 7 + 1); }
static inline int64_t td_rows_(int q, int e) { return (q * 3 + e * 7) % 4; } // 0..3 rows, some 0
// The order-dependent sum's terms: 1e8 + 1 + ... - 1e8 (one rank: 3).
static inline float td_order_term_(int r, int R) { return R == 1 ? 3.0f : r == 0 ? 1e8f : r == R - 1 ? -1e8f : 1.0f; }

// A buffer of the backend holding host bytes src (NULL: zeroed).
static inline void *td_buf_(const test_dist_mem *m, const void *src, size_t bytes) {
    void *p = m->alloc(bytes ? bytes : 1);
    if (src && bytes) m->put(p, src, bytes);
    return p;
}

// Reads buffer p back into host dst and releases it.
static inline void td_back_(const test_dist_mem *m, void *dst, void *p, size_t bytes) {
    if (bytes) m->get(dst, p, bytes);
    m->release(p);
}

// The exchange of dist_plan.h: rows sorted by expert, each row (source, expert, index); the
// number of rows misplaced on this rank.
static inline int td_a2a_(mtrl_dist_comm *c, const test_dist_mem *mem, mtrl_status *st) {
    int R = mtrl_dist_comm_ranks(c), me = mtrl_dist_comm_rank(c), bad = 0;
    mtrl_dist_experts x;
    if (mtrl_dist_experts_make(&x, TD_E, R, NULL) != MTRL_OK) return 1;
    int64_t rows_all[MTRL_DIST_RANKS_MAX * TD_E], n_send = 0, n_recv = 0;
    for (int q = 0; q < R; q++)
        for (int e = 0; e < TD_E; e++) rows_all[q * TD_E + e] = td_rows_(q, e);
    int64_t sc[MTRL_DIST_RANKS_MAX], so[MTRL_DIST_RANKS_MAX], rc[MTRL_DIST_RANKS_MAX], ro[MTRL_DIST_RANKS_MAX];
    mtrl_dist_a2a_send(&x, rows_all + me * TD_E, sc, so);
    mtrl_dist_a2a_recv(&x, me, rows_all, rc, ro, NULL);
    for (int q = 0; q < R; q++) n_send += sc[q], n_recv += rc[q];
    size_t row = 3 * sizeof(int32_t);
    int32_t *send = calloc((size_t)n_send * 3 + 1, sizeof(int32_t)), *recv = calloc((size_t)n_recv * 3 + 1, sizeof(int32_t));
    int64_t at = 0;
    for (int e = 0; e < TD_E; e++)
        for (int j = 0; j < td_rows_(me, e); j++, at++) send[at * 3] = me, send[at * 3 + 1] = e, send[at * 3 + 2] = j;
    void *ds = td_buf_(mem, send, (size_t)n_send * row), *dr = td_buf_(mem, NULL, (size_t)n_recv * row);
    *st = mtrl_dist_comm_alltoallv(c, ds, sc, so, dr, rc, ro, row, NULL);
    mem->release(ds);
    td_back_(mem, recv, dr, (size_t)n_recv * row);
    // From each source, its rows of my experts in expert order, at that source's offset.
    for (int q = 0; q < R; q++) {
        int64_t k = ro[q];
        for (int e = x.first[me]; e < x.first[me + 1]; e++)
            for (int j = 0; j < td_rows_(q, e); j++, k++)
                bad += recv[k * 3] != q || recv[k * 3 + 1] != e || recv[k * 3 + 2] != j;
        bad += k != ro[q] + rc[q];
    }
    free(send);
    free(recv);
    return bad;
}

// Rank c's part: every op once, outputs into x (ctx of the rank threads).
static inline void test_dist_ops_rank(mtrl_dist_comm *c, void *ctx) {
    test_dist_ops *x = ctx;
    const test_dist_mem *m = x->mem;
    int r = mtrl_dist_comm_rank(c), R = mtrl_dist_comm_ranks(c);
    mtrl_status *st = x->st[r];
    mtrl_error err = {0};
    st[0] = mtrl_dist_comm_barrier(c, &err);
    for (int i = 0; i < TD_ELEM; i++) x->ar[r][i] = td_val_(r, i), x->ar64[r][i] = td_val_(r, i) * 1e-3;
    void *b = td_buf_(m, x->ar[r], sizeof x->ar[r]);
    st[1] = mtrl_dist_comm_allreduce(c, b, TD_ELEM, MTRL_DT_F32, &err);
    td_back_(m, x->ar[r], b, sizeof x->ar[r]);
    b = td_buf_(m, x->ar64[r], sizeof x->ar64[r]);
    st[2] = mtrl_dist_comm_allreduce(c, b, TD_ELEM, MTRL_DT_F64, &err);
    td_back_(m, x->ar64[r], b, sizeof x->ar64[r]);
    x->order[r] = td_order_term_(r, R);
    b = td_buf_(m, &x->order[r], sizeof(float));
    mtrl_status so = mtrl_dist_comm_allreduce(c, b, 1, MTRL_DT_F32, &err);
    td_back_(m, &x->order[r], b, sizeof(float));
    float *send = malloc(sizeof(float) * (size_t)R * TD_ELEM);
    for (int i = 0; i < R * TD_ELEM; i++) send[i] = td_val_(r, i);
    b = td_buf_(m, send, sizeof(float) * (size_t)R * TD_ELEM);
    void *out = td_buf_(m, NULL, sizeof x->rs[r]);
    st[3] = mtrl_dist_comm_reduce_scatter(c, b, out, TD_ELEM, &err);
    m->release(b);
    td_back_(m, x->rs[r], out, sizeof x->rs[r]);
    free(send);
    unsigned char mine[TD_BYTES];
    for (int i = 0; i < TD_BYTES; i++) mine[i] = td_byte_(r, i), x->ag_in[r][r * TD_BYTES + i] = td_byte_(r, i);
    size_t all = (size_t)R * TD_BYTES;
    b = td_buf_(m, mine, TD_BYTES);
    out = td_buf_(m, NULL, all);
    st[4] = mtrl_dist_comm_allgather(c, b, out, TD_BYTES, &err);
    m->release(b);
    td_back_(m, x->ag[r], out, all);
    out = td_buf_(m, x->ag_in[r], all); // in place: the own chunk is already there
    mtrl_status si = mtrl_dist_comm_allgather(c, (char *)out + (size_t)r * TD_BYTES, out, TD_BYTES, &err);
    td_back_(m, x->ag_in[r], out, all);
    int root = R - 1;
    for (int i = 0; i < TD_BYTES; i++) x->bc[r][i] = r == root ? td_byte_(99, i) : 0;
    b = td_buf_(m, x->bc[r], TD_BYTES);
    st[5] = mtrl_dist_comm_broadcast(c, b, TD_BYTES, root, &err);
    td_back_(m, x->bc[r], b, TD_BYTES);
    x->a2a_bad[r] = td_a2a_(c, m, &st[6]);
    st[7] = so != MTRL_OK ? so : si;
    snprintf(x->msg[r], sizeof x->msg[r], "%s", err.msg);
}

// Rank r's outputs of src into dst: a world of processes (test_dist_zmq) runs
// test_dist_ops_rank in each rank's process on a copy of its own, and the checks below run on
// the copies merged.
static inline void test_dist_ops_take(test_dist_ops *dst, const test_dist_ops *src, int r) {
    memcpy(dst->st[r], src->st[r], sizeof dst->st[r]);
    memcpy(dst->msg[r], src->msg[r], sizeof dst->msg[r]);
    memcpy(dst->ar[r], src->ar[r], sizeof dst->ar[r]);
    dst->order[r] = src->order[r];
    memcpy(dst->ar64[r], src->ar64[r], sizeof dst->ar64[r]);
    memcpy(dst->rs[r], src->rs[r], sizeof dst->rs[r]);
    memcpy(dst->ag[r], src->ag[r], sizeof dst->ag[r]);
    memcpy(dst->ag_in[r], src->ag_in[r], sizeof dst->ag_in[r]);
    memcpy(dst->bc[r], src->bc[r], sizeof dst->bc[r]);
    dst->a2a_bad[r] = src->a2a_bad[r];
}

// The checks of a world of R ranks after test_dist_ops_rank ran on each. rank_order: the
// backend sums in rank order (local), so the order-dependent sum is checked too.
static inline void test_dist_ops_check(const test_dist_ops *x, int R, int rank_order, const char *what) {
    float order = 0;
    for (int q = 0; q < R; q++) order = q ? order + td_order_term_(q, R) : td_order_term_(q, R);
    for (int r = 0; r < R; r++) {
        for (int k = 0; k < TD_OPS; k++)
            TEST_CHECKF(x->st[r][k] == MTRL_OK, "%s R=%d rank %d op %d: %d (%s)", what, R, r, k, x->st[r][k], x->msg[r]);
        int bad = 0;
        for (int i = 0; i < TD_ELEM; i++) {
            float want = 0, want_rs = 0;
            double want64 = 0;
            for (int q = 0; q < R; q++) {
                want += td_val_(q, i);
                want64 += td_val_(q, i) * 1e-3;
                want_rs += td_val_(q, r * TD_ELEM + i);
            }
            bad += x->ar[r][i] != want || x->rs[r][i] != want_rs;
            bad += memcmp(&x->ar64[r][i], &x->ar64[0][i], sizeof(double)) != 0; // the same bits everywhere
            bad += fabs(x->ar64[r][i] - want64) > 1e-12;
        }
        TEST_CHECKF(bad == 0, "%s R=%d rank %d: %d all-reduce / reduce-scatter values wrong", what, R, r, bad);
        if (rank_order)
            TEST_CHECKF(x->order[r] == order, "%s R=%d rank %d: the order-dependent sum %.9g, rank order gives %.9g", what,
                        R, r, x->order[r], order);
        TEST_CHECKF(!memcmp(&x->order[r], &x->order[0], sizeof(float)), "%s R=%d rank %d: a sum differs from rank 0's",
                    what, R, r);
        bad = 0;
        for (int q = 0; q < R; q++)
            for (int i = 0; i < TD_BYTES; i++)
                bad += x->ag[r][q * TD_BYTES + i] != td_byte_(q, i) || x->ag_in[r][q * TD_BYTES + i] != td_byte_(q, i);
        for (int i = 0; i < TD_BYTES; i++) bad += x->bc[r][i] != td_byte_(99, i);
        TEST_CHECKF(bad == 0, "%s R=%d rank %d: %d all-gather / broadcast bytes wrong", what, R, r, bad);
        TEST_CHECKF(x->a2a_bad[r] == 0, "%s R=%d rank %d: %d all-to-all-v rows misplaced", what, R, r, x->a2a_bad[r]);
    }
}

#endif
