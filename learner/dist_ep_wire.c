// dist_ep_wire.c: the routed experts of a model's training passes expert parallel, in rounds
// (see dist_ep_wire.h).
#include "learner/dist_ep_wire.h"

#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "model/backend.h"
#include "model/model_moe.h"

enum { ROUND_NONE = 0, ROUND_FWD = 1, ROUND_BWD = 2 };

// p grown to hold n reals (its old contents dropped).
static real *ensure_(real *p, size_t *cap, size_t n) {
    if (n <= *cap && p) return p;
    free(p);
    *cap = n + n / 2 + 64;
    return xmalloc(sizeof(real) * *cap);
}

// The first failure is kept; every later round returns at once.
static void fail_(mtrl_dist_ep_wire *w, mtrl_status st) {
    if (w->status == MTRL_OK) w->status = st;
}

// Owner side of a round: one source's n rows X (and dY), grouped by this rank's experts, run as
// the source's header hq says (kind, layer, rows per expert); out [n][d] gets Y or dX.
static void serve_(mtrl_dist_ep_wire *w, const int64_t *hq, int n, const real *X, const real *dY, real *out) {
    mtrl_model *m = w->m;
    int own = w->e1 - w->e0, layer = (int)hq[1];
    int off[257];
    off[0] = 0;
    for (int j = 0; j < own; j++) off[j + 1] = off[j] + (int)hq[2 + w->e0 + j];
    MTRL_CHECKF(off[own] == n, "expert-parallel round: %d rows from the header, %d received", off[own], n);
    w->served += n;
    if (hq[0] == ROUND_FWD) {
        mtrl_model_moe_experts_fwd(m, layer, w->e0, w->e1, n, off, X, w->u1, w->u3, out);
        return;
    }
    // A backward: the experts' activations again from X (nothing is kept between rounds), then
    // their backward; the weight gradients of experts e0 .. e1-1 land in this rank's m->dG.
    mtrl_model_moe_experts_fwd(m, layer, w->e0, w->e1, n, off, X, w->u1, w->u3, w->y);
    mtrl_model_moe_experts_bwd(m, layer, w->e0, w->e1, off, X, w->u1, w->u3, dY, out);
}

// One round (dist_ep_wire.h): this rank asks `kind` for `rows` rows of layer `layer` grouped by
// expert (offsets [E+1]), X and, for a backward, dY; res [rows][d] gets Y or dX. Returns 0 when
// no rank asked anything (the round ended at its headers), 1 otherwise.
static int round_(mtrl_dist_ep_wire *w, int kind, int layer, int rows, const int *offsets, const real *X,
                  const real *dY, real *res) {
    mtrl_model *m = w->m;
    mtrl_backend *be = m->be;
    int E = w->E, R = w->ranks, D = m->dims.d, I = m->dims.I;
    size_t H = 2 + (size_t)E;
    if (w->status != MTRL_OK) {
        if (rows) memset(res, 0, sizeof(real) * (size_t)rows * D);
        return 0;
    }
    int64_t *h = w->hdr;
    memset(h, 0, sizeof(int64_t) * H);
    h[0] = kind;
    h[1] = layer;
    if (kind != ROUND_NONE) {
        int off[257];
        be->download(be, off, offsets, sizeof(int) * (size_t)(E + 1));
        for (int e = 0; e < E; e++) h[2 + e] = off[e + 1] - off[e];
    }
    mtrl_status st = mtrl_dist_comm_allgather(w->comm, h, w->hdr_all, sizeof(int64_t) * H, &w->err);
    if (st != MTRL_OK) goto failed;
    int active = 0, bwd = 0;
    for (int q = 0; q < R; q++) {
        active |= w->hdr_all[q * H] != ROUND_NONE;
        bwd |= w->hdr_all[q * H] == ROUND_BWD;
    }
    if (!active) return 0;
    w->rounds++;
    w->asked += kind != ROUND_NONE;
    int W = bwd ? 2 * D : D; // the round's row width: X, or X and dY side by side
    for (int q = 0; q < R; q++)
        for (int e = 0; e < E; e++) w->rows_all[(size_t)q * E + e] = w->hdr_all[q * H + 2 + (size_t)e];
    int64_t sc[MTRL_DIST_RANKS_MAX], so[MTRL_DIST_RANKS_MAX], rc[MTRL_DIST_RANKS_MAX], ro[MTRL_DIST_RANKS_MAX];
    int64_t expert_rows[256];
    mtrl_dist_a2a_send(&w->experts, h + 2, sc, so);
    mtrl_dist_a2a_recv(&w->experts, w->rank, w->rows_all, rc, ro, expert_rows);
    int64_t n = 0, most = 0;
    for (int q = 0; q < R; q++) {
        n += rc[q];
        if (rc[q] > most) most = rc[q];
    }
    // This rank's rows in the round's width (a forward alone sends X as it is).
    const real *sbuf = X;
    if (W != D || !X) {
        w->send = ensure_(w->send, &w->send_cap, (size_t)rows * W);
        if (rows) {
            be->copy_rows(be, rows, D, X, D, w->send, W);
            if (W != D) {
                if (dY) be->copy_rows(be, rows, D, dY, D, w->send + D, W);
                else for (int i = 0; i < rows; i++) memset(w->send + (size_t)i * W + D, 0, sizeof(real) * D);
            }
        }
        sbuf = w->send;
    }
    w->recv = ensure_(w->recv, &w->recv_cap, (size_t)n * W);
    w->out = ensure_(w->out, &w->out_cap, (size_t)n * D);
    st = mtrl_dist_comm_alltoallv(w->comm, sbuf, sc, so, w->recv, rc, ro, sizeof(real) * (size_t)W, &w->err);
    if (st != MTRL_OK) goto failed;
    // The received rows as contiguous [n][d] arrays of X and dY.
    const real *rx = w->recv, *rdy = NULL;
    if (W != D && n) {
        w->rx = ensure_(w->rx, &w->rx_cap, (size_t)n * D);
        w->rdy = ensure_(w->rdy, &w->rdy_cap, (size_t)n * D);
        be->copy_rows(be, (int)n, D, w->recv, W, w->rx, D);
        be->copy_rows(be, (int)n, D, w->recv + D, W, w->rdy, D);
        rx = w->rx;
        rdy = w->rdy;
    }
    size_t act = (size_t)most * (I > D ? I : D);
    if (act > w->act_cap || !w->u1) {
        free(w->u1), free(w->u3), free(w->y);
        w->act_cap = act + act / 2 + 64;
        w->u1 = xmalloc(sizeof(real) * w->act_cap);
        w->u3 = xmalloc(sizeof(real) * w->act_cap);
        w->y = xmalloc(sizeof(real) * w->act_cap);
    }
    for (int q = 0; q < R; q++) {
        if (!rc[q]) continue;
        size_t at = (size_t)ro[q] * D;
        serve_(w, w->hdr_all + q * H, (int)rc[q], rx + at, rdy ? rdy + at : NULL, w->out + at);
    }
    st = mtrl_dist_comm_alltoallv(w->comm, w->out, rc, ro, rows ? res : w->out, sc, so, sizeof(real) * (size_t)D,
                                  &w->err);
    if (st != MTRL_OK) goto failed;
    return 1;
failed:
    fail_(w, st);
    if (rows) memset(res, 0, sizeof(real) * (size_t)rows * D);
    return 0;
}

static void wire_fwd_(void *user, int layer, int rows, const int *offsets, const real *X, real *Y) {
    round_(user, ROUND_FWD, layer, rows, offsets, X, NULL, Y);
}

static void wire_bwd_(void *user, int layer, int rows, const int *offsets, const real *X, const real *dY, real *dX) {
    round_(user, ROUND_BWD, layer, rows, offsets, X, dY, dX);
}

mtrl_status mtrl_dist_ep_wire_init(mtrl_dist_ep_wire *w, mtrl_model *m, const mtrl_dist_experts *x,
                                   mtrl_dist_comm *comm, mtrl_error *err) {
    memset(w, 0, sizeof *w);
    const mtrl_model_dims *d = &m->dims;
    int R = mtrl_dist_comm_ranks(comm);
    if (mtrl_dist_comm_gpu(comm) >= 0)
        return mtrl_error_set(err, MTRL_ERR_USAGE,
                              "expert-parallel passes: the communicator's buffers are GPU %d's memory; a CPU model's "
                              "rounds take host buffers (mtrl_dist_comm_init_local)", mtrl_dist_comm_gpu(comm));
    if (x->E != d->E)
        return mtrl_error_set(err, MTRL_ERR_USAGE,
                              "expert-parallel passes: the assignment is of %d experts, the model's layers have %d",
                              x->E, d->E);
    if (x->ranks != R)
        return mtrl_error_set(err, MTRL_ERR_USAGE,
                              "expert-parallel passes: the assignment is over %d ranks, the communicator has %d",
                              x->ranks, R);
    if (d->E > 256)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "expert-parallel passes: %d experts (at most 256)", d->E);
    w->m = m;
    w->comm = comm;
    w->rank = mtrl_dist_comm_rank(comm);
    w->ranks = R;
    w->E = d->E;
    w->experts = *x;
    w->e0 = x->first[w->rank];
    w->e1 = x->first[w->rank + 1];
    w->fn = (mtrl_model_experts_fn){wire_fwd_, wire_bwd_, w};
    mtrl_status st = mtrl_model_set_experts(m, &w->fn, err);
    if (st != MTRL_OK) {
        memset(w, 0, sizeof *w);
        return st;
    }
    size_t H = 2 + (size_t)d->E;
    w->hdr = xcalloc(H, sizeof(int64_t));
    w->hdr_all = xcalloc(H * (size_t)R, sizeof(int64_t));
    w->rows_all = xcalloc((size_t)d->E * (size_t)R, sizeof(int64_t));
    return MTRL_OK;
}

void mtrl_dist_ep_wire_free(mtrl_dist_ep_wire *w) {
    if (w->m && w->m->experts == &w->fn) mtrl_model_set_experts(w->m, NULL, NULL);
    free(w->hdr), free(w->hdr_all), free(w->rows_all);
    free(w->send), free(w->recv), free(w->out);
    free(w->u1), free(w->u3), free(w->y), free(w->rx), free(w->rdy);
    memset(w, 0, sizeof *w);
}

mtrl_status mtrl_dist_ep_wire_finish(mtrl_dist_ep_wire *w, mtrl_error *err) {
    while (w->status == MTRL_OK && round_(w, ROUND_NONE, 0, 0, NULL, NULL, NULL, NULL)) {
    }
    mtrl_status st = w->status;
    if (st != MTRL_OK && err) *err = w->err;
    return st;
}
