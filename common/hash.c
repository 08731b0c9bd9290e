// hash.c: MurmurHash64A, CRC-32C and SHA-256 through OpenSSL's libcrypto (see hash.h).
#include "common/hash.h"

#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

uint64_t mtrl_hash64(const void *data, size_t n, uint64_t seed) {
    const uint64_t m = 0xc6a4a7935bd1e995ULL;
    const int r = 47;
    uint64_t h = seed ^ (n * m);
    const unsigned char *p = data;
    size_t blocks = n / 8;
    for (size_t i = 0; i < blocks; i++) {
        uint64_t k;
        memcpy(&k, p + 8 * i, 8); // little-endian hosts only (x86-64, aarch64)
        k *= m; k ^= k >> r; k *= m;
        h ^= k; h *= m;
    }
    const unsigned char *tail = p + 8 * blocks;
    switch (n & 7) {
    case 7: h ^= (uint64_t)tail[6] << 48; /* fall through */
    case 6: h ^= (uint64_t)tail[5] << 40; /* fall through */
    case 5: h ^= (uint64_t)tail[4] << 32; /* fall through */
    case 4: h ^= (uint64_t)tail[3] << 24; /* fall through */
    case 3: h ^= (uint64_t)tail[2] << 16; /* fall through */
    case 2: h ^= (uint64_t)tail[1] << 8;  /* fall through */
    case 1: h ^= (uint64_t)tail[0]; h *= m;
    }
    h ^= h >> r; h *= m; h ^= h >> r;
    return h;
}

uint64_t mtrl_hash64_str(const char *s, uint64_t seed) { return mtrl_hash64(s, strlen(s), seed); }

static uint32_t crc32c_table_[8][256];
static int crc32c_ready_;

static void crc32c_init_(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
        crc32c_table_[0][i] = c;
    }
    for (int t = 1; t < 8; t++)
        for (int i = 0; i < 256; i++)
            crc32c_table_[t][i] = (crc32c_table_[t - 1][i] >> 8) ^ crc32c_table_[0][crc32c_table_[t - 1][i] & 0xff];
    crc32c_ready_ = 1;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// The CRC register update is linear over GF(2): crc(c, X) = shift(c, |X|) ^ crc(0, X), where
// shift(c, n) runs c through n zero bytes. shift is a 32x32 bit matrix; its columns (the images
// of the single bits) are computed once for the two distances the interleaved loop needs.
static uint32_t crc32c_cols_[2][32]; // [0]: 4096 bytes, [1]: 8192 bytes

__attribute__((target("sse4.2"))) static uint32_t crc32c_zeros_(uint32_t c, size_t n) {
    uint64_t r = c;
    for (size_t i = 0; i < n; i += 8) r = __builtin_ia32_crc32di(r, 0);
    return (uint32_t)r;
}

static void crc32c_cols_init_(void) {
    for (int b = 0; b < 32; b++) {
        crc32c_cols_[0][b] = crc32c_zeros_(1u << b, 4096);
        crc32c_cols_[1][b] = crc32c_zeros_(1u << b, 8192);
    }
}

static uint32_t crc32c_shift_(uint32_t c, size_t n) {
    const uint32_t *col = crc32c_cols_[n == 8192];
    uint32_t r = 0;
    for (int b = 0; b < 32; b++) r ^= col[b] & (0u - ((c >> b) & 1));
    return r;
}

// SSE4.2's crc32 instruction computes exactly CRC-32C, 8 bytes per instruction: ~10x the table
// version, which matters for the gigabytes of weights the wire checks on every publish.
__attribute__((target("sse4.2"))) static uint32_t crc32c_hw_(uint32_t crc, const unsigned char *p, size_t n) {
    uint64_t c = ~crc;
    // Three independent streams hide the instruction's 3-cycle latency on long buffers.
    while (n >= 3 * 4096) {
        uint64_t c1 = 0, c2 = 0;
        for (size_t i = 0; i < 4096; i += 8) {
            uint64_t a, b, d;
            memcpy(&a, p + i, 8);
            memcpy(&b, p + 4096 + i, 8);
            memcpy(&d, p + 8192 + i, 8);
            c = __builtin_ia32_crc32di(c, a);
            c1 = __builtin_ia32_crc32di(c1, b);
            c2 = __builtin_ia32_crc32di(c2, d);
        }
        // Combine: shift c over 8192 bytes and c1 over 4096 bytes of zeros, then xor.
        c = crc32c_shift_((uint32_t)c, 8192) ^ crc32c_shift_((uint32_t)c1, 4096) ^ (uint32_t)c2;
        p += 3 * 4096;
        n -= 3 * 4096;
    }
    while (n >= 8) {
        uint64_t a;
        memcpy(&a, p, 8);
        c = __builtin_ia32_crc32di(c, a);
        p += 8;
        n -= 8;
    }
    while (n--) c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
    return ~(uint32_t)c;
}
#define MTRL_CRC32C_HW 1
#endif

// Slicing-by-8 (or the SSE4.2 instruction where the CPU has it). The table is built on first
// use; a benign race builds identical tables.
uint32_t mtrl_crc32c(uint32_t crc, const void *data, size_t n) {
#ifdef MTRL_CRC32C_HW
    static int hw = -1;
    if (hw < 0) {
        hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
        if (hw) crc32c_cols_init_(); // a benign race builds identical columns
    }
    if (hw && !getenv("MTRL_CRC32C_SOFT")) return crc32c_hw_(crc, data, n);
#endif
    if (!crc32c_ready_) crc32c_init_();
    const unsigned char *p = data;
    crc = ~crc;
    while (n >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= crc;
        crc = crc32c_table_[7][lo & 0xff] ^ crc32c_table_[6][(lo >> 8) & 0xff] ^
              crc32c_table_[5][(lo >> 16) & 0xff] ^ crc32c_table_[4][lo >> 24] ^
              crc32c_table_[3][hi & 0xff] ^ crc32c_table_[2][(hi >> 8) & 0xff] ^
              crc32c_table_[1][(hi >> 16) & 0xff] ^ crc32c_table_[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ crc32c_table_[0][(crc ^ *p++) & 0xff];
    return ~crc;
}

static void to_hex_(const unsigned char *b, size_t n, char *hex) {
    static const char d[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) { hex[2 * i] = d[b[i] >> 4]; hex[2 * i + 1] = d[b[i] & 15]; }
    hex[2 * n] = '\0';
}

// SHA-256 through OpenSSL's libcrypto: its SHA-NI code hashes ~7x faster than libsodium's
// portable one on the H200 machines' Xeons (1.1 against 7.7 s/GiB measured side by side on the
// 2-core machine), and a checkpoint's hash reads the whole file back (14 GB for `small` with its
// moments: about a minute of the background write with libsodium).
static int sha256_(const void *data, size_t n, FILE *f, unsigned char out[32]) {
    EVP_MD_CTX *c = EVP_MD_CTX_new();
    int ok = c && EVP_DigestInit_ex(c, EVP_sha256(), NULL) == 1;
    if (ok && data) ok = EVP_DigestUpdate(c, data, n) == 1;
    if (ok && f) {
        enum { CHUNK = 1 << 20 };
        unsigned char *buf = malloc(CHUNK);
        size_t got;
        ok = buf != NULL;
        while (ok && (got = fread(buf, 1, CHUNK, f)) > 0) ok = EVP_DigestUpdate(c, buf, got) == 1;
        if (ok && ferror(f)) ok = 0;
        free(buf);
    }
    unsigned int len = 0;
    if (ok) ok = EVP_DigestFinal_ex(c, out, &len) == 1 && len == 32;
    EVP_MD_CTX_free(c);
    return ok ? 0 : -1;
}

int mtrl_sha256_hex(const void *data, size_t n, char hex[65]) {
    unsigned char out[32];
    if (sha256_(data ? data : "", data ? n : 0, NULL, out) != 0) return -1;
    to_hex_(out, sizeof out, hex);
    return 0;
}

int mtrl_sha256_file_hex(const char *path, char hex[65]) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    unsigned char out[32];
    int rc = sha256_(NULL, 0, f, out);
    fclose(f);
    if (rc != 0) return -1;
    to_hex_(out, sizeof out, hex);
    return 0;
}

void mtrl_hash64_hex(uint64_t h, char hex[17]) { snprintf(hex, 17, "%016llx", (unsigned long long)h); }
