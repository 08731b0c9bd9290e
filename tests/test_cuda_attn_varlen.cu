// mtrl-test: gpu f64 timeout=600
// test_cuda_attn_varlen.cu: the varlen causal attention (mtrl_attn_causal_fwd_varlen / _bwd_varlen,
// attn/varlen.cuh: n packed pieces, each attending causally to its own keys only, one launch per
// kernel for all pieces) against mtrl_attn_causal_fwd / _bwd once per piece BIT FOR BIT (o, lse,
// dq, and dk, dv accumulated onto the same nonzero buffers: the same device code on the same
// inputs, tile for tile), for each kernel version the shape runs: v3 (wgmma, an H100 / H200: the
// option attn = auto), v2 (attn = mma) and v1 (attn = simt); and against the fp64 reference
// (mtrl_ref_attn_causal_fwd_varlen / _bwd_varlen on the same bf16-rounded inputs) at 1e-2, the
// bf16 kernels' tolerance of test_cuda_mla.cu. Outputs are poisoned with NaN first.
// Packs: pieces of 1, 15, 16, 17, 64, 333 tokens (a partial tile, one tile minus and plus one row,
// several tiles of every kernel's sizes), one piece alone (1 and 333), and mixes of 100 pieces of
// random lengths with an empty piece among them. Shapes: the naive MLA form (H = 8, Dk = 192 =
// d_n + d_r, Dv = 128: the learner's attention), MHA Dk = Dv = 128, GQA (Hk = 2 of H = 4, v3's
// in-step dK / dV), the absorbed form (Hk = 1, Dk = 576, Dv = 512 aliased: v2 forward, v1
// backward), and the prefill form (each piece with earlier keys of its own before its rows:
// koffs), naive and absorbed.
#include "tests/testhelp.h"
#include "kernels/lab/cuda_testutil.h"
#include "kernels/ref/mla_ref.h"


static void round_bf16_(double *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = tu_bf16_round(x[i]);
}

// One pack: n pieces of len[i] query rows, extra[i] earlier keys each (NULL: none, the learner's
// form with koffs = NULL). Every version the shape runs, varlen against per piece.
static void test_pack(mtrl_cuda_ctx *ctx, const char *name, int n, const int *len, const int *extra, int H, int Hk,
                      int Dk, int Dv, int alias) {
    int *qo = (int *)malloc(sizeof(int) * (n + 1)), *ko = (int *)malloc(sizeof(int) * (n + 1));
    qo[0] = ko[0] = 0;
    int long_key = 0;  // some piece has two keys or more (else every gradient is exactly zero)
    for (int i = 0; i < n; i++) {
        qo[i + 1] = qo[i] + len[i];
        ko[i + 1] = ko[i] + len[i] + (extra ? extra[i] : 0);
        long_key |= ko[i + 1] - ko[i] > 1;
    }
    const int Tq = qo[n], Tk = ko[n], ldk = alias ? Dk : Hk * Dk, ldv = alias ? Dk : Hk * Dv;
    const int *kp = extra ? ko : NULL;
    const double scale = 1.0 / sqrt((double)(alias ? 192 : Dk));
    const size_t nq = (size_t)Tq * H * Dk, nk = (size_t)Tk * ldk, nv = alias ? 0 : (size_t)Tk * ldv,
                 no = (size_t)Tq * H * Dv, nl = (size_t)Tq * H;
    double *q = tu_alloc(nq), *k = tu_alloc(nk), *v = tu_alloc(nv ? nv : 1), *dout = tu_alloc(no);
    tu_fill_normal(q, nq, 1.0);
    tu_fill_normal(k, nk, 1.0);
    tu_fill_normal(v, nv, 1.0);
    tu_fill_normal(dout, no, 1.0);
    round_bf16_(q, nq), round_bf16_(k, nk), round_bf16_(v, nv), round_bf16_(dout, no);
    const double *vv = alias ? k : v;
    // the fp64 reference on the rounded inputs
    double *o = tu_alloc(no), *lse = tu_alloc(nl), *dq = tu_alloc(nq), *dk = tu_alloc(nk), *dv = alias ? dk : tu_alloc(nv);
    double *dk0 = tu_alloc(nk), *dv0 = tu_alloc(nv ? nv : 1);
    tu_fill_normal(dk0, nk, 1.0);  // accumulated onto
    tu_fill_normal(dv0, nv, 1.0);
    memcpy(dk, dk0, sizeof(double) * nk);
    if (!alias) memcpy(dv, dv0, sizeof(double) * nv);
    mtrl_ref_attn_causal_fwd_varlen(n, qo, kp, H, Hk, Dk, Dv, scale, q, k, ldk, vv, ldv, o, lse);
    mtrl_ref_attn_causal_bwd_varlen(n, qo, kp, H, Hk, Dk, Dv, scale, q, k, ldk, vv, ldv, o, lse, dout, dq, dk, dv);
    for (size_t i = 0; i < nk; i++) dk[i] -= dk0[i];  // the increments
    if (!alias)
        for (size_t i = 0; i < nv; i++) dv[i] -= dv0[i];

    mtrl_bf16 *d_q = tu_dev_bf16(q, nq), *d_k = tu_dev_bf16(k, nk), *d_v = alias ? d_k : tu_dev_bf16(v, nv),
              *d_do = tu_dev_bf16(dout, no);
    size_t big = nq > nk ? nq : nk;
    if (nv > big) big = nv;
    if (no > big) big = no;
    double *got = tu_alloc(big);
    for (int version = 3; version >= 1; version--) {
        mtrl_cuda_ctx_opts(ctx)->attn = version == 3 ? MTRL_KOPT_AUTO : version == 2 ? MTRL_KOPT_MMA : MTRL_KOPT_SIMT;
        const int vf = mtrl_attn_causal_version(ctx, H, Hk, Dk, Dv, alias, 0);
        const int vb = mtrl_attn_causal_version(ctx, H, Hk, Dk, Dv, alias, 1);
        // the versions this option selects that a higher option has not run already
        if (version == 3 && vf < 3 && vb < 3) continue;
        if (version == 2 && vf < 2 && vb < 2) continue;
        printf("varlen %s: %d pieces, %d rows, %d keys, H=%d Hk=%d Dk=%d Dv=%d%s: fwd v%d, bwd v%d\n", name, n, Tq, Tk,
               H, Hk, Dk, Dv, alias ? " (values alias the keys)" : "", vf, vb);
        float *p_o = tu_dev_nan(ctx, no), *p_lse = tu_dev_nan(ctx, nl), *p_dq = tu_dev_nan(ctx, nq);
        float *v_o = tu_dev_nan(ctx, no), *v_lse = tu_dev_nan(ctx, nl), *v_dq = tu_dev_nan(ctx, nq);
        float *p_dk = tu_dev_f32(dk0, nk), *p_dv = alias ? p_dk : tu_dev_f32(dv0, nv);
        float *v_dk = tu_dev_f32(dk0, nk), *v_dv = alias ? v_dk : tu_dev_f32(dv0, nv);
        for (int i = 0; i < n; i++) {  // one call per piece
            const int Tqi = qo[i + 1] - qo[i], Tki = ko[i + 1] - ko[i];
            const size_t a = (size_t)qo[i], b = (size_t)ko[i];
            TEST_EQ_INT(mtrl_attn_causal_fwd(ctx, Tqi, Tki, H, Hk, Dk, Dv, (float)scale, d_q + a * H * Dk,
                                             d_k + b * ldk, ldk, d_v + b * ldv, ldv, p_o + a * H * Dv, p_lse + a * H),
                        0);
        }
        for (int i = 0; i < n; i++) {
            const int Tqi = qo[i + 1] - qo[i], Tki = ko[i + 1] - ko[i];
            const size_t a = (size_t)qo[i], b = (size_t)ko[i];
            TEST_EQ_INT(mtrl_attn_causal_bwd(ctx, Tqi, Tki, H, Hk, Dk, Dv, (float)scale, d_q + a * H * Dk,
                                             d_k + b * ldk, ldk, d_v + b * ldv, ldv, p_o + a * H * Dv, p_lse + a * H,
                                             d_do + a * H * Dv, p_dq + a * H * Dk, p_dk + b * ldk,
                                             alias ? p_dk + b * ldk : p_dv + b * ldv),
                        0);
        }
        TEST_EQ_INT(mtrl_attn_causal_fwd_varlen(ctx, n, qo, kp, H, Hk, Dk, Dv, (float)scale, d_q, d_k, ldk, d_v, ldv,
                                                v_o, v_lse),
                    0);
        // the backward on the per-piece forward's o and lse (the same bits when the forward passed)
        TEST_EQ_INT(mtrl_attn_causal_bwd_varlen(ctx, n, qo, kp, H, Hk, Dk, Dv, (float)scale, d_q, d_k, ldk, d_v, ldv,
                                                p_o, p_lse, d_do, v_dq, v_dk, v_dv),
                    0);
        mtrl_cuda_sync(ctx);
        char what[96];
#define VL_NAME(s, ver) (snprintf(what, sizeof what, "%s (v%d)", s, ver), what)
        TU_SAME(VL_NAME("fwd o: varlen vs per piece", vf), v_o, p_o, no);
        TU_SAME(VL_NAME("fwd lse", vf), v_lse, p_lse, nl);
        TU_SAME(VL_NAME("bwd dq", vb), v_dq, p_dq, nq);
        TU_SAME(VL_NAME(alias ? "bwd dk (= dv, accumulated)" : "bwd dk (accumulated)", vb), v_dk, p_dk, nk);
        if (!alias) TU_SAME(VL_NAME("bwd dv (accumulated)", vb), v_dv, p_dv, nv);
        tu_get_f32(got, v_o, no);
        TU_CHECK_REL(VL_NAME("o vs fp64", vf), got, o, no, 1e-2);
        tu_get_f32(got, v_lse, nl);
        TU_CHECK_REL(VL_NAME("lse vs fp64", vf), got, lse, nl, 1e-2);
        if (long_key) {
            tu_get_f32(got, v_dq, nq);
            TU_CHECK_REL(VL_NAME("dq vs fp64", vb), got, dq, nq, 1e-2);
            tu_get_f32(got, v_dk, nk);
            for (size_t i = 0; i < nk; i++) got[i] -= (double)(float)dk0[i];
            TU_CHECK_REL(VL_NAME("dk increment vs fp64", vb), got, dk, nk, 1e-2);
            if (!alias) {
                tu_get_f32(got, v_dv, nv);
                for (size_t i = 0; i < nv; i++) got[i] -= (double)(float)dv0[i];
                TU_CHECK_REL(VL_NAME("dv increment vs fp64", vb), got, dv, nv, 1e-2);
            }
        }
        float *fr[] = {p_o, p_lse, p_dq, v_o, v_lse, v_dq, p_dk, v_dk};
        for (size_t i = 0; i < sizeof fr / sizeof *fr; i++) mtrl_cuda_free(fr[i]);
        if (!alias) {
            mtrl_cuda_free(p_dv);
            mtrl_cuda_free(v_dv);
        }
    }
    mtrl_cuda_ctx_opts(ctx)->attn = MTRL_KOPT_AUTO;
    mtrl_cuda_free(d_q);
    mtrl_cuda_free(d_k);
    if (!alias) mtrl_cuda_free(d_v);
    mtrl_cuda_free(d_do);
    double *fh[] = {q, k, v, dout, o, lse, dq, dk, dk0, dv0, got};
    for (size_t i = 0; i < sizeof fh / sizeof *fh; i++) free(fh[i]);
    if (!alias) free(dv);
    free(qo);
    free(ko);
}

int main(void) {
    if (mtrl_cuda_device_count() <= 0) test_skip("no CUDA device");
    mtrl_cuda_ctx *ctx = mtrl_cuda_ctx_create(0, NULL);
    tu_seed(21);
    static const int edge[6] = {1, 15, 16, 17, 64, 333}, one[1] = {1}, long1[1] = {333};
    static const int edge_extra[6] = {0, 40, 1, 100, 0, 7};
    int mix[100], mix_extra[100];
    tu_vl_mix(100, 150, mix);
    for (int i = 0; i < 100; i++) mix_extra[i] = (int)(tu_unif() * 200);
    // the learner's naive MLA form (small's H = 8), then MHA 128, GQA, the absorbed form
    const struct {
        const char *what;
        int H, Hk, Dk, Dv, alias;
    } shapes[] = {
        {"naive MLA", 8, 8, 192, 128, 0},
        {"MHA", 4, 4, 128, 128, 0},
        {"GQA", 4, 2, 128, 128, 0},
        {"absorbed", 8, 1, 576, 512, 1},
    };
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        char name[96];
        const int H = shapes[s].H, Hk = shapes[s].Hk, Dk = shapes[s].Dk, Dv = shapes[s].Dv, al = shapes[s].alias;
#define PACK(label, n, len, extra)                                                  \
    (snprintf(name, sizeof name, "%s, %s", shapes[s].what, label),                  \
     test_pack(ctx, name, n, len, extra, H, Hk, Dk, Dv, al))
        PACK("1 15 16 17 64 333", 6, edge, (const int *)NULL);
        PACK("one piece of 1", 1, one, (const int *)NULL);
        PACK("one piece of 333", 1, long1, (const int *)NULL);
        PACK("mix of 100", 100, mix, (const int *)NULL);
        if (s == 0 || s == 3) {  // the prefill form: each piece after keys of its own
            PACK("1 15 16 17 64 333 after own keys", 6, edge, edge_extra);
            PACK("mix of 100 after own keys", 100, mix, mix_extra);
        }
    }
    // arguments the op refuses
    int bad[3] = {0, 20, 10}, kbad[3] = {0, 10, 30};
    mtrl_bf16 *d = (mtrl_bf16 *)mtrl_cuda_malloc(2 * 40 * 8 * 192);
    float *f = tu_dev_nan(ctx, 40 * 8 * 192);
    printf("refused: offsets going backwards; a piece with fewer keys than rows\n");
    TEST_EQ_INT(mtrl_attn_causal_fwd_varlen(ctx, 2, bad, NULL, 8, 8, 192, 128, 0.1f, d, d, 8 * 192, d, 8 * 128, f, f),
                -1);
    TEST_EQ_INT(mtrl_attn_causal_fwd_varlen(ctx, 2, kbad, bad + 0, 8, 8, 192, 128, 0.1f, d, d, 8 * 192, d, 8 * 128,
                                            f, f),
                -1);
    mtrl_cuda_free(d);
    mtrl_cuda_free(f);
    mtrl_cuda_ctx_destroy(ctx);
    return test_report();
}
