// actor.h: the actor process (`mtrl actor --connect ENDPOINT`), docs/architecture.md §3 and §5.
//
// It says HELLO to the learner with its id and a fresh incarnation, builds the model and env
// from the experiment the WELCOME carries, loads the weights the learner sends (copied out of
// the same-host weight channel a WEIGHTS_AT names, common/weights_shm.h, or WEIGHTS chunks
// when the channel does not open here), then runs
// episodes (actor/rollout.h) and streams each as BEGIN, CHUNKs of at most [actor] chunk_tokens
// tokens as they are produced, and END, never sending more bytes than the learner's credit
// allows (generation pauses while the credit is spent). New weights are applied between
// generation steps; every token keeps the version that produced it. Once per heartbeat period it
// reports where its time went (ACTOR_STATS: prefill, decode, tools, waiting; learner/perf.h).
// Heartbeats both ways; when the learner goes quiet the actor says HELLO again (the DEALER
// reconnects by itself) and restarts its episodes under the new WELCOME. A BYE from the
// learner, or *stop, ends it.
#ifndef MTRL_ACTOR_H
#define MTRL_ACTOR_H

#include <signal.h>
#include <stdint.h>

// Returns the process exit code: 0 after a BYE or *stop, 1 when the learner never answered or
// the experiment it sent cannot be run here, MTRL_ACTOR_EXIT_LEARNER_LOST (below) when it went
// silent for good.
// gpu: the CUDA device for a [model] device = cuda experiment (-1: the experiment's choice).
// Exit status of an actor that cannot run the experiment at all (an env plug-in that does not
// load, a model that does not fit): restarting it would fail the same way.
#define MTRL_ACTOR_EXIT_UNUSABLE 3
// Exit status of an actor whose learner was silent for [actor] learner_patience_s after the
// WELCOME (it died, or the network to it did): a remote actor does not wait forever.
#define MTRL_ACTOR_EXIT_LEARNER_LOST 4
int mtrl_actor_main(const char *endpoint, uint32_t actor_id, int gpu, volatile sig_atomic_t *stop);

#endif
