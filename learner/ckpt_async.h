// ckpt_async.h: checkpoints written while training goes on (issue 21).
//
// mtrl_ckpt_async_start copies the model's state (parameters, β and, with_optimizer, both AdamW
// moments, with step and version) into a snapshot buffer, then returns while a thread writes
// the snapshot with mtrl_model_save (the same bytes a synchronous save of that state writes,
// atomically: PATH.tmp, fsync, rename) and hashes the file. The caller may step the model at
// once. Copying is the only cost on the caller's path: a memcpy on the CPU, a device-to-host
// copy into pinned memory for a model on a GPU (full PCIe rate). The buffer is kept for the next
// checkpoint (grown when one with the optimizer follows one without).
//
// One write at a time: collect the previous one (mtrl_ckpt_async_collect) before starting the
// next. collect reports each finished write once, with its status: a write that failed names
// the file and the reason, and nothing was replaced under the real name.
#ifndef MTRL_CKPT_ASYNC_H
#define MTRL_CKPT_ASYNC_H

#include <stdint.h>

#include "model/model.h"
#include "common/status.h"

typedef struct mtrl_ckpt_async mtrl_ckpt_async;

typedef struct mtrl_ckpt_done {
    char path[1200];
    long step;           // the caller's step of the checkpoint (mtrl_ckpt_async_start)
    uint32_t version;
    mtrl_status status;
    mtrl_error err;      // when status != MTRL_OK
    char sha256[65];     // of the written file
    double snapshot_s;   // seconds the caller waited for the copy
    double write_s;      // seconds the thread took to write and hash
} mtrl_ckpt_done;

mtrl_ckpt_async *mtrl_ckpt_async_new(void);
// Snapshots the model and starts writing it to path with the caller's metadata (n_meta
// key/value pairs, copied); step: what the caller logs the checkpoint under (done->step). MTRL_ERR_STATE when a write is still uncollected; MTRL_ERR_NOMEM
// when the snapshot buffer cannot be allocated.
mtrl_status mtrl_ckpt_async_start(mtrl_ckpt_async *a, const mtrl_model *m, const char *path, long step, int with_optimizer,
                                  const char *const *meta, int n_meta, mtrl_error *err);
// 1 with *done when a write has finished and was not collected yet, 0 otherwise; wait: first
// waits for a write in flight.
int mtrl_ckpt_async_collect(mtrl_ckpt_async *a, int wait, mtrl_ckpt_done *done);
// 1 while a write is started and not collected.
int mtrl_ckpt_async_busy(const mtrl_ckpt_async *a);
// Waits for a write in flight (its result is dropped: collect it first) and frees the buffers.
void mtrl_ckpt_async_free(mtrl_ckpt_async *a); // NULL-safe

#endif
