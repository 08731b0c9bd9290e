// dist_dp.c: the data-parallel learner step (dist_dp.h) over the per-rank parts of train.c.
//
// One data path for both devices: the padded blocks live where the model computes (the
// backend's memory: host on the CPU, the GPU's on CUDA) and move through the backend's copies,
// which on the CPU are the memcpy the CPU step always ran. The step's host arrays (log-probs,
// counts, loads, QB sums) go to the communicator as they are when its buffers are host memory,
// and through a device block of the backend when they are device memory. Before each collective
// on a GPU the backend is synchronised: the communicator may read the blocks from another
// stream (NCCL's), and returns only once its results are in them.
#include "learner/dist_dp.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/timeutil.h"
#include "learner/train_rank.h"
#include "model/backend.h"

// The reduce-scatter sums fp32: the learner's blocks are `real` of the fp32 build.
_Static_assert(sizeof(real) == sizeof(float), "the data-parallel step reduces fp32 gradient blocks");

// What both inits check and set: the communicator's memory against the model's.
static mtrl_status init_comm_(mtrl_dist_dp *dp, mtrl_dist_comm *comm, const mtrl_model *m, mtrl_error *err) {
    memset(dp, 0, sizeof *dp);
    if (m->inference)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "data-parallel step: an inference model has no gradients to reduce");
    int gpu = mtrl_dist_comm_gpu(comm);
    if (m->device == MTRL_DEVICE_CPU && gpu >= 0)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "data-parallel step: a CPU model needs a communicator of host buffers "
                              "(mtrl_dist_comm_init_local), got a %s one of GPU %d's memory",
                              mtrl_dist_comm_backend(comm), gpu);
    if (m->device == MTRL_DEVICE_CUDA && gpu != m->gpu)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "data-parallel step: a model on GPU %d needs a communicator of that "
                              "GPU's memory (mtrl_dist_comm_init_local_device or _init_nccl on GPU %d), got a %s one of %s",
                              m->gpu, m->gpu, mtrl_dist_comm_backend(comm), gpu < 0 ? "host memory" : "another GPU's");
    dp->comm = comm;
    dp->be = m->be;
    dp->device_buffers = gpu >= 0;
    dp->rank = mtrl_dist_comm_rank(comm);
    dp->ranks = mtrl_dist_comm_ranks(comm);
    return MTRL_OK;
}

// The ZeRO layout the reduce-scatter and all-gather run over: the whole block's, or with
// expert parallel the non-expert block's.
static const mtrl_dist_shards *zero_shards_(const mtrl_dist_dp *dp) { return dp->ep ? &dp->layout.dense : &dp->shards; }

// The padded blocks of the layout and the QB sums.
static void init_buffers_(mtrl_dist_dp *dp, const mtrl_model *m) {
    const mtrl_dist_shards *sh = zero_shards_(dp);
    mtrl_backend *be = dp->be;
    dp->send = be->alloc(be, sh->padded);
    dp->gather = be->alloc(be, sh->padded);
    dp->shard = be->alloc(be, sh->shard_bytes);
    be->zero(be, dp->send, sh->padded); // the padding past the block stays zero
    be->zero(be, dp->gather, sh->padded);
    be->zero(be, dp->shard, sh->shard_bytes);
    be->sync(be);
    size_t LE = (size_t)m->dims.L * (size_t)m->dims.E;
    dp->qb = xcalloc(2 * LE + (size_t)m->dims.L, sizeof(double));
}

mtrl_status mtrl_dist_dp_init(mtrl_dist_dp *dp, mtrl_dist_comm *comm, const mtrl_model *m, mtrl_error *err) {
    mtrl_status s = init_comm_(dp, comm, m, err);
    if (s != MTRL_OK) return s;
    if ((s = mtrl_dist_shards_make(&dp->shards, &m->params, dp->ranks, MTRL_DIST_SHARD_ALIGN, err)) != MTRL_OK) return s;
    init_buffers_(dp, m);
    return MTRL_OK;
}

mtrl_status mtrl_dist_dp_init_ep(mtrl_dist_dp *dp, mtrl_dist_comm *comm, mtrl_model *m, mtrl_error *err) {
    if (m->device != MTRL_DEVICE_CPU) {
        memset(dp, 0, sizeof *dp);
        return mtrl_error_set(err, MTRL_ERR_USAGE, "data-parallel step with expert parallel: the model is on GPU %d; "
                              "only CPU models over the local backend run it (a GPU needs the exchange over NCCL on "
                              "device buffers: docs/multi-gpu.md §3)", m->gpu);
    }
    mtrl_status s = init_comm_(dp, comm, m, err);
    if (s != MTRL_OK) return s;
    if (m->dims.n_moe == 0)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "data-parallel step with expert parallel: the model has no MoE layer");
    mtrl_dist_experts x;
    if ((s = mtrl_dist_experts_make(&x, m->dims.E, dp->ranks, err)) != MTRL_OK) return s;
    if ((s = mtrl_dist_ep_layout_make(&dp->layout, &m->params, &x, MTRL_DIST_SHARD_ALIGN, err)) != MTRL_OK) return s;
    if ((s = mtrl_dist_ep_wire_init(&dp->wire, m, &x, comm, err)) != MTRL_OK) {
        mtrl_dist_ep_layout_free(&dp->layout);
        return s;
    }
    dp->ep = 1;
    init_buffers_(dp, m);
    // Rank 0 receives every other rank's experts; another rank packs its own (ep_gather_experts_).
    size_t xb = dp->rank == 0 ? dp->layout.expert_total - dp->layout.rank[0].expert_bytes : dp->layout.rank[dp->rank].expert_bytes;
    dp->xbuf = xmalloc(xb ? xb : 1);
    dp->xcount = xmalloc(sizeof(int64_t) * 4 * (size_t)dp->ranks);
    return MTRL_OK;
}

void mtrl_dist_dp_free(mtrl_dist_dp *dp) {
    mtrl_backend *be = dp->be;
    mtrl_dist_shards_free(&dp->shards);
    if (dp->ep) {
        mtrl_dist_ep_wire_free(&dp->wire);
        mtrl_dist_ep_layout_free(&dp->layout);
    }
    if (be) {
        be->release(be, dp->send);
        be->release(be, dp->gather);
        be->release(be, dp->shard);
        be->release(be, dp->tmp);
    }
    free(dp->qb);
    free(dp->xbuf);
    free(dp->xcount);
    memset(dp, 0, sizeof *dp);
}

// All-reduce of the host array h[count] (the step's statistics, counts, loads): as it is over a
// communicator of host buffers, through the device block tmp over one of device buffers.
static mtrl_status host_allreduce_(mtrl_dist_dp *dp, void *h, size_t count, mtrl_dtype dtype, mtrl_error *err) {
    if (!dp->device_buffers) return mtrl_dist_comm_allreduce(dp->comm, h, count, dtype, err);
    mtrl_backend *be = dp->be;
    size_t bytes = count * mtrl_dtype_size(dtype);
    if (bytes > dp->tmp_bytes) {
        be->release(be, dp->tmp);
        dp->tmp_bytes = bytes + bytes / 4 + 256;
        dp->tmp = be->alloc(be, dp->tmp_bytes);
    }
    be->upload(be, dp->tmp, h, bytes);
    be->sync(be);
    mtrl_status s = mtrl_dist_comm_allreduce(dp->comm, dp->tmp, count, dtype, err);
    if (s == MTRL_OK) be->download(be, h, dp->tmp, bytes);
    return s;
}

// Bytes [begin, end) of the block that this rank owns, end clipped at the block's size.
static void own_range_(const mtrl_dist_dp *dp, size_t *begin, size_t *end) {
    const mtrl_dist_shard *sh = &dp->shards.rank[dp->rank];
    *begin = sh->begin < dp->shards.total ? sh->begin : dp->shards.total;
    *end = sh->end < dp->shards.total ? sh->end : dp->shards.total;
}

// The episodes of this rank in the token split, in batch order (*idx malloc'ed).
static mtrl_status own_episodes_(const mtrl_dist_dp *dp, mtrl_traj *const *eps, int n, int **idx, int *k,
                                 mtrl_error *err) {
    int *len = xmalloc(sizeof(int) * (size_t)(n ? n : 1));
    for (int i = 0; i < n; i++) len[i] = (int)eps[i]->n_tokens;
    mtrl_dist_split sp;
    mtrl_status s = mtrl_dist_split_make(&sp, n, len, dp->ranks, 0, err);
    free(len);
    if (s != MTRL_OK) return s;
    *k = sp.first[dp->rank + 1] - sp.first[dp->rank];
    *idx = xmalloc(sizeof(int) * (size_t)(*k ? *k : 1));
    memcpy(*idx, sp.order + sp.first[dp->rank], sizeof(int) * (size_t)*k);
    mtrl_dist_split_free(&sp);
    return MTRL_OK;
}

// The ranks' own counts (what each computed from its share), added, against what every rank
// computed from the whole batch: a difference means they were not given the same batch.
static mtrl_status counts_check_(mtrl_dist_dp *dp, double own_a, double own_b, double whole_a, double whole_b,
                                 const char *what, mtrl_error *err) {
    double c[2] = {own_a, own_b};
    mtrl_status s = host_allreduce_(dp, c, 2, MTRL_DT_F64, err);
    if (s != MTRL_OK) return s;
    if (c[0] != whole_a || c[1] != whole_b)
        return mtrl_error_set(err, MTRL_ERR_MISMATCH, "data-parallel step on rank %d of %d: the ranks' shares hold %.0f %s "
                              "and %.0f episodes, the batch %.0f and %.0f: the ranks were given different batches",
                              dp->rank, dp->ranks, c[0], what, c[1], whole_a, whole_b);
    return MTRL_OK;
}

// Steps 3 to 5 of dist_dp.h: reduce-scatter of the gradients, the global norm, AdamW on the
// own shard, all-gather of the parameters. Returns the norm before clipping in *norm.
// The blocks are the backend's (device memory on a GPU): m->d_grads and m->d_params, which on
// the CPU are m->grads and m->params.base.
static mtrl_status sharded_adamw_(mtrl_dist_dp *dp, mtrl_model *m, const mtrl_train_adamw *o, double *norm,
                                  mtrl_error *err) {
    mtrl_backend *be = dp->be;
    const mtrl_dist_shards *sh = &dp->shards;
    size_t lo, hi;
    own_range_(dp, &lo, &hi);
    be->copy(be, dp->send, m->d_grads, sh->total); // the padding past the block stays zero
    be->sync(be);
    mtrl_status s = mtrl_dist_comm_reduce_scatter(dp->comm, (const float *)dp->send, dp->shard,
                                                  sh->shard_bytes / sizeof(float), err);
    if (s != MTRL_OK) return s;
    be->copy(be, (char *)m->d_grads + lo, dp->shard, hi - lo);
    const mtrl_dist_shard *own = &sh->rank[dp->rank];
    double sq = 0; // each piece's sum of squares comes back to the host (backend.h grad_sq_norm)
    for (int p = own->first_piece; p < own->first_piece + own->n_piece; p++)
        sq += mtrl_model_grad_sq_range(m, sh->piece[p].tensor, sh->piece[p].begin, sh->piece[p].end);
    if ((s = host_allreduce_(dp, &sq, 1, MTRL_DT_F64, err)) != MTRL_OK) return s;
    *norm = sqrt(sq);
    real scale = mtrl_model_clip_scale(*norm, o->clip);
    m->step++;
    for (int p = own->first_piece; p < own->first_piece + own->n_piece; p++)
        mtrl_model_adamw_range(m, sh->piece[p].tensor, sh->piece[p].begin, sh->piece[p].end, scale, o->lr, o->beta1,
                               o->beta2, o->eps, o->weight_decay);
    char *mine = dp->gather + own->begin;
    be->copy(be, mine, (char *)m->d_params + lo, hi - lo);
    be->sync(be);
    if ((s = mtrl_dist_comm_allgather(dp->comm, mine, dp->gather, sh->shard_bytes, err)) != MTRL_OK) return s;
    be->copy(be, m->d_params, dp->gather, sh->total);
    mtrl_model_params_changed(m); // also waits for the copy
    return MTRL_OK;
}

// A non-expert piece's bytes, and where it starts in the model's blocks (*block) and in the
// non-expert block (*dense).
static size_t piece_at_(const mtrl_dist_ep_layout *L, const mtrl_tt *t, const mtrl_dist_piece *p, size_t *block,
                        size_t *dense) {
    size_t es = mtrl_dtype_size(t->items[p->tensor].dtype);
    *block = t->items[p->tensor].offset + p->begin * es;
    *dense = L->dense_offset[p->tensor] + p->begin * es;
    return (p->end - p->begin) * es;
}

// Step 5's end with expert parallel: every rank's new expert rows onto rank 0, the rank that
// publishes the weights and writes the full parameter file (dist_dp.h). One all-to-all-v of
// bytes in which only the sends to rank 0 are not empty; the other ranks keep their stale
// copies of the others' experts (unread). dp->xbuf: on rank 0 every other rank's experts, rank
// by rank in the layout's piece order; on another rank its own, packed.
static mtrl_status ep_gather_experts_(mtrl_dist_dp *dp, mtrl_model *m, mtrl_error *err) {
    const mtrl_dist_ep_layout *L = &dp->layout;
    const mtrl_tt *t = &m->params;
    char *params = m->d_params;
    int64_t *cnt = dp->xcount, *sc = cnt, *so = cnt + dp->ranks, *rc = cnt + 2 * dp->ranks, *ro = cnt + 3 * dp->ranks;
    memset(cnt, 0, sizeof(int64_t) * 4 * (size_t)dp->ranks);
    int64_t at = 0;
    for (int q = 1; q < dp->ranks; q++) {
        if (dp->rank == 0) rc[q] = (int64_t)L->rank[q].expert_bytes, ro[q] = at;
        at += (int64_t)L->rank[q].expert_bytes;
    }
    const mtrl_dist_ep_rank *er = &L->rank[dp->rank];
    if (dp->rank > 0) {
        sc[0] = (int64_t)er->expert_bytes;
        size_t o = 0;
        for (int j = er->first_piece; j < er->first_piece + er->n_expert_piece; j++) {
            size_t es = mtrl_dtype_size(t->items[L->piece[j].tensor].dtype), bytes = (L->piece[j].end - L->piece[j].begin) * es;
            memcpy(dp->xbuf + o, params + t->items[L->piece[j].tensor].offset + L->piece[j].begin * es, bytes);
            o += bytes;
        }
    }
    mtrl_status s = mtrl_dist_comm_alltoallv(dp->comm, dp->xbuf, sc, so, dp->xbuf, rc, ro, 1, err);
    if (s != MTRL_OK || dp->rank > 0) return s;
    size_t o = 0;
    for (int q = 1; q < dp->ranks; q++)
        for (int j = L->rank[q].first_piece; j < L->rank[q].first_piece + L->rank[q].n_expert_piece; j++) {
            size_t es = mtrl_dtype_size(t->items[L->piece[j].tensor].dtype), bytes = (L->piece[j].end - L->piece[j].begin) * es;
            memcpy(params + t->items[L->piece[j].tensor].offset + L->piece[j].begin * es, dp->xbuf + o, bytes);
            o += bytes;
        }
    return MTRL_OK;
}

// Steps 3 to 5 with expert-parallel ownership (dist_dp.h mtrl_dist_dp_init_ep): the
// non-expert tensors through their compact block (layout.dense_offset), the own experts as
// they are. CPU blocks (the backend's copies are memcpy there), as init_ep allows.
static mtrl_status ep_adamw_(mtrl_dist_dp *dp, mtrl_model *m, const mtrl_train_adamw *o, double *norm,
                             mtrl_error *err) {
    mtrl_backend *be = dp->be;
    const mtrl_dist_ep_layout *L = &dp->layout;
    const mtrl_dist_shards *sh = &L->dense;
    const mtrl_tt *t = &m->params;
    char *grads = m->d_grads, *params = m->d_params;
    for (int i = 0; i < t->n; i++)
        if (L->dense_offset[i] != SIZE_MAX)
            be->copy(be, dp->send + L->dense_offset[i], grads + t->items[i].offset, t->items[i].nbytes);
    be->sync(be);
    mtrl_status s = mtrl_dist_comm_reduce_scatter(dp->comm, (const float *)dp->send, dp->shard,
                                                  sh->shard_bytes / sizeof(float), err);
    if (s != MTRL_OK) return s;
    const mtrl_dist_shard *own = &sh->rank[dp->rank];
    for (int j = own->first_piece; j < own->first_piece + own->n_piece; j++) {
        size_t at, dn, bytes = piece_at_(L, t, &sh->piece[j], &at, &dn);
        be->copy(be, grads + at, (char *)dp->shard + (dn - own->begin), bytes);
    }
    // Every piece this rank owns: its experts' (complete from the exchange), then its shard.
    const mtrl_dist_ep_rank *er = &L->rank[dp->rank];
    double sq = 0;
    for (int j = er->first_piece; j < er->first_piece + er->n_piece; j++)
        sq += mtrl_model_grad_sq_range(m, L->piece[j].tensor, L->piece[j].begin, L->piece[j].end);
    if ((s = host_allreduce_(dp, &sq, 1, MTRL_DT_F64, err)) != MTRL_OK) return s;
    *norm = sqrt(sq);
    real scale = mtrl_model_clip_scale(*norm, o->clip);
    m->step++;
    for (int j = er->first_piece; j < er->first_piece + er->n_piece; j++)
        mtrl_model_adamw_range(m, L->piece[j].tensor, L->piece[j].begin, L->piece[j].end, scale, o->lr, o->beta1,
                               o->beta2, o->eps, o->weight_decay);
    for (int j = own->first_piece; j < own->first_piece + own->n_piece; j++) {
        size_t at, dn, bytes = piece_at_(L, t, &sh->piece[j], &at, &dn);
        be->copy(be, dp->gather + dn, params + at, bytes);
    }
    be->sync(be);
    if ((s = mtrl_dist_comm_allgather(dp->comm, dp->gather + own->begin, dp->gather, sh->shard_bytes, err)) != MTRL_OK)
        return s;
    for (int i = 0; i < t->n; i++)
        if (L->dense_offset[i] != SIZE_MAX)
            be->copy(be, params + t->items[i].offset, dp->gather + L->dense_offset[i], t->items[i].nbytes);
    s = ep_gather_experts_(dp, m, err);
    mtrl_model_params_changed(m);
    return s;
}

// The optimizer part of a step: plain ZeRO or with expert-parallel ownership.
static mtrl_status step_adamw_(mtrl_dist_dp *dp, mtrl_model *m, const mtrl_train_adamw *o, double *norm,
                               mtrl_error *err) {
    return dp->ep ? ep_adamw_(dp, m, o, norm, err) : sharded_adamw_(dp, m, o, norm, err);
}

// With expert parallel, the rounds of the others' passes served once this rank's are done
// (dist_ep_wire.h); always called, also after a failure, so that no peer waits on this rank's
// rounds; the first failure wins.
static mtrl_status ep_finish_(mtrl_dist_dp *dp, mtrl_status s, mtrl_error *err) {
    if (!dp->ep) return s;
    mtrl_error e = {0};
    mtrl_status f = mtrl_dist_ep_wire_finish(&dp->wire, &e);
    if (s == MTRL_OK && f != MTRL_OK) {
        if (err) *err = e;
        return f;
    }
    return s;
}

// Step 7: this step's routing loads and QB sums and counts, added over the ranks.
static mtrl_status qb_reduce_(mtrl_dist_dp *dp, mtrl_model *m, mtrl_error *err) {
    size_t L = (size_t)m->dims.L, LE = L * (size_t)m->dims.E;
    double *q = dp->qb;
    for (size_t i = 0; i < LE; i++) q[i] = (double)m->load[i], q[LE + i] = m->qb_sum[i];
    for (size_t l = 0; l < L; l++) q[2 * LE + l] = m->qb_count[l];
    mtrl_status s = host_allreduce_(dp, q, 2 * LE + L, MTRL_DT_F64, err);
    if (s != MTRL_OK) return s;
    for (size_t i = 0; i < LE; i++) m->load[i] = (long)q[i], m->qb_sum[i] = q[LE + i];
    for (size_t l = 0; l < L; l++) m->qb_count[l] = (int)q[2 * LE + l];
    return MTRL_OK;
}

mtrl_status mtrl_dist_dp_rl_step(mtrl_dist_dp *dp, mtrl_model *m, const mtrl_config *cfg, const mtrl_algo_config *a,
                                 mtrl_traj *const *eps, int n, mtrl_step_stats *st, mtrl_error *err) {
    double t_start = mtrl_time_mono();
    int *idx = NULL, k = 0;
    mtrl_status s = own_episodes_(dp, eps, n, &idx, &k, err);
    if (s != MTRL_OK) return s;
    mtrl_train_rl_batch b;
    mtrl_train_rl_batch_init(&b, m, cfg, a, eps, n, st);
    long own_mask = 0;
    for (int j = 0; j < k; j++)
        for (size_t t = b.off[idx[j]]; t < b.off[idx[j] + 1]; t++) own_mask += b.mask[t];
    s = counts_check_(dp, (double)own_mask, (double)k, (double)b.n_mask, (double)n, "loss tokens", err);
    mtrl_model_zero_grads(m);
    if (s == MTRL_OK && k) mtrl_train_rl_backward(m, cfg, a, eps, &b, idx, k);
    s = ep_finish_(dp, s, err);
    // Every token's log-prob and entropy is written on one rank and zero on the others.
    if (s == MTRL_OK) s = host_allreduce_(dp, b.logp, b.T + 1, MTRL_DT_F32, err);
    if (s == MTRL_OK) s = host_allreduce_(dp, b.ent, b.T + 1, MTRL_DT_F32, err);
    if (s == MTRL_OK) {
        memcpy(b.logp_old, b.logp, sizeof(float) * (b.T + 1)); // π_old: the learner's own log-prob (train.c)
        mtrl_train_rl_stats(a, &b, st);
        mtrl_train_adamw o = mtrl_train_adamw_of(cfg, cfg->learner.lr);
        s = step_adamw_(dp, m, &o, &st->grad_norm, err);
    }
    if (s == MTRL_OK) s = qb_reduce_(dp, m, err);
    if (s == MTRL_OK) mtrl_train_step_end(m, st);
    st->seconds = mtrl_time_mono() - t_start;
    mtrl_train_rl_batch_free(&b);
    free(idx);
    return s;
}

mtrl_status mtrl_dist_dp_sft_step(mtrl_dist_dp *dp, mtrl_model *m, const mtrl_config *cfg, mtrl_traj *const *eps,
                                  int n, double lr, double *loss, mtrl_error *err) {
    int *idx = NULL, k = 0;
    mtrl_status s = own_episodes_(dp, eps, n, &idx, &k, err);
    if (s != MTRL_OK) return s;
    mtrl_traj **own = xmalloc(sizeof *own * (size_t)(k ? k : 1));
    for (int j = 0; j < k; j++) own[j] = eps[idx[j]];
    size_t count = mtrl_train_sft_count(eps, n);
    s = counts_check_(dp, (double)mtrl_train_sft_count(own, k), (double)k, (double)count, (double)n, "MODEL tokens", err);
    free(own);
    mtrl_model_zero_grads(m);
    double sum = 0;
    if (s == MTRL_OK && k) sum = mtrl_train_sft_backward(m, cfg, eps, idx, k, count);
    s = ep_finish_(dp, s, err);
    if (s == MTRL_OK) s = host_allreduce_(dp, &sum, 1, MTRL_DT_F64, err);
    double norm = 0;
    mtrl_train_adamw o = mtrl_train_adamw_of(cfg, lr);
    if (s == MTRL_OK) s = step_adamw_(dp, m, &o, &norm, err);
    if (s == MTRL_OK) s = qb_reduce_(dp, m, err);
    if (s == MTRL_OK) mtrl_train_step_end(m, NULL);
    if (loss) *loss = count ? sum / (double)count : 0;
    free(idx);
    return s;
}
