// mtrl-test: cpu
// One MoE layer expert parallel on the local communicator's threads (learner/dist_ep_moe.h)
// against the model's one-rank layer (model/model_moe.h mtrl_model_moe_layer_fwd / _bwd, what the
// model's FFN runs) on the same tokens: a batch of N tokens cut into consecutive, uneven slices,
// rank r holding slice r (one rank may hold none), over R = 1, 2, 3, 4 ranks, for the tiny preset
// (8 experts, top-2, a shared expert, sigmoid router on z − β: 8 % 3 != 0) and a Kimi-like form
// (6 experts, top-3, no shared expert, softmax scores, top-k of s − β, no renormalisation:
// 6 % 4 != 0), a QB bias β that changes the routing, and again with a replayed routing (R3):
//   * the layer's output and input gradients of every token, within TOL of one rank's (each row
//     is computed by the same functions on the same inputs: bit-equality is expected and the
//     measured worst is printed);
//   * each expert's weight gradients on its owner within TOL of one rank's, every other
//     expert's gradient on that rank exactly zero, the router's and shared experts' gradients
//     summed over the ranks within TOL_SUM of one rank's, nothing else of the gradient touched;
//   * the routing written back equal to one rank's; the loads summed over the ranks equal one
//     rank's exactly on every rank; the β sums and batch counts on every rank equal the sum over
//     the slices of what one rank observes on each slice, bit for bit, and β after mtrl_qb_apply
//     the same bits on every rank;
//   * refusals: fewer experts than ranks, an assignment of another size than the model's or the
//     communicator's, a dense layer, a replayed expert id out of range, negative tokens, a
//     backward without its forward, and ranks passing different statistics levels
//     (MTRL_ERR_MISMATCH from the communicator).
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "common/tokenizer.h"
#include "learner/dist_comm.h"
#include "learner/dist_ep_moe.h"
#include "learner/dist_plan.h"
#include "model/model.h"
#include "model/model_moe.h"
#include "model/qb.h"
#include "tests/testhelp.h"
#include "tests/testdist.h"
#include "tests/testmodel.h"

// fp32 state tolerance relative to the largest entry: the rows are the same computations, so
// anything above rounding is a wrong row.
#define TOL 1e-6
// The router's and shared experts' gradients: R partial sums added in another order.
#define TOL_SUM 1e-5
#define RMAX 4
#define N_TOK 61

static const char *ini_tiny_ = "preset = tiny\n";
static const char *ini_kimi_ = "preset = tiny\nexperts = 6\ntop_k = 3\nshared_experts = 0\nrouter_score = softmax\n"
                               "router_bias = score\nrouter_renorm = false\n";

// Slice sizes of the N_TOK tokens for R ranks (consecutive, uneven; R = 4 has an empty rank).
static const int slice_[RMAX + 1][RMAX] = {{0}, {N_TOK}, {40, 21}, {7, 31, 23}, {20, 0, 29, 12}};

static double worst_out_, worst_dx_, worst_dw_, worst_sum_;

static void worst_(double *w, double e) {
    if (e > *w) *w = e;
}

// One expert-parallel run: R ranks, each with its own replica of the model.
typedef struct ep_run {
    int R, layer, level;
    int start[RMAX + 1];
    const real *x, *dy;
    const uint8_t *routing_in; // [N][n_moe][K] or NULL
    mtrl_model *m[RMAX];
    real *y, *dx;              // [N][d]
    uint8_t *routing_out;      // [N][n_moe][K]
    mtrl_status st[RMAX];
    char msg[RMAX][MTRL_ERROR_MSG_MAX];
} ep_run;

static void ep_rank_(mtrl_dist_comm *c, void *p) {
    ep_run *k = p;
    int r = mtrl_dist_comm_rank(c);
    mtrl_model *m = k->m[r];
    const mtrl_model_dims *d = &m->dims;
    size_t s = (size_t)k->start[r], rt = (size_t)d->n_moe * d->k;
    int T = k->start[r + 1] - k->start[r];
    mtrl_error err = {0};
    mtrl_dist_experts x;
    mtrl_dist_ep_moe e;
    mtrl_status st = mtrl_dist_experts_make(&x, d->E, k->R, &err);
    if (st == MTRL_OK) st = mtrl_dist_ep_moe_init(&e, m, k->layer, &x, c, &err);
    if (st == MTRL_OK)
        st = mtrl_dist_ep_moe_fwd(&e, T, k->x + s * d->d, k->routing_in ? k->routing_in + s * rt : NULL,
                                  k->routing_out + s * rt, k->level, k->y + s * d->d, &err);
    if (st == MTRL_OK) st = mtrl_dist_ep_moe_bwd(&e, k->dy + s * d->d, k->dx + s * d->d, &err);
    mtrl_dist_ep_moe_free(&e);
    k->st[r] = st;
    snprintf(k->msg[r], sizeof k->msg[r], "%s", err.msg);
}

static void *arena_alloc_(void *ar, size_t bytes) { return mtrl_arena_alloc(ar, bytes); }

static void fill_normal_(real *a, size_t n, uint64_t stream, double scale) {
    for (size_t i = 0; i < n; i++) a[i] = (real)(scale * mtrl_rng_normal(7, stream, i));
}

// A routing of every MoE layer: K distinct experts a token, from a random rotation and stride.
static void random_routing_(const mtrl_model_dims *d, uint8_t *rt) {
    for (size_t i = 0; i < (size_t)N_TOK * d->n_moe; i++) {
        int first = (int)(mtrl_rng_u64(9, 1, i) % (uint64_t)d->E);
        for (int j = 0; j < d->k; j++) rt[i * d->k + j] = (uint8_t)((first + j) % d->E);
    }
}

// The model's gradients zero, its step statistics cleared and layer l's β set to `beta`.
static void reset_(mtrl_model *m, int l, const real *beta) {
    const mtrl_model_dims *d = &m->dims;
    mtrl_model_zero_grads(m);
    memset(m->load, 0, sizeof *m->load * (size_t)d->L * d->E);
    memset(m->qb_sum, 0, sizeof *m->qb_sum * (size_t)d->L * d->E);
    memset(m->qb_count, 0, sizeof *m->qb_count * (size_t)d->L);
    memcpy(m->qb_beta + (size_t)l * d->E, beta, sizeof(real) * (size_t)d->E);
}

// 1 when element i of m's gradient block belongs to layer l's router, routed or shared experts.
static int moe_grad_(const mtrl_model *m, int l, size_t i) {
    const mtrl_model_dims *d = &m->dims;
    const mtrl_layer_ptrs *g = &m->G.layer[l];
    size_t EId = (size_t)d->E * d->I * d->d, SId = (size_t)d->n_shared * d->I * d->d;
    const real *at[7] = {g->router, g->ew1, g->ew3, g->ew2, g->sw1, g->sw3, g->sw2};
    size_t n[7] = {(size_t)d->E * d->d, EId, EId, EId, SId, SId, SId};
    for (int j = 0; j < 7; j++)
        if (at[j] && m->grads + i >= at[j] && m->grads + i < at[j] + n[j]) return 1;
    return 0;
}

// Compares the run's gradients with one rank's (ref): the experts on their owners, zeros
// elsewhere, the summed router and shared experts.
static void check_grads_(const ep_run *k, const mtrl_model *ref, const mtrl_dist_experts *x, const char *what) {
    const mtrl_model_dims *d = &ref->dims;
    int l = k->layer;
    size_t EI = (size_t)d->I * d->d, n = ref->params.total / sizeof(real);
    for (int e = 0; e < d->E; e++) {
        const mtrl_layer_ptrs *go = &k->m[mtrl_dist_expert_rank(x, e)]->G.layer[l], *gr = &ref->G.layer[l];
        double err = fmax(test_max_rel(go->ew1 + e * EI, gr->ew1 + e * EI, EI),
                          fmax(test_max_rel(go->ew3 + e * EI, gr->ew3 + e * EI, EI),
                               test_max_rel(go->ew2 + e * EI, gr->ew2 + e * EI, EI)));
        worst_(&worst_dw_, err);
        TEST_CHECKF(err <= TOL, "%s: expert %d's gradient on its owner: %.3g from one rank's", what, e, err);
    }
    for (int r = 0; r < k->R; r++) {
        const mtrl_layer_ptrs *g = &k->m[r]->G.layer[l];
        size_t stray = 0;
        for (int e = 0; e < d->E; e++) {
            if (mtrl_dist_expert_rank(x, e) == r) continue;
            for (size_t i = 0; i < EI; i++)
                stray += g->ew1[e * EI + i] != 0 || g->ew3[e * EI + i] != 0 || g->ew2[e * EI + i] != 0;
        }
        for (size_t i = 0; i < n; i++) stray += !moe_grad_(ref, l, i) && k->m[r]->grads[i] != 0;
        TEST_CHECKF(stray == 0, "%s: rank %d wrote %zu gradient elements outside its experts and the layer", what, r,
                    stray);
    }
    // The router's and shared experts' gradients: each rank's tokens' part, summed.
    const real *gref[4] = {ref->G.layer[l].router, ref->G.layer[l].sw1, ref->G.layer[l].sw3, ref->G.layer[l].sw2};
    size_t SI = (size_t)d->n_shared * d->I * d->d, cnt[4] = {(size_t)d->E * d->d, SI, SI, SI};
    for (int j = 0; j < 4; j++) {
        if (!cnt[j]) continue;
        real *sum = calloc(cnt[j], sizeof *sum);
        for (int r = 0; r < k->R; r++) {
            const mtrl_layer_ptrs *g = &k->m[r]->G.layer[l];
            const real *a = j == 0 ? g->router : j == 1 ? g->sw1 : j == 2 ? g->sw3 : g->sw2;
            for (size_t i = 0; i < cnt[j]; i++) sum[i] += a[i];
        }
        double err = test_max_rel(sum, gref[j], cnt[j]);
        worst_(&worst_sum_, err);
        TEST_CHECKF(err <= TOL_SUM, "%s: %s gradient summed over the ranks: %.3g from one rank's", what,
                    j ? "shared expert" : "router", err);
        free(sum);
    }
}

// The QB statistics: loads equal one rank's exactly on every rank; β sums and batches what one
// rank observes on each slice, summed in rank order; β after the update the same on every rank.
static void check_stats_(const ep_run *k, mtrl_model *ref, const char *what) {
    const mtrl_model_dims *d = &ref->dims;
    int l = k->layer, E = d->E;
    double want[MTRL_MODEL_MOE_STATS(256)] = {0};
    for (int r = 0; r < k->R; r++) {
        int T = k->start[r + 1] - k->start[r];
        size_t rt = (size_t)d->n_moe * d->k;
        mtrl_arena ar;
        mtrl_arena_init(&ar, (size_t)1 << 22);
        mtrl_model_moe_rows rows;
        double st[MTRL_MODEL_MOE_STATS(256)];
        mtrl_model_moe_rows_carve(d, T, arena_alloc_, &ar, &rows);
        mtrl_model_moe_route_fwd(ref, l, T, k->x + (size_t)k->start[r] * d->d,
                                 k->routing_in ? k->routing_in + (size_t)k->start[r] * rt : NULL, NULL, &rows);
        mtrl_model_moe_observe(ref, l, T, &rows, k->level, st);
        for (int i = 0; i < MTRL_MODEL_MOE_STATS(E); i++) want[i] += st[i];
        mtrl_arena_free(&ar);
    }
    for (int r = 0; r < k->R; r++) {
        const mtrl_model *m = k->m[r];
        int loads = 0, sums = 0;
        for (int e = 0; e < E; e++) {
            loads += m->load[(size_t)l * E + e] == ref->load[(size_t)l * E + e];
            sums += m->qb_sum[(size_t)l * E + e] == want[E + e];
        }
        TEST_CHECKF(loads == E, "%s: rank %d: %d of %d experts' loads equal one rank's", what, r, loads, E);
        TEST_CHECKF(sums == E && m->qb_count[l] == (int)want[2 * E],
                    "%s: rank %d: %d of %d β sums, %d batches (want %d)", what, r, sums, E, m->qb_count[l],
                    (int)want[2 * E]);
    }
    if (k->level >= 2) TEST_CHECKF(want[2 * E] >= 1, "%s: no slice large enough for a β", what);
    for (int r = 0; r < k->R; r++) {
        mtrl_qb_set_mode(k->m[r], MTRL_QB_TRAIN);
        mtrl_qb_apply(k->m[r]);
        TEST_CHECKF(!memcmp(k->m[r]->qb_beta + (size_t)l * E, k->m[0]->qb_beta + (size_t)l * E, sizeof(real) * E),
                    "%s: rank %d's β after the update differs from rank 0's", what, r);
    }
}

// One configuration over R = 1 .. 4 ranks, routed with β and replayed.
static void test_layer_(const char *ini, int layer, const char *name) {
    mtrl_model_dims d = test_model_dims(ini, MTRL_VOCAB);
    TEST_CHECKF(d.E > 0, "%s: dims", name);
    if (d.E == 0) return;
    mtrl_model ref, ms[RMAX];
    mtrl_model_init(&ref, &d, 11);
    for (int r = 0; r < RMAX; r++) mtrl_model_init(&ms[r], &d, 11);
    size_t nd = (size_t)N_TOK * d.d, nrt = (size_t)N_TOK * d.n_moe * d.k;
    real *x = malloc(sizeof(real) * nd), *dy = malloc(sizeof(real) * nd), beta[256];
    real *y_ref = malloc(sizeof(real) * nd), *dx_ref = malloc(sizeof(real) * nd);
    real *y = malloc(sizeof(real) * nd), *dx = malloc(sizeof(real) * nd);
    uint8_t *rt_in = calloc(nrt, 1), *rt_ref = calloc(nrt, 1), *rt = calloc(nrt, 1);
    fill_normal_(x, nd, 1, 1.0);
    fill_normal_(dy, nd, 2, 1.0);
    fill_normal_(beta, (size_t)d.E, 3, 0.3);
    random_routing_(&d, rt_in);
    for (int replay = 0; replay < 2; replay++) {
        // One rank: the model's layer on all N_TOK tokens.
        reset_(&ref, layer, beta);
        mtrl_arena ar;
        mtrl_arena_init(&ar, (size_t)1 << 24);
        mtrl_model_moe_rows rows;
        memset(rt_ref, 0, nrt);
        mtrl_model_moe_layer_fwd(&ref, &ar, layer, N_TOK, x, replay ? rt_in : NULL, rt_ref, 2, &rows, y_ref);
        mtrl_model_moe_layer_bwd(&ref, &ar, layer, N_TOK, x, &rows, dy, dx_ref);
        if (!replay) { // β must matter, or the replayed and the β-routed runs test the same thing
            real zero[256] = {0};
            memcpy(ref.qb_beta + (size_t)layer * d.E, zero, sizeof(real) * (size_t)d.E);
            mtrl_model_moe_route_fwd(&ref, layer, N_TOK, x, NULL, rt, &rows);
            TEST_CHECKF(memcmp(rt, rt_ref, nrt) != 0, "%s layer %d: β changes no token's routing", name, layer);
            memcpy(ref.qb_beta + (size_t)layer * d.E, beta, sizeof(real) * (size_t)d.E);
        }
        mtrl_arena_free(&ar);
        for (int R = 1; R <= RMAX; R++) {
            char what[128];
            snprintf(what, sizeof what, "%s layer %d%s, %d ranks", name, layer, replay ? " replayed" : "", R);
            ep_run *k = calloc(1, sizeof *k);
            *k = (ep_run){.R = R, .layer = layer, .level = 2, .x = x, .dy = dy, .routing_in = replay ? rt_in : NULL,
                          .y = y, .dx = dx, .routing_out = rt};
            for (int r = 0; r < R; r++) {
                k->start[r + 1] = k->start[r] + slice_[R][r];
                k->m[r] = &ms[r];
                reset_(&ms[r], layer, beta);
            }
            memset(y, 0, sizeof(real) * nd);
            memset(dx, 0, sizeof(real) * nd);
            memset(rt, 0, nrt);
            test_dist_run_local(R, 5000, -1, ep_rank_, k);
            int ok = 1;
            for (int r = 0; r < R; r++) {
                TEST_CHECKF(k->st[r] == MTRL_OK, "%s: rank %d: %s", what, r, k->msg[r]);
                ok &= k->st[r] == MTRL_OK;
            }
            if (ok) {
                double ey = test_max_rel(y, y_ref, nd), ex = test_max_rel(dx, dx_ref, nd);
                worst_(&worst_out_, ey);
                worst_(&worst_dx_, ex);
                TEST_CHECKF(ey <= TOL, "%s: output %.3g from one rank's", what, ey);
                TEST_CHECKF(ex <= TOL, "%s: input gradient %.3g from one rank's", what, ex);
                TEST_CHECKF(!memcmp(rt, rt_ref, nrt), "%s: the routing written back differs from one rank's", what);
                mtrl_dist_experts xa;
                mtrl_dist_experts_make(&xa, d.E, R, NULL);
                check_grads_(k, &ref, &xa, what);
                check_stats_(k, &ref, what);
            }
            free(k);
        }
    }
    free(x); free(dy); free(y_ref); free(dx_ref); free(y); free(dx);
    free(rt_in); free(rt_ref); free(rt);
    mtrl_model_free(&ref);
    for (int r = 0; r < RMAX; r++) mtrl_model_free(&ms[r]);
}

// ---- refusals -------------------------------------------------------------------------------------

typedef struct bad_ctx {
    mtrl_model *m;
    mtrl_status st[2][8];
    char msg[2][8][MTRL_ERROR_MSG_MAX];
} bad_ctx;

static void bad_rank_(mtrl_dist_comm *c, void *p) {
    bad_ctx *b = p;
    int r = mtrl_dist_comm_rank(c), E = b->m->dims.E;
    mtrl_error err[8] = {{0}};
    mtrl_dist_experts x4, x6, x2;
    mtrl_dist_experts_make(&x4, E, 4, NULL);
    mtrl_dist_experts_make(&x6, 6, 2, NULL);
    mtrl_dist_experts_make(&x2, E, 2, NULL);
    mtrl_dist_ep_moe e;
    b->st[r][0] = mtrl_dist_ep_moe_init(&e, b->m, 1, &x4, c, &err[0]); // 4 ranks' assignment, 2 ranks
    b->st[r][1] = mtrl_dist_ep_moe_init(&e, b->m, 1, &x6, c, &err[1]); // 6 experts' assignment
    b->st[r][2] = mtrl_dist_ep_moe_init(&e, b->m, 0, &x2, c, &err[2]); // the dense layer
    b->st[r][3] = mtrl_dist_ep_moe_init(&e, b->m, 1, &x2, c, &err[3]);
    const mtrl_model_dims *d = &b->m->dims;
    real xs[4 * 64] = {0}, ys[4 * 64];
    uint8_t rt[4 * 8 * 8] = {0};
    rt[(size_t)(2 * d->n_moe + 0) * d->k + 1] = (uint8_t)E; // token 2, layer 1, slot 1
    b->st[r][4] = mtrl_dist_ep_moe_fwd(&e, 4, xs, rt, NULL, 1, ys, &err[4]);
    b->st[r][5] = mtrl_dist_ep_moe_fwd(&e, -1, xs, NULL, NULL, 1, ys, &err[5]);
    b->st[r][6] = mtrl_dist_ep_moe_bwd(&e, ys, ys, &err[6]);
    // Different statistics levels: rank 0 all-reduces, rank 1 all-gathers the counts.
    b->st[r][7] = mtrl_dist_ep_moe_fwd(&e, 4, xs, NULL, NULL, r ? 0 : 2, ys, &err[7]);
    mtrl_dist_ep_moe_free(&e);
    for (int i = 0; i < 8; i++) snprintf(b->msg[r][i], sizeof b->msg[r][i], "%s", err[i].msg);
}

static void test_refusals_(void) {
    mtrl_error err = {0};
    mtrl_dist_experts x;
    TEST_EQ_INT(mtrl_dist_experts_make(&x, 3, 4, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "3 experts over 4 ranks");
    mtrl_model_dims d = test_model_dims(ini_tiny_, MTRL_VOCAB);
    mtrl_model m;
    mtrl_model_init(&m, &d, 11);
    bad_ctx *b = calloc(1, sizeof *b);
    b->m = &m;
    test_dist_run_local(2, 2000, -1, bad_rank_, b);
    // What bad_rank_'s calls must return, in order, on both ranks (NULL: any message).
    static const struct {
        mtrl_status st;
        const char *msg;
    } want[8] = {
        {MTRL_ERR_USAGE, "over 4 ranks, the communicator has 2"},
        {MTRL_ERR_USAGE, "of 6 experts, the model's layers have 8"},
        {MTRL_ERR_USAGE, "layer 0 is not a MoE layer (layers 1..3 are)"},
        {MTRL_OK, NULL},
        {MTRL_ERR_USAGE, "token 2, slot 1, is expert 8 of 8"},
        {MTRL_ERR_USAGE, "-1 tokens"},
        {MTRL_ERR_STATE, "a backward without its forward"},
        {MTRL_ERR_MISMATCH, NULL},
    };
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < 8; i++) {
            TEST_CHECKF(b->st[r][i] == want[i].st, "rank %d, call %d: status %d, want %d (%s)", r, i, b->st[r][i],
                        want[i].st, b->msg[r][i]);
            if (want[i].msg) TEST_CONTAINS(b->msg[r][i], want[i].msg);
        }
    printf("ranks passing different statistics levels: %s\n", b->msg[0][7]);
    free(b);
    mtrl_model_free(&m);
}

int main(void) {
    test_layer_(ini_tiny_, 1, "tiny");
    test_layer_(ini_tiny_, 3, "tiny");
    test_layer_(ini_kimi_, 2, "kimi-form");
    printf("worst relative errors against one rank: output %.3g, input gradient %.3g, expert weight gradient %.3g, "
           "router and shared expert gradients summed %.3g\n",
           worst_out_, worst_dx_, worst_dw_, worst_sum_);
    test_refusals_();
    return test_report();
}
