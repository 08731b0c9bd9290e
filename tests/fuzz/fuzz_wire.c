// fuzz_wire.c: libFuzzer entry for the wire decoder and the episode assembler (wire.h).
//
// Input: a sequence of messages, each  u8 sel | u32 len (LE) | len bytes, where the first
// min(len, 40) bytes are the header frame and the rest the payload frame. Every message goes
// through mtrl_wire_decode; BEGIN/CHUNK/END also go into one assembler as actor sel & 3,
// incarnation (sel >> 2) & 1; sel & 0x80 then aborts that actor. Properties checked (abort on
// violation): nothing crashes or leaks under ASan/UBSan; a message that decodes re-encodes to
// the same bytes; every episode the assembler hands back has a final status, and a
// COMPLETE/TRUNCATED one carries the digest of its tokens.
//
// Built three ways: with clang as fuzz_wire (-fsanitize=fuzzer,address,undefined), and inside
// test_fuzz_replay (gcc), which includes this file with LLVMFuzzerTestOneInput renamed.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/wire/wire.h"

static mtrl_wire_limits fw_limits_(void) {
    // Small caps, so inputs a fuzzer can write reach every limit.
    mtrl_wire_limits l = mtrl_wire_limits_default();
    l.max_payload = 1u << 20;
    l.max_text = 256;
    l.max_config = 4096;
    l.max_routing_cells = 4096;
    l.max_weight_chunks = 64;
    l.max_episode_bytes = 1u << 18;
    l.max_open_per_actor = 4;
    l.traj.max_tokens = 1u << 14;
    l.traj.max_chunk_tokens = 1u << 12;
    l.traj.max_tool_calls = 64;
    l.traj.max_tool_bytes = 4096;
    l.traj.max_string = 256;
    l.traj.max_routing_width = 64;
    l.traj.max_turns = 64;
    return l;
}

static void fw_fail_(const char *what) {
    fprintf(stderr, "fuzz_wire: property violated: %s\n", what);
    abort();
}

// Episodes committed and messages decoded so far (the replay driver checks the harness is not
// vacuous: valid inputs must get through).
static uint64_t fw_committed_, fw_decoded_;

static void fw_drain_(mtrl_wire_asm *a, mtrl_traj *t) {
    while (mtrl_wire_asm_pop(a, t)) {
        if (t->status == MTRL_EP_COMPLETE || t->status == MTRL_EP_TRUNCATED) fw_committed_++;
        if (t->status == MTRL_EP_OPEN) fw_fail_("an episode came back still open");
        if ((t->status == MTRL_EP_COMPLETE || t->status == MTRL_EP_TRUNCATED) &&
            t->digest != mtrl_traj_digest_compute(t))
            fw_fail_("a committed episode's digest does not match its tokens");
        if ((t->status == MTRL_EP_REJECTED || t->status == MTRL_EP_ABORTED) && !t->reason)
            fw_fail_("a rejected or aborted episode has no reason");
        if (t->n_tokens & 1) mtrl_wire_asm_recycle(a, t); // later episodes reuse its buffers
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static int quiet;
    if (!quiet) {
        mtrl_log_set_level(MTRL_LOG_ERROR);
        quiet = 1;
    }
    mtrl_wire_limits lim = fw_limits_();
    mtrl_wire_asm *a = mtrl_wire_asm_new(&lim);
    mtrl_wire_msg m;
    mtrl_wire_msg_init(&m);
    mtrl_wire_out o;
    mtrl_wire_out_init(&o);
    mtrl_traj t;
    mtrl_traj_init(&t);
    size_t pos = 0;
    while (size - pos >= 5) {
        uint8_t sel = data[pos];
        uint32_t len = (uint32_t)data[pos + 1] | ((uint32_t)data[pos + 2] << 8) | ((uint32_t)data[pos + 3] << 16) |
                       ((uint32_t)data[pos + 4] << 24);
        pos += 5;
        if (len > size - pos) len = (uint32_t)(size - pos);
        const uint8_t *msg = data + pos;
        pos += len;
        size_t hn = len < MTRL_WIRE_HDR_SIZE ? len : MTRL_WIRE_HDR_SIZE;
        const uint8_t *pl = msg + hn;
        size_t pn = len - hn;

        mtrl_error err;
        if (mtrl_wire_decode(msg, hn, pl, pn, &lim, &m, &err) == MTRL_OK) {
            fw_decoded_++;
            mtrl_wire_msg_encode(&o, &m);
            if (memcmp(o.hdr, msg, MTRL_WIRE_HDR_SIZE) != 0) fw_fail_("header re-encodes differently");
            if (o.payload.len != pn || (pn && memcmp(o.payload.data, pl, pn) != 0))
                fw_fail_("payload re-encodes differently");
        } else if (err.msg[0] == '\0') {
            fw_fail_("a refused message without a reason");
        }
        mtrl_wire_hdr h;
        if (mtrl_wire_hdr_decode(msg, hn, &lim, &h, &err) == MTRL_OK &&
            (h.type == MTRL_WIRE_BEGIN || h.type == MTRL_WIRE_CHUNK || h.type == MTRL_WIRE_END) && h.length == pn) {
            mtrl_wire_asm_feed(a, sel & 3u, (sel >> 2) & 1u, &h, pl, pn, &err);
        }
        if (sel & 0x80) mtrl_wire_asm_abort_actor(a, sel & 3u, MTRL_WIRE_ANY_INCARNATION, "fuzz: actor gone");
        fw_drain_(a, &t);
    }
    for (uint32_t actor = 0; actor < 4; actor++)
        mtrl_wire_asm_abort_actor(a, actor, MTRL_WIRE_ANY_INCARNATION, "fuzz: end of input");
    fw_drain_(a, &t);
    if (mtrl_wire_asm_open_bytes(a) != 0) fw_fail_("open bytes left after every actor was aborted");
    mtrl_traj_free(&t);
    mtrl_wire_out_free(&o);
    mtrl_wire_msg_free(&m);
    mtrl_wire_asm_free(a);
    return 0;
}
