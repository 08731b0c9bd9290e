// actor.c: the actor process (see actor.h).
#include "actor/actor.h"
#include "model/qb.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <omp.h>
#include <zmq.h>

#include "actor/rollout.h"
#include "common/check.h"
#include "common/checkpoint.h"
#include "common/fsutil.h"
#include "common/log.h"
#include "model/model_wshm.h"
#include "common/timeutil.h"
#include "common/tokenizer.h"
#include "common/weights_shm.h"
#include "common/wire/wire.h"
#include "common/wire/wire_auth.h"
#include "common/wire/wire_monitor.h"
#include "env/env_host.h"

#define HELLO_PATIENCE_S 120.0

typedef struct stream {
    uint64_t episode_id;
    uint64_t sent;     // tokens sent in CHUNKs
    uint32_t seq;      // CHUNKs sent
} stream;

typedef struct outmsg {
    mtrl_wire_out o;
} outmsg;

typedef struct actor {
    uint32_t id, incarnation;
    int gpu;               // --gpu N (-1: the experiment's choice)
    void *zctx;
    mtrl_wire_sock sock;
    mtrl_wire_monitor mon;
    int resync;            // waiting for the WELCOME that answers a resynchronising HELLO
    mtrl_wire_limits lim;
    mtrl_wire_stats rx;
    mtrl_config cfg;
    int have_cfg;
    uint64_t run_id;
    uint64_t config_hash;
    mtrl_model model;
    int have_model, have_weights;
    mtrl_rollout *ro;
    int64_t credit;
    int64_t credit_full;   // the credit of the last WELCOME: nothing is in flight when credit >= it
    int64_t credit_welcome; // what the last WELCOME granted (credit_welcome_)
    int hello_open;        // a HELLO is out and its WELCOME has not come yet
    // weights being received
    uint8_t *wbuf;
    uint64_t wlen, wgot;
    uint32_t wversion, wcount, wseen;
    // the same-host weight channel (WEIGHTS_AT): the announcement still to copy out
    mtrl_wshm *wch;
    mtrl_wshm_layout wlay;
    mtrl_model_wshm_dev *wdev;  // its device slots (CUDA IPC)
    int wpending, wslot;
    uint32_t wat_version;
    // episode streams and the outbox
    stream *streams;
    int n_streams, cap_streams;
    outmsg *out;
    int n_out, cap_out, out_head;
    double last_heard, last_sent, last_qb;
    double learner_heard;  // the last message from the learner (last_heard is also reset to pace HELLOs)
    // snapshots of long episodes in flight ([actor] snapshot_dir): per slot, the episode whose
    // snapshot file exists and its length then
    uint64_t *snap_ep, *snap_at;
    int n_snap;
    int bye;
    char unusable[400];    // why this experiment cannot run here (bye = 3): sent to the learner before the BYE
    long episodes_done;
    int out_peak;          // the most messages the outbox held (backpressure: see the main loop)
    uint64_t out_peak_bytes;
    // the time split since the last ACTOR_STATS (send_actor_stats_): the rollout's parts, the
    // socket polls of the main loop, and when the interval began
    mtrl_rollout_times times;
    double wait_s, last_stats;
} actor;

// ---- outbox under credit -----------------------------------------------------------------------------------

static mtrl_wire_out *queue_(actor *a) {
    if (a->n_out == a->cap_out) {
        if (a->out_head > 0) {
            memmove(a->out, a->out + a->out_head, sizeof *a->out * (size_t)(a->n_out - a->out_head));
            a->n_out -= a->out_head;
            a->out_head = 0;
        }
        if (a->n_out == a->cap_out) {
            a->cap_out = a->cap_out ? 2 * a->cap_out : 64;
            a->out = xrealloc(a->out, sizeof *a->out * (size_t)a->cap_out);
        }
    }
    mtrl_wire_out *o = &a->out[a->n_out++].o;
    mtrl_wire_out_init(o);
    return o;
}

static int send_now_(actor *a, mtrl_wire_out *o) {
    mtrl_error err;
    if (mtrl_wire_send(&a->sock, NULL, o, &err) != MTRL_OK) {
        LOG_WARN("send failed: %s", err.msg);
        return 0;
    }
    a->last_sent = mtrl_time_mono();
    return 1;
}

// Sends queued episode messages while the credit lasts.
static void flush_(actor *a) {
    while (a->out_head < a->n_out) {
        mtrl_wire_out *o = &a->out[a->out_head].o;
        int64_t cost = (int64_t)(o->payload.len + MTRL_WIRE_HDR_SIZE);
        // A message larger than the whole credit goes alone, when nothing else is in flight;
        // otherwise a small credit and a large chunk would wait for each other forever.
        // No credit at all (the learner's warm-up) means wait.
        if (cost > a->credit && !(a->credit_full > 0 && cost > a->credit_full && a->credit >= a->credit_full)) break;
        if (!send_now_(a, o)) break;
        a->credit -= cost;
        mtrl_wire_out_free(o);
        a->out_head++;
    }
    if (a->out_head == a->n_out) a->out_head = a->n_out = 0;
}

static int outbox_len_(const actor *a) { return a->n_out - a->out_head; }

// Records the outbox's high-water mark (printed when the actor leaves).
static void outbox_note_peak_(actor *a) {
    if (outbox_len_(a) <= a->out_peak) return;
    a->out_peak = outbox_len_(a);
    uint64_t b = 0;
    for (int i = a->out_head; i < a->n_out; i++) b += a->out[i].o.payload.len + MTRL_WIRE_HDR_SIZE;
    if (b > a->out_peak_bytes) a->out_peak_bytes = b;
}

// Drops everything queued and every open stream: what they belong to will not reach the learner.
static void outbox_clear_(actor *a) {
    for (int i = a->out_head; i < a->n_out; i++) mtrl_wire_out_free(&a->out[i].o);
    a->out_head = a->n_out = 0;
    a->n_streams = 0;
}

// ---- episode streams ---------------------------------------------------------------------------------------

static stream *stream_find_(actor *a, uint64_t id) {
    for (int i = 0; i < a->n_streams; i++)
        if (a->streams[i].episode_id == id) return &a->streams[i];
    return NULL;
}

static void queue_chunks_(actor *a, stream *s, const mtrl_traj *t, int final) {
    uint64_t chunk = (uint64_t)a->cfg.actor.chunk_tokens;
    while (t->n_tokens - s->sent >= chunk || (final && t->n_tokens > s->sent)) {
        uint64_t n = t->n_tokens - s->sent < chunk ? t->n_tokens - s->sent : chunk;
        mtrl_wire_encode_chunk(queue_(a), t, s->seq++, s->sent, (uint32_t)n);
        s->sent += n;
    }
}

static void on_begin_(void *u, mtrl_traj *t) {
    actor *a = u;
    if (a->n_streams == a->cap_streams) {
        a->cap_streams = a->cap_streams ? 2 * a->cap_streams : 64;
        a->streams = xrealloc(a->streams, sizeof *a->streams * (size_t)a->cap_streams);
    }
    a->streams[a->n_streams++] = (stream){t->episode_id, 0, 0};
    mtrl_wire_encode_begin(queue_(a), t);
}

static void on_end_(void *u, mtrl_traj *t) {
    actor *a = u;
    stream *s = stream_find_(a, t->episode_id);
    if (!s) return;
    queue_chunks_(a, s, t, 1);
    mtrl_wire_encode_end(queue_(a), t, s->seq);
    *s = a->streams[--a->n_streams];
    a->episodes_done++;
}

// A heartbeat when nothing was sent for a heartbeat period: the learner declares an actor dead
// after heartbeat_timeout_ms of silence.
static void heartbeat_(actor *a, double now) {
    double hb = 1e-3 * (double)(a->have_cfg ? a->cfg.actor.heartbeat_ms : 1000);
    if (now - a->last_sent <= hb) return;
    mtrl_wire_out o;
    mtrl_wire_out_init(&o);
    mtrl_wire_encode_heartbeat(&o);
    send_now_(a, &o);
    mtrl_wire_out_free(&o);
}

// Between the rounds of a long prefill (a 1M-token document is minutes of prefill on a CPU and
// ~20 s on a GPU): only the heartbeat; the socket is not read, so nothing changes the rollout.
static void on_tick_(void *u) {
    actor *a = u;
    heartbeat_(a, mtrl_time_mono());
}

// ---- snapshots of long episodes ([actor] snapshot_dir) --------------------------------------------------------
//
// Every episode in flight is written to <dir>/a<actor>.s<slot>.snap (atomically: temp + rename)
// each time it grows by snapshot_tokens; the file goes when the episode ends. A restarted actor
// resumes every snapshot of its id into a free slot (decode state, tokens, RNG position, env
// replayed) under a fresh episode id and streams it again from its first token: a 1M-token
// episode costs the tokens since its last snapshot, not all of them.

// The run id is in the name: a snapshot left by a killed actor of another run is never resumed.
static void snap_path_(const actor *a, int slot, char *buf, size_t cap) {
    snprintf(buf, cap, "%s/a%u.r%llu.s%d.snap", a->cfg.actor.snapshot_dir, a->id, (unsigned long long)a->run_id, slot);
}

static int snap_file_write_(const char *path, const mtrl_wbuf *b) {
    char tmp[1200];
    FILE *f = mtrl_file_atomic_begin(path, tmp, sizeof tmp);
    if (!f) return -1;
    return mtrl_file_atomic_end(f, tmp, path, fwrite(b->data, 1, b->len, f) != b->len) ? -1 : 0;
}

static void snap_write_(actor *a, int i, const mtrl_traj *t) {
    mtrl_wbuf b;
    mtrl_wbuf_init(&b);
    mtrl_error err;
    char path[1100];
    snap_path_(a, i, path, sizeof path);
    if (mtrl_rollout_snapshot(a->ro, i, &b, &err) != MTRL_OK) LOG_WARN("snapshot of slot %d: %s", i, err.msg);
    else if (snap_file_write_(path, &b) != 0) LOG_WARN("snapshot %s: %s", path, strerror(errno));
    else {
        a->snap_ep[i] = t->episode_id;
        a->snap_at[i] = t->n_tokens;
    }
    mtrl_wbuf_free(&b);
}

static void snap_remove_(actor *a, int i) {
    char path[1100];
    snap_path_(a, i, path, sizeof path);
    unlink(path);
    a->snap_ep[i] = a->snap_at[i] = 0;
}

// After a generation step: new snapshots where episodes grew enough; old ones of finished episodes go.
static void snapshots_(actor *a) {
    if (!a->cfg.actor.snapshot_dir[0] || !a->ro) return;
    for (int i = 0; i < a->n_snap; i++) {
        mtrl_traj *t = mtrl_rollout_slot(a->ro, i);
        if (a->snap_ep[i] && (!t || t->episode_id != a->snap_ep[i])) snap_remove_(a, i);
        if (t && t->n_tokens >= a->snap_at[i] + (uint64_t)a->cfg.actor.snapshot_tokens) snap_write_(a, i, t);
    }
}

static void on_begin_(void *u, mtrl_traj *t);

// At start: resumes the snapshots an earlier process of this actor id left in this run.
static void snapshots_resume_(actor *a) {
    const char *dir = a->cfg.actor.snapshot_dir;
    if (!dir[0]) return;
    if (mtrl_mkdir_p(dir) != 0) {
        LOG_WARN("[actor] snapshot_dir %s: %s; no snapshots", dir, strerror(errno));
        return;
    }
    // Read them all first: resuming into slot k rewrites slot k's file.
    int n = a->n_snap, got = 0;
    mtrl_wbuf *bufs = xcalloc((size_t)n, sizeof *bufs);
    for (int i = 0; i < n; i++) {
        char path[1100];
        snap_path_(a, i, path, sizeof path);
        mtrl_wbuf_init(&bufs[i]);
        FILE *f = fopen(path, "rb");
        if (!f) continue;
        char chunk[1 << 16];
        size_t r;
        while ((r = fread(chunk, 1, sizeof chunk, f)) > 0) mtrl_wbuf_bytes(&bufs[i], chunk, r);
        fclose(f);
        unlink(path);
        got++;
    }
    int slot = 0;
    for (int i = 0; i < n && got; i++) {
        if (!bufs[i].len) continue;
        while (slot < n && mtrl_rollout_slot(a->ro, slot)) slot++;
        mtrl_error err;
        if (slot < n && mtrl_rollout_resume(a->ro, slot, bufs[i].data, bufs[i].len, &err) == MTRL_OK) {
            uint64_t old = mtrl_rollout_adopt(a->ro, slot);
            mtrl_traj *t = mtrl_rollout_slot(a->ro, slot);
            LOG_INFO("resumed episode %llu as %llu at %llu tokens (snapshot of slot %d)", (unsigned long long)old,
                     (unsigned long long)t->episode_id, (unsigned long long)t->n_tokens, i);
            on_begin_(a, t);
            snap_write_(a, slot, t);
        } else {
            LOG_WARN("snapshot of slot %d not resumed: %s", i, slot < n ? err.msg : "no free slot");
        }
    }
    for (int i = 0; i < n; i++) mtrl_wbuf_free(&bufs[i]);
    free(bufs);
}

// ---- messages from the learner -----------------------------------------------------------------------------

// The credit a WELCOME brings. The answer to our HELLO (a first one, or a resynchronising one:
// the learner counts this actor afresh too) sets it. Any other WELCOME of the run, a new stage's,
// leaves the account running and only adds the change of the granted amount, as the learner
// does (stage_enter_): bytes already on the way when it was sent are counted on both sides as
// sent under the old grant. Resetting here while the learner did the same double-counted those
// bytes on the learner's side, a credit's worth per stage change.
static void credit_welcome_(actor *a, const mtrl_wire_msg *m, int reset) {
    int64_t c = (int64_t)m->credit_bytes;
    if (reset) {
        a->credit = a->credit_full = c;
    } else {
        a->credit += c - a->credit_welcome;
        a->credit_full += c - a->credit_welcome;
    }
    a->credit_welcome = c;
}

static void hello_(actor *a) {
    a->hello_open = 1;
    mtrl_wire_out o;
    mtrl_wire_out_init(&o);
    mtrl_wire_encode_hello(&o, a->id, a->incarnation, 0);
    send_now_(a, &o);
    mtrl_wire_out_free(&o);
}

// Logs an error that makes the experiment unusable here and keeps the first such error: the
// learner gets it (an ERROR message before the BYE) and stores it, so the run store says why
// the actors failed, not only that they did.
static void unusable_(actor *a, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void unusable_(actor *a, const char *fmt, ...) {
    char msg[sizeof a->unusable];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    LOG_ERROR("%s", msg);
    if (!a->unusable[0]) snprintf(a->unusable, sizeof a->unusable, "%s", msg);
}

// (Re)builds the episodes in flight for the current config and incarnation; counters continue
// so episode and group ids stay unique. Whatever was queued before means nothing now.
static int rollout_build_(actor *a, uint64_t next_group, uint64_t next_episode) {
    mtrl_rollout_params p;
    mtrl_error err;
    mtrl_rollout_params_from_config(&p, &a->cfg, a->id, a->incarnation);
    p.first_group = next_group;
    p.first_episode = next_episode;
    p.times = &a->times;
    if (mtrl_rollout_init(&a->ro, &p, &a->cfg, &a->model, &err) != MTRL_OK) {
        unusable_(a, "%s", err.msg);
        return 0;
    }
    outbox_clear_(a);
    // A rebuild (a new stage) ends the episodes the snapshots were of.
    for (int i = 0; i < a->n_snap && a->cfg.actor.snapshot_dir[0]; i++) snap_remove_(a, i);
    a->n_snap = mtrl_rollout_slot_count(a->ro);
    free(a->snap_ep);
    free(a->snap_at);
    a->snap_ep = xcalloc((size_t)a->n_snap, sizeof *a->snap_ep);
    a->snap_at = xcalloc((size_t)a->n_snap, sizeof *a->snap_at);
    return 1;
}

static void weights_at_close_(actor *a);

static int setup_(actor *a, const mtrl_wire_msg *m) {
    mtrl_config_errors errs = {0};
    if (mtrl_config_load_text(&a->cfg, "<experiment from the learner>", m->text ? m->text : "", NULL, 0, &errs) != MTRL_OK) {
        for (int i = 0; i < errs.n; i++) unusable_(a, "%s", errs.msgs[i]);
        mtrl_config_errors_free(&errs);
        return 0;
    }
    mtrl_config_errors_free(&errs);
    mtrl_model_dims d;
    mtrl_error err;
    omp_set_num_threads(mtrl_config_threads(&a->cfg));
    if (mtrl_model_dims_from_config(&d, &a->cfg, MTRL_VOCAB, &err) != MTRL_OK) {
        unusable_(a, "%s", err.msg);
        return 0;
    }
    uint64_t next_group = 0, next_episode = 0;
    int first = !a->have_model; // a later setup is a new stage: its episodes in flight are over
    int device = MTRL_DEVICE_CPU, gpu = 0;
    if (mtrl_model_parse_device(a->cfg.model.device, &device, &gpu) != 0) {
        unusable_(a, "[model] device = %s: expected cpu or cuda", a->cfg.model.device);
        return 0;
    }
    if (a->gpu >= 0) gpu = a->gpu;
    // A new stage of the same run keeps the model: building one is seconds of silence on a GPU
    // (the learner would declare the actor dead) and the stage's weights replace its values anyway.
    int keep = a->have_model && m->run_id == a->run_id && !memcmp(&a->model.dims, &d, sizeof d) &&
               a->model.device == device && a->model.gpu == gpu &&
               a->model.weights_bf16 == !strcmp(a->cfg.actor.weights, "bf16");
    if (a->have_model) {
        if (a->ro) mtrl_rollout_counters(a->ro, &next_group, &next_episode);
        mtrl_rollout_free(a->ro);
        a->ro = NULL;
        if (!keep) {
            weights_at_close_(a); // its layout and device mappings are the old model's
            mtrl_model_free(&a->model);
        }
    }
    // parameters only: an actor never trains (no gradient or AdamW blocks beside the learner's);
    // [actor] weights = bf16: its GEMM matrices as bf16 alone (model/model_wsplit.h)
    mtrl_status (*init)(mtrl_model *, const mtrl_model_dims *, uint64_t, int, int, mtrl_error *) =
        !strcmp(a->cfg.actor.weights, "bf16") ? mtrl_model_init_infer_bf16_on : mtrl_model_init_infer_on;
    if (!keep && init(&a->model, &d, (uint64_t)a->cfg.run.seed, device, gpu, &err) != MTRL_OK) {
        unusable_(a, "%s", err.msg);
        a->have_model = 0;
        return 0;
    }
    // β comes with the weights; actors never apply a β of their own. With qb_actor_stats they sum
    // the β each decode batch implies (and the loads) for the learner (send_qb_stats_).
    mtrl_qb_set_mode(&a->model, a->cfg.learner.qb_actor_stats ? MTRL_QB_DECODE : MTRL_QB_FROZEN);
    a->have_model = 1;
    a->have_weights = 0;
    a->have_cfg = 1;
    a->run_id = m->run_id;
    a->config_hash = m->config_hash;
    if (!rollout_build_(a, next_group, next_episode)) return 0;
    LOG_INFO("run %llu: %d episodes in flight, model %zu parameters", (unsigned long long)a->run_id,
             mtrl_rollout_slot_count(a->ro), mtrl_model_param_count(&a->model));
    if (first) snapshots_resume_(a);
    return 1;
}

// Starts over as a new incarnation and says HELLO: the learner aborts what it holds of the old
// one (messages of the dropped connection may be missing), answers with a WELCOME of the same run
// (the credit comes back; model and weights stay), and the episodes in flight go on under new
// ids, streamed again from their first token: nothing generated is lost.
static void resync_(actor *a, const char *why) {
    uint32_t now = (uint32_t)((mtrl_time_wall() - 1704067200.0) * 10.0);
    a->incarnation = now > a->incarnation ? now : a->incarnation + 1;
    outbox_clear_(a);
    int kept = 0;
    if (a->ro) {
        kept = mtrl_rollout_reincarnate(a->ro, a->incarnation);
        for (int i = 0; i < mtrl_rollout_slot_count(a->ro); i++) {
            mtrl_traj *t = mtrl_rollout_slot(a->ro, i);
            if (t) on_begin_(a, t);
        }
    }
    LOG_WARN("%s: HELLO as incarnation %u; %d episodes in flight go on under new ids", why, a->incarnation, kept);
    a->credit = 0;
    a->resync = 1;
    hello_(a);
}

// Sends the QB statistics decoded since the last call (ROUTING_STATS, stamped with the weight
// version they were routed with) and clears them. Outside the credit: a few KB per heartbeat.
static void send_qb_stats_(actor *a) {
    mtrl_model *m = &a->model;
    if (!a->have_model || mtrl_qb_mode(m) != MTRL_QB_DECODE) return;
    int L = m->dims.L, E = m->dims.E;
    size_t LE = (size_t)L * E;
    uint64_t *counts = xmalloc(sizeof *counts * LE);
    uint32_t *batches = xmalloc(sizeof *batches * (size_t)L);
    double *sums = xmalloc(sizeof *sums * LE);
    if (mtrl_qb_export(m, sums, batches)) {
        for (size_t i = 0; i < LE; i++) counts[i] = m->load[i] > 0 ? (uint64_t)m->load[i] : 0;
        mtrl_wire_out o;
        mtrl_wire_out_init(&o);
        mtrl_wire_encode_routing_stats(&o, m->version, (uint32_t)L, (uint32_t)E, counts, batches, sums);
        send_now_(a, &o);
        mtrl_wire_out_free(&o);
        memset(m->load, 0, sizeof *m->load * LE);
    }
    free(counts);
    free(batches);
    free(sums);
}

// Where this actor's time went since the last report (ACTOR_STATS, outside the credit: 80 bytes
// per heartbeat), then the interval starts over. The learner sums the reports (mtrl bench rl).
static void send_actor_stats_(actor *a, double now) {
    mtrl_wire_actor_stats s = {now - a->last_stats, a->times.prefill_s, a->times.decode_s, a->times.tools_s, a->wait_s,
                               (double)a->times.prefill_tokens, (double)a->times.decode_tokens,
                               (double)a->times.decode_steps};
    mtrl_wire_out o;
    mtrl_wire_out_init(&o);
    mtrl_wire_encode_actor_stats(&o, &s);
    send_now_(a, &o);
    mtrl_wire_out_free(&o);
    memset(&a->times, 0, sizeof a->times);
    a->wait_s = 0;
    a->last_stats = now;
}

static void weights_chunk_(actor *a, const mtrl_wire_msg *m) {
    if (m->chunk_index == 0 || m->weight_version != a->wversion || m->blob_bytes != a->wlen) {
        free(a->wbuf);
        a->wbuf = xmalloc(m->blob_bytes ? m->blob_bytes : 1);
        a->wlen = m->blob_bytes;
        a->wgot = 0;
        a->wseen = 0;
        a->wversion = m->weight_version;
        a->wcount = m->chunk_count;
    }
    if (m->blob_offset + m->data_len > a->wlen) return;
    memcpy(a->wbuf + m->blob_offset, m->data, m->data_len);
    a->wgot += m->data_len;
    a->wseen++;
    if (a->wseen < a->wcount || a->wgot != a->wlen || !a->have_model) return;
    send_qb_stats_(a); // what the old β routed goes out under the old version
    mtrl_ckpt c;
    mtrl_error err;
    mtrl_status s = mtrl_ckpt_open_mem(&c, a->wbuf, a->wlen, &err);
    if (s == MTRL_OK) {
        s = mtrl_model_load(&a->model, &c, 0, &err);
        mtrl_ckpt_close(&c);
    }
    if (s != MTRL_OK) {
        LOG_ERROR("weights version %u refused: %s", a->wversion, err.msg);
        return;
    }
    a->model.version = a->wversion;
    a->have_weights = 1;
    free(a->wbuf);
    a->wbuf = NULL;
    LOG_DEBUG("weights version %u loaded", a->wversion);
}

// ---- the same-host weight channel (WEIGHTS_AT, common/weights_shm.h) --------------------------------------

static void weights_at_close_(actor *a) {
    mtrl_model_wshm_dev_free(a->wdev);
    mtrl_wshm_close(a->wch);
    mtrl_model_wshm_layout_free(&a->wlay);
    a->wdev = NULL;
    a->wch = NULL;
    a->wpending = 0;
}

// Opens the announced channel (once per learner: its name and nonce). 0 when it cannot be read
// here; the learner is then asked for ZeroMQ chunks (publish = auto) or the actor stops (shm).
static int weights_at_open_(actor *a, const mtrl_wire_msg *m) {
    if (a->wch && !strcmp(mtrl_wshm_name(a->wch), m->text) && mtrl_wshm_nonce(a->wch) == m->nonce) return 1;
    weights_at_close_(a);
    mtrl_model_wshm_layout(&a->model, !strcmp(a->cfg.learner.publish_dtype, "bf16"), &a->wlay);
    mtrl_error err;
    mtrl_status st = mtrl_wshm_open(&a->wch, m->text, m->nonce, a->wlay.hash, a->wlay.slot_bytes, &err);
    if (st == MTRL_OK && mtrl_wshm_kind_of(a->wch) == MTRL_WSHM_DEVICE)
        st = mtrl_model_wshm_dev_open(&a->wdev, &a->model, &a->wlay, a->wch, &err);
    if (st == MTRL_OK) {
        LOG_INFO("weights through the same-host channel %s (%s)", m->text, a->wdev ? "CUDA IPC" : "shared memory");
        return 1;
    }
    weights_at_close_(a);
    if (!strcmp(a->cfg.learner.publish, "shm")) {
        unusable_(a, "[learner] publish = shm: %s", err.msg);
        a->bye = 3;
        return 0;
    }
    LOG_INFO("%s: asking for the weights over ZeroMQ", err.msg);
    mtrl_wire_out o;
    mtrl_wire_out_init(&o);
    mtrl_wire_encode_weights_req(&o, 0, m->weight_version);
    send_now_(a, &o);
    mtrl_wire_out_free(&o);
    return 0;
}

static int newer_(uint32_t v, uint32_t than) { return (int32_t)(v - than) > 0; }

// Copies the announced version out of the channel, or a newer one when the learner has written
// past it (the slot moved on, or it did so during the copy: a torn copy is retried from the
// latest complete slot). A device copy whose stamp has not landed yet is tried again on the next
// turn of the loop.
static void weights_at_read_(actor *a) {
    for (int tries = 0; a->wpending && tries < 4; tries++) {
        mtrl_wshm_ticket t;
        const void *data;
        mtrl_error err;
        mtrl_status st = mtrl_wshm_read_begin(a->wch, a->wat_version, a->wslot, &t, &data, &err);
        if (st == MTRL_OK) {
            send_qb_stats_(a); // what the old β routed goes out under the old version
            if (a->wdev) mtrl_model_wshm_dev_unpack(a->wdev, &a->model, t.slot);
            else mtrl_model_wshm_unpack_host(&a->model, &a->wlay, data);
            if (mtrl_wshm_read_end(a->wch, &t)) {
                a->model.version = t.version;
                a->have_weights = 1;
                a->wpending = 0;
                LOG_DEBUG("weights version %u copied from slot %d", t.version, t.slot);
                return;
            }
            a->have_weights = 0; // torn: the parameters are a mix until the retry
        } else if (st == MTRL_ERR_FORMAT) {
            LOG_ERROR("%s", err.msg);
            a->wpending = 0;
            return;
        }
        uint32_t v;
        int slot;
        if (!mtrl_wshm_latest(a->wch, &v, &slot) || (st == MTRL_ERR_STATE && !newer_(v, a->wat_version))) return;
        a->wat_version = v;
        a->wslot = slot;
    }
}

static void weights_at_(actor *a, const mtrl_wire_msg *m) {
    if (!a->have_model || !weights_at_open_(a, m)) return;
    if (a->wpending && !newer_(m->weight_version, a->wat_version)) return;
    a->wat_version = m->weight_version;
    a->wslot = (int)m->slot;
    a->wpending = 1;
    weights_at_read_(a);
}

// Handles everything waiting on the socket (waits up to timeout_ms for the first message).
static int poll_(actor *a, int timeout_ms) {
    mtrl_wire_in in;
    mtrl_error err;
    int got = 0;
    mtrl_status s = mtrl_wire_recv(&a->sock, timeout_ms, &in, &a->rx, &err);
    while (s == MTRL_OK) {
        got++;
        a->last_heard = a->learner_heard = mtrl_time_mono();
        mtrl_wire_msg m;
        mtrl_wire_msg_init(&m);
        if (mtrl_wire_decode(in.hdr_bytes, MTRL_WIRE_HDR_SIZE, in.payload, in.payload_len, &a->lim, &m, &err) != MTRL_OK) {
            LOG_WARN("dropped a message from the learner: %s", err.msg);
        } else {
            switch (in.hdr.type) {
            case MTRL_WIRE_WELCOME:
                // The first WELCOME, another run or a new stage: rebuild model, env and
                // episodes. A WELCOME of the same run and stage (an answer to a repeated HELLO, a
                // learner that was only slow) just resets the credit. A learner restarted with
                // --resume does not know our open episodes: it drops their chunks, they are lost,
                // and the next episodes go through.
                {
                    int reset = a->hello_open || !a->have_cfg || m.run_id != a->run_id;
                    if (!a->have_cfg || m.run_id != a->run_id || m.config_hash != a->config_hash) {
                        if (!setup_(a, &m)) a->bye = 3; // the experiment cannot run here
                    }
                    credit_welcome_(a, &m, reset);
                }
                a->hello_open = 0;
                a->resync = 0;
                break;
            case MTRL_WIRE_WEIGHTS: weights_chunk_(a, &m); break;
            case MTRL_WIRE_WEIGHTS_AT: weights_at_(a, &m); break;
            case MTRL_WIRE_CREDIT:
                a->credit += (int64_t)m.credit_bytes;
                // After a warm-up WELCOME with no credit, the first grant sets the full credit.
                if (a->credit_full < a->credit) a->credit_full = a->credit;
                break;
            case MTRL_WIRE_BYE:
                LOG_INFO("learner said BYE: %s", m.text ? m.text : "");
                a->bye = 1;
                break;
            case MTRL_WIRE_ERROR:
                // MTRL_ERR_PEER: the learner does not know this incarnation (it declared it dead,
                // or it restarted): what it holds of our episodes is gone.
                if (m.code == MTRL_ERR_PEER && a->have_cfg && !a->resync) resync_(a, "the learner does not know this actor");
                else if (m.code != MTRL_ERR_PEER) LOG_WARN("learner error: %s", m.text ? m.text : "");
                break;
            default: break;
            }
        }
        mtrl_wire_msg_free(&m);
        s = mtrl_wire_recv(&a->sock, 0, &in, &a->rx, &err);
    }
    if (a->wpending) weights_at_read_(a);
    return got;
}

int mtrl_actor_main(const char *endpoint, uint32_t actor_id, int gpu, volatile sig_atomic_t *stop) {
    actor a;
    memset(&a, 0, sizeof a);
    a.id = actor_id;
    a.gpu = gpu;
    // Incarnations must grow: the learner treats a higher one as a restart of the same actor and
    // a lower one as stale. Tenths of a second since 2024-01-01 fit 32 bits for 13 years.
    a.incarnation = (uint32_t)((mtrl_time_wall() - 1704067200.0) * 10.0);
    char tag[32];
    snprintf(tag, sizeof tag, "actor %u", actor_id);
    mtrl_log_set_tag(tag);
    a.zctx = zmq_ctx_new();
    a.lim = mtrl_wire_limits_default();
    mtrl_wire_sockopts so = mtrl_wire_sockopts_default();
    // ZeroMQ's own heartbeat only guards against dead TCP peers here; the learner's silence is
    // judged by the application (below), which knows the learner may be busy for a long step.
    so.heartbeat_timeout_ms = 60000;
    mtrl_wire_auth_client_apply(&so); // --curve-server-key / --curve-key of mtrl actor (tools/cmd_run.c)
    mtrl_error err;
    if (mtrl_wire_dealer_open(&a.sock, a.zctx, endpoint, a.id, a.incarnation, &a.lim, &so, &err) != MTRL_OK) {
        LOG_ERROR("%s", err.msg);
        zmq_ctx_term(a.zctx);
        return 1;
    }
    if (mtrl_wire_monitor_open(&a.mon, &a.sock,
                               ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                                   ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH,
                               &err) != MTRL_OK)
        LOG_WARN("%s (connection drops will only be noticed by the heartbeats)", err.msg);
    // Handshake: HELLO until a WELCOME and the first weights arrive.
    double t0 = mtrl_time_mono(), last_hello = -1e9, last_refused = -1e9;
    while (!*stop && !a.bye && !a.have_cfg) {
        double now = mtrl_time_mono();
        if (now - t0 > HELLO_PATIENCE_S) {
            LOG_ERROR("the learner at %s did not answer for %.0f s", endpoint, HELLO_PATIENCE_S);
            a.bye = 2;
            break;
        }
        if (!a.have_cfg && now - last_hello > 2.0) {
            hello_(&a);
            last_hello = now;
        }
        poll_(&a, 100);
        mtrl_wire_event ev_; // a drop before the WELCOME loses nothing of ours
        while (mtrl_wire_monitor_next(&a.mon, &ev_)) {
            // A refused handshake is the one thing the actor can tell the user (wrong keys).
            if (ev_.event & (ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                             ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)) {
                if (now - last_refused > 5.0) LOG_WARN("%s: %s (check the CURVE keys)", ev_.address, ev_.name);
                last_refused = now;
            } else {
                LOG_DEBUG("connection %s: %s", ev_.name, ev_.address);
            }
        }
    }
    double hb = 1e-3 * (double)(a.have_cfg ? a.cfg.actor.heartbeat_ms : 1000);
    // The learner is single-threaded: a long optimizer step keeps it quiet. Only a silence much
    // longer than the heartbeat timeout means it went away.
    double quiet = 3e-3 * (double)(a.have_cfg ? a.cfg.learner.heartbeat_timeout_ms : 5000);
    mtrl_rollout_events ev = {&a, on_begin_, on_end_, on_tick_};
    // An isolated env's call that waits for its child (a hung step, until step_timeout_ms)
    // keeps the heartbeats going.
    mtrl_env_wait_hook_set(on_tick_, &a);
    a.last_heard = a.last_stats = a.learner_heard = mtrl_time_mono();
    while (!*stop && !a.bye) {
        // Wait on the socket when there is nothing to generate (no weights or credit yet, or a
        // backlog to send); otherwise just look.
        int idle = !a.ro || !a.have_weights || a.credit <= 0 || outbox_len_(&a) > 0;
        double t_poll = mtrl_time_mono();
        poll_(&a, idle ? 20 : 0);
        a.wait_s += mtrl_time_mono() - t_poll;
        mtrl_wire_event ev_;
        while (mtrl_wire_monitor_next(&a.mon, &ev_)) {
            if (ev_.event != ZMQ_EVENT_DISCONNECTED) {
                LOG_DEBUG("connection %s: %s", ev_.name, ev_.address);
                continue;
            }
            // Messages in flight on the dropped connection are lost both ways; the learner may
            // hold our episodes open waiting for them. Start over as a new incarnation.
            if (!a.resync && a.have_cfg) resync_(&a, "connection to the learner dropped");
        }
        flush_(&a);
        double now = mtrl_time_mono();
        long patience = a.have_cfg ? a.cfg.actor.learner_patience_s : 0;
        if (patience > 0 && now - a.learner_heard > (double)patience) {
            LOG_ERROR("the learner at %s has been silent for %.0f s ([actor] learner_patience_s = %ld); giving up "
                      "(exit %d)", endpoint, now - a.learner_heard, patience, MTRL_ACTOR_EXIT_LEARNER_LOST);
            a.bye = 4;
            break;
        }
        if (a.resync) {
            // Generation waits for the WELCOME; the HELLO is repeated in case it was lost too.
            if (now - a.last_sent > 2.0) hello_(&a);
            continue;
        }
        if (now - a.last_qb > hb) {
            send_qb_stats_(&a);
            send_actor_stats_(&a, now);
            a.last_qb = now;
        }
        heartbeat_(&a, now);
        if (now - a.last_heard > quiet) {
            // The learner went away (restart?): say HELLO again; the DEALER reconnects itself.
            LOG_WARN("learner silent for %.1f s: saying HELLO again", now - a.last_heard);
            hello_(&a);
            a.last_heard = now;
        }
        // Generation waits for credit (none at all during the learner's warm-up) and for the
        // outbox to drain: what it would produce could not be sent either, and an actor that
        // generates on under a small remainder of credit runs ahead of a busy learner without
        // bound (at 1M tokens: 18 documents prefilled during one learner step, each a 1.8 MB
        // chunk waiting behind the last, on the GPU the learner was using).
        if (a.credit <= 0 || outbox_len_(&a) > 0) continue;
        if (a.ro && a.have_weights) {
            mtrl_rollout_step(a.ro, &ev);
            for (int i = 0; i < mtrl_rollout_slot_count(a.ro); i++) {
                mtrl_traj *t = mtrl_rollout_slot(a.ro, i);
                stream *s = t ? stream_find_(&a, t->episode_id) : NULL;
                if (s) queue_chunks_(&a, s, t, 0);
            }
            snapshots_(&a);
            outbox_note_peak_(&a);
            flush_(&a);
        }
    }
    // Say goodbye (the learner aborts whatever is still open) and leave; an actor that cannot run
    // the experiment says why first.
    if (a.have_cfg || a.bye == 3) {
        mtrl_wire_out o;
        mtrl_wire_out_init(&o);
        if (a.bye == 3) {
            mtrl_wire_encode_error(&o, MTRL_ERR_USAGE, a.unusable[0] ? a.unusable : "cannot run this experiment");
            send_now_(&a, &o);
            mtrl_wire_out_free(&o);
            mtrl_wire_out_init(&o);
        }
        if (a.have_cfg) send_actor_stats_(&a, mtrl_time_mono());
        mtrl_wire_encode_bye(&o, a.bye == 3 ? "cannot run this experiment" : *stop ? "actor stopped" : "learner said BYE");
        send_now_(&a, &o);
        mtrl_wire_out_free(&o);
    }
    // The run is over: its snapshots mean nothing to the next one. (Stopped by a signal, they
    // stay: a restarted actor resumes them.)
    if (a.bye == 1 && a.have_cfg && a.cfg.actor.snapshot_dir[0])
        for (int i = 0; i < a.n_snap; i++) snap_remove_(&a, i);
    int rc = a.bye == 4 ? MTRL_ACTOR_EXIT_LEARNER_LOST : a.bye == 3 ? MTRL_ACTOR_EXIT_UNUSABLE : a.bye == 2 ? 1 : 0;
    LOG_INFO("%ld episodes streamed; outbox peak %d messages, %.1f KB; leaving", a.episodes_done, a.out_peak,
             a.out_peak_bytes / 1e3);
    mtrl_env_wait_hook_set(NULL, NULL); // a is going away
    mtrl_rollout_free(a.ro);
    weights_at_close_(&a);
    if (a.have_model) mtrl_model_free(&a.model);
    for (int i = a.out_head; i < a.n_out; i++) mtrl_wire_out_free(&a.out[i].o);
    free(a.out);
    free(a.streams);
    free(a.snap_ep);
    free(a.snap_at);
    free(a.wbuf);
    mtrl_wire_monitor_close(&a.mon);
    mtrl_wire_sock_close(&a.sock);
    zmq_ctx_term(a.zctx);
    return rc;
}
