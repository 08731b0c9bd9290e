// gemm_ref.c: plain row-major GEMM for the CPU reference (see gemm_ref.h).
#include "gemm_ref.h"

#include <stddef.h>
#include <stdlib.h>

// One row of C: acc[0..N) = op(A)[i,:] · op(B). The NN and TN forms stream rows of B so the
// inner loop is contiguous and vectorises; NT is a contiguous dot product per element.
static void gemm_row_(int trans_a, int trans_b, int i, int N, int K, const real *A, int lda,
                      const real *B, int ldb, double *acc) {
    for (int j = 0; j < N; j++) acc[j] = 0.0;
    if (!trans_b) {
        for (int k = 0; k < K; k++) {
            double a = trans_a ? A[(size_t)k * lda + i] : A[(size_t)i * lda + k];
            if (a == 0.0) continue;
            const real *b = B + (size_t)k * ldb;
            for (int j = 0; j < N; j++) acc[j] += a * (double)b[j];
        }
    } else if (!trans_a) {
        const real *a = A + (size_t)i * lda;
        for (int j = 0; j < N; j++) {
            const real *b = B + (size_t)j * ldb;
            double s = 0.0;
            for (int k = 0; k < K; k++) s += (double)a[k] * (double)b[k];
            acc[j] = s;
        }
    } else {
        for (int j = 0; j < N; j++) {
            double s = 0.0;
            for (int k = 0; k < K; k++) s += (double)A[(size_t)k * lda + i] * (double)B[(size_t)j * ldb + k];
            acc[j] = s;
        }
    }
}

void gemm_ref(int trans_a, int trans_b, int M, int N, int K, real alpha, const real *A, int lda,
              const real *B, int ldb, real beta, real *C, int ldc) {
    if (M <= 0 || N <= 0) return;
    // Parallelise only when there is enough work; small tile products (16x16 KDA tiles) are
    // called from inside already-parallel loops and must not spawn nested teams.
    long long work = (long long)M * N * (K > 0 ? K : 1);
    #pragma omp parallel if (work > (1 << 17))
    {
        double stack_acc[512];
        double *acc = N <= 512 ? stack_acc : malloc(sizeof(double) * (size_t)N);
        #pragma omp for schedule(static)
        for (int i = 0; i < M; i++) {
            real *c = C + (size_t)i * ldc;
            gemm_row_(trans_a, trans_b, i, N, K, A, lda, B, ldb, acc);
            for (int j = 0; j < N; j++) {
                double prev = beta == 0 ? 0.0 : (double)beta * (double)c[j];
                c[j] = (real)((double)alpha * acc[j] + prev);
            }
        }
        if (acc != stack_acc) free(acc);
    }
}
