// mtrl-test: gpu f64 timeout=600
// test_cuda_moe.cu: the CUDA MoE kernels against the fp64 CPU reference (moe_ref.h): router
// (sigmoid and softmax scores, QB bias, replayed routing), router backward, the stable dispatch
// (exact offsets / permutation), gather, grouped SwiGLU experts forward / backward (fp32 and
// bf16 operands), combine forward / backward, scatter backward, load counts and the QB update.
// Cases include an empty expert (its bias makes it never chosen) and all tokens on one expert.
// The experts' GEMMs run on several streams (GEMM lanes); one lane gives the same bits.
// The grouped experts (own kernels, device offsets) against the same reference with empty
// experts, skewed routing and 0 .. 9000 rows per expert, forward and backward (test_grouped).
// Logits and biases are multiples of 2^-8, so z − β is exact in fp32 and the selections
// (including ties, broken by the lower id) must match the reference exactly.
// Tolerances: fp32 arithmetic 1e-5 (router), 1e-4 (fp32-operand GEMMs: the lanes, true fp32);
// TF32 3e-3 (the grouped kernels on fp32 operands); bf16 operands 1e-2; integer outputs and the
// QB bias exact.
#include "tests/testhelp.h"
#include "kernels/lab/cuda_testutil.h"
#include "kernels/ref/gemm_ref.h"
#include "kernels/ref/moe_ref.h"

static void fill_quant(double *x, size_t n, double sd) {
    for (size_t i = 0; i < n; i++) x[i] = round(sd * tu_normal() * 256.0) / 256.0;
}

static int *dl_int(const int *d, size_t n) {
    int *h = (int *)malloc(sizeof(int) * (n ? n : 1));
    mtrl_cuda_download(h, d, sizeof(int) * n);
    return h;
}

static void test_router(mtrl_cuda_ctx *ctx, int N, int E, int K, int softmax, int with_beta) {
    printf("router N=%d E=%d K=%d %s%s\n", N, E, K, softmax ? "softmax" : "sigmoid",
           with_beta ? " + QB bias" : "");
    size_t nz = (size_t)N * E, nk = (size_t)N * K;
    double *z = tu_alloc(nz), *beta = tu_alloc(E), *w = tu_alloc(nk), *s = tu_alloc(nz),
           *dw = tu_alloc(nk), *dz = tu_alloc(nz), *got = tu_alloc(nz);
    fill_quant(z, nz, 1.0);
    fill_quant(beta, E, 0.5);
    tu_fill_normal(dw, nk, 1.0);
    int *sel = (int *)malloc(sizeof(int) * nk);
    double rho = 2.446;
    mtrl_ref_moe_router_fwd(N, E, K, z, with_beta ? beta : NULL, softmax, rho, 0, sel, w, s);
    mtrl_ref_moe_router_bwd(N, E, K, s, sel, w, softmax, rho, dw, dz);
    float *d_z = tu_dev_f32(z, nz), *d_beta = tu_dev_f32(beta, E), *d_w = tu_dev_nan(ctx, nk),
          *d_s = tu_dev_nan(ctx, nz), *d_dw = tu_dev_f32(dw, nk), *d_dz = tu_dev_nan(ctx, nz);
    int *d_sel = (int *)mtrl_cuda_malloc(sizeof(int) * nk);
    TEST_EQ_INT(mtrl_moe_router_fwd(ctx, N, E, K, d_z, with_beta ? d_beta : NULL, softmax,
                                    (float)rho, 0, d_sel, d_w, d_s), 0);
    TEST_EQ_INT(mtrl_moe_router_bwd(ctx, N, E, K, d_s, d_sel, d_w, softmax, (float)rho, d_dw, d_dz), 0);
    mtrl_cuda_sync(ctx);
    int *gsel = dl_int(d_sel, nk);
    int mism = 0;
    for (size_t i = 0; i < nk; i++) mism += gsel[i] != sel[i];
    printf("  %-44s %d of %zu slots differ\n", "router sel (exact)", mism, nk);
    TEST_EQ_INT(mism, 0);
    tu_get_f32(got, d_w, nk);
    TU_CHECK_REL("router w", got, w, nk, 1e-5);
    tu_get_f32(got, d_s, nz);
    TU_CHECK_REL("router s", got, s, nz, 1e-5);
    tu_get_f32(got, d_dz, nz);
    TU_CHECK_REL("router bwd dz", got, dz, nz, 1e-5);
    // replay: sel given (the reference's), only s and w computed
    float *d_w2 = tu_dev_nan(ctx, nk), *d_s2 = tu_dev_nan(ctx, nz);
    int *d_sel2 = tu_dev_i32(sel, nk);
    TEST_EQ_INT(mtrl_moe_router_fwd(ctx, N, E, K, d_z, NULL, softmax, (float)rho, 1, d_sel2, d_w2,
                                    d_s2), 0);
    mtrl_cuda_sync(ctx);
    tu_get_f32(got, d_w2, nk);
    TU_CHECK_REL("router w (replay)", got, w, nk, 1e-5);
    float *fp[] = {d_z, d_beta, d_w, d_s, d_dw, d_dz, d_w2, d_s2};
    for (int i = 0; i < 8; i++) mtrl_cuda_free(fp[i]);
    mtrl_cuda_free(d_sel);
    mtrl_cuda_free(d_sel2);
    free(z); free(beta); free(w); free(s); free(dw); free(dz); free(got); free(sel); free(gsel);
}

// Full block: dispatch, gather, experts, combine and the backward chain, fp32 or bf16 operands.
// sel_mode 0: random top-K with expert 3 never chosen; 1: K = 1 and every token on expert 5.
static void test_block(mtrl_cuda_ctx *ctx, int N, int E, int K, int D, int I, int type, int sel_mode) {
    printf("experts N=%d E=%d K=%d D=%d I=%d %s %s\n", N, E, K, D, I, type ? "bf16" : "fp32",
           sel_mode ? "(all tokens on expert 5)" : "(expert 3 empty)");
    size_t R = (size_t)N * K;
    int *sel = (int *)malloc(sizeof(int) * R);
    double *z = tu_alloc((size_t)N * E), *beta = tu_alloc(E), *w = tu_alloc(R), *s = tu_alloc((size_t)N * E);
    fill_quant(z, (size_t)N * E, 1.0);
    if (sel_mode == 0) beta[3] = 100.0;
    else for (int t = 0; t < N; t++) z[(size_t)t * E + 5] = 50.0;
    mtrl_ref_moe_router_fwd(N, E, K, z, beta, 0, 2.446, 0, sel, w, s);
    int *offsets = (int *)malloc(sizeof(int) * (E + 1)), *perm = (int *)malloc(sizeof(int) * R),
        *pos = (int *)malloc(sizeof(int) * R);
    mtrl_ref_moe_dispatch(N, E, K, sel, offsets, perm, pos);
    // GPU dispatch
    int *d_sel = tu_dev_i32(sel, R);
    int *d_off = (int *)mtrl_cuda_malloc(sizeof(int) * (E + 1)), *d_perm = (int *)mtrl_cuda_malloc(sizeof(int) * R),
        *d_pos = (int *)mtrl_cuda_malloc(sizeof(int) * R), *d_load = (int *)mtrl_cuda_malloc(sizeof(int) * E);
    TEST_EQ_INT(mtrl_moe_dispatch(ctx, N, E, K, d_sel, d_off, d_perm, d_pos), 0);
    TEST_EQ_INT(mtrl_moe_load_count(ctx, N, E, K, d_sel, d_load), 0);
    mtrl_cuda_sync(ctx);
    int *g_off = dl_int(d_off, E + 1), *g_perm = dl_int(d_perm, R), *g_pos = dl_int(d_pos, R),
        *g_load = dl_int(d_load, E);
    int *load = (int *)malloc(sizeof(int) * E);
    mtrl_ref_moe_load_count(N, E, K, sel, load);
    TEST_CHECK(!memcmp(g_off, offsets, sizeof(int) * (E + 1)));
    TEST_CHECK(!memcmp(g_perm, perm, sizeof(int) * R));
    TEST_CHECK(!memcmp(g_pos, pos, sizeof(int) * R));
    TEST_CHECK(!memcmp(g_load, load, sizeof(int) * E));
    printf("  dispatch offsets/perm/pos and load counts %s (expert 3: %d rows, expert 5: %d rows)\n",
           memcmp(g_pos, pos, sizeof(int) * R) || memcmp(g_off, offsets, sizeof(int) * (E + 1)) ? "DIFFER" : "exact",
           offsets[4] - offsets[3], offsets[6] - offsets[5]);
    // inputs
    size_t nw1 = (size_t)E * I * D;
    double *x = tu_alloc((size_t)N * D), *W1 = tu_alloc(nw1), *W3 = tu_alloc(nw1), *W2 = tu_alloc(nw1);
    tu_fill_normal(x, (size_t)N * D, 1.0);
    tu_fill_normal(W1, nw1, 1.0 / sqrt((double)D));
    tu_fill_normal(W3, nw1, 1.0 / sqrt((double)D));
    tu_fill_normal(W2, nw1, 1.0 / sqrt((double)I));
    double *Xp = tu_alloc(R * D), *u1 = tu_alloc(R * I), *u3 = tu_alloc(R * I), *Yp = tu_alloc(R * D),
           *y = tu_alloc((size_t)N * D), *dy = tu_alloc((size_t)N * D), *dYp = tu_alloc(R * D),
           *dwr = tu_alloc(R), *dXp = tu_alloc(R * D), *dx = tu_alloc((size_t)N * D),
           *dW1 = tu_alloc(nw1), *dW3 = tu_alloc(nw1), *dW2 = tu_alloc(nw1);
    tu_fill_normal(dy, (size_t)N * D, 1.0);
    tu_fill_normal(dx, (size_t)N * D, 1.0);
    tu_fill_normal(dW1, nw1, 1.0);
    tu_fill_normal(dW3, nw1, 1.0);
    tu_fill_normal(dW2, nw1, 1.0);
    float *d_dx = tu_dev_f32(dx, (size_t)N * D), *d_dW1 = tu_dev_f32(dW1, nw1),
          *d_dW3 = tu_dev_f32(dW3, nw1), *d_dW2 = tu_dev_f32(dW2, nw1);
    double *dx0 = tu_alloc((size_t)N * D), *dW10 = tu_alloc(nw1);
    memcpy(dx0, dx, sizeof(double) * N * D);
    memcpy(dW10, dW1, sizeof(double) * nw1);
    mtrl_ref_moe_gather(N, K, D, pos, x, Xp);
    mtrl_ref_moe_experts_fwd(E, D, I, offsets, Xp, W1, W3, W2, u1, u3, Yp);
    mtrl_ref_moe_combine_fwd(N, K, D, pos, w, Yp, y);
    mtrl_ref_moe_combine_bwd(N, K, D, pos, w, Yp, dy, dYp, dwr);
    mtrl_ref_moe_experts_bwd(E, D, I, offsets, Xp, W1, W3, W2, u1, u3, dYp, dXp, dW1, dW3, dW2);
    mtrl_ref_moe_scatter_bwd(N, K, D, pos, dXp, dx);
    // GPU chain (weights in the operand type)
    int bf = type == MTRL_BF16;
    void *d_W1 = bf ? (void *)tu_dev_bf16(W1, nw1) : (void *)tu_dev_f32(W1, nw1);
    void *d_W3 = bf ? (void *)tu_dev_bf16(W3, nw1) : (void *)tu_dev_f32(W3, nw1);
    void *d_W2 = bf ? (void *)tu_dev_bf16(W2, nw1) : (void *)tu_dev_f32(W2, nw1);
    float *d_x = tu_dev_f32(x, (size_t)N * D), *d_w = tu_dev_f32(w, R), *d_u1 = tu_dev_nan(ctx, R * I),
          *d_u3 = tu_dev_nan(ctx, R * I), *d_Yp = tu_dev_nan(ctx, R * D), *d_y = tu_dev_nan(ctx, (size_t)N * D),
          *d_dy = tu_dev_f32(dy, (size_t)N * D), *d_dYp = tu_dev_nan(ctx, R * D), *d_dw = tu_dev_nan(ctx, R),
          *d_dXp = tu_dev_nan(ctx, R * D);
    void *d_Xp = mtrl_cuda_malloc(R * D * (bf ? 2 : 4));
    TEST_EQ_INT(mtrl_moe_gather(ctx, N, K, D, d_pos, d_x, d_Xp, type), 0);
    TEST_EQ_INT(mtrl_moe_experts_fwd(ctx, E, D, I, g_off, d_Xp, d_W1, d_W3, d_W2, type, d_u1, d_u3, d_Yp), 0);
    TEST_EQ_INT(mtrl_moe_combine_fwd(ctx, N, K, D, d_pos, d_w, d_Yp, d_y), 0);
    TEST_EQ_INT(mtrl_moe_combine_bwd(ctx, N, K, D, d_pos, d_w, d_Yp, d_dy, d_dYp, d_dw), 0);
    TEST_EQ_INT(mtrl_moe_experts_bwd(ctx, E, D, I, g_off, d_Xp, d_W1, d_W3, d_W2, type, d_u1, d_u3, d_dYp,
                                     d_dXp, d_dW1, d_dW3, d_dW2), 0);
    TEST_EQ_INT(mtrl_moe_scatter_bwd(ctx, N, K, D, d_pos, d_dXp, d_dx), 0);
    mtrl_cuda_sync(ctx);
    double tol = bf ? 1e-2 : 1e-4;
    size_t big = R * (D > I ? D : I) > nw1 ? R * (D > I ? D : I) : nw1;
    double *got = tu_alloc(big);
    if (!bf) {
        tu_get_f32(got, (float *)d_Xp, R * D);
        TU_CHECK_REL("gather X_perm", got, Xp, R * D, 0.0);
    }
    tu_get_f32(got, d_u1, R * I);
    TU_CHECK_REL("experts u1", got, u1, R * I, tol);
    tu_get_f32(got, d_Yp, R * D);
    TU_CHECK_REL("experts Y_perm", got, Yp, R * D, tol);
    tu_get_f32(got, d_y, (size_t)N * D);
    TU_CHECK_REL("combine y", got, y, (size_t)N * D, tol);
    tu_get_f32(got, d_dYp, R * D);
    TU_CHECK_REL("combine bwd dY_perm", got, dYp, R * D, 1e-6);
    tu_get_f32(got, d_dw, R);
    TU_CHECK_REL("combine bwd dw", got, dwr, R, tol);
    tu_get_f32(got, d_dXp, R * D);
    TU_CHECK_REL("experts bwd dX_perm", got, dXp, R * D, tol);
    // The experts on one GEMM lane (moe_lanes = 1) give the same bits as on the default lanes:
    // each expert's GEMMs are the same cuBLAS calls, only on other streams.
    {
        float *y4 = (float *)malloc(sizeof(float) * R * D), *x4 = (float *)malloc(sizeof(float) * R * D),
              *y1 = (float *)malloc(sizeof(float) * R * D), *x1 = (float *)malloc(sizeof(float) * R * D);
        mtrl_cuda_download(y4, d_Yp, sizeof(float) * R * D);
        mtrl_cuda_download(x4, d_dXp, sizeof(float) * R * D);
        mtrl_cuda_ctx_opts(ctx)->moe_lanes = 1;
        TEST_EQ_INT(mtrl_moe_experts_fwd(ctx, E, D, I, g_off, d_Xp, d_W1, d_W3, d_W2, type, d_u1, d_u3, d_Yp), 0);
        TEST_EQ_INT(mtrl_moe_experts_bwd(ctx, E, D, I, g_off, d_Xp, d_W1, d_W3, d_W2, type, d_u1, d_u3, d_dYp,
                                         d_dXp, NULL, NULL, NULL), 0);
        mtrl_cuda_sync(ctx);
        mtrl_cuda_ctx_opts(ctx)->moe_lanes = 0;
        mtrl_cuda_download(y1, d_Yp, sizeof(float) * R * D);
        mtrl_cuda_download(x1, d_dXp, sizeof(float) * R * D);
        TEST_CHECKF(!memcmp(y1, y4, sizeof(float) * R * D), "experts Y_perm: 1 GEMM lane differs from the default");
        TEST_CHECKF(!memcmp(x1, x4, sizeof(float) * R * D), "experts bwd dX_perm: 1 GEMM lane differs from the default");
        free(y4); free(x4); free(y1); free(x1);
    }
    // increments of the accumulated buffers
    double *inc = tu_alloc(big), *rinc = tu_alloc(big);
    tu_get_f32(got, d_dW1, nw1);
    for (size_t i = 0; i < nw1; i++) { inc[i] = got[i] - dW10[i]; rinc[i] = dW1[i] - dW10[i]; }
    TU_CHECK_REL("experts bwd dW1 (+=, increment)", inc, rinc, nw1, tol);
    tu_get_f32(got, d_dW3, nw1);
    TU_CHECK_REL("experts bwd dW3 (+=)", got, dW3, nw1, tol);
    tu_get_f32(got, d_dW2, nw1);
    TU_CHECK_REL("experts bwd dW2 (+=)", got, dW2, nw1, tol);
    tu_get_f32(got, d_dx, (size_t)N * D);
    for (size_t i = 0; i < (size_t)N * D; i++) { inc[i] = got[i] - dx0[i]; rinc[i] = dx[i] - dx0[i]; }
    TU_CHECK_REL("scatter bwd dx (+=, increment)", inc, rinc, (size_t)N * D, tol);
    free(inc); free(rinc); free(got);
    void *dp[] = {d_W1, d_W3, d_W2, d_x, d_w, d_u1, d_u3, d_Yp, d_y, d_dy, d_dYp, d_dw, d_dXp, d_Xp,
                  d_dx, d_dW1, d_dW3, d_dW2, d_sel, d_off, d_perm, d_pos, d_load};
    for (size_t i = 0; i < sizeof dp / sizeof *dp; i++) mtrl_cuda_free(dp[i]);
    double *hp[] = {z, beta, w, s, x, W1, W3, W2, Xp, u1, u3, Yp, y, dy, dYp, dwr, dXp, dx, dW1, dW3,
                    dW2, dx0, dW10};
    for (size_t i = 0; i < sizeof hp / sizeof *hp; i++) free(hp[i]);
    free(sel); free(offsets); free(perm); free(pos); free(g_off); free(g_perm); free(g_pos);
    free(g_load); free(load);
}

// The grouped experts (mtrl_moe_experts_grouped_fwd / _bwd: own kernels, device offsets) against
// the fp64 reference on the given rows per expert (zeros: empty experts; one large count: skewed
// routing). Operands fp32 (multiplied as TF32) or bf16. Outputs are NaN-poisoned first (every row
// must be written); the weight gradients start random and only their increments are compared,
// and an empty expert's must be exactly zero (its gradient bits untouched). Also: the same bits on
// a second run, R = 0 writes nothing, and the NULL-gradient forms (dW3 alone: the single-pair
// weight-gradient launch on du3).
static void test_grouped(mtrl_cuda_ctx *ctx, int E, int D, int I, const int *rows, int type, const char *what) {
    int bf = type == MTRL_BF16;
    int *off = (int *)malloc(sizeof(int) * (E + 1));
    off[0] = 0;
    for (int e = 0; e < E; e++) off[e + 1] = off[e] + rows[e];
    size_t R = (size_t)off[E], nw = (size_t)E * I * D;
    int empty = 0, most = 0;
    for (int e = 0; e < E; e++) {
        empty += rows[e] == 0;
        if (rows[e] > rows[most]) most = e;
    }
    printf("grouped experts E=%d D=%d I=%d R=%zu %s (%s; %d empty, largest expert %d rows) path %s\n", E, D, I, R,
           bf ? "bf16" : "fp32 as TF32", what, empty, rows[most],
           mtrl_moe_experts_path(ctx, E, D, I, (long)R, type) == MTRL_MOE_GROUPED ? "grouped" : "lanes");
    double *Xp = tu_alloc(R * D), *W1 = tu_alloc(nw), *W3 = tu_alloc(nw), *W2 = tu_alloc(nw), *dYp = tu_alloc(R * D);
    tu_fill_normal(Xp, R * D, 1.0);
    tu_fill_normal(W1, nw, 1.0 / sqrt((double)D));
    tu_fill_normal(W3, nw, 1.0 / sqrt((double)D));
    tu_fill_normal(W2, nw, 1.0 / sqrt((double)I));
    tu_fill_normal(dYp, R * D, 1.0);
    double *u1 = tu_alloc(R * I), *u3 = tu_alloc(R * I), *Yp = tu_alloc(R * D), *dXp = tu_alloc(R * D),
           *dW1 = tu_alloc(nw), *dW3 = tu_alloc(nw), *dW2 = tu_alloc(nw);
    mtrl_ref_moe_experts_fwd(E, D, I, off, Xp, W1, W3, W2, u1, u3, Yp);
    mtrl_ref_moe_experts_bwd(E, D, I, off, Xp, W1, W3, W2, u1, u3, dYp, dXp, dW1, dW3, dW2);  // from zero: the increments
    // device
    int *d_off = tu_dev_i32(off, E + 1);
    void *d_X = bf ? (void *)tu_dev_bf16(Xp, R * D) : (void *)tu_dev_f32(Xp, R * D);
    void *d_W1 = bf ? (void *)tu_dev_bf16(W1, nw) : (void *)tu_dev_f32(W1, nw);
    void *d_W3 = bf ? (void *)tu_dev_bf16(W3, nw) : (void *)tu_dev_f32(W3, nw);
    void *d_W2 = bf ? (void *)tu_dev_bf16(W2, nw) : (void *)tu_dev_f32(W2, nw);
    double *g0 = tu_alloc(3 * nw);  // the gradients' starting values
    tu_fill_normal(g0, 3 * nw, 1.0);
    float *d_u1 = tu_dev_nan(ctx, R * I), *d_u3 = tu_dev_nan(ctx, R * I), *d_Yp = tu_dev_nan(ctx, R * D),
          *d_dYp = tu_dev_f32(dYp, R * D), *d_dXp = tu_dev_nan(ctx, R * D), *d_dW1 = tu_dev_f32(g0, nw),
          *d_dW3 = tu_dev_f32(g0 + nw, nw), *d_dW2 = tu_dev_f32(g0 + 2 * nw, nw);
    TEST_EQ_INT(mtrl_moe_experts_grouped_fwd(ctx, E, D, I, (long)R, d_off, d_X, d_W1, d_W3, d_W2, type, d_u1, d_u3,
                                             d_Yp), 0);
    TEST_EQ_INT(mtrl_moe_experts_grouped_bwd(ctx, E, D, I, (long)R, d_off, d_X, d_W1, d_W3, d_W2, type, d_u1, d_u3,
                                             d_dYp, d_dXp, d_dW1, d_dW3, d_dW2), 0);
    mtrl_cuda_sync(ctx);
    // TF32: ~3e-4 rms relative per rounded operand, through at most three chained products;
    // bf16: ~1e-3 per operand (the reference sees the unrounded weights), as test_block.
    double tol = bf ? 1e-2 : 3e-3;
    size_t big = R * (size_t)D > nw ? R * (size_t)D : nw;
    double *got = tu_alloc(big), *inc = tu_alloc(nw);
    char name[64];
    tu_get_f32(got, d_u1, R * I);
    TU_CHECK_REL("grouped u1", got, u1, R * I, tol);
    tu_get_f32(got, d_u3, R * I);
    TU_CHECK_REL("grouped u3", got, u3, R * I, tol);
    tu_get_f32(got, d_Yp, R * D);
    TU_CHECK_REL("grouped Y_perm", got, Yp, R * D, tol);
    tu_get_f32(got, d_dXp, R * D);
    TU_CHECK_REL("grouped bwd dX_perm", got, dXp, R * D, tol);
    float *dws[3] = {d_dW1, d_dW3, d_dW2};
    const double *refs[3] = {dW1, dW3, dW2};
    const char *names[3] = {"dW1", "dW3", "dW2"};
    for (int k = 0; k < 3; k++) {
        tu_get_f32(got, dws[k], nw);
        int untouched = 1;
        for (size_t i = 0; i < nw; i++) {
            inc[i] = got[i] - (double)(float)g0[k * nw + i];
            if (rows[i / ((size_t)I * D)] == 0 && got[i] != (double)(float)g0[k * nw + i]) untouched = 0;
        }
        snprintf(name, sizeof name, "grouped bwd %s (+=, increment)", names[k]);
        TU_CHECK_REL(name, inc, refs[k], nw, tol);
        TEST_CHECKF(untouched, "grouped bwd %s: an empty expert's gradient changed", names[k]);
    }
    // The same bits on a second run (fixed reduction order, no atomics).
    {
        float *y1 = (float *)malloc(sizeof(float) * (R * D ? R * D : 1)), *y2 = (float *)malloc(sizeof(float) * (R * D ? R * D : 1));
        mtrl_cuda_download(y1, d_Yp, sizeof(float) * R * D);
        TEST_EQ_INT(mtrl_moe_experts_grouped_fwd(ctx, E, D, I, (long)R, d_off, d_X, d_W1, d_W3, d_W2, type, d_u1,
                                                 d_u3, d_Yp), 0);
        mtrl_cuda_sync(ctx);
        mtrl_cuda_download(y2, d_Yp, sizeof(float) * R * D);
        TEST_CHECKF(!memcmp(y1, y2, sizeof(float) * R * D), "grouped Y_perm: a second run gives other bits");
        free(y1);
        free(y2);
    }
    // dW3 alone (dW1, dW2 NULL) into a zeroed buffer: the increment again.
    {
        double *zero = tu_alloc(nw);
        float *d_g = tu_dev_f32(zero, nw);
        TEST_EQ_INT(mtrl_moe_experts_grouped_bwd(ctx, E, D, I, (long)R, d_off, d_X, d_W1, d_W3, d_W2, type, d_u1,
                                                 d_u3, d_dYp, d_dXp, NULL, d_g, NULL), 0);
        mtrl_cuda_sync(ctx);
        tu_get_f32(got, d_g, nw);
        TU_CHECK_REL("grouped bwd dW3 alone", got, dW3, nw, tol);
        mtrl_cuda_free(d_g);
        free(zero);
    }
    void *dp[] = {d_off, d_X, d_W1, d_W3, d_W2, d_u1, d_u3, d_Yp, d_dYp, d_dXp, d_dW1, d_dW3, d_dW2};
    for (size_t i = 0; i < sizeof dp / sizeof *dp; i++) mtrl_cuda_free(dp[i]);
    double *hp[] = {Xp, W1, W3, W2, dYp, u1, u3, Yp, dXp, dW1, dW3, dW2, g0, got, inc};
    for (size_t i = 0; i < sizeof hp / sizeof *hp; i++) free(hp[i]);
    free(off);
}

// Row counts for test_grouped; the chooser's answers on the shapes the model meets.
static void test_grouped_all(mtrl_cuda_ctx *ctx) {
    // skewed, 0 .. 9000 rows: mean ~950 (128-row tiles); partial k-slices and n-tiles (264, 200)
    const int r12[12] = {0, 1, 15, 16, 17, 33, 100, 0, 9000, 130, 64, 2000};
    // decode-like: 64 experts of 0 .. 12 rows (32-row tiles), some empty
    int r64[64];
    for (int e = 0; e < 64; e++) r64[e] = (int)(tu_next() % 13);
    r64[3] = r64[40] = 0;
    // mean ~48 (64-row tiles), tile edges 63/64/65
    const int r8[8] = {50, 0, 63, 64, 65, 47, 40, 51};
    // one expert holds every row
    int r16[16] = {0};
    r16[11] = 300;
    for (int bf = 0; bf < 2; bf++) {
        int type = bf ? MTRL_BF16 : MTRL_F32;
        test_grouped(ctx, 12, 264, 200, r12, type, "skewed, 0 .. 9000 rows");
        test_grouped(ctx, 64, 128, 64, r64, type, "decode-like, 0 .. 12 rows");
        test_grouped(ctx, 8, 96, 40, r8, type, "tile edges");
        test_grouped(ctx, 16, 64, 48, r16, type, "every row on expert 11");
    }
    // R = 0: nothing launched, nothing written
    int z[4] = {0};
    float *d_y = tu_dev_nan(ctx, 8);
    int *d_z = tu_dev_i32(z, 4);
    TEST_EQ_INT(mtrl_moe_experts_grouped_fwd(ctx, 3, 8, 8, 0, d_z, d_y, d_y, d_y, d_y, MTRL_F32, d_y, d_y, d_y), 0);
    TEST_EQ_INT(mtrl_moe_experts_grouped_fwd(ctx, 3, 12, 8, 0, d_z, d_y, d_y, d_y, d_y, MTRL_F32, d_y, d_y, d_y), -1);
    mtrl_cuda_free(d_y);
    mtrl_cuda_free(d_z);
    // The chooser: true fp32 and one expert go to the lanes; small rows to the grouped kernels.
    mtrl_cuda_ctx_set_tf32(ctx, 0);
    TEST_EQ_INT(mtrl_moe_experts_path(ctx, 64, 1024, 512, 64 * 16, MTRL_F32), MTRL_MOE_LANES);
    TEST_EQ_INT(mtrl_moe_experts_path(ctx, 64, 1024, 512, 64 * 16, MTRL_BF16), MTRL_MOE_GROUPED);
    TEST_EQ_INT(mtrl_moe_experts_path(ctx, 1, 1024, 512, 4096, MTRL_BF16), MTRL_MOE_LANES);
    TEST_EQ_INT(mtrl_moe_experts_path(ctx, 64, 1020, 512, 64 * 16, MTRL_BF16), MTRL_MOE_LANES);
    mtrl_cuda_ctx_set_tf32(ctx, 1);
    TEST_EQ_INT(mtrl_moe_experts_path(ctx, 64, 1024, 512, 64 * 16, MTRL_F32), MTRL_MOE_GROUPED);
    // by one expert's mean GEMM work (measured crossover, moe/experts_mma.cu): small's 1024 rows
    // grouped, 1024 rows of 2048 -> 1024 and 8192 rows of small's on the lanes
    TEST_EQ_INT(mtrl_moe_experts_path(ctx, 64, 1024, 512, 64 * 1024, MTRL_BF16), MTRL_MOE_GROUPED);
    TEST_EQ_INT(mtrl_moe_experts_path(ctx, 64, 2048, 1024, 64 * 1024, MTRL_BF16), MTRL_MOE_LANES);
    TEST_EQ_INT(mtrl_moe_experts_path(ctx, 64, 1024, 512, 64 * 8192, MTRL_F32), MTRL_MOE_LANES);
    mtrl_cuda_ctx_set_tf32(ctx, 0);
}

static void test_qb(mtrl_cuda_ctx *ctx, int N, int E, int K, int with_old) {
    printf("QB N=%d E=%d K=%d%s\n", N, E, K, with_old ? " (warm start)" : "");
    double *z = tu_alloc((size_t)N * E), *bold = tu_alloc(E), *bnew = tu_alloc(E), *got = tu_alloc(E);
    fill_quant(z, (size_t)N * E, 1.0);
    for (int t = 0; t < N; t++)  // skewed router: expert e gets + 3 (2e/(E-1) - 1)
        for (int e = 0; e < E; e++) z[(size_t)t * E + e] += round(3.0 * (2.0 * e / (E - 1) - 1.0) * 256) / 256;
    fill_quant(bold, E, 0.5);
    int rr = mtrl_ref_qb_beta_from_batch(N, E, K, z, with_old ? bold : NULL, bnew);
    float *d_z = tu_dev_f32(z, (size_t)N * E), *d_old = tu_dev_f32(bold, E), *d_new = tu_dev_nan(ctx, E);
    int rg = mtrl_qb_beta_from_batch(ctx, N, E, K, d_z, with_old ? d_old : NULL, d_new);
    mtrl_cuda_sync(ctx);
    TEST_EQ_INT(rg, rr);
    tu_get_f32(got, d_new, E);
    TU_CHECK_REL("QB beta (exact)", got, bnew, E, 0.0);
    mtrl_cuda_free(d_z); mtrl_cuda_free(d_old); mtrl_cuda_free(d_new);
    free(z); free(bold); free(bnew); free(got);
}

int main(void) {
    if (mtrl_cuda_device_count() <= 0) test_skip("no CUDA device");
    mtrl_cuda_ctx *ctx = mtrl_cuda_ctx_create(0, NULL);
    tu_seed(11);
    test_router(ctx, 1000, 64, 6, 0, 1);
    test_router(ctx, 777, 256, 8, 1, 1);
    test_router(ctx, 500, 20, 3, 0, 0);
    test_block(ctx, 300, 16, 4, 64, 48, MTRL_F32, 0);
    test_block(ctx, 300, 16, 4, 64, 48, MTRL_BF16, 0);
    test_block(ctx, 2500, 8, 1, 32, 16, MTRL_F32, 1);
    test_block(ctx, 2500, 8, 1, 32, 16, MTRL_BF16, 1);
    test_grouped_all(ctx);
    test_qb(ctx, 2048, 32, 4, 1);
    test_qb(ctx, 4096, 64, 8, 0);
    test_qb(ctx, 3, 64, 8, 1);   // tiny batch: skipped (returns 1, beta copied)
    test_qb(ctx, 100, 8, 8, 1);  // K >= E: skipped
    mtrl_cuda_ctx_destroy(ctx);
    return test_report();
}
