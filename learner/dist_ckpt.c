// dist_ckpt.c: sharded checkpoints, one file per rank plus an index (see dist_ckpt.h).
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/hash.h"
#include "learner/dist_ckpt.h"

static const char *const prefix_[3] = {"", "adam_m.", "adam_v."};

void mtrl_dist_ckpt_rank_path(char *out, size_t cap, const char *index_path, int rank, int ranks) {
    snprintf(out, cap, "%s.rank%dof%d", index_path, rank, ranks);
}

// The SHA-256 of what fixes the flat block: every tensor's name, dtype, shape and offset.
static void layout_digest_(const mtrl_tt *t, char hex[65]) {
    size_t cap = 256 * (size_t)t->n + 64, n = 0;
    char *s = xmalloc(cap);
    for (int i = 0; i < t->n; i++) {
        const mtrl_tensor *x = &t->items[i];
        n += (size_t)snprintf(s + n, cap - n, "%s %s %zu [", x->name, mtrl_dtype_name(x->dtype), x->offset);
        for (int d = 0; d < x->ndim; d++) n += (size_t)snprintf(s + n, cap - n, "%" PRId64 ",", x->shape[d]);
        n += (size_t)snprintf(s + n, cap - n, "]\n");
        MTRL_CHECKF(n < cap, "layout text of %s overflows", x->name);
    }
    n += (size_t)snprintf(s + n, cap - n, "total %zu\n", t->total);
    MTRL_CHECK(n < cap && mtrl_sha256_hex(s, n, hex) == 0);
    free(s);
}

// The entry name of block `blk`'s piece p: "<prefix><tensor>@<first element>".
static mtrl_status piece_name_(char *out, const mtrl_tt *t, const mtrl_dist_piece *p, int blk, mtrl_error *err) {
    int n = snprintf(out, MTRL_TT_NAME_MAX, "%s%s@%zu", prefix_[blk], t->items[p->tensor].name, p->begin);
    if (n < 0 || n >= MTRL_TT_NAME_MAX)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "sharded checkpoint: the name of a piece of %s is too long",
                              t->items[p->tensor].name);
    return MTRL_OK;
}

static size_t piece_off_(const mtrl_tt *t, const mtrl_dist_piece *p) {
    return t->items[p->tensor].offset + p->begin * mtrl_dtype_size(t->items[p->tensor].dtype);
}

// Writes rank `rank` of `ranks`'s file: pieces piece[0 .. n-1] of the three blocks, each at
// blk[b] + (its byte offset in the block - shift).
static mtrl_status write_pieces_(const char *index_path, const mtrl_tt *t, int rank, int ranks,
                                 const mtrl_dist_piece *piece, int n_piece, const void *const *blk, size_t shift,
                                 mtrl_error *err) {
    int n = 3 * n_piece;
    mtrl_ckpt_entry *e = xcalloc((size_t)(n ? n : 1), sizeof *e);
    char (*names)[MTRL_TT_NAME_MAX] = xcalloc((size_t)(n ? n : 1), sizeof *names);
    mtrl_status st = MTRL_OK;
    for (int b = 0, k = 0; b < 3 && st == MTRL_OK; b++)
        for (int j = 0; j < n_piece && st == MTRL_OK; j++, k++) {
            const mtrl_dist_piece *p = &piece[j];
            const mtrl_tensor *x = &t->items[p->tensor];
            st = piece_name_(names[k], t, p, b, err);
            e[k].name = names[k];
            e[k].dtype = x->dtype;
            e[k].ndim = 1;
            e[k].shape[0] = (int64_t)(p->end - p->begin);
            e[k].nbytes = (p->end - p->begin) * mtrl_dtype_size(x->dtype);
            e[k].data = (const char *)blk[b] + (piece_off_(t, p) - shift);
        }
    char layout[65], r[16], rs[16], path[1100];
    layout_digest_(t, layout);
    snprintf(r, sizeof r, "%d", rank);
    snprintf(rs, sizeof rs, "%d", ranks);
    const char *meta[] = {"mtrl.shard", r, "shard.ranks", rs, "shard.layout", layout};
    mtrl_dist_ckpt_rank_path(path, sizeof path, index_path, rank, ranks);
    if (st == MTRL_OK) st = mtrl_ckpt_write_file(path, e, n, meta, 3, err);
    free(e);
    free(names);
    return st;
}

mtrl_status mtrl_dist_ckpt_write_rank(const char *index_path, const mtrl_dist_shards *sh, const mtrl_tt *t, int rank,
                                      const void *params, const void *adam_m, const void *adam_v, mtrl_error *err) {
    MTRL_CHECKF(rank >= 0 && rank < sh->ranks && sh->total == t->total, "rank %d of a layout of %d", rank, sh->ranks);
    const mtrl_dist_shard *h = &sh->rank[rank];
    const void *blk[3] = {params, adam_m, adam_v};
    return write_pieces_(index_path, t, rank, sh->ranks, sh->piece + h->first_piece, h->n_piece, blk, h->begin, err);
}

mtrl_status mtrl_dist_ckpt_write_rank_ep(const char *index_path, const mtrl_dist_ep_layout *l, const mtrl_tt *t,
                                         int rank, const void *params, const void *adam_m, const void *adam_v,
                                         mtrl_error *err) {
    MTRL_CHECKF(rank >= 0 && rank < l->ranks, "rank %d of a layout of %d", rank, l->ranks);
    const mtrl_dist_ep_rank *h = &l->rank[rank];
    const void *blk[3] = {params, adam_m, adam_v};
    return write_pieces_(index_path, t, rank, l->ranks, l->piece + h->first_piece, h->n_piece, blk, 0, err);
}

// The index of a checkpoint of `ranks` rank files: experts = 0 the ZeRO layout, E > 0 the
// expert-parallel one with E experts (shard.kind, shard.experts).
static mtrl_status write_index_(const char *index_path, int ranks, size_t align, const mtrl_tt *t, int experts,
                                const mtrl_ckpt_entry *extra, int n_extra, const char *const *meta, int n_meta,
                                mtrl_error *err) {
    int nm = n_meta + 5 + 2 * ranks + (experts ? 2 : 0);
    const char **kv = xcalloc((size_t)(2 * nm), sizeof(char *));
    // val: the three numbers, then per rank its two keys, its file's name and its digest.
    char (*val)[1100] = xcalloc((size_t)(4 + 4 * ranks), sizeof *val);
    char layout[65];
    layout_digest_(t, layout);
    snprintf(val[0], sizeof val[0], "%d", ranks);
    snprintf(val[1], sizeof val[1], "%zu", align);
    snprintf(val[2], sizeof val[2], "%zu", t->total);
    int k = 0;
    kv[k++] = "mtrl.sharded"; kv[k++] = "1";
    kv[k++] = "shard.ranks"; kv[k++] = val[0];
    kv[k++] = "shard.align"; kv[k++] = val[1];
    kv[k++] = "shard.total"; kv[k++] = val[2];
    kv[k++] = "shard.layout"; kv[k++] = layout;
    if (experts) {
        snprintf(val[3 + 4 * ranks], sizeof val[0], "%d", experts);
        kv[k++] = "shard.kind"; kv[k++] = "expert_parallel";
        kv[k++] = "shard.experts"; kv[k++] = val[3 + 4 * ranks];
    }
    mtrl_status st = MTRL_OK;
    for (int r = 0; r < ranks && st == MTRL_OK; r++) {
        char *key_file = val[3 + 4 * r], *file = val[4 + 4 * r], *key_sha = val[5 + 4 * r], *dig = val[6 + 4 * r];
        char path[1100];
        mtrl_dist_ckpt_rank_path(path, sizeof path, index_path, r, ranks);
        const char *slash = strrchr(path, '/');
        snprintf(file, sizeof val[0], "%s", slash ? slash + 1 : path);
        if (mtrl_sha256_file_hex(path, dig) != 0) {
            st = mtrl_error_set(err, MTRL_ERR_IO, "sharded checkpoint %s: cannot read rank %d's file %s", index_path, r, path);
            break;
        }
        snprintf(key_file, sizeof val[0], "shard.%d.file", r);
        snprintf(key_sha, sizeof val[0], "shard.%d.sha256", r);
        kv[k++] = key_file; kv[k++] = file;
        kv[k++] = key_sha; kv[k++] = dig;
    }
    for (int i = 0; i < 2 * n_meta; i++) kv[k++] = meta[i];
    if (st == MTRL_OK) st = mtrl_ckpt_write_file(index_path, extra, n_extra, kv, nm, err);
    free(kv);
    free(val);
    return st;
}

mtrl_status mtrl_dist_ckpt_write_index(const char *index_path, const mtrl_dist_shards *sh, const mtrl_tt *t,
                                       const mtrl_ckpt_entry *extra, int n_extra, const char *const *meta, int n_meta,
                                       mtrl_error *err) {
    MTRL_CHECK(sh->total == t->total);
    return write_index_(index_path, sh->ranks, sh->align, t, 0, extra, n_extra, meta, n_meta, err);
}

mtrl_status mtrl_dist_ckpt_write_index_ep(const char *index_path, const mtrl_dist_ep_layout *l, const mtrl_tt *t,
                                          const mtrl_ckpt_entry *extra, int n_extra, const char *const *meta,
                                          int n_meta, mtrl_error *err) {
    return write_index_(index_path, l->ranks, l->dense.align, t, l->experts.E, extra, n_extra, meta, n_meta, err);
}

static long meta_long_(const mtrl_ckpt *c, const char *key) {
    const char *s = mtrl_ckpt_meta(c, key);
    char *end;
    long v = s ? strtol(s, &end, 10) : -1;
    return s && *s && !*end ? v : -1;
}

mtrl_status mtrl_dist_ckpt_open(mtrl_dist_ckpt *c, const char *index_path, const mtrl_tt *t, mtrl_error *err) {
    memset(c, 0, sizeof *c);
    mtrl_status st = mtrl_ckpt_open_file(&c->index, index_path, err);
    if (st != MTRL_OK) return st;
    snprintf(c->path, sizeof c->path, "%s", index_path);
    c->table = t;
    const char *layout = mtrl_ckpt_meta(&c->index, "shard.layout");
    long ranks = meta_long_(&c->index, "shard.ranks"), align = meta_long_(&c->index, "shard.align"),
         total = meta_long_(&c->index, "shard.total");
    char mine[65];
    layout_digest_(t, mine);
    if (!mtrl_ckpt_meta(&c->index, "mtrl.sharded") || !layout || ranks < 1 || align < 1 || total < 1)
        st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: not the index of a sharded checkpoint (no shard.* metadata)",
                            index_path);
    else if (strcmp(layout, mine) || (size_t)total != t->total)
        st = mtrl_error_set(err, MTRL_ERR_MISMATCH,
                            "%s: written for another parameter layout (%ld bytes, layout %.16s...) than this model's "
                            "(%zu bytes, layout %.16s...)",
                            index_path, total, layout, t->total, mine);
    const char *kind = mtrl_ckpt_meta(&c->index, "shard.kind");
    long experts = meta_long_(&c->index, "shard.experts");
    if (st == MTRL_OK && kind && (strcmp(kind, "expert_parallel") || experts < 1))
        st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: shard.kind %s with shard.experts %ld: not a layout this build reads",
                            index_path, kind, experts);
    if (st == MTRL_OK && kind) {
        // Written with expert-parallel ownership (dist_ep.h): the same layout again from the
        // ranks and experts it was written with; the digest above fixed the table.
        mtrl_dist_experts x;
        st = mtrl_dist_experts_make(&x, (int)experts, (int)ranks, err);
        if (st == MTRL_OK) st = mtrl_dist_ep_layout_make(&c->written_ep, t, &x, (size_t)align, err);
        if (st != MTRL_OK) st = mtrl_error_wrap(err, "%s: its expert-parallel layout (%ld ranks, %ld experts)", index_path,
                                                ranks, experts);
        c->ep = st == MTRL_OK;
    } else if (st == MTRL_OK) {
        st = mtrl_dist_shards_make(&c->written, t, (int)ranks, (size_t)align, err);
    }
    c->ranks = (int)ranks;
    if (st == MTRL_OK) {
        c->digest = xcalloc((size_t)ranks, sizeof *c->digest);
        for (int r = 0; r < ranks && st == MTRL_OK; r++) {
            char key[32];
            snprintf(key, sizeof key, "shard.%d.sha256", r);
            const char *d = mtrl_ckpt_meta(&c->index, key);
            if (!d || strlen(d) != 64)
                st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: no %s for rank %d's file", index_path, key, r);
            else
                memcpy(c->digest[r], d, 65);
        }
    }
    if (st != MTRL_OK) mtrl_dist_ckpt_close(c);
    return st;
}

// Copies, from old rank q's file, every piece that overlaps [lo, hi) of the block into the
// three target buffers (dst[b] holds the block's bytes from lo).
static mtrl_status copy_from_(mtrl_dist_ckpt *c, int q, size_t lo, size_t hi, void *const *dst,
                              mtrl_error *err) {
    const mtrl_tt *t = c->table;
    char path[1100];
    mtrl_dist_ckpt_rank_path(path, sizeof path, c->path, q, c->ranks);
    mtrl_status st = mtrl_ckpt_verify_digest(path, c->digest[q], err);
    mtrl_ckpt f;
    if (st == MTRL_OK) st = mtrl_ckpt_open_file(&f, path, err);
    if (st != MTRL_OK) return st;
    const mtrl_dist_piece *pieces;
    int n_piece;
    if (c->ep) {
        pieces = c->written_ep.piece + c->written_ep.rank[q].first_piece;
        n_piece = c->written_ep.rank[q].n_piece;
    } else {
        pieces = c->written.piece + c->written.rank[q].first_piece;
        n_piece = c->written.rank[q].n_piece;
    }
    void *buf = NULL;
    size_t buf_cap = 0;
    for (int j = 0; j < n_piece && st == MTRL_OK; j++) {
        const mtrl_dist_piece *p = &pieces[j];
        size_t es = mtrl_dtype_size(t->items[p->tensor].dtype), a = piece_off_(t, p), b = a + (p->end - p->begin) * es;
        size_t x0 = a > lo ? a : lo, x1 = b < hi ? b : hi;
        if (x0 >= x1) continue;
        if (b - a > buf_cap) {
            free(buf);
            buf_cap = b - a;
            buf = xmalloc(buf_cap);
        }
        for (int k = 0; k < 3 && st == MTRL_OK; k++) {
            if (!dst[k]) continue;
            char name[MTRL_TT_NAME_MAX];
            int64_t shape[1] = {(int64_t)(p->end - p->begin)};
            st = piece_name_(name, t, p, k, err);
            if (st == MTRL_OK) st = mtrl_ckpt_read(&f, name, t->items[p->tensor].dtype, 1, shape, buf, err);
            if (st == MTRL_OK) memcpy((char *)dst[k] + (x0 - lo), (char *)buf + (x0 - a), x1 - x0);
        }
    }
    free(buf);
    mtrl_ckpt_close(&f);
    return st;
}

mtrl_status mtrl_dist_ckpt_read_shard(mtrl_dist_ckpt *c, const mtrl_dist_shards *sh, int rank, void *params,
                                      void *adam_m, void *adam_v, mtrl_error *err) {
    MTRL_CHECKF(rank >= 0 && rank < sh->ranks && sh->total == c->table->total, "rank %d of a layout of %d", rank,
                sh->ranks);
    size_t lo = sh->rank[rank].begin, hi = sh->rank[rank].end < sh->total ? sh->rank[rank].end : sh->total;
    void *dst[3] = {params, adam_m, adam_v};
    for (int k = 0; k < 3; k++)
        if (dst[k] && hi > lo) memset(dst[k], 0, hi - lo);
    mtrl_status st = MTRL_OK;
    // An expert-parallel rank's pieces span the block (its experts of every layer): every file.
    for (int q = 0; q < c->ranks && st == MTRL_OK; q++)
        if (c->ep || (c->written.rank[q].begin < hi && c->written.rank[q].end > lo)) st = copy_from_(c, q, lo, hi, dst, err);
    return st;
}

void mtrl_dist_ckpt_close(mtrl_dist_ckpt *c) {
    mtrl_ckpt_close(&c->index);
    mtrl_dist_shards_free(&c->written);
    if (c->ep) mtrl_dist_ep_layout_free(&c->written_ep);
    free(c->digest);
    memset(c, 0, sizeof *c);
}
