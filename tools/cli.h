// cli.h: the subcommands of the `mtrl` front door (docs/architecture.md §2) and their shared helpers.
//
// Each subcommand is `int cmd_NAME(int argc, char **argv)` with argv[0] = the subcommand name;
// it returns the process exit code: 0 done, 1 the work failed, 2 bad usage or bad config.
#ifndef MTRL_TOOLS_CLI_H
#define MTRL_TOOLS_CLI_H

#include <stdio.h>

int cmd_run(int argc, char **argv);
int cmd_check(int argc, char **argv);
int cmd_learner(int argc, char **argv);
int cmd_actor(int argc, char **argv);
int cmd_replay(int argc, char **argv);
int cmd_report(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_plan(int argc, char **argv);
int cmd_eval(int argc, char **argv);
int cmd_keygen(int argc, char **argv);
int cmd_import(int argc, char **argv); // tools/cmd_hf.c
int cmd_export(int argc, char **argv);
int cmd_bench_rl(int argc, char **argv); // `mtrl bench rl` (tools/cmd_bench_rl.c), from cmd_bench

// What `mtrl run` does with a loaded experiment (tools/cmd_run.c): the learner in this process
// and [actor] count local actor processes (restarted when they die, reaped at the end), with
// SIGINT/SIGTERM ending the run cleanly as killed. opts->tick and tick_user are taken for the
// supervisor of the actors; the rest of *opts goes to mtrl_learner_open as given. *run_id
// (nullable) receives the run's id (-1 when the learner did not open). Returns the exit code: 0
// finished, 1 failed or killed, 2 bad config; errors are printed as "mtrl NAME: ...".
struct mtrl_config;
struct mtrl_learner_opts;
int cli_run_local(const char *name, const struct mtrl_config *cfg, struct mtrl_learner_opts *opts, long long *run_id);

// The machine line of the benchmarks' reports ("machine: CPU, N cores, OS; date").
void cli_bench_machine(void);

// Prints "mtrl NAME: MESSAGE" and the usage line to stderr; returns 2.
int cli_usage_error(const char *name, const char *usage, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

// 1 when argv[i] is -h or --help.
int cli_is_help(const char *arg);

// Collects the --set section.key=value options from argv; returns the count (pointers into argv).
// Also accepts --set=section.key=value.
int cli_collect_sets(int argc, char **argv, const char **sets, int max);

// Loads the experiment at path with the --set options of argv into *cfg. On errors prints them
// all and "mtrl NAME: N problems in PATH" to stderr and returns 0; 1 on success.
int cli_config_load(const char *name, const char *path, int argc, char **argv, struct mtrl_config *cfg);

// Loads and creates the experiment's env once in a child process (mtrl_env_check_config). On an
// error prints "PATH: [env] MESSAGE" and "mtrl NAME: 1 problem in PATH" to stderr, as a config
// error, and returns 0 (the caller exits 2); 1 when the env works. tools (nullable): its
// describe() text, malloc'ed, or NULL (mtrl_env_check_config). Every [stage.N] is checked
// too, with the env keys it gives (mtrl_config_stage): "PATH: [stage.N] with [env]: MESSAGE".
int cli_env_check(const char *name, const char *path, const struct mtrl_config *cfg, char **tools);

#endif
