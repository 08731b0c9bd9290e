// trajbuf.h: little-endian byte writer and bounds-checked reader for the trajectory, trajectory
// file and wire encodings (traj.h, trajfile.h, wire.h). Not a general serialisation library.
//
// mtrl_wbuf is a growable output buffer (xrealloc: never fails). Writers append fixed-width
// little-endian integers, IEEE floats by their bits, and length-prefixed strings and bytes.
//
// mtrl_rbuf is a cursor over borrowed input bytes. Every read checks the bytes that remain and
// on the first failure records one error ("<what>: at byte P: <field>: truncated: needs N
// bytes, M remain") and becomes sticky: later reads return zeros and keep the first message,
// so a decoder reads a run of fields and checks r->status once before it uses a value for an
// allocation or a loop bound. `base` is added to every byte offset in messages, so a reader
// over a record inside a file can report offsets relative to whatever the caller prefers.
//
// Hosts are little-endian (x86-64, aarch64); the build refuses others rather than silently
// writing a different format.
#ifndef MTRL_TRAJBUF_H
#define MTRL_TRAJBUF_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "mtrl encodings assume a little-endian host"
#endif

// ---- writer ----------------------------------------------------------------------------------

typedef struct mtrl_wbuf {
    uint8_t *data; // owned; NULL until the first write
    size_t len;    // bytes written
    size_t cap;    // bytes allocated
} mtrl_wbuf;

void mtrl_wbuf_init(mtrl_wbuf *b);
void mtrl_wbuf_free(mtrl_wbuf *b);            // NULL-safe; leaves an empty buffer
void mtrl_wbuf_reset(mtrl_wbuf *b);           // len = 0, keeps the allocation
// Reserves n more bytes and returns a pointer to them (len grows by n); contents undefined.
uint8_t *mtrl_wbuf_grow(mtrl_wbuf *b, size_t n);
// Makes room for n more bytes without writing them (one allocation instead of doublings).
void mtrl_wbuf_reserve(mtrl_wbuf *b, size_t n);
void mtrl_wbuf_bytes(mtrl_wbuf *b, const void *p, size_t n);
void mtrl_wbuf_u8(mtrl_wbuf *b, uint8_t v);
void mtrl_wbuf_u16(mtrl_wbuf *b, uint16_t v);
void mtrl_wbuf_u32(mtrl_wbuf *b, uint32_t v);
void mtrl_wbuf_u64(mtrl_wbuf *b, uint64_t v);
void mtrl_wbuf_f32(mtrl_wbuf *b, float v);
void mtrl_wbuf_f64(mtrl_wbuf *b, double v);
// u32 length then bytes; NULL writes length 0.
void mtrl_wbuf_str(mtrl_wbuf *b, const char *s);
void mtrl_wbuf_blob(mtrl_wbuf *b, const void *p, uint32_t n);
void mtrl_wbuf_put_u32_at(mtrl_wbuf *b, size_t at, uint32_t v);
void mtrl_wbuf_put_u64_at(mtrl_wbuf *b, size_t at, uint64_t v);

// ---- reader ----------------------------------------------------------------------------------

typedef struct mtrl_rbuf {
    const uint8_t *p;  // borrowed input
    size_t n;          // input size
    size_t pos;        // next byte to read
    uint64_t base;     // added to offsets in messages
    const char *what;  // names the encoding in messages ("token slice"); borrowed
    mtrl_error *err;   // may be NULL
    mtrl_status status;// MTRL_OK until the first failure
} mtrl_rbuf;

void mtrl_rbuf_init(mtrl_rbuf *r, const void *p, size_t n, const char *what, mtrl_error *err);
static inline size_t mtrl_rbuf_left(const mtrl_rbuf *r) { return r->n - r->pos; }

// Records a failure at the current position (first failure wins) and returns its code:
//     return mtrl_rbuf_fail(r, MTRL_ERR_LIMIT, "env name length %u over max_string=%u", n, cap);
mtrl_status mtrl_rbuf_fail(mtrl_rbuf *r, mtrl_status code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
// Like mtrl_rbuf_fail, naming an explicit byte offset (relative to the reader's start).
mtrl_status mtrl_rbuf_fail_at(mtrl_rbuf *r, size_t at, mtrl_status code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
// 0 and a "truncated" failure unless n more bytes remain. `field` names what was being read.
int mtrl_rbuf_need(mtrl_rbuf *r, uint64_t n, const char *field);
// Returns a pointer to the next n bytes and skips them, or NULL (with a failure) if fewer remain.
const uint8_t *mtrl_rbuf_take(mtrl_rbuf *r, uint64_t n, const char *field);
uint8_t mtrl_rbuf_u8(mtrl_rbuf *r, const char *field);
uint16_t mtrl_rbuf_u16(mtrl_rbuf *r, const char *field);
uint32_t mtrl_rbuf_u32(mtrl_rbuf *r, const char *field);
uint64_t mtrl_rbuf_u64(mtrl_rbuf *r, const char *field);
float mtrl_rbuf_f32(mtrl_rbuf *r, const char *field);
double mtrl_rbuf_f64(mtrl_rbuf *r, const char *field);
// A u32-length-prefixed string of at most `cap` bytes with no NUL inside, copied into a fresh
// NUL-terminated allocation (*out; NULL for length 0). The cap is checked before allocating.
mtrl_status mtrl_rbuf_str(mtrl_rbuf *r, uint32_t cap, const char *field, char **out);
// A u32-length-prefixed byte blob of at most `cap` bytes, copied (*out NULL for length 0).
mtrl_status mtrl_rbuf_blob(mtrl_rbuf *r, uint32_t cap, const char *field, uint8_t **out, uint32_t *len);

// Little-endian loads and stores on raw bytes (for fixed headers).
static inline uint16_t mtrl_le16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t mtrl_le32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint64_t mtrl_le64(const uint8_t *p) {
    return (uint64_t)mtrl_le32(p) | ((uint64_t)mtrl_le32(p + 4) << 32);
}
static inline void mtrl_st16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static inline void mtrl_st32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void mtrl_st64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

#endif
