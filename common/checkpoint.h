// checkpoint.h: tensors in the safetensors layout, on disk or in memory.
//
// Layout (https://github.com/huggingface/safetensors): u64 little-endian header length N, then
// N bytes of JSON {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
// "__metadata__": {"key": "value", ...}}, then the raw little-endian tensor bytes. Any
// safetensors reader opens our checkpoints. We use the same bytes for the weights a learner
// publishes to its actors (written to memory, sent over the wire, read from memory).
//
// Writing a file goes to PATH.tmp, is flushed and fsynced, then renamed over PATH, so a crash
// never leaves a half-written checkpoint under the real name. Reading checks every header
// field and that offsets lie inside the file before any data is read; a tensor whose dtype or
// shape differs from what the caller expects is refused with a message naming it.
#ifndef MTRL_CHECKPOINT_H
#define MTRL_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/status.h"
#include "common/tensor.h"

typedef struct mtrl_ckpt_entry {
    const char *name;
    mtrl_dtype dtype;
    int ndim;
    int64_t shape[MTRL_TT_MAX_DIMS];
    const void *data;
    size_t nbytes;
} mtrl_ckpt_entry;

// Writes s as a JSON string (quotes, escapes) to f: the names and metadata of a safetensors
// header (also common/safetensors.c's writer).
void mtrl_ckpt_json_str(FILE *f, const char *s);
// Writes "__metadata__":{"k":"v",...} from n_meta key/value pairs (meta[2i], meta[2i+1]).
void mtrl_ckpt_json_meta(FILE *f, const char *const *meta, int n_meta);

// Writes entries and metadata (n_meta key/value pairs, meta[2i] = key, meta[2i+1] = value).
mtrl_status mtrl_ckpt_write_file(const char *path, const mtrl_ckpt_entry *e, int n, const char *const *meta,
                                 int n_meta, mtrl_error *err);
// The same into a malloc'ed buffer (*out, *out_len); the caller frees *out.
mtrl_status mtrl_ckpt_write_mem(void **out, size_t *out_len, const mtrl_ckpt_entry *e, int n,
                                const char *const *meta, int n_meta, mtrl_error *err);
// The same, but the nbytes of every entry whose data is NULL are left for the caller to fill
// (e.g. converted straight into the buffer, with no copy in between): data_at [n] receives
// where each entry's bytes start in *out (a multiple of the element size: the header is padded
// to 8 bytes and every tensor before is whole).
mtrl_status mtrl_ckpt_write_mem_at(void **out, size_t *out_len, const mtrl_ckpt_entry *e, int n,
                                   const char *const *meta, int n_meta, size_t *data_at, mtrl_error *err);

typedef struct mtrl_ckpt_tensor {
    char name[MTRL_TT_NAME_MAX];
    mtrl_dtype dtype;
    int ndim;
    int64_t shape[MTRL_TT_MAX_DIMS];
    uint64_t begin, end;  // byte offsets into the data section
} mtrl_ckpt_tensor;

typedef struct mtrl_ckpt {
    char source[256];     // file path or "<memory>" for messages
    FILE *f;
    uint64_t data_start;  // byte offset of the data section
    uint64_t data_len;
    mtrl_ckpt_tensor *t;
    int n;
    char **meta;          // key, value, key, value, ...
    int n_meta;
} mtrl_ckpt;

mtrl_status mtrl_ckpt_open_file(mtrl_ckpt *c, const char *path, mtrl_error *err);
// Whether the file at path is the one a run store recorded when it was written (digest: the
// sha256 hex of the checkpoints table). MTRL_ERR_MISMATCH naming both digests when the file
// changed since (overwritten by another run, edited, truncated); MTRL_OK when it matches or no
// digest was recorded (NULL or ""); MTRL_ERR_IO when it cannot be read. Every reader of a run's
// checkpoint (--resume, replay --rescore / --reexec, eval) calls it before loading.
mtrl_status mtrl_ckpt_verify_digest(const char *path, const char *digest, mtrl_error *err);
// Reads from caller-owned memory that must outlive the handle.
mtrl_status mtrl_ckpt_open_mem(mtrl_ckpt *c, const void *buf, size_t len, mtrl_error *err);
void mtrl_ckpt_close(mtrl_ckpt *c);

const char *mtrl_ckpt_meta(const mtrl_ckpt *c, const char *key); // NULL when absent
int mtrl_ckpt_find(const mtrl_ckpt *c, const char *name);        // index or -1

// Reads tensor `name` into out after checking dtype and shape. MTRL_ERR_MISMATCH names the
// tensor and both shapes; MTRL_ERR_NOTFOUND when absent.
mtrl_status mtrl_ckpt_read(mtrl_ckpt *c, const char *name, mtrl_dtype dtype, int ndim, const int64_t *shape, void *out,
                           mtrl_error *err);

#endif
