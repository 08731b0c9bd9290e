// tensor.c: named tensor tables (see tensor.h).
#include "common/tensor.h"

#include <stdlib.h>
#include <string.h>

#include "common/check.h"

size_t mtrl_dtype_size(mtrl_dtype dt) {
    switch (dt) {
    case MTRL_DT_F32: return 4;
    case MTRL_DT_F64: return 8;
    case MTRL_DT_BF16: return 2;
    case MTRL_DT_I32: return 4;
    case MTRL_DT_U8: return 1;
    }
    return 0;
}

static const char *dtype_names_[] = {"F32", "F64", "BF16", "I32", "U8"};

const char *mtrl_dtype_name(mtrl_dtype dt) { return dtype_names_[dt]; }

int mtrl_dtype_parse(const char *name) {
    for (int i = 0; i < 5; i++)
        if (!strcmp(name, dtype_names_[i])) return i;
    return -1;
}

void mtrl_tt_init(mtrl_tt *t) { memset(t, 0, sizeof *t); }

int mtrl_tt_add(mtrl_tt *t, const char *name, mtrl_dtype dtype, int ndim, const int64_t *shape) {
    MTRL_CHECKF(ndim >= 0 && ndim <= MTRL_TT_MAX_DIMS, "%s: %d dims", name, ndim);
    MTRL_CHECKF(strlen(name) < MTRL_TT_NAME_MAX, "tensor name too long: %s", name);
    MTRL_CHECKF(mtrl_tt_find(t, name) < 0, "duplicate tensor name %s", name);
    MTRL_CHECK(!t->base);
    if (t->n == t->cap) {
        t->cap = t->cap ? 2 * t->cap : 32;
        t->items = xrealloc(t->items, sizeof *t->items * (size_t)t->cap);
    }
    mtrl_tensor *x = &t->items[t->n];
    memset(x, 0, sizeof *x);
    strcpy(x->name, name);
    x->dtype = dtype;
    x->ndim = ndim;
    x->numel = 1;
    for (int i = 0; i < ndim; i++) {
        MTRL_CHECKF(shape[i] >= 0, "%s: negative dim", name);
        x->shape[i] = shape[i];
        x->numel *= (size_t)shape[i];
    }
    x->nbytes = x->numel * mtrl_dtype_size(dtype);
    return t->n++;
}

size_t mtrl_tt_layout(mtrl_tt *t) {
    size_t off = 0;
    for (int i = 0; i < t->n; i++) {
        t->items[i].offset = off;
        off += (t->items[i].nbytes + 63) & ~(size_t)63;
    }
    t->total = off;
    return off;
}

void mtrl_tt_point(mtrl_tt *t, void *base) {
    mtrl_tt_layout(t);
    t->base = base;
    for (int i = 0; i < t->n; i++) t->items[i].ptr = (char *)base + t->items[i].offset;
}

void mtrl_tt_alloc(mtrl_tt *t) {
    size_t total = mtrl_tt_layout(t);
    void *b = aligned_alloc(64, total ? total : 64);
    MTRL_CHECKF(b != NULL, "out of memory allocating a tensor table of %zu bytes", total);
    memset(b, 0, total);
    mtrl_tt_point(t, b);
    t->owns = 1;
}

int mtrl_tt_find(const mtrl_tt *t, const char *name) {
    for (int i = 0; i < t->n; i++)
        if (!strcmp(t->items[i].name, name)) return i;
    return -1;
}

void mtrl_tt_free(mtrl_tt *t) {
    if (!t) return;
    if (t->owns) free(t->base);
    free(t->items);
    memset(t, 0, sizeof *t);
}
