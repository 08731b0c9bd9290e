// model_plan.h: the memory planner of the learner step (issue "million-token episodes").
//
// A learner step runs mtrl_model_forward and mtrl_model_backward over a batch of sequences with
// a segment length S (model.h, form 3): activations are O(S), the whole-episode state is the
// boundary states of every segment and the MLA latents. The planner counts, for given dims,
// sequence lengths, device and memory budget, every block the code allocates for that step and
// picks the largest S that fits. The per-segment and per-batch blocks are not estimated: they come
// from the functions the model sizes its own allocations with (seg_arena_bytes, ws_sizes_for in
// model_ws.h), so the plan and the allocation cannot drift apart. The scratch of the CUDA
// backend and kernels (grow-only buffers: the bf16 copies of queries and dout for the
// attention, and of the latents when they are stored fp32, the KDA and MoE backward workspaces) mirrors backend_cuda.c and kernels/cuda/*.cu,
// with their growth factors.
//
// What is counted (bytes; fp32 model: 4 per value, except the MLA latents: the backend's latent
// element size, backend.h mtrl_backend_latent_size: 2 (bf16) on a GPU unless [kernels] latent = fp32 (dims.kern);
// their gradients stay `real`):
//   model        parameters, gradients, both AdamW moments (4 x the parameter block), QB β;
//                with bf16 GEMM operands ([kernels] gemm = bf16, backend.h) the weights' bf16 copy
//   episode      boundary KDA states and conv windows of every segment of every sequence, the
//                MLA latents of every sequence (state arena of the forward), and in the backward
//                ∂L/∂latents of the longest sequence with the running dS / dconv / S / conv
//   activations  the activation arena: one segment's forward caches plus its backward
//                temporaries (or, segment 0 under MTRL_KEEP_BYTES_MAX, every sequence's caches)
//   scratch      CUDA: the backend's and the kernels' grow-only scratch; CPU: the largest
//                temporary the reference kernels allocate (an estimate)
//   runtime      CUDA: cuBLAS workspace, loaded kernel images, allocation rounding (a constant,
//                MTRL_PLAN_CUDA_RUNTIME)
//   host         CUDA: the host mirrors of the four parameter blocks; any device: the per-token
//                arrays of the trajectories and the learner step (token ids, log-probs,
//                advantages, masks, routing), estimated from learner/train.c and common/traj.h
// On the CPU everything is host memory and the host lines count against the budget; on a GPU
// only the device lines do. The plan fits when total + margin <= budget, margin = 5% of the
// budget.
//
// Checked against reality: on the CPU the activation arena's measured peak equals the plan to
// the arena's alignment (tests/test_model_plan.c); on an H200 the backend's high-water mark of a
// 64K and a 1M-token step was 1.000 and 0.999 of the plan without the runtime reserve
// (tests/test_cuda_long.c).
//
// Segment lengths are multiples of 64 (whole KDA tiles of 16 and whole 64-token super-chunks,
// docs/model.md §2.6; the code itself takes any length), or the whole sequence when it fits.
//
//     mtrl_model_plan p;
//     if (mtrl_model_plan_uniform(&p, &dims, MTRL_DEVICE_CUDA, 1 << 20, 1, budget, &err) != MTRL_OK) ...
//     mtrl_model_forward(m, batch, p.segment, ...);
//     mtrl_model_plan_print(&p, stdout);
#ifndef MTRL_MODEL_PLAN_H
#define MTRL_MODEL_PLAN_H

#include <stddef.h>
#include <stdio.h>

#include "model/model.h"
#include "common/status.h"

#define MTRL_PLAN_SEGMENT_STEP 64          // segment lengths are multiples of this
// The longest segment the planner offers beyond the batch's longest sequence: a segment is also
// the most tokens of short sequences packed into one unit of mtrl_model_train (model.h), and past
// a few tens of thousands of rows the GEMMs gain nothing while the arena keeps growing.
#define MTRL_PLAN_PACK_MAX 65536
// Device memory a CUDA model uses outside its backend's blocks and scratch: cuBLAS workspaces
// (the context's, and 7 x 32 MiB for the GEMM lanes of the MoE experts, cuda_common.cuh), kernel
// images loaded on first launch, allocation rounding. Reserved with room to spare over what an
// H200 measured (docs/perf.md, "Measurements moved out of code comments").
#define MTRL_PLAN_CUDA_RUNTIME ((size_t)384 << 20)

typedef struct mtrl_model_plan {
    // the request
    int device;              // MTRL_DEVICE_*
    int seqs;                // sequences in the batch
    long tokens;             // the longest sequence
    size_t total_tokens;     // Σ tokens over the batch
    size_t budget;           // bytes available (0: evaluated without a budget)
    // the answer
    int segment;             // S for mtrl_model_forward (the whole sequence when it fits)
    int n_seg;               // segments of the longest sequence
    int keep;                // eval with segment 0: the activations are kept (no recompute);
                             // make: segment 0 would keep them AND fit the budget (then 0 is the
                             // faster choice, with no more memory than the plan)
    // device bytes (host bytes on the CPU)
    size_t params;           // parameter block
    size_t grads;            // gradient block
    size_t adam;             // both AdamW moments
    size_t weights_bf16;     // CUDA with bf16 GEMM operands ([kernels] gemm = bf16): the bf16 copy of
                             // the parameter block (2 bytes a parameter); 0 otherwise
    size_t qb;               // QB β and the backend's small constants
    size_t boundary;         // KDA states and conv windows entering every segment, running state
    size_t latents;          // MLA latents of every sequence
    size_t latent_grads;     // backward: ∂L/∂latents of the longest sequence, dS, dconv, S, conv
    size_t activations;      // activation arena
    size_t scratch;          // grow-only scratch (CUDA), reference temporaries (CPU)
    size_t runtime;          // CUDA runtime reserve (MTRL_PLAN_CUDA_RUNTIME), 0 on the CPU
    size_t host_mirrors;     // CUDA: host copies of parameters, gradients and moments
    size_t host_episode;     // per-token host arrays (trajectories and the learner step)
    size_t total;            // what counts against the budget (device lines; all lines on the CPU)
    size_t host_total;       // host bytes (CUDA: mirrors + episode arrays; CPU: = total)
    size_t margin;           // 5% of the budget
} mtrl_model_plan;

// The bytes of one learner step (forward + backward of the batch) with this segment: S > 0, or
// 0 as mtrl_model_forward takes 0 (one segment per sequence, activations kept when they fit in
// MTRL_KEEP_BYTES_MAX). len: n sequence lengths (>= 1). budget is recorded, not checked.
void mtrl_model_plan_eval(mtrl_model_plan *p, const mtrl_model_dims *d, int device, int n, const int *len, int segment,
                          size_t budget);

// Chooses the segment: the largest multiple of MTRL_PLAN_SEGMENT_STEP (or the whole longest
// sequence; for a batch of several sequences up to the batch's tokens, at most
// MTRL_PLAN_PACK_MAX, so that short sequences pack into large units) whose plan fits in budget
// minus the margin, and fills p with that plan; p->keep says
// whether segment 0 (every activation kept, no recompute) fits as well. When nothing
// fits: MTRL_ERR_NOMEM with a message giving the least any segment needs, at which segment, and
// the budget (p then holds the plan of that least segment).
mtrl_status mtrl_model_plan_make(mtrl_model_plan *p, const mtrl_model_dims *d, int device, int n, const int *len,
                                 size_t budget, mtrl_error *err);
// The same for `seqs` sequences of `tokens` tokens each.
mtrl_status mtrl_model_plan_uniform(mtrl_model_plan *p, const mtrl_model_dims *d, int device, long tokens, int seqs,
                                    size_t budget, mtrl_error *err);

// Free and total bytes of a device: the host's MemAvailable and MemTotal (MTRL_DEVICE_CPU) or
// cudaMemGetInfo of GPU `gpu` through a CUDA backend created for the call (MTRL_DEVICE_CUDA;
// MTRL_ERR_USAGE with the reason when this build or machine has none).
mtrl_status mtrl_model_device_memory(int device, int gpu, size_t *free_bytes, size_t *total_bytes, mtrl_error *err);

// The memory of a live model's device (backend.h mem_info): free and total bytes of the device,
// the grow-only scratch its backend holds, and the high-water mark of everything the backend has
// held (allocations + scratch; 0 on the CPU, which does not count). Pointers nullable.
void mtrl_model_mem_info(const mtrl_model *m, size_t *free_bytes, size_t *total_bytes, size_t *scratch_bytes,
                         size_t *peak_bytes);

// The plan for a live model and the batch it is about to train on (the learner). The budget is
// the device's free memory plus what the model already holds that the plan counts again:
// parameter, gradient and moment blocks, β, the batch workspace of its last forward (freed by
// the next one) and the grow-only scratch.
mtrl_status mtrl_model_plan_batch(mtrl_model_plan *p, const mtrl_model *m, const mtrl_batch *b, mtrl_error *err);

// The segment length the learner's form of the model runs batch b with on m: the one resolver
// of [learner] segment, for the learner's steps, `mtrl bench` and replay's scoring (which must
// score as an RL step does). setting: mtrl_config_segment's value (N, or MTRL_CFG_SEGMENT_AUTO).
// N gives N; auto gives the planner's choice for this batch (mtrl_model_plan_batch: the largest
// multiple of MTRL_PLAN_SEGMENT_STEP that fits the device's free memory, which is also how many
// tokens of short sequences one unit of mtrl_model_train packs; 0, whole sequences, when the
// longest fits as one), and its plan into `plan` (nullable; untouched for N). The result is what
// mtrl_model_forward, _train and _logits take. MTRL_ERR_NOMEM (auto, nothing fits) with the
// planner's message; MTRL_ERR_USAGE for a setting that is neither.
mtrl_status mtrl_model_segment_resolve(const mtrl_model *m, const mtrl_batch *b, long setting, int *segment,
                                       mtrl_model_plan *plan, mtrl_error *err);

// A human-readable table (GiB with two decimals), one line per block.
void mtrl_model_plan_print(const mtrl_model_plan *p, FILE *f);

#endif
