// weights_shm.h: the same-host weight channel (issue 21): published weights that actors on the
// learner's host copy out of shared memory instead of receiving and parsing a safetensors blob
// over ZeroMQ.
//
// A POSIX shared-memory segment (shm_open under a name with the writer's pid and a random
// nonce, 0600) holds a header page and, for a HOST channel, two slots of slot_bytes each. A
// DEVICE channel keeps its two slots in GPU memory (model/model_wshm.h allocates them and
// puts their CUDA IPC handles into the header: the handles travel once, with the segment, not
// with every announcement); its segment is the header alone. What a slot holds is the caller's
// business (model_wshm.h lays the model's parameter table out in it); the channel checks that
// both ends agree on it through layout_hash and slot_bytes.
//
// Versions and slots, a seqlock per slot (double-buffered, the writer never waits):
//   writer  mtrl_wshm_write_begin: the slot that is NOT the latest; its seq goes odd
//           ... fills it (host memory, or device kernels on a stream) ...
//           mtrl_wshm_write_end(version): stamp = version, seq even, latest = (version, slot);
//           callable from another thread (a CUDA host callback after the device copy)
//           then announces (version, slot) to the actors (WEIGHTS_AT over ZeroMQ, wire.h)
//   reader  mtrl_wshm_read_begin(version, slot): OK when the slot holds that version now
//           ... copies it out (and waits for the device copy to finish) ...
//           mtrl_wshm_read_end: 1 when seq did not move meanwhile: the copy is whole; 0 when the
//           writer started over the slot during the copy (torn): a newer version is complete
//           in the other slot (mtrl_wshm_latest), read that one instead.
// The writer reuses a slot only two publishes later, so a reader faster than one publish
// interval never retries. Nothing the reader does blocks the writer.
//
// The reader is another process: everything it reads is checked. mtrl_wshm_open refuses (with a
// message naming the segment) a name that does not exist (MTRL_ERR_NOTFOUND: another host, or the
// learner is gone), a header that is not one (MTRL_ERR_FORMAT: bad magic, size, slot offsets
// outside the segment), one of another learner or an earlier run (MTRL_ERR_MISMATCH: nonce
// differs from the announcement's; stale), and one laid out for another model (MTRL_ERR_MISMATCH:
// layout hash or slot bytes). A writer killed before it could remove its name leaves the
// segment behind; the nonce tells it from a live one, and the next mtrl_wshm_create removes the
// channels of writers whose process is gone.
#ifndef MTRL_WEIGHTS_SHM_H
#define MTRL_WEIGHTS_SHM_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define MTRL_WSHM_SLOTS 2
#define MTRL_WSHM_NAME_MAX 64
#define MTRL_WSHM_IPC_BYTES 64 // sizeof(cudaIpcMemHandle_t)

typedef enum mtrl_wshm_kind { MTRL_WSHM_HOST = 1, MTRL_WSHM_DEVICE = 2 } mtrl_wshm_kind;

typedef struct mtrl_wshm mtrl_wshm;

// What a reader holds between read_begin and read_end.
typedef struct mtrl_wshm_ticket {
    int slot;
    uint32_t version;
    uint64_t seq;
} mtrl_wshm_ticket;

// ---- writer ---------------------------------------------------------------------------------------
// Creates a channel of `kind` with two slots of slot_bytes (HOST: in the segment, reserved with
// posix_fallocate so a full /dev/shm is an error here, MTRL_ERR_NOMEM naming it, and not a SIGBUS
// later), after removing the stale channels of dead writers (above). layout_hash: the caller's
// digest of what a slot holds.
mtrl_status mtrl_wshm_create(mtrl_wshm **out, mtrl_wshm_kind kind, uint64_t slot_bytes, uint64_t layout_hash,
                             mtrl_error *err);
// The slot the next write goes to: the one not holding the latest version.
int mtrl_wshm_next_slot(const mtrl_wshm *w);
// Starts writing slot mtrl_wshm_next_slot (returned in *slot): readers of it from now on see a
// torn read. Returns the host memory of the slot (NULL for a DEVICE channel).
void *mtrl_wshm_write_begin(mtrl_wshm *w, int *slot);
// Stamps the slot with version and makes it the latest. Thread-safe against readers; one
// writer thread at a time.
void mtrl_wshm_write_end(mtrl_wshm *w, int slot, uint32_t version);
// The IPC handles of a DEVICE channel's slots (MTRL_WSHM_IPC_BYTES each), written before the
// first announcement; read back by the reader.
void mtrl_wshm_set_ipc(mtrl_wshm *w, int slot, const void *handle);

// ---- reader ---------------------------------------------------------------------------------------
// Opens the channel `name` announced with `nonce`, for a slot layout of layout_hash and
// slot_bytes (see the errors above). Read-only mapping.
mtrl_status mtrl_wshm_open(mtrl_wshm **out, const char *name, uint64_t nonce, uint64_t layout_hash,
                           uint64_t slot_bytes, mtrl_error *err);
// Begins a copy of `version` from `slot`: MTRL_OK with *data (the host slot; NULL for a
// DEVICE channel) when the slot holds that version now. MTRL_ERR_STATE: not yet (being written,
// or the device copy behind the announcement has not finished: try again shortly).
// MTRL_ERR_NOTFOUND: the slot moved on past that version (read mtrl_wshm_latest instead).
mtrl_status mtrl_wshm_read_begin(const mtrl_wshm *r, uint32_t version, int slot, mtrl_wshm_ticket *t,
                                 const void **data, mtrl_error *err);
// 1 when the slot was not rewritten since read_begin (the copy is whole), 0 when it was.
int mtrl_wshm_read_end(const mtrl_wshm *r, const mtrl_wshm_ticket *t);
// The latest complete version and its slot; 0 when nothing was written yet.
int mtrl_wshm_latest(const mtrl_wshm *r, uint32_t *version, int *slot);
// The IPC handle of a DEVICE channel's slot (MTRL_WSHM_IPC_BYTES bytes in the header).
const void *mtrl_wshm_ipc(const mtrl_wshm *r, int slot);

// ---- both ------------------------------------------------------------------------------------------
const char *mtrl_wshm_name(const mtrl_wshm *w);
uint64_t mtrl_wshm_nonce(const mtrl_wshm *w);
mtrl_wshm_kind mtrl_wshm_kind_of(const mtrl_wshm *w);
uint64_t mtrl_wshm_slot_bytes(const mtrl_wshm *w);
// Unmaps; the writer also removes the name (readers that still map it keep their mapping).
void mtrl_wshm_close(mtrl_wshm *w); // NULL-safe

#endif
