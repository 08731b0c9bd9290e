// model_plan.c: the memory planner of the learner step (see model_plan.h).
#include "model/model_plan.h"

#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "model/backend.h"
#include "model/model_ws.h"

// ---- CUDA scratch ---------------------------------------------------------------------------------------
//
// Two grow-only buffers, both kept until the model is freed:
//   * the backend's (backend_cuda.c scratch_): grows to request × 5/4 + 1 MiB. Its largest
//     requests are the bf16 copies the attention takes (attn_causal_fwd_/_bwd_): the absorbed
//     queries [T][mH][dc+dr], in the backward dout [T][mH][dc] and, with fp32 latents only
//     ([kernels] latent = fp32), the latents of every key so far [Tk][dc+dr] (bf16 latents are read
//     where they are); in the naive form the queries [T][mH][dn+dr], dout [T][mH][dv] and, with
//     fp32 latents, the expanded keys and values of every key so far; small ones: token ids, targets, log-probs. With bf16 GEMM operands
//     ([kernels] gemm = bf16) also the bf16 copies of each GEMM's non-weight operands: the largest
//     is a projection's dW = dyᵀ x (dy [T][n] and x [T][k], the LM head's dy [T][V] first) or
//     the experts' X_perm [T·k][d].
//   * the kernels' context's (core/context.cu mtrl_ctx_scratch): grows to request × 9/8 + 1 MiB.
//     Requests per launcher (kda/chunk_simt.cu, moe/moe.cu, core/ops_simt.cu, mla/attn_decode.cu): the KDA chunk
//     workspace (W, U, Q⁺, K^e, P, e^γ per tile; in the backward also dD and dS per tile), the MoE
//     expert backward (dY, dm, m, du1, du3 per routed row; dY, m, du1, du3 bf16 with bf16 GEMM
//     operands), the conv backward, the column
//     reductions of the norms and AttnRes sites, the gate backward's partial sums.
// Every piece of one request starts 256-byte aligned (backend_cuda.c take_, ws_carver::take).
// CUDA arrays are fp32 whatever `real` is.

// What a CUDA backend stores in reduced precision (backend.h): the latent element size, and
// whether its GEMMs take bf16 operands (a bf16 copy of the parameters, operand copies in scratch).
typedef struct plan_prec {
    size_t lat_size;
    int gemm_bf16;
} plan_prec;

// A backend of `device` created for dims d (its kernel options).
static plan_prec prec_of_device_(const mtrl_model_dims *d, int device) {
    return (plan_prec){mtrl_backend_latent_size(device, &d->kern), mtrl_backend_gemm_bf16(device, &d->kern)};
}
static plan_prec prec_of_backend_(const mtrl_backend *be) { return (plan_prec){be->latent_size, be->gemm_bf16}; }
// The bf16 copy of a parameter block of P bytes that a backend with bf16 GEMM operands holds.
static size_t weights_bf16_bytes_(size_t P) { return P / sizeof(real) * 2; }

#define PLAN_SMS 160 // multiprocessors assumed for the split counts (H100/H200: 132, B200: 148)

static size_t al256_(size_t x) { return (x + 255) & ~(size_t)255; }
static size_t carve_(const size_t *bytes, int n) {
    size_t off = 0;
    for (int i = 0; i < n; i++) off = al256_(off) + bytes[i];
    return off;
}
static size_t max_(size_t a, size_t b) { return a > b ? a : b; }
static size_t cdiv_(size_t a, size_t b) { return (a + b - 1) / b; }

// core/ops_simt.cu row_splits + the launchers' adjustment: column-reduction partials for N rows of D.
static size_t row_splits_(size_t N, size_t D) {
    size_t cols = cdiv_(D, 256), ns = cdiv_((size_t)PLAN_SMS * 4, cols);
    if (ns > N) ns = N;
    if (ns < 1) ns = 1;
    size_t per = cdiv_(N, ns);
    return cdiv_(N, per);
}
// norm_dw_ (rmsnorm_bwd, gated_rmsnorm_bwd): partials [ns][D] and rstd [N].
static size_t norm_dw_req_(size_t N, size_t D) {
    size_t p[2] = {4 * row_splits_(N, D) * D, 4 * N};
    return carve_(p, 2);
}
// moe_experts_bwd over R rows of width D -> I with operands of es bytes: dY (bf16 operands only;
// fp32 ones read the caller's), dm (fp32), m | du1 | du3.
static size_t experts_bwd_req_(size_t R, size_t D, size_t I, size_t es) {
    size_t p[3] = {es == 2 ? es * R * D : 0, 4 * R * I, 3 * es * R * I};
    return carve_(p, 3);
}

// The largest request to the context's scratch in a segment of T tokens (GEMM operands of es bytes).
static size_t ctx_request_(const mtrl_model_dims *d, size_t T, size_t es) {
    size_t D = (size_t)d->d, req = 0;
    int nb = 1 + (d->L - 1) / d->S; // committed blocks at the output site
    if (model_n_kda(d) > 0) {
        size_t H = (size_t)d->H, K = (size_t)d->D, HK = H * K, nt = cdiv_(T, 16), Tp = nt * 16;
        // W, U, Q⁺, K^e [H][Tp][K]; P [H][nt][16][16]; e^γ [H][nt][K]; dD [H][Tp][K]; dS [nt][H][K][K];
        // v3's state gradient between the pieces of its pass 2, [H][K][K] (v3's tile records take
        // what v2's first six do)
        size_t ws[9] = {4 * H * Tp * K, 4 * H * Tp * K, 4 * H * Tp * K, 4 * H * Tp * K, 4 * H * nt * 256,
                        4 * H * nt * K, 4 * H * Tp * K, 4 * nt * H * K * K, 4 * H * K * K};
        req = max_(req, carve_(ws, 9)); // mtrl_kda_chunk_bwd (the forward takes the first six, and v3's
                                        // state between its pieces the ninth; the chunk-parallel
                                        // forward's 2 (pieces - 1) H K K, pieces <= nt / 128, fits
                                        // in the eighth)
        size_t nsplit = cdiv_((size_t)PLAN_SMS * 8 * 256, HK);
        if (nsplit > T) nsplit = T;
        if (nsplit < 1) nsplit = 1;
        nsplit = cdiv_(T, cdiv_(T, nsplit));
        req = max_(req, 2 * 8 * nsplit * HK); // mtrl_kda_gate_bwd
        size_t C = HK, conv[2] = {4 * (T * C + 1), 4 * row_splits_(T, C) * C * (size_t)d->W};
        req = max_(req, carve_(conv, 2)); // mtrl_shortconv_bwd
        req = max_(req, norm_dw_req_(T * H, K)); // gated_rmsnorm_bwd
    }
    if (model_n_mla(d) > 0) {
        // attn_causal_bwd: D [Tq][H]; with the v3 kernels and MHA rows also lse and D head-major,
        // [2][H][Tq rounded up to 64] (attn/causal_mma.cu).
        // The varlen forms (a packed segment) add their tables first: the pieces' offsets and
        // six lists of (piece, tile) items, at most a piece per token (attn/varlen.cuh); their
        // lse / D copies stay within the per-call size (mla/attn_decode.cu groups the pieces).
        size_t mH = (size_t)d->mH, tab = 4 * (3 * (T + 1) + 1 + 2 * (6 * T + T * mH / 16 + T / 16)),
               dt[3] = {tab, 4 * (cdiv_(T * mH, 64) * 64), 8 * mH * (cdiv_(T, 64) * 64)};
        req = max_(req, carve_(dt, 3));
        req = max_(req, norm_dw_req_(T, (size_t)d->dc)); // kv_a_layernorm
    }
    req = max_(req, norm_dw_req_(T, D)); // norm1, norm2, final norm
    size_t site[2] = {4 * T * (size_t)(nb + 1), 4 * row_splits_(T, D) * D};
    req = max_(req, carve_(site, 2)); // attnres_site_bwd
    req = max_(req, experts_bwd_req_(T, D, (size_t)d->dense_I, es)); // the dense FFNs
    if (d->n_moe > 0) {
        size_t R = T * (size_t)d->k;
        req = max_(req, experts_bwd_req_(R, D, (size_t)d->I, es));
        if (d->n_shared > 0) req = max_(req, experts_bwd_req_(T, D, (size_t)d->n_shared * d->I, es));
        req = max_(req, 4 * cdiv_(R, 1024) * (size_t)d->E); // moe_dispatch counts
        req = max_(req, 4 * T);                               // qb_beta_from_batch alpha
    }
    return req;
}

// With bf16 GEMM operands, the largest bf16 operand copies one GEMM of a T-token segment puts
// in the backend's scratch (backend_cuda.c gemm_, experts_operands_): for y = x Wᵀ (x [T][k],
// W [n][k]) the backward's dW = dyᵀ x rounds dy and x (the forward only x, dx only dy; W is
// the weights' copy); the expert entries round X [rows][d] (weights: the copy).
static size_t gemm_bf16_request_(const mtrl_model_dims *d, size_t T) {
    size_t HD = (size_t)d->H * d->D, D = (size_t)d->d, kda = model_n_kda(d) > 0, mla = model_n_mla(d) > 0;
    // {present, n, k} of every projection shape of model_fwd.c
    size_t proj[][3] = {{1, (size_t)d->V, D}, {d->n_moe > 0, (size_t)d->E, D}, // LM head, router
                        {kda, HD, D}, {kda, (size_t)d->D, D}, {kda, HD, (size_t)d->D}, {kda, (size_t)d->H, D},
                        {kda, D, HD}, {mla, (size_t)d->mH * (d->dn + d->dr), D}, {mla, (size_t)d->dc + d->dr, D},
                        {mla && d->mla_gate, (size_t)d->mH * d->dv, D}, {mla, D, (size_t)d->mH * d->dv}};
    size_t req = 0;
    for (size_t i = 0; i < sizeof proj / sizeof proj[0]; i++) {
        size_t p[2] = {2 * T * proj[i][1], 2 * T * proj[i][2]};
        if (proj[i][0]) req = max_(req, carve_(p, 2));
    }
    size_t rows = d->n_moe > 0 ? T * (size_t)d->k : T; // routed rows (dense FFN, shared experts: T)
    size_t x[4] = {2 * rows * D, 0, 0, 0};
    return max_(req, carve_(x, 4));
}

// The largest request to the backend's own scratch for a sequence of len tokens in segments of seg.
static size_t backend_request_(const mtrl_model_dims *d, plan_prec pr, size_t len, size_t seg) {
    size_t req = 0, T = seg < len ? seg : len, lat_size = pr.lat_size;
    size_t small[3] = {4 * T, 4 * T, 4 * T}; // logprob_fwd_/_bwd_: targets, log-probs, entropies
    req = max_(req, carve_(small, 3));
    if (pr.gemm_bf16) req = max_(req, gemm_bf16_request_(d, T));
    if (model_n_mla(d) > 0) {
        size_t mH = (size_t)d->mH, ld = (size_t)d->dc + d->dr;
        // the last segment: the longest (the first takes the remainder, model_run.c) and keys
        // over the whole sequence
        if (d->mla_absorbed) {
            size_t lat_copy = lat_size == 2 ? 0 : 2 * len * ld;
            size_t p[4] = {2 * T * mH * ld, lat_copy, 0, 2 * T * mH * (size_t)d->dc};
            req = max_(req, carve_(p, 4)); // attn_causal_bwd_ (the forward takes the first three)
        } else { // naive: q [T][mH][dn+dr], the expanded k and v (copied when fp32), dout [T][mH][dv]
            size_t kw = mH * (size_t)(d->dn + d->dr), vw = mH * (size_t)d->dv, f32 = lat_size != 2;
            size_t p[4] = {2 * T * kw, f32 * 2 * len * kw, f32 * 2 * len * vw, 2 * T * vw};
            req = max_(req, carve_(p, 4));
        }
    }
    return req;
}

// ---- the plan ---------------------------------------------------------------------------------------------

static int seg_len_(int len, int segment) { return segment > 0 && segment < len ? segment : (len > 0 ? len : 1); }

// mtrl_model_plan_eval with the parameter block's size P given (the search evaluates thousands
// of segment lengths; laying out the parameter table each time would dominate) and the
// backend's reduced precisions.
static void eval_(mtrl_model_plan *p, const mtrl_model_dims *d, size_t P, int device, plan_prec pr, int n,
                  const int *len, int segment, size_t budget) {
    memset(p, 0, sizeof *p);
    p->device = device;
    p->seqs = n;
    p->budget = budget;
    p->segment = segment > 0 ? segment : 0;
    int max_len = 1;
    for (int i = 0; i < n; i++) {
        p->total_tokens += (size_t)len[i];
        if (len[i] > max_len) max_len = len[i];
    }
    p->tokens = max_len;
    p->n_seg = (max_len + seg_len_(max_len, segment) - 1) / seg_len_(max_len, segment);
    size_t R = sizeof(real), LE = (size_t)d->L * d->E;
    size_t rw = (size_t)d->n_moe * d->k;
    int cuda = device == MTRL_DEVICE_CUDA;
    p->params = P;
    p->grads = P;
    p->adam = 2 * P;
    p->weights_bf16 = cuda && pr.gemm_bf16 ? weights_bf16_bytes_(P) : 0;
    // β (+ on the CPU its host bookkeeping: sums, counts, loads; on a GPU the Σx² partials)
    p->qb = LE * R + (cuda ? sizeof(double) * 256 : LE * (sizeof(double) + sizeof(long)) + (size_t)d->L * sizeof(int));
    ws_sizes ws;
    ws_sizes_for(d, pr.lat_size, n, len, segment, &ws);
    p->keep = ws.keep;
    p->latents = ws.latent;
    p->boundary = ws.state - ws.latent;
    p->latent_grads = ws.grad;
    p->activations = ws.arena;
    if (cuda) {
        size_t breq = 0;
        for (int i = 0; i < n; i++)
            breq = max_(breq, backend_request_(d, pr, (size_t)len[i], (size_t)seg_len_(len[i], segment)));
        if (ws.max_pack > 0)
            breq = max_(breq, backend_request_(d, pr, (size_t)ws.max_pack, (size_t)ws.max_pack));
        size_t creq = ctx_request_(d, (size_t)ws.max_seg, pr.gemm_bf16 ? 2 : 4);
        p->scratch = breq + breq / 4 + ((size_t)1 << 20) + creq + creq / 8 + ((size_t)1 << 20);
        p->runtime = MTRL_PLAN_CUDA_RUNTIME;
    } else {
        // moe_ref / attnres_ref / mla_ref temporaries of one call (OpenMP threads share them out)
        size_t T = (size_t)ws.max_seg, w = (size_t)d->dense_I;
        if (d->n_moe > 0) w = max_(w, max_((size_t)d->k * d->I, (size_t)d->n_shared * d->I));
        p->scratch = 3 * T * w * R + T * (size_t)(d->mH > 0 ? d->mH : 1) * sizeof(double);
    }
    // Host arrays per token: the trajectory (ids, behaviour log-prob, version, kind, routing),
    // the forward's targets and routing, the learner step's log-probs, entropies, behaviour,
    // advantages, gradients and mask (learner/train.c).
    p->host_episode = p->total_tokens * (4 + 4 + 4 + 1 + rw + 4 + rw + 4 * R + 6 * 4 + 4 + 1);
    p->host_mirrors = cuda ? 4 * P + LE * (R + sizeof(double) + sizeof(long)) : 0;
    p->total = p->params + p->grads + p->adam + p->weights_bf16 + p->qb + p->boundary + p->latents + p->latent_grads + p->activations +
               p->scratch + p->runtime + (cuda ? 0 : p->host_episode);
    p->host_total = cuda ? p->host_mirrors + p->host_episode : p->total;
    p->margin = budget / 20;
}

void mtrl_model_plan_eval(mtrl_model_plan *p, const mtrl_model_dims *d, int device, int n, const int *len, int segment,
                          size_t budget) {
    eval_(p, d, model_param_bytes(d), device, prec_of_device_(d, device), n, len, segment, budget);
}

static double gib_(size_t b) { return (double)b / (double)((size_t)1 << 30); }
// "12.34 GiB", or "5.6 MiB" below a GiB (buf: >= 32 bytes).
static char *size_str_(char *buf, size_t b) {
    if (b >= ((size_t)1 << 30)) snprintf(buf, 32, "%.2f GiB", gib_(b));
    else snprintf(buf, 32, "%.1f MiB", (double)b / (double)((size_t)1 << 20));
    return buf;
}

// mtrl_model_plan_make with the reduced precisions given (a live model: its backend's).
static mtrl_status make_(mtrl_model_plan *p, const mtrl_model_dims *d, int device, plan_prec pr, int n,
                         const int *len, size_t budget, mtrl_error *err) {
    int max_len = 1;
    long total = 0;
    for (int i = 0; i < n; i++) {
        if (len[i] > max_len) max_len = len[i];
        total += len[i];
    }
    // Past the longest sequence a longer segment still packs more short sequences into one
    // unit (fewer, larger GEMMs), up to the batch's tokens or MTRL_PLAN_PACK_MAX.
    int lim = max_len;
    if (total > lim) lim = (int)(total < MTRL_PLAN_PACK_MAX ? total : (max_len > MTRL_PLAN_PACK_MAX ? max_len : MTRL_PLAN_PACK_MAX));
    // Candidates in increasing order: every multiple of the step below the limit, then the
    // limit itself. The total is not monotonic in S (fewer, larger segments need
    // fewer boundary states but a larger activation arena): keep the largest S that fits and,
    // for the message when none does, the one that needs least.
    mtrl_model_plan best, least, cur;
    memset(&best, 0, sizeof best);
    memset(&least, 0, sizeof least);
    int have = 0;
    size_t P = model_param_bytes(d);
    for (long s = MTRL_PLAN_SEGMENT_STEP;; s += MTRL_PLAN_SEGMENT_STEP) {
        int S = s < lim ? (int)s : lim;
        eval_(&cur, d, P, device, pr, n, len, S, budget);
        if (s == MTRL_PLAN_SEGMENT_STEP || cur.total < least.total) least = cur;
        if (cur.total <= budget && budget - cur.total >= cur.margin) {
            best = cur;
            have = 1;
        }
        if (S == lim) break;
    }
    if (!have) {
        *p = least;
        char need[32], model[32], state[32], act[32], scr[32], rt[32], bud[32];
        return mtrl_error_set(err, MTRL_ERR_NOMEM,
                              "the learner step of %d sequence%s of up to %d tokens needs at least %s on the %s "
                              "(segment %d: model %s, episode state %s, activations %s, scratch %s, runtime %s) "
                              "plus a 5%% margin; the budget is %s%s",
                              n, n == 1 ? "" : "s", max_len, size_str_(need, least.total),
                              device == MTRL_DEVICE_CUDA ? "GPU" : "host", least.segment,
                              size_str_(model, least.params + least.grads + least.adam + least.weights_bf16 + least.qb),
                              size_str_(state, least.boundary + least.latents + least.latent_grads),
                              size_str_(act, least.activations), size_str_(scr, least.scratch),
                              size_str_(rt, least.runtime), size_str_(bud, budget),
                              model_n_mla(d) > 0 && !d->mla_absorbed
                                  ? " (MLA trained in the naive form expands every key so far in each segment: "
                                    "[model] mla_train = absorbed needs less for long sequences)"
                                  : "");
    }
    // Segment 0 keeps every activation when they fit under MTRL_KEEP_BYTES_MAX (no recompute
    // in the backward): note whether that fits the budget too.
    mtrl_model_plan k0;
    eval_(&k0, d, P, device, pr, n, len, 0, budget);
    *p = best;
    p->keep = k0.keep && k0.total <= budget && budget - k0.total >= k0.margin;
    return MTRL_OK;
}

mtrl_status mtrl_model_plan_make(mtrl_model_plan *p, const mtrl_model_dims *d, int device, int n, const int *len,
                                 size_t budget, mtrl_error *err) {
    return make_(p, d, device, prec_of_device_(d, device), n, len, budget, err);
}

mtrl_status mtrl_model_plan_uniform(mtrl_model_plan *p, const mtrl_model_dims *d, int device, long tokens, int seqs,
                                    size_t budget, mtrl_error *err) {
    if (tokens < 1 || tokens > (1L << 30) || seqs < 1)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "plan: need 1 <= tokens <= 2^30 and seqs >= 1 (got %ld, %d)", tokens,
                              seqs);
    int *len = xmalloc(sizeof(int) * (size_t)seqs);
    for (int i = 0; i < seqs; i++) len[i] = (int)tokens;
    mtrl_status st = mtrl_model_plan_make(p, d, device, seqs, len, budget, err);
    free(len);
    return st;
}

mtrl_status mtrl_model_device_memory(int device, int gpu, size_t *free_bytes, size_t *total_bytes, mtrl_error *err) {
    *free_bytes = *total_bytes = 0;
    if (device == MTRL_DEVICE_CPU) {
        mtrl_backend *be = mtrl_backend_cpu();
        be->mem_info(be, free_bytes, total_bytes, NULL, NULL);
        if (!*total_bytes) return mtrl_error_set(err, MTRL_ERR_IO, "cannot read MemAvailable from /proc/meminfo");
        return MTRL_OK;
    }
    if (device != MTRL_DEVICE_CUDA) return mtrl_error_set(err, MTRL_ERR_USAGE, "unknown device %d", device);
    char msg[256] = "";
    mtrl_backend *be = mtrl_backend_cuda_create(gpu, NULL, 0, msg, sizeof msg);  // memory only
    if (!be) return mtrl_error_set(err, MTRL_ERR_USAGE, "no CUDA memory to query: %s", msg);
    be->mem_info(be, free_bytes, total_bytes, NULL, NULL);
    mtrl_backend_destroy(be);
    return MTRL_OK;
}

void mtrl_model_mem_info(const mtrl_model *m, size_t *free_bytes, size_t *total_bytes, size_t *scratch_bytes,
                         size_t *peak_bytes) {
    m->be->mem_info(m->be, free_bytes, total_bytes, scratch_bytes, peak_bytes);
}

mtrl_status mtrl_model_plan_batch(mtrl_model_plan *p, const mtrl_model *m, const mtrl_batch *b, mtrl_error *err) {
    size_t fr = 0, tot = 0, scratch = 0;
    mtrl_model_mem_info(m, &fr, &tot, &scratch, NULL);
    if (!tot) return mtrl_error_set(err, MTRL_ERR_IO, "cannot read the free memory of the model's device");
    const mtrl_model_dims *d = &m->dims;
    size_t held = 4 * m->params.total + ws_held_bytes(m) + scratch;
    if (m->device == MTRL_DEVICE_CUDA) held += sizeof(real) * (size_t)d->L * d->E;
    if (m->be->gemm_bf16) held += weights_bf16_bytes_(m->params.total); // the weights' bf16 copy
    return make_(p, d, m->device, prec_of_backend_(m->be), b->n, b->len, fr + held, err);
}

mtrl_status mtrl_model_segment_resolve(const mtrl_model *m, const mtrl_batch *b, long setting, int *segment,
                                       mtrl_model_plan *plan, mtrl_error *err) {
    *segment = 0;
    if (setting > 0 && setting <= (1L << 30)) {
        *segment = (int)setting;
        return MTRL_OK;
    }
    if (setting != MTRL_CFG_SEGMENT_AUTO)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "[learner] segment %ld: expected auto or a token count", setting);
    mtrl_model_plan p;
    mtrl_status st = mtrl_model_plan_batch(&p, m, b, err);
    if (plan) *plan = p;
    if (st == MTRL_OK) *segment = p.segment;
    return st;
}

// ---- printing -------------------------------------------------------------------------------------------------

static void row_(FILE *f, const char *label, double bytes) {
    fprintf(f, "  %-38s %10.2f %12.1f\n", label, bytes / (double)((size_t)1 << 30), bytes / (double)((size_t)1 << 20));
}

void mtrl_model_plan_print(const mtrl_model_plan *p, FILE *f) {
    int cuda = p->device == MTRL_DEVICE_CUDA;
    fprintf(f, "learner step: %d sequence%s of up to %ld tokens (%zu in all) on the %s", p->seqs,
            p->seqs == 1 ? "" : "s", p->tokens, p->total_tokens, cuda ? "GPU" : "CPU");
    if (p->budget) fprintf(f, ", budget %.2f GiB", gib_(p->budget));
    fputc('\n', f);
    if (p->segment > 0)
        fprintf(f, "segment %d tokens: the longest sequence in %d segment%s (%s), shorter ones packed up to %d tokens "
                "a unit (never recomputed by mtrl_model_train)\n",
                p->segment, p->n_seg, p->n_seg == 1 ? "" : "s",
                p->n_seg == 1 ? "not recomputed" : "all but the last recomputed in the backward", p->segment);
    else
        fprintf(f, "segment 0: one segment per sequence, activations %s\n",
                p->keep ? "kept (no recompute)" : "recomputed");
    if (p->segment > 0 && p->keep)
        fprintf(f, "segment 0 would keep every activation (no recompute) within the budget too\n");
    fprintf(f, "  %-38s %10s %12s\n", cuda ? "GPU" : "host", "GiB", "MiB");
    row_(f, "parameters", (double)p->params);
    row_(f, "gradients", (double)p->grads);
    row_(f, "AdamW moments (m, v)", (double)p->adam);
    if (p->weights_bf16) row_(f, "bf16 weight copy (gemm = bf16)", (double)p->weights_bf16);
    row_(f, "QB beta and constants", (double)p->qb);
    row_(f, "boundary states (KDA S, conv windows)", (double)p->boundary);
    row_(f, "MLA latents", (double)p->latents);
    row_(f, "latent gradients (backward)", (double)p->latent_grads);
    row_(f, "activations (one segment, fwd + bwd)", (double)p->activations);
    row_(f, cuda ? "scratch (attention bf16, KDA, MoE)" : "scratch (reference temporaries)", (double)p->scratch);
    if (cuda) row_(f, "CUDA runtime reserve", (double)p->runtime);
    else row_(f, "episode arrays (tokens, logp, adv.)", (double)p->host_episode);
    row_(f, "total", (double)p->total);
    if (p->budget) {
        row_(f, "margin (5% of the budget)", (double)p->margin);
        row_(f, "left", (double)p->budget - (double)p->total - (double)p->margin);
    }
    if (cuda) {
        fprintf(f, "  %-38s %10s %12s\n", "host", "GiB", "MiB");
        row_(f, "mirrors (params, grads, moments)", (double)p->host_mirrors);
        row_(f, "episode arrays (tokens, logp, adv.)", (double)p->host_episode);
        row_(f, "host total", (double)p->host_total);
    }
}
