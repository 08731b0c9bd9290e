// mtrl-test: cpu
// The actor's batched rollout engine on the tiny backbone with the calc env:
//  - episodes are well formed (BOS + prompt as PROMPT tokens, MODEL tokens with log-probs <= 0
//    and the weight version, valid statuses, groups of G with one task seed);
//  - batched generation is batch-invariant: re-running any episode alone from its task seed and
//    episode id (mtrl_rollout_run_one, what replay --reexec does) reproduces it token for token,
//    and after a warm-up, when episodes call the tool, with the same status, reward and calls
//    (the engine prefills the prompts and tool results of a step together);
//  - snapshot/resume: an in-flight episode (after a short warm-up, so it uses the calc tool)
//    snapshotted mid-way and resumed in a fresh rollout continues with exactly the tokens the
//    uninterrupted episode produced; a corrupt snapshot is refused;
//  - a prompt longer than two prefill segments (a retrieval document) is prefilled in rounds with
//    the tick callback between them (the actor's heartbeats), and the episodes are the same as
//    when re-executed alone (one whole prefill).
#include <stdlib.h>
#include <string.h>

#include "actor/rollout.h"
#include "common/rng.h"
#include "learner/train.h"
#include "env/env_config.h"
#include "common/config.h"
#include "common/tokenizer.h"
#include "tests/testhelp.h"

typedef struct collected {
    mtrl_traj eps[64];
    int n, begun, ticks;
} collected;

static void on_begin(void *u, mtrl_traj *t) { (void)t; ((collected *)u)->begun++; }
static void on_end(void *u, mtrl_traj *t) {
    collected *c = u;
    if (c->n < 64) { mtrl_traj_init(&c->eps[c->n]); mtrl_traj_swap(&c->eps[c->n], t); c->n++; }
}

// The experiment `text`, the tiny model of its [model] (init seed model_seed) and the rollout
// parameters of actor 1 (sampling seed sample_seed).
typedef struct fixture {
    mtrl_config cfg;
    mtrl_model m;
    mtrl_rollout_params p;
} fixture;

static void fixture_init_(fixture *f, const char *text, uint64_t model_seed, uint64_t sample_seed) {
    mtrl_config_errors errs = {0};
    TEST_EQ_INT(mtrl_config_load_text(&f->cfg, "t.ini", text, NULL, 0, &errs), MTRL_OK);
    mtrl_config_errors_free(&errs);
    mtrl_model_dims d;
    mtrl_model_dims_from_config(&d, &f->cfg, MTRL_VOCAB, NULL);
    mtrl_model_init(&f->m, &d, model_seed);
    mtrl_rollout_params_from_config(&f->p, &f->cfg, 1, sample_seed);
}

// Re-executes t alone (mtrl_rollout_run_one, what replay --reexec does): 1 when its tokens,
// log-probs, kinds, status, reward and tool calls are all the same. *reward_again: the rerun's.
static int same_alone_(const fixture *f, mtrl_model *m, mtrl_env *env, const mtrl_traj *t, double *reward_again) {
    mtrl_traj again;
    mtrl_traj_init(&again);
    mtrl_error err;
    mtrl_rollout_run_one(&f->p, m, env, t->task_seed, t->episode_id, t->group_id, &again, &err);
    int same = again.n_tokens == t->n_tokens && again.status == t->status && again.reward == t->reward &&
               again.n_tools == t->n_tools;
    for (uint64_t k = 0; same && k < t->n_tokens; k++)
        same = again.ids[k] == t->ids[k] && again.logprob[k] == t->logprob[k] && again.kind[k] == t->kind[k];
    if (reward_again) *reward_again = again.reward;
    mtrl_traj_free(&again);
    return same;
}

static void on_tick(void *u) { ((collected *)u)->ticks++; }

// A retrieval document of 2.5 prefill segments inline in the prompt, two episodes of one group.
static void long_prompt_case_(void) {
    char text[512];
    int doc = MTRL_PREFILL_SEGMENT * 5 / 2;
    snprintf(text, sizeof text,
             "[run]\nseed = 3\n[env]\nname = retrieval\ninline_doc = true\ndoc_tokens = %d\n[actor]\n"
             "episodes_in_flight = 2\nmax_tokens = %d\nmax_turn_tokens = 8\n[algo]\ngroup_size = 2\n",
             doc, doc + 96);
    fixture f;
    fixture_init_(&f, text, 4, 2);
    mtrl_config *cfg = &f.cfg;
    mtrl_model *m = &f.m;
    const mtrl_rollout_params *p = &f.p;
    mtrl_rollout *r;
    mtrl_error err;
    TEST_EQ_INT(mtrl_rollout_init(&r, p, cfg, m, &err), MTRL_OK);
    collected c = {0};
    mtrl_rollout_events ev = {&c, NULL, on_end, on_tick};
    mtrl_rollout_step(r, &ev);
    int ticks = c.ticks;
    mtrl_rollout_stop_new(r);
    while (mtrl_rollout_step(r, &ev) > 0) {}
    printf("long prompt of %d tokens: %d ticks in its prefill, %d episodes\n", doc, ticks, c.n);
    TEST_CHECKF(ticks >= 2, "%d ticks while prefilling %d tokens in segments of %d", ticks, doc, MTRL_PREFILL_SEGMENT);
    TEST_EQ_INT(c.n, 2);
    mtrl_env *env;
    TEST_EQ_INT(mtrl_env_open_config(cfg, &env, &err), MTRL_OK);
    for (int i = 0; i < c.n; i++) {
        mtrl_traj *t = &c.eps[i];
        TEST_CHECK(t->n_tokens > (uint64_t)doc);
        TEST_CHECKF(same_alone_(&f, m, env, t, NULL), "long-prompt episode %d (%llu tokens) differs when re-executed alone",
                    i, (unsigned long long)t->n_tokens);
        mtrl_traj_free(t);
    }
    mtrl_env_close(env);
    mtrl_rollout_free(r);
    mtrl_model_free(m);
}

int main(void) {
    fixture f;
    fixture_init_(&f,
                  "[run]\nseed = 5\n[env]\nname = calc\n[actor]\nepisodes_in_flight = 6\nmax_tokens = 40\n"
                  "max_turn_tokens = 12\n[algo]\ngroup_size = 3\n",
                  9, 7);
    mtrl_config *cfg = &f.cfg;
    mtrl_model *m = &f.m;
    m->version = 3;
    const mtrl_rollout_params *p = &f.p;
    mtrl_rollout *r;
    mtrl_error err;
    TEST_EQ_INT(mtrl_rollout_init(&r, p, cfg, m, &err), MTRL_OK);
    collected c = {0};
    mtrl_rollout_events ev = {&c, on_begin, on_end, NULL};
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
    TEST_EQ_INT(mtrl_env_open_config(cfg, &env, &err), MTRL_OK);
    for (int i = 0; i < c.n; i++)
        TEST_CHECKF(same_alone_(&f, m, env, &c.eps[i], NULL), "episode %d (%llu tokens) differs when re-executed alone", i,
                    (unsigned long long)c.eps[i].n_tokens);
    // Snapshot / resume. A short supervised warm-up first, so episodes call the calc tool.
    // (the quickstart's: enough that some answers are right, so rewards can tell turns apart)
    for (int s = 0; s < 90; s++) {
        mtrl_traj demos[16], *dp[16];
        for (int i = 0; i < 16; i++) {
            mtrl_traj_init(&demos[i]);
            TEST_EQ_INT(mtrl_train_demo_episode(env, 100 + 16 * (uint64_t)s + (uint64_t)i, 40, &demos[i], &err), MTRL_OK);
            dp[i] = &demos[i];
        }
        mtrl_train_sft_step(m, cfg, dp, 16, 5e-3);
        for (int i = 0; i < 16; i++) mtrl_traj_free(&demos[i]);
    }
    mtrl_env_close(env);
    for (int i = 0; i < c.n; i++) mtrl_traj_free(&c.eps[i]);
    mtrl_rollout_free(r);
    int snaps = 0, with_tools = 0, alone = 0, alone_tools = 0, alone_rewarded = 0;
    for (int round = 0; round < 6; round++) {
        TEST_EQ_INT(mtrl_rollout_init(&r, p, cfg, m, &err), MTRL_OK);
        collected a = {0};
        mtrl_rollout_events eva = {&a, NULL, on_end, NULL};
        // Run a few steps into the first groups (further each round), snapshot every live slot.
        for (int k = 0; k < 6 + 3 * round; k++) mtrl_rollout_step(r, &eva);
        mtrl_wbuf snap[6];
        uint64_t ids[6];
        int live[6];
        for (int i = 0; i < 6; i++) {
            mtrl_wbuf_init(&snap[i]);
            mtrl_traj *t = mtrl_rollout_slot(r, i);
            live[i] = t != NULL;
            if (!live[i]) continue;
            ids[i] = t->episode_id;
            with_tools += t->n_tools > 0;
            TEST_EQ_INT(mtrl_rollout_snapshot(r, i, &snap[i], &err), MTRL_OK);
        }
        // Uninterrupted: run everything to the end.
        mtrl_rollout_stop_new(r);
        while (mtrl_rollout_step(r, &eva) > 0) {}
        // The batched engine (prompts and tool results prefilled together at the end of a step)
        // == each episode alone, now that they call the tool: tokens, status, reward, tool calls.
        mtrl_env *env1;
        TEST_EQ_INT(mtrl_env_open_config(cfg, &env1, &err), MTRL_OK);
        for (int k = 0; k < a.n; k++) {
            mtrl_traj *x = &a.eps[k];
            double r_again;
            int same = same_alone_(&f, m, env1, x, &r_again);
            TEST_CHECKF(same, "episode %llu (%u tool calls, reward %g) differs when re-executed alone (reward %g)",
                        (unsigned long long)x->episode_id, x->n_tools, x->reward, r_again);
            alone += same;
            alone_tools += same && x->n_tools > 0;
            alone_rewarded += same && x->n_tools > 0 && x->reward > 0;
        }
        mtrl_env_close(env1);
        // Resumed: a fresh rollout, each snapshot into its slot.
        mtrl_rollout *r2;
        TEST_EQ_INT(mtrl_rollout_init(&r2, p, cfg, m, &err), MTRL_OK);
        mtrl_rollout_stop_new(r2);
        collected b = {0};
        mtrl_rollout_events evb = {&b, NULL, on_end, NULL};
        for (int i = 0; i < 6; i++)
            if (live[i]) TEST_EQ_INT(mtrl_rollout_resume(r2, i, snap[i].data, snap[i].len, &err), MTRL_OK);
        while (mtrl_rollout_step(r2, &evb) > 0) {}
        for (int i = 0; i < 6; i++) {
            if (!live[i]) continue;
            mtrl_traj *x = NULL, *y = NULL;
            for (int k = 0; k < a.n; k++) if (a.eps[k].episode_id == ids[i]) x = &a.eps[k];
            for (int k = 0; k < b.n; k++) if (b.eps[k].episode_id == ids[i]) y = &b.eps[k];
            TEST_CHECK(x && y);
            if (!x || !y) continue;
            char why[256] = "";
            int same = x->n_tokens == y->n_tokens && x->status == y->status && x->reward == y->reward;
            for (uint64_t k = 0; same && k < x->n_tokens; k++) same = x->ids[k] == y->ids[k] && x->logprob[k] == y->logprob[k];
            TEST_CHECKF(same, "resumed episode %llu differs from the uninterrupted one %s", (unsigned long long)ids[i], why);
            snaps++;
        }
        // A flipped byte is refused (CRC), and so is a resume into a busy slot.
        for (int i = 0; i < 6; i++)
            if (live[i] && snap[i].len > 100) {
                snap[i].data[60] ^= 1;
                mtrl_rollout *r3;
                mtrl_rollout_init(&r3, p, cfg, m, &err);
                TEST_EQ_INT(mtrl_rollout_resume(r3, i, snap[i].data, snap[i].len, &err), MTRL_ERR_FORMAT);
                TEST_CONTAINS(err.msg, "CRC");
                mtrl_rollout_free(r3);
                break;
            }
        for (int i = 0; i < 6; i++) mtrl_wbuf_free(&snap[i]);
        for (int k = 0; k < a.n; k++) mtrl_traj_free(&a.eps[k]);
        for (int k = 0; k < b.n; k++) mtrl_traj_free(&b.eps[k]);
        mtrl_rollout_free(r2);
        mtrl_rollout_free(r);
    }
    printf("snapshot/resume: %d episodes resumed identically, %d snapshots taken after a tool call\n", snaps, with_tools);
    printf("after the warm-up: %d episodes identical when re-executed alone, %d of them with tool calls, %d of those "
           "rewarded\n", alone, alone_tools, alone_rewarded);
    TEST_CHECK(alone_tools >= 1 && alone_rewarded >= 1);
    TEST_CHECK(snaps >= 6);
    TEST_CHECK(with_tools >= 1);
    mtrl_model_free(m);
    long_prompt_case_();
    return test_report();
}
