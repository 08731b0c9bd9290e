// model_fwd.c: the forward pass of one segment (see model_ws.h): embeddings, the Block-AttnRes
// stack of KDA / MLA mixers and dense / MoE FFNs (docs/model.md §0.3, §6.2), the LM head and the
// per-token log-probabilities. Every operation goes through the model's backend (backend.h):
// the arrays below live where the model computes.
#include <math.h>
#include <string.h>

#include <stdlib.h>

#include "common/check.h"
#include "model/backend.h"
#include "model/model_image.h"
#include "model/model_moe.h"
#include "model/model_ws.h"
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

// ---- KDA (docs/model.md §2.1) ----------------------------------------------------------------------------

static void kda_forward_(mtrl_model *m, mtrl_arena *ar, int l, int mode, int T, const real *x1, seq_io *io,
                         const seg_decode *dec, layer_cache *c, real *out) {
    const mtrl_model_dims *d = &m->dims;
    const mtrl_layer_ptrs *p = &m->dP.layer[l];
    mtrl_backend *be = m->be;
    int H = d->H, D = d->D, HD = H * D, W = d->W, ki = model_kda_index(d, l);
    size_t conv_sz = (size_t)3 * (W - 1) * HD, S_sz = (size_t)H * D * D;
    c->pq = ALLOC((size_t)T * HD); c->pk = ALLOC((size_t)T * HD); c->pv = ALLOC((size_t)T * HD);
    double t = model_prof_begin(m);
    proj_(be, T, HD, d->d, x1, p->wq, c->pq);
    proj_(be, T, HD, d->d, x1, p->wk, c->pk);
    proj_(be, T, HD, d->d, x1, p->wv, c->pv);
    model_prof_end(m, MTRL_PROF_KDA_PROJ, t);
    t = model_prof_begin(m);
    c->cq = ALLOC((size_t)T * HD); c->ck = ALLOC((size_t)T * HD); c->cv = ALLOC((size_t)T * HD);
    size_t w1 = (size_t)(W - 1) * HD;
    if (mode != SEG_DECODE) {
        c->cst = ALLOC(conv_sz);
        // A packed segment's pieces start from the zero window (io's window takes their
        // scratch), or each from its own window (piece_io: the window is copied to cst first).
        real *st = io->piece_io ? NULL : io->conv + (size_t)ki * conv_sz;
        if (!io->n_piece) be->copy(be, c->cst, st, sizeof(real) * conv_sz);
        else if (!io->piece_io) be->zero(be, c->cst, sizeof(real) * conv_sz);
        const real *px[3] = {c->pq, c->pk, c->pv}, *cw[3] = {p->conv_q, p->conv_k, p->conv_v};
        real *cy[3] = {c->cq, c->ck, c->cv};
        // piece_io: the pieces' windows of this projection (each read, then advanced in place)
        real **win = io->piece_io ? xmalloc(sizeof(real *) * (size_t)io->n_piece) : NULL;
        for (int s = 0; s < 3; s++) {
            if (io->n_piece && !io->piece_io) { // every piece from the zero window: one call
                be->shortconv_fwd_varlen(be, io->n_piece, io->piece, HD, W, px[s], cw[s], cy[s]);
                continue;
            }
            if (win) { // every piece from its own window: one call
                for (int i = 0; i < io->n_piece; i++) win[i] = io->piece_io[i].conv + (size_t)ki * conv_sz + s * w1;
                be->shortconv_fwd_varlen_io(be, io->n_piece, io->piece, HD, W, px[s], cw[s],
                                            (const real *const *)win, win, cy[s]);
                continue;
            }
            for (int i = 0; i < seq_pieces(io); i++) {
                int Ti;
                size_t o = (size_t)seq_piece(io, T, i, &Ti) * HD;
                real *out_st = io->piece_io ? io->piece_io[i].conv + (size_t)ki * conv_sz + s * w1 : st + s * w1;
                if (io->piece_io) be->copy(be, c->cst + s * w1, out_st, sizeof(real) * w1);
                be->shortconv_fwd(be, Ti, HD, W, px[s] + o, cw[s], c->cst + s * w1, cy[s] + o, out_st);
            }
        }
        free(win);
    } else {
        const real *px[3] = {c->pq, c->pk, c->pv}, *cw[3] = {p->conv_q, p->conv_k, p->conv_v};
        real *cy[3] = {c->cq, c->ck, c->cv};
        for (int s = 0; s < 3; s++)
            be->shortconv_step(be, T, HD, W, px[s], cw[s], dec->win + ((size_t)ki * 3 + s) * T, cy[s]);
    }
    c->qn = ALLOC((size_t)T * HD); c->kn = ALLOC((size_t)T * HD);
    be->l2norm_fwd(be, T * H, D, c->cq, (real)1e-6, c->qn);
    be->l2norm_fwd(be, T * H, D, c->ck, (real)1e-6, c->kn);
    be->scale(be, (size_t)T * HD, c->qn, (real)(1.0 / sqrt((double)D)));
    model_prof_end(m, MTRL_PROF_KDA_ELEM, t);
    c->f1 = ALLOC((size_t)T * D); c->f = ALLOC((size_t)T * HD); c->g = ALLOC((size_t)T * HD);
    c->bl = ALLOC((size_t)T * H); c->beta = ALLOC((size_t)T * H);
    t = model_prof_begin(m);
    proj_(be, T, D, d->d, x1, p->wf1, c->f1);
    proj_(be, T, HD, D, c->f1, p->wf2, c->f);
    proj_(be, T, H, d->d, x1, p->wbeta, c->bl);
    model_prof_end(m, MTRL_PROF_KDA_PROJ, t);
    t = model_prof_begin(m);
    be->sigmoid(be, (size_t)T * H, c->bl, c->beta);
    model_prof_end(m, MTRL_PROF_KDA_ELEM, t);
    c->o = ALLOC((size_t)T * HD);
    // the gate next to the delta rule: together they are the profile's KDA core
    t = model_prof_begin(m);
    be->kda_gate_fwd(be, d->kda_gate, T, H, D, c->f, p->A_log, p->dt_bias, d->g_min, c->g);
    if (mode != SEG_DECODE) {
        real *S = io->piece_io ? NULL : io->kda_S + (size_t)ki * S_sz;
        c->S0 = ALLOC(S_sz);
        if (!io->n_piece) be->copy(be, c->S0, S, sizeof(real) * S_sz);
        else if (!io->piece_io) be->zero(be, c->S0, sizeof(real) * S_sz); // piece_io: each piece's own, below
        // the tile states are for a backward: a prefill stores none
        c->S_tiles = mode == SEG_PREFILL ? NULL : ALLOC((size_t)seg_kda_tiles(T, io) * S_sz);
        if (io->n_piece && !io->piece_io) {
            // Pieces each from the zero state: one call for them all (on a GPU one launch per
            // kernel stage instead of two per piece); their final states go nowhere (model_ws.h).
            be->kda_chunk_fwd_varlen(be, io->n_piece, io->piece, H, D, D, c->qn, c->kn, c->cv, c->g, c->beta, c->o,
                                     NULL, c->S_tiles);
        } else if (io->piece_io && io->n_piece > 1) {
            // Pieces each continuing its own state, advanced in place: one call for them all. One
            // piece alone takes the per-piece form below, whose long-sequence forms (the
            // chunk-parallel pieces of backend kda_chunk_fwd) the varlen form does not have.
            real **Sp = xmalloc(sizeof(real *) * (size_t)io->n_piece);
            for (int i = 0; i < io->n_piece; i++) Sp[i] = io->piece_io[i].kda_S + (size_t)ki * S_sz;
            be->kda_chunk_fwd_varlen_io(be, io->n_piece, io->piece, H, D, D, c->qn, c->kn, c->cv, c->g, c->beta,
                                        (const real *const *)Sp, c->o, Sp, c->S_tiles);
            free(Sp);
        } else {
            size_t tile = 0;
            for (int i = 0; i < seq_pieces(io); i++) {
                int Ti, o = seq_piece(io, T, i, &Ti);
                size_t x = (size_t)o * HD, h = (size_t)o * H;
                real *S_out = S;
                if (io->piece_io) { // the piece's own state in, its successor out
                    S_out = io->piece_io[i].kda_S + (size_t)ki * S_sz;
                    be->copy(be, c->S0, S_out, sizeof(real) * S_sz);
                }
                be->kda_chunk_fwd(be, Ti, H, D, D, c->qn + x, c->kn + x, c->cv + x, c->g + x, c->beta + h, c->S0,
                                  c->o + x, S_out, c->S_tiles ? c->S_tiles + tile * S_sz : NULL);
                tile += (size_t)mtrl_ref_kda_tile_count(Ti);
            }
        }
    } else {
        size_t o = (size_t)ki * T;
        be->kda_step(be, T, H, D, D, c->qn, c->kn, c->cv, c->g, c->beta, dec->S_h + o, dec->S + o, c->o);
    }
    model_prof_end(m, MTRL_PROF_KDA_CORE, t);
    c->z1 = ALLOC((size_t)T * D); c->z = ALLOC((size_t)T * HD); c->y = ALLOC((size_t)T * HD);
    t = model_prof_begin(m);
    proj_(be, T, D, d->d, x1, p->wz1, c->z1);
    proj_(be, T, HD, D, c->z1, p->wz2, c->z);
    model_prof_end(m, MTRL_PROF_KDA_PROJ, t);
    t = model_prof_begin(m);
    be->gated_rmsnorm_fwd(be, T * H, D, c->o, c->z, p->onorm, d->eps, c->y);
    model_prof_end(m, MTRL_PROF_KDA_ELEM, t);
    t = model_prof_begin(m);
    proj_(be, T, d->d, HD, c->y, p->wo, out);
    model_prof_end(m, MTRL_PROF_KDA_PROJ, t);
}

// ---- gated MLA, absorbed over the latent (docs/model.md §3.1, §3.3) ------------------------------------

// Writes rows [ĉ ; k^r] of B caches: cache b's rows are dst_h[b] (latent elements, row stride ld)
// and take `rows` consecutive rows of chat [.][dc] and kr [.][dr] (backend.h latent_put rounds
// them to the stored type).
static void latent_write_(mtrl_backend *be, int B, int rows, int dc, int dr, const real *chat, const real *kr,
                          void *const *dst_h) {
    int ld = dc + dr;
    void **kdst = xmalloc(sizeof(void *) * (size_t)B);
    for (int b = 0; b < B; b++) kdst[b] = mtrl_latent_at(be, dst_h[b], (size_t)dc);
    be->latent_put(be, B, rows, dc, chat, dc, dst_h, ld);
    if (dr > 0) be->latent_put(be, B, rows, dr, kr, dr, kdst, ld);
    free(kdst);
}

// seg_mla_expand's rows from one cache (lat: Tk consecutive rows) or, lat = NULL, from anywhere
// (rows_h: Tk row pointers, the pieces of a piece_io pack, one gather for all).
static mla_kv mla_expand_(mtrl_model *m, mtrl_arena *ar, int l, int Tk, const void *lat, const void *const *rows_h) {
    const mtrl_model_dims *d = &m->dims;
    mtrl_backend *be = m->be;
    int mH = d->mH, dn = d->dn, dr = d->dr, dv = d->dv, dc = d->dc, ld = dc + dr, ldk = mH * (dn + dr);
    mla_kv x;
    x.k = mtrl_arena_alloc(ar, be->latent_size * (size_t)Tk * ldk);  // the latent type: bf16 on a GPU
    x.v = mtrl_arena_alloc(ar, be->latent_size * (size_t)Tk * mH * dv);
    x.lr = ALLOC((size_t)Tk * ld);
    size_t mark = mtrl_arena_mark(ar);
    real *k = ALLOC((size_t)Tk * ldk), *v = ALLOC((size_t)Tk * mH * dv);
    if (lat) be->latent_get(be, Tk, ld, lat, ld, x.lr, ld);
    else be->latent_gather(be, Tk, ld, rows_h, x.lr, ld);
    be->mla_expand_kv(be, Tk, mH, dn, dr, dv, dc, x.lr, ld, x.lr + dc, ld, m->dP.layer[l].mkvb, k, v);
    be->latent_put(be, 1, Tk, ldk, k, ldk, &x.k, ldk);
    be->latent_put(be, 1, Tk, mH * dv, v, mH * dv, &x.v, mH * dv);
    mtrl_arena_release(ar, mark);
    return x;
}

mla_kv seg_mla_expand(mtrl_model *m, mtrl_arena *ar, int l, int Tk, const void *lat) {
    return mla_expand_(m, ar, l, Tk, lat, NULL);
}

static size_t mla_naive_bytes_(const mtrl_model_dims *d, size_t Tk, size_t lat);

static void mla_forward_(mtrl_model *m, mtrl_arena *ar, int l, int mode, int T, const real *x1, seq_io *io,
                         const seg_decode *dec, layer_cache *c, real *out) {
    const mtrl_model_dims *d = &m->dims;
    const mtrl_layer_ptrs *p = &m->dP.layer[l];
    mtrl_backend *be = m->be;
    int mH = d->mH, dn = d->dn, dr = d->dr, dv = d->dv, dc = d->dc, ld = dc + dr;
    int mi = model_mla_index(d, l);
    real scale = (real)(1.0 / sqrt((double)(dn + dr)));
    c->q = ALLOC((size_t)T * mH * (dn + dr));
    real *lraw = ALLOC((size_t)T * ld);
    double t = model_prof_begin(m);
    proj_(be, T, mH * (dn + dr), d->d, x1, p->mq, c->q);
    proj_(be, T, ld, d->d, x1, p->mkva, lraw);
    model_prof_end(m, MTRL_PROF_MLA_PROJ, t);
    c->craw = ALLOC((size_t)T * dc); c->kr = ALLOC((size_t)T * dr); c->rstd_c = ALLOC(T);
    t = model_prof_begin(m);
    be->copy_rows(be, T, dc, lraw, ld, c->craw, dc);
    be->copy_rows(be, T, dr, lraw + dc, ld, c->kr, dr);
    real *chat = ALLOC((size_t)T * dc);
    be->rmsnorm_fwd(be, T, dc, c->craw, p->mkv_norm, d->kv_eps, chat, c->rstd_c);
    // The new latent rows [ĉ ; k^r] join the sequence's cache.
    if (mode != SEG_DECODE && io->piece_io) {
        // Each token's row to its own piece's cache, all in one write (as the decode's rows):
        // no launches per piece.
        MTRL_CHECK(io->piece[0] == 0 && io->piece[io->n_piece] == T); // every row has its piece
        void **rows = xmalloc(sizeof(void *) * (size_t)(T > 0 ? T : 1));
        for (int i = 0; i < io->n_piece; i++) {
            const seq_io *pi = &io->piece_io[i];
            int Ti, o = seq_piece(io, T, i, &Ti);
            MTRL_CHECKF(pi->t0 + Ti <= pi->cap, "MLA latent cache full: position %d, capacity %d", pi->t0 + Ti - 1,
                        pi->cap);
            for (int r = 0; r < Ti; r++)
                rows[o + r] = mtrl_latent_at(be, pi->latent, ((size_t)mi * pi->cap + (size_t)pi->t0 + r) * ld);
        }
        latent_write_(be, T, 1, dc, dr, chat, c->kr, rows);
        free(rows);
    } else if (mode != SEG_DECODE) {
        MTRL_CHECKF(io->t0 + T <= io->cap, "MLA latent cache full: position %d, capacity %d", io->t0 + T - 1, io->cap);
        void *row = mtrl_latent_at(be, io->latent, ((size_t)mi * io->cap + (size_t)io->t0) * ld);
        latent_write_(be, 1, T, dc, dr, chat, c->kr, &row);
    } else { // the rows' positions were checked against their capacities with the step's arguments
        void *const *rows = dec->row + (size_t)mi * 2 * T;
        be->latent_put_rows(be, T, dc, chat, dc, rows, ld);
        if (dr > 0) be->latent_put_rows(be, T, dr, c->kr, dr, rows + T, ld);
    }
    model_prof_end(m, MTRL_PROF_MLA_ELEM, t);
    c->a = ALLOC((size_t)T * mH * dv);
    if ((mode == SEG_CHUNK && !d->mla_absorbed) || (mode == SEG_PREFILL && d->mla_prefill_naive && !io->piece_io)) {
        // Naive form: every key so far (a packed segment: its own rows) expanded per head,
        // attention with Hk = H over Dk = dn+dr, Dv = dv, straight into a.
        MTRL_CHECK(!io->piece_io);
        c->lse = ALLOC((size_t)T * mH);
        int Tk = io->n_piece ? T : io->t0 + T, ldk = mH * (dn + dr);
        size_t mark = mtrl_arena_mark(ar);
        t = model_prof_begin(m);
        MTRL_CHECK(!io->n_piece || io->t0 == 0);
        mla_kv x = seg_mla_expand(m, ar, l, Tk, mtrl_latent_at(be, io->latent, (size_t)mi * io->cap * ld));
        model_prof_end(m, MTRL_PROF_MLA_ABSORB, t);
        t = model_prof_begin(m);
        if (io->n_piece) // every piece over its own rows (its keys), in one call
            be->attn_causal_fwd_varlen(be, io->n_piece, io->piece, NULL, mH, mH, dn + dr, dv, scale, c->q, x.k, ldk,
                                       x.v, mH * dv, c->a, c->lse);
        else
            be->attn_causal_fwd(be, T, Tk, mH, mH, dn + dr, dv, scale, c->q, x.k, ldk, x.v, mH * dv, c->a, c->lse);
        model_prof_end(m, MTRL_PROF_MLA_ATTN, t);
        mtrl_arena_release(ar, mark);
    } else if (mode == SEG_PREFILL && d->mla_prefill_naive) {
        // Naive prefill of pieces that continue their own caches: the keys so far of a group of
        // consecutive pieces expanded together (one gather of their cache rows, one expansion,
        // as many keys as the arena has room for, at least one piece's: what seg_prefill_bytes
        // sizes), each piece's rows attending to its own keys; the group's scratch is released
        // before the next.
        c->lse = ALLOC((size_t)T * mH);
        int ldk = mH * (dn + dr);
        const void **rows = NULL;
        int nrows = 0;
        for (int i0 = 0, i1; i0 < io->n_piece; i0 = i1) {
            size_t room = ar->cap - ((ar->used + 63) & ~(size_t)63), K = 0;
            for (i1 = i0; i1 < io->n_piece; i1++) {
                int Ti;
                seq_piece(io, T, i1, &Ti);
                size_t Ki = (size_t)io->piece_io[i1].t0 + (size_t)Ti;
                if (i1 > i0 && mla_naive_bytes_(d, K + Ki, be->latent_size) + 64 > room) break;
                K += Ki;
            }
            if ((int)K > nrows) {
                nrows = (int)K;
                rows = xrealloc(rows, sizeof(void *) * K);
            }
            for (int i = i0, r = 0; i < i1; i++) { // the group's cache rows, piece after piece
                const seq_io *pi = &io->piece_io[i];
                int Ti;
                seq_piece(io, T, i, &Ti);
                for (int j = 0; j < pi->t0 + Ti; j++)
                    rows[r++] = mtrl_latent_at(be, pi->latent, ((size_t)mi * pi->cap + (size_t)j) * ld);
            }
            size_t mark = mtrl_arena_mark(ar);
            t = model_prof_begin(m);
            mla_kv x = mla_expand_(m, ar, l, (int)K, NULL, rows);
            model_prof_end(m, MTRL_PROF_MLA_ABSORB, t);
            t = model_prof_begin(m);
            // the group's pieces in one call: piece i's rows over its keys, the group's keys
            // laid out piece after piece (its earlier positions, then its new rows)
            int *ko = xmalloc(sizeof(int) * (size_t)(i1 - i0 + 1));
            ko[0] = 0;
            for (int i = i0; i < i1; i++) {
                int Ti;
                seq_piece(io, T, i, &Ti);
                ko[i - i0 + 1] = ko[i - i0] + io->piece_io[i].t0 + Ti;
            }
            be->attn_causal_fwd_varlen(be, i1 - i0, io->piece + i0, ko, mH, mH, dn + dr, dv, scale, c->q, x.k, ldk,
                                       x.v, mH * dv, c->a, c->lse);
            free(ko);
            model_prof_end(m, MTRL_PROF_MLA_ATTN, t);
            mtrl_arena_release(ar, mark);
        }
        free(rows);
    } else if (mode != SEG_DECODE) {
        c->qt = ALLOC((size_t)T * mH * ld); c->ol = ALLOC((size_t)T * mH * dc); c->lse = ALLOC((size_t)T * mH);
        t = model_prof_begin(m);
        be->mla_absorb_q(be, T, mH, dn, dr, dv, dc, c->q, p->mkvb, c->qt);
        model_prof_end(m, MTRL_PROF_MLA_ABSORB, t);
        t = model_prof_begin(m);
        if (!io->n_piece) {
            const void *lat = mtrl_latent_at(be, io->latent, (size_t)mi * io->cap * ld);
            be->attn_causal_fwd(be, T, io->t0 + T, mH, 1, ld, dc, scale, c->qt, lat, ld, lat, ld, c->ol, c->lse);
        } else if (!io->piece_io) {
            // Each piece attends to its own rows of the packed latents: one call.
            MTRL_CHECK(io->t0 == 0);
            const void *lat = mtrl_latent_at(be, io->latent, (size_t)mi * io->cap * ld);
            be->attn_causal_fwd_varlen(be, io->n_piece, io->piece, NULL, mH, 1, ld, dc, scale, c->qt, lat, ld, lat,
                                       ld, c->ol, c->lse);
        } else {
            // Each piece attends to its own cache, the earlier positions too (caches apart: once
            // per piece).
            for (int i = 0; i < io->n_piece; i++) {
                int Ti;
                size_t o = (size_t)seq_piece(io, T, i, &Ti);
                int Tk = Ti;
                const void *lat = mtrl_latent_at(be, io->latent, ((size_t)mi * io->cap + o) * ld);
                if (io->piece_io) {
                    const seq_io *pi = &io->piece_io[i];
                    lat = mtrl_latent_at(be, pi->latent, (size_t)mi * pi->cap * ld);
                    Tk = pi->t0 + Ti;
                }
                be->attn_causal_fwd(be, Ti, Tk, mH, 1, ld, dc, scale, c->qt + o * mH * ld, lat, ld, lat, ld,
                                    c->ol + o * mH * dc, c->lse + o * mH);
            }
        }
        model_prof_end(m, MTRL_PROF_MLA_ATTN, t);
        t = model_prof_begin(m);
        be->mla_up_v(be, T, mH, dn, dv, dc, c->ol, p->mkvb, c->a);
        model_prof_end(m, MTRL_PROF_MLA_ABSORB, t);
    } else {
        size_t o = (size_t)mi * T;
        t = model_prof_begin(m);
        be->mla_decode(be, T, mH, dn, dr, dv, dc, scale, c->q, p->mkvb, dec->lat_h + o, dec->lat + o, ld, dec->Tk_h,
                       dec->Tk, c->a);
        model_prof_end(m, MTRL_PROF_MLA_ATTN, t);
    }
    const real *ag = c->a;
    if (d->mla_gate) {
        c->gl = ALLOC((size_t)T * mH * dv); c->ag = ALLOC((size_t)T * mH * dv);
        t = model_prof_begin(m);
        proj_(be, T, mH * dv, d->d, x1, p->mg, c->gl);
        model_prof_end(m, MTRL_PROF_MLA_PROJ, t);
        t = model_prof_begin(m);
        be->sigmoid_mul(be, (size_t)T * mH * dv, c->gl, c->a, c->ag);
        model_prof_end(m, MTRL_PROF_MLA_ELEM, t);
        ag = c->ag;
    }
    t = model_prof_begin(m);
    proj_(be, T, d->d, mH * dv, ag, p->mo, out);
    model_prof_end(m, MTRL_PROF_MLA_PROJ, t);
}

// ---- FFN: dense SwiGLU (layers below first_dense) or MoE (docs/model.md §4) ---------------------------
// The MoE layer in phases (model_moe.h): the expert-parallel layer runs the same ones.

static void *arena_alloc_(void *ar, size_t bytes) { return mtrl_arena_alloc(ar, bytes); }

void mtrl_model_moe_rows_carve(const mtrl_model_dims *d, int T, void *(*alloc)(void *user, size_t bytes), void *user,
                               mtrl_model_moe_rows *r) {
    size_t E = (size_t)d->E, K = (size_t)d->k, R = (size_t)T * K, rs = sizeof(real), is = sizeof(int);
    memset(r, 0, sizeof *r);
    r->z = alloc(user, rs * T * E); r->s = alloc(user, rs * T * E); r->w = alloc(user, rs * R);
    r->sel = alloc(user, is * R); r->offsets = alloc(user, is * (E + 1));
    r->perm = alloc(user, is * R); r->pos = alloc(user, is * R);
    r->X = alloc(user, rs * R * d->d); r->u1 = alloc(user, rs * R * d->I);
    r->u3 = alloc(user, rs * R * d->I); r->Y = alloc(user, rs * R * d->d);
    if (d->n_shared > 0) {
        size_t SI = (size_t)d->n_shared * d->I;
        r->su1 = alloc(user, rs * T * SI); r->su3 = alloc(user, rs * T * SI);
    }
}

void mtrl_model_moe_route_fwd(mtrl_model *m, int l, int T, const real *x, const uint8_t *routing_in,
                              uint8_t *routing_out, mtrl_model_moe_rows *r) {
    const mtrl_model_dims *d = &m->dims;
    mtrl_backend *be = m->be;
    int E = d->E, K = d->k, mi = mtrl_model_moe_index(d, l);
    MTRL_CHECKF(mi >= 0, "MoE routing of layer %d, a dense layer", l);
    double t = model_prof_begin(m);
    proj_(be, T, E, d->d, x, m->dP.layer[l].router, r->z);
    int *sel_h = NULL;
    if (routing_in || routing_out) sel_h = xmalloc(sizeof(int) * (size_t)T * K + 1);
    if (routing_in) {
        for (int t = 0; t < T; t++)
            for (int j = 0; j < K; j++) sel_h[t * K + j] = routing_in[((size_t)t * d->n_moe + mi) * K + j];
        be->upload(be, r->sel, sel_h, sizeof(int) * (size_t)T * K);
    }
    be->moe_router_fwd(be, T, E, K, r->z, m->d_qb_beta + (size_t)l * E, model_router_form(d), d->rho,
                       routing_in != NULL, r->sel, r->w, r->s);
    if (routing_out) {
        be->download(be, sel_h, r->sel, sizeof(int) * (size_t)T * K);
        for (int t = 0; t < T; t++)
            for (int j = 0; j < K; j++) routing_out[((size_t)t * d->n_moe + mi) * K + j] = (uint8_t)sel_h[t * K + j];
    }
    free(sel_h);
    be->moe_dispatch(be, T, E, K, r->sel, r->offsets, r->perm, r->pos);
    be->moe_gather(be, T, K, d->d, r->pos, x, r->X);
    model_prof_end(m, MTRL_PROF_MOE_ROUTE, t);
}

void mtrl_model_moe_observe(mtrl_model *m, int l, int T, const mtrl_model_moe_rows *r, int level, double *st) {
    const mtrl_model_dims *d = &m->dims;
    mtrl_backend *be = m->be;
    int E = d->E, K = d->k;
    MTRL_CHECKF(E <= 256, "QB statistics of %d experts (at most 256)", E);
    memset(st, 0, sizeof *st * (size_t)MTRL_MODEL_MOE_STATS(E));
    if (level <= 0) return;
    double t = model_prof_begin(m);
    // QB (docs/model.md §4.3): this batch routed with the old β; the β it implies is summed and
    // only becomes the routing β after the optimizer step (mtrl_qb_apply, qb.h).
    int load[256];
    be->moe_load_count(be, T, E, K, r->sel, load);
    for (int e = 0; e < E; e++) st[e] = load[e];
    real bnew[256];
    // QB balances the scores the router selected on: z, or s (router_bias = score)
    const real *sc = d->router_bias_score ? r->s : r->z;
    if (level >= 2 && be->qb_beta(be, T, E, K, sc, m->d_qb_beta + (size_t)l * E, bnew) == 0) {
        for (int e = 0; e < E; e++) st[E + e] = bnew[e];
        st[2 * E] = 1;
    }
    model_prof_end(m, MTRL_PROF_MOE_ROUTE, t);
}

void mtrl_model_moe_observe_add(mtrl_model *m, int l, const double *st) {
    int E = m->dims.E;
    for (int e = 0; e < E; e++) {
        m->load[(size_t)l * E + e] += (long)st[e];
        m->qb_sum[(size_t)l * E + e] += st[E + e];
    }
    m->qb_count[l] += (int)st[2 * E];
}

void mtrl_model_moe_experts_fwd(mtrl_model *m, int l, int e0, int e1, int rows, const int *offsets, const real *X,
                                real *u1, real *u3, real *Y) {
    const mtrl_model_dims *d = &m->dims;
    const mtrl_layer_ptrs *p = &m->dP.layer[l];
    MTRL_CHECKF(0 <= e0 && e0 <= e1 && e1 <= d->E, "experts %d..%d of %d", e0, e1 - 1, d->E);
    size_t w = (size_t)e0 * d->I * d->d; // expert e0's first element of every [E][..] weight
    double t = model_prof_begin(m);
    m->be->moe_experts_fwd(m->be, e1 - e0, d->d, d->I, rows, offsets, X, p->ew1 + w, p->ew3 + w, p->ew2 + w, u1, u3,
                           Y);
    model_prof_end(m, MTRL_PROF_MOE_EXPERTS, t);
}

void mtrl_model_moe_combine_fwd(mtrl_model *m, int l, int T, const real *x, mtrl_model_moe_rows *r, real *ys, real *y) {
    const mtrl_model_dims *d = &m->dims;
    const mtrl_layer_ptrs *p = &m->dP.layer[l];
    mtrl_backend *be = m->be;
    double t = model_prof_begin(m);
    be->moe_combine_fwd(be, T, d->k, d->d, r->pos, r->w, r->Y, y);
    model_prof_end(m, MTRL_PROF_MOE_ROUTE, t);
    if (d->n_shared > 0) {
        t = model_prof_begin(m);
        be->moe_swiglu_fwd(be, T, d->d, d->n_shared * d->I, x, p->sw1, p->sw3, p->sw2, r->su1, r->su3, ys);
        be->add(be, (size_t)T * d->d, y, ys, y);
        model_prof_end(m, MTRL_PROF_MOE_SHARED, t);
    }
}

// The layer of mtrl_model_moe_layer_fwd with its routed experts run by fn when it is set
// (model.h mtrl_model_set_experts; r->u1, u3 are then carved but left unwritten: the experts'
// activations live with their owner).
static void moe_layer_fwd_(mtrl_model *m, mtrl_arena *ar, int l, int T, const real *x, const uint8_t *routing_in,
                           uint8_t *routing_out, int level, const mtrl_model_experts_fn *fn, mtrl_model_moe_rows *r,
                           real *y) {
    const mtrl_model_dims *d = &m->dims;
    mtrl_model_moe_rows_carve(d, T, arena_alloc_, ar, r);
    mtrl_model_moe_route_fwd(m, l, T, x, routing_in, routing_out, r);
    if (level > 0) {
        double st[MTRL_MODEL_MOE_STATS(256)];
        mtrl_model_moe_observe(m, l, T, r, level, st);
        mtrl_model_moe_observe_add(m, l, st);
    }
    if (fn) fn->fwd(fn->user, l, T * d->k, r->offsets, r->X, r->Y);
    else mtrl_model_moe_experts_fwd(m, l, 0, d->E, T * d->k, r->offsets, r->X, r->u1, r->u3, r->Y);
    mtrl_model_moe_combine_fwd(m, l, T, x, r, d->n_shared > 0 ? ALLOC((size_t)T * d->d) : NULL, y);
}

void mtrl_model_moe_layer_fwd(mtrl_model *m, mtrl_arena *ar, int l, int T, const real *x, const uint8_t *routing_in,
                              uint8_t *routing_out, int level, mtrl_model_moe_rows *r, real *y) {
    moe_layer_fwd_(m, ar, l, T, x, routing_in, routing_out, level, NULL, r, y);
}

// fn: the experts elsewhere (model.h mtrl_model_set_experts), for a training segment only.
static void ffn_forward_(mtrl_model *m, mtrl_arena *ar, int l, int T, const real *x2, layer_cache *c, real *out,
                         const seg_out *so, const mtrl_model_experts_fn *fn) {
    const mtrl_model_dims *d = &m->dims;
    const mtrl_layer_ptrs *p = &m->dP.layer[l];
    mtrl_backend *be = m->be;
    if (mtrl_model_is_dense(d, l)) {
        c->u1 = ALLOC((size_t)T * d->dense_I); c->u3 = ALLOC((size_t)T * d->dense_I);
        double t = model_prof_begin(m);
        be->moe_swiglu_fwd(be, T, d->d, d->dense_I, x2, p->w1, p->w3, p->w2, c->u1, c->u3, out);
        model_prof_end(m, MTRL_PROF_FFN_DENSE, t);
        return;
    }
    const seg_decode *dec = so ? so->dec : NULL;
    if (!dec) {
        moe_layer_fwd_(m, ar, l, T, x2, so ? so->routing_in : NULL, so ? so->routing_out : NULL,
                       so ? so->qb_stats : 0, fn, &c->moe, out);
        return;
    }
    // A decode step: its routing and statistics stay in backend memory (seg_decode).
    int E = d->E, K = d->k, mi = mtrl_model_moe_index(d, l);
    mtrl_model_moe_rows *r = &c->moe;
    mtrl_model_moe_rows_carve(d, T, arena_alloc_, ar, r);
    mtrl_model_moe_route_fwd(m, l, T, x2, so->routing_in, NULL, r);
    if (dec->sel) be->copy(be, dec->sel + (size_t)mi * T * K, r->sel, sizeof(int) * (size_t)T * K);
    if (so->qb_stats)
        dec->beta_status[mi] = be->moe_stats(be, T, E, K, r->sel, d->router_bias_score ? r->s : r->z,
                                             m->d_qb_beta + (size_t)l * E, so->qb_stats, dec->load + (size_t)mi * E,
                                             dec->beta + (size_t)mi * E);
    mtrl_model_moe_experts_fwd(m, l, 0, E, T * K, r->offsets, r->X, r->u1, r->u3, r->Y);
    mtrl_model_moe_combine_fwd(m, l, T, x2, r, d->n_shared > 0 ? ALLOC((size_t)T * d->d) : NULL, out);
}

// ---- the stack ------------------------------------------------------------------------------------------

// Sources of AttnRes site j: the committed blocks, then the partial sum when it is non-empty.
static int site_sources_(const seg_cache *c, int j, const real **src) {
    int n = 0;
    for (int b = 0; b < c->nb_site[j]; b++) src[n++] = c->blocks[b];
    if (c->part[j]) src[n++] = c->part[j];
    return n;
}

// Input h [T][d] of site j from its n sources: the AttnRes softmax mix (alpha its weights), or
// with dims.attnres = 0 the plain residual stream, the sum of the sources (the embedding and the
// running sum of the sublayer outputs: dims.S = L keeps them two; alpha is left unwritten).
static void site_fwd_(mtrl_model *m, int T, int j, int n, const real *const *src, real *h, real *alpha) {
    const mtrl_model_dims *d = &m->dims;
    mtrl_backend *be = m->be;
    if (d->attnres) {
        be->attnres_site_fwd(be, T, d->d, n, src, m->dP.site_w + (size_t)j * d->d, m->dP.site_g + (size_t)j * d->d,
                             d->eps, h, alpha);
        return;
    }
    size_t N = (size_t)T * d->d;
    if (n == 1) be->copy(be, h, src[0], sizeof(real) * N);
    else be->add(be, N, src[0], src[1], h);
    for (int i = 2; i < n; i++) be->add(be, N, h, src[i], h);
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
    const seg_decode *dec = mode == SEG_DECODE ? out->dec : NULL;
    MTRL_CHECKF(mode != SEG_DECODE || dec, "a decode step needs its arguments (seg_out.dec)");
    c->emb = ALLOC((size_t)T * D);
    double t = model_prof_begin(m);
    if (dec) { // the ids are the step's arguments (image tokens as 0, then embedded from `tokens`)
        be->embedding_rows(be, T, D, dec->ids, m->dP.embed, c->emb);
        if (tokens) model_image_fwd(m, T, tokens, c->emb);
    } else {
        int *tid = T <= 4096 ? ids : xmalloc(sizeof(int) * (size_t)T);
        model_image_ids(T, tokens, tid);
        be->embedding_fwd(be, T, D, tid, m->dP.embed, c->emb);
        model_image_fwd(m, T, tokens, c->emb);
        if (tid != ids) free(tid);
    }
    model_prof_end(m, MTRL_PROF_EMBED, t);
    c->blocks[0] = c->emb;
    int nb = 1;
    real *p = NULL;
    const real *src[MTRL_MAX_LAYERS + 2];
    // SEG_PREFILL keeps nothing for a backward: each layer's temporaries are released once its
    // output (the partial sum, allocated first so that it survives) is formed.
    int prefill = mode == SEG_PREFILL;
    MTRL_CHECKF(mode == SEG_DECODE || !io->piece_io || prefill, "pieces with their own states need SEG_PREFILL");
    for (int l = 0; l < L; l++) {
        layer_cache *lc = &c->layer[l];
        if (l > 0 && l % d->S == 0) {
            c->blocks[nb++] = p;
            p = NULL;
        }
        real *p_out = prefill ? ALLOC((size_t)T * D) : NULL;
        size_t mark = mtrl_arena_mark(ar);
        // mixer sublayer j = 2l
        int j = 2 * l;
        c->part[j] = p;
        c->nb_site[j] = nb;
        lc->nsrc_a = site_sources_(c, j, src);
        lc->alpha_a = ALLOC((size_t)T * lc->nsrc_a);
        lc->h_a = ALLOC((size_t)T * D);
        lc->rstd1 = ALLOC(T); lc->x1 = ALLOC((size_t)T * D);
        t = model_prof_begin(m);
        site_fwd_(m, T, j, lc->nsrc_a, src, lc->h_a, lc->alpha_a);
        be->rmsnorm_fwd(be, T, D, lc->h_a, m->dP.layer[l].norm1, d->eps, lc->x1, lc->rstd1);
        model_prof_end(m, MTRL_PROF_SITE, t);
        lc->mix = ALLOC((size_t)T * D);
        if (d->mixer[l] == 'K') kda_forward_(m, ar, l, mode, T, lc->x1, io, dec, lc, lc->mix);
        else mla_forward_(m, ar, l, mode, T, lc->x1, io, dec, lc, lc->mix);
        real *pn = ALLOC((size_t)T * D);
        t = model_prof_begin(m);
        be->add(be, (size_t)T * D, p, lc->mix, pn);
        model_prof_end(m, MTRL_PROF_SITE, t);
        p = pn;
        // FFN sublayer j = 2l + 1
        j = 2 * l + 1;
        c->part[j] = p;
        c->nb_site[j] = nb;
        lc->nsrc_f = site_sources_(c, j, src);
        lc->alpha_f = ALLOC((size_t)T * lc->nsrc_f);
        lc->h_f = ALLOC((size_t)T * D);
        lc->rstd2 = ALLOC(T); lc->x2 = ALLOC((size_t)T * D);
        t = model_prof_begin(m);
        site_fwd_(m, T, j, lc->nsrc_f, src, lc->h_f, lc->alpha_f);
        be->rmsnorm_fwd(be, T, D, lc->h_f, m->dP.layer[l].norm2, d->eps, lc->x2, lc->rstd2);
        model_prof_end(m, MTRL_PROF_SITE, t);
        lc->ffn = ALLOC((size_t)T * D);
        ffn_forward_(m, ar, l, T, lc->x2, lc, lc->ffn, out, mode == SEG_CHUNK ? m->experts : NULL);
        pn = prefill ? p_out : ALLOC((size_t)T * D);
        t = model_prof_begin(m);
        be->add(be, (size_t)T * D, p, lc->ffn, pn);
        model_prof_end(m, MTRL_PROF_SITE, t);
        p = pn;
        if (prefill) mtrl_arena_release(ar, mark);
    }
    int j = 2 * L;
    c->part[j] = p;
    c->nb_site[j] = nb;
    c->nsrc_o = site_sources_(c, j, src);
    c->alpha_o = ALLOC((size_t)T * c->nsrc_o);
    c->h_o = ALLOC((size_t)T * D);
    t = model_prof_begin(m);
    site_fwd_(m, T, j, c->nsrc_o, src, c->h_o, c->alpha_o);
    model_prof_end(m, MTRL_PROF_SITE, t);
    c->rstd_f = ALLOC(T); c->xf = ALLOC((size_t)T * D);
    c->logits = ALLOC((size_t)T * d->V);
    t = model_prof_begin(m);
    be->rmsnorm_fwd(be, T, D, c->h_o, m->dP.final_norm, d->eps, c->xf, c->rstd_f);
    proj_(be, T, d->V, D, c->xf, m->dP.lm_head, c->logits);
    // a decode step's logits stay in c->logits: its driver reads them after the step
    if (out && out->logits && !dec) be->download(be, out->logits, c->logits, sizeof(real) * (size_t)T * d->V);
    if (out && out->logp) be->logprob_fwd(be, T, d->V, c->logits, out->targets, out->logp, out->entropy);
    model_prof_end(m, MTRL_PROF_HEAD, t);
    if (mode != SEG_DECODE) {
        io->t0 += T;
        for (int i = 0, len; io->piece_io && i < io->n_piece; i++) {
            seq_piece(io, T, i, &len);
            io->piece_io[i].t0 += len;
        }
    }
    else
        for (int r = 0; r < T; r++) io[r].t0 += 1;
}

// ---- arena sizing ---------------------------------------------------------------------------------------
//
// The bytes of the ALLOCs above (forward caches) and of model_bwd.c (backward temporaries), each
// rounded to the arena's 64-byte alignment: the memory planner (model_plan.c) and the drivers
// (model_run.c) size the activation arena with these, so KEEP THEM IN STEP with the ALLOCs.
// tests/test_model_plan.c checks them against the arena's measured peak.

// n elements of `size` bytes, rounded to the arena's alignment; n reals, n ints
static size_t lb_(size_t n, size_t size) { return (n * size + 63) & ~(size_t)63; }
static size_t rb_(size_t n) { return lb_(n, sizeof(real)); }
static size_t ib_(size_t n) { return lb_(n, sizeof(int)); }

// Committed AttnRes blocks the sites of layer l see (l = L: the output site), as seg_forward
// commits them: one more at every layer l > 0 with l % S == 0, none after the last layer.
static int blocks_at_(const mtrl_model_dims *d, int l) { return 1 + (l < d->L ? l : d->L - 1) / d->S; }

static size_t kda_fwd_bytes_(const mtrl_model_dims *d, size_t T, size_t tiles) {
    size_t HD = (size_t)d->H * d->D, S_sz = (size_t)d->H * d->D * d->D;
    return 13 * rb_(T * HD) + rb_((size_t)3 * (d->W - 1) * HD) + 2 * rb_(T * d->D) + 2 * rb_(T * d->H) + rb_(S_sz) +
           rb_(tiles * S_sz);
}
// The MLA forward's caches up to its attention: q, lraw, craw, kr, rstd_c, ĉ, a, lse.
static size_t mla_fwd_head_bytes_(const mtrl_model_dims *d, size_t T) {
    size_t mH = (size_t)d->mH, ld = (size_t)d->dc + d->dr;
    return rb_(T * mH * (d->dn + d->dr)) + rb_(T * ld) + 2 * rb_(T * d->dc) + rb_(T * d->dr) + rb_(T) +
           rb_(T * mH * d->dv) + rb_(T * mH);
}
// Every cache of the MLA forward: the absorbed form adds its query and latent-space output.
static size_t mla_fwd_bytes_(const mtrl_model_dims *d, size_t T, int absorbed) {
    size_t mH = (size_t)d->mH, ld = (size_t)d->dc + d->dr;
    return mla_fwd_head_bytes_(d, T) + rb_(T * mH * d->dv) * (d->mla_gate ? 2 : 0) +
           (absorbed ? rb_(T * mH * ld) + rb_(T * mH * d->dc) : 0);
}
// The naive form's temporaries over Tk keys (released after its attention): kx, vx in the latent
// type (lat bytes an element), lr, then the expansion's k, v (seg_mla_expand) or, in the
// backward, the gradients dk, dv in their place.
static size_t mla_naive_bytes_(const mtrl_model_dims *d, size_t Tk, size_t lat) {
    size_t mH = (size_t)d->mH, kw = Tk * mH * (d->dn + d->dr), vw = Tk * mH * d->dv;
    return lb_(kw, lat) + lb_(vw, lat) + rb_(kw) + rb_(vw) + rb_(Tk * (d->dc + d->dr));
}
static size_t ffn_fwd_bytes_(const mtrl_model_dims *d, int l, size_t T) {
    if (mtrl_model_is_dense(d, l)) return 2 * rb_(T * d->dense_I);
    size_t K = (size_t)d->k, R = T * K, SI = (size_t)d->n_shared * d->I;
    size_t b = 2 * rb_(T * d->E) + rb_(T * K) + 3 * ib_(T * K) + ib_((size_t)d->E + 1) + 2 * rb_(R * d->d) +
               2 * rb_(R * d->I);
    if (d->n_shared > 0) b += 2 * rb_(T * SI) + rb_(T * d->d);
    return b;
}
static size_t kda_bwd_bytes_(const mtrl_model_dims *d, size_t T) {
    size_t HD = (size_t)d->H * d->D;
    return 11 * rb_(T * HD) + 2 * rb_(T * d->D) + rb_(T * d->H) + rb_((size_t)d->H * d->D * d->D) +
           rb_((size_t)3 * (d->W - 1) * HD);
}
// dag (da, dgl), the absorbed form's dol, dqt, then dq; the naive form's temporaries (released)
// or the latent rows' dĉ, dlraw, dcraw after them.
static size_t mla_bwd_bytes_(const mtrl_model_dims *d, size_t T, size_t Tk, size_t lat) {
    size_t mH = (size_t)d->mH, ld = (size_t)d->dc + d->dr, tail = 2 * rb_(T * d->dc) + rb_(T * ld);
    size_t b = rb_(T * mH * d->dv) * (d->mla_gate ? 3 : 1) + rb_(T * mH * (d->dn + d->dr));
    if (d->mla_absorbed) return b + rb_(T * mH * d->dc) + rb_(T * mH * ld) + tail;
    size_t naive = mla_naive_bytes_(d, Tk, lat);
    return b + (naive > tail ? naive : tail);
}
static size_t ffn_bwd_bytes_(const mtrl_model_dims *d, int l, size_t T) {
    if (mtrl_model_is_dense(d, l)) return 0;
    size_t R = T * d->k;
    return 2 * rb_(R * d->d) + rb_(T * d->k) + rb_(T * d->E) + (d->n_shared > 0 ? rb_(T * d->d) : 0);
}

int seg_kda_tiles(int T, const seq_io *io) {
    if (!io || !io->n_piece) return mtrl_ref_kda_tile_count(T);
    int n = 0;
    for (int i = 0, len; i < io->n_piece; i++) {
        seq_piece(io, T, i, &len);
        n += mtrl_ref_kda_tile_count(len);
    }
    return n;
}

// The ALLOCs of layer l of seg_forward before its mixer: alpha_a, h_a, rstd1, x1, mix.
static size_t layer_pre_bytes_(const mtrl_model_dims *d, int l, size_t T) {
    size_t D = (size_t)d->d;
    // the partial sum is empty only at the first layer of a block (layer 0 included)
    int nsrc_a = blocks_at_(d, l) + (l % d->S != 0);
    return rb_(T * nsrc_a) + 2 * rb_(T * D) + rb_(T) + rb_(T * D);
}

// The ALLOCs of layer l of seg_forward (its last partial sum included); MLA in the absorbed
// form or not.
static size_t layer_fwd_bytes_(const mtrl_model_dims *d, int l, size_t T, size_t tiles, int absorbed) {
    size_t D = (size_t)d->d;
    int nb = blocks_at_(d, l);
    size_t b = layer_pre_bytes_(d, l, T) + rb_(T * D); // + pn
    b += d->mixer[l] == 'K' ? kda_fwd_bytes_(d, T, tiles) : mla_fwd_bytes_(d, T, absorbed);
    b += rb_(T * (nb + 1)) + 2 * rb_(T * D) + rb_(T) + 2 * rb_(T * D); // alpha_f, h_f, x2, rstd2, ffn, pn
    return b + ffn_fwd_bytes_(d, l, T);
}

// What MLA layer l of a naive forward holds while its attention runs, on top of what the
// segment held before the layer: its caches so far and the expanded keys of Tk keys.
static size_t mla_naive_at_attn_(const mtrl_model_dims *d, int l, size_t T, size_t Tk, size_t lat) {
    return layer_pre_bytes_(d, l, T) + mla_fwd_head_bytes_(d, T) + mla_naive_bytes_(d, Tk, lat);
}

// The output site, the final norm and the logits.
static size_t head_fwd_bytes_(const mtrl_model_dims *d, size_t T) {
    int nb = blocks_at_(d, d->L);
    return rb_(T * (nb + 1)) + 2 * rb_(T * (size_t)d->d) + rb_(T) + rb_(T * d->V); // alpha_o, h_o, xf, rstd_f, logits
}

// The caches a SEG_CHUNK forward keeps (*kept) and its peak: the naive MLA form's temporaries
// over Tk keys sit on top of the caches so far while its attention runs.
static size_t fwd_bytes_(const mtrl_model_dims *d, int T_, int tiles, int Tk, size_t lat, size_t *kept) {
    size_t T = (size_t)(T_ > 0 ? T_ : 1), peak = 0;
    size_t b = rb_(T * d->d); // emb
    for (int l = 0; l < d->L; l++) {
        if (d->mixer[l] == 'M' && !d->mla_absorbed && Tk > 0) {
            size_t at = b + mla_naive_at_attn_(d, l, T, (size_t)Tk, lat);
            if (at > peak) peak = at;
        }
        b += layer_fwd_bytes_(d, l, T, (size_t)tiles, d->mla_absorbed);
    }
    b += head_fwd_bytes_(d, T);
    if (kept) *kept = b;
    return b > peak ? b : peak;
}

size_t seg_prefill_bytes(const mtrl_model_dims *d, int T_, int Tk, size_t lat) {
    size_t T = (size_t)(T_ > 0 ? T_ : 1), tiles = 0, out = rb_(T * d->d); // no tile states
    int naive = d->mla_prefill_naive;
    // emb and the outputs of the layers so far stay; on top, one layer's temporaries at a time
    // (its output excluded), or the head after the last layer; in the naive form the expanded
    // keys of up to Tk keys on top of the MLA layer's caches up to its attention
    size_t most = (size_t)(d->L + 1) * out + head_fwd_bytes_(d, T);
    for (int l = 0; l < d->L; l++) {
        size_t t = (size_t)(l + 2) * out + layer_fwd_bytes_(d, l, T, tiles, !naive) - out;
        if (t > most) most = t;
        if (naive && d->mixer[l] == 'M' && Tk > 0) {
            t = (size_t)(l + 2) * out + mla_naive_at_attn_(d, l, T, (size_t)Tk, lat);
            if (t > most) most = t;
        }
    }
    return most;
}

size_t seg_bwd_bytes(const mtrl_model_dims *d, int T_, int Tk, size_t lat) {
    size_t T = (size_t)(T_ > 0 ? T_ : 1), D = (size_t)d->d;
    int nb = blocks_at_(d, d->L);
    // dlogits, dxf, dh, dB[nb], dp, dx
    size_t b = rb_(T * d->V) + 2 * rb_(T * D) + (size_t)(nb + 1) * rb_(T * D) + rb_(T * D);
    size_t layer = 0;
    for (int l = 0; l < d->L; l++) {
        size_t f = ffn_bwd_bytes_(d, l, T),
               x = d->mixer[l] == 'K' ? kda_bwd_bytes_(d, T) : mla_bwd_bytes_(d, T, (size_t)(Tk > 0 ? Tk : 1), lat);
        if (f > layer) layer = f;
        if (x > layer) layer = x;
    }
    return b + layer;
}

size_t seg_fwd_bytes(const mtrl_model_dims *d, int T, int Tk, size_t lat) {
    return fwd_bytes_(d, T, mtrl_ref_kda_tile_count(T > 0 ? T : 1), Tk, lat, NULL);
}

// The forward's peak, or its caches with the backward on top, whichever is more.
static size_t arena_bytes_(const mtrl_model_dims *d, int T, int tiles, int Tk, size_t lat) {
    size_t kept, peak = fwd_bytes_(d, T, tiles, Tk, lat, &kept), step = kept + seg_bwd_bytes(d, T, Tk, lat);
    return (peak > step ? peak : step) + 4096;
}

size_t seg_arena_bytes(const mtrl_model_dims *d, int T, int Tk, size_t lat) {
    return arena_bytes_(d, T, mtrl_ref_kda_tile_count(T > 0 ? T : 1), Tk, lat);
}

size_t seg_pack_arena_bytes(const mtrl_model_dims *d, int T, int tiles, size_t lat) {
    return arena_bytes_(d, T, tiles, T, lat);
}
