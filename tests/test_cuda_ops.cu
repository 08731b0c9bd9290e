// mtrl-test: gpu f64
// test_cuda_ops.cu: the CUDA per-token operators against the fp64 CPU reference (ops_ref.h,
// attnres_ref.h): RMSNorm, L2Norm, gated RMSNorm (forward, backward, "+=" weight gradients onto
// nonzero buffers), SwiGLU, short conv with a carried state (forward, state out, backward with
// the state gradient, state_bwd, batched decode step), log-prob / entropy over a 50k vocabulary
// (forward and backward), AdamW, one Block-AttnRes site (forward, backward).
// All fp32 on the GPU: ‖out − ref‖/‖ref‖ ≤ 1e-5 (elementwise and row ops), 1e-4 where a
// reduction runs over many rows or a long row (weight gradients, the vocabulary).
#include "tests/testhelp.h"
#include "kernels/lab/cuda_testutil.h"
#include "kernels/ref/attnres_ref.h"
#include "kernels/ref/ops_ref.h"

static double *fetch(const float *d, size_t n) {
    double *h = tu_alloc(n);
    tu_get_f32(h, d, n);
    return h;
}
#define CHECK_DEV(what, dptr, ref, n, tol)            \
    do {                                              \
        double *g_ = fetch((dptr), (n));              \
        TU_CHECK_REL((what), g_, (ref), (n), (tol));  \
        free(g_);                                     \
    } while (0)

static void test_norms(mtrl_cuda_ctx *ctx, int N, int D) {
    printf("norms N=%d D=%d\n", N, D);
    size_t n = (size_t)N * D;
    double *x = tu_alloc(n), *z = tu_alloc(n), *w = tu_alloc(D), *dy = tu_alloc(n), *y = tu_alloc(n),
           *rstd = tu_alloc(N), *dx = tu_alloc(n), *dz = tu_alloc(n), *dw = tu_alloc(D), *dw0 = tu_alloc(D);
    tu_fill_normal(x, n, 2.0);
    tu_fill_normal(z, n, 1.0);
    tu_fill_normal(w, D, 1.0);
    tu_fill_normal(dy, n, 1.0);
    tu_fill_normal(dw0, D, 1.0);
    float *d_x = tu_dev_f32(x, n), *d_z = tu_dev_f32(z, n), *d_w = tu_dev_f32(w, D), *d_dy = tu_dev_f32(dy, n);
    float *d_y = tu_dev_nan(ctx, n), *d_r = tu_dev_nan(ctx, N), *d_dx = tu_dev_nan(ctx, n),
          *d_dz = tu_dev_nan(ctx, n), *d_dw = tu_dev_f32(dw0, D);
    double eps = 1e-5;
    // RMSNorm
    mtrl_ref_rmsnorm_fwd(N, D, x, w, eps, y, rstd);
    memcpy(dw, dw0, sizeof(double) * D);
    mtrl_ref_rmsnorm_bwd(N, D, x, w, rstd, eps, dy, dx, dw);
    TEST_EQ_INT(mtrl_rmsnorm_fwd(ctx, N, D, d_x, d_w, (float)eps, d_y, d_r), 0);
    TEST_EQ_INT(mtrl_rmsnorm_bwd(ctx, N, D, d_x, d_w, d_r, (float)eps, d_dy, d_dx, d_dw), 0);
    mtrl_cuda_sync(ctx);
    CHECK_DEV("rmsnorm y", d_y, y, n, 1e-5);
    CHECK_DEV("rmsnorm rstd", d_r, rstd, N, 1e-5);
    CHECK_DEV("rmsnorm dx", d_dx, dx, n, 1e-5);
    CHECK_DEV("rmsnorm dw (+=)", d_dw, dw, D, 1e-4);
    // RMSNorm backward without rstd and without dw
    mtrl_cuda_fill_f32(ctx, n, NAN, d_dx);
    TEST_EQ_INT(mtrl_rmsnorm_bwd(ctx, N, D, d_x, d_w, NULL, (float)eps, d_dy, d_dx, NULL), 0);
    mtrl_cuda_sync(ctx);
    CHECK_DEV("rmsnorm dx (rstd recomputed)", d_dx, dx, n, 1e-5);
    // gated
    mtrl_ref_gated_rmsnorm_fwd(N, D, x, z, w, eps, y);
    memcpy(dw, dw0, sizeof(double) * D);
    mtrl_ref_gated_rmsnorm_bwd(N, D, x, z, w, eps, dy, dx, dz, dw);
    {
        float *t = tu_dev_f32(dw0, D);
        mtrl_cuda_free(d_dw);
        d_dw = t;
    }
    TEST_EQ_INT(mtrl_gated_rmsnorm_fwd(ctx, N, D, d_x, d_z, d_w, (float)eps, d_y), 0);
    TEST_EQ_INT(mtrl_gated_rmsnorm_bwd(ctx, N, D, d_x, d_z, d_w, (float)eps, d_dy, d_dx, d_dz, d_dw), 0);
    mtrl_cuda_sync(ctx);
    CHECK_DEV("gated rmsnorm y", d_y, y, n, 1e-5);
    CHECK_DEV("gated rmsnorm dx", d_dx, dx, n, 1e-5);
    CHECK_DEV("gated rmsnorm dz", d_dz, dz, n, 1e-5);
    CHECK_DEV("gated rmsnorm dw (+=)", d_dw, dw, D, 1e-4);
    // L2Norm
    double *rn = tu_alloc(N);
    mtrl_ref_l2norm_fwd(N, D, x, 1e-6, y, rn);
    mtrl_ref_l2norm_bwd(N, D, x, 1e-6, dy, dx);
    TEST_EQ_INT(mtrl_l2norm_fwd(ctx, N, D, d_x, 1e-6f, d_y, d_r), 0);
    TEST_EQ_INT(mtrl_l2norm_bwd(ctx, N, D, d_x, 1e-6f, d_dy, d_dx), 0);
    mtrl_cuda_sync(ctx);
    CHECK_DEV("l2norm y", d_y, y, n, 1e-5);
    CHECK_DEV("l2norm rnorm", d_r, rn, N, 1e-5);
    CHECK_DEV("l2norm dx", d_dx, dx, n, 1e-5);
    // SwiGLU (u1 = x, u3 = z)
    mtrl_ref_swiglu_fwd(N, D, x, z, y);
    mtrl_ref_swiglu_bwd(N, D, x, z, dy, dx, dz);
    TEST_EQ_INT(mtrl_swiglu_fwd(ctx, N, D, d_x, d_z, d_y), 0);
    TEST_EQ_INT(mtrl_swiglu_bwd(ctx, N, D, d_x, d_z, d_dy, d_dx, d_dz), 0);
    mtrl_cuda_sync(ctx);
    CHECK_DEV("swiglu m", d_y, y, n, 1e-5);
    CHECK_DEV("swiglu du1", d_dx, dx, n, 1e-5);
    CHECK_DEV("swiglu du3", d_dz, dz, n, 1e-5);
    float *dp[] = {d_x, d_z, d_w, d_dy, d_y, d_r, d_dx, d_dz, d_dw};
    for (int i = 0; i < 9; i++) mtrl_cuda_free(dp[i]);
    double *hp[] = {x, z, w, dy, y, rstd, dx, dz, dw, dw0, rn};
    for (int i = 0; i < 11; i++) free(hp[i]);
}

static void test_conv(mtrl_cuda_ctx *ctx, int T, int C, int W, int with_state) {
    printf("shortconv T=%d C=%d W=%d %s\n", T, C, W, with_state ? "with state" : "from zeros");
    size_t n = (size_t)T * C, ns = (size_t)(W - 1) * C;
    double *x = tu_alloc(n), *w = tu_alloc((size_t)C * W), *st = tu_alloc(ns), *y = tu_alloc(n),
           *so = tu_alloc(ns), *dy = tu_alloc(n), *dx = tu_alloc(n), *dw = tu_alloc((size_t)C * W),
           *dsi = tu_alloc(ns), *dso = tu_alloc(ns);
    tu_fill_normal(x, n, 1.0);
    tu_fill_normal(w, (size_t)C * W, 0.5);
    tu_fill_normal(st, ns, 1.0);
    tu_fill_normal(dy, n, 1.0);
    tu_fill_normal(dw, (size_t)C * W, 1.0);
    tu_fill_normal(dso, ns, 1.0);
    float *d_x = tu_dev_f32(x, n), *d_w = tu_dev_f32(w, (size_t)C * W), *d_st = tu_dev_f32(st, ns),
          *d_y = tu_dev_nan(ctx, n), *d_so = tu_dev_nan(ctx, ns), *d_dy = tu_dev_f32(dy, n),
          *d_dx = tu_dev_nan(ctx, n), *d_dw = tu_dev_f32(dw, (size_t)C * W), *d_dsi = tu_dev_nan(ctx, ns),
          *d_dso = tu_dev_f32(dso, ns);
    const double *sin = with_state ? st : NULL;
    mtrl_ref_shortconv_fwd(T, C, W, x, w, sin, y, so);
    mtrl_ref_shortconv_bwd(T, C, W, x, w, sin, dy, dx, dw, dsi);
    mtrl_ref_shortconv_state_bwd(T, C, W, dso, dx, dsi);
    TEST_EQ_INT(mtrl_shortconv_fwd(ctx, T, C, W, d_x, d_w, with_state ? d_st : NULL, d_y, d_so), 0);
    TEST_EQ_INT(mtrl_shortconv_bwd(ctx, T, C, W, d_x, d_w, with_state ? d_st : NULL, d_dy, d_dx, d_dw,
                                   d_dsi), 0);
    TEST_EQ_INT(mtrl_shortconv_state_bwd(ctx, T, C, W, d_dso, d_dx, d_dsi), 0);
    mtrl_cuda_sync(ctx);
    if (T) CHECK_DEV("shortconv y", d_y, y, n, 1e-5);
    CHECK_DEV("shortconv state_out", d_so, so, ns, 1e-6);
    if (T) CHECK_DEV("shortconv dx (+ state grad)", d_dx, dx, n, 1e-5);
    CHECK_DEV("shortconv dw (+=)", d_dw, dw, (size_t)C * W, 1e-4);
    CHECK_DEV("shortconv dstate_in", d_dsi, dsi, ns, 1e-5);
    // in-place state: state_out aliasing state_in
    if (with_state) {
        float *d_st2 = tu_dev_f32(st, ns);
        TEST_EQ_INT(mtrl_shortconv_fwd(ctx, T, C, W, d_x, d_w, d_st2, d_y, d_st2), 0);
        mtrl_cuda_sync(ctx);
        CHECK_DEV("shortconv state_out (in place)", d_st2, so, ns, 1e-6);
        mtrl_cuda_free(d_st2);
    }
    float *dp[] = {d_x, d_w, d_st, d_y, d_so, d_dy, d_dx, d_dw, d_dsi, d_dso};
    for (int i = 0; i < 10; i++) mtrl_cuda_free(dp[i]);
    double *hp[] = {x, w, st, y, so, dy, dx, dw, dsi, dso};
    for (int i = 0; i < 10; i++) free(hp[i]);
}

static void test_conv_step(mtrl_cuda_ctx *ctx, int B, int C, int W) {
    printf("shortconv step B=%d C=%d W=%d\n", B, C, W);
    size_t nw = (size_t)B * (W - 1) * C;
    double *x1 = tu_alloc((size_t)B * C), *w = tu_alloc((size_t)C * W), *win = tu_alloc(nw),
           *y1 = tu_alloc((size_t)B * C);
    tu_fill_normal(x1, (size_t)B * C, 1.0);
    tu_fill_normal(w, (size_t)C * W, 0.5);
    tu_fill_normal(win, nw, 1.0);
    float *d_x1 = tu_dev_f32(x1, (size_t)B * C), *d_w = tu_dev_f32(w, (size_t)C * W),
          *d_win = tu_dev_f32(win, nw), *d_y1 = tu_dev_nan(ctx, (size_t)B * C);
    for (int b = 0; b < B; b++)
        mtrl_ref_shortconv_step(C, W, x1 + (size_t)b * C, w, win + (size_t)b * (W - 1) * C, y1 + (size_t)b * C);
    TEST_EQ_INT(mtrl_shortconv_step(ctx, B, C, W, d_x1, d_w, d_win, d_y1), 0);
    mtrl_cuda_sync(ctx);
    CHECK_DEV("shortconv step y1", d_y1, y1, (size_t)B * C, 1e-5);
    CHECK_DEV("shortconv step window", d_win, win, nw, 0.0);
    mtrl_cuda_free(d_x1); mtrl_cuda_free(d_w); mtrl_cuda_free(d_win); mtrl_cuda_free(d_y1);
    free(x1); free(w); free(win); free(y1);
}

static void test_logprob(mtrl_cuda_ctx *ctx, int N, int V) {
    printf("logprob N=%d V=%d\n", N, V);
    size_t n = (size_t)N * V;
    double *l = tu_alloc(n), *lp = tu_alloc(N), *ent = tu_alloc(N), *dlp = tu_alloc(N),
           *dent = tu_alloc(N), *dl = tu_alloc(n);
    tu_fill_normal(l, n, 3.0);
    tu_fill_normal(dlp, N, 1.0);
    tu_fill_normal(dent, N, 1.0);
    int *tg = (int *)malloc(sizeof(int) * N);
    for (int i = 0; i < N; i++) tg[i] = i % 5 == 3 ? -1 : (int)(tu_next() % (uint64_t)V);
    mtrl_ref_logits_logprob_fwd(N, V, l, tg, lp, ent);
    mtrl_ref_logits_logprob_bwd(N, V, l, tg, dlp, dent, dl);
    float *d_l = tu_dev_f32(l, n), *d_lp = tu_dev_nan(ctx, N), *d_ent = tu_dev_nan(ctx, N),
          *d_dlp = tu_dev_f32(dlp, N), *d_dent = tu_dev_f32(dent, N), *d_dl = tu_dev_nan(ctx, n);
    int *d_tg = tu_dev_i32(tg, N);
    TEST_EQ_INT(mtrl_logprob_fwd(ctx, N, V, d_l, d_tg, d_lp, d_ent), 0);
    TEST_EQ_INT(mtrl_logprob_bwd(ctx, N, V, d_l, d_tg, d_dlp, d_dent, d_dl), 0);
    mtrl_cuda_sync(ctx);
    CHECK_DEV("logprob logp", d_lp, lp, N, 1e-5);
    CHECK_DEV("logprob entropy", d_ent, ent, N, 1e-4);
    CHECK_DEV("logprob bwd dlogits", d_dl, dl, n, 1e-4);
    // in place (dlogits aliasing logits)
    TEST_EQ_INT(mtrl_logprob_bwd(ctx, N, V, d_l, d_tg, d_dlp, d_dent, d_l), 0);
    mtrl_cuda_sync(ctx);
    CHECK_DEV("logprob bwd dlogits (in place)", d_l, dl, n, 1e-4);
    float *dp[] = {d_l, d_lp, d_ent, d_dlp, d_dent, d_dl};
    for (int i = 0; i < 6; i++) mtrl_cuda_free(dp[i]);
    mtrl_cuda_free(d_tg);
    free(l); free(lp); free(ent); free(dlp); free(dent); free(dl); free(tg);
}

static void test_adamw(mtrl_cuda_ctx *ctx, size_t n) {
    printf("adamw n=%zu\n", n);
    double *p = tu_alloc(n), *g = tu_alloc(n), *m = tu_alloc(n), *v = tu_alloc(n);
    tu_fill_normal(p, n, 1.0);
    tu_fill_normal(g, n, 1.0);
    tu_fill_normal(m, n, 0.1);
    for (size_t i = 0; i < n; i++) v[i] = (double)(float)(0.01 * tu_unif());
    float *d_p = tu_dev_f32(p, n), *d_g = tu_dev_f32(g, n), *d_m = tu_dev_f32(m, n), *d_v = tu_dev_f32(v, n);
    mtrl_ref_adamw_update(n, p, g, m, v, 1e-3, 0.9, 0.95, 1e-8, 0.1, 7);
    TEST_EQ_INT(mtrl_adamw(ctx, n, d_p, d_g, d_m, d_v, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 7), 0);
    mtrl_cuda_sync(ctx);
    CHECK_DEV("adamw param", d_p, p, n, 1e-6);
    CHECK_DEV("adamw m", d_m, m, n, 1e-6);
    CHECK_DEV("adamw v", d_v, v, n, 1e-6);
    mtrl_cuda_free(d_p); mtrl_cuda_free(d_g); mtrl_cuda_free(d_m); mtrl_cuda_free(d_v);
    free(p); free(g); free(m); free(v);
}

static void test_attnres(mtrl_cuda_ctx *ctx, int N, int D, int S) {
    printf("attnres site N=%d D=%d S=%d\n", N, D, S);
    size_t n = (size_t)N * D;
    double **V = (double **)malloc(sizeof(double *) * S), **dV = (double **)malloc(sizeof(double *) * S);
    float **d_V = (float **)malloc(sizeof(float *) * S), **d_dV = (float **)malloc(sizeof(float *) * S);
    for (int i = 0; i < S; i++) {
        V[i] = tu_alloc(n);
        dV[i] = tu_alloc(n);
        tu_fill_normal(V[i], n, 1.0 + i);
        tu_fill_normal(dV[i], n, 1.0);
        d_V[i] = tu_dev_f32(V[i], n);
        d_dV[i] = i == 1 ? NULL : tu_dev_f32(dV[i], n);  // source 1: no gradient wanted
    }
    double *w = tu_alloc(D), *gm = tu_alloc(D), *h = tu_alloc(n), *al = tu_alloc((size_t)N * S),
           *dh = tu_alloc(n), *dw = tu_alloc(D), *dg = tu_alloc(D);
    tu_fill_normal(w, D, 0.3);
    tu_fill_normal(gm, D, 1.0);
    tu_fill_normal(dh, n, 1.0);
    tu_fill_normal(dw, D, 1.0);
    tu_fill_normal(dg, D, 1.0);
    float *d_w = tu_dev_f32(w, D), *d_gm = tu_dev_f32(gm, D), *d_h = tu_dev_nan(ctx, n),
          *d_al = tu_dev_nan(ctx, (size_t)N * S), *d_dh = tu_dev_f32(dh, n), *d_dw = tu_dev_f32(dw, D),
          *d_dg = tu_dev_f32(dg, D);
    double eps = 1e-5;
    mtrl_ref_attnres_site_fwd(N, D, S, (const double *const *)V, w, gm, eps, h, al);
    double **dVr = (double **)malloc(sizeof(double *) * S);
    for (int i = 0; i < S; i++) dVr[i] = i == 1 ? NULL : dV[i];
    mtrl_ref_attnres_site_bwd(N, D, S, (const double *const *)V, w, gm, eps, al, dh, dVr, dw, dg);
    TEST_EQ_INT(mtrl_attnres_site_fwd(ctx, N, D, S, (const float *const *)d_V, d_w, d_gm, (float)eps,
                                      d_h, d_al), 0);
    TEST_EQ_INT(mtrl_attnres_site_bwd(ctx, N, D, S, (const float *const *)d_V, d_w, d_gm, (float)eps,
                                      d_al, d_dh, d_dV, d_dw, d_dg), 0);
    mtrl_cuda_sync(ctx);
    CHECK_DEV("attnres h", d_h, h, n, 1e-5);
    CHECK_DEV("attnres alpha", d_al, al, (size_t)N * S, 1e-5);
    for (int i = 0; i < S; i++) {
        if (i == 1) continue;
        char what[64];
        snprintf(what, sizeof what, "attnres dV[%d] (+=)", i);
        CHECK_DEV(what, d_dV[i], dV[i], n, 1e-5);
    }
    CHECK_DEV("attnres dw (+=)", d_dw, dw, D, 1e-4);
    CHECK_DEV("attnres dgamma (+=)", d_dg, dg, D, 1e-4);
    for (int i = 0; i < S; i++) {
        mtrl_cuda_free(d_V[i]);
        mtrl_cuda_free(d_dV[i]);
        free(V[i]);
        free(dV[i]);
    }
    free(V); free(dV); free(d_V); free(d_dV); free(dVr);
    float *dp[] = {d_w, d_gm, d_h, d_al, d_dh, d_dw, d_dg};
    for (int i = 0; i < 7; i++) mtrl_cuda_free(dp[i]);
    free(w); free(gm); free(h); free(al); free(dh); free(dw); free(dg);
}

int main(void) {
    if (mtrl_cuda_device_count() <= 0) test_skip("no CUDA device");
    mtrl_cuda_ctx *ctx = mtrl_cuda_ctx_create(0, NULL);
    tu_seed(5);
    test_norms(ctx, 700, 1000);
    test_norms(ctx, 33, 16);
    test_conv(ctx, 300, 96, 4, 1);
    test_conv(ctx, 2, 40, 4, 1);  // T < W - 1: the state passes through
    test_conv(ctx, 50, 40, 4, 0);
    test_conv_step(ctx, 5, 96, 4);
    test_logprob(ctx, 40, 50000);
    test_adamw(ctx, 100003);
    test_attnres(ctx, 200, 256, 5);
    mtrl_cuda_ctx_destroy(ctx);
    return test_report();
}
