// replay.c: test_fuzz_replay, a plain (gcc, no libFuzzer) driver for the two fuzz entry points.
//
//     test_fuzz_replay                      a few thousand random and mutated-valid inputs
//                                           through both targets (MTRL_FUZZ_ITERS overrides
//                                           the count per target, MTRL_FUZZ_SEED the seed)
//     test_fuzz_replay wire FILE...         replay saved inputs (a crash reproducer, a corpus)
//     test_fuzz_replay trajfile FILE...
//     test_fuzz_replay --write-seeds DIR    write valid seed inputs for the libFuzzer targets
//                                           (DIR/wire-N, DIR/trajfile-N)
//
// The targets abort on a violated property, so this process crashing is the failure signal;
// it prints the iteration and seed first, so the input can be regenerated.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LLVMFuzzerTestOneInput fuzz_wire_one
#include "tests/fuzz/fuzz_wire.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_trajfile_one
#include "tests/fuzz/fuzz_trajfile.c"
#undef LLVMFuzzerTestOneInput

#include "common/hash.h"
#include "tests/fuzz/trajgen.h"

#define MAX_INPUT (1u << 18)

// Appends one message in fuzz_wire's input format.
static void put_msg(mtrl_wbuf *b, uint8_t sel, const mtrl_wire_out *o) {
    mtrl_wbuf_u8(b, sel);
    mtrl_wbuf_u32(b, (uint32_t)(MTRL_WIRE_HDR_SIZE + o->payload.len));
    mtrl_wbuf_bytes(b, o->hdr, MTRL_WIRE_HDR_SIZE);
    mtrl_wbuf_bytes(b, o->payload.data, o->payload.len);
}

// A valid wire session: control messages, then one or two episodes streamed in chunks.
static void seed_wire(mtrl_wbuf *b, tg_rng *r) {
    mtrl_wire_out o;
    mtrl_wire_out_init(&o);
    mtrl_wbuf_reset(b);
    mtrl_wire_encode_hello(&o, 1, 0, MTRL_WIRE_CAP_ROUTING);
    put_msg(b, 1, &o);
    mtrl_wire_encode_welcome(&o, 3, tg_u64(r), 7, 1u << 20, "[model]\npreset = tiny\n");
    put_msg(b, 1, &o);
    mtrl_wire_encode_credit(&o, 65536);
    put_msg(b, 1, &o);
    uint8_t blob[300];
    for (size_t i = 0; i < sizeof blob; i++) blob[i] = (uint8_t)tg_u64(r);
    mtrl_wire_encode_weights(&o, 7, 0, 2, sizeof blob, 0, blob, 150);
    put_msg(b, 1, &o);
    uint64_t counts[2 * 4];
    for (int i = 0; i < 8; i++) counts[i] = tg_u64(r) % 1000;
    mtrl_wire_encode_routing_stats(&o, 7, 2, 4, counts, NULL, NULL);
    put_msg(b, 1, &o);
    mtrl_wire_encode_weights_req(&o, 5, 8);
    put_msg(b, 1, &o);
    mtrl_wire_encode_heartbeat(&o);
    put_msg(b, 1, &o);
    mtrl_wire_actor_stats as = {1.0, 0.25, 0.5, 0.125, 0.0625, 64, 32, 4};
    mtrl_wire_encode_actor_stats(&o, &as);
    put_msg(b, 1, &o);
    int episodes = 1 + (int)tg_below(r, 2);
    mtrl_traj t;
    mtrl_traj_init(&t);
    for (int e = 0; e < episodes; e++) {
        uint8_t sel = (uint8_t)(1 + e);
        tg_traj(&t, r, tg_below(r, 200), tg_below(r, 2) ? tg_below(r, 6) : 0, (int)tg_below(r, 2), tg_below(r, 3));
        t.actor_id = sel & 3u;
        t.incarnation = 0;
        mtrl_wire_encode_begin(&o, &t);
        put_msg(b, sel, &o);
        uint32_t seq = 0, per = 1 + tg_below(r, 80);
        for (uint64_t off = 0; off < t.n_tokens; off += per) {
            uint32_t n = (uint32_t)(t.n_tokens - off < per ? t.n_tokens - off : per);
            mtrl_wire_encode_chunk(&o, &t, seq++, off, n);
            put_msg(b, sel, &o);
        }
        mtrl_wire_encode_end(&o, &t, seq);
        put_msg(b, sel, &o);
    }
    mtrl_wire_encode_error(&o, MTRL_ERR_PEER, "bye for now");
    put_msg(b, 1, &o);
    mtrl_wire_encode_bye(&o, "done");
    put_msg(b, 1, &o);
    mtrl_traj_free(&t);
    mtrl_wire_out_free(&o);
}

// A valid trajectory file of a few records (framed by hand, as trajfile.h specifies).
static void seed_trajfile(mtrl_wbuf *b, tg_rng *r) {
    mtrl_wbuf_reset(b);
    mtrl_traj t;
    mtrl_traj_init(&t);
    mtrl_wbuf rec;
    mtrl_wbuf_init(&rec);
    int n = 1 + (int)tg_below(r, 4);
    for (int i = 0; i < n; i++) {
        tg_traj(&t, r, tg_below(r, 120), tg_below(r, 2) ? tg_below(r, 5) : 0, (int)tg_below(r, 2), tg_below(r, 3));
        mtrl_wbuf_reset(&rec);
        mtrl_traj_encode(&rec, &t);
        uint8_t len[8];
        mtrl_st64(len, rec.len);
        mtrl_wbuf_bytes(b, len, 8);
        mtrl_wbuf_u32(b, mtrl_trajfile_crc_mask(mtrl_crc32c(0, len, 8)));
        mtrl_wbuf_bytes(b, rec.data, rec.len);
        mtrl_wbuf_u32(b, mtrl_trajfile_crc_mask(mtrl_crc32c(0, rec.data, rec.len)));
    }
    mtrl_wbuf_free(&rec);
    mtrl_traj_free(&t);
}

static int run_files(const char *target, int argc, char **argv) {
    int (*fn)(const uint8_t *, size_t) = strcmp(target, "wire") == 0 ? fuzz_wire_one : fuzz_trajfile_one;
    for (int i = 0; i < argc; i++) {
        FILE *f = fopen(argv[i], "rb");
        if (!f) {
            fprintf(stderr, "test_fuzz_replay: %s: cannot open\n", argv[i]);
            return 2;
        }
        uint8_t *buf = malloc(MAX_INPUT);
        size_t n = fread(buf, 1, MAX_INPUT, f);
        fclose(f);
        printf("%s: %zu bytes\n", argv[i], n);
        fflush(stdout);
        fn(buf, n);
        free(buf);
    }
    printf("%d inputs replayed through %s\n", argc, target);
    return 0;
}

static int write_seeds(const char *dir) {
    tg_rng r = {1};
    mtrl_wbuf b;
    mtrl_wbuf_init(&b);
    for (int i = 0; i < 8; i++) {
        for (int k = 0; k < 2; k++) {
            if (k == 0) seed_wire(&b, &r);
            else seed_trajfile(&b, &r);
            char path[1024];
            snprintf(path, sizeof path, "%s/%s-%d", dir, k == 0 ? "wire" : "trajfile", i);
            FILE *f = fopen(path, "wb");
            if (!f || fwrite(b.data, 1, b.len, f) != b.len) {
                fprintf(stderr, "test_fuzz_replay: %s: cannot write\n", path);
                return 2;
            }
            fclose(f);
        }
    }
    mtrl_wbuf_free(&b);
    printf("wrote 16 seeds to %s\n", dir);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 3 && strcmp(argv[1], "--write-seeds") == 0) return write_seeds(argv[2]);
    if (argc >= 2 && (strcmp(argv[1], "wire") == 0 || strcmp(argv[1], "trajfile") == 0))
        return run_files(argv[1], argc - 2, argv + 2);
    if (argc >= 2) {
        fprintf(stderr, "usage: test_fuzz_replay [wire|trajfile FILE... | --write-seeds DIR]\n");
        return 2;
    }
    const char *it = getenv("MTRL_FUZZ_ITERS");
    const char *sd = getenv("MTRL_FUZZ_SEED");
    int iters = it ? atoi(it) : 4000;
    uint64_t seed = sd ? strtoull(sd, NULL, 0) : 20261130;
    uint8_t *buf = malloc(MAX_INPUT);
    mtrl_wbuf valid;
    mtrl_wbuf_init(&valid);
    for (int target = 0; target < 2; target++) {
        const char *name = target == 0 ? "wire" : "trajfile";
        int (*fn)(const uint8_t *, size_t) = target == 0 ? fuzz_wire_one : fuzz_trajfile_one;
        tg_rng r = {seed + (uint64_t)target};
        int kinds[3] = {0, 0, 0};
        for (int i = 0; i < iters; i++) {
            if (i % 40 == 0) { // a fresh valid input now and then
                if (target == 0) seed_wire(&valid, &r);
                else seed_trajfile(&valid, &r);
            }
            size_t n = 0;
            int kind = tg_below(&r, 10) == 0 ? 0 : (tg_below(&r, 8) == 0 ? 1 : 2);
            if (kind == 0) { // random bytes
                n = tg_below(&r, 512);
                for (size_t j = 0; j < n; j++) buf[j] = (uint8_t)tg_u64(&r);
            } else { // the valid input as is, or mutated
                n = valid.len < MAX_INPUT / 2 ? valid.len : MAX_INPUT / 2;
                memcpy(buf, valid.data, n);
                if (kind == 2) tg_mutate(&r, buf, &n, MAX_INPUT);
            }
            kinds[kind]++;
            if (getenv("MTRL_FUZZ_VERBOSE")) fprintf(stderr, "%s: input %d (%zu bytes)\n", name, i, n);
            fn(buf, n);
        }
        printf("%s: %d inputs (%d random, %d valid, %d mutated-valid), seed %llu: no property violated\n", name, iters,
               kinds[0], kinds[1], kinds[2], (unsigned long long)(seed + (uint64_t)target));
        fflush(stdout);
    }
    // The valid inputs must really get through, or the runs above tested only the refusals.
    printf("wire: %llu messages decoded, %llu episodes committed; trajfile: %llu episodes decoded\n",
           (unsigned long long)fw_decoded_, (unsigned long long)fw_committed_, (unsigned long long)ft_decoded_);
    if (iters >= 40 && (fw_committed_ == 0 || fw_decoded_ == 0 || ft_decoded_ == 0)) {
        fprintf(stderr, "test_fuzz_replay: valid seed inputs were refused; the harness is broken\n");
        return 1;
    }
    mtrl_wbuf_free(&valid);
    free(buf);
    return 0;
}
