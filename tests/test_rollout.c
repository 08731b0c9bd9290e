// mtrl-test: cpu
// The actor's batched rollout engine on the tiny backbone with the calc env:
//  - episodes are well formed (BOS + prompt as PROMPT tokens, MODEL tokens with log-probs <= 0
//    and the weight version, valid statuses, groups of G with one task seed);
//  - batched generation is batch-invariant: re-running any episode alone from its task seed and
//    episode id (mtrl_rollout_run_one, what replay --reexec does) reproduces it token for token.
#include <stdlib.h>
#include <string.h>

#include "actor/rollout.h"
#include "env/env_config.h"
#include "common/config.h"
#include "common/tokenizer.h"
#include "tests/testhelp.h"

typedef struct collected {
    mtrl_traj eps[64];
    int n, begun;
} collected;

static void on_begin(void *u, mtrl_traj *t) { (void)t; ((collected *)u)->begun++; }
static void on_end(void *u, mtrl_traj *t) {
    collected *c = u;
    if (c->n < 64) { mtrl_traj_init(&c->eps[c->n]); mtrl_traj_swap(&c->eps[c->n], t); c->n++; }
}

int main(void) {
    mtrl_config cfg;
    mtrl_config_errors errs = {0};
    const char *text = "[run]\nseed = 5\n[env]\nname = calc\n[actor]\nepisodes_in_flight = 6\nmax_tokens = 40\n"
                       "max_turn_tokens = 12\n[algo]\ngroup_size = 3\n";
    TEST_EQ_INT(mtrl_config_load_text(&cfg, "t.ini", text, NULL, 0, &errs), MTRL_OK);
    mtrl_config_errors_free(&errs);
    mtrl_model_dims d;
    mtrl_model_dims_from_config(&d, &cfg.model, MTRL_VOCAB, NULL);
    mtrl_model m;
    mtrl_model_init(&m, &d, 9);
    m.version = 3;
    mtrl_rollout_params p;
    mtrl_rollout_params_from_config(&p, &cfg, 1, 7);
    mtrl_rollout *r;
    mtrl_error err;
    TEST_EQ_INT(mtrl_rollout_init(&r, &p, &cfg, &m, &err), MTRL_OK);
    collected c = {0};
    mtrl_rollout_events ev = {&c, on_begin, on_end};
    int steps = 0;
    while (c.n < 12 && steps < 2000) {
        mtrl_rollout_step(r, &ev);
        steps++;
    }
    mtrl_rollout_stop_new(r);
    while (mtrl_rollout_step(r, &ev) > 0) {}
    TEST_CHECK(c.n >= 12);
    TEST_EQ_INT(c.begun, c.n);
    for (int i = 0; i < c.n; i++) {
        mtrl_traj *t = &c.eps[i];
        TEST_CHECK(t->n_tokens >= 2 && t->ids[0] == MTRL_TOK_BOS && t->kind[0] == MTRL_TOK_PROMPT);
        TEST_CHECK(t->n_tokens <= 40);
        TEST_CHECK(t->status == MTRL_EP_COMPLETE || t->status == MTRL_EP_TRUNCATED);
        int ok = 1;
        for (uint64_t k = 0; k < t->n_tokens; k++) {
            if (t->kind[k] == MTRL_TOK_MODEL) ok &= t->logprob[k] <= 0 && t->version[k] == 3;
        }
        TEST_CHECK(ok);
        TEST_EQ_STR(t->env, "calc");
        // groups: the 3 episodes of a group share the task seed
        for (int j = 0; j < c.n; j++)
            if (c.eps[j].group_id == t->group_id) TEST_CHECK(c.eps[j].task_seed == t->task_seed);
    }
    // Re-execute every episode alone: identical tokens, log-probs and status.
    mtrl_env *env;
    TEST_EQ_INT(mtrl_env_open_config(&cfg, &env, &err), MTRL_OK);
    for (int i = 0; i < c.n; i++) {
        mtrl_traj *t = &c.eps[i], again;
        mtrl_traj_init(&again);
        mtrl_rollout_run_one(&p, &m, env, t->task_seed, t->episode_id, t->group_id, &again, &err);
        int same = again.n_tokens == t->n_tokens && again.status == t->status;
        for (uint64_t k = 0; same && k < t->n_tokens; k++)
            same = again.ids[k] == t->ids[k] && again.logprob[k] == t->logprob[k] && again.kind[k] == t->kind[k];
        TEST_CHECKF(same, "episode %d (%llu tokens) differs when re-executed alone", i, (unsigned long long)t->n_tokens);
        mtrl_traj_free(&again);
    }
    mtrl_env_close(env);
    for (int i = 0; i < c.n; i++) mtrl_traj_free(&c.eps[i]);
    mtrl_rollout_free(r);
    mtrl_model_free(&m);
    return test_report();
}
