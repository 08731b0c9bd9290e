// moe/experts_mma.cu: the MoE SwiGLU experts as grouped GEMMs of our own (kernels_cuda.h,
// "grouped experts"): every expert's rows in one launch per product, whatever the per-expert row
// counts (0 to many thousands, skewed), the segment offsets read from DEVICE memory (no host copy
// of the counts, so the launches are capturable in a CUDA graph), SwiGLU and its backward fused
// into the GEMM epilogues. Forward: 2 launches (u1 = X W1ᵀ and u3 = X W3ᵀ in one block with m =
// SiLU(u1) u3 in the epilogue; Y = m W2ᵀ). Backward: 4 (+ dY's bf16 rounding): dm = dY W2 with
// the SwiGLU backward in the epilogue (m, du1, du3; dm never stored), dX = du1 W1 + du3 W3 as one
// reduction over the two products, dW2 += dYᵀ m, and dW1 += du1ᵀ X with dW3 += du3ᵀ X in one
// launch.
//
// The kernel: 256 threads (8 warps, 2 along m x 4 along n) on a BM x BN output tile, operands
// through a 3-stage cp.async pipeline of 128-byte k-slices (64 bf16 or 32 fp32), mma.sync on
// tensor cores with fp32 accumulators: bf16 m16n8k16 (ldmatrix fragments), or TF32 m16n8k8 for
// fp32 operands (scalar fragment loads, rounded to TF32 with cvt.rna). Two kinds of tiles:
//   * row tiles (the activation GEMMs): output rows are an expert's rows, K and N fixed. The grid
//     is persistent (as many blocks as fit at once); each block first builds the prefix sum of the
//     experts' m-tiles, cdiv(rows_e, BM), from the device offsets into shared memory, then walks
//     the flattened (m-tile, n-tile) space with a grid stride, finding a tile's expert by binary
//     search. Every tile costs the same (K fixed), so skew costs no balance; an empty expert has
//     no tiles. BM (32, 64 or 128) follows the mean rows per expert, so small experts waste
//     little of the tensor-core tile (at 16 rows the weights are read once, the kernel is bound
//     by their bytes).
//   * weight-gradient tiles: a fixed output [M][N] per expert, K = the expert's rows (varying).
//     One block per (expert, tile) in the ordinary grid (the hardware hands blocks to SMs as they
//     free up); an empty expert's blocks return at once, leaving its gradient untouched.
// Every output element is written by one thread in a fixed order of k: results are
// bit-reproducible, no atomics.
//
// The row tiles on bf16 operands (the forward, the backward's dm and dX) have a second
// implementation for Hopper (wgmma fed by TMA, moe/sm90a/experts_wgmma.cu), chosen by the option
// moe (kernel_opts.h; grouped_kernel_ below).
#include <algorithm>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/moe/sm90a/experts_wgmma.cuh"

namespace {

constexpr int GT = 256;      // threads per block
constexpr int GST = 3;       // pipeline stages
constexpr int GKB = 128;     // bytes of k per stage of a k-contiguous tile
constexpr int GRS = GKB + 16;  // row stride of a k-contiguous tile in shared memory (bank-conflict free)
constexpr int GMAXE = 1024;  // experts a row-tile launch handles (the prefix lives in shared memory)

// What a launch computes (its operand layouts and epilogue).
enum Mode {
    FWD13 = 0,   // u1 = A B0ᵀ, u3 = A B1ᵀ (B [E][N][K]); u1, u3 fp32 and m = SiLU(u1) u3 (operand type)
    FWD2 = 1,    // C = A B0ᵀ (B [E][N][K]), fp32
    BWD_DM = 2,  // dm = A B0 (B [E][K][N]); epilogue: m, du1, du3 (operand type) from U[0], U[1]
    BWD_DX = 3,  // C = A0 B0 + A1 B1 (B [E][K][N]), fp32
    WGRAD = 4,   // C[p][e] = beta C[p][e] + A[p]_eᵀ B_e (A_e [rows][M], B_e [rows][N]), fp32
};

struct GArgs {
    const int *off;  // [E+1] device
    int E;
    int M;  // WGRAD: output rows (the width of A's rows)
    int N;  // output columns
    int K;  // row tiles: the reduction length (of each part for BWD_DX)
    const void *A[2];
    int lda;
    const void *B[2];
    int ldb;
    long long sB;  // row tiles: elements between experts' weight matrices
    float *C[2];
    int ldc;
    void *O[3];         // FWD13: m; BWD_DM: m, du1, du3 (row stride N)
    const float *U[2];  // BWD_DM: u1, u3 (row stride N)
    float beta;         // WGRAD
};

// ---- tensor-core helpers ----------------------------------------------------------------------

__device__ __forceinline__ uint32_t tf32_(float x) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}
// D = A B + D for one m16n8k8 tile, TF32 operands, fp32 accumulators (PTX ISA, "mma.m16n8k8" for
// .tf32; g = lane >> 2, t = lane & 3): a[0] = (g, t), a[1] = (g+8, t), a[2] = (g, t+4),
// a[3] = (g+8, t+4); b[0] = (k = t, n = g), b[1] = (k = t+4, n = g); C as mma_bf16_16816.
__device__ __forceinline__ void mma_tf32_1688(float *c, const uint32_t *a, const uint32_t *b) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// The A fragment (16 x 16 at (m0, k0)) of a k-major matrix (element (m, k) at A[k ld + m]), for
// ldsm_x4_t: matrix j = lane / 8 is (m0 + 8 (j & 1), k0 + 8 (j >> 1)), i.e. a[0..3] in order.
__device__ __forceinline__ const uint16_t *adr_a_km(const uint16_t *A, int ld, int k0, int m0, int lane) {
    return A + (k0 + (lane & 7) + ((lane >> 4) << 3)) * ld + m0 + (((lane >> 3) & 1) << 3);
}

// ---- tiles in shared memory ---------------------------------------------------------------------
//
// A k-contiguous tile (rows x one 128-byte k-slice) has row stride GRS; a k-major one (k-slice rows
// x cols) has row stride cols * es + kpad_ (16 bytes for bf16: ldmatrix rows on distinct banks;
// 32 for fp32: the scalar fragment loads (t ld + g) hit 32 distinct banks).

template <class T>
constexpr int kpad_() { return sizeof(T) == 2 ? 16 : 32; }
template <class T, int COLS>
constexpr int kmajor_stride_() { return COLS * (int)sizeof(T) + kpad_<T>(); }

// cp.async of an NR x NC tile (element (r, c) at g[r ld + c], NC * es a multiple of 16) into s
// (row stride ss bytes); rows >= rlim or 16-byte chunks at columns >= clim are zero-filled
// (clim is a multiple of 16 / es, so a chunk is either inside or outside). g is always a valid
// address (the tile's origin), used as the dummy source of filled chunks.
template <class T, int NR, int NC>
__device__ __forceinline__ void load_tile_(char *s, int ss, const T *g, long ld, int rlim, int clim) {
    constexpr int CH = 16 / (int)sizeof(T), CPR = NC / CH;
#pragma unroll 4
    for (int i = threadIdx.x; i < NR * CPR; i += GT) {
        int r = i / CPR, c = (i % CPR) * CH;
        bool ok = r < rlim && c < clim;
        cp_async16_pred(s + r * ss + c * (int)sizeof(T), ok ? g + (long)r * ld + c : g, ok);
    }
}

template <class T, int MODE>
struct Lay {
    static constexpr bool A_KMAJOR = MODE == WGRAD;                  // else k-contiguous rows
    static constexpr bool B_KMAJOR = MODE >= BWD_DM;                 // [K][N] (else [N][K])
    static constexpr int NB = MODE == FWD13 ? 2 : 1;                 // B tiles per stage
    static constexpr int BK = GKB / (int)sizeof(T);                  // k per stage
};

template <class T, int MODE, int BM, int BN>
constexpr int a_bytes_() {
    return Lay<T, MODE>::A_KMAJOR ? Lay<T, MODE>::BK * kmajor_stride_<T, BM>() : BM * GRS;
}
template <class T, int MODE, int BN>
constexpr int b_bytes_() {
    return Lay<T, MODE>::B_KMAJOR ? Lay<T, MODE>::BK * kmajor_stride_<T, BN>() : BN * GRS;
}
template <class T, int MODE, int BM, int BN>
constexpr int smem_bytes_() {
    return GST * (a_bytes_<T, MODE, BM, BN>() + Lay<T, MODE>::NB * b_bytes_<T, MODE, BN>());
}

// One k-slice of the warp's MI x NI tiles (of each of the NB accumulators) from the stage at sa, sb.
template <class T, int MODE, int BM, int BN, int MI, int NI>
__device__ __forceinline__ void mma_slice_(const char *sa, const char *sb, int wm0, int wn0,
                                           float (&acc)[Lay<T, MODE>::NB][MI][NI][4]) {
    using L = Lay<T, MODE>;
    constexpr int NB = L::NB, BK = L::BK;
    const int lane = threadIdx.x & 31;
    if constexpr (sizeof(T) == 2) {
        const uint16_t *A = (const uint16_t *)sa;
#pragma unroll
        for (int k0 = 0; k0 < BK; k0 += 16) {
            uint32_t a[MI][4];
#pragma unroll
            for (int i = 0; i < MI; i++) {
                if constexpr (L::A_KMAJOR)
                    ldsm_x4_t(a[i], adr_a_km(A, kmajor_stride_<T, BM>() / 2, k0, wm0 + 16 * i, lane));
                else
                    ldsm_x4(a[i], adr_a(A + (wm0 + 16 * i) * (GRS / 2), GRS / 2, k0, lane));
            }
#pragma unroll
            for (int nb = 0; nb < NB; nb++) {
                const uint16_t *B = (const uint16_t *)(sb + nb * b_bytes_<T, MODE, BN>());
                uint32_t b[NI][2];
#pragma unroll
                for (int j = 0; j < NI; j += 2) {
                    uint32_t r[4];
                    if constexpr (L::B_KMAJOR)
                        ldsm_x4_t(r, adr_b_kn(B, kmajor_stride_<T, BN>() / 2, k0, wn0 + 8 * j, lane));
                    else
                        ldsm_x4(r, adr_b_nk(B, GRS / 2, k0, wn0 + 8 * j, lane));
                    b[j][0] = r[0];
                    b[j][1] = r[1];
                    b[j + 1][0] = r[2];
                    b[j + 1][1] = r[3];
                }
#pragma unroll
                for (int i = 0; i < MI; i++)
#pragma unroll
                    for (int j = 0; j < NI; j++) mma_bf16_16816(acc[nb][i][j], a[i], b[j]);
            }
        }
    } else {
        const float *A = (const float *)sa;
        const int g = lane >> 2, t = lane & 3;
        // element (m, k) of the A tile, (n, k) of a B tile
        auto ea = [&](int m, int k) {
            return L::A_KMAJOR ? A[k * (kmajor_stride_<T, BM>() / 4) + m] : A[m * (GRS / 4) + k];
        };
#pragma unroll
        for (int k0 = 0; k0 < BK; k0 += 8) {
            uint32_t a[MI][4];
#pragma unroll
            for (int i = 0; i < MI; i++) {
                int m = wm0 + 16 * i + g;
                a[i][0] = tf32_(ea(m, k0 + t));
                a[i][1] = tf32_(ea(m + 8, k0 + t));
                a[i][2] = tf32_(ea(m, k0 + t + 4));
                a[i][3] = tf32_(ea(m + 8, k0 + t + 4));
            }
#pragma unroll
            for (int nb = 0; nb < NB; nb++) {
                const float *B = (const float *)(sb + nb * b_bytes_<T, MODE, BN>());
                auto eb = [&](int n, int k) {
                    return L::B_KMAJOR ? B[k * (kmajor_stride_<T, BN>() / 4) + n] : B[n * (GRS / 4) + k];
                };
                uint32_t b[NI][2];
#pragma unroll
                for (int j = 0; j < NI; j++) {
                    int n = wn0 + 8 * j + g;
                    b[j][0] = tf32_(eb(n, k0 + t));
                    b[j][1] = tf32_(eb(n, k0 + t + 4));
                }
#pragma unroll
                for (int i = 0; i < MI; i++)
#pragma unroll
                    for (int j = 0; j < NI; j++) mma_tf32_1688(acc[nb][i][j], a[i], b[j]);
            }
        }
    }
}

__device__ __forceinline__ void store2_(float *p, float a, float b) { *(float2 *)p = make_float2(a, b); }
__device__ __forceinline__ void store2_(uint16_t *p, float a, float b) { *(uint32_t *)p = pack_bf16(a, b); }

// The epilogue of one output pair (columns col, col + 1 of row `row`; rows of the expert's
// segment or of the weight gradient): v[nb][0..1] are the accumulators.
template <class T, int MODE>
__device__ __forceinline__ void epilogue2_(const GArgs &a, long row, int col, const float (*v)[2], float *cw) {
    if constexpr (MODE == FWD13) {
        long i = row * a.N + col;
        store2_(a.C[0] + i, v[0][0], v[0][1]);
        store2_(a.C[1] + i, v[1][0], v[1][1]);
        float m0 = v[0][0] * sigmoid_acc(v[0][0]) * v[1][0], m1 = v[0][1] * sigmoid_acc(v[0][1]) * v[1][1];
        store2_((T *)a.O[0] + i, m0, m1);
    } else if constexpr (MODE == BWD_DM) {
        long i = row * a.N + col;
        float2 u1 = *(const float2 *)(a.U[0] + i), u3 = *(const float2 *)(a.U[1] + i);
        float m[2], d1[2], d3[2];
        float ua[2] = {u1.x, u1.y}, ub[2] = {u3.x, u3.y};
#pragma unroll
        for (int h = 0; h < 2; h++) {  // as moe_swiglu_bwd_k
            float x = ua[h], y = ub[h], sg = sigmoid_acc(x), silu = x * sg, gd = v[0][h];
            m[h] = silu * y;
            d3[h] = gd * silu;
            d1[h] = gd * y * sg * (1.f + x * (1.f - sg));
        }
        store2_((T *)a.O[0] + i, m[0], m[1]);
        store2_((T *)a.O[1] + i, d1[0], d1[1]);
        store2_((T *)a.O[2] + i, d3[0], d3[1]);
    } else if constexpr (MODE == WGRAD) {
        float *p = cw + row * a.ldc + col;
        float2 o = a.beta != 0.f ? *(const float2 *)p : make_float2(0.f, 0.f);
        store2_(p, v[0][0] + a.beta * o.x, v[0][1] + a.beta * o.y);
    } else {
        store2_(a.C[0] + row * a.ldc + col, v[0][0], v[0][1]);
    }
}

// The main loop over nk k-slices (issue(stage, kt) queues slice kt's copies), then the epilogue
// of every valid (row < rows, col < N) output pair; rows are relative to row_base; cw: WGRAD's
// output matrix (this expert's).
template <class T, int MODE, int BM, int BN, class Issue>
__device__ __forceinline__ void tile_(const GArgs &a, char *smem, int nk, Issue &&issue, long row_base,
                                      int m0, int rows, int n0, float *cw) {
    using L = Lay<T, MODE>;
    constexpr int NB = L::NB, WM = BM / 2, WN = BN / 4, MI = WM / 16, NI = WN / 8;
    constexpr int AB = a_bytes_<T, MODE, BM, BN>(), BB = b_bytes_<T, MODE, BN>(), SB = AB + NB * BB;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wm0 = (warp >> 2) * WM, wn0 = (warp & 3) * WN;
    float acc[NB][MI][NI][4];
#pragma unroll
    for (int nb = 0; nb < NB; nb++)
#pragma unroll
        for (int i = 0; i < MI; i++)
#pragma unroll
            for (int j = 0; j < NI; j++)
#pragma unroll
                for (int q = 0; q < 4; q++) acc[nb][i][j][q] = 0.f;
#pragma unroll
    for (int s = 0; s < GST - 1; s++) {
        if (s < nk) issue(smem + s * SB, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < nk; kt++) {
        cp_async_wait<GST - 2>();
        __syncthreads();  // slice kt landed for every thread; the stage written next is free
        if (kt + GST - 1 < nk) issue(smem + ((kt + GST - 1) % GST) * SB, kt + GST - 1);
        cp_async_commit();
        const char *st = smem + (kt % GST) * SB;
        mma_slice_<T, MODE, BM, BN, MI, NI>(st, st + AB, wm0, wn0, acc);
    }
    cp_async_wait<0>();
    __syncthreads();  // the next tile's prologue overwrites the stages
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int r = m0 + wm0 + 16 * i + g + 8 * h;
            if (r >= rows) continue;
#pragma unroll
            for (int j = 0; j < NI; j++) {
                int col = n0 + wn0 + 8 * j + 2 * t;
                if (col >= a.N) continue;
                float v[NB][2];
#pragma unroll
                for (int nb = 0; nb < NB; nb++) {
                    v[nb][0] = acc[nb][i][j][2 * h];
                    v[nb][1] = acc[nb][i][j][2 * h + 1];
                }
                epilogue2_<T, MODE>(a, row_base + r, col, v, cw);
            }
        }
}

// Row tiles (FWD13, FWD2, BWD_DM, BWD_DX): persistent over the (m-tile, n-tile) space.
template <class T, int MODE, int BM, int BN>
__global__ void __launch_bounds__(GT, 2) grouped_rows_k(GArgs a) {
    using L = Lay<T, MODE>;
    constexpr int BK = L::BK;
    extern __shared__ __align__(128) char gsm[];
    __shared__ int pre[GMAXE + 1];  // pre[e]: m-tiles of the experts before e
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp == 0) {
        int per = (a.E + 31) / 32, lo = lane * per, hi = min(a.E, lo + per), sum = 0;
        for (int e = lo; e < hi; e++) sum += (a.off[e + 1] - a.off[e] + BM - 1) / BM;
        int inc = sum;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            int v = __shfl_up_sync(0xffffffffu, inc, o);
            if (lane >= o) inc += v;
        }
        int run = inc - sum;
        for (int e = lo; e < hi; e++) {
            pre[e] = run;
            run += (a.off[e + 1] - a.off[e] + BM - 1) / BM;
        }
        if (lane == 31) pre[a.E] = inc;
    }
    __syncthreads();
    const int ntn = (a.N + BN - 1) / BN, nk1 = (a.K + BK - 1) / BK, nk = MODE == BWD_DX ? 2 * nk1 : nk1;
    const long total = (long)pre[a.E] * ntn;
    for (long tile = blockIdx.x; tile < total; tile += gridDim.x) {
        int mt = (int)(tile / ntn), n0 = (int)(tile % ntn) * BN;
        int lo = 0, hi = a.E - 1;  // the last expert whose first m-tile is <= mt
        while (lo < hi) {
            int mid = (lo + hi + 1) >> 1;
            if (pre[mid] <= mt) lo = mid;
            else hi = mid - 1;
        }
        const int e = lo, r0 = a.off[e], rows = a.off[e + 1] - r0, m0 = (mt - pre[e]) * BM;
        auto issue = [&](char *st, int kt) {
            int part = MODE == BWD_DX && kt >= nk1, k0 = (kt - part * nk1) * BK;
            const T *A = (const T *)a.A[part] + ((long)r0 + m0) * a.lda + k0;
            load_tile_<T, BM, BK>(st, GRS, A, a.lda, rows - m0, a.K - k0);
            char *sb = st + a_bytes_<T, MODE, BM, BN>();
#pragma unroll
            for (int nb = 0; nb < L::NB; nb++) {
                const T *B = (const T *)a.B[MODE == BWD_DX ? part : nb] + (long long)e * a.sB;
                char *s = sb + nb * b_bytes_<T, MODE, BN>();
                if constexpr (L::B_KMAJOR)
                    load_tile_<T, BK, BN>(s, kmajor_stride_<T, BN>(), B + (long)k0 * a.ldb + n0, a.ldb, a.K - k0,
                                          a.N - n0);
                else
                    load_tile_<T, BN, BK>(s, GRS, B + (long)n0 * a.ldb + k0, a.ldb, a.N - n0, a.K - k0);
            }
        };
        tile_<T, MODE, BM, BN>(a, gsm, nk, issue, r0, m0, rows, n0, nullptr);
    }
}

// Weight-gradient tiles: blockIdx.x = (expert, m-tile, n-tile), blockIdx.y = pair.
template <class T, int BM, int BN>
__global__ void __launch_bounds__(GT, 2) grouped_wgrad_k(GArgs a) {
    constexpr int BK = Lay<T, WGRAD>::BK;
    extern __shared__ __align__(128) char gsm[];
    const int p = blockIdx.y, ntm = (a.M + BM - 1) / BM, ntn = (a.N + BN - 1) / BN;
    const int e = blockIdx.x / (ntm * ntn), rem = blockIdx.x % (ntm * ntn);
    const int m0 = rem / ntn * BM, n0 = rem % ntn * BN;
    const int r0 = a.off[e], rows = a.off[e + 1] - r0;
    if (rows <= 0) return;  // an empty expert: its gradient stays as it is
    auto issue = [&](char *st, int kt) {
        int k0 = kt * BK;
        const T *A = (const T *)a.A[p] + ((long)r0 + k0) * a.lda + m0;
        load_tile_<T, BK, BM>(st, kmajor_stride_<T, BM>(), A, a.lda, rows - k0, a.M - m0);
        const T *B = (const T *)a.B[0] + ((long)r0 + k0) * a.ldb + n0;
        load_tile_<T, BK, BN>(st + a_bytes_<T, WGRAD, BM, BN>(), kmajor_stride_<T, BN>(), B, a.ldb, rows - k0,
                              a.N - n0);
    };
    tile_<T, WGRAD, BM, BN>(a, gsm, (rows + BK - 1) / BK, issue, 0, m0, a.M, n0,
                            a.C[p] + (size_t)e * a.M * a.N);
}

// ---- launch -------------------------------------------------------------------------------------

// Blocks of a kernel resident on one SM (cached per kernel instance).
template <class K>
int resident_(K kernel, int smem) {
    int n = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, GT, smem));
    return n > 0 ? n : 1;
}

template <class T, int MODE, int BM, int BN>
void launch_rows_(mtrl_cuda_ctx *c, const GArgs &a, long R) {
    constexpr int sm = smem_bytes_<T, MODE, BM, BN>();
    auto k = grouped_rows_k<T, MODE, BM, BN>;
    static int occ = 0;  // per instance; a benign race (every thread computes the same value)
    if (!occ) {
        set_smem(k, sm);
        occ = resident_(k, sm);
    }
    long ntn = (a.N + BN - 1) / BN, mt = (R + BM - 1) / BM + a.E;  // >= Σ cdiv(rows_e, BM)
    long grid = std::min(mt * ntn, (long)c->sms * occ);
    k<<<(unsigned)grid, GT, sm, c->stream>>>(a);
    CUDA_LAUNCH_CHECK();
}

// BM follows the mean rows per expert (a tile mostly full; see the header).
template <class T, int MODE, int BN>
void launch_rows_bm_(mtrl_cuda_ctx *c, const GArgs &a, long R) {
    long mean = R / a.E;
    if (mean <= 32) launch_rows_<T, MODE, 32, BN>(c, a, R);
    else if (mean <= 64) launch_rows_<T, MODE, 64, BN>(c, a, R);
    else launch_rows_<T, MODE, 128, BN>(c, a, R);
}

template <int MODE, int BN>
void launch_rows_t_(mtrl_cuda_ctx *c, const GArgs &a, long R, int type) {
    if (type == MTRL_BF16) launch_rows_bm_<uint16_t, MODE, BN>(c, a, R);
    else launch_rows_bm_<float, MODE, BN>(c, a, R);
}

template <class T>
void launch_wgrad_t_(mtrl_cuda_ctx *c, const GArgs &a, int pairs) {
    constexpr int BM = 128, BN = 128, sm = smem_bytes_<T, WGRAD, BM, BN>();
    auto k = grouped_wgrad_k<T, BM, BN>;
    set_smem(k, sm);
    unsigned tiles = (unsigned)(a.E * ((a.M + BM - 1) / BM) * ((a.N + BN - 1) / BN));
    k<<<dim3(tiles, pairs), GT, sm, c->stream>>>(a);
    CUDA_LAUNCH_CHECK();
}
void launch_wgrad_(mtrl_cuda_ctx *c, const GArgs &a, int pairs, int type) {
    if (type == MTRL_BF16) launch_wgrad_t_<uint16_t>(c, a, pairs);
    else launch_wgrad_t_<float>(c, a, pairs);
}

bool aligned16_(const void *p) { return ((uintptr_t)p & 15) == 0; }

// FWD2's arguments: C [R][N] = A_e [rows][K] B[e]ᵀ, B [E][N][K].
GArgs nt_args_(int E, const int *off, int N, int K, const void *A, const void *B, float *C) {
    GArgs a = {};
    a.off = off, a.E = E, a.N = N, a.K = K;
    a.A[0] = A, a.lda = K;
    a.B[0] = B, a.ldb = K, a.sB = (long long)N * K;
    a.C[0] = C, a.ldc = N;
    return a;
}

}  // namespace

// ---- entry points (kernels_cuda.h) ----------------------------------------------------------------

// Which path runs the experts, as `mtrl bench ops --device cuda --only moe` measured both paths
// at 16 .. 8192 rows per expert, balanced and skewed, bf16 and TF32 (docs/perf.md):
//   * true fp32 (fp32 operands on a context without TF32): the stream lanes. Our kernel multiplies
//     fp32 operands as TF32 only; cuBLAS keeps the fp32 products the GPU tests compare at 1e-5.
//   * one expert (the dense SwiGLU FFN): one cuBLAS chain, nothing to group.
//   * widths not multiples of 8 (16-byte rows) or more than 1024 experts: the kernel's limits.
//   * by the mean work of one expert's GEMM, rows x D x I. The grouped kernel (mma.sync, ~280
//     TFLOP/s at most) wins wherever launches dominate: 10-12x at 16 rows, 5-9x at 128, and at
//     1024 rows of `small`'s 1024 -> 512 (5.4e8: 3.1 vs 5.3 ms bf16); cuBLAS's Hopper kernels on
//     the lanes win from 1024 rows of 2048 -> 1024 (2.1e9: 10.9 vs 7.0 ms) and at 8192 rows of
//     either (4.3e9: 23 vs 16 ms). The crossover lies between 5.4e8 and 2.1e9: 1e9.
#define MTRL_MOE_GROUPED_MAX_WORK 1e9

extern "C" int mtrl_moe_experts_path(const mtrl_cuda_ctx *c, int E, int D, int I, long R, int type) {
    if (type == MTRL_F32 && !c->tf32) return MTRL_MOE_LANES;
    if (E <= 1 || E > GMAXE || D % 8 || I % 8) return MTRL_MOE_LANES;
    if ((double)R / E * D * I >= MTRL_MOE_GROUPED_MAX_WORK) return MTRL_MOE_LANES;
    return MTRL_MOE_GROUPED;
}

// The row GEMMs' kernel for bf16 operands (kernel_opts.h, moe): wgmma (sm_90a, compute
// capability 9.0 only) above MTRL_MOE_WGMMA_MIN_MEAN rows per expert on average under AUTO, where
// the mma kernel's tiles are 128 rows too (so the two waste the same part of a tile on ragged
// experts, and wgmma multiplies ~2.5x faster); below, at decode's few rows per expert, the mma
// kernel's 32- and 64-row tiles read each expert's weights with less padding.
#define MTRL_MOE_WGMMA_MIN_MEAN 64

static int grouped_kernel_(const mtrl_cuda_ctx *c, int E, long R, int type) {
    if (type != MTRL_BF16 || c->cc != 90 || E > MOE_WG_MAXE || c->opts.moe == MTRL_KOPT_MMA) return MTRL_KOPT_MMA;
    if (c->opts.moe == MTRL_KOPT_WGMMA || R > (long)MTRL_MOE_WGMMA_MIN_MEAN * E) return MTRL_KOPT_WGMMA;
    return MTRL_KOPT_MMA;
}

extern "C" int mtrl_moe_grouped_kernel(const mtrl_cuda_ctx *c, int E, long R, int type) {
    return grouped_kernel_(c, E, R, type);
}

extern "C" int mtrl_moe_experts_fwd_path(const mtrl_cuda_ctx *c, int E, int D, int I, long R, int type) {
    if (E > 1 && E <= GMAXE && D % 8 == 0 && I % 8 == 0 && grouped_kernel_(c, E, R, type) == MTRL_KOPT_WGMMA)
        return MTRL_MOE_GROUPED;
    return mtrl_moe_experts_path(c, E, D, I, R, type);
}

#define GROUPED_REQUIRE_(E, D, I, R, type, ...)                                                             \
    MTRL_CUDA_REQUIRE((E) >= 1 && (E) <= GMAXE && (D) >= 8 && (I) >= 8 && (D) % 8 == 0 && (I) % 8 == 0 &&   \
                          (R) >= 0 && (R) < (1l << 31) && ((type) == MTRL_F32 || (type) == MTRL_BF16),      \
                      "E=%d D=%d I=%d R=%ld type=%d", (E), (D), (I), (long)(R), (type));                   \
    {                                                                                                       \
        const void *ps_[] = {__VA_ARGS__};                                                                  \
        for (const void *p_ : ps_) MTRL_CUDA_REQUIRE(aligned16_(p_), "an operand is not 16-byte aligned"); \
    }

extern "C" int mtrl_moe_grouped_gemm(mtrl_cuda_ctx *c, int E, long R, const int *offsets, int N, int K,
                                     const void *A, const void *B, int type, float *C) {
    GROUPED_REQUIRE_(E, N, K, R, type, A, B, C);
    if (!R) return 0;
    if (grouped_kernel_(c, E, R, type) == MTRL_KOPT_WGMMA && !moe_wg_fwd2(c, E, N, K, R, offsets, A, B, C))
        return 0;
    launch_rows_t_<FWD2, 128>(c, nt_args_(E, offsets, N, K, A, B, C), R, type);
    return 0;
}

extern "C" int mtrl_moe_grouped_gemm_bf16(mtrl_cuda_ctx *c, int E, long R, const int *offsets, int N, int K,
                                          const void *A, const void *B, void *C) {
    GROUPED_REQUIRE_(E, N, K, R, MTRL_BF16, A, B, C);
    if (!R) return 0;
    if (grouped_kernel_(c, E, R, MTRL_BF16) != MTRL_KOPT_WGMMA) return 1;
    return moe_wg_fwd2_bf16(c, E, N, K, R, offsets, A, B, C);
}

extern "C" int mtrl_moe_experts_grouped_fwd(mtrl_cuda_ctx *c, int E, int D, int I, long R, const int *offsets,
                                            const void *X_perm, const void *W1, const void *W3, const void *W2,
                                            int type, float *u1, float *u3, float *Y_perm) {
    GROUPED_REQUIRE_(E, D, I, R, type, X_perm, W1, W3, W2, u1, u3, Y_perm);
    if (!R) return 0;
    size_t es = type == MTRL_BF16 ? 2 : 4;
    void *m = mtrl_ctx_scratch(c, (size_t)R * I * es);
    if (grouped_kernel_(c, E, R, type) == MTRL_KOPT_WGMMA &&
        !moe_wg_fwd13(c, E, I, D, R, offsets, X_perm, W1, W3, u1, u3, m)) {
        if (moe_wg_fwd2(c, E, D, I, R, offsets, m, W2, Y_perm))
            launch_rows_t_<FWD2, 128>(c, nt_args_(E, offsets, D, I, m, W2, Y_perm), R, type);
        return 0;
    }
    GArgs a = {};
    a.off = offsets, a.E = E, a.N = I, a.K = D;
    a.A[0] = X_perm, a.lda = D;
    a.B[0] = W1, a.B[1] = W3, a.ldb = D, a.sB = (long long)I * D;
    a.C[0] = u1, a.C[1] = u3, a.ldc = I;
    a.O[0] = m;
    launch_rows_t_<FWD13, 64>(c, a, R, type);
    launch_rows_t_<FWD2, 128>(c, nt_args_(E, offsets, D, I, m, W2, Y_perm), R, type);
    return 0;
}

extern "C" int mtrl_moe_experts_grouped_bwd(mtrl_cuda_ctx *c, int E, int D, int I, long R, const int *offsets,
                                            const void *X_perm, const void *W1, const void *W3, const void *W2,
                                            int type, const float *u1, const float *u3, const float *dY_perm,
                                            float *dX_perm, float *dW1, float *dW3, float *dW2) {
    GROUPED_REQUIRE_(E, D, I, R, type, X_perm, W1, W3, W2, u1, u3, dY_perm, dX_perm, dW1, dW3, dW2);
    if (!R) return 0;
    size_t es = type == MTRL_BF16 ? 2 : 4;
    // dY in the operand type (bf16: rounded into the scratch), then m, du1, du3
    ws_carver sz{nullptr, 0};
    if (type == MTRL_BF16) sz.take<char>((size_t)R * D * es);
    sz.take<char>(3 * (size_t)R * I * es);
    ws_carver cv{(char *)mtrl_ctx_scratch(c, sz.off), 0};
    const void *dY = dY_perm;
    if (type == MTRL_BF16) {
        mtrl_bf16 *h = (mtrl_bf16 *)cv.take<char>((size_t)R * D * es);
        mtrl_cuda_f32_to_bf16(c, (size_t)R * D, dY_perm, h);
        dY = h;
    }
    char *m = cv.take<char>(3 * (size_t)R * I * es), *du1 = m + (size_t)R * I * es, *du3 = du1 + (size_t)R * I * es;
    GArgs a = {};  // dm = dY W2[e] -> m, du1, du3
    a.off = offsets, a.E = E, a.N = I, a.K = D;
    a.A[0] = dY, a.lda = D;
    a.B[0] = W2, a.ldb = I, a.sB = (long long)D * I;
    a.U[0] = u1, a.U[1] = u3;
    a.O[0] = m, a.O[1] = du1, a.O[2] = du3;
    const bool wg = grouped_kernel_(c, E, R, type) == MTRL_KOPT_WGMMA;
    if (!wg || moe_wg_bwd_dm(c, E, I, D, R, offsets, dY, W2, u1, u3, m, du1, du3)) launch_rows_t_<BWD_DM, 128>(c, a, R, type);
    GArgs b = {};  // dX = du1 W1[e] + du3 W3[e]
    b.off = offsets, b.E = E, b.N = D, b.K = I;
    b.A[0] = du1, b.A[1] = du3, b.lda = I;
    b.B[0] = W1, b.B[1] = W3, b.ldb = D, b.sB = (long long)I * D;
    b.C[0] = dX_perm, b.ldc = D;
    if (!wg || moe_wg_bwd_dx(c, E, D, I, R, offsets, du1, du3, W1, W3, dX_perm)) launch_rows_t_<BWD_DX, 128>(c, b, R, type);
    if (dW2) {  // dW2[e] += dYᵀ m
        GArgs w = {};
        w.off = offsets, w.E = E, w.M = D, w.N = I, w.beta = 1.f;
        w.A[0] = dY, w.lda = D;
        w.B[0] = m, w.ldb = I;
        w.C[0] = dW2, w.ldc = I;
        launch_wgrad_(c, w, 1, type);
    }
    if (dW1 || dW3) {  // dW1[e] += du1ᵀ X, dW3[e] += du3ᵀ X (one launch, a pair each)
        GArgs w = {};
        w.off = offsets, w.E = E, w.M = I, w.N = D, w.beta = 1.f;
        int p = 0;
        if (dW1) w.A[p] = du1, w.C[p++] = dW1;
        if (dW3) w.A[p] = du3, w.C[p++] = dW3;
        w.lda = I;
        w.B[0] = X_perm, w.ldb = D;
        w.ldc = D;
        launch_wgrad_(c, w, p, type);
    }
    return 0;
}
