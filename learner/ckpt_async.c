// ckpt_async.c: checkpoints written while training goes on (see ckpt_async.h).
#include "learner/ckpt_async.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/hash.h"
#include "model/backend.h"
#include "common/timeutil.h"

#if defined(MTRL_HAVE_CUDA) && !REAL_IS_F64
#include "model/model_wshm_cuda.h"
#endif

struct mtrl_ckpt_async {
    void *buf;               // the snapshot: params | adam_m | adam_v | β
    size_t cap;
    int pinned;              // buf from cudaMallocHost
    mtrl_model snap;         // the model as of the snapshot, over buf (CPU)
    int with_optimizer;
    char **meta;
    int n_meta;
    pthread_t thread;
    int started;             // a write was started and not collected
    atomic_int finished;
    mtrl_ckpt_done done;
};

mtrl_ckpt_async *mtrl_ckpt_async_new(void) { return xcalloc(1, sizeof(mtrl_ckpt_async)); }

static void buf_free_(mtrl_ckpt_async *a) {
#if defined(MTRL_HAVE_CUDA) && !REAL_IS_F64
    if (a->pinned) {
        mtrl_mw_host_free(a->buf);
        a->buf = NULL;
    }
#endif
    free(a->buf);
    a->buf = NULL;
    a->cap = 0;
}

static int buf_reserve_(mtrl_ckpt_async *a, size_t bytes, int device) {
    if (a->cap >= bytes) return 0;
    buf_free_(a);
#if defined(MTRL_HAVE_CUDA) && !REAL_IS_F64
    if (device == MTRL_DEVICE_CUDA) {
        a->buf = mtrl_mw_host_alloc(bytes);
        a->pinned = 1;
        a->cap = bytes;
        return 0;
    }
#endif
    (void)device;
    a->pinned = 0;
    a->buf = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    if (!a->buf) return -1;
    a->cap = bytes;
    return 0;
}

static void meta_free_(mtrl_ckpt_async *a) {
    for (int i = 0; i < 2 * a->n_meta; i++) free(a->meta[i]);
    free(a->meta);
    a->meta = NULL;
    a->n_meta = 0;
}

static void *write_(void *user) {
    mtrl_ckpt_async *a = user;
    double t0 = mtrl_time_mono();
    mtrl_ckpt_done *d = &a->done;
    d->status = mtrl_model_save(&a->snap, d->path, NULL, NULL, a->with_optimizer, (const char *const *)a->meta, a->n_meta, &d->err);
    if (d->status == MTRL_OK && mtrl_sha256_file_hex(d->path, d->sha256) != 0)
        d->status = mtrl_error_set(&d->err, MTRL_ERR_IO, "%s: written, but cannot be read back to hash it", d->path);
    d->write_s = mtrl_time_mono() - t0;
    atomic_store(&a->finished, 1);
    return NULL;
}

// A block of the model into the snapshot: a device model downloads (into pinned memory), a CPU
// one copies with every thread (a single memcpy stream is well below the memory bandwidth).
static void copy_(const mtrl_model *m, void *dst, const void *dev, const void *host, size_t bytes) {
    if (m->device != MTRL_DEVICE_CPU) {
        m->be->download(m->be, dst, dev, bytes);
        return;
    }
    size_t piece = (size_t)4 << 20, n = (bytes + piece - 1) / piece;
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        size_t at = i * piece;
        memcpy((char *)dst + at, (const char *)host + at, bytes - at < piece ? bytes - at : piece);
    }
}

mtrl_status mtrl_ckpt_async_start(mtrl_ckpt_async *a, const mtrl_model *m, const char *path, long step, int with_optimizer,
                                  const char *const *meta, int n_meta, mtrl_error *err) {
    if (a->started) return mtrl_error_set(err, MTRL_ERR_STATE, "checkpoint %s: the previous one was not collected", path);
    double t0 = mtrl_time_mono();
    size_t total = m->params.total, beta = sizeof(real) * (size_t)m->dims.L * (size_t)m->dims.E;
    // A model that has moments gets a buffer for them at once, whatever this checkpoint holds:
    // growing it later (the warm-up's last checkpoint has no moments, the RL ones do) meant a
    // second pinned allocation of 14 GB for `small`, ~8 s on the learner's path.
    int has_moments = m->device != MTRL_DEVICE_CPU ? m->d_adam_m != NULL : m->adam_m != NULL;
    size_t bytes = total * (with_optimizer || has_moments ? 3 : 1) + beta;
    if (buf_reserve_(a, bytes, m->device) != 0)
        return mtrl_error_set(err, MTRL_ERR_NOMEM, "checkpoint %s: cannot allocate a %.2f GB snapshot", path, bytes / 1e9);
    char *b = a->buf;
    MTRL_CHECKF(!m->weights_bf16, "checkpoint %s: a bf16-resident model has no fp32 parameter block to snapshot", path);
    copy_(m, b, m->d_params, m->params.base, total);
    if (with_optimizer) {
        copy_(m, b + total, m->d_adam_m, m->adam_m, total);
        copy_(m, b + 2 * total, m->d_adam_v, m->adam_v, total);
    }
    char *bb = b + total * (with_optimizer ? 3 : 1);
    memcpy(bb, m->qb_beta, beta); // β's master is the host copy (model.h)
    // The snapshot model: the live one's table and dims over the snapshot's blocks, on the CPU.
    // Only what mtrl_model_save reads is set; nothing of it is freed.
    mtrl_model *s = &a->snap;
    memset(s, 0, sizeof *s);
    s->dims = m->dims;
    s->params = m->params;
    s->params.base = b;
    s->params.owns = 0;
    s->adam_m = with_optimizer ? (real *)(b + total) : NULL;
    s->adam_v = with_optimizer ? (real *)(b + 2 * total) : NULL;
    s->qb_beta = (real *)bb;
    s->device = MTRL_DEVICE_CPU;
    s->step = m->step;
    s->version = m->version;
    a->with_optimizer = with_optimizer;
    meta_free_(a);
    a->meta = xcalloc((size_t)(2 * n_meta + 1), sizeof(char *));
    for (int i = 0; i < 2 * n_meta; i++) a->meta[i] = xstrdup(meta[i]);
    a->n_meta = n_meta;
    memset(&a->done, 0, sizeof a->done);
    snprintf(a->done.path, sizeof a->done.path, "%s", path);
    a->done.step = step;
    a->done.version = m->version;
    a->done.snapshot_s = mtrl_time_mono() - t0;
    atomic_store(&a->finished, 0);
    MTRL_CHECKF(pthread_create(&a->thread, NULL, write_, a) == 0, "cannot start the checkpoint writer thread");
    a->started = 1;
    return MTRL_OK;
}

int mtrl_ckpt_async_collect(mtrl_ckpt_async *a, int wait, mtrl_ckpt_done *done) {
    if (!a->started || (!wait && !atomic_load(&a->finished))) return 0;
    pthread_join(a->thread, NULL);
    a->started = 0;
    *done = a->done;
    return 1;
}

int mtrl_ckpt_async_busy(const mtrl_ckpt_async *a) { return a->started; }

void mtrl_ckpt_async_free(mtrl_ckpt_async *a) {
    if (!a) return;
    if (a->started) pthread_join(a->thread, NULL);
    meta_free_(a);
    buf_free_(a);
    free(a);
}
