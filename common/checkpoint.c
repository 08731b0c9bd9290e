// checkpoint.c: safetensors writer and reader (see checkpoint.h).
#include "common/checkpoint.h"
#include "common/hash.h"

#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/check.h"
#include "common/fsutil.h"

#define HEADER_MAX ((uint64_t)100 << 20) // a header over 100 MiB is refused as corrupt

// ---- writing ------------------------------------------------------------------------------------------

void mtrl_ckpt_json_meta(FILE *f, const char *const *meta, int n_meta) {
    fprintf(f, "\"__metadata__\":{");
    for (int i = 0; i < n_meta; i++) {
        if (i) fputc(',', f);
        mtrl_ckpt_json_str(f, meta[2 * i]);
        fputc(':', f);
        mtrl_ckpt_json_str(f, meta[2 * i + 1]);
    }
    fputc('}', f);
}

void mtrl_ckpt_json_str(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\') fprintf(f, "\\%c", ch);
        else if (ch < 0x20) fprintf(f, "\\u%04x", ch);
        else fputc(ch, f);
    }
    fputc('"', f);
}

// The safetensors header: u64 length, then the JSON padded with spaces to a multiple of 8 (as
// the reference writer does). Returns the malloc'd prefix (length + JSON) and its size.
static unsigned char *header_build_(const mtrl_ckpt_entry *e, int n, const char *const *meta, int n_meta,
                                    size_t *prefix_len) {
    char *hdr = NULL;
    size_t hlen = 0;
    FILE *h = open_memstream(&hdr, &hlen);
    if (!h) return NULL;
    fputc('{', h);
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        if (i) fputc(',', h);
        mtrl_ckpt_json_str(h, e[i].name);
        fprintf(h, ":{\"dtype\":\"%s\",\"shape\":[", mtrl_dtype_name(e[i].dtype));
        for (int d = 0; d < e[i].ndim; d++) fprintf(h, "%s%lld", d ? "," : "", (long long)e[i].shape[d]);
        fprintf(h, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off, (unsigned long long)(off + e[i].nbytes));
        off += e[i].nbytes;
    }
    if (n_meta > 0) {
        if (n) fputc(',', h);
        mtrl_ckpt_json_meta(h, meta, n_meta);
    }
    fputc('}', h);
    fclose(h);
    uint64_t padded = (hlen + 7) & ~(uint64_t)7;
    unsigned char *p = xmalloc(8 + padded);
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(padded >> (8 * i));
    memcpy(p + 8, hdr, hlen);
    memset(p + 8 + hlen, ' ', padded - hlen);
    free(hdr);
    *prefix_len = 8 + padded;
    return p;
}

static int write_stream_(FILE *f, const mtrl_ckpt_entry *e, int n, const char *const *meta, int n_meta) {
    size_t plen;
    unsigned char *prefix = header_build_(e, n, meta, n_meta, &plen);
    if (!prefix) return -1;
    int bad = fwrite(prefix, 1, plen, f) != plen;
    free(prefix);
    for (int i = 0; i < n && !bad; i++) bad = fwrite(e[i].data, 1, e[i].nbytes, f) != e[i].nbytes;
    return bad ? -1 : 0;
}

mtrl_status mtrl_ckpt_write_file(const char *path, const mtrl_ckpt_entry *e, int n, const char *const *meta,
                                 int n_meta, mtrl_error *err) {
    char tmp[1024];
    FILE *f = mtrl_file_atomic_begin(path, tmp, sizeof tmp);
    if (!f) return mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
    int where = mtrl_file_atomic_end(f, tmp, path, write_stream_(f, e, n, meta, n_meta));
    if (where == MTRL_FILE_WRITE_FAILED)
        return mtrl_error_set(err, MTRL_ERR_IO, "%s: write failed: %s (nothing was replaced)", path, strerror(errno));
    if (where == MTRL_FILE_RENAME_FAILED)
        return mtrl_error_set(err, MTRL_ERR_IO, "%s: rename failed: %s", path, strerror(errno));
    return MTRL_OK;
}

mtrl_status mtrl_ckpt_write_mem(void **out, size_t *out_len, const mtrl_ckpt_entry *e, int n,
                                const char *const *meta, int n_meta, mtrl_error *err) {
    for (int i = 0; i < n; i++) MTRL_CHECKF(e[i].data || !e[i].nbytes, "tensor %s has no data", e[i].name);
    return mtrl_ckpt_write_mem_at(out, out_len, e, n, meta, n_meta, NULL, err);
}

mtrl_status mtrl_ckpt_write_mem_at(void **out, size_t *out_len, const mtrl_ckpt_entry *e, int n,
                                   const char *const *meta, int n_meta, size_t *data_at, mtrl_error *err) {
    // One allocation of the exact size: a growing memory stream would copy gigabytes of
    // weights several times over.
    size_t plen;
    unsigned char *prefix = header_build_(e, n, meta, n_meta, &plen);
    if (!prefix) return mtrl_error_set(err, MTRL_ERR_NOMEM, "cannot build the weights header");
    size_t len = plen;
    for (int i = 0; i < n; i++) len += e[i].nbytes;
    unsigned char *buf = malloc(len);
    if (!buf) {
        free(prefix);
        return mtrl_error_set(err, MTRL_ERR_NOMEM, "cannot allocate %zu bytes for the weights", len);
    }
    memcpy(buf, prefix, plen);
    free(prefix);
    size_t at = plen;
    for (int i = 0; i < n; i++) {
        if (data_at) data_at[i] = at;
        if (e[i].data) memcpy(buf + at, e[i].data, e[i].nbytes);
        at += e[i].nbytes;
    }
    *out = buf;
    *out_len = len;
    return MTRL_OK;
}

// ---- a small JSON reader for the header ------------------------------------------------------------------

typedef struct jp {
    const char *s, *end;
    const char *src;
    mtrl_error *err;
} jp;

static void ws_(jp *p) {
    while (p->s < p->end && isspace((unsigned char)*p->s)) p->s++;
}

static int expect_(jp *p, char ch) {
    ws_(p);
    if (p->s < p->end && *p->s == ch) {
        p->s++;
        return 1;
    }
    return 0;
}

// Parses a JSON string into out (cap bytes). Escapes: \" \\ \/ \b \f \n \r \t \uXXXX (ASCII only).
static int str_(jp *p, char *out, size_t cap) {
    if (!expect_(p, '"')) return 0;
    size_t n = 0;
    while (p->s < p->end && *p->s != '"') {
        char ch = *p->s++;
        if (ch == '\\') {
            if (p->s >= p->end) return 0;
            char e = *p->s++;
            switch (e) {
            case 'n': ch = '\n'; break;
            case 't': ch = '\t'; break;
            case 'r': ch = '\r'; break;
            case 'b': ch = '\b'; break;
            case 'f': ch = '\f'; break;
            case 'u': {
                if (p->end - p->s < 4) return 0;
                char hex[5] = {p->s[0], p->s[1], p->s[2], p->s[3], 0};
                p->s += 4;
                long v = strtol(hex, NULL, 16);
                ch = v < 128 ? (char)v : '?';
                break;
            }
            default: ch = e;
            }
        }
        if (n + 1 >= cap) return 0;
        out[n++] = ch;
    }
    if (p->s >= p->end) return 0;
    p->s++;
    out[n] = '\0';
    return 1;
}

static int uint_(jp *p, uint64_t *v) {
    ws_(p);
    if (p->s >= p->end || !isdigit((unsigned char)*p->s)) return 0;
    uint64_t x = 0;
    while (p->s < p->end && isdigit((unsigned char)*p->s)) {
        uint64_t nx = x * 10 + (uint64_t)(*p->s - '0');
        if (nx < x) return 0;
        x = nx;
        p->s++;
    }
    *v = x;
    return 1;
}

static int uint_array_(jp *p, uint64_t *v, int max, int *n) {
    if (!expect_(p, '[')) return 0;
    *n = 0;
    if (expect_(p, ']')) return 1;
    do {
        if (*n >= max || !uint_(p, &v[*n])) return 0;
        (*n)++;
    } while (expect_(p, ','));
    return expect_(p, ']');
}

static mtrl_status parse_header_(mtrl_ckpt *c, const char *hdr, size_t len, mtrl_error *err) {
    jp p = {hdr, hdr + len, c->source, err};
#define BAD(what) return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: bad safetensors header: %s at byte %ld", c->source, what, \
                                        (long)(8 + (p.s - hdr)))
    if (!expect_(&p, '{')) BAD("expected '{'");
    int cap = 0;
    if (expect_(&p, '}')) return MTRL_OK;
    do {
        char key[MTRL_TT_NAME_MAX];
        if (!str_(&p, key, sizeof key)) BAD("expected a tensor name (at most 95 bytes)");
        if (!expect_(&p, ':') || !expect_(&p, '{')) BAD("expected ':{'");
        if (!strcmp(key, "__metadata__")) {
            if (!expect_(&p, '}')) {
                do {
                    char k[256], v[4096];
                    if (!str_(&p, k, sizeof k) || !expect_(&p, ':') || !str_(&p, v, sizeof v)) BAD("bad metadata entry");
                    c->meta = xrealloc(c->meta, sizeof(char *) * (size_t)(2 * c->n_meta + 2));
                    c->meta[2 * c->n_meta] = xstrdup(k);
                    c->meta[2 * c->n_meta + 1] = xstrdup(v);
                    c->n_meta++;
                } while (expect_(&p, ','));
                if (!expect_(&p, '}')) BAD("expected '}' after metadata");
            }
            continue;
        }
        if (c->n == cap) {
            cap = cap ? 2 * cap : 64;
            c->t = xrealloc(c->t, sizeof *c->t * (size_t)cap);
        }
        mtrl_ckpt_tensor *t = &c->t[c->n];
        memset(t, 0, sizeof *t);
        strcpy(t->name, key);
        int have = 0;
        do {
            char field[32];
            if (!str_(&p, field, sizeof field) || !expect_(&p, ':')) BAD("expected a field name");
            if (!strcmp(field, "dtype")) {
                char dt[16];
                if (!str_(&p, dt, sizeof dt)) BAD("bad dtype");
                int d = mtrl_dtype_parse(dt);
                if (d < 0) return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: tensor %s has unsupported dtype %s", c->source, key, dt);
                t->dtype = (mtrl_dtype)d;
                have |= 1;
            } else if (!strcmp(field, "shape")) {
                uint64_t s[MTRL_TT_MAX_DIMS];
                if (!uint_array_(&p, s, MTRL_TT_MAX_DIMS, &t->ndim)) BAD("bad shape (at most 4 dims)");
                for (int i = 0; i < t->ndim; i++) t->shape[i] = (int64_t)s[i];
                have |= 2;
            } else if (!strcmp(field, "data_offsets")) {
                uint64_t o[2];
                int n;
                if (!uint_array_(&p, o, 2, &n) || n != 2 || o[1] < o[0]) BAD("bad data_offsets");
                t->begin = o[0];
                t->end = o[1];
                have |= 4;
            } else {
                BAD("unknown tensor field");
            }
        } while (expect_(&p, ','));
        if (!expect_(&p, '}') || have != 7) BAD("tensor entry needs dtype, shape and data_offsets");
        uint64_t numel = 1;
        for (int i = 0; i < t->ndim; i++) numel *= (uint64_t)t->shape[i];
        if (t->end - t->begin != numel * mtrl_dtype_size(t->dtype))
            return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: tensor %s: %llu data bytes do not match its shape", c->source, key,
                                  (unsigned long long)(t->end - t->begin));
        if (t->end > c->data_len)
            return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: tensor %s ends at byte %llu past the data (%llu bytes): truncated file?",
                                  c->source, key, (unsigned long long)t->end, (unsigned long long)c->data_len);
        c->n++;
    } while (expect_(&p, ','));
    if (!expect_(&p, '}')) BAD("expected '}'");
#undef BAD
    return MTRL_OK;
}

static mtrl_status open_stream_(mtrl_ckpt *c, uint64_t total, mtrl_error *err) {
    unsigned char len8[8];
    if (total < 8 || fread(len8, 1, 8, c->f) != 8)
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: too short for a safetensors file (%llu bytes)", c->source,
                              (unsigned long long)total);
    uint64_t n = 0;
    for (int i = 0; i < 8; i++) n |= (uint64_t)len8[i] << (8 * i);
    if (n > HEADER_MAX || n > total - 8)
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: header length %llu does not fit the file (%llu bytes)", c->source,
                              (unsigned long long)n, (unsigned long long)total);
    char *hdr = xmalloc(n + 1);
    if (fread(hdr, 1, n, c->f) != n) {
        free(hdr);
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: header truncated", c->source);
    }
    hdr[n] = '\0';
    c->data_start = 8 + n;
    c->data_len = total - 8 - n;
    mtrl_status st = parse_header_(c, hdr, n, err);
    free(hdr);
    return st;
}

mtrl_status mtrl_ckpt_open_file(mtrl_ckpt *c, const char *path, mtrl_error *err) {
    memset(c, 0, sizeof *c);
    snprintf(c->source, sizeof c->source, "%s", path);
    c->f = fopen(path, "rb");
    if (!c->f) return mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    fseeko(c->f, 0, SEEK_END);
    uint64_t total = (uint64_t)ftello(c->f);
    fseeko(c->f, 0, SEEK_SET);
    mtrl_status st = open_stream_(c, total, err);
    if (st != MTRL_OK) mtrl_ckpt_close(c);
    return st;
}

mtrl_status mtrl_ckpt_verify_digest(const char *path, const char *digest, mtrl_error *err) {
    if (!digest || !digest[0]) return MTRL_OK;
    char have[65];
    if (mtrl_sha256_file_hex(path, have) != 0)
        return mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot read to check its digest: %s", path, strerror(errno));
    if (strcmp(have, digest))
        return mtrl_error_set(err, MTRL_ERR_MISMATCH,
                              "%s: the checkpoint file changed since its run wrote it (sha256 %.16s..., the run store "
                              "recorded %.16s...): overwritten by another run with the same out_dir, or edited; its "
                              "weights are not the ones this run used",
                              path, have, digest);
    return MTRL_OK;
}

mtrl_status mtrl_ckpt_open_mem(mtrl_ckpt *c, const void *buf, size_t len, mtrl_error *err) {
    memset(c, 0, sizeof *c);
    snprintf(c->source, sizeof c->source, "<weights in memory>");
    c->f = fmemopen((void *)buf, len ? len : 1, "rb");
    if (!c->f) return mtrl_error_set(err, MTRL_ERR_NOMEM, "cannot open weights in memory");
    mtrl_status st = open_stream_(c, len, err);
    if (st != MTRL_OK) mtrl_ckpt_close(c);
    return st;
}

void mtrl_ckpt_close(mtrl_ckpt *c) {
    if (!c) return;
    if (c->f) fclose(c->f);
    free(c->t);
    for (int i = 0; i < 2 * c->n_meta; i++) free(c->meta[i]);
    free(c->meta);
    memset(c, 0, sizeof *c);
}

const char *mtrl_ckpt_meta(const mtrl_ckpt *c, const char *key) {
    for (int i = 0; i < c->n_meta; i++)
        if (!strcmp(c->meta[2 * i], key)) return c->meta[2 * i + 1];
    return NULL;
}

int mtrl_ckpt_find(const mtrl_ckpt *c, const char *name) {
    for (int i = 0; i < c->n; i++)
        if (!strcmp(c->t[i].name, name)) return i;
    return -1;
}

static void shape_str_(char *buf, size_t cap, int ndim, const int64_t *s) {
    size_t at = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && at < cap; i++) at += (size_t)snprintf(buf + at, cap - at, "%s%lld", i ? "," : "", (long long)s[i]);
    if (at < cap) snprintf(buf + at, cap - at, "]");
}

mtrl_status mtrl_ckpt_read(mtrl_ckpt *c, const char *name, mtrl_dtype dtype, int ndim, const int64_t *shape, void *out,
                           mtrl_error *err) {
    int i = mtrl_ckpt_find(c, name);
    if (i < 0) return mtrl_error_set(err, MTRL_ERR_NOTFOUND, "%s: has no tensor %s", c->source, name);
    mtrl_ckpt_tensor *t = &c->t[i];
    int same = t->dtype == dtype && t->ndim == ndim;
    for (int d = 0; same && d < ndim; d++) same = t->shape[d] == shape[d];
    if (!same) {
        char a[96], b[96];
        shape_str_(a, sizeof a, t->ndim, t->shape);
        shape_str_(b, sizeof b, ndim, shape);
        return mtrl_error_set(err, MTRL_ERR_MISMATCH, "%s: tensor %s is %s %s, the model expects %s %s", c->source, name,
                              mtrl_dtype_name(t->dtype), a, mtrl_dtype_name(dtype), b);
    }
    if (fseeko(c->f, (off_t)(c->data_start + t->begin), SEEK_SET) != 0 ||
        fread(out, 1, t->end - t->begin, c->f) != t->end - t->begin)
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: tensor %s: data truncated", c->source, name);
    return MTRL_OK;
}
