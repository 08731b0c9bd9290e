// learner_ranks.c: the learner's data-parallel ranks in one process (see learner_ranks.h).
//
// One mutex and one condition variable (on the monotonic clock) hold the whole protocol: rank 0
// writes the job and bumps `seq`; each follower, waiting for a new seq, runs it and writes its
// status and `done = seq`; rank 0 waits until every follower's done is seq, or a deadline. The
// batch, config and algorithm are rank 0's, read by every rank during the job and untouched by
// rank 0 until all are done (the step reads its episodes only).
#include "learner/learner_ranks.h"

#include <errno.h>
#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/check.h"
#include "common/log.h"
#include "common/timeutil.h"
#include "common/trajbuf.h"
#include "learner/dist_ckpt.h"
#include "learner/dist_comm.h"
#include "learner/dist_dp.h"
#include "learner/dist_launch.h"
#include "model/qb.h"

typedef enum { JOB_NONE, JOB_RL, JOB_SFT, JOB_RESET, JOB_SAVE, JOB_STOP, JOB_BEAT } job_kind;

static const char *const job_name_[] = {"", "RL step", "supervised step", "optimizer reset", "checkpoint shards", "stop",
                                        "heartbeat"};

typedef struct job_ {
    job_kind kind;
    const mtrl_config *cfg;
    const mtrl_algo_config *algo;
    mtrl_traj *const *eps;
    int n;
    double lr;
    const char *index;       // JOB_SAVE: the index path (the rank files are beside it)
    mtrl_step_stats *st;     // rank 0's (JOB_RL)
    double *loss;            // rank 0's (JOB_SFT, nullable)
} job_;

typedef struct rank_ {
    struct mtrl_learner_ranks *g;
    int rank, gpu;
    pthread_t th;
    int started;
    mtrl_model own;          // a follower's replica
    mtrl_model *m;           // &own, or rank 0's model
    mtrl_dist_comm *comm;
    mtrl_dist_dp dp;
    int have_dp;
    mtrl_step_stats stats;   // a follower's (the same values as rank 0's)
    long steps;              // step jobs run (the test hook counts them)
    long fail_at;            // > 0: fail step job number fail_at (tests)
    // under g->mu:
    uint64_t done;           // the last job seq finished
    int ready, exited;       // set up (or failed to: st), thread ended
    mtrl_status st;          // of the set-up, then of the last job
    mtrl_error err;
} rank_;

// The unique id of NCCL from rank 0 to the others inside the process.
typedef struct boot_mem_ {
    unsigned char id[512];
    size_t bytes;
    int ready;
} boot_mem_;

struct mtrl_learner_ranks {
    int R, device, threads, timeout_ms;
    int proc;                // the ranks are processes (mtrl_learner_ranks_init_process): only rk[me] is here
    int me;                  // this process's rank (0 unless proc)
    double last_post;        // proc, rank 0: when the last job went out (the heartbeat's clock)
    int ep;                  // [learner] expert_parallel with R > 1: the EP+DP step (dist_dp.h)
    int dead;                // a step failed: the world is dead
    char why_dead[MTRL_ERROR_MSG_MAX];
    mtrl_dist_world *world;  // the local backend's (CPU)
    const void *blob;        // rank 0's state while the followers load it
    size_t blob_len;
    boot_mem_ boot;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    job_ job;
    uint64_t seq;
    rank_ rk[MTRL_DIST_RANKS_MAX];
};

// ---- waiting ----------------------------------------------------------------------------------

static struct timespec deadline_(int ms) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    t.tv_sec += ms / 1000;
    t.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (t.tv_nsec >= 1000000000L) t.tv_sec++, t.tv_nsec -= 1000000000L;
    return t;
}

// Waits on g->cv (g->mu held) until `at`; 0 when it passed.
static int wait_until_(mtrl_learner_ranks *g, const struct timespec *at) {
    return pthread_cond_timedwait(&g->cv, &g->mu, at) != ETIMEDOUT;
}

static mtrl_status boot_mem_fn_(void *user, int rank, int ranks, void *id, size_t id_bytes, int timeout_ms,
                                mtrl_error *err) {
    (void)ranks;
    mtrl_learner_ranks *g = user;
    if (id_bytes > sizeof g->boot.id)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "learner ranks: an NCCL id of %zu bytes (at most %zu)", id_bytes,
                              sizeof g->boot.id);
    pthread_mutex_lock(&g->mu);
    mtrl_status s = MTRL_OK;
    if (rank == 0) {
        memcpy(g->boot.id, id, id_bytes);
        g->boot.bytes = id_bytes;
        g->boot.ready = 1;
        pthread_cond_broadcast(&g->cv);
    } else {
        struct timespec at = deadline_(timeout_ms);
        while (!g->boot.ready && wait_until_(g, &at)) {}
        if (g->boot.ready) memcpy(id, g->boot.id, id_bytes);
        else s = mtrl_error_set(err, MTRL_ERR_TIMEOUT, "learner rank %d: no NCCL id from rank 0 within %d ms", rank, timeout_ms);
    }
    pthread_mutex_unlock(&g->mu);
    return s;
}

// ---- one rank ---------------------------------------------------------------------------------

// The rank's communicator and step state (and, for a follower, its replica of rank 0's state).
static mtrl_status rank_setup_(rank_ *k, mtrl_error *err) {
    mtrl_learner_ranks *g = k->g;
    mtrl_status s = g->device == MTRL_DEVICE_CPU
                        ? mtrl_dist_comm_init_local(&k->comm, g->world, k->rank, err)
                        : mtrl_dist_comm_init_nccl(&k->comm, g->R, k->rank, k->gpu, NULL, g->timeout_ms, boot_mem_fn_, g, err);
    if (s == MTRL_OK && k->rank > 0) {
        const mtrl_model *m0 = g->rk[0].m;
        mtrl_model_dims d = m0->dims;
        s = mtrl_model_init_on(&k->own, &d, 0, g->device, k->gpu, err);
        if (s == MTRL_OK) {
            k->m = &k->own;
            mtrl_qb_set_mode(&k->own, m0->qb_mode);
            mtrl_ckpt c;
            s = mtrl_ckpt_open_mem(&c, g->blob, g->blob_len, err);
            if (s == MTRL_OK) {
                s = mtrl_model_load(&k->own, &c, 1, err); // parameters, moments, β, step, version
                mtrl_ckpt_close(&c);
            }
        }
    }
    if (s == MTRL_OK && (s = g->ep ? mtrl_dist_dp_init_ep(&k->dp, k->comm, k->m, err)
                                   : mtrl_dist_dp_init(&k->dp, k->comm, k->m, err)) == MTRL_OK)
        k->have_dp = 1;
    return s;
}

static void rank_teardown_(rank_ *k) {
    if (k->have_dp) mtrl_dist_dp_free(&k->dp);
    k->have_dp = 0;
    mtrl_dist_comm_free(k->comm);
    k->comm = NULL;
    if (k->m == &k->own) mtrl_model_free(&k->own);
    k->m = NULL;
}

// Rank k's part of job j.
static mtrl_status rank_job_(rank_ *k, const job_ *j, mtrl_error *err) {
    switch (j->kind) {
    case JOB_RL:
    case JOB_SFT:
        k->steps++;
        if (k->fail_at > 0 && k->steps == k->fail_at)
            return mtrl_error_set(err, MTRL_ERR_PEER, "failure injected by a test at its step job %ld (the step not run)",
                                  k->steps);
        if (j->kind == JOB_RL) {
            mtrl_step_stats *st = k->rank == 0 ? j->st : &k->stats;
            if (k->rank) st->loads = NULL;
            return mtrl_dist_dp_rl_step(&k->dp, k->m, j->cfg, j->algo, j->eps, j->n, st, err);
        }
        return mtrl_dist_dp_sft_step(&k->dp, k->m, j->cfg, j->eps, j->n, j->lr, k->rank == 0 ? j->loss : NULL, err);
    case JOB_RESET:
        mtrl_model_optimizer_reset(k->m);
        return MTRL_OK;
    case JOB_SAVE: {
        mtrl_model_to_host(k->m); // a GPU replica's moments and parameters into its host mirror
        if (k->g->ep) // what this rank owns: its experts and its non-expert shard (dist_ckpt.h)
            return mtrl_dist_ckpt_write_rank_ep(j->index, &k->dp.layout, &k->m->params, k->rank, k->m->params.base,
                                                k->m->adam_m, k->m->adam_v, err);
        const mtrl_dist_shards *sh = &k->dp.shards;
        size_t at = sh->rank[k->rank].begin < sh->total ? sh->rank[k->rank].begin : sh->total;
        return mtrl_dist_ckpt_write_rank(j->index, sh, &k->m->params, k->rank, (const char *)k->m->params.base + at,
                                         (const char *)k->m->adam_m + at, (const char *)k->m->adam_v + at, err);
    }
    default:
        return MTRL_OK;
    }
}

static void *follower_main_(void *p) {
    rank_ *k = p;
    mtrl_learner_ranks *g = k->g;
    omp_set_num_threads(g->threads);
    mtrl_error err = {0};
    mtrl_status s = rank_setup_(k, &err);
    pthread_mutex_lock(&g->mu);
    k->st = s;
    k->err = err;
    k->ready = 1;
    pthread_cond_broadcast(&g->cv);
    // No job is posted before every rank is set up, so the first to see is seq 1: a stop posted
    // while this rank was still setting up (another rank failed) is seen too.
    uint64_t seen = 0;
    while (s == MTRL_OK) {
        while (g->seq == seen) pthread_cond_wait(&g->cv, &g->mu);
        seen = g->seq;
        job_ j = g->job;
        if (j.kind == JOB_STOP) break;
        pthread_mutex_unlock(&g->mu);
        mtrl_error e = {0};
        mtrl_status js = rank_job_(k, &j, &e);
        pthread_mutex_lock(&g->mu);
        k->st = js;
        k->err = e;
        k->done = seen;
        pthread_cond_broadcast(&g->cv);
    }
    pthread_mutex_unlock(&g->mu);
    rank_teardown_(k);
    pthread_mutex_lock(&g->mu);
    k->exited = 1;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

// ---- rank 0's side ------------------------------------------------------------------------------

// The error of a job that failed on some ranks: the first rank whose own cause it is (not a
// timeout waiting for another, nor a world already dead), else the first that failed.
static mtrl_status combine_(mtrl_learner_ranks *g, const char *what, mtrl_error *err) {
    int cause = -1, failed = 0;
    for (int r = 0; r < g->R; r++) {
        mtrl_status s = g->rk[r].st;
        if (s == MTRL_OK) continue;
        failed++;
        if (cause < 0 || ((g->rk[cause].st == MTRL_ERR_TIMEOUT || g->rk[cause].st == MTRL_ERR_STATE) &&
                          s != MTRL_ERR_TIMEOUT && s != MTRL_ERR_STATE))
            cause = r;
    }
    if (cause < 0) return MTRL_OK;
    int other = -1;
    for (int r = 0; r < g->R && other < 0; r++)
        if (r != cause && g->rk[r].st != MTRL_OK) other = r;
    if (other >= 0)
        return mtrl_error_set(err, g->rk[cause].st, "learner rank %d of %d failed its %s: %.400s (%d of the %d ranks "
                              "failed; rank %d: %.300s)", cause, g->R, what, g->rk[cause].err.msg, failed, g->R, other,
                              g->rk[other].err.msg);
    return mtrl_error_set(err, g->rk[cause].st, "learner rank %d of %d failed its %s: %.600s", cause, g->R, what,
                          g->rk[cause].err.msg);
}

static mtrl_status post_proc_(mtrl_learner_ranks *g, const job_ *j, mtrl_error *err);

// Posts job j to the followers, runs rank 0's part, waits for theirs (at most the rank timeout
// after rank 0's ended, plus 5 s) and returns the combined status.
static mtrl_status run_job_(mtrl_learner_ranks *g, const job_ *j, mtrl_error *err) {
    if (g->dead)
        return mtrl_error_set(err, MTRL_ERR_STATE, "learner ranks: no %s after a failed step: %.600s", job_name_[j->kind],
                              g->why_dead);
    if (g->proc) return post_proc_(g, j, err);
    pthread_mutex_lock(&g->mu);
    g->job = *j;
    uint64_t seq = ++g->seq;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    rank_ *k0 = &g->rk[0];
    mtrl_error e0 = {0};
    mtrl_status s0 = rank_job_(k0, j, &e0);
    pthread_mutex_lock(&g->mu);
    k0->st = s0;
    k0->err = e0;
    struct timespec at = deadline_(g->timeout_ms + 5000);
    int late = 0;
    for (int r = 1; r < g->R; r++) {
        rank_ *k = &g->rk[r];
        while (k->done != seq && wait_until_(g, &at)) {}
        if (k->done != seq) {
            late = 1;
            k->st = mtrl_error_set(&k->err, MTRL_ERR_TIMEOUT, "did not finish within %d ms of rank 0", g->timeout_ms + 5000);
        }
    }
    mtrl_status s = combine_(g, job_name_[j->kind], err);
    pthread_mutex_unlock(&g->mu);
    // A failed step leaves the replicas undefined; a follower still busy misses the next job
    // (and may still read the batch: only a rank stuck in its own compute past the deadline).
    if (s != MTRL_OK && (j->kind == JOB_RL || j->kind == JOB_SFT || late)) {
        g->dead = 1;
        snprintf(g->why_dead, sizeof g->why_dead, "%s", err->msg);
    }
    return s;
}

int mtrl_learner_ranks_describe(const mtrl_config *cfg, char *buf, size_t cap) {
    int gpu[MTRL_CFG_GPUS_MAX];
    char why[400];
    int R = mtrl_config_ranks(cfg, gpu, why, sizeof why);
    if (R < 0) {
        snprintf(buf, cap, "%s", why);
        return -1;
    }
    if (gpu[0] < 0) {
        snprintf(buf, cap, "%d data-parallel learner rank%s: %s%s", R, R == 1 ? "" : "s",
                 R == 1 ? "the learner's own thread on the CPU" : "threads of one process on the CPU (local backend)",
                 !cfg->learner.expert_parallel ? ""
                 : R == 1 ? "; [learner] expert_parallel has no effect with one rank"
                          : "; the routed experts expert parallel over them ([learner] expert_parallel: each rank owns "
                            "its block of experts, the rest ZeRO-sharded)");
        return R;
    }
    char ids[400] = "";
    size_t n = 0;
    for (int r = 0; r < R && n < sizeof ids; r++) n += (size_t)snprintf(ids + n, sizeof ids - n, "%s%d", r ? "," : "", gpu[r]);
    snprintf(buf, cap, "%d data-parallel learner rank%s on GPU%s %s%s", R, R == 1 ? "" : "s", R == 1 ? "" : "s", ids,
             R == 1 ? "" : " (one thread each, NCCL)");
    return R;
}

mtrl_status mtrl_learner_ranks_check_ep(const mtrl_config *cfg, const mtrl_model_dims *d, mtrl_error *err) {
    if (!cfg->learner.expert_parallel) return MTRL_OK;
    int device = MTRL_DEVICE_CPU, gpu = 0, id[MTRL_CFG_GPUS_MAX];
    mtrl_model_parse_device(cfg->model.device, &device, &gpu);
    int R = mtrl_config_ranks(cfg, id, NULL, 0);
    if (device != MTRL_DEVICE_CPU)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "[learner] expert_parallel = true with [model] device = %s: the "
                              "expert-parallel step runs on CPU models only; its GPU path (the expert exchange over "
                              "NCCL on device buffers) is not built (docs/multi-gpu.md §3)", cfg->model.device);
    if (d->n_moe == 0 || d->E == 0)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "[learner] expert_parallel = true, but the model has no MoE layer "
                              "(%d layers, all dense): there are no experts to spread over the ranks", d->L);
    if (R > d->E)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "[learner] expert_parallel = true with %d learner ranks, but the model "
                              "has %d routed experts: every rank must own at least one (at most %d ranks, or "
                              "expert_parallel = false)", R, d->E, d->E);
    return MTRL_OK;
}

mtrl_status mtrl_learner_ranks_init(mtrl_learner_ranks **out, mtrl_model *m0, const mtrl_config *cfg, mtrl_error *err) {
    *out = NULL;
    int gpu[MTRL_CFG_GPUS_MAX];
    char why[400];
    int R = mtrl_config_ranks(cfg, gpu, why, sizeof why);
    if (R < 0) return mtrl_error_set(err, MTRL_ERR_USAGE, "%s: %s", cfg->path, why);
    int device = gpu[0] < 0 ? MTRL_DEVICE_CPU : MTRL_DEVICE_CUDA;
    if (m0->device != device || (device == MTRL_DEVICE_CUDA && m0->gpu != gpu[0]))
        return mtrl_error_set(err, MTRL_ERR_USAGE, "learner ranks: rank 0's model is on %s, [learner] ranks / gpus put "
                              "rank 0 on %s", m0->device == MTRL_DEVICE_CPU ? "the CPU" : "a GPU",
                              device == MTRL_DEVICE_CPU ? "the CPU" : "another device");
    mtrl_status s = mtrl_learner_ranks_check_ep(cfg, &m0->dims, err);
    if (s != MTRL_OK) return s;
    mtrl_learner_ranks *g = xcalloc(1, sizeof *g);
    g->R = R;
    g->ep = cfg->learner.expert_parallel && R > 1;
    g->device = device;
    // [learner] threads is each rank's; its default (the cores shared with the actors) is
    // shared by the ranks too, so that R ranks of the CPU do not oversubscribe it R times.
    g->threads = mtrl_config_threads(cfg);
    if (cfg->learner.threads == 0 && device == MTRL_DEVICE_CPU) g->threads = g->threads / R > 1 ? g->threads / R : 1;
    omp_set_num_threads(g->threads); // rank 0's, the caller's thread
    g->timeout_ms = (int)cfg->learner.rank_timeout_ms;
    pthread_mutex_init(&g->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&g->cv, &ca);
    pthread_condattr_destroy(&ca);
    for (int r = 0; r < R; r++) g->rk[r] = (rank_){.g = g, .rank = r, .gpu = gpu[r]};
    g->rk[0].m = m0;
    if (device == MTRL_DEVICE_CPU) s = mtrl_dist_world_init(&g->world, R, g->timeout_ms, err);
    void *blob = NULL;
    size_t len = 0;
    // Rank 0's whole state, which every follower loads: the replicas start equal.
    if (s == MTRL_OK && R > 1) s = mtrl_model_save(m0, NULL, &blob, &len, 1, NULL, 0, err);
    g->blob = blob;
    g->blob_len = len;
    for (int r = 1; r < R && s == MTRL_OK; r++) {
        if (pthread_create(&g->rk[r].th, NULL, follower_main_, &g->rk[r]) != 0) {
            s = mtrl_error_set(err, MTRL_ERR_NOMEM, "learner rank %d: cannot start its thread", r);
            break;
        }
        g->rk[r].started = 1;
    }
    if (s == MTRL_OK) {
        mtrl_error e0 = {0};
        g->rk[0].st = rank_setup_(&g->rk[0], &e0);
        g->rk[0].err = e0;
        pthread_mutex_lock(&g->mu);
        for (int r = 1; r < R; r++)
            while (!g->rk[r].ready) pthread_cond_wait(&g->cv, &g->mu); // each set-up ends (NCCL's init has its timeout)
        s = combine_(g, "start", err);
        pthread_mutex_unlock(&g->mu);
    }
    free(blob);
    g->blob = NULL;
    if (s != MTRL_OK) {
        mtrl_learner_ranks_free(g);
        return s;
    }
    *out = g;
    return MTRL_OK;
}

static void free_proc_(mtrl_learner_ranks *g);

void mtrl_learner_ranks_free(mtrl_learner_ranks *g) {
    if (!g) return;
    if (g->proc) {
        free_proc_(g);
        return;
    }
    pthread_mutex_lock(&g->mu);
    g->job = (job_){.kind = JOB_STOP};
    g->seq++;
    pthread_cond_broadcast(&g->cv);
    struct timespec at = deadline_(g->timeout_ms + 5000);
    int stuck = 0;
    for (int r = 1; r < g->R; r++) {
        rank_ *k = &g->rk[r];
        if (!k->started) continue;
        while (!k->exited && wait_until_(g, &at)) {}
        stuck += !k->exited;
    }
    pthread_mutex_unlock(&g->mu);
    if (stuck) {
        // Joining would hang the process: the stuck threads and what they use stay behind.
        LOG_ERROR("learner ranks: %d follower thread(s) did not stop within %d ms; left running", stuck, g->timeout_ms + 5000);
        for (int r = 1; r < g->R; r++)
            if (g->rk[r].started && !g->rk[r].exited) pthread_detach(g->rk[r].th);
            else if (g->rk[r].started) pthread_join(g->rk[r].th, NULL);
        return;
    }
    for (int r = 1; r < g->R; r++)
        if (g->rk[r].started) pthread_join(g->rk[r].th, NULL);
    rank_teardown_(&g->rk[0]); // rank 0's model stays the caller's
    mtrl_dist_world_free(g->world);
    pthread_cond_destroy(&g->cv);
    pthread_mutex_destroy(&g->mu);
    free(g);
}

int mtrl_learner_ranks_count(const mtrl_learner_ranks *g) { return g->R; }
const char *mtrl_learner_ranks_backend(const mtrl_learner_ranks *g) {
    return g->proc ? "zmq" : g->device == MTRL_DEVICE_CPU ? "local" : "nccl";
}
int mtrl_learner_ranks_failed(const mtrl_learner_ranks *g) { return g->dead; }

mtrl_status mtrl_learner_ranks_rl_step(mtrl_learner_ranks *g, const mtrl_config *cfg, const mtrl_algo_config *a,
                                       mtrl_traj *const *eps, int n, mtrl_step_stats *st, mtrl_error *err) {
    job_ j = {.kind = JOB_RL, .cfg = cfg, .algo = a, .eps = eps, .n = n, .st = st};
    return run_job_(g, &j, err);
}

mtrl_status mtrl_learner_ranks_sft_step(mtrl_learner_ranks *g, const mtrl_config *cfg, mtrl_traj *const *eps, int n,
                                        double lr, double *loss, mtrl_error *err) {
    job_ j = {.kind = JOB_SFT, .cfg = cfg, .eps = eps, .n = n, .lr = lr, .loss = loss};
    return run_job_(g, &j, err);
}

mtrl_status mtrl_learner_ranks_optimizer_reset(mtrl_learner_ranks *g, mtrl_error *err) {
    job_ j = {.kind = JOB_RESET};
    return run_job_(g, &j, err);
}

mtrl_status mtrl_learner_ranks_save(mtrl_learner_ranks *g, const char *index_path, const char *const *meta, int n_meta,
                                    mtrl_error *err) {
    job_ j = {.kind = JOB_SAVE, .index = index_path};
    mtrl_status s = run_job_(g, &j, err);
    if (s != MTRL_OK) return s;
    // Every rank file is on disk: the index, with what every rank holds alike.
    const mtrl_model *m0 = g->rk[0].m;
    _Static_assert(sizeof(real) == sizeof(float), "QB β is saved as fp32");
    mtrl_ckpt_entry beta = {.name = "qb_beta", .dtype = MTRL_DT_F32, .ndim = 2,
                            .data = m0->qb_beta, .nbytes = sizeof(real) * (size_t)m0->dims.L * (size_t)m0->dims.E};
    beta.shape[0] = m0->dims.L;
    beta.shape[1] = m0->dims.E;
    char step[32], version[32];
    snprintf(step, sizeof step, "%ld", m0->step);
    snprintf(version, sizeof version, "%u", m0->version);
    const char **kv = xcalloc((size_t)(2 * n_meta + 4), sizeof(char *));
    kv[0] = "step"; kv[1] = step;
    kv[2] = "version"; kv[3] = version;
    for (int i = 0; i < 2 * n_meta; i++) kv[4 + i] = meta[i];
    s = g->ep ? mtrl_dist_ckpt_write_index_ep(index_path, &g->rk[0].dp.layout, &m0->params, &beta, 1, kv, n_meta + 2, err)
              : mtrl_dist_ckpt_write_index(index_path, &g->rk[0].dp.shards, &m0->params, &beta, 1, kv, n_meta + 2, err);
    free(kv);
    if (s != MTRL_OK) return mtrl_error_wrap(err, "learner rank 0 of %d, the checkpoint's index", g->R);
    return MTRL_OK;
}

mtrl_status mtrl_learner_ranks_load_moments(mtrl_model *m, const char *index_path, mtrl_error *err) {
    mtrl_dist_ckpt c;
    mtrl_status s = mtrl_dist_ckpt_open(&c, index_path, &m->params, err);
    if (s != MTRL_OK) return s;
    const char *step = mtrl_ckpt_meta(&c.index, "step");
    mtrl_dist_shards one; // one rank's layout: the whole blocks
    s = step ? mtrl_dist_shards_make(&one, &m->params, 1, MTRL_DIST_SHARD_ALIGN, err)
             : mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: no step metadata: not a learner's sharded optimizer state", index_path);
    if (s == MTRL_OK) {
        s = mtrl_dist_ckpt_read_shard(&c, &one, 0, NULL, m->adam_m, m->adam_v, err);
        mtrl_dist_shards_free(&one);
    }
    if (s == MTRL_OK) {
        m->step = strtol(step, NULL, 10);
        mtrl_model_to_device(m); // the moments (and the mirror's parameters, unchanged) onto a GPU
    }
    mtrl_dist_ckpt_close(&c);
    return s;
}

void mtrl_learner_ranks_test_fail(mtrl_learner_ranks *g, int rank, long job) {
    MTRL_CHECKF(rank >= 0 && rank < g->R && job > 0, "rank %d of %d, job %ld", rank, g->R, job);
    pthread_mutex_lock(&g->mu);
    g->rk[rank].fail_at = g->rk[rank].steps + job;
    pthread_mutex_unlock(&g->mu);
}

const mtrl_model *mtrl_learner_ranks_test_model(const mtrl_learner_ranks *g, int rank) {
    MTRL_CHECKF(rank >= 0 && rank < g->R, "rank %d of %d", rank, g->R);
    return g->rk[rank].m;
}

int mtrl_learner_ranks_expert_parallel(const mtrl_learner_ranks *g) { return g->ep; }

// ---- ranks as processes (the zmq backend) --------------------------------------------------------
//
// A job travels from rank 0 as two broadcasts: a fixed header, then (when it has one) its
// payload. Every rank runs it, then the ranks allgather one status record each, so rank 0
// names a follower's own error (a shard it could not write) as the threads' combine_ does.
// The configuration and algorithm go as their raw structs: every rank runs the same build
// (the header carries their sizes, checked), and the learner's stage may have changed them.

typedef struct wire_job_ {
    char magic[4];           // "MTJB"
    uint32_t kind;           // job_kind
    uint64_t payload;        // bytes of the payload broadcast after this header (0: none)
    double lr;               // JOB_SFT
    int32_t n;               // episodes (JOB_RL, JOB_SFT)
    uint32_t cfg_bytes;      // sizeof(mtrl_config) on rank 0 (steps)
    uint32_t algo_bytes;     // sizeof(mtrl_algo_config) on rank 0 (JOB_RL)
    uint8_t reserved[28];
} wire_job_;
_Static_assert(sizeof(wire_job_) == 64, "the job header is 64 bytes");

typedef struct wire_status_ {
    int32_t st;
    char msg[MTRL_ERROR_MSG_MAX - 4];
} wire_status_;

// Every rank's status of the job just run (k's own in k->st / k->err) into g->rk[*].st / .err.
// A failed exchange (the world died in the job) leaves only this rank's, or the exchange's error.
static void exchange_status_(mtrl_learner_ranks *g, rank_ *k) {
    wire_status_ *all = xcalloc((size_t)g->R, sizeof *all);
    wire_status_ mine = {.st = (int32_t)k->st};
    snprintf(mine.msg, sizeof mine.msg, "%.1000s", k->st == MTRL_OK ? "" : k->err.msg);
    mtrl_error e = {0};
    if (mtrl_dist_comm_allgather(k->comm, &mine, all, sizeof mine, &e) == MTRL_OK) {
        for (int r = 0; r < g->R; r++) {
            g->rk[r].st = (mtrl_status)all[r].st;
            snprintf(g->rk[r].err.msg, sizeof g->rk[r].err.msg, "%s", all[r].msg);
        }
    } else if (k->st == MTRL_OK) {
        k->st = e.code;
        k->err = e;
    }
    free(all);
}

static void put_traj_(mtrl_wbuf *b, const mtrl_traj *t) {
    // A demonstration of the warm-up may still be OPEN, which the encoding does not carry: it
    // goes as complete with a flag that restores it.
    mtrl_traj c = *t;
    uint8_t open = c.status == MTRL_EP_OPEN;
    if (open) c.status = MTRL_EP_COMPLETE;
    mtrl_wbuf one;
    mtrl_wbuf_init(&one);
    mtrl_traj_encode(&one, &c);
    mtrl_wbuf_u8(b, open);
    mtrl_wbuf_u64(b, one.len);
    mtrl_wbuf_bytes(b, one.data, one.len);
    mtrl_wbuf_free(&one);
}

static mtrl_status post_proc_(mtrl_learner_ranks *g, const job_ *j, mtrl_error *err) {
    rank_ *k0 = &g->rk[0];
    wire_job_ h = {.magic = {'M', 'T', 'J', 'B'}, .kind = (uint32_t)j->kind, .lr = j->lr, .n = j->n};
    mtrl_wbuf pay;
    mtrl_wbuf_init(&pay);
    if (j->kind == JOB_RL || j->kind == JOB_SFT) {
        h.cfg_bytes = sizeof *j->cfg;
        mtrl_wbuf_bytes(&pay, j->cfg, sizeof *j->cfg);
        if (j->kind == JOB_RL) {
            h.algo_bytes = sizeof *j->algo;
            mtrl_wbuf_bytes(&pay, j->algo, sizeof *j->algo);
        }
        for (int i = 0; i < j->n; i++) put_traj_(&pay, j->eps[i]);
    } else if (j->kind == JOB_SAVE) {
        mtrl_wbuf_bytes(&pay, j->index, strlen(j->index) + 1);
    }
    h.payload = pay.len;
    mtrl_error e = {0};
    mtrl_status s = mtrl_dist_comm_broadcast(k0->comm, &h, sizeof h, 0, &e);
    if (s == MTRL_OK && pay.len) s = mtrl_dist_comm_broadcast(k0->comm, pay.data, pay.len, 0, &e);
    mtrl_wbuf_free(&pay);
    g->last_post = mtrl_time_mono();
    if (s != MTRL_OK) {
        g->dead = 1;
        mtrl_error_set(err, s, "learner rank 0 of %d: posting the %s to the other ranks: %.800s", g->R,
                       job_name_[j->kind], e.msg);
        snprintf(g->why_dead, sizeof g->why_dead, "%s", err->msg);
        return s;
    }
    if (j->kind == JOB_STOP || j->kind == JOB_BEAT) return MTRL_OK;
    mtrl_error e0 = {0};
    k0->st = rank_job_(k0, j, &e0);
    k0->err = e0;
    exchange_status_(g, k0);
    g->last_post = mtrl_time_mono();
    s = combine_(g, job_name_[j->kind], err);
    if (s != MTRL_OK && (j->kind == JOB_RL || j->kind == JOB_SFT)) {
        g->dead = 1;
        snprintf(g->why_dead, sizeof g->why_dead, "%s", err->msg);
    }
    return s;
}

mtrl_status mtrl_learner_ranks_init_process(mtrl_learner_ranks **out, mtrl_model *m, const mtrl_config *cfg, int rank,
                                            int world, const mtrl_dist_rendezvous *rv, mtrl_error *err) {
    *out = NULL;
    if (world < 2 || world > MTRL_DIST_RANKS_MAX || rank < 0 || rank >= world)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "learner ranks: rank %d of %d processes (2 .. %d ranks)", rank, world,
                              MTRL_DIST_RANKS_MAX);
    if (m->device != MTRL_DEVICE_CPU || strcmp(cfg->model.device, "cpu") != 0)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "%s: [model] device = %s: learner ranks as processes of a launcher run "
                              "on the CPU only (the zmq backend; GPUs need NCCL between processes, docs/multi-gpu.md §3)",
                              cfg->path, cfg->model.device);
    mtrl_status s = mtrl_learner_ranks_check_ep(cfg, &m->dims, err);
    if (s != MTRL_OK) return s;
    mtrl_learner_ranks *g = xcalloc(1, sizeof *g);
    g->R = world;
    g->proc = 1;
    g->me = rank;
    g->ep = cfg->learner.expert_parallel != 0;
    g->device = MTRL_DEVICE_CPU;
    g->threads = mtrl_config_threads(cfg); // each process has its own share of its node
    omp_set_num_threads(g->threads);
    g->timeout_ms = (int)cfg->learner.rank_timeout_ms;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    rank_ *k = &g->rk[rank];
    *k = (rank_){.g = g, .rank = rank, .gpu = -1, .m = m};
    // Processes start at their own pace (rank 0 opens its store and loads its checkpoint
    // first): the join waits at least a minute whatever the collectives' timeout.
    int join_ms = g->timeout_ms > 60000 ? g->timeout_ms : 60000;
    s = mtrl_dist_comm_init_zmq(&k->comm, world, rank, rv, join_ms, g->timeout_ms, err);
    // Rank 0's whole state (parameters, moments, β, step, version), which every follower loads:
    // the replicas start equal, whatever rank 0 was loaded from.
    void *blob = NULL;
    size_t len = 0;
    if (s == MTRL_OK && rank == 0) s = mtrl_model_save(m, NULL, &blob, &len, 1, NULL, 0, err);
    uint64_t n = len;
    if (s == MTRL_OK) s = mtrl_dist_comm_broadcast(k->comm, &n, sizeof n, 0, err);
    if (s == MTRL_OK && rank > 0) blob = xmalloc(n ? (size_t)n : 1);
    if (s == MTRL_OK) s = mtrl_dist_comm_broadcast(k->comm, blob, (size_t)n, 0, err);
    if (s == MTRL_OK && rank > 0) {
        mtrl_ckpt c;
        mtrl_status ls = mtrl_ckpt_open_mem(&c, blob, (size_t)n, &k->err);
        if (ls == MTRL_OK) {
            ls = mtrl_model_load(m, &c, 1, &k->err);
            mtrl_ckpt_close(&c);
        }
        k->st = ls;
    }
    free(blob);
    if (s == MTRL_OK && k->st == MTRL_OK) {
        k->st = g->ep ? mtrl_dist_dp_init_ep(&k->dp, k->comm, m, &k->err) : mtrl_dist_dp_init(&k->dp, k->comm, m, &k->err);
        k->have_dp = k->st == MTRL_OK;
    }
    if (s == MTRL_OK) {
        exchange_status_(g, k);
        s = combine_(g, "start", err);
    }
    if (s != MTRL_OK) {
        g->dead = 1; // no stop to post: the others fail on their own
        mtrl_learner_ranks_free(g);
        return s;
    }
    g->last_post = mtrl_time_mono();
    *out = g;
    return MTRL_OK;
}

static void free_proc_(mtrl_learner_ranks *g) {
    if (g->me == 0 && g->rk[0].comm && !g->dead) {
        job_ stop = {.kind = JOB_STOP};
        mtrl_error e = {0};
        if (post_proc_(g, &stop, &e) != MTRL_OK) LOG_WARN("%s", e.msg);
    }
    rank_teardown_(&g->rk[g->me]); // the model stays the caller's
    pthread_cond_destroy(&g->cv);
    pthread_mutex_destroy(&g->mu);
    free(g);
}

int mtrl_learner_ranks_rank(const mtrl_learner_ranks *g) { return g->me; }

mtrl_status mtrl_learner_ranks_heartbeat(mtrl_learner_ranks *g, mtrl_error *err) {
    if (!g || !g->proc || g->me != 0 || g->dead) return MTRL_OK;
    double period = g->timeout_ms / 4 < 5000 ? g->timeout_ms / 4000.0 : 5.0;
    if (mtrl_time_mono() - g->last_post < period) return MTRL_OK;
    job_ beat = {.kind = JOB_BEAT};
    return post_proc_(g, &beat, err);
}

// The episodes of a step's payload p[0..len) after the raw structs.
static mtrl_status get_trajs_(const uint8_t *p, size_t len, int n, mtrl_traj *t, mtrl_error *err) {
    mtrl_traj_limits lim = mtrl_traj_limits_default();
    // rank 0 took these episodes in under its own limits: nothing here is smaller.
    lim.max_tokens = UINT64_MAX / 2;
    lim.max_chunk_tokens = lim.max_tool_calls = lim.max_tool_bytes = lim.max_string = UINT32_MAX / 2;
    lim.max_routing_width = lim.max_turns = lim.max_images = UINT32_MAX / 2;
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        uint64_t one;
        if (len - at < 9) return mtrl_error_set(err, MTRL_ERR_FORMAT, "episode %d of %d: the payload ends", i, n);
        uint8_t open = p[at];
        memcpy(&one, p + at + 1, 8);
        at += 9;
        if (one > len - at) return mtrl_error_set(err, MTRL_ERR_FORMAT, "episode %d of %d: %llu bytes past the payload", i, n,
                                                   (unsigned long long)one);
        mtrl_status s = mtrl_traj_decode(&t[i], p + at, (size_t)one, &lim, err);
        if (s != MTRL_OK) return mtrl_error_wrap(err, "episode %d of %d", i, n);
        if (open) t[i].status = MTRL_EP_OPEN;
        at += (size_t)one;
    }
    return at == len ? MTRL_OK : mtrl_error_set(err, MTRL_ERR_FORMAT, "%zu bytes after the episodes", len - at);
}

// One job from rank 0 decoded and run on this follower; *stop set on the stop job.
static mtrl_status follow_one_(mtrl_learner_ranks *g, int *stop, mtrl_error *err) {
    rank_ *k = &g->rk[g->me];
    wire_job_ h;
    memset(&h, 0, sizeof h);
    mtrl_status s = mtrl_dist_comm_broadcast(k->comm, &h, sizeof h, 0, err);
    if (s != MTRL_OK)
        return mtrl_error_wrap(err, "learner rank %d of %d, waiting for rank 0's next job (rank 0 posts one at least "
                               "every %d ms while it runs)", g->me, g->R, g->timeout_ms / 4 < 5000 ? g->timeout_ms / 4 : 5000);
    if (memcmp(h.magic, "MTJB", 4) != 0 || h.kind < JOB_RL || h.kind > JOB_BEAT)
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "learner rank %d of %d: rank 0 sent a job header that is not one "
                              "(kind %u)", g->me, g->R, h.kind);
    if (h.kind == JOB_STOP) {
        *stop = 1;
        return MTRL_OK;
    }
    if (h.kind == JOB_BEAT) return MTRL_OK;
    uint8_t *p = xmalloc(h.payload ? (size_t)h.payload : 1);
    if (h.payload && (s = mtrl_dist_comm_broadcast(k->comm, p, (size_t)h.payload, 0, err)) != MTRL_OK) {
        free(p);
        return mtrl_error_wrap(err, "learner rank %d of %d, receiving the %s", g->me, g->R, job_name_[h.kind]);
    }
    job_ j = {.kind = (job_kind)h.kind, .n = h.n, .lr = h.lr};
    mtrl_config *cfg = NULL;
    mtrl_algo_config algo;
    mtrl_traj *t = NULL;
    mtrl_traj **eps = NULL;
    mtrl_error je = {0};
    mtrl_status js = MTRL_OK;
    if (j.kind == JOB_RL || j.kind == JOB_SFT) {
        size_t fixed = (size_t)h.cfg_bytes + h.algo_bytes;
        if (h.cfg_bytes != sizeof *cfg || (j.kind == JOB_RL && h.algo_bytes != sizeof algo) || fixed > h.payload || h.n < 0)
            js = mtrl_error_set(&je, MTRL_ERR_MISMATCH, "rank 0's %s has a configuration of %u bytes and an algorithm of "
                                "%u, this build's are %zu and %zu: every rank must run the same mtrl", job_name_[j.kind],
                                h.cfg_bytes, h.algo_bytes, sizeof *cfg, sizeof algo);
        if (js == MTRL_OK) {
            cfg = xmalloc(sizeof *cfg);
            memcpy(cfg, p, sizeof *cfg);
            if (j.kind == JOB_RL) memcpy(&algo, p + h.cfg_bytes, sizeof algo);
            t = xcalloc((size_t)(h.n ? h.n : 1), sizeof *t);
            eps = xcalloc((size_t)(h.n ? h.n : 1), sizeof *eps);
            for (int i = 0; i < h.n; i++) mtrl_traj_init(&t[i]), eps[i] = &t[i];
            js = get_trajs_(p + fixed, (size_t)h.payload - fixed, h.n, t, &je);
            j.cfg = cfg;
            j.algo = &algo;
            j.eps = eps;
        }
    } else if (j.kind == JOB_SAVE) {
        if (!h.payload || p[h.payload - 1] != 0)
            js = mtrl_error_set(&je, MTRL_ERR_FORMAT, "a checkpoint job without its index path");
        j.index = (const char *)p;
    }
    if (js == MTRL_OK) js = rank_job_(k, &j, &je);
    else js = mtrl_error_wrap(&je, "rank 0's %s", job_name_[j.kind]);
    k->st = js;
    k->err = je;
    exchange_status_(g, k);
    for (int i = 0; t && i < h.n; i++) mtrl_traj_free(&t[i]);
    free(t);
    free(eps);
    free(cfg);
    free(p);
    if (k->st != MTRL_OK && (j.kind == JOB_RL || j.kind == JOB_SFT || js == MTRL_OK)) {
        // A failed step (or a world that died in the exchange) ends the world: stop here.
        g->dead = 1;
        return mtrl_error_set(err, k->st, "learner rank %d of %d failed its %s: %.800s", g->me, g->R,
                              job_name_[j.kind], k->err.msg);
    }
    if (js != MTRL_OK) LOG_ERROR("learner rank %d of %d failed its %s: %.800s", g->me, g->R, job_name_[j.kind], je.msg);
    return MTRL_OK;
}

mtrl_status mtrl_learner_ranks_follow(mtrl_learner_ranks *g, long *jobs, mtrl_error *err) {
    MTRL_CHECKF(g->proc && g->me > 0, "mtrl_learner_ranks_follow on rank %d (proc %d)", g->me, g->proc);
    int stop = 0;
    if (jobs) *jobs = 0;
    while (!stop) {
        mtrl_status s = follow_one_(g, &stop, err);
        if (s != MTRL_OK) return s;
        if (jobs && !stop) (*jobs)++;
    }
    return MTRL_OK;
}

mtrl_status mtrl_learner_ranks_check_launch(const mtrl_config *cfg, const mtrl_dist_launch *l, mtrl_error *err) {
    char why[400];
    if (mtrl_config_ranks(cfg, NULL, why, sizeof why) < 0) return mtrl_error_set(err, MTRL_ERR_USAGE, "%s: %s", cfg->path, why);
    const char *world_var = !strcmp(l->source, "slurm") ? "SLURM_NTASKS" : "WORLD_SIZE";
    if (cfg->learner.ranks && cfg->learner.ranks != l->world)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "%s: [learner] ranks = %ld, but the launch (%s) says %s = %d: the "
                              "launcher's processes are the ranks (set ranks = %d, or leave it unset)", cfg->path,
                              cfg->learner.ranks, l->source, world_var, l->world, l->world);
    if (strcmp(cfg->model.device, "cpu") != 0)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "%s: [model] device = %s under a launch of %d processes (%s): learner "
                              "ranks as processes run on the CPU only today (the zmq backend; the GPU path, NCCL "
                              "between processes, is not built: docs/multi-gpu.md §3)", cfg->path, cfg->model.device,
                              l->world, l->source);
    return MTRL_OK;
}
