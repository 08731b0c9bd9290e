// dist_launch.h: which rank of the multi-GPU learner this process is, as a launcher said it
// (issue 27, docs/multi-gpu.md), its CUDA device, and the bootstrap of NCCL's unique id from
// rank 0 to the others over ZeroMQ.
//
// The launcher's variables are the one place where mtrl reads the environment for a choice:
// the launcher, not the user, sets them, once per process. Everything else is configuration.
// Two launchers are understood, and no launcher means one process:
//   torchrun  RANK, WORLD_SIZE (both needed when either is set), LOCAL_WORLD_SIZE (default
//             WORLD_SIZE: one node; WORLD_SIZE must be a multiple, torchrun starts as many ranks
//             on every node), LOCAL_RANK (default RANK % LOCAL_WORLD_SIZE), GROUP_RANK (the
//             node; default RANK / LOCAL_WORLD_SIZE), MASTER_ADDR and MASTER_PORT (needed when
//             WORLD_SIZE > 1).
//             Any launcher that sets these variables works the same (a script, mpirun wrapper).
//   slurm     srun's tasks: SLURM_PROCID, SLURM_NTASKS (or SLURM_NPROCS), SLURM_LOCALID,
//             SLURM_NODEID (default: the node whose tasks hold SLURM_PROCID, block placement),
//             the tasks of each node from SLURM_STEP_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE (one
//             number for every node) or SLURM_TASKS_PER_NODE (the compact "2(x3),1" form), and
//             rank 0's host: MASTER_ADDR when the job script exports it, else the first host of
//             SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or SLURM_NODELIST (the compact
//             "gpu[01-04,07]" form): with srun's block and cyclic distributions task 0 runs on
//             the step's first node. SLURM_LAUNCH_NODE_IPADDR is not used: it is where srun ran,
//             which may be a login node outside the step.
//   none      neither: rank 0 of 1 on this node.
// torchrun's variables win when both are set (`srun torchrun ...` starts torchrun under Slurm,
// and the variables torchrun gives its workers are the ranks).
//
// The rendezvous port is MASTER_PORT + 1: under torchrun MASTER_PORT is taken by the agent's
// own store (torchrun's c10d TCPStore listens there), so the id goes one port above it. Under
// Slurm without MASTER_PORT it is 15000 + SLURM_JOB_ID % 10000 (a port per job, so two jobs on
// one node do not meet; SLURM_JOB_ID is needed then).
//
// A world has at most MTRL_DIST_RANKS_MAX ranks (learner/dist_plan.h). Every error is
// MTRL_ERR_USAGE naming the variable and its value ("launch (torchrun): RANK = 4 is not below
// WORLD_SIZE = 4"): a launch that disagrees with itself is a configuration error, refused
// before any socket is opened.
//
//     mtrl_dist_launch l;
//     if (mtrl_dist_launch_from_env(&l, (const char *const *)environ, &err) != MTRL_OK) ... stop
//     int gpus[MTRL_CFG_GPUS_MAX], n = mtrl_config_gpus(cfg, gpus, NULL, 0), gpu;
//     if (mtrl_dist_launch_gpu(&l, gpus, n, &gpu, &err) != MTRL_OK) ... stop
//     mtrl_dist_rendezvous rv = mtrl_dist_rendezvous_of(&l);
//     mtrl_dist_comm_init_nccl(&c, l.world, l.rank, gpu, stream, timeout_ms, mtrl_dist_bootstrap_zmq, &rv, &err);
#ifndef MTRL_DIST_LAUNCH_H
#define MTRL_DIST_LAUNCH_H

#include <stddef.h>

#include "common/status.h"
#include "common/wire/wire.h"

#define MTRL_DIST_HOST_MAX 256

typedef struct mtrl_dist_launch {
    const char *source;          // "torchrun", "slurm" or "none" (static strings)
    int rank, world;             // this process is rank `rank` of `world` (0 <= rank < world)
    int local_rank, local_world; // ... and local rank `local_rank` of the `local_world` on its node
    int node;                    // the node's index (0: rank 0's node)
    char host[MTRL_DIST_HOST_MAX]; // rank 0's host (name or IPv4 address); "" when world == 1
    int port;                    // the rendezvous port (above); 0 when world == 1
    const char *rank_var;        // the variables the numbers came from, for messages:
    const char *local_rank_var;  // "RANK" / "SLURM_PROCID", "LOCAL_RANK" / "SLURM_LOCALID",
    const char *local_world_var; // "LOCAL_WORLD_SIZE" / "SLURM_STEP_TASKS_PER_NODE" ...
} mtrl_dist_launch;

// The launch from env: NAME=VALUE strings ending at a NULL (environ for this process; a test
// passes its own). env NULL: no variables (source "none").
mtrl_status mtrl_dist_launch_from_env(mtrl_dist_launch *out, const char *const *env, mtrl_error *err);

// The CUDA device of the launch's local rank: with `[learner] gpus` listed (n_gpus > 0, the ids
// of mtrl_config_gpus), local rank i gets gpus[i]; without (n_gpus == 0), device i. A local
// rank or local world beyond the listed GPUs is MTRL_ERR_USAGE naming the variable, its value
// and the list.
mtrl_status mtrl_dist_launch_gpu(const mtrl_dist_launch *l, const int *gpus, int n_gpus, int *gpu, mtrl_error *err);

// One line for logs and `mtrl check`: "torchrun: rank 1 of 4 (local 1 of 2, node 0),
// rendezvous node01:29501".
void mtrl_dist_launch_describe(const mtrl_dist_launch *l, char *buf, size_t cap);

// The first host of a Slurm nodelist: "gpu[01-04,07],cpu3" -> "gpu01", "a[1-2]-ib[3]" ->
// "a1-ib3", "n7" -> "n7". MTRL_ERR_USAGE naming var (for the message) and the list when it is
// empty, a bracket is not closed, or a range inside one is not digits ("[a-b]").
mtrl_status mtrl_dist_nodelist_first(const char *var, const char *list, char *host, size_t cap, mtrl_error *err);

// ---- the unique id over ZeroMQ (an mtrl_dist_bootstrap_fn of dist_comm.h) -----------------------
//
// Rank 0 binds a ROUTER at tcp://ADDR:port (ADDR: host resolved to its IPv4 address, which
// must be one of this node's: the others connect exactly there, and nothing else listens)
// and answers each other rank's request with the id; it returns MTRL_OK once every rank 1 ..
// ranks-1 has had it, each exactly once, or MTRL_ERR_TIMEOUT at timeout_ms naming the ranks
// that never asked (and any request it refused). The others connect a DEALER (ZeroMQ
// reconnects until rank 0 listens), ask and wait at most timeout_ms: MTRL_ERR_TIMEOUT naming
// host:port and the timeout when nobody answers. One message each way, one frame, little-endian:
//     0 u8[4] magic "MTBS"   4 u16 version (1)   6 u16 kind (1 ask, 2 id, 3 refused)
//     8 u32 world size       12 u32 rank (the asker's)   16 u32 id bytes   20 i32 status (refused)
//     24 the id (kind 2), the reason as text (kind 3), nothing (kind 1)
// Rank 0 refuses, with a reason the asker returns: another version, world size
// (MTRL_ERR_MISMATCH) or id size (MTRL_ERR_MISMATCH), a rank out of range (MTRL_ERR_USAGE), a
// rank that had the id already (MTRL_ERR_STATE: two processes with one rank).
//
// The id lets anyone who has it join the NCCL world; NCCL's own bootstrap sends it in the clear
// too. For a network that is not trusted, give both sides CURVE options (common/wire/wire_auth.h:
// rank 0 a server's, with a ZAP handler started in zmq_ctx; the others a client's).
typedef struct mtrl_dist_rendezvous {
    char host[MTRL_DIST_HOST_MAX]; // rank 0's host
    int port;                      // 1 .. 65535
    void *zmq_ctx;                 // NULL: a context of the call's own; else the caller's (CURVE's ZAP handler)
    const mtrl_wire_sockopts *opts; // NULL: mtrl_wire_sockopts_default() (no CURVE)
} mtrl_dist_rendezvous;

// The rendezvous of a launch (its host and port; no context, no CURVE).
mtrl_dist_rendezvous mtrl_dist_rendezvous_of(const mtrl_dist_launch *l);

// user: a const mtrl_dist_rendezvous *. See above.
mtrl_status mtrl_dist_bootstrap_zmq(void *user, int rank, int ranks, void *id, size_t id_bytes, int timeout_ms,
                                    mtrl_error *err);

#endif
