// chunk_varlen_mma.cu: the KDA chunked forward over many packed sequences in one launch per stage,
// mtrl_kda_chunk_fwd_varlen, and its backward mtrl_kda_chunk_bwd_varlen (the same tables).
//
// Why: the learner packs many short sequences into one segment (model_ws.h: n_piece pieces laid
// end to end, each from the zero state), and a per-piece call runs two launches (v3's prep and
// state pass, kda/chunk_mma.cu) per piece and layer; at 128-token pieces each launch covers 8 tiles
// and the GPU mostly waits for the launches. Here the same two kernels' device code runs once for
// all pieces:
//   1. prep, grid (ceil(tiles / 4), H), 4 warps: warp w of block x takes tile x * 4 + w of the
//      flat list of every piece's tiles (piece 0's tiles first, then piece 1's ...), finds its
//      piece by a binary search over the pieces' first tiles (a table uploaded with the call) and
//      runs KDA3_PREP_TILE_ (kda/chunk_mma.cuh, kda3_prep_k's body) on the tile of that piece, as the
//      per-piece prep would (the piece's own T, tile n counted from the piece's first token).
//   2. state pass, grid (V / (16 WPB), H, pieces), WPB = 4 warps, as v3: block z walks
//      piece z's tiles from S = 0 with KDA3_STATE_TILE_ (kda/chunk_mma.cuh, kda3_state_k's body), the
//      piece's o rows, its tile states and (optional) final state at the piece's place.
// Scratch: the records of the tiles of one launch. A pack of many tiny pieces has up to a tile
// per token, 16 times the records of one sequence of its length, so the pieces run in groups of
// consecutive pieces of at most max(ceil(T / 16), the longest piece's tiles) tiles, two launches
// per group: one group for the learner's packs of pieces of 16 tokens and more.
// Every tile therefore sees the per-piece launches' inputs and arithmetic: o, S_tiles and the
// final states are bit for bit those of mtrl_kda_chunk_fwd per piece with S0 = NULL
// (tests/test_cuda_kda_varlen.cu checks it). The blocks of short pieces finish early and free
// their SM for the next ones, so the state pass of many short pieces fills the GPU where one
// piece's 2H blocks leave most of it idle.
// The backward, mtrl_kda_chunk_bwd_varlen, runs mtrl_kda_chunk_bwd's v3 stages the same way, per
// group of pieces (the same groups; its scratch per tile is the per-piece call's):
//   1. the prep above (bf16x3 records, as the v3 backward always splits);
//   2. without the caller's tile states, the state pass above for them (o and S_final off);
//   3. the state-gradient pass (kda/chunk_mma_bwd.cu, kda_vl_state_bwd_k), grid (V / 64, H, pieces):
//      block z walks piece z's tiles from its last to its first from dS = 0 (no gradient arrives
//      through a final state), writing no dS0 (none leaves through the zero initial state);
//   4. pass 3 per tile (kda/chunk_simt.cu, kda_vl_tile_bwd_k), grid (tiles, H), the tile's piece
//      by the same binary search.
// Stages 3 and 4 inline the per-sequence kernels' own bodies (kda3_state_bwd_, kda_tile_bwd_), so
// dq, dk, dv, dg, dβ are bit for bit those of mtrl_kda_chunk_bwd per piece with S0, dS_final and
// dS0 NULL (tests/test_cuda_kda_varlen.cu). Four launches per group instead of four per piece.
// Shapes v3 does not take (K != 128, V != 128, unaligned inputs, the kda_fwd = SIMT option; for the
// backward kda_bwd = SIMT too) run mtrl_kda_chunk_fwd / mtrl_kda_chunk_bwd per piece.
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>

#include "kernels/cuda/kda/chunk_mma.cuh"

int kda3_supports(int H, int K, int V, const void *q, const void *k, const void *v,
                  const void *g);  // kda/chunk_mma.cu

namespace {

// Pass 1 over the NT tiles of a group of np consecutive pieces (the launcher's groups), tiles tb0 ..
// tb0 + NT − 1 of the pack: the record of the group's tile gl, head h at rec + (h NT + gl)
// Rec<X>::BYTES. ofs, ts [np + 1]: the group's pieces' first tokens and first tiles in the pack.
template <bool X>
__global__ void __launch_bounds__(128) kda_vl_prep_k(int np, int NT, int tb0, int H, const int *__restrict__ ofs,
                                                     const int *__restrict__ ts, const float *__restrict__ q_all,
                                                     const float *__restrict__ k_all,
                                                     const float *__restrict__ v_all,
                                                     const float *__restrict__ g_all,
                                                     const float *__restrict__ beta_all,
                                                     unsigned char *__restrict__ rec) {
    using Rc = Rec<X>;
    constexpr int LO = PrepCfg<X>::LO;  // lo planes in shared memory (elements)
    extern __shared__ __align__(16) unsigned char sm3_[];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int gl = blockIdx.x * 4 + w, h = blockIdx.y, gt = tb0 + gl;  // the tile in the group, in the pack
    if (gl >= NT) return;  // no block barriers in this kernel
    // the tile's piece, and what a per-piece launch over that piece would have been given
    // (the macro declares its own p and t0)
    const int pc = vl_piece_of(ts, np, gt), first = ofs[pc], T = ofs[pc + 1] - first, n = gt - ts[pc], nt = NT;
    const size_t xk = (size_t)first * H * K3, xv = (size_t)first * H * V3;
    const float *q = q_all + xk, *k = k_all + xk, *v = v_all + xv, *g = g_all + xk,
                *beta = beta_all + (size_t)first * H;
    KDA3_PREP_TILE_(gl);
}

// Pass 2: block (x, h, z) runs kda3_state_k's loop over piece z of the group from the zero state
// (value columns x 16 WPB .. of head h). o_all [T][H][V] (WO) at the pack's rows; St_all
// [NT][H][K][V] and Sf_all [np][H][K][V] (each nullable) at the group's first tile and piece.
// S0p, Sfp (device tables [np] at the group's first piece, nullable, entries nullable): piece z
// starts from S0p[z] instead of zero and leaves its final state at Sfp[z] instead of Sf_all's row
// (the piece_io form, mtrl_kda_chunk_fwd_varlen_io); S0p[z] may be Sfp[z], as kda3_state_k's S0
// may be its S_final: each warp reads its columns first and writes them last.
template <int WPB, bool WO, bool X>
__global__ void __launch_bounds__(32 * WPB, 1)
    kda_vl_state_k(int NT, int tb0, int H, const int *__restrict__ ofs, const int *__restrict__ ts,
                   const unsigned char *__restrict__ rec, float *__restrict__ o_all, float *Sf_all,
                   float *__restrict__ St_all, const float *const *S0p, float *const *Sfp) {
    using Cf = StCfg<WPB, X>;
    using Rc = Rec<X>;
    constexpr int NTH = 32 * WPB, LDU = Cf::LDU, NB = K3 / 8;
    constexpr int LO3 = Cf::LO3 / 2, LOP = Cf::LOP / 2, LOU = Cf::LOU / 2;  // lo parts (elements)
    extern __shared__ __align__(16) unsigned char sm3_[];
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, gq = lane >> 2, tq = lane & 3;
    const int h = blockIdx.y, jb = blockIdx.x * 16 * WPB;  // the block's first value column
    const int jw = 16 * w, j0 = jb + jw;                     // the warp's, in the block / global
    const int p = blockIdx.z, tb = ts[p] - tb0, nt = ts[p + 1] - ts[p], T = ofs[p + 1] - ofs[p];
    // the piece's view of the pack: what a per-piece launch would have been given
    float *o = WO ? o_all + (size_t)ofs[p] * H * V3 : nullptr;
    float *S_tiles = St_all ? St_all + (size_t)tb * H * K3 * V3 : nullptr;
    float *S_final = Sfp ? Sfp[p] : Sf_all ? Sf_all + (size_t)p * H * K3 * V3 : nullptr;
    const float *S0 = S0p ? S0p[p] : nullptr;
    const unsigned char *rp = rec + ((size_t)h * NT + tb) * Rc::BYTES;  // the piece's records of head h

    auto issue = [&](int n) {
        const unsigned char *R = rp + (size_t)n * Rc::BYTES;
        unsigned char *st = sm3_ + (n % NST3) * Cf::STAGE;
        KDA3_STAGE_KSIDE_(st, R, Cf::SP, Cf::SEG, tid, NTH, Cf::NP);
        for (int i = tid; i < Cf::NP * C3 * 2 * WPB; i += NTH) {
            const int r = i / (2 * WPB), c = i % (2 * WPB);  // r = part * 16 + row
            cp_async16(st + Cf::SU + r * LDU * 2 + c * 16, R + Rc::U + (r * V3 + jb) * 2 + c * 16);
        }
    };
#pragma unroll 1
    for (int s = 0; s < NST3 - 1; s++) {
        if (s < nt) issue(s);
        cp_async_commit();  // empty groups keep the count uniform
    }

    float st[NB][4];  // Sᵀ in the accumulator layout (KDA3_STATE_LOAD_): zero
    KDA3_STATE_LOAD_(st, S0, h, j0, gq, tq);

    KDA3_STATE_TILES_(NST3, 0, nt);
    if (S_final) KDA3_STATE_STORE_(S_final, st, h, j0, gq, tq);
}

template <bool X>
void vl_prep_(mtrl_cuda_ctx *c, int n, int NT, int tb0, int H, const int *ofs, const int *ts, const float *q,
              const float *k, const float *v, const float *g, const float *beta, unsigned char *rec) {
    const size_t sh = 4 * (size_t)PrepCfg<X>::WARP_BYTES;
    set_smem(kda_vl_prep_k<X>, sh);
    kda_vl_prep_k<X><<<dim3((NT + 3) / 4, H), 128, sh, c->stream>>>(n, NT, tb0, H, ofs, ts, q, k, v, g, beta, rec);
    CUDA_LAUNCH_CHECK();
}
template <int WPB, bool X>
void vl_state_(mtrl_cuda_ctx *c, int n, int NT, int tb0, int H, const int *ofs, const int *ts, const unsigned char *rec,
               float *o, float *S_final, float *S_tiles, const float *const *S0p, float *const *Sfp) {
    const size_t sh = StCfg<WPB, X>::smem();
    const dim3 grid(V3 / (16 * WPB), H, n);
    if (o) {
        set_smem(kda_vl_state_k<WPB, true, X>, sh);
        kda_vl_state_k<WPB, true, X><<<grid, 32 * WPB, sh, c->stream>>>(NT, tb0, H, ofs, ts, rec, o, S_final, S_tiles,
                                                                         S0p, Sfp);
    } else {
        set_smem(kda_vl_state_k<WPB, false, X>, sh);
        kda_vl_state_k<WPB, false, X><<<grid, 32 * WPB, sh, c->stream>>>(NT, tb0, H, ofs, ts, rec, o, S_final,
                                                                          S_tiles, S0p, Sfp);
    }
    CUDA_LAUNCH_CHECK();
}

// Checks the offsets (host) and sums the pieces' tiles; -1 with a message when they are not
// pieces of a packed tensor.
int vl_tiles_(const char *fn, int n, const int *offs_host, long long *NT) {
    if (n < 0 || (n > 0 && !offs_host) || (n > 0 && offs_host[0] < 0)) {
        fprintf(stderr, "%s: n = %d pieces with offsets %s: need n >= 0 and offsets [n + 1] from 0 on\n", fn, n,
                offs_host ? "given" : "NULL");
        return -1;
    }
    long long t = 0;
    for (int i = 0; i < n; i++) {
        if (offs_host[i + 1] < offs_host[i]) {
            fprintf(stderr, "%s: offsets[%d] = %d < offsets[%d] = %d: pieces must not overlap\n", fn, i + 1,
                    offs_host[i + 1], i, offs_host[i]);
            return -1;
        }
        t += (offs_host[i + 1] - offs_host[i] + C3 - 1) / C3;
    }
    if (t > 0x7fffffffLL / 4 || (long long)n > 65535) {
        fprintf(stderr, "%s: %d pieces with %lld tiles: at most 65535 pieces and 2^29 tiles\n", fn, n, t);
        return -1;
    }
    *NT = t;
    return 0;
}

// Groups of consecutive pieces of at most vl_cap_ tiles, one launch per stage each: the scratch
// per tile (records; the backward's dΔ, dS and recomputed states) then takes no more than the
// longest piece's per-piece call or one sequence of the pack's length would (a pack of many
// 1-token pieces has a tile per token).
int vl_cap_(int n, const int *offs) {
    int cap = (offs[n] - offs[0] + C3 - 1) / C3;
    for (int i = 0; i < n; i++) cap = std::max(cap, (offs[i + 1] - offs[i] + C3 - 1) / C3);
    return cap;
}
// The end (exclusive) of the group from piece p0: as many pieces as fit in cap tiles, one at least.
int vl_group_end_(int n, const int *ts_h, int p0, int cap) {
    int p1 = p0 + 1;
    while (p1 < n && ts_h[p1 + 1] - ts_h[p0] <= cap) p1++;
    return p1;
}
// The tables the kernels search: ofs [n + 1] (the pieces' first tokens), then ts [n + 1] (their
// first tiles), on the host (returned, to free; NULL when out of memory) and copied to tab.
int *vl_tables_(mtrl_cuda_ctx *c, const char *fn, int n, const int *offs_host, int *tab) {
    int *tab_h = (int *)malloc(sizeof(int) * 2 * ((size_t)n + 1));
    if (!tab_h) {
        fprintf(stderr, "%s: out of host memory for %d pieces\n", fn, n);
        return nullptr;
    }
    int *ts_h = tab_h + n + 1;
    for (int i = 0; i <= n; i++) tab_h[i] = offs_host[i];
    ts_h[0] = 0;
    for (int i = 0; i < n; i++) ts_h[i + 1] = ts_h[i] + (offs_host[i + 1] - offs_host[i] + C3 - 1) / C3;
    // pageable: staged before the call returns
    const cudaError_t e =
        cudaMemcpyAsync(tab, tab_h, sizeof(int) * 2 * ((size_t)n + 1), cudaMemcpyHostToDevice, c->stream);
    if (e != cudaSuccess) {
        fprintf(stderr, "%s: copying the tables of %d pieces: %s\n", fn, n, cudaGetErrorString(e));
        free(tab_h);
        return nullptr;
    }
    return tab_h;
}

}  // namespace

// Both forms (mtrl_kda_chunk_fwd_varlen, _varlen_io): S0_h, Sf_h host tables [n] of device
// pointers or NULL (every piece from zero, final states into S_final's rows).
static int vl_fwd_(const char *fn, mtrl_cuda_ctx *c, int n, const int *offs_host, int H, int K, int V,
                   const float *q, const float *k, const float *v, const float *g, const float *beta,
                   const float *const *S0_h, float *o, float *S_final, float *const *Sf_h, float *S_tiles) {
    long long NT = 0;
    if (vl_tiles_(fn, n, offs_host, &NT)) return -1;
    const bool v3 = mtrl_kda_chunk_fwd_version(c, H, K, V) == 3 && kda3_supports(H, K, V, q, k, v, g);
    if (!v3 || NT == 0) {  // per piece: other shapes, or nothing but empty pieces (S_final = 0)
        size_t x = 0, hv = (size_t)H * K * V, tiles = 0;
        for (int i = 0; i < n; i++) {
            const int Ti = offs_host[i + 1] - offs_host[i];
            x = (size_t)offs_host[i];
            const float *S0 = S0_h ? S0_h[i] : NULL;
            float *Sf = Sf_h ? Sf_h[i] : S_final ? S_final + i * hv : NULL;
            if (Ti == 0 && Sf && Sf == S0) continue;  // an empty piece in place: its state stays
            if (mtrl_kda_chunk_fwd(c, Ti, H, K, V, q + x * H * K, k + x * H * K, v + x * H * V, g + x * H * K,
                                   beta + x * H, S0, o ? o + x * H * V : NULL, Sf,
                                   S_tiles ? S_tiles + tiles * hv : NULL))
                return -1;
            tiles += (size_t)((Ti + C3 - 1) / C3);
        }
        return 0;
    }
    const int split = !c->opts.kda_plain_bf16;
    const int cap = vl_cap_(n, offs_host);
    ws_carver sz{nullptr, 0};
    sz.take<unsigned char>((size_t)H * cap * kda3_rec_bytes(split));
    sz.take<int>(2 * ((size_t)n + 1));
    const int np_tab = (S0_h ? n : 0) + (Sf_h ? n : 0);  // the piece_io form's pointer tables
    sz.take<const float *>((size_t)np_tab);
    ws_carver cv{(char *)mtrl_ctx_scratch(c, sz.off), 0};
    unsigned char *rec = cv.take<unsigned char>((size_t)H * cap * kda3_rec_bytes(split));
    int *tab = cv.take<int>(2 * ((size_t)n + 1));  // ofs [n + 1], then ts [n + 1]
    const float **ptab = cv.take<const float *>((size_t)np_tab);  // S0 [n] (with S0_h), then Sf [n]
    const float *const *S0p = S0_h ? ptab : nullptr;
    float *const *Sfp = Sf_h ? (float *const *)(ptab + (S0_h ? n : 0)) : nullptr;
    if (np_tab) {
        // pageable: staged before the call returns
        if (S0_h) CUDA_CHECK(cudaMemcpyAsync(ptab, S0_h, sizeof(void *) * n, cudaMemcpyHostToDevice, c->stream));
        if (Sf_h)
            CUDA_CHECK(cudaMemcpyAsync(ptab + (S0_h ? n : 0), Sf_h, sizeof(void *) * n, cudaMemcpyHostToDevice,
                                       c->stream));
    }
    int *tab_h = vl_tables_(c, fn, n, offs_host, tab);
    if (!tab_h) return -1;
    const int *ts_h = tab_h + n + 1;
    const size_t hkv = (size_t)H * K3 * V3;
    for (int p0 = 0, p1; p0 < n; p0 = p1) {
        p1 = vl_group_end_(n, ts_h, p0, cap);
        const int np = p1 - p0, tb0 = ts_h[p0], nt = ts_h[p1] - tb0;
        const int *ofs = tab + p0, *ts = tab + n + 1 + p0;
        float *Sf = S_final ? S_final + (size_t)p0 * hkv : nullptr, *St = S_tiles ? S_tiles + (size_t)tb0 * hkv : nullptr;
        const float *const *S0g = S0p ? S0p + p0 : nullptr;
        float *const *Sfg = Sfp ? Sfp + p0 : nullptr;
        if (split) {
            if (nt) vl_prep_<true>(c, np, nt, tb0, H, ofs, ts, q, k, v, g, beta, rec);
            vl_state_<4, true>(c, np, nt, tb0, H, ofs, ts, rec, o, Sf, St, S0g, Sfg);
        } else {
            if (nt) vl_prep_<false>(c, np, nt, tb0, H, ofs, ts, q, k, v, g, beta, rec);
            vl_state_<4, false>(c, np, nt, tb0, H, ofs, ts, rec, o, Sf, St, S0g, Sfg);
        }
    }
    free(tab_h);
    return 0;
}

extern "C" int mtrl_kda_chunk_fwd_varlen(mtrl_cuda_ctx *c, int n, const int *offs_host, int H, int K, int V,
                                         const float *q, const float *k, const float *v, const float *g,
                                         const float *beta, float *o, float *S_final, float *S_tiles) {
    return vl_fwd_(__func__, c, n, offs_host, H, K, V, q, k, v, g, beta, NULL, o, S_final, NULL, S_tiles);
}

// The piece_io form: the same two launches, piece i's state pass from S0_h[i] (its per-piece call's
// S0) and its final state to Sf_h[i].
extern "C" int mtrl_kda_chunk_fwd_varlen_io(mtrl_cuda_ctx *c, int n, const int *offs_host, int H, int K, int V,
                                            const float *q, const float *k, const float *v, const float *g,
                                            const float *beta, const float *const *S0_host, float *o,
                                            float *const *Sf_host, float *S_tiles) {
    return vl_fwd_(__func__, c, n, offs_host, H, K, V, q, k, v, g, beta, S0_host, o, NULL, Sf_host, S_tiles);
}

extern "C" int mtrl_kda_chunk_bwd_varlen(mtrl_cuda_ctx *c, int n, const int *offs_host, int H, int K, int V,
                                         const float *q, const float *k, const float *v, const float *g,
                                         const float *beta, const float *S_tiles, const float *dout, float *dq,
                                         float *dk, float *dv, float *dg, float *dbeta) {
    long long NT = 0;
    if (vl_tiles_(__func__, n, offs_host, &NT)) return -1;
    // the shapes and options for which mtrl_kda_chunk_bwd takes v3 (kda/chunk_simt.cu)
    const bool v3 = mtrl_kda_chunk_bwd_version(c, H, K, V) == 3 && kda3_supports(H, K, V, q, k, v, g) &&
                    ((uintptr_t)dout & 15u) == 0;
    if (!v3 || NT == 0) {  // per piece: other shapes, or nothing but empty pieces (no gradient)
        const size_t hv = (size_t)H * K * V;
        size_t tiles = 0;
        for (int i = 0; i < n; i++) {
            const int Ti = offs_host[i + 1] - offs_host[i];
            const size_t xk = (size_t)offs_host[i] * H * K, xv = (size_t)offs_host[i] * H * V;
            if (mtrl_kda_chunk_bwd(c, Ti, H, K, V, q + xk, k + xk, v + xv, g + xk, beta + (size_t)offs_host[i] * H,
                                   NULL, S_tiles ? S_tiles + tiles * hv : NULL, dout + xv, NULL, dq + xk, dk + xk,
                                   dv + xv, dg + xk, dbeta + (size_t)offs_host[i] * H, NULL))
                return -1;
            tiles += (size_t)((Ti + C3 - 1) / C3);
        }
        return 0;
    }
    // Per group: the bf16x3 records (the prep, as mtrl_kda_chunk_bwd's v3 always splits), the tile
    // states when the caller has none (the forward's state pass), the state-gradient pass, pass 3.
    const int cap = vl_cap_(n, offs_host);
    const size_t hkv = (size_t)H * K3 * V3;
    unsigned char *rec = nullptr;
    float *dD = nullptr, *dSt = nullptr, *own = nullptr;
    int *tab = nullptr;
    auto carve = [&](ws_carver &cv) {
        rec = cv.take<unsigned char>((size_t)H * cap * kda3_rec_bytes(1));
        dD = cv.take<float>((size_t)H * cap * C3 * V3);
        dSt = cv.take<float>((size_t)cap * hkv);
        own = S_tiles ? nullptr : cv.take<float>((size_t)cap * hkv);
        tab = cv.take<int>(2 * ((size_t)n + 1));  // ofs [n + 1], then ts [n + 1]
    };
    ws_carver sz{nullptr, 0};
    carve(sz);
    ws_carver cv{(char *)mtrl_ctx_scratch(c, sz.off), 0};
    carve(cv);
    int *tab_h = vl_tables_(c, __func__, n, offs_host, tab);
    if (!tab_h) return -1;
    const int *ts_h = tab_h + n + 1;
    int rc = 0;
    for (int p0 = 0, p1; p0 < n && !rc; p0 = p1) {
        p1 = vl_group_end_(n, ts_h, p0, cap);
        const int np = p1 - p0, tb0 = ts_h[p0], nt = ts_h[p1] - tb0;
        const int *ofs = tab + p0, *ts = tab + n + 1 + p0;
        if (!nt) continue;  // empty pieces only: no gradient to give
        vl_prep_<true>(c, np, nt, tb0, H, ofs, ts, q, k, v, g, beta, rec);
        const float *St = S_tiles ? S_tiles + (size_t)tb0 * hkv : own;
        if (!S_tiles) vl_state_<4, true>(c, np, nt, tb0, H, ofs, ts, rec, nullptr, nullptr, own, nullptr, nullptr);
        kda3_state_bwd_varlen_launch(c, np, nt, tb0, H, ofs, ts, rec, dout, dD, dSt);
        rc = kda_tile_bwd_varlen_launch(c, np, nt, tb0, H, ofs, ts, q, k, v, g, beta, St, dout, dD, dSt, dq, dk, dv,
                                        dg, dbeta);
    }
    free(tab_h);
    return rc;
}
