// mtrl-test: gpu slow timeout=900
// Million-token learner steps on one GPU: the segmented forward/backward (model.h form 3) against
// the unsegmented one at 64K tokens, and a 1,048,576-token learner step with the segment length
// the memory planner (model/model_plan.h) picks from the card's free memory.
//
// (a) One 65,536-token sequence, segment 0 (one segment, recomputed in the backward) vs segments
//     of 4096 and 8192 with the routing of the unsegmented run replayed (R3, so near-tied experts
//     cannot flip): the loss L = Σ c_t logp_t + Σ e_t entropy_t and every gradient. Tolerances
//     (bf16 attention operands; the kernel rounds its probabilities to bf16 relative to a running
//     maximum that depends on how the queries are split): loss and log-probs 1e-3 relative (L2);
//     the whole gradient vector 2e-2 relative (L2), and max |Δg| / max |g| 2e-2. The worst
//     tensor is printed, not checked. The device's high-water mark of the unsegmented step stays
//     within its plan.
// (b) One 1,048,576-token sequence: mtrl_model_plan_batch (free memory + what the model holds),
//     then forward, backward and one AdamW step with the planned segment. Checks: the step
//     completes with finite log-probs and gradient norm; the backend's high-water mark
//     (allocations + scratch, backend.h mem_info) is within the plan's blocks without the runtime
//     reserve, and that mark plus what the device lost outside the backend (cudaMemGetInfo before
//     the model and after the step, minus what the backend holds then: context, cuBLAS workspace,
//     kernel images) within the plan's total; the plan is not useless (the mark >= 2/3 of it).
//     Printed for docs/perf.md: the plan, forward / backward / AdamW seconds, tokens/s, the
//     attention's share estimated from its FLOPs, the high-water mark and the device-level peak.
//
// The models. Both use the `small` preset's widths (d 1024; KDA 8 heads x 128; MLA nope 128,
// rope 64, v 128, latent 512; dense FFN 2816; 64 experts top-6 + 1 shared of 512; vocabulary 264)
// on 4 layers with AttnRes blocks of 2:
//   (a) KMKM, 8 MLA heads as `small` (MLA before and after KDA layers);
//   (b) KKKM, 2 MLA heads.
// Why not `small` itself at 1M: the absorbed attention's forward costs T² mH (dc + dr + dc) FLOPs
// per MLA layer (perf.md's convention: the causal half of 2 T² H (Dk + Dv)), 9.6e15 for T = 2^20
// and 8 heads; a learner step runs it in the forward and again in the backward's recompute, plus
// the backward (fwd+bwd = 3.5x the forward). At the kernel's measured 120 TFLOP/s forward and
// 63 fwd+bwd (docs/perf.md, absorbed MLA at 32K) that is 80 + 530 s per layer: ~30 minutes for
// small's 3 MLA layers. One MLA layer with 2 heads: 2.4e15 FLOPs, ~20 + 133 s. The rest of the
// 4-layer model (fp32 cuBLAS GEMMs at ~16 TFLOP/s, perf.md; ~0.46 GFLOP per token for forward,
// recompute and backward) adds ~30 s, the KDA chunk kernels a few seconds: about 3 minutes.
//
// What one H200 measured: docs/perf.md, "Measurements moved out of code comments" (and "A million-token learner step on one GPU").
//
// argv[1] (optional): "a" or "b" runs that part alone. Exits 77 without a CUDA device (or in a
// build without CUDA).
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "model/model.h"
#include "model/qb.h"
#include "model/model_plan.h"
#include "model/model_ws.h"
#include "common/rng.h"
#include "common/timeutil.h"
#include "common/tokenizer.h"
#include "tests/testhelp.h"
#include "tests/testmodel.h"

_Static_assert(!REAL_IS_F64, "the GPU model is the fp32 build");

#define SMALL_WIDTHS                                                                                          \
    "preset = custom\nlayers = 4\nd_model = 1024\nkda_heads = 8\nkda_head_dim = 128\nmla_nope_dim = 128\n"   \
    "mla_rope_dim = 64\nmla_v_dim = 128\nmla_latent_dim = 512\ndense_inter = 2816\nexperts = 64\ntop_k = 6\n" \
    "shared_experts = 1\nexpert_inter = 512\nattnres_block = 2\n"

static const double GIB = 1073741824.0;

static mtrl_model_dims dims_(const char *model_ini) { return test_model_dims(model_ini, MTRL_VOCAB); }

// A model on GPU 0 with every path carrying signal: non-zero AttnRes queries and key-norm gains,
// KDA A_log and QB β (initialised at 0 or 1 otherwise). 0 when it cannot be created.
static int model_(mtrl_model *m, const mtrl_model_dims *d, uint64_t seed) {
    mtrl_error err;
    if (mtrl_model_init_on(m, d, seed, MTRL_DEVICE_CUDA, 0, &err) != MTRL_OK) {
        fprintf(stderr, "model: %s\n", err.msg);
        return 0;
    }
    test_model_perturb(m, seed);
    mtrl_model_to_device(m);
    return 1;
}

// Random tokens and loss coefficients: c_t = -(0.5 + u)/T (a mean negative log-likelihood with
// random weights, so the loss does not cancel), e_t = 0.1 N(0,1)/T on the entropies.
typedef struct episode {
    int T;
    uint32_t *tok;
    real *c, *e, *logp, *ent;
} episode;

static void episode_make_(episode *x, int T, uint64_t seed) {
    x->T = T;
    x->tok = malloc(sizeof(uint32_t) * (size_t)T);
    x->c = malloc(sizeof(real) * (size_t)T);
    x->e = malloc(sizeof(real) * (size_t)T);
    x->logp = calloc((size_t)T, sizeof(real));
    x->ent = calloc((size_t)T, sizeof(real));
    for (int t = 0; t < T; t++) {
        x->tok[t] = (uint32_t)(mtrl_rng_u64(seed, 1, (uint64_t)t) % MTRL_VOCAB);
        x->c[t] = (real)(-(0.5 + mtrl_rng_uniform(seed, 2, (uint64_t)t)) / T);
        x->e[t] = (real)(0.1 * mtrl_rng_normal(seed, 3, (uint64_t)t) / T);
    }
}

static void episode_free_(episode *x) {
    free(x->tok);
    free(x->c);
    free(x->e);
    free(x->logp);
    free(x->ent);
}

static double loss_(const episode *x) {
    double L = 0;
    for (int t = 0; t < x->T; t++) L += (double)x->c[t] * x->logp[t] + (double)x->e[t] * x->ent[t];
    return L;
}

static int finite_(const real *a, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite((double)a[i])) return 0;
    return 1;
}

// Bytes the backend holds now: the model's blocks, the batch workspace and both scratches.
static size_t held_now_(const mtrl_model *m, size_t scratch) {
    return 4 * m->params.total + sizeof(real) * (size_t)m->dims.L * m->dims.E + sizeof(double) * 256 +
           ws_held_bytes(m) + scratch;
}

// Attention forward FLOPs of the step's MLA layers over a causal sequence of T tokens.
static double attn_flops_(const mtrl_model_dims *d, double T) {
    return (double)model_n_mla(d) * T * T * d->mH * (2.0 * d->dc + d->dr);
}

// ---- (a) segmented == unsegmented at 64K --------------------------------------------------------------

static void test_segmented_(void) {
    enum { T = 65536 };
    mtrl_model_dims d = dims_(SMALL_WIDTHS "hybrid = KMKM\nmla_heads = 8\n");
    printf("== (a) %d tokens, layers %s, d %d, MLA %d heads, %d experts top-%d\n", T, d.mixer, d.d, d.mH, d.E, d.k);
    mtrl_model m;
    if (!model_(&m, &d, 21)) {
        TEST_CHECK(0);
        return;
    }
    size_t nparam = m.params.total / sizeof(real), total = m.params.total;
    printf("  %zu parameters\n", mtrl_model_param_count(&m));
    episode x;
    episode_make_(&x, T, 5);
    const uint32_t *toks[1] = {x.tok};
    int len[1] = {T};
    size_t rw = (size_t)d.n_moe * d.k;
    uint8_t *rout = calloc((size_t)T * rw + 1, 1);
    uint8_t *routs[1] = {rout};
    mtrl_batch b = {1, toks, len, NULL};

    // Unsegmented, with its own routing recorded.
    mtrl_model_zero_grads(&m);
    double t0 = mtrl_time_mono();
    mtrl_model_forward(&m, &b, 0, x.logp, x.ent, routs);
    double t1 = mtrl_time_mono();
    mtrl_model_backward(&m, &b, x.c, x.e);
    double t2 = mtrl_time_mono();
    mtrl_model_to_host(&m);
    double L0 = loss_(&x);
    real *g0 = malloc(total), *lp0 = malloc(sizeof(real) * T);
    memcpy(g0, m.grads, total);
    memcpy(lp0, x.logp, sizeof(real) * T);
    TEST_CHECK(finite_(lp0, T) && finite_(g0, nparam));
    size_t peak = 0, scratch = 0;
    mtrl_model_mem_info(&m, NULL, NULL, &scratch, &peak);
    mtrl_model_plan p;
    mtrl_model_plan_eval(&p, &d, MTRL_DEVICE_CUDA, 1, len, 0, 0);
    printf("  segment 0: loss %.9g, forward %.2f s, backward %.2f s; backend high-water %.2f GiB, plan without the "
           "runtime reserve %.2f GiB (x%.3f), scratch %.2f GiB planned %.2f\n",
           L0, t1 - t0, t2 - t1, peak / GIB, (p.total - p.runtime) / GIB, (double)peak / (double)(p.total - p.runtime),
           scratch / GIB, p.scratch / GIB);
    TEST_CHECKF(peak <= p.total - p.runtime, "high-water %zu above the plan's %zu", peak, p.total - p.runtime);

    // Segmented, replaying that routing.
    const uint8_t *rc[1] = {rout};
    mtrl_batch br = b;
    br.routing = rc;
    m.replay_routing = 1;
    real *g1 = malloc(total);
    int segs[2] = {4096, 8192};
    for (int s = 0; s < 2; s++) {
        mtrl_model_zero_grads(&m);
        t0 = mtrl_time_mono();
        mtrl_model_forward(&m, &br, segs[s], x.logp, x.ent, NULL);
        t1 = mtrl_time_mono();
        mtrl_model_backward(&m, &br, x.c, x.e);
        t2 = mtrl_time_mono();
        mtrl_model_to_host(&m);
        memcpy(g1, m.grads, total);
        double L1 = loss_(&x), eL = fabs(L1 - L0) / fabs(L0), elp = test_rel_err_f(x.logp, lp0, T);
        double num = 0, den = 0, dmax = 0, gmax = 0;
        for (size_t i = 0; i < nparam; i++) {
            double a = g1[i], r = g0[i];
            num += (a - r) * (a - r);
            den += r * r;
            dmax = fmax(dmax, fabs(a - r));
            gmax = fmax(gmax, fabs(r));
        }
        double eg = sqrt(num) / sqrt(den), em = dmax / gmax;
        double worst = 0;
        const char *wn = "";
        for (int i = 0; i < m.params.n; i++) {
            const mtrl_tensor *t = &m.params.items[i];
            double r = test_rel_err_f((const real *)((const char *)g1 + t->offset),
                                      (const real *)((const char *)g0 + t->offset), t->numel);
            if (!(r <= worst)) {
                worst = r;
                wn = t->name;
            }
        }
        printf("  segment %d (%d segments): forward %.2f s, backward %.2f s; loss %.9g (rel %.3g), logp rel %.3g, "
               "gradient rel L2 %.3g, max |dg| / max |g| %.3g (%.3g / %.3g), worst tensor %s %.3g\n",
               segs[s], T / segs[s], t1 - t0, t2 - t1, L1, eL, elp, eg, em, dmax, gmax, wn, worst);
        TEST_CHECK(finite_(x.logp, T) && finite_(g1, nparam));
        TEST_CHECKF(eL <= 1e-3, "segment %d: loss rel %.3g", segs[s], eL);
        TEST_CHECKF(elp <= 1e-3, "segment %d: logp rel %.3g", segs[s], elp);
        TEST_CHECKF(eg <= 2e-2, "segment %d: gradient rel L2 %.3g", segs[s], eg);
        TEST_CHECKF(em <= 2e-2, "segment %d: max gradient difference %.3g of the largest", segs[s], em);
    }
    free(g0);
    free(g1);
    free(lp0);
    free(rout);
    episode_free_(&x);
    mtrl_model_free(&m);
}

// ---- (b) a 1M-token learner step with the planned segment ----------------------------------------------

static void test_million_(void) {
    enum { T = 1 << 20 };
    mtrl_model_dims d = dims_(SMALL_WIDTHS "hybrid = KKKM\nmla_heads = 2\n");
    printf("== (b) %d tokens, layers %s, d %d, MLA %d heads, %d experts top-%d\n", T, d.mixer, d.d, d.mH, d.E, d.k);
    size_t free0 = 0, tot = 0;
    mtrl_error err;
    TEST_EQ_INT(mtrl_model_device_memory(MTRL_DEVICE_CUDA, 0, &free0, &tot, &err), MTRL_OK);
    printf("  device: %.2f GiB free of %.2f before the model\n", free0 / GIB, tot / GIB);
    mtrl_model m;
    if (!model_(&m, &d, 22)) {
        TEST_CHECK(0);
        return;
    }
    printf("  %zu parameters\n", mtrl_model_param_count(&m));
    episode x;
    episode_make_(&x, T, 6);
    const uint32_t *toks[1] = {x.tok};
    int len[1] = {T};
    mtrl_batch b = {1, toks, len, NULL};
    mtrl_model_plan p;
    mtrl_status st = mtrl_model_plan_batch(&p, &m, &b, &err);
    TEST_EQ_INT(st, MTRL_OK);
    if (st != MTRL_OK) fprintf(stderr, "%s\n", err.msg);
    mtrl_model_plan_print(&p, stdout);
    if (st != MTRL_OK) {
        episode_free_(&x);
        mtrl_model_free(&m);
        return;
    }
    mtrl_model_zero_grads(&m);
    double t0 = mtrl_time_mono();
    mtrl_model_forward(&m, &b, p.segment, x.logp, x.ent, NULL);
    double t1 = mtrl_time_mono();
    mtrl_model_backward(&m, &b, x.c, x.e);
    double t2 = mtrl_time_mono();
    double gnorm = mtrl_model_optimizer_step(&m, (real)1e-4, (real)0.9, (real)0.95, (real)1e-8, (real)0.1, (real)1);
    double t3 = mtrl_time_mono();
    mtrl_qb_apply(&m);
    size_t free1 = 0, scratch = 0, peak = 0;
    mtrl_model_mem_info(&m, &free1, NULL, &scratch, &peak);
    size_t held = held_now_(&m, scratch), lost = free0 > free1 ? free0 - free1 : 0;
    size_t outside = lost > held ? lost - held : 0, dev_peak = peak + outside;
    size_t planned = p.total - p.runtime;
    double fa = attn_flops_(&d, T);
    printf("  learner step of %d tokens, segment %d: forward %.1f s, backward %.1f s (recompute included), "
           "AdamW %.2f s; %.0f tokens/s forward, %.0f tokens/s step; loss %.6g, gradient norm %.6g\n",
           T, p.segment, t1 - t0, t2 - t1, t3 - t2, T / (t1 - t0), T / (t3 - t0), loss_(&x), gnorm);
    printf("  attention: %.3g FLOPs forward (x2 with the recompute, + 2.5x in the backward); at the forward's "
           "time that alone would be %.0f TFLOP/s\n",
           fa, fa / (t1 - t0) / 1e12);
    printf("  memory: backend high-water %.2f GiB (plan without the runtime reserve %.2f, x%.3f); scratch %.2f GiB "
           "(planned %.2f); outside the backend %.2f GiB (reserve %.2f); device-level peak %.2f GiB of the plan's "
           "%.2f; free after the step %.2f GiB\n",
           peak / GIB, planned / GIB, (double)peak / (double)planned, scratch / GIB, p.scratch / GIB, outside / GIB,
           p.runtime / GIB, dev_peak / GIB, p.total / GIB, free1 / GIB);
    TEST_CHECK(finite_(x.logp, T) && finite_(x.ent, T) && isfinite(gnorm) && gnorm > 0);
    TEST_CHECKF(peak <= planned, "high-water %zu above the plan's %zu", peak, planned);
    TEST_CHECKF(dev_peak <= p.total, "device-level peak %zu above the plan's total %zu", dev_peak, p.total);
    TEST_CHECKF(3 * peak >= 2 * planned, "high-water %zu is below 2/3 of the plan %zu", peak, planned);
    episode_free_(&x);
    mtrl_model_free(&m);
}

int main(int argc, char **argv) {
    const char *only = argc > 1 ? argv[1] : "";
    if (mtrl_model_cuda_devices() == 0) test_skip("no CUDA device (or a build without CUDA)");
    if (!*only || !strcmp(only, "a")) test_segmented_();
    if (!*only || !strcmp(only, "b")) test_million_();
    return test_report();
}
