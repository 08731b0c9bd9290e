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
// The backward, mtrl_shortconv_bwd_varlen, is four launches for the pack: dp = dy ⊙ SiLU'(p) and
// dx (bit for bit ops_simt.cu's conv_dp_k and conv_dx_k per piece from the zero window), then dw
// in row blocks and their sum as for one sequence of the pack's length: deterministic (the
// blocks follow the pack's rows), but not the per-piece calls' order of summation, so dw differs
// from theirs at fp32 rounding (tests/test_cuda_kda_varlen.cu checks it at 1e-5 of fp64).
#include <stdio.h>
#include <stdlib.h>

#include "kernels/cuda/cuda_common.cuh"

namespace {

constexpr int VL_CONV_T = 256;   // threads per block
constexpr int VL_CONV_MAXW = 8;  // the widest kernel mtrl_shortconv_fwd takes

// The pre-activation p_t[c] of row t of the pack, whose piece starts at row s: the taps before s
// read the piece's window st [W-1][C] (nullable: zero), fmaf over the taps oldest first (ops_simt.cu's conv_pre_ with no state).
__device__ __forceinline__ float vl_conv_pre_(int t, int c, int s, int C, int W, const float *__restrict__ x,
                                              const float *__restrict__ w, const float *st) {
    float p = 0.f;
    for (int j = 0; j < W; j++) {
        const int tt = t - W + 1 + j;
        p = fmaf(w[(size_t)c * W + j], tt >= s ? x[(size_t)tt * C + c] : st ? st[(size_t)(tt - s + W - 1) * C + c] : 0.f,
                 p);
    }
    return p;
}

// win (nullable, a device table [n], entries nullable): piece p's taps before its first row read
// its window win[p] [W-1][C] (the piece_io form) instead of zeros, as conv_fwd_k reads state_in.
__global__ void vl_conv_fwd_k(int n, int C, int W, const int *__restrict__ ofs, const float *__restrict__ x,
                              const float *__restrict__ w, float *__restrict__ y, const float *const *win) {
    const size_t lo = (size_t)ofs[0] * C, hi = (size_t)ofs[n] * C;
    for (size_t i = lo + blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < hi; i += (size_t)gridDim.x * blockDim.x) {
        const int t = (int)(i / C), c = (int)(i % C), pc = vl_piece_of(ofs, n, t), s = ofs[pc];
        const float p = vl_conv_pre_(t, c, s, C, W, x, w, win ? win[pc] : nullptr);
        y[i] = p * sigmoid_acc(p);
    }
}

// The backward (ops_simt.cu's conv_dp_k, conv_dx_k with no state; rows lo = ofs[0] C .. of dp).
__global__ void vl_conv_dp_k(int n, int C, int W, const int *__restrict__ ofs, const float *__restrict__ x,
                             const float *__restrict__ w, const float *__restrict__ dy, float *__restrict__ dp) {
    const size_t lo = (size_t)ofs[0] * C, hi = (size_t)ofs[n] * C;
    for (size_t i = lo + blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < hi; i += (size_t)gridDim.x * blockDim.x) {
        const int t = (int)(i / C), c = (int)(i % C), s = ofs[vl_piece_of(ofs, n, t)];
        const float p = vl_conv_pre_(t, c, s, C, W, x, w, nullptr), sg = sigmoid_acc(p);
        dp[i - lo] = dy[i] * sg * (1.f + p * (1.f - sg));
    }
}
// dx_s = Σ_j w_j dp_{s+W−1−j} over the taps inside s's piece.
__global__ void vl_conv_dx_k(int n, int C, int W, const int *__restrict__ ofs, const float *__restrict__ w,
                             const float *__restrict__ dp, float *__restrict__ dx) {
    const size_t lo = (size_t)ofs[0] * C, hi = (size_t)ofs[n] * C;
    for (size_t i = lo + blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < hi; i += (size_t)gridDim.x * blockDim.x) {
        const int t = (int)(i / C), c = (int)(i % C), p = vl_piece_of(ofs, n, t), e = ofs[p + 1];
        float g = 0.f;
        for (int j = 0; j < W; j++) {
            const int tt = t + W - 1 - j;
            if (tt < e) g = fmaf(w[(size_t)c * W + j], dp[(size_t)tt * C + c - lo], g);
        }
        dx[i] = g;
    }
}
// dw partials over the pack's rows in blocks of rows_per (as one sequence of the pack's length
// would split them, ops_simt.cu's conv_dw_part_k), the taps before a row's piece reading zero:
// part [splits][C][W]. The split does not follow the pieces, so the sum's order is not the
// per-piece calls' (mtrl_shortconv_bwd_varlen says so); it is fixed by the pack, so repeatable.
__global__ void vl_conv_dw_part_k(int n, int C, int W, int rows_per, const int *__restrict__ ofs,
                                  const float *__restrict__ x, const float *__restrict__ dp,
                                  float *__restrict__ part) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int t0 = ofs[0] + blockIdx.y * rows_per, t1 = t0 + rows_per < ofs[n] ? t0 + rows_per : ofs[n];
    float acc[VL_CONV_MAXW];
#pragma unroll
    for (int j = 0; j < VL_CONV_MAXW; j++) acc[j] = 0.f;
    int p = t0 < t1 ? vl_piece_of(ofs, n, t0) : 0;
    for (int t = t0; t < t1; t++) {
        while (ofs[p + 1] <= t) p++;  // the rows walk forward: the next pieces (empty ones skipped)
        const int s = ofs[p];
        const float g = dp[(size_t)(t - ofs[0]) * C + c];
#pragma unroll
        for (int j = 0; j < VL_CONV_MAXW; j++) {
            const int tt = t - W + 1 + j;
            if (j < W) acc[j] = fmaf(g, tt >= s ? x[(size_t)tt * C + c] : 0.f, acc[j]);
        }
    }
#pragma unroll
    for (int j = 0; j < VL_CONV_MAXW; j++)
        if (j < W) part[((size_t)blockIdx.y * C + c) * W + j] = acc[j];
}
// dw[i] += Σ_split part[split][i], splits in order.
__global__ void vl_conv_dw_sum_k(int CW, int ns, const float *__restrict__ part, float *__restrict__ dw) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= CW) return;
    float s = 0.f;
    for (int k = 0; k < ns; k++) s += part[(size_t)k * CW + i];
    dw[i] += s;
}

// The pack's rows, or -1 (with a message) for arguments the varlen ops refuse.
long long vl_conv_rows_(const char *fn, int n, const int *offs_host, int C, int W) {
    if (!(n >= 0 && n <= (1 << 24) && C >= 1 && W >= 1 && W <= VL_CONV_MAXW && (n == 0 || offs_host))) {
        fprintf(stderr, "%s: unsupported arguments: n=%d C=%d W=%d offsets %s\n", fn, n, C, W,
                offs_host ? "given" : "NULL");
        return -1;
    }
    if (n == 0) return 0;
    if (offs_host[0] < 0) {
        fprintf(stderr, "%s: unsupported arguments: offsets[0] = %d\n", fn, offs_host[0]);
        return -1;
    }
    for (int i = 0; i < n; i++)
        if (offs_host[i + 1] < offs_host[i]) {
            fprintf(stderr, "%s: unsupported arguments: offsets[%d] = %d < offsets[%d] = %d\n", fn, i + 1,
                    offs_host[i + 1], i, offs_host[i]);
            return -1;
        }
    return (long long)offs_host[n] - offs_host[0];
}

// The offsets [n + 1] copied into scratch (at *ofs), then `extra` bytes of scratch (at *extra_p,
// 256-byte aligned); -1 when the copy fails.
int vl_conv_upload_(mtrl_cuda_ctx *c, const char *fn, int n, const int *offs_host, size_t extra, int **ofs,
                    void **extra_p) {
    ws_carver sz{nullptr, 0};
    sz.take<int>((size_t)n + 1);
    sz.take<unsigned char>(extra);
    ws_carver cv{(char *)mtrl_ctx_scratch(c, sz.off), 0};
    *ofs = cv.take<int>((size_t)n + 1);
    void *ex = cv.take<unsigned char>(extra);
    if (extra_p) *extra_p = ex;
    // pageable: staged before the call returns
    const cudaError_t e =
        cudaMemcpyAsync(*ofs, offs_host, sizeof(int) * ((size_t)n + 1), cudaMemcpyHostToDevice, c->stream);
    if (e != cudaSuccess) {
        fprintf(stderr, "%s: copying the offsets of %d pieces: %s\n", fn, n, cudaGetErrorString(e));
        return -1;
    }
    return 0;
}

unsigned vl_conv_grid_(const mtrl_cuda_ctx *c, size_t elems) {
    size_t blocks = (elems + VL_CONV_T - 1) / VL_CONV_T;
    if (blocks > (size_t)c->sms * 32) blocks = (size_t)c->sms * 32;  // grid-stride beyond that
    return (unsigned)(blocks ? blocks : 1);
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

extern "C" int mtrl_shortconv_bwd_varlen(mtrl_cuda_ctx *c, int n, const int *offs_host, int C, int W,
                                         const float *x, const float *w, const float *dy, float *dx, float *dw) {
    const long long rows = vl_conv_rows_(__func__, n, offs_host, C, W);
    if (rows <= 0) return (int)rows;
    // dw's row splits: ops_simt.cu's row_splits for one sequence of the pack's rows
    const int cols = (C + VL_CONV_T - 1) / VL_CONV_T;
    long long ns = (c->sms * 4 + cols - 1) / cols;
    ns = ns > rows ? rows : ns < 1 ? 1 : ns;
    const int rows_per = (int)((rows + ns - 1) / ns);
    ns = (rows + rows_per - 1) / rows_per;
    const size_t dp_bytes = (sizeof(float) * (size_t)rows * C + 255) & ~(size_t)255;
    int *ofs = nullptr;
    void *ex = nullptr;
    if (vl_conv_upload_(c, __func__, n, offs_host, dp_bytes + sizeof(float) * (size_t)ns * C * W, &ofs, &ex))
        return -1;
    float *dp = (float *)ex, *part = (float *)((char *)ex + dp_bytes);
    const unsigned grid = vl_conv_grid_(c, (size_t)rows * C);
    vl_conv_dp_k<<<grid, VL_CONV_T, 0, c->stream>>>(n, C, W, ofs, x, w, dy, dp);
    CUDA_LAUNCH_CHECK();
    vl_conv_dx_k<<<grid, VL_CONV_T, 0, c->stream>>>(n, C, W, ofs, w, dp, dx);
    CUDA_LAUNCH_CHECK();
    vl_conv_dw_part_k<<<dim3(cols, (unsigned)ns), VL_CONV_T, 0, c->stream>>>(n, C, W, rows_per, ofs, x, dp, part);
    CUDA_LAUNCH_CHECK();
    vl_conv_dw_sum_k<<<cdiv((size_t)C * W, VL_CONV_T), VL_CONV_T, 0, c->stream>>>(C * W, (int)ns, part, dw);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int mtrl_shortconv_fwd_varlen_io(mtrl_cuda_ctx *c, int n, const int *offs_host, int C, int W,
                                            const float *x, const float *w, const float *const *win_in_host,
                                            float *const *win_out_host, float *y) {
    const long long rows = vl_conv_rows_(__func__, n, offs_host, C, W);
    if (rows < 0) return -1;
    const bool wr = win_out_host && W > 1;
    if (n == 0 || (!rows && !wr)) return 0;
    // offsets [n + 1], then the window tables [n] each (pageable: staged before the call returns)
    int *ofs = nullptr;
    void *ex = nullptr;
    if (vl_conv_upload_(c, __func__, n, offs_host, 2 * sizeof(float *) * (size_t)n, &ofs, &ex)) return -1;
    const float **win = (const float **)ex;
    float **wout = (float **)ex + n;
    if (win_in_host)
        CUDA_CHECK(cudaMemcpyAsync(win, win_in_host, sizeof(void *) * n, cudaMemcpyHostToDevice, c->stream));
    if (wr) CUDA_CHECK(cudaMemcpyAsync(wout, win_out_host, sizeof(void *) * n, cudaMemcpyHostToDevice, c->stream));
    const float *const *wi = win_in_host ? win : nullptr;
    if (rows) {  // the outputs read the windows before the window pass overwrites them
        vl_conv_fwd_k<<<vl_conv_grid_(c, (size_t)rows * C), VL_CONV_T, 0, c->stream>>>(n, C, W, ofs, x, w, y, wi);
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
