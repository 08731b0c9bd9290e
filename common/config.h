// config.h: typed experiment configuration from INI files.
//
// An experiment is a plain INI file (Python's configparser reads it too: no dialect of ours):
// sections [run] [model] [env] [actor] [learner] [algo] [warmup] [kernels] and [stage.1] ... [stage.16];
// `key = value` lines; comments start with ; or #. The keys, types, defaults, ranges and help
// live in config_schema.h. Parsing goes through libinih's ini_parse_stream with our own line
// reader, so every message names file:line (Debian's inih gives handlers no line numbers and
// silently splits lines over 200 bytes; we reject such lines instead).
//
// Every problem is collected before returning, each as one line
//     experiments/x.ini:3: unknown key 'lrr' in [learner]; did you mean 'lr'?
// and the caller prints them all and exits 2 (docs/architecture.md §2). Nothing is half-applied:
// on error the config must not be used.
//
//     mtrl_config cfg; mtrl_config_errors errs = {0};
//     if (mtrl_config_load(&cfg, "x.ini", sets, n_sets, &errs) != MTRL_OK) {
//         mtrl_config_errors_print(&errs, stderr); mtrl_config_errors_free(&errs); exit(2);
//     }
//     printf("%g\n", cfg.learner.lr);
#ifndef MTRL_CONFIG_H
#define MTRL_CONFIG_H

#include <stdint.h>
#include <stdio.h>

#include "common/config_schema.h"
#include "common/status.h"

#define MTRL_CFG_STR_MAX 256

#define MTRL_CFG_DECL_INT(k) long k;
#define MTRL_CFG_DECL_FLOAT(k) double k;
#define MTRL_CFG_DECL_BOOL(k) int k;
#define MTRL_CFG_DECL_STR(k) char k[MTRL_CFG_STR_MAX];
#define MTRL_CFG_DECL_ENUM(k) char k[MTRL_CFG_STR_MAX];
#define MTRL_CFG_DECL(sec, key, type, def, lo, hi, choices, help) MTRL_CFG_DECL_##type(key)

typedef struct mtrl_cfg_run { MTRL_CFG_RUN(MTRL_CFG_DECL) } mtrl_cfg_run;
typedef struct mtrl_cfg_model { MTRL_CFG_MODEL(MTRL_CFG_DECL) } mtrl_cfg_model;
typedef struct mtrl_cfg_env { MTRL_CFG_ENV(MTRL_CFG_DECL) } mtrl_cfg_env;
typedef struct mtrl_cfg_actor { MTRL_CFG_ACTOR(MTRL_CFG_DECL) } mtrl_cfg_actor;
typedef struct mtrl_cfg_learner { MTRL_CFG_LEARNER(MTRL_CFG_DECL) } mtrl_cfg_learner;
typedef struct mtrl_cfg_algo { MTRL_CFG_ALGO(MTRL_CFG_DECL) } mtrl_cfg_algo;
typedef struct mtrl_cfg_warmup { MTRL_CFG_WARMUP(MTRL_CFG_DECL) } mtrl_cfg_warmup;
typedef struct mtrl_cfg_kernels { MTRL_CFG_KERNELS(MTRL_CFG_DECL) } mtrl_cfg_kernels;
typedef struct mtrl_cfg_stage { MTRL_CFG_STAGE(MTRL_CFG_DECL) } mtrl_cfg_stage;

typedef struct mtrl_config {
    mtrl_cfg_run run;
    mtrl_cfg_model model;
    mtrl_cfg_env env;
    mtrl_cfg_actor actor;
    mtrl_cfg_learner learner;
    mtrl_cfg_algo algo;
    mtrl_cfg_warmup warmup;
    mtrl_cfg_kernels kernels;
    mtrl_cfg_stage stage[MTRL_CFG_MAX_STAGES];
    int n_stages;                  // [stage.1]..[stage.n_stages] present
    char path[MTRL_CFG_STR_MAX];   // the file it came from ("" for defaults or text)
} mtrl_config;

// All messages of one load, in input order.
typedef struct mtrl_config_errors {
    char **msgs;
    int n, cap;
} mtrl_config_errors;

// Defaults of every key (required keys left empty).
void mtrl_config_defaults(mtrl_config *cfg);

// Parses `path`, then applies `sets` ("section.key=value", as given to --set), then checks
// required keys and cross-field rules and resolves the [model] preset. Returns MTRL_OK, or
// MTRL_ERR_USAGE with every problem in errs (MTRL_ERR_IO when the file cannot be opened).
mtrl_status mtrl_config_load(mtrl_config *cfg, const char *path, const char *const *sets, int n_sets,
                             mtrl_config_errors *errs);

// Same from a string in memory; `name` stands for the file in messages.
mtrl_status mtrl_config_load_text(mtrl_config *cfg, const char *name, const char *text, const char *const *sets,
                                  int n_sets, mtrl_config_errors *errs);

void mtrl_config_errors_print(const mtrl_config_errors *errs, FILE *f);
void mtrl_config_errors_free(mtrl_config_errors *errs);

// The resolved config as INI text (every key, defaults included), in schema order. The
// caller frees the string. Loading this text again yields the same config.
char *mtrl_config_to_ini(const mtrl_config *cfg);

// A stable 64-bit hash of the resolved config (of mtrl_config_to_ini's text).
uint64_t mtrl_config_hash(const mtrl_config *cfg);

// Prints every key with type, default, range or choices and help (mtrl check --keys).
void mtrl_config_print_keys(FILE *f);

// [learner] segment as a number: N (1 .. 2^30), MTRL_CFG_SEGMENT_AUTO for "auto", 0 for anything
// else (the load has refused it). The planner resolves it per batch (model_plan.h
// mtrl_model_segment_resolve).
#define MTRL_CFG_SEGMENT_AUTO (-1L)
long mtrl_config_segment(const mtrl_config *cfg);

// [learner] gpus as device ids: the count (0 for the default, empty: one rank on GPU 0) and
// ids[0 .. count-1] in the order listed (rank r runs on ids[r]); -1 with the reason in why for
// a list that is not comma-separated ids 0..MTRL_CFG_GPU_ID_MAX, names one twice or more than
// MTRL_CFG_GPUS_MAX (the load has refused such a list, naming the key). why nullable.
#define MTRL_CFG_GPUS_MAX 64
#define MTRL_CFG_GPU_ID_MAX 1023
int mtrl_config_gpus(const mtrl_config *cfg, int *ids, char *why, size_t why_cap);

// [actor] gpus as device ids, as mtrl_config_gpus but with repeats allowed (two actors may
// share a GPU); the load refuses a malformed list and a list with [model] device = cpu.
int mtrl_config_actor_gpus(const mtrl_config *cfg, int *ids, char *why, size_t why_cap);
// The CUDA device of local actor `actor_id` (1-based, as mtrl run numbers them): the
// ((actor_id - 1) mod n)-th id of [actor] gpus, or -1 when the list is empty (the actor takes
// [model] device's GPU).
int mtrl_config_actor_gpu(const mtrl_config *cfg, int actor_id);

// The learner's data-parallel ranks: [learner] ranks resolved with [learner] gpus and [model]
// device. Returns R >= 1 and gpu[r] for r < R (gpu[MTRL_CFG_GPUS_MAX], nullable): rank r's CUDA
// device, or -1 on the CPU. With device = cpu the ranks are threads on the CPU and gpus must be
// empty; with cuda rank r runs on the r-th listed id (ranks must equal their number; 0 takes
// it), or on device r when none is listed, and rank 0's GPU must be [model] device's (where the
// actors run: weights are published on that device). -1 with the reason in why (naming the
// keys, without the file name) otherwise. The load refuses a bad combination only when ranks
// is set (ranks = 0 with gpus listed and device = cpu is `mtrl plan`'s way to print a per-rank
// plan; the learner refuses it at start).
int mtrl_config_ranks(const mtrl_config *cfg, int *gpu, char *why, size_t why_cap);

// OpenMP threads for one process of a run: [learner] threads when set, else the cores shared
// evenly between the learner and its [actor] count local actors (at least 1). On a 2-core
// machine with 2 actors every process gets one thread: teams of two on a shared core spend
// their time spinning, not computing (measured: 3x slower on the tiny model).
int mtrl_config_threads(const mtrl_config *cfg);

// The experiment as it runs in stage s (0-based) of its [stage.N] ladder: the stage's context
// is [actor] max_tokens (and caps max_turn_tokens), its doc_tokens, hops, files,
// max_obs_bytes and max_tool_calls those of [env], its group_size, batch_groups and episodes_in_flight those of [algo], [learner] and [actor]; a
// stage key of 0 keeps the base value. The learner enters stages with it; `mtrl eval --stage`
// evaluates one.
mtrl_config mtrl_config_stage(const mtrl_config *base, int s);
// The stage (0-based) that learner step `step` (0-based, the next step to take) belongs to: the
// stages' steps laid end to end, the last stage for any later step; 0 without a ladder.
int mtrl_config_stage_of_step(const mtrl_config *base, long step);


#endif
