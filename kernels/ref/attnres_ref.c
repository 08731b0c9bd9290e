// attnres_ref.c: CPU reference of one Block AttnRes site and its two-phase evaluation
// (see attnres_ref.h, docs/model.md §6).
#include "attnres_ref.h"

#include "gemm_ref.h"
#include "par_ref.h"

#include <math.h>
#include <stddef.h>
#include <stdlib.h>

static void *attnres_xmalloc_(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) abort();
    return p;
}

// r = (mean(v²) + eps)^(-1/2) of one row, accumulated in double.
static double attnres_rinv_(int D, const real *v, real eps) {
    double ss = 0;
    for (int d = 0; d < D; d++) ss += (double)v[d] * v[d];
    return 1.0 / sqrt(ss / D + (double)eps);
}

// u = gamma ⊙ w: the effective query the logits use (one product, not one per source).
static real *attnres_query_(int D, const real *w, const real *gamma) {
    real *u = attnres_xmalloc_(sizeof(real) * (size_t)D);
    for (int d = 0; d < D; d++) u[d] = gamma[d] * w[d];
    return u;
}

// Token t of a site: r[i], z[i] (logits) and a[i] = softmax(z) for the S sources.
static void attnres_token_softmax_(int D, int S, const real *const *V, size_t t, const real *u,
                                   real eps, double *r, double *z, double *a) {
    double mx = -INFINITY;
    for (int i = 0; i < S; i++) {
        const real *v = V[i] + t * D;
        r[i] = attnres_rinv_(D, v, eps);
        double dot = 0;
        for (int d = 0; d < D; d++) dot += (double)u[d] * v[d];
        z[i] = r[i] * dot;
        mx = z[i] > mx ? z[i] : mx;
    }
    double sum = 0;
    for (int i = 0; i < S; i++) sum += (a[i] = exp(z[i] - mx));
    for (int i = 0; i < S; i++) a[i] /= sum;
}

// Tokens [t0, t1) of a site's forward: alpha (when given) and h.
static void site_fwd_rows_(int t0, int t1, int D, int S, const real *const *V, const real *u, real eps, real *h,
                           real *alpha) {
    double *r = attnres_xmalloc_(sizeof(double) * 3 * (size_t)S), *z = r + S, *a = z + S;
    for (int t = t0; t < t1; t++) {
        attnres_token_softmax_(D, S, V, (size_t)t, u, eps, r, z, a);
        if (alpha)
            for (int i = 0; i < S; i++) alpha[(size_t)t * S + i] = (real)a[i];
        real *ht = h + (size_t)t * D;
        for (int d = 0; d < D; d++) {
            double acc = 0;
            for (int i = 0; i < S; i++) acc += a[i] * V[i][(size_t)t * D + d];
            ht[d] = (real)acc;
        }
    }
    free(r);
}

// Tokens [t0, t1) of a site's backward: dV accumulated, c[t][i] = dz_i r_i written.
static void site_bwd_rows_(int t0, int t1, int D, int S, const real *const *V, const real *u, real eps,
                           const real *alpha, const real *dh, real *const *dV, real *c) {
    double *r = attnres_xmalloc_(sizeof(double) * 4 * (size_t)S);
    double *z = r + S, *a = z + S, *da = a + S;
    for (int t = t0; t < t1; t++) {
        // Logits are recomputed even when alpha is given: the dV formula needs u·x̂_i = z_i.
        attnres_token_softmax_(D, S, V, (size_t)t, u, eps, r, z, a);
        if (alpha)
            for (int i = 0; i < S; i++) a[i] = alpha[(size_t)t * S + i];
        const real *dht = dh + (size_t)t * D;
        double sad = 0;
        for (int i = 0; i < S; i++) {
            const real *v = V[i] + (size_t)t * D;
            double dot = 0;
            for (int d = 0; d < D; d++) dot += (double)dht[d] * v[d];
            da[i] = dot;
            sad += a[i] * dot;
        }
        for (int i = 0; i < S; i++) {
            double dz = a[i] * (da[i] - sad), ci = dz * r[i];
            c[(size_t)t * S + i] = (real)ci;
            if (!dV[i]) continue;
            const real *v = V[i] + (size_t)t * D;
            real *g = dV[i] + (size_t)t * D;
            double proj = r[i] * z[i] / D;  // x̂_i (u·x̂_i)/D = V_i r_i z_i / D
            for (int d = 0; d < D; d++)
                g[d] = (real)((double)g[d] + a[i] * dht[d] + ci * ((double)u[d] - proj * v[d]));
        }
    }
    free(r);
}

void mtrl_ref_attnres_site_fwd(int N, int D, int S, const real *const *V, const real *w,
                      const real *gamma, real eps, real *h, real *alpha) {
    real *u = attnres_query_(D, w, gamma);
    REF_PAR_RANGES(ref_par((5.0 * D + REF_FLOPS_EXP) * N * S), N, lo, hi,
                   site_fwd_rows_((int)lo, (int)hi, D, S, V, u, eps, h, alpha));
    free(u);
}

void mtrl_ref_attnres_site_bwd(int N, int D, int S, const real *const *V, const real *w,
                      const real *gamma, real eps, const real *alpha, const real *dh,
                      real *const *dV, real *dw, real *dgamma) {
    real *u = attnres_query_(D, w, gamma);
    // c[t][i] = dz_i r_i: the weight of V_i[t] in Σ dz_i x̂_i, the common factor of dw and dgamma.
    real *c = attnres_xmalloc_(sizeof(real) * (size_t)N * S);
    REF_PAR_RANGES(ref_par((10.0 * D + REF_FLOPS_EXP) * N * S), N, lo, hi,
                   site_bwd_rows_((int)lo, (int)hi, D, S, V, u, eps, alpha, dh, dV, c));
    if (dw || dgamma) {
        // G = Σ_{t,i} c[t][i] V_i[t]: a 1×N by N×D product per source (fixed order over tokens
        // inside mtrl_ref_gemm, sources in order), so the result is independent of the thread count.
        real *G = attnres_xmalloc_(sizeof(real) * (size_t)D);
        for (int i = 0; i < S; i++)
            mtrl_ref_gemm(1, 0, 1, D, N, 1, c + i, S, V[i], D, i ? 1 : 0, G, D);
        for (int d = 0; d < D; d++) {
            if (dw) dw[d] += gamma[d] * G[d];
            if (dgamma) dgamma[d] += w[d] * G[d];
        }
        free(G);
    }
    free(c);
    free(u);
}

void mtrl_ref_attnres_phase1(int N, int D, int nb, const real *const *B, int P, const real *w,
                    const real *gamma, real eps, real *m, real *l, real *acc) {
    size_t rows = (size_t)nb * N;
    real *U = attnres_xmalloc_(sizeof(real) * (size_t)P * D);
    for (size_t q = 0; q < (size_t)P * D; q++) U[q] = gamma[q] * w[q];
    // Xh [nb][N][D]: the normalised blocks stacked, so all logits are one GEMM Z = Xh Uᵀ.
    real *Xh = attnres_xmalloc_(sizeof(real) * rows * D);
    real *Z = attnres_xmalloc_(sizeof(real) * rows * P);
    REF_PAR_FOR(ref_par(2.0 * rows * D),
        for (long q = 0; q < (long)rows; q++) {
            const real *v = B[q / N] + (size_t)(q % N) * D;
            double r = attnres_rinv_(D, v, eps);
            for (int d = 0; d < D; d++) Xh[(size_t)q * D + d] = (real)(r * v[d]);
        });
    mtrl_ref_gemm(0, 1, (int)rows, P, D, 1, Xh, D, U, D, 0, Z, P);
    REF_PAR_FOR(ref_par((REF_FLOPS_EXP + 2.0 * D) * N * P * nb),
        for (int t = 0; t < N; t++) {
            for (int p = 0; p < P; p++) {
                double mx = -INFINITY, sum = 0;
                for (int b = 0; b < nb; b++) {
                    double zb = Z[((size_t)b * N + t) * P + p];
                    mx = zb > mx ? zb : mx;
                }
                real *at = acc + ((size_t)p * N + t) * D;
                for (int d = 0; d < D; d++) at[d] = 0;
                for (int b = 0; b < nb; b++) {
                    double e = exp(Z[((size_t)b * N + t) * P + p] - mx);
                    sum += e;
                    const real *v = B[b] + (size_t)t * D;
                    for (int d = 0; d < D; d++) at[d] = (real)((double)at[d] + e * v[d]);
                }
                m[(size_t)p * N + t] = (real)mx;
                l[(size_t)p * N + t] = (real)sum;
            }
        });
    free(Z);
    free(Xh);
    free(U);
}

void mtrl_ref_attnres_phase2(int N, int D, const real *m, const real *l, const real *acc,
                    const real *Vp, const real *w, const real *gamma, real eps, real *h,
                    real *lse) {
    real *u = Vp ? attnres_query_(D, w, gamma) : NULL;
    REF_PAR_FOR(ref_par((REF_FLOPS_EXP + 4.0 * D) * N),
        for (int t = 0; t < N; t++) {
            const real *at = acc + (size_t)t * D;
            real *ht = h + (size_t)t * D;
            double mt = m[t], lt = l[t];
            if (!Vp) {
                for (int d = 0; d < D; d++) ht[d] = (real)(at[d] / lt);
                if (lse) lse[t] = (real)(mt + log(lt));
                continue;
            }
            const real *v = Vp + (size_t)t * D;
            double dot = 0;
            for (int d = 0; d < D; d++) dot += (double)u[d] * v[d];
            double zp = attnres_rinv_(D, v, eps) * dot;
            double m2 = zp > mt ? zp : mt;
            double sc = exp(mt - m2), ep = exp(zp - m2), l2 = lt * sc + ep;
            for (int d = 0; d < D; d++) ht[d] = (real)((at[d] * sc + ep * v[d]) / l2);
            if (lse) lse[t] = (real)(m2 + log(l2));
        });
    free(u);
}
