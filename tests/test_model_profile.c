// mtrl-test: cpu
// The model's opt-in profile (model.h "profile"), on the fp32 CPU model of preset tiny (KKKM):
//  - numerics do not change: a forward+backward+optimizer step with the profile on gives the same
//    log-probs, entropies, gradients and updated parameters, bit for bit, as with it off;
//  - every phase the model runs is counted: each block of the forward and the backward (KDA and
//    MLA sub-blocks, dense FFN, MoE routing / experts / shared, sites, embedding, head), the
//    optimizer; the recompute pass only when the backward recomputes segments (segment > 0);
//  - blocks a model lacks stay at zero calls (MLA on an all-KDA hybrid);
//  - the phases are disjoint intervals of the call: their sum lies within [50%, 100%] of the
//    call's wall time (the rest: work between phases).
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "common/timeutil.h"
#include "tests/testhelp.h"
#include "tests/testmodel.h"

enum { NSEQ = 3, VOCAB = 64 };
static const int lens_[NSEQ] = {96, 61, 130};

typedef struct step_out {
    real *logp, *ent, *grads, *params;
    size_t bytes; // of grads and params
    double wall; // seconds of forward + backward + optimizer step
} step_out;

// One learner step on a fresh model (same seed each time): forward, backward of fixed
// coefficients, AdamW. prof: the profile to fill (NULL: off).
static step_out run_step_(const mtrl_model_dims *d, int segment, mtrl_model_profile *prof) {
    mtrl_model m;
    mtrl_model_init(&m, d, 7);
    test_model_perturb(&m, 3);
    uint32_t *tok[NSEQ];
    int total = 0;
    for (int i = 0; i < NSEQ; i++) {
        tok[i] = malloc(sizeof(uint32_t) * (size_t)lens_[i]);
        for (int t = 0; t < lens_[i]; t++) tok[i][t] = (uint32_t)(mtrl_rng_u64(5, (uint64_t)i, (uint64_t)t) % VOCAB);
        total += lens_[i];
    }
    mtrl_batch b = {NSEQ, (const uint32_t *const *)tok, lens_, NULL};
    real *c = malloc(sizeof(real) * (size_t)total), *e = malloc(sizeof(real) * (size_t)total);
    for (int t = 0; t < total; t++) {
        c[t] = (real)(0.1 * mtrl_rng_normal(6, 0, (uint64_t)t));
        e[t] = (real)(0.05 * mtrl_rng_normal(6, 1, (uint64_t)t));
    }
    step_out o;
    o.logp = malloc(sizeof(real) * (size_t)total);
    o.ent = malloc(sizeof(real) * (size_t)total);
    o.bytes = m.params.total;
    o.grads = malloc(m.params.total);
    o.params = malloc(m.params.total);
    if (prof) memset(prof, 0, sizeof *prof);
    m.profile = prof;
    double t0 = mtrl_time_mono();
    mtrl_model_forward(&m, &b, segment, o.logp, o.ent, NULL);
    mtrl_model_zero_grads(&m);
    mtrl_model_backward(&m, &b, c, e);
    memcpy(o.grads, m.grads, m.params.total);
    mtrl_model_optimizer_step(&m, (real)1e-3, (real)0.9, (real)0.95, (real)1e-8, (real)0.1, (real)1);
    o.wall = mtrl_time_mono() - t0;
    m.profile = NULL;
    memcpy(o.params, m.params.base, m.params.total);
    mtrl_model_free(&m);
    for (int i = 0; i < NSEQ; i++) free(tok[i]);
    free(c);
    free(e);
    return o;
}

static void step_free_(step_out *o) {
    free(o->logp);
    free(o->ent);
    free(o->grads);
    free(o->params);
}

static int is_mla_(int block) {
    return block == MTRL_PROF_MLA_PROJ || block == MTRL_PROF_MLA_ELEM || block == MTRL_PROF_MLA_ABSORB ||
           block == MTRL_PROF_MLA_ATTN;
}

// Runs the step with the profile off and on and checks the profile's invariants. has_mla: the
// hybrid has MLA layers; recompute: the backward recomputes its segments.
static void check_(const char *what, const mtrl_model_dims *d, int segment, int has_mla, int recompute) {
    fprintf(stderr, "%s\n", what);
    step_out off = run_step_(d, segment, NULL);
    mtrl_model_profile prof;
    step_out on = run_step_(d, segment, &prof);
    int total = 0;
    for (int i = 0; i < NSEQ; i++) total += lens_[i];
    size_t bytes = off.bytes;
    TEST_CHECK(!memcmp(off.logp, on.logp, sizeof(real) * (size_t)total));
    TEST_CHECK(!memcmp(off.ent, on.ent, sizeof(real) * (size_t)total));
    TEST_CHECK(!memcmp(off.grads, on.grads, bytes));
    TEST_CHECK(!memcmp(off.params, on.params, bytes));
    double sum = 0;
    for (int p = 0; p < MTRL_PROF_PASSES; p++)
        for (int k = 0; k < MTRL_PROF_BLOCKS; k++) {
            char name[64];
            mtrl_model_profile_name(p, k, name, sizeof name);
            sum += prof.sec[p][k];
            TEST_CHECKF(prof.sec[p][k] >= 0, "%s: %g s", name, prof.sec[p][k]);
            // the optimizer counts under the backward pass only
            int want = k == MTRL_PROF_OPTIM ? p == MTRL_PROF_BWD
                       : p == MTRL_PROF_RECOMPUTE && !recompute ? 0
                       : is_mla_(k) ? has_mla
                                     : 1;
            if (want) TEST_CHECKF(prof.calls[p][k] > 0, "%s: %ld calls", name, prof.calls[p][k]);
            else TEST_CHECKF(prof.calls[p][k] == 0 && prof.sec[p][k] == 0, "%s: %ld calls", name, prof.calls[p][k]);
        }
    TEST_EQ_INT(prof.pass, MTRL_PROF_FWD);
    // Disjoint intervals inside the timed call, on the same clock: at most all of it (the slack
    // is rounding); the model's ops are most of it.
    TEST_CHECKF(sum <= on.wall * (1 + 1e-9) && sum >= 0.5 * on.wall, "phases %.6f s of a %.6f s step", sum, on.wall);
    step_free_(&off);
    step_free_(&on);
}

int main(void) {
    mtrl_model_dims tiny = test_model_dims("preset = tiny\n", VOCAB);
    TEST_CHECK(strchr(tiny.mixer, 'K') && strchr(tiny.mixer, 'M') && tiny.n_shared > 0);
    // segment 0: the batch runs as one packed segment, activations kept (no recompute)
    check_("tiny, kept activations", &tiny, 0, 1, 0);
    // segment 32: the 96- and 130-token sequences are cut into segments and recomputed
    check_("tiny, segments of 32 tokens, recomputed", &tiny, 32, 1, 1);
    mtrl_model_dims kda = test_model_dims("preset = tiny\nhybrid = KKKK\n", VOCAB);
    TEST_CHECK(!strchr(kda.mixer, 'M'));
    check_("tiny, all KDA", &kda, 32, 0, 1);
    return test_report();
}
