// learner_follow.c: a learner rank > 0 as its own process (see learner_follow.h).
#include "learner/learner_follow.h"

#include <string.h>

#include "common/log.h"
#include "common/tokenizer.h"
#include "learner/learner_ranks.h"
#include "model/model.h"
#include "model/qb.h"

mtrl_status mtrl_learner_follow_run(const mtrl_config *cfg, const mtrl_dist_launch *l, mtrl_error *err) {
    if (l->rank <= 0 || l->world < 2)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "learner follower: rank %d of %d (a follower is a rank > 0)", l->rank,
                              l->world);
    mtrl_model_dims d;
    mtrl_status s = mtrl_model_dims_from_config(&d, cfg, MTRL_VOCAB, err);
    if (s != MTRL_OK) return mtrl_error_wrap(err, "%s", cfg->path);
    if (strcmp(cfg->model.device, "cpu") != 0)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "%s: [model] device = %s: learner ranks as processes of a launcher run "
                              "on the CPU only (docs/multi-gpu.md §3)", cfg->path, cfg->model.device);
    // Initialised as rank 0's is (the same seed), then overwritten with rank 0's whole state.
    mtrl_model m;
    s = mtrl_model_init_on(&m, &d, (uint64_t)cfg->run.seed, MTRL_DEVICE_CPU, 0, err);
    if (s != MTRL_OK) return s;
    mtrl_qb_set_mode(&m, cfg->learner.qb ? MTRL_QB_TRAIN : MTRL_QB_FROZEN);
    mtrl_dist_rendezvous rv = mtrl_dist_rendezvous_of(l);
    mtrl_learner_ranks *rk;
    s = mtrl_learner_ranks_init_process(&rk, &m, cfg, l->rank, l->world, &rv, err);
    if (s == MTRL_OK) {
        LOG_INFO("learner rank %d of %d: joined rank 0 at %s:%d, model %zu parameters", l->rank, l->world, rv.host, rv.port,
                 mtrl_model_param_count(&m));
        long jobs = 0;
        s = mtrl_learner_ranks_follow(rk, &jobs, err);
        if (s == MTRL_OK) LOG_INFO("learner rank %d of %d: rank 0 stopped the world after %ld jobs", l->rank, l->world, jobs);
        mtrl_learner_ranks_free(rk);
    }
    mtrl_model_free(&m);
    return s;
}
