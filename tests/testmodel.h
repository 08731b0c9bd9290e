// testmodel.h: model dimensions from a few lines of INI, for the model tests (header-only).
#ifndef MTRL_TESTMODEL_H
#define MTRL_TESTMODEL_H

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/config.h"
#include "kernels/ref/kda_ref.h"
#include "model/backend.h"
#include "model/model.h"
#include "model/model_ws.h"
#include "common/rng.h"

// The dims of "[model]\n<model_ini>" (an [env] section is added, as the config requires); a bad
// config prints its errors and returns zeroed dims, which the caller's checks then catch.
static inline mtrl_model_dims test_model_dims(const char *model_ini, int vocab) {
    mtrl_config cfg;
    char text[2048];
    snprintf(text, sizeof text, "[env]\nname = calc\n[model]\n%s", model_ini);
    mtrl_config_errors errs = {0};
    mtrl_status st = mtrl_config_load_text(&cfg, "test", text, NULL, 0, &errs);
    if (st != MTRL_OK) mtrl_config_errors_print(&errs, stderr);
    mtrl_config_errors_free(&errs);
    mtrl_model_dims d;
    memset(&d, 0, sizeof d);
    mtrl_error err;
    if (st == MTRL_OK && mtrl_model_dims_from_config(&d, &cfg, vocab, &err) != MTRL_OK) {
        fprintf(stderr, "%s\n", err.msg);
        memset(&d, 0, sizeof d);
    }
    // true fp32 GEMMs on a GPU ([model] gemm = fp32): the tests hold the GPU model to the CPU's
    // fp32; test_cuda_model asks for TF32 through [kernels] gemm = tf32 where it compares the two
    d.gemm_tf32 = 0;
    return d;
}

// With Kimi's unbounded gate (dims.kda_gate): head 0 of every KDA layer decays fast (e^{A_log}
// ~ 12, softplus of ~0.5 and up), so some of its log-decays fall below the factored chunk
// form's -11 (the CPU's token-recurrence path, a GPU's clamp) and others do not. No-op otherwise.
static inline void test_model_fast_decay(mtrl_model *m, uint64_t seed) {
    const mtrl_model_dims *d = &m->dims;
    if (d->kda_gate != MTRL_KDA_GATE_KIMI) return;
    for (int l = 0; l < d->L; l++) {
        mtrl_layer_ptrs *p = &m->P.layer[l];
        if (!p->A_log) continue;
        p->A_log[0] = (real)(log(12.0) + 0.2 * mtrl_rng_normal(seed, 3 + l, 0));
        for (int j = 0; j < d->D; j++) p->dt_bias[j] = (real)(0.5 + 0.5 * mtrl_rng_normal(seed, 60 + l, j));
    }
}

// The smallest KDA log-decay g of the first KDA layer over a sequence (the gate of a chunked
// forward; a CPU model only, whose g are exact unless test_model_clamp_kimi_gate is on) and in
// *below (nullable) how many entries lie under thr: the Kimi tests check that the decay leaves
// the range of a floor.
static inline double test_model_min_decay(mtrl_model *m, const uint32_t *tok, int T, double thr, long *below) {
    mtrl_arena ar;
    mtrl_arena_init(&ar, seg_arena_bytes(&m->dims, T, T, sizeof(real)));
    mtrl_decode_state s;
    mtrl_decode_state_init(&s, m, T);
    seq_io io = {s.kda_S, s.conv, s.latent, s.cap, 0, 0, NULL, NULL};
    seg_cache c;
    seg_forward(m, &ar, SEG_CHUNK, T, tok, &io, NULL, &c);
    double g = 0;
    long n = 0;
    for (int l = 0; l < m->dims.L; l++)
        if (m->dims.mixer[l] == 'K') {
            for (size_t i = 0; i < (size_t)T * m->dims.H * m->dims.D; i++) {
                g = fmin(g, c.layer[l].g[i]);
                n += c.layer[l].g[i] < thr;
            }
            break;
        }
    if (below) *below = n;
    mtrl_decode_state_free(&s);
    mtrl_arena_free(&ar);
    return g;
}

// Non-zero AttnRes queries, key-norm gains, KDA A_log and QB β (initialised at 0 or 1 otherwise),
// so every path of the model carries signal in a comparison. Host parameters only: a model on a
// device needs mtrl_model_to_device afterwards.
static inline void test_model_perturb(mtrl_model *m, uint64_t seed) {
    const mtrl_model_dims *d = &m->dims;
    for (size_t i = 0; m->P.site_w && i < (size_t)(2 * d->L + 1) * d->d; i++) {
        m->P.site_w[i] = (real)(0.5 * mtrl_rng_normal(seed, 1, i));
        m->P.site_g[i] = (real)(1.0 + 0.2 * mtrl_rng_normal(seed, 2, i));
    }
    for (int l = 0; l < d->L; l++)
        if (m->P.layer[l].A_log)
            for (int h = 0; h < d->H; h++) m->P.layer[l].A_log[h] = (real)(0.3 * mtrl_rng_normal(seed, 3 + l, h));
    for (size_t i = (size_t)d->first_dense * d->E; i < (size_t)d->L * d->E; i++)
        m->qb_beta[i] = (real)(0.05 * mtrl_rng_normal(seed, 90, i));
    test_model_fast_decay(m, seed);
}

// test_cuda_model's `reduced small` case (KMKM, d 256, KDA 2 x 128, MLA 4 heads, latent 256 + 32,
// 16 experts top-4, one shared expert), vocabulary 512.
#define TEST_INI_REDUCED_SMALL                                                                          \
    "preset = custom\nlayers = 4\nd_model = 256\nhybrid = KMKM\nkda_heads = 2\nkda_head_dim = 128\n"      \
    "mla_heads = 4\nmla_nope_dim = 64\nmla_rope_dim = 32\nmla_v_dim = 64\nmla_latent_dim = 256\n"          \
    "dense_inter = 512\nexperts = 16\ntop_k = 4\nshared_experts = 1\nexpert_inter = 128\nattnres_block = 2\n"

// The AdamW learning rate of the one step test_cuda_model's bf16 weight-copy check and
// test_model_gemm_emu take (both models from the same fp32 gradients): 1e-3, a large RL step.
// At 1e-2 the first AdamW step (about lr times the gradient's sign on every weight) turns the
// random-init model into one whose bf16 forward is far more sensitive: the H200 measured bf16 vs
// fp32 log-probs 0.012-0.073 after it (0.0009 before), so the check measured that conditioning,
// not whether the weight copy follows the step (which the reload checks prove exactly).
#define TEST_STEP_LR 1e-3f

// max |a - b| / max |b| over n values (a vector's error relative to its largest entry).
static inline double test_max_rel(const real *a, const real *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double x = fabs((double)a[i] - (double)b[i]);
        if (x > num) num = x;
        if (fabs((double)b[i]) > den) den = fabs((double)b[i]);
    }
    return num / (den > 0 ? den : 1);
}

// The CPU backend's Kimi gate clamped at the model's g_min, as a GPU computes it (backend_cuda.c):
// on (1) swaps the gate of the process's one CPU backend, off (0) restores the exact one. With it
// a GPU test compares like with like, and a CPU test measures the clamp's own effect.
typedef void (*test_gate_fwd_fn)(mtrl_backend *, int, int, int, int, const real *, const real *, const real *, real,
                                 real *);
typedef void (*test_gate_bwd_fn)(mtrl_backend *, int, int, int, int, const real *, const real *, const real *, real,
                                 const real *, real *, real *, real *);
static test_gate_fwd_fn test_exact_gate_fwd_;
static test_gate_bwd_fn test_exact_gate_bwd_;
static void test_clamped_gate_fwd_(mtrl_backend *be, int kind, int T, int H, int K, const real *f, const real *A,
                                   const real *b, real g_min, real *g) {
    if (kind == MTRL_KDA_GATE_KIMI) mtrl_ref_kda_gate_kimi_fwd(T, H, K, f, A, b, g_min, g);
    else test_exact_gate_fwd_(be, kind, T, H, K, f, A, b, g_min, g);
}
static void test_clamped_gate_bwd_(mtrl_backend *be, int kind, int T, int H, int K, const real *f, const real *A,
                                   const real *b, real g_min, const real *dg, real *df, real *dA, real *db) {
    if (kind == MTRL_KDA_GATE_KIMI) mtrl_ref_kda_gate_kimi_bwd(T, H, K, f, A, b, g_min, dg, df, dA, db);
    else test_exact_gate_bwd_(be, kind, T, H, K, f, A, b, g_min, dg, df, dA, db);
}
static inline void test_model_clamp_kimi_gate(int on) {
    mtrl_backend *be = mtrl_backend_cpu();
    if (on && be->kda_gate_fwd != test_clamped_gate_fwd_) {
        test_exact_gate_fwd_ = be->kda_gate_fwd;
        test_exact_gate_bwd_ = be->kda_gate_bwd;
        be->kda_gate_fwd = test_clamped_gate_fwd_;
        be->kda_gate_bwd = test_clamped_gate_bwd_;
    } else if (!on && be->kda_gate_fwd == test_clamped_gate_fwd_) {
        be->kda_gate_fwd = test_exact_gate_fwd_;
        be->kda_gate_bwd = test_exact_gate_bwd_;
    }
}

#endif
