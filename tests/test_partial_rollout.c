// mtrl-test: cpu
// Partial rollouts (issue 8): when new weights arrive in the middle of an episode, the actor
// keeps the decode state it built under the old weights (KDA states, conv windows, MLA latents)
// and continues with the new weights; it does not re-prefill the episode. This test measures
// what that decision costs, on the tiny backbone: for the tokens generated after the switch, the
// log-prob the actor computes from the kept state against the log-prob of a fresh prefill under
// the new weights (what the learner computes), next to the change the weight update itself makes
// (old weights against new, both fresh). Checked: the kept state really is stale (the difference
// is not zero) and costs less than the weight update itself at the RL learning rates used here;
// the numbers are printed for docs/long-episodes.md.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "model/model.h"
#include "model/qb.h"
#include "common/rng.h"
#include "common/tokenizer.h"
#include "tests/testhelp.h"
#include "tests/testmodel.h"

enum { P = 96, D = 96, K = 96, N = P + D + K };

static double logp_(const real *logits, int V, uint32_t tok) {
    double mx = logits[0];
    for (int v = 1; v < V; v++) mx = logits[v] > mx ? logits[v] : mx;
    double s = 0;
    for (int v = 0; v < V; v++) s += exp(logits[v] - mx);
    return logits[tok] - mx - log(s);
}

// One AdamW step that raises the log-probs of a random sequence (a stand-in for an RL update),
// then QB, as the learner does after a step.
static void update_(mtrl_model *m, double lr, uint64_t seed) {
    uint32_t toks[128];
    for (int t = 0; t < 128; t++) toks[t] = (uint32_t)(mtrl_rng_u64(seed, 1, (uint64_t)t) % 256);
    const uint32_t *tp[1] = {toks};
    int len[1] = {128};
    mtrl_batch b = {1, tp, len, NULL};
    real logp[128], c[128];
    for (int t = 0; t < 128; t++) c[t] = (real)(-1.0 / 128);
    mtrl_model_forward(m, &b, 0, logp, NULL, NULL);
    mtrl_model_zero_grads(m);
    mtrl_model_backward(m, &b, c, NULL);
    mtrl_model_optimizer_step(m, (real)lr, (real)0.9, (real)0.95, (real)1e-8, 0, (real)1.0);
    mtrl_qb_apply(m);
}

int main(void) {
    mtrl_model_dims d = test_model_dims("preset = tiny\n", MTRL_VOCAB);
    TEST_CHECK(d.L > 0);
    int V = d.V;
    uint32_t tok[N];
    for (int t = 0; t < N; t++) tok[t] = (uint32_t)(mtrl_rng_u64(77, 0, (uint64_t)t) % 256);
    real *L0 = malloc(sizeof(real) * (size_t)N * V), *L1 = malloc(sizeof(real) * (size_t)N * V);
    real *row = malloc(sizeof(real) * (size_t)V);
    const double lrs[] = {1e-4, 1.5e-3, 1e-2};
    double kept_cost[3], update_cost[3];
    for (int i = 0; i < 3; i++) {
        mtrl_model m;
        mtrl_model_init(&m, &d, 11);
        // A few updates first, so the model is not at its near-uniform initialisation.
        for (int w = 0; w < 20; w++) update_(&m, 3e-3, 100 + (uint64_t)w);
        mtrl_model_logits(&m, tok, N, 0, L0);
        mtrl_decode_state st;
        mtrl_decode_state_init(&st, &m, N);
        mtrl_model_prefill(&m, &st, tok, P + D, NULL, NULL); // the episode so far, old weights
        update_(&m, lrs[i], 999);                            // new weights arrive mid-episode
        mtrl_model_logits(&m, tok, N, 0, L1);
        double kept = 0, upd = 0, worst = 0;
        mtrl_decode_state *sp[1] = {&st};
        for (int t = P + D; t < N - 1; t++) {
            mtrl_model_decode(&m, sp, 1, &tok[t], row, NULL); // continues from the kept state
            double lk = logp_(row, V, tok[t + 1]);
            double lf = logp_(L1 + (size_t)t * V, V, tok[t + 1]);
            double lo = logp_(L0 + (size_t)t * V, V, tok[t + 1]);
            kept += fabs(lk - lf);
            upd += fabs(lo - lf);
            if (fabs(lk - lf) > worst) worst = fabs(lk - lf);
        }
        kept_cost[i] = kept / (K - 1);
        update_cost[i] = upd / (K - 1);
        printf("lr %.1e: kept state vs fresh prefill: mean |dlogp| %.3e (max %.3e); old vs new weights: %.3e; "
               "ratio %.3f\n", lrs[i], kept_cost[i], worst, update_cost[i], kept_cost[i] / update_cost[i]);
        mtrl_decode_state_free(&st);
        mtrl_model_free(&m);
    }
    for (int i = 0; i < 3; i++) {
        TEST_CHECKF(kept_cost[i] > 0, "lr %g: the kept state is not stale at all?", lrs[i]);
        TEST_CHECKF(kept_cost[i] < update_cost[i], "lr %g: keeping the state costs %.3e, more than the update's %.3e",
                    lrs[i], kept_cost[i], update_cost[i]);
    }
    // It grows with the size of the update.
    TEST_CHECK(kept_cost[0] < kept_cost[1] && kept_cost[1] < kept_cost[2]);
    free(L0);
    free(L1);
    free(row);
    return test_report();
}
