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
//
// With arguments it is instead the study of that recall (no checks, exit 0): the warm-up's step
// on `retrieval`'s own demos (inline_doc, max_tool_calls = 0, key_digits = 6, seeds as the
// learner's warm-up draws them), the tiny preset, printing the held-out loss per answer token
// (`v`, six digits, EOS; 128 demos of other seeds) every `every` steps:
//     OMP_NUM_THREADS=1 build/test_warmup_copy recall hybrid=KMKM doc_tokens=64 lr=3e-3 batch=16 steps=600
// (every=100 held=128 by default).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "common/rng.h"
#include "common/timeutil.h"
#include "common/tokenizer.h"
#include "env/env_config.h"
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

// The mean NLL of the MODEL tokens of eps under m (forward only), and per answer position (the
// first npos of them).
static double model_nll_(mtrl_model *m, mtrl_traj *eps, int n, double *per_pos, int npos) {
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
        for (int k = 0; k < npos; k++) per_pos[k] = 0;
    size_t o = 0;
    for (int i = 0; i < n; i++) {
        int k = 0;
        for (uint64_t j = 1; j < eps[i].n_tokens; j++)
            if (eps[i].kind[j] == MTRL_TOK_MODEL) {
                tot -= lp[o + j - 1];
                cnt++;
                if (per_pos && k < npos) per_pos[k] -= lp[o + j - 1] / n;
                k++;
            }
        o += eps[i].n_tokens;
    }
    free(lp);
    free(tk);
    free(len);
    return tot / (double)cnt;
}

// ---- the recall study ------------------------------------------------------------------------

#define RECALL_ANSWER 8 // v, six digits, EOS

// Reads key=value arguments into the study's settings; 0, or -1 on an unknown key.
typedef struct recall_args {
    char hybrid[16];
    int doc_tokens, batch, steps, every, held;
    double lr;
} recall_args;

static int recall_args_(int argc, char **argv, recall_args *a) {
    *a = (recall_args){"KKKM", 16, 64, 600, 100, 128, 3e-3};
    for (int i = 2; i < argc; i++) {
        const char *v = strchr(argv[i], '=');
        if (!v) return -1;
        size_t n = (size_t)(v++ - argv[i]);
        if (n == 6 && !strncmp(argv[i], "hybrid", n)) snprintf(a->hybrid, sizeof a->hybrid, "%s", v);
        else if (n == 10 && !strncmp(argv[i], "doc_tokens", n)) a->doc_tokens = atoi(v);
        else if (n == 5 && !strncmp(argv[i], "batch", n)) a->batch = atoi(v);
        else if (n == 5 && !strncmp(argv[i], "steps", n)) a->steps = atoi(v);
        else if (n == 5 && !strncmp(argv[i], "every", n)) a->every = atoi(v);
        else if (n == 4 && !strncmp(argv[i], "held", n)) a->held = atoi(v);
        else if (n == 2 && !strncmp(argv[i], "lr", n)) a->lr = atof(v);
        else return -1;
    }
    return a->batch > 0 && a->steps > 0 && a->every > 0 && a->held > 0 ? 0 : -1;
}

static void recall_print_(int step, double train, double held, const double *pp, double t0) {
    printf("step %4d: train %.4f, held-out %.4f; per answer token:", step, train, held);
    for (int k = 0; k < RECALL_ANSWER; k++) printf(" %.2f", pp[k]);
    printf(" (%.0f s)\n", mtrl_time_mono() - t0);
    fflush(stdout);
}

static int recall_study_(int argc, char **argv) {
    recall_args a;
    if (recall_args_(argc, argv, &a)) {
        fprintf(stderr, "usage: %s recall [hybrid=KKKM] [doc_tokens=16] [lr=3e-3] [batch=64] [steps=600] "
                        "[every=100] [held=128]\n", argv[0]);
        return 2;
    }
    char ini[512];
    snprintf(ini, sizeof ini,
             "[run]\nseed = 1\n[model]\npreset = tiny\nhybrid = %s\n[env]\nname = retrieval\ninline_doc = true\n"
             "demo_search = false\nmax_tool_calls = 0\nkey_digits = 6\ndoc_tokens = %d\n",
             a.hybrid, a.doc_tokens);
    mtrl_config cfg;
    mtrl_config_errors errs = {0};
    if (mtrl_config_load_text(&cfg, "study.ini", ini, NULL, 0, &errs) != MTRL_OK) {
        fprintf(stderr, "config: %s\n", errs.n ? errs.msgs[0] : "?");
        return 2;
    }
    mtrl_config_errors_free(&errs);
    mtrl_model_dims d;
    mtrl_error err;
    mtrl_env *env;
    if (mtrl_model_dims_from_config(&d, &cfg, MTRL_VOCAB, &err) != MTRL_OK ||
        mtrl_env_open_config(&cfg, &env, &err) != MTRL_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 2;
    }
    mtrl_model m;
    mtrl_model_init(&m, &d, 1);
    int B = a.batch, H = a.held;
    mtrl_traj *demos = calloc((size_t)B, sizeof *demos), *held = calloc((size_t)H, sizeof *held);
    mtrl_traj **dp = calloc((size_t)B, sizeof *dp);
    for (int i = 0; i < B; i++) mtrl_traj_init(&demos[i]), dp[i] = &demos[i];
    for (int i = 0; i < H; i++) {
        mtrl_traj_init(&held[i]);
        if (mtrl_train_demo_episode(env, 1000000007ull + (uint64_t)i, 1 << 20, &held[i], &err) != MTRL_OK) {
            fprintf(stderr, "demo: %s\n", err.msg);
            return 2;
        }
    }
    printf("recall study: tiny, hybrid %s, doc_tokens %d (%llu tokens a demo), lr %g, batch %d, %d steps\n", a.hybrid,
           a.doc_tokens, (unsigned long long)held[0].n_tokens, a.lr, B, a.steps);
    double pp[RECALL_ANSWER], t0 = mtrl_time_mono(), loss = NAN;
    recall_print_(0, loss, model_nll_(&m, held, H, pp, RECALL_ANSWER), pp, t0);
    uint64_t ws = mtrl_rng_stream("warmup", 0, 0);
    for (int s = 0; s < a.steps; s++) {
        for (int i = 0; i < B; i++) {
            uint64_t seed = mtrl_rng_u64((uint64_t)cfg.run.seed, ws, (uint64_t)s * (uint64_t)B + (uint64_t)i);
            if (mtrl_train_demo_episode(env, seed, 1 << 20, &demos[i], &err) != MTRL_OK) {
                fprintf(stderr, "demo: %s\n", err.msg);
                return 2;
            }
        }
        loss = mtrl_train_sft_step(&m, &cfg, dp, B, a.lr);
        if ((s + 1) % a.every == 0) recall_print_(s + 1, loss, model_nll_(&m, held, H, pp, RECALL_ANSWER), pp, t0);
    }
    for (int i = 0; i < B; i++) mtrl_traj_free(&demos[i]);
    for (int i = 0; i < H; i++) mtrl_traj_free(&held[i]);
    free(demos);
    free(held);
    free(dp);
    mtrl_env_close(env);
    mtrl_model_free(&m);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "recall")) return recall_study_(argc, argv);
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
    double first = model_nll_(&m, held, H, NULL, 0);
    printf("held-out loss before: %.4f\n", first);
    for (int s = 0; s < STEPS; s++) {
        for (int i = 0; i < B; i++) copy_demo_((uint64_t)s * B + (uint64_t)i, &demos[i]);
        // The step's loss is the forward's at its own weights (before the update), on the MODEL
        // tokens alone.
        double want = s % 50 == 0 ? model_nll_(&m, demos, B, NULL, 0) : NAN;
        double loss = mtrl_train_sft_step(&m, &cfg, dp, B, 3e-3);
        if (s % 50 == 0) {
            TEST_CLOSE(loss, want, 1e-5, 1e-6);
            double pp[COPY_DIGITS + 1];
            double h = model_nll_(&m, held, H, pp, COPY_DIGITS + 1);
            printf("step %3d: train %.4f, held-out %.4f; per answer token:", s + 1, loss, h);
            for (int k = 0; k <= COPY_DIGITS; k++) printf(" %.2f", pp[k]);
            printf("\n");
        }
    }
    double pp[COPY_DIGITS + 1];
    double last = model_nll_(&m, held, H, pp, COPY_DIGITS + 1);
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
