// dist_ep.h: who owns which parameters when the routed experts are expert parallel (issue 27,
// docs/multi-gpu.md).
//
// The ZeRO layout of learner/dist_plan.h cuts the whole parameter block into equal byte ranges,
// so an expert's weights may be updated by a rank that never runs it. Here rank r OWNS (holds the
// parameters, gradients and both AdamW moments of) the routed-expert tensors of its experts,
// which are the only ranks that compute their gradients, and every other tensor (embeddings,
// attention, norms, router, shared experts, lm_head) is ZeRO-sharded over all ranks as
// mtrl_dist_shards_make shards a table: the non-expert tensors form a compact block of their own
// (the reduce-scatter and all-gather buffers of the data-parallel part) cut into equal ranges.
// A pure function of the table and the expert assignment, tested on the CPU.
//
//     mtrl_dist_ep_layout l;
//     if (mtrl_dist_ep_layout_make(&l, &t, &experts, MTRL_DIST_SHARD_ALIGN, &err) != MTRL_OK) ...
//     for (int j = 0; j < l.rank[r].n_piece; j++) ... l.piece[l.rank[r].first_piece + j] is r's
//     mtrl_dist_ep_layout_free(&l);
#ifndef MTRL_DIST_EP_H
#define MTRL_DIST_EP_H

#include <stddef.h>
#include <stdio.h>

#include "common/status.h"
#include "common/tensor.h"
#include "learner/dist_plan.h"

typedef struct mtrl_dist_ep_rank {
    // Owned pieces: piece[first_piece .. first_piece + n_piece - 1], its expert pieces first (one
    // per routed-expert tensor, in table order: its contiguous block of experts is one element
    // range), then its pieces of the non-expert shard.
    int first_piece, n_piece, n_expert_piece;
    size_t expert_bytes;    // bytes of its experts' rows of every routed-expert tensor
    size_t shard_bytes;     // bytes of tensors in its non-expert shard (padding left out)
    // What the forward needs in full on this rank: every non-expert tensor whole (gathered) plus
    // its own experts: held[first_held .. first_held + n_held - 1].
    int first_held, n_held;
    size_t held_bytes;      // dense_bytes + expert_bytes
} mtrl_dist_ep_rank;

typedef struct mtrl_dist_ep_layout {
    int ranks;
    mtrl_dist_experts experts;   // the assignment it was made with
    size_t expert_total;         // bytes of all routed-expert tensors
    size_t dense_bytes;          // bytes of all other tensors
    // The ZeRO layout of the non-expert block (the non-expert tensors in table order, laid out
    // by mtrl_tt_layout on their own): its byte ranges are of that block, its pieces' tensor
    // indices are t's.
    mtrl_dist_shards dense;
    size_t *dense_offset;        // [t->n] tensor i's byte offset in the non-expert block
                                 // (SIZE_MAX for a routed-expert tensor)
    mtrl_dist_ep_rank rank[MTRL_DIST_RANKS_MAX];
    mtrl_dist_piece *piece;      // owned pieces, rank by rank
    int n_piece;
    mtrl_dist_piece *held;       // held pieces, rank by rank
    int n_held;
} mtrl_dist_ep_layout;

// The layout of table t (laid out) with the experts of x (mtrl_dist_experts_make: contiguous
// blocks, E % ranks != 0 giving the first ranks one more) and the non-expert part sharded with
// `align` (as mtrl_dist_shards_make takes it). A routed-expert tensor is one
// mtrl_model_param_is_routed_expert names; its first dimension must be x->E. E = 0 (a dense
// model): no expert tensor, everything sharded. MTRL_ERR_USAGE naming the tensor for an expert
// tensor whose first dimension is not E, and the errors of mtrl_dist_shards_make for the
// non-expert block (a table of experts alone is refused as an empty table).
mtrl_status mtrl_dist_ep_layout_make(mtrl_dist_ep_layout *l, const mtrl_tt *t, const mtrl_dist_experts *x, size_t align,
                                     mtrl_error *err);
void mtrl_dist_ep_layout_free(mtrl_dist_ep_layout *l);

// Two lines of `mtrl plan`: per rank, the bytes it owns (experts + non-expert shard; the
// gradient and each AdamW moment the same) and the bytes it holds in full for the forward.
void mtrl_dist_ep_print(const mtrl_dist_ep_layout *l, FILE *f);

#endif
