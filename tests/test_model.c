// mtrl-test: cpu f64 timeout=900
// The whole backbone in fp64 (docs/model.md §8 I3, I8, I11 and the segmented form):
//  - every parameter tensor's gradient == central finite differences of the loss
//    L = Σ c_t logp_t + Σ e_t entropy_t (routing replayed so the loss is smooth in θ);
//  - segmented forward/backward == unsegmented: loss and every gradient to 1e-9 relative for
//    segment lengths 16, 48 and 64 on a sequence of a few hundred tokens;
//  - MLA's two training forms (model.h mla_absorbed: naive, the default, and absorbed) give the
//    same loss (1e-12) and gradients (1e-9), whole, in segments and in a packed batch;
//  - the peak activation memory of the segmented backward grows with the segment, not the
//    sequence, in the absorbed form; in the naive form it grows by the expanded keys, up to the
//    arena mirror;
//  - prefill-then-decode == one full prefill (split points 1, 15, 16, 17, T % 16 != 0);
//  - QB: β gets no gradient, is set only by mtrl_qb_apply after the step, centred;
//  - a packed batch (short sequences end to end in one segment) == the sequences one at a time:
//    log-probs, entropies, routing and every gradient, with and without kept activations;
//  - the learner's one-pass step (mtrl_model_train: forward, loss, backward unit by unit) ==
//    the sequences one at a time, with only a too-long sequence's earlier segments recomputed;
//  - several sequences prefilled at once (mtrl_model_prefill_many) == one prefill each;
//  - a batched decode of 64 states at 64 different positions == 64 single decodes;
//  - Kimi Linear's layer forms (docs/model-forms.md: unbounded gate with decays beyond the
//    chunk range, plain residual, two dense layers, top-k on scores, no renormalisation, no MLA
//    gate): FD gradients, segmented == whole, prefill + decode == full, the layout and QB on
//    the scores.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/checkpoint.h"
#include "common/config.h"
#include "model/model.h"
#include "model/qb.h"
#include "model/model_ws.h"
#include "common/rng.h"
#include "kernels/ref/kda_ref.h"
#include "tests/testhelp.h"
#include "tests/testmodel.h"

_Static_assert(REAL_IS_F64, "this test needs the fp64 build");

static mtrl_model_dims small_dims_x(int layers, int S, const char *hybrid, const char *extra) {
    char text[1024];
    snprintf(text, sizeof text,
             "preset = custom\nlayers = %d\nd_model = 16\nhybrid = %s\nkda_heads = 2\n"
             "kda_head_dim = 8\nmla_heads = 2\nmla_nope_dim = 8\nmla_rope_dim = 4\nmla_v_dim = 8\nmla_latent_dim = 12\n"
             "dense_inter = 24\nexperts = 4\ntop_k = 2\nshared_experts = 1\nexpert_inter = 12\nattnres_block = %d\n"
             "init_std = 0.3\n%s",
             layers, hybrid, S, extra);
    return test_model_dims(text, 32);
}
static mtrl_model_dims small_dims(int layers, int S, const char *hybrid) { return small_dims_x(layers, S, hybrid, ""); }

// Every layer form of Kimi Linear switched on (docs/model-forms.md): the unbounded KDA gate, the
// plain residual, two dense layers, top-k on scores with the correction bias, no renormalisation,
// MLA without an output gate and its latent norm's own epsilon.
#define KIMI_FORMS                                                                                                 \
    "kda_gate = kimi\nattnres = false\ndense_layers = 2\nrouter_bias = score\nrouter_renorm = false\n"            \
    "mla_gate = false\nmla_kv_norm_eps = 1e-6\n"
static mtrl_model_dims kimi_dims(int layers, const char *hybrid) { return small_dims_x(layers, 2, hybrid, KIMI_FORMS); }

// Non-zero AttnRes queries and gate parameters so every path carries gradient.
static void perturb_params(mtrl_model *m, uint64_t seed) {
    const mtrl_model_dims *d = &m->dims;
    for (size_t i = 0; m->P.site_w && i < (size_t)(2 * d->L + 1) * d->d; i++) {
        m->P.site_w[i] = (real)(0.5 * mtrl_rng_normal(seed, 1, i));
        m->P.site_g[i] = (real)(1.0 + 0.2 * mtrl_rng_normal(seed, 2, i));
    }
    for (int l = 0; l < d->L; l++) {
        mtrl_layer_ptrs *p = &m->P.layer[l];
        if (p->A_log)
            for (int h = 0; h < d->H; h++) p->A_log[h] = (real)(0.3 * mtrl_rng_normal(seed, 3 + l, h));
    }
    test_model_fast_decay(m, seed);
}

static void make_tokens(uint32_t *tok, int n, uint64_t seed) {
    for (int t = 0; t < n; t++) tok[t] = (uint32_t)(mtrl_rng_u64(seed, 99, t) % 32);
}

// Loss and (optionally) gradients for one batch with fixed coefficients.
static double run_loss(mtrl_model *m, mtrl_batch *b, int segment, const real *c, const real *e, int backward) {
    int total = 0;
    for (int i = 0; i < b->n; i++) total += b->len[i];
    real *logp = calloc((size_t)total, sizeof(real)), *ent = calloc((size_t)total, sizeof(real));
    mtrl_model_forward(m, b, segment, logp, ent, NULL);
    double L = 0;
    for (int t = 0; t < total; t++) L += c[t] * logp[t] + (e ? e[t] * ent[t] : 0);
    if (backward) mtrl_model_backward(m, b, c, e);
    free(logp);
    free(ent);
    return L;
}

// The largest relative difference of the model's gradients from ref (a copy of an earlier
// m->grads), over every tensor; *name: the tensor where it is.
static double grads_worst_(const mtrl_model *m, const real *ref, const char **name) {
    double worst = 0;
    for (int i = 0; i < m->params.n; i++) {
        const mtrl_tensor *t = &m->params.items[i];
        double r = test_max_rel((real *)((char *)m->grads + t->offset), (const real *)((const char *)ref + t->offset),
                                t->numel);
        if (r > worst) {
            worst = r;
            *name = t->name;
        }
    }
    return worst;
}

static void test_gradcheck(mtrl_model_dims d, const char *label, int probes_max) {
    mtrl_model m;
    mtrl_model_init(&m, &d, 11);
    perturb_params(&m, 5);
    enum { NS = 2 };
    int len[NS] = {21, 13};
    uint32_t t0[21], t1[13];
    make_tokens(t0, 21, 1);
    make_tokens(t1, 13, 2);
    const uint32_t *toks[NS] = {t0, t1};
    // Record the routing once, then replay it: the loss is smooth in θ for finite differences.
    uint8_t *rout[NS];
    size_t rw = (size_t)d.n_moe * d.k;
    for (int i = 0; i < NS; i++) rout[i] = calloc((size_t)len[i] * rw, 1);
    mtrl_batch b = {NS, toks, len, NULL};
    int total = 34;
    real c[34], e[34];
    for (int t = 0; t < total; t++) {
        c[t] = (real)mtrl_rng_normal(3, 1, t);
        e[t] = (real)(0.3 * mtrl_rng_normal(3, 2, t));
    }
    real logp[34];
    if (d.kda_gate == MTRL_KDA_GATE_KIMI) {
        double g = test_model_min_decay(&m, t0, 21, -11, NULL);
        printf("gradcheck %s: smallest KDA log-decay %.3g\n", label, g);
        TEST_CHECKF(g < KDA_G_CHUNK_MIN, "%s: no log-decay below the chunk range (%.3g)", label, g);
    }
    mtrl_model_forward(&m, &b, 0, logp, NULL, rout);
    b.routing = (const uint8_t *const *)rout;
    m.replay_routing = 1;
    mtrl_model_zero_grads(&m);
    run_loss(&m, &b, 0, c, e, 1);
    // Check a few entries of every tensor.
    double worst = 0;
    const char *worst_name = "";
    int checked = 0, bad = 0;
    for (int i = 0; i < m.params.n; i++) {
        mtrl_tensor *t = &m.params.items[i];
        real *p = t->ptr, *g = (real *)((char *)m.grads + t->offset);
        int probes = (int)t->numel < probes_max ? (int)t->numel : probes_max;
        for (int k = 0; k < probes; k++) {
            size_t j = (size_t)(mtrl_rng_u64(7, (uint64_t)i, (uint64_t)k) % t->numel);
            real keep = p[j];
            double h = 1e-5;
            p[j] = keep + h;
            double Lp = run_loss(&m, &b, 0, c, e, 0);
            p[j] = keep - h;
            double Lm = run_loss(&m, &b, 0, c, e, 0);
            p[j] = keep;
            double fd = (Lp - Lm) / (2 * h);
            // Relative error with a floor: central differences at h = 1e-5 carry ~1e-9 of noise.
            double err = fabs(fd - g[j]) / fmax(fabs(fd) + fabs(g[j]), 1e-3);
            checked++;
            if (err > 1e-5) {
                bad++;
                fprintf(stderr, "  %s[%zu]: analytic %.10g, finite difference %.10g\n", t->name, j, (double)g[j], fd);
            }
            if (err > worst) { worst = err; worst_name = t->name; }
        }
    }
    printf("gradcheck %s: %d entries over %d tensors, worst relative error %.3g (%s)\n", label, checked, m.params.n,
           worst, worst_name);
    TEST_EQ_INT(bad, 0);
    for (int i = 0; i < NS; i++) free(rout[i]);
    mtrl_model_free(&m);
}

static void count_hook_(void *user) { ++*(int *)user; }

static void test_segmented(mtrl_model_dims d) {
    mtrl_model m;
    mtrl_model_init(&m, &d, 12);
    perturb_params(&m, 6);
    enum { T = 200 };
    uint32_t tok[T];
    make_tokens(tok, T, 3);
    const uint32_t *toks[1] = {tok};
    int len[1] = {T};
    mtrl_batch b = {1, toks, len, NULL};
    real c[T], e[T];
    for (int t = 0; t < T; t++) {
        c[t] = (real)mtrl_rng_normal(4, 1, t);
        e[t] = (real)(0.2 * mtrl_rng_normal(4, 2, t));
    }
    size_t nb = m.params.total;
    mtrl_model_zero_grads(&m);
    double L0 = run_loss(&m, &b, 0, c, e, 1);
    real *g0 = malloc(nb);
    memcpy(g0, m.grads, nb);
    // The two forms of MLA training (model.h mla_absorbed) are the same function: the absorbed
    // form (MQA over the latents) against the naive one (keys and values expanded per head,
    // the default), whole and in segments of 48 (keys from earlier segments).
    for (int seg = 0; seg <= 48; seg += 48) {
        mtrl_model_zero_grads(&m);
        m.dims.mla_absorbed = 1;
        double La = run_loss(&m, &b, seg, c, e, 1);
        m.dims.mla_absorbed = 0;
        const char *wn = "";
        double worst = grads_worst_(&m, g0, &wn);
        printf("MLA absorbed vs naive form, segment %d: loss %.15g vs %.15g, worst gradient rel diff %.3g (%s)\n",
               seg, La, L0, worst, wn);
        TEST_CLOSE(La, L0, 1e-12, 0);
        TEST_CHECKF(worst <= 1e-9, "absorbed form, segment %d: gradient differs by %.3g in %s", seg, worst, wn);
    }
    int segs[3] = {16, 48, 64};
    size_t peak[3];
    for (int s = 0; s < 3; s++) {
        mtrl_model_zero_grads(&m);
        m.peak_activation_bytes = 0;
        double L = run_loss(&m, &b, segs[s], c, e, 1);
        peak[s] = m.peak_activation_bytes;
        TEST_CLOSE(L, L0, 1e-12, 0);
        const char *wn = "";
        double worst = grads_worst_(&m, g0, &wn);
        printf("%ssegment %d: loss %.15g vs %.15g, worst gradient rel diff %.3g (%s), peak activations %zu bytes\n",
               d.attnres ? "" : "Kimi forms, ", segs[s], L, L0, worst, wn, peak[s]);
        TEST_CHECKF(worst <= 1e-9, "segment %d: gradient differs by %.3g in %s", segs[s], worst, wn);
    }
    TEST_CHECK(peak[0] < peak[1] && peak[1] < peak[2]);
    // The segment hook runs after every segment of the forward and of the backward: 200 tokens
    // at segment 48 are 5 segments.
    int hooks = 0;
    m.segment_hook = count_hook_;
    m.segment_hook_user = &hooks;
    real lp[T];
    mtrl_model_forward(&m, &b, 48, lp, NULL, NULL);
    TEST_EQ_INT(hooks, 5);
    mtrl_model_backward(&m, &b, c, NULL);
    TEST_EQ_INT(hooks, 10);
    m.segment_hook = NULL;
    // The backward takes the forward's last segment from its caches (model.h) and recomputes the
    // others; a second backward of the same forward recomputes that one too: the same bits. The
    // first segment takes the remainder (200 = 8 + 4 x 48), so the kept one is a full one.
    {
        real *g1 = malloc(nb);
        mtrl_model_forward(&m, &b, 48, lp, NULL, NULL);
        mtrl_model_zero_grads(&m);
        mtrl_model_backward(&m, &b, c, e);
        memcpy(g1, m.grads, nb);
        mtrl_model_zero_grads(&m);
        mtrl_model_backward(&m, &b, c, e);
        TEST_CHECKF(!memcmp(g1, m.grads, nb), "a second backward (every segment recomputed) differs from the first");
        const char *wn = "";
        double worst = grads_worst_(&m, g0, &wn);
        TEST_CHECKF(worst <= 1e-9, "segment 48, backward twice: gradient differs by %.3g in %s", worst, wn);
        free(g1);
    }
    // Peak activation memory follows the segment length, not the sequence, in the absorbed form:
    // doubling the sequence at segment 16 keeps the peak within a few percent (only the
    // latents grow). The naive form expands every key so far: its peak grows, up to the mirror of
    // the last segment (model_ws.h seg_arena_bytes).
    enum { T2 = 400 };
    uint32_t tok2[T2];
    make_tokens(tok2, T2, 4);
    const uint32_t *toks2[1] = {tok2};
    int len2[1] = {T2};
    mtrl_batch b2 = {1, toks2, len2, NULL};
    real c2[T2];
    for (int t = 0; t < T2; t++) c2[t] = (real)mtrl_rng_normal(5, 1, t);
    real lp2[T2];
    for (int absorbed = 0; absorbed <= 1; absorbed++) {
        m.dims.mla_absorbed = absorbed;
        size_t p1 = peak[0];
        if (absorbed) {
            mtrl_model_zero_grads(&m);
            m.peak_activation_bytes = 0;
            run_loss(&m, &b, 16, c, e, 1);
            p1 = m.peak_activation_bytes;
        }
        mtrl_model_zero_grads(&m);
        m.peak_activation_bytes = 0;
        mtrl_model_forward(&m, &b2, 16, lp2, NULL, NULL);
        mtrl_model_backward(&m, &b2, c2, NULL);
        size_t p2 = m.peak_activation_bytes;
        printf("segment 16, %s form: peak %zu bytes at T=%d, %zu bytes at T=%d\n", absorbed ? "absorbed" : "naive", p1, T,
               p2, T2);
        if (absorbed) TEST_CHECKF(p2 < p1 * 11 / 10, "absorbed: peak grew from %zu to %zu", p1, p2);
        else {
            // (T2 is 25 whole segments: the last one's mirror is exact)
            size_t mirror = seg_arena_bytes(&m.dims, 16, T2, m.be->latent_size) - 4096;
            TEST_CHECKF(p2 > p1 && p2 <= mirror, "naive: peak grew from %zu to %zu, mirror at T=%d %zu", p1, p2, T2,
                        mirror);
        }
    }
    m.dims.mla_absorbed = 0;
    free(g0);
    mtrl_model_free(&m);
}

// The loss of test_packed's mtrl_model_train runs: the fixed coefficients c, e as dlogp and
// dentropy of each unit's positions. Checks the contract: units come in batch order, cover the
// batch once, and their log-probs are written when the loss sees them (lp starts as NaN).
typedef struct train_check {
    const real *c, *e;
    const int *len;
    int n, next, calls, ordered;
    const real *lp;
} train_check;

static void train_check_loss_(void *user, int i0, int n, const real *logp, const real *ent, real *dlogp,
                              real *dentropy) {
    (void)ent;
    train_check *tc = user;
    tc->calls++;
    tc->ordered &= i0 == tc->next && n >= 1 && i0 + n <= tc->n && logp == tc->lp;
    int o = 0;
    for (int i = 0; i < i0; i++) o += tc->len[i];
    for (int i = i0; i < i0 + n && i < tc->n; i++)
        for (int t = 0; t < tc->len[i]; t++, o++) {
            tc->ordered &= !isnan(logp[o]);
            dlogp[o] = tc->c[o];
            dentropy[o] = tc->e[o];
        }
    tc->next = i0 + n;
}

// Packing (model_ws.h MTRL_PACK_TOKENS): the batch's short sequences run end to end as one
// segment, each from the zero state and attending only to itself. Lengths: 1 token, a multiple
// of the KDA tile, tails; with segment 48 the 80-token sequence is segmented on its own and the
// others form packs of at most 48 tokens.
static void test_packed(mtrl_model_dims d) {
    mtrl_model m;
    mtrl_model_init(&m, &d, 14);
    perturb_params(&m, 8);
    enum { NS = 6, TOT = 37 + 16 + 1 + 80 + 21 + 9 };
    int len[NS] = {37, 16, 1, 80, 21, 9};
    uint32_t tok[TOT];
    make_tokens(tok, TOT, 9);
    const uint32_t *toks[NS];
    real c[TOT], e[TOT];
    for (int t = 0; t < TOT; t++) {
        c[t] = (real)mtrl_rng_normal(6, 1, t);
        e[t] = (real)(0.2 * mtrl_rng_normal(6, 2, t));
    }
    size_t rw = (size_t)d.n_moe * d.k, nb = m.params.total;
    uint8_t *rout[NS], *rone[NS];
    for (int i = 0, o = 0; i < NS; o += len[i++]) {
        toks[i] = tok + o;
        rout[i] = calloc((size_t)len[i] * rw, 1);
        rone[i] = calloc((size_t)len[i] * rw, 1);
    }
    // The reference: one sequence per forward/backward, gradients summed.
    real lp1[TOT], en1[TOT], lp[TOT], en[TOT];
    mtrl_model_zero_grads(&m);
    for (int i = 0, o = 0; i < NS; o += len[i++]) {
        mtrl_batch b1 = {1, toks + i, len + i, NULL};
        mtrl_model_forward(&m, &b1, 0, lp1 + o, en1 + o, rone + i);
        mtrl_model_backward(&m, &b1, c + o, e + o);
    }
    real *g1 = malloc(nb);
    memcpy(g1, m.grads, nb);
    int segs[2] = {0, 48};
    // In the default (naive) MLA training form, then in the absorbed one against the same
    // naive reference: each piece of a pack attends to its own rows in both (model_fwd.c).
    for (int form = 0; form < 2; form++)
    for (int s = 0; s < 2; s++) {
        mtrl_batch b = {NS, toks, len, NULL};
        m.dims.mla_absorbed = form;
        mtrl_model_zero_grads(&m);
        mtrl_model_forward(&m, &b, segs[s], lp, en, rout);
        mtrl_model_backward(&m, &b, c, e);
        m.dims.mla_absorbed = 0;
        const char *wn = "";
        double worst = grads_worst_(&m, g1, &wn);
        int same_routing = 1;
        for (int i = 0; i < NS; i++) same_routing &= memcmp(rout[i], rone[i], (size_t)len[i] * rw) == 0;
        double el = test_max_rel(lp, lp1, TOT), ee = test_max_rel(en, en1, TOT);
        printf("packed batch%s, segment %d: log-prob rel diff %.3g, entropy %.3g, worst gradient %.3g (%s)\n",
               form ? " (MLA trained absorbed)" : "", segs[s], el, ee, worst, wn);
        TEST_CHECKF(el <= 1e-12 && ee <= 1e-12, "segment %d: log-probs differ by %.3g, entropies by %.3g", segs[s], el,
                    ee);
        TEST_CHECKF(worst <= (form ? 1e-9 : 1e-10), "segment %d: gradient differs by %.3g in %s", segs[s], worst, wn);
        TEST_CHECKF(same_routing, "segment %d: packed routing differs from one sequence at a time", segs[s]);
    }
    // mtrl_model_train (the learner's step: forward, loss and backward unit by unit) == the
    // reference. Segment 0: packs of MTRL_PACK_TOKENS (one unit); 48: the 80-token sequence in
    // two segments (its first recomputed, 32 tokens), the rest in packs of <= 48; 128: two packs.
    int tsegs[3] = {0, 48, 128}, trecomp[3] = {0, 32, 0}, tunits[3] = {1, 4, 2};
    for (int s = 0; s < 3; s++) {
        mtrl_batch b = {NS, toks, len, NULL};
        train_check tc = {c, e, len, NS, 0, 0, 1, NULL};
        real dl[TOT], de[TOT];
        for (int t = 0; t < TOT; t++) lp[t] = en[t] = dl[t] = de[t] = (real)NAN;
        tc.lp = lp;
        mtrl_model_zero_grads(&m);
        mtrl_model_train(&m, &b, tsegs[s], lp, en, dl, de, train_check_loss_, &tc);
        const char *wn = "";
        double worst = grads_worst_(&m, g1, &wn);
        double el = test_max_rel(lp, lp1, TOT), ee = test_max_rel(en, en1, TOT);
        printf("mtrl_model_train, segment %d: %d units, %ld tokens recomputed, log-prob rel diff %.3g, entropy %.3g, "
               "worst gradient %.3g (%s)\n", tsegs[s], tc.calls, m.recomputed_tokens, el, ee, worst, wn);
        TEST_CHECKF(tc.ordered, "segment %d: the loss saw units out of order or before their log-probs", tsegs[s]);
        TEST_EQ_INT(tc.next, NS);
        TEST_CHECKF(el <= 1e-12 && ee <= 1e-12, "train, segment %d: log-probs differ by %.3g, entropies by %.3g",
                    tsegs[s], el, ee);
        TEST_CHECKF(worst <= 1e-10, "train, segment %d: gradient differs by %.3g in %s", tsegs[s], worst, wn);
        TEST_EQ_INT(m.recomputed_tokens, trecomp[s]);
        TEST_EQ_INT(tc.calls, tunits[s]);
    }
    for (int i = 0; i < NS; i++) {
        free(rout[i]);
        free(rone[i]);
    }
    free(g1);
    mtrl_model_free(&m);
}

// Batched decode at B = 64 == 64 single decodes: 64 states at different positions (0 .. 63
// tokens prefilled, so KDA states, conv windows and latent caches of every length), three
// decode steps of all of them in one call each, against the same steps one state at a time on
// copies; logits, routing and the states' positions.
static void test_decode_batch64(void) {
    mtrl_model_dims d = small_dims(4, 2, "KMKM");
    mtrl_model m;
    mtrl_model_init(&m, &d, 21);
    perturb_params(&m, 12);
    enum { B = 64, STEPS = 3, CAP = 64 + STEPS + 1 };
    size_t rw = (size_t)d.n_moe * d.k;
    mtrl_decode_state bat[B], one[B];
    mtrl_decode_state *pb[B];
    uint32_t tok[B][CAP];
    for (int i = 0; i < B; i++) {
        make_tokens(tok[i], CAP, 300 + (uint64_t)i);
        mtrl_decode_state_init(&bat[i], &m, CAP);
        mtrl_decode_state_init(&one[i], &m, CAP);
        if (i) mtrl_model_prefill(&m, &bat[i], tok[i], i, NULL, NULL);
        mtrl_decode_state_copy(&one[i], &bat[i], &m);
        pb[i] = &bat[i];
    }
    real *lb = malloc(sizeof(real) * B * d.V), *l1 = malloc(sizeof(real) * B * d.V);
    uint8_t *rb = malloc((size_t)B * rw), *r1 = malloc((size_t)B * rw);
    double worst = 0;
    int same_routing = 1;
    for (int s = 0; s < STEPS; s++) {
        uint32_t in[B];
        for (int i = 0; i < B; i++) in[i] = tok[i][i + s];
        mtrl_model_decode(&m, pb, B, in, lb, rb);
        for (int i = 0; i < B; i++) {
            mtrl_decode_state *p1 = &one[i];
            mtrl_model_decode(&m, &p1, 1, in + i, l1 + (size_t)i * d.V, r1 + (size_t)i * rw);
        }
        double e = test_max_rel(lb, l1, (size_t)B * d.V);
        if (e > worst) worst = e;
        same_routing &= memcmp(rb, r1, (size_t)B * rw) == 0;
    }
    int same_pos = 1;
    for (int i = 0; i < B; i++) same_pos &= bat[i].pos == i + STEPS && one[i].pos == i + STEPS;
    printf("decode of B = 64 states (0..63 tokens in) vs one at a time, %d steps: logits rel diff %.3g\n", STEPS, worst);
    TEST_CHECKF(worst <= 1e-12, "batched decode at B = 64 differs from single decodes by %.3g", worst);
    TEST_CHECK(same_routing);
    TEST_CHECK(same_pos);
    for (int i = 0; i < B; i++) {
        mtrl_decode_state_free(&bat[i]);
        mtrl_decode_state_free(&one[i]);
    }
    free(lb); free(l1); free(rb); free(r1);
    mtrl_model_free(&m);
}

// An inference model (mtrl_model_init_infer_on, the actors'): parameters only, the same logits
// as a training model of the same seed, its weights loadable from a training model's save, and
// the optimizer's entry points refused with a clear error.
static void test_inference_model(void) {
    mtrl_model_dims d = small_dims(4, 2, "KMKM");
    mtrl_model tr, inf;
    mtrl_error err;
    mtrl_model_init(&tr, &d, 31);
    TEST_EQ_INT(mtrl_model_init_infer_on(&inf, &d, 31, MTRL_DEVICE_CPU, 0, &err), MTRL_OK);
    TEST_CHECK(inf.inference && !inf.grads && !inf.adam_m && !inf.adam_v && !inf.d_grads);
    perturb_params(&tr, 13);
    void *mem = NULL;
    size_t len = 0;
    TEST_EQ_INT(mtrl_model_save(&tr, NULL, &mem, &len, 0, NULL, 0, &err), MTRL_OK);
    mtrl_ckpt c;
    TEST_EQ_INT(mtrl_ckpt_open_mem(&c, mem, len, &err), MTRL_OK);
    TEST_EQ_INT(mtrl_model_load(&inf, &c, 0, &err), MTRL_OK);
    TEST_EQ_INT(mtrl_model_load(&inf, &c, 1, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "inference model");
    mtrl_ckpt_close(&c);
    free(mem);
    mem = NULL;
    TEST_EQ_INT(mtrl_model_save(&inf, NULL, &mem, &len, 1, NULL, 0, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "inference model");
    free(mem);
    enum { T = 40 };
    uint32_t tok[T];
    make_tokens(tok, T, 77);
    real *a = malloc(sizeof(real) * T * d.V), *b = malloc(sizeof(real) * T * d.V);
    mtrl_model_logits(&tr, tok, T, 0, a);
    mtrl_model_logits(&inf, tok, T, 0, b);
    TEST_CHECKF(!memcmp(a, b, sizeof(real) * T * d.V), "an inference model's logits differ from the training model's");
    mtrl_model_optimizer_reset(&inf); // nothing to reset: a no-op, not a crash
    free(a);
    free(b);
    mtrl_model_free(&inf);
    mtrl_model_free(&tr);
}

// mtrl_model_prefill_many (the actor's batched tool results: one packed SEG_PREFILL whose pieces
// continue their own states, the varlen piece_io ops) == one mtrl_model_prefill per sequence:
// states at different positions, new pieces of different lengths; the last-token logits, then one
// batched decode step from the states it left (KDA states, conv windows, latents and positions all
// used), and the routing. Four states (fresh, after 17 and after 3 tokens; pieces of 20, 5, 16 and
// 1 tokens), and nine (pieces of 1, 15, 16, 17, 33, 2, 40, 3 and 64 tokens: partial, whole and
// several KDA tiles, pieces shorter than the conv window, after 0 .. 33 tokens).
enum { PM_MAX = 9, PM_CAP = 128 };
static void test_prefill_many(int prefill_naive, int N, const int *before, const int *len) {
    mtrl_model_dims d = small_dims(4, 2, "KMKM");
    d.mla_prefill_naive = prefill_naive;
    mtrl_model m;
    mtrl_model_init(&m, &d, 15);
    perturb_params(&m, 9);
    enum { CAP = PM_CAP };
    TEST_CHECK(N <= PM_MAX);
    uint32_t tok[PM_MAX][CAP];
    for (int i = 0; i < N; i++) make_tokens(tok[i], CAP, 20 + (uint64_t)i);
    mtrl_decode_state one[PM_MAX], many[PM_MAX];
    mtrl_decode_state *pm[PM_MAX], *po[PM_MAX];
    const uint32_t *fresh[PM_MAX];
    size_t rw = (size_t)d.n_moe * d.k;
    uint8_t *r1[PM_MAX], *rm[PM_MAX];
    real *l1 = malloc(sizeof(real) * N * d.V), *lm = malloc(sizeof(real) * N * d.V);
    for (int i = 0; i < N; i++) {
        mtrl_decode_state_init(&one[i], &m, CAP);
        mtrl_decode_state_init(&many[i], &m, CAP);
        if (before[i]) {
            mtrl_model_prefill(&m, &one[i], tok[i], before[i], NULL, NULL);
            mtrl_model_prefill(&m, &many[i], tok[i], before[i], NULL, NULL);
        }
        fresh[i] = tok[i] + before[i];
        r1[i] = calloc((size_t)len[i] * rw, 1);
        rm[i] = calloc((size_t)len[i] * rw, 1);
        pm[i] = &many[i];
        po[i] = &one[i];
        mtrl_model_prefill(&m, &one[i], fresh[i], len[i], l1 + (size_t)i * d.V, r1[i]);
    }
    mtrl_model_prefill_many(&m, pm, N, fresh, len, lm, rm);
    double el = test_max_rel(lm, l1, (size_t)N * d.V);
    int same_routing = 1, same_pos = 1;
    for (int i = 0; i < N; i++) {
        same_routing &= memcmp(r1[i], rm[i], (size_t)len[i] * rw) == 0;
        same_pos &= many[i].pos == one[i].pos && one[i].pos == before[i] + len[i];
    }
    uint32_t next[PM_MAX];
    for (int i = 0; i < N; i++) next[i] = tok[i][before[i] + len[i]];
    real *d1 = malloc(sizeof(real) * N * d.V), *dm = malloc(sizeof(real) * N * d.V);
    mtrl_model_decode(&m, po, N, next, d1, NULL);
    mtrl_model_decode(&m, pm, N, next, dm, NULL);
    double ed = test_max_rel(dm, d1, (size_t)N * d.V);
    printf("prefill of %d sequences at once%s: last logits rel diff %.3g, next decode step %.3g\n", N,
           prefill_naive ? " (naive MLA prefill)" : "", el, ed);
    TEST_CHECKF(el <= 1e-12, "prefill_many logits differ by %.3g", el);
    TEST_CHECKF(ed <= 1e-12, "the states prefill_many left differ: decode logits by %.3g", ed);
    TEST_CHECK(same_routing);
    TEST_CHECK(same_pos);
    for (int i = 0; i < N; i++) {
        mtrl_decode_state_free(&one[i]);
        mtrl_decode_state_free(&many[i]);
        free(r1[i]);
        free(rm[i]);
    }
    free(l1); free(lm); free(d1); free(dm);
    mtrl_model_free(&m);
}

static void test_prefill_decode(mtrl_model_dims d, int prefill_naive) {
    d.mla_prefill_naive = prefill_naive;
    mtrl_model m;
    mtrl_model_init(&m, &d, 13);
    perturb_params(&m, 7);
    enum { T = 37 };
    uint32_t tok[T];
    make_tokens(tok, T, 5);
    real *full = malloc(sizeof(real) * T * d.V);
    mtrl_model_logits(&m, tok, T, 0, full);
    int splits[5] = {1, 15, 16, 17, 33};
    real logits[4][32];
    for (int si = 0; si < 5; si++) {
        int sp = splits[si];
        // Two sequences decoded side by side in one batch, from different split points.
        mtrl_decode_state s0, s1;
        mtrl_decode_state_init(&s0, &m, T);
        mtrl_decode_state_init(&s1, &m, T);
        real last[32];
        mtrl_model_prefill(&m, &s0, tok, sp, last, NULL);
        double err = test_max_rel(last, full + (size_t)(sp - 1) * d.V, (size_t)d.V);
        int pre = sp < 5 ? sp : 5;
        mtrl_model_prefill(&m, &s1, tok, pre, NULL, NULL);
        for (int t = pre; t < sp; t++) {
            mtrl_decode_state *one[1] = {&s1};
            mtrl_model_decode(&m, one, 1, &tok[t], logits[0], NULL);
        }
        for (int t = sp; t < T; t++) {
            mtrl_decode_state *two[2] = {&s0, &s1};
            uint32_t in[2] = {tok[t], tok[t]};
            mtrl_model_decode(&m, two, 2, in, logits[0], NULL);
            double e0 = test_max_rel(logits[0], full + (size_t)t * d.V, (size_t)d.V);
            double e1 = test_max_rel(logits[0] + d.V, full + (size_t)t * d.V, (size_t)d.V);
            if (e0 > err) err = e0;
            if (e1 > err) err = e1;
        }
        printf("prefill %d then decode to %d%s%s: max rel diff of logits %.3g\n", sp, T,
               prefill_naive ? " (naive MLA prefill)" : "", d.kda_gate == MTRL_KDA_GATE_KIMI ? " (Kimi forms)" : "", err);
        TEST_CHECKF(err < 1e-10, "split %d: %.3g", sp, err);
        // Segmented logits agree too.
        real *segl = malloc(sizeof(real) * T * d.V);
        mtrl_model_logits(&m, tok, T, sp, segl);
        TEST_CHECK(test_max_rel(segl, full, (size_t)T * d.V) < 1e-10);
        free(segl);
        mtrl_decode_state_free(&s0);
        mtrl_decode_state_free(&s1);
    }
    free(full);
    mtrl_model_free(&m);
}

static void test_qb_outside_gradient(void) {
    mtrl_model_dims d = small_dims(3, 4, "KKM");
    mtrl_model m;
    mtrl_model_init(&m, &d, 14);
    enum { T = 64 };
    uint32_t tok[T];
    make_tokens(tok, T, 6);
    const uint32_t *toks[1] = {tok};
    int len[1] = {T};
    mtrl_batch b = {1, toks, len, NULL};
    real c[T];
    for (int t = 0; t < T; t++) c[t] = (real)mtrl_rng_normal(8, 1, t);
    real beta0[3 * 4];
    memcpy(beta0, m.qb_beta, sizeof beta0);
    mtrl_model_zero_grads(&m);
    run_loss(&m, &b, 0, c, NULL, 1);
    // forward + backward leave β untouched (it is not a parameter and gets no gradient)
    TEST_CHECK(memcmp(beta0, m.qb_beta, sizeof beta0) == 0);
    TEST_CHECK(mtrl_tt_find(&m.params, "qb_beta") < 0);
    mtrl_model_optimizer_step(&m, 1e-3, 0.9, 0.95, 1e-8, 0, 1);
    TEST_CHECK(memcmp(beta0, m.qb_beta, sizeof beta0) == 0);
    // the step's β, centred per layer: the mean of the two layers' sums less its mean
    double want[3 * 4];
    for (int l = 1; l < 3; l++) {
        double mean = 0;
        for (int e = 0; e < 4; e++) mean += m.qb_sum[l * 4 + e] / m.qb_count[l] / 4;
        for (int e = 0; e < 4; e++) want[l * 4 + e] = m.qb_sum[l * 4 + e] / m.qb_count[l] - mean;
    }
    TEST_EQ_INT(mtrl_qb_apply(&m), 2);
    TEST_CHECK(memcmp(beta0, m.qb_beta, sizeof beta0) != 0);
    for (int l = 1; l < 3; l++) {
        double sum = 0, spread = 0;
        for (int e = 0; e < 4; e++) {
            TEST_NEAR(m.qb_beta[l * 4 + e], want[l * 4 + e], 1e-12);
            sum += m.qb_beta[l * 4 + e];
            spread += fabs(m.qb_beta[l * 4 + e]);
        }
        TEST_NEAR(sum, 0, 1e-12);
        TEST_CHECK(spread > 0); // centring kept the differences, the only part top-k reads
    }
    // frozen (eval, replay, the learner with qb off) never changes β and computes none, but the
    // forward still counts the routing loads (metrics)
    memcpy(beta0, m.qb_beta, sizeof beta0);
    mtrl_qb_set_mode(&m, MTRL_QB_FROZEN);
    run_loss(&m, &b, 0, c, NULL, 0);
    TEST_EQ_INT(m.qb_count[1] + m.qb_count[2], 0);
    long load = 0;
    for (int e = 0; e < 4; e++) load += m.load[4 + e];
    TEST_EQ_INT(load, (long)T * d.k);
    TEST_EQ_INT(mtrl_qb_apply(&m), 0);
    TEST_CHECK(memcmp(beta0, m.qb_beta, sizeof beta0) == 0);
    mtrl_model_free(&m);
}

// The `tiny` preset itself (4 layers KKKM, d = 64, 8 experts top-2, vocabulary 264).
static mtrl_model_dims tiny_dims(void) {
    mtrl_config cfg;
    mtrl_config_errors errs = {0};
    mtrl_config_load_text(&cfg, "tiny", "[env]\nname = calc\n[model]\npreset = tiny\n", NULL, 0, &errs);
    mtrl_config_errors_free(&errs);
    mtrl_model_dims d;
    mtrl_model_dims_from_config(&d, &cfg, 264, NULL);
    return d;
}

// I8 (stack): with a block size S >= L no block is ever committed, so every site sees exactly
// {embedding, partial sum} (the first mixer only the embedding); with S = 1 site j of layer l
// sees l + 1 committed blocks.
static void test_attnres_blocks(void) {
    for (int S = 1; S <= 8; S *= 8) {
        mtrl_model_dims d = small_dims(4, S, "KKKM");
        mtrl_model m;
        mtrl_model_init(&m, &d, 2);
        mtrl_arena ar;
        mtrl_arena_init(&ar, seg_arena_bytes(&d, 8, 8, sizeof(real)));
        mtrl_decode_state s;
        mtrl_decode_state_init(&s, &m, 8);
        seq_io io = {s.kda_S, s.conv, s.latent, s.cap, 0, 0, NULL, NULL};
        uint32_t tok[8];
        make_tokens(tok, 8, 9);
        seg_cache c;
        seg_forward(&m, &ar, SEG_CHUNK, 8, tok, &io, NULL, &c);
        int ok = 1;
        for (int l = 0; l < d.L; l++) {
            int want = S >= d.L ? 1 : l + 1;
            ok &= c.nb_site[2 * l] == want && c.nb_site[2 * l + 1] == want;
            ok &= c.layer[l].nsrc_a == (l == 0 || (S == 1 && l > 0) ? want : want + 1);
            ok &= c.layer[l].nsrc_f == want + 1;
        }
        ok &= c.nsrc_o == (S >= d.L ? 2 : d.L + 1);
        TEST_CHECKF(ok, "AttnRes site sources wrong for block size %d", S);
        mtrl_decode_state_free(&s);
        mtrl_arena_free(&ar);
        mtrl_model_free(&m);
    }
}

// The layout the Kimi forms imply: no attnres.* tensors without AttnRes, the dense FFN in the
// first dense_layers layers and MoE after them (routing records n_moe = L − dense_layers layers
// wide), bad values refused naming the key; and QB on the scores the router selects on: with
// router_bias = score, one QB update from a batch balances the same batch's routing.
static void test_kimi_layout(void) {
    mtrl_model_dims d = kimi_dims(5, "KKMKM");
    TEST_EQ_INT(d.first_dense, 2);
    TEST_EQ_INT(d.n_moe, 3);
    TEST_EQ_INT(d.attnres, 0);
    TEST_EQ_INT(d.S, 5);
    mtrl_model m;
    mtrl_model_init(&m, &d, 3);
    TEST_CHECK(mtrl_tt_find(&m.params, "attnres.w") < 0 && mtrl_tt_find(&m.params, "attnres.g") < 0);
    TEST_CHECK(m.P.site_w == NULL && m.P.site_g == NULL);
    TEST_CHECK(mtrl_tt_find(&m.params, "layers.1.ffn.w1") >= 0 && mtrl_tt_find(&m.params, "layers.1.moe.router") < 0);
    TEST_CHECK(mtrl_tt_find(&m.params, "layers.2.moe.router") >= 0 && mtrl_tt_find(&m.params, "layers.2.ffn.w1") < 0);
    TEST_CHECK(mtrl_tt_find(&m.params, "layers.2.mla.wg") < 0);
    TEST_EQ_INT(mtrl_model_moe_index(&d, 1), -1);
    TEST_EQ_INT(mtrl_model_moe_index(&d, 2), 0);
    // the defaults keep the project's model
    mtrl_model_dims d0 = small_dims(4, 2, "KKKM");
    TEST_CHECK(d0.first_dense == 1 && d0.n_moe == 3 && d0.attnres == 1 && d0.kda_gate == MTRL_KDA_GATE_BOUNDED &&
               d0.router_bias_score == 0 && d0.moe_renorm == 1);
    // bad values name their key
    const char *bad[3][2] = {{"layers = 4\ndense_layers = 5\n", "dense_layers"},
                             {"kda_gate = softplus\n", "kda_gate"},
                             {"router_bias = both\n", "router_bias"}};
    for (int i = 0; i < 3; i++) {
        char text[256];
        snprintf(text, sizeof text, "[env]\nname = calc\n[model]\n%s", bad[i][0]);
        mtrl_config cfg;
        mtrl_config_errors errs = {0};
        TEST_CHECK(mtrl_config_load_text(&cfg, "t", text, NULL, 0, &errs) != MTRL_OK);
        TEST_CHECKF(errs.n > 0 && strstr(errs.msgs[0], bad[i][1]) != NULL, "error for %s: %s", bad[i][1],
                    errs.n ? errs.msgs[0] : "(none)");
        mtrl_config_errors_free(&errs);
    }
    // QB on the scores: route a batch, set β from it, route it again.
    enum { T = 96 };
    uint32_t tok[T];
    make_tokens(tok, T, 21);
    const uint32_t *toks[1] = {tok};
    int len[1] = {T};
    mtrl_batch b = {1, toks, len, NULL};
    real lp[T];
    // The first MoE layer's input does not depend on any β (the layers before it are dense), so
    // QB iterated on this one batch converges to balancing it within one slot per expert: a load
    // violation of at most E / (N K). A β in other units than the selection's (the logits'
    // while the router selects on scores) would not converge there.
    int l0 = d.first_dense;
    double bound = (double)d.E / (T * d.k) + 1e-12, v[6];
    for (int it = 0; it < 6; it++) {
        mtrl_model_forward(&m, &b, 0, lp, NULL, NULL);
        v[it] = mtrl_model_load_violation(&m, l0);
        TEST_EQ_INT(mtrl_qb_apply(&m), d.n_moe);
    }
    printf("QB on router scores (Kimi forms), layer %d: load violation %.3g, then %.3g %.3g %.3g %.3g %.3g after each "
           "update (bound %.3g)\n", l0, v[0], v[1], v[2], v[3], v[4], v[5], bound);
    TEST_CHECKF(v[0] > bound && v[5] <= bound, "QB on scores did not balance: %.3g -> %.3g", v[0], v[5]);
    mtrl_model_free(&m);
}

// The GPU's approximation of Kimi's gate (backend_cuda.c: clamped at g_min, the range of its
// chunk kernels) measured here in fp64 without a GPU: the CPU backend's gate swapped for the
// same clamp at the lowest g_min (-8, kernels_cuda.h MTRL_KDA_TC_G_MIN), log-probs against the
// exact gate's. The test's decays (testmodel.h test_model_fast_decay) go far past it in one head
// of every KDA layer.
static void test_kimi_clamp_effect(void) {
    mtrl_model_dims d = kimi_dims(4, "KKMK");
    d.g_min = -8;
    mtrl_model m;
    mtrl_model_init(&m, &d, 17);
    perturb_params(&m, 9);
    enum { T = 200 };
    uint32_t tok[T];
    make_tokens(tok, T, 23);
    const uint32_t *toks[1] = {tok};
    int len[1] = {T};
    mtrl_batch b = {1, toks, len, NULL};
    long below = 0;
    double gmin = test_model_min_decay(&m, tok, T, d.g_min, &below);
    real exact[T], clamped[T];
    uint8_t *rout[1] = {calloc((size_t)T * d.n_moe * d.k, 1)};
    mtrl_model_forward(&m, &b, 0, exact, NULL, rout);
    b.routing = (const uint8_t *const *)rout; // the same experts, so only the gate differs
    m.replay_routing = 1;
    test_model_clamp_kimi_gate(1);
    mtrl_model_forward(&m, &b, 0, clamped, NULL, NULL);
    test_model_clamp_kimi_gate(0);
    double num = 0, den = 0, mx = 0;
    for (int t = 0; t < T - 1; t++) {
        double e = fabs((double)clamped[t] - (double)exact[t]);
        num += e * e;
        den += (double)exact[t] * exact[t];
        mx = fmax(mx, e);
    }
    printf("Kimi gate clamped at %.3g (the GPU's form) vs exact, fp64, %d tokens: %ld of %d log-decays of the first "
           "KDA layer below it (min %.3g); log-probs rel L2 %.3g, max abs %.3g nats\n",
           (double)d.g_min, T, below, T * d.H * d.D, gmin, sqrt(num / den), mx);
    TEST_CHECKF(below > 0 && mx > 0, "the clamp took no effect (%ld below the floor)", below);
    // the stress case: a third of the first layer's decays below the floor, down to -57
    TEST_CHECKF(sqrt(num / den) < 5e-4, "the clamp moved log-probs by %.3g relative", sqrt(num / den));
    free(rout[0]);
    mtrl_model_free(&m);
}

// Loads an experiment of calc on the tiny preset with `extra` appended and returns its dims.
static mtrl_model_dims dims_of_text_(const char *extra) {
    char text[1024];
    snprintf(text, sizeof text, "[env]\nname = calc\n[model]\npreset = tiny\n%s", extra);
    mtrl_config cfg;
    mtrl_config_errors errs = {0};
    TEST_EQ_INT(mtrl_config_load_text(&cfg, "t", text, NULL, 0, &errs), MTRL_OK);
    mtrl_config_errors_free(&errs);
    mtrl_model_dims d;
    TEST_EQ_INT(mtrl_model_dims_from_config(&d, &cfg, 264, NULL), MTRL_OK);
    return d;
}

// [model] gemm: TF32 GEMMs on a GPU by default (dims.gemm_tf32), fp32 on request, anything else
// an error naming the key; and [kernels] gemm's overrides (backend.h mtrl_backend_gemm_tf32: a
// pure function in every build, so checked here without a GPU; test_cuda_model checks the
// backends a GPU creates).
// The MFU's active parameters: the matrices minus the routed experts' (1 - k/E), counted here
// from the dims so that a renamed tensor cannot silently count every expert as active.
static void test_active_params(void) {
    mtrl_model_dims d = kimi_dims(5, "KKMKM");
    mtrl_model m;
    mtrl_model_init(&m, &d, 3);
    double matrices = 0;
    for (int i = 0; i < m.params.n; i++)
        if (m.params.items[i].ndim >= 2 && strcmp(m.params.items[i].name, "embed")) matrices += (double)m.params.items[i].numel;
    double routed = (double)d.n_moe * 3 * d.E * d.I * d.d;
    double want = matrices - routed * (1 - (double)d.k / d.E);
    TEST_CHECKF(fabs(mtrl_model_active_matmul_params(&m) - want) < 0.5, "active %.0f, want %.0f",
                mtrl_model_active_matmul_params(&m), want);
    TEST_CHECK(d.k < d.E && routed > 0);
    mtrl_model_free(&m);
}

static void test_gemm_precision(void) {
    TEST_EQ_INT(tiny_dims().gemm_tf32, 1);
    mtrl_model_dims d = dims_of_text_("gemm = fp32\n");
    TEST_EQ_INT(d.gemm_tf32, 0);
    mtrl_config cfg;
    mtrl_config_errors errs = {0};
    TEST_CHECK(mtrl_config_load_text(&cfg, "t", "[env]\nname = calc\n[model]\ngemm = bf16\n", NULL, 0, &errs) != MTRL_OK);
    TEST_CHECK(errs.n > 0 && strstr(errs.msgs[0], "gemm") != NULL);
    mtrl_config_errors_free(&errs);
    const mtrl_kernel_opts dflt = {0};
    TEST_EQ_INT(mtrl_backend_gemm_tf32(MTRL_DEVICE_CUDA, &dflt, 1), 1);
    TEST_EQ_INT(mtrl_backend_gemm_tf32(MTRL_DEVICE_CUDA, NULL, 0), 0);
    TEST_EQ_INT(mtrl_backend_gemm_tf32(MTRL_DEVICE_CPU, &dflt, 1), 0);
    d = dims_of_text_("[kernels]\ngemm = fp32\n");
    TEST_EQ_INT(mtrl_backend_gemm_tf32(MTRL_DEVICE_CUDA, &d.kern, 1), 0);
    d = dims_of_text_("gemm = fp32\n[kernels]\ngemm = tf32\n");
    TEST_EQ_INT(mtrl_backend_gemm_tf32(MTRL_DEVICE_CUDA, &d.kern, d.gemm_tf32), 1);
    d = dims_of_text_("[kernels]\ngemm = bf16\n");
    TEST_EQ_INT(mtrl_backend_gemm_tf32(MTRL_DEVICE_CUDA, &d.kern, 1), 0);
    TEST_EQ_INT(mtrl_backend_gemm_bf16(MTRL_DEVICE_CUDA, &d.kern), 1);
    TEST_EQ_INT(mtrl_backend_gemm_bf16(MTRL_DEVICE_CPU, &d.kern), 0);
    TEST_EQ_INT(mtrl_backend_gemm_bf16(MTRL_DEVICE_CUDA, &dflt), 0);
}

// [kernels]: the defaults are the zeroed options (the kernels a context without a config
// chooses, so that runs keep the kernels they had), and every key reaches its field.
static void test_kernel_opts(void) {
    const mtrl_kernel_opts zero = {0};
    mtrl_model_dims d = dims_of_text_("");
    TEST_CHECKF(!memcmp(&d.kern, &zero, sizeof zero), "the default [kernels] section is not the zeroed options");
    d = dims_of_text_("[kernels]\nattn = mma\ndecode = simt\nkda_fwd = simt\nkda_bwd = simt\nkda_bwd_tile = simt\n"
                      "kda_tile_threads = 256\nkda_fwd_pieces = 3\nkda_bwd_pieces = 2\nkda_seq_pieces = 5\n"
                      "kda_records = bf16\nmoe_lanes = 1\nmoe = wgmma\ngemm = bf16\nlatent = fp32\n");
    const mtrl_kernel_opts *o = &d.kern;
    TEST_EQ_INT(o->attn, MTRL_KOPT_MMA);
    TEST_EQ_INT(o->decode, MTRL_KOPT_SIMT);
    TEST_EQ_INT(o->kda_fwd, MTRL_KOPT_SIMT);
    TEST_EQ_INT(o->kda_bwd, MTRL_KOPT_SIMT);
    TEST_EQ_INT(o->kda_bwd_tile, MTRL_KOPT_SIMT);
    TEST_EQ_INT(o->kda_tile_threads, 256);
    TEST_EQ_INT(o->kda_fwd_pieces, 3);
    TEST_EQ_INT(o->kda_bwd_pieces, 2);
    TEST_EQ_INT(o->kda_seq_pieces, 5);
    TEST_EQ_INT(o->kda_plain_bf16, 1);
    TEST_EQ_INT(o->moe_lanes, 1);
    TEST_EQ_INT(o->moe, MTRL_KOPT_WGMMA);
    TEST_EQ_INT(dims_of_text_("[kernels]\nmoe = mma\n").kern.moe, MTRL_KOPT_MMA);
    TEST_EQ_INT(o->gemm, MTRL_KGEMM_BF16);
    TEST_EQ_INT(o->latent_fp32, 1);
    TEST_EQ_INT(dims_of_text_("[kernels]\nattn = simt\n").kern.attn, MTRL_KOPT_SIMT);
    TEST_EQ_INT((int)mtrl_backend_latent_size(MTRL_DEVICE_CUDA, o), 4);
    TEST_EQ_INT((int)mtrl_backend_latent_size(MTRL_DEVICE_CUDA, &zero), 2);
    TEST_EQ_INT((int)mtrl_backend_latent_size(MTRL_DEVICE_CPU, o), (int)sizeof(real));
    // a bad value names the section and key
    mtrl_config cfg;
    mtrl_config_errors errs = {0};
    TEST_CHECK(mtrl_config_load_text(&cfg, "t", "[env]\nname = calc\n[kernels]\nkda_records = bf8\n", NULL, 0, &errs) !=
               MTRL_OK);
    TEST_CHECK(errs.n > 0 && strstr(errs.msgs[0], "kda_records") != NULL);
    mtrl_config_errors_free(&errs);
    // the keys of the variants that left the tree (docs/kernel-lab.md) are errors that name them,
    // not silently ignored settings
    static const char *gone[] = {"attn_fwd_config = 3", "attn_dkv_rows = 64", "attn_dq_first = true",
                                 "attn_dkv_in_step = true", "kda_cluster = 8", "kda_warps = 2"};
    for (size_t i = 0; i < sizeof gone / sizeof *gone; i++) {
        char text[128], key[32];
        snprintf(text, sizeof text, "[env]\nname = calc\n[kernels]\n%s\n", gone[i]);
        snprintf(key, sizeof key, "%.*s", (int)strcspn(gone[i], " "), gone[i]);
        errs = (mtrl_config_errors){0};
        TEST_CHECKF(mtrl_config_load_text(&cfg, "t", text, NULL, 0, &errs) != MTRL_OK, "[kernels] %s accepted", key);
        TEST_CHECKF(errs.n > 0 && strstr(errs.msgs[0], key) != NULL, "the error does not name %s", key);
        mtrl_config_errors_free(&errs);
    }
}

int main(void) {
    test_gemm_precision();
    test_kernel_opts();
    test_gradcheck(small_dims(4, 2, "KKMK"), "small", 3);
    test_gradcheck(tiny_dims(), "tiny preset", 1);
    test_gradcheck(kimi_dims(4, "KKMK"), "Kimi forms", 3);
    test_attnres_blocks();
    test_kimi_layout();
    test_active_params();
    test_kimi_clamp_effect();
    test_segmented(small_dims(4, 2, "KMKM"));
    test_segmented(kimi_dims(4, "KMKM"));
    test_packed(small_dims(4, 2, "KMKM"));
    test_packed(kimi_dims(4, "KMKM"));
    test_prefill_decode(small_dims(4, 2, "KKKM"), 0);
    test_prefill_decode(small_dims(4, 2, "KKKM"), 1);
    test_prefill_decode(kimi_dims(4, "KKKM"), 0);
    test_prefill_decode(kimi_dims(4, "KKKM"), 1);
    static const int pm_before4[4] = {0, 17, 3, 0}, pm_len4[4] = {20, 5, 16, 1};
    static const int pm_before9[9] = {0, 17, 3, 0, 5, 1, 0, 16, 33}, pm_len9[9] = {1, 15, 16, 17, 33, 2, 40, 3, 64};
    for (int naive = 0; naive < 2; naive++) {
        test_prefill_many(naive, 4, pm_before4, pm_len4);
        test_prefill_many(naive, 9, pm_before9, pm_len9);
    }
    test_decode_batch64();
    test_inference_model();
    test_qb_outside_gradient();
    return test_report();
}
