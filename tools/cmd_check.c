// cmd_check.c: `mtrl check EXPERIMENT.ini` validates an experiment and prints the resolved
// config (every key, defaults included) on stdout, with its hash as a comment. The [env] is
// loaded and created once in a child process first, so a broken env is a config error here.
// Under a launcher (torchrun's or srun's variables set: learner/dist_launch.h) it also says
// which rank this process would be and on which GPU, and refuses a launch that disagrees with
// itself or with [learner] gpus.
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "common/log.h"
#include "common/tokenizer.h"
#include "learner/dist_launch.h"
#include "learner/learner_ranks.h"
#include "learner/learner_ranks.h"
#include "tools/cli.h"

extern char **environ;

// The launch this process would use, as a comment line, when a launcher set its variables; 0
// and the error on stderr when they disagree (with themselves or with [learner] gpus).
static int check_launch_(const char *path, const mtrl_config *cfg, char *line, size_t cap) {
    mtrl_dist_launch l;
    mtrl_error err;
    int gpus[MTRL_CFG_GPUS_MAX], n = mtrl_config_gpus(cfg, gpus, NULL, 0), gpu;
    line[0] = 0;
    if (mtrl_dist_launch_from_env(&l, (const char *const *)environ, &err) != MTRL_OK ||
        mtrl_dist_launch_gpu(&l, gpus, n < 0 ? 0 : n, &gpu, &err) != MTRL_OK) {
        fprintf(stderr, "%s: %s\nmtrl check: 1 problem in %s\n", path, err.msg, path);
        return 0;
    }
    if (strcmp(l.source, "none")) {
        char what[512];
        mtrl_dist_launch_describe(&l, what, sizeof what);
        // mtrl run joins a launcher's world of several processes (CPU models: the zmq backend), so
        // what it would refuse (ranks that disagree with the world size) is refused here.
        // A GPU model's launch is described (its GPU above), with what mtrl run does with it.
        int gpu_model = strcmp(cfg->model.device, "cpu") != 0;
        if (l.world > 1 && !gpu_model && mtrl_learner_ranks_check_launch(cfg, &l, &err) != MTRL_OK) {
            fprintf(stderr, "%s\nmtrl check: 1 problem in %s\n", err.msg, path);
            return 0;
        }
        char role[200] = "";
        if (l.world > 1 && gpu_model)
            snprintf(role, sizeof role, " (mtrl run refuses a launch of a GPU model: learner ranks as processes run on "
                     "the CPU only today, docs/multi-gpu.md §3)");
        else if (l.world > 1)
            snprintf(role, sizeof role, " (mtrl run joins this world as learner rank %d of %d: %s, zmq backend)", l.rank,
                     l.world, l.rank == 0 ? "the learner loop with the actors and the run store"
                                          : "a follower: its model replica runs rank 0's steps");
        snprintf(line, cap, "; launch: %s; GPU %d%s\n", what, gpu, role);
    }
    return 1;
}

#define CHECK_USAGE "mtrl check EXPERIMENT.ini [--set section.key=value ...] | mtrl check --keys"

int cmd_check(int argc, char **argv) {
    const char *path = NULL;
    for (int i = 1; i < argc; i++) {
        if (cli_is_help(argv[i])) {
            printf("usage: %s\n\nValidates the experiment (unknown, duplicate, mistyped, out-of-range or missing keys\n"
                   "are reported as file:line: message, all at once, exit 2), loads and creates its [env] in a\n"
                   "child process (an unknown env, a plug-in that does not load or refuses its args: exit 2)\n"
                   "and prints the resolved config, after the env's tool list (its describe(), as comments).\n"
                   "Under torchrun or srun (RANK/WORLD_SIZE or SLURM_PROCID set) it also prints the rank and\n"
                   "GPU this process would take, and refuses a launch that disagrees with itself (exit 2).\n"
                   "With several learner ranks ([learner] ranks, gpus) it says where they run.\n"
                   "--keys lists every key with its type, default, range and help.\n", CHECK_USAGE);
            return 0;
        }
        if (!strcmp(argv[i], "--keys")) {
            mtrl_config_print_keys(stdout);
            return 0;
        }
        if (!strcmp(argv[i], "--set")) { i++; continue; }
        if (!strncmp(argv[i], "--set=", 6)) continue;
        if (argv[i][0] == '-') return cli_usage_error("check", CHECK_USAGE, "unknown option '%s'", argv[i]);
        if (path) return cli_usage_error("check", CHECK_USAGE, "more than one experiment file given");
        path = argv[i];
    }
    if (!path) return cli_usage_error("check", CHECK_USAGE, "no experiment file given");
    mtrl_config cfg;
    if (!cli_config_load("check", path, argc, argv, &cfg)) return 2;
    char launch[800];
    if (!check_launch_(path, &cfg, launch, sizeof launch)) return 2;
    char *tools = NULL;
    if (!cli_env_check("check", path, &cfg, &tools)) return 2;
    // [learner] expert_parallel against the model it would run on (a GPU, no experts, too few).
    mtrl_model_dims dims;
    mtrl_error err;
    if (mtrl_model_dims_from_config(&dims, &cfg, MTRL_VOCAB, &err) == MTRL_OK &&
        mtrl_learner_ranks_check_ep(&cfg, &dims, &err) != MTRL_OK) {
        fprintf(stderr, "%s: %s\nmtrl check: 1 problem in %s\n", path, err.msg, path);
        free(tools);
        return 2;
    }
    char *ini = mtrl_config_to_ini(&cfg);
    printf("; resolved from %s, config hash %016" PRIx64 "\n%s", path, mtrl_config_hash(&cfg), launch);
    // Several learner ranks: where they run (the load refused keys that disagree when ranks is set).
    char ranks[400];
    if (mtrl_learner_ranks_describe(&cfg, ranks, sizeof ranks) > 1) printf("; learner: %s\n", ranks);
    // [actor] gpus: which GPU each local actor takes (mtrl run passes it as --gpu)
    if (cfg.actor.gpus[0] && cfg.actor.count > 0) {
        printf("; actors:");
        for (int i = 1; i <= cfg.actor.count && i <= 16; i++) printf(" %d on GPU %d%s", i, mtrl_config_actor_gpu(&cfg, i),
                                                                   i < cfg.actor.count ? "," : "");
        printf("%s\n", cfg.actor.count > 16 ? " ..." : "");
    }
    // The env's describe(): what its tools are, for the experiment's author (comments, so the
    // output stays an experiment that passes check again). The model sees only the prompts.
    if (tools) {
        printf("; the env's tools (its describe()):\n");
        for (char *line = tools, *next; line && *line; line = next) {
            next = strchr(line, '\n');
            if (next) *next++ = '\0';
            char esc[1024]; // the env's text: escaped like every string an env gives (common/log.h)
            mtrl_text_escape(esc, sizeof esc, line, strlen(line));
            printf(";   %s\n", esc);
        }
    }
    printf("%s", ini);
    free(tools);
    free(ini);
    return 0;
}
