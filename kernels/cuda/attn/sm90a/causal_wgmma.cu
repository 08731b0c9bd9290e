// attn/sm90a/causal_wgmma.cu: v3 of the causal attention (forward, and the backward's dK / dV and dQ), on
// Hopper's warpgroup MMA: every product is a wgmma reading its shared-memory operands through
// descriptors (wgmma.cuh), so the operand fragments no longer pass through registers
// (v2, attn/causal_mma.cu, spends 251 registers and runs at 12% occupancy: docs/kernel-lab.md).
// Compiled for sm_90a only (the arch-specific wgmma instructions); the launcher declines any
// other device, and the caller runs v2. Dk = 128 or 192 (the naive MLA form), Dv = 128.
//
// The kernels (all deterministic: nothing atomic, fixed summation order). In each, two
// warpgroups of 64 rows (query rows, or keys for dK / dV) take turns on the tensor cores: named
// barriers order their product issue, so one's softmax runs while the other's products do;
// tiles stream into stages guarded by mbarriers (full: landed; empty: both warpgroups done).
//   attn3_fwd_ws_k     the forward, warp-specialised (FA3's structure): a producer warp streams
//                      K / V tiles by bulk tensor copies (TMA).
//   attn3_bwd_dq_ws_k  dQ, the same with a producer warpgroup.
//   attn3_bwd_dkv_pp_k dK / dV (MHA rows): thread 0 refills the query-tile stages; no producer
//                      warp, because dK and dV take 255 registers per consumer thread.
//   attn3_bwd_dkv_k    dK / dV with the warpgroups in step (a __syncthreads per tile, cp.async
//                      by every thread): GQA rows.
// Each kernel has a varlen form (VL = true; attn/varlen.cuh): the tensor maps then span the whole
// pack, a block's coordinates start at its piece's first key (and query row).
// Measured and dropped (docs/kernel-lab.md): the forward and dQ in step (the forward 1.5-1.7x
// slower); a warp-specialised dK / dV (384 threads with setmaxnreg 24 / 240: ptxas reported 168
// registers per thread and ~1 KB of spills, and it ran 1.3x slower than in step).
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
#include <stdlib.h>

#include "kernels/cuda/attn/args.cuh"
#include "kernels/cuda/attn/sm90a/wgmma.cuh"

namespace {

// The kernels' dynamic shared memory from its first 1024-byte boundary (the sw128 tiles need
// it; each kernel asks for 1 KB more than its layout).
__device__ __forceinline__ unsigned char *smem_align1024(unsigned char *raw) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(raw);
    return raw + ((1024u - (a & 1023u)) & 1023u);
}
// cp.async of ROWS packed query rows from rho0 (COLS columns of src: the queries a.q or dout)
// into a sw128 tile; rows past the end zero-filled.
template <int NT, int ROWS, int COLS>
__device__ __forceinline__ void load_rows(unsigned char *dst, int tid, const A2 &a, int j, int rho0,
                                          const uint16_t *src) {
    wg_load_tile<NT, ROWS, COLS>(dst, tid, [&](int r) -> const uint16_t * {
        const int rho = rho0 + r;
        return rho < a.nrows ? src + row_ih(a, j, rho) * COLS : nullptr;
    }, src);
}
// The same for ROWS keys (or values) from k0 of key head j: src a.k or a.v, row stride ld.
template <int NT, int ROWS, int COLS>
__device__ __forceinline__ void load_keys(unsigned char *dst, int tid, const A2 &a, int j, int k0,
                                          const uint16_t *src, int ld) {
    wg_load_tile<NT, ROWS, COLS>(dst, tid, [&](int r) -> const uint16_t * {
        return k0 + r < a.Tk ? src + (size_t)(k0 + r) * ld + (size_t)j * COLS : nullptr;
    }, src);
}

// The two warpgroups' turns on the tensor cores (named barriers 1 and 2, 256 threads):
// pingpong_start lets warpgroup 0 go first; pingpong_tile waits for this warpgroup's turn,
// issues its first products, hands the turn over (not after the other warpgroup's last tile:
// no one would take it) and finishes the tile. Issue and finish stay in one branch so that
// ptxas keeps the wgmma asynchronous (C7515); an inactive tile only passes the turn on.
__device__ __forceinline__ void pingpong_start(int wg) {
    if (wg == 1) named_bar_arrive(1, 256);
}
template <class Issue, class Finish>
__device__ __forceinline__ void pingpong_tile(int wg, bool last_tile, bool active, Issue issue,
                                              Finish finish) {
    named_bar_sync(1 + wg, 256);
    const bool pass = !(wg == 1 && last_tile);
    if (active) {
        issue();
        if (pass) named_bar_arrive(2 - wg, 256);
        finish();
    } else if (pass) {
        named_bar_arrive(2 - wg, 256);
    }
}
// Thread 0 initialises the stages' mbarriers (8 bytes each): full[st] completes with `full_count`
// arrivals (and the copies' bytes), empty[st] with every consumer thread's (256).
__device__ __forceinline__ void stage_bars_init(uint32_t full0, uint32_t empty0, int ns,
                                                unsigned full_count) {
    if (threadIdx.x == 0)
        for (int st = 0; st < ns; st++) {
            mbar_init(full0 + 8 * st, full_count);
            mbar_init(empty0 + 8 * st, 256);
        }
}

template <int DK, int DV>
struct Wdkv {
    static constexpr int BN = 128, BR = 64, NT = 256;
    static constexpr int KB = BN * DK * 2, VB = BN * DV * 2, QB = BR * DK * 2, OB = BR * DV * 2;
    static constexpr int oK = 0, oV = KB, oQ = KB + VB, oO = oQ + 2 * QB, oL = oO + 2 * OB;
    // + 1 KB: the dynamic shared memory is aligned to 1024 bytes by hand
    static constexpr size_t smem() { return (size_t)oL + 4 * BR * sizeof(float) + 1024; }
    static_assert(DK % 64 == 0 && DV % 64 == 0, "64-column blocks");
};

// The two products the backward starts a tile with, issued and committed (not waited for):
// x = A1 B1ᵀ over K1 columns and y = A2 B2ᵀ over K2, A the warpgroup's 64 rows of sw128 tiles of
// RA rows (a1, a2), B sw128 tiles of RB rows (b1, b2), both K-major; N = RB.
template <int K1, int K2, int RA, int RB, int NH>
__device__ __forceinline__ void wg_issue_pair(float (&x)[NH], float (&y)[NH], uint32_t a1,
                                              uint32_t b1, uint32_t a2, uint32_t b2, int wg) {
    static_assert(2 * NH == RB, "the products' N is the B tile's rows");
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < K1 / 16; ks++)
        wg_ss<0>(x, wg_desc_k(a1, RA, 64 * wg, ks), wg_desc_k(b1, RB, 0, ks), ks);
#pragma unroll
    for (int ks = 0; ks < K2 / 16; ks++)
        wg_ss<0>(y, wg_desc_k(a2, RA, 64 * wg, ks), wg_desc_k(b2, RB, 0, ks), ks);
    wg_commit();
}

// One warpgroup's dK / dV work on one query tile, in two halves (as the forward's).
template <int DK, int DV, int BR>
struct Dkv3Rows {
    float dka[DK / 2], dva[DV / 2], sT[BR / 2], dpT[BR / 2];
    int kr0, kr1;  // the thread's key rows
};
template <int DK, int DV, int BN, int BR>
__device__ __forceinline__ void dkv3_issue(Dkv3Rows<DK, DV, BR> &r, uint32_t sK, uint32_t sV, int wg,
                                           uint32_t tQ, uint32_t tO) {
    wg_issue_pair<DK, DV, BN, BR>(r.sT, r.dpT, sK, tQ, sV, tO, wg);  // Sᵀ = K Qᵀ, dPᵀ = V dOᵀ
}
// tL, tD: the tile's lse (base 2; +inf past the last row) and D; column c is packed row rho0 + c.
template <int DK, int DV, int BR>
__device__ __forceinline__ void dkv3_finish(Dkv3Rows<DK, DV, BR> &r, const A2 &a, uint32_t tQ,
                                            uint32_t tO, const float *tL, const float *tD,
                                            int rho0, bool diag, int t) {
    wg_wait<0>();
    wg_hold(r.sT);
    wg_hold(r.dpT);
#pragma unroll
    for (int n8 = 0; n8 < BR / 8; n8++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int c = 8 * n8 + 2 * t + e;
            const float L = tL[c], dd = tD[c];
            float x0 = ex2(r.sT[4 * n8 + e] * a.sl2 - L);
            float x1 = ex2(r.sT[4 * n8 + 2 + e] * a.sl2 - L);
            if (diag) {
                const int pos = a.off + (rho0 + c) / a.G;
                x0 = r.kr0 > pos ? 0.f : x0;
                x1 = r.kr1 > pos ? 0.f : x1;
            }
            r.sT[4 * n8 + e] = x0;
            r.sT[4 * n8 + 2 + e] = x1;
            r.dpT[4 * n8 + e] = x0 * (r.dpT[4 * n8 + e] - dd);
            r.dpT[4 * n8 + 2 + e] = x1 * (r.dpT[4 * n8 + 2 + e] - dd);
        }
    }
    uint32_t pa[BR / 16][4], da[BR / 16][4];  // A fragments of the 16-row K steps
#pragma unroll
    for (int kk = 0; kk < BR / 16; kk++) {
#pragma unroll
        for (int h = 0; h < 4; h++) {
            pa[kk][h] = pack_bf16(r.sT[8 * kk + 2 * h], r.sT[8 * kk + 2 * h + 1]);
            da[kk][h] = pack_bf16(r.dpT[8 * kk + 2 * h], r.dpT[8 * kk + 2 * h + 1]);
        }
    }
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < BR / 16; kk++) wg_rs<1>(r.dva, pa[kk], wg_desc_mn(tO, BR, 0, kk), 1);
#pragma unroll
    for (int kk = 0; kk < BR / 16; kk++) wg_rs<1>(r.dka, da[kk], wg_desc_mn(tQ, BR, 0, kk), 1);
    wg_commit();
    wg_wait<0>();
    wg_hold(r.dka);
    wg_hold(r.dva);
}
template <int DK, int DV, int BR>
__device__ __forceinline__ void dkv3_init(Dkv3Rows<DK, DV, BR> &r, int kr0) {
#pragma unroll
    for (int i = 0; i < DK / 2; i++) r.dka[i] = 0.f;
#pragma unroll
    for (int i = 0; i < DV / 2; i++) r.dva[i] = 0.f;
    r.kr0 = kr0;
    r.kr1 = kr0 + 8;
}
// dk += scale dK, dv += dV: the block owns these keys, one read-modify-write each.
template <int DK, int DV, int BR>
__device__ __forceinline__ void dkv3_store(const Dkv3Rows<DK, DV, BR> &r, const A2 &a, int j, int t,
                                           float *dk, float *dv) {
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int key = hr ? r.kr1 : r.kr0;
        if (key >= a.Tk) continue;
        float *kr = dk + (size_t)key * a.ldk + (size_t)j * DK + 2 * t;
        float *vr = dv + (size_t)key * a.ldv + (size_t)j * DV + 2 * t;
#pragma unroll
        for (int n8 = 0; n8 < DK / 8; n8++) {
            float2 x = *reinterpret_cast<float2 *>(kr + 8 * n8);
            x.x += a.scale * r.dka[4 * n8 + 2 * hr];
            x.y += a.scale * r.dka[4 * n8 + 2 * hr + 1];
            *reinterpret_cast<float2 *>(kr + 8 * n8) = x;
        }
#pragma unroll
        for (int n8 = 0; n8 < DV / 8; n8++) {
            float2 y = *reinterpret_cast<float2 *>(vr + 8 * n8);
            y.x += r.dva[4 * n8 + 2 * hr];
            y.y += r.dva[4 * n8 + 2 * hr + 1];
            *reinterpret_cast<float2 *>(vr + 8 * n8) = y;
        }
    }
}
// The block's K and V rows (cp.async by `nt` threads; landed after a wait).
template <int NT, int BN, int DK, int DV>
__device__ __forceinline__ void dkv3_load_kv(unsigned char *sK, unsigned char *sV, const A2 &a,
                                             int j, int s0, int tid) {
    load_keys<NT, BN, DK>(sK, tid, a, j, s0, a.k, a.ldk);
    load_keys<NT, BN, DV>(sV, tid, a, j, s0, a.v, a.ldv);
}

// VL: a varlen launch, the block's piece and key tile from vl (attn/varlen.cuh).
template <int DK, int DV, bool VL>
__global__ void __launch_bounds__(256, 1)
    attn3_bwd_dkv_k(A2 a, const uint16_t *__restrict__ dout, const float *__restrict__ lse,
                    const float *__restrict__ Dd, float *__restrict__ dk, float *__restrict__ dv,
                    const AttnVl vl) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using C = Wdkv<DK, DV>;
    constexpr int BN = C::BN, BR = C::BR, NT = C::NT;
    extern __shared__ __align__(1024) unsigned char sm_raw[];
    unsigned char *sm = smem_align1024(sm_raw);
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(sm);
    float *sL = reinterpret_cast<float *>(sm + C::oL), *sD = sL + 2 * BR;

    const int tid = threadIdx.x, wg = tid >> 7, wi = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    int bx = blockIdx.x;
    if (VL) bx = attn_vl_dkv_block(a, vl, dout, lse, Dd, dk, dv);
    const int j = blockIdx.y, s0 = bx * BN;
    const int kw0 = s0 + 64 * wg;                          // the warpgroup's first key
    const int i_first = s0 - a.off > 0 ? s0 - a.off : 0;  // first token that sees key s0
    const int rt0 = i_first * a.G / BR, nrt = (a.nrows + BR - 1) / BR;

    dkv3_load_kv<NT, BN, DK, DV>(sm + C::oK, sm + C::oV, a, j, s0, tid);
    auto issue = [&](int rt) {
        const int st = rt & 1, rho0 = rt * BR;
        load_rows<NT, BR, DK>(sm + C::oQ + st * C::QB, tid, a, j, rho0, a.q);
        load_rows<NT, BR, DV>(sm + C::oO + st * C::OB, tid, a, j, rho0, dout);
        if (tid < BR) row_lse_d(a, j, rho0 + tid, lse, Dd, sL + st * BR + tid, sD + st * BR + tid);
        cp_async_commit();
    };
    if (rt0 < nrt) issue(rt0);  // (K, V ride in the same group)
    else cp_async_commit();

    Dkv3Rows<DK, DV, BR> r;
    dkv3_init(r, kw0 + 16 * wi + g);
    for (int rt = rt0; rt < nrt; rt++) {
        cp_async_next(rt, nrt, issue);
        wg_fence_proxy();  // the landed cp.async bytes, visible to wgmma
        __syncthreads();
        const int st = rt & 1, rho0 = rt * BR;
        const int last = (rho0 + BR < a.nrows ? rho0 + BR : a.nrows) - 1;
        if (a.off + last / a.G >= kw0) {  // some row of the tile sees the warpgroup's keys
            const uint32_t tQ = base + C::oQ + st * C::QB, tO = base + C::oO + st * C::OB;
            dkv3_issue<DK, DV, BN, BR>(r, base + C::oK, base + C::oV, wg, tQ, tO);
            dkv3_finish<DK, DV, BR>(r, a, tQ, tO, sL + st * BR, sD + st * BR, rho0,
                                    a.off + rho0 / a.G < kw0 + 63, t);
        }
        __syncthreads();  // this stage is overwritten by the next iteration's issue
    }
    cp_async_wait<0>();
    dkv3_store(r, a, j, t, dk, dv);
#endif
}

// dK / dV with the warpgroups taking turns (MHA rows: G = 1, where a query tile is a box of the
// Q and dO tensors). The same products as attn3_bwd_dkv_k; three stages of query tiles, each
// filled by thread 0 with bulk copies (Q and dO by TMA; lse and D from the head-major copies Lt,
// Dt) completing on full[st], freed through empty[st] by all 256 threads. No producer warp: the
// consumers keep their 255 registers (a warp-specialised block of 384 threads compiled to 168
// per thread and spilled). Thread 0 refills a stage at the end of its own tile n (tile n + 2 into the
// stage of tile n - 1, which the other warpgroup, at most a tile behind, has released), and
// named barriers make the warpgroups take turns issuing Sᵀ and dPᵀ.
template <int DK, int DV>
struct WdkvPp {
    static constexpr int BN = 128, BR = 64, NS = 3;
    static constexpr int KB = BN * DK * 2, VB = BN * DV * 2, QB = BR * DK * 2, OB = BR * DV * 2;
    static constexpr int oK = 0, oV = KB, oQ = KB + VB, oO = oQ + NS * QB, oL = oO + NS * OB;
    static constexpr int oD = oL + NS * BR * 4, oBar = oD + NS * BR * 4;
    static constexpr size_t smem() { return (size_t)oBar + 8 * 2 * NS + 1024; }
};
// VL: a varlen launch (the tensor maps over the whole pack's rows, Lt / Dt per piece at vl.lo).
template <int DK, int DV, bool VL>
__global__ void __launch_bounds__(256, 1)
    attn3_bwd_dkv_pp_k(A2 a, const uint16_t *__restrict__ dout, const float *__restrict__ Lt,
                       const float *__restrict__ Dt, int npad, float *__restrict__ dk,
                       float *__restrict__ dv, const __grid_constant__ CUtensorMap tmQ,
                       const __grid_constant__ CUtensorMap tmO, const AttnVl vl) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using C = WdkvPp<DK, DV>;
    constexpr int BN = C::BN, BR = C::BR, NS = C::NS;
    extern __shared__ __align__(1024) unsigned char sm_raw[];
    unsigned char *sm = smem_align1024(sm_raw);
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(sm);
    const float *sL = reinterpret_cast<const float *>(sm + C::oL), *sD = reinterpret_cast<const float *>(sm + C::oD);
    const uint32_t full0 = base + C::oBar, empty0 = full0 + 8 * NS;

    const int tid = threadIdx.x, lane = tid & 31, warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    const int wg = warp >> 2, wi = warp & 3;  // (through a shuffle: known warp-uniform, C7518)
    const int g = lane >> 2, t = lane & 3;
    int bx = blockIdx.x, qbase = 0;  // qbase: the piece's first row in the maps
    if (VL) {
        const int2 it = vl.it[blockIdx.x], z = attn_vl_piece(a, vl, it.x);
        Lt += vl.lo[it.x];
        Dt += vl.lo[it.x];
        npad = (a.Tq + 63) / 64 * 64;
        dk += (size_t)z.y * a.ldk;
        dv += (size_t)z.y * a.ldv;
        qbase = z.x;
        bx = it.y;
    }
    (void)dout;
    const int j = blockIdx.y, s0 = bx * BN;
    const int kw0 = s0 + 64 * wg;
    const int i_first = s0 - a.off > 0 ? s0 - a.off : 0;  // first token that sees key s0
    const int rt0 = i_first / BR, nt = (a.nrows + BR - 1) / BR - rt0;  // (G = 1)
    stage_bars_init(full0, empty0, NS, 1);
    dkv3_load_kv<256, BN, DK, DV>(sm + C::oK, sm + C::oV, a, j, s0, tid);
    cp_async_commit();
    cp_async_wait<0>();
    wg_fence_proxy();
    __syncthreads();
    // tile n (rows (rt0 + n) BR ..) into stage n % NS, by thread 0
    auto fill = [&](int n) {
        const int st = n % NS, rho0 = (rt0 + n) * BR;
        const uint32_t full = full0 + 8 * st;
        mbar_expect_tx(full, (unsigned)(BR * (DK + DV) * 2 + 2 * BR * 4));
#pragma unroll
        for (int cb = 0; cb < DK / 64; cb++)
            tma_load_2d(base + C::oQ + st * C::QB + cb * BR * 128, &tmQ, j * DK + 64 * cb, qbase + rho0, full);
#pragma unroll
        for (int cb = 0; cb < DV / 64; cb++)
            tma_load_2d(base + C::oO + st * C::OB + cb * BR * 128, &tmO, j * DV + 64 * cb, qbase + rho0, full);
        bulk_load(base + C::oL + st * BR * 4, Lt + (size_t)j * npad + rho0, BR * 4, full);
        bulk_load(base + C::oD + st * BR * 4, Dt + (size_t)j * npad + rho0, BR * 4, full);
    };
    if (warp == 0) {
        if (lane == 0)
            for (int n = 0; n < 2 && n < nt; n++) fill(n);
        __syncwarp();
    }
    Dkv3Rows<DK, DV, BR> r;
    dkv3_init(r, kw0 + 16 * wi + g);
    pingpong_start(wg);
    for (int n = 0; n < nt; n++) {
        const int st = n % NS, rho0 = (rt0 + n) * BR;
        const uint32_t tQ = base + C::oQ + st * C::QB, tO = base + C::oO + st * C::OB;
        mbar_wait(full0 + 8 * st, (unsigned)(n / NS) & 1u);
        const int last = (rho0 + BR < a.nrows ? rho0 + BR : a.nrows) - 1;
        pingpong_tile(wg, n == nt - 1, a.off + last >= kw0,
            [&] { dkv3_issue<DK, DV, BN, BR>(r, base + C::oK, base + C::oV, wg, tQ, tO); },
            [&] {
                dkv3_finish<DK, DV, BR>(r, a, tQ, tO, sL + st * BR, sD + st * BR, rho0,
                                        a.off + rho0 < kw0 + 63, t);
            });
        mbar_arrive(empty0 + 8 * st);
        if (warp == 0 && n + 2 < nt) {  // (warp-uniform, then one lane: C7518)
            if (lane == 0) {
                const int m = n + 2;
                if (m >= NS) mbar_wait(empty0 + 8 * (m % NS), (unsigned)(m / NS - 1) & 1u);
                fill(m);
            }
            __syncwarp();
        }
    }
    dkv3_store(r, a, j, t, dk, dv);
#endif
}

// Forward: o and lse of 128 packed query rows per block (two warpgroups x 64 rows; the block's
// Q tile is loaded once), 128-key tiles of K and V through two stages:
//   S = Q Kᵀ    wgmma m64n128k16, A = the warpgroup's Q rows (K-major), B = the K tile (K-major)
//   online softmax in base 2 in registers (rows g, g + 8 of each warp: quad shuffles)
//   O += P V    wgmma m64n(DV)k16, A = P from registers, B = the V tile (MN-major)
// Shared memory (Dk 192): Q 48 KB, two stages of K 48 KB + V 32 KB.
template <int DK, int DV>
struct Wfwd {
    static constexpr int BM = 128, BN = 128;
    static constexpr int QB = BM * DK * 2, KB = BN * DK * 2, VB = BN * DV * 2;
    static constexpr int oQ = 0, oK = QB, oV = QB + 2 * KB, oBar = oV + 2 * VB;
    // (+ 32: four mbarriers)
    static constexpr size_t smem() { return (size_t)oBar + 32 + 1024; }
    static_assert(DK % 64 == 0 && DV % 64 == 0, "64-column blocks");
};

// The producer of the warp-specialised kernels (one thread): key tiles 0..nkb-1 of key head j
// (BN keys, DK key and DV value columns) into two stages (K at sK + st kstride, V likewise), one
// bulk tensor copy per 64-column block, completing on full[st]; stage st is reused once both
// consumer warpgroups have arrived on empty[st] (phase parity of the tile two before).
template <int DK, int DV, int BN>
__device__ __forceinline__ void ws_produce_kv(uint32_t sK, int kstride, uint32_t sV, int vstride,
                                              uint32_t full0, uint32_t empty0, const CUtensorMap *tmK,
                                              const CUtensorMap *tmV, int j, int nkb, int kbase) {
    for (int kb = 0; kb < nkb; kb++) {
        const int k0 = kbase + kb * BN, st = kb & 1;  // (kbase: a varlen piece's first key)
        if (kb >= 2) mbar_wait(empty0 + 8 * st, (unsigned)((kb >> 1) - 1) & 1u);
        const uint32_t full = full0 + 8 * st;
        mbar_expect_tx(full, (unsigned)(BN * (DK + DV) * 2));  // rows past Tk: zero-filled, counted
#pragma unroll
        for (int cb = 0; cb < DK / 64; cb++)
            tma_load_2d(sK + st * kstride + cb * BN * 128, tmK, j * DK + 64 * cb, k0, full);
#pragma unroll
        for (int cb = 0; cb < DV / 64; cb++)
            tma_load_2d(sV + st * vstride + cb * BN * 128, tmV, j * DV + 64 * cb, k0, full);
    }
}

// One warpgroup's work on one key tile of the forward, in two halves so that the warp-specialised
// kernel can hand the tensor cores to the other warpgroup between them (Fwd3Rows: the thread's
// state). fwd3_issue_s: S = Q Kᵀ (issued, committed, not waited for).
template <int DK, int DV, int BN>
struct Fwd3Rows {
    float oacc[DV / 2], m[2], l[2], s[BN / 2];
    int pos[2];  // positions of the thread's rows g, g + 8
};
template <int DK, int DV, int BN, int BM>
__device__ __forceinline__ void fwd3_issue_s(Fwd3Rows<DK, DV, BN> &r, uint32_t tQ, int wg,
                                             uint32_t tK) {
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < DK / 16; ks++)
        wg_ss<0>(r.s, wg_desc_k(tQ, BM, 64 * wg, ks), wg_desc_k(tK, BN, 0, ks), ks);
    wg_commit();
}
// fwd3_finish: waits for S, the online softmax (base 2, masked where the tile crosses the
// diagonal: `diag`), O += P V, waits for it.
template <int DK, int DV, int BN>
__device__ __forceinline__ void fwd3_finish(Fwd3Rows<DK, DV, BN> &r, const A2 &a, uint32_t tV,
                                            int k0, bool diag, int t) {
    wg_wait<0>();
    wg_hold(r.s);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n8 = 0; n8 < BN / 8; n8++)
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float x = r.s[4 * n8 + 2 * h + e] * a.sl2;
                if (diag) x = k0 + 8 * n8 + 2 * t + e > r.pos[h] ? -INFINITY : x;
                r.s[4 * n8 + 2 * h + e] = x;
                mx[h] = fmaxf(mx[h], x);
            }
    float al[2], bse[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
        const float mn = fmaxf(r.m[h], mx[h]);
        // a row with no visible key yet keeps exponent base 0 (no -inf - -inf)
        bse[h] = mn == -INFINITY ? 0.f : mn;
        al[h] = ex2(r.m[h] - bse[h]);
        r.m[h] = mn;
    }
    float ps[2] = {0.f, 0.f};
#pragma unroll
    for (int n8 = 0; n8 < BN / 8; n8++)
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const float p = ex2(r.s[4 * n8 + 2 * h + e] - bse[h]);
                r.s[4 * n8 + 2 * h + e] = p;
                ps[h] += p;
            }
#pragma unroll
    for (int h = 0; h < 2; h++) r.l[h] = r.l[h] * al[h] + ps[h];
#pragma unroll
    for (int n8 = 0; n8 < DV / 8; n8++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            r.oacc[4 * n8 + 2 * h] *= al[h];
            r.oacc[4 * n8 + 2 * h + 1] *= al[h];
        }
    uint32_t pa[BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++)
#pragma unroll
        for (int h = 0; h < 4; h++) pa[kk][h] = pack_bf16(r.s[8 * kk + 2 * h], r.s[8 * kk + 2 * h + 1]);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) wg_rs<1>(r.oacc, pa[kk], wg_desc_mn(tV, BN, 0, kk), 1);
    wg_commit();
    wg_wait<0>();
    wg_hold(r.oacc);
}
template <int DK, int DV, int BN>
__device__ __forceinline__ void fwd3_init(Fwd3Rows<DK, DV, BN> &r, const A2 &a, int rho_g) {
#pragma unroll
    for (int i = 0; i < DV / 2; i++) r.oacc[i] = 0.f;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        r.m[h] = -INFINITY;
        r.l[h] = 0.f;
        r.pos[h] = a.off + (rho_g + 8 * h) / a.G;
    }
}
// o = O / l; lse = ln 2 (m + log2 l) of the thread's rows rho_g, rho_g + 8. The row sums are
// per-thread partials until here.
template <int DK, int DV, int BN>
__device__ __forceinline__ void fwd3_store(Fwd3Rows<DK, DV, BN> &r, const A2 &a, int j, int rho_g,
                                           int t, float *o, float *lse) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float lr = r.l[h];
        lr += __shfl_xor_sync(0xffffffffu, lr, 1);
        lr += __shfl_xor_sync(0xffffffffu, lr, 2);
        const int rho = rho_g + 8 * h;
        if (rho >= a.nrows) continue;
        const float inv = lr > 0.f ? 1.f / lr : 0.f;
        const size_t ih = row_ih(a, j, rho);
        float *orow = o + ih * DV + 2 * t;
#pragma unroll
        for (int n8 = 0; n8 < DV / 8; n8++)
            *reinterpret_cast<float2 *>(orow + 8 * n8) =
                make_float2(r.oacc[4 * n8 + 2 * h] * inv, r.oacc[4 * n8 + 2 * h + 1] * inv);
        if (t == 0) lse[ih] = (r.m[h] + log2f(lr)) * 0.6931471805599453f;
    }
}

// The key tiles of BN keys that the block of BM packed rows from rho0 sees (up to its last row).
__device__ __forceinline__ int key_tiles(const A2 &a, int rho0, int BM, int BN) {
    const int last = min(rho0 + BM, a.nrows) - 1;
    return (a.off + last / a.G) / BN + 1;
}
// The warpgroup's first and last row positions.
struct Fwd3Span {
    int wpos_first, wpos_last;
};
__device__ __forceinline__ Fwd3Span fwd3_span(const A2 &a, int rho0, int wg) {
    Fwd3Span sp;
    sp.wpos_last = a.off + min(rho0 + 64 * wg + 63, a.nrows - 1) / a.G;
    sp.wpos_first = a.off + (rho0 + 64 * wg) / a.G;
    return sp;
}

// The forward, warp-specialised (FA3's structure): warps 0-7 are the two consumer warpgroups,
// warp 8 the producer: one thread streams the K / V tiles into two stages by bulk tensor
// copies (TMA: one instruction per 64-column block, the 128-byte swizzle applied by the copy,
// rows past Tk zero-filled), which complete on full[s]; the consumers free a stage through
// empty[s] once their products on it completed. (A first version had the producer warp issue
// cp.async: 160 per lane per tile made it 2.2x slower than the warpgroups in step.) Nothing else
// keeps the warpgroups in step, and named barriers 1 and 2 make them take turns issuing S = Q Kᵀ
// (ping-pong): one warpgroup's softmax runs while the other's products occupy the tensor cores.
// VL: a varlen launch (the K / V maps over the whole pack's keys), the block's piece and row
// tile from vl (attn/varlen.cuh).
template <int DK, int DV, bool VL>
__global__ void __launch_bounds__(288, 1)
    attn3_fwd_ws_k(A2 a, float *__restrict__ o, float *__restrict__ lse,
                   const __grid_constant__ CUtensorMap tmK, const __grid_constant__ CUtensorMap tmV,
                   const AttnVl vl) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using C = Wfwd<DK, DV>;
    constexpr int BM = C::BM, BN = C::BN;
    extern __shared__ __align__(1024) unsigned char sm_raw[];
    unsigned char *sm = smem_align1024(sm_raw);
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(sm);
    const uint32_t full0 = base + C::oBar, empty0 = full0 + 16;  // full[2], empty[2]

    // (the warp index through a shuffle: ptxas then knows it is uniform across the warp, and keeps
    // the wgmma of the branches below asynchronous; without it they are serialised, C7518)
    const int tid = threadIdx.x, warp = __shfl_sync(0xffffffffu, tid >> 5, 0), lane = tid & 31;
    int bx = gridDim.x - 1 - blockIdx.x, kbase = 0;  // heaviest first
    if (VL) bx = attn_vl_fwd_block(a, vl, o, lse, &kbase);
    const int j = blockIdx.y, rho0 = bx * BM;
    stage_bars_init(full0, empty0, 2, 1);  // (full: the producer's expect_tx arrival)
    if (warp < 8)
        load_rows<256, BM, DK>(sm + C::oQ, tid, a, j, rho0, a.q);
    cp_async_commit();
    cp_async_wait<0>();
    wg_fence_proxy();
    __syncthreads();  // Q landed, the mbarriers initialised
    const int nkb = key_tiles(a, rho0, BM, BN);

    if (warp == 8) {  // producer: one thread, one bulk tensor copy per 64-column block
        if (lane == 0) ws_produce_kv<DK, DV, BN>(base + C::oK, C::KB, base + C::oV, C::VB, full0,
                                                 empty0, &tmK, &tmV, j, nkb, kbase);
        return;
    }
    const int wg = warp >> 2, wi = warp & 3, g = lane >> 2, t = lane & 3;
    const int rho_g = rho0 + 64 * wg + 16 * wi + g;
    const Fwd3Span sp = fwd3_span(a, rho0, wg);
    Fwd3Rows<DK, DV, BN> r;
    fwd3_init(r, a, rho_g);
    pingpong_start(wg);
    for (int kb = 0; kb < nkb; kb++) {
        const int k0 = kb * BN, st = kb & 1;
        mbar_wait(full0 + 8 * st, (unsigned)(kb >> 1) & 1u);  // (bulk copies: the async proxy)
        pingpong_tile(wg, kb == nkb - 1, k0 <= sp.wpos_last,
            [&] { fwd3_issue_s<DK, DV, BN, BM>(r, base + C::oQ, wg, base + C::oK + st * C::KB); },
            [&] { fwd3_finish(r, a, base + C::oV + st * C::VB, k0, k0 + BN - 1 > sp.wpos_first, t); });
        mbar_arrive(empty0 + 8 * st);
    }
    fwd3_store(r, a, j, rho_g, t, o, lse);
#endif
}

// dQ of 128 packed query rows per block (two warpgroups x 64 rows; the block's Q and dO are
// loaded once), 64-key tiles of K and V through two stages:
//   S = Q Kᵀ    wgmma m64n64k16, A = the warpgroup's Q rows (K-major), B = the K tile (K-major)
//   dP = dO Vᵀ  the same over DV
//   dS = P ⊙ (dP − D), P = 2^(S sl2 − lse2) zero after each row's position
//   dQ += dS K  wgmma m64n(DK)k16, A = dS from registers, B = the K tile (MN-major)
// then dq = scale dQ (overwrite). Shared memory (Dk 192): Q 48 KB, dO 32 KB, two stages of
// K 24 KB + V 16 KB.
template <int DK, int DV>
struct Wdq {
    static constexpr int BM = 128, BN = 64;
    static constexpr int QB = BM * DK * 2, OB = BM * DV * 2, KB = BN * DK * 2, VB = BN * DV * 2;
    static constexpr int oQ = 0, oO = QB, oK = QB + OB, oV = oK + 2 * KB, oBar = oV + 2 * VB;
    // (+ 32: four mbarriers)
    static constexpr size_t smem() { return (size_t)oBar + 32 + 1024; }
    static_assert(DK % 64 == 0 && DV % 64 == 0, "64-column blocks");
};

// One warpgroup's dQ work on one key tile, in two halves (as the forward's).
template <int DK>
struct Dq3Rows {
    float acc[DK / 2], s[32], dp[32], L[2], Dr[2];
    int pos[2];
};
template <int DK, int DV, int BM, int BN>
__device__ __forceinline__ void dq3_issue(Dq3Rows<DK> &r, uint32_t tQ, uint32_t tO, int wg,
                                          uint32_t tK, uint32_t tV) {
    wg_issue_pair<DK, DV, BM, BN>(r.s, r.dp, tQ, tK, tO, tV, wg);  // S = Q Kᵀ, dP = dO Vᵀ
}
template <int DK, int BN>
__device__ __forceinline__ void dq3_finish(Dq3Rows<DK> &r, const A2 &a, uint32_t tK, int k0,
                                           bool diag, int t) {
    wg_wait<0>();
    wg_hold(r.s);
    wg_hold(r.dp);
#pragma unroll
    for (int n8 = 0; n8 < 8; n8++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int key = k0 + 8 * n8 + 2 * t + e;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float p = ex2(r.s[4 * n8 + 2 * h + e] * a.sl2 - r.L[h]);
                if (diag) p = key > r.pos[h] ? 0.f : p;
                r.dp[4 * n8 + 2 * h + e] = p * (r.dp[4 * n8 + 2 * h + e] - r.Dr[h]);
            }
        }
    }
    uint32_t da[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
#pragma unroll
        for (int h = 0; h < 4; h++) da[kk][h] = pack_bf16(r.dp[8 * kk + 2 * h], r.dp[8 * kk + 2 * h + 1]);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; kk++) wg_rs<1>(r.acc, da[kk], wg_desc_mn(tK, BN, 0, kk), 1);
    wg_commit();
    wg_wait<0>();
    wg_hold(r.acc);
}
// The thread's rows rho_g, rho_g + 8: positions, lse (base 2), D; dQ zeroed.
template <int DK>
__device__ __forceinline__ void dq3_init(Dq3Rows<DK> &r, const A2 &a, int j, int rho_g,
                                         const float *lse, const float *Dd) {
#pragma unroll
    for (int i = 0; i < DK / 2; i++) r.acc[i] = 0.f;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int rho = rho_g + 8 * h;
        r.pos[h] = a.off + rho / a.G;
        row_lse_d(a, j, rho, lse, Dd, &r.L[h], &r.Dr[h]);
    }
}
template <int DK>
__device__ __forceinline__ void dq3_store(const Dq3Rows<DK> &r, const A2 &a, int j, int rho_g,
                                          int t, float *dq) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int rho = rho_g + 8 * h;
        if (rho >= a.nrows) continue;
        float *qr = dq + row_ih(a, j, rho) * DK + 2 * t;
#pragma unroll
        for (int n8 = 0; n8 < DK / 8; n8++)
            *reinterpret_cast<float2 *>(qr + 8 * n8) =
                make_float2(a.scale * r.acc[4 * n8 + 2 * h], a.scale * r.acc[4 * n8 + 2 * h + 1]);
    }
}
// The block's Q and dO rows, by cp.async from the threads tid < nt (landed when it returns).
template <int BM, int DK, int DV>
__device__ __forceinline__ void dq3_load_rows(unsigned char *sQ, unsigned char *sO, const A2 &a,
                                              int j, int rho0, int tid, const uint16_t *dout) {
    load_rows<256, BM, DK>(sQ, tid, a, j, rho0, a.q);
    load_rows<256, BM, DV>(sO, tid, a, j, rho0, dout);
}

// dQ warp-specialised, as the forward: warps 0-7 consume, one thread of warps 8-11 streams the
// K / V tiles by bulk tensor copies, the consumer warpgroups take turns issuing S and dP. A whole
// producer warpgroup that gives its registers back (setmaxnreg.dec to 40, the consumers .inc to
// 232): with a producer warp (nine warps, 168 registers per thread) ptxas spilled 128 bytes at
// Dk = 192, where dQ alone holds 96 accumulators; this way it compiles without spills.
// VL: a varlen launch, as the forward's.
template <int DK, int DV, bool VL>
__global__ void __launch_bounds__(384, 1)
    attn3_bwd_dq_ws_k(A2 a, const uint16_t *__restrict__ dout, const float *__restrict__ lse,
                      const float *__restrict__ Dd, float *__restrict__ dq,
                      const __grid_constant__ CUtensorMap tmK, const __grid_constant__ CUtensorMap tmV,
                      const AttnVl vl) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using C = Wdq<DK, DV>;
    constexpr int BM = C::BM, BN = C::BN;
    extern __shared__ __align__(1024) unsigned char sm_raw[];
    unsigned char *sm = smem_align1024(sm_raw);
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(sm);
    const uint32_t full0 = base + C::oBar, empty0 = full0 + 16;

    // (the warp index through a shuffle: ptxas then knows it is uniform across the warp, and keeps
    // the wgmma of the branches below asynchronous; without it they are serialised, C7518)
    const int tid = threadIdx.x, warp = __shfl_sync(0xffffffffu, tid >> 5, 0), lane = tid & 31;
    int bx = gridDim.x - 1 - blockIdx.x, kbase = 0;  // heaviest first
    if (VL) bx = attn_vl_dq_block(a, vl, dout, lse, Dd, dq, &kbase);
    const int j = blockIdx.y, rho0 = bx * BM;
    stage_bars_init(full0, empty0, 2, 1);
    if (warp < 8) dq3_load_rows<BM, DK, DV>(sm + C::oQ, sm + C::oO, a, j, rho0, tid, dout);
    cp_async_commit();
    cp_async_wait<0>();
    wg_fence_proxy();
    __syncthreads();
    const int nkb = key_tiles(a, rho0, BM, BN);
    if (warp >= 8) {
        wg_setmaxnreg_dec<40>();
        if (tid == 256) ws_produce_kv<DK, DV, BN>(base + C::oK, C::KB, base + C::oV, C::VB, full0,
                                                  empty0, &tmK, &tmV, j, nkb, kbase);
        return;
    }
    wg_setmaxnreg_inc<232>();
    const int wg = warp >> 2, wi = warp & 3, g = lane >> 2, t = lane & 3;
    const int rho_g = rho0 + 64 * wg + 16 * wi + g;
    Dq3Rows<DK> r;
    dq3_init(r, a, j, rho_g, lse, Dd);
    const Fwd3Span sp = fwd3_span(a, rho0, wg);
    pingpong_start(wg);
    for (int kb = 0; kb < nkb; kb++) {
        const int k0 = kb * BN, st = kb & 1;
        const uint32_t tK = base + C::oK + st * C::KB, tV = base + C::oV + st * C::VB;
        mbar_wait(full0 + 8 * st, (unsigned)(kb >> 1) & 1u);
        pingpong_tile(wg, kb == nkb - 1, k0 <= sp.wpos_last,
            [&] { dq3_issue<DK, DV, BM, BN>(r, base + C::oQ, base + C::oO, wg, tK, tV); },
            [&] { dq3_finish<DK, BN>(r, a, tK, k0, k0 + BN - 1 > sp.wpos_first, t); });
        mbar_arrive(empty0 + 8 * st);
    }
    dq3_store(r, a, j, rho_g, t, dq);
#endif
}

template <int DK, int DV>
int launch_dkv3_(mtrl_cuda_ctx *c, const A2 &a, int Hk, const uint16_t *dout, const float *lse,
                 const float *D, const float *Lt, const float *Dt, int npad, float *dk, float *dv,
                 const AttnVlTab *vt) {
    using C = Wdkv<DK, DV>;
    using P = WdkvPp<DK, DV>;
    CUtensorMap tq, to;
    int nb = 0;
    if (a.G == 1 && Lt && P::smem() <= c->smem_optin &&
        !tma_map_rows(&tq, a.q, a.H * DK, a.Tq, P::BR) && !tma_map_rows(&to, dout, a.H * DV, a.Tq, P::BR)) {
        if (vt) {
            const AttnVl v = vt->view(true, P::BN, &nb);
            set_smem(attn3_bwd_dkv_pp_k<DK, DV, true>, P::smem());
            attn3_bwd_dkv_pp_k<DK, DV, true><<<dim3(nb, Hk), 256, P::smem(), c->stream>>>(
                a, dout, Lt, Dt, npad, dk, dv, tq, to, v);
        } else {
            set_smem(attn3_bwd_dkv_pp_k<DK, DV, false>, P::smem());
            attn3_bwd_dkv_pp_k<DK, DV, false><<<dim3(cdiv(a.Tk, P::BN), Hk), 256, P::smem(), c->stream>>>(
                a, dout, Lt, Dt, npad, dk, dv, tq, to, AttnVl{});
        }
        CUDA_LAUNCH_CHECK();
        return 0;
    }
    const size_t sh = C::smem();
    MTRL_CUDA_REQUIRE(sh <= c->smem_optin, "shared memory %zu > %zu", sh, c->smem_optin);
    if (vt) {
        const AttnVl v = vt->view(true, C::BN, &nb);
        set_smem(attn3_bwd_dkv_k<DK, DV, true>, sh);
        attn3_bwd_dkv_k<DK, DV, true><<<dim3(nb, Hk), C::NT, sh, c->stream>>>(a, dout, lse, D, dk, dv, v);
    } else {
        set_smem(attn3_bwd_dkv_k<DK, DV, false>, sh);
        attn3_bwd_dkv_k<DK, DV, false><<<dim3(cdiv(a.Tk, C::BN), Hk), C::NT, sh, c->stream>>>(a, dout, lse, D, dk,
                                                                                              dv, AttnVl{});
    }
    CUDA_LAUNCH_CHECK();
    return 0;
}

// The tensor maps of K and V (boxes of 64 columns x bn keys) for the warp-specialised kernels:
// 0, or -1 when the driver declines them.
static int kv_maps_(const A2 &a, int bn, CUtensorMap *tk, CUtensorMap *tv) {
    return tma_map_rows(tk, a.k, a.ldk, a.Tk, bn) || tma_map_rows(tv, a.v, a.ldv, a.Tk, bn) ? -1 : 0;
}

// (vt: a varlen call's tables; the maps then span the pack's keys, attn/varlen.cuh)
template <int DK, int DV>
int launch_dq3_(mtrl_cuda_ctx *c, const A2 &a, int Hk, const uint16_t *dout, const float *lse,
                const float *D, float *dq, const AttnVlTab *vt) {
    using C = Wdq<DK, DV>;
    const size_t sh = C::smem();
    MTRL_CUDA_REQUIRE(sh <= c->smem_optin, "shared memory %zu > %zu", sh, c->smem_optin);
    CUtensorMap tk, tv;
    if (kv_maps_(a, C::BN, &tk, &tv)) return 1;  // declined: v2 runs
    if (vt) {
        int nb;
        const AttnVl v = vt->view(false, C::BM, &nb);
        set_smem(attn3_bwd_dq_ws_k<DK, DV, true>, sh);
        attn3_bwd_dq_ws_k<DK, DV, true><<<dim3(nb, Hk), 384, sh, c->stream>>>(a, dout, lse, D, dq, tk, tv, v);
    } else {
        set_smem(attn3_bwd_dq_ws_k<DK, DV, false>, sh);
        attn3_bwd_dq_ws_k<DK, DV, false><<<dim3(cdiv((size_t)a.nrows, C::BM), Hk), 384, sh, c->stream>>>(
            a, dout, lse, D, dq, tk, tv, AttnVl{});
    }
    CUDA_LAUNCH_CHECK();
    return 0;
}

template <int DK, int DV>
int launch_fwd3_(mtrl_cuda_ctx *c, const A2 &a, int Hk, float *o, float *lse, const AttnVlTab *vt) {
    using C = Wfwd<DK, DV>;
    const size_t sh = C::smem();
    MTRL_CUDA_REQUIRE(sh <= c->smem_optin, "shared memory %zu > %zu", sh, c->smem_optin);
    CUtensorMap tk, tv;
    if (kv_maps_(a, C::BN, &tk, &tv)) return 1;  // declined: v2 runs
    if (vt) {
        int nb;
        const AttnVl v = vt->view(false, C::BM, &nb);
        set_smem(attn3_fwd_ws_k<DK, DV, true>, sh);
        attn3_fwd_ws_k<DK, DV, true><<<dim3(nb, Hk), 288, sh, c->stream>>>(a, o, lse, tk, tv, v);
    } else {
        set_smem(attn3_fwd_ws_k<DK, DV, false>, sh);
        attn3_fwd_ws_k<DK, DV, false><<<dim3(cdiv((size_t)a.nrows, C::BM), Hk), 288, sh, c->stream>>>(
            a, o, lse, tk, tv, AttnVl{});
    }
    CUDA_LAUNCH_CHECK();
    return 0;
}

}  // namespace

int attn3_fwd_launch(mtrl_cuda_ctx *c, const A2 &a, int Hk, float *o, float *lse, const AttnVlTab *vt) {
    if (c->cc != 90 || a.Dv != 128) return 1;
    if (a.Dk == 192) return launch_fwd3_<192, 128>(c, a, Hk, o, lse, vt);
    if (a.Dk == 128) return launch_fwd3_<128, 128>(c, a, Hk, o, lse, vt);
    return 1;
}

int attn3_dq_launch(mtrl_cuda_ctx *c, const A2 &a, int Hk, const uint16_t *dout,
                    const float *lse, const float *D, float *dq, const AttnVlTab *vt) {
    if (c->cc != 90 || a.Dv != 128) return 1;
    if (a.Dk == 192) return launch_dq3_<192, 128>(c, a, Hk, dout, lse, D, dq, vt);
    if (a.Dk == 128) return launch_dq3_<128, 128>(c, a, Hk, dout, lse, D, dq, vt);
    return 1;
}

int attn3_dkv_launch(mtrl_cuda_ctx *c, const A2 &a, int Hk, const uint16_t *dout,
                     const float *lse, const float *D, const float *Lt, const float *Dt, int npad,
                     float *dk, float *dv, const AttnVlTab *vt) {
    if (c->cc != 90 || a.Dv != 128) return 1;  // sm_90a code runs on compute capability 9.0 only
    if (a.Dk == 192) return launch_dkv3_<192, 128>(c, a, Hk, dout, lse, D, Lt, Dt, npad, dk, dv, vt);
    if (a.Dk == 128) return launch_dkv3_<128, 128>(c, a, Hk, dout, lse, D, Lt, Dt, npad, dk, dv, vt);
    return 1;
}
