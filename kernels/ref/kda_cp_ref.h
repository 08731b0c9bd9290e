// kda_cp_ref.h: CPU reference of the chunk-parallel KDA forward (kernels/cuda/kda/chunk_parallel.cu):
// the same decomposition, built from mtrl_ref_kda_chunk_fwd, so that the CUDA form can be checked
// against it and the decomposition itself against the sequential form (tests/test_kda_cp_ref.c).
//
// The state recurrence is affine in the incoming state: over a run of tiles p (a "piece"),
// S_out = M_p S_in + B_p with B_p the piece's final state from S_in = 0 and M_p (K x K) its final
// state from S_in = I with v = 0 (the same chunked recurrence with V = K; A = diag(e^γ) − K^eᵀ W
// acts on the rows of the state, so the columns of I evolve as value columns). Pieces are runs of
// whole 16-token tiles, tile bounds nt p / pieces (nt = mtrl_ref_kda_tile_count(T)), as on the GPU:
//   1. B_p, M_p for p = 0 .. pieces − 2 (each piece on its own);
//   2. S_in(0) = S0, S_in(p + 1) = M_p S_in(p) + B_p (mtrl_ref_gemm; with S0 = NULL, S_in(1) = B_0
//      without a product, so it is the sequential state at that boundary bit for bit);
//   3. every piece's o and S_tiles from S_in(p) (mtrl_ref_kda_chunk_fwd), S_final from the last.
// Piece 0 runs exactly the sequential arithmetic (bit-identical o and S_tiles over its tokens),
// and so does piece 1 when S0 = NULL; later pieces differ by the rounding of M_p and the combine.
//
// Arguments as mtrl_ref_kda_chunk_fwd (kda_ref.h; o, S_final, S_tiles nullable); pieces >= 1, clamped to
// the tile count (1 = mtrl_ref_kda_chunk_fwd itself). Scratch: 2 (pieces − 1) H K max(K, V) reals plus
// one piece's zero values, allocated per call.
#ifndef MTRL_KDA_CP_REF_H
#define MTRL_KDA_CP_REF_H

#include "kernels/ref/real.h"

#ifdef __cplusplus
extern "C" {
#endif

void mtrl_ref_kda_chunk_fwd_cp(int T, int H, int K, int V, const real *q, const real *k, const real *v,
                      const real *g, const real *beta, const real *S0, real *o, real *S_final,
                      real *S_tiles, int pieces);
// The first tile of piece p of `pieces` over nt tiles (p = pieces gives nt): the bounds both
// the reference and the CUDA form use.
static inline int mtrl_ref_kda_cp_bound(int nt, int p, int pieces) {
    return (int)((long long)nt * p / pieces);
}

#ifdef __cplusplus
}
#endif

#endif
