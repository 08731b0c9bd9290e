// model_wsplit.h: the bf16-resident form of an inference model's weights (issue 21): which
// parameters keep an fp32 copy on the device and where each one lives.
//
// An actor whose GEMMs take bf16 operands ([kernels] gemm = bf16) needs its GEMM weights only
// as bf16: today it holds the fp32 block AND the backend's bf16 copy of it. In the bf16 form
// (mtrl_model_init_infer_bf16_on, [actor] weights = bf16) the device holds two compact blocks:
//   fp32  the vectors (norms, gains, biases, A_log) and the matrices a non-GEMM op reads in
//         the forward and the decode: `embed` (embedding lookup), `attnres.w` / `attnres.g`
//         (the AttnRes site kernel), `kda.conv_q/k/v` (the short conv), `mla.wkvb` (absorbed
//         queries, up-projection of values, the absorbed decode and the naive expansion);
//   bf16  every other matrix (the projections, lm_head, the router, the dense and expert
//         FFNs, image.patch_w), read by gemm and the expert entries only.
// The table (m->params, its offsets, the host mirror and the weight-slot layout) is unchanged;
// only the device placement differs. A GEMM-only tensor's device pointer (m->dP) points INTO
// the bf16 block (as `real *`): the CUDA backend takes such a pointer as the bf16 operand
// itself and every non-GEMM entry that reads a weight aborts on one (no silent misuse).
#ifndef MTRL_MODEL_WSPLIT_H
#define MTRL_MODEL_WSPLIT_H

#include <stddef.h>

#include "common/tensor.h"

#define MTRL_WSPLIT_NONE ((size_t)-1)

typedef struct mtrl_wsplit {
    int n;            // tensors (m->params.n)
    size_t *f32_off;  // [n] byte offset in the fp32 block, or MTRL_WSPLIT_NONE
    size_t *b16_off;  // [n] byte offset in the bf16 block, or MTRL_WSPLIT_NONE (exactly one is set)
    size_t f32_bytes; // the blocks' sizes (each tensor at a 256-byte aligned offset)
    size_t b16_bytes;
    size_t gemm_numel;  // elements of the bf16 (GEMM-only) tensors
} mtrl_wsplit;

// 1 when tensor `name` of ndim dims is read only as a GEMM / expert operand in the forward and
// decode (its fp32 copy can go); 0 for vectors and the matrices listed above.
int mtrl_wsplit_gemm_only(const char *name, int ndim);

void mtrl_wsplit_init(mtrl_wsplit *s, const mtrl_tt *t);
void mtrl_wsplit_free(mtrl_wsplit *s);

// Device bytes of an inference model's weights on a GPU: the fp32 block, plus the backend's
// bf16 copy of all of it when gemm_bf16 (today's form); the bf16 form's two blocks when
// weights_bf16 (which implies gemm_bf16).
size_t mtrl_wsplit_device_bytes(const mtrl_tt *t, int gemm_bf16, int weights_bf16);

#endif
