// mtrl-test: cpu slow timeout=600
// test_agent_cpu.c: experiments/agent-cpu.ini end to end (fork/exec of MTRL_BIN in a mkdtemp
// directory): the many-turn `corpus` env up its two-stage ladder, the actor's decode states
// through the memory account ([actor] device_budget_mb), the per-token mask on. The run finishes
// its 4 steps with exit 0; every episode ends complete or truncated (none aborted: the env and
// the memory account never failed one); the stage-2 episodes come from the env with its stage
// keys; `mtrl replay --reexec` of an episode of each stage is identical (replay re-executes an
// episode in its stage's config).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/testhelp.h"
#include "tests/testproc.h"

int main(void) {
    const char *bin = getenv("MTRL_BIN"), *src = getenv("MTRL_SRC");
    if (!bin || !src) {
        fprintf(stderr, "MTRL_BIN and MTRL_SRC must be set (ctest sets them)\n");
        return 1;
    }
    char dir[64] = "/tmp/mtrl-agent-XXXXXX", ini[1024], db[256];
    TEST_CHECK(mkdtemp(dir) != NULL);
    snprintf(ini, sizeof ini, "%s/experiments/agent-cpu.ini", src);
    snprintf(db, sizeof db, "%s/runs.db", dir);
    test_result r = test_run_in(dir, (char *[]){(char *)bin, "run", ini, "--db", "runs.db", "--set", "run.out_dir=runs",
                                                "--set", "run.max_minutes=8", "--set", "run.checkpoint_every=1", "--set",
                                                "run.keep_checkpoints=0", NULL});
    TEST_CHECKF(r.rc == 0, "mtrl run agent-cpu.ini: exit %d\n%s", r.rc, r.err);
    TEST_CONTAINS(r.err, "run 1 finished: 4 steps");
    test_result_free(&r);
    long long n = test_query_int(db, "select count(*) from episodes");
    long long bad = test_query_int(db, "select count(*) from episodes where status not in ('complete', 'truncated')");
    long long calls = test_query_int(db, "select coalesce(sum(tool_calls), 0) from episodes");
    printf("agent-cpu: %lld episodes, %lld tool calls in all, %lld neither complete nor truncated\n", n, calls, bad);
    TEST_CHECK(n >= 8);
    TEST_EQ_INT(bad, 0);
    TEST_EQ_INT(test_query_int(db, "select count(*) from metrics where name = 'token_masked_frac'"), 4);
    // no step trains a token sampled more than [learner] max_staleness (4) versions before it
    TEST_CHECK(test_query_int(db, "select coalesce(max(value), 0) from metrics where name = 'staleness_max'") <= 4);
    // an episode of one weight version that has a checkpoint (checkpoint_every = 1; a stage's
    // first version, the same weights as the step before, has none)
    // One of stage 1 (hops = 1, context 2048: not the base [env] and [actor]) and one of stage 2:
    // replay re-executes each in its own stage.
    char id[32];
    for (int st = 1; st <= 2; st++) {
        char q[400];
        snprintf(q, sizeof q,
                 "select id from episodes where version_min = version_max and version_min in (select version from "
                 "checkpoints) and step %s 2 order by tool_calls desc, id limit 1",
                 st == 1 ? "<" : ">=");
        long long ep = test_query_int(db, q);
        TEST_CHECKF(ep > 0, "no stage-%d episode with a retained version", st);
        snprintf(id, sizeof id, "%lld", ep);
        r = test_run_in(dir, (char *[]){(char *)bin, "replay", "--db", "runs.db", "--episode", id, "--reexec", NULL});
        TEST_CHECKF(r.rc == 0, "replay --reexec: exit %d\n%s", r.rc, r.err);
        TEST_CONTAINS(r.out, "corpus");
        TEST_CONTAINS(r.out, "identical");
        test_result_free(&r);
    }
    // A stage-2 episode's prompt: the env was opened with the stage's hops.
    long long ep2 = test_query_int(db, "select id from episodes where step >= 3 order by id limit 1");
    if (ep2 > 0) {
        snprintf(id, sizeof id, "%lld", ep2);
        r = test_run_in(dir, (char *[]){(char *)bin, "replay", "--db", "runs.db", "--episode", id, NULL});
        TEST_CHECK(r.rc == 0);
        TEST_CHECKF(strstr(r.out, "follow next= 2 times") || strstr(r.out, "sum of v") || strstr(r.out, "largest t"),
                    "stage-2 episode %s: not a corpus prompt", id);
        test_result_free(&r);
    }
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
    return test_report();
}
