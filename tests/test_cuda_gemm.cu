// mtrl-test: gpu f64
// test_cuda_gemm.cu: the cuBLAS GEMM launchers against mtrl_ref_gemm (fp64): every transpose
// combination, strides larger than the width, beta = 0 (over NaN-poisoned C) and beta = 1,
// strided batches, and the linear-layer forward / backward products.
// Tolerances: fp32 operands ‖C − ref‖/‖ref‖ ≤ 1e-5 (true fp32, no TF32); bf16 operands
// (rounding of the inputs included) ≤ 1e-2.
#include "tests/testhelp.h"
#include "kernels/lab/cuda_testutil.h"
#include "kernels/ref/gemm_ref.h"

static void one(mtrl_cuda_ctx *ctx, int ta, int tb, int M, int N, int K, int type, double beta) {
    int ra = ta ? K : M, ca = ta ? M : K, rb = tb ? N : K, cb = tb ? K : N;
    int lda = ca + 3, ldb = cb + 1, ldc = N + 2;
    size_t na = (size_t)ra * lda, nb = (size_t)rb * ldb, nc = (size_t)M * ldc;
    double *A = tu_alloc(na), *B = tu_alloc(nb), *C = tu_alloc(nc), *got = tu_alloc(nc);
    tu_fill_normal(A, na, 1.0);
    tu_fill_normal(B, nb, 1.0);
    tu_fill_normal(C, nc, 1.0);
    void *dA = type == MTRL_BF16 ? (void *)tu_dev_bf16(A, na) : (void *)tu_dev_f32(A, na);
    void *dB = type == MTRL_BF16 ? (void *)tu_dev_bf16(B, nb) : (void *)tu_dev_f32(B, nb);
    float *dC = beta == 0 ? tu_dev_nan(ctx, nc) : tu_dev_f32(C, nc);
    TEST_EQ_INT(mtrl_gemm(ctx, ta, tb, M, N, K, 1.5f, dA, lda, dB, ldb, type, (float)beta, dC,
                          ldc, MTRL_F32), 0);
    mtrl_cuda_sync(ctx);
    mtrl_ref_gemm(ta, tb, M, N, K, 1.5, A, lda, B, ldb, beta, C, ldc);
    tu_get_f32(got, dC, nc);
    // compare only the M x N window (the padding columns are not written)
    double *g2 = tu_alloc((size_t)M * N), *r2 = tu_alloc((size_t)M * N);
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            g2[(size_t)i * N + j] = got[(size_t)i * ldc + j];
            r2[(size_t)i * N + j] = C[(size_t)i * ldc + j];
        }
    char what[128];
    snprintf(what, sizeof what, "gemm %s ta=%d tb=%d %dx%dx%d beta=%g", type ? "bf16" : "f32",
             ta, tb, M, N, K, beta);
    TU_CHECK_REL(what, g2, r2, (size_t)M * N, type == MTRL_BF16 ? 1e-2 : 1e-5);
    mtrl_cuda_free(dA); mtrl_cuda_free(dB); mtrl_cuda_free(dC);
    free(A); free(B); free(C); free(got); free(g2); free(r2);
}

static void linear(mtrl_cuda_ctx *ctx, int T, int n, int k, int type) {
    double *x = tu_alloc((size_t)T * k), *W = tu_alloc((size_t)n * k), *dy = tu_alloc((size_t)T * n);
    double *y = tu_alloc((size_t)T * n), *dx = tu_alloc((size_t)T * k), *dW = tu_alloc((size_t)n * k);
    double *got = tu_alloc((size_t)T * (n > k ? n : k) + (size_t)n * k);
    tu_fill_normal(x, (size_t)T * k, 1.0);
    tu_fill_normal(W, (size_t)n * k, 0.1);
    tu_fill_normal(dy, (size_t)T * n, 1.0);
    tu_fill_normal(dx, (size_t)T * k, 1.0);  // accumulated onto
    tu_fill_normal(dW, (size_t)n * k, 1.0);
    int bf = type == MTRL_BF16;
    void *d_x = bf ? (void *)tu_dev_bf16(x, (size_t)T * k) : (void *)tu_dev_f32(x, (size_t)T * k);
    void *d_W = bf ? (void *)tu_dev_bf16(W, (size_t)n * k) : (void *)tu_dev_f32(W, (size_t)n * k);
    void *d_dy = bf ? (void *)tu_dev_bf16(dy, (size_t)T * n) : (void *)tu_dev_f32(dy, (size_t)T * n);
    float *d_y = tu_dev_nan(ctx, (size_t)T * n), *d_dx = tu_dev_f32(dx, (size_t)T * k),
          *d_dW = tu_dev_f32(dW, (size_t)n * k);
    TEST_EQ_INT(mtrl_linear_fwd(ctx, T, n, k, d_x, d_W, type, 0.f, d_y), 0);
    TEST_EQ_INT(mtrl_linear_bwd_dx(ctx, T, n, k, d_dy, d_W, type, 1.f, d_dx), 0);
    TEST_EQ_INT(mtrl_linear_bwd_dw(ctx, T, n, k, d_dy, d_x, type, 1.f, d_dW), 0);
    mtrl_cuda_sync(ctx);
    mtrl_ref_gemm(0, 1, T, n, k, 1, x, k, W, k, 0, y, n);
    mtrl_ref_gemm(0, 0, T, k, n, 1, dy, n, W, k, 1, dx, k);
    mtrl_ref_gemm(1, 0, n, k, T, 1, dy, n, x, k, 1, dW, k);
    double tol = bf ? 1e-2 : 1e-5;
    char what[128];
    tu_get_f32(got, d_y, (size_t)T * n);
    snprintf(what, sizeof what, "linear %s fwd %dx%d<-%d", bf ? "bf16" : "f32", T, n, k);
    TU_CHECK_REL(what, got, y, (size_t)T * n, tol);
    tu_get_f32(got, d_dx, (size_t)T * k);
    snprintf(what, sizeof what, "linear %s dx (+=)", bf ? "bf16" : "f32");
    TU_CHECK_REL(what, got, dx, (size_t)T * k, tol);
    tu_get_f32(got, d_dW, (size_t)n * k);
    snprintf(what, sizeof what, "linear %s dW (+=)", bf ? "bf16" : "f32");
    TU_CHECK_REL(what, got, dW, (size_t)n * k, tol);
    mtrl_cuda_free(d_x); mtrl_cuda_free(d_W); mtrl_cuda_free(d_dy);
    mtrl_cuda_free(d_y); mtrl_cuda_free(d_dx); mtrl_cuda_free(d_dW);
    free(x); free(W); free(dy); free(y); free(dx); free(dW); free(got);
}

static void batched(mtrl_cuda_ctx *ctx, int type) {
    int M = 33, N = 20, K = 47, nbatch = 5;
    long long sA = (long long)M * K + 7, sB = (long long)N * K + 5, sC = (long long)M * N + 3;
    double *A = tu_alloc(sA * nbatch), *B = tu_alloc(sB * nbatch), *C = tu_alloc(sC * nbatch),
           *got = tu_alloc(sC * nbatch);
    tu_fill_normal(A, sA * nbatch, 1.0);
    tu_fill_normal(B, sB * nbatch, 1.0);
    int bf = type == MTRL_BF16;
    void *dA = bf ? (void *)tu_dev_bf16(A, sA * nbatch) : (void *)tu_dev_f32(A, sA * nbatch);
    void *dB = bf ? (void *)tu_dev_bf16(B, sB * nbatch) : (void *)tu_dev_f32(B, sB * nbatch);
    float *dC = tu_dev_nan(ctx, sC * nbatch);
    // C_b = A_b (M x K) * B_bᵀ (B_b stored N x K)
    TEST_EQ_INT(mtrl_gemm_batched(ctx, 0, 1, M, N, K, 1.f, dA, K, sA, dB, K, sB, type, 0.f, dC,
                                  N, sC, MTRL_F32, nbatch), 0);
    mtrl_cuda_sync(ctx);
    tu_get_f32(got, dC, sC * nbatch);
    double *g2 = tu_alloc((size_t)M * N * nbatch), *r2 = tu_alloc((size_t)M * N * nbatch);
    for (int b = 0; b < nbatch; b++) {
        mtrl_ref_gemm(0, 1, M, N, K, 1, A + b * sA, K, B + b * sB, K, 0, C + b * sC, N);
        memcpy(g2 + (size_t)b * M * N, got + b * sC, sizeof(double) * M * N);
        memcpy(r2 + (size_t)b * M * N, C + b * sC, sizeof(double) * M * N);
    }
    TU_CHECK_REL(bf ? "gemm_batched bf16" : "gemm_batched f32", g2, r2, (size_t)M * N * nbatch,
                 bf ? 1e-2 : 1e-5);
    mtrl_cuda_free(dA); mtrl_cuda_free(dB); mtrl_cuda_free(dC);
    free(A); free(B); free(C); free(got); free(g2); free(r2);
}

int main(void) {
    if (mtrl_cuda_device_count() <= 0) test_skip("no CUDA device");
    mtrl_cuda_ctx *ctx = mtrl_cuda_ctx_create(0, NULL);
    tu_seed(7);
    for (int type = 0; type < 2; type++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                one(ctx, ta, tb, 37, 51, 129, type, 0.0);
                one(ctx, ta, tb, 64, 40, 33, type, 1.0);
            }
    linear(ctx, 300, 96, 80, MTRL_F32);
    linear(ctx, 300, 96, 80, MTRL_BF16);
    batched(ctx, MTRL_F32);
    batched(ctx, MTRL_BF16);
    // bf16 output
    {
        int M = 40, N = 24, K = 64;
        double *A = tu_alloc((size_t)M * K), *B = tu_alloc((size_t)K * N), *C = tu_alloc((size_t)M * N);
        tu_fill_normal(A, (size_t)M * K, 1.0);
        tu_fill_normal(B, (size_t)K * N, 1.0);
        mtrl_bf16 *dA = tu_dev_bf16(A, (size_t)M * K), *dB = tu_dev_bf16(B, (size_t)K * N);
        mtrl_bf16 *dC = (mtrl_bf16 *)mtrl_cuda_malloc(sizeof(uint16_t) * M * N);
        float *dCf = tu_dev_nan(ctx, (size_t)M * N);
        TEST_EQ_INT(mtrl_gemm(ctx, 0, 0, M, N, K, 1.f, dA, K, dB, N, MTRL_BF16, 0.f, dC, N,
                              MTRL_BF16), 0);
        mtrl_cuda_bf16_to_f32(ctx, (size_t)M * N, dC, dCf);
        mtrl_cuda_sync(ctx);
        mtrl_ref_gemm(0, 0, M, N, K, 1, A, K, B, N, 0, C, N);
        double *got = tu_alloc((size_t)M * N);
        tu_get_f32(got, dCf, (size_t)M * N);
        TU_CHECK_REL("gemm bf16 in, bf16 out", got, C, (size_t)M * N, 1e-2);
        mtrl_cuda_free(dA); mtrl_cuda_free(dB); mtrl_cuda_free(dC); mtrl_cuda_free(dCf);
        free(A); free(B); free(C); free(got);
    }
    TEST_EQ_INT(mtrl_gemm(ctx, 0, 0, 4, 4, 4, 1.f, NULL, 4, NULL, 4, MTRL_F32, 0.f, NULL, 4,
                          MTRL_BF16), -1);  // fp32 operands with a bf16 C: refused
    mtrl_cuda_ctx_destroy(ctx);
    return test_report();
}
