// mtrl-test: cpu
// The partition of a learner step over ranks (learner/dist_plan.h) and sharded checkpoints
// (learner/dist_ckpt.h): the token split (every episode once, the stated bound, the packer's
// units), the expert blocks and a simulated all-to-all there and back, the ZeRO shard layout
// covering the block once, re-sharding R -> R' bit for bit, [learner] gpus, [actor] gpus, and the
// expert-parallel ownership (learner/dist_ep.h).
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/checkpoint.h"
#include "common/config.h"
#include "common/rng.h"
#include "learner/dist_ckpt.h"
#include "learner/dist_ep.h"
#include "learner/dist_plan.h"
#include "learner/learner.h"
#include "model/model.h"
#include "testhelp.h"
#include "testmodel.h"
#include "testproc.h"

static uint64_t rnd_(uint64_t stream, uint64_t *ctr) { return mtrl_rng_u64(27, stream, (*ctr)++); }

static int cmp_desc_(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x < y) - (x > y);
}

// Every invariant of one split, the bound recomputed here from the sorted lengths.
static void check_split_(const mtrl_dist_split *s, int n, const int *len, int ranks, int segment) {
    int *seen = calloc((size_t)(n ? n : 1), sizeof(int));
    long total = 0, max = 0;
    for (int r = 0; r < ranks; r++) {
        long tok = 0;
        int longest = 0, prev = -1, ordered = 1;
        TEST_EQ_INT(s->first[r + 1] - s->first[r], s->rank[r].n_seq);
        for (int j = s->first[r]; j < s->first[r + 1]; j++) {
            int i = s->order[j];
            TEST_CHECK(i >= 0 && i < n && s->rank_of[i] == r);
            if (i >= 0 && i < n) seen[i]++;
            ordered &= i > prev;
            prev = i;
            tok += len[i];
            if (len[i] > longest) longest = len[i];
        }
        TEST_CHECKF(ordered, "rank %d's episodes are not in batch order", r);
        TEST_EQ_INT(s->rank[r].tokens, tok);
        TEST_EQ_INT(s->rank[r].longest, longest);
        total += tok;
        if (tok > max) max = tok;
        // Units: at least one per episode that does not fit the pack capacity, and the packed
        // ones at least their tokens over the capacity.
        int cap = segment > 0 ? segment : 4096;
        long packed = 0;
        int alone = 0;
        for (int j = s->first[r]; j < s->first[r + 1]; j++) {
            if (len[s->order[j]] > cap) alone++;
            else packed += len[s->order[j]];
        }
        TEST_CHECKF(s->rank[r].units >= alone + (packed + cap - 1) / cap && s->rank[r].units <= s->rank[r].n_seq,
                    "rank %d: %d units for %d episodes (%d alone, %ld packed tokens)", r, s->rank[r].units,
                    s->rank[r].n_seq, alone, packed);
    }
    int once = 1;
    for (int i = 0; i < n; i++) once &= seen[i] == 1;
    TEST_CHECKF(once, "an episode assigned other than once (n %d, ranks %d)", n, ranks);
    TEST_EQ_INT(s->total, total);
    TEST_EQ_INT(s->max_tokens, max);
    int *sorted = malloc(sizeof(int) * (size_t)(n ? n : 1));
    memcpy(sorted, len, sizeof(int) * (size_t)n);
    qsort(sorted, (size_t)n, sizeof(int), cmp_desc_);
    double l_r = n > ranks ? sorted[ranks] : 0, longest = n ? sorted[0] : 0;
    double bound = (double)total / ranks + (1.0 - 1.0 / ranks) * l_r;
    if (longest > bound) bound = longest;
    TEST_CHECKF((double)max <= bound + 1e-9 && max <= s->bound, "n %d ranks %d: busiest %ld over the bound %.1f (%ld)",
                n, ranks, max, bound, s->bound);
    free(sorted);
    free(seen);
}

static void test_split(void) {
    mtrl_error err;
    mtrl_dist_split s;
    // A hand case: the 5000-token episode alone on rank 0, the four of 1000 packed into one unit.
    int hand[] = {1000, 1000, 5000, 1000, 1000};
    TEST_CHECK(mtrl_dist_split_make(&s, 5, hand, 2, 0, &err) == MTRL_OK);
    TEST_EQ_INT(s.rank_of[2], 0);
    TEST_EQ_INT(s.rank[0].n_seq, 1);
    TEST_EQ_INT(s.rank[1].tokens, 4000);
    TEST_EQ_INT(s.rank[1].units, 1);
    TEST_EQ_INT(s.order[1], 0);
    TEST_EQ_INT(s.order[4], 4);
    TEST_NEAR(s.imbalance, 5000.0 / 4500.0 - 1.0, 1e-12);
    check_split_(&s, 5, hand, 2, 0);
    mtrl_dist_split_free(&s);

    // Random batches of mixed lengths, and the same batch with one episode longer than the rest.
    uint64_t ctr = 0;
    const int ranks_of[] = {1, 2, 3, 4, 7, 8};
    for (int trial = 0; trial < 60; trial++) {
        int ranks = ranks_of[trial % 6], n = 1 + (int)(rnd_(1, &ctr) % 160), segment = trial % 3 ? 0 : 2048;
        int *len = malloc(sizeof(int) * (size_t)(n + 1));
        long sum = 0;
        for (int i = 0; i < n; i++) {
            uint64_t u = rnd_(2, &ctr);
            len[i] = u % 4 == 0 ? 1 + (int)((u >> 8) % 16000) : 1 + (int)((u >> 8) % 700); // a few long, many short
            sum += len[i];
        }
        TEST_CHECK(mtrl_dist_split_make(&s, n, len, ranks, segment, &err) == MTRL_OK);
        check_split_(&s, n, len, ranks, segment);
        // Deterministic: the same input gives the same split.
        mtrl_dist_split t;
        TEST_CHECK(mtrl_dist_split_make(&t, n, len, ranks, segment, &err) == MTRL_OK);
        TEST_CHECK(!memcmp(s.rank_of, t.rank_of, sizeof(int) * (size_t)n) && !memcmp(s.order, t.order, sizeof(int) * (size_t)n));
        mtrl_dist_split_free(&t);
        mtrl_dist_split_free(&s);
        int big = (int)(rnd_(3, &ctr) % (uint64_t)(n + 1));
        memmove(len + big + 1, len + big, sizeof(int) * (size_t)(n - big));
        len[big] = (int)(sum + 1 > (1L << 30) ? (1L << 30) : sum + 1);
        TEST_CHECK(mtrl_dist_split_make(&s, n + 1, len, ranks, segment, &err) == MTRL_OK);
        check_split_(&s, n + 1, len, ranks, segment);
        if (ranks > 1) {
            TEST_EQ_INT(s.max_tokens, len[big]);
            TEST_EQ_INT(s.rank[s.rank_of[big]].n_seq, 1);
        }
        mtrl_dist_split_free(&s);
        free(len);
    }
    // Many short episodes (at most 700 tokens): the busiest rank within 700 tokens of the mean.
    for (int trial = 0; trial < 12; trial++) {
        int ranks = ranks_of[trial % 6], n = 8 * ranks + (int)(rnd_(6, &ctr) % 300);
        int *len = malloc(sizeof(int) * (size_t)n);
        for (int i = 0; i < n; i++) len[i] = 1 + (int)(rnd_(7, &ctr) % 700);
        TEST_CHECK(mtrl_dist_split_make(&s, n, len, ranks, 0, &err) == MTRL_OK);
        check_split_(&s, n, len, ranks, 0);
        TEST_CHECKF((double)s.max_tokens <= (double)s.total / ranks + 700, "%d short episodes over %d ranks: busiest %ld, mean %.1f",
                    n, ranks, s.max_tokens, (double)s.total / ranks);
        mtrl_dist_split_free(&s);
        free(len);
    }
    // Fewer episodes than ranks: the others get none.
    int two[] = {10, 20};
    TEST_CHECK(mtrl_dist_split_make(&s, 2, two, 4, 0, &err) == MTRL_OK);
    TEST_EQ_INT(s.rank[0].tokens, 20);
    TEST_EQ_INT(s.rank[1].tokens, 10);
    TEST_EQ_INT(s.rank[3].n_seq + s.rank[3].units, 0);
    check_split_(&s, 2, two, 4, 0);
    mtrl_dist_split_free(&s);
    int bad[] = {10, 0, 3};
    TEST_CHECK(mtrl_dist_split_make(&s, 3, bad, 2, 0, &err) == MTRL_ERR_USAGE && strstr(err.msg, "episode 1"));
    TEST_CHECK(mtrl_dist_split_make(&s, 2, two, 0, 0, &err) == MTRL_ERR_USAGE && strstr(err.msg, "0 ranks"));
    TEST_CHECK(mtrl_dist_split_make(&s, 2, two, MTRL_DIST_RANKS_MAX + 1, 0, &err) == MTRL_ERR_USAGE);
}

static void test_experts(void) {
    mtrl_error err;
    mtrl_dist_experts x;
    TEST_CHECK(mtrl_dist_experts_make(&x, 8, 3, &err) == MTRL_OK);
    TEST_CHECK(x.first[1] == 3 && x.first[2] == 6 && x.first[3] == 8);
    for (int e = 0; e < 8; e++) TEST_EQ_INT(mtrl_dist_expert_rank(&x, e), e < 3 ? 0 : e < 6 ? 1 : 2);
    TEST_CHECK(mtrl_dist_experts_make(&x, 64, 8, &err) == MTRL_OK);
    for (int r = 0; r < 8; r++) TEST_EQ_INT(x.first[r], 8 * r);
    TEST_CHECK(mtrl_dist_experts_make(&x, 2, 4, &err) == MTRL_ERR_USAGE && strstr(err.msg, "2 experts over 4 ranks"));
    TEST_CHECK(mtrl_dist_experts_make(&x, 0, 4, &err) == MTRL_OK && x.first[4] == 0);

    // A simulated exchange on R ranks: rows are (source rank, token, choice) ids routed to random
    // experts; each rank groups its rows by expert, the counts go first, then the rows, the
    // owner orders them expert-major; then the way back.
    uint64_t ctr = 0;
    const int cases[][2] = {{8, 2}, {8, 3}, {16, 4}, {5, 5}, {64, 8}, {7, 1}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int E = cases[c][0], R = cases[c][1], k = 2;
        TEST_CHECK(mtrl_dist_experts_make(&x, E, R, &err) == MTRL_OK);
        int64_t *rows_all = calloc((size_t)(R * E), sizeof(int64_t));
        int64_t *sent[MTRL_DIST_RANKS_MAX], *orig[MTRL_DIST_RANKS_MAX], n_rows[MTRL_DIST_RANKS_MAX];
        int *exp_of[MTRL_DIST_RANKS_MAX];
        int64_t scount[MTRL_DIST_RANKS_MAX][MTRL_DIST_RANKS_MAX], soff[MTRL_DIST_RANKS_MAX][MTRL_DIST_RANKS_MAX];
        for (int r = 0; r < R; r++) {
            int T = (int)(rnd_(4, &ctr) % 50);
            n_rows[r] = (int64_t)T * k;
            orig[r] = malloc(sizeof(int64_t) * (size_t)(n_rows[r] + 1));
            exp_of[r] = malloc(sizeof(int) * (size_t)(n_rows[r] + 1));
            sent[r] = malloc(sizeof(int64_t) * (size_t)(n_rows[r] + 1));
            for (int64_t i = 0; i < n_rows[r]; i++) {
                orig[r][i] = ((int64_t)r << 32) | i;
                exp_of[r][i] = (int)(rnd_(5, &ctr) % (uint64_t)E);
                rows_all[(size_t)r * E + exp_of[r][i]]++;
            }
            // Group by expert (stable): what the grouped GEMMs' sort does on each rank.
            int64_t at = 0;
            for (int e = 0; e < E; e++)
                for (int64_t i = 0; i < n_rows[r]; i++)
                    if (exp_of[r][i] == e) sent[r][at++] = orig[r][i];
            mtrl_dist_a2a_send(&x, rows_all + (size_t)r * E, scount[r], soff[r]);
            int64_t sum = 0;
            for (int d = 0; d < R; d++) {
                sum += scount[r][d];
                TEST_EQ_INT(soff[r][d], d ? soff[r][d - 1] + scount[r][d - 1] : 0);
            }
            TEST_EQ_INT(sum, n_rows[r]);
        }
        int64_t *back[MTRL_DIST_RANKS_MAX];
        for (int r = 0; r < R; r++) back[r] = calloc((size_t)(n_rows[r] + 1), sizeof(int64_t));
        for (int d = 0; d < R; d++) {
            int64_t rcount[MTRL_DIST_RANKS_MAX], roff[MTRL_DIST_RANKS_MAX], erows[64], total = 0;
            mtrl_dist_a2a_recv(&x, d, rows_all, rcount, roff, erows);
            for (int s = 0; s < R; s++) {
                TEST_EQ_INT(rcount[s], scount[s][d]);
                total += rcount[s];
            }
            int64_t *in = malloc(sizeof(int64_t) * (size_t)(total + 1)), *grouped = malloc(sizeof(int64_t) * (size_t)(total + 1));
            int64_t *pos = malloc(sizeof(int64_t) * (size_t)(total + 1));
            for (int s = 0; s < R; s++) memcpy(in + roff[s], sent[s] + soff[s][d], sizeof(int64_t) * (size_t)rcount[s]);
            mtrl_dist_a2a_expert_order(&x, d, rows_all, pos);
            for (int64_t i = 0; i < total; i++) grouped[pos[i]] = in[i];
            // Expert-major: the rows of each own expert together, and every row is one of its.
            int64_t at = 0, wrong = 0;
            for (int e = x.first[d]; e < x.first[d + 1]; e++)
                for (int64_t j = 0; j < erows[e - x.first[d]]; j++, at++) {
                    int64_t id = grouped[at];
                    wrong += exp_of[id >> 32][id & 0xffffffff] != e;
                }
            TEST_EQ_INT(at, total);
            TEST_EQ_INT(wrong, 0);
            // The way back: undo the grouping, then the reverse exchange into each source's slots.
            for (int64_t i = 0; i < total; i++) in[i] = grouped[pos[i]];
            for (int s = 0; s < R; s++) memcpy(back[s] + soff[s][d], in + roff[s], sizeof(int64_t) * (size_t)rcount[s]);
            free(in);
            free(grouped);
            free(pos);
        }
        for (int r = 0; r < R; r++) {
            TEST_CHECKF(!memcmp(back[r], sent[r], sizeof(int64_t) * (size_t)n_rows[r]), "E %d R %d: rank %d's rows", E, R, r);
            free(back[r]);
            free(sent[r]);
            free(orig[r]);
            free(exp_of[r]);
        }
        free(rows_all);
    }
}

// Every element of every tensor in exactly one rank's pieces, the ranges tiling [0, padded).
static void check_shards_(const mtrl_dist_shards *s, const mtrl_tt *t, int ranks, size_t align) {
    TEST_EQ_INT(s->ranks, ranks);
    TEST_CHECK(s->shard_bytes % align == 0 && s->padded == s->shard_bytes * (size_t)ranks && s->padded >= t->total &&
               s->padded - t->total < (size_t)ranks * align + align);
    size_t used = 0;
    for (int r = 0; r < ranks; r++) {
        TEST_EQ_INT(s->rank[r].begin, r ? s->rank[r - 1].end : 0);
        TEST_EQ_INT(s->rank[r].begin % align, 0);
        used += s->rank[r].used;
    }
    TEST_EQ_INT(s->rank[ranks - 1].end, s->padded);
    size_t want = 0;
    for (int i = 0; i < t->n; i++) want += t->items[i].nbytes;
    TEST_EQ_INT(used, want);
    int ok = 1;
    for (int i = 0; i < t->n; i++) {
        unsigned char *hit = calloc(t->items[i].numel + 1, 1);
        for (int r = 0; r < ranks; r++)
            for (int j = 0; j < s->rank[r].n_piece; j++) {
                const mtrl_dist_piece *p = &s->piece[s->rank[r].first_piece + j];
                if (p->tensor != i) continue;
                size_t es = mtrl_dtype_size(t->items[i].dtype), b0 = t->items[i].offset + p->begin * es;
                ok &= b0 >= s->rank[r].begin && t->items[i].offset + p->end * es <= s->rank[r].end && p->begin < p->end;
                for (size_t e = p->begin; e < p->end; e++) hit[e]++;
            }
        for (size_t e = 0; e < t->items[i].numel; e++) ok &= hit[e] == 1;
        free(hit);
    }
    TEST_CHECKF(ok, "ranks %d align %zu: an element owned other than once", ranks, align);
}

static void test_shards(void) {
    mtrl_error err;
    mtrl_model_dims d = test_model_dims("preset = tiny", 264);
    mtrl_tt t;
    mtrl_model_param_table(&t, &d);
    for (int ranks = 1; ranks <= 9; ranks++)
        for (size_t align = 64; align <= 4096; align *= 8) {
            mtrl_dist_shards s;
            TEST_CHECK(mtrl_dist_shards_make(&s, &t, ranks, align, &err) == MTRL_OK);
            check_shards_(&s, &t, ranks, align);
            mtrl_dist_shards_free(&s);
        }
    mtrl_tt_free(&t);
    // Odd sizes and mixed dtypes: a tensor cut into many pieces, a block smaller than the ranks'
    // alignment (ranks of padding alone).
    mtrl_tt u;
    mtrl_tt_init(&u);
    mtrl_tt_add(&u, "a", MTRL_DT_F64, 1, (int64_t[]){3});
    mtrl_tt_add(&u, "b", MTRL_DT_F32, 2, (int64_t[]){37, 11});
    mtrl_tt_add(&u, "c", MTRL_DT_BF16, 1, (int64_t[]){5});
    mtrl_tt_layout(&u);
    for (int ranks = 1; ranks <= 16; ranks += 3) {
        mtrl_dist_shards s;
        TEST_CHECK(mtrl_dist_shards_make(&s, &u, ranks, 8, &err) == MTRL_OK);
        check_shards_(&s, &u, ranks, 8);
        mtrl_dist_shards_free(&s);
    }
    mtrl_dist_shards s;
    TEST_CHECK(mtrl_dist_shards_make(&s, &u, 2, 4, &err) == MTRL_ERR_USAGE && strstr(err.msg, "of a"));
    TEST_CHECK(mtrl_dist_shards_make(&s, &u, 0, 256, &err) == MTRL_ERR_USAGE);
    mtrl_tt_free(&u);
}

// Fills a block's tensors with values from `stream` and zeroes the padding between them.
// Every element of t owned by exactly one rank; rank r's expert pieces exactly its experts' rows
// of every MoE layer's w1/w3/w2; the non-expert pieces those of mtrl_dist_shards_make on a table
// of the non-expert tensors alone; held = every non-expert tensor whole plus r's own experts.
static void check_ep_(const mtrl_tt *t, int E, int ranks) {
    mtrl_error err;
    mtrl_dist_experts x;
    TEST_CHECK(mtrl_dist_experts_make(&x, E, ranks, &err) == MTRL_OK);
    mtrl_dist_ep_layout l;
    TEST_CHECKF(mtrl_dist_ep_layout_make(&l, t, &x, MTRL_DIST_SHARD_ALIGN, &err) == MTRL_OK, "%s", err.msg);
    // The reference for the non-expert part, built independently.
    mtrl_tt d;
    mtrl_tt_init(&d);
    size_t expert_total = 0, dense = 0;
    int n_exp = 0;
    for (int i = 0; i < t->n; i++) {
        const mtrl_tensor *a = &t->items[i];
        if (strstr(a->name, ".moe.w1") || strstr(a->name, ".moe.w2") || strstr(a->name, ".moe.w3")) {
            TEST_CHECK(strstr(a->name, "shared") == NULL && a->shape[0] == E);
            expert_total += a->nbytes;
            n_exp++;
        } else {
            mtrl_tt_add(&d, a->name, a->dtype, a->ndim, a->shape);
            dense += a->nbytes;
        }
    }
    mtrl_tt_layout(&d);
    mtrl_dist_shards ref;
    TEST_CHECK(mtrl_dist_shards_make(&ref, &d, ranks, MTRL_DIST_SHARD_ALIGN, &err) == MTRL_OK);
    TEST_EQ_INT(l.expert_total, expert_total);
    TEST_EQ_INT(l.dense_bytes, dense);
    TEST_CHECK(E == 0 || n_exp > 0);
    int ok = 1;
    size_t owned = 0;
    unsigned char **hit = calloc((size_t)t->n, sizeof *hit);
    for (int i = 0; i < t->n; i++) hit[i] = calloc(t->items[i].numel + 1, 1);
    for (int r = 0; r < ranks; r++) {
        const mtrl_dist_ep_rank *h = &l.rank[r];
        int e0 = x.first[r], e1 = x.first[r + 1];
        // Expert pieces: one per expert tensor, in table order, the rows of experts e0..e1-1.
        ok &= h->n_expert_piece == (e1 > e0 ? n_exp : 0);
        int k = 0;
        size_t eb = 0;
        for (int i = 0; i < t->n && e1 > e0; i++) {
            const mtrl_tensor *a = &t->items[i];
            if (!strstr(a->name, ".moe.w") || strstr(a->name, "shared")) continue;
            const mtrl_dist_piece *p = &l.piece[h->first_piece + k++];
            size_t row = a->numel / (size_t)a->shape[0], es = mtrl_dtype_size(a->dtype);
            ok &= p->tensor == i && p->begin == row * (size_t)e0 && p->end == row * (size_t)e1;
            // In bytes of the block: expert e0's first byte and e1-1's last.
            ok &= a->offset + p->begin * es == a->offset + (size_t)e0 * (a->nbytes / (size_t)E);
            eb += (p->end - p->begin) * es;
        }
        ok &= h->expert_bytes == eb;
        // Non-expert pieces: the reference shard's, tensor indices mapped back by name.
        const mtrl_dist_shard *s = &ref.rank[r];
        ok &= h->n_piece - h->n_expert_piece == s->n_piece && h->shard_bytes == s->used;
        for (int j = 0; j < s->n_piece && j < h->n_piece - h->n_expert_piece; j++) {
            const mtrl_dist_piece *p = &l.piece[h->first_piece + h->n_expert_piece + j], *q = &ref.piece[s->first_piece + j];
            ok &= !strcmp(t->items[p->tensor].name, d.items[q->tensor].name) && p->begin == q->begin && p->end == q->end;
        }
        for (int j = 0; j < h->n_piece; j++) {
            const mtrl_dist_piece *p = &l.piece[h->first_piece + j];
            ok &= p->begin < p->end && p->end <= t->items[p->tensor].numel;
            for (size_t e = p->begin; e < p->end; e++) hit[p->tensor][e]++;
            owned += (p->end - p->begin) * mtrl_dtype_size(t->items[p->tensor].dtype);
        }
        // Held: the whole of every non-expert tensor and r's expert pieces, nothing else.
        size_t held = 0;
        for (int j = 0; j < h->n_held; j++) {
            const mtrl_dist_piece *p = &l.held[h->first_held + j];
            const mtrl_tensor *a = &t->items[p->tensor];
            int is_exp = strstr(a->name, ".moe.w") && !strstr(a->name, "shared");
            ok &= is_exp ? (p->begin == a->numel / (size_t)E * (size_t)e0 && p->end == a->numel / (size_t)E * (size_t)e1)
                         : (p->begin == 0 && p->end == a->numel);
            held += (p->end - p->begin) * mtrl_dtype_size(a->dtype);
        }
        ok &= h->n_held == t->n - n_exp + h->n_expert_piece && held == h->held_bytes && held == dense + eb;
    }
    for (int i = 0; i < t->n; i++) {
        for (size_t e = 0; e < t->items[i].numel; e++) ok &= hit[i][e] == 1;
        free(hit[i]);
    }
    free(hit);
    ok &= owned == expert_total + dense;
    TEST_CHECKF(ok, "E %d ranks %d: the expert-parallel layout is wrong", E, ranks);
    if (ranks == 1) // one rank owns everything: every tensor whole
        for (int j = 0; j < l.n_piece; j++) ok &= l.piece[j].begin == 0 && l.piece[j].end == t->items[l.piece[j].tensor].numel;
    TEST_CHECKF(ok && (ranks > 1 || l.n_piece == t->n), "E %d: one rank does not own every tensor whole", E);
    mtrl_dist_shards_free(&ref);
    mtrl_tt_free(&d);
    mtrl_dist_ep_layout_free(&l);
}

static void test_ep_layout(void) {
    mtrl_error err;
    mtrl_model_dims d = test_model_dims("preset = tiny", 264);
    mtrl_tt t;
    mtrl_model_param_table(&t, &d);
    TEST_CHECK(d.E > 1);
    for (int ranks = 1; ranks <= d.E && ranks <= 8; ranks++) check_ep_(&t, d.E, ranks); // E % ranks != 0 among them
    // An assignment of another E than the table's is refused, naming the tensor.
    mtrl_dist_experts x;
    TEST_CHECK(mtrl_dist_experts_make(&x, d.E * 2, 2, &err) == MTRL_OK);
    mtrl_dist_ep_layout l;
    TEST_CHECK(mtrl_dist_ep_layout_make(&l, &t, &x, MTRL_DIST_SHARD_ALIGN, &err) == MTRL_ERR_USAGE &&
               strstr(err.msg, ".moe.w1"));
    mtrl_tt_free(&t);
    mtrl_model_dims s = test_model_dims("preset = small", 264);
    TEST_EQ_INT(s.E, 64);
    mtrl_model_param_table(&t, &s);
    for (int ranks = 2; ranks <= 8; ranks *= 2) check_ep_(&t, s.E, ranks);
    mtrl_tt_free(&t);
}

static void fill_block_(const mtrl_tt *t, void *block, uint64_t stream) {
    memset(block, 0, t->total);
    uint64_t ctr = 0;
    for (int i = 0; i < t->n; i++) {
        real *x = (real *)((char *)block + t->items[i].offset);
        for (size_t e = 0; e < t->items[i].numel; e++) x[e] = (real)mtrl_rng_normal(27, stream, ctr++);
    }
}

// Writes m's state with R1 ranks (each from shard buffers of its own), reads it back with R2,
// assembles the R2 shards and compares them with the unsharded state, byte for byte.
static void reshard_(const mtrl_model *m, const char *dir, int R1, int R2) {
    mtrl_error err;
    char path[600];
    snprintf(path, sizeof path, "%s/ckpt_%d.safetensors", dir, R1);
    const void *blk[3] = {m->params.base, m->adam_m, m->adam_v};
    size_t total = m->params.total;
    mtrl_dist_shards w, r2;
    TEST_CHECK(mtrl_dist_shards_make(&w, &m->params, R1, MTRL_DIST_SHARD_ALIGN, &err) == MTRL_OK);
    for (int r = 0; r < R1; r++) {
        void *sh[3];
        size_t b = w.rank[r].begin, e = w.rank[r].end < total ? w.rank[r].end : total;
        for (int k = 0; k < 3; k++) {
            sh[k] = calloc(w.shard_bytes, 1);
            if (e > b) memcpy(sh[k], (const char *)blk[k] + b, e - b);
        }
        mtrl_status st = mtrl_dist_ckpt_write_rank(path, &w, &m->params, r, sh[0], sh[1], sh[2], &err);
        TEST_CHECKF(st == MTRL_OK, "R %d rank %d: %s", R1, r, err.msg);
        for (int k = 0; k < 3; k++) free(sh[k]);
    }
    mtrl_ckpt_entry beta = {"qb_beta", sizeof(real) == 8 ? MTRL_DT_F64 : MTRL_DT_F32, 2,
                            {m->dims.L, m->dims.E}, m->qb_beta, sizeof(real) * (size_t)m->dims.L * m->dims.E};
    const char *meta[] = {"step", "7"};
    TEST_CHECK(mtrl_dist_ckpt_write_index(path, &w, &m->params, &beta, 1, meta, 1, &err) == MTRL_OK);
    mtrl_dist_shards_free(&w);

    mtrl_dist_ckpt c;
    mtrl_status st = mtrl_dist_ckpt_open(&c, path, &m->params, &err);
    TEST_CHECKF(st == MTRL_OK, "%s", err.msg);
    if (st != MTRL_OK) return;
    TEST_CHECK(mtrl_dist_shards_make(&r2, &m->params, R2, MTRL_DIST_SHARD_ALIGN, &err) == MTRL_OK);
    char *full[3];
    for (int k = 0; k < 3; k++) full[k] = malloc(total);
    for (int r = 0; r < R2; r++) {
        void *sh[3];
        for (int k = 0; k < 3; k++) sh[k] = malloc(r2.shard_bytes);
        st = mtrl_dist_ckpt_read_shard(&c, &r2, r, sh[0], sh[1], sh[2], &err);
        TEST_CHECKF(st == MTRL_OK, "%d -> %d, rank %d: %s", R1, R2, r, err.msg);
        size_t b = r2.rank[r].begin, e = r2.rank[r].end < total ? r2.rank[r].end : total;
        for (int k = 0; k < 3; k++) {
            if (e > b) memcpy(full[k] + b, sh[k], e - b);
            free(sh[k]);
        }
    }
    for (int k = 0; k < 3; k++) {
        TEST_CHECKF(!memcmp(full[k], blk[k], total), "%d -> %d ranks: block %d differs from the unsharded state", R1, R2, k);
        free(full[k]);
    }
    real *b2 = malloc(beta.nbytes);
    TEST_CHECK(mtrl_ckpt_read(&c.index, "qb_beta", beta.dtype, 2, beta.shape, b2, &err) == MTRL_OK &&
               !memcmp(b2, m->qb_beta, beta.nbytes));
    free(b2);
    TEST_CHECK(mtrl_ckpt_meta(&c.index, "step") && !strcmp(mtrl_ckpt_meta(&c.index, "step"), "7"));
    mtrl_dist_ckpt_close(&c);
    mtrl_dist_shards_free(&r2);
}

static void test_checkpoint(void) {
    char dir[] = "/tmp/mtrl_dist_plan_XXXXXX";
    TEST_CHECK(mkdtemp(dir) != NULL);
    mtrl_model_dims d = test_model_dims("preset = tiny", 264);
    mtrl_model m;
    mtrl_model_init(&m, &d, 5);
    fill_block_(&m.params, m.adam_m, 1);
    fill_block_(&m.params, m.adam_v, 2);
    for (int i = 0; i < d.L * d.E; i++) m.qb_beta[i] = (real)(0.01 * i);
    reshard_(&m, dir, 2, 1);
    reshard_(&m, dir, 4, 2);
    reshard_(&m, dir, 3, 2);
    reshard_(&m, dir, 1, 3);

    // R' = 1 straight into a fresh model's blocks: the model the unsharded checkpoint loads.
    mtrl_error err;
    char path[600], full[600];
    snprintf(path, sizeof path, "%s/ckpt_4.safetensors", dir);
    snprintf(full, sizeof full, "%s/full.safetensors", dir);
    TEST_CHECK(mtrl_model_save(&m, full, NULL, NULL, 1, NULL, 0, &err) == MTRL_OK);
    mtrl_model a, b;
    mtrl_model_init(&a, &d, 9);
    mtrl_model_init(&b, &d, 9);
    mtrl_ckpt f;
    TEST_CHECK(mtrl_ckpt_open_file(&f, full, &err) == MTRL_OK && mtrl_model_load(&a, &f, 1, &err) == MTRL_OK);
    mtrl_ckpt_close(&f);
    mtrl_dist_ckpt c;
    mtrl_dist_shards one;
    TEST_CHECK(mtrl_dist_shards_make(&one, &b.params, 1, MTRL_DIST_SHARD_ALIGN, &err) == MTRL_OK);
    TEST_CHECK(mtrl_dist_ckpt_open(&c, path, &b.params, &err) == MTRL_OK);
    TEST_CHECK(mtrl_dist_ckpt_read_shard(&c, &one, 0, b.params.base, b.adam_m, b.adam_v, &err) == MTRL_OK);
    mtrl_dist_ckpt_close(&c);
    size_t total = a.params.total;
    TEST_CHECK(!memcmp(a.params.base, b.params.base, total) && !memcmp(a.adam_m, b.adam_m, total) &&
               !memcmp(a.adam_v, b.adam_v, total));

    // Refusals: an unsharded checkpoint, another model's layout, a rank file changed since.
    TEST_CHECK(mtrl_dist_ckpt_open(&c, full, &b.params, &err) == MTRL_ERR_FORMAT && strstr(err.msg, "not the index"));
    mtrl_model_dims d2 = test_model_dims("preset = tiny\nlayers = 3", 264);
    mtrl_tt t2;
    mtrl_model_param_table(&t2, &d2);
    TEST_CHECK(mtrl_dist_ckpt_open(&c, path, &t2, &err) == MTRL_ERR_MISMATCH && strstr(err.msg, "another parameter layout"));
    mtrl_tt_free(&t2);
    char rank1[700];
    mtrl_dist_ckpt_rank_path(rank1, sizeof rank1, path, 1, 4);
    FILE *g = fopen(rank1, "r+b");
    TEST_CHECK(g != NULL);
    if (g) {
        fseek(g, -1, SEEK_END);
        int ch = fgetc(g);
        fseek(g, -1, SEEK_END);
        fputc(ch ^ 1, g);
        fclose(g);
    }
    TEST_CHECK(mtrl_dist_ckpt_open(&c, path, &b.params, &err) == MTRL_OK);
    TEST_CHECK(mtrl_dist_ckpt_read_shard(&c, &one, 0, b.params.base, b.adam_m, b.adam_v, &err) == MTRL_ERR_MISMATCH);
    mtrl_dist_ckpt_close(&c);
    mtrl_dist_shards_free(&one);
    mtrl_model_free(&a);
    mtrl_model_free(&b);
    mtrl_model_free(&m);
    test_tmpdir_done(dir, test_failed_);
}

// [learner] gpus: the list, the default, and refusals naming the key.
static void test_config_gpus(void) {
    const struct { const char *value; int n; const char *msg; } cases[] = {
        {"", 0, NULL},         {"0", 1, NULL},           {"0,1,3", 3, NULL},  {" 2 , 0 ", 2, NULL},
        {"0,0", -1, "twice"},  {"-1", -1, "not a GPU id"}, {"0,x", -1, "not a number"}, {"0;1", -1, "comma"},
        {"1,", -1, "not a number"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char text[256];
        snprintf(text, sizeof text, "[env]\nname = calc\n[learner]\ngpus = %s\n", cases[i].value);
        mtrl_config cfg;
        mtrl_config_errors errs = {0};
        mtrl_status st = mtrl_config_load_text(&cfg, "gpus.ini", text, NULL, 0, &errs);
        if (cases[i].n >= 0) {
            TEST_CHECKF(st == MTRL_OK, "gpus = %s: %s", cases[i].value, errs.n ? errs.msgs[0] : "");
            int ids[MTRL_CFG_GPUS_MAX];
            char why[160];
            TEST_EQ_INT(mtrl_config_gpus(&cfg, ids, why, sizeof why), cases[i].n);
            if (cases[i].n == 3) TEST_CHECK(ids[0] == 0 && ids[1] == 1 && ids[2] == 3);
            if (cases[i].n == 2) TEST_CHECK(ids[0] == 2 && ids[1] == 0);
        } else {
            TEST_CHECKF(st != MTRL_OK && errs.n == 1 && strstr(errs.msgs[0], "[learner] gpus") &&
                            strstr(errs.msgs[0], cases[i].msg),
                        "gpus = %s: %s", cases[i].value, errs.n ? errs.msgs[0] : "(accepted)");
        }
        mtrl_config_errors_free(&errs);
    }
}

// [actor] gpus: actor i (1-based) on the ((i-1) mod n)-th id, repeats allowed, the default -1
// ([model] device's GPU); a malformed list and a list for a CPU model refused naming the key;
// `mtrl check` prints where each actor runs.
static void test_actor_gpus(void) {
    const char *base = "[env]\nname = calc\n[model]\ndevice = cuda\n[actor]\ncount = 5\n";
    const struct { const char *value; int gpu[5]; } ok[] = {
        {"", {-1, -1, -1, -1, -1}}, {"1", {1, 1, 1, 1, 1}}, {"1,0", {1, 0, 1, 0, 1}}, {" 2 , 2 , 3", {2, 2, 3, 2, 2}},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        char text[256];
        snprintf(text, sizeof text, "%sgpus = %s\n", base, ok[i].value);
        mtrl_config cfg;
        mtrl_config_errors errs = {0};
        TEST_CHECKF(mtrl_config_load_text(&cfg, "a.ini", text, NULL, 0, &errs) == MTRL_OK, "[actor] gpus = %s: %s",
                    ok[i].value, errs.n ? errs.msgs[0] : "");
        mtrl_config_errors_free(&errs);
        for (int a = 1; a <= 5; a++)
            TEST_CHECKF(mtrl_config_actor_gpu(&cfg, a) == ok[i].gpu[a - 1], "[actor] gpus = %s: actor %d on %d, not %d",
                        ok[i].value, a, mtrl_config_actor_gpu(&cfg, a), ok[i].gpu[a - 1]);
    }
    const struct { const char *text, *msg; } bad[] = {
        {"[env]\nname = calc\n[model]\ndevice = cuda\n[actor]\ngpus = 0,x\n", "not a number"},
        {"[env]\nname = calc\n[model]\ndevice = cuda\n[actor]\ngpus = 0;1\n", "comma"},
        {"[env]\nname = calc\n[model]\ndevice = cuda\n[actor]\ngpus = 5000\n", "not a GPU id"},
        {"[env]\nname = calc\n[actor]\ngpus = 0\n", "needs [model] device = cuda"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        mtrl_config cfg;
        mtrl_config_errors errs = {0};
        mtrl_status st = mtrl_config_load_text(&cfg, "a.ini", bad[i].text, NULL, 0, &errs);
        TEST_CHECKF(st != MTRL_OK && errs.n == 1 && strstr(errs.msgs[0], "[actor] gpus") && strstr(errs.msgs[0], bad[i].msg),
                    "case %zu: %s", i, errs.n ? errs.msgs[0] : "(accepted)");
        mtrl_config_errors_free(&errs);
    }
    const char *bin = getenv("MTRL_BIN"), *src = getenv("MTRL_SRC");
    if (!bin || !src) return;
    char cmd[2048], out[65536];
    snprintf(cmd, sizeof cmd, "'%s' check '%s/experiments/quickstart.ini' --set model.device=cuda --set actor.count=3 "
             "--set actor.gpus=1,0 2>&1", bin, src);
    int rc = test_shell(cmd, out, sizeof out);
    TEST_CHECKF(rc == 0 && strstr(out, "; actors: 1 on GPU 1, 2 on GPU 0, 3 on GPU 1\n"), "mtrl check (rc %d):\n%.2000s", rc, out);
    snprintf(cmd, sizeof cmd, "'%s' check '%s/experiments/quickstart.ini' --set actor.gpus=0 2>&1", bin, src);
    rc = test_shell(cmd, out, sizeof out);
    TEST_CHECKF(rc == 2 && strstr(out, "[actor] gpus = 0 needs [model] device = cuda"), "mtrl check (rc %d):\n%.2000s", rc, out);
}

// GPUs listed for a CPU learner: the load takes it (mtrl plan's per-rank plan), the learner
// refuses to start, naming both keys.
static void test_learner_refuses(void) {
    mtrl_config cfg;
    mtrl_config_errors errs = {0};
    const char *text = "[env]\nname = calc\n[learner]\ngpus = 0,1\n";
    TEST_CHECK(mtrl_config_load_text(&cfg, "gpus.ini", text, NULL, 0, &errs) == MTRL_OK);
    mtrl_config_errors_free(&errs);
    mtrl_learner *l = NULL;
    mtrl_error err;
    TEST_CHECKF(mtrl_learner_open(&l, &cfg, NULL, &err) == MTRL_ERR_USAGE && l == NULL &&
                strstr(err.msg, "[learner] gpus = 0,1") && strstr(err.msg, "[model] device = cpu"), "%s", err.msg);
}

// `mtrl plan` with two GPUs listed prints the per-rank table (ctest sets MTRL_BIN and MTRL_SRC).
static void test_plan_command(void) {
    const char *bin = getenv("MTRL_BIN"), *src = getenv("MTRL_SRC");
    if (!bin || !src) {
        printf("mtrl plan not run: MTRL_BIN / MTRL_SRC not set (run through ctest)\n");
        return;
    }
    char cmd[2048], out[16384];
    snprintf(cmd, sizeof cmd, "'%s' plan '%s/experiments/quickstart.ini' --budget-gib 8 --set learner.gpus=3,1 2>&1", bin,
             src);
    int rc = test_shell(cmd, out, sizeof out);
    TEST_CHECKF(rc == 0 && strstr(out, "per-rank plan (2 ranks)") && strstr(out, "imbalance 0.0%") &&
                    strstr(out, "0..3") && strstr(out, "4..7") &&
                    strstr(out, "expert-parallel ownership") && strstr(out, "held for the forward") && strstr(out, "memory plan of rank 0 (16 of the 32"),
                "mtrl plan (rc %d):\n%s", rc, out);
}

int main(void) {
    test_split();
    test_experts();
    test_shards();
    test_ep_layout();
    test_checkpoint();
    test_config_gpus();
    test_actor_gpus();
    test_learner_refuses();
    test_plan_command();
    return test_report();
}
