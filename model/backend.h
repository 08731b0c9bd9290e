// backend.h: the operations the backbone runs, behind one table of function pointers, so the
// ONE model implementation (model_fwd.c, model_bwd.c, model_run.c, model_params.c) runs on the
// CPU reference or on the GPU. Not part of the public API (model.h selects the device).
//
//   CPU  (backend_cpu.c): every entry calls the kernels/ref function of the same name, or is
//        the loop the model used to run inline, so results are bit-identical to the reference.
//   CUDA (backend_cuda.c, fp32 build with MTRL_HAVE_CUDA only): the launchers of
//        kernels/cuda/kernels_cuda.h on device pointers, plus the small kernels of
//        core/model_ops.cu (elementwise ops, embedding, pointer-array gathers, norms).
//
// Conventions (every entry):
//   * Pointers are the backend's memory (device memory for CUDA), except arguments whose name
//     ends in _h: host memory. Arrays of pointers (`*_h` of pointers) are host arrays holding
//     backend pointers.
//   * Shapes, layouts and the overwrite / "+=" rules are those of the kernels/ref function with
//     the same name (its header documents them). Batched decode entries (shortconv_step,
//     kda_step, mla_decode) take one state pointer per row instead of one contiguous block.
//   * Everything is ordered on one stream: an entry may return before the device finished,
//     except download, grad_sq_norm, moe_load_count, qb_beta and mem_info, which return host
//     results.
//   * The decode step's entries (shortconv_step, kda_step, latent_put_rows, mla_decode,
//     embedding_rows, moe_stats) take their per-row pointers, ids and lengths as BACKEND arrays
//     (written before the step, model_decode.c) and return nothing to the host, so that a step
//     needs no host round trip and can be recorded once and replayed (graph_*, below).
//   * Arguments the CUDA kernels do not support abort with a message (check.h); the model
//     checks its dimensions against the kernels' limits when it is created on a GPU.
#ifndef MTRL_MODEL_BACKEND_H
#define MTRL_MODEL_BACKEND_H

#include <stddef.h>

#include "kernels/kernel_opts.h"
#include "kernels/ref/real.h"

// Every operation of a backend, for building the tables (one entry per line of mtrl_backend).
#define MTRL_BACKEND_OPS(X) \
    X(alloc) X(release) X(zero) X(copy) X(upload) X(download) \
    X(sync) X(copy_rows) X(gather) X(scatter) X(sigmoid) X(sigmoid_mul) \
    X(sigmoid_mul_bwd) X(dsigmoid) X(add) X(scale) X(gemm) X(rmsnorm_fwd) \
    X(rmsnorm_bwd) X(l2norm_fwd) X(l2norm_bwd) X(gated_rmsnorm_fwd) X(gated_rmsnorm_bwd) X(shortconv_fwd) \
    X(shortconv_fwd_varlen) X(shortconv_bwd) X(shortconv_bwd_varlen) X(shortconv_state_bwd) X(shortconv_step) X(embedding_fwd) X(embedding_bwd) X(logprob_fwd) \
    X(logprob_bwd) X(adamw) X(grad_sq_norm) X(kda_gate_fwd) X(kda_gate_bwd) X(kda_chunk_fwd) \
    X(kda_chunk_bwd) X(kda_chunk_fwd_varlen) X(kda_chunk_bwd_varlen) X(kda_step) X(attn_causal_fwd) X(attn_causal_bwd) X(attn_causal_fwd_varlen) X(attn_causal_bwd_varlen) X(mla_absorb_q) X(mla_absorb_q_bwd) \
    X(mla_up_v) X(mla_up_v_bwd) X(mla_expand_kv) X(mla_expand_kv_bwd) X(mla_decode) X(moe_router_fwd) X(moe_router_bwd) X(moe_dispatch) \
    X(moe_gather) X(moe_combine_fwd) X(moe_combine_bwd) X(moe_scatter_bwd) X(moe_experts_fwd) X(moe_experts_bwd) \
    X(moe_swiglu_fwd) X(moe_swiglu_bwd) X(moe_load_count) X(qb_beta) X(attnres_site_fwd) X(attnres_site_bwd) \
    X(mem_info) X(latent_put) X(latent_get) X(latent_download) X(latent_upload) X(weights_changed) \
    X(shortconv_fwd_varlen_io) X(kda_chunk_fwd_varlen_io) X(latent_gather) \
    X(embedding_rows) X(latent_put_rows) X(moe_stats) X(graph_begin) X(graph_end) X(graph_launch) X(graph_free)

typedef struct mtrl_backend mtrl_backend;

struct mtrl_backend {
    int device; // MTRL_DEVICE_CPU or MTRL_DEVICE_CUDA (model.h)
    int gpu;    // CUDA device index
    void *impl; // the CUDA backend's private state (context, scratch)
    // Bytes of one element of an MLA latent cache (mtrl_backend_latent_size): every latent
    // pointer below (`const void *` in the attention and decode entries, decode states, the
    // batch workspace) points to elements of this size, and every byte count of latents uses it.
    size_t latent_size;
    // 1 when the dense GEMMs take bf16 operands (mtrl_backend_gemm_bf16 at the backend's
    // creation): the memory planner of a live model counts the bf16 weight copies with it.
    int gemm_bf16;
    // 1 when its fp32 GEMMs run on TF32 tensor cores (mtrl_backend_gemm_tf32 at the backend's
    // creation, with the model's [model] gemm).
    int gemm_tf32;

    // ---- memory --------------------------------------------------------------------------------
    void *(*alloc)(mtrl_backend *, size_t bytes); // uninitialised, at least 64-byte aligned; 0 bytes: a valid pointer
    void (*release)(mtrl_backend *, void *p);     // NULL is fine
    void (*zero)(mtrl_backend *, void *p, size_t bytes);
    void (*copy)(mtrl_backend *, void *dst, const void *src, size_t bytes);
    void (*upload)(mtrl_backend *, void *dst, const void *src_h, size_t bytes);
    void (*download)(mtrl_backend *, void *dst_h, const void *src, size_t bytes);
    void (*sync)(mtrl_backend *);
    // The model's fp32 master weights, the one parameter block [params, params + n), were
    // created, uploaded, loaded or stepped. A backend whose GEMMs take bf16 operands
    // (gemm_bf16) rounds its bf16 copy of the block here (allocated on the first call, freed
    // with the backend) and from then on reads a weight operand of gemm and of the MoE / SwiGLU
    // entries (a pointer inside the block) from that copy: the copy is as fresh as the last
    // call, so every writer of the block calls it. No-op otherwise (the CPU, fp32 and TF32).
    void (*weights_changed)(mtrl_backend *, const real *params, size_t n);
    // The memory the backend allocates from: free and total bytes (CPU: MemAvailable and
    // MemTotal of /proc/meminfo, 0 when unreadable; CUDA: cudaMemGetInfo of its GPU); the
    // scratch the backend and its kernels hold now (grow-only buffers, CUDA; 0 on the CPU); the
    // high-water mark of all it has held since it was created: allocations plus scratch (CUDA;
    // 0 on the CPU, which does not count). Every pointer nullable; host results.
    void (*mem_info)(mtrl_backend *, size_t *free_h, size_t *total_h, size_t *scratch_h, size_t *peak_h);
    // dst[r*ldd + j] = src[r*lds + j] for r < rows, j < n.
    void (*copy_rows)(mtrl_backend *, int rows, int n, const real *src, int lds, real *dst, int ldd);
    // dst[b*n ..] = src_h[b][0..n)  /  dst_h[b][0..n) = src[b*n ..], b < B.
    void (*gather)(mtrl_backend *, int B, size_t n, const real *const *src_h, real *dst);
    void (*scatter)(mtrl_backend *, int B, size_t n, const real *src, real *const *dst_h);

    // ---- elementwise (the loops the model runs between kernels) --------------------------------
    void (*sigmoid)(mtrl_backend *, size_t n, const real *x, real *y);                    // y = σ(x)
    void (*sigmoid_mul)(mtrl_backend *, size_t n, const real *x, const real *a, real *y); // y = σ(x) a
    // da = dy σ(x), dx = dy a σ(x)(1 − σ(x)).
    void (*sigmoid_mul_bwd)(mtrl_backend *, size_t n, const real *x, const real *a, const real *dy, real *da,
                            real *dx);
    void (*dsigmoid)(mtrl_backend *, size_t n, const real *s, real *dy); // dy *= s (1 − s), s = σ(·)
    // y = a + b (a NULL: y = 0 + b). y may alias a or b.
    void (*add)(mtrl_backend *, size_t n, const real *a, const real *b, real *y);
    void (*scale)(mtrl_backend *, size_t n, real *x, real s); // x *= s

    // ---- dense ---------------------------------------------------------------------------------
    void (*gemm)(mtrl_backend *, int trans_a, int trans_b, int M, int N, int K, real alpha, const real *A, int lda,
                 const real *B, int ldb, real beta, real *C, int ldc);

    // ---- per-token ops (ops_ref.h) -----------------------------------------------------------------
    void (*rmsnorm_fwd)(mtrl_backend *, int N, int D, const real *x, const real *w, real eps, real *y, real *rstd);
    void (*rmsnorm_bwd)(mtrl_backend *, int N, int D, const real *x, const real *w, const real *rstd, real eps,
                        const real *dy, real *dx, real *dw);
    void (*l2norm_fwd)(mtrl_backend *, int N, int D, const real *x, real eps, real *y);
    void (*l2norm_bwd)(mtrl_backend *, int N, int D, const real *x, real eps, const real *dy, real *dx);
    void (*gated_rmsnorm_fwd)(mtrl_backend *, int N, int D, const real *x, const real *z, const real *w, real eps,
                              real *y);
    void (*gated_rmsnorm_bwd)(mtrl_backend *, int N, int D, const real *x, const real *z, const real *w, real eps,
                              const real *dy, real *dx, real *dz, real *dw);
    void (*shortconv_fwd)(mtrl_backend *, int T, int C, int W, const real *x, const real *w, const real *state_in,
                          real *y, real *state_out);
    void (*shortconv_bwd)(mtrl_backend *, int T, int C, int W, const real *x, const real *w, const real *state_in,
                          const real *dy, real *dx, real *dw, real *dstate_in);
    void (*shortconv_state_bwd)(mtrl_backend *, int T, int C, int W, const real *dstate_out, real *dx,
                                real *dstate_in);
    // n packed pieces each from the zero window, no window out (ops_ref.h
    // mtrl_ref_shortconv_fwd_varlen); offs_h [n + 1] on the host. The CUDA form is one launch.
    void (*shortconv_fwd_varlen)(mtrl_backend *, int n, const int *offs_h, int C, int W, const real *x,
                                 const real *w, real *y);
    // Its backward (mtrl_ref_shortconv_bwd_varlen): dx overwritten, dw +=. The CUDA form is four
    // launches; its dw is summed in blocks of the pack's rows, not per piece (fp32 rounding apart).
    void (*shortconv_bwd_varlen)(mtrl_backend *, int n, const int *offs_h, int C, int W, const real *x,
                                 const real *w, const real *dy, real *dx, real *dw);
    // B decode rows: x1, y1 [B][C]; row r's window [W−1][C] at window[r] (updated); window: a
    // backend array of B backend pointers.
    void (*shortconv_step)(mtrl_backend *, int B, int C, int W, const real *x1, const real *w,
                           real *const *window, real *y1);
    void (*embedding_fwd)(mtrl_backend *, int N, int D, const int *ids_h, const real *E, real *x);
    // The same with the ids in backend memory (the decode step's).
    void (*embedding_rows)(mtrl_backend *, int N, int D, const int *ids, const real *E, real *x);
    void (*embedding_bwd)(mtrl_backend *, int N, int D, const int *ids_h, const real *dx, real *dE);
    // logp_h, entropy_h (nullable) [N] on the host.
    void (*logprob_fwd)(mtrl_backend *, int N, int V, const real *logits, const int *targets_h, real *logp_h,
                        real *entropy_h);
    void (*logprob_bwd)(mtrl_backend *, int N, int V, const real *logits, const int *targets_h, const real *dlogp_h,
                        const real *dentropy_h, real *dlogits);
    void (*adamw)(mtrl_backend *, size_t n, real *param, const real *grad, real *m, real *v, real lr, real beta1,
                  real beta2, real eps, real weight_decay, long step);
    double (*grad_sq_norm)(mtrl_backend *, size_t n, const real *grad);

    // ---- KDA (kda_ref.h) ---------------------------------------------------------------------------
    // kind: MTRL_KDA_GATE_* (model.h). The Kimi gate is exact on the CPU (kda_gate_kimi_fwd with no
    // floor); the CUDA backend clamps it at g_min, the range of its chunked kernels.
    void (*kda_gate_fwd)(mtrl_backend *, int kind, int T, int H, int K, const real *f, const real *A_log,
                         const real *dt_bias, real g_min, real *g);
    void (*kda_gate_bwd)(mtrl_backend *, int kind, int T, int H, int K, const real *f, const real *A_log,
                         const real *dt_bias, real g_min, const real *dg, real *df, real *dA_log, real *ddt_bias);
    void (*kda_chunk_fwd)(mtrl_backend *, int T, int H, int K, int V, const real *q, const real *k, const real *v,
                          const real *g, const real *beta, const real *S0, real *o, real *S_final, real *S_tiles);
    void (*kda_chunk_bwd)(mtrl_backend *, int T, int H, int K, int V, const real *q, const real *k, const real *v,
                          const real *g, const real *beta, const real *S0, const real *S_tiles, const real *dout,
                          const real *dS_final, real *dq, real *dk, real *dv, real *dg, real *dbeta, real *dS0);
    // n packed pieces each from the zero state (a packed segment without piece_io, model_ws.h):
    // offs_h [n + 1] on the host (piece i: rows offs_h[i] .. offs_h[i+1] - 1), S_final [n][H][K][V]
    // and S_tiles (every piece's tiles, piece by piece) nullable; the backward takes no final-state
    // gradient and gives no dS0 (kda_ref.h mtrl_ref_kda_chunk_fwd_varlen / _bwd_varlen). The CUDA
    // forward and backward are one launch per kernel stage for all pieces.
    void (*kda_chunk_fwd_varlen)(mtrl_backend *, int n, const int *offs_h, int H, int K, int V, const real *q,
                                 const real *k, const real *v, const real *g, const real *beta, real *o,
                                 real *S_final, real *S_tiles);
    void (*kda_chunk_bwd_varlen)(mtrl_backend *, int n, const int *offs_h, int H, int K, int V, const real *q,
                                 const real *k, const real *v, const real *g, const real *beta,
                                 const real *S_tiles, const real *dout, real *dq, real *dk, real *dv, real *dg,
                                 real *dbeta);
    // The piece_io forms of the two varlen forwards (a SEG_PREFILL pack whose pieces continue
    // their own states, model_ws.h): piece i reads its conv window win_in_h[i] / its state S0_h[i]
    // and leaves the new one at win_out_h[i] / Sf_h[i] (host arrays [n] of backend pointers, NULL
    // for none, entries nullable; an out may be its in: updated in place). ops_ref.h
    // mtrl_ref_shortconv_fwd_varlen_io, kda_ref.h mtrl_ref_kda_chunk_fwd_varlen_io; on CUDA a
    // fixed number of launches for all pieces (two each), bit for bit the per-piece calls of
    // shortconv_fwd / mtrl_kda_chunk_fwd.
    void (*shortconv_fwd_varlen_io)(mtrl_backend *, int n, const int *offs_h, int C, int W, const real *x,
                                    const real *w, const real *const *win_in_h, real *const *win_out_h, real *y);
    void (*kda_chunk_fwd_varlen_io)(mtrl_backend *, int n, const int *offs_h, int H, int K, int V, const real *q,
                                    const real *k, const real *v, const real *g, const real *beta,
                                    const real *const *S0_h, real *o, real *const *Sf_h, real *S_tiles);
    // B decode rows (q, k, g [B][H][K], v, o [B][H][V], beta [B][H]); row r's state at S[r] (a
    // backend array), S_h the same B pointers on the host (for checks only: where the kernels
    // may run in place).
    void (*kda_step)(mtrl_backend *, int B, int H, int K, int V, const real *q, const real *k, const real *v,
                     const real *g, const real *beta, real *const *S_h, real *const *S, real *o);

    // ---- MLA latent caches (elements of latent_size) -----------------------------------------------
    // The one way latent rows are written: dst_h[b][r*ldd + j] = src[(b*rows + r)*lds + j]
    // rounded to the latent type, b < B, r < rows, j < n. The chunked form writes its T rows
    // (B = 1, rows = T), the decode one row for each of B sequences (rows = 1). dst_h: a host
    // array of B backend pointers to latent elements.
    void (*latent_put)(mtrl_backend *, int B, int rows, int n, const real *src, int lds, void *const *dst_h,
                       int ldd);
    // The decode form (rows = 1): dst a BACKEND array of B backend pointers.
    void (*latent_put_rows)(mtrl_backend *, int B, int n, const real *src, int lds, void *const *dst, int ldd);
    // The reverse of one block of latent_put: dst[r*ldd + j] = src[r*lds + j] (latent elements
    // widened exactly to `real`), r < rows, j < n.
    void (*latent_get)(mtrl_backend *, int rows, int n, const void *src, int lds, real *dst, int ldd);
    // latent_get of rows from anywhere (several caches at once): dst[r*ldd + j] = src_h[r][j]
    // widened, r < rows, j < n; src_h a host array of `rows` backend pointers to latent elements.
    void (*latent_gather)(mtrl_backend *, int rows, int n, const void *const *src_h, real *dst, int ldd);
    // n latent elements to host `real`s (widened exactly) / from host `real`s (rounded), for
    // snapshots: host arrays stay `real` whatever the backend stores.
    void (*latent_download)(mtrl_backend *, size_t n, const void *src, real *dst_h);
    void (*latent_upload)(mtrl_backend *, size_t n, const real *src_h, void *dst);

    // ---- attention / MLA (mla_ref.h) ---------------------------------------------------------------
    // k and v are latent caches (latent_size elements; the model runs this attention over
    // latents only); every other array is `real`, the gradients dk, dv included.
    void (*attn_causal_fwd)(mtrl_backend *, int Tq, int Tk, int H, int Hk, int Dk, int Dv, real scale, const real *q,
                            const void *k, int ldk, const void *v, int ldv, real *o, real *lse);
    void (*attn_causal_bwd)(mtrl_backend *, int Tq, int Tk, int H, int Hk, int Dk, int Dv, real scale, const real *q,
                            const void *k, int ldk, const void *v, int ldv, const real *o, const real *lse,
                            const real *dout, real *dq, real *dk, real *dv);
    // n packed pieces in one call, each attending causally to its own keys only (mla_ref.h
    // mtrl_ref_attn_causal_fwd_varlen / _bwd_varlen): piece i's queries at rows qoffs_h[i] ..
    // qoffs_h[i+1]-1 of q, o, lse, dout, dq; its keys at rows koffs_h[i] .. koffs_h[i+1]-1 of k,
    // v, dk, dv (koffs_h NULL: its query rows, the learner's packs from the zero state; else the
    // prefill form, a piece's earlier keys before its new ones). Host arrays [n + 1]. The same
    // results as attn_causal_fwd / _bwd once per piece; on CUDA bit for bit those calls' (one
    // launch per kernel for all pieces; the fp32-operand check kernels run per piece).
    void (*attn_causal_fwd_varlen)(mtrl_backend *, int n, const int *qoffs_h, const int *koffs_h, int H, int Hk,
                                   int Dk, int Dv, real scale, const real *q, const void *k, int ldk, const void *v,
                                   int ldv, real *o, real *lse);
    void (*attn_causal_bwd_varlen)(mtrl_backend *, int n, const int *qoffs_h, const int *koffs_h, int H, int Hk,
                                   int Dk, int Dv, real scale, const real *q, const void *k, int ldk, const void *v,
                                   int ldv, const real *o, const real *lse, const real *dout, real *dq, real *dk,
                                   real *dv);
    void (*mla_absorb_q)(mtrl_backend *, int N, int H, int dn, int dr, int dv, int dc, const real *q,
                         const real *W_kvb, real *qt);
    void (*mla_absorb_q_bwd)(mtrl_backend *, int N, int H, int dn, int dr, int dv, int dc, const real *q,
                             const real *W_kvb, const real *dqt, real *dq, real *dW_kvb);
    void (*mla_up_v)(mtrl_backend *, int N, int H, int dn, int dv, int dc, const real *cstar, const real *W_kvb,
                     real *a);
    void (*mla_up_v_bwd)(mtrl_backend *, int N, int H, int dn, int dv, int dc, const real *cstar, const real *W_kvb,
                         const real *da, real *dcstar, real *dW_kvb);
    // The naive form's keys and values from N latent rows (c, kr: `real`, row strides ldc, ldr)
    // and the gradients back (dlat_c, dlat_kr, dW_kvb +=).
    void (*mla_expand_kv)(mtrl_backend *, int N, int H, int dn, int dr, int dv, int dc, const real *c, int ldc,
                          const real *kr, int ldr, const real *W_kvb, real *k, real *v);
    void (*mla_expand_kv_bwd)(mtrl_backend *, int N, int H, int dn, int dr, int dv, int dc, const real *c, int ldc,
                              const real *W_kvb, const real *dk, const real *dvals, real *dlat_c, int ld_c,
                              real *dlat_kr, int ld_kr, real *dW_kvb);
    // B decode rows: q [B][H][dn+dr], a [B][H][dv]; row r reads the interleaved latent cache
    // lat[r] ([Tk[r]][ld] rows [ĉ ; k^r] of latent elements, its own token's row included); lat
    // and Tk backend arrays, lat_h and Tk_h the same on the host (for the launch's shape only:
    // the CUDA kernels split every row's keys by B and the power of 2 at or above the longest
    // Tk, mtrl_backend_decode_len, so that steps of one B and that length run the same launches).
    void (*mla_decode)(mtrl_backend *, int B, int H, int dn, int dr, int dv, int dc, real scale, const real *q,
                       const real *W_kvb, const void *const *lat_h, const void *const *lat, int ld,
                       const int *Tk_h, const int *Tk, real *a);

    // ---- MoE (moe_ref.h) ---------------------------------------------------------------------------
    // form: moe_ref.h's MOE_ROUTER_* bits (model_router_form)
    void (*moe_router_fwd)(mtrl_backend *, int N, int E, int K, const real *z, const real *beta, int form,
                           real rho, int replay, int *sel, real *w, real *s);
    void (*moe_router_bwd)(mtrl_backend *, int N, int E, int K, const real *s, const int *sel, const real *w,
                           int form, real rho, const real *dw, real *dz);
    void (*moe_dispatch)(mtrl_backend *, int N, int E, int K, const int *sel, int *offsets, int *perm_token, int *pos);
    void (*moe_gather)(mtrl_backend *, int N, int K, int D, const int *pos, const real *x, real *X_perm);
    void (*moe_combine_fwd)(mtrl_backend *, int N, int K, int D, const int *pos, const real *w, const real *Y_perm,
                            real *y);
    void (*moe_combine_bwd)(mtrl_backend *, int N, int K, int D, const int *pos, const real *w, const real *Y_perm,
                            const real *dy, real *dY_perm, real *dw);
    void (*moe_scatter_bwd)(mtrl_backend *, int N, int K, int D, const int *pos, const real *dX_perm, real *dx);
    // R = offsets[E], the rows (N K), given so that no backend needs to read offsets back.
    void (*moe_experts_fwd)(mtrl_backend *, int E, int D, int I, int R, const int *offsets, const real *X_perm,
                            const real *W1, const real *W3, const real *W2, real *u1, real *u3, real *Y_perm);
    void (*moe_experts_bwd)(mtrl_backend *, int E, int D, int I, const int *offsets, const real *X_perm,
                            const real *W1, const real *W3, const real *W2, const real *u1, const real *u3,
                            const real *dY_perm, real *dX_perm, real *dW1, real *dW3, real *dW2);
    void (*moe_swiglu_fwd)(mtrl_backend *, int N, int D, int I, const real *x, const real *W1, const real *W3,
                           const real *W2, real *u1, real *u3, real *y);
    void (*moe_swiglu_bwd)(mtrl_backend *, int N, int D, int I, const real *x, const real *W1, const real *W3,
                           const real *W2, const real *u1, const real *u3, const real *dy, real *dx, real *dW1,
                           real *dW3, real *dW2);
    void (*moe_load_count)(mtrl_backend *, int N, int E, int K, const int *sel, int *load_h);
    // qb_beta_from_batch with the new β returned on the host.
    int (*qb_beta)(mtrl_backend *, int N, int E, int K, const real *z, const real *beta_old, real *beta_new_h);
    // The routing statistics of one batch into backend memory, nothing to the host: load [E] =
    // moe_load_count; with level >= 2 also beta_new [E] = qb_beta's β from the scores z (else
    // beta_new is untouched). Returns qb_beta's status (0 computed, 1 skipped), which the shapes
    // decide; 1 for level < 2.
    int (*moe_stats)(mtrl_backend *, int N, int E, int K, const int *sel, const real *z, const real *beta_old,
                     int level, int *load, real *beta_new);

    // ---- Block AttnRes (attnres_ref.h); V_h / dV_h: host arrays of S backend pointers ---------------
    void (*attnres_site_fwd)(mtrl_backend *, int N, int D, int S, const real *const *V_h, const real *w,
                             const real *gamma, real eps, real *h, real *alpha);
    void (*attnres_site_bwd)(mtrl_backend *, int N, int D, int S, const real *const *V_h, const real *w,
                             const real *gamma, real eps, const real *alpha, const real *dh, real *const *dV_h,
                             real *dw, real *dgamma);

    // ---- recorded steps (CUDA graphs; the decode step, model_decode.c) --------------------------
    // graph_begin: the entries called until graph_end are recorded instead of run; 0, or -1 when
    // this backend does not record (the CPU; CUDA with [kernels] decode_graph = off). graph_end:
    // a replayable recording, or NULL when it failed (an entry between needed the host: a
    // download, a sync, memory that had to grow); nothing recorded ran either way. graph_launch
    // runs a recording again: the same kernels with the same arguments on the same memory, so
    // whatever varies between replays must be in backend memory the kernels read (the parameter
    // block is read in place: a new weight version is seen). 0, or -1 (nothing ran) when the
    // recording is stale (scratch it points into was reallocated since): record again.
    int (*graph_begin)(mtrl_backend *);
    void *(*graph_end)(mtrl_backend *);
    int (*graph_launch)(mtrl_backend *, void *graph);
    void (*graph_free)(mtrl_backend *, void *graph); // NULL is fine
};

// The key length whose launches an mla_decode over rows of at most max_len keys shares: the
// power of 2 at or above max_len (backend.h mla_decode).
static inline int mtrl_backend_decode_len(int max_len) {
    int n = 1;
    while (n < max_len) n *= 2;
    return n;
}

// The CPU backend (one shared, stateless instance).
mtrl_backend *mtrl_backend_cpu(void);

// The precisions a backend of `device` with kernel options `o` (kernels/kernel_opts.h, NULL:
// the defaults) takes; the memory planner asks them before any backend exists.
//
// The latent element size it stores (its latent_size): sizeof(real) on the CPU (the reference
// keeps its precision: fp64 in the tests); on CUDA 2, bf16 (a long episode's latents stay
// resident at half the bytes, and the attention and the absorbed decode read them as their bf16
// operands with no conversion pass), or 4 with o->latent_fp32 (fp32, converted to bf16 per
// attention call, the fp32 decode kernel: the fallback the GPU tests compare against).
size_t mtrl_backend_latent_size(int device, const mtrl_kernel_opts *o);
// 1 when its fp32 GEMMs run on TF32 tensor cores (10-bit mantissa inputs, fp32 accumulation,
// ~1e-3 relative): CUDA, where o->gemm says tf32, or where it follows the model (MTRL_KGEMM_MODEL)
// and the model wants it (`want`: [model] gemm = tf32); never with bf16 operands. 0 otherwise.
// The GPU tests' models ask for fp32 (tests/testmodel.h): they hold the GPU model to ~1e-5 of
// the CPU; test_cuda_model compares TF32 with it.
int mtrl_backend_gemm_tf32(int device, const mtrl_kernel_opts *o, int want);
// 1 when it multiplies the model's dense projections, the MoE experts and the dense SwiGLU FFNs
// with bf16 operands on tensor cores (fp32 accumulation, fp32 outputs and gradients; 8-bit
// mantissa inputs, ~4e-3 relative per operand): CUDA with o->gemm = MTRL_KGEMM_BF16. The fp32
// master weights, gradients and AdamW moments stay as they are; the backend keeps one bf16 copy
// of the parameter block (2 bytes a parameter, refreshed at weights_changed) and rounds the
// activation / dy operands into its scratch per GEMM. The MLA absorption products (mla_absorb_q,
// mla_up_v, a batched GEMM per head) stay fp32, and true fp32 (mtrl_backend_gemm_tf32 is 0):
// one setting names a run's GEMM precision. 0 otherwise.
int mtrl_backend_gemm_bf16(int device, const mtrl_kernel_opts *o);
// Element i of a latent array (pointer arithmetic in latent elements).
static inline void *mtrl_latent_at(const mtrl_backend *be, const void *base, size_t i) {
    return (char *)base + be->latent_size * i;
}

// A CUDA backend on GPU `gpu` whose context takes the kernel options `o` (NULL: the defaults),
// or NULL with a message in err_msg (built without CUDA, the fp64 build, or no such device).
// want_tf32: the model's [model] gemm (mtrl_backend_gemm_tf32). mtrl_backend_destroy frees it
// (the CPU instance is left alone).
mtrl_backend *mtrl_backend_cuda_create(int gpu, const mtrl_kernel_opts *o, int want_tf32, char *err_msg,
                                       size_t err_len);
void mtrl_backend_destroy(mtrl_backend *be);
// The bf16-resident weights of a CUDA backend with gemm_bf16 (model/model_wsplit.h): allocates
// its bf16 block of `bytes` (freed with the backend) and returns it. From then on a pointer into
// that block is a bf16 operand as it is (gemm and the MoE / SwiGLU entries), any non-GEMM entry
// that reads a weight aborts on one, and weights_changed aborts (there is no fp32 block to round:
// the model writes the bf16 block itself). Once per backend; aborts on the CPU / without CUDA.
void *mtrl_backend_cuda_weights_bf16(mtrl_backend *be, size_t bytes);
// Number of CUDA devices this build can use (0 without CUDA support or without a device).
int mtrl_backend_cuda_devices(void);

#endif
