// cuda_common.cuh: what every kernels/cuda/*.cu file shares: the check macros, the context
// (cuBLAS handle, stream, scratch), small device helpers (reductions, bf16, mma.sync).
#ifndef MTRL_CUDA_COMMON_CUH
#define MTRL_CUDA_COMMON_CUH

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/kernels_cuda.h"

#define MTRL_CTX_LANES 8
#define MTRL_CTX_LANE_WS ((size_t)32 << 20)  // cuBLAS's recommended workspace on Hopper

// ---- checks ---------------------------------------------------------------------------------
#define CUDA_CHECK(call)                                                                   \
    do {                                                                                   \
        cudaError_t e_ = (call);                                                           \
        if (e_ != cudaSuccess) {                                                           \
            fprintf(stderr, "%s:%d: CUDA error %s (%s) in %s\n", __FILE__, __LINE__,       \
                    cudaGetErrorName(e_), cudaGetErrorString(e_), #call);                  \
            abort();                                                                       \
        }                                                                                  \
    } while (0)
// After every kernel launch: launch-configuration errors show here, asynchronous faults at the
// next synchronising call.
#define CUDA_LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())
#define CUBLAS_CHECK(call)                                                                 \
    do {                                                                                   \
        cublasStatus_t s_ = (call);                                                        \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                 \
            fprintf(stderr, "%s:%d: cuBLAS error %d (%s) in %s\n", __FILE__, __LINE__,     \
                    (int)s_, cublasGetStatusString(s_), #call);                            \
            abort();                                                                       \
        }                                                                                  \
    } while (0)
// Argument checks of the launchers: print and return -1.
#define MTRL_CUDA_REQUIRE(cond, ...)                                                       \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            fprintf(stderr, "%s:%d: %s: unsupported arguments (%s): ", __FILE__, __LINE__, \
                    __func__, #cond);                                                      \
            fprintf(stderr, __VA_ARGS__);                                                  \
            fputc('\n', stderr);                                                           \
            return -1;                                                                     \
        }                                                                                  \
    } while (0)

// ---- context --------------------------------------------------------------------------------
struct mtrl_cuda_ctx {
    int device;
    cudaStream_t stream;
    cublasHandle_t blas;
    void *scratch;
    size_t scratch_bytes;
    int sms;             // multiprocessor count
    int tf32;            // fp32 GEMM operands multiply as TF32 (mtrl_cuda_ctx_set_tf32)
    size_t smem_optin;   // largest dynamic shared memory a block may opt in to
    int cc;              // compute capability, major * 10 + minor (90: H100 / H200)
    mtrl_kernel_opts opts; // which kernels the launchers choose (mtrl_cuda_ctx_opts)
    // GEMM lanes 1 .. MTRL_CTX_LANES-1 (lane 0 is `stream`): non-blocking streams, created at the
    // first mtrl_ctx_lanes_fork, that share `blas`: a GEMM on lane i sets the handle's stream to
    // lane i's and its workspace to ws[i] (MTRL_CTX_LANE_WS bytes; concurrent GEMMs must not share
    // one), then gives the handle back to `stream`. One handle, because each cuBLAS handle holds
    // a large workspace of its own outside the planner's blocks (docs/perf.md, "Measurements moved out of code comments"). ev[i]: lane i's fork / join event.
    cudaStream_t lane_stream[MTRL_CTX_LANES];
    void *lane_ws[MTRL_CTX_LANES];
    cudaEvent_t lane_ev[MTRL_CTX_LANES];
    int lanes_made;
    // Graph recording (mtrl_cuda_graph_begin .. _end): `stream` is the capture stream cap_stream
    // meanwhile, the context's own stream kept in saved_stream; capture_bad: something that needs
    // the host was asked for (nothing of it was done), so the recording is thrown away.
    cudaStream_t cap_stream, saved_stream;
    int capturing, capture_bad;
};

// Independent GEMMs on several streams at once, for products too small to fill the GPU one at a
// time (the MoE experts: one cuBLAS call per expert). mtrl_ctx_lanes(ctx) is how many lanes to
// use (the option moe_lanes, kernel_opts.h: 1 .. MTRL_CTX_LANES, default
// MTRL_CTX_LANES); fork makes lanes 1 .. n-1 wait for the work queued on ctx->stream so far;
// mtrl_gemm_lane(ctx, i, ...) is mtrl_gemm on lane i (callers pass i < n, e.g. e % n); join makes
// ctx->stream wait for the lanes' work. Between fork and join each lane runs its own chain
// (GEMMs, and kernels launched on mtrl_ctx_lane_stream); the chains' outputs must be disjoint.
int mtrl_ctx_lanes(const mtrl_cuda_ctx *ctx);
void mtrl_ctx_lanes_fork(mtrl_cuda_ctx *ctx, int n);
void mtrl_ctx_lanes_join(mtrl_cuda_ctx *ctx, int n);
cudaStream_t mtrl_ctx_lane_stream(const mtrl_cuda_ctx *ctx, int lane);  // for kernels in a lane's chain
// Between fork and join: lane `lane` waits for the work queued on ctx->stream so far.
void mtrl_ctx_lane_after(mtrl_cuda_ctx *ctx, int lane);
int mtrl_gemm_lane(mtrl_cuda_ctx *ctx, int lane, int ta, int tb, int M, int N, int K, float alpha, const void *A,
                   int lda, const void *B, int ldb, int ab_type, float beta, void *C, int ldc, int c_type);

// Scratch of at least `bytes` (grow-only; growing waits for the device, then reallocates).
void *mtrl_ctx_scratch(mtrl_cuda_ctx *ctx, size_t bytes);

// Carves aligned pieces out of one scratch allocation: first a sizing pass (base NULL), then
// the real one.
struct ws_carver {
    char *base;
    size_t off;
    template <class T>
    T *take(size_t n) {
        off = (off + 255) & ~(size_t)255;
        T *p = base ? (T *)(base + off) : nullptr;
        off += n * sizeof(T);
        return p;
    }
};

static inline unsigned cdiv(size_t a, size_t b) { return (unsigned)((a + b - 1) / b); }

// A count option (kernel_opts.h): `forced` when it is not 0, else `dflt`; either clamped to
// [lo, hi] (lo when hi < lo).
static inline int opt_count(int forced, int dflt, int lo, int hi) {
    int n = forced ? forced : dflt;
    n = n > hi ? hi : n;
    return n < lo ? lo : n;
}

// ---- device helpers -------------------------------------------------------------------------
// The piece of element x of a packed tensor (varlen kernels: kda/chunk_varlen_mma.cu,
// core/conv_varlen.cu): the last p < n with first[p] <= x (first [n + 1] non-decreasing, the
// pieces' first rows or tiles; first[0] <= x < first[n]; an empty piece shares its start with
// the next and is skipped).
__device__ __forceinline__ int vl_piece_of(const int *__restrict__ first, int n, int x) {
    int lo = 0, hi = n - 1;  // invariant: first[lo] <= x, the answer in [lo, hi]
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (first[mid] <= x) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
// `red` is shared scratch of >= 33 floats. Fixed order: deterministic.
__device__ __forceinline__ float block_sum(float v, float *red) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    if (w == 0) {
        float x = lane < nw ? red[lane] : 0.f;
        x = warp_sum(x);
        if (lane == 0) red[32] = x;
    }
    __syncthreads();
    return red[32];
}
__device__ __forceinline__ double block_sum_d(double v, double *red) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum_d(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    if (w == 0) {
        double x = lane < nw ? red[lane] : 0.0;
        x = warp_sum_d(x);
        if (lane == 0) red[32] = x;
    }
    __syncthreads();
    return red[32];
}
__device__ __forceinline__ float block_max(float v, float *red) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    if (w == 0) {
        float x = lane < nw ? red[lane] : -INFINITY;
        x = warp_max(x);
        if (lane == 0) red[32] = x;
    }
    __syncthreads();
    return red[32];
}

__device__ __forceinline__ float sigmoidf_(float y) {
    return y >= 0.f ? 1.f / (1.f + __expf(-y)) : __expf(y) / (1.f + __expf(y));
}
// Accurate variant (expf) where the result is compared with the fp64 oracle closely.
__device__ __forceinline__ float sigmoid_acc(float y) {
    return y >= 0.f ? 1.f / (1.f + expf(-y)) : expf(y) / (1.f + expf(y));
}

__device__ __forceinline__ float bf2f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float bf2f(uint16_t x) {
    return __uint_as_float(((uint32_t)x) << 16);
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);  // .x = lo (low 16 bits), .y = hi
    return *reinterpret_cast<uint32_t *>(&p);
}
__device__ __forceinline__ uint32_t pack_bf16_raw(uint16_t lo, uint16_t hi) {
    return (uint32_t)lo | ((uint32_t)hi << 16);
}

// D = A B + D for one m16n8k16 tile: bf16 operands, fp32 accumulators. Fragment layout
// (PTX ISA, "mma.m16n8k16" for .bf16), with g = lane >> 2 and t = lane & 3:
//   A (16x16, row): a[0] = (g, 2t..2t+1), a[1] = (g+8, 2t..), a[2] = (g, 2t+8..), a[3] = (g+8, 2t+8..)
//   B (16x8, k x n): b[0] = (k = 2t..2t+1, n = g), b[1] = (k = 2t+8..2t+9, n = g)
//   C (16x8): c[0..1] = (g, 2t..2t+1), c[2..3] = (g+8, 2t..2t+1)
// Each 32-bit register holds two bf16, the lower column (or k) in the low half.
__device__ __forceinline__ void mma_bf16_16816(float *c, const uint32_t *a, const uint32_t *b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ldmatrix: four 8x8 b16 matrices; lane l supplies the (16-byte aligned) address of row l % 8
// of matrix l / 8. Thread (g = lane/4, t = lane%4) receives elements (g, 2t..2t+1) of each
// matrix (.trans: elements (2t..2t+1, g)), i.e. exactly the mma.m16n8k16 fragment layout.
__device__ __forceinline__ void ldsm_x4(uint32_t *r, const uint16_t *p) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t *r, const uint16_t *p) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
// Lane addresses of the three fragment loads (fragment layouts: mma_bf16_16816 above); moved here
// from attn/causal_mma.cu unchanged. With x4 loads the four registers are, in order:
// A: the 16 x 16 block at (row 0, col k0) of a row-major matrix: r[0..3] = a[0..3] (ldsm_x4).
__device__ __forceinline__ const uint16_t *adr_a(const uint16_t *A, int ld, int k0, int lane) {
    return A + (lane & 15) * ld + k0 + ((lane >> 4) << 3);
}
// B of n-tiles n0, n0 + 8 (k rows k0..k0+15) from an n-major matrix (element (k, n) at B[n ld + k]):
// ldsm_x4; r[0], r[1] = b[0], b[1] of n-tile n0 and r[2], r[3] = b[0], b[1] of n-tile n0 + 8.
__device__ __forceinline__ const uint16_t *adr_b_nk(const uint16_t *B, int ld, int k0, int n0,
                                                    int lane) {
    return B + (n0 + (lane & 7) + ((lane >> 4) << 3)) * ld + k0 + (((lane >> 3) & 1) << 3);
}
// The same from a k-major matrix (element (k, n) at B[k ld + n]): ldsm_x4_t, same register order.
__device__ __forceinline__ const uint16_t *adr_b_kn(const uint16_t *B, int ld, int k0, int n0,
                                                    int lane) {
    return B + (k0 + (lane & 7) + (((lane >> 3) & 1) << 3)) * ld + n0 + ((lane >> 4) << 3);
}

// 2^x on the special-function unit (ex2.approx: ~2 ulp; 2^-inf = +0).
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// cp.async of 16 bytes global -> shared (both 16-byte aligned).
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
// The same, filling 16 zero bytes instead when pred is false (gmem must still be a valid address).
__device__ __forceinline__ void cp_async16_pred(void *smem, const void *gmem, bool pred) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    int n = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// Double buffering over tiles 0 .. n-1: before working on tile i, issue tile i + 1 (if there is
// one) into the other buffer, then wait until tile i's copies (this thread's) have landed.
template <class Issue>
__device__ __forceinline__ void cp_async_next(int i, int n, Issue &&issue) {
    if (i + 1 < n) {
        issue(i + 1);
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
}

// ---- mbarriers (shared-memory barriers with phases; sm_90) -----------------------------------
__device__ __forceinline__ void mbar_init(uint32_t b, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(b), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t b, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(b), "r"(bytes) : "memory");
}
// Waits for the phase of parity `parity` to complete. A phase that never completes (a byte count
// or a piece assignment wrong: kda/chunk_mma.cu's cluster pass first ran after it was written) traps after
// 2^24 polls (each try_wait may suspend for a while: at least ~1 s, at most minutes) instead of
// hanging the test: the launch then fails with an error.
__device__ __forceinline__ void mbar_wait(uint32_t b, unsigned parity) {
    for (unsigned spins = 0;; spins++) {
        uint32_t ok;
        asm volatile(
            "{\n"
            ".reg .pred p;\n"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n"
            "}\n"
            : "=r"(ok)
            : "r"(b), "r"(parity)
            : "memory");
        if (ok) return;
        if (spins == (1u << 24)) __trap();
    }
}
__device__ __forceinline__ void mbar_arrive(uint32_t b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(b) : "memory");
}
// Named barriers 1..15 (0 is __syncthreads): `count` threads (a multiple of 32) meet; arrive
// signals without waiting.
__device__ __forceinline__ void named_bar_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// Thread-block clusters (sm_90): the cluster barrier (arrive with release, wait with acquire:
// shared-memory writes before the arrive are visible to every block of the cluster after the
// wait), this block's rank, and a load from another block's shared memory (distributed shared
// memory: the same offset in block `rank`).
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory"); }
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ float ld_dsmem_f32(const float *p, unsigned rank) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p), r;
    float x;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(x) : "r"(r) : "memory");
    return x;
}

// Programmatic dependent launch (sm_90). A kernel launched with mtrl_launch_pdl may start
// before the kernel ahead of it on the stream has finished: whatever it does before
// pdl_wait() must not read that kernel's output (it may read older data: the kernel ahead was
// launched the ordinary way, so everything before it had completed). pdl_wait() returns once the
// kernel ahead has completed and its writes are visible; pdl_trigger() lets the next
// PDL-launched kernel start (its blocks take SMs as this kernel's blocks leave). Both are no-ops
// in a kernel launched the ordinary way.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// cluster_x > 1 also launches clusters of cluster_x blocks along x (grid.x a multiple of it).
template <class... P, class... A>
static inline void mtrl_launch_pdl(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
                                   cudaStream_t stream, int cluster_x, A &&...args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[2] = {};
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    attr[1].id = cudaLaunchAttributeClusterDimension;
    attr[1].val.clusterDim.x = (unsigned)cluster_x;
    attr[1].val.clusterDim.y = 1;
    attr[1].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = cluster_x > 1 ? 2 : 1;
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, static_cast<P>(args)...));
}

// Raises a kernel's dynamic shared-memory limit when it needs more than 48 KB.
template <class F>
static inline void set_smem(F *kernel, size_t bytes) {
    if (bytes > 48 * 1024)
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)bytes));
}

#endif
