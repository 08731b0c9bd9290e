// kdaemu.h: what the CPU emulations of the tensor-core KDA kernels share (header-only):
// test_kda_v3_emu.c (the forward v3) and test_kda_v3_bwd_emu.c (the backward's state-gradient
// pass). The roundings the kernels apply, the kernel-level input cases and the relative errors
// they are measured with. K = V = 128, the only shape the v3 kernels take.
#ifndef MTRL_TESTS_KDAEMU_H
#define MTRL_TESTS_KDAEMU_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common/rng.h"

enum { KEMU_K = 128, KEMU_V = 128 };

// bf16(x): round to nearest even, as the GPU's conversions (finite x).
static inline float kemu_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&x, &u, 4);
    return x;
}
// e^x as the kernels form it (e2x: ex2.approx of the fp32 product x log2 e; the argument's
// rounding, up to 2.6e-6 relative at |x| = 40, is kept, the ~2 ulp of ex2.approx are not).
static inline float kemu_exp(float x) { return (float)exp2((double)(x * 1.4426950408889634f)); }
// a·b from hi / lo parts as the tensor cores form it (exact in double): one product when the lo
// parts are 0, the three of bf16x3 otherwise (a_lo b_lo, 2^-16 relative, dropped).
static inline double kemu_mul3(float ah, float al, float bh, float bl) {
    return (double)ah * bh + (double)ah * bl + (double)al * bh;
}

// The kernel-level cases: T tokens, H heads, the decay g random in (g_min, 0), at the bound
// g_min + 1e-3, or from the model's gate at initialisation (g_min = −5).
enum { KEMU_G_RANDOM, KEMU_G_BOUND, KEMU_G_MODEL };
typedef struct {
    int T, H, gk;
} kemu_case;

// Draw `*ctr` of the inputs' normal stream, then advance it.
static inline double kemu_normal(uint64_t *ctr) { return mtrl_rng_normal(11, 1, (*ctr)++); }

// q (L2-normalised and scaled by 1/√K), k (L2-normalised), v, g, β of case c as the layer feeds
// the core ([T][H][K] and [T][H]). Returns the stream's counter after them: each test draws its
// further inputs (S0, dO, ...) from there, in its own order.
static inline uint64_t kemu_inputs(const kemu_case *c, float *q, float *k, float *v, float *g, float *beta) {
    const int K = KEMU_K, V = KEMU_V;
    uint64_t ctr = (uint64_t)c->T * 1000 + (uint64_t)c->H * 10 + (uint64_t)c->gk;
    for (int t = 0; t < c->T; t++)
        for (int h = 0; h < c->H; h++) {
            float *qq = q + ((size_t)t * c->H + h) * K, *kk = k + ((size_t)t * c->H + h) * K;
            double a[KEMU_K], b[KEMU_K], nq = 0, nk = 0;
            for (int d = 0; d < K; d++) {
                a[d] = kemu_normal(&ctr);
                b[d] = kemu_normal(&ctr);
                nq += a[d] * a[d];
                nk += b[d] * b[d];
            }
            for (int d = 0; d < K; d++) {
                qq[d] = (float)(a[d] / sqrt(nq + 1e-6) / sqrt((double)K));
                kk[d] = (float)(b[d] / sqrt(nk + 1e-6));
            }
        }
    for (size_t i = 0; i < (size_t)c->T * c->H * V; i++) v[i] = (float)kemu_normal(&ctr);
    for (size_t i = 0; i < (size_t)c->T * c->H * K; i++) {
        double x;
        if (c->gk == KEMU_G_BOUND) x = -5.0 + 1e-3;
        else if (c->gk == KEMU_G_MODEL) {
            int hd = (int)(i % ((size_t)c->H * K)); // the per-(head, column) dt_bias
            double dt = exp(log(1e-3) + mtrl_rng_uniform(11, 2, (uint64_t)hd) * (log(0.1) - log(1e-3)));
            x = -5.0 / (1.0 + exp(-(0.5 * kemu_normal(&ctr) + log(expm1(dt)))));
        } else x = -5.0 / (1.0 + exp(-2.0 * kemu_normal(&ctr)));
        g[i] = (float)x < 0.f && (float)x > -5.f ? (float)x : -0.5f;
    }
    for (size_t i = 0; i < (size_t)c->T * c->H; i++) beta[i] = (float)(1.0 / (1.0 + exp(-kemu_normal(&ctr))));
    return ctr;
}

// ‖a − b‖ / ‖b‖ (L2) of n values, fp32 against fp64 (fp64 against fp64: testhelp.h test_rel_err_d).
static inline double kemu_rel_fd(const float *a, const double *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += (a[i] - b[i]) * (a[i] - b[i]);
        den += b[i] * b[i];
    }
    return sqrt(num) / (den > 0 ? sqrt(den) : 1e-300);
}

#endif
