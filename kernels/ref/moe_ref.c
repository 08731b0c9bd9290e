// moe_ref.c: CPU reference of the MoE FFN and the QB bias (see moe_ref.h, docs/model.md §4).
#include "moe_ref.h"

#include "gemm_ref.h"
#include "par_ref.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// Allocation failure in the reference is not recoverable: the caller sized the problem.
static void *moe_xmalloc_(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) abort();
    return p;
}

static double moe_sigmoid_(double x) {
    // Split by sign so exp never overflows.
    if (x >= 0) return 1.0 / (1.0 + exp(-x));
    double e = exp(x);
    return e / (1.0 + e);
}

// ---- router ---------------------------------------------------------------------------------

// Selection order: higher score first, and on equal scores the lower expert id first.
static int moe_better_(real a, int ia, real b, int ib) { return a > b || (a == b && ia < ib); }

void mtrl_ref_moe_router_fwd(int N, int E, int K, const real *z, const real *beta, int form,
                    real rho, int replay, int *sel, real *w, real *s) {
    int softmax = form & MOE_ROUTER_SOFTMAX;
    REF_PAR_FOR(ref_par((REF_FLOPS_EXP + 2.0 * K) * N * E),
        for (int t = 0; t < N; t++) {
            const real *zt = z + (size_t)t * E;
            real *st = s + (size_t)t * E;
            int *selt = sel + (size_t)t * K;

            if (softmax) {
                double mx = zt[0];
                for (int e = 1; e < E; e++) mx = zt[e] > mx ? zt[e] : mx;
                double sum = 0;
                for (int e = 0; e < E; e++) sum += exp((double)zt[e] - mx);
                for (int e = 0; e < E; e++) st[e] = (real)(exp((double)zt[e] - mx) / sum);
            } else {
                for (int e = 0; e < E; e++) st[e] = (real)moe_sigmoid_(zt[e]);
            }

            if (!replay) {
                // Insertion top-K: E is a few hundred and K a few, so this beats a heap or sort and
                // keeps the slots in descending order for free. The selection score is recomputed
                // as x - beta at each comparison: the same expression, so the same rounding.
                const real *xt = form & MOE_ROUTER_SELECT_SCORE ? st : zt;
                int cnt = 0;
                for (int e = 0; e < E; e++) {
                    real c = xt[e] - (beta ? beta[e] : 0);
                    if (cnt == K) {
                        int l = selt[K - 1];
                        if (!moe_better_(c, e, xt[l] - (beta ? beta[l] : 0), l)) continue;
                        cnt--;
                    }
                    int j = cnt++;
                    while (j > 0) {
                        int p = selt[j - 1];
                        if (!moe_better_(c, e, xt[p] - (beta ? beta[p] : 0), p)) break;
                        selt[j] = p;
                        j--;
                    }
                    selt[j] = e;
                }
            }

            // The 1e-20 only guards a softmax that underflowed on every chosen expert.
            double Z = 1;
            if (!(form & MOE_ROUTER_NO_RENORM)) {
                Z = 0;
                for (int j = 0; j < K; j++) Z += st[selt[j]];
                Z += 1e-20;
            }
            for (int j = 0; j < K; j++) w[(size_t)t * K + j] = (real)((double)rho * st[selt[j]] / Z);
        });
}

void mtrl_ref_moe_router_bwd(int N, int E, int K, const real *s, const int *sel, const real *w,
                    int form, real rho, const real *dw, real *dz) {
    int score_softmax = form & MOE_ROUTER_SOFTMAX, renorm = !(form & MOE_ROUTER_NO_RENORM);
    REF_PAR_FOR(ref_par(6.0 * N * E),
        for (int t = 0; t < N; t++) {
            const real *st = s + (size_t)t * E;
            const int *selt = sel + (size_t)t * K;
            const real *wt = w + (size_t)t * K, *dwt = dw + (size_t)t * K;
            real *dzt = dz + (size_t)t * E;

            double Z = 1e-20, dww = 0;
            for (int j = 0; j < K; j++) {
                Z += st[selt[j]];
                dww += (double)dwt[j] * wt[j];
            }
            // ds_f = (rho dw_f - Σ dw_e w_e) / Z on the chosen set, kept in dz as scratch;
            // without the renormalisation w = rho s, so ds_f = rho dw_f.
            if (!renorm) {
                Z = 1;
                dww = 0;
            }
            for (int e = 0; e < E; e++) dzt[e] = 0;
            for (int j = 0; j < K; j++) dzt[selt[j]] = (real)(((double)rho * dwt[j] - dww) / Z);

            if (score_softmax) {
                double dot = 0;
                for (int j = 0; j < K; j++) dot += (double)st[selt[j]] * dzt[selt[j]];
                for (int e = 0; e < E; e++) dzt[e] = (real)(st[e] * ((double)dzt[e] - dot));
            } else {
                for (int j = 0; j < K; j++) {
                    int e = selt[j];
                    dzt[e] = (real)((double)dzt[e] * st[e] * (1.0 - (double)st[e]));
                }
            }
        });
}

// ---- dispatch / combine -------------------------------------------------------------------

void mtrl_ref_moe_dispatch(int N, int E, int K, const int *sel, int *offsets, int *perm_token, int *pos) {
    long R = (long)N * K;
    memset(offsets, 0, sizeof(int) * (size_t)(E + 1));
    for (long r = 0; r < R; r++) offsets[sel[r] + 1]++;
    for (int e = 0; e < E; e++) offsets[e + 1] += offsets[e];
    // Sequential fill in (token, slot) order is what makes the sort stable.
    int *cursor = moe_xmalloc_(sizeof(int) * (size_t)(E > 0 ? E : 1));
    memcpy(cursor, offsets, sizeof(int) * (size_t)E);
    for (int t = 0; t < N; t++)
        for (int j = 0; j < K; j++) {
            int p = cursor[sel[(size_t)t * K + j]]++;
            perm_token[p] = t;
            pos[(size_t)t * K + j] = p;
        }
    free(cursor);
}

void mtrl_ref_moe_gather(int N, int K, int D, const int *pos, const real *x, real *X_perm) {
    REF_PAR_FOR(ref_par(1.0 * N * K * D),
        for (int t = 0; t < N; t++)
            for (int j = 0; j < K; j++)
                memcpy(X_perm + (size_t)pos[(size_t)t * K + j] * D, x + (size_t)t * D,
                       sizeof(real) * (size_t)D););
}

void mtrl_ref_moe_combine_fwd(int N, int K, int D, const int *pos, const real *w, const real *Y_perm,
                     real *y) {
    REF_PAR_FOR(ref_par(2.0 * N * K * D),
        for (int t = 0; t < N; t++) {
            real *yt = y + (size_t)t * D;
            for (int d = 0; d < D; d++) {
                double acc = 0;
                for (int j = 0; j < K; j++)
                    acc += (double)w[(size_t)t * K + j] * Y_perm[(size_t)pos[(size_t)t * K + j] * D + d];
                yt[d] = (real)acc;
            }
        });
}

void mtrl_ref_moe_combine_bwd(int N, int K, int D, const int *pos, const real *w, const real *Y_perm,
                     const real *dy, real *dY_perm, real *dw) {
    REF_PAR_FOR(ref_par(4.0 * N * K * D),
        for (int t = 0; t < N; t++) {
            const real *dyt = dy + (size_t)t * D;
            for (int j = 0; j < K; j++) {
                size_t r = (size_t)pos[(size_t)t * K + j];
                real wj = w[(size_t)t * K + j];
                const real *yr = Y_perm + r * D;
                real *dyr = dY_perm + r * D;
                double dot = 0;
                for (int d = 0; d < D; d++) {
                    dot += (double)dyt[d] * yr[d];
                    dyr[d] = wj * dyt[d];
                }
                dw[(size_t)t * K + j] = (real)dot;
            }
        });
}

void mtrl_ref_moe_scatter_bwd(int N, int K, int D, const int *pos, const real *dX_perm, real *dx) {
    REF_PAR_FOR(ref_par(2.0 * N * K * D),
        for (int t = 0; t < N; t++) {
            real *dxt = dx + (size_t)t * D;
            for (int d = 0; d < D; d++) {
                double acc = dxt[d];
                for (int j = 0; j < K; j++) acc += dX_perm[(size_t)pos[(size_t)t * K + j] * D + d];
                dxt[d] = (real)acc;
            }
        });
}

// ---- experts --------------------------------------------------------------------------------

// Expert e's rows of the forward: u1 = X W1ᵀ, u3 = X W3ᵀ, Y = (SiLU(u1) ⊙ u3) W2ᵀ.
static void expert_fwd_(int e, int D, int I, const int *offsets, const real *X_perm, const real *W1,
                        const real *W3, const real *W2, real *u1, real *u3, real *Y_perm) {
    int r0 = offsets[e], rows = offsets[e + 1] - offsets[e];
    if (rows <= 0) return;
    const real *X = X_perm + (size_t)r0 * D;
    real *a = u1 + (size_t)r0 * I, *b = u3 + (size_t)r0 * I;
    mtrl_ref_gemm(0, 1, rows, I, D, 1, X, D, W1 + (size_t)e * I * D, D, 0, a, I);
    mtrl_ref_gemm(0, 1, rows, I, D, 1, X, D, W3 + (size_t)e * I * D, D, 0, b, I);
    real *m = moe_xmalloc_(sizeof(real) * (size_t)rows * I);
    for (size_t q = 0; q < (size_t)rows * I; q++) m[q] = (real)(a[q] * moe_sigmoid_(a[q]) * b[q]);
    mtrl_ref_gemm(0, 1, rows, D, I, 1, m, I, W2 + (size_t)e * D * I, I, 0, Y_perm + (size_t)r0 * D, D);
    free(m);
}

// Expert e's rows of the backward (dX written, dW accumulated; see mtrl_ref_moe_experts_bwd).
static void expert_bwd_(int e, int D, int I, const int *offsets, const real *X_perm, const real *W1,
                        const real *W3, const real *W2, const real *u1, const real *u3, const real *dY_perm,
                        real *dX_perm, real *dW1, real *dW3, real *dW2) {
    int r0 = offsets[e], rows = offsets[e + 1] - offsets[e];
    if (rows <= 0) return;
    size_t n = (size_t)rows * I;
    const real *X = X_perm + (size_t)r0 * D, *dY = dY_perm + (size_t)r0 * D;
    const real *a = u1 + (size_t)r0 * I, *b = u3 + (size_t)r0 * I;
    real *m = moe_xmalloc_(sizeof(real) * n * 3);
    real *du1 = m + n, *du3 = m + 2 * n;  // du1 first holds dm
    // dm = dY W2[e]   and   dW2[e] += dYᵀ m
    mtrl_ref_gemm(0, 0, rows, I, D, 1, dY, D, W2 + (size_t)e * D * I, I, 0, du1, I);
    for (size_t q = 0; q < n; q++) {
        double sg = moe_sigmoid_(a[q]), silu = a[q] * sg, dm = du1[q];
        m[q] = (real)(silu * b[q]);
        du3[q] = (real)(dm * silu);
        du1[q] = (real)(dm * b[q] * sg * (1.0 + a[q] * (1.0 - sg)));
    }
    if (dW2) mtrl_ref_gemm(1, 0, D, I, rows, 1, dY, D, m, I, 1, dW2 + (size_t)e * D * I, I);
    // dX = du1 W1[e] + du3 W3[e];   dW1[e] += du1ᵀ X;   dW3[e] += du3ᵀ X
    real *dX = dX_perm + (size_t)r0 * D;
    mtrl_ref_gemm(0, 0, rows, D, I, 1, du1, I, W1 + (size_t)e * I * D, D, 0, dX, D);
    mtrl_ref_gemm(0, 0, rows, D, I, 1, du3, I, W3 + (size_t)e * I * D, D, 1, dX, D);
    if (dW1) mtrl_ref_gemm(1, 0, I, D, rows, 1, du1, I, X, D, 1, dW1 + (size_t)e * I * D, D);
    if (dW3) mtrl_ref_gemm(1, 0, I, D, rows, 1, du3, I, X, D, 1, dW3 + (size_t)e * I * D, D);
    free(m);
}

// Experts run on the team (dynamic: loads are uneven by design, skewed routing, empty experts)
// when there are several and their work is worth a fork (par_ref.h); their GEMMs then run
// serially inside. One expert (the dense and shared SwiGLU), or a small batch: experts in turn,
// each GEMM deciding for itself.
static int experts_par_(int E, int D, int I, const int *offsets, double gemms) {
    return E > 1 && ref_par((2.0 * gemms * D + REF_FLOPS_EXP) * I * (double)(offsets[E] - offsets[0]));
}

void mtrl_ref_moe_experts_fwd(int E, int D, int I, const int *offsets, const real *X_perm,
                     const real *W1, const real *W3, const real *W2, real *u1, real *u3,
                     real *Y_perm) {
    if (experts_par_(E, D, I, offsets, 3)) {
        #pragma omp parallel for schedule(dynamic, 1)
        for (int e = 0; e < E; e++) expert_fwd_(e, D, I, offsets, X_perm, W1, W3, W2, u1, u3, Y_perm);
    } else {
        for (int e = 0; e < E; e++) expert_fwd_(e, D, I, offsets, X_perm, W1, W3, W2, u1, u3, Y_perm);
    }
}

void mtrl_ref_moe_experts_bwd(int E, int D, int I, const int *offsets, const real *X_perm,
                     const real *W1, const real *W3, const real *W2, const real *u1,
                     const real *u3, const real *dY_perm, real *dX_perm, real *dW1, real *dW3,
                     real *dW2) {
    if (experts_par_(E, D, I, offsets, 6)) {
        #pragma omp parallel for schedule(dynamic, 1)
        for (int e = 0; e < E; e++)
            expert_bwd_(e, D, I, offsets, X_perm, W1, W3, W2, u1, u3, dY_perm, dX_perm, dW1, dW3, dW2);
    } else {
        for (int e = 0; e < E; e++)
            expert_bwd_(e, D, I, offsets, X_perm, W1, W3, W2, u1, u3, dY_perm, dX_perm, dW1, dW3, dW2);
    }
}

void mtrl_ref_moe_swiglu_fwd(int N, int D, int I, const real *x, const real *W1, const real *W3,
                    const real *W2, real *u1, real *u3, real *y) {
    int offsets[2] = {0, N};
    mtrl_ref_moe_experts_fwd(1, D, I, offsets, x, W1, W3, W2, u1, u3, y);
}

void mtrl_ref_moe_swiglu_bwd(int N, int D, int I, const real *x, const real *W1, const real *W3,
                    const real *W2, const real *u1, const real *u3, const real *dy, real *dx,
                    real *dW1, real *dW3, real *dW2) {
    int offsets[2] = {0, N};
    mtrl_ref_moe_experts_bwd(1, D, I, offsets, x, W1, W3, W2, u1, u3, dy, dx, dW1, dW3, dW2);
}

// ---- load statistics and Quantile Balancing ------------------------------------------------

void mtrl_ref_moe_load_count(int N, int E, int K, const int *sel, int *load) {
    memset(load, 0, sizeof(int) * (size_t)E);
    for (long r = 0; r < (long)N * K; r++) load[sel[r]]++;
}

double mtrl_ref_moe_max_violation(int E, const int *load, long total_slots) {
    if (total_slots <= 0 || E <= 0) return 0;
    double target = (double)total_slots / E;
    int mx = load[0];
    for (int e = 1; e < E; e++) mx = load[e] > mx ? load[e] : mx;
    return mx / target - 1.0;
}

// The k-th largest (1-based) of a[0..n), reordering a. Quickselect with a three-way partition
// (runs of equal values, common in clipped or integer-valued scores, end in one pass) and a
// pseudo-random pivot from a fixed xorshift sequence (no adversarial quadratic inputs; the
// returned value is unique, so the pivot sequence cannot change the result).
static real qb_select_kth_largest_(real *a, int n, int k) {
    int lo = 0, hi = n - 1, target = k - 1;
    uint32_t rs = 0x9e3779b9u ^ (uint32_t)n;
    while (lo < hi) {
        rs ^= rs << 13; rs ^= rs >> 17; rs ^= rs << 5;
        real pivot = a[lo + (int)(rs % (uint32_t)(hi - lo + 1))];
        // Descending: [lo, lt) > pivot, [lt, i) == pivot, (gt, hi] < pivot.
        int lt = lo, i = lo, gt = hi;
        while (i <= gt) {
            real v = a[i];
            if (v > pivot) { a[i] = a[lt]; a[lt] = v; lt++; i++; }
            else if (v < pivot) { a[i] = a[gt]; a[gt] = v; gt--; }
            else i++;
        }
        if (target < lt) hi = lt - 1;
        else if (target > gt) lo = gt + 1;
        else return pivot;
    }
    return a[lo];
}

// Rows [i0, i1) of the QB first pass: alpha_i, the (K+1)-th largest z_i - beta_old, and
// cols[e][i] = z_ie - alpha_i.
static void qb_alpha_rows_(int i0, int i1, int N, int E, int K, const real *z, const real *beta_old, real *cols) {
    real *row = moe_xmalloc_(sizeof(real) * (size_t)E);
    for (int i = i0; i < i1; i++) {
        const real *zi = z + (size_t)i * E;
        for (int e = 0; e < E; e++) row[e] = zi[e] - (beta_old ? beta_old[e] : 0);
        real alpha = qb_select_kth_largest_(row, E, K + 1);
        for (int e = 0; e < E; e++) cols[(size_t)e * N + i] = zi[e] - alpha;
    }
    free(row);
}

int mtrl_ref_qb_beta_from_batch(int N, int E, int K, const real *z, const real *beta_old, real *beta_new) {
    long q = (long)N * K / E;  // ⌊NK/E⌋: the per-expert capacity at exact balance
    if (q == 0 || q + 1 > N || K >= E) {
        if (beta_new != beta_old)
            for (int e = 0; e < E; e++) beta_new[e] = beta_old ? beta_old[e] : 0;
        return 1;
    }
    // cols [E][N]: z_ij - alpha_i stored by expert so each column selection is contiguous.
    real *cols = moe_xmalloc_(sizeof(real) * (size_t)N * E);
    // Each expert's column is complete only when every alpha is: two passes, each on the team
    // when the selections are worth it (a quickselect of E, then of N, per row / column).
    if (ref_par(8.0 * N * E)) {
        #pragma omp parallel
        {
            long lo, hi;
            ref_thread_range(N, &lo, &hi);
            qb_alpha_rows_((int)lo, (int)hi, N, E, K, z, beta_old, cols);
            // The barrier finishes every alpha before any beta_new is written, which is what
            // lets beta_new alias beta_old.
            #pragma omp barrier
            ref_thread_range(E, &lo, &hi);
            for (long e = lo; e < hi; e++)
                beta_new[e] = qb_select_kth_largest_(cols + (size_t)e * N, N, (int)q + 1);
        }
    } else {
        qb_alpha_rows_(0, N, N, E, K, z, beta_old, cols);
        for (int e = 0; e < E; e++) beta_new[e] = qb_select_kth_largest_(cols + (size_t)e * N, N, (int)q + 1);
    }
    free(cols);
    return 0;
}
