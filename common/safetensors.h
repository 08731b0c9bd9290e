// safetensors.h: reading and writing Hugging Face checkpoints in the safetensors layout, one
// file or a folder of shards with model.safetensors.index.json, without a second copy of the
// weights in host memory.
//
// The layout (checkpoint.h has mtrl's own use of it): u64 little-endian header length N, N bytes
// of JSON {"NAME": {"dtype": "BF16", "shape": [..], "data_offsets": [b, e]}, ...,
// "__metadata__": {...}}, then the data section. A sharded checkpoint is a folder with
// model-00001-of-0000K.safetensors ... and model.safetensors.index.json, whose "weight_map"
// names the shard of every tensor.
//
// Reading maps every file (mmap, read-only, private) and parses the headers with jansson. Every
// field is checked when the set is opened, before a caller reads a byte of data: the header
// length and each tensor's data_offsets must lie inside the file (a truncated shard is refused
// there, naming the file and the first tensor that runs past its end), the byte count must be
// the shape's, names are unique across shards, and every tensor the index names must be in the
// shard it names. mtrl_st_read then converts one tensor straight from the mapping into the
// caller's array (bf16, f16 or f32 on disk into f32 or f64): the page cache is the only other
// copy, and it is the kernel's to drop. Tensors read are marked, so a loader can name the ones
// it never placed (mtrl_st_unread).
//
// Writing (mtrl_st_write) converts the caller's arrays tensor by tensor into shards of at most
// max_shard bytes (bf16 or f32 on disk) with the index beside them, into a folder the caller
// makes, so a whole export can be written into a temporary folder and renamed (model_hf.h).
#ifndef MTRL_SAFETENSORS_H
#define MTRL_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "common/tensor.h"

#define MTRL_ST_MAX_DIMS 8

// On-disk dtypes. Only the floating ones convert; the others are listed to name them in errors.
typedef enum mtrl_st_dtype {
    MTRL_ST_F32, MTRL_ST_F16, MTRL_ST_BF16, MTRL_ST_F64, MTRL_ST_I64, MTRL_ST_I32, MTRL_ST_I16, MTRL_ST_I8,
    MTRL_ST_U8, MTRL_ST_BOOL, MTRL_ST_F8_E4M3, MTRL_ST_F8_E5M2, MTRL_ST_N_DTYPES
} mtrl_st_dtype;
const char *mtrl_st_dtype_name(mtrl_st_dtype dt); // "BF16", ...

typedef struct mtrl_st_tensor {
    char *name;
    mtrl_st_dtype dtype;
    int ndim;
    int64_t shape[MTRL_ST_MAX_DIMS];
    const unsigned char *data; // inside its file's mapping
    uint64_t nbytes;
    int file;                  // index into mtrl_st.files
    int read;                  // set by mtrl_st_read
} mtrl_st_tensor;

typedef struct mtrl_st_file {
    char *path;
    void *map;
    size_t len;
} mtrl_st_file;

typedef struct mtrl_st {
    char source[4096];   // what was opened (file or folder), for messages
    mtrl_st_file *files;
    int n_files;
    mtrl_st_tensor *t;   // sorted by name
    int n;
    uint64_t bytes_read; // data bytes mtrl_st_read has converted (GB/s of a load)
} mtrl_st;

// Opens path: a .safetensors file, or a folder holding model.safetensors.index.json (sharded)
// or model.safetensors. MTRL_ERR_IO (cannot open or map), MTRL_ERR_FORMAT (a header or index
// field out of range or malformed; a truncated file), MTRL_ERR_NOTFOUND (no checkpoint in the
// folder, or a tensor of the index missing from its shard): each message names the file and,
// where there is one, the tensor. On failure s holds nothing (no mapping is left open).
mtrl_status mtrl_st_open(mtrl_st *s, const char *path, mtrl_error *err);
void mtrl_st_close(mtrl_st *s);

// Index of the tensor named name, or -1.
int mtrl_st_find(const mtrl_st *s, const char *name);
// The file that holds tensor i (for messages).
const char *mtrl_st_path_of(const mtrl_st *s, int i);

// Converts tensor i into out (out_dtype MTRL_DT_F32 or MTRL_DT_F64; numel elements), after
// checking that its shape is (ndim, shape): MTRL_ERR_MISMATCH naming the file, the tensor and
// both shapes; MTRL_ERR_FORMAT naming them when its dtype does not convert (only F32, F16, BF16
// and F64 do). Marks the tensor read and adds its bytes to s->bytes_read.
mtrl_status mtrl_st_read(mtrl_st *s, int i, mtrl_dtype out_dtype, int ndim, const int64_t *shape, void *out,
                         mtrl_error *err);
// The checks of mtrl_st_read alone (shape, then dtype), reading nothing: a loader checks every
// tensor before it writes any value.
mtrl_status mtrl_st_check(const mtrl_st *s, int i, int ndim, const int64_t *shape, mtrl_error *err);
// The same, found by name: MTRL_ERR_NOTFOUND naming the tensor and the checkpoint when absent.
mtrl_status mtrl_st_read_name(mtrl_st *s, const char *name, mtrl_dtype out_dtype, int ndim, const int64_t *shape,
                              void *out, mtrl_error *err);
// The first tensor not read yet at or after index from, or -1.
int mtrl_st_unread(const mtrl_st *s, int from);

// One tensor to write: its name and shape, and its values as f32 or f64 (src_dtype).
typedef struct mtrl_st_entry {
    const char *name;
    int ndim;
    int64_t shape[MTRL_ST_MAX_DIMS];
    mtrl_dtype src_dtype; // MTRL_DT_F32 or MTRL_DT_F64
    const void *src;
} mtrl_st_entry;

// Writes the entries into the existing folder dir as disk_dtype (MTRL_DT_F32 or MTRL_DT_BF16,
// rounded to nearest even): model.safetensors when they fit in one shard of max_shard bytes,
// else model-0000i-of-0000K.safetensors and model.safetensors.index.json (tensors in order, a
// new shard when the next would overflow; a tensor larger than max_shard gets a shard of its
// own). meta: n_meta key/value pairs for every shard's __metadata__ (the index gets
// "total_size"). Each file is flushed and fsynced. MTRL_ERR_IO naming the file on failure (the
// caller removes the folder). *bytes_out (nullable) gets the data bytes written.
mtrl_status mtrl_st_write(const char *dir, const mtrl_st_entry *e, int n, mtrl_dtype disk_dtype, size_t max_shard,
                          const char *const *meta, int n_meta, uint64_t *bytes_out, mtrl_error *err);

#endif
