// mtrl-test: cpu timeout=600
// The memory planner (model/model_plan.h) against what the model really allocates, on
// the fp32 CPU model:
//  - for the `tiny` preset and a reduced config (MLA in the middle, no gate, no shared expert,
//    AttnRes blocks of 3), several (T, S) and a two-sequence batch with segment 0: the planned
//    activation bytes are >= the arena's measured peak (mtrl_model_forward + _backward) and at
//    most 1.5x it; the forward's own peak equals the forward mirror (seg_fwd_bytes: its caches,
//    or the naive MLA form's expanded keys on top of those so far) and the whole step's peak the
//    step mirror (seg_arena_bytes), the most over the segments, both to the arena's 64-byte
//    alignment;
//    the planned boundary states + latents equal the workspace's state bytes plus alignment;
//  - the planned segment is a multiple of 64 (or the whole sequence) and never shrinks as the
//    budget grows; the plan fits its budget minus the margin;
//  - a budget below what the least segment needs gives MTRL_ERR_NOMEM and a message with both
//    numbers (and, MLA trained naive, the absorbed form, which needs less there);
//  - T = 1,048,576 with the `small` preset plans on the CPU and on a GPU budget without size_t
//    overflow (every block sane and consistent), and prints;
//  - prefill (SEG_PREFILL, no caches) peaks exactly at its mirror seg_prefill_bytes, at most
//    half the cached forward of the same segment; in the naive MLA prefill form at the most of
//    its segments' mirrors (the expanded keys so far);
//  - [kernels] gemm = bf16: a GPU plan counts the bf16 weight copy and its operand copies;
//  - the free-memory query and the live-model planning work; `mtrl plan` prints a plan; `mtrl bench
//    long` runs one episode, with a preset or an experiment's model (--config).
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "model/backend.h"
#include "model/model.h"
#include "model/model_plan.h"
#include "model/model_ws.h"
#include "common/rng.h"
#include "common/tokenizer.h"
#include "tests/testhelp.h"
#include "tests/testmodel.h"
#include "tests/testproc.h"

static mtrl_model_dims dims_(const char *model_ini) { return test_model_dims(model_ini, MTRL_VOCAB); }

static const char *reduced_ini_ =
    "preset = custom\nlayers = 5\nd_model = 48\nhybrid = KMKMK\nkda_heads = 2\nkda_head_dim = 16\nmla_heads = 3\n"
    "mla_nope_dim = 8\nmla_rope_dim = 4\nmla_v_dim = 8\nmla_latent_dim = 16\nmla_gate = false\ndense_inter = 40\n"
    "experts = 6\ntop_k = 2\nshared_experts = 0\nexpert_inter = 24\nattnres_block = 3\n";

// One learner step (forward + backward) of a batch on a fresh peak; returns the arena's peak.
static size_t step_peak_(mtrl_model *m, int n, const int *len, int segment, size_t *fwd_peak, size_t *state_bytes) {
    const uint32_t *toks[4];
    uint32_t *buf[4];
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        buf[i] = malloc(sizeof(uint32_t) * (size_t)len[i]);
        for (int t = 0; t < len[i]; t++)
            buf[i][t] = (uint32_t)(mtrl_rng_u64(17, (uint64_t)i, (uint64_t)t) % MTRL_VOCAB);
        toks[i] = buf[i];
        total += (size_t)len[i];
    }
    real *logp = calloc(total, sizeof(real)), *c = malloc(sizeof(real) * total), *e = malloc(sizeof(real) * total);
    for (size_t t = 0; t < total; t++) {
        c[t] = (real)mtrl_rng_normal(18, 1, t);
        e[t] = (real)(0.2 * mtrl_rng_normal(18, 2, t));
    }
    mtrl_batch b = {n, toks, len, NULL};
    m->peak_activation_bytes = 0;
    mtrl_model_forward(m, &b, segment, logp, NULL, NULL);
    *fwd_peak = m->peak_activation_bytes;
    *state_bytes = m->ws->state_bytes;
    mtrl_model_backward(m, &b, c, e);
    for (int i = 0; i < n; i++) free(buf[i]);
    free(logp);
    free(c);
    free(e);
    return m->peak_activation_bytes;
}

// Planned vs measured activations for each (T, S) of one model.
static void test_activations_(const char *name, const char *ini) {
    mtrl_model_dims d = dims_(ini);
    mtrl_model m;
    mtrl_model_init(&m, &d, 3);
    // Non-zero AttnRes queries, so the sites do real work (the sizes do not depend on values).
    for (size_t i = 0; i < (size_t)(2 * d.L + 1) * d.d; i++) m.P.site_w[i] = (real)(0.3 * mtrl_rng_normal(4, 1, i));
    struct { int n, len[2], seg; } cases[] = {
        {1, {256, 0}, 64}, {1, {300, 0}, 128}, {1, {1000, 0}, 192},
        {1, {200, 0}, 0},  {2, {160, 100}, 0}, {2, {333, 77}, 64},
    };
    printf("== %s (%s)\n", name, d.mixer);
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        int n = cases[k].n, seg = cases[k].seg;
        const int *len = cases[k].len;
        size_t fwd_peak, state_bytes;
        size_t peak = step_peak_(&m, n, len, seg, &fwd_peak, &state_bytes);
        mtrl_model_plan p;
        mtrl_model_plan_eval(&p, &d, MTRL_DEVICE_CPU, n, len, seg, 0);
        double ratio = (double)p.activations / (double)peak;
        char lens[64];
        if (n > 1) snprintf(lens, sizeof lens, "%d + %d", len[0], len[1]);
        else snprintf(lens, sizeof lens, "%d", len[0]);
        printf("  %s tokens, segment %3d%s: planned activations %9zu bytes, measured peak %9zu (x%.4f), "
               "forward alone %zu\n",
               lens, seg, p.keep ? " (kept)" : "", p.activations, peak, ratio, fwd_peak);
        TEST_CHECKF(p.activations >= peak && p.activations <= peak + peak / 2,
                    "%s T=%d S=%d: planned %zu vs measured %zu", name, len[0], seg, p.activations, peak);
        if (!p.keep) {
            // One segment's caches, then its backward on top: the mirrors to the 64-byte alignment.
            // The naive MLA form expands every key so far: segment k of a sequence (T_k tokens
            // ending at token e_k) needs seg_arena_bytes(T_k, e_k); the step peaks at the most
            // of them (the planner takes the bound (longest segment, longest sequence)). The
            // first segment takes the remainder (model_run.c seg_span_).
            int S = 1;
            size_t f = 0, fb = 0;
            for (int i = 0; i < n; i++) {
                int s = seg > 0 && seg < len[i] ? seg : len[i];
                if (s > S) S = s;
                int ns = (len[i] + s - 1) / s;
                for (int e = 0, g = 0; g < ns; g++) {
                    int Ts = g ? s : len[i] - (ns - 1) * s, Tk_ = e + Ts;
                    size_t fs = seg_fwd_bytes(&d, Ts, Tk_, m.be->latent_size),
                           as = seg_arena_bytes(&d, Ts, Tk_, m.be->latent_size) - 4096;
                    if (fs > f) f = fs;
                    if (as > fb) fb = as;
                    e = Tk_;
                }
            }
            TEST_CHECKF(f >= fwd_peak && f - fwd_peak < 64, "%s S=%d: forward mirror %zu, measured %zu", name, S, f,
                        fwd_peak);
            TEST_CHECKF(fb >= peak && fb - peak < 64, "%s S=%d: forward + backward mirror %zu, measured %zu", name, S,
                        fb, peak);
        }
        // The state arena: what the workspace counts plus the 64-byte carving and the running state.
        size_t planned_state = p.boundary + p.latents, slack = 64 * (size_t)(3 * n + 2);
        size_t running = sizeof(real) * (size_t)model_n_kda(&d) *
                         ((size_t)d.H * d.D * d.D + (size_t)3 * (d.W - 1) * d.H * d.D);
        TEST_CHECKF(planned_state >= state_bytes + running && planned_state <= state_bytes + running + slack,
                    "%s: planned state %zu vs workspace %zu + running %zu", name, planned_state, state_bytes, running);
    }
    // Prefill keeps no caches for a backward: its scratch peak is the prefill mirror (to the
    // 64-byte alignment) for a prompt longer than one prefill segment, and far below the cached
    // forward of the same segment.
    enum { NP = MTRL_PREFILL_SEGMENT + 300 };
    uint32_t *tok = malloc(sizeof(uint32_t) * NP);
    for (int t = 0; t < NP; t++) tok[t] = (uint32_t)((t * 7 + 3) % d.V);
    mtrl_decode_state s;
    mtrl_decode_state_init(&s, &m, NP);
    m.peak_infer_bytes = 0;
    mtrl_model_prefill(&m, &s, tok, NP, NULL, NULL);
    size_t pf = seg_prefill_bytes(&d, MTRL_PREFILL_SEGMENT, NP, m.be->latent_size),
           cached = seg_fwd_bytes(&d, MTRL_PREFILL_SEGMENT, 0, m.be->latent_size);
    printf("  prefill of %d tokens: scratch peak %zu bytes, mirror %zu (cached forward %zu)\n", NP, m.peak_infer_bytes,
           pf, cached);
    TEST_CHECKF(pf >= m.peak_infer_bytes && pf - m.peak_infer_bytes < 64, "%s: prefill mirror %zu, measured %zu", name,
                pf, m.peak_infer_bytes);
    TEST_CHECKF(pf < cached / 2, "%s: prefill needs %zu, the cached forward %zu", name, pf, cached);
    mtrl_decode_state_free(&s);
    // The naive prefill form ([model] mla_prefill = naive) expands every key so far: its peak is
    // the most of its segments' mirrors (keys up to the end of each).
    if (model_n_mla(&d) > 0) {
        m.dims.mla_prefill_naive = 1;
        mtrl_model_ws_free(&m); // a fresh inference arena: its peak restarts
        mtrl_decode_state_init(&s, &m, NP);
        m.peak_infer_bytes = 0;
        mtrl_model_prefill(&m, &s, tok, NP, NULL, NULL);
        size_t p1 = seg_prefill_bytes(&m.dims, MTRL_PREFILL_SEGMENT, MTRL_PREFILL_SEGMENT, m.be->latent_size),
               p2 = seg_prefill_bytes(&m.dims, NP - MTRL_PREFILL_SEGMENT, NP, m.be->latent_size), pn = p1 > p2 ? p1 : p2;
        printf("  naive prefill of %d tokens: scratch peak %zu bytes, mirror %zu\n", NP, m.peak_infer_bytes, pn);
        TEST_CHECKF(pn >= m.peak_infer_bytes && pn - m.peak_infer_bytes < 64, "%s: naive prefill mirror %zu, measured %zu",
                    name, pn, m.peak_infer_bytes);
        mtrl_decode_state_free(&s);
        m.dims.mla_prefill_naive = 0;
    }
    free(tok);
    mtrl_model_free(&m);
}

static void test_budget_(void) {
    mtrl_model_dims d = dims_("preset = tiny\n");
    int len[3] = {4096, 3000, 1234};
    mtrl_model_plan p;
    mtrl_error err;
    // The least any segment needs: the budget just below fails, with both numbers in the message.
    mtrl_status st = mtrl_model_plan_make(&p, &d, MTRL_DEVICE_CPU, 3, len, (size_t)1 << 20, &err);
    TEST_EQ_INT(st, MTRL_ERR_NOMEM);
    TEST_CONTAINS(err.msg, "needs at least");
    TEST_CONTAINS(err.msg, "the budget is 1.0 MiB");
    printf("below the minimum: %s\n", err.msg);
    size_t least = p.total;
    TEST_CHECK(least > ((size_t)1 << 20));
    // The message names the absorbed MLA training form, which needs less for long sequences (its
    // least segment does not expand the keys of the whole sequence), and only in the naive form.
    TEST_CONTAINS(err.msg, "mla_train = absorbed");
    d.mla_absorbed = 1;
    TEST_EQ_INT(mtrl_model_plan_make(&p, &d, MTRL_DEVICE_CPU, 3, len, (size_t)1 << 20, &err), MTRL_ERR_NOMEM);
    TEST_CHECK(strstr(err.msg, "mla_train") == NULL);
    printf("least: naive %zu bytes, absorbed %zu\n", least, p.total);
    TEST_CHECK(p.total < least);
    d.mla_absorbed = 0;
    // Budgets from the least up: the segment never shrinks, and every plan fits.
    int last = 0, fits = 0, all = len[0] + len[1] + len[2];
    for (double b = (double)least; b < (double)least * 64; b *= 1.07) {
        st = mtrl_model_plan_make(&p, &d, MTRL_DEVICE_CPU, 3, len, (size_t)b, &err);
        if (st != MTRL_OK) {
            TEST_CHECKF(!fits, "budget %.0f fails after a smaller one fitted", b);
            continue;
        }
        fits = 1;
        TEST_CHECKF(p.segment >= last, "budget %.0f: segment %d after %d", b, p.segment, last);
        TEST_CHECK(p.segment % MTRL_PLAN_SEGMENT_STEP == 0 || p.segment == all);
        TEST_CHECK(p.total + p.margin <= p.budget);
        last = p.segment;
    }
    TEST_CHECK(fits);
    // a large budget takes whole sequences, and packs the shorter ones with the longest: one
    // segment of the batch's tokens
    TEST_EQ_INT(last, all);
    printf("budgets %zu .. x64: segment grows to %d\n", least, last);
}

static void test_million_(void) {
    mtrl_model_dims d = dims_("preset = small\n");
    int T = 1 << 20;
    mtrl_model_plan p;
    mtrl_error err;
    size_t gib = (size_t)1 << 30;
    for (int dev = 0; dev < 2; dev++) {
        mtrl_status st = mtrl_model_plan_uniform(&p, &d, dev, T, 1, 130 * gib, &err);
        TEST_EQ_INT(st, MTRL_OK);
        if (st != MTRL_OK) fprintf(stderr, "%s\n", err.msg);
        mtrl_model_plan_print(&p, stdout);
        TEST_CHECK(p.segment >= 64 && p.segment % 64 == 0 && p.segment < T);
        TEST_CHECK((size_t)p.n_seg * (size_t)p.segment >= (size_t)T);
        TEST_CHECK(p.total + p.margin <= 130 * gib && p.total > p.activations && p.activations > gib);
        // latents: n_mla layers x T x (dc + dr) elements of the device's latent type, whole
        size_t lat = mtrl_backend_latent_size(dev, &d.kern) * (size_t)model_n_mla(&d) * (size_t)T * (size_t)(d.dc + d.dr);
        TEST_CHECK(p.latents >= lat && p.latents < lat + 64);
        // the whole sequence as one segment: terabytes, no wrap-around
        mtrl_model_plan w;
        mtrl_model_plan_eval(&w, &d, dev, 1, &T, T, 0);
        printf("  one 1M-token segment: activations %.1f GiB, scratch %.1f GiB\n", (double)w.activations / gib,
               (double)w.scratch / gib);
        TEST_CHECK(w.activations > 1000 * gib && w.activations < ((size_t)1 << 50));
        TEST_CHECK(w.activations / (size_t)T > seg_arena_bytes(&d, 1024, 1024, mtrl_backend_latent_size(dev, &d.kern)) / 1024 / 2);
    }
}

// [kernels] gemm = bf16 (backend.h): a GPU plan adds the bf16 copy of the parameters (2 bytes a
// parameter, half the fp32 block) and sizes the scratch for the GEMMs' bf16 operand copies (the
// LM head's dy [T][V] at least); the other lines are unchanged. A CPU plan has no copy.
static void test_gemm_bf16_(void) {
    mtrl_model_dims d = dims_("preset = small\n");
    int T = 8192;
    mtrl_model_plan f, h, c;
    mtrl_model_plan_eval(&f, &d, MTRL_DEVICE_CUDA, 1, &T, 4096, 0);
    d.kern.gemm = MTRL_KGEMM_BF16;
    mtrl_model_plan_eval(&h, &d, MTRL_DEVICE_CUDA, 1, &T, 4096, 0);
    mtrl_model_plan_eval(&c, &d, MTRL_DEVICE_CPU, 1, &T, 4096, 0);
    d.kern.gemm = MTRL_KGEMM_MODEL;
    printf("small, 8192 tokens in segments of 4096 on a GPU: bf16 weight copy %.2f GiB, scratch %.2f GiB (fp32 "
           "GEMMs %.2f)\n",
           (double)h.weights_bf16 / (1 << 30), (double)h.scratch / (1 << 30), (double)f.scratch / (1 << 30));
    TEST_EQ_INT(f.weights_bf16, 0);
    TEST_EQ_INT(c.weights_bf16, 0);
    TEST_CHECK(h.weights_bf16 == h.params / 2 && h.params == f.params);
    TEST_CHECK(h.scratch >= 2 * (size_t)4096 * (size_t)d.V);
    TEST_CHECK(h.total - h.weights_bf16 - h.scratch == f.total - f.scratch);
}

static void test_live_model_(void) {
    size_t fr = 0, tot = 0;
    mtrl_error err;
    TEST_EQ_INT(mtrl_model_device_memory(MTRL_DEVICE_CPU, 0, &fr, &tot, &err), MTRL_OK);
    TEST_CHECK(tot > 0 && fr > 0 && fr <= tot);
    printf("host memory: %.2f GiB available of %.2f\n", (double)fr / (1 << 30), (double)tot / (1 << 30));
    mtrl_model_dims d = dims_("preset = tiny\n");
    mtrl_model m;
    mtrl_model_init(&m, &d, 5);
    int len[2] = {700, 300};
    uint32_t a[700], b2[300];
    for (int t = 0; t < 700; t++) a[t] = (uint32_t)(t * 7 % MTRL_VOCAB);
    for (int t = 0; t < 300; t++) b2[t] = (uint32_t)(t * 11 % MTRL_VOCAB);
    const uint32_t *toks[2] = {a, b2};
    mtrl_batch b = {2, toks, len, NULL};
    mtrl_model_plan p;
    TEST_EQ_INT(mtrl_model_plan_batch(&p, &m, &b, &err), MTRL_OK);
    // both sequences in one unit: the segment is the batch's 1000 tokens
    TEST_CHECK(p.budget >= 4 * m.params.total && p.segment > 0 && p.segment <= 1000);
    printf("live tiny model, batch 700 + 300 tokens: segment %d, budget %.2f GiB\n", p.segment,
           (double)p.budget / (1 << 30));
    mtrl_model_free(&m);
}

static void test_command_(void) {
    const char *bin = getenv("MTRL_BIN"), *src = getenv("MTRL_SRC");
    if (!bin || !src) {
        printf("MTRL_BIN / MTRL_SRC unset: the command is not checked\n");
        return;
    }
    char dir[] = "/tmp/mtrl_plan_XXXXXX", ini[1024];
    TEST_CHECK(mkdtemp(dir) != NULL);
    snprintf(ini, sizeof ini, "%s/experiments/retrieval-1m.ini", src);
    test_result r = test_run_in(dir, (char *[]){(char *)bin, "plan", ini, "--tokens", "1048576", "--device", "cuda",
                                                "--budget-gib", "130", NULL});
    printf("%s", r.out);
    TEST_EQ_INT(r.rc, 0);
    TEST_CONTAINS(r.out, "segment ");
    TEST_CONTAINS(r.out, "activations (one segment, fwd + bwd)");
    test_result_free(&r);
    r = test_run_in(dir, (char *[]){(char *)bin, "plan", ini, "--budget-gib", "2", NULL});
    TEST_EQ_INT(r.rc, 1);
    TEST_CONTAINS(r.err, "needs at least");
    test_result_free(&r);
    r = test_run_in(dir, (char *[]){(char *)bin, "plan", ini, "--tokens", "0", NULL});
    TEST_EQ_INT(r.rc, 2);
    test_result_free(&r);
    // `mtrl bench long`: one episode through the actor's prefill and decode and the learner's
    // planned step (what docs/perf.md records at 1M tokens on the GPU), here 600 tokens of tiny.
    r = test_run_in(dir, (char *[]){(char *)bin, "bench", "long", "--tokens", "600", "--decode", "4", NULL});
    printf("%s", r.out);
    TEST_EQ_INT(r.rc, 0);
    TEST_CONTAINS(r.out, "actor:   prefill");
    TEST_CONTAINS(r.out, "ms per token at 600..604 context");
    TEST_CONTAINS(r.out, "learner: segment ");
    test_result_free(&r);
    r = test_run_in(dir, (char *[]){(char *)bin, "bench", "long", "--decode", "0", NULL});
    TEST_EQ_INT(r.rc, 2);
    test_result_free(&r);
    // --config: the experiment's model and device (the quickstart's tiny on the CPU)
    char qs[1024];
    snprintf(qs, sizeof qs, "%s/experiments/quickstart.ini", src);
    r = test_run_in(dir, (char *[]){(char *)bin, "bench", "long", "--config", qs, "--tokens", "300", "--decode", "2", NULL});
    TEST_EQ_INT(r.rc, 0);
    TEST_CONTAINS(r.out, "the model of ");
    TEST_CONTAINS(r.out, "quickstart.ini on cpu");
    TEST_CONTAINS(r.out, "ms per token at 300..302 context");
    test_result_free(&r);
    r = test_run_in(dir, (char *[]){(char *)bin, "bench", "long", "--config", "/nonexistent/x.ini", NULL});
    TEST_EQ_INT(r.rc, 2);
    TEST_CONTAINS(r.err, "/nonexistent/x.ini");
    test_result_free(&r);
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    TEST_EQ_INT(system(cmd), 0);
}

// The naive MLA form's expanded keys and values are stored in the latent type (model_ws.h
// seg_mla_expand): on a GPU (2-byte latents) the naive form's arena is smaller than with 4-byte
// elements by at most what those keys and values take at the difference; the absorbed form, which
// expands nothing, does not change. (The CPU's own mirrors are checked exact above; the GPU's
// by test_cuda_model.)
static void test_latent_keys_(void) {
    for (int absorbed = 0; absorbed <= 1; absorbed++) {
        char ini[1024];
        snprintf(ini, sizeof ini, "%smla_train = %s\nmla_prefill = %s\n", reduced_ini_, absorbed ? "absorbed" : "naive",
                 absorbed ? "absorbed" : "naive");
        mtrl_model_dims d = dims_(ini);
        const int T = 256, Tk = 1024;
        size_t a2 = seg_arena_bytes(&d, T, Tk, 2), a4 = seg_arena_bytes(&d, T, Tk, 4);
        // a short prefill segment after a long context: the expanded keys are its peak
        const int Tp = 64, Tkp = 16384;
        size_t p2 = seg_prefill_bytes(&d, Tp, Tkp, 2), p4 = seg_prefill_bytes(&d, Tp, Tkp, 4);
        size_t kv = (size_t)Tk * d.mH * (d.dn + d.dr + d.dv), kvp = (size_t)Tkp * d.mH * (d.dn + d.dr + d.dv);
        printf("  latent keys (%s): step arena %zu vs %zu bytes, prefill %zu vs %zu (2- vs 4-byte latents)\n",
               absorbed ? "absorbed" : "naive", a2, a4, p2, p4);
        if (absorbed) {
            TEST_CHECK(a2 == a4 && p2 == p4);
        } else {
            TEST_CHECK(a2 < a4 && a4 - a2 <= 2 * kv + 128);
            TEST_CHECK(p2 < p4 && p4 - p2 <= 2 * kvp + 128);
        }
    }
}

int main(void) {
    test_latent_keys_();
    test_activations_("tiny preset", "preset = tiny\n");
    test_activations_("reduced", reduced_ini_);
    test_budget_();
    test_million_();
    test_gemm_bf16_();
    test_live_model_();
    test_command_();
    return test_report();
}
