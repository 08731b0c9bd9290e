// trajgen.h: random trajectories and byte mutations for the traj/trajfile/wire tests and the
// fuzz replay driver. Header-only, deterministic from a seed (splitmix64), test code only.
#ifndef MTRL_TESTS_TRAJGEN_H
#define MTRL_TESTS_TRAJGEN_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "common/traj.h"

typedef struct tg_rng {
    uint64_t s;
} tg_rng;

static inline uint64_t tg_u64(tg_rng *r) {
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
static inline uint32_t tg_below(tg_rng *r, uint32_t n) { return n ? (uint32_t)(tg_u64(r) % n) : 0; }
static inline double tg_unit(tg_rng *r) { return (double)(tg_u64(r) >> 11) / 9007199254740992.0; }

// Fills t (initialised) with a random episode: n_tokens tokens, routing of `width` ids
// (u16 when asked), `n_tools` tool calls with binary arguments and results, per-turn rewards.
// Logprobs include -0.0 and a NaN payload now and then, so bit-exactness is really tested.
static inline void tg_traj(mtrl_traj *t, tg_rng *r, uint64_t n_tokens, uint32_t width, int u16, uint32_t n_tools) {
    mtrl_traj_reset(t);
    t->episode_id = tg_u64(r);
    t->group_id = tg_u64(r);
    t->task_seed = tg_u64(r);
    char env[32];
    snprintf(env, sizeof env, "env-%u", tg_below(r, 1000));
    mtrl_traj_set_env(t, env);
    t->actor_id = tg_below(r, 64);
    t->incarnation = tg_below(r, 8);
    t->sample_seed = tg_u64(r);
    t->sample_stream = tg_u64(r);
    t->start_wall = 1.7e9 + tg_unit(r);
    mtrl_traj_set_routing(t, width, u16);
    uint32_t version = tg_below(r, 100);
    size_t rb = mtrl_traj_routing_row_bytes(t);
    uint8_t row[2 * 4096];
    for (uint64_t i = 0; i < n_tokens; i++) {
        if (tg_below(r, 64) == 0) version++;
        uint8_t kind = (uint8_t)tg_below(r, 4);
        float lp = -(float)tg_unit(r) * 10.0f;
        uint32_t pick = tg_below(r, 200);
        if (pick == 0) lp = -0.0f;
        if (pick == 1) {
            uint32_t nan = 0x7fc01234u;
            memcpy(&lp, &nan, 4);
        }
        for (size_t j = 0; j < rb; j++) row[j] = (uint8_t)tg_u64(r);
        mtrl_traj_append(t, (uint32_t)tg_u64(r), lp, version, kind, rb ? row : NULL);
    }
    uint32_t turns = tg_below(r, 5);
    for (uint32_t i = 0; i < turns; i++) mtrl_traj_add_turn_reward(t, tg_unit(r) - 0.5);
    for (uint32_t i = 0; i < n_tools; i++) {
        uint8_t args[64], res[200];
        uint32_t na = tg_below(r, sizeof args), nr = tg_below(r, sizeof res);
        for (uint32_t j = 0; j < na; j++) args[j] = (uint8_t)tg_u64(r); // NULs included
        for (uint32_t j = 0; j < nr; j++) res[j] = (uint8_t)tg_u64(r);
        int fail = tg_below(r, 3) == 0;
        mtrl_traj_add_tool_call(t, i, tg_below(r, 2) ? "search" : "calc", args, na, res, nr, tg_unit(r),
                                fail ? -3 : 0, fail ? "tool timed out" : NULL);
    }
    t->reward = tg_unit(r);
    t->status = tg_below(r, 2) ? MTRL_EP_COMPLETE : MTRL_EP_TRUNCATED;
    if (t->status == MTRL_EP_TRUNCATED) mtrl_traj_set_reason(t, "token budget of %llu spent",
                                                             (unsigned long long)n_tokens);
    t->end_wall = t->start_wall + 10 * tg_unit(r);
}

// Mutates buf[0..*n) in place (cap = capacity): bit flips, byte sets, truncation, insertion,
// deletion, or an "interesting" little-endian integer written over a random spot.
static inline void tg_mutate(tg_rng *r, uint8_t *buf, size_t *n, size_t cap) {
    int rounds = 1 + (int)tg_below(r, 4);
    for (int k = 0; k < rounds; k++) {
        size_t len = *n;
        switch (tg_below(r, 7)) {
        case 0:
            if (len) buf[tg_below(r, (uint32_t)len)] ^= (uint8_t)(1u << tg_below(r, 8));
            break;
        case 1:
            if (len) buf[tg_below(r, (uint32_t)len)] = (uint8_t)tg_u64(r);
            break;
        case 2:
            if (len) *n = tg_below(r, (uint32_t)len);
            break;
        case 3:
            if (len < cap) {
                size_t at = tg_below(r, (uint32_t)len + 1);
                memmove(buf + at + 1, buf + at, len - at);
                buf[at] = (uint8_t)tg_u64(r);
                *n = len + 1;
            }
            break;
        case 4:
            if (len) {
                size_t at = tg_below(r, (uint32_t)len);
                memmove(buf + at, buf + at + 1, len - at - 1);
                *n = len - 1;
            }
            break;
        default: {
            static const uint64_t vals[] = {0, 1, 0x7f, 0x80, 0xff, 0xffff, 0x7fffffff, 0xffffffffu,
                                            0x100000000ull, 0x7fffffffffffffffull, 0xffffffffffffffffull};
            uint64_t v = vals[tg_below(r, sizeof vals / sizeof vals[0])];
            uint32_t w = 1u << tg_below(r, 4); // 1, 2, 4 or 8 bytes
            if (len >= w) {
                size_t at = tg_below(r, (uint32_t)(len - w + 1));
                for (uint32_t j = 0; j < w; j++) buf[at + j] = (uint8_t)(v >> (8 * j));
            }
        }
        }
    }
}

#endif
