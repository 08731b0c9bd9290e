// backend_cuda.c: the CUDA backend (backend.h): the launchers of kernels/cuda/kernels_cuda.h
// and the small kernels of core/model_ops.cu on device memory, on one stream.
//
// Precision: fp32 activations, states and gradients. GEMMs are cuBLAS on TF32 tensor cores where
// the model asks ([model] gemm = tf32, the default) or in true fp32 (MTRL_F32;
// gemm = fp32, the GPU tests' setting; backend.h mtrl_backend_gemm_tf32), true fp32 chosen over bf16
// operands so the GPU model agrees with the fp32 CPU model to about 1e-5 relative everywhere
// but the MLA attention: the only causal-attention kernel multiplies bf16 operands (tensor
// cores, fp32 accumulation), so the chunked form converts the absorbed
// queries and dout to bf16 copies per call (errors ~1e-3 relative). The MLA latents are STORED
// as bf16 (latent_size 2, issue 8): rows are rounded once when written (latent_put), the
// attention and the absorbed decode (its tensor-core v2 kernel) read them as they are, and
// their gradients stay fp32. [kernels] latent = fp32 keeps fp32 latents (converted per
// attention call, the fp32 decode kernel): the earlier path, for comparison.
// [kernels] gemm = bf16 (backend.h mtrl_backend_gemm_bf16; it wins over TF32) gives the
// dense projections, the MoE experts and the dense SwiGLU FFNs bf16 operands with fp32
// accumulation and fp32 results, for the tensor-core rate (the fp32 GEMMs ran the model at
// fp32 speed, docs/perf.md P7): the weights from one bf16 copy of the parameter block that
// weights_changed_ refreshes (once per optimizer step, load or upload: converting per GEMM
// would repeat the same rounding for every segment), the activations and dy rounded into
// scratch per GEMM (they change every call). The master weights, the optimizer and every
// gradient stay fp32, so the rounding costs accuracy per step (~4e-3 relative per operand)
// without accumulating in the weights.
//
// Decode states are separate allocations per sequence, while the batched decode kernels take
// one block: kda_step runs on each row's state in place (mtrl_kda_step_rows) where its v2
// kernel applies, else it and shortconv_step gather the B states into scratch, run, and scatter
// them back; mla_decode addresses every sequence's latent cache from the lowest one (the
// decode states align their latents for that; otherwise it runs one launch per sequence).
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bf16.h"
#include "common/check.h"
#include "model/backend.h"
#include "model/model.h"

#if defined(MTRL_HAVE_CUDA) && !REAL_IS_F64

#include "kernels/cuda/core/model_ops.h"
#include "model/model_wshm_cuda.h"
#include "kernels/cuda/kernels_cuda.h"

typedef mtrl_backend BE;

typedef struct live_block {
    void *p;
    size_t bytes;
} live_block;

typedef struct cuda_impl {
    mtrl_cuda_ctx *ctx;
    char *scratch;        // the backend's own scratch (the launchers use the context's)
    size_t scratch_bytes;
    double *sq_part;      // [MTRL_MC_SQ_BLOCKS]
    // What the backend holds, for mem_info: the blocks of alloc_ (and sq_part), their sum, and
    // the high-water mark of that sum plus both scratches.
    live_block *live;
    int n_live, cap_live;
    size_t live_bytes, peak_bytes;
    // [kernels] gemm = bf16 (be->gemm_bf16): the bf16 copy w16 of the fp32 parameter block w32 of w_n
    // values that weights_changed_ last saw; one allocation for the backend's lifetime (a model
    // has one parameter block), rounded again at every weights_changed_.
    // The bf16-resident form (mtrl_backend_cuda_weights_bf16): w16 is then the model's own bf16
    // block of w16_bytes (no w32), written by the model, never rounded here.
    const real *w32;
    size_t w_n;
    mtrl_bf16 *w16;
    int resident;
    size_t w16_bytes;
} cuda_impl;

#define CTX(be) (((cuda_impl *)(be)->impl)->ctx)
// A launcher that refuses its arguments is a model bug (the dims were checked at init).
#define OK(call) MTRL_CHECKF((call) == 0, "CUDA launcher refused its arguments: %s", #call)

// ---- what the backend holds ---------------------------------------------------------------------------
//
// Held bytes change at alloc_/release_ and when either scratch grows; the context's scratch grows
// inside launchers, between those events, and never shrinks. Sampling before and after every
// change (and at mem_info) therefore sees the exact high-water mark of the sum.

static void sample_(cuda_impl *x) {
    size_t held = x->live_bytes + x->scratch_bytes + mtrl_mc_ctx_scratch_bytes(x->ctx);
    if (held > x->peak_bytes) x->peak_bytes = held;
}
static void track_(cuda_impl *x, void *p, size_t bytes) {
    if (x->n_live == x->cap_live) {
        x->cap_live = x->cap_live ? 2 * x->cap_live : 64;
        x->live = xrealloc(x->live, sizeof(live_block) * (size_t)x->cap_live);
    }
    x->live[x->n_live++] = (live_block){p, bytes};
    x->live_bytes += bytes;
    sample_(x);
}
static void untrack_(cuda_impl *x, void *p) {
    sample_(x);
    for (int i = x->n_live - 1; i >= 0; i--)
        if (x->live[i].p == p) {
            x->live_bytes -= x->live[i].bytes;
            x->live[i] = x->live[--x->n_live];
            return;
        }
}

// Scratch of at least `bytes` (grow-only; growing waits for the stream, so not while a graph is
// recorded: that fails the recording, whose kernels never run).
static char *scratch_(BE *be, size_t bytes) {
    cuda_impl *x = be->impl;
    if (bytes > x->scratch_bytes && mtrl_cuda_recording(x->ctx)) {
        mtrl_cuda_record_fail(x->ctx);
        return x->scratch;
    }
    if (bytes > x->scratch_bytes) {
        sample_(x);
        mtrl_mc_free(x->ctx, x->scratch);
        x->scratch_bytes = bytes + bytes / 4 + ((size_t)1 << 20);
        x->scratch = mtrl_mc_malloc(x->scratch_bytes);
        sample_(x);
    }
    return x->scratch;
}
// Carving: aligned offsets into one scratch request.
static size_t take_(size_t *off, size_t bytes) {
    size_t o = (*off + 255) & ~(size_t)255;
    *off = o + bytes;
    return o;
}

// ---- memory ----------------------------------------------------------------------------------------

static void *alloc_(BE *be, size_t bytes) {
    if (mtrl_cuda_recording(CTX(be))) { // cudaMalloc is no stream work: not in a recording
        mtrl_cuda_record_fail(CTX(be));
        return NULL;
    }
    void *p = mtrl_mc_malloc(bytes);
    track_(be->impl, p, bytes ? bytes : 1);
    return p;
}
static void release_(BE *be, void *p) {
    if (!p) return;
    untrack_(be->impl, p);
    mtrl_mc_free(CTX(be), p);
}
static void mem_info_(BE *be, size_t *free_h, size_t *total_h, size_t *scratch_h, size_t *peak_h) {
    cuda_impl *x = be->impl;
    size_t fr = 0, tot = 0;
    if (free_h || total_h) mtrl_mc_mem_info(x->ctx, &fr, &tot);
    sample_(x);
    if (free_h) *free_h = fr;
    if (total_h) *total_h = tot;
    if (scratch_h) *scratch_h = x->scratch_bytes + mtrl_mc_ctx_scratch_bytes(x->ctx);
    if (peak_h) *peak_h = x->peak_bytes;
}
static void zero_(BE *be, void *p, size_t bytes) { mtrl_mc_zero(CTX(be), p, bytes); }
static void copy_(BE *be, void *dst, const void *src, size_t bytes) { mtrl_mc_copy(CTX(be), dst, src, bytes); }
static void upload_(BE *be, void *dst, const void *src, size_t bytes) { mtrl_mc_upload(CTX(be), dst, src, bytes); }
static void download_(BE *be, void *dst, const void *src, size_t bytes) {
    mtrl_mc_download(CTX(be), dst, src, bytes);
}
static void sync_(BE *be) { mtrl_cuda_sync(CTX(be)); }
static void copy_rows_(BE *be, int rows, int n, const real *src, int lds, real *dst, int ldd) {
    mtrl_mc_copy_rows(CTX(be), rows, n, src, lds, dst, ldd);
}
// Uploads a host array of B pointers into scratch at *off; returns the device array.
static void *ptrs_(BE *be, char *base, size_t o, int B, const void *const *ptrs_h) {
    mtrl_mc_upload(CTX(be), base + o, ptrs_h, sizeof(void *) * (size_t)B);
    return base + o;
}
static void gather_(BE *be, int B, size_t n, const real *const *src_h, real *dst) {
    if (B <= 0 || !n) return;
    char *s = scratch_(be, sizeof(void *) * (size_t)B);
    mtrl_mc_gather(CTX(be), B, n, ptrs_(be, s, 0, B, (const void *const *)src_h), dst);
}
static void scatter_(BE *be, int B, size_t n, const real *src, real *const *dst_h) {
    if (B <= 0 || !n) return;
    char *s = scratch_(be, sizeof(void *) * (size_t)B);
    mtrl_mc_scatter(CTX(be), B, n, src, ptrs_(be, s, 0, B, (const void *const *)dst_h));
}

// ---- elementwise ------------------------------------------------------------------------------------

static void sigmoid_(BE *be, size_t n, const real *x, real *y) { mtrl_mc_sigmoid(CTX(be), n, x, y); }
static void sigmoid_mul_(BE *be, size_t n, const real *x, const real *a, real *y) {
    mtrl_mc_sigmoid_mul(CTX(be), n, x, a, y);
}
static void sigmoid_mul_bwd_(BE *be, size_t n, const real *x, const real *a, const real *dy, real *da, real *dx) {
    mtrl_mc_sigmoid_mul_bwd(CTX(be), n, x, a, dy, da, dx);
}
static void dsigmoid_(BE *be, size_t n, const real *s, real *dy) { mtrl_mc_dsigmoid(CTX(be), n, s, dy); }
static void add_(BE *be, size_t n, const real *a, const real *b, real *y) { mtrl_mc_add(CTX(be), n, a, b, y); }
static void scale_(BE *be, size_t n, real *x, real s) { mtrl_mc_scale(CTX(be), n, x, s); }

// ---- dense: TF32 (the default), true fp32, or bf16 operands -----------------------------------------------
//
// With gemm_bf16 every operand of gemm_ and of the expert entries is taken as bf16: a master
// weight (a pointer inside the parameter block) from the backend's copy, rounded once per
// weights_changed_ (once per optimizer step, not once per GEMM: a weight feeds several GEMMs
// per segment and every segment of a step); anything else (activations, dy) rounded into the
// backend's scratch per call (stream-ordered, so the next call may reuse it). Outputs and
// gradients stay fp32 (cuBLAS accumulates in fp32; beta = 1 accumulates into fp32 dW).

static void weights_changed_(BE *be, const real *params, size_t n) {
    cuda_impl *x = be->impl;
    MTRL_CHECKF(!x->resident, "weights_changed on bf16-resident weights: the model writes its bf16 block itself");
    if (!be->gemm_bf16) return;
    if (n != x->w_n) {
        release_(be, x->w16);
        x->w16 = alloc_(be, 2 * n);
        x->w_n = n;
    }
    x->w32 = params;
    mtrl_cuda_f32_to_bf16(x->ctx, n, params, x->w16);
}
// 1 when p points into the bf16-resident block (a GEMM-only weight stored as bf16).
static int resident_(const BE *be, const void *p) {
    const cuda_impl *x = be->impl;
    uintptr_t a = (uintptr_t)p, lo = (uintptr_t)x->w16;
    return x->resident && a >= lo && a < lo + x->w16_bytes;
}
// A weight operand of a non-GEMM entry must be fp32: a bf16-resident pointer here is a model
// bug (model_wsplit.h lists the matrices those entries read), caught before a kernel reads bf16
// bits as fp32.
static void fp32_weight_(const BE *be, const void *p) {
    MTRL_CHECKF(!resident_(be, p), "a non-GEMM op was given a bf16-resident weight (model/model_wsplit.h: "
                                   "keep that matrix in fp32)");
}
// The bf16 copy of p when p points into the master weights (or is a bf16-resident weight),
// else NULL.
static const mtrl_bf16 *weight_bf16_(const BE *be, const real *p) {
    const cuda_impl *x = be->impl;
    if (x->resident) return resident_(be, p) ? (const mtrl_bf16 *)(const void *)p : NULL;
    uintptr_t a = (uintptr_t)p, lo = (uintptr_t)x->w32, hi = (uintptr_t)(x->w32 + x->w_n);
    return x->w16 && a >= lo && a < hi ? x->w16 + (p - x->w32) : NULL;
}
// Elements a GEMM reads of a row-major operand of rows x cols with row stride ld.
static size_t span_(int rows, int cols, int ld) {
    return rows > 0 && cols > 0 ? (size_t)(rows - 1) * (size_t)ld + (size_t)cols : 0;
}
// Scratch bytes the bf16 form of n values at p takes: none for a master weight.
static size_t bf16_bytes_(const BE *be, const real *p, size_t n) { return weight_bf16_(be, p) ? 0 : 2 * n; }
// The bf16 form of n values at p: the weights' copy, or p rounded into scratch at s + o
// (reserved by the caller: bf16_bytes_).
static const mtrl_bf16 *bf16_of_(BE *be, char *s, size_t o, const real *p, size_t n) {
    const mtrl_bf16 *w = weight_bf16_(be, p);
    if (w) return w;
    mtrl_cuda_f32_to_bf16(CTX(be), n, p, (mtrl_bf16 *)(s + o));
    return (const mtrl_bf16 *)(s + o);
}

static void gemm_(BE *be, int ta, int tb, int M, int N, int K, real alpha, const real *A, int lda, const real *B,
                  int ldb, real beta, real *C, int ldc) {
    if (!be->gemm_bf16) {
        OK(mtrl_gemm(CTX(be), ta, tb, M, N, K, alpha, A, lda, B, ldb, MTRL_F32, beta, C, ldc, MTRL_F32));
        return;
    }
    size_t na = span_(ta ? K : M, ta ? M : K, lda), nb = span_(tb ? N : K, tb ? K : N, ldb);
    size_t off = 0, oa = take_(&off, bf16_bytes_(be, A, na)), ob = take_(&off, bf16_bytes_(be, B, nb));
    char *s = scratch_(be, off);
    OK(mtrl_gemm(CTX(be), ta, tb, M, N, K, alpha, bf16_of_(be, s, oa, A, na), lda, bf16_of_(be, s, ob, B, nb), ldb,
                 MTRL_BF16, beta, C, ldc, MTRL_F32));
}

// ---- per-token ops ------------------------------------------------------------------------------------

static void rmsnorm_fwd_(BE *be, int N, int D, const real *x, const real *w, real eps, real *y, real *rstd) {
    fp32_weight_(be, w);
    OK(mtrl_rmsnorm_fwd(CTX(be), N, D, x, w, eps, y, rstd));
}
static void rmsnorm_bwd_(BE *be, int N, int D, const real *x, const real *w, const real *rstd, real eps,
                         const real *dy, real *dx, real *dw) {
    OK(mtrl_rmsnorm_bwd(CTX(be), N, D, x, w, rstd, eps, dy, dx, dw));
}
static void l2norm_fwd_(BE *be, int N, int D, const real *x, real eps, real *y) {
    OK(mtrl_l2norm_fwd(CTX(be), N, D, x, eps, y, NULL));
}
static void l2norm_bwd_(BE *be, int N, int D, const real *x, real eps, const real *dy, real *dx) {
    OK(mtrl_l2norm_bwd(CTX(be), N, D, x, eps, dy, dx));
}
static void gated_rmsnorm_fwd_(BE *be, int N, int D, const real *x, const real *z, const real *w, real eps,
                               real *y) {
    fp32_weight_(be, w);
    OK(mtrl_gated_rmsnorm_fwd(CTX(be), N, D, x, z, w, eps, y));
}
static void gated_rmsnorm_bwd_(BE *be, int N, int D, const real *x, const real *z, const real *w, real eps,
                               const real *dy, real *dx, real *dz, real *dw) {
    OK(mtrl_gated_rmsnorm_bwd(CTX(be), N, D, x, z, w, eps, dy, dx, dz, dw));
}
static void shortconv_fwd_(BE *be, int T, int C, int W, const real *x, const real *w, const real *si, real *y,
                           real *so) {
    fp32_weight_(be, w);
    OK(mtrl_shortconv_fwd(CTX(be), T, C, W, x, w, si, y, so));
}
static void shortconv_bwd_(BE *be, int T, int C, int W, const real *x, const real *w, const real *si,
                           const real *dy, real *dx, real *dw, real *dsi) {
    OK(mtrl_shortconv_bwd(CTX(be), T, C, W, x, w, si, dy, dx, dw, dsi));
}
static void shortconv_state_bwd_(BE *be, int T, int C, int W, const real *dso, real *dx, real *dsi) {
    OK(mtrl_shortconv_state_bwd(CTX(be), T, C, W, dso, dx, dsi));
}
static void shortconv_fwd_varlen_(BE *be, int n, const int *offs, int C, int W, const real *x, const real *w,
                                  real *y) {
    fp32_weight_(be, w);
    OK(mtrl_shortconv_fwd_varlen(CTX(be), n, offs, C, W, x, w, y));
}
static void shortconv_bwd_varlen_(BE *be, int n, const int *offs, int C, int W, const real *x, const real *w,
                                  const real *dy, real *dx, real *dw) {
    OK(mtrl_shortconv_bwd_varlen(CTX(be), n, offs, C, W, x, w, dy, dx, dw));
}
// The same from a device array of the B states' pointers (the decode step's: nothing uploaded).
static float *states_in_dev_(BE *be, int B, size_t n, real *const *st) {
    float *blk = (float *)scratch_(be, sizeof(float) * (size_t)B * n);
    mtrl_mc_gather(CTX(be), B, n, (const float *const *)st, blk);
    return blk;
}
static void shortconv_step_(BE *be, int B, int C, int W, const real *x1, const real *w, real *const *win,
                            real *y1) {
    fp32_weight_(be, w);
    if (B <= 0) return;
    size_t n = (size_t)(W - 1) * C;
    if (!n) {
        OK(mtrl_shortconv_step(CTX(be), B, C, W, x1, w, NULL, y1));
        return;
    }
    float *blk = states_in_dev_(be, B, n, win);
    OK(mtrl_shortconv_step(CTX(be), B, C, W, x1, w, blk, y1));
    mtrl_mc_scatter(CTX(be), B, n, blk, (float *const *)win);
}
static void embedding_fwd_(BE *be, int N, int D, const int *ids, const real *E, real *x) {
    fp32_weight_(be, E);
    if (N <= 0) return;
    int *d = (int *)scratch_(be, sizeof(int) * (size_t)N);
    mtrl_mc_upload(CTX(be), d, ids, sizeof(int) * (size_t)N);
    mtrl_mc_embedding_fwd(CTX(be), N, D, d, E, x);
}
static void embedding_rows_(BE *be, int N, int D, const int *ids, const real *E, real *x) {
    fp32_weight_(be, E);
    if (N > 0) mtrl_mc_embedding_fwd(CTX(be), N, D, ids, E, x);
}
static void embedding_bwd_(BE *be, int N, int D, const int *ids, const real *dx, real *dE) {
    if (N <= 0) return;
    int *d = (int *)scratch_(be, sizeof(int) * (size_t)N);
    mtrl_mc_upload(CTX(be), d, ids, sizeof(int) * (size_t)N);
    mtrl_mc_embedding_bwd(CTX(be), N, D, d, dx, dE);
}
static void logprob_fwd_(BE *be, int N, int V, const real *logits, const int *tg, real *logp, real *ent) {
    if (N <= 0) return;
    size_t off = 0, ot = take_(&off, sizeof(int) * (size_t)N), ol = take_(&off, sizeof(float) * (size_t)N),
           oe = take_(&off, sizeof(float) * (size_t)N);
    char *s = scratch_(be, off);
    mtrl_mc_upload(CTX(be), s + ot, tg, sizeof(int) * (size_t)N);
    OK(mtrl_logprob_fwd(CTX(be), N, V, logits, (int *)(s + ot), (float *)(s + ol), ent ? (float *)(s + oe) : NULL));
    mtrl_mc_download(CTX(be), logp, s + ol, sizeof(float) * (size_t)N);
    if (ent) mtrl_mc_download(CTX(be), ent, s + oe, sizeof(float) * (size_t)N);
}
static void logprob_bwd_(BE *be, int N, int V, const real *logits, const int *tg, const real *dlogp,
                         const real *dent, real *dlogits) {
    if (N <= 0) return;
    size_t off = 0, ot = take_(&off, sizeof(int) * (size_t)N), ol = take_(&off, sizeof(float) * (size_t)N),
           oe = take_(&off, sizeof(float) * (size_t)N);
    char *s = scratch_(be, off);
    mtrl_mc_upload(CTX(be), s + ot, tg, sizeof(int) * (size_t)N);
    mtrl_mc_upload(CTX(be), s + ol, dlogp, sizeof(float) * (size_t)N);
    if (dent) mtrl_mc_upload(CTX(be), s + oe, dent, sizeof(float) * (size_t)N);
    OK(mtrl_logprob_bwd(CTX(be), N, V, logits, (int *)(s + ot), (float *)(s + ol), dent ? (float *)(s + oe) : NULL,
                        dlogits));
}
static void adamw_(BE *be, size_t n, real *p, const real *g, real *m, real *v, real lr, real b1, real b2, real eps,
                   real wd, long step) {
    OK(mtrl_adamw(CTX(be), n, p, g, m, v, lr, b1, b2, eps, wd, step));
}
static double grad_sq_norm_(BE *be, size_t n, const real *g) {
    cuda_impl *x = be->impl;
    return mtrl_mc_sq_norm(x->ctx, n, g, x->sq_part);
}

// ---- KDA -----------------------------------------------------------------------------------------------

// The Kimi gate clamped at g_min: the chunked kernels need every g >= g_min >= MTRL_KDA_TC_G_MIN
// (kernels_cuda.h, docs/model-forms.md). Decode uses the same gate, so a GPU's forms agree with one another.
static void kda_gate_fwd_(BE *be, int kind, int T, int H, int K, const real *f, const real *A, const real *b,
                          real gm, real *g) {
    if (kind == MTRL_KDA_GATE_KIMI) OK(mtrl_kda_gate_kimi_fwd(CTX(be), T, H, K, f, A, b, gm, g));
    else OK(mtrl_kda_gate_fwd(CTX(be), T, H, K, f, A, b, gm, g));
}
static void kda_gate_bwd_(BE *be, int kind, int T, int H, int K, const real *f, const real *A, const real *b,
                          real gm, const real *dg, real *df, real *dA, real *db) {
    if (kind == MTRL_KDA_GATE_KIMI) OK(mtrl_kda_gate_kimi_bwd(CTX(be), T, H, K, f, A, b, gm, dg, df, dA, db));
    else OK(mtrl_kda_gate_bwd(CTX(be), T, H, K, f, A, b, gm, dg, df, dA, db));
}
static void shortconv_fwd_varlen_io_(BE *be, int n, const int *offs, int C, int W, const real *x, const real *w,
                                     const real *const *win_in, real *const *win_out, real *y) {
    fp32_weight_(be, w);
    OK(mtrl_shortconv_fwd_varlen_io(CTX(be), n, offs, C, W, x, w, win_in, win_out, y));
}
static void kda_chunk_fwd_varlen_io_(BE *be, int n, const int *offs, int H, int K, int V, const real *q,
                                     const real *k, const real *v, const real *g, const real *beta,
                                     const real *const *S0, real *o, real *const *Sf, real *St) {
    OK(mtrl_kda_chunk_fwd_varlen_io(CTX(be), n, offs, H, K, V, q, k, v, g, beta, S0, o, Sf, St));
}
static void kda_chunk_fwd_(BE *be, int T, int H, int K, int V, const real *q, const real *k, const real *v,
                           const real *g, const real *beta, const real *S0, real *o, real *Sf, real *St) {
    OK(mtrl_kda_chunk_fwd_cp(CTX(be), mtrl_cuda_ctx_opts(CTX(be))->kda_seq_pieces, T, H, K, V, q, k, v, g, beta, S0, o, Sf, St));
}
static void kda_chunk_bwd_(BE *be, int T, int H, int K, int V, const real *q, const real *k, const real *v,
                           const real *g, const real *beta, const real *S0, const real *St, const real *dout,
                           const real *dSf, real *dq, real *dk, real *dv, real *dg, real *dbeta, real *dS0) {
    OK(mtrl_kda_chunk_bwd(CTX(be), T, H, K, V, q, k, v, g, beta, S0, St, dout, dSf, dq, dk, dv, dg, dbeta, dS0));
}
static void kda_chunk_fwd_varlen_(BE *be, int n, const int *offs, int H, int K, int V, const real *q, const real *k,
                                  const real *v, const real *g, const real *beta, real *o, real *Sf, real *St) {
    OK(mtrl_kda_chunk_fwd_varlen(CTX(be), n, offs, H, K, V, q, k, v, g, beta, o, Sf, St));
}
static void kda_chunk_bwd_varlen_(BE *be, int n, const int *offs, int H, int K, int V, const real *q, const real *k,
                                  const real *v, const real *g, const real *beta, const real *St,
                                  const real *dout, real *dq, real *dk, real *dv, real *dg, real *dbeta) {
    OK(mtrl_kda_chunk_bwd_varlen(CTX(be), n, offs, H, K, V, q, k, v, g, beta, St, dout, dq, dk, dv, dg, dbeta));
}
static void kda_step_(BE *be, int B, int H, int K, int V, const real *q, const real *k, const real *v,
                      const real *g, const real *beta, real *const *S_h, real *const *S, real *o) {
    if (B <= 0) return;
    size_t n = (size_t)H * K * V;
    if (mtrl_kda_step_rows_ok(CTX(be), B, H, K, V, q, k, v, g, (const float *const *)S_h, o)) {
        // each state read and written once, in place (no gather into scratch and scatter back)
        OK(mtrl_kda_step_rows(CTX(be), B, H, K, V, q, k, v, g, beta, (float *const *)S, o));
        return;
    }
    float *blk = states_in_dev_(be, B, n, S);
    OK(mtrl_kda_step(CTX(be), B, H, K, V, q, k, v, g, beta, blk, o));
    mtrl_mc_scatter(CTX(be), B, n, blk, (float *const *)S);
}

// ---- MLA latents ------------------------------------------------------------------------------------------
//
// Stored as bf16 (latent_size 2) or, under [kernels] latent = fp32, fp32 (backend.h
// mtrl_backend_latent_size).

static int lat_type_(const BE *be) { return be->latent_size == 2 ? MTRL_BF16 : MTRL_F32; }

static void latent_put_(BE *be, int B, int rows, int n, const real *src, int lds, void *const *dst, int ldd) {
    if (B <= 0 || rows <= 0 || n <= 0) return;
    char *s = scratch_(be, sizeof(void *) * (size_t)B);
    mtrl_mc_latent_put(CTX(be), B, rows, n, src, lds, ptrs_(be, s, 0, B, (const void *const *)dst), ldd,
                       lat_type_(be));
}
static void latent_put_rows_(BE *be, int B, int n, const real *src, int lds, void *const *dst, int ldd) {
    if (B > 0 && n > 0) mtrl_mc_latent_put(CTX(be), B, 1, n, src, lds, dst, ldd, lat_type_(be));
}
static void latent_get_(BE *be, int rows, int n, const void *src, int lds, real *dst, int ldd) {
    mtrl_mc_latent_get(CTX(be), rows, n, src, lds, dst, ldd, lat_type_(be));
}
static void latent_gather_(BE *be, int rows, int n, const void *const *src, real *dst, int ldd) {
    if (rows <= 0 || n <= 0) return;
    char *s = scratch_(be, sizeof(void *) * (size_t)rows);
    mtrl_mc_latent_gather(CTX(be), rows, n, (const void *const *)ptrs_(be, s, 0, rows, src), dst, ldd, lat_type_(be));
}
// Through the host: a bf16 cache crosses as bf16 (half the bytes of the bus) and is widened or
// rounded there, with the GPU's rounding (common/bf16.h).
static void latent_download_(BE *be, size_t n, const void *src, real *dst) {
    if (lat_type_(be) == MTRL_F32) {
        mtrl_mc_download(CTX(be), dst, src, sizeof(float) * n);
        return;
    }
    uint16_t *h = xmalloc(2 * n + 2);
    mtrl_mc_download(CTX(be), h, src, 2 * n);
    for (size_t i = 0; i < n; i++) dst[i] = mtrl_bf16_to_f32(h[i]);
    free(h);
}
static void latent_upload_(BE *be, size_t n, const real *src, void *dst) {
    if (lat_type_(be) == MTRL_F32) {
        mtrl_mc_upload(CTX(be), dst, src, sizeof(float) * n);
        return;
    }
    uint16_t *h = xmalloc(2 * n + 2);
    for (size_t i = 0; i < n; i++) h[i] = mtrl_bf16_from_f32(src[i]);
    mtrl_mc_upload(CTX(be), dst, h, 2 * n); // staged before it returns: h may go
    free(h);
}

// ---- attention / MLA -------------------------------------------------------------------------------------
//
// The attention kernel takes bf16 q, k, v (and dout). q and dout are converted into scratch per
// call; k and v are latents, read as stored when they are bf16, else ([kernels] latent = fp32)
// converted too, as Tk whole rows of their stride (v only when it is not the same array).

// The bf16 form of Tk latent rows of stride ld at `lat`: the cache itself, or its copy at
// scratch offset o (reserved by the caller: lat_copy_bytes_).
static size_t lat_copy_bytes_(const BE *be, int Tk, int ld, int needed) {
    return needed && lat_type_(be) == MTRL_F32 ? 2 * (size_t)Tk * ld : 0;
}
static const mtrl_bf16 *lat_bf16_(BE *be, char *s, size_t o, int Tk, int ld, const void *lat) {
    if (lat_type_(be) == MTRL_BF16) return lat;
    mtrl_cuda_f32_to_bf16(CTX(be), (size_t)Tk * ld, lat, (mtrl_bf16 *)(s + o));
    return (const mtrl_bf16 *)(s + o);
}

// [kernels] attn_operands = fp32 (its config check requires fp32 latents, so k and v are fp32 here).
static int attn_f32_(BE *be) {
    if (!mtrl_cuda_ctx_opts(CTX(be))->attn_fp32) return 0;
    MTRL_CHECK(lat_type_(be) == MTRL_F32);
    return 1;
}

// The bf16 operands of one call in the backend's scratch: q (and dout, when given) converted, the
// Tk key and value rows as stored or converted.
typedef struct {
    const mtrl_bf16 *q, *k, *v, *dout;
} attn_ops_;
static attn_ops_ attn_ops_make_(BE *be, int Tq, int Tk, int H, int Dk, int Dv, const real *q, const void *k, int ldk,
                                const void *v, int ldv, const real *dout) {
    int alias = v == k && ldv == ldk;
    size_t nq = (size_t)Tq * H * Dk, nd = dout ? (size_t)Tq * H * Dv : 0;
    size_t off = 0, oq = take_(&off, 2 * nq), ok = take_(&off, lat_copy_bytes_(be, Tk, ldk, 1)),
           ov = take_(&off, lat_copy_bytes_(be, Tk, ldv, !alias)), od = take_(&off, 2 * nd);
    char *s = scratch_(be, off);
    mtrl_cuda_ctx *c = CTX(be);
    attn_ops_ r;
    mtrl_cuda_f32_to_bf16(c, nq, q, (mtrl_bf16 *)(s + oq));
    r.q = (const mtrl_bf16 *)(s + oq);
    r.k = lat_bf16_(be, s, ok, Tk, ldk, k);
    r.v = alias ? r.k : lat_bf16_(be, s, ov, Tk, ldv, v);
    r.dout = NULL;
    if (dout) {
        mtrl_cuda_f32_to_bf16(c, nd, dout, (mtrl_bf16 *)(s + od));
        r.dout = (const mtrl_bf16 *)(s + od);
    }
    return r;
}

static void attn_causal_fwd_(BE *be, int Tq, int Tk, int H, int Hk, int Dk, int Dv, real scale, const real *q,
                             const void *k, int ldk, const void *v, int ldv, real *o, real *lse) {
    if (attn_f32_(be)) {
        OK(mtrl_attn_causal_fwd_f32(CTX(be), Tq, Tk, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv, o, lse));
        return;
    }
    attn_ops_ x = attn_ops_make_(be, Tq, Tk, H, Dk, Dv, q, k, ldk, v, ldv, NULL);
    OK(mtrl_attn_causal_fwd(CTX(be), Tq, Tk, H, Hk, Dk, Dv, scale, x.q, x.k, ldk, x.v, ldv, o, lse));
}
static void attn_causal_bwd_(BE *be, int Tq, int Tk, int H, int Hk, int Dk, int Dv, real scale, const real *q,
                             const void *k, int ldk, const void *v, int ldv, const real *o, const real *lse,
                             const real *dout, real *dq, real *dk, real *dv) {
    if (attn_f32_(be)) {
        OK(mtrl_attn_causal_bwd_f32(CTX(be), Tq, Tk, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv, o, lse, dout, dq, dk,
                                    dv));
        return;
    }
    int alias = v == k && ldv == ldk;
    attn_ops_ x = attn_ops_make_(be, Tq, Tk, H, Dk, Dv, q, k, ldk, v, ldv, dout);
    OK(mtrl_attn_causal_bwd(CTX(be), Tq, Tk, H, Hk, Dk, Dv, scale, x.q, x.k, ldk, x.v, ldv, o, lse, x.dout, dq, dk,
                            alias ? dk : dv));
}
// The varlen forms: q (and dout) of the whole pack converted once, its key rows read as stored
// (or converted once), one varlen call (bit for bit the per-piece calls above). The offsets are
// rebased to the first piece's rows. With attn_operands = fp32: the check kernels once per piece.
static void vl_rebase_(int n, const int *qoffs, const int *koffs, int *qo, int *ko, size_t *q0, size_t *k0) {
    const int *kk = koffs ? koffs : qoffs;
    *q0 = (size_t)qoffs[0];
    *k0 = (size_t)kk[0];
    for (int i = 0; i <= n; i++) {
        qo[i] = qoffs[i] - qoffs[0];
        ko[i] = kk[i] - kk[0];
    }
}
static void attn_causal_fwd_varlen_(BE *be, int n, const int *qoffs, const int *koffs, int H, int Hk, int Dk,
                                    int Dv, real scale, const real *q, const void *k, int ldk, const void *v, int ldv,
                                    real *o, real *lse) {
    if (n <= 0) return;
    const int *kk = koffs ? koffs : qoffs;
    if (attn_f32_(be)) {
        for (int i = 0; i < n; i++) {
            size_t a = (size_t)qoffs[i], b = (size_t)kk[i];
            attn_causal_fwd_(be, qoffs[i + 1] - qoffs[i], kk[i + 1] - kk[i], H, Hk, Dk, Dv, scale, q + a * H * Dk,
                             mtrl_latent_at(be, k, b * ldk), ldk, mtrl_latent_at(be, v, b * ldv), ldv,
                             o + a * H * Dv, lse + a * H);
        }
        return;
    }
    int *qo = xmalloc(sizeof(int) * 2 * ((size_t)n + 1)), *ko = qo + n + 1;
    size_t q0, k0;
    vl_rebase_(n, qoffs, koffs, qo, ko, &q0, &k0);
    q += q0 * H * Dk, o += q0 * H * Dv, lse += q0 * H;
    attn_ops_ x = attn_ops_make_(be, qo[n], ko[n], H, Dk, Dv, q, mtrl_latent_at(be, k, k0 * ldk), ldk,
                                 mtrl_latent_at(be, v, k0 * ldv), ldv, NULL);
    OK(mtrl_attn_causal_fwd_varlen(CTX(be), n, qo, ko, H, Hk, Dk, Dv, scale, x.q, x.k, ldk, x.v, ldv, o, lse));
    free(qo);
}
static void attn_causal_bwd_varlen_(BE *be, int n, const int *qoffs, const int *koffs, int H, int Hk, int Dk,
                                    int Dv, real scale, const real *q, const void *k, int ldk, const void *v, int ldv,
                                    const real *o, const real *lse, const real *dout, real *dq, real *dk, real *dv) {
    if (n <= 0) return;
    const int *kk = koffs ? koffs : qoffs;
    if (attn_f32_(be)) {
        for (int i = 0; i < n; i++) {
            size_t a = (size_t)qoffs[i], b = (size_t)kk[i];
            attn_causal_bwd_(be, qoffs[i + 1] - qoffs[i], kk[i + 1] - kk[i], H, Hk, Dk, Dv, scale, q + a * H * Dk,
                             mtrl_latent_at(be, k, b * ldk), ldk, mtrl_latent_at(be, v, b * ldv), ldv,
                             o + a * H * Dv, lse + a * H, dout + a * H * Dv, dq + a * H * Dk, dk + b * ldk,
                             dv + b * ldv);
        }
        return;
    }
    int *qo = xmalloc(sizeof(int) * 2 * ((size_t)n + 1)), *ko = qo + n + 1;
    size_t q0, k0;
    vl_rebase_(n, qoffs, koffs, qo, ko, &q0, &k0);
    const int alias = v == k && ldv == ldk;
    q += q0 * H * Dk, o += q0 * H * Dv, lse += q0 * H, dout += q0 * H * Dv, dq += q0 * H * Dk;
    dk += k0 * ldk, dv += k0 * ldv;
    attn_ops_ x = attn_ops_make_(be, qo[n], ko[n], H, Dk, Dv, q, mtrl_latent_at(be, k, k0 * ldk), ldk,
                                 mtrl_latent_at(be, v, k0 * ldv), ldv, dout);
    OK(mtrl_attn_causal_bwd_varlen(CTX(be), n, qo, ko, H, Hk, Dk, Dv, scale, x.q, x.k, ldk, x.v, ldv, o, lse, x.dout,
                                   dq, dk, alias ? dk : dv));
    free(qo);
}
// W_kvb [H*(dn+dv)][dc]: head h's W_UK at h*(dn+dv)*dc, its W_UV dn*dc further (mla_ref.h).
static void mla_absorb_q_(BE *be, int N, int H, int dn, int dr, int dv, int dc, const real *q, const real *W,
                          real *qt) {
    fp32_weight_(be, W);
    mtrl_cuda_ctx *c = CTX(be);
    int ldq = H * (dn + dr), ldt = H * (dc + dr);
    long long sw = (long long)(dn + dv) * dc;
    OK(mtrl_gemm_batched(c, 0, 0, N, dc, dn, 1.f, q, ldq, dn + dr, W, dc, sw, MTRL_F32, 0.f, qt, ldt, dc + dr,
                         MTRL_F32, H));
    mtrl_mc_copy_rows(c, N * H, dr, q + dn, dn + dr, qt + dc, dc + dr);
}
static void mla_absorb_q_bwd_(BE *be, int N, int H, int dn, int dr, int dv, int dc, const real *q, const real *W,
                              const real *dqt, real *dq, real *dW) {
    mtrl_cuda_ctx *c = CTX(be);
    int ldq = H * (dn + dr), ldt = H * (dc + dr);
    long long sw = (long long)(dn + dv) * dc;
    OK(mtrl_gemm_batched(c, 0, 1, N, dn, dc, 1.f, dqt, ldt, dc + dr, W, dc, sw, MTRL_F32, 0.f, dq, ldq, dn + dr,
                         MTRL_F32, H));
    mtrl_mc_copy_rows(c, N * H, dr, dqt + dc, dc + dr, dq + dn, dn + dr);
    if (dW)
        OK(mtrl_gemm_batched(c, 1, 0, dn, dc, N, 1.f, q, ldq, dn + dr, dqt, ldt, dc + dr, MTRL_F32, 1.f, dW, dc, sw,
                             MTRL_F32, H));
}
// The naive form (mla_ref.h mla_expand_kv): one strided batch over the heads per product (ĉ is
// the same A for every head: stride 0), fp32 as the absorption products; k^r copied per head.
static void mla_expand_kv_(BE *be, int N, int H, int dn, int dr, int dv, int dc, const real *cl, int ldc,
                           const real *kr, int ldr, const real *W, real *k, real *v) {
    fp32_weight_(be, W);
    mtrl_cuda_ctx *c = CTX(be);
    int ldk = H * (dn + dr);
    long long sw = (long long)(dn + dv) * dc;
    OK(mtrl_gemm_batched(c, 0, 1, N, dn, dc, 1.f, cl, ldc, 0, W, dc, sw, MTRL_F32, 0.f, k, ldk, dn + dr, MTRL_F32,
                         H));
    OK(mtrl_gemm_batched(c, 0, 1, N, dv, dc, 1.f, cl, ldc, 0, W + (size_t)dn * dc, dc, sw, MTRL_F32, 0.f, v, H * dv,
                         dv, MTRL_F32, H));
    for (int h = 0; h < H; h++) mtrl_mc_copy_rows(c, N, dr, kr, ldr, k + (size_t)h * (dn + dr) + dn, ldk);
}
// dlat_c += Σ_h (dk^n_h W_UK,h + dv_h W_UV,h): a sum over heads, so one GEMM per head and product
// accumulating in place (beta 1); dW per head is one strided batch; dlat_kr += Σ_h dk^r_h.
static void mla_expand_kv_bwd_(BE *be, int N, int H, int dn, int dr, int dv, int dc, const real *cl, int ldc,
                               const real *W, const real *dk, const real *dvals, real *dlat_c, int ld_c,
                               real *dlat_kr, int ld_kr, real *dW) {
    mtrl_cuda_ctx *c = CTX(be);
    int ldk = H * (dn + dr);
    long long sw = (long long)(dn + dv) * dc;
    for (int h = 0; h < H; h++) {
        const real *Wh = W + (size_t)h * sw;
        OK(mtrl_gemm(c, 0, 0, N, dc, dn, 1.f, dk + (size_t)h * (dn + dr), ldk, Wh, dc, MTRL_F32, 1.f, dlat_c, ld_c,
                     MTRL_F32));
        OK(mtrl_gemm(c, 0, 0, N, dc, dv, 1.f, dvals + (size_t)h * dv, H * dv, Wh + (size_t)dn * dc, dc, MTRL_F32,
                     1.f, dlat_c, ld_c, MTRL_F32));
    }
    if (dr > 0) mtrl_mc_sum_heads(c, N, H, dr, dk + dn, ldk, dn + dr, dlat_kr, ld_kr);
    if (dW) {
        OK(mtrl_gemm_batched(c, 1, 0, dn, dc, N, 1.f, dk, ldk, dn + dr, cl, ldc, 0, MTRL_F32, 1.f, dW, dc, sw,
                             MTRL_F32, H));
        OK(mtrl_gemm_batched(c, 1, 0, dv, dc, N, 1.f, dvals, H * dv, dv, cl, ldc, 0, MTRL_F32, 1.f,
                             dW + (size_t)dn * dc, dc, sw, MTRL_F32, H));
    }
}
static void mla_up_v_(BE *be, int N, int H, int dn, int dv, int dc, const real *cs, const real *W, real *a) {
    fp32_weight_(be, W);
    OK(mtrl_gemm_batched(CTX(be), 0, 1, N, dv, dc, 1.f, cs, H * dc, dc, W + (size_t)dn * dc, dc,
                         (long long)(dn + dv) * dc, MTRL_F32, 0.f, a, H * dv, dv, MTRL_F32, H));
}
static void mla_up_v_bwd_(BE *be, int N, int H, int dn, int dv, int dc, const real *cs, const real *W,
                          const real *da, real *dcs, real *dW) {
    mtrl_cuda_ctx *c = CTX(be);
    long long sw = (long long)(dn + dv) * dc;
    OK(mtrl_gemm_batched(c, 0, 0, N, dc, dv, 1.f, da, H * dv, dv, W + (size_t)dn * dc, dc, sw, MTRL_F32, 0.f, dcs,
                         H * dc, dc, MTRL_F32, H));
    if (dW)
        OK(mtrl_gemm_batched(c, 1, 0, dv, dc, N, 1.f, da, H * dv, dv, cs, H * dc, dc, MTRL_F32, 1.f,
                             dW + (size_t)dn * dc, dc, sw, MTRL_F32, H));
}
// Every row's cache from one pool based at address 0 (mtrl_mc_ptr_rows: the start rows are
// computed on the device from the backend array, so a recorded step reads the rows of whatever
// states the step names) when every cache starts at a multiple of the row size from 0, as the
// decode states align them; otherwise one launch per sequence (host offsets: not recordable).
// The split over the keys follows B and mtrl_backend_decode_len of the longest row (backend.h).
static void mla_decode_(BE *be, int B, int H, int dn, int dr, int dv, int dc, real scale, const real *q,
                        const real *W, const void *const *lat_h, const void *const *lat, int ld,
                        const int *Tk_h, const int *Tk, real *a) {
    fp32_weight_(be, W);
    if (B <= 0) return;
    mtrl_cuda_ctx *c = CTX(be);
    int max_len = 1;
    for (int r = 0; r < B; r++)
        if (Tk_h[r] > max_len) max_len = Tk_h[r];
    max_len = mtrl_backend_decode_len(max_len);
    size_t row = be->latent_size * (size_t)ld;
    int pooled = 1;
    for (int r = 0; r < B && pooled; r++) pooled = (uintptr_t)lat_h[r] % row == 0;
    if (pooled) {
        long long *st = (long long *)scratch_(be, sizeof(long long) * (size_t)B);
        mtrl_mc_ptr_rows(c, B, lat, row, st);
        OK(mtrl_mla_decode_absorbed(c, B, H, dn, dr, dv, dc, scale, q, W, NULL, lat_type_(be), ld, st, Tk, max_len,
                                    a));
        return;
    }
    // One launch per sequence, each on its own cache (start row 0).
    size_t off = 0, os = take_(&off, sizeof(long long) * (size_t)B);
    char *s = scratch_(be, off);
    long long *st = xcalloc((size_t)B, sizeof(long long));
    mtrl_mc_upload(c, s + os, st, sizeof(long long) * (size_t)B);
    for (int r = 0; r < B; r++)
        OK(mtrl_mla_decode_absorbed(c, 1, H, dn, dr, dv, dc, scale, q + (size_t)r * H * (dn + dr), W, lat_h[r],
                                    lat_type_(be), ld, (const long long *)(s + os), Tk + r, Tk_h[r],
                                    a + (size_t)r * H * dv));
    free(st);
}

// ---- MoE ----------------------------------------------------------------------------------------------------

static void moe_router_fwd_(BE *be, int N, int E, int K, const real *z, const real *beta, int sm, real rho,
                            int replay, int *sel, real *w, real *s) {
    OK(mtrl_moe_router_fwd(CTX(be), N, E, K, z, beta, sm, rho, replay, sel, w, s));
}
static void moe_router_bwd_(BE *be, int N, int E, int K, const real *s, const int *sel, const real *w, int sm,
                            real rho, const real *dw, real *dz) {
    OK(mtrl_moe_router_bwd(CTX(be), N, E, K, s, sel, w, sm, rho, dw, dz));
}
static void moe_dispatch_(BE *be, int N, int E, int K, const int *sel, int *off, int *perm, int *pos) {
    OK(mtrl_moe_dispatch(CTX(be), N, E, K, sel, off, perm, pos));
}
static void moe_gather_(BE *be, int N, int K, int D, const int *pos, const real *x, real *Xp) {
    OK(mtrl_moe_gather(CTX(be), N, K, D, pos, x, Xp, MTRL_F32));
}
static void moe_combine_fwd_(BE *be, int N, int K, int D, const int *pos, const real *w, const real *Yp, real *y) {
    OK(mtrl_moe_combine_fwd(CTX(be), N, K, D, pos, w, Yp, y));
}
static void moe_combine_bwd_(BE *be, int N, int K, int D, const int *pos, const real *w, const real *Yp,
                             const real *dy, real *dYp, real *dw) {
    OK(mtrl_moe_combine_bwd(CTX(be), N, K, D, pos, w, Yp, dy, dYp, dw));
}
static void moe_scatter_bwd_(BE *be, int N, int K, int D, const int *pos, const real *dXp, real *dx) {
    OK(mtrl_moe_scatter_bwd(CTX(be), N, K, D, pos, dXp, dx));
}
// The expert loop needs the segment offsets on the host (the grouped kernels do not: they take
// the device offsets and R).
static int *offsets_h_(BE *be, int E, const int *off) {
    int *h = xmalloc(sizeof(int) * (size_t)(E + 1));
    mtrl_mc_download(CTX(be), h, off, sizeof(int) * (size_t)(E + 1));
    return h;
}
// The operands of the expert GEMMs, op = {X [R][D], W1, W3 [E][I][D], W2 [E][D][I]}: as they
// are (MTRL_F32), or replaced by their bf16 forms (MTRL_BF16, gemm_bf16: X rounded into
// scratch, the weights' copies; the launchers round dY and the SwiGLU products themselves).
static int experts_operands_(BE *be, int E, int D, int I, size_t R, const void *op[4]) {
    if (!be->gemm_bf16) return MTRL_F32;
    size_t n[4] = {R * (size_t)D, (size_t)E * I * D, (size_t)E * I * D, (size_t)E * D * I}, o[4], off = 0;
    for (int i = 0; i < 4; i++) o[i] = take_(&off, bf16_bytes_(be, op[i], n[i]));
    char *s = scratch_(be, off);
    for (int i = 0; i < 4; i++) op[i] = bf16_of_(be, s, o[i], op[i], n[i]);
    return MTRL_BF16;
}
// The experts on the host offsets h [E+1], in the backend's operand type: the grouped kernels
// (on the device offsets `off`) where mtrl_moe_experts_path (the forward: _fwd_path) picks
// them, else the per-expert chains of mtrl_moe_experts_fwd / _bwd. off is NULL for the dense
// FFN (E = 1: the chains).
// The grouped kernels also need 16-byte aligned operands (p [n]).
static int experts_grouped_(BE *be, int E, int D, int I, const int *off, long R, int type, const void *const *p,
                            int n, int fwd) {
    for (int i = 0; i < n; i++)
        if ((uintptr_t)p[i] & 15) return 0;
    int path = fwd ? mtrl_moe_experts_fwd_path(CTX(be), E, D, I, R, type) : mtrl_moe_experts_path(CTX(be), E, D, I, R, type);
    return off && path == MTRL_MOE_GROUPED;
}
// R rows; h the host offsets, or NULL: read back here only where the chains need them.
static void experts_fwd_(BE *be, int E, int D, int I, const int *off, int R, const int *h, const real *X,
                         const real *W1, const real *W3, const real *W2, real *u1, real *u3, real *Y) {
    const void *op[4] = {X, W1, W3, W2};
    int type = experts_operands_(be, E, D, I, (size_t)R, op);
    const void *p[7] = {op[0], op[1], op[2], op[3], u1, u3, Y};
    if (experts_grouped_(be, E, D, I, off, R, type, p, 7, 1)) {
        OK(mtrl_moe_experts_grouped_fwd(CTX(be), E, D, I, R, off, op[0], op[1], op[2], op[3], type, u1, u3, Y));
        return;
    }
    int *hh = h ? NULL : offsets_h_(be, E, off);
    OK(mtrl_moe_experts_fwd(CTX(be), E, D, I, h ? h : hh, op[0], op[1], op[2], op[3], type, u1, u3, Y));
    free(hh);
}
static void experts_bwd_(BE *be, int E, int D, int I, const int *off, const int *h, const real *X, const real *W1,
                         const real *W3, const real *W2, const real *u1, const real *u3, const real *dY, real *dX,
                         real *dW1, real *dW3, real *dW2) {
    const void *op[4] = {X, W1, W3, W2};
    int type = experts_operands_(be, E, D, I, (size_t)h[E], op);
    const void *p[11] = {op[0], op[1], op[2], op[3], u1, u3, dY, dX, dW1, dW3, dW2};  // NULL is aligned
    if (experts_grouped_(be, E, D, I, off, h[E], type, p, 11, 0))
        OK(mtrl_moe_experts_grouped_bwd(CTX(be), E, D, I, h[E], off, op[0], op[1], op[2], op[3], type, u1, u3, dY, dX,
                                        dW1, dW3, dW2));
    else
        OK(mtrl_moe_experts_bwd(CTX(be), E, D, I, h, op[0], op[1], op[2], op[3], type, u1, u3, dY, dX, dW1, dW3,
                                dW2));
}
static void moe_experts_fwd_(BE *be, int E, int D, int I, int R, const int *off, const real *Xp, const real *W1,
                             const real *W3, const real *W2, real *u1, real *u3, real *Yp) {
    experts_fwd_(be, E, D, I, off, R, NULL, Xp, W1, W3, W2, u1, u3, Yp);
}
static void moe_experts_bwd_(BE *be, int E, int D, int I, const int *off, const real *Xp, const real *W1,
                             const real *W3, const real *W2, const real *u1, const real *u3, const real *dYp,
                             real *dXp, real *dW1, real *dW3, real *dW2) {
    int *h = offsets_h_(be, E, off);
    experts_bwd_(be, E, D, I, off, h, Xp, W1, W3, W2, u1, u3, dYp, dXp, dW1, dW3, dW2);
    free(h);
}
// Dense SwiGLU = one expert over all rows (as moe_swiglu_fwd/bwd of the reference).
static void moe_swiglu_fwd_(BE *be, int N, int D, int I, const real *x, const real *W1, const real *W3,
                            const real *W2, real *u1, real *u3, real *y) {
    if (N <= 0) return;
    int h[2] = {0, N};
    experts_fwd_(be, 1, D, I, NULL, N, h, x, W1, W3, W2, u1, u3, y);
}
static void moe_swiglu_bwd_(BE *be, int N, int D, int I, const real *x, const real *W1, const real *W3,
                            const real *W2, const real *u1, const real *u3, const real *dy, real *dx, real *dW1,
                            real *dW3, real *dW2) {
    if (N <= 0) return;
    int h[2] = {0, N};
    experts_bwd_(be, 1, D, I, NULL, h, x, W1, W3, W2, u1, u3, dy, dx, dW1, dW3, dW2);
}
static void moe_load_count_(BE *be, int N, int E, int K, const int *sel, int *load) {
    int *d = (int *)scratch_(be, sizeof(int) * (size_t)E);
    OK(mtrl_moe_load_count(CTX(be), N, E, K, sel, d));
    mtrl_mc_download(CTX(be), load, d, sizeof(int) * (size_t)E);
}
static int qb_beta_(BE *be, int N, int E, int K, const real *z, const real *bo, real *bn) {
    float *d = (float *)scratch_(be, sizeof(float) * (size_t)E);
    int r = mtrl_qb_beta_from_batch(CTX(be), N, E, K, z, bo, d);
    MTRL_CHECKF(r >= 0, "mtrl_qb_beta_from_batch refused N=%d E=%d K=%d", N, E, K);
    mtrl_mc_download(CTX(be), bn, d, sizeof(float) * (size_t)E);
    return r;
}

static int moe_stats_(BE *be, int N, int E, int K, const int *sel, const real *z, const real *bo, int level,
                      int *load, real *bn) {
    OK(mtrl_moe_load_count(CTX(be), N, E, K, sel, load));
    if (level < 2) return 1;
    int r = mtrl_qb_beta_from_batch(CTX(be), N, E, K, z, bo, bn);
    MTRL_CHECKF(r >= 0, "mtrl_qb_beta_from_batch refused N=%d E=%d K=%d", N, E, K);
    return r;
}

// ---- recorded steps ------------------------------------------------------------------------------------------
//
// A recording points into the backend's scratch and the bf16 weight copy as they were: stale once
// either is reallocated (the context checks its own scratch).

typedef struct be_graph {
    mtrl_cuda_graph *g;
    const char *scratch;
    const mtrl_bf16 *w16;
} be_graph;

static int graph_begin_(BE *be) {
    if (!mtrl_cuda_ctx_opts(CTX(be))->decode_graph) return -1;
    return mtrl_cuda_graph_begin(CTX(be));
}
static void *graph_end_(BE *be) {
    cuda_impl *x = be->impl;
    mtrl_cuda_graph *g = mtrl_cuda_graph_end(x->ctx);
    if (!g) return NULL;
    be_graph *bg = xmalloc(sizeof *bg);
    *bg = (be_graph){g, x->scratch, x->w16};
    return bg;
}
static int graph_launch_(BE *be, void *graph) {
    cuda_impl *x = be->impl;
    be_graph *bg = graph;
    if (!bg || bg->scratch != x->scratch || bg->w16 != x->w16) return -1;
    return mtrl_cuda_graph_launch(x->ctx, bg->g);
}
static void graph_free_(BE *be, void *graph) {
    (void)be;
    be_graph *bg = graph;
    if (!bg) return;
    mtrl_cuda_graph_free(bg->g);
    free(bg);
}

// ---- AttnRes -------------------------------------------------------------------------------------------------

static void attnres_site_fwd_(BE *be, int N, int D, int S, const real *const *V, const real *w, const real *g,
                              real eps, real *h, real *alpha) {
    fp32_weight_(be, w);
    fp32_weight_(be, g);
    OK(mtrl_attnres_site_fwd(CTX(be), N, D, S, V, w, g, eps, h, alpha));
}
static void attnres_site_bwd_(BE *be, int N, int D, int S, const real *const *V, const real *w, const real *g,
                              real eps, const real *alpha, const real *dh, real *const *dV, real *dw, real *dg) {
    OK(mtrl_attnres_site_bwd(CTX(be), N, D, S, V, w, g, eps, alpha, dh, dV, dw, dg));
}

#define BACKEND_ENTRY_(name) .name = name##_,
static const mtrl_backend cuda_template_ = {
    .device = MTRL_DEVICE_CUDA,
    MTRL_BACKEND_OPS(BACKEND_ENTRY_)
};

int mtrl_backend_cuda_devices(void) { return mtrl_cuda_device_count(); }

mtrl_backend *mtrl_backend_cuda_create(int gpu, const mtrl_kernel_opts *o, int want_tf32, char *err_msg,
                                       size_t err_len) {
    int n = mtrl_cuda_device_count();
    if (gpu < 0 || gpu >= n) {
        snprintf(err_msg, err_len, "GPU %d requested, %d CUDA device%s usable", gpu, n, n == 1 ? "" : "s");
        return NULL;
    }
    mtrl_backend *be = xmalloc(sizeof *be);
    *be = cuda_template_;
    be->gpu = gpu;
    be->latent_size = mtrl_backend_latent_size(MTRL_DEVICE_CUDA, o);
    cuda_impl *x = xcalloc(1, sizeof *x);
    x->ctx = mtrl_cuda_ctx_create(gpu, NULL);
    if (o) *mtrl_cuda_ctx_opts(x->ctx) = *o;
    be->gemm_bf16 = mtrl_backend_gemm_bf16(MTRL_DEVICE_CUDA, o);
    be->gemm_tf32 = mtrl_backend_gemm_tf32(MTRL_DEVICE_CUDA, o, want_tf32);
    mtrl_cuda_ctx_set_tf32(x->ctx, be->gemm_tf32);
    be->impl = x;
    x->sq_part = alloc_(be, sizeof(double) * MTRL_MC_SQ_BLOCKS);
    return be;
}

void *mtrl_backend_cuda_weights_bf16(mtrl_backend *be, size_t bytes) {
    cuda_impl *x = be->impl;
    MTRL_CHECKF(be->device == MTRL_DEVICE_CUDA && be->gemm_bf16, "bf16-resident weights need [kernels] gemm = bf16");
    MTRL_CHECKF(!x->w16, "the backend already holds a bf16 weight block");
    x->w16 = alloc_(be, bytes);
    x->w16_bytes = bytes;
    x->resident = 1;
    return x->w16;
}

// The model's stream, for the device weight channel (model_wshm_cuda.h).
mtrl_cuda_ctx *mtrl_backend_cuda_ctx(mtrl_backend *be) { return CTX(be); }

void mtrl_backend_cuda_destroy_(mtrl_backend *be) {
    cuda_impl *x = be->impl;
    mtrl_cuda_sync(x->ctx);
    mtrl_mc_free(x->ctx, x->scratch);
    mtrl_mc_free(x->ctx, x->sq_part);
    mtrl_mc_free(x->ctx, x->w16);
    mtrl_cuda_ctx_destroy(x->ctx);
    free(x->live);
    free(x);
    free(be);
}

#else

int mtrl_backend_cuda_devices(void) { return 0; }

mtrl_backend *mtrl_backend_cuda_create(int gpu, const mtrl_kernel_opts *o, int want_tf32, char *err_msg,
                                       size_t err_len) {
    (void)gpu;
    (void)o;
    (void)want_tf32;
    snprintf(err_msg, err_len, "%s",
             REAL_IS_F64 ? "the fp64 build has no CUDA backend"
                         : "this build has no CUDA support (configure with -DMTRL_CUDA=ON on a machine with nvcc)");
    return NULL;
}

void *mtrl_backend_cuda_weights_bf16(mtrl_backend *be, size_t bytes) {
    (void)be;
    (void)bytes;
    MTRL_CHECKF(0, "bf16-resident weights need the CUDA build");
    return NULL;
}

#endif

// One answer in every build, so that a plan for a GPU (`mtrl plan --device cuda`) made where
// there is none says what a CUDA build will allocate.
size_t mtrl_backend_latent_size(int device, const mtrl_kernel_opts *o) {
    if (device != MTRL_DEVICE_CUDA) return sizeof(real);
    return o && o->latent_fp32 ? sizeof(float) : 2;
}

int mtrl_backend_gemm_bf16(int device, const mtrl_kernel_opts *o) {
    return device == MTRL_DEVICE_CUDA && o && o->gemm == MTRL_KGEMM_BF16;
}

int mtrl_backend_gemm_tf32(int device, const mtrl_kernel_opts *o, int want) {
    if (device != MTRL_DEVICE_CUDA || mtrl_backend_gemm_bf16(device, o)) return 0;
    if (o && o->gemm == MTRL_KGEMM_TF32) return 1;
    if (o && o->gemm == MTRL_KGEMM_FP32) return 0;
    return want != 0;
}
