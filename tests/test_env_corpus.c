// mtrl-test: cpu timeout=120
// test_env_corpus.c: the built-in `corpus` env (env/builtin/corpus.c), the many-turn env of
// issue 23, through the host API:
//  - every task (chain, sum, latest) over several seeds: the demo reaches reward 1 with no tool
//    error, and a wrong answer gets 0;
//  - long horizons: a chain of 32 hops and a sum over 60 records each make >= 50 tool calls, and
//    the chain's demo episode grows past 100K tokens through its results;
//  - determinism and replay: the demo episode of a seed, built as the warm-up builds it
//    (mtrl_train_demo_episode: every tool result in the token stream), is token for token the
//    same from a second instance that first ran other seeds, and from an isolated env (a child
//    process), with >= 50 tool calls;
//  - the tools: grep's pages continue where the previous stopped, open's header and bounds,
//    list's pages, malformed and unknown calls are observations with tool_error, the tool-call
//    limit ends the episode;
//  - credit=c: a wrong answer earns c x the fraction of the task's facts its open() results
//    showed whole (each fact counted once, a page that cuts a fact's line short does not count),
//    the right answer 1, and credit=0 a wrong answer 0 whatever was opened;
//  - trail: a policy that only reads the end of each first page (open(id,0), then the id its
//    next= line names, until next=end, then the code on the line above) solves every seed, and
//    its pages are exactly max_obs_bytes, end with the code= and next= lines, and every file has
//    one size; the demo is that policy; hops_min..hops draws each episode's hops over the whole
//    range; credit counts the files on the trail opened;
//  - config refusals name the key; the stage keys reach the env (mtrl_config_stage);
//  - generation of a 16 MiB corpus takes well under a second;
//  - experiments/agent-1m.ini's ladder: at every stage the demo episodes
//    fit the stage's context with room for the model's own tokens, and at the last stage they
//    make >= 100 tool calls and >= 512K tokens;
//  - the plug-in example of the same kind (env/examples/notes.c, build/lib/libmtrl_env_notes.so):
//    its demo of 30 hops (62 tool calls) reaches reward 1, in-process and isolated alike, token
//    for token; a wrong answer gets 0; a bad key is refused by name.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "common/timeutil.h"
#include "common/tokenizer.h"
#include "env/env_config.h"
#include "env/env_host.h"
#include "learner/train.h"
#include "tests/testhelp.h"

static mtrl_env *open_named(const char *name, const char *config, int isolate) {
    mtrl_env *e = NULL;
    mtrl_error err = {0};
    mtrl_env_opts o;
    mtrl_env_opts_default(&o);
    o.isolate = isolate;
    mtrl_status st = mtrl_env_open(&e, name, config, &o, &err);
    TEST_CHECKF(st == MTRL_OK, "open %s (%s): %s", name, config, err.msg);
    return e;
}

static mtrl_env *open_env(const char *config, int isolate) { return open_named("corpus", config, isolate); }

// Runs the demo of seed step by step (copying each action: the demo's memory lasts until the
// next call). Returns the reward; *calls gets the tool calls made.
static double run_demo(mtrl_env *e, uint64_t seed, int *calls) {
    mtrl_error err = {0};
    mtrl_env_result r;
    TEST_CHECKF(mtrl_env_reset(e, seed, &r, &err) == MTRL_OK, "reset: %s", err.msg);
    mtrl_env_demo_out d;
    if (mtrl_env_demo(e, &d, &err) != MTRL_OK) {
        TEST_CHECKF(0, "demo: %s", err.msg);
        return -1;
    }
    size_t n = d.count;
    char(*acts)[160] = calloc(n, sizeof *acts);
    uint32_t *kinds = calloc(n, sizeof *kinds);
    for (size_t i = 0; i < n; i++) {
        kinds[i] = d.actions[i].kind;
        TEST_CHECK(d.actions[i].len < 160);
        memcpy(acts[i], d.actions[i].data, d.actions[i].len);
    }
    double reward = -1;
    *calls = 0;
    for (size_t i = 0; i < n; i++) {
        TEST_CHECKF(mtrl_env_step(e, kinds[i], acts[i], strlen(acts[i]), &r, &err) == MTRL_OK, "step %zu: %s", i, err.msg);
        if (kinds[i] == MTRL_ENV_ACTION_TOOL) {
            ++*calls;
            TEST_CHECKF(!r.tool_error, "demo call %s failed: %.*s", acts[i], (int)(r.obs_len < 200 ? r.obs_len : 200), r.obs);
        }
        if (r.done) {
            reward = r.reward;
            TEST_EQ_INT(i, n - 1);
            break;
        }
    }
    free(acts);
    free(kinds);
    return reward;
}

static void test_tasks(void) {
    static const char *tasks[] = {"chain", "sum", "latest"};
    for (int k = 0; k < 3; k++) {
        char conf[160];
        snprintf(conf, sizeof conf, "task=%s;hops=6;files=16;file_tokens=1024;max_obs_bytes=512;max_tool_calls=100", tasks[k]);
        mtrl_env *e = open_env(conf, 0);
        for (uint64_t seed = 1; seed <= 12; seed++) {
            int calls = 0;
            double r = run_demo(e, seed * 7919, &calls);
            TEST_CHECKF(r == 1.0, "%s seed %llu: demo reward %g", tasks[k], (unsigned long long)seed, r);
            if (k == 0) TEST_EQ_INT(calls, 2 * 6 + 2);
            else TEST_CHECK(calls >= 6 + 1);
        }
        // A wrong answer gets 0.
        mtrl_env_result r;
        mtrl_error err = {0};
        mtrl_env_reset(e, 5, &r, &err);
        TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_ANSWER, "x1", 2, &r, &err) == MTRL_OK);
        TEST_CHECK(r.done && r.reward == 0.0);
        mtrl_env_close(e);
    }
    // mix picks all three tasks over seeds, and its demos solve them.
    mtrl_env *e = open_env("hops=3;files=8;file_tokens=512;max_obs_bytes=400;max_tool_calls=100", 0);
    int seen[3] = {0};
    for (uint64_t seed = 0; seed < 30; seed++) {
        mtrl_env_result r;
        mtrl_error err = {0};
        mtrl_env_reset(e, seed, &r, &err);
        seen[0] += strstr(r.obs, "follow next=") != NULL;
        seen[1] += strstr(r.obs, "sum of v") != NULL;
        seen[2] += strstr(r.obs, "largest t") != NULL;
        int calls;
        TEST_CHECK(run_demo(e, seed, &calls) == 1.0);
    }
    TEST_CHECKF(seen[0] && seen[1] && seen[2], "mix over 30 seeds: chain %d, sum %d, latest %d", seen[0], seen[1], seen[2]);
    mtrl_env_close(e);
}

static void test_long_and_replay(void) {
    const char *chain = "task=chain;hops=32;files=64;file_tokens=8192;max_obs_bytes=4096;max_tool_calls=200";
    const char *sum = "task=sum;hops=60;files=64;file_tokens=4096;max_obs_bytes=1024;max_tool_calls=200";
    const char *trail = "task=trail;hops=60;hops_min=50;files=64;file_tokens=4096;max_obs_bytes=2048;max_tool_calls=200";
    const char *confs[3] = {chain, sum, trail};
    for (int c = 0; c < 3; c++) {
        mtrl_env *a = open_env(confs[c], 0), *b = open_env(confs[c], 0), *iso = open_env(confs[c], 1);
        int calls = 0;
        TEST_CHECK(run_demo(a, 42, &calls) == 1.0);
        TEST_CHECKF(calls >= 50, "%s: %d tool calls", confs[c], calls);
        // b runs other seeds first: nothing of an earlier episode may leak into the next.
        int dummy;
        run_demo(b, 7, &dummy);
        run_demo(b, 8, &dummy);
        mtrl_traj ta, tb, ti;
        mtrl_traj_init(&ta);
        mtrl_traj_init(&tb);
        mtrl_traj_init(&ti);
        mtrl_error err = {0};
        TEST_CHECKF(mtrl_train_demo_episode(a, 42, 1 << 22, &ta, &err) == MTRL_OK, "demo episode: %s", err.msg);
        TEST_CHECKF(mtrl_train_demo_episode(b, 42, 1 << 22, &tb, &err) == MTRL_OK, "demo episode: %s", err.msg);
        TEST_CHECKF(mtrl_train_demo_episode(iso, 42, 1 << 22, &ti, &err) == MTRL_OK, "isolated demo episode: %s", err.msg);
        TEST_CHECK(ta.reward == 1.0 && tb.reward == 1.0 && ti.reward == 1.0);
        TEST_EQ_INT(ta.n_tokens, tb.n_tokens);
        TEST_EQ_INT(ta.n_tokens, ti.n_tokens);
        TEST_CHECK(ta.n_tokens == tb.n_tokens && !memcmp(ta.ids, tb.ids, sizeof(uint32_t) * ta.n_tokens));
        TEST_CHECK(ta.n_tokens == ti.n_tokens && !memcmp(ta.ids, ti.ids, sizeof(uint32_t) * ta.n_tokens));
        if (c == 0) TEST_CHECKF(ta.n_tokens > 100000, "chain demo episode of %llu tokens", (unsigned long long)ta.n_tokens);
        printf("%s: %d tool calls, demo episode %llu tokens\n", confs[c], calls, (unsigned long long)ta.n_tokens);
        // Another seed gives another episode.
        TEST_CHECK(mtrl_train_demo_episode(b, 43, 1 << 22, &tb, &err) == MTRL_OK);
        TEST_CHECK(tb.n_tokens != ta.n_tokens || memcmp(ta.ids, tb.ids, sizeof(uint32_t) * ta.n_tokens));
        mtrl_traj_free(&ta);
        mtrl_traj_free(&tb);
        mtrl_traj_free(&ti);
        mtrl_env_close(a);
        mtrl_env_close(b);
        mtrl_env_close(iso);
    }
}

static const char *step_(mtrl_env *e, const char *call, mtrl_env_result *r) {
    mtrl_error err = {0};
    TEST_CHECKF(mtrl_env_step(e, MTRL_ENV_ACTION_TOOL, call, strlen(call), r, &err) == MTRL_OK, "%s: %s", call, err.msg);
    static char buf[8192];
    size_t n = r->obs_len < sizeof buf - 1 ? r->obs_len : sizeof buf - 1;
    memcpy(buf, r->obs, n);
    buf[n] = 0;
    return buf;
}

static void test_tools(void) {
    mtrl_env *e = open_env("task=chain;hops=2;files=12;file_tokens=2048;max_obs_bytes=100;max_tool_calls=12", 0);
    mtrl_env_result r;
    mtrl_error err = {0};
    mtrl_env_reset(e, 3, &r, &err);
    TEST_CONTAINS(r.obs, "ids f0000 to f0011");
    // grep over every file: 12 next= lines, 100 bytes hold fewer, so pages continue.
    const char *o = step_(e, "grep(*,next=)", &r);
    TEST_CHECK(!r.tool_error);
    TEST_CONTAINS(o, "f0000@");
    TEST_CONTAINS(o, "more: grep(*,next=,");
    int first_page = 0;
    for (const char *p = o; (p = strchr(p, '@')); p++) first_page++;
    char call[64];
    const char *m = strstr(o, "more: ");
    snprintf(call, sizeof call, "%.*s", (int)(strchr(m, ')') - m - 6 + 1), m + 6);
    o = step_(e, call, &r);
    int second_page = 0;
    for (const char *p = o; (p = strchr(p, '@')); p++) second_page++;
    TEST_CHECKF(first_page + second_page == 12 || strstr(o, "more:"), "pages %d + %d of 12 matches", first_page,
                second_page);
    TEST_CHECK(strstr(o, "f0000@") == NULL); // the second page starts where the first stopped
    // open: header and the bytes from the offset; the next= line of f0003 is where grep says.
    o = step_(e, "grep(f0003,next=)", &r);
    TEST_CHECK(!strncmp(o, "f0003@", 6));
    snprintf(call, sizeof call, "open(f0003,%d)", atoi(o + 6));
    o = step_(e, call, &r);
    TEST_CHECK(!r.tool_error);
    TEST_CONTAINS(o, "of ");
    TEST_CONTAINS(o, "\nnext=f00");
    TEST_CHECK(r.obs_len <= 100);
    o = step_(e, "open(f0003,999999)", &r);
    TEST_CHECK(r.tool_error);
    TEST_CONTAINS(o, "outside the file");
    o = step_(e, "open(f0099,0)", &r);
    TEST_CHECK(r.tool_error);
    TEST_CONTAINS(o, "no file 'f0099'");
    o = step_(e, "list(0)", &r);
    TEST_CHECK(!r.tool_error && !strncmp(o, "f0000 ", 6));
    TEST_CONTAINS(o, "more: list(");
    o = step_(e, "grep(f0003)", &r);
    TEST_CHECK(r.tool_error);
    TEST_CONTAINS(o, "grep needs a scope and text");
    o = step_(e, "grep(*,zzzz)", &r);
    TEST_CHECK(!r.tool_error);
    TEST_CONTAINS(o, "no match for 'zzzz'");
    o = step_(e, "cat(f0001)", &r);
    TEST_CHECK(r.tool_error);
    TEST_CONTAINS(o, "unknown tool 'cat'; tools: list, open, grep");
    o = step_(e, "open f0001", &r);
    TEST_CHECK(r.tool_error);
    TEST_CONTAINS(o, "malformed");
    // 11 calls so far; the 12th is allowed, the 13th ends the episode.
    step_(e, "list(3)", &r);
    TEST_CHECK(!r.done);
    o = step_(e, "list(0)", &r);
    TEST_CHECK(r.done && r.reward == 0.0);
    TEST_CONTAINS(o, "tool call limit (12)");
    mtrl_env_close(e);
}

static void test_config(void) {
    struct {
        const char *conf, *msg;
    } bad[] = {
        {"task=chains", "corpus: task='chains': use mix, chain, sum, latest or trail"},
        {"hops=4;hops_min=5", "hops_min=5 is above hops=4"},
        {"task=trail;hops=8;files=8", "task=trail with hops=8 needs more than 8 files"},
        {"files=1", "files"},
        {"files=65536;file_tokens=8192", "over the 256 MiB"},
        {"hops=4000;files=2;file_tokens=256", "hops=4000 records do not fit"},
        {"hop=3", "unknown config key 'hop'"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        mtrl_env *e = NULL;
        mtrl_error err = {0};
        TEST_CHECK(mtrl_env_open(&e, "corpus", bad[i].conf, NULL, &err) != MTRL_OK);
        TEST_CONTAINS(err.msg, bad[i].msg);
    }
    // The [stage.N] keys of the ladder reach the env's config.
    const char *ini = "[env]\nname = corpus\nhops = 2\nfiles = 8\nmax_obs_bytes = 256\nmax_tool_calls = 10\n"
                      "[stage.1]\ncontext = 4096\n[stage.2]\ncontext = 8192\nhops = 9\nfiles = 32\nmax_obs_bytes = 1024\n"
                      "max_tool_calls = 40\n";
    mtrl_config cfg;
    mtrl_config_errors errs = {0};
    mtrl_status cst = mtrl_config_load_text(&cfg, "corpus.ini", ini, NULL, 0, &errs);
    if (cst != MTRL_OK) mtrl_config_errors_print(&errs, stderr);
    mtrl_config_errors_free(&errs);
    TEST_CHECK(cst == MTRL_OK);
    mtrl_error err = {0};
    mtrl_config s1 = mtrl_config_stage(&cfg, 0), s2 = mtrl_config_stage(&cfg, 1);
    TEST_EQ_INT(s1.env.hops, 2);
    TEST_EQ_INT(s2.env.hops, 9);
    TEST_EQ_INT(s2.env.files, 32);
    TEST_EQ_INT(s2.env.max_obs_bytes, 1024);
    TEST_EQ_INT(s2.env.max_tool_calls, 40);
    mtrl_env *e = NULL;
    TEST_CHECKF(mtrl_env_open_config(&s2, &e, &err) == MTRL_OK, "open stage 2: %s", err.msg);
    mtrl_env_result r;
    mtrl_env_reset(e, 1, &r, &err);
    TEST_CONTAINS(r.obs, "A corpus of 32 log files");
    TEST_CONTAINS(r.obs, "up to 1024 bytes");
    mtrl_env_close(e);
}

static void test_speed(void) {
    mtrl_env *e = open_env("task=sum;hops=256;files=1024;file_tokens=16384;max_obs_bytes=8192;max_tool_calls=1000", 0);
    mtrl_env_result r;
    mtrl_error err = {0};
    double t0 = mtrl_time_mono();
    for (int i = 0; i < 3; i++) TEST_CHECK(mtrl_env_reset(e, (uint64_t)i, &r, &err) == MTRL_OK);
    double dt = (mtrl_time_mono() - t0) / 3;
    printf("16 MiB corpus generated in %.1f ms\n", dt * 1e3);
    TEST_CHECKF(dt < 0.5, "generation took %.3f s", dt);
    int calls;
    TEST_CHECK(run_demo(e, 9, &calls) == 1.0);
    TEST_CHECK(calls >= 256);
    mtrl_env_close(e);
}

static void test_plugin_notes(void) {
    const char *b = getenv("MTRL_BUILD");
    char so[600];
    snprintf(so, sizeof so, "%s/lib/libmtrl_env_notes.so", b ? b : ".");
    const char *conf = "hops=30;notes=64;note_bytes=2048;page_bytes=1024;max_tool_calls=100";
    mtrl_env *a = open_named(so, conf, 0), *iso = open_named(so, conf, 1);
    if (!a || !iso) return;
    for (uint64_t seed = 1; seed <= 3; seed++) {
        int calls = 0;
        TEST_CHECK(run_demo(a, seed, &calls) == 1.0);
        TEST_EQ_INT(calls, 62);
    }
    mtrl_traj ta, ti;
    mtrl_traj_init(&ta);
    mtrl_traj_init(&ti);
    mtrl_error err = {0};
    TEST_CHECKF(mtrl_train_demo_episode(a, 77, 1 << 22, &ta, &err) == MTRL_OK, "notes demo: %s", err.msg);
    TEST_CHECKF(mtrl_train_demo_episode(iso, 77, 1 << 22, &ti, &err) == MTRL_OK, "isolated notes demo: %s", err.msg);
    TEST_CHECK(ta.reward == 1.0 && ti.reward == 1.0);
    TEST_CHECK(ta.n_tokens == ti.n_tokens && !memcmp(ta.ids, ti.ids, sizeof(uint32_t) * ta.n_tokens));
    printf("notes plug-in: 30 hops, demo episode %llu tokens\n", (unsigned long long)ta.n_tokens);
    TEST_CHECK(ta.n_tokens > 30 * 1024);
    mtrl_traj_free(&ta);
    mtrl_traj_free(&ti);
    mtrl_env_result r;
    mtrl_env_reset(a, 5, &r, &err);
    TEST_CONTAINS(r.obs, "follow `see` 30 times");
    TEST_CHECK(mtrl_env_step(a, MTRL_ENV_ACTION_TOOL, "look(n001,x)", 12, &r, &err) == MTRL_OK);
    TEST_CHECK(r.tool_error);
    TEST_CONTAINS(r.obs, "unknown tool 'look'");
    TEST_CHECK(mtrl_env_step(a, MTRL_ENV_ACTION_ANSWER, "nope", 4, &r, &err) == MTRL_OK);
    TEST_CHECK(r.done && r.reward == 0.0);
    mtrl_env_close(a);
    mtrl_env_close(iso);
    mtrl_env *x = NULL;
    TEST_CHECK(mtrl_env_open(&x, so, "hopz=3", NULL, &err) != MTRL_OK);
    TEST_CONTAINS(err.msg, "unknown config key 'hopz'");
}

static void test_agent_ladder(void) {
    const char *src = getenv("MTRL_SRC");
    char path[600];
    snprintf(path, sizeof path, "%s/experiments/agent-1m.ini", src ? src : "..");
    mtrl_config cfg;
    mtrl_config_errors errs = {0};
    mtrl_status cst = mtrl_config_load(&cfg, path, NULL, 0, &errs);
    if (cst != MTRL_OK) mtrl_config_errors_print(&errs, stderr);
    mtrl_config_errors_free(&errs);
    TEST_CHECK(cst == MTRL_OK);
    if (cst != MTRL_OK) return;
    TEST_CHECK(cfg.n_stages >= 4);
    for (int st = 0; st < cfg.n_stages; st++) {
        mtrl_config c = mtrl_config_stage(&cfg, st);
        mtrl_env *e = NULL;
        mtrl_error err = {0};
        TEST_CHECKF(mtrl_env_open_config(&c, &e, &err) == MTRL_OK, "stage %d: %s", st + 1, err.msg);
        if (!e) continue;
        uint64_t most = 0, least = UINT64_MAX;
        uint32_t calls_min = UINT32_MAX;
        for (uint64_t seed = 0; seed < 6; seed++) {
            mtrl_traj t;
            mtrl_traj_init(&t);
            TEST_CHECKF(mtrl_train_demo_episode(e, seed, 1 << 24, &t, &err) == MTRL_OK, "stage %d: %s", st + 1, err.msg);
            TEST_CHECK(t.reward == 1.0);
            uint32_t calls = 0;
            for (uint64_t k = 0; k < t.n_tokens; k++) calls += t.ids[k] == MTRL_TOK_TOOL_OPEN;
            if (t.n_tokens > most) most = t.n_tokens;
            if (t.n_tokens < least) least = t.n_tokens;
            if (calls < calls_min) calls_min = calls;
            mtrl_traj_free(&t);
        }
        printf("agent-1m stage %d: context %ld, hops %ld, page %ld: demo episodes %llu..%llu tokens, >= %u tool calls\n",
               st + 1, c.actor.max_tokens, c.env.hops, c.env.max_obs_bytes, (unsigned long long)least,
               (unsigned long long)most, calls_min);
        // the model's turns add to the demo's tokens: keep a tenth of the context for them
        TEST_CHECKF(most < (uint64_t)c.actor.max_tokens * 9 / 10, "stage %d: demo of %llu tokens in a context of %ld",
                    st + 1, (unsigned long long)most, c.actor.max_tokens);
        TEST_CHECK(calls_min <= (uint32_t)c.env.max_tool_calls);
        if (st == cfg.n_stages - 1) {
            TEST_CHECKF(calls_min >= 100, "last stage: %u tool calls", calls_min);
            TEST_CHECKF(least >= 512 * 1024, "last stage: %llu tokens", (unsigned long long)least);
        }
        mtrl_env_close(e);
    }
}

// Action i of seed's demo into buf (160 bytes).
static void demo_action(mtrl_env *e, uint64_t seed, size_t i, char *buf) {
    mtrl_error err = {0};
    mtrl_env_result r;
    TEST_CHECK(mtrl_env_reset(e, seed, &r, &err) == MTRL_OK);
    mtrl_env_demo_out d;
    TEST_CHECK(mtrl_env_demo(e, &d, &err) == MTRL_OK && i < d.count && d.actions[i].len < 160);
    memset(buf, 0, 160);
    memcpy(buf, d.actions[i].data, d.actions[i].len);
}

// Plays the first `calls` actions of seed's demo, then answers `answer`; returns the reward.
static double partial_demo(mtrl_env *e, uint64_t seed, size_t calls, const char *extra, const char *answer) {
    mtrl_error err = {0};
    mtrl_env_result r;
    TEST_CHECKF(mtrl_env_reset(e, seed, &r, &err) == MTRL_OK, "reset: %s", err.msg);
    mtrl_env_demo_out d;
    TEST_CHECKF(mtrl_env_demo(e, &d, &err) == MTRL_OK, "demo: %s", err.msg);
    TEST_CHECK(calls < d.count);
    char(*acts)[160] = calloc(calls + 1, sizeof *acts);
    for (size_t i = 0; i < calls; i++) memcpy(acts[i], d.actions[i].data, d.actions[i].len);
    for (size_t i = 0; i < calls; i++) {
        TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_TOOL, acts[i], strlen(acts[i]), &r, &err) == MTRL_OK);
        TEST_CHECKF(!r.tool_error && !r.done, "call %s", acts[i]);
    }
    if (extra) TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_TOOL, extra, strlen(extra), &r, &err) == MTRL_OK && !r.done);
    TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_ANSWER, answer, strlen(answer), &r, &err) == MTRL_OK);
    TEST_CHECK(r.done);
    free(acts);
    return r.reward;
}

static void test_credit(void) {
    // chain of 3 hops: 4 facts (3 next= lines, the last file's code= line), 2 demo calls each
    mtrl_env *e = open_env("task=chain;hops=3;files=16;file_tokens=1024;max_obs_bytes=512;credit=0.5", 0);
    int calls;
    TEST_CHECK(run_demo(e, 5, &calls) == 1.0);
    TEST_EQ_INT(calls, 8);
    TEST_NEAR(partial_demo(e, 5, 0, NULL, "000000"), 0.0, 0);
    TEST_NEAR(partial_demo(e, 5, 1, NULL, "000000"), 0.0, 0);         // a grep shows no fact
    TEST_NEAR(partial_demo(e, 5, 2, NULL, "000000"), 0.5 * 1 / 4, 0); // one open, one fact
    TEST_NEAR(partial_demo(e, 5, 6, NULL, "000000"), 0.5 * 3 / 4, 0);
    // the same page again counts once
    char again[160] = {0};
    demo_action(e, 5, 1, again);
    TEST_NEAR(partial_demo(e, 5, 2, again, "000000"), 0.5 * 1 / 4, 0);
    // the right answer alone is 1, facts or not (the task's answer: the demo's last action)
    char ans[160];
    demo_action(e, 5, (size_t)calls, ans); // the demo's last action: the answer
    TEST_NEAR(partial_demo(e, 5, 0, NULL, ans), 1.0, 0);
    mtrl_env_close(e);
    // a page that ends inside a fact's line does not show it: open the first file at the byte
    // before its next= line's end with a page too small for the line
    e = open_env("task=chain;hops=1;files=8;file_tokens=1024;max_obs_bytes=64;credit=0.5", 0);
    {
        char open_call[160], id[16] = {0};
        demo_action(e, 9, 1, open_call); // open(fNNNN,OFF) at the next= line
        long long off;
        TEST_CHECK(sscanf(open_call, "open(%15[^,],%lld)", id, &off) == 2);
        char late[96];
        snprintf(late, sizeof late, "open(%s,%lld)", id, off + 1); // starts past the line's first byte
        TEST_NEAR(partial_demo(e, 9, 0, late, "000000"), 0.0, 0);
        TEST_NEAR(partial_demo(e, 9, 0, open_call, "000000"), 0.5 * 1 / 2, 0);
    }
    mtrl_env_close(e);
    // sum over 6 records: each open of a record's location is one fact
    e = open_env("task=sum;hops=6;files=16;file_tokens=1024;max_obs_bytes=256;credit=0.3", 0);
    {
        mtrl_error err = {0};
        mtrl_env_result r;
        TEST_CHECK(mtrl_env_reset(e, 3, &r, &err) == MTRL_OK);
        mtrl_env_demo_out d;
        TEST_CHECK(mtrl_env_demo(e, &d, &err) == MTRL_OK);
        size_t greps = d.count - 1 - 6; // the grep pages, then 6 opens, then the answer
        TEST_NEAR(partial_demo(e, 3, greps, NULL, "0"), 0.0, 0);
        TEST_NEAR(partial_demo(e, 3, greps + 2, NULL, "0"), 0.3 * 2 / 6, 1e-15);
        TEST_NEAR(partial_demo(e, 3, greps + 6, NULL, "0"), 0.3, 1e-15);
    }
    mtrl_env_close(e);
    // credit=0 (the default): a wrong answer after every fact is 0
    e = open_env("task=chain;hops=3;files=16;file_tokens=1024;max_obs_bytes=512", 0);
    TEST_NEAR(partial_demo(e, 5, 8, NULL, "000000"), 0.0, 0);
    mtrl_env_close(e);
    // refusals name the key and the range
    const char *bad[] = {"credit=1", "credit=-0.1", "credit=abc", "credit="};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        mtrl_env *x = NULL;
        mtrl_error err = {0};
        mtrl_env_opts o;
        mtrl_env_opts_default(&o);
        TEST_CHECKF(mtrl_env_open(&x, "corpus", bad[i], &o, &err) != MTRL_OK, "%s accepted", bad[i]);
        TEST_CHECKF(strstr(err.msg, "credit") && strstr(err.msg, "0.9"), "%s: %s", bad[i], err.msg);
    }
}

// trail: the rule the prompt states, played from the observations alone (not from the demo).
// Returns the reward; *calls gets the opens made (the episode's hops + 1).
static double play_trail(mtrl_env *e, uint64_t seed, size_t page, int *calls) {
    mtrl_error err = {0};
    mtrl_env_result r;
    TEST_CHECKF(mtrl_env_reset(e, seed, &r, &err) == MTRL_OK, "reset: %s", err.msg);
    char id[16] = {0}, call[64];
    const char *at = strstr(r.obs, "Start at ");
    TEST_CHECK(at && sscanf(at, "Start at %15[^:]", id) == 1);
    *calls = 0;
    for (;;) {
        snprintf(call, sizeof call, "open(%s,0)", id);
        const char *o = step_(e, call, &r);
        ++*calls;
        TEST_CHECKF(!r.tool_error && !r.done, "seed %llu %s: %s", (unsigned long long)seed, call, o);
        if (r.tool_error || r.done) return -1;
        TEST_EQ_INT(r.obs_len, page); // the whole page, header included
        size_t n = strlen(o);
        // the page ends "code=DDDDDD\nnext=X\n"
        const char *nx = n > 0 ? o + n - 1 : o;
        while (nx > o && nx[-1] != '\n') nx--;
        TEST_CHECKF(!strncmp(nx, "next=", 5) && nx - o >= 12 && !strncmp(nx - 12, "code=", 5), "seed %llu %s: page ends %s",
                    (unsigned long long)seed, call, nx);
        if (!strncmp(nx, "next=end\n", 9)) {
            char code[8] = {0};
            memcpy(code, nx - 7, 6);
            TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_ANSWER, code, 6, &r, &err) == MTRL_OK && r.done);
            return r.reward;
        }
        TEST_CHECK(sscanf(nx, "next=%15[^\n]", id) == 1);
        if (*calls > 4096) return -1;
    }
}

static void test_trail(void) {
    mtrl_env *e = open_env("task=trail;hops=6;hops_min=2;files=16;file_tokens=1024;max_obs_bytes=512;max_tool_calls=100;credit=0.5", 0);
    int seen[8] = {0};
    for (uint64_t seed = 0; seed < 40; seed++) {
        int calls = 0, dcalls = 0;
        TEST_NEAR(play_trail(e, seed, 512, &calls), 1.0, 0);
        TEST_CHECKF(calls >= 3 && calls <= 7, "seed %llu: %d opens for 2..6 hops", (unsigned long long)seed, calls);
        if (calls >= 0 && calls < 8) seen[calls]++;
        TEST_NEAR(run_demo(e, seed, &dcalls), 1.0, 0);
        TEST_EQ_INT(dcalls, calls);
    }
    for (int c = 3; c <= 7; c++) TEST_CHECKF(seen[c] > 0, "no episode of %d opens in 40 seeds (hops 2..6)", c);
    // every file has one size (the header of every page is alike)
    mtrl_env_result r;
    mtrl_error err = {0};
    TEST_CHECK(mtrl_env_reset(e, 3, &r, &err) == MTRL_OK);
    const char *l = step_(e, "list(0)", &r);
    long long size0 = -1;
    for (const char *q = l; (q = strchr(q, ' ')) != NULL; q++) {
        long long sz = atoll(q + 1);
        if (size0 < 0) size0 = sz;
        TEST_CHECKF(sz == size0 && sz >= 1024, "file sizes %lld and %lld", size0, sz);
    }
    // credit: the first k files of the trail opened, then a wrong answer
    int calls = 0;
    TEST_NEAR(run_demo(e, 11, &calls), 1.0, 0);
    for (int k = 0; k < calls; k++) TEST_NEAR(partial_demo(e, 11, (size_t)k, NULL, "000000"), 0.5 * k / calls, 1e-15);
    mtrl_env_close(e);
    // hops alone: every episode of exactly hops, and a long trail at a small page
    e = open_env("task=trail;hops=120;files=128;file_tokens=256;max_obs_bytes=64;max_tool_calls=200", 0);
    for (uint64_t seed = 0; seed < 3; seed++) {
        TEST_NEAR(play_trail(e, seed, 64, &calls), 1.0, 0);
        TEST_EQ_INT(calls, 121);
    }
    mtrl_env_close(e);
}

int main(int argc, char **argv) {
    mtrl_env_host_main(argc, argv); // the isolated envs below start this program as their child
    test_agent_ladder();
    test_plugin_notes();
    test_tasks();
    test_long_and_replay();
    test_tools();
    test_credit();
    test_trail();
    test_config();
    test_speed();
    return test_report();
}
