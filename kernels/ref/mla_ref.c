// mla_ref.c: causal attention and MLA latent algebra of the CPU reference (see mla_ref.h).
#include "kernels/ref/mla_ref.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ref/gemm_ref.h"
#include "kernels/ref/par_ref.h"

// Tile sizes of the flash-style loops: a row block of ATT_BR queries against a key block of
// ATT_BC keys is the most score memory ever held (per thread).
enum { ATT_BR = 32, ATT_BC = 64 };

static inline int imin_(int a, int b) { return a < b ? a : b; }
static inline int imax_(int a, int b) { return a > b ? a : b; }

// ---- forward -------------------------------------------------------------------------------

void mtrl_ref_attn_causal_fwd(int Tq, int Tk, int H, int Hk, int Dk, int Dv, real scale, const real *q,
                     const real *k, int ldk, const real *v, int ldv, real *o, real *lse) {
    if (Tq <= 0 || H <= 0) return;
    const int G = H / Hk, off = Tk - Tq, ldq = H * Dk;
    const int nrb = (Tq + ATT_BR - 1) / ATT_BR, items = H * nrb;
    // Whole-sequence kernels fork with `parallel if`: one runtime call per call, not per row.
    const double pairs = (double)Tq * ((double)off + 0.5 * Tq) * H;
    #pragma omp parallel if (ref_par(pairs * (2.0 * (Dk + Dv) + REF_FLOPS_EXP)))
    {
        real *S = malloc(sizeof(real) * ATT_BR * ATT_BC);
        real *acc = malloc(sizeof(real) * ATT_BR * (size_t)Dv);
        double m[ATT_BR], l[ATT_BR];
        // Later row blocks see more keys: hand them out first so the tail balances.
        #pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < items; it++) {
            const int rb = nrb - 1 - it / H, h = it % H, j = h / G;
            const int i0 = rb * ATT_BR, nr = imin_(ATT_BR, Tq - i0);
            const real *qh = q + (size_t)i0 * ldq + (size_t)h * Dk;
            const real *kj = k + (size_t)j * Dk, *vj = v + (size_t)j * Dv;
            for (int r = 0; r < nr; r++) { m[r] = -INFINITY; l[r] = 0.0; }
            memset(acc, 0, sizeof(real) * (size_t)nr * Dv);
            const int send = off + i0 + nr;  // keys [0, send) cover the block's last row
            for (int s0 = 0; s0 < send; s0 += ATT_BC) {
                const int nc = imin_(ATT_BC, send - s0);
                mtrl_ref_gemm(0, 1, nr, nc, Dk, scale, qh, ldq, kj + (size_t)s0 * ldk, ldk, 0, S, ATT_BC);
                for (int r = 0; r < nr; r++) {
                    real *Sr = S + (size_t)r * ATT_BC;
                    const int cmax = imin_(off + i0 + r - s0, nc - 1);  // last visible key
                    if (cmax < 0) { memset(Sr, 0, sizeof(real) * (size_t)nc); continue; }
                    double mx = m[r];
                    for (int c = 0; c <= cmax; c++) if ((double)Sr[c] > mx) mx = (double)Sr[c];
                    const double alpha = exp(m[r] - mx);  // 0 on the first visible block
                    double sum = 0.0;
                    for (int c = 0; c <= cmax; c++) {
                        double e = exp((double)Sr[c] - mx);
                        Sr[c] = (real)e;
                        sum += e;
                    }
                    for (int c = cmax + 1; c < nc; c++) Sr[c] = 0;
                    l[r] = l[r] * alpha + sum;
                    m[r] = mx;
                    if (alpha != 1.0) {
                        real *ar = acc + (size_t)r * Dv;
                        for (int d = 0; d < Dv; d++) ar[d] = (real)((double)ar[d] * alpha);
                    }
                }
                mtrl_ref_gemm(0, 0, nr, Dv, nc, 1, S, ATT_BC, vj + (size_t)s0 * ldv, ldv, 1, acc, Dv);
            }
            for (int r = 0; r < nr; r++) {
                const int i = i0 + r;
                real *orow = o + ((size_t)i * H + h) * Dv;
                const real *ar = acc + (size_t)r * Dv;
                const double inv = 1.0 / l[r];
                for (int d = 0; d < Dv; d++) orow[d] = (real)((double)ar[d] * inv);
                lse[(size_t)i * H + h] = (real)(m[r] + log(l[r]));
            }
        }
        free(S);
        free(acc);
    }
}

// ---- backward ------------------------------------------------------------------------------

// Recomputes one (row block × key block) tile: P = exp(scale Q Kᵀ − lse) under the causal
// mask, and in place of dP the score gradient dS = P ⊙ (dO Vᵀ − rowsum(dO ⊙ O)).
// Qh/dOh point at row i0 of head h (strides ldq, ldo); Kj/Vj at key s0 of key head j.
static void attn_tile_bwd_(int nr, int nc, int i0, int s0, int off, int H, int h, int Dk, int Dv,
                           real scale, const real *Qh, int ldq, const real *Kj, int ldk,
                           const real *Vj, int ldv, const real *dOh, int ldo, const real *lse,
                           const double *Dsum, real *P, real *dS) {
    mtrl_ref_gemm(0, 1, nr, nc, Dk, scale, Qh, ldq, Kj, ldk, 0, P, ATT_BC);
    mtrl_ref_gemm(0, 1, nr, nc, Dv, 1, dOh, ldo, Vj, ldv, 0, dS, ATT_BC);
    for (int r = 0; r < nr; r++) {
        const int i = i0 + r;
        const int cmax = imin_(off + i - s0, nc - 1);
        const double L = (double)lse[(size_t)i * H + h], Di = Dsum[(size_t)i * H + h];
        real *Pr = P + (size_t)r * ATT_BC, *dSr = dS + (size_t)r * ATT_BC;
        for (int c = 0; c < nc; c++) {
            if (c > cmax) { Pr[c] = 0; dSr[c] = 0; continue; }
            double p = exp((double)Pr[c] - L);
            Pr[c] = (real)p;
            dSr[c] = (real)(p * ((double)dSr[c] - Di));
        }
    }
}

// Do [a, a+na) and [b, b+nb) (in reals) overlap? Used to pick a race-free partition of the
// dk/dv accumulation when the two may alias.
static int ranges_overlap_(const real *a, size_t na, const real *b, size_t nb) {
    uintptr_t a0 = (uintptr_t)a, a1 = (uintptr_t)(a + na);
    uintptr_t b0 = (uintptr_t)b, b1 = (uintptr_t)(b + nb);
    return a0 < b1 && b0 < a1;
}

void mtrl_ref_attn_causal_bwd(int Tq, int Tk, int H, int Hk, int Dk, int Dv, real scale, const real *q,
                     const real *k, int ldk, const real *v, int ldv, const real *o,
                     const real *lse, const real *dout, real *dq, real *dk, real *dv) {
    if (Tq <= 0 || H <= 0) return;
    const int G = H / Hk, off = Tk - Tq, ldq = H * Dk, ldo = H * Dv;

    // D_i,h = dO·O: the softmax backward's row term, shared by both passes.
    double *Dsum = malloc(sizeof(double) * (size_t)Tq * H);
    REF_PAR_FOR(ref_par(2.0 * Tq * H * Dv),
        for (int ih = 0; ih < Tq * H; ih++) {
            const real *a = o + (size_t)ih * Dv, *b = dout + (size_t)ih * Dv;
            double s = 0.0;
            for (int d = 0; d < Dv; d++) s += (double)a[d] * (double)b[d];
            Dsum[ih] = s;
        });

    // Pass 1: dk, dv by key block. Each work item owns key rows [s0, s0+nc) of its key heads,
    // so the accumulation needs no atomics and its order is fixed. When dk and dv may alias
    // across key heads (Hk > 1), one item takes all key heads of its block.
    const int nkb = (Tk + ATT_BC - 1) / ATT_BC;
    int per_head = 1;
    if (Hk > 1 && Tk > 0) {
        size_t nk = (size_t)(Tk - 1) * ldk + (size_t)Hk * Dk;
        size_t nv = (size_t)(Tk - 1) * ldv + (size_t)Hk * Dv;
        per_head = !ranges_overlap_(dk, nk, dv, nv);
    }
    const int jgroups = per_head ? Hk : 1, items1 = nkb * jgroups;
    const int par = ref_par((double)Tq * ((double)off + 0.5 * Tq) * H * (4.0 * (Dk + Dv) + REF_FLOPS_EXP));
    #pragma omp parallel if (par)
    {
        real *P = malloc(sizeof(real) * ATT_BR * ATT_BC);
        real *dS = malloc(sizeof(real) * ATT_BR * ATT_BC);
        #pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < items1; it++) {
            const int kb = it / jgroups, jg = it % jgroups;
            const int j0 = per_head ? jg : 0, j1 = per_head ? jg + 1 : Hk;
            const int s0 = kb * ATT_BC, nc = imin_(ATT_BC, Tk - s0);
            const int istart = imax_(0, s0 - off);  // first query row that sees key s0
            for (int j = j0; j < j1; j++) {
                const real *Kj = k + (size_t)s0 * ldk + (size_t)j * Dk;
                const real *Vj = v + (size_t)s0 * ldv + (size_t)j * Dv;
                real *dKj = dk + (size_t)s0 * ldk + (size_t)j * Dk;
                real *dVj = dv + (size_t)s0 * ldv + (size_t)j * Dv;
                for (int h = j * G; h < (j + 1) * G; h++) {
                    for (int i0 = istart; i0 < Tq; i0 += ATT_BR) {
                        const int nr = imin_(ATT_BR, Tq - i0);
                        const real *Qh = q + (size_t)i0 * ldq + (size_t)h * Dk;
                        const real *dOh = dout + (size_t)i0 * ldo + (size_t)h * Dv;
                        attn_tile_bwd_(nr, nc, i0, s0, off, H, h, Dk, Dv, scale, Qh, ldq, Kj, ldk,
                                       Vj, ldv, dOh, ldo, lse, Dsum, P, dS);
                        mtrl_ref_gemm(1, 0, nc, Dv, nr, 1, P, ATT_BC, dOh, ldo, 1, dVj, ldv);
                        mtrl_ref_gemm(1, 0, nc, Dk, nr, scale, dS, ATT_BC, Qh, ldq, 1, dKj, ldk);
                    }
                }
            }
        }
        free(P);
        free(dS);
    }

    // Pass 2: dq by (head, row block), recomputing the same tiles.
    const int nrb = (Tq + ATT_BR - 1) / ATT_BR, items2 = H * nrb;
    #pragma omp parallel if (par)
    {
        real *P = malloc(sizeof(real) * ATT_BR * ATT_BC);
        real *dS = malloc(sizeof(real) * ATT_BR * ATT_BC);
        #pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < items2; it++) {
            const int rb = nrb - 1 - it / H, h = it % H, j = h / G;
            const int i0 = rb * ATT_BR, nr = imin_(ATT_BR, Tq - i0);
            const real *Qh = q + (size_t)i0 * ldq + (size_t)h * Dk;
            const real *dOh = dout + (size_t)i0 * ldo + (size_t)h * Dv;
            real *dQh = dq + (size_t)i0 * ldq + (size_t)h * Dk;
            for (int r = 0; r < nr; r++) memset(dQh + (size_t)r * ldq, 0, sizeof(real) * (size_t)Dk);
            const int send = off + i0 + nr;
            for (int s0 = 0; s0 < send; s0 += ATT_BC) {
                const int nc = imin_(ATT_BC, send - s0);
                const real *Kj = k + (size_t)s0 * ldk + (size_t)j * Dk;
                const real *Vj = v + (size_t)s0 * ldv + (size_t)j * Dv;
                attn_tile_bwd_(nr, nc, i0, s0, off, H, h, Dk, Dv, scale, Qh, ldq, Kj, ldk, Vj, ldv,
                               dOh, ldo, lse, Dsum, P, dS);
                mtrl_ref_gemm(0, 0, nr, Dk, nc, scale, dS, ATT_BC, Kj, ldk, 1, dQh, ldq);
            }
        }
        free(P);
        free(dS);
    }
    free(Dsum);
}

// ---- varlen: one call per piece -----------------------------------------------------------

void mtrl_ref_attn_causal_fwd_varlen(int n, const int *qoffs, const int *koffs, int H, int Hk, int Dk, int Dv,
                                     real scale, const real *q, const real *k, int ldk, const real *v, int ldv,
                                     real *o, real *lse) {
    const int *ko = koffs ? koffs : qoffs;
    for (int i = 0; i < n; i++) {
        const size_t q0 = (size_t)qoffs[i], k0 = (size_t)ko[i];
        mtrl_ref_attn_causal_fwd(qoffs[i + 1] - qoffs[i], ko[i + 1] - ko[i], H, Hk, Dk, Dv, scale, q + q0 * H * Dk,
                                 k + k0 * ldk, ldk, v + k0 * ldv, ldv, o + q0 * H * Dv, lse + q0 * H);
    }
}

void mtrl_ref_attn_causal_bwd_varlen(int n, const int *qoffs, const int *koffs, int H, int Hk, int Dk, int Dv,
                                     real scale, const real *q, const real *k, int ldk, const real *v, int ldv,
                                     const real *o, const real *lse, const real *dout, real *dq, real *dk,
                                     real *dv) {
    const int *ko = koffs ? koffs : qoffs;
    for (int i = 0; i < n; i++) {
        const size_t q0 = (size_t)qoffs[i], k0 = (size_t)ko[i];
        mtrl_ref_attn_causal_bwd(qoffs[i + 1] - qoffs[i], ko[i + 1] - ko[i], H, Hk, Dk, Dv, scale, q + q0 * H * Dk,
                                 k + k0 * ldk, ldk, v + k0 * ldv, ldv, o + q0 * H * Dv, lse + q0 * H,
                                 dout + q0 * H * Dv, dq + q0 * H * Dk, dk + k0 * ldk, dv + k0 * ldv);
    }
}

// ---- absorbed <-> expanded helpers ---------------------------------------------------------

static inline const real *w_uk_(const real *W, int h, int dn, int dv, int dc) {
    return W + (size_t)h * (dn + dv) * dc;
}
static inline const real *w_uv_(const real *W, int h, int dn, int dv, int dc) {
    return W + ((size_t)h * (dn + dv) + dn) * dc;
}

void mtrl_ref_mla_absorb_q(int N, int H, int dn, int dr, int dv, int dc, const real *q, const real *W_kvb,
                  real *qt) {
    const int ldq = H * (dn + dr), ldt = H * (dc + dr);
    for (int h = 0; h < H; h++) {
        // q̃^c [N][dc] = q^n [N][dn] · W_UK,h [dn][dc]
        mtrl_ref_gemm(0, 0, N, dc, dn, 1, q + (size_t)h * (dn + dr), ldq, w_uk_(W_kvb, h, dn, dv, dc), dc,
                 0, qt + (size_t)h * (dc + dr), ldt);
        for (int t = 0; t < N; t++)
            memcpy(qt + (size_t)t * ldt + (size_t)h * (dc + dr) + dc,
                   q + (size_t)t * ldq + (size_t)h * (dn + dr) + dn, sizeof(real) * (size_t)dr);
    }
}

void mtrl_ref_mla_absorb_q_bwd(int N, int H, int dn, int dr, int dv, int dc, const real *q,
                      const real *W_kvb, const real *dqt, real *dq, real *dW_kvb) {
    const int ldq = H * (dn + dr), ldt = H * (dc + dr);
    for (int h = 0; h < H; h++) {
        const real *dqc = dqt + (size_t)h * (dc + dr);
        mtrl_ref_gemm(0, 1, N, dn, dc, 1, dqc, ldt, w_uk_(W_kvb, h, dn, dv, dc), dc, 0,
                 dq + (size_t)h * (dn + dr), ldq);
        for (int t = 0; t < N; t++)
            memcpy(dq + (size_t)t * ldq + (size_t)h * (dn + dr) + dn,
                   dqt + (size_t)t * ldt + (size_t)h * (dc + dr) + dc, sizeof(real) * (size_t)dr);
        if (dW_kvb)  // dW_UK,h += q^nᵀ dq̃^c
            mtrl_ref_gemm(1, 0, dn, dc, N, 1, q + (size_t)h * (dn + dr), ldq, dqc, ldt, 1,
                     dW_kvb + (size_t)h * (dn + dv) * dc, dc);
    }
}

void mtrl_ref_mla_up_v(int N, int H, int dn, int dv, int dc, const real *cstar, const real *W_kvb, real *a) {
    for (int h = 0; h < H; h++)  // a_h [N][dv] = ĉ*_h [N][dc] · W_UV,hᵀ
        mtrl_ref_gemm(0, 1, N, dv, dc, 1, cstar + (size_t)h * dc, H * dc, w_uv_(W_kvb, h, dn, dv, dc), dc,
                 0, a + (size_t)h * dv, H * dv);
}

void mtrl_ref_mla_up_v_bwd(int N, int H, int dn, int dv, int dc, const real *cstar, const real *W_kvb,
                  const real *da, real *dcstar, real *dW_kvb) {
    for (int h = 0; h < H; h++) {
        mtrl_ref_gemm(0, 0, N, dc, dv, 1, da + (size_t)h * dv, H * dv, w_uv_(W_kvb, h, dn, dv, dc), dc, 0,
                 dcstar + (size_t)h * dc, H * dc);
        if (dW_kvb)  // dW_UV,h += daᵀ ĉ*
            mtrl_ref_gemm(1, 0, dv, dc, N, 1, da + (size_t)h * dv, H * dv, cstar + (size_t)h * dc, H * dc, 1,
                     dW_kvb + ((size_t)h * (dn + dv) + dn) * dc, dc);
    }
}

void mtrl_ref_mla_expand_kv(int N, int H, int dn, int dr, int dv, int dc, const real *c, int ldc,
                   const real *kr, int ldr, const real *W_kvb, real *k, real *v) {
    const int ldk = H * (dn + dr), ldv = H * dv;
    for (int h = 0; h < H; h++) {
        mtrl_ref_gemm(0, 1, N, dn, dc, 1, c, ldc, w_uk_(W_kvb, h, dn, dv, dc), dc, 0,
                 k + (size_t)h * (dn + dr), ldk);
        mtrl_ref_gemm(0, 1, N, dv, dc, 1, c, ldc, w_uv_(W_kvb, h, dn, dv, dc), dc, 0,
                 v + (size_t)h * dv, ldv);
        for (int t = 0; t < N; t++)
            memcpy(k + (size_t)t * ldk + (size_t)h * (dn + dr) + dn, kr + (size_t)t * ldr,
                   sizeof(real) * (size_t)dr);
    }
}

void mtrl_ref_mla_expand_kv_bwd(int N, int H, int dn, int dr, int dv, int dc, const real *c, int ldc,
                       const real *W_kvb, const real *dk, const real *dvals, real *dlat_c,
                       int ld_c, real *dlat_kr, int ld_kr, real *dW_kvb) {
    const int ldk = H * (dn + dr), ldv = H * dv;
    for (int h = 0; h < H; h++) {
        const real *dkn = dk + (size_t)h * (dn + dr), *dvh = dvals + (size_t)h * dv;
        mtrl_ref_gemm(0, 0, N, dc, dn, 1, dkn, ldk, w_uk_(W_kvb, h, dn, dv, dc), dc, 1, dlat_c, ld_c);
        mtrl_ref_gemm(0, 0, N, dc, dv, 1, dvh, ldv, w_uv_(W_kvb, h, dn, dv, dc), dc, 1, dlat_c, ld_c);
        if (dW_kvb) {
            mtrl_ref_gemm(1, 0, dn, dc, N, 1, dkn, ldk, c, ldc, 1, dW_kvb + (size_t)h * (dn + dv) * dc, dc);
            mtrl_ref_gemm(1, 0, dv, dc, N, 1, dvh, ldv, c, ldc, 1,
                     dW_kvb + ((size_t)h * (dn + dv) + dn) * dc, dc);
        }
    }
    // k^r is shared by all heads: its gradient is the sum over heads, in head order.
    for (int t = 0; t < N; t++) {
        real *g = dlat_kr + (size_t)t * ld_kr;
        for (int d = 0; d < dr; d++) {
            double s = (double)g[d];
            for (int h = 0; h < H; h++) s += (double)dk[(size_t)t * ldk + (size_t)h * (dn + dr) + dn + d];
            g[d] = (real)s;
        }
    }
}

// ---- absorbed decode -----------------------------------------------------------------------

void mtrl_ref_mla_decode_absorbed(int H, int dn, int dr, int dv, int dc, real scale, const real *q,
                         const real *W_kvb, const real *cache_c, const real *cache_kr, int Tk,
                         real *a) {
    mtrl_ref_mla_decode_absorbed_ld(H, dn, dr, dv, dc, scale, q, W_kvb, cache_c, dc, cache_kr, dr, Tk, a);
}

// One split-K chunk of the absorbed decode: keys [ch·clen, min(Tk, (ch+1)·clen)) into the chunk's
// running max pm, sum pl and accumulator pacc (per head); S: H × ATT_BC scores of scratch.
static void decode_chunk_(int ch, int clen, int H, int dr, int dc, real scale, const real *qt,
                          const real *cache_c, int ldc, const real *cache_kr, int ldr, int Tk, real *S,
                          double *pm, double *pl, real *pacc) {
    const int Dl = dc + dr, c0 = ch * clen, c1 = imin_(Tk, c0 + clen);
    double *m = pm + (size_t)ch * H, *l = pl + (size_t)ch * H;
    real *acc = pacc + (size_t)ch * H * dc;
    for (int h = 0; h < H; h++) { m[h] = -INFINITY; l[h] = 0.0; }
    memset(acc, 0, sizeof(real) * (size_t)H * dc);
    for (int s0 = c0; s0 < c1; s0 += ATT_BC) {
        const int nc = imin_(ATT_BC, c1 - s0);
        mtrl_ref_gemm(0, 1, H, nc, dc, scale, qt, Dl, cache_c + (size_t)s0 * ldc, ldc, 0, S, ATT_BC);
        if (dr > 0)
            mtrl_ref_gemm(0, 1, H, nc, dr, scale, qt + dc, Dl, cache_kr + (size_t)s0 * ldr, ldr, 1, S, ATT_BC);
        for (int h = 0; h < H; h++) {
            real *Sh = S + (size_t)h * ATT_BC;
            double mx = m[h];
            for (int c = 0; c < nc; c++) if ((double)Sh[c] > mx) mx = (double)Sh[c];
            const double alpha = exp(m[h] - mx);
            double sum = 0.0;
            for (int c = 0; c < nc; c++) {
                double e = exp((double)Sh[c] - mx);
                Sh[c] = (real)e;
                sum += e;
            }
            l[h] = l[h] * alpha + sum;
            m[h] = mx;
            if (alpha != 1.0) {
                real *ah = acc + (size_t)h * dc;
                for (int d = 0; d < dc; d++) ah[d] = (real)((double)ah[d] * alpha);
            }
        }
        mtrl_ref_gemm(0, 0, H, dc, nc, 1, S, ATT_BC, cache_c + (size_t)s0 * ldc, ldc, 1, acc, dc);
    }
}

void mtrl_ref_mla_decode_absorbed_ld(int H, int dn, int dr, int dv, int dc, real scale, const real *q,
                            const real *W_kvb, const real *cache_c, int ldc,
                            const real *cache_kr, int ldr, int Tk, real *a) {
    if (Tk <= 0) { memset(a, 0, sizeof(real) * (size_t)H * dv); return; }
    const int Dl = dc + dr;
    real *qt = malloc(sizeof(real) * (size_t)H * Dl);
    mtrl_ref_mla_absorb_q(1, H, dn, dr, dv, dc, q, W_kvb, qt);

    // Split-K over the cache: chunk boundaries depend only on Tk, and the chunks are merged in
    // order, so the result does not depend on the number of threads. All H heads share each
    // cache row (MQA), so one chunk reads its rows once for every head.
    int nch = (Tk + 255) / 256;
    if (nch > 64) nch = 64;
    const int clen = (Tk + nch - 1) / nch;
    nch = (Tk + clen - 1) / clen;
    double *pm = malloc(sizeof(double) * (size_t)nch * H * 2), *pl = pm + (size_t)nch * H;
    real *pacc = malloc(sizeof(real) * (size_t)nch * H * dc);
    if (ref_par((4.0 * Dl + REF_FLOPS_EXP) * Tk * H)) {
        #pragma omp parallel
        {
            real *S = malloc(sizeof(real) * (size_t)H * ATT_BC);
            #pragma omp for schedule(dynamic, 1)
            for (int ch = 0; ch < nch; ch++)
                decode_chunk_(ch, clen, H, dr, dc, scale, qt, cache_c, ldc, cache_kr, ldr, Tk, S, pm, pl, pacc);
            free(S);
        }
    } else {
        real *S = malloc(sizeof(real) * (size_t)H * ATT_BC);
        for (int ch = 0; ch < nch; ch++)
            decode_chunk_(ch, clen, H, dr, dc, scale, qt, cache_c, ldc, cache_kr, ldr, Tk, S, pm, pl, pacc);
        free(S);
    }
    // Merge the chunks: ĉ*_h = Σ_ch e^{m_ch − M} acc_ch / Σ_ch e^{m_ch − M} l_ch.
    real *cstar = malloc(sizeof(real) * (size_t)H * dc);
    double *row = malloc(sizeof(double) * (size_t)dc);
    for (int h = 0; h < H; h++) {
        double M = -INFINITY, L = 0.0;
        for (int ch = 0; ch < nch; ch++) if (pm[(size_t)ch * H + h] > M) M = pm[(size_t)ch * H + h];
        for (int d = 0; d < dc; d++) row[d] = 0.0;
        for (int ch = 0; ch < nch; ch++) {
            const double w = exp(pm[(size_t)ch * H + h] - M);
            L += w * pl[(size_t)ch * H + h];
            const real *ah = pacc + ((size_t)ch * H + h) * dc;
            for (int d = 0; d < dc; d++) row[d] += w * (double)ah[d];
        }
        for (int d = 0; d < dc; d++) cstar[(size_t)h * dc + d] = (real)(row[d] / L);
    }
    mtrl_ref_mla_up_v(1, H, dn, dv, dc, cstar, W_kvb, a);
    free(row);
    free(cstar);
    free(pacc);
    free(pm);
    free(qt);
}
