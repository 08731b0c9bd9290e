// arena.h: a bump allocator for per-step scratch.
//
// One block reserved at init; alloc bumps an offset (aligned to 64 bytes by default); reset
// frees everything at once; mark/release free everything allocated after a mark (nested
// scopes). The arena never grows: running past its capacity is an invariant failure, because
// capacities are planned from the model's shapes at init. peak records the high-water mark so
// a memory planner can report and tests can measure it.
//     mtrl_arena a; mtrl_arena_init(&a, 1 << 20);
//     float *x = mtrl_arena_alloc(&a, n * sizeof *x);
//     size_t m = mtrl_arena_mark(&a); ... mtrl_arena_release(&a, m);
//     mtrl_arena_free(&a);
#ifndef MTRL_ARENA_H
#define MTRL_ARENA_H

#include <stddef.h>

typedef struct mtrl_arena {
    unsigned char *base;
    size_t cap;   // bytes reserved
    size_t used;  // bytes handed out (including alignment padding)
    size_t peak;  // largest `used` ever reached
    int borrowed; // base belongs to the caller (mtrl_arena_init_over)
} mtrl_arena;

void mtrl_arena_init(mtrl_arena *a, size_t cap);
// An arena over the caller's block [base, base + cap), e.g. device memory: the arena only does
// address arithmetic on it (never reads or writes it, except mtrl_arena_calloc, which must not
// be used on memory the host cannot write). mtrl_arena_free forgets the block without freeing it.
void mtrl_arena_init_over(mtrl_arena *a, void *base, size_t cap);
void mtrl_arena_free(mtrl_arena *a); // harmless on a zeroed or freed arena

// Uninitialised memory, 64-byte aligned. Aborts (check.h) when the arena is full.
void *mtrl_arena_alloc(mtrl_arena *a, size_t bytes);
// Zero-filled.
void *mtrl_arena_calloc(mtrl_arena *a, size_t bytes);
// Returns NULL instead of aborting when the request does not fit.
void *mtrl_arena_try_alloc(mtrl_arena *a, size_t bytes, size_t align);

static inline size_t mtrl_arena_mark(const mtrl_arena *a) { return a->used; }
void mtrl_arena_release(mtrl_arena *a, size_t mark);
void mtrl_arena_reset(mtrl_arena *a);

#endif
