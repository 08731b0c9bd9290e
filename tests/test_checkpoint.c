// mtrl-test: cpu
// Checkpoints (safetensors) of the fp32 backbone on the `tiny` preset:
//  - a save/load round trip is bit-exact (parameters, AdamW moments, QB β, step, version);
//  - train one step, save, load into a fresh model, train the next step == two steps without
//    the save, bit for bit (docs/model.md §8 I11);
//  - a checkpoint of another shape is refused naming the first mismatching tensor, and the
//    model is left untouched; torn and corrupt files are refused with a precise message;
//  - published weights round-trip through memory.
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/checkpoint.h"
#include "common/config.h"
#include "model/model.h"
#include "model/qb.h"
#include "common/rng.h"
#include "common/tokenizer.h"
#include "tests/testhelp.h"

static mtrl_model_dims tiny_dims(const char *extra) {
    mtrl_config cfg;
    char text[256];
    snprintf(text, sizeof text, "[env]\nname = calc\n[model]\npreset = tiny\n%s", extra);
    mtrl_config_errors errs = {0};
    mtrl_config_load_text(&cfg, "t", text, NULL, 0, &errs);
    mtrl_config_errors_free(&errs);
    mtrl_model_dims d;
    mtrl_model_dims_from_config(&d, &cfg, MTRL_VOCAB, NULL);
    return d;
}

static void train_step(mtrl_model *m, uint64_t seed) {
    enum { NS = 2, T = 24 };
    uint32_t tok[NS][T];
    const uint32_t *toks[NS];
    int len[NS];
    for (int i = 0; i < NS; i++) {
        for (int t = 0; t < T; t++) tok[i][t] = (uint32_t)(mtrl_rng_u64(seed, (uint64_t)i, (uint64_t)t) % 256);
        toks[i] = tok[i];
        len[i] = T - 3 * i;
    }
    mtrl_batch b = {NS, toks, len, NULL};
    real logp[NS * T], c[NS * T];
    for (int t = 0; t < NS * T; t++) c[t] = (real)mtrl_rng_normal(seed, 77, (uint64_t)t);
    mtrl_model_zero_grads(m);
    mtrl_model_forward(m, &b, 0, logp, NULL, NULL);
    mtrl_model_backward(m, &b, c, NULL);
    mtrl_model_optimizer_step(m, (real)1e-2, (real)0.9, (real)0.95, (real)1e-8, (real)0.01, (real)1.0);
    mtrl_qb_apply(m);
    m->version++;
}

static int same_state(const mtrl_model *a, const mtrl_model *b) {
    size_t n = a->params.total;
    size_t LE = sizeof(real) * (size_t)a->dims.L * (size_t)a->dims.E;
    return !memcmp(a->params.base, b->params.base, n) && !memcmp(a->adam_m, b->adam_m, n) &&
           !memcmp(a->adam_v, b->adam_v, n) && !memcmp(a->qb_beta, b->qb_beta, LE) && a->step == b->step &&
           a->version == b->version;
}

int main(void) {
    char dir[] = "/tmp/mtrl-ckpt-XXXXXX";
    TEST_CHECK(mkdtemp(dir) != NULL);
    char path[256], bad[256];
    snprintf(path, sizeof path, "%s/step1.safetensors", dir);
    snprintf(bad, sizeof bad, "%s/bad.safetensors", dir);
    mtrl_model_dims d = tiny_dims("");
    mtrl_error err;

    // Reference: two steps in one go.
    mtrl_model ref;
    mtrl_model_init(&ref, &d, 3);
    train_step(&ref, 100);
    train_step(&ref, 101);

    // One step, save, load into a fresh model, one more step.
    mtrl_model a, b;
    mtrl_model_init(&a, &d, 3);
    train_step(&a, 100);
    const char *meta[] = {"config_hash", "0123456789abcdef", "seed", "3"};
    TEST_EQ_INT(mtrl_model_save(&a, path, NULL, NULL, 1, meta, 2, &err), MTRL_OK);
    TEST_CHECK(access(path, F_OK) == 0);
    char tmp[300];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    TEST_CHECK(access(tmp, F_OK) != 0); // the temporary file was renamed away
    mtrl_model_init(&b, &d, 99); // different init: everything must come from the file
    mtrl_ckpt c;
    TEST_EQ_INT(mtrl_ckpt_open_file(&c, path, &err), MTRL_OK);
    TEST_EQ_STR(mtrl_ckpt_meta(&c, "config_hash"), "0123456789abcdef");
    TEST_EQ_STR(mtrl_ckpt_meta(&c, "step"), "1");
    TEST_EQ_INT(mtrl_model_load(&b, &c, 1, &err), MTRL_OK);
    mtrl_ckpt_close(&c);
    TEST_CHECK(same_state(&a, &b)); // round trip is bit-exact
    train_step(&b, 101);
    TEST_CHECK(same_state(&ref, &b)); // resume == no save, bit for bit
    TEST_EQ_INT(b.step, 2);

    // A model of another shape refuses the checkpoint, naming the tensor, and stays untouched.
    mtrl_model_dims d2 = tiny_dims("d_model = 48\n");
    mtrl_model other;
    mtrl_model_init(&other, &d2, 5);
    void *before = malloc(other.params.total);
    memcpy(before, other.params.base, other.params.total);
    TEST_EQ_INT(mtrl_ckpt_open_file(&c, path, &err), MTRL_OK);
    TEST_EQ_INT(mtrl_model_load(&other, &c, 1, &err), MTRL_ERR_MISMATCH);
    TEST_CONTAINS(err.msg, "tensor embed is F32 [264,64], the model expects F32 [264,48]");
    mtrl_ckpt_close(&c);
    TEST_CHECK(memcmp(before, other.params.base, other.params.total) == 0);
    free(before);

    // Torn file: every cut of the file is refused, never loaded.
    FILE *f = fopen(path, "rb");
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *bytes = malloc((size_t)size);
    TEST_EQ_INT(fread(bytes, 1, (size_t)size, f), size);
    fclose(f);
    long cuts[] = {0, 4, 12, 200, size / 2, size - 1};
    for (int i = 0; i < 6; i++) {
        f = fopen(bad, "wb");
        fwrite(bytes, 1, (size_t)cuts[i], f);
        fclose(f);
        mtrl_model x;
        mtrl_model_init(&x, &d, 1);
        mtrl_status st = mtrl_ckpt_open_file(&c, bad, &err);
        if (st == MTRL_OK) {
            st = mtrl_model_load(&x, &c, 1, &err);
            mtrl_ckpt_close(&c);
        }
        TEST_CHECKF(st != MTRL_OK, "a file cut at %ld of %ld bytes loaded", cuts[i], size);
        TEST_CONTAINS(err.msg, bad);
        mtrl_model_free(&x);
    }
    // Corrupt header byte.
    f = fopen(bad, "wb");
    bytes[20] = '#';
    fwrite(bytes, 1, (size_t)size, f);
    fclose(f);
    TEST_CHECK(mtrl_ckpt_open_file(&c, bad, &err) == MTRL_ERR_FORMAT);
    TEST_CONTAINS(err.msg, "bad safetensors header");
    free(bytes);

    // Published weights through memory: parameters and β only.
    void *mem;
    size_t mem_len;
    TEST_EQ_INT(mtrl_model_save(&b, NULL, &mem, &mem_len, 0, NULL, 0, &err), MTRL_OK);
    mtrl_model w;
    mtrl_model_init(&w, &d, 42);
    TEST_EQ_INT(mtrl_ckpt_open_mem(&c, mem, mem_len, &err), MTRL_OK);
    TEST_EQ_INT(mtrl_model_load(&w, &c, 0, &err), MTRL_OK);
    mtrl_ckpt_close(&c);
    TEST_CHECK(memcmp(w.params.base, b.params.base, b.params.total) == 0);
    TEST_CHECK(memcmp(w.qb_beta, b.qb_beta, sizeof(real) * (size_t)d.L * d.E) == 0);
    TEST_EQ_INT(w.version, b.version);
    free(mem);

    // ... and as bf16 matrices (publish_dtype = bf16): half the bytes; matrices come back as
    // their bf16 rounding (nearest even: relative error <= 2^-8, the unit roundoff of an 8-bit
    // significand), vectors and β exactly.
    size_t full_len = mem_len;
    TEST_EQ_INT(mtrl_model_save_bf16(&b, &mem, &mem_len, &err), MTRL_OK);
    printf("published weights: %zu bytes fp32, %zu bytes with bf16 matrices\n", full_len, mem_len);
    TEST_CHECK(mem_len < full_len * 6 / 10);
    mtrl_model w2;
    mtrl_model_init(&w2, &d, 43);
    TEST_EQ_INT(mtrl_ckpt_open_mem(&c, mem, mem_len, &err), MTRL_OK);
    TEST_CHECK(c.t[mtrl_ckpt_find(&c, "lm_head")].dtype == MTRL_DT_BF16);
    TEST_EQ_INT(mtrl_model_load(&w2, &c, 0, &err), MTRL_OK);
    // Optimizer state never comes from bf16: a training resume of this blob is refused.
    TEST_CHECK(mtrl_model_load(&w2, &c, 1, &err) != MTRL_OK);
    mtrl_ckpt_close(&c);
    double worst = 0;
    int vec_exact = 1, changed = 0;
    for (int i = 0; i < b.params.n; i++) {
        const mtrl_tensor *t = &b.params.items[i];
        const real *x = (const real *)((const char *)b.params.base + t->offset);
        const real *y = (const real *)((const char *)w2.params.base + t->offset);
        for (size_t k = 0; k < t->numel; k++) {
            if (t->ndim < 2) vec_exact &= x[k] == y[k];
            else if (x[k] != 0) {
                double r = fabs((double)y[k] - (double)x[k]) / fabs((double)x[k]);
                if (r > worst) worst = r;
                changed |= y[k] != x[k];
            }
        }
    }
    printf("bf16 matrices: worst relative rounding %.3g\n", worst);
    TEST_CHECK(worst <= 1.0 / 256 && changed);
    TEST_CHECK(vec_exact);
    TEST_CHECK(memcmp(w2.qb_beta, b.qb_beta, sizeof(real) * (size_t)d.L * d.E) == 0);
    TEST_EQ_INT(w2.version, b.version);
    free(mem);
    mtrl_model_free(&w2);

    mtrl_model_free(&ref);
    mtrl_model_free(&a);
    mtrl_model_free(&b);
    mtrl_model_free(&other);
    mtrl_model_free(&w);
    unlink(path);
    unlink(bad);
    rmdir(dir);
    return test_report();
}
