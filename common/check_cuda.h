// check_cuda.h: the invariant tier (check.h) for CUDA, cuBLAS and NCCL calls made from C.
//
// Every call is wrapped: a failure prints file:line, the failing call and the library's own
// error name and text, then aborts (docs/architecture.md §9: GPU failures are invariants, not inputs).
// One generator makes all three, as ggml's CHECK_GEN does. Compiled only in CUDA builds
// (MTRL_HAVE_CUDA); kernels/cuda has its own copy because kernels/ includes nothing of ours.
//     CUDA_CHECK(cudaMalloc(&p, n));   CUBLAS_CHECK(cublasCreate(&h));   NCCL_CHECK(ncclCommInitAll(...));
#ifndef MTRL_CHECK_CUDA_H
#define MTRL_CHECK_CUDA_H

#ifdef MTRL_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "common/check.h"

#define MTRL_CHECK_GEN(call, type, ok, name_fn, text_fn)                                            \
    do {                                                                                            \
        type s_ = (call);                                                                           \
        if (s_ != (ok)) mtrl_check_fail(__FILE__, __LINE__, #call, "%s: %s", name_fn(s_), text_fn(s_)); \
    } while (0)

#define CUDA_CHECK(call) MTRL_CHECK_GEN(call, cudaError_t, cudaSuccess, cudaGetErrorName, cudaGetErrorString)
#define CUBLAS_CHECK(call) MTRL_CHECK_GEN(call, cublasStatus_t, CUBLAS_STATUS_SUCCESS, mtrl_cublas_name, cublasGetStatusString)
// After a kernel launch: configuration errors show here, asynchronous faults at the next sync.
#define CUDA_LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())

static inline const char *mtrl_cublas_name(cublasStatus_t s) { return cublasGetStatusName(s); }

#ifdef MTRL_HAVE_NCCL
#include <nccl.h>
static inline const char *mtrl_nccl_name(ncclResult_t r) { return r == ncclSuccess ? "ncclSuccess" : "ncclError"; }
#define NCCL_CHECK(call) MTRL_CHECK_GEN(call, ncclResult_t, ncclSuccess, mtrl_nccl_name, ncclGetErrorString)
#endif

#endif
#endif
