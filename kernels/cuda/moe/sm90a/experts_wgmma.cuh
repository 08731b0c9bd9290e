// moe/sm90a/experts_wgmma.cuh: the grouped experts' row GEMMs on Hopper's warpgroup MMA (wgmma) with
// bulk tensor copies (TMA), compiled for sm_90a only (moe/sm90a/experts_wgmma.cu); called by the
// grouped experts' launchers in moe/experts_mma.cu where they choose it. bf16 operands, fp32
// accumulators; the segment offsets `off` [E+1] and the tile schedule stay on the device.
// Each returns 0 when launched, 1 when it declines (not a compute capability 9.0 device, more
// than MOE_WG_MAXE experts, the driver refuses a tensor map): the caller then runs the mma.sync
// kernels. Requirements as the grouped launchers': K and N multiples of 8, 16-byte aligned
// operands, R < 2^31.
#ifndef MTRL_MOE_EXPERTS_WGMMA_CUH
#define MTRL_MOE_EXPERTS_WGMMA_CUH
#include "kernels/cuda/cuda_common.cuh"

#define MOE_WG_MAXE 1024

// u1 = X W1[e]ᵀ, u3 = X W3[e]ᵀ (fp32 [R][N]) and m = SiLU(u1) u3 (bf16 [R][N]) for the rows of
// each expert: X [R][K], W1, W3 [E][N][K], all bf16.
int moe_wg_fwd13(mtrl_cuda_ctx *c, int E, int N, int K, long R, const int *off, const void *X, const void *W1,
                 const void *W3, float *u1, float *u3, void *m);
// C = A B[e]ᵀ (fp32 [R][N]) for the rows of each expert: A [R][K], B [E][N][K], bf16.
int moe_wg_fwd2(mtrl_cuda_ctx *c, int E, int N, int K, long R, const int *off, const void *A, const void *B,
                float *C);
// The same product stored as bf16 (C [R][N], each value rounded to nearest even from the fp32
// accumulator moe_wg_fwd2 would store: the same bits as rounding its output).
int moe_wg_fwd2_bf16(mtrl_cuda_ctx *c, int E, int N, int K, long R, const int *off, const void *A, const void *B,
                     void *C);
// dm = dY W2[e] (dY [R][K], W2 [E][K][N] bf16; N = I, K = D), never stored: m = SiLU(u1) u3,
// du1, du3 (bf16 [R][N]) from it and u1, u3 (fp32 [R][N]).
int moe_wg_bwd_dm(mtrl_cuda_ctx *c, int E, int N, int K, long R, const int *off, const void *dY, const void *W2,
                  const float *u1, const float *u3, void *m, void *du1, void *du3);
// dX = du1 W1[e] + du3 W3[e] (fp32 [R][N]; du1, du3 [R][K], W1, W3 [E][K][N] bf16; N = D, K = I).
int moe_wg_bwd_dx(mtrl_cuda_ctx *c, int E, int N, int K, long R, const int *off, const void *du1, const void *du3,
                  const void *W1, const void *W3, float *dX);

#endif
