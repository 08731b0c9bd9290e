// mtrl.c: the one user-facing command. A thin front door: it dispatches to the subcommands in
// tools/cmd_*.c, which stand on the libraries (docs/architecture.md §2).
#include <stdio.h>
#include <string.h>

#include "common/version.h"
#include "env/env_host.h"
#include "tools/cli.h"

// The benchmarks of this build (tools/cmd_bench.c): ops only where the CUDA kernels are built in.
#ifdef MTRL_HAVE_CUDA_BENCH
#define BENCHES_ "model, long, learner, decode, publish, rl, ops"
#define BENCHES_BAR_ "model|long|learner|decode|publish|rl|ops"
#else
#define BENCHES_ "model, long, learner, decode, publish, rl"
#define BENCHES_BAR_ "model|long|learner|decode|publish|rl"
#endif

typedef struct subcommand {
    const char *name;
    int (*fn)(int, char **);
    const char *summary;
} subcommand;

static const subcommand subcommands_[] = {
    {"run", cmd_run, "run an experiment: the learner and [actor] count local actors"},
    {"check", cmd_check, "validate an experiment INI and print the resolved config"},
    {"learner", cmd_learner, "run the learner alone (actors connect from elsewhere)"},
    {"actor", cmd_actor, "run one actor that connects to a learner"},
    {"replay", cmd_replay, "show, rescore or re-execute a recorded episode"},
    {"report", cmd_report, "write an HTML report and CSVs of a run"},
    {"bench", cmd_bench, "benchmarks: " BENCHES_},
    {"plan", cmd_plan, "memory plan of the learner step: segment length and bytes per block"},
    {"eval", cmd_eval, "success rate of a checkpoint on fresh tasks (a stage of the ladder)"},
    {"import", cmd_import, "read a Hugging Face Kimi-Linear folder into an mtrl checkpoint (and its load GB/s)"},
    {"export", cmd_export, "write a checkpoint as a Hugging Face Kimi-Linear folder that transformers loads"},
    {"keygen", cmd_keygen, "write a CURVE keypair (STEM.key, STEM.pub) for remote actors"},
};
#define N_SUBCOMMANDS ((int)(sizeof subcommands_ / sizeof subcommands_[0]))

static void print_help_(FILE *f) {
    fprintf(f, "mtrl: agentic reinforcement learning for million-token trajectories\n\n"
               "usage: mtrl <command> [options]   (mtrl <command> --help for each; mtrl --version)\n\n"
               "commands:\n");
    for (int i = 0; i < N_SUBCOMMANDS; i++) fprintf(f, "  %-8s %s\n", subcommands_[i].name, subcommands_[i].summary);
    fprintf(f, "\n    mtrl run EXPERIMENT.ini [--db runs.db] [--set section.key=value ...]\n"
               "    mtrl check EXPERIMENT.ini [--set ...] [--keys]\n"
               "    mtrl learner EXPERIMENT.ini\n"
               "    mtrl actor --connect tcp://HOST:PORT [--gpu N] [--curve-server-key L.pub --curve-key A.key]\n"
               "    mtrl replay --db runs.db --episode ID [--rescore] [--reexec]\n"
               "    mtrl report --db runs.db [--run ID] --out DIR\n"
               "    mtrl bench " BENCHES_BAR_ " ...   (mtrl bench --help)\n"
               "    mtrl plan EXPERIMENT.ini [--tokens T] [--batch B] [--device cpu|cuda] [--budget-gib G]\n"
               "    mtrl eval EXPERIMENT.ini [--checkpoint FILE] [--episodes N] [--stage K] [--device D]\n"
               "    mtrl keygen STEM\n"
               "\nexit codes: 0 done, 1 the run failed, 2 bad usage or bad config\n");
}

int main(int argc, char **argv) {
    mtrl_env_host_main(argc, argv); // returns unless this process is an isolated env's child
    if (argc < 2) {
        print_help_(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "version")) {
        printf("mtrl %s (git %s)\n", mtrl_version(), mtrl_git_rev());
        return 0;
    }
    if (cli_is_help(argv[1]) || !strcmp(argv[1], "help")) {
        print_help_(stdout);
        return 0;
    }
    for (int i = 0; i < N_SUBCOMMANDS; i++)
        if (!strcmp(argv[1], subcommands_[i].name)) return subcommands_[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "mtrl: unknown command '%s'\nusage: mtrl <command> [options]; commands:", argv[1]);
    for (int i = 0; i < N_SUBCOMMANDS; i++) fprintf(stderr, " %s", subcommands_[i].name);
    fputc('\n', stderr);
    return 2;
}
