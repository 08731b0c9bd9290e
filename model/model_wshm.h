// model_wshm.h: the backbone's published weights in a slot of the same-host weight channel
// (common/weights_shm.h), laid out like the model's parameter table so a reader copies (and
// widens) instead of parsing.
//
// A slot holds every parameter in the order of m->params, then QB's β [L][E], each at a 64-byte
// aligned offset: with bf16, every matrix (ndim >= 2) as bf16 rounded to nearest even (the
// matrices mtrl_model_save_bf16 publishes), vectors and β as `real`; without, everything as
// `real`. The layout hash covers names, shapes, element types, offsets and sizeof(real), so a
// reader of another model (or precision) is refused by mtrl_wshm_open.
//
// Host slots (a CPU model, or any model where the channel is HOST): mtrl_model_wshm_pack_host /
// _unpack_host. Device slots (learner and actors on GPUs of one host, a DEVICE channel): the
// learner's two slots live in its GPU's memory, filled by one kernel on the model's stream (no
// host round trip; the stamp is written by a CUDA host callback once the copy is done), and
// shared through CUDA IPC handles in the channel header; an actor opens them once
// (cudaIpcOpenMemHandle) and converts a slot into its own parameter block device to device.
// Built without CUDA (or the fp64 build), the device calls return MTRL_ERR_USAGE.
#ifndef MTRL_MODEL_WSHM_H
#define MTRL_MODEL_WSHM_H

#include <stdint.h>

#include "model/model.h"
#include "common/weights_shm.h"

enum { MTRL_WSHM_ITEM_REAL = 0, MTRL_WSHM_ITEM_BF16 = 1, MTRL_WSHM_ITEM_BETA = 2 };
// A reader's flag on an item of its own device copy of the layout (never in a layout or its
// hash): the destination is the bf16-resident block of a model (model_wsplit.h) at byte `src`,
// the slot's bf16 copied as it is (or its `real` rounded), instead of the fp32 block.
enum { MTRL_WSHM_ITEM_TO_BF16 = 4 };

// One tensor of a slot: `n` elements from byte `src` of the parameter block (BETA: of the β
// array) to byte `dst` of the slot, as `real` or bf16.
typedef struct mtrl_wshm_item {
    uint64_t src, dst, n;
    uint32_t kind;  // MTRL_WSHM_ITEM_*
    uint32_t pad;
} mtrl_wshm_item;

typedef struct mtrl_wshm_layout {
    mtrl_wshm_item *items; // every parameter, then β
    int n;
    int bf16;
    uint64_t slot_bytes;
    uint64_t hash;
} mtrl_wshm_layout;

void mtrl_model_wshm_layout(const mtrl_model *m, int bf16, mtrl_wshm_layout *lay);
void mtrl_model_wshm_layout_free(mtrl_wshm_layout *lay);

// Writes the model's current parameters and β into a host slot (a GPU model's host mirror is
// refreshed from the device first).
void mtrl_model_wshm_pack_host(const mtrl_model *m, const mtrl_wshm_layout *lay, void *slot);
// Reads a host slot into the model (bf16 widened exactly) and, for a GPU model, uploads it.
void mtrl_model_wshm_unpack_host(mtrl_model *m, const mtrl_wshm_layout *lay, const void *slot);

// ---- device slots (CUDA) ----------------------------------------------------------------------
typedef struct mtrl_model_wshm_dev mtrl_model_wshm_dev;

// Writer: allocates the two device slots on the model's GPU and stores their IPC handles in the
// channel (a DEVICE channel of lay->slot_bytes).
mtrl_status mtrl_model_wshm_dev_create(mtrl_model_wshm_dev **out, const mtrl_model *m, const mtrl_wshm_layout *lay,
                                       mtrl_wshm *ch, mtrl_error *err);
// Writer: packs the model's device parameters and β into the next slot on the model's stream
// (ordered after the optimizer step that produced them, before the next step's kernels) and
// returns at once; a host callback stamps the slot with `version` when the copy is done. Returns
// the slot, for the announcement. Waits only if the previous publish's copy is still running.
int mtrl_model_wshm_dev_publish(mtrl_model_wshm_dev *d, mtrl_model *m, mtrl_wshm *ch, uint32_t version);
// Reader: opens the IPC handles of ch's slots on the model's GPU (cudaIpcOpenMemHandle).
mtrl_status mtrl_model_wshm_dev_open(mtrl_model_wshm_dev **out, const mtrl_model *m, const mtrl_wshm_layout *lay,
                                     const mtrl_wshm *ch, mtrl_error *err);
// Reader: converts device slot `slot` into the model's parameter block and β (bf16 widened,
// device to device, on the model's stream) and waits for it; the host β is refreshed too. A
// bf16-resident model (mtrl_model_init_infer_bf16_on) gets its GEMM-only matrices copied into
// its bf16 block as they are in the slot (fp32 slots: rounded), the rest into its fp32 block.
void mtrl_model_wshm_dev_unpack(mtrl_model_wshm_dev *d, mtrl_model *m, int slot);
// Writer: waits for the copies in flight, frees the slots; reader: closes the handles.
void mtrl_model_wshm_dev_free(mtrl_model_wshm_dev *d); // NULL-safe

#endif
