// mtrl-test: gpu
// The NCCL backend of learner/dist_comm.h on device buffers: every collective's result exactly
// (tests/testdist.h: values whose sums are exact in any order, every rank the same bits), in a
// world of 1 rank and, with two or more GPUs, of one rank per GPU (one thread each, the id
// through the file bootstrap); then, with two or more GPUs, a rank that never arrives: the
// other returns MTRL_ERR_TIMEOUT naming the op within its timeout (the communicator aborted,
// not hung), and the late rank's next call returns an error too instead of waiting forever.
// Skips (77) without a GPU or in a build without NCCL.
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/gpu.h"
#include "learner/dist_comm.h"
#include "tests/testdist.h"
#include "tests/testhelp.h"

#ifdef MTRL_HAVE_NCCL
#include <cuda_runtime.h>

// Rank r on GPU r (tests/testdist.h).
static void run_ranks_(int R, int timeout_ms, test_rank_fn fn, void *ctx) { test_dist_run_nccl(R, timeout_ms, fn, ctx); }

static void ops_(int R) {
    test_dist_ops *x = calloc(1, sizeof *x);
    x->mem = &test_dist_dev_mem;
    run_ranks_(R, 30000, test_dist_ops_rank, x);
    test_dist_ops_check(x, R, 0, "nccl");
    printf("nccl: world of %d: every op checked\n", R);
    free(x);
}

typedef struct timeout_ctx {
    mtrl_status st, late;
    char msg[MTRL_ERROR_MSG_MAX], late_msg[MTRL_ERROR_MSG_MAX];
    double waited_ms;
    atomic_int returned;
} timeout_ctx;

// Rank 0 all-reduces; rank 1 does not come until rank 0 has returned, then calls a barrier.
static void timeout_rank_(mtrl_dist_comm *c, void *p) {
    timeout_ctx *x = p;
    mtrl_error err = {0};
    float *d = td_dev_alloc_(sizeof(float));
    if (mtrl_dist_comm_rank(c) == 0) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        x->st = mtrl_dist_comm_allreduce(c, d, 1, MTRL_DT_F32, &err);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        x->waited_ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
        snprintf(x->msg, sizeof x->msg, "%s", err.msg);
        atomic_store(&x->returned, 1);
    } else if (mtrl_dist_comm_rank(c) == 1) {
        while (!atomic_load(&x->returned)) nanosleep(&(struct timespec){0, 1000000}, NULL);
        x->late = mtrl_dist_comm_barrier(c, &err);
        snprintf(x->late_msg, sizeof x->late_msg, "%s", err.msg);
    }
    td_dev_free_(d);
}

static void timeout_(void) {
    timeout_ctx *x = calloc(1, sizeof *x);
    run_ranks_(2, 2000, timeout_rank_, x);
    printf("nccl timeout: rank 0 after %.0f ms: %s\nnccl timeout: the late rank: %s\n", x->waited_ms, x->msg, x->late_msg);
    TEST_EQ_INT(x->st, MTRL_ERR_TIMEOUT);
    TEST_CONTAINS(x->msg, "all_reduce");
    TEST_CONTAINS(x->msg, "rank 0 of 2");
    TEST_CONTAINS(x->msg, "2000 ms");
    TEST_CHECKF(x->late != MTRL_OK, "the late rank's barrier with an aborted peer returned OK");
    free(x);
}
#endif

int main(void) {
#ifndef MTRL_HAVE_NCCL
    test_skip("a build without NCCL");
#else
    int n = mtrl_gpu_count();
    if (n == 0) test_skip("no CUDA device");
    if (n > MTRL_DIST_RANKS_MAX) n = MTRL_DIST_RANKS_MAX;
    ops_(1);
    if (n >= 2) {
        ops_(n);
        timeout_();
    } else {
        printf("one GPU: the world of several ranks and the timeout need two\n");
    }
    return test_report();
#endif
}
