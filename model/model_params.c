// model_params.c: dimensions, the parameter table, initialisation, the optimizer step and QB
// bookkeeping of the backbone (see model.h).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "model/backend.h"
#include "model/model.h"
#include "model/model_ws.h"
#include "model/model_wsplit.h"
#include "common/bf16.h"
#include "common/rng.h"
#include "common/timeutil.h"
#include "kernels/ref/moe_ref.h"

// The position of `value` in the '|'-separated `choices` (0 when absent: the schema has checked it).
static int choice_(const char *value, const char *choices) {
    size_t n = strlen(value);
    int i = 0;
    for (const char *p = choices; *p; i++) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && !strncmp(p, value, n)) return i;
        if (!bar) break;
        p = bar + 1;
    }
    return 0;
}

void mtrl_kernel_opts_from_config(mtrl_kernel_opts *o, const mtrl_cfg_kernels *k) {
    memset(o, 0, sizeof *o);
    o->attn = choice_(k->attn, "auto|simt|mma"); // MTRL_KOPT_AUTO, _SIMT, _MMA
    o->decode = choice_(k->decode, "auto|simt");
    o->kda_fwd = choice_(k->kda_fwd, "auto|simt");
    o->kda_bwd = choice_(k->kda_bwd, "auto|simt");
    o->kda_bwd_tile = choice_(k->kda_bwd_tile, "auto|simt");
    o->kda_tile_threads = !strcmp(k->kda_tile_threads, "256") ? 256 : 0;
    o->kda_fwd_pieces = (int)k->kda_fwd_pieces;
    o->kda_bwd_pieces = (int)k->kda_bwd_pieces;
    o->kda_seq_pieces = (int)k->kda_seq_pieces;
    o->kda_plain_bf16 = !strcmp(k->kda_records, "bf16");
    o->moe_lanes = (int)k->moe_lanes;
    o->moe = choice_(k->moe, "auto|simt|mma|wgmma"); // MTRL_KOPT_AUTO, _MMA, _WGMMA (no simt)
    o->gemm = choice_(k->gemm, "model|tf32|fp32|bf16"); // MTRL_KGEMM_*
    o->latent_fp32 = !strcmp(k->latent, "fp32");
    o->attn_fp32 = !strcmp(k->attn_operands, "fp32");
    o->decode_graph = !strcmp(k->decode_graph, "on");
}

mtrl_status mtrl_model_dims_from_config(mtrl_model_dims *d, const mtrl_config *cfg, int vocab, mtrl_error *err) {
    const mtrl_cfg_model *c = &cfg->model;
    memset(d, 0, sizeof *d);
    mtrl_kernel_opts_from_config(&d->kern, &cfg->kernels);
    d->L = (int)c->layers;
    d->d = (int)c->d_model;
    d->V = c->vocab > 0 ? (int)c->vocab : vocab;
    d->H = (int)c->kda_heads;
    d->D = (int)c->kda_head_dim;
    d->W = (int)c->conv_kernel;
    d->mH = (int)c->mla_heads;
    d->dn = (int)c->mla_nope_dim;
    d->dr = (int)c->mla_rope_dim;
    d->dv = (int)c->mla_v_dim;
    d->dc = (int)c->mla_latent_dim;
    d->mla_gate = c->mla_gate;
    d->mla_absorbed = !strcmp(c->mla_train, "absorbed");
    d->mla_prefill_naive = !strcmp(c->mla_prefill, "naive");
    d->gemm_tf32 = !strcmp(c->gemm, "tf32");
    d->dense_I = (int)c->dense_inter;
    d->E = (int)c->experts;
    d->k = (int)c->top_k;
    d->n_shared = (int)c->shared_experts;
    d->I = (int)c->expert_inter;
    d->S = (int)c->attnres_block;
    d->score_softmax = !strcmp(c->router_score, "softmax");
    d->g_min = (real)c->g_min;
    d->rho = (real)c->rho;
    d->eps = (real)c->norm_eps;
    d->init_std = (real)c->init_std;
    d->image_patch = (int)c->image_patch;
    d->image_max_side = (int)c->image_max_side;
    if (d->L < 1 || d->L > MTRL_MAX_LAYERS)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "[model] layers = %d: must be 1..%d", d->L, MTRL_MAX_LAYERS);
    if ((int)strlen(c->hybrid) != d->L)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "[model] hybrid '%s' has %zu letters for %d layers", c->hybrid,
                              strlen(c->hybrid), d->L);
    memcpy(d->mixer, c->hybrid, (size_t)d->L);
    if (d->E > 256)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "[model] experts = %d: routing records are one byte, at most 256", d->E);
    if (d->k < 1 || d->k > d->E)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "[model] top_k = %d must be 1..experts (%d)", d->k, d->E);
    if (d->S < 1) return mtrl_error_set(err, MTRL_ERR_USAGE, "[model] attnres_block must be >= 1");
    d->kda_gate = !strcmp(c->kda_gate, "kimi") ? MTRL_KDA_GATE_KIMI : MTRL_KDA_GATE_BOUNDED;
    d->attnres = c->attnres;
    // Without AttnRes the stream is one running sum: one block over every layer (model_fwd.c).
    if (!d->attnres) d->S = d->L;
    d->first_dense = c->dense_layers > 0 ? (int)c->dense_layers : 1;
    if (d->first_dense > d->L)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "[model] dense_layers = %d exceeds layers = %d", d->first_dense,
                              d->L);
    d->router_bias_score = !strcmp(c->router_bias, "score");
    d->moe_renorm = c->router_renorm;
    d->kv_eps = c->mla_kv_norm_eps > 0 ? (real)c->mla_kv_norm_eps : d->eps;
    d->n_moe = d->L - d->first_dense;
    return MTRL_OK;
}

// ---- the parameter table ---------------------------------------------------------------------------

#if REAL_IS_F64
#define REAL_DT MTRL_DT_F64
#else
#define REAL_DT MTRL_DT_F32
#endif

typedef struct param_builder {
    mtrl_tt *t;
    int idx[64 + MTRL_MAX_LAYERS * 40];
    int n;
} param_builder;

static void add_(mtrl_tt *t, const char *name, int64_t a, int64_t b, int64_t c) {
    int64_t shape[3] = {a, b, c};
    int nd = c ? 3 : (b ? 2 : 1);
    mtrl_tt_add(t, name, REAL_DT, nd, shape);
}

static void build_table_(mtrl_tt *t, const mtrl_model_dims *d) {
    char n[MTRL_TT_NAME_MAX];
    add_(t, "embed", d->V, d->d, 0);
    add_(t, "lm_head", d->V, d->d, 0);
    add_(t, "final_norm", d->d, 0, 0);
    if (d->attnres) {
        add_(t, "attnres.w", 2 * d->L + 1, d->d, 0);
        add_(t, "attnres.g", 2 * d->L + 1, d->d, 0);
    }
    int HD = d->H * d->D;
    for (int l = 0; l < d->L; l++) {
#define P(suffix, a, b, c) (snprintf(n, sizeof n, "layers.%d.%s", l, suffix), add_(t, n, a, b, c))
        P("norm1", d->d, 0, 0);
        P("norm2", d->d, 0, 0);
        if (d->mixer[l] == 'K') {
            P("kda.wq", HD, d->d, 0);
            P("kda.wk", HD, d->d, 0);
            P("kda.wv", HD, d->d, 0);
            P("kda.conv_q", HD, d->W, 0);
            P("kda.conv_k", HD, d->W, 0);
            P("kda.conv_v", HD, d->W, 0);
            P("kda.wf1", d->D, d->d, 0);
            P("kda.wf2", HD, d->D, 0);
            P("kda.A_log", d->H, 0, 0);
            P("kda.dt_bias", HD, 0, 0);
            P("kda.wbeta", d->H, d->d, 0);
            P("kda.wz1", d->D, d->d, 0);
            P("kda.wz2", HD, d->D, 0);
            P("kda.onorm", d->D, 0, 0);
            P("kda.wo", d->d, HD, 0);
        } else {
            P("mla.wq", d->mH * (d->dn + d->dr), d->d, 0);
            P("mla.wkva", d->dc + d->dr, d->d, 0);
            P("mla.kv_norm", d->dc, 0, 0);
            P("mla.wkvb", d->mH * (d->dn + d->dv), d->dc, 0);
            if (d->mla_gate) P("mla.wg", d->mH * d->dv, d->d, 0);
            P("mla.wo", d->d, d->mH * d->dv, 0);
        }
        if (mtrl_model_is_dense(d, l)) {
            P("ffn.w1", d->dense_I, d->d, 0);
            P("ffn.w3", d->dense_I, d->d, 0);
            P("ffn.w2", d->d, d->dense_I, 0);
        } else {
            P("moe.router", d->E, d->d, 0);
            P("moe.w1", d->E, d->I, d->d);
            P("moe.w3", d->E, d->I, d->d);
            P("moe.w2", d->E, d->d, d->I);
            if (d->n_shared > 0) {
                P("moe.shared_w1", d->n_shared * d->I, d->d, 0);
                P("moe.shared_w3", d->n_shared * d->I, d->d, 0);
                P("moe.shared_w2", d->d, d->n_shared * d->I, 0);
            }
        }
#undef P
    }
    if (d->image_patch > 0) add_(t, "image.patch_w", d->d, 3 * d->image_patch * d->image_patch + 4, 0);
}

void mtrl_model_param_table(mtrl_tt *t, const mtrl_model_dims *d) {
    mtrl_tt_init(t);
    build_table_(t, d);
    mtrl_tt_layout(t);
}

size_t model_param_bytes(const mtrl_model_dims *d) {
    mtrl_tt t;
    mtrl_model_param_table(&t, d);
    size_t n = t.total;
    mtrl_tt_free(&t);
    return n;
}

// Where a pointer set points: one block laid out like the parameters (split NULL), or the two
// blocks of the bf16-resident form (base: its fp32 block, w16: its bf16 block).
typedef struct where_ {
    char *base;
    const mtrl_wsplit *split;
    char *w16;
} where_;

static real *at_(const mtrl_tt *t, const where_ *w, const char *name) {
    int i = mtrl_tt_find(t, name);
    if (i < 0) return NULL;
    if (!w->split) return (real *)(w->base + t->items[i].offset);
    // a GEMM-only matrix: its bf16 elements, typed `real *` for the pointer set only
    size_t o = w->split->f32_off[i];
    return o != MTRL_WSPLIT_NONE ? (real *)(w->base + o) : (real *)(void *)(w->w16 + w->split->b16_off[i]);
}

// Points a pointer set into the block(s) at w.
static void point_at_(const mtrl_tt *t, const where_ *base, const mtrl_model_dims *d, mtrl_model_ptrs *p) {
    memset(p, 0, sizeof *p);
    p->embed = at_(t, base, "embed");
    p->lm_head = at_(t, base, "lm_head");
    p->final_norm = at_(t, base, "final_norm");
    p->site_w = at_(t, base, "attnres.w");
    p->site_g = at_(t, base, "attnres.g");
    char n[MTRL_TT_NAME_MAX];
    for (int l = 0; l < d->L; l++) {
        mtrl_layer_ptrs *x = &p->layer[l];
#define G(field, suffix) (snprintf(n, sizeof n, "layers.%d.%s", l, suffix), x->field = at_(t, base, n))
        G(norm1, "norm1"); G(norm2, "norm2");
        G(wq, "kda.wq"); G(wk, "kda.wk"); G(wv, "kda.wv");
        G(conv_q, "kda.conv_q"); G(conv_k, "kda.conv_k"); G(conv_v, "kda.conv_v");
        G(wf1, "kda.wf1"); G(wf2, "kda.wf2"); G(A_log, "kda.A_log"); G(dt_bias, "kda.dt_bias");
        G(wbeta, "kda.wbeta"); G(wz1, "kda.wz1"); G(wz2, "kda.wz2"); G(onorm, "kda.onorm"); G(wo, "kda.wo");
        G(mq, "mla.wq"); G(mkva, "mla.wkva"); G(mkv_norm, "mla.kv_norm"); G(mkvb, "mla.wkvb");
        G(mg, "mla.wg"); G(mo, "mla.wo");
        G(w1, "ffn.w1"); G(w3, "ffn.w3"); G(w2, "ffn.w2");
        G(router, "moe.router"); G(ew1, "moe.w1"); G(ew3, "moe.w3"); G(ew2, "moe.w2");
        G(sw1, "moe.shared_w1"); G(sw3, "moe.shared_w3"); G(sw2, "moe.shared_w2");
#undef G
    }
    p->patch_w = at_(t, base, "image.patch_w");
}

// Points a pointer set into any block laid out like the parameters.
static void point_(const mtrl_tt *t, void *base, const mtrl_model_dims *d, mtrl_model_ptrs *p) {
    where_ w = {base, NULL, NULL};
    point_at_(t, &w, d, p);
}

// Initialisation: projections N(0, init_std) from the tensor's own RNG stream (so a tensor's
// init does not depend on the order of the table); output projections scaled by 1/sqrt(2L)
// as in GPT-2; norms 1; AttnRes pseudo-queries 0 (a site starts as the mean of its sources,
// docs/model.md §6.1); KDA A_log 0 and dt_bias = softplus⁻¹(dt), dt log-uniform in [1e-3, 0.1]
// (fla's init, docs/model.md §2.1); conv weights N(0, 1/W) around a mild identity.
// Every value depends only on (seed, tensor, index), so the loops run in parallel with the
// same result for any thread count.
static void init_(mtrl_model *m, uint64_t seed) {
    const mtrl_model_dims *d = &m->dims;
    for (int i = 0; i < m->params.n; i++) {
        mtrl_tensor *t = &m->params.items[i];
        real *x = t->ptr;
        uint64_t stream = mtrl_rng_stream(t->name, 0, 0);
        const char *nm = t->name;
        long n = (long)t->numel;
        int big = n > 65536;
        int is_norm = strstr(nm, "norm") != NULL || !strcmp(nm, "attnres.g");
        if (is_norm) {
            for (long j = 0; j < n; j++) x[j] = 1;
        } else if (!strcmp(nm, "attnres.w") || strstr(nm, "A_log")) {
            for (long j = 0; j < n; j++) x[j] = 0;
        } else if (strstr(nm, "dt_bias")) {
#pragma omp parallel for schedule(static) if (big)
            for (long j = 0; j < n; j++) {
                double u = mtrl_rng_uniform(seed, stream, (uint64_t)j);
                double dt = exp(log(1e-3) + u * (log(0.1) - log(1e-3)));
                if (dt < 1e-4) dt = 1e-4;
                x[j] = (real)(dt + log(-expm1(-dt))); // softplus^-1(dt)
            }
        } else if (strstr(nm, "conv_")) {
#pragma omp parallel for schedule(static) if (big)
            for (long j = 0; j < n; j++) x[j] = (real)(mtrl_rng_normal(seed, stream, (uint64_t)j) / sqrt((double)d->W));
        } else {
            double std = d->init_std;
            if (strstr(nm, ".wo") || strstr(nm, "w2")) std /= sqrt(2.0 * d->L);
            if (!strcmp(nm, "embed")) std = 1.0;
            if (!strcmp(nm, "image.patch_w")) std = 1.0 / d->image_patch; // model.h patch_w
#pragma omp parallel for schedule(static) if (big)
            for (long j = 0; j < n; j++) x[j] = (real)(std * mtrl_rng_normal(seed, stream, (uint64_t)j));
        }
    }
}

// What the CUDA kernels take (kernels_cuda.h); NULL when the dims fit.
static const char *cuda_dims_problem_(const mtrl_model_dims *d, char *buf, size_t n) {
    int kda = model_n_kda(d) > 0, mla = model_n_mla(d) > 0;
    if (kda && (d->D % 16 || d->D > 128))
        snprintf(buf, n, "kda_head_dim = %d: the CUDA KDA kernels take multiples of 16 up to 128", d->D);
    else if (kda && (d->W < 1 || d->W > 8))
        snprintf(buf, n, "conv_kernel = %d: the CUDA short conv takes 1..8", d->W);
    else if (mla && (d->dc % 16 || d->dc > 512))
        snprintf(buf, n, "mla_latent_dim = %d: the CUDA attention takes multiples of 16 up to 512", d->dc);
    else if (mla && ((d->dc + d->dr) % 8 || d->dc + d->dr > 576))
        snprintf(buf, n, "mla_latent_dim + mla_rope_dim = %d: the CUDA attention takes multiples of 8 up to 576",
                 d->dc + d->dr);
    else if (mla && (!d->mla_absorbed || d->mla_prefill_naive) &&
             ((d->dn + d->dr) % 8 || d->dv % 16 || (d->dn + d->dr + 15) / 16 * 16 + d->dv > 576))
        snprintf(buf, n, "mla_nope_dim + mla_rope_dim = %d, mla_v_dim = %d: the CUDA attention of mla_train = naive "
                 "takes key widths of multiples of 8 and value widths of multiples of 16, together up to 576 "
                 "(or set mla_train = absorbed and mla_prefill = absorbed)", d->dn + d->dr, d->dv);
    else if (mla && d->mH > 32)
        snprintf(buf, n, "mla_heads = %d: the CUDA MLA decode takes at most 32", d->mH);
    else if (d->L > 1 && (d->k > 16 || d->E > 1024))
        snprintf(buf, n, "experts = %d, top_k = %d: the CUDA router takes at most 1024 and 16", d->E, d->k);
    else if ((d->L + d->S - 1) / d->S + 1 > 64)
        snprintf(buf, n, "%d AttnRes sources: the CUDA site kernel takes at most 64", (d->L + d->S - 1) / d->S + 1);
    else
        return NULL;
    return buf;
}

int mtrl_model_cuda_devices(void) { return mtrl_backend_cuda_devices(); }

int mtrl_model_parse_device(const char *s, int *device, int *gpu) {
    *gpu = 0;
    if (!strcmp(s, "cpu")) {
        *device = MTRL_DEVICE_CPU;
        return 0;
    }
    if (!strncmp(s, "cuda", 4)) {
        *device = MTRL_DEVICE_CUDA;
        if (!s[4]) return 0;
        char *end;
        long g = s[4] == ':' ? strtol(s + 5, &end, 10) : -1;
        if (s[4] == ':' && end != s + 5 && !*end && g >= 0 && g < 1024) {
            *gpu = (int)g;
            return 0;
        }
    }
    return -1;
}

// infer: parameters only (mtrl_model_init_infer_on): no gradient or optimizer blocks.
static void alloc_host_(mtrl_model *m, const mtrl_model_dims *dims, uint64_t seed, int infer) {
    memset(m, 0, sizeof *m);
    m->dims = *dims;
    m->inference = infer;
    mtrl_tt_init(&m->params);
    build_table_(&m->params, dims);
    mtrl_tt_alloc(&m->params);
    size_t total = m->params.total;
    point_(&m->params, m->params.base, dims, &m->P);
    if (!infer) {
        m->grads = aligned_alloc(64, total);
        m->adam_m = aligned_alloc(64, total);
        m->adam_v = aligned_alloc(64, total);
        MTRL_CHECKF(m->grads && m->adam_m && m->adam_v, "out of memory for %zu-byte gradient and optimizer blocks", total);
        memset(m->grads, 0, total);
        memset(m->adam_m, 0, total);
        memset(m->adam_v, 0, total);
        point_(&m->params, m->grads, dims, &m->G);
    }
    init_(m, seed);
    size_t LE = (size_t)dims->L * (size_t)dims->E;
    m->qb_beta = xcalloc(LE, sizeof(real));
    m->qb_sum = xcalloc(LE, sizeof(double));
    m->qb_count = xcalloc((size_t)dims->L, sizeof(int));
    m->load = xcalloc(LE, sizeof(long));
}

static void init_cpu_(mtrl_model *m, const mtrl_model_dims *dims, uint64_t seed, int infer) {
    alloc_host_(m, dims, seed, infer);
    m->device = MTRL_DEVICE_CPU;
    m->be = mtrl_backend_cpu();
    m->d_params = m->params.base;
    m->d_grads = m->grads;
    m->d_adam_m = m->adam_m;
    m->d_adam_v = m->adam_v;
    m->dP = m->P;
    m->dG = m->G;
    m->d_qb_beta = m->qb_beta;
}

void mtrl_model_init(mtrl_model *m, const mtrl_model_dims *dims, uint64_t seed) { init_cpu_(m, dims, seed, 0); }

static mtrl_status init_on_(mtrl_model *m, const mtrl_model_dims *dims, uint64_t seed, int device, int gpu, int infer,
                            mtrl_error *err) {
    if (device == MTRL_DEVICE_CPU) {
        init_cpu_(m, dims, seed, infer);
        return MTRL_OK;
    }
    memset(m, 0, sizeof *m);
    if (device != MTRL_DEVICE_CUDA) return mtrl_error_set(err, MTRL_ERR_USAGE, "unknown model device %d", device);
    char msg[256];
    const char *why = cuda_dims_problem_(dims, msg, sizeof msg);
    if (why) return mtrl_error_set(err, MTRL_ERR_USAGE, "[model] device = cuda: %s", why);
    char bmsg[256] = "";
    mtrl_backend *be = mtrl_backend_cuda_create(gpu, &dims->kern, dims->gemm_tf32, bmsg, sizeof bmsg);
    if (!be) return mtrl_error_set(err, MTRL_ERR_USAGE, "[model] device = cuda: %s", bmsg);
    alloc_host_(m, dims, seed, infer);
    m->device = MTRL_DEVICE_CUDA;
    m->gpu = gpu;
    m->be = be;
    size_t total = m->params.total, LE = (size_t)dims->L * (size_t)dims->E;
    if (infer == 2) { // the bf16-resident form: two compact blocks (model_wsplit.h)
        m->weights_bf16 = 1;
        m->wsplit = xmalloc(sizeof *m->wsplit);
        mtrl_wsplit_init(m->wsplit, &m->params);
        m->d_params = be->alloc(be, m->wsplit->f32_bytes);
        m->d_w16 = mtrl_backend_cuda_weights_bf16(be, m->wsplit->b16_bytes);
    } else {
        m->d_params = be->alloc(be, total);
    }
    if (!infer) {
        m->d_grads = be->alloc(be, total);
        m->d_adam_m = be->alloc(be, total);
        m->d_adam_v = be->alloc(be, total);
        point_(&m->params, m->d_grads, dims, &m->dG);
    }
    m->d_qb_beta = be->alloc(be, sizeof(real) * LE);
    where_ w = {m->d_params, m->wsplit, m->d_w16};
    point_at_(&m->params, &w, dims, &m->dP);
    mtrl_model_to_device(m);
    return MTRL_OK;
}

mtrl_status mtrl_model_init_on(mtrl_model *m, const mtrl_model_dims *dims, uint64_t seed, int device, int gpu,
                               mtrl_error *err) {
    return init_on_(m, dims, seed, device, gpu, 0, err);
}

mtrl_status mtrl_model_init_infer_on(mtrl_model *m, const mtrl_model_dims *dims, uint64_t seed, int device, int gpu,
                                     mtrl_error *err) {
    return init_on_(m, dims, seed, device, gpu, 1, err);
}

mtrl_status mtrl_model_init_infer_bf16_on(mtrl_model *m, const mtrl_model_dims *dims, uint64_t seed, int device,
                                          int gpu, mtrl_error *err) {
    if (device != MTRL_DEVICE_CUDA || !mtrl_backend_gemm_bf16(device, &dims->kern)) {
        memset(m, 0, sizeof *m);
        return mtrl_error_set(err, MTRL_ERR_USAGE,
                              "[actor] weights = bf16 needs [model] device = cuda and [kernels] gemm = bf16 "
                              "(the GEMM weights are kept as bf16 only)");
    }
    return init_on_(m, dims, seed, device, gpu, 2, err);
}

// The bf16-resident form's transfers (model_wsplit.h): the fp32 tensors as they are, the
// GEMM-only ones rounded (up) / widened (down) on the host, with the GPU's rounding.
static void split_upload_(mtrl_model *m) {
    const mtrl_wsplit *s = m->wsplit;
    mtrl_backend *be = m->be;
    uint16_t *h = xmalloc(s->b16_bytes ? s->b16_bytes : 1);
    for (int i = 0; i < m->params.n; i++) {
        const mtrl_tensor *t = &m->params.items[i];
        const real *src = (const real *)((const char *)m->params.base + t->offset);
        if (s->f32_off[i] != MTRL_WSPLIT_NONE) {
            be->upload(be, (char *)m->d_params + s->f32_off[i], src, sizeof(real) * t->numel);
            continue;
        }
        uint16_t *d = (uint16_t *)((char *)h + s->b16_off[i]);
        for (size_t k = 0; k < t->numel; k++) d[k] = mtrl_bf16_from_f32((float)src[k]);
    }
    be->upload(be, m->d_w16, h, s->b16_bytes);
    be->sync(be);
    free(h);
}
static void split_download_(mtrl_model *m) {
    const mtrl_wsplit *s = m->wsplit;
    mtrl_backend *be = m->be;
    uint16_t *h = xmalloc(s->b16_bytes ? s->b16_bytes : 1);
    be->download(be, h, m->d_w16, s->b16_bytes);
    for (int i = 0; i < m->params.n; i++) {
        const mtrl_tensor *t = &m->params.items[i];
        real *dst = (real *)((char *)m->params.base + t->offset);
        if (s->f32_off[i] != MTRL_WSPLIT_NONE) {
            be->download(be, dst, (char *)m->d_params + s->f32_off[i], sizeof(real) * t->numel);
            continue;
        }
        const uint16_t *src = (const uint16_t *)((char *)h + s->b16_off[i]);
        for (size_t k = 0; k < t->numel; k++) dst[k] = (real)mtrl_bf16_to_f32(src[k]);
    }
    free(h);
}

void model_params_upload(mtrl_model *m) {
    if (m->device == MTRL_DEVICE_CPU) return;
    if (m->weights_bf16) {
        split_upload_(m);
        return;
    }
    m->be->upload(m->be, m->d_params, m->params.base, m->params.total);
    model_weights_changed(m);
}

void model_params_download(mtrl_model *m) {
    if (m->device == MTRL_DEVICE_CPU) return;
    if (m->weights_bf16) split_download_(m);
    else m->be->download(m->be, m->params.base, m->d_params, m->params.total);
}

void mtrl_model_to_host(mtrl_model *m) {
    if (m->device == MTRL_DEVICE_CPU) return;
    mtrl_backend *be = m->be;
    size_t total = m->params.total;
    model_params_download(m);
    if (m->inference) return;
    be->download(be, m->grads, m->d_grads, total);
    be->download(be, m->adam_m, m->d_adam_m, total);
    be->download(be, m->adam_v, m->d_adam_v, total);
}

void model_weights_changed(mtrl_model *m) {
    if (m->weights_bf16) return; // its writers write the bf16 block themselves (model_params_upload)
    m->be->weights_changed(m->be, m->d_params, m->params.total / sizeof(real));
}

void mtrl_model_to_device(mtrl_model *m) {
    if (m->device == MTRL_DEVICE_CPU) return;
    mtrl_backend *be = m->be;
    size_t total = m->params.total;
    model_params_upload(m);
    if (!m->inference) {
        be->upload(be, m->d_grads, m->grads, total);
        be->upload(be, m->d_adam_m, m->adam_m, total);
        be->upload(be, m->d_adam_v, m->adam_v, total);
    }
    be->upload(be, m->d_qb_beta, m->qb_beta, sizeof(real) * (size_t)m->dims.L * (size_t)m->dims.E);
    be->sync(be);
}

void mtrl_model_optimizer_reset(mtrl_model *m) {
    if (m->inference) return; // no optimizer to reset
    size_t total = m->params.total;
    memset(m->adam_m, 0, total);
    memset(m->adam_v, 0, total);
    if (m->device != MTRL_DEVICE_CPU) {
        m->be->zero(m->be, m->d_adam_m, total);
        m->be->zero(m->be, m->d_adam_v, total);
        m->be->sync(m->be);
    }
}

void mtrl_model_free(mtrl_model *m) {
    if (!m) return;
    mtrl_model_ws_free(m);
    if (m->be && m->device != MTRL_DEVICE_CPU) {
        m->be->release(m->be, m->d_params);
        m->be->release(m->be, m->d_grads);
        m->be->release(m->be, m->d_adam_m);
        m->be->release(m->be, m->d_adam_v);
        m->be->release(m->be, m->d_qb_beta);
        mtrl_backend_destroy(m->be);
    }
    mtrl_wsplit_free(m->wsplit);
    free(m->wsplit);
    mtrl_tt_free(&m->params);
    free(m->grads);
    free(m->adam_m);
    free(m->adam_v);
    free(m->qb_beta);
    free(m->qb_sum);
    free(m->qb_count);
    free(m->load);
    memset(m, 0, sizeof *m);
}

int mtrl_model_gemm_precision(const mtrl_model *m) {
    return m->be->gemm_bf16 ? MTRL_KGEMM_BF16 : m->be->gemm_tf32 ? MTRL_KGEMM_TF32 : MTRL_KGEMM_FP32;
}

size_t mtrl_model_latent_size(const mtrl_model *m) { return m->be->latent_size; }

double mtrl_model_copy_rate(mtrl_model *m, size_t bytes, int reps) {
    mtrl_backend *be = m->be;
    char *a = be->alloc(be, bytes), *b = be->alloc(be, bytes);
    be->zero(be, a, bytes);
    be->copy(be, b, a, bytes);
    be->sync(be);
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = mtrl_time_mono();
        be->copy(be, b, a, bytes);
        be->sync(be);
        double t = mtrl_time_mono() - t0;
        if (t < best) best = t;
    }
    be->release(be, a);
    be->release(be, b);
    return 2.0 * (double)bytes / best;
}

size_t mtrl_model_param_count(const mtrl_model *m) {
    size_t n = 0;
    for (int i = 0; i < m->params.n; i++) n += m->params.items[i].numel;
    return n;
}

// Routed experts are the layers' 'moe.w1/w3/w2' tensors (build_table_ names them); the
// shared experts are 'moe.shared_w*' and count in full.
int mtrl_model_param_is_routed_expert(const char *name) {
    const char *s = strstr(name, ".moe.w");
    return s && (s[6] == '1' || s[6] == '2' || s[6] == '3') && s[7] == 0;
}

double mtrl_model_active_matmul_params(const mtrl_model *m) {
    const mtrl_model_dims *d = &m->dims;
    double active = 0;
    for (int i = 0; i < m->params.n; i++) {
        const mtrl_tensor *t = &m->params.items[i];
        if (!strcmp(t->name, "embed") || t->ndim < 2) continue;
        double n = (double)t->numel;
        if (mtrl_model_param_is_routed_expert(t->name)) n *= (double)d->k / d->E;
        active += n;
    }
    return active;
}

void mtrl_model_zero_grads(mtrl_model *m) {
    MTRL_CHECKF(!m->inference, "an inference model (mtrl_model_init_infer_on) has no gradients");
    m->be->zero(m->be, m->d_grads, m->params.total);
}

// No weight decay on norms, gains, biases and AttnRes queries (1-D tensors).
static real tensor_weight_decay_(const mtrl_tensor *t, real weight_decay) {
    return t->ndim >= 2 && strncmp(t->name, "attnres.", 8) ? weight_decay : 0;
}

static void range_check_(const mtrl_model *m, int tensor, size_t begin, size_t end) {
    MTRL_CHECKF(!m->inference, "an inference model (mtrl_model_init_infer_on) has no optimizer");
    MTRL_CHECKF(tensor >= 0 && tensor < m->params.n && begin <= end && end <= m->params.items[tensor].numel,
                "optimizer range: tensor %d, elements [%zu, %zu)", tensor, begin, end);
}

double mtrl_model_grad_sq_range(const mtrl_model *m, int tensor, size_t begin, size_t end) {
    range_check_(m, tensor, begin, end);
    const mtrl_tensor *t = &m->params.items[tensor];
    return m->be->grad_sq_norm(m->be, end - begin, (const real *)((const char *)m->d_grads + t->offset) + begin);
}

void mtrl_model_adamw_range(mtrl_model *m, int tensor, size_t begin, size_t end, real grad_scale, real lr, real beta1,
                            real beta2, real eps, real weight_decay) {
    range_check_(m, tensor, begin, end);
    mtrl_backend *be = m->be;
    const mtrl_tensor *t = &m->params.items[tensor];
    size_t n = end - begin, at = t->offset + begin * sizeof(real);
    if (!n) return;
    real *g = (real *)((char *)m->d_grads + at);
    if (grad_scale != 1) be->scale(be, n, g, grad_scale);
    be->adamw(be, n, (real *)((char *)m->d_params + at), g, (real *)((char *)m->d_adam_m + at),
              (real *)((char *)m->d_adam_v + at), lr, beta1, beta2, eps, tensor_weight_decay_(t, weight_decay), m->step);
}

void mtrl_model_params_changed(mtrl_model *m) {
    model_weights_changed(m);
    m->be->sync(m->be);
}

double mtrl_model_optimizer_step(mtrl_model *m, real lr, real beta1, real beta2, real eps, real weight_decay,
                                 real clip) {
    MTRL_CHECKF(!m->inference, "an inference model (mtrl_model_init_infer_on) has no optimizer");
    double t_prof = model_prof_begin(m);
    double sq = 0;
    for (int i = 0; i < m->params.n; i++) sq += mtrl_model_grad_sq_range(m, i, 0, m->params.items[i].numel);
    double norm = sqrt(sq);
    real scale = mtrl_model_clip_scale(norm, clip);
    m->step++;
    for (int i = 0; i < m->params.n; i++)
        mtrl_model_adamw_range(m, i, 0, m->params.items[i].numel, scale, lr, beta1, beta2, eps, weight_decay);
    mtrl_model_params_changed(m);
    model_prof_end_in(m, MTRL_PROF_BWD, MTRL_PROF_OPTIM, t_prof); // the learner's step, after its backward
    return norm;
}

double mtrl_model_load_violation(const mtrl_model *m, int layer) {
    const mtrl_model_dims *d = &m->dims;
    if (layer < d->first_dense || layer >= d->L) return 0;
    long total = 0;
    int load[256];
    for (int e = 0; e < d->E; e++) {
        load[e] = (int)m->load[(size_t)layer * d->E + e];
        total += load[e];
    }
    return mtrl_ref_moe_max_violation(d->E, load, total);
}
