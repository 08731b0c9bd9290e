// mla/attn_decode.cu: causal attention for the (absorbed) MLA layer, training forward / backward in
// flash style, and the absorbed decode over a batch of latent caches (docs/model.md §3; the oracle
// is kernels/ref/mla_ref.c: attn_causal_fwd/bwd, mla_decode_absorbed_ld).
//
// Training form. The kernels below are v1; the launchers run v2 (attn/causal_mma.cu: FA2 style,
// register-resident scores, cp.async double buffering) for the shapes it takes (see
// mtrl_attn_causal_version) unless attn = simt is set (kernel_opts.h).
// Query rows are packed per key head j: row ρ = (token i, head g of the group),
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
// Varlen (mtrl_attn_causal_fwd_varlen / _bwd_varlen): the tables of attn/varlen.cuh, then v2 / v3
// (attn/causal_mma.cu) or these kernels' VL forms, one launch each for all pieces.
// Decode (mtrl_mla_decode_absorbed): three launches.
//   mla_absorb_q_k: q̃ = [W_UKᵀ qⁿ ; qʳ] for every (sequence, head) (fp32, one kernel for the
//      product and the rope slice).
//   One of the split-K attention kernels below over each sequence's latent cache, all H heads
//      per split (MQA), writing per-split partials (m, l, O).
//   mla_decode_merge_uv_k: merges the partials in split order (deterministic) and applies the
//      value up-projection a = W_UV c* in the same kernel (clusters of blocks over c*'s columns,
//      partial products added across the cluster in rank order).
//   The attention and merge kernels are programmatic dependent launches: the attention kernel's
//   first key loads overlap the absorption, the merge's W_UV load overlaps the attention's tail.
//   v2 (default; bf16 cache only). grid (splits, B), 256 threads (8 warps), one block per SM.
//      A split (L keys; L from B, max_len and the SM count: dec2_split_len_) streams through
//      shared memory ONCE in 32-key stages (cp.async 16 B, a ring of stages), two stages per
//      64-key tile. Per tile, mma.sync m16n8k16 (bf16 operands, fp32 accumulation) with the heads
//      as M (16 rows, zero rows for H < 16): S = Q̃ Kᵀ (warp w: keys 8w..8w+7 over all Dk dims),
//      online softmax in base 2 (row maxima exchanged through shared memory, P stored as bf16),
//      then O += P V with V = the first dc columns of the same rows (warp w: value columns
//      w dc/8 .. +dc/8, accumulators in registers). Writes per-split (m, l, O[H][dc]).
//      Two kernels:
//      * mla_decode2r_k (H <= 16 and (dc, dr) = (512, 64) or (128, 32)): Q̃ held in registers as
//        mma A fragments, 6 stages, 2 barriers per tile (2 to 4 stages in flight).
//      * mla_decode2_k (other v2 shapes, e.g. H in 17..32): Q̃ in shared memory (ldmatrix per
//        k-step), two row tiles when H > 16, 5 stages (4 where shared memory is short),
//        3 barriers per tile.
//      v2 shapes: dc in {128, 256, 512}, (dc + dr) % 32 == 0, H <= 32, ld % 8 == 0, 16-byte
//      aligned pool. Anything else (fp32 cache, the tiny preset's dc = 32) runs v1.
//   v1 mla_decode_k (fp32 SIMT): split-K over 256-key chunks, dot products from shared memory,
//      partial (m, l, acc) with natural-base maxima, merged by the same merge kernel. The fallback;
//      decode = simt (kernel_opts.h) selects it for every shape (read at each call).
#include <math.h>
#include <stdlib.h>

#include "kernels/cuda/attn/varlen.cuh"
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
// A varlen block's piece p (attn/varlen.cuh): the pack's arguments narrowed to the piece's own
// call's; returns its first query token and first key.
__device__ __forceinline__ int2 attn_vl_piece(AttnArgs &a, const AttnVl &vl, int p) {
    const int q0 = vl.qo[p], k0 = vl.ko[p];
    a.Tq = vl.qo[p + 1] - q0;
    a.Tk = vl.ko[p + 1] - k0;
    a.q += (size_t)q0 * a.H * a.Dk;
    a.k += (size_t)k0 * a.ldk;
    a.v += (size_t)k0 * a.ldv;
    return make_int2(q0, k0);
}
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

// VL: a varlen launch, the block's piece and row block from vl (attn/varlen.cuh).
template <bool VL>
__global__ void __launch_bounds__(256, 1) attn_fwd_k(AttnArgs a, float *o, float *lse, const AttnVl vl) {
    extern __shared__ __align__(16) unsigned char smraw[];
    FwdSm s;
    fwd_sm_carve(s, smraw, a.Dkp, a.Dv, a.alias);
    const int LDQ = a.Dkp + 8, LDK = a.Dkp + 8, LDV = a.alias ? LDK : a.Dv + 8, LDS = FBN + 4,
              LDP = FBN + 8;
    int bx = blockIdx.x;
    int k0 = 0;
    if (VL) bx = attn_vl_fwd_block(a, vl, o, lse, &k0);
    (void)k0;
    const int j = blockIdx.y, rho0 = bx * ABM, nrows = a.Tq * a.G;
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

template <bool VL>
__global__ void __launch_bounds__(256, 1) attn_bwd_dq_k(AttnArgs a, const uint16_t *dout,
                                                        const float *lse, const float *D,
                                                        float *dq, const AttnVl vl) {
    extern __shared__ __align__(16) unsigned char smraw[];
    BwdSm s;
    dq_sm_carve(s, smraw, a.Dkp, a.Dv, a.alias);
    const int LDK = a.Dkp + 8, LDV = a.alias ? LDK : a.Dv + 8, LDS = BBN + 4, LDZ = BBN + 8;
    int bx = blockIdx.x;
    int k0 = 0;
    if (VL) bx = attn_vl_dq_block(a, vl, dout, lse, D, dq, &k0);
    (void)k0;
    const int j = blockIdx.y, rho0 = bx * ABM, nrows = a.Tq * a.G;
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

template <bool VL>
__global__ void __launch_bounds__(256, 1) attn_bwd_dkv_k(AttnArgs a, const uint16_t *dout,
                                                         const float *lse, const float *D,
                                                         float *dk, float *dv, const AttnVl vl) {
    extern __shared__ __align__(16) unsigned char smraw[];
    BwdSm s;
    dkv_sm_carve(s, smraw, a.Dkp, a.Dv, a.alias);
    const int LDQ = a.Dkp + 8, LDO = a.Dv + 8, LDK = a.Dkp + 8, LDV = a.alias ? LDK : a.Dv + 8;
    const int LDS = BBN + 4, LDT = ABM + 8;
    int bx = blockIdx.x;
    if (VL) bx = attn_vl_dkv_block(a, vl, dout, lse, D, dk, dv);
    const int j = blockIdx.y, s0 = bx * BBN, nrows = a.Tq * a.G;
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

// The v1 backward kernels' shared memory (dQ, dK / dV); -1 with a message past the device's.
static int bwd_smem_(mtrl_cuda_ctx *c, const AttnArgs &a, size_t *sh1, size_t *sh2) {
    BwdSm s;
    *sh1 = dq_sm_carve(s, nullptr, a.Dkp, a.Dv, a.alias);
    *sh2 = dkv_sm_carve(s, nullptr, a.Dkp, a.Dv, a.alias);
    MTRL_CUDA_REQUIRE(*sh1 <= c->smem_optin && *sh2 <= c->smem_optin, "shared memory %zu/%zu > %zu", *sh1, *sh2,
                      c->smem_optin);
    return 0;
}

// v2 (attn/causal_mma.cu): return 1 without launching for shapes they do not take, or when
// attn = simt; the arguments are checked here first.
extern "C" int mtrl_attn2_causal_fwd(mtrl_cuda_ctx *c, int Tq, int Tk, int H, int Hk, int Dk,
                                     int Dv, float scale, const mtrl_bf16 *q, const mtrl_bf16 *k,
                                     int ldk, const mtrl_bf16 *v, int ldv, float *o, float *lse);
extern "C" int mtrl_attn2_causal_bwd(mtrl_cuda_ctx *c, int Tq, int Tk, int H, int Hk, int Dk,
                                     int Dv, float scale, const mtrl_bf16 *q, const mtrl_bf16 *k,
                                     int ldk, const mtrl_bf16 *v, int ldv, const float *o,
                                     const float *lse, const mtrl_bf16 *dout, float *dq,
                                     float *dk, float *dv);

extern "C" int mtrl_attn_causal_fwd(mtrl_cuda_ctx *c, int Tq, int Tk, int H, int Hk, int Dk,
                                    int Dv, float scale, const mtrl_bf16 *q, const mtrl_bf16 *k,
                                    int ldk, const mtrl_bf16 *v, int ldv, float *o, float *lse) {
    AttnArgs a;
    if (attn_args_(c, a, Tq, Tk, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv)) return -1;
    if (Tq == 0) return 0;
    int r2 = mtrl_attn2_causal_fwd(c, Tq, Tk, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv, o, lse);
    if (r2 <= 0) return r2;
    FwdSm s;
    size_t sh = fwd_sm_carve(s, nullptr, a.Dkp, Dv, a.alias);
    MTRL_CUDA_REQUIRE(sh <= c->smem_optin, "shared memory %zu > %zu", sh, c->smem_optin);
    set_smem(attn_fwd_k<false>, sh);
    dim3 grid(cdiv((size_t)Tq * a.G, ABM), Hk);
    attn_fwd_k<false><<<grid, 256, sh, c->stream>>>(a, o, lse, AttnVl{});
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
    int r2 = mtrl_attn2_causal_bwd(c, Tq, Tk, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv, o, lse,
                                   dout, dq, dk, dv);
    if (r2 <= 0) return r2;
    size_t sh1, sh2;
    if (bwd_smem_(c, a, &sh1, &sh2)) return -1;
    float *D = (float *)mtrl_ctx_scratch(c, sizeof(float) * (size_t)Tq * H);
    int rows = Tq * H;
    attn_bwd_pre_k<<<cdiv(rows, 8), 256, 0, c->stream>>>(rows, Dv, dout, o, D);
    CUDA_LAUNCH_CHECK();
    set_smem(attn_bwd_dq_k<false>, sh1);
    attn_bwd_dq_k<false><<<dim3(cdiv((size_t)Tq * a.G, ABM), Hk), 256, sh1, c->stream>>>(a, dout, lse, D,
                                                                                          dq, AttnVl{});
    CUDA_LAUNCH_CHECK();
    set_smem(attn_bwd_dkv_k<false>, sh2);
    attn_bwd_dkv_k<false><<<dim3(cdiv(Tk, BBN), Hk), 256, sh2, c->stream>>>(a, dout, lse, D, dk, dv, AttnVl{});
    CUDA_LAUNCH_CHECK();
    return 0;
}

// ---- varlen (attn/varlen.cuh) ------------------------------------------------------------------

// Checks the pieces (host offsets) and builds their tables, the offsets rebased to 0 (the
// caller moves its pointers to the first piece's rows). -1 with a message when they are not pieces of a
// packed call.
static int attn_vl_prep_(const char *fn, AttnVlTab &t, int n, const int *qo_h, const int *ko_h, int H, int Hk,
                         bool bwd, size_t *bytes) {
    if (n < 0 || (n > 0 && !qo_h) || n > (1 << 24)) {
        fprintf(stderr, "%s: n = %d pieces with offsets %s\n", fn, n, qo_h ? "given" : "NULL");
        return -1;
    }
    const int *kh = ko_h ? ko_h : qo_h;
    std::vector<int> qo((size_t)n + 1), ko((size_t)n + 1);
    for (int i = 0; i <= n; i++) {
        qo[i] = qo_h[i] - qo_h[0];
        ko[i] = kh[i] - kh[0];
    }
    for (int i = 0; i < n; i++)
        if (qo[i + 1] < qo[i] || ko[i + 1] - ko[i] < qo[i + 1] - qo[i]) {
            fprintf(stderr, "%s: piece %d has %d query rows and %d keys: need 0 <= Tq <= Tk\n", fn, i,
                    qo[i + 1] - qo[i], ko[i + 1] - ko[i]);
            return -1;
        }
    *bytes = attn_vl_build(t, n, qo.data(), ko.data(), H, H / Hk, bwd);
    return 0;
}

extern "C" int mtrl_attn_causal_fwd_varlen(mtrl_cuda_ctx *c, int n, const int *qoffs_host, const int *koffs_host,
                                           int H, int Hk, int Dk, int Dv, float scale, const mtrl_bf16 *q,
                                           const mtrl_bf16 *k, int ldk, const mtrl_bf16 *v, int ldv, float *o,
                                           float *lse) {
    AttnVlTab t;
    size_t tb = 0;
    if (attn_vl_prep_(__func__, t, n, qoffs_host, koffs_host, H, Hk, false, &tb)) return -1;
    const size_t q0 = n ? (size_t)qoffs_host[0] : 0, k0 = n ? (size_t)(koffs_host ? koffs_host : qoffs_host)[0] : 0;
    q += q0 * H * Dk, o += q0 * H * Dv, lse += q0 * H, k += k0 * ldk, v += k0 * ldv;  // the tables are from 0
    AttnArgs a;
    if (attn_args_(c, a, t.Tq, t.Tk, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv)) return -1;
    if (t.Tq == 0) return 0;
    if (attn_vl_upload(c, t, mtrl_ctx_scratch(c, tb))) return -1;
    const int r2 = attn2_causal_fwd_vl(c, t, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv, o, lse);
    if (r2 <= 0) return r2;
    FwdSm s;
    size_t sh = fwd_sm_carve(s, nullptr, a.Dkp, Dv, a.alias);
    MTRL_CUDA_REQUIRE(sh <= c->smem_optin, "shared memory %zu > %zu", sh, c->smem_optin);
    int nb;
    const AttnVl vl = t.view(false, ABM, &nb);
    set_smem(attn_fwd_k<true>, sh);
    attn_fwd_k<true><<<dim3(nb, Hk), 256, sh, c->stream>>>(a, o, lse, vl);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int mtrl_attn_causal_bwd_varlen(mtrl_cuda_ctx *c, int n, const int *qoffs_host, const int *koffs_host,
                                           int H, int Hk, int Dk, int Dv, float scale, const mtrl_bf16 *q,
                                           const mtrl_bf16 *k, int ldk, const mtrl_bf16 *v, int ldv, const float *o,
                                           const float *lse, const mtrl_bf16 *dout, float *dq, float *dk,
                                           float *dv) {
    // v3's head-major lse / D copies take 64 rows per piece and head at least: a pack of many
    // tiny pieces runs as groups of consecutive pieces whose copies take no more than one
    // sequence of the pack's length would (or the longest piece's), so the scratch stays what the
    // planner counts (model_plan.c). The pieces are independent: the same bits either way.
    if (n > 1 && qoffs_host) {
        const int *kh = koffs_host ? koffs_host : qoffs_host;
        long long cap = ((long long)qoffs_host[n] - qoffs_host[0] + 63) / 64 * 64, sum = 0;
        for (int i = 0; i < n; i++) {
            const long long np = (qoffs_host[i + 1] - qoffs_host[i] + 63LL) / 64 * 64;
            cap = np > cap ? np : cap;
            sum += np;
        }
        if (sum > cap)
            for (int p0 = 0, p1; p0 < n; p0 = p1) {
                long long g = 0;
                for (p1 = p0; p1 < n; p1++) {
                    const long long np = (qoffs_host[p1 + 1] - qoffs_host[p1] + 63LL) / 64 * 64;
                    if (p1 > p0 && g + np > cap) break;
                    g += np;
                }
                if (mtrl_attn_causal_bwd_varlen(c, p1 - p0, qoffs_host + p0, kh + p0, H, Hk, Dk, Dv, scale, q, k,
                                                ldk, v, ldv, o, lse, dout, dq, dk, dv))
                    return -1;
            }
        if (sum > cap) return 0;
    }
    AttnVlTab t;
    size_t tb = 0;
    if (attn_vl_prep_(__func__, t, n, qoffs_host, koffs_host, H, Hk, true, &tb)) return -1;
    const size_t q0 = n ? (size_t)qoffs_host[0] : 0, k0 = n ? (size_t)(koffs_host ? koffs_host : qoffs_host)[0] : 0;
    q += q0 * H * Dk, o += q0 * H * Dv, lse += q0 * H, dout += q0 * H * Dv, dq += q0 * H * Dk;
    k += k0 * ldk, v += k0 * ldv, dk += k0 * ldk, dv += k0 * ldv;  // the tables are from 0
    AttnArgs a;
    if (attn_args_(c, a, t.Tq, t.Tk, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv)) return -1;
    if (a.alias) MTRL_CUDA_REQUIRE(dv == dk, "aliased values need dv == dk");
    MTRL_CUDA_REQUIRE(((uintptr_t)dout & 15) == 0, "dout must be 16-byte aligned");
    if (t.Tq == 0) return 0;
    // one scratch block: the tables, then D (and v3's copies)
    ws_carver sz{nullptr, 0};
    sz.take<int>(tb / sizeof(int));
    sz.take<float>(attn_vl_bwd_floats(t, H));
    ws_carver wc{(char *)mtrl_ctx_scratch(c, sz.off), 0};
    int *tab = wc.take<int>(tb / sizeof(int));
    float *ws = wc.take<float>(attn_vl_bwd_floats(t, H));
    if (attn_vl_upload(c, t, tab)) return -1;
    const int r2 = attn2_causal_bwd_vl(c, t, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv, o, lse, dout, dq, dk, dv, ws);
    if (r2 <= 0) return r2;
    size_t sh1, sh2;
    if (bwd_smem_(c, a, &sh1, &sh2)) return -1;
    const int rows = t.Tq * H;  // D of every row of the pack: each the same as in its piece's call
    attn_bwd_pre_k<<<cdiv(rows, 8), 256, 0, c->stream>>>(rows, Dv, dout, o, ws);
    CUDA_LAUNCH_CHECK();
    int nq, nk;
    const AttnVl vq = t.view(false, ABM, &nq), vk = t.view(true, BBN, &nk);
    set_smem(attn_bwd_dq_k<true>, sh1);
    attn_bwd_dq_k<true><<<dim3(nq, Hk), 256, sh1, c->stream>>>(a, dout, lse, ws, dq, vq);
    CUDA_LAUNCH_CHECK();
    set_smem(attn_bwd_dkv_k<true>, sh2);
    attn_bwd_dkv_k<true><<<dim3(nk, Hk), 256, sh2, c->stream>>>(a, dout, lse, ws, dk, dv, vk);
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

// ---- absorbed decode, v2 (tensor cores) ---------------------------------------------------------

#define D2_CH 32            // keys per cp.async stage
#define D2_TN 64            // keys per compute tile (two stages)
#define D2_LDP (D2_TN + 8)  // row stride of P in shared memory (bf16): 144 B, conflict-free ldmatrix

struct Dec2Args {
    int H, Dk, dc, ld, L, nsplit;
    float sl2;                      // softmax scale * log2(e)
    const float *qt;                // [B][H][Dk] absorbed queries (fp32)
    const uint16_t *lat;            // bf16 pool, row stride ld
    const long long *seq_start;
    const int *seq_len;
    float *pm, *pl, *pacc;          // [B][nsplit][H] (base-2 max, sum), [B][nsplit][H][dc]
};

// Shared memory of mla_decode2_k: NST key stages and Q̃ ([rows][Dk + 8] bf16: the 16-byte pad
// makes 8 consecutive rows hit 8 different 16-byte bank groups, so ldmatrix is conflict-free),
// P [rows][D2_LDP] bf16, row maxima and sums [8 warps][32] and the final maxima [32] (fp32).
static size_t dec2_smem_(int MT, int NST, int Dk) {
    size_t LDS = (size_t)Dk + 8;
    return 2 * ((size_t)NST * D2_CH * LDS + (size_t)MT * 16 * LDS + (size_t)MT * 16 * D2_LDP) +
           4 * (8 * 32 * 2 + 32);
}

// grid (nsplit, B), 256 threads (8 warps), one block per SM. MT: row tiles of 16 heads; NTW:
// 8-column mma tiles per warp in P V (dc = 64 NTW); NST: stages in the cp.async ring (>= 4).
//
// Pipeline: chunk c (32 keys) lives in stage c % NST. The prologue issues chunks 0 .. NST-3;
// iteration `it` (tile = chunks 2it, 2it+1) waits until at most NST-4 groups are pending (so
// chunks <= 2it+1 landed), passes barrier A (every warp is done with tile it-1), then issues
// chunks 2it+NST-2 and 2it+NST-1 into the stages tile it-1 used. One commit group per chunk,
// empty groups past the end, so the counts are uniform. Chunks of the last tile beyond the
// split's end are zero-filled (the P V product must not meet stale or uninitialised bits).
template <int MT, int NTW, int NST>
__global__ void __launch_bounds__(256, 1) mla_decode2_k(Dec2Args a) {
    static_assert(NST >= 4 && NTW % 2 == 0 && (MT == 1 || MT == 2), "mla_decode2_k shape");
    extern __shared__ __align__(16) unsigned char dec2_sm[];
    const int Dk = a.Dk, LDS = Dk + 8, PR = Dk >> 3;  // PR: 16-byte pieces per key row
    uint16_t *sK = reinterpret_cast<uint16_t *>(dec2_sm);
    uint16_t *sQ = sK + (size_t)NST * D2_CH * LDS;
    uint16_t *sP = sQ + (size_t)MT * 16 * LDS;
    float *sRedM = reinterpret_cast<float *>(sP + MT * 16 * D2_LDP);  // [8][32]
    float *sRedL = sRedM + 8 * 32;                                     // [8][32]
    float *sMf = sRedL + 8 * 32;                                       // [32]
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
    const int b = blockIdx.y, split = blockIdx.x;
    const int len = a.seq_len[b];
    const int c0 = split * a.L;
    if (c0 >= len) return;  // this sequence is shorter: no split here (uniform per block)
    const int nkeys = len - c0 < a.L ? len - c0 : a.L;
    const int ntile = (nkeys + D2_TN - 1) / D2_TN, nchunk = 2 * ntile;
    const uint16_t *base = a.lat + (size_t)a.seq_start[b] * (size_t)a.ld;  // key 0 of the sequence

    // Pieces (16 bytes) of a chunk are numbered i = r PR + pc; thread tid copies i = tid + 256 j,
    // its (row, piece) advanced incrementally (no division per piece).
    const int r_first = tid / PR, pc_first = tid - r_first * PR;
    const int r_step = 256 / PR, pc_step = 256 - r_step * PR;
    auto issue = [&](int ch) {
        if (ch < nchunk) {
            uint16_t *dst = sK + (size_t)(ch % NST) * D2_CH * LDS;
            const int kc = ch * D2_CH;  // first key of the chunk, from c0
            const uint16_t *src = base + ((size_t)c0 + kc) * (size_t)a.ld;
            int r = r_first, pc = pc_first;
            while (r < D2_CH) {
                const bool ok = kc + r < nkeys;  // else 16 zero bytes (src-size 0)
                cp_async16_pred(dst + r * LDS + pc * 8, ok ? src + r * a.ld + pc * 8 : base, ok);
                r += r_step;
                pc += pc_step;
                if (pc >= PR) {
                    pc -= PR;
                    r++;
                }
            }
        }
        cp_async_commit();
    };
#pragma unroll
    for (int ch = 0; ch < NST - 2; ch++) issue(ch);
    pdl_wait();     // Q̃ comes from the absorption kernel ahead; the keys above did not
    pdl_trigger();  // the merge's blocks may take SMs as these leave

    // Q̃ rows of this sequence as bf16; rows H .. MT*16-1 are zero.
    {
        const int q4 = Dk >> 2;
        const float *qb = a.qt + (size_t)b * a.H * Dk;
        for (int i = tid; i < MT * 16 * q4; i += 256) {
            const int r = i / q4, c = (i - r * q4) * 4;
            float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
            if (r < a.H) x = *reinterpret_cast<const float4 *>(qb + (size_t)r * Dk + c);
            uint2 pk;
            pk.x = pack_bf16(x.x, x.y);
            pk.y = pack_bf16(x.z, x.w);
            *reinterpret_cast<uint2 *>(sQ + r * LDS + c) = pk;
        }
    }

    float oacc[MT][NTW][4];
    float mrun[MT][2], lrun[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int nt = 0; nt < NTW; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) oacc[mt][nt][e] = 0.f;
        mrun[mt][0] = mrun[mt][1] = -INFINITY;
        lrun[mt][0] = lrun[mt][1] = 0.f;
    }
    const int col0 = w * (NTW * 8);  // this warp's first value column in P V

    for (int it = 0; it < ntile; it++) {
        cp_async_wait<NST - 4>();
        __syncthreads();  // A: chunks 2it, 2it+1 visible; tile it-1 fully consumed
        issue(2 * it + NST - 2);
        issue(2 * it + NST - 1);

        // ---- S = Q̃ Kᵀ for keys 8w .. 8w+7 of the tile (two accumulators per row tile) ----
        const uint16_t *kb = sK + (size_t)((2 * it + (w >> 2)) % NST) * D2_CH * LDS +
                             ((w & 3) * 8 + (lane & 7)) * LDS + ((lane >> 3) << 3);
        float sacc[MT][2][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int e = 0; e < 4; e++) sacc[mt][0][e] = sacc[mt][1][e] = 0.f;
#pragma unroll 2
        for (int k0 = 0; k0 < Dk; k0 += 32) {
            uint32_t bk[4];  // b[0..1]: dims k0 .. k0+15, b[2..3]: k0+16 .. k0+31 (n = key)
            ldsm_x4(bk, kb + k0);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                uint32_t a0[4], a1[4];
                frag_a(a0, sQ + mt * 16 * LDS, LDS, k0, lane);
                frag_a(a1, sQ + mt * 16 * LDS, LDS, k0 + 16, lane);
                mma_bf16_16816(sacc[mt][0], a0, bk);
                mma_bf16_16816(sacc[mt][1], a1, bk + 2);
            }
        }
        // Scores (base 2), keys past the split's end masked; row maxima of this warp's 8 keys.
        const int kidx = it * D2_TN + 8 * w + 2 * t;  // key (from c0) of element 0; element 1: +1
        float sc[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float x = (sacc[mt][0][e] + sacc[mt][1][e]) * a.sl2;
                sc[mt][e] = kidx + (e & 1) < nkeys ? x : -INFINITY;
            }
            float m0 = fmaxf(sc[mt][0], sc[mt][1]), m1 = fmaxf(sc[mt][2], sc[mt][3]);
            m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 1));
            m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 2));
            m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 1));
            m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 2));
            if (t == 0) {
                sRedM[w * 32 + mt * 16 + g] = m0;
                sRedM[w * 32 + mt * 16 + g + 8] = m1;
            }
        }
        __syncthreads();  // B: every warp's row maxima
        // Online softmax: the tile's row max over the 8 warps (same order in every thread, so
        // every thread holds identical running maxima), rescale, P = 2^(s - m) as bf16.
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int hr = 0; hr < 2; hr++) {
                const int row = mt * 16 + g + 8 * hr;
                float tm = sRedM[row];
#pragma unroll
                for (int i = 1; i < 8; i++) tm = fmaxf(tm, sRedM[i * 32 + row]);
                const float mn = fmaxf(mrun[mt][hr], tm);  // finite: the tile has a valid key
                const float al = exp2f(mrun[mt][hr] - mn);  // first tile: 2^-inf = 0
                mrun[mt][hr] = mn;
                const __nv_bfloat162 pb =
                    __floats2bfloat162_rn(exp2f(sc[mt][2 * hr] - mn), exp2f(sc[mt][2 * hr + 1] - mn));
                lrun[mt][hr] = fmaf(lrun[mt][hr], al, __low2float(pb) + __high2float(pb));
                *reinterpret_cast<__nv_bfloat162 *>(sP + row * D2_LDP + 8 * w + 2 * t) = pb;
#pragma unroll
                for (int nt = 0; nt < NTW; nt++) {
                    oacc[mt][nt][2 * hr] *= al;
                    oacc[mt][nt][2 * hr + 1] *= al;
                }
            }
        __syncthreads();  // C: P complete

        // ---- O += P V: keys of the tile as k (16 per step), this warp's value columns as n ----
#pragma unroll
        for (int ks = 0; ks < D2_TN / 16; ks++) {
            const uint16_t *vb =
                sK + (size_t)((2 * it + (ks >> 1)) % NST) * D2_CH * LDS + (ks & 1) * 16 * LDS;
            uint32_t pa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) frag_a(pa[mt], sP + mt * 16 * D2_LDP, D2_LDP, ks * 16, lane);
#pragma unroll
            for (int np = 0; np < NTW / 2; np++) {
                uint32_t bv[4];
                frag_b2_kn(bv, vb, LDS, 0, col0 + np * 16, lane);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    mma_bf16_16816(oacc[mt][2 * np], pa[mt], bv);
                    mma_bf16_16816(oacc[mt][2 * np + 1], pa[mt], bv + 2);
                }
            }
        }
    }
    cp_async_wait<0>();  // only empty groups can be pending here

    // ---- per-split results: m (base 2), l, O (unnormalised) ----
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int row = mt * 16 + g + 8 * hr;
            float l = lrun[mt][hr];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            if (t == 0) {
                sRedL[w * 32 + row] = l;
                if (w == 0) sMf[row] = mrun[mt][hr];
            }
        }
    __syncthreads();
    const size_t pb0 = ((size_t)b * a.nsplit + split) * a.H;
    if (tid < MT * 16 && tid < a.H) {
        float l = sRedL[tid];
#pragma unroll
        for (int i = 1; i < 8; i++) l += sRedL[i * 32 + tid];
        a.pm[pb0 + tid] = sMf[tid];
        a.pl[pb0 + tid] = l;
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int row = mt * 16 + g + 8 * hr;
            if (row < a.H) {
                float *dst = a.pacc + (pb0 + row) * a.dc + col0 + 2 * t;
#pragma unroll
                for (int nt = 0; nt < NTW; nt++)
                    *reinterpret_cast<float2 *>(dst + nt * 8) =
                        make_float2(oacc[mt][nt][2 * hr], oacc[mt][nt][2 * hr + 1]);
            }
        }
}

// Shared memory of mla_decode2r_k: 6 key stages, P, row maxima / sums / final maxima.
#define D2R_NST 6
static size_t dec2r_smem_(int Dk) {
    return 2 * ((size_t)D2R_NST * D2_CH * ((size_t)Dk + 8) + 16 * D2_LDP) + 4 * (8 * 32 * 2 + 32);
}

// The same attention with Q̃ in registers: H <= 16 (one row tile), Dk = 16 KS. Each thread keeps
// the mma A fragments of all KS k-steps (4 KS registers), so the score product reads only the
// keys from shared memory; that frees the 18 KB of Q̃ for a sixth stage, and the tile loop
// needs two barriers instead of three:
//   S(it) -> row maxima -> barrier B(it) -> issue tile it+2 into tile it-1's stages -> P(it)
//   -> wait for tile it+1 -> barrier C(it) -> O += P(it) V(it)
// B(it): maxima visible, and every warp is past PV(it-1), so tile it-1's stages are free.
// C(it): P(it) visible, and tile it+1 landed and visible for S(it+1). One commit group per
// chunk: the prologue commits tiles 0 and 1 (4 groups), every iteration 2 more; at C(it) the
// groups of tile it+2 may still be pending (wait_group 2). 2 to 4 chunks stay in flight.
template <int KS, int NTW>
__global__ void __launch_bounds__(256, 1) mla_decode2r_k(Dec2Args a) {
    static_assert(KS % 2 == 0 && NTW % 2 == 0, "mla_decode2r_k shape");
    constexpr int NST = D2R_NST, Dk = 16 * KS, LDS = Dk + 8, PR = Dk / 8;
    extern __shared__ __align__(16) unsigned char dec2_sm[];
    uint16_t *sK = reinterpret_cast<uint16_t *>(dec2_sm);
    uint16_t *sP = sK + (size_t)NST * D2_CH * LDS;
    float *sRedM = reinterpret_cast<float *>(sP + 16 * D2_LDP);  // [8][32] (rows 0..15 used)
    float *sRedL = sRedM + 8 * 32;                               // [8][32]
    float *sMf = sRedL + 8 * 32;                                 // [32]
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
    const int b = blockIdx.y, split = blockIdx.x;
    const int len = a.seq_len[b];
    const int c0 = split * a.L;
    if (c0 >= len) return;
    const int nkeys = len - c0 < a.L ? len - c0 : a.L;
    const int ntile = (nkeys + D2_TN - 1) / D2_TN, nchunk = 2 * ntile;
    const uint16_t *base = a.lat + (size_t)a.seq_start[b] * (size_t)a.ld;

    const int r_first = tid / PR, pc_first = tid - r_first * PR;
    constexpr int r_step = 256 / PR, pc_step = 256 - r_step * PR;
    auto issue = [&](int ch) {
        if (ch < nchunk) {
            uint16_t *dst = sK + (size_t)(ch % NST) * D2_CH * LDS;
            const int kc = ch * D2_CH;
            const uint16_t *src = base + ((size_t)c0 + kc) * (size_t)a.ld;
            int r = r_first, pc = pc_first;
            while (r < D2_CH) {
                const bool ok = kc + r < nkeys;
                cp_async16_pred(dst + r * LDS + pc * 8, ok ? src + r * a.ld + pc * 8 : base, ok);
                r += r_step;
                pc += pc_step;
                if (pc >= PR) {
                    pc -= PR;
                    r++;
                }
            }
        }
        cp_async_commit();
    };
#pragma unroll
    for (int ch = 0; ch < 4; ch++) issue(ch);
    pdl_wait();     // as in mla_decode2_k
    pdl_trigger();

    // Q̃ as A fragments straight from global memory (fp32 -> bf16): a[0] (g, 2t..), a[1] (g+8,
    // 2t..), a[2] (g, 2t+8..), a[3] (g+8, 2t+8..) of k-step ks; rows >= H are zero.
    uint32_t qf[KS][4];
    {
        const float *q0 = a.qt + ((size_t)b * a.H + g) * Dk + 2 * t;
        const float *q1 = q0 + (size_t)8 * Dk;
        const bool h0 = g < a.H, h1 = g + 8 < a.H;
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            float2 x0 = make_float2(0.f, 0.f), x1 = x0, x2 = x0, x3 = x0;
            if (h0) {
                x0 = *reinterpret_cast<const float2 *>(q0 + ks * 16);
                x2 = *reinterpret_cast<const float2 *>(q0 + ks * 16 + 8);
            }
            if (h1) {
                x1 = *reinterpret_cast<const float2 *>(q1 + ks * 16);
                x3 = *reinterpret_cast<const float2 *>(q1 + ks * 16 + 8);
            }
            qf[ks][0] = pack_bf16(x0.x, x0.y);
            qf[ks][1] = pack_bf16(x1.x, x1.y);
            qf[ks][2] = pack_bf16(x2.x, x2.y);
            qf[ks][3] = pack_bf16(x3.x, x3.y);
        }
    }

    float oacc[NTW][4];
    float mrun[2] = {-INFINITY, -INFINITY}, lrun[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < NTW; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) oacc[nt][e] = 0.f;
    const int col0 = w * (NTW * 8);

    cp_async_wait<2>();  // tile 0 (chunks 0, 1) landed; tile 1 may be pending
    __syncthreads();

    for (int it = 0; it < ntile; it++) {
        // ---- S = Q̃ Kᵀ for keys 8w .. 8w+7 of the tile: four independent accumulators ----
        const uint16_t *kb = sK + (size_t)((2 * it + (w >> 2)) % NST) * D2_CH * LDS +
                             ((w & 3) * 8 + (lane & 7)) * LDS + ((lane >> 3) << 3);
        float sacc[4][4];
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) sacc[j][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < KS; ks += 2) {
            uint32_t bk[4];  // b[0..1]: k-step ks, b[2..3]: k-step ks+1 (n = key)
            ldsm_x4(bk, kb + ks * 16);
            mma_bf16_16816(sacc[ks & 2], qf[ks], bk);
            mma_bf16_16816(sacc[(ks & 2) + 1], qf[ks + 1], bk + 2);
        }
        const int kidx = it * D2_TN + 8 * w + 2 * t;
        float sc[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float x = ((sacc[0][e] + sacc[1][e]) + (sacc[2][e] + sacc[3][e])) * a.sl2;
            sc[e] = kidx + (e & 1) < nkeys ? x : -INFINITY;
        }
        {
            float m0 = fmaxf(sc[0], sc[1]), m1 = fmaxf(sc[2], sc[3]);
            m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 1));
            m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 2));
            m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 1));
            m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 2));
            if (t == 0) {
                sRedM[w * 32 + g] = m0;
                sRedM[w * 32 + g + 8] = m1;
            }
        }
        __syncthreads();  // B(it)
        issue(2 * it + 4);
        issue(2 * it + 5);
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int row = g + 8 * hr;
            float tm = sRedM[row];
#pragma unroll
            for (int i = 1; i < 8; i++) tm = fmaxf(tm, sRedM[i * 32 + row]);
            const float mn = fmaxf(mrun[hr], tm);
            const float al = exp2f(mrun[hr] - mn);
            mrun[hr] = mn;
            const __nv_bfloat162 pb =
                __floats2bfloat162_rn(exp2f(sc[2 * hr] - mn), exp2f(sc[2 * hr + 1] - mn));
            lrun[hr] = fmaf(lrun[hr], al, __low2float(pb) + __high2float(pb));
            *reinterpret_cast<__nv_bfloat162 *>(sP + row * D2_LDP + 8 * w + 2 * t) = pb;
#pragma unroll
            for (int nt = 0; nt < NTW; nt++) {
                oacc[nt][2 * hr] *= al;
                oacc[nt][2 * hr + 1] *= al;
            }
        }
        cp_async_wait<2>();  // tile it+1 landed (tile it+2 may be pending)
        __syncthreads();     // C(it)

        // ---- O += P V ----
#pragma unroll
        for (int ks = 0; ks < D2_TN / 16; ks++) {
            const uint16_t *vb =
                sK + (size_t)((2 * it + (ks >> 1)) % NST) * D2_CH * LDS + (ks & 1) * 16 * LDS;
            uint32_t pa[4];
            frag_a(pa, sP, D2_LDP, ks * 16, lane);
#pragma unroll
            for (int np = 0; np < NTW / 2; np++) {
                uint32_t bv[4];
                frag_b2_kn(bv, vb, LDS, 0, col0 + np * 16, lane);
                mma_bf16_16816(oacc[2 * np], pa, bv);
                mma_bf16_16816(oacc[2 * np + 1], pa, bv + 2);
            }
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int row = g + 8 * hr;
        float l = lrun[hr];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        if (t == 0) {
            sRedL[w * 32 + row] = l;
            if (w == 0) sMf[row] = mrun[hr];
        }
    }
    __syncthreads();
    const size_t pb0 = ((size_t)b * a.nsplit + split) * a.H;
    if (tid < 16 && tid < a.H) {
        float l = sRedL[tid];
#pragma unroll
        for (int i = 1; i < 8; i++) l += sRedL[i * 32 + tid];
        a.pm[pb0 + tid] = sMf[tid];
        a.pl[pb0 + tid] = l;
    }
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int row = g + 8 * hr;
        if (row < a.H) {
            float *dst = a.pacc + (pb0 + row) * a.dc + col0 + 2 * t;
#pragma unroll
            for (int nt = 0; nt < NTW; nt++)
                *reinterpret_cast<float2 *>(dst + nt * 8) =
                    make_float2(oacc[nt][2 * hr], oacc[nt][2 * hr + 1]);
        }
    }
}

// ---- absorbed decode: the query absorption, and the merge with the value up-projection -------

#define ABS_COLS 32  // columns of W_UK per block (one warp's coalesced 128 B)
#define ABS_NS 8     // slices of the dn sum per block: 256 threads = ABS_COLS x ABS_NS
#define ABS_BT 16    // sequences per block (W_UK read once for all of them)
// dn padded so that each slice holds a multiple of 4 (q^n read as float4)
__host__ __device__ static inline int absorb_dnp_(int dn) { return ((dn + 4 * ABS_NS - 1) / (4 * ABS_NS)) * 4 * ABS_NS; }
static size_t absorb_smem_(int dn) {
    return sizeof(float) * ((size_t)ABS_BT * absorb_dnp_(dn) + (ABS_NS - 1) * ABS_BT * ABS_COLS);
}

// qt[b][h] = [q^n_{b,h} W_UK,h ; q^r_{b,h}] (fp32; docs/model.md §3). grid (H ceil(dc / 32),
// ceil(B / 16)), 256 threads. Thread (slice sl, column c) sums n in slice sl of dn (dnp / 8
// values, 4 at a time: one float4 of each sequence's q^n from shared memory per 4 products) for
// the block's nb <= 16 sequences; W_UK,h is read once per block, coalesced, 16 loads in flight.
// The 8 slice sums are added in slice order (deterministic). The first column tile's blocks also
// copy the rope slice q^r. One launch instead of a cuBLAS batched GEMM plus a copy
// (docs/kernel-lab.md).
__global__ void __launch_bounds__(256, 2) mla_absorb_q_k(int B, int H, int dn, int dr, int dv, int dc,
                                                      const float *q, const float *W, float *qt) {
    extern __shared__ __align__(16) float abs_sm[];  // sq [ABS_BT][dnp], part [ABS_NS-1][ABS_BT][ABS_COLS]
    pdl_trigger();  // the attention kernel's blocks may take SMs as these leave
    const int dnp = absorb_dnp_(dn);
    float *sq = abs_sm, *part = abs_sm + (size_t)ABS_BT * dnp;
    const int nct = (dc + ABS_COLS - 1) / ABS_COLS;
    const int h = blockIdx.x / nct, ct = blockIdx.x - h * nct;
    const int b0 = blockIdx.y * ABS_BT, nb = B - b0 < ABS_BT ? B - b0 : ABS_BT;
    const size_t ldq = (size_t)H * (dn + dr), Dk = (size_t)dc + dr;
    const float *qh = q + (size_t)b0 * ldq + (size_t)h * (dn + dr);  // q^n of sequence b0, head h
    for (int i = threadIdx.x; i < nb * dnp; i += 256) {
        const int j = i / dnp, n = i - j * dnp;
        sq[i] = n < dn ? qh[(size_t)j * ldq + n] : 0.f;
    }
    __syncthreads();
    const int col = threadIdx.x % ABS_COLS, sl = threadIdx.x / ABS_COLS, c = ct * ABS_COLS + col;
    const int per = dnp / ABS_NS, n0 = sl * per;
    float acc[ABS_BT];
#pragma unroll
    for (int j = 0; j < ABS_BT; j++) acc[j] = 0.f;
    if (c < dc) {
        const float *w = W + (size_t)h * (dn + dv) * dc + c;  // W_UK,h column c
        for (int nc = n0; nc < n0 + per; nc += 16) {  // 16 loads in flight (one pass at dn <= 128)
            float x[16];
#pragma unroll
            for (int u = 0; u < 16; u++) x[u] = nc + u < n0 + per && nc + u < dn ? w[(size_t)(nc + u) * dc] : 0.f;
#pragma unroll
            for (int q4 = 0; q4 < 4; q4++) {
                if (nc + 4 * q4 >= n0 + per) break;
#pragma unroll
                for (int j = 0; j < ABS_BT; j++)
                    if (j < nb) {
                        const float4 y = *reinterpret_cast<const float4 *>(sq + j * dnp + nc + 4 * q4);
                        acc[j] = fmaf(y.x, x[4 * q4], fmaf(y.y, x[4 * q4 + 1],
                                      fmaf(y.z, x[4 * q4 + 2], fmaf(y.w, x[4 * q4 + 3], acc[j]))));
                    }
            }
        }
    }
    if (sl > 0)
#pragma unroll
        for (int j = 0; j < ABS_BT; j++)
            if (j < nb) part[((sl - 1) * ABS_BT + j) * ABS_COLS + col] = acc[j];
    __syncthreads();
    if (sl == 0 && c < dc)
        for (int j = 0; j < nb; j++) {
            float x = acc[j];
            for (int u = 0; u < ABS_NS - 1; u++) x += part[(u * ABS_BT + j) * ABS_COLS + col];
            qt[((size_t)(b0 + j) * H + h) * Dk + c] = x;
        }
    if (ct == 0)
        for (int i = threadIdx.x; i < nb * dr; i += 256) {
            const int j = i / dr, r = i - j * dr;
            qt[((size_t)(b0 + j) * H + h) * Dk + dc + r] = qh[(size_t)j * ldq + dn + r];
        }
}

#define MRG_T 1024    // threads of a merge block: 8 groups of 128
#define MRG_COLS 128  // columns of c* per block; a cluster of ceil(dc / 128) blocks spans dc
#define MRG_BT 32     // most sequences per block (a power of 2)
struct MrgArgs {
    int B, H, dn, dv, dc, nsplit, L, bt;
    float ms;  // 1 for base-2 maxima (v2), log2 e for natural ones (v1)
    const int *seq_len;
    const float *pm, *pl, *pacc, *W;
    float *a;
};
// Shared memory of the merge, in floats: W_UV slice [dv][128], weights [bt][nsplit] (rounded to
// 4 floats: the arrays after it are read as float4), group sums [max(8, bt)][128], c* [bt][128],
// partial a [bt][dv]; then the used split counts [MRG_BT] (int).
static size_t merge_w_floats_(int nsplit, int bt) { return ((size_t)bt * nsplit + 3) / 4 * 4; }
static size_t merge_smem_(int nsplit, int dv, int bt) {
    return sizeof(float) * ((size_t)dv * MRG_COLS + merge_w_floats_(nsplit, bt) +
                            (size_t)(bt > 8 ? bt : 8) * MRG_COLS + (size_t)bt * MRG_COLS + (size_t)bt * dv) +
           sizeof(int) * MRG_BT;
}

// a[b][h] = W_UV,h c*[b][h] with c* = Σ_s w_s O_s / Σ_s w_s l_s, w_s = 2^{(m_s − M) ms} over the
// used splits. grid (nct = ceil(dc / 128), H, ceil(B / bt)), clusters of nct blocks along x,
// 1024 threads; block ct owns columns 128 ct .. 128 ct + 127 of c* and of W_UV,h.
//  1. Before waiting for the attention kernel: its slice of W_UV,h into shared memory.
//  2. Warp j < nb: sequence b0 + j's M, then its weights w_s / Σ w_s l_s (lanes over splits,
//     xor trees).
//  3. c*: the 8 groups of 128 threads take gps = 8 / bt groups per sequence (bt <= 8) or bt / 8
//     sequences each (bt > 8); group u of a sequence sums O_s over s ≡ u (mod gps) in increasing
//     order (one column per thread); the group sums are added in group order.
//  4. Partial a over this block's columns, 8 sequences at a time: 8 threads per row v of W_UV,h
//     (16 columns each, from shared memory), an xor tree over the 8.
//  5. Across the cluster: block ct adds the partials of rows v in its share, block 0's first,
//     from distributed shared memory.
// Every order is fixed: the result is deterministic. Replaces a merge kernel, the c* round trip
// and a cuBLAS batched GEMM (W_UV read once per block, before the wait).
__global__ void __launch_bounds__(MRG_T) mla_decode_merge_uv_k(MrgArgs m) {
    extern __shared__ __align__(16) float mrg_sm[];
    const int nct = gridDim.x, ct = blockIdx.x, h = blockIdx.y, bt = m.bt, dv = m.dv, dc = m.dc;
    const int b0 = blockIdx.z * bt, nb = m.B - b0 < bt ? m.B - b0 : bt;
    const int ncol = dc - ct * MRG_COLS < MRG_COLS ? dc - ct * MRG_COLS : MRG_COLS;
    float *sWv = mrg_sm;                                    // [dv][128]
    float *sw = sWv + (size_t)dv * MRG_COLS;                // [bt][nsplit]
    float *part = sw + ((size_t)bt * m.nsplit + 3) / 4 * 4;  // [max(8, bt)][128] (merge_w_floats_)
    float *sc = part + (size_t)(bt > 8 ? bt : 8) * MRG_COLS;  // [bt][128]
    float *sa = sc + (size_t)bt * MRG_COLS;       // [bt][dv]
    int *sused = reinterpret_cast<int *>(sa + (size_t)bt * dv);  // [MRG_BT]
    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5, grp = tid >> 7, cl = tid & 127;

    const float *Wuv = m.W + ((size_t)h * (m.dn + dv) + m.dn) * dc + (size_t)ct * MRG_COLS;
#pragma unroll 16
    for (int i = tid; i < dv * MRG_COLS; i += MRG_T) {
        const int v = i >> 7, cc = i & 127;
        sWv[i] = cc < ncol ? Wuv[(size_t)v * dc + cc] : 0.f;
    }
    pdl_wait();  // the partials come from the kernel ahead

    if (wp < nb) {
        const int b = b0 + wp;
        int used = (m.seq_len[b] + m.L - 1) / m.L;
        if (used > m.nsplit) used = m.nsplit;
        const size_t base = (size_t)b * m.nsplit * m.H + h;  // + s H
        float mx = -INFINITY;
        for (int s = lane; s < used; s += 32) mx = fmaxf(mx, m.pm[base + (size_t)s * m.H]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float l = 0.f;
        for (int s = lane; s < used; s += 32) {
            const float wgt = exp2f((m.pm[base + (size_t)s * m.H] - mx) * m.ms);
            sw[wp * m.nsplit + s] = wgt;
            l = fmaf(m.pl[base + (size_t)s * m.H], wgt, l);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
        const float inv = 1.f / l;
        for (int s = lane; s < used; s += 32) sw[wp * m.nsplit + s] *= inv;
        if (lane == 0) sused[wp] = used;
    }
    __syncthreads();

    const int gps = bt < 8 ? 8 / bt : 1, u = grp % gps, spg = bt > 8 ? bt / 8 : 1;
    for (int jj = 0; jj < spg; jj++) {
        const int j = grp / gps + jj * (8 / gps);  // sequence j, its group u
        float acc = 0.f;
        if (j < nb && cl < ncol) {
            const int used = sused[j];
            const float *x = m.pacc + (((size_t)(b0 + j) * m.nsplit) * m.H + h) * dc + ct * MRG_COLS + cl;
            const float *wj = sw + j * m.nsplit;
#pragma unroll 8
            for (int s = u; s < used; s += gps) acc = fmaf(x[(size_t)s * m.H * dc], wj[s], acc);
        }
        part[(j * gps + u) * MRG_COLS + cl] = acc;
    }
    __syncthreads();
    for (int i = tid; i < nb * MRG_COLS; i += MRG_T) {  // c*[jj] = its groups' sums in order
        const int jj = i >> 7, c = i & 127;
        float x = part[jj * gps * MRG_COLS + c];
        for (int uu = 1; uu < gps; uu++) x += part[(jj * gps + uu) * MRG_COLS + c];
        sc[i] = x;  // zero beyond ncol: the partials there are zero
    }
    __syncthreads();

    const int sub = tid & 7;
    for (int j0 = 0; j0 < nb; j0 += 8)
        for (int v = tid >> 3; v < dv; v += MRG_T / 8) {
            float d[8];
#pragma unroll
            for (int jj = 0; jj < 8; jj++) d[jj] = 0.f;
#pragma unroll
            for (int i = 0; i < MRG_COLS / 32; i++) {
                const int c = 4 * sub + 32 * i;
                const float4 wv = *reinterpret_cast<const float4 *>(sWv + v * MRG_COLS + c);
#pragma unroll
                for (int jj = 0; jj < 8; jj++)
                    if (j0 + jj < nb) {
                        const float4 y = *reinterpret_cast<const float4 *>(sc + (j0 + jj) * MRG_COLS + c);
                        d[jj] = fmaf(wv.x, y.x, fmaf(wv.y, y.y, fmaf(wv.z, y.z, fmaf(wv.w, y.w, d[jj]))));
                    }
            }
#pragma unroll
            for (int jj = 0; jj < 8; jj++) {
                float y = d[jj];
                y += __shfl_xor_sync(0xffffffffu, y, 1);
                y += __shfl_xor_sync(0xffffffffu, y, 2);
                y += __shfl_xor_sync(0xffffffffu, y, 4);
                if (sub == 0 && j0 + jj < nb) sa[(j0 + jj) * dv + v] = y;
            }
        }
    if (nct > 1) {
        cluster_arrive();
        cluster_wait();
    } else {
        __syncthreads();
    }
    const int vper = (dv + nct - 1) / nct, v0 = ct * vper, v1 = dv < v0 + vper ? dv : v0 + vper;
    for (int i = tid; i < nb * vper; i += MRG_T) {
        const int jj = i / vper, v = v0 + (i - jj * vper);
        if (v < v1) {
            float x = sa[jj * dv + v];
            if (nct > 1) {
                x = ld_dsmem_f32(sa + jj * dv + v, 0);
                for (int r = 1; r < nct; r++) x += ld_dsmem_f32(sa + jj * dv + v, (unsigned)r);
            }
            m.a[((size_t)(b0 + jj) * m.H + h) * dv + v] = x;
        }
    }
    if (nct > 1) {  // no block leaves while another may still read its partials
        cluster_arrive();
        cluster_wait();
    }
}

typedef void (*dec2_kernel_t)(Dec2Args);
template <int MT, int NST>
static dec2_kernel_t dec2_pick_ntw_(int dc) {
    switch (dc) {
        case 128: return mla_decode2_k<MT, 2, NST>;
        case 256: return mla_decode2_k<MT, 4, NST>;
        case 512: return mla_decode2_k<MT, 8, NST>;
        default: return nullptr;
    }
}
static dec2_kernel_t dec2_pick_(int MT, int NST, int dc) {
    if (MT == 1) return NST == 5 ? dec2_pick_ntw_<1, 5>(dc) : dec2_pick_ntw_<1, 4>(dc);
    return NST == 5 ? dec2_pick_ntw_<2, 5>(dc) : dec2_pick_ntw_<2, 4>(dc);
}
// The register-Q̃ kernel for this shape, or nullptr: H <= 16 and (dc, dr) = (512, 64) (the
// model) or (128, 32) (a test shape).
static dec2_kernel_t dec2r_pick_(int H, int dc, int Dk) {
    if (H > 16) return nullptr;
    if (dc == 512 && Dk == 576) return mla_decode2r_k<36, 8>;
    if (dc == 128 && Dk == 160) return mla_decode2r_k<10, 2>;
    return nullptr;
}
// Stages for the v2 kernel at this shape: 5 when the shared memory allows, else 4, else 0.
static int dec2_stages_(const mtrl_cuda_ctx *c, int H, int Dk) {
    const int MT = H <= 16 ? 1 : 2;
    if (dec2_smem_(MT, 5, Dk) <= c->smem_optin) return 5;
    if (dec2_smem_(MT, 4, Dk) <= c->smem_optin) return 4;
    return 0;
}
// Keys per split: the multiple of 64 in [256, 8192] that minimises waves x (L + 128), a wave
// being one block on every SM and 128 keys the cost of a block's start, its partial results and
// their merge. Candidates: about 1 .. 16 waves of blocks.
static int dec2_split_len_(int B, int max_len, int sms) {
    if (sms < 1) sms = 1;
    long long bestL = 256;
    double best = 1e300;
    for (int wv = 1; wv <= 16; wv++) {
        long long want = (long long)wv * sms / B;
        if (want < 1) want = 1;
        long long L = (max_len + want - 1) / want;
        L = (L + 63) / 64 * 64;
        if (L < 256) L = 256;
        if (L > 8192) L = 8192;
        long long blocks = (long long)B * ((max_len + L - 1) / L);
        double cost = (double)((blocks + sms - 1) / sms) * (double)(L + 128);
        if (cost < best) {
            best = cost;
            bestL = L;
        }
    }
    return (int)bestL;
}

extern "C" int mtrl_mla_decode_version(mtrl_cuda_ctx *c, int H, int dr, int dc, int lat_type,
                                       int ld) {
    if (c->opts.decode == MTRL_KOPT_SIMT) return 1;
    const int Dk = dc + dr;
    if (lat_type != MTRL_BF16 || H < 1 || H > 32 || !(dc == 128 || dc == 256 || dc == 512) ||
        dr < 0 || Dk % 32 != 0 || Dk > 640 || ld < Dk || ld % 8 != 0)
        return 1;
    return dec2_stages_(c, H, Dk) ? 2 : 1;
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
    const int Dk = dc + dr;
    const int v2 = mtrl_mla_decode_version(c, H, dr, dc, lat_type, ld) == 2 &&
                   ((uintptr_t)lat & 15u) == 0 && B <= 65535;
    // v1: 256-key chunks; v2: splits of L keys. nch = splits per sequence (partials per split).
    const int L = v2 ? dec2_split_len_(B, max_len, c->sms) : DCH;
    const int nch = (max_len + L - 1) / L;
    ws_carver sz{nullptr, 0};
    sz.take<float>((size_t)B * H * Dk);
    sz.take<float>((size_t)B * nch * H * 2);
    sz.take<float>((size_t)B * nch * H * dc);
    ws_carver cv{(char *)mtrl_ctx_scratch(c, sz.off), 0};
    float *qt = cv.take<float>((size_t)B * H * Dk);
    float *pm = cv.take<float>((size_t)B * nch * H * 2), *pl = pm + (size_t)B * nch * H;
    float *pacc = cv.take<float>((size_t)B * nch * H * dc);
    // Three launches: absorption (ordinary launch: q may come from the kernel ahead), attention
    // and merge (programmatic dependent launches: each starts while the one ahead drains; the
    // attention kernel's first key loads overlap the absorption).
    const size_t sh_abs = absorb_smem_(dn);
    MTRL_CUDA_REQUIRE(sh_abs <= c->smem_optin, "dn=%d: absorption needs %zu B of shared memory", dn, sh_abs);
    set_smem(mla_absorb_q_k, sh_abs);
    mla_absorb_q_k<<<dim3(H * cdiv(dc, ABS_COLS), cdiv(B, ABS_BT)), 256, sh_abs, c->stream>>>(
        B, H, dn, dr, dv, dc, q, W_kvb, qt);
    CUDA_LAUNCH_CHECK();
    if (v2) {
        const int MT = H <= 16 ? 1 : 2, NST = dec2_stages_(c, H, Dk);
        dec2_kernel_t kern = dec2_pick_(MT, NST, dc);
        size_t sh = dec2_smem_(MT, NST, Dk);
        dec2_kernel_t kr = dec2r_pick_(H, dc, Dk);
        if (kr && dec2r_smem_(Dk) <= c->smem_optin) {
            kern = kr;
            sh = dec2r_smem_(Dk);
        }
        set_smem(kern, sh);
        Dec2Args da;
        da.H = H; da.Dk = Dk; da.dc = dc; da.ld = ld; da.L = L; da.nsplit = nch;
        da.sl2 = scale * LOG2E_F;
        da.qt = qt; da.lat = (const uint16_t *)lat; da.seq_start = seq_start; da.seq_len = seq_len;
        da.pm = pm; da.pl = pl; da.pacc = pacc;
        mtrl_launch_pdl(kern, dim3(nch, B), dim3(256), sh, c->stream, 1, da);
    } else {
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
    }
    // a[b][h] = W_UV,h c*[b][h]: clusters of nct blocks over dc, bt sequences per block: the
    // smallest power of 2 that fits all blocks in one wave (one 1024-thread block per SM; a wave
    // costs the block's chain of latencies, ~10 µs), if shared memory allows
    const int nct = (int)cdiv(dc, MRG_COLS);
    int bt = 1;
    while (bt < MRG_BT && (long long)nct * H * cdiv(B, bt) > c->sms && merge_smem_(nch, dv, 2 * bt) <= c->smem_optin)
        bt *= 2;
    const size_t sh_mrg = merge_smem_(nch, dv, bt);
    MTRL_CUDA_REQUIRE(sh_mrg <= c->smem_optin, "%d splits, dv=%d: the merge needs %zu B of shared memory",
                      nch, dv, sh_mrg);
    set_smem(mla_decode_merge_uv_k, sh_mrg);
    MrgArgs ma;
    ma.B = B; ma.H = H; ma.dn = dn; ma.dv = dv; ma.dc = dc; ma.nsplit = nch; ma.L = L; ma.bt = bt;
    ma.ms = v2 ? 1.f : LOG2E_F;
    ma.seq_len = seq_len; ma.pm = pm; ma.pl = pl; ma.pacc = pacc; ma.W = W_kvb; ma.a = a;
    mtrl_launch_pdl(mla_decode_merge_uv_k, dim3(nct, H, cdiv(B, bt)), dim3(MRG_T), sh_mrg, c->stream, nct, ma);
    return 0;
}
