// mtrl-test: cpu f64
// test_attnres_ref.c: one Block AttnRes site, fp64 (docs/model.md §8 I8, site-level parts).
//   1. all w = 0 → every alpha = 1/S and h = the mean of the sources;
//   2. site backward (dV, dw, dgamma) vs central finite differences of L = Σ G ⊙ h, with the
//      "+=" and NULL-source contracts, and alpha recomputed when not passed;
//   3. the two-phase (phase 1 over committed blocks for several sites at once, phase 2 online
//      merge of the partial sum) equals the direct softmax, with and without a partial source,
//      and stays finite and exact for large logits.
#include "kernels/ref/attnres_ref.h"
#include "common/rng.h"
#include "tests/testhelp.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// Finite-difference tolerances below assume real = double.
_Static_assert(REAL_IS_F64, "test_attnres_ref needs the fp64 reference build (mtrl-test: f64)");

static void fill_normal(real *a, size_t n, uint64_t stream, double scale, double shift) {
    for (size_t i = 0; i < n; i++) a[i] = (real)(shift + scale * mtrl_rng_normal(7, stream, i));
}

static real *alloc_real(size_t n) { return calloc(n ? n : 1, sizeof(real)); }

// L = Σ G ⊙ h for the site.
static double site_loss(int N, int D, int S, const real *const *V, const real *w,
                        const real *gamma, real eps, const real *G) {
    real *h = alloc_real((size_t)N * D);
    mtrl_ref_attnres_site_fwd(N, D, S, V, w, gamma, eps, h, NULL);
    double L = 0;
    for (size_t q = 0; q < (size_t)N * D; q++) L += (double)G[q] * h[q];
    free(h);
    return L;
}

static void test_zero_query_is_mean(void) {
    enum { N = 5, D = 7, S = 4 };
    real *V[S];
    for (int i = 0; i < S; i++) {
        V[i] = alloc_real(N * D);
        fill_normal(V[i], N * D, 100 + i, 1.0 + i, 0.3 * i);  // different scales: norm matters
    }
    real w[D] = {0}, gamma[D], h[N * D], alpha[N * S], mean[N * D];
    fill_normal(gamma, D, 110, 1.0, 1.0);
    mtrl_ref_attnres_site_fwd(N, D, S, (const real *const *)V, w, gamma, 1e-5, h, alpha);
    for (int q = 0; q < N * D; q++) {
        double s = 0;
        for (int i = 0; i < S; i++) s += V[i][q];
        mean[q] = (real)(s / S);
    }
    double err = 0;
    for (int q = 0; q < N * D; q++) err = fmax(err, fabs(h[q] - mean[q]));
    printf("w = 0: max |h - mean(V)| = %.3g\n", err);
    TEST_ARRAY_CLOSE(h, mean, N * D, 0, 1e-14);
    for (int q = 0; q < N * S; q++) TEST_NEAR(alpha[q], 1.0 / S, 1e-15);
    for (int i = 0; i < S; i++) free(V[i]);
}

static void test_site_backward_fd(void) {
    enum { N = 3, D = 6, S = 4 };
    const real eps = 1e-5, hstep = 1e-6;
    real *V[S], *dV[S], *dVpre[S];
    for (int i = 0; i < S; i++) {
        V[i] = alloc_real(N * D);
        dV[i] = alloc_real(N * D);
        dVpre[i] = alloc_real(N * D);
        fill_normal(V[i], N * D, 200 + i, 0.5 + 0.5 * i, 0.2);
        fill_normal(dVpre[i], N * D, 210 + i, 1.0, 0);  // pre-filled: checks "+="
        memcpy(dV[i], dVpre[i], sizeof(real) * N * D);
    }
    real w[D], gamma[D], G[N * D], dw[D], dgamma[D], alpha[N * S];
    fill_normal(w, D, 220, 0.6, 0);  // large enough that alpha is far from uniform
    fill_normal(gamma, D, 221, 0.5, 1.0);
    fill_normal(G, N * D, 222, 1.0, 0);
    real dw0[D], dg0[D];
    fill_normal(dw0, D, 223, 1.0, 0);
    fill_normal(dg0, D, 224, 1.0, 0);
    memcpy(dw, dw0, sizeof dw);
    memcpy(dgamma, dg0, sizeof dgamma);

    real h[N * D];
    mtrl_ref_attnres_site_fwd(N, D, S, (const real *const *)V, w, gamma, eps, h, alpha);
    // Forward against the definition written out: r_i, z_i = (gamma ⊙ w)·(r_i V_i), softmax.
    double ferr = 0;
    for (int t = 0; t < N; t++) {
        double z[S], mx = -INFINITY, sum = 0;
        for (int i = 0; i < S; i++) {
            double ss = 0, dot = 0;
            for (int d = 0; d < D; d++) ss += V[i][t * D + d] * V[i][t * D + d];
            double r = 1.0 / sqrt(ss / D + eps);
            for (int d = 0; d < D; d++) dot += gamma[d] * w[d] * (r * V[i][t * D + d]);
            z[i] = dot;
            mx = fmax(mx, z[i]);
        }
        for (int i = 0; i < S; i++) sum += exp(z[i] - mx);
        for (int i = 0; i < S; i++) ferr = fmax(ferr, fabs(alpha[t * S + i] - exp(z[i] - mx) / sum));
        for (int d = 0; d < D; d++) {
            double hv = 0;
            for (int i = 0; i < S; i++) hv += exp(z[i] - mx) / sum * V[i][t * D + d];
            ferr = fmax(ferr, fabs(h[t * D + d] - hv));
        }
    }
    printf("site fwd vs definition: max err %.3g\n", ferr);
    TEST_CHECKF(ferr < 1e-14, "site fwd err %.3g", ferr);
    double amin = 1, amax = 0;
    for (int q = 0; q < N * S; q++) { amin = fmin(amin, alpha[q]); amax = fmax(amax, alpha[q]); }
    printf("site bwd: alpha range [%.3f, %.3f]\n", amin, amax);
    TEST_CHECKF(amax - amin > 0.2, "alpha should be far from uniform: [%g, %g]", amin, amax);
    mtrl_ref_attnres_site_bwd(N, D, S, (const real *const *)V, w, gamma, eps, alpha, G,
                     (real *const *)dV, dw, dgamma);

    // Finite differences of every input element.
    double worst = 0;
    for (int i = 0; i < S; i++) {
        real an[N * D], fd[N * D];
        for (int q = 0; q < N * D; q++) {
            real keep = V[i][q];
            V[i][q] = keep + hstep;
            double lp = site_loss(N, D, S, (const real *const *)V, w, gamma, eps, G);
            V[i][q] = keep - hstep;
            double lm = site_loss(N, D, S, (const real *const *)V, w, gamma, eps, G);
            V[i][q] = keep;
            fd[q] = (real)((lp - lm) / (2 * hstep));
            an[q] = dV[i][q] - dVpre[i][q];
        }
        double e = test_rel_err_d(an, fd, N * D);
        worst = fmax(worst, e);
        TEST_CHECKF(e < 1e-7, "dV[%d] rel err %.3g", i, e);
    }
    printf("site bwd: dV max rel err vs FD = %.3g\n", worst);
    real fdw[D], fdg[D], anw[D], ang[D];
    for (int d = 0; d < D; d++) {
        real keep = w[d];
        w[d] = keep + hstep;
        double lp = site_loss(N, D, S, (const real *const *)V, w, gamma, eps, G);
        w[d] = keep - hstep;
        double lm = site_loss(N, D, S, (const real *const *)V, w, gamma, eps, G);
        w[d] = keep;
        fdw[d] = (real)((lp - lm) / (2 * hstep));
        keep = gamma[d];
        gamma[d] = keep + hstep;
        lp = site_loss(N, D, S, (const real *const *)V, w, gamma, eps, G);
        gamma[d] = keep - hstep;
        lm = site_loss(N, D, S, (const real *const *)V, w, gamma, eps, G);
        gamma[d] = keep;
        fdg[d] = (real)((lp - lm) / (2 * hstep));
        anw[d] = dw[d] - dw0[d];
        ang[d] = dgamma[d] - dg0[d];
    }
    double ew = test_rel_err_d(anw, fdw, D), eg = test_rel_err_d(ang, fdg, D);
    printf("site bwd: dw rel err = %.3g, dgamma rel err = %.3g\n", ew, eg);
    TEST_CHECKF(ew < 1e-7, "dw rel err %.3g", ew);
    TEST_CHECKF(eg < 1e-7, "dgamma rel err %.3g", eg);

    // alpha = NULL (recomputed) and a NULL source pointer: same gradients, source 1 skipped.
    real *dV2[S];
    for (int i = 0; i < S; i++) dV2[i] = i == 1 ? NULL : alloc_real(N * D);
    real dw2[D] = {0}, dg2[D] = {0};
    mtrl_ref_attnres_site_bwd(N, D, S, (const real *const *)V, w, gamma, eps, NULL, G, (real *const *)dV2,
                     dw2, dg2);
    for (int i = 0; i < S; i++) {
        if (!dV2[i]) continue;
        real an[N * D];
        for (int q = 0; q < N * D; q++) an[q] = dV[i][q] - dVpre[i][q];
        TEST_ARRAY_CLOSE(dV2[i], an, N * D, 1e-12, 1e-14);
        free(dV2[i]);
    }
    TEST_ARRAY_CLOSE(dw2, anw, D, 1e-12, 1e-14);
    TEST_ARRAY_CLOSE(dg2, ang, D, 1e-12, 1e-14);
    for (int i = 0; i < S; i++) { free(V[i]); free(dV[i]); free(dVpre[i]); }
}

// Two-phase vs direct for P sites over nb committed blocks; wscale sets the logit magnitude.
static void check_two_phase(int N, int D, int nb, int P, double wscale, uint64_t seed_stream) {
    const real eps = 1e-5;
    real **B = malloc(sizeof(real *) * (size_t)(nb + 1));
    for (int b = 0; b <= nb; b++) {  // B[nb] is the partial sum
        B[b] = alloc_real((size_t)N * D);
        fill_normal(B[b], (size_t)N * D, seed_stream + b, 1.0 + 0.7 * b, 0.1 * b);
    }
    real *w = alloc_real((size_t)P * D), *gamma = alloc_real((size_t)P * D);
    fill_normal(w, (size_t)P * D, seed_stream + 50, wscale, 0);
    fill_normal(gamma, (size_t)P * D, seed_stream + 51, 0.3, 1.0);
    real *m = alloc_real((size_t)P * N), *l = alloc_real((size_t)P * N);
    real *acc = alloc_real((size_t)P * N * D);
    mtrl_ref_attnres_phase1(N, D, nb, (const real *const *)B, P, w, gamma, eps, m, l, acc);

    real *h2 = alloc_real((size_t)N * D), *hd = alloc_real((size_t)N * D);
    real *alpha = alloc_real((size_t)N * (nb + 1)), *lse = alloc_real(N);
    double worst = 0, worst_lse = 0;
    for (int p = 0; p < P; p++) {
        for (int with_partial = 0; with_partial <= 1; with_partial++) {
            int S = nb + with_partial;
            mtrl_ref_attnres_phase2(N, D, m + (size_t)p * N, l + (size_t)p * N, acc + (size_t)p * N * D,
                           with_partial ? B[nb] : NULL, w + (size_t)p * D, gamma + (size_t)p * D,
                           eps, h2, lse);
            mtrl_ref_attnres_site_fwd(N, D, S, (const real *const *)B, w + (size_t)p * D,
                             gamma + (size_t)p * D, eps, hd, alpha);
            double e = test_rel_err_d(h2, hd, (size_t)N * D);
            worst = fmax(worst, e);
            TEST_CHECKF(e < 1e-13, "two-phase vs direct: site %d partial %d rel err %.3g", p,
                        with_partial, e);
            // lse reproduces the direct alpha of the last source: exp(z_last - lse).
            for (int t = 0; t < N; t++) {
                const real *v = B[S - 1] + (size_t)t * D;
                double ss = 0, dot = 0;
                for (int d = 0; d < D; d++) {
                    ss += v[d] * v[d];
                    dot += gamma[(size_t)p * D + d] * w[(size_t)p * D + d] * v[d];
                }
                double z = dot / sqrt(ss / D + eps);
                double a = exp(z - lse[t]);
                worst_lse = fmax(worst_lse, fabs(a - alpha[(size_t)t * S + S - 1]));
            }
            for (int q = 0; q < N * D; q++) TEST_CHECK(isfinite(h2[q]));
        }
    }
    printf("two-phase (N=%d D=%d blocks=%d sites=%d |w|~%g): max rel err %.3g, alpha from lse "
           "err %.3g\n", N, D, nb, P, wscale, worst, worst_lse);
    TEST_CHECKF(worst_lse < 1e-11, "alpha from lse err %.3g", worst_lse);
    for (int b = 0; b <= nb; b++) free(B[b]);
    free(B); free(w); free(gamma); free(m); free(l); free(acc); free(h2); free(hd); free(alpha);
    free(lse);
}

int main(void) {
    test_zero_query_is_mean();
    test_site_backward_fd();
    check_two_phase(9, 16, 3, 8, 1.0, 300);
    check_two_phase(5, 12, 1, 2, 1.0, 400);    // one committed block (embedding only)
    check_two_phase(6, 16, 4, 3, 200.0, 500);  // logits in the hundreds: needs the max shift
    return test_report();
}
