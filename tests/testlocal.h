// testlocal.h: a world of the local communicator (learner/dist_comm.h) as threads of the test,
// rank r on thread r (header-only; test_dist_dp, test_dist_ep). The rank functions record what
// they got; the checks run on the main thread after every rank returned (the counters of
// testhelp.h are not atomic).
#ifndef MTRL_TESTLOCAL_H
#define MTRL_TESTLOCAL_H

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "learner/dist_comm.h"
#include "learner/dist_plan.h"
#include "tests/testhelp.h"

typedef void (*test_local_fn)(mtrl_dist_comm *c, void *ctx);

typedef struct test_local_job {
    mtrl_dist_world *w;
    int rank;
    test_local_fn fn;
    void *ctx;
} test_local_job;

static void *test_local_main_(void *p) {
    test_local_job *j = p;
    mtrl_dist_comm *c = NULL;
    mtrl_error err;
    if (mtrl_dist_comm_init_local(&c, j->w, j->rank, &err) != MTRL_OK) {
        fprintf(stderr, "rank %d: %s\n", j->rank, err.msg);
        abort();
    }
    j->fn(c, j->ctx);
    mtrl_dist_comm_free(c);
    return NULL;
}

// Runs fn on R threads of a world whose calls wait at most timeout_ms.
static inline void test_local_run(int R, int timeout_ms, test_local_fn fn, void *ctx) {
    mtrl_dist_world *w;
    mtrl_error err;
    TEST_EQ_INT(mtrl_dist_world_init(&w, R, timeout_ms, &err), MTRL_OK);
    pthread_t th[MTRL_DIST_RANKS_MAX];
    test_local_job job[MTRL_DIST_RANKS_MAX];
    for (int r = 0; r < R; r++) {
        job[r] = (test_local_job){w, r, fn, ctx};
        pthread_create(&th[r], NULL, test_local_main_, &job[r]);
    }
    for (int r = 0; r < R; r++) pthread_join(th[r], NULL);
    mtrl_dist_world_free(w);
}

#endif
