// cmd_eval.c: `mtrl eval EXPERIMENT.ini`: a checkpoint's success rate on fresh tasks of the
// experiment's env, in this process, with nothing trained and nothing stored:
//
//   mtrl eval EXPERIMENT.ini [--checkpoint FILE] [--episodes N] [--stage K] [--device D] [--set ...]
//
// The episodes are the actor's (actor/rollout.h: batched decode, tool calls, the same sampling
// temperature and top-p), [actor] episodes_in_flight at once in groups of [algo] group_size, on
// tasks no training actor draws: the task seeds come from actor id MTRL_EVAL_ACTOR_ID, which no
// `mtrl run` actor has. --stage K runs stage K of the [stage.N] ladder (its context, document
// length, group size and episodes in flight): a model trained on the short stages can be
// evaluated at the longest. One line per finished episode, then the totals. Exit 0, 1 when the
// checkpoint or model cannot be loaded or an episode setup fails, 2 for bad usage.
// A checkpoint that [run] db has a row for is checked against the digest recorded there: a file
// changed since its run wrote it is refused (exit 1), naming both digests.
#include <sqlite3.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "actor/rollout.h"
#include "common/checkpoint.h"
#include "common/config.h"
#include "common/fsutil.h"
#include "model/model.h"
#include "model/qb.h"
#include "model/model_hf.h"
#include "common/store.h"
#include "common/timeutil.h"
#include "common/tokenizer.h"
#include "tools/cli.h"

#define EVAL_USAGE                                                                                     \
    "mtrl eval EXPERIMENT.ini [--checkpoint FILE] [--episodes N] [--stage K] [--device cpu|cuda|cuda:N] " \
    "[--set section.key=value ...]"

// Actor ids are 0..65535 (`mtrl actor --id`; `mtrl run` numbers its actors from 1): this one is
// outside, so evaluation tasks are not training tasks.
#define MTRL_EVAL_ACTOR_ID 0x45564131u // "EVA1"

typedef struct eval_totals {
    long ended, by_status[MTRL_EP_REJECTED + 1], successes, tokens, model_tokens, tools;
    double reward;
    double t0;
} eval_totals;

static void eval_end_(void *user, mtrl_traj *t) {
    eval_totals *e = user;
    e->ended++;
    if (t->status <= MTRL_EP_REJECTED) e->by_status[t->status]++;
    e->successes += mtrl_traj_success(t);
    e->reward += t->reward;
    e->tokens += (long)t->n_tokens;
    e->model_tokens += (long)t->n_model;
    e->tools += t->n_tools;
    printf("episode %ld: %s, reward %g, %llu tokens (%llu generated), %u tool call%s%s%s, %.1f s since start\n", e->ended,
           mtrl_ep_status_name(t->status), t->reward, (unsigned long long)t->n_tokens, (unsigned long long)t->n_model,
           t->n_tools, t->n_tools == 1 ? "" : "s", t->reason && t->reason[0] ? ": " : "", t->reason ? t->reason : "",
           mtrl_time_mono() - e->t0);
    fflush(stdout);
}

// The digest [run] db recorded for the checkpoint file ckpt (its rows name it as the learner
// wrote it: absolute, or relative to the store's folder or to here), into digest; "" when the
// store is absent or no row names that file (a checkpoint from elsewhere is not checked).
static void eval_recorded_digest_(const mtrl_config *cfg, const char *ckpt, char *digest, size_t cap) {
    digest[0] = 0;
    mtrl_store *st;
    mtrl_error err;
    char want[4096], cand[8200], real[4096];
    if (mtrl_path_real(ckpt, want, sizeof want) != 0 || access(cfg->run.db, F_OK) != 0) return;
    if (mtrl_store_open(&st, cfg->run.db, 1, &err) != MTRL_OK) return;
    sqlite3_stmt *q = NULL;
    const char *slash = strrchr(cfg->run.db, '/');
    if (sqlite3_prepare_v2(mtrl_store_sqlite(st), "SELECT path, digest FROM checkpoints", -1, &q, NULL) == SQLITE_OK)
        while (!digest[0] && sqlite3_step(q) == SQLITE_ROW) {
            const char *p = (const char *)sqlite3_column_text(q, 0), *d = (const char *)sqlite3_column_text(q, 1);
            if (!p || !d) continue;
            for (int k = 0; k < 2 && !digest[0]; k++) {
                if (k == 0) snprintf(cand, sizeof cand, "%s", p);
                else if (p[0] != '/' && slash) snprintf(cand, sizeof cand, "%.*s/%s", (int)(slash - cfg->run.db), cfg->run.db, p);
                else break;
                if (mtrl_path_real(cand, real, sizeof real) == 0 && !strcmp(real, want)) snprintf(digest, cap, "%s", d);
            }
        }
    sqlite3_finalize(q);
    mtrl_store_close(st);
}

// The model of cfg on its device with the checkpoint's weights (or the initial ones).
static int eval_model_open_(mtrl_model *m, const mtrl_config *cfg, const char *device, const char *ckpt) {
    mtrl_model_dims d;
    mtrl_error err;
    int dev, gpu;
    if (mtrl_model_parse_device(device, &dev, &gpu))
        return cli_usage_error("eval", EVAL_USAGE, "device %s: expected cpu, cuda or cuda:N", device);
    if (mtrl_model_dims_from_config(&d, cfg, MTRL_VOCAB, &err) != MTRL_OK) {
        fprintf(stderr, "mtrl eval: %s\n", err.msg);
        return 2;
    }
    if (mtrl_model_init_on(m, &d, (uint64_t)cfg->run.seed, dev, gpu, &err) != MTRL_OK) {
        fprintf(stderr, "mtrl eval: %s\n", err.msg);
        return 1;
    }
    mtrl_qb_set_mode(m, MTRL_QB_FROZEN); // evaluation never moves β
    if (!ckpt && cfg->model.from[0]) {
        mtrl_hf_load_stats ls;
        if (mtrl_model_load_hf(m, cfg->model.from, &ls, &err) != MTRL_OK) {
            fprintf(stderr, "mtrl eval: %s\n", err.msg);
            mtrl_model_free(m);
            return 1;
        }
        fprintf(stderr, "mtrl eval: no --checkpoint: the weights of [model] from = %s\n", cfg->model.from);
        return 0;
    }
    if (!ckpt) {
        fprintf(stderr, "mtrl eval: no --checkpoint: the initial weights of seed %ld\n", (long)cfg->run.seed);
        return 0;
    }
    mtrl_ckpt c;
    char digest[128];
    eval_recorded_digest_(cfg, ckpt, digest, sizeof digest);
    mtrl_status st = mtrl_ckpt_verify_digest(ckpt, digest, &err);
    if (st == MTRL_OK) st = mtrl_ckpt_open_file(&c, ckpt, &err);
    if (st == MTRL_OK) {
        st = mtrl_model_load(m, &c, 0, &err);
        mtrl_ckpt_close(&c);
    }
    if (st != MTRL_OK) {
        fprintf(stderr, "mtrl eval: %s\n", err.msg);
        mtrl_model_free(m);
        return 1;
    }
    return 0;
}

int cmd_eval(int argc, char **argv) {
    const char *path = NULL, *device = NULL, *ckpt = NULL;
    long episodes = 16, stage = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        char *end = NULL;
        if (cli_is_help(a)) {
            printf("usage: %s\n\n"
                   "Runs N episodes (rounded up to whole groups) of the experiment's env with the\n"
                   "checkpoint's weights, on tasks no training actor draws, and prints each episode and\n"
                   "the success rate. Nothing is trained or stored.\n"
                   "  --checkpoint FILE  weights (a checkpoint of `mtrl run`; default: the initial weights)\n"
                   "  --episodes N       episodes to run (default 16)\n"
                   "  --stage K          run stage K of the [stage.N] ladder (1-based)\n"
                   "  --device D         cpu, cuda or cuda:N (default: [model] device)\n",
                   EVAL_USAGE);
            return 0;
        }
        if (!strcmp(a, "--set")) { i++; continue; }
        if (!strncmp(a, "--set=", 6)) continue;
        if (!strcmp(a, "--episodes") && v) {
            episodes = strtol(v, &end, 10);
            if (*end || episodes < 1 || episodes > 1000000)
                return cli_usage_error("eval", EVAL_USAGE, "--episodes %s: expected 1..1000000", v);
            i++;
        } else if (!strcmp(a, "--stage") && v) {
            stage = strtol(v, &end, 10);
            if (*end || stage < 1) return cli_usage_error("eval", EVAL_USAGE, "--stage %s: expected 1, 2, ...", v);
            i++;
        } else if (!strcmp(a, "--checkpoint") && v) {
            ckpt = argv[++i];
        } else if (!strcmp(a, "--device") && v) {
            device = argv[++i];
        } else if (a[0] == '-') {
            return cli_usage_error("eval", EVAL_USAGE, "unknown option '%s'", a);
        } else if (path) {
            return cli_usage_error("eval", EVAL_USAGE, "more than one experiment file given");
        } else {
            path = a;
        }
    }
    if (!path) return cli_usage_error("eval", EVAL_USAGE, "no experiment file given");
    mtrl_config cfg;
    if (!cli_config_load("eval", path, argc, argv, &cfg)) return 2;
    if (stage > 0) {
        if (stage > cfg.n_stages)
            return cli_usage_error("eval", EVAL_USAGE, "--stage %ld: %s has %d stage%s", stage, path, cfg.n_stages,
                                   cfg.n_stages == 1 ? "" : "s");
        cfg = mtrl_config_stage(&cfg, (int)stage - 1);
    }
    mtrl_model m;
    int rc = eval_model_open_(&m, &cfg, device ? device : cfg.model.device, ckpt);
    if (rc) return rc;
    mtrl_rollout_params p;
    mtrl_rollout_params_from_config(&p, &cfg, MTRL_EVAL_ACTOR_ID, 0);
    p.max_groups = (uint64_t)((episodes + p.group_size - 1) / p.group_size);
    long target = (long)p.max_groups * p.group_size;
    mtrl_rollout *ro;
    mtrl_error err;
    if (mtrl_rollout_init(&ro, &p, &cfg, &m, &err) != MTRL_OK) {
        fprintf(stderr, "mtrl eval: %s\n", err.msg);
        mtrl_model_free(&m);
        return 1;
    }
    printf("eval %s%s: %ld episodes, %d at once in groups of %d, up to %d tokens each, on %s\n", path,
           stage ? " (one stage)" : "", target, p.slots, p.group_size, p.max_tokens, device ? device : cfg.model.device);
    eval_totals e = {0};
    e.t0 = mtrl_time_mono();
    mtrl_rollout_events ev = {&e, NULL, eval_end_, NULL};
    // every episode ends (the env says done, or the token budget runs out)
    while (mtrl_rollout_step(ro, &ev) > 0 || e.ended < target) {
    }
    double dt = mtrl_time_mono() - e.t0;
    printf("%ld episodes in %.1f s: success %.3f (%ld), mean reward %.3f; %ld complete, %ld truncated, %ld aborted; "
           "%.0f tokens and %.1f tool calls per episode, %.0f generated tokens/s\n",
           e.ended, dt, e.ended ? (double)e.successes / (double)e.ended : 0.0, e.successes,
           e.ended ? e.reward / (double)e.ended : 0.0, e.by_status[MTRL_EP_COMPLETE], e.by_status[MTRL_EP_TRUNCATED],
           e.by_status[MTRL_EP_ABORTED], e.ended ? (double)e.tokens / (double)e.ended : 0.0,
           e.ended ? (double)e.tools / (double)e.ended : 0.0, dt > 0 ? (double)e.model_tokens / dt : 0.0);
    mtrl_rollout_free(ro);
    mtrl_model_free(&m);
    return 0;
}
