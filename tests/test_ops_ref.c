// mtrl-test: cpu f64
// test_ops_ref.c: the shared primitives of kernels/ref/ops_ref.h in fp64.
//
// Every backward is checked against central finite differences of L = Σ R ⊙ out with random
// weights R, on random non-zero inputs (relative error = max |fd − g| / max |g|). Forwards
// are checked against direct formulas. Short conv: state carry across two halves equals one
// run, the decode step equals the forward, and a two-segment backward (with
// shortconv_state_bwd) equals the one-run backward; packed pieces (varlen) against finite
// differences and each piece alone. AdamW: one and two steps by hand.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "kernels/ref/ops_ref.h"
#include "tests/testhelp.h"

#define FD_H 1e-5
#define FD_TOL 1e-7

static uint64_t stream_ = 1;

// Fresh random normals × scale (+ shift), a new stream per call.
static real *randn(size_t n, double scale, double shift) {
    real *x = malloc(sizeof(real) * (n ? n : 1));
    uint64_t s = stream_++;
    for (size_t i = 0; i < n; i++) x[i] = (real)(shift + scale * mtrl_rng_normal(42, s, i));
    return x;
}

static real *copyv(const real *x, size_t n) {
    real *y = malloc(sizeof(real) * (n ? n : 1));
    memcpy(y, x, sizeof(real) * n);
    return y;
}

static double dot(const real *a, const real *b, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += (double)a[i] * (double)b[i];
    return s;
}

// Finite-difference check: perturb x[e], evaluate loss(ctx), compare with grad[e].
typedef double (*loss_fn)(void *ctx);
static double fd_err(loss_fn f, void *ctx, real *x, size_t n, const real *grad) {
    double worst = 0, gmax = 1e-30;
    for (size_t e = 0; e < n; e++) {
        real keep = x[e];
        x[e] = keep + FD_H;
        double lp = f(ctx);
        x[e] = keep - FD_H;
        double lm = f(ctx);
        x[e] = keep;
        double fd = (lp - lm) / (2 * FD_H);
        double d = fabs(fd - (double)grad[e]);
        if (d > worst) worst = d;
        if (fabs((double)grad[e]) > gmax) gmax = fabs((double)grad[e]);
    }
    return worst / gmax;
}

#define CHECK_FD(name, f, ctx, x, n, g)                                      \
    do {                                                                     \
        double e_ = fd_err(f, ctx, x, n, g);                                 \
        printf("  %-34s fd rel err %.2e\n", name, e_);                       \
        TEST_CHECKF(e_ < FD_TOL, "%s: %.3e", name, e_);                      \
    } while (0)

// ---- norms ---------------------------------------------------------------------------------

typedef struct { int N, D; real *x, *z, *w, *R, *y; real eps; int kind; } norm_ctx;
enum { K_RMS, K_L2, K_GATED };

static double norm_loss(void *p) {
    norm_ctx *c = p;
    if (c->kind == K_RMS) mtrl_ref_rmsnorm_fwd(c->N, c->D, c->x, c->w, c->eps, c->y, NULL);
    else if (c->kind == K_L2) mtrl_ref_l2norm_fwd(c->N, c->D, c->x, c->eps, c->y, NULL);
    else mtrl_ref_gated_rmsnorm_fwd(c->N, c->D, c->x, c->z, c->w, c->eps, c->y);
    return dot(c->R, c->y, (size_t)c->N * c->D);
}

static void test_norms(void) {
    printf("norms\n");
    const int N = 5, D = 7;
    const size_t n = (size_t)N * D;
    norm_ctx c = { N, D, randn(n, 1.3, 0.2), randn(n, 1.5, 0), randn(D, 0.5, 1.0),
                   randn(n, 1, 0), malloc(sizeof(real) * n), (real)1e-5, K_RMS };
    // RMSNorm forward vs the formula, rstd output, y aliasing x.
    real *rstd = malloc(sizeof(real) * N);
    mtrl_ref_rmsnorm_fwd(N, D, c.x, c.w, c.eps, c.y, rstd);
    double worst = 0;
    for (int i = 0; i < N; i++) {
        double s = 0;
        for (int j = 0; j < D; j++) s += c.x[i * D + j] * c.x[i * D + j];
        double r = 1 / sqrt(s / D + 1e-5);
        TEST_CLOSE(rstd[i], r, 1e-14, 0);
        for (int j = 0; j < D; j++) worst = fmax(worst, fabs(c.y[i * D + j] - c.w[j] * c.x[i * D + j] * r));
    }
    TEST_CHECKF(worst < 1e-14, "rmsnorm fwd %.3e", worst);
    real *xa = copyv(c.x, n);
    mtrl_ref_rmsnorm_fwd(N, D, xa, c.w, c.eps, xa, NULL);
    TEST_ARRAY_CLOSE(xa, c.y, n, 0, 0);

    // RMSNorm backward: dw accumulates onto a random start; rstd given == recomputed.
    real *dx = malloc(sizeof(real) * n), *dx2 = malloc(sizeof(real) * n);
    real *dw0 = randn(D, 1, 0), *dw = copyv(dw0, D), *dwg = malloc(sizeof(real) * D);
    mtrl_ref_rmsnorm_bwd(N, D, c.x, c.w, NULL, c.eps, c.R, dx, dw);
    mtrl_ref_rmsnorm_bwd(N, D, c.x, c.w, rstd, c.eps, c.R, dx2, NULL);
    TEST_ARRAY_CLOSE(dx2, dx, n, 1e-12, 1e-14);
    for (int j = 0; j < D; j++) dwg[j] = dw[j] - dw0[j];
    CHECK_FD("rmsnorm dx", norm_loss, &c, c.x, n, dx);
    CHECK_FD("rmsnorm dw (+=)", norm_loss, &c, c.w, D, dwg);
    real *dya = copyv(c.R, n);  // dx may alias dy
    mtrl_ref_rmsnorm_bwd(N, D, c.x, c.w, NULL, c.eps, dya, dya, NULL);
    TEST_ARRAY_CLOSE(dya, dx, n, 1e-14, 1e-15);

    // L2Norm: unit rows (up to eps), backward.
    c.kind = K_L2;
    c.eps = (real)1e-6;
    real *rn = malloc(sizeof(real) * N);
    mtrl_ref_l2norm_fwd(N, D, c.x, c.eps, c.y, rn);
    for (int i = 0; i < N; i++) {
        double s = 0, s2 = 0;
        for (int j = 0; j < D; j++) { s += c.y[i * D + j] * c.y[i * D + j]; s2 += c.x[i * D + j] * c.x[i * D + j]; }
        TEST_CLOSE(s, s2 / (s2 + 1e-6), 1e-13, 0);
        TEST_CLOSE(rn[i], 1 / sqrt(s2 + 1e-6), 1e-14, 0);
    }
    mtrl_ref_l2norm_bwd(N, D, c.x, c.eps, c.R, dx);
    CHECK_FD("l2norm dx", norm_loss, &c, c.x, n, dx);

    // Gated RMSNorm.
    c.kind = K_GATED;
    c.eps = (real)1e-5;
    mtrl_ref_gated_rmsnorm_fwd(N, D, c.x, c.z, c.w, c.eps, c.y);
    worst = 0;
    for (int i = 0; i < N; i++) {
        for (int j = 0; j < D; j++) {
            double want = c.w[j] * c.x[i * D + j] * rstd[i] / (1 + exp(-c.z[i * D + j]));
            worst = fmax(worst, fabs(c.y[i * D + j] - want));
        }
    }
    TEST_CHECKF(worst < 1e-14, "gated fwd %.3e", worst);
    real *dz = malloc(sizeof(real) * n);
    memcpy(dw, dw0, sizeof(real) * D);
    mtrl_ref_gated_rmsnorm_bwd(N, D, c.x, c.z, c.w, c.eps, c.R, dx, dz, dw);
    for (int j = 0; j < D; j++) dwg[j] = dw[j] - dw0[j];
    CHECK_FD("gated_rmsnorm dx", norm_loss, &c, c.x, n, dx);
    CHECK_FD("gated_rmsnorm dz", norm_loss, &c, c.z, n, dz);
    CHECK_FD("gated_rmsnorm dw (+=)", norm_loss, &c, c.w, D, dwg);

    free(c.x); free(c.z); free(c.w); free(c.R); free(c.y); free(rstd); free(xa); free(dx);
    free(dx2); free(dw0); free(dw); free(dwg); free(dya); free(rn); free(dz);
}

// ---- SwiGLU --------------------------------------------------------------------------------

typedef struct { int N, I; real *u1, *u3, *R, *m; } swi_ctx;
static double swi_loss(void *p) {
    swi_ctx *c = p;
    mtrl_ref_swiglu_fwd(c->N, c->I, c->u1, c->u3, c->m);
    return dot(c->R, c->m, (size_t)c->N * c->I);
}

static void test_swiglu(void) {
    printf("swiglu\n");
    const int N = 4, I = 6;
    const size_t n = (size_t)N * I;
    swi_ctx c = { N, I, randn(n, 2, 0), randn(n, 1, 0), randn(n, 1, 0), malloc(sizeof(real) * n) };
    mtrl_ref_swiglu_fwd(N, I, c.u1, c.u3, c.m);
    double worst = 0;
    for (size_t e = 0; e < n; e++)
        worst = fmax(worst, fabs(c.m[e] - c.u1[e] / (1 + exp(-c.u1[e])) * c.u3[e]));
    TEST_CHECKF(worst < 1e-15, "swiglu fwd %.3e", worst);
    real *du1 = malloc(sizeof(real) * n), *du3 = malloc(sizeof(real) * n);
    mtrl_ref_swiglu_bwd(N, I, c.u1, c.u3, c.R, du1, du3);
    CHECK_FD("swiglu du1", swi_loss, &c, c.u1, n, du1);
    CHECK_FD("swiglu du3", swi_loss, &c, c.u3, n, du3);
    free(c.u1); free(c.u3); free(c.R); free(c.m); free(du1); free(du3);
}

// ---- short conv ----------------------------------------------------------------------------

typedef struct { int T, C, W; real *x, *w, *st, *R, *y; } conv_ctx;
static double conv_loss(void *p) {
    conv_ctx *c = p;
    mtrl_ref_shortconv_fwd(c->T, c->C, c->W, c->x, c->w, c->st, c->y, NULL);
    return dot(c->R, c->y, (size_t)c->T * c->C);
}

// Direct formula for one output, for the forward check.
static double conv_direct(int t, int ch, int C, int W, const real *x, const real *w, const real *st) {
    double p = 0;
    for (int j = 0; j < W; j++) {
        int s = t - W + 1 + j;
        double xv = s >= 0 ? x[s * C + ch] : (st ? st[(s + W - 1) * C + ch] : 0);
        p += w[ch * W + j] * xv;
    }
    return p / (1 + exp(-p));
}

static void test_shortconv(void) {
    printf("shortconv\n");
    const int T = 9, C = 3, W = 4;
    const size_t n = (size_t)T * C, ns = (size_t)(W - 1) * C;
    conv_ctx c = { T, C, W, randn(n, 1, 0), randn((size_t)C * W, 0.7, 0), randn(ns, 1, 0),
                   randn(n, 1, 0), malloc(sizeof(real) * n) };
    // Forward against the direct formula, with and without state.
    for (int with_state = 0; with_state < 2; with_state++) {
        const real *st = with_state ? c.st : NULL;
        mtrl_ref_shortconv_fwd(T, C, W, c.x, c.w, st, c.y, NULL);
        double worst = 0;
        for (int t = 0; t < T; t++)
            for (int ch = 0; ch < C; ch++)
                worst = fmax(worst, fabs(c.y[t * C + ch] - conv_direct(t, ch, C, W, c.x, c.w, st)));
        TEST_CHECKF(worst < 1e-15, "conv fwd (state %d) %.3e", with_state, worst);
    }

    // Backward vs FD: dx, dw (+=), dstate_in.
    real *dx = malloc(sizeof(real) * n), *dst = malloc(sizeof(real) * ns);
    real *dw0 = randn((size_t)C * W, 1, 0), *dw = copyv(dw0, (size_t)C * W);
    real *dwg = malloc(sizeof(real) * C * W);
    mtrl_ref_shortconv_bwd(T, C, W, c.x, c.w, c.st, c.R, dx, dw, dst);
    for (int e = 0; e < C * W; e++) dwg[e] = dw[e] - dw0[e];
    CHECK_FD("shortconv dx", conv_loss, &c, c.x, n, dx);
    CHECK_FD("shortconv dw (+=)", conv_loss, &c, c.w, (size_t)C * W, dwg);
    CHECK_FD("shortconv dstate_in", conv_loss, &c, c.st, ns, dst);
    // Short segment (T < W−1 = 3): dstate_in still exact.
    {
        conv_ctx s = c;
        s.T = 2;
        real *dxs = malloc(sizeof(real) * 2 * C), *dsts = malloc(sizeof(real) * ns);
        real *dws = calloc((size_t)C * W, sizeof(real));
        mtrl_ref_shortconv_bwd(2, C, W, s.x, s.w, s.st, s.R, dxs, dws, dsts);
        CHECK_FD("shortconv T=2 dx", conv_loss, &s, s.x, 2 * (size_t)C, dxs);
        CHECK_FD("shortconv T=2 dstate_in", conv_loss, &s, s.st, ns, dsts);
        CHECK_FD("shortconv T=2 dw", conv_loss, &s, s.w, (size_t)C * W, dws);
        free(dxs); free(dsts); free(dws);
    }

    // Two halves with carried state == one run; also a 2-token middle piece (T < W−1).
    real *yfull = malloc(sizeof(real) * n), *ysplit = malloc(sizeof(real) * n);
    real *state = malloc(sizeof(real) * ns), *state_full = malloc(sizeof(real) * ns);
    mtrl_ref_shortconv_fwd(T, C, W, c.x, c.w, c.st, yfull, state_full);
    const int cuts[3] = { 4, 2, 3 };  // pieces of 4, 2, 3 tokens
    memcpy(state, c.st, sizeof(real) * ns);
    for (int p = 0, t0 = 0; p < 3; t0 += cuts[p], p++)
        mtrl_ref_shortconv_fwd(cuts[p], C, W, c.x + (size_t)t0 * C, c.w, state, ysplit + (size_t)t0 * C, state);
    TEST_ARRAY_CLOSE(ysplit, yfull, n, 0, 0);
    TEST_ARRAY_CLOSE(state, state_full, ns, 0, 0);
    TEST_ARRAY_CLOSE(state_full, c.x + (size_t)(T - W + 1) * C, ns, 0, 0);

    // Decode steps from the state == the forward; the window ends equal to state_out.
    memcpy(state, c.st, sizeof(real) * ns);
    for (int t = 0; t < T; t++) mtrl_ref_shortconv_step(C, W, c.x + (size_t)t * C, c.w, state, ysplit + (size_t)t * C);
    TEST_ARRAY_CLOSE(ysplit, yfull, n, 1e-15, 1e-16);
    TEST_ARRAY_CLOSE(state, state_full, ns, 0, 0);

    // Segmented backward: segments [0,A), [A,T) (A = 5), then [0,2),[2,T) where the first
    // segment is shorter than W−1 so the carried gradient reaches the first state_in.
    const int splits[2] = { 5, 2 };
    for (int si = 0; si < 2; si++) {
        const int A = splits[si], B = T - A;
        real *stA = malloc(sizeof(real) * ns);  // state after segment A
        mtrl_ref_shortconv_fwd(A, C, W, c.x, c.w, c.st, ysplit, stA);
        real *dxs = malloc(sizeof(real) * n), *dsB = malloc(sizeof(real) * ns), *dsA = malloc(sizeof(real) * ns);
        real *dws = copyv(dw0, (size_t)C * W);
        mtrl_ref_shortconv_bwd(B, C, W, c.x + (size_t)A * C, c.w, stA, c.R + (size_t)A * C, dxs + (size_t)A * C, dws, dsB);
        mtrl_ref_shortconv_bwd(A, C, W, c.x, c.w, c.st, c.R, dxs, dws, dsA);
        mtrl_ref_shortconv_state_bwd(A, C, W, dsB, dxs, dsA);
        TEST_ARRAY_CLOSE(dxs, dx, n, 1e-13, 1e-15);
        TEST_ARRAY_CLOSE(dws, dw, (size_t)C * W, 1e-13, 1e-15);
        TEST_ARRAY_CLOSE(dsA, dst, ns, 1e-13, 1e-15);
        free(stA); free(dxs); free(dsB); free(dsA); free(dws);
    }
    free(c.x); free(c.w); free(c.st); free(c.R); free(c.y); free(dx); free(dst); free(dw0);
    free(dw); free(dwg); free(yfull); free(ysplit); free(state); free(state_full);
}

// Packed pieces from the zero window (mtrl_ref_shortconv_fwd_varlen / _bwd_varlen): the backward
// against finite differences of the packed forward (no gradient crosses a piece start), and
// bit for bit the backward of each piece alone (state_in NULL), dw accumulating piece by piece.
typedef struct { int n; const int *offs; int C, W; real *x, *w, *R, *y; } conv_vl_ctx;
static double conv_vl_loss(void *p) {
    conv_vl_ctx *c = p;
    mtrl_ref_shortconv_fwd_varlen(c->n, c->offs, c->C, c->W, c->x, c->w, c->y);
    return dot(c->R, c->y, (size_t)c->offs[c->n] * c->C);
}

static void test_shortconv_varlen(void) {
    printf("shortconv varlen\n");
    // pieces of 4, 0, 1, 2 (shorter than the window) and 5 tokens
    static const int offs[6] = {0, 4, 4, 5, 7, 12};
    const int np = 5, C = 3, W = 4, T = offs[np];
    const size_t n = (size_t)T * C, nw = (size_t)C * W;
    conv_vl_ctx c = {np, offs, C, W, randn(n, 1, 0), randn(nw, 0.7, 0), randn(n, 1, 0), malloc(sizeof(real) * n)};
    real *dx = malloc(sizeof(real) * n), *dw0 = randn(nw, 1, 0), *dw = copyv(dw0, nw), *dwg = malloc(sizeof(real) * nw);
    mtrl_ref_shortconv_bwd_varlen(np, offs, C, W, c.x, c.w, c.R, dx, dw);
    for (size_t e = 0; e < nw; e++) dwg[e] = dw[e] - dw0[e];
    CHECK_FD("shortconv varlen dx", conv_vl_loss, &c, c.x, n, dx);
    CHECK_FD("shortconv varlen dw (+=)", conv_vl_loss, &c, c.w, nw, dwg);
    real *dxp = malloc(sizeof(real) * n), *dwp = copyv(dw0, nw);
    for (int i = 0; i < np; i++) {
        size_t o = (size_t)offs[i] * C;
        mtrl_ref_shortconv_bwd(offs[i + 1] - offs[i], C, W, c.x + o, c.w, NULL, c.R + o, dxp + o, dwp, NULL);
    }
    TEST_ARRAY_CLOSE(dx, dxp, n, 0, 0);
    TEST_ARRAY_CLOSE(dw, dwp, nw, 0, 0);
    free(c.x); free(c.w); free(c.R); free(c.y); free(dx); free(dw0); free(dw); free(dwg); free(dxp); free(dwp);
}

// ---- embedding -----------------------------------------------------------------------------

static void test_embedding(void) {
    printf("embedding\n");
    const int V = 6, D = 4, N = 7;
    const int ids[7] = { 3, 0, 3, -1, 5, 3, 1 };
    real *E = randn((size_t)V * D, 1, 0), *x = randn((size_t)N * D, 1, 0);
    mtrl_ref_embedding_fwd(N, D, ids, E, x);
    for (int i = 0; i < N; i++)
        for (int j = 0; j < D; j++)
            TEST_CLOSE(x[i * D + j], ids[i] < 0 ? 0 : E[ids[i] * D + j], 0, 0);
    real *dx = randn((size_t)N * D, 1, 0), *dE0 = randn((size_t)V * D, 1, 0), *dE = copyv(dE0, (size_t)V * D);
    mtrl_ref_embedding_bwd(N, D, ids, dx, dE);
    double worst = 0;
    for (int v = 0; v < V; v++)
        for (int j = 0; j < D; j++) {
            double want = dE0[v * D + j];
            for (int i = 0; i < N; i++) if (ids[i] == v) want += dx[i * D + j];
            worst = fmax(worst, fabs(dE[v * D + j] - want));
        }
    TEST_CHECKF(worst < 1e-14, "embedding bwd %.3e", worst);
    free(E); free(x); free(dx); free(dE0); free(dE);
}

// ---- logits log-prob / entropy -------------------------------------------------------------

typedef struct { int N, V; real *l; int *tg; real *c, *e, *lp, *H; } lp_ctx;
static double lp_loss(void *p) {
    lp_ctx *c = p;
    mtrl_ref_logits_logprob_fwd(c->N, c->V, c->l, c->tg, c->lp, c->H);
    return dot(c->c, c->lp, (size_t)c->N) + dot(c->e, c->H, (size_t)c->N);
}

static void test_logprob(void) {
    printf("logits_logprob\n");
    const int N = 4, V = 9;
    int tg[4] = { 2, -1, 8, 0 };
    lp_ctx c = { N, V, randn((size_t)N * V, 2, 3), tg, randn(N, 1, 0), randn(N, 1, 0),
                 malloc(sizeof(real) * N), malloc(sizeof(real) * N) };
    mtrl_ref_logits_logprob_fwd(N, V, c.l, tg, c.lp, c.H);
    for (int i = 0; i < N; i++) {
        double z = 0, Hs = 0;
        for (int v = 0; v < V; v++) z += exp(c.l[i * V + v]);
        for (int v = 0; v < V; v++) { double p = exp(c.l[i * V + v]) / z; Hs -= p * log(p); }
        TEST_CLOSE(c.lp[i], tg[i] < 0 ? 0 : c.l[i * V + tg[i]] - log(z), 1e-13, 1e-14);
        TEST_CLOSE(c.H[i], Hs, 1e-13, 1e-14);
    }
    real *g = malloc(sizeof(real) * N * V);
    mtrl_ref_logits_logprob_bwd(N, V, c.l, tg, c.c, c.e, g);
    CHECK_FD("logprob+entropy dlogits", lp_loss, &c, c.l, (size_t)N * V, g);
    // Entropy term off (NULL) == dentropy of zeros; and dlogits aliasing logits.
    real *zeros = calloc(N, sizeof(real)), *g0 = malloc(sizeof(real) * N * V), *g1 = malloc(sizeof(real) * N * V);
    mtrl_ref_logits_logprob_bwd(N, V, c.l, tg, c.c, NULL, g0);
    mtrl_ref_logits_logprob_bwd(N, V, c.l, tg, c.c, zeros, g1);
    TEST_ARRAY_CLOSE(g0, g1, (size_t)N * V, 0, 0);
    real *la = copyv(c.l, (size_t)N * V);
    mtrl_ref_logits_logprob_bwd(N, V, la, tg, c.c, c.e, la);
    TEST_ARRAY_CLOSE(la, g, (size_t)N * V, 0, 0);
    free(c.l); free(c.c); free(c.e); free(c.lp); free(c.H); free(g); free(zeros); free(g0);
    free(g1); free(la);
}

// ---- AdamW and norms -----------------------------------------------------------------------

static void test_adamw(void) {
    printf("adamw\n");
    const size_t n = 5;
    real *p = randn(n, 1, 0), *g1 = randn(n, 1, 0), *g2 = randn(n, 1, 0);
    real *m = calloc(n, sizeof(real)), *v = calloc(n, sizeof(real));
    real *p0 = copyv(p, n);
    const double lr = 0.01, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
    mtrl_ref_adamw_update(n, p, g1, m, v, lr, b1, b2, eps, wd, 1);
    for (size_t i = 0; i < n; i++) {
        // Step 1: m̂ = g, v̂ = g², so the step is lr (g/(|g|+eps) + wd p).
        double g = g1[i];
        TEST_CLOSE(m[i], 0.1 * g, 1e-15, 0);
        TEST_CLOSE(v[i], 0.05 * g * g, 1e-15, 0);
        TEST_CLOSE(p[i], p0[i] - lr * (g / (fabs(g) + eps) + wd * p0[i]), 1e-15, 1e-17);
    }
    real *p1 = copyv(p, n);
    mtrl_ref_adamw_update(n, p, g2, m, v, lr, b1, b2, eps, wd, 2);
    for (size_t i = 0; i < n; i++) {
        double mm = 0.9 * 0.1 * g1[i] + 0.1 * g2[i];
        double vv = 0.95 * 0.05 * g1[i] * g1[i] + 0.05 * g2[i] * g2[i];
        double mh = mm / (1 - 0.81), vh = vv / (1 - 0.9025);
        TEST_CLOSE(p[i], p1[i] - lr * (mh / (sqrt(vh) + eps) + wd * p1[i]), 1e-14, 1e-16);
    }
    // grad_sq_norm across several blocks; scale_inplace.
    const size_t big = 10007;
    real *gb = randn(big, 1, 0);
    double want = 0;
    for (size_t i = 0; i < big; i++) want += (double)gb[i] * gb[i];
    double got = mtrl_ref_grad_sq_norm(big, gb);
    TEST_CLOSE(got, want, 1e-12, 0);
    TEST_CLOSE(mtrl_ref_grad_sq_norm(3, gb), (double)gb[0] * gb[0] + gb[1] * gb[1] + gb[2] * gb[2], 1e-15, 0);
    mtrl_ref_scale_inplace(big, gb, (real)0.5);
    TEST_CLOSE(mtrl_ref_grad_sq_norm(big, gb), want * 0.25, 1e-12, 0);
    free(p); free(g1); free(g2); free(m); free(v); free(p0); free(p1); free(gb);
}

// The piece_io short conv (mtrl_ref_shortconv_fwd_varlen_io): pieces of 1, 2, 0, 5 and 9 rows
// (shorter and longer than the window) each continuing its own window == one run of the window's
// sequence: the window as the last W−1 inputs before the piece, then the piece (y and the new
// window exactly); in place (the new windows over the old) the same bits; a NULL entry the zero
// window.
static void test_shortconv_varlen_io(void) {
    printf("shortconv varlen_io\n");
    enum { NP = 5, C = 3, W = 4 };
    const int len[NP] = {1, 2, 0, 5, 9};
    int offs[NP + 1] = {0};
    for (int i = 0; i < NP; i++) offs[i + 1] = offs[i] + len[i];
    size_t n = (size_t)offs[NP] * C, ns = (size_t)(W - 1) * C;
    real *x = randn(n, 1.0, 0.0), *w = randn((size_t)C * W, 0.5, 0.0), *win = randn(NP * ns, 1.0, 0.0);
    real *y = malloc(sizeof(real) * n), *y2 = malloc(sizeof(real) * n), *wo = malloc(sizeof(real) * NP * ns);
    real *wip = malloc(sizeof(real) * NP * ns);
    const real *in[NP];
    real *out[NP], *inplace[NP];
    for (int i = 0; i < NP; i++) {
        in[i] = i == 1 ? NULL : win + i * ns;
        out[i] = wo + i * ns;
        inplace[i] = wip + i * ns;
    }
    memcpy(wip, win, sizeof(real) * NP * ns);
    memset(wip + ns, 0, sizeof(real) * ns);
    mtrl_ref_shortconv_fwd_varlen_io(NP, offs, C, W, x, w, in, out, y);
    mtrl_ref_shortconv_fwd_varlen_io(NP, offs, C, W, x, w, (const real *const *)inplace, inplace, y2);
    TEST_ARRAY_CLOSE(y2, y, n, 0, 0);
    TEST_ARRAY_CLOSE(wip, wo, NP * ns, 0, 0);
    for (int i = 0; i < NP; i++) {
        // the piece's stream: its window's rows, then its rows, from the zero window
        int Ti = len[i], Ts = W - 1 + Ti;
        real *xs = calloc((size_t)Ts * C, sizeof(real)), *ys = malloc(sizeof(real) * ((size_t)Ts * C + 1));
        real *so = malloc(sizeof(real) * ns);
        if (in[i]) memcpy(xs, in[i], sizeof(real) * ns);
        memcpy(xs + ns, x + (size_t)offs[i] * C, sizeof(real) * (size_t)Ti * C);
        real *zero = calloc(ns, sizeof(real));
        mtrl_ref_shortconv_fwd(Ts, C, W, xs, w, zero, ys, so);
        TEST_ARRAY_CLOSE(y + (size_t)offs[i] * C, ys + ns, (size_t)Ti * C, 0, 0);
        TEST_ARRAY_CLOSE(wo + i * ns, so, ns, 0, 0);
        free(xs); free(ys); free(so); free(zero);
    }
    free(x); free(w); free(win); free(y); free(y2); free(wo); free(wip);
}

int main(void) {
    test_norms();
    test_swiglu();
    test_shortconv();
    test_shortconv_varlen();
    test_shortconv_varlen_io();
    test_embedding();
    test_logprob();
    test_adamw();
    return test_report();
}
