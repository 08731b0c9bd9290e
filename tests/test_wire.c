// mtrl-test: cpu timeout=120
// test_wire: the wire protocol (common/wire/wire.h): every message type round-trips bit for bit,
// malformed and oversized messages are refused with a reason and counted, the episode
// assembler commits only consistent episodes (gaps, wrong digests, wrong counts, caps ->
// REJECTED; dead or restarted actors -> ABORTED; duplicates ignored), and a real DEALER/ROUTER
// pair over tcp://127.0.0.1 carries a multi-chunk episode end to end and survives a frame over
// ZMQ_MAXMSGSIZE.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/hash.h"
#include "common/wire/wire.h"
#include "tests/fuzz/trajgen.h"
#include "tests/testhelp.h"

static mtrl_wire_limits lim_;

// decode(o) must succeed; returns the message in m, and checks that it re-encodes identically.
static void decode_ok(const mtrl_wire_out *o, mtrl_wire_msg *m, const char *label) {
    mtrl_error err;
    mtrl_status st = mtrl_wire_decode(o->hdr, MTRL_WIRE_HDR_SIZE, o->payload.data, o->payload.len, &lim_, m, &err);
    TEST_CHECKF(st == MTRL_OK, "%s: %s", label, err.msg);
    mtrl_wire_out o2;
    mtrl_wire_out_init(&o2);
    if (st == MTRL_OK) {
        mtrl_wire_msg_encode(&o2, m);
        TEST_CHECKF(memcmp(o2.hdr, o->hdr, MTRL_WIRE_HDR_SIZE) == 0, "%s: header re-encodes differently", label);
        TEST_CHECKF(o2.payload.len == o->payload.len &&
                        (o->payload.len == 0 || memcmp(o2.payload.data, o->payload.data, o->payload.len) == 0),
                    "%s: payload re-encodes differently", label);
    }
    mtrl_wire_out_free(&o2);
}

static void test_messages(void) {
    mtrl_wire_out o;
    mtrl_wire_out_init(&o);
    mtrl_wire_msg m;
    mtrl_wire_msg_init(&m);

    mtrl_wire_encode_hello(&o, 7, 3, MTRL_WIRE_CAP_ROUTING | MTRL_WIRE_CAP_CURVE);
    TEST_CHECK(memcmp(o.hdr, "MTRL", 4) == 0);
    decode_ok(&o, &m, "HELLO");
    TEST_EQ_INT(m.hdr.type, MTRL_WIRE_HELLO);
    TEST_EQ_INT(m.proto, MTRL_WIRE_VERSION);
    TEST_EQ_INT(m.actor_id, 7);
    TEST_EQ_INT(m.incarnation, 3);
    TEST_EQ_INT(m.caps, MTRL_WIRE_CAP_ROUTING | MTRL_WIRE_CAP_CURVE);

    const char *cfg = "[model]\npreset = tiny\n[env]\nname = calc\n";
    mtrl_wire_encode_welcome(&o, 12, 0xfeedfacecafebeefULL, 41, 8u << 20, cfg);
    decode_ok(&o, &m, "WELCOME");
    TEST_EQ_INT(m.run_id, 12);
    TEST_EQ_INT(m.config_hash, 0xfeedfacecafebeefULL);
    TEST_EQ_INT(m.weight_version, 41);
    TEST_EQ_INT(m.credit_bytes, 8u << 20);
    TEST_EQ_STR(m.text, cfg);

    mtrl_wire_encode_credit(&o, 123456789);
    decode_ok(&o, &m, "CREDIT");
    TEST_EQ_INT(m.credit_bytes, 123456789);

    tg_rng r = {1};
    mtrl_traj t;
    mtrl_traj_init(&t);
    tg_traj(&t, &r, 500, 8, 1, 2);
    mtrl_wire_encode_begin(&o, &t);
    decode_ok(&o, &m, "BEGIN");
    TEST_EQ_INT(m.hdr.id, t.episode_id);
    TEST_EQ_INT(m.traj.episode_id, t.episode_id);
    TEST_EQ_STR(m.traj.env, t.env);
    TEST_EQ_INT(m.traj.routing_width, 8);

    mtrl_wire_encode_chunk(&o, &t, 3, 100, 250);
    decode_ok(&o, &m, "CHUNK");
    TEST_EQ_INT(m.hdr.seq, 3);
    TEST_EQ_INT(m.chunk_offset, 100);
    TEST_EQ_INT(m.traj.n_tokens, 250);
    TEST_CHECK(memcmp(m.traj.ids, t.ids + 100, 250 * 4) == 0);
    TEST_CHECK(memcmp(m.traj.routing, t.routing + 100 * 16, 250 * 16) == 0);

    mtrl_wire_encode_end(&o, &t, 2);
    decode_ok(&o, &m, "END");
    TEST_EQ_INT(m.hdr.seq, 2);
    TEST_EQ_INT(m.end_tokens, 500);
    TEST_EQ_INT(m.end_digest, mtrl_traj_digest_compute(&t));
    TEST_EQ_INT(m.traj.n_tools, 2);
    TEST_EQ_INT(m.traj.status, t.status);

    mtrl_wire_encode_weights_req(&o, 77, 9);
    decode_ok(&o, &m, "WEIGHTS_REQ");
    TEST_EQ_INT(m.hdr.id, 77);
    TEST_EQ_INT(m.weight_version, 9);

    uint8_t blob[3000];
    for (size_t i = 0; i < sizeof blob; i++) blob[i] = (uint8_t)(i * 7);
    mtrl_wire_encode_weights(&o, 9, 1, 3, sizeof blob, 1000, blob + 1000, 1000);
    decode_ok(&o, &m, "WEIGHTS");
    TEST_EQ_INT(m.chunk_index, 1);
    TEST_EQ_INT(m.chunk_count, 3);
    TEST_EQ_INT(m.blob_bytes, 3000);
    TEST_EQ_INT(m.blob_offset, 1000);
    TEST_EQ_INT(m.data_len, 1000);
    TEST_CHECK(m.data && memcmp(m.data, blob + 1000, 1000) == 0);
    TEST_EQ_INT(m.chunk_digest, mtrl_crc32c(0, blob + 1000, 1000));

    uint64_t counts[3 * 5];
    uint32_t batches[3] = {0, 7, 11};
    double beta_sum[3 * 5];
    for (int i = 0; i < 15; i++) {
        counts[i] = (uint64_t)i * 1000003u;
        beta_sum[i] = 0.37 * i - 2.5;
    }
    mtrl_wire_encode_routing_stats(&o, 9, 3, 5, counts, batches, beta_sum);
    decode_ok(&o, &m, "ROUTING_STATS");
    TEST_EQ_INT(m.layers, 3);
    TEST_EQ_INT(m.experts, 5);
    TEST_CHECK(m.counts && memcmp(m.counts, counts, sizeof counts) == 0);
    TEST_CHECK(m.qb_batches && memcmp(m.qb_batches, batches, sizeof batches) == 0);
    TEST_CHECK(m.qb_beta_sum && memcmp(m.qb_beta_sum, beta_sum, sizeof beta_sum) == 0);
    // A β sum that is not a number is refused, naming the field.
    beta_sum[4] = NAN;
    mtrl_wire_encode_routing_stats(&o, 9, 3, 5, counts, batches, beta_sum);
    {
        mtrl_error e;
        TEST_CHECK(mtrl_wire_decode(o.hdr, MTRL_WIRE_HDR_SIZE, o.payload.data, o.payload.len, &lim_, &m, &e) ==
                   MTRL_ERR_FORMAT);
        TEST_CONTAINS(e.msg, "beta_sum[4]");
    }

    mtrl_wire_encode_heartbeat(&o);
    decode_ok(&o, &m, "HEARTBEAT");
    TEST_EQ_INT(o.payload.len, 0);
    TEST_EQ_INT(mtrl_le32(o.hdr + 32), 0);

    mtrl_wire_encode_bye(&o, "shutting down");
    decode_ok(&o, &m, "BYE");
    TEST_EQ_STR(m.text, "shutting down");
    mtrl_wire_encode_bye(&o, NULL);
    decode_ok(&o, &m, "BYE empty");
    TEST_CHECK(m.text == NULL);

    mtrl_wire_encode_error(&o, MTRL_ERR_MISMATCH, "config hash differs");
    decode_ok(&o, &m, "ERROR");
    TEST_EQ_INT(m.code, MTRL_ERR_MISMATCH);
    TEST_EQ_STR(m.text, "config hash differs");

    mtrl_wire_encode_weights_at(&o, 9, 1, 0x0123456789abcdefull, "/mtrl-w.42.0123456789abcdef");
    decode_ok(&o, &m, "WEIGHTS_AT");
    TEST_EQ_INT(m.weight_version, 9);
    TEST_EQ_INT(m.slot, 1);
    TEST_CHECK(m.nonce == 0x0123456789abcdefull);
    TEST_EQ_STR(m.text, "/mtrl-w.42.0123456789abcdef");

    TEST_EQ_STR(mtrl_wire_type_name(MTRL_WIRE_WEIGHTS_AT), "WEIGHTS_AT");
    TEST_EQ_STR(mtrl_wire_type_name(MTRL_WIRE_ROUTING_STATS), "ROUTING_STATS");
    TEST_EQ_STR(mtrl_wire_type_name(99), "UNKNOWN");
    mtrl_traj_free(&t);
    mtrl_wire_msg_free(&m);
    mtrl_wire_out_free(&o);
}

// Copies o's bytes, lets `edit` change them, and expects decode to fail with want + needle.
static void expect_bad(const uint8_t *hdr, size_t hn, const uint8_t *pl, size_t pn, const mtrl_wire_limits *l,
                       mtrl_status want, const char *needle) {
    mtrl_wire_msg m;
    mtrl_wire_msg_init(&m);
    mtrl_error err;
    err.msg[0] = '\0';
    mtrl_status st = mtrl_wire_decode(hdr, hn, pl, pn, l, &m, &err);
    TEST_CHECKF(st == want, "want %s (%s), got %s: %s", mtrl_status_name(want), needle, mtrl_status_name(st), err.msg);
    TEST_CONTAINS(err.msg, needle);
    mtrl_wire_msg_free(&m);
}

// Recomputes the header's payload CRC after a payload edit, so the payload decoder is reached.
static void fix_crc(uint8_t *hdr, const uint8_t *pl, size_t pn) {
    mtrl_st32(hdr + 32, pn ? mtrl_crc32c(0, pl, pn) : 0);
}

static void test_malformed(void) {
    mtrl_wire_out o;
    mtrl_wire_out_init(&o);
    uint8_t h[MTRL_WIRE_HDR_SIZE + 1], p[4096];

    mtrl_wire_encode_hello(&o, 1, 1, 0);
    memcpy(h, o.hdr, 40);
    expect_bad(h, 39, o.payload.data, o.payload.len, &lim_, MTRL_ERR_FORMAT, "39 bytes; a header frame is 40 bytes");
    h[0] = 'X';
    expect_bad(h, 40, o.payload.data, o.payload.len, &lim_, MTRL_ERR_FORMAT, "bad magic");
    memcpy(h, o.hdr, 40);
    mtrl_st16(h + 4, 2);
    expect_bad(h, 40, o.payload.data, o.payload.len, &lim_, MTRL_ERR_MISMATCH, "protocol version 2");
    memcpy(h, o.hdr, 40);
    mtrl_st16(h + 6, MTRL_WIRE_TYPE_MAX + 1);
    expect_bad(h, 40, o.payload.data, o.payload.len, &lim_, MTRL_ERR_FORMAT, "unknown message type 15");
    memcpy(h, o.hdr, 40);
    mtrl_st32(h + 8, 4);
    expect_bad(h, 40, o.payload.data, o.payload.len, &lim_, MTRL_ERR_FORMAT, "unknown flags");
    memcpy(h, o.hdr, 40);
    h[36] = 1;
    expect_bad(h, 40, o.payload.data, o.payload.len, &lim_, MTRL_ERR_FORMAT, "reserved");
    memcpy(h, o.hdr, 40);
    expect_bad(h, 40, o.payload.data, o.payload.len - 1, &lim_, MTRL_ERR_FORMAT, "payload is 19 bytes, the header says 20");
    memcpy(p, o.payload.data, o.payload.len);
    p[5] ^= 1;
    expect_bad(h, 40, p, o.payload.len, &lim_, MTRL_ERR_FORMAT, "payload CRC");
    // HELLO with a trailing byte: over the type's fixed size.
    memcpy(p, o.payload.data, o.payload.len);
    p[20] = 0;
    mtrl_st64(h + 16, 21);
    fix_crc(h, p, 21);
    expect_bad(h, 40, p, 21, &lim_, MTRL_ERR_LIMIT, "wire HELLO: at byte 16: payload of 21 bytes over the cap of 20");

    // Oversized payloads are refused from the header alone, before any payload is looked at.
    mtrl_wire_limits small = lim_;
    small.max_payload = 1000;
    mtrl_wire_encode_credit(&o, 1);
    memcpy(h, o.hdr, 40);
    mtrl_st16(h + 6, MTRL_WIRE_CHUNK);
    mtrl_st64(h + 16, 1u << 30);
    expect_bad(h, 40, NULL, 0, &small, MTRL_ERR_LIMIT, "wire CHUNK: at byte 16: payload of 1073741824 bytes over the cap of 1000");

    // WELCOME config over max_config.
    small = lim_;
    small.max_config = 10;
    mtrl_wire_encode_welcome(&o, 1, 2, 3, 4, "0123456789ABC");
    expect_bad(o.hdr, 40, o.payload.data, o.payload.len, &small, MTRL_ERR_LIMIT, "payload of 45 bytes over the cap of 42");
    small.max_config = 12;
    memcpy(h, o.hdr, 40);
    memcpy(p, o.payload.data, o.payload.len);
    mtrl_st64(h + 16, 44);
    fix_crc(h, p, 44);
    expect_bad(h, 40, p, 44, &small, MTRL_ERR_LIMIT, "config_text: length 13 over the cap of 12 bytes");
    // ROUTING_STATS over max_routing_cells.
    small = lim_;
    small.max_routing_cells = 14;
    uint64_t counts[15] = {0};
    mtrl_wire_encode_routing_stats(&o, 1, 3, 5, counts, NULL, NULL);
    small.max_payload = lim_.max_payload;
    memcpy(h, o.hdr, 40);
    expect_bad(h, 40, o.payload.data, o.payload.len, &small, MTRL_ERR_LIMIT, "3 x 5 over max_routing_cells=14");
    // ... and a cell count the payload cannot hold (layers x experts overflowing 32 bits).
    memcpy(p, o.payload.data, 12);
    mtrl_st32(p + 4, 0x10000);
    mtrl_st32(p + 8, 0x10000);
    memcpy(h, o.hdr, 40);
    mtrl_st64(h + 16, 12);
    fix_crc(h, p, 12);
    expect_bad(h, 40, p, 12, &lim_, MTRL_ERR_LIMIT, "layers x experts: 65536 x 65536 over max_routing_cells");

    // BYE / ERROR text over max_text; WEIGHTS chunk_count over max_weight_chunks.
    small = lim_;
    small.max_text = 8;
    mtrl_wire_encode_error(&o, 1, "123456789");
    expect_bad(o.hdr, 40, o.payload.data, o.payload.len, &small, MTRL_ERR_LIMIT, "wire ERROR: at byte 16: payload of 17 bytes over the cap of 16");
    small.max_text = 9;
    mtrl_wire_encode_bye(&o, "0123456789");
    memcpy(h, o.hdr, 40);
    memcpy(p, o.payload.data, o.payload.len);
    mtrl_st64(h + 16, 13);
    fix_crc(h, p, 13);
    expect_bad(h, 40, p, 13, &small, MTRL_ERR_LIMIT, "wire BYE: at byte 0: reason: length 10 over the cap of 9 bytes");
    small = lim_;
    small.max_weight_chunks = 4;
    uint8_t w8[8] = {0};
    mtrl_wire_encode_weights(&o, 1, 0, 5, 8, 0, w8, 8);
    expect_bad(o.hdr, 40, o.payload.data, o.payload.len, &small, MTRL_ERR_LIMIT, "chunk_count: 5 (must be 1..max_weight_chunks=4)");

    // WEIGHTS: digest, offsets, chunk index.
    uint8_t blob[64] = {1, 2, 3};
    mtrl_wire_encode_weights(&o, 1, 0, 2, 64, 0, blob, 64);
    memcpy(h, o.hdr, 40);
    memcpy(p, o.payload.data, o.payload.len);
    size_t wn = o.payload.len;
    p[wn - 1] ^= 0x10;
    fix_crc(h, p, wn);
    expect_bad(h, 40, p, wn, &lim_, MTRL_ERR_FORMAT, "digest mismatch: chunk 0");
    memcpy(p, o.payload.data, wn);
    mtrl_st64(p + 12, 63); // blob_bytes smaller than offset + n
    fix_crc(h, p, wn);
    expect_bad(h, 40, p, wn, &lim_, MTRL_ERR_FORMAT, "run past the blob's 63 bytes");
    memcpy(p, o.payload.data, wn);
    mtrl_st32(p + 4, 2); // chunk_index == chunk_count
    fix_crc(h, p, wn);
    expect_bad(h, 40, p, wn, &lim_, MTRL_ERR_FORMAT, "chunk_index: 2 of 2 chunks");

    // BEGIN whose id disagrees with the header; CHUNK with a bad kind; END with a bad status.
    tg_rng r = {3};
    mtrl_traj t;
    mtrl_traj_init(&t);
    tg_traj(&t, &r, 20, 0, 0, 0);
    mtrl_wire_encode_begin(&o, &t);
    memcpy(h, o.hdr, 40);
    mtrl_st64(h + 24, t.episode_id + 1);
    expect_bad(h, 40, o.payload.data, o.payload.len, &lim_, MTRL_ERR_FORMAT, "but the episode header says");
    mtrl_wire_encode_chunk(&o, &t, 0, 0, 20);
    memcpy(h, o.hdr, 40);
    memcpy(p, o.payload.data, o.payload.len);
    p[24 + 160 + 3] = 9;
    fix_crc(h, p, o.payload.len);
    expect_bad(h, 40, p, o.payload.len, &lim_, MTRL_ERR_FORMAT, "wire CHUNK: token slice: at byte 187: kind[3]: 9");
    mtrl_wire_encode_end(&o, &t, 1);
    memcpy(h, o.hdr, 40);
    memcpy(p, o.payload.data, o.payload.len);
    mtrl_st32(p + 24, 77);
    fix_crc(h, p, o.payload.len);
    expect_bad(h, 40, p, o.payload.len, &lim_, MTRL_ERR_FORMAT, "wire END: episode summary: at byte 24: status: 77");
    mtrl_traj_free(&t);

    // Every truncation of every message type is refused (header says more than arrives).
    mtrl_wire_msg m;
    mtrl_wire_msg_init(&m);
    mtrl_wire_encode_welcome(&o, 1, 2, 3, 4, "config");
    for (size_t n = 0; n < o.payload.len; n++) {
        mtrl_error err;
        memcpy(h, o.hdr, 40);
        mtrl_st64(h + 16, n);
        fix_crc(h, o.payload.data, n);
        TEST_EQ_INT(mtrl_wire_decode(h, 40, o.payload.data, n, &lim_, &m, &err), MTRL_ERR_FORMAT);
    }
    mtrl_wire_msg_free(&m);
    mtrl_wire_out_free(&o);
}

// ---- assembler ---------------------------------------------------------------------------

typedef struct stream {
    mtrl_wire_out msg[64];
    int n;
} stream;

// BEGIN, CHUNKs of `per` tokens, END for t.
static void stream_build(stream *s, const mtrl_traj *t, uint32_t per) {
    s->n = 0;
    mtrl_wire_out_init(&s->msg[s->n]);
    mtrl_wire_encode_begin(&s->msg[s->n++], t);
    uint32_t seq = 0;
    for (uint64_t off = 0; off < t->n_tokens; off += per) {
        uint32_t n = (uint32_t)(t->n_tokens - off < per ? t->n_tokens - off : per);
        mtrl_wire_out_init(&s->msg[s->n]);
        mtrl_wire_encode_chunk(&s->msg[s->n++], t, seq++, off, n);
    }
    mtrl_wire_out_init(&s->msg[s->n]);
    mtrl_wire_encode_end(&s->msg[s->n++], t, seq);
}

static void stream_free(stream *s) {
    for (int i = 0; i < s->n; i++) mtrl_wire_out_free(&s->msg[i]);
    s->n = 0;
}

static mtrl_status feed(mtrl_wire_asm *a, uint32_t actor, uint32_t inc, const mtrl_wire_out *o, mtrl_error *err) {
    mtrl_wire_hdr h;
    mtrl_status st = mtrl_wire_hdr_decode(o->hdr, MTRL_WIRE_HDR_SIZE, &lim_, &h, err);
    if (st) return st;
    return mtrl_wire_asm_feed(a, actor, inc, &h, o->payload.data, o->payload.len, err);
}

static void make_ep(mtrl_traj *t, tg_rng *r, uint32_t actor, uint32_t inc, uint64_t id, uint64_t n) {
    tg_traj(t, r, n, 8, 0, 2);
    t->actor_id = actor;
    t->incarnation = inc;
    t->episode_id = id;
}

static void test_assembler(void) {
    tg_rng r = {77};
    mtrl_wire_asm *a = mtrl_wire_asm_new(&lim_);
    mtrl_traj t, got;
    mtrl_traj_init(&t);
    mtrl_traj_init(&got);
    stream s;
    mtrl_error err;
    char why[128];

    // In order, with duplicates sprinkled in: committed, equal, digest checked.
    make_ep(&t, &r, 1, 0, 100, 3000);
    stream_build(&s, &t, 400);
    TEST_EQ_INT(s.n, 10);
    for (int i = 0; i < s.n; i++) {
        TEST_EQ_INT(feed(a, 1, 0, &s.msg[i], &err), MTRL_OK);
        if (i == 0 || i == 3) TEST_EQ_INT(feed(a, 1, 0, &s.msg[i], &err), MTRL_OK); // duplicate BEGIN, CHUNK
        if (i == 5) TEST_EQ_INT(feed(a, 1, 0, &s.msg[2], &err), MTRL_OK);            // an old CHUNK again
        if (i < s.n - 1) TEST_EQ_INT(mtrl_wire_asm_pop(a, &got), 0);
    }
    TEST_EQ_INT(mtrl_wire_asm_pop(a, &got), 1);
    TEST_CHECKF(mtrl_traj_equal(&got, &t, why, sizeof why), "assembled episode: %s", why);
    TEST_EQ_INT(got.digest, mtrl_traj_digest_compute(&t));
    TEST_EQ_INT(mtrl_wire_asm_stats(a)->duplicates, 3);
    TEST_EQ_INT(mtrl_wire_asm_stats(a)->completed, 1);
    TEST_EQ_INT(mtrl_wire_asm_open_bytes(a), 0);
    // Anything after the END is late, not an error.
    TEST_EQ_INT(feed(a, 1, 0, &s.msg[4], &err), MTRL_OK);
    TEST_EQ_INT(feed(a, 1, 0, &s.msg[s.n - 1], &err), MTRL_OK);
    TEST_EQ_INT(mtrl_wire_asm_stats(a)->late, 2);
    TEST_EQ_INT(mtrl_wire_asm_pop(a, &got), 0);
    stream_free(&s);

    // A recycled trajectory's buffers carry the next episode (with another routing shape).
    uint32_t *old_ids = got.ids;
    mtrl_wire_asm_recycle(a, &got);
    TEST_CHECK(got.ids == NULL && got.n_tokens == 0);
    tg_traj(&t, &r, 2500, 3, 1, 1);
    t.actor_id = 1;
    t.incarnation = 0;
    t.episode_id = 150;
    stream_build(&s, &t, 1000);
    for (int i = 0; i < s.n; i++) TEST_EQ_INT(feed(a, 1, 0, &s.msg[i], &err), MTRL_OK);
    TEST_EQ_INT(mtrl_wire_asm_pop(a, &got), 1);
    TEST_CHECK(got.ids == old_ids); // the same allocation, reused
    TEST_CHECKF(mtrl_traj_equal(&got, &t, why, sizeof why), "episode in recycled buffers: %s", why);
    stream_free(&s);

    // A dropped chunk: the next one is a gap -> REJECTED, never committed.
    make_ep(&t, &r, 1, 0, 101, 1000);
    stream_build(&s, &t, 300);
    feed(a, 1, 0, &s.msg[0], &err);
    feed(a, 1, 0, &s.msg[1], &err);
    TEST_EQ_INT(feed(a, 1, 0, &s.msg[3], &err), MTRL_ERR_PEER);
    TEST_CONTAINS(err.msg, "gap: expected chunk 1, got chunk 2");
    TEST_EQ_INT(mtrl_wire_asm_pop(a, &got), 1);
    TEST_EQ_INT(got.status, MTRL_EP_REJECTED);
    TEST_EQ_INT(got.episode_id, 101);
    TEST_CONTAINS(got.reason, "gap");
    for (int i = 4; i < s.n; i++) TEST_EQ_INT(feed(a, 1, 0, &s.msg[i], &err), MTRL_OK); // late now
    TEST_EQ_INT(mtrl_wire_asm_pop(a, &got), 0);
    stream_free(&s);

    // A chunk missing at the end: END's seq says so.
    make_ep(&t, &r, 1, 0, 102, 1000);
    stream_build(&s, &t, 300);
    for (int i = 0; i < s.n - 2; i++) feed(a, 1, 0, &s.msg[i], &err);
    TEST_EQ_INT(feed(a, 1, 0, &s.msg[s.n - 1], &err), MTRL_ERR_PEER);
    TEST_CONTAINS(err.msg, "END after 4 chunks, but 3 chunks arrived");
    TEST_EQ_INT(mtrl_wire_asm_pop(a, &got), 1);
    TEST_EQ_INT(got.status, MTRL_EP_REJECTED);
    stream_free(&s);

    // A wrong digest, and a wrong token count, in an otherwise valid END.
    for (int which = 0; which < 2; which++) {
        make_ep(&t, &r, 2, 0, 200 + (uint64_t)which, 700);
        stream_build(&s, &t, 250);
        mtrl_wire_msg m;
        mtrl_wire_msg_init(&m);
        mtrl_wire_out *end = &s.msg[s.n - 1];
        TEST_EQ_INT(mtrl_wire_decode(end->hdr, 40, end->payload.data, end->payload.len, &lim_, &m, &err), MTRL_OK);
        if (which == 0) m.end_digest ^= 1;
        else m.end_tokens = 699;
        mtrl_wire_msg_encode(end, &m);
        mtrl_wire_msg_free(&m);
        for (int i = 0; i < s.n - 1; i++) TEST_EQ_INT(feed(a, 2, 0, &s.msg[i], &err), MTRL_OK);
        TEST_EQ_INT(feed(a, 2, 0, end, &err), MTRL_ERR_MISMATCH);
        TEST_CONTAINS(err.msg, which == 0 ? "digest mismatch" : "END says 699 tokens, 700 arrived");
        TEST_EQ_INT(mtrl_wire_asm_pop(a, &got), 1);
        TEST_EQ_INT(got.status, MTRL_EP_REJECTED);
        TEST_CONTAINS(got.reason, which == 0 ? "digest mismatch" : "699");
        stream_free(&s);
    }

    // A chunk whose tokens were changed in flight (valid encoding, other ids): digest catches it.
    make_ep(&t, &r, 2, 0, 210, 500);
    stream_build(&s, &t, 250);
    s.msg[1].payload.data[24] ^= 1; // first id of chunk 0
    mtrl_wire_msg m;
    mtrl_wire_msg_init(&m);
    mtrl_wire_decode(s.msg[1].hdr, 40, s.msg[1].payload.data, s.msg[1].payload.len, &lim_, &m, &err); // CRC now wrong
    TEST_CONTAINS(err.msg, "payload CRC");
    mtrl_wire_msg_free(&m);
    for (int i = 0; i < s.n; i++) feed(a, 2, 0, &s.msg[i], &err); // the assembler trusts recv's CRC check
    TEST_EQ_INT(mtrl_wire_asm_pop(a, &got), 1);
    TEST_EQ_INT(got.status, MTRL_EP_REJECTED);
    TEST_CONTAINS(got.reason, "digest mismatch");
    stream_free(&s);

    // A malformed chunk rejects its episode with the decoder's reason.
    make_ep(&t, &r, 2, 0, 211, 300);
    stream_build(&s, &t, 300);
    feed(a, 2, 0, &s.msg[0], &err);
    s.msg[1].payload.data[24 + 300 * 8 + 5] = 200; // a kind byte
    TEST_EQ_INT(feed(a, 2, 0, &s.msg[1], &err), MTRL_ERR_FORMAT);
    TEST_EQ_INT(mtrl_wire_asm_pop(a, &got), 1);
    TEST_EQ_INT(got.status, MTRL_EP_REJECTED);
    TEST_CONTAINS(got.reason, "kind[5]: 200 is not a token kind");
    stream_free(&s);

    // Abort an actor: its open episodes come back ABORTED with the reason; others stay open.
    stream s2;
    make_ep(&t, &r, 3, 0, 300, 600);
    stream_build(&s, &t, 200);
    make_ep(&t, &r, 4, 0, 400, 600);
    stream_build(&s2, &t, 200);
    for (int i = 0; i < 3; i++) {
        feed(a, 3, 0, &s.msg[i], &err);
        feed(a, 4, 0, &s2.msg[i], &err);
    }
    TEST_EQ_INT(mtrl_wire_asm_open_count(a, 3, 0), 1);
    TEST_CHECK(mtrl_wire_asm_open_bytes(a) > 0);
    TEST_EQ_INT(mtrl_wire_asm_abort_actor(a, 3, MTRL_WIRE_ANY_INCARNATION, "heartbeat timeout after 5 s"), 1);
    TEST_EQ_INT(mtrl_wire_asm_pop(a, &got), 1);
    TEST_EQ_INT(got.status, MTRL_EP_ABORTED);
    TEST_EQ_INT(got.episode_id, 300);
    TEST_EQ_INT(got.n_tokens, 400);
    TEST_EQ_STR(got.reason, "heartbeat timeout after 5 s");
    TEST_EQ_INT(mtrl_wire_asm_pop(a, &got), 0);
    TEST_EQ_INT(mtrl_wire_asm_open_count(a, 4, 0), 1);
    for (int i = 3; i < s.n; i++) TEST_EQ_INT(feed(a, 3, 0, &s.msg[i], &err), MTRL_OK); // late
    // Actor 4 restarts as incarnation 1: its old episode is aborted, its old messages are stale.
    make_ep(&t, &r, 4, 1, 401, 100);
    stream s3;
    stream_build(&s3, &t, 100);
    TEST_EQ_INT(feed(a, 4, 1, &s3.msg[0], &err), MTRL_OK);
    TEST_EQ_INT(mtrl_wire_asm_pop(a, &got), 1);
    TEST_EQ_INT(got.status, MTRL_EP_ABORTED);
    TEST_EQ_INT(got.episode_id, 400);
    TEST_CONTAINS(got.reason, "actor 4 restarted (incarnation 0 -> 1)");
    TEST_EQ_INT(feed(a, 4, 0, &s2.msg[3], &err), MTRL_ERR_PEER);
    TEST_CONTAINS(err.msg, "replaced by incarnation 1");
    for (int i = 1; i < s3.n; i++) TEST_EQ_INT(feed(a, 4, 1, &s3.msg[i], &err), MTRL_OK);
    TEST_EQ_INT(mtrl_wire_asm_pop(a, &got), 1);
    TEST_EQ_INT(got.status, t.status);
    TEST_EQ_INT(got.episode_id, 401);
    stream_free(&s);
    stream_free(&s2);
    stream_free(&s3);

    // A BEGIN from a sender that is not the actor it names; a CHUNK without a BEGIN.
    make_ep(&t, &r, 5, 0, 500, 10);
    stream_build(&s, &t, 10);
    TEST_EQ_INT(feed(a, 6, 0, &s.msg[0], &err), MTRL_ERR_PEER);
    TEST_CONTAINS(err.msg, "BEGIN names episode 500 of actor 5.0 but came as episode 500 from actor 6.0");
    TEST_EQ_INT(mtrl_wire_asm_pop(a, &got), 1);
    TEST_EQ_INT(got.status, MTRL_EP_REJECTED);
    uint64_t invalid = mtrl_wire_asm_stats(a)->invalid;
    TEST_EQ_INT(feed(a, 5, 0, &s.msg[1], &err), MTRL_ERR_PEER);
    TEST_CONTAINS(err.msg, "which has no BEGIN");
    TEST_EQ_INT(mtrl_wire_asm_stats(a)->invalid, invalid + 1);
    TEST_CONTAINS(mtrl_wire_asm_stats(a)->last_reason, "which has no BEGIN");
    // Not an episode message at all.
    mtrl_wire_out o;
    mtrl_wire_out_init(&o);
    mtrl_wire_encode_heartbeat(&o);
    TEST_EQ_INT(feed(a, 5, 0, &o, &err), MTRL_ERR_STATE);
    mtrl_wire_out_free(&o);
    stream_free(&s);
    mtrl_wire_asm_free(a);

    // Caps: open episodes per actor, bytes per episode.
    mtrl_wire_limits l = lim_;
    l.max_open_per_actor = 2;
    l.max_episode_bytes = 6000;
    a = mtrl_wire_asm_new(&l);
    for (uint64_t id = 0; id < 3; id++) {
        make_ep(&t, &r, 1, 0, id, 10);
        mtrl_wire_out_init(&o);
        mtrl_wire_encode_begin(&o, &t);
        mtrl_status st = feed(a, 1, 0, &o, &err);
        TEST_EQ_INT(st, id < 2 ? MTRL_OK : MTRL_ERR_LIMIT);
        mtrl_wire_out_free(&o);
    }
    TEST_CONTAINS(err.msg, "already has 2 open episodes (max_open_per_actor=2)");
    TEST_EQ_INT(mtrl_wire_asm_pop(a, &got), 1);
    TEST_EQ_INT(got.episode_id, 2);
    TEST_EQ_INT(got.status, MTRL_EP_REJECTED);
    make_ep(&t, &r, 1, 0, 0, 1000); // episode 0 is open: stream its 1000 tokens (> 6000 bytes)
    stream_build(&s, &t, 200);
    mtrl_status st = MTRL_OK;
    for (int i = 1; i < s.n && st == MTRL_OK; i++) st = feed(a, 1, 0, &s.msg[i], &err);
    TEST_EQ_INT(st, MTRL_ERR_LIMIT);
    TEST_CONTAINS(err.msg, "over max_episode_bytes=6000");
    TEST_EQ_INT(mtrl_wire_asm_pop(a, &got), 1);
    TEST_EQ_INT(got.status, MTRL_EP_REJECTED);
    TEST_EQ_INT(mtrl_wire_asm_stats(a)->rejected, 2);
    stream_free(&s);
    mtrl_wire_asm_free(a); // frees the still-open episode 1

    mtrl_traj_free(&t);
    mtrl_traj_free(&got);
}

// ---- real sockets --------------------------------------------------------------------------

static mtrl_status recv_ok(mtrl_wire_sock *s, mtrl_wire_in *in, mtrl_wire_stats *stats, const char *what) {
    mtrl_error err;
    mtrl_status st = mtrl_wire_recv(s, 3000, in, stats, &err);
    TEST_CHECKF(st == MTRL_OK, "%s: %s", what, err.msg);
    return st;
}

static void test_sockets(void) {
    void *ctx = zmq_ctx_new();
    mtrl_wire_limits ll = lim_;
    ll.max_payload = 1u << 20; // the learner takes frames up to 1 MiB
    mtrl_wire_sock L, D;
    mtrl_error err;
    TEST_EQ_INT(mtrl_wire_router_open(&L, ctx, "tcp://127.0.0.1:*", &ll, NULL, &err), MTRL_OK);
    TEST_CHECKF(strncmp(L.endpoint, "tcp://127.0.0.1:", 16) == 0 && strlen(L.endpoint) > 16, "endpoint %s",
                L.endpoint);
    TEST_EQ_INT(mtrl_wire_dealer_open(&D, ctx, L.endpoint, 7, 2, NULL, NULL, &err), MTRL_OK);
    TEST_CHECK(strncmp((const char *)D.self_id.id, "a7.i2.", 6) == 0);
    mtrl_wire_stats lstats;
    memset(&lstats, 0, sizeof lstats);

    // Nothing yet: a timeout, not an error.
    mtrl_wire_in in;
    TEST_EQ_INT(mtrl_wire_recv(&L, 20, &in, &lstats, &err), MTRL_ERR_TIMEOUT);

    // HELLO -> WELCOME.
    mtrl_wire_out o;
    mtrl_wire_out_init(&o);
    mtrl_wire_encode_hello(&o, 7, 2, MTRL_WIRE_CAP_ROUTING);
    TEST_EQ_INT(mtrl_wire_send(&D, NULL, &o, &err), MTRL_OK);
    mtrl_wire_msg m;
    mtrl_wire_msg_init(&m);
    mtrl_wire_peer peer;
    memset(&peer, 0, sizeof peer);
    if (recv_ok(&L, &in, &lstats, "HELLO") == MTRL_OK) {
        TEST_EQ_INT(in.hdr.type, MTRL_WIRE_HELLO);
        TEST_EQ_INT(in.peer.len, D.self_id.len);
        TEST_CHECK(memcmp(in.peer.id, D.self_id.id, D.self_id.len) == 0);
        peer = in.peer;
        TEST_EQ_INT(mtrl_wire_decode(in.hdr_bytes, 40, in.payload, in.payload_len, &ll, &m, &err), MTRL_OK);
        TEST_EQ_INT(m.actor_id, 7);
    }
    mtrl_wire_encode_welcome(&o, 1, 0xabc, 5, 1u << 24, "[model]\npreset = tiny\n");
    TEST_EQ_INT(mtrl_wire_send(&L, &peer, &o, &err), MTRL_OK);
    if (recv_ok(&D, &in, NULL, "WELCOME") == MTRL_OK) {
        TEST_EQ_INT(mtrl_wire_decode(in.hdr_bytes, 40, in.payload, in.payload_len, &lim_, &m, &err), MTRL_OK);
        TEST_EQ_INT(m.weight_version, 5);
        TEST_EQ_STR(m.text, "[model]\npreset = tiny\n");
    }
    // A ROUTER send to a peer it never heard of fails loudly (ROUTER_MANDATORY).
    mtrl_wire_peer ghost = {{'n', 'o', 'b', 'o', 'd', 'y'}, 6};
    TEST_EQ_INT(mtrl_wire_send(&L, &ghost, &o, &err), MTRL_ERR_PEER);

    // A multi-chunk episode with routing, end to end through the assembler.
    tg_rng r = {8};
    mtrl_traj t, got;
    mtrl_traj_init(&t);
    mtrl_traj_init(&got);
    make_ep(&t, &r, 7, 2, 9001, 20000);
    stream s;
    stream_build(&s, &t, 2500); // ~ 2500 * (13 + 8) bytes per chunk
    for (int i = 0; i < s.n; i++) TEST_EQ_INT(mtrl_wire_send(&D, NULL, &s.msg[i], &err), MTRL_OK);
    mtrl_wire_asm *a = mtrl_wire_asm_new(&ll);
    int popped = 0;
    for (int i = 0; i < s.n && !popped; i++) {
        if (recv_ok(&L, &in, &lstats, "episode message") != MTRL_OK) break;
        TEST_EQ_INT(mtrl_wire_asm_feed(a, 7, 2, &in.hdr, in.payload, in.payload_len, &err), MTRL_OK);
        popped = mtrl_wire_asm_pop(a, &got);
    }
    TEST_CHECK(popped);
    char why[128];
    TEST_CHECKF(mtrl_traj_equal(&got, &t, why, sizeof why), "over tcp: %s", why);
    TEST_EQ_INT(mtrl_wire_asm_stats(a)->completed, 1);
    stream_free(&s);

    // Garbage from the peer: refused with a reason, counted, the learner carries on.
    uint64_t inv = lstats.invalid;
    zmq_send(D.sock, "GARBAGE-GARBAGE-GARBAGE-GARBAGE-GARBAGE!", 40, 0);
    TEST_EQ_INT(mtrl_wire_recv(&L, 3000, &in, &lstats, &err), MTRL_ERR_FORMAT);
    TEST_CONTAINS(err.msg, "bad magic");
    TEST_CONTAINS(err.msg, "from a7.i2.");
    TEST_EQ_INT(lstats.invalid, inv + 1);
    TEST_CONTAINS(lstats.last_reason, "bad magic");
    zmq_send(D.sock, "x", 1, ZMQ_SNDMORE);
    zmq_send(D.sock, "y", 1, ZMQ_SNDMORE);
    zmq_send(D.sock, "z", 1, 0);
    TEST_EQ_INT(mtrl_wire_recv(&L, 3000, &in, &lstats, &err), MTRL_ERR_FORMAT);
    TEST_CONTAINS(err.msg, "message of 3 frames");

    // A frame over ZMQ_MAXMSGSIZE: libzmq drops the connection, the learner sees nothing
    // (no crash, no allocation of the frame), and the actor's open episode is aborted by the
    // caller when the peer is declared dead.
    make_ep(&t, &r, 7, 2, 9002, 120000); // one chunk of 120000 * 21 bytes > 1 MiB
    stream_build(&s, &t, 120000);
    TEST_EQ_INT(mtrl_wire_send(&D, NULL, &s.msg[0], &err), MTRL_OK);
    TEST_CHECK(s.msg[1].payload.len > ll.max_payload);
    TEST_EQ_INT(mtrl_wire_send(&D, NULL, &s.msg[1], &err), MTRL_OK);
    int begins = 0;
    for (;;) {
        mtrl_status st = mtrl_wire_recv(&L, 500, &in, &lstats, &err);
        if (st == MTRL_ERR_TIMEOUT) break;
        TEST_EQ_INT(st, MTRL_OK);
        TEST_EQ_INT(in.hdr.type, MTRL_WIRE_BEGIN);
        if (st == MTRL_OK) mtrl_wire_asm_feed(a, 7, 2, &in.hdr, in.payload, in.payload_len, &err);
        begins++;
    }
    TEST_CHECK(begins <= 1);
    TEST_EQ_INT(mtrl_wire_asm_abort_actor(a, 7, 2, "heartbeat timeout"), (size_t)begins);
    stream_free(&s);
    mtrl_wire_sock_close(&D);

    // A fresh DEALER (the restarted actor) still gets through.
    TEST_EQ_INT(mtrl_wire_dealer_open(&D, ctx, L.endpoint, 7, 3, NULL, NULL, &err), MTRL_OK);
    mtrl_wire_encode_hello(&o, 7, 3, 0);
    TEST_EQ_INT(mtrl_wire_send(&D, NULL, &o, &err), MTRL_OK);
    if (recv_ok(&L, &in, &lstats, "HELLO after the oversized frame") == MTRL_OK) {
        TEST_EQ_INT(in.hdr.type, MTRL_WIRE_HELLO);
        TEST_CHECK(memcmp(in.peer.id, "a7.i3.", 6) == 0);
        peer = in.peer;
    }
    mtrl_wire_encode_credit(&o, 4096);
    TEST_EQ_INT(mtrl_wire_send(&L, &peer, &o, &err), MTRL_OK);
    if (recv_ok(&D, &in, NULL, "CREDIT") == MTRL_OK) TEST_EQ_INT(in.hdr.type, MTRL_WIRE_CREDIT);

    mtrl_wire_asm_free(a);
    mtrl_wire_msg_free(&m);
    mtrl_wire_out_free(&o);
    mtrl_traj_free(&t);
    mtrl_traj_free(&got);
    mtrl_wire_sock_close(&D);
    mtrl_wire_sock_close(&L);
    double t0 = 0;
    (void)t0;
    TEST_EQ_INT(zmq_ctx_term(ctx), 0); // bounded linger: returns promptly
}

// ACTOR_STATS (the actor's time split for mtrl bench rl): round trip, the byte layout the header
// of wire.h gives, and the refusals: an unknown layout version (MISMATCH, so a newer actor is
// told apart from a broken one), a field count that is not the version's, a negative or
// non-finite time, a truncated payload, bytes after the end.
static void test_actor_stats(void) {
    mtrl_wire_out o;
    mtrl_wire_out_init(&o);
    mtrl_wire_msg m;
    mtrl_wire_msg_init(&m);
    mtrl_wire_actor_stats s = {1.25, 0.125, 0.5, 0.0625, 0.25, 4096, 777, 99};
    mtrl_wire_encode_actor_stats(&o, &s);
    decode_ok(&o, &m, "ACTOR_STATS");
    TEST_EQ_INT(m.hdr.type, MTRL_WIRE_ACTOR_STATS);
    TEST_CHECK(memcmp(&m.actor_stats, &s, sizeof s) == 0);
    TEST_EQ_STR(mtrl_wire_type_name(MTRL_WIRE_ACTOR_STATS), "ACTOR_STATS");
    TEST_EQ_INT(o.payload.len, 8 + 8 * MTRL_WIRE_ACTOR_STATS_FIELDS);
    TEST_EQ_INT(mtrl_le32(o.payload.data), MTRL_WIRE_ACTOR_STATS_VERSION);
    TEST_EQ_INT(mtrl_le32(o.payload.data + 4), MTRL_WIRE_ACTOR_STATS_FIELDS);
    uint64_t u = mtrl_le64(o.payload.data + 8 + 8 * 2); // decode_s, the third field
    double d;
    memcpy(&d, &u, 8);
    TEST_NEAR(d, 0.5, 0);

    uint8_t h[MTRL_WIRE_HDR_SIZE], p[128];
    size_t n = o.payload.len;
    memcpy(h, o.hdr, sizeof h);
    memcpy(p, o.payload.data, n);
    mtrl_st32(p, 2);
    fix_crc(h, p, n);
    expect_bad(h, sizeof h, p, n, &lim_, MTRL_ERR_MISMATCH, "wire ACTOR_STATS: at byte 0: layout version 2; this build reads version 1");
    memcpy(p, o.payload.data, n);
    mtrl_st32(p + 4, 7);
    fix_crc(h, p, n);
    expect_bad(h, sizeof h, p, n, &lim_, MTRL_ERR_FORMAT, "at byte 4: field count 7; layout version 1 has 8");
    mtrl_wire_actor_stats bad = s;
    bad.tools_s = -1;
    mtrl_wire_encode_actor_stats(&o, &bad);
    expect_bad(o.hdr, MTRL_WIRE_HDR_SIZE, o.payload.data, o.payload.len, &lim_, MTRL_ERR_FORMAT,
               "at byte 32: tools_s: -1, must be finite and >= 0");
    bad = s;
    bad.wait_s = INFINITY;
    mtrl_wire_encode_actor_stats(&o, &bad);
    expect_bad(o.hdr, MTRL_WIRE_HDR_SIZE, o.payload.data, o.payload.len, &lim_, MTRL_ERR_FORMAT, "wait_s: inf");
    // Truncated: the header's length says fewer bytes than the fields need.
    mtrl_wire_encode_actor_stats(&o, &s);
    memcpy(h, o.hdr, sizeof h);
    memcpy(p, o.payload.data, n);
    mtrl_st64(h + 16, n - 8);
    fix_crc(h, p, n - 8);
    expect_bad(h, sizeof h, p, n - 8, &lim_, MTRL_ERR_FORMAT, "decode_steps");
    // One byte more than the layout: over the type's cap, refused from the header alone.
    mtrl_st64(h + 16, n + 1);
    p[n] = 0;
    fix_crc(h, p, n + 1);
    expect_bad(h, sizeof h, p, n + 1, &lim_, MTRL_ERR_LIMIT, "wire ACTOR_STATS: at byte 16: payload of 73 bytes over the cap of 72");
    mtrl_wire_msg_free(&m);
    mtrl_wire_out_free(&o);
}

int main(void) {
    lim_ = mtrl_wire_limits_default();
    test_messages();
    test_actor_stats();
    test_malformed();
    test_assembler();
    test_sockets();
    return test_report();
}
