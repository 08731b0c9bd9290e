// mtrl-test: gpu f64 timeout=900
// test_cuda_moe_wgmma.cu: the grouped experts' row GEMMs on Hopper's warpgroup MMA (wgmma + TMA,
// moe/sm90a/experts_wgmma.cu, forced through the option moe = wgmma: the forward, the single
// grouped GEMM, the backward's dm with the SwiGLU backward and dX) against an fp64 CPU reference,
// and the chooser's answers. Skips without a device, and on a device that is not
// compute capability 9.0 (the kernels are sm_90a code).
//
// Inputs are rounded to bf16 on the host first, so the reference multiplies the operands the GPU
// does: u1 = X W1ᵀ, u3 = X W3ᵀ differ only by fp32 accumulation (tolerance 1e-4, relative L2);
// the reference rounds m = SiLU(u1) u3 to bf16 as the kernel does, so Y = m W2ᵀ differs by that
// accumulation and the rare m that fp32 and fp64 round to neighbouring bf16 values (1e-3); dX
// likewise (the reference rounds dY, du1 and du3 to bf16 as the launcher and the kernel do: 1e-3). Every
// output starts NaN (each row must be written, none past its expert's end), and besides the error
// over all rows each expert's own error must pass (a 1-row expert beside a 9000-row one).
// Cases: empty experts, 1 row, tile edges (127 / 128 / 129 rows), ragged widths (K and N not
// multiples of the 64-wide k-slice or the 128 / 256-wide n-tiles), K < 64, skewed routing, every
// row on one expert, decode-like 0 .. 12 rows, one expert, and 16, 128, 1024, 8192 rows per
// expert balanced. Also: the same bits on a second run, and the single grouped GEMM, whose bf16
// output form (mtrl_moe_grouped_gemm_bf16) must be its fp32 output rounded to nearest even, bit
// for bit, with every row written (the buffer starts as bf16 NaNs).
#include "tests/testhelp.h"
#include "kernels/lab/cuda_testutil.h"
#include "kernels/ref/gemm_ref.h"
#include "common/bf16.h"

static double silu_(double x) { return x / (1.0 + exp(-x)); }

// The relative L2 error of each expert's rows (width W), and the largest.
static double worst_expert_(const double *got, const double *ref, const int *off, int E, int W, int *which) {
    double worst = 0.0;
    *which = -1;
    for (int e = 0; e < E; e++) {
        size_t n = (size_t)(off[e + 1] - off[e]) * W;
        if (!n) continue;
        double r = tu_relerr(got + (size_t)off[e] * W, ref + (size_t)off[e] * W, n);
        if (!(r <= worst)) {  // NaN counts as the worst
            worst = r;
            *which = e;
        }
    }
    return worst;
}

static void check_(const char *what, const double *got, const double *ref, const int *off, int E, int W,
                   double tol) {
    size_t R = (size_t)off[E];
    TU_CHECK_REL(what, got, ref, R * W, tol);
    int e;
    double w = worst_expert_(got, ref, off, E, W, &e);
    printf("  %-44s worst expert %d: rel err %.3e\n", "", e, w);
    TEST_CHECKF(w <= tol, "%s: expert %d's relative error %.3e > %.1e", what, e, w, tol);
}

static void case_(mtrl_cuda_ctx *ctx, int E, int D, int I, const int *rows, const char *what) {
    int *off = (int *)malloc(sizeof(int) * (E + 1));
    off[0] = 0;
    int empty = 0, most = 0;
    for (int e = 0; e < E; e++) {
        off[e + 1] = off[e] + rows[e];
        empty += rows[e] == 0;
        if (rows[e] > rows[most]) most = e;
    }
    const size_t R = (size_t)off[E], nw = (size_t)E * I * D;
    printf("wgmma experts fwd E=%d D=%d I=%d R=%zu (%s; %d empty, largest expert %d rows)\n", E, D, I, R, what, empty,
           rows[most]);
    double *X = tu_alloc(R * D), *W1 = tu_alloc(nw), *W3 = tu_alloc(nw), *W2 = tu_alloc(nw);
    tu_fill_normal(X, R * D, 1.0);
    tu_fill_normal(W1, nw, 1.0 / sqrt((double)D));
    tu_fill_normal(W3, nw, 1.0 / sqrt((double)D));
    tu_fill_normal(W2, nw, 1.0 / sqrt((double)I));
    double *ps[4] = {X, W1, W3, W2};
    size_t ns[4] = {R * D, nw, nw, nw};
    for (int k = 0; k < 4; k++)
        for (size_t i = 0; i < ns[k]; i++) ps[k][i] = tu_bf16_round(ps[k][i]);
    double *dY = tu_alloc(R * D);  // the backward's input; the launcher rounds it to bf16
    tu_fill_normal(dY, R * D, 1.0);
    for (size_t i = 0; i < R * D; i++) dY[i] = tu_bf16_round(dY[i]);
    double *u1 = tu_alloc(R * I), *u3 = tu_alloc(R * I), *m = tu_alloc(R * I), *Y = tu_alloc(R * D);
    double *dm = tu_alloc(R * I), *du1 = tu_alloc(R * I), *du3 = tu_alloc(R * I), *dX = tu_alloc(R * D);
    for (int e = 0; e < E; e++) {
        const int r0 = off[e], n = rows[e];
        if (!n) continue;
        const double *Xe = X + (size_t)r0 * D, *dYe = dY + (size_t)r0 * D;
        const double *W1e = W1 + (size_t)e * I * D, *W3e = W3 + (size_t)e * I * D, *W2e = W2 + (size_t)e * D * I;
        mtrl_ref_gemm(0, 1, n, I, D, 1.0, Xe, D, W1e, D, 0.0, u1 + (size_t)r0 * I, I);
        mtrl_ref_gemm(0, 1, n, I, D, 1.0, Xe, D, W3e, D, 0.0, u3 + (size_t)r0 * I, I);
        for (size_t i = (size_t)r0 * I; i < (size_t)(r0 + n) * I; i++) m[i] = tu_bf16_round(silu_(u1[i]) * u3[i]);
        mtrl_ref_gemm(0, 1, n, D, I, 1.0, m + (size_t)r0 * I, I, W2e, I, 0.0, Y + (size_t)r0 * D, D);
        // backward: dm = dY W2[e]; du1, du3 rounded to bf16 as the kernel stores them; dX = du1 W1 + du3 W3
        mtrl_ref_gemm(0, 0, n, I, D, 1.0, dYe, D, W2e, I, 0.0, dm + (size_t)r0 * I, I);
        for (size_t i = (size_t)r0 * I; i < (size_t)(r0 + n) * I; i++) {
            double x = u1[i], sg = 1.0 / (1.0 + exp(-x));
            du3[i] = tu_bf16_round(dm[i] * x * sg);
            du1[i] = tu_bf16_round(dm[i] * u3[i] * sg * (1.0 + x * (1.0 - sg)));
        }
        mtrl_ref_gemm(0, 0, n, D, I, 1.0, du1 + (size_t)r0 * I, I, W1e, D, 0.0, dX + (size_t)r0 * D, D);
        mtrl_ref_gemm(0, 0, n, D, I, 1.0, du3 + (size_t)r0 * I, I, W3e, D, 1.0, dX + (size_t)r0 * D, D);
    }
    int *d_off = tu_dev_i32(off, E + 1);
    mtrl_bf16 *d_X = tu_dev_bf16(X, R * D), *d_W1 = tu_dev_bf16(W1, nw), *d_W3 = tu_dev_bf16(W3, nw),
              *d_W2 = tu_dev_bf16(W2, nw);
    float *d_u1 = tu_dev_nan(ctx, R * I), *d_u3 = tu_dev_nan(ctx, R * I), *d_Y = tu_dev_nan(ctx, R * D),
          *d_C = tu_dev_nan(ctx, R * I), *d_dY = tu_dev_f32(dY, R * D), *d_dX = tu_dev_nan(ctx, R * D);
    TEST_EQ_INT(mtrl_moe_grouped_kernel(ctx, E, (long)R, MTRL_BF16), MTRL_KOPT_WGMMA);
    TEST_EQ_INT(mtrl_moe_experts_grouped_fwd(ctx, E, D, I, (long)R, d_off, d_X, d_W1, d_W3, d_W2, MTRL_BF16, d_u1,
                                             d_u3, d_Y), 0);
    TEST_EQ_INT(mtrl_moe_grouped_gemm(ctx, E, (long)R, d_off, I, D, d_X, d_W3, MTRL_BF16, d_C), 0);
    // the backward's row GEMMs alone (no weight gradient asked for): dm with the SwiGLU backward, dX
    TEST_EQ_INT(mtrl_moe_experts_grouped_bwd(ctx, E, D, I, (long)R, d_off, d_X, d_W1, d_W3, d_W2, MTRL_BF16, d_u1,
                                             d_u3, d_dY, d_dX, NULL, NULL, NULL), 0);
    mtrl_cuda_sync(ctx);
    const size_t big = R * (size_t)(D > I ? D : I);
    double *got = tu_alloc(big);
    tu_get_f32(got, d_u1, R * I);
    check_("wgmma u1", got, u1, off, E, I, 1e-4);
    tu_get_f32(got, d_u3, R * I);
    check_("wgmma u3", got, u3, off, E, I, 1e-4);
    tu_get_f32(got, d_Y, R * D);
    check_("wgmma Y_perm", got, Y, off, E, D, 1e-3);
    tu_get_f32(got, d_C, R * I);
    check_("wgmma grouped GEMM X W3ᵀ", got, u3, off, E, I, 1e-4);
    tu_get_f32(got, d_dX, R * D);
    check_("wgmma bwd dX_perm", got, dX, off, E, D, 1e-3);
    {
        const size_t n = R * I ? R * I : 1;
        uint16_t *h = (uint16_t *)malloc(2 * n);
        float *cf = (float *)malloc(4 * n);
        memset(h, 0xff, 2 * n);
        void *d_Ch = mtrl_cuda_malloc(2 * n);
        mtrl_cuda_upload(d_Ch, h, 2 * n);
        TEST_EQ_INT(mtrl_moe_grouped_gemm_bf16(ctx, E, (long)R, d_off, I, D, d_X, d_W3, d_Ch), 0);
        mtrl_cuda_sync(ctx);
        mtrl_cuda_download(h, d_Ch, 2 * R * I);
        mtrl_cuda_download(cf, d_C, 4 * R * I);
        size_t bad = 0, first = 0;
        for (size_t i = 0; i < R * I; i++)
            if (h[i] != mtrl_bf16_from_f32(cf[i]) && !bad++) first = i;
        TEST_CHECKF(!bad, "wgmma grouped GEMM bf16 out: %zu of %zu values are not the fp32 output rounded (first at "
                          "row %zu column %zu: 0x%04x, want 0x%04x)",
                    bad, R * I, first / I, first % I, h[first], mtrl_bf16_from_f32(cf[first]));
        mtrl_cuda_free(d_Ch);
        free(h);
        free(cf);
    }
    // The same bits on a second run (each output summed by one thread in a fixed order).
    {
        size_t n = R * D ? R * D : 1;
        float *y1 = (float *)malloc(sizeof(float) * n), *y2 = (float *)malloc(sizeof(float) * n);
        mtrl_cuda_download(y1, d_Y, sizeof(float) * R * D);
        TEST_EQ_INT(mtrl_moe_experts_grouped_fwd(ctx, E, D, I, (long)R, d_off, d_X, d_W1, d_W3, d_W2, MTRL_BF16,
                                                 d_u1, d_u3, d_Y), 0);
        mtrl_cuda_sync(ctx);
        mtrl_cuda_download(y2, d_Y, sizeof(float) * R * D);
        TEST_CHECKF(!memcmp(y1, y2, sizeof(float) * R * D), "wgmma Y_perm: a second run gives other bits");
        free(y1);
        free(y2);
    }
    void *dp[] = {d_off, d_X, d_W1, d_W3, d_W2, d_u1, d_u3, d_Y, d_C, d_dY, d_dX};
    for (size_t i = 0; i < sizeof dp / sizeof *dp; i++) mtrl_cuda_free(dp[i]);
    double *hp[] = {X, W1, W3, W2, u1, u3, m, Y, got, dY, dm, du1, du3, dX};
    for (size_t i = 0; i < sizeof hp / sizeof *hp; i++) free(hp[i]);
    free(off);
}

static void cases_(mtrl_cuda_ctx *ctx) {
    // empty experts, one row, the 128-row tile's edges
    const int r8[8] = {0, 1, 127, 128, 129, 300, 0, 1000};
    case_(ctx, 8, 256, 128, r8, "empty, 1 row, tile edges");
    // ragged: K = 264 (a partial k-slice), N = 200 (FWD13's second n-tile partial), D = 264 (FWD2's)
    const int r12[12] = {0, 1, 15, 16, 17, 33, 100, 0, 9000, 130, 64, 2000};
    case_(ctx, 12, 264, 200, r12, "skewed, 0 .. 9000 rows, ragged widths");
    // K < 64 (one partial k-slice) in both products
    const int r3[3] = {5, 70, 0};
    case_(ctx, 3, 40, 48, r3, "K < 64");
    // decode-like: 64 experts of 0 .. 12 rows
    int r64[64];
    for (int e = 0; e < 64; e++) r64[e] = (int)(tu_next() % 13);
    r64[3] = r64[40] = 0;
    case_(ctx, 64, 128, 64, r64, "decode-like, 0 .. 12 rows");
    // every row on one expert
    int r16[16] = {0};
    r16[11] = 3000;
    case_(ctx, 16, 128, 256, r16, "every row on expert 11");
    // skewed as the benchmark: expert e gets ∝ e + 1 of 16 x 1024 rows
    int rs[16], s = 0;
    for (int e = 0; e < 16; e++) s += rs[e] = (int)(16.0 * 1024 * (e + 1) / (16 * 17 / 2.0));
    rs[15] += 16 * 1024 - s;
    case_(ctx, 16, 256, 128, rs, "skewed, e + 1");
    // one expert
    const int r1[1] = {777};
    case_(ctx, 1, 128, 128, r1, "one expert");
    // 16, 128, 1024, 8192 rows per expert, balanced
    const int per[4] = {16, 128, 1024, 8192};
    for (int i = 0; i < 4; i++) {
        int rb[4] = {per[i], per[i], per[i], per[i]};
        char what[48];
        snprintf(what, sizeof what, "%d rows per expert", per[i]);
        case_(ctx, 4, 256, 128, rb, what);
    }
}

// The chooser (option moe, kernel_opts.h): auto takes wgmma above 64 rows per expert on average
// for bf16 only, mma never, wgmma at any rows; the forward path follows it.
static void test_chooser(mtrl_cuda_ctx *ctx) {
    mtrl_kernel_opts *o = mtrl_cuda_ctx_opts(ctx);
    o->moe = MTRL_KOPT_AUTO;
    TEST_EQ_INT(mtrl_moe_grouped_kernel(ctx, 64, 64 * 16, MTRL_BF16), MTRL_KOPT_MMA);
    TEST_EQ_INT(mtrl_moe_grouped_kernel(ctx, 64, 64 * 64, MTRL_BF16), MTRL_KOPT_MMA);
    TEST_EQ_INT(mtrl_moe_grouped_kernel(ctx, 64, 64 * 65, MTRL_BF16), MTRL_KOPT_WGMMA);
    TEST_EQ_INT(mtrl_moe_grouped_kernel(ctx, 64, 64 * 8192, MTRL_BF16), MTRL_KOPT_WGMMA);
    TEST_EQ_INT(mtrl_moe_grouped_kernel(ctx, 64, 64 * 8192, MTRL_F32), MTRL_KOPT_MMA);
    TEST_EQ_INT(mtrl_moe_grouped_kernel(ctx, 2048, 2048 * 128, MTRL_BF16), MTRL_KOPT_MMA);  // > 1024 experts
    // the forward on wgmma outruns the lanes at every count it takes; the backward keeps its rule
    TEST_EQ_INT(mtrl_moe_experts_fwd_path(ctx, 64, 1024, 512, 64 * 8192, MTRL_BF16), MTRL_MOE_GROUPED);
    TEST_EQ_INT(mtrl_moe_experts_path(ctx, 64, 1024, 512, 64 * 8192, MTRL_BF16), MTRL_MOE_LANES);
    TEST_EQ_INT(mtrl_moe_experts_fwd_path(ctx, 1, 1024, 512, 8192, MTRL_BF16), MTRL_MOE_LANES);  // dense FFN
    TEST_EQ_INT(mtrl_moe_experts_fwd_path(ctx, 64, 1020, 512, 64 * 8192, MTRL_BF16), MTRL_MOE_LANES);
    o->moe = MTRL_KOPT_MMA;
    TEST_EQ_INT(mtrl_moe_grouped_kernel(ctx, 64, 64 * 8192, MTRL_BF16), MTRL_KOPT_MMA);
    TEST_EQ_INT(mtrl_moe_experts_fwd_path(ctx, 64, 1024, 512, 64 * 8192, MTRL_BF16), MTRL_MOE_LANES);
    o->moe = MTRL_KOPT_WGMMA;
    TEST_EQ_INT(mtrl_moe_grouped_kernel(ctx, 64, 64 * 2, MTRL_BF16), MTRL_KOPT_WGMMA);
    o->moe = MTRL_KOPT_AUTO;
}

int main(void) {
    if (mtrl_cuda_device_count() <= 0) test_skip("no CUDA device");
    mtrl_cuda_ctx *ctx = mtrl_cuda_ctx_create(0, NULL);
    mtrl_cuda_ctx_opts(ctx)->moe = MTRL_KOPT_WGMMA;
    if (mtrl_moe_grouped_kernel(ctx, 8, 1024, MTRL_BF16) != MTRL_KOPT_WGMMA) {
        mtrl_cuda_ctx_destroy(ctx);
        test_skip("not a compute capability 9.0 device: the wgmma kernels do not run here");
    }
    tu_seed(21);
    cases_(ctx);
    test_chooser(ctx);
    mtrl_cuda_ctx_destroy(ctx);
    return test_report();
}
