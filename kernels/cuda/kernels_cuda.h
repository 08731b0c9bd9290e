// kernels_cuda.h: the C entry points of the CUDA kernels (plain C11, includable without the
// CUDA headers). Every function mirrors one function of the CPU reference in kernels/ref/ (the
// contract: same shapes, same row-major layouts, same "+=" / overwrite rules), operating on
// DEVICE pointers, asynchronously on the context's stream.
//
// Conventions:
//   * All pointers are device pointers unless the name ends in _host. The caller owns them.
//   * Launchers return 0, or -1 for arguments the kernels do not support (a message naming the
//     argument goes to stderr; nothing was launched). A failing CUDA or cuBLAS call is a bug or a
//     lost device: it prints file:line and aborts (CUDA_CHECK / CUBLAS_CHECK in cuda_common.cuh).
//   * Nothing is synchronised unless stated; mtrl_cuda_sync() waits and checks.
//   * A launcher may use the context's scratch buffer (grown on demand; growing it synchronises
//     the device). Scratch never carries data from one call to the next.
//   * Precision: fp32 arithmetic unless a function takes bf16 operands (mtrl_bf16, the bit
//     pattern of __nv_bfloat16); those multiply on tensor cores with fp32 accumulation.
//   * Reductions are done in a fixed order: results are bit-reproducible run to run (no
//     floating-point atomics anywhere).
#ifndef MTRL_KERNELS_CUDA_H
#define MTRL_KERNELS_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/kernel_opts.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct CUstream_st *mtrl_stream;  // the same type as cudaStream_t; NULL = default stream
typedef uint16_t mtrl_bf16;               // storage of one bf16 value
typedef struct mtrl_cuda_ctx mtrl_cuda_ctx;

enum { MTRL_F32 = 0, MTRL_BF16 = 1 };  // element types of GEMM operands and some buffers

// ---- context, buffers, conversions --------------------------------------------------------

// Number of usable CUDA devices; 0 when there is none or the driver cannot be reached (never
// aborts, so a test can call it first and skip).
int mtrl_cuda_device_count(void);
// One context per thread and stream: cuBLAS handle, the stream, a scratch buffer. stream may be
// NULL (the default stream). Selects `device` for the calling thread.
mtrl_cuda_ctx *mtrl_cuda_ctx_create(int device, mtrl_stream stream);
// The context's kernel options (kernels/kernel_opts.h), zero (the defaults) at creation. The
// launchers read them at each call; the owner sets them once (the model's backend copies the
// model's), and tests and benchmarks change them between calls to compare kernels.
mtrl_kernel_opts *mtrl_cuda_ctx_opts(mtrl_cuda_ctx *ctx);
// on = 1: the GEMMs of fp32 operands (mtrl_gemm, mtrl_gemm_batched and what calls them) run on
// tensor cores with TF32 inputs (10-bit mantissa, fp32 accumulation: ~1e-3 relative, about 7x
// the fp32 rate on an H200); 0 (the default): true fp32. bf16 operands are unaffected.
void mtrl_cuda_ctx_set_tf32(mtrl_cuda_ctx *ctx, int on);
void mtrl_cuda_ctx_destroy(mtrl_cuda_ctx *ctx);
mtrl_stream mtrl_cuda_ctx_stream(const mtrl_cuda_ctx *ctx);
// Waits for the context's stream and checks for errors (aborts on one). While recording a
// graph (below) it waits for nothing and fails the recording.
void mtrl_cuda_sync(mtrl_cuda_ctx *ctx);

// ---- CUDA graphs (core/context.cu) ----
// mtrl_cuda_graph_begin records the work the context's launchers queue until mtrl_cuda_graph_end
// into a graph instead of running it (stream capture, thread-local mode, on a stream of the
// context's own; the cuBLAS handle follows it). While recording, anything that needs the host or
// the allocator fails the recording and does nothing: a download or a synchronisation
// (core/model_ops.h), an allocation or free, a context scratch that would have to grow. Returns 0,
// or -1 when the context is already recording.
typedef struct mtrl_cuda_graph mtrl_cuda_graph;
int mtrl_cuda_graph_begin(mtrl_cuda_ctx *ctx);
// Ends the recording: the instantiated graph, or NULL when it failed (nothing of it ran either
// way: the caller runs the work again without recording).
mtrl_cuda_graph *mtrl_cuda_graph_end(mtrl_cuda_ctx *ctx);
// 1 while recording; mtrl_cuda_record_fail marks the recording failed (a caller's host-side need).
int mtrl_cuda_recording(const mtrl_cuda_ctx *ctx);
void mtrl_cuda_record_fail(mtrl_cuda_ctx *ctx);
// Replays g on the context's stream: the recorded kernels with the arguments they were recorded
// with, on the same memory (whatever it holds now). 0, or -1 (nothing launched) when the context's
// scratch was reallocated since the recording: the graph is stale.
int mtrl_cuda_graph_launch(mtrl_cuda_ctx *ctx, mtrl_cuda_graph *g);
void mtrl_cuda_graph_free(mtrl_cuda_graph *g); // NULL is fine

void *mtrl_cuda_malloc(size_t bytes);  // cudaMalloc; aborts on failure; 0 bytes gives NULL
void mtrl_cuda_free(void *p);          // NULL is fine
void mtrl_cuda_upload(void *dst, const void *src_host, size_t bytes);    // synchronous
void mtrl_cuda_download(void *dst_host, const void *src, size_t bytes);  // synchronous
// Elementwise conversions (round to nearest even); n elements.
void mtrl_cuda_f32_to_bf16(mtrl_cuda_ctx *ctx, size_t n, const float *x, mtrl_bf16 *y);
void mtrl_cuda_bf16_to_f32(mtrl_cuda_ctx *ctx, size_t n, const mtrl_bf16 *x, float *y);
// Fills n floats with value (e.g. NaN to poison an output before a test).
void mtrl_cuda_fill_f32(mtrl_cuda_ctx *ctx, size_t n, float value, float *x);

// ---- dense GEMM (cuBLAS) -------------------------------------------------------------------
//
// Row-major, exactly gemm_ref: C[M][N] = alpha op(A)[M][K] op(B)[K][N] + beta C, op(X) = X or
// Xᵀ as stored with row strides lda/ldb/ldc. ab_type: MTRL_F32 (true fp32, no TF32) or
// MTRL_BF16 (tensor cores, fp32 accumulation); A and B share the type. c_type: MTRL_F32 or
// MTRL_BF16 (the result is rounded once). beta = 0 overwrites C.
int mtrl_gemm(mtrl_cuda_ctx *ctx, int trans_a, int trans_b, int M, int N, int K, float alpha,
              const void *A, int lda, const void *B, int ldb, int ab_type, float beta, void *C,
              int ldc, int c_type);
// The same for `batch` independent products at element strides sA, sB, sC.
int mtrl_gemm_batched(mtrl_cuda_ctx *ctx, int trans_a, int trans_b, int M, int N, int K,
                      float alpha, const void *A, int lda, long long sA, const void *B, int ldb,
                      long long sB, int ab_type, float beta, void *C, int ldc, long long sC,
                      int c_type, int batch);
// A linear layer y = x Wᵀ (x [T][k], W [n][k], y [T][n]) and its two backward products:
//     dx [T][k] = dy W   (beta = 1 accumulates),     dW [n][k] = dyᵀ x (beta = 1 accumulates).
// x/W/dy share `type`; y, dx, dW are fp32. For MTRL_BF16 the caller keeps bf16 copies of the
// fp32 master weights (mtrl_cuda_f32_to_bf16 once per step) and of the activations.
int mtrl_linear_fwd(mtrl_cuda_ctx *ctx, int T, int n, int k, const void *x, const void *W,
                    int type, float beta, float *y);
int mtrl_linear_bwd_dx(mtrl_cuda_ctx *ctx, int T, int n, int k, const void *dy, const void *W,
                       int type, float beta, float *dx);
int mtrl_linear_bwd_dw(mtrl_cuda_ctx *ctx, int T, int n, int k, const void *dy, const void *x,
                       int type, float beta, float *dW);

// ---- KDA (kda_ref.h) -----------------------------------------------------------------------
//
// Layouts as kda_ref.h: q, k, g, dq, dk, dg [T][H][K]; v, o, dv, dout [T][H][V]; beta, dbeta
// [T][H]; states [H][K][V] (fp32). One sequence per call. Requirements: K and V multiples of
// 16, at most 128 for the chunked form (the model uses 128) and 256 for the decode step; every
// g in (g_min, 0) with g_min >= MTRL_KDA_TC_G_MIN (§2.5). Arithmetic: fp32 (SIMT), except the chunked
// forward v3 below.
//
// MTRL_KDA_TC_G_MIN: the smallest log-decay the chunked kernels take. A tile's factors are
// e^{±(G_i − G_m)}, up to e^{±8|g|} from its middle row (§2.5); v3 rounds the scaled operands to
// split bf16 (ex2.approx flushes results below 2^-126 = e^-87.3, and the low half of a split
// operand sits 2^-8 under its value), so at g = -11 (e^{±88}) the operands at a tile's ends lose
// their low half or flush to zero, and rows with every decay at the floor lose their own
// contribution. At -8 the factors stay within e^{±64}: both halves of any operand above 1e-10 are
// normal numbers. The [model] g_min range (common/config_schema.h) starts here.
#define MTRL_KDA_TC_G_MIN (-8.0)
int mtrl_kda_gate_fwd(mtrl_cuda_ctx *ctx, int T, int H, int K, const float *f,
                      const float *A_log, const float *dt_bias, float g_min, float *g);
// df overwritten; dA_log [H] and ddt_bias [H*K] ACCUMULATED (+=), as kda_gate_bwd.
int mtrl_kda_gate_bwd(mtrl_cuda_ctx *ctx, int T, int H, int K, const float *f,
                      const float *A_log, const float *dt_bias, float g_min, const float *dg,
                      float *df, float *dA_log, float *ddt_bias);
// Kimi Linear's gate, as kda_gate_kimi_fwd / _bwd, clamped below at g_floor (>= MTRL_KDA_TC_G_MIN for
// the chunked kernels): the unbounded decay is not representable in their factored form, so a GPU
// model approximates every g < g_floor by g_floor (docs/model-forms.md measures the effect).
int mtrl_kda_gate_kimi_fwd(mtrl_cuda_ctx *ctx, int T, int H, int K, const float *f,
                           const float *A_log, const float *dt_bias, float g_floor, float *g);
int mtrl_kda_gate_kimi_bwd(mtrl_cuda_ctx *ctx, int T, int H, int K, const float *f,
                           const float *A_log, const float *dt_bias, float g_floor,
                           const float *dg, float *df, float *dA_log, float *ddt_bias);
// Chunked forward in 16-token tiles (§2.3). S0, o, S_final, S_tiles nullable. S_tiles receives
// the incoming state of every tile, [ceil(T/16)][H][K][V] (what the backward needs).
// Two kernels: v3 (kda/chunk_mma.cu: mma.sync with split-bf16 operands, fp32 state and
// accumulators; ‖err‖/‖ref‖ ≈ 7e-6 on an H200), the default for K = V = 128 and 16-byte aligned
// q, k, v, g; v2 (fp32 SIMT) for every other shape, or forced by the option kda_fwd = SIMT.
// kda_plain_bf16: v3 with plain bf16 operands (≈ 3e-3; fails the model's tests: kda/chunk_simt.cu and
// tests/test_kda_v3_emu.c say why).
int mtrl_kda_chunk_fwd(mtrl_cuda_ctx *ctx, int T, int H, int K, int V, const float *q,
                       const float *k, const float *v, const float *g, const float *beta,
                       const float *S0, float *o, float *S_final, float *S_tiles);
// The same forward, chunk-parallel (kda/chunk_parallel.cu): the sequence is split into `pieces` runs of
// whole 16-token tiles; every piece's final state from zero and its K x K transition are computed
// at once, a short pass over the pieces gives each its incoming state, then every piece's outputs
// at once. For the shapes where the sequential state pass leaves most SMs idle (few heads, long
// T). pieces: MTRL_KDA_CP_AUTO (0): mtrl_kda_cp_pieces's choice; 1: exactly mtrl_kda_chunk_fwd;
// N >= 2: N pieces (clamped to the tile count and MTRL_KDA_CP_MAX_PIECES). Shapes and inputs v3
// does not take (K = V = 128, 16-byte aligned q, k, v, g; kda/chunk_parallel.cu) run mtrl_kda_chunk_fwd.
// Same arguments and results as mtrl_kda_chunk_fwd, within v3's tolerance of fp64 (the state
// entering piece p >= 2, or p >= 1 when S0 != NULL, goes through the transitions' rounding); bit
// for bit on the tokens of piece 0, and of piece 1 when S0 is NULL. Scratch: v3's records plus
// 2 (pieces − 1) H K V floats.
enum { MTRL_KDA_CP_AUTO = 0, MTRL_KDA_CP_MAX_PIECES = 64 };
int mtrl_kda_chunk_fwd_cp(mtrl_cuda_ctx *ctx, int pieces, int T, int H, int K, int V, const float *q,
                          const float *k, const float *v, const float *g, const float *beta,
                          const float *S0, float *o, float *S_final, float *S_tiles);
// The two forwards above with q, k, v, g in bf16 (same layouts; beta, S0 and the outputs fp32):
// the prep widens each value to fp32 as it loads it and computes from there exactly as from fp32
// inputs, so the results are bit for bit those of mtrl_kda_chunk_fwd / _cp (same pieces) given the
// same values widened to fp32. Why: the prep reads q, k, v, g once and is near the DRAM rate
// (docs/perf.md), and bf16 halves those bytes where a caller holds its inputs as bf16 (fla and
// FlashKDA take bf16). v3 only: K = V = 128, 16-byte aligned q, k, v, g, kda_fwd not SIMT; other
// calls return -1 (v2 reads fp32, and widening into scratch would spend the traffic saved).
// The model does not call these (docs/perf.md, "KDA forward with bf16 inputs"): its q, k leave the
// L2 norm and scale, v the short convolution and g the gate, fp32 elementwise kernels just before
// the forward, whose fp32 outputs the backward reads again; a bf16 copy would write 2 bytes a value
// to save 2 on the read, and bf16 outputs from those kernels would change the backend's interface
// (the CPU backend's too). The actor's prefill of several sequences takes the varlen form, fp32.
int mtrl_kda_chunk_fwd_bf16(mtrl_cuda_ctx *ctx, int T, int H, int K, int V, const mtrl_bf16 *q,
                            const mtrl_bf16 *k, const mtrl_bf16 *v, const mtrl_bf16 *g, const float *beta,
                            const float *S0, float *o, float *S_final, float *S_tiles);
int mtrl_kda_chunk_fwd_cp_bf16(mtrl_cuda_ctx *ctx, int pieces, int T, int H, int K, int V, const mtrl_bf16 *q,
                               const mtrl_bf16 *k, const mtrl_bf16 *v, const mtrl_bf16 *g, const float *beta,
                               const float *S0, float *o, float *S_final, float *S_tiles);
// The number of pieces mtrl_kda_chunk_fwd_cp runs for `pieces` = request at this shape (given
// 16-byte aligned inputs); 1 means the sequential forward. Auto (request 0): min(SMs / H, tiles /
// 128) when that is at least 4 and 8H <= SMs, else 1: chunk-parallel for H <= 16 on an H200 and
// T >= 8,192 (kda/chunk_parallel.cu says why and what it measured).
int mtrl_kda_cp_pieces(const mtrl_cuda_ctx *ctx, int T, int H, int K, int V, int request);
// The forward kernel mtrl_kda_chunk_fwd runs for this shape (given 16-byte aligned inputs): 3 or 2.
int mtrl_kda_chunk_fwd_version(const mtrl_cuda_ctx *ctx, int H, int K, int V);
// The state-gradient pass mtrl_kda_chunk_bwd runs for this shape (given 16-byte aligned inputs): 3 or 2.
int mtrl_kda_chunk_bwd_version(const mtrl_cuda_ctx *ctx, int H, int K, int V);
// Chunked backward (docs/model.md §2.4). S_tiles as written by the forward, or NULL (recomputed into
// scratch). dS_final NULL = zero; dS0 nullable; every other output overwritten.
// The sequential state-gradient pass has two kernels: v3 (kda/chunk_mma_bwd.cu: mma.sync with
// split-bf16 operands, bf16x3, fp32 accumulators), the default for K = V = 128 and 16-byte aligned
// q, k, v, g, dout; v2 (fp32 SIMT) for every other shape, or with the option kda_bwd = SIMT.
// The per-tile pass runs its products on tensor cores with bf16x3 operands (any shape), or in
// fp32 SIMT with kda_bwd_tile = SIMT.
int mtrl_kda_chunk_bwd(mtrl_cuda_ctx *ctx, int T, int H, int K, int V, const float *q,
                       const float *k, const float *v, const float *g, const float *beta,
                       const float *S0, const float *S_tiles, const float *dout,
                       const float *dS_final, float *dq, float *dk, float *dv, float *dg,
                       float *dbeta, float *dS0);
// The chunked forward of n packed sequences, each from the zero state (the learner's packs):
// piece i is tokens offs_host[i] .. offs_host[i+1] - 1 of q, k, v, g [.][H][K], beta [.][H]
// (offs_host: a HOST array [n + 1], non-decreasing, from offs_host[0] >= 0; n <= 65535). o [.][H][V]
// at the same rows, S_final [n][H][K][V] (one per piece) and S_tiles (every piece's tile states,
// piece by piece: mtrl_ref_kda_tile_count(len) each) nullable. Results bit for bit those of
// mtrl_kda_chunk_fwd per piece with S0 = NULL. For v3's shapes (K = V = 128, 16-byte aligned q, k,
// v, g) one prep and one state-pass launch for all pieces (kda/chunk_varlen_mma.cu; in groups of at
// most max(ceil(T / 16), longest piece's tiles) tiles, T the pack's tokens: scratch for that many
// of v3's records), else mtrl_kda_chunk_fwd per piece.
int mtrl_kda_chunk_fwd_varlen(mtrl_cuda_ctx *ctx, int n, const int *offs_host, int H, int K, int V,
                              const float *q, const float *k, const float *v, const float *g,
                              const float *beta, float *o, float *S_final, float *S_tiles);
// The piece_io form (the actor's prefill of several sequences, each continuing its own state):
// the same, piece i from the state at S0_host[i] and its final state to Sf_host[i] (S0_host,
// Sf_host: HOST arrays [n] of device pointers [H][K][V], or NULL: every piece from zero / no final
// states; entries nullable likewise; Sf_host[i] may be S0_host[i]: updated in place). Bit for bit
// mtrl_kda_chunk_fwd per piece with that S0 and S_final, in the same two launches (plus the
// tables' uploads).
int mtrl_kda_chunk_fwd_varlen_io(mtrl_cuda_ctx *ctx, int n, const int *offs_host, int H, int K, int V,
                                 const float *q, const float *k, const float *v, const float *g,
                                 const float *beta, const float *const *S0_host, float *o,
                                 float *const *Sf_host, float *S_tiles);
// The backward of mtrl_kda_chunk_fwd_varlen: bit for bit mtrl_kda_chunk_bwd per piece (S0 = NULL, dS_final = NULL, no dS0),
// S_tiles as the varlen forward wrote them (or NULL: recomputed); dq, dk, dv, dg, dbeta
// overwritten at every piece's rows. Where mtrl_kda_chunk_bwd takes v3 (K = V = 128, 16-byte
// aligned q, k, v, g, dout, kda_bwd not SIMT) four launches per group of pieces (the forward's
// groups; scratch per tile as the per-piece call's), else mtrl_kda_chunk_bwd per piece.
int mtrl_kda_chunk_bwd_varlen(mtrl_cuda_ctx *ctx, int n, const int *offs_host, int H, int K, int V,
                              const float *q, const float *k, const float *v, const float *g,
                              const float *beta, const float *S_tiles, const float *dout, float *dq,
                              float *dk, float *dv, float *dg, float *dbeta);
// One decode token for B sequences (kda_step per sequence): q, k, g [B][H][K]; v [B][H][V];
// beta [B][H]; S [B][H][K][V] updated in place; o [B][H][V].
// Two kernels (kda/chunk_simt.cu): v2 (state in registers, 16-byte accesses) for K in {64, 128, 256},
// V % 64 == 0 and 16-byte aligned pointers; v1 for every other shape, or for all shapes with the
// option decode = SIMT.
int mtrl_kda_step(mtrl_cuda_ctx *ctx, int B, int H, int K, int V, const float *q,
                  const float *k, const float *v, const float *g, const float *beta, float *S,
                  float *o);
// The kernel mtrl_kda_step runs for this shape (given 16-byte aligned pointers): 2 or 1.
int mtrl_kda_step_version(const mtrl_cuda_ctx *ctx, int H, int K, int V);
// The same step with each row's state in its own block: S_rows [B] DEVICE pointers to
// [H][K][V] states, read and updated in place (the v2 kernel, no gather into one block: a decode
// step of B sequences reads and writes each state once). Only where mtrl_kda_step_rows_ok says
// so (the v2 shapes, 16-byte aligned q, k, v, g, o and states: S_h is the same B pointers on the
// host); other calls are refused. Bit-identical to mtrl_kda_step on the gathered block.
int mtrl_kda_step_rows_ok(const mtrl_cuda_ctx *ctx, int B, int H, int K, int V, const float *q, const float *k, const float *v,
                          const float *g, const float *const *S_h, const float *o);
int mtrl_kda_step_rows(mtrl_cuda_ctx *ctx, int B, int H, int K, int V, const float *q, const float *k,
                       const float *v, const float *g, const float *beta, float *const *S_rows, float *o);

// ---- causal attention / MLA (mla_ref.h) ----------------------------------------------------
//
// attn_causal_fwd/bwd of mla_ref.h on bf16 operands (flash style: tiles, online softmax, the
// log-sum-exp saved, nothing Tq x Tk stored). q [Tq][H][Dk]; key of token s, key head j at
// k + s*ldk + j*Dk; value at v + s*ldv + j*Dv. Query row i is at position Tk - Tq + i.
// The absorbed MLA passes Hk = 1, v = k, ldv = ldk, Dv = dc < Dk ("aliased" values).
// Requirements: Dk, Dv multiples of 16, Dv <= 512, Dk <= 576, H % Hk == 0; Tq <= Tk.
// o [Tq][H][Dv], lse [Tq][H] (fp32).
// Three kernel sets (docs/kernel-lab.md, "Causal attention (P4)"): v3 (attn/sm90a/causal_wgmma.cu,
// Hopper's wgmma; compute capability 9.0 only) and v2 (attn/causal_mma.cu, FA2 style, mma.sync)
// for Dk = Dv = 128 and for Dk = 192, Dv = 128 (the naive MLA form: d_n + d_r keys, d_v values)
// with separate values (any Hk): v3 on an H100 / H200 unless the option attn = MMA, else v2; v2
// for the forward of the absorbed shape (Hk = 1, Dk = 576, Dv = 512 aliased); v1 (mla/attn_decode.cu)
// for every other shape, or for all shapes with attn = SIMT.
int mtrl_attn_causal_fwd(mtrl_cuda_ctx *ctx, int Tq, int Tk, int H, int Hk, int Dk, int Dv,
                         float scale, const mtrl_bf16 *q, const mtrl_bf16 *k, int ldk,
                         const mtrl_bf16 *v, int ldv, float *o, float *lse);
// n packed pieces in one call (mla_ref.h mtrl_ref_attn_causal_fwd_varlen): piece i's queries
// at rows qoffs_host[i] .. qoffs_host[i+1]-1 of q, o, lse (and dout, dq), its keys at rows
// koffs_host[i] .. koffs_host[i+1]-1 of k, v (and dk, dv); koffs_host NULL: the query rows. Host
// arrays [n + 1], non-decreasing, Tq_i <= Tk_i. Each piece attends causally to its own keys only. The kernel that
// mtrl_attn_causal_fwd / _bwd runs for the shape (mtrl_attn_causal_version, the same options)
// runs once for all pieces: each block takes one (piece, tile) item of a list uploaded with the
// call and sees its piece as that piece's own launch would (attn/varlen.cuh), so o, lse, dq, dk
// and dv are bit for bit those of one call per piece (tests/test_cuda_attn_varlen.cu); one launch
// per kernel (the backward's: D, v3's lse copies, dK / dV, dQ) whatever n.
int mtrl_attn_causal_fwd_varlen(mtrl_cuda_ctx *ctx, int n, const int *qoffs_host, const int *koffs_host, int H,
                                int Hk, int Dk, int Dv, float scale, const mtrl_bf16 *q, const mtrl_bf16 *k,
                                int ldk, const mtrl_bf16 *v, int ldv, float *o, float *lse);
int mtrl_attn_causal_bwd_varlen(mtrl_cuda_ctx *ctx, int n, const int *qoffs_host, const int *koffs_host, int H,
                                int Hk, int Dk, int Dv, float scale, const mtrl_bf16 *q, const mtrl_bf16 *k,
                                int ldk, const mtrl_bf16 *v, int ldv, const float *o, const float *lse,
                                const mtrl_bf16 *dout, float *dq, float *dk, float *dv);
// The same two functions on fp32 operands (attn/causal_f32.cu; [kernels] attn_operands = fp32):
// the fp32 check of a model against an fp32 reference, not a training kernel (one block per query
// row and head, no tiling; dk, dv accumulated with atomics, so not bit-reproducible). Any Dk, Dv
// up to 640; o, lse, dq, dk, dv as above.
int mtrl_attn_causal_fwd_f32(mtrl_cuda_ctx *ctx, int Tq, int Tk, int H, int Hk, int Dk, int Dv, float scale,
                             const float *q, const float *k, int ldk, const float *v, int ldv, float *o, float *lse);
int mtrl_attn_causal_bwd_f32(mtrl_cuda_ctx *ctx, int Tq, int Tk, int H, int Hk, int Dk, int Dv, float scale,
                             const float *q, const float *k, int ldk, const float *v, int ldv, const float *o,
                             const float *lse, const float *dout, float *dq, float *dk, float *dv);
// The kernel mtrl_attn_causal_fwd (bwd = 0) or _bwd (bwd = 1) runs for this shape on the
// context's device with its options: 3, 2 or 1
// (given 16-byte aligned o and 8-byte aligned dq, dk, dv; v1 runs otherwise).
// alias: the values are the first Dv columns of the keys (Hk = 1, v == k, ldv == ldk).
int mtrl_attn_causal_version(const mtrl_cuda_ctx *ctx, int H, int Hk, int Dk, int Dv, int alias, int bwd);
// dq [Tq][H][Dk] overwritten; dk, dv ACCUMULATED (+=) with the strides of k, v. With aliased
// values (Hk = 1, v == k, ldv == ldk) dv must equal dk (one latent gradient); otherwise dk and
// dv must not overlap. o and lse are the forward's; dout [Tq][H][Dv] bf16.
int mtrl_attn_causal_bwd(mtrl_cuda_ctx *ctx, int Tq, int Tk, int H, int Hk, int Dk, int Dv,
                         float scale, const mtrl_bf16 *q, const mtrl_bf16 *k, int ldk,
                         const mtrl_bf16 *v, int ldv, const float *o, const float *lse,
                         const mtrl_bf16 *dout, float *dq, float *dk, float *dv);
// Absorbed MLA decode (mla_decode_absorbed_ld) for B sequences of different lengths, one new
// query token each. q [B][H][dn+dr] (fp32); W_kvb [H*(dn+dv)][dc] (fp32); the latent caches of
// all sequences live in one pool `lat` (element type lat_type: MTRL_F32 or MTRL_BF16) with row
// stride ld >= dc+dr, each row [ĉ ; k^r]: sequence b's Tk = seq_len[b] rows start at row
// seq_start[b] (device arrays [B]; seq_len[b] >= 1, the new token's row included; lat may be
// NULL, the pool then starting at address 0: caches anywhere whose addresses are multiples of
// the row, core/model_ops.h mtrl_mc_ptr_rows). max_len: a host-side upper bound of the seq_len
// (sizes the split over the cache: the same max_len, the same launches). a [B][H][dv]
// overwritten. Split-K over the cache, partial results merged in a fixed order (deterministic).
// Requirements: H <= 32, dc <= 512, dc + dr <= 640.
// Two kernels (mla/attn_decode.cu): v2 (tensor cores: bf16 query and cache, fp32 softmax and
// accumulation; splits sized from B, max_len and the SM count) for a bf16 cache with
// dc in {128, 256, 512}, (dc + dr) % 32 == 0, ld % 8 == 0 and a 16-byte aligned pool (fastest
// for H <= 16 with dc = 512, dr = 64: the query stays in registers); v1 (fp32 SIMT, 256-key
// splits) for every other case, or for all cases with the option decode = SIMT.
int mtrl_mla_decode_absorbed(mtrl_cuda_ctx *ctx, int B, int H, int dn, int dr, int dv, int dc,
                             float scale, const float *q, const float *W_kvb, const void *lat,
                             int lat_type, int ld, const long long *seq_start,
                             const int *seq_len, int max_len, float *a);
// The kernel mtrl_mla_decode_absorbed runs for these arguments (given a 16-byte aligned pool):
// 2 or 1.
int mtrl_mla_decode_version(mtrl_cuda_ctx *ctx, int H, int dr, int dc, int lat_type, int ld);

// ---- MoE (moe_ref.h) ----------------------------------------------------------------------
//
// N tokens, E experts, K experts per token, D model width, I expert width, R = N*K rows.
// sel, pos [N][K], offsets [E+1], perm_token [R] are int32 device arrays.
// Router: as mtrl_ref_moe_router_fwd (top-K of z − beta or s − beta, ties to the lower id, slots in
// descending order; K <= 16, E <= 1024); form: moe_ref.h's MOE_ROUTER_* bits.
int mtrl_moe_router_fwd(mtrl_cuda_ctx *ctx, int N, int E, int K, const float *z,
                        const float *beta, int form, float rho, int replay, int *sel,
                        float *w, float *s);
int mtrl_moe_router_bwd(mtrl_cuda_ctx *ctx, int N, int E, int K, const float *s, const int *sel,
                        const float *w, int form, float rho, const float *dw,
                        float *dz);
// Stable counting sort by expert (moe_dispatch): deterministic, no atomics on the order.
int mtrl_moe_dispatch(mtrl_cuda_ctx *ctx, int N, int E, int K, const int *sel, int *offsets,
                      int *perm_token, int *pos);
// X_perm[pos[t][j]] = x[t]; x fp32 [N][D]; X_perm [R][D] of x_type (MTRL_F32 or MTRL_BF16:
// rounded on the way).
int mtrl_moe_gather(mtrl_cuda_ctx *ctx, int N, int K, int D, const int *pos, const float *x,
                    void *X_perm, int x_type);
int mtrl_moe_combine_fwd(mtrl_cuda_ctx *ctx, int N, int K, int D, const int *pos,
                         const float *w, const float *Y_perm, float *y);
int mtrl_moe_combine_bwd(mtrl_cuda_ctx *ctx, int N, int K, int D, const int *pos,
                         const float *w, const float *Y_perm, const float *dy, float *dY_perm,
                         float *dw);
int mtrl_moe_scatter_bwd(mtrl_cuda_ctx *ctx, int N, int K, int D, const int *pos,
                         const float *dX_perm, float *dx);
// Grouped SwiGLU experts (moe_experts_fwd/bwd) as a loop of cuBLAS GEMMs over the experts
// (measured faster than cuBLAS's grouped API, docs/perf.md). offsets_host: a HOST copy of
// offsets [E+1] (the caller downloads it once per layer). type: operand type of X_perm and
// the weights W1, W3 [E][I][D], W2 [E][D][I] (MTRL_F32 or MTRL_BF16 copies of the fp32
// masters). u1, u3 [R][I] fp32 saved; Y_perm [R][D] fp32. Backward: dY_perm fp32; dX_perm
// [R][D] fp32 overwritten; dW1, dW3, dW2 fp32 += (each nullable).
int mtrl_moe_experts_fwd(mtrl_cuda_ctx *ctx, int E, int D, int I, const int *offsets_host,
                         const void *X_perm, const void *W1, const void *W3, const void *W2,
                         int type, float *u1, float *u3, float *Y_perm);
int mtrl_moe_experts_bwd(mtrl_cuda_ctx *ctx, int E, int D, int I, const int *offsets_host,
                         const void *X_perm, const void *W1, const void *W3, const void *W2,
                         int type, const float *u1, const float *u3, const float *dY_perm,
                         float *dX_perm, float *dW1, float *dW3, float *dW2);
// ---- grouped experts (moe/experts_mma.cu) ----
// The same products as mtrl_moe_experts_fwd / _bwd (same arguments, layouts, "+=" rules) in a
// fixed number of launches whatever E (forward 2, backward 4, plus dY's rounding for bf16), with
// `offsets` the DEVICE array [E+1] (no host copy: capturable in a CUDA graph) and R = offsets[E]
// given by the caller (N*K: known without reading the device; it sizes the scratch and the grid).
// fp32 operands multiply as TF32 here whatever the context's setting (mtrl_moe_experts_path sends
// true-fp32 work to the lanes); bf16 as the lanes. SwiGLU (and its backward) run in the GEMMs'
// epilogues; an expert with no rows leaves its weight gradients untouched. Requires 1 <= E <=
// 1024, D and I multiples of 8, and 16-byte aligned operands (-1 otherwise). Results are
// deterministic (no atomics) but not the lanes' bits.
int mtrl_moe_experts_grouped_fwd(mtrl_cuda_ctx *ctx, int E, int D, int I, long R, const int *offsets,
                                 const void *X_perm, const void *W1, const void *W3, const void *W2, int type,
                                 float *u1, float *u3, float *Y_perm);
int mtrl_moe_experts_grouped_bwd(mtrl_cuda_ctx *ctx, int E, int D, int I, long R, const int *offsets,
                                 const void *X_perm, const void *W1, const void *W3, const void *W2, int type,
                                 const float *u1, const float *u3, const float *dY_perm, float *dX_perm,
                                 float *dW1, float *dW3, float *dW2);
// One grouped GEMM of the same kernel (the benchmark's comparison with torch._grouped_mm):
// C [R][N] fp32, expert e's rows C_e = A_e B[e]ᵀ with A [R][K] and B [E][N][K] of `type`.
int mtrl_moe_grouped_gemm(mtrl_cuda_ctx *ctx, int E, long R, const int *offsets, int N, int K, const void *A,
                          const void *B, int type, float *C);
// The same grouped GEMM with bf16 A, B and a bf16 C [R][N] (torch._grouped_mm's contract: the
// benchmark compares like with like; the model keeps fp32 outputs), on the wgmma kernel only:
// returns 1 where mtrl_moe_grouped_kernel does not choose it (no compute capability 9.0, the
// option moe = mma, or too few rows per expert) or where the driver declines a tensor map, -1 on
// bad arguments. C holds the fp32 result
// rounded to nearest even: the bits of rounding mtrl_moe_grouped_gemm's output.
int mtrl_moe_grouped_gemm_bf16(mtrl_cuda_ctx *ctx, int E, long R, const int *offsets, int N, int K, const void *A,
                               const void *B, void *C);
// Which implementation suits these experts (R rows in all, operands of `type` on this context):
// MTRL_MOE_GROUPED (the functions above) or MTRL_MOE_LANES (mtrl_moe_experts_fwd / _bwd, per-expert
// cuBLAS chains on the GEMM lanes). The rules and why: moe/experts_mma.cu.
enum { MTRL_MOE_LANES = 0, MTRL_MOE_GROUPED = 1 };
int mtrl_moe_experts_path(const mtrl_cuda_ctx *ctx, int E, int D, int I, long R, int type);
// The same choice for the forward alone: MTRL_MOE_GROUPED also where the grouped forward runs
// on wgmma (below), which outruns the lanes at every row count it takes.
int mtrl_moe_experts_fwd_path(const mtrl_cuda_ctx *ctx, int E, int D, int I, long R, int type);
// The kernel of the grouped row GEMMs (the forward's, mtrl_moe_grouped_gemm, and the backward's
// dm and dX; the weight gradients are always mma's) for these operands, by the option moe
// (kernel_opts.h): MTRL_KOPT_WGMMA (bf16 on compute capability 9.0: warpgroup MMA fed by TMA,
// moe/sm90a/experts_wgmma.cu; a launch falls back to mma if the driver declines a tensor map)
// or MTRL_KOPT_MMA (moe/experts_mma.cu).
int mtrl_moe_grouped_kernel(const mtrl_cuda_ctx *ctx, int E, long R, int type);
// load [E] (overwritten): slots per expert.
int mtrl_moe_load_count(mtrl_cuda_ctx *ctx, int N, int E, int K, const int *sel, int *load);
// QB practical-form update (qb_beta_from_batch): exact selections (radix select on the fp32
// bit patterns). beta_old nullable; beta_new may alias beta_old. Returns 0, 1 when skipped (as
// the reference: ⌊NK/E⌋ = 0, ⌊NK/E⌋+1 > N, K >= E; then beta_new = beta_old), or -1.
int mtrl_qb_beta_from_batch(mtrl_cuda_ctx *ctx, int N, int E, int K, const float *z,
                            const float *beta_old, float *beta_new);

// ---- per-token ops (ops_ref.h, attnres_ref.h); all fp32 ------------------------------------
int mtrl_rmsnorm_fwd(mtrl_cuda_ctx *ctx, int N, int D, const float *x, const float *w, float eps,
                     float *y, float *rstd);
// dw += (nullable); rstd nullable (recomputed).
int mtrl_rmsnorm_bwd(mtrl_cuda_ctx *ctx, int N, int D, const float *x, const float *w,
                     const float *rstd, float eps, const float *dy, float *dx, float *dw);
int mtrl_l2norm_fwd(mtrl_cuda_ctx *ctx, int N, int D, const float *x, float eps, float *y,
                    float *rnorm);
int mtrl_l2norm_bwd(mtrl_cuda_ctx *ctx, int N, int D, const float *x, float eps,
                    const float *dy, float *dx);
int mtrl_gated_rmsnorm_fwd(mtrl_cuda_ctx *ctx, int N, int D, const float *x, const float *z,
                           const float *w, float eps, float *y);
int mtrl_gated_rmsnorm_bwd(mtrl_cuda_ctx *ctx, int N, int D, const float *x, const float *z,
                           const float *w, float eps, const float *dy, float *dx, float *dz,
                           float *dw);
int mtrl_swiglu_fwd(mtrl_cuda_ctx *ctx, int N, int I, const float *u1, const float *u3,
                    float *m);
int mtrl_swiglu_bwd(mtrl_cuda_ctx *ctx, int N, int I, const float *u1, const float *u3,
                    const float *dm, float *du1, float *du3);
// Short conv + SiLU over one sequence (shortconv_fwd/bwd/state_bwd/step of ops_ref.h).
// W <= 8. state_in, state_out, dstate_in nullable as in the reference.
int mtrl_shortconv_fwd(mtrl_cuda_ctx *ctx, int T, int C, int W, const float *x, const float *w,
                       const float *state_in, float *y, float *state_out);
int mtrl_shortconv_bwd(mtrl_cuda_ctx *ctx, int T, int C, int W, const float *x, const float *w,
                       const float *state_in, const float *dy, float *dx, float *dw,
                       float *dstate_in);
int mtrl_shortconv_state_bwd(mtrl_cuda_ctx *ctx, int T, int C, int W, const float *dstate_out,
                             float *dx, float *dstate_in);
// shortconv_fwd_varlen (ops_ref.h): n packed pieces each from the zero window (offs_host: a HOST
// array [n + 1], non-decreasing, n <= 2^24), in one launch (core/conv_varlen.cu); bit for bit
// mtrl_shortconv_fwd per piece with state_in = NULL.
int mtrl_shortconv_fwd_varlen(mtrl_cuda_ctx *ctx, int n, const int *offs_host, int C, int W,
                              const float *x, const float *w, float *y);
// shortconv_bwd_varlen (ops_ref.h): its backward, dx overwritten, dw +=, four launches for the
// pack (core/conv_varlen.cu): dx bit for bit mtrl_shortconv_bwd per piece with state_in = NULL;
// dw deterministic, summed in row blocks of the pack (not per piece), so at fp32 rounding of the
// per-piece calls' dw.
int mtrl_shortconv_bwd_varlen(mtrl_cuda_ctx *ctx, int n, const int *offs_host, int C, int W,
                              const float *x, const float *w, const float *dy, float *dx, float *dw);
// The piece_io form: piece i reads the window at win_in_host[i] ([W-1][C], NULL entry or table:
// zeros) for its rows before its first and writes its last W-1 inputs to win_out_host[i] (NULL
// entry or table: none; may be win_in_host[i]: in place). HOST tables [n] of device pointers. Two
// launches (outputs, then windows); bit for bit mtrl_shortconv_fwd per piece with those states.
int mtrl_shortconv_fwd_varlen_io(mtrl_cuda_ctx *ctx, int n, const int *offs_host, int C, int W,
                                 const float *x, const float *w, const float *const *win_in_host,
                                 float *const *win_out_host, float *y);
// B decode tokens of B sequences: x1 [B][C], windows [B][W-1][C] updated, y1 [B][C].
int mtrl_shortconv_step(mtrl_cuda_ctx *ctx, int B, int C, int W, const float *x1,
                        const float *w, float *window, float *y1);
// Log-prob / entropy over a vocabulary row (logits_logprob_fwd/bwd); V any size (tiled).
int mtrl_logprob_fwd(mtrl_cuda_ctx *ctx, int N, int V, const float *logits, const int *targets,
                     float *logp, float *entropy);
int mtrl_logprob_bwd(mtrl_cuda_ctx *ctx, int N, int V, const float *logits, const int *targets,
                     const float *dlogp, const float *dentropy, float *dlogits);
// AdamW (adamw_update).
int mtrl_adamw(mtrl_cuda_ctx *ctx, size_t n, float *param, const float *grad, float *m,
               float *v, float lr, float beta1, float beta2, float eps, float weight_decay,
               long step);
// One Block-AttnRes site (attnres_site_fwd/bwd). V_host: a HOST array of S device pointers
// (S <= 64). alpha [N][S] nullable in the forward; required in the backward. dV_host: S
// device pointers (entries nullable), each ACCUMULATED; dw, dgamma += (nullable).
int mtrl_attnres_site_fwd(mtrl_cuda_ctx *ctx, int N, int D, int S, const float *const *V_host,
                          const float *w, const float *gamma, float eps, float *h,
                          float *alpha);
int mtrl_attnres_site_bwd(mtrl_cuda_ctx *ctx, int N, int D, int S, const float *const *V_host,
                          const float *w, const float *gamma, float eps, const float *alpha,
                          const float *dh, float *const *dV_host, float *dw, float *dgamma);


#ifdef __cplusplus
}
#endif

#endif
