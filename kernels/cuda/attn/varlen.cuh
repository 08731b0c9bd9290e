// attn/varlen.cuh: the pieces of a varlen causal attention call (mtrl_attn_causal_fwd_varlen /
// _bwd_varlen, kernels_cuda.h) as the kernels of all three versions see them.
//
// A varlen launch runs the per-call kernel's own device code (the same template with VL = true)
// on a flat list of work items, one per blockIdx.x: (piece, the tile of that piece the block
// would have taken in the piece's own launch: a row tile for the forward and dQ, a key tile for
// dK / dV). The block first narrows the pack's arguments to its piece (attn_vl_piece: the piece's
// Tq, Tk, and its q, k, v rows; the outputs offset by the piece's first row and key), so every
// block sees what the per-piece launch's block saw, and the results are that launch's bits. The
// items are ordered heaviest first over the whole pack (the per-piece launches order their own
// row blocks that way), so the long tiles of long pieces do not form the tail.
// The host builds the pieces' tables and one item list per tile size (32, 64, 128 rows or keys),
// uploads them in one copy with the call, and each launcher takes the list of its kernel's tile.
#ifndef MTRL_ATTN_VARLEN_CUH
#define MTRL_ATTN_VARLEN_CUH
#include <stdint.h>
#include <stdio.h>

#include <algorithm>
#include <vector>

#include "kernels/cuda/cuda_common.cuh"

// The device view of one launch.
struct AttnVl {
    const int *qo, *ko;  // [n + 1]: piece p's first query token, first key (device)
    const int *lo;       // [n + 1]: its first entry in v3's head-major lse / D copies (H Σ npad)
    const int2 *it;      // the launch's items, one per blockIdx.x: (piece, its tile)
    int n;
};

// The tile sizes the kernels use (the item lists the host builds): 32, 64, 128.
enum { VL_NTILE = 3 };
static inline int vl_tile_slot(int tile) { return tile == 32 ? 0 : tile == 64 ? 1 : 2; }

// The host's copy of one call's tables, and where they went on the device.
struct AttnVlTab {
    int n, Tq, Tk, G;  // pieces, the pack's query tokens and keys, query heads per key head
    std::vector<int> qo, ko, lo;  // host copies (from 0)
    std::vector<int> host;        // everything uploaded: qo, ko, lo, then the item lists
    size_t at_rows[VL_NTILE], at_keys[VL_NTILE];  // offsets (ints) of the lists in `host`
    int nrows[VL_NTILE], nkeys[VL_NTILE];         // their lengths (items)
    const int *dev;                               // `host` on the device (after attn_vl_upload)

    // The view and grid x of a launch over `tile`-row (keys = false) or `tile`-key tiles.
    AttnVl view(bool keys, int tile, int *nblocks) const {
        const int s = vl_tile_slot(tile);
        *nblocks = keys ? nkeys[s] : nrows[s];
        AttnVl v;
        v.qo = dev;
        v.ko = dev + (n + 1);
        v.lo = dev + 2 * (n + 1);
        v.it = reinterpret_cast<const int2 *>(dev + (keys ? at_keys[s] : at_rows[s]));
        v.n = n;
        return v;
    }
};

// Builds the tables of n pieces (qo, ko: host [n + 1], ko from the caller or equal to qo; both
// rebased to start at 0 by the caller) for G query heads per key head and H heads: the pieces'
// npad (Tq rounded up to 64) prefix times H in lo. Pieces without query rows get no items (their
// per-piece calls launch nothing). with_keys: also the key-tile lists (the backward's dK / dV;
// the forward's prefill form has long key ranges it does not tile). Returns the bytes to upload.
static inline size_t attn_vl_build(AttnVlTab &t, int n, const int *qo, const int *ko, int H, int G, bool with_keys) {
    t.n = n;
    t.G = G;
    t.qo.assign(qo, qo + n + 1);
    t.ko.assign(ko, ko + n + 1);
    t.lo.assign((size_t)n + 1, 0);
    for (int p = 0; p < n; p++) t.lo[p + 1] = t.lo[p] + H * ((qo[p + 1] - qo[p] + 63) / 64 * 64);
    t.Tq = qo[n];
    t.Tk = ko[n];
    t.host.clear();
    t.host.insert(t.host.end(), t.qo.begin(), t.qo.end());
    t.host.insert(t.host.end(), t.ko.begin(), t.ko.end());
    t.host.insert(t.host.end(), t.lo.begin(), t.lo.end());
    if (t.host.size() & 1) t.host.push_back(0);  // int2 items: 8-byte aligned
    struct W {
        long long w;
        int p, b;
    };
    std::vector<W> items;
    for (int keys = 0; keys < (with_keys ? 2 : 1); keys++)
        for (int s = 0; s < VL_NTILE; s++) {
            const int tile = 32 << s;
            items.clear();
            for (int p = 0; p < n; p++) {
                const int Tq = qo[p + 1] - qo[p], Tk = ko[p + 1] - ko[p], off = Tk - Tq;
                if (Tq <= 0) continue;
                if (!keys) {  // row tiles of the packed rows: the keys up to the tile's last row
                    const int nr = Tq * G;
                    for (int b = 0; b * tile < nr; b++) {
                        const int last = std::min((b + 1) * tile, nr) - 1;
                        items.push_back({(long long)off + last / G + 1, p, b});
                    }
                } else {  // key tiles: the query rows that see the tile's first key
                    for (int b = 0; b * tile < Tk; b++)
                        items.push_back({(long long)Tq - std::max(0, b * tile - off), p, b});
                }
            }
            std::stable_sort(items.begin(), items.end(), [](const W &x, const W &y) { return x.w > y.w; });
            (keys ? t.at_keys : t.at_rows)[s] = t.host.size();
            (keys ? t.nkeys : t.nrows)[s] = (int)items.size();
            for (const W &x : items) {
                t.host.push_back(x.p);
                t.host.push_back(x.b);
            }
        }
    if (!with_keys)
        for (int s = 0; s < VL_NTILE; s++) t.at_keys[s] = t.nkeys[s] = 0;
    t.dev = nullptr;
    return sizeof(int) * t.host.size();
}

// Copies the tables to dev (scratch of attn_vl_build's bytes, 8-byte aligned; pageable: staged
// before the call returns). 0, or -1 with a message.
static inline int attn_vl_upload(mtrl_cuda_ctx *c, AttnVlTab &t, void *dev) {
    t.dev = (const int *)dev;
    const cudaError_t e =
        cudaMemcpyAsync(dev, t.host.data(), sizeof(int) * t.host.size(), cudaMemcpyHostToDevice, c->stream);
    if (e != cudaSuccess) {
        fprintf(stderr, "attention varlen: copying the tables of %d pieces: %s\n", t.n, cudaGetErrorString(e));
        return -1;
    }
    return 0;
}

// A varlen block's piece and tile (the kernels' VL = true branch): the arguments `a` (A2 of
// attn/args.cuh or v1's AttnArgs) narrowed to the piece (attn_vl_piece), the pointers indexed by
// query rows moved to the piece's first row and those indexed by keys to its first key; returns
// the piece's tile the block takes (and the piece's first key at *k0 for the kernels that stream
// keys through tensor maps of the whole pack).
template <class A, class PO, class PL>
__device__ __forceinline__ int attn_vl_fwd_block(A &a, const AttnVl &vl, PO &o, PL &lse, int *k0) {
    const int2 it = vl.it[blockIdx.x], z = attn_vl_piece(a, vl, it.x);
    o += (size_t)z.x * a.H * a.Dv;
    lse += (size_t)z.x * a.H;
    *k0 = z.y;
    return it.y;
}
template <class A, class PO, class PL, class PD, class PQ>
__device__ __forceinline__ int attn_vl_dq_block(A &a, const AttnVl &vl, PO &dout, PL &lse, PD &Dd, PQ &dq, int *k0) {
    const int2 it = vl.it[blockIdx.x], z = attn_vl_piece(a, vl, it.x);
    dout += (size_t)z.x * a.H * a.Dv;
    lse += (size_t)z.x * a.H;
    Dd += (size_t)z.x * a.H;
    dq += (size_t)z.x * a.H * a.Dk;
    *k0 = z.y;
    return it.y;
}
template <class A, class PO, class PL, class PD, class PK, class PV>
__device__ __forceinline__ int attn_vl_dkv_block(A &a, const AttnVl &vl, PO &dout, PL &lse, PD &Dd, PK &dk, PV &dv) {
    const int2 it = vl.it[blockIdx.x], z = attn_vl_piece(a, vl, it.x);
    dout += (size_t)z.x * a.H * a.Dv;
    lse += (size_t)z.x * a.H;
    Dd += (size_t)z.x * a.H;
    dk += (size_t)z.y * a.ldk;
    dv += (size_t)z.y * a.ldv;
    return it.y;
}

static inline size_t attn_vl_round64(size_t x) { return (x + 63) / 64 * 64; }
// The backward's scratch (floats) beside the tables: D [Tq][H] of the pack (rounded to 64), then
// v3's head-major lse and D copies per piece (lo[n] each).
static inline size_t attn_vl_bwd_floats(const AttnVlTab &t, int H) {
    return attn_vl_round64((size_t)t.Tq * H) + 2 * (size_t)t.lo[t.n];
}

// The v2 / v3 varlen launchers (attn/causal_mma.cu): 1 without launching anything for a shape or
// alignment v2 and v3 do not take (the caller runs v1), 0 when launched, -1 on an error. The
// arguments are the pack's (vt's tables uploaded); ws: attn_vl_bwd_floats of device scratch.
int attn2_causal_fwd_vl(mtrl_cuda_ctx *c, const AttnVlTab &vt, int H, int Hk, int Dk, int Dv, float scale,
                        const mtrl_bf16 *q, const mtrl_bf16 *k, int ldk, const mtrl_bf16 *v, int ldv, float *o,
                        float *lse);
int attn2_causal_bwd_vl(mtrl_cuda_ctx *c, const AttnVlTab &vt, int H, int Hk, int Dk, int Dv, float scale,
                        const mtrl_bf16 *q, const mtrl_bf16 *k, int ldk, const mtrl_bf16 *v, int ldv, const float *o,
                        const float *lse, const mtrl_bf16 *dout, float *dq, float *dk, float *dv, float *ws);

#endif
