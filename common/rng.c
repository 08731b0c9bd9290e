// rng.c: Philox-4x32-10 (see rng.h). Constants from Random123 (Salmon et al., SC'11).
#include "common/rng.h"

#include <math.h>

#include "common/hash.h"

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

void mtrl_philox4x32(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    uint32_t k0 = key[0], k1 = key[1];
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)PHILOX_M0 * c0;
        uint64_t p1 = (uint64_t)PHILOX_M1 * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        uint32_t n1 = (uint32_t)p1;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        uint32_t n3 = (uint32_t)p0;
        c0 = n0; c1 = n1; c2 = n2; c3 = n3;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

// Key = seed; counter words = (counter lo, counter hi, stream lo, stream hi). One block gives
// 128 bits; we use the first 64 so every (seed, stream, counter) maps to its own block.
uint64_t mtrl_rng_u64(uint64_t seed, uint64_t stream, uint64_t counter) {
    uint32_t ctr[4] = {(uint32_t)counter, (uint32_t)(counter >> 32), (uint32_t)stream,
                       (uint32_t)(stream >> 32)};
    uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    uint32_t out[4];
    mtrl_philox4x32(ctr, key, out);
    return ((uint64_t)out[0] << 32) | out[1];
}

double mtrl_rng_uniform(uint64_t seed, uint64_t stream, uint64_t counter) {
    return (double)(mtrl_rng_u64(seed, stream, counter) >> 11) * (1.0 / 9007199254740992.0);
}

double mtrl_rng_normal(uint64_t seed, uint64_t stream, uint64_t counter) {
    double u1 = mtrl_rng_uniform(seed, stream, 2 * counter);
    double u2 = mtrl_rng_uniform(seed, stream, 2 * counter + 1);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

uint64_t mtrl_rng_stream(const char *name, uint64_t a, uint64_t b) {
    uint64_t h = mtrl_hash64_str(name, 0x6d74726cULL);
    h = mtrl_hash64(&a, sizeof a, h);
    return mtrl_hash64(&b, sizeof b, h);
}
