// kda_ref.c: KDA core reference: gate, recurrence + BPTT, decode step, chunked forward/backward.
// See kda_ref.h for shapes and options; the math is model.md §2.1-2.6 and is followed symbol
// for symbol (names in comments are the design's).
#include "kernels/ref/kda_ref.h"

#include "kernels/ref/gemm_ref.h"
#include "kernels/ref/par_ref.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

// ---- small helpers ----------------------------------------------------------------------------

static void *kda_xmalloc_(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "kda_ref: out of memory (%zu bytes)\n", n);
        abort();
    }
    return p;
}

static int kda_thread_count_(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static int kda_thread_id_(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline double kda_sigmoid_(double y) {
    // Two branches so exp never overflows for large |y|.
    if (y >= 0) return 1.0 / (1.0 + exp(-y));
    double e = exp(y);
    return e / (1.0 + e);
}

// ---- gate (§2.1) ------------------------------------------------------------------------------

// softplus as transformers' KimiLinearForgetGate: x itself above 20 (where log1p(e^x) = x
// to within e^-20), and its derivative to match.
static inline double kda_softplus_(double x) { return x > 20.0 ? x : log1p(exp(x)); }
static inline double kda_dsoftplus_(double x) { return x > 20.0 ? 1.0 : kda_sigmoid_(x); }

// One entry of either gate at x = f + dt_bias, a = e^{A_log}: the bounded g_min·σ(a x), or
// Kimi's max(−a softplus(x), bound) (bound = the floor). With dg given, *dx = ∂L/∂x and
// *dA = ∂L/∂A_log (0 where Kimi's floor clamped g).
static inline double kda_gate_at_(int kimi, double a, double x, double bound, double dg, double *dx, double *dA) {
    if (!kimi) {
        double s = kda_sigmoid_(a * x);
        double dy = dg * bound * s * (1.0 - s);  // ∂L/∂(a x)
        *dx = a * dy;
        *dA = a * x * dy;  // ∂(a x)/∂A_log = a x since a = e^{A_log}
        return bound * s;
    }
    double y = -a * kda_softplus_(x);
    if (y < bound) {
        *dx = *dA = 0;
        return bound;
    }
    *dx = -dg * a * kda_dsoftplus_(x);
    *dA = dg * y;  // ∂y/∂A_log = y since y = −e^{A_log} softplus(x)
    return y;
}

static void kda_gate_fwd_(int kimi, int T, int H, int K, const real *f, const real *A_log, const real *dt_bias,
                          real bound, real *g) {
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) {
            double a = exp((double)A_log[h]), dx, dA;
            for (int d = 0; d < K; d++) {
                size_t i = ((size_t)t * H + h) * K + d;
                double x = (double)f[i] + (double)dt_bias[(size_t)h * K + d];
                g[i] = (real)kda_gate_at_(kimi, a, x, (double)bound, 0, &dx, &dA);
            }
        }
}

static void kda_gate_bwd_(int kimi, int T, int H, int K, const real *f, const real *A_log, const real *dt_bias,
                          real bound, const real *dg, real *df, real *dA_log, real *ddt_bias) {
    for (int h = 0; h < H; h++) {
        double a = exp((double)A_log[h]);
        double dA = 0;
        for (int d = 0; d < K; d++) {
            double db = 0;
            for (int t = 0; t < T; t++) {
                size_t i = ((size_t)t * H + h) * K + d;
                double x = (double)f[i] + (double)dt_bias[(size_t)h * K + d], dx, dAt;
                kda_gate_at_(kimi, a, x, (double)bound, (double)dg[i], &dx, &dAt);
                df[i] = (real)dx;
                db += dx;
                dA += dAt;
            }
            ddt_bias[(size_t)h * K + d] += (real)db;
        }
        dA_log[h] += (real)dA;
    }
}

void mtrl_ref_kda_gate_fwd(int T, int H, int K, const real *f, const real *A_log, const real *dt_bias,
                  real g_min, real *g) {
    kda_gate_fwd_(0, T, H, K, f, A_log, dt_bias, g_min, g);
}

void mtrl_ref_kda_gate_bwd(int T, int H, int K, const real *f, const real *A_log, const real *dt_bias,
                  real g_min, const real *dg, real *df, real *dA_log, real *ddt_bias) {
    kda_gate_bwd_(0, T, H, K, f, A_log, dt_bias, g_min, dg, df, dA_log, ddt_bias);
}

void mtrl_ref_kda_gate_kimi_fwd(int T, int H, int K, const real *f, const real *A_log, const real *dt_bias,
                       real g_floor, real *g) {
    kda_gate_fwd_(1, T, H, K, f, A_log, dt_bias, g_floor, g);
}

void mtrl_ref_kda_gate_kimi_bwd(int T, int H, int K, const real *f, const real *A_log, const real *dt_bias,
                       real g_floor, const real *dg, real *df, real *dA_log, real *ddt_bias) {
    kda_gate_bwd_(1, T, H, K, f, A_log, dt_bias, g_floor, dg, df, dA_log, ddt_bias);
}

// ---- recurrence (§2.2) ------------------------------------------------------------------------

// One token of one head, in place on S [K][V]. Every column j of S evolves on its own (the
// decay scales rows, the delta update is rank one), so no scratch is needed.
static void kda_head_step_(int K, int V, const real *q, const real *k, const real *v,
                           const real *g, real beta, real *S, real *o) {
    for (int d = 0; d < K; d++) {
        real e = (real)exp((double)g[d]);
        for (int j = 0; j < V; j++) S[(size_t)d * V + j] *= e;  // S̃ = D_t S
    }
    for (int j = 0; j < V; j++) {
        double kS = 0;
        for (int d = 0; d < K; d++) kS += (double)S[(size_t)d * V + j] * (double)k[d];
        double r = (double)v[j] - kS;  // r_t = v_t − S̃ᵀ k_t
        double br = (double)beta * r;
        double acc = 0;
        for (int d = 0; d < K; d++) {
            real *s = &S[(size_t)d * V + j];
            *s = (real)((double)*s + br * (double)k[d]);  // S_t = S̃ + β k rᵀ
            acc += (double)*s * (double)q[d];
        }
        if (o) o[j] = (real)acc;  // o_t = S_tᵀ q_t
    }
}

void mtrl_ref_kda_step(int H, int K, int V, const real *q, const real *k, const real *v, const real *g,
              const real *beta, real *S, real *o) {
    for (int h = 0; h < H; h++)
        kda_head_step_(K, V, q + (size_t)h * K, k + (size_t)h * K, v + (size_t)h * V,
                       g + (size_t)h * K, beta[h], S + (size_t)h * K * V, o + (size_t)h * V);
}

void mtrl_ref_kda_recurrent_fwd(int T, int H, int K, int V, const real *q, const real *k, const real *v,
                       const real *g, const real *beta, const real *S0, real *o, real *S_final,
                       real *S_all) {
    size_t KV = (size_t)K * V;
    real *state = kda_xmalloc_(sizeof(real) * H * KV);
    if (S0) memcpy(state, S0, sizeof(real) * H * KV);
    else memset(state, 0, sizeof(real) * H * KV);
    REF_PAR_FOR(ref_par(6.0 * T * H * KV),
        for (int h = 0; h < H; h++) {
            real *S = state + h * KV;
            if (S_all) memcpy(S_all + (size_t)h * KV, S, sizeof(real) * KV);
            for (int t = 0; t < T; t++) {
                size_t th = (size_t)t * H + h;
                kda_head_step_(K, V, q + th * K, k + th * K, v + th * V, g + th * K, beta[th], S,
                               o + th * V);
                if (S_all) memcpy(S_all + ((size_t)(t + 1) * H + h) * KV, S, sizeof(real) * KV);
            }
        });
    if (S_final) memcpy(S_final, state, sizeof(real) * H * KV);
    free(state);
}

// BPTT of one head over tokens t0 .. t1−1: the state before token t (t0 <= t <= t1) is at
// S_all + (t − t0)·s_stride ([K][V]); dS [K][V] holds ∂L/∂S_{t1} on entry and ∂L/∂S_{t0} on
// return. Scratch: St [K][V], r and dr [V]. Writes dq, dk, dg, dv, dbeta at the tokens' rows.
static void kda_head_bptt_(int H, int K, int V, int h, int t0, int t1, const real *q, const real *k,
                           const real *v, const real *g, const real *beta, const real *S_all,
                           size_t s_stride, const real *dout, real *dS, real *St, real *r, real *dr,
                           real *dq, real *dk, real *dv, real *dg, real *dbeta) {
    for (int t = t1 - 1; t >= t0; t--) {
        size_t th = (size_t)t * H + h;
        const real *qt = q + th * K, *kt = k + th * K, *vt = v + th * V, *gt = g + th * K;
        const real *dot = dout + th * V;
        const real *Sp = S_all + (size_t)(t - t0) * s_stride;      // S_{t-1}
        const real *Sc = S_all + (size_t)(t + 1 - t0) * s_stride;  // S_t
        double bt = (double)beta[th];
        for (int d = 0; d < K; d++) {  // S̃ = D_t S_{t-1}
            real e = (real)exp((double)gt[d]);
            for (int j = 0; j < V; j++) St[(size_t)d * V + j] = Sp[(size_t)d * V + j] * e;
        }
        for (int j = 0; j < V; j++) {  // r = v − S̃ᵀ k
            double acc = 0;
            for (int d = 0; d < K; d++) acc += (double)St[(size_t)d * V + j] * (double)kt[d];
            r[j] = (real)((double)vt[j] - acc);
        }
        for (int d = 0; d < K; d++) {  // dS += q doᵀ;  dq = S_t do
            double acc = 0;
            for (int j = 0; j < V; j++) {
                real *s = &dS[(size_t)d * V + j];
                *s = (real)((double)*s + (double)qt[d] * (double)dot[j]);
                acc += (double)Sc[(size_t)d * V + j] * (double)dot[j];
            }
            dq[th * K + d] = (real)acc;
        }
        for (int j = 0; j < V; j++) {  // dr = β dSᵀ k;  dv = dr
            double acc = 0;
            for (int d = 0; d < K; d++) acc += (double)dS[(size_t)d * V + j] * (double)kt[d];
            dr[j] = (real)(bt * acc);
            dv[th * V + j] = dr[j];
        }
        double db = 0;
        for (int d = 0; d < K; d++) {
            double dSr = 0, Sdr = 0, dgd = 0;
            for (int j = 0; j < V; j++) {
                size_t i = (size_t)d * V + j;
                dSr += (double)dS[i] * (double)r[j];    // (dS r)_d
                Sdr += (double)St[i] * (double)dr[j];   // (S̃ dr)_d
                // dS̃ = dS − k drᵀ, formed in place; dg = rowsum(S̃ ⊙ dS̃)
                dS[i] = (real)((double)dS[i] - (double)kt[d] * (double)dr[j]);
                dgd += (double)St[i] * (double)dS[i];
            }
            db += (double)kt[d] * dSr;              // dβ = kᵀ dS r
            dk[th * K + d] = (real)(bt * dSr - Sdr);  // dk = β dS r − S̃ dr
            dg[th * K + d] = (real)dgd;
            real e = (real)exp((double)gt[d]);     // dS ← D_t dS̃
            for (int j = 0; j < V; j++) dS[(size_t)d * V + j] *= e;
        }
        dbeta[th] = (real)db;
    }
}

void mtrl_ref_kda_recurrent_bwd(int T, int H, int K, int V, const real *q, const real *k, const real *v,
                       const real *g, const real *beta, const real *S_all, const real *dout,
                       const real *dS_final, real *dq, real *dk, real *dv, real *dg, real *dbeta,
                       real *dS0) {
    size_t KV = (size_t)K * V;
    int nth = kda_thread_count_();
    // Per thread: dS [K][V], S̃ [K][V], r [V], dr [V].
    size_t per = 2 * KV + 2 * (size_t)V;
    real *pool = kda_xmalloc_(sizeof(real) * per * nth);
    REF_PAR_FOR(ref_par(14.0 * T * H * KV),
        for (int h = 0; h < H; h++) {
            real *dS = pool + per * kda_thread_id_();
            real *St = dS + KV, *r = St + KV, *dr = r + V;
            if (dS_final) memcpy(dS, dS_final + h * KV, sizeof(real) * KV);
            else memset(dS, 0, sizeof(real) * KV);
            kda_head_bptt_(H, K, V, h, 0, T, q, k, v, g, beta, S_all + h * KV, (size_t)H * KV, dout, dS,
                           St, r, dr, dq, dk, dv, dg, dbeta);
            if (dS0) memcpy(dS0 + h * KV, dS, sizeof(real) * KV);
        });
    free(pool);
}

// ---- UT transform (§2.3) ----------------------------------------------------------------------

void mtrl_ref_kda_ut_solve(int c, const real *M, int ldm, real *T, int ldt, int method) {
    if (c <= 0) return;
    if (c > KDA_TILE) {
        fprintf(stderr, "kda_ut_solve: c = %d > %d\n", c, KDA_TILE);
        abort();
    }
    for (int i = 0; i < c; i++)
        for (int j = 0; j < c; j++) T[(size_t)i * ldt + j] = 0;
    if (method == KDA_SOLVE_NILPOTENT) {
        // T = (I − M)(I + M²)(I + M⁴)(I + M⁸): Σ_{i<16} (−M)^i, exact because M^c = 0. The
        // squarings stop once the product covers every power below c.
        real Mp[KDA_TILE * KDA_TILE], Mq[KDA_TILE * KDA_TILE], Y[KDA_TILE * KDA_TILE];
        const int L = KDA_TILE;
        for (int i = 0; i < c; i++)
            for (int j = 0; j < c; j++) {
                real m = j < i ? M[(size_t)i * ldm + j] : 0;  // strictly lower part only
                Mp[i * L + j] = m;
                T[(size_t)i * ldt + j] = (i == j ? 1 : 0) - m;
            }
        for (int p = 2; p < c; p *= 2) {
            mtrl_ref_gemm(0, 0, c, c, c, 1, Mp, L, Mp, L, 0, Mq, L);  // M^p = (M^{p/2})²
            memcpy(Mp, Mq, sizeof Mp);
            mtrl_ref_gemm(0, 0, c, c, c, 1, T, ldt, Mp, L, 0, Y, L);  // T ← T (I + M^p)
            for (int i = 0; i < c; i++)
                for (int j = 0; j < c; j++) T[(size_t)i * ldt + j] += Y[i * L + j];
        }
        // The product is lower triangular in exact arithmetic; rounding leaves exact zeros
        // above the diagonal too (every factor is lower triangular), but pin it for clarity.
        for (int i = 0; i < c; i++) {
            T[(size_t)i * ldt + i] = 1;
            for (int j = i + 1; j < c; j++) T[(size_t)i * ldt + j] = 0;
        }
    } else {
        // Forward substitution: T_ii = 1, T_{i,0:i} = −M_{i,0:i} T_{0:i,0:i}.
        T[0] = 1;
        for (int i = 1; i < c; i++) {
            mtrl_ref_gemm(0, 0, 1, i, i, -1, M + (size_t)i * ldm, ldm, T, ldt, 0, T + (size_t)i * ldt,
                     ldt);
            T[(size_t)i * ldt + i] = 1;
        }
    }
}

// ---- chunked form (§2.3, §2.4, §2.6) ----------------------------------------------------------

typedef struct {
    int H, K, V;
    int CS;       // rows of a chunk: 16, or 64 for §2.6
    int ref, solve, pad;
} kda_cfg_;

// Scratch of one thread for one chunk of CS rows. Names follow model.md §2.3/2.4.
typedef struct {
    real *Q, *Kk, *G, *Vv, *b;          // gathered chunk (padded rows zero); G = cumsum_rows(g)
    real *Qp, *Kp, *Kb, *Ke, *Vb;       // Q⁺, K⁺, diag(β)K⁺, K^e, diag(β)V
    real *gam, *rho;                    // γ = G_{c−1}; the reference row of a block
    real *X, *M, *P, *Tm;               // X = unmasked K̂⁺K̂⁻ᵀ; M, P, T (c x c, stride CS)
    real *Y;                            // c x c product scratch
    real *W, *U, *D, *O;                // W, U, Δ, O
    real *A, *Qh, *eA, *B, *eB;         // one block row: K̂⁺, Q̂⁺, e^{G−ρ}; strip K̂⁻, e^{ρ−G}
    real *S;                            // running state [K][V]
    // backward
    real *dO, *dD, *dQp, *dKe, *dW, *YW, *YU, *dT, *tmp, *dM, *dP;
    real *dQ, *dK, *dG, *dV, *db, *dA, *dQh, *dB, *dS, *dSp, *dgam;
} kda_ws_;

// Carves one thread's workspace from `base` (NULL: only counts). Returns the element count.
static size_t kda_ws_carve_(const kda_cfg_ *cf, int bwd, real *base, kda_ws_ *w) {
    size_t CS = cf->CS, K = cf->K, V = cf->V, n = 0;
    kda_ws_ dummy;
    if (!w) w = &dummy;
#define KDA_TAKE_(field, count) \
    do { w->field = base ? base + n : NULL; n += (size_t)(count); } while (0)
    KDA_TAKE_(Q, CS * K); KDA_TAKE_(Kk, CS * K); KDA_TAKE_(G, CS * K); KDA_TAKE_(Vv, CS * V);
    KDA_TAKE_(b, CS);
    KDA_TAKE_(Qp, CS * K); KDA_TAKE_(Kp, CS * K); KDA_TAKE_(Kb, CS * K); KDA_TAKE_(Ke, CS * K);
    KDA_TAKE_(Vb, CS * V); KDA_TAKE_(gam, K); KDA_TAKE_(rho, K);
    KDA_TAKE_(X, CS * CS); KDA_TAKE_(M, CS * CS); KDA_TAKE_(P, CS * CS); KDA_TAKE_(Tm, CS * CS);
    KDA_TAKE_(Y, CS * CS);
    KDA_TAKE_(W, CS * K); KDA_TAKE_(U, CS * V); KDA_TAKE_(D, CS * V); KDA_TAKE_(O, CS * V);
    KDA_TAKE_(A, KDA_TILE * K); KDA_TAKE_(Qh, KDA_TILE * K); KDA_TAKE_(eA, KDA_TILE * K);
    KDA_TAKE_(B, CS * K); KDA_TAKE_(eB, CS * K);
    KDA_TAKE_(S, K * V);
    if (bwd) {
        KDA_TAKE_(dO, CS * V); KDA_TAKE_(dD, CS * V); KDA_TAKE_(dQp, CS * K);
        KDA_TAKE_(dKe, CS * K); KDA_TAKE_(dW, CS * K); KDA_TAKE_(YW, CS * K);
        KDA_TAKE_(YU, CS * V); KDA_TAKE_(dT, CS * CS); KDA_TAKE_(tmp, CS * CS);
        KDA_TAKE_(dM, CS * CS); KDA_TAKE_(dP, CS * CS);
        KDA_TAKE_(dQ, CS * K); KDA_TAKE_(dK, CS * K); KDA_TAKE_(dG, CS * K);
        KDA_TAKE_(dV, CS * V); KDA_TAKE_(db, CS);
        KDA_TAKE_(dA, KDA_TILE * K); KDA_TAKE_(dQh, KDA_TILE * K); KDA_TAKE_(dB, CS * K);
        KDA_TAKE_(dS, K * V); KDA_TAKE_(dSp, K * V); KDA_TAKE_(dgam, K);
    }
#undef KDA_TAKE_
    return n;
}

static void kda_cfg_init_(kda_cfg_ *cf, int H, int K, int V, const kda_chunk_opts *opts) {
    kda_chunk_opts o = {0};
    if (opts) o = *opts;
    cf->H = H;
    cf->K = K;
    cf->V = V;
    cf->CS = o.chunk == KDA_SUPER_CHUNK ? KDA_SUPER_CHUNK : KDA_TILE;
    if (o.chunk != 0 && o.chunk != KDA_TILE && o.chunk != KDA_SUPER_CHUNK) {
        fprintf(stderr, "kda_chunk: chunk = %d (want 0, 16 or 64)\n", o.chunk);
        abort();
    }
    cf->ref = o.ref;
    cf->solve = o.solve;
    cf->pad = o.pad_tail;
}

int mtrl_ref_kda_chunk_state_count(int T, const kda_chunk_opts *opts) {
    int CS = opts && opts->chunk == KDA_SUPER_CHUNK ? KDA_SUPER_CHUNK : KDA_TILE;
    return T > 0 ? (T + CS - 1) / CS : 0;
}

// Copies rows t0 .. t0+cr−1 of head h into the workspace; rows cr .. c−1 (padding) are zero,
// β = 0 and g = 0 there, which leaves every real output and S' unchanged (§2.3).
static void kda_gather_(const kda_cfg_ *cf, kda_ws_ *w, int h, int t0, int cr, int c,
                        const real *q, const real *k, const real *v, const real *g,
                        const real *beta) {
    int H = cf->H, K = cf->K, V = cf->V;
    for (int r = 0; r < c; r++) {
        if (r < cr) {
            size_t th = (size_t)(t0 + r) * H + h;
            memcpy(w->Q + (size_t)r * K, q + th * K, sizeof(real) * K);
            memcpy(w->Kk + (size_t)r * K, k + th * K, sizeof(real) * K);
            memcpy(w->G + (size_t)r * K, g + th * K, sizeof(real) * K);
            memcpy(w->Vv + (size_t)r * V, v + th * V, sizeof(real) * V);
            w->b[r] = beta[th];
        } else {
            memset(w->Q + (size_t)r * K, 0, sizeof(real) * K);
            memset(w->Kk + (size_t)r * K, 0, sizeof(real) * K);
            memset(w->G + (size_t)r * K, 0, sizeof(real) * K);
            memset(w->Vv + (size_t)r * V, 0, sizeof(real) * V);
            w->b[r] = 0;
        }
    }
}

// Fills the scaled operands of block row I (rows nI .. nI+cI−1) and of the key strip
// j0 .. j0+nj−1 for the reference row w->rho:
//     A = K̂⁺ = K ⊙ e^{G−ρ}, Qh = Q̂⁺ = Q ⊙ e^{G−ρ}   (block rows),   B = K̂⁻ = K ⊙ e^{ρ−G} (strip)
// The factors are kept (eA, eB) so the backward can unscale without another exp.
static void kda_block_scale_(const kda_cfg_ *cf, kda_ws_ *w, int nI, int cI, int j0, int nj) {
    int K = cf->K;
    for (int r = 0; r < cI; r++)
        for (int d = 0; d < K; d++) {
            size_t i = (size_t)(nI + r) * K + d, l = (size_t)r * K + d;
            real e = (real)exp((double)w->G[i] - (double)w->rho[d]);
            w->eA[l] = e;
            w->A[l] = w->Kk[i] * e;
            w->Qh[l] = w->Q[i] * e;
        }
    for (int j = 0; j < nj; j++)
        for (int d = 0; d < K; d++) {
            size_t i = (size_t)(j0 + j) * K + d, l = (size_t)j * K + d;
            real e = (real)exp((double)w->rho[d] - (double)w->G[i]);
            w->eB[l] = e;
            w->B[l] = w->Kk[i] * e;
        }
}

// Sets w->rho to the reference of block row I. diag: the diagonal 16x16 block, referenced at
// its midpoint m = nI + min(8, cI−1) or at its incoming boundary (G_{nI−1}, 0 for the first
// block). Off-diagonal strip (§2.6): row nI, so both exponents are <= 0.
static void kda_block_ref_(const kda_cfg_ *cf, kda_ws_ *w, int nI, int cI, int diag) {
    int K = cf->K;
    int row;
    if (!diag) row = nI;
    else if (cf->ref == KDA_REF_START) row = nI - 1;
    else row = nI + (cI - 1 < 8 ? cI - 1 : 8);
    if (row < 0) memset(w->rho, 0, sizeof(real) * K);
    else memcpy(w->rho, w->G + (size_t)row * K, sizeof(real) * K);
}

// Everything of one chunk that does not depend on the incoming state: G, the scaled operands,
// M, P, T, W, U (§2.3; §2.6 for c > 16). Expects the chunk gathered into w (c rows).
static void kda_chunk_prepare_(const kda_cfg_ *cf, kda_ws_ *w, int c) {
    int K = cf->K, V = cf->V, CS = cf->CS;
    // G = cumsum_rows(g), summed in double so long chunks do not drift.
    for (int d = 0; d < K; d++) {
        double acc = 0;
        for (int r = 0; r < c; r++) {
            acc += (double)w->G[(size_t)r * K + d];
            w->G[(size_t)r * K + d] = (real)acc;
        }
    }
    memcpy(w->gam, w->G + (size_t)(c - 1) * K, sizeof(real) * K);
    // Inter-chunk operands; every exponent is <= 0.
    for (int r = 0; r < c; r++) {
        for (int d = 0; d < K; d++) {
            size_t i = (size_t)r * K + d;
            real eg = (real)exp((double)w->G[i]);
            real ee = (real)exp((double)w->gam[d] - (double)w->G[i]);
            w->Qp[i] = w->Q[i] * eg;
            w->Kp[i] = w->Kk[i] * eg;
            w->Kb[i] = w->b[r] * w->Kp[i];
            w->Ke[i] = w->Kk[i] * ee;
        }
        for (int j = 0; j < V; j++) w->Vb[(size_t)r * V + j] = w->b[r] * w->Vv[(size_t)r * V + j];
    }
    // X = K̂⁺K̂⁻ᵀ and P = Q̂⁺K̂⁻ᵀ, one block row at a time: the diagonal block with its own
    // reference, then the strip to its left (only for 64-row chunks).
    for (int nI = 0; nI < c; nI += KDA_TILE) {
        int cI = c - nI < KDA_TILE ? c - nI : KDA_TILE;
        kda_block_ref_(cf, w, nI, cI, 1);
        kda_block_scale_(cf, w, nI, cI, nI, cI);
        mtrl_ref_gemm(0, 1, cI, cI, K, 1, w->A, K, w->B, K, 0, w->X + (size_t)nI * CS + nI, CS);
        mtrl_ref_gemm(0, 1, cI, cI, K, 1, w->Qh, K, w->B, K, 0, w->P + (size_t)nI * CS + nI, CS);
        if (nI > 0) {
            kda_block_ref_(cf, w, nI, cI, 0);
            kda_block_scale_(cf, w, nI, cI, 0, nI);
            mtrl_ref_gemm(0, 1, cI, nI, K, 1, w->A, K, w->B, K, 0, w->X + (size_t)nI * CS, CS);
            mtrl_ref_gemm(0, 1, cI, nI, K, 1, w->Qh, K, w->B, K, 0, w->P + (size_t)nI * CS, CS);
        }
    }
    // Mask by select, never by multiply: the discarded upper entries of the diagonal blocks
    // may be large (up to e^{75} with the start reference) and blocks right of the diagonal
    // were never written. M = StrictTril(diag(β) X), P = Tril(P).
    for (int i = 0; i < c; i++)
        for (int j = 0; j < c; j++) {
            size_t l = (size_t)i * CS + j;
            if (j >= i) w->X[l] = 0;
            w->M[l] = j < i ? w->b[i] * w->X[l] : 0;
            if (j > i) w->P[l] = 0;
        }
    // T = (I + M)^{-1} by block forward substitution (§2.6): T_II from the tile solver, then
    // T_{I,0:nI} = −T_II M_{I,0:nI} T_{0:nI,0:nI} (T is lower triangular, so the product sums
    // exactly over J <= K < I).
    for (int i = 0; i < c; i++) memset(w->Tm + (size_t)i * CS, 0, sizeof(real) * c);
    for (int nI = 0; nI < c; nI += KDA_TILE) {
        int cI = c - nI < KDA_TILE ? c - nI : KDA_TILE;
        real *TII = w->Tm + (size_t)nI * CS + nI;
        mtrl_ref_kda_ut_solve(cI, w->M + (size_t)nI * CS + nI, CS, TII, CS, cf->solve);
        if (nI > 0) {
            mtrl_ref_gemm(0, 0, cI, nI, nI, 1, w->M + (size_t)nI * CS, CS, w->Tm, CS, 0, w->Y, CS);
            mtrl_ref_gemm(0, 0, cI, nI, cI, -1, TII, CS, w->Y, CS, 0, w->Tm + (size_t)nI * CS, CS);
        }
    }
    // W = T diag(β)K⁺, U = T diag(β)V.
    mtrl_ref_gemm(0, 0, c, K, c, 1, w->Tm, CS, w->Kb, K, 0, w->W, K);
    mtrl_ref_gemm(0, 0, c, V, c, 1, w->Tm, CS, w->Vb, V, 0, w->U, V);
}

// Δ = U − W S for the chunk's incoming state S.
static void kda_chunk_delta_(const kda_cfg_ *cf, kda_ws_ *w, int c, const real *S) {
    int K = cf->K, V = cf->V;
    memcpy(w->D, w->U, sizeof(real) * (size_t)c * V);
    mtrl_ref_gemm(0, 0, c, V, K, -1, w->W, K, S, V, 1, w->D, V);
}

// 1 when every log-decay of head h in tokens t0 .. t0+cr−1 is >= KDA_G_CHUNK_MIN, the range of
// the factored chunk form; a chunk outside it runs the token recurrence instead (same math).
static int kda_chunk_in_range_(int H, int K, int h, int t0, int cr, const real *g) {
    for (int r = 0; r < cr; r++) {
        const real *gt = g + ((size_t)(t0 + r) * H + h) * K;
        for (int d = 0; d < K; d++)
            if (!(gt[d] >= (real)KDA_G_CHUNK_MIN)) return 0;
    }
    return 1;
}

// Forward of head h over all chunks (§2.3). S0h: [K][V] or NULL; o: [T][H][V] or NULL;
// Sf: [K][V] or NULL; St: [nchunks][H][K][V] or NULL (incoming state of each chunk).
static void kda_head_fwd_(const kda_cfg_ *cf, kda_ws_ *w, int T, int h, const real *q,
                          const real *k, const real *v, const real *g, const real *beta,
                          const real *S0h, real *o, real *Sf, real *St) {
    int H = cf->H, K = cf->K, V = cf->V, CS = cf->CS;
    size_t KV = (size_t)K * V;
    real *S = w->S;
    if (S0h) memcpy(S, S0h, sizeof(real) * KV);
    else memset(S, 0, sizeof(real) * KV);
    for (int n = 0, t0 = 0; t0 < T; n++, t0 += CS) {
        int cr = T - t0 < CS ? T - t0 : CS;
        int c = cf->pad ? CS : cr;
        if (St) memcpy(St + ((size_t)n * H + h) * KV, S, sizeof(real) * KV);
        if (!kda_chunk_in_range_(H, K, h, t0, cr, g)) {  // the token recurrence, exact for any decay
            for (int r = 0; r < cr; r++) {
                size_t th = (size_t)(t0 + r) * H + h;
                kda_head_step_(K, V, q + th * K, k + th * K, v + th * V, g + th * K, beta[th], S,
                               o ? o + th * V : NULL);
            }
            continue;
        }
        kda_gather_(cf, w, h, t0, cr, c, q, k, v, g, beta);
        kda_chunk_prepare_(cf, w, c);
        kda_chunk_delta_(cf, w, c, S);
        // O = Q⁺ S + P Δ
        mtrl_ref_gemm(0, 0, c, V, K, 1, w->Qp, K, S, V, 0, w->O, V);
        mtrl_ref_gemm(0, 0, c, V, c, 1, w->P, CS, w->D, V, 1, w->O, V);
        // S' = diag(e^γ) S + K^eᵀ Δ
        for (int d = 0; d < K; d++) {
            real e = (real)exp((double)w->gam[d]);
            for (int j = 0; j < V; j++) S[(size_t)d * V + j] *= e;
        }
        mtrl_ref_gemm(1, 0, K, V, c, 1, w->Ke, K, w->D, V, 1, S, V);
        if (o)
            for (int r = 0; r < cr; r++)
                memcpy(o + ((size_t)(t0 + r) * H + h) * V, w->O + (size_t)r * V,
                       sizeof(real) * V);
    }
    if (Sf) memcpy(Sf, S, sizeof(real) * KV);
}

// Accumulates the gradient of one block of X = K̂⁺K̂⁻ᵀ and P = Q̂⁺K̂⁻ᵀ (rows nI.., key strip
// j0 .. j0+nj−1) into dQ, dK and dG (∂L/∂G), with w->dM = diag(β) dM and w->dP given:
//     dK̂⁺ = diag(β) dM K̂⁻,  dQ̂⁺ = dP K̂⁻,  dK̂⁻ = (diag(β) dM)ᵀ K̂⁺ + dPᵀ Q̂⁺
// then back through X = K ⊙ e^{±(G−ρ)}, with ρ a constant (it cancels in every product). Each
// X ⊙ dX is formed as unscaled ⊙ (dX ⊙ factor), so no product of two large factors is rounded.
static void kda_block_bwd_(const kda_cfg_ *cf, kda_ws_ *w, int nI, int cI, int j0, int nj) {
    int K = cf->K, CS = cf->CS;
    kda_block_scale_(cf, w, nI, cI, j0, nj);
    const real *dMb = w->dM + (size_t)nI * CS + j0, *dP = w->dP + (size_t)nI * CS + j0;
    mtrl_ref_gemm(0, 0, cI, K, nj, 1, dMb, CS, w->B, K, 0, w->dA, K);
    mtrl_ref_gemm(0, 0, cI, K, nj, 1, dP, CS, w->B, K, 0, w->dQh, K);
    mtrl_ref_gemm(1, 0, nj, K, cI, 1, dMb, CS, w->A, K, 0, w->dB, K);
    mtrl_ref_gemm(1, 0, nj, K, cI, 1, dP, CS, w->Qh, K, 1, w->dB, K);
    for (int r = 0; r < cI; r++)
        for (int d = 0; d < K; d++) {
            size_t i = (size_t)(nI + r) * K + d, l = (size_t)r * K + d;
            real ta = w->dA[l] * w->eA[l], tq = w->dQh[l] * w->eA[l];
            w->dK[i] += ta;
            w->dQ[i] += tq;
            w->dG[i] += w->Kk[i] * ta + w->Q[i] * tq;
        }
    for (int j = 0; j < nj; j++)
        for (int d = 0; d < K; d++) {
            size_t i = (size_t)(j0 + j) * K + d, l = (size_t)j * K + d;
            real tb = w->dB[l] * w->eB[l];
            w->dK[i] += tb;
            w->dG[i] -= w->Kk[i] * tb;
        }
}

// Backward of one chunk (§2.4). On entry w->S is the chunk's incoming state, w->dS = ∂L/∂S'
// and w->dO the gathered ∂L/∂O; on exit w->dSp = ∂L/∂S (for the previous chunk) and dQ, dK,
// dV, dG (already reverse-cumsummed into ∂L/∂g), db hold the chunk's input gradients.
static void kda_chunk_bwd_(const kda_cfg_ *cf, kda_ws_ *w, int c) {
    int K = cf->K, V = cf->V, CS = cf->CS;
    const real *S = w->S, *dS = w->dS;
    kda_chunk_prepare_(cf, w, c);
    kda_chunk_delta_(cf, w, c, S);
    // dΔ = Pᵀ dO + K^e dS'
    mtrl_ref_gemm(1, 0, c, V, c, 1, w->P, CS, w->dO, V, 0, w->dD, V);
    mtrl_ref_gemm(0, 0, c, V, K, 1, w->Ke, K, dS, V, 1, w->dD, V);
    // dS_prev = diag(e^γ) dS' + Q⁺ᵀ dO − Wᵀ dΔ;  dγ_S = e^γ ⊙ rowsum(S ⊙ dS')
    for (int d = 0; d < K; d++) {
        double e = exp((double)w->gam[d]), acc = 0;
        for (int j = 0; j < V; j++) {
            size_t i = (size_t)d * V + j;
            w->dSp[i] = (real)(e * (double)dS[i]);
            acc += (double)S[i] * (double)dS[i];
        }
        w->dgam[d] = (real)(e * acc);
    }
    mtrl_ref_gemm(1, 0, K, V, c, 1, w->Qp, K, w->dO, V, 1, w->dSp, V);
    mtrl_ref_gemm(1, 0, K, V, c, -1, w->W, K, w->dD, V, 1, w->dSp, V);
    // dP = Tril(dO Δᵀ);  dQ⁺ = dO Sᵀ;  dK^e = Δ dS'ᵀ;  dW = −dΔ Sᵀ;  Y_W = Tᵀ dW;  Y_U = Tᵀ dΔ
    mtrl_ref_gemm(0, 1, c, c, V, 1, w->dO, V, w->D, V, 0, w->dP, CS);
    mtrl_ref_gemm(0, 1, c, K, V, 1, w->dO, V, S, V, 0, w->dQp, K);
    mtrl_ref_gemm(0, 1, c, K, V, 1, w->D, V, dS, V, 0, w->dKe, K);
    mtrl_ref_gemm(0, 1, c, K, V, -1, w->dD, V, S, V, 0, w->dW, K);
    mtrl_ref_gemm(1, 0, c, K, c, 1, w->Tm, CS, w->dW, K, 0, w->YW, K);
    mtrl_ref_gemm(1, 0, c, V, c, 1, w->Tm, CS, w->dD, V, 0, w->YU, V);
    // dT = dW (diag(β)K⁺)ᵀ + dΔ (diag(β)V)ᵀ;  dM = StrictTril(−Tᵀ dT Tᵀ)
    mtrl_ref_gemm(0, 1, c, c, K, 1, w->dW, K, w->Kb, K, 0, w->dT, CS);
    mtrl_ref_gemm(0, 1, c, c, V, 1, w->dD, V, w->Vb, V, 1, w->dT, CS);
    mtrl_ref_gemm(1, 0, c, c, c, 1, w->Tm, CS, w->dT, CS, 0, w->tmp, CS);
    mtrl_ref_gemm(0, 1, c, c, c, -1, w->tmp, CS, w->Tm, CS, 0, w->dM, CS);
    // Masks, dβ, and dM ← diag(β) dM (the form every use below needs).
    for (int i = 0; i < c; i++) {
        double db = 0;
        for (int d = 0; d < K; d++)
            db += (double)w->Kp[(size_t)i * K + d] * (double)w->YW[(size_t)i * K + d];
        for (int j = 0; j < V; j++)
            db += (double)w->Vv[(size_t)i * V + j] * (double)w->YU[(size_t)i * V + j];
        for (int j = 0; j < c; j++) {
            size_t l = (size_t)i * CS + j;
            if (j < i) {
                db += (double)w->dM[l] * (double)w->X[l];
                w->dM[l] *= w->b[i];
            } else {
                w->dM[l] = 0;
            }
            if (j > i) w->dP[l] = 0;
        }
        w->db[i] = (real)db;
        for (int j = 0; j < V; j++)  // dV = diag(β) Y_U
            w->dV[(size_t)i * V + j] = w->b[i] * w->YU[(size_t)i * V + j];
    }
    // Inter-chunk operands back to unscaled inputs:
    //   dQ = dQ⁺ ⊙ e^G, dK = β Y_W ⊙ e^G + dK^e ⊙ e^{γ−G},
    //   dG = Q⊙(dQ⁺e^G) + K⊙(βY_W e^G) − K⊙(dK^e e^{γ−G}),  dγ += colsum K⊙(dK^e e^{γ−G}).
    for (int r = 0; r < c; r++)
        for (int d = 0; d < K; d++) {
            size_t i = (size_t)r * K + d;
            real eg = (real)exp((double)w->G[i]);
            real ee = (real)exp((double)w->gam[d] - (double)w->G[i]);
            real tq = w->dQp[i] * eg, tk = w->b[r] * w->YW[i] * eg, te = w->dKe[i] * ee;
            w->dQ[i] = tq;
            w->dK[i] = tk + te;
            w->dG[i] = w->Q[i] * tq + w->Kk[i] * tk - w->Kk[i] * te;
            w->dgam[d] += w->Kk[i] * te;
        }
    // Intra-chunk blocks of M and P, with the same references as the forward.
    for (int nI = 0; nI < c; nI += KDA_TILE) {
        int cI = c - nI < KDA_TILE ? c - nI : KDA_TILE;
        kda_block_ref_(cf, w, nI, cI, 1);
        kda_block_bwd_(cf, w, nI, cI, nI, cI);
        if (nI > 0) {
            kda_block_ref_(cf, w, nI, cI, 0);
            kda_block_bwd_(cf, w, nI, cI, 0, nI);
        }
    }
    // γ is the last row of G; then dg_r = Σ_{r' >= r} dG_{r'}.
    for (int d = 0; d < K; d++) {
        w->dG[(size_t)(c - 1) * K + d] += w->dgam[d];
        double acc = 0;
        for (int r = c - 1; r >= 0; r--) {
            acc += (double)w->dG[(size_t)r * K + d];
            w->dG[(size_t)r * K + d] = (real)acc;
        }
    }
}

// Backward of head h over all chunks, last to first. St: [nchunks][H][K][V] incoming states.
static void kda_head_bwd_(const kda_cfg_ *cf, kda_ws_ *w, int T, int h, const real *q,
                          const real *k, const real *v, const real *g, const real *beta,
                          const real *St, const real *dout, const real *dSf, real *dq, real *dk,
                          real *dv, real *dg, real *dbeta, real *dS0h) {
    int H = cf->H, K = cf->K, V = cf->V, CS = cf->CS;
    size_t KV = (size_t)K * V;
    int nch = (T + CS - 1) / CS;
    if (dSf) memcpy(w->dS, dSf, sizeof(real) * KV);
    else memset(w->dS, 0, sizeof(real) * KV);
    real *rec = NULL;  // a chunk out of range: its CS+1 states, S̃, r, dr (allocated on first use)
    for (int n = nch - 1; n >= 0; n--) {
        int t0 = n * CS;
        int cr = T - t0 < CS ? T - t0 : CS;
        int c = cf->pad ? CS : cr;
        if (!kda_chunk_in_range_(H, K, h, t0, cr, g)) {  // BPTT from the chunk's incoming state
            if (!rec) rec = kda_xmalloc_(sizeof(real) * ((size_t)(CS + 2) * KV + 2 * (size_t)V));
            real *Sa = rec, *Sx = rec + (size_t)(CS + 1) * KV, *r = Sx + KV, *dr = r + V;
            memcpy(Sa, St + ((size_t)n * H + h) * KV, sizeof(real) * KV);
            for (int i = 0; i < cr; i++) {
                size_t th = (size_t)(t0 + i) * H + h;
                memcpy(Sa + (size_t)(i + 1) * KV, Sa + (size_t)i * KV, sizeof(real) * KV);
                kda_head_step_(K, V, q + th * K, k + th * K, v + th * V, g + th * K, beta[th],
                               Sa + (size_t)(i + 1) * KV, NULL);
            }
            kda_head_bptt_(H, K, V, h, t0, t0 + cr, q, k, v, g, beta, Sa, KV, dout, w->dS, Sx, r, dr,
                           dq, dk, dv, dg, dbeta);
            continue;
        }
        memcpy(w->S, St + ((size_t)n * H + h) * KV, sizeof(real) * KV);
        kda_gather_(cf, w, h, t0, cr, c, q, k, v, g, beta);
        for (int r = 0; r < c; r++) {
            if (r < cr)
                memcpy(w->dO + (size_t)r * V, dout + ((size_t)(t0 + r) * H + h) * V,
                       sizeof(real) * V);
            else
                memset(w->dO + (size_t)r * V, 0, sizeof(real) * V);
        }
        kda_chunk_bwd_(cf, w, c);
        for (int r = 0; r < cr; r++) {
            size_t th = (size_t)(t0 + r) * H + h;
            memcpy(dq + th * K, w->dQ + (size_t)r * K, sizeof(real) * K);
            memcpy(dk + th * K, w->dK + (size_t)r * K, sizeof(real) * K);
            memcpy(dg + th * K, w->dG + (size_t)r * K, sizeof(real) * K);
            memcpy(dv + th * V, w->dV + (size_t)r * V, sizeof(real) * V);
            dbeta[th] = w->db[r];
        }
        memcpy(w->dS, w->dSp, sizeof(real) * KV);
    }
    free(rec);
    if (dS0h) memcpy(dS0h, w->dS, sizeof(real) * KV);
}

// ---- public entry points ----------------------------------------------------------------------

void mtrl_ref_kda_chunk_fwd_ex(int T, int H, int K, int V, const real *q, const real *k, const real *v,
                      const real *g, const real *beta, const real *S0, real *o, real *S_final,
                      real *S_tiles, const kda_chunk_opts *opts) {
    size_t KV = (size_t)K * V;
    if (T <= 0) {  // no tokens: the state passes through
        if (S_final) {
            if (S0) memcpy(S_final, S0, sizeof(real) * H * KV);
            else memset(S_final, 0, sizeof(real) * H * KV);
        }
        return;
    }
    kda_cfg_ cf;
    kda_cfg_init_(&cf, H, K, V, opts);
    int nth = kda_thread_count_();
    size_t per = kda_ws_carve_(&cf, 0, NULL, NULL);
    real *pool = kda_xmalloc_(sizeof(real) * per * nth);
    REF_PAR_FOR(ref_par(8.0 * T * H * KV),
        for (int h = 0; h < H; h++) {
            kda_ws_ w;
            kda_ws_carve_(&cf, 0, pool + per * kda_thread_id_(), &w);
            kda_head_fwd_(&cf, &w, T, h, q, k, v, g, beta, S0 ? S0 + h * KV : NULL, o,
                          S_final ? S_final + h * KV : NULL, S_tiles);
        });
    free(pool);
}

void mtrl_ref_kda_chunk_bwd_ex(int T, int H, int K, int V, const real *q, const real *k, const real *v,
                      const real *g, const real *beta, const real *S0, const real *S_tiles,
                      const real *dout, const real *dS_final, real *dq, real *dk, real *dv,
                      real *dg, real *dbeta, real *dS0, const kda_chunk_opts *opts) {
    size_t KV = (size_t)K * V;
    if (T <= 0) {
        if (dS0) {
            if (dS_final) memcpy(dS0, dS_final, sizeof(real) * H * KV);
            else memset(dS0, 0, sizeof(real) * H * KV);
        }
        return;
    }
    kda_cfg_ cf;
    kda_cfg_init_(&cf, H, K, V, opts);
    int nth = kda_thread_count_();
    size_t per = kda_ws_carve_(&cf, 1, NULL, NULL);
    real *pool = kda_xmalloc_(sizeof(real) * per * nth);
    // Without stored states, rerun the forward once (per head, in the same parallel loop) to
    // recover every chunk's incoming state, as fla does with disable_recompute=False.
    real *own = NULL;
    if (!S_tiles) own = kda_xmalloc_(sizeof(real) * KV * H * mtrl_ref_kda_chunk_state_count(T, opts));
    REF_PAR_FOR(ref_par((own ? 28.0 : 20.0) * T * H * KV),
        for (int h = 0; h < H; h++) {
            kda_ws_ w;
            kda_ws_carve_(&cf, 1, pool + per * kda_thread_id_(), &w);
            if (own) kda_head_fwd_(&cf, &w, T, h, q, k, v, g, beta, S0 ? S0 + h * KV : NULL, NULL,
                                   NULL, own);
            kda_head_bwd_(&cf, &w, T, h, q, k, v, g, beta, own ? own : S_tiles, dout,
                          dS_final ? dS_final + h * KV : NULL, dq, dk, dv, dg, dbeta,
                          dS0 ? dS0 + h * KV : NULL);
        });
    free(own);
    free(pool);
}

void mtrl_ref_kda_chunk_fwd(int T, int H, int K, int V, const real *q, const real *k, const real *v,
                   const real *g, const real *beta, const real *S0, real *o, real *S_final,
                   real *S_tiles) {
    mtrl_ref_kda_chunk_fwd_ex(T, H, K, V, q, k, v, g, beta, S0, o, S_final, S_tiles, NULL);
}

void mtrl_ref_kda_chunk_bwd(int T, int H, int K, int V, const real *q, const real *k, const real *v,
                   const real *g, const real *beta, const real *S0, const real *S_tiles,
                   const real *dout, const real *dS_final, real *dq, real *dk, real *dv, real *dg,
                   real *dbeta, real *dS0) {
    mtrl_ref_kda_chunk_bwd_ex(T, H, K, V, q, k, v, g, beta, S0, S_tiles, dout, dS_final, dq, dk, dv, dg,
                     dbeta, dS0, NULL);
}

void mtrl_ref_kda_chunk_fwd_varlen(int n, const int *offs, int H, int K, int V, const real *q, const real *k,
                                   const real *v, const real *g, const real *beta, real *o, real *S_final,
                                   real *S_tiles) {
    size_t hk = (size_t)H * K, hv = (size_t)H * V, tile = 0;
    for (int i = 0; i < n; i++) {
        int Ti = offs[i + 1] - offs[i];
        size_t x = (size_t)offs[i];
        mtrl_ref_kda_chunk_fwd(Ti, H, K, V, q + x * hk, k + x * hk, v + x * hv, g + x * hk, beta + x * H, NULL,
                               o ? o + x * hv : NULL, S_final ? S_final + (size_t)i * hk * V : NULL,
                               S_tiles ? S_tiles + tile * hk * V : NULL);
        tile += (size_t)mtrl_ref_kda_tile_count(Ti);
    }
}

void mtrl_ref_kda_chunk_fwd_varlen_io(int n, const int *offs, int H, int K, int V, const real *q, const real *k,
                                      const real *v, const real *g, const real *beta, const real *const *S0,
                                      real *o, real *const *S_final, real *S_tiles) {
    size_t hk = (size_t)H * K, hv = (size_t)H * V, tile = 0;
    for (int i = 0; i < n; i++) {
        int Ti = offs[i + 1] - offs[i];
        size_t x = (size_t)offs[i];
        // the piece's state is copied in before its final state is written: in place is safe
        mtrl_ref_kda_chunk_fwd(Ti, H, K, V, q + x * hk, k + x * hk, v + x * hv, g + x * hk, beta + x * H,
                               S0 ? S0[i] : NULL, o ? o + x * hv : NULL, S_final ? S_final[i] : NULL,
                               S_tiles ? S_tiles + tile * hk * V : NULL);
        tile += (size_t)mtrl_ref_kda_tile_count(Ti);
    }
}

void mtrl_ref_kda_chunk_bwd_varlen(int n, const int *offs, int H, int K, int V, const real *q, const real *k,
                                   const real *v, const real *g, const real *beta, const real *S_tiles,
                                   const real *dout, real *dq, real *dk, real *dv, real *dg, real *dbeta) {
    size_t hk = (size_t)H * K, hv = (size_t)H * V, tile = 0;
    for (int i = 0; i < n; i++) {
        int Ti = offs[i + 1] - offs[i];
        size_t x = (size_t)offs[i];
        mtrl_ref_kda_chunk_bwd(Ti, H, K, V, q + x * hk, k + x * hk, v + x * hv, g + x * hk, beta + x * H, NULL,
                               S_tiles ? S_tiles + tile * hk * V : NULL, dout + x * hv, NULL, dq + x * hk,
                               dk + x * hk, dv + x * hv, dg + x * hk, dbeta + x * H, NULL);
        tile += (size_t)mtrl_ref_kda_tile_count(Ti);
    }
}
