// dist_ep_moe.c: one MoE layer expert parallel over a communicator's ranks (see dist_ep_moe.h).
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "learner/dist_ep_moe.h"
#include "model/backend.h"

// A backend block of this forward (the model_moe.h carve takes it as its allocator).
static void *ep_alloc_(void *user, size_t bytes) {
    mtrl_dist_ep_moe *e = user;
    MTRL_CHECKF(e->n_blk < MTRL_DIST_EP_MOE_BLOCKS, "expert-parallel layer: more than %d blocks",
                MTRL_DIST_EP_MOE_BLOCKS);
    return e->blk[e->n_blk++] = e->m->be->alloc(e->m->be, bytes);
}

static real *ep_rows_(mtrl_dist_ep_moe *e, int rows, int width) {
    return ep_alloc_(e, sizeof(real) * (size_t)rows * (size_t)width);
}

// Releases the blocks allocated after the first `keep`.
static void ep_release_(mtrl_dist_ep_moe *e, int keep) {
    while (e->n_blk > keep) e->m->be->release(e->m->be, e->blk[--e->n_blk]);
}

mtrl_status mtrl_dist_ep_moe_init(mtrl_dist_ep_moe *e, mtrl_model *m, int layer, const mtrl_dist_experts *x,
                                  mtrl_dist_comm *comm, mtrl_error *err) {
    memset(e, 0, sizeof *e);
    const mtrl_model_dims *d = &m->dims;
    int R = mtrl_dist_comm_ranks(comm);
    if (m->device != MTRL_DEVICE_CPU)
        return mtrl_error_set(err, MTRL_ERR_USAGE,
                              "expert-parallel MoE: the model is on a GPU; the layer runs CPU models on the local "
                              "communicator only (the device path over NCCL is not built)");
    if (layer < 0 || layer >= d->L || mtrl_model_is_dense(d, layer))
        return mtrl_error_set(err, MTRL_ERR_USAGE,
                              "expert-parallel MoE: layer %d is not a MoE layer (layers %d..%d are)", layer,
                              d->first_dense, d->L - 1);
    if (x->E != d->E)
        return mtrl_error_set(err, MTRL_ERR_USAGE,
                              "expert-parallel MoE: the assignment is of %d experts, the model's layers have %d", x->E,
                              d->E);
    if (x->ranks != R)
        return mtrl_error_set(err, MTRL_ERR_USAGE,
                              "expert-parallel MoE: the assignment is over %d ranks, the communicator has %d", x->ranks,
                              R);
    if (d->E > 256)
        return mtrl_error_set(err, MTRL_ERR_USAGE,
                              "expert-parallel MoE: %d experts (routing ids are bytes: at most 256)", d->E);
    e->m = m;
    e->comm = comm;
    e->layer = layer;
    e->rank = mtrl_dist_comm_rank(comm);
    e->ranks = R;
    e->experts = *x;
    e->e0 = x->first[e->rank];
    e->e1 = x->first[e->rank + 1];
    e->rows_all = xmalloc(sizeof(int64_t) * (size_t)R * (size_t)d->E);
    return MTRL_OK;
}

void mtrl_dist_ep_moe_free(mtrl_dist_ep_moe *e) {
    if (e->m) ep_release_(e, 0);
    free(e->rows_all);
    memset(e, 0, sizeof *e);
}

// dst[pos[i]] = src[i]: received rows (source-major) into the own experts' order, through the
// model's MoE gather with one slot a row.
static void to_experts_(mtrl_dist_ep_moe *e, const real *src, real *dst) {
    mtrl_backend *be = e->m->be;
    be->moe_gather(be, e->n_recv, 1, e->m->dims.d, e->pos, src, dst);
}

// dst[i] = src[pos[i]]: back to the received order, through the gather's backward (dst += the
// row, onto zeros: exact).
static void from_experts_(mtrl_dist_ep_moe *e, const real *src, real *dst) {
    mtrl_backend *be = e->m->be;
    be->zero(be, dst, sizeof(real) * (size_t)e->n_recv * (size_t)e->m->dims.d);
    be->moe_scatter_bwd(be, e->n_recv, 1, e->m->dims.d, e->pos, src, dst);
}

// This rank's rows grouped by expert to the experts' owners (to_owners) or the owners' rows back
// (the reverse exchange), rows of d reals.
static mtrl_status exchange_(mtrl_dist_ep_moe *e, int to_owners, const real *send, real *recv, mtrl_error *err) {
    size_t row = sizeof(real) * (size_t)e->m->dims.d;
    if (to_owners)
        return mtrl_dist_comm_alltoallv(e->comm, send, e->send_count, e->send_offset, recv, e->recv_count,
                                        e->recv_offset, row, err);
    return mtrl_dist_comm_alltoallv(e->comm, send, e->recv_count, e->recv_offset, recv, e->send_count, e->send_offset,
                                    row, err);
}

// Steps 3 and 4 of the forward's plan (dist_ep_moe.h): the counts, then where every row goes.
static mtrl_status plan_exchange_(mtrl_dist_ep_moe *e, mtrl_error *err) {
    const mtrl_model_dims *d = &e->m->dims;
    mtrl_backend *be = e->m->be;
    int E = d->E, own = e->e1 - e->e0;
    int off_h[257];
    int64_t mine[256], expert_rows[256];
    be->download(be, off_h, e->rows.offsets, sizeof(int) * (size_t)(E + 1));
    for (int x = 0; x < E; x++) mine[x] = off_h[x + 1] - off_h[x];
    mtrl_status st = mtrl_dist_comm_allgather(e->comm, mine, e->rows_all, sizeof(int64_t) * (size_t)E, err);
    if (st != MTRL_OK) return st;
    mtrl_dist_a2a_send(&e->experts, mine, e->send_count, e->send_offset);
    mtrl_dist_a2a_recv(&e->experts, e->rank, e->rows_all, e->recv_count, e->recv_offset, expert_rows);
    int64_t n = 0;
    for (int r = 0; r < e->ranks; r++) n += e->recv_count[r];
    e->n_recv = (int)n;
    int64_t *pos64 = xmalloc(sizeof(int64_t) * (size_t)n + 1);
    int *pos_h = xmalloc(sizeof(int) * (size_t)n + 1);
    mtrl_dist_a2a_expert_order(&e->experts, e->rank, e->rows_all, pos64);
    for (int64_t i = 0; i < n; i++) pos_h[i] = (int)pos64[i];
    e->pos = ep_alloc_(e, sizeof(int) * (size_t)n);
    be->upload(be, e->pos, pos_h, sizeof(int) * (size_t)n);
    int own_off[257];
    own_off[0] = 0;
    for (int j = 0; j < own; j++) own_off[j + 1] = own_off[j] + (int)expert_rows[j];
    e->offsets = ep_alloc_(e, sizeof(int) * (size_t)(own + 1));
    be->upload(be, e->offsets, own_off, sizeof(int) * (size_t)(own + 1));
    free(pos64);
    free(pos_h);
    return MTRL_OK;
}

mtrl_status mtrl_dist_ep_moe_fwd(mtrl_dist_ep_moe *e, int T, const real *x, const uint8_t *routing_in,
                                 uint8_t *routing_out, int level, real *y, mtrl_error *err) {
    mtrl_model *m = e->m;
    const mtrl_model_dims *d = &m->dims;
    int E = d->E, K = d->k, mi = mtrl_model_moe_index(d, e->layer);
    if (T < 0) return mtrl_error_set(err, MTRL_ERR_USAGE, "expert-parallel MoE: %d tokens", T);
    // A replayed id past E would send its row to no rank (the router takes the ids as given).
    for (int t = 0; routing_in && t < T; t++)
        for (int j = 0; j < K; j++) {
            int id = routing_in[((size_t)t * d->n_moe + mi) * K + j];
            if (id >= E)
                return mtrl_error_set(err, MTRL_ERR_USAGE,
                                      "expert-parallel MoE: layer %d: the replayed routing of token %d, slot %d, is "
                                      "expert %d of %d", e->layer, t, j, id, E);
        }
    ep_release_(e, 0);
    e->ready = 0;
    mtrl_model_moe_rows_carve(d, T, ep_alloc_, e, &e->rows);
    mtrl_model_moe_route_fwd(m, e->layer, T, x, routing_in, routing_out, &e->rows);
    mtrl_status st;
    if (level > 0) {
        // One all-reduce of loads, β sums and batches: every rank adds the same sums.
        double stats[MTRL_MODEL_MOE_STATS(256)];
        mtrl_model_moe_observe(m, e->layer, T, &e->rows, level, stats);
        st = mtrl_dist_comm_allreduce(e->comm, stats, (size_t)MTRL_MODEL_MOE_STATS(E), MTRL_DT_F64, err);
        if (st != MTRL_OK) return st;
        mtrl_model_moe_observe_add(m, e->layer, stats);
    }
    if ((st = plan_exchange_(e, err)) != MTRL_OK) return st;
    int n = e->n_recv;
    real *Xr = ep_rows_(e, n, d->d);
    if ((st = exchange_(e, 1, e->rows.X, Xr, err)) != MTRL_OK) return st;
    e->Xe = ep_rows_(e, n, d->d);
    to_experts_(e, Xr, e->Xe);
    e->u1 = ep_rows_(e, n, d->I);
    e->u3 = ep_rows_(e, n, d->I);
    real *Ye = ep_rows_(e, n, d->d);
    mtrl_model_moe_experts_fwd(m, e->layer, e->e0, e->e1, n, e->offsets, e->Xe, e->u1, e->u3, Ye);
    from_experts_(e, Ye, Xr); // Xr now holds the outputs in the received order
    if ((st = exchange_(e, 0, Xr, e->rows.Y, err)) != MTRL_OK) return st;
    real *ys = d->n_shared > 0 ? ep_rows_(e, T, d->d) : NULL;
    mtrl_model_moe_combine_fwd(m, e->layer, T, x, &e->rows, ys, y);
    e->T = T;
    e->x = x;
    e->ready = 1;
    return MTRL_OK;
}

mtrl_status mtrl_dist_ep_moe_bwd(mtrl_dist_ep_moe *e, const real *dy, real *dx, mtrl_error *err) {
    if (!e->ready)
        return mtrl_error_set(err, MTRL_ERR_STATE, "expert-parallel MoE: layer %d: a backward without its forward",
                              e->layer);
    mtrl_model *m = e->m;
    const mtrl_model_dims *d = &m->dims;
    int T = e->T, K = d->k, n = e->n_recv, keep = e->n_blk;
    e->ready = 0;
    real *dY = ep_rows_(e, T * K, d->d), *dw = ep_rows_(e, T, K), *dX = ep_rows_(e, T * K, d->d);
    real *dz = ep_rows_(e, T, d->E), *dxs = d->n_shared > 0 ? ep_rows_(e, T, d->d) : NULL;
    real *dYr = ep_rows_(e, n, d->d), *dYe = ep_rows_(e, n, d->d), *dXe = ep_rows_(e, n, d->d);
    mtrl_model_moe_combine_bwd(m, e->layer, T, &e->rows, dy, dY, dw);
    mtrl_status st = exchange_(e, 1, dY, dYr, err);
    if (st == MTRL_OK) {
        to_experts_(e, dYr, dYe);
        mtrl_model_moe_experts_bwd(m, e->layer, e->e0, e->e1, e->offsets, e->Xe, e->u1, e->u3, dYe, dXe);
        from_experts_(e, dXe, dYr); // dYr now holds the input-row gradients in the received order
        st = exchange_(e, 0, dYr, dX, err);
    }
    if (st == MTRL_OK) mtrl_model_moe_route_bwd(m, e->layer, T, e->x, &e->rows, dy, dX, dw, dz, dxs, dx);
    ep_release_(e, keep);
    return st;
}
