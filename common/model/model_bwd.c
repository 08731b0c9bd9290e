// model_bwd.c: the backward pass of one segment (see model_ws.h): the LM head, the Block-AttnRes
// walk over the sublayers in reverse (model.md §6.3), the mixers and FFNs, the embedding.
// Parameter gradients accumulate into m->G; gradients of the boundary states flow through g.
#include <math.h>
#include <string.h>

#include "common/check.h"
#include "common/model/model_ws.h"
#include "kernels/ref/attnres_ref.h"
#include "kernels/ref/gemm_ref.h"
#include "kernels/ref/kda_ref.h"
#include "kernels/ref/mla_ref.h"
#include "kernels/ref/moe_ref.h"
#include "kernels/ref/ops_ref.h"

#define ALLOC(n) ((real *)mtrl_arena_alloc(ar, sizeof(real) * (size_t)(n)))
#define ZALLOC(n) ((real *)mtrl_arena_calloc(ar, sizeof(real) * (size_t)(n)))

// For y = x Wᵀ (x [T][k], W [n][k]): dx (+)= dy W and dW += dyᵀ x.
static void proj_bwd_(int T, int n, int k, const real *x, const real *W, const real *dy, real *dx, int accumulate,
                      real *dW) {
    gemm_ref(0, 0, T, k, n, 1, dy, n, W, k, accumulate ? 1 : 0, dx, k);
    gemm_ref(1, 0, n, k, T, 1, dy, n, x, k, 1, dW, k);
}

static real sigmoid_(real x) { return (real)(1.0 / (1.0 + exp(-(double)x))); }

// ---- KDA --------------------------------------------------------------------------------------------------

static void kda_backward_(mtrl_model *m, mtrl_arena *ar, int l, int T, const layer_cache *c, const real *dout,
                          real *dx1, seq_grad *g) {
    const mtrl_model_dims *d = &m->dims;
    const mtrl_layer_ptrs *p = &m->P.layer[l];
    mtrl_layer_ptrs *gp = &m->G.layer[l];
    int H = d->H, D = d->D, HD = H * D, W = d->W, ki = model_kda_index(d, l);
    size_t S_sz = (size_t)H * D * D, w1 = (size_t)(W - 1) * HD;
    real *dy = ALLOC(T * HD);
    proj_bwd_(T, d->d, HD, c->y, p->wo, dout, dy, 0, gp->wo);
    real *d_o = ALLOC(T * HD), *dz = ALLOC(T * HD);
    gated_rmsnorm_bwd(T * H, D, c->o, c->z, p->onorm, d->eps, dy, d_o, dz, gp->onorm);
    real *dz1 = ALLOC(T * D);
    proj_bwd_(T, HD, D, c->z1, p->wz2, dz, dz1, 0, gp->wz2);
    proj_bwd_(T, D, d->d, c->x1, p->wz1, dz1, dx1, 1, gp->wz1);
    real *dqn = ALLOC(T * HD), *dkn = ALLOC(T * HD), *dcv = ALLOC(T * HD), *dg = ALLOC(T * HD);
    real *dbeta = ALLOC(T * H), *dS0 = ALLOC(S_sz);
    real *dS = g->dS + (size_t)ki * S_sz;
    kda_chunk_bwd(T, H, D, D, c->qn, c->kn, c->cv, c->g, c->beta, c->S0, c->S_tiles, d_o, dS, dqn, dkn, dcv, dg,
                  dbeta, dS0);
    memcpy(dS, dS0, sizeof(real) * S_sz);
    for (int i = 0; i < T * H; i++) dbeta[i] *= c->beta[i] * (1 - c->beta[i]);
    proj_bwd_(T, H, d->d, c->x1, p->wbeta, dbeta, dx1, 1, gp->wbeta);
    real *df = ALLOC(T * HD), *df1 = ALLOC(T * D);
    kda_gate_bwd(T, H, D, c->f, p->A_log, p->dt_bias, d->g_min, dg, df, gp->A_log, gp->dt_bias);
    proj_bwd_(T, HD, D, c->f1, p->wf2, df, df1, 0, gp->wf2);
    proj_bwd_(T, D, d->d, c->x1, p->wf1, df1, dx1, 1, gp->wf1);
    // q = D^-1/2 · L2Norm(q̃), k = L2Norm(k̃): back through the norms to the conv outputs.
    real *dcq = ALLOC(T * HD), *dck = ALLOC(T * HD);
    scale_inplace((size_t)T * HD, dqn, (real)(1.0 / sqrt((double)D)));
    l2norm_bwd(T * H, D, c->cq, (real)1e-6, dqn, dcq);
    l2norm_bwd(T * H, D, c->ck, (real)1e-6, dkn, dck);
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
    real *dpx = ALLOC(T * HD);
    for (int s = 0; s < 3; s++) {
        shortconv_bwd(T, HD, W, px[s], cw[s], c->cst + s * w1, dc3[s], dpx, cgw[s], dst_in + s * w1);
        shortconv_state_bwd(T, HD, W, dconv + s * w1, dpx, dst_in + s * w1);
        proj_bwd_(T, HD, d->d, c->x1, Wp[s], dpx, dx1, 1, gW[s]);
    }
    memcpy(dconv, dst_in, sizeof(real) * 3 * w1);
}

// ---- MLA --------------------------------------------------------------------------------------------------

static void mla_backward_(mtrl_model *m, mtrl_arena *ar, int l, int T, const layer_cache *c, const seq_io *io,
                          const real *dout, real *dx1, seq_grad *g) {
    const mtrl_model_dims *d = &m->dims;
    const mtrl_layer_ptrs *p = &m->P.layer[l];
    mtrl_layer_ptrs *gp = &m->G.layer[l];
    int mH = d->mH, dn = d->dn, dr = d->dr, dv = d->dv, dc = d->dc, ld = dc + dr;
    int mi = model_mla_index(d, l), Adv = mH * dv;
    real scale = (real)(1.0 / sqrt((double)(dn + dr)));
    int t0 = io->t0 - T; // io->t0 is the position after this segment
    real *dag = ALLOC(T * Adv);
    proj_bwd_(T, d->d, Adv, d->mla_gate ? c->ag : c->a, p->mo, dout, dag, 0, gp->mo);
    real *da = dag;
    if (d->mla_gate) {
        da = ALLOC(T * Adv);
        real *dgl = ALLOC(T * Adv);
        for (size_t i = 0; i < (size_t)T * Adv; i++) {
            real s = sigmoid_(c->gl[i]);
            da[i] = dag[i] * s;
            dgl[i] = dag[i] * c->a[i] * s * (1 - s);
        }
        proj_bwd_(T, Adv, d->d, c->x1, p->mg, dgl, dx1, 1, gp->mg);
    }
    real *dol = ALLOC(T * mH * dc), *dqt = ALLOC(T * mH * ld), *dq = ALLOC(T * mH * (dn + dr));
    mla_up_v_bwd(T, mH, dn, dv, dc, c->ol, p->mkvb, da, dol, gp->mkvb);
    const real *lat = io->latent + (size_t)mi * io->cap * ld;
    real *dlat = g->dlatent + (size_t)mi * io->cap * ld;
    attn_causal_bwd(T, t0 + T, mH, 1, ld, dc, scale, c->qt, lat, ld, lat, ld, c->ol, c->lse, dol, dqt, dlat, dlat);
    mla_absorb_q_bwd(T, mH, dn, dr, dv, dc, c->q, p->mkvb, dqt, dq, gp->mkvb);
    proj_bwd_(T, mH * (dn + dr), d->d, c->x1, p->mq, dq, dx1, 1, gp->mq);
    // This segment's latent rows have received every gradient (later segments ran first).
    real *dchat = ALLOC(T * dc), *dlraw = ALLOC(T * ld), *dcraw = ALLOC(T * dc);
    for (int t = 0; t < T; t++) memcpy(dchat + (size_t)t * dc, dlat + (size_t)(t0 + t) * ld, sizeof(real) * dc);
    rmsnorm_bwd(T, dc, c->craw, p->mkv_norm, c->rstd_c, d->eps, dchat, dcraw, gp->mkv_norm);
    for (int t = 0; t < T; t++) {
        memcpy(dlraw + (size_t)t * ld, dcraw + (size_t)t * dc, sizeof(real) * dc);
        memcpy(dlraw + (size_t)t * ld + dc, dlat + (size_t)(t0 + t) * ld + dc, sizeof(real) * dr);
    }
    proj_bwd_(T, ld, d->d, c->x1, p->mkva, dlraw, dx1, 1, gp->mkva);
}

// ---- FFN ----------------------------------------------------------------------------------------------------

static void ffn_backward_(mtrl_model *m, mtrl_arena *ar, int l, int T, const layer_cache *c, const real *dout,
                          real *dx2) {
    const mtrl_model_dims *d = &m->dims;
    const mtrl_layer_ptrs *p = &m->P.layer[l];
    mtrl_layer_ptrs *gp = &m->G.layer[l];
    if (l == 0) {
        moe_swiglu_bwd(T, d->d, d->dense_I, c->x2, p->w1, p->w3, p->w2, c->u1, c->u3, dout, dx2, gp->w1, gp->w3,
                       gp->w2);
        return;
    }
    int E = d->E, K = d->k, R = T * K;
    real *dYp = ALLOC(R * d->d), *dw = ALLOC(T * K), *dXp = ALLOC(R * d->d), *dz = ALLOC(T * E);
    moe_combine_bwd(T, K, d->d, c->pos, c->wr, c->Yp, dout, dYp, dw);
    moe_experts_bwd(E, d->d, d->I, c->offsets, c->Xp, p->ew1, p->ew3, p->ew2, c->eu1, c->eu3, dYp, dXp, gp->ew1,
                    gp->ew3, gp->ew2);
    memset(dx2, 0, sizeof(real) * (size_t)T * d->d);
    moe_scatter_bwd(T, K, d->d, c->pos, dXp, dx2);
    moe_router_bwd(T, E, K, c->sr, c->sel, c->wr, d->score_softmax, d->rho, dw, dz);
    proj_bwd_(T, E, d->d, c->x2, p->router, dz, dx2, 1, gp->router);
    if (d->n_shared > 0) {
        int SI = d->n_shared * d->I;
        real *dxs = ALLOC(T * d->d);
        moe_swiglu_bwd(T, d->d, SI, c->x2, p->sw1, p->sw3, p->sw2, c->su1, c->su3, dout, dxs, gp->sw1, gp->sw3,
                       gp->sw2);
        for (size_t i = 0; i < (size_t)T * d->d; i++) dx2[i] += dxs[i];
    }
}

// ---- the stack ------------------------------------------------------------------------------------------------

// Backward of AttnRes site j given dh: block gradients into dB[b], the partial's into dp.
static void site_backward_(mtrl_model *m, const seg_cache *c, int j, int nsrc, const real *alpha, const real *dh,
                           real **dB, real *dp) {
    const mtrl_model_dims *d = &m->dims;
    const real *src[MTRL_MAX_LAYERS + 2];
    real *dsrc[MTRL_MAX_LAYERS + 2];
    int n = 0;
    for (int b = 0; b < c->nb_site[j]; b++) { src[n] = c->blocks[b]; dsrc[n++] = dB[b]; }
    if (c->part[j]) { src[n] = c->part[j]; dsrc[n++] = dp; }
    MTRL_CHECK(n == nsrc);
    attnres_site_bwd(c->T, d->d, nsrc, src, m->P.site_w + (size_t)j * d->d, m->P.site_g + (size_t)j * d->d, d->eps,
                     alpha, dh, dsrc, m->G.site_w + (size_t)j * d->d, m->G.site_g + (size_t)j * d->d);
}

void seg_backward(mtrl_model *m, mtrl_arena *ar, seg_cache *c, const uint32_t *tokens, const int *targets,
                  const seq_io *io, const real *dlogp, const real *dentropy, seq_grad *g) {
    const mtrl_model_dims *d = &m->dims;
    int T = c->T, D = d->d, L = d->L;
    MTRL_CHECK(c->mode == SEG_CHUNK);
    // LM head and final norm.
    real *dlogits = ALLOC((size_t)T * d->V);
    logits_logprob_bwd(T, d->V, c->logits, targets, dlogp, dentropy, dlogits);
    real *dxf = ALLOC(T * D), *dh = ALLOC(T * D);
    proj_bwd_(T, d->V, D, c->xf, m->P.lm_head, dlogits, dxf, 0, m->G.lm_head);
    rmsnorm_bwd(T, D, c->h_o, m->P.final_norm, c->rstd_f, d->eps, dxf, dh, m->G.final_norm);
    int nb = c->nb_site[2 * L];
    real *dB[MTRL_MAX_LAYERS + 1];
    for (int b = 0; b < nb; b++) dB[b] = ZALLOC(T * D);
    real *dp = ZALLOC(T * D);
    site_backward_(m, c, 2 * L, c->nsrc_o, c->alpha_o, dh, dB, dp);
    real *dx = ALLOC(T * D);
    for (int l = L - 1; l >= 0; l--) {
        layer_cache *lc = &c->layer[l];
        size_t mark = mtrl_arena_mark(ar);
        // FFN sublayer: its output's gradient is dp (p_after = p_before + f).
        ffn_backward_(m, ar, l, T, lc, dp, dx);
        rmsnorm_bwd(T, D, lc->h_f, m->P.layer[l].norm2, lc->rstd2, d->eps, dx, dh, m->G.layer[l].norm2);
        site_backward_(m, c, 2 * l + 1, lc->nsrc_f, lc->alpha_f, dh, dB, dp);
        mtrl_arena_release(ar, mark);
        // Mixer sublayer.
        memset(dx, 0, sizeof(real) * (size_t)T * D);
        if (d->mixer[l] == 'K') kda_backward_(m, ar, l, T, lc, dp, dx, g);
        else mla_backward_(m, ar, l, T, lc, io, dp, dx, g);
        rmsnorm_bwd(T, D, lc->h_a, m->P.layer[l].norm1, lc->rstd1, d->eps, dx, dh, m->G.layer[l].norm1);
        if (!c->part[2 * l]) memset(dp, 0, sizeof(real) * (size_t)T * D); // p_before was empty
        site_backward_(m, c, 2 * l, lc->nsrc_a, lc->alpha_a, dh, dB, dp);
        mtrl_arena_release(ar, mark);
        // Entering the previous block from its last sublayer: its sum's gradient is complete.
        if (l > 0 && l % d->S == 0) memcpy(dp, dB[c->nb_site[2 * l] - 1], sizeof(real) * (size_t)T * D);
    }
    int ids[4096];
    int *tid = T <= 4096 ? ids : (int *)mtrl_arena_alloc(ar, sizeof(int) * (size_t)T);
    for (int t = 0; t < T; t++) tid[t] = (int)tokens[t];
    embedding_bwd(T, D, tid, dB[0], m->G.embed);
}
