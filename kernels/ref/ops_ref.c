// ops_ref.c: shared primitives of the CPU reference (see ops_ref.h for the contracts).
#include "kernels/ref/ops_ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ref/par_ref.h"  // which loops run on a team: ref_par(flops)

static inline double sigmoid_(double x) { return 1.0 / (1.0 + exp(-x)); }

// Inverse RMS of one row, summed in double so the fp32 build tracks the fp64 one.
static double row_rstd_(int D, const real *x, double eps) {
    double s = 0.0;
    for (int j = 0; j < D; j++) s += (double)x[j] * (double)x[j];
    return 1.0 / sqrt(s / D + eps);
}

// ---- norms ---------------------------------------------------------------------------------

void mtrl_ref_rmsnorm_fwd(int N, int D, const real *x, const real *w, real eps, real *y, real *rstd) {
    REF_PAR_FOR(ref_par(4.0 * N * D),
        for (int i = 0; i < N; i++) {
            const real *xi = x + (size_t)i * D;
            real *yi = y + (size_t)i * D;
            double r = row_rstd_(D, xi, (double)eps);
            for (int j = 0; j < D; j++) yi[j] = (real)((double)w[j] * (double)xi[j] * r);
            if (rstd) rstd[i] = (real)r;
        });
}

// dw[j] += Σ_i dy[i][j] · x̂[i][j] · s[i][j], where s = σ(z) when z is given (gated norm) and
// 1 otherwise. Parallel over column blocks, rows summed in order per column: deterministic.
static void norm_dw_(int N, int D, const real *x, const real *z, const real *rstd, double eps,
                     const real *dy, real *dw) {
    enum { CB = 64 };
    int nb = (D + CB - 1) / CB;
    REF_PAR_FOR(ref_par((z ? REF_FLOPS_EXP + 4 : 4.0) * N * D),
        for (int b = 0; b < nb; b++) {
            int j0 = b * CB, j1 = j0 + CB < D ? j0 + CB : D;
            double acc[CB];
            for (int j = j0; j < j1; j++) acc[j - j0] = 0.0;
            for (int i = 0; i < N; i++) {
                const real *xi = x + (size_t)i * D, *dyi = dy + (size_t)i * D;
                double r = rstd ? (double)rstd[i] : row_rstd_(D, xi, eps);
                if (z) {
                    const real *zi = z + (size_t)i * D;
                    for (int j = j0; j < j1; j++)
                        acc[j - j0] += (double)dyi[j] * (double)xi[j] * r * sigmoid_((double)zi[j]);
                } else {
                    for (int j = j0; j < j1; j++) acc[j - j0] += (double)dyi[j] * (double)xi[j] * r;
                }
            }
            for (int j = j0; j < j1; j++) dw[j] = (real)((double)dw[j] + acc[j - j0]);
        });
}

void mtrl_ref_rmsnorm_bwd(int N, int D, const real *x, const real *w, const real *rstd, real eps,
                 const real *dy, real *dx, real *dw) {
    // dw first: dx may alias dy.
    if (dw) norm_dw_(N, D, x, NULL, rstd, (double)eps, dy, dw);
    REF_PAR_FOR(ref_par(8.0 * N * D),
        for (int i = 0; i < N; i++) {
            const real *xi = x + (size_t)i * D, *dyi = dy + (size_t)i * D;
            real *dxi = dx + (size_t)i * D;
            double r = rstd ? (double)rstd[i] : row_rstd_(D, xi, (double)eps);
            double dot = 0.0;  // Σ u ⊙ x̂
            for (int j = 0; j < D; j++) dot += (double)w[j] * (double)dyi[j] * (double)xi[j] * r;
            double mean = dot / D;
            for (int j = 0; j < D; j++) {
                double u = (double)w[j] * (double)dyi[j];
                dxi[j] = (real)(r * (u - (double)xi[j] * r * mean));
            }
        });
}

void mtrl_ref_l2norm_fwd(int N, int D, const real *x, real eps, real *y, real *rnorm) {
    REF_PAR_FOR(ref_par(4.0 * N * D),
        for (int i = 0; i < N; i++) {
            const real *xi = x + (size_t)i * D;
            real *yi = y + (size_t)i * D;
            double s = 0.0;
            for (int j = 0; j < D; j++) s += (double)xi[j] * (double)xi[j];
            double r = 1.0 / sqrt(s + (double)eps);
            for (int j = 0; j < D; j++) yi[j] = (real)((double)xi[j] * r);
            if (rnorm) rnorm[i] = (real)r;
        });
}

void mtrl_ref_l2norm_bwd(int N, int D, const real *x, real eps, const real *dy, real *dx) {
    REF_PAR_FOR(ref_par(6.0 * N * D),
        for (int i = 0; i < N; i++) {
            const real *xi = x + (size_t)i * D, *dyi = dy + (size_t)i * D;
            real *dxi = dx + (size_t)i * D;
            double s = 0.0, dot = 0.0;
            for (int j = 0; j < D; j++) {
                s += (double)xi[j] * (double)xi[j];
                dot += (double)dyi[j] * (double)xi[j];
            }
            double r = 1.0 / sqrt(s + (double)eps);
            double dyy = dot * r;  // dy · y
            for (int j = 0; j < D; j++) dxi[j] = (real)(r * ((double)dyi[j] - (double)xi[j] * r * dyy));
        });
}

void mtrl_ref_gated_rmsnorm_fwd(int N, int D, const real *x, const real *z, const real *w, real eps,
                       real *y) {
    REF_PAR_FOR(ref_par((REF_FLOPS_EXP + 4) * N * D),
        for (int i = 0; i < N; i++) {
            const real *xi = x + (size_t)i * D, *zi = z + (size_t)i * D;
            real *yi = y + (size_t)i * D;
            double r = row_rstd_(D, xi, (double)eps);
            for (int j = 0; j < D; j++)
                yi[j] = (real)((double)w[j] * (double)xi[j] * r * sigmoid_((double)zi[j]));
        });
}

void mtrl_ref_gated_rmsnorm_bwd(int N, int D, const real *x, const real *z, const real *w, real eps,
                       const real *dy, real *dx, real *dz, real *dw) {
    if (dw) norm_dw_(N, D, x, z, NULL, (double)eps, dy, dw);
    REF_PAR_FOR(ref_par((2 * REF_FLOPS_EXP + 12) * N * D),
        for (int i = 0; i < N; i++) {
            const real *xi = x + (size_t)i * D, *zi = z + (size_t)i * D, *dyi = dy + (size_t)i * D;
            real *dxi = dx + (size_t)i * D, *dzi = dz + (size_t)i * D;
            double r = row_rstd_(D, xi, (double)eps);
            double dot = 0.0;  // Σ u ⊙ x̂ with u = dy ⊙ w ⊙ s
            for (int j = 0; j < D; j++) {
                double s = sigmoid_((double)zi[j]);
                double xh = (double)xi[j] * r;
                double gy = (double)dyi[j] * (double)w[j];
                dot += gy * s * xh;
                dzi[j] = (real)(gy * xh * s * (1.0 - s));
            }
            double mean = dot / D;
            for (int j = 0; j < D; j++) {
                double u = (double)dyi[j] * (double)w[j] * sigmoid_((double)zi[j]);
                dxi[j] = (real)(r * (u - (double)xi[j] * r * mean));
            }
        });
}

// ---- SwiGLU --------------------------------------------------------------------------------

void mtrl_ref_swiglu_fwd(int N, int I, const real *u1, const real *u3, real *m) {
    size_t n = (size_t)N * I;
    REF_PAR_FOR(ref_par(REF_FLOPS_EXP * n),
        for (size_t e = 0; e < n; e++) {
            double a = (double)u1[e];
            m[e] = (real)(a * sigmoid_(a) * (double)u3[e]);
        });
}

void mtrl_ref_swiglu_bwd(int N, int I, const real *u1, const real *u3, const real *dm, real *du1,
                real *du3) {
    size_t n = (size_t)N * I;
    REF_PAR_FOR(ref_par(REF_FLOPS_EXP * n),
        for (size_t e = 0; e < n; e++) {
            double a = (double)u1[e], b = (double)u3[e], g = (double)dm[e];
            double s = sigmoid_(a);
            double g1 = g * b * s * (1.0 + a * (1.0 - s));
            double g3 = g * a * s;
            du1[e] = (real)g1;
            du3[e] = (real)g3;
        });
}

// ---- short conv ----------------------------------------------------------------------------

// The input at stream position t (t < 0 reads state_in row t + W − 1; NULL state = 0).
static inline const real *conv_row_(int t, int C, int W, const real *x, const real *state_in) {
    if (t >= 0) return x + (size_t)t * C;
    return state_in ? state_in + (size_t)(t + W - 1) * C : NULL;
}

// p_t for all channels into p[C] (double).
static void conv_pre_(int t, int C, int W, const real *x, const real *w, const real *state_in,
                      double *p) {
    for (int c = 0; c < C; c++) p[c] = 0.0;
    for (int j = 0; j < W; j++) {
        const real *xr = conv_row_(t - W + 1 + j, C, W, x, state_in);
        if (!xr) continue;
        for (int c = 0; c < C; c++) p[c] += (double)w[(size_t)c * W + j] * (double)xr[c];
    }
}

// y rows [t0, t1) of the forward: SiLU of the causal conv.
static void conv_fwd_rows_(int t0, int t1, int C, int W, const real *x, const real *w, const real *state_in,
                           real *y) {
    double *p = malloc(sizeof(double) * (size_t)C);
    for (int t = t0; t < t1; t++) {
        conv_pre_(t, C, W, x, w, state_in, p);
        real *yt = y + (size_t)t * C;
        for (int c = 0; c < C; c++) yt[c] = (real)(p[c] * sigmoid_(p[c]));
    }
    free(p);
}

// dp rows [t0, t1) of the backward: dp_t = dy_t ⊙ SiLU'(p_t), p recomputed.
static void conv_dp_rows_(int t0, int t1, int C, int W, const real *x, const real *w, const real *state_in,
                          const real *dy, double *dp) {
    double *p = malloc(sizeof(double) * (size_t)C);
    for (int t = t0; t < t1; t++) {
        conv_pre_(t, C, W, x, w, state_in, p);
        const real *dyt = dy + (size_t)t * C;
        double *dpt = dp + (size_t)t * C;
        for (int c = 0; c < C; c++) {
            double s = sigmoid_(p[c]);
            dpt[c] = (double)dyt[c] * s * (1.0 + p[c] * (1.0 - s));
        }
    }
    free(p);
}

void mtrl_ref_shortconv_fwd(int T, int C, int W, const real *x, const real *w, const real *state_in,
                   real *y, real *state_out) {
    REF_PAR_RANGES(ref_par((2.0 * W + REF_FLOPS_EXP) * T * C), T, lo, hi,
                   conv_fwd_rows_((int)lo, (int)hi, C, W, x, w, state_in, y));
    if (state_out) {
        // Row r of state_out is stream position T − (W−1) + r. Copy in increasing r: when
        // state_out aliases state_in the source row (r + T) is never below the destination r.
        for (int r = 0; r < W - 1; r++) {
            const real *src = conv_row_(T - (W - 1) + r, C, W, x, state_in);
            real *dst = state_out + (size_t)r * C;
            if (!src) memset(dst, 0, sizeof(real) * (size_t)C);
            else if (src != dst) memmove(dst, src, sizeof(real) * (size_t)C);
        }
    }
}

void mtrl_ref_shortconv_fwd_varlen(int n, const int *offs, int C, int W, const real *x, const real *w, real *y) {
    for (int i = 0; i < n; i++) {
        size_t o = (size_t)offs[i] * C;
        mtrl_ref_shortconv_fwd(offs[i + 1] - offs[i], C, W, x + o, w, NULL, y + o, NULL);
    }
}

void mtrl_ref_shortconv_fwd_varlen_io(int n, const int *offs, int C, int W, const real *x, const real *w,
                                      const real *const *win_in, real *const *win_out, real *y) {
    for (int i = 0; i < n; i++) {
        size_t o = (size_t)offs[i] * C;
        mtrl_ref_shortconv_fwd(offs[i + 1] - offs[i], C, W, x + o, w, win_in ? win_in[i] : NULL, y + o,
                               win_out ? win_out[i] : NULL);
    }
}

void mtrl_ref_shortconv_bwd(int T, int C, int W, const real *x, const real *w, const real *state_in,
                   const real *dy, real *dx, real *dw, real *dstate_in) {
    // dp_t = dy_t ⊙ SiLU'(p_t), recomputed from the inputs. Kept for all T (T·C doubles).
    double *dp = malloc(sizeof(double) * ((size_t)T * C + 1));
    REF_PAR_RANGES(ref_par((2.0 * W + REF_FLOPS_EXP) * T * C), T, lo, hi,
                   conv_dp_rows_((int)lo, (int)hi, C, W, x, w, state_in, dy, dp));
    // dx_s = Σ_j w_j dp_{s+W−1−j} over t = s+W−1−j in [0, T). Rows s in [−(W−1), T): the
    // negative ones are dstate_in.
    int s_lo = dstate_in ? -(W - 1) : 0;
    REF_PAR_FOR(ref_par(2.0 * T * C * W),
        for (int s = s_lo; s < T; s++) {
            real *out = s >= 0 ? dx + (size_t)s * C : dstate_in + (size_t)(s + W - 1) * C;
            for (int c = 0; c < C; c++) {
                double g = 0.0;
                for (int j = 0; j < W; j++) {
                    int t = s + W - 1 - j;
                    if (t < 0 || t >= T) continue;
                    g += (double)w[(size_t)c * W + j] * dp[(size_t)t * C + c];
                }
                out[c] = (real)g;
            }
        });
    // dw_{c,j} += Σ_t dp_t x_{t−W+1+j}: parallel over channels, t in order (deterministic).
    REF_PAR_FOR(ref_par(2.0 * T * C * W),
        for (int c = 0; c < C; c++) {
            for (int j = 0; j < W; j++) {
                double g = 0.0;
                for (int t = 0; t < T; t++) {
                    const real *xr = conv_row_(t - W + 1 + j, C, W, x, state_in);
                    if (xr) g += dp[(size_t)t * C + c] * (double)xr[c];
                }
                dw[(size_t)c * W + j] = (real)((double)dw[(size_t)c * W + j] + g);
            }
        });
    free(dp);
}

void mtrl_ref_shortconv_bwd_varlen(int n, const int *offs, int C, int W, const real *x, const real *w, const real *dy,
                                   real *dx, real *dw) {
    for (int i = 0; i < n; i++) {
        size_t o = (size_t)offs[i] * C;
        mtrl_ref_shortconv_bwd(offs[i + 1] - offs[i], C, W, x + o, w, NULL, dy + o, dx + o, dw, NULL);
    }
}

void mtrl_ref_shortconv_state_bwd(int T, int C, int W, const real *dstate_out, real *dx, real *dstate_in) {
    for (int r = 0; r < W - 1; r++) {
        int t = T - (W - 1) + r;  // stream position that state_out row r copied
        real *dst = t >= 0 ? dx + (size_t)t * C : (dstate_in ? dstate_in + (size_t)(t + W - 1) * C : NULL);
        if (!dst) continue;
        const real *g = dstate_out + (size_t)r * C;
        for (int c = 0; c < C; c++) dst[c] += g[c];
    }
}

void mtrl_ref_shortconv_step(int C, int W, const real *x1, const real *w, real *window, real *y1) {
    for (int c = 0; c < C; c++) {
        double p = (double)w[(size_t)c * W + W - 1] * (double)x1[c];
        for (int j = 0; j < W - 1; j++) p += (double)w[(size_t)c * W + j] * (double)window[(size_t)j * C + c];
        y1[c] = (real)(p * sigmoid_(p));
    }
    if (W > 1) {
        memmove(window, window + C, sizeof(real) * (size_t)(W - 2) * C);
        memcpy(window + (size_t)(W - 2) * C, x1, sizeof(real) * (size_t)C);
    }
}

// ---- embedding -----------------------------------------------------------------------------

void mtrl_ref_embedding_fwd(int N, int D, const int *ids, const real *E, real *x) {
    for (int i = 0; i < N; i++) {
        real *xi = x + (size_t)i * D;
        if (ids[i] < 0) memset(xi, 0, sizeof(real) * (size_t)D);
        else memcpy(xi, E + (size_t)ids[i] * D, sizeof(real) * (size_t)D);
    }
}

void mtrl_ref_embedding_bwd(int N, int D, const int *ids, const real *dx, real *dE) {
    for (int i = 0; i < N; i++) {
        if (ids[i] < 0) continue;
        real *e = dE + (size_t)ids[i] * D;
        const real *g = dx + (size_t)i * D;
        for (int j = 0; j < D; j++) e[j] += g[j];
    }
}

// ---- log-softmax statistics ----------------------------------------------------------------

// Row statistics: max, lse = log Σ exp, and μ = Σ p_v l_v (so H = lse − μ).
static void row_softmax_stats_(int V, const real *l, double *mx, double *lse, double *mu) {
    double m = -INFINITY;
    for (int v = 0; v < V; v++) if ((double)l[v] > m) m = (double)l[v];
    double s = 0.0, sl = 0.0;
    for (int v = 0; v < V; v++) {
        double e = exp((double)l[v] - m);
        s += e;
        sl += e * ((double)l[v] - m);
    }
    *mx = m;
    *lse = m + log(s);
    *mu = m + sl / s;
}

void mtrl_ref_logits_logprob_fwd(int N, int V, const real *logits, const int *targets, real *logp,
                        real *entropy) {
    REF_PAR_FOR(ref_par(REF_FLOPS_EXP * N * V),
        for (int i = 0; i < N; i++) {
            const real *l = logits + (size_t)i * V;
            double m, lse, mu;
            row_softmax_stats_(V, l, &m, &lse, &mu);
            logp[i] = targets[i] >= 0 ? (real)((double)l[targets[i]] - lse) : (real)0;
            if (entropy) entropy[i] = (real)(lse - mu);
        });
}

void mtrl_ref_logits_logprob_bwd(int N, int V, const real *logits, const int *targets, const real *dlogp,
                        const real *dentropy, real *dlogits) {
    REF_PAR_FOR(ref_par(2 * REF_FLOPS_EXP * N * V),
        for (int i = 0; i < N; i++) {
            const real *l = logits + (size_t)i * V;
            real *g = dlogits + (size_t)i * V;
            double m, lse, mu;
            row_softmax_stats_(V, l, &m, &lse, &mu);
            int t = targets[i];
            double c = t >= 0 ? (double)dlogp[i] : 0.0;
            double e = dentropy ? (double)dentropy[i] : 0.0;
            // ∂H/∂l_v = −p_v (l_v − μ);  ∂logp/∂l_v = δ_{v,t} − p_v.
            for (int v = 0; v < V; v++) {
                double lv = (double)l[v];
                double p = exp(lv - lse);
                g[v] = (real)(-c * p - e * p * (lv - mu));
            }
            if (t >= 0) g[t] = (real)((double)g[t] + c);
        });
}

// ---- sampling ------------------------------------------------------------------------------

// Order for the nucleus: higher logit first, ties by lower index (a total order, so the
// nucleus and the walk are deterministic). qsort has no context argument in C11; a
// thread-local pointer keeps concurrent callers apart.
static _Thread_local const real *tl_logits_;
static int sort_desc_tl_(const void *a, const void *b) {
    int i = *(const int *)a, j = *(const int *)b;
    real li = tl_logits_[i], lj = tl_logits_[j];
    if (li > lj) return -1;
    if (li < lj) return 1;
    return (i > j) - (i < j);
}

int mtrl_ref_sample_logits(int V, const real *logits, real temperature, real top_p, double u,
                  real *logp_out) {
    if (V <= 0) return -1;
    int amax = 0;
    for (int v = 1; v < V; v++) if (logits[v] > logits[amax]) amax = v;
    double m = (double)logits[amax];
    if (!(temperature > 0)) {
        if (logp_out) {
            double s = 0.0;
            for (int v = 0; v < V; v++) s += exp((double)logits[v] - m);
            *logp_out = (real)(-log(s));  // logits[amax] − lse
        }
        return amax;
    }
    double invT = 1.0 / (double)temperature;
    // e_v = exp((l_v − max)/T): unnormalised probabilities, the largest is exactly 1.
    double total = 0.0;
    for (int v = 0; v < V; v++) total += exp(((double)logits[v] - m) * invT);
    if (u < 0) u = 0;
    if (!(top_p < 1)) {
        // If rounding leaves the target beyond the last partial sum, the last token with
        // positive mass is taken (never a zero-probability one).
        double target = u * total, cum = 0.0;
        int pick = -1, last_pos = amax;
        for (int v = 0; v < V && pick < 0; v++) {
            double e = exp(((double)logits[v] - m) * invT);
            if (e <= 0) continue;
            last_pos = v;
            cum += e;
            if (cum > target) pick = v;
        }
        if (pick < 0) pick = last_pos;
        if (logp_out) *logp_out = (real)(((double)logits[pick] - m) * invT - log(total));
        return pick;
    }
    // Only tokens with e >= eps can be in the nucleus: the ones below hold less than
    // V·eps = (1 − top_p)·total / 2 of the mass, so the tokens above it already exceed
    // top_p·total. Sorting just those keeps a 160K vocabulary cheap (the nucleus of a peaked
    // distribution is small), and the margin keeps rounding away from the boundary.
    // (e >= eps is tested as l >= m + T·log(eps), one comparison per token.)
    const double eps = 0.5 * (1.0 - (double)top_p) * total / V;
    const double lthr = m + log(eps) / invT;
    int *idx = malloc(sizeof(int) * (size_t)V);
    int ncand = 0;
    for (int v = 0; v < V; v++)
        if ((double)logits[v] >= lthr || v == amax) idx[ncand++] = v;
    tl_logits_ = logits;
    qsort(idx, (size_t)ncand, sizeof(int), sort_desc_tl_);
    tl_logits_ = NULL;
    // Nucleus: the smallest prefix with mass >= top_p · total.
    double need = (double)top_p * total, mass = 0.0;
    int n = 0;
    while (n < ncand) {
        mass += exp(((double)logits[idx[n]] - m) * invT);
        n++;
        if (mass >= need) break;
    }
    double target = u * mass, cum = 0.0;
    int pick = idx[n - 1];
    for (int r = 0; r < n; r++) {
        cum += exp(((double)logits[idx[r]] - m) * invT);
        if (cum > target) { pick = idx[r]; break; }
    }
    free(idx);
    if (logp_out) *logp_out = (real)(((double)logits[pick] - m) * invT - log(mass));
    return pick;
}

// ---- optimizer -----------------------------------------------------------------------------

void mtrl_ref_adamw_update(size_t n, real *param, const real *grad, real *m, real *v, real lr,
                  real beta1, real beta2, real eps, real weight_decay, long step) {
    double b1 = (double)beta1, b2 = (double)beta2;
    double c1 = 1.0 - pow(b1, (double)step), c2 = 1.0 - pow(b2, (double)step);
    REF_PAR_FOR(ref_par(REF_FLOPS_EXP * n),
        for (size_t i = 0; i < n; i++) {
            double g = (double)grad[i];
            double mi = b1 * (double)m[i] + (1.0 - b1) * g;
            double vi = b2 * (double)v[i] + (1.0 - b2) * g * g;
            m[i] = (real)mi;
            v[i] = (real)vi;
            double p = (double)param[i];
            double upd = (mi / c1) / (sqrt(vi / c2) + (double)eps) + (double)weight_decay * p;
            param[i] = (real)(p - (double)lr * upd);
        });
}

double mtrl_ref_grad_sq_norm(size_t n, const real *grad) {
    enum { BLK = 4096 };
    size_t nb = (n + BLK - 1) / BLK;
    if (nb <= 1) {
        double s = 0.0;
        for (size_t i = 0; i < n; i++) s += (double)grad[i] * (double)grad[i];
        return s;
    }
    double *part = malloc(sizeof(double) * nb);
    REF_PAR_FOR(ref_par(2.0 * n),
        for (size_t b = 0; b < nb; b++) {
            size_t i0 = b * BLK, i1 = i0 + BLK < n ? i0 + BLK : n;
            double s = 0.0;
            for (size_t i = i0; i < i1; i++) s += (double)grad[i] * (double)grad[i];
            part[b] = s;
        });
    double s = 0.0;
    for (size_t b = 0; b < nb; b++) s += part[b];
    free(part);
    return s;
}

void mtrl_ref_scale_inplace(size_t n, real *x, real s) {
    REF_PAR_FOR(ref_par(1.0 * n),
        for (size_t i = 0; i < n; i++) x[i] *= s;);
}
