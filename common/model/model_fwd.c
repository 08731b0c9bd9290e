// model_fwd.c: the forward pass of one segment (see model_ws.h): embeddings, the Block-AttnRes
// stack of KDA / MLA mixers and dense / MoE FFNs (model.md §0.3, §6.2), the LM head and the
// per-token log-probabilities. Every operation goes through the model's backend (backend.h):
// the arrays below live where the model computes.
#include <math.h>
#include <string.h>

#include <stdlib.h>

#include "common/check.h"
#include "common/model/backend.h"
#include "common/model/model_ws.h"
#include "kernels/ref/kda_ref.h"

#define ALLOC(n) ((real *)mtrl_arena_alloc(ar, sizeof(real) * (size_t)(n)))
#define IALLOC(n) ((int *)mtrl_arena_alloc(ar, sizeof(int) * (size_t)(n)))

int model_n_kda(const mtrl_model_dims *d) {
    int n = 0;
    for (int l = 0; l < d->L; l++) n += d->mixer[l] == 'K';
    return n;
}

int model_n_mla(const mtrl_model_dims *d) { return d->L - model_n_kda(d); }

int model_kda_index(const mtrl_model_dims *d, int l) {
    int n = 0;
    for (int i = 0; i < l; i++) n += d->mixer[i] == 'K';
    return n;
}

int model_mla_index(const mtrl_model_dims *d, int l) {
    int n = 0;
    for (int i = 0; i < l; i++) n += d->mixer[i] == 'M';
    return n;
}

// y[T][n] = x[T][k] · W[n][k]ᵀ: every projection of the model.
static void proj_(mtrl_backend *be, int T, int n, int k, const real *x, const real *W, real *y) {
    be->gemm(be, 0, 1, T, n, k, 1, x, k, W, k, 0, y, n);
}

// ---- KDA (model.md §2.1) ----------------------------------------------------------------------------

static void kda_forward_(mtrl_model *m, mtrl_arena *ar, int l, int mode, int T, const real *x1, seq_io *io,
                         layer_cache *c, real *out) {
    const mtrl_model_dims *d = &m->dims;
    const mtrl_layer_ptrs *p = &m->dP.layer[l];
    mtrl_backend *be = m->be;
    int H = d->H, D = d->D, HD = H * D, W = d->W, ki = model_kda_index(d, l);
    size_t conv_sz = (size_t)3 * (W - 1) * HD, S_sz = (size_t)H * D * D;
    c->pq = ALLOC(T * HD); c->pk = ALLOC(T * HD); c->pv = ALLOC(T * HD);
    proj_(be, T, HD, d->d, x1, p->wq, c->pq);
    proj_(be, T, HD, d->d, x1, p->wk, c->pk);
    proj_(be, T, HD, d->d, x1, p->wv, c->pv);
    c->cq = ALLOC(T * HD); c->ck = ALLOC(T * HD); c->cv = ALLOC(T * HD);
    size_t w1 = (size_t)(W - 1) * HD;
    if (mode == SEG_CHUNK) {
        real *st = io->conv + (size_t)ki * conv_sz;
        c->cst = ALLOC(conv_sz);
        be->copy(be, c->cst, st, sizeof(real) * conv_sz);
        be->shortconv_fwd(be, T, HD, W, c->pq, p->conv_q, c->cst, c->cq, st);
        be->shortconv_fwd(be, T, HD, W, c->pk, p->conv_k, c->cst + w1, c->ck, st + w1);
        be->shortconv_fwd(be, T, HD, W, c->pv, p->conv_v, c->cst + 2 * w1, c->cv, st + 2 * w1);
    } else {
        real **win = xmalloc(sizeof(real *) * (size_t)T);
        const real *px[3] = {c->pq, c->pk, c->pv}, *cw[3] = {p->conv_q, p->conv_k, p->conv_v};
        real *cy[3] = {c->cq, c->ck, c->cv};
        for (int s = 0; s < 3; s++) {
            for (int r = 0; r < T; r++) win[r] = io[r].conv + (size_t)ki * conv_sz + s * w1;
            be->shortconv_step(be, T, HD, W, px[s], cw[s], win, cy[s]);
        }
        free(win);
    }
    c->qn = ALLOC(T * HD); c->kn = ALLOC(T * HD);
    be->l2norm_fwd(be, T * H, D, c->cq, (real)1e-6, c->qn);
    be->l2norm_fwd(be, T * H, D, c->ck, (real)1e-6, c->kn);
    be->scale(be, (size_t)T * HD, c->qn, (real)(1.0 / sqrt((double)D)));
    c->f1 = ALLOC(T * D); c->f = ALLOC(T * HD); c->g = ALLOC(T * HD);
    proj_(be, T, D, d->d, x1, p->wf1, c->f1);
    proj_(be, T, HD, D, c->f1, p->wf2, c->f);
    be->kda_gate_fwd(be, T, H, D, c->f, p->A_log, p->dt_bias, d->g_min, c->g);
    c->bl = ALLOC(T * H); c->beta = ALLOC(T * H);
    proj_(be, T, H, d->d, x1, p->wbeta, c->bl);
    be->sigmoid(be, (size_t)T * H, c->bl, c->beta);
    c->o = ALLOC(T * HD);
    if (mode == SEG_CHUNK) {
        real *S = io->kda_S + (size_t)ki * S_sz;
        c->S0 = ALLOC(S_sz);
        be->copy(be, c->S0, S, sizeof(real) * S_sz);
        c->S_tiles = ALLOC((size_t)kda_tile_count(T) * S_sz);
        be->kda_chunk_fwd(be, T, H, D, D, c->qn, c->kn, c->cv, c->g, c->beta, c->S0, c->o, S, c->S_tiles);
    } else {
        real **Sr = xmalloc(sizeof(real *) * (size_t)T);
        for (int r = 0; r < T; r++) Sr[r] = io[r].kda_S + (size_t)ki * S_sz;
        be->kda_step(be, T, H, D, D, c->qn, c->kn, c->cv, c->g, c->beta, Sr, c->o);
        free(Sr);
    }
    c->z1 = ALLOC(T * D); c->z = ALLOC(T * HD); c->y = ALLOC(T * HD);
    proj_(be, T, D, d->d, x1, p->wz1, c->z1);
    proj_(be, T, HD, D, c->z1, p->wz2, c->z);
    be->gated_rmsnorm_fwd(be, T * H, D, c->o, c->z, p->onorm, d->eps, c->y);
    proj_(be, T, d->d, HD, c->y, p->wo, out);
}

// ---- gated MLA, absorbed over the latent (model.md §3.1, §3.3) ------------------------------------

static void mla_forward_(mtrl_model *m, mtrl_arena *ar, int l, int mode, int T, const real *x1, seq_io *io,
                         layer_cache *c, real *out) {
    const mtrl_model_dims *d = &m->dims;
    const mtrl_layer_ptrs *p = &m->dP.layer[l];
    mtrl_backend *be = m->be;
    int mH = d->mH, dn = d->dn, dr = d->dr, dv = d->dv, dc = d->dc, ld = dc + dr;
    int mi = model_mla_index(d, l);
    real scale = (real)(1.0 / sqrt((double)(dn + dr)));
    c->q = ALLOC(T * mH * (dn + dr));
    proj_(be, T, mH * (dn + dr), d->d, x1, p->mq, c->q);
    real *lraw = ALLOC(T * ld);
    proj_(be, T, ld, d->d, x1, p->mkva, lraw);
    c->craw = ALLOC(T * dc); c->kr = ALLOC(T * dr); c->rstd_c = ALLOC(T);
    be->copy_rows(be, T, dc, lraw, ld, c->craw, dc);
    be->copy_rows(be, T, dr, lraw + dc, ld, c->kr, dr);
    real *chat = ALLOC(T * dc);
    be->rmsnorm_fwd(be, T, dc, c->craw, p->mkv_norm, d->eps, chat, c->rstd_c);
    // The new latent rows [ĉ ; k^r] join the sequence's cache.
    if (mode == SEG_CHUNK) {
        MTRL_CHECKF(io->t0 + T <= io->cap, "MLA latent cache full: position %d, capacity %d", io->t0 + T - 1, io->cap);
        real *row = io->latent + ((size_t)mi * io->cap + (size_t)io->t0) * ld;
        be->copy_rows(be, T, dc, chat, dc, row, ld);
        be->copy_rows(be, T, dr, c->kr, dr, row + dc, ld);
    } else {
        real **rows = xmalloc(sizeof(real *) * (size_t)T * 2);
        for (int t = 0; t < T; t++) {
            MTRL_CHECKF(io[t].t0 < io[t].cap, "MLA latent cache full: position %d, capacity %d", io[t].t0, io[t].cap);
            rows[t] = io[t].latent + ((size_t)mi * io[t].cap + (size_t)io[t].t0) * ld;
            rows[T + t] = rows[t] + dc;
        }
        be->scatter(be, T, (size_t)dc, chat, rows);
        if (dr > 0) be->scatter(be, T, (size_t)dr, c->kr, rows + T);
        free(rows);
    }
    c->a = ALLOC(T * mH * dv);
    if (mode == SEG_CHUNK) {
        const real *lat = io->latent + (size_t)mi * io->cap * ld;
        int Tk = io->t0 + T;
        c->qt = ALLOC(T * mH * ld); c->ol = ALLOC(T * mH * dc); c->lse = ALLOC(T * mH);
        be->mla_absorb_q(be, T, mH, dn, dr, dv, dc, c->q, p->mkvb, c->qt);
        be->attn_causal_fwd(be, T, Tk, mH, 1, ld, dc, scale, c->qt, lat, ld, lat, ld, c->ol, c->lse);
        be->mla_up_v(be, T, mH, dn, dv, dc, c->ol, p->mkvb, c->a);
    } else {
        const real **lat = xmalloc(sizeof(real *) * (size_t)T);
        int *Tk = xmalloc(sizeof(int) * (size_t)T);
        for (int r = 0; r < T; r++) {
            lat[r] = io[r].latent + (size_t)mi * io[r].cap * ld;
            Tk[r] = io[r].t0 + 1;
        }
        be->mla_decode(be, T, mH, dn, dr, dv, dc, scale, c->q, p->mkvb, lat, ld, Tk, c->a);
        free(lat);
        free(Tk);
    }
    const real *ag = c->a;
    if (d->mla_gate) {
        c->gl = ALLOC(T * mH * dv); c->ag = ALLOC(T * mH * dv);
        proj_(be, T, mH * dv, d->d, x1, p->mg, c->gl);
        be->sigmoid_mul(be, (size_t)T * mH * dv, c->gl, c->a, c->ag);
        ag = c->ag;
    }
    proj_(be, T, d->d, mH * dv, ag, p->mo, out);
}

// ---- FFN: dense SwiGLU (layer 0) or MoE (model.md §4) -----------------------------------------------

static void ffn_forward_(mtrl_model *m, mtrl_arena *ar, int l, int T, const real *x2, layer_cache *c, real *out,
                         const seg_out *so) {
    const mtrl_model_dims *d = &m->dims;
    const mtrl_layer_ptrs *p = &m->dP.layer[l];
    mtrl_backend *be = m->be;
    if (l == 0) {
        c->u1 = ALLOC(T * d->dense_I); c->u3 = ALLOC(T * d->dense_I);
        be->moe_swiglu_fwd(be, T, d->d, d->dense_I, x2, p->w1, p->w3, p->w2, c->u1, c->u3, out);
        return;
    }
    int E = d->E, K = d->k, mi = l - 1;
    c->zr = ALLOC(T * E); c->sr = ALLOC(T * E); c->wr = ALLOC(T * K);
    c->sel = IALLOC(T * K); c->offsets = IALLOC(E + 1); c->perm = IALLOC(T * K); c->pos = IALLOC(T * K);
    proj_(be, T, E, d->d, x2, p->router, c->zr);
    const real *beta = m->d_qb_beta + (size_t)l * E;
    int replay = so && so->routing_in;
    int *sel_h = NULL;
    if (replay || (so && so->routing_out)) sel_h = xmalloc(sizeof(int) * (size_t)T * K + 1);
    if (replay) {
        for (int t = 0; t < T; t++)
            for (int j = 0; j < K; j++) sel_h[t * K + j] = so->routing_in[((size_t)t * d->n_moe + mi) * K + j];
        be->upload(be, c->sel, sel_h, sizeof(int) * (size_t)T * K);
    }
    be->moe_router_fwd(be, T, E, K, c->zr, beta, d->score_softmax, d->rho, replay, c->sel, c->wr, c->sr);
    if (so && so->routing_out) {
        be->download(be, sel_h, c->sel, sizeof(int) * (size_t)T * K);
        for (int t = 0; t < T; t++)
            for (int j = 0; j < K; j++)
                so->routing_out[((size_t)t * d->n_moe + mi) * K + j] = (uint8_t)sel_h[t * K + j];
    }
    free(sel_h);
    if (so && so->qb_stats) {
        // QB (model.md §4.3): this batch routed with the old β above; the β it implies is
        // summed and only becomes the routing β after the optimizer step (mtrl_model_qb_apply).
        int load[256];
        be->moe_load_count(be, T, E, K, c->sel, load);
        for (int e = 0; e < E; e++) m->load[(size_t)l * E + e] += load[e];
        real bnew[256];
        if (!m->qb_frozen && be->qb_beta(be, T, E, K, c->zr, beta, bnew) == 0) {
            for (int e = 0; e < E; e++) m->qb_sum[(size_t)l * E + e] += bnew[e];
            m->qb_count[l]++;
        }
    }
    be->moe_dispatch(be, T, E, K, c->sel, c->offsets, c->perm, c->pos);
    int R = T * K;
    c->Xp = ALLOC(R * d->d); c->eu1 = ALLOC(R * d->I); c->eu3 = ALLOC(R * d->I); c->Yp = ALLOC(R * d->d);
    be->moe_gather(be, T, K, d->d, c->pos, x2, c->Xp);
    be->moe_experts_fwd(be, E, d->d, d->I, c->offsets, c->Xp, p->ew1, p->ew3, p->ew2, c->eu1, c->eu3, c->Yp);
    be->moe_combine_fwd(be, T, K, d->d, c->pos, c->wr, c->Yp, out);
    if (d->n_shared > 0) {
        int SI = d->n_shared * d->I;
        c->su1 = ALLOC(T * SI); c->su3 = ALLOC(T * SI);
        real *ys = ALLOC(T * d->d);
        be->moe_swiglu_fwd(be, T, d->d, SI, x2, p->sw1, p->sw3, p->sw2, c->su1, c->su3, ys);
        be->add(be, (size_t)T * d->d, out, ys, out);
    }
}

// ---- the stack ------------------------------------------------------------------------------------------

// Sources of AttnRes site j: the committed blocks, then the partial sum when it is non-empty.
static int site_sources_(const seg_cache *c, int j, const real **src) {
    int n = 0;
    for (int b = 0; b < c->nb_site[j]; b++) src[n++] = c->blocks[b];
    if (c->part[j]) src[n++] = c->part[j];
    return n;
}

void seg_forward(mtrl_model *m, mtrl_arena *ar, int mode, int T, const uint32_t *tokens, seq_io *io, seg_out *out,
                 seg_cache *c) {
    const mtrl_model_dims *d = &m->dims;
    mtrl_backend *be = m->be;
    int D = d->d, L = d->L;
    memset(c, 0, sizeof *c);
    c->T = T;
    c->mode = mode;
    int ids[4096];
    int *tid = T <= 4096 ? ids : xmalloc(sizeof(int) * (size_t)T);
    for (int t = 0; t < T; t++) tid[t] = (int)tokens[t];
    c->emb = ALLOC(T * D);
    be->embedding_fwd(be, T, D, tid, m->dP.embed, c->emb);
    if (tid != ids) free(tid);
    c->blocks[0] = c->emb;
    int nb = 1;
    real *p = NULL;
    const real *src[MTRL_MAX_LAYERS + 2];
    for (int l = 0; l < L; l++) {
        layer_cache *lc = &c->layer[l];
        if (l > 0 && l % d->S == 0) {
            c->blocks[nb++] = p;
            p = NULL;
        }
        // mixer sublayer j = 2l
        int j = 2 * l;
        c->part[j] = p;
        c->nb_site[j] = nb;
        lc->nsrc_a = site_sources_(c, j, src);
        lc->alpha_a = ALLOC(T * lc->nsrc_a);
        lc->h_a = ALLOC(T * D);
        be->attnres_site_fwd(be, T, D, lc->nsrc_a, src, m->dP.site_w + (size_t)j * D, m->dP.site_g + (size_t)j * D,
                             d->eps, lc->h_a, lc->alpha_a);
        lc->rstd1 = ALLOC(T); lc->x1 = ALLOC(T * D);
        be->rmsnorm_fwd(be, T, D, lc->h_a, m->dP.layer[l].norm1, d->eps, lc->x1, lc->rstd1);
        lc->mix = ALLOC(T * D);
        if (d->mixer[l] == 'K') kda_forward_(m, ar, l, mode, T, lc->x1, io, lc, lc->mix);
        else mla_forward_(m, ar, l, mode, T, lc->x1, io, lc, lc->mix);
        real *pn = ALLOC(T * D);
        be->add(be, (size_t)T * D, p, lc->mix, pn);
        p = pn;
        // FFN sublayer j = 2l + 1
        j = 2 * l + 1;
        c->part[j] = p;
        c->nb_site[j] = nb;
        lc->nsrc_f = site_sources_(c, j, src);
        lc->alpha_f = ALLOC(T * lc->nsrc_f);
        lc->h_f = ALLOC(T * D);
        be->attnres_site_fwd(be, T, D, lc->nsrc_f, src, m->dP.site_w + (size_t)j * D, m->dP.site_g + (size_t)j * D,
                             d->eps, lc->h_f, lc->alpha_f);
        lc->rstd2 = ALLOC(T); lc->x2 = ALLOC(T * D);
        be->rmsnorm_fwd(be, T, D, lc->h_f, m->dP.layer[l].norm2, d->eps, lc->x2, lc->rstd2);
        lc->ffn = ALLOC(T * D);
        ffn_forward_(m, ar, l, T, lc->x2, lc, lc->ffn, out);
        pn = ALLOC(T * D);
        be->add(be, (size_t)T * D, p, lc->ffn, pn);
        p = pn;
    }
    int j = 2 * L;
    c->part[j] = p;
    c->nb_site[j] = nb;
    c->nsrc_o = site_sources_(c, j, src);
    c->alpha_o = ALLOC(T * c->nsrc_o);
    c->h_o = ALLOC(T * D);
    be->attnres_site_fwd(be, T, D, c->nsrc_o, src, m->dP.site_w + (size_t)j * D, m->dP.site_g + (size_t)j * D, d->eps,
                         c->h_o, c->alpha_o);
    c->rstd_f = ALLOC(T); c->xf = ALLOC(T * D);
    be->rmsnorm_fwd(be, T, D, c->h_o, m->dP.final_norm, d->eps, c->xf, c->rstd_f);
    c->logits = ALLOC((size_t)T * d->V);
    proj_(be, T, d->V, D, c->xf, m->dP.lm_head, c->logits);
    if (out && out->logits) be->download(be, out->logits, c->logits, sizeof(real) * (size_t)T * d->V);
    if (out && out->logp) be->logprob_fwd(be, T, d->V, c->logits, out->targets, out->logp, out->entropy);
    if (mode == SEG_CHUNK) io->t0 += T;
    else
        for (int r = 0; r < T; r++) io[r].t0 += 1;
}

size_t seg_arena_bytes(const mtrl_model_dims *d, int T, int Tk) {
    (void)Tk;
    size_t HD = (size_t)d->H * d->D, mla = (size_t)d->mH * (d->dn + d->dr), ld = (size_t)d->dc + d->dr;
    size_t kda_tok = 13 * HD + 2 * (size_t)d->D + 2 * (size_t)d->H;
    size_t mla_tok = mla + 3 * ld + (size_t)d->mH * ld + (size_t)d->mH * d->dc + d->mH + 3 * (size_t)d->mH * d->dv + 2;
    size_t mix_tok = kda_tok > mla_tok ? kda_tok : mla_tok;
    size_t ffn_tok = 2 * (size_t)d->dense_I + 2 * (size_t)d->E + 4 * (size_t)d->k + 2 * (size_t)d->k * d->d +
                     2 * (size_t)d->k * d->I + 2 * (size_t)d->n_shared * d->I + d->d;
    size_t nb = (size_t)(d->L + d->S - 1) / d->S + 2;
    size_t site_tok = 2 * nb + 8 * (size_t)d->d + 4;
    size_t layer_tok = mix_tok + ffn_tok + site_tok;
    size_t per_tok = (size_t)d->L * layer_tok + 2 * (size_t)d->V + 4 * (size_t)d->d + nb;
    size_t S_sz = (size_t)d->H * d->D * d->D;
    size_t fixed_layer = ((size_t)kda_tile_count(T) + 4) * S_sz + 6 * (size_t)(d->W) * HD + (size_t)d->E + 64;
    // backward temporaries: one layer's worth of gradients plus dB, dp and the head.
    size_t bwd_tok = 2 * layer_tok + nb * (size_t)d->d + 4 * (size_t)d->d + (size_t)d->V;
    size_t floats = (size_t)T * (per_tok + bwd_tok) + (size_t)d->L * fixed_layer + 2 * fixed_layer;
    size_t allocs = (size_t)d->L * 160 + 256;
    return floats * sizeof(real) * 5 / 4 + allocs * 64 + (1u << 20);
}
