// cuda_testutil.h: host helpers shared by tests/test_cuda_*.cu (the kernel lab, not part of the
// library):
// random inputs, fp64 <-> device fp32/bf16 transfers, and the relative-error check of the
// numerics standard (‖out − ref‖ / ‖ref‖ against the fp64 CPU reference, NaN never passes).
// Include after tests/testhelp.h.
#ifndef MTRL_CUDA_TESTUTIL_H
#define MTRL_CUDA_TESTUTIL_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/kernels_cuda.h"

// ---- random numbers (splitmix64) ------------------------------------------------------------
static uint64_t tu_state_ = 0x9e3779b97f4a7c15ull;
static inline void tu_seed(uint64_t s) { tu_state_ = s * 0x9e3779b97f4a7c15ull + 1; }
static inline uint64_t tu_next(void) {
    uint64_t z = (tu_state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static inline double tu_unif(void) { return (double)(tu_next() >> 11) * (1.0 / 9007199254740992.0); }
static inline double tu_normal(void) {
    double u = tu_unif(), v = tu_unif();
    if (u < 1e-300) u = 1e-300;
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}
// Fills with N(0, sd²) values rounded to fp32 (so the GPU and the reference see the same inputs).
static inline void tu_fill_normal(double *x, size_t n, double sd) {
    for (size_t i = 0; i < n; i++) x[i] = (double)(float)(sd * tu_normal());
}
static inline void tu_fill_unif(double *x, size_t n, double lo, double hi) {
    for (size_t i = 0; i < n; i++) x[i] = (double)(float)(lo + (hi - lo) * tu_unif());
}
// Rounds to bf16 (nearest even) and back, in place: the reference then sees the GPU's inputs.
static inline double tu_bf16_round(double x) {
    float f = (float)x;
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return (double)f;
}
static inline uint16_t tu_bf16_bits(double x) {
    float f = (float)tu_bf16_round(x);
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

static inline double *tu_alloc(size_t n) {
    double *p = (double *)calloc(n ? n : 1, sizeof(double));
    if (!p) abort();
    return p;
}

// n random piece lengths in [1, max], the 8th empty (the varlen tests' mixed packs).
static inline void tu_vl_mix(int n, int max, int *len) {
    for (int i = 0; i < n; i++) len[i] = 1 + (int)(tu_unif() * max) % max;
    if (n > 7) len[7] = 0;
}

// ---- transfers ------------------------------------------------------------------------------
static inline float *tu_dev_f32(const double *h, size_t n) {
    float *t = (float *)malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) t[i] = (float)h[i];
    float *d = (float *)mtrl_cuda_malloc((n ? n : 1) * sizeof(float));
    mtrl_cuda_upload(d, t, n * sizeof(float));
    free(t);
    return d;
}
static inline mtrl_bf16 *tu_dev_bf16(const double *h, size_t n) {
    uint16_t *t = (uint16_t *)malloc((n ? n : 1) * sizeof(uint16_t));
    for (size_t i = 0; i < n; i++) t[i] = tu_bf16_bits(h[i]);
    mtrl_bf16 *d = (mtrl_bf16 *)mtrl_cuda_malloc((n ? n : 1) * sizeof(uint16_t));
    mtrl_cuda_upload(d, t, n * sizeof(uint16_t));
    free(t);
    return d;
}
static inline int *tu_dev_i32(const int *h, size_t n) {
    int *d = (int *)mtrl_cuda_malloc((n ? n : 1) * sizeof(int));
    mtrl_cuda_upload(d, h, n * sizeof(int));
    return d;
}
// A device fp32 buffer of n elements poisoned with NaN (so unwritten outputs show).
static inline float *tu_dev_nan(mtrl_cuda_ctx *ctx, size_t n) {
    float *d = (float *)mtrl_cuda_malloc((n ? n : 1) * sizeof(float));
    mtrl_cuda_fill_f32(ctx, n ? n : 1, NAN, d);
    return d;
}
static inline void tu_get_f32(double *h, const float *d, size_t n) {
    float *t = (float *)malloc((n ? n : 1) * sizeof(float));
    mtrl_cuda_download(t, d, n * sizeof(float));
    for (size_t i = 0; i < n; i++) h[i] = t[i];
    free(t);
}

// ---- checks ---------------------------------------------------------------------------------
// Do two device fp32 arrays of n elements hold the same bits?
static inline int tu_same_f32(const float *d_a, const float *d_b, size_t n) {
    float *a = (float *)malloc((n ? n : 1) * sizeof(float)), *b = (float *)malloc((n ? n : 1) * sizeof(float));
    mtrl_cuda_download(a, d_a, n * sizeof(float));
    mtrl_cuda_download(b, d_b, n * sizeof(float));
    int same = memcmp(a, b, n * sizeof(float)) == 0;
    free(a);
    free(b);
    return same;
}
// Prints "what: same bits" or FAIL and records the check (the varlen ops against their per-piece calls).
#define TU_SAME(what, a, b, n)                                                        \
    do {                                                                              \
        int s_ = tu_same_f32((a), (b), (n));                                          \
        printf("  %-44s %s\n", (what), s_ ? "same bits" : "FAIL (bits differ)");     \
        TEST_CHECKF(s_, "%s: varlen and per-piece results differ", (what));           \
    } while (0)

// ‖got − ref‖ / ‖ref‖ (NaN anywhere gives NaN); an all-zero reference uses the absolute norm.
static inline double tu_relerr(const double *got, const double *ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = got[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
        if (got[i] != got[i]) return NAN;
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}
// Prints one line per comparison ("what: rel err E (tol T) ok|FAIL") and records the check.
#define TU_CHECK_REL(what, got, ref, n, tol)                                                \
    do {                                                                                    \
        double e_ = tu_relerr((got), (ref), (size_t)(n));                                   \
        int ok_ = e_ <= (tol);                                                              \
        printf("  %-44s rel err %.3e (tol %.0e) %s\n", (what), e_, (double)(tol),          \
               ok_ ? "ok" : "FAIL");                                                        \
        TEST_CHECKF(ok_, "%s: relative error %.3e > %.1e", (what), e_, (double)(tol));     \
    } while (0)

#endif
