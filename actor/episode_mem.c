// episode_mem.c: the memory account and write-back pool of episodes in flight (episode_mem.h).
#include "actor/episode_mem.h"

#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "model/backend.h"

#define MIB (1024.0 * 1024.0)

void mtrl_epmem_sizes_of(const mtrl_model *m, mtrl_epmem_sizes *o) {
    const mtrl_model_dims *d = &m->dims;
    memset(o, 0, sizeof *o);
    for (int l = 0; l < d->L; l++) {
        o->n_kda += d->mixer[l] == 'K';
        o->n_mla += d->mixer[l] == 'M';
    }
    o->heads = d->H;
    o->kda_state_per_head = sizeof(real) * (size_t)d->D * (size_t)d->D;
    o->kda_state = o->kda_state_per_head * (size_t)d->H * (size_t)o->n_kda;
    o->conv = sizeof(real) * 3 * (size_t)(d->W - 1) * (size_t)d->H * (size_t)d->D * (size_t)o->n_kda;
    o->latent_per_token = m->be->latent_size * (size_t)(d->dc + d->dr) * (size_t)o->n_mla;
}

// Host reals of a parked state at pos positions (mtrl_decode_state_download's arrays).
static void host_sizes_(const mtrl_epmem *a, int pos, size_t *nS, size_t *nC, size_t *nL) {
    const mtrl_model_dims *d = &a->m->dims;
    mtrl_epmem_sizes z;
    mtrl_epmem_sizes_of(a->m, &z);
    *nS = (size_t)z.n_kda * (size_t)d->H * (size_t)d->D * (size_t)d->D;
    *nC = (size_t)z.n_kda * 3 * (size_t)(d->W - 1) * (size_t)d->H * (size_t)d->D;
    *nL = (size_t)z.n_mla * (size_t)pos * (size_t)(d->dc + d->dr);
}

mtrl_status mtrl_epmem_init(mtrl_epmem *a, mtrl_model *m, mtrl_decode_state **states, int n, int max_tokens,
                            size_t device_budget, size_t host_budget, int min_cap, mtrl_error *err) {
    memset(a, 0, sizeof *a);
    size_t one = mtrl_decode_state_bytes(m, min_cap);
    if (one > device_budget)
        return mtrl_error_set(err, MTRL_ERR_USAGE,
                              "actor: [actor] device_budget_mb = %.0f cannot hold one decode state of %d tokens (%.1f MiB); "
                              "raise it", (double)device_budget / MIB, min_cap, (double)one / MIB);
    a->m = m;
    a->states = states;
    a->n = n;
    a->max_tokens = max_tokens;
    a->device_budget = device_budget;
    a->host_budget = host_budget;
    a->slot = xcalloc((size_t)n, sizeof *a->slot);
    return MTRL_OK;
}

static void host_free_(mtrl_epmem_slot *s) {
    free(s->hS);
    free(s->hC);
    free(s->hL);
    s->hS = s->hC = s->hL = NULL;
}

void mtrl_epmem_release(mtrl_epmem *a, int i) {
    mtrl_epmem_slot *s = &a->slot[i];
    if (s->where == MTRL_EPMEM_DEVICE) mtrl_decode_state_free(a->states[i]);
    host_free_(s);
    a->device_used -= s->device_bytes;
    a->host_used -= s->host_bytes;
    memset(s, 0, sizeof *s);
}

void mtrl_epmem_free(mtrl_epmem *a) {
    if (!a->slot) return;
    for (int i = 0; i < a->n; i++) mtrl_epmem_release(a, i);
    free(a->slot);
    memset(a, 0, sizeof *a);
}

static void charge_(mtrl_epmem *a, int i, size_t dev) {
    a->slot[i].device_bytes = dev;
    a->device_used += dev;
    if (a->device_used > a->device_peak) a->device_peak = a->device_used;
}

mtrl_status mtrl_epmem_park(mtrl_epmem *a, int i, mtrl_error *err) {
    mtrl_epmem_slot *s = &a->slot[i];
    MTRL_CHECKF(s->where == MTRL_EPMEM_DEVICE, "episode memory: park of slot %d, which is not on the device", i);
    mtrl_decode_state *st = a->states[i];
    size_t nS, nC, nL;
    host_sizes_(a, st->pos, &nS, &nC, &nL);
    size_t hb = sizeof(real) * (nS + nC + nL);
    if (a->host_used + hb > a->host_budget)
        return mtrl_error_set(err, MTRL_ERR_NOMEM, "host budget of %.0f MiB full (%.1f MiB parked)",
                              (double)a->host_budget / MIB, (double)a->host_used / MIB);
    s->hS = xmalloc(sizeof(real) * (nS + 1));
    s->hC = xmalloc(sizeof(real) * (nC + 1));
    s->hL = xmalloc(sizeof(real) * (nL + 1));
    mtrl_decode_state_download(a->m, st, s->hS, s->hC, s->hL);
    s->pos = st->pos;
    s->cap = st->cap;
    mtrl_decode_state_free(st);
    a->device_used -= s->device_bytes;
    s->device_bytes = 0;
    s->host_bytes = hb;
    a->host_used += hb;
    if (a->host_used > a->host_peak) a->host_peak = a->host_used;
    s->where = MTRL_EPMEM_HOST;
    a->parks++;
    return MTRL_OK;
}

// Parks idle slots (not `keep`), least recently used first, until `need` more device bytes fit.
// Returns 1 when they fit.
static int make_room_(mtrl_epmem *a, size_t need, int keep, const uint8_t *idle) {
    while (a->device_used + need > a->device_budget) {
        int best = -1;
        for (int j = 0; idle && j < a->n; j++)
            if (j != keep && idle[j] && a->slot[j].where == MTRL_EPMEM_DEVICE &&
                (best < 0 || a->slot[j].last_use < a->slot[best].last_use))
                best = j;
        if (best < 0) return 0;
        mtrl_error e;
        if (mtrl_epmem_park(a, best, &e) != MTRL_OK) return 0;
    }
    return 1;
}

static mtrl_status full_(mtrl_epmem *a, mtrl_error *err, const char *what, size_t need) {
    int dev = 0, host = 0;
    for (int j = 0; j < a->n; j++) {
        dev += a->slot[j].where == MTRL_EPMEM_DEVICE;
        host += a->slot[j].where == MTRL_EPMEM_HOST;
    }
    return mtrl_error_set(err, MTRL_ERR_NOMEM,
                          "the actor's device budget of %.0f MiB is full: %s needs %.1f MiB, %.1f MiB used by %d "
                          "episodes on the device, %d parked in host memory",
                          (double)a->device_budget / MIB, what, (double)need / MIB, (double)a->device_used / MIB, dev, host);
}

mtrl_status mtrl_epmem_admit(mtrl_epmem *a, int i, int cap, const uint8_t *idle, mtrl_error *err) {
    mtrl_epmem_slot *s = &a->slot[i];
    MTRL_CHECKF(s->where == MTRL_EPMEM_NONE, "episode memory: admit into slot %d, which holds an episode", i);
    if (cap > a->max_tokens) cap = a->max_tokens;
    size_t need = mtrl_decode_state_bytes(a->m, cap);
    if (!make_room_(a, need, i, idle)) {
        a->refusals++;
        return full_(a, err, "a new episode", need);
    }
    mtrl_decode_state_init(a->states[i], a->m, cap);
    charge_(a, i, need);
    s->where = MTRL_EPMEM_DEVICE;
    s->cap = cap;
    s->last_use = ++a->clock;
    return MTRL_OK;
}

// Replaces slot i's device state by one of capacity cap holding the same positions.
static void regrow_(mtrl_epmem *a, int i, int cap, size_t bytes) {
    mtrl_decode_state *st = a->states[i], grown;
    mtrl_decode_state_init(&grown, a->m, cap);
    mtrl_decode_state_copy(&grown, st, a->m);
    mtrl_decode_state_free(st);
    *st = grown;
    a->device_used -= a->slot[i].device_bytes;
    charge_(a, i, bytes);
    a->slot[i].cap = cap;
    a->grows++;
}

mtrl_status mtrl_epmem_reserve(mtrl_epmem *a, int i, int need, const uint8_t *idle, mtrl_error *err) {
    mtrl_epmem_slot *s = &a->slot[i];
    MTRL_CHECKF(s->where == MTRL_EPMEM_DEVICE, "episode memory: reserve in slot %d, which is not on the device", i);
    s->last_use = ++a->clock;
    mtrl_decode_state *st = a->states[i];
    if (need <= st->cap) return MTRL_OK;
    if (need > a->max_tokens)
        return mtrl_error_set(err, MTRL_ERR_LIMIT, "%d positions are over [actor] max_tokens = %d", need, a->max_tokens);
    // Doubling keeps the copies to O(log length) per episode; near the budget, just what is needed.
    int want = st->cap * 2 > need ? st->cap * 2 : need;
    if (want > a->max_tokens) want = a->max_tokens;
    size_t bw = mtrl_decode_state_bytes(a->m, want), bn = mtrl_decode_state_bytes(a->m, need);
    // The grown state is allocated before the old one is freed: both count until the copy.
    if (a->device_used + bw <= a->device_budget) {
        regrow_(a, i, want, bw);
        return MTRL_OK;
    }
    if (make_room_(a, bn, i, idle)) {
        regrow_(a, i, need, bn);
        return MTRL_OK;
    }
    return full_(a, err, "growing an episode's decode state", bn);
}

mtrl_status mtrl_epmem_unpark(mtrl_epmem *a, int i, int need_pos, const uint8_t *idle, mtrl_error *err) {
    mtrl_epmem_slot *s = &a->slot[i];
    if (s->where == MTRL_EPMEM_DEVICE) return MTRL_OK;
    MTRL_CHECKF(s->where == MTRL_EPMEM_HOST, "episode memory: unpark of slot %d, which holds no episode", i);
    // Back at the capacity it is about to need: one allocation, no growth copy after it.
    int cap = need_pos > s->cap ? need_pos : s->cap;
    if (cap > a->max_tokens) cap = a->max_tokens;
    size_t need = mtrl_decode_state_bytes(a->m, cap);
    if (!make_room_(a, need, i, idle)) return full_(a, err, "a parked episode's return", need);
    s->cap = cap;
    mtrl_decode_state *st = a->states[i];
    mtrl_decode_state_init(st, a->m, s->cap);
    mtrl_decode_state_upload(a->m, st, s->pos, s->hS, s->hC, s->hL);
    host_free_(s);
    a->host_used -= s->host_bytes;
    s->host_bytes = 0;
    charge_(a, i, need);
    s->where = MTRL_EPMEM_DEVICE;
    s->last_use = ++a->clock;
    a->unparks++;
    return MTRL_OK;
}

int mtrl_epmem_pos(const mtrl_epmem *a, int i) {
    return a->slot[i].where == MTRL_EPMEM_HOST ? a->slot[i].pos : a->slot[i].where == MTRL_EPMEM_DEVICE ? a->states[i]->pos : 0;
}

int mtrl_epmem_others_on_device(const mtrl_epmem *a, int i) {
    int k = 0;
    for (int j = 0; j < a->n; j++) k += j != i && a->slot[j].where == MTRL_EPMEM_DEVICE;
    return k;
}

// Device bytes slot i needs at the peak of getting need positions: a parked state comes back at
// that capacity; a resident one that must grow holds its old state and the new one at once.
static size_t peak_need_(const mtrl_epmem *a, int i, int need) {
    const mtrl_epmem_slot *s = &a->slot[i];
    if (need > a->max_tokens) need = a->max_tokens;
    int cap = s->cap > need ? s->cap : need;
    size_t b = mtrl_decode_state_bytes(a->m, cap);
    if (s->where == MTRL_EPMEM_DEVICE && s->cap < need) b += s->device_bytes;
    return b;
}

int mtrl_epmem_fits(const mtrl_epmem *a, int i, int need, const uint8_t *idle) {
    size_t busy = 0;
    for (int j = 0; j < a->n; j++)
        if (j != i && a->slot[j].where == MTRL_EPMEM_DEVICE && !(idle && idle[j])) busy += a->slot[j].device_bytes;
    return busy + peak_need_(a, i, need) <= a->device_budget;
}

int mtrl_epmem_fits_alone(const mtrl_epmem *a, int need) {
    if (need > a->max_tokens) need = a->max_tokens;
    return mtrl_decode_state_bytes(a->m, need) <= a->device_budget;
}
