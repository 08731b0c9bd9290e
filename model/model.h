// model.h: the backbone (docs/model.md) assembled from the ops of a backend (backend.h): the CPU
// reference of kernels/ref, or the CUDA kernels of kernels/cuda (see "Devices" below).
//
// A hybrid stack of L layers; layer l mixes tokens with KDA (lower-bounded decay, §2) or gated
// MLA (NoPE, §3), then applies an FFN: dense SwiGLU in the first layer(s), MoE with a sigmoid
// router, top-k of (logit − β), renormalised weights and shared experts in the others (§4). The
// residual stream is Block Attention Residuals (§6). Options of the dims switch these forms to
// Kimi Linear's (the unbounded gate, score-biased routing, plain residual: docs/model-forms.md). Written over `real`: the programs link
// the fp32 build, the tests an fp64 build of the same source (kernels/ref/real.h).
//
// Shapes (per sequence): T tokens, d = d_model, V = vocabulary, H heads, D = KDA head dim,
// dn/dr/dv/dc = MLA nope/rope/value/latent dims, E experts, k = top_k.
//
// Three execution forms, equal within tolerance (docs/model.md §8):
//  1. chunked: mtrl_model_forward/backward over a batch of sequences with segment = 0 (each
//     sequence is one segment; KDA in 16-token tiles).
//  2. recurrent decode: mtrl_model_decode over a batch of per-sequence states (KDA state, conv
//     windows, MLA latent cache), one token per sequence per call; mtrl_model_prefill feeds a
//     prompt through the chunked form into such a state.
//  3. segmented: the same calls with segment = S > 0. Each sequence is cut into segments of S
//     tokens, the first taking the remainder (len - (n-1)·S); KDA states, conv windows and MLA
//     latents cross the boundaries. The forward keeps only per-boundary states and the MLA
//     latents (O(T × (dc + dr)) per MLA layer); the backward walks segments last to first,
//     recomputes each from its boundary state (except the forward's very last, whose caches are
//     still there) and gives the exact gradient of the whole sequence. Activation memory is
//     O(S), not O(T).
//     model_plan.h chooses S from the device's free memory (and counts every block of a step).
//
// Training protocol (the learner, replay):
//     mtrl_model_forward(m, batch, segment, logp, entropy, routing_out)   // all tokens' log-probs
//     ... the loss turns logp into dlogp (and dentropy) per token ...
//     mtrl_model_backward(m, batch, dlogp, dentropy)                      // grads += ∂L/∂θ
//     mtrl_model_optimizer_step(m, ...)                                    // AdamW on grads
//     mtrl_qb_apply(m)                                                      // β for the next step (qb.h)
// The forward stores what the backward needs inside the model's batch workspace; a forward
// must precede each backward with the same batch.
//
// Devices (docs/model.md is the math; backend.h the operations): the same code runs on the CPU
// reference (MTRL_DEVICE_CPU, fp32 or fp64) or on one GPU (MTRL_DEVICE_CUDA, the fp32 build
// with MTRL_HAVE_CUDA), chosen once by mtrl_model_init_on (from `[model] device`:
// mtrl_model_parse_device(cfg->model.device, &device, &gpu)). On a GPU:
//   * parameters, gradients and both AdamW moments live in one device block each; the host
//     block m->params (and m->grads, m->adam_m, m->adam_v) is a MIRROR, the source for
//     checkpoints and published weights. mtrl_model_save refreshes it from the device and
//     mtrl_model_load uploads what it read, so checkpoints need no extra call. Code that reads
//     or writes the host blocks directly calls mtrl_model_to_host / mtrl_model_to_device.
//   * QB's β is kept on the host (m->qb_beta, set by mtrl_qb_apply) and copied to the
//     device by the calls that change it; after writing m->qb_beta by hand, call
//     mtrl_model_to_device.
//   * the per-segment activations, the boundary states of a batch and every decode state
//     (KDA S, conv windows, MLA latents) live on the device. mtrl_decode_state_download /
//     _upload move a state's contents to and from host arrays (snapshots).
//   * inputs and outputs of the calls (tokens, log-probs, logits, routing, dlogp) stay host
//     arrays; every call returns with its host outputs written.
//   * arithmetic: fp32 everywhere but the GEMMs and the attention. The projection and expert
//     GEMMs run through cuBLAS on TF32 tensor cores by default (dims.gemm_tf32, [model] gemm =
//     tf32; gemm = fp32 or [kernels] gemm = fp32 keeps true fp32, what the GPU tests compare with the
//     CPU); the MLA causal attention multiplies bf16 copies of its operands, fp32 accumulation.
//     Opt-in at creation: [kernels] gemm = bf16 (dims.kern; bf16 operands for
//     the projections and FFN / expert GEMMs from a bf16 copy of the weights that the backend
//     refreshes whenever the parameter block changes; backend.h mtrl_backend_gemm_bf16).
//   * MLA latents (the learner's batch workspace, every decode state) are stored as bf16,
//     rounded once when their rows are written (issue 8: half the bytes of a long episode's
//     resident cache; the absorbed decode runs its bf16 tensor-core kernel); their gradients
//     stay fp32 and accumulate across segments. [kernels] latent = fp32 (dims.kern) when the
//     model is created keeps them fp32 (backend.h mtrl_backend_latent_size). Host arrays of
//     latents (snapshots: mtrl_decode_state_download / _upload) are `real` either way.
#ifndef MTRL_MODEL_H
#define MTRL_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "common/arena.h"
#include "common/config.h"
#include "common/tensor.h"
#include "kernels/kernel_opts.h"
#include "kernels/ref/real.h"

#define MTRL_MAX_LAYERS 128

struct mtrl_backend; // backend.h

enum { MTRL_DEVICE_CPU = 0, MTRL_DEVICE_CUDA = 1 };

typedef struct mtrl_model_dims {
    int L, d, V;
    char mixer[MTRL_MAX_LAYERS + 1]; // 'K' or 'M' per layer
    int H, D, W;                     // KDA heads, head dim (d_k = d_v), conv kernel
    int mH, dn, dr, dv, dc;          // MLA heads and dims
    int mla_gate;
    // The learner's chunked forward and backward (SEG_CHUNK) run MLA in the absorbed form (1,
    // [model] mla_train = absorbed) or the naive one (0, the default): keys and values expanded
    // per head from the latents (mla_ref.h mla_expand_kv), attention with Hk = H over Dk = dn+dr,
    // Dv = dv. The same function either way; decode stays absorbed.
    int mla_absorbed;
    // Prefill (SEG_PREFILL) in the naive form too (1, the default, [model] mla_prefill = naive)
    // or absorbed (0): naive, the inference scratch holds the expanded keys of every key so far
    // (mtrl_model_infer_bytes takes the capacity for it).
    int mla_prefill_naive;
    // The GPU's projection and expert GEMMs on TF32 tensor cores (1, the default, [model] gemm =
    // tf32) or true fp32 (0); kern.gemm may override it (backend.h mtrl_backend_gemm_tf32). A CPU
    // model ignores it.
    int gemm_tf32;
    // The kernels and precisions of a GPU backend ([kernels], kernels/kernel_opts.h; zero: the
    // defaults). The backend copies them into its CUDA context; the planner sizes the latents by
    // them. A CPU model ignores them.
    mtrl_kernel_opts kern;
    int dense_I;                     // FFN width of the dense layers
    int E, k, n_shared, I;           // experts, top-k, shared experts, expert width
    int S;                           // AttnRes block size in layers
    int score_softmax;
    real g_min, rho, eps, init_std;
    int n_moe;                       // MoE layers: L − first_dense
    // The forms of the layers ([model] keys; docs/model-forms.md maps Kimi Linear's onto them).
    // Each default is the project's own model.
    int kda_gate;          // MTRL_KDA_GATE_*: bounded (default) or Kimi's unbounded softplus gate
    int attnres;           // 1 (default): Block AttnRes; 0: plain pre-norm residual, no attnres.* tensors
    int first_dense;       // layers 0 .. first_dense−1 have the dense SwiGLU FFN (default 1)
    int router_bias_score; // 0 (default): top-k of z − β; 1: top-k of s − β (s the router score)
    int moe_renorm;        // 1 (default): the top-k scores renormalised to sum 1 before ρ
    real kv_eps;           // epsilon of the MLA latent's RMSNorm (default: eps)
    // Pictures (docs/multimodal.md, common/image.h): side P of the patches ([model]
    // image_patch; 0 = none: an image token is then a programming error) and the largest side
    // of a picture in pixels ([model] image_max_side).
    int image_patch, image_max_side;
} mtrl_model_dims;

// kda_gate: g = g_min·σ(e^{A_log}(f + dt_bias)) in (g_min, 0) (the default), or Kimi Linear's
// g = −e^{A_log}·softplus(f + dt_bias) in (−∞, 0), exact on the CPU; a GPU clamps it below at
// g_min, the range its chunked kernels take (kda_ref.h kda_gate_kimi_fwd, docs/model-forms.md).
enum { MTRL_KDA_GATE_BOUNDED = 0, MTRL_KDA_GATE_KIMI = 1 };

// Pointers to one layer's tensors inside a block laid out like the parameters (the parameters
// themselves, their gradients, or an optimizer moment). Unused pointers are NULL.
typedef struct mtrl_layer_ptrs {
    real *norm1, *norm2;                                  // [d]
    real *wq, *wk, *wv;                                   // KDA [H*D][d]
    real *conv_q, *conv_k, *conv_v;                       // [H*D][W]
    real *wf1, *wf2;                                      // [D][d], [H*D][D]
    real *A_log, *dt_bias;                                // [H], [H*D]
    real *wbeta;                                          // [H][d]
    real *wz1, *wz2;                                      // [D][d], [H*D][D]
    real *onorm;                                          // [D]
    real *wo;                                             // [d][H*D]
    real *mq;                                             // MLA [mH*(dn+dr)][d]
    real *mkva;                                           // [dc+dr][d]
    real *mkv_norm;                                       // [dc]
    real *mkvb;                                           // [mH*(dn+dv)][dc]
    real *mg;                                             // [mH*dv][d] (gate)
    real *mo;                                             // [d][mH*dv]
    real *w1, *w3, *w2;                                   // dense FFN [I][d], [I][d], [d][I]
    real *router;                                         // [E][d]
    real *ew1, *ew3, *ew2;                                // experts [E][I][d], [E][I][d], [E][d][I]
    real *sw1, *sw3, *sw2;                                // shared [n_shared*I][d], ..., [d][n_shared*I]
} mtrl_layer_ptrs;

typedef struct mtrl_model_ptrs {
    real *embed;                                          // [V][d]
    real *lm_head;                                        // [V][d]
    real *final_norm;                                     // [d]
    real *site_w, *site_g;                                // [2L+1][d] AttnRes pseudo-queries, key norms
    mtrl_layer_ptrs layer[MTRL_MAX_LAYERS];
    // The patch embedding [d][3P² + 4] (dims.image_patch > 0, else NULL): columns 0..3P²-1 map
    // a patch's pixels (each byte v as v/255, so black is 0), column 3P² is its bias, the last
    // three are the embeddings of IMG_START, IMG_ROW and IMG_END (one-hot inputs): one GEMM
    // embeds every image token of a segment. Initialised N(0, 1/P²): a patch of pixels around
    // 1/2 then embeds at about the text embedding's scale (N(0, 1)).
    real *patch_w;
} mtrl_model_ptrs;

// A batch of sequences. Position t of sequence i predicts tokens[t+1]; the last position has no
// target. logp/entropy/dlogp arrays of a batch are laid out sequence after sequence (offsets).
typedef struct mtrl_batch {
    int n;                      // sequences
    const uint32_t *const *tokens;
    const int *len;             // tokens per sequence
    // Recorded routing to replay (R3), or NULL: per sequence [len][n_moe][k] expert ids.
    const uint8_t *const *routing;
} mtrl_batch;

// Per-sequence decode state (the recurrent form). The arrays live where the model computes
// (device memory for a CUDA model: never dereference them on the host there).
typedef struct mtrl_decode_state {
    int pos;        // tokens consumed so far
    int cap;        // latent cache capacity in tokens
    real *kda_S;    // [n_kda][H][D][D]
    real *conv;     // [n_kda][3][W-1][H*D]  (q, k, v windows)
    void *latent;   // [n_mla][cap][dc+dr] of the backend's latent type (`real` on the CPU, bf16 on a GPU)
    void *block;    // the one allocation holding the three
    struct mtrl_backend *be; // the backend that allocated it
} mtrl_decode_state;

// ---- profile (opt-in; `mtrl bench model --profile`) --------------------------------------------------
// Where a forward, backward and optimizer step spend their time, by sub-block of the model. While
// m->profile is set, every phase below is timed with the device synchronised (be->sync) before
// the clock is read at both of its ends, so asynchronous GPU work lands in the phase that issued
// it. Those syncs serialise the host and the device, so a profiled call is slower than an
// unprofiled one: time the throughput without the profile, profile one extra call. NULL (the
// default) costs one pointer test per phase. Numerics do not change (tests/test_model_profile.c).
//
// Each interval is counted under a pass and a block; calls counts intervals, not layers (a KDA
// layer's forward times its projections in five intervals). Phases do not nest, and the work
// between them (state copies at segment boundaries, arena bookkeeping) is in no phase: the sum
// of the phases against the wall time of the call is the attribution's coverage.
enum {
    MTRL_PROF_FWD,       // mtrl_model_forward (and prefill, logits, decode, which use the same code)
    MTRL_PROF_RECOMPUTE, // the forward of each segment that mtrl_model_backward recomputes (segmented
                         // backward, or a batch too large to keep its activations)
    MTRL_PROF_BWD,       // the backward proper, and mtrl_model_optimizer_step
    MTRL_PROF_PASSES
};
enum {
    MTRL_PROF_EMBED,       // embedding lookup / its gradient scatter
    MTRL_PROF_SITE,        // AttnRes sites (the output site included), pre-norms, residual adds
    MTRL_PROF_KDA_PROJ,    // KDA GEMMs: q/k/v, gate f1/f2, beta, output gate z1/z2, wo
    MTRL_PROF_KDA_ELEM,    // KDA short convs, L2 norms, sigmoid, gated RMSNorm (memory-bound)
    MTRL_PROF_KDA_CORE,    // KDA gate and the chunked delta rule (kda_gate_*, kda_chunk_* / kda_step)
    MTRL_PROF_MLA_PROJ,    // MLA GEMMs: q, kv_a, gate, output
    MTRL_PROF_MLA_ELEM,    // MLA latent RMSNorm, latent rows written / read, gate sigmoid
    MTRL_PROF_MLA_ABSORB,  // MLA kv_b absorbed into the queries and out of the latent output
    MTRL_PROF_MLA_ATTN,    // MLA causal attention over the latents (attn_causal_*, mla_decode)
    MTRL_PROF_FFN_DENSE,   // layer 0's dense SwiGLU
    MTRL_PROF_MOE_ROUTE,   // router GEMM, top-k, QB statistics, dispatch, gather / combine / scatter
    MTRL_PROF_MOE_EXPERTS, // the routed experts' grouped SwiGLU
    MTRL_PROF_MOE_SHARED,  // the shared experts
    MTRL_PROF_HEAD,        // final RMSNorm, LM head GEMM, log-probs (and their gradients)
    MTRL_PROF_OPTIM,       // mtrl_model_optimizer_step (pass MTRL_PROF_BWD)
    MTRL_PROF_BLOCKS
};
typedef struct mtrl_model_profile {
    long calls[MTRL_PROF_PASSES][MTRL_PROF_BLOCKS]; // timed intervals
    double sec[MTRL_PROF_PASSES][MTRL_PROF_BLOCKS]; // their total wall time, device synchronised
    int pass; // MTRL_PROF_*: set by the drivers (MTRL_PROF_FWD outside mtrl_model_backward)
} mtrl_model_profile;
// "fwd.kda.proj", "recompute.site", "bwd.optimizer", ...: a phase's name for tables.
const char *mtrl_model_profile_name(int pass, int block, char *buf, size_t cap);

typedef struct mtrl_model {
    mtrl_model_dims dims;
    mtrl_tt params;             // the parameter table and its block
    real *grads, *adam_m, *adam_v; // same layout as params (params.total bytes each); NULL when inference
    int inference;              // parameters only (mtrl_model_init_infer_on)
    // The bf16-resident form (mtrl_model_init_infer_bf16_on, model_wsplit.h): d_params is the
    // compact fp32 block of the tensors that keep fp32, d_w16 the backend's bf16 block of the
    // GEMM-only ones, wsplit where each tensor lives; 0 / NULL otherwise.
    int weights_bf16;
    void *d_w16;
    struct mtrl_wsplit *wsplit;
    mtrl_model_ptrs P, G;       // pointers into params and grads (host blocks)
    // Where the model computes: the backend and its copies of the blocks. On the CPU these are
    // the host blocks themselves (dP == P, d_params == params.base, ...).
    int device, gpu;            // MTRL_DEVICE_*, CUDA device index
    struct mtrl_backend *be;
    void *d_params, *d_grads, *d_adam_m, *d_adam_v;
    mtrl_model_ptrs dP, dG;     // pointers into d_params and d_grads
    real *d_qb_beta;            // [L][E]
    long step;                  // optimizer steps taken
    uint32_t version;           // weight version (published)
    // Quantile Balancing (docs/model.md §4.3): β per MoE layer, outside the gradient path.
    real *qb_beta;              // [L][E] (the dense layers' rows unused)
    double *qb_sum;             // [L][E] β computed from this step's batches, summed
    int *qb_count;              // [L] number of batches summed
    long *load;                 // [L][E] routing load this step (metrics)
    int qb_mode;                // MTRL_QB_* (model/qb.h, the owner of everything QB): TRAIN at init
    int replay_routing;         // mtrl_model_forward uses batch->routing when set
    // Called after each segment of a segmented forward and backward (nullable): a learner step
    // over a 1M-token episode takes minutes, and its owner keeps its connections alive from
    // here (the learner sends heartbeats). It must not touch the model.
    void (*segment_hook)(void *user);
    void *segment_hook_user;
    // Workspace of the last forward (for its backward); owned here, sized per batch.
    struct mtrl_model_ws *ws;
    size_t peak_activation_bytes; // high-water mark of per-segment activations (bench, tests)
    size_t peak_infer_bytes;      // ... of the prefill / logits scratch (tests)
    long recomputed_tokens;       // tokens the last backward (or mtrl_model_train) ran a second
                                  // forward for: 0 when every segment's caches were at hand
    // The per-phase timing the calls add to while set (nullable; see "profile" above). Zero it
    // before the calls to profile; the caller owns it.
    mtrl_model_profile *profile;
    // 1: decode steps launch kernel by kernel even where the backend records them as graphs
    // (model/model_decode.h): a benchmark's comparison of the two on one model. 0 at init.
    int decode_eager;
    // The patch table the image tokens of the next calls name (mtrl_model_set_patches).
    const uint8_t *img_rows;
    int img_n;
    // Where the routed experts of the training passes run (mtrl_model_set_experts; NULL: here).
    const struct mtrl_model_experts_fn *experts;
} mtrl_model;

// The routed experts of every MoE layer run by someone else (expert parallel: the ranks that own
// them, learner/dist_ep_wire.h). While set, the training passes (the segments of
// mtrl_model_forward, _backward and _train, recomputed ones included) route each MoE layer here
// as always (QB bias, routing replay, the statistics into m's counters) and hand its rows,
// grouped by expert, to fwd instead of running the experts; the backward hands the same rows and
// their output gradients to bwd. Prefill, logits and decode never call them. Arrays are backend
// memory (the host's on the CPU, the only device that takes it); offsets [E+1]: expert e's rows
// are offsets[e] .. offsets[e+1]-1 of `rows`.
typedef struct mtrl_model_experts_fn {
    // Y [rows][d] (overwritten) = the experts of X [rows][d], layer `layer`.
    void (*fwd)(void *user, int layer, int rows, const int *offsets, const real *X, real *Y);
    // dX [rows][d] (overwritten) from the forward's X and dY; the experts' weight gradients are
    // added by whoever runs them (into this model's m->dG only for the experts it owns).
    void (*bwd)(void *user, int layer, int rows, const int *offsets, const real *X, const real *dY, real *dX);
    void *user;
} mtrl_model_experts_fn;

// Sets (fn borrowed until unset) or unsets (fn NULL) m's experts elsewhere. MTRL_ERR_USAGE
// naming the reason for a model not on the CPU (a GPU path needs the NCCL exchange on the
// device: docs/multi-gpu.md §3), an inference model or a dense one (no MoE layer).
mtrl_status mtrl_model_set_experts(mtrl_model *m, const mtrl_model_experts_fn *fn, mtrl_error *err);

// Fills dims from a resolved config's [model] and [kernels] and the vocabulary size. Returns
// MTRL_OK or MTRL_ERR_USAGE with a message (shapes the model cannot take).
mtrl_status mtrl_model_dims_from_config(mtrl_model_dims *d, const mtrl_config *cfg, int vocab, mtrl_error *err);

// The kernel options a resolved [kernels] section names (the INI's choices as
// kernels/kernel_opts.h's values).
void mtrl_kernel_opts_from_config(mtrl_kernel_opts *o, const mtrl_cfg_kernels *k);

// Allocates parameters (initialised from the counter RNG with `seed`), gradients and AdamW
// moments, one block each, on the CPU.
void mtrl_model_init(mtrl_model *m, const mtrl_model_dims *dims, uint64_t seed);
// The same on a device: MTRL_DEVICE_CPU (gpu ignored) or MTRL_DEVICE_CUDA on GPU `gpu`. The
// initial values are the CPU's, bit for bit (initialised on the host, then uploaded). Returns
// MTRL_ERR_USAGE with a message (m left zeroed) when this build has no CUDA backend (the CPU-
// only or the fp64 build), there is no such GPU, or the dims exceed what the CUDA kernels take
// (KDA head dim a multiple of 16 <= 128; MLA dc a multiple of 16 <= 512, dc + dr a multiple of 8
// <= 576, heads <= 32; top_k <= 16; conv kernel <= 8).
mtrl_status mtrl_model_init_on(mtrl_model *m, const mtrl_model_dims *dims, uint64_t seed, int device, int gpu,
                               mtrl_error *err);
// The same with the parameters alone, for inference (the actors, which never train): no
// gradient or AdamW blocks on the device or the host (3 x the parameter bytes less: 14 GB of
// `small` on a GPU the learner shares). mtrl_model_backward, _train, _zero_grads and
// _optimizer_step refuse such a model (a check failure naming it); saving or loading it
// with_optimizer is an error; mtrl_model_optimizer_reset does nothing.
mtrl_status mtrl_model_init_infer_on(mtrl_model *m, const mtrl_model_dims *dims, uint64_t seed, int device, int gpu,
                                     mtrl_error *err);
// The same in the bf16-resident form (model/model_wsplit.h; [actor] weights = bf16): on a GPU
// with [kernels] gemm = bf16 only (MTRL_ERR_USAGE otherwise, naming the keys), the GEMM-only
// matrices exist on the device as bf16 alone (no fp32 copy), the rest as fp32. Its GEMMs read
// exactly the bf16 weights of the fp32 form (which rounds its fp32 block to the same bf16):
// loading a checkpoint, mtrl_model_to_device and a host weight slot round the matrices once
// (on the host), a device weight slot of bf16 matrices is copied as it is. The host mirror
// (m->params.base) stays fp32 and whole; mtrl_model_to_host widens the bf16 matrices.
mtrl_status mtrl_model_init_infer_bf16_on(mtrl_model *m, const mtrl_model_dims *dims, uint64_t seed, int device,
                                          int gpu, mtrl_error *err);
// Usable CUDA devices for a model in this build (0: CPU only).
int mtrl_model_cuda_devices(void);
// What m's backend computes in, for reports: its dense and expert GEMMs' precision
// (MTRL_KGEMM_BF16, _TF32 or _FP32; a CPU model's is FP32, standing for `real`), and the bytes
// of one MLA latent element it stores (backend.h mtrl_backend_latent_size).
int mtrl_model_gemm_precision(const mtrl_model *m);
size_t mtrl_model_latent_size(const mtrl_model *m);
// The copy rate of m's device (bytes read + written per second) over two blocks of `bytes` it
// allocates for the call, best of `reps`: the memory roofline `mtrl bench` compares with.
double mtrl_model_copy_rate(mtrl_model *m, size_t bytes, int reps);
// Reads "cpu" / "cuda" / "cuda:N" (the [model] device value). Returns 0, or -1 for anything else.
int mtrl_model_parse_device(const char *s, int *device, int *gpu);
void mtrl_model_free(mtrl_model *m);

// Host mirror <-> device (no-ops on the CPU). to_host copies parameters, gradients and
// moments into the host blocks; to_device copies parameters, gradients, moments and β from the
// host. Both wait for the device.
void mtrl_model_to_host(mtrl_model *m);
void mtrl_model_to_device(mtrl_model *m);
// Zeroes both AdamW moments (a fresh optimizer), wherever they live.
void mtrl_model_optimizer_reset(mtrl_model *m);

size_t mtrl_model_param_count(const mtrl_model *m);
// The parameter table of dims d, laid out (names, shapes, offsets, t->total) with no block
// allocated: what mtrl_model_init builds, for code that plans over it without a model (the
// ZeRO shard layout of `mtrl plan`, learner/dist_plan.h). Free with mtrl_tt_free.
void mtrl_model_param_table(mtrl_tt *t, const mtrl_model_dims *d);
// 1 for a MoE layer's routed-expert tensor ('L<i>.moe.w1', w3: [E][I][d]; w2: [E][d][I]): expert
// e's part is the e-th of E equal contiguous ranges; 0 for every other tensor (shared experts
// 'moe.shared_w*' and the router included).
int mtrl_model_param_is_routed_expert(const char *name);
// Matrix parameters one token multiplies by (the MFU convention: embeddings and vectors left
// out, each MoE layer's routed experts counted k/E of their size, shared experts in full).
double mtrl_model_active_matmul_params(const mtrl_model *m);
void mtrl_model_zero_grads(mtrl_model *m);

// Forward over a batch (form 1 or 3). logp [Σ len], entropy [Σ len] (nullable): per position,
// of the next token (0 for each sequence's last position). routing_out (nullable): per sequence
// [len][n_moe][k] chosen experts, as u8 (E <= 256). segment: a resolved length (what
// model_plan.h mtrl_model_segment_resolve gives for [learner] segment): S > 0 tokens per segment,
// or 0, one segment per sequence; never "plan it", which is the resolver's job.
// Routing statistics for QB and loads accumulate in the model (model/qb.h).
void mtrl_model_forward(mtrl_model *m, const mtrl_batch *b, int segment, real *logp, real *entropy,
                        uint8_t *const *routing_out);

// Backward of L = Σ dlogp·logp + Σ dentropy·entropy over the batch of the last forward, at the
// weights of that forward (change none in between); gradients ACCUMULATE into m->grads.
// dentropy nullable. The forward's last segment is not recomputed: its caches are still in the
// workspace (one segment's forward less per step; a sequence of one segment recomputes nothing).
void mtrl_model_backward(mtrl_model *m, const mtrl_batch *b, const real *dlogp, const real *dentropy);

// The learner's step in one pass (form 1 or 3, the same gradient as forward + backward): the
// batch is cut into units (packs of whole sequences that fit in one segment, laid end to end up
// to `segment` tokens, or MTRL_PACK_TOKENS with segment 0; a longer sequence is a unit of its
// own, cut into segments), and each unit runs its forward, then loss(), then its backward while
// its caches are still in the arena. So a sequence of one segment is never recomputed and the
// activations held are one segment's whatever the batch size; only the earlier segments of a
// sequence longer than `segment` are recomputed (m->recomputed_tokens counts them).
// loss(user, i0, n, logp, entropy, dlogp, dentropy) is called once per unit, in batch order,
// after logp (and entropy, when non-NULL) of sequences i0 .. i0+n-1 are written; it fills
// dlogp (and dentropy, when non-NULL) at those sequences' positions. All four arrays are the
// whole batch's [Σ len], laid out as mtrl_model_forward's. Gradients ACCUMULATE into m->grads;
// QB statistics and loads accumulate as a forward's. routing replay as mtrl_model_forward's.
typedef void (*mtrl_model_loss_fn)(void *user, int i0, int n, const real *logp, const real *entropy, real *dlogp,
                                   real *dentropy);
void mtrl_model_train(mtrl_model *m, const mtrl_batch *b, int segment, real *logp, real *entropy, real *dlogp,
                      real *dentropy, mtrl_model_loss_fn loss, void *user);
// The units mtrl_model_train (and the forward) cut n sequences of len[i] tokens into with this
// segment: unit k holds sequences first[k] .. first[k+1]-1, in order (first has room for n + 1
// entries). Returns the number of units. The one packing rule: the workspace sizes, the memory
// planner and the multi-GPU split (learner/dist_plan.h) all count units with it.
int mtrl_model_pack_units(int n, const int *len, int segment, int *first);

// Logits of every position of one sequence (tests, replay): logits [len][V].
void mtrl_model_logits(mtrl_model *m, const uint32_t *tokens, int len, int segment, real *logits);

// AdamW over every parameter with global-norm clipping (clip <= 0: off); returns the
// gradient norm before clipping. Increments m->step.
double mtrl_model_optimizer_step(mtrl_model *m, real lr, real beta1, real beta2, real eps, real weight_decay,
                                 real clip);
// The same step in pieces, for an optimizer whose state is sharded over ranks (ZeRO,
// learner/dist_dp.h): each rank sums the squared gradients of the elements it owns, the ranks
// add their sums, and each updates its own elements with the scale of the whole norm.
// mtrl_model_optimizer_step is exactly these calls over every tensor whole, so both paths run
// one element update. Ranges are elements [begin, end) of tensor `tensor` of m->params.
//   mtrl_model_grad_sq_range   Σ g² over the range (in double)
//   mtrl_model_clip_scale      the factor of global-norm clipping for a norm (clip <= 0: 1)
//   mtrl_model_adamw_range     scales the range's gradients by grad_scale, then AdamW at step
//                              m->step (the caller increments it once per step, before),
//                              weight decay as the whole step's (none on 1-D and attnres.*)
//   mtrl_model_params_changed  after writing the parameter block (the updates, or shards
//                              gathered from other ranks): the backend's derived copies follow
double mtrl_model_grad_sq_range(const mtrl_model *m, int tensor, size_t begin, size_t end);
static inline real mtrl_model_clip_scale(double norm, real clip) {
    return (clip > 0 && norm > clip) ? (real)(clip / norm) : (real)1;
}
void mtrl_model_adamw_range(mtrl_model *m, int tensor, size_t begin, size_t end, real grad_scale, real lr, real beta1,
                            real beta2, real eps, real weight_decay);
void mtrl_model_params_changed(mtrl_model *m);

// QB (its modes, statistics and update): model/qb.h.
// Max load violation of one layer in the current step's statistics.
double mtrl_model_load_violation(const mtrl_model *m, int layer);

// Decode states, on the model's device. Free them before the model.
void mtrl_decode_state_init(mtrl_decode_state *s, const mtrl_model *m, int cap);
// Device bytes a decode state of capacity cap takes (what init allocates, latents at the
// backend's latent element size): for memory budgets.
size_t mtrl_decode_state_bytes(const mtrl_model *m, int cap);
// Prefill of n sequences at once (the actor's tool results, prompts): tokens[i] (lens[i] >= 1
// tokens) continue states[i] (distinct states). Sequences are laid end to end into packed
// segments of up to MTRL_PREFILL_SEGMENT tokens, one forward each instead of one per sequence;
// a longer one runs alone. logits_last [n][V] (nullable): the distribution after each one's
// last token; routing_out [n] (nullable, entries nullable): as mtrl_model_prefill's. The same
// as n calls of mtrl_model_prefill, up to the rounding of GEMMs over more rows.
void mtrl_model_prefill_many(mtrl_model *m, mtrl_decode_state *const *states, int n, const uint32_t *const *tokens,
                             const int *lens, real *logits_last, uint8_t *const *routing_out);
// Device bytes of the scratch that mtrl_model_prefill and mtrl_model_decode share: one prefill
// segment's forward (MTRL_PREFILL_SEGMENT tokens, fewer for shorter prompts; with [model]
// mla_prefill = naive also the expanded keys of a sequence of up to `cap` tokens) or one decode
// batch of `batch` rows, whichever is larger. For the actor's memory budget.
size_t mtrl_model_infer_bytes(const mtrl_model *m, int batch, int cap);
// Prompts and tool results are prefilled in segments of up to this many tokens: long enough for
// a GPU's attention and GEMMs to fill the device on a long document (few, full launches per MLA
// layer; with [kernels] latent = fp32 also few conversions of the latent cache to the attention's
// bf16 operands: one per segment and MLA layer), short enough
// that one segment's forward stays a small part of an actor's memory (prefill keeps no caches
// for a backward: ~230 KB a token for `small`, 1.9 GB a segment).
#define MTRL_PREFILL_SEGMENT 8192
void mtrl_decode_state_free(mtrl_decode_state *s);
void mtrl_decode_state_reset(mtrl_decode_state *s, const mtrl_model *m);
// Copies a state (snapshot/resume); dst must have been initialised with cap >= src->pos.
void mtrl_decode_state_copy(mtrl_decode_state *dst, const mtrl_decode_state *src, const mtrl_model *m);
// A state's contents as host arrays laid out like the CPU fields: kda_S [n_kda][H][D][D], conv
// [n_kda][3][W-1][H*D], latent [n_mla][pos][dc+dr] (the pos rows in use of each layer, packed).
// download reads s (any device); upload writes s (cap >= pos) and sets s->pos = pos. The host
// arrays are `real` whatever the device stores: bf16 latents are widened exactly on download
// and rounded on upload, so a snapshot's format does not depend on the device (and a bf16 state
// downloaded and uploaded again is bit for bit the same).
void mtrl_decode_state_download(const mtrl_model *m, const mtrl_decode_state *s, real *kda_S, real *conv,
                                real *latent);
void mtrl_decode_state_upload(const mtrl_model *m, mtrl_decode_state *s, int pos, const real *kda_S,
                              const real *conv, const real *latent);

// Feeds n tokens into a state through the chunked form; logits_last [V] (nullable) are the
// logits after the last token; routing_out (nullable) [n][n_moe][k] the experts each token
// took. The state's capacity must hold pos + n tokens.
void mtrl_model_prefill(mtrl_model *m, mtrl_decode_state *s, const uint32_t *tokens, int n, real *logits_last,
                        uint8_t *routing_out);

// One token for each of B sequences (the recurrent form, batched projections): tokens [B],
// states[B], logits [B][V]. routing_out (nullable) [B][n_moe][k].
void mtrl_model_decode(mtrl_model *m, mtrl_decode_state *const *states, int B, const uint32_t *tokens, real *logits,
                       uint8_t *routing_out);
// The decode steps since the model's workspace was made: replayed from a recording, recorded
// (and run), and launched kernel by kernel (model/model_decode.h; [kernels] decode_graph on a
// GPU records). Each pointer nullable.
void mtrl_model_decode_counts(const mtrl_model *m, long *replayed, long *recorded, long *launched);

// ---- checkpoints and published weights (safetensors, common/checkpoint.h) ----------------------------
// Writes the parameters and QB β, plus with_optimizer: the AdamW moments and the step. Metadata:
// mtrl.format, step, version, dtype, and the caller's key/value pairs (config hash, RNG seed,
// run counters). path != NULL writes a file atomically; else *mem/*mem_len get a malloc'ed buffer.
mtrl_status mtrl_model_save(const mtrl_model *m, const char *path, void **mem, size_t *mem_len, int with_optimizer,
                            const char *const *meta, int n_meta, mtrl_error *err);
// The published weights (no optimizer state) with every matrix (ndim >= 2) as bf16, rounded to
// nearest even, and vectors and QB β as they are: half the bytes of mtrl_model_save for the
// actors. *mem / *mem_len get a malloc'ed buffer. mtrl_model_load widens bf16 matrices back.
mtrl_status mtrl_model_save_bf16(const mtrl_model *m, void **mem, size_t *mem_len, mtrl_error *err);
// Loads what mtrl_model_save wrote into an initialised model of the same dims. Every tensor's
// dtype and shape is checked before any byte is read, so a mismatch (named in the message)
// leaves the model untouched. with_optimizer also restores the moments, the step and version.
struct mtrl_ckpt;
mtrl_status mtrl_model_load(mtrl_model *m, struct mtrl_ckpt *c, int with_optimizer, mtrl_error *err);

// 1 when layer l has the dense FFN (the first first_dense layers), 0 when MoE.
static inline int mtrl_model_is_dense(const mtrl_model_dims *d, int l) { return l < d->first_dense; }
// Index of layer l among the MoE layers, or -1 for a dense layer.
static inline int mtrl_model_moe_index(const mtrl_model_dims *d, int l) {
    return l < d->first_dense ? -1 : l - d->first_dense;
}

// ---- pictures (docs/multimodal.md, common/image.h) ----------------------------------------------------
// Image tokens (ids >= MTRL_IMG_TOKEN_BASE) may stand anywhere in the token arrays of every call
// above (forward, backward, train, logits, prefill, prefill_many, decode): a patch token
// MTRL_IMG_PATCH0 + i is embedded from row i of the patch table set here, the specials from
// their columns of P.patch_w; the rest of the stack is the text's. rows [n][3P²] (RGB8 patches,
// common/image.h mtrl_image_patches) is borrowed: it must stay valid and unchanged until the
// calls that use it returned (a forward and its backward both read it). Tokens name rows of the
// table set when the call runs; a row outside it is a check failure. No log-prob is taken of an
// image token (the position before one has no target: logp 0). NULL, 0: no table.
void mtrl_model_set_patches(mtrl_model *m, const uint8_t *rows, int n);

#endif
