// bf16.h: bf16 <-> fp32 on the host, one value at a time (the checkpoint's bf16 weights, the
// CUDA backend's bf16 MLA latents crossing to and from host arrays). bf16 is the top half of an
// fp32: widening is exact; narrowing rounds to nearest even, as the CUDA conversions
// (__float2bfloat16_rn) do, so a value rounded on the host equals one rounded on the GPU.
#ifndef MTRL_BF16_H
#define MTRL_BF16_H

#include <stdint.h>
#include <string.h>

// Rounds to nearest even; a NaN stays a (quiet) NaN.
static inline uint16_t mtrl_bf16_from_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static inline float mtrl_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#endif
