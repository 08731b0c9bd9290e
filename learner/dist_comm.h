// dist_comm.h: the collectives of a learner spread over R ranks (issue 27, docs/multi-gpu.md).
//
// One handle per rank; every rank of a world calls the same collectives in the same order with
// the same sizes. Two backends behind one API:
//   local  the R ranks are R threads of one process (mtrl_dist_world below); buffers are host
//          memory, or a GPU's memory for a rank made by mtrl_dist_comm_init_local_device (then
//          staged through host memory). Reductions add the ranks' values in rank order
//          (((r0 + r1) + r2) ...) on the host, so every rank gets the same bits, a run gets them
//          again, and device buffers get the bits host buffers get: what the CPU tests compare,
//          what lets a CPU learner run data parallel on threads, and what runs the GPU step of
//          several ranks on ONE GPU (ranks as threads, a model replica each).
//   nccl   one rank per GPU (learner/dist_comm_nccl.c, only with MTRL_HAVE_NCCL); buffers are
//          device memory of the rank's GPU, and the work runs on the caller's stream. Sums in
//          NCCL's order (the same on every rank of a ring, not rank order).
//   zmq    one process per rank, on one host or several, over ZeroMQ TCP (below); host buffers;
//          sums in rank order through rank 0 (the local backend's bits).
//
// No silent hang: every call waits at most the world's timeout_ms for its peers (each barrier
// inside a collective gets the whole timeout). A rank that does not arrive makes the others
// return MTRL_ERR_TIMEOUT with a message naming the op, the waiting rank, the timeout and the
// ranks missing (local, zmq; NCCL cannot tell who). A world whose call failed (timeout, ranks that
// called different collectives or sizes: MTRL_ERR_MISMATCH) is dead: every later call on any
// of its ranks returns MTRL_ERR_STATE with the first failure's message. The caller then stops
// the step (and the run); nothing recovers a world.
//
//     mtrl_dist_world *w;                       // local: once, before the rank threads
//     mtrl_dist_world_init(&w, R, 2000, &err);
//     ... in thread r:
//     mtrl_dist_comm *c;
//     mtrl_dist_comm_init_local(&c, w, r, &err);
//     if (mtrl_dist_comm_allreduce(c, buf, n, MTRL_DT_F32, &err) != MTRL_OK) ... stop
//     mtrl_dist_comm_free(c);
//     ... after joining the threads:
//     mtrl_dist_world_free(w);
#ifndef MTRL_DIST_COMM_H
#define MTRL_DIST_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "common/tensor.h"

typedef struct mtrl_dist_comm mtrl_dist_comm;   // one rank's handle (opaque)
typedef struct mtrl_dist_world mtrl_dist_world; // the local backend's shared state (opaque)

// ---- local backend (threads of one process) ----------------------------------------------------

// A world of `ranks` ranks (1 .. MTRL_DIST_RANKS_MAX) whose calls wait at most timeout_ms
// (> 0) for the other ranks. MTRL_ERR_USAGE naming the value otherwise. Free it after every
// rank's handle is freed.
mtrl_status mtrl_dist_world_init(mtrl_dist_world **w, int ranks, int timeout_ms, mtrl_error *err);
void mtrl_dist_world_free(mtrl_dist_world *w); // NULL: no-op
// Rank `rank`'s handle of w (one per rank, from the thread that runs it). MTRL_ERR_USAGE for a
// rank out of range or taken twice.
mtrl_status mtrl_dist_comm_init_local(mtrl_dist_comm **c, mtrl_dist_world *w, int rank, mtrl_error *err);

// Rank `rank`'s handle of w whose buffers are device memory of CUDA device `gpu` (every buffer
// of every call; the rank's model lives there). Each call copies the rank's inputs into host
// memory of the handle, meets the others as a host rank does (the peers read those copies), and
// copies its results back into the device buffers: copies on `stream` (a cudaStream_t; NULL:
// the legacy default stream), each waited for, so the call returns with its results in the
// buffers. The caller makes the inputs ready first (the device work writing them, on whatever
// stream, finished: e.g. the model's backend synchronised). Ranks of one world may mix host and
// device handles. A copy that fails fails the world (every rank's call returns an error, then
// MTRL_ERR_STATE). MTRL_ERR_USAGE as mtrl_dist_comm_init_local, for a GPU that does not exist,
// and in a build without CUDA. The copies through host memory cost what NCCL avoids: this is
// for testing the GPU step on one device, not for speed.
mtrl_status mtrl_dist_comm_init_local_device(mtrl_dist_comm **c, mtrl_dist_world *w, int rank, int gpu, void *stream,
                                             mtrl_error *err);

// ---- nccl backend (one process or thread per GPU) ----------------------------------------------

// How the unique id of rank 0 reaches the others. Rank 0 calls it with the id to publish, the
// others with a buffer to fill; it returns MTRL_OK, or an error with a message (timeout_ms: how
// long the others may wait for it).
typedef mtrl_status (*mtrl_dist_bootstrap_fn)(void *user, int rank, int ranks, void *id, size_t id_bytes,
                                              int timeout_ms, mtrl_error *err);
// The bootstrap of one host through a file: user is its path (a const char *), which must not
// exist when the world starts (one fresh path per world, e.g. in the run directory): rank 0
// writes the id to a temporary name and links it into place, refusing (MTRL_ERR_STATE) a path
// that exists; the others poll for it until the timeout (MTRL_ERR_TIMEOUT naming the path).
// The caller removes the file after every rank's init returned.
mtrl_status mtrl_dist_bootstrap_file(void *user, int rank, int ranks, void *id, size_t id_bytes, int timeout_ms,
                                     mtrl_error *err);
// Rank `rank` of `ranks` on CUDA device `gpu`, its collectives on `stream` (a cudaStream_t;
// NULL: the legacy default stream). The communicator is created non-blocking
// (ncclCommInitRankConfig, blocking = 0) and every call polls ncclCommGetAsyncError and the
// stream until done or the deadline, then aborts the communicator (ncclCommAbort) and returns
// MTRL_ERR_TIMEOUT; an NCCL or CUDA error is MTRL_ERR_PEER with NCCL's message. So each call
// returns once its result is in the buffers (the stream has completed it). Sets
// NCCL_NVLS_ENABLE=0 when the environment leaves it unset. MTRL_ERR_USAGE in a build without
// NCCL.
mtrl_status mtrl_dist_comm_init_nccl(mtrl_dist_comm **c, int ranks, int rank, int gpu, void *stream, int timeout_ms,
                                     mtrl_dist_bootstrap_fn boot, void *boot_user, mtrl_error *err);

// ---- zmq backend (ranks as processes, on one host or several) ----------------------------------
//
// Ranks are separate processes joined over ZeroMQ TCP (learner/dist_comm_zmq.c); buffers are
// host memory (a device buffer is refused, MTRL_ERR_USAGE, in a CUDA build: this backend is for
// CPU models; GPUs use NCCL). Every collective is a star through rank 0: each rank sends rank 0
// a header (op, call number, sizes, its rank) and its data; rank 0 checks that every header
// matches its own (else MTRL_ERR_MISMATCH naming both calls, on every rank), combines IN RANK
// ORDER (the local backend's sums, to the bit) and sends each rank its result. Data travels in
// frames of at most MTRL_DIST_ZMQ_FRAME bytes (a larger frame disconnects its sender), so
// buffers of any size pass. Rank 0 keeps a copy of every other rank's input of the call in
// progress (grow-only): (ranks - 1) x the largest buffer.
//
// Timeouts: rank 0 waits at most timeout_ms with nothing arriving from the ranks it still waits
// for (data that keeps flowing does not time out), then fails with MTRL_ERR_TIMEOUT naming the
// ranks missing and tells every other rank (which returns the same code and message). The
// others wait for rank 0's answer at most 2 x timeout_ms + 100 ms without a frame (longer
// than rank 0, so its verdict, which names the missing rank, arrives first even when rank 0
// entered the call up to timeout_ms later), then fail with
// MTRL_ERR_TIMEOUT naming rank 0's address, and tell rank 0. A rank whose process died is a
// rank that does not arrive. A failed world refuses every later call (MTRL_ERR_STATE).
//
// Joining: rank 0 binds a ROUTER at tcp://IP:port (rv->host resolved to IPv4; it must be this
// node's address), the others connect a DEALER (common/wire sockets: bounded linger, frame
// cap, heartbeats, CURVE from rv->opts) and say who they are; init returns once all ranks
// joined: rank 0 waits join_timeout_ms (processes start at their own pace, so this is not
// the calls' timeout), then fails with MTRL_ERR_TIMEOUT naming the ranks that did not join and
// any requests refused; the others wait 2 x join_timeout_ms + 100 ms for rank 0's welcome. Rank 0 refuses, and answers when it can, a message
// that is not this protocol's, another version, world size (MTRL_ERR_MISMATCH), a rank out of
// range or a rank taken; messages from peers that are not ranks of the world are dropped. The
// protocol is in dist_comm_zmq.c. One world per rendezvous port at a time. ranks == 1 opens
// no socket.
typedef struct mtrl_dist_rendezvous mtrl_dist_rendezvous; // learner/dist_launch.h
#define MTRL_DIST_ZMQ_FRAME (16u << 20)
mtrl_status mtrl_dist_comm_init_zmq(mtrl_dist_comm **c, int ranks, int rank, const mtrl_dist_rendezvous *rv,
                                    int join_timeout_ms, int timeout_ms, mtrl_error *err);

// ---- every backend ------------------------------------------------------------------------------

void mtrl_dist_comm_free(mtrl_dist_comm *c); // NULL: no-op
int mtrl_dist_comm_rank(const mtrl_dist_comm *c);
int mtrl_dist_comm_ranks(const mtrl_dist_comm *c);
const char *mtrl_dist_comm_backend(const mtrl_dist_comm *c); // "local", "nccl" or "zmq"
// The CUDA device whose memory c's buffers are (nccl, local from init_local_device), or -1:
// host memory (local from init_local, zmq).
int mtrl_dist_comm_gpu(const mtrl_dist_comm *c);

// Returns when every rank has called it.
mtrl_status mtrl_dist_comm_barrier(mtrl_dist_comm *c, mtrl_error *err);
// buf[count] of dtype MTRL_DT_F32 or MTRL_DT_F64 becomes the sum over the ranks, in place.
// (F64: statistics and squared norms, exact for integer counts below 2^53.)
mtrl_status mtrl_dist_comm_allreduce(mtrl_dist_comm *c, void *buf, size_t count, mtrl_dtype dtype, mtrl_error *err);
// send[ranks * count] fp32 on every rank; recv[count] of rank r = Σ over ranks of their
// send[r * count .. (r+1) * count) (the ZeRO gradient reduction: chunk r is rank r's shard).
// send and recv must not overlap.
mtrl_status mtrl_dist_comm_reduce_scatter(mtrl_dist_comm *c, const float *send, float *recv, size_t count,
                                          mtrl_error *err);
// recv[ranks * bytes]: rank q's send[bytes] at q * bytes, on every rank. recv may hold send in
// place at the caller's own chunk (send == recv + rank * bytes).
mtrl_status mtrl_dist_comm_allgather(mtrl_dist_comm *c, const void *send, void *recv, size_t bytes, mtrl_error *err);
// buf[bytes] of rank root onto every rank.
mtrl_status mtrl_dist_comm_broadcast(mtrl_dist_comm *c, void *buf, size_t bytes, int root, mtrl_error *err);
// All-to-all of rows of elem_bytes bytes with per-peer counts and offsets, in rows (what
// learner/dist_plan.h mtrl_dist_a2a_send / _recv give): the send_count[q] rows at row
// send_offset[q] of send go to rank q, which receives them at row recv_offset[me] of its recv,
// having said recv_count[me] = that count. A count that disagrees with its peer's is
// MTRL_ERR_MISMATCH naming both ranks (local, zmq; NCCL cannot check it). Counts of zero are fine.
mtrl_status mtrl_dist_comm_alltoallv(mtrl_dist_comm *c, const void *send, const int64_t *send_count,
                                     const int64_t *send_offset, void *recv, const int64_t *recv_count,
                                     const int64_t *recv_offset, size_t elem_bytes, mtrl_error *err);

#endif
