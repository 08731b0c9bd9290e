// mtrl-test: cpu f64
// mtrl's Kimi Linear layer forms (docs/model-forms.md) against the reference implementation,
// transformers 5.17's KimiLinearForCausalLM, run in float64. tests/fixtures/kimi/kimi_tiny.bin
// (tools/make_kimi_forms_fixture.py) is a tiny random Kimi Linear: 4 layers KKMK, two dense
// layers, sigmoid router with e_score_correction_bias, one KDA head per layer decaying far below
// -11. The file holds its weights under mtrl's names and its logits for 45 tokens, with
// moe_renormalize on and off.
//  - every tensor of the mtrl model with the Kimi forms is in the file, with the same element
//    count, and the file has no other tensor;
//  - logits of the chunked form, the segmented form (segment 16) and prefill + decode match
//    transformers' to 1e-11 of the largest logit, with router_renorm true and false;
//  - the MLA latent norm's epsilon matters: with mla_kv_norm_eps left at norm_eps (1e-5 instead
//    of Kimi's 1e-6) the logits move by more than 1e-7.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "tests/testhelp.h"
#include "tests/testmodel.h"

_Static_assert(REAL_IS_F64, "this test needs the fp64 build");

enum { V = 32, TMAX = 64 };

typedef struct fixture {
    FILE *f;
    long params; // file offset of the tensors
    int T;
    uint32_t tok[TMAX];
    double beta[4 * 4];
    double *logits[2]; // [T][V], renormalised then not
} fixture;

static int read_(FILE *f, void *p, size_t size, size_t n) { return fread(p, size, n, f) == n; }

// Reads the tokens, β and logits; leaves the tensors for load_().
static int fixture_open_(fixture *x, const char *path) {
    memset(x, 0, sizeof *x);
    x->f = fopen(path, "rb");
    if (!x->f) return 0;
    int n;
    if (!read_(x->f, &n, 4, 1)) return 0;
    x->params = ftell(x->f);
    for (int i = 0; i < n; i++) {
        char name[64];
        long long numel;
        if (!read_(x->f, name, 64, 1) || !read_(x->f, &numel, 8, 1) || fseek(x->f, numel * 8, SEEK_CUR)) return 0;
    }
    if (!read_(x->f, x->beta, 8, 16) || !read_(x->f, &x->T, 4, 1) || x->T < 1 || x->T > TMAX) return 0;
    int32_t tk[TMAX];
    if (!read_(x->f, tk, 4, (size_t)x->T)) return 0;
    for (int t = 0; t < x->T; t++) x->tok[t] = (uint32_t)tk[t];
    for (int r = 0; r < 2; r++) {
        x->logits[r] = malloc(sizeof(double) * (size_t)x->T * V);
        if (!read_(x->f, x->logits[r], 8, (size_t)x->T * V)) return 0;
    }
    return 1;
}

// The file's tensors into m by name; 0 (with a message) when one is missing or mis-sized.
static int load_(fixture *x, mtrl_model *m) {
    fseek(x->f, x->params - 4, SEEK_SET);
    int n, ok = 1;
    if (!read_(x->f, &n, 4, 1)) return 0;
    for (int i = 0; i < n; i++) {
        char name[64];
        long long numel;
        if (!read_(x->f, name, 64, 1) || !read_(x->f, &numel, 8, 1)) return 0;
        name[63] = '\0';
        int j = mtrl_tt_find(&m->params, name);
        if (j < 0 || (long long)m->params.items[j].numel != numel) {
            fprintf(stderr, "  fixture tensor %s (%lld elements): %s in the model\n", name, numel,
                    j < 0 ? "not" : "another size");
            ok = 0;
            fseek(x->f, numel * 8, SEEK_CUR);
            continue;
        }
        if (!read_(x->f, m->params.items[j].ptr, 8, (size_t)numel)) return 0;
    }
    TEST_CHECKF(n == m->params.n, "the fixture has %d tensors, the model %d", n, m->params.n);
    memcpy(m->qb_beta, x->beta, sizeof x->beta);
    return ok && n == m->params.n;
}

static mtrl_model_dims dims_(int renorm, const char *kv_eps) {
    char ini[1024];
    snprintf(ini, sizeof ini,
             "preset = custom\nlayers = 4\nd_model = 16\nhybrid = KKMK\nkda_heads = 2\nkda_head_dim = 8\n"
             "mla_heads = 2\nmla_nope_dim = 8\nmla_rope_dim = 4\nmla_v_dim = 8\nmla_latent_dim = 12\n"
             "dense_inter = 24\nexperts = 4\ntop_k = 2\nshared_experts = 1\nexpert_inter = 12\nattnres_block = 1\n"
             "conv_kernel = 4\nrho = 2.446\nnorm_eps = 1e-5\n"
             "kda_gate = kimi\ng_min = -8\nattnres = false\ndense_layers = 2\nrouter_bias = score\n"
             "router_renorm = %s\nmla_gate = false\nmla_kv_norm_eps = %s\n",
             renorm ? "true" : "false", kv_eps);
    return test_model_dims(ini, V);
}

// Largest |logit difference| of form k (0 chunked, 1 segmented, 2 prefill 7 then decode).
static double form_err_(mtrl_model *m, const fixture *x, int k, const double *ref, double *lg) {
    int T = x->T;
    if (k < 2) mtrl_model_logits(m, x->tok, T, k ? 16 : 0, lg);
    else {
        mtrl_decode_state s;
        mtrl_decode_state_init(&s, m, T);
        mtrl_model_logits(m, x->tok, 7, 0, lg);
        mtrl_model_prefill(m, &s, x->tok, 7, NULL, NULL);
        for (int t = 7; t < T; t++) {
            mtrl_decode_state *one[1] = {&s};
            mtrl_model_decode(m, one, 1, &x->tok[t], lg + (size_t)t * V, NULL);
        }
        mtrl_decode_state_free(&s);
    }
    double mx = 0;
    for (size_t i = 0; i < (size_t)T * V; i++) mx = fmax(mx, fabs(lg[i] - ref[i]));
    return mx;
}

int main(void) {
    const char *src = getenv("MTRL_SRC");
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/fixtures/kimi/kimi_tiny.bin", src ? src : "..");
    fixture x;
    int opened = fixture_open_(&x, path);
    TEST_CHECKF(opened, "cannot read the fixture %s", path);
    if (!opened) return test_report();
    double *lg = malloc(sizeof(double) * (size_t)x.T * V);
    const char *form[3] = {"chunked", "segmented (16)", "prefill 7 + decode"};
    for (int renorm = 1; renorm >= 0; renorm--) {
        const double *ref = x.logits[renorm ? 0 : 1];
        double scale = 0;
        for (size_t i = 0; i < (size_t)x.T * V; i++) scale = fmax(scale, fabs(ref[i]));
        mtrl_model_dims d = dims_(renorm, "1e-6");
        mtrl_model m;
        mtrl_model_init(&m, &d, 1);
        TEST_CHECK(load_(&x, &m));
        for (int k = 0; k < 3; k++) {
            double e = form_err_(&m, &x, k, ref, lg);
            printf("router_renorm = %s, %s: max |mtrl - transformers| of the logits %.3g (largest logit %.3g)\n",
                   renorm ? "true" : "false", form[k], e, scale);
            TEST_CHECKF(e <= 1e-11 * scale, "%s, renorm %d: logits differ by %.3g", form[k], renorm, e);
        }
        mtrl_model_free(&m);
    }
    // Kimi's kv_a_layernorm takes eps 1e-6 while every other norm takes rms_norm_eps.
    mtrl_model_dims d = dims_(1, "0");
    TEST_CHECK(d.kv_eps == d.eps);
    mtrl_model m;
    mtrl_model_init(&m, &d, 1);
    TEST_CHECK(load_(&x, &m));
    double e = form_err_(&m, &x, 0, x.logits[0], lg);
    printf("MLA latent norm with norm_eps (1e-5) instead of 1e-6: logits differ by %.3g\n", e);
    TEST_CHECKF(e > 1e-7, "the latent norm's epsilon made no difference (%.3g)", e);
    mtrl_model_free(&m);
    free(lg);
    free(x.logits[0]);
    free(x.logits[1]);
    fclose(x.f);
    return test_report();
}
