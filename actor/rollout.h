// rollout.h: tool-use episodes on the backbone's decode form, many at once.
//
// An episode reads (common/tokenizer.h):
//     BOS prompt | model: text TOOL_OPEN call TOOL_CLOSE | RESULT_OPEN observation RESULT_CLOSE | ... | model: answer EOS
// Prompt and observation tokens are fed through the chunked form (prefill) and never trained
// on (kinds PROMPT and TOOL); model tokens are sampled from the logits with temperature and
// top-p, each with its behaviour log-prob and the weight version that produced it (kind MODEL).
// The text between TOOL_OPEN and TOOL_CLOSE goes to env.step as a TOOL action; the text since
// the last observation goes as the ANSWER when the model emits EOS. An episode ends when the
// env says done (COMPLETE), or as TRUNCATED when the token budget or the per-turn limit runs out
// (no reward), or as ABORTED when the env fails (crash, timeout, error: the reason is kept).
//
// Episodes come in groups of G (same task seed, independent sampling streams) for group-
// relative advantages. Every random choice is a pure function of counters: the task seed of
// group g is mtrl_rng_u64(run seed, stream("task", actor, incarnation), g) and the sample for
// token t of episode e uses mtrl_rng_uniform(run seed, stream("sample", e, 0), t), so replay
// re-executes an episode exactly (mtrl_rollout_run_one with the same weights and env).
//
// mtrl_rollout_step advances every in-flight episode by one token with one batched decode call;
// finished episodes are handed to the caller, and free slots start new groups until
// mtrl_rollout_stop_new is called.
#ifndef MTRL_ACTOR_ROLLOUT_H
#define MTRL_ACTOR_ROLLOUT_H

#include <stdint.h>

#include "common/config.h"
#include "model/model.h"
#include "common/status.h"
#include "common/traj.h"
#include "common/trajbuf.h"
#include "env/env_host.h"

typedef struct mtrl_rollout mtrl_rollout;

// Where a rollout's time goes (the actor's ACTOR_STATS, mtrl bench rl): seconds in the batched
// engine's prefills (mtrl_model_prefill_many) and decodes (mtrl_model_decode) and in env calls
// (reset and step: the tools and the scoring of answers), with the tokens fed by each. Added to
// while mtrl_rollout_params.times points at one; its owner reads and clears it.
typedef struct mtrl_rollout_times {
    double prefill_s, decode_s, tools_s;
    uint64_t prefill_tokens, decode_tokens, decode_steps;
} mtrl_rollout_times;

typedef struct mtrl_rollout_params {
    uint64_t seed;           // [run] seed
    uint32_t actor_id, incarnation;
    int slots;               // [actor] episodes_in_flight (rounded up to a multiple of group_size)
    int group_size;          // [algo] group_size
    int max_tokens;          // [actor] max_tokens (mtrl_rollout_init lowers it to what memory holds)
    int memory_capped;       // set by mtrl_rollout_init: max_tokens was lowered to fit the memory
    int max_turn_tokens;     // [actor] max_turn_tokens
    double temperature, top_p;
    int record_routing;      // [actor] routing_replay
    uint64_t first_group;    // counters to start from: an actor that rebuilds its rollout (a new
    uint64_t first_episode;  // stage) continues them, so episode ids never repeat in a run
    uint64_t max_groups;     // no new group after this many (0: until mtrl_rollout_stop_new)
    mtrl_rollout_times *times; // nullable (params_from_config: NULL): the time split goes here
    // How episodes are framed and tool calls read (common/chat.h). NULL: mtrl_rollout_init opens
    // [model] tokenizer and chat_template (the rollout owns it); run_one takes NULL as bytes.
    const struct mtrl_chat *chat;
    size_t device_budget;    // [actor] device_budget_mb in bytes: decode states through the episode
    size_t host_budget;      // memory account (actor/episode_mem.h); 0 = off. [actor] host_budget_mb
    // [actor] prefill_rounds: prefill rounds per step (one MTRL_PREFILL_SEGMENT of all pending
    // feeds each). An episode whose feed is still pending skips the decode until it is fed; the
    // others decode every step, so a long tool result does not stall the batch. 0: all pending
    // feeds before the next decode. The rounds cut feeds where one whole prefill would cut its
    // segments, so the tokens do not depend on it.
    int prefill_rounds;
} mtrl_rollout_params;

void mtrl_rollout_params_from_config(mtrl_rollout_params *p, const mtrl_config *cfg, uint32_t actor_id,
                                     uint32_t incarnation);

// Opens `slots` env instances (config [env]) and decode states. The model is borrowed and
// may have its weights replaced between steps (the version is read per token).
mtrl_status mtrl_rollout_init(mtrl_rollout **out, const mtrl_rollout_params *p, const mtrl_config *cfg, mtrl_model *m,
                              mtrl_error *err);
void mtrl_rollout_free(mtrl_rollout *r);

// Callbacks. begin: an episode started (its prompt is in the trajectory). end: it finished;
// the trajectory is the callee's to keep (swap it out) until the callback returns. tick (may be
// NULL): called between the rounds of a long prefill (one segment of MTRL_PREFILL_SEGMENT
// tokens each, a fraction of a second on a GPU), so that a step spent prefilling 1M-token
// documents does not silence the caller's heartbeats; it must not call into the rollout.
typedef struct mtrl_rollout_events {
    void *user;
    void (*begin)(void *user, mtrl_traj *t);
    void (*end)(void *user, mtrl_traj *t);
    void (*tick)(void *user);
} mtrl_rollout_events;

// One generation step for every in-flight episode. Returns the number of episodes in flight
// after the step (0 when stopped and drained).
int mtrl_rollout_step(mtrl_rollout *r, const mtrl_rollout_events *ev);

// The counters of groups and episodes started so far (to continue them in a new rollout).
void mtrl_rollout_counters(const mtrl_rollout *r, uint64_t *next_group, uint64_t *next_episode);

// No new groups start after this; in-flight episodes run to their end.
void mtrl_rollout_stop_new(mtrl_rollout *r);

// The in-flight trajectory of slot i (NULL when the slot is idle), for streaming chunks.
mtrl_traj *mtrl_rollout_slot(mtrl_rollout *r, int i);
int mtrl_rollout_slot_count(const mtrl_rollout *r);
// The memory account of the decode states (actor/episode_mem.h), or NULL without a device budget.
// With one, a group starts only when the account admits its episodes (else it waits), states
// grow with their episodes, an episode waiting for the prefill of its env's text (a tool result,
// a prompt) may be parked in host memory while others need the room, and an episode ends
// `truncated` with the account's reason only when its state can grow no more.
const struct mtrl_epmem *mtrl_rollout_mem(const mtrl_rollout *r);

// ---- snapshot and resume of an in-flight episode -------------------------------------------------
// A snapshot holds everything the episode needs to go on exactly as if it had not stopped:
// the trajectory so far (tokens, log-probs, versions, tool calls), the decode state (KDA
// states, conv windows, MLA latents of every position so far), the next-token logits and the
// turn bookkeeping; the sampler needs nothing more (it is a function of the token position).
// The env is brought back by re-running its reset(seed) and the recorded tool calls; a result
// that differs from the recorded one refuses the resume (the env is not deterministic).
// Format: "MTRLSNAP", version, the parts above, CRC-32C of everything before it.
mtrl_status mtrl_rollout_snapshot(mtrl_rollout *r, int slot, mtrl_wbuf *out, mtrl_error *err);
// Resumes into an idle slot of r (same model shape; the weights may be newer).
mtrl_status mtrl_rollout_resume(mtrl_rollout *r, int slot, const void *buf, size_t n, mtrl_error *err);
// After a resume in another process: the episode continues as this rollout's actor incarnation
// under a fresh episode id (the learner recorded the old stream as aborted when the old
// incarnation went away); its tokens, group and sampling stream stay. Returns the old id.
uint64_t mtrl_rollout_adopt(mtrl_rollout *r, int slot);
// The actor starts over as a new incarnation (its connection to the learner was lost): every
// episode in flight is adopted under it (mtrl_rollout_adopt), and new episodes get its ids.
// Returns the number of episodes in flight.
int mtrl_rollout_reincarnate(mtrl_rollout *r, uint32_t incarnation);

// Runs one episode alone (replay --reexec): the task seed, episode id and sampling stream of a
// recorded episode, on the given model and env. The result is written to out.
mtrl_status mtrl_rollout_run_one(const mtrl_rollout_params *p, mtrl_model *m, mtrl_env *env, uint64_t task_seed,
                                 uint64_t episode_id, uint64_t group_id, mtrl_traj *out, mtrl_error *err);

#endif
