// mtrl-test: cpu timeout=60
// test_env_builtin.c: the built-in retrieval and calc envs through the host API (in-process):
// demo episodes reach reward 1, wrong answers get 0 (or retrieval's per-digit credit), malformed and unknown tool calls come back
// as error observations (not errors), tool-call limits end the episode, the calc expression
// parser, config refusals, determinism per seed, and the 1M-token document generation time.
#include <stdio.h>
#include <string.h>

#include "common/timeutil.h"
#include "env/builtin/builtin.h"
#include "env/env_host.h"
#include "tests/testhelp.h"

static mtrl_env *open_env(const char *name, const char *config) {
    mtrl_env *e = NULL;
    mtrl_error err = {0};
    mtrl_status st = mtrl_env_open(&e, name, config, NULL, &err);
    TEST_CHECKF(st == MTRL_OK, "open %s (%s): %s", name, config, err.msg);
    return e;
}

// Runs the env's demo for seed; returns the final reward (-1 when the episode broke).
static double run_demo(mtrl_env *e, uint64_t seed, int *steps) {
    mtrl_error err = {0};
    mtrl_env_result r;
    if (mtrl_env_reset(e, seed, &r, &err) != MTRL_OK) {
        TEST_CHECKF(0, "reset: %s", err.msg);
        return -1;
    }
    mtrl_env_demo_out d;
    if (mtrl_env_demo(e, &d, &err) != MTRL_OK) {
        TEST_CHECKF(0, "demo: %s", err.msg);
        return -1;
    }
    // Copy the demo: its memory is valid only until the next call on the env.
    char acts[4][256];
    uint32_t kinds[4];
    size_t lens[4], n = d.count < 4 ? d.count : 4;
    for (size_t i = 0; i < n; i++) {
        kinds[i] = d.actions[i].kind;
        lens[i] = d.actions[i].len < 255 ? d.actions[i].len : 255;
        memcpy(acts[i], d.actions[i].data, lens[i]);
    }
    double reward = -1;
    for (size_t i = 0; i < n; i++) {
        if (mtrl_env_step(e, kinds[i], acts[i], lens[i], &r, &err) != MTRL_OK) {
            TEST_CHECKF(0, "step %zu: %s", i, err.msg);
            return -1;
        }
        if (kinds[i] == MTRL_ENV_ACTION_TOOL) TEST_CHECKF(!r.tool_error, "demo tool call failed: %.*s", (int)r.obs_len, r.obs);
        if (r.done) {
            reward = r.reward;
            TEST_EQ_INT(i, n - 1);
            break;
        }
    }
    if (steps) *steps = (int)n;
    return reward;
}

static mtrl_env_result step(mtrl_env *e, uint32_t kind, const char *text) {
    mtrl_env_result r;
    mtrl_error err = {0};
    mtrl_status st = mtrl_env_step(e, kind, text, strlen(text), &r, &err);
    TEST_CHECKF(st == MTRL_OK, "step '%s': %s", text, err.msg);
    return r;
}

static void expect_obs(mtrl_env_result r, const char *want) {
    char buf[4096];
    snprintf(buf, sizeof buf, "%.*s", (int)r.obs_len, r.obs);
    TEST_EQ_STR(buf, want);
}

static void test_calc_eval(void) {
    struct { const char *s; long long v; const char *err; } cases[] = {
        {"12*7+3", 87, NULL}, {"2+3*4", 14, NULL}, {"(2+3)*4", 20, NULL}, {" 10 - 4 - 3 ", 3, NULL},
        {"-5*-(3)", 15, NULL}, {"7/2", 3, NULL}, {"-7/2", -3, NULL}, {"100/(5-3)/5", 10, NULL},
        {"9223372036854775807", 9223372036854775807LL, NULL},
        {"1/0", 0, "division by zero"}, {"1/(2-2)", 0, "division by zero"},
        {"", 0, "empty expression"}, {"2+", 0, "unexpected end of expression"},
        {"2+x", 0, "unexpected 'x' at position 3"}, {"(1+2", 0, "missing ')'"},
        {"1+2)", 0, "unmatched ')' at position 4"}, {"3 4", 0, "unexpected '4' at position 3"},
        {"9223372036854775807+1", 0, "overflow"}, {"99999999999999999999", 0, "overflow"},
        {"4000000000*4000000000", 0, "overflow"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int64_t v = 0;
        char err[128] = "";
        int rc = env_calc_eval(cases[i].s, strlen(cases[i].s), &v, err, sizeof err);
        if (!cases[i].err) {
            TEST_CHECKF(rc == 0 && v == cases[i].v, "'%s' -> rc %d v %lld err %s", cases[i].s, rc, (long long)v, err);
        } else {
            TEST_CHECKF(rc != 0, "'%s' should fail", cases[i].s);
            TEST_CONTAINS(err, cases[i].err);
        }
    }
    // Deep nesting is refused, not a stack overflow.
    char deep[401];
    memset(deep, '(', 200);
    deep[200] = '1';
    memset(deep + 201, ')', 200);
    int64_t v;
    char err[128];
    TEST_CHECK(env_calc_eval(deep, 401, &v, err, sizeof err) != 0);
    TEST_CONTAINS(err, "nested too deeply");
}

static void test_calc(void) {
    mtrl_env *e = open_env("calc", "digits=1;ops=1");
    if (!e) return;
    TEST_EQ_STR(mtrl_env_name(e), "calc");
    // The easiest setting: prompts like "3+4=?", answers like "7".
    mtrl_env_result r;
    mtrl_error err = {0};
    TEST_CHECK(mtrl_env_reset(e, 1, &r, &err) == MTRL_OK);
    TEST_EQ_INT(r.obs_len, 5);
    TEST_CHECKF(r.obs_len == 5 && r.obs[1] != 0 && strchr("+-*", r.obs[1]) && !memcmp(r.obs + 3, "=?", 2),
                "prompt '%.*s'", (int)r.obs_len, r.obs);
    printf("calc digits=1 ops=1 prompt: %.*s\n", (int)r.obs_len, r.obs);
    for (uint64_t seed = 0; seed < 50; seed++) TEST_EQ_INT((int)(run_demo(e, seed, NULL) * 1000), 1000);

    // A worked episode with tool use and a wrong answer.
    TEST_CHECK(mtrl_env_reset(e, 7, &r, &err) == MTRL_OK);
    char prompt[64];
    snprintf(prompt, sizeof prompt, "%.*s", (int)r.obs_len, r.obs);
    int64_t want;
    char why[64];
    TEST_CHECK(env_calc_eval(prompt, strlen(prompt) - 2, &want, why, sizeof why) == 0);
    char call[80], wrong[32], right[32];
    snprintf(call, sizeof call, "calc(%.*s)", (int)strlen(prompt) - 2, prompt);
    snprintf(right, sizeof right, "%lld", (long long)want);
    snprintf(wrong, sizeof wrong, "%lld", (long long)want + 1);
    r = step(e, MTRL_ENV_ACTION_TOOL, call);
    expect_obs(r, right);
    TEST_EQ_INT(r.done, 0);
    TEST_EQ_INT(r.tool_error, 0);
    TEST_CHECK(r.latency_s >= 0 && r.latency_s < 1);
    r = step(e, MTRL_ENV_ACTION_TOOL, "calc(1/0)");
    expect_obs(r, "error: division by zero");
    TEST_EQ_INT(r.tool_error, 1);
    TEST_EQ_INT(r.done, 0);
    r = step(e, MTRL_ENV_ACTION_TOOL, "calc(2*y)");
    expect_obs(r, "error: unexpected 'y' at position 3");
    r = step(e, MTRL_ENV_ACTION_TOOL, "foo(1)");
    expect_obs(r, "error: unknown tool 'foo'; tools: calc");
    TEST_EQ_INT(r.reward * 1000, 0);
    TEST_EQ_INT(r.done, 0);
    TEST_EQ_INT(r.tool_error, 1);
    r = step(e, MTRL_ENV_ACTION_ANSWER, wrong);
    TEST_EQ_INT(r.done, 1);
    TEST_EQ_INT(r.reward * 1000, 0);
    // After done, stepping is a state error until the next reset.
    TEST_EQ_INT(mtrl_env_step(e, MTRL_ENV_ACTION_ANSWER, right, strlen(right), &r, &err), MTRL_ERR_STATE);
    TEST_CONTAINS(err.msg, "call mtrl_env_reset first");
    // The right answer with whitespace around it counts.
    TEST_CHECK(mtrl_env_reset(e, 7, &r, &err) == MTRL_OK);
    char spaced[40];
    snprintf(spaced, sizeof spaced, " %s\n", right);
    r = step(e, MTRL_ENV_ACTION_ANSWER, spaced);
    TEST_EQ_INT(r.reward * 1000, 1000);
    // Junk answers score 0.
    TEST_CHECK(mtrl_env_reset(e, 7, &r, &err) == MTRL_OK);
    r = step(e, MTRL_ENV_ACTION_ANSWER, "seven");
    TEST_EQ_INT(r.reward * 1000, 0);

    // Tool-call limit (default 4): the fifth call ends the episode with reward 0.
    TEST_CHECK(mtrl_env_reset(e, 8, &r, &err) == MTRL_OK);
    for (int i = 0; i < 4; i++) TEST_EQ_INT(step(e, MTRL_ENV_ACTION_TOOL, "calc(1+1)").done, 0);
    r = step(e, MTRL_ENV_ACTION_TOOL, "calc(1+1)");
    TEST_EQ_INT(r.done, 1);
    TEST_EQ_INT(r.reward * 1000, 0);
    expect_obs(r, "error: tool call limit (4) reached; episode over");

    const char *tools;
    size_t tl;
    TEST_CHECK(mtrl_env_describe(e, &tools, &tl, &err) == MTRL_OK);
    TEST_CONTAINS(tools, "calc(expr)");
    mtrl_env_close(e);

    // Harder settings: every demo still scores 1 (no overflow, parser and generator agree).
    e = open_env("calc", "digits=6\nops=4\nmax_tool_calls=2");
    if (e) {
        TEST_CHECK(mtrl_env_reset(e, 3, &r, &err) == MTRL_OK);
        printf("calc digits=6 ops=4 prompt: %.*s\n", (int)r.obs_len, r.obs);
        for (uint64_t seed = 0; seed < 200; seed++) TEST_EQ_INT((int)(run_demo(e, seed, NULL) * 1000), 1000);
        mtrl_env_close(e);
    }

    // Config refusals name the key and the range or the known keys.
    mtrl_env *bad = NULL;
    TEST_EQ_INT(mtrl_env_open(&bad, "calc", "digits=9", NULL, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "digits=9 out of range 1..6");
    TEST_CHECK(bad == NULL);
    TEST_EQ_INT(mtrl_env_open(&bad, "calc", "digit=2", NULL, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "unknown config key 'digit'; known keys: digits, ops, max_tool_calls");
    TEST_EQ_INT(mtrl_env_open(&bad, "calc", "ops=two", NULL, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "ops='two' is not an integer");
    TEST_EQ_INT(mtrl_env_open(&bad, "calc", "ops=1;ops=2", NULL, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "given twice");
    TEST_EQ_INT(mtrl_env_open(&bad, "calc", "ops", NULL, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "is not key=value");
    // Keys of the [env] section meant for other built-ins or the host are ignored, so the
    // actor may pass the whole section.
    TEST_EQ_INT(mtrl_env_open(&bad, "calc", "doc_tokens=100;isolate=true;base_url=http://x", NULL, &err), MTRL_OK);
    mtrl_env_close(bad);
    bad = NULL;
    // max_tool_calls=0: no tools; the first call ends the episode.
    TEST_EQ_INT(mtrl_env_open(&bad, "calc", "max_tool_calls=0", NULL, &err), MTRL_OK);
    if (bad) {
        TEST_CHECK(mtrl_env_reset(bad, 1, &r, &err) == MTRL_OK);
        r = step(bad, MTRL_ENV_ACTION_TOOL, "calc(1+1)");
        TEST_EQ_INT(r.done, 1);
        TEST_EQ_INT(r.reward * 1000, 0);
        mtrl_env_close(bad);
        bad = NULL;
    }
    TEST_EQ_INT(mtrl_env_open(&bad, "calculator", "", NULL, &err), MTRL_ERR_NOTFOUND);
    TEST_CONTAINS(err.msg, "unknown env 'calculator'; built-in envs are retrieval, calc, http, picture, corpus");
}

static void test_retrieval(void) {
    mtrl_env *e = open_env("retrieval", "doc_tokens=2000; max_obs_bytes=256");
    if (!e) return;
    mtrl_env_result r;
    mtrl_error err = {0};
    TEST_CHECK(mtrl_env_reset(e, 42, &r, &err) == MTRL_OK);
    char prompt[1024];
    snprintf(prompt, sizeof prompt, "%.*s", (int)r.obs_len, r.obs);
    printf("retrieval prompt: %s", prompt);
    TEST_CONTAINS(prompt, "What is the value of k");
    TEST_CONTAINS(prompt, "search(text)");
    const char *kp = strstr(prompt, "value of ") + 9;
    char key[16];
    size_t kl = strcspn(kp, "?");
    snprintf(key, sizeof key, "%.*s", (int)kl, kp);

    // search finds the line with its byte offset; read at that offset shows the same line.
    char call[64];
    snprintf(call, sizeof call, "search(%s)", key);
    r = step(e, MTRL_ENV_ACTION_TOOL, call);
    char hit[256];
    snprintf(hit, sizeof hit, "%.*s", (int)r.obs_len, r.obs);
    TEST_EQ_INT(r.tool_error, 0);
    TEST_CONTAINS(hit, key);
    long off = atol(hit);
    const char *line = strstr(hit, ": ") + 2;
    char value[16];
    snprintf(value, sizeof value, "%.*s", (int)strcspn(strchr(line, '=') + 1, "\n"), strchr(line, '=') + 1);
    TEST_CHECK(value[0] == 'v' && strlen(value) == 7);
    snprintf(call, sizeof call, "read(%ld, %zu)", off, strlen(key) + 9);
    r = step(e, MTRL_ENV_ACTION_TOOL, call);
    char rd[64];
    snprintf(rd, sizeof rd, "%.*s", (int)r.obs_len, r.obs);
    char want[64];
    snprintf(want, sizeof want, "%s=%s\n", key, value);
    TEST_EQ_STR(rd, want);
    // Tool errors: bad read arguments, empty search, unknown and malformed calls.
    r = step(e, MTRL_ENV_ACTION_TOOL, "read(99999999,10)");
    TEST_CONTAINS(r.obs, "error: offset 99999999 is past the end of the document");
    TEST_EQ_INT(r.tool_error, 1);
    r = step(e, MTRL_ENV_ACTION_TOOL, "read(abc)");
    TEST_CONTAINS(r.obs, "error: read needs two integers");
    r = step(e, MTRL_ENV_ACTION_TOOL, "foo(bar)");
    expect_obs(r, "error: unknown tool 'foo'; tools: search, read");
    TEST_EQ_INT(r.done, 0);
    TEST_EQ_INT(r.reward * 1000, 0);
    TEST_EQ_INT(r.tool_error, 1);
    // A limit of 8 tool calls: 5 used so far; three more allowed, the ninth ends the episode.
    r = step(e, MTRL_ENV_ACTION_TOOL, "search this please");
    expect_obs(r, "error: malformed tool call 'search this please'; expected name(args); tools: search, read");
    TEST_EQ_INT(r.done, 0);
    r = step(e, MTRL_ENV_ACTION_TOOL, "search()");
    TEST_CONTAINS(r.obs, "error: search needs text");
    // A search matching many lines is capped at max_obs_bytes.
    r = step(e, MTRL_ENV_ACTION_TOOL, "search(=v)");
    TEST_CHECKF(r.obs_len <= 256, "capped search output %zu bytes", r.obs_len);
    TEST_CONTAINS(r.obs, "(more matches not shown)");
    r = step(e, MTRL_ENV_ACTION_TOOL, "search(k)");
    TEST_EQ_INT(r.done, 1);
    TEST_EQ_INT(r.reward * 1000, 0);

    // Right and wrong answers.
    TEST_CHECK(mtrl_env_reset(e, 42, &r, &err) == MTRL_OK);
    r = step(e, MTRL_ENV_ACTION_ANSWER, value);
    TEST_EQ_INT(r.done, 1);
    TEST_EQ_INT(r.reward * 1000, 1000);
    TEST_CHECK(mtrl_env_reset(e, 42, &r, &err) == MTRL_OK);
    r = step(e, MTRL_ENV_ACTION_ANSWER, "v000000x");
    TEST_EQ_INT(r.done, 1);
    TEST_EQ_INT(r.reward * 1000, 0);

    // Demo episodes (search, then answer) score 1 for many seeds; the fact is anywhere.
    int steps = 0;
    for (uint64_t seed = 0; seed < 40; seed++) TEST_EQ_INT((int)(run_demo(e, seed, &steps) * 1000), 1000);
    TEST_EQ_INT(steps, 2);
    mtrl_env_close(e);

    // The observation cap holds even for notes and errors.
    e = open_env("retrieval", "doc_tokens=300;max_obs_bytes=8");
    if (e) {
        TEST_CHECK(mtrl_env_reset(e, 5, &r, &err) == MTRL_OK);
        r = step(e, MTRL_ENV_ACTION_TOOL, "search(k)");
        TEST_EQ_INT(r.obs_len, 8);
        r = step(e, MTRL_ENV_ACTION_TOOL, "nonsense");
        TEST_EQ_INT(r.obs_len, 8);
        mtrl_env_close(e);
    }
    mtrl_env *bad = NULL;
    TEST_EQ_INT(mtrl_env_open(&bad, "retrieval", "inline_doc=maybe", NULL, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "inline_doc='maybe' is not a boolean");

    // Inline mode: the prompt is the document plus the question; the demo is the answer alone.
    e = open_env("retrieval", "doc_tokens=300;inline_doc=true");
    if (e) {
        TEST_CHECK(mtrl_env_reset(e, 5, &r, &err) == MTRL_OK);
        TEST_CHECKF(r.obs_len > 250 && r.obs_len < 360, "inline prompt %zu bytes", r.obs_len);
        printf("retrieval inline prompt:\n%.*s", (int)r.obs_len, r.obs);
        TEST_CHECK(r.obs[0] == 'k');
        TEST_CHECK(strstr(r.obs, "What is the value of") != NULL);
        for (uint64_t seed = 0; seed < 20; seed++) TEST_EQ_INT((int)(run_demo(e, seed, &steps) * 1000), 1000);
        TEST_EQ_INT(steps, 1);
        mtrl_env_close(e);
    }
    // demo_search: inline, and the demo searches for the key first (2 steps), still reward 1
    e = open_env("retrieval", "doc_tokens=300;inline_doc=true;demo_search=1");
    if (e) {
        for (uint64_t seed = 0; seed < 20; seed++) TEST_EQ_INT((int)(run_demo(e, seed, &steps) * 1000), 1000);
        TEST_EQ_INT(steps, 2);
        mtrl_env_close(e);
    }
    // key_digits: one key width at every length (a context ladder's stages differ in length
    // only); automatic, 300 tokens get 3-digit keys. Too small a width for the document gives
    // fewer lines, never a repeated key; widths 1..2 are refused.
    for (int kd = 0; kd <= 6; kd += 3) {
        char conf[96];
        snprintf(conf, sizeof conf, "doc_tokens=%d;inline_doc=true;demo_search=1;key_digits=%d", kd == 3 ? 100000 : 300, kd);
        e = open_env("retrieval", conf);
        if (!e) continue;
        TEST_CHECK(mtrl_env_reset(e, 9, &r, &err) == MTRL_OK);
        int want = kd ? kd : 3;
        size_t line = strcspn(r.obs, "\n") + 1;
        TEST_EQ_INT((int)line - 10, want);
        const char *q = strstr(r.obs, "What is the value of k");
        TEST_CHECK(q && strspn(q + 22, "0123456789") == (size_t)want);
        if (kd == 3) TEST_EQ_INT((int)((r.obs_len - strlen(q)) / line), 1000); // 10^3 keys, no repeats
        TEST_EQ_INT((int)(run_demo(e, 9, &steps) * 1000), 1000);
        mtrl_env_close(e);
    }
    TEST_EQ_INT(mtrl_env_open(&bad, "retrieval", "key_digits=2", NULL, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "key_digits=2");
}

// 1M-token document: generation time printed, under one second; keys unique; the queried line
// lands anywhere (its position spreads over the document across seeds); same seed, same doc.
static void test_retrieval_1m(void) {
    mtrl_env *e = open_env("retrieval", "doc_tokens=1048576;inline_doc=1");
    if (!e) return;
    mtrl_env_result r;
    mtrl_error err = {0};
    double t0 = mtrl_time_mono();
    TEST_CHECK(mtrl_env_reset(e, 1, &r, &err) == MTRL_OK);
    double dt = mtrl_time_mono() - t0;
    printf("retrieval: 1M-token document generated in %.1f ms (%zu bytes of prompt)\n", dt * 1e3, r.obs_len);
    TEST_CHECKF(dt < 1.0, "generation took %.3f s", dt);
    TEST_CHECKF(r.obs_len > 1000000 && r.obs_len <= 1048576 + 64, "prompt %zu bytes", r.obs_len);
    // Unique keys: lines are fixed-width "kNNNNNN=vNNNNNN\n"; count distinct keys by bitmap.
    size_t line = strcspn(r.obs, "\n") + 1, lines = 0, dups = 0;
    int w = (int)line - 10;
    TEST_EQ_INT(w, 6);
    static unsigned char seen[1000000 / 8 + 1];
    memset(seen, 0, sizeof seen);
    for (const char *p = r.obs; p + line <= r.obs + r.obs_len && *p == 'k'; p += line, lines++) {
        long k = 0;
        for (int i = 1; i <= w; i++) k = k * 10 + (p[i] - '0');
        if (seen[k / 8] & (1 << (k % 8))) dups++;
        seen[k / 8] |= (unsigned char)(1 << (k % 8));
    }
    TEST_CHECKF(lines > 60000, "%zu lines", lines);
    TEST_EQ_INT(dups, 0);
    uint64_t h1 = 0;
    for (size_t i = 0; i < r.obs_len; i++) h1 = h1 * 31 + (unsigned char)r.obs[i];
    // Fact positions over seeds: the demo answer is the value; find its line's position.
    double lo = 1, hi = 0;
    for (uint64_t seed = 100; seed < 110; seed++) {
        TEST_CHECK(mtrl_env_reset(e, seed, &r, &err) == MTRL_OK);
        const char *q = strstr(r.obs + r.obs_len - 64, "value of ");
        if (!q) continue;
        char key[16];
        snprintf(key, sizeof key, "%.*s=", (int)strcspn(q + 9, "?"), q + 9);
        const char *at = strstr(r.obs, key);
        TEST_CHECK(at != NULL);
        if (at) {
            double pos = (double)(at - r.obs) / (double)r.obs_len;
            lo = pos < lo ? pos : lo;
            hi = pos > hi ? pos : hi;
        }
    }
    TEST_CHECKF(hi - lo > 0.3, "fact positions span only [%.2f, %.2f]", lo, hi);
    TEST_CHECK(mtrl_env_reset(e, 1, &r, &err) == MTRL_OK);
    uint64_t h2 = 0;
    for (size_t i = 0; i < r.obs_len; i++) h2 = h2 * 31 + (unsigned char)r.obs[i];
    TEST_CHECK(h1 == h2);
    TEST_CHECK(mtrl_env_reset(e, 2, &r, &err) == MTRL_OK);
    uint64_t h3 = 0;
    for (size_t i = 0; i < r.obs_len; i++) h3 = h3 * 31 + (unsigned char)r.obs[i];
    TEST_CHECK(h1 != h3);
    mtrl_env_close(e);

    // Over the observation cap: refused with MTRL_ERR_LIMIT, not handed out.
    mtrl_env_opts o;
    mtrl_env_opts_default(&o);
    o.max_obs_bytes = 10000;
    mtrl_env *small = NULL;
    TEST_CHECK(mtrl_env_open(&small, "retrieval", "doc_tokens=20000;inline_doc=1", &o, &err) == MTRL_OK);
    if (small) {
        TEST_EQ_INT(mtrl_env_reset(small, 1, &r, &err), MTRL_ERR_LIMIT);
        TEST_CONTAINS(err.msg, "over max_obs_bytes = 10000");
        mtrl_env_close(small);
    }
}

// max_tool_calls = 0: recall alone. The fact is in the prompt, the demo is the bare answer and
// solves it, a tool call ends the episode with reward 0, and the settings that would put the
// fact out of reach (no inline document) or make the demo call a tool are refused.
static void test_retrieval_no_tools(void) {
    mtrl_env *e = open_env("retrieval", "doc_tokens=2048;inline_doc=1;max_tool_calls=0;key_digits=4");
    for (uint64_t seed = 1; seed <= 5; seed++) {
        mtrl_env_result r;
        mtrl_error err = {0};
        TEST_CHECK(mtrl_env_reset(e, seed, &r, &err) == MTRL_OK);
        TEST_CONTAINS(r.obs, "no tool is available");
        // The asked-for key's line, with its value, is in the prompt.
        const char *q = strstr(r.obs, "What is the value of ");
        TEST_CHECK(q != NULL);
        char line[32];
        snprintf(line, sizeof line, "%.5s=v", q + 21);
        const char *at = strstr(r.obs, line);
        TEST_CHECKF(at != NULL && at < q, "the line of %.5s is not in the document", q + 21);
        mtrl_env_demo_out d;
        TEST_CHECK(mtrl_env_demo(e, &d, &err) == MTRL_OK);
        TEST_EQ_INT(d.count, 1);
        TEST_EQ_INT(d.actions[0].kind, MTRL_ENV_ACTION_ANSWER);
        TEST_CHECK(at && d.actions[0].len == 7 && !memcmp(d.actions[0].data, at + 6, 7));
        int steps = 0;
        TEST_CHECK(run_demo(e, seed, &steps) == 1.0);
        TEST_CHECK(mtrl_env_reset(e, seed, &r, &err) == MTRL_OK);
        TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_TOOL, "search(k1)", 10, &r, &err) == MTRL_OK);
        TEST_CHECK(r.done && r.reward == 0.0 && r.tool_error);
        TEST_CONTAINS(r.obs, "tool call limit (0)");
    }
    mtrl_env_close(e);
    const char *bad[][2] = {{"inline_doc=0;max_tool_calls=0", "max_tool_calls=0 with inline_doc=0"},
                            {"inline_doc=1;demo_search=1;max_tool_calls=0", "max_tool_calls=0 with demo_search=1"}};
    for (int i = 0; i < 2; i++) {
        mtrl_env *x = NULL;
        mtrl_error err = {0};
        TEST_CHECK(mtrl_env_open(&x, "retrieval", bad[i][0], NULL, &err) != MTRL_OK);
        TEST_CONTAINS(err.msg, bad[i][1]);
    }
}

// The reward of answering `answer` at once in the episode of seed.
static double answer_reward(mtrl_env *e, uint64_t seed, const char *answer) {
    mtrl_env_result r;
    mtrl_error err = {0};
    TEST_CHECK(mtrl_env_reset(e, seed, &r, &err) == MTRL_OK);
    TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_ANSWER, answer, strlen(answer), &r, &err) == MTRL_OK);
    TEST_CHECK(r.done);
    return r.reward;
}

// credit=c: a wrong answer of the value's shape ('v', six digits) earns c x the fraction of the
// digits it has in place; the exact value is 1, a malformed answer 0 and credit=0 (the default)
// leaves a wrong answer at 0. The rewards are exact (c x k / 6 in doubles, as env_credit_reward
// computes them); the largest partial one (c = 0.9, five digits) is below 1, so not success.
static void test_retrieval_credit(void) {
    const double credits[] = {0.5, 0.9};
    for (int ci = 0; ci < 2; ci++) {
        double c = credits[ci];
        char cfg[128];
        snprintf(cfg, sizeof cfg, "doc_tokens=256;inline_doc=1;max_tool_calls=0;key_digits=4;credit=%g", c);
        mtrl_env *e = open_env("retrieval", cfg);
        for (uint64_t seed = 1; seed <= 3; seed++) {
            mtrl_env_result r;
            mtrl_error err = {0};
            TEST_CHECK(mtrl_env_reset(e, seed, &r, &err) == MTRL_OK);
            mtrl_env_demo_out d;
            TEST_CHECK(mtrl_env_demo(e, &d, &err) == MTRL_OK);
            char value[8] = {0};
            TEST_EQ_INT(d.actions[0].len, 7);
            memcpy(value, d.actions[0].data, 7);
            TEST_CHECK(value[0] == 'v');
            TEST_NEAR(answer_reward(e, seed, value), 1.0, 0);
            // the first k digits right, the others off by one
            for (int k = 0; k < 6; k++) {
                char a[8];
                memcpy(a, value, 8);
                for (int i = 1 + k; i < 7; i++) a[i] = (char)('0' + (a[i] - '0' + 1) % 10);
                double got = answer_reward(e, seed, a);
                TEST_NEAR(got, c * k / 6, 0);
                TEST_CHECKF(got < 1.0, "%d digits of 6 earned %g", k, got);
            }
            // the last two digits right (digits count in place, not as a prefix), with whitespace
            char a[16];
            snprintf(a, sizeof a, " %.5s%.2s\n", value, value + 5);
            for (int i = 2; i < 6; i++) a[i] = (char)('0' + (a[i] - '0' + 5) % 10);
            TEST_NEAR(answer_reward(e, seed, a), c * 2 / 6, 0);
            // malformed: no 'v', a digit short or over, another letter, a non-digit, empty
            char nov[8], shortv[8], longv[9], letter[8], nondigit[8];
            snprintf(nov, sizeof nov, "%s", value + 1);
            snprintf(shortv, sizeof shortv, "%.6s", value);
            snprintf(longv, sizeof longv, "%s0", value);
            snprintf(letter, sizeof letter, "k%s", value + 1);
            snprintf(nondigit, sizeof nondigit, "%s", value);
            nondigit[3] = 'a';
            const char *bad[] = {nov, shortv, longv, letter, nondigit, "", "the value is"};
            for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
                TEST_CHECKF(answer_reward(e, seed, bad[i]) == 0.0, "malformed '%s' (value %s) earned credit", bad[i],
                            value);
            // a tool call still ends the episode with 0
            TEST_CHECK(mtrl_env_reset(e, seed, &r, &err) == MTRL_OK);
            TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_TOOL, "search(k1)", 10, &r, &err) == MTRL_OK);
            TEST_CHECK(r.done && r.reward == 0.0);
        }
        mtrl_env_close(e);
    }
    // credit=0 and no credit key: today's rewards, 1 or 0
    const char *zero[] = {"doc_tokens=256;inline_doc=1;max_tool_calls=0;key_digits=4;credit=0",
                          "doc_tokens=256;inline_doc=1;max_tool_calls=0;key_digits=4"};
    for (int zi = 0; zi < 2; zi++) {
        mtrl_env *e = open_env("retrieval", zero[zi]);
        mtrl_env_result r;
        mtrl_error err = {0};
        TEST_CHECK(mtrl_env_reset(e, 7, &r, &err) == MTRL_OK);
        mtrl_env_demo_out d;
        TEST_CHECK(mtrl_env_demo(e, &d, &err) == MTRL_OK);
        char value[8] = {0}, five[8];
        memcpy(value, d.actions[0].data, 7);
        memcpy(five, value, 8);
        five[6] = (char)('0' + (five[6] - '0' + 1) % 10);
        TEST_NEAR(answer_reward(e, 7, value), 1.0, 0);
        TEST_NEAR(answer_reward(e, 7, five), 0.0, 0);
        mtrl_env_close(e);
    }
    // refusals name the key and the range
    const char *bad[] = {"credit=1", "credit=0.95", "credit=-0.1", "credit=abc"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        mtrl_env *x = NULL;
        mtrl_error err = {0};
        TEST_CHECKF(mtrl_env_open(&x, "retrieval", bad[i], NULL, &err) != MTRL_OK, "%s accepted", bad[i]);
        TEST_CHECKF(strstr(err.msg, "credit") && strstr(err.msg, "0.9"), "%s: %s", bad[i], err.msg);
    }
}

int main(void) {
    test_retrieval_no_tools();
    test_retrieval_credit();
    test_calc_eval();
    test_calc();
    test_retrieval();
    test_retrieval_1m();
    return test_report();
}
