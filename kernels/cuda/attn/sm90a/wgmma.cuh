// wgmma.cuh: what the sm_90a kernels share to drive Hopper's warpgroup MMA (wgmma) from shared
// memory: the 128-byte-swizzled tile layout, its matrix descriptors, and the fences.
//
// Tile layout ("sw128 tile"): a ROWS x COLS bf16 matrix (COLS % 64 == 0) is stored as COLS / 64
// column blocks, each ROWS x 64 (128 bytes per row, rows consecutive), block b at byte
// b ROWS 128. Inside a block, the 16-byte chunk c (8 columns) of row r sits at chunk c ^ (r % 8):
// the 128-byte swizzle wgmma expects, which also keeps cp.async stores and wgmma reads free of
// bank conflicts. Every block starts on a 1024-byte boundary (the swizzle repeats every 8 rows).
//
// One stored tile serves both ways wgmma reads an operand (PTX ISA, "Shared Memory Matrix
// Layout", 128B swizzling):
//   K-major (the tile's rows are the M or N index, its columns the K index): 16-column step ks
//     of rows r0.. starts at block (16 ks) / 64, row r0, byte 32 (ks % 4); stride between
//     8-row groups (SBO) 1024, leading offset unused (16).  wg_desc_k().
//   MN-major (rows are the K index, columns the M or N index; wgmma's transpose flag): the
//     16-row step kk starts at row 16 kk of block 0; LBO = ROWS 128 (from one 64-column block
//     to the next), SBO = 1024 (from 8 K rows to the next 8).  wg_desc_mn().
// Writes into a tile by cp.async (the generic proxy) must be made visible to wgmma (the async
// proxy): cp.async wait, then wg_fence_proxy(), then a barrier.
#ifndef MTRL_WGMMA_CUH
#define MTRL_WGMMA_CUH
#include <cuda.h>
#include <cudaTypedefs.h>
#include <stdint.h>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/attn/sm90a/wgmma_ops.cuh"

// Descriptor of a 128-byte-swizzled operand at shared address `saddr` (bits 0-13: address / 16;
// 16-29: LBO / 16; 32-45: SBO / 16; 62-63: 1 = 128-byte swizzle).
__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((saddr & 0x3FFFFu) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFFu) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}
// K-major operand: rows r0.. (r0 % 8 == 0) of the tile at `tile` (ROWS rows), K step ks.
__device__ __forceinline__ uint64_t wg_desc_k(uint32_t tile, int rows, int r0, int ks) {
    return wg_desc(tile + (uint32_t)((ks >> 2) * rows * 128 + r0 * 128 + (ks & 3) * 32), 16, 1024);
}
// MN-major operand: K rows 16 kk.. of the tile at `tile` (ROWS rows), columns from block c0 / 64.
__device__ __forceinline__ uint64_t wg_desc_mn(uint32_t tile, int rows, int c0, int kk) {
    return wg_desc(tile + (uint32_t)((c0 >> 6) * rows * 128 + kk * 16 * 128), (uint32_t)rows * 128,
                   1024);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Hands registers back to / takes them from the block's pool: every thread of the warpgroup
// executes the same one (the warp-specialised kernels' producer and consumer warpgroups).
template <int N>
__device__ __forceinline__ void wg_setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void wg_setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
// Orders this thread's generic-proxy shared-memory writes (cp.async included, once waited for)
// before later async-proxy reads (wgmma operands).
__device__ __forceinline__ void wg_fence_proxy() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// The accumulator registers pass through the asm statements as "+f" operands; this keeps the
// compiler from moving their reads or writes across an in-flight wgmma (CUTLASS does the same).
template <int N>
__device__ __forceinline__ void wg_hold(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// cp.async of a ROWS x COLS bf16 tile into the sw128 layout at `dst` by NT threads (thread
// index `tid`); row r comes from src(r), or is zero-filled when src(r) is null (`any`: a valid
// dummy address).
template <int NT, int ROWS, int COLS, class F>
__device__ __forceinline__ void wg_load_tile(unsigned char *dst, int tid, F src,
                                             const uint16_t *any) {
    static_assert(COLS % 64 == 0 && ROWS % 8 == 0, "sw128 tiles: 64-column blocks, 8-row groups");
    constexpr int C8 = COLS / 8;
#pragma unroll 4
    for (int i = tid; i < ROWS * C8; i += NT) {
        const int r = i / C8, c = i - r * C8;
        const uint16_t *s = src(r);
        cp_async16_pred(dst + (c >> 3) * (ROWS * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4),
                        s ? s + c * 8 : any, s != nullptr);
    }
}

// ---- bulk tensor copies (TMA) into sw128 tiles ------------------------------------------------
// One copy: the 64-column x `rows` box at (column c0, row r0) of the 2D bf16 tensor behind `map`
// into the sw128 column block at shared address dst (1024-aligned), completing (with its byte
// count) on the mbarrier at `bar`. Rows outside the tensor arrive as zeros.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap *map, int c0, int r0,
                                            uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"((uint64_t)map), "r"(c0), "r"(r0), "r"(bar)
        : "memory");
}

// One bulk copy of `bytes` (a multiple of 16) from global src (16-byte aligned) to shared dst,
// completing on the mbarrier at `bar`.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void *src, unsigned bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

// The tensor map of `rows` rows of bf16 at `base`, `ld` elements apart (a multiple of 8), read in
// boxes of 64 columns x box_rows rows with the 128-byte swizzle. 0, or -1 when the driver
// declines (the caller then takes another path).
static inline int tma_map_rows(CUtensorMap *map, const void *base, int ld, int rows, int box_rows) {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
    if (!encode) {
        void *fn = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                             &q) != cudaSuccess || q != cudaDriverEntryPointSuccess || !fn)
            return -1;
        encode = (PFN_cuTensorMapEncodeTiled_v12000)fn;
    }
    if (((uintptr_t)base & 15) || (ld & 7) || rows < 1) return -1;
    const cuuint64_t dim[2] = {(cuuint64_t)ld, (cuuint64_t)rows};
    const cuuint64_t stride[1] = {(cuuint64_t)ld * 2};
    const cuuint32_t box[2] = {64, (cuuint32_t)box_rows}, estride[2] = {1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void *>(base), dim, stride, box,
                  estride, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS
               ? 0
               : -1;
}

#endif
