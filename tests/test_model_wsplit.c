// mtrl-test: cpu
// The bf16-resident placement of an inference model's weights (model/model_wsplit.h, issue 21):
//   * which tensors keep fp32: vectors and exactly the matrices a non-GEMM op reads (embed,
//     attnres.w/g, the short-conv weights, mla.wkvb); every other matrix is GEMM-only;
//   * every tensor has one place, the blocks are as large as their tensors (256-byte aligned),
//     and the GEMM-only element count equals the matrices' count less the kept ones, computed
//     here from the dims (not from the classifier);
//   * the device bytes of the bf16 form drop, against today's fp32 block + bf16 copy, by at
//     least the GEMM-only matrices' fp32 bytes (printed for tiny and small);
//   * [actor] weights takes fp32|bf16, and the bf16 form is refused off a GPU / without
//     [kernels] gemm = bf16 with a message naming the keys.
#include <stdio.h>
#include <string.h>

#include "common/config.h"
#include "common/tokenizer.h"
#include "model/model.h"
#include "model/model_wsplit.h"
#include "tests/testhelp.h"
#include "tests/testmodel.h"

static void test_classify(void) {
    TEST_CHECK(!mtrl_wsplit_gemm_only("embed", 2));
    TEST_CHECK(!mtrl_wsplit_gemm_only("attnres.w", 2));
    TEST_CHECK(!mtrl_wsplit_gemm_only("attnres.g", 2));
    TEST_CHECK(!mtrl_wsplit_gemm_only("layers.0.kda.conv_q", 2));
    TEST_CHECK(!mtrl_wsplit_gemm_only("layers.10.kda.conv_v", 2));
    TEST_CHECK(!mtrl_wsplit_gemm_only("layers.3.mla.wkvb", 2));
    TEST_CHECK(!mtrl_wsplit_gemm_only("final_norm", 1));
    TEST_CHECK(!mtrl_wsplit_gemm_only("layers.0.kda.A_log", 1));
    TEST_CHECK(mtrl_wsplit_gemm_only("lm_head", 2));
    TEST_CHECK(mtrl_wsplit_gemm_only("layers.0.kda.wq", 2));
    TEST_CHECK(mtrl_wsplit_gemm_only("layers.3.mla.wkva", 2));
    TEST_CHECK(mtrl_wsplit_gemm_only("layers.1.moe.router", 2));
    TEST_CHECK(mtrl_wsplit_gemm_only("layers.1.moe.w1", 3));
    TEST_CHECK(mtrl_wsplit_gemm_only("layers.1.moe.shared_w2", 2));
    TEST_CHECK(mtrl_wsplit_gemm_only("image.patch_w", 2));
}

static void test_layout(const char *name, const char *ini) {
    mtrl_model_dims d = test_model_dims(ini, MTRL_VOCAB);
    TEST_CHECK(d.L > 0);
    mtrl_tt t;
    mtrl_model_param_table(&t, &d);
    mtrl_wsplit s;
    mtrl_wsplit_init(&s, &t);
    TEST_EQ_INT(s.n, t.n);
    size_t f32 = 0, b16 = 0, matrices = 0;
    for (int i = 0; i < t.n; i++) {
        const mtrl_tensor *x = &t.items[i];
        int in32 = s.f32_off[i] != MTRL_WSPLIT_NONE, in16 = s.b16_off[i] != MTRL_WSPLIT_NONE;
        TEST_CHECKF(in32 + in16 == 1, "%s: in %d blocks", x->name, in32 + in16);
        if (x->ndim >= 2) matrices += x->numel;
        if (in32) {
            TEST_CHECK(s.f32_off[i] % 256 == 0 && s.f32_off[i] + 4 * x->numel <= s.f32_bytes);
            f32 += 4 * x->numel;
        } else {
            TEST_CHECK(x->ndim >= 2);
            TEST_CHECK(s.b16_off[i] % 256 == 0 && s.b16_off[i] + 2 * x->numel <= s.b16_bytes);
            b16 += 2 * x->numel;
        }
    }
    TEST_CHECK(s.f32_bytes >= f32 && s.f32_bytes < f32 + 256 * (size_t)t.n);
    TEST_CHECK(s.b16_bytes >= b16 && s.b16_bytes < b16 + 256 * (size_t)t.n);
    // The kept matrices from the dims: embed, AttnRes w and g, 3 convs per KDA layer, wkvb per MLA layer.
    size_t HD = (size_t)d.H * d.D, kept = (size_t)d.V * d.d + (d.attnres ? 2 * (size_t)(2 * d.L + 1) * d.d : 0);
    for (int l = 0; l < d.L; l++)
        kept += d.mixer[l] == 'K' ? 3 * HD * (size_t)d.W : (size_t)d.mH * (d.dn + d.dv) * (size_t)d.dc;
    TEST_CHECKF(s.gemm_numel == matrices - kept, "%s: %zu GEMM-only elements, %zu matrices less %zu kept", name,
                s.gemm_numel, matrices, kept);
    TEST_CHECK(2 * s.gemm_numel == b16);
    size_t today = mtrl_wsplit_device_bytes(&t, 1, 0), now = mtrl_wsplit_device_bytes(&t, 1, 1);
    TEST_CHECK(today == t.total + t.total / 2);
    TEST_CHECK(now == s.f32_bytes + s.b16_bytes);
    TEST_CHECK(mtrl_wsplit_device_bytes(&t, 0, 0) == t.total);
    TEST_CHECKF(today - now >= 4 * s.gemm_numel, "%s: the drop %zu < the GEMM matrices' fp32 bytes %zu", name,
                today - now, 4 * s.gemm_numel);
    printf("%s: %zu parameters; device weights with gemm = bf16: fp32 block + bf16 copy %.1f MB, bf16 form %.1f MB "
           "(fp32 %.1f MB of which %.1f MB kept matrices, bf16 %.1f MB); drop %.1f MB >= the GEMM matrices' fp32 %.1f MB\n",
           name, t.total / 4, today / 1e6, now / 1e6, s.f32_bytes / 1e6, 4.0 * kept / 1e6, s.b16_bytes / 1e6,
           (today - now) / 1e6, 4.0 * s.gemm_numel / 1e6);
    mtrl_wsplit_free(&s);
    mtrl_tt_free(&t);
}

static void test_refused(void) {
    mtrl_model_dims d = test_model_dims("preset = tiny\n", MTRL_VOCAB);
    mtrl_model m;
    mtrl_error err;
    TEST_EQ_INT(mtrl_model_init_infer_bf16_on(&m, &d, 1, MTRL_DEVICE_CPU, 0, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "[kernels] gemm = bf16");
    TEST_CONTAINS(err.msg, "[actor] weights = bf16");
    d.kern.gemm = MTRL_KGEMM_FP32;
    TEST_EQ_INT(mtrl_model_init_infer_bf16_on(&m, &d, 1, MTRL_DEVICE_CUDA, 0, &err), MTRL_ERR_USAGE);
    mtrl_model_free(&m); // zeroed by the refusal: a no-op
}

static void test_config(void) {
    mtrl_config cfg;
    mtrl_config_errors errs = {0};
    TEST_EQ_INT(mtrl_config_load_text(&cfg, "x.ini", "[env]\nname = calc\n", NULL, 0, &errs), MTRL_OK);
    TEST_EQ_STR(cfg.actor.weights, "fp32");
    mtrl_config_errors_free(&errs);
    TEST_EQ_INT(mtrl_config_load_text(&cfg, "x.ini",
                                      "[env]\nname = calc\n[model]\ndevice = cuda\n[kernels]\ngemm = bf16\n"
                                      "[actor]\nweights = bf16\n",
                                      NULL, 0, &errs),
                MTRL_OK);
    TEST_EQ_STR(cfg.actor.weights, "bf16");
    mtrl_config_errors_free(&errs);
    // without bf16 GEMMs (or off a GPU) the form cannot be: refused when the config loads
    TEST_CHECK(mtrl_config_load_text(&cfg, "x.ini", "[env]\nname = calc\n[model]\ndevice = cuda\n[actor]\nweights = bf16\n",
                                     NULL, 0, &errs) != MTRL_OK);
    TEST_CHECK(errs.n > 0);
    if (errs.n > 0) TEST_CONTAINS(errs.msgs[0], "[kernels] gemm = bf16");
    mtrl_config_errors_free(&errs);
    TEST_CHECK(mtrl_config_load_text(&cfg, "x.ini", "[env]\nname = calc\n[actor]\nweights = fp16\n", NULL, 0, &errs) !=
               MTRL_OK);
    TEST_CHECK(errs.n > 0);
    if (errs.n > 0) TEST_CONTAINS(errs.msgs[0], "weights");
    mtrl_config_errors_free(&errs);
}

int main(void) {
    test_classify();
    test_layout("tiny", "preset = tiny\nhybrid = KKMK\n");
    test_layout("tiny, no AttnRes, image patches", "preset = tiny\nattnres = false\nimage_patch = 4\n");
    test_layout("small", "preset = small\n");
    test_refused();
    test_config();
    return test_report();
}
