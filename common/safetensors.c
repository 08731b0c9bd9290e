// safetensors.c: mapped reader and sharded writer of Hugging Face checkpoints (see safetensors.h).
#include "common/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/bf16.h"
#include "common/check.h"
#include "common/checkpoint.h"

#define HEADER_MAX ((uint64_t)100 << 20) // a header over 100 MiB is refused as corrupt
#define INDEX_NAME "model.safetensors.index.json"
#define SINGLE_NAME "model.safetensors"

static const struct { const char *name; int size; } dtypes_[MTRL_ST_N_DTYPES] = {
    [MTRL_ST_F32] = {"F32", 4},  [MTRL_ST_F16] = {"F16", 2},          [MTRL_ST_BF16] = {"BF16", 2},
    [MTRL_ST_F64] = {"F64", 8},  [MTRL_ST_I64] = {"I64", 8},          [MTRL_ST_I32] = {"I32", 4},
    [MTRL_ST_I16] = {"I16", 2},  [MTRL_ST_I8] = {"I8", 1},            [MTRL_ST_U8] = {"U8", 1},
    [MTRL_ST_BOOL] = {"BOOL", 1}, [MTRL_ST_F8_E4M3] = {"F8_E4M3", 1}, [MTRL_ST_F8_E5M2] = {"F8_E5M2", 1},
};

const char *mtrl_st_dtype_name(mtrl_st_dtype dt) { return dt < MTRL_ST_N_DTYPES ? dtypes_[dt].name : "?"; }

static int dtype_parse_(const char *s) {
    for (int i = 0; i < MTRL_ST_N_DTYPES; i++)
        if (!strcmp(s, dtypes_[i].name)) return i;
    return -1;
}

static void shape_str_(char *out, size_t cap, int ndim, const int64_t *shape) {
    size_t n = (size_t)snprintf(out, cap, "[");
    for (int d = 0; d < ndim && n < cap; d++) n += (size_t)snprintf(out + n, cap - n, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (n < cap) snprintf(out + n, cap - n, "]");
}

// ---- opening ------------------------------------------------------------------------------------------

static mtrl_status map_file_(mtrl_st_file *f, const char *path, mtrl_error *err) {
    memset(f, 0, sizeof *f);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return mtrl_error_set(err, errno == ENOENT ? MTRL_ERR_NOTFOUND : MTRL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return mtrl_error_set(err, MTRL_ERR_IO, "%s: not a regular file", path);
    }
    f->path = xstrdup(path);
    f->len = (size_t)st.st_size;
    if (f->len > 0) {
        f->map = mmap(NULL, f->len, PROT_READ, MAP_PRIVATE, fd, 0);
        if (f->map == MAP_FAILED) {
            int e = errno;
            close(fd);
            free(f->path);
            memset(f, 0, sizeof *f);
            return mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot map: %s", path, strerror(e));
        }
        // The loader reads each tensor once, front to back: let the kernel read ahead.
        madvise(f->map, f->len, MADV_SEQUENTIAL);
    }
    close(fd);
    return MTRL_OK;
}

static void unmap_file_(mtrl_st_file *f) {
    if (f->map && f->len) munmap(f->map, f->len);
    free(f->path);
    memset(f, 0, sizeof *f);
}

static int json_u64_(json_t *v, uint64_t *out) {
    if (!json_is_integer(v) || json_integer_value(v) < 0) return 0;
    *out = (uint64_t)json_integer_value(v);
    return 1;
}

// Parses the header of file fi and appends its tensors to s.
static mtrl_status parse_header_(mtrl_st *s, int fi, mtrl_error *err) {
    const mtrl_st_file *f = &s->files[fi];
    const unsigned char *p = f->map;
    if (f->len < 8) return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: %zu bytes, shorter than the 8-byte header length: truncated", f->path, f->len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | p[i];
    if (hlen > HEADER_MAX || hlen > f->len - 8)
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: header length %llu is out of range (file of %zu bytes): truncated or not safetensors",
                              f->path, (unsigned long long)hlen, f->len);
    json_error_t je;
    json_t *root = json_loadb((const char *)p + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &je);
    if (!root || !json_is_object(root)) {
        json_decref(root);
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: header is not a JSON object: %s (column %d)", f->path,
                              root ? "" : je.text, je.column);
    }
    uint64_t data_start = 8 + hlen, data_len = f->len - data_start;
    const char *key;
    json_t *v;
    mtrl_status st = MTRL_OK;
    json_object_foreach(root, key, v) {
        if (!strcmp(key, "__metadata__")) continue;
        json_t *dt = json_object_get(v, "dtype"), *sh = json_object_get(v, "shape"), *off = json_object_get(v, "data_offsets");
        int d = json_is_string(dt) ? dtype_parse_(json_string_value(dt)) : -1;
        uint64_t b, e;
        if (!json_is_object(v) || d < 0 || !json_is_array(sh) || json_array_size(sh) > MTRL_ST_MAX_DIMS || !json_is_array(off) ||
            json_array_size(off) != 2 || !json_u64_(json_array_get(off, 0), &b) || !json_u64_(json_array_get(off, 1), &e) || b > e) {
            st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: tensor %s: malformed header entry (dtype %s, shape, data_offsets [begin, end])",
                                f->path, key, json_is_string(dt) ? json_string_value(dt) : "missing");
            break;
        }
        if (e > data_len) {
            st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: tensor %s: data_offsets [%llu, %llu] run past the data section (%llu bytes): the file is truncated",
                                f->path, key, (unsigned long long)b, (unsigned long long)e, (unsigned long long)data_len);
            break;
        }
        mtrl_st_tensor t = {0};
        t.dtype = (mtrl_st_dtype)d;
        t.ndim = (int)json_array_size(sh);
        uint64_t numel = 1;
        int ok = 1;
        for (int k = 0; k < t.ndim; k++) {
            uint64_t x = 0;
            ok &= json_u64_(json_array_get(sh, (size_t)k), &x) && x < ((uint64_t)1 << 40);
            t.shape[k] = (int64_t)x;
            numel *= ok ? x : 1;
        }
        if (!ok || numel * (uint64_t)dtypes_[d].size != e - b) {
            st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: tensor %s: %llu data bytes do not match its shape and dtype %s",
                                f->path, key, (unsigned long long)(e - b), dtypes_[d].name);
            break;
        }
        t.name = xstrdup(key);
        t.data = p + data_start + b;
        t.nbytes = e - b;
        t.file = fi;
        s->t = xrealloc(s->t, sizeof *s->t * (size_t)(s->n + 1));
        s->t[s->n++] = t;
    }
    json_decref(root);
    return st;
}

static int cmp_tensor_(const void *a, const void *b) {
    return strcmp(((const mtrl_st_tensor *)a)->name, ((const mtrl_st_tensor *)b)->name);
}

static void join_(char *out, size_t cap, const char *dir, const char *name) {
    snprintf(out, cap, "%s%s%s", dir, dir[0] && dir[strlen(dir) - 1] == '/' ? "" : "/", name);
}

// A folder's shards, from its index: the distinct files of weight_map, in first-seen order,
// after checking each value is a plain file name in the folder.
static mtrl_status open_index_(mtrl_st *s, const char *dir, const char *index, json_t **map_out, mtrl_error *err) {
    json_error_t je;
    json_t *root = json_load_file(index, JSON_REJECT_DUPLICATES, &je);
    if (!root) return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s:%d:%d: %s", index, je.line, je.column, je.text);
    json_t *map = json_object_get(root, "weight_map");
    if (!json_is_object(map)) {
        json_decref(root);
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: no \"weight_map\" object", index);
    }
    const char *key;
    json_t *v;
    mtrl_status st = MTRL_OK;
    json_object_foreach(map, key, v) {
        const char *fn = json_string_value(v);
        if (!fn || !fn[0] || strchr(fn, '/') || !strcmp(fn, "..")) {
            st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: weight_map[\"%s\"]: expected a file name in the folder", index, key);
            break;
        }
        char path[8192];
        join_(path, sizeof path, dir, fn);
        int have = 0;
        for (int i = 0; i < s->n_files && !have; i++) have = !strcmp(s->files[i].path, path);
        if (have) continue;
        s->files = xrealloc(s->files, sizeof *s->files * (size_t)(s->n_files + 1));
        if ((st = map_file_(&s->files[s->n_files], path, err)) != MTRL_OK) {
            mtrl_error_wrap(err, "%s names shard %s for tensor %s", index, fn, key);
            break;
        }
        s->n_files++;
    }
    if (st != MTRL_OK) json_decref(root);
    else *map_out = root;
    return st;
}

mtrl_status mtrl_st_open(mtrl_st *s, const char *path, mtrl_error *err) {
    memset(s, 0, sizeof *s);
    snprintf(s->source, sizeof s->source, "%s", path);
    struct stat st;
    if (stat(path, &st) != 0)
        return mtrl_error_set(err, errno == ENOENT ? MTRL_ERR_NOTFOUND : MTRL_ERR_IO, "%s: %s", path, strerror(errno));
    json_t *index_root = NULL;
    char index[8192] = "";
    mtrl_status rc = MTRL_OK;
    if (S_ISDIR(st.st_mode)) {
        char single[8192];
        join_(index, sizeof index, path, INDEX_NAME);
        join_(single, sizeof single, path, SINGLE_NAME);
        if (access(index, F_OK) == 0) {
            rc = open_index_(s, path, index, &index_root, err);
        } else if (access(single, F_OK) == 0) {
            index[0] = 0;
            s->files = xcalloc(1, sizeof *s->files);
            if ((rc = map_file_(&s->files[0], single, err)) == MTRL_OK) s->n_files = 1;
        } else {
            rc = mtrl_error_set(err, MTRL_ERR_NOTFOUND, "%s: no %s or %s in the folder", path, INDEX_NAME, SINGLE_NAME);
        }
    } else {
        s->files = xcalloc(1, sizeof *s->files);
        if ((rc = map_file_(&s->files[0], path, err)) == MTRL_OK) s->n_files = 1;
    }
    for (int i = 0; rc == MTRL_OK && i < s->n_files; i++) rc = parse_header_(s, i, err);
    if (rc == MTRL_OK) {
        qsort(s->t, (size_t)s->n, sizeof *s->t, cmp_tensor_);
        for (int i = 1; i < s->n && rc == MTRL_OK; i++)
            if (!strcmp(s->t[i - 1].name, s->t[i].name))
                rc = mtrl_error_set(err, MTRL_ERR_FORMAT, "tensor %s is in both %s and %s", s->t[i].name,
                                    s->files[s->t[i - 1].file].path, s->files[s->t[i].file].path);
    }
    if (rc == MTRL_OK && index_root) {
        // Every tensor of the index must be in the shard it names, and no shard may hold one the
        // index does not name (a stale shard of another checkpoint in the folder).
        json_t *map = json_object_get(index_root, "weight_map"), *v;
        const char *key;
        json_object_foreach(map, key, v) {
            int i = mtrl_st_find(s, key);
            char want[8192];
            join_(want, sizeof want, path, json_string_value(v));
            if (i < 0) {
                rc = mtrl_error_set(err, MTRL_ERR_NOTFOUND, "%s: tensor %s: the index places it in %s, which does not hold it",
                                    index, key, want);
                break;
            }
            if (strcmp(s->files[s->t[i].file].path, want)) {
                rc = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: tensor %s: the index places it in %s, but it is in %s", index,
                                    key, want, s->files[s->t[i].file].path);
                break;
            }
        }
        for (int i = 0; rc == MTRL_OK && i < s->n; i++)
            if (!json_object_get(map, s->t[i].name))
                rc = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: tensor %s is not in the index %s", s->files[s->t[i].file].path,
                                    s->t[i].name, index);
    }
    json_decref(index_root);
    if (rc != MTRL_OK) mtrl_st_close(s);
    return rc;
}

void mtrl_st_close(mtrl_st *s) {
    for (int i = 0; i < s->n; i++) free(s->t[i].name);
    free(s->t);
    for (int i = 0; i < s->n_files; i++) unmap_file_(&s->files[i]);
    free(s->files);
    memset(s, 0, sizeof *s);
}

int mtrl_st_find(const mtrl_st *s, const char *name) {
    int lo = 0, hi = s->n - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2, c = strcmp(s->t[mid].name, name);
        if (!c) return mid;
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

const char *mtrl_st_path_of(const mtrl_st *s, int i) { return s->files[s->t[i].file].path; }

int mtrl_st_unread(const mtrl_st *s, int from) {
    for (int i = from < 0 ? 0 : from; i < s->n; i++)
        if (!s->t[i].read) return i;
    return -1;
}

// ---- conversion ---------------------------------------------------------------------------------------

static float f16_to_f32_(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, ex = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (ex == 0x1f) u = sign | 0x7f800000u | (man << 13); // inf, NaN
    else if (ex) u = sign | ((ex + 112) << 23) | (man << 13);
    else if (!man) u = sign;
    else { // subnormal: normalise
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// Element j of a little-endian floating tensor as a double (exact for every source dtype).
static inline double load_(const unsigned char *p, mtrl_st_dtype dt, size_t j) {
    switch (dt) {
    case MTRL_ST_F32: { float f; memcpy(&f, p + 4 * j, 4); return f; }
    case MTRL_ST_BF16: { uint16_t h; memcpy(&h, p + 2 * j, 2); return mtrl_bf16_to_f32(h); }
    case MTRL_ST_F16: { uint16_t h; memcpy(&h, p + 2 * j, 2); return f16_to_f32_(h); }
    default: { double d; memcpy(&d, p + 8 * j, 8); return d; }
    }
}

// Converts n elements; in parallel blocks for large tensors (the load is memory-bound: one pass
// over the mapping, one over the destination).
static void convert_(const unsigned char *p, mtrl_st_dtype dt, size_t n, mtrl_dtype out_dtype, void *out) {
    enum { BLOCK = 1 << 16 };
    long nb = (long)((n + BLOCK - 1) / BLOCK);
#pragma omp parallel for schedule(static) if (nb > 4)
    for (long b = 0; b < nb; b++) {
        size_t j0 = (size_t)b * BLOCK, j1 = j0 + BLOCK < n ? j0 + BLOCK : n;
        if (out_dtype == MTRL_DT_F32 && dt == MTRL_ST_F32) {
            memcpy((float *)out + j0, p + 4 * j0, 4 * (j1 - j0));
        } else if (out_dtype == MTRL_DT_F32 && dt == MTRL_ST_BF16) {
            uint32_t *o = (uint32_t *)out;
            for (size_t j = j0; j < j1; j++) {
                uint16_t h;
                memcpy(&h, p + 2 * j, 2);
                o[j] = (uint32_t)h << 16; // bf16 is the top half of an fp32
            }
        } else if (out_dtype == MTRL_DT_F32) {
            float *o = out;
            for (size_t j = j0; j < j1; j++) o[j] = (float)load_(p, dt, j);
        } else {
            double *o = out;
            for (size_t j = j0; j < j1; j++) o[j] = load_(p, dt, j);
        }
    }
}

mtrl_status mtrl_st_check(const mtrl_st *s, int i, int ndim, const int64_t *shape, mtrl_error *err) {
    MTRL_CHECK(i >= 0 && i < s->n);
    const mtrl_st_tensor *t = &s->t[i];
    int same = t->ndim == ndim;
    for (int d = 0; same && d < ndim; d++) same = t->shape[d] == shape[d];
    if (!same) {
        char a[160], b[160];
        shape_str_(a, sizeof a, t->ndim, t->shape);
        shape_str_(b, sizeof b, ndim, shape);
        return mtrl_error_set(err, MTRL_ERR_MISMATCH, "%s: tensor %s has shape %s, the model needs %s", mtrl_st_path_of(s, i),
                              t->name, a, b);
    }
    if (t->dtype != MTRL_ST_F32 && t->dtype != MTRL_ST_BF16 && t->dtype != MTRL_ST_F16 && t->dtype != MTRL_ST_F64)
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: tensor %s has dtype %s; mtrl reads F32, F16, BF16 and F64 weights",
                              mtrl_st_path_of(s, i), t->name, dtypes_[t->dtype].name);
    return MTRL_OK;
}

mtrl_status mtrl_st_read(mtrl_st *s, int i, mtrl_dtype out_dtype, int ndim, const int64_t *shape, void *out,
                         mtrl_error *err) {
    MTRL_CHECK(out_dtype == MTRL_DT_F32 || out_dtype == MTRL_DT_F64);
    mtrl_status st = mtrl_st_check(s, i, ndim, shape, err);
    if (st != MTRL_OK) return st;
    mtrl_st_tensor *t = &s->t[i];
    size_t n = (size_t)(t->nbytes / (uint64_t)dtypes_[t->dtype].size);
    convert_(t->data, t->dtype, n, out_dtype, out);
    t->read = 1;
    s->bytes_read += t->nbytes;
    return MTRL_OK;
}

mtrl_status mtrl_st_read_name(mtrl_st *s, const char *name, mtrl_dtype out_dtype, int ndim, const int64_t *shape,
                              void *out, mtrl_error *err) {
    int i = mtrl_st_find(s, name);
    if (i < 0) return mtrl_error_set(err, MTRL_ERR_NOTFOUND, "%s: tensor %s is missing", s->source, name);
    return mtrl_st_read(s, i, out_dtype, ndim, shape, out, err);
}

// ---- writing ------------------------------------------------------------------------------------------

static size_t numel_(const mtrl_st_entry *e) {
    size_t n = 1;
    for (int d = 0; d < e->ndim; d++) n *= (size_t)e->shape[d];
    return n;
}


// Writes entries [a, b) as one file.
static mtrl_status write_shard_(const char *path, const mtrl_st_entry *e, int a, int b, mtrl_dtype disk, size_t esz,
                                const char *const *meta, int n_meta, mtrl_error *err) {
    char *hdr = NULL;
    size_t hlen = 0;
    FILE *h = open_memstream(&hdr, &hlen);
    MTRL_CHECK(h);
    fputc('{', h);
    if (n_meta > 0) mtrl_ckpt_json_meta(h, meta, n_meta);
    uint64_t off = 0;
    for (int i = a; i < b; i++) {
        if (i > a || n_meta > 0) fputc(',', h);
        mtrl_ckpt_json_str(h, e[i].name);
        fprintf(h, ":{\"dtype\":\"%s\",\"shape\":[", disk == MTRL_DT_BF16 ? "BF16" : "F32");
        for (int d = 0; d < e[i].ndim; d++) fprintf(h, "%s%lld", d ? "," : "", (long long)e[i].shape[d]);
        uint64_t nb = numel_(&e[i]) * esz;
        fprintf(h, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off, (unsigned long long)(off + nb));
        off += nb;
    }
    fputc('}', h);
    fclose(h);
    hdr = xrealloc(hdr, hlen + 8);
    while (hlen % 8) hdr[hlen++] = ' '; // padded to 8 bytes, as the reference writer does
    FILE *f = fopen(path, "wb");
    if (!f) {
        free(hdr);
        return mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    }
    unsigned char len8[8];
    for (int k = 0; k < 8; k++) len8[k] = (unsigned char)((uint64_t)hlen >> (8 * k));
    int bad = fwrite(len8, 1, 8, f) != 8 || fwrite(hdr, 1, hlen, f) != hlen;
    free(hdr);
    enum { CHUNK = 1 << 16 };
    unsigned char *buf = xmalloc(CHUNK * 4);
    for (int i = a; i < b && !bad; i++) {
        size_t n = numel_(&e[i]);
        for (size_t j0 = 0; j0 < n && !bad; j0 += CHUNK) {
            size_t m = n - j0 < CHUNK ? n - j0 : CHUNK;
            for (size_t j = 0; j < m; j++) {
                double v = e[i].src_dtype == MTRL_DT_F64 ? ((const double *)e[i].src)[j0 + j] : ((const float *)e[i].src)[j0 + j];
                if (disk == MTRL_DT_BF16) {
                    uint16_t x = mtrl_bf16_from_f32((float)v);
                    memcpy(buf + 2 * j, &x, 2);
                } else {
                    float x = (float)v;
                    memcpy(buf + 4 * j, &x, 4);
                }
            }
            bad = fwrite(buf, esz, m, f) != m;
        }
    }
    free(buf);
    bad |= fflush(f) != 0 || fsync(fileno(f)) != 0;
    int e2 = errno;
    bad |= fclose(f) != 0;
    if (bad) return mtrl_error_set(err, MTRL_ERR_IO, "%s: write failed: %s", path, strerror(e2 ? e2 : errno));
    return MTRL_OK;
}

mtrl_status mtrl_st_write(const char *dir, const mtrl_st_entry *e, int n, mtrl_dtype disk_dtype, size_t max_shard,
                          const char *const *meta, int n_meta, uint64_t *bytes_out, mtrl_error *err) {
    MTRL_CHECK(disk_dtype == MTRL_DT_F32 || disk_dtype == MTRL_DT_BF16);
    size_t esz = disk_dtype == MTRL_DT_BF16 ? 2 : 4;
    // Shard boundaries: start[k] .. start[k+1].
    int *start = xmalloc(sizeof(int) * (size_t)(n + 2));
    int k = 0;
    uint64_t cur = 0, total = 0;
    start[k++] = 0;
    for (int i = 0; i < n; i++) {
        uint64_t nb = numel_(&e[i]) * esz;
        if (cur > 0 && cur + nb > max_shard) {
            start[k++] = i;
            cur = 0;
        }
        cur += nb;
        total += nb;
    }
    start[k] = n;
    int shards = k;
    mtrl_status st = MTRL_OK;
    char path[8192], fn[64];
    FILE *idx = NULL;
    char ipath[8192];
    if (shards > 1) {
        join_(ipath, sizeof ipath, dir, INDEX_NAME);
        idx = fopen(ipath, "w");
        if (!idx) st = mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot create: %s", ipath, strerror(errno));
        else fprintf(idx, "{\n  \"metadata\": {\"total_size\": %llu},\n  \"weight_map\": {", (unsigned long long)total);
    }
    for (int s = 0; s < shards && st == MTRL_OK; s++) {
        if (shards == 1) snprintf(fn, sizeof fn, "%s", SINGLE_NAME);
        else snprintf(fn, sizeof fn, "model-%05d-of-%05d.safetensors", s + 1, shards);
        join_(path, sizeof path, dir, fn);
        st = write_shard_(path, e, start[s], start[s + 1], disk_dtype, esz, meta, n_meta, err);
        for (int i = start[s]; idx && i < start[s + 1]; i++) {
            fprintf(idx, "%s\n    ", i ? "," : "");
            mtrl_ckpt_json_str(idx, e[i].name);
            fprintf(idx, ": \"%s\"", fn);
        }
    }
    if (idx) {
        fprintf(idx, "\n  }\n}\n");
        int bad = ferror(idx) || fflush(idx) != 0 || fsync(fileno(idx)) != 0;
        bad |= fclose(idx) != 0;
        if (bad && st == MTRL_OK) st = mtrl_error_set(err, MTRL_ERR_IO, "%s: write failed: %s", ipath, strerror(errno));
    }
    free(start);
    if (bytes_out) *bytes_out = st == MTRL_OK ? total : 0;
    return st;
}
