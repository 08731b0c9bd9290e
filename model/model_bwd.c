// model_bwd.c: the backward pass of one segment (see model_ws.h): the LM head, the Block-AttnRes
// walk over the sublayers in reverse (docs/model.md §6.3), the mixers and FFNs, the embedding.
// Parameter gradients accumulate into m->dG (where the backend computes); gradients of the boundary
// states flow through g.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "model/backend.h"
#include "model/model_image.h"
#include "model/model_ws.h"

#define ALLOC(n) ((real *)mtrl_arena_alloc(ar, sizeof(real) * (size_t)(n)))

// Zero-filled arena memory (wherever the backend keeps it).
static real *zalloc_(mtrl_backend *be, mtrl_arena *ar, size_t n) {
    real *p = ALLOC(n);
    be->zero(be, p, sizeof(real) * n);
    return p;
}

// For y = x Wᵀ (x [T][k], W [n][k]): dx (+)= dy W and dW += dyᵀ x.
static void proj_bwd_(mtrl_backend *be, int T, int n, int k, const real *x, const real *W, const real *dy, real *dx,
                      int accumulate, real *dW) {
    be->gemm(be, 0, 0, T, k, n, 1, dy, n, W, k, accumulate ? 1 : 0, dx, k);
    be->gemm(be, 1, 0, n, k, T, 1, dy, n, x, k, 1, dW, k);
}

// ---- KDA --------------------------------------------------------------------------------------------------

static void kda_backward_(mtrl_model *m, mtrl_arena *ar, int l, int T, const layer_cache *c, const seq_io *io,
                          const real *dout, real *dx1, seq_grad *g) {
    const mtrl_model_dims *d = &m->dims;
    const mtrl_layer_ptrs *p = &m->dP.layer[l];
    mtrl_layer_ptrs *gp = &m->dG.layer[l];
    mtrl_backend *be = m->be;
    int H = d->H, D = d->D, HD = H * D, W = d->W, ki = model_kda_index(d, l);
    size_t S_sz = (size_t)H * D * D, w1 = (size_t)(W - 1) * HD;
    real *dy = ALLOC((size_t)T * HD);
    double t = model_prof_begin(m);
    proj_bwd_(be, T, d->d, HD, c->y, p->wo, dout, dy, 0, gp->wo);
    model_prof_end(m, MTRL_PROF_KDA_PROJ, t);
    real *d_o = ALLOC((size_t)T * HD), *dz = ALLOC((size_t)T * HD);
    t = model_prof_begin(m);
    be->gated_rmsnorm_bwd(be, T * H, D, c->o, c->z, p->onorm, d->eps, dy, d_o, dz, gp->onorm);
    model_prof_end(m, MTRL_PROF_KDA_ELEM, t);
    real *dz1 = ALLOC((size_t)T * D);
    t = model_prof_begin(m);
    proj_bwd_(be, T, HD, D, c->z1, p->wz2, dz, dz1, 0, gp->wz2);
    proj_bwd_(be, T, D, d->d, c->x1, p->wz1, dz1, dx1, 1, gp->wz1);
    model_prof_end(m, MTRL_PROF_KDA_PROJ, t);
    real *dqn = ALLOC((size_t)T * HD), *dkn = ALLOC((size_t)T * HD);
    real *dcv = ALLOC((size_t)T * HD), *dg = ALLOC((size_t)T * HD);
    real *dbeta = ALLOC((size_t)T * H), *dS0 = ALLOC(S_sz);
    real *dS = g->dS + (size_t)ki * S_sz;
    t = model_prof_begin(m);
    if (!io->n_piece) {
        be->kda_chunk_bwd(be, T, H, D, D, c->qn, c->kn, c->cv, c->g, c->beta, c->S0, c->S_tiles, d_o, dS, dqn, dkn,
                          dcv, dg, dbeta, dS0);
        be->copy(be, dS, dS0, sizeof(real) * S_sz);
    } else {
        // Packed pieces, each from the zero state (the backward runs on learner packs only, never
        // on piece_io prefills) and each ending its sequence: no gradient arrives through a final
        // state, none leaves through S0.
        be->kda_chunk_bwd_varlen(be, io->n_piece, io->piece, H, D, D, c->qn, c->kn, c->cv, c->g, c->beta,
                                 c->S_tiles, d_o, dqn, dkn, dcv, dg, dbeta);
    }
    // the gate's backward next to the delta rule's (the profile's KDA core); dx1 still takes
    // wz1, wbeta, wf1, then q/k/v in that order
    real *df = ALLOC((size_t)T * HD), *df1 = ALLOC((size_t)T * D);
    be->kda_gate_bwd(be, d->kda_gate, T, H, D, c->f, p->A_log, p->dt_bias, d->g_min, dg, df, gp->A_log, gp->dt_bias);
    model_prof_end(m, MTRL_PROF_KDA_CORE, t);
    t = model_prof_begin(m);
    be->dsigmoid(be, (size_t)T * H, c->beta, dbeta);
    model_prof_end(m, MTRL_PROF_KDA_ELEM, t);
    t = model_prof_begin(m);
    proj_bwd_(be, T, H, d->d, c->x1, p->wbeta, dbeta, dx1, 1, gp->wbeta);
    proj_bwd_(be, T, HD, D, c->f1, p->wf2, df, df1, 0, gp->wf2);
    proj_bwd_(be, T, D, d->d, c->x1, p->wf1, df1, dx1, 1, gp->wf1);
    model_prof_end(m, MTRL_PROF_KDA_PROJ, t);
    // q = D^-1/2 · L2Norm(q̃), k = L2Norm(k̃): back through the norms to the conv outputs.
    real *dcq = ALLOC((size_t)T * HD), *dck = ALLOC((size_t)T * HD);
    t = model_prof_begin(m);
    be->scale(be, (size_t)T * HD, dqn, (real)(1.0 / sqrt((double)D)));
    be->l2norm_bwd(be, T * H, D, c->cq, (real)1e-6, dqn, dcq);
    be->l2norm_bwd(be, T * H, D, c->ck, (real)1e-6, dkn, dck);
    model_prof_end(m, MTRL_PROF_KDA_ELEM, t);
    // Conv backward, then the gradient that reached this segment's last inputs through the
    // window handed to the next segment (g->dconv in), then hand ours to the previous segment.
    real *dconv = g->dconv + (size_t)ki * 3 * w1;
    real *dst_in = ALLOC(3 * w1);
    const real *dc3[3] = {dcq, dck, dcv};
    const real *px[3] = {c->pq, c->pk, c->pv};
    const real *cw[3] = {p->conv_q, p->conv_k, p->conv_v};
    real *cgw[3] = {gp->conv_q, gp->conv_k, gp->conv_v};
    const real *Wp[3] = {p->wq, p->wk, p->wv};
    real *gW[3] = {gp->wq, gp->wk, gp->wv};
    real *dpx = ALLOC((size_t)T * HD);
    for (int s = 0; s < 3; s++) {
        t = model_prof_begin(m);
        if (!io->n_piece) {
            be->shortconv_bwd(be, T, HD, W, px[s], cw[s], c->cst + s * w1, dc3[s], dpx, cgw[s], dst_in + s * w1);
            be->shortconv_state_bwd(be, T, HD, W, dconv + s * w1, dpx, dst_in + s * w1);
        } else if (!io->piece_io) {  // every piece from the zero window: one call
            be->shortconv_bwd_varlen(be, io->n_piece, io->piece, HD, W, px[s], cw[s], dc3[s], dpx, cgw[s]);
        } else {
            for (int i = 0; i < io->n_piece; i++) {
                int Ti;
                size_t o = (size_t)seq_piece(io, T, i, &Ti) * HD;
                be->shortconv_bwd(be, Ti, HD, W, px[s] + o, cw[s], c->cst + s * w1, dc3[s] + o, dpx + o, cgw[s], NULL);
            }
        }
        model_prof_end(m, MTRL_PROF_KDA_ELEM, t);
        t = model_prof_begin(m);
        proj_bwd_(be, T, HD, d->d, c->x1, Wp[s], dpx, dx1, 1, gW[s]);
        model_prof_end(m, MTRL_PROF_KDA_PROJ, t);
    }
    if (!io->n_piece) be->copy(be, dconv, dst_in, sizeof(real) * 3 * w1);
}

// ---- MLA --------------------------------------------------------------------------------------------------

static void mla_backward_(mtrl_model *m, mtrl_arena *ar, int l, int T, const layer_cache *c, const seq_io *io,
                          const real *dout, real *dx1, seq_grad *g) {
    const mtrl_model_dims *d = &m->dims;
    const mtrl_layer_ptrs *p = &m->dP.layer[l];
    mtrl_layer_ptrs *gp = &m->dG.layer[l];
    mtrl_backend *be = m->be;
    int mH = d->mH, dn = d->dn, dr = d->dr, dv = d->dv, dc = d->dc, ld = dc + dr;
    int mi = model_mla_index(d, l), Adv = mH * dv;
    real scale = (real)(1.0 / sqrt((double)(dn + dr)));
    int t0 = io->t0 - T; // io->t0 is the position after this segment
    real *dag = ALLOC((size_t)T * Adv);
    double t = model_prof_begin(m);
    proj_bwd_(be, T, d->d, Adv, d->mla_gate ? c->ag : c->a, p->mo, dout, dag, 0, gp->mo);
    model_prof_end(m, MTRL_PROF_MLA_PROJ, t);
    real *da = dag;
    if (d->mla_gate) {
        da = ALLOC((size_t)T * Adv);
        real *dgl = ALLOC((size_t)T * Adv);
        t = model_prof_begin(m);
        be->sigmoid_mul_bwd(be, (size_t)T * Adv, c->gl, c->a, dag, da, dgl);
        model_prof_end(m, MTRL_PROF_MLA_ELEM, t);
        t = model_prof_begin(m);
        proj_bwd_(be, T, Adv, d->d, c->x1, p->mg, dgl, dx1, 1, gp->mg);
        model_prof_end(m, MTRL_PROF_MLA_PROJ, t);
    }
    const void *lat = mtrl_latent_at(be, io->latent, (size_t)mi * io->cap * ld);
    real *dlat = g->dlatent + (size_t)mi * io->cap * ld;
    real *dq;
    if (!d->mla_absorbed) {
        // Naive form (model_fwd.c): the keys and values expanded again, their gradients over
        // every key so far (a packed segment: its own rows) folded back into the latents'.
        dq = ALLOC((size_t)T * mH * (dn + dr));
        int Tk = io->n_piece ? T : t0 + T, ldk = mH * (dn + dr);
        size_t mark = mtrl_arena_mark(ar);
        t = model_prof_begin(m);
        mla_kv x = seg_mla_expand(m, ar, l, Tk, lat);
        real *dk = zalloc_(be, ar, (size_t)Tk * ldk), *dvv = zalloc_(be, ar, (size_t)Tk * mH * dv);
        model_prof_end(m, MTRL_PROF_MLA_ABSORB, t);
        t = model_prof_begin(m);
        if (io->n_piece) // every piece over its own rows, in one call
            be->attn_causal_bwd_varlen(be, io->n_piece, io->piece, NULL, mH, mH, dn + dr, dv, scale, c->q, x.k, ldk,
                                       x.v, mH * dv, c->a, c->lse, da, dq, dk, dvv);
        else
            be->attn_causal_bwd(be, T, Tk, mH, mH, dn + dr, dv, scale, c->q, x.k, ldk, x.v, mH * dv, c->a, c->lse, da,
                                dq, dk, dvv);
        model_prof_end(m, MTRL_PROF_MLA_ATTN, t);
        t = model_prof_begin(m);
        be->mla_expand_kv_bwd(be, Tk, mH, dn, dr, dv, dc, x.lr, ld, p->mkvb, dk, dvv, dlat, ld, dlat + dc, ld, gp->mkvb);
        model_prof_end(m, MTRL_PROF_MLA_ABSORB, t);
        mtrl_arena_release(ar, mark);
    } else {
        real *dol = ALLOC((size_t)T * mH * dc), *dqt = ALLOC((size_t)T * mH * ld);
        dq = ALLOC((size_t)T * mH * (dn + dr));
        t = model_prof_begin(m);
        be->mla_up_v_bwd(be, T, mH, dn, dv, dc, c->ol, p->mkvb, da, dol, gp->mkvb);
        model_prof_end(m, MTRL_PROF_MLA_ABSORB, t);
        t = model_prof_begin(m);
        if (!io->n_piece) {
            be->attn_causal_bwd(be, T, t0 + T, mH, 1, ld, dc, scale, c->qt, lat, ld, lat, ld, c->ol, c->lse, dol, dqt,
                                dlat, dlat);
        } else { // every piece over its own rows of the packed latents, in one call
            be->attn_causal_bwd_varlen(be, io->n_piece, io->piece, NULL, mH, 1, ld, dc, scale, c->qt, lat, ld, lat, ld,
                                       c->ol, c->lse, dol, dqt, dlat, dlat);
        }
        model_prof_end(m, MTRL_PROF_MLA_ATTN, t);
        t = model_prof_begin(m);
        be->mla_absorb_q_bwd(be, T, mH, dn, dr, dv, dc, c->q, p->mkvb, dqt, dq, gp->mkvb);
        model_prof_end(m, MTRL_PROF_MLA_ABSORB, t);
    }
    t = model_prof_begin(m);
    proj_bwd_(be, T, mH * (dn + dr), d->d, c->x1, p->mq, dq, dx1, 1, gp->mq);
    model_prof_end(m, MTRL_PROF_MLA_PROJ, t);
    // This segment's latent rows have received every gradient (later segments ran first).
    real *dchat = ALLOC((size_t)T * dc), *dlraw = ALLOC((size_t)T * ld), *dcraw = ALLOC((size_t)T * dc);
    t = model_prof_begin(m);
    be->copy_rows(be, T, dc, dlat + (size_t)t0 * ld, ld, dchat, dc);
    be->rmsnorm_bwd(be, T, dc, c->craw, p->mkv_norm, c->rstd_c, d->kv_eps, dchat, dcraw, gp->mkv_norm);
    be->copy_rows(be, T, dc, dcraw, dc, dlraw, ld);
    be->copy_rows(be, T, dr, dlat + (size_t)t0 * ld + dc, ld, dlraw + dc, ld);
    model_prof_end(m, MTRL_PROF_MLA_ELEM, t);
    t = model_prof_begin(m);
    proj_bwd_(be, T, ld, d->d, c->x1, p->mkva, dlraw, dx1, 1, gp->mkva);
    model_prof_end(m, MTRL_PROF_MLA_PROJ, t);
}

// ---- FFN ----------------------------------------------------------------------------------------------------
// The MoE layer's backward in phases (model_moe.h): the expert-parallel layer runs the same ones.

void mtrl_model_moe_combine_bwd(mtrl_model *m, int l, int T, const mtrl_model_moe_rows *r, const real *dy, real *dY,
                                real *dw) {
    (void)l;
    double t = model_prof_begin(m);
    m->be->moe_combine_bwd(m->be, T, m->dims.k, m->dims.d, r->pos, r->w, r->Y, dy, dY, dw);
    model_prof_end(m, MTRL_PROF_MOE_ROUTE, t);
}

void mtrl_model_moe_experts_bwd(mtrl_model *m, int l, int e0, int e1, const int *offsets, const real *X, const real *u1,
                                const real *u3, const real *dY, real *dX) {
    const mtrl_model_dims *d = &m->dims;
    const mtrl_layer_ptrs *p = &m->dP.layer[l];
    mtrl_layer_ptrs *gp = &m->dG.layer[l];
    MTRL_CHECKF(0 <= e0 && e0 <= e1 && e1 <= d->E, "experts %d..%d of %d", e0, e1 - 1, d->E);
    size_t w = (size_t)e0 * d->I * d->d; // expert e0's first element of every [E][..] weight
    double t = model_prof_begin(m);
    m->be->moe_experts_bwd(m->be, e1 - e0, d->d, d->I, offsets, X, p->ew1 + w, p->ew3 + w, p->ew2 + w, u1, u3, dY,
                           dX, gp->ew1 + w, gp->ew3 + w, gp->ew2 + w);
    model_prof_end(m, MTRL_PROF_MOE_EXPERTS, t);
}

void mtrl_model_moe_route_bwd(mtrl_model *m, int l, int T, const real *x, const mtrl_model_moe_rows *r, const real *dy,
                              const real *dX, const real *dw, real *dz, real *dxs, real *dx) {
    const mtrl_model_dims *d = &m->dims;
    const mtrl_layer_ptrs *p = &m->dP.layer[l];
    mtrl_layer_ptrs *gp = &m->dG.layer[l];
    mtrl_backend *be = m->be;
    int E = d->E, K = d->k;
    double t = model_prof_begin(m);
    be->zero(be, dx, sizeof(real) * (size_t)T * d->d);
    be->moe_scatter_bwd(be, T, K, d->d, r->pos, dX, dx);
    be->moe_router_bwd(be, T, E, K, r->s, r->sel, r->w, model_router_form(d), d->rho, dw, dz);
    proj_bwd_(be, T, E, d->d, x, p->router, dz, dx, 1, gp->router);
    model_prof_end(m, MTRL_PROF_MOE_ROUTE, t);
    if (d->n_shared > 0) {
        int SI = d->n_shared * d->I;
        t = model_prof_begin(m);
        be->moe_swiglu_bwd(be, T, d->d, SI, x, p->sw1, p->sw3, p->sw2, r->su1, r->su3, dy, dxs, gp->sw1, gp->sw3,
                           gp->sw2);
        be->add(be, (size_t)T * d->d, dx, dxs, dx);
        model_prof_end(m, MTRL_PROF_MOE_SHARED, t);
    }
}

// The backward of mtrl_model_moe_layer_bwd with the routed experts' part run by fn when set
// (model.h mtrl_model_set_experts): it gets the forward's rows r->X, which the segment's caches
// hold, and their output gradients.
static void moe_layer_bwd_(mtrl_model *m, mtrl_arena *ar, int l, int T, const real *x, const mtrl_model_moe_rows *r,
                           const real *dy, const mtrl_model_experts_fn *fn, real *dx) {
    const mtrl_model_dims *d = &m->dims;
    int R = T * d->k;
    real *dY = ALLOC((size_t)R * d->d), *dw = ALLOC((size_t)T * d->k);
    real *dX = ALLOC((size_t)R * d->d), *dz = ALLOC((size_t)T * d->E);
    real *dxs = d->n_shared > 0 ? ALLOC((size_t)T * d->d) : NULL;
    mtrl_model_moe_combine_bwd(m, l, T, r, dy, dY, dw);
    if (fn) fn->bwd(fn->user, l, R, r->offsets, r->X, dY, dX);
    else mtrl_model_moe_experts_bwd(m, l, 0, d->E, r->offsets, r->X, r->u1, r->u3, dY, dX);
    mtrl_model_moe_route_bwd(m, l, T, x, r, dy, dX, dw, dz, dxs, dx);
}

void mtrl_model_moe_layer_bwd(mtrl_model *m, mtrl_arena *ar, int l, int T, const real *x, const mtrl_model_moe_rows *r,
                              const real *dy, real *dx) {
    moe_layer_bwd_(m, ar, l, T, x, r, dy, NULL, dx);
}

static void ffn_backward_(mtrl_model *m, mtrl_arena *ar, int l, int T, const layer_cache *c, const real *dout,
                          real *dx2) {
    const mtrl_model_dims *d = &m->dims;
    if (!mtrl_model_is_dense(d, l)) {
        moe_layer_bwd_(m, ar, l, T, c->x2, &c->moe, dout, m->experts, dx2);
        return;
    }
    const mtrl_layer_ptrs *p = &m->dP.layer[l];
    mtrl_layer_ptrs *gp = &m->dG.layer[l];
    double t = model_prof_begin(m);
    m->be->moe_swiglu_bwd(m->be, T, d->d, d->dense_I, c->x2, p->w1, p->w3, p->w2, c->u1, c->u3, dout, dx2, gp->w1,
                          gp->w3, gp->w2);
    model_prof_end(m, MTRL_PROF_FFN_DENSE, t);
}

// ---- the stack ------------------------------------------------------------------------------------------------

// Backward of AttnRes site j given dh: block gradients into dB[b], the partial's into dp (+=).
static void site_backward_(mtrl_model *m, const seg_cache *c, int j, int nsrc, const real *alpha, const real *dh,
                           real **dB, real *dp) {
    const mtrl_model_dims *d = &m->dims;
    const real *src[MTRL_MAX_LAYERS + 2];
    real *dsrc[MTRL_MAX_LAYERS + 2];
    int n = 0;
    for (int b = 0; b < c->nb_site[j]; b++) { src[n] = c->blocks[b]; dsrc[n++] = dB[b]; }
    if (c->part[j]) { src[n] = c->part[j]; dsrc[n++] = dp; }
    MTRL_CHECK(n == nsrc);
    if (!d->attnres) { // the plain residual: h is the sum of its sources
        for (int i = 0; i < n; i++) m->be->add(m->be, (size_t)c->T * d->d, dsrc[i], dh, dsrc[i]);
        return;
    }
    m->be->attnres_site_bwd(m->be, c->T, d->d, nsrc, src, m->dP.site_w + (size_t)j * d->d,
                            m->dP.site_g + (size_t)j * d->d, d->eps, alpha, dh, dsrc, m->dG.site_w + (size_t)j * d->d,
                            m->dG.site_g + (size_t)j * d->d);
}

void seg_backward(mtrl_model *m, mtrl_arena *ar, seg_cache *c, const uint32_t *tokens, const int *targets,
                  const seq_io *io, const real *dlogp, const real *dentropy, seq_grad *g) {
    const mtrl_model_dims *d = &m->dims;
    mtrl_backend *be = m->be;
    int T = c->T, D = d->d, L = d->L;
    MTRL_CHECK(c->mode == SEG_CHUNK);
    // LM head and final norm.
    real *dlogits = ALLOC((size_t)T * d->V);
    real *dxf = ALLOC((size_t)T * D), *dh = ALLOC((size_t)T * D);
    double t = model_prof_begin(m);
    be->logprob_bwd(be, T, d->V, c->logits, targets, dlogp, dentropy, dlogits);
    proj_bwd_(be, T, d->V, D, c->xf, m->dP.lm_head, dlogits, dxf, 0, m->dG.lm_head);
    be->rmsnorm_bwd(be, T, D, c->h_o, m->dP.final_norm, c->rstd_f, d->eps, dxf, dh, m->dG.final_norm);
    model_prof_end(m, MTRL_PROF_HEAD, t);
    int nb = c->nb_site[2 * L];
    real *dB[MTRL_MAX_LAYERS + 1];
    t = model_prof_begin(m);
    for (int b = 0; b < nb; b++) dB[b] = zalloc_(be, ar, (size_t)T * D);
    real *dp = zalloc_(be, ar, (size_t)T * D);
    site_backward_(m, c, 2 * L, c->nsrc_o, c->alpha_o, dh, dB, dp);
    model_prof_end(m, MTRL_PROF_SITE, t);
    real *dx = ALLOC((size_t)T * D);
    for (int l = L - 1; l >= 0; l--) {
        layer_cache *lc = &c->layer[l];
        size_t mark = mtrl_arena_mark(ar);
        // FFN sublayer: its output's gradient is dp (p_after = p_before + f).
        ffn_backward_(m, ar, l, T, lc, dp, dx);
        t = model_prof_begin(m);
        be->rmsnorm_bwd(be, T, D, lc->h_f, m->dP.layer[l].norm2, lc->rstd2, d->eps, dx, dh, m->dG.layer[l].norm2);
        site_backward_(m, c, 2 * l + 1, lc->nsrc_f, lc->alpha_f, dh, dB, dp);
        mtrl_arena_release(ar, mark);
        // Mixer sublayer.
        be->zero(be, dx, sizeof(real) * (size_t)T * D);
        model_prof_end(m, MTRL_PROF_SITE, t);
        if (d->mixer[l] == 'K') kda_backward_(m, ar, l, T, lc, io, dp, dx, g);
        else mla_backward_(m, ar, l, T, lc, io, dp, dx, g);
        t = model_prof_begin(m);
        be->rmsnorm_bwd(be, T, D, lc->h_a, m->dP.layer[l].norm1, lc->rstd1, d->eps, dx, dh, m->dG.layer[l].norm1);
        if (!c->part[2 * l]) be->zero(be, dp, sizeof(real) * (size_t)T * D); // p_before was empty
        site_backward_(m, c, 2 * l, lc->nsrc_a, lc->alpha_a, dh, dB, dp);
        mtrl_arena_release(ar, mark);
        // Entering the previous block from its last sublayer: its sum's gradient is complete.
        if (l > 0 && l % d->S == 0) be->copy(be, dp, dB[c->nb_site[2 * l] - 1], sizeof(real) * (size_t)T * D);
        model_prof_end(m, MTRL_PROF_SITE, t);
    }
    int ids[4096];
    int *tid = T <= 4096 ? ids : xmalloc(sizeof(int) * (size_t)T);
    model_image_ids(T, tokens, tid);
    t = model_prof_begin(m);
    model_image_bwd(m, T, tokens, dB[0]);
    be->embedding_bwd(be, T, D, tid, dB[0], m->dG.embed);
    model_prof_end(m, MTRL_PROF_EMBED, t);
    if (tid != ids) free(tid);
}
