// conv_varlen.cu: the short conv + SiLU forward over many packed sequences in one launch,
// mtrl_shortconv_fwd_varlen. A packed segment (model_ws.h: pieces end to end, each from the
// zero window) ran mtrl_shortconv_fwd once per piece and projection, three launches per piece
// and KDA layer of a few rows each; here one launch covers every piece. Element (t, c) finds its
// piece by a binary search over the pieces' first rows (a table uploaded with the call) and
// reads zero for the taps before that row: the same products in the same order (fmaf over the
// taps, oldest first) as ops_cuda.cu's conv_fwd_k with no state, so the result is bit for bit
// the per-piece launches'. mtrl_shortconv_fwd_varlen_io is the piece_io form (the actor's
// prefill: each piece continues its own window and leaves its new one): the taps before a piece's
// first row read its window, and a second launch writes every piece's last W−1 inputs as its new
// window (after the first: a window may be updated in place).
#include <stdio.h>
#include <stdlib.h>

#include "kernels/cuda/cuda_common.cuh"

namespace {

constexpr int VL_CONV_T = 256;   // threads per block
constexpr int VL_CONV_MAXW = 8;  // the widest kernel mtrl_shortconv_fwd takes

// The last p < n with ofs[p] <= t (ofs [n + 1] non-decreasing, ofs[0] <= t < ofs[n]).
__device__ __forceinline__ int vl_conv_piece_(const int *__restrict__ ofs, int n, int t) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (ofs[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// win (nullable, a device table [n], entries nullable): piece p's taps before its first row read
// its window win[p] [W-1][C] (the piece_io form) instead of zeros, as conv_fwd_k reads state_in.
__global__ void vl_conv_fwd_k(int n, int C, int W, const int *__restrict__ ofs, const float *__restrict__ x,
                              const float *__restrict__ w, float *__restrict__ y, const float *const *win) {
    const size_t lo = (size_t)ofs[0] * C, hi = (size_t)ofs[n] * C;
    for (size_t i = lo + blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < hi; i += (size_t)gridDim.x * blockDim.x) {
        const int t = (int)(i / C), c = (int)(i % C), pc = vl_conv_piece_(ofs, n, t), s = ofs[pc];
        const float *st = win ? win[pc] : nullptr;
        float p = 0.f;
        for (int j = 0; j < W; j++) {
            const int tt = t - W + 1 + j;
            p = fmaf(w[(size_t)c * W + j],
                     tt >= s ? x[(size_t)tt * C + c] : st ? st[(size_t)(tt - s + W - 1) * C + c] : 0.f, p);
        }
        y[i] = p * sigmoid_acc(p);
    }
}

// The piece_io form's windows: thread (p, c) writes row r of wout[p] (entries nullable) as the
// input at the piece's position T_p − (W−1) + r (its window's rows before its first input), rows
// ascending, so wout[p] may be win[p] (a row moves towards lower indices), as conv_state_k.
__global__ void vl_conv_window_k(int n, int C, int W, const int *__restrict__ ofs, const float *__restrict__ x,
                                 const float *const *win, float *const *wout) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)n * C) return;
    const int p = (int)(i / C), c = (int)(i % C), T = ofs[p + 1] - ofs[p];
    float *so = wout[p];
    if (!so) return;
    const float *st = win ? win[p] : nullptr, *xp = x + (size_t)ofs[p] * C;
    for (int r = 0; r < W - 1; r++) {
        const int t = T - (W - 1) + r;
        so[(size_t)r * C + c] = t >= 0 ? xp[(size_t)t * C + c] : st ? st[(size_t)(t + W - 1) * C + c] : 0.f;
    }
}

}  // namespace

extern "C" int mtrl_shortconv_fwd_varlen_io(mtrl_cuda_ctx *c, int n, const int *offs_host, int C, int W,
                                            const float *x, const float *w, const float *const *win_in_host,
                                            float *const *win_out_host, float *y) {
    MTRL_CUDA_REQUIRE(n >= 0 && n <= (1 << 24) && C >= 1 && W >= 1 && W <= VL_CONV_MAXW && (n == 0 || offs_host),
                      "n=%d C=%d W=%d offsets %s", n, C, W, offs_host ? "given" : "NULL");
    if (n == 0) return 0;
    MTRL_CUDA_REQUIRE(offs_host[0] >= 0, "offsets[0] = %d", offs_host[0]);
    for (int i = 0; i < n; i++)
        MTRL_CUDA_REQUIRE(offs_host[i + 1] >= offs_host[i], "offsets[%d] = %d < offsets[%d] = %d", i + 1,
                          offs_host[i + 1], i, offs_host[i]);
    const size_t rows = (size_t)(offs_host[n] - offs_host[0]);
    const bool wr = win_out_host && W > 1;
    if (!rows && !wr) return 0;
    // offsets [n + 1], then the window tables [n] each (pageable: staged before the call returns)
    ws_carver sz{nullptr, 0};
    sz.take<int>((size_t)n + 1);
    sz.take<const float *>((size_t)n);
    sz.take<float *>((size_t)n);
    ws_carver cv{(char *)mtrl_ctx_scratch(c, sz.off), 0};
    int *ofs = cv.take<int>((size_t)n + 1);
    const float **win = cv.take<const float *>((size_t)n);
    float **wout = cv.take<float *>((size_t)n);
    CUDA_CHECK(cudaMemcpyAsync(ofs, offs_host, sizeof(int) * ((size_t)n + 1), cudaMemcpyHostToDevice, c->stream));
    if (win_in_host)
        CUDA_CHECK(cudaMemcpyAsync(win, win_in_host, sizeof(void *) * n, cudaMemcpyHostToDevice, c->stream));
    if (wr) CUDA_CHECK(cudaMemcpyAsync(wout, win_out_host, sizeof(void *) * n, cudaMemcpyHostToDevice, c->stream));
    const float *const *wi = win_in_host ? win : nullptr;
    if (rows) {  // the outputs read the windows before the window pass overwrites them
        size_t blocks = (rows * C + VL_CONV_T - 1) / VL_CONV_T;
        if (blocks > (size_t)c->sms * 32) blocks = (size_t)c->sms * 32;  // grid-stride beyond that
        vl_conv_fwd_k<<<(unsigned)blocks, VL_CONV_T, 0, c->stream>>>(n, C, W, ofs, x, w, y, wi);
        CUDA_LAUNCH_CHECK();
    }
    if (wr) {
        vl_conv_window_k<<<cdiv((size_t)n * C, VL_CONV_T), VL_CONV_T, 0, c->stream>>>(n, C, W, ofs, x, wi, wout);
        CUDA_LAUNCH_CHECK();
    }
    return 0;
}

// The zero-window form: the piece_io form with no windows in or out (the same first launch).
extern "C" int mtrl_shortconv_fwd_varlen(mtrl_cuda_ctx *c, int n, const int *offs_host, int C, int W,
                                         const float *x, const float *w, float *y) {
    return mtrl_shortconv_fwd_varlen_io(c, n, offs_host, C, W, x, w, NULL, NULL, y);
}
