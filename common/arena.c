// arena.c: bump allocator (see arena.h).
#include "common/arena.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"

void mtrl_arena_init(mtrl_arena *a, size_t cap) {
    a->base = NULL;
    if (cap) {
        a->base = aligned_alloc(64, (cap + 63) & ~(size_t)63);
        MTRL_CHECKF(a->base != NULL, "out of memory reserving an arena of %zu bytes", cap);
    }
    a->cap = cap;
    a->used = 0;
    a->peak = 0;
    a->borrowed = 0;
}

void mtrl_arena_init_over(mtrl_arena *a, void *base, size_t cap) {
    MTRL_CHECKF(base != NULL || cap == 0, "arena over a NULL block of %zu bytes", cap);
    a->base = base;
    a->cap = cap;
    a->used = 0;
    a->peak = 0;
    a->borrowed = 1;
}

void mtrl_arena_free(mtrl_arena *a) {
    if (!a) return;
    if (!a->borrowed) free(a->base);
    memset(a, 0, sizeof *a);
}

void *mtrl_arena_try_alloc(mtrl_arena *a, size_t bytes, size_t align) {
    MTRL_CHECK(align && (align & (align - 1)) == 0);
    uintptr_t start = ((uintptr_t)a->base + a->used + align - 1) & ~(uintptr_t)(align - 1);
    size_t off = (size_t)(start - (uintptr_t)a->base);
    if (off > a->cap || bytes > a->cap - off) return NULL;
    a->used = off + bytes;
    if (a->used > a->peak) a->peak = a->used;
    return a->base + off;
}

void *mtrl_arena_alloc(mtrl_arena *a, size_t bytes) {
    void *p = mtrl_arena_try_alloc(a, bytes, 64);
    MTRL_CHECKF(p != NULL, "arena full: asked for %zu bytes with %zu of %zu used", bytes, a->used, a->cap);
    return p;
}

void *mtrl_arena_calloc(mtrl_arena *a, size_t bytes) {
    void *p = mtrl_arena_alloc(a, bytes);
    memset(p, 0, bytes);
    return p;
}

void mtrl_arena_release(mtrl_arena *a, size_t mark) {
    MTRL_CHECKF(mark <= a->used, "arena mark %zu is past the used size %zu", mark, a->used);
    a->used = mark;
}

void mtrl_arena_reset(mtrl_arena *a) { a->used = 0; }
