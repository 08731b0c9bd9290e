// conv_varlen.cu: the short conv + SiLU forward over many packed sequences in one launch,
// mtrl_shortconv_fwd_varlen. A packed segment (model_ws.h: pieces end to end, each from the
// zero window) ran mtrl_shortconv_fwd once per piece and projection, three launches per piece
// and KDA layer of a few rows each; here one launch covers every piece. Element (t, c) finds its
// piece by a binary search over the pieces' first rows (a table uploaded with the call) and
// reads zero for the taps before that row: the same products in the same order (fmaf over the
// taps, oldest first) as ops_cuda.cu's conv_fwd_k with no state, so the result is bit for bit
// the per-piece launches'.
#include <stdio.h>
#include <stdlib.h>

#include "kernels/cuda/cuda_common.cuh"

namespace {

constexpr int VL_CONV_T = 256;   // threads per block
constexpr int VL_CONV_MAXW = 8;  // the widest kernel mtrl_shortconv_fwd takes

__global__ void vl_conv_fwd_k(int n, int C, int W, const int *__restrict__ ofs, const float *__restrict__ x,
                              const float *__restrict__ w, float *__restrict__ y) {
    const size_t lo = (size_t)ofs[0] * C, hi = (size_t)ofs[n] * C;
    for (size_t i = lo + blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < hi; i += (size_t)gridDim.x * blockDim.x) {
        const int t = (int)(i / C), c = (int)(i % C), s = ofs[vl_piece_of(ofs, n, t)];
        float p = 0.f;
        for (int j = 0; j < W; j++) {
            const int tt = t - W + 1 + j;
            p = fmaf(w[(size_t)c * W + j], tt >= s ? x[(size_t)tt * C + c] : 0.f, p);
        }
        y[i] = p * sigmoid_acc(p);
    }
}

}  // namespace

extern "C" int mtrl_shortconv_fwd_varlen(mtrl_cuda_ctx *c, int n, const int *offs_host, int C, int W,
                                         const float *x, const float *w, float *y) {
    MTRL_CUDA_REQUIRE(n >= 0 && n <= (1 << 24) && C >= 1 && W >= 1 && W <= VL_CONV_MAXW && (n == 0 || offs_host),
                      "n=%d C=%d W=%d offsets %s", n, C, W, offs_host ? "given" : "NULL");
    if (n == 0) return 0;
    MTRL_CUDA_REQUIRE(offs_host[0] >= 0, "offsets[0] = %d", offs_host[0]);
    for (int i = 0; i < n; i++)
        MTRL_CUDA_REQUIRE(offs_host[i + 1] >= offs_host[i], "offsets[%d] = %d < offsets[%d] = %d", i + 1,
                          offs_host[i + 1], i, offs_host[i]);
    const size_t rows = (size_t)(offs_host[n] - offs_host[0]);
    if (!rows) return 0;
    int *ofs = (int *)mtrl_ctx_scratch(c, sizeof(int) * ((size_t)n + 1));
    // pageable: staged before the call returns
    CUDA_CHECK(cudaMemcpyAsync(ofs, offs_host, sizeof(int) * ((size_t)n + 1), cudaMemcpyHostToDevice, c->stream));
    size_t blocks = (rows * C + VL_CONV_T - 1) / VL_CONV_T;
    if (blocks > (size_t)c->sms * 32) blocks = (size_t)c->sms * 32;  // grid-stride beyond that
    vl_conv_fwd_k<<<(unsigned)blocks, VL_CONV_T, 0, c->stream>>>(n, C, W, ofs, x, w, y);
    CUDA_LAUNCH_CHECK();
    return 0;
}
