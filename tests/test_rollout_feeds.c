// mtrl-test: cpu
// test_rollout_feeds.c: [actor] prefill_rounds with long TOOL RESULTS (actor/rollout.c flush_):
// the tiny backbone (two layers), biased to call tools (the lm_head rows of TOOL_OPEN / TOOL_CLOSE
// / EOS get a large weight on a residual dimension every embedding sets high), plays the long_obs
// plug-in (tests/fixtures/env/long_obs_env.c), whose first tool result of an episode is
// OBS_BYTES bytes: with the byte tokenizer more than one 8192-token prefill segment (its later
// results are short). Four episodes in flight, groups of 1, run twice:
//  - prefill_rounds = 1: no step prefills more than one segment (8192 tokens) of tool results,
//    results stay pending across steps, and in steps that begin with a result pending the other
//    episodes decode (the batch is not stalled) while the waiting one gains no token;
//  - prefill_rounds = 0: some step prefills more than one segment (the long feeds exist) and no
//    result is ever pending at the end of a step (every feed before the next decode);
//  - every episode is the same in both runs (ids and log-probs bit for bit, status, reward) and
//    equal to its run alone (mtrl_rollout_run_one, replay --reexec): the schedule changes no token.
#include <stdlib.h>
#include <string.h>

#include "actor/rollout.h"
#include "common/config.h"
#include "common/tokenizer.h"
#include "env/env_config.h"
#include "model/model_plan.h"
#include "tests/testhelp.h"

enum { SLOTS = 4, OBS_BYTES = 8500 };

static char experiment[2048];

typedef struct collected {
    mtrl_traj eps[16];
    int n;
} collected;

static void on_end(void *u, mtrl_traj *t) {
    collected *c = u;
    if (c->n < 16) {
        mtrl_traj_init(&c->eps[c->n]);
        mtrl_traj_swap(&c->eps[c->n], t);
        c->n++;
    }
}

// What one rollout did, step by step.
typedef struct run_stats {
    int steps;
    uint64_t prompt_tokens;       // prefilled at the first step (every group starts there)
    uint64_t feed_tokens;         // tool results prefilled, all steps
    uint64_t max_step_feed;       // the most tool-result tokens one step prefilled
    int pending_steps;            // steps that ended with a tool result (partly) unfed
    int decoded_while_pending;    // steps that began with a result pending and decoded others
    uint64_t decode_while_pending; // ... the tokens those steps decoded
    int waiting_grew;             // episodes that gained a token in a step they began pending in
    int long_feeds;               // tool results longer than one segment, over all episodes
} run_stats;

// Slot i's tool result is queued and not yet (all) in the state: the trajectory has the call's
// TOOL_CLOSE (the call is recorded) but fewer framed results than calls, since a result's tokens
// join the trajectory when the whole of it is fed.
static int pending_(mtrl_rollout *r, int i) {
    const mtrl_traj *t = mtrl_rollout_slot(r, i);
    if (!t) return 0;
    uint32_t results = 0;
    for (uint64_t k = 0; k < t->n_tokens; k++) results += t->ids[k] == MTRL_TOK_RESULT_OPEN && t->kind[k] == MTRL_TOK_TOOL;
    return t->n_tools > results;
}

static void run_(const mtrl_config *cfg, mtrl_model *m, int rounds, collected *c, run_stats *rs) {
    mtrl_rollout_params p;
    mtrl_rollout_params_from_config(&p, cfg, 1, 0);
    mtrl_rollout_times tm;
    memset(&tm, 0, sizeof tm);
    p.times = &tm;
    p.max_groups = SLOTS;
    p.prefill_rounds = rounds;
    mtrl_rollout *r;
    mtrl_error err;
    TEST_CHECKF(mtrl_rollout_init(&r, &p, cfg, m, &err) == MTRL_OK, "%s", err.msg);
    memset(rs, 0, sizeof *rs);
    mtrl_rollout_events ev = {c, NULL, on_end, NULL};
    int was_pending[SLOTS] = {0};
    uint64_t n_model[SLOTS] = {0};
    for (int live = 1; live && rs->steps < 100000; rs->steps++) {
        uint64_t pf = tm.prefill_tokens, dc = tm.decode_tokens;
        int any_pending = 0;
        for (int i = 0; i < SLOTS; i++) {
            any_pending |= was_pending[i];
            const mtrl_traj *t = mtrl_rollout_slot(r, i);
            n_model[i] = t ? t->n_model : 0;
        }
        live = mtrl_rollout_step(r, &ev);
        uint64_t fed = tm.prefill_tokens - pf;
        if (rs->steps == 0) { // the prompts of every group, whole; no tool call can be made yet
            for (int i = 0; i < SLOTS; i++) {
                const mtrl_traj *t = mtrl_rollout_slot(r, i);
                for (uint64_t k = 0; t && k < t->n_tokens; k++) rs->prompt_tokens += t->kind[k] == MTRL_TOK_PROMPT;
            }
            TEST_EQ_INT(fed, rs->prompt_tokens);
            fed -= rs->prompt_tokens;
        }
        rs->feed_tokens += fed;
        if (fed > rs->max_step_feed) rs->max_step_feed = fed;
        if (any_pending && tm.decode_tokens > dc) {
            rs->decoded_while_pending++;
            rs->decode_while_pending += tm.decode_tokens - dc;
        }
        int pend_now = 0;
        for (int i = 0; i < SLOTS; i++) {
            const mtrl_traj *t = mtrl_rollout_slot(r, i);
            if (was_pending[i] && t && t->n_model > n_model[i]) rs->waiting_grew++;
            was_pending[i] = pending_(r, i);
            pend_now |= was_pending[i];
        }
        rs->pending_steps += pend_now;
    }
    for (int e = 0; e < c->n; e++) {
        const mtrl_traj *t = &c->eps[e];
        for (uint32_t k = 0; k < t->n_tools; k++) rs->long_feeds += t->tools[k].result_len > MTRL_PREFILL_SEGMENT;
    }
    printf("prefill_rounds %d: %d episodes in %d steps; prompts %llu tokens; tool results %llu tokens (%d over one "
           "segment), at most %llu in one step; %d steps ended with a result pending; %d steps began with one "
           "pending and decoded %llu tokens of the others; %llu decode tokens in %llu decode steps\n",
           rounds, c->n, rs->steps, (unsigned long long)rs->prompt_tokens, (unsigned long long)rs->feed_tokens,
           rs->long_feeds, (unsigned long long)rs->max_step_feed, rs->pending_steps, rs->decoded_while_pending,
           (unsigned long long)rs->decode_while_pending, (unsigned long long)tm.decode_tokens,
           (unsigned long long)tm.decode_steps);
    mtrl_rollout_free(r);
}

static const mtrl_traj *by_id_(const collected *c, uint64_t id) {
    for (int e = 0; e < c->n; e++)
        if (c->eps[e].episode_id == id) return &c->eps[e];
    return NULL;
}

static int same_(const mtrl_traj *a, const mtrl_traj *b) {
    if (a->n_tokens != b->n_tokens || a->status != b->status || a->reward != b->reward || a->n_tools != b->n_tools)
        return 0;
    for (uint64_t k = 0; k < a->n_tokens; k++)
        if (a->ids[k] != b->ids[k] || a->logprob[k] != b->logprob[k] || a->kind[k] != b->kind[k]) return 0;
    return 1;
}

// The random tiny backbone makes tool calls rarely; this one makes them every few tokens: every
// embedding gets a large value in dimension 0, so the final norm's output there is large and
// positive whatever the context, and the lm_head rows of the call's tokens (and, less, EOS) get a
// weight on it that acts as a bias of their logits. The rest of the weights stay as they were,
// so the logits still depend on the context.
static void bias_to_tools_(mtrl_model *m) {
    int d = m->dims.d;
    for (int t = 0; t < m->dims.V; t++) m->P.embed[(size_t)t * d] = 8.0f;
    m->P.lm_head[(size_t)MTRL_TOK_TOOL_OPEN * d] = 1.0f;
    m->P.lm_head[(size_t)MTRL_TOK_TOOL_CLOSE * d] = 1.0f;
    m->P.lm_head[(size_t)MTRL_TOK_EOS * d] = 0.3f;
}

int main(void) {
    const char *b = getenv("MTRL_BUILD");
    snprintf(experiment, sizeof experiment,
             "[run]\nseed = 5\n[env]\nname = plugin\nplugin = %s/lib/libmtrl_env_long_obs.so\nisolate = false\n"
             "args = obs_bytes=%d;long_calls=1\nmax_tool_calls = 4\n[actor]\nepisodes_in_flight = %d\nmax_tokens = 65536\n"
             "max_turn_tokens = 48\n[algo]\ngroup_size = 1\n[model]\nlayers = 2\n",
             b ? b : ".", OBS_BYTES, SLOTS);
    mtrl_config cfg;
    mtrl_config_errors errs = {0};
    mtrl_status st = mtrl_config_load_text(&cfg, "feeds.ini", experiment, NULL, 0, &errs);
    if (st != MTRL_OK) mtrl_config_errors_print(&errs, stderr);
    mtrl_config_errors_free(&errs);
    TEST_EQ_INT(st, MTRL_OK);
    mtrl_model_dims d;
    mtrl_error err;
    TEST_EQ_INT(mtrl_model_dims_from_config(&d, &cfg, MTRL_VOCAB, &err), MTRL_OK);
    mtrl_model m;
    mtrl_model_init(&m, &d, 4);
    bias_to_tools_(&m);

    collected one = {0}, all = {0};
    run_stats s1, s0;
    run_(&cfg, &m, 1, &one, &s1);
    run_(&cfg, &m, 0, &all, &s0);
    TEST_EQ_INT(one.n, SLOTS);
    TEST_EQ_INT(all.n, SLOTS);
    // The long feeds exist: with every feed before the next decode, a step prefills more than one
    // segment; with one round a step, none does, and results wait across steps while the others
    // decode.
    TEST_CHECKF(s0.long_feeds >= SLOTS, "%d tool results over one segment", s0.long_feeds);
    TEST_CHECKF(s0.max_step_feed > MTRL_PREFILL_SEGMENT, "rounds 0: at most %llu tokens in a step",
                (unsigned long long)s0.max_step_feed);
    TEST_EQ_INT(s0.pending_steps, 0);
    TEST_EQ_INT(s0.decoded_while_pending, 0);
    TEST_CHECKF(s1.max_step_feed <= MTRL_PREFILL_SEGMENT, "rounds 1: %llu tokens of tool results in one step",
                (unsigned long long)s1.max_step_feed);
    TEST_CHECK(s1.pending_steps > 0);
    TEST_CHECK(s1.decoded_while_pending > 0);
    TEST_EQ_INT(s1.waiting_grew, 0);
    TEST_EQ_INT(s1.feed_tokens, s0.feed_tokens);
    TEST_EQ_INT(s1.prompt_tokens, s0.prompt_tokens);

    // The same tokens either way, and alone.
    mtrl_rollout_params p;
    mtrl_rollout_params_from_config(&p, &cfg, 1, 0);
    mtrl_env *env;
    TEST_CHECKF(mtrl_env_open_config(&cfg, &env, &err) == MTRL_OK, "%s", err.msg);
    for (int e = 0; e < one.n; e++) {
        const mtrl_traj *t = &one.eps[e], *u = by_id_(&all, t->episode_id);
        TEST_CHECKF(u && same_(t, u), "episode %llx (%llu tokens, %s) differs between prefill_rounds 1 and 0",
                    (unsigned long long)t->episode_id, (unsigned long long)t->n_tokens, mtrl_ep_status_name(t->status));
        mtrl_traj alone;
        mtrl_traj_init(&alone);
        mtrl_rollout_run_one(&p, &m, env, t->task_seed, t->episode_id, t->group_id, &alone, &err);
        TEST_CHECKF(same_(t, &alone), "episode %llx (%llu tokens) differs from its run alone (%llu tokens)",
                    (unsigned long long)t->episode_id, (unsigned long long)t->n_tokens,
                    (unsigned long long)alone.n_tokens);
        printf("episode %d: %llu tokens (%llu model), %u tool calls, %s, reward %.0f; the same in both runs and alone\n",
               e, (unsigned long long)t->n_tokens, (unsigned long long)t->n_model, t->n_tools,
               mtrl_ep_status_name(t->status), t->reward);
        mtrl_traj_free(&alone);
    }
    mtrl_env_close(env);
    for (int e = 0; e < one.n; e++) mtrl_traj_free(&one.eps[e]);
    for (int e = 0; e < all.n; e++) mtrl_traj_free(&all.eps[e]);
    mtrl_model_free(&m);
    return test_report();
}
