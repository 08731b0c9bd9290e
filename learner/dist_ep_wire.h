// dist_ep_wire.h: the routed experts of a model's training passes run expert parallel over the
// ranks of a communicator (issue 27, docs/multi-gpu.md): the context a CPU model carries
// (model.h mtrl_model_set_experts) during a data-parallel step with expert-parallel ownership
// (learner/dist_dp.h mtrl_dist_dp_init_ep).
//
// Why not mtrl_dist_ep_moe_fwd / _bwd (learner/dist_ep_moe.h) layer by layer: that layer needs
// every rank at the same layer, in the same direction, at once, and its owners keep the
// experts' activations from a forward for the backward that follows. The ranks of a step run
// their own episodes (the token split), so their units, segments and recomputed segments differ
// in number and order: rank 0 may be in the backward of its second unit while rank 1 is still
// in the forward of its first, and a recompute comes between a segment's forward and its
// backward on one rank only. So the exchange here is a sequence of ROUNDS that any mix of
// requests can share:
//
//   each MoE layer of a training forward (recomputes included) or backward on rank r is one
//   round in which r asks the owners of the experts its rows chose to run them; a rank that has
//   finished its passes (mtrl_dist_ep_wire_finish) joins every round with no request, serving
//   the others, until a round in which no rank asks anything: then every rank leaves it.
//
// One round (every rank calls the same three collectives, in every case):
//   1. headers, all-gathered: [kind (0 none, 1 forward, 2 backward), layer, rows per expert [E]]
//   2. the rows to their experts' owners (all-to-all-v, mtrl_dist_a2a_send / _recv): a forward
//      sends its rows X, a backward X and the rows' output gradients dY side by side (a round
//      with any backward in it sends rows of 2d for everyone)
//   3. each owner runs, source by source, its own experts (model_moe.h phases on its block of
//      ew1 / ew3 / ew2) on what it received: a forward's outputs Y; a backward's dX, after
//      computing the experts' activations again from X (so an owner keeps nothing between rounds,
//      and a backward may meet the forwards of other ranks' other segments), with the experts'
//      weight gradients added to the OWNER's m->dG;
//   4. the results back (the reverse all-to-all-v), into the asker's Y or dX.
// The router, the routing replay (R3), the QB statistics, the combine and the shared experts
// stay on the asker (the model's own phases, model_moe.h): routing and loads are exactly one
// rank's. The cost: a backward sends X again and recomputes the experts' activations (the
// forward's compute once more for the experts), and a rank idle at the end of a step serves the
// others' rounds; 1 + 2 collectives a round.
//
// An expert's weight gradient sums the rows of every rank (source by source, each source's rows
// in its order), so it is complete on its owner after finish and zero elsewhere: the step then
// reduces only the non-expert block (learner/dist_ep.h's layout). The sums are in another order
// than one rank's: equal within fp32 rounding.
//
// Errors: a collective that fails (a peer past the communicator's timeout, a mismatch) kills the
// world (dist_comm.h); the context keeps the first error, every later round returns at once with
// zero outputs, and finish returns it: the step stops. CPU models on host buffers (the local
// backend) only; GPU models are refused (mtrl_model_set_experts, and the device path: §3).
//
//     mtrl_dist_ep_wire w;                      // in rank r's thread, model m, world comm
//     if (mtrl_dist_ep_wire_init(&w, m, &experts, comm, &err) != MTRL_OK) ...   // attaches to m
//     mtrl_model_train(m, ...);                 // each MoE layer: one round
//     if (mtrl_dist_ep_wire_finish(&w, &err) != MTRL_OK) ... // serves until every rank is done
//     mtrl_dist_ep_wire_free(&w);               // detaches
#ifndef MTRL_DIST_EP_WIRE_H
#define MTRL_DIST_EP_WIRE_H

#include <stdint.h>

#include "common/status.h"
#include "learner/dist_comm.h"
#include "learner/dist_plan.h"
#include "model/model.h"

typedef struct mtrl_dist_ep_wire {
    mtrl_model *m;                 // borrowed: this rank's model (its own experts' weights read)
    mtrl_dist_comm *comm;          // borrowed
    int rank, ranks, E;
    mtrl_dist_experts experts;     // the assignment
    int e0, e1;                    // this rank's experts: e0 .. e1-1
    mtrl_model_experts_fn fn;      // what m calls (model.h)
    mtrl_status status;            // the first failure (MTRL_OK: none)
    mtrl_error err;
    long rounds, asked, served;    // since init: rounds joined, rounds with a request of this
                                   // rank's, rows this rank's experts ran (forward + backward)
    // Host buffers of a round, grown as needed.
    int64_t *hdr, *hdr_all;        // [2 + E], [ranks][2 + E]
    int64_t *rows_all;             // [ranks][E]
    real *send, *recv, *out;       // rows in the round's width (send, recv), of d (out)
    real *rx, *rdy;                // the received X and dY apart, [rows][d] each
    real *u1, *u3, *y;             // an owner's recomputed activations and outputs
    size_t send_cap, recv_cap, out_cap, rx_cap, rdy_cap, act_cap;
} mtrl_dist_ep_wire;

// The context of model m (a CPU training model with MoE layers) on the rank of comm, with the
// assignment x (mtrl_dist_experts_make over comm's ranks and m's experts), attached to m
// (mtrl_model_set_experts). MTRL_ERR_USAGE naming the values for another number of experts or
// ranks than m's and comm's, more than 256 experts, a communicator of device buffers, and what
// mtrl_model_set_experts refuses (a GPU model among them). No communication.
mtrl_status mtrl_dist_ep_wire_init(mtrl_dist_ep_wire *w, mtrl_model *m, const mtrl_dist_experts *x,
                                   mtrl_dist_comm *comm, mtrl_error *err);
// Detaches from the model and frees; zeroed or freed: no-op.
void mtrl_dist_ep_wire_free(mtrl_dist_ep_wire *w);

// Joins rounds with no request, serving the others' rows, until a round in which no rank asks
// anything (every rank has called finish): call it on every rank after its own passes of a
// step, before any other collective. Returns the first failure of the rounds since the last
// finish (the model's passes cannot return one), or MTRL_OK.
mtrl_status mtrl_dist_ep_wire_finish(mtrl_dist_ep_wire *w, mtrl_error *err);

// Memory (not built): every rank still holds all E experts' weights (and gradients, moments),
// reading only its own. Holding its own alone means a model whose routed-expert tensors are
// [e1 - e0][...] on rank r (the table's expert tensors cut by learner/dist_ep.h's held pieces),
// model_moe.h's experts phases indexing them from e0, and the checkpoints written from those
// pieces (dist_ckpt.h already writes owned pieces): docs/multi-gpu.md §3.

#endif
