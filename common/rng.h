// rng.h: counter-based random numbers (Philox-4x32-10, Salmon et al., SC'11).
//
// A value is a pure function of (seed, stream, counter): no hidden state, so any sample of any
// episode can be recomputed later, on the CPU or the GPU, from three integers. Convention:
// `stream` names what the numbers are for (an episode's sampling, an init of one tensor, ...)
// and `counter` walks through the values of that stream; each call yields 4 words.
//     mtrl_rng_uniform(seed, stream, i)  -> i-th uniform in [0, 1) of that stream
#ifndef MTRL_RNG_H
#define MTRL_RNG_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// The raw block function: 4 output words for counter (c0..c3) and key (k0, k1).
void mtrl_philox4x32(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);

// 64 random bits for (seed, stream, counter): the first half of one Philox block.
uint64_t mtrl_rng_u64(uint64_t seed, uint64_t stream, uint64_t counter);

// Uniform double in [0, 1) with 53 random bits.
double mtrl_rng_uniform(uint64_t seed, uint64_t stream, uint64_t counter);

// Standard normal (Box-Muller over counters 2*counter and 2*counter+1 of the stream).
double mtrl_rng_normal(uint64_t seed, uint64_t stream, uint64_t counter);

// A stream id derived from a name and up to two integers (for example a tensor name, or an
// episode id and a turn), so independent uses never share a stream by accident.
uint64_t mtrl_rng_stream(const char *name, uint64_t a, uint64_t b);

#ifdef __cplusplus
}
#endif

#endif
