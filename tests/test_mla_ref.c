// mtrl-test: cpu f64
// test_mla_ref.c: causal attention and the MLA latent algebra of kernels/ref/mla_ref.h, fp64.
//
//   * attention forward/backward vs a naive (materialised softmax) reference, at sizes that
//     cross the row and key blocks, for Hk = H, grouped Hk, Hk = 1 with v aliasing k;
//   * backward vs central finite differences for q, k, v (Hk = H; Hk = 1 with v = k);
//   * the segment property: the last rows with Tk = full equal the tail of a full run, and dk
//     accumulated over two segment calls equals one call;
//   * varlen (packed pieces, each attending causally to its own keys only): the same bits as one
//     call per piece, and the naive reference per piece, with the keys at the queries' rows and
//     with longer key ranges of their own (the prefill form), v aliasing k or not;
//   * I4: absorbed decode == expanded multi-head form for the last token; absorbed training
//     form (absorb q, MQA over latents, up-project) == expanded training form, forward and
//     backward; the helpers' backwards vs finite differences.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "kernels/ref/mla_ref.h"
#include "tests/testhelp.h"

#define FD_H 1e-5
#define FD_TOL 1e-7

static uint64_t stream_ = 100;

static real *randn(size_t n, double scale) {
    real *x = malloc(sizeof(real) * (n ? n : 1));
    uint64_t s = stream_++;
    for (size_t i = 0; i < n; i++) x[i] = (real)(scale * mtrl_rng_normal(7, s, i));
    return x;
}
static real *copyv(const real *x, size_t n) {
    real *y = malloc(sizeof(real) * n);
    memcpy(y, x, sizeof(real) * n);
    return y;
}
static real *zeros(size_t n) { return calloc(n ? n : 1, sizeof(real)); }
static double dot(const real *a, const real *b, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += (double)a[i] * (double)b[i];
    return s;
}
static double max_abs(const real *a, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = fmax(m, fabs((double)a[i]));
    return m;
}
// max |a − b| / max |b|: the figure printed for every comparison (the floor keeps it
// meaningful when the reference is exactly zero, e.g. dq of a single visible key).
static double rel_diff(const real *a, const real *b, size_t n) {
    double d = 0;
    for (size_t i = 0; i < n; i++) d = fmax(d, fabs((double)a[i] - (double)b[i]));
    return d / fmax(max_abs(b, n), 1e-6);
}
#define CHECK_REL(name, got, want, n, tol)                                   \
    do {                                                                     \
        double e_ = rel_diff(got, want, n);                                  \
        printf("  %-44s rel diff %.2e\n", name, e_);                         \
        TEST_CHECKF(e_ < (tol), "%s: %.3e", name, e_);                       \
    } while (0)

// ---- naive reference -----------------------------------------------------------------------

// Materialised causal attention, same conventions as attn_causal_fwd/bwd. The backward
// writes dq and accumulates dk, dv (which may alias, as in the library).
static void naive_attn(int Tq, int Tk, int H, int Hk, int Dk, int Dv, double scale, const real *q,
                       const real *k, int ldk, const real *v, int ldv, real *o, real *lse,
                       const real *dout, real *dq, real *dk, real *dv) {
    const int G = H / Hk, off = Tk - Tq;
    double *p = malloc(sizeof(double) * Tk), *dp = malloc(sizeof(double) * Tk);
    for (int i = 0; i < Tq; i++)
        for (int h = 0; h < H; h++) {
            const int j = h / G, pos = off + i;
            const real *qi = q + ((size_t)i * H + h) * Dk;
            double mx = -INFINITY, z = 0;
            for (int s = 0; s <= pos; s++) {
                double a = 0;
                for (int d = 0; d < Dk; d++) a += qi[d] * k[(size_t)s * ldk + j * Dk + d];
                p[s] = scale * a;
                mx = fmax(mx, p[s]);
            }
            for (int s = 0; s <= pos; s++) { p[s] = exp(p[s] - mx); z += p[s]; }
            for (int s = 0; s <= pos; s++) p[s] /= z;
            if (o) {
                for (int d = 0; d < Dv; d++) {
                    double a = 0;
                    for (int s = 0; s <= pos; s++) a += p[s] * v[(size_t)s * ldv + j * Dv + d];
                    o[((size_t)i * H + h) * Dv + d] = (real)a;
                }
                lse[(size_t)i * H + h] = (real)(mx + log(z));
            }
            if (!dout) continue;
            const real *g = dout + ((size_t)i * H + h) * Dv;
            double D = 0;
            for (int s = 0; s <= pos; s++) {
                double a = 0;
                for (int d = 0; d < Dv; d++) a += g[d] * v[(size_t)s * ldv + j * Dv + d];
                dp[s] = a;
                D += p[s] * a;
            }
            real *dqi = dq + ((size_t)i * H + h) * Dk;
            for (int d = 0; d < Dk; d++) dqi[d] = 0;
            for (int s = 0; s <= pos; s++) {
                double ds = p[s] * (dp[s] - D);
                for (int d = 0; d < Dk; d++) {
                    dqi[d] += (real)(scale * ds * k[(size_t)s * ldk + j * Dk + d]);
                    dk[(size_t)s * ldk + j * Dk + d] += (real)(scale * ds * qi[d]);
                }
                for (int d = 0; d < Dv; d++) dv[(size_t)s * ldv + j * Dv + d] += (real)(p[s] * g[d]);
            }
        }
    free(p);
    free(dp);
}

// ---- attention vs naive --------------------------------------------------------------------

// One configuration: forward and backward of the library vs the naive reference. alias: v = k
// (ldv = ldk, Dv <= Dk), so dv = dk too.
static void attn_vs_naive(const char *name, int Tq, int Tk, int H, int Hk, int Dk, int Dv, int alias) {
    const double scale = 1.0 / sqrt(Dk);
    const int ldk = Hk * Dk, ldv = alias ? ldk : Hk * Dv;
    real *q = randn((size_t)Tq * H * Dk, 1.0), *k = randn((size_t)Tk * ldk, 1.0);
    real *v = alias ? k : randn((size_t)Tk * ldv, 1.0);
    real *R = randn((size_t)Tq * H * Dv, 1.0);
    real *o = zeros((size_t)Tq * H * Dv), *lse = zeros((size_t)Tq * H);
    real *o_n = zeros((size_t)Tq * H * Dv), *lse_n = zeros((size_t)Tq * H);
    real *dk0 = randn((size_t)Tk * ldk, 1.0);  // non-zero start: dk, dv accumulate
    real *dv0 = alias ? dk0 : randn((size_t)Tk * ldv, 1.0);
    real *dk = copyv(dk0, (size_t)Tk * ldk), *dv = alias ? dk : copyv(dv0, (size_t)Tk * ldv);
    real *dk_n = copyv(dk0, (size_t)Tk * ldk), *dv_n = alias ? dk_n : copyv(dv0, (size_t)Tk * ldv);
    real *dq = randn((size_t)Tq * H * Dk, 1.0), *dq_n = zeros((size_t)Tq * H * Dk);  // dq overwritten

    mtrl_ref_attn_causal_fwd(Tq, Tk, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv, o, lse);
    mtrl_ref_attn_causal_bwd(Tq, Tk, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv, o, lse, R, dq, dk, dv);
    naive_attn(Tq, Tk, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv, o_n, lse_n, R, dq_n, dk_n, dv_n);
    printf(" %s (Tq %d Tk %d H %d Hk %d Dk %d Dv %d%s)\n", name, Tq, Tk, H, Hk, Dk, Dv, alias ? " v=k" : "");
    CHECK_REL("o vs naive", o, o_n, (size_t)Tq * H * Dv, 1e-13);
    CHECK_REL("lse vs naive", lse, lse_n, (size_t)Tq * H, 1e-13);
    CHECK_REL("dq vs naive", dq, dq_n, (size_t)Tq * H * Dk, 1e-12);
    CHECK_REL("dk (+=) vs naive", dk, dk_n, (size_t)Tk * ldk, 1e-12);
    if (!alias) CHECK_REL("dv (+=) vs naive", dv, dv_n, (size_t)Tk * ldv, 1e-12);
    free(q); free(k); free(R); free(o); free(lse); free(o_n); free(lse_n); free(dk0); free(dk);
    free(dk_n); free(dq); free(dq_n);
    if (!alias) { free(v); free(dv0); free(dv); free(dv_n); }
}

// ---- attention vs finite differences --------------------------------------------------------

typedef struct { int Tq, Tk, H, Hk, Dk, Dv, ldk, ldv; double scale; real *q, *k, *v, *R, *o, *lse; } attn_ctx;
static double attn_loss(void *p) {
    attn_ctx *c = p;
    mtrl_ref_attn_causal_fwd(c->Tq, c->Tk, c->H, c->Hk, c->Dk, c->Dv, c->scale, c->q, c->k, c->ldk, c->v,
                    c->ldv, c->o, c->lse);
    return dot(c->R, c->o, (size_t)c->Tq * c->H * c->Dv);
}
typedef double (*loss_fn)(void *ctx);
static double fd_err(loss_fn f, void *ctx, real *x, size_t n, const real *grad) {
    double worst = 0, gmax = 1e-30;
    for (size_t e = 0; e < n; e++) {
        real keep = x[e];
        x[e] = keep + FD_H;
        double lp = f(ctx);
        x[e] = keep - FD_H;
        double lm = f(ctx);
        x[e] = keep;
        worst = fmax(worst, fabs((lp - lm) / (2 * FD_H) - grad[e]));
        gmax = fmax(gmax, fabs(grad[e]));
    }
    return worst / gmax;
}
#define CHECK_FD(name, f, ctx, x, n, g)                                      \
    do {                                                                     \
        double e_ = fd_err(f, ctx, x, n, g);                                 \
        printf("  %-44s fd rel err %.2e\n", name, e_);                       \
        TEST_CHECKF(e_ < FD_TOL, "%s: %.3e", name, e_);                      \
    } while (0)

static void attn_fd(int Tq, int Tk, int H, int Hk, int Dk, int Dv, int alias) {
    attn_ctx c = { Tq, Tk, H, Hk, Dk, Dv, Hk * Dk, alias ? Hk * Dk : Hk * Dv, 1.0 / sqrt(Dk),
                   NULL, NULL, NULL, NULL, NULL, NULL };
    c.q = randn((size_t)Tq * H * Dk, 1.0);
    c.k = randn((size_t)Tk * c.ldk, 1.0);
    c.v = alias ? c.k : randn((size_t)Tk * c.ldv, 1.0);
    c.R = randn((size_t)Tq * H * Dv, 1.0);
    c.o = zeros((size_t)Tq * H * Dv);
    c.lse = zeros((size_t)Tq * H);
    real *dq = zeros((size_t)Tq * H * Dk), *dk = zeros((size_t)Tk * c.ldk);
    real *dv = alias ? dk : zeros((size_t)Tk * c.ldv);
    attn_loss(&c);
    mtrl_ref_attn_causal_bwd(Tq, Tk, H, Hk, Dk, Dv, c.scale, c.q, c.k, c.ldk, c.v, c.ldv, c.o, c.lse, c.R, dq, dk, dv);
    printf(" fd (Tq %d Tk %d H %d Hk %d Dk %d Dv %d%s)\n", Tq, Tk, H, Hk, Dk, Dv, alias ? " v=k" : "");
    CHECK_FD("dq", attn_loss, &c, c.q, (size_t)Tq * H * Dk, dq);
    CHECK_FD(alias ? "dk (= d latent, key and value)" : "dk", attn_loss, &c, c.k, (size_t)Tk * c.ldk, dk);
    if (!alias) CHECK_FD("dv", attn_loss, &c, c.v, (size_t)Tk * c.ldv, dv);
    free(c.q); free(c.k); free(c.R); free(c.o); free(c.lse); free(dq); free(dk);
    if (!alias) { free(c.v); free(dv); }
}

// ---- segment property ----------------------------------------------------------------------

static void test_segments(void) {
    printf("segments\n");
    const int T = 70, tail = 5, H = 2, Hk = 1, Dk = 7, Dv = 5;  // absorbed-like: v = k
    const int ld = Hk * Dk, A = T - tail;
    const double scale = 0.4;
    real *q = randn((size_t)T * H * Dk, 1.0), *L = randn((size_t)T * ld, 1.0), *R = randn((size_t)T * H * Dv, 1.0);
    real *o = zeros((size_t)T * H * Dv), *lse = zeros((size_t)T * H);
    real *o_t = zeros((size_t)tail * H * Dv), *lse_t = zeros((size_t)tail * H);
    mtrl_ref_attn_causal_fwd(T, T, H, Hk, Dk, Dv, scale, q, L, ld, L, ld, o, lse);
    mtrl_ref_attn_causal_fwd(tail, T, H, Hk, Dk, Dv, scale, q + (size_t)A * H * Dk, L, ld, L, ld, o_t, lse_t);
    CHECK_REL("tail rows (Tq 5, Tk 70) == full run o", o_t, o + (size_t)A * H * Dv, (size_t)tail * H * Dv, 1e-14);
    CHECK_REL("tail rows lse", lse_t, lse + (size_t)A * H, (size_t)tail * H, 1e-14);
    // Head segment alone (Tq = Tk = A) == the first A rows of the full run.
    real *o_h = zeros((size_t)A * H * Dv), *lse_h = zeros((size_t)A * H);
    mtrl_ref_attn_causal_fwd(A, A, H, Hk, Dk, Dv, scale, q, L, ld, L, ld, o_h, lse_h);
    CHECK_REL("head rows (Tq = Tk = 65) == full run o", o_h, o, (size_t)A * H * Dv, 1e-14);

    // Backward: one call vs two segment calls accumulating into one latent gradient.
    real *dL0 = randn((size_t)T * ld, 1.0);
    real *dL1 = copyv(dL0, (size_t)T * ld), *dL2 = copyv(dL0, (size_t)T * ld);
    real *dq1 = zeros((size_t)T * H * Dk), *dq2 = zeros((size_t)T * H * Dk);
    mtrl_ref_attn_causal_bwd(T, T, H, Hk, Dk, Dv, scale, q, L, ld, L, ld, o, lse, R, dq1, dL1, dL1);
    mtrl_ref_attn_causal_bwd(tail, T, H, Hk, Dk, Dv, scale, q + (size_t)A * H * Dk, L, ld, L, ld, o_t, lse_t,
                    R + (size_t)A * H * Dv, dq2 + (size_t)A * H * Dk, dL2, dL2);
    mtrl_ref_attn_causal_bwd(A, A, H, Hk, Dk, Dv, scale, q, L, ld, L, ld, o_h, lse_h, R, dq2, dL2, dL2);
    CHECK_REL("dq of two segments == one call", dq2, dq1, (size_t)T * H * Dk, 1e-13);
    CHECK_REL("d latent accumulated over segments == one", dL2, dL1, (size_t)T * ld, 1e-13);
    free(q); free(L); free(R); free(o); free(lse); free(o_t); free(lse_t); free(o_h); free(lse_h);
    free(dL0); free(dL1); free(dL2); free(dq1); free(dq2);
}

// ---- MLA: absorbed vs expanded (I4) --------------------------------------------------------

typedef struct {
    int T, H, dn, dr, dv, dc;
    double scale;
    real *q, *L, *W, *R;                 // inputs: q [T][H][dn+dr], latent [T][dc+dr], W_kvb
    real *qt, *cstar, *lse, *a;          // absorbed-form intermediates and output
} mla_ctx;

// Absorbed training forward: qt = absorb(q); MQA over the latent (value = first dc dims);
// a = up_v(cstar). Returns Σ R ⊙ a.
static double mla_absorbed_loss(void *p) {
    mla_ctx *c = p;
    const int Dl = c->dc + c->dr;
    mtrl_ref_mla_absorb_q(c->T, c->H, c->dn, c->dr, c->dv, c->dc, c->q, c->W, c->qt);
    mtrl_ref_attn_causal_fwd(c->T, c->T, c->H, 1, Dl, c->dc, c->scale, c->qt, c->L, Dl, c->L, Dl, c->cstar, c->lse);
    mtrl_ref_mla_up_v(c->T, c->H, c->dn, c->dv, c->dc, c->cstar, c->W, c->a);
    return dot(c->R, c->a, (size_t)c->T * c->H * c->dv);
}

static void mla_ctx_init(mla_ctx *c, int T, int H, int dn, int dr, int dv, int dc) {
    c->T = T; c->H = H; c->dn = dn; c->dr = dr; c->dv = dv; c->dc = dc;
    c->scale = 1.0 / sqrt(dn + dr);
    const int Dl = dc + dr;
    c->q = randn((size_t)T * H * (dn + dr), 1.0);
    c->L = randn((size_t)T * Dl, 1.0);
    c->W = randn((size_t)H * (dn + dv) * dc, 0.5);
    c->R = randn((size_t)T * H * dv, 1.0);
    c->qt = zeros((size_t)T * H * Dl);
    c->cstar = zeros((size_t)T * H * dc);
    c->lse = zeros((size_t)T * H);
    c->a = zeros((size_t)T * H * dv);
}
static void mla_ctx_free(mla_ctx *c) {
    free(c->q); free(c->L); free(c->W); free(c->R); free(c->qt); free(c->cstar); free(c->lse); free(c->a);
}

// Absorbed backward of Σ R ⊙ a into dq (overwritten), dL (+=), dW (+=). Needs the forward.
static void mla_absorbed_bwd(mla_ctx *c, real *dq, real *dL, real *dW) {
    const int T = c->T, H = c->H, Dl = c->dc + c->dr;
    real *dcstar = zeros((size_t)T * H * c->dc), *dqt = zeros((size_t)T * H * Dl);
    mtrl_ref_mla_up_v_bwd(T, H, c->dn, c->dv, c->dc, c->cstar, c->W, c->R, dcstar, dW);
    mtrl_ref_attn_causal_bwd(T, T, H, 1, Dl, c->dc, c->scale, c->qt, c->L, Dl, c->L, Dl, c->cstar, c->lse,
                    dcstar, dqt, dL, dL);
    mtrl_ref_mla_absorb_q_bwd(T, H, c->dn, c->dr, c->dv, c->dc, c->q, c->W, dqt, dq, dW);
    free(dcstar);
    free(dqt);
}

static void test_mla_training_forms(int T) {
    printf("MLA training: absorbed vs expanded (T %d)\n", T);
    mla_ctx c;
    mla_ctx_init(&c, T, 3, 4, 3, 5, 6);
    const int H = c.H, dn = c.dn, dr = c.dr, dv = c.dv, dc = c.dc, Dl = dc + dr, Dh = dn + dr;
    mla_absorbed_loss(&c);

    // Expanded: k, v per head from the latent, multi-head attention (Hk = H).
    real *k = zeros((size_t)T * H * Dh), *v = zeros((size_t)T * H * dv);
    real *a_e = zeros((size_t)T * H * dv), *lse_e = zeros((size_t)T * H);
    mtrl_ref_mla_expand_kv(T, H, dn, dr, dv, dc, c.L, Dl, c.L + dc, Dl, c.W, k, v);
    mtrl_ref_attn_causal_fwd(T, T, H, H, Dh, dv, c.scale, c.q, k, H * Dh, v, H * dv, a_e, lse_e);
    CHECK_REL("a: absorbed == expanded", c.a, a_e, (size_t)T * H * dv, 1e-13);
    CHECK_REL("lse: absorbed == expanded", c.lse, lse_e, (size_t)T * H, 1e-13);

    // Backward of both forms.
    real *dq_a = zeros((size_t)T * H * Dh), *dL_a = zeros((size_t)T * Dl), *dW_a = zeros((size_t)H * (dn + dv) * dc);
    mla_absorbed_bwd(&c, dq_a, dL_a, dW_a);
    real *dq_e = zeros((size_t)T * H * Dh), *dk = zeros((size_t)T * H * Dh), *dvv = zeros((size_t)T * H * dv);
    real *dL_e = zeros((size_t)T * Dl), *dW_e = zeros((size_t)H * (dn + dv) * dc);
    mtrl_ref_attn_causal_bwd(T, T, H, H, Dh, dv, c.scale, c.q, k, H * Dh, v, H * dv, a_e, lse_e, c.R, dq_e, dk, dvv);
    mtrl_ref_mla_expand_kv_bwd(T, H, dn, dr, dv, dc, c.L, Dl, c.W, dk, dvv, dL_e, Dl, dL_e + dc, Dl, dW_e);
    CHECK_REL("dq: absorbed == expanded", dq_a, dq_e, (size_t)T * H * Dh, 1e-12);
    CHECK_REL("d latent [c; k^r]: absorbed == expanded", dL_a, dL_e, (size_t)T * Dl, 1e-12);
    CHECK_REL("dW_kvb: absorbed == expanded", dW_a, dW_e, (size_t)H * (dn + dv) * dc, 1e-12);

    if (T <= 8) {  // finite differences through the whole absorbed chain
        CHECK_FD("absorbed chain dq", mla_absorbed_loss, &c, c.q, (size_t)T * H * Dh, dq_a);
        CHECK_FD("absorbed chain d latent", mla_absorbed_loss, &c, c.L, (size_t)T * Dl, dL_a);
        CHECK_FD("absorbed chain dW_kvb", mla_absorbed_loss, &c, c.W, (size_t)H * (dn + dv) * dc, dW_a);
    }
    mla_ctx_free(&c);
    free(k); free(v); free(a_e); free(lse_e); free(dq_a); free(dL_a); free(dW_a); free(dq_e);
    free(dk); free(dvv); free(dL_e); free(dW_e);
}

// Expanded-form loss for the FD check of mla_expand_kv_bwd: Σ Rk ⊙ k + Σ Rv ⊙ v.
typedef struct { int N, H, dn, dr, dv, dc; real *L, *W, *Rk, *Rv, *k, *v; } exp_ctx;
static double expand_loss(void *p) {
    exp_ctx *c = p;
    const int Dl = c->dc + c->dr;
    mtrl_ref_mla_expand_kv(c->N, c->H, c->dn, c->dr, c->dv, c->dc, c->L, Dl, c->L + c->dc, Dl, c->W, c->k, c->v);
    return dot(c->Rk, c->k, (size_t)c->N * c->H * (c->dn + c->dr)) + dot(c->Rv, c->v, (size_t)c->N * c->H * c->dv);
}

static void test_expand_fd(void) {
    printf("mla_expand_kv backward\n");
    exp_ctx c = { 4, 2, 3, 2, 4, 5, NULL, NULL, NULL, NULL, NULL, NULL };
    const int Dl = c.dc + c.dr, Dh = c.dn + c.dr;
    c.L = randn((size_t)c.N * Dl, 1.0);
    c.W = randn((size_t)c.H * (c.dn + c.dv) * c.dc, 1.0);
    c.Rk = randn((size_t)c.N * c.H * Dh, 1.0);
    c.Rv = randn((size_t)c.N * c.H * c.dv, 1.0);
    c.k = zeros((size_t)c.N * c.H * Dh);
    c.v = zeros((size_t)c.N * c.H * c.dv);
    real *dL0 = randn((size_t)c.N * Dl, 1.0), *dL = copyv(dL0, (size_t)c.N * Dl);
    real *dW = zeros((size_t)c.H * (c.dn + c.dv) * c.dc);
    mtrl_ref_mla_expand_kv_bwd(c.N, c.H, c.dn, c.dr, c.dv, c.dc, c.L, Dl, c.W, c.Rk, c.Rv, dL, Dl, dL + c.dc, Dl, dW);
    for (int e = 0; e < c.N * Dl; e++) dL[e] -= dL0[e];
    CHECK_FD("expand_kv d latent (+=)", expand_loss, &c, c.L, (size_t)c.N * Dl, dL);
    CHECK_FD("expand_kv dW_kvb", expand_loss, &c, c.W, (size_t)c.H * (c.dn + c.dv) * c.dc, dW);
    free(c.L); free(c.W); free(c.Rk); free(c.Rv); free(c.k); free(c.v); free(dL0); free(dL); free(dW);
}

static void test_decode(int Tk) {
    printf("MLA decode: absorbed vs expanded, last token (Tk %d)\n", Tk);
    const int H = 3, dn = 4, dr = 3, dv = 5, dc = 6, Dl = dc + dr, Dh = dn + dr;
    const double scale = 1.0 / sqrt(Dh);
    real *L = randn((size_t)Tk * Dl, 1.0), *W = randn((size_t)H * (dn + dv) * dc, 0.5);
    real *q = randn((size_t)H * Dh, 2.0);
    // Separate caches for the plain entry point.
    real *cc = zeros((size_t)Tk * dc), *ckr = zeros((size_t)Tk * dr);
    for (int t = 0; t < Tk; t++) {
        memcpy(cc + (size_t)t * dc, L + (size_t)t * Dl, sizeof(real) * dc);
        memcpy(ckr + (size_t)t * dr, L + (size_t)t * Dl + dc, sizeof(real) * dr);
    }
    real *a_abs = zeros((size_t)H * dv), *a_ld = zeros((size_t)H * dv), *a_e = zeros((size_t)H * dv);
    mtrl_ref_mla_decode_absorbed(H, dn, dr, dv, dc, scale, q, W, cc, ckr, Tk, a_abs);
    mtrl_ref_mla_decode_absorbed_ld(H, dn, dr, dv, dc, scale, q, W, L, Dl, L + dc, Dl, Tk, a_ld);
    // Expanded: build k^n, v per head from W_kvb ĉ, attend with the last token's query.
    real *k = zeros((size_t)Tk * H * Dh), *v = zeros((size_t)Tk * H * dv), *lse = zeros(H);
    mtrl_ref_mla_expand_kv(Tk, H, dn, dr, dv, dc, L, Dl, L + dc, Dl, W, k, v);
    mtrl_ref_attn_causal_fwd(1, Tk, H, H, Dh, dv, scale, q, k, H * Dh, v, H * dv, a_e, lse);
    CHECK_REL("absorbed decode == expanded", a_abs, a_e, (size_t)H * dv, 1e-13);
    CHECK_REL("absorbed decode (interleaved cache) == expanded", a_ld, a_e, (size_t)H * dv, 1e-13);
    // And against the naive reference (independent of the blocked code).
    real *a_n = zeros((size_t)H * dv), *lse_n = zeros(H);
    naive_attn(1, Tk, H, H, Dh, dv, scale, q, k, H * Dh, v, H * dv, a_n, lse_n, NULL, NULL, NULL, NULL);
    CHECK_REL("absorbed decode == naive expanded", a_abs, a_n, (size_t)H * dv, 1e-13);
    free(L); free(W); free(q); free(cc); free(ckr); free(a_abs); free(a_ld); free(a_e); free(k);
    free(v); free(lse); free(a_n); free(lse_n);
}

// ---- varlen: packed pieces ----------------------------------------------------------------

// n pieces of Tq_i query rows; extra_i earlier keys each (0: the learner's packs, koffs = qoffs;
// otherwise the prefill form with its own key rows). The varlen calls against one call per piece
// (memcmp: the same bits) and against the naive reference per piece.
static void test_varlen(const char *name, int n, const int *len, const int *extra, int H, int Hk, int Dk, int Dv,
                        int alias) {
    printf("varlen: %s (%d pieces)\n", name, n);
    int *qo = malloc(sizeof(int) * (n + 1)), *ko = malloc(sizeof(int) * (n + 1));
    qo[0] = ko[0] = 0;
    for (int i = 0; i < n; i++) {
        qo[i + 1] = qo[i] + len[i];
        ko[i + 1] = ko[i] + len[i] + (extra ? extra[i] : 0);
    }
    const int Tq = qo[n], Tk = ko[n], ldk = Hk * Dk, ldv = alias ? ldk : Hk * Dv;
    const double scale = 1.0 / sqrt(Dk);
    const size_t nq = (size_t)Tq * H * Dk, no = (size_t)Tq * H * Dv, nk = (size_t)Tk * ldk, nv = (size_t)Tk * ldv;
    real *q = randn(nq, 1.0), *k = randn(nk, 1.0), *v = alias ? k : randn(nv, 1.0), *R = randn(no, 1.0);
    real *o = zeros(no), *lse = zeros((size_t)Tq * H), *o1 = zeros(no), *lse1 = zeros((size_t)Tq * H);
    real *o_n = zeros(no), *lse_n = zeros((size_t)Tq * H);
    real *dk0 = randn(nk, 1.0), *dv0 = alias ? dk0 : randn(nv, 1.0);  // dk, dv accumulate
    real *dk = copyv(dk0, nk), *dv = alias ? dk : copyv(dv0, nv), *dk1 = copyv(dk0, nk),
         *dv1 = alias ? dk1 : copyv(dv0, nv), *dk_n = copyv(dk0, nk), *dv_n = alias ? dk_n : copyv(dv0, nv);
    real *dq = randn(nq, 1.0), *dq1 = zeros(nq), *dq_n = zeros(nq);
    const int *kp = extra ? ko : NULL;
    mtrl_ref_attn_causal_fwd_varlen(n, qo, kp, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv, o, lse);
    mtrl_ref_attn_causal_bwd_varlen(n, qo, kp, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv, o, lse, R, dq, dk, dv);
    for (int i = 0; i < n; i++) {
        const int Tqi = qo[i + 1] - qo[i], Tki = ko[i + 1] - ko[i];
        const size_t a = (size_t)qo[i], b = (size_t)ko[i];
        mtrl_ref_attn_causal_fwd(Tqi, Tki, H, Hk, Dk, Dv, scale, q + a * H * Dk, k + b * ldk, ldk, v + b * ldv, ldv,
                                 o1 + a * H * Dv, lse1 + a * H);
        mtrl_ref_attn_causal_bwd(Tqi, Tki, H, Hk, Dk, Dv, scale, q + a * H * Dk, k + b * ldk, ldk, v + b * ldv, ldv,
                                 o1 + a * H * Dv, lse1 + a * H, R + a * H * Dv, dq1 + a * H * Dk, dk1 + b * ldk,
                                 dv1 + b * ldv);
        naive_attn(Tqi, Tki, H, Hk, Dk, Dv, scale, q + a * H * Dk, k + b * ldk, ldk, v + b * ldv, ldv, o_n + a * H * Dv,
                   lse_n + a * H, R + a * H * Dv, dq_n + a * H * Dk, dk_n + b * ldk, dv_n + b * ldv);
    }
    TEST_CHECKF(!memcmp(o, o1, sizeof(real) * no) && !memcmp(lse, lse1, sizeof(real) * Tq * H),
                "%s: forward differs from the per-piece calls", name);
    TEST_CHECKF(!memcmp(dq, dq1, sizeof(real) * nq) && !memcmp(dk, dk1, sizeof(real) * nk) &&
                    !memcmp(dv, dv1, sizeof(real) * nv),
                "%s: backward differs from the per-piece calls", name);
    printf("  the same bits as one call per piece: o, lse, dq, dk, dv\n");
    CHECK_REL("o vs naive per piece", o, o_n, no, 1e-12);
    CHECK_REL("lse", lse, lse_n, (size_t)Tq * H, 1e-12);
    CHECK_REL("dq", dq, dq_n, nq, 1e-11);
    CHECK_REL("dk (accumulated)", dk, dk_n, nk, 1e-11);
    if (!alias) CHECK_REL("dv (accumulated)", dv, dv_n, nv, 1e-11);
    real *fr[] = {q, k, R, o, lse, o1, lse1, o_n, lse_n, dk0, dk, dk1, dk_n, dq, dq1, dq_n};
    for (size_t i = 0; i < sizeof fr / sizeof *fr; i++) free(fr[i]);
    if (!alias) {
        real *fv[] = {v, dv0, dv, dv1, dv_n};
        for (size_t i = 0; i < sizeof fv / sizeof *fv; i++) free(fv[i]);
    }
    free(qo);
    free(ko);
}

static void test_varlen_all(void) {
    const int len[] = {1, 15, 16, 17, 0, 64, 70, 3};
    const int extra[] = {0, 5, 40, 0, 9, 1, 66, 2};
    const int n = (int)(sizeof len / sizeof *len);
    test_varlen("keys at the queries' rows, MHA", n, len, NULL, 3, 3, 6, 5, 0);
    test_varlen("keys at the queries' rows, MQA latent (v = k)", n, len, NULL, 3, 1, 8, 6, 1);
    test_varlen("own earlier keys (prefill form), grouped", n, len, extra, 4, 2, 5, 3, 0);
    test_varlen("own earlier keys, MQA latent (v = k)", n, len, extra, 2, 1, 7, 4, 1);
    const int one[] = {33};
    test_varlen("one piece", 1, one, NULL, 2, 2, 4, 4, 0);
}

int main(void) {
    printf("attention vs naive\n");
    attn_vs_naive("multi-head", 70, 70, 3, 3, 6, 5, 0);
    attn_vs_naive("segment rows", 40, 100, 2, 2, 5, 4, 0);
    attn_vs_naive("grouped", 37, 37, 4, 2, 5, 3, 0);
    attn_vs_naive("MQA latent", 70, 70, 3, 1, 8, 6, 1);
    attn_vs_naive("grouped, v aliasing k", 33, 66, 4, 2, 6, 4, 1);
    attn_vs_naive("single row", 1, 1, 2, 1, 3, 3, 0);
    printf("attention vs finite differences\n");
    attn_fd(9, 9, 2, 2, 5, 4, 0);
    attn_fd(6, 11, 2, 2, 4, 3, 0);
    attn_fd(9, 9, 3, 1, 7, 5, 1);
    test_segments();
    test_varlen_all();
    test_expand_fd();
    test_mla_training_forms(7);
    test_mla_training_forms(75);
    test_decode(9);
    test_decode(300);
    return test_report();
}
