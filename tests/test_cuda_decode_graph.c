// mtrl-test: gpu timeout=900
// Decode steps replayed from CUDA graphs ([kernels] decode_graph = on, model/model_decode.h)
// against the same steps launched kernel by kernel (decode_graph = off): two GPU models with the
// same weights, fed the same tokens, must give the same logits, routing, routing loads and QB β
// sums, bit for bit, over 90 steps in which
//   * episodes (10..40 steps) finish and about half of the finished slots are refilled from a
//     new prompt (1..70 tokens, slot 0 110, prefilled) every 10 steps: B changes, and the rows
//     move between batch positions at every step;
//   * the contexts are of mixed lengths, and the longest crosses 128 and back: the key-length
//     buckets (powers of 2) that the recordings are keyed on;
//   * the weights are replaced twice between steps (perturbed on the host, mtrl_model_to_device):
//     a replay reads the parameters in place, so it sees them, and must still match;
// and the graph model must have replayed steps (counted), the launched one none. The GEMMs are
// TF32: the grouped expert kernels take the expert offsets on the device, while true fp32 runs the
// per-expert cuBLAS chains, which read them on the host and cannot be recorded (the driver then
// launches; checked too: such a model replays nothing and gives the same bits). Cases: tiny
// (KKKM: the SIMT MLA decode at dc 32) and a reduced small (KMKM, latent 256 + 32: the
// tensor-core MLA decode, 16 experts top-4 with a shared expert).
#include <stdlib.h>
#include <string.h>

#include "model/qb.h"
#include "testhelp.h"
#include "testmodel.h"

#define NS 12    // slots
#define STEPS 90
#define CAP 512

typedef struct side {
    mtrl_model m;
    mtrl_decode_state st[NS];
} side;

static void perturb_(mtrl_model *m, int k) {
    mtrl_model_to_host(m);
    real *p = (real *)m->params.base;
    size_t n = m->params.total / sizeof(real);
    for (size_t i = (size_t)k; i < n; i += 7) p[i] *= (real)(1.0 + 0.02 * (k + 1));
    mtrl_model_to_device(m);
}

static int open_(side *s, const mtrl_model_dims *d0, int graph, int gemm) {
    mtrl_model_dims d = *d0;
    d.kern.gemm = gemm;
    d.kern.decode_graph = graph;
    mtrl_error err;
    if (mtrl_model_init_on(&s->m, &d, 7, MTRL_DEVICE_CUDA, 0, &err) != MTRL_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return -1;
    }
    mtrl_qb_set_mode(&s->m, MTRL_QB_DECODE); // the β sums are taken at every step
    for (int i = 0; i < NS; i++) mtrl_decode_state_init(&s->st[i], &s->m, CAP);
    return 0;
}

static void close_(side *s) {
    for (int i = 0; i < NS; i++) mtrl_decode_state_free(&s->st[i]);
    mtrl_model_free(&s->m);
}

// The episodic loop on both models; returns the steps compared. min_replays < 0: none expected.
static int run_(const char *name, const mtrl_model_dims *d0, int gemm, long min_replays) {
    side g, e;
    if (open_(&g, d0, 1, gemm) || open_(&e, d0, 0, gemm)) {
        TEST_CHECKF(0, "%s: models not created", name);
        return 0;
    }
    const mtrl_model_dims *d = &g.m.dims;
    int V = d->V, left[NS] = {0}, steps = 0, Bmin = NS, Bmax = 0;
    size_t rw = (size_t)d->n_moe * d->k;
    real *lg = malloc(sizeof(real) * NS * V), *le = malloc(sizeof(real) * NS * V);
    uint8_t *rg = malloc(NS * rw + 1), *re = malloc(NS * rw + 1);
    long logit_diff = 0, route_diff = 0;
    for (int step = 0; step < STEPS; step++) {
        if (step == 35 || step == 65) { // a new weight version between steps
            perturb_(&g.m, step / 35);
            perturb_(&e.m, step / 35);
        }
        // every 10 steps about half the finished slots are refilled: B holds for a while (so
        // that its recordings get replayed), then changes
        for (int s = 0; s < NS; s++)
            if (left[s] == 0 && step % 10 == 0 && (step / 10 + s) % 2 == 0) {
                // slot 0 from 110 tokens: its context crosses 128 while it decodes
                int n = s == 0 ? 110 : 1 + (int)(mtrl_rng_u64(11, (uint64_t)step, (uint64_t)s) % 70);
                uint32_t prompt[128];
                for (int t = 0; t < n; t++) prompt[t] = (uint32_t)(mtrl_rng_u64(12, (uint64_t)step * NS + s, t) % V);
                mtrl_decode_state_reset(&g.st[s], &g.m);
                mtrl_decode_state_reset(&e.st[s], &e.m);
                mtrl_model_prefill(&g.m, &g.st[s], prompt, n, NULL, NULL);
                mtrl_model_prefill(&e.m, &e.st[s], prompt, n, NULL, NULL);
                left[s] = 10 * (1 + (int)(mtrl_rng_u64(13, (uint64_t)step, (uint64_t)s) % 4));
            }
        mtrl_decode_state *pg[NS], *pe[NS];
        uint32_t tok[NS];
        int B = 0, rows[NS];
        for (int i = 0; i < NS; i++) { // a rotating order: rows change batch positions
            int s = (i * 5 + step) % NS;
            if (left[s] <= 0) continue;
            rows[B] = s;
            pg[B] = &g.st[s];
            pe[B] = &e.st[s];
            tok[B] = (uint32_t)(mtrl_rng_u64(14, (uint64_t)step, (uint64_t)s) % V);
            B++;
        }
        if (!B) continue;
        if (B < Bmin) Bmin = B;
        if (B > Bmax) Bmax = B;
        mtrl_model_decode(&g.m, pg, B, tok, lg, rg);
        mtrl_model_decode(&e.m, pe, B, tok, le, re);
        logit_diff += memcmp(lg, le, sizeof(real) * (size_t)B * V) != 0;
        route_diff += memcmp(rg, re, (size_t)B * rw) != 0;
        for (int b = 0; b < B; b++) left[rows[b]]--;
        steps++;
    }
    TEST_CHECKF(logit_diff == 0, "%s: logits differ at %ld of %d steps", name, logit_diff, steps);
    TEST_CHECKF(route_diff == 0, "%s: routing differs at %ld of %d steps", name, route_diff, steps);
    size_t LE = (size_t)d->L * d->E;
    TEST_CHECKF(!memcmp(g.m.load, e.m.load, sizeof(long) * LE), "%s: routing loads differ", name);
    TEST_CHECKF(!memcmp(g.m.qb_sum, e.m.qb_sum, sizeof(double) * LE), "%s: QB β sums differ", name);
    TEST_CHECKF(!memcmp(g.m.qb_count, e.m.qb_count, sizeof(int) * (size_t)d->L), "%s: QB batch counts differ", name);
    long rep, rec, lau, rep_e;
    mtrl_model_decode_counts(&g.m, &rep, &rec, &lau);
    mtrl_model_decode_counts(&e.m, &rep_e, NULL, NULL);
    printf("%s: %d steps, B %d..%d; graph model: %ld replayed, %ld recorded, %ld launched; logits and routing %s\n",
           name, steps, Bmin, Bmax, rep, rec, lau, logit_diff || route_diff ? "DIFFER" : "bit for bit");
    if (min_replays < 0) TEST_CHECKF(rep == 0 && rec == 0, "%s: %ld steps replayed, expected none", name, rep);
    else TEST_CHECKF(rep >= min_replays, "%s: %ld steps replayed, expected at least %ld", name, rep, min_replays);
    TEST_CHECKF(rep_e == 0, "%s: the launched model replayed %ld steps", name, rep_e);
    TEST_CHECK(Bmin < Bmax); // the batch size did change
    free(lg);
    free(le);
    free(rg);
    free(re);
    close_(&g);
    close_(&e);
    return steps;
}

int main(void) {
    if (mtrl_model_cuda_devices() == 0) test_skip("no CUDA device (or a build without CUDA)");
    static const struct {
        const char *name, *ini;
        int vocab;
    } cases[] = {
        {"tiny (KKKM)", "preset = tiny\n", 64},
        {"reduced small (KMKM, latent 256+32, 16 experts top-4)",
         "preset = custom\nlayers = 4\nd_model = 256\nhybrid = KMKM\nkda_heads = 2\nkda_head_dim = 128\n"
         "mla_heads = 4\nmla_nope_dim = 64\nmla_rope_dim = 32\nmla_v_dim = 64\nmla_latent_dim = 256\n"
         "dense_inter = 512\nexperts = 16\ntop_k = 4\nshared_experts = 1\nexpert_inter = 128\nattnres_block = 2\n",
         512},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        mtrl_model_dims d = test_model_dims(cases[c].ini, cases[c].vocab);
        TEST_CHECK(d.L > 0);
        if (d.L <= 0) continue;
        run_(cases[c].name, &d, MTRL_KGEMM_TF32, 40);
    }
    // True fp32 GEMMs: the per-expert chains read the offsets on the host, so no step can be
    // recorded; the driver launches them all and the bits are the launched model's.
    mtrl_model_dims d = test_model_dims(cases[0].ini, cases[0].vocab);
    if (d.L > 0) run_("tiny, fp32 GEMMs (not recordable)", &d, MTRL_KGEMM_FP32, -1);
    return test_report();
}
