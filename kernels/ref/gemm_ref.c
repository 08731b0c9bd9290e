// gemm_ref.c: plain row-major GEMM for the CPU reference (see gemm_ref.h).
//
// Accumulation: in the fp64 build everything is double. In the fp32 build a dot product keeps
// 8 float partial sums (a fixed order, so the compiler can put them in one vector register)
// that are added in double at the end, and a streamed row of C accumulates in float. Every
// element of C is computed the same way whatever M is, so a row's result does not depend on
// the other rows of the batch (the actor's batched decode relies on that).
#include "gemm_ref.h"
#include "par_ref.h"

#include <stddef.h>
#include <stdlib.h>

#if REAL_IS_F64
typedef double acc_t;
#else
typedef float acc_t;
#endif

#define LANES 8

// The hot loops are compiled twice, for AVX2+FMA machines and for any x86-64, and picked at load
// time (GCC/clang function multi-versioning); other targets get the plain version.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define HOT_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define HOT_CLONES
#endif

static inline double dot_(const real *a, const real *b, int K) {
    acc_t s[LANES] = {0};
    int k = 0;
    for (; k + LANES <= K; k += LANES)
        for (int l = 0; l < LANES; l++) s[l] += (acc_t)a[k + l] * (acc_t)b[k + l];
    double t = 0.0;
    for (int l = 0; l < LANES; l++) t += (double)s[l];
    for (; k < K; k++) t += (double)a[k] * (double)b[k];
    return t;
}

// Four dot products of a with rows b, b + ldb, b + 2 ldb, b + 3 ldb into out[0..4): each element
// summed exactly as dot_ does (lane l holds k ≡ l mod LANES, lanes added in order in double),
// in four independent vector chains so that every load of a serves four columns.
typedef real lanes_t __attribute__((vector_size(sizeof(real) * LANES), aligned(sizeof(real))));
static inline __attribute__((unused)) void dot4_(const real *a, const real *b, int ldb, int K, double *out) {
    const real *b0 = b, *b1 = b + ldb, *b2 = b1 + ldb, *b3 = b2 + ldb;
    lanes_t s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    int k = 0;
    for (; k + LANES <= K; k += LANES) {
        lanes_t x = *(const lanes_t *)(a + k);
        s0 += x * *(const lanes_t *)(b0 + k);
        s1 += x * *(const lanes_t *)(b1 + k);
        s2 += x * *(const lanes_t *)(b2 + k);
        s3 += x * *(const lanes_t *)(b3 + k);
    }
    double t0 = 0.0, t1 = 0.0, t2 = 0.0, t3 = 0.0;
    for (int l = 0; l < LANES; l++) {
        t0 += (double)s0[l];
        t1 += (double)s1[l];
        t2 += (double)s2[l];
        t3 += (double)s3[l];
    }
    for (; k < K; k++) {
        t0 += (double)a[k] * (double)b0[k];
        t1 += (double)a[k] * (double)b1[k];
        t2 += (double)a[k] * (double)b2[k];
        t3 += (double)a[k] * (double)b3[k];
    }
    out[0] = t0, out[1] = t1, out[2] = t2, out[3] = t3;
}

// One row of C: acc[0..N) = op(A)[i,:] · op(B). The NN and TN forms stream rows of B so the
// inner loop is contiguous and vectorises; NT is a contiguous dot product per element.
HOT_CLONES static void gemm_row_(int trans_a, int trans_b, int i, int N, int K, const real *A, int lda, const real *B, int ldb,
                      acc_t *acc, double *out) {
    if (!trans_b) {
        for (int j = 0; j < N; j++) acc[j] = 0;
        for (int k = 0; k < K; k++) {
            acc_t a = trans_a ? (acc_t)A[(size_t)k * lda + i] : (acc_t)A[(size_t)i * lda + k];
            if (a == 0) continue;
            const real *b = B + (size_t)k * ldb;
            for (int j = 0; j < N; j++) acc[j] += a * (acc_t)b[j];
        }
        for (int j = 0; j < N; j++) out[j] = (double)acc[j];
    } else if (!trans_a) {
        const real *a = A + (size_t)i * lda;
        int j = 0;
#if !REAL_IS_F64 // (eight doubles a vector measured slower than dot_ on AVX2; fp64 is the test build)
        for (; j + 4 <= N; j += 4) dot4_(a, B + (size_t)j * ldb, ldb, K, out + j);
#endif
        for (; j < N; j++) out[j] = dot_(a, B + (size_t)j * ldb, K);
    } else {
        for (int j = 0; j < N; j++) {
            double s = 0.0;
            for (int k = 0; k < K; k++) s += (double)A[(size_t)k * lda + i] * (double)B[(size_t)j * ldb + k];
            out[j] = s;
        }
    }
}

// Rows [i0, i1) of C, with this caller's own row scratch.
static void gemm_rows_(int trans_a, int trans_b, int i0, int i1, int N, int K, real alpha, const real *A, int lda,
                       const real *B, int ldb, real beta, real *C, int ldc) {
    acc_t stack_acc[512];
    double stack_out[512];
    acc_t *acc = N <= 512 ? stack_acc : malloc(sizeof(acc_t) * (size_t)N);
    double *out = N <= 512 ? stack_out : malloc(sizeof(double) * (size_t)N);
    for (int i = i0; i < i1; i++) {
        real *c = C + (size_t)i * ldc;
        gemm_row_(trans_a, trans_b, i, N, K, A, lda, B, ldb, acc, out);
        for (int j = 0; j < N; j++) {
            double prev = beta == 0 ? 0.0 : (double)beta * (double)c[j];
            c[j] = (real)((double)alpha * out[j] + prev);
        }
    }
    if (acc != stack_acc) free(acc);
    if (out != stack_out) free(out);
}

void mtrl_ref_gemm(int trans_a, int trans_b, int M, int N, int K, real alpha, const real *A, int lda,
              const real *B, int ldb, real beta, real *C, int ldc) {
    if (M <= 0 || N <= 0) return;
    // Rows split over the team only for enough work (par_ref.h): the small tile products of
    // attention and KDA run inside their callers' parallel loops, a decode step's projections
    // serially.
    REF_PAR_RANGES(M > 1 && ref_par(2.0 * M * N * (K > 0 ? K : 1)), M, lo, hi,
                   gemm_rows_(trans_a, trans_b, (int)lo, (int)hi, N, K, alpha, A, lda, B, ldb, beta, C, ldc));
}
