// gemm_ref.h: the one dense matrix product of the CPU reference.
//
// Row-major: C[M,N] = alpha * op(A)[M,K] · op(B)[K,N] + beta * C, where op(X) = X or Xᵀ.
// lda/ldb/ldc are the row strides of A, B, C as stored. beta = 0 overwrites C (NaN in C is
// not propagated). Accumulates in double so the fp32 build matches the fp64 build closely.
// Parallel over rows of C with OpenMP when the product is large enough to pay for it.
#ifndef MTRL_GEMM_REF_H
#define MTRL_GEMM_REF_H

#include "real.h"

#ifdef __cplusplus
extern "C" {
#endif

void mtrl_ref_gemm(int trans_a, int trans_b, int M, int N, int K, real alpha, const real *A, int lda,
              const real *B, int ldb, real beta, real *C, int ldc);

#ifdef __cplusplus
}
#endif

#endif
