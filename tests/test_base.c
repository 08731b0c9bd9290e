// mtrl-test: cpu
// common/ base: Philox known answers and reproducibility, arena behaviour, hashes, status text.
#include <stdint.h>
#include <string.h>

#include "common/arena.h"
#include "common/hash.h"
#include "common/rng.h"
#include "common/status.h"
#include "tests/testhelp.h"

static void test_philox_kat(void) {
    // Known-answer vectors of Philox-4x32-10 from Random123's kat_vectors.
    struct { uint32_t ctr[4], key[2], out[4]; } kat[] = {
        {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
        {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff},
         {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
        {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0},
         {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
    };
    for (int i = 0; i < 3; i++) {
        uint32_t out[4];
        mtrl_philox4x32(kat[i].ctr, kat[i].key, out);
        for (int j = 0; j < 4; j++) TEST_EQ_INT(out[j], kat[i].out[j]);
    }
}

static void test_rng_reproducible(void) {
    // A value is a pure function of (seed, stream, counter): recomputing in any order agrees.
    double a[1000];
    for (int i = 0; i < 1000; i++) a[i] = mtrl_rng_uniform(42, 7, (uint64_t)i);
    int same = 1;
    for (int i = 999; i >= 0; i--) same &= a[i] == mtrl_rng_uniform(42, 7, (uint64_t)i);
    TEST_CHECK(same);
    // different seeds, streams and counters give different values
    TEST_CHECK(mtrl_rng_u64(42, 7, 0) != mtrl_rng_u64(43, 7, 0));
    TEST_CHECK(mtrl_rng_u64(42, 7, 0) != mtrl_rng_u64(42, 8, 0));
    TEST_CHECK(mtrl_rng_u64(42, 7, 0) != mtrl_rng_u64(42, 7, 1));
    TEST_CHECK(mtrl_rng_stream("init", 1, 2) != mtrl_rng_stream("init", 2, 1));
    TEST_CHECK(mtrl_rng_stream("init", 1, 2) == mtrl_rng_stream("init", 1, 2));
    // moments: uniform mean 1/2, variance 1/12; normal mean 0, variance 1 (n = 2e5, 5 sigma)
    int n = 200000;
    double s = 0, s2 = 0, ns = 0, ns2 = 0, lo = 1, hi = 0;
    for (int i = 0; i < n; i++) {
        double u = mtrl_rng_uniform(1, 2, (uint64_t)i);
        s += u; s2 += u * u;
        if (u < lo) lo = u;
        if (u > hi) hi = u;
        double z = mtrl_rng_normal(1, 3, (uint64_t)i);
        ns += z; ns2 += z * z;
    }
    TEST_CHECK(lo >= 0.0 && hi < 1.0);
    TEST_NEAR(s / n, 0.5, 5 * 0.2887 / sqrt(n));
    TEST_NEAR(s2 / n - (s / n) * (s / n), 1.0 / 12, 0.002);
    TEST_NEAR(ns / n, 0.0, 5 / sqrt(n));
    TEST_NEAR(ns2 / n, 1.0, 0.02);
}

static void test_arena(void) {
    mtrl_arena a;
    mtrl_arena_init(&a, 4096);
    char *p = mtrl_arena_alloc(&a, 10);
    char *q = mtrl_arena_alloc(&a, 100);
    TEST_EQ_INT((uintptr_t)p % 64, 0);
    TEST_EQ_INT((uintptr_t)q % 64, 0);
    TEST_CHECK(q >= p + 10);
    memset(p, 1, 10);
    memset(q, 2, 100);
    TEST_EQ_INT(p[9], 1);
    size_t m = mtrl_arena_mark(&a);
    char *r = mtrl_arena_alloc(&a, 1000);
    TEST_CHECK(r >= q + 100);
    mtrl_arena_release(&a, m);
    char *r2 = mtrl_arena_alloc(&a, 1000);
    TEST_CHECK(r2 == r); // released memory is handed out again
    TEST_CHECK(a.peak >= a.used);
    size_t peak = a.peak;
    TEST_CHECK(mtrl_arena_try_alloc(&a, 1 << 20, 64) == NULL); // does not fit: NULL, nothing changes
    TEST_EQ_INT(a.peak, peak);
    int *z = mtrl_arena_calloc(&a, 64 * sizeof(int));
    int allzero = 1;
    for (int i = 0; i < 64; i++) allzero &= z[i] == 0;
    TEST_CHECK(allzero);
    mtrl_arena_reset(&a);
    TEST_EQ_INT(a.used, 0);
    TEST_CHECK(a.peak >= 1000);
    mtrl_arena_free(&a);
    mtrl_arena_free(&a); // harmless twice
}

static void test_hashes(void) {
    const char *s = "123456789";
    TEST_EQ_INT(mtrl_crc32c(0, s, 9), 0xE3069283u); // the CRC-32C check value
    // incremental CRC equals one pass
    TEST_EQ_INT(mtrl_crc32c(mtrl_crc32c(0, s, 4), s + 4, 5), 0xE3069283u);
    char hex[65];
    TEST_EQ_INT(mtrl_sha256_hex("abc", 3, hex), 0);
    TEST_EQ_STR(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    TEST_CHECK(mtrl_hash64("abc", 3, 0) != mtrl_hash64("abd", 3, 0));
    TEST_CHECK(mtrl_hash64("abc", 3, 0) == mtrl_hash64("abc", 3, 0));
    TEST_CHECK(mtrl_hash64("abc", 3, 1) != mtrl_hash64("abc", 3, 0));
}

static void test_status(void) {
    mtrl_error e;
    TEST_EQ_INT(mtrl_error_set(&e, MTRL_ERR_FORMAT, "%s: record %d: bad CRC", "f.bin", 3), MTRL_ERR_FORMAT);
    TEST_EQ_STR(e.msg, "f.bin: record 3: bad CRC");
    mtrl_error_wrap(&e, "while replaying episode %d", 9);
    TEST_EQ_STR(e.msg, "while replaying episode 9: f.bin: record 3: bad CRC");
    TEST_EQ_STR(mtrl_status_name(MTRL_ERR_LIMIT), "limit");
    TEST_EQ_INT(mtrl_error_set(NULL, MTRL_ERR_IO, "x"), MTRL_ERR_IO);
}

int main(void) {
    test_philox_kat();
    test_rng_reproducible();
    test_arena();
    test_hashes();
    test_status();
    return test_report();
}
