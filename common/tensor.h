// tensor.h: named tensor tables with one allocation per lifetime class (as llm.c does).
//
// A table lists tensors (name, dtype, shape); mtrl_tt_layout assigns each an offset (64-byte
// aligned) in one block; mtrl_tt_alloc makes that block and points every tensor into it.
// Parameters, gradients and optimizer moments share one layout: the same offsets in blocks of
// the same size, so a flat loop over the block is a loop over every parameter. Checkpoints are
// a table plus its block (common/checkpoint.h).
//     mtrl_tt t; mtrl_tt_init(&t);
//     int i = mtrl_tt_add(&t, "layers.0.wq", MTRL_DT_F32, 2, (int64_t[]){64, 32});
//     mtrl_tt_alloc(&t);  float *wq = t.items[i].ptr;  ...  mtrl_tt_free(&t);
#ifndef MTRL_TENSOR_H
#define MTRL_TENSOR_H

#include <stddef.h>
#include <stdint.h>

typedef enum mtrl_dtype { MTRL_DT_F32, MTRL_DT_F64, MTRL_DT_BF16, MTRL_DT_I32, MTRL_DT_U8 } mtrl_dtype;

size_t mtrl_dtype_size(mtrl_dtype dt);
const char *mtrl_dtype_name(mtrl_dtype dt);    // safetensors names: F32, F64, BF16, I32, U8
int mtrl_dtype_parse(const char *name);        // -1 when unknown

#define MTRL_TT_NAME_MAX 96
#define MTRL_TT_MAX_DIMS 4

typedef struct mtrl_tensor {
    char name[MTRL_TT_NAME_MAX];
    mtrl_dtype dtype;
    int ndim;
    int64_t shape[MTRL_TT_MAX_DIMS];
    size_t numel;
    size_t offset;   // bytes from the start of the block
    size_t nbytes;
    void *ptr;       // into the block once allocated or pointed
} mtrl_tensor;

typedef struct mtrl_tt {
    mtrl_tensor *items;
    int n, cap;
    size_t total;    // bytes of the block (after mtrl_tt_layout)
    void *base;      // the block
    int owns;        // 1 when mtrl_tt_alloc made the block
} mtrl_tt;

void mtrl_tt_init(mtrl_tt *t);
// Adds a tensor; returns its index. Names must be unique (checked).
int mtrl_tt_add(mtrl_tt *t, const char *name, mtrl_dtype dtype, int ndim, const int64_t *shape);
// Assigns offsets; returns the block size in bytes.
size_t mtrl_tt_layout(mtrl_tt *t);
// Lays out (if needed) and allocates the zeroed block.
void mtrl_tt_alloc(mtrl_tt *t);
// Points the tensors into a block owned by someone else (of at least t->total bytes).
void mtrl_tt_point(mtrl_tt *t, void *base);
// Index of a name, or -1.
int mtrl_tt_find(const mtrl_tt *t, const char *name);
void mtrl_tt_free(mtrl_tt *t);

#endif
