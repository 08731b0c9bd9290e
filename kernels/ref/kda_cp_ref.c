// kda_cp_ref.c: the chunk-parallel KDA forward's decomposition in the reference (kda_cp_ref.h).
#include "kernels/ref/kda_cp_ref.h"

#include "kernels/ref/gemm_ref.h"
#include "kernels/ref/kda_ref.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void *kda_cp_xcalloc_(size_t n) {
    void *p = calloc(n ? n : 1, 1);
    if (!p) {
        fprintf(stderr, "kda_cp_ref: out of memory (%zu bytes)\n", n);
        abort();
    }
    return p;
}

void mtrl_ref_kda_chunk_fwd_cp(int T, int H, int K, int V, const real *q, const real *k, const real *v,
                      const real *g, const real *beta, const real *S0, real *o, real *S_final,
                      real *S_tiles, int pieces) {
    int nt = mtrl_ref_kda_tile_count(T);
    int np = pieces < 1 ? 1 : pieces > nt ? nt : pieces;
    if (np <= 1) {
        mtrl_ref_kda_chunk_fwd(T, H, K, V, q, k, v, g, beta, S0, o, S_final, S_tiles);
        return;
    }
    size_t KV = (size_t)K * V, KK = (size_t)K * K;
    int max_len = 0;  // tokens of the longest piece (its zero values for M_p)
    for (int p = 0; p < np; p++) {
        int len = KDA_TILE * (mtrl_ref_kda_cp_bound(nt, p + 1, np) - mtrl_ref_kda_cp_bound(nt, p, np));
        if (len > max_len) max_len = len;
    }
    real *B = kda_cp_xcalloc_(sizeof(real) * (np - 1) * H * KV);  // B_p, then S_in(p + 1)
    real *M = kda_cp_xcalloc_(sizeof(real) * (np - 1) * H * KK);
    real *I = kda_cp_xcalloc_(sizeof(real) * H * KK);
    real *zv = kda_cp_xcalloc_(sizeof(real) * (size_t)max_len * H * K);
    for (int h = 0; h < H; h++)
        for (int d = 0; d < K; d++) I[(size_t)h * KK + (size_t)d * K + d] = 1;
    // 1. each piece but the last: its final state from zero, and its transition
    for (int p = 0; p + 1 < np; p++) {
        int t0 = KDA_TILE * mtrl_ref_kda_cp_bound(nt, p, np), t1 = KDA_TILE * mtrl_ref_kda_cp_bound(nt, p + 1, np);
        size_t xk = (size_t)t0 * H * K, xv = (size_t)t0 * H * V, xb = (size_t)t0 * H;
        mtrl_ref_kda_chunk_fwd(t1 - t0, H, K, V, q + xk, k + xk, v + xv, g + xk, beta + xb, NULL, NULL,
                      B + (size_t)p * H * KV, NULL);
        mtrl_ref_kda_chunk_fwd(t1 - t0, H, K, K, q + xk, k + xk, zv, g + xk, beta + xb, I, NULL,
                      M + (size_t)p * H * KK, NULL);
    }
    // 2. the incoming states, in sequence: B_p ← M_p S_in(p) + B_p = S_in(p + 1)
    for (int p = 0; p + 1 < np; p++) {
        const real *Sin = p == 0 ? S0 : B + (size_t)(p - 1) * H * KV;
        if (!Sin) continue;
        for (int h = 0; h < H; h++)
            mtrl_ref_gemm(0, 0, K, V, K, 1, M + (size_t)p * H * KK + (size_t)h * KK, K,
                     Sin + (size_t)h * KV, V, 1, B + (size_t)p * H * KV + (size_t)h * KV, V);
    }
    // 3. every piece from its incoming state
    for (int p = 0; p < np; p++) {
        int n0 = mtrl_ref_kda_cp_bound(nt, p, np);
        int t0 = KDA_TILE * n0, t1 = p + 1 < np ? KDA_TILE * mtrl_ref_kda_cp_bound(nt, p + 1, np) : T;
        size_t xk = (size_t)t0 * H * K, xv = (size_t)t0 * H * V, xb = (size_t)t0 * H;
        const real *Sin = p == 0 ? S0 : B + (size_t)(p - 1) * H * KV;
        mtrl_ref_kda_chunk_fwd(t1 - t0, H, K, V, q + xk, k + xk, v + xv, g + xk, beta + xb, Sin,
                      o ? o + xv : NULL, p + 1 == np ? S_final : NULL,
                      S_tiles ? S_tiles + (size_t)n0 * H * KV : NULL);
    }
    free(zv);
    free(I);
    free(M);
    free(B);
}
