// model_ckpt.c: checkpoints and published weights of the backbone (see model.h).
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bf16.h"
#include "common/check.h"
#include "common/checkpoint.h"
#include "model/backend.h"
#include "model/model.h"
#include "model/model_ws.h"

#if REAL_IS_F64
#define REAL_DT MTRL_DT_F64
#else
#define REAL_DT MTRL_DT_F32
#endif

// The entries of a save: every parameter, then β, then (optionally) both moments of each.
typedef struct save_list {
    mtrl_ckpt_entry *e;
    char (*names)[MTRL_TT_NAME_MAX + 16];
    int n;
} save_list;

static void list_build_(const mtrl_model *m, int with_optimizer, save_list *l) {
    int n = m->params.n * (with_optimizer ? 3 : 1) + 1;
    l->e = xcalloc((size_t)n, sizeof *l->e);
    l->names = xcalloc((size_t)n, sizeof *l->names);
    l->n = 0;
    for (int pass = 0; pass < (with_optimizer ? 3 : 1); pass++) {
        const char *prefix = pass == 0 ? "" : pass == 1 ? "adam_m." : "adam_v.";
        const char *base = pass == 0 ? (const char *)m->params.base : pass == 1 ? (const char *)m->adam_m : (const char *)m->adam_v;
        for (int i = 0; i < m->params.n; i++) {
            const mtrl_tensor *t = &m->params.items[i];
            mtrl_ckpt_entry *x = &l->e[l->n];
            snprintf(l->names[l->n], sizeof l->names[l->n], "%s%s", prefix, t->name);
            MTRL_CHECKF(strlen(l->names[l->n]) < MTRL_TT_NAME_MAX, "checkpoint name too long: %s", l->names[l->n]);
            x->name = l->names[l->n];
            x->dtype = t->dtype;
            x->ndim = t->ndim;
            memcpy(x->shape, t->shape, sizeof x->shape);
            x->data = base + t->offset;
            x->nbytes = t->nbytes;
            l->n++;
        }
        if (pass == 0) {
            mtrl_ckpt_entry *x = &l->e[l->n];
            snprintf(l->names[l->n], sizeof l->names[l->n], "qb_beta");
            x->name = l->names[l->n];
            x->dtype = REAL_DT;
            x->ndim = 2;
            x->shape[0] = m->dims.L;
            x->shape[1] = m->dims.E;
            x->data = m->qb_beta;
            x->nbytes = sizeof(real) * (size_t)m->dims.L * (size_t)m->dims.E;
            l->n++;
        }
    }
}

// A model on a device: the host blocks are a mirror; refresh the parts a save writes.
static void refresh_host_(const mtrl_model *m, int with_optimizer) {
    if (m->device == MTRL_DEVICE_CPU) return;
    mtrl_backend *be = m->be;
    size_t total = m->params.total;
    model_params_download((mtrl_model *)m); // the device copy is read, the mirror refreshed
    if (with_optimizer) {
        be->download(be, m->adam_m, m->d_adam_m, total);
        be->download(be, m->adam_v, m->d_adam_v, total);
    }
}

// Writes the list to path (atomically) or to a malloc'ed buffer, with the model's metadata and
// the caller's, and frees the list. data_at (buffer only, nullable): where each entry's bytes
// start, for entries the caller fills itself (data NULL: mtrl_ckpt_write_mem_at).
static mtrl_status list_write_(const mtrl_model *m, save_list *l, int with_optimizer, const char *const *meta,
                               int n_meta, const char *path, void **mem, size_t *mem_len, size_t *data_at,
                               mtrl_error *err) {
    char step[32], version[32];
    snprintf(step, sizeof step, "%ld", m->step);
    snprintf(version, sizeof version, "%" PRIu32, m->version);
    int nm = n_meta + 4;
    const char **kv = xcalloc((size_t)(2 * nm), sizeof(char *));
    kv[0] = "mtrl.format"; kv[1] = "1";
    kv[2] = "step"; kv[3] = step;
    kv[4] = "version"; kv[5] = version;
    kv[6] = "optimizer"; kv[7] = with_optimizer ? "adamw" : "none";
    for (int i = 0; i < 2 * n_meta; i++) kv[8 + i] = meta[i];
    mtrl_status st = path ? mtrl_ckpt_write_file(path, l->e, l->n, kv, nm, err)
                          : mtrl_ckpt_write_mem_at(mem, mem_len, l->e, l->n, kv, nm, data_at, err);
    free(kv);
    free(l->e);
    free(l->names);
    return st;
}

mtrl_status mtrl_model_save(const mtrl_model *m, const char *path, void **mem, size_t *mem_len, int with_optimizer,
                            const char *const *meta, int n_meta, mtrl_error *err) {
    if (with_optimizer && m->inference)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "an inference model has no optimizer state to save");
    refresh_host_(m, with_optimizer);
    save_list l;
    list_build_(m, with_optimizer, &l);
    return list_write_(m, &l, with_optimizer, meta, n_meta, path, mem, mem_len, NULL, err);
}

// The tensors published as bf16: every matrix of parameters (β stays as it is).
static int published_bf16_(const mtrl_ckpt_entry *x) {
    return x->ndim >= 2 && x->dtype == REAL_DT && strcmp(x->name, "qb_beta") != 0;
}

mtrl_status mtrl_model_save_bf16(const mtrl_model *m, void **mem, size_t *mem_len, mtrl_error *err) {
    refresh_host_(m, 0);
    save_list l;
    list_build_(m, 0, &l);
    // The matrices are rounded straight into the blob (no bf16 copy in between): their entries
    // go in without data and are filled where the writer put them.
    int n = l.n;
    const real **src = xcalloc((size_t)(n ? n : 1), sizeof(*src));
    size_t *at = xmalloc(sizeof(size_t) * (size_t)(n ? n : 1)), *count = xcalloc((size_t)(n ? n : 1), sizeof(size_t));
    for (int i = 0; i < n; i++) {
        mtrl_ckpt_entry *x = &l.e[i];
        if (!published_bf16_(x)) continue;
        src[i] = x->data;
        x->data = NULL;
        x->dtype = MTRL_DT_BF16;
        count[i] = x->nbytes / sizeof(real);
        x->nbytes = count[i] * sizeof(uint16_t);
    }
    const char *meta[] = {"weights", "bf16"};
    mtrl_status st = list_write_(m, &l, 0, meta, 1, NULL, mem, mem_len, at, err);
    for (int i = 0; st == MTRL_OK && i < n; i++) {
        if (!src[i]) continue;
        MTRL_CHECKF(at[i] % sizeof(uint16_t) == 0, "bf16 tensor %d at an odd offset", i);
        uint16_t *dst = (uint16_t *)((unsigned char *)*mem + at[i]);
        const real *s = src[i];
        size_t c = count[i];
        #pragma omp parallel for schedule(static)
        for (size_t k = 0; k < c; k++) dst[k] = mtrl_bf16_from_f32((float)s[k]);
    }
    free(src);
    free(at);
    free(count);
    return st;
}

// Reads tensor i of the list into its place: as stored, or widened from bf16 (published weights).
static mtrl_status read_entry_(mtrl_ckpt *c, const mtrl_ckpt_entry *x, mtrl_error *err) {
    int k = mtrl_ckpt_find(c, x->name);
    if (k >= 0 && c->t[k].dtype == MTRL_DT_BF16 && x->dtype != MTRL_DT_BF16) {
        size_t n = x->nbytes / sizeof(real);
        uint16_t *h = malloc(sizeof(uint16_t) * (n ? n : 1));
        if (!h) return mtrl_error_set(err, MTRL_ERR_NOMEM, "cannot allocate %zu bytes to widen %s", 2 * n, x->name);
        mtrl_status st = mtrl_ckpt_read(c, x->name, MTRL_DT_BF16, x->ndim, x->shape, h, err);
        real *dst = (real *)x->data;
        if (st == MTRL_OK) {
            #pragma omp parallel for schedule(static)
            for (size_t i = 0; i < n; i++) dst[i] = (real)mtrl_bf16_to_f32(h[i]);
        }
        free(h);
        return st;
    }
    return mtrl_ckpt_read(c, x->name, x->dtype, x->ndim, x->shape, (void *)x->data, err);
}

mtrl_status mtrl_model_load(mtrl_model *m, mtrl_ckpt *c, int with_optimizer, mtrl_error *err) {
    if (with_optimizer && m->inference)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "%s: an inference model cannot take optimizer state", c->source);
    save_list l;
    list_build_(m, with_optimizer, &l);
    mtrl_status st = MTRL_OK;
    // Check every tensor first, so a mismatch changes nothing.
    for (int i = 0; i < l.n && st == MTRL_OK; i++) {
        int k = mtrl_ckpt_find(c, l.e[i].name);
        if (k < 0) {
            st = mtrl_error_set(err, MTRL_ERR_MISMATCH, "%s: has no tensor %s (a checkpoint of another model?)", c->source,
                                l.e[i].name);
            break;
        }
        const mtrl_ckpt_tensor *t = &c->t[k];
        // bf16 matrices (mtrl_model_save_bf16) are widened on reading.
        int widen = t->dtype == MTRL_DT_BF16 && l.e[i].dtype != MTRL_DT_BF16 && !with_optimizer;
        int same = (t->dtype == l.e[i].dtype || widen) && t->ndim == l.e[i].ndim;
        for (int d = 0; same && d < t->ndim; d++) same = t->shape[d] == l.e[i].shape[d];
        if (!same) st = mtrl_ckpt_read(c, l.e[i].name, l.e[i].dtype, l.e[i].ndim, l.e[i].shape, NULL, err);
    }
    const char *s = mtrl_ckpt_meta(c, "step"), *v = mtrl_ckpt_meta(c, "version");
    if (st == MTRL_OK && with_optimizer && (!s || !v))
        st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: no step/version metadata: not an mtrl training checkpoint", c->source);
    for (int i = 0; i < l.n && st == MTRL_OK; i++) st = read_entry_(c, &l.e[i], err);
    if (st == MTRL_OK && m->device != MTRL_DEVICE_CPU) {
        mtrl_backend *be = m->be;
        size_t total = m->params.total;
        model_params_upload(m);
        be->upload(be, m->d_qb_beta, m->qb_beta, sizeof(real) * (size_t)m->dims.L * (size_t)m->dims.E);
        if (with_optimizer) {
            be->upload(be, m->d_adam_m, m->adam_m, total);
            be->upload(be, m->d_adam_v, m->adam_v, total);
        }
        be->sync(be);
    }
    if (st == MTRL_OK && with_optimizer) {
        m->step = strtol(s, NULL, 10);
        m->version = (uint32_t)strtoul(v, NULL, 10);
    } else if (st == MTRL_OK && v) {
        m->version = (uint32_t)strtoul(v, NULL, 10);
    }
    free(l.e);
    free(l.names);
    return st;
}
