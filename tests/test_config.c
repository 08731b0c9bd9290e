// mtrl-test: cpu
// The typed INI config: every kind of error is reported with file:line and a useful message,
// all errors are collected, --set goes through the same checks, the resolved config round-trips
// through its own INI text with the same hash, and the shipped experiments load.
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "common/config.h"
#include "tests/testhelp.h"

// Loads text and returns the joined error messages (caller frees), or NULL when it loaded.
static char *load_errors(const char *text, const char *const *sets, int n_sets, mtrl_config *cfg) {
    mtrl_config_errors errs = {0};
    mtrl_status st = mtrl_config_load_text(cfg, "x.ini", text, sets, n_sets, &errs);
    if (st == MTRL_OK) {
        TEST_EQ_INT(errs.n, 0);
        mtrl_config_errors_free(&errs);
        return NULL;
    }
    size_t cap = 1;
    for (int i = 0; i < errs.n; i++) cap += strlen(errs.msgs[i]) + 1;
    char *all = calloc(1, cap);
    for (int i = 0; i < errs.n; i++) { strcat(all, errs.msgs[i]); strcat(all, "\n"); }
    mtrl_config_errors_free(&errs);
    return all;
}

#define ENV "[env]\nname = calc\n"

static void expect_error(const char *text, const char *needle) {
    mtrl_config cfg;
    char *e = load_errors(text, NULL, 0, &cfg);
    TEST_CHECKF(e != NULL, "expected an error containing \"%s\" for:\n%s", needle, text);
    if (e) TEST_CONTAINS(e, needle);
    free(e);
}

int main(void) {
    mtrl_config cfg;

    // unknown key on line 3, with the nearest valid key
    expect_error(ENV "[learner]\nlrr = 2\n", "x.ini:4: unknown key 'lrr' in [learner]; did you mean 'lr'?");
    expect_error("[run]\nname = a\nsteeps = 3\n" ENV, "x.ini:3: unknown key 'steeps' in [run]; did you mean 'steps'?");
    // unknown section with the nearest
    expect_error(ENV "[learnr]\nlr = 1\n", "x.ini:3: unknown section [learnr]; did you mean [learner]?");
    // duplicate key and duplicate section
    expect_error(ENV "[run]\nsteps = 3\nsteps = 4\n", "x.ini:5: duplicate key 'steps' in [run] (first set on line 4)");
    expect_error(ENV "[run]\n[run]\n", "x.ini:4: duplicate section [run] (first on line 3)");
    // wrong type, out of range, bad choice, bad bool
    expect_error(ENV "[run]\nsteps = ten\n", "x.ini:4: [run] steps: expected an integer, got 'ten'");
    expect_error(ENV "[learner]\nlr = 1e-3x\n", "x.ini:4: [learner] lr: expected a finite number, got '1e-3x'");
    expect_error(ENV "[model]\ng_min = -20\n", "x.ini:4: [model] g_min: -20 is out of range [-8, -0.01]");
    expect_error(ENV "[algo]\nloss = ppo2\n", "x.ini:4: [algo] loss: 'ppo2' is not one of ppo|cispo|gspo");
    expect_error(ENV "[env]\n", "duplicate section [env]");
    expect_error("[env]\nname = calc\nisolate = maybe\n", "x.ini:3: [env] isolate: 'maybe' is not one of auto|true|false");
    // missing required key
    expect_error("[run]\nsteps = 3\n", "x.ini: [env] missing required key 'name'");
    // [learner] segment: auto (the default) or a token count; the old [model] segment is refused
    // with where it went
    expect_error(ENV "[model]\nsegment = 0\n", "x.ini:4: [model] segment has moved to [learner] segment");
    expect_error(ENV "[learner]\nsegment = 0\n", "[learner] segment: '0' is not auto or a token count");
    expect_error(ENV "[learner]\nsegment = 64k\n", "[learner] segment: '64k' is not auto or a token count");
    TEST_CHECK(load_errors(ENV, NULL, 0, &cfg) == NULL);
    TEST_EQ_INT(mtrl_config_segment(&cfg), MTRL_CFG_SEGMENT_AUTO);
    TEST_CHECK(load_errors(ENV "[learner]\nsegment = 4096\n", NULL, 0, &cfg) == NULL);
    TEST_EQ_INT(mtrl_config_segment(&cfg), 4096);
    {
        const char *sets[] = {"learner.segment=128", "kernels.gemm=bf16"};
        TEST_CHECK(load_errors(ENV, sets, 2, &cfg) == NULL);
        TEST_EQ_INT(mtrl_config_segment(&cfg), 128);
        TEST_EQ_STR(cfg.kernels.gemm, "bf16");
        // the resolved INI (what runs.db stores with the run) carries [kernels]
        char *ini = mtrl_config_to_ini(&cfg);
        TEST_CONTAINS(ini, "[kernels]");
        TEST_CONTAINS(ini, "gemm = bf16");
        free(ini);
    }
    expect_error(ENV "[kernels]\ngemm = fp16\n", "[kernels] gemm: 'fp16' is not one of model|tf32|fp32|bf16");
    // syntax: no '=', indented continuation, key before any section
    expect_error(ENV "[run]\nsteps\n", "x.ini:4: expected 'key = value', got 'steps'");
    expect_error(ENV "[run]\nsteps = 3\n  more\n", "x.ini:5: indented line");
    expect_error("steps = 3\n" ENV, "x.ini:1: key outside any section");
    // an over-long line is rejected, never split into a bogus key
    {
        char text[1024];
        char longv[400];
        memset(longv, 'a', sizeof longv - 1);
        longv[sizeof longv - 1] = '\0';
        snprintf(text, sizeof text, ENV "[run]\nname = %s=steps\n", longv);
        mtrl_config c2;
        char *e = load_errors(text, NULL, 0, &c2);
        TEST_CHECK(e != NULL);
        if (e) TEST_CONTAINS(e, "x.ini:4: line is");
        free(e);
    }
    // stages must be numbered without gaps
    expect_error(ENV "[stage.2]\nsteps = 3\n", "[stage.1] is missing");
    expect_error(ENV "[stage.x]\nsteps = 3\n", "x.ini:3: bad stage section [stage.x]");
    // cross-field rules
    expect_error("[env]\nname = plugin\n", "[env] name = plugin needs plugin = path/to/env.so");
    expect_error(ENV "[model]\nhybrid = KKX\n", "[model] hybrid = 'KKX'");
    expect_error(ENV "[run]\nkeep_trajectories = every_0\n", "keep_trajectories: 'every_0'");
    expect_error(ENV "[learner]\ncurve_key = learner.key\n", "[learner] curve_key needs curve_allow");
    expect_error(ENV "[learner]\ncurve_allow = actors/\n", "[learner] curve_allow has no effect without curve_key");

    // every error is collected: three problems, three messages
    {
        mtrl_config_errors errs = {0};
        mtrl_status st = mtrl_config_load_text(&cfg, "x.ini", "[run]\nsteps = a\nfoo = 1\n[bar]\n", NULL, 0, &errs);
        TEST_EQ_INT(st, MTRL_ERR_USAGE);
        TEST_EQ_INT(errs.n, 4); // steps, foo, [bar], missing env.name
        mtrl_config_errors_free(&errs);
    }

    // --set overrides with the same checks
    {
        const char *sets[] = {"learner.lr=0.5", "stage.1.steps=7", "model.layers=6"};
        char *e = load_errors(ENV, sets, 3, &cfg);
        TEST_CHECK(e == NULL);
        free(e);
        TEST_CLOSE(cfg.learner.lr, 0.5, 0, 0);
        TEST_EQ_INT(cfg.n_stages, 1);
        TEST_EQ_INT(cfg.stage[0].steps, 7);
        TEST_EQ_INT(cfg.model.layers, 6);
        TEST_EQ_STR(cfg.model.hybrid, "KKKMKM");
        const char *bad[] = {"learner.lr=abc", "learner.lrr=1", "nosuch", "foo.bar=1"};
        e = load_errors(ENV, bad, 4, &cfg);
        TEST_CHECK(e != NULL);
        if (e) {
            TEST_CONTAINS(e, "--set learner.lr=abc: [learner] lr: expected a finite number");
            TEST_CONTAINS(e, "--set learner.lrr=1: unknown key 'lrr' in [learner]; did you mean 'lr'?");
            TEST_CONTAINS(e, "--set nosuch: expected section.key=value");
            TEST_CONTAINS(e, "--set foo.bar=1: unknown section [foo]");
        }
        free(e);
    }

    // defaults and presets resolve; the printed config loads back to the same hash
    {
        char *e = load_errors(ENV "[model]\npreset = tiny\nd_model = 32\n", NULL, 0, &cfg);
        TEST_CHECK(e == NULL);
        free(e);
        TEST_EQ_INT(cfg.model.d_model, 32);
        TEST_EQ_INT(cfg.model.layers, 4);
        TEST_EQ_STR(cfg.model.hybrid, "KKKM");
        TEST_EQ_INT(cfg.learner.batch_groups, 4);
        char *ini = mtrl_config_to_ini(&cfg);
        mtrl_config back;
        e = load_errors(ini, NULL, 0, &back);
        TEST_CHECK(e == NULL);
        free(e);
        TEST_EQ_INT(mtrl_config_hash(&back) == mtrl_config_hash(&cfg), 1);
        free(ini);
        mtrl_config other;
        e = load_errors(ENV "[model]\npreset = tiny\nd_model = 48\n", NULL, 0, &other);
        free(e);
        TEST_CHECK(mtrl_config_hash(&other) != mtrl_config_hash(&cfg));
    }

    // Every experiment INI also parses with Python's configparser (strict: no duplicate sections
    // or keys), so the format is plain INI and no dialect of ours.
    {
        const char *src = getenv("MTRL_SRC");
        char cmd[2048];
        snprintf(cmd, sizeof cmd,
                 "command -v python3 >/dev/null || exit 77; cd '%s' && python3 -c \"import configparser,glob,sys\n"
                 "files=sorted(glob.glob('experiments/*.ini'))\nassert files\nfor f in files:\n"
                 "    c=configparser.ConfigParser(strict=True, interpolation=None)\n    c.read_file(open(f))\n"
                 "    assert c.has_section('env'), f\nprint(len(files), 'experiment files parse with configparser')\"",
                 src ? src : ".");
        int rc = system(cmd);
        if (WIFEXITED(rc) && WEXITSTATUS(rc) == 77) printf("python3 not found: configparser check skipped\n");
        else TEST_CHECKF(WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "an experiment file does not parse with configparser");
    }

    // custom preset requires explicit sizes
    expect_error(ENV "[model]\npreset = custom\n", "[model] preset = custom needs layers");

    // every shipped experiment loads without errors
    {
        const char *src = getenv("MTRL_SRC");
        const char *files[] = {"experiments/quickstart.ini", "experiments/quickstart-gpu.ini", "experiments/retrieval-1m.ini",
                               "experiments/agent-1m.ini", "experiments/recall-1m.ini", "experiments/agent-cpu.ini"};
        for (size_t i = 0; src && i < sizeof files / sizeof files[0]; i++) {
            char path[1024];
            snprintf(path, sizeof path, "%s/%s", src, files[i]);
            mtrl_config_errors errs = {0};
            mtrl_status st = mtrl_config_load(&cfg, path, NULL, 0, &errs);
            TEST_CHECKF(st == MTRL_OK, "%s: %s", path, errs.n ? errs.msgs[0] : "");
            mtrl_config_errors_free(&errs);
        }
        mtrl_config_errors errs = {0};
        TEST_EQ_INT(mtrl_config_load(&cfg, "/nonexistent/x.ini", NULL, 0, &errs), MTRL_ERR_IO);
        TEST_CHECK(errs.n == 1 && strstr(errs.msgs[0], "/nonexistent/x.ini: cannot open"));
        mtrl_config_errors_free(&errs);
    }
    return test_report();
}
