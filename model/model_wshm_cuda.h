// model_wshm_cuda.h: the CUDA pieces of the device weight channel (model_wshm.h), in
// model_wshm_cuda.cu: the slot pack / unpack kernel, CUDA IPC handles, events and host callbacks
// on a context's stream. Plain C; built only with MTRL_HAVE_CUDA (fp32 model). Failures of the
// CUDA calls abort (check_cuda.h) except opening an IPC handle, which another process (or a
// GPU without peer access) may refuse: it returns NULL with the reason.
#ifndef MTRL_MODEL_WSHM_CUDA_H
#define MTRL_MODEL_WSHM_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "model/model_wshm.h"
#include "kernels/cuda/kernels_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

// The model's stream (backend_cuda.c).
struct mtrl_backend;
mtrl_cuda_ctx *mtrl_backend_cuda_ctx(struct mtrl_backend *be);

// items: a DEVICE array of n items (model_wshm.h). pack: slot <- params / beta (fp32, bf16
// rounded to nearest even); unpack: params / beta <- slot (bf16 widened), items flagged
// MTRL_WSHM_ITEM_TO_BF16 into w16 instead (bf16 copied, fp32 rounded; w16 NULL when none is).
// On the ctx's stream.
void mtrl_mw_pack(mtrl_cuda_ctx *ctx, const mtrl_wshm_item *items, int n, const float *params, const float *beta,
                  void *slot);
void mtrl_mw_unpack(mtrl_cuda_ctx *ctx, const mtrl_wshm_item *items, int n, const void *slot, float *params,
                    float *beta, void *w16);
// CUDA IPC: handle (MTRL_WSHM_IPC_BYTES) of device memory p; open in another process on
// `device` (NULL with why[] on failure); close.
void mtrl_mw_ipc_get(const void *p, void *handle);
void *mtrl_mw_ipc_open(const void *handle, int device, char *why, size_t cap);
void mtrl_mw_ipc_close(void *p);
// fn(user) on a host thread once the stream's work so far is done (cudaLaunchHostFunc).
void mtrl_mw_host_func(mtrl_cuda_ctx *ctx, void (*fn)(void *), void *user);
// An event recorded on the stream now (created on the first call); wait for it.
void mtrl_mw_event_record(mtrl_cuda_ctx *ctx, void **ev);
void mtrl_mw_event_wait(void *ev);
void mtrl_mw_event_free(void *ev);
// Pinned host memory (checkpoint snapshots: device-to-host at full PCIe rate).
void *mtrl_mw_host_alloc(size_t bytes);
void mtrl_mw_host_free(void *p);

#ifdef __cplusplus
}
#endif

#endif
