// mtrl-test: cpu slow timeout=300
// test_kda_v3_emu.c: why the tensor-core KDA forward v3 (kernels/cuda/kda_tc_cuda.cu, bf16
// operands) fails the model's GPU tests, reproduced without a GPU. The CPU model of
// test_cuda_model's `reduced small` case (KMKM, d 256, KDA 2 x 128) runs twice: with the fp32
// reference chunked forward (the CPU backend) and with that forward replaced by a C port of
// tools/kda_v3/rounding_model.py (v3's bf16 rounding points: every mma operand, T, the state and
// Δ as operands; fp32 state and accumulators; the backward stays the fp32 reference, as on the GPU
// where the v2 backward consumes v3's S_tiles). The same measures as test_cuda_model steps 6 and 7:
// segmented (16, 24 tokens) vs whole log-probs and gradients (routing replayed), prefill then
// decode vs one prefill (split points 1, 15, 16, 17; rows whose routing differs skipped), and the
// emulated forward against the fp32 one on the same routing (test_cuda_model's GPU vs CPU).
// Checks: the fp32 path meets test_cuda_model's tolerances; the emulated kernel's own error
// (o of the first KDA layer against the fp32 forward) is at the rounding model's level (< 1e-2).
// Printed, not checked: the emulated model-level numbers. Measured here (x86, 2026-11-30):
// emulated v3 decode vs prefill 0.116 of max |logit| (0.005–0.025 before the first routing
// flip), segment 24 logp 4.2e-4 and layers.2.kda.A_log gradient 0.111 — the GPU run of v3 gave
// 0.17, 2.4e-3 and 0.547 (layers.0): the failures are v3's bf16 rounding (≈ 4e-3 relative per
// KDA layer) amplified by the model (MoE routing flips; the decay gradient, a sum ~100x smaller
// than the sum of its terms' magnitudes), not an indexing error.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "common/model/backend.h"
#include "common/model/model.h"
#include "common/rng.h"
#include "tests/testhelp.h"
#include "tests/testmodel.h"

_Static_assert(!REAL_IS_F64, "the fp32 model");

static float bf_(float x) { uint32_t u; memcpy(&u, &x, 4); u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u; memcpy(&x, &u, 4); return x; }
static float ex_(float x) { return (float)exp((double)x); }
// numpy rounding_model.py's v3 (bf16 operands at the kernel's points, fp32 state), K = V = 128.
static void emu_v3_(mtrl_backend *be, int T, int H, int K, int V, const real *q, const real *k, const real *v, const real *g,
                    const real *beta, const real *S0, real *o, real *Sf, real *St) {
    (void)be;
    int nt = (T + 15) / 16;
    float *S = malloc(sizeof(float) * K * V), *Sb = malloc(sizeof(float) * K * V);
    static float Kp[16][128], Qh[16][128], Km[16][128], BK[16][128], BV[16][128], Qp[16][128], Ke[16][128], G[16][128];
    static float Wn[16][128], U[16][128], Db[16][128];
    float P[16][16], M[16][16], Tb[16][16], eg[128], bb[16];
    for (int h = 0; h < H; h++) {
        for (int i = 0; i < K * V; i++) S[i] = S0 ? S0[(size_t)h * K * V + i] : 0.f;
        for (int n = 0; n < nt; n++) {
            int t0 = 16 * n, cr = T - t0 < 16 ? T - t0 : 16, m = cr - 1 < 8 ? cr - 1 : 8;
            for (int r = 0; r < 16; r++) bb[r] = r < cr ? beta[(size_t)(t0 + r) * H + h] : 0.f;
            for (int d = 0; d < K; d++) {
                float acc = 0.f;
                for (int r = 0; r < 16; r++) { acc += r < cr ? g[((size_t)(t0 + r) * H + h) * K + d] : 0.f; G[r][d] = acc; }
                eg[d] = ex_(G[15][d]);
            }
            for (int r = 0; r < 16; r++)
                for (int d = 0; d < K; d++) {
                    size_t ix = ((size_t)(t0 + r) * H + h) * K + d;
                    float qq = r < cr ? q[ix] : 0.f, kk = r < cr ? k[ix] : 0.f, vv = r < cr ? v[((size_t)(t0 + r) * H + h) * V + d] : 0.f;
                    float Gc = G[r][d], Gm = G[m][d], ga = G[15][d];
                    Kp[r][d] = bf_(kk * ex_(Gc - Gm)); Qh[r][d] = bf_(qq * ex_(Gc - Gm)); Km[r][d] = bf_(kk * ex_(Gm - Gc));
                    BK[r][d] = bf_(bb[r] * (kk * ex_(Gc))); BV[r][d] = bf_(bb[r] * vv); Qp[r][d] = bf_(qq * ex_(Gc));
                    Ke[r][d] = bf_(kk * ex_(ga - Gc));
                }
            for (int i = 0; i < 16; i++)
                for (int j = 0; j < 16; j++) {
                    double x = 0, p = 0;
                    for (int d = 0; d < K; d++) { x += (double)Kp[i][d] * Km[j][d]; p += (double)Qh[i][d] * Km[j][d]; }
                    P[i][j] = bf_(j <= i ? (float)p : 0.f); M[i][j] = j < i ? bb[i] * (float)x : 0.f;
                }
            for (int j = 0; j < 16; j++) {
                float col[16];
                for (int i = 0; i < 16; i++) { float acc = 0.f; for (int l = 0; l < i; l++) acc = fmaf(M[i][l], col[l], acc);
                    col[i] = i == j ? 1.f : (i > j ? -acc : 0.f); }
                for (int i = 0; i < 16; i++) Tb[i][j] = bf_(col[i]);
            }
            for (int i = 0; i < 16; i++)
                for (int d = 0; d < K; d++) {
                    double w = 0, u = 0;
                    for (int l = 0; l < 16; l++) { w += (double)Tb[i][l] * BK[l][d]; u += (double)Tb[i][l] * BV[l][d]; }
                    Wn[i][d] = bf_(-(float)w); U[i][d] = bf_((float)u);
                }
            if (St) memcpy(St + ((size_t)n * H + h) * K * V, S, sizeof(float) * K * V);
            for (int i = 0; i < K * V; i++) Sb[i] = bf_(S[i]);
            for (int s = 0; s < 16; s++)
                for (int j = 0; j < V; j++) {
                    double acc = U[s][j];
                    for (int d = 0; d < K; d++) acc += (double)Wn[s][d] * Sb[d * V + j];
                    Db[s][j] = bf_((float)acc);
                }
            if (o)
                for (int r = 0; r < cr; r++)
                    for (int j = 0; j < V; j++) {
                        double acc = 0;
                        for (int d = 0; d < K; d++) acc += (double)Qp[r][d] * Sb[d * V + j];
                        for (int s = 0; s < 16; s++) acc += (double)P[r][s] * Db[s][j];
                        o[((size_t)(t0 + r) * H + h) * V + j] = (float)acc;
                    }
            for (int d = 0; d < K; d++)
                for (int j = 0; j < V; j++) {
                    double acc = (double)eg[d] * S[d * V + j];
                    for (int s = 0; s < 16; s++) acc += (double)Ke[s][d] * Db[s][j];
                    S[d * V + j] = (float)acc;
                }
        }
        if (Sf) memcpy(Sf + (size_t)h * K * V, S, sizeof(float) * K * V);
    }
    free(S); free(Sb);
}

static int emu_on_ = 0, emu_first_ = 0;
static double emu_o_err_ = -1;
static void (*fwd_fp32_)(mtrl_backend *, int, int, int, int, const real *, const real *, const real *, const real *,
                         const real *, const real *, real *, real *, real *);
static void fwd_(mtrl_backend *be, int T, int H, int K, int V, const real *q, const real *k, const real *v, const real *g,
                 const real *beta, const real *S0, real *o, real *Sf, real *St) {
    if (!emu_on_ || K != 128 || V != 128) {
        fwd_fp32_(be, T, H, K, V, q, k, v, g, beta, S0, o, Sf, St);
        return;
    }
    emu_v3_(be, T, H, K, V, q, k, v, g, beta, S0, o, Sf, St);
    if (emu_first_ && o) {  // the kernel-level error of the first call, against the fp32 forward
        emu_first_ = 0;
        size_t n = (size_t)T * H * V;
        real *o2 = malloc(sizeof(real) * n);
        fwd_fp32_(be, T, H, K, V, q, k, v, g, beta, S0, o2, NULL, NULL);
        emu_o_err_ = test_rel_err_f(o, o2, n);
        free(o2);
    }
}

static double worst_(const mtrl_model *m, const real *a, const real *b, const char **nm) {
    double w = 0;
    *nm = "";
    for (int i = 0; i < m->params.n; i++) {
        const mtrl_tensor *t = &m->params.items[i];
        double r = test_rel_err_f((const real *)((const char *)a + t->offset), (const real *)((const char *)b + t->offset),
                                  t->numel);
        if (!(r <= w)) {
            w = r;
            *nm = t->name;
        }
    }
    return w;
}

typedef struct {
    double seg_lp[2], seg_g[2], dec, dec_pre;
    const char *seg_n[2];
    int flips;
} result_;

static void run_(mtrl_model *m, const uint32_t *const *tok, const int *lens, const real *c, result_ *r, real *g_out,
                 uint8_t *const *rin) {
    const mtrl_model_dims *d = &m->dims;
    size_t rw = (size_t)d->n_moe * d->k, total = m->params.total;
    int n = 2, tot = lens[0] + lens[1];
    uint8_t *rg[2];
    const uint8_t *rgc[2];
    for (int i = 0; i < n; i++) rgc[i] = rg[i] = calloc((size_t)lens[i] * rw + 1, 1);
    mtrl_batch b = {n, tok, lens, NULL};
    real *lp0 = calloc((size_t)tot, sizeof(real)), *lps = calloc((size_t)tot, sizeof(real));
    // whole, own routing (or the given one replayed)
    const uint8_t *ric[2] = {rin ? rin[0] : NULL, rin ? rin[1] : NULL};
    mtrl_batch b0 = b;
    if (rin) b0.routing = ric;
    m->replay_routing = rin != NULL;
    mtrl_model_zero_grads(m);
    mtrl_model_forward(m, &b0, 0, lp0, NULL, rin ? NULL : rg);
    mtrl_model_backward(m, &b0, c, NULL);
    memcpy(g_out, m->grads, total);
    if (rin)
        for (int i = 0; i < n; i++) memcpy(rg[i], rin[i], (size_t)lens[i] * rw);
    // segmented, routing replayed
    mtrl_batch bs = b;
    bs.routing = rgc;
    m->replay_routing = 1;
    int segs[2] = {16, 24};
    for (int s = 0; s < 2; s++) {
        mtrl_model_zero_grads(m);
        mtrl_model_forward(m, &bs, segs[s], lps, NULL, NULL);
        mtrl_model_backward(m, &bs, c, NULL);
        r->seg_lp[s] = test_rel_err_f(lps, lp0, (size_t)tot);
        r->seg_g[s] = worst_(m, m->grads, g_out, &r->seg_n[s]);
    }
    m->replay_routing = 0;
    // prefill then decode vs one prefill
    int T = lens[0], V = d->V;
    real *lg = malloc(sizeof(real) * (size_t)T * V), *row = malloc(sizeof(real) * (size_t)V);
    uint8_t *rfull = calloc((size_t)T * rw + 1, 1), *rdec = calloc(rw + 1, 1);
    mtrl_model_logits(m, tok[0], T, 0, lg);
    {
        mtrl_decode_state s;
        mtrl_decode_state_init(&s, m, T);
        mtrl_model_prefill(m, &s, tok[0], T, NULL, rfull);
        mtrl_decode_state_free(&s);
    }
    int splits[4] = {1, 15, 16, 17};
    r->dec = r->dec_pre = 0;
    r->flips = 0;
    for (int si = 0; si < 4; si++) {
        int sp = splits[si], flipped = 0;
        mtrl_decode_state s;
        mtrl_decode_state_init(&s, m, T);
        mtrl_model_prefill(m, &s, tok[0], sp, row, NULL);
        r->dec = fmax(r->dec, test_max_rel(row, lg + (size_t)(sp - 1) * V, (size_t)V));
        for (int t = sp; t < T; t++) {
            mtrl_decode_state *one[1] = {&s};
            mtrl_model_decode(m, one, 1, &tok[0][t], row, rdec);
            if (memcmp(rdec, rfull + (size_t)t * rw, rw)) {
                r->flips++;
                flipped = 1;
                continue;
            }
            double e = test_max_rel(row, lg + (size_t)t * V, (size_t)V);
            r->dec = fmax(r->dec, e);
            if (!flipped) r->dec_pre = fmax(r->dec_pre, e);
        }
        mtrl_decode_state_free(&s);
    }
    for (int i = 0; i < n; i++) free(rg[i]);
    free(lp0); free(lps); free(lg); free(row); free(rfull); free(rdec);
}

int main(void) {
    const char *ini = "preset = custom\nlayers = 4\nd_model = 256\nhybrid = KMKM\nkda_heads = 2\nkda_head_dim = 128\n"
                      "mla_heads = 4\nmla_nope_dim = 64\nmla_rope_dim = 32\nmla_v_dim = 64\nmla_latent_dim = 256\n"
                      "dense_inter = 512\nexperts = 16\ntop_k = 4\nshared_experts = 1\nexpert_inter = 128\n"
                      "attnres_block = 2\n";
    mtrl_model_dims d = test_model_dims(ini, 512);
    mtrl_model m;
    mtrl_model_init(&m, &d, 7);
    test_model_perturb(&m, 3);
    fwd_fp32_ = m.be->kda_chunk_fwd;
    m.be->kda_chunk_fwd = fwd_;
    int lens[2] = {96, 41};
    uint32_t *tk[2];
    const uint32_t *ct[2];
    for (int i = 0; i < 2; i++) {
        tk[i] = malloc(sizeof(uint32_t) * (size_t)lens[i]);
        for (int t = 0; t < lens[i]; t++) tk[i][t] = (uint32_t)(mtrl_rng_u64(5, 10 + i, t) % 512);
        ct[i] = tk[i];
    }
    real *c = malloc(sizeof(real) * 137);
    for (int t = 0; t < 137; t++) c[t] = (real)mtrl_rng_normal(5, 20, t);
    size_t total = m.params.total, rw = (size_t)d.n_moe * d.k;
    real *g32 = malloc(total), *gemu = malloc(total), *gx = malloc(total);
    result_ r32, remu, rx;
    run_(&m, ct, lens, c, &r32, g32, NULL);
    printf("fp32 forward: segment 16 / 24 logp rel %.3g / %.3g, gradient rel %.3g (%s) / %.3g (%s); decode %.3g\n",
           r32.seg_lp[0], r32.seg_lp[1], r32.seg_g[0], r32.seg_n[0], r32.seg_g[1], r32.seg_n[1], r32.dec);
    TEST_CHECKF(r32.seg_lp[0] <= 1e-4 && r32.seg_lp[1] <= 1e-4, "fp32: segmented logp %.3g / %.3g", r32.seg_lp[0],
                r32.seg_lp[1]);
    TEST_CHECKF(r32.seg_g[0] <= 1e-2 && r32.seg_g[1] <= 1e-2, "fp32: segmented gradients %.3g / %.3g", r32.seg_g[0],
                r32.seg_g[1]);
    TEST_CHECKF(r32.dec <= 2e-2, "fp32: decode vs prefill %.3g", r32.dec);
    // the routing of the fp32 run, for the GPU-vs-CPU analogue
    uint8_t *rr[2];
    for (int i = 0; i < 2; i++) rr[i] = calloc((size_t)lens[i] * rw + 1, 1);
    {
        mtrl_batch b = {2, ct, lens, NULL};
        real *lp = calloc(137, sizeof(real));
        m.replay_routing = 0;
        mtrl_model_forward(&m, &b, 0, lp, NULL, rr);
        free(lp);
    }
    emu_on_ = 1;
    emu_first_ = 1;
    run_(&m, ct, lens, c, &remu, gemu, NULL);
    printf("emulated v3: kernel-level o rel %.3g (first KDA call); segment 16 / 24 logp rel %.3g / %.3g, gradient rel "
           "%.3g (%s) / %.3g (%s); decode %.3g (%.3g before the first routing flip; %d rows with other routing skipped)\n",
           emu_o_err_, remu.seg_lp[0], remu.seg_lp[1], remu.seg_g[0], remu.seg_n[0], remu.seg_g[1], remu.seg_n[1],
           remu.dec, remu.dec_pre, remu.flips);
    TEST_CHECKF(emu_o_err_ > 0 && emu_o_err_ < 1e-2, "emulated v3 o rel %.3g", emu_o_err_);
    run_(&m, ct, lens, c, &rx, gx, rr);  // emulated, the fp32 run's routing replayed
    const char *wn;
    double wx = worst_(&m, gx, g32, &wn);
    printf("emulated v3 vs fp32 forward (fp32 routing replayed): worst gradient rel %.3g (%s)\n", wx, wn);
    for (int i = 0; i < 2; i++) { free(tk[i]); free(rr[i]); }
    free(c); free(g32); free(gemu); free(gx);
    mtrl_model_free(&m);
    return test_report();
}
