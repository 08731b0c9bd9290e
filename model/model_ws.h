// model_ws.h: internals of the backbone shared by its forward, backward and drivers. Not part
// of the public API (model.h).
//
// A segment is T consecutive tokens of one sequence (mode SEG_CHUNK), or T rows that are the
// next token of T different sequences (mode SEG_DECODE). Per-token work (norms, projections,
// AttnRes, FFN, MoE) is the same in both; only the token mixers differ: the chunked KDA form and
// causal attention over the sequence's latents, or the recurrent KDA step, the conv window
// step and the absorbed decode, each row with its own state.
//
// Cross-segment state lives in seq_io: the KDA state and conv windows of each KDA layer (updated
// in place as the segment runs) and the MLA latents of each MLA layer (rows t0.. written).
// The activations a segment's backward needs live in seg_cache, carved from one arena that is
// reset per segment; nothing of a segment outlives its backward.
// Every array here lives where the model's backend computes (backend.h: device memory for a
// CUDA model); the arenas are arenas over one backend block (mtrl_arena_init_over).
#ifndef MTRL_MODEL_WS_H
#define MTRL_MODEL_WS_H

#include "common/arena.h"
#include "model/backend.h"
#include "kernels/ref/moe_ref.h"
#include "model/model.h"
#include "model/model_moe.h"
#include "common/timeutil.h"

// SEG_PREFILL: SEG_CHUNK that keeps nothing for a backward (prefill, logits): each layer's
// temporaries are released as soon as its output exists, so a long prompt runs in long
// segments (seg_prefill_bytes) and the caches of seg_cache are not valid afterwards.
enum { SEG_CHUNK = 0, SEG_DECODE = 1, SEG_PREFILL = 2 };

typedef struct seq_io {
    real *kda_S;   // [n_kda][H][D][D]
    real *conv;    // [n_kda][3][W-1][H*D]
    void *latent;  // [n_mla][cap][dc+dr] latent elements (backend.h latent_size)
    int cap;       // latent rows per MLA layer
    int t0;        // absolute position of the segment's first token
    // A packed segment (SEG_CHUNK only): n_piece > 0 whole sequences laid end to end, piece i
    // at tokens piece[i] .. piece[i+1]-1 of the segment (host array [n_piece+1]). Each piece
    // starts from the zero state and attends only to itself; kda_S and conv then receive
    // nothing meaningful. n_piece = 0: the segment continues the state above (one sequence).
    int n_piece;
    const int *piece;
    // With pieces: NULL (each piece from the zero state: the learner's packs), or [n_piece]
    // states each piece continues from and advances (prefill of several sequences at once,
    // SEG_PREFILL only: nothing is kept for a backward).
    struct seq_io *piece_io;
} seq_io;

// The pieces of a chunked segment: n_piece, or 1 (the whole segment) when it has none.
static inline int seq_pieces(const seq_io *io) { return io->n_piece ? io->n_piece : 1; }
// Piece i of a chunked segment of T tokens: its first token in the segment; *len its length.
static inline int seq_piece(const seq_io *io, int T, int i, int *len) {
    if (!io->n_piece) {
        *len = T;
        return 0;
    }
    *len = io->piece[i + 1] - io->piece[i];
    return io->piece[i];
}

// Gradients flowing backwards across a segment boundary (same layout as seq_io's state).
typedef struct seq_grad {
    real *dS;      // [n_kda][H][D][D]: ∂L/∂(state leaving the segment) in, ∂L/∂(state entering) out
    real *dconv;   // [n_kda][3][W-1][H*D]: likewise for the conv windows
    real *dlatent; // [n_mla][cap][dc+dr] (`real` whatever the latents are), accumulated over the whole sequence
} seq_grad;

typedef struct layer_cache {
    int nsrc_a, nsrc_f;
    real *alpha_a, *alpha_f;     // [T][nsrc]
    real *h_a, *rstd1, *x1;      // site output, its RMSNorm
    real *h_f, *rstd2, *x2;
    real *mix, *ffn;             // sublayer outputs [T][d]
    // KDA
    real *pq, *pk, *pv;          // [T][HD] before the conv
    real *cst;                   // [3][W-1][HD] conv state entering the segment
    real *cq, *ck, *cv;          // after conv + SiLU
    real *qn, *kn;               // L2-normalised (q scaled by D^-1/2)
    real *f1, *f, *g;            // gate path
    real *bl, *beta;             // [T][H]
    real *S0, *S_tiles;          // state entering, per-tile states
    real *o, *z1, *z, *y;
    // MLA
    real *q;                     // [T][mH][dn+dr]
    real *craw, *kr, *rstd_c;    // [T][dc], [T][dr], [T]
    real *qt, *ol, *lse;         // absorbed query, latent-space output, log-sum-exp
    real *a, *gl, *ag;           // [T][mH*dv]
    // FFN
    real *u1, *u3;               // dense [T][dense_I]
    mtrl_model_moe_rows moe;     // MoE: routing, permuted rows, shared experts (model_moe.h)
} layer_cache;

typedef struct seg_cache {
    int T, mode;
    real *emb;                           // [T][d]
    real *part[2 * MTRL_MAX_LAYERS + 1]; // partial sum seen by site j (NULL = empty)
    real *blocks[MTRL_MAX_LAYERS + 1];   // committed block sums; blocks[0] = emb
    int nb_site[2 * MTRL_MAX_LAYERS + 1];// committed blocks visible to site j
    layer_cache layer[MTRL_MAX_LAYERS];
    int nsrc_o;
    real *alpha_o, *h_o, *rstd_f, *xf;
    real *logits;                        // [T][V]
} seg_cache;

// What a segment forward produces besides the state update.
typedef struct seg_out {
    const int *targets;        // [T] next-token ids (-1 = none), for logp
    real *logp, *entropy;      // [T] (nullable)
    real *logits;              // [T][V] copy-out (nullable)
    const uint8_t *routing_in; // [T][n_moe][k] to replay (nullable)
    uint8_t *routing_out;      // [T][n_moe][k] (nullable)
    int qb_stats;              // what the forward records: 0 nothing, 1 routing loads, 2 loads and
                               // the β its batch implies (mtrl_qb_observe_level, qb.h)
    // SEG_DECODE only (required there): the step's per-row arguments in backend memory, and where
    // its routing and statistics go instead of routing_out and the model's counters (the driver,
    // model_decode.c, reads them back after the step; nothing is read during it).
    const struct seg_decode *dec;
} seg_out;

// A decode step's arguments, written to backend memory before the step (so that a recorded step,
// backend.h graph_*, replays with the next step's values), and its outputs. B rows; the arrays
// of pointers are backend arrays of backend pointers, _h their host copies (for the backend's
// checks and launch shapes only).
typedef struct seg_decode {
    const int *ids;             // [B] token ids
    const int *Tk, *Tk_h;       // [B] keys row r attends to: its position + 1
    real *const *win;           // [n_kda][3][B] conv windows (q, k, v) of each KDA layer
    real *const *S, *const *S_h;// [n_kda][B] KDA states
    const void *const *lat, *const *lat_h; // [n_mla][B] the rows' latent caches of each MLA layer
    void *const *row;           // [n_mla][2][B] the new token's latent row: its ĉ, its k^r
    int *sel;                   // [n_moe][B][k] the routing (NULL: not wanted)
    int *load;                  // [n_moe][E] routing loads (NULL with qb_stats 0)
    real *beta;                 // [n_moe][E] the β each layer's batch implies (qb_stats 2)
    int *beta_status;           // [n_moe] host: moe_stats' status per MoE layer (0: beta computed)
} seg_decode;

// Per-batch workspace of the last forward.
typedef struct mtrl_model_ws {
    mtrl_arena arena;     // per-segment activations
    int seg_T;            // the arena's planned segment length
    int seg_Tk;           // ... and longest key range
    int n_seq;            // sequences in the batch
    size_t state_bytes;   // bytes of their boundary states and latents (model_run.c ws_seq, ws_pack)
} mtrl_model_ws;

// Forward of one segment (model_fwd.c). tokens: the segment's T token ids (SEG_CHUNK) or the
// T rows' ids (SEG_DECODE); io: one state (chunk) or T states (decode). c: caches (carved from
// the arena) when save != 0, else temporaries that the call releases.
void seg_forward(mtrl_model *m, mtrl_arena *ar, int mode, int T, const uint32_t *tokens, seq_io *io, seg_out *out,
                 seg_cache *c);

// Backward of the segment whose caches c the forward saved (model_bwd.c): dlogp/dentropy [T];
// g: gradients crossing the boundary (in: from the segment after, out: to the segment before).
// Parameter gradients accumulate into m->dG.
void seg_backward(mtrl_model *m, mtrl_arena *ar, seg_cache *c, const uint32_t *tokens, const int *targets,
                  const seq_io *io, const real *dlogp, const real *dentropy, seq_grad *g);

// MLA layer l's naive form (docs/model.md §3.1, mla_ref.h mla_expand_kv) over Tk latent rows lat
// ([ĉ ; k^r], stride dc+dr), carved from ar in this order and left there for the caller to
// release: the keys k [Tk][mH][dn+dr] and values v [Tk][mH][dv] in the latent type (the
// attention reads keys and values as latents; latent_size bytes an element: half a `real`'s on
// a GPU),
// then the rows widened to `real`, lr [Tk][dc+dr] (the backward's dW_kvb needs ĉ). The `real` k
// and v of the expansion are carved after them and released before returning (model_fwd.c
// mla_naive_bytes_ counts all five).
typedef struct mla_kv {
    void *k, *v;
    real *lr;
} mla_kv;
mla_kv seg_mla_expand(mtrl_model *m, mtrl_arena *ar, int l, int Tk, const void *lat);

// Arena bytes one segment of T tokens (keys up to Tk) needs for forward caches and backward:
// the larger of the forward's peak (seg_fwd_bytes) and its caches with seg_bwd_bytes (the most
// seg_backward carves on top of them), + a little slack. Exact mirrors of the allocations
// (64-byte aligned), see model_fwd.c. Tk matters to the naive MLA form only (its keys and
// values are expanded into the arena, lat bytes an element: the backend's latent_size); Tk = 0:
// none (decode).
size_t seg_arena_bytes(const mtrl_model_dims *d, int T, int Tk, size_t lat);
size_t seg_fwd_bytes(const mtrl_model_dims *d, int T, int Tk, size_t lat);
size_t seg_bwd_bytes(const mtrl_model_dims *d, int T, int Tk, size_t lat);
// The same for a packed segment of T tokens whose pieces have `tiles` KDA tiles in all
// (Σ mtrl_ref_kda_tile_count(piece length): each piece stores its own tile states).
size_t seg_pack_arena_bytes(const mtrl_model_dims *d, int T, int tiles, size_t lat);
// Arena bytes of one SEG_PREFILL segment of T tokens (the peak of its forward); Tk: the most
// keys any of its sequences has after it (the naive prefill form's expanded keys; 0: none).
size_t seg_prefill_bytes(const mtrl_model_dims *d, int T, int Tk, size_t lat);
// KDA tiles whose states a chunked segment of T tokens stores (io: its pieces, nullable).
int seg_kda_tiles(int T, const seq_io *io);
// Packing of a batch (model_run.c): consecutive sequences that each fit in one segment are laid
// end to end into packed segments of up to MTRL_PACK_TOKENS tokens (or `segment` when set), so
// a learner step over many short episodes runs a few large GEMMs instead of one small set per
// episode. A sequence longer than that, or cut into segments, is a pack of its own. QB's
// routing statistics are taken per segment, so a pack gives one β estimate for all its tokens.
#define MTRL_PACK_TOKENS 4096

// The device (backend) blocks mtrl_model_forward / _backward allocate for a batch of n sequences
// of len[i] tokens with `segment`, with latents of lat_size bytes an element (backend.h
// latent_size; model_run.c computes them with this function, the memory planner model_plan.c
// reads them):
typedef struct ws_sizes {
    int keep;        // segment <= 0 and every activation fits in MTRL_KEEP_BYTES_MAX: no recompute
    int max_seg;     // the longest segment
    int max_len;     // the longest sequence
    int max_pack;    // the longest packed segment of several sequences (0: none)
    size_t arena;    // activation arena: kept segments, or one segment's forward + backward
    size_t one_seg;  // ... of one segment (what mtrl_model_train holds: it never keeps)
    size_t state;    // boundary KDA states and conv windows of every segment, MLA latents, running state
    size_t latent;   // ... of which MLA latents
    size_t grad;     // the backward's block: ∂/∂latents (`real`) of the longest sequence or pack, dS, dconv, S, conv
} ws_sizes;
void ws_sizes_for(const mtrl_model_dims *d, size_t lat_size, int n, const int *len, int segment, ws_sizes *out);
// Bytes of the batch workspace the model holds now: the activation, state and gradient arenas.
// They stay allocated after a step and the next batch reuses them when they are large enough
// (a larger batch frees and reallocates each); mtrl_model_ws_free, or freeing the model, gives
// them back. The planner counts them as free memory.
size_t ws_held_bytes(const mtrl_model *m);

// Activations of a chunked batch are kept (no recompute in the backward) when they fit here.
#define MTRL_KEEP_BYTES_MAX ((size_t)1 << 30)

// Bytes of the parameter block of these dims (the same table mtrl_model_init lays out); the
// gradient block and each AdamW moment have the same size.
size_t model_param_bytes(const mtrl_model_dims *d);

int model_n_kda(const mtrl_model_dims *d);
int model_n_mla(const mtrl_model_dims *d);
// Index of layer l among the KDA (or MLA) layers.
int model_kda_index(const mtrl_model_dims *d, int l);
int model_mla_index(const mtrl_model_dims *d, int l);

void mtrl_model_ws_free(mtrl_model *m);

// The router's form (moe_ref.h MOE_ROUTER_* bits) from the dims.
static inline int model_router_form(const mtrl_model_dims *d) {
    return (d->score_softmax ? MOE_ROUTER_SOFTMAX : 0) | (d->router_bias_score ? MOE_ROUTER_SELECT_SCORE : 0) |
           (d->moe_renorm ? 0 : MOE_ROUTER_NO_RENORM);
}

// A phase of the profile (model.h): t = model_prof_begin(m); ...; model_prof_end(m, block, t)
// adds the interval to block under the profile's current pass. Both ends wait for the device, so
// the work issued inside is what is timed. No-ops (one test) when m->profile is NULL.
static inline double model_prof_begin(mtrl_model *m) {
    if (!m->profile) return 0;
    m->be->sync(m->be);
    return mtrl_time_mono();
}
// ... under an explicit pass instead (the optimizer's step counts with the backward).
static inline void model_prof_end_in(mtrl_model *m, int pass, int block, double t0) {
    mtrl_model_profile *p = m->profile;
    if (!p) return;
    m->be->sync(m->be);
    p->calls[pass][block]++;
    p->sec[pass][block] += mtrl_time_mono() - t0;
}
static inline void model_prof_end(mtrl_model *m, int block, double t0) {
    if (m->profile) model_prof_end_in(m, m->profile->pass, block, t0);
}

// Tells the backend the parameter block on its side changed (backend.h weights_changed: a
// backend with bf16 GEMM operands re-rounds its weight copy). Every writer of m->d_params calls
// it: creation and mtrl_model_to_device, mtrl_model_load, mtrl_model_optimizer_step.
void model_weights_changed(mtrl_model *m);
// The host mirror m->params.base to the device / back, in either placement (the bf16-resident
// form, model_wsplit.h, rounds / widens its GEMM-only matrices): upload includes
// model_weights_changed. No-ops on the CPU.
void model_params_upload(mtrl_model *m);
void model_params_download(mtrl_model *m);

#endif
