// learner.h: the learner process (docs/architecture.md §3, §5, §6).
//
// It binds a ZeroMQ ROUTER, welcomes actors (HELLO → WELCOME with the resolved experiment, so
// an actor builds the same model and env), serves weights (WEIGHTS_AT: the version is in a slot
// of the same-host weight channel, learner/weights_pub.h; or, with [learner] publish = zmq and
// for actors that answer WEIGHTS_REQ, WEIGHTS chunks of the safetensors blob), assembles streamed episodes (BEGIN / CHUNK / END,
// common/wire/wire.h) and commits each finished one to the trajectory file and the run store. When
// `[learner] batch_groups` groups of `[algo] group_size` episodes are complete it takes one
// optimizer step (learner/train.h), updates QB β after the step, publishes version + 1 and logs
// metrics and expert loads. Episodes older than `max_staleness` versions are recorded but not
// trained on. Actors silent for `heartbeat_timeout_ms` are dead: their open episodes are
// aborted. Credit (bytes an actor may have in flight) is returned as the learner consumes
// episodes, so the learner holds at most Σ credit of unassembled bytes.
//
// An optional [warmup] stage runs first: supervised steps on env demonstrations.
// Checkpoints (parameters, AdamW, β, step, version, counters) every `checkpoint_every` steps
// and at the end, written from a snapshot in the background (learner/ckpt_async.h; a failed
// write fails the run); `resume` continues the last run of the database from its last checkpoint.
// Where the time of RL goes (the learner's and the actors' splits, tokens, episodes) is logged
// per step and in total at the end of RL: learner/perf.h lists the metrics.
// With [learner] ranks (or several [learner] gpus) resolving to R > 1, every step is the
// data-parallel step on R ranks of this process (learner/learner_ranks.h): this loop is rank
// 0, and checkpoints keep the moments as one shard file per rank beside the parameter file.
#ifndef MTRL_LEARNER_H
#define MTRL_LEARNER_H

#include <signal.h>

#include "common/config.h"
#include "common/status.h"

typedef struct mtrl_learner mtrl_learner;

#define MTRL_PROGRESS_LINE 1
#define MTRL_PROGRESS_JSON 2

typedef struct mtrl_learner_opts {
    const char *db;        // run store path (NULL: [run] db)
    int resume;            // continue the latest run of db from its last checkpoint
    int progress;          // 0: none; MTRL_PROGRESS_LINE: the progress line on stderr;
                           // MTRL_PROGRESS_JSON: one JSON object a line on stdout (mtrl run --json):
                           //   {"type":"warmup","run":R,"step":S,"steps":N,"loss":L,"elapsed_s":T} per warm-up step,
                           //   {"type":"step","run":R,"step":S,"steps":N,"reward":M,"episodes":E,"aborted":A,
                           //    "actors":K,"episodes_per_s":..,"tokens_per_s":..,"elapsed_s":T} per RL step,
                           //   {"type":"end","run":R,"status":"finished|failed|killed","step":S,"episodes":E,
                           //    "elapsed_s":T[,"reason":"..."]} once (a number that is not finite is null)
    void (*tick)(void *user); // called every loop iteration (mtrl run restarts dead actors there)
    void *tick_user;
    double rl_seconds;     // > 0: end the run (finished) after this many seconds of RL, counted
                           // from the end of the warm-up (mtrl bench rl)
    const struct mtrl_dist_launch *launch; // NULL or one process: the ranks as [learner] ranks says;
                           // a launch of world > 1 whose rank 0 this is: its ranks are the launch's
                           // processes (learner/learner_ranks.h; the others run learner_follow.h)
} mtrl_learner_opts;

mtrl_status mtrl_learner_open(mtrl_learner **out, const mtrl_config *cfg, const mtrl_learner_opts *opts,
                              mtrl_error *err);
// The endpoint actors connect to (the bound port when the config says tcp://...:*).
const char *mtrl_learner_endpoint(const mtrl_learner *l);
long long mtrl_learner_run_id(const mtrl_learner *l);

// Runs until [run] steps optimizer steps are done (0), *stop becomes non-zero (the run is
// marked killed, 1), or the run fails (1, with the reason logged and stored).
int mtrl_learner_run(mtrl_learner *l, volatile sig_atomic_t *stop);
// Ends the run as `failed` with the reason (logged as an event) at the next turn of the loop:
// for a supervisor whose actors cannot run the experiment at all. Safe from the tick callback.
void mtrl_learner_fail(mtrl_learner *l, const char *why);
// The last error an actor sent before leaving ("actor N: why it cannot run the experiment"; ""
// when none did). Each is also stored as an event of the run, escaped like all peer text.
const char *mtrl_learner_actor_error(const mtrl_learner *l);
// When (mtrl_time_mono seconds) the learner declared actor `id` dead because it fell silent
// after it had started working (not one past actor_start_timeout_ms while setting up, which
// comes back by itself), while no incarnation of that id is live since; 0 otherwise. `mtrl run`'s supervisor kills
// and restarts such an actor (a plug-in hung in an env step stalls its process, which then
// neither works nor exits). Safe from the tick callback.
double mtrl_learner_actor_silent_since(const mtrl_learner *l, uint32_t id);
void mtrl_learner_close(mtrl_learner *l);

#endif
