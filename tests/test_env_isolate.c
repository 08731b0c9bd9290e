// mtrl-test: cpu fault timeout=60
// test_env_isolate.c: envs in a child process (env_host.h, isolate = 1).
// - A plug-in that segfaults or abort()s in step aborts that episode with a reason naming the
//   signal; stepping on is a state error; the next reset starts a fresh child and works.
// - A plug-in that loops forever in step is killed at the step deadline (500 ms here) with
//   "env step timed out after 500 ms"; the next episode works.
// - Built-ins run isolated with the same tasks as in-process, including a 1 MB prompt.
// - The child has the configured rlimits, no inherited descriptors beyond 0-3, argv[0]
//   "mtrl-env-host", and dies with its parent (PR_SET_PDEATHSIG).
// - A reply over max_obs_bytes is refused and the child is replaced.
#include <errno.h>
#include <fcntl.h>
#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/timeutil.h"
#include "env/env_host.h"
#include "tests/testhelp.h"

static char libdir[1024];

static const char *lib(const char *name) {
    static char path[1200];
    snprintf(path, sizeof path, "%s/lib%s.so", libdir, name);
    return path;
}

static mtrl_env *open_iso(const char *name, const char *config, int timeout_ms) {
    mtrl_env_opts o;
    mtrl_env_opts_default(&o);
    o.isolate = 1;
    o.call_timeout_ms = timeout_ms;
    o.start_timeout_ms = 5000;
    mtrl_env *e = NULL;
    mtrl_error err = {0};
    TEST_CHECKF(mtrl_env_open(&e, name, config, &o, &err) == MTRL_OK, "open %s: %s", name, err.msg);
    return e;
}

// One good episode of the fixture env: prompt "say ok", answer "ok" -> reward 1.
static void good_episode(mtrl_env *e) {
    mtrl_env_result r;
    mtrl_error err = {0};
    TEST_CHECKF(mtrl_env_reset(e, 1, &r, &err) == MTRL_OK, "reset: %s", err.msg);
    TEST_CHECK(r.obs_len == 6 && !memcmp(r.obs, "say ok", 6));
    TEST_CHECKF(mtrl_env_step(e, MTRL_ENV_ACTION_ANSWER, "ok", 2, &r, &err) == MTRL_OK, "step: %s", err.msg);
    TEST_EQ_INT(r.done, 1);
    TEST_EQ_INT(r.reward * 1000, 1000);
}

static int pid_alive(int pid) {
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *p = strrchr(buf, ')');
    return p && p[1] == ' ' && p[2] != 'Z' && p[2] != 'X'; // a zombie is dead
}

static void test_crash(const char *fixture, const char *reason) {
    mtrl_env *e = open_iso(lib(fixture), "", 2000);
    if (!e) return;
    good_episode(e);
    mtrl_env_stats s;
    mtrl_env_stats_get(e, &s);
    int pid1 = s.child_pid;
    TEST_CHECK(pid1 > 0);

    mtrl_env_result r;
    mtrl_error err = {0};
    TEST_CHECK(mtrl_env_reset(e, 2, &r, &err) == MTRL_OK);
    TEST_CHECK(mtrl_env_step(e, MTRL_ENV_ACTION_TOOL, "hello()", 7, &r, &err) == MTRL_OK); // survives normal calls
    TEST_EQ_INT(r.tool_error, 1);
    double t0 = mtrl_time_mono();
    mtrl_status st = mtrl_env_step(e, MTRL_ENV_ACTION_TOOL, "boom()", 6, &r, &err);
    double dt = mtrl_time_mono() - t0;
    TEST_EQ_INT(st, MTRL_ERR_PLUGIN);
    TEST_CONTAINS(err.msg, reason);
    TEST_CHECKF(dt < 1.5, "crash noticed after %.3f s", dt);
    printf("%s: %s (%.1f ms)\n", fixture, err.msg, dt * 1e3);
    TEST_CHECK(!pid_alive(pid1));
    // The episode is over: stepping is a state error, not a hang or a crash of ours.
    TEST_EQ_INT(mtrl_env_step(e, MTRL_ENV_ACTION_ANSWER, "ok", 2, &r, &err), MTRL_ERR_STATE);
    mtrl_env_stats_get(e, &s);
    TEST_EQ_INT(s.aborts, 1);
    TEST_EQ_INT(s.child_pid, 0);
    // The next episode gets a fresh child and works.
    good_episode(e);
    mtrl_env_stats_get(e, &s);
    TEST_EQ_INT(s.restarts, 1);
    TEST_CHECK(s.child_pid > 0 && s.child_pid != pid1);
    // And it can crash and recover again.
    TEST_CHECK(mtrl_env_reset(e, 3, &r, &err) == MTRL_OK);
    TEST_EQ_INT(mtrl_env_step(e, MTRL_ENV_ACTION_TOOL, "boom()", 6, &r, &err), MTRL_ERR_PLUGIN);
    good_episode(e);
    mtrl_env_stats_get(e, &s);
    TEST_EQ_INT(s.restarts, 2);
    TEST_EQ_INT(s.aborts, 2);
    mtrl_env_close(e);
}

static void test_hang(void) {
    mtrl_env *e = open_iso(lib("mtrl_env_bad_hang"), "", 500);
    if (!e) return;
    good_episode(e);
    mtrl_env_stats s;
    mtrl_env_stats_get(e, &s);
    int pid1 = s.child_pid;
    mtrl_env_result r;
    mtrl_error err = {0};
    TEST_CHECK(mtrl_env_reset(e, 2, &r, &err) == MTRL_OK);
    double t0 = mtrl_time_mono();
    mtrl_status st = mtrl_env_step(e, MTRL_ENV_ACTION_TOOL, "boom()", 6, &r, &err);
    double dt = mtrl_time_mono() - t0;
    TEST_EQ_INT(st, MTRL_ERR_TIMEOUT);
    TEST_CONTAINS(err.msg, "env step timed out after 500 ms");
    TEST_CHECKF(dt >= 0.45 && dt < 1.5, "timeout after %.3f s", dt);
    printf("hang: %s (%.1f ms)\n", err.msg, dt * 1e3);
    TEST_CHECK(!pid_alive(pid1));
    TEST_EQ_INT(mtrl_env_step(e, MTRL_ENV_ACTION_ANSWER, "ok", 2, &r, &err), MTRL_ERR_STATE);
    good_episode(e);
    mtrl_env_stats_get(e, &s);
    TEST_EQ_INT(s.restarts, 1);
    TEST_EQ_INT(s.aborts, 1);
    // A child killed from outside between episodes is replaced at the next reset.
    int pid2 = s.child_pid;
    kill(pid2, SIGKILL);
    double until = mtrl_time_mono() + 2.0;
    while (pid_alive(pid2) && mtrl_time_mono() < until) {
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
    }
    good_episode(e);
    mtrl_env_stats_get(e, &s);
    TEST_EQ_INT(s.restarts, 2);
    TEST_EQ_INT(s.aborts, 1);
    mtrl_env_close(e);
}

// Isolated built-ins give the same prompts and rewards as in-process ones.
static void test_builtins(void) {
    mtrl_env *iso = open_iso("calc", "digits=2;ops=2", 5000);
    mtrl_env *inp = NULL;
    mtrl_error err = {0};
    TEST_CHECK(mtrl_env_open(&inp, "calc", "digits=2;ops=2", NULL, &err) == MTRL_OK);
    if (iso && inp) {
        for (uint64_t seed = 0; seed < 10; seed++) {
            mtrl_env_result a, b;
            TEST_CHECK(mtrl_env_reset(iso, seed, &a, &err) == MTRL_OK);
            char pa[64];
            snprintf(pa, sizeof pa, "%.*s", (int)a.obs_len, a.obs);
            TEST_CHECK(mtrl_env_reset(inp, seed, &b, &err) == MTRL_OK);
            TEST_CHECK(a.obs_len == b.obs_len && !memcmp(pa, b.obs, b.obs_len));
            mtrl_env_demo_out d;
            TEST_CHECK(mtrl_env_demo(iso, &d, &err) == MTRL_OK);
            TEST_EQ_INT(d.count, 2);
            if (d.count != 2) continue;
            char call[64], ans[32];
            snprintf(call, sizeof call, "%.*s", (int)d.actions[0].len, d.actions[0].data);
            snprintf(ans, sizeof ans, "%.*s", (int)d.actions[1].len, d.actions[1].data);
            TEST_EQ_INT(d.actions[0].kind, MTRL_ENV_ACTION_TOOL);
            TEST_EQ_INT(d.actions[1].kind, MTRL_ENV_ACTION_ANSWER);
            TEST_CHECK(mtrl_env_step(iso, MTRL_ENV_ACTION_TOOL, call, strlen(call), &a, &err) == MTRL_OK);
            TEST_CHECK(a.obs_len == strlen(ans) && !memcmp(a.obs, ans, a.obs_len));
            TEST_CHECK(mtrl_env_step(iso, MTRL_ENV_ACTION_TOOL, "nope", 4, &a, &err) == MTRL_OK);
            TEST_CONTAINS(a.obs, "error: malformed tool call 'nope'");
            TEST_CHECK(mtrl_env_step(iso, MTRL_ENV_ACTION_ANSWER, ans, strlen(ans), &a, &err) == MTRL_OK);
            TEST_EQ_INT(a.done, 1);
            TEST_EQ_INT(a.reward * 1000, 1000);
        }
    }
    mtrl_env_close(iso);
    mtrl_env_close(inp);

    // A 1M-token prompt crosses the socket intact.
    iso = open_iso("retrieval", "doc_tokens=1048576;inline_doc=1", 5000);
    if (iso) {
        mtrl_env_result r;
        double t0 = mtrl_time_mono();
        TEST_CHECK(mtrl_env_reset(iso, 9, &r, &err) == MTRL_OK);
        double dt = mtrl_time_mono() - t0;
        printf("isolated retrieval reset with a %zu-byte prompt: %.1f ms (latency %.1f ms)\n", r.obs_len, dt * 1e3,
               r.latency_s * 1e3);
        TEST_CHECK(r.obs_len > 1000000);
        TEST_CHECK(r.obs[0] == 'k' && r.obs[r.obs_len - 1] == '\n');
        mtrl_env_demo_out d;
        TEST_CHECK(mtrl_env_demo(iso, &d, &err) == MTRL_OK);
        if (d.count == 1) {
            char ans[16];
            snprintf(ans, sizeof ans, "%.*s", (int)d.actions[0].len, d.actions[0].data);
            TEST_CHECK(mtrl_env_step(iso, MTRL_ENV_ACTION_ANSWER, ans, strlen(ans), &r, &err) == MTRL_OK);
            TEST_EQ_INT(r.reward * 1000, 1000);
        } else {
            TEST_CHECK(0);
        }
        mtrl_env_close(iso);
    }

    // A reply over max_obs_bytes is refused before allocation; the child is replaced.
    mtrl_env_opts o;
    mtrl_env_opts_default(&o);
    o.isolate = 1;
    o.max_obs_bytes = 10000;
    mtrl_env *e = NULL;
    TEST_CHECK(mtrl_env_open(&e, "retrieval", "doc_tokens=20000;inline_doc=1", &o, &err) == MTRL_OK);
    if (e) {
        mtrl_env_result r;
        TEST_EQ_INT(mtrl_env_reset(e, 1, &r, &err), MTRL_ERR_LIMIT);
        TEST_CONTAINS(err.msg, "over max_obs_bytes = 10000");
        mtrl_env_stats s;
        mtrl_env_stats_get(e, &s);
        TEST_EQ_INT(s.child_pid, 0);
        mtrl_env_close(e);
    }
    // Config errors come back from the child unchanged.
    TEST_EQ_INT(mtrl_env_open(&e, "calc", "digits=0", &o, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "digits=0 out of range 1..6");
    TEST_EQ_INT(mtrl_env_open(&e, "nosuch", "", &o, &err), MTRL_ERR_NOTFOUND);
    TEST_CONTAINS(err.msg, "unknown env 'nosuch'");
}

static long limit_of(int pid, const char *what) {
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/limits", pid);
    FILE *f = fopen(path, "r");
    if (!f) return -2;
    long v = -3;
    while (fgets(line, sizeof line, f)) {
        if (!strncmp(line, what, strlen(what))) {
            const char *p = line + strlen(what);
            while (*p == ' ') p++;
            v = !strncmp(p, "unlimited", 9) ? -1 : atol(p);
        }
    }
    fclose(f);
    return v;
}

static void test_child_setup(void) {
    // A descriptor without close-on-exec: the child must not inherit it.
    int leak = open("/dev/null", O_RDONLY);
    TEST_CHECK(leak >= 0);
    mtrl_env_opts o;
    mtrl_env_opts_default(&o);
    o.isolate = 1;
    o.mem_limit_bytes = (uint64_t)1 << 30;
    o.cpu_limit_s = 100;
    o.nofile_limit = 32;
    mtrl_env *e = NULL;
    mtrl_error err = {0};
    TEST_CHECK(mtrl_env_open(&e, "calc", "", &o, &err) == MTRL_OK);
    if (leak >= 0) close(leak);
    if (!e) return;
    mtrl_env_stats s;
    mtrl_env_stats_get(e, &s);
    int pid = s.child_pid;
    TEST_CHECK(pid > 0);
#if !defined(__SANITIZE_ADDRESS__)
    TEST_EQ_INT(limit_of(pid, "Max address space"), 1L << 30);
#endif
    TEST_EQ_INT(limit_of(pid, "Max cpu time"), 100);
    TEST_EQ_INT(limit_of(pid, "Max open files"), 32);
    TEST_EQ_INT(limit_of(pid, "Max core file size"), 0);
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd", pid);
    DIR *d = opendir(path);
    int nfd = 0, max_fd = -1;
    if (d) {
        struct dirent *de;
        while ((de = readdir(d))) {
            if (de->d_name[0] == '.') continue;
            int fd = atoi(de->d_name);
            nfd++;
            max_fd = fd > max_fd ? fd : max_fd;
        }
        closedir(d);
    }
    TEST_CHECKF(nfd == 4 && max_fd == 3, "child has %d descriptors, highest %d", nfd, max_fd);
    snprintf(path, sizeof path, "/proc/%d/cmdline", pid);
    FILE *f = fopen(path, "r");
    char cmd[64] = "";
    if (f) {
        size_t n = fread(cmd, 1, sizeof cmd - 1, f);
        cmd[n] = 0;
        fclose(f);
    }
    TEST_EQ_STR(cmd, "mtrl-env-host");
    mtrl_env_close(e);
    TEST_CHECK(!pid_alive(pid));

    // PR_SET_PDEATHSIG: a host process that dies takes its env child with it.
    int pfd[2];
    TEST_CHECK(pipe(pfd) == 0);
    pid_t mid = fork();
    if (mid == 0) {
        close(pfd[0]);
        mtrl_env *m = NULL;
        mtrl_env_opts mo;
        mtrl_env_opts_default(&mo);
        mo.isolate = 1;
        int cpid = 0;
        if (mtrl_env_open(&m, "calc", "", &mo, NULL) == MTRL_OK) {
            mtrl_env_stats ms;
            mtrl_env_stats_get(m, &ms);
            cpid = ms.child_pid;
        }
        if (write(pfd[1], &cpid, sizeof cpid) != sizeof cpid) _exit(2);
        pause(); // killed by the test
        _exit(0);
    }
    close(pfd[1]);
    int cpid = 0;
    TEST_CHECK(read(pfd[0], &cpid, sizeof cpid) == sizeof cpid);
    close(pfd[0]);
    TEST_CHECK(cpid > 0 && pid_alive(cpid));
    kill(mid, SIGKILL);
    waitpid(mid, NULL, 0);
    double until = mtrl_time_mono() + 2.0;
    while (cpid > 0 && pid_alive(cpid) && mtrl_time_mono() < until) {
        struct timespec ts = {0, 5000000};
        nanosleep(&ts, NULL);
    }
    TEST_CHECKF(cpid > 0 && !pid_alive(cpid), "env child %d outlived its host", cpid);
}

int main(int argc, char **argv) {
    mtrl_env_host_main(argc, argv); // the isolated envs below start this program as their child
    const char *b = getenv("MTRL_BUILD");
    snprintf(libdir, sizeof libdir, "%s/lib", b ? b : ".");
#if defined(__SANITIZE_ADDRESS__)
    // AddressSanitizer turns SIGSEGV into exit status 1; let the env children die of the real
    // signal, as they do in a normal build (children read ASAN_OPTIONS when they start).
    setenv("ASAN_OPTIONS", "handle_segv=0", 1);
#endif
    test_crash("mtrl_env_bad_segv", "env crashed: signal 11 (Segmentation fault) during step");
    test_crash("mtrl_env_bad_abort", "env crashed: signal 6 (Aborted) during step");
    test_hang();
    test_builtins();
    test_child_setup();
    return test_report();
}
