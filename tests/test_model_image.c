// mtrl-test: cpu f64 timeout=600
// Image tokens through the backbone in fp64 (docs/multimodal.md, model.h "pictures"):
//  - every parameter's gradient, the patch embedding's above all, == central finite differences
//    on a batch of two sequences mixing text and pictures (routing replayed);
//  - the text embedding gets no gradient from image positions, and the position before an
//    image token has no log-prob (targets masked);
//  - every form gives the same result on a stream with pictures: chunked logits == segmented
//    (segments cutting through a picture) == prefill then decode (the split inside a picture,
//    the rest of it decoded token by token) == prefill_many of two sequences at once; a batch of
//    two (packed into one segment) == each alone;
//  - the stream's layout (common/image.h): IMG_START, rows of patches each closed by IMG_ROW,
//    IMG_END; patches padded with black at the right and bottom edges.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/image.h"
#include "model/model.h"
#include "common/rng.h"
#include "tests/testhelp.h"
#include "tests/testmodel.h"

_Static_assert(REAL_IS_F64, "this test needs the fp64 build");

enum { P = 2, V = 32 };

static mtrl_model_dims dims_(const char *hybrid) {
    char text[600];
    snprintf(text, sizeof text,
             "preset = custom\nlayers = 4\nd_model = 16\nhybrid = %s\nkda_heads = 2\n"
             "kda_head_dim = 8\nmla_heads = 2\nmla_nope_dim = 8\nmla_rope_dim = 4\nmla_v_dim = 8\nmla_latent_dim = 12\n"
             "dense_inter = 24\nexperts = 4\ntop_k = 2\nshared_experts = 1\nexpert_inter = 12\nattnres_block = 2\n"
             "init_std = 0.3\nimage_patch = %d\nimage_max_side = 64\n",
             hybrid, P);
    return test_model_dims(text, V);
}

// Two pictures of 3 x 4 and 5 x 2 pixels (odd sizes: padded patches), their patch table.
typedef struct pics {
    uint8_t rgb0[4 * 3 * 3], rgb1[2 * 5 * 3];
    uint8_t *table;
    int n;
} pics;

static void pics_make_(pics *p) {
    for (size_t i = 0; i < sizeof p->rgb0; i++) p->rgb0[i] = (uint8_t)(mtrl_rng_u64(5, 1, i) & 255);
    for (size_t i = 0; i < sizeof p->rgb1; i++) p->rgb1[i] = (uint8_t)(mtrl_rng_u64(5, 2, i) & 255);
    size_t n0 = mtrl_image_patch_count(3, 4, P), n1 = mtrl_image_patch_count(5, 2, P), pb = 3 * P * P;
    p->n = (int)(n0 + n1);
    p->table = malloc((size_t)p->n * pb);
    mtrl_image_patches(p->rgb0, 3, 4, P, p->table);
    mtrl_image_patches(p->rgb1, 5, 2, P, p->table + n0 * pb);
}

// text(a) picture text(b) [picture] text(c): the tokens of one sequence; returns its length.
static int seq_make_(uint32_t *tok, uint64_t seed, int a, int b, int c, int second) {
    int n = 0;
    for (int i = 0; i < a; i++) tok[n++] = (uint32_t)(mtrl_rng_u64(seed, 1, i) % V);
    mtrl_image_tokens(3, 4, P, 0, tok + n);
    n += (int)mtrl_image_token_count(3, 4, P);
    for (int i = 0; i < b; i++) tok[n++] = (uint32_t)(mtrl_rng_u64(seed, 2, i) % V);
    if (second) {
        mtrl_image_tokens(5, 2, P, (uint32_t)mtrl_image_patch_count(3, 4, P), tok + n);
        n += (int)mtrl_image_token_count(5, 2, P);
    }
    for (int i = 0; i < c; i++) tok[n++] = (uint32_t)(mtrl_rng_u64(seed, 3, i) % V);
    return n;
}

static void test_layout(void) {
    TEST_EQ_INT(mtrl_image_patch_count(3, 4, 2), 4);
    TEST_EQ_INT(mtrl_image_token_count(3, 4, 2), 2 + 2 * 3);
    uint32_t t[8];
    mtrl_image_tokens(3, 4, 2, 7, t);
    uint32_t want[8] = {MTRL_IMG_START, MTRL_IMG_PATCH0 + 7, MTRL_IMG_PATCH0 + 8, MTRL_IMG_ROW,
                        MTRL_IMG_PATCH0 + 9, MTRL_IMG_PATCH0 + 10, MTRL_IMG_ROW, MTRL_IMG_END};
    TEST_CHECK(memcmp(t, want, sizeof t) == 0);
    uint8_t rgb[4 * 3 * 3], out[4 * 12];
    for (int i = 0; i < 36; i++) rgb[i] = (uint8_t)(i + 1);
    mtrl_image_patches(rgb, 3, 4, 2, out);
    // patch (0,1) holds column 2 of rows 0 and 1, then black padding
    const uint8_t *p01 = out + 12;
    TEST_CHECK(p01[0] == rgb[6] && p01[1] == rgb[7] && p01[2] == rgb[8] && p01[3] == 0 && p01[5] == 0);
    TEST_CHECK(p01[6] == rgb[15] && p01[9] == 0);
    // patch (1,0): rows 2 and 3, columns 0 and 1
    TEST_CHECK(out[24] == rgb[18] && out[27] == rgb[21] && out[30] == rgb[27]);
}

static double loss_(mtrl_model *m, const mtrl_batch *b, const real *c, int backward) {
    int total = 0;
    for (int i = 0; i < b->n; i++) total += b->len[i];
    real *logp = calloc((size_t)total, sizeof(real));
    mtrl_model_forward(m, b, 0, logp, NULL, NULL);
    double L = 0;
    for (int t = 0; t < total; t++) L += c[t] * logp[t];
    if (backward) mtrl_model_backward(m, b, c, NULL);
    free(logp);
    return L;
}

static void test_gradcheck(void) {
    mtrl_model_dims d = dims_("KKMK");
    mtrl_model m;
    mtrl_model_init(&m, &d, 11);
    test_model_perturb(&m, 5);
    TEST_CHECK(m.P.patch_w != NULL);
    pics pc;
    pics_make_(&pc);
    mtrl_model_set_patches(&m, pc.table, pc.n);
    uint32_t t0[64], t1[64];
    int len[2] = {seq_make_(t0, 1, 3, 4, 3, 1), seq_make_(t1, 2, 0, 5, 2, 0)};
    const uint32_t *toks[2] = {t0, t1};
    size_t rw = (size_t)d.n_moe * d.k;
    uint8_t *rout[2] = {calloc((size_t)len[0] * rw, 1), calloc((size_t)len[1] * rw, 1)};
    mtrl_batch b = {2, toks, len, NULL};
    int total = len[0] + len[1];
    real *c = malloc(sizeof(real) * (size_t)total), *logp = malloc(sizeof(real) * (size_t)total);
    for (int t = 0; t < total; t++) c[t] = (real)mtrl_rng_normal(3, 1, t);
    mtrl_model_forward(&m, &b, 0, logp, NULL, rout);
    // no log-prob before an image token
    int masked = 0, bad_mask = 0;
    for (int i = 0, o = 0; i < 2; o += len[i], i++)
        for (int t = 0; t + 1 < len[i]; t++)
            if (mtrl_img_token_is(toks[i][t + 1])) {
                masked++;
                bad_mask += logp[o + t] != 0;
            } else {
                bad_mask += !(logp[o + t] < 0);
            }
    TEST_EQ_INT(masked, 8 + 6 + 8 - 1); // every image token but the one at position 0 of sequence 1
    TEST_EQ_INT(bad_mask, 0);
    b.routing = (const uint8_t *const *)rout;
    m.replay_routing = 1;
    mtrl_model_zero_grads(&m);
    loss_(&m, &b, c, 1);
    int checked = 0, bad = 0;
    double worst = 0, worst_patch = 0;
    for (int i = 0; i < m.params.n; i++) {
        mtrl_tensor *t = &m.params.items[i];
        real *p = t->ptr, *g = (real *)((char *)m.grads + t->offset);
        int is_patch = !strcmp(t->name, "image.patch_w");
        int probes = is_patch ? 40 : 2;
        for (int k = 0; k < probes && k < (int)t->numel; k++) {
            size_t j = (size_t)(mtrl_rng_u64(7, (uint64_t)i, (uint64_t)k) % t->numel);
            if (is_patch && k < 3) j = (size_t)(k + 1) * (3 * P * P + 4) - 3 + (size_t)k; // the specials' columns
            real keep = p[j];
            double h = 1e-5;
            p[j] = keep + h;
            double Lp = loss_(&m, &b, c, 0);
            p[j] = keep - h;
            double Lm = loss_(&m, &b, c, 0);
            p[j] = keep;
            double fd = (Lp - Lm) / (2 * h);
            double err = fabs(fd - g[j]) / fmax(fabs(fd) + fabs(g[j]), 1e-3);
            checked++;
            if (err > 1e-5) {
                bad++;
                fprintf(stderr, "  %s[%zu]: analytic %.10g, finite difference %.10g\n", t->name, j, (double)g[j], fd);
            }
            if (err > worst) worst = err;
            if (is_patch && err > worst_patch) worst_patch = err;
        }
    }
    // the patch embedding carries real gradient
    double gnorm = 0;
    for (int j = 0; j < d.d * (3 * P * P + 4); j++) gnorm += fabs((double)m.G.patch_w[j]);
    printf("image gradcheck: %d entries, worst relative error %.3g (patch embedding %.3g), |dW_patch|_1 %.3g\n",
           checked, worst, worst_patch, gnorm);
    TEST_EQ_INT(bad, 0);
    TEST_CHECK(gnorm > 1e-3);
    // the text embedding's row 0 (what image ids map to inside embedding_fwd) gets only what the
    // text tokens 0 give it: with no token 0 in the text, nothing
    uint32_t t2[64];
    int n2 = 0;
    for (int i = 0; i < 4; i++) t2[n2++] = 1 + (uint32_t)i;
    mtrl_image_tokens(3, 4, P, 0, t2 + n2);
    n2 += (int)mtrl_image_token_count(3, 4, P);
    t2[n2++] = 5;
    const uint32_t *tt[1] = {t2};
    mtrl_batch b2 = {1, tt, &n2, NULL};
    m.replay_routing = 0;
    mtrl_model_zero_grads(&m);
    loss_(&m, &b2, c, 1);
    double row0 = 0;
    for (int j = 0; j < d.d; j++) row0 += fabs((double)m.G.embed[j]);
    TEST_CHECKF(row0 == 0, "text embedding row 0 got %.3g from image positions", row0);
    free(rout[0]);
    free(rout[1]);
    free(c);
    free(logp);
    free(pc.table);
    mtrl_model_free(&m);
}

static void test_forms(void) {
    mtrl_model_dims d = dims_("KMKM");
    mtrl_model m;
    mtrl_model_init(&m, &d, 13);
    test_model_perturb(&m, 7);
    pics pc;
    pics_make_(&pc);
    mtrl_model_set_patches(&m, pc.table, pc.n);
    uint32_t tok[64], tk2[64];
    int T = seq_make_(tok, 3, 5, 3, 4, 1), T2 = seq_make_(tk2, 4, 2, 6, 1, 0);
    real *full = malloc(sizeof(real) * (size_t)T * V), *seg = malloc(sizeof(real) * (size_t)T * V);
    mtrl_model_logits(&m, tok, T, 0, full);
    double worst_seg = 0;
    for (int s = 3; s <= 16; s += 13) {
        mtrl_model_logits(&m, tok, T, s, seg);
        double e = test_max_rel(seg, full, (size_t)T * V);
        if (e > worst_seg) worst_seg = e;
    }
    // prefill up to inside the first picture, decode the rest (image tokens too)
    int split = 5 + 3;
    mtrl_decode_state st;
    mtrl_decode_state_init(&st, &m, T);
    real last[V], lg[V];
    mtrl_model_prefill(&m, &st, tok, split, last, NULL);
    double worst_dec = test_max_rel(last, full + (size_t)(split - 1) * V, V);
    for (int t = split; t < T; t++) {
        mtrl_decode_state *one[1] = {&st};
        mtrl_model_decode(&m, one, 1, &tok[t], lg, NULL);
        double e = test_max_rel(lg, full + (size_t)t * V, V);
        if (e > worst_dec) worst_dec = e;
    }
    // two sequences prefilled at once == each alone
    real *full2 = malloc(sizeof(real) * (size_t)T2 * V);
    mtrl_model_logits(&m, tk2, T2, 0, full2);
    mtrl_decode_state a, bb;
    mtrl_decode_state_init(&a, &m, T);
    mtrl_decode_state_init(&bb, &m, T2);
    mtrl_decode_state *sts[2] = {&a, &bb};
    const uint32_t *pt[2] = {tok, tk2};
    int pl[2] = {T, T2};
    real two[2 * V];
    mtrl_model_prefill_many(&m, sts, 2, pt, pl, two, NULL);
    double worst_many = fmax(test_max_rel(two, full + (size_t)(T - 1) * V, V),
                             test_max_rel(two + V, full2 + (size_t)(T2 - 1) * V, V));
    // a packed batch of both == each alone (log-probs)
    real *lp2 = malloc(sizeof(real) * (size_t)(T + T2)), *lp1 = malloc(sizeof(real) * (size_t)(T + T2));
    mtrl_batch b = {2, pt, pl, NULL};
    mtrl_model_forward(&m, &b, 0, lp2, NULL, NULL);
    mtrl_batch b0 = {1, pt, pl, NULL}, b1 = {1, pt + 1, pl + 1, NULL};
    mtrl_model_forward(&m, &b0, 0, lp1, NULL, NULL);
    mtrl_model_forward(&m, &b1, 0, lp1 + T, NULL, NULL);
    double worst_pack = test_max_rel(lp2, lp1, (size_t)(T + T2));
    printf("image forms (%d + %d tokens): segmented %.3g, prefill+decode %.3g, prefill_many %.3g, packed %.3g\n", T,
           T2, worst_seg, worst_dec, worst_many, worst_pack);
    TEST_CHECK(worst_seg < 1e-10);
    TEST_CHECK(worst_dec < 1e-10);
    TEST_CHECK(worst_many < 1e-10);
    TEST_CHECK(worst_pack < 1e-10);
    // the picture matters: another picture changes the logits after it
    pc.table[0] ^= 0xff;
    real *other = malloc(sizeof(real) * (size_t)T * V);
    mtrl_model_logits(&m, tok, T, 0, other);
    TEST_CHECK(test_max_rel(other + (size_t)(T - 1) * V, full + (size_t)(T - 1) * V, V) > 1e-6);
    TEST_CHECK(test_max_rel(other, full, (size_t)5 * V) < 1e-12); // ... and not the text before it (causal)
    mtrl_decode_state_free(&st);
    mtrl_decode_state_free(&a);
    mtrl_decode_state_free(&bb);
    free(full); free(seg); free(full2); free(lp1); free(lp2); free(other);
    free(pc.table);
    mtrl_model_free(&m);
}

int main(void) {
    test_layout();
    test_gradcheck();
    test_forms();
    return test_report();
}
