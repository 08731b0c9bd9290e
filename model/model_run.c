// model_run.c: the drivers of the three execution forms (model.h): batched forward/backward
// over segments, logits, prefill and batched recurrent decode.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/image.h"
#include "common/check.h"
#include "model/backend.h"
#include "model/model_decode.h"
#include "model/model_ws.h"
#include "model/qb.h"
#include "kernels/ref/kda_ref.h"

typedef struct ws_seq {
    int len, seg, n_seg;
    real *bound_S;     // [n_seg][n_kda][H][D][D] state entering each segment   (backend memory)
    real *bound_conv;  // [n_seg][n_kda][3][W-1][HD]                            (backend memory)
    void *latent;      // [n_mla][len][dc+dr] latent elements                   (backend memory)
    uint8_t *routing;  // [len][n_moe][k] chosen in the forward, replayed by the recompute
    int *targets;      // [len]
    seg_cache *kept;   // [n_seg] when activations are kept
} ws_seq;

// A packed segment: sequences i0 .. i0+n-1 end to end (model_ws.h MTRL_PACK_TOKENS).
typedef struct ws_pack {
    int i0, n, T;
    size_t off;        // the pack's first position in the batch's per-position arrays
    int *piece;        // [n+1] token offsets of the sequences in the pack
    uint32_t *tokens;  // [T]
    int *targets;      // [T]
    uint8_t *routing;  // [T][n_moe][k] chosen in the forward, replayed by the recompute
    void *latent;      // [n_mla][T][dc+dr] latent elements                     (backend memory)
    seg_cache kept;    // when activations are kept
} ws_pack;

typedef struct ws_impl {
    mtrl_model_ws pub;
    ws_seq *seqs;
    int n_pack;
    ws_pack *packs;    // [n_pack]; a pack of one sequence runs as that sequence (seqs[i0])
    int keep;
    mtrl_arena state;   // the batch's boundary states and latents, plus the running S and conv
    real *run_S, *run_C;
    mtrl_arena grad;    // the backward's gradients crossing segment boundaries (grad_bytes_)
    // The caches of the forward's last segment (pack tail_pack, segment tail_seg), still in the
    // activation arena when the forward returns: the backward starts with that segment and takes
    // them instead of recomputing it (tail_ok: set by the forward, cleared by the backward).
    seg_cache tail;
    int tail_pack, tail_seg, tail_ok;
    int grad_len;       // the longest sequence or pack: the backward's latent-gradient rows
    mtrl_arena infer;   // prefill / decode / logits scratch
    model_decode *decode; // the decode step's arguments and recordings (model_decode.h)
} ws_impl;

static size_t S_size_(const mtrl_model_dims *d) { return (size_t)d->H * d->D * d->D; }
static size_t conv_size_(const mtrl_model_dims *d) { return (size_t)3 * (d->W - 1) * d->H * d->D; }
static size_t lat_w_(const mtrl_model_dims *d) { return (size_t)d->dc + d->dr; }

// Arenas over one block of the backend's memory.
static void be_arena_init_(mtrl_backend *be, mtrl_arena *a, size_t cap) {
    mtrl_arena_init_over(a, be->alloc(be, cap), cap);
}
static void be_arena_free_(mtrl_backend *be, mtrl_arena *a) {
    if (a->base) be->release(be, a->base);
    a->borrowed = 1;
    mtrl_arena_free(a);
}
// Bytes an arena needs for pieces of these sizes (64-byte aligned each).
static size_t carve_bytes_(size_t bytes) { return (bytes + 63) & ~(size_t)63; }
#define RALLOC(a, n) ((real *)mtrl_arena_alloc((a), sizeof(real) * (size_t)(n)))
// n latent elements of the model's backend (backend.h latent_size).
#define LALLOC(m, a, n) mtrl_arena_alloc((a), (m)->be->latent_size * (size_t)(n))

// Frees the batch's host bookkeeping (sequences and packs), keeping the arenas.
static void ws_batch_clear_(ws_impl *w) {
    for (int i = 0; i < w->pub.n_seq; i++) {
        ws_seq *s = &w->seqs[i];
        free(s->routing);
        free(s->targets);
        free(s->kept);
    }
    free(w->seqs);
    for (int k = 0; k < w->n_pack; k++) {
        ws_pack *p = &w->packs[k];
        free(p->piece);
        free(p->tokens);
        free(p->targets);
        free(p->routing);
    }
    free(w->packs);
    w->seqs = NULL;
    w->packs = NULL;
    w->n_pack = 0;
    w->keep = 0;
    w->tail_ok = 0;
    w->run_S = w->run_C = NULL;
    mtrl_arena arena = w->pub.arena;
    w->pub = (mtrl_model_ws){0};
    w->pub.arena = arena;
}

void mtrl_model_ws_free(mtrl_model *m) {
    ws_impl *w = (ws_impl *)m->ws;
    if (!w) return;
    ws_batch_clear_(w);
    model_decode_free(m, w->decode); // its recordings point into the arenas
    be_arena_free_(m->be, &w->pub.arena);
    be_arena_free_(m->be, &w->state);
    be_arena_free_(m->be, &w->grad);
    be_arena_free_(m->be, &w->infer);
    free(w);
    m->ws = NULL;
}

static ws_impl *ws_get_(mtrl_model *m) {
    if (!m->ws) m->ws = xcalloc(1, sizeof(ws_impl));
    return (ws_impl *)m->ws;
}

static void arena_ensure_(mtrl_backend *be, mtrl_arena *a, size_t bytes) {
    if (a->cap >= bytes) return;
    be_arena_free_(be, a);
    be_arena_init_(be, a, bytes);
}
// A batch arena (activations, states, the backward's gradients) of at least `bytes`, empty. The
// block of the last batch is kept when it is large enough: cudaMalloc and cudaFree of the
// ~110 GiB activation arena at every forward took ~390 ms of a 2.37 s step of `small` at 64K on
// an H200 (docs/perf.md P7). The planner counts held blocks as free (ws_held_bytes).
static void arena_fit_(mtrl_backend *be, mtrl_arena *a, size_t bytes) {
    arena_ensure_(be, a, bytes);
    mtrl_arena_reset(a);
    a->peak = 0;
}

// The forward just left segment `seg` of pack `pack` in the activation arena (ws_impl tail).
static void tail_set_(ws_impl *w, int pack, int seg) {
    w->tail_pack = pack;
    w->tail_seg = seg;
    w->tail_ok = 1;
}

// The segment length of a sequence of len tokens.
static int seg_of_(int len, int segment) { return segment > 0 && segment < len ? segment : (len > 0 ? len : 1); }

// Segment g of sequence s: tokens [*t0, *t0 + the length returned). The first segment takes the
// remainder, so that the last one, whose caches the backward takes from the forward instead of
// recomputing it (ws_impl tail), is a full one.
static int seg_span_(const ws_seq *s, int g, int *t0) {
    int r = s->len - (s->n_seg - 1) * s->seg;
    *t0 = g ? r + (g - 1) * s->seg : 0;
    return g ? s->seg : r;
}

// The gradient block of the backward for sequences of up to max_len tokens.
static size_t grad_bytes_(const mtrl_model_dims *d, int max_len) {
    size_t S_sz = S_size_(d) * model_n_kda(d), C_sz = conv_size_(d) * model_n_kda(d);
    return 2 * carve_bytes_(sizeof(real) * S_sz) + 2 * carve_bytes_(sizeof(real) * C_sz) +
           carve_bytes_(sizeof(real) * (size_t)model_n_mla(d) * (size_t)max_len * lat_w_(d));
}

int mtrl_model_pack_units(int n, const int *len, int segment, int *first) {
    int cap = segment > 0 ? segment : MTRL_PACK_TOKENS, np = 0, tok = 0, open = 0;
    for (int i = 0; i < n; i++) {
        int fits = len[i] <= cap; // one segment, and room for it in a pack
        if (!open || !fits || tok + len[i] > cap) {
            first[np++] = i;
            tok = 0;
        }
        tok += len[i];
        open = fits;
    }
    first[np] = n;
    return np;
}

void ws_sizes_for(const mtrl_model_dims *d, size_t lat_size, int n, const int *len, int segment, ws_sizes *out) {
    int n_kda = model_n_kda(d), n_mla = model_n_mla(d);
    size_t S_sz = S_size_(d) * n_kda, C_sz = conv_size_(d) * n_kda, LW = lat_w_(d);
    int max_seg = 1, max_len = 1, max_pack = 0;
    size_t keep_bytes = 0, one_seg = 0, state_cap = carve_bytes_(sizeof(real) * S_sz) + carve_bytes_(sizeof(real) * C_sz);
    size_t lat = 0;
    int *first = xmalloc(sizeof(int) * (size_t)(n + 1));
    int np = mtrl_model_pack_units(n, len, segment, first);
    for (int k = 0; k < np; k++) {
        int i = first[k];
        if (first[k + 1] - i == 1) {
            int seg = seg_of_(len[i], segment), n_seg = (len[i] + seg - 1) / seg;
            if (seg > max_seg) max_seg = seg;
            if (len[i] > max_len) max_len = len[i];
            size_t a = seg_arena_bytes(d, seg, len[i], lat_size);
            keep_bytes += a * (size_t)n_seg;
            if (a > one_seg) one_seg = a;
            size_t l = carve_bytes_(lat_size * (size_t)n_mla * (size_t)len[i] * LW);
            state_cap += carve_bytes_(sizeof(real) * (size_t)n_seg * S_sz) +
                         carve_bytes_(sizeof(real) * (size_t)n_seg * C_sz) + l;
            lat += l;
            continue;
        }
        int T = 0, tiles = 0;
        for (; i < first[k + 1]; i++) {
            T += len[i];
            tiles += mtrl_ref_kda_tile_count(len[i]);
            if (len[i] > max_len) max_len = len[i];
        }
        if (T > max_pack) max_pack = T;
        size_t a = seg_pack_arena_bytes(d, T, tiles, lat_size), l = carve_bytes_(lat_size * (size_t)n_mla * (size_t)T * LW);
        keep_bytes += a;
        if (a > one_seg) one_seg = a;
        state_cap += l;
        lat += l;
    }
    free(first);
    out->keep = segment <= 0 && keep_bytes <= MTRL_KEEP_BYTES_MAX;
    out->max_seg = max_seg > max_pack ? max_seg : max_pack;
    out->max_len = max_len;
    out->max_pack = max_pack;
    out->arena = out->keep ? keep_bytes : one_seg;
    out->one_seg = one_seg;
    out->state = state_cap;
    out->latent = lat;
    out->grad = grad_bytes_(d, max_len > max_pack ? max_len : max_pack);
}

size_t ws_held_bytes(const mtrl_model *m) {
    const ws_impl *w = (const ws_impl *)m->ws;
    return w ? w->pub.arena.cap + w->state.cap + w->grad.cap : 0;
}

// The next-token targets of a sequence of len tokens (-1 after its last, and before an image
// token: pictures are context, never predicted).
static void targets_of_(const uint32_t *tok, int len, int *out) {
    for (int t = 0; t < len; t++) out[t] = t + 1 < len && !mtrl_img_token_is(tok[t + 1]) ? (int)tok[t + 1] : -1;
}

// The pass the profile's phases count under (model.h): MTRL_PROF_FWD except inside
// mtrl_model_backward, so prefill, logits and decode count as forward.
static void prof_pass_(mtrl_model *m, int pass) {
    if (m->profile) m->profile->pass = pass;
}

const char *mtrl_model_profile_name(int pass, int block, char *buf, size_t cap) {
    static const char *const pass_name[MTRL_PROF_PASSES] = {"fwd", "recompute", "bwd"};
    static const char *const block_name[MTRL_PROF_BLOCKS] = {
        "embed",    "site",        "kda.proj",    "kda.elem",   "kda.core", "mla.proj", "mla.elem",  "mla.absorb",
        "mla.attn", "ffn.dense",   "moe.route",   "moe.experts", "moe.shared", "head",    "optimizer"};
    if (pass < 0 || pass >= MTRL_PROF_PASSES || block < 0 || block >= MTRL_PROF_BLOCKS) snprintf(buf, cap, "?");
    else snprintf(buf, cap, "%s.%s", pass_name[pass], block_name[block]);
    return buf;
}

// Forward of a packed segment: its sequences' tokens end to end in one seg_forward, each
// sequence a piece that starts from the zero state (model_ws.h seq_io).
static void pack_forward_(mtrl_model *m, const mtrl_batch *b, ws_pack *pk, real *logp, real *entropy,
                          uint8_t *const *routing_out) {
    ws_impl *w = (ws_impl *)m->ws;
    const mtrl_model_dims *d = &m->dims;
    size_t rw = (size_t)d->n_moe * d->k, lat = (size_t)model_n_mla(d) * lat_w_(d);
    int T = 0;
    pk->piece = xmalloc(sizeof(int) * (size_t)(pk->n + 1));
    for (int j = 0; j < pk->n; j++) {
        pk->piece[j] = T;
        T += b->len[pk->i0 + j];
    }
    pk->piece[pk->n] = T;
    pk->T = T;
    pk->tokens = xmalloc(sizeof(uint32_t) * (size_t)T);
    pk->targets = xmalloc(sizeof(int) * (size_t)T);
    pk->routing = xcalloc((size_t)T * rw + 1, 1);
    int replay = m->replay_routing && b->routing;
    uint8_t *rin = replay ? xmalloc((size_t)T * rw + 1) : NULL;
    for (int j = 0; j < pk->n; j++) {
        int i = pk->i0 + j, o = pk->piece[j], len = b->len[i];
        memcpy(pk->tokens + o, b->tokens[i], sizeof(uint32_t) * (size_t)len);
        targets_of_(b->tokens[i], len, pk->targets + o);
        if (replay) memcpy(rin + (size_t)o * rw, b->routing[i], (size_t)len * rw);
    }
    pk->latent = LALLOC(m, &w->state, (size_t)T * lat);
    w->pub.state_bytes += m->be->latent_size * (size_t)T * lat;
    seq_io io = {w->run_S, w->run_C, pk->latent, T, 0, pk->n, pk->piece, NULL};
    seg_out so = {pk->targets, logp, entropy, NULL, rin, pk->routing, mtrl_qb_observe_level(m, 0), NULL};
    seg_cache *c = w->keep ? &pk->kept : &w->tail;
    if (!w->keep) mtrl_arena_reset(&w->pub.arena);
    seg_forward(m, &w->pub.arena, SEG_CHUNK, T, pk->tokens, &io, &so, c);
    if (!w->keep) tail_set_(w, (int)(pk - w->packs), 0);
    if (w->pub.arena.peak > m->peak_activation_bytes) m->peak_activation_bytes = w->pub.arena.peak;
    for (int j = 0; routing_out && j < pk->n; j++)
        if (routing_out[pk->i0 + j])
            memcpy(routing_out[pk->i0 + j], pk->routing + (size_t)pk->piece[j] * rw, (size_t)b->len[pk->i0 + j] * rw);
    free(rin);
}

// Backward of a packed segment (its forward recomputed first unless kept); dlat, S, C: the
// gradient block's latent gradients and scratch states, dlogp/dentropy: the pack's slices.
// tail: the forward's caches of this pack are still in the arena (ws_impl tail).
static void pack_backward_(mtrl_model *m, ws_pack *pk, int tail, real *dS, real *dC, real *dlat, real *S, real *C,
                           const real *dlogp, const real *dentropy) {
    ws_impl *w = (ws_impl *)m->ws;
    mtrl_backend *be = m->be;
    be->zero(be, dlat, sizeof(real) * (size_t)pk->T * (size_t)model_n_mla(&m->dims) * lat_w_(&m->dims));
    seq_grad g = {dS, dC, dlat};
    seq_io io = {S, C, pk->latent, pk->T, pk->T, pk->n, pk->piece, NULL};
    seg_cache tmp, *c = &pk->kept;
    if (tail) {
        c = &w->tail;
    } else if (!w->keep) {
        io.t0 = 0;
        seg_out so = {pk->targets, NULL, NULL, NULL, pk->routing, NULL, 0, NULL};
        mtrl_arena_reset(&w->pub.arena);
        prof_pass_(m, MTRL_PROF_RECOMPUTE);
        seg_forward(m, &w->pub.arena, SEG_CHUNK, pk->T, pk->tokens, &io, &so, &tmp);
        prof_pass_(m, MTRL_PROF_BWD);
        m->recomputed_tokens += pk->T;
        c = &tmp;
    }
    size_t mark = mtrl_arena_mark(&w->pub.arena);
    seg_backward(m, &w->pub.arena, c, pk->tokens, pk->targets, &io, dlogp, dentropy, &g);
    if (w->pub.arena.peak > m->peak_activation_bytes) m->peak_activation_bytes = w->pub.arena.peak;
    mtrl_arena_release(&w->pub.arena, mark);
}

// The batch's workspace for a forward over b with `segment` (model.h): the sequences' and packs'
// bookkeeping, the activation arena (every segment's caches when w->keep, else one segment's;
// train: never keep, each unit's backward follows its forward), the state block zero-filled.
static ws_impl *batch_setup_(mtrl_model *m, const mtrl_batch *b, int segment, int train) {
    const mtrl_model_dims *d = &m->dims;
    mtrl_backend *be = m->be;
    ws_impl *w = ws_get_(m);
    ws_batch_clear_(w);
    int n_kda = model_n_kda(d);
    size_t S_sz = S_size_(d) * n_kda, C_sz = conv_size_(d) * n_kda;
    w->pub.n_seq = b->n;
    w->seqs = xcalloc((size_t)(b->n ? b->n : 1), sizeof(ws_seq));
    for (int i = 0; i < b->n; i++) {
        ws_seq *s = &w->seqs[i];
        s->len = b->len[i];
        s->seg = seg_of_(s->len, segment);
        s->n_seg = (s->len + s->seg - 1) / s->seg;
    }
    ws_sizes sz;
    ws_sizes_for(d, be->latent_size, b->n, b->len, segment, &sz);
    w->keep = sz.keep && !train;
    arena_fit_(be, &w->pub.arena, w->keep ? sz.arena : sz.one_seg);
    w->pub.seg_T = sz.max_seg;
    w->pub.seg_Tk = sz.max_len;
    w->grad_len = sz.max_len > sz.max_pack ? sz.max_len : sz.max_pack;
    arena_fit_(be, &w->state, sz.state);
    be->zero(be, w->state.base, sz.state);
    w->run_S = RALLOC(&w->state, S_sz);
    w->run_C = RALLOC(&w->state, C_sz);
    int *first = xmalloc(sizeof(int) * (size_t)(b->n + 1));
    w->n_pack = mtrl_model_pack_units(b->n, b->len, segment, first);
    w->packs = xcalloc((size_t)(w->n_pack ? w->n_pack : 1), sizeof(ws_pack));
    size_t off = 0;
    for (int k = 0; k < w->n_pack; k++) {
        ws_pack *pk = &w->packs[k];
        pk->i0 = first[k];
        pk->n = first[k + 1] - first[k];
        pk->off = off;
        for (int i = first[k]; i < first[k + 1]; i++) off += (size_t)b->len[i];
    }
    free(first);
    m->recomputed_tokens = 0;
    return w;
}

// The sizes a sequence's forward and backward carve with: KDA state and conv window elements
// of all KDA layers, a latent row, a token's routing bytes.
typedef struct seq_sizes {
    int n_mla;
    size_t S_sz, C_sz, LW, rw;
} seq_sizes;
static seq_sizes seq_sizes_(const mtrl_model_dims *d) {
    int n_kda = model_n_kda(d);
    return (seq_sizes){model_n_mla(d), S_size_(d) * n_kda, conv_size_(d) * n_kda, lat_w_(d), (size_t)d->n_moe * d->k};
}

// Forward of a sequence that is a unit of its own (pack k of one sequence), segment after
// segment; logp, entropy: its slices (nullable).
static void seq_forward_(mtrl_model *m, const mtrl_batch *b, int k, real *logp, real *entropy,
                         uint8_t *const *routing_out) {
    mtrl_backend *be = m->be;
    ws_impl *w = (ws_impl *)m->ws;
    const seq_sizes z = seq_sizes_(&m->dims);
    int i = w->packs[k].i0;
    ws_seq *s = &w->seqs[i];
    int len = s->len;
    s->bound_S = RALLOC(&w->state, (size_t)s->n_seg * z.S_sz);
    s->bound_conv = RALLOC(&w->state, (size_t)s->n_seg * z.C_sz);
    s->latent = LALLOC(m, &w->state, (size_t)z.n_mla * len * z.LW);
    s->routing = xcalloc((size_t)len * z.rw + 1, 1);
    s->targets = xmalloc(sizeof(int) * (size_t)(len + 1));
    targets_of_(b->tokens[i], len, s->targets);
    if (w->keep) s->kept = xcalloc((size_t)s->n_seg, sizeof(seg_cache));
    w->pub.state_bytes += sizeof(real) * (size_t)s->n_seg * (z.S_sz + z.C_sz) + be->latent_size * (size_t)z.n_mla * len * z.LW;
    real *S = w->run_S, *C = w->run_C;
    be->zero(be, S, sizeof(real) * z.S_sz);
    be->zero(be, C, sizeof(real) * z.C_sz);
    seq_io io = {S, C, s->latent, len, 0, 0, NULL, NULL};
    for (int g = 0; g < s->n_seg; g++) {
        int t0, T = seg_span_(s, g, &t0);
        be->copy(be, s->bound_S + (size_t)g * z.S_sz, S, sizeof(real) * z.S_sz);
        be->copy(be, s->bound_conv + (size_t)g * z.C_sz, C, sizeof(real) * z.C_sz);
        const uint8_t *rin = m->replay_routing && b->routing ? b->routing[i] + (size_t)t0 * z.rw : NULL;
        seg_out so = {s->targets + t0, logp ? logp + t0 : NULL, entropy ? entropy + t0 : NULL, NULL,
                      rin, s->routing + (size_t)t0 * z.rw, mtrl_qb_observe_level(m, 0), NULL};
        seg_cache *c = w->keep ? &s->kept[g] : &w->tail;
        if (!w->keep) mtrl_arena_reset(&w->pub.arena);
        seg_forward(m, &w->pub.arena, SEG_CHUNK, T, b->tokens[i] + t0, &io, &so, c);
        if (!w->keep) tail_set_(w, k, g);
        if (w->pub.arena.peak > m->peak_activation_bytes) m->peak_activation_bytes = w->pub.arena.peak;
        if (m->segment_hook) m->segment_hook(m->segment_hook_user);
    }
    if (routing_out && routing_out[i]) memcpy(routing_out[i], s->routing, (size_t)len * z.rw);
}

// Backward of the sequence of pack k of one sequence, its segments last to first, each
// recomputed from its boundary state unless kept or the forward's tail (tail: pack k's last
// segment is still in the arena). dS, dC, dlat, S, C: the gradient block's pieces.
static void seq_backward_(mtrl_model *m, const mtrl_batch *b, int k, int tail, real *dS, real *dC, real *dlat,
                          real *S, real *C, const real *dlogp, const real *dentropy) {
    mtrl_backend *be = m->be;
    ws_impl *w = (ws_impl *)m->ws;
    const seq_sizes z = seq_sizes_(&m->dims);
    int i = w->packs[k].i0;
    ws_seq *s = &w->seqs[i];
    int len = s->len;
    be->zero(be, dS, sizeof(real) * z.S_sz);
    be->zero(be, dC, sizeof(real) * z.C_sz);
    be->zero(be, dlat, sizeof(real) * (size_t)z.n_mla * len * z.LW);
    seq_grad g = {dS, dC, dlat};
    for (int gi = s->n_seg - 1; gi >= 0; gi--) {
        int t0, T = seg_span_(s, gi, &t0);
        seq_io io = {S, C, s->latent, len, t0 + T, 0, NULL, NULL};
        seg_cache tmp, *c;
        if (w->keep) {
            c = &s->kept[gi];
        } else if (tail && gi == w->tail_seg) {
            c = &w->tail; // the forward's last segment: its caches are still in the arena
        } else {
            // Recompute the segment from its boundary state, replaying the forward's routing.
            be->copy(be, S, s->bound_S + (size_t)gi * z.S_sz, sizeof(real) * z.S_sz);
            be->copy(be, C, s->bound_conv + (size_t)gi * z.C_sz, sizeof(real) * z.C_sz);
            io.t0 = t0;
            seg_out so = {s->targets + t0, NULL, NULL, NULL, s->routing + (size_t)t0 * z.rw, NULL, 0, NULL};
            mtrl_arena_reset(&w->pub.arena);
            prof_pass_(m, MTRL_PROF_RECOMPUTE);
            seg_forward(m, &w->pub.arena, SEG_CHUNK, T, b->tokens[i] + t0, &io, &so, &tmp);
            prof_pass_(m, MTRL_PROF_BWD);
            m->recomputed_tokens += T;
            c = &tmp;
        }
        size_t mark = mtrl_arena_mark(&w->pub.arena);
        seg_backward(m, &w->pub.arena, c, b->tokens[i] + t0, s->targets + t0, &io, dlogp + t0,
                     dentropy ? dentropy + t0 : NULL, &g);
        if (w->pub.arena.peak > m->peak_activation_bytes) m->peak_activation_bytes = w->pub.arena.peak;
        mtrl_arena_release(&w->pub.arena, mark);
        if (m->segment_hook) m->segment_hook(m->segment_hook_user);
    }
}

// Forward of unit k (a pack, or a sequence of its own); logp/entropy: the whole batch's arrays.
static void unit_forward_(mtrl_model *m, const mtrl_batch *b, int k, real *logp, real *entropy,
                          uint8_t *const *routing_out) {
    ws_impl *w = (ws_impl *)m->ws;
    ws_pack *pk = &w->packs[k];
    real *lp = logp ? logp + pk->off : NULL, *en = entropy ? entropy + pk->off : NULL;
    if (pk->n > 1) pack_forward_(m, b, pk, lp, en, routing_out);
    else seq_forward_(m, b, k, lp, en, routing_out);
}

// The backward's gradient block for the batch of the last forward: dS, dC, dlat, S, C.
typedef struct bwd_block {
    real *dS, *dC, *dlat, *S, *C;
} bwd_block;
static bwd_block bwd_block_get_(mtrl_model *m) {
    const mtrl_model_dims *d = &m->dims;
    ws_impl *w = (ws_impl *)m->ws;
    int n_kda = model_n_kda(d);
    size_t S_sz = S_size_(d) * n_kda, C_sz = conv_size_(d) * n_kda;
    mtrl_arena *ga = &w->grad;
    arena_fit_(m->be, ga, grad_bytes_(d, w->grad_len));
    bwd_block g;
    g.dS = RALLOC(ga, S_sz);
    g.dC = RALLOC(ga, C_sz);
    g.dlat = RALLOC(ga, (size_t)model_n_mla(d) * (size_t)w->grad_len * lat_w_(d));
    g.S = RALLOC(ga, S_sz);
    g.C = RALLOC(ga, C_sz);
    return g;
}

// Backward of unit k; dlogp/dentropy: the whole batch's arrays. tail: the unit's last segment
// is the forward's last, still in the arena.
static void unit_backward_(mtrl_model *m, const mtrl_batch *b, int k, int tail, const bwd_block *g, const real *dlogp,
                           const real *dentropy) {
    ws_impl *w = (ws_impl *)m->ws;
    ws_pack *pk = &w->packs[k];
    const real *dl = dlogp + pk->off, *de = dentropy ? dentropy + pk->off : NULL;
    if (pk->n > 1) pack_backward_(m, pk, tail, g->dS, g->dC, g->dlat, g->S, g->C, dl, de);
    else seq_backward_(m, b, k, tail, g->dS, g->dC, g->dlat, g->S, g->C, dl, de);
}

void mtrl_model_forward(mtrl_model *m, const mtrl_batch *b, int segment, real *logp, real *entropy,
                        uint8_t *const *routing_out) {
    ws_impl *w = batch_setup_(m, b, segment, 0);
    for (int k = 0; k < w->n_pack; k++) unit_forward_(m, b, k, logp, entropy, routing_out);
    m->be->sync(m->be);
}

void mtrl_model_backward(mtrl_model *m, const mtrl_batch *b, const real *dlogp, const real *dentropy) {
    ws_impl *w = (ws_impl *)m->ws;
    MTRL_CHECKF(!m->inference, "mtrl_model_backward: an inference model has no gradients");
    MTRL_CHECKF(w && w->pub.n_seq == b->n, "mtrl_model_backward needs the forward of the same batch first");
    prof_pass_(m, MTRL_PROF_BWD);
    bwd_block g = bwd_block_get_(m);
    m->recomputed_tokens = 0;
    // The first unit this walk meets holds the forward's last segment; later ones reset the arena.
    int tail_ok = w->tail_ok;
    w->tail_ok = 0;
    for (int k = w->n_pack - 1; k >= 0; k--) unit_backward_(m, b, k, tail_ok && k == w->tail_pack, &g, dlogp, dentropy);
    m->be->sync(m->be);
    prof_pass_(m, MTRL_PROF_FWD);
}

void mtrl_model_train(mtrl_model *m, const mtrl_batch *b, int segment, real *logp, real *entropy, real *dlogp,
                      real *dentropy, mtrl_model_loss_fn loss, void *user) {
    MTRL_CHECKF(!m->inference, "mtrl_model_train: an inference model has no gradients");
    ws_impl *w = batch_setup_(m, b, segment, 1);
    bwd_block g = bwd_block_get_(m);
    for (int k = 0; k < w->n_pack; k++) {
        ws_pack *pk = &w->packs[k];
        prof_pass_(m, MTRL_PROF_FWD);
        unit_forward_(m, b, k, logp, entropy, NULL);
        loss(user, pk->i0, pk->n, logp, entropy, dlogp, dentropy);
        prof_pass_(m, MTRL_PROF_BWD);
        unit_backward_(m, b, k, w->tail_ok && w->tail_pack == k, &g, dlogp, dentropy);
        w->tail_ok = 0;
    }
    m->be->sync(m->be);
    prof_pass_(m, MTRL_PROF_FWD);
}

mtrl_status mtrl_model_set_experts(mtrl_model *m, const mtrl_model_experts_fn *fn, mtrl_error *err) {
    if (fn && m->device != MTRL_DEVICE_CPU)
        return mtrl_error_set(err, MTRL_ERR_USAGE,
                              "experts elsewhere (expert parallel): the model is on GPU %d; only a CPU model takes them "
                              "(the device path needs the NCCL exchange on the model's stream: docs/multi-gpu.md §3)",
                              m->gpu);
    if (fn && m->inference)
        return mtrl_error_set(err, MTRL_ERR_USAGE,
                              "experts elsewhere (expert parallel): an inference model has no training passes");
    if (fn && m->dims.n_moe == 0)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "experts elsewhere (expert parallel): the model has no MoE layer");
    m->experts = fn;
    return MTRL_OK;
}

// ---- inference ---------------------------------------------------------------------------------------------

// The inference scratch: a prefill segment's forward (nothing kept for a backward; keys up to
// Tk after it), or a decode batch's.
static size_t prefill_bytes_(const mtrl_model *m, int T, int Tk) {
    return seg_prefill_bytes(&m->dims, T, Tk, m->be->latent_size) + 4096;
}
static size_t decode_bytes_(const mtrl_model *m, int B) { return seg_fwd_bytes(&m->dims, B, 0, m->be->latent_size) + 4096; }

size_t mtrl_model_infer_bytes(const mtrl_model *m, int batch, int cap) {
    size_t a = prefill_bytes_(m, MTRL_PREFILL_SEGMENT, cap), b = decode_bytes_(m, batch);
    return a > b ? a : b;
}

static seq_io state_io_(const mtrl_decode_state *s) { return (seq_io){s->kda_S, s->conv, s->latent, s->cap, s->pos, 0, NULL, NULL}; }

static size_t gcd_(size_t a, size_t b) {
    while (b) {
        size_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

size_t mtrl_decode_state_bytes(const mtrl_model *m, int cap) {
    const mtrl_model_dims *d = &m->dims;
    size_t kb = sizeof(real) * model_n_kda(d) * S_size_(d), cb = sizeof(real) * model_n_kda(d) * conv_size_(d);
    size_t row = m->be->latent_size * lat_w_(d), lb = row * (size_t)model_n_mla(d) * (size_t)cap;
    size_t al = row / gcd_(row, 64) * 64;
    return carve_bytes_(kb) + carve_bytes_(cb) + al + lb + 64;
}

void mtrl_decode_state_init(mtrl_decode_state *s, const mtrl_model *m, int cap) {
    const mtrl_model_dims *d = &m->dims;
    mtrl_backend *be = m->be;
    memset(s, 0, sizeof *s);
    s->cap = cap;
    s->be = be;
    // One block: KDA states, conv windows, then the latents, whose start is a multiple of the
    // latent row size (so the CUDA decode can address every state's cache from one base).
    size_t kb = sizeof(real) * model_n_kda(d) * S_size_(d), cb = sizeof(real) * model_n_kda(d) * conv_size_(d);
    size_t row = be->latent_size * lat_w_(d);
    size_t al = row / gcd_(row, 64) * 64;
    size_t bytes = mtrl_decode_state_bytes(m, cap);
    char *blk = be->alloc(be, bytes);
    be->zero(be, blk, bytes);
    s->block = blk;
    s->kda_S = (real *)blk;
    s->conv = (real *)(blk + carve_bytes_(kb));
    uintptr_t lat = (uintptr_t)(blk + carve_bytes_(kb) + carve_bytes_(cb));
    lat = (lat + al - 1) / al * al;
    s->latent = (void *)lat;
}

void mtrl_decode_state_free(mtrl_decode_state *s) {
    if (!s) return;
    if (s->be) s->be->release(s->be, s->block);
    memset(s, 0, sizeof *s);
}

void mtrl_decode_state_reset(mtrl_decode_state *s, const mtrl_model *m) {
    const mtrl_model_dims *d = &m->dims;
    s->pos = 0;
    m->be->zero(m->be, s->kda_S, sizeof(real) * model_n_kda(d) * S_size_(d));
    m->be->zero(m->be, s->conv, sizeof(real) * model_n_kda(d) * conv_size_(d));
}

void mtrl_decode_state_copy(mtrl_decode_state *dst, const mtrl_decode_state *src, const mtrl_model *m) {
    const mtrl_model_dims *d = &m->dims;
    mtrl_backend *be = m->be;
    MTRL_CHECKF(dst->cap >= src->pos, "decode state copy: capacity %d < position %d", dst->cap, src->pos);
    be->copy(be, dst->kda_S, src->kda_S, sizeof(real) * model_n_kda(d) * S_size_(d));
    be->copy(be, dst->conv, src->conv, sizeof(real) * model_n_kda(d) * conv_size_(d));
    size_t lw = lat_w_(d);
    for (int j = 0; j < model_n_mla(d); j++)
        be->copy(be, mtrl_latent_at(be, dst->latent, (size_t)j * dst->cap * lw),
                 mtrl_latent_at(be, src->latent, (size_t)j * src->cap * lw), be->latent_size * (size_t)src->pos * lw);
    dst->pos = src->pos;
}

void mtrl_decode_state_download(const mtrl_model *m, const mtrl_decode_state *s, real *kda_S, real *conv,
                                real *latent) {
    const mtrl_model_dims *d = &m->dims;
    mtrl_backend *be = m->be;
    size_t lw = lat_w_(d);
    be->download(be, kda_S, s->kda_S, sizeof(real) * model_n_kda(d) * S_size_(d));
    be->download(be, conv, s->conv, sizeof(real) * model_n_kda(d) * conv_size_(d));
    for (int j = 0; j < model_n_mla(d); j++)
        be->latent_download(be, (size_t)s->pos * lw, mtrl_latent_at(be, s->latent, (size_t)j * s->cap * lw),
                            latent + (size_t)j * s->pos * lw);
}

void mtrl_decode_state_upload(const mtrl_model *m, mtrl_decode_state *s, int pos, const real *kda_S,
                              const real *conv, const real *latent) {
    const mtrl_model_dims *d = &m->dims;
    mtrl_backend *be = m->be;
    MTRL_CHECKF(pos >= 0 && pos <= s->cap, "decode state upload: position %d, capacity %d", pos, s->cap);
    size_t lw = lat_w_(d);
    be->upload(be, s->kda_S, kda_S, sizeof(real) * model_n_kda(d) * S_size_(d));
    be->upload(be, s->conv, conv, sizeof(real) * model_n_kda(d) * conv_size_(d));
    for (int j = 0; j < model_n_mla(d); j++)
        be->latent_upload(be, (size_t)pos * lw, latent + (size_t)j * pos * lw,
                          mtrl_latent_at(be, s->latent, (size_t)j * s->cap * lw));
    be->sync(be);
    s->pos = pos;
}

void mtrl_model_prefill(mtrl_model *m, mtrl_decode_state *s, const uint32_t *tokens, int n, real *logits_last,
                        uint8_t *routing_out) {
    ws_impl *w = ws_get_(m);
    mtrl_backend *be = m->be;
    MTRL_CHECKF(s->pos + n <= s->cap, "prefill of %d tokens at position %d overflows capacity %d", n, s->pos, s->cap);
    int seg = n < MTRL_PREFILL_SEGMENT ? (n > 0 ? n : 1) : MTRL_PREFILL_SEGMENT;
    arena_ensure_(be, &w->infer, prefill_bytes_(m, seg, s->pos + n));
    seq_io io = state_io_(s);
    for (int t0 = 0; t0 < n; t0 += seg) {
        int T = n - t0 < seg ? n - t0 : seg;
        mtrl_arena_reset(&w->infer);
        seg_cache c;
        seg_out so = {NULL, NULL, NULL, NULL, NULL,
                      routing_out ? routing_out + (size_t)t0 * m->dims.n_moe * m->dims.k : NULL, 0, NULL};
        seg_forward(m, &w->infer, SEG_PREFILL, T, tokens + t0, &io, &so, &c);
        if (w->infer.peak > m->peak_infer_bytes) m->peak_infer_bytes = w->infer.peak;
        if (t0 + T == n && logits_last)
            be->download(be, logits_last, c.logits + (size_t)(T - 1) * m->dims.V, sizeof(real) * m->dims.V);
    }
    be->sync(be);
    s->pos = io.t0;
}

// One packed prefill of sequences i0 .. i0+k-1 (each fits, all together <= MTRL_PREFILL_SEGMENT).
static void prefill_pack_(mtrl_model *m, mtrl_decode_state *const *states, int i0, int k, const uint32_t *const *tokens,
                          const int *lens, real *logits_last, uint8_t *const *routing_out) {
    ws_impl *w = ws_get_(m);
    mtrl_backend *be = m->be;
    const mtrl_model_dims *d = &m->dims;
    size_t rw = (size_t)d->n_moe * d->k;
    int *piece = xmalloc(sizeof(int) * (size_t)(k + 1)), T = 0;
    seq_io *pio = xmalloc(sizeof(seq_io) * (size_t)k);
    int want_routing = 0, Tk = 0, Kall = 0;
    for (int j = 0; j < k; j++) {
        mtrl_decode_state *st = states[i0 + j];
        if (st->pos + lens[i0 + j] > Tk) Tk = st->pos + lens[i0 + j];
        Kall += st->pos + lens[i0 + j];
        MTRL_CHECKF(st->pos + lens[i0 + j] <= st->cap, "prefill of %d tokens at position %d overflows capacity %d",
                    lens[i0 + j], st->pos, st->cap);
        piece[j] = T;
        T += lens[i0 + j];
        pio[j] = state_io_(st);
        want_routing |= routing_out && routing_out[i0 + j];
    }
    piece[k] = T;
    uint32_t *tok = xmalloc(sizeof(uint32_t) * (size_t)T);
    for (int j = 0; j < k; j++) memcpy(tok + piece[j], tokens[i0 + j], sizeof(uint32_t) * (size_t)lens[i0 + j]);
    uint8_t *rout = want_routing ? xmalloc((size_t)T * rw + 1) : NULL;
    // The naive MLA form expands the keys of as many pieces at once as the arena has room for
    // (model_fwd.c): room for all of them where that takes no more than a full segment's prefill
    // at these keys (within mtrl_model_infer_bytes), else at least each piece's alone.
    size_t need = prefill_bytes_(m, T, Tk);
    if (d->mla_prefill_naive && k > 1) {
        size_t all = prefill_bytes_(m, T, Kall), full = prefill_bytes_(m, MTRL_PREFILL_SEGMENT, Tk);
        if ((all < full ? all : full) > need) need = all < full ? all : full;
    }
    arena_ensure_(be, &w->infer, need);
    mtrl_arena_reset(&w->infer);
    seq_io io = {NULL, NULL, NULL, 0, 0, k, piece, pio};
    seg_out so = {NULL, NULL, NULL, NULL, NULL, rout, 0, NULL};
    seg_cache c;
    seg_forward(m, &w->infer, SEG_PREFILL, T, tok, &io, &so, &c);
    if (w->infer.peak > m->peak_infer_bytes) m->peak_infer_bytes = w->infer.peak;
    for (int j = 0; j < k; j++) {
        if (logits_last)
            be->download(be, logits_last + (size_t)(i0 + j) * d->V, c.logits + (size_t)(piece[j + 1] - 1) * d->V,
                         sizeof(real) * d->V);
        if (rout && routing_out[i0 + j])
            memcpy(routing_out[i0 + j], rout + (size_t)piece[j] * rw, (size_t)lens[i0 + j] * rw);
        states[i0 + j]->pos = pio[j].t0;
    }
    free(rout);
    free(tok);
    free(pio);
    free(piece);
}

void mtrl_model_prefill_many(mtrl_model *m, mtrl_decode_state *const *states, int n, const uint32_t *const *tokens,
                             const int *lens, real *logits_last, uint8_t *const *routing_out) {
    const int V = m->dims.V;
    // one state twice would be read and advanced by two pieces of one forward
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < n; j++)
            MTRL_CHECKF(states[i] != states[j], "mtrl_model_prefill_many: states %d and %d are the same", i, j);
    for (int i = 0; i < n;) {
        if (lens[i] > MTRL_PREFILL_SEGMENT) { // a long one alone, in its own segments
            mtrl_model_prefill(m, states[i], tokens[i], lens[i], logits_last ? logits_last + (size_t)i * V : NULL,
                               routing_out ? routing_out[i] : NULL);
            i++;
            continue;
        }
        int k = 0, T = 0;
        while (i + k < n && lens[i + k] <= MTRL_PREFILL_SEGMENT && T + lens[i + k] <= MTRL_PREFILL_SEGMENT) T += lens[i + k++];
        prefill_pack_(m, states, i, k, tokens, lens, logits_last, routing_out);
        i += k;
    }
    m->be->sync(m->be);
}

void mtrl_model_decode(mtrl_model *m, mtrl_decode_state *const *states, int B, const uint32_t *tokens, real *logits,
                       uint8_t *routing_out) {
    ws_impl *w = ws_get_(m);
    arena_ensure_(m->be, &w->infer, decode_bytes_(m, B));
    model_decode_step(m, &w->decode, &w->infer, states, B, tokens, logits, routing_out);
}

void mtrl_model_decode_counts(const mtrl_model *m, long *replayed, long *recorded, long *launched) {
    model_decode_counts(m->ws ? ((const ws_impl *)m->ws)->decode : NULL, replayed, recorded, launched);
}

void mtrl_model_logits(mtrl_model *m, const uint32_t *tokens, int len, int segment, real *logits) {
    mtrl_decode_state s;
    mtrl_decode_state_init(&s, m, len);
    ws_impl *w = ws_get_(m);
    int seg = seg_of_(len, segment);
    arena_ensure_(m->be, &w->infer, prefill_bytes_(m, seg, len));
    seq_io io = state_io_(&s);
    for (int t0 = 0; t0 < len; t0 += seg) {
        int T = len - t0 < seg ? len - t0 : seg;
        mtrl_arena_reset(&w->infer);
        seg_out so = {NULL, NULL, NULL, logits + (size_t)t0 * m->dims.V, NULL, NULL, 0, NULL};
        seg_cache c;
        seg_forward(m, &w->infer, SEG_PREFILL, T, tokens + t0, &io, &so, &c);
    }
    m->be->sync(m->be);
    mtrl_decode_state_free(&s);
}
