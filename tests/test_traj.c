// mtrl-test: cpu timeout=120
// test_traj: the trajectory representation (common/traj.h): bit-exact round trips of every
// encoding, the chunking-independent digest, and a decoder that refuses every truncation,
// every cap violation and every non-canonical form with a message naming the byte.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/hash.h"
#include "common/traj.h"
#include "tests/fuzz/trajgen.h"
#include "tests/testhelp.h"

static mtrl_traj_limits lim_;

// encode -> decode -> equal -> encode again gives the same bytes.
static void check_roundtrip(const mtrl_traj *t, const char *label) {
    mtrl_wbuf a, b;
    mtrl_wbuf_init(&a);
    mtrl_wbuf_init(&b);
    mtrl_traj_encode(&a, t);
    mtrl_traj u;
    mtrl_traj_init(&u);
    mtrl_error err;
    mtrl_status st = mtrl_traj_decode(&u, a.data, a.len, &lim_, &err);
    TEST_CHECKF(st == MTRL_OK, "%s: decode: %s", label, err.msg);
    char why[128];
    TEST_CHECKF(mtrl_traj_equal(t, &u, why, sizeof why), "%s: %s", label, why);
    TEST_EQ_INT(u.digest, mtrl_traj_digest_compute(t));
    TEST_EQ_INT(u.n_model, t->n_model);
    TEST_EQ_INT(u.version_min, t->version_min);
    TEST_EQ_INT(u.version_max, t->version_max);
    mtrl_traj_encode(&b, &u);
    TEST_CHECKF(a.len == b.len && memcmp(a.data, b.data, a.len) == 0, "%s: re-encoding differs", label);
    mtrl_traj_free(&u);
    mtrl_wbuf_free(&a);
    mtrl_wbuf_free(&b);
}

static void test_roundtrip(void) {
    mtrl_traj t;
    mtrl_traj_init(&t);
    // Empty episode, no routing, no tools.
    t.episode_id = 1;
    t.status = MTRL_EP_COMPLETE;
    check_roundtrip(&t, "empty");
    tg_rng r = {42};
    struct { uint64_t n; uint32_t width; int u16; uint32_t tools; } cases[] = {
        {1, 0, 0, 0}, {7, 3, 0, 1}, {300, 16, 0, 4}, {513, 12, 1, 2}, {2000, 0, 0, 9}, {4096, 48, 1, 3},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        tg_traj(&t, &r, cases[c].n, cases[c].width, cases[c].u16, cases[c].tools);
        char label[64];
        snprintf(label, sizeof label, "case %zu (%llu tokens, width %u)", c, (unsigned long long)cases[c].n,
                 cases[c].width);
        check_roundtrip(&t, label);
    }
    // Random shapes, reusing one trajectory (reset keeps buffers across routing shapes).
    for (int k = 0; k < 30; k++) {
        tg_traj(&t, &r, tg_below(&r, 700), tg_below(&r, 3) ? tg_below(&r, 24) : 0, (int)tg_below(&r, 2),
                tg_below(&r, 6));
        check_roundtrip(&t, "random");
    }
    // version_min/max follow MODEL tokens only.
    mtrl_traj_reset(&t);
    mtrl_traj_append(&t, 1, 0, 9, MTRL_TOK_PROMPT, NULL);
    mtrl_traj_append(&t, 2, 0, 5, MTRL_TOK_MODEL, NULL);
    mtrl_traj_append(&t, 3, 0, 7, MTRL_TOK_MODEL, NULL);
    mtrl_traj_append(&t, 4, 0, 1, MTRL_TOK_TOOL, NULL);
    TEST_EQ_INT(t.n_model, 2);
    TEST_EQ_INT(t.version_min, 5);
    TEST_EQ_INT(t.version_max, 7);
    // u16 routing ids read back.
    mtrl_traj_reset(&t);
    mtrl_traj_set_routing(&t, 2, 1);
    uint8_t row[4] = {0x34, 0x12, 0xff, 0x01};
    mtrl_traj_append(&t, 1, -1.0f, 0, MTRL_TOK_MODEL, row);
    TEST_EQ_INT(mtrl_traj_routing_id(&t, 0, 0), 0x1234);
    TEST_EQ_INT(mtrl_traj_routing_id(&t, 0, 1), 0x01ff);
    mtrl_traj_free(&t);
}

// The BEGIN / CHUNK / END encodings rebuild the same episode, however it is cut.
static void test_parts(void) {
    tg_rng r = {7};
    mtrl_traj t, u;
    mtrl_traj_init(&t);
    mtrl_traj_init(&u);
    mtrl_wbuf b;
    mtrl_wbuf_init(&b);
    mtrl_error err;
    for (int k = 0; k < 10; k++) {
        tg_traj(&t, &r, 100 + tg_below(&r, 2000), tg_below(&r, 2) ? 8 : 0, (int)tg_below(&r, 2), tg_below(&r, 4));
        mtrl_wbuf_reset(&b);
        mtrl_traj_header_encode(&b, &t);
        TEST_EQ_INT(mtrl_traj_header_decode(&u, b.data, b.len, &lim_, &err), MTRL_OK);
        uint64_t off = 0;
        int chunks = 0;
        while (off < t.n_tokens) {
            uint32_t n = 1 + tg_below(&r, 300);
            if (n > t.n_tokens - off) n = (uint32_t)(t.n_tokens - off);
            mtrl_wbuf_reset(&b);
            mtrl_traj_slice s = mtrl_traj_slice_of(&t, off, n);
            mtrl_traj_slice_encode(&b, &s);
            mtrl_traj_slice_info info;
            TEST_EQ_INT(mtrl_traj_slice_peek(b.data, b.len, &info, &err), MTRL_OK);
            TEST_EQ_INT(info.offset, off);
            TEST_EQ_INT(info.count, n);
            uint64_t got_off = 99;
            mtrl_status st = mtrl_traj_slice_decode(&u, b.data, b.len, off, &lim_, &got_off, &err);
            TEST_CHECKF(st == MTRL_OK, "slice at %llu: %s", (unsigned long long)off, err.msg);
            TEST_EQ_INT(got_off, off);
            off += n;
            chunks++;
        }
        mtrl_wbuf_reset(&b);
        mtrl_traj_summary_encode(&b, &t);
        uint64_t total = 0, digest = 0;
        TEST_EQ_INT(mtrl_traj_summary_decode(&u, b.data, b.len, &lim_, &total, &digest, &err), MTRL_OK);
        TEST_EQ_INT(total, t.n_tokens);
        TEST_EQ_INT(digest, mtrl_traj_digest_compute(&t));
        char why[128];
        TEST_CHECKF(mtrl_traj_equal(&t, &u, why, sizeof why), "rebuilt from %d chunks: %s", chunks, why);
    }
    // A slice whose offset or routing shape does not fit is refused and changes nothing.
    tg_traj(&t, &r, 50, 4, 0, 0);
    mtrl_wbuf_reset(&b);
    mtrl_traj_header_encode(&b, &t);
    mtrl_traj_header_decode(&u, b.data, b.len, &lim_, &err);
    mtrl_wbuf_reset(&b);
    mtrl_traj_slice s = mtrl_traj_slice_of(&t, 10, 20);
    mtrl_traj_slice_encode(&b, &s);
    TEST_EQ_INT(mtrl_traj_slice_decode(&u, b.data, b.len, 0, &lim_, NULL, &err), MTRL_ERR_FORMAT);
    TEST_CONTAINS(err.msg, "offset: slice starts at token 10, expected 0");
    TEST_EQ_INT(u.n_tokens, 0);
    mtrl_traj_set_routing(&u, 5, 0);
    TEST_EQ_INT(mtrl_traj_slice_decode(&u, b.data, b.len, UINT64_MAX, &lim_, NULL, &err), MTRL_ERR_FORMAT);
    TEST_CONTAINS(err.msg, "routing_width");
    TEST_EQ_INT(u.n_tokens, 0);
    mtrl_traj_free(&t);
    mtrl_traj_free(&u);
    mtrl_wbuf_free(&b);
}

static void test_digest(void) {
    tg_rng r = {99};
    mtrl_traj t;
    mtrl_traj_init(&t);
    for (int k = 0; k < 20; k++) {
        tg_traj(&t, &r, 1 + tg_below(&r, 3000), tg_below(&r, 2) ? 1 + tg_below(&r, 20) : 0, (int)tg_below(&r, 2), 0);
        uint64_t whole = mtrl_traj_digest_compute(&t);
        for (int cut = 0; cut < 5; cut++) {
            mtrl_traj_digest d;
            mtrl_traj_digest_init(&d);
            uint64_t off = 0;
            while (off < t.n_tokens) {
                uint64_t n = cut == 0 ? 1 : 1 + tg_below(&r, cut == 1 ? 7 : 900);
                if (n > t.n_tokens - off) n = t.n_tokens - off;
                mtrl_traj_digest_update(&d, &t, off, n);
                off += n;
            }
            mtrl_traj_digest_update(&d, &t, off, 0); // empty slices change nothing
            TEST_EQ_INT(mtrl_traj_digest_final(&d), whole);
        }
        // Every field of one token moves the digest.
        uint64_t i = tg_below(&r, (uint32_t)t.n_tokens);
        t.ids[i] ^= 1;
        TEST_CHECK(mtrl_traj_digest_compute(&t) != whole);
        t.ids[i] ^= 1;
        uint32_t bits;
        memcpy(&bits, &t.logprob[i], 4);
        bits ^= 0x80000000u; // -x vs x, and -0.0 vs 0.0
        memcpy(&t.logprob[i], &bits, 4);
        TEST_CHECK(mtrl_traj_digest_compute(&t) != whole);
        bits ^= 0x80000000u;
        memcpy(&t.logprob[i], &bits, 4);
        t.version[i]++;
        TEST_CHECK(mtrl_traj_digest_compute(&t) != whole);
        t.version[i]--;
        t.kind[i] ^= 1;
        TEST_CHECK(mtrl_traj_digest_compute(&t) != whole);
        t.kind[i] ^= 1;
        if (t.routing_width) {
            t.routing[i * mtrl_traj_routing_row_bytes(&t)] ^= 4;
            TEST_CHECK(mtrl_traj_digest_compute(&t) != whole);
            t.routing[i * mtrl_traj_routing_row_bytes(&t)] ^= 4;
        }
        TEST_EQ_INT(mtrl_traj_digest_compute(&t), whole);
    }
    // One token fewer is a different digest (the count is folded in).
    tg_traj(&t, &r, 10, 0, 0, 0);
    uint64_t ten = mtrl_traj_digest_compute(&t);
    t.n_tokens = 9;
    TEST_CHECK(mtrl_traj_digest_compute(&t) != ten);
    // The definition in traj.h, spelled out for one token.
    mtrl_traj_reset(&t);
    float lp = -1.5f;
    mtrl_traj_append(&t, 0x01020304u, lp, 7, MTRL_TOK_MODEL, NULL);
    uint8_t rec[13] = {4, 3, 2, 1, 0, 0, 0xc0, 0xbf, 7, 0, 0, 0, 1};
    uint64_t h = mtrl_hash64(rec, 13, MTRL_TRAJ_DIGEST_SEED);
    uint8_t n1[8] = {1, 0, 0, 0, 0, 0, 0, 0};
    TEST_EQ_INT(mtrl_traj_digest_compute(&t), mtrl_hash64(n1, 8, h));
    mtrl_traj_free(&t);
}

// Every strict prefix of an encoding is refused with a message naming a byte offset.
static void check_prefixes(const mtrl_wbuf *b, int which) {
    mtrl_traj u;
    mtrl_traj_init(&u);
    mtrl_error err;
    int bad = 0;
    for (size_t n = 0; n < b->len; n++) {
        mtrl_status st;
        err.msg[0] = '\0';
        if (which == 0) st = mtrl_traj_decode(&u, b->data, n, &lim_, &err);
        else if (which == 1) st = mtrl_traj_header_decode(&u, b->data, n, &lim_, &err);
        else if (which == 2) {
            mtrl_traj_reset(&u);
            mtrl_traj_set_routing(&u, 6, 1);
            st = mtrl_traj_slice_decode(&u, b->data, n, UINT64_MAX, &lim_, NULL, &err);
            if (u.n_tokens) bad++;
        } else st = mtrl_traj_summary_decode(&u, b->data, n, &lim_, NULL, NULL, &err);
        if (st != MTRL_ERR_FORMAT || !strstr(err.msg, "at byte") || !strstr(err.msg, "truncated")) {
            if (bad++ < 3)
                fprintf(stderr, "encoding %d, prefix %zu of %zu: status %d, \"%s\"\n", which, n, b->len, st, err.msg);
        }
    }
    TEST_CHECKF(bad == 0, "encoding %d: %d prefixes not refused as truncated", which, bad);
    mtrl_traj_free(&u);
}

static void test_truncation(void) {
    tg_rng r = {5};
    mtrl_traj t;
    mtrl_traj_init(&t);
    tg_traj(&t, &r, 40, 6, 1, 3);
    mtrl_wbuf b;
    mtrl_wbuf_init(&b);
    mtrl_traj_encode(&b, &t);
    check_prefixes(&b, 0);
    mtrl_wbuf_reset(&b);
    mtrl_traj_header_encode(&b, &t);
    check_prefixes(&b, 1);
    mtrl_wbuf_reset(&b);
    mtrl_traj_slice s = mtrl_traj_slice_of(&t, 0, 40);
    mtrl_traj_slice_encode(&b, &s);
    check_prefixes(&b, 2);
    mtrl_wbuf_reset(&b);
    mtrl_traj_summary_encode(&b, &t);
    check_prefixes(&b, 3);
    // Trailing bytes are refused too.
    mtrl_wbuf_reset(&b);
    mtrl_traj_encode(&b, &t);
    mtrl_wbuf_u8(&b, 0);
    mtrl_error err;
    mtrl_traj u;
    mtrl_traj_init(&u);
    TEST_EQ_INT(mtrl_traj_decode(&u, b.data, b.len, &lim_, &err), MTRL_ERR_FORMAT);
    TEST_CONTAINS(err.msg, "1 unexpected bytes after the end");
    mtrl_traj_free(&u);
    mtrl_traj_free(&t);
    mtrl_wbuf_free(&b);
}

// Decodes b with limits l and expects `want` with `needle` in the message.
static void expect_fail(const mtrl_wbuf *b, const mtrl_traj_limits *l, mtrl_status want, const char *needle) {
    mtrl_traj u;
    mtrl_traj_init(&u);
    mtrl_error err;
    err.msg[0] = '\0';
    mtrl_status st = mtrl_traj_decode(&u, b->data, b->len, l, &err);
    TEST_CHECKF(st == want, "want %s for \"%s\", got %s: %s", mtrl_status_name(want), needle, mtrl_status_name(st),
                err.msg);
    TEST_CONTAINS(err.msg, needle);
    TEST_CONTAINS(err.msg, "at byte");
    TEST_EQ_INT(u.n_tokens, 0);
    mtrl_traj_free(&u);
}

static void test_limits(void) {
    tg_rng r = {11};
    mtrl_traj t;
    mtrl_traj_init(&t);
    tg_traj(&t, &r, 100, 8, 0, 3);
    t.n_turn_rewards = 0;
    mtrl_traj_add_turn_reward(&t, 1);
    mtrl_traj_add_turn_reward(&t, 2);
    mtrl_traj_set_reason(&t, "a reason of some length");
    mtrl_wbuf b;
    mtrl_wbuf_init(&b);
    mtrl_traj_encode(&b, &t);
    mtrl_traj_limits l;
    l = lim_; l.max_tokens = 99;
    expect_fail(&b, &l, MTRL_ERR_LIMIT, "over max_tokens=99");
    l = lim_; l.max_routing_width = 7;
    expect_fail(&b, &l, MTRL_ERR_LIMIT, "routing_width: 8 over max_routing_width=7");
    l = lim_; l.max_tool_calls = 2;
    expect_fail(&b, &l, MTRL_ERR_LIMIT, "n_tools: 3 over max_tool_calls=2");
    l = lim_; l.max_turns = 1;
    expect_fail(&b, &l, MTRL_ERR_LIMIT, "n_turn_rewards: 2 over max_turns=1");
    l = lim_; l.max_string = 5; // env "env-NNN" is longer
    expect_fail(&b, &l, MTRL_ERR_LIMIT, "env: length");
    uint32_t biggest = 0;
    for (uint32_t i = 0; i < t.n_tools; i++) {
        if (t.tools[i].args_len > biggest) biggest = t.tools[i].args_len;
        if (t.tools[i].result_len > biggest) biggest = t.tools[i].result_len;
    }
    l = lim_; l.max_tool_bytes = biggest - 1;
    expect_fail(&b, &l, MTRL_ERR_LIMIT, "over the cap of");
    // max_chunk_tokens bounds a CHUNK, not a whole-episode record.
    l = lim_; l.max_chunk_tokens = 10;
    mtrl_traj u;
    mtrl_traj_init(&u);
    mtrl_error err;
    TEST_EQ_INT(mtrl_traj_decode(&u, b.data, b.len, &l, &err), MTRL_OK);
    mtrl_wbuf s;
    mtrl_wbuf_init(&s);
    mtrl_traj_slice sl = mtrl_traj_slice_of(&t, 0, 11);
    mtrl_traj_slice_encode(&s, &sl);
    mtrl_traj_reset(&u);
    mtrl_traj_set_routing(&u, 8, 0);
    TEST_EQ_INT(mtrl_traj_slice_decode(&u, s.data, s.len, 0, &l, NULL, &err), MTRL_ERR_LIMIT);
    TEST_CONTAINS(err.msg, "token slice: at byte 16: count: 11 tokens over max_chunk_tokens=10");
    // A huge count with few bytes behind it is refused before anything is allocated.
    mtrl_st32(s.data + 16, 0xffffffffu);
    l.max_chunk_tokens = UINT32_MAX;
    l.max_tokens = UINT64_MAX;
    TEST_EQ_INT(mtrl_traj_slice_decode(&u, s.data, s.len, 0, &l, NULL, &err), MTRL_ERR_FORMAT);
    TEST_CONTAINS(err.msg, "ids: truncated: needs 17179869180 bytes");
    mtrl_traj_free(&u);
    mtrl_wbuf_free(&s);
    mtrl_wbuf_free(&b);
    mtrl_traj_free(&t);
}

// Non-canonical or corrupt fields, each at a known offset of the whole-episode encoding.
static void test_malformed(void) {
    tg_rng r = {13};
    mtrl_traj t;
    mtrl_traj_init(&t);
    tg_traj(&t, &r, 30, 2, 0, 1);
    for (uint64_t i = 0; i < t.n_tokens; i++) t.version[i] = i < 10 ? 3 : 4; // two version runs
    mtrl_wbuf hb, b;
    mtrl_wbuf_init(&hb);
    mtrl_wbuf_init(&b);
    mtrl_traj_header_encode(&hb, &t);
    size_t H = 8, S = 8 + hb.len;                       // header and slice start
    size_t kinds = S + 24 + 30 * 8, runs = kinds + 30;   // kind bytes, version runs
    mtrl_traj_encode(&b, &t);
    struct { size_t at; uint8_t val; mtrl_status want; const char *needle; } cases[] = {
        {0, 'X', MTRL_ERR_FORMAT, "tag: expected \"TRAJ\""},
        {4, 2, MTRL_ERR_FORMAT, "format: version 2"},
        {6, 1, MTRL_ERR_FORMAT, "flags: unknown bits"},
        {H + 6, 2, MTRL_ERR_FORMAT, "flags: unknown bits 0x0002"},
        {S, 'Y', MTRL_ERR_FORMAT, "tag: expected \"TCHK\""},
        {S + 8, 1, MTRL_ERR_FORMAT, "offset: slice starts at token 1, expected 0"},
        {kinds + 5, 4, MTRL_ERR_FORMAT, "kind[5]: 4 is not a token kind"},
        {runs, 3, MTRL_ERR_FORMAT, "version run"},
        {runs + 4, 0, MTRL_ERR_FORMAT, "version run 0: length 0"},
        {runs + 12, 21, MTRL_ERR_FORMAT, "cover more than 30 tokens"},
        {runs + 16, 3, MTRL_ERR_FORMAT, "same version 3 as the run before"},
        {runs + 88, 29, MTRL_ERR_FORMAT, "summary says 29 tokens, the record holds 30"},
        {runs + 96, 0x5a, MTRL_ERR_FORMAT, "digest mismatch"},     // the summary's digest
        {kinds - 1, 0x55, MTRL_ERR_FORMAT, "digest mismatch"},     // a logprob byte
        {runs + 20 + 31, 0x77, MTRL_ERR_FORMAT, "digest mismatch"}, // a routing byte
    };
    mtrl_wbuf c;
    mtrl_wbuf_init(&c);
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        mtrl_wbuf_reset(&c);
        mtrl_wbuf_bytes(&c, b.data, b.len);
        TEST_CHECK(cases[k].at < c.len);
        if (c.data[cases[k].at] == cases[k].val) c.data[cases[k].at] ^= 0xff;
        else c.data[cases[k].at] = cases[k].val;
        expect_fail(&c, &lim_, cases[k].want, cases[k].needle);
    }
    // Summary: a status that is not final, a NUL inside a string.
    mtrl_wbuf_reset(&c);
    mtrl_traj_summary_encode(&c, &t);
    mtrl_traj u;
    mtrl_traj_init(&u);
    mtrl_error err;
    mtrl_st32(c.data + 24, 0);
    TEST_EQ_INT(mtrl_traj_summary_decode(&u, c.data, c.len, &lim_, NULL, NULL, &err), MTRL_ERR_FORMAT);
    TEST_CONTAINS(err.msg, "episode summary: at byte 24: status: 0 is not a final episode status");
    TEST_EQ_INT(u.status, MTRL_EP_OPEN);
    mtrl_traj_set_env(&t, "abc");
    mtrl_wbuf_reset(&c);
    mtrl_traj_header_encode(&c, &t);
    c.data[c.len - 2] = 0;
    TEST_EQ_INT(mtrl_traj_header_decode(&u, c.data, c.len, &lim_, &err), MTRL_ERR_FORMAT);
    TEST_CONTAINS(err.msg, "env: contains a NUL byte");
    // Routing flag without routing.
    mtrl_traj_reset(&t);
    mtrl_wbuf_reset(&c);
    mtrl_traj_header_encode(&c, &t);
    c.data[6] = 1;
    TEST_EQ_INT(mtrl_traj_header_decode(&u, c.data, c.len, &lim_, &err), MTRL_ERR_FORMAT);
    TEST_CONTAINS(err.msg, "2-byte routing ids but routing_width is 0");
    mtrl_traj_free(&u);
    mtrl_traj_free(&t);
    mtrl_wbuf_free(&hb);
    mtrl_wbuf_free(&b);
    mtrl_wbuf_free(&c);
}

// Random mutations of valid encodings never crash, and whatever decodes re-encodes identically.
static void test_mutations(void) {
    tg_rng r = {21};
    mtrl_traj t, u;
    mtrl_traj_init(&t);
    mtrl_traj_init(&u);
    mtrl_wbuf b, b2;
    mtrl_wbuf_init(&b);
    mtrl_wbuf_init(&b2);
    uint8_t *m = malloc(1 << 16);
    int accepted = 0;
    for (int k = 0; k < 1500; k++) {
        if (k % 50 == 0) {
            tg_traj(&t, &r, tg_below(&r, 60), tg_below(&r, 2) ? 3 : 0, (int)tg_below(&r, 2), tg_below(&r, 3));
            mtrl_wbuf_reset(&b);
            mtrl_traj_encode(&b, &t);
        }
        if (b.len > (1 << 15)) continue;
        size_t n = b.len;
        memcpy(m, b.data, n);
        tg_mutate(&r, m, &n, 1 << 16);
        mtrl_error err;
        if (mtrl_traj_decode(&u, m, n, &lim_, &err) == MTRL_OK) {
            accepted++;
            mtrl_wbuf_reset(&b2);
            mtrl_traj_encode(&b2, &u);
            TEST_CHECKF(b2.len == n && memcmp(b2.data, m, n) == 0, "mutation %d decoded but re-encodes differently", k);
        } else {
            TEST_CHECKF(strstr(err.msg, "at byte") != NULL, "message without an offset: %s", err.msg);
        }
    }
    printf("mutations: %d of 1500 still decoded (e.g. a changed reward)\n", accepted);
    free(m);
    mtrl_traj_free(&t);
    mtrl_traj_free(&u);
    mtrl_wbuf_free(&b);
    mtrl_wbuf_free(&b2);
}

int main(void) {
    lim_ = mtrl_traj_limits_default();
    TEST_EQ_STR(mtrl_ep_status_name(MTRL_EP_REJECTED), "rejected");
    TEST_EQ_INT(mtrl_ep_status_parse("truncated"), MTRL_EP_TRUNCATED);
    TEST_EQ_INT(mtrl_ep_status_parse("nope"), -1);
    test_roundtrip();
    test_parts();
    test_digest();
    test_truncation();
    test_limits();
    test_malformed();
    test_mutations();
    return test_report();
}
