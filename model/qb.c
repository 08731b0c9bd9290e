// qb.c: Quantile Balancing's modes, statistics and update (qb.h).
#include "model/qb.h"

#include <string.h>

#include "common/check.h"
#include "model/backend.h"
#include "model/model.h"

void mtrl_qb_set_mode(mtrl_model *m, int mode) {
    MTRL_CHECKF(mode == MTRL_QB_TRAIN || mode == MTRL_QB_DECODE || mode == MTRL_QB_FROZEN, "QB mode %d", mode);
    m->qb_mode = mode;
}

int mtrl_qb_mode(const mtrl_model *m) { return m->qb_mode; }

int mtrl_qb_observe_level(const mtrl_model *m, int decode) {
    if (decode) return m->qb_mode == MTRL_QB_DECODE ? 2 : 0;
    return m->qb_mode == MTRL_QB_TRAIN ? 2 : 1;
}

int mtrl_qb_export(mtrl_model *m, double *sums, uint32_t *batches) {
    const mtrl_model_dims *d = &m->dims;
    size_t LE = (size_t)d->L * (size_t)d->E;
    int any = 0;
    for (int l = 0; l < d->L; l++) {
        batches[l] = (uint32_t)m->qb_count[l];
        any |= m->qb_count[l] > 0;
    }
    memcpy(sums, m->qb_sum, sizeof *sums * LE);
    memset(m->qb_sum, 0, sizeof *m->qb_sum * LE);
    memset(m->qb_count, 0, sizeof *m->qb_count * (size_t)d->L);
    return any;
}

void mtrl_qb_merge(mtrl_model *m, int layer, const double *beta) {
    const mtrl_model_dims *d = &m->dims;
    MTRL_CHECKF(layer >= d->first_dense && layer < d->L, "QB merge into layer %d, not a MoE layer", layer);
    for (int e = 0; e < d->E; e++) m->qb_sum[(size_t)layer * d->E + e] += beta[e];
    m->qb_count[layer]++;
}

int mtrl_qb_apply(mtrl_model *m) {
    const mtrl_model_dims *d = &m->dims;
    int updated = 0;
    for (int l = d->first_dense; l < d->L; l++) {
        double *sum = m->qb_sum + (size_t)l * d->E;
        if (m->qb_mode == MTRL_QB_TRAIN && m->qb_count[l] > 0) {
            double mean = 0;
            for (int e = 0; e < d->E; e++) mean += sum[e] / m->qb_count[l];
            mean /= d->E;
            for (int e = 0; e < d->E; e++) m->qb_beta[(size_t)l * d->E + e] = (real)(sum[e] / m->qb_count[l] - mean);
            updated++;
        }
        m->qb_count[l] = 0;
        for (int e = 0; e < d->E; e++) {
            sum[e] = 0;
            m->load[(size_t)l * d->E + e] = 0;
        }
    }
    if (updated && m->device != MTRL_DEVICE_CPU) {
        m->be->upload(m->be, m->d_qb_beta, m->qb_beta, sizeof(real) * (size_t)d->L * (size_t)d->E);
        m->be->sync(m->be);
    }
    return updated;
}
