// dist_plan.c: the partition of a learner step over ranks (see dist_plan.h).
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "learner/dist_plan.h"
#include "model/model.h"

static mtrl_status ranks_ok_(int ranks, const char *what, mtrl_error *err) {
    if (ranks < 1 || ranks > MTRL_DIST_RANKS_MAX)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "%s: %d ranks: expected 1..%d", what, ranks, MTRL_DIST_RANKS_MAX);
    return MTRL_OK;
}

// ---- token split --------------------------------------------------------------------------------

typedef struct len_idx { int len, i; } len_idx;

// Longest first; equal lengths in batch order, so the split does not depend on qsort's order.
static int by_len_desc_(const void *a, const void *b) {
    const len_idx *x = a, *y = b;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

mtrl_status mtrl_dist_split_make(mtrl_dist_split *s, int n, const int *len, int ranks, int segment, mtrl_error *err) {
    memset(s, 0, sizeof *s);
    mtrl_status st = ranks_ok_(ranks, "token split", err);
    if (st != MTRL_OK) return st;
    if (n < 0) return mtrl_error_set(err, MTRL_ERR_USAGE, "token split: %d episodes", n);
    for (int i = 0; i < n; i++)
        if (len[i] < 1) return mtrl_error_set(err, MTRL_ERR_USAGE, "token split: episode %d has %d tokens", i, len[i]);
    s->ranks = ranks;
    s->n = n;
    s->segment = segment;
    size_t cap = (size_t)(n ? n : 1);
    s->rank_of = xmalloc(sizeof(int) * cap);
    s->order = xmalloc(sizeof(int) * cap);
    len_idx *by_len = xmalloc(sizeof(len_idx) * cap);
    for (int i = 0; i < n; i++) by_len[i] = (len_idx){len[i], i};
    qsort(by_len, (size_t)n, sizeof(len_idx), by_len_desc_);
    for (int j = 0; j < n; j++) {
        int i = by_len[j].i, r = 0;
        for (int q = 1; q < ranks; q++)
            if (s->rank[q].tokens < s->rank[r].tokens) r = q;
        s->rank_of[i] = r;
        s->rank[r].tokens += len[i];
        s->rank[r].n_seq++;
        if (len[i] > s->rank[r].longest) s->rank[r].longest = len[i];
        s->total += len[i];
    }
    // Each rank's episodes in batch order: the packer lays consecutive sequences end to end.
    for (int r = 0; r < ranks; r++) s->first[r + 1] = s->first[r] + s->rank[r].n_seq;
    int at[MTRL_DIST_RANKS_MAX];
    memcpy(at, s->first, sizeof(int) * (size_t)ranks);
    for (int i = 0; i < n; i++) s->order[at[s->rank_of[i]]++] = i;
    int *lens = xmalloc(sizeof(int) * cap), *units = xmalloc(sizeof(int) * (cap + 1));
    for (int r = 0; r < ranks; r++) {
        int m = s->rank[r].n_seq;
        for (int j = 0; j < m; j++) lens[j] = len[s->order[s->first[r] + j]];
        s->rank[r].units = m ? mtrl_model_pack_units(m, lens, segment, units) : 0;
        if (s->rank[r].tokens > s->max_tokens) s->max_tokens = s->rank[r].tokens;
    }
    long longest = n ? by_len[0].len : 0, l_r = n > ranks ? by_len[ranks].len : 0;
    // total / ranks + (1 - 1/ranks) l_R, rounded up: the busiest rank's last episode started on
    // the least loaded rank, which held at most the mean of the other episodes.
    long lpt = (s->total - l_r + ranks - 1) / ranks + l_r;
    s->bound = longest > lpt ? longest : lpt;
    s->imbalance = s->total ? (double)s->max_tokens * ranks / (double)s->total - 1.0 : 0.0;
    free(by_len);
    free(lens);
    free(units);
    return MTRL_OK;
}

void mtrl_dist_split_free(mtrl_dist_split *s) {
    free(s->rank_of);
    free(s->order);
    memset(s, 0, sizeof *s);
}

// ---- experts ------------------------------------------------------------------------------------

mtrl_status mtrl_dist_experts_make(mtrl_dist_experts *x, int E, int ranks, mtrl_error *err) {
    memset(x, 0, sizeof *x);
    mtrl_status st = ranks_ok_(ranks, "expert assignment", err);
    if (st != MTRL_OK) return st;
    if (E < 0) return mtrl_error_set(err, MTRL_ERR_USAGE, "expert assignment: %d experts", E);
    if (E > 0 && E < ranks)
        return mtrl_error_set(err, MTRL_ERR_USAGE,
                              "expert assignment: %d experts over %d ranks leaves a rank with no expert; run expert "
                              "parallel over at most %d ranks",
                              E, ranks, E);
    x->E = E;
    x->ranks = ranks;
    for (int r = 0; r < ranks; r++) x->first[r + 1] = x->first[r] + E / ranks + (r < E % ranks);
    return MTRL_OK;
}

int mtrl_dist_expert_rank(const mtrl_dist_experts *x, int e) {
    MTRL_CHECKF(e >= 0 && e < x->E, "expert %d of %d", e, x->E);
    int r = 0;
    while (x->first[r + 1] <= e) r++;
    return r;
}

void mtrl_dist_a2a_send(const mtrl_dist_experts *x, const int64_t *rows, int64_t *count, int64_t *offset) {
    int64_t at = 0;
    for (int r = 0; r < x->ranks; r++) {
        int64_t c = 0;
        for (int e = x->first[r]; e < x->first[r + 1]; e++) c += rows[e];
        offset[r] = at;
        count[r] = c;
        at += c;
    }
}

void mtrl_dist_a2a_recv(const mtrl_dist_experts *x, int me, const int64_t *rows_all, int64_t *count, int64_t *offset,
                        int64_t *expert_rows) {
    MTRL_CHECKF(me >= 0 && me < x->ranks, "rank %d of %d", me, x->ranks);
    int e0 = x->first[me], e1 = x->first[me + 1];
    if (expert_rows)
        for (int e = e0; e < e1; e++) expert_rows[e - e0] = 0;
    int64_t at = 0;
    for (int r = 0; r < x->ranks; r++) {
        const int64_t *rows = rows_all + (size_t)r * (size_t)x->E;
        int64_t c = 0;
        for (int e = e0; e < e1; e++) {
            c += rows[e];
            if (expert_rows) expert_rows[e - e0] += rows[e];
        }
        offset[r] = at;
        count[r] = c;
        at += c;
    }
}

void mtrl_dist_a2a_expert_order(const mtrl_dist_experts *x, int me, const int64_t *rows_all, int64_t *pos) {
    MTRL_CHECKF(me >= 0 && me < x->ranks, "rank %d of %d", me, x->ranks);
    int e0 = x->first[me], e1 = x->first[me + 1];
    // start[e][r]: where source r's rows of expert e begin in expert-major order.
    int64_t at = 0, i = 0;
    int64_t *start = xmalloc(sizeof(int64_t) * (size_t)((e1 - e0) * x->ranks + 1));
    for (int e = e0; e < e1; e++)
        for (int r = 0; r < x->ranks; r++) {
            start[(size_t)(e - e0) * (size_t)x->ranks + (size_t)r] = at;
            at += rows_all[(size_t)r * (size_t)x->E + (size_t)e];
        }
    for (int r = 0; r < x->ranks; r++)
        for (int e = e0; e < e1; e++) {
            int64_t s0 = start[(size_t)(e - e0) * (size_t)x->ranks + (size_t)r];
            for (int64_t k = 0; k < rows_all[(size_t)r * (size_t)x->E + (size_t)e]; k++) pos[i++] = s0 + k;
        }
    free(start);
}

// ---- shards -------------------------------------------------------------------------------------

mtrl_status mtrl_dist_shards_make(mtrl_dist_shards *s, const mtrl_tt *t, int ranks, size_t align, mtrl_error *err) {
    memset(s, 0, sizeof *s);
    mtrl_status st = ranks_ok_(ranks, "shard layout", err);
    if (st != MTRL_OK) return st;
    if (t->n == 0 || t->total == 0) return mtrl_error_set(err, MTRL_ERR_USAGE, "shard layout: an empty parameter table");
    if (align == 0) return mtrl_error_set(err, MTRL_ERR_USAGE, "shard layout: alignment 0");
    for (int i = 0; i < t->n; i++) {
        size_t es = mtrl_dtype_size(t->items[i].dtype);
        if (align % es || t->items[i].offset % es)
            return mtrl_error_set(err, MTRL_ERR_USAGE, "shard layout: alignment %zu cuts the %zu-byte elements of %s", align,
                                  es, t->items[i].name);
    }
    s->ranks = ranks;
    s->align = align;
    s->total = t->total;
    s->shard_bytes = (t->total + (size_t)ranks - 1) / (size_t)ranks;
    s->shard_bytes = (s->shard_bytes + align - 1) / align * align;
    s->padded = s->shard_bytes * (size_t)ranks;
    // A tensor is cut at most ranks - 1 times.
    s->piece = xmalloc(sizeof(mtrl_dist_piece) * (size_t)(t->n + ranks));
    for (int r = 0; r < ranks; r++) {
        mtrl_dist_shard *h = &s->rank[r];
        h->begin = (size_t)r * s->shard_bytes;
        h->end = h->begin + s->shard_bytes;
        h->first_piece = s->n_piece;
        for (int i = 0; i < t->n; i++) {
            const mtrl_tensor *x = &t->items[i];
            size_t a = x->offset > h->begin ? x->offset : h->begin;
            size_t b = x->offset + x->nbytes < h->end ? x->offset + x->nbytes : h->end;
            if (a >= b) continue;
            size_t es = mtrl_dtype_size(x->dtype);
            mtrl_dist_piece *p = &s->piece[s->n_piece++];
            p->tensor = i;
            p->begin = (a - x->offset) / es;
            p->end = (b - x->offset) / es;
            h->used += b - a;
        }
        h->n_piece = s->n_piece - h->first_piece;
    }
    return MTRL_OK;
}

void mtrl_dist_shards_free(mtrl_dist_shards *s) {
    free(s->piece);
    memset(s, 0, sizeof *s);
}

// ---- printing -----------------------------------------------------------------------------------

static double mib_(size_t b) { return (double)b / (double)((size_t)1 << 20); }

void mtrl_dist_plan_print(const mtrl_dist_split *s, const mtrl_dist_experts *x, const mtrl_dist_shards *sh,
                          const int *gpus, FILE *f) {
    fprintf(f, "per-rank plan (%d ranks):\n", s->ranks);
    fprintf(f, "  %-4s %-4s %8s %12s %6s %8s %-11s %14s %14s\n", "rank", "gpu", "episodes", "tokens", "units", "longest",
            "experts", "moments MiB", "shard MiB");
    for (int r = 0; r < s->ranks; r++) {
        const mtrl_dist_rank_batch *b = &s->rank[r];
        char ex[32] = "-";
        if (x && x->E > 0) snprintf(ex, sizeof ex, "%d..%d", x->first[r], x->first[r + 1] - 1);
        char gpu[16] = "-";
        if (gpus) snprintf(gpu, sizeof gpu, "%d", gpus[r]);
        fprintf(f, "  %-4d %-4s %8d %12ld %6d %8d %-11s", r, gpu, b->n_seq, b->tokens, b->units, b->longest, ex);
        // ZeRO-1: the two moments of the shard; the parameter or gradient shard is one block's.
        if (sh) fprintf(f, " %14.1f %14.1f", mib_(2 * sh->shard_bytes), mib_(sh->shard_bytes));
        fputc('\n', f);
    }
    fprintf(f, "  tokens %ld, busiest rank %ld (bound %ld), imbalance %.1f%%\n", s->total, s->max_tokens, s->bound,
            100.0 * s->imbalance);
    if (x && x->E > 0)
        fprintf(f, "  experts: %d per MoE layer over %d ranks, %d or %d a rank\n", x->E, x->ranks, x->E / x->ranks,
                (x->E + x->ranks - 1) / x->ranks);
    if (sh)
        fprintf(f, "  shards: parameter block %.1f MiB (%zu bytes), %zu bytes a rank (aligned to %zu), %zu bytes of "
                "padding past the block; the moment shard is two of these a rank (ZeRO-1), the reduced gradient "
                "shard one (ZeRO-2); the parameters stay replicated (%.1f MiB a rank)\n",
                mib_(sh->total), sh->total, sh->shard_bytes, sh->align, sh->padded - sh->total, mib_(sh->total));
}
