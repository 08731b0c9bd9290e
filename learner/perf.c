// perf.c: the RL loop's time split, its metrics and their read-back (see perf.h).
#include "learner/perf.h"

#include <sqlite3.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"

// Every field of mtrl_perf with its metric name (after the prefix); totals_only fields are
// logged with the "rl." totals alone. One table for add, log and load, so they cannot disagree.
typedef struct field_ {
    const char *name;
    size_t off;
    int totals_only;
} field_;

#define F_(name, member, totals) {name, offsetof(mtrl_perf, member), totals}
static const field_ fields_[] = {
    F_("learner_wall_seconds", wall, 0),
    F_("learner_train_seconds", train, 0),
    F_("learner_wait_seconds", wait, 0),
    F_("learner_publish_seconds", publish, 0),
    F_("learner_checkpoint_seconds", checkpoint, 0),
    F_("actor_wall_seconds", actors.wall_s, 0),
    F_("actor_prefill_seconds", actors.prefill_s, 0),
    F_("actor_decode_seconds", actors.decode_s, 0),
    F_("actor_tools_seconds", actors.tools_s, 0),
    F_("actor_wait_seconds", actors.wait_s, 0),
    F_("actor_prefill_tokens", actors.prefill_tokens, 0),
    F_("actor_decode_tokens", actors.decode_tokens, 0),
    F_("actor_decode_steps", actors.decode_steps, 0),
    F_("episodes_committed", episodes, 0),
    F_("generated_tokens", generated_tokens, 0),
    F_("trained_tokens", trained_tokens, 0),
    F_("steps", steps, 1),
    F_("warmup_seconds", warmup, 1),
    F_("trained_episodes", trained_episodes, 1),
};
#undef F_
#define N_FIELDS_ ((int)(sizeof fields_ / sizeof fields_[0]))
_Static_assert(sizeof fields_ / sizeof fields_[0] * sizeof(double) == sizeof(mtrl_perf),
               "every field of mtrl_perf is a double listed in fields_");

static double *at_(mtrl_perf *p, int i) { return (double *)((char *)p + fields_[i].off); }
static double get_(const mtrl_perf *p, int i) { return *(const double *)((const char *)p + fields_[i].off); }

void mtrl_perf_add(mtrl_perf *to, const mtrl_perf *p) {
    for (int i = 0; i < N_FIELDS_; i++) *at_(to, i) += get_(p, i);
}

void mtrl_perf_actor_add(mtrl_perf *p, const mtrl_wire_actor_stats *s) {
    mtrl_wire_actor_stats *a = &p->actors;
    a->wall_s += s->wall_s;
    a->prefill_s += s->prefill_s;
    a->decode_s += s->decode_s;
    a->tools_s += s->tools_s;
    a->wait_s += s->wait_s;
    a->prefill_tokens += s->prefill_tokens;
    a->decode_tokens += s->decode_tokens;
    a->decode_steps += s->decode_steps;
}

double mtrl_perf_other(const mtrl_perf *p) { return p->wall - p->train - p->wait - p->publish - p->checkpoint; }

double mtrl_perf_actor_other(const mtrl_perf *p) {
    const mtrl_wire_actor_stats *a = &p->actors;
    return a->wall_s - a->prefill_s - a->decode_s - a->tools_s - a->wait_s;
}

double mtrl_perf_busy(const mtrl_perf *p) { return p->wall > 0 ? (p->train + p->publish + p->checkpoint) / p->wall : 0; }

static void put_(mtrl_store *s, int64_t run, int64_t step, const char *prefix, const char *name, double v) {
    char full[96];
    snprintf(full, sizeof full, "%s%s", prefix, name);
    mtrl_error err;
    if (mtrl_store_metric_log(s, run, step, full, v, 0, &err) != MTRL_OK) LOG_WARN("metric %s: %s", full, err.msg);
}

void mtrl_perf_log(mtrl_store *s, int64_t run, int64_t step, const char *prefix, const mtrl_perf *p) {
    int totals = !strcmp(prefix, "rl.");
    for (int i = 0; i < N_FIELDS_; i++)
        if (totals || !fields_[i].totals_only) put_(s, run, step, prefix, fields_[i].name, get_(p, i));
    put_(s, run, step, prefix, "learner_other_seconds", mtrl_perf_other(p));
    put_(s, run, step, prefix, "learner_busy", mtrl_perf_busy(p));
    put_(s, run, step, prefix, "actor_other_seconds", mtrl_perf_actor_other(p));
}

mtrl_status mtrl_perf_load(mtrl_store *s, int64_t run, mtrl_perf *p, int64_t *step, mtrl_error *err) {
    memset(p, 0, sizeof *p);
    *step = -1;
    for (int i = 0; i < N_FIELDS_; i++) {
        char full[96];
        snprintf(full, sizeof full, "rl.%s", fields_[i].name);
        int64_t *steps;
        double *values;
        size_t n;
        mtrl_status st = mtrl_store_metric_series(s, run, full, &steps, &values, &n, err);
        if (st != MTRL_OK) return st;
        if (n > 0) {
            *at_(p, i) = values[n - 1]; // the latest sitting's totals
            *step = steps[n - 1];
        }
        free(steps);
        free(values);
        if (n == 0)
            return mtrl_error_set(err, MTRL_ERR_NOTFOUND, "%s: run %lld has no metric %s (its RL loop did not end)",
                                  mtrl_store_path(s), (long long)run, full);
    }
    return MTRL_OK;
}

mtrl_status mtrl_perf_reward_ends(mtrl_store *s, int64_t run, double *first, double *last, long *n, mtrl_error *err) {
    *first = *last = 0;
    *n = 0;
    sqlite3 *db = mtrl_store_sqlite(s);
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db,
                           "SELECT reward FROM episodes WHERE run = ? AND status IN ('complete', 'truncated') "
                           "ORDER BY started, id",
                           -1, &st, NULL) != SQLITE_OK)
        return mtrl_error_set(err, MTRL_ERR_IO, "%s: episodes: %s", mtrl_store_path(s), sqlite3_errmsg(db));
    sqlite3_bind_int64(st, 1, run);
    double *r = NULL;
    size_t cap = 0;
    int rc;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        if ((size_t)*n == cap) {
            cap = cap ? 2 * cap : 1024;
            r = xrealloc(r, sizeof *r * cap);
        }
        r[(*n)++] = sqlite3_column_double(st, 0);
    }
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE) {
        free(r);
        return mtrl_error_set(err, MTRL_ERR_IO, "%s: episodes: %s", mtrl_store_path(s), sqlite3_errmsg(db));
    }
    long k = *n / 5 > 0 ? *n / 5 : 1;
    for (long i = 0; i < k && i < *n; i++) {
        *first += r[i] / (double)k;
        *last += r[*n - 1 - i] / (double)k;
    }
    free(r);
    return MTRL_OK;
}
