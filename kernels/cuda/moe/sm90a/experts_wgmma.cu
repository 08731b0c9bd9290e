// moe/sm90a/experts_wgmma.cu: the MoE experts' row GEMMs (an expert's rows out) as grouped GEMMs
// on Hopper's warpgroup MMA (wgmma.cuh) fed by bulk tensor copies (TMA), for 128 rows per expert
// and more, where the mma.sync kernels of moe/experts_mma.cu stop at ~280 TFLOP/s. The products,
// as theirs:
//   FWD13: u1 = X W1[e]ᵀ and u3 = X W3[e]ᵀ in one tile (128 columns of each), SwiGLU in the
//          epilogue: u1, u3 fp32 and m = SiLU(u1) u3 bf16.
//   FWD2:  C = A B[e]ᵀ (Y = m W2[e]ᵀ, or one grouped GEMM), fp32, 256 columns a tile.
//   FWD2H: the same product stored as bf16 (torch._grouped_mm's contract: half the bytes out).
//   BDM:   dm = dY W2[e] with the SwiGLU backward in the epilogue (reads u1, u3; writes m, du1,
//          du3 bf16; dm is never stored), 256 columns a tile.
//   BDX:   dX = du1 W1[e] + du3 W3[e], one reduction over both products, fp32.
// The expert's rows of A are contiguous (tokens already permuted) and K-contiguous: A is K-major
// for wgmma, one 2D tensor map [R][K] covers it. The forward's weights [E][N][K] are K-major too
// (map [E N][K]); the backward's [E][K][N] are read as they lie, MN-major (wgmma's transpose of
// B; map [E K][N]). The weight gradients (K = an expert's rows) stay on the mma kernels.
//
// Block (384 threads, one per SM, persistent): warpgroups 0 and 1 consume, warpgroup 2 produces
// (one thread issues the copies; the warpgroup gives its registers to the consumers). A tile is
// 128 rows x (256 B rows) over k-slices of 64: per slice, one stage holds the A box (128 x 64,
// 16 KB) and the B boxes (32 KB: FWD13 128 rows of W1 then 128 of W3 at the same n0, FWD2 256
// consecutive rows of B; backward 4 blocks of 64 columns x 64 k-rows), written by TMA with the
// 128-byte swizzle wgmma reads
// (wgmma.cuh's sw128 tile). Four stages (192 KB) guarded by mbarriers: full[s] completes with the
// copies' bytes, empty[s] once both consumer warpgroups' products on it have completed; the
// producer runs ahead across tile boundaries, so the next tile's slices land during an epilogue.
// Consumer warpgroup w multiplies rows 64 w .. 64 w + 63 of the tile: per slice 4 x wgmma
// m64n256k16 into 128 fp32 accumulators a thread, one commit group a slice, waiting for the group
// before (wait_group 1) to release its stage.
//
// Schedule: every block builds the prefix of the experts' 128-row tiles from the device offsets
// (no host copy of the counts: graph-capturable) and walks the flattened (m-tile, n-tile) space
// with a grid stride, finding a tile's expert by binary search; an empty expert has no tiles, and
// every tile costs the same (K fixed), so skewed routing keeps the blocks balanced. The A box of
// a tile's last m-tile runs past its expert's rows (into the next expert's, or zeros past R):
// those rows are computed and not stored. Columns past N (and past K: zeros) likewise.
// Every output element is written once by one thread, summed in a fixed order: deterministic.
#include <algorithm>

#include "kernels/cuda/attn/sm90a/wgmma.cuh"
#include "kernels/cuda/moe/sm90a/experts_wgmma.cuh"

namespace {

constexpr int WBM = 128;                // rows per tile (two consumer warpgroups x 64)
constexpr int WBK = 64;                 // k per stage: one 128-byte swizzled column block
constexpr int WBB = 256;                // B rows per stage
constexpr int WNS = 4;                  // stages
constexpr int WAB = WBM * WBK * 2;      // A bytes per stage (16 KB)
constexpr int WBBY = WBB * WBK * 2;     // B bytes per stage (32 KB)
constexpr int WST = WAB + WBBY;         // stage bytes
constexpr int WOBAR = WNS * WST;        // full[WNS], empty[WNS] after the stages
constexpr size_t WSMEM = (size_t)WOBAR + 16 * WNS + 1024;  // + 1 KB: aligned to 1024 by hand

// The products (the template argument of experts_wg_k).
enum WMode {
    WFWD13 = 0,  // u1 = A B0[e]ᵀ, u3 = A B1[e]ᵀ (B [E][N][K]), m = SiLU(u1) u3
    WFWD2 = 1,   // C = A B0[e]ᵀ (B [E][N][K])
    WBDM = 2,    // dm = A B0[e] (B [E][K][N]); epilogue: m, du1, du3 from U0, U1 (dm not stored)
    WBDX = 3,    // C = A0 B0[e] + A1 B1[e] (B [E][K][N])
    WFWD2H = 4,  // O[0] = bf16(A B0[e]ᵀ) (B [E][N][K]): WFWD2's accumulators, rounded once
};

struct WArgs {
    const int *off;  // [E+1] device
    int E, N, K;     // K: the reduction length (of each part for WBDX)
    float *C0, *C1;  // WFWD13: u1, u3; WFWD2, WBDX: C (row stride N)
    uint32_t *O[3];  // bf16 pairs (row stride N / 2): WFWD13 m; WBDM m, du1, du3; WFWD2H C
    const float *U0, *U1;  // WBDM: u1, u3 (row stride N)
};

// A tile of the flattened space: expert e (rows r0 .. r0 + rows - 1), rows m0 .. of the expert,
// output columns n0 ...
struct WTile {
    int e, r0, rows, m0, n0;
};
__device__ __forceinline__ WTile wtile_(const WArgs &a, const int *pre, long t, int ntn, int bn) {
    WTile w;
    const int mt = (int)(t / ntn);
    w.n0 = (int)(t % ntn) * bn;
    int lo = 0, hi = a.E - 1;  // the last expert whose first m-tile is <= mt
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (pre[mid] <= mt) lo = mid;
        else hi = mid - 1;
    }
    w.e = lo;
    w.r0 = a.off[lo];
    w.rows = a.off[lo + 1] - w.r0;
    w.m0 = (mt - pre[lo]) * WBM;
    return w;
}

__device__ __forceinline__ unsigned char *wsmem_align_(unsigned char *raw) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(raw);
    return raw + ((1024u - (s & 1023u)) & 1023u);
}

// Output columns per tile: FWD13 128 of u1 and 128 of u3, the others 256.
template <int MODE>
constexpr int wbn_() { return MODE == WFWD13 ? 128 : 256; }

// tmA0, tmA1: A (WBDX: du1, du3; else tmA1 = tmA0), boxes of 64 columns x 128 rows. tmB0, tmB1:
// the weights: K-major (FWD: [E N][K], boxes 64 x 128 rows) or MN-major (BWD: [E K][N], boxes
// 64 columns x 64 k-rows: a stage's B tile is four 64-column blocks of 64 k-rows, 8 KB apart).
template <int MODE>
__global__ void __launch_bounds__(384, 1)
    experts_wg_k(WArgs a, const __grid_constant__ CUtensorMap tmA0, const __grid_constant__ CUtensorMap tmA1,
                 const __grid_constant__ CUtensorMap tmB0, const __grid_constant__ CUtensorMap tmB1) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) unsigned char wsm_raw[];
    __shared__ int pre[MOE_WG_MAXE + 1];  // pre[e]: 128-row tiles of the experts before e
    unsigned char *sm = wsmem_align_(wsm_raw);
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(sm);
    const uint32_t full0 = base + WOBAR, empty0 = full0 + 8 * WNS;
    // (the warp index through a shuffle: known warp-uniform, so the wgmma below stay asynchronous)
    const int tid = threadIdx.x, warp = __shfl_sync(0xffffffffu, tid >> 5, 0), lane = tid & 31;
    if (warp == 0) {
        const int per = (a.E + 31) / 32, lo = lane * per, hi = min(a.E, lo + per);
        int sum = 0;
        for (int e = lo; e < hi; e++) sum += (a.off[e + 1] - a.off[e] + WBM - 1) / WBM;
        int inc = sum;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, inc, o);
            if (lane >= o) inc += v;
        }
        int run = inc - sum;
        for (int e = lo; e < hi; e++) {
            pre[e] = run;
            run += (a.off[e + 1] - a.off[e] + WBM - 1) / WBM;
        }
        if (lane == 31) pre[a.E] = inc;
    }
    if (tid == 0)
        for (int s = 0; s < WNS; s++) {
            mbar_init(full0 + 8 * s, 1);      // the producer's expect_tx arrival (and the bytes)
            mbar_init(empty0 + 8 * s, 256);   // every consumer thread
        }
    wg_fence_proxy();
    __syncthreads();
    constexpr int BN = wbn_<MODE>();
    constexpr bool BMN = MODE == WBDM || MODE == WBDX;  // B MN-major
    const int ntn = (a.N + BN - 1) / BN, nk1 = (a.K + WBK - 1) / WBK, nk = MODE == WBDX ? 2 * nk1 : nk1;
    const long total = (long)pre[a.E] * ntn;

    if (warp >= 8) {  // producer warpgroup: one thread issues every copy
        wg_setmaxnreg_dec<40>();
        if (tid == 256) {
            int it = 0;
            for (long t = blockIdx.x; t < total; t += gridDim.x) {
                const WTile w = wtile_(a, pre, t, ntn, BN);
                const int ra = w.r0 + w.m0;
                for (int kt = 0; kt < nk; kt++, it++) {
                    const int s = it % WNS;
                    if (it >= WNS) mbar_wait(empty0 + 8 * s, (unsigned)(it / WNS - 1) & 1u);
                    const uint32_t full = full0 + 8 * s, sa = base + s * WST, sb = sa + WAB;
                    const bool part = MODE == WBDX && kt >= nk1;  // WBDX: the second product
                    const int k0 = (kt - (part ? nk1 : 0)) * WBK;
                    mbar_expect_tx(full, (unsigned)WST);  // boxes past the tensor: zero-filled, counted
                    tma_load_2d(sa, part ? &tmA1 : &tmA0, k0, ra, full);
                    if constexpr (BMN) {  // k-rows e K + k0 .., columns n0 + 64 j ..
                        const CUtensorMap *mb = part ? &tmB1 : &tmB0;
#pragma unroll
                        for (int j = 0; j < 4; j++)
                            tma_load_2d(sb + j * 64 * 128, mb, w.n0 + 64 * j, w.e * a.K + k0, full);
                    } else {  // FWD13: rows n0 .. of W1 then of W3; FWD2: 256 rows of B from n0
                        const int rb0 = w.e * a.N + w.n0;
                        tma_load_2d(sb, &tmB0, k0, rb0, full);
                        tma_load_2d(sb + 128 * 128, &tmB1, k0, MODE == WFWD13 ? rb0 : rb0 + 128, full);
                    }
                }
            }
        }
        return;
    }
    wg_setmaxnreg_inc<232>();
    const int wg = warp >> 2, wi = warp & 3, g = lane >> 2, t4 = lane & 3;
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; i++) acc[i] = 0.f;
    int it = 0;
    for (long t = blockIdx.x; t < total; t += gridDim.x) {
        const WTile w = wtile_(a, pre, t, ntn, BN);
        for (int kt = 0; kt < nk; kt++, it++) {
            const int s = it % WNS;
            mbar_wait(full0 + 8 * s, (unsigned)(it / WNS) & 1u);
            const uint32_t sa = base + s * WST, sb = sa + WAB;
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < WBK / 16; ks++) {
                if constexpr (BMN) wg_ss<1>(acc, wg_desc_k(sa, WBM, 64 * wg, ks), wg_desc_mn(sb, 64, 0, ks), kt | ks);
                else wg_ss<0>(acc, wg_desc_k(sa, WBM, 64 * wg, ks), wg_desc_k(sb, WBB, 0, ks), kt | ks);
            }
            wg_commit();
            if (kt > 0) {  // the slice before has been multiplied: its stage is free
                wg_wait<1>();
                mbar_arrive(empty0 + 8 * ((it - 1) % WNS));
            }
        }
        wg_wait<0>();
        mbar_arrive(empty0 + 8 * ((it - 1) % WNS));
        wg_hold(acc);
        // accumulator i of the m64nN layout: row 16 wi + g + 8 ((i / 2) % 2), column 8 (i / 4) + 2 t4 + i % 2
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = w.m0 + 64 * wg + 16 * wi + g + 8 * h;
            if (row >= w.rows) continue;
            const size_t ro = (size_t)(w.r0 + row) * a.N;
            if constexpr (MODE == WFWD13) {  // columns 0..127: u1, 128..255: u3 of the same n0
#pragma unroll
                for (int n8 = 0; n8 < 16; n8++) {
                    const int col = w.n0 + 8 * n8 + 2 * t4;
                    if (col >= a.N) continue;
                    const float x0 = acc[4 * n8 + 2 * h], x1 = acc[4 * n8 + 2 * h + 1];
                    const float y0 = acc[64 + 4 * n8 + 2 * h], y1 = acc[64 + 4 * n8 + 2 * h + 1];
                    *reinterpret_cast<float2 *>(a.C0 + ro + col) = make_float2(x0, x1);
                    *reinterpret_cast<float2 *>(a.C1 + ro + col) = make_float2(y0, y1);
                    a.O[0][(ro + col) >> 1] = pack_bf16(x0 * sigmoid_acc(x0) * y0, x1 * sigmoid_acc(x1) * y1);
                }
            } else if constexpr (MODE == WBDM) {  // the SwiGLU backward, as experts_mma.cu's BWD_DM
#pragma unroll
                for (int n8 = 0; n8 < 32; n8++) {
                    const int col = w.n0 + 8 * n8 + 2 * t4;
                    if (col >= a.N) continue;
                    const float2 u1 = *reinterpret_cast<const float2 *>(a.U0 + ro + col);
                    const float2 u3 = *reinterpret_cast<const float2 *>(a.U1 + ro + col);
                    const float x[2] = {u1.x, u1.y}, y[2] = {u3.x, u3.y};
                    float mm[2], d1[2], d3[2];
#pragma unroll
                    for (int q = 0; q < 2; q++) {
                        const float sg = sigmoid_acc(x[q]), silu = x[q] * sg, gd = acc[4 * n8 + 2 * h + q];
                        mm[q] = silu * y[q];
                        d3[q] = gd * silu;
                        d1[q] = gd * y[q] * sg * (1.f + x[q] * (1.f - sg));
                    }
                    const size_t i = (ro + col) >> 1;
                    a.O[0][i] = pack_bf16(mm[0], mm[1]);
                    a.O[1][i] = pack_bf16(d1[0], d1[1]);
                    a.O[2][i] = pack_bf16(d3[0], d3[1]);
                }
            } else {  // WFWD2, WBDX: C fp32; WFWD2H: C bf16
#pragma unroll
                for (int n8 = 0; n8 < 32; n8++) {
                    const int col = w.n0 + 8 * n8 + 2 * t4;
                    if (col >= a.N) continue;
                    const float x0 = acc[4 * n8 + 2 * h], x1 = acc[4 * n8 + 2 * h + 1];
                    if constexpr (MODE == WFWD2H) a.O[0][(ro + col) >> 1] = pack_bf16(x0, x1);
                    else *reinterpret_cast<float2 *>(a.C0 + ro + col) = make_float2(x0, x1);
                }
            }
        }
    }
#endif
}

// Whether this device runs the kernels (sm_90a code: compute capability 9.0 only).
bool wg_device_(const mtrl_cuda_ctx *c, int E) {
    return c->cc == 90 && E >= 1 && E <= MOE_WG_MAXE && WSMEM <= c->smem_optin;
}

template <int MODE>
int launch_wg_(mtrl_cuda_ctx *c, const WArgs &a, long R, const void *A0, const void *A1, const void *B0,
               const void *B1) {
    if (!wg_device_(c, a.E) || R >= (1l << 31) || (long)a.E * a.N >= (1l << 31) || (long)a.E * a.K >= (1l << 31))
        return 1;
    constexpr bool BMN = MODE == WBDM || MODE == WBDX;
    const int bld = BMN ? a.N : a.K, brows = BMN ? a.E * a.K : a.E * a.N, bbox = BMN ? 64 : 128;
    CUtensorMap ta0, ta1, tb0, tb1;
    if (tma_map_rows(&ta0, A0, a.K, (int)R, WBM) || tma_map_rows(&ta1, A1, a.K, (int)R, WBM) ||
        tma_map_rows(&tb0, B0, bld, brows, bbox) || tma_map_rows(&tb1, B1, bld, brows, bbox))
        return 1;
    auto k = experts_wg_k<MODE>;
    static bool sized = false;  // per instance; a benign race (every caller sets the same value)
    if (!sized) {
        set_smem(k, WSMEM);
        sized = true;
    }
    constexpr int BN = wbn_<MODE>();
    const long ntn = (a.N + BN - 1) / BN, mt = (R + WBM - 1) / WBM + a.E;  // >= Σ cdiv(rows_e, 128)
    const long grid = std::min(mt * ntn, (long)c->sms);
    k<<<(unsigned)grid, 384, WSMEM, c->stream>>>(a, ta0, ta1, tb0, tb1);
    CUDA_LAUNCH_CHECK();
    return 0;
}

}  // namespace

int moe_wg_fwd13(mtrl_cuda_ctx *c, int E, int N, int K, long R, const int *off, const void *X, const void *W1,
                 const void *W3, float *u1, float *u3, void *m) {
    WArgs a = {};
    a.off = off, a.E = E, a.N = N, a.K = K, a.C0 = u1, a.C1 = u3, a.O[0] = (uint32_t *)m;
    return launch_wg_<WFWD13>(c, a, R, X, X, W1, W3);
}

int moe_wg_fwd2(mtrl_cuda_ctx *c, int E, int N, int K, long R, const int *off, const void *A, const void *B,
                float *C) {
    WArgs a = {};
    a.off = off, a.E = E, a.N = N, a.K = K, a.C0 = C;
    return launch_wg_<WFWD2>(c, a, R, A, A, B, B);
}

int moe_wg_fwd2_bf16(mtrl_cuda_ctx *c, int E, int N, int K, long R, const int *off, const void *A, const void *B,
                     void *C) {
    WArgs a = {};
    a.off = off, a.E = E, a.N = N, a.K = K, a.O[0] = (uint32_t *)C;
    return launch_wg_<WFWD2H>(c, a, R, A, A, B, B);
}

int moe_wg_bwd_dm(mtrl_cuda_ctx *c, int E, int N, int K, long R, const int *off, const void *dY, const void *W2,
                  const float *u1, const float *u3, void *m, void *du1, void *du3) {
    WArgs a = {};
    a.off = off, a.E = E, a.N = N, a.K = K, a.U0 = u1, a.U1 = u3;
    a.O[0] = (uint32_t *)m, a.O[1] = (uint32_t *)du1, a.O[2] = (uint32_t *)du3;
    return launch_wg_<WBDM>(c, a, R, dY, dY, W2, W2);
}

int moe_wg_bwd_dx(mtrl_cuda_ctx *c, int E, int N, int K, long R, const int *off, const void *du1, const void *du3,
                  const void *W1, const void *W3, float *dX) {
    WArgs a = {};
    a.off = off, a.E = E, a.N = N, a.K = K, a.C0 = dX;
    return launch_wg_<WBDX>(c, a, R, du1, du3, W1, W3);
}
