// mtrl-test: gpu f64 timeout=600
// test_cuda_kda_varlen.cu: the varlen KDA forward (kda/chunk_varlen_mma.cu, mtrl_kda_chunk_fwd_varlen:
// n packed pieces each from the zero state, one prep and one state-pass launch for all) against
// mtrl_kda_chunk_fwd per piece BIT FOR BIT (o, every piece's final state, every piece's tile
// states: the same device code on the same inputs, tile for tile) and against the fp64 reference
// (mtrl_ref_kda_chunk_fwd_varlen) at 1e-4 (v3 bf16x3's tolerance, test_cuda_kda.cu says why).
// Packs: pieces of 1, 15, 16, 17, 64, 333 tokens (one partial tile, one tile minus and plus one
// token, more tiles than the ring's 6 stages), one piece alone (1 and 333), and mixes of 100
// pieces of random lengths with an empty piece among them, at H = 2 and 16. Outputs are poisoned
// with NaN first. Per pack also: the prefill form (o only) and the state-only form (S_final only)
// give the training form's bits, plain
// bf16 records (kda_plain_bf16) the per-piece bf16 bits, and a shape v3 does not take (K = V = 32:
// the per-piece fallback) the reference's numbers at 1e-4. The varlen backward
// (mtrl_kda_chunk_bwd_varlen, one launch per stage) on the varlen forward's tile states against the
// fp64 varlen backward on the reference's: 1e-3 where the states are v3's (test_cuda_kda.cu's
// tolerance for gradients through v3's forward), 1e-4 at K = 32; and dq, dk, dv, dg, dβ BIT FOR BIT
// mtrl_kda_chunk_bwd per piece, on the tile states and with them recomputed (NULL), and on the
// edge pack with the options' other two pass-3 kernels. The KDA layer's short conv over the same
// packs (mtrl_shortconv_fwd_varlen, one launch): bit for bit mtrl_shortconv_fwd per piece from the
// zero window, and the fp64 reference (mtrl_ref_shortconv_fwd_varlen) at 1e-5, C = H K, W = 4; its
// backward (mtrl_shortconv_bwd_varlen): dx bit for bit mtrl_shortconv_bwd per piece, dw (summed in
// the pack's row blocks, not per piece) at 1e-5 of the per-piece calls' and of fp64.
// The piece_io forms (mtrl_kda_chunk_fwd_varlen_io, mtrl_shortconv_fwd_varlen_io: each piece from
// its own random state / window, some from none) over the same packs: bit for bit the per-piece
// calls from those states (o, final states, tile states; y, new windows), into separate states and
// in place, and the fp64 piece_io references at 1e-4 (KDA) and 1e-5 (conv); a pack of two empty
// pieces (no tiles: the states pass through, or stay where they are in place).
#include "tests/testhelp.h"
#include "kernels/lab/cuda_testutil.h"
#include "kernels/ref/kda_ref.h"
#include "kernels/ref/ops_ref.h"

// Inputs the layer could feed the core: |k| about 1 (entries N(0, 1/K)), q smaller, β in (0, 1),
// g in (-5, -0.01): the decay well inside the chunked kernels' range.
static void vl_inputs_(size_t nqk, size_t nv, size_t nb, int K, double *q, double *k, double *v, double *g,
                       double *beta) {
    tu_fill_normal(q, nqk, 1.0 / K);
    tu_fill_normal(k, nqk, 1.0 / sqrt((double)K));
    tu_fill_normal(v, nv, 1.0);
    tu_fill_unif(g, nqk, -5.0, -0.01);
    tu_fill_unif(beta, nb, 0.05, 0.95);
}


typedef struct {
    float *o, *Sf, *St;
} vl_out_;

static vl_out_ vl_out_nan_(mtrl_cuda_ctx *ctx, size_t nv, size_t nsf, size_t nst) {
    vl_out_ r = {tu_dev_nan(ctx, nv), tu_dev_nan(ctx, nsf), tu_dev_nan(ctx, nst)};
    return r;
}
static void vl_out_free_(vl_out_ *r) {
    mtrl_cuda_free(r->o);
    mtrl_cuda_free(r->Sf);
    mtrl_cuda_free(r->St);
}

// o, S_final and S_tiles against the fp64 reference's at 1e-4 (got: host scratch for the largest).
static void vl_check_fp64_(const char *pre, const vl_out_ *r, const double *o, const double *Sf, const double *St,
                           size_t nv, size_t nsf, size_t nst, double *got) {
    const struct {
        const char *what;
        const float *d;
        const double *ref;
        size_t n;
    } c[3] = {{"o vs fp64", r->o, o, nv}, {"S_final vs fp64", r->Sf, Sf, nsf}, {"S_tiles vs fp64", r->St, St, nst}};
    for (int i = 0; i < 3; i++) {
        char what[64];
        snprintf(what, sizeof what, "%s%s", pre, c[i].what);
        tu_get_f32(got, c[i].d, c[i].n);
        TU_CHECK_REL(what, got, c[i].ref, c[i].n, 1e-4);
    }
}

// The per-piece launches the model ran before the varlen op (S0 = NULL: every piece from zero).
static void vl_per_piece_(mtrl_cuda_ctx *ctx, int n, const int *offs, int H, int K, int V, const float *q,
                          const float *k, const float *v, const float *g, const float *beta, vl_out_ *r) {
    size_t ns = (size_t)H * K * V, tile = 0;
    for (int i = 0; i < n; i++) {
        int Ti = offs[i + 1] - offs[i];
        size_t x = (size_t)offs[i];
        TEST_EQ_INT(mtrl_kda_chunk_fwd(ctx, Ti, H, K, V, q + x * H * K, k + x * H * K, v + x * H * V,
                                       g + x * H * K, beta + x * H, NULL, r->o + x * H * V, r->Sf + i * ns,
                                       r->St + tile * ns),
                    0);
        tile += (size_t)mtrl_ref_kda_tile_count(Ti);
    }
}

// The per-piece backward the model ran before the varlen one: mtrl_kda_chunk_bwd per piece with S0,
// dS_final and dS0 NULL, the piece's tile states (St, or NULL: recomputed) at its place.
typedef struct {
    float *dq, *dk, *dv, *dg, *db;
} vl_grad_;
static vl_grad_ vl_grad_nan_(mtrl_cuda_ctx *ctx, size_t nqk, size_t nv, size_t nb) {
    vl_grad_ r = {tu_dev_nan(ctx, nqk), tu_dev_nan(ctx, nqk), tu_dev_nan(ctx, nv), tu_dev_nan(ctx, nqk),
                  tu_dev_nan(ctx, nb)};
    return r;
}
static void vl_grad_free_(vl_grad_ *r) {
    float *p[5] = {r->dq, r->dk, r->dv, r->dg, r->db};
    for (int i = 0; i < 5; i++) mtrl_cuda_free(p[i]);
}
static void vl_bwd_per_piece_(mtrl_cuda_ctx *ctx, int n, const int *offs, int H, int K, int V, const float *q,
                              const float *k, const float *v, const float *g, const float *beta, const float *St,
                              const float *dout, vl_grad_ *r) {
    size_t ns = (size_t)H * K * V, tile = 0;
    for (int i = 0; i < n; i++) {
        int Ti = offs[i + 1] - offs[i];
        size_t x = (size_t)offs[i], xk = x * H * K, xv = x * H * V;
        TEST_EQ_INT(mtrl_kda_chunk_bwd(ctx, Ti, H, K, V, q + xk, k + xk, v + xv, g + xk, beta + x * H, NULL,
                                       St ? St + tile * ns : NULL, dout + xv, NULL, r->dq + xk, r->dk + xk,
                                       r->dv + xv, r->dg + xk, r->db + x * H, NULL),
                    0);
        tile += (size_t)mtrl_ref_kda_tile_count(Ti);
    }
}
// The varlen backward against the per-piece one, bit for bit, gradient by gradient.
static void vl_bwd_same_(const char *form, const vl_grad_ *a, const vl_grad_ *b, size_t nqk, size_t nv, size_t nb) {
    const float *x[5] = {a->dq, a->dk, a->dv, a->dg, a->db}, *y[5] = {b->dq, b->dk, b->dv, b->dg, b->db};
    const size_t sz[5] = {nqk, nqk, nv, nqk, nb};
    static const char *nm[5] = {"dq", "dk", "dv", "dg", "dbeta"};
    for (int i = 0; i < 5; i++) {
        char what[96];
        snprintf(what, sizeof what, "%s: bwd %s == per piece", form, nm[i]);
        TU_SAME(what, x[i], y[i], sz[i]);
    }
}

// The pack's offsets [n + 1] (malloc'd) and its pieces' tiles in all (*nt).
static int *vl_offs_(int n, const int *len, size_t *nt) {
    int *offs = (int *)malloc(sizeof(int) * ((size_t)n + 1));
    offs[0] = 0;
    *nt = 0;
    for (int i = 0; i < n; i++) {
        offs[i + 1] = offs[i] + len[i];
        *nt += (size_t)mtrl_ref_kda_tile_count(len[i]);
    }
    return offs;
}

static void test_varlen(mtrl_cuda_ctx *ctx, const char *name, int n, const int *len, int H, int K) {
    const int V = K;
    size_t nt = 0;
    int *offs = vl_offs_(n, len, &nt);
    int T = offs[n];
    printf("varlen %s: %d pieces, T=%d, %zu tiles, H=%d K=V=%d\n", name, n, T, nt, H, K);
    size_t nqk = (size_t)T * H * K, nv = (size_t)T * H * V, nb = (size_t)T * H, ns = (size_t)H * K * V;
    size_t nsf = (size_t)n * ns, nst = nt * ns;
    double *q = tu_alloc(nqk), *k = tu_alloc(nqk), *v = tu_alloc(nv), *g = tu_alloc(nqk), *beta = tu_alloc(nb);
    vl_inputs_(nqk, nv, nb, K, q, k, v, g, beta);
    double *o = tu_alloc(nv), *Sf = tu_alloc(nsf), *St = tu_alloc(nst);
    mtrl_ref_kda_chunk_fwd_varlen(n, offs, H, K, V, q, k, v, g, beta, o, Sf, St);
    float *d_q = tu_dev_f32(q, nqk), *d_k = tu_dev_f32(k, nqk), *d_v = tu_dev_f32(v, nv), *d_g = tu_dev_f32(g, nqk),
          *d_b = tu_dev_f32(beta, nb);

    vl_out_ pp = vl_out_nan_(ctx, nv, nsf, nst), vl = vl_out_nan_(ctx, nv, nsf, nst);
    vl_per_piece_(ctx, n, offs, H, K, V, d_q, d_k, d_v, d_g, d_b, &pp);
    TEST_EQ_INT(mtrl_kda_chunk_fwd_varlen(ctx, n, offs, H, K, V, d_q, d_k, d_v, d_g, d_b, vl.o, vl.Sf, vl.St), 0);
    mtrl_cuda_sync(ctx);
    TU_SAME("o == per piece", vl.o, pp.o, nv);
    TU_SAME("S_final == per piece", vl.Sf, pp.Sf, nsf);
    TU_SAME("S_tiles == per piece", vl.St, pp.St, nst);
    size_t ngot = nst > nqk ? nst : nqk;
    double *got = tu_alloc(ngot > nsf ? ngot : nsf);
    vl_check_fp64_("", &vl, o, Sf, St, nv, nsf, nst, got);

    if (K == 128) {
        // the prefill form (o only) and the state-only form
        vl_out_ f = vl_out_nan_(ctx, nv, nsf, 1);
        TEST_EQ_INT(mtrl_kda_chunk_fwd_varlen(ctx, n, offs, H, K, V, d_q, d_k, d_v, d_g, d_b, f.o, NULL, NULL), 0);
        TEST_EQ_INT(mtrl_kda_chunk_fwd_varlen(ctx, n, offs, H, K, V, d_q, d_k, d_v, d_g, d_b, NULL, f.Sf, NULL), 0);
        mtrl_cuda_sync(ctx);
        TU_SAME("prefill form: o", f.o, vl.o, nv);
        TU_SAME("state-only form: S_final", f.Sf, vl.Sf, nsf);
        vl_out_free_(&f);
        // plain bf16 records: per piece and varlen still agree bit for bit
        mtrl_cuda_ctx_opts(ctx)->kda_plain_bf16 = 1;
        vl_out_ bp = vl_out_nan_(ctx, nv, nsf, nst), bv = vl_out_nan_(ctx, nv, nsf, nst);
        vl_per_piece_(ctx, n, offs, H, K, V, d_q, d_k, d_v, d_g, d_b, &bp);
        TEST_EQ_INT(mtrl_kda_chunk_fwd_varlen(ctx, n, offs, H, K, V, d_q, d_k, d_v, d_g, d_b, bv.o, bv.Sf, bv.St), 0);
        mtrl_cuda_sync(ctx);
        mtrl_cuda_ctx_opts(ctx)->kda_plain_bf16 = 0;
        TU_SAME("bf16 records: o == per piece", bv.o, bp.o, nv);
        TU_SAME("bf16 records: S_tiles == per piece", bv.St, bp.St, nst);
        vl_out_free_(&bp);
        vl_out_free_(&bv);
    }

    // the backward over the varlen forward's tile states
    double *dout = tu_alloc(nv);
    tu_fill_normal(dout, nv, 1.0);
    double *dq = tu_alloc(nqk), *dk = tu_alloc(nqk), *dv = tu_alloc(nv), *dg = tu_alloc(nqk), *db = tu_alloc(nb);
    mtrl_ref_kda_chunk_bwd_varlen(n, offs, H, K, V, q, k, v, g, beta, St, dout, dq, dk, dv, dg, db);
    float *d_dout = tu_dev_f32(dout, nv), *d_dq = tu_dev_nan(ctx, nqk), *d_dk = tu_dev_nan(ctx, nqk),
          *d_dv = tu_dev_nan(ctx, nv), *d_dg = tu_dev_nan(ctx, nqk), *d_db = tu_dev_nan(ctx, nb);
    TEST_EQ_INT(mtrl_kda_chunk_bwd_varlen(ctx, n, offs, H, K, V, d_q, d_k, d_v, d_g, d_b, vl.St, d_dout, d_dq, d_dk,
                                          d_dv, d_dg, d_db),
                0);
    mtrl_cuda_sync(ctx);
    const struct {
        const char *what;
        const float *d;
        const double *ref;
        size_t n;
    } grads[5] = {{"bwd dq", d_dq, dq, nqk}, {"bwd dk", d_dk, dk, nqk}, {"bwd dv", d_dv, dv, nv},
                  {"bwd dg", d_dg, dg, nqk}, {"bwd dbeta", d_db, db, nb}};
    // Pieces of one token from the zero state: S_1 = β k vᵀ does not depend on g, so dg is exactly 0
    // (the fp64 reference leaves ~1e-17 of rounding, the GPU ~1e-9; a relative error divides by it)
    int longest = 0;
    for (int i = 0; i < n; i++) longest = offs[i + 1] - offs[i] > longest ? offs[i + 1] - offs[i] : longest;
    for (int i = 0; i < 5; i++) {
        tu_get_f32(got, grads[i].d, grads[i].n);
        if (i == 3 && longest <= 1) {
            double mx = 0;
            for (size_t j = 0; j < grads[i].n; j++) mx = fmax(mx, fabs(got[j]));
            printf("  %-44s max |dg| %.3g (exactly 0: one-token pieces)\n", grads[i].what, mx);
            TEST_CHECKF(mx < 1e-6, "one-token pieces: dg %.3g, not 0", mx);
            continue;
        }
        TU_CHECK_REL(grads[i].what, got, grads[i].ref, grads[i].n, K == 128 ? 1e-3 : 1e-4);
    }

    // the varlen backward == mtrl_kda_chunk_bwd per piece, bit for bit: on the forward's tile
    // states, with the tile states recomputed (NULL), and (K = 128, the edge pack) with the SIMT
    // pass 3 and the 8-warp tensor-core pass 3 (the options kda_bwd_tile, kda_tile_threads)
    {
        vl_grad_ vg = {d_dq, d_dk, d_dv, d_dg, d_db};
        vl_grad_ pg = vl_grad_nan_(ctx, nqk, nv, nb), rv = vl_grad_nan_(ctx, nqk, nv, nb),
                 rp = vl_grad_nan_(ctx, nqk, nv, nb);
        vl_bwd_per_piece_(ctx, n, offs, H, K, V, d_q, d_k, d_v, d_g, d_b, pp.St, d_dout, &pg);
        TEST_EQ_INT(mtrl_kda_chunk_bwd_varlen(ctx, n, offs, H, K, V, d_q, d_k, d_v, d_g, d_b, NULL, d_dout, rv.dq,
                                              rv.dk, rv.dv, rv.dg, rv.db),
                    0);
        vl_bwd_per_piece_(ctx, n, offs, H, K, V, d_q, d_k, d_v, d_g, d_b, NULL, d_dout, &rp);
        mtrl_cuda_sync(ctx);
        vl_bwd_same_("tile states given", &vg, &pg, nqk, nv, nb);
        vl_bwd_same_("tile states recomputed", &rv, &rp, nqk, nv, nb);
        if (K == 128 && n == 6) {
            static const char *form[2] = {"SIMT pass 3", "8-warp pass 3"};
            for (int f = 0; f < 2; f++) {
                if (f == 0) mtrl_cuda_ctx_opts(ctx)->kda_bwd_tile = MTRL_KOPT_SIMT;
                else mtrl_cuda_ctx_opts(ctx)->kda_tile_threads = 256;
                vl_bwd_per_piece_(ctx, n, offs, H, K, V, d_q, d_k, d_v, d_g, d_b, pp.St, d_dout, &pg);
                TEST_EQ_INT(mtrl_kda_chunk_bwd_varlen(ctx, n, offs, H, K, V, d_q, d_k, d_v, d_g, d_b, vl.St, d_dout,
                                                      rv.dq, rv.dk, rv.dv, rv.dg, rv.db),
                            0);
                mtrl_cuda_sync(ctx);
                mtrl_cuda_ctx_opts(ctx)->kda_bwd_tile = 0;
                mtrl_cuda_ctx_opts(ctx)->kda_tile_threads = 0;
                vl_bwd_same_(form[f], &rv, &pg, nqk, nv, nb);
            }
        }
        vl_grad_free_(&pg);
        vl_grad_free_(&rv);
        vl_grad_free_(&rp);
    }

    float *dev[] = {d_q, d_k, d_v, d_g, d_b, d_dout, d_dq, d_dk, d_dv, d_dg, d_db};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) mtrl_cuda_free(dev[i]);
    vl_out_free_(&pp);
    vl_out_free_(&vl);
    double *host[] = {q, k, v, g, beta, o, Sf, St, got, dout, dq, dk, dv, dg, db};
    for (size_t i = 0; i < sizeof host / sizeof host[0]; i++) free(host[i]);
    free(offs);
}

// The short conv of the KDA layer over the pack (C = H K channels, the model's W = 4).
static void test_conv_varlen(mtrl_cuda_ctx *ctx, const char *name, int n, const int *len, int C) {
    const int W = 4;
    int *offs = (int *)malloc(sizeof(int) * ((size_t)n + 1));
    offs[0] = 0;
    for (int i = 0; i < n; i++) offs[i + 1] = offs[i] + len[i];
    size_t nx = (size_t)offs[n] * C;
    printf("conv varlen %s: %d pieces, T=%d, C=%d, W=%d\n", name, n, offs[n], C, W);
    double *x = tu_alloc(nx), *w = tu_alloc((size_t)C * W), *y = tu_alloc(nx), *got = tu_alloc(nx);
    tu_fill_normal(x, nx, 1.0);
    tu_fill_normal(w, (size_t)C * W, 0.5);
    mtrl_ref_shortconv_fwd_varlen(n, offs, C, W, x, w, y);
    float *d_x = tu_dev_f32(x, nx), *d_w = tu_dev_f32(w, (size_t)C * W), *d_pp = tu_dev_nan(ctx, nx),
          *d_vl = tu_dev_nan(ctx, nx);
    for (int i = 0; i < n; i++) {
        size_t o = (size_t)offs[i] * C;
        TEST_EQ_INT(mtrl_shortconv_fwd(ctx, len[i], C, W, d_x + o, d_w, NULL, d_pp + o, NULL), 0);
    }
    TEST_EQ_INT(mtrl_shortconv_fwd_varlen(ctx, n, offs, C, W, d_x, d_w, d_vl), 0);
    mtrl_cuda_sync(ctx);
    TU_SAME("conv y == per piece", d_vl, d_pp, nx);
    tu_get_f32(got, d_vl, nx);
    TU_CHECK_REL("conv y vs fp64", got, y, nx, 1e-5);
    // the backward: dx bit for bit the per-piece calls', dw (+= onto the same start) summed in
    // other blocks, so at fp32 rounding of theirs; both against the fp64 reference
    size_t nw = (size_t)C * W;
    double *dy = tu_alloc(nx), *dx = tu_alloc(nx), *dw = tu_alloc(nw), *gw = tu_alloc(nw);
    tu_fill_normal(dy, nx, 1.0);
    tu_fill_normal(dw, nw, 1.0);
    for (size_t i = 0; i < nw; i++) dw[i] = (double)(float)dw[i];  // the devices' start, exactly
    float *d_dy = tu_dev_f32(dy, nx), *d_dwp = tu_dev_f32(dw, nw), *d_dwv = tu_dev_f32(dw, nw);
    mtrl_ref_shortconv_bwd_varlen(n, offs, C, W, x, w, dy, dx, dw);
    for (int i = 0; i < n; i++) {
        size_t o = (size_t)offs[i] * C;
        TEST_EQ_INT(mtrl_shortconv_bwd(ctx, len[i], C, W, d_x + o, d_w, NULL, d_dy + o, d_pp + o, d_dwp, NULL), 0);
    }
    TEST_EQ_INT(mtrl_shortconv_bwd_varlen(ctx, n, offs, C, W, d_x, d_w, d_dy, d_vl, d_dwv), 0);
    mtrl_cuda_sync(ctx);
    TU_SAME("conv bwd dx == per piece", d_vl, d_pp, nx);
    tu_get_f32(got, d_vl, nx);
    TU_CHECK_REL("conv bwd dx vs fp64", got, dx, nx, 1e-5);
    tu_get_f32(got, d_dwv, nw);
    tu_get_f32(gw, d_dwp, nw);
    TU_CHECK_REL("conv bwd dw vs per piece", got, gw, nw, 1e-5);
    TU_CHECK_REL("conv bwd dw vs fp64", got, dw, nw, 1e-5);
    mtrl_cuda_free(d_x);
    mtrl_cuda_free(d_w);
    mtrl_cuda_free(d_pp);
    mtrl_cuda_free(d_vl);
    mtrl_cuda_free(d_dy);
    mtrl_cuda_free(d_dwp);
    mtrl_cuda_free(d_dwv);
    free(x); free(w); free(y); free(got); free(offs); free(dy); free(dx); free(dw); free(gw);
}

// ---- the piece_io forms (mtrl_kda_chunk_fwd_varlen_io, mtrl_shortconv_fwd_varlen_io): every piece
// continues its own state (the actor's packed prefill) ---------------------------------------------

// Piece i's state: random (fp32-exact), or none (NULL: the zero state) for every 5th piece from
// the 3rd. S0 [n][ns] holds them (zeros where none), *d_S0 its device copy, the table points in it.
static const float **vl_io_states_(int n, size_t ns, double *S0, float **d_S0) {
    tu_fill_normal(S0, (size_t)n * ns, 0.25);
    for (int i = 0; i < n; i++)
        for (size_t j = 0; j < ns; j++) S0[i * ns + j] = i % 5 == 2 ? 0.0 : (double)(float)S0[i * ns + j];
    *d_S0 = tu_dev_f32(S0, (size_t)n * ns);
    const float **tab = (const float **)malloc(sizeof(float *) * (size_t)(n ? n : 1));
    for (int i = 0; i < n; i++) tab[i] = i % 5 == 2 ? NULL : *d_S0 + i * ns;
    return tab;
}

// Per-piece mtrl_kda_chunk_fwd from S0 (tab) == the varlen_io form bit for bit (o, final states,
// tile states), into separate final states and in place (final states over the initial ones);
// the fp64 piece_io reference at 1e-4.
static void test_varlen_io(mtrl_cuda_ctx *ctx, const char *name, int n, const int *len, int H, int K) {
    size_t nt = 0;
    int *offs = vl_offs_(n, len, &nt), T = offs[n], V = K;
    printf("varlen_io %s: %d pieces from their own states, T=%d, %zu tiles, H=%d K=V=%d\n", name, n, T, nt, H, K);
    size_t nqk = (size_t)T * H * K, nv = (size_t)T * H * V, nb = (size_t)T * H, ns = (size_t)H * K * V;
    size_t nsf = (size_t)n * ns, nst = nt * ns;
    double *q = tu_alloc(nqk), *k = tu_alloc(nqk), *v = tu_alloc(nv), *g = tu_alloc(nqk), *beta = tu_alloc(nb);
    vl_inputs_(nqk, nv, nb, K, q, k, v, g, beta);
    double *S0 = tu_alloc(nsf);
    float *d_S0;
    const float **tab = vl_io_states_(n, ns, S0, &d_S0);
    // the fp64 reference from the same states
    const double **rtab = (const double **)malloc(sizeof(double *) * (size_t)n);
    double **rsf = (double **)malloc(sizeof(double *) * (size_t)n);
    double *o = tu_alloc(nv), *Sf = tu_alloc(nsf), *St = tu_alloc(nst);
    for (int i = 0; i < n; i++) {
        rtab[i] = tab[i] ? S0 + i * ns : NULL;
        rsf[i] = Sf + i * ns;
    }
    mtrl_ref_kda_chunk_fwd_varlen_io(n, offs, H, K, V, q, k, v, g, beta, rtab, o, rsf, St);
    float *d_q = tu_dev_f32(q, nqk), *d_k = tu_dev_f32(k, nqk), *d_v = tu_dev_f32(v, nv), *d_g = tu_dev_f32(g, nqk),
          *d_b = tu_dev_f32(beta, nb);

    vl_out_ pp = vl_out_nan_(ctx, nv, nsf, nst), vl = vl_out_nan_(ctx, nv, nsf, nst);
    size_t tile = 0;
    for (int i = 0; i < n; i++) {  // per piece, as the model ran the actor's prefill before
        size_t x = (size_t)offs[i];
        TEST_EQ_INT(mtrl_kda_chunk_fwd(ctx, len[i], H, K, V, d_q + x * H * K, d_k + x * H * K, d_v + x * H * V,
                                       d_g + x * H * K, d_b + x * H, tab[i], pp.o + x * H * V, pp.Sf + i * ns,
                                       pp.St + tile * ns),
                    0);
        tile += (size_t)mtrl_ref_kda_tile_count(len[i]);
    }
    float **sft = (float **)malloc(sizeof(float *) * (size_t)n), **inp = (float **)malloc(sizeof(float *) * (size_t)n);
    float *d_in = tu_dev_f32(S0, nsf);  // the initial states again (zeros for none), for in place
    for (int i = 0; i < n; i++) {
        sft[i] = vl.Sf + i * ns;
        inp[i] = d_in + i * ns;
    }
    TEST_EQ_INT(mtrl_kda_chunk_fwd_varlen_io(ctx, n, offs, H, K, V, d_q, d_k, d_v, d_g, d_b, tab, vl.o, sft, vl.St),
                0);
    mtrl_cuda_sync(ctx);
    TU_SAME("io: o == per piece", vl.o, pp.o, nv);
    TU_SAME("io: S_final == per piece", vl.Sf, pp.Sf, nsf);
    TU_SAME("io: S_tiles == per piece", vl.St, pp.St, nst);
    // in place: the initial states (zeros for the NULL ones) overwritten by the final ones
    vl_out_ ip = vl_out_nan_(ctx, nv, 1, 1);
    TEST_EQ_INT(mtrl_kda_chunk_fwd_varlen_io(ctx, n, offs, H, K, V, d_q, d_k, d_v, d_g, d_b,
                                             (const float *const *)inp, ip.o, inp, NULL),
                0);
    mtrl_cuda_sync(ctx);
    TU_SAME("io in place: o == per piece", ip.o, pp.o, nv);
    TU_SAME("io in place: states == per piece S_final", d_in, pp.Sf, nsf);
    double *got = tu_alloc(nst > nv ? (nst > nsf ? nst : nsf) : (nv > nsf ? nv : nsf));
    vl_check_fp64_("io: ", &vl, o, Sf, St, nv, nsf, nst, got);

    float *dev[] = {d_q, d_k, d_v, d_g, d_b, d_S0, d_in};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) mtrl_cuda_free(dev[i]);
    vl_out_free_(&pp);
    vl_out_free_(&vl);
    vl_out_free_(&ip);
    double *host[] = {q, k, v, g, beta, S0, o, Sf, St, got};
    for (size_t i = 0; i < sizeof host / sizeof host[0]; i++) free(host[i]);
    free(tab); free(rtab); free(rsf); free(sft); free(inp); free(offs);
}

// The short conv's piece_io form: per-piece mtrl_shortconv_fwd from each piece's window (NULL for
// every 5th from the 3rd) writing its new window == the varlen_io form bit for bit (y, windows),
// into separate windows and in place; the fp64 reference at 1e-5.
static void test_conv_varlen_io(mtrl_cuda_ctx *ctx, const char *name, int n, const int *len, int C) {
    const int W = 4;
    int *offs = (int *)malloc(sizeof(int) * ((size_t)n + 1));
    offs[0] = 0;
    for (int i = 0; i < n; i++) offs[i + 1] = offs[i] + len[i];
    size_t nx = (size_t)offs[n] * C, ns = (size_t)(W - 1) * C, nw = (size_t)n * ns;
    printf("conv varlen_io %s: %d pieces from their own windows, T=%d, C=%d, W=%d\n", name, n, offs[n], C, W);
    double *x = tu_alloc(nx), *w = tu_alloc((size_t)C * W), *y = tu_alloc(nx), *win = tu_alloc(nw),
           *wo = tu_alloc(nw), *got = tu_alloc(nx > nw ? nx : nw);
    tu_fill_normal(x, nx, 1.0);
    tu_fill_normal(w, (size_t)C * W, 0.5);
    float *d_win;
    const float **tab = vl_io_states_(n, ns, win, &d_win);
    float *d_x = tu_dev_f32(x, nx), *d_w = tu_dev_f32(w, (size_t)C * W), *d_pp = tu_dev_nan(ctx, nx),
          *d_vl = tu_dev_nan(ctx, nx), *d_ip = tu_dev_nan(ctx, nx), *d_wpp = tu_dev_nan(ctx, nw),
          *d_wvl = tu_dev_nan(ctx, nw), *d_wip = tu_dev_f32(win, nw);
    const double **rin = (const double **)malloc(sizeof(double *) * (size_t)n);
    double **rout = (double **)malloc(sizeof(double *) * (size_t)n);
    float **out = (float **)malloc(sizeof(float *) * (size_t)n), **inp = (float **)malloc(sizeof(float *) * (size_t)n);
    for (int i = 0; i < n; i++) {
        rin[i] = tab[i] ? win + i * ns : NULL;
        rout[i] = wo + i * ns;
        out[i] = d_wvl + i * ns;
        inp[i] = d_wip + i * ns;
        size_t o = (size_t)offs[i] * C;
        TEST_EQ_INT(mtrl_shortconv_fwd(ctx, len[i], C, W, d_x + o, d_w, tab[i], d_pp + o, d_wpp + i * ns), 0);
    }
    mtrl_ref_shortconv_fwd_varlen_io(n, offs, C, W, x, w, rin, rout, y);
    TEST_EQ_INT(mtrl_shortconv_fwd_varlen_io(ctx, n, offs, C, W, d_x, d_w, tab, out, d_vl), 0);
    TEST_EQ_INT(mtrl_shortconv_fwd_varlen_io(ctx, n, offs, C, W, d_x, d_w, (const float *const *)inp, inp, d_ip), 0);
    mtrl_cuda_sync(ctx);
    TU_SAME("conv io: y == per piece", d_vl, d_pp, nx);
    TU_SAME("conv io: windows == per piece", d_wvl, d_wpp, nw);
    TU_SAME("conv io in place: y == per piece", d_ip, d_pp, nx);
    TU_SAME("conv io in place: windows == per piece", d_wip, d_wpp, nw);
    tu_get_f32(got, d_vl, nx);
    TU_CHECK_REL("conv io: y vs fp64", got, y, nx, 1e-5);
    tu_get_f32(got, d_wvl, nw);
    TU_CHECK_REL("conv io: windows vs fp64", got, wo, nw, 1e-6);
    float *dev[] = {d_win, d_x, d_w, d_pp, d_vl, d_ip, d_wpp, d_wvl, d_wip};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) mtrl_cuda_free(dev[i]);
    free(x); free(w); free(y); free(win); free(wo); free(got);
    free(tab); free(rin); free(rout); free(out); free(inp); free(offs);
}

int main(void) {
    if (mtrl_cuda_device_count() <= 0) test_skip("no CUDA device");
    mtrl_cuda_ctx *ctx = mtrl_cuda_ctx_create(0, NULL);
    tu_seed(21);
    static const int edge[6] = {1, 15, 16, 17, 64, 333}, one[1] = {1}, long1[1] = {333};
    int mix[100];
    for (int hi = 0; hi < 2; hi++) {
        int H = hi ? 16 : 2;
        test_varlen(ctx, "1 15 16 17 64 333", 6, edge, H, 128);
        test_varlen(ctx, "one piece of 1", 1, one, H, 128);
        test_varlen(ctx, "one piece of 333", 1, long1, H, 128);
        tu_vl_mix(100, H == 2 ? 200 : 48, mix);
        test_varlen(ctx, "mix of 100", 100, mix, H, 128);
        test_conv_varlen(ctx, "mix of 100", 100, mix, H * 128);
        test_conv_varlen(ctx, "1 15 16 17 64 333", 6, edge, H * 128);
        // the piece_io forms over the same packs
        test_varlen_io(ctx, "1 15 16 17 64 333", 6, edge, H, 128);
        test_varlen_io(ctx, "one piece of 333", 1, long1, H, 128);
        test_varlen_io(ctx, "mix of 100", 100, mix, H, 128);
        test_conv_varlen_io(ctx, "mix of 100", 100, mix, H * 128);
        test_conv_varlen_io(ctx, "1 15 16 17 64 333", 6, edge, H * 128);
    }
    test_varlen(ctx, "1 15 16 17 64 333 (K = 32: per piece)", 6, edge, 2, 32);
    test_varlen_io(ctx, "1 15 16 17 64 333 (K = 32: per piece)", 6, edge, 2, 32);
    static const int empty2[2] = {0, 0};  // no tiles at all: the states pass through (or stay in place)
    test_varlen_io(ctx, "two empty pieces", 2, empty2, 2, 128);
    // arguments the op refuses
    int bad[3] = {0, 20, 10};
    float *d = tu_dev_nan(ctx, 20 * 2 * 128);
    printf("refused: offsets going backwards\n");
    TEST_EQ_INT(mtrl_kda_chunk_fwd_varlen(ctx, 2, bad, 2, 128, 128, d, d, d, d, d, d, NULL, NULL), -1);
    TEST_EQ_INT(mtrl_kda_chunk_fwd_varlen(ctx, 2, NULL, 2, 128, 128, d, d, d, d, d, d, NULL, NULL), -1);
    TEST_EQ_INT(mtrl_shortconv_fwd_varlen(ctx, 2, bad, 256, 4, d, d, d), -1);
    TEST_EQ_INT(mtrl_shortconv_bwd_varlen(ctx, 2, bad, 256, 4, d, d, d, d, d), -1);
    TEST_EQ_INT(mtrl_kda_chunk_bwd_varlen(ctx, 2, bad, 2, 128, 128, d, d, d, d, d, NULL, d, d, d, d, d, d), -1);
    mtrl_cuda_free(d);
    mtrl_cuda_ctx_destroy(ctx);
    return test_report();
}
