// mtrl-test: cpu timeout=300
// test_episode_mem.c: the actor's memory account of episodes in flight (actor/episode_mem.h) on
// the tiny backbone:
//  - the sizes by part (KDA state per head, conv windows, MLA latents per token) add up to what
//    a decode state allocates, the latents linear in the capacity;
//  - the account refuses a new episode before it would pass the budget (the used bytes never
//    exceed it), parks an idle episode in host memory to admit one when it may, and a growth
//    that no parking can make room for fails with the reason the episode is truncated with;
//  - an episode whose decode state went to host memory and back continues with the same tokens
//    (greedy, and the same logits bit for bit) as its twin that stayed, and so does one whose
//    state grew on demand;
//  - the rollout with a device budget, groups of 1 and 2: groups wait for room, states grow and
//    idle episodes are parked, the budget is never passed, and every episode is token for token
//    what it is when re-executed alone without any budget (mtrl_rollout_run_one, replay
//    --reexec); with a roomy budget nothing waits and a group's episodes share its prompt state.
#include <stdlib.h>
#include <string.h>

#include "actor/episode_mem.h"
#include "actor/rollout.h"
#include "common/config.h"
#include "common/tokenizer.h"
#include "env/env_config.h"
#include "kernels/ref/ops_ref.h"
#include "tests/testhelp.h"

static void model_of_(mtrl_config *cfg, mtrl_model *m, const char *text) {
    mtrl_config_errors errs = {0};
    mtrl_status st = mtrl_config_load_text(cfg, "t.ini", text, NULL, 0, &errs);
    if (st != MTRL_OK) mtrl_config_errors_print(&errs, stderr);
    mtrl_config_errors_free(&errs);
    TEST_EQ_INT(st, MTRL_OK);
    mtrl_model_dims d;
    mtrl_model_dims_from_config(&d, cfg, MTRL_VOCAB, NULL);
    mtrl_model_init(m, &d, 4);
}

static int argmax_(const real *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

// Greedy decode of n tokens from state s whose next-token logits are `logits` (updated).
static void greedy_(mtrl_model *m, mtrl_decode_state *s, real *logits, int n, uint32_t *out) {
    mtrl_decode_state *one[1] = {s};
    for (int i = 0; i < n; i++) {
        uint32_t t = (uint32_t)argmax_(logits, m->dims.V);
        out[i] = t;
        mtrl_model_decode(m, one, 1, &t, logits, NULL);
    }
}

static void test_account(void) {
    mtrl_config cfg;
    mtrl_model m;
    model_of_(&cfg, &m, "[env]\nname = calc\n");
    mtrl_epmem_sizes z;
    mtrl_epmem_sizes_of(&m, &z);
    printf("tiny: %d KDA layers x %d heads, %zu B of state per head; conv %zu B; MLA latents %zu B per token over %d "
           "layers\n",
           z.n_kda, z.heads, z.kda_state_per_head, z.conv, z.latent_per_token, z.n_mla);
    TEST_CHECK(z.n_kda > 0 && z.n_mla > 0 && z.latent_per_token > 0);
    TEST_EQ_INT(z.kda_state, z.kda_state_per_head * (size_t)z.heads * (size_t)z.n_kda);
    size_t b1 = mtrl_decode_state_bytes(&m, 1000), b2 = mtrl_decode_state_bytes(&m, 3000);
    TEST_EQ_INT(b2 - b1, 2000 * z.latent_per_token);
    size_t fixed = b1 - 1000 * z.latent_per_token;
    TEST_CHECKF(fixed >= z.kda_state + z.conv && fixed <= z.kda_state + z.conv + 4096, "fixed part %zu of %zu + %zu",
                fixed, z.kda_state, z.conv);

    // Room for three states of 1024 tokens and a little more: the fourth is refused.
    enum { N = 5 };
    mtrl_decode_state st[N];
    memset(st, 0, sizeof st);
    mtrl_decode_state *sp[N];
    for (int i = 0; i < N; i++) sp[i] = &st[i];
    size_t one = mtrl_decode_state_bytes(&m, 1024);
    mtrl_epmem a;
    mtrl_error err;
    TEST_EQ_INT(mtrl_epmem_init(&a, &m, sp, N, 4096, 3 * one + one / 2, 0, 64, &err), MTRL_OK);
    for (int i = 0; i < 3; i++) TEST_EQ_INT(mtrl_epmem_admit(&a, i, 1024, NULL, &err), MTRL_OK);
    TEST_EQ_INT(mtrl_epmem_admit(&a, 3, 1024, NULL, &err), MTRL_ERR_NOMEM);
    TEST_CONTAINS(err.msg, "device budget");
    TEST_CHECK(a.device_used <= a.device_budget && a.device_peak <= a.device_budget);
    TEST_EQ_INT(a.refusals, 1);
    TEST_EQ_INT(a.slot[3].where, MTRL_EPMEM_NONE);
    // Idle slot 1 may be parked, but there is no host budget: still refused.
    uint8_t idle[N] = {0, 1, 0, 0, 0};
    TEST_EQ_INT(mtrl_epmem_admit(&a, 3, 1024, idle, &err), MTRL_ERR_NOMEM);
    mtrl_epmem_free(&a);

    // With a host budget the idle episode goes to host memory and the new one is admitted.
    TEST_EQ_INT(mtrl_epmem_init(&a, &m, sp, N, 4096, 3 * one + one / 2, 64u << 20, 64, &err), MTRL_OK);
    for (int i = 0; i < 3; i++) TEST_EQ_INT(mtrl_epmem_admit(&a, i, 1024, NULL, &err), MTRL_OK);
    TEST_EQ_INT(mtrl_epmem_admit(&a, 3, 1024, idle, &err), MTRL_OK);
    TEST_EQ_INT(a.slot[1].where, MTRL_EPMEM_HOST);
    TEST_EQ_INT(a.parks, 1);
    TEST_CHECK(a.device_peak <= a.device_budget);
    // Slot 1 cannot come back while the others stay; when slot 2 ends it can.
    TEST_EQ_INT(mtrl_epmem_unpark(&a, 1, 0, NULL, &err), MTRL_ERR_NOMEM);
    TEST_CHECK(mtrl_epmem_parked(&a, 1));
    mtrl_epmem_release(&a, 2);
    TEST_EQ_INT(mtrl_epmem_unpark(&a, 1, 0, NULL, &err), MTRL_OK);
    TEST_EQ_INT(a.host_used, 0);
    // A growth nothing can make room for: the reason the rollout truncates the episode with.
    TEST_EQ_INT(mtrl_epmem_reserve(&a, 0, 3000, NULL, &err), MTRL_ERR_NOMEM);
    TEST_CONTAINS(err.msg, "growing an episode's decode state");
    TEST_EQ_INT(mtrl_epmem_reserve(&a, 0, 5000, NULL, &err), MTRL_ERR_LIMIT);
    TEST_CHECK(a.device_peak <= a.device_budget);
    mtrl_epmem_free(&a);

    // Host and back, and grown on demand, against a twin that stayed: the same greedy tokens.
    TEST_EQ_INT(mtrl_epmem_init(&a, &m, sp, N, 4096, 64u << 20, 64u << 20, 64, &err), MTRL_OK);
    for (int i = 0; i < 3; i++) TEST_EQ_INT(mtrl_epmem_admit(&a, i, i == 2 ? 64 : 1024, NULL, &err), MTRL_OK);
    TEST_EQ_INT(st[2].cap, 64);
    uint32_t prompt[60];
    for (int i = 0; i < 60; i++) prompt[i] = (uint32_t)(1 + (i * 37) % 200);
    int V = m.dims.V;
    real *lg[3];
    for (int i = 0; i < 3; i++) {
        lg[i] = calloc((size_t)V, sizeof(real));
        mtrl_model_prefill(&m, &st[i], prompt, 60, lg[i], NULL);
    }
    // slot 2 (capacity 64) grows to take the tokens it is about to decode
    TEST_EQ_INT(mtrl_epmem_reserve(&a, 2, 60 + 80, NULL, &err), MTRL_OK);
    TEST_CHECK(st[2].cap >= 140 && a.grows == 1);
    TEST_EQ_INT(mtrl_epmem_park(&a, 1, &err), MTRL_OK);
    TEST_CHECK(st[1].block == NULL && a.host_used > 0);
    uint32_t t0[80], t1[80], t2[80];
    greedy_(&m, &st[0], lg[0], 40, t0); // slot 0 decodes while slot 1 is parked
    TEST_EQ_INT(mtrl_epmem_unpark(&a, 1, 0, NULL, &err), MTRL_OK);
    greedy_(&m, &st[1], lg[1], 40, t1);
    greedy_(&m, &st[2], lg[2], 40, t2);
    TEST_CHECK(!memcmp(t0, t1, sizeof(uint32_t) * 40));
    TEST_CHECK(!memcmp(t0, t2, sizeof(uint32_t) * 40));
    TEST_CHECK(!memcmp(lg[0], lg[1], sizeof(real) * (size_t)V));
    TEST_CHECK(!memcmp(lg[0], lg[2], sizeof(real) * (size_t)V));
    // park again mid-way, then on
    TEST_EQ_INT(mtrl_epmem_park(&a, 1, &err), MTRL_OK);
    greedy_(&m, &st[0], lg[0], 40, t0);
    TEST_EQ_INT(mtrl_epmem_unpark(&a, 1, 0, NULL, &err), MTRL_OK);
    greedy_(&m, &st[1], lg[1], 40, t1);
    TEST_CHECK(!memcmp(t0, t1, sizeof(uint32_t) * 40));
    TEST_CHECK(!memcmp(lg[0], lg[1], sizeof(real) * (size_t)V));
    TEST_EQ_INT(a.parks, 2);
    TEST_EQ_INT(a.unparks, 2);
    for (int i = 0; i < 3; i++) free(lg[i]);
    mtrl_epmem_free(&a);
    mtrl_model_free(&m);
}

typedef struct collected {
    mtrl_traj eps[64];
    int n;
} collected;

static void on_end(void *u, mtrl_traj *t) {
    collected *c = u;
    if (c->n < 64) {
        mtrl_traj_init(&c->eps[c->n]);
        mtrl_traj_swap(&c->eps[c->n], t);
        c->n++;
    }
}

// G: episodes per group (G > 1: the group's later episodes copy the first one's prompt state,
// or prefill it themselves when the copy does not fit). roomy: a budget of 8 whole episodes, in
// which nothing waits. rounds: [actor] prefill_rounds (0: every feed before the next decode, the
// schedule the parks and refusals below were counted with; 1: one 8192-token round a step, the
// default, where the schedule differs and only the budget and the tokens are checked).
static void test_rollout_budget(int G, int roomy, int rounds) {
    int doc = 3000;
    char text[512];
    snprintf(text, sizeof text,
             "[run]\nseed = 3\n[env]\nname = retrieval\ninline_doc = true\ndoc_tokens = %d\nmax_tool_calls = 0\n"
             "[actor]\nepisodes_in_flight = 4\nmax_tokens = %d\nmax_turn_tokens = 24\n[algo]\ngroup_size = %d\n",
             doc, doc + 96, G);
    mtrl_config cfg;
    mtrl_model m;
    model_of_(&cfg, &m, text);
    mtrl_rollout_params p;
    mtrl_rollout_params_from_config(&p, &cfg, 1, 2);
    // Room for two whole episodes and a little: four in flight need to wait and park.
    size_t full = mtrl_decode_state_bytes(&m, doc + 96);
    p.device_budget = roomy ? 8 * full : 2 * full + full / 4;
    p.host_budget = 64u << 20;
    p.max_groups = (uint64_t)(8 / G);
    p.prefill_rounds = rounds;
    mtrl_rollout *r;
    mtrl_error err;
    TEST_EQ_INT(mtrl_rollout_init(&r, &p, &cfg, &m, &err), MTRL_OK);
    collected c = {0};
    mtrl_rollout_events ev = {&c, NULL, on_end, NULL};
    for (int guard = 0; c.n < 8 && guard < 100000; guard++) mtrl_rollout_step(r, &ev);
    const mtrl_epmem *a = mtrl_rollout_mem(r);
    TEST_CHECK(a != NULL);
    printf("G = %d, prefill_rounds %d: rollout with a device budget of %.2f MiB (a whole episode %.2f MiB): %d episodes, peak %.2f MiB, %llu "
           "parks, %llu unparks, %llu grows, %llu refusals\n",
           G, rounds, (double)a->device_budget / (1 << 20), (double)full / (1 << 20), c.n, (double)a->device_peak / (1 << 20),
           (unsigned long long)a->parks, (unsigned long long)a->unparks, (unsigned long long)a->grows,
           (unsigned long long)a->refusals);
    TEST_EQ_INT(c.n, 8);
    TEST_CHECK(a->device_peak <= a->device_budget);
    TEST_CHECK(a->unparks == a->parks);
    TEST_CHECK(a->grows > 0);
    if (roomy) TEST_CHECK(a->parks == 0 && a->refusals == 0);
    else if (!rounds) TEST_CHECK(a->parks > 0 && a->refusals > 0);
    // Every episode as it is alone, with a state of max_tokens and no budget.
    mtrl_rollout_params alone = p;
    alone.device_budget = alone.host_budget = 0;
    mtrl_env *env;
    TEST_EQ_INT(mtrl_env_open_config(&cfg, &env, &err), MTRL_OK);
    for (int i = 0; i < c.n; i++) {
        mtrl_traj *t = &c.eps[i], again;
        mtrl_traj_init(&again);
        TEST_CHECK(t->n_tokens > (uint64_t)doc);
        mtrl_rollout_run_one(&alone, &m, env, t->task_seed, t->episode_id, t->group_id, &again, &err);
        int same = again.n_tokens == t->n_tokens && again.status == t->status && again.reward == t->reward;
        for (uint64_t k = 0; same && k < t->n_tokens; k++)
            same = again.ids[k] == t->ids[k] && again.logprob[k] == t->logprob[k];
        TEST_CHECKF(same, "episode %d (%llu tokens, %s: %s) differs from its run alone (%llu tokens)", i,
                    (unsigned long long)t->n_tokens, mtrl_ep_status_name(t->status), t->reason ? t->reason : "",
                    (unsigned long long)again.n_tokens);
        mtrl_traj_free(&again);
        mtrl_traj_free(t);
    }
    mtrl_env_close(env);
    mtrl_rollout_free(r);
    mtrl_model_free(&m);
}

int main(void) {
    test_account();
    test_rollout_budget(1, 0, 0);
    test_rollout_budget(2, 0, 0);
    test_rollout_budget(2, 1, 0);
    test_rollout_budget(2, 0, 1);
    return test_report();
}
