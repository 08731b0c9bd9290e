// trajbuf.c: little-endian byte writer and bounds-checked reader (see trajbuf.h).
#include "common/trajbuf.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"

// ---- writer ----------------------------------------------------------------------------------

void mtrl_wbuf_init(mtrl_wbuf *b) { b->data = NULL; b->len = b->cap = 0; }

void mtrl_wbuf_free(mtrl_wbuf *b) {
    if (!b) return;
    free(b->data);
    mtrl_wbuf_init(b);
}

void mtrl_wbuf_reset(mtrl_wbuf *b) { b->len = 0; }

uint8_t *mtrl_wbuf_grow(mtrl_wbuf *b, size_t n) {
    MTRL_CHECKF(n <= SIZE_MAX - b->len, "buffer size overflow");
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n) cap = cap > SIZE_MAX / 2 ? b->len + n : cap * 2;
        b->data = xrealloc(b->data, cap);
        b->cap = cap;
    }
    uint8_t *p = b->data + b->len;
    b->len += n;
    return p;
}

void mtrl_wbuf_reserve(mtrl_wbuf *b, size_t n) {
    MTRL_CHECKF(n <= SIZE_MAX - b->len, "buffer size overflow");
    if (b->len + n <= b->cap) return;
    b->data = xrealloc(b->data, b->len + n);
    b->cap = b->len + n;
}

void mtrl_wbuf_bytes(mtrl_wbuf *b, const void *p, size_t n) {
    if (n) memcpy(mtrl_wbuf_grow(b, n), p, n);
}
void mtrl_wbuf_u8(mtrl_wbuf *b, uint8_t v) { *mtrl_wbuf_grow(b, 1) = v; }
void mtrl_wbuf_u16(mtrl_wbuf *b, uint16_t v) { mtrl_st16(mtrl_wbuf_grow(b, 2), v); }
void mtrl_wbuf_u32(mtrl_wbuf *b, uint32_t v) { mtrl_st32(mtrl_wbuf_grow(b, 4), v); }
void mtrl_wbuf_u64(mtrl_wbuf *b, uint64_t v) { mtrl_st64(mtrl_wbuf_grow(b, 8), v); }
void mtrl_wbuf_f32(mtrl_wbuf *b, float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    mtrl_wbuf_u32(b, u);
}
void mtrl_wbuf_f64(mtrl_wbuf *b, double v) {
    uint64_t u;
    memcpy(&u, &v, 8);
    mtrl_wbuf_u64(b, u);
}
void mtrl_wbuf_str(mtrl_wbuf *b, const char *s) {
    size_t n = s ? strlen(s) : 0;
    MTRL_CHECKF(n <= UINT32_MAX, "string of %zu bytes cannot be encoded", n);
    mtrl_wbuf_u32(b, (uint32_t)n);
    mtrl_wbuf_bytes(b, s, n);
}
void mtrl_wbuf_blob(mtrl_wbuf *b, const void *p, uint32_t n) {
    mtrl_wbuf_u32(b, n);
    mtrl_wbuf_bytes(b, p, n);
}
void mtrl_wbuf_put_u32_at(mtrl_wbuf *b, size_t at, uint32_t v) {
    MTRL_CHECK(at + 4 <= b->len);
    mtrl_st32(b->data + at, v);
}
void mtrl_wbuf_put_u64_at(mtrl_wbuf *b, size_t at, uint64_t v) {
    MTRL_CHECK(at + 8 <= b->len);
    mtrl_st64(b->data + at, v);
}

// ---- reader ----------------------------------------------------------------------------------

void mtrl_rbuf_init(mtrl_rbuf *r, const void *p, size_t n, const char *what, mtrl_error *err) {
    r->p = p;
    r->n = p ? n : 0;
    r->pos = 0;
    r->base = 0;
    r->what = what ? what : "input";
    r->err = err;
    r->status = MTRL_OK;
}

static mtrl_status rbuf_failv_(mtrl_rbuf *r, size_t at, mtrl_status code, const char *fmt, va_list ap) {
    if (r->status != MTRL_OK) return r->status; // keep the first failure: it is the cause
    r->status = code;
    if (r->err) {
        char msg[MTRL_ERROR_MSG_MAX];
        vsnprintf(msg, sizeof msg, fmt, ap);
        mtrl_error_set(r->err, code, "%s: at byte %llu: %s", r->what,
                       (unsigned long long)(r->base + at), msg);
    }
    return code;
}

mtrl_status mtrl_rbuf_fail(mtrl_rbuf *r, mtrl_status code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    mtrl_status s = rbuf_failv_(r, r->pos, code, fmt, ap);
    va_end(ap);
    return s;
}

mtrl_status mtrl_rbuf_fail_at(mtrl_rbuf *r, size_t at, mtrl_status code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    mtrl_status s = rbuf_failv_(r, at, code, fmt, ap);
    va_end(ap);
    return s;
}

int mtrl_rbuf_need(mtrl_rbuf *r, uint64_t n, const char *field) {
    if (r->status != MTRL_OK) return 0;
    if (n <= mtrl_rbuf_left(r)) return 1;
    mtrl_rbuf_fail(r, MTRL_ERR_FORMAT, "%s: truncated: needs %llu bytes, %zu remain", field,
                   (unsigned long long)n, mtrl_rbuf_left(r));
    return 0;
}

const uint8_t *mtrl_rbuf_take(mtrl_rbuf *r, uint64_t n, const char *field) {
    if (!mtrl_rbuf_need(r, n, field)) return NULL;
    if (!r->p) return (const uint8_t *)""; // an empty input: nothing to point into
    const uint8_t *p = r->p + r->pos;
    r->pos += (size_t)n;
    return p;
}

uint8_t mtrl_rbuf_u8(mtrl_rbuf *r, const char *field) {
    const uint8_t *p = mtrl_rbuf_take(r, 1, field);
    return p ? p[0] : 0;
}
uint16_t mtrl_rbuf_u16(mtrl_rbuf *r, const char *field) {
    const uint8_t *p = mtrl_rbuf_take(r, 2, field);
    return p ? mtrl_le16(p) : 0;
}
uint32_t mtrl_rbuf_u32(mtrl_rbuf *r, const char *field) {
    const uint8_t *p = mtrl_rbuf_take(r, 4, field);
    return p ? mtrl_le32(p) : 0;
}
uint64_t mtrl_rbuf_u64(mtrl_rbuf *r, const char *field) {
    const uint8_t *p = mtrl_rbuf_take(r, 8, field);
    return p ? mtrl_le64(p) : 0;
}
float mtrl_rbuf_f32(mtrl_rbuf *r, const char *field) {
    uint32_t u = mtrl_rbuf_u32(r, field);
    float v;
    memcpy(&v, &u, 4);
    return v;
}
double mtrl_rbuf_f64(mtrl_rbuf *r, const char *field) {
    uint64_t u = mtrl_rbuf_u64(r, field);
    double v;
    memcpy(&v, &u, 8);
    return v;
}

mtrl_status mtrl_rbuf_str(mtrl_rbuf *r, uint32_t cap, const char *field, char **out) {
    *out = NULL;
    size_t at = r->pos;
    uint32_t n = mtrl_rbuf_u32(r, field);
    if (r->status) return r->status;
    if (n > cap)
        return mtrl_rbuf_fail_at(r, at, MTRL_ERR_LIMIT, "%s: length %u over the cap of %u bytes",
                                 field, n, cap);
    const uint8_t *p = mtrl_rbuf_take(r, n, field);
    if (!p) return r->status;
    if (n == 0) return MTRL_OK;
    const void *nul = memchr(p, 0, n);
    if (nul)
        return mtrl_rbuf_fail_at(r, at + 4 + (size_t)((const uint8_t *)nul - p), MTRL_ERR_FORMAT,
                                 "%s: contains a NUL byte", field);
    char *s = xmalloc((size_t)n + 1);
    memcpy(s, p, n);
    s[n] = '\0';
    *out = s;
    return MTRL_OK;
}

mtrl_status mtrl_rbuf_blob(mtrl_rbuf *r, uint32_t cap, const char *field, uint8_t **out, uint32_t *len) {
    *out = NULL;
    *len = 0;
    size_t at = r->pos;
    uint32_t n = mtrl_rbuf_u32(r, field);
    if (r->status) return r->status;
    if (n > cap)
        return mtrl_rbuf_fail_at(r, at, MTRL_ERR_LIMIT, "%s: length %u over the cap of %u bytes",
                                 field, n, cap);
    const uint8_t *p = mtrl_rbuf_take(r, n, field);
    if (!p) return r->status;
    if (n == 0) return MTRL_OK;
    *out = xmalloc(n);
    memcpy(*out, p, n);
    *len = n;
    return MTRL_OK;
}
