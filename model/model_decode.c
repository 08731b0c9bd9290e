// model_decode.c: the batched decode step (model_decode.h): its arguments in one backend block,
// its outputs read back after it, and its recordings.
#include "model/model_decode.h"

#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/image.h"
#include "model/backend.h"
#include "model/model_ws.h"
#include "model/qb.h"

// Recordings kept at once (batch sizes x key-length buckets x outputs wanted); the least recently
// used goes when a new key needs a place.
#define DEC_KEYS 32

enum { DEC_SEEN = 0, DEC_RECORDED = 1, DEC_EAGER = -1 };

typedef struct dec_key {
    int B, len, routing, level; // len: mtrl_backend_decode_len of the longest row
    int state;                  // DEC_SEEN (launched once), DEC_RECORDED (g), DEC_EAGER (not recordable)
    void *g;
    real *logits;                    // where the step leaves its logits (the scratch arena)
    int status[MTRL_MAX_LAYERS];     // moe_stats' status per MoE layer (the shapes decide it)
    unsigned long used;
} dec_key;

// Offsets of the block's arrays for B rows: the arguments first (uploaded as one), then the
// outputs (read back as one).
typedef struct dec_layout {
    size_t ids, Tk, win, S, lat, row, args; // args: bytes of the arguments
    size_t sel, load, beta, end;
} dec_layout;

struct model_decode {
    void *blk;            // backend block: dec_layout of up to cap rows
    size_t blk_bytes;
    int cap;
    unsigned char *host;  // the arguments, built here, then uploaded; the outputs read back
    const void *arena;    // the scratch the recordings were made on
    dec_key keys[DEC_KEYS];
    int n_keys;
    unsigned long tick;
    long replayed, recorded, launched;
};

static size_t al_(size_t x) { return (x + 63) & ~(size_t)63; }

static dec_layout layout_(const mtrl_model_dims *d, int B) {
    dec_layout y;
    size_t b = (size_t)B, nk = (size_t)model_n_kda(d), nm = (size_t)model_n_mla(d), p = sizeof(void *);
    size_t o = 0;
    y.ids = o; o = al_(o + sizeof(int) * b);
    y.Tk = o; o = al_(o + sizeof(int) * b);
    y.win = o; o = al_(o + p * nk * 3 * b);
    y.S = o; o = al_(o + p * nk * b);
    y.lat = o; o = al_(o + p * nm * b);
    y.row = o; o = al_(o + p * nm * 2 * b);
    y.args = o;
    y.sel = o; o = al_(o + sizeof(int) * (size_t)d->n_moe * b * (size_t)d->k);
    y.load = o; o = al_(o + sizeof(int) * (size_t)d->n_moe * (size_t)d->E);
    y.beta = o; o = al_(o + sizeof(real) * (size_t)d->n_moe * (size_t)d->E);
    y.end = o;
    return y;
}

static void keys_clear_(mtrl_backend *be, model_decode *x) {
    for (int i = 0; i < x->n_keys; i++) be->graph_free(be, x->keys[i].g);
    x->n_keys = 0;
}

void model_decode_free(mtrl_model *m, model_decode *x) {
    if (!x) return;
    keys_clear_(m->be, x);
    if (x->blk) m->be->release(m->be, x->blk);
    free(x->host);
    free(x);
}

void model_decode_counts(const model_decode *x, long *replayed, long *recorded, long *launched) {
    if (replayed) *replayed = x ? x->replayed : 0;
    if (recorded) *recorded = x ? x->recorded : 0;
    if (launched) *launched = x ? x->launched : 0;
}

// The block for B rows; a new block invalidates every recording (they point into the old one).
static void block_fit_(mtrl_model *m, model_decode *x, int B) {
    if (B <= x->cap) return;
    mtrl_backend *be = m->be;
    keys_clear_(be, x);
    if (x->blk) be->release(be, x->blk);
    int cap = B > 2 * x->cap ? B : 2 * x->cap;
    x->blk_bytes = layout_(&m->dims, cap).end;
    x->blk = be->alloc(be, x->blk_bytes);
    x->host = xrealloc(x->host, x->blk_bytes);
    x->cap = cap;
}

static dec_key *key_get_(mtrl_backend *be, model_decode *x, int B, int len, int routing, int level) {
    for (int i = 0; i < x->n_keys; i++) {
        dec_key *k = &x->keys[i];
        if (k->B == B && k->len == len && k->routing == routing && k->level == level) return k;
    }
    dec_key *k;
    if (x->n_keys < DEC_KEYS) {
        k = &x->keys[x->n_keys++];
    } else {
        k = &x->keys[0];
        for (int i = 1; i < DEC_KEYS; i++)
            if (x->keys[i].used < k->used) k = &x->keys[i];
        be->graph_free(be, k->g);
    }
    memset(k, 0, sizeof *k);
    *k = (dec_key){B, len, routing, level, DEC_SEEN, NULL, NULL, {0}, 0};
    return k;
}

// The step's forward, launched or recorded: the arena's layout for B rows is the same each time.
static real *forward_(mtrl_model *m, mtrl_arena *ar, mtrl_decode_state *const *states, int B, const uint32_t *tokens,
                      seg_out *so) {
    seq_io ios[256];
    seq_io *io = B <= 256 ? ios : xmalloc(sizeof(seq_io) * (size_t)B);
    for (int r = 0; r < B; r++) {
        const mtrl_decode_state *s = states[r];
        io[r] = (seq_io){s->kda_S, s->conv, s->latent, s->cap, s->pos, 0, NULL, NULL};
    }
    mtrl_arena_reset(ar);
    seg_cache c;
    seg_forward(m, ar, SEG_DECODE, B, tokens, io, so, &c);
    if (ar->peak > m->peak_infer_bytes) m->peak_infer_bytes = ar->peak;
    if (io != ios) free(io);
    return c.logits;
}

// The arguments of B rows into the host image of the block (pointers to the block for the
// backend arrays, to the image for their host copies); 1 when a token is an image token.
static int args_(mtrl_model *m, model_decode *x, const dec_layout *y, mtrl_decode_state *const *states, int B,
                 const uint32_t *tokens, seg_decode *dec, int *max_len) {
    const mtrl_model_dims *d = &m->dims;
    mtrl_backend *be = m->be;
    unsigned char *h = x->host, *blk = x->blk;
    int nk = model_n_kda(d), nm = model_n_mla(d), ld = d->dc + d->dr, image = 0;
    size_t conv_sz = (size_t)3 * (d->W - 1) * d->H * d->D, w1 = (size_t)(d->W - 1) * d->H * d->D,
           S_sz = (size_t)d->H * d->D * d->D;
    int *ids = (int *)(h + y->ids), *Tk = (int *)(h + y->Tk);
    real **win = (real **)(h + y->win), **S = (real **)(h + y->S);
    const void **lat = (const void **)(h + y->lat);
    void **row = (void **)(h + y->row);
    *max_len = 1;
    for (int r = 0; r < B; r++) {
        const mtrl_decode_state *s = states[r];
        MTRL_CHECKF(s->pos < s->cap, "MLA latent cache full: position %d, capacity %d", s->pos, s->cap);
        image |= mtrl_img_token_is(tokens[r]);
        ids[r] = mtrl_img_token_is(tokens[r]) ? 0 : (int)tokens[r]; // as model_image_ids
        Tk[r] = s->pos + 1;
        if (Tk[r] > *max_len) *max_len = Tk[r];
        for (int j = 0; j < nk; j++) {
            for (int c = 0; c < 3; c++) win[((size_t)j * 3 + c) * B + r] = s->conv + (size_t)j * conv_sz + c * w1;
            S[(size_t)j * B + r] = s->kda_S + (size_t)j * S_sz;
        }
        for (int j = 0; j < nm; j++) {
            void *cache = mtrl_latent_at(be, s->latent, (size_t)j * s->cap * ld);
            lat[(size_t)j * B + r] = cache;
            row[(size_t)j * 2 * B + r] = mtrl_latent_at(be, cache, (size_t)s->pos * ld);
            row[((size_t)j * 2 + 1) * B + r] = mtrl_latent_at(be, cache, (size_t)s->pos * ld + d->dc);
        }
    }
    dec->ids = (const int *)(blk + y->ids);
    dec->Tk = (const int *)(blk + y->Tk);
    dec->Tk_h = Tk;
    dec->win = (real *const *)(blk + y->win);
    dec->S = (real *const *)(blk + y->S);
    dec->S_h = S;
    dec->lat = (const void *const *)(blk + y->lat);
    dec->lat_h = lat;
    dec->row = (void *const *)(blk + y->row);
    return image;
}

// The routing and statistics of a finished step (outputs at the block's y->sel ..), added as the
// segment forward adds them.
static void outputs_(mtrl_model *m, model_decode *x, const dec_layout *y, int B, const dec_key *k, int routing,
                     int level, uint8_t *routing_out) {
    const mtrl_model_dims *d = &m->dims;
    int E = d->E, K = d->k, nmoe = d->n_moe;
    if (!routing && !level) return;
    m->be->download(m->be, x->host + y->sel, (unsigned char *)x->blk + y->sel, y->end - y->sel);
    const int *sel = (const int *)(x->host + y->sel), *load = (const int *)(x->host + y->load);
    const real *beta = (const real *)(x->host + y->beta);
    for (int mi = 0; routing && mi < nmoe; mi++)
        for (int t = 0; t < B; t++)
            for (int j = 0; j < K; j++)
                routing_out[((size_t)t * nmoe + mi) * K + j] = (uint8_t)sel[((size_t)mi * B + t) * K + j];
    for (int mi = 0; level && mi < nmoe; mi++) {
        int l = d->first_dense + mi;
        for (int e = 0; e < E; e++) m->load[(size_t)l * E + e] += load[(size_t)mi * E + e];
        if (level >= 2 && k->status[mi] == 0) {
            for (int e = 0; e < E; e++) m->qb_sum[(size_t)l * E + e] += beta[(size_t)mi * E + e];
            m->qb_count[l]++;
        }
    }
}

void model_decode_step(mtrl_model *m, model_decode **dp, mtrl_arena *ar, mtrl_decode_state *const *states, int B,
                       const uint32_t *tokens, real *logits, uint8_t *routing_out) {
    mtrl_backend *be = m->be;
    const mtrl_model_dims *d = &m->dims;
    if (B <= 0) return;
    if (!*dp) *dp = xcalloc(1, sizeof(model_decode));
    model_decode *x = *dp;
    if (ar->base != x->arena) { // recordings point into the scratch they were made on
        keys_clear_(be, x);
        x->arena = ar->base;
    }
    block_fit_(m, x, B);
    dec_layout y = layout_(d, B);
    int level = mtrl_qb_observe_level(m, 1), routing = routing_out != NULL, max_len;
    seg_decode dec = {0};
    int image = args_(m, x, &y, states, B, tokens, &dec, &max_len);
    unsigned char *blk = x->blk;
    dec.sel = routing ? (int *)(blk + y.sel) : NULL;
    dec.load = level ? (int *)(blk + y.load) : NULL;
    dec.beta = level ? (real *)(blk + y.beta) : NULL;
    be->upload(be, blk, x->host, y.args);
    seg_out so = {NULL, NULL, NULL, NULL, NULL, NULL, level, &dec};

    // Recorded, replayed or launched (model_decode.h): the same kernels on the same arguments.
    dec_key *k = key_get_(be, x, B, mtrl_backend_decode_len(max_len), routing, level);
    k->used = ++x->tick;
    int recordable = !image && !m->profile && !m->decode_eager;
    real *lg = NULL;
    if (recordable && k->state == DEC_RECORDED) {
        if (be->graph_launch(be, k->g) == 0) {
            lg = k->logits;
            x->replayed++;
        } else { // stale (the backend's scratch moved): launch once more, then record again
            be->graph_free(be, k->g);
            k->g = NULL;
            k->state = DEC_SEEN;
        }
    } else if (recordable && k->state == DEC_SEEN && k->logits) {
        dec.beta_status = k->status;
        if (be->graph_begin(be) == 0) {
            real *at = forward_(m, ar, states, B, tokens, &so);
            void *g = be->graph_end(be);
            if (g && be->graph_launch(be, g) == 0) {
                k->g = g;
                k->state = DEC_RECORDED;
                lg = at;
                x->recorded++;
            } else {
                be->graph_free(be, g);
                k->state = DEC_EAGER;
            }
        } else {
            k->state = DEC_EAGER;
        }
    }
    if (!lg) {
        dec.beta_status = k->status;
        lg = forward_(m, ar, states, B, tokens, &so);
        k->logits = lg;
        x->launched++;
    }
    if (logits) be->download(be, logits, lg, sizeof(real) * (size_t)B * d->V);
    outputs_(m, x, &y, B, k, routing, level, routing_out);
    be->sync(be);
    for (int r = 0; r < B; r++) states[r]->pos++;
}
