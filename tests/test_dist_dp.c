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

#include "common/config.h"
#include "common/rng.h"
#include "common/tokenizer.h"
#include "learner/dist_comm.h"
#include "learner/dist_dp.h"
#include "learner/dist_plan.h"
#include "learner/train.h"
#include "model/model.h"
#include "model/qb.h"
#include "tests/testhelp.h"

// fp32 rounding of a sum in another order, through one AdamW step (lr-sized, so parameters
// move by at most lr per step and differ by rounding of that).
#define TOL_REL 1e-5

// ---- a world of threads -----------------------------------------------------------------------

typedef void (*rank_fn)(mtrl_dist_comm *c, void *ctx);
typedef struct rank_job {
    mtrl_dist_world *w;
    int rank;
    rank_fn fn;
    void *ctx;
} rank_job;

static void *rank_main_(void *p) {
    rank_job *j = p;
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

// Runs fn on R threads, rank r on thread r; the checks run after, on the main thread.
static void run_ranks_(int R, int timeout_ms, rank_fn fn, void *ctx) {
    mtrl_dist_world *w;
    mtrl_error err;
    TEST_EQ_INT(mtrl_dist_world_init(&w, R, timeout_ms, &err), MTRL_OK);
    pthread_t th[MTRL_DIST_RANKS_MAX];
    rank_job job[MTRL_DIST_RANKS_MAX];
    for (int r = 0; r < R; r++) {
        job[r] = (rank_job){w, r, fn, ctx};
        pthread_create(&th[r], NULL, rank_main_, &job[r]);
    }
    for (int r = 0; r < R; r++) pthread_join(th[r], NULL);
    mtrl_dist_world_free(w);
}

// ---- the collectives --------------------------------------------------------------------------

enum { N_ELEM = 37, N_BYTES = 23, A2A_E = 5 };

typedef struct ops_ctx {
    int R;
    mtrl_status st[MTRL_DIST_RANKS_MAX][8];
    float ar[MTRL_DIST_RANKS_MAX][N_ELEM], order[MTRL_DIST_RANKS_MAX];
    double ar64[MTRL_DIST_RANKS_MAX][N_ELEM];
    float rs[MTRL_DIST_RANKS_MAX][N_ELEM];
    unsigned char ag[MTRL_DIST_RANKS_MAX][MTRL_DIST_RANKS_MAX * N_BYTES];
    unsigned char ag_in[MTRL_DIST_RANKS_MAX][MTRL_DIST_RANKS_MAX * N_BYTES];
    unsigned char bc[MTRL_DIST_RANKS_MAX][N_BYTES];
    int a2a_bad[MTRL_DIST_RANKS_MAX];
} ops_ctx;

static float val_(int r, int i) { return (float)((r + 1) * 1000 + i) * 0.25f; } // exact sums
static unsigned char byte_(int r, int i) { return (unsigned char)(r * 31 + i * 7 + 1); }
static int64_t a2a_rows_(int q, int e) { return (q * 3 + e * 7) % 4; } // 0..3 rows, some 0

// The exchange of dist_plan.h: rows sorted by expert, each row (source, expert, index).
static int a2a_run_(mtrl_dist_comm *c, mtrl_status *st) {
    int R = mtrl_dist_comm_ranks(c), me = mtrl_dist_comm_rank(c), bad = 0;
    mtrl_dist_experts x;
    if (mtrl_dist_experts_make(&x, A2A_E, R, NULL) != MTRL_OK) return 1;
    int64_t rows_all[MTRL_DIST_RANKS_MAX * A2A_E], n_send = 0, n_recv = 0;
    for (int q = 0; q < R; q++)
        for (int e = 0; e < A2A_E; e++) rows_all[q * A2A_E + e] = a2a_rows_(q, e);
    int64_t sc[MTRL_DIST_RANKS_MAX], so[MTRL_DIST_RANKS_MAX], rc[MTRL_DIST_RANKS_MAX], ro[MTRL_DIST_RANKS_MAX];
    mtrl_dist_a2a_send(&x, rows_all + me * A2A_E, sc, so);
    mtrl_dist_a2a_recv(&x, me, rows_all, rc, ro, NULL);
    for (int q = 0; q < R; q++) n_send += sc[q], n_recv += rc[q];
    int32_t *send = calloc((size_t)n_send * 3 + 1, sizeof(int32_t)), *recv = calloc((size_t)n_recv * 3 + 1, sizeof(int32_t));
    int64_t at = 0;
    for (int e = 0; e < A2A_E; e++)
        for (int j = 0; j < a2a_rows_(me, e); j++, at++)
            send[at * 3] = me, send[at * 3 + 1] = e, send[at * 3 + 2] = j;
    *st = mtrl_dist_comm_alltoallv(c, send, sc, so, recv, rc, ro, 3 * sizeof(int32_t), NULL);
    // From each source, its rows of my experts in expert order, at that source's offset.
    for (int q = 0; q < R; q++) {
        int64_t k = ro[q];
        for (int e = x.first[me]; e < x.first[me + 1]; e++)
            for (int j = 0; j < a2a_rows_(q, e); j++, k++)
                bad += recv[k * 3] != q || recv[k * 3 + 1] != e || recv[k * 3 + 2] != j;
        bad += k != ro[q] + rc[q];
    }
    free(send);
    free(recv);
    return bad;
}

static void ops_rank_(mtrl_dist_comm *c, void *p) {
    ops_ctx *x = p;
    int r = mtrl_dist_comm_rank(c), R = mtrl_dist_comm_ranks(c);
    mtrl_status *st = x->st[r];
    st[0] = mtrl_dist_comm_barrier(c, NULL);
    for (int i = 0; i < N_ELEM; i++) x->ar[r][i] = val_(r, i), x->ar64[r][i] = val_(r, i) * 1e-3;
    st[1] = mtrl_dist_comm_allreduce(c, x->ar[r], N_ELEM, MTRL_DT_F32, NULL);
    st[2] = mtrl_dist_comm_allreduce(c, x->ar64[r], N_ELEM, MTRL_DT_F64, NULL);
    // A sum whose fp32 value depends on the order: 1e8 + 1 + ... - 1e8.
    x->order[r] = r == 0 ? 1e8f : r == R - 1 ? -1e8f : 1.0f;
    if (R == 1) x->order[r] = 3.0f;
    mtrl_status so = mtrl_dist_comm_allreduce(c, &x->order[r], 1, MTRL_DT_F32, NULL);
    float *send = malloc(sizeof(float) * (size_t)R * N_ELEM);
    for (int q = 0; q < R; q++)
        for (int i = 0; i < N_ELEM; i++) send[q * N_ELEM + i] = val_(r, q * N_ELEM + i);
    st[3] = mtrl_dist_comm_reduce_scatter(c, send, x->rs[r], N_ELEM, NULL);
    free(send);
    unsigned char mine[N_BYTES];
    for (int i = 0; i < N_BYTES; i++) mine[i] = byte_(r, i), x->ag_in[r][r * N_BYTES + i] = byte_(r, i);
    st[4] = mtrl_dist_comm_allgather(c, mine, x->ag[r], N_BYTES, NULL);
    mtrl_status si = mtrl_dist_comm_allgather(c, x->ag_in[r] + r * N_BYTES, x->ag_in[r], N_BYTES, NULL); // in place
    int root = R - 1;
    for (int i = 0; i < N_BYTES; i++) x->bc[r][i] = r == root ? byte_(99, i) : 0;
    st[5] = mtrl_dist_comm_broadcast(c, x->bc[r], N_BYTES, root, NULL);
    x->a2a_bad[r] = a2a_run_(c, &st[6]);
    st[7] = so != MTRL_OK ? so : si;
}

static void test_ops_(int R) {
    ops_ctx *x = calloc(1, sizeof *x);
    x->R = R;
    run_ranks_(R, 5000, ops_rank_, x);
    float order = R == 1 ? 3.0f : 1e8f;
    for (int q = 1; q < R; q++) order += q == R - 1 ? -1e8f : 1.0f; // rank order, in fp32
    for (int r = 0; r < R; r++) {
        for (int k = 0; k < 8; k++) TEST_CHECKF(x->st[r][k] == MTRL_OK, "R=%d rank %d op %d: %d", R, r, k, x->st[r][k]);
        int bad = 0;
        for (int i = 0; i < N_ELEM; i++) {
            float want = 0, want_rs = 0;
            double want64 = 0;
            for (int q = 0; q < R; q++) {
                want += val_(q, i);
                want64 += val_(q, i) * 1e-3;
                want_rs += val_(q, r * N_ELEM + i);
            }
            bad += x->ar[r][i] != want || x->rs[r][i] != want_rs;
            bad += memcmp(&x->ar64[r][i], &x->ar64[0][i], sizeof(double)) != 0; // the same bits everywhere
            bad += fabs(x->ar64[r][i] - want64) > 1e-12;
        }
        TEST_CHECKF(bad == 0, "R=%d rank %d: %d all-reduce / reduce-scatter values wrong", R, r, bad);
        TEST_CHECKF(x->order[r] == order, "R=%d rank %d: the order-dependent sum %.9g, rank order gives %.9g", R, r,
                    x->order[r], order);
        bad = 0;
        for (int q = 0; q < R; q++)
            for (int i = 0; i < N_BYTES; i++)
                bad += x->ag[r][q * N_BYTES + i] != byte_(q, i) || x->ag_in[r][q * N_BYTES + i] != byte_(q, i);
        for (int i = 0; i < N_BYTES; i++) bad += x->bc[r][i] != byte_(99, i);
        TEST_CHECKF(bad == 0, "R=%d rank %d: %d all-gather / broadcast bytes wrong", R, r, bad);
        TEST_CHECKF(x->a2a_bad[r] == 0, "R=%d rank %d: %d all-to-all-v rows misplaced", R, r, x->a2a_bad[r]);
    }
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
    TEST_EQ_INT(mtrl_dist_comm_init_local(&a, w, 1, &err), MTRL_OK);
    TEST_EQ_INT(mtrl_dist_comm_init_local(&b, w, 1, &err), MTRL_ERR_USAGE);
    TEST_EQ_INT(mtrl_dist_comm_init_local(&b, w, 2, &err), MTRL_ERR_USAGE);
    mtrl_dist_comm_free(a);
    mtrl_dist_world_free(w);
}

// ---- the DP step ------------------------------------------------------------------------------

enum { NEP = 10 };
static const int lens_[NEP] = {17, 40, 95, 130, 23, 64, 8, 150, 33, 77};

// Episode i: BOS and a prompt, then model tokens with a tool result in the middle, behaviour
// log-probs away from the learner's (ratios off 1, clipping and TIS at work), groups
// interleaved (group_id i % 3), episode 5 truncated (masked by mask_truncated).
static void episode_(mtrl_traj *t, int i) {
    mtrl_traj_reset(t);
    t->episode_id = (uint64_t)i;
    t->group_id = (uint64_t)(i % 3);
    uint64_t s = mtrl_rng_stream("test.dist_dp", (uint64_t)i, 0);
    int prompt = 3 + i % 5;
    for (int j = 0; j < lens_[i]; j++) {
        uint32_t id = j == 0 ? MTRL_TOK_BOS : (uint32_t)(mtrl_rng_u64(5, s, (uint64_t)j) % 256);
        uint8_t kind = j < prompt ? MTRL_TOK_PROMPT : (j / 11) % 3 == 2 ? MTRL_TOK_TOOL : MTRL_TOK_MODEL;
        float lp = kind == MTRL_TOK_MODEL ? (float)(-4.0 - 2.0 * mtrl_rng_uniform(5, s, 1000 + (uint64_t)j)) : 0.0f;
        mtrl_traj_append(t, id, lp, 0, kind, NULL);
    }
    t->reward = (double)(i * 7 % 5) / 4.0;
    t->status = i == 5 ? MTRL_EP_TRUNCATED : MTRL_EP_COMPLETE;
}

static void config_(mtrl_config *cfg, const char *extra) {
    char text[1024];
    snprintf(text, sizeof text,
             "[run]\nseed = 1\n[model]\npreset = tiny\n[env]\nname = calc\n[learner]\nlr = 0.003\nweight_decay = 0.1\n"
             "%s", extra);
    mtrl_config_errors errs = {0};
    mtrl_status s = mtrl_config_load_text(cfg, "t.ini", text, NULL, 0, &errs);
    if (s != MTRL_OK) mtrl_config_errors_print(&errs, stderr);
    mtrl_config_errors_free(&errs);
    TEST_EQ_INT(s, MTRL_OK);
}

static void model_(mtrl_model *m, const mtrl_config *cfg, int qb_mode) {
    mtrl_model_dims d;
    TEST_EQ_INT(mtrl_model_dims_from_config(&d, cfg, MTRL_VOCAB, NULL), MTRL_OK);
    mtrl_model_init(m, &d, 11);
    // β changes with QB on from the units a rank runs (dist_dp.h), so the comparisons with one
    // rank over two steps keep it frozen; test_qb_ checks the reduction with QB on.
    mtrl_qb_set_mode(m, qb_mode);
}

// What one rank (or the one-rank reference) leaves after each step.
typedef struct step_out {
    mtrl_status st[2];
    char msg[MTRL_ERROR_MSG_MAX];
    mtrl_step_stats stats[2];
    real *params[2], *grads[2], *adam_m, *adam_v, *qb_beta;
    long *loads;
    size_t lo, hi;            // the bytes of its shard (one rank: the whole block)
} step_out;

typedef struct dp_ctx {
    const mtrl_config *cfg;
    const mtrl_algo_config *algo;
    mtrl_traj *const *eps;
    int steps, qb_mode, sft;
    int odd_rank;             // > 0: rank odd_rank - 1 is given the batch less its first episode
    step_out out[MTRL_DIST_RANKS_MAX];
} dp_ctx;

static real *copy_(const void *p, size_t bytes) {
    real *c = malloc(bytes);
    memcpy(c, p, bytes);
    return c;
}

static void snapshot_(step_out *o, const mtrl_model *m, int step) {
    size_t n = m->params.total;
    o->params[step] = copy_(m->params.base, n);
    o->grads[step] = copy_(m->grads, n);
    o->adam_m = copy_(m->adam_m, n);
    o->adam_v = copy_(m->adam_v, n);
    o->qb_beta = copy_(m->qb_beta, sizeof(real) * (size_t)m->dims.L * m->dims.E);
}

static void step_out_free_(step_out *o) {
    for (int s = 0; s < 2; s++) free(o->params[s]), free(o->grads[s]);
    free(o->adam_m), free(o->adam_v), free(o->qb_beta), free(o->loads);
}

static void dp_rank_(mtrl_dist_comm *c, void *p) {
    dp_ctx *x = p;
    int r = mtrl_dist_comm_rank(c);
    step_out *o = &x->out[r];
    mtrl_model m;
    model_(&m, x->cfg, x->qb_mode);
    mtrl_dist_dp dp;
    mtrl_error err = {0};
    o->st[0] = mtrl_dist_dp_init(&dp, c, &m, &err);
    if (o->st[0] != MTRL_OK) {
        snprintf(o->msg, sizeof o->msg, "%s", err.msg);
        mtrl_model_free(&m);
        return;
    }
    const mtrl_dist_shard *sh = &dp.shards.rank[r];
    o->lo = sh->begin < dp.shards.total ? sh->begin : dp.shards.total;
    o->hi = sh->end < dp.shards.total ? sh->end : dp.shards.total;
    o->loads = calloc((size_t)m.dims.L * m.dims.E, sizeof(long));
    int odd = x->odd_rank == r + 1;
    for (int s = 0; s < x->steps; s++) {
        o->stats[s].loads = o->loads;
        mtrl_traj *const *eps = x->eps + odd;
        if (x->sft) o->st[s] = mtrl_dist_dp_sft_step(&dp, &m, x->cfg, eps, NEP - odd, 3e-3, &o->stats[s].loss, &err);
        else o->st[s] = mtrl_dist_dp_rl_step(&dp, &m, x->cfg, x->algo, eps, NEP - odd, &o->stats[s], &err);
        if (o->st[s] != MTRL_OK) snprintf(o->msg, sizeof o->msg, "%s", err.msg);
        snapshot_(o, &m, s);
    }
    mtrl_dist_dp_free(&dp);
    mtrl_model_free(&m);
}

static void reference_(dp_ctx *x, step_out *o) {
    mtrl_model m;
    model_(&m, x->cfg, x->qb_mode);
    o->lo = 0;
    o->hi = m.params.total;
    o->loads = calloc((size_t)m.dims.L * m.dims.E, sizeof(long));
    for (int s = 0; s < x->steps; s++) {
        o->stats[s].loads = o->loads;
        if (x->sft) o->stats[s].loss = mtrl_train_sft_step(&m, x->cfg, x->eps, NEP, 3e-3);
        else mtrl_train_rl_step(&m, x->cfg, x->algo, x->eps, NEP, &o->stats[s]);
        snapshot_(o, &m, s);
    }
    mtrl_model_free(&m);
}

// max |a - b| / max |b| over bytes [lo, hi) of two blocks (0 for an empty range).
static double block_rel_(const real *a, const real *b, size_t lo, size_t hi) {
    double num = 0, den = 0;
    for (size_t i = lo / sizeof(real); i < hi / sizeof(real); i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (d > num) num = d;
        if (fabs((double)b[i]) > den) den = fabs((double)b[i]);
    }
    return den > 0 ? num / den : num;
}

// The DP step on R ranks against one rank, for config text `extra`.
static void test_dp_(int R, const char *extra, int steps, int sft, const char *what) {
    mtrl_config cfg;
    config_(&cfg, extra);
    mtrl_algo_config algo;
    mtrl_error err;
    TEST_EQ_INT(mtrl_train_algo_config(&cfg, &algo, &err), MTRL_OK);
    mtrl_traj tr[NEP], *eps[NEP];
    for (int i = 0; i < NEP; i++) mtrl_traj_init(&tr[i]), episode_(&tr[i], i), eps[i] = &tr[i];
    dp_ctx *x = calloc(1, sizeof *x);
    *x = (dp_ctx){.cfg = &cfg, .algo = &algo, .eps = eps, .steps = steps, .qb_mode = MTRL_QB_FROZEN, .sft = sft};
    step_out ref = {0};
    reference_(x, &ref);
    run_ranks_(R, 60000, dp_rank_, x);
    size_t total = x->out[0].hi - x->out[0].lo;
    for (int r = 0; r < R; r++) total = x->out[r].hi > total ? x->out[r].hi : total;
    for (int s = 0; s < steps; s++) {
        const mtrl_step_stats *w = &ref.stats[s];
        printf("%s, %d ranks, step %d: loss %.9g grad_norm %.9g (one rank: %.9g, %.9g)\n", what, R, s + 1,
               x->out[0].stats[s].loss, x->out[0].stats[s].grad_norm, w->loss, w->grad_norm); // sft: no norm (0)
        if (strstr(what, "clipped"))
            TEST_CHECKF(w->grad_norm > 0.05, "%s: norm %.3g, clipping at 0.05 not active", what, w->grad_norm);
        double worst_p = 0;
        for (int r = 0; r < R; r++) {
            step_out *o = &x->out[r];
            TEST_CHECKF(o->st[s] == MTRL_OK, "%s rank %d step %d: %s", what, r, s + 1, o->msg);
            const mtrl_step_stats *g = &o->stats[s];
            TEST_CLOSE(g->loss, w->loss, TOL_REL, 1e-9);
            if (!sft) {
                TEST_CLOSE(g->grad_norm, w->grad_norm, TOL_REL, 0);
                TEST_CLOSE(g->pg_loss, w->pg_loss, TOL_REL, 1e-9);
                TEST_CLOSE(g->entropy_mean, w->entropy_mean, TOL_REL, 0);
                TEST_CLOSE(g->ratio_mean, w->ratio_mean, TOL_REL, 0);
                TEST_CLOSE(g->kl_k3, w->kl_k3, TOL_REL, 1e-12);
                TEST_CLOSE(g->clip_low + g->clip_high + g->clip_dual, w->clip_low + w->clip_high + w->clip_dual, 0, 1e-12);
                TEST_EQ_INT(g->tokens, w->tokens);
                TEST_EQ_INT(g->model_tokens, w->model_tokens);
                TEST_EQ_INT(g->groups, w->groups);
                TEST_CLOSE(g->staleness_mean, w->staleness_mean, 0, 1e-12);
                TEST_CLOSE(g->reward_mean, w->reward_mean, 0, 1e-12);
                // The rank's shard of the reduced gradients, clipped as one rank clips them.
                double eg = block_rel_(o->grads[s], ref.grads[s], o->lo, o->hi);
                TEST_CHECKF(eg <= TOL_REL, "%s rank %d step %d: gradient shard off by %.3g (relative to its largest)",
                            what, r, s + 1, eg);
            }
            double ep = block_rel_(o->params[s], ref.params[s], 0, total);
            if (ep > worst_p) worst_p = ep;
            // Elementwise. AdamW moves a parameter by lr g / (|g| + eps) at the first step: a
            // gradient of about eps (1e-8), left by cancellation, changes its update by a
            // fraction of lr when the two summation orders round it differently (a few in
            // 10^4 of the parameters here, by up to ~1.5e-3 lr). So every parameter within
            // TOL_REL or 0.01 lr, and all but 0.01% within TOL_REL or 1e-4 lr.
            size_t np = total / sizeof(real), off = 0;
            TEST_ARRAY_CLOSE(o->params[s], ref.params[s], np, TOL_REL, 0.01 * cfg.learner.lr);
            for (size_t i = 0; i < np; i++)
                off += fabs((double)o->params[s][i] - (double)ref.params[s][i]) > TOL_REL * fabs((double)ref.params[s][i]) + 1e-4 * cfg.learner.lr;
            TEST_CHECKF(off * 10000 <= np, "%s rank %d step %d: %zu of %zu parameters beyond %g relative and 1e-4 lr", what,
                        r, s + 1, off, np, TOL_REL);
            if (r == 0) printf("  %zu of %zu parameters beyond %g relative and 1e-4 lr\n", off, np, TOL_REL);
            if (r) TEST_CHECKF(!memcmp(o->params[s], x->out[0].params[s], total), "%s step %d: rank %d's parameters "
                               "differ from rank 0's", what, s + 1, r);
        }
        printf("  parameters: largest difference from one rank %.3g of the largest parameter\n", worst_p);
    }
    if (steps == 2)
        for (int r = 0; r < R; r++) {
            step_out *o = &x->out[r];
            double em = block_rel_(o->adam_m, ref.adam_m, o->lo, o->hi), ev = block_rel_(o->adam_v, ref.adam_v, o->lo, o->hi);
            printf("  rank %d moments of bytes [%zu, %zu): m off by %.3g, v by %.3g\n", r, o->lo, o->hi, em, ev);
            TEST_CHECKF(em <= TOL_REL && ev <= TOL_REL, "%s rank %d: moments off by %.3g, %.3g", what, r, em, ev);
            TEST_ARRAY_CLOSE(o->adam_m + o->lo / sizeof(real), ref.adam_m + o->lo / sizeof(real),
                             (o->hi - o->lo) / sizeof(real), 1e-4, 1e-9);
        }
    for (int r = 0; r < R; r++) step_out_free_(&x->out[r]);
    step_out_free_(&ref);
    free(x);
    for (int i = 0; i < NEP; i++) mtrl_traj_free(&tr[i]);
}

// With QB on: the loads of the ranks' shares add up to one rank's, and β is the same on every
// rank.
static void test_qb_(int R) {
    mtrl_config cfg;
    config_(&cfg, "");
    mtrl_algo_config algo;
    TEST_EQ_INT(mtrl_train_algo_config(&cfg, &algo, NULL), MTRL_OK);
    mtrl_traj tr[NEP], *eps[NEP];
    for (int i = 0; i < NEP; i++) mtrl_traj_init(&tr[i]), episode_(&tr[i], i), eps[i] = &tr[i];
    dp_ctx *x = calloc(1, sizeof *x);
    *x = (dp_ctx){.cfg = &cfg, .algo = &algo, .eps = eps, .steps = 1, .qb_mode = MTRL_QB_TRAIN};
    step_out ref = {0};
    reference_(x, &ref);
    run_ranks_(R, 60000, dp_rank_, x);
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
    for (int r = 0; r < R; r++) step_out_free_(&x->out[r]);
    step_out_free_(&ref);
    free(x);
    for (int i = 0; i < NEP; i++) mtrl_traj_free(&tr[i]);
}

// Ranks given different batches: every rank's step fails (the count check, or a peer that left
// at it), at least one naming the cause; none returns MTRL_OK.
static void test_odd_batch_(void) {
    mtrl_config cfg;
    config_(&cfg, "");
    mtrl_algo_config algo;
    TEST_EQ_INT(mtrl_train_algo_config(&cfg, &algo, NULL), MTRL_OK);
    mtrl_traj tr[NEP], *eps[NEP];
    for (int i = 0; i < NEP; i++) mtrl_traj_init(&tr[i]), episode_(&tr[i], i), eps[i] = &tr[i];
    dp_ctx *x = calloc(1, sizeof *x);
    *x = (dp_ctx){.cfg = &cfg, .algo = &algo, .eps = eps, .steps = 1, .qb_mode = MTRL_QB_FROZEN, .odd_rank = 2};
    run_ranks_(2, 1000, dp_rank_, x);
    int named = 0;
    for (int r = 0; r < 2; r++) {
        TEST_CHECKF(x->out[r].st[0] != MTRL_OK, "rank %d took a step on a batch the other rank did not have", r);
        named += x->out[r].st[0] == MTRL_ERR_MISMATCH && strstr(x->out[r].msg, "different batches");
        step_out_free_(&x->out[r]);
    }
    TEST_CHECKF(named >= 1, "no rank named the different batches: %s / %s", x->out[0].msg, x->out[1].msg);
    free(x);
    for (int i = 0; i < NEP; i++) mtrl_traj_free(&tr[i]);
}

int main(void) {
    for (int R = 1; R <= 4; R++) test_ops_(R);
    test_failures_();
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
