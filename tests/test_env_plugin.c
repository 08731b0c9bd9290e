// mtrl-test: cpu timeout=60
// test_env_plugin.c: the plug-in loader and the example plug-in.
// - ABI refusals, in-process and isolated, each with its message checked: wrong major, newer
//   minor, missing entry symbol, table too small, a NULL required callback, a missing file, a
//   file that is not a shared library.
// - The example `reverse` plug-in (build/lib/libmtrl_env_example.so) runs an episode both
//   in-process and isolated (demo, tool call, error observation, wrong answer).
// - The README's plain build (cc -shared -fPIC -I<repo>/env) works on the example, also under
//   -std=c11 -pedantic -Werror (the ABI header is standard C), and the result loads.
// - [env] max_tool_calls is enforced by the host for a plug-in (test_host_tool_limit).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/config.h"
#include "env/env_config.h"
#include "env/env_host.h"
#include "tests/testhelp.h"

static char libdir[1024];

static const char *lib(const char *name) {
    static char path[4][1200];
    static int k;
    k = (k + 1) % 4;
    snprintf(path[k], sizeof path[k], "%s/lib%s.so", libdir, name);
    return path[k];
}

static void expect_refused(const char *name, int isolate, mtrl_status code, const char *m1, const char *m2) {
    mtrl_env_opts o;
    mtrl_env_opts_default(&o);
    o.isolate = isolate;
    o.start_timeout_ms = 5000;
    mtrl_env *e = (mtrl_env *)1;
    mtrl_error err = {0};
    mtrl_status st = mtrl_env_open(&e, name, "", &o, &err);
    TEST_CHECKF(st == code, "%s (isolate=%d): got %s, want %s: %s", name, isolate, mtrl_status_name(st),
                mtrl_status_name(code), err.msg);
    TEST_CHECK(e == NULL);
    TEST_CONTAINS(err.msg, name); // the message names the file
    TEST_CONTAINS(err.msg, m1);
    if (m2) TEST_CONTAINS(err.msg, m2);
    if (isolate == 0) printf("refused: %s\n", err.msg);
}

static void test_refusals(void) {
    for (int iso = 0; iso <= 1; iso++) {
        expect_refused(lib("mtrl_env_bad_abi_major"), iso, MTRL_ERR_PLUGIN,
                       "was built for env ABI 99.0 but this host speaks 1.0",
                       "rebuild it against this mtrl's env/mtrl_env.h");
        expect_refused(lib("mtrl_env_bad_abi_minor"), iso, MTRL_ERR_PLUGIN,
                       "needs env ABI 1.7, newer than this host's 1.0", "update mtrl, or rebuild the plug-in");
        expect_refused(lib("mtrl_env_bad_no_symbol"), iso, MTRL_ERR_PLUGIN, "does not export 'mtrl_env_plugin'",
                       "see env/examples/README.md");
        expect_refused(lib("mtrl_env_bad_small"), iso, MTRL_ERR_PLUGIN, "struct_size 8 is smaller than the",
                       "set struct_size = sizeof(mtrl_env_api)");
        expect_refused(lib("mtrl_env_bad_null_step"), iso, MTRL_ERR_PLUGIN, "required callback 'step' is NULL", NULL);
        expect_refused(lib("mtrl_env_does_not_exist"), iso, MTRL_ERR_PLUGIN, "could not be loaded",
                       "No such file");
    }
    // A file that is not a shared library.
    char junk[] = "/tmp/mtrl_env_junk_XXXXXX";
    int fd = mkstemp(junk);
    TEST_CHECK(fd >= 0);
    if (fd >= 0) {
        TEST_CHECK(write(fd, "not an ELF file\n", 16) == 16);
        close(fd);
        char path[64];
        snprintf(path, sizeof path, "%s", junk); // contains '/', so it is taken as a plug-in path
        expect_refused(path, 0, MTRL_ERR_PLUGIN, "could not be loaded", "shared library");
        expect_refused(path, 1, MTRL_ERR_PLUGIN, "could not be loaded", "shared library");
        unlink(junk);
    }
    // The same defect-free source loads fine (the fixtures fail for their defect only).
    mtrl_env *e = NULL;
    mtrl_error err = {0};
    TEST_CHECKF(mtrl_env_open(&e, lib("mtrl_env_bad_none"), "", NULL, &err) == MTRL_OK, "%s", err.msg);
    mtrl_env_close(e);
}

static void run_reverse(const char *path, int isolate) {
    mtrl_env_opts o;
    mtrl_env_opts_default(&o);
    o.isolate = isolate;
    mtrl_env *e = NULL;
    mtrl_error err = {0};
    mtrl_status st = mtrl_env_open(&e, path, "min_len=4; ;max_len = 8\n", &o, &err);
    TEST_CHECKF(st == MTRL_OK, "open %s isolate=%d: %s", path, isolate, err.msg);
    if (!e) return;
    TEST_EQ_STR(mtrl_env_name(e), "reverse");
    TEST_EQ_STR(mtrl_env_version(e), "1.0");
    TEST_EQ_INT(mtrl_env_isolated(e), isolate);
    TEST_EQ_INT(mtrl_env_has_demo(e), 1);
    const char *tools;
    size_t tl;
    TEST_CHECK(mtrl_env_describe(e, &tools, &tl, &err) == MTRL_OK);
    TEST_CONTAINS(tools, "letter(i)");

    mtrl_env_result r;
    TEST_CHECKF(mtrl_env_reset(e, 11, &r, &err) == MTRL_OK, "%s", err.msg);
    char prompt[64], word[40];
    snprintf(prompt, sizeof prompt, "%.*s", (int)r.obs_len, r.obs);
    TEST_CHECK(sscanf(prompt, "Reverse the word: %39s", word) == 1);
    size_t n = strlen(word);
    TEST_CHECKF(n >= 4 && n <= 8, "word '%s'", word);
    if (isolate == 0) printf("reverse prompt: %s", prompt);

    mtrl_env_demo_out d;
    TEST_CHECK(mtrl_env_demo(e, &d, &err) == MTRL_OK);
    TEST_EQ_INT(d.count, 1);
    char answer[40] = "";
    if (d.count == 1) {
        TEST_EQ_INT(d.actions[0].kind, MTRL_ENV_ACTION_ANSWER);
        snprintf(answer, sizeof answer, "%.*s", (int)d.actions[0].len, d.actions[0].data);
    }
    for (size_t i = 0; i < n; i++) TEST_CHECK(answer[i] == word[n - 1 - i]);

    TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_TOOL, "letter(0)", 9, &r, &err) == MTRL_OK);
    TEST_CHECK(r.obs_len == 1 && r.obs[0] == word[0]);
    TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_TOOL, "foo(1)", 6, &r, &err) == MTRL_OK);
    TEST_CONTAINS(r.obs, "error: unknown tool 'foo'; tools: letter");
    TEST_EQ_INT(r.tool_error, 1);
    TEST_EQ_INT(r.done, 0);
    TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_ANSWER, answer, strlen(answer), &r, &err) == MTRL_OK);
    TEST_EQ_INT(r.done, 1);
    TEST_EQ_INT(r.reward * 1000, 1000);
    TEST_CHECK(r.latency_s >= 0 && r.latency_s < 5);

    TEST_CHECK(mtrl_env_reset(e, 11, &r, &err) == MTRL_OK);
    TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_ANSWER, word, n, &r, &err) == MTRL_OK);
    TEST_EQ_INT(r.done, 1);
    TEST_EQ_INT(r.reward * 1000, 0);

    mtrl_env_stats s;
    mtrl_env_stats_get(e, &s);
    TEST_EQ_INT(s.episodes, 2);
    TEST_EQ_INT(s.steps, 4);
    TEST_EQ_INT(s.aborts, 0);
    TEST_EQ_INT(s.restarts, 0);

    // The plug-in refuses bad config with its own message, passed through.
    mtrl_env *bad = NULL;
    TEST_EQ_INT(mtrl_env_open(&bad, path, "colour=red", &o, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "env 'reverse' refused its config: reverse: unknown config key 'colour'");
    mtrl_env_close(e);
}

static void test_plain_build(void) {
    const char *src = getenv("MTRL_SRC");
    if (system("command -v cc >/dev/null 2>&1") != 0 || !src) {
        printf("no cc on PATH: skipping the README build check\n");
        return;
    }
    char dir[] = "/tmp/mtrl_env_build_XXXXXX";
    if (!mkdtemp(dir)) {
        TEST_CHECK(0);
        return;
    }
    char cmd[4096], so[128];
    snprintf(so, sizeof so, "%s/myenv.so", dir);
    snprintf(cmd, sizeof cmd, "cc -shared -fPIC -std=c11 -pedantic -Wall -Wextra -Werror -I%s/env -o %s %s/env/examples/reverse.c",
             src, so, src);
    int rc = system(cmd);
    TEST_CHECKF(rc == 0, "%s -> %d", cmd, rc);
    if (rc == 0) run_reverse(so, 0);
    unlink(so);
    rmdir(dir);
}

// [env] max_tool_calls holds for a plug-in too (issue 28, item 16: it was ignored, the plug-in's
// own limit applied): with max_tool_calls = 1, reverse (whose own limit is 4) gets the first
// tool call; the second ends the episode in the host, reward 0, and the plug-in never sees it;
// the next episode gets its one call again.
static void test_host_tool_limit(const char *path, int isolate) {
    char text[1600];
    snprintf(text, sizeof text, "[env]\nname = plugin\nplugin = %s\nisolate = %s\nmax_tool_calls = 1\n", path,
             isolate ? "true" : "false");
    mtrl_config cfg;
    mtrl_config_errors errs = {0};
    TEST_CHECK(mtrl_config_load_text(&cfg, "limit.ini", text, NULL, 0, &errs) == MTRL_OK);
    mtrl_config_errors_free(&errs);
    mtrl_env *e = NULL;
    mtrl_error err = {0};
    TEST_CHECKF(mtrl_env_open_config(&cfg, &e, &err) == MTRL_OK, "%s", err.msg);
    if (!e) return;
    mtrl_env_result r;
    for (int ep = 0; ep < 2; ep++) {
        TEST_CHECKF(mtrl_env_reset(e, 11, &r, &err) == MTRL_OK, "%s", err.msg);
        TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_TOOL, "letter(0)", 9, &r, &err) == MTRL_OK);
        TEST_EQ_INT(r.done, 0);
        TEST_EQ_INT(r.obs_len, 1);
        TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_TOOL, "letter(1)", 9, &r, &err) == MTRL_OK);
        TEST_EQ_INT(r.done, 1);
        TEST_EQ_INT(r.tool_error, 1);
        TEST_EQ_INT(r.reward * 1000, 0);
        char obs[128];
        snprintf(obs, sizeof obs, "%.*s", (int)r.obs_len, r.obs);
        TEST_EQ_STR(obs, "error: tool call limit (1) reached; episode over");
        // over: a step now is refused until the next reset
        TEST_EQ_INT(mtrl_env_step(e, MTRL_ENV_ACTION_ANSWER, "x", 1, &r, &err), MTRL_ERR_STATE);
    }
    mtrl_env_close(e);
}

int main(void) {
    const char *b = getenv("MTRL_BUILD");
    snprintf(libdir, sizeof libdir, "%s/lib", b ? b : ".");
    test_refusals();
    run_reverse(lib("mtrl_env_example"), 0);
    run_reverse(lib("mtrl_env_example"), 1);
    test_host_tool_limit(lib("mtrl_env_example"), 0);
    test_host_tool_limit(lib("mtrl_env_example"), 1);
    test_plain_build();
    return test_report();
}
