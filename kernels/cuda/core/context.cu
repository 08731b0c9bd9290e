// core/context.cu: context, device buffers, conversions and the cuBLAS GEMM launchers
// (kernels_cuda.h, "context" and "dense GEMM").
#include <string.h>

#include "kernels/cuda/cuda_common.cuh"

// ---- context --------------------------------------------------------------------------------

extern "C" int mtrl_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();  // clear the sticky-free error so later calls start clean
        return 0;
    }
    return n;
}

extern "C" mtrl_cuda_ctx *mtrl_cuda_ctx_create(int device, mtrl_stream stream) {
    mtrl_cuda_ctx *c = (mtrl_cuda_ctx *)calloc(1, sizeof *c);
    if (!c) abort();
    c->device = device;
    CUDA_CHECK(cudaSetDevice(device));
    c->stream = (cudaStream_t)stream;
    CUBLAS_CHECK(cublasCreate(&c->blas));
    CUBLAS_CHECK(cublasSetStream(c->blas, c->stream));
    // Default math: fp32 products stay fp32 (no TF32); bf16 products use tensor cores.
    CUBLAS_CHECK(cublasSetMathMode(c->blas, CUBLAS_DEFAULT_MATH));
    cudaDeviceProp p;
    CUDA_CHECK(cudaGetDeviceProperties(&p, device));
    c->sms = p.multiProcessorCount;
    c->smem_optin = p.sharedMemPerBlockOptin;
    c->cc = p.major * 10 + p.minor;
    return c;
}

extern "C" void mtrl_cuda_ctx_set_tf32(mtrl_cuda_ctx *c, int on) { c->tf32 = on != 0; }

extern "C" mtrl_kernel_opts *mtrl_cuda_ctx_opts(mtrl_cuda_ctx *c) { return &c->opts; }

extern "C" void mtrl_cuda_ctx_destroy(mtrl_cuda_ctx *c) {
    if (!c) return;
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    for (int i = 1; i < MTRL_CTX_LANES && c->lanes_made; i++) {
        CUDA_CHECK(cudaStreamSynchronize(c->lane_stream[i]));
        CUDA_CHECK(cudaStreamDestroy(c->lane_stream[i]));
        CUDA_CHECK(cudaFree(c->lane_ws[i]));
    }
    for (int i = 0; i < MTRL_CTX_LANES && c->lanes_made; i++) CUDA_CHECK(cudaEventDestroy(c->lane_ev[i]));
    CUBLAS_CHECK(cublasDestroy(c->blas));
    if (c->scratch) CUDA_CHECK(cudaFree(c->scratch));
    if (c->cap_stream) CUDA_CHECK(cudaStreamDestroy(c->cap_stream));
    free(c);
}

extern "C" mtrl_stream mtrl_cuda_ctx_stream(const mtrl_cuda_ctx *c) { return (mtrl_stream)c->stream; }

extern "C" void mtrl_cuda_sync(mtrl_cuda_ctx *c) {
    if (c->capturing) {
        c->capture_bad = 1;
        return;
    }
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    CUDA_CHECK(cudaGetLastError());
}

void *mtrl_ctx_scratch(mtrl_cuda_ctx *c, size_t bytes) {
    if (bytes <= c->scratch_bytes) return c->scratch;
    if (c->capturing) { // growing waits for the stream: not while recording (the kernels never run)
        c->capture_bad = 1;
        return c->scratch;
    }
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    if (c->scratch) CUDA_CHECK(cudaFree(c->scratch));
    size_t n = bytes + bytes / 8 + (1 << 20);
    CUDA_CHECK(cudaMalloc(&c->scratch, n));
    c->scratch_bytes = n;
    return c->scratch;
}

// ---- CUDA graphs --------------------------------------------------------------------------------

struct mtrl_cuda_graph {
    cudaGraphExec_t exec;
    void *scratch; // the context's scratch when recorded: its kernels' arguments point into it
};

extern "C" int mtrl_cuda_recording(const mtrl_cuda_ctx *c) { return c->capturing; }
extern "C" void mtrl_cuda_record_fail(mtrl_cuda_ctx *c) {
    if (c->capturing) c->capture_bad = 1;
}

extern "C" int mtrl_cuda_graph_begin(mtrl_cuda_ctx *c) {
    if (c->capturing) return -1;
    // A non-blocking stream of our own: the legacy default stream cannot be captured, and a
    // blocking stream would synchronise with it implicitly (an error while capturing).
    if (!c->cap_stream) CUDA_CHECK(cudaStreamCreateWithFlags(&c->cap_stream, cudaStreamNonBlocking));
    // The recording follows everything queued so far (it runs later, on `stream`, anyway).
    c->saved_stream = c->stream;
    c->stream = c->cap_stream;
    CUBLAS_CHECK(cublasSetStream(c->blas, c->stream));
    c->capturing = 1;
    c->capture_bad = 0;
    CUDA_CHECK(cudaStreamBeginCapture(c->cap_stream, cudaStreamCaptureModeThreadLocal));
    return 0;
}

extern "C" mtrl_cuda_graph *mtrl_cuda_graph_end(mtrl_cuda_ctx *c) {
    if (!c->capturing) return NULL;
    cudaGraph_t graph = NULL;
    cudaError_t e = cudaStreamEndCapture(c->cap_stream, &graph);
    c->capturing = 0;
    c->stream = c->saved_stream;
    CUBLAS_CHECK(cublasSetStream(c->blas, c->stream));
    if (e != cudaSuccess) (void)cudaGetLastError(); // an invalidated capture: not sticky
    mtrl_cuda_graph *g = NULL;
    if (e == cudaSuccess && graph && !c->capture_bad) {
        cudaGraphExec_t exec = NULL;
        if (cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess) {
            g = (mtrl_cuda_graph *)calloc(1, sizeof *g);
            if (!g) abort();
            g->exec = exec;
            g->scratch = c->scratch;
        } else {
            (void)cudaGetLastError();
        }
    }
    if (graph) CUDA_CHECK(cudaGraphDestroy(graph));
    c->capture_bad = 0;
    return g;
}

extern "C" int mtrl_cuda_graph_launch(mtrl_cuda_ctx *c, mtrl_cuda_graph *g) {
    if (!g || c->capturing || g->scratch != c->scratch) return -1;
    CUDA_CHECK(cudaGraphLaunch(g->exec, c->stream));
    return 0;
}

extern "C" void mtrl_cuda_graph_free(mtrl_cuda_graph *g) {
    if (!g) return;
    CUDA_CHECK(cudaGraphExecDestroy(g->exec));
    free(g);
}

// ---- buffers --------------------------------------------------------------------------------

extern "C" void *mtrl_cuda_malloc(size_t bytes) {
    if (!bytes) return NULL;
    void *p = NULL;
    CUDA_CHECK(cudaMalloc(&p, bytes));
    return p;
}
extern "C" void mtrl_cuda_free(void *p) {
    if (p) CUDA_CHECK(cudaFree(p));
}
extern "C" void mtrl_cuda_upload(void *dst, const void *src, size_t bytes) {
    if (bytes) CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}
extern "C" void mtrl_cuda_download(void *dst, const void *src, size_t bytes) {
    if (bytes) CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

__global__ void k_f32_to_bf16(size_t n, const float *x, __nv_bfloat16 *y) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] = __float2bfloat16_rn(x[i]);
}
__global__ void k_bf16_to_f32(size_t n, const __nv_bfloat16 *x, float *y) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] = __bfloat162float(x[i]);
}
__global__ void k_fill_f32(size_t n, float v, float *x) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] = v;
}

static unsigned grid_for_(size_t n) {
    size_t b = (n + 255) / 256;
    return (unsigned)(b < 65535 * 8 ? (b ? b : 1) : 65535 * 8);
}

extern "C" void mtrl_cuda_f32_to_bf16(mtrl_cuda_ctx *c, size_t n, const float *x, mtrl_bf16 *y) {
    if (!n) return;
    k_f32_to_bf16<<<grid_for_(n), 256, 0, c->stream>>>(n, x, (__nv_bfloat16 *)y);
    CUDA_LAUNCH_CHECK();
}
extern "C" void mtrl_cuda_bf16_to_f32(mtrl_cuda_ctx *c, size_t n, const mtrl_bf16 *x, float *y) {
    if (!n) return;
    k_bf16_to_f32<<<grid_for_(n), 256, 0, c->stream>>>(n, (const __nv_bfloat16 *)x, y);
    CUDA_LAUNCH_CHECK();
}
extern "C" void mtrl_cuda_fill_f32(mtrl_cuda_ctx *c, size_t n, float v, float *x) {
    if (!n) return;
    k_fill_f32<<<grid_for_(n), 256, 0, c->stream>>>(n, v, x);
    CUDA_LAUNCH_CHECK();
}

// ---- GEMM -----------------------------------------------------------------------------------
//
// Row-major C = op(A) op(B) is column-major Cᵀ = op(B)ᵀ op(A)ᵀ, and a row-major X with stride
// ld is the column-major Xᵀ with the same ld: so call cuBLAS with the operands swapped and the
// same transpose flags.

static cudaDataType_t dt_(int t) { return t == MTRL_BF16 ? CUDA_R_16BF : CUDA_R_32F; }

// fp32 products: true fp32 unless the context asks for TF32 tensor cores.
static cublasComputeType_t compute_(const mtrl_cuda_ctx *c, int ab_type) {
    return ab_type == MTRL_F32 && c->tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
}

static int gemm_on_(mtrl_cuda_ctx *c, cublasHandle_t h, int ta, int tb, int M, int N, int K, float alpha,
                    const void *A, int lda, const void *B, int ldb, int ab_type, float beta, void *C, int ldc,
                    int c_type) {
    MTRL_CUDA_REQUIRE(M >= 0 && N >= 0 && K >= 0, "M=%d N=%d K=%d", M, N, K);
    MTRL_CUDA_REQUIRE(ab_type == MTRL_F32 || ab_type == MTRL_BF16, "ab_type=%d", ab_type);
    MTRL_CUDA_REQUIRE(c_type == MTRL_F32 || c_type == MTRL_BF16, "c_type=%d", c_type);
    MTRL_CUDA_REQUIRE(!(ab_type == MTRL_F32 && c_type == MTRL_BF16), "fp32 operands, bf16 C");
    if (M == 0 || N == 0) return 0;
    cublasOperation_t oa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, ob = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    CUBLAS_CHECK(cublasGemmEx(h, ob, oa, N, M, K, &alpha, B, dt_(ab_type), ldb, A, dt_(ab_type), lda, &beta, C,
                              dt_(c_type), ldc, compute_(c, ab_type), CUBLAS_GEMM_DEFAULT));
    return 0;
}

extern "C" int mtrl_gemm(mtrl_cuda_ctx *c, int ta, int tb, int M, int N, int K, float alpha,
                         const void *A, int lda, const void *B, int ldb, int ab_type, float beta,
                         void *C, int ldc, int c_type) {
    return gemm_on_(c, c->blas, ta, tb, M, N, K, alpha, A, lda, B, ldb, ab_type, beta, C, ldc, c_type);
}

// ---- GEMM lanes (cuda_common.cuh) -------------------------------------------------------------

int mtrl_ctx_lanes(const mtrl_cuda_ctx *c) {
    return opt_count(c->opts.moe_lanes, MTRL_CTX_LANES, 1, MTRL_CTX_LANES);
}

// Lanes lo .. hi-1 wait for the work queued on the context's stream so far.
static void lanes_wait_stream_(mtrl_cuda_ctx *c, int lo, int hi) {
    CUDA_CHECK(cudaEventRecord(c->lane_ev[0], c->stream));
    for (int i = lo; i < hi; i++) CUDA_CHECK(cudaStreamWaitEvent(c->lane_stream[i], c->lane_ev[0], 0));
}

void mtrl_ctx_lanes_fork(mtrl_cuda_ctx *c, int n) {
    if (n <= 1) return;
    if (!c->lanes_made) {
        for (int i = 0; i < MTRL_CTX_LANES; i++) CUDA_CHECK(cudaEventCreateWithFlags(&c->lane_ev[i], cudaEventDisableTiming));
        c->lane_stream[0] = c->stream;
        for (int i = 1; i < MTRL_CTX_LANES; i++) {
            CUDA_CHECK(cudaStreamCreateWithFlags(&c->lane_stream[i], cudaStreamNonBlocking));
            CUDA_CHECK(cudaMalloc(&c->lane_ws[i], MTRL_CTX_LANE_WS));
        }
        c->lanes_made = 1;
    }
    lanes_wait_stream_(c, 1, n);
}

void mtrl_ctx_lanes_join(mtrl_cuda_ctx *c, int n) {
    for (int i = 1; i < n; i++) {
        CUDA_CHECK(cudaEventRecord(c->lane_ev[i], c->lane_stream[i]));
        CUDA_CHECK(cudaStreamWaitEvent(c->stream, c->lane_ev[i], 0));
    }
}

void mtrl_ctx_lane_after(mtrl_cuda_ctx *c, int lane) {
    lane %= MTRL_CTX_LANES;
    if (lane == 0 || !c->lanes_made) return;
    lanes_wait_stream_(c, lane, lane + 1);
}

cudaStream_t mtrl_ctx_lane_stream(const mtrl_cuda_ctx *c, int lane) {
    return lane > 0 && c->lanes_made ? c->lane_stream[lane % MTRL_CTX_LANES] : c->stream;
}

int mtrl_gemm_lane(mtrl_cuda_ctx *c, int lane, int ta, int tb, int M, int N, int K, float alpha, const void *A,
                   int lda, const void *B, int ldb, int ab_type, float beta, void *C, int ldc, int c_type) {
    lane %= MTRL_CTX_LANES;
    if (lane == 0 || !c->lanes_made)
        return gemm_on_(c, c->blas, ta, tb, M, N, K, alpha, A, lda, B, ldb, ab_type, beta, C, ldc, c_type);
    // cublasSetStream resets the handle's workspace to its default pool: set the lane's after it,
    // and give the handle back to the context's stream (and its default workspace) afterwards.
    CUBLAS_CHECK(cublasSetStream(c->blas, c->lane_stream[lane]));
    CUBLAS_CHECK(cublasSetWorkspace(c->blas, c->lane_ws[lane], MTRL_CTX_LANE_WS));
    int rc = gemm_on_(c, c->blas, ta, tb, M, N, K, alpha, A, lda, B, ldb, ab_type, beta, C, ldc, c_type);
    CUBLAS_CHECK(cublasSetStream(c->blas, c->stream));
    return rc;
}

extern "C" int mtrl_gemm_batched(mtrl_cuda_ctx *c, int ta, int tb, int M, int N, int K,
                                 float alpha, const void *A, int lda, long long sA, const void *B,
                                 int ldb, long long sB, int ab_type, float beta, void *C, int ldc,
                                 long long sC, int c_type, int batch) {
    MTRL_CUDA_REQUIRE(M >= 0 && N >= 0 && K >= 0 && batch >= 0, "M=%d N=%d K=%d batch=%d", M, N,
                      K, batch);
    MTRL_CUDA_REQUIRE(ab_type == MTRL_F32 || ab_type == MTRL_BF16, "ab_type=%d", ab_type);
    MTRL_CUDA_REQUIRE(c_type == MTRL_F32 || c_type == MTRL_BF16, "c_type=%d", c_type);
    MTRL_CUDA_REQUIRE(!(ab_type == MTRL_F32 && c_type == MTRL_BF16), "fp32 operands, bf16 C");
    if (M == 0 || N == 0 || batch == 0) return 0;
    cublasOperation_t oa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, ob = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    CUBLAS_CHECK(cublasGemmStridedBatchedEx(c->blas, ob, oa, N, M, K, &alpha, B, dt_(ab_type),
                                            ldb, sB, A, dt_(ab_type), lda, sA, &beta, C,
                                            dt_(c_type), ldc, sC, batch, compute_(c, ab_type),
                                            CUBLAS_GEMM_DEFAULT));
    return 0;
}

extern "C" int mtrl_linear_fwd(mtrl_cuda_ctx *c, int T, int n, int k, const void *x,
                               const void *W, int type, float beta, float *y) {
    return mtrl_gemm(c, 0, 1, T, n, k, 1.f, x, k, W, k, type, beta, y, n, MTRL_F32);
}
extern "C" int mtrl_linear_bwd_dx(mtrl_cuda_ctx *c, int T, int n, int k, const void *dy,
                                  const void *W, int type, float beta, float *dx) {
    return mtrl_gemm(c, 0, 0, T, k, n, 1.f, dy, n, W, k, type, beta, dx, k, MTRL_F32);
}
extern "C" int mtrl_linear_bwd_dw(mtrl_cuda_ctx *c, int T, int n, int k, const void *dy,
                                  const void *x, int type, float beta, float *dW) {
    return mtrl_gemm(c, 1, 0, n, k, T, 1.f, dy, n, x, k, type, beta, dW, k, MTRL_F32);
}
