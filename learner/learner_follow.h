// learner_follow.h: a data-parallel learner rank > 0 as its own process (issue 27,
// docs/multi-gpu.md §3): what `mtrl run` runs on every rank but 0 under a launcher.
//
// It builds the model replica of the experiment (the same config as rank 0's), joins rank 0's
// world over the zmq backend (learner/learner_ranks.h, "ranks as processes"), receives rank 0's
// whole state, then runs rank 0's jobs (RL steps, supervised steps, optimizer resets, checkpoint
// shards) until rank 0 says stop. It opens no run store, starts no actor and publishes nothing:
// rank 0 does all of that. Logs go to stderr tagged "rank N".
#ifndef MTRL_LEARNER_FOLLOW_H
#define MTRL_LEARNER_FOLLOW_H

#include "common/config.h"
#include "common/status.h"
#include "learner/dist_launch.h"

// Rank l->rank (> 0) of l->world for cfg ([model] device = cpu). MTRL_OK once rank 0 stopped the
// world; else the error (a usage error for a config this rank cannot run, MTRL_ERR_TIMEOUT
// naming rank 0's address when it stopped answering, a failed step's cause).
mtrl_status mtrl_learner_follow_run(const mtrl_config *cfg, const mtrl_dist_launch *l, mtrl_error *err);

#endif
