// model_fwd.c: the forward pass of one segment (see model_ws.h): embeddings, the Block-AttnRes
// stack of KDA / MLA mixers and dense / MoE FFNs (model.md §0.3, §6.2), the LM head and the
// per-token log-probabilities.
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
static void proj_(int T, int n, int k, const real *x, const real *W, real *y) {
    gemm_ref(0, 1, T, n, k, 1, x, k, W, k, 0, y, n);
}

static real sigmoid_(real x) { return (real)(1.0 / (1.0 + exp(-(double)x))); }

// ---- KDA (model.md §2.1) ----------------------------------------------------------------------------

static void kda_forward_(mtrl_model *m, mtrl_arena *ar, int l, int mode, int T, const real *x1, seq_io *io,
                         layer_cache *c, real *out) {
    const mtrl_model_dims *d = &m->dims;
    const mtrl_layer_ptrs *p = &m->P.layer[l];
    int H = d->H, D = d->D, HD = H * D, W = d->W, ki = model_kda_index(d, l);
    size_t conv_sz = (size_t)3 * (W - 1) * HD, S_sz = (size_t)H * D * D;
    c->pq = ALLOC(T * HD); c->pk = ALLOC(T * HD); c->pv = ALLOC(T * HD);
    proj_(T, HD, d->d, x1, p->wq, c->pq);
    proj_(T, HD, d->d, x1, p->wk, c->pk);
    proj_(T, HD, d->d, x1, p->wv, c->pv);
    c->cq = ALLOC(T * HD); c->ck = ALLOC(T * HD); c->cv = ALLOC(T * HD);
    if (mode == SEG_CHUNK) {
        real *st = io->conv + (size_t)ki * conv_sz;
        c->cst = ALLOC(conv_sz);
        memcpy(c->cst, st, sizeof(real) * conv_sz);
        size_t w1 = (size_t)(W - 1) * HD;
        shortconv_fwd(T, HD, W, c->pq, p->conv_q, c->cst, c->cq, st);
        shortconv_fwd(T, HD, W, c->pk, p->conv_k, c->cst + w1, c->ck, st + w1);
        shortconv_fwd(T, HD, W, c->pv, p->conv_v, c->cst + 2 * w1, c->cv, st + 2 * w1);
    } else {
        size_t w1 = (size_t)(W - 1) * HD;
        for (int r = 0; r < T; r++) {
            real *st = io[r].conv + (size_t)ki * conv_sz;
            shortconv_step(HD, W, c->pq + (size_t)r * HD, p->conv_q, st, c->cq + (size_t)r * HD);
            shortconv_step(HD, W, c->pk + (size_t)r * HD, p->conv_k, st + w1, c->ck + (size_t)r * HD);
            shortconv_step(HD, W, c->pv + (size_t)r * HD, p->conv_v, st + 2 * w1, c->cv + (size_t)r * HD);
        }
    }
    c->qn = ALLOC(T * HD); c->kn = ALLOC(T * HD);
    l2norm_fwd(T * H, D, c->cq, (real)1e-6, c->qn, NULL);
    l2norm_fwd(T * H, D, c->ck, (real)1e-6, c->kn, NULL);
    scale_inplace((size_t)T * HD, c->qn, (real)(1.0 / sqrt((double)D)));
    c->f1 = ALLOC(T * D); c->f = ALLOC(T * HD); c->g = ALLOC(T * HD);
    proj_(T, D, d->d, x1, p->wf1, c->f1);
    proj_(T, HD, D, c->f1, p->wf2, c->f);
    kda_gate_fwd(T, H, D, c->f, p->A_log, p->dt_bias, d->g_min, c->g);
    c->bl = ALLOC(T * H); c->beta = ALLOC(T * H);
    proj_(T, H, d->d, x1, p->wbeta, c->bl);
    for (int i = 0; i < T * H; i++) c->beta[i] = sigmoid_(c->bl[i]);
    c->o = ALLOC(T * HD);
    if (mode == SEG_CHUNK) {
        real *S = io->kda_S + (size_t)ki * S_sz;
        c->S0 = ALLOC(S_sz);
        memcpy(c->S0, S, sizeof(real) * S_sz);
        c->S_tiles = ALLOC((size_t)kda_tile_count(T) * S_sz);
        kda_chunk_fwd(T, H, D, D, c->qn, c->kn, c->cv, c->g, c->beta, c->S0, c->o, S, c->S_tiles);
    } else {
        for (int r = 0; r < T; r++) {
            size_t o = (size_t)r * HD;
            kda_step(H, D, D, c->qn + o, c->kn + o, c->cv + o, c->g + o, c->beta + (size_t)r * H,
                     io[r].kda_S + (size_t)ki * S_sz, c->o + o);
        }
    }
    c->z1 = ALLOC(T * D); c->z = ALLOC(T * HD); c->y = ALLOC(T * HD);
    proj_(T, D, d->d, x1, p->wz1, c->z1);
    proj_(T, HD, D, c->z1, p->wz2, c->z);
    gated_rmsnorm_fwd(T * H, D, c->o, c->z, p->onorm, d->eps, c->y);
    proj_(T, d->d, HD, c->y, p->wo, out);
}

// ---- gated MLA, absorbed over the latent (model.md §3.1, §3.3) ------------------------------------

static void mla_forward_(mtrl_model *m, mtrl_arena *ar, int l, int mode, int T, const real *x1, seq_io *io,
                         layer_cache *c, real *out) {
    const mtrl_model_dims *d = &m->dims;
    const mtrl_layer_ptrs *p = &m->P.layer[l];
    int mH = d->mH, dn = d->dn, dr = d->dr, dv = d->dv, dc = d->dc, ld = dc + dr;
    int mi = model_mla_index(d, l);
    real scale = (real)(1.0 / sqrt((double)(dn + dr)));
    c->q = ALLOC(T * mH * (dn + dr));
    proj_(T, mH * (dn + dr), d->d, x1, p->mq, c->q);
    real *lraw = ALLOC(T * ld);
    proj_(T, ld, d->d, x1, p->mkva, lraw);
    c->craw = ALLOC(T * dc); c->kr = ALLOC(T * dr); c->rstd_c = ALLOC(T);
    for (int t = 0; t < T; t++) {
        memcpy(c->craw + (size_t)t * dc, lraw + (size_t)t * ld, sizeof(real) * dc);
        memcpy(c->kr + (size_t)t * dr, lraw + (size_t)t * ld + dc, sizeof(real) * dr);
    }
    real *chat = ALLOC(T * dc);
    rmsnorm_fwd(T, dc, c->craw, p->mkv_norm, d->eps, chat, c->rstd_c);
    // The new latent rows [ĉ ; k^r] join the sequence's cache.
    for (int t = 0; t < T; t++) {
        seq_io *s = mode == SEG_CHUNK ? io : &io[t];
        int pos = mode == SEG_CHUNK ? io->t0 + t : s->t0;
        MTRL_CHECKF(pos < s->cap, "MLA latent cache full: position %d, capacity %d", pos, s->cap);
        real *row = s->latent + ((size_t)mi * s->cap + (size_t)pos) * ld;
        memcpy(row, chat + (size_t)t * dc, sizeof(real) * dc);
        memcpy(row + dc, c->kr + (size_t)t * dr, sizeof(real) * dr);
    }
    c->a = ALLOC(T * mH * dv);
    if (mode == SEG_CHUNK) {
        const real *lat = io->latent + (size_t)mi * io->cap * ld;
        int Tk = io->t0 + T;
        c->qt = ALLOC(T * mH * ld); c->ol = ALLOC(T * mH * dc); c->lse = ALLOC(T * mH);
        mla_absorb_q(T, mH, dn, dr, dv, dc, c->q, p->mkvb, c->qt);
        attn_causal_fwd(T, Tk, mH, 1, ld, dc, scale, c->qt, lat, ld, lat, ld, c->ol, c->lse);
        mla_up_v(T, mH, dn, dv, dc, c->ol, p->mkvb, c->a);
    } else {
        for (int r = 0; r < T; r++) {
            const real *lat = io[r].latent + (size_t)mi * io[r].cap * ld;
            mla_decode_absorbed_ld(mH, dn, dr, dv, dc, scale, c->q + (size_t)r * mH * (dn + dr), p->mkvb, lat, ld,
                                   lat + dc, ld, io[r].t0 + 1, c->a + (size_t)r * mH * dv);
        }
    }
    const real *ag = c->a;
    if (d->mla_gate) {
        c->gl = ALLOC(T * mH * dv); c->ag = ALLOC(T * mH * dv);
        proj_(T, mH * dv, d->d, x1, p->mg, c->gl);
        for (size_t i = 0; i < (size_t)T * mH * dv; i++) c->ag[i] = sigmoid_(c->gl[i]) * c->a[i];
        ag = c->ag;
    }
    proj_(T, d->d, mH * dv, ag, p->mo, out);
}

// ---- FFN: dense SwiGLU (layer 0) or MoE (model.md §4) -----------------------------------------------

static void ffn_forward_(mtrl_model *m, mtrl_arena *ar, int l, int T, const real *x2, layer_cache *c, real *out,
                         const seg_out *so) {
    const mtrl_model_dims *d = &m->dims;
    const mtrl_layer_ptrs *p = &m->P.layer[l];
    if (l == 0) {
        c->u1 = ALLOC(T * d->dense_I); c->u3 = ALLOC(T * d->dense_I);
        moe_swiglu_fwd(T, d->d, d->dense_I, x2, p->w1, p->w3, p->w2, c->u1, c->u3, out);
        return;
    }
    int E = d->E, K = d->k, mi = l - 1;
    c->zr = ALLOC(T * E); c->sr = ALLOC(T * E); c->wr = ALLOC(T * K);
    c->sel = IALLOC(T * K); c->offsets = IALLOC(E + 1); c->perm = IALLOC(T * K); c->pos = IALLOC(T * K);
    proj_(T, E, d->d, x2, p->router, c->zr);
    const real *beta = m->qb_beta + (size_t)l * E;
    int replay = so && so->routing_in;
    if (replay)
        for (int t = 0; t < T; t++)
            for (int j = 0; j < K; j++) c->sel[t * K + j] = so->routing_in[((size_t)t * d->n_moe + mi) * K + j];
    moe_router_fwd(T, E, K, c->zr, beta, d->score_softmax, d->rho, replay, c->sel, c->wr, c->sr);
    if (so && so->routing_out)
        for (int t = 0; t < T; t++)
            for (int j = 0; j < K; j++)
                so->routing_out[((size_t)t * d->n_moe + mi) * K + j] = (uint8_t)c->sel[t * K + j];
    if (so && so->qb_stats) {
        // QB (model.md §4.3): this batch routed with the old β above; the β it implies is
        // summed and only becomes the routing β after the optimizer step (mtrl_model_qb_apply).
        int load[256];
        moe_load_count(T, E, K, c->sel, load);
        for (int e = 0; e < E; e++) m->load[(size_t)l * E + e] += load[e];
        real bnew[256];
        if (!m->qb_frozen && qb_beta_from_batch(T, E, K, c->zr, beta, bnew) == 0) {
            for (int e = 0; e < E; e++) m->qb_sum[(size_t)l * E + e] += bnew[e];
            m->qb_count[l]++;
        }
    }
    moe_dispatch(T, E, K, c->sel, c->offsets, c->perm, c->pos);
    int R = T * K;
    c->Xp = ALLOC(R * d->d); c->eu1 = ALLOC(R * d->I); c->eu3 = ALLOC(R * d->I); c->Yp = ALLOC(R * d->d);
    moe_gather(T, K, d->d, c->pos, x2, c->Xp);
    moe_experts_fwd(E, d->d, d->I, c->offsets, c->Xp, p->ew1, p->ew3, p->ew2, c->eu1, c->eu3, c->Yp);
    moe_combine_fwd(T, K, d->d, c->pos, c->wr, c->Yp, out);
    if (d->n_shared > 0) {
        int SI = d->n_shared * d->I;
        c->su1 = ALLOC(T * SI); c->su3 = ALLOC(T * SI);
        real *ys = ALLOC(T * d->d);
        moe_swiglu_fwd(T, d->d, SI, x2, p->sw1, p->sw3, p->sw2, c->su1, c->su3, ys);
        for (size_t i = 0; i < (size_t)T * d->d; i++) out[i] += ys[i];
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
    int D = d->d, L = d->L;
    memset(c, 0, sizeof *c);
    c->T = T;
    c->mode = mode;
    int ids[4096];
    int *tid = T <= 4096 ? ids : IALLOC(T);
    for (int t = 0; t < T; t++) tid[t] = (int)tokens[t];
    c->emb = ALLOC(T * D);
    embedding_fwd(T, D, tid, m->P.embed, c->emb);
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
        attnres_site_fwd(T, D, lc->nsrc_a, src, m->P.site_w + (size_t)j * D, m->P.site_g + (size_t)j * D, d->eps,
                         lc->h_a, lc->alpha_a);
        lc->rstd1 = ALLOC(T); lc->x1 = ALLOC(T * D);
        rmsnorm_fwd(T, D, lc->h_a, m->P.layer[l].norm1, d->eps, lc->x1, lc->rstd1);
        lc->mix = ALLOC(T * D);
        if (d->mixer[l] == 'K') kda_forward_(m, ar, l, mode, T, lc->x1, io, lc, lc->mix);
        else mla_forward_(m, ar, l, mode, T, lc->x1, io, lc, lc->mix);
        real *pn = ALLOC(T * D);
        for (size_t i = 0; i < (size_t)T * D; i++) pn[i] = (p ? p[i] : 0) + lc->mix[i];
        p = pn;
        // FFN sublayer j = 2l + 1
        j = 2 * l + 1;
        c->part[j] = p;
        c->nb_site[j] = nb;
        lc->nsrc_f = site_sources_(c, j, src);
        lc->alpha_f = ALLOC(T * lc->nsrc_f);
        lc->h_f = ALLOC(T * D);
        attnres_site_fwd(T, D, lc->nsrc_f, src, m->P.site_w + (size_t)j * D, m->P.site_g + (size_t)j * D, d->eps,
                         lc->h_f, lc->alpha_f);
        lc->rstd2 = ALLOC(T); lc->x2 = ALLOC(T * D);
        rmsnorm_fwd(T, D, lc->h_f, m->P.layer[l].norm2, d->eps, lc->x2, lc->rstd2);
        lc->ffn = ALLOC(T * D);
        ffn_forward_(m, ar, l, T, lc->x2, lc, lc->ffn, out);
        pn = ALLOC(T * D);
        for (size_t i = 0; i < (size_t)T * D; i++) pn[i] = p[i] + lc->ffn[i];
        p = pn;
    }
    int j = 2 * L;
    c->part[j] = p;
    c->nb_site[j] = nb;
    c->nsrc_o = site_sources_(c, j, src);
    c->alpha_o = ALLOC(T * c->nsrc_o);
    c->h_o = ALLOC(T * D);
    attnres_site_fwd(T, D, c->nsrc_o, src, m->P.site_w + (size_t)j * D, m->P.site_g + (size_t)j * D, d->eps, c->h_o,
                     c->alpha_o);
    c->rstd_f = ALLOC(T); c->xf = ALLOC(T * D);
    rmsnorm_fwd(T, D, c->h_o, m->P.final_norm, d->eps, c->xf, c->rstd_f);
    c->logits = ALLOC((size_t)T * d->V);
    proj_(T, d->V, D, c->xf, m->P.lm_head, c->logits);
    if (out && out->logits) memcpy(out->logits, c->logits, sizeof(real) * (size_t)T * d->V);
    if (out && out->logp) logits_logprob_fwd(T, d->V, c->logits, out->targets, out->logp, out->entropy);
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
