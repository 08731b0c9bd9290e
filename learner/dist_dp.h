// dist_dp.h: the data-parallel learner step over R ranks (issue 27, docs/multi-gpu.md).
//
// Each rank holds a replica of the model (same dims, same parameters: models initialised with
// one seed, or loaded from one checkpoint) and calls the step with the SAME batch; the step
// makes every replica's parameters equal to what one rank's mtrl_train_rl_step (or
// mtrl_train_sft_step) gives on that batch, up to fp32 summation order:
//   1. the batch's per-token arrays, group advantages and loss denominators over the whole
//      batch, on every rank (learner/train_rank.h); the ranks' own counts, all-reduced, must
//      add up to them (MTRL_ERR_MISMATCH otherwise: the ranks were given different batches);
//   2. the episodes split by tokens (dist_plan.h mtrl_dist_split_make); each rank runs the
//      forward and backward of its own exactly as one rank runs a batch, but with the whole
//      batch's denominators, so the ranks' gradients add up to the one-rank gradient;
//   3. the gradient block reduce-scattered by the ZeRO shard layout (mtrl_dist_shards_make:
//      padded buffers of R x S bytes): rank r gets the sum of bytes [r S, (r+1) S);
//   4. the global gradient norm from the all-reduced squared sums of each rank's pieces, and
//      clipping with it as one rank clips (mtrl_model_clip_scale);
//   5. AdamW on the own shard only (mtrl_model_adamw_range, the element update that
//      mtrl_model_optimizer_step runs), then the updated parameter shards all-gathered;
//   6. the learner's log-probs and entropies of every episode all-reduced (each token is
//      nonzero on one rank only, so the sum is exact), so each rank computes the step's loss and
//      statistics over the whole batch: every rank reports the one-rank values;
//   7. the routing loads and QB's β sums and counts all-reduced before mtrl_qb_apply, so β is
//      the same on every rank. It is the mean over every rank's units (model.h: QB sums one β
//      per forward segment); one rank's β is that of its own units, so with [learner] qb the
//      β after a step equals one rank's only when the units are the same.
//
// State kept per rank: the AdamW moments of its own shard only (m->adam_m, adam_v are whole
// blocks, of which only bytes [r S, (r+1) S) are kept up to date: the rest stays as it was,
// zero from a fresh model), and after the step its shard of the reduced, clipped gradients in
// m->grads (the rest is this rank's own partial gradient); on a GPU, in the device blocks
// (m->d_adam_m, ...; mtrl_model_to_host mirrors them). Checkpoints of such a model are the
// sharded ones (learner/dist_ckpt.h), one file per rank.
//
// Devices: a CPU model takes a communicator of host buffers (the local backend,
// mtrl_dist_comm_init_local); a model on GPU g one of g's memory: the local backend's
// mtrl_dist_comm_init_local_device (ranks as threads of one process, several of them on one GPU
// if need be: how the step is tested on one device) or NCCL (one rank per GPU). On a GPU the
// gradient block, the reduce-scatter and all-gather buffers, the sums of squares and AdamW all
// run on the device (the backend's entries); only the step's host arrays (log-probs, counts,
// loads, QB sums) pass through a small device block. The parameters' host mirror stays as
// mtrl_train_rl_step leaves it on a GPU: call mtrl_model_to_host to read them. With the local
// backend the sums are in rank order on the host, the same bits on every rank; with NCCL in its
// order, the same on every rank of the ring. The gradient reduction is one reduce-scatter after
// the backward (not bucketed, not overlapped with it: docs/multi-gpu.md §3).
//
//     mtrl_dist_dp dp;                           // in rank r's thread, with its own model m
//     if (mtrl_dist_dp_init(&dp, comm, m, &err) != MTRL_OK) ...
//     mtrl_dist_dp_rl_step(&dp, m, cfg, &algo, eps, n, &st, &err);   // eps: the whole batch
//     mtrl_dist_dp_free(&dp);
//
// A collective that fails (a rank that does not arrive within the communicator's timeout)
// makes the step return its error; the replicas are then in an undefined state (some ranks
// may have updated their shard) and the world is dead: stop the run and resume from a
// checkpoint.
#ifndef MTRL_DIST_DP_H
#define MTRL_DIST_DP_H

#include "learner/dist_comm.h"
#include "learner/dist_ep.h"
#include "learner/dist_ep_wire.h"
#include "learner/dist_plan.h"
#include "learner/train.h"

typedef struct mtrl_dist_dp {
    mtrl_dist_comm *comm;     // borrowed
    struct mtrl_backend *be;  // the model's (borrowed: free the step's state before the model)
    int rank, ranks;
    int device_buffers;       // the communicator's buffers are device memory (the model's GPU)
    mtrl_dist_shards shards;  // the ZeRO layout of the model's parameter table
    // In the backend's memory (the GPU's for a GPU model):
    char *send;               // [shards.padded] the gradient block, padded, for the reduce-scatter
    char *gather;             // [shards.padded] the parameter shards, for the all-gather
    float *shard;             // [shard_bytes / 4] the reduced gradients of the own shard
    void *tmp;                // [tmp_bytes] host arrays on their way to a device communicator
    size_t tmp_bytes;
    double *qb;               // [2 L E + L] loads, β sums and batch counts, for the all-reduce (host)
    // Expert parallel (mtrl_dist_dp_init_ep; ep = 0 for mtrl_dist_dp_init): the ownership of
    // learner/dist_ep.h, send / gather / shard then hold its non-expert block (shards unused),
    // and the model's experts run over the ranks through wire.
    int ep;
    mtrl_dist_ep_layout layout;
    mtrl_dist_ep_wire wire;
    char *xbuf;               // the experts gathered onto rank 0 after each step (host)
    int64_t *xcount;          // [4 ranks] the all-to-all-v's counts and offsets
} mtrl_dist_dp;

// The step's state for the rank of comm with model m (a training model, CPU or GPU, and a
// communicator of its memory: see "Devices" above). MTRL_ERR_USAGE naming what is refused.
mtrl_status mtrl_dist_dp_init(mtrl_dist_dp *dp, mtrl_dist_comm *comm, const mtrl_model *m, mtrl_error *err);

// The same step with the routed experts expert parallel (docs/multi-gpu.md §1): rank r owns
// the experts first[r] .. first[r+1]-1 of mtrl_dist_experts_make(E, ranks) in every MoE layer
// and the ZeRO shard of everything else (learner/dist_ep.h's layout). The steps of the DP step
// above change where the experts are concerned:
//   2. each rank's forward and backward route its tokens as one rank does, and every MoE layer's
//      routed rows run on their experts' owners (learner/dist_ep_wire.h, attached to m here;
//      after its passes a rank serves the others' rows until all are done), so an expert's
//      gradient is complete on its owner (every rank's tokens) and zero elsewhere;
//   3. only the non-expert block (the non-expert tensors laid out on their own) is
//      reduce-scattered, in padded buffers of R x its shard;
//   4. the global norm: each rank's squared sums over its own experts and its non-expert shard,
//      all-reduced (every expert counted once, on its owner);
//   5. AdamW on the own experts and the own shard; the non-expert shards all-gathered; the
//      experts gathered onto rank 0 only (one all-to-all-v in which only the sends to rank 0
//      are not empty), so that rank 0's model holds every expert's new weights: what the
//      learner publishes to the actors and writes as the full parameter file. On the other
//      ranks the others' experts keep their old, unread values (only the owner runs an
//      expert), and every rank's moments of the others' experts stay as they were;
//   7. QB: the loads and β sums each rank observed on its own tokens, all-reduced once per
//      step as above: β the same bits on every rank.
// Each rank still holds the whole parameter, gradient and moment blocks (dist_ep_wire.h says
// what holding its own experts alone needs). CPU models on host buffers (the local backend)
// only: MTRL_ERR_USAGE for a GPU model (the device path: docs/multi-gpu.md §3), a dense one, or
// fewer experts than ranks (mtrl_dist_experts_make's message). Free with mtrl_dist_dp_free
// before the model (it detaches the experts from m). Until then every training pass of m
// (mtrl_model_forward, _backward, _train) is collective: called outside the step on one rank,
// its rounds wait for the others and time out (prefill, logits and decode are not affected).
mtrl_status mtrl_dist_dp_init_ep(mtrl_dist_dp *dp, mtrl_dist_comm *comm, mtrl_model *m, mtrl_error *err);
void mtrl_dist_dp_free(mtrl_dist_dp *dp);

// One RL step of the whole batch eps[0..n-1] (the same on every rank), as mtrl_train_rl_step.
// st as mtrl_train_rl_step fills it, the same on every rank but for seconds. The version is
// incremented.
mtrl_status mtrl_dist_dp_rl_step(mtrl_dist_dp *dp, mtrl_model *m, const mtrl_config *cfg, const mtrl_algo_config *a,
                                 mtrl_traj *const *eps, int n, mtrl_step_stats *st, mtrl_error *err);

// One supervised step, as mtrl_train_sft_step: *loss (nullable) the mean NLL before the step.
mtrl_status mtrl_dist_dp_sft_step(mtrl_dist_dp *dp, mtrl_model *m, const mtrl_config *cfg, mtrl_traj *const *eps,
                                  int n, double lr, double *loss, mtrl_error *err);

#endif
