// attn/causal_mma.cu: v2 of the causal attention of the training form (mtrl_attn_causal_fwd/bwd;
// the launchers in mla/attn_decode.cu dispatch here), FlashAttention-2 style: every product is
// mma.sync m16n8k16 (bf16 operands, fp32 accumulation), fragments through ldmatrix, the K/V (or
// Q/dO) tiles stream through shared memory with cp.async, double-buffered (tile n+1 is in flight
// while tile n is multiplied), and the score tile never leaves registers: the accumulator layout
// of S = Q Kᵀ is, two n-tiles at a time, the A-fragment layout of P for P V (the FA2 register
// trick), so there is no shared-memory round trip and no barrier between the two products.
//
// Query rows are packed per key head j as in v1: row ρ = (token ρ / G, head j G + ρ % G),
// G = H / Hk, so MHA (G = 1) blocks are consecutive tokens of one head and the absorbed MQA
// (Hk = 1, G = H) blocks are 64 / H tokens x all heads against one shared key tile.
//
//   forward  attn2_fwd_k<DK, DVS, NVW, BN, QREG, ALIAS, MT, MINB>: grid (row blocks of 64 MT,
//            Hk, value slices), 4 NVW warps. Warp (rg = w % 4, vg = w / 4) owns the query rows
//            16 rg + 64 mt (mt < MT) and value columns vg DVS ..+DVS of the block's slice. Online
//            softmax in base 2 in registers (row maxima across the 4 threads of a quad by
//            shuffles; the row sums stay per-thread partials until the end). Key tiles past the
//            block's last row are skipped, and only tiles that cross the diagonal are masked. Row
//            blocks are launched heaviest (last) first, so the causal triangle's long blocks do
//            not form the tail.
//            * MHA Dk = Dv = 128 (configuration 4 of docs/kernel-lab.md): <128, 128, 1, 64, Q in shared
//              memory, separate V, MT = 2>: each K / V fragment read through ldmatrix feeds two
//              row tiles (with MT = 1 the loop is bound by one ldmatrix.x4 per two mma: 242 vs
//              299 TFLOP/s at 32K). 104 KB of shared memory, 255 registers, 2 blocks per SM.
//            * absorbed Dk = 576, Dv = 512 aliased: <576, 256, 2, 64, Q in shared memory, V = the
//              first 512 columns of the key tile, MT = 1>: 8 warps, the two warps of a row group
//              compute the same S (Q Kᵀ over 576 is redone, 65% of the issued mma work is useful)
//              and each accumulates 256 value columns (128 accumulator registers). 224 KB of
//              shared memory (Q + two key stages), one block per SM.
//            * MHA Dk = 192, Dv = 128 (the naive MLA form: d_n + d_r = 128 + 64 keys, d_v = 128
//              values): <192, 128, 1, 32, Q in shared memory, separate V, MT = 2, 2 blocks per
//              SM>: 240 registers, no spills, 92 KB (Q 128 x 200 + two stages of 32 keys x
//              (200 + 136) bf16). With 64-key stages it would be 134 KB, one block per SM, 255
//              registers and 72 B of spills.
//   backward (Dk = Dv = 128 or Dk = 192, Dv = 128, values not aliased; the absorbed shape runs
//            v1) in three launches, nothing atomic:
//            attn2_bwd_pre_k: D = rowsum(dO ⊙ O);
//            attn2_bwd_dkv_k<DK, DV, BR>: grid (key blocks of 64, Hk); warp w owns 16 keys and
//              holds their dK, dV (fp32, (DK + DV) / 2 registers); for each BR-row tile of
//              queries that see the keys (Q, dO, lse, D double-buffered), Sᵀ = K Qᵀ, Pᵀ,
//              dV += Pᵀ dO, dPᵀ = V dOᵀ, dSᵀ = Pᵀ ⊙ (dPᵀ − D), dK += dSᵀ Q, all in registers;
//              added once to dk / dv (+=);
//            attn2_bwd_dq_k<DK, DV, BN, MT, QREG>: grid (row blocks of 64 MT, Hk); for each key
//              tile, S, P, dP = dO Vᵀ, dS, dQ += dS K; dq written once (overwrite). Dk = Dv = 128:
//              BN = 32, MT = 2 (Q and dO fragments from shared memory).
//            Dk = 192, Dv = 128: dkv <192, 128, BR = 32>: the 96 + 64 accumulator registers of dK
//              and dV fit beside Sᵀ and dPᵀ because the query tile is 32 rows (16 + 16 registers
//              instead of 32 + 32 at 64 rows, the same 192 live accumulators as the 128 shape):
//              251 registers, no spills, 85 KB (K 64 x 200, V 64 x 136, two stages of Q 32 x 200
//              and dO 32 x 136), 2 blocks per SM. 64-row tiles would compile without spills (255
//              registers) but need 127 KB, one block per SM. The price of 32 rows: the warp's K / V A-fragments are read
//              once per 32 rows instead of per 64 (6 ldmatrix per 8 mma in Sᵀ and dPᵀ instead
//              of 5), and twice the barriers. dq <192, 128, 32, 1, Q and dO from shared
//              memory>: dQ is 96 registers (MT = 2 would need 192), 216 registers, no spills,
//              84 KB, 2 blocks per SM (64-key stages: 126 KB; with Q and dO in registers ptxas
//              spills 116 B).
//            So S and dP are computed twice (7 products instead of FA2's 5): the price of a
//            deterministic dq without floating-point atomics.
// attn = simt (kernel_opts.h) selects the v1 kernels of mla/attn_decode.cu (read at each call).
// Every kernel also has a varlen form (VL = true: one launch over many packed pieces, each block's
// piece and tile from a work list; attn/varlen.cuh), bit for bit the per-piece launches.
#include <math.h>
#include <stdlib.h>

#include "kernels/cuda/attn/args.cuh"
#include "kernels/cuda/cuda_common.cuh"

namespace {

constexpr int BM = 64;  // packed query rows per block (4 row groups of 16)
constexpr float kLog2e = kAttnLog2e, kLn2 = 0.6931471805599453f;

// adr_a, adr_b_nk, adr_b_kn (the lane addresses of the ldmatrix fragment loads) and ex2 are in
// cuda_common.cuh (shared with the KDA v3 kernels).

// cp.async of ROWS x COLS bf16 (COLS % 8 == 0) into dst (row stride ldd) by NT threads; row r
// comes from src(r), or is zero-filled when src(r) is null (`any`: a valid dummy address).
template <int NT, int ROWS, int COLS, class F>
__device__ __forceinline__ void load_tile(uint16_t *dst, int ldd, F src, const uint16_t *any) {
    constexpr int C8 = COLS / 8;
#pragma unroll 4
    for (int i = threadIdx.x; i < ROWS * C8; i += NT) {
        int r = i / C8, c = i - r * C8;
        const uint16_t *s = src(r);
        cp_async16_pred(dst + r * ldd + c * 8, s ? s + c * 8 : any, s != nullptr);
    }
}

// The A fragment of the 16 x 16 block kk of P from the fp32 accumulators of S (n-tiles 2kk,
// 2kk + 1): a C tile (g, 2t..2t+1 | g+8, 2t..2t+1) is half of an A fragment.
__device__ __forceinline__ void acc_to_a(uint32_t *af, const float *c0, const float *c1) {
    af[0] = pack_bf16(c0[0], c0[1]);
    af[1] = pack_bf16(c0[2], c0[3]);
    af[2] = pack_bf16(c1[0], c1[1]);
    af[3] = pack_bf16(c1[2], c1[3]);
}

// ---- forward --------------------------------------------------------------------------------

// MT: row tiles of 16 per warp (the block has 64 MT rows; warp rg owns rows 16 rg + 64 mt): each
// key / value fragment read from shared memory then feeds MT products, which is what bounds the
// loop when MT = 1 (one ldmatrix.x4 per two mma).
template <int DK, int DVS, int NVW, int BN, bool QREG, bool ALIAS, int MT>
struct FwdCfg {
    static constexpr int NT = 128 * NVW;
    static constexpr int BMB = BM * MT;    // packed rows per block
    static constexpr int DVB = DVS * NVW;  // value columns per block
    static constexpr int LDK = DK + 8;     // +16 bytes per row: ldmatrix without bank conflicts
    static constexpr int LDV = ALIAS ? LDK : DVB + 8;
    static constexpr int KSZ = BN * LDK, VSZ = ALIAS ? 0 : BN * LDV, STG = KSZ + VSZ;
    // QREG: Q is staged through stage 1 and then lives in registers.
    static constexpr size_t smem() {
        return sizeof(uint16_t) * (QREG ? (size_t)2 * STG : (size_t)BMB * LDK + 2 * (size_t)STG);
    }
    static_assert(!QREG || (MT == 1 && BM * LDK <= STG), "Q staging must fit into one stage");
    static_assert(DK % 16 == 0 && DVS % 16 == 0 && BN % 16 == 0, "tile shapes");
};

// VL: a varlen launch, the block's piece and row tile from vl (attn/varlen.cuh).
template <int DK, int DVS, int NVW, int BN, bool QREG, bool ALIAS, int MT, int MINB, bool VL>
__global__ void __launch_bounds__(128 * NVW, MINB)
    attn2_fwd_k(A2 a, float *__restrict__ o, float *__restrict__ lse, const AttnVl vl) {
    using C = FwdCfg<DK, DVS, NVW, BN, QREG, ALIAS, MT>;
    constexpr int NT = C::NT, LDK = C::LDK, LDV = C::LDV, KSZ = C::KSZ, STG = C::STG;
    constexpr int BMB = C::BMB, NST = BN / 8, NOT = DVS / 8;
    extern __shared__ __align__(16) unsigned char sm_[];
    uint16_t *smem = reinterpret_cast<uint16_t *>(sm_);
    uint16_t *sQ = QREG ? smem + STG : smem;
    uint16_t *sT = QREG ? smem : smem + BMB * LDK;  // the two key/value stages

    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, rg = w & 3, vg = w >> 2;
    const int g = lane >> 2, t = lane & 3;
    int bx = gridDim.x - 1 - blockIdx.x;
    int k0 = 0;
    if (VL) bx = attn_vl_fwd_block(a, vl, o, lse, &k0);
    (void)k0;
    const int j = blockIdx.y, rho0 = bx * BMB;
    const int vc0 = blockIdx.z * C::DVB;  // the block's first value column

    load_tile<NT, BMB, DK>(sQ, LDK, [&](int r) -> const uint16_t * {
        int rho = rho0 + r;
        return rho < a.nrows ? a.q + row_ih(a, j, rho) * DK : nullptr;
    }, a.q);
    cp_async_commit();
    const int last = min(rho0 + BMB, a.nrows) - 1;
    const int nkb = (a.off + last / a.G) / BN + 1;  // key tiles up to the block's last row
    auto issue = [&](int kb) {
        const int s0 = kb * BN;
        uint16_t *dK = sT + (kb & 1) * STG;
        load_tile<NT, BN, DK>(dK, LDK, [&](int r) -> const uint16_t * {
            return s0 + r < a.Tk ? a.k + (size_t)(s0 + r) * a.ldk + (size_t)j * DK : nullptr;
        }, a.k);
        if (!ALIAS)
            load_tile<NT, BN, C::DVB>(dK + KSZ, LDV, [&](int r) -> const uint16_t * {
                return s0 + r < a.Tk ? a.v + (size_t)(s0 + r) * a.ldv + (size_t)j * a.Dv + vc0
                                     : nullptr;
            }, a.v);
        cp_async_commit();
    };
    issue(0);

    uint32_t qf[QREG ? DK / 16 : 1][4];
    if (QREG) {
        cp_async_wait<1>();  // Q landed (tile 0 may still be in flight)
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < (QREG ? DK / 16 : 0); ks++)
            ldsm_x4(qf[ks], adr_a(sQ + rg * 16 * LDK, LDK, ks * 16, lane));
        __syncthreads();  // stage 1 is free for tile 1
    }

    float oacc[MT][NOT][4];
    float m[MT][2], l[MT][2];  // rows g and g + 8 of each row tile, base 2
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int i = 0; i < NOT; i++)
            oacc[mt][i][0] = oacc[mt][i][1] = oacc[mt][i][2] = oacc[mt][i][3] = 0.f;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            m[mt][h] = -INFINITY;
            l[mt][h] = 0.f;
        }
    }
    const int pos_first = a.off + rho0 / a.G;  // the block's earliest row

    for (int kb = 0; kb < nkb; kb++) {
        cp_async_next(kb, nkb, issue);
        __syncthreads();
        const uint16_t *tK = sT + (kb & 1) * STG;
        const uint16_t *tV = (ALIAS ? tK + vc0 : tK + KSZ) + vg * DVS;
        float s[MT][NST][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int i = 0; i < NST; i++) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < DK / 16; ks++) {
            uint32_t af[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                if (QREG) {
#pragma unroll
                    for (int e = 0; e < 4; e++) af[mt][e] = qf[QREG ? ks : 0][e];
                } else {
                    ldsm_x4(af[mt], adr_a(sQ + (mt * BM + rg * 16) * LDK, LDK, ks * 16, lane));
                }
            }
#pragma unroll
            for (int np = 0; np < NST / 2; np++) {
                uint32_t b[4];
                ldsm_x4(b, adr_b_nk(tK, LDK, ks * 16, np * 16, lane));
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    mma_bf16_16816(s[mt][2 * np], af[mt], b);
                    mma_bf16_16816(s[mt][2 * np + 1], af[mt], b + 2);
                }
            }
        }
        // scale to base 2 and mask the keys after each row's position (only tiles that cross
        // the diagonal; keys past Tk are always after every row's position)
        const int s0 = kb * BN;
        const bool diag = s0 + BN - 1 > pos_first;
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            float mx0 = -INFINITY, mx1 = -INFINITY;
            int pos0 = 0, pos1 = 0;  // the rows' positions, needed on diagonal tiles only
            if (diag) {
                const int r = rho0 + mt * BM + rg * 16 + g;
                pos0 = a.off + r / a.G;
                pos1 = a.off + (r + 8) / a.G;
            }
#pragma unroll
            for (int nt = 0; nt < NST; nt++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    int key = s0 + nt * 8 + 2 * t + e;
                    float x0 = s[mt][nt][e] * a.sl2, x1 = s[mt][nt][2 + e] * a.sl2;
                    if (diag) {
                        x0 = key > pos0 ? -INFINITY : x0;
                        x1 = key > pos1 ? -INFINITY : x1;
                    }
                    s[mt][nt][e] = x0;
                    s[mt][nt][2 + e] = x1;
                    mx0 = fmaxf(mx0, x0);
                    mx1 = fmaxf(mx1, x1);
                }
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            const float mn0 = fmaxf(m[mt][0], mx0), mn1 = fmaxf(m[mt][1], mx1);
            // a row with no visible key yet keeps exponent base 0 (no -inf - -inf)
            const float b0 = mn0 == -INFINITY ? 0.f : mn0, b1 = mn1 == -INFINITY ? 0.f : mn1;
            const float al0 = ex2(m[mt][0] - b0), al1 = ex2(m[mt][1] - b1);
            m[mt][0] = mn0;
            m[mt][1] = mn1;
            float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
            for (int nt = 0; nt < NST; nt++) {
                s[mt][nt][0] = ex2(s[mt][nt][0] - b0);
                s[mt][nt][1] = ex2(s[mt][nt][1] - b0);
                s[mt][nt][2] = ex2(s[mt][nt][2] - b1);
                s[mt][nt][3] = ex2(s[mt][nt][3] - b1);
                ps0 += s[mt][nt][0] + s[mt][nt][1];
                ps1 += s[mt][nt][2] + s[mt][nt][3];
            }
            l[mt][0] = l[mt][0] * al0 + ps0;
            l[mt][1] = l[mt][1] * al1 + ps1;
#pragma unroll
            for (int i = 0; i < NOT; i++) {
                oacc[mt][i][0] *= al0;
                oacc[mt][i][1] *= al0;
                oacc[mt][i][2] *= al1;
                oacc[mt][i][3] *= al1;
            }
        }
        // O += P V (P straight from the accumulators)
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            uint32_t af[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) acc_to_a(af[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
#pragma unroll
            for (int dp = 0; dp < NOT / 2; dp++) {
                uint32_t b[4];
                ldsm_x4_t(b, adr_b_kn(tV, LDV, kk * 16, dp * 16, lane));
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    mma_bf16_16816(oacc[mt][2 * dp], af[mt], b);
                    mma_bf16_16816(oacc[mt][2 * dp + 1], af[mt], b + 2);
                }
            }
        }
        __syncthreads();  // this stage is overwritten by the next iteration's issue
    }

    // o = O / l; lse = ln 2 (m + log2 l). The row sums are per-thread partials until here.
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            float lr = l[mt][hr];
            lr += __shfl_xor_sync(0xffffffffu, lr, 1);
            lr += __shfl_xor_sync(0xffffffffu, lr, 2);
            const int rho = rho0 + mt * BM + rg * 16 + g + 8 * hr;
            if (rho >= a.nrows) continue;
            const float inv = lr > 0.f ? 1.f / lr : 0.f;
            const size_t ih = row_ih(a, j, rho);
            float *orow = o + ih * a.Dv + vc0 + vg * DVS;
#pragma unroll
            for (int i = 0; i < NOT; i++)
                *reinterpret_cast<float2 *>(orow + i * 8 + 2 * t) =
                    make_float2(oacc[mt][i][2 * hr] * inv, oacc[mt][i][2 * hr + 1] * inv);
            if (vg == 0 && t == 0 && blockIdx.z == 0) lse[ih] = (m[mt][hr] + log2f(lr)) * kLn2;
        }
    }
}

// ---- backward -------------------------------------------------------------------------------

// D[i][h] = Σ_c dO[i][h][c] O[i][h][c]: one warp per (i, h), fixed order. With Lt (MHA rows,
// for v3's dK / dV): also head-major copies Lt[h][i] = lse[i][h] log2(e) and Dt[h][i] = D[i][h],
// npad rows per head, the rows Tq..npad-1 padded with +inf and 0 (warps past `rows` write those).
__global__ void attn2_bwd_pre_k(int rows, int Dv, const uint16_t *__restrict__ dout,
                                const float *__restrict__ o, float *__restrict__ D,
                                const float *__restrict__ lse, int H, int Tq, int npad,
                                float *__restrict__ Lt, float *__restrict__ Dt) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= rows) {
        const int p = row - rows, pads = npad - Tq;
        if (Lt && lane == 0 && pads > 0 && p < H * pads) {
            const int h = p / pads, i = Tq + p % pads;
            Lt[(size_t)h * npad + i] = INFINITY;
            Dt[(size_t)h * npad + i] = 0.f;
        }
        return;
    }
    const uint16_t *dr = dout + (size_t)row * Dv;
    const float *orow = o + (size_t)row * Dv;
    float acc = 0.f;
    for (int c = lane * 4; c < Dv; c += 128) {  // Dv % 16 == 0: whole groups of 4
        uint2 d = *reinterpret_cast<const uint2 *>(dr + c);
        float4 x = *reinterpret_cast<const float4 *>(orow + c);
        acc = fmaf(bf2f((uint16_t)(d.x & 0xffffu)), x.x, acc);
        acc = fmaf(bf2f((uint16_t)(d.x >> 16)), x.y, acc);
        acc = fmaf(bf2f((uint16_t)(d.y & 0xffffu)), x.z, acc);
        acc = fmaf(bf2f((uint16_t)(d.y >> 16)), x.w, acc);
    }
    acc = warp_sum(acc);
    if (lane == 0) {
        D[row] = acc;
        if (Lt) {
            const int i = row / H, h = row - i * H;
            Lt[(size_t)h * npad + i] = lse[row] * kLog2e;
            Dt[(size_t)h * npad + i] = acc;
        }
    }
}

// dK, dV of 64 keys per block (key columns DK, value columns DV). Shared memory: K [64][DK+8]
// and V [64][DV+8] once; Q [2][BR][DK+8], dO [2][BR][DV+8], lse (base 2) and D [2][BR] per
// row tile of BR packed query rows (BR = 64 for Dk = Dv = 128; 32 for Dk = 192, Dv = 128, where
// 64-row stages would take 127 KB and one block per SM).
template <int DK, int DV, int BR>
struct DkvCfg {
    static constexpr int LDK = DK + 8, LDV = DV + 8, BN = 64;
    static constexpr int KSZ = BN * LDK, VSZ = BN * LDV, QSZ = BR * LDK, OSZ = BR * LDV;
    static constexpr size_t smem() {
        return sizeof(uint16_t) * ((size_t)KSZ + VSZ + 2 * (size_t)QSZ + 2 * (size_t)OSZ) +
               sizeof(float) * 4 * BR;
    }
    static_assert(DK % 16 == 0 && DV % 16 == 0 && BR % 16 == 0 && BR <= BM, "tile shapes");
};

template <int DK, int DV, int BR, bool VL>
__global__ void __launch_bounds__(128, 2)
    attn2_bwd_dkv_k(A2 a, const uint16_t *__restrict__ dout, const float *__restrict__ lse,
                    const float *__restrict__ Dd, float *__restrict__ dk, float *__restrict__ dv,
                    const AttnVl vl) {
    using C = DkvCfg<DK, DV, BR>;
    constexpr int LDK = C::LDK, LDV = C::LDV, BN = C::BN, NRT = BR / 8, NKT = DK / 8,
                  NVT = DV / 8, NMX = NKT > NVT ? NKT : NVT;
    extern __shared__ __align__(16) unsigned char sm_[];
    uint16_t *sK = reinterpret_cast<uint16_t *>(sm_), *sV = sK + C::KSZ, *sQ = sV + C::VSZ,
             *sO = sQ + 2 * C::QSZ;  // sQ, sO: two stages each
    float *sL = reinterpret_cast<float *>(sO + 2 * C::OSZ), *sD = sL + 2 * BR;

    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
    int bx = blockIdx.x;
    if (VL) bx = attn_vl_dkv_block(a, vl, dout, lse, Dd, dk, dv);
    const int j = blockIdx.y, s0 = bx * BN;
    const int kw0 = s0 + 16 * w;  // the warp's first key
    const int i_first = s0 - a.off > 0 ? s0 - a.off : 0;  // first token that sees key s0
    const int rt0 = i_first * a.G / BR, nrt = (a.nrows + BR - 1) / BR;

    load_tile<128, BN, DK>(sK, LDK, [&](int r) -> const uint16_t * {
        return s0 + r < a.Tk ? a.k + (size_t)(s0 + r) * a.ldk + (size_t)j * DK : nullptr;
    }, a.k);
    load_tile<128, BN, DV>(sV, LDV, [&](int r) -> const uint16_t * {
        return s0 + r < a.Tk ? a.v + (size_t)(s0 + r) * a.ldv + (size_t)j * DV : nullptr;
    }, a.v);
    auto issue = [&](int rt) {
        const int st = rt & 1, rho0 = rt * BR;
        load_tile<128, BR, DK>(sQ + st * C::QSZ, LDK, [&](int r) -> const uint16_t * {
            int rho = rho0 + r;
            return rho < a.nrows ? a.q + row_ih(a, j, rho) * DK : nullptr;
        }, a.q);
        load_tile<128, BR, DV>(sO + st * C::OSZ, LDV, [&](int r) -> const uint16_t * {
            int rho = rho0 + r;
            return rho < a.nrows ? dout + row_ih(a, j, rho) * DV : nullptr;
        }, dout);
        // rows past the end: P = 2^-inf = 0, so they add nothing
        if (tid < BR) row_lse_d(a, j, rho0 + tid, lse, Dd, sL + st * BR + tid, sD + st * BR + tid);
        cp_async_commit();
    };
    if (rt0 < nrt) issue(rt0);  // (K, V ride in the same group)
    else cp_async_commit();

    float dka[NKT][4], dva[NVT][4];
#pragma unroll
    for (int i = 0; i < NMX; i++) {
        const int ik = i < NKT ? i : 0, iv = i < NVT ? i : 0;  // (clamped: no dead overrun)
        if (i < NKT) dka[ik][0] = dka[ik][1] = dka[ik][2] = dka[ik][3] = 0.f;
        if (i < NVT) dva[iv][0] = dva[iv][1] = dva[iv][2] = dva[iv][3] = 0.f;
    }
    for (int rt = rt0; rt < nrt; rt++) {
        cp_async_next(rt, nrt, issue);
        __syncthreads();
        const int st = rt & 1, rho0 = rt * BR;
        const uint16_t *tQ = sQ + st * C::QSZ, *tO = sO + st * C::OSZ;
        const float *tL = sL + st * BR, *tD = sD + st * BR;
        // Sᵀ = K Qᵀ: the warp's 16 keys x BR rows
        float p[NRT][4];
#pragma unroll
        for (int i = 0; i < NRT; i++) p[i][0] = p[i][1] = p[i][2] = p[i][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < DK / 16; ks++) {
            uint32_t af[4];
            ldsm_x4(af, adr_a(sK + 16 * w * LDK, LDK, ks * 16, lane));
#pragma unroll
            for (int np = 0; np < NRT / 2; np++) {
                uint32_t b[4];
                ldsm_x4(b, adr_b_nk(tQ, LDK, ks * 16, np * 16, lane));
                mma_bf16_16816(p[2 * np], af, b);
                mma_bf16_16816(p[2 * np + 1], af, b + 2);
            }
        }
        // Pᵀ = 2^(S sl2 - lse2), zero after each row's position
        const bool diag = a.off + rho0 / a.G < s0 + BN - 1;
#pragma unroll
        for (int nt = 0; nt < NRT; nt++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int r = nt * 8 + 2 * t + e;
                const float L = tL[r];
                float x0 = ex2(p[nt][e] * a.sl2 - L), x1 = ex2(p[nt][2 + e] * a.sl2 - L);
                if (diag) {
                    const int pos = a.off + (rho0 + r) / a.G;
                    x0 = kw0 + g > pos ? 0.f : x0;
                    x1 = kw0 + g + 8 > pos ? 0.f : x1;
                }
                p[nt][e] = x0;
                p[nt][2 + e] = x1;
            }
        }
        // dV += Pᵀ dO
#pragma unroll
        for (int kk = 0; kk < BR / 16; kk++) {
            uint32_t af[4];
            acc_to_a(af, p[2 * kk], p[2 * kk + 1]);
#pragma unroll
            for (int dp = 0; dp < NVT / 2; dp++) {
                uint32_t b[4];
                ldsm_x4_t(b, adr_b_kn(tO, LDV, kk * 16, dp * 16, lane));
                mma_bf16_16816(dva[2 * dp], af, b);
                mma_bf16_16816(dva[2 * dp + 1], af, b + 2);
            }
        }
        // dPᵀ = V dOᵀ, then dSᵀ = Pᵀ ⊙ (dPᵀ − D) in place
        float dp_[NRT][4];
#pragma unroll
        for (int i = 0; i < NRT; i++) dp_[i][0] = dp_[i][1] = dp_[i][2] = dp_[i][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < DV / 16; ks++) {
            uint32_t af[4];
            ldsm_x4(af, adr_a(sV + 16 * w * LDV, LDV, ks * 16, lane));
#pragma unroll
            for (int np = 0; np < NRT / 2; np++) {
                uint32_t b[4];
                ldsm_x4(b, adr_b_nk(tO, LDV, ks * 16, np * 16, lane));
                mma_bf16_16816(dp_[2 * np], af, b);
                mma_bf16_16816(dp_[2 * np + 1], af, b + 2);
            }
        }
#pragma unroll
        for (int nt = 0; nt < NRT; nt++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const float dd = tD[nt * 8 + 2 * t + e];
                dp_[nt][e] = p[nt][e] * (dp_[nt][e] - dd);
                dp_[nt][2 + e] = p[nt][2 + e] * (dp_[nt][2 + e] - dd);
            }
        }
        // dK += dSᵀ Q (the softmax scale is applied once at the end)
#pragma unroll
        for (int kk = 0; kk < BR / 16; kk++) {
            uint32_t af[4];
            acc_to_a(af, dp_[2 * kk], dp_[2 * kk + 1]);
#pragma unroll
            for (int dp = 0; dp < NKT / 2; dp++) {
                uint32_t b[4];
                ldsm_x4_t(b, adr_b_kn(tQ, LDK, kk * 16, dp * 16, lane));
                mma_bf16_16816(dka[2 * dp], af, b);
                mma_bf16_16816(dka[2 * dp + 1], af, b + 2);
            }
        }
        __syncthreads();  // this stage is overwritten by the next iteration's issue
    }
    cp_async_wait<0>();
    // dk += scale dK, dv += dV: one block owns these rows, one read-modify-write each
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int key = kw0 + g + 8 * hr;
        if (key >= a.Tk) continue;
        float *kr = dk + (size_t)key * a.ldk + (size_t)j * DK + 2 * t;
        float *vr = dv + (size_t)key * a.ldv + (size_t)j * DV + 2 * t;
#pragma unroll
        for (int i = 0; i < NMX; i++) {  // (dk, dv interleaved while both have column tiles)
            if (i < NKT) {
                const int ik = i < NKT ? i : 0;
                float2 x = *reinterpret_cast<float2 *>(kr + i * 8);
                x.x += a.scale * dka[ik][2 * hr];
                x.y += a.scale * dka[ik][2 * hr + 1];
                *reinterpret_cast<float2 *>(kr + i * 8) = x;
            }
            if (i < NVT) {
                const int iv = i < NVT ? i : 0;
                float2 y = *reinterpret_cast<float2 *>(vr + i * 8);
                y.x += dva[iv][2 * hr];
                y.y += dva[iv][2 * hr + 1];
                *reinterpret_cast<float2 *>(vr + i * 8) = y;
            }
        }
    }
}

// dQ of 64 MT packed rows per block (key columns DK, value columns DV; warp w owns rows
// 16 w + 64 mt). Shared memory: two stages of K [BN][DK+8], V [BN][DV+8]. QREG (MT = 1, BN = 64):
// Q and dO are staged through the second stage, then live in registers; otherwise they stay in
// shared memory (MT = 2: no room in registers, and each K / V fragment feeds two row tiles;
// Dk = 192: dQ alone takes 96 accumulator registers).
template <int DK, int DV, int BN, int MT, bool QREG_>
struct DqCfg {
    static constexpr int LDK = DK + 8, LDV = DV + 8, STG = BN * (LDK + LDV), BMB = BM * MT;
    static constexpr bool QREG = QREG_;
    static constexpr size_t smem() {
        return sizeof(uint16_t) * ((size_t)2 * STG + (QREG ? 0 : (size_t)BMB * (LDK + LDV)));
    }
    static_assert(!QREG || (MT == 1 && BN == BM), "Q and dO staging must fit into one stage");
    static_assert(DK % 16 == 0 && DV % 16 == 0 && BN % 16 == 0, "tile shapes");
};

template <int DK, int DV, int BN, int MT, bool QREG_, bool VL>
__global__ void __launch_bounds__(128, 2)
    attn2_bwd_dq_k(A2 a, const uint16_t *__restrict__ dout, const float *__restrict__ lse,
                   const float *__restrict__ Dd, float *__restrict__ dq, const AttnVl vl) {
    using C = DqCfg<DK, DV, BN, MT, QREG_>;
    constexpr int LDK = C::LDK, LDV = C::LDV, STG = C::STG, BMB = C::BMB, NST = BN / 8,
                  NDT = DK / 8, KSK = DK / 16, KSV = DV / 16, KS = KSK > KSV ? KSK : KSV;
    constexpr bool QREG = C::QREG;
    extern __shared__ __align__(16) unsigned char sm_[];
    uint16_t *sT = reinterpret_cast<uint16_t *>(sm_);
    uint16_t *sQ = QREG ? sT + STG : sT + 2 * STG, *sO = sQ + BMB * LDK;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
    int bx = gridDim.x - 1 - blockIdx.x;
    int k0 = 0;
    if (VL) bx = attn_vl_dq_block(a, vl, dout, lse, Dd, dq, &k0);
    (void)k0;
    const int j = blockIdx.y, rho0 = bx * BMB;

    auto rowsrc = [&](const uint16_t *base, int ld) {
        return [=, &a](int r) -> const uint16_t * {
            int rho = rho0 + r;
            return rho < a.nrows ? base + row_ih(a, j, rho) * ld : nullptr;
        };
    };
    load_tile<128, BMB, DK>(sQ, LDK, rowsrc(a.q, DK), a.q);
    load_tile<128, BMB, DV>(sO, LDV, rowsrc(dout, DV), dout);
    cp_async_commit();
    const int last = min(rho0 + BMB, a.nrows) - 1;
    const int nkb = (a.off + last / a.G) / BN + 1;
    auto issue = [&](int kb) {
        const int s0 = kb * BN;
        uint16_t *dK = sT + (kb & 1) * STG;
        load_tile<128, BN, DK>(dK, LDK, [&](int r) -> const uint16_t * {
            return s0 + r < a.Tk ? a.k + (size_t)(s0 + r) * a.ldk + (size_t)j * DK : nullptr;
        }, a.k);
        load_tile<128, BN, DV>(dK + BN * LDK, LDV, [&](int r) -> const uint16_t * {
            return s0 + r < a.Tk ? a.v + (size_t)(s0 + r) * a.ldv + (size_t)j * DV : nullptr;
        }, a.v);
        cp_async_commit();
    };
    issue(0);
    float Lr[MT][2], Dr[MT][2];  // rows past the end: finite, not stored
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int rho = rho0 + mt * BM + 16 * w + g + 8 * h;
            Lr[mt][h] = 0.f;
            Dr[mt][h] = 0.f;
            if (rho < a.nrows) {
                size_t ih = row_ih(a, j, rho);
                Lr[mt][h] = lse[ih] * kLog2e;
                Dr[mt][h] = Dd[ih];
            }
        }
    const int pos_first = a.off + rho0 / a.G;
    uint32_t qf[QREG ? KSK : 1][4], of[QREG ? KSV : 1][4];
    if (QREG) {
        cp_async_wait<1>();
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < (QREG ? KS : 0); ks++) {
            if (ks < KSK) ldsm_x4(qf[ks < KSK ? ks : 0], adr_a(sQ + 16 * w * LDK, LDK, ks * 16, lane));
            if (ks < KSV) ldsm_x4(of[ks < KSV ? ks : 0], adr_a(sO + 16 * w * LDV, LDV, ks * 16, lane));
        }
        __syncthreads();
    }

    float acc[MT][NDT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < NDT; i++) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.f;
    for (int kb = 0; kb < nkb; kb++) {
        cp_async_next(kb, nkb, issue);
        __syncthreads();
        const uint16_t *tK = sT + (kb & 1) * STG, *tV = tK + BN * LDK;
        float p[MT][NST][4], dp_[MT][NST][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int i = 0; i < NST; i++) {
                p[mt][i][0] = p[mt][i][1] = p[mt][i][2] = p[mt][i][3] = 0.f;
                dp_[mt][i][0] = dp_[mt][i][1] = dp_[mt][i][2] = dp_[mt][i][3] = 0.f;
            }
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            // (S over the DK key columns, dP over the DV value columns: both while ks < both)
            const bool kq = ks < KSK, kv = ks < KSV;
            uint32_t aq[MT][4], ao[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                if (QREG) {
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        if (kq) aq[mt][e] = qf[QREG && kq ? ks : 0][e];
                        if (kv) ao[mt][e] = of[QREG && kv ? ks : 0][e];
                    }
                } else {
                    if (kq) ldsm_x4(aq[mt], adr_a(sQ + (mt * BM + 16 * w) * LDK, LDK, ks * 16, lane));
                    if (kv) ldsm_x4(ao[mt], adr_a(sO + (mt * BM + 16 * w) * LDV, LDV, ks * 16, lane));
                }
            }
#pragma unroll
            for (int np = 0; np < NST / 2; np++) {
                uint32_t b[4];
                if (kq) {
                    ldsm_x4(b, adr_b_nk(tK, LDK, ks * 16, np * 16, lane));
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        mma_bf16_16816(p[mt][2 * np], aq[mt], b);
                        mma_bf16_16816(p[mt][2 * np + 1], aq[mt], b + 2);
                    }
                }
                if (kv) {
                    ldsm_x4(b, adr_b_nk(tV, LDV, ks * 16, np * 16, lane));
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        mma_bf16_16816(dp_[mt][2 * np], ao[mt], b);
                        mma_bf16_16816(dp_[mt][2 * np + 1], ao[mt], b + 2);
                    }
                }
            }
        }
        const int s0 = kb * BN;
        const bool diag = s0 + BN - 1 > pos_first;
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            int pos0 = 0, pos1 = 0;
            if (diag) {
                const int r = rho0 + mt * BM + 16 * w + g;
                pos0 = a.off + r / a.G;
                pos1 = a.off + (r + 8) / a.G;
            }
#pragma unroll
            for (int nt = 0; nt < NST; nt++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int key = s0 + nt * 8 + 2 * t + e;
                    float x0 = ex2(p[mt][nt][e] * a.sl2 - Lr[mt][0]);
                    float x1 = ex2(p[mt][nt][2 + e] * a.sl2 - Lr[mt][1]);
                    if (diag) {
                        x0 = key > pos0 ? 0.f : x0;
                        x1 = key > pos1 ? 0.f : x1;
                    }
                    dp_[mt][nt][e] = x0 * (dp_[mt][nt][e] - Dr[mt][0]);
                    dp_[mt][nt][2 + e] = x1 * (dp_[mt][nt][2 + e] - Dr[mt][1]);
                }
            }
        }
        // dQ += dS K
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            uint32_t af[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) acc_to_a(af[mt], dp_[mt][2 * kk], dp_[mt][2 * kk + 1]);
#pragma unroll
            for (int dp = 0; dp < NDT / 2; dp++) {
                uint32_t b[4];
                ldsm_x4_t(b, adr_b_kn(tK, LDK, kk * 16, dp * 16, lane));
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    mma_bf16_16816(acc[mt][2 * dp], af[mt], b);
                    mma_bf16_16816(acc[mt][2 * dp + 1], af[mt], b + 2);
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int rho = rho0 + mt * BM + 16 * w + g + 8 * hr;
            if (rho >= a.nrows) continue;
            float *drow = dq + row_ih(a, j, rho) * DK + 2 * t;
#pragma unroll
            for (int i = 0; i < NDT; i++)
                *reinterpret_cast<float2 *>(drow + i * 8) =
                    make_float2(a.scale * acc[mt][i][2 * hr], a.scale * acc[mt][i][2 * hr + 1]);
        }
}

// (vt: a varlen call's tables, attn/varlen.cuh; a is then the whole pack's)
template <int DK, int DV, int BN, int MT, bool QREG>
int launch_dq_(mtrl_cuda_ctx *c, const A2 &a, int Hk, const uint16_t *dout, const float *lse,
                const float *D, float *dq, const AttnVlTab *vt) {
    using Cq = DqCfg<DK, DV, BN, MT, QREG>;
    MTRL_CUDA_REQUIRE(Cq::smem() <= c->smem_optin, "shared memory %zu > %zu", Cq::smem(),
                      c->smem_optin);
    if (vt) {
        int nb;
        const AttnVl v = vt->view(false, Cq::BMB, &nb);
        auto kernel = attn2_bwd_dq_k<DK, DV, BN, MT, QREG, true>;
        set_smem(kernel, Cq::smem());
        kernel<<<dim3(nb, Hk), 128, Cq::smem(), c->stream>>>(a, dout, lse, D, dq, v);
    } else {
        auto kernel = attn2_bwd_dq_k<DK, DV, BN, MT, QREG, false>;
        set_smem(kernel, Cq::smem());
        kernel<<<dim3(cdiv((size_t)a.nrows, Cq::BMB), Hk), 128, Cq::smem(), c->stream>>>(a, dout, lse, D, dq,
                                                                                         AttnVl{});
    }
    CUDA_LAUNCH_CHECK();
    return 0;
}

template <int DK, int DV, int BR>
int launch_dkv_(mtrl_cuda_ctx *c, const A2 &a, int Hk, const uint16_t *dout, const float *lse,
                const float *D, float *dk, float *dv, const AttnVlTab *vt) {
    const size_t sh = DkvCfg<DK, DV, BR>::smem();
    MTRL_CUDA_REQUIRE(sh <= c->smem_optin, "shared memory %zu > %zu", sh, c->smem_optin);
    if (vt) {
        int nb;
        const AttnVl v = vt->view(true, DkvCfg<DK, DV, BR>::BN, &nb);
        set_smem(attn2_bwd_dkv_k<DK, DV, BR, true>, sh);
        attn2_bwd_dkv_k<DK, DV, BR, true><<<dim3(nb, Hk), 128, sh, c->stream>>>(a, dout, lse, D, dk, dv, v);
    } else {
        set_smem(attn2_bwd_dkv_k<DK, DV, BR, false>, sh);
        attn2_bwd_dkv_k<DK, DV, BR, false><<<dim3(cdiv(a.Tk, 64), Hk), 128, sh, c->stream>>>(a, dout, lse, D, dk,
                                                                                             dv, AttnVl{});
    }
    CUDA_LAUNCH_CHECK();
    return 0;
}

// v3 (attn/sm90a/causal_wgmma.cu) unless the option attn = MMA, on a compute capability 9.0 device
// (its code is sm_90a only).
int attn3_on_(const mtrl_cuda_ctx *c) { return c->opts.attn != MTRL_KOPT_MMA && c->cc == 90; }

// Which kernel runs (3, 2 or 1) with the context's options on its device: the one chooser of
// the causal attention.
int attn_version_(const mtrl_cuda_ctx *c, int H, int Hk, int Dk, int Dv, int alias, int bwd) {
    if (c->opts.attn == MTRL_KOPT_SIMT || H <= 0 || Hk <= 0 || H % Hk) return 1;
    // naive MLA: d_n + d_r = 192, d_v = 128
    if (!alias && (Dk == 128 || Dk == 192) && Dv == 128) return attn3_on_(c) ? 3 : 2;
    if (!bwd && alias && Hk == 1 && Dk == 576 && Dv == 512) return 2;
    return 1;
}

// One forward configuration per shape, the fastest measured (docs/kernel-lab.md, "v2"); the
// others measured left the tree (the same page says which commit last had them).
template <int DK, int DVS, int NVW, int BN, bool QREG, bool ALIAS, int MT, int MINB>
int launch_fwd_(mtrl_cuda_ctx *c, const A2 &a, int Hk, float *o, float *lse, const AttnVlTab *vt) {
    using Cf = FwdCfg<DK, DVS, NVW, BN, QREG, ALIAS, MT>;
    const size_t sh = Cf::smem();
    MTRL_CUDA_REQUIRE(sh <= c->smem_optin, "shared memory %zu > %zu", sh, c->smem_optin);
    if (vt) {
        int nb;
        const AttnVl v = vt->view(false, Cf::BMB, &nb);
        auto kernel = attn2_fwd_k<DK, DVS, NVW, BN, QREG, ALIAS, MT, MINB, true>;
        set_smem(kernel, sh);
        kernel<<<dim3(nb, Hk, a.Dv / Cf::DVB), Cf::NT, sh, c->stream>>>(a, o, lse, v);
    } else {
        auto kernel = attn2_fwd_k<DK, DVS, NVW, BN, QREG, ALIAS, MT, MINB, false>;
        set_smem(kernel, sh);
        dim3 grid(cdiv((size_t)a.nrows, Cf::BMB), Hk, a.Dv / Cf::DVB);
        kernel<<<grid, Cf::NT, sh, c->stream>>>(a, o, lse, AttnVl{});
    }
    CUDA_LAUNCH_CHECK();
    return 0;
}

// v3's head-major lse and D copies of a varlen call (attn/args.cuh, attn2_bwd_pre_k's Lt, Dt),
// per piece at vt's lo (npad_p = Tq_p rounded up to 64 rows per head): one thread per entry of
// the piece's npad_p rows and H heads, +inf and 0 past its Tq_p.
__global__ void attn2_vl_lt_k(int n, const int *__restrict__ qo, const int *__restrict__ lo, int H,
                              const float *__restrict__ lse, const float *__restrict__ D,
                              float *__restrict__ Lt, float *__restrict__ Dt) {
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= lo[n]) return;
    const int p = vl_piece_of(lo, n, e), Tq = qo[p + 1] - qo[p], npad = (Tq + 63) / 64 * 64;
    const int r = e - lo[p], h = r / npad, i = r - h * npad;
    const size_t row = ((size_t)qo[p] + i) * H + h;
    Lt[e] = i < Tq ? lse[row] * kLog2e : INFINITY;
    Dt[e] = i < Tq ? D[row] : 0.f;
}

}  // namespace

// The same, public; see kernels_cuda.h.
extern "C" int mtrl_attn_causal_version(const mtrl_cuda_ctx *c, int H, int Hk, int Dk, int Dv, int alias,
                                        int bwd) {
    return attn_version_(c, H, Hk, Dk, Dv, alias, bwd);
}

// The v2 launchers behind mtrl_attn_causal_fwd/bwd (mla/attn_decode.cu has checked the arguments:
// Tq <= Tk, 16-byte aligned rows and pointers, dv == dk when aliased). They return 1, launching
// nothing, for a shape v2 does not take, so the caller runs v1.
static int attn2_fwd_(mtrl_cuda_ctx *c, const AttnVlTab *vt, int Tq, int Tk, int H, int Hk, int Dk, int Dv,
                      float scale, const mtrl_bf16 *q, const mtrl_bf16 *k, int ldk, const mtrl_bf16 *v, int ldv,
                      float *o, float *lse) {
    const int alias = Hk == 1 && v == k && ldv == ldk && Dv <= Dk;
    const int ver = attn_version_(c, H, Hk, Dk, Dv, alias, 0);
    if (ver < 2) return 1;
    if ((uintptr_t)o & 7) return 1;  // float2 stores
    if (Tq == 0) return 0;
    A2 a = attn_args_make(Tq, Tk, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv);
    if (ver == 3) {
        const int r = attn3_fwd_launch(c, a, Hk, o, lse, vt);
        if (r <= 0) return r;  // else: declined, v2 below
    }
    if (!alias && Dk == 192) return launch_fwd_<192, 128, 1, 32, false, false, 2, 2>(c, a, Hk, o, lse, vt);  // Dv = 128
    if (!alias) return launch_fwd_<128, 128, 1, 64, false, false, 2, 2>(c, a, Hk, o, lse, vt);
    return launch_fwd_<576, 256, 2, 64, false, true, 1, 1>(c, a, 1, o, lse, vt);
}

// ws (varlen only): attn_vl_bwd_floats of scratch for D and v3's head-major copies.
static int attn2_bwd_(mtrl_cuda_ctx *c, const AttnVlTab *vt, int Tq, int Tk, int H, int Hk, int Dk, int Dv,
                      float scale, const mtrl_bf16 *q, const mtrl_bf16 *k, int ldk, const mtrl_bf16 *v, int ldv,
                      const float *o, const float *lse, const mtrl_bf16 *dout, float *dq, float *dk, float *dv,
                      float *ws) {
    const int alias = Hk == 1 && v == k && ldv == ldk && Dv <= Dk;
    const int ver = attn_version_(c, H, Hk, Dk, Dv, alias, 1);
    if (ver < 2) return 1;
    if (((uintptr_t)o & 15) || (((uintptr_t)dq | (uintptr_t)dk | (uintptr_t)dv) & 7))
        return 1;  // float4 loads of o, float2 accesses of dq, dk, dv
    if (Tq == 0) return 0;
    A2 a = attn_args_make(Tq, Tk, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv);
    // D [Tq][H], and for v3 with MHA rows its head-major copies with lse (attn/args.cuh)
    const int rows = Tq * H, tcopy = ver == 3 && H == Hk;
    int npad = (Tq + 63) / 64 * 64;
    float *D, *Lt = nullptr, *Dt = nullptr;
    if (!vt) {
        ws_carver sz{nullptr, 0};
        sz.take<float>((size_t)rows);
        if (tcopy) sz.take<float>(2 * (size_t)H * npad);
        ws_carver wc{(char *)mtrl_ctx_scratch(c, sz.off), 0};
        D = wc.take<float>((size_t)rows);
        Lt = tcopy ? wc.take<float>(2 * (size_t)H * npad) : nullptr;
        Dt = tcopy ? Lt + (size_t)H * npad : nullptr;
        const int warps = rows + (tcopy ? H * (npad - Tq) : 0);
        attn2_bwd_pre_k<<<cdiv(warps, 8), 256, 0, c->stream>>>(rows, Dv, dout, o, D, lse, H, Tq, npad, Lt, Dt);
        CUDA_LAUNCH_CHECK();
    } else {  // D over the whole pack (each row's the same as in its piece's call), copies per piece
        const int nlo = vt->lo[vt->n];
        D = ws;
        npad = 0;
        attn2_bwd_pre_k<<<cdiv(rows, 8), 256, 0, c->stream>>>(rows, Dv, dout, o, D, lse, H, Tq, 0, nullptr,
                                                               nullptr);
        CUDA_LAUNCH_CHECK();
        if (tcopy) {
            Lt = ws + attn_vl_round64((size_t)rows);
            Dt = Lt + nlo;
            int nb;
            const AttnVl vv = vt->view(false, 64, &nb);
            if (nlo) attn2_vl_lt_k<<<cdiv(nlo, 256), 256, 0, c->stream>>>(vt->n, vv.qo, vv.lo, H, lse, D, Lt, Dt);
            CUDA_LAUNCH_CHECK();
        }
    }
    // v3: dK / dV and dQ on wgmma (attn/sm90a/causal_wgmma.cu)
    const int dkv3 = ver == 3 ? attn3_dkv_launch(c, a, Hk, dout, lse, D, Lt, Dt, npad, dk, dv, vt) : 1;
    if (dkv3 < 0) return -1;
    if (dkv3 == 0) {
        const int dq3 = attn3_dq_launch(c, a, Hk, dout, lse, D, dq, vt);
        if (dq3 <= 0) return dq3;
        if (Dk == 192) return launch_dq_<192, 128, 32, 1, false>(c, a, Hk, dout, lse, D, dq, vt);
        return launch_dq_<128, 128, 32, 2, false>(c, a, Hk, dout, lse, D, dq, vt);
    }
    if (Dk == 192) {  // Dv = 128: 32-row query tiles in dkv, one row tile per warp in dq
        if (launch_dkv_<192, 128, 32>(c, a, Hk, dout, lse, D, dk, dv, vt)) return -1;
        return launch_dq_<192, 128, 32, 1, false>(c, a, Hk, dout, lse, D, dq, vt);
    }
    if (launch_dkv_<128, 128, 64>(c, a, Hk, dout, lse, D, dk, dv, vt)) return -1;
    // dq: two row tiles per warp, 32-key tiles (faster than one row tile with Q and dO in
    // registers, docs/kernel-lab.md)
    return launch_dq_<128, 128, 32, 2, false>(c, a, Hk, dout, lse, D, dq, vt);
}

extern "C" int mtrl_attn2_causal_fwd(mtrl_cuda_ctx *c, int Tq, int Tk, int H, int Hk, int Dk,
                                     int Dv, float scale, const mtrl_bf16 *q, const mtrl_bf16 *k,
                                     int ldk, const mtrl_bf16 *v, int ldv, float *o, float *lse) {
    return attn2_fwd_(c, nullptr, Tq, Tk, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv, o, lse);
}

extern "C" int mtrl_attn2_causal_bwd(mtrl_cuda_ctx *c, int Tq, int Tk, int H, int Hk, int Dk,
                                     int Dv, float scale, const mtrl_bf16 *q, const mtrl_bf16 *k,
                                     int ldk, const mtrl_bf16 *v, int ldv, const float *o,
                                     const float *lse, const mtrl_bf16 *dout, float *dq,
                                     float *dk, float *dv) {
    return attn2_bwd_(c, nullptr, Tq, Tk, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv, o, lse, dout, dq, dk, dv,
                      nullptr);
}

// The varlen forms (attn/varlen.cuh): the same choices and launchers on the pack, vt's lists.
int attn2_causal_fwd_vl(mtrl_cuda_ctx *c, const AttnVlTab &vt, int H, int Hk, int Dk, int Dv, float scale,
                        const mtrl_bf16 *q, const mtrl_bf16 *k, int ldk, const mtrl_bf16 *v, int ldv, float *o,
                        float *lse) {
    return attn2_fwd_(c, &vt, vt.Tq, vt.Tk, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv, o, lse);
}
int attn2_causal_bwd_vl(mtrl_cuda_ctx *c, const AttnVlTab &vt, int H, int Hk, int Dk, int Dv, float scale,
                        const mtrl_bf16 *q, const mtrl_bf16 *k, int ldk, const mtrl_bf16 *v, int ldv, const float *o,
                        const float *lse, const mtrl_bf16 *dout, float *dq, float *dk, float *dv, float *ws) {
    return attn2_bwd_(c, &vt, vt.Tq, vt.Tk, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv, o, lse, dout, dq, dk, dv, ws);
}
