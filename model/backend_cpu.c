// backend_cpu.c: the CPU backend (backend.h): the kernels/ref functions and the loops the model
// runs between them, on host memory. Results are those of the reference, bit for bit.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "model/backend.h"
#include "model/model.h"
#include "kernels/ref/attnres_ref.h"
#include "kernels/ref/gemm_ref.h"
#include "kernels/ref/kda_ref.h"
#include "kernels/ref/mla_ref.h"
#include "kernels/ref/moe_ref.h"
#include "kernels/ref/ops_ref.h"
#include "kernels/ref/par_ref.h"

typedef mtrl_backend BE;

// ---- memory ------------------------------------------------------------------------------------------

static void *alloc_(BE *be, size_t bytes) {
    (void)be;
    void *p = aligned_alloc(64, bytes ? (bytes + 63) & ~(size_t)63 : 64);
    MTRL_CHECKF(p != NULL, "out of memory allocating %zu bytes", bytes);
    return p;
}
static void release_(BE *be, void *p) { (void)be; free(p); }
static void zero_(BE *be, void *p, size_t bytes) { (void)be; if (bytes) memset(p, 0, bytes); }
static void copy_(BE *be, void *dst, const void *src, size_t bytes) {
    (void)be;
    if (bytes && dst != src) memmove(dst, src, bytes);
}
static void sync_(BE *be) { (void)be; }
static void copy_rows_(BE *be, int rows, int n, const real *src, int lds, real *dst, int ldd) {
    (void)be;
    if (n <= 0) return;
    for (int r = 0; r < rows; r++) memcpy(dst + (size_t)r * ldd, src + (size_t)r * lds, sizeof(real) * (size_t)n);
}
static void gather_(BE *be, int B, size_t n, const real *const *src, real *dst) {
    (void)be;
    for (int b = 0; b < B; b++) memcpy(dst + (size_t)b * n, src[b], sizeof(real) * n);
}
static void scatter_(BE *be, int B, size_t n, const real *src, real *const *dst) {
    (void)be;
    for (int b = 0; b < B; b++) memcpy(dst[b], src + (size_t)b * n, sizeof(real) * n);
}

// ---- elementwise: exactly the loops the model ran inline --------------------------------------------

static real sigmoid1_(real x) { return (real)(1.0 / (1.0 + exp(-(double)x))); }

static void sigmoid_(BE *be, size_t n, const real *x, real *y) {
    (void)be;
    for (size_t i = 0; i < n; i++) y[i] = sigmoid1_(x[i]);
}
static void sigmoid_mul_(BE *be, size_t n, const real *x, const real *a, real *y) {
    (void)be;
    for (size_t i = 0; i < n; i++) y[i] = sigmoid1_(x[i]) * a[i];
}
static void sigmoid_mul_bwd_(BE *be, size_t n, const real *x, const real *a, const real *dy, real *da, real *dx) {
    (void)be;
    for (size_t i = 0; i < n; i++) {
        real s = sigmoid1_(x[i]);
        da[i] = dy[i] * s;
        dx[i] = dy[i] * a[i] * s * (1 - s);
    }
}
static void dsigmoid_(BE *be, size_t n, const real *s, real *dy) {
    (void)be;
    for (size_t i = 0; i < n; i++) dy[i] *= s[i] * (1 - s[i]);
}
static void add_(BE *be, size_t n, const real *a, const real *b, real *y) {
    (void)be;
    if (a)
        for (size_t i = 0; i < n; i++) y[i] = a[i] + b[i];
    else
        for (size_t i = 0; i < n; i++) y[i] = (real)0 + b[i];
}
static void scale_(BE *be, size_t n, real *x, real s) { (void)be; mtrl_ref_scale_inplace(n, x, s); }

// ---- wrappers -----------------------------------------------------------------------------------------

static void gemm_(BE *be, int ta, int tb, int M, int N, int K, real alpha, const real *A, int lda, const real *B,
                  int ldb, real beta, real *C, int ldc) {
    (void)be;
    mtrl_ref_gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
static void rmsnorm_fwd_(BE *be, int N, int D, const real *x, const real *w, real eps, real *y, real *rstd) {
    (void)be;
    mtrl_ref_rmsnorm_fwd(N, D, x, w, eps, y, rstd);
}
static void rmsnorm_bwd_(BE *be, int N, int D, const real *x, const real *w, const real *rstd, real eps,
                         const real *dy, real *dx, real *dw) {
    (void)be;
    mtrl_ref_rmsnorm_bwd(N, D, x, w, rstd, eps, dy, dx, dw);
}
static void l2norm_fwd_(BE *be, int N, int D, const real *x, real eps, real *y) {
    (void)be;
    mtrl_ref_l2norm_fwd(N, D, x, eps, y, NULL);
}
static void l2norm_bwd_(BE *be, int N, int D, const real *x, real eps, const real *dy, real *dx) {
    (void)be;
    mtrl_ref_l2norm_bwd(N, D, x, eps, dy, dx);
}
static void gated_rmsnorm_fwd_(BE *be, int N, int D, const real *x, const real *z, const real *w, real eps,
                               real *y) {
    (void)be;
    mtrl_ref_gated_rmsnorm_fwd(N, D, x, z, w, eps, y);
}
static void gated_rmsnorm_bwd_(BE *be, int N, int D, const real *x, const real *z, const real *w, real eps,
                               const real *dy, real *dx, real *dz, real *dw) {
    (void)be;
    mtrl_ref_gated_rmsnorm_bwd(N, D, x, z, w, eps, dy, dx, dz, dw);
}
static void shortconv_fwd_(BE *be, int T, int C, int W, const real *x, const real *w, const real *si, real *y,
                           real *so) {
    (void)be;
    mtrl_ref_shortconv_fwd(T, C, W, x, w, si, y, so);
}
static void shortconv_bwd_(BE *be, int T, int C, int W, const real *x, const real *w, const real *si,
                           const real *dy, real *dx, real *dw, real *dsi) {
    (void)be;
    mtrl_ref_shortconv_bwd(T, C, W, x, w, si, dy, dx, dw, dsi);
}
static void shortconv_state_bwd_(BE *be, int T, int C, int W, const real *dso, real *dx, real *dsi) {
    (void)be;
    mtrl_ref_shortconv_state_bwd(T, C, W, dso, dx, dsi);
}
static void shortconv_fwd_varlen_(BE *be, int n, const int *offs, int C, int W, const real *x, const real *w,
                                  real *y) {
    (void)be;
    mtrl_ref_shortconv_fwd_varlen(n, offs, C, W, x, w, y);
}
static void shortconv_bwd_varlen_(BE *be, int n, const int *offs, int C, int W, const real *x, const real *w,
                                  const real *dy, real *dx, real *dw) {
    (void)be;
    mtrl_ref_shortconv_bwd_varlen(n, offs, C, W, x, w, dy, dx, dw);
}
static void shortconv_step_(BE *be, int B, int C, int W, const real *x1, const real *w, real *const *win,
                            real *y1) {
    (void)be;
    // The batch's rows are the outer loop on a team when worth it; each row's step is serial.
    REF_PAR_FOR(ref_par((2.0 * W + REF_FLOPS_EXP) * B * C),
        for (int r = 0; r < B; r++) mtrl_ref_shortconv_step(C, W, x1 + (size_t)r * C, w, win[r], y1 + (size_t)r * C););
}
static void embedding_fwd_(BE *be, int N, int D, const int *ids, const real *E, real *x) {
    (void)be;
    mtrl_ref_embedding_fwd(N, D, ids, E, x);
}
static void embedding_rows_(BE *be, int N, int D, const int *ids, const real *E, real *x) {
    embedding_fwd_(be, N, D, ids, E, x);
}
static void embedding_bwd_(BE *be, int N, int D, const int *ids, const real *dx, real *dE) {
    (void)be;
    mtrl_ref_embedding_bwd(N, D, ids, dx, dE);
}
static void logprob_fwd_(BE *be, int N, int V, const real *logits, const int *tg, real *logp, real *ent) {
    (void)be;
    mtrl_ref_logits_logprob_fwd(N, V, logits, tg, logp, ent);
}
static void logprob_bwd_(BE *be, int N, int V, const real *logits, const int *tg, const real *dlogp,
                         const real *dent, real *dlogits) {
    (void)be;
    mtrl_ref_logits_logprob_bwd(N, V, logits, tg, dlogp, dent, dlogits);
}
static void adamw_(BE *be, size_t n, real *p, const real *g, real *m, real *v, real lr, real b1, real b2, real eps,
                   real wd, long step) {
    (void)be;
    mtrl_ref_adamw_update(n, p, g, m, v, lr, b1, b2, eps, wd, step);
}
static double grad_sq_norm_(BE *be, size_t n, const real *g) { (void)be; return mtrl_ref_grad_sq_norm(n, g); }

static void kda_gate_fwd_(BE *be, int kind, int T, int H, int K, const real *f, const real *A, const real *b,
                          real gm, real *g) {
    (void)be;
    if (kind == MTRL_KDA_GATE_KIMI) mtrl_ref_kda_gate_kimi_fwd(T, H, K, f, A, b, (real)-INFINITY, g);
    else mtrl_ref_kda_gate_fwd(T, H, K, f, A, b, gm, g);
}
static void kda_gate_bwd_(BE *be, int kind, int T, int H, int K, const real *f, const real *A, const real *b,
                          real gm, const real *dg, real *df, real *dA, real *db) {
    (void)be;
    if (kind == MTRL_KDA_GATE_KIMI) mtrl_ref_kda_gate_kimi_bwd(T, H, K, f, A, b, (real)-INFINITY, dg, df, dA, db);
    else mtrl_ref_kda_gate_bwd(T, H, K, f, A, b, gm, dg, df, dA, db);
}
static void shortconv_fwd_varlen_io_(BE *be, int n, const int *offs, int C, int W, const real *x, const real *w,
                                     const real *const *win_in, real *const *win_out, real *y) {
    (void)be;
    mtrl_ref_shortconv_fwd_varlen_io(n, offs, C, W, x, w, win_in, win_out, y);
}
static void kda_chunk_fwd_varlen_io_(BE *be, int n, const int *offs, int H, int K, int V, const real *q,
                                     const real *k, const real *v, const real *g, const real *beta,
                                     const real *const *S0, real *o, real *const *Sf, real *St) {
    (void)be;
    mtrl_ref_kda_chunk_fwd_varlen_io(n, offs, H, K, V, q, k, v, g, beta, S0, o, Sf, St);
}
static void kda_chunk_fwd_(BE *be, int T, int H, int K, int V, const real *q, const real *k, const real *v,
                           const real *g, const real *beta, const real *S0, real *o, real *Sf, real *St) {
    (void)be;
    mtrl_ref_kda_chunk_fwd(T, H, K, V, q, k, v, g, beta, S0, o, Sf, St);
}
static void kda_chunk_bwd_(BE *be, int T, int H, int K, int V, const real *q, const real *k, const real *v,
                           const real *g, const real *beta, const real *S0, const real *St, const real *dout,
                           const real *dSf, real *dq, real *dk, real *dv, real *dg, real *dbeta, real *dS0) {
    (void)be;
    mtrl_ref_kda_chunk_bwd(T, H, K, V, q, k, v, g, beta, S0, St, dout, dSf, dq, dk, dv, dg, dbeta, dS0);
}
static void kda_chunk_fwd_varlen_(BE *be, int n, const int *offs, int H, int K, int V, const real *q, const real *k,
                                  const real *v, const real *g, const real *beta, real *o, real *Sf, real *St) {
    (void)be;
    mtrl_ref_kda_chunk_fwd_varlen(n, offs, H, K, V, q, k, v, g, beta, o, Sf, St);
}
static void kda_chunk_bwd_varlen_(BE *be, int n, const int *offs, int H, int K, int V, const real *q, const real *k,
                                  const real *v, const real *g, const real *beta, const real *St,
                                  const real *dout, real *dq, real *dk, real *dv, real *dg, real *dbeta) {
    (void)be;
    mtrl_ref_kda_chunk_bwd_varlen(n, offs, H, K, V, q, k, v, g, beta, St, dout, dq, dk, dv, dg, dbeta);
}
static void kda_step_(BE *be, int B, int H, int K, int V, const real *q, const real *k, const real *v,
                      const real *g, const real *beta, real *const *S_h, real *const *S, real *o) {
    (void)be;
    (void)S_h; // the backend array (host memory here) is what the step reads
    REF_PAR_FOR(ref_par((8.0 * K * V + REF_FLOPS_EXP * K) * B * H),
        for (int r = 0; r < B; r++) {
            size_t qo = (size_t)r * H * K, vo = (size_t)r * H * V;
            mtrl_ref_kda_step(H, K, V, q + qo, k + qo, v + vo, g + qo, beta + (size_t)r * H, S[r], o + vo);
        });
}

// ---- latents: `real` elements (latent_size = sizeof(real)), so the reference runs unchanged ----------

static void latent_put_(BE *be, int B, int rows, int n, const real *src, int lds, void *const *dst, int ldd) {
    for (int b = 0; b < B; b++) copy_rows_(be, rows, n, src + (size_t)b * rows * lds, lds, dst[b], ldd);
}
static void latent_put_rows_(BE *be, int B, int n, const real *src, int lds, void *const *dst, int ldd) {
    latent_put_(be, B, 1, n, src, lds, dst, ldd);
}
static void latent_get_(BE *be, int rows, int n, const void *src, int lds, real *dst, int ldd) {
    copy_rows_(be, rows, n, src, lds, dst, ldd);
}
static void latent_gather_(BE *be, int rows, int n, const void *const *src, real *dst, int ldd) {
    for (int r = 0; r < rows; r++) copy_rows_(be, 1, n, src[r], n, dst + (size_t)r * ldd, ldd);
}
static void latent_download_(BE *be, size_t n, const void *src, real *dst) { copy_(be, dst, src, sizeof(real) * n); }
static void latent_upload_(BE *be, size_t n, const real *src, void *dst) { copy_(be, dst, src, sizeof(real) * n); }

static void attn_causal_fwd_(BE *be, int Tq, int Tk, int H, int Hk, int Dk, int Dv, real scale, const real *q,
                             const void *k, int ldk, const void *v, int ldv, real *o, real *lse) {
    (void)be;
    mtrl_ref_attn_causal_fwd(Tq, Tk, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv, o, lse);
}
static void attn_causal_bwd_(BE *be, int Tq, int Tk, int H, int Hk, int Dk, int Dv, real scale, const real *q,
                             const void *k, int ldk, const void *v, int ldv, const real *o, const real *lse,
                             const real *dout, real *dq, real *dk, real *dv) {
    (void)be;
    mtrl_ref_attn_causal_bwd(Tq, Tk, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv, o, lse, dout, dq, dk, dv);
}
static void attn_causal_fwd_varlen_(BE *be, int n, const int *qoffs, const int *koffs, int H, int Hk, int Dk,
                                    int Dv, real scale, const real *q, const void *k, int ldk, const void *v, int ldv,
                                    real *o, real *lse) {
    (void)be;
    mtrl_ref_attn_causal_fwd_varlen(n, qoffs, koffs, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv, o, lse);
}
static void attn_causal_bwd_varlen_(BE *be, int n, const int *qoffs, const int *koffs, int H, int Hk, int Dk,
                                    int Dv, real scale, const real *q, const void *k, int ldk, const void *v, int ldv,
                                    const real *o, const real *lse, const real *dout, real *dq, real *dk, real *dv) {
    (void)be;
    mtrl_ref_attn_causal_bwd_varlen(n, qoffs, koffs, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv, o, lse, dout, dq, dk,
                                    dv);
}
static void mla_absorb_q_(BE *be, int N, int H, int dn, int dr, int dv, int dc, const real *q, const real *W,
                          real *qt) {
    (void)be;
    mtrl_ref_mla_absorb_q(N, H, dn, dr, dv, dc, q, W, qt);
}
static void mla_absorb_q_bwd_(BE *be, int N, int H, int dn, int dr, int dv, int dc, const real *q, const real *W,
                              const real *dqt, real *dq, real *dW) {
    (void)be;
    mtrl_ref_mla_absorb_q_bwd(N, H, dn, dr, dv, dc, q, W, dqt, dq, dW);
}
static void mla_up_v_(BE *be, int N, int H, int dn, int dv, int dc, const real *cs, const real *W, real *a) {
    (void)be;
    mtrl_ref_mla_up_v(N, H, dn, dv, dc, cs, W, a);
}
static void mla_up_v_bwd_(BE *be, int N, int H, int dn, int dv, int dc, const real *cs, const real *W,
                          const real *da, real *dcs, real *dW) {
    (void)be;
    mtrl_ref_mla_up_v_bwd(N, H, dn, dv, dc, cs, W, da, dcs, dW);
}
static void mla_expand_kv_(BE *be, int N, int H, int dn, int dr, int dv, int dc, const real *c, int ldc,
                           const real *kr, int ldr, const real *W, real *k, real *v) {
    (void)be;
    mtrl_ref_mla_expand_kv(N, H, dn, dr, dv, dc, c, ldc, kr, ldr, W, k, v);
}
static void mla_expand_kv_bwd_(BE *be, int N, int H, int dn, int dr, int dv, int dc, const real *c, int ldc,
                               const real *W, const real *dk, const real *dvals, real *dlat_c, int ld_c,
                               real *dlat_kr, int ld_kr, real *dW) {
    (void)be;
    mtrl_ref_mla_expand_kv_bwd(N, H, dn, dr, dv, dc, c, ldc, W, dk, dvals, dlat_c, ld_c, dlat_kr, ld_kr, dW);
}
static void mla_decode_(BE *be, int B, int H, int dn, int dr, int dv, int dc, real scale, const real *q,
                        const real *W, const void *const *lat_h, const void *const *lat, int ld, const int *Tk_h,
                        const int *Tk, real *a) {
    (void)be;
    (void)lat_h; // the backend arrays (host memory here) are what the step reads
    (void)Tk_h;
    double flops = 0;  // the absorption and up-projection of every row, then its keys
    for (int r = 0; r < B; r++) flops += 2.0 * H * dc * (dn + dv) + (4.0 * (dc + dr) + REF_FLOPS_EXP) * Tk[r] * H;
    REF_PAR_FOR(ref_par(flops),
        for (int r = 0; r < B; r++) {
            const real *L = lat[r];
            mtrl_ref_mla_decode_absorbed_ld(H, dn, dr, dv, dc, scale, q + (size_t)r * H * (dn + dr), W, L, ld, L + dc, ld,
                                   Tk[r], a + (size_t)r * H * dv);
        });
}

static void moe_router_fwd_(BE *be, int N, int E, int K, const real *z, const real *beta, int sm, real rho,
                            int replay, int *sel, real *w, real *s) {
    (void)be;
    mtrl_ref_moe_router_fwd(N, E, K, z, beta, sm, rho, replay, sel, w, s);
}
static void moe_router_bwd_(BE *be, int N, int E, int K, const real *s, const int *sel, const real *w, int sm,
                            real rho, const real *dw, real *dz) {
    (void)be;
    mtrl_ref_moe_router_bwd(N, E, K, s, sel, w, sm, rho, dw, dz);
}
static void moe_dispatch_(BE *be, int N, int E, int K, const int *sel, int *off, int *perm, int *pos) {
    (void)be;
    mtrl_ref_moe_dispatch(N, E, K, sel, off, perm, pos);
}
static void moe_gather_(BE *be, int N, int K, int D, const int *pos, const real *x, real *Xp) {
    (void)be;
    mtrl_ref_moe_gather(N, K, D, pos, x, Xp);
}
static void moe_combine_fwd_(BE *be, int N, int K, int D, const int *pos, const real *w, const real *Yp, real *y) {
    (void)be;
    mtrl_ref_moe_combine_fwd(N, K, D, pos, w, Yp, y);
}
static void moe_combine_bwd_(BE *be, int N, int K, int D, const int *pos, const real *w, const real *Yp,
                             const real *dy, real *dYp, real *dw) {
    (void)be;
    mtrl_ref_moe_combine_bwd(N, K, D, pos, w, Yp, dy, dYp, dw);
}
static void moe_scatter_bwd_(BE *be, int N, int K, int D, const int *pos, const real *dXp, real *dx) {
    (void)be;
    mtrl_ref_moe_scatter_bwd(N, K, D, pos, dXp, dx);
}
static void moe_experts_fwd_(BE *be, int E, int D, int I, int R, const int *off, const real *Xp, const real *W1,
                             const real *W3, const real *W2, real *u1, real *u3, real *Yp) {
    (void)be;
    MTRL_CHECKF(off[E] == R, "moe_experts_fwd: %d rows given, the offsets end at %d", R, off[E]);
    mtrl_ref_moe_experts_fwd(E, D, I, off, Xp, W1, W3, W2, u1, u3, Yp);
}
static void moe_experts_bwd_(BE *be, int E, int D, int I, const int *off, const real *Xp, const real *W1,
                             const real *W3, const real *W2, const real *u1, const real *u3, const real *dYp,
                             real *dXp, real *dW1, real *dW3, real *dW2) {
    (void)be;
    mtrl_ref_moe_experts_bwd(E, D, I, off, Xp, W1, W3, W2, u1, u3, dYp, dXp, dW1, dW3, dW2);
}
static void moe_swiglu_fwd_(BE *be, int N, int D, int I, const real *x, const real *W1, const real *W3,
                            const real *W2, real *u1, real *u3, real *y) {
    (void)be;
    mtrl_ref_moe_swiglu_fwd(N, D, I, x, W1, W3, W2, u1, u3, y);
}
static void moe_swiglu_bwd_(BE *be, int N, int D, int I, const real *x, const real *W1, const real *W3,
                            const real *W2, const real *u1, const real *u3, const real *dy, real *dx, real *dW1,
                            real *dW3, real *dW2) {
    (void)be;
    mtrl_ref_moe_swiglu_bwd(N, D, I, x, W1, W3, W2, u1, u3, dy, dx, dW1, dW3, dW2);
}
static void moe_load_count_(BE *be, int N, int E, int K, const int *sel, int *load) {
    (void)be;
    mtrl_ref_moe_load_count(N, E, K, sel, load);
}
static int qb_beta_(BE *be, int N, int E, int K, const real *z, const real *bo, real *bn) {
    (void)be;
    return mtrl_ref_qb_beta_from_batch(N, E, K, z, bo, bn);
}
static int moe_stats_(BE *be, int N, int E, int K, const int *sel, const real *z, const real *bo, int level,
                      int *load, real *bn) {
    moe_load_count_(be, N, E, K, sel, load);
    return level >= 2 ? qb_beta_(be, N, E, K, z, bo, bn) : 1;
}
static void attnres_site_fwd_(BE *be, int N, int D, int S, const real *const *V, const real *w, const real *g,
                              real eps, real *h, real *alpha) {
    (void)be;
    mtrl_ref_attnres_site_fwd(N, D, S, V, w, g, eps, h, alpha);
}
static void attnres_site_bwd_(BE *be, int N, int D, int S, const real *const *V, const real *w, const real *g,
                              real eps, const real *alpha, const real *dh, real *const *dV, real *dw, real *dg) {
    (void)be;
    mtrl_ref_attnres_site_bwd(N, D, S, V, w, g, eps, alpha, dh, dV, dw, dg);
}

// MemAvailable and MemTotal of /proc/meminfo (kB there), 0 when unreadable.
static void mem_info_(BE *be, size_t *free_h, size_t *total_h, size_t *scratch_h, size_t *peak_h) {
    (void)be;
    size_t avail = 0, total = 0;
    FILE *f = fopen("/proc/meminfo", "r");
    if (f) {
        char line[256];
        unsigned long long kb;
        while (fgets(line, sizeof line, f)) {
            if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) avail = (size_t)kb * 1024;
            else if (sscanf(line, "MemTotal: %llu kB", &kb) == 1) total = (size_t)kb * 1024;
        }
        fclose(f);
    }
    if (free_h) *free_h = avail;
    if (total_h) *total_h = total;
    if (scratch_h) *scratch_h = 0;
    if (peak_h) *peak_h = 0;
}

// The reference multiplies the fp32 (fp64) masters themselves: no copy to refresh.
static void weights_changed_(BE *be, const real *params, size_t n) { (void)be, (void)params, (void)n; }

// Host memory: uploads and downloads are plain copies.
static void upload_(BE *be, void *dst, const void *src, size_t bytes) { copy_(be, dst, src, bytes); }
static void download_(BE *be, void *dst, const void *src, size_t bytes) { copy_(be, dst, src, bytes); }

// The CPU records nothing: every call runs as it is made.
static int graph_begin_(BE *be) {
    (void)be;
    return -1;
}
static void *graph_end_(BE *be) {
    (void)be;
    return NULL;
}
static int graph_launch_(BE *be, void *g) {
    (void)be;
    (void)g;
    return -1;
}
static void graph_free_(BE *be, void *g) {
    (void)be;
    (void)g;
}

#define BACKEND_ENTRY_(name) .name = name##_,
static mtrl_backend cpu_ = {
    .device = MTRL_DEVICE_CPU,
    .latent_size = sizeof(real),
    MTRL_BACKEND_OPS(BACKEND_ENTRY_)
};

mtrl_backend *mtrl_backend_cpu(void) { return &cpu_; }

void mtrl_backend_destroy(mtrl_backend *be) {
    if (!be || be == &cpu_) return;
#if defined(MTRL_HAVE_CUDA) && !REAL_IS_F64
    void mtrl_backend_cuda_destroy_(mtrl_backend *);
    mtrl_backend_cuda_destroy_(be);
#endif
}
