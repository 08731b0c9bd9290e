// dist_ep.c: parameter ownership with expert-parallel experts (see dist_ep.h).
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "learner/dist_ep.h"
#include "model/model.h"

mtrl_status mtrl_dist_ep_layout_make(mtrl_dist_ep_layout *l, const mtrl_tt *t, const mtrl_dist_experts *x, size_t align,
                                     mtrl_error *err) {
    memset(l, 0, sizeof *l);
    int R = x->ranks, n_exp = 0;
    for (int i = 0; i < t->n; i++) {
        const mtrl_tensor *a = &t->items[i];
        if (!mtrl_model_param_is_routed_expert(a->name)) continue;
        if (a->ndim < 1 || a->shape[0] != x->E || x->E == 0)
            return mtrl_error_set(err, MTRL_ERR_USAGE,
                                  "expert-parallel layout: routed-expert tensor %s has first dimension %lld, the "
                                  "assignment %d experts", a->name, a->ndim ? (long long)a->shape[0] : 0LL, x->E);
        n_exp++;
    }
    // The non-expert tensors on their own, in table order; sub[j] is tensor j's index in t.
    mtrl_tt d;
    mtrl_tt_init(&d);
    int *sub = xmalloc(sizeof(int) * (size_t)t->n);
    for (int i = 0; i < t->n; i++) {
        const mtrl_tensor *a = &t->items[i];
        if (mtrl_model_param_is_routed_expert(a->name)) {
            l->expert_total += a->nbytes;
            continue;
        }
        sub[mtrl_tt_add(&d, a->name, a->dtype, a->ndim, a->shape)] = i;
        l->dense_bytes += a->nbytes;
    }
    mtrl_tt_layout(&d);
    mtrl_status st = mtrl_dist_shards_make(&l->dense, &d, R, align, err);
    if (st != MTRL_OK) {
        mtrl_tt_free(&d);
        free(sub);
        return st;
    }
    l->dense_offset = xmalloc(sizeof(size_t) * (size_t)(t->n ? t->n : 1));
    for (int i = 0; i < t->n; i++) l->dense_offset[i] = SIZE_MAX;
    for (int j = 0; j < d.n; j++) l->dense_offset[sub[j]] = d.items[j].offset;
    mtrl_tt_free(&d);
    for (int j = 0; j < l->dense.n_piece; j++) l->dense.piece[j].tensor = sub[l->dense.piece[j].tensor];
    free(sub);
    l->ranks = R;
    l->experts = *x;
    l->piece = xmalloc(sizeof(mtrl_dist_piece) * (size_t)(R * n_exp + l->dense.n_piece));
    l->held = xmalloc(sizeof(mtrl_dist_piece) * (size_t)R * (size_t)t->n);
    for (int r = 0; r < R; r++) {
        mtrl_dist_ep_rank *h = &l->rank[r];
        h->first_piece = l->n_piece;
        h->first_held = l->n_held;
        for (int i = 0; i < t->n; i++) {
            const mtrl_tensor *a = &t->items[i];
            if (!mtrl_model_param_is_routed_expert(a->name)) {
                l->held[l->n_held++] = (mtrl_dist_piece){i, 0, a->numel};
                continue;
            }
            size_t per = a->numel / (size_t)x->E; // one expert's elements: a contiguous row block
            mtrl_dist_piece p = {i, per * (size_t)x->first[r], per * (size_t)x->first[r + 1]};
            if (p.begin == p.end) continue;
            l->piece[l->n_piece++] = p;
            l->held[l->n_held++] = p;
            h->expert_bytes += (p.end - p.begin) * mtrl_dtype_size(a->dtype);
        }
        h->n_expert_piece = l->n_piece - h->first_piece;
        const mtrl_dist_shard *s = &l->dense.rank[r];
        memcpy(&l->piece[l->n_piece], &l->dense.piece[s->first_piece], sizeof(mtrl_dist_piece) * (size_t)s->n_piece);
        l->n_piece += s->n_piece;
        h->n_piece = l->n_piece - h->first_piece;
        h->shard_bytes = s->used;
        h->n_held = l->n_held - h->first_held;
        h->held_bytes = l->dense_bytes + h->expert_bytes;
    }
    return MTRL_OK;
}

void mtrl_dist_ep_layout_free(mtrl_dist_ep_layout *l) {
    mtrl_dist_shards_free(&l->dense);
    free(l->dense_offset);
    free(l->piece);
    free(l->held);
    memset(l, 0, sizeof *l);
}

static double mib_(size_t b) { return (double)b / (double)((size_t)1 << 20); }

void mtrl_dist_ep_print(const mtrl_dist_ep_layout *l, FILE *f) {
    fprintf(f, "  expert-parallel ownership (experts by expert, the rest ZeRO over all ranks), MiB experts+shard:");
    for (int r = 0; r < l->ranks; r++)
        fprintf(f, " r%d %.1f+%.1f", r, mib_(l->rank[r].expert_bytes), mib_(l->rank[r].shard_bytes));
    fprintf(f, "\n  held for the forward (non-expert %.1f MiB + own experts), MiB:", mib_(l->dense_bytes));
    for (int r = 0; r < l->ranks; r++) fprintf(f, " r%d %.1f", r, mib_(l->rank[r].held_bytes));
    fputc('\n', f);
}
