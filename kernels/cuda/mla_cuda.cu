// mla_cuda.cu: causal attention for the (absorbed) MLA layer, training forward / backward in
// flash style, and the absorbed decode over a batch of latent caches (model.md §3; the oracle
// is kernels/ref/mla_ref.c: attn_causal_fwd/bwd, mla_decode_absorbed_ld).
//
// Training form. Query rows are packed per key head j: row ρ = (token i, head g of the group),
// i = ρ / G, head h = j G + ρ % G, G = H / Hk, so the absorbed MLA (Hk = 1, one 576-wide key
// head shared by all H heads) multiplies 64 packed rows against each key tile it loads. Every
// product is mma.sync m16n8k16 (bf16 operands, fp32 accumulation); nothing Tq x Tk is stored.
//   forward   attn_fwd_k, grid (row blocks of 64, Hk): S = Q Kᵀ into shared memory, online
//             softmax (base 2), P (bf16) V accumulated in registers; saves lse.
//   backward  attn_bwd_pre_k: D = rowsum(dO ⊙ O);
//             attn_bwd_dq_k, grid (row blocks, Hk): recompute S and dP = dO Vᵀ per 32-key tile,
//             dZ = P ⊙ (dP − D), dQ = scale dZ K in registers (written once, no atomics);
//             attn_bwd_dkv_k, grid (key blocks of 32, Hk): for every row block that sees the
//             keys, recompute P and dZ and accumulate dK = scale dZᵀ Q and dV = Pᵀ dO in
//             registers (one accumulator when V aliases K), added once to dk / dv.
// Decode. mla_decode_k (fp32 SIMT): split-K over 256-key chunks of each sequence's latent cache,
// all H heads per chunk (MQA), partial (m, l, acc) merged in chunk order by mla_decode_merge_k;
// the query absorption and the value up-projection are cuBLAS batched GEMMs over heads.
#include <math.h>

#include "kernels/cuda/cuda_common.cuh"

#define ABM 64  // packed query rows per block
#define FBN 64  // keys per tile, forward
#define BBN 32  // keys per tile, backward
#define LOG2E_F 1.4426950408889634f
#define LN2_F 0.6931471805599453f

struct AttnArgs {
    int Tq, Tk, H, Hk, G, Dk, Dv;
    int Dkp;  // Dk rounded up to 16 (zero columns in shared memory)
    float scale, sl2;  // softmax scale, and scale * log2(e)
    const uint16_t *q, *k, *v;
    int ldk, ldv;
    int alias;  // values are the first Dv columns of the keys (Hk = 1, v == k, ldv == ldk)
};

__device__ __forceinline__ uint32_t ld32(const uint16_t *p) {
    return *reinterpret_cast<const uint32_t *>(p);
}

// ldmatrix: four 8x8 b16 matrices; lane l supplies the (16-byte aligned) address of row l % 8
// of matrix l / 8. Thread (g = lane/4, t = lane%4) receives elements (g, 2t..2t+1) of each
// matrix (.trans: elements (2t..2t+1, g)), i.e. exactly the mma.m16n8k16 fragment layout.
__device__ __forceinline__ void ldsm_x4(uint32_t *r, const uint16_t *p) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t *r, const uint16_t *p) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
// A fragment of the 16 x 16 block at (row 0, col k0) of a row-major matrix.
__device__ __forceinline__ void frag_a(uint32_t *a, const uint16_t *A, int lda, int k0, int lane) {
    ldsm_x4(a, A + (lane & 15) * lda + k0 + ((lane >> 4) << 3));
}
// B fragments of two adjacent n-tiles (n0, n0 + 8) at k0 from an n-major matrix (element
// (k, n) at B[n*ldb + k]): b[0..1] for tile n0, b[2..3] for tile n0 + 8.
__device__ __forceinline__ void frag_b2_nk(uint32_t *b, const uint16_t *B, int ldb, int k0, int n0,
                                           int lane) {
    ldsm_x4(b, B + (n0 + (lane & 7) + ((lane >> 4) << 3)) * ldb + k0 + (((lane >> 3) & 1) << 3));
}
// The same from a k-major matrix (element (k, n) at B[k*ldb + n]), through ldmatrix.trans.
__device__ __forceinline__ void frag_b2_kn(uint32_t *b, const uint16_t *B, int ldb, int k0, int n0,
                                           int lane) {
    ldsm_x4_t(b, B + (k0 + (lane & 7) + (((lane >> 3) & 1) << 3)) * ldb + n0 + ((lane >> 4) << 3));
}

// acc[nt] (16 x 8 tiles) += A[16 rows][kdim] · B[8 NT rows][kdim]ᵀ, A and B row-major in shared
// memory ("n-major" B: key rows with contiguous k). A points at the warp's first row. NT even.
template <int NT>
__device__ __forceinline__ void warp_mm_nk(float (*acc)[4], const uint16_t *A, int lda,
                                           const uint16_t *B, int ldb, int kdim, int lane) {
    for (int k0 = 0; k0 < kdim; k0 += 16) {
        uint32_t a[4];
        frag_a(a, A, lda, k0, lane);
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
            uint32_t b[4];
            frag_b2_nk(b, B, ldb, k0, nt * 8, lane);
            mma_bf16_16816(acc[nt], a, b);
            mma_bf16_16816(acc[nt + 1], a, b + 2);
        }
    }
}

// B fragment from a k-major matrix (element (k, n) at B[k*ldb + n]), one tile, plain loads.
__device__ __forceinline__ void frag_b_kn(uint32_t *b, const uint16_t *B, int ldb, int k0, int n0,
                                          int lane) {
    int g = lane >> 2, t = lane & 3;
    const uint16_t *bp = B + (k0 + 2 * t) * ldb + n0 + g;
    b[0] = pack_bf16_raw(bp[0], bp[ldb]);
    b[1] = pack_bf16_raw(bp[8 * ldb], bp[9 * ldb]);
}

// acc[nt] += A[16][kdim] · B[kdim][8 nt ..], B k-major; tiles nt < ntw (ntw <= MAXNT), in pairs
// through ldmatrix.trans (an odd last tile through plain loads).
template <int MAXNT>
__device__ __forceinline__ void warp_mm_kn(float (*acc)[4], const uint16_t *A, int lda,
                                           const uint16_t *B, int ldb, int kdim, int lane,
                                           int ntw) {
    for (int k0 = 0; k0 < kdim; k0 += 16) {
        uint32_t a[4];
        frag_a(a, A, lda, k0, lane);
#pragma unroll
        for (int nt = 0; nt < MAXNT; nt += 2) {
            if (nt + 1 < ntw) {
                uint32_t b[4];
                frag_b2_kn(b, B, ldb, k0, nt * 8, lane);
                mma_bf16_16816(acc[nt], a, b);
                mma_bf16_16816(acc[nt + 1], a, b + 2);
            } else if (nt < ntw) {
                uint32_t b[2];
                frag_b_kn(b, B, ldb, k0, nt * 8, lane);
                mma_bf16_16816(acc[nt], a, b);
            }
        }
    }
}

// Stores a warp's 16 x 8NT fp32 tile (accumulator layout) to shared memory at C (row stride ldc).
template <int NT>
__device__ __forceinline__ void store_acc(const float (*acc)[4], float *C, int ldc, int lane) {
    int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        C[g * ldc + nt * 8 + 2 * t] = acc[nt][0];
        C[g * ldc + nt * 8 + 2 * t + 1] = acc[nt][1];
        C[(g + 8) * ldc + nt * 8 + 2 * t] = acc[nt][2];
        C[(g + 8) * ldc + nt * 8 + 2 * t + 1] = acc[nt][3];
    }
}

// cp.async of `rows` rows of `cols` bf16 (cols % 8 == 0) into dst (row stride ldd), zero-filled
// up to colsp columns; row r comes from src(r), or is all zeros when src(r) is null.
template <class F>
__device__ __forceinline__ void load_rows(uint16_t *dst, int ldd, int rows, int cols, int colsp,
                                          F src, const uint16_t *any) {
    int c8n = colsp / 8;
    for (int i = threadIdx.x; i < rows * c8n; i += blockDim.x) {
        int r = i / c8n, c8 = i % c8n;
        const uint16_t *s = c8 * 8 < cols ? src(r) : nullptr;
        cp_async16_pred(dst + r * ldd + c8 * 8, s ? s + c8 * 8 : any, s != nullptr);
    }
}

__device__ __forceinline__ int row_token(const AttnArgs &a, int rho) { return rho / a.G; }
__device__ __forceinline__ int row_head(const AttnArgs &a, int j, int rho) {
    return j * a.G + rho % a.G;
}

// Shared-memory carving with 16-byte alignment.
struct SmCarve {
    unsigned char *p;
    size_t off;
    template <class T>
    __host__ __device__ T *take(size_t n) {
        off = (off + 15) & ~(size_t)15;
        T *r = p ? (T *)(p + off) : nullptr;
        off += n * sizeof(T);
        return r;
    }
};

// ---- forward --------------------------------------------------------------------------------

struct FwdSm {
    uint16_t *Q, *K, *V, *P;
    float *S, *M, *L, *Al;
};
__host__ __device__ inline size_t fwd_sm_carve(FwdSm &s, unsigned char *base, int Dkp, int Dv,
                                               int alias) {
    SmCarve c{base, 0};
    s.Q = c.take<uint16_t>((size_t)ABM * (Dkp + 8));
    s.K = c.take<uint16_t>((size_t)FBN * (Dkp + 8));
    s.V = alias ? s.K : c.take<uint16_t>((size_t)FBN * (Dv + 8));
    s.S = c.take<float>((size_t)ABM * (FBN + 4));
    s.P = c.take<uint16_t>((size_t)ABM * (FBN + 8));
    s.M = c.take<float>(ABM);
    s.L = c.take<float>(ABM);
    s.Al = c.take<float>(ABM);
    return c.off;
}

#define FWD_MAXNT 32  // Dv <= 512: each warp owns Dv/2 columns = Dv/16 tiles of 8

__global__ void __launch_bounds__(256, 1) attn_fwd_k(AttnArgs a, float *o, float *lse) {
    extern __shared__ __align__(16) unsigned char smraw[];
    FwdSm s;
    fwd_sm_carve(s, smraw, a.Dkp, a.Dv, a.alias);
    const int LDQ = a.Dkp + 8, LDK = a.Dkp + 8, LDV = a.alias ? LDK : a.Dv + 8, LDS = FBN + 4,
              LDP = FBN + 8;
    const int j = blockIdx.y, rho0 = blockIdx.x * ABM, nrows = a.Tq * a.G;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
    const int rg = w & 3, half = w >> 2, ntw = a.Dv / 16;

    load_rows(s.Q, LDQ, ABM, a.Dk, a.Dkp, [&](int r) -> const uint16_t * {
        int rho = rho0 + r;
        if (rho >= nrows) return nullptr;
        return a.q + ((size_t)row_token(a, rho) * a.H + row_head(a, j, rho)) * a.Dk;
    }, a.q);
    cp_async_commit();
    if (tid < ABM) {
        s.M[tid] = -INFINITY;
        s.L[tid] = 0.f;
    }
    int last = (rho0 + ABM < nrows ? rho0 + ABM : nrows) - 1;
    int pos_max = a.Tk - a.Tq + row_token(a, last);
    int nkb = pos_max / FBN + 1;

    float oacc[FWD_MAXNT][4];
#pragma unroll
    for (int nt = 0; nt < FWD_MAXNT; nt++) oacc[nt][0] = oacc[nt][1] = oacc[nt][2] = oacc[nt][3] = 0.f;

    for (int kb = 0; kb < nkb; kb++) {
        const int s0 = kb * FBN;
        load_rows(s.K, LDK, FBN, a.Dk, a.Dkp, [&](int r) -> const uint16_t * {
            return s0 + r < a.Tk ? a.k + (size_t)(s0 + r) * a.ldk + (size_t)j * a.Dk : nullptr;
        }, a.k);
        if (!a.alias)
            load_rows(s.V, LDV, FBN, a.Dv, a.Dv, [&](int r) -> const uint16_t * {
                return s0 + r < a.Tk ? a.v + (size_t)(s0 + r) * a.ldv + (size_t)j * a.Dv : nullptr;
            }, a.v);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        {  // S = Q Kᵀ: warp (rg, half) computes rows 16 rg.., keys 32 half..
            float sacc[4][4];
#pragma unroll
            for (int nt = 0; nt < 4; nt++) sacc[nt][0] = sacc[nt][1] = sacc[nt][2] = sacc[nt][3] = 0.f;
            warp_mm_nk<4>(sacc, s.Q + rg * 16 * LDQ, LDQ, s.K + half * 32 * LDK, LDK, a.Dkp, lane);
            store_acc<4>(sacc, s.S + rg * 16 * LDS + half * 32, LDS, lane);
        }
        __syncthreads();
        {  // online softmax, 4 threads per row, 16 keys each
            int r = tid >> 2, part = tid & 3, rho = rho0 + r;
            int pos = rho < nrows ? a.Tk - a.Tq + row_token(a, rho) : -1;
            float x[16], mx = -INFINITY;
#pragma unroll
            for (int c = 0; c < 16; c++) {
                int key = s0 + part * 16 + c;
                float v = s.S[r * LDS + part * 16 + c] * a.sl2;
                x[c] = key <= pos ? v : -INFINITY;
                mx = fmaxf(mx, x[c]);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            float mold = s.M[r], mnew = fmaxf(mold, mx);
            float alpha = mnew == -INFINITY ? 1.f : exp2f(mold - mnew);
            float sum = 0.f;
#pragma unroll
            for (int c = 0; c < 16; c += 2) {
                float p0 = mnew == -INFINITY ? 0.f : exp2f(x[c] - mnew);
                float p1 = mnew == -INFINITY ? 0.f : exp2f(x[c + 1] - mnew);
                sum += p0 + p1;
                *reinterpret_cast<uint32_t *>(s.P + r * LDP + part * 16 + c) = pack_bf16(p0, p1);
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            __syncwarp();
            if (part == 0) {
                s.L[r] = s.L[r] * alpha + sum;
                s.M[r] = mnew;
                s.Al[r] = alpha;
            }
        }
        __syncthreads();
        {  // O = diag(alpha) O + P V; warp (rg, half) owns rows 16 rg.., columns half * Dv/2 ..
            float al0 = s.Al[rg * 16 + g], al1 = s.Al[rg * 16 + g + 8];
#pragma unroll
            for (int nt = 0; nt < FWD_MAXNT; nt++) {
                oacc[nt][0] *= al0;
                oacc[nt][1] *= al0;
                oacc[nt][2] *= al1;
                oacc[nt][3] *= al1;
            }
            warp_mm_kn<FWD_MAXNT>(oacc, s.P + rg * 16 * LDP, LDP, s.V + half * (a.Dv / 2), LDV,
                                  FBN, lane, ntw);
        }
        __syncthreads();
    }
    // o = O / l; lse = m ln 2 + ln l.
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        int r = rg * 16 + g + hr * 8, rho = rho0 + r;
        if (rho >= nrows) continue;
        float inv = 1.f / s.L[r];
        float *orow = o + ((size_t)row_token(a, rho) * a.H + row_head(a, j, rho)) * a.Dv;
#pragma unroll
        for (int nt = 0; nt < FWD_MAXNT; nt++) {
            if (nt < ntw) {
                int col = half * (a.Dv / 2) + nt * 8 + 2 * t;
                orow[col] = oacc[nt][2 * hr] * inv;
                orow[col + 1] = oacc[nt][2 * hr + 1] * inv;
            }
        }
    }
    if (tid < ABM && rho0 + tid < nrows) {
        int rho = rho0 + tid;
        lse[(size_t)row_token(a, rho) * a.H + row_head(a, j, rho)] =
            s.M[tid] * LN2_F + logf(s.L[tid]);
    }
}

// ---- backward ---------------------------------------------------------------------------------

// D[i][h] = Σ_c dO[i][h][c] O[i][h][c]: one warp per (i, h).
__global__ void attn_bwd_pre_k(int rows, int Dv, const uint16_t *dout, const float *o, float *D) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= rows) return;
    float acc = 0.f;
    for (int c = lane; c < Dv; c += 32)
        acc = fmaf(bf2f(dout[(size_t)row * Dv + c]), o[(size_t)row * Dv + c], acc);
    acc = warp_sum(acc);
    if (lane == 0) D[row] = acc;
}

struct BwdSm {
    uint16_t *Q, *dO, *K, *V, *Z, *PT, *ZT;
    float *S, *dP, *Lse, *Dd;
};
// dq kernel: Q, dO (ABM rows), K, V (BBN rows), S, dP [ABM][BBN+4], Z [ABM][BBN+8].
__host__ __device__ inline size_t dq_sm_carve(BwdSm &s, unsigned char *base, int Dkp, int Dv,
                                              int alias) {
    SmCarve c{base, 0};
    s.Q = c.take<uint16_t>((size_t)ABM * (Dkp + 8));
    s.dO = c.take<uint16_t>((size_t)ABM * (Dv + 8));
    s.K = c.take<uint16_t>((size_t)BBN * (Dkp + 8));
    s.V = alias ? s.K : c.take<uint16_t>((size_t)BBN * (Dv + 8));
    s.S = c.take<float>((size_t)ABM * (BBN + 4));
    s.dP = c.take<float>((size_t)ABM * (BBN + 4));
    s.Z = c.take<uint16_t>((size_t)ABM * (BBN + 8));
    s.Lse = c.take<float>(ABM);
    s.Dd = c.take<float>(ABM);
    s.PT = s.ZT = nullptr;
    return c.off;
}
// dkv kernel: K, V (BBN rows), Q, dO (ABM rows), S, dP, PT, ZT [BBN][ABM+8].
__host__ __device__ inline size_t dkv_sm_carve(BwdSm &s, unsigned char *base, int Dkp, int Dv,
                                               int alias) {
    SmCarve c{base, 0};
    s.K = c.take<uint16_t>((size_t)BBN * (Dkp + 8));
    s.V = alias ? s.K : c.take<uint16_t>((size_t)BBN * (Dv + 8));
    s.Q = c.take<uint16_t>((size_t)ABM * (Dkp + 8));
    s.dO = c.take<uint16_t>((size_t)ABM * (Dv + 8));
    s.S = c.take<float>((size_t)ABM * (BBN + 4));
    s.dP = c.take<float>((size_t)ABM * (BBN + 4));
    s.PT = c.take<uint16_t>((size_t)BBN * (ABM + 8));
    s.ZT = c.take<uint16_t>((size_t)BBN * (ABM + 8));
    s.Lse = c.take<float>(ABM);
    s.Dd = c.take<float>(ABM);
    s.Z = nullptr;
    return c.off;
}

// Loads the Q and dO rows of row block rho0 and their lse (base 2) and D values.
__device__ void bwd_load_rows(const AttnArgs &a, const BwdSm &s, int j, int rho0,
                              const uint16_t *dout, const float *lse, const float *D) {
    const int nrows = a.Tq * a.G;
    load_rows(s.Q, a.Dkp + 8, ABM, a.Dk, a.Dkp, [&](int r) -> const uint16_t * {
        int rho = rho0 + r;
        if (rho >= nrows) return nullptr;
        return a.q + ((size_t)row_token(a, rho) * a.H + row_head(a, j, rho)) * a.Dk;
    }, a.q);
    load_rows(s.dO, a.Dv + 8, ABM, a.Dv, a.Dv, [&](int r) -> const uint16_t * {
        int rho = rho0 + r;
        if (rho >= nrows) return nullptr;
        return dout + ((size_t)row_token(a, rho) * a.H + row_head(a, j, rho)) * a.Dv;
    }, dout);
    for (int r = threadIdx.x; r < ABM; r += blockDim.x) {
        int rho = rho0 + r;
        if (rho < nrows) {
            size_t ih = (size_t)row_token(a, rho) * a.H + row_head(a, j, rho);
            s.Lse[r] = lse[ih] * LOG2E_F;
            s.Dd[r] = D[ih];
        } else {
            s.Lse[r] = 0.f;
            s.Dd[r] = 0.f;
        }
    }
}

// S = Q Kᵀ and dP = dO Vᵀ for ABM rows x BBN keys into s.S, s.dP (warp: rows 16 (w&3), keys
// 16 (w>>2)).
__device__ void bwd_scores(const AttnArgs &a, const BwdSm &s) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, rg = w & 3, kh = w >> 2;
    const int LDQ = a.Dkp + 8, LDO = a.Dv + 8, LDK = a.Dkp + 8, LDV = a.alias ? LDK : a.Dv + 8;
    const int LDS = BBN + 4;
    float acc[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    warp_mm_nk<2>(acc, s.Q + rg * 16 * LDQ, LDQ, s.K + kh * 16 * LDK, LDK, a.Dkp, lane);
    store_acc<2>(acc, s.S + rg * 16 * LDS + kh * 16, LDS, lane);
#pragma unroll
    for (int nt = 0; nt < 2; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    warp_mm_nk<2>(acc, s.dO + rg * 16 * LDO, LDO, s.V + kh * 16 * LDV, LDV, a.Dv, lane);
    store_acc<2>(acc, s.dP + rg * 16 * LDS + kh * 16, LDS, lane);
}

#define DQ_MAXNT 36  // Dk <= 576: each warp owns Dk/2 columns = Dk/16 tiles of 8

__global__ void __launch_bounds__(256, 1) attn_bwd_dq_k(AttnArgs a, const uint16_t *dout,
                                                        const float *lse, const float *D,
                                                        float *dq) {
    extern __shared__ __align__(16) unsigned char smraw[];
    BwdSm s;
    dq_sm_carve(s, smraw, a.Dkp, a.Dv, a.alias);
    const int LDK = a.Dkp + 8, LDV = a.alias ? LDK : a.Dv + 8, LDS = BBN + 4, LDZ = BBN + 8;
    const int j = blockIdx.y, rho0 = blockIdx.x * ABM, nrows = a.Tq * a.G;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
    const int rg = w & 3, half = w >> 2, ntq = a.Dkp / 16;
    bwd_load_rows(a, s, j, rho0, dout, lse, D);
    int last = (rho0 + ABM < nrows ? rho0 + ABM : nrows) - 1;
    int nkb = (a.Tk - a.Tq + row_token(a, last)) / BBN + 1;
    float acc[DQ_MAXNT][4];
#pragma unroll
    for (int nt = 0; nt < DQ_MAXNT; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    for (int kb = 0; kb < nkb; kb++) {
        const int s0 = kb * BBN;
        load_rows(s.K, LDK, BBN, a.Dk, a.Dkp, [&](int r) -> const uint16_t * {
            return s0 + r < a.Tk ? a.k + (size_t)(s0 + r) * a.ldk + (size_t)j * a.Dk : nullptr;
        }, a.k);
        if (!a.alias)
            load_rows(s.V, LDV, BBN, a.Dv, a.Dv, [&](int r) -> const uint16_t * {
                return s0 + r < a.Tk ? a.v + (size_t)(s0 + r) * a.ldv + (size_t)j * a.Dv : nullptr;
            }, a.v);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        bwd_scores(a, s);
        __syncthreads();
        for (int i = tid; i < ABM * BBN; i += blockDim.x) {
            int r = i / BBN, c = i % BBN, rho = rho0 + r, key = s0 + c;
            float dz = 0.f;
            if (rho < nrows && key <= a.Tk - a.Tq + row_token(a, rho)) {
                float p = exp2f(s.S[r * LDS + c] * a.sl2 - s.Lse[r]);
                dz = p * (s.dP[r * LDS + c] - s.Dd[r]);
            }
            s.Z[r * LDZ + c] = __bfloat16_as_ushort(__float2bfloat16_rn(dz));
        }
        __syncthreads();
        warp_mm_kn<DQ_MAXNT>(acc, s.Z + rg * 16 * LDZ, LDZ, s.K + half * (a.Dkp / 2), LDK, BBN,
                             lane, ntq);
        __syncthreads();
    }
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        int r = rg * 16 + g + hr * 8, rho = rho0 + r;
        if (rho >= nrows) continue;
        float *drow = dq + ((size_t)row_token(a, rho) * a.H + row_head(a, j, rho)) * a.Dk;
#pragma unroll
        for (int nt = 0; nt < DQ_MAXNT; nt++) {
            int col = half * (a.Dkp / 2) + nt * 8 + 2 * t;
            if (nt < ntq && col < a.Dk) {
                drow[col] = a.scale * acc[nt][2 * hr];
                drow[col + 1] = a.scale * acc[nt][2 * hr + 1];
            }
        }
    }
}

#define DKV_MAXU 18  // (Dk [+ Dv]) / 8 tiles over 4 column groups: <= 576 / 32 (even)

__global__ void __launch_bounds__(256, 1) attn_bwd_dkv_k(AttnArgs a, const uint16_t *dout,
                                                         const float *lse, const float *D,
                                                         float *dk, float *dv) {
    extern __shared__ __align__(16) unsigned char smraw[];
    BwdSm s;
    dkv_sm_carve(s, smraw, a.Dkp, a.Dv, a.alias);
    const int LDQ = a.Dkp + 8, LDO = a.Dv + 8, LDK = a.Dkp + 8, LDV = a.alias ? LDK : a.Dv + 8;
    const int LDS = BBN + 4, LDT = ABM + 8;
    const int j = blockIdx.y, s0 = blockIdx.x * BBN, nrows = a.Tq * a.G;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
    const int kg = w & 1, cg = w >> 1;
    const int Ct = a.alias ? a.Dkp : a.Dkp + a.Dv, ntiles = Ct / 8;
    int i_min = s0 - (a.Tk - a.Tq);
    int rho_min = (i_min > 0 ? i_min : 0) * a.G;
    if (rho_min >= nrows) return;  // no query row sees these keys
    load_rows(s.K, LDK, BBN, a.Dk, a.Dkp, [&](int r) -> const uint16_t * {
        return s0 + r < a.Tk ? a.k + (size_t)(s0 + r) * a.ldk + (size_t)j * a.Dk : nullptr;
    }, a.k);
    if (!a.alias)
        load_rows(s.V, LDV, BBN, a.Dv, a.Dv, [&](int r) -> const uint16_t * {
            return s0 + r < a.Tk ? a.v + (size_t)(s0 + r) * a.ldv + (size_t)j * a.Dv : nullptr;
        }, a.v);
    float acc[DKV_MAXU][4];
#pragma unroll
    for (int u = 0; u < DKV_MAXU; u++) acc[u][0] = acc[u][1] = acc[u][2] = acc[u][3] = 0.f;
    for (int rho0 = (rho_min / ABM) * ABM; rho0 < nrows; rho0 += ABM) {
        bwd_load_rows(a, s, j, rho0, dout, lse, D);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        bwd_scores(a, s);
        __syncthreads();
        for (int i = tid; i < ABM * BBN; i += blockDim.x) {
            int c = i / ABM, r = i % ABM, rho = rho0 + r, key = s0 + c;
            float p = 0.f, dz = 0.f;
            if (rho < nrows && key <= a.Tk - a.Tq + row_token(a, rho)) {
                p = exp2f(s.S[r * LDS + c] * a.sl2 - s.Lse[r]);
                dz = a.scale * p * (s.dP[r * LDS + c] - s.Dd[r]);
            }
            s.PT[c * LDT + r] = __bfloat16_as_ushort(__float2bfloat16_rn(p));
            s.ZT[c * LDT + r] = __bfloat16_as_ushort(__float2bfloat16_rn(dz));
        }
        __syncthreads();
        // acc[keys 16 kg.., columns] += ZT · Q (dK part) and PT · dO (dV part). The warp owns
        // column-tile pairs v = cg + 4u (tiles 2v, 2v + 1; Dkp/8 and Dv/8 are even, so a pair
        // never straddles the dK / dV boundary).
        for (int k0 = 0; k0 < ABM; k0 += 16) {
            uint32_t az[4], ap[4];
            frag_a(az, s.ZT + kg * 16 * LDT, LDT, k0, lane);
            frag_a(ap, s.PT + kg * 16 * LDT, LDT, k0, lane);
#pragma unroll
            for (int u = 0; u < DKV_MAXU / 2; u++) {
                int nt = 2 * (cg + 4 * u);
                if (nt < ntiles) {
                    int c = nt * 8;
                    uint32_t b[4];
                    if (c < a.Dkp) {
                        frag_b2_kn(b, s.Q, LDQ, k0, c, lane);
                        mma_bf16_16816(acc[2 * u], az, b);
                        mma_bf16_16816(acc[2 * u + 1], az, b + 2);
                        if (a.alias && c < a.Dv) {
                            frag_b2_kn(b, s.dO, LDO, k0, c, lane);
                            mma_bf16_16816(acc[2 * u], ap, b);
                            mma_bf16_16816(acc[2 * u + 1], ap, b + 2);
                        }
                    } else {
                        frag_b2_kn(b, s.dO, LDO, k0, c - a.Dkp, lane);
                        mma_bf16_16816(acc[2 * u], ap, b);
                        mma_bf16_16816(acc[2 * u + 1], ap, b + 2);
                    }
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        int key = s0 + kg * 16 + g + hr * 8;
        if (key >= a.Tk) continue;
#pragma unroll
        for (int u = 0; u < DKV_MAXU; u++) {
            int nt = 2 * (cg + 4 * (u >> 1)) + (u & 1);
            int c = nt * 8 + 2 * t;
            if (nt < ntiles && (c < a.Dk || c >= a.Dkp)) {
                float *dst = c < a.Dk ? dk + (size_t)key * a.ldk + (size_t)j * a.Dk + c
                                      : dv + (size_t)key * a.ldv + (size_t)j * a.Dv + (c - a.Dkp);
                dst[0] += acc[u][2 * hr];
                dst[1] += acc[u][2 * hr + 1];
            }
        }
    }
}

// ---- launchers (training form) ----------------------------------------------------------------

static int attn_args_(mtrl_cuda_ctx *c, AttnArgs &a, int Tq, int Tk, int H, int Hk, int Dk,
                      int Dv, float scale, const mtrl_bf16 *q, const mtrl_bf16 *k, int ldk,
                      const mtrl_bf16 *v, int ldv) {
    MTRL_CUDA_REQUIRE(Tq >= 0 && Tq <= Tk && H > 0 && Hk > 0 && H % Hk == 0,
                      "Tq=%d Tk=%d H=%d Hk=%d", Tq, Tk, H, Hk);
    MTRL_CUDA_REQUIRE(Dk % 8 == 0 && Dv % 16 == 0 && Dk > 0 && Dv > 0 && Dk <= 576 && Dv <= 512,
                      "Dk=%d Dv=%d (Dk a multiple of 8, Dv of 16)", Dk, Dv);
    MTRL_CUDA_REQUIRE(ldk % 8 == 0 && ldv % 8 == 0 && ((uintptr_t)k & 15) == 0 &&
                          ((uintptr_t)v & 15) == 0 && ((uintptr_t)q & 15) == 0,
                      "ldk=%d ldv=%d: rows must be 16-byte aligned", ldk, ldv);
    a.Tq = Tq; a.Tk = Tk; a.H = H; a.Hk = Hk; a.G = H / Hk; a.Dk = Dk; a.Dv = Dv;
    a.Dkp = (Dk + 15) / 16 * 16;
    a.scale = scale;
    a.sl2 = scale * LOG2E_F;
    a.q = q; a.k = k; a.v = v; a.ldk = ldk; a.ldv = ldv;
    a.alias = (Hk == 1 && v == k && ldv == ldk && Dv <= Dk);
    if (!a.alias)
        MTRL_CUDA_REQUIRE(a.Dkp + Dv <= 576, "Dk + Dv = %d > 576 without aliased values", Dk + Dv);
    (void)c;
    return 0;
}

extern "C" int mtrl_attn_causal_fwd(mtrl_cuda_ctx *c, int Tq, int Tk, int H, int Hk, int Dk,
                                    int Dv, float scale, const mtrl_bf16 *q, const mtrl_bf16 *k,
                                    int ldk, const mtrl_bf16 *v, int ldv, float *o, float *lse) {
    AttnArgs a;
    if (attn_args_(c, a, Tq, Tk, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv)) return -1;
    if (Tq == 0) return 0;
    FwdSm s;
    size_t sh = fwd_sm_carve(s, nullptr, a.Dkp, Dv, a.alias);
    MTRL_CUDA_REQUIRE(sh <= c->smem_optin, "shared memory %zu > %zu", sh, c->smem_optin);
    set_smem(attn_fwd_k, sh);
    dim3 grid(cdiv((size_t)Tq * a.G, ABM), Hk);
    attn_fwd_k<<<grid, 256, sh, c->stream>>>(a, o, lse);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int mtrl_attn_causal_bwd(mtrl_cuda_ctx *c, int Tq, int Tk, int H, int Hk, int Dk,
                                    int Dv, float scale, const mtrl_bf16 *q, const mtrl_bf16 *k,
                                    int ldk, const mtrl_bf16 *v, int ldv, const float *o,
                                    const float *lse, const mtrl_bf16 *dout, float *dq,
                                    float *dk, float *dv) {
    AttnArgs a;
    if (attn_args_(c, a, Tq, Tk, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv)) return -1;
    if (a.alias) MTRL_CUDA_REQUIRE(dv == dk, "aliased values need dv == dk");
    MTRL_CUDA_REQUIRE(((uintptr_t)dout & 15) == 0, "dout must be 16-byte aligned");
    if (Tq == 0) return 0;
    BwdSm s;
    size_t sh1 = dq_sm_carve(s, nullptr, a.Dkp, Dv, a.alias);
    size_t sh2 = dkv_sm_carve(s, nullptr, a.Dkp, Dv, a.alias);
    MTRL_CUDA_REQUIRE(sh1 <= c->smem_optin && sh2 <= c->smem_optin, "shared memory %zu/%zu > %zu",
                      sh1, sh2, c->smem_optin);
    float *D = (float *)mtrl_ctx_scratch(c, sizeof(float) * (size_t)Tq * H);
    int rows = Tq * H;
    attn_bwd_pre_k<<<cdiv(rows, 8), 256, 0, c->stream>>>(rows, Dv, dout, o, D);
    CUDA_LAUNCH_CHECK();
    set_smem(attn_bwd_dq_k, sh1);
    attn_bwd_dq_k<<<dim3(cdiv((size_t)Tq * a.G, ABM), Hk), 256, sh1, c->stream>>>(a, dout, lse, D,
                                                                                   dq);
    CUDA_LAUNCH_CHECK();
    set_smem(attn_bwd_dkv_k, sh2);
    attn_bwd_dkv_k<<<dim3(cdiv(Tk, BBN), Hk), 256, sh2, c->stream>>>(a, dout, lse, D, dk, dv);
    CUDA_LAUNCH_CHECK();
    return 0;
}

// ---- absorbed decode ---------------------------------------------------------------------------

#define DCH 256  // keys per split-K chunk
#define DSB 32   // keys per step inside a chunk
#define DEC_MAXH 32

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(uint16_t x) { return bf2f(x); }

template <class T>
__global__ void __launch_bounds__(256) mla_decode_k(int H, int Dk, int Dv, float scale,
                                                    const float *qt, const T *lat, int ld,
                                                    const long long *seq_start,
                                                    const int *seq_len, int nch, float *pm,
                                                    float *pl, float *pacc) {
    extern __shared__ float sm[];
    const int LDL = Dk + 1;
    float *sq = sm, *sL = sq + H * Dk, *sp = sL + DSB * LDL, *sM = sp + H * DSB, *sLs = sM + H,
          *sAl = sLs + H;
    const int b = blockIdx.y, ch = blockIdx.x, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int len = seq_len[b];
    const long long st = seq_start[b];
    const int c0 = ch * DCH, c1 = c0 + DCH < len ? c0 + DCH : len;
    for (int i = tid; i < H * Dk; i += blockDim.x) sq[i] = qt[(size_t)b * H * Dk + i];
    for (int h = tid; h < H; h += blockDim.x) {
        sM[h] = -INFINITY;
        sLs[h] = 0.f;
    }
    float acc[DEC_MAXH][2];
#pragma unroll
    for (int h = 0; h < DEC_MAXH; h++) acc[h][0] = acc[h][1] = 0.f;
    __syncthreads();
    for (int s0 = c0; s0 < c1; s0 += DSB) {
        const int n = c1 - s0 < DSB ? c1 - s0 : DSB;
        for (int i = tid; i < DSB * Dk; i += blockDim.x) {
            int r = i / Dk, d = i % Dk;
            sL[r * LDL + d] = r < n ? to_f(lat[(size_t)(st + s0 + r) * ld + d]) : 0.f;
        }
        __syncthreads();
        for (int p = tid; p < H * DSB; p += blockDim.x) {
            int sidx = p & (DSB - 1), h = p / DSB;
            const float *qh = sq + h * Dk, *lr = sL + sidx * LDL;
            float dot = 0.f;
            for (int d = 0; d < Dk; d++) dot = fmaf(qh[d], lr[d], dot);
            sp[h * DSB + sidx] = sidx < n ? dot * scale : -INFINITY;
        }
        __syncthreads();
        for (int h = w; h < H; h += (blockDim.x >> 5)) {
            float x = sp[h * DSB + lane];  // DSB == 32 == warp size
            float mx = warp_max(x), mold = sM[h], mnew = fmaxf(mold, mx);
            float alpha = expf(mold - mnew);  // mold = -inf gives 0; mnew is finite (n >= 1)
            float p = expf(x - mnew);
            float sum = warp_sum(p);
            sp[h * DSB + lane] = p;
            if (lane == 0) {
                sLs[h] = sLs[h] * alpha + sum;
                sM[h] = mnew;
                sAl[h] = alpha;
            }
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < 2; u++) {
            int col = tid + 256 * u;
            if (col < Dv) {
#pragma unroll
                for (int h = 0; h < DEC_MAXH; h++)
                    if (h < H) acc[h][u] *= sAl[h];
                for (int sidx = 0; sidx < n; sidx++) {
                    float lv = sL[sidx * LDL + col];
#pragma unroll
                    for (int h = 0; h < DEC_MAXH; h++)
                        if (h < H) acc[h][u] = fmaf(sp[h * DSB + sidx], lv, acc[h][u]);
                }
            }
        }
        __syncthreads();
    }
    size_t base = ((size_t)b * nch + ch) * H;
    for (int h = tid; h < H; h += blockDim.x) {
        pm[base + h] = sM[h];
        pl[base + h] = sLs[h];
    }
#pragma unroll
    for (int u = 0; u < 2; u++) {
        int col = tid + 256 * u;
        if (col < Dv) {
#pragma unroll
            for (int h = 0; h < DEC_MAXH; h++)
                if (h < H) pacc[(base + h) * Dv + col] = acc[h][u];
        }
    }
}

// cstar[b][h] = Σ_ch e^{m_ch − M} acc_ch / Σ_ch e^{m_ch − M} l_ch, chunks in order.
__global__ void mla_decode_merge_k(int H, int Dv, int nch, const int *seq_len, const float *pm,
                                   const float *pl, const float *pacc, float *cstar) {
    int b = blockIdx.x, h = blockIdx.y;
    int used = (seq_len[b] + DCH - 1) / DCH;
    if (used > nch) used = nch;
    size_t base = (size_t)b * nch * H;
    float M = -INFINITY;
    for (int ch = 0; ch < used; ch++) M = fmaxf(M, pm[base + (size_t)ch * H + h]);
    float L = 0.f;
    for (int ch = 0; ch < used; ch++) L += pl[base + (size_t)ch * H + h] * expf(pm[base + (size_t)ch * H + h] - M);
    for (int col = threadIdx.x; col < Dv; col += blockDim.x) {
        float acc = 0.f;
        for (int ch = 0; ch < used; ch++) {
            size_t i = base + (size_t)ch * H + h;
            acc = fmaf(pacc[i * Dv + col], expf(pm[i] - M), acc);
        }
        cstar[((size_t)b * H + h) * Dv + col] = acc / L;
    }
}

// qt[b][h][dc + r] = q[b][h][dn + r] (the un-rotated "rope" slice passes through).
__global__ void mla_copy_rope_k(int BH, int dn, int dr, int dc, const float *q, float *qt) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= BH * dr) return;
    int bh = i / dr, r = i % dr;
    qt[(size_t)bh * (dc + dr) + dc + r] = q[(size_t)bh * (dn + dr) + dn + r];
}

extern "C" int mtrl_mla_decode_absorbed(mtrl_cuda_ctx *c, int B, int H, int dn, int dr, int dv,
                                        int dc, float scale, const float *q, const float *W_kvb,
                                        const void *lat, int lat_type, int ld,
                                        const long long *seq_start, const int *seq_len,
                                        int max_len, float *a) {
    MTRL_CUDA_REQUIRE(B >= 0 && H > 0 && H <= DEC_MAXH && dn > 0 && dr >= 0 && dv > 0 && dc > 0 &&
                          dc <= 512 && dc + dr <= 640 && ld >= dc + dr && max_len >= 1,
                      "B=%d H=%d dn=%d dr=%d dv=%d dc=%d ld=%d max_len=%d", B, H, dn, dr, dv, dc,
                      ld, max_len);
    MTRL_CUDA_REQUIRE(lat_type == MTRL_F32 || lat_type == MTRL_BF16, "lat_type=%d", lat_type);
    if (B == 0) return 0;
    const int Dk = dc + dr, nch = (max_len + DCH - 1) / DCH;
    ws_carver sz{nullptr, 0};
    sz.take<float>((size_t)B * H * Dk);
    sz.take<float>((size_t)B * H * dc);
    sz.take<float>((size_t)B * nch * H * 2);
    sz.take<float>((size_t)B * nch * H * dc);
    ws_carver cv{(char *)mtrl_ctx_scratch(c, sz.off), 0};
    float *qt = cv.take<float>((size_t)B * H * Dk);
    float *cstar = cv.take<float>((size_t)B * H * dc);
    float *pm = cv.take<float>((size_t)B * nch * H * 2), *pl = pm + (size_t)B * nch * H;
    float *pacc = cv.take<float>((size_t)B * nch * H * dc);
    // qt[b][h][0:dc] = q^n_{b,h} W_UK,h (for each head h: [B x dn] x [dn x dc])
    if (mtrl_gemm_batched(c, 0, 0, B, dc, dn, 1.f, q, H * (dn + dr), dn + dr, W_kvb, dc,
                          (long long)(dn + dv) * dc, MTRL_F32, 0.f, qt, H * Dk, Dk, MTRL_F32, H))
        return -1;
    if (dr > 0) {
        mla_copy_rope_k<<<cdiv((size_t)B * H * dr, 256), 256, 0, c->stream>>>(B * H, dn, dr, dc, q, qt);
        CUDA_LAUNCH_CHECK();
    }
    size_t sh = sizeof(float) * ((size_t)H * Dk + (size_t)DSB * (Dk + 1) + (size_t)H * DSB + 3 * H);
    MTRL_CUDA_REQUIRE(sh <= c->smem_optin, "shared memory %zu > %zu", sh, c->smem_optin);
    dim3 grid(nch, B);
    if (lat_type == MTRL_BF16) {
        set_smem(mla_decode_k<uint16_t>, sh);
        mla_decode_k<uint16_t><<<grid, 256, sh, c->stream>>>(H, Dk, dc, scale, qt,
                                                             (const uint16_t *)lat, ld, seq_start,
                                                             seq_len, nch, pm, pl, pacc);
    } else {
        set_smem(mla_decode_k<float>, sh);
        mla_decode_k<float><<<grid, 256, sh, c->stream>>>(H, Dk, dc, scale, qt, (const float *)lat,
                                                          ld, seq_start, seq_len, nch, pm, pl, pacc);
    }
    CUDA_LAUNCH_CHECK();
    mla_decode_merge_k<<<dim3(B, H), 256, 0, c->stream>>>(H, dc, nch, seq_len, pm, pl, pacc, cstar);
    CUDA_LAUNCH_CHECK();
    // a[b][h] = W_UV,h cstar[b][h]  (for each head: [B x dc] x [dv x dc]ᵀ)
    return mtrl_gemm_batched(c, 0, 1, B, dv, dc, 1.f, cstar, H * dc, dc, W_kvb + (size_t)dn * dc, dc,
                             (long long)(dn + dv) * dc, MTRL_F32, 0.f, a, H * dv, dv, MTRL_F32, H);
}
