// mtrl-test: cpu f64
// test_moe_ref.c: the MoE reference in fp64 (docs/model.md §4, §8 I9).
//   1. router forward: top-k of z − beta in descending order, ties to the lower id, renormalised
//      weights summing to rho, sigmoid and softmax scores, replay reproduces w and s;
//   2. router backward vs central finite differences (sigmoid and softmax);
//   3. dispatch is a stable counting sort with pos its inverse; dispatch, identity experts and
//      combine return Σ_j w_j x exactly;
//   4. grouped experts forward vs a per-row SwiGLU, backward vs finite differences, with an
//      expert that gets no rows and with every row on one expert;
//   5. the whole MoE block y = Σ w_e Expert_e(x) + Shared(x), x → logits by gemm_ref with W_r:
//      gradients of x, W_r, expert and shared weights vs finite differences, with the chosen
//      set checked unchanged under every ±h perturbation;
//   6. beta gets no gradient: replay under another beta, or a beta change that keeps the
//      routing, gives bit-identical outputs; adding a constant to beta changes no routing.
#include "kernels/ref/gemm_ref.h"
#include "kernels/ref/moe_ref.h"
#include "common/rng.h"
#include "tests/testhelp.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// Finite-difference tolerances below assume real = double.
_Static_assert(REAL_IS_F64, "test_moe_ref needs the fp64 reference build (mtrl-test: f64)");

static void fill_normal(real *a, size_t n, uint64_t stream, double scale) {
    for (size_t i = 0; i < n; i++) a[i] = (real)(scale * mtrl_rng_normal(11, stream, i));
}
static real *ralloc(size_t n) { return calloc(n ? n : 1, sizeof(real)); }
static int *ialloc(size_t n) { return calloc(n ? n : 1, sizeof(int)); }
static double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

// ---- 1. router forward --------------------------------------------------------------------

static void test_router_fwd(void) {
    enum { N = 16, E = 9, K = 3 };
    const real rho = 2.446;
    real z[N * E], beta[E], w[N * K], s[N * E], w2[N * K], s2[N * E];
    int sel[N * K];
    fill_normal(z, N * E, 1, 1.0);
    fill_normal(beta, E, 2, 0.5);
    for (int sm = 0; sm <= 1; sm++) {
        mtrl_ref_moe_router_fwd(N, E, K, z, beta, sm, rho, 0, sel, w, s);
        for (int t = 0; t < N; t++) {
            // Brute force: the rank of each expert under (score desc, id asc).
            int order[E];
            for (int e = 0; e < E; e++) order[e] = e;
            for (int a = 0; a < E; a++)
                for (int b = a + 1; b < E; b++) {
                    double ca = z[t * E + order[a]] - beta[order[a]];
                    double cb = z[t * E + order[b]] - beta[order[b]];
                    if (cb > ca || (cb == ca && order[b] < order[a])) {
                        int tmp = order[a]; order[a] = order[b]; order[b] = tmp;
                    }
                }
            double Z = 0, sumw = 0, ssum = 0;
            for (int j = 0; j < K; j++) TEST_EQ_INT(sel[t * K + j], order[j]);
            if (sm) {
                double mx = -INFINITY, tot = 0;
                for (int e = 0; e < E; e++) mx = fmax(mx, z[t * E + e]);
                for (int e = 0; e < E; e++) tot += exp(z[t * E + e] - mx);
                for (int e = 0; e < E; e++) TEST_CLOSE(s[t * E + e], exp(z[t * E + e] - mx) / tot, 1e-14, 0);
            } else {
                for (int e = 0; e < E; e++) TEST_CLOSE(s[t * E + e], sigmoid(z[t * E + e]), 1e-14, 0);
            }
            for (int e = 0; e < E; e++) ssum += s[t * E + e];
            if (sm) TEST_CLOSE(ssum, 1.0, 0, 1e-14);
            for (int j = 0; j < K; j++) Z += s[t * E + sel[t * K + j]];
            for (int j = 0; j < K; j++) {
                TEST_CLOSE(w[t * K + j], rho * s[t * E + sel[t * K + j]] / Z, 1e-14, 0);
                sumw += w[t * K + j];
            }
            TEST_CLOSE(sumw, rho, 1e-14, 0);
        }
        // Replay with the recorded routing (and a different beta, which replay never reads).
        int sel2[N * K];
        memcpy(sel2, sel, sizeof sel);
        real beta2[E];
        fill_normal(beta2, E, 3, 5.0);
        mtrl_ref_moe_router_fwd(N, E, K, z, beta2, sm, rho, 1, sel2, w2, s2);
        TEST_CHECK(memcmp(sel2, sel, sizeof sel) == 0);
        TEST_CHECK(memcmp(w2, w, sizeof w) == 0);
        TEST_CHECK(memcmp(s2, s, sizeof s) == 0);
    }
    // Ties go to the lower expert id; beta = NULL means no bias.
    {
        real zt[5] = {1, 2, 2, 0, 2}, wt[3], st[5];
        int st2[2], st3[3];
        mtrl_ref_moe_router_fwd(1, 5, 2, zt, NULL, 0, 1, 0, st2, wt, st);
        TEST_EQ_INT(st2[0], 1);
        TEST_EQ_INT(st2[1], 2);
        mtrl_ref_moe_router_fwd(1, 5, 3, zt, NULL, 0, 1, 0, st3, wt, st);
        TEST_EQ_INT(st3[0], 1);
        TEST_EQ_INT(st3[1], 2);
        TEST_EQ_INT(st3[2], 4);
        // A bias that makes expert 0 the best (1 - (-2) = 3 > 2) and keeps the tie of 2 and 4.
        real bt[5] = {-2, 0, 0.5, 0, 0};
        mtrl_ref_moe_router_fwd(1, 5, 3, zt, bt, 0, 1, 0, st3, wt, st);
        TEST_EQ_INT(st3[0], 0);
        TEST_EQ_INT(st3[1], 1);
        TEST_EQ_INT(st3[2], 4);
    }
}

// Kimi Linear's router (transformers' KimiLinearTopkRouter with one group): the top-K of
// σ(z) + bias with bias = −beta, weights σ(z) of the chosen, renormalised or not, times rho.
static void test_router_forms(void) {
    enum { N = 9, E = 7, K = 3 };
    const real rho = 2.446;
    real z[N * E], beta[E], w[N * K], s[N * E];
    int sel[N * K];
    fill_normal(z, N * E, 24, 1.5);
    fill_normal(beta, E, 25, 0.3);
    for (int renorm = 0; renorm <= 1; renorm++) {
        int form = MOE_ROUTER_SELECT_SCORE | (renorm ? 0 : MOE_ROUTER_NO_RENORM);
        mtrl_ref_moe_router_fwd(N, E, K, z, beta, form, rho, 0, sel, w, s);
        int ok = 1;
        for (int t = 0; t < N; t++) {
            // brute force: rank of each chosen expert among σ(z) − β, descending
            int taken[E] = {0};
            double Z = 0;
            for (int j = 0; j < K; j++) {
                int best = -1;
                double bv = 0;
                for (int e = 0; e < E; e++) {
                    double v = 1.0 / (1.0 + exp(-(double)z[t * E + e])) - (double)beta[e];
                    if (!taken[e] && (best < 0 || v > bv)) { best = e; bv = v; }
                }
                taken[best] = 1;
                ok &= sel[t * K + j] == best;
                Z += 1.0 / (1.0 + exp(-(double)z[t * E + best]));
            }
            for (int j = 0; j < K; j++) {
                double sj = 1.0 / (1.0 + exp(-(double)z[t * E + sel[t * K + j]]));
                double want = rho * sj / (renorm ? Z + 1e-20 : 1.0);
                ok &= fabs(w[t * K + j] - want) <= 1e-14 * want;
            }
        }
        TEST_CHECKF(ok, "router on scores (renorm %d): selection or weights differ from the brute force", renorm);
    }
}

// ---- 2. router backward -------------------------------------------------------------------

static double router_loss(int N, int E, int K, const real *z, const real *beta, int sm, real rho,
                          const real *c, int *sel, real *w, real *s) {
    mtrl_ref_moe_router_fwd(N, E, K, z, beta, sm, rho, 0, sel, w, s);
    double L = 0;
    for (int q = 0; q < N * K; q++) L += (double)c[q] * w[q];
    return L;
}

static void test_router_bwd(void) {
    enum { N = 7, E = 6, K = 3 };
    const real rho = 2.446, h = 1e-6;
    real z[N * E], beta[E], c[N * K], w[N * K], s[N * E], dz[N * E], fd[N * E];
    real wp[N * K], sp[N * E];
    int sel[N * K], selp[N * K];
    fill_normal(z, N * E, 20, 1.5);
    fill_normal(beta, E, 21, 0.5);
    fill_normal(c, N * K, 22, 1.0);
    // every form (moe_ref.h MOE_ROUTER_*): scores, selection on logits or scores, renormalised or not
    const int forms[6] = {0, MOE_ROUTER_SOFTMAX, MOE_ROUTER_SELECT_SCORE, MOE_ROUTER_NO_RENORM,
                          MOE_ROUTER_SELECT_SCORE | MOE_ROUTER_NO_RENORM, MOE_ROUTER_SOFTMAX | MOE_ROUTER_NO_RENORM};
    for (int fi = 0; fi < 6; fi++) {
        int sm = forms[fi];
        router_loss(N, E, K, z, beta, sm, rho, c, sel, w, s);
        mtrl_ref_moe_router_bwd(N, E, K, s, sel, w, sm, rho, c, dz);
        int changed = 0;
        for (int q = 0; q < N * E; q++) {
            real keep = z[q];
            z[q] = keep + h;
            double lp = router_loss(N, E, K, z, beta, sm, rho, c, selp, wp, sp);
            changed += memcmp(selp, sel, sizeof sel) != 0;
            z[q] = keep - h;
            double lm = router_loss(N, E, K, z, beta, sm, rho, c, selp, wp, sp);
            changed += memcmp(selp, sel, sizeof sel) != 0;
            z[q] = keep;
            fd[q] = (real)((lp - lm) / (2 * h));
        }
        double e = test_rel_err_d(dz, fd, N * E);
        printf("router bwd (form %d: %s%s%s): dz rel err vs FD = %.3g\n", sm, sm & MOE_ROUTER_SOFTMAX ? "softmax" : "sigmoid",
               sm & MOE_ROUTER_SELECT_SCORE ? ", top-k of s - beta" : "", sm & MOE_ROUTER_NO_RENORM ? ", no renorm" : "", e);
        TEST_EQ_INT(changed, 0);
        TEST_CHECKF(e < 1e-8, "router dz rel err %.3g", e);
        if (!(sm & MOE_ROUTER_SOFTMAX)) {  // sigmoid: unchosen experts get exactly zero
            for (int t = 0; t < N; t++)
                for (int ex = 0; ex < E; ex++) {
                    int chosen = 0;
                    for (int j = 0; j < K; j++) chosen |= sel[t * K + j] == ex;
                    if (!chosen) TEST_CHECK(dz[t * E + ex] == 0);
                }
        }
    }
}

// ---- 3. dispatch / combine ----------------------------------------------------------------

static void test_dispatch_combine(void) {
    enum { N = 23, E = 7, K = 3, D = 5 };
    real z[N * E], w[N * K], s[N * E], x[N * D], y[N * D], yref[N * D];
    int sel[N * K], offsets[E + 1], perm[N * K], pos[N * K], load[E];
    fill_normal(z, N * E, 30, 1.0);
    fill_normal(x, N * D, 31, 1.0);
    mtrl_ref_moe_router_fwd(N, E, K, z, NULL, 0, 2.446, 0, sel, w, s);
    mtrl_ref_moe_dispatch(N, E, K, sel, offsets, perm, pos);
    mtrl_ref_moe_load_count(N, E, K, sel, load);
    TEST_EQ_INT(offsets[0], 0);
    TEST_EQ_INT(offsets[E], N * K);
    for (int e = 0; e < E; e++) TEST_EQ_INT(offsets[e + 1] - offsets[e], load[e]);
    int hit[N * K] = {0}, stable = 1, consistent = 1;
    for (int t = 0; t < N; t++)
        for (int j = 0; j < K; j++) {
            int r = pos[t * K + j], e = sel[t * K + j];
            hit[r]++;
            consistent &= perm[r] == t && r >= offsets[e] && r < offsets[e + 1];
        }
    for (int r = 0; r < N * K; r++) TEST_EQ_INT(hit[r], 1);
    TEST_CHECK(consistent);
    // Stable: inside a segment, tokens are non-decreasing (one token never repeats an expert).
    for (int e = 0; e < E; e++)
        for (int r = offsets[e] + 1; r < offsets[e + 1]; r++) stable &= perm[r] > perm[r - 1];
    TEST_CHECK(stable);

    // Identity experts: Y_perm = X_perm, so combine gives Σ_j w_j x_t.
    real *Xp = ralloc(N * K * D);
    mtrl_ref_moe_gather(N, K, D, pos, x, Xp);
    for (int r = 0; r < N * K; r++)
        TEST_CHECK(memcmp(Xp + r * D, x + perm[r] * D, sizeof(real) * D) == 0);
    mtrl_ref_moe_combine_fwd(N, K, D, pos, w, Xp, y);
    for (int t = 0; t < N; t++)
        for (int d = 0; d < D; d++) {
            double a = 0;
            for (int j = 0; j < K; j++) a += (double)w[t * K + j] * x[t * D + d];
            yref[t * D + d] = (real)a;
        }
    double err = 0;
    for (int q = 0; q < N * D; q++) err = fmax(err, fabs(y[q] - yref[q]));
    printf("dispatch + identity experts + combine: max |y - sum_j w_j x| = %.3g\n", err);
    TEST_ARRAY_CLOSE(y, yref, N * D, 0, 1e-15);
    // Max violation of a routing that puts everything on one expert is E - 1.
    int one[N * K];
    for (int q = 0; q < N * K; q++) one[q] = 4;
    mtrl_ref_moe_load_count(N, E, K, one, load);
    TEST_EQ_INT(load[4], N * K);
    TEST_CLOSE(mtrl_ref_moe_max_violation(E, load, N * K), E - 1.0, 1e-15, 0);
    free(Xp);
}

// ---- 4. grouped experts -------------------------------------------------------------------

// L = Σ G ⊙ Y_perm of the grouped experts over a given routing.
static double experts_loss(int E, int D, int I, const int *offsets, const real *Xp,
                           const real *W1, const real *W3, const real *W2, const real *G,
                           real *u1, real *u3, real *Yp) {
    int R = offsets[E];
    mtrl_ref_moe_experts_fwd(E, D, I, offsets, Xp, W1, W3, W2, u1, u3, Yp);
    double L = 0;
    for (int q = 0; q < R * D; q++) L += (double)G[q] * Yp[q];
    return L;
}

// Central finite differences of loss(ctx) in every element of p (n of them), compared with the
// analytic gradient an (already net of any pre-filled value). Returns the relative error.
static double fd_check(real *p, size_t n, const real *an, double (*loss)(void *), void *ctx,
                       real h) {
    real *fd = ralloc(n);
    for (size_t q = 0; q < n; q++) {
        real keep = p[q];
        p[q] = keep + h;
        double lp = loss(ctx);
        p[q] = keep - h;
        double lm = loss(ctx);
        p[q] = keep;
        fd[q] = (real)((lp - lm) / (2 * h));
    }
    double e = test_rel_err_d(an, fd, n);
    free(fd);
    return e;
}

typedef struct {
    int E, D, I;
    const int *offsets;
    real *Xp, *W1, *W3, *W2;
    const real *G;
    real *u1, *u3, *Yp;
} ExpertsCtx;

static double experts_loss_cb(void *v) {
    ExpertsCtx *c = v;
    return experts_loss(c->E, c->D, c->I, c->offsets, c->Xp, c->W1, c->W3, c->W2, c->G, c->u1,
                        c->u3, c->Yp);
}

static void check_experts(const char *name, int N, int E, int K, const int *sel, int empty_e) {
    const int D = 5, I = 4;
    const real h = 1e-6;
    int R = N * K;
    int *offsets = ialloc(E + 1), *perm = ialloc(R), *pos = ialloc(R);
    mtrl_ref_moe_dispatch(N, E, K, sel, offsets, perm, pos);
    real *x = ralloc(N * D), *Xp = ralloc(R * D), *G = ralloc(R * D);
    real *W1 = ralloc(E * I * D), *W3 = ralloc(E * I * D), *W2 = ralloc(E * D * I);
    real *u1 = ralloc(R * I), *u3 = ralloc(R * I), *Yp = ralloc(R * D), *dXp = ralloc(R * D);
    real *dW1 = ralloc(E * I * D), *dW3 = ralloc(E * I * D), *dW2 = ralloc(E * D * I);
    real *dW1p = ralloc(E * I * D), *dW3p = ralloc(E * I * D), *dW2p = ralloc(E * D * I);
    fill_normal(x, N * D, 40, 1.0);
    fill_normal(G, R * D, 41, 1.0);
    fill_normal(W1, E * I * D, 42, 0.6);
    fill_normal(W3, E * I * D, 43, 0.6);
    fill_normal(W2, E * D * I, 44, 0.6);
    fill_normal(dW1p, E * I * D, 45, 1.0);  // pre-filled: checks "+=" and untouched experts
    fill_normal(dW3p, E * I * D, 46, 1.0);
    fill_normal(dW2p, E * D * I, 47, 1.0);
    memcpy(dW1, dW1p, sizeof(real) * E * I * D);
    memcpy(dW3, dW3p, sizeof(real) * E * I * D);
    memcpy(dW2, dW2p, sizeof(real) * E * D * I);
    mtrl_ref_moe_gather(N, K, D, pos, x, Xp);

    // Forward vs a per-row SwiGLU with the expert of that row.
    experts_loss(E, D, I, offsets, Xp, W1, W3, W2, G, u1, u3, Yp);
    double ferr = 0;
    for (int e = 0; e < E; e++)
        for (int r = offsets[e]; r < offsets[e + 1]; r++) {
            double m[8];
            for (int i = 0; i < I; i++) {
                double a = 0, b = 0;
                for (int d = 0; d < D; d++) {
                    a += W1[(e * I + i) * D + d] * Xp[r * D + d];
                    b += W3[(e * I + i) * D + d] * Xp[r * D + d];
                }
                m[i] = a * sigmoid(a) * b;
            }
            for (int d = 0; d < D; d++) {
                double yv = 0;
                for (int i = 0; i < I; i++) yv += W2[(e * D + d) * I + i] * m[i];
                ferr = fmax(ferr, fabs(yv - Yp[r * D + d]));
            }
        }
    TEST_CHECKF(ferr < 1e-14, "%s: experts fwd vs per-row SwiGLU max err %.3g", name, ferr);

    mtrl_ref_moe_experts_bwd(E, D, I, offsets, Xp, W1, W3, W2, u1, u3, G, dXp, dW1, dW3, dW2);
    real *a1 = ralloc(E * I * D), *a3 = ralloc(E * I * D), *a2 = ralloc(E * D * I);
    for (int q = 0; q < E * I * D; q++) {
        a1[q] = dW1[q] - dW1p[q];
        a3[q] = dW3[q] - dW3p[q];
        a2[q] = dW2[q] - dW2p[q];
    }
    ExpertsCtx c = {E, D, I, offsets, Xp, W1, W3, W2, G, u1, u3, Yp};
    double ex = fd_check(Xp, R * D, dXp, experts_loss_cb, &c, h);
    double e1 = fd_check(W1, E * I * D, a1, experts_loss_cb, &c, h);
    double e3 = fd_check(W3, E * I * D, a3, experts_loss_cb, &c, h);
    double e2 = fd_check(W2, E * D * I, a2, experts_loss_cb, &c, h);
    printf("experts (%s): fwd err %.3g; rel err vs FD: dX %.3g dW1 %.3g dW3 %.3g dW2 %.3g\n",
           name, ferr, ex, e1, e3, e2);
    TEST_CHECKF(ex < 1e-8, "%s dX %.3g", name, ex);
    TEST_CHECKF(e1 < 1e-8, "%s dW1 %.3g", name, e1);
    TEST_CHECKF(e3 < 1e-8, "%s dW3 %.3g", name, e3);
    TEST_CHECKF(e2 < 1e-8, "%s dW2 %.3g", name, e2);
    // Experts with no rows: gradients exactly as pre-filled.
    for (int e = 0; e < E; e++) {
        if (offsets[e + 1] > offsets[e]) continue;
        TEST_CHECK(e == empty_e || empty_e < 0);
        TEST_CHECK(memcmp(dW1 + e * I * D, dW1p + e * I * D, sizeof(real) * I * D) == 0);
        TEST_CHECK(memcmp(dW3 + e * I * D, dW3p + e * I * D, sizeof(real) * I * D) == 0);
        TEST_CHECK(memcmp(dW2 + e * D * I, dW2p + e * D * I, sizeof(real) * D * I) == 0);
    }
    if (empty_e >= 0) TEST_EQ_INT(offsets[empty_e + 1] - offsets[empty_e], 0);
    free(offsets); free(perm); free(pos); free(x); free(Xp); free(G); free(W1); free(W3);
    free(W2); free(u1); free(u3); free(Yp); free(dXp); free(dW1); free(dW3); free(dW2);
    free(dW1p); free(dW3p); free(dW2p); free(a1); free(a3); free(a2);
}

static void test_experts(void) {
    // Expert 2 of 5 gets no token; the others get uneven loads.
    enum { N = 6, E = 5, K = 2 };
    const int sel[N * K] = {0, 1, 3, 0, 4, 1, 1, 3, 0, 4, 3, 1};
    check_experts("expert 2 empty", N, E, K, sel, 2);
    // Every token on expert 3 (K = 1): one segment holds all rows, four experts are empty.
    int all[N];
    for (int t = 0; t < N; t++) all[t] = 3;
    check_experts("all on expert 3", N, E, 1, all, -1);
}

// ---- 5. the whole MoE block ---------------------------------------------------------------

enum { BN = 6, BE = 5, BK = 2, BD = 4, BI = 3, BIS = 3 };

typedef struct {
    real Wr[BE * BD];                                       // router [E][D]
    real W1[BE * BI * BD], W3[BE * BI * BD], W2[BE * BD * BI];  // experts
    real S1[BIS * BD], S3[BIS * BD], S2[BD * BIS];          // shared expert
} Block;

typedef struct {
    real z[BN * BE], s[BN * BE], w[BN * BK];
    int sel[BN * BK], offsets[BE + 1], perm[BN * BK], pos[BN * BK];
    real Xp[BN * BK * BD], u1[BN * BK * BI], u3[BN * BK * BI], Yp[BN * BK * BD];
    real su1[BN * BIS], su3[BN * BIS], ys[BN * BD], y[BN * BD];
} Acts;

// y = Σ_j w_j Expert_{sel_j}(x) + Shared(x). replay != 0 reuses a->sel.
static void block_fwd(const Block *p, const real *x, const real *beta, int sm, real rho,
                      int replay, Acts *a) {
    mtrl_ref_gemm(0, 1, BN, BE, BD, 1, x, BD, p->Wr, BD, 0, a->z, BE);
    mtrl_ref_moe_router_fwd(BN, BE, BK, a->z, beta, sm, rho, replay, a->sel, a->w, a->s);
    mtrl_ref_moe_dispatch(BN, BE, BK, a->sel, a->offsets, a->perm, a->pos);
    mtrl_ref_moe_gather(BN, BK, BD, a->pos, x, a->Xp);
    mtrl_ref_moe_experts_fwd(BE, BD, BI, a->offsets, a->Xp, p->W1, p->W3, p->W2, a->u1, a->u3, a->Yp);
    mtrl_ref_moe_combine_fwd(BN, BK, BD, a->pos, a->w, a->Yp, a->y);
    mtrl_ref_moe_swiglu_fwd(BN, BD, BIS, x, p->S1, p->S3, p->S2, a->su1, a->su3, a->ys);
    for (int q = 0; q < BN * BD; q++) a->y[q] += a->ys[q];
}

static const int *g_base_sel;  // routing of the unperturbed forward
static int g_changed;          // FD perturbations that changed the routing (must stay 0)

static double block_loss(const Block *p, const real *x, const real *beta, int sm, real rho,
                         const real *G) {
    static Acts a;
    block_fwd(p, x, beta, sm, rho, 0, &a);
    g_changed += memcmp(a.sel, g_base_sel, sizeof a.sel) != 0;
    double L = 0;
    for (int q = 0; q < BN * BD; q++) L += (double)G[q] * a.y[q];
    return L;
}

typedef struct {
    const Block *p;
    const real *x, *beta, *G;
    int sm;
    real rho;
} BlockCtx;

static double block_loss_cb(void *v) {
    BlockCtx *c = v;
    return block_loss(c->p, c->x, c->beta, c->sm, c->rho, c->G);
}

static void test_block_fd(int sm) {
    const real rho = 2.446, h = 1e-6;
    static Block p, g;
    static Acts a;
    real x[BN * BD], beta[BE], G[BN * BD];
    fill_normal(p.Wr, BE * BD, 50, 1.0);
    fill_normal(p.W1, BE * BI * BD, 51, 0.7);
    fill_normal(p.W3, BE * BI * BD, 52, 0.7);
    fill_normal(p.W2, BE * BD * BI, 53, 0.7);
    fill_normal(p.S1, BIS * BD, 54, 0.7);
    fill_normal(p.S3, BIS * BD, 55, 0.7);
    fill_normal(p.S2, BD * BIS, 56, 0.7);
    fill_normal(x, BN * BD, 57, 1.0);
    fill_normal(beta, BE, 58, 0.5);
    fill_normal(G, BN * BD, 59, 1.0);
    memset(&g, 0, sizeof g);

    block_fwd(&p, x, beta, sm, rho, 0, &a);
    int load[BE];
    mtrl_ref_moe_load_count(BN, BE, BK, a.sel, load);
    // Backward, dy = G.
    real dYp[BN * BK * BD], dw[BN * BK], dXp[BN * BK * BD], dz[BN * BE], dx[BN * BD] = {0};
    real dxs[BN * BD];
    mtrl_ref_moe_combine_bwd(BN, BK, BD, a.pos, a.w, a.Yp, G, dYp, dw);
    mtrl_ref_moe_experts_bwd(BE, BD, BI, a.offsets, a.Xp, p.W1, p.W3, p.W2, a.u1, a.u3, dYp, dXp, g.W1,
                    g.W3, g.W2);
    mtrl_ref_moe_scatter_bwd(BN, BK, BD, a.pos, dXp, dx);
    mtrl_ref_moe_router_bwd(BN, BE, BK, a.s, a.sel, a.w, sm, rho, dw, dz);
    mtrl_ref_gemm(1, 0, BE, BD, BN, 1, dz, BE, x, BD, 1, g.Wr, BD);
    mtrl_ref_gemm(0, 0, BN, BD, BE, 1, dz, BE, p.Wr, BD, 1, dx, BD);
    mtrl_ref_moe_swiglu_bwd(BN, BD, BIS, x, p.S1, p.S3, p.S2, a.su1, a.su3, G, dxs, g.S1, g.S3, g.S2);
    for (int q = 0; q < BN * BD; q++) dx[q] += dxs[q];

    g_base_sel = a.sel;
    g_changed = 0;
    BlockCtx c = {&p, x, beta, G, sm, rho};
    double ex = fd_check(x, BN * BD, dx, block_loss_cb, &c, h);
    double er = fd_check(p.Wr, BE * BD, g.Wr, block_loss_cb, &c, h);
    double e1 = fd_check(p.W1, BE * BI * BD, g.W1, block_loss_cb, &c, h);
    double e3 = fd_check(p.W3, BE * BI * BD, g.W3, block_loss_cb, &c, h);
    double e2 = fd_check(p.W2, BE * BD * BI, g.W2, block_loss_cb, &c, h);
    double s1 = fd_check(p.S1, BIS * BD, g.S1, block_loss_cb, &c, h);
    double s3 = fd_check(p.S3, BIS * BD, g.S3, block_loss_cb, &c, h);
    double s2 = fd_check(p.S2, BD * BIS, g.S2, block_loss_cb, &c, h);
    printf("MoE block (%s%s%s, loads", sm & MOE_ROUTER_SOFTMAX ? "softmax" : "sigmoid",
           sm & MOE_ROUTER_SELECT_SCORE ? ", top-k of s - beta" : "", sm & MOE_ROUTER_NO_RENORM ? ", no renorm" : "");
    for (int e = 0; e < BE; e++) printf(" %d", load[e]);
    printf("): rel err vs FD: dx %.3g dWr %.3g dW1 %.3g dW3 %.3g dW2 %.3g dS1 %.3g dS3 %.3g "
           "dS2 %.3g; routing changes under +-h: %d\n", ex, er, e1, e3, e2, s1, s3, s2, g_changed);
    TEST_EQ_INT(g_changed, 0);
    TEST_CHECKF(ex < 1e-8, "dx %.3g", ex);
    TEST_CHECKF(er < 1e-8, "dWr %.3g", er);
    TEST_CHECKF(e1 < 1e-8 && e3 < 1e-8 && e2 < 1e-8, "dW1 %.3g dW3 %.3g dW2 %.3g", e1, e3, e2);
    TEST_CHECKF(s1 < 1e-8 && s3 < 1e-8 && s2 < 1e-8, "dS1 %.3g dS3 %.3g dS2 %.3g", s1, s3, s2);
}

// ---- 6. beta gets no gradient -------------------------------------------------------------

static void test_beta_no_gradient(void) {
    const real rho = 2.446;
    static Block p;
    static Acts a, b;
    real x[BN * BD], beta[BE], beta2[BE];
    fill_normal(p.Wr, BE * BD, 60, 1.0);
    fill_normal(p.W1, BE * BI * BD, 61, 0.7);
    fill_normal(p.W3, BE * BI * BD, 62, 0.7);
    fill_normal(p.W2, BE * BD * BI, 63, 0.7);
    fill_normal(p.S1, BIS * BD, 64, 0.7);
    fill_normal(p.S3, BIS * BD, 65, 0.7);
    fill_normal(p.S2, BD * BIS, 66, 0.7);
    fill_normal(x, BN * BD, 67, 1.0);
    fill_normal(beta, BE, 68, 1.0);
    block_fwd(&p, x, beta, 0, rho, 0, &a);

    // Replay the recorded routing under a very different beta: identical outputs, bit for bit.
    fill_normal(beta2, BE, 69, 10.0);
    memcpy(b.sel, a.sel, sizeof a.sel);
    block_fwd(&p, x, beta2, 0, rho, 1, &b);
    TEST_CHECK(memcmp(b.y, a.y, sizeof a.y) == 0);
    TEST_CHECK(memcmp(b.w, a.w, sizeof a.w) == 0);

    // A beta perturbation small enough to keep the routing changes nothing: dL/dbeta = 0.
    for (int e = 0; e < BE; e++) beta2[e] = beta[e] + (real)(1e-7 * mtrl_rng_normal(11, 70, e));
    block_fwd(&p, x, beta2, 0, rho, 0, &b);
    TEST_CHECK(memcmp(b.sel, a.sel, sizeof a.sel) == 0);
    TEST_CHECK(memcmp(b.y, a.y, sizeof a.y) == 0);

    // Adding a constant to beta changes no routing decision (slot order included), on a larger
    // batch so many near-competitive choices are exercised.
    enum { N = 512, E = 32, K = 4 };
    real *z = ralloc(N * E), *w = ralloc(N * K), *s = ralloc(N * E);
    real bb[E], bc[E];
    int *sel0 = ialloc(N * K), *sel1 = ialloc(N * K);
    fill_normal(z, N * E, 71, 1.0);
    fill_normal(bb, E, 72, 1.0);
    mtrl_ref_moe_router_fwd(N, E, K, z, bb, 0, rho, 0, sel0, w, s);
    const double shifts[] = {0.5, -2.25, 17.0, -1e3};
    int same = 0;
    for (int c = 0; c < 4; c++) {
        for (int e = 0; e < E; e++) bc[e] = bb[e] + (real)shifts[c];
        mtrl_ref_moe_router_fwd(N, E, K, z, bc, 0, rho, 0, sel1, w, s);
        same += memcmp(sel0, sel1, sizeof(int) * N * K) == 0;
    }
    printf("beta + constant: %d of 4 shifts leave all %d routing decisions unchanged\n", same,
           N * K);
    TEST_EQ_INT(same, 4);
    free(z); free(w); free(s); free(sel0); free(sel1);
}

int main(void) {
    test_router_fwd();
    test_router_forms();
    test_router_bwd();
    test_dispatch_combine();
    test_experts();
    test_block_fd(0);
    test_block_fd(1);
    test_block_fd(MOE_ROUTER_SELECT_SCORE | MOE_ROUTER_NO_RENORM);
    test_beta_no_gradient();
    return test_report();
}
