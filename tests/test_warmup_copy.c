// mtrl-test: cpu slow timeout=900
// The supervised warm-up's step (mtrl_train_sft_step) on the tiny backbone, through the same
// packed batch a warm-up builds:
//  - its loss is the mean NLL of exactly the MODEL tokens, each predicted at the position before
//    it (the log-probs of mtrl_model_forward on the same batch, read at those positions);
//  - it teaches a copy: BOS, six random digits, '|', the same digits and EOS (the MODEL part).
//    Only the context holds the digits, so a loss below chance (ln 10 a digit) needs the
//    gradient to cross positions and the pieces of a pack to see their own rows. 64 demos a
//    step at lr 3e-3 took the held-out loss 5.56 -> 0.05 in 200 steps (2026-12-02); the test
//    holds it to 0.5 (chance on the digits is 6 ln 10 / 7 = 1.97).
// docs/long-episodes.md (recall without tools) has the longer copies and the retrieval recall
// this measures against.
#include <math.h>
#include <stdlib.h>

#include "common/config.h"
#include "common/rng.h"
#include "common/tokenizer.h"
#include "learner/train.h"
#include "model/model.h"
#include "tests/testhelp.h"

#define COPY_DIGITS 6

static void copy_demo_(uint64_t seed, mtrl_traj *t) {
    mtrl_traj_reset(t);
    char dg[COPY_DIGITS];
    uint64_t st = mtrl_rng_stream("test.warmup_copy", 0, 0);
    for (int i = 0; i < COPY_DIGITS; i++) dg[i] = (char)('0' + mtrl_rng_u64(seed, st, (uint64_t)i) % 10);
    mtrl_traj_append(t, MTRL_TOK_BOS, 0, 0, MTRL_TOK_PROMPT, NULL);
    for (int i = 0; i < COPY_DIGITS; i++) mtrl_traj_append(t, (unsigned char)dg[i], 0, 0, MTRL_TOK_PROMPT, NULL);
    mtrl_traj_append(t, '|', 0, 0, MTRL_TOK_PROMPT, NULL);
    for (int i = 0; i < COPY_DIGITS; i++) mtrl_traj_append(t, (unsigned char)dg[i], 0, 0, MTRL_TOK_MODEL, NULL);
    mtrl_traj_append(t, MTRL_TOK_EOS, 0, 0, MTRL_TOK_MODEL, NULL);
    t->status = MTRL_EP_COMPLETE;
}

// The mean NLL of the MODEL tokens of eps under m (forward only), and per answer position.
static double model_nll_(mtrl_model *m, mtrl_traj *eps, int n, double *per_pos) {
    const uint32_t **tk = malloc(sizeof *tk * (size_t)n);
    int *len = malloc(sizeof(int) * (size_t)n);
    size_t T = 0;
    for (int i = 0; i < n; i++) tk[i] = eps[i].ids, len[i] = (int)eps[i].n_tokens, T += eps[i].n_tokens;
    mtrl_batch b = {n, tk, len, NULL};
    real *lp = calloc(T + 1, sizeof(real));
    mtrl_model_forward(m, &b, 0, lp, NULL, NULL);
    double tot = 0;
    long cnt = 0;
    if (per_pos)
        for (int k = 0; k <= COPY_DIGITS; k++) per_pos[k] = 0;
    size_t o = 0;
    for (int i = 0; i < n; i++) {
        int k = 0;
        for (uint64_t j = 1; j < eps[i].n_tokens; j++)
            if (eps[i].kind[j] == MTRL_TOK_MODEL) {
                tot -= lp[o + j - 1];
                cnt++;
                if (per_pos && k <= COPY_DIGITS) per_pos[k] -= lp[o + j - 1] / n;
                k++;
            }
        o += eps[i].n_tokens;
    }
    free(lp);
    free(tk);
    free(len);
    return tot / (double)cnt;
}

int main(void) {
    mtrl_config cfg;
    mtrl_config_errors errs = {0};
    TEST_EQ_INT(mtrl_config_load_text(&cfg, "t.ini", "[run]\nseed = 1\n[model]\npreset = tiny\n[env]\nname = calc\n", NULL, 0, &errs),
                MTRL_OK);
    mtrl_config_errors_free(&errs);
    mtrl_model_dims d;
    TEST_EQ_INT(mtrl_model_dims_from_config(&d, &cfg, MTRL_VOCAB, NULL), MTRL_OK);
    mtrl_model m;
    mtrl_model_init(&m, &d, 1);
    enum { B = 64, H = 128, STEPS = 200 };
    mtrl_traj demos[B], held[H];
    mtrl_traj *dp[B];
    for (int i = 0; i < B; i++) mtrl_traj_init(&demos[i]), dp[i] = &demos[i];
    for (int i = 0; i < H; i++) mtrl_traj_init(&held[i]), copy_demo_(1000000 + (uint64_t)i, &held[i]);
    double first = model_nll_(&m, held, H, NULL);
    printf("held-out loss before: %.4f\n", first);
    for (int s = 0; s < STEPS; s++) {
        for (int i = 0; i < B; i++) copy_demo_((uint64_t)s * B + (uint64_t)i, &demos[i]);
        // The step's loss is the forward's at its own weights (before the update), on the MODEL
        // tokens alone.
        double want = s % 50 == 0 ? model_nll_(&m, demos, B, NULL) : NAN;
        double loss = mtrl_train_sft_step(&m, &cfg, dp, B, 3e-3);
        if (s % 50 == 0) {
            TEST_CLOSE(loss, want, 1e-5, 1e-6);
            double pp[COPY_DIGITS + 1];
            double h = model_nll_(&m, held, H, pp);
            printf("step %3d: train %.4f, held-out %.4f; per answer token:", s + 1, loss, h);
            for (int k = 0; k <= COPY_DIGITS; k++) printf(" %.2f", pp[k]);
            printf("\n");
        }
    }
    double pp[COPY_DIGITS + 1];
    double last = model_nll_(&m, held, H, pp);
    printf("held-out loss after %d steps: %.4f (chance on the digits: %.4f)\n", STEPS, last,
           COPY_DIGITS * log(10.0) / (COPY_DIGITS + 1));
    TEST_CHECKF(first > 5.0, "an untrained model's loss %.3f (ln %d = %.2f expected)", first, MTRL_VOCAB,
                log((double)MTRL_VOCAB));
    TEST_CHECKF(last < 0.5, "the copy was not learnt: held-out loss %.3f after %d steps", last, STEPS);
    for (int k = 0; k < COPY_DIGITS; k++)
        TEST_CHECKF(pp[k] < 1.0, "copied digit %d: loss %.3f (chance %.3f)", k, pp[k], log(10.0));
    for (int i = 0; i < B; i++) mtrl_traj_free(&demos[i]);
    for (int i = 0; i < H; i++) mtrl_traj_free(&held[i]);
    mtrl_model_free(&m);
    return test_report();
}
