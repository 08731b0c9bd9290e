// learner_ranks.h: the learner's data-parallel ranks inside the `mtrl run` process (issue 27,
// docs/multi-gpu.md).
//
// With [learner] ranks (or several [learner] gpus) resolving to R > 1 (common/config.h
// mtrl_config_ranks), the learner trains on R ranks of one host:
//   - rank 0 is the learner loop's own thread and model (learner.c: the actors' episodes,
//     rewards, the run store, weight publishing, logging, checkpoints);
//   - ranks 1 .. R-1 are follower threads started here, each with a replica of rank 0's model
//     made from rank 0's whole state at the start (parameters, both AdamW moments, β, step,
//     version: the replicas begin equal, whatever rank 0 was loaded from) and its own
//     learner/dist_dp.h step state.
// Each call below is one job: rank 0 posts it (the SAME batch, config and learning rate for
// every rank), runs its own part in the caller's thread, then waits for every follower's. The
// jobs: an RL step (mtrl_dist_dp_rl_step), a supervised warm-up step (_sft_step), an optimizer
// reset (RL starts with fresh moments), a checkpoint's shards, and stop (mtrl_learner_ranks_free).
//
// Where the ranks run:
//   [model] device = cpu   R threads on the CPU, the local backend (mtrl_dist_comm_init_local:
//                          sums in rank order, the same bits every run): what the CPU tests and
//                          CI run end to end.
//   [model] device = cuda  rank r on the r-th id of [learner] gpus (or device r), NCCL
//                          (mtrl_dist_comm_init_nccl, its collectives on the legacy default
//                          stream; the unique id handed from rank 0 to the others in memory).
//
// Expert parallel ([learner] expert_parallel = true, R > 1; CPU models with MoE layers only,
// mtrl_learner_ranks_check_ep): every rank runs mtrl_dist_dp_init_ep's step instead, owning
// its block of experts (learner/dist_ep.h: their parameters, gradients and moments) and its
// ZeRO shard of the rest; after each step every expert's new weights are gathered onto rank 0
// (dist_dp.h step 5), so rank 0's model is whole, as without it, and what the learner
// publishes and writes as the full parameter file holds every expert. A follower's copies of
// the others' experts are stale (it never runs them). Its checkpoint's rank files hold what
// each rank owns (dist_ckpt.h's expert-parallel layout); reading them back is the same call.
// Memory (not built): each rank still allocates the whole parameter, gradient and moment
// blocks, every expert included, and reads only its own. Holding its own alone needs
//   1. a follower model whose routed-expert tensors have e1 - e0 rows: a table of its own,
//      while the parameter table, mtrl_model_load / _save, dist_ckpt.h's layout digest and
//      mtrl_model_set_experts all assume the one whole table on every rank today;
//   2. model_moe.h's expert phases indexing ew1 / ew3 / ew2 from e0 (dist_ep_wire.h passes
//      expert ids of the whole range);
//   3. the followers' start loading only their pieces of rank 0's state (a whole
//      mtrl_model_load of the blob today), and the step and the save addressing the own
//      experts in the smaller block (the rank files already hold the owned pieces only, so
//      their format would not change).
// Rank 0 would keep every expert (it publishes and writes the full parameter file), so the
// saving is on ranks 1 .. R-1: (E - E/R) / E of the expert bytes of each of the four blocks.
//
// State kept per rank (dist_dp.h): the AdamW moments of its own ZeRO shard only. So a
// checkpoint's optimizer state is written sharded (mtrl_learner_ranks_save: every rank its rank
// file, rank 0 the index last, learner/dist_ckpt.h), and read back by any number of ranks
// (mtrl_learner_ranks_load_moments reads the whole moments into one model, which the ranks
// then copy at their start). The parameters are equal on every rank after each step: rank 0's
// are what the learner publishes and writes as the checkpoint's full parameter file.
//
// A failure on any rank (a collective past [learner] rank_timeout_ms, any step or write error)
// makes the call return it, with a message naming the rank and its cause. After a failed step
// the world is dead (the replicas may differ): every later job is refused with MTRL_ERR_STATE,
// and the run stops without a final checkpoint, its last complete one the one to resume. A
// failed checkpoint write leaves the world alive and no index (nothing names the files).
//
//     mtrl_learner_ranks *rk;                     // after rank 0's model is loaded
//     if (mtrl_learner_ranks_init(&rk, &model, cfg, &err) != MTRL_OK) ... stop
//     if (mtrl_learner_ranks_rl_step(rk, cfg, &algo, batch, n, &st, &err) != MTRL_OK) ... stop the run
//     mtrl_learner_ranks_free(rk);                // before rank 0's model
#ifndef MTRL_LEARNER_RANKS_H
#define MTRL_LEARNER_RANKS_H

#include <stddef.h>

#include "common/checkpoint.h"
#include "common/config.h"
#include "common/status.h"
#include "learner/train.h"

typedef struct mtrl_learner_ranks mtrl_learner_ranks;

// One line for logs, `mtrl check` and `mtrl plan`: "2 data-parallel learner ranks: threads of
// one process on the CPU (local backend)" or "... on GPUs 0,1 (NCCL)"; the reason when the keys
// disagree (mtrl_config_ranks). Returns R, or -1.
int mtrl_learner_ranks_describe(const mtrl_config *cfg, char *buf, size_t cap);

// Whether cfg's [learner] expert_parallel can run on a model of dims d: MTRL_OK when it is off
// or it can; MTRL_ERR_USAGE naming the key for a GPU model (the GPU path is not built:
// docs/multi-gpu.md §3), a model without MoE layers, or more ranks than routed experts. With
// one rank it has no effect (and is not refused on a CPU MoE model). What mtrl_learner_ranks_init,
// the learner's start, `mtrl check` and `mtrl plan` call.
mtrl_status mtrl_learner_ranks_check_ep(const mtrl_config *cfg, const mtrl_model_dims *d, mtrl_error *err);

// Starts ranks 1 .. R-1 of cfg's ranks (R >= 1; [learner] rank_timeout_ms their collectives'
// limit) with replicas of m0, rank 0's model, which stays the caller's (its thread calls every
// job). Each rank runs [learner] threads OpenMP threads; with threads = 0 on the CPU the
// default share (common/config.h mtrl_config_threads) is split over the R ranks (at least 1
// each), and the caller's thread is set to it too. MTRL_ERR_USAGE naming the keys for ranks the config refuses, or a model on another
// device than [model] device says, and what mtrl_learner_ranks_check_ep refuses; a rank that cannot start (no such GPU, NCCL's init) is
// named with its error, and nothing is left running.
mtrl_status mtrl_learner_ranks_init(mtrl_learner_ranks **out, mtrl_model *m0, const mtrl_config *cfg, mtrl_error *err);
// Stops and joins the followers and frees their replicas (NULL: no-op). A follower that does
// not stop within the timeout is left behind (logged) with its memory.
void mtrl_learner_ranks_free(mtrl_learner_ranks *r);

int mtrl_learner_ranks_count(const mtrl_learner_ranks *r);
int mtrl_learner_ranks_expert_parallel(const mtrl_learner_ranks *r); // 1: the EP+DP step
const char *mtrl_learner_ranks_backend(const mtrl_learner_ranks *r); // "local" or "nccl"
// 1 once a step failed: the world is dead and the replicas may differ.
int mtrl_learner_ranks_failed(const mtrl_learner_ranks *r);

// One RL step of the whole batch eps[0..n-1] on every rank, as mtrl_train_rl_step on one: st
// is rank 0's statistics (set st->loads before the call to receive the loads), the same as
// every rank's. rank 0's model (m0) has the new parameters and version.
mtrl_status mtrl_learner_ranks_rl_step(mtrl_learner_ranks *r, const mtrl_config *cfg, const mtrl_algo_config *a,
                                       mtrl_traj *const *eps, int n, mtrl_step_stats *st, mtrl_error *err);
// One supervised step, as mtrl_train_sft_step: *loss (nullable) the mean NLL before the step.
mtrl_status mtrl_learner_ranks_sft_step(mtrl_learner_ranks *r, const mtrl_config *cfg, mtrl_traj *const *eps, int n,
                                        double lr, double *loss, mtrl_error *err);
// Zeroes both AdamW moments on every rank (mtrl_model_optimizer_reset).
mtrl_status mtrl_learner_ranks_optimizer_reset(mtrl_learner_ranks *r, mtrl_error *err);

// The optimizer state as a sharded checkpoint at index_path (learner/dist_ckpt.h): every rank
// writes its rank file (its shard of the parameters and both moments; with expert parallel its
// own experts' and its non-expert shard's, dist_ckpt.h's expert-parallel layout) at once, then rank 0 the
// index with QB β, the metadata "step" (AdamW's) and "version", and the caller's n_meta pairs.
// The index is written only when every rank file is, so a failed write (named by its rank)
// leaves nothing that names a partial state.
mtrl_status mtrl_learner_ranks_save(mtrl_learner_ranks *r, const char *index_path, const char *const *meta,
                                    int n_meta, mtrl_error *err);

// Reads the whole AdamW moments and step of the sharded checkpoint at index_path (written by
// any number of ranks) into m (a model of the same layout, on any device), as a one-rank
// checkpoint would restore them. The layout and every rank file are checked (dist_ckpt.h).
// Either layout, whatever the reader's R' and expert_parallel: the ranks then copy this whole
// state at their start.
mtrl_status mtrl_learner_ranks_load_moments(mtrl_model *m, const char *index_path, mtrl_error *err);

// ---- ranks as processes (a launcher's world, the zmq backend) ----------------------------------
//
// Under a launcher (learner/dist_launch.h: torchrun's or srun's variables) every rank is its own
// `mtrl run` process: rank 0 runs the learner loop and calls the jobs above as with threads;
// each rank > 0 runs learner/learner_follow.h, which calls mtrl_learner_ranks_follow. A job goes
// from rank 0 by broadcast (learner/dist_comm.h, zmq backend): a 64-byte header (kind, payload
// bytes, episodes, learning rate, the sizes of the raw config and algorithm structs), then the
// payload: for a step the config and algorithm as rank 0 runs them (every rank runs the same
// build: the sizes are checked) and the batch's episodes in common/traj.h's encoding, for a
// checkpoint its index path (the ranks share a filesystem: each writes its rank file there).
// After each job the ranks allgather their statuses, so rank 0 names a follower's own error as
// with threads. While rank 0 collects rollouts it posts a heartbeat job every
// min(rank_timeout_ms / 4, 5 s) (mtrl_learner_ranks_heartbeat, from the learner's loop): a
// follower waits for its next job 2 x rank_timeout_ms + 100 ms (the backend's limit), so a rank 0
// that died (or a gap in its loop past that) makes the follower fail naming rank 0's address.
// CPU models only ([model] device = cpu).

// This process's rank `rank` of `world` (2 .. MTRL_DIST_RANKS_MAX) over the zmq backend at rv
// (mtrl_dist_rendezvous_of the launch). m is this rank's model, the caller's: rank 0's as
// loaded, a follower's of the same dims (its state is replaced by rank 0's whole state, sent at
// the start, so the replicas begin equal). The join waits max(rank_timeout_ms, 60 s) for every
// rank. MTRL_ERR_USAGE for a model or [model] device that is not the CPU, and what
// mtrl_learner_ranks_check_ep refuses; a rank that cannot start is named with its error.
typedef struct mtrl_dist_rendezvous mtrl_dist_rendezvous;
typedef struct mtrl_dist_launch mtrl_dist_launch;

// Whether cfg can run as the launch's world of l->world > 1 processes: MTRL_ERR_USAGE naming
// both when [learner] ranks is set and differs from the launch's world size (WORLD_SIZE or
// SLURM_NTASKS), when [model] device is not cpu, and what mtrl_config_ranks refuses. What
// `mtrl run` (every rank) and `mtrl check` call under a launcher.
mtrl_status mtrl_learner_ranks_check_launch(const mtrl_config *cfg, const mtrl_dist_launch *l, mtrl_error *err);

mtrl_status mtrl_learner_ranks_init_process(mtrl_learner_ranks **out, mtrl_model *m, const mtrl_config *cfg, int rank,
                                            int world, const mtrl_dist_rendezvous *rv, mtrl_error *err);
int mtrl_learner_ranks_rank(const mtrl_learner_ranks *r); // this process's rank (0 with threads)
// Rank 0 of processes: posts a heartbeat job when none went out for the period above (else, and
// with threads, nothing). An error: the world is dead (a follower gone), as after a failed step.
mtrl_status mtrl_learner_ranks_heartbeat(mtrl_learner_ranks *r, mtrl_error *err);
// A follower process (rank > 0): runs rank 0's jobs until its stop (MTRL_OK) or a failure: the
// wait for a job past its limit (MTRL_ERR_TIMEOUT naming rank 0's address), a failed step, a
// broken header. A follower's failed checkpoint shard is told to rank 0 and logged, and the
// loop goes on (rank 0 fails the run). *jobs (nullable): the jobs run, heartbeats included.
mtrl_status mtrl_learner_ranks_follow(mtrl_learner_ranks *r, long *jobs, mtrl_error *err);

// ---- tests only ---------------------------------------------------------------------------------
// Makes rank `rank` fail its step job number `job` (1: the first RL or supervised step after
// this call) without running it, as a rank that died would: the others time out in their
// first collective. Its own error says "failure injected by a test".
void mtrl_learner_ranks_test_fail(mtrl_learner_ranks *r, int rank, long job);
// Rank `rank`'s model (rank 0's is the caller's), to read between jobs.
const mtrl_model *mtrl_learner_ranks_test_model(const mtrl_learner_ranks *r, int rank);

#endif
