// mtrl-test: gpu f64 timeout=600
// test_cuda_mla.cu: the CUDA attention kernels against the fp64 CPU reference (mla_ref.h):
// causal flash forward (o, lse) and backward (dq overwritten; dk, dv accumulated onto nonzero
// buffers) for the absorbed MLA form (Hk = 1, values aliasing the first dc latent columns, the
// model's shapes: Dk = dc + dr = 576, Dv = 512, and the tiny preset's Dk = 40 that needs zero
// padding to 48), a segment attending to a longer prefix (Tq < Tk), and the general form (Hk = 2,
// separate values); MHA Dk = 192, Dv = 128 (the naive MLA form: must run v2 or v3, v1 checked
// against it too; v3, the wgmma kernels, is the default on an H100 / H200, and attn = mma
// cases run v2 there); and the absorbed decode over a batch of sequences of different lengths
// (fp32 and bf16 latent caches; each case through both kernels: v2 where the arguments allow it,
// then v1 forced through decode = simt).
// Tolerances: attention takes bf16 operands: ‖out − ref‖/‖ref‖ ≤ 1e-2 against the reference on
// the unrounded inputs. Attention runs the v2 kernels where the shape allows them (twice:
// bit-identical), then v1 forced through attn = simt. Decode: fp32 cache ≤ 1e-4; bf16 cache ≤ 1e-2.
#include "tests/testhelp.h"
#include "kernels/lab/cuda_testutil.h"
#include "kernels/ref/mla_ref.h"

// The attention option the cases below run with besides v1 (auto, or mma where a caller keeps
// v3 off).
static int attn_base_ = MTRL_KOPT_AUTO;
static int attn_f32_only_;  // `test_cuda_mla f32`: only the fp32-operand cases
// Sets the option attn for the attention launchers (read at each call): version 1 forces the v1
// kernels (simt), version 2 leaves attn_base_ (v2 or v3 where the shape allows it).
static void set_attn_version(mtrl_cuda_ctx *ctx, int version) {
    mtrl_cuda_ctx_opts(ctx)->attn = version == 1 ? MTRL_KOPT_SIMT : attn_base_;
}

// Forward and backward through both kernel sets (v2 where the shape allows it, then v1 forced)
// on the same inputs, each against the fp64 reference; v2 twice, the two runs bit-identical.
// expect_v2: the shape must run v2 or v3 (mtrl_attn_causal_version reports 2 or 3 for forward
// and backward), and v1's o, lse, dq and dk / dv increments must agree with it within 1e-2
// (the lines "v1 vs v2" compare against whichever of the two ran).
static void test_attn_x(mtrl_cuda_ctx *ctx, int Tq, int Tk, int H, int Hk, int Dk, int Dv,
                        int alias, int expect_v2) {
    double scale = 1.0 / sqrt((double)(alias ? 192 : Dk));
    int ldk = alias ? Dk : Hk * Dk, ldv = alias ? Dk : Hk * Dv;
    size_t nq = (size_t)Tq * H * Dk, nk = (size_t)Tk * ldk, nv = alias ? 0 : (size_t)Tk * ldv,
           no = (size_t)Tq * H * Dv, nl = (size_t)Tq * H;
    double *q = tu_alloc(nq), *k = tu_alloc(nk), *v = tu_alloc(nv ? nv : 1), *dout = tu_alloc(no);
    tu_fill_normal(q, nq, 1.0);
    tu_fill_normal(k, nk, 1.0);
    if (!alias) tu_fill_normal(v, nv, 1.0);
    tu_fill_normal(dout, no, 1.0);
    const double *vv = alias ? k : v;
    double *o = tu_alloc(no), *lse = tu_alloc(nl);
    mtrl_ref_attn_causal_fwd(Tq, Tk, H, Hk, Dk, Dv, scale, q, k, ldk, vv, ldv, o, lse);
    double *dq = tu_alloc(nq), *dk = tu_alloc(nk), *dv = alias ? dk : tu_alloc(nv);
    tu_fill_normal(dk, nk, 1.0);  // accumulated onto
    if (!alias) tu_fill_normal(dv, nv, 1.0);
    double *dk0 = tu_alloc(nk), *dv0 = tu_alloc(nv ? nv : 1);
    memcpy(dk0, dk, sizeof(double) * nk);
    if (!alias) memcpy(dv0, dv, sizeof(double) * nv);
    mtrl_ref_attn_causal_bwd(Tq, Tk, H, Hk, Dk, Dv, scale, q, k, ldk, vv, ldv, o, lse, dout, dq, dk, dv);
    // One key (Tq = Tk = 1): the softmax over it is the constant 1, so dq and the dk increment
    // are exactly zero; the fp64 reference leaves ~1e-17 of rounding there, which a relative
    // error would divide by. Set them to their exact value: the checks become absolute.
    const int one_key = Tk == 1;
    if (one_key) {
        memset(dq, 0, sizeof(double) * nq);
        if (!alias) memcpy(dk, dk0, sizeof(double) * nk);
    }

    mtrl_bf16 *d_q = tu_dev_bf16(q, nq), *d_k = tu_dev_bf16(k, nk),
              *d_v = alias ? d_k : tu_dev_bf16(v, nv), *d_do = tu_dev_bf16(dout, no);
    size_t big = nq > nk ? nq : nk;
    if (nv > big) big = nv;
    if (no > big) big = no;
    double *got = tu_alloc(big), *inc = tu_alloc(big), *ref_inc = tu_alloc(big);
    // the first v2 run's results (float bits), compared with the second
    size_t nall = no + nl + nq + nk + nv;
    float *first = (float *)malloc(sizeof(float) * nall), *again = (float *)malloc(sizeof(float) * nall);
    for (int version = 2; version >= 1; version--) {
        set_attn_version(ctx, version);
        int vf = mtrl_attn_causal_version(ctx, H, Hk, Dk, Dv, alias, 0);
        int vb = mtrl_attn_causal_version(ctx, H, Hk, Dk, Dv, alias, 1);
        printf("attention Tq=%d Tk=%d H=%d Hk=%d Dk=%d Dv=%d%s: fwd v%d, bwd v%d\n", Tq, Tk, H, Hk,
               Dk, Dv, alias ? " (values alias the keys)" : "", vf, vb);
        if (version == 2 && expect_v2) {  // v2 or v3 (attn: v3 on an H100 / H200)
            TEST_CHECK(vf >= 2);
            TEST_CHECK(vb >= 2);
        }
        if (version == 2 && vf == 1 && vb == 1) continue;  // the v1 pass covers it
        if (version == 1) {
            TEST_EQ_INT(vf, 1);
            TEST_EQ_INT(vb, 1);
        }
        for (int run = 0; run < (version == 2 ? 2 : 1); run++) {
            float *d_o = tu_dev_nan(ctx, no), *d_lse = tu_dev_nan(ctx, nl), *e_dq = tu_dev_nan(ctx, nq);
            float *e_dk = tu_dev_f32(dk0, nk), *e_dv = alias ? e_dk : tu_dev_f32(dv0, nv);
            TEST_EQ_INT(mtrl_attn_causal_fwd(ctx, Tq, Tk, H, Hk, Dk, Dv, (float)scale, d_q, d_k, ldk,
                                             d_v, ldv, d_o, d_lse), 0);
            TEST_EQ_INT(mtrl_attn_causal_bwd(ctx, Tq, Tk, H, Hk, Dk, Dv, (float)scale, d_q, d_k, ldk,
                                             d_v, ldv, d_o, d_lse, d_do, e_dq, e_dk, e_dv), 0);
            mtrl_cuda_sync(ctx);
            // v2's first run in `first`; v2's second run and v1's run in `again`
            float *bits = version == 2 && run == 0 ? first : again;
            mtrl_cuda_download(bits, d_o, sizeof(float) * no);
            mtrl_cuda_download(bits + no, d_lse, sizeof(float) * nl);
            mtrl_cuda_download(bits + no + nl, e_dq, sizeof(float) * nq);
            mtrl_cuda_download(bits + no + nl + nq, e_dk, sizeof(float) * nk);
            if (!alias) mtrl_cuda_download(bits + no + nl + nq + nk, e_dv, sizeof(float) * nv);
            if (run == 0) {
                char what[64];
#define ATT_NAME(s) (snprintf(what, sizeof what, "%s (fwd v%d, bwd v%d)", s, vf, vb), what)
                tu_get_f32(got, d_o, no);
                TU_CHECK_REL(ATT_NAME("fwd o"), got, o, no, 1e-2);
                tu_get_f32(got, d_lse, nl);
                TU_CHECK_REL(ATT_NAME("fwd lse"), got, lse, nl, 1e-2);
                tu_get_f32(got, e_dq, nq);
                TU_CHECK_REL(ATT_NAME("bwd dq"), got, dq, nq, 1e-2);
                // dk/dv: compare the increments (accumulated buffer minus its start) so the
                // start values do not dilute the error.
                tu_get_f32(got, e_dk, nk);
                for (size_t i = 0; i < nk; i++) {
                    inc[i] = got[i] - dk0[i];
                    ref_inc[i] = dk[i] - dk0[i];
                }
                TU_CHECK_REL(ATT_NAME(alias ? "bwd dk (+=, dk and dv aliased)" : "bwd dk (+=)"), inc,
                             ref_inc, nk, 1e-2);
                if (!alias) {
                    tu_get_f32(got, e_dv, nv);
                    for (size_t i = 0; i < nv; i++) {
                        inc[i] = got[i] - dv0[i];
                        ref_inc[i] = dv[i] - dv0[i];
                    }
                    TU_CHECK_REL(ATT_NAME("bwd dv (+=)"), inc, ref_inc, nv, 1e-2);
                }
#undef ATT_NAME
                if (version == 1 && expect_v2) {  // v1 against v2 (v2's bits from its first run)
                    // offsets of o, lse, dq, dk, dv in the bit buffers; dk, dv as increments
                    const size_t off[5] = {0, no, no + nl, no + nl + nq, no + nl + nq + nk};
                    const size_t len[5] = {no, nl, nq, nk, nv};
                    const double *start[5] = {NULL, NULL, NULL, dk0, dv0};
                    const char *nm[5] = {"v1 vs v2: fwd o", "v1 vs v2: fwd lse", "v1 vs v2: bwd dq",
                                         "v1 vs v2: bwd dk (increments)",
                                         "v1 vs v2: bwd dv (increments)"};
                    for (int b = 0; b < (alias ? 4 : 5); b++) {
                        if (one_key && (b == 2 || (b == 3 && !alias))) continue;  // noise on an exact 0
                        for (size_t i = 0; i < len[b]; i++) {
                            double s0 = start[b] ? start[b][i] : 0.0;
                            inc[i] = (double)again[off[b] + i] - s0;
                            ref_inc[i] = (double)first[off[b] + i] - s0;
                        }
                        TU_CHECK_REL(nm[b], inc, ref_inc, len[b], 1e-2);
                    }
                }
            } else {
                int same = memcmp(first, again, sizeof(float) * nall) == 0;
                printf("  two v2 runs bit-identical (o, lse, dq, dk, dv): %s\n", same ? "yes" : "NO");
                TEST_CHECK(same);
            }
            mtrl_cuda_free(d_o); mtrl_cuda_free(d_lse); mtrl_cuda_free(e_dq); mtrl_cuda_free(e_dk);
            if (!alias) mtrl_cuda_free(e_dv);
        }
    }
    set_attn_version(ctx, 2);
    free(first); free(again);
    free(inc);
    free(ref_inc);
    free(dk0);
    free(dv0);
    mtrl_cuda_free(d_q); mtrl_cuda_free(d_k); if (!alias) mtrl_cuda_free(d_v); mtrl_cuda_free(d_do);
    free(q); free(k); free(v); free(dout); free(o); free(lse); free(dq); free(dk);
    if (!alias) free(dv);
    free(got);
}

static void test_attn(mtrl_cuda_ctx *ctx, int Tq, int Tk, int H, int Hk, int Dk, int Dv, int alias) {
    test_attn_x(ctx, Tq, Tk, H, Hk, Dk, Dv, alias, 0);
}

// The fp32 check kernels (mtrl_attn_causal_fwd_f32 / _bwd_f32) against the fp64 reference on
// fp32-rounded inputs: fp32 arithmetic (dot products in fp64), so 1e-5 relative (dk, dv as
// increments onto nonzero buffers; their atomics add in any order, which stays at fp32's rounding).
static void test_attn_f32(mtrl_cuda_ctx *ctx, int Tq, int Tk, int H, int Hk, int Dk, int Dv, int alias) {
    double scale = 1.0 / sqrt((double)Dk);
    int ldk = alias ? Dk : Hk * Dk, ldv = alias ? Dk : Hk * Dv;
    size_t nq = (size_t)Tq * H * Dk, nk = (size_t)Tk * ldk, nv = alias ? 0 : (size_t)Tk * ldv,
           no = (size_t)Tq * H * Dv, nl = (size_t)Tq * H;
    double *q = tu_alloc(nq), *k = tu_alloc(nk), *v = tu_alloc(nv ? nv : 1), *dout = tu_alloc(no);
    tu_fill_normal(q, nq, 1.0);
    tu_fill_normal(k, nk, 1.0);
    if (!alias) tu_fill_normal(v, nv, 1.0);
    tu_fill_normal(dout, no, 1.0);
    double *all[4] = {q, k, v, dout};
    size_t len[4] = {nq, nk, nv, no};
    for (int b = 0; b < 4; b++)
        for (size_t i = 0; i < len[b]; i++) all[b][i] = (double)(float)all[b][i];
    const double *vv = alias ? k : v;
    double *o = tu_alloc(no), *lse = tu_alloc(nl), *dq = tu_alloc(nq), *dk = tu_alloc(nk), *dv = alias ? dk : tu_alloc(nv);
    mtrl_ref_attn_causal_fwd(Tq, Tk, H, Hk, Dk, Dv, scale, q, k, ldk, vv, ldv, o, lse);
    mtrl_ref_attn_causal_bwd(Tq, Tk, H, Hk, Dk, Dv, scale, q, k, ldk, vv, ldv, o, lse, dout, dq, dk, dv);
    float *d_q = tu_dev_f32(q, nq), *d_k = tu_dev_f32(k, nk), *d_v = alias ? d_k : tu_dev_f32(v, nv),
          *d_do = tu_dev_f32(dout, no), *d_o = tu_dev_nan(ctx, no), *d_lse = tu_dev_nan(ctx, nl),
          *e_dq = tu_dev_nan(ctx, nq);
    double *dk0 = tu_alloc(nk), *dv0 = tu_alloc(nv ? nv : 1);
    tu_fill_normal(dk0, nk, 1.0);
    if (!alias) tu_fill_normal(dv0, nv, 1.0);
    for (size_t i = 0; i < nk; i++) dk0[i] = (double)(float)dk0[i];
    for (size_t i = 0; i < nv; i++) dv0[i] = (double)(float)dv0[i];
    float *e_dk = tu_dev_f32(dk0, nk), *e_dv = alias ? e_dk : tu_dev_f32(dv0, nv);
    printf("attention fp32 operands Tq=%d Tk=%d H=%d Hk=%d Dk=%d Dv=%d%s\n", Tq, Tk, H, Hk, Dk, Dv,
           alias ? " (values alias the keys)" : "");
    TEST_EQ_INT(mtrl_attn_causal_fwd_f32(ctx, Tq, Tk, H, Hk, Dk, Dv, (float)scale, d_q, d_k, ldk, d_v, ldv, d_o, d_lse), 0);
    TEST_EQ_INT(mtrl_attn_causal_bwd_f32(ctx, Tq, Tk, H, Hk, Dk, Dv, (float)scale, d_q, d_k, ldk, d_v, ldv, d_o, d_lse,
                                         d_do, e_dq, e_dk, e_dv), 0);
    mtrl_cuda_sync(ctx);
    size_t big = nq > nk ? nq : nk;
    if (nv > big) big = nv;
    if (no > big) big = no;
    double *got = tu_alloc(big), *ref = tu_alloc(big);
    tu_get_f32(got, d_o, no);
    TU_CHECK_REL("fp32 fwd o", got, o, no, 1e-5);
    tu_get_f32(got, d_lse, nl);
    TU_CHECK_REL("fp32 fwd lse", got, lse, nl, 1e-5);
    if (Tk > 1) { // one key: dq is exactly 0 (the reference leaves rounding noise)
        tu_get_f32(got, e_dq, nq);
        TU_CHECK_REL("fp32 bwd dq", got, dq, nq, 1e-5);
    }
    tu_get_f32(got, e_dk, nk);
    for (size_t i = 0; i < nk; i++) {
        got[i] -= dk0[i];
        ref[i] = dk[i];
    }
    // one key without aliased values: the dk increment is exactly 0 as dq is (noise on both sides)
    if (Tk > 1 || alias)
        TU_CHECK_REL(alias ? "fp32 bwd dk (+=, dk and dv aliased)" : "fp32 bwd dk (+=)", got, ref, nk, 1e-5);
    if (!alias) {
        tu_get_f32(got, e_dv, nv);
        for (size_t i = 0; i < nv; i++) {
            got[i] -= dv0[i];
            ref[i] = dv[i];
        }
        TU_CHECK_REL("fp32 bwd dv (+=)", got, ref, nv, 1e-5);
    }
    mtrl_cuda_free(d_q); mtrl_cuda_free(d_k); if (!alias) mtrl_cuda_free(d_v); mtrl_cuda_free(d_do);
    mtrl_cuda_free(d_o); mtrl_cuda_free(d_lse); mtrl_cuda_free(e_dq); mtrl_cuda_free(e_dk);
    if (!alias) mtrl_cuda_free(e_dv);
    free(q); free(k); free(v); free(dout); free(o); free(lse); free(dq); free(dk);
    if (!alias) free(dv);
    free(dk0); free(dv0); free(got); free(ref);
}

// Both of v3's shapes (Dk = 192 or 128, Dv = 128) on tails of its tiles, Tq < Tk, GQA (which
// the v3 ping-pong dK / dV declines), one token: run under the alternative kernel settings.
static void test_v3_shapes(mtrl_cuda_ctx *ctx) {
    test_attn_x(ctx, 1, 1, 2, 2, 192, 128, 0, 1);
    test_attn_x(ctx, 200, 200, 2, 2, 192, 128, 0, 1);
    test_attn_x(ctx, 1000, 1000, 8, 8, 192, 128, 0, 1);
    test_attn_x(ctx, 77, 333, 2, 2, 192, 128, 0, 1);
    test_attn_x(ctx, 150, 190, 4, 2, 192, 128, 0, 1);
    test_attn_x(ctx, 129, 129, 2, 2, 192, 128, 0, 1);
    test_attn_x(ctx, 200, 200, 4, 4, 128, 128, 0, 1);
    test_attn_x(ctx, 150, 190, 4, 2, 128, 128, 0, 1);
    test_attn_x(ctx, 1, 65, 2, 2, 128, 128, 0, 1);
}

// Sets the option decode for the launchers (read at each call): version 1 forces the first
// kernel, version 2 leaves the launcher's default (v2 where the shape allows it).
static void set_decode_version(mtrl_cuda_ctx *ctx, int version) {
    mtrl_cuda_ctx_opts(ctx)->decode = version == 1 ? MTRL_KOPT_SIMT : MTRL_KOPT_AUTO;
}

// B sequences of lengths lens[] in one pool (a gap of 3 rows before each, row stride dc+dr+8),
// one query token each. Both kernels (v2 where the arguments allow it, then v1 forced) on the
// same inputs, each against the fp64 reference (which sees the unrounded cache and query).
static void test_decode(mtrl_cuda_ctx *ctx, int B, const int *lens, int H, int dn, int dr, int dv,
                        int dc, int lat_type) {
    int ld = dc + dr + 8, max_len = 0;
    long long *start = (long long *)malloc(sizeof(long long) * B);
    long long rows = 0;
    for (int b = 0; b < B; b++) {
        rows += 3;  // a gap before each sequence
        start[b] = rows;
        rows += lens[b];
        if (lens[b] > max_len) max_len = lens[b];
    }
    size_t npool = (size_t)rows * ld, nq = (size_t)B * H * (dn + dr), nw = (size_t)H * (dn + dv) * dc;
    double *pool = tu_alloc(npool), *q = tu_alloc(nq), *W = tu_alloc(nw), *a = tu_alloc((size_t)B * H * dv);
    tu_fill_normal(pool, npool, 1.0);
    tu_fill_normal(q, nq, 1.0);
    tu_fill_normal(W, nw, 1.0 / sqrt((double)dc));
    double scale = 1.0 / sqrt((double)(dn + dr));
    for (int b = 0; b < B; b++)
        mtrl_ref_mla_decode_absorbed_ld(H, dn, dr, dv, dc, scale, q + (size_t)b * H * (dn + dr), W,
                               pool + (size_t)start[b] * ld, ld, pool + (size_t)start[b] * ld + dc, ld,
                               lens[b], a + (size_t)b * H * dv);
    void *d_pool = lat_type == MTRL_BF16 ? (void *)tu_dev_bf16(pool, npool) : (void *)tu_dev_f32(pool, npool);
    float *d_q = tu_dev_f32(q, nq), *d_W = tu_dev_f32(W, nw);
    long long *d_start = (long long *)mtrl_cuda_malloc(sizeof(long long) * B);
    mtrl_cuda_upload(d_start, start, sizeof(long long) * B);
    int *d_len = tu_dev_i32(lens, B);
    double *got = tu_alloc((size_t)B * H * dv);
    for (int version = 2; version >= 1; version--) {
        set_decode_version(ctx, version);
        int runs = mtrl_mla_decode_version(ctx, H, dr, dc, lat_type, ld);
        printf("decode B=%d H=%d dn=%d dr=%d dv=%d dc=%d max_len=%d %s cache: kernel v%d%s\n", B, H,
               dn, dr, dv, dc, max_len, lat_type == MTRL_BF16 ? "bf16" : "fp32", runs,
               version == 2 && runs == 1 ? " (arguments not supported by v2)" : "");
        if (version == 2 && runs == 1) continue;  // the v1 pass below covers it
        TEST_EQ_INT(runs, version);
        float *d_a = tu_dev_nan(ctx, (size_t)B * H * dv);
        TEST_EQ_INT(mtrl_mla_decode_absorbed(ctx, B, H, dn, dr, dv, dc, (float)scale, d_q, d_W, d_pool,
                                             lat_type, ld, d_start, d_len, max_len, d_a), 0);
        mtrl_cuda_sync(ctx);
        tu_get_f32(got, d_a, (size_t)B * H * dv);
        TU_CHECK_REL(version == 2 ? "decode a (v2)" : "decode a (v1)", got, a, (size_t)B * H * dv,
                     lat_type == MTRL_BF16 ? 1e-2 : 1e-4);
        // a second call gives the same bits (every sum in the merge runs in a fixed order)
        float *a1 = (float *)malloc(sizeof(float) * B * H * dv), *a2 = (float *)malloc(sizeof(float) * B * H * dv);
        mtrl_cuda_download(a1, d_a, sizeof(float) * B * H * dv);
        TEST_EQ_INT(mtrl_mla_decode_absorbed(ctx, B, H, dn, dr, dv, dc, (float)scale, d_q, d_W, d_pool,
                                             lat_type, ld, d_start, d_len, max_len, d_a), 0);
        mtrl_cuda_sync(ctx);
        mtrl_cuda_download(a2, d_a, sizeof(float) * B * H * dv);
        TEST_CHECKF(memcmp(a1, a2, sizeof(float) * B * H * dv) == 0, "decode v%d: a second call, other bits", version);
        free(a1);
        free(a2);
        mtrl_cuda_free(d_a);
    }
    set_decode_version(ctx, 2);
    mtrl_cuda_free(d_pool); mtrl_cuda_free(d_q); mtrl_cuda_free(d_W);
    mtrl_cuda_free(d_start); mtrl_cuda_free(d_len);
    free(start); free(pool); free(q); free(W); free(a); free(got);
}

// `test_cuda_mla attn` runs the attention cases alone (the decode cases take most of the time).
int main(int argc, char **argv) {
    if (mtrl_cuda_device_count() <= 0) test_skip("no CUDA device");
    const int attn_only = argc > 1 && !strcmp(argv[1], "attn");
    mtrl_cuda_ctx *ctx = mtrl_cuda_ctx_create(0, NULL);
    tu_seed(3);
    if (argc > 1 && !strcmp(argv[1], "f32")) attn_f32_only_ = 1;
    // fp32 operands ([kernels] attn_operands = fp32): the Kimi fixture's naive shape (Dk 16 + 8,
    // Dv 16), its absorbed one (latent 16 + 8, values aliased), GQA, Tq < Tk, one key, 300 keys
    test_attn_f32(ctx, 40, 40, 2, 2, 24, 16, 0);
    test_attn_f32(ctx, 40, 40, 2, 1, 24, 16, 1);
    test_attn_f32(ctx, 37, 301, 4, 2, 48, 32, 0);
    test_attn_f32(ctx, 1, 1, 2, 2, 192, 128, 0);
    test_attn_f32(ctx, 200, 300, 4, 1, 576, 512, 1);
    if (attn_f32_only_) {
        mtrl_cuda_ctx_destroy(ctx);
        return test_report();
    }
    test_attn(ctx, 150, 150, 4, 1, 40, 32, 1);    // tiny preset latent (dc 32 + dr 8)
    test_attn(ctx, 200, 200, 8, 1, 576, 512, 1);  // model shapes (dc 512 + dr 64)
    test_attn(ctx, 70, 190, 4, 1, 576, 512, 1);   // a segment after a 120-token prefix
    test_attn(ctx, 130, 130, 4, 2, 48, 32, 0);    // general: 2 key heads, separate values
    test_attn(ctx, 1, 33, 2, 1, 80, 64, 1);       // one query row
    // v2 shapes: the absorbed forward (Tq < Tk; key and packed-row counts that are not multiples
    // of the 64-key tile or the 64-row block), MHA Dk = Dv = 128 (forward and backward), GQA,
    // Tq < Tk, tails, one query row, exact tiles.
    test_attn(ctx, 37, 301, 4, 1, 576, 512, 1);
    test_attn(ctx, 200, 200, 16, 1, 576, 512, 1);  // the bench's H = 16: 4 tokens per block
    test_attn(ctx, 200, 200, 4, 4, 128, 128, 0);   // MHA, 200 = 3 x 64 + 8
    test_attn(ctx, 77, 333, 3, 3, 128, 128, 0);    // a segment after a 256-token prefix
    test_attn(ctx, 150, 190, 4, 2, 128, 128, 0);   // GQA: 2 heads per key head
    test_attn(ctx, 1, 65, 2, 2, 128, 128, 0);      // one query row, 65 keys
    test_attn(ctx, 64, 64, 1, 1, 128, 128, 0);     // exact tiles
    const uint64_t rng_before_192 = tu_state_;  // restored after: the decode inputs as before
    // v2 MHA Dk = 192, Dv = 128 (the naive MLA form of the small preset: d_n 128 + d_r 64 key
    // columns, d_v 128): must run v2, and v1 must agree with it. Token counts that are not
    // multiples of the 32- / 64-row tiles or the 32- / 64-key tiles, one token, Tq < Tk
    // (segments after a prefix), H = 2 and 8, one GQA case, exact tiles.
    test_attn_x(ctx, 1, 1, 2, 2, 192, 128, 0, 1);      // one token
    test_attn_x(ctx, 63, 63, 8, 8, 192, 128, 0, 1);
    test_attn_x(ctx, 200, 200, 2, 2, 192, 128, 0, 1);  // 200 = 6 x 32 + 8
    test_attn_x(ctx, 1000, 1000, 8, 8, 192, 128, 0, 1);
    test_attn_x(ctx, 1, 65, 2, 2, 192, 128, 0, 1);     // one query row after 64 keys
    test_attn_x(ctx, 77, 333, 2, 2, 192, 128, 0, 1);   // a segment after a 256-token prefix
    test_attn_x(ctx, 200, 1000, 8, 8, 192, 128, 0, 1); // a segment after an 800-token prefix
    test_attn_x(ctx, 150, 190, 4, 2, 192, 128, 0, 1);  // GQA: 2 heads per key head
    test_attn_x(ctx, 128, 128, 2, 2, 192, 128, 0, 1);  // exact tiles
    // v2 where v3 is the default (H100 / H200; elsewhere these rerun v2): attn = mma
    attn_base_ = MTRL_KOPT_MMA;
    printf("attn = mma:\n");
    test_v3_shapes(ctx);
    attn_base_ = MTRL_KOPT_AUTO;
    // v3's own tile boundaries (128 keys / 128 rows per block, 64-row and 64-key tiles)
    test_attn_x(ctx, 256, 256, 2, 2, 192, 128, 0, 1);
    test_attn_x(ctx, 129, 129, 2, 2, 192, 128, 0, 1);
    test_attn_x(ctx, 127, 383, 2, 2, 192, 128, 0, 1);
    test_attn_x(ctx, 64, 64, 1, 1, 128, 128, 0, 1);
    tu_state_ = rng_before_192;
    if (attn_only) {
        mtrl_cuda_ctx_destroy(ctx);
        return test_report();
    }
    int lens1[5] = {1, 17, 256, 300, 700};
    test_decode(ctx, 5, lens1, 8, 32, 16, 32, 64, MTRL_F32);
    test_decode(ctx, 5, lens1, 8, 32, 16, 32, 64, MTRL_BF16);
    int lens2[3] = {1000, 1, 2049};
    test_decode(ctx, 3, lens2, 32, 128, 64, 128, 512, MTRL_BF16);  // H = 32: two row tiles in v2
    test_decode(ctx, 3, lens2, 32, 128, 64, 128, 512, MTRL_F32);
    // v2 shapes (model dims dc 512 + dr 64, H = 16 unless stated): one key; one long sequence in
    // many splits; B = 64 of mixed lengths around the 64-key tile and the split length; B = 8
    // short sequences (one split each); H < 16 and H = 20 (zero-padded rows), dc = 128 / 256.
    int lens3[1] = {1};
    test_decode(ctx, 1, lens3, 16, 128, 64, 128, 512, MTRL_BF16);
    int lens4[1] = {50001};
    test_decode(ctx, 1, lens4, 16, 128, 64, 128, 512, MTRL_BF16);
    int lens5[64];
    const int edge[16] = {1, 2, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1023, 3001};
    for (int b = 0; b < 64; b++) lens5[b] = b < 16 ? edge[b] : 1 + (int)(tu_unif() * 3000);
    test_decode(ctx, 64, lens5, 16, 128, 64, 128, 512, MTRL_BF16);
    // B = 16 and 24 on 132 SMs: the merge takes 8 and 16 sequences per block (the second block
    // of 24 holds 8); B = 64 above takes 32, B = 8 below 4, B = 1 one.
    test_decode(ctx, 16, lens5 + 8, 16, 128, 64, 128, 512, MTRL_BF16);
    test_decode(ctx, 24, lens5 + 40, 16, 128, 64, 128, 512, MTRL_BF16);
    int lens6[8] = {1, 5, 64, 100, 200, 255, 256, 129};
    test_decode(ctx, 8, lens6, 16, 128, 64, 128, 512, MTRL_BF16);
    int lens7[3] = {1, 700, 4099};
    test_decode(ctx, 3, lens7, 8, 64, 32, 64, 128, MTRL_BF16);     // dc 128 + dr 32, H = 8
    int lens8[2] = {333, 5000};
    test_decode(ctx, 2, lens8, 20, 64, 32, 96, 256, MTRL_BF16);    // dc 256 + dr 32, H = 20
    mtrl_cuda_ctx_destroy(ctx);
    return test_report();
}
