// dist_ep_moe.h: one MoE layer run expert parallel over the ranks of a communicator (issue 27,
// docs/multi-gpu.md). Each rank routes its own tokens, sends every routed row (token x chosen
// expert) to the rank that owns the expert (learner/dist_plan.h: contiguous blocks), runs its own
// experts on the rows it received and sends the outputs back, where they are combined with the
// router's weights and the shared experts, computed locally. The backward runs the same way
// round: output-row gradients to the owners, the experts' backward there (an expert's weight
// gradients exist on its owner only), input-row gradients back, the router's and the shared
// experts' backward locally.
//
// Every phase is the model's own (model/model_moe.h: the routing with the QB bias and routing
// replay, the experts of a range of ids, the combine, their backward), on the model's backend
// kernels, so a token's output on R ranks is the one-rank layer's: each row is computed by the
// same function of the same inputs. An expert's rows reach its owner source-major (rank 0's,
// then rank 1's, ...), each source's in token order; with the ranks holding consecutive slices
// of a batch, that is the one-rank order, and the experts' weight gradients sum the rows in it.
//
// Forward of layer l on rank r (T tokens, x [T][d] the FFN's RMSNorm-ed input):
//     1. route (model_moe.h mtrl_model_moe_route_fwd): the rows grouped by expert
//     2. QB statistics (level > 0): the loads, β sums and batch count of every rank summed with one
//        all-reduce (fp64) and added to every rank's step counters, so mtrl_qb_apply gives the same
//        β on every rank: the mean over the ranks' batches of the β each implies (qb.h; the
//        reference's rule for distributed batches, moe_ref.h qb_beta_from_batch)
//     3. counts: each rank's rows per expert, all-gathered ([ranks][E] int64)
//     4. rows: all-to-all-v (mtrl_dist_a2a_send / _recv), then the received rows put expert-major
//        (mtrl_dist_a2a_expert_order) for the own experts' grouped GEMMs
//     5. the own experts (mtrl_model_moe_experts_fwd on first[r] .. first[r+1]-1)
//     6. outputs back (the reverse all-to-all-v) and the combine with the shared experts
// Collectives per forward: 2 or 3 (all-gather, all-to-all-v twice, the all-reduce with level >
// 0); per backward: 2 all-to-all-v. Every rank calls them, also with T = 0 tokens. A failed
// collective returns its error (the world is then dead, dist_comm.h) and the layer's state is
// undefined: the step stops.
//
// The local backend (ranks as threads, host memory) on a CPU model today: the device path (the
// NCCL backend on device buffers) is not built (docs/multi-gpu.md §3). Each forward allocates
// its buffers from the model's backend (released by the next forward or _free), not from a
// planned arena. The model's training passes inside the learner's step do not call this layer:
// there the ranks run different segments in different orders, which learner/dist_ep_wire.h's
// rounds allow (it says why this layer cannot); both run the same model_moe.h phases.
//
//     mtrl_dist_experts x;  mtrl_dist_experts_make(&x, m->dims.E, ranks, &err);
//     mtrl_dist_ep_moe e;
//     if (mtrl_dist_ep_moe_init(&e, m, layer, &x, comm, &err) != MTRL_OK) ...
//     mtrl_dist_ep_moe_fwd(&e, T, x2, NULL, NULL, level, y, &err);   // x2 kept until the bwd
//     mtrl_dist_ep_moe_bwd(&e, dy, dx2, &err);                        // m->dG += own experts' ...
//     mtrl_dist_ep_moe_free(&e);
#ifndef MTRL_DIST_EP_MOE_H
#define MTRL_DIST_EP_MOE_H

#include <stdint.h>

#include "common/status.h"
#include "learner/dist_comm.h"
#include "learner/dist_plan.h"
#include "model/model.h"
#include "model/model_moe.h"

#define MTRL_DIST_EP_MOE_BLOCKS 40

typedef struct mtrl_dist_ep_moe {
    mtrl_model *m;                // borrowed: this rank's model (its own experts' weights are read)
    mtrl_dist_comm *comm;         // borrowed
    int layer, rank, ranks;
    mtrl_dist_experts experts;    // the assignment
    int e0, e1;                   // this rank's experts: e0 .. e1-1
    // The last forward, kept for its backward.
    int ready;                    // a forward ran and its backward has not
    int T;                        // its tokens
    const real *x;                // borrowed [T][d] input, read again by the backward
    mtrl_model_moe_rows rows;     // its tokens' routing and rows grouped by expert (model_moe.h)
    int64_t *rows_all;            // [ranks][E] every rank's rows per expert
    int64_t send_count[MTRL_DIST_RANKS_MAX], send_offset[MTRL_DIST_RANKS_MAX];
    int64_t recv_count[MTRL_DIST_RANKS_MAX], recv_offset[MTRL_DIST_RANKS_MAX];
    int n_recv;                   // rows received for the own experts
    int *pos;                     // [n_recv] backend: received row i's place in expert-major order
    int *offsets;                 // [e1-e0+1] backend: the own experts' rows in expert-major order
    real *Xe, *u1, *u3;           // [n_recv][d], [n_recv][I] x2: the own experts' rows, activations
    void *blk[MTRL_DIST_EP_MOE_BLOCKS]; // backend blocks of the forward (released by the next, _free)
    int n_blk;
} mtrl_dist_ep_moe;

// Layer `layer` of model m (a CPU model) expert parallel with the assignment x over the ranks of
// comm (this rank: mtrl_dist_comm_rank). MTRL_ERR_USAGE naming the values for a model not on the
// CPU, a dense or missing layer, an assignment of another number of experts than the model's or
// of another number of ranks than comm's (fewer experts than ranks is refused before, by
// mtrl_dist_experts_make). No communication.
mtrl_status mtrl_dist_ep_moe_init(mtrl_dist_ep_moe *e, mtrl_model *m, int layer, const mtrl_dist_experts *x,
                                  mtrl_dist_comm *comm, mtrl_error *err);
void mtrl_dist_ep_moe_free(mtrl_dist_ep_moe *e); // zeroed or freed: no-op

// The forward of this rank's T >= 0 tokens x [T][d] (backend memory, borrowed until the backward
// returns) into y [T][d] (overwritten). routing_in / routing_out (nullable, host, [T][n_moe][K]
// as mtrl_model_forward takes them): a recorded routing replayed (R3; ids checked below E) /
// the routing written back. level: 0 nothing, 1 the routing loads, 2 loads and β
// (mtrl_qb_observe_level, qb.h); every rank must pass the same. Adds the statistics summed over
// the ranks to every rank's model (m->load, m->qb_sum, m->qb_count of the layer). MTRL_ERR_USAGE
// for T < 0 or a replayed id out of range (the other ranks then time out in the exchange), or a
// collective's error.
mtrl_status mtrl_dist_ep_moe_fwd(mtrl_dist_ep_moe *e, int T, const real *x, const uint8_t *routing_in,
                                 uint8_t *routing_out, int level, real *y, mtrl_error *err);

// The backward of the last forward given dy [T][d]: dx [T][d] (overwritten) for this rank's
// tokens; into this rank's m->dG (+=): its own experts' ew1 / ew3 / ew2 rows (the gradient of
// every token routed to them, whichever rank holds it), and its tokens' part of the router's and
// the shared experts' gradients (which the ranks' data-parallel reduction sums). The other
// experts' gradients are not touched. MTRL_ERR_STATE without a forward since the last backward;
// a collective's error.
mtrl_status mtrl_dist_ep_moe_bwd(mtrl_dist_ep_moe *e, const real *dy, real *dx, mtrl_error *err);

#endif
