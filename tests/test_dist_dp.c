// mtrl-test: cpu
// The data-parallel learner's data path on threads (issue 27): the local communicator
// (learner/dist_comm.h) and the DP step (learner/dist_dp.h).
//   * every local collective's result, exactly (values whose sums are exact, and a sum whose
//     value depends on the order: rank order, the same bits on every rank), in place and not;
//     the all-to-all-v with the counts and offsets of learner/dist_plan.h's exchange;
//   * a rank that never arrives: the others return MTRL_ERR_TIMEOUT within the 200 ms timeout
//     naming the op, themselves, the timeout and the missing rank; the late rank then gets
//     MTRL_ERR_STATE; ranks calling different collectives get MTRL_ERR_MISMATCH;
//   * the DP RL step over 2 and 3 ranks against one rank's mtrl_train_rl_step on the same
//     batch of mixed-length episodes (groups interleaved, a truncated one masked, tool
//     tokens, stale tokens at the second step): the loss and the other statistics, the
//     gradient norm (clipping active), each rank's reduced and clipped gradient shard, every
//     parameter after each of two steps, and each rank's shard of both AdamW moments after
//     the second; the replicas' parameters equal bit for bit; a second configuration
//     (seq_mean_token_mean, entropy bonus, segments of 64 tokens) over 2 ranks; the DP
//     supervised step against mtrl_train_sft_step;
//   * with QB on, the routing loads summed over the ranks equal one rank's, and β is the same
//     on every rank, bit for bit.
// Tolerances: the ranks' gradients are summed in another order than one rank's backward sums
// them (fp32), so values are compared with a relative tolerance (TOL_REL below, stated per
// check); equality across ranks is exact.
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/config.h"
#include "common/gpu.h"
#include "common/rng.h"
#include "common/tokenizer.h"
#include "learner/dist_comm.h"
#include "learner/dist_dp.h"
#include "learner/dist_plan.h"
#include "learner/train.h"
#include "model/model.h"
#include "model/qb.h"
#include "tests/testdist.h"
#include "tests/testdp.h"
#include "tests/testhelp.h"

// fp32 rounding of a sum in another order, through one AdamW step (lr-sized, so parameters
// move by at most lr per step and differ by rounding of that).
#define TOL_REL 1e-5

// ---- a world of threads -----------------------------------------------------------------------

// Runs fn on R threads of host buffers, rank r on thread r; the checks run after, on the main thread.
static void run_ranks_(int R, int timeout_ms, test_rank_fn fn, void *ctx) { test_dist_run_local(R, timeout_ms, -1, fn, ctx); }

// ---- the collectives (tests/testdist.h) on host memory ------------------------------------------

static void *host_alloc_(size_t n) { return calloc(1, n); }
static void host_copy_(void *dst, const void *src, size_t n) { memcpy(dst, src, n); }
static const test_dist_mem host_mem_ = {host_alloc_, host_copy_, host_copy_, free};

static void test_ops_(int R) {
    test_dist_ops *x = calloc(1, sizeof *x);
    x->mem = &host_mem_;
    run_ranks_(R, 5000, test_dist_ops_rank, x);
    test_dist_ops_check(x, R, 1, "local");
    free(x);
}

// One rank never arrives; it calls only after the others returned.
typedef struct timeout_ctx {
    mtrl_status st[3], late;
    char msg[3][MTRL_ERROR_MSG_MAX], late_msg[MTRL_ERROR_MSG_MAX];
    double waited[3];
    atomic_int returned;
} timeout_ctx;

static void timeout_rank_(mtrl_dist_comm *c, void *p) {
    timeout_ctx *x = p;
    int r = mtrl_dist_comm_rank(c);
    mtrl_error err = {0};
    float v = 1;
    if (r == 2) {
        while (atomic_load(&x->returned) < 2) nanosleep(&(struct timespec){0, 1000000}, NULL);
        x->late = mtrl_dist_comm_allreduce(c, &v, 1, MTRL_DT_F32, &err);
        snprintf(x->late_msg, sizeof x->late_msg, "%s", err.msg);
        return;
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    x->st[r] = mtrl_dist_comm_allreduce(c, &v, 1, MTRL_DT_F32, &err);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    x->waited[r] = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
    snprintf(x->msg[r], sizeof x->msg[r], "%s", err.msg);
    atomic_fetch_add(&x->returned, 1);
}

// Two ranks calling different collectives.
typedef struct mismatch_ctx {
    mtrl_status st[2], op[2];
    char msg[2][MTRL_ERROR_MSG_MAX];
} mismatch_ctx;

static void mismatch_rank_(mtrl_dist_comm *c, void *p) {
    mismatch_ctx *x = p;
    int r = mtrl_dist_comm_rank(c);
    float v[5] = {0};
    mtrl_error err = {0};
    x->st[r] = mtrl_dist_comm_allreduce(c, v, r ? 5 : 4, MTRL_DT_F32, &err);
    snprintf(x->msg[r], sizeof x->msg[r], "%s", err.msg);
}

static void mismatch_op_rank_(mtrl_dist_comm *c, void *p) {
    mismatch_ctx *x = p;
    int r = mtrl_dist_comm_rank(c);
    unsigned char b[4] = {0};
    x->op[r] = r ? mtrl_dist_comm_broadcast(c, b, 4, 0, NULL) : mtrl_dist_comm_barrier(c, NULL);
}

static void test_failures_(void) {
    timeout_ctx *x = calloc(1, sizeof *x);
    run_ranks_(3, 200, timeout_rank_, x);
    for (int r = 0; r < 2; r++) {
        TEST_EQ_INT(x->st[r], MTRL_ERR_TIMEOUT);
        char me[32];
        snprintf(me, sizeof me, "rank %d of 3", r);
        TEST_CONTAINS(x->msg[r], "all_reduce");
        TEST_CONTAINS(x->msg[r], me);
        TEST_CONTAINS(x->msg[r], "200 ms");
        TEST_CONTAINS(x->msg[r], "rank(s) 2 did not arrive");
        printf("timeout: rank %d returned after %.0f ms: %s\n", r, x->waited[r], x->msg[r]);
    }
    TEST_EQ_INT(x->late, MTRL_ERR_STATE);
    TEST_CONTAINS(x->late_msg, "failed earlier");
    free(x);

    mismatch_ctx *m = calloc(1, sizeof *m);
    run_ranks_(2, 2000, mismatch_rank_, m);
    run_ranks_(2, 2000, mismatch_op_rank_, m);
    for (int r = 0; r < 2; r++) {
        TEST_EQ_INT(m->st[r], MTRL_ERR_MISMATCH);
        TEST_CONTAINS(m->msg[r], "different collectives");
        TEST_EQ_INT(m->op[r], MTRL_ERR_MISMATCH);
    }
    free(m);

    mtrl_dist_world *w = NULL;
    mtrl_error err;
    TEST_EQ_INT(mtrl_dist_world_init(&w, 0, 100, &err), MTRL_ERR_USAGE);
    TEST_EQ_INT(mtrl_dist_world_init(&w, 2, 0, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "timeout");
    TEST_EQ_INT(mtrl_dist_world_init(&w, 2, 100, &err), MTRL_OK);
    mtrl_dist_comm *a = NULL, *b = NULL;
    // Device buffers need a GPU that exists (test_cuda_dist_dp runs them on one).
    TEST_EQ_INT(mtrl_dist_comm_init_local_device(&a, w, 0, -1, NULL, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "GPU -1");
    if (mtrl_gpu_count() == 0) {
        TEST_EQ_INT(mtrl_dist_comm_init_local_device(&a, w, 0, 0, NULL, &err), MTRL_ERR_USAGE);
        TEST_CONTAINS(err.msg, "no CUDA device");
    }
    TEST_EQ_INT(mtrl_dist_comm_init_local(&a, w, 1, &err), MTRL_OK);
    TEST_EQ_INT(mtrl_dist_comm_gpu(a), -1);
    TEST_EQ_INT(mtrl_dist_comm_init_local(&b, w, 1, &err), MTRL_ERR_USAGE);
    TEST_EQ_INT(mtrl_dist_comm_init_local(&b, w, 2, &err), MTRL_ERR_USAGE);
    mtrl_dist_comm_free(a);
    mtrl_dist_world_free(w);
}

// The file bootstrap of the NCCL backend's id (plain files: no GPU needed).
static void test_bootstrap_(void) {
    char path[256];
    snprintf(path, sizeof path, "/tmp/mtrl_test_dist_dp_id.%ld", (long)getpid());
    unlink(path);
    unsigned char id[128], got[128] = {0};
    for (int i = 0; i < 128; i++) id[i] = (unsigned char)(i * 13 + 5);
    mtrl_error err;
    TEST_EQ_INT(mtrl_dist_bootstrap_file(path, 0, 2, id, sizeof id, 100, &err), MTRL_OK);
    TEST_EQ_INT(mtrl_dist_bootstrap_file(path, 1, 2, got, sizeof got, 100, &err), MTRL_OK);
    TEST_CHECK(!memcmp(id, got, sizeof id));
    TEST_EQ_INT(mtrl_dist_bootstrap_file(path, 0, 2, id, sizeof id, 100, &err), MTRL_ERR_STATE); // another world's
    TEST_CONTAINS(err.msg, "exists");
    unlink(path);
    TEST_EQ_INT(mtrl_dist_bootstrap_file(path, 1, 2, got, sizeof got, 100, &err), MTRL_ERR_TIMEOUT);
    TEST_CONTAINS(err.msg, path);
    TEST_CONTAINS(err.msg, "100 ms");
}

// ---- the DP step (tests/testdp.h) on CPU models ------------------------------------------------

static void world_host_(int R, int timeout_ms, test_rank_fn fn, void *ctx, const test_dp_setup *u) {
    (void)u;
    run_ranks_(R, timeout_ms, fn, ctx);
}

// CPU models over host buffers. Tolerances: fp32 rounding of a sum in another order, through
// AdamW steps (lr-sized, so parameters move by at most lr per step and differ by rounding of
// that): TOL_REL for the statistics, the gradient shards and the moments; every parameter
// within TOL_REL or 0.01 lr, and all but 0.01% within TOL_REL or 1e-4 lr (measured: 6 and 7 of
// 440736 beyond that, by up to ~1.5e-3 lr); the first moment elementwise within 1e-4, 1e-9.
static const test_dp_setup cpu_ = {
    .device = MTRL_DEVICE_CPU, .model_ini = "", .world = world_host_, .gpu_buffers = -1,
    .tol = {.stats = TOL_REL, .clip_abs = 1e-12, .grad = TOL_REL, .param_rel = TOL_REL, .param_lr_all = 0.01,
            .param_lr_most = 1e-4, .param_frac = 1e-4, .moments = TOL_REL, .m_elem_rel = 1e-4, .m_elem_abs = 1e-9}};

static void test_dp_(int R, const char *extra, int steps, int sft, const char *what) {
    test_dp_compare(&cpu_, R, extra, steps, sft, what);
}

// With QB on: the loads of the ranks' shares add up to one rank's, and β is the same on every
// rank.
static void test_qb_(int R) {
    tdp_case *c = tdp_case_run_(&cpu_, R, 60000, "", (tdp_ctx){.steps = 1, .qb_mode = MTRL_QB_TRAIN}, 1);
    tdp_ctx *x = &c->x;
    const mtrl_config cfg = c->cfg;
    tdp_out ref = c->ref;
    mtrl_model_dims d;
    TEST_EQ_INT(mtrl_model_dims_from_config(&d, &cfg, MTRL_VOCAB, NULL), MTRL_OK);
    size_t LE = (size_t)d.L * d.E;
    int changed = 0;
    for (size_t i = 0; i < LE; i++) changed += x->out[0].qb_beta[i] != 0;
    TEST_CHECKF(changed > 0, "QB did not move β");
    for (int r = 0; r < R; r++) {
        TEST_EQ_INT(x->out[r].st[0], MTRL_OK);
        TEST_CHECKF(!memcmp(x->out[r].loads, ref.loads, sizeof(long) * LE), "rank %d: loads differ from one rank's", r);
        TEST_CHECKF(!memcmp(x->out[r].qb_beta, x->out[0].qb_beta, sizeof(real) * LE), "rank %d: β differs from rank 0's", r);
        for (int l = d.first_dense; l < d.L; l++)
            TEST_CLOSE(x->out[r].stats[0].max_violation[l], ref.stats[0].max_violation[l], 0, 1e-12);
    }
    tdp_case_free_(c, R);
}

// Ranks given different batches: every rank's step fails (the count check, or a peer that left
// at it), at least one naming the cause; none returns MTRL_OK.
static void test_odd_batch_(void) {
    tdp_case *c = tdp_case_run_(&cpu_, 2, 1000, "", (tdp_ctx){.steps = 1, .qb_mode = MTRL_QB_FROZEN, .odd_rank = 2}, 0);
    int named = 0;
    for (int r = 0; r < 2; r++) {
        TEST_CHECKF(c->x.out[r].st[0] != MTRL_OK, "rank %d took a step on a batch the other rank did not have", r);
        named += c->x.out[r].st[0] == MTRL_ERR_MISMATCH && strstr(c->x.out[r].msg, "different batches");
    }
    TEST_CHECKF(named >= 1, "no rank named the different batches: %s / %s", c->x.out[0].msg, c->x.out[1].msg);
    tdp_case_free_(c, 2);
}

int main(void) {
    for (int R = 1; R <= 4; R++) test_ops_(R);
    test_failures_();
    test_bootstrap_();
    // Clipping on (the norm of this batch is well above 0.05), segments planned.
    const char *clip = "grad_clip = 0.05\n[algo]\nmask_truncated = true\n";
    test_dp_(2, clip, 2, 0, "rl token_mean clipped");
    test_dp_(3, clip, 2, 0, "rl token_mean clipped");
    test_dp_(2, "grad_clip = 0\nsegment = 64\n[algo]\naggregation = seq_mean_token_mean\nentropy_coef = 0.01\n", 1, 0,
             "rl seq_mean entropy seg64");
    test_dp_(3, "grad_clip = 0.05\n", 1, 1, "sft");
    test_qb_(3);
    test_odd_batch_();
    return test_report();
}
