// perf.h: where the RL loop's time goes, for the run store and `mtrl bench rl` (docs/perf.md,
// "mtrl bench rl").
//
// The learner splits its wall time from the end of the warm-up into five parts:
//   train       mtrl_train_rl_step: forward, backward, optimizer, QB update
//   wait        its socket loop between steps: waiting for episodes (receiving and assembling
//               them included)
//   publish     new weights serialised and queued to the actors (stage changes included)
//   checkpoint  checkpoints of [run] checkpoint_every (the one at the end of the run comes
//               after the timed window): the snapshot, and a due checkpoint's one wait (at
//               most 2 s) for the previous write to end
//   other       wall - the four: episodes and metrics recorded in SQLite, credit, bookkeeping
// and busy = (train + publish + checkpoint) / wall, the share of the wall time it spends on the
// work the loop needs of it (the rest is waiting for the actors, or overhead).
// The actors report their own split (ACTOR_STATS, common/wire/wire.h) once per [actor] heartbeat_ms;
// the learner sums the reports that arrive: wall, prefill, decode, tools, wait (for weights or
// credit, loading weights included) and other = wall - the four, summed over actors (so about
// [actor] count x the learner's wall; a report covers the heartbeat before it arrived).
//
// Metrics (runs.db), at every RL step, for the cycle since the previous step's metrics (the
// first since the end of the warm-up):
//     learner_wall_seconds, learner_train_seconds, learner_wait_seconds,
//     learner_publish_seconds, learner_checkpoint_seconds, learner_other_seconds, learner_busy,
//     actor_wall_seconds, actor_prefill_seconds, actor_decode_seconds, actor_tools_seconds,
//     actor_wait_seconds, actor_other_seconds, actor_prefill_tokens, actor_decode_tokens,
//     actor_decode_steps, episodes_committed, generated_tokens (the MODEL tokens of the
//     episodes committed), trained_tokens (the tokens of the step's forward + backward)
// and once when RL ends (at its last step) the totals since the end of the warm-up under the
// same names with "rl." in front, plus rl.steps, rl.trained_episodes (the episodes of the
// steps' batches; the others were stale, or of groups dropped) and rl.warmup_seconds (the
// warm-up stage from the start of mtrl_learner_run: supervised steps, publish, checkpoint).
#ifndef MTRL_LEARNER_PERF_H
#define MTRL_LEARNER_PERF_H

#include <stdint.h>

#include "common/status.h"
#include "common/store.h"
#include "common/wire/wire.h"

typedef struct mtrl_perf {
    double wall, train, wait, publish, checkpoint; // learner seconds
    mtrl_wire_actor_stats actors;                  // the actors' reports, summed
    double episodes, generated_tokens, trained_tokens;
    double steps, warmup, trained_episodes;        // logged with the totals only: rl.steps (RL
                                                   // steps of this sitting), rl.warmup_seconds,
                                                   // rl.trained_episodes (per step: `episodes`)
} mtrl_perf;

// to += p, field by field.
void mtrl_perf_add(mtrl_perf *to, const mtrl_perf *p);
// p->actors += one ACTOR_STATS report.
void mtrl_perf_actor_add(mtrl_perf *p, const mtrl_wire_actor_stats *s);
// The residual parts: learner wall - train - wait - publish - checkpoint; the same of the actors.
double mtrl_perf_other(const mtrl_perf *p);
double mtrl_perf_actor_other(const mtrl_perf *p);
// (train + publish + checkpoint) / wall; 0 for a zero wall.
double mtrl_perf_busy(const mtrl_perf *p);

// Logs p as the metrics above at (run, step), each name with prefix in front: "" for a step's
// cycle, "rl." for the totals (which add rl.steps and rl.warmup_seconds). Inside the caller's
// batch, if any; a failed write is logged, not returned (metrics never stop a run).
void mtrl_perf_log(mtrl_store *s, int64_t run, int64_t step, const char *prefix, const mtrl_perf *p);
// Reads back the totals (the "rl." metrics) of run: MTRL_ERR_NOTFOUND, naming the run, when it
// has none (its RL loop never ended, or a store of a build before them). *step: their step.
mtrl_status mtrl_perf_load(mtrl_store *s, int64_t run, mtrl_perf *p, int64_t *step, mtrl_error *err);

// The mean reward of the first and of the last 20% (at least one) of run's complete and
// truncated episodes in the order they started; *n = how many there are (means 0 when none).
mtrl_status mtrl_perf_reward_ends(mtrl_store *s, int64_t run, double *first, double *last, long *n, mtrl_error *err);

#endif
