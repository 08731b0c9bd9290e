// hash.h: digests.
//
// mtrl_hash64: a fast 64-bit non-cryptographic digest (MurmurHash64A) for trajectories, config
// hashes and stream ids; stable across machines (little-endian reads). mtrl_hash64_stream lets
// a digest be built from pieces: the result equals hashing the concatenation only when the
// pieces are fed in the same order and sizes, so producers and checkers must agree on framing.
// mtrl_crc32c: CRC-32C (Castagnoli) for framed records. mtrl_sha256: SHA-256 (OpenSSL's libcrypto) for
// checkpoints, hex-encoded into a 65-byte buffer.
#ifndef MTRL_HASH_H
#define MTRL_HASH_H

#include <stddef.h>
#include <stdint.h>

uint64_t mtrl_hash64(const void *data, size_t n, uint64_t seed);
uint64_t mtrl_hash64_str(const char *s, uint64_t seed);

// Incremental form: h = mtrl_hash64_feed(h, piece, n) for each piece, starting from a seed.
// Equivalent to chaining mtrl_hash64 with the running value as the seed.
static inline uint64_t mtrl_hash64_feed(uint64_t h, const void *data, size_t n) {
    return mtrl_hash64(data, n, h);
}

uint32_t mtrl_crc32c(uint32_t crc, const void *data, size_t n);

// hex must hold 65 bytes. Returns 0, or -1 when the digest failed (or, for a file, it could not be read).
int mtrl_sha256_hex(const void *data, size_t n, char hex[65]);

// Streaming SHA-256 of a file's bytes; returns 0 or -1 on a read error.
int mtrl_sha256_file_hex(const char *path, char hex[65]);

// Hex form of a 64-bit digest (16 digits + NUL).
void mtrl_hash64_hex(uint64_t h, char hex[17]);

#endif
