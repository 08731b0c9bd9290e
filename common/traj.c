// traj.c: the trajectory representation, its digest and its binary encodings (see traj.h).
#include "common/traj.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/hash.h"
#include "common/image.h"

#define TAG_(a, b, c, d) ((uint32_t)(a) | ((uint32_t)(b) << 8) | ((uint32_t)(c) << 16) | ((uint32_t)(d) << 24))
#define TAG_HEADER TAG_('T', 'B', 'E', 'G')
#define TAG_SLICE TAG_('T', 'C', 'H', 'K')
#define TAG_SUMMARY TAG_('T', 'E', 'N', 'D')
#define TAG_EPISODE TAG_('T', 'R', 'A', 'J')

// Smallest encoded tool call: turn, status, latency, four empty length prefixes.
#define TOOL_MIN_BYTES (4 + 4 + 8 + 4 + 4 + 4 + 4)

const char *mtrl_ep_status_name(mtrl_ep_status s) {
    switch (s) {
    case MTRL_EP_OPEN: return "open";
    case MTRL_EP_COMPLETE: return "complete";
    case MTRL_EP_TRUNCATED: return "truncated";
    case MTRL_EP_ABORTED: return "aborted";
    case MTRL_EP_REJECTED: return "rejected";
    }
    return "unknown";
}

int mtrl_ep_status_parse(const char *name) {
    if (!name) return -1;
    for (int s = MTRL_EP_OPEN; s <= MTRL_EP_REJECTED; s++)
        if (strcmp(name, mtrl_ep_status_name((mtrl_ep_status)s)) == 0) return s;
    return -1;
}

mtrl_traj_limits mtrl_traj_limits_default(void) {
    mtrl_traj_limits l;
    l.max_tokens = 1ull << 21;
    l.max_chunk_tokens = 1u << 18;
    l.max_tool_calls = 1u << 16;
    l.max_tool_bytes = 16u << 20;
    l.max_string = 4096;
    l.max_routing_width = 4096;
    l.max_turns = 1u << 16;
    l.max_images = 4096;
    l.max_image_bytes = 3u * 4096u * 4096u;
    return l;
}

// ---- lifetime --------------------------------------------------------------------------------

void mtrl_traj_init(mtrl_traj *t) {
    memset(t, 0, sizeof *t);
    t->status = MTRL_EP_OPEN;
}

static void tool_call_free_(mtrl_tool_call *c) {
    free(c->name);
    free(c->args);
    free(c->result);
    free(c->error);
    memset(c, 0, sizeof *c);
}

// Clears everything the summary decoder fills, so a failed decode leaves no half summary.
static void summary_clear_(mtrl_traj *t) {
    for (uint32_t i = 0; i < t->n_tools; i++) tool_call_free_(&t->tools[i]);
    t->n_tools = 0;
    t->n_turn_rewards = 0;
    free(t->reason);
    t->reason = NULL;
    t->status = MTRL_EP_OPEN;
    t->reward = 0;
    t->end_wall = 0;
    t->digest = 0;
    for (uint32_t i = 0; i < t->n_images; i++) free(t->images[i].rgb);
    t->n_images = 0;
    t->image_patch = 0;
}

void mtrl_traj_free(mtrl_traj *t) {
    if (!t) return;
    summary_clear_(t);
    free(t->tools);
    free(t->turn_rewards);
    free(t->images);
    free(t->env);
    free(t->ids);
    free(t->logprob);
    free(t->version);
    free(t->kind);
    free(t->routing);
    mtrl_traj_init(t);
}

void mtrl_traj_reset(mtrl_traj *t) {
    summary_clear_(t);
    free(t->env);
    // Keep every array and its capacity: a learner that reuses trajectories then stops paying
    // for first-touch page faults, which dominate streaming a fresh 1M-token episode.
    mtrl_traj saved = *t;
    mtrl_traj_init(t);
    t->ids = saved.ids;
    t->logprob = saved.logprob;
    t->version = saved.version;
    t->kind = saved.kind;
    t->cap_tokens = saved.ids ? saved.cap_tokens : 0;
    t->routing = saved.routing;
    t->cap_routing = saved.cap_routing;
    t->tools = saved.tools;
    t->cap_tools = saved.cap_tools;
    t->turn_rewards = saved.turn_rewards;
    t->cap_turn_rewards = saved.cap_turn_rewards;
    t->images = saved.images;
    t->cap_images = saved.cap_images;
}

void mtrl_traj_swap(mtrl_traj *a, mtrl_traj *b) {
    mtrl_traj tmp = *a;
    *a = *b;
    *b = tmp;
}

void mtrl_traj_set_env(mtrl_traj *t, const char *env) {
    free(t->env);
    t->env = (env && env[0]) ? xstrdup(env) : NULL;
}

void mtrl_traj_set_reason(mtrl_traj *t, const char *fmt, ...) {
    char buf[MTRL_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    free(t->reason);
    t->reason = buf[0] ? xstrdup(buf) : NULL;
}

void mtrl_traj_set_routing(mtrl_traj *t, uint32_t width, int u16) {
    MTRL_CHECKF(t->n_tokens == 0, "routing shape set after %llu tokens", (unsigned long long)t->n_tokens);
    t->routing_width = width;
    // The flag means nothing without routing; clearing it keeps the encoding canonical.
    t->flags = (width && u16) ? MTRL_TRAJ_ROUTING_U16 : 0;
    // The routing buffer (cap_routing bytes) is kept; mtrl_traj_reserve grows it as tokens arrive.
}

uint32_t mtrl_traj_routing_id(const mtrl_traj *t, uint64_t i, uint32_t j) {
    MTRL_CHECK(i < t->n_tokens && j < t->routing_width);
    const uint8_t *row = t->routing + i * mtrl_traj_routing_row_bytes(t);
    return (t->flags & MTRL_TRAJ_ROUTING_U16) ? mtrl_le16(row + 2 * j) : row[j];
}

// ---- tokens ----------------------------------------------------------------------------------

void mtrl_traj_reserve(mtrl_traj *t, uint64_t n) {
    if (n > t->cap_tokens) {
        uint64_t cap = t->cap_tokens ? t->cap_tokens : 256;
        while (cap < n) cap *= 2;
        MTRL_CHECKF(cap <= SIZE_MAX / 8, "trajectory capacity %llu tokens", (unsigned long long)cap);
        t->ids = xrealloc(t->ids, (size_t)cap * sizeof *t->ids);
        t->logprob = xrealloc(t->logprob, (size_t)cap * sizeof *t->logprob);
        t->version = xrealloc(t->version, (size_t)cap * sizeof *t->version);
        t->kind = xrealloc(t->kind, (size_t)cap);
        t->cap_tokens = cap;
    }
    // Routing bytes grow on their own schedule (at most doubling, or to what is needed): a reset
    // keeps the token capacity of an earlier episode, and sizing the routing by that capacity
    // would let a small input of a wider routing shape allocate far more than it holds.
    size_t rb = mtrl_traj_routing_row_bytes(t);
    if (rb) {
        MTRL_CHECKF(n <= SIZE_MAX / rb, "routing of %llu rows", (unsigned long long)n);
        uint64_t need = n * rb;
        if (need > t->cap_routing) {
            uint64_t cap = t->cap_routing ? 2 * t->cap_routing : 256 * (uint64_t)rb;
            if (cap < need) cap = need;
            if (cap > t->cap_tokens * rb) cap = t->cap_tokens * rb;
            t->routing = xrealloc(t->routing, (size_t)cap);
            t->cap_routing = cap;
        }
    }
}

// Keeps n_model and the version range of MODEL tokens current for tokens [from, n_tokens).
static void note_tokens_(mtrl_traj *t, uint64_t from) {
    for (uint64_t i = from; i < t->n_tokens; i++) {
        if (t->kind[i] != MTRL_TOK_MODEL) continue;
        uint32_t v = t->version[i];
        if (t->n_model == 0 || v < t->version_min) t->version_min = v;
        if (t->n_model == 0 || v > t->version_max) t->version_max = v;
        t->n_model++;
    }
}

void mtrl_traj_append(mtrl_traj *t, uint32_t id, float logprob, uint32_t version, uint8_t kind,
                      const uint8_t *routing_row) {
    mtrl_traj_append_n(t, 1, &id, &logprob, &version, &kind, routing_row);
}

void mtrl_traj_append_n(mtrl_traj *t, uint64_t n, const uint32_t *ids, const float *logprob,
                        const uint32_t *version, const uint8_t *kind, const uint8_t *routing) {
    if (n == 0) return;
    for (uint64_t i = 0; i < n; i++) MTRL_CHECKF(kind[i] <= MTRL_TOK_PAD, "token kind %u", kind[i]);
    MTRL_CHECKF(!t->routing_width || routing, "routing width %u but no routing rows", t->routing_width);
    uint64_t at = t->n_tokens;
    mtrl_traj_reserve(t, at + n);
    memcpy(t->ids + at, ids, (size_t)n * 4);
    memcpy(t->logprob + at, logprob, (size_t)n * 4);
    memcpy(t->version + at, version, (size_t)n * 4);
    memcpy(t->kind + at, kind, (size_t)n);
    size_t rb = mtrl_traj_routing_row_bytes(t);
    if (t->routing_width) memcpy(t->routing + at * rb, routing, (size_t)n * rb);
    t->n_tokens = at + n;
    note_tokens_(t, at);
}

void mtrl_traj_add_turn_reward(mtrl_traj *t, double r) {
    if (t->n_turn_rewards == t->cap_turn_rewards) {
        t->cap_turn_rewards = t->cap_turn_rewards ? 2 * t->cap_turn_rewards : 8;
        t->turn_rewards = xrealloc(t->turn_rewards, t->cap_turn_rewards * sizeof *t->turn_rewards);
    }
    t->turn_rewards[t->n_turn_rewards++] = r;
}

static mtrl_tool_call *tool_push_(mtrl_traj *t) {
    if (t->n_tools == t->cap_tools) {
        t->cap_tools = t->cap_tools ? 2 * t->cap_tools : 8;
        t->tools = xrealloc(t->tools, t->cap_tools * sizeof *t->tools);
    }
    mtrl_tool_call *c = &t->tools[t->n_tools++];
    memset(c, 0, sizeof *c);
    return c;
}

static uint8_t *dup_bytes_(const void *p, uint32_t n) {
    if (!n) return NULL;
    uint8_t *q = xmalloc(n);
    memcpy(q, p, n);
    return q;
}

void mtrl_traj_add_tool_call(mtrl_traj *t, uint32_t turn, const char *name, const void *args,
                             uint32_t args_len, const void *result, uint32_t result_len,
                             double latency, int32_t status, const char *error) {
    mtrl_tool_call *c = tool_push_(t);
    c->turn = turn;
    c->status = status;
    c->latency = latency;
    c->name = (name && name[0]) ? xstrdup(name) : NULL;
    c->args = dup_bytes_(args, args_len);
    c->args_len = args_len;
    c->result = dup_bytes_(result, result_len);
    c->result_len = result_len;
    c->error = (error && error[0]) ? xstrdup(error) : NULL;
}

// ---- digest ----------------------------------------------------------------------------------

void mtrl_traj_digest_init(mtrl_traj_digest *d) {
    d->h = MTRL_TRAJ_DIGEST_SEED;
    d->n = 0;
}

void mtrl_traj_digest_update(mtrl_traj_digest *d, const mtrl_traj *t, uint64_t first, uint64_t count) {
    MTRL_CHECK(first <= t->n_tokens && count <= t->n_tokens - first);
    size_t rb = mtrl_traj_routing_row_bytes(t);
    uint64_t h = d->h;
    uint8_t rec[13];
    for (uint64_t i = first; i < first + count; i++) {
        uint32_t lp;
        memcpy(&lp, &t->logprob[i], 4);
        mtrl_st32(rec, t->ids[i]);
        mtrl_st32(rec + 4, lp);
        mtrl_st32(rec + 8, t->version[i]);
        rec[12] = t->kind[i];
        h = mtrl_hash64(rec, sizeof rec, h);
        if (rb) h = mtrl_hash64(t->routing + i * rb, rb, h);
    }
    d->h = h;
    d->n += count;
}

uint64_t mtrl_traj_digest_final(const mtrl_traj_digest *d) {
    uint8_t n[8];
    mtrl_st64(n, d->n);
    return mtrl_hash64(n, 8, d->h);
}

uint64_t mtrl_traj_digest_compute(const mtrl_traj *t) {
    mtrl_traj_digest d;
    mtrl_traj_digest_init(&d);
    mtrl_traj_digest_update(&d, t, 0, t->n_tokens);
    return mtrl_traj_digest_final(&d);
}

// ---- encoders --------------------------------------------------------------------------------

static void prefix_(mtrl_wbuf *out, uint32_t tag, uint16_t flags) {
    mtrl_wbuf_u32(out, tag);
    mtrl_wbuf_u16(out, MTRL_TRAJ_FORMAT);
    mtrl_wbuf_u16(out, flags);
}

void mtrl_traj_header_encode(mtrl_wbuf *out, const mtrl_traj *t) {
    prefix_(out, TAG_HEADER, (uint16_t)(t->flags & MTRL_TRAJ_ROUTING_U16));
    mtrl_wbuf_u64(out, t->episode_id);
    mtrl_wbuf_u64(out, t->group_id);
    mtrl_wbuf_u64(out, t->task_seed);
    mtrl_wbuf_u32(out, t->actor_id);
    mtrl_wbuf_u32(out, t->incarnation);
    mtrl_wbuf_u64(out, t->sample_seed);
    mtrl_wbuf_u64(out, t->sample_stream);
    mtrl_wbuf_u32(out, t->routing_width);
    mtrl_wbuf_f64(out, t->start_wall);
    mtrl_wbuf_str(out, t->env);
}

void mtrl_traj_slice_encode(mtrl_wbuf *out, const mtrl_traj_slice *s) {
    const mtrl_traj *t = s->t;
    MTRL_CHECK(s->first <= t->n_tokens && s->count <= t->n_tokens - s->first);
    uint64_t a = s->first, n = s->count;
    prefix_(out, TAG_SLICE, (uint16_t)(t->flags & MTRL_TRAJ_ROUTING_U16));
    mtrl_wbuf_u64(out, s->offset);
    mtrl_wbuf_u32(out, s->count);
    mtrl_wbuf_u32(out, t->routing_width);
    if (n) { // the arrays are NULL in an episode without tokens
        mtrl_wbuf_bytes(out, t->ids + a, (size_t)n * 4);
        mtrl_wbuf_bytes(out, t->logprob + a, (size_t)n * 4);
        mtrl_wbuf_bytes(out, t->kind + a, (size_t)n);
    }
    // Versions change rarely within an episode (once per weight refresh): run-length code them.
    size_t at_runs = out->len;
    mtrl_wbuf_u32(out, 0);
    uint32_t runs = 0;
    for (uint64_t i = a; i < a + n;) {
        uint64_t j = i + 1;
        while (j < a + n && t->version[j] == t->version[i]) j++;
        mtrl_wbuf_u32(out, (uint32_t)(j - i));
        mtrl_wbuf_u32(out, t->version[i]);
        runs++;
        i = j;
    }
    mtrl_wbuf_put_u32_at(out, at_runs, runs);
    size_t rb = mtrl_traj_routing_row_bytes(t);
    if (rb && n) mtrl_wbuf_bytes(out, t->routing + a * rb, (size_t)n * rb);
}

void mtrl_traj_summary_encode_with(mtrl_wbuf *out, const mtrl_traj *t, uint64_t total_tokens,
                                   uint64_t digest) {
    prefix_(out, TAG_SUMMARY, t->n_images ? MTRL_TRAJ_IMAGES : 0);
    mtrl_wbuf_u64(out, total_tokens);
    mtrl_wbuf_u64(out, digest);
    mtrl_wbuf_u32(out, (uint32_t)t->status);
    mtrl_wbuf_f64(out, t->reward);
    mtrl_wbuf_f64(out, t->end_wall);
    mtrl_wbuf_u32(out, t->n_turn_rewards);
    for (uint32_t i = 0; i < t->n_turn_rewards; i++) mtrl_wbuf_f64(out, t->turn_rewards[i]);
    mtrl_wbuf_str(out, t->reason);
    mtrl_wbuf_u32(out, t->n_tools);
    for (uint32_t i = 0; i < t->n_tools; i++) {
        const mtrl_tool_call *c = &t->tools[i];
        mtrl_wbuf_u32(out, c->turn);
        mtrl_wbuf_u32(out, (uint32_t)c->status);
        mtrl_wbuf_f64(out, c->latency);
        mtrl_wbuf_str(out, c->name);
        mtrl_wbuf_blob(out, c->args, c->args_len);
        mtrl_wbuf_blob(out, c->result, c->result_len);
        mtrl_wbuf_str(out, c->error);
    }
    if (!t->n_images) return;
    mtrl_wbuf_u32(out, t->image_patch);
    mtrl_wbuf_u32(out, t->n_images);
    for (uint32_t i = 0; i < t->n_images; i++) {
        const mtrl_traj_image *im = &t->images[i];
        mtrl_wbuf_u64(out, im->digest);
        mtrl_wbuf_u32(out, im->width);
        mtrl_wbuf_u32(out, im->height);
        mtrl_wbuf_blob(out, im->rgb, 3u * im->width * im->height);
    }
}

void mtrl_traj_summary_encode(mtrl_wbuf *out, const mtrl_traj *t) {
    mtrl_traj_summary_encode_with(out, t, t->n_tokens, mtrl_traj_digest_compute(t));
}

void mtrl_traj_encode(mtrl_wbuf *out, const mtrl_traj *t) {
    MTRL_CHECKF(t->n_tokens <= UINT32_MAX, "episode of %llu tokens", (unsigned long long)t->n_tokens);
    // Reserve the slice's exact size up front: growing a buffer of hundreds of MB by doubling
    // copies it several times into freshly faulted pages.
    uint64_t runs = 0;
    for (uint64_t i = 0; i < t->n_tokens; i++) runs += (i == 0 || t->version[i] != t->version[i - 1]);
    mtrl_wbuf_reserve(out, 256 + (t->env ? strlen(t->env) : 0) + 28 + (size_t)t->n_tokens * (9 + mtrl_traj_routing_row_bytes(t)) +
                               (size_t)runs * 8);
    prefix_(out, TAG_EPISODE, 0);
    mtrl_traj_header_encode(out, t);
    mtrl_traj_slice s = mtrl_traj_slice_of(t, 0, (uint32_t)t->n_tokens);
    mtrl_traj_slice_encode(out, &s);
    mtrl_traj_summary_encode(out, t);
}

// ---- decoders --------------------------------------------------------------------------------

// Tag, format and flags; returns the flags (only the bits in `allowed` may be set).
static uint16_t read_prefix_(mtrl_rbuf *r, uint32_t tag, const char *tag_name, uint16_t allowed) {
    size_t at = r->pos;
    uint32_t got = mtrl_rbuf_u32(r, "tag");
    uint16_t fmt = mtrl_rbuf_u16(r, "format");
    uint16_t flags = mtrl_rbuf_u16(r, "flags");
    if (r->status) return 0;
    if (got != tag) {
        mtrl_rbuf_fail_at(r, at, MTRL_ERR_FORMAT, "tag: expected \"%s\", got 0x%08x", tag_name, got);
        return 0;
    }
    if (fmt != MTRL_TRAJ_FORMAT) {
        mtrl_rbuf_fail_at(r, at + 4, MTRL_ERR_FORMAT,
                          "format: version %u; this build reads version %u", fmt, MTRL_TRAJ_FORMAT);
        return 0;
    }
    if (flags & ~allowed) {
        mtrl_rbuf_fail_at(r, at + 6, MTRL_ERR_FORMAT, "flags: unknown bits 0x%04x", flags & ~allowed);
        return 0;
    }
    return flags;
}

static mtrl_status header_read_(mtrl_rbuf *r, mtrl_traj *t, const mtrl_traj_limits *lim) {
    uint16_t flags = read_prefix_(r, TAG_HEADER, "TBEG", MTRL_TRAJ_ROUTING_U16);
    t->episode_id = mtrl_rbuf_u64(r, "episode_id");
    t->group_id = mtrl_rbuf_u64(r, "group_id");
    t->task_seed = mtrl_rbuf_u64(r, "task_seed");
    t->actor_id = mtrl_rbuf_u32(r, "actor_id");
    t->incarnation = mtrl_rbuf_u32(r, "incarnation");
    t->sample_seed = mtrl_rbuf_u64(r, "sample_seed");
    t->sample_stream = mtrl_rbuf_u64(r, "sample_stream");
    size_t at_width = r->pos;
    uint32_t width = mtrl_rbuf_u32(r, "routing_width");
    t->start_wall = mtrl_rbuf_f64(r, "start_wall");
    if (r->status) return r->status;
    if (width > lim->max_routing_width)
        return mtrl_rbuf_fail_at(r, at_width, MTRL_ERR_LIMIT, "routing_width: %u over max_routing_width=%u",
                                 width, lim->max_routing_width);
    if (width == 0 && flags)
        return mtrl_rbuf_fail(r, MTRL_ERR_FORMAT, "flags: 2-byte routing ids but routing_width is 0");
    mtrl_traj_set_routing(t, width, flags & MTRL_TRAJ_ROUTING_U16);
    char *env = NULL;
    if (mtrl_rbuf_str(r, lim->max_string, "env", &env)) return r->status;
    free(t->env);
    t->env = env;
    return MTRL_OK;
}

static mtrl_status trailing_(mtrl_rbuf *r) {
    if (r->status) return r->status;
    if (mtrl_rbuf_left(r))
        return mtrl_rbuf_fail(r, MTRL_ERR_FORMAT, "%zu unexpected bytes after the end", mtrl_rbuf_left(r));
    return MTRL_OK;
}

mtrl_status mtrl_traj_header_decode(mtrl_traj *t, const void *buf, size_t n,
                                    const mtrl_traj_limits *lim, mtrl_error *err) {
    mtrl_rbuf r;
    mtrl_rbuf_init(&r, buf, n, "episode header", err);
    mtrl_traj_reset(t);
    if (header_read_(&r, t, lim) || trailing_(&r)) {
        mtrl_traj_reset(t);
        return r.status;
    }
    return MTRL_OK;
}

// Fixed slice fields.
static void slice_info_read_(mtrl_rbuf *r, mtrl_traj_slice_info *info) {
    info->flags = read_prefix_(r, TAG_SLICE, "TCHK", MTRL_TRAJ_ROUTING_U16);
    info->offset = mtrl_rbuf_u64(r, "offset");
    info->count = mtrl_rbuf_u32(r, "count");
    info->routing_width = mtrl_rbuf_u32(r, "routing_width");
}

mtrl_status mtrl_traj_slice_peek(const void *buf, size_t n, mtrl_traj_slice_info *info, mtrl_error *err) {
    mtrl_rbuf r;
    mtrl_rbuf_init(&r, buf, n, "token slice", err);
    memset(info, 0, sizeof *info);
    slice_info_read_(&r, info);
    return r.status;
}

// Validates a slice of at most max_count tokens and appends it to t; t changes only on success.
static mtrl_status slice_read_(mtrl_rbuf *r, mtrl_traj *t, uint64_t expect_offset, uint64_t max_count,
                               const char *max_name, const mtrl_traj_limits *lim, uint64_t *offset) {
    size_t at0 = r->pos;
    mtrl_traj_slice_info s;
    slice_info_read_(r, &s);
    if (r->status) return r->status;
    if (offset) *offset = s.offset;
    if (s.routing_width > lim->max_routing_width)
        return mtrl_rbuf_fail_at(r, at0 + 20, MTRL_ERR_LIMIT, "routing_width: %u over max_routing_width=%u",
                                 s.routing_width, lim->max_routing_width);
    if (s.routing_width != t->routing_width || s.flags != (t->flags & MTRL_TRAJ_ROUTING_U16))
        return mtrl_rbuf_fail_at(r, at0 + 20, MTRL_ERR_FORMAT,
                                 "routing_width: slice has %u ids of %u bytes, the episode header says %u of %u",
                                 s.routing_width, (s.flags & MTRL_TRAJ_ROUTING_U16) ? 2u : 1u,
                                 t->routing_width, mtrl_traj_routing_id_bytes(t));
    if (expect_offset != UINT64_MAX && s.offset != expect_offset)
        return mtrl_rbuf_fail_at(r, at0 + 8, MTRL_ERR_FORMAT, "offset: slice starts at token %llu, expected %llu",
                                 (unsigned long long)s.offset, (unsigned long long)expect_offset);
    if (s.count > max_count)
        return mtrl_rbuf_fail_at(r, at0 + 16, MTRL_ERR_LIMIT, "count: %u tokens over %s=%llu", s.count,
                                 max_name, (unsigned long long)max_count);
    if (t->n_tokens > lim->max_tokens || s.count > lim->max_tokens - t->n_tokens)
        return mtrl_rbuf_fail_at(r, at0 + 16, MTRL_ERR_LIMIT,
                                 "count: %u more tokens would make the episode %llu tokens, over max_tokens=%llu",
                                 s.count, (unsigned long long)(t->n_tokens + s.count),
                                 (unsigned long long)lim->max_tokens);
    uint64_t n = s.count;
    const uint8_t *ids = mtrl_rbuf_take(r, n * 4, "ids");
    const uint8_t *lp = mtrl_rbuf_take(r, n * 4, "logprob");
    size_t at_kind = r->pos;
    const uint8_t *kind = mtrl_rbuf_take(r, n, "kind");
    if (r->status) return r->status;
    for (uint64_t i = 0; i < n; i++)
        if (kind[i] > MTRL_TOK_PAD)
            return mtrl_rbuf_fail_at(r, at_kind + (size_t)i, MTRL_ERR_FORMAT, "kind[%llu]: %u is not a token kind",
                                     (unsigned long long)i, kind[i]);
    size_t at_runs = r->pos;
    uint32_t n_runs = mtrl_rbuf_u32(r, "version runs");
    if (r->status) return r->status;
    if (n_runs > n || (n > 0 && n_runs == 0))
        return mtrl_rbuf_fail_at(r, at_runs, MTRL_ERR_FORMAT, "version runs: %u runs for %llu tokens", n_runs,
                                 (unsigned long long)n);
    const uint8_t *runs = mtrl_rbuf_take(r, (uint64_t)n_runs * 8, "version runs");
    if (r->status) return r->status;
    uint64_t sum = 0;
    for (uint32_t k = 0; k < n_runs; k++) {
        uint32_t len = mtrl_le32(runs + 8 * k), v = mtrl_le32(runs + 8 * k + 4);
        size_t at = at_runs + 4 + 8 * (size_t)k;
        if (len == 0) return mtrl_rbuf_fail_at(r, at, MTRL_ERR_FORMAT, "version run %u: length 0", k);
        if (k > 0 && v == mtrl_le32(runs + 8 * (k - 1) + 4))
            return mtrl_rbuf_fail_at(r, at, MTRL_ERR_FORMAT,
                                     "version run %u: same version %u as the run before (not canonical)", k, v);
        sum += len;
        if (sum > n)
            return mtrl_rbuf_fail_at(r, at, MTRL_ERR_FORMAT, "version runs: cover more than %llu tokens",
                                     (unsigned long long)n);
    }
    if (sum != n)
        return mtrl_rbuf_fail_at(r, at_runs, MTRL_ERR_FORMAT, "version runs: cover %llu of %llu tokens",
                                 (unsigned long long)sum, (unsigned long long)n);
    size_t rb = mtrl_traj_routing_row_bytes(t);
    const uint8_t *routing = mtrl_rbuf_take(r, n * rb, "routing");
    if (r->status) return r->status;

    // Everything checked: now append.
    uint64_t at = t->n_tokens;
    mtrl_traj_reserve(t, at + n);
    if (n) {
        memcpy(t->ids + at, ids, (size_t)n * 4);
        memcpy(t->logprob + at, lp, (size_t)n * 4);
        memcpy(t->kind + at, kind, (size_t)n);
        if (rb) memcpy(t->routing + at * rb, routing, (size_t)n * rb);
    }
    uint64_t i = at;
    for (uint32_t k = 0; k < n_runs; k++) {
        uint32_t len = mtrl_le32(runs + 8 * k), v = mtrl_le32(runs + 8 * k + 4);
        for (uint32_t j = 0; j < len; j++) t->version[i++] = v;
    }
    t->n_tokens = at + n;
    note_tokens_(t, at);
    return MTRL_OK;
}

mtrl_status mtrl_traj_slice_decode(mtrl_traj *t, const void *buf, size_t n, uint64_t expect_offset,
                                   const mtrl_traj_limits *lim, uint64_t *offset, mtrl_error *err) {
    mtrl_rbuf r;
    mtrl_rbuf_init(&r, buf, n, "token slice", err);
    uint64_t before = t->n_tokens, model = t->n_model;
    uint32_t vmin = t->version_min, vmax = t->version_max;
    if (slice_read_(&r, t, expect_offset, lim->max_chunk_tokens, "max_chunk_tokens", lim, offset)) return r.status;
    if (trailing_(&r)) {
        // Trailing junk is found after the append; undo it so t is unchanged on failure.
        t->n_tokens = before;
        t->n_model = model;
        t->version_min = vmin;
        t->version_max = vmax;
        return r.status;
    }
    return MTRL_OK;
}

// The summary's image section (traj.h): every size checked before its bytes are taken, every
// digest against its bytes, no picture twice.
static mtrl_status images_read_(mtrl_rbuf *r, mtrl_traj *t, const mtrl_traj_limits *lim) {
    size_t at_p = r->pos;
    uint32_t P = mtrl_rbuf_u32(r, "image_patch");
    size_t at_n = r->pos;
    uint32_t n = mtrl_rbuf_u32(r, "n_images");
    if (r->status) return r->status;
    if (P < 1 || P > 64) return mtrl_rbuf_fail_at(r, at_p, MTRL_ERR_FORMAT, "image_patch: %u is not 1..64", P);
    if (n < 1) return mtrl_rbuf_fail_at(r, at_n, MTRL_ERR_FORMAT, "n_images: 0 with the image flag set");
    if (n > lim->max_images)
        return mtrl_rbuf_fail_at(r, at_n, MTRL_ERR_LIMIT, "n_images: %u over max_images=%u", n, lim->max_images);
    if (!mtrl_rbuf_need(r, (uint64_t)n * 20, "images")) return r->status;
    t->images = xrealloc(t->images, (size_t)n * sizeof *t->images);
    t->cap_images = n;
    t->image_patch = P;
    uint32_t first = 0;
    for (uint32_t i = 0; i < n; i++) {
        mtrl_traj_image *im = &t->images[i];
        memset(im, 0, sizeof *im);
        im->digest = mtrl_rbuf_u64(r, "image.digest");
        size_t at_w = r->pos;
        im->width = mtrl_rbuf_u32(r, "image.width");
        im->height = mtrl_rbuf_u32(r, "image.height");
        if (r->status) return r->status;
        if (im->width < 1 || im->height < 1 || im->width > 4096 || im->height > 4096)
            return mtrl_rbuf_fail_at(r, at_w, MTRL_ERR_FORMAT, "image %u: %u x %u pixels (each side 1..4096)", i,
                                     im->width, im->height);
        uint64_t want = 3ull * im->width * im->height;
        if (want > lim->max_image_bytes)
            return mtrl_rbuf_fail_at(r, at_w, MTRL_ERR_LIMIT, "image %u: %llu bytes over max_image_bytes=%u", i,
                                     (unsigned long long)want, lim->max_image_bytes);
        size_t at_b = r->pos;
        uint32_t len = 0;
        t->n_images = i + 1; // so a failure below frees what this picture already holds
        if (mtrl_rbuf_blob(r, lim->max_image_bytes, "image.rgb", &im->rgb, &len)) return r->status;
        if (len != want)
            return mtrl_rbuf_fail_at(r, at_b, MTRL_ERR_FORMAT, "image %u: %u bytes for %u x %u RGB8 pixels (%llu)", i,
                                     len, im->width, im->height, (unsigned long long)want);
        if (mtrl_hash64(im->rgb, len, MTRL_TRAJ_IMAGE_SEED) != im->digest)
            return mtrl_rbuf_fail_at(r, at_b, MTRL_ERR_FORMAT, "image %u: digest mismatch", i);
        for (uint32_t j = 0; j < i; j++)
            if (t->images[j].digest == im->digest)
                return mtrl_rbuf_fail_at(r, at_b, MTRL_ERR_FORMAT, "image %u: the same picture as image %u", i, j);
        im->first_patch = first;
        first += (uint32_t)mtrl_image_patch_count(im->width, im->height, (int)P);
    }
    return MTRL_OK;
}

static mtrl_status summary_read_(mtrl_rbuf *r, mtrl_traj *t, const mtrl_traj_limits *lim,
                                 uint64_t *total, uint64_t *digest) {
    summary_clear_(t);
    uint16_t flags = read_prefix_(r, TAG_SUMMARY, "TEND", MTRL_TRAJ_IMAGES);
    *total = mtrl_rbuf_u64(r, "total_tokens");
    *digest = mtrl_rbuf_u64(r, "digest");
    size_t at_status = r->pos;
    uint32_t status = mtrl_rbuf_u32(r, "status");
    t->reward = mtrl_rbuf_f64(r, "reward");
    t->end_wall = mtrl_rbuf_f64(r, "end_wall");
    size_t at_turns = r->pos;
    uint32_t n_turns = mtrl_rbuf_u32(r, "n_turn_rewards");
    if (r->status) return r->status;
    if (status < MTRL_EP_COMPLETE || status > MTRL_EP_REJECTED)
        return mtrl_rbuf_fail_at(r, at_status, MTRL_ERR_FORMAT, "status: %u is not a final episode status", status);
    if (n_turns > lim->max_turns)
        return mtrl_rbuf_fail_at(r, at_turns, MTRL_ERR_LIMIT, "n_turn_rewards: %u over max_turns=%u", n_turns,
                                 lim->max_turns);
    const uint8_t *tr = mtrl_rbuf_take(r, (uint64_t)n_turns * 8, "turn_rewards");
    if (r->status) return r->status;
    if (n_turns > t->cap_turn_rewards) {
        t->turn_rewards = xrealloc(t->turn_rewards, (size_t)n_turns * sizeof *t->turn_rewards);
        t->cap_turn_rewards = n_turns;
    }
    for (uint32_t i = 0; i < n_turns; i++) {
        uint64_t u = mtrl_le64(tr + 8 * (size_t)i);
        memcpy(&t->turn_rewards[i], &u, 8);
    }
    t->n_turn_rewards = n_turns;
    if (mtrl_rbuf_str(r, lim->max_string, "reason", &t->reason)) return r->status;
    size_t at_tools = r->pos;
    uint32_t n_tools = mtrl_rbuf_u32(r, "n_tools");
    if (r->status) return r->status;
    if (n_tools > lim->max_tool_calls)
        return mtrl_rbuf_fail_at(r, at_tools, MTRL_ERR_LIMIT, "n_tools: %u over max_tool_calls=%u", n_tools,
                                 lim->max_tool_calls);
    // Each call takes at least TOOL_MIN_BYTES: refuse a count the input cannot hold before
    // allocating the table.
    if (!mtrl_rbuf_need(r, (uint64_t)n_tools * TOOL_MIN_BYTES, "tools")) return r->status;
    if (n_tools > t->cap_tools) {
        t->tools = xrealloc(t->tools, (size_t)n_tools * sizeof *t->tools);
        t->cap_tools = n_tools;
    }
    for (uint32_t i = 0; i < n_tools; i++) {
        mtrl_tool_call *c = &t->tools[i];
        memset(c, 0, sizeof *c);
        t->n_tools = i + 1; // so a failure below frees what this call already holds
        c->turn = mtrl_rbuf_u32(r, "tool.turn");
        c->status = (int32_t)mtrl_rbuf_u32(r, "tool.status");
        c->latency = mtrl_rbuf_f64(r, "tool.latency");
        if (mtrl_rbuf_str(r, lim->max_string, "tool.name", &c->name)) return r->status;
        if (mtrl_rbuf_blob(r, lim->max_tool_bytes, "tool.args", &c->args, &c->args_len)) return r->status;
        if (mtrl_rbuf_blob(r, lim->max_tool_bytes, "tool.result", &c->result, &c->result_len)) return r->status;
        if (mtrl_rbuf_str(r, lim->max_string, "tool.error", &c->error)) return r->status;
    }
    if ((flags & MTRL_TRAJ_IMAGES) && images_read_(r, t, lim)) return r->status;
    t->status = (mtrl_ep_status)status;
    t->digest = *digest;
    return MTRL_OK;
}

mtrl_status mtrl_traj_summary_decode(mtrl_traj *t, const void *buf, size_t n,
                                     const mtrl_traj_limits *lim, uint64_t *total_tokens,
                                     uint64_t *digest, mtrl_error *err) {
    mtrl_rbuf r;
    mtrl_rbuf_init(&r, buf, n, "episode summary", err);
    uint64_t tot = 0, dig = 0;
    if (summary_read_(&r, t, lim, &tot, &dig) || trailing_(&r)) {
        summary_clear_(t);
        return r.status;
    }
    if (total_tokens) *total_tokens = tot;
    if (digest) *digest = dig;
    return MTRL_OK;
}

mtrl_status mtrl_traj_decode(mtrl_traj *t, const void *buf, size_t n, const mtrl_traj_limits *lim,
                             mtrl_error *err) {
    mtrl_rbuf r;
    mtrl_rbuf_init(&r, buf, n, "episode record", err);
    mtrl_traj_reset(t);
    uint64_t total = 0, digest = 0;
    read_prefix_(&r, TAG_EPISODE, "TRAJ", 0);
    if (r.status) goto fail;
    r.what = "episode record (header)";
    if (header_read_(&r, t, lim)) goto fail;
    r.what = "episode record (token slice)";
    if (slice_read_(&r, t, 0, lim->max_tokens, "max_tokens", lim, NULL)) goto fail;
    r.what = "episode record (summary)";
    size_t at_summary = r.pos;
    if (summary_read_(&r, t, lim, &total, &digest)) goto fail;
    r.what = "episode record";
    if (trailing_(&r)) goto fail;
    if (total != t->n_tokens) {
        mtrl_rbuf_fail_at(&r, at_summary + 8, MTRL_ERR_FORMAT, "summary says %llu tokens, the record holds %llu",
                          (unsigned long long)total, (unsigned long long)t->n_tokens);
        goto fail;
    }
    uint64_t got = mtrl_traj_digest_compute(t);
    if (got != digest) {
        mtrl_rbuf_fail_at(&r, at_summary + 16, MTRL_ERR_FORMAT,
                          "digest mismatch: summary says %016llx, the tokens hash to %016llx",
                          (unsigned long long)digest, (unsigned long long)got);
        goto fail;
    }
    mtrl_status ist = mtrl_traj_images_check(t, err);
    if (ist != MTRL_OK) {
        mtrl_traj_reset(t);
        return ist;
    }
    return MTRL_OK;
fail:
    mtrl_traj_reset(t);
    return r.status;
}

// ---- comparison ------------------------------------------------------------------------------

static int str_eq_(const char *a, const char *b) { return strcmp(a ? a : "", b ? b : "") == 0; }
static int f64_eq_(double a, double b) { return memcmp(&a, &b, sizeof a) == 0; }

#define DIFF_(...) do { if (why && why_cap) snprintf(why, why_cap, __VA_ARGS__); return 0; } while (0)

int mtrl_traj_equal(const mtrl_traj *a, const mtrl_traj *b, char *why, size_t why_cap) {
    if (a->episode_id != b->episode_id) DIFF_("episode_id differs");
    if (a->group_id != b->group_id) DIFF_("group_id differs");
    if (a->task_seed != b->task_seed) DIFF_("task_seed differs");
    if (!str_eq_(a->env, b->env)) DIFF_("env differs");
    if (a->actor_id != b->actor_id || a->incarnation != b->incarnation) DIFF_("actor differs");
    if (a->sample_seed != b->sample_seed || a->sample_stream != b->sample_stream) DIFF_("sample seed differs");
    if (a->routing_width != b->routing_width || a->flags != b->flags) DIFF_("routing shape differs");
    if (!f64_eq_(a->start_wall, b->start_wall)) DIFF_("start_wall differs");
    if (a->n_tokens != b->n_tokens)
        DIFF_("n_tokens differs: %llu vs %llu", (unsigned long long)a->n_tokens, (unsigned long long)b->n_tokens);
    size_t rb = mtrl_traj_routing_row_bytes(a);
    for (uint64_t i = 0; i < a->n_tokens; i++) {
        if (a->ids[i] != b->ids[i]) DIFF_("tokens[%llu].id differs", (unsigned long long)i);
        if (memcmp(&a->logprob[i], &b->logprob[i], 4)) DIFF_("tokens[%llu].logprob differs", (unsigned long long)i);
        if (a->version[i] != b->version[i]) DIFF_("tokens[%llu].version differs", (unsigned long long)i);
        if (a->kind[i] != b->kind[i]) DIFF_("tokens[%llu].kind differs", (unsigned long long)i);
        if (rb && memcmp(a->routing + i * rb, b->routing + i * rb, rb))
            DIFF_("tokens[%llu].routing differs", (unsigned long long)i);
    }
    if (a->status != b->status) DIFF_("status differs: %s vs %s", mtrl_ep_status_name(a->status),
                                      mtrl_ep_status_name(b->status));
    if (!str_eq_(a->reason, b->reason)) DIFF_("reason differs");
    if (!f64_eq_(a->reward, b->reward)) DIFF_("reward differs");
    if (!f64_eq_(a->end_wall, b->end_wall)) DIFF_("end_wall differs");
    if (a->n_turn_rewards != b->n_turn_rewards) DIFF_("n_turn_rewards differs");
    for (uint32_t i = 0; i < a->n_turn_rewards; i++)
        if (!f64_eq_(a->turn_rewards[i], b->turn_rewards[i])) DIFF_("turn_rewards[%u] differs", i);
    if (a->n_tools != b->n_tools) DIFF_("n_tools differs: %u vs %u", a->n_tools, b->n_tools);
    for (uint32_t i = 0; i < a->n_tools; i++) {
        const mtrl_tool_call *x = &a->tools[i], *y = &b->tools[i];
        if (x->turn != y->turn || x->status != y->status || !f64_eq_(x->latency, y->latency))
            DIFF_("tools[%u] turn/status/latency differs", i);
        if (!str_eq_(x->name, y->name) || !str_eq_(x->error, y->error)) DIFF_("tools[%u] name/error differs", i);
        if (x->args_len != y->args_len || (x->args_len && memcmp(x->args, y->args, x->args_len)))
            DIFF_("tools[%u].args differs", i);
        if (x->result_len != y->result_len || (x->result_len && memcmp(x->result, y->result, x->result_len)))
            DIFF_("tools[%u].result differs", i);
    }
    if (a->n_images != b->n_images || (a->n_images && a->image_patch != b->image_patch))
        DIFF_("pictures differ: %u vs %u", a->n_images, b->n_images);
    for (uint32_t i = 0; i < a->n_images; i++)
        if (a->images[i].digest != b->images[i].digest || a->images[i].width != b->images[i].width ||
            a->images[i].height != b->images[i].height ||
            memcmp(a->images[i].rgb, b->images[i].rgb, 3u * a->images[i].width * a->images[i].height))
            DIFF_("images[%u] differs", i);
    if (why && why_cap) why[0] = '\0';
    return 1;
}
