// model_wshm.c: the backbone's weights in a weight-channel slot (see model_wshm.h).
#include "model/model_wshm.h"

#include <stdlib.h>
#include <string.h>

#include "common/bf16.h"
#include "common/check.h"
#include "common/hash.h"
#include "model/backend.h"
#include "model/model_ws.h"
#include "model/model_wsplit.h"

#define ALIGN64(x) (((x) + 63u) & ~(uint64_t)63u)

void mtrl_model_wshm_layout(const mtrl_model *m, int bf16, mtrl_wshm_layout *lay) {
    memset(lay, 0, sizeof *lay);
    lay->n = m->params.n + 1;
    lay->items = xcalloc((size_t)lay->n, sizeof *lay->items);
    lay->bf16 = bf16 != 0;
    uint64_t at = 0, h = mtrl_hash64_str("mtrl weight slot 1", sizeof(real));
    h = mtrl_hash64_feed(h, &lay->bf16, sizeof lay->bf16);
    for (int i = 0; i < m->params.n; i++) {
        const mtrl_tensor *t = &m->params.items[i];
        mtrl_wshm_item *it = &lay->items[i];
        it->src = t->offset;
        it->n = t->numel;
        it->kind = bf16 && t->ndim >= 2 ? MTRL_WSHM_ITEM_BF16 : MTRL_WSHM_ITEM_REAL;
        it->dst = at;
        at = ALIGN64(at + it->n * (it->kind == MTRL_WSHM_ITEM_BF16 ? sizeof(uint16_t) : sizeof(real)));
        h = mtrl_hash64_str(t->name, h);
        h = mtrl_hash64_feed(h, t->shape, sizeof(int64_t) * (size_t)t->ndim);
        h = mtrl_hash64_feed(h, it, sizeof *it);
    }
    mtrl_wshm_item *b = &lay->items[m->params.n];
    b->kind = MTRL_WSHM_ITEM_BETA;
    b->src = 0;
    b->n = (uint64_t)m->dims.L * (uint64_t)m->dims.E;
    b->dst = at;
    h = mtrl_hash64_feed(h, b, sizeof *b);
    lay->slot_bytes = ALIGN64(at + b->n * sizeof(real));
    lay->hash = h;
}

void mtrl_model_wshm_layout_free(mtrl_wshm_layout *lay) {
    free(lay->items);
    memset(lay, 0, sizeof *lay);
}

void mtrl_model_wshm_pack_host(const mtrl_model *m, const mtrl_wshm_layout *lay, void *slot) {
    model_params_download((mtrl_model *)m); // the device copy is read, the mirror refreshed
    const char *params = m->params.base;
    char *dst = slot;
    // One parallel region over every item: the threads split each tensor, nobody waits between.
    #pragma omp parallel
    for (int i = 0; i < lay->n; i++) {
        const mtrl_wshm_item *it = &lay->items[i];
        const real *s = it->kind == MTRL_WSHM_ITEM_BETA ? m->qb_beta : (const real *)(params + it->src);
        size_t n = it->n;
        if (it->kind == MTRL_WSHM_ITEM_BF16) {
            uint16_t *d = (uint16_t *)(dst + it->dst);
            #pragma omp for schedule(static) nowait
            for (size_t k = 0; k < n; k++) d[k] = mtrl_bf16_from_f32((float)s[k]);
        } else {
            real *d = (real *)(dst + it->dst);
            #pragma omp for schedule(static) nowait
            for (size_t k = 0; k < n; k++) d[k] = s[k];
        }
    }
}

void mtrl_model_wshm_unpack_host(mtrl_model *m, const mtrl_wshm_layout *lay, const void *slot) {
    char *params = m->params.base;
    const char *src = slot;
    #pragma omp parallel
    for (int i = 0; i < lay->n; i++) {
        const mtrl_wshm_item *it = &lay->items[i];
        real *d = it->kind == MTRL_WSHM_ITEM_BETA ? m->qb_beta : (real *)(params + it->src);
        size_t n = it->n;
        if (it->kind == MTRL_WSHM_ITEM_BF16) {
            const uint16_t *s = (const uint16_t *)(src + it->dst);
            #pragma omp for schedule(static) nowait
            for (size_t k = 0; k < n; k++) d[k] = (real)mtrl_bf16_to_f32(s[k]);
        } else {
            const real *s = (const real *)(src + it->dst);
            #pragma omp for schedule(static) nowait
            for (size_t k = 0; k < n; k++) d[k] = s[k];
        }
    }
    if (m->device != MTRL_DEVICE_CPU) {
        mtrl_backend *be = m->be;
        be->upload(be, m->d_qb_beta, m->qb_beta, sizeof(real) * (size_t)m->dims.L * (size_t)m->dims.E);
    }
    model_params_upload(m); // includes model_weights_changed
    if (m->device != MTRL_DEVICE_CPU) m->be->sync(m->be);
}

#if defined(MTRL_HAVE_CUDA) && !REAL_IS_F64

#include "kernels/cuda/core/model_ops.h"
#include "model/model_wshm_cuda.h"

struct mtrl_model_wshm_dev {
    int writer;
    int n;
    mtrl_wshm_item *items;         // device copy of the layout's items
    void *slot[MTRL_WSHM_SLOTS];   // device memory (writer: owned; reader: IPC-mapped)
    void *done;                    // writer: event after the last publish's stamp
    mtrl_cuda_ctx *ctx;            // the model's stream
};

typedef struct stamp_job {
    mtrl_wshm *ch;
    int slot;
    uint32_t version;
} stamp_job;

// On a CUDA host thread once the pack before it on the stream is done: the slot is whole.
static void stamp_(void *user) {
    stamp_job *j = user;
    mtrl_wshm_write_end(j->ch, j->slot, j->version);
    free(j);
}

static mtrl_model_wshm_dev *dev_new_(const mtrl_model *m, const mtrl_wshm_layout *lay, int writer) {
    mtrl_model_wshm_dev *d = xcalloc(1, sizeof *d);
    d->writer = writer;
    d->n = lay->n;
    d->ctx = mtrl_backend_cuda_ctx(m->be);
    // A bf16-resident reader's own items: each parameter's destination in its two blocks.
    mtrl_wshm_item *items = xmalloc(sizeof *items * (size_t)lay->n);
    memcpy(items, lay->items, sizeof *items * (size_t)lay->n);
    if (m->weights_bf16) {
        MTRL_CHECKF(!writer, "a bf16-resident model (an actor's) does not publish weights");
        const mtrl_wsplit *s = m->wsplit;
        for (int i = 0; i < m->params.n; i++) {
            if (s->f32_off[i] != MTRL_WSPLIT_NONE) {
                items[i].src = s->f32_off[i];
            } else {
                items[i].src = s->b16_off[i];
                items[i].kind |= MTRL_WSHM_ITEM_TO_BF16;
            }
        }
    }
    d->items = mtrl_mc_malloc(sizeof *items * (size_t)lay->n);
    mtrl_mc_upload(d->ctx, d->items, items, sizeof *items * (size_t)lay->n);
    mtrl_cuda_sync(d->ctx);
    free(items);
    return d;
}

mtrl_status mtrl_model_wshm_dev_create(mtrl_model_wshm_dev **out, const mtrl_model *m, const mtrl_wshm_layout *lay,
                                       mtrl_wshm *ch, mtrl_error *err) {
    *out = NULL;
    if (m->device != MTRL_DEVICE_CUDA) return mtrl_error_set(err, MTRL_ERR_USAGE, "device weight slots need a model on a GPU");
    mtrl_model_wshm_dev *d = dev_new_(m, lay, 1);
    for (int s = 0; s < MTRL_WSHM_SLOTS; s++) {
        // Plain cudaMalloc blocks: what cudaIpcGetMemHandle shares (not a pool's memory).
        d->slot[s] = mtrl_mc_malloc(lay->slot_bytes);
        uint8_t h[MTRL_WSHM_IPC_BYTES];
        mtrl_mw_ipc_get(d->slot[s], h);
        mtrl_wshm_set_ipc(ch, s, h);
    }
    *out = d;
    return MTRL_OK;
}

int mtrl_model_wshm_dev_publish(mtrl_model_wshm_dev *d, mtrl_model *m, mtrl_wshm *ch, uint32_t version) {
    // The previous publish's stamp must land before this one picks its slot (it reads the
    // latest slot); normally it did long ago, a step's worth of kernels back.
    mtrl_mw_event_wait(d->done);
    int slot;
    mtrl_wshm_write_begin(ch, &slot);
    mtrl_mw_pack(d->ctx, d->items, d->n, (const float *)m->d_params, (const float *)m->d_qb_beta, d->slot[slot]);
    stamp_job *j = xmalloc(sizeof *j);
    *j = (stamp_job){ch, slot, version};
    mtrl_mw_host_func(d->ctx, stamp_, j);
    mtrl_mw_event_record(d->ctx, &d->done);
    return slot;
}

mtrl_status mtrl_model_wshm_dev_open(mtrl_model_wshm_dev **out, const mtrl_model *m, const mtrl_wshm_layout *lay,
                                     const mtrl_wshm *ch, mtrl_error *err) {
    *out = NULL;
    if (m->device != MTRL_DEVICE_CUDA)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "weight channel %s holds device slots: the model is not on a GPU", mtrl_wshm_name(ch));
    mtrl_model_wshm_dev *d = dev_new_(m, lay, 0);
    for (int s = 0; s < MTRL_WSHM_SLOTS; s++) {
        char why[256];
        d->slot[s] = mtrl_mw_ipc_open(mtrl_wshm_ipc(ch, s), m->gpu, why, sizeof why);
        if (!d->slot[s]) {
            mtrl_model_wshm_dev_free(d);
            return mtrl_error_set(err, MTRL_ERR_IO, "weight channel %s, slot %d: %s", mtrl_wshm_name(ch), s, why);
        }
    }
    *out = d;
    return MTRL_OK;
}

void mtrl_model_wshm_dev_unpack(mtrl_model_wshm_dev *d, mtrl_model *m, int slot) {
    mtrl_mw_unpack(d->ctx, d->items, d->n, d->slot[slot], (float *)m->d_params, (float *)m->d_qb_beta, m->d_w16);
    mtrl_cuda_sync(d->ctx);
    m->be->download(m->be, m->qb_beta, m->d_qb_beta, sizeof(real) * (size_t)m->dims.L * (size_t)m->dims.E);
    model_weights_changed(m);
}

void mtrl_model_wshm_dev_free(mtrl_model_wshm_dev *d) {
    if (!d) return;
    mtrl_cuda_sync(d->ctx);
    for (int s = 0; s < MTRL_WSHM_SLOTS; s++) {
        if (d->writer) mtrl_mc_free(d->ctx, d->slot[s]);
        else mtrl_mw_ipc_close(d->slot[s]);
    }
    mtrl_mw_event_free(d->done);
    mtrl_mc_free(d->ctx, d->items);
    free(d);
}

#else

struct mtrl_model_wshm_dev {
    int unused;
};

static mtrl_status no_cuda_(mtrl_error *err) {
    return mtrl_error_set(err, MTRL_ERR_USAGE, "device weight slots need the CUDA build (fp32)");
}

mtrl_status mtrl_model_wshm_dev_create(mtrl_model_wshm_dev **out, const mtrl_model *m, const mtrl_wshm_layout *lay,
                                       mtrl_wshm *ch, mtrl_error *err) {
    (void)m, (void)lay, (void)ch;
    *out = NULL;
    return no_cuda_(err);
}
int mtrl_model_wshm_dev_publish(mtrl_model_wshm_dev *d, mtrl_model *m, mtrl_wshm *ch, uint32_t version) {
    (void)d, (void)m, (void)ch, (void)version;
    MTRL_CHECKF(0, "device weight slots need the CUDA build");
    return -1;
}
mtrl_status mtrl_model_wshm_dev_open(mtrl_model_wshm_dev **out, const mtrl_model *m, const mtrl_wshm_layout *lay,
                                     const mtrl_wshm *ch, mtrl_error *err) {
    (void)m, (void)lay, (void)ch;
    *out = NULL;
    return no_cuda_(err);
}
void mtrl_model_wshm_dev_unpack(mtrl_model_wshm_dev *d, mtrl_model *m, int slot) {
    (void)d, (void)m, (void)slot;
    MTRL_CHECKF(0, "device weight slots need the CUDA build");
}
void mtrl_model_wshm_dev_free(mtrl_model_wshm_dev *d) { (void)d; }

#endif
