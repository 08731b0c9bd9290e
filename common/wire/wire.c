// wire.c: wire message encoders and decoders, no sockets (see wire.h).
// The socket helpers are in wire_sock.c and the episode assembler in wire_asm.c.
#include "common/wire/wire.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/hash.h"

const char *mtrl_wire_type_name(uint16_t type) {
    static const char *names[] = {NULL, "HELLO", "WELCOME", "CREDIT", "BEGIN", "CHUNK", "END",
                                  "WEIGHTS_REQ", "WEIGHTS", "ROUTING_STATS", "HEARTBEAT", "BYE", "ERROR", "ACTOR_STATS",
                                  "WEIGHTS_AT"};
    if (type >= 1 && type <= MTRL_WIRE_TYPE_MAX) return names[type];
    return "UNKNOWN";
}

mtrl_wire_limits mtrl_wire_limits_default(void) {
    mtrl_wire_limits l;
    l.max_payload = 64ull << 20;
    l.max_text = 4096;
    l.max_config = 1u << 20;
    l.max_routing_cells = 1u << 20;
    l.max_weight_chunks = 1u << 16;
    l.max_episode_bytes = 1ull << 30;
    l.max_open_per_actor = 64;
    l.traj = mtrl_traj_limits_default();
    return l;
}

void mtrl_wire_stats_invalid(mtrl_wire_stats *s, const char *reason) {
    if (!s) return;
    s->invalid++;
    snprintf(s->last_reason, sizeof s->last_reason, "%s", reason ? reason : "");
}

// ---- encoders --------------------------------------------------------------------------------

void mtrl_wire_out_init(mtrl_wire_out *o) {
    memset(o->hdr, 0, sizeof o->hdr);
    mtrl_wbuf_init(&o->payload);
}

void mtrl_wire_out_free(mtrl_wire_out *o) {
    if (!o) return;
    mtrl_wbuf_free(&o->payload);
}

static mtrl_wbuf *begin_(mtrl_wire_out *o) {
    mtrl_wbuf_reset(&o->payload);
    return &o->payload;
}

// Fills the header frame for the payload already in o.
static void finish_(mtrl_wire_out *o, uint16_t type, uint32_t seq, uint64_t id) {
    uint8_t *h = o->hdr;
    memcpy(h, MTRL_WIRE_MAGIC, 4);
    mtrl_st16(h + 4, MTRL_WIRE_VERSION);
    mtrl_st16(h + 6, type);
    mtrl_st32(h + 8, 0);
    mtrl_st32(h + 12, seq);
    mtrl_st64(h + 16, o->payload.len);
    mtrl_st64(h + 24, id);
    mtrl_st32(h + 32, o->payload.len ? mtrl_crc32c(0, o->payload.data, o->payload.len) : 0);
    mtrl_st32(h + 36, 0);
}

static void hello_payload_(mtrl_wbuf *b, uint16_t proto, uint32_t actor_id, uint32_t incarnation, uint64_t caps) {
    mtrl_wbuf_u16(b, proto);
    mtrl_wbuf_u16(b, 0);
    mtrl_wbuf_u32(b, actor_id);
    mtrl_wbuf_u32(b, incarnation);
    mtrl_wbuf_u64(b, caps);
}

void mtrl_wire_encode_hello(mtrl_wire_out *o, uint32_t actor_id, uint32_t incarnation, uint64_t caps) {
    hello_payload_(begin_(o), MTRL_WIRE_VERSION, actor_id, incarnation, caps);
    finish_(o, MTRL_WIRE_HELLO, 0, 0);
}

static void welcome_payload_(mtrl_wbuf *b, uint64_t run_id, uint64_t config_hash, uint32_t weight_version,
                             uint64_t credit_bytes, const char *config_text) {
    mtrl_wbuf_u64(b, run_id);
    mtrl_wbuf_u64(b, config_hash);
    mtrl_wbuf_u32(b, weight_version);
    mtrl_wbuf_u64(b, credit_bytes);
    mtrl_wbuf_str(b, config_text);
}

void mtrl_wire_encode_welcome(mtrl_wire_out *o, uint64_t run_id, uint64_t config_hash, uint32_t weight_version,
                              uint64_t credit_bytes, const char *config_text) {
    welcome_payload_(begin_(o), run_id, config_hash, weight_version, credit_bytes, config_text);
    finish_(o, MTRL_WIRE_WELCOME, 0, 0);
}

void mtrl_wire_encode_credit(mtrl_wire_out *o, uint64_t credit_bytes) {
    mtrl_wbuf_u64(begin_(o), credit_bytes);
    finish_(o, MTRL_WIRE_CREDIT, 0, 0);
}

void mtrl_wire_encode_begin(mtrl_wire_out *o, const mtrl_traj *t) {
    mtrl_traj_header_encode(begin_(o), t);
    finish_(o, MTRL_WIRE_BEGIN, 0, t->episode_id);
}

void mtrl_wire_encode_chunk(mtrl_wire_out *o, const mtrl_traj *t, uint32_t seq, uint64_t first, uint32_t count) {
    mtrl_traj_slice s = mtrl_traj_slice_of(t, first, count);
    mtrl_traj_slice_encode(begin_(o), &s);
    finish_(o, MTRL_WIRE_CHUNK, seq, t->episode_id);
}

void mtrl_wire_encode_end(mtrl_wire_out *o, const mtrl_traj *t, uint32_t seq) {
    mtrl_traj_summary_encode(begin_(o), t);
    finish_(o, MTRL_WIRE_END, seq, t->episode_id);
}

void mtrl_wire_encode_weights_req(mtrl_wire_out *o, uint64_t request_id, uint32_t version) {
    mtrl_wbuf_u32(begin_(o), version);
    finish_(o, MTRL_WIRE_WEIGHTS_REQ, 0, request_id);
}

static void weights_payload_(mtrl_wbuf *b, uint32_t version, uint32_t chunk_index, uint32_t chunk_count,
                             uint64_t blob_bytes, uint64_t offset, uint64_t digest, const void *data, uint64_t n) {
    mtrl_wbuf_u32(b, version);
    mtrl_wbuf_u32(b, chunk_index);
    mtrl_wbuf_u32(b, chunk_count);
    mtrl_wbuf_u64(b, blob_bytes);
    mtrl_wbuf_u64(b, offset);
    mtrl_wbuf_u64(b, digest);
    mtrl_wbuf_u64(b, n);
    mtrl_wbuf_bytes(b, data, (size_t)n);
}

void mtrl_wire_encode_weights(mtrl_wire_out *o, uint32_t version, uint32_t chunk_index, uint32_t chunk_count,
                              uint64_t blob_bytes, uint64_t offset, const void *data, uint64_t n) {
    weights_payload_(begin_(o), version, chunk_index, chunk_count, blob_bytes, offset,
                     mtrl_crc32c(0, data, (size_t)n), data, n);
    finish_(o, MTRL_WIRE_WEIGHTS, chunk_index, 0);
}

static void routing_stats_payload_(mtrl_wbuf *b, uint32_t version, uint32_t layers, uint32_t experts,
                                   const uint64_t *counts, const uint32_t *batches, const double *beta_sum) {
    mtrl_wbuf_u32(b, version);
    mtrl_wbuf_u32(b, layers);
    mtrl_wbuf_u32(b, experts);
    uint64_t cells = (uint64_t)layers * experts;
    for (uint64_t i = 0; i < cells; i++) mtrl_wbuf_u64(b, counts[i]);
    for (uint32_t l = 0; l < layers; l++) mtrl_wbuf_u32(b, batches ? batches[l] : 0);
    for (uint64_t i = 0; i < cells; i++) mtrl_wbuf_f64(b, beta_sum ? beta_sum[i] : 0.0);
}

void mtrl_wire_encode_routing_stats(mtrl_wire_out *o, uint32_t version, uint32_t layers, uint32_t experts,
                                    const uint64_t *counts, const uint32_t *batches, const double *beta_sum) {
    routing_stats_payload_(begin_(o), version, layers, experts, counts, batches, beta_sum);
    finish_(o, MTRL_WIRE_ROUTING_STATS, 0, 0);
}

void mtrl_wire_encode_heartbeat(mtrl_wire_out *o) {
    begin_(o);
    finish_(o, MTRL_WIRE_HEARTBEAT, 0, 0);
}

// The fields of ACTOR_STATS in wire order: encoder, decoder and field names agree through it.
#define ACTOR_STATS_FIELDS_(X) X(wall_s) X(prefill_s) X(decode_s) X(tools_s) X(wait_s) X(prefill_tokens) X(decode_tokens) X(decode_steps)

static void actor_stats_payload_(mtrl_wbuf *b, const mtrl_wire_actor_stats *s) {
    mtrl_wbuf_u32(b, MTRL_WIRE_ACTOR_STATS_VERSION);
    mtrl_wbuf_u32(b, MTRL_WIRE_ACTOR_STATS_FIELDS);
#define PUT_(f) mtrl_wbuf_f64(b, s->f);
    ACTOR_STATS_FIELDS_(PUT_)
#undef PUT_
}

void mtrl_wire_encode_actor_stats(mtrl_wire_out *o, const mtrl_wire_actor_stats *s) {
    actor_stats_payload_(begin_(o), s);
    finish_(o, MTRL_WIRE_ACTOR_STATS, 0, 0);
}

void mtrl_wire_encode_bye(mtrl_wire_out *o, const char *reason) {
    mtrl_wbuf_str(begin_(o), reason);
    finish_(o, MTRL_WIRE_BYE, 0, 0);
}

void mtrl_wire_encode_error(mtrl_wire_out *o, int32_t code, const char *text) {
    mtrl_wbuf *b = begin_(o);
    mtrl_wbuf_u32(b, (uint32_t)code);
    mtrl_wbuf_str(b, text);
    finish_(o, MTRL_WIRE_ERROR, 0, 0);
}

#define WEIGHTS_AT_NAME_MAX 63 // MTRL_WSHM_NAME_MAX - 1

static void weights_at_payload_(mtrl_wbuf *b, uint32_t version, uint32_t slot, uint64_t nonce, const char *name) {
    mtrl_wbuf_u32(b, version);
    mtrl_wbuf_u32(b, slot);
    mtrl_wbuf_u64(b, nonce);
    mtrl_wbuf_str(b, name);
}

void mtrl_wire_encode_weights_at(mtrl_wire_out *o, uint32_t version, uint32_t slot, uint64_t nonce, const char *name) {
    MTRL_CHECKF(strlen(name) <= WEIGHTS_AT_NAME_MAX, "weight channel name too long: %s", name);
    weights_at_payload_(begin_(o), version, slot, nonce, name);
    finish_(o, MTRL_WIRE_WEIGHTS_AT, 0, 0);
}

// ---- decoders --------------------------------------------------------------------------------

// The largest payload a type may carry under lim (checked before the payload is looked at).
static uint64_t type_cap_(uint16_t type, const mtrl_wire_limits *lim) {
    uint64_t cap;
    switch (type) {
    case MTRL_WIRE_HELLO: cap = 20; break;
    case MTRL_WIRE_WELCOME: cap = 32 + (uint64_t)lim->max_config; break;
    case MTRL_WIRE_CREDIT: cap = 8; break;
    case MTRL_WIRE_WEIGHTS_REQ: cap = 4; break;
    case MTRL_WIRE_ROUTING_STATS: cap = 12 + 20 * (uint64_t)lim->max_routing_cells; break; // layers <= cells
    case MTRL_WIRE_HEARTBEAT: cap = 0; break;
    case MTRL_WIRE_ACTOR_STATS: cap = 8 + 8 * MTRL_WIRE_ACTOR_STATS_FIELDS; break;
    case MTRL_WIRE_BYE: cap = 4 + (uint64_t)lim->max_text; break;
    case MTRL_WIRE_ERROR: cap = 8 + (uint64_t)lim->max_text; break;
    case MTRL_WIRE_WEIGHTS_AT: cap = 20 + WEIGHTS_AT_NAME_MAX; break;
    default: cap = lim->max_payload; break; // BEGIN, CHUNK, END, WEIGHTS
    }
    return cap < lim->max_payload ? cap : lim->max_payload;
}

mtrl_status mtrl_wire_hdr_decode(const void *buf, size_t n, const mtrl_wire_limits *lim, mtrl_wire_hdr *h,
                                 mtrl_error *err) {
    memset(h, 0, sizeof *h);
    const uint8_t *p = buf;
    if (n != MTRL_WIRE_HDR_SIZE)
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "wire header: %zu bytes; a header frame is %d bytes", n,
                              MTRL_WIRE_HDR_SIZE);
    if (memcmp(p, MTRL_WIRE_MAGIC, 4) != 0)
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "wire header: at byte 0: bad magic %02x %02x %02x %02x (not mtrl)",
                              p[0], p[1], p[2], p[3]);
    h->version = mtrl_le16(p + 4);
    h->type = mtrl_le16(p + 6);
    h->flags = mtrl_le32(p + 8);
    h->seq = mtrl_le32(p + 12);
    h->length = mtrl_le64(p + 16);
    h->id = mtrl_le64(p + 24);
    h->crc = mtrl_le32(p + 32);
    uint32_t reserved = mtrl_le32(p + 36);
    if (h->version != MTRL_WIRE_VERSION)
        return mtrl_error_set(err, MTRL_ERR_MISMATCH,
                              "wire header: at byte 4: protocol version %u; this build speaks version %u "
                              "(run the same mtrl on actor and learner)", h->version, MTRL_WIRE_VERSION);
    if (h->type < 1 || h->type > MTRL_WIRE_TYPE_MAX)
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "wire header: at byte 6: unknown message type %u", h->type);
    if (h->flags != 0)
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "wire %s: at byte 8: unknown flags 0x%08x",
                              mtrl_wire_type_name(h->type), h->flags);
    if (reserved != 0)
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "wire %s: at byte 36: reserved field is 0x%08x, must be 0",
                              mtrl_wire_type_name(h->type), reserved);
    uint64_t cap = type_cap_(h->type, lim);
    if (h->length > cap)
        return mtrl_error_set(err, MTRL_ERR_LIMIT, "wire %s: at byte 16: payload of %llu bytes over the cap of %llu",
                              mtrl_wire_type_name(h->type), (unsigned long long)h->length, (unsigned long long)cap);
    if (h->length == 0 && h->crc != 0)
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "wire %s: at byte 32: CRC 0x%08x for an empty payload",
                              mtrl_wire_type_name(h->type), h->crc);
    return MTRL_OK;
}

mtrl_status mtrl_wire_payload_check(const mtrl_wire_hdr *h, const void *payload, size_t n, mtrl_error *err) {
    if (n != h->length)
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "wire %s: payload is %zu bytes, the header says %llu",
                              mtrl_wire_type_name(h->type), n, (unsigned long long)h->length);
    uint32_t crc = n ? mtrl_crc32c(0, payload, n) : 0;
    if (crc != h->crc)
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "wire %s: payload CRC 0x%08x, the header says 0x%08x",
                              mtrl_wire_type_name(h->type), crc, h->crc);
    return MTRL_OK;
}

void mtrl_wire_msg_init(mtrl_wire_msg *m) {
    memset(m, 0, sizeof *m);
    mtrl_traj_init(&m->traj);
}

void mtrl_wire_msg_free(mtrl_wire_msg *m) {
    if (!m) return;
    free(m->text);
    free(m->counts);
    free(m->qb_batches);
    free(m->qb_beta_sum);
    mtrl_traj_free(&m->traj);
    mtrl_wire_msg_init(m);
}

// Clears m for a new decode, keeping the trajectory's token capacity.
static void msg_reset_(mtrl_wire_msg *m) {
    mtrl_traj keep = m->traj;
    free(m->text);
    free(m->counts);
    free(m->qb_batches);
    free(m->qb_beta_sum);
    memset(m, 0, sizeof *m);
    m->traj = keep;
    mtrl_traj_reset(&m->traj);
}

static mtrl_status trailing_(mtrl_rbuf *r) {
    if (r->status) return r->status;
    if (mtrl_rbuf_left(r))
        return mtrl_rbuf_fail(r, MTRL_ERR_FORMAT, "%zu unexpected bytes after the end", mtrl_rbuf_left(r));
    return MTRL_OK;
}

static mtrl_status decode_payload_(const void *payload, size_t n, const mtrl_wire_limits *lim, mtrl_wire_msg *m,
                                   mtrl_error *err) {
    char what[32];
    snprintf(what, sizeof what, "wire %s", mtrl_wire_type_name(m->hdr.type));
    mtrl_rbuf r;
    mtrl_rbuf_init(&r, payload, n, what, err);
    mtrl_status st;
    switch ((mtrl_wire_type)m->hdr.type) {
    case MTRL_WIRE_HELLO: {
        m->proto = mtrl_rbuf_u16(&r, "protocol version");
        uint16_t pad = mtrl_rbuf_u16(&r, "reserved");
        m->actor_id = mtrl_rbuf_u32(&r, "actor_id");
        m->incarnation = mtrl_rbuf_u32(&r, "incarnation");
        m->caps = mtrl_rbuf_u64(&r, "capabilities");
        if (!r.status && pad) return mtrl_rbuf_fail_at(&r, 2, MTRL_ERR_FORMAT, "reserved: %u, must be 0", pad);
        return trailing_(&r);
    }
    case MTRL_WIRE_WELCOME:
        m->run_id = mtrl_rbuf_u64(&r, "run_id");
        m->config_hash = mtrl_rbuf_u64(&r, "config_hash");
        m->weight_version = mtrl_rbuf_u32(&r, "weight_version");
        m->credit_bytes = mtrl_rbuf_u64(&r, "credit_bytes");
        if (mtrl_rbuf_str(&r, lim->max_config, "config_text", &m->text)) return r.status;
        return trailing_(&r);
    case MTRL_WIRE_CREDIT:
        m->credit_bytes = mtrl_rbuf_u64(&r, "credit_bytes");
        return trailing_(&r);
    case MTRL_WIRE_WEIGHTS_REQ:
        m->weight_version = mtrl_rbuf_u32(&r, "version");
        return trailing_(&r);
    case MTRL_WIRE_HEARTBEAT: return trailing_(&r);
    case MTRL_WIRE_ACTOR_STATS: {
        uint32_t version = mtrl_rbuf_u32(&r, "layout version");
        uint32_t fields = mtrl_rbuf_u32(&r, "field count");
        if (r.status) return r.status;
        if (version != MTRL_WIRE_ACTOR_STATS_VERSION)
            return mtrl_rbuf_fail_at(&r, 0, MTRL_ERR_MISMATCH, "layout version %u; this build reads version %u", version,
                                     MTRL_WIRE_ACTOR_STATS_VERSION);
        if (fields != MTRL_WIRE_ACTOR_STATS_FIELDS)
            return mtrl_rbuf_fail_at(&r, 4, MTRL_ERR_FORMAT, "field count %u; layout version %u has %d", fields, version,
                                     MTRL_WIRE_ACTOR_STATS_FIELDS);
#define GET_(f)                                                                                                        \
    {                                                                                                                  \
        size_t at = r.pos;                                                                                             \
        m->actor_stats.f = mtrl_rbuf_f64(&r, #f);                                                                      \
        if (!r.status && !(isfinite(m->actor_stats.f) && m->actor_stats.f >= 0))                                       \
            return mtrl_rbuf_fail_at(&r, at, MTRL_ERR_FORMAT, #f ": %g, must be finite and >= 0", m->actor_stats.f);   \
    }
        ACTOR_STATS_FIELDS_(GET_)
#undef GET_
        return trailing_(&r);
    }
    case MTRL_WIRE_BYE:
        if (mtrl_rbuf_str(&r, lim->max_text, "reason", &m->text)) return r.status;
        return trailing_(&r);
    case MTRL_WIRE_ERROR:
        m->code = (int32_t)mtrl_rbuf_u32(&r, "code");
        if (mtrl_rbuf_str(&r, lim->max_text, "text", &m->text)) return r.status;
        return trailing_(&r);
    case MTRL_WIRE_WEIGHTS_AT:
        m->weight_version = mtrl_rbuf_u32(&r, "version");
        m->slot = mtrl_rbuf_u32(&r, "slot");
        m->nonce = mtrl_rbuf_u64(&r, "nonce");
        if (mtrl_rbuf_str(&r, WEIGHTS_AT_NAME_MAX, "channel name", &m->text)) return r.status;
        return trailing_(&r);
    case MTRL_WIRE_WEIGHTS: {
        m->weight_version = mtrl_rbuf_u32(&r, "version");
        m->chunk_index = mtrl_rbuf_u32(&r, "chunk_index");
        size_t at_count = r.pos;
        m->chunk_count = mtrl_rbuf_u32(&r, "chunk_count");
        m->blob_bytes = mtrl_rbuf_u64(&r, "blob_bytes");
        m->blob_offset = mtrl_rbuf_u64(&r, "offset");
        m->chunk_digest = mtrl_rbuf_u64(&r, "digest");
        size_t at_n = r.pos;
        uint64_t len = mtrl_rbuf_u64(&r, "n");
        if (r.status) return r.status;
        if (m->chunk_count == 0 || m->chunk_count > lim->max_weight_chunks)
            return mtrl_rbuf_fail_at(&r, at_count, m->chunk_count ? MTRL_ERR_LIMIT : MTRL_ERR_FORMAT,
                                     "chunk_count: %u (must be 1..max_weight_chunks=%u)", m->chunk_count,
                                     lim->max_weight_chunks);
        if (m->chunk_index >= m->chunk_count)
            return mtrl_rbuf_fail_at(&r, 4, MTRL_ERR_FORMAT, "chunk_index: %u of %u chunks", m->chunk_index,
                                     m->chunk_count);
        if (m->blob_offset > m->blob_bytes || len > m->blob_bytes - m->blob_offset)
            return mtrl_rbuf_fail_at(&r, at_n, MTRL_ERR_FORMAT,
                                     "n: %llu bytes at offset %llu run past the blob's %llu bytes",
                                     (unsigned long long)len, (unsigned long long)m->blob_offset,
                                     (unsigned long long)m->blob_bytes);
        const uint8_t *d = mtrl_rbuf_take(&r, len, "data");
        if (!d) return r.status;
        if (trailing_(&r)) return r.status;
        uint64_t got = mtrl_crc32c(0, d, (size_t)len);
        if (got != m->chunk_digest)
            return mtrl_rbuf_fail_at(&r, at_n - 8, MTRL_ERR_FORMAT,
                                     "digest mismatch: chunk %u says %016llx, its bytes hash to %016llx",
                                     m->chunk_index, (unsigned long long)m->chunk_digest, (unsigned long long)got);
        m->data = d;
        m->data_len = len;
        return MTRL_OK;
    }
    case MTRL_WIRE_ROUTING_STATS: {
        m->weight_version = mtrl_rbuf_u32(&r, "version");
        m->layers = mtrl_rbuf_u32(&r, "layers");
        m->experts = mtrl_rbuf_u32(&r, "experts");
        if (r.status) return r.status;
        uint64_t cells = (uint64_t)m->layers * m->experts;
        if (cells > lim->max_routing_cells)
            return mtrl_rbuf_fail_at(&r, 4, MTRL_ERR_LIMIT, "layers x experts: %u x %u over max_routing_cells=%u",
                                     m->layers, m->experts, lim->max_routing_cells);
        const uint8_t *c = mtrl_rbuf_take(&r, cells * 8, "counts");
        if (!c) return r.status;
        const uint8_t *nb = mtrl_rbuf_take(&r, (uint64_t)m->layers * 4, "batches");
        if (!nb) return r.status;
        size_t at_beta = r.pos;
        const uint8_t *bs = mtrl_rbuf_take(&r, cells * 8, "beta_sum");
        if (!bs || trailing_(&r)) return r.status;
        m->counts = xmalloc((size_t)(cells ? cells : 1) * 8);
        m->qb_batches = xmalloc((size_t)(m->layers ? m->layers : 1) * 4);
        m->qb_beta_sum = xmalloc((size_t)(cells ? cells : 1) * 8);
        for (uint64_t i = 0; i < cells; i++) m->counts[i] = mtrl_le64(c + 8 * i);
        for (uint32_t l = 0; l < m->layers; l++) m->qb_batches[l] = mtrl_le32(nb + 4 * l);
        for (uint64_t i = 0; i < cells; i++) {
            uint64_t u = mtrl_le64(bs + 8 * i);
            memcpy(&m->qb_beta_sum[i], &u, 8);
            if (!isfinite(m->qb_beta_sum[i]))
                return mtrl_rbuf_fail_at(&r, at_beta + 8 * i, MTRL_ERR_FORMAT, "beta_sum[%llu]: not a finite number",
                                         (unsigned long long)i);
        }
        return MTRL_OK;
    }
    case MTRL_WIRE_BEGIN:
        st = mtrl_traj_header_decode(&m->traj, payload, n, &lim->traj, err);
        if (st) return st;
        if (m->traj.episode_id != m->hdr.id)
            return mtrl_error_set(err, MTRL_ERR_FORMAT, "wire BEGIN: header id %llu but the episode header says %llu",
                                  (unsigned long long)m->hdr.id, (unsigned long long)m->traj.episode_id);
        return MTRL_OK;
    case MTRL_WIRE_CHUNK: {
        mtrl_traj_slice_info info;
        st = mtrl_traj_slice_peek(payload, n, &info, err);
        if (st) return st;
        if (info.routing_width > lim->traj.max_routing_width)
            return mtrl_error_set(err, MTRL_ERR_LIMIT, "token slice: at byte 20: routing_width: %u over max_routing_width=%u",
                                  info.routing_width, lim->traj.max_routing_width);
        mtrl_traj_set_routing(&m->traj, info.routing_width, info.flags & MTRL_TRAJ_ROUTING_U16);
        m->traj.episode_id = m->hdr.id;
        return mtrl_traj_slice_decode(&m->traj, payload, n, UINT64_MAX, &lim->traj, &m->chunk_offset, err);
    }
    case MTRL_WIRE_END:
        m->traj.episode_id = m->hdr.id;
        return mtrl_traj_summary_decode(&m->traj, payload, n, &lim->traj, &m->end_tokens, &m->end_digest, err);
    }
    return mtrl_error_set(err, MTRL_ERR_FORMAT, "wire: unknown message type %u", m->hdr.type);
}

mtrl_status mtrl_wire_decode(const void *hdr, size_t hdr_len, const void *payload, size_t payload_len,
                             const mtrl_wire_limits *lim, mtrl_wire_msg *m, mtrl_error *err) {
    msg_reset_(m);
    mtrl_status st = mtrl_wire_hdr_decode(hdr, hdr_len, lim, &m->hdr, err);
    if (!st) st = mtrl_wire_payload_check(&m->hdr, payload, payload_len, err);
    if (!st) {
        st = decode_payload_(payload, payload_len, lim, m, err);
        uint16_t ty = m->hdr.type;
        // The trajectory decoders name their encoding; say which message carried it.
        if (st && err && (ty == MTRL_WIRE_BEGIN || ty == MTRL_WIRE_CHUNK || ty == MTRL_WIRE_END) &&
            strncmp(err->msg, "wire ", 5) != 0)
            mtrl_error_wrap(err, "wire %s", mtrl_wire_type_name(ty));
    }
    if (st) {
        mtrl_wire_hdr keep = m->hdr;
        msg_reset_(m);
        m->hdr = keep;
    }
    return st;
}

void mtrl_wire_msg_encode(mtrl_wire_out *o, const mtrl_wire_msg *m) {
    mtrl_wbuf *b = begin_(o);
    switch ((mtrl_wire_type)m->hdr.type) {
    case MTRL_WIRE_HELLO: hello_payload_(b, m->proto, m->actor_id, m->incarnation, m->caps); break;
    case MTRL_WIRE_WELCOME:
        welcome_payload_(b, m->run_id, m->config_hash, m->weight_version, m->credit_bytes, m->text);
        break;
    case MTRL_WIRE_CREDIT: mtrl_wbuf_u64(b, m->credit_bytes); break;
    case MTRL_WIRE_WEIGHTS_REQ: mtrl_wbuf_u32(b, m->weight_version); break;
    case MTRL_WIRE_HEARTBEAT: break;
    case MTRL_WIRE_ACTOR_STATS: actor_stats_payload_(b, &m->actor_stats); break;
    case MTRL_WIRE_BYE: mtrl_wbuf_str(b, m->text); break;
    case MTRL_WIRE_ERROR:
        mtrl_wbuf_u32(b, (uint32_t)m->code);
        mtrl_wbuf_str(b, m->text);
        break;
    case MTRL_WIRE_WEIGHTS_AT: weights_at_payload_(b, m->weight_version, m->slot, m->nonce, m->text ? m->text : ""); break;
    case MTRL_WIRE_WEIGHTS:
        weights_payload_(b, m->weight_version, m->chunk_index, m->chunk_count, m->blob_bytes, m->blob_offset,
                         m->chunk_digest, m->data, m->data_len);
        break;
    case MTRL_WIRE_ROUTING_STATS:
        routing_stats_payload_(b, m->weight_version, m->layers, m->experts, m->counts, m->qb_batches, m->qb_beta_sum);
        break;
    case MTRL_WIRE_BEGIN: mtrl_traj_header_encode(b, &m->traj); break;
    case MTRL_WIRE_CHUNK: {
        MTRL_CHECK(m->traj.n_tokens <= UINT32_MAX);
        mtrl_traj_slice s = mtrl_traj_slice_of(&m->traj, 0, (uint32_t)m->traj.n_tokens);
        s.offset = m->chunk_offset;
        mtrl_traj_slice_encode(b, &s);
        break;
    }
    case MTRL_WIRE_END: mtrl_traj_summary_encode_with(b, &m->traj, m->end_tokens, m->end_digest); break;
    default: MTRL_CHECKF(0, "encoding a message of unknown type %u", m->hdr.type);
    }
    finish_(o, m->hdr.type, m->hdr.seq, m->hdr.id);
}
