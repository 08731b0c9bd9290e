// learner.c: the learner process (see learner.h).
#include "learner/learner.h"
#include "model/qb.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>
#include <omp.h>
#include <zmq.h>

#include "env/env_config.h"
#include "learner/json_line.h"
#include "common/chat.h"
#include "common/check.h"
#include "common/checkpoint.h"
#include "common/fsutil.h"
#include "common/hash.h"
#include "common/log.h"
#include "model/model_hf.h"
#include "common/rng.h"
#include "common/store.h"
#include "common/timeutil.h"
#include "common/tokenizer.h"
#include "common/trajfile.h"
#include "common/wire/wire.h"
#include "common/wire/wire_auth.h"
#include "common/wire/wire_monitor.h"
#include "common/wire/wire_shared.h"
#include "learner/ckpt_async.h"
#include "learner/dist_launch.h"
#include "learner/learner_ranks.h"
#include "learner/peer_guard.h"
#include "learner/perf.h"
#include "learner/run_dir.h"
#include "learner/train.h"
#include "learner/weights_pub.h"

#define MAX_ACTORS 256
// Weights travel in chunks of 32 MiB: few enough messages for ZeroMQ's high-water mark (1000
// messages) even for a 1.2 B-parameter fp32 model, small enough for the frame cap (64 MiB).
#define WEIGHTS_CHUNK ((size_t)32 << 20)

typedef struct actor_rec {
    uint32_t id, incarnation;
    mtrl_wire_peer peer;
    double last_seen;
    double welcomed;        // when the last WELCOME went out
    int alive;
    int heard;              // a message came after the last WELCOME: the actor is set up (until
                            // then it builds its model and envs, seconds of silence on a GPU,
                            // and actor_start_timeout_ms applies instead of heartbeat_timeout_ms)
    uint64_t owed;          // payload bytes received and not yet returned as credit
    int64_t credit;         // bytes it may still send: WELCOME's credit + grants - episode bytes received
    int64_t credit_welcome; // what the last WELCOME granted (a stage's WELCOME adds only its change)
    int refused;            // sent beyond its credit: disconnected, its HELLOs and messages ignored
    int zmq_weights;        // gets WEIGHTS chunks (no weight channel, or it asked: WEIGHTS_REQ)
    char key[MTRL_WIRE_KEY_Z85_LEN + 1]; // under CURVE: the client key its HELLO came with
    double silent_at;       // when it was declared dead for silence (0: it was not)
} actor_rec;

typedef struct group_buf {
    uint64_t id;
    mtrl_traj **eps;
    int n;
    double last_arrival;
} group_buf;

struct mtrl_learner {
    mtrl_config cfg;        // the experiment as it applies now (the current stage's overrides in)
    mtrl_config base;       // the experiment as loaded
    int stage;              // current [stage.N] (0-based), -1 without stages
    uint32_t stage_version; // the weight version the current stage started with (see stage_enter_)
    long total_steps;       // [run] steps, or the sum of the stages' steps
    char *config_text;
    uint64_t config_hash;
    char config_hash_hex[17];
    void *zctx;
    mtrl_wire_sock sock;
    mtrl_wire_monitor mon;
    double last_mon_warn;      // handshake failures are logged at most once a second
    mtrl_wire_auth_server *auth; // CURVE ZAP handler; NULL without [learner] curve_key
    double last_unknown_reply; // rate limit of the "say HELLO" answers to unknown peers
    mtrl_peer_guard guard;     // peers that send refused messages; a flooder is hung up on
    mtrl_wire_limits lim;
    mtrl_wire_asm *asm_;
    mtrl_wire_stats rx;
    mtrl_store *store;
    int64_t run_id;
    char run_dir[1024];      // out_dir/<store>-run<id>: this run's files (learner/run_dir.h)
    char traj_path[1100];
    mtrl_trajfile_writer tw;
    mtrl_wbuf scratch;
    mtrl_model model;        // rank 0's replica with several ranks
    mtrl_learner_ranks *ranks; // ranks 1 .. R-1 (learner/learner_ranks.h); NULL: one rank, today's step
    mtrl_algo_config algo;
    mtrl_wire_shared **wmsg; // the current weights as encoded WEIGHTS messages, shared by all sends
    uint32_t n_wmsg;
    mtrl_weights_pub pub;    // the same-host weight channel ([learner] publish)
    mtrl_ckpt_async *ckpt;   // the checkpoint being written in the background
    int ckpt_due;            // a checkpoint is due but waits for the one still being written
    int ckpt_due_waited;     // the due checkpoint's one wait (CKPT_WAIT_S) is spent
    actor_rec actors[MAX_ACTORS];
    int n_actors;
    group_buf *groups;
    int n_groups, cap_groups;
    long step;
    long episodes_by_status[MTRL_EP_REJECTED + 1];
    long stale_dropped, groups_dropped;
    long stage_dropped;      // episodes of an earlier stage that arrived after the stage changed
    long episodes_seen;      // finished episodes, for keep_trajectories = every_N
    long tokens_seen;
    long *loads;
    double *actor_qb_sum;    // [L][E] β sums from the actors' ROUTING_STATS since the last step
    long *actor_qb_n;        // [L] decode batches summed
    double t_start;
    double t_last_step;    // when the last RL step ended (0: none yet)
    double t_progress;     // when the last RL step ended, or RL started: [learner] stall_timeout_s
    long joins;            // actors welcomed so far
    int progress;
    int resumed; // this sitting continues a run (--resume): stop_before_stage does not stop it where it starts
    mtrl_progress prog;
    void (*tick)(void *);
    void *tick_user;
    int warming;             // in the warm-up: actors are welcomed with no credit (they wait)
    double last_hb;
    double last_reward;
    char failed[256];        // mtrl_learner_fail's reason: the run ends as failed
    char actor_error[400];   // the last error an actor sent (why it cannot run the experiment)
    // where the time of RL goes (learner/perf.h): this cycle's split (since the previous step's
    // metrics) and the totals since the end of the warm-up (t_rl: when it ended, 0 before)
    mtrl_perf cyc, tot;
    double t_rl, t_cycle;
    double rl_seconds;       // mtrl_learner_opts.rl_seconds
};

// ---- helpers -----------------------------------------------------------------------------------------------

static void event_(mtrl_learner *l, mtrl_log_level lv, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void event_(mtrl_learner *l, mtrl_log_level lv, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    mtrl_log(lv, "%s", msg);
    if (l->store) mtrl_store_event_log(l->store, l->run_id, lv, msg, NULL);
}

// A durable write that failed (the run store, the trajectory file): the run stops and ends as
// failed (non-zero exit), never as finished over data it could not keep. The first failure is
// the one reported; the event row is best effort (the store may be the thing that is full).
static void durable_fail_(mtrl_learner *l, const char *what, const mtrl_error *err) {
    if (l->failed[0]) return;
    event_(l, MTRL_LOG_ERROR, "%s: %s; stopping the run (a failed write loses data)", what, err ? err->msg : "write failed");
    char why[256];
    snprintf(why, sizeof why, "%.80s: %.160s", what, err ? err->msg : "write failed");
    mtrl_learner_fail(l, why);
}

static actor_rec *actor_find_(mtrl_learner *l, const mtrl_wire_peer *p) {
    for (int i = 0; i < l->n_actors; i++)
        if (l->actors[i].peer.len == p->len && !memcmp(l->actors[i].peer.id, p->id, p->len)) return &l->actors[i];
    return NULL;
}

// After a send to actor a: a peer ZeroMQ no longer knows is dead.
static void sent_(mtrl_learner *l, actor_rec *a, mtrl_status st, const mtrl_error *err) {
    if (st != MTRL_OK) {
        LOG_WARN("send to actor %u failed: %s", a->id, err->msg);
        if (err->code == MTRL_ERR_PEER && a->alive) {
            // ZeroMQ's own heartbeat (or the TCP close) found the peer gone before ours timed out.
            a->alive = 0;
            size_t n = mtrl_wire_asm_abort_actor(l->asm_, a->id, a->incarnation, "actor connection lost (no heartbeat)");
            event_(l, MTRL_LOG_WARN, "actor %u (incarnation %u) disconnected: %zu open episodes aborted", a->id, a->incarnation, n);
        }
    }
}

static void send_(mtrl_learner *l, actor_rec *a, mtrl_wire_out *o) {
    mtrl_error err;
    sent_(l, a, mtrl_wire_send(&l->sock, &a->peer, o, &err), &err);
}

static void wmsg_free_(mtrl_learner *l) {
    for (uint32_t c = 0; c < l->n_wmsg; c++) mtrl_wire_shared_release(l->wmsg[c]);
    free(l->wmsg);
    l->wmsg = NULL;
    l->n_wmsg = 0;
}

// Serialises the weights and encodes them as WEIGHTS messages; every actor that gets chunks is
// then sent the same bytes (messages still queued for an actor keep the older version alive).
static void serialise_(mtrl_learner *l) {
    double t0 = mtrl_time_mono();
    void *blob = NULL;
    size_t len = 0;
    mtrl_error err;
    if (!strcmp(l->cfg.learner.publish_dtype, "bf16"))
        MTRL_CHECKF(mtrl_model_save_bf16(&l->model, &blob, &len, &err) == MTRL_OK, "%s", err.msg);
    else
        MTRL_CHECKF(mtrl_model_save(&l->model, NULL, &blob, &len, 0, NULL, 0, &err) == MTRL_OK, "%s", err.msg);
    wmsg_free_(l);
    l->n_wmsg = (uint32_t)((len + WEIGHTS_CHUNK - 1) / WEIGHTS_CHUNK);
    l->wmsg = xcalloc(l->n_wmsg, sizeof *l->wmsg);
    mtrl_wire_out o;
    mtrl_wire_out_init(&o);
    for (uint32_t c = 0; c < l->n_wmsg; c++) {
        uint64_t off = (uint64_t)c * WEIGHTS_CHUNK;
        uint64_t n = len - off < WEIGHTS_CHUNK ? len - off : WEIGHTS_CHUNK;
        mtrl_wire_encode_weights(&o, l->model.version, c, l->n_wmsg, len, off, (const uint8_t *)blob + off, n);
        l->wmsg[c] = mtrl_wire_shared_take(&o);
    }
    mtrl_wire_out_free(&o);
    free(blob);
    double dt = mtrl_time_mono() - t0;
    if (dt > 1.0) LOG_INFO("weights version %u serialised: %.2f GB in %.1f s", l->model.version, len / 1e9, dt);
}

// Publishes the current version: into the weight channel when there is one (a slot write: no
// serialisation, the actors copy it out), and as WEIGHTS messages only while some actor gets
// chunks. Returns the seconds it took.
static double publish_(mtrl_learner *l) {
    double t0 = mtrl_time_mono();
    mtrl_weights_pub_publish(&l->pub, &l->model);
    int chunks = !l->pub.ch;
    for (int i = 0; i < l->n_actors && !chunks; i++) chunks = l->actors[i].alive && l->actors[i].zmq_weights;
    if (chunks) serialise_(l);
    else wmsg_free_(l); // a later actor that asks for chunks gets the version current then
    return mtrl_time_mono() - t0;
}

static void send_weights_(mtrl_learner *l, actor_rec *a) {
    if (!a->zmq_weights) {
        mtrl_wire_out o;
        mtrl_wire_out_init(&o);
        if (mtrl_weights_pub_announce(&l->pub, &o)) send_(l, a, &o);
        mtrl_wire_out_free(&o);
        return;
    }
    if (!l->n_wmsg) serialise_(l);
    for (uint32_t c = 0; c < l->n_wmsg && a->alive; c++) {
        mtrl_error err;
        sent_(l, a, mtrl_wire_shared_send(&l->sock, &a->peer, l->wmsg[c], &err), &err);
    }
}

// ---- committing episodes -----------------------------------------------------------------------------------

static int keep_traj_(mtrl_learner *l, const mtrl_traj *t) {
    const char *k = l->cfg.run.keep_trajectories;
    if (!strcmp(k, "all")) return 1;
    if (!strcmp(k, "failures")) return t->status != MTRL_EP_COMPLETE || t->reward <= 0;
    long every = strtol(k + 6, NULL, 10);
    return every > 0 && l->episodes_seen % every == 0;
}

static group_buf *group_get_(mtrl_learner *l, uint64_t id) {
    for (int i = 0; i < l->n_groups; i++)
        if (l->groups[i].id == id) return &l->groups[i];
    if (l->n_groups == l->cap_groups) {
        l->cap_groups = l->cap_groups ? 2 * l->cap_groups : 16;
        l->groups = xrealloc(l->groups, sizeof *l->groups * (size_t)l->cap_groups);
    }
    group_buf *g = &l->groups[l->n_groups++];
    memset(g, 0, sizeof *g);
    g->id = id;
    g->eps = xcalloc((size_t)l->cfg.algo.group_size, sizeof(mtrl_traj *));
    return g;
}

// Removes group i keeping the others in arrival order: batches take the oldest final groups first,
// so no group waits behind newer ones until it is stale.
static void group_drop_(mtrl_learner *l, int i) {
    group_buf *g = &l->groups[i];
    for (int k = 0; k < g->n; k++) {
        mtrl_traj_free(g->eps[k]);
        free(g->eps[k]);
    }
    free(g->eps);
    memmove(&l->groups[i], &l->groups[i + 1], sizeof *l->groups * (size_t)(l->n_groups - i - 1));
    l->n_groups--;
}

// Data the learner refused: an episode the assembler rejected (over a cap, malformed), or one
// of a peer that sent beyond its credit. Its row says what happened; its tokens are not kept.
static int refused_data_(const mtrl_learner *l, const mtrl_traj *t) {
    if (t->status == MTRL_EP_REJECTED) return 1;
    for (int i = 0; i < l->n_actors; i++)
        if (l->actors[i].refused && l->actors[i].id == t->actor_id && l->actors[i].incarnation == t->incarnation) return 1;
    return 0;
}

// Records a closed episode (file + SQLite) and files it into its group for training.
static void commit_(mtrl_learner *l, mtrl_traj *t) {
    mtrl_error err;
    l->episodes_seen++;
    l->tokens_seen += (long)t->n_tokens;
    l->cyc.episodes++;
    l->cyc.generated_tokens += (double)t->n_model;
    if (t->status <= MTRL_EP_REJECTED) l->episodes_by_status[t->status]++;
    int64_t off = -1;
    const char *path = NULL;
    if (keep_traj_(l, t) && t->n_tokens > 0 && !refused_data_(l, t)) {
        uint64_t o;
        if (mtrl_trajfile_append_traj(&l->tw, t, &l->scratch, &o, &err) == MTRL_OK) {
            off = (int64_t)o;
            path = l->traj_path;
        } else {
            durable_fail_(l, "trajectory file", &err);
        }
    }
    if (mtrl_store_episode_log(l->store, l->run_id, t, path, off, l->step, &err) != MTRL_OK)
        durable_fail_(l, "run store", &err);
    int trainable = t->status == MTRL_EP_COMPLETE || t->status == MTRL_EP_TRUNCATED;
    // An episode whose prompt came before the stage's weights was generated under the previous
    // stage's context and document (the actor had not rebuilt yet): not this stage's data.
    if (trainable && t->n_tokens > 0 && t->version[0] < l->stage_version) {
        l->stage_dropped++;
        trainable = 0;
    }
    if (trainable && t->n_model > 0 && (long)l->model.version - (long)t->version_min > l->cfg.learner.max_staleness) {
        l->stale_dropped++;
        trainable = 0;
    }
    if (t->status == MTRL_EP_ABORTED || t->status == MTRL_EP_REJECTED)
        LOG_WARN("episode %" PRIu64 " %s: %s", t->episode_id, mtrl_ep_status_name(t->status), t->reason ? t->reason : "");
    group_buf *g = group_get_(l, t->group_id);
    g->last_arrival = mtrl_time_mono();
    mtrl_traj *keep = xmalloc(sizeof *keep);
    mtrl_traj_init(keep);
    mtrl_traj_swap(keep, t);
    if (!trainable) keep->status = keep->status == MTRL_EP_COMPLETE || keep->status == MTRL_EP_TRUNCATED
                                       ? MTRL_EP_REJECTED : keep->status; // stale: held out of training
    if (g->n < l->cfg.algo.group_size) g->eps[g->n++] = keep;
    else {
        mtrl_traj_free(keep);
        free(keep);
    }
}

static int group_trainable_(const group_buf *g) {
    int n = 0;
    for (int k = 0; k < g->n; k++) n += g->eps[k]->status == MTRL_EP_COMPLETE || g->eps[k]->status == MTRL_EP_TRUNCATED;
    return n;
}

// The trainable episodes of g sampled with weights more than max_staleness versions behind the
// learner's now: the check at arrival again, at the step that would train them (a group can
// wait for its last episode, or behind a backlog, for several steps).
static int group_stale_eps_(const mtrl_learner *l, const group_buf *g) {
    int n = 0;
    for (int k = 0; k < g->n; k++) {
        const mtrl_traj *t = g->eps[k];
        int trainable = t->status == MTRL_EP_COMPLETE || t->status == MTRL_EP_TRUNCATED;
        n += trainable && t->n_model > 0 &&
             (long)l->model.version - (long)t->version_min > l->cfg.learner.max_staleness;
    }
    return n;
}

// A group is final when all G episodes arrived, or when it has waited long past the heartbeat
// timeout (its actor died before starting the rest).
static int group_final_(const mtrl_learner *l, const group_buf *g, double now) {
    return g->n >= l->cfg.algo.group_size || now - g->last_arrival > 3e-3 * (double)l->cfg.learner.heartbeat_timeout_ms;
}

// ---- messages ---------------------------------------------------------------------------------------------------

// Actor-side QB statistics ([learner] qb_actor_stats): the β sums of the actors' decode batches
// since the last step, kept when routed with weights no staler than max_staleness.
static void qb_stats_in_(mtrl_learner *l, actor_rec *a, const mtrl_wire_in *in) {
    if (!l->cfg.learner.qb_actor_stats) return;
    mtrl_wire_msg m;
    mtrl_wire_msg_init(&m);
    mtrl_error err;
    const mtrl_model_dims *d = &l->model.dims;
    if (mtrl_wire_decode(in->hdr_bytes, MTRL_WIRE_HDR_SIZE, in->payload, in->payload_len, &l->lim, &m, &err) != MTRL_OK) {
        mtrl_wire_stats_invalid(&l->rx, err.msg);
    } else if (m.layers != (uint32_t)d->L || m.experts != (uint32_t)d->E) {
        char why[160];
        snprintf(why, sizeof why, "actor %u: ROUTING_STATS of %u x %u, the model has %d layers x %d experts", a->id,
                 m.layers, m.experts, d->L, d->E);
        mtrl_wire_stats_invalid(&l->rx, why);
    } else if ((long)l->model.version - (long)m.weight_version <= l->cfg.learner.max_staleness) {
        for (int ly = d->first_dense; ly < d->L; ly++) {
            l->actor_qb_n[ly] += m.qb_batches[ly];
            for (int e = 0; e < d->E; e++) l->actor_qb_sum[(size_t)ly * d->E + e] += m.qb_beta_sum[(size_t)ly * d->E + e];
        }
    }
    mtrl_wire_msg_free(&m);
}

// Folds the actors' statistics into this step's QB update as one batch: their mean β counts as
// much as one of the learner's own batches, however many decode steps it averages (those are a
// few tokens each and would otherwise drown the learner's view of the trained batch).
static long qb_stats_fold_(mtrl_learner *l) {
    const mtrl_model_dims *d = &l->model.dims;
    long n = 0;
    for (int ly = d->first_dense; ly < d->L; ly++) {
        if (l->actor_qb_n[ly] == 0) continue;
        n += l->actor_qb_n[ly];
        double *sum = l->actor_qb_sum + (size_t)ly * d->E;
        for (int e = 0; e < d->E; e++) sum[e] /= (double)l->actor_qb_n[ly];
        mtrl_qb_merge(&l->model, ly, sum);
        memset(sum, 0, sizeof *sum * (size_t)d->E);
        l->actor_qb_n[ly] = 0;
    }
    return n;
}

// An actor's time split since its previous report (ACTOR_STATS): summed into the cycle's during
// RL, dropped during the warm-up (the actors only wait then).
static void actor_stats_in_(mtrl_learner *l, const mtrl_wire_in *in) {
    mtrl_wire_msg m;
    mtrl_wire_msg_init(&m);
    mtrl_error err;
    if (mtrl_wire_decode(in->hdr_bytes, MTRL_WIRE_HDR_SIZE, in->payload, in->payload_len, &l->lim, &m, &err) != MTRL_OK)
        mtrl_wire_stats_invalid(&l->rx, err.msg);
    else if (l->t_rl > 0)
        mtrl_perf_actor_add(&l->cyc, &m.actor_stats);
    mtrl_wire_msg_free(&m);
}

// Charges an episode message of cost bytes to actor a's credit; 0 when it is beyond it: the
// peer is disconnected (BYE), its open episodes aborted (their data is not kept: commit_) and
// nothing it sends is read again. The actor sends while its credit covers a message, or one
// message larger than the whole credit when nothing is in flight (actor.c flush_); a repeated
// WELCOME resets its count while bytes are in flight, so one credit of slack is allowed. What
// the learner holds of a peer is thus bounded by its credit, the slack and one message.
static int credit_take_(mtrl_learner *l, actor_rec *a, int64_t cost) {
    int64_t full = l->cfg.learner.credit_bytes;
    if (cost <= a->credit + full || (cost > full && a->credit >= 0)) {
        a->credit -= cost;
        return 1;
    }
    size_t n = mtrl_wire_asm_abort_actor(l->asm_, a->id, a->incarnation, "actor sent beyond its credit");
    event_(l, MTRL_LOG_ERROR,
           "actor %u (incarnation %u) sent a %lld-byte message with %lld bytes of credit left ([learner] credit_bytes = %lld): "
           "disconnected and refused, %zu open episodes aborted and not kept",
           a->id, a->incarnation, (long long)cost, (long long)a->credit, (long long)full, n);
    mtrl_wire_out o;
    mtrl_wire_out_init(&o);
    mtrl_wire_encode_bye(&o, "sent beyond its credit: disconnected");
    send_(l, a, &o);
    mtrl_wire_out_free(&o);
    a->alive = 0;
    a->refused = 1;
    a->owed = 0;
    return 0;
}

// A message refused from in->peer (the last one received): logged once per peer and window; a
// peer past [learner]'s limit of refused messages is hung up on (issue 28, item 2).
static void refused_(mtrl_learner *l, const mtrl_wire_in *in, const char *why) {
    mtrl_peer_guard_verdict v = mtrl_peer_guard_note(&l->guard, &in->peer, mtrl_time_mono());
    if (v == MTRL_PEER_GUARD_LOG) LOG_WARN("dropped a message: %s", why);
    if (v != MTRL_PEER_GUARD_HANG_UP) return;
    mtrl_error e;
    if (mtrl_wire_sock_disconnect_last(&l->sock, &e) == MTRL_OK)
        event_(l, MTRL_LOG_WARN, "disconnected a peer that sent %u refused messages in %.0f s (the last: %s)",
               l->guard.limit + 1, l->guard.window_s, why);
    else
        LOG_DEBUG("could not disconnect a peer that floods: %s", e.msg);
}

// 1 when a HELLO as actor m->actor_id from connection `in` (record `a` there, or NULL; CURVE
// key `key`, "" without) must be refused because a live actor holds that id on another
// connection (issue 28, item 4: a forged HELLO with a higher incarnation displaced the real
// actor, and incarnations come from the actors' clocks). The id belongs to the connection that
// holds it, whatever the incarnation numbers say; it passes to another connection only once
// the holder is gone: its connection closed (a restarted actor's predecessor, found by a probe
// send that ROUTER_MANDATORY refuses) or it was declared dead (silent). Under CURVE it never
// passes to another key while the holder lives. The refusal is silent (no amplification) and
// counts toward the peer guard; the real actor, retrying its HELLO, is let in once the holder
// is gone.
static int hello_taken_(mtrl_learner *l, const actor_rec *a, const mtrl_wire_msg *m, const char *key,
                        const mtrl_wire_in *in) {
    for (int i = 0; i < l->n_actors; i++) {
        actor_rec *o = &l->actors[i];
        if (o == a || !o->alive || o->id != m->actor_id) continue;
        int other_key = strcmp(o->key, key) != 0;
        if (!other_key) {
            mtrl_wire_out hb;
            mtrl_wire_out_init(&hb);
            mtrl_wire_encode_heartbeat(&hb);
            mtrl_error e;
            mtrl_status st = mtrl_wire_send(&l->sock, &o->peer, &hb, &e);
            mtrl_wire_out_free(&hb);
            if (st == MTRL_ERR_PEER) return 0; // the holder's connection is gone
        }
        char why[200];
        snprintf(why, sizeof why, "refused a HELLO as actor %u (incarnation %u) from another connection%s: actor %u "
                 "(incarnation %u) is live there", m->actor_id, m->incarnation,
                 other_key ? " with another CURVE key" : "", o->id, o->incarnation);
        mtrl_wire_stats_invalid(&l->rx, why);
        refused_(l, in, why);
        return 1;
    }
    return 0;
}

static void handle_(mtrl_learner *l, mtrl_wire_in *in) {
    mtrl_error err;
    actor_rec *a = actor_find_(l, &in->peer);
    uint16_t type = in->hdr.type;
    if (a && a->refused) return; // disconnected for ignoring its credit: nothing it sends is read
    if (type == MTRL_WIRE_HELLO) {
        mtrl_wire_msg m;
        mtrl_wire_msg_init(&m);
        if (mtrl_wire_decode(in->hdr_bytes, MTRL_WIRE_HDR_SIZE, in->payload, in->payload_len, &l->lim, &m, &err) != MTRL_OK) {
            mtrl_wire_stats_invalid(&l->rx, err.msg);
            mtrl_wire_msg_free(&m);
            return;
        }
        // A repeated HELLO of a welcomed incarnation (the actor resends it until it hears from
        // us; they queue while the learner is busy): one WELCOME per heartbeat timeout is enough.
        if (a && a->alive && a->id == m.actor_id && a->incarnation == m.incarnation &&
            mtrl_time_mono() - a->welcomed < 1e-3 * (double)l->cfg.learner.heartbeat_timeout_ms) {
            a->last_seen = mtrl_time_mono();
            mtrl_wire_msg_free(&m);
            return;
        }
        char key[MTRL_WIRE_KEY_Z85_LEN + 1];
        mtrl_wire_auth_peer_key(&l->sock, key);
        if (hello_taken_(l, a, &m, key, in)) {
            mtrl_wire_msg_free(&m);
            return;
        }
        // A new incarnation of a known actor id: its older incarnation's episodes are over.
        for (int i = 0; i < l->n_actors; i++) {
            actor_rec *o = &l->actors[i];
            if (o->id == m.actor_id && o->incarnation != m.incarnation && o->alive) {
                size_t n = mtrl_wire_asm_abort_actor(l->asm_, o->id, o->incarnation, "actor restarted (new incarnation)");
                if (n) event_(l, MTRL_LOG_WARN, "actor %u restarted: %zu open episodes aborted", o->id, n);
                o->alive = 0;
            }
        }
        if (!a) {
            if (l->n_actors == MAX_ACTORS) {
                for (int i = 0; i < l->n_actors; i++)
                    if (!l->actors[i].alive) { l->actors[i] = l->actors[--l->n_actors]; break; }
            }
            if (l->n_actors == MAX_ACTORS) {
                mtrl_wire_msg_free(&m);
                return;
            }
            a = &l->actors[l->n_actors++];
            memset(a, 0, sizeof *a);
            a->peer = in->peer;
        }
        a->id = m.actor_id;
        a->incarnation = m.incarnation;
        a->alive = 1;
        a->last_seen = mtrl_time_mono();
        a->welcomed = a->last_seen;
        a->heard = 0;
        a->zmq_weights = !l->pub.ch;
        a->credit = l->warming ? 0 : l->cfg.learner.credit_bytes; // what the WELCOME grants
        a->credit_welcome = a->credit;
        memcpy(a->key, key, sizeof a->key);
        l->joins++;
        event_(l, MTRL_LOG_INFO, "actor %u (incarnation %u) joined", a->id, a->incarnation);
        mtrl_wire_out o;
        mtrl_wire_out_init(&o);
        mtrl_wire_encode_welcome(&o, (uint64_t)l->run_id, l->config_hash, l->model.version,
                                 l->warming ? 0 : (uint64_t)l->cfg.learner.credit_bytes, l->config_text);
        send_(l, a, &o);
        mtrl_wire_out_free(&o);
        if (!l->warming) send_weights_(l, a);
        mtrl_wire_msg_free(&m);
        return;
    }
    if (!a || !a->alive) {
        mtrl_wire_stats_invalid(&l->rx, "message from an actor that has not said HELLO (or is dead)");
        refused_(l, in, "message from an actor that has not said HELLO (or is dead)");
        // Tell it, so it starts over instead of streaming into the void (an actor declared dead
        // while only slow, or one whose connection dropped and came back). At most a few
        // answers per second: a flood from an unknown peer gets no amplification.
        double now = mtrl_time_mono();
        if (type != MTRL_WIRE_BYE && now - l->last_unknown_reply > 0.2) {
            l->last_unknown_reply = now;
            mtrl_wire_out o;
            mtrl_wire_out_init(&o);
            mtrl_wire_encode_error(&o, MTRL_ERR_PEER, "this learner does not know that actor incarnation: say HELLO");
            mtrl_error e2;
            mtrl_wire_send(&l->sock, &in->peer, &o, &e2); // a peer that is gone: nothing to do
            mtrl_wire_out_free(&o);
        }
        return;
    }
    a->last_seen = mtrl_time_mono();
    a->heard = 1;
    switch (type) {
    case MTRL_WIRE_BEGIN:
    case MTRL_WIRE_CHUNK:
    case MTRL_WIRE_END:
        if (!credit_take_(l, a, (int64_t)(in->payload_len + MTRL_WIRE_HDR_SIZE))) break;
        if (mtrl_wire_asm_feed(l->asm_, a->id, a->incarnation, &in->hdr, in->payload, in->payload_len, &err) != MTRL_OK)
            LOG_WARN("actor %u: %s", a->id, err.msg);
        a->owed += in->payload_len + MTRL_WIRE_HDR_SIZE;
        break;
    case MTRL_WIRE_WEIGHTS_REQ:
        // An actor that cannot open the weight channel (another host) asks for chunks.
        if (!a->zmq_weights) event_(l, MTRL_LOG_INFO, "actor %u gets the weights over ZeroMQ (the weight channel does not open there)", a->id);
        a->zmq_weights = 1;
        send_weights_(l, a);
        break;
    case MTRL_WIRE_ROUTING_STATS:
        qb_stats_in_(l, a, in);
        break;
    case MTRL_WIRE_ACTOR_STATS:
        actor_stats_in_(l, in);
        break;
    case MTRL_WIRE_HEARTBEAT:
        break;
    case MTRL_WIRE_ERROR:
    case MTRL_WIRE_BYE: {
        // The text is the peer's: the event log escapes it (mtrl_store_event_log, common/log.c).
        mtrl_wire_msg m;
        mtrl_wire_msg_init(&m);
        const char *text = "";
        if (mtrl_wire_decode(in->hdr_bytes, MTRL_WIRE_HDR_SIZE, in->payload, in->payload_len, &l->lim, &m, &err) == MTRL_OK)
            text = m.text ? m.text : "";
        if (type == MTRL_WIRE_ERROR) {
            // An actor that cannot run the experiment says why before it leaves (actor.c, unusable_).
            snprintf(l->actor_error, sizeof l->actor_error, "actor %u: %s", a->id, text);
            event_(l, MTRL_LOG_ERROR, "%s", l->actor_error);
        } else {
            size_t n = mtrl_wire_asm_abort_actor(l->asm_, a->id, a->incarnation, "actor said BYE");
            event_(l, MTRL_LOG_INFO, "actor %u left: %s (%zu open episodes aborted)", a->id, text, n);
            a->alive = 0;
        }
        mtrl_wire_msg_free(&m);
        break;
    }
    default:
        mtrl_wire_stats_invalid(&l->rx, "unexpected message type from an actor");
    }
}

// Returns credit for every message consumed (an actor never has more than its credit in flight,
// or one message larger than it: the learner holds at most the sum of the credits plus one such
// message per actor, and the assembler caps each episode), while fewer than two batches of
// complete groups wait: episodes produced faster than the learner trains would only go stale, so
// the actors wait instead (backpressure). Open episodes are never starved of credit: their END
// must get through.
static void grant_credit_(mtrl_learner *l) {
    // Only complete groups count: a partial group's other episodes still need credit to arrive.
    int complete = 0;
    for (int i = 0; i < l->n_groups; i++) complete += l->groups[i].n >= l->cfg.algo.group_size;
    if (complete >= 2 * l->cfg.learner.batch_groups) return;
    mtrl_wire_out o;
    mtrl_wire_out_init(&o);
    for (int i = 0; i < l->n_actors; i++) {
        actor_rec *a = &l->actors[i];
        if (!a->alive || a->owed == 0) continue;
        mtrl_wire_encode_credit(&o, a->owed);
        send_(l, a, &o);
        a->credit += (int64_t)a->owed;
        a->owed = 0;
    }
    mtrl_wire_out_free(&o);
}

// Once per [actor] heartbeat_ms (earlier calls do nothing): sends a heartbeat to every live
// actor; judge: first declares dead those silent for longer than heartbeat_timeout_ms, or
// actor_start_timeout_ms while one has sent nothing since its WELCOME (only where their
// messages are being received: not mid-step).
static void check_heartbeats_(mtrl_learner *l, int judge) {
    double now = mtrl_time_mono();
    if (now - l->last_hb <= 1e-3 * (double)l->cfg.actor.heartbeat_ms) return;
    l->last_hb = now;
    mtrl_wire_out o;
    mtrl_wire_out_init(&o);
    mtrl_wire_encode_heartbeat(&o);
    for (int i = 0; i < l->n_actors; i++) {
        actor_rec *a = &l->actors[i];
        if (!a->alive) continue;
        double timeout = 1e-3 * (double)(a->heard ? l->cfg.learner.heartbeat_timeout_ms : l->cfg.learner.actor_start_timeout_ms);
        if (judge && now - a->last_seen > timeout) {
            size_t n = mtrl_wire_asm_abort_actor(l->asm_, a->id, a->incarnation, "actor stopped heartbeating");
            // Only one that was working (heard since its WELCOME): one still setting up (a model
            // build on a GPU, a slow env create) says HELLO again when it is ready.
            if (a->heard) a->silent_at = now;
            event_(l, MTRL_LOG_WARN, "actor %u (incarnation %u) silent for %.1f s: dead, %zu open episodes aborted", a->id,
                   a->incarnation, now - a->last_seen, n);
            a->alive = 0;
            continue;
        }
        send_(l, a, &o);
    }
    mtrl_wire_out_free(&o);
}

// ---- the context ladder ([stage.N]) ----------------------------------------------------------------------------

// The stage that step `step` (0-based, the next step to take) belongs to.
static int stage_of_(const mtrl_learner *l, long step) { return mtrl_config_stage_of_step(&l->base, step); }

// Applies stage s to the experiment: its context is the episode budget, its document length the
// retrieval env's, its group size and batch the learner's. The actors get a new WELCOME with the
// resolved experiment (they rebuild their episodes) and the current weights. Groups of the old
// stage that are not complete are dropped: the group size may change. next: a stage after the
// first of this process; the weights get a new version (the same values) that marks this
// stage's episodes: those whose prompt has an older version are the previous stage's, which
// the actors were still finishing when the stage changed, and are not trained (commit_).
static void group_drop_(mtrl_learner *l, int i);
static void stage_enter_(mtrl_learner *l, int s, int next) {
    mtrl_config c = mtrl_config_stage(&l->base, s);
    l->cfg = c;
    l->stage = s;
    free(l->config_text);
    l->config_text = mtrl_config_to_ini(&c);
    l->config_hash = mtrl_config_hash(&c);
    mtrl_hash64_hex(l->config_hash, l->config_hash_hex);
    while (l->n_groups) group_drop_(l, l->n_groups - 1);
    if (next) {
        l->model.version++;
        publish_(l);
        l->stage_version = l->model.version;
    }
    event_(l, MTRL_LOG_INFO, "stage %d of %d from step %ld: context %ld tokens, document %ld, group %ld, batch %ld groups", s + 1,
           l->base.n_stages, l->step, c.actor.max_tokens, c.env.doc_tokens, c.algo.group_size, c.learner.batch_groups);
    mtrl_wire_out o;
    mtrl_wire_out_init(&o);
    mtrl_wire_encode_welcome(&o, (uint64_t)l->run_id, l->config_hash, l->model.version, (uint64_t)c.learner.credit_bytes,
                             l->config_text);
    for (int i = 0; i < l->n_actors; i++)
        if (l->actors[i].alive) {
            send_(l, &l->actors[i], &o);
            send_weights_(l, &l->actors[i]);
            l->actors[i].heard = 0; // it rebuilds its episodes and envs
            // The account runs on (the actor's credit_welcome_): bytes it sent before this
            // WELCOME reaches it arrive here after it and are charged once, as it charged them.
            l->actors[i].credit += c.learner.credit_bytes - l->actors[i].credit_welcome;
            l->actors[i].credit_welcome = c.learner.credit_bytes;
        }
    mtrl_wire_out_free(&o);
}

// ---- steps ------------------------------------------------------------------------------------------------------

static void log_metric_(mtrl_learner *l, const char *name, double v) {
    mtrl_error err;
    if (mtrl_store_metric_log(l->store, l->run_id, l->step, name, v, 0, &err) != MTRL_OK) durable_fail_(l, "run store", &err);
}

// The folder of checkpoint `path`'s optimizer shards when several ranks wrote it: ckpt-N.shards
// beside ckpt-N.safetensors, holding the index optimizer.safetensors and its rank files.
static void shards_dir_(char *out, size_t cap, const char *path) {
    size_t n = strlen(path), ext = strlen(".safetensors");
    if (n > ext && !strcmp(path + n - ext, ".safetensors")) n -= ext;
    snprintf(out, cap, "%.*s.shards", (int)n, path);
}

// Removes checkpoint `path`'s shards folder, if it has one (retention).
static void shards_remove_(const char *path) {
    char dir[1300];
    shards_dir_(dir, sizeof dir, path);
    DIR *d = opendir(dir);
    if (!d) return;
    for (struct dirent *e; (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char f[1600];
        snprintf(f, sizeof f, "%s/%s", dir, e->d_name);
        unlink(f);
    }
    closedir(d);
    rmdir(dir);
}

// A checkpoint whose write finished (wait: the one in flight, when there is one): logged in the
// store with its hash, older files past keep_checkpoints removed. A failed write fails the run:
// it must not end as finished with the state it meant to keep lost.
static void checkpoint_done_(mtrl_learner *l, int wait) {
    mtrl_ckpt_done d;
    if (!l->ckpt || !mtrl_ckpt_async_collect(l->ckpt, wait, &d)) return;
    if (d.status != MTRL_OK) {
        event_(l, MTRL_LOG_ERROR, "checkpoint: %s", d.err.msg);
        mtrl_learner_fail(l, "a checkpoint could not be written (the error is above)");
        return;
    }
    LOG_INFO("checkpoint %s written (snapshot %.2f s, then %.1f s in the background)", d.path, d.snapshot_s, d.write_s);
    mtrl_error err;
    if (mtrl_store_checkpoint_log(l->store, l->run_id, d.step, d.version, d.path, d.sha256, &err) != MTRL_OK)
        durable_fail_(l, "run store (checkpoint row)", &err); // a checkpoint no reader can verify
    // Retention: the newest keep_checkpoints files stay (0 = all). Rows stay as history.
    long keep = l->cfg.run.keep_checkpoints;
    if (keep > 0) {
        mtrl_store_checkpoint *rows;
        size_t n;
        if (mtrl_store_checkpoints(l->store, l->run_id, &rows, &n, NULL) == MTRL_OK) {
            for (size_t i = 0; i + (size_t)keep < n; i++) {
                unlink(rows[i].path);
                shards_remove_(rows[i].path);
            }
            free(rows);
        }
    }
}

// Ends the cycle at now: its split goes into the totals and, with log, into this step's metrics.
static void perf_cycle_end_(mtrl_learner *l, double now, int log) {
    l->cyc.wall = now - l->t_cycle;
    if (log) mtrl_perf_log(l->store, l->run_id, l->step, "", &l->cyc);
    mtrl_perf_add(&l->tot, &l->cyc);
    memset(&l->cyc, 0, sizeof l->cyc);
    l->t_cycle = now;
}

// with_optimizer: also the AdamW moments and step (what --resume needs; 3x the bytes). The
// checkpoint after the warm-up holds only the weights (what replay needs). The state is copied
// into a snapshot and written in the background (learner/ckpt_async.h): the step loop waits
// only for a previous checkpoint still being written.
// With several ranks each holds the moments of its own shard only: they are written first, by
// every rank at once, into ckpt-N.shards/ (learner/learner_ranks.h, the index last), and the
// file ckpt-N.safetensors (what mtrl eval, replay and --resume open, the store's row) holds
// the parameters and β, with the index's name and SHA-256 in its metadata. The row is written
// when that file is: a failure before leaves the previous checkpoint the latest.
static void checkpoint_(mtrl_learner *l, int with_optimizer) {
    checkpoint_done_(l, 1);
    char path[1200], step[32], run[32], index_rel[64], index_sha[65];
    snprintf(path, sizeof path, "%s/ckpt-%06ld.safetensors", l->run_dir, l->step);
    snprintf(step, sizeof step, "%ld", l->step);
    snprintf(run, sizeof run, "%lld", (long long)l->run_id);
    const char *meta[] = {"config_hash", l->config_hash_hex, "run", run, "learner_step", step,
                          "optimizer_shards", index_rel, "optimizer_shards_sha256", index_sha};
    int n_meta = 3;
    mtrl_error err;
    if (l->ranks && mtrl_learner_ranks_failed(l->ranks)) {
        event_(l, MTRL_LOG_WARN, "no checkpoint at step %ld: a learner rank failed, the replicas may differ (the last "
               "complete checkpoint is the one to resume)", l->step);
        return;
    }
    if (l->ranks && with_optimizer) {
        char dir[1300], index[1400];
        shards_dir_(dir, sizeof dir, path);
        snprintf(index_rel, sizeof index_rel, "ckpt-%06ld.shards/optimizer.safetensors", l->step);
        snprintf(index, sizeof index, "%s/%s", l->run_dir, index_rel);
        mtrl_status st = mtrl_mkdir_p(dir) == 0 ? MTRL_OK
                         : mtrl_error_set(&err, MTRL_ERR_IO, "%s: cannot create: %s", dir, strerror(errno));
        if (st == MTRL_OK) st = mtrl_learner_ranks_save(l->ranks, index, meta, 3, &err);
        if (st == MTRL_OK && mtrl_sha256_file_hex(index, index_sha) != 0)
            st = mtrl_error_set(&err, MTRL_ERR_IO, "%s: cannot read it back to hash it", index);
        if (st != MTRL_OK) {
            event_(l, MTRL_LOG_ERROR, "checkpoint at step %ld: %s", l->step, err.msg);
            mtrl_learner_fail(l, "a checkpoint could not be written (the error is above)");
            return;
        }
        n_meta = 5;
        with_optimizer = 0; // the moments are in the shards
    }
    if (!l->ckpt) l->ckpt = mtrl_ckpt_async_new();
    if (mtrl_ckpt_async_start(l->ckpt, &l->model, path, l->step, with_optimizer, meta, n_meta, &err) != MTRL_OK) {
        event_(l, MTRL_LOG_ERROR, "checkpoint: %s", err.msg);
        mtrl_learner_fail(l, "a checkpoint could not be written (the error is above)");
    }
}

// How long a due checkpoint waits for the previous write before it is deferred to a later step.
#define CKPT_WAIT_S 2.0

// 1 when no checkpoint write is in flight (a finished one collected), waiting up to `seconds`.
static int checkpoint_idle_(mtrl_learner *l, double seconds) {
    double t0 = mtrl_time_mono();
    for (;;) {
        checkpoint_done_(l, 0);
        if (!l->ckpt || !mtrl_ckpt_async_busy(l->ckpt)) return 1;
        if (mtrl_time_mono() - t0 >= seconds) return 0;
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

static void rl_step_(mtrl_learner *l, int *ready, int n_ready) {
    mtrl_traj **batch = NULL;
    int nb = 0, cap = 0;
    for (int r = 0; r < n_ready; r++) {
        group_buf *g = &l->groups[ready[r]];
        for (int k = 0; k < g->n; k++) {
            if (g->eps[k]->status != MTRL_EP_COMPLETE && g->eps[k]->status != MTRL_EP_TRUNCATED) continue;
            if (nb == cap) {
                cap = cap ? 2 * cap : 64;
                batch = xrealloc(batch, sizeof *batch * (size_t)cap);
            }
            batch[nb++] = g->eps[k];
        }
    }
    mtrl_step_stats st;
    st.loads = l->loads;
    long qb_actor = qb_stats_fold_(l); // summed before the step's own batches; applied after it
    double t_train = mtrl_time_mono();
    if (!l->ranks) {
        mtrl_train_rl_step(&l->model, &l->cfg, &l->algo, batch, nb, &st);
    } else {
        mtrl_error err;
        if (mtrl_learner_ranks_rl_step(l->ranks, &l->cfg, &l->algo, batch, nb, &st, &err) != MTRL_OK) {
            // The replicas may differ now: no publish, no metrics, no checkpoint of this step.
            event_(l, MTRL_LOG_ERROR, "RL step %ld: %s", l->step + 1, err.msg);
            char why[256];
            snprintf(why, sizeof why, "RL step %ld: %.200s", l->step + 1, err.msg);
            mtrl_learner_fail(l, why);
            free(batch);
            return;
        }
    }
    l->cyc.train += mtrl_time_mono() - t_train;
    l->cyc.trained_tokens += (double)st.tokens;
    l->cyc.steps++;
    l->cyc.trained_episodes += (double)st.episodes;
    l->step++;
    // [learner] publish_every: the actors get every N-th version (each publish costs the learner
    // the serialisation and each actor a load); the others stay on the learner.
    double t_pub = 0, pub_serialise = 0;
    if (l->step % l->cfg.learner.publish_every == 0) {
        t_pub = mtrl_time_mono();
        pub_serialise = publish_(l);
        for (int i = 0; i < l->n_actors; i++)
            if (l->actors[i].alive) send_weights_(l, &l->actors[i]);
        t_pub = mtrl_time_mono() - t_pub;
        l->cyc.publish += t_pub;
    }
    // Wall time from the previous step's end: the learner's step plus its wait for episodes.
    double now = mtrl_time_mono(), cycle = l->t_last_step > 0 ? now - l->t_last_step : now - l->t_start;
    l->t_last_step = now;
    mtrl_error err;
    if (mtrl_store_begin(l->store, &err) == MTRL_OK) {
        double el = mtrl_time_mono() - l->t_start;
        log_metric_(l, "reward", st.reward_mean);
        log_metric_(l, "success", st.success_rate);
        log_metric_(l, "loss", st.loss);
        log_metric_(l, "pg_loss", st.pg_loss);
        log_metric_(l, "entropy", st.entropy_mean);
        log_metric_(l, "clip_low", st.clip_low);
        log_metric_(l, "clip_high", st.clip_high);
        log_metric_(l, "clip_dual", st.clip_dual);
        log_metric_(l, "ratio", st.ratio_mean);
        log_metric_(l, "mismatch_k1", st.kl_k1);
        log_metric_(l, "mismatch_k3", st.kl_k3);
        log_metric_(l, "mismatch_absdiff", st.logp_absdiff);
        log_metric_(l, "masked_frac", st.masked_frac);
        log_metric_(l, "token_masked_frac", st.token_masked_frac);
        log_metric_(l, "grad_norm", st.grad_norm);
        log_metric_(l, "staleness_mean", st.staleness_mean);
        log_metric_(l, "staleness_max", st.staleness_max);
        log_metric_(l, "tool_calls", st.tool_calls_mean);
        log_metric_(l, "episode_len", st.episode_len_mean);
        log_metric_(l, "episodes", st.episodes);
        log_metric_(l, "learner_tokens_per_s", st.seconds > 0 ? st.tokens / st.seconds : 0);
        log_metric_(l, "tokens_per_s", el > 0 ? l->tokens_seen / el : 0);
        log_metric_(l, "episodes_per_s", el > 0 ? l->episodes_seen / el : 0);
        log_metric_(l, "step_seconds", st.seconds);
        log_metric_(l, "publish_seconds", t_pub);
        log_metric_(l, "publish_serialise_seconds", pub_serialise);
        log_metric_(l, "cycle_seconds", cycle);
        log_metric_(l, "stale_dropped", (double)l->stale_dropped);
        log_metric_(l, "groups_dropped", (double)l->groups_dropped);
        if (l->stage >= 0) log_metric_(l, "stage_dropped", (double)l->stage_dropped);
        log_metric_(l, "episodes_aborted", (double)l->episodes_by_status[MTRL_EP_ABORTED]);
        log_metric_(l, "episodes_rejected", (double)l->episodes_by_status[MTRL_EP_REJECTED]);
        log_metric_(l, "version", l->model.version);
        if (l->stage >= 0) {
            char name[64];
            log_metric_(l, "stage", l->stage + 1);
            snprintf(name, sizeof name, "reward.stage%d", l->stage + 1);
            log_metric_(l, name, st.reward_mean);
            log_metric_(l, "context", (double)l->cfg.actor.max_tokens);
        }
        const mtrl_model_dims *d = &l->model.dims;
        double worst = 0;
        for (int ly = d->first_dense; ly < d->L; ly++) {
            char name[64];
            snprintf(name, sizeof name, "max_violation.%d", ly);
            log_metric_(l, name, st.max_violation[ly]);
            if (st.max_violation[ly] > worst) worst = st.max_violation[ly];
            for (int e = 0; e < d->E; e++)
                if (mtrl_store_expert_log(l->store, l->run_id, l->step, ly, e, (double)l->loads[(size_t)ly * d->E + e],
                                          (double)l->model.qb_beta[(size_t)ly * d->E + e], &err) != MTRL_OK)
                    durable_fail_(l, "run store", &err);
        }
        log_metric_(l, "max_violation", worst);
        // which episodes this step trained on (episodes.trained_step; never the stale ones)
        uint64_t *ids = xmalloc(sizeof *ids * (size_t)(nb ? nb : 1));
        for (int i = 0; i < nb; i++) ids[i] = batch[i]->episode_id;
        if (mtrl_store_episodes_trained(l->store, l->run_id, l->step, ids, (size_t)nb, &err) != MTRL_OK)
            durable_fail_(l, "run store", &err);
        free(ids);
        if (l->cfg.learner.qb_actor_stats) log_metric_(l, "qb_actor_batches", (double)qb_actor);
        perf_cycle_end_(l, now, 1);
        if (mtrl_store_commit(l->store, &err) != MTRL_OK) durable_fail_(l, "run store", &err);
    } else {
        durable_fail_(l, "run store", &err);
        perf_cycle_end_(l, now, 0);
    }
    l->last_reward = st.reward_mean;
    if (l->cfg.run.checkpoint_every > 0 && l->step % l->cfg.run.checkpoint_every == 0 && !l->ckpt_due) {
        l->ckpt_due = 1;
        l->ckpt_due_waited = 0;
    }
    // A checkpoint due while the previous one is still being written (a 14 GB file of `small`
    // with its moments takes ~85 s on the H200 machine's disk) is taken at the first step after
    // that write ends, rather than stalling training for it (and the actors' heartbeats); a
    // write about to end (a small model's) is waited for, so such runs checkpoint every N steps.
    // The wait is spent once per due checkpoint: the later steps only look, or a long write
    // would cost CKPT_WAIT_S at every step until it ends.
    double t_wait = mtrl_time_mono();
    if (l->ckpt_due && checkpoint_idle_(l, l->ckpt_due_waited ? 0.0 : CKPT_WAIT_S)) {
        double t_ckpt = mtrl_time_mono();
        l->cyc.checkpoint += t_ckpt - t_wait;
        checkpoint_(l, 1);
        l->ckpt_due = 0;
        l->cyc.checkpoint += mtrl_time_mono() - t_ckpt;
    } else if (l->ckpt_due) {
        l->ckpt_due_waited = 1;
        l->cyc.checkpoint += mtrl_time_mono() - t_wait;
    }
    free(batch);
}

// Answers whatever the actors sent and keeps the heartbeats going (the main loop's first half;
// the warm-up calls it between its steps so actors are welcomed, not left waiting).
static void pump_(mtrl_learner *l, int timeout_ms) {
    mtrl_wire_in in;
    mtrl_error err;
    mtrl_status s = mtrl_wire_recv(&l->sock, timeout_ms, &in, &l->rx, &err);
    // A malformed message does not end the turn: a flood of them must drain at the rate it
    // comes (a queue left full stalls the connection in libzmq, see mtrl_learner_create).
    for (int n = 0; s != MTRL_ERR_TIMEOUT && n < 100000; n++) {
        if (s == MTRL_OK) handle_(l, &in);
        else refused_(l, &in, err.msg);
        s = mtrl_wire_recv(&l->sock, 0, &in, &l->rx, &err);
    }
    mtrl_wire_event ev;
    while (mtrl_wire_monitor_next(&l->mon, &ev)) {
        if (ev.event == ZMQ_EVENT_DISCONNECTED) {
            LOG_DEBUG("connection from %s closed", ev.address);
        } else if (mtrl_time_mono() - l->last_mon_warn > 1.0) { // a refused peer retries every 100 ms
            l->last_mon_warn = mtrl_time_mono();
            event_(l, MTRL_LOG_WARN, "connection from %s: %s", ev.address, ev.name);
        }
    }
    check_heartbeats_(l, 1);
    checkpoint_done_(l, 0);
    // Ranks as processes: the followers hear from rank 0 while it collects rollouts.
    if (l->ranks && !l->failed[0] && mtrl_learner_ranks_heartbeat(l->ranks, &err) != MTRL_OK) {
        event_(l, MTRL_LOG_ERROR, "%s", err.msg);
        mtrl_learner_fail(l, "the learner's ranks failed (the error is above)");
    }
    if (l->tick) l->tick(l->tick_user);
}

// The model's segment_hook during a step: a 1M-token episode's step takes minutes, and an actor
// that hears nothing for 3 heartbeat timeouts says HELLO again (and gets a WELCOME with the
// weights after the step). Heartbeats go out; nothing is received (the actors' messages wait
// in the socket for the step's end, when pump_ reads them before judging anyone's silence).
static void step_hook_(void *user) { check_heartbeats_(user, 0); }

// Fails the run when no RL step was taken for [learner] stall_timeout_s, naming what is missing
// (issue 28, item 12: a network dropping full-size packets gave 0 steps in 8 minutes and the run
// never failed).
static void stall_check_(mtrl_learner *l, double now) {
    long limit = l->cfg.learner.stall_timeout_s;
    if (limit <= 0 || now - l->t_progress <= (double)limit) return;
    int live = 0;
    for (int i = 0; i < l->n_actors; i++) live += l->actors[i].alive;
    char why[160];
    if (l->joins == 0)
        snprintf(why, sizeof why, "no actor has connected (is one started, and can it reach %.100s?)", l->sock.endpoint);
    else if (live == 0)
        snprintf(why, sizeof why, "no actor is live (%ld joined; all left or were declared dead)", l->joins);
    else if (l->episodes_seen == 0)
        snprintf(why, sizeof why, "%d actors are connected but no episode has finished (the network may drop their data)", live);
    else
        snprintf(why, sizeof why, "%d actors are connected but too few episodes make a batch (%ld finished, %ld aborted)", live,
                 l->episodes_seen, l->episodes_by_status[MTRL_EP_ABORTED]);
    char msg[sizeof l->failed];
    snprintf(msg, sizeof msg, "no progress: no RL step for %ld s ([learner] stall_timeout_s) at step %ld: %.140s", limit,
             l->step, why);
    mtrl_learner_fail(l, msg);
}

static int actors_live_(const mtrl_learner *l) {
    int live = 0;
    for (int i = 0; i < l->n_actors; i++) live += l->actors[i].alive;
    return live;
}

// ---- progress as JSON lines (mtrl run --json) -------------------------------------------------------------

static int json_on_(const mtrl_learner *l) { return l->progress == MTRL_PROGRESS_JSON; }

static void json_step_(mtrl_learner *l) {
    double el = mtrl_time_mono() - l->t_start;
    mtrl_json_line j;
    mtrl_json_begin(&j, stdout, "step");
    mtrl_json_int(&j, "run", (long long)l->run_id);
    mtrl_json_int(&j, "step", l->step);
    mtrl_json_int(&j, "steps", l->total_steps);
    mtrl_json_num(&j, "reward", l->last_reward);
    mtrl_json_int(&j, "episodes", l->episodes_seen);
    mtrl_json_int(&j, "aborted", l->episodes_by_status[MTRL_EP_ABORTED]);
    mtrl_json_int(&j, "actors", actors_live_(l));
    mtrl_json_num(&j, "episodes_per_s", el > 0 ? l->episodes_seen / el : 0);
    mtrl_json_num(&j, "tokens_per_s", el > 0 ? l->tokens_seen / el : 0);
    mtrl_json_num(&j, "elapsed_s", el);
    mtrl_json_end(&j);
}

static void json_end_(mtrl_learner *l, const char *status, const char *reason) {
    mtrl_json_line j;
    mtrl_json_begin(&j, stdout, "end");
    mtrl_json_int(&j, "run", (long long)l->run_id);
    mtrl_json_str(&j, "status", status);
    mtrl_json_int(&j, "step", l->step);
    mtrl_json_int(&j, "episodes", l->episodes_seen);
    mtrl_json_num(&j, "elapsed_s", mtrl_time_mono() - l->t_start);
    if (reason && reason[0]) mtrl_json_str(&j, "reason", reason);
    mtrl_json_end(&j);
}

// stop: SIGINT / SIGTERM (mtrl_learner_run's flag), checked at every warm-up step: a warm-up of
// thousands of steps must not hold a Ctrl-C for a minute.
static void warmup_(mtrl_learner *l, volatile sig_atomic_t *stop) {
    long steps = l->cfg.warmup.steps;
    if (steps <= 0 || l->model.step > 0) return;
    mtrl_env *env;
    mtrl_error err;
    if (mtrl_env_open_config(&l->cfg, &env, &err) != MTRL_OK) {
        event_(l, MTRL_LOG_ERROR, "warm-up: %s", err.msg);
        return;
    }
    // The demos in the model's own tokens and chat template ([model] tokenizer, chat_template),
    // as the actors frame episodes.
    mtrl_chat chat;
    if (mtrl_chat_init(&chat, &l->cfg.model, (uint32_t)l->model.dims.V, &err) != MTRL_OK) {
        event_(l, MTRL_LOG_ERROR, "warm-up: %s", err.msg);
        mtrl_env_close(env);
        return;
    }
    int B = (int)l->cfg.warmup.batch;
    mtrl_traj *demos = xcalloc((size_t)B, sizeof(mtrl_traj));
    mtrl_traj **dp = xcalloc((size_t)B, sizeof(mtrl_traj *));
    for (int i = 0; i < B; i++) {
        mtrl_traj_init(&demos[i]);
        dp[i] = &demos[i];
    }
    event_(l, MTRL_LOG_INFO, "warm-up: %ld supervised steps on %s demonstrations", steps, mtrl_env_name(env));
    l->warming = 1;
    double recent[10] = {0}; // the last 10 losses ([warmup] target_loss)
    for (long s = 0; s < steps && !*stop && !l->failed[0]; s++) {
        pump_(l, 0);
        int ok = 1;
        for (int i = 0; i < B && ok; i++) {
            uint64_t seed = mtrl_rng_u64((uint64_t)l->cfg.run.seed, mtrl_rng_stream("warmup", 0, 0), (uint64_t)(s * B + i));
            ok = mtrl_train_demo_episode_chat(env, seed, (int)l->cfg.actor.max_tokens, l->model.dims.image_patch,
                                              &chat, &demos[i], &err) == MTRL_OK;
        }
        if (!ok) {
            event_(l, MTRL_LOG_ERROR, "warm-up stopped: %s", err.msg);
            break;
        }
        double loss = 0;
        if (!l->ranks) {
            loss = mtrl_train_sft_step(&l->model, &l->cfg, dp, B, l->cfg.warmup.lr);
        } else if (mtrl_learner_ranks_sft_step(l->ranks, &l->cfg, dp, B, l->cfg.warmup.lr, &loss, &err) != MTRL_OK) {
            event_(l, MTRL_LOG_ERROR, "warm-up step %ld: %s", s + 1, err.msg);
            char why[256];
            snprintf(why, sizeof why, "warm-up step %ld: %.200s", s + 1, err.msg);
            mtrl_learner_fail(l, why);
            break;
        }
        recent[s % 10] = loss;
        if (mtrl_store_metric_log(l->store, l->run_id, -steps + s, "warmup_loss", loss, 0, &err) != MTRL_OK)
            durable_fail_(l, "run store", &err);
        if (l->progress == MTRL_PROGRESS_LINE)
            mtrl_progress_update(&l->prog, s + 1 == steps, "warm-up %ld/%ld | loss %.3f", s + 1, steps, loss);
        if (json_on_(l)) {
            mtrl_json_line j;
            mtrl_json_begin(&j, stdout, "warmup");
            mtrl_json_int(&j, "run", (long long)l->run_id);
            mtrl_json_int(&j, "step", s + 1);
            mtrl_json_int(&j, "steps", steps);
            mtrl_json_num(&j, "loss", loss);
            mtrl_json_num(&j, "elapsed_s", mtrl_time_mono() - l->t_start);
            mtrl_json_end(&j);
        }
        // target_loss: the warm-up teaches the format and stops there, leaving the skill to RL.
        // A mean of 10 steps, since one batch's loss is noisy.
        if (l->cfg.warmup.target_loss > 0 && s >= 9) {
            double mean = 0;
            for (int k = 0; k < 10; k++) mean += recent[k] / 10;
            if (mean < l->cfg.warmup.target_loss) {
                event_(l, MTRL_LOG_INFO, "warm-up: mean loss of the last 10 steps %.3f < [warmup] target_loss %g at step %ld of %ld: RL starts",
                       mean, l->cfg.warmup.target_loss, s + 1, steps);
                break;
            }
        }
    }
    if (l->progress == MTRL_PROGRESS_LINE) mtrl_progress_end(&l->prog);
    // RL starts with a fresh optimizer: the moments of the supervised stage do not carry over.
    mtrl_model_optimizer_reset(&l->model);
    if (l->ranks && !l->failed[0] && mtrl_learner_ranks_optimizer_reset(l->ranks, &err) != MTRL_OK) {
        event_(l, MTRL_LOG_ERROR, "warm-up: %s", err.msg);
        mtrl_learner_fail(l, "the learner's ranks failed in the warm-up (the error is above)");
    }
    for (int i = 0; i < B; i++) mtrl_traj_free(&demos[i]);
    free(demos);
    free(dp);
    mtrl_chat_free(&chat);
    mtrl_env_close(env);
    if (*stop || l->failed[0]) return; // stopped mid warm-up: no half-trained behaviour policy is published or kept
    publish_(l);
    // The warmed-up weights are the first behaviour policy: keep them for replay and rescoring.
    checkpoint_(l, 0);
    // The actors welcomed during the warm-up get the trained weights and their credit now.
    l->warming = 0;
    mtrl_wire_out o;
    mtrl_wire_out_init(&o);
    mtrl_wire_encode_credit(&o, (uint64_t)l->cfg.learner.credit_bytes);
    for (int i = 0; i < l->n_actors; i++)
        if (l->actors[i].alive) {
            send_weights_(l, &l->actors[i]);
            send_(l, &l->actors[i], &o);
            l->actors[i].credit += l->cfg.learner.credit_bytes;
        }
    mtrl_wire_out_free(&o);
}

// ---- lifecycle ---------------------------------------------------------------------------------------------------

static mtrl_status resume_(mtrl_learner *l, mtrl_error *err) {
    mtrl_status st = mtrl_store_run_latest(l->store, &l->run_id, err);
    if (st != MTRL_OK) return mtrl_error_wrap(err, "--resume");
    mtrl_store_checkpoint *rows;
    size_t n;
    if ((st = mtrl_store_checkpoints(l->store, l->run_id, &rows, &n, err)) != MTRL_OK) return st;
    if (n == 0) {
        free(rows);
        return mtrl_error_set(err, MTRL_ERR_NOTFOUND, "--resume: run %lld has no checkpoint to resume from", (long long)l->run_id);
    }
    mtrl_ckpt c;
    st = mtrl_ckpt_verify_digest(rows[n - 1].path, rows[n - 1].digest, err);
    if (st == MTRL_OK) st = mtrl_ckpt_open_file(&c, rows[n - 1].path, err);
    if (st == MTRL_OK) {
        // A changed experiment is allowed (more steps, another learning rate); a changed model
        // is not, and mtrl_model_load refuses it naming the first tensor that differs.
        const char *h = mtrl_ckpt_meta(&c, "config_hash");
        if (h && strcmp(h, l->config_hash_hex))
            event_(l, MTRL_LOG_WARN, "--resume: %s was written with config %s, this config is %s; continuing",
                   rows[n - 1].path, h, l->config_hash_hex);
        // Written by several ranks: the parameters here, the moments in the shards it names (any
        // number of ranks reads them: learner/learner_ranks.h).
        const char *shards = mtrl_ckpt_meta(&c, "optimizer_shards"), *sha = mtrl_ckpt_meta(&c, "optimizer_shards_sha256");
        st = mtrl_model_load(&l->model, &c, !shards, err);
        if (st == MTRL_OK && shards) {
            char index[1400];
            const char *slash = strrchr(rows[n - 1].path, '/');
            snprintf(index, sizeof index, "%.*s%s", slash ? (int)(slash - rows[n - 1].path + 1) : 0, rows[n - 1].path, shards);
            st = sha ? mtrl_ckpt_verify_digest(index, sha, err)
                     : mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: optimizer_shards without its SHA-256", rows[n - 1].path);
            if (st == MTRL_OK) st = mtrl_learner_ranks_load_moments(&l->model, index, err);
            if (st != MTRL_OK) mtrl_error_wrap(err, "--resume");
        }
        const char *ls = mtrl_ckpt_meta(&c, "learner_step");
        if (st == MTRL_OK) l->step = ls ? strtol(ls, NULL, 10) : rows[n - 1].step;
        mtrl_ckpt_close(&c);
    }
    free(rows);
    if (st == MTRL_OK) {
        mtrl_store_run_set_status(l->store, l->run_id, MTRL_RUN_RUNNING, NULL);
        l->resumed = 1;
        event_(l, MTRL_LOG_INFO, "resumed run %lld at step %ld (version %u)", (long long)l->run_id, l->step, l->model.version);
        // A sitting that ended without its final checkpoint (kill -9, a crash, a lost machine)
        // trained steps past the last one: that training is gone and the steps are done again.
        // Say so, and mark their episodes untrained (SIGINT/SIGTERM checkpoint first: nothing lost).
        int64_t lost_to = mtrl_store_max_trained_step(l->store, l->run_id), changed = 0;
        if (lost_to > l->step) {
            if ((st = mtrl_store_episodes_untrain_after(l->store, l->run_id, l->step, &changed, err)) != MTRL_OK) return st;
            event_(l, MTRL_LOG_WARN,
                   "--resume: the previous sitting trained to step %lld but its last checkpoint is of step %ld: steps "
                   "%ld..%lld are lost and done again (%lld of their episodes marked untrained; [run] checkpoint_every = %ld)",
                   (long long)lost_to, l->step, l->step + 1, (long long)lost_to, (long long)changed, l->cfg.run.checkpoint_every);
        }
    }
    return st;
}

mtrl_status mtrl_learner_open(mtrl_learner **out, const mtrl_config *cfg, const mtrl_learner_opts *opts,
                              mtrl_error *err) {
    mtrl_learner *l = xcalloc(1, sizeof *l);
    l->cfg = *cfg;
    l->base = *cfg;
    l->stage = -1;
    l->total_steps = cfg->run.steps;
    if (cfg->n_stages > 0) {
        l->total_steps = 0;
        for (int s = 0; s < cfg->n_stages; s++) l->total_steps += cfg->stage[s].steps;
    }
    l->progress = opts ? opts->progress : 0;
    l->tick = opts ? opts->tick : NULL;
    omp_set_num_threads(mtrl_config_threads(cfg));
    l->tick_user = opts ? opts->tick_user : NULL;
    l->rl_seconds = opts ? opts->rl_seconds : 0;
    mtrl_progress_init(&l->prog, 5.0);
    l->config_text = mtrl_config_to_ini(cfg);
    l->config_hash = mtrl_config_hash(cfg);
    mtrl_hash64_hex(l->config_hash, l->config_hash_hex);
    mtrl_status st = mtrl_train_algo_config(cfg, &l->algo, err);
    mtrl_model_dims d;
    if (st == MTRL_OK) st = mtrl_model_dims_from_config(&d, cfg, MTRL_VOCAB, err);
    int device = MTRL_DEVICE_CPU, gpu = 0;
    if (st == MTRL_OK && mtrl_model_parse_device(cfg->model.device, &device, &gpu) != 0)
        st = mtrl_error_set(err, MTRL_ERR_USAGE, "%s: [model] device = %s: expected cpu or cuda", cfg->path, cfg->model.device);
    // [learner] ranks / gpus: R data-parallel ranks, rank 0 on [model] device (where the actors
    // run and the weights are published); R > 1 starts the others below (learner/learner_ranks.h).
    char why[400];
    int n_ranks = st == MTRL_OK ? mtrl_config_ranks(cfg, NULL, why, sizeof why) : 1;
    if (n_ranks < 0) st = mtrl_error_set(err, MTRL_ERR_USAGE, "%s: %s", cfg->path, why);
    // Under a launcher the ranks are its processes (this one rank 0): see mtrl_learner_ranks_check_launch.
    const mtrl_dist_launch *launch = opts && opts->launch && opts->launch->world > 1 ? opts->launch : NULL;
    if (st == MTRL_OK && launch) {
        st = mtrl_learner_ranks_check_launch(cfg, launch, err);
        n_ranks = launch->world;
    }
    // [learner] expert_parallel refused before anything is built (a GPU model, no experts).
    if (st == MTRL_OK && (st = mtrl_learner_ranks_check_ep(cfg, &d, err)) != MTRL_OK) mtrl_error_wrap(err, "%s", cfg->path);
    if (st == MTRL_OK) st = mtrl_model_init_on(&l->model, &d, (uint64_t)cfg->run.seed, device, gpu, err);
    if (st == MTRL_OK) mtrl_qb_set_mode(&l->model, cfg->learner.qb ? MTRL_QB_TRAIN : MTRL_QB_FROZEN);
    // A run that starts from a Hugging Face checkpoint takes its weights and correction biases
    // (QB beta); a resumed one gets them from its own checkpoint below.
    if (st == MTRL_OK && cfg->model.from[0] && !(opts && opts->resume)) {
        mtrl_hf_load_stats ls;
        st = mtrl_model_load_hf(&l->model, cfg->model.from, &ls, err);
        if (st == MTRL_OK)
            LOG_INFO("learner: loaded %s: %d tensors, %.1f MB in %.2f s (%.2f GB/s)", cfg->model.from, ls.tensors, ls.bytes / 1e6,
                     ls.seconds, ls.seconds > 0 ? ls.bytes / ls.seconds / 1e9 : 0.0);
    }
    if (st == MTRL_OK && mtrl_mkdir_p(cfg->run.out_dir) != 0)
        st = mtrl_error_set(err, MTRL_ERR_IO, "[run] out_dir %s: cannot create: %s", cfg->run.out_dir, strerror(errno));
    if (st != MTRL_OK) {
        if (l->model.params.base) mtrl_model_free(&l->model);
        free(l->config_text);
        free(l);
        return st;
    }
    l->loads = xcalloc((size_t)d.L * (size_t)d.E, sizeof(long));
    l->actor_qb_sum = xcalloc((size_t)d.L * (size_t)d.E, sizeof(double));
    l->actor_qb_n = xcalloc((size_t)d.L, sizeof(long));
    const char *db = opts && opts->db ? opts->db : cfg->run.db;
    st = mtrl_store_open(&l->store, db, 0, err);
    if (st == MTRL_OK) {
        if (opts && opts->resume) {
            st = resume_(l, err);
        } else {
            char hex[17];
            mtrl_hash64_hex(l->config_hash, hex);
            mtrl_store_run_info info = {cfg->run.name, l->config_text, hex, NULL, NULL, 0};
            st = mtrl_store_run_create(l->store, &info, &l->run_id, err);
        }
    }
    if (st == MTRL_OK && (st = mtrl_run_dir_claim(l->run_dir, sizeof l->run_dir, cfg->run.out_dir, db, l->run_id, err)) != MTRL_OK) {
        mtrl_store_event_log(l->store, l->run_id, MTRL_LOG_ERROR, err->msg, NULL);
        mtrl_store_run_set_status(l->store, l->run_id, MTRL_RUN_FAILED, NULL);
    }
    if (st == MTRL_OK) {
        snprintf(l->traj_path, sizeof l->traj_path, "%s/traj-run%lld.bin", l->run_dir, (long long)l->run_id);
        st = mtrl_trajfile_writer_open(&l->tw, l->traj_path, 0, err);
    }
    // The other ranks copy rank 0's state as it is now: initialised, or loaded (Hugging Face
    // weights, a resumed checkpoint).
    if (st == MTRL_OK && launch) {
        mtrl_dist_rendezvous rv = mtrl_dist_rendezvous_of(launch);
        st = mtrl_learner_ranks_init_process(&l->ranks, &l->model, cfg, 0, launch->world, &rv, err);
        if (st != MTRL_OK) {
            mtrl_store_event_log(l->store, l->run_id, MTRL_LOG_ERROR, err->msg, NULL);
            mtrl_store_run_set_status(l->store, l->run_id, MTRL_RUN_FAILED, NULL);
        }
    } else if (st == MTRL_OK && n_ranks > 1 && (st = mtrl_learner_ranks_init(&l->ranks, &l->model, cfg, err)) != MTRL_OK) {
        mtrl_store_event_log(l->store, l->run_id, MTRL_LOG_ERROR, err->msg, NULL);
        mtrl_store_run_set_status(l->store, l->run_id, MTRL_RUN_FAILED, NULL);
    }
    if (st == MTRL_OK) {
        l->zctx = zmq_ctx_new();
        l->lim = mtrl_wire_limits_default();
        // An actor keeps every slot busy (episodes_in_flight rounded up to whole groups, as
        // mtrl_rollout_params_from_config sizes them): that many episodes may be open at once.
        // With [stage.N] sections, the largest of any stage.
        for (int s = -1; s < cfg->n_stages; s++) {
            mtrl_config c = s < 0 ? *cfg : mtrl_config_stage(cfg, s);
            uint32_t g = (uint32_t)c.algo.group_size, slots = ((uint32_t)c.actor.episodes_in_flight + g - 1) / g * g;
            if (slots > l->lim.max_open_per_actor) l->lim.max_open_per_actor = slots;
        }
        mtrl_wire_sockopts so = mtrl_wire_sockopts_default();
        // ZeroMQ's heartbeat drops a connection silently, losing what was in flight: give it the
        // same patience as the application's own heartbeat, which aborts episodes explicitly.
        so.heartbeat_timeout_ms = (int)cfg->learner.heartbeat_timeout_ms;
        // No ZMTP heartbeats from the ROUTER's side (the actors' DEALERs still send theirs, and
        // the application heartbeat judges the actors): in libzmq 4.3.4 the PING timer of a
        // connection whose input stopped at the high-water mark and whose peer then hung up
        // writes to it after the engine marked it failed and aborts the process
        // (`!_io_error`, stream_engine_base.cpp:331; zeromq/libzmq#4364): 10^6 tiny garbage
        // frames while the learner is busy, then a hang-up, did it (issue 28, item 2).
        so.heartbeat_ivl_ms = 0;
        if (cfg->learner.curve_key[0])
            st = mtrl_wire_auth_server_init(&l->auth, l->zctx, cfg->learner.curve_key, cfg->learner.curve_allow, &so, err);
        if (st == MTRL_OK) st = mtrl_wire_router_open(&l->sock, l->zctx, cfg->learner.endpoint, &l->lim, &so, err);
        mtrl_wire_key_wipe(&so, sizeof so);
        if (st == MTRL_OK &&
            mtrl_wire_monitor_open(&l->mon, &l->sock,
                                   ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                                       ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH,
                                   err) != MTRL_OK)
            LOG_WARN("%s", err->msg);
    }
    if (st != MTRL_OK) {
        mtrl_learner_close(l);
        return st;
    }
    l->asm_ = mtrl_wire_asm_new(&l->lim);
    mtrl_peer_guard_init(&l->guard, 1000, 2.0);
    l->model.segment_hook = step_hook_;
    l->model.segment_hook_user = l;
    mtrl_wbuf_init(&l->scratch);
    if ((st = mtrl_weights_pub_init(&l->pub, &l->model, &cfg->learner, err)) != MTRL_OK) {
        mtrl_learner_close(l);
        return st;
    }
    publish_(l);
    char ranks[400] = "one rank";
    if (launch)
        snprintf(ranks, sizeof ranks, "%d data-parallel learner ranks: processes of a %s launch, rank 0 here (zmq backend, "
                 "rendezvous %s:%d)", launch->world, launch->source, launch->host, launch->port);
    else if (l->ranks) mtrl_learner_ranks_describe(cfg, ranks, sizeof ranks);
    event_(l, MTRL_LOG_INFO, "run %lld (%s): learner on %s, model %zu parameters, %s, store %s", (long long)l->run_id,
           cfg->run.name, l->sock.endpoint, mtrl_model_param_count(&l->model), ranks, db);
    *out = l;
    return MTRL_OK;
}

const char *mtrl_learner_endpoint(const mtrl_learner *l) { return l->sock.endpoint; }
const char *mtrl_learner_actor_error(const mtrl_learner *l) { return l->actor_error; }
long long mtrl_learner_run_id(const mtrl_learner *l) { return (long long)l->run_id; }

int mtrl_learner_run(mtrl_learner *l, volatile sig_atomic_t *stop) {
    l->t_start = mtrl_time_mono();
    warmup_(l, stop);
    l->t_rl = l->t_cycle = l->t_progress = mtrl_time_mono();
    memset(&l->cyc, 0, sizeof l->cyc);
    memset(&l->tot, 0, sizeof l->tot);
    l->tot.warmup = l->t_rl - l->t_start;
    if (*stop) goto killed;
    double deadline = l->cfg.run.max_minutes > 0 ? l->t_start + 60.0 * l->cfg.run.max_minutes : 0;
    // room for the largest batch of any stage; the group size and batch are read from l->cfg at
    // every iteration, which stage_enter_ sets
    long max_need = l->base.learner.batch_groups;
    for (int s = 0; s < l->base.n_stages; s++) {
        long n = mtrl_config_stage(&l->base, s).learner.batch_groups;
        if (n > max_need) max_need = n;
    }
    int *ready = xmalloc(sizeof(int) * (size_t)max_need);
    mtrl_traj popped;
    mtrl_traj_init(&popped);
    if (l->base.n_stages > 0) stage_enter_(l, stage_of_(l, l->step), 0);
    // A fresh run that is to stop before the stage it starts in (stop_before_stage = 1: the
    // warm-up alone, a checkpoint of the policy before any RL step) stops here; the loop below
    // sees stage changes only. A resumed sitting goes on into the stage it starts in.
    int stop_at_start = l->base.n_stages > 0 && !l->resumed && l->cfg.run.stop_before_stage == stage_of_(l, l->step) + 1;
    if (stop_at_start)
        event_(l, MTRL_LOG_INFO, "[run] stop_before_stage %ld: stopping at step %ld, before stage %d",
               l->cfg.run.stop_before_stage, l->step, stage_of_(l, l->step) + 1);
    while (!stop_at_start && l->step < l->total_steps && !*stop && !l->failed[0]) {
        int s = l->base.n_stages > 0 ? stage_of_(l, l->step) : -1;
        if (s != l->stage) {
            // stop_before_stage: a sitting ends here with a checkpoint; --resume starts in it
            if (s + 1 == l->cfg.run.stop_before_stage) {
                event_(l, MTRL_LOG_INFO, "[run] stop_before_stage %ld: stopping at step %ld, before stage %d",
                       l->cfg.run.stop_before_stage, l->step, s + 1);
                break;
            }
            double t_stage = mtrl_time_mono();
            stage_enter_(l, s, 1);
            l->cyc.publish += mtrl_time_mono() - t_stage; // a new version for the stage
        }
        mtrl_error err;
        double t_wait = mtrl_time_mono();
        pump_(l, 20);
        l->cyc.wait += mtrl_time_mono() - t_wait;
        // The closed episodes go into the store as one transaction. A busy store (a reader's
        // checkpoint past the 5 s busy timeout) is transient: the episodes wait in the assembler
        // for the next round. Any other failure stops the run (durable_fail_).
        mtrl_status bst = mtrl_store_begin(l->store, &err);
        if (bst == MTRL_OK) {
            while (mtrl_wire_asm_pop(l->asm_, &popped)) commit_(l, &popped);
            if (mtrl_store_commit(l->store, &err) != MTRL_OK) durable_fail_(l, "run store (episode batch)", &err);
        } else if (bst == MTRL_ERR_TIMEOUT) {
            LOG_WARN("run store busy, the episodes wait: %s", err.msg);
        } else {
            durable_fail_(l, "run store (episode batch)", &err);
        }
        grant_credit_(l);
        double now = mtrl_time_mono();
        int G = (int)l->cfg.algo.group_size, need = (int)l->cfg.learner.batch_groups;
        // Final groups: train on those with at least 2 trainable episodes, drop the others.
        int n_ready = 0;
        for (int i = 0; i < l->n_groups && n_ready < need; i++) {
            if (!group_final_(l, &l->groups[i], now)) continue;
            int stale = group_stale_eps_(l, &l->groups[i]);
            if (stale) { // one policy per group: a group with a stale episode leaves whole
                l->stale_dropped += stale;
                l->groups_dropped++;
                group_drop_(l, i--);
                continue;
            }
            if (group_trainable_(&l->groups[i]) < (G > 1 ? 2 : 1)) {
                l->groups_dropped++;
                group_drop_(l, i--);
                continue;
            }
            ready[n_ready++] = i;
        }
        if (n_ready == need) {
            rl_step_(l, ready, n_ready);
            l->t_progress = mtrl_time_mono();
            if (json_on_(l)) json_step_(l);
            // drop the consumed groups, highest index first so the others keep their place
            for (int r = n_ready - 1; r >= 0; r--) group_drop_(l, ready[r]);
        }
        if (l->progress == MTRL_PROGRESS_LINE) {
            int live = 0;
            for (int i = 0; i < l->n_actors; i++) live += l->actors[i].alive;
            double el = mtrl_time_mono() - l->t_start;
            mtrl_progress_update(&l->prog, 0, "step %ld/%ld | reward %.3f | %.1f episodes/s | %.0f tokens/s | actors %d | aborted %ld",
                                 l->step, l->total_steps, l->last_reward, el > 0 ? l->episodes_seen / el : 0,
                                 el > 0 ? l->tokens_seen / el : 0, live, l->episodes_by_status[MTRL_EP_ABORTED]);
        }
        stall_check_(l, now);
        if (deadline > 0 && now > deadline) {
            event_(l, MTRL_LOG_WARN, "[run] max_minutes reached at step %ld", l->step);
            break;
        }
        if (l->rl_seconds > 0 && mtrl_time_mono() - l->t_rl >= l->rl_seconds) {
            event_(l, MTRL_LOG_INFO, "%.0f s of RL done at step %ld (mtrl bench rl)", l->rl_seconds, l->step);
            break;
        }
    }
    mtrl_traj_free(&popped);
    free(ready);
    // A run failed from outside (mtrl run's supervisor: no actor can run it) may have the actors'
    // last words still in the socket: they sent their error before exiting, so it is there to read.
    for (int n = 0; n < 10 && l->failed[0] && actors_live_(l) > 0; n++) pump_(l, 100);
    if (l->progress == MTRL_PROGRESS_LINE) mtrl_progress_end(&l->prog);
    // The totals of this sitting's RL (learner/perf.h), before the final checkpoint.
    perf_cycle_end_(l, mtrl_time_mono(), 0);
    mtrl_perf_log(l->store, l->run_id, l->step, "rl.", &l->tot);
    // Tell the actors the run is over before the final checkpoint: they have nothing left to
    // do, and a large one (`small` with its moments: 14 GB, ~85 s to the H200 machine's disk,
    // after the previous write ends) outlasts their patience with a silent learner.
    mtrl_wire_out o;
    mtrl_wire_out_init(&o);
    mtrl_wire_encode_bye(&o, *stop ? "run killed" : "run finished");
    for (int i = 0; i < l->n_actors; i++)
        if (l->actors[i].alive) send_(l, &l->actors[i], &o);
    mtrl_wire_out_free(&o);
    double t_final = mtrl_time_mono();
    checkpoint_(l, 1); // none when a rank failed (the replicas may differ)
    checkpoint_done_(l, 1); // the last checkpoint is on disk and logged before the run ends
    LOG_INFO("final checkpoint: %.1f s (the previous write's end included)", mtrl_time_mono() - t_final);
    if (*stop) goto killed;
    mtrl_error err;
    if (l->failed[0]) {
        event_(l, MTRL_LOG_ERROR, "run %lld failed at step %ld: %s%s%s", (long long)l->run_id, l->step, l->failed,
               l->actor_error[0] ? "; the last actor error: " : "", l->actor_error);
        // On a full store this may fail too: the run stays `running`, and the next writer's
        // mtrl_store_open marks it failed (its lock is gone); never `finished`.
        if (mtrl_store_run_set_status(l->store, l->run_id, MTRL_RUN_FAILED, &err) != MTRL_OK)
            LOG_ERROR("run %lld: the status `failed` could not be stored: %s", (long long)l->run_id, err.msg);
        if (json_on_(l)) json_end_(l, "failed", l->failed);
        return 1;
    }
    if (mtrl_store_run_set_status(l->store, l->run_id, MTRL_RUN_FINISHED, &err) != MTRL_OK) {
        LOG_ERROR("run %lld: the status `finished` could not be stored: %s", (long long)l->run_id, err.msg);
        if (json_on_(l)) json_end_(l, "failed", err.msg);
        return 1;
    }
    if (json_on_(l)) json_end_(l, "finished", NULL);
    event_(l, MTRL_LOG_INFO, "run %lld finished: %ld steps, %ld episodes (%ld complete, %ld truncated, %ld aborted, %ld rejected)",
           (long long)l->run_id, l->step, l->episodes_seen, l->episodes_by_status[MTRL_EP_COMPLETE],
           l->episodes_by_status[MTRL_EP_TRUNCATED], l->episodes_by_status[MTRL_EP_ABORTED],
           l->episodes_by_status[MTRL_EP_REJECTED]);
    return 0;
killed:
    mtrl_store_run_set_status(l->store, l->run_id, MTRL_RUN_KILLED, NULL);
    event_(l, MTRL_LOG_WARN, "run %lld killed at step %ld", (long long)l->run_id, l->step);
    if (json_on_(l)) json_end_(l, "killed", NULL);
    return 1;
}

double mtrl_learner_actor_silent_since(const mtrl_learner *l, uint32_t id) {
    double t = 0;
    for (int i = 0; i < l->n_actors; i++) {
        const actor_rec *a = &l->actors[i];
        if (a->id != id) continue;
        if (a->alive) return 0;
        if (a->silent_at > t) t = a->silent_at;
    }
    return t;
}

void mtrl_learner_fail(mtrl_learner *l, const char *why) {
    snprintf(l->failed, sizeof l->failed, "%s", why && why[0] ? why : "failed");
}

void mtrl_learner_close(mtrl_learner *l) {
    if (!l) return;
    mtrl_error err;
    if (l->tw.fd >= 0 && l->tw.path) mtrl_trajfile_writer_close(&l->tw, &err);
    mtrl_wire_monitor_close(&l->mon);
    mtrl_wire_sock_close(&l->sock);
    mtrl_wire_auth_server_free(l->auth); // after the ROUTER, before zmq_ctx_term
    if (l->zctx) zmq_ctx_term(l->zctx);
    mtrl_wire_asm_free(l->asm_);
    while (l->n_groups) group_drop_(l, l->n_groups - 1);
    free(l->groups);
    mtrl_store_close(l->store);
    mtrl_ckpt_async_free(l->ckpt);
    mtrl_weights_pub_free(&l->pub); // before the model: device slots wait for its stream
    mtrl_learner_ranks_free(l->ranks); // the followers, before rank 0's model
    mtrl_model_free(&l->model);
    mtrl_wbuf_free(&l->scratch);
    wmsg_free_(l);
    free(l->loads);
    free(l->actor_qb_sum);
    free(l->actor_qb_n);
    free(l->config_text);
    free(l);
}
