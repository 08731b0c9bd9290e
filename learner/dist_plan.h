// dist_plan.h: how a learner step is partitioned over R ranks (issue 27, docs/multi-gpu.md).
//
// Pure functions of sizes and counts, with no device and no communication, so that every rank
// computes the same partition from the same inputs and the CPU tests can check it:
//   split    the batch's episodes over the ranks, balanced by tokens (data parallel); each
//            rank's episodes, in batch order, are cut into units by the single-rank packer
//            (model.h mtrl_model_pack_units), so a rank runs its share as one GPU runs a batch
//   experts  the E routed experts of every MoE layer over the ranks in contiguous blocks
//            (expert parallel), and the all-to-all counts and offsets of one exchange
//   shards   the ZeRO-1/2 layout of the flat parameter block (common/tensor.h): each rank owns a
//            contiguous, aligned byte range of the block and of the gradient and both AdamW
//            moment blocks of the same layout; the pieces of tensors it updates
// The sharded checkpoint built on the shard layout is learner/dist_ckpt.h.
//
//     mtrl_dist_split s;
//     if (mtrl_dist_split_make(&s, n, len, ranks, segment, &err) != MTRL_OK) ...
//     for (int j = s.first[r]; j < s.first[r + 1]; j++) ... episode s.order[j] runs on rank r
//     mtrl_dist_split_free(&s);
#ifndef MTRL_DIST_PLAN_H
#define MTRL_DIST_PLAN_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/status.h"
#include "common/tensor.h"

// The most ranks a plan takes ([learner] gpus lists at most MTRL_CFG_GPUS_MAX).
#define MTRL_DIST_RANKS_MAX 64
// Shard boundaries are multiples of this many bytes: every element of every dtype stays whole,
// and each rank's slice of a reduce-scatter or all-gather buffer starts where cudaMalloc's
// alignment would put a buffer of its own.
#define MTRL_DIST_SHARD_ALIGN 256

// ---- token split (data parallel) ----------------------------------------------------------------

typedef struct mtrl_dist_rank_batch {
    int n_seq;        // episodes on this rank
    long tokens;      // their tokens
    int longest;      // the longest of them (0: none)
    int units;        // units mtrl_model_pack_units cuts them into with the split's segment
} mtrl_dist_rank_batch;

typedef struct mtrl_dist_split {
    int ranks, n;
    int segment;                 // the segment the units were counted with (0: MTRL_PACK_TOKENS)
    int *rank_of;                // [n] the rank of episode i
    int *order;                  // [n] the episodes grouped by rank, each rank's in batch order
    int first[MTRL_DIST_RANKS_MAX + 1]; // rank r's episodes: order[first[r] .. first[r+1]-1]
    mtrl_dist_rank_batch rank[MTRL_DIST_RANKS_MAX];
    long total;                  // Σ tokens
    long max_tokens;             // the busiest rank's tokens
    long bound;                  // what the split guarantees: max_tokens <= bound (below)
    double imbalance;            // max_tokens / (total / ranks) - 1: 0 is a perfect split
} mtrl_dist_split;

// Splits n episodes of len[i] >= 1 tokens over `ranks` ranks (1 .. MTRL_DIST_RANKS_MAX),
// longest first onto the rank with the fewest tokens so far (ties: the lower rank; equal
// lengths: the earlier episode), then counts each rank's units with `segment` (what
// mtrl_model_segment_resolve gives; 0: whole sequences). Deterministic. The guarantee (the
// list-scheduling bound): max_tokens <= max(longest, total / ranks + (1 - 1/ranks) * l_R), l_R
// the (ranks+1)-th longest length (0 when n <= ranks); an episode longer than the others
// together makes its rank the busiest, which only cutting it across ranks would avoid. A rank
// may get no episode (n < ranks): it still takes part in the gradient reduction. MTRL_ERR_USAGE
// naming the input for ranks out of range, n < 0 or an episode of no tokens.
mtrl_status mtrl_dist_split_make(mtrl_dist_split *s, int n, const int *len, int ranks, int segment, mtrl_error *err);
void mtrl_dist_split_free(mtrl_dist_split *s);

// ---- expert assignment and all-to-all counts (expert parallel) ---------------------------------

typedef struct mtrl_dist_experts {
    int E, ranks;
    int first[MTRL_DIST_RANKS_MAX + 1]; // rank r owns experts first[r] .. first[r+1]-1
} mtrl_dist_experts;

// E experts over `ranks` ranks in contiguous blocks: E / ranks each, the first E % ranks ranks
// one more (so E % ranks != 0 is taken, and the plan shows the uneven blocks). MTRL_ERR_USAGE
// naming both numbers when E < ranks (a rank would hold no expert: expert parallel over fewer
// ranks is the way) or ranks is out of range. E = 0 (a dense model): every block empty.
mtrl_status mtrl_dist_experts_make(mtrl_dist_experts *x, int E, int ranks, mtrl_error *err);
// The rank that owns expert e.
int mtrl_dist_expert_rank(const mtrl_dist_experts *x, int e);

// One exchange of a MoE layer: every rank has rows (token x chosen expert) sorted by expert, as
// the grouped expert GEMMs take them; rows[e] is how many go to expert e. The counts travel
// first (each rank's rows[E], gathered into rows_all[ranks][E]), then the rows.
// The send side of rank `me`: count[r] rows to rank r, from offset[r] of its sorted rows (the
// experts of a rank are contiguous, so are its rows).
void mtrl_dist_a2a_send(const mtrl_dist_experts *x, const int64_t *rows, int64_t *count, int64_t *offset);
// The receive side of rank `me`: count[r] rows from rank r land at offset[r] (source-major:
// rank 0's rows for my experts, then rank 1's, ...); expert_rows[j] (nullable, [x->first[me+1] -
// x->first[me]]) is how many rows its j-th own expert gets in all.
void mtrl_dist_a2a_recv(const mtrl_dist_experts *x, int me, const int64_t *rows_all, int64_t *count, int64_t *offset,
                        int64_t *expert_rows);
// Where received row i goes in expert-major order (every source's rows of my first expert, then
// my second, ...: what the grouped GEMMs take): pos[i], i < Σ count. Gathering out[pos[i]] =
// in[i] groups them; out[i] = in[pos[i]] undoes it before the reverse exchange.
void mtrl_dist_a2a_expert_order(const mtrl_dist_experts *x, int me, const int64_t *rows_all, int64_t *pos);

// ---- ZeRO shard layout of the parameter block --------------------------------------------------

typedef struct mtrl_dist_piece {
    int tensor;             // index in the table
    size_t begin, end;      // elements of the tensor, [begin, end)
} mtrl_dist_piece;

typedef struct mtrl_dist_shard {
    size_t begin, end;      // bytes of the block this rank owns, [begin, end); end may pass the
                            // block's total on the last ranks (their padding)
    int first_piece, n_piece; // its pieces: piece[first_piece .. first_piece + n_piece - 1]
    size_t used;            // bytes of tensors in it; the rest is alignment padding
} mtrl_dist_shard;

typedef struct mtrl_dist_shards {
    int ranks;
    size_t align;           // boundaries are multiples of it
    size_t total;           // the table's block bytes (t->total)
    size_t shard_bytes;     // bytes every rank owns: total / ranks rounded up to align
    size_t padded;          // ranks x shard_bytes: the reduce-scatter buffers' size
    mtrl_dist_shard rank[MTRL_DIST_RANKS_MAX];
    mtrl_dist_piece *piece; // [n_piece] in block order, rank by rank
    int n_piece;
} mtrl_dist_shards;

// The layout of table t (laid out: mtrl_tt_layout) over `ranks` ranks: rank r owns bytes
// [r x shard_bytes, (r+1) x shard_bytes) of the parameter, gradient and moment blocks, updates
// the tensor elements that fall there (a tensor may be cut between ranks, never an element), and
// gathers the rest. The padding: the table's own (64-byte tensor alignment) inside the ranges,
// and padded - total bytes past the block on the last ranks. MTRL_ERR_USAGE naming the input
// for ranks out of range, an align that is 0 or not a multiple of every dtype's size, or an
// empty table.
mtrl_status mtrl_dist_shards_make(mtrl_dist_shards *s, const mtrl_tt *t, int ranks, size_t align, mtrl_error *err);
void mtrl_dist_shards_free(mtrl_dist_shards *s);

// ---- the printed plan (`mtrl plan` with several [learner] gpus) --------------------------------

// One line per rank: episodes, tokens, units, the experts it owns, the bytes of its shard of
// the moments (what ZeRO-1 keeps per rank) and of the parameters and gradients; then the
// imbalance and the padding. x and sh nullable (not printed).
void mtrl_dist_plan_print(const mtrl_dist_split *s, const mtrl_dist_experts *x, const mtrl_dist_shards *sh,
                          const int *gpus, FILE *f);

#endif
