// cmd_plan.c: `mtrl plan EXPERIMENT.ini`: the memory plan of the experiment's learner step
// (model/model_plan.h): the segment length the learner would use with [learner] segment = auto
// and what every block of the step takes, for a batch of sequences on a device and a budget.
//
//   mtrl plan EXPERIMENT.ini [--tokens T] [--batch B] [--device cpu|cuda|cuda:N] [--budget-gib G] [--set ...]
//
// Defaults: T = the longest stage context (else [actor] max_tokens); B = that stage's episodes per
// step (group_size x batch_groups); the device of [model] device; the budget = the device's free
// memory now. With several learner ranks ([learner] ranks or gpus): the per-rank plan (learner/dist_plan.h: episodes,
// tokens and units per rank, experts per rank, shard bytes per rank) and the memory plan of the
// busiest rank's share. Exit 0 with the plan, 1 when nothing fits (the message says what the
// least needs), 2 for bad usage.
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/config.h"
#include "learner/dist_ep.h"
#include "learner/dist_plan.h"
#include "learner/learner_ranks.h"
#include "model/model_plan.h"
#include "common/tokenizer.h"
#include "tools/cli.h"

#define PLAN_USAGE                                                                                 \
    "mtrl plan EXPERIMENT.ini [--tokens T] [--batch B] [--device cpu|cuda|cuda:N] [--budget-gib G] " \
    "[--set section.key=value ...]"

// [learner] gpus lists several: the batch split over the ranks (learner/dist_plan.h), the
// experts and ZeRO shards of each, and the memory plan of the busiest rank's share with its
// moments sharded.
static int plan_ranks_(const mtrl_model_dims *d, int dev, long tokens, int batch, size_t budget, const int *gpus,
                       int ranks, int expert_parallel) {
    mtrl_error err;
    int *len = xmalloc(sizeof(int) * (size_t)batch);
    for (int i = 0; i < batch; i++) len[i] = (int)tokens;
    mtrl_dist_split split;
    mtrl_status st = mtrl_dist_split_make(&split, batch, len, ranks, 0, &err);
    int busiest = 0;
    for (int r = 1; st == MTRL_OK && r < ranks; r++)
        if (split.rank[r].tokens > split.rank[busiest].tokens) busiest = r;
    mtrl_model_plan p;
    int share = st == MTRL_OK ? split.rank[busiest].n_seq : 0;
    if (st == MTRL_OK && share > 0) st = mtrl_model_plan_uniform(&p, d, dev, tokens, share, budget, &err);
    if (st == MTRL_OK && share > 0) { // the units with the segment the busiest rank's plan chose
        mtrl_dist_split_free(&split);
        st = mtrl_dist_split_make(&split, batch, len, ranks, p.segment, &err);
    }
    free(len);
    if (st != MTRL_OK) {
        fprintf(stderr, "mtrl plan: %s\n", err.msg);
        return 1;
    }
    mtrl_dist_experts x;
    int have_x = mtrl_dist_experts_make(&x, d->E, ranks, &err) == MTRL_OK;
    if (!have_x) printf("expert parallel: %s\n", err.msg);
    mtrl_tt t;
    mtrl_model_param_table(&t, d);
    mtrl_dist_shards sh;
    MTRL_CHECK(mtrl_dist_shards_make(&sh, &t, ranks, MTRL_DIST_SHARD_ALIGN, &err) == MTRL_OK);
    mtrl_dist_plan_print(&split, have_x ? &x : NULL, &sh, gpus, stdout);
    if (have_x && x.E > 0) {
        mtrl_dist_ep_layout ep;
        if (mtrl_dist_ep_layout_make(&ep, &t, &x, MTRL_DIST_SHARD_ALIGN, &err) == MTRL_OK) {
            mtrl_dist_ep_print(&ep, stdout);
            mtrl_dist_ep_layout_free(&ep);
        } else {
            printf("expert-parallel ownership: %s\n", err.msg);
        }
    }
    if (share > 0) {
        printf("memory plan of rank %d (%d of the %d episodes):\n", busiest, share, batch);
        mtrl_model_plan_print(&p, stdout);
        size_t zero1 = p.total - p.adam + 2 * sh.shard_bytes;
        printf("with the AdamW moments sharded (ZeRO-1): %.2f GiB of moments instead of %.2f GiB, %.2f GiB in all (%s)\n",
               (double)(2 * sh.shard_bytes) / (1 << 30), (double)p.adam / (1 << 30), (double)zero1 / (1 << 30),
               p.budget && zero1 + p.margin > p.budget ? "does not fit the budget" : "fits the budget");
    }
    // What mtrl run's step does with it: [learner] expert_parallel picks the ownership.
    if (expert_parallel)
        printf("mtrl run trains this split with [learner] expert_parallel: each rank owns the experts and shard above "
               "(their gradients and moments), runs its experts for every rank's tokens, and rank 0 gathers every "
               "expert after each step; each rank still allocates every expert's weights (docs/multi-gpu.md)\n");
    else
        printf("mtrl run trains this split data parallel, the moments sharded; [learner] expert_parallel = true trains "
               "it with the expert-parallel ownership above (CPU models; docs/multi-gpu.md)\n");
    mtrl_dist_shards_free(&sh);
    mtrl_tt_free(&t);
    mtrl_dist_split_free(&split);
    return 0;
}

int cmd_plan(int argc, char **argv) {
    const char *path = NULL, *device = NULL;
    long tokens = 0, batch = 0;
    double budget_gib = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        char *end = NULL;
        if (cli_is_help(a)) {
            printf("usage: %s\n\n"
                   "Prints the memory plan of the experiment's learner step: the segment length S the\n"
                   "learner uses with [learner] segment = auto (the largest multiple of 64 that fits the budget\n"
                   "minus a 5%% margin, or the whole episode), and the bytes of the parameters, gradients,\n"
                   "AdamW moments, boundary states, MLA latents and their gradients, one segment's\n"
                   "activations, scratch, and the host arrays.\n"
                   "  --tokens T      tokens per episode (default: the longest [stage.N] context, else\n"
                   "                  [actor] max_tokens)\n"
                   "  --batch B       episodes per learner step (default: that stage's group_size x batch_groups)\n"
                   "  --device D      cpu, cuda or cuda:N (default: [model] device)\n"
                   "  --budget-gib G  memory to plan for (default: the device's free memory now)\n"
                   "With several learner ranks (--set learner.ranks=N, or learner.gpus=0,1,...): the per-rank plan,\n"
                   "the batch's episodes split over the ranks by tokens, the experts and the ZeRO shard of each\n"
                   "rank, and the memory plan of the busiest rank's share.\n"
                   "Exit 1 when nothing fits, with what the least needs.\n",
                   PLAN_USAGE);
            return 0;
        }
        if (!strcmp(a, "--set")) { i++; continue; }
        if (!strncmp(a, "--set=", 6)) continue;
        if (!strcmp(a, "--tokens") && v) {
            tokens = strtol(v, &end, 10);
            if (*end || tokens < 1 || tokens > (1L << 30))
                return cli_usage_error("plan", PLAN_USAGE, "--tokens %s: expected 1..1073741824", v);
            i++;
        } else if (!strcmp(a, "--batch") && v) {
            batch = strtol(v, &end, 10);
            if (*end || batch < 1 || batch > (1L << 20))
                return cli_usage_error("plan", PLAN_USAGE, "--batch %s: expected 1..1048576", v);
            i++;
        } else if (!strcmp(a, "--device") && v) {
            device = v;
            i++;
        } else if (!strcmp(a, "--budget-gib") && v) {
            budget_gib = strtod(v, &end);
            if (*end || !(budget_gib > 0) || budget_gib > 1e6)
                return cli_usage_error("plan", PLAN_USAGE, "--budget-gib %s: expected a positive number of GiB", v);
            i++;
        } else if (a[0] == '-') {
            return cli_usage_error("plan", PLAN_USAGE, "unknown option '%s'", a);
        } else if (path) {
            return cli_usage_error("plan", PLAN_USAGE, "more than one experiment file given");
        } else {
            path = a;
        }
    }
    if (!path) return cli_usage_error("plan", PLAN_USAGE, "no experiment file given");
    mtrl_config cfg;
    if (!cli_config_load("plan", path, argc, argv, &cfg)) return 2;
    // The longest stage and its batch: episodes per step = group_size x batch_groups.
    mtrl_config longest = cfg;
    for (int s = 0; s < cfg.n_stages; s++) {
        mtrl_config c = mtrl_config_stage(&cfg, s);
        if (c.actor.max_tokens >= longest.actor.max_tokens) longest = c;
    }
    if (!tokens) tokens = longest.actor.max_tokens;
    if (!batch) batch = longest.learner.batch_groups * longest.algo.group_size;
    int dev, gpu;
    if (!device) device = cfg.model.device;
    if (mtrl_model_parse_device(device, &dev, &gpu))
        return cli_usage_error("plan", PLAN_USAGE, "--device %s: expected cpu, cuda or cuda:N", device);
    mtrl_model_dims d;
    mtrl_error err;
    if (mtrl_model_dims_from_config(&d, &cfg, MTRL_VOCAB, &err) != MTRL_OK) {
        fprintf(stderr, "mtrl plan: %s: %s\n", path, err.msg);
        return 2;
    }
    size_t budget;
    if (budget_gib > 0) {
        budget = (size_t)(budget_gib * (double)((size_t)1 << 30));
    } else {
        size_t total;
        if (mtrl_model_device_memory(dev, gpu, &budget, &total, &err) != MTRL_OK) {
            fprintf(stderr, "mtrl plan: %s; give the memory with --budget-gib G\n", err.msg);
            return 2;
        }
        printf("free memory of %s: %.2f of %.2f GiB\n", device, (double)budget / (1 << 30), (double)total / (1 << 30));
    }
    printf("experiment %s: model preset %s, %d layers (%s), d=%d, %d experts top-%d\n", path, cfg.model.preset, d.L,
           d.mixer, d.d, d.E, d.k);
    // The learner's ranks ([learner] ranks, gpus: mtrl_config_ranks); GPUs listed for a CPU
    // experiment still plan one rank per id (the learner refuses to run them).
    int gpus[MTRL_CFG_GPUS_MAX], ranks = mtrl_config_ranks(&cfg, gpus, NULL, 0);
    char what[400];
    if (ranks > 1 && mtrl_learner_ranks_describe(&cfg, what, sizeof what) > 1) printf("learner: %s\n", what);
    if (ranks < 0) ranks = mtrl_config_gpus(&cfg, gpus, NULL, 0);
    if (mtrl_learner_ranks_check_ep(&cfg, &d, &err) != MTRL_OK) {
        fprintf(stderr, "mtrl plan: %s: %s\n", path, err.msg);
        return 2;
    }
    if (ranks > 1)
        return plan_ranks_(&d, dev, tokens, (int)batch, budget, gpus[0] >= 0 ? gpus : NULL, ranks,
                           cfg.learner.expert_parallel);
    mtrl_model_plan p;
    mtrl_status st = mtrl_model_plan_uniform(&p, &d, dev, tokens, (int)batch, budget, &err);
    mtrl_model_plan_print(&p, stdout);
    if (st != MTRL_OK) {
        fprintf(stderr, "mtrl plan: %s\n", err.msg);
        return 1;
    }
    return 0;
}
