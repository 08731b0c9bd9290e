// attn_wg_cuda.cu: v3 of the causal attention (forward, and the backward's dK / dV and dQ), on
// Hopper's warpgroup MMA: every product is a wgmma reading its shared-memory operands through
// descriptors (wgmma.cuh), so the operand fragments no longer pass through registers
// (v2, attn_tc_cuda.cu, spends 251 registers and runs at 12% occupancy: docs/kernel-lab.md).
// Compiled for sm_90a only (the arch-specific wgmma instructions); the launcher declines any
// other device, and the caller runs v2.
//
// attn3_bwd_dkv_k<DK, DV>: grid (key blocks of 128, Hk), 256 threads = two warpgroups; warpgroup
// w owns keys 64 w .. 64 w + 63 of the block and holds their dK (DK / 2 fp32 registers per
// thread) and dV (DV / 2). K and V of the block are loaded once; 64-row tiles of packed queries
// (Q, dO, lse, D) stream through two stages by cp.async (tile n + 1 lands while tile n is
// multiplied). Per tile and warpgroup (skipped when none of its keys is visible to the tile):
//   Sᵀ = K Qᵀ      wgmma m64n64k16, A = K (K-major), B = the Q tile (K-major), DK / 16 steps
//   dPᵀ = V dOᵀ    the same over DV
//   Pᵀ = 2^(Sᵀ sl2 − lse2), zero after each row's position; dSᵀ = Pᵀ ⊙ (dPᵀ − D)
//   dV += Pᵀ dO    wgmma m64n(DV)k16, A = Pᵀ from registers (the accumulator layout of Sᵀ is the
//                  A-fragment layout, as in FA2/FA3), B = the dO tile (MN-major), 4 steps
//   dK += dSᵀ Q    wgmma m64n(DK)k16, A = dSᵀ from registers, B = the Q tile (MN-major)
// then dk += scale dK, dv += dV once (each key belongs to one block: nothing atomic, the
// summation order is fixed, so results are bit-reproducible).
// Shared memory (Dk 192): K 48 KB, V 32 KB, two stages of Q 24 KB + dO 16 KB, lse and D.
#include <math.h>

#include "kernels/cuda/attn_args.cuh"
#include "kernels/cuda/sm90a/wgmma.cuh"

namespace {

template <int DK, int DV>
struct Wdkv {
    static constexpr int BN = 128, BR = 64, NT = 256;
    static constexpr int KB = BN * DK * 2, VB = BN * DV * 2, QB = BR * DK * 2, OB = BR * DV * 2;
    static constexpr int oK = 0, oV = KB, oQ = KB + VB, oO = oQ + 2 * QB, oL = oO + 2 * OB;
    // + 1 KB: the dynamic shared memory is aligned to 1024 bytes by hand
    static constexpr size_t smem() { return (size_t)oL + 4 * BR * sizeof(float) + 1024; }
    static_assert(DK % 64 == 0 && DV % 64 == 0, "64-column blocks");
};

template <int DK, int DV>
__global__ void __launch_bounds__(256, 1)
    attn3_bwd_dkv_k(A2 a, const uint16_t *__restrict__ dout, const float *__restrict__ lse,
                    const float *__restrict__ Dd, float *__restrict__ dk, float *__restrict__ dv) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using C = Wdkv<DK, DV>;
    constexpr int BN = C::BN, BR = C::BR, NT = C::NT;
    extern __shared__ __align__(1024) unsigned char sm_raw[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(sm_raw);
    unsigned char *sm = sm_raw + ((1024u - (raw & 1023u)) & 1023u);
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(sm);
    float *sL = reinterpret_cast<float *>(sm + C::oL), *sD = sL + 2 * BR;

    const int tid = threadIdx.x, wg = tid >> 7, wi = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int j = blockIdx.y, s0 = blockIdx.x * BN;
    const int kw0 = s0 + 64 * wg;                          // the warpgroup's first key
    const int i_first = s0 - a.off > 0 ? s0 - a.off : 0;  // first token that sees key s0
    const int rt0 = i_first * a.G / BR, nrt = (a.nrows + BR - 1) / BR;

    wg_load_tile<NT, BN, DK>(sm + C::oK, tid, [&](int r) -> const uint16_t * {
        return s0 + r < a.Tk ? a.k + (size_t)(s0 + r) * a.ldk + (size_t)j * DK : nullptr;
    }, a.k);
    wg_load_tile<NT, BN, DV>(sm + C::oV, tid, [&](int r) -> const uint16_t * {
        return s0 + r < a.Tk ? a.v + (size_t)(s0 + r) * a.ldv + (size_t)j * DV : nullptr;
    }, a.v);
    auto issue = [&](int rt) {
        const int st = rt & 1, rho0 = rt * BR;
        wg_load_tile<NT, BR, DK>(sm + C::oQ + st * C::QB, tid, [&](int r) -> const uint16_t * {
            const int rho = rho0 + r;
            return rho < a.nrows ? a.q + row_ih(a, j, rho) * DK : nullptr;
        }, a.q);
        wg_load_tile<NT, BR, DV>(sm + C::oO + st * C::OB, tid, [&](int r) -> const uint16_t * {
            const int rho = rho0 + r;
            return rho < a.nrows ? dout + row_ih(a, j, rho) * DV : nullptr;
        }, dout);
        if (tid < BR) {  // rows past the end: P = 2^-inf = 0, so they add nothing
            const int rho = rho0 + tid;
            const size_t ih = rho < a.nrows ? row_ih(a, j, rho) : 0;
            sL[st * BR + tid] = rho < a.nrows ? lse[ih] * kAttnLog2e : INFINITY;
            sD[st * BR + tid] = rho < a.nrows ? Dd[ih] : 0.f;
        }
        cp_async_commit();
    };
    if (rt0 < nrt) issue(rt0);  // (K, V ride in the same group)
    else cp_async_commit();

    float dka[DK / 2], dva[DV / 2];
#pragma unroll
    for (int i = 0; i < DK / 2; i++) dka[i] = 0.f;
#pragma unroll
    for (int i = 0; i < DV / 2; i++) dva[i] = 0.f;
    const int kr0 = kw0 + 16 * wi + g, kr1 = kr0 + 8;  // the thread's two key rows

    for (int rt = rt0; rt < nrt; rt++) {
        if (rt + 1 < nrt) {
            issue(rt + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        wg_fence_proxy();  // the landed cp.async bytes, visible to wgmma
        __syncthreads();
        const int st = rt & 1, rho0 = rt * BR;
        const int last = (rho0 + BR < a.nrows ? rho0 + BR : a.nrows) - 1;
        if (a.off + last / a.G >= kw0) {  // some row of the tile sees the warpgroup's keys
            const uint32_t tQ = base + C::oQ + st * C::QB, tO = base + C::oO + st * C::OB;
            float sT[32], dpT[32];
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < DK / 16; ks++)
                wg_ss<0>(sT, wg_desc_k(base + C::oK, BN, 64 * wg, ks), wg_desc_k(tQ, BR, 0, ks),
                         ks);
#pragma unroll
            for (int ks = 0; ks < DV / 16; ks++)
                wg_ss<0>(dpT, wg_desc_k(base + C::oV, BN, 64 * wg, ks), wg_desc_k(tO, BR, 0, ks),
                         ks);
            wg_commit();
            wg_wait<0>();
            wg_hold(sT);
            wg_hold(dpT);
            // Pᵀ (in sT) and dSᵀ (in dpT); column c of the tile is packed row rho0 + c
            const float *tL = sL + st * BR, *tD = sD + st * BR;
            const bool diag = a.off + rho0 / a.G < kw0 + 63;
#pragma unroll
            for (int n8 = 0; n8 < 8; n8++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int c = 8 * n8 + 2 * t + e;
                    const float L = tL[c], dd = tD[c];
                    float x0 = ex2(sT[4 * n8 + e] * a.sl2 - L);
                    float x1 = ex2(sT[4 * n8 + 2 + e] * a.sl2 - L);
                    if (diag) {
                        const int pos = a.off + (rho0 + c) / a.G;
                        x0 = kr0 > pos ? 0.f : x0;
                        x1 = kr1 > pos ? 0.f : x1;
                    }
                    sT[4 * n8 + e] = x0;
                    sT[4 * n8 + 2 + e] = x1;
                    dpT[4 * n8 + e] = x0 * (dpT[4 * n8 + e] - dd);
                    dpT[4 * n8 + 2 + e] = x1 * (dpT[4 * n8 + 2 + e] - dd);
                }
            }
            uint32_t pa[4][4], da[4][4];  // A fragments of the four 16-row K steps
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
#pragma unroll
                for (int h = 0; h < 4; h++) {
                    pa[kk][h] = pack_bf16(sT[8 * kk + 2 * h], sT[8 * kk + 2 * h + 1]);
                    da[kk][h] = pack_bf16(dpT[8 * kk + 2 * h], dpT[8 * kk + 2 * h + 1]);
                }
            }
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < 4; kk++) wg_rs<1>(dva, pa[kk], wg_desc_mn(tO, BR, 0, kk), 1);
#pragma unroll
            for (int kk = 0; kk < 4; kk++) wg_rs<1>(dka, da[kk], wg_desc_mn(tQ, BR, 0, kk), 1);
            wg_commit();
            wg_wait<0>();
            wg_hold(dka);
            wg_hold(dva);
        }
        __syncthreads();  // this stage is overwritten by the next iteration's issue
    }
    cp_async_wait<0>();
    // dk += scale dK, dv += dV: the block owns these keys, one read-modify-write each
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int key = hr ? kr1 : kr0;
        if (key >= a.Tk) continue;
        float *kr = dk + (size_t)key * a.ldk + (size_t)j * DK + 2 * t;
        float *vr = dv + (size_t)key * a.ldv + (size_t)j * DV + 2 * t;
#pragma unroll
        for (int n8 = 0; n8 < DK / 8; n8++) {
            float2 x = *reinterpret_cast<float2 *>(kr + 8 * n8);
            x.x += a.scale * dka[4 * n8 + 2 * hr];
            x.y += a.scale * dka[4 * n8 + 2 * hr + 1];
            *reinterpret_cast<float2 *>(kr + 8 * n8) = x;
        }
#pragma unroll
        for (int n8 = 0; n8 < DV / 8; n8++) {
            float2 y = *reinterpret_cast<float2 *>(vr + 8 * n8);
            y.x += dva[4 * n8 + 2 * hr];
            y.y += dva[4 * n8 + 2 * hr + 1];
            *reinterpret_cast<float2 *>(vr + 8 * n8) = y;
        }
    }
#endif
}

// Forward: o and lse of 128 packed query rows per block (two warpgroups x 64 rows; the block's
// Q tile is loaded once), 128-key tiles of K and V through two cp.async stages:
//   S = Q Kᵀ    wgmma m64n128k16, A = the warpgroup's Q rows (K-major), B = the K tile (K-major)
//   online softmax in base 2 in registers (rows g, g + 8 of each warp: quad shuffles)
//   O += P V    wgmma m64n(DV)k16, A = P from registers, B = the V tile (MN-major)
// Shared memory (Dk 192): Q 48 KB, two stages of K 48 KB + V 32 KB.
template <int DK, int DV>
struct Wfwd {
    static constexpr int BM = 128, BN = 128, NT = 256;
    static constexpr int QB = BM * DK * 2, KB = BN * DK * 2, VB = BN * DV * 2;
    static constexpr int oQ = 0, oK = QB, oV = QB + 2 * KB;
    static constexpr size_t smem() { return (size_t)oV + 2 * VB + 1024; }
    static_assert(DK % 64 == 0 && DV % 64 == 0, "64-column blocks");
};

template <int DK, int DV>
__global__ void __launch_bounds__(256, 1)
    attn3_fwd_k(A2 a, float *__restrict__ o, float *__restrict__ lse) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using C = Wfwd<DK, DV>;
    constexpr int BM = C::BM, BN = C::BN, NT = C::NT;
    extern __shared__ __align__(1024) unsigned char sm_raw[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(sm_raw);
    unsigned char *sm = sm_raw + ((1024u - (raw & 1023u)) & 1023u);
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(sm);

    const int tid = threadIdx.x, wg = tid >> 7, wi = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int j = blockIdx.y, rho0 = (gridDim.x - 1 - blockIdx.x) * BM;  // heaviest first
    wg_load_tile<NT, BM, DK>(sm + C::oQ, tid, [&](int r) -> const uint16_t * {
        const int rho = rho0 + r;
        return rho < a.nrows ? a.q + row_ih(a, j, rho) * DK : nullptr;
    }, a.q);
    auto issue = [&](int kb) {
        const int k0 = kb * BN, st = kb & 1;
        wg_load_tile<NT, BN, DK>(sm + C::oK + st * C::KB, tid, [&](int r) -> const uint16_t * {
            return k0 + r < a.Tk ? a.k + (size_t)(k0 + r) * a.ldk + (size_t)j * DK : nullptr;
        }, a.k);
        wg_load_tile<NT, BN, DV>(sm + C::oV + st * C::VB, tid, [&](int r) -> const uint16_t * {
            return k0 + r < a.Tk ? a.v + (size_t)(k0 + r) * a.ldv + (size_t)j * DV : nullptr;
        }, a.v);
        cp_async_commit();
    };
    issue(0);  // (Q rides in the same group)
    int pos[2];
#pragma unroll
    for (int h = 0; h < 2; h++) pos[h] = a.off + (rho0 + 64 * wg + 16 * wi + g + 8 * h) / a.G;
    const int last = min(rho0 + BM, a.nrows) - 1;
    const int nkb = (a.off + last / a.G) / BN + 1;  // key tiles up to the block's last row
    const int wlast = min(rho0 + 64 * wg + 63, a.nrows - 1);
    const int wpos_last = a.off + wlast / a.G;  // the warpgroup's last row
    const int wpos_first = a.off + (rho0 + 64 * wg) / a.G;

    float oacc[DV / 2], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < DV / 2; i++) oacc[i] = 0.f;
    for (int kb = 0; kb < nkb; kb++) {
        if (kb + 1 < nkb) {
            issue(kb + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        wg_fence_proxy();
        __syncthreads();
        const int k0 = kb * BN, st = kb & 1;
        if (k0 <= wpos_last) {
            const uint32_t tK = base + C::oK + st * C::KB, tV = base + C::oV + st * C::VB;
            float s[BN / 2];
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < DK / 16; ks++)
                wg_ss<0>(s, wg_desc_k(base + C::oQ, BM, 64 * wg, ks), wg_desc_k(tK, BN, 0, ks), ks);
            wg_commit();
            wg_wait<0>();
            wg_hold(s);
            const bool diag = k0 + BN - 1 > wpos_first;
            float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int n8 = 0; n8 < BN / 8; n8++)
#pragma unroll
                for (int h = 0; h < 2; h++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        float x = s[4 * n8 + 2 * h + e] * a.sl2;
                        if (diag) x = k0 + 8 * n8 + 2 * t + e > pos[h] ? -INFINITY : x;
                        s[4 * n8 + 2 * h + e] = x;
                        mx[h] = fmaxf(mx[h], x);
                    }
            float al[2], bse[2];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
                const float mn = fmaxf(m[h], mx[h]);
                // a row with no visible key yet keeps exponent base 0 (no -inf - -inf)
                bse[h] = mn == -INFINITY ? 0.f : mn;
                al[h] = ex2(m[h] - bse[h]);
                m[h] = mn;
            }
            float ps[2] = {0.f, 0.f};
#pragma unroll
            for (int n8 = 0; n8 < BN / 8; n8++)
#pragma unroll
                for (int h = 0; h < 2; h++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const float p = ex2(s[4 * n8 + 2 * h + e] - bse[h]);
                        s[4 * n8 + 2 * h + e] = p;
                        ps[h] += p;
                    }
#pragma unroll
            for (int h = 0; h < 2; h++) l[h] = l[h] * al[h] + ps[h];
#pragma unroll
            for (int n8 = 0; n8 < DV / 8; n8++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    oacc[4 * n8 + 2 * h] *= al[h];
                    oacc[4 * n8 + 2 * h + 1] *= al[h];
                }
            uint32_t pa[BN / 16][4];
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++)
#pragma unroll
                for (int h = 0; h < 4; h++) pa[kk][h] = pack_bf16(s[8 * kk + 2 * h], s[8 * kk + 2 * h + 1]);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) wg_rs<1>(oacc, pa[kk], wg_desc_mn(tV, BN, 0, kk), 1);
            wg_commit();
            wg_wait<0>();
            wg_hold(oacc);
        }
        __syncthreads();  // this stage is overwritten by the next iteration's issue
    }
    cp_async_wait<0>();
    // o = O / l; lse = ln 2 (m + log2 l). The row sums are per-thread partials until here.
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float lr = l[h];
        lr += __shfl_xor_sync(0xffffffffu, lr, 1);
        lr += __shfl_xor_sync(0xffffffffu, lr, 2);
        const int rho = rho0 + 64 * wg + 16 * wi + g + 8 * h;
        if (rho >= a.nrows) continue;
        const float inv = lr > 0.f ? 1.f / lr : 0.f;
        const size_t ih = row_ih(a, j, rho);
        float *orow = o + ih * DV + 2 * t;
#pragma unroll
        for (int n8 = 0; n8 < DV / 8; n8++)
            *reinterpret_cast<float2 *>(orow + 8 * n8) =
                make_float2(oacc[4 * n8 + 2 * h] * inv, oacc[4 * n8 + 2 * h + 1] * inv);
        if (t == 0) lse[ih] = (m[h] + log2f(lr)) * 0.6931471805599453f;
    }
#endif
}

// dQ of 128 packed query rows per block (two warpgroups x 64 rows; the block's Q and dO are
// loaded once), 64-key tiles of K and V through two cp.async stages:
//   S = Q Kᵀ    wgmma m64n64k16, A = the warpgroup's Q rows (K-major), B = the K tile (K-major)
//   dP = dO Vᵀ  the same over DV
//   dS = P ⊙ (dP − D), P = 2^(S sl2 − lse2) zero after each row's position
//   dQ += dS K  wgmma m64n(DK)k16, A = dS from registers, B = the K tile (MN-major)
// then dq = scale dQ (overwrite). Shared memory (Dk 192): Q 48 KB, dO 32 KB, two stages of
// K 24 KB + V 16 KB.
template <int DK, int DV>
struct Wdq {
    static constexpr int BM = 128, BN = 64, NT = 256;
    static constexpr int QB = BM * DK * 2, OB = BM * DV * 2, KB = BN * DK * 2, VB = BN * DV * 2;
    static constexpr int oQ = 0, oO = QB, oK = QB + OB, oV = oK + 2 * KB;
    static constexpr size_t smem() { return (size_t)oV + 2 * VB + 1024; }
    static_assert(DK % 64 == 0 && DV % 64 == 0, "64-column blocks");
};

template <int DK, int DV>
__global__ void __launch_bounds__(256, 1)
    attn3_bwd_dq_k(A2 a, const uint16_t *__restrict__ dout, const float *__restrict__ lse,
                   const float *__restrict__ Dd, float *__restrict__ dq) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using C = Wdq<DK, DV>;
    constexpr int BM = C::BM, BN = C::BN, NT = C::NT;
    extern __shared__ __align__(1024) unsigned char sm_raw[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(sm_raw);
    unsigned char *sm = sm_raw + ((1024u - (raw & 1023u)) & 1023u);
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(sm);

    const int tid = threadIdx.x, wg = tid >> 7, wi = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int j = blockIdx.y, rho0 = (gridDim.x - 1 - blockIdx.x) * BM;  // heaviest first
    wg_load_tile<NT, BM, DK>(sm + C::oQ, tid, [&](int r) -> const uint16_t * {
        const int rho = rho0 + r;
        return rho < a.nrows ? a.q + row_ih(a, j, rho) * DK : nullptr;
    }, a.q);
    wg_load_tile<NT, BM, DV>(sm + C::oO, tid, [&](int r) -> const uint16_t * {
        const int rho = rho0 + r;
        return rho < a.nrows ? dout + row_ih(a, j, rho) * DV : nullptr;
    }, dout);
    auto issue = [&](int kb) {
        const int k0 = kb * BN, st = kb & 1;
        wg_load_tile<NT, BN, DK>(sm + C::oK + st * C::KB, tid, [&](int r) -> const uint16_t * {
            return k0 + r < a.Tk ? a.k + (size_t)(k0 + r) * a.ldk + (size_t)j * DK : nullptr;
        }, a.k);
        wg_load_tile<NT, BN, DV>(sm + C::oV + st * C::VB, tid, [&](int r) -> const uint16_t * {
            return k0 + r < a.Tk ? a.v + (size_t)(k0 + r) * a.ldv + (size_t)j * DV : nullptr;
        }, a.v);
        cp_async_commit();
    };
    issue(0);  // (Q, dO ride in the same group)
    // the thread's two rows (g, g + 8 of its warp's 16): positions, lse (base 2), D
    int pos[2];
    float L[2], Dr[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int rho = rho0 + 64 * wg + 16 * wi + g + 8 * h;
        pos[h] = a.off + rho / a.G;
        const size_t ih = rho < a.nrows ? row_ih(a, j, rho) : 0;
        L[h] = rho < a.nrows ? lse[ih] * kAttnLog2e : INFINITY;
        Dr[h] = rho < a.nrows ? Dd[ih] : 0.f;
    }
    const int last = min(rho0 + BM, a.nrows) - 1;
    const int nkb = (a.off + last / a.G) / BN + 1;  // key tiles up to the block's last row
    const int wlast = min(rho0 + 64 * wg + 63, a.nrows - 1);
    const int wpos_last = a.off + (wlast >= 0 ? wlast : 0) / a.G;  // the warpgroup's last row
    const int wpos_first = a.off + (rho0 + 64 * wg) / a.G;

    float acc[DK / 2];
#pragma unroll
    for (int i = 0; i < DK / 2; i++) acc[i] = 0.f;
    for (int kb = 0; kb < nkb; kb++) {
        if (kb + 1 < nkb) {
            issue(kb + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        wg_fence_proxy();
        __syncthreads();
        const int k0 = kb * BN, st = kb & 1;
        if (k0 <= wpos_last) {  // some key of the tile is visible to the warpgroup's rows
            const uint32_t tK = base + C::oK + st * C::KB, tV = base + C::oV + st * C::VB;
            float s[32], dp[32];
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < DK / 16; ks++)
                wg_ss<0>(s, wg_desc_k(base + C::oQ, BM, 64 * wg, ks), wg_desc_k(tK, BN, 0, ks), ks);
#pragma unroll
            for (int ks = 0; ks < DV / 16; ks++)
                wg_ss<0>(dp, wg_desc_k(base + C::oO, BM, 64 * wg, ks), wg_desc_k(tV, BN, 0, ks), ks);
            wg_commit();
            wg_wait<0>();
            wg_hold(s);
            wg_hold(dp);
            const bool diag = k0 + BN - 1 > wpos_first;
#pragma unroll
            for (int n8 = 0; n8 < 8; n8++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int key = k0 + 8 * n8 + 2 * t + e;
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        float p = ex2(s[4 * n8 + 2 * h + e] * a.sl2 - L[h]);
                        if (diag) p = key > pos[h] ? 0.f : p;
                        dp[4 * n8 + 2 * h + e] = p * (dp[4 * n8 + 2 * h + e] - Dr[h]);
                    }
                }
            }
            uint32_t da[4][4];
#pragma unroll
            for (int kk = 0; kk < 4; kk++)
#pragma unroll
                for (int h = 0; h < 4; h++)
                    da[kk][h] = pack_bf16(dp[8 * kk + 2 * h], dp[8 * kk + 2 * h + 1]);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < 4; kk++) wg_rs<1>(acc, da[kk], wg_desc_mn(tK, BN, 0, kk), 1);
            wg_commit();
            wg_wait<0>();
            wg_hold(acc);
        }
        __syncthreads();  // this stage is overwritten by the next iteration's issue
    }
    cp_async_wait<0>();
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int rho = rho0 + 64 * wg + 16 * wi + g + 8 * h;
        if (rho >= a.nrows) continue;
        float *qr = dq + row_ih(a, j, rho) * DK + 2 * t;
#pragma unroll
        for (int n8 = 0; n8 < DK / 8; n8++)
            *reinterpret_cast<float2 *>(qr + 8 * n8) =
                make_float2(a.scale * acc[4 * n8 + 2 * h], a.scale * acc[4 * n8 + 2 * h + 1]);
    }
#endif
}

template <int DK, int DV>
int launch_dkv3_(mtrl_cuda_ctx *c, const A2 &a, int Hk, const uint16_t *dout, const float *lse,
                 const float *D, float *dk, float *dv) {
    using C = Wdkv<DK, DV>;
    const size_t sh = C::smem();
    MTRL_CUDA_REQUIRE(sh <= c->smem_optin, "shared memory %zu > %zu", sh, c->smem_optin);
    set_smem(attn3_bwd_dkv_k<DK, DV>, sh);
    attn3_bwd_dkv_k<DK, DV><<<dim3(cdiv(a.Tk, C::BN), Hk), C::NT, sh, c->stream>>>(a, dout, lse,
                                                                                   D, dk, dv);
    CUDA_LAUNCH_CHECK();
    return 0;
}

template <int DK, int DV>
int launch_dq3_(mtrl_cuda_ctx *c, const A2 &a, int Hk, const uint16_t *dout, const float *lse,
                const float *D, float *dq) {
    using C = Wdq<DK, DV>;
    const size_t sh = C::smem();
    MTRL_CUDA_REQUIRE(sh <= c->smem_optin, "shared memory %zu > %zu", sh, c->smem_optin);
    set_smem(attn3_bwd_dq_k<DK, DV>, sh);
    attn3_bwd_dq_k<DK, DV><<<dim3(cdiv((size_t)a.nrows, C::BM), Hk), C::NT, sh, c->stream>>>(
        a, dout, lse, D, dq);
    CUDA_LAUNCH_CHECK();
    return 0;
}

template <int DK, int DV>
int launch_fwd3_(mtrl_cuda_ctx *c, const A2 &a, int Hk, float *o, float *lse) {
    using C = Wfwd<DK, DV>;
    const size_t sh = C::smem();
    MTRL_CUDA_REQUIRE(sh <= c->smem_optin, "shared memory %zu > %zu", sh, c->smem_optin);
    set_smem(attn3_fwd_k<DK, DV>, sh);
    attn3_fwd_k<DK, DV><<<dim3(cdiv((size_t)a.nrows, C::BM), Hk), C::NT, sh, c->stream>>>(a, o, lse);
    CUDA_LAUNCH_CHECK();
    return 0;
}

}  // namespace

int attn3_fwd_launch(mtrl_cuda_ctx *c, const A2 &a, int Hk, float *o, float *lse) {
    if (c->cc != 90 || a.Dv != 128) return 1;
    if (a.Dk == 192) return launch_fwd3_<192, 128>(c, a, Hk, o, lse);
    if (a.Dk == 128) return launch_fwd3_<128, 128>(c, a, Hk, o, lse);
    return 1;
}

int attn3_dq_launch(mtrl_cuda_ctx *c, const A2 &a, int Hk, const uint16_t *dout,
                    const float *lse, const float *D, float *dq) {
    if (c->cc != 90 || a.Dv != 128) return 1;
    if (a.Dk == 192) return launch_dq3_<192, 128>(c, a, Hk, dout, lse, D, dq);
    if (a.Dk == 128) return launch_dq3_<128, 128>(c, a, Hk, dout, lse, D, dq);
    return 1;
}

int attn3_dkv_launch(mtrl_cuda_ctx *c, const A2 &a, int Hk, const uint16_t *dout,
                     const float *lse, const float *D, float *dk, float *dv) {
    if (c->cc != 90 || a.Dv != 128) return 1;  // sm_90a code runs on compute capability 9.0 only
    if (a.Dk == 192) return launch_dkv3_<192, 128>(c, a, Hk, dout, lse, D, dk, dv);
    if (a.Dk == 128) return launch_dkv3_<128, 128>(c, a, Hk, dout, lse, D, dk, dv);
    return 1;
}
