// cmd_run.c: `mtrl run`, `mtrl learner` and `mtrl actor` (docs/architecture.md §2).
//
// `mtrl run EXPERIMENT.ini` is the learner in this process plus [actor] count local actor
// processes (fork + exec of `mtrl actor --connect ENDPOINT --id N`). An actor that dies is
// started again (its open episodes are aborted by the learner), with a pause that doubles up
// to 30 s. SIGINT/SIGTERM stop the run cleanly: actors are told and reaped, the run is marked
// killed, exit code 1. Exit codes: 0 finished, 1 failed or killed, 2 bad usage or config.
//
// CURVE ([learner] curve_key): `mtrl actor` takes --curve-server-key LEARNER.pub and
// --curve-key ACTOR.key, checks them here (a bad file is a usage error, exit 2, naming it) and
// hands them to the actor through mtrl_wire_auth_client_set. `mtrl run` gives its local actors
// an ephemeral keypair that only this learner process trusts (mtrl_wire_auth_local_init: files
// in a private folder under [run] out_dir, deleted at the end), so the allow-list on disk holds
// only the remote actors.
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#include "actor/actor.h"
#include "common/config.h"
#include "common/fsutil.h"
#include "common/log.h"
#include "common/timeutil.h"
#include "common/wire/wire_auth.h"
#include "learner/dist_launch.h"
#include "learner/learner.h"
#include "learner/learner_follow.h"
#include "learner/learner_ranks.h"
#include "tools/cli.h"

#define RUN_USAGE "mtrl run EXPERIMENT.ini [--db runs.db] [--resume] [--json] [--set section.key=value ...]"
#define LEARNER_USAGE "mtrl learner EXPERIMENT.ini [--db runs.db] [--resume] [--json] [--set section.key=value ...]"
#define ACTOR_USAGE                                                                                    \
    "mtrl actor --connect tcp://HOST:PORT [--id N] [--gpu N] [--curve-server-key LEARNER.pub --curve-key ACTOR.key]"

// The text after the usage line of `mtrl run --help` (and `mtrl learner --help`).
#define RUN_HELP                                                                                       \
    "\nRuns an experiment: the learner in this process and [actor] count local actor processes\n"      \
    "(`mtrl learner` runs the learner alone and prints the endpoint remote actors connect to).\n"     \
    "A short supervised warm-up ([warmup] steps) on the env's demonstrations, then RL steps until\n" \
    "[run] steps; checkpoints and trajectories go to [run] out_dir/<store>-run<id>/ (runs.db's\n"    \
    "run 3: runs-run3/), every run, step, episode and event to the run store. Progress is one\n"    \
    "line on stderr (redrawn on a terminal, plain lines otherwise).\n\n"                             \
    "options:\n"                                                                                      \
    "  --db FILE             the run store (SQLite; default [run] db); one learner writes it at a time\n" \
    "  --resume              continue the store's latest run from its last checkpoint\n" \
    "  --json                progress as one JSON object a line on stdout instead of the line on\n" \
    "                        stderr: {\"type\":\"warmup\"|\"step\"|\"end\", \"run\", \"step\", \"steps\", ...}\n" \
    "                        (learner/learner.h lists the fields); logs stay on stderr\n" \
    "  --set SECTION.KEY=V   override a key of the experiment (repeatable; mtrl check --keys lists them)\n" \
    "  -h, --help            this help\n\n"                                                           \
    "An actor that dies is restarted; SIGINT or SIGTERM stops the run cleanly (marked killed).\n"    \
    "Look at the run with: mtrl report --db FILE --out DIR, mtrl replay --db FILE --episode ID.\n"   \
    "exit codes: 0 finished, 1 the run failed or was killed, 2 bad usage or bad config (nothing\n"   \
    "written)\n"

static volatile sig_atomic_t stop_;

static void on_signal_(int sig) {
    (void)sig;
    stop_ = 1;
}

static void install_signals_(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal_;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
}

typedef struct run_args {
    const char *path, *db;
    int resume, json;
    const char *sets[64];
    int n_sets;
} run_args;

static int parse_run_args_(const char *name, const char *usage, int argc, char **argv, run_args *a) {
    memset(a, 0, sizeof *a);
    for (int i = 1; i < argc; i++) {
        if (cli_is_help(argv[i])) {
            printf("usage: %s\n%s", usage, RUN_HELP);
            return 0;
        }
        if ((!strcmp(argv[i], "--db") || !strcmp(argv[i], "--set")) && i + 1 == argc)
            return cli_usage_error(name, usage, "%s: missing value", argv[i]);
        if (!strcmp(argv[i], "--db")) a->db = argv[++i];
        else if (!strcmp(argv[i], "--resume")) a->resume = 1;
        else if (!strcmp(argv[i], "--json")) a->json = 1;
        else if (!strcmp(argv[i], "--set")) {
            if (a->n_sets < 64) a->sets[a->n_sets++] = argv[++i];
        } else if (!strncmp(argv[i], "--set=", 6)) {
            if (a->n_sets < 64) a->sets[a->n_sets++] = argv[i] + 6;
        } else if (argv[i][0] == '-') return cli_usage_error(name, usage, "unknown option '%s'", argv[i]);
        else if (a->path) return cli_usage_error(name, usage, "more than one experiment file given");
        else a->path = argv[i];
    }
    if (!a->path) return cli_usage_error(name, usage, "no experiment file given");
    return -1; // go on
}

static int load_config_(const run_args *a, mtrl_config *cfg) {
    mtrl_config_errors errs = {0};
    if (mtrl_config_load(cfg, a->path, a->sets, a->n_sets, &errs) != MTRL_OK) {
        mtrl_config_errors_print(&errs, stderr);
        mtrl_config_errors_free(&errs);
        return 0;
    }
    return 1;
}

typedef struct child {
    pid_t pid;
    int id;
    int gpu;           // its CUDA device (--gpu), -1: [model] device's
    int restarts;
    double next_start;
    int gave_up;       // exited with MTRL_ACTOR_EXIT_UNUSABLE: not restarted
    double started;    // when this pid was spawned
    int killed;        // SIGKILL sent to this pid (it was silent)
} child;

// curve (nullable): the local actors' key files when the learner runs CURVE.
// gpu: its CUDA device ([actor] gpus, mtrl_config_actor_gpu), -1 for [model] device's.
static pid_t spawn_actor_(const char *endpoint, int id, int gpu, const mtrl_wire_auth_local *curve) {
    char ids[16], gpus[16];
    snprintf(ids, sizeof ids, "%d", id);
    snprintf(gpus, sizeof gpus, "%d", gpu);
    char *args[13] = {"mtrl", "actor", "--connect", (char *)endpoint, "--id", ids};
    int n = 6;
    if (gpu >= 0) {
        args[n++] = "--gpu";
        args[n++] = gpus;
    }
    if (curve && curve->dir[0]) {
        args[n++] = "--curve-server-key";
        args[n++] = (char *)curve->server_pub;
        args[n++] = "--curve-key";
        args[n++] = (char *)curve->key_file;
    }
    args[n] = NULL;
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid == 0) {
        // The actor dies with this process, however it ends (kill -9, abort): an orphan would
        // say HELLO to a dead port forever. The signal survives the exec; a parent that died
        // before the prctl is seen by getppid.
        if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent) _exit(127);
        // Idle OpenMP threads sleep instead of spinning: the actors share cores with the learner.
        setenv("OMP_WAIT_POLICY", "PASSIVE", 0);
        execv("/proc/self/exe", args);
        _exit(127);
    }
    return pid;
}

typedef struct supervisor {
    child *kids;
    int n;
    const char *endpoint;
    const mtrl_wire_auth_local *curve;
    mtrl_learner *l;
} supervisor;

// Restarts actors that died while the run goes on, with a pause that doubles up to 30 s.
static void supervise_(void *user) {
    supervisor *s = user;
    double now = mtrl_time_mono();
    for (int i = 0; i < s->n; i++) {
        child *k = &s->kids[i];
        if (k->pid > 0) {
            int status;
            if (waitpid(k->pid, &status, WNOHANG) != k->pid) {
                // Silent since after it started (a plug-in hung in a step, say): it neither works
                // nor exits, so it is killed here and restarted below once reaped.
                double silent = s->l ? mtrl_learner_actor_silent_since(s->l, (uint32_t)k->id) : 0;
                if (!k->killed && silent > k->started) {
                    LOG_WARN("actor %d (pid %d) fell silent and the learner declared it dead: killing it to restart it",
                             k->id, (int)k->pid);
                    kill(k->pid, SIGKILL);
                    k->killed = 1;
                }
                continue;
            }
            if (WIFEXITED(status) && WEXITSTATUS(status) == MTRL_ACTOR_EXIT_UNUSABLE) {
                LOG_ERROR("actor %d cannot run this experiment (its error is above); not restarted", k->id);
                k->pid = 0;
                k->gave_up = 1;
                int left = 0;
                for (int j = 0; j < s->n; j++) left += !s->kids[j].gave_up;
                if (left == 0 && s->l) mtrl_learner_fail(s->l, "no actor can run this experiment (their errors are the run's events)");
                continue;
            }
            if (WIFSIGNALED(status)) LOG_WARN("actor %d (pid %d) died: signal %d; restarting", k->id, (int)k->pid, WTERMSIG(status));
            else LOG_WARN("actor %d (pid %d) exited with status %d; restarting", k->id, (int)k->pid, WEXITSTATUS(status));
            k->pid = 0;
            double pause = k->restarts < 5 ? (double)(1 << k->restarts) : 30.0;
            k->next_start = now + (pause > 30 ? 30 : pause);
            k->restarts++;
        } else if (!k->gave_up && now >= k->next_start) {
            k->pid = spawn_actor_(s->endpoint, k->id, k->gpu, s->curve);
            k->started = now;
            k->killed = 0;
        }
    }
}

int cli_run_local(const char *name, const mtrl_config *cfg, mtrl_learner_opts *opts, long long *run_id) {
    if (run_id) *run_id = -1;
    install_signals_();
    mtrl_log_set_tag("learner");
    mtrl_learner *l;
    mtrl_error err;
    // With CURVE the local actors need a key the learner accepts; it must be trusted before the
    // learner starts its ZAP handler (in mtrl_learner_open).
    mtrl_wire_auth_local curve = {0};
    if (cfg->learner.curve_key[0] && cfg->actor.count > 0) {
        mtrl_status st = MTRL_OK;
        if (mtrl_mkdir_p(cfg->run.out_dir) != 0)
            st = mtrl_error_set(&err, MTRL_ERR_IO, "[run] out_dir %s: cannot create: %s", cfg->run.out_dir, strerror(errno));
        if (st == MTRL_OK) st = mtrl_wire_auth_local_init(&curve, cfg->run.out_dir, cfg->learner.curve_key, &err);
        if (st != MTRL_OK) {
            fprintf(stderr, "mtrl %s: %s\n", name, err.msg);
            return st == MTRL_ERR_IO ? 1 : 2;
        }
    }
    supervisor sv = {0};
    opts->tick = supervise_;
    opts->tick_user = &sv;
    if (mtrl_learner_open(&l, cfg, opts, &err) != MTRL_OK) {
        fprintf(stderr, "mtrl %s: %s\n", name, err.msg);
        mtrl_wire_auth_local_free(&curve);
        return err.code == MTRL_ERR_USAGE ? 2 : 1;
    }
    if (run_id) *run_id = mtrl_learner_run_id(l);
    const char *endpoint = mtrl_learner_endpoint(l);
    int n = (int)cfg->actor.count;
    child *kids = calloc((size_t)(n ? n : 1), sizeof(child));
    for (int i = 0; i < n; i++) {
        kids[i].id = i + 1;
        kids[i].gpu = mtrl_config_actor_gpu(cfg, kids[i].id);
        kids[i].pid = spawn_actor_(endpoint, kids[i].id, kids[i].gpu, &curve);
        kids[i].started = mtrl_time_mono();
    }
    sv = (supervisor){kids, n, endpoint, &curve, l};
    int rc = mtrl_learner_run(l, &stop_);
    // Reap the actors: they got a BYE; give them a moment, then stop them. The learner closes
    // after them: a slow actor still reading the messages queued before its BYE (a weight
    // version's announcement) must find the same-host channel there, not fall back to asking
    // for the weights over ZeroMQ of a learner that is gone (seen in CI on a loaded machine).
    for (int i = 0; i < n; i++)
        if (kids[i].pid > 0) kill(kids[i].pid, SIGTERM);
    double t0 = mtrl_time_mono();
    for (int i = 0; i < n; i++) {
        while (kids[i].pid > 0) {
            int status;
            pid_t w = waitpid(kids[i].pid, &status, WNOHANG);
            if (w == kids[i].pid || (w < 0 && errno == ECHILD)) break;
            if (mtrl_time_mono() - t0 > 5) {
                kill(kids[i].pid, SIGKILL);
                waitpid(kids[i].pid, &status, 0);
                break;
            }
            struct timespec ts = {0, 20 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
    }
    mtrl_learner_close(l);
    free(kids);
    mtrl_wire_auth_local_free(&curve);
    return rc;
}

int cmd_run(int argc, char **argv) {
    run_args a;
    int rc = parse_run_args_("run", RUN_USAGE, argc, argv, &a);
    if (rc >= 0) return rc;
    mtrl_config cfg;
    if (!load_config_(&a, &cfg)) return 2;
    // A broken [env] is a config error, found before the run store or out_dir is touched.
    if (!cli_env_check("run", a.path, &cfg, NULL)) return 2;
    mtrl_learner_opts o = {a.db, a.resume, a.json ? MTRL_PROGRESS_JSON : MTRL_PROGRESS_LINE, NULL, NULL, 0, NULL};
    // Under a launcher (torchrun's or srun's variables) this process is one rank of its world:
    // rank 0 the learner with its actors and store, the others followers (learner_follow.h).
    mtrl_dist_launch launch;
    mtrl_error err;
    if (mtrl_dist_launch_from_env(&launch, (const char *const *)environ, &err) != MTRL_OK) {
        fprintf(stderr, "mtrl run: %s\n", err.msg);
        return 2;
    }
    if (launch.world > 1) {
        if (mtrl_learner_ranks_check_launch(&cfg, &launch, &err) != MTRL_OK) {
            fprintf(stderr, "mtrl run: %s\n", err.msg);
            return 2;
        }
        if (launch.rank > 0) {
            char tag[32];
            snprintf(tag, sizeof tag, "rank %d", launch.rank);
            mtrl_log_set_tag(tag);
            signal(SIGPIPE, SIG_IGN);
            if (mtrl_learner_follow_run(&cfg, &launch, &err) != MTRL_OK) {
                fprintf(stderr, "mtrl run (learner rank %d of %d): %s\n", launch.rank, launch.world, err.msg);
                return err.code == MTRL_ERR_USAGE ? 2 : 1;
            }
            return 0;
        }
        o.launch = &launch;
    }
    return cli_run_local("run", &cfg, &o, NULL);
}

int cmd_learner(int argc, char **argv) {
    run_args a;
    int rc = parse_run_args_("learner", LEARNER_USAGE, argc, argv, &a);
    if (rc >= 0) return rc;
    mtrl_config cfg;
    if (!load_config_(&a, &cfg)) return 2;
    install_signals_();
    mtrl_log_set_tag("learner");
    mtrl_learner *l;
    mtrl_error err;
    mtrl_learner_opts o = {a.db, a.resume, a.json ? MTRL_PROGRESS_JSON : MTRL_PROGRESS_LINE, NULL, NULL, 0, NULL};
    if (mtrl_learner_open(&l, &cfg, &o, &err) != MTRL_OK) {
        fprintf(stderr, "mtrl learner: %s\n", err.msg);
        return err.code == MTRL_ERR_USAGE ? 2 : 1;
    }
    printf("%s\n", mtrl_learner_endpoint(l));
    fflush(stdout);
    rc = mtrl_learner_run(l, &stop_);
    mtrl_learner_close(l);
    return rc;
}

int cmd_actor(int argc, char **argv) {
    const char *endpoint = NULL, *server_pub = NULL, *client_key = NULL;
    long id = 1, gpu = -1;
    for (int i = 1; i < argc; i++) {
        if (cli_is_help(argv[i])) {
            printf("usage: %s\n\nOne actor: connects to the learner at --connect, receives the experiment and weights\n"
                   "from it and streams episodes back. --id names it in the learner's log and store;\n"
                   "--gpu picks a CUDA device; with CURVE, --curve-server-key is the learner's .pub and\n"
                   "--curve-key this actor's .key (mtrl keygen).\n"
                   "exit codes: 0 the learner said goodbye, 1 the learner never answered or failed, 2 bad\n"
                   "usage, 3 this machine cannot run the experiment (not restarted), 4 the learner was\n"
                   "silent for [actor] learner_patience_s\n", ACTOR_USAGE);
            return 0;
        }
        static const char *const valued[] = {"--connect", "--id", "--gpu", "--curve-server-key", "--curve-key"};
        for (size_t k = 0; k < sizeof valued / sizeof valued[0]; k++)
            if (!strcmp(argv[i], valued[k]) && i + 1 == argc)
                return cli_usage_error("actor", ACTOR_USAGE, "%s: missing value", argv[i]);
        if (!strcmp(argv[i], "--connect") && i + 1 < argc) endpoint = argv[++i];
        else if (!strcmp(argv[i], "--id") && i + 1 < argc) {
            char *end;
            id = strtol(argv[++i], &end, 10);
            if (*end || id < 0 || id > 65535) return cli_usage_error("actor", ACTOR_USAGE, "--id %s: expected 0..65535", argv[i]);
        } else if (!strcmp(argv[i], "--gpu") && i + 1 < argc) {
            char *end;
            gpu = strtol(argv[++i], &end, 10);
            if (*end || gpu < 0 || gpu > 1024) return cli_usage_error("actor", ACTOR_USAGE, "--gpu %s: expected a device index", argv[i]);
        } else if (!strcmp(argv[i], "--curve-server-key") && i + 1 < argc) server_pub = argv[++i];
        else if (!strcmp(argv[i], "--curve-key") && i + 1 < argc) client_key = argv[++i];
        else return cli_usage_error("actor", ACTOR_USAGE, "unknown option '%s'", argv[i]);
    }
    if (!endpoint) return cli_usage_error("actor", ACTOR_USAGE, "--connect ENDPOINT is required");
    if (!server_pub != !client_key)
        return cli_usage_error("actor", ACTOR_USAGE, "CURVE needs both --curve-server-key (the learner's .pub) and "
                               "--curve-key (this actor's .key)");
    if (server_pub) {
        // Checked now, so a bad key file is a clear usage error instead of a handshake that
        // silently never completes.
        mtrl_wire_sockopts so = mtrl_wire_sockopts_default();
        mtrl_error err;
        if (mtrl_wire_auth_client_opts(&so, server_pub, client_key, &err) != MTRL_OK) {
            fprintf(stderr, "mtrl actor: %s\n", err.msg);
            return err.code == MTRL_ERR_IO ? 1 : 2;
        }
        mtrl_wire_auth_client_set(&so);
        mtrl_wire_key_wipe(&so, sizeof so);
    }
    install_signals_();
    return mtrl_actor_main(endpoint, (uint32_t)id, (int)gpu, &stop_);
}
