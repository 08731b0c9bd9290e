// cmd_bench_rl.c: `mtrl bench rl EXPERIMENT.ini [--seconds N] [--db runs.db] [--set section.key=value ...]`
//
// The RL loop of the experiment as `mtrl run` runs it (cli_run_local: the learner in this
// process, [actor] count actor processes streaming over ZeroMQ): its [warmup] first, timed on
// its own, then N seconds of RL (default 60), after which the learner ends the run cleanly
// (mtrl_learner_opts.rl_seconds). The report is read back from the run store the learner wrote
// (learner/perf.h: the same numbers are its rl.* metrics; per step the learner_* and actor_*
// ones): episodes/s, generated and trained tokens/s, the learner's wall time split (train /
// waiting for episodes / publish / checkpoint / other, and busy), the actors' (prefill / decode
// / tools / waiting / other, summed over the actors), and the mean reward of the first and last
// 20% of the RL episodes (logged too, as rl.reward_first and rl.reward_last).
//
// [run] steps becomes the schema's maximum and max_minutes 0, so time ends the run (an
// experiment with [stage.N] sections still ends with its stages, maybe before N seconds: the
// report says so); --set goes on top. Without --db the run store and [run] out_dir live in a
// temporary folder, removed at the end; with --db the store stays (out_dir stays temporary
// unless --set run.out_dir=... is given). Exit codes: 0 done, 1 the run failed or was
// interrupted (what it measured is still printed), 2 bad usage or config.
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/config.h"
#include "common/store.h"
#include "common/timeutil.h"
#include "learner/learner.h"
#include "learner/perf.h"
#include "tools/cli.h"

#define BENCH_RL_USAGE "mtrl bench rl EXPERIMENT.ini [--seconds N] [--db runs.db] [--set section.key=value ...]"
#define MAX_SETS_ 64

static int remove_entry_(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path);
}

// "12.34 s  56.7%" of the wall time.
static void part_(const char *label, double s, double wall) {
    printf("  %-26s %9.2f s %6.1f%%\n", label, s, wall > 0 ? 100.0 * s / wall : 0.0);
}

static void report_(const mtrl_config *cfg, const char *path, double seconds, const mtrl_perf *p, double first,
                    double last, long n_rewarded, double elapsed, const char *db, int temp_db) {
    double wall = p->wall, per = wall > 0 ? 1.0 / wall : 0;
    printf("mtrl bench rl %s --seconds %g\n", path, seconds);
    cli_bench_machine();
    printf("experiment: model %s on %s; %ld actors x %ld episodes in flight; batch %ld groups x %ld episodes\n",
           cfg->model.preset, cfg->model.device, cfg->actor.count, cfg->actor.episodes_in_flight,
           cfg->learner.batch_groups, cfg->algo.group_size);
    printf("run store: %s%s\n", db, temp_db ? " (temporary, removed now; --db PATH keeps it)" : "");
    printf("warm-up: %.2f s (%ld supervised steps, publish, checkpoint)\n", p->warmup, cfg->warmup.steps);
    printf("rest: %.2f s (learner, model and actors set up; final checkpoint; actors stopped)\n",
           elapsed - p->warmup - wall);
    printf("RL: %.2f s, %.0f steps, %.0f episodes (%.0f of them trained on)\n", wall, p->steps, p->episodes,
           p->trained_episodes);
    printf("  %-26s %9.1f\n", "episodes/s", p->episodes * per);
    printf("  %-26s %9.1f   (model tokens the actors sampled, of the episodes committed)\n", "generated tokens/s",
           p->generated_tokens * per);
    printf("  %-26s %9.1f   (tokens through the learner's forward + backward)\n", "trained tokens/s",
           p->trained_tokens * per);
    printf("learner (%.2f s wall; busy = (train + publish + checkpoint) / wall):\n", wall);
    part_("train", p->train, wall);
    part_("waiting for episodes", p->wait, wall);
    part_("publish", p->publish, wall);
    part_("checkpoint", p->checkpoint, wall);
    part_("other", mtrl_perf_other(p), wall);
    printf("  %-26s %9s   %6.1f%%\n", "learner busy", "", 100.0 * mtrl_perf_busy(p));
    const mtrl_wire_actor_stats *a = &p->actors;
    printf("actors (%ld, summed over their reports: %.2f s wall):\n", cfg->actor.count, a->wall_s);
    part_("prefill", a->prefill_s, a->wall_s);
    part_("decode", a->decode_s, a->wall_s);
    part_("tools", a->tools_s, a->wall_s);
    part_("waiting (weights, credit)", a->wait_s, a->wall_s);
    part_("other", mtrl_perf_actor_other(p), a->wall_s);
    printf("  decode: %.0f tokens in %.0f steps (%.1f sequences a step, %.3f ms a step); prefill: %.0f tokens\n",
           a->decode_tokens, a->decode_steps, a->decode_steps > 0 ? a->decode_tokens / a->decode_steps : 0,
           a->decode_steps > 0 ? 1e3 * a->decode_s / a->decode_steps : 0, a->prefill_tokens);
    printf("reward: %.3f (first 20%% of RL episodes) -> %.3f (last 20%%), %ld episodes\n", first, last, n_rewarded);
    if (wall + 1.0 < seconds) printf("note: the run ended after %.1f s of RL, before --seconds %g\n", wall, seconds);
}

// Reads the totals back and logs the reward ends: 0, or 1 when the store has no totals.
static int read_back_(const char *db, long long run, mtrl_perf *p, double *first, double *last, long *n) {
    mtrl_store *s;
    mtrl_error err;
    if (mtrl_store_open(&s, db, 0, &err) != MTRL_OK) {
        fprintf(stderr, "mtrl bench rl: %s\n", err.msg);
        return 1;
    }
    int64_t step;
    mtrl_status st = mtrl_perf_load(s, run, p, &step, &err);
    if (st == MTRL_OK) st = mtrl_perf_reward_ends(s, run, first, last, n, &err);
    if (st == MTRL_OK) {
        mtrl_store_metric_log(s, run, step, "rl.reward_first", *first, 0, NULL);
        mtrl_store_metric_log(s, run, step, "rl.reward_last", *last, 0, NULL);
    } else {
        fprintf(stderr, "mtrl bench rl: %s\n", err.msg);
    }
    mtrl_store_close(s);
    return st == MTRL_OK ? 0 : 1;
}

int cmd_bench_rl(int argc, char **argv) {
    const char *path = NULL, *db = NULL;
    double seconds = 60;
    const char *sets[MAX_SETS_ + 3];
    int n_user = 0, user_out_dir = 0;
    const char *user[MAX_SETS_];
    for (int i = 1; i < argc; i++) {
        if (cli_is_help(argv[i])) {
            printf("usage: %s\n", BENCH_RL_USAGE);
            return 0;
        }
        const char *set = NULL;
        if (!strcmp(argv[i], "--seconds") && i + 1 < argc) {
            char *end;
            seconds = strtod(argv[++i], &end);
            if (*end || !(seconds > 0 && seconds <= 1e6))
                return cli_usage_error("bench rl", BENCH_RL_USAGE, "--seconds %s: expected a number of seconds > 0", argv[i]);
        } else if (!strcmp(argv[i], "--db") && i + 1 < argc) db = argv[++i];
        else if (!strcmp(argv[i], "--set") && i + 1 < argc) set = argv[++i];
        else if (!strncmp(argv[i], "--set=", 6)) set = argv[i] + 6;
        else if (argv[i][0] == '-') return cli_usage_error("bench rl", BENCH_RL_USAGE, "unknown option '%s'", argv[i]);
        else if (path) return cli_usage_error("bench rl", BENCH_RL_USAGE, "more than one experiment file given");
        else path = argv[i];
        if (set) {
            if (n_user == MAX_SETS_) return cli_usage_error("bench rl", BENCH_RL_USAGE, "more than %d --set options", MAX_SETS_);
            user[n_user++] = set;
            user_out_dir |= !strncmp(set, "run.out_dir=", 12);
        }
    }
    if (!path) return cli_usage_error("bench rl", BENCH_RL_USAGE, "no experiment file given");
    char tmp[512];
    const char *tdir = getenv("TMPDIR");
    snprintf(tmp, sizeof tmp, "%s/mtrl-bench-rl-XXXXXX", tdir && tdir[0] ? tdir : "/tmp");
    if (!mkdtemp(tmp)) {
        perror("mtrl bench rl: a temporary folder");
        return 1;
    }
    // Time ends the run, not steps; the user's --set come last and win.
    char out_dir[600], tmp_db[600];
    snprintf(out_dir, sizeof out_dir, "run.out_dir=%s/out", tmp);
    snprintf(tmp_db, sizeof tmp_db, "%s/runs.db", tmp);
    int n_sets = 0;
    sets[n_sets++] = "run.steps=1000000000";
    sets[n_sets++] = "run.max_minutes=0";
    if (!user_out_dir) sets[n_sets++] = out_dir;
    for (int i = 0; i < n_user; i++) sets[n_sets++] = user[i];
    mtrl_config cfg;
    mtrl_config_errors errs = {0};
    int rc;
    if (mtrl_config_load(&cfg, path, sets, n_sets, &errs) != MTRL_OK) {
        mtrl_config_errors_print(&errs, stderr);
        fprintf(stderr, "mtrl bench rl: %d problem%s in %s\n", errs.n, errs.n == 1 ? "" : "s", path);
        mtrl_config_errors_free(&errs);
        rc = 2;
    } else {
        if (!db) db = tmp_db;
        mtrl_learner_opts o = {db, 0, 1, NULL, NULL, seconds, NULL};
        long long run;
        double t0 = mtrl_time_mono();
        rc = cli_run_local("bench rl", &cfg, &o, &run);
        double elapsed = mtrl_time_mono() - t0;
        mtrl_perf p;
        double first, last;
        long n;
        if (run >= 0 && read_back_(db, run, &p, &first, &last, &n) == 0) {
            fflush(stderr);
            report_(&cfg, path, seconds, &p, first, last, n, elapsed, db, db == tmp_db);
            if (rc != 0) printf("note: the run did not finish cleanly (exit code %d; its errors are above)\n", rc);
        } else if (rc == 0) {
            rc = 1;
        }
    }
    nftw(tmp, remove_entry_, 16, FTW_DEPTH | FTW_PHYS);
    return rc;
}
