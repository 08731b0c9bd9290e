// replay_model.c: `mtrl replay --rescore` and `--reexec` (see replay.h): the model side of
// replay.
//
// Weights. A token's version is the weight version that produced it; the learner saves a
// checkpoint every [run] checkpoint_every steps, and the checkpoints table gives each file's
// version. Version 0 is the initial weights, which mtrl_model_init re-creates bit for bit from
// [run] seed (learner and actors start from them), so it needs no file. A checkpoint is
// "retained" when its file still exists ([run] keep_checkpoints deletes old ones).
//
// Rescore computes the learner's log-prob of every token exactly as an RL step does
// (mtrl_model_forward over the whole episode with [learner] segment, resolved by the planner as
// the learner resolves it (model_plan.h mtrl_model_segment_resolve); token j's log-prob is
// position j-1's) and compares it with the behaviour log-prob over MODEL tokens through
// mtrl_algo_mismatch_report. The actor samples at [actor] temperature and top-p, and its
// behaviour log-prob is of that transformed distribution (kernels/ref sample_logits); the
// learner trains against temperature-1 log-probs. When the transform is not the identity, the
// learner's log-probs under the same transform are reported too (they isolate the numerical
// mismatch from the transform).
//
// Re-execution runs mtrl_rollout_run_one with the episode's actor id and incarnation, task
// seed, episode and group ids: the sampling stream depends only on the episode id, so the same
// weights and env give the same episode token for token.
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "actor/rollout.h"
#include "common/check.h"
#include "common/checkpoint.h"
#include "common/fsutil.h"
#include "model/model.h"
#include "model/qb.h"
#include "model/model_plan.h"
#include "common/tokenizer.h"
#include "env/env_config.h"
#include "tools/replay.h"

// ---- weights ------------------------------------------------------------------------------------

// The newest retained checkpoint of version v, or -1. path receives its resolved file.
static long ckpt_exact_(const replay_session *s, uint32_t v, char *path, size_t cap) {
    for (size_t i = s->n_ckpts; i-- > 0;) {
        if (s->ckpts[i].version != v) continue;
        replay_resolve_path(s->db, s->ckpts[i].path, path, cap);
        if (access(path, R_OK) == 0) return (long)i;
    }
    return -1;
}

// The retained checkpoint with the smallest version > v (newer = 1) or the largest < v.
static long ckpt_nearest_(const replay_session *s, uint32_t v, int newer, char *path, size_t cap) {
    long best = -1;
    char p[4096];
    for (size_t i = 0; i < s->n_ckpts; i++) {
        uint32_t cv = s->ckpts[i].version;
        if (newer ? cv <= v : cv >= v) continue;
        if (best >= 0 && (newer ? cv >= s->ckpts[best].version : cv <= s->ckpts[best].version)) continue;
        replay_resolve_path(s->db, s->ckpts[i].path, p, sizeof p);
        if (access(p, R_OK) != 0) continue;
        best = (long)i;
        snprintf(path, cap, "%s", p);
    }
    return best;
}

// "1, 2, 5" — the versions of the retained checkpoints.
static void retained_list_(const replay_session *s, char *out, size_t cap) {
    out[0] = 0;
    char p[4096];
    int n = 0;
    for (size_t i = 0; i < s->n_ckpts; i++) {
        replay_resolve_path(s->db, s->ckpts[i].path, p, sizeof p);
        if (access(p, R_OK) != 0) continue;
        size_t l = strlen(out);
        snprintf(out + l, cap - l, "%s%u", n++ ? ", " : "", s->ckpts[i].version);
    }
    if (!n) snprintf(out, cap, "none");
}

// The digest the store recorded for the checkpoint file at path (resolved, or as given with
// --checkpoint), or NULL when none of this run's rows names that file.
static const char *recorded_digest_(const replay_session *s, const char *path) {
    char want[4096], p[4096], real[4096];
    if (mtrl_path_real(path, want, sizeof want) != 0) return NULL;
    for (size_t i = 0; i < s->n_ckpts; i++) {
        replay_resolve_path(s->db, s->ckpts[i].path, p, sizeof p);
        if (mtrl_path_real(p, real, sizeof real) == 0 && !strcmp(real, want)) return s->ckpts[i].digest;
    }
    return NULL;
}

static mtrl_status model_dims_(const replay_session *s, mtrl_model_dims *d, mtrl_error *err) {
    mtrl_status st = mtrl_model_dims_from_config(d, &s->cfg, MTRL_VOCAB, err);
    if (st != MTRL_OK) return mtrl_error_wrap(err, "run %lld [model]", (long long)s->run);
    return MTRL_OK;
}

// (Re)creates *m with the run's dims and initial weights, then loads path unless it is NULL.
// *inited tracks whether m holds a model to free.
static mtrl_status model_load_(const replay_session *s, mtrl_model *m, int *inited, const char *path, mtrl_error *err) {
    mtrl_model_dims d;
    mtrl_status st = model_dims_(s, &d, err);
    if (st != MTRL_OK) return st;
    if (*inited) mtrl_model_free(m);
    // Replay rescoring runs on the CPU: the fp32 reference the actor's numbers are checked against.
    mtrl_model_init(m, &d, (uint64_t)s->cfg.run.seed);
    *inited = 1;
    mtrl_qb_set_mode(m, MTRL_QB_FROZEN); // replay never moves β
    m->version = 0;
    if (!path) return MTRL_OK;
    // A file that changed since the run wrote it (another run's, same out_dir) would show up as a
    // divergence of log-probs; say what it is instead.
    st = mtrl_ckpt_verify_digest(path, recorded_digest_(s, path), err);
    if (st != MTRL_OK) return st;
    mtrl_ckpt c;
    st = mtrl_ckpt_open_file(&c, path, err);
    if (st != MTRL_OK) return st;
    st = mtrl_model_load(m, &c, 0, err);
    mtrl_ckpt_close(&c);
    return st;
}

// ---- log-probs ----------------------------------------------------------------------------------

// log-prob of token x under logits l[V] transformed as the actor samples (temperature, top-p).
static double sampled_logp_(const real *l, int V, uint32_t x, double temp, double top_p, int *order) {
    int amax = 0;
    for (int v = 1; v < V; v++)
        if (l[v] > l[amax]) amax = v;
    double m = (double)l[amax];
    if (!(temp > 0)) temp = 1.0; // greedy: the actor reports the temperature-1 log-prob
    double invT = 1.0 / temp, total = 0;
    for (int v = 0; v < V; v++) total += exp(((double)l[v] - m) * invT);
    if (!(top_p < 1)) return ((double)l[x] - m) * invT - log(total);
    // nucleus: the smallest prefix (by descending logit) with mass >= top_p * total
    for (int v = 0; v < V; v++) order[v] = v;
    // insertion sort is fine for small V; use a simple selection over the prefix otherwise
    double need = top_p * total, mass = 0;
    int in = 0;
    for (int n = 0; n < V; n++) {
        int best = n;
        for (int j = n + 1; j < V; j++)
            if (l[order[j]] > l[order[best]]) best = j;
        int tmp = order[n];
        order[n] = order[best];
        order[best] = tmp;
        mass += exp(((double)l[order[n]] - m) * invT);
        if ((uint32_t)order[n] == x) in = 1;
        if (mass >= need) break;
    }
    if (!in) return -INFINITY;
    return ((double)l[x] - m) * invT - log(mass);
}

// The episode's pictures as m's patch table (docs/multimodal.md); the caller frees the result
// (NULL when it has none) after its calls on m.
static uint8_t *patches_on_(mtrl_model *m, const mtrl_traj *t) {
    mtrl_model_set_patches(m, NULL, 0);
    int P = m->dims.image_patch;
    if (!t->n_images || P <= 0) return NULL;
    size_t rows = mtrl_traj_patch_rows(t);
    uint8_t *tab = xmalloc(rows * (size_t)(3 * P * P) + 1);
    mtrl_traj_patch_table(t, tab);
    mtrl_model_set_patches(m, tab, (int)rows);
    return tab;
}

// Learner log-probs of t's tokens under m into lp[j] for the tokens with sel[j] != 0; with
// adj != NULL also the log-probs under the sampling transform.
// routing = 1: replay the actor's recorded routing, as the learner does with [algo] routing_replay.
// setting: [learner] segment (mtrl_config_segment). MTRL_OK, or the resolver's error (nothing
// written).
static mtrl_status score_(mtrl_model *m, const mtrl_traj *t, long setting, int routing, const uint8_t *sel, float *lp,
                          float *adj, double temp, double top_p, mtrl_error *err) {
    size_t T = (size_t)t->n_tokens;
    const uint32_t *toks[1] = {t->ids};
    const uint8_t *rt[1] = {t->routing};
    int len[1] = {(int)T};
    mtrl_batch b = {1, toks, len, routing ? rt : NULL};
    int segment = 0;
    mtrl_status st = mtrl_model_segment_resolve(m, &b, setting, &segment, NULL, err);
    if (st != MTRL_OK) return st;
    real *pos = xcalloc(T + 1, sizeof(real));
    uint8_t *tab = patches_on_(m, t);
    m->replay_routing = routing;
    mtrl_model_forward(m, &b, segment, pos, NULL, NULL);
    m->replay_routing = 0;
    for (size_t j = 1; j < T; j++)
        if (sel[j]) lp[j] = (float)pos[j - 1];
    free(pos);
    if (!adj) {
        mtrl_model_set_patches(m, NULL, 0);
        free(tab);
        return MTRL_OK;
    }
    int V = m->dims.V;
    real *logits = xmalloc(sizeof(real) * T * (size_t)V);
    int *order = xmalloc(sizeof(int) * (size_t)V);
    mtrl_model_logits(m, t->ids, (int)T, segment, logits);
    for (size_t j = 1; j < T; j++)
        if (sel[j]) adj[j] = (float)sampled_logp_(logits + (j - 1) * (size_t)V, V, t->ids[j], temp, top_p, order);
    mtrl_model_set_patches(m, NULL, 0);
    free(tab);
    free(order);
    free(logits);
    return MTRL_OK;
}

// ---- rescore ------------------------------------------------------------------------------------

void replay_rescore_free(replay_rescore *r) {
    free(r->learner);
    free(r->adjusted);
    free(r->mask);
    free(r->used);
    free(r->w);
    memset(r, 0, sizeof *r);
}

// Fills w for the tokens of version v (default weights). Returns 0 when no weights exist at all.
static int weights_for_(const replay_session *s, uint32_t v, replay_weights *w) {
    memset(w, 0, sizeof *w);
    w->want = v;
    if (ckpt_exact_(s, v, w->path, sizeof w->path) >= 0) {
        w->used = v;
        w->found = 1;
        snprintf(w->note, sizeof w->note, "exact");
        return 1;
    }
    if (v == 0) {
        w->used = 0;
        w->found = 1;
        w->initial = 1;
        snprintf(w->note, sizeof w->note, "exact: version 0 needs no checkpoint");
        return 1;
    }
    long k = ckpt_nearest_(s, v, 1, w->path, sizeof w->path);
    if (k >= 0) {
        w->used = s->ckpts[k].version;
        snprintf(w->note, sizeof w->note, "version %u is not retained; used the nearest newer retained one", v);
        return 1;
    }
    k = ckpt_nearest_(s, v, 0, w->path, sizeof w->path);
    if (k >= 0) {
        w->used = s->ckpts[k].version;
        snprintf(w->note, sizeof w->note, "version %u is not retained and none newer is; used the nearest older one", v);
        return 1;
    }
    return 0;
}

mtrl_status replay_rescore_run(replay_session *s, const replay_rescore_opts *o, replay_rescore *r, mtrl_error *err) {
    memset(r, 0, sizeof *r);
    const mtrl_traj *t = &s->t;
    size_t T = (size_t)t->n_tokens;
    if (T > (size_t)INT32_MAX) return mtrl_error_set(err, MTRL_ERR_LIMIT, "episode of %zu tokens is too long to score", T);
    r->T = T;
    r->temperature = s->cfg.actor.temperature;
    r->top_p = s->cfg.actor.top_p;
    r->learner = xcalloc(T + 1, sizeof(float));
    r->mask = xcalloc(T + 1, 1);
    r->used = xcalloc(T + 1, sizeof(uint32_t));
    size_t n_model = 0;
    for (size_t j = 1; j < T; j++) {
        r->mask[j] = t->kind[j] == MTRL_TOK_MODEL;
        n_model += r->mask[j];
    }
    int transform = r->temperature > 0 && (r->temperature != 1.0 || r->top_p < 1.0);
    mtrl_model_dims d;
    mtrl_status st = model_dims_(s, &d, err);
    if (st != MTRL_OK) goto fail;
    // routing replay (R3) exactly when the learner would use it for this episode
    int has_routing = t->routing && t->routing_width == (uint32_t)(d.n_moe * d.k) && !(t->flags & MTRL_TRAJ_ROUTING_U16);
    r->routing = s->cfg.algo.routing_replay && has_routing;
    if (r->routing) snprintf(r->routing_note, sizeof r->routing_note, "the actor's recorded routing replayed ([algo] routing_replay, as the learner trains)");
    else if (s->cfg.algo.routing_replay) snprintf(r->routing_note, sizeof r->routing_note, "[algo] routing_replay is on but the episode carries no usable routing: routed afresh");
    else if (has_routing) snprintf(r->routing_note, sizeof r->routing_note, "routed afresh (the episode carries routing; [algo] routing_replay is off, as the learner trains)");
    else r->routing_note[0] = 0;
    // the logits of the whole episode for the transformed log-probs: only when they fit 1 GiB
    if (transform && n_model && (double)T * d.V * sizeof(real) <= (double)(1u << 30)) r->adjusted = xcalloc(T + 1, sizeof(float));

    // distinct recorded versions of the model tokens, ascending
    uint32_t *vers = xmalloc(sizeof(uint32_t) * (n_model ? n_model : 1));
    size_t nv = 0;
    for (size_t j = 1; j < T; j++) {
        if (!r->mask[j]) continue;
        size_t k = 0;
        while (k < nv && vers[k] != t->version[j]) k++;
        if (k == nv) vers[nv++] = t->version[j];
    }
    for (size_t a = 1; a < nv; a++)
        for (size_t b = a; b > 0 && vers[b - 1] > vers[b]; b--) {
            uint32_t x = vers[b];
            vers[b] = vers[b - 1];
            vers[b - 1] = x;
        }
    r->w = xcalloc(nv ? nv : 1, sizeof(replay_weights));
    r->n_w = nv;
    char retained[1024];
    retained_list_(s, retained, sizeof retained);

    if (o->checkpoint || o->have_version) {
        // one set of weights for every token
        char path[4096] = "";
        int initial = 0;
        if (o->checkpoint) {
            snprintf(path, sizeof path, "%s", o->checkpoint);
        } else if (ckpt_exact_(s, o->version, path, sizeof path) < 0) {
            if (o->version == 0) initial = 1;
            else {
                free(vers);
                st = mtrl_error_set(err, MTRL_ERR_NOTFOUND,
                                    "--version %u: run %lld has no retained checkpoint of that version (retained: %s)",
                                    o->version, (long long)s->run, retained);
                goto fail;
            }
        }
        mtrl_model m;
        int inited = 0;
        st = model_load_(s, &m, &inited, initial ? NULL : path, err);
        if (st == MTRL_OK) {
            uint32_t used = m.version;
            st = score_(&m, t, mtrl_config_segment(&s->cfg), r->routing, r->mask, r->learner, r->adjusted,
                        r->temperature, r->top_p, err);
            for (size_t j = 0; j < T; j++) r->used[j] = used;
            for (size_t k = 0; k < nv; k++) {
                replay_weights *w = &r->w[k];
                w->want = vers[k];
                w->used = used;
                w->found = vers[k] == used;
                w->initial = initial;
                snprintf(w->path, sizeof w->path, "%s", path);
                snprintf(w->note, sizeof w->note, "%s", vers[k] == used ? "exact" : "as asked (a different version)");
            }
            if (initial) snprintf(r->source, sizeof r->source, "--version 0: the initial weights, re-created from [run] seed");
            else if (o->checkpoint) snprintf(r->source, sizeof r->source, "--checkpoint %s (version %u)", path, used);
            else snprintf(r->source, sizeof r->source, "--version %u: %s", o->version, path);
        }
        if (inited) mtrl_model_free(&m);
        free(vers);
        if (st != MTRL_OK) goto fail;
    } else {
        for (size_t k = 0; k < nv; k++)
            if (!weights_for_(s, vers[k], &r->w[k])) {
                st = mtrl_error_set(err, MTRL_ERR_NOTFOUND,
                                    "the tokens were generated with version %u and run %lld retains no checkpoint "
                                    "at all (checkpoints: %zu rows, files retained: %s); see [run] checkpoint_every "
                                    "and keep_checkpoints",
                                    vers[k], (long long)s->run, s->n_ckpts, retained);
                free(vers);
                goto fail;
            }
        free(vers);
        int all_exact = 1;
        for (size_t k = 0; k < nv; k++) all_exact &= r->w[k].found;
        if (nv == 0) snprintf(r->source, sizeof r->source, "none needed: the episode has no model tokens");
        else if (nv == 1) snprintf(r->source, sizeof r->source, "the version its tokens were generated with%s",
                                   all_exact ? "" : " (not retained: substituted, see below)");
        else snprintf(r->source, sizeof r->source, "each token under its own version (%zu versions)%s", nv,
                      all_exact ? "" : "; some are not retained and were substituted, see below");
        // one forward per distinct set of weights
        uint8_t *done = xcalloc(nv ? nv : 1, 1);
        uint8_t *sel = xcalloc(T + 1, 1);
        mtrl_model m;
        int inited = 0;
        for (size_t k = 0; k < nv && st == MTRL_OK; k++) {
            if (done[k]) continue;
            const replay_weights *w = &r->w[k];
            memset(sel, 0, T + 1);
            for (size_t q = k; q < nv; q++) {
                const replay_weights *x = &r->w[q];
                if (x->initial != w->initial || strcmp(x->path, w->path)) continue;
                done[q] = 1;
                for (size_t j = 1; j < T; j++)
                    if (r->mask[j] && t->version[j] == x->want) {
                        sel[j] = 1;
                        r->used[j] = w->used;
                    }
            }
            st = model_load_(s, &m, &inited, w->initial ? NULL : w->path, err);
            if (st == MTRL_OK)
                st = score_(&m, t, mtrl_config_segment(&s->cfg), r->routing, sel, r->learner, r->adjusted, r->temperature,
                            r->top_p, err);
        }
        if (inited) mtrl_model_free(&m);
        free(done);
        free(sel);
        if (st != MTRL_OK) goto fail;
    }
    st = mtrl_algo_mismatch_report(r->learner, t->logprob, r->mask, T, MTRL_ALGO_MISMATCH_BINS, r->worst, REPLAY_WORST,
                                   &r->mm);
    if (st == MTRL_OK && r->adjusted)
        st = mtrl_algo_mismatch_report(r->adjusted, t->logprob, r->mask, T, MTRL_ALGO_MISMATCH_BINS, NULL, 0, &r->mm_adj);
    if (st != MTRL_OK) {
        st = mtrl_error_set(err, st, "mismatch report refused the episode");
        goto fail;
    }
    return MTRL_OK;
fail:
    replay_rescore_free(r);
    return st;
}

// ---- re-execution -------------------------------------------------------------------------------

void replay_reexec_free(replay_reexec *r) {
    mtrl_traj_free(&r->re);
}

static void tok_desc_(const mtrl_traj *t, size_t i, char *out, size_t cap) {
    char txt[32];
    replay_token_text(t->ids[i], txt, sizeof txt);
    const char *k = t->kind[i] == MTRL_TOK_MODEL ? "model" : t->kind[i] == MTRL_TOK_PROMPT ? "prompt"
                    : t->kind[i] == MTRL_TOK_TOOL ? "tool" : "pad";
    if (t->kind[i] == MTRL_TOK_MODEL)
        snprintf(out, cap, "%s token %u %s%s%s (log-prob %.9g, version %u)", k, t->ids[i], t->ids[i] < 256 ? "'" : "", txt,
                 t->ids[i] < 256 ? "'" : "", (double)t->logprob[i], t->version[i]);
    else
        snprintf(out, cap, "%s token %u %s%s%s (version %u)", k, t->ids[i], t->ids[i] < 256 ? "'" : "", txt,
                 t->ids[i] < 256 ? "'" : "", t->version[i]);
}

static int f32_same_(float a, float b) { return !memcmp(&a, &b, sizeof a); }

// The log-prob of the recorded token `at` under m, given the recorded tokens before it.
// setting: [learner] segment (mtrl_config_segment); NAN when no segment fits.
static double recorded_logp_now_(mtrl_model *m, const mtrl_traj *t, size_t at, long setting, double temp, double top_p) {
    int V = m->dims.V;
    if (at == 0 || (double)at * V * sizeof(real) > (double)(1u << 30)) return NAN;
    const uint32_t *toks[1] = {t->ids};
    int len[1] = {(int)at}, segment = 0;
    mtrl_batch b = {1, toks, len, NULL};
    mtrl_error err;
    if (mtrl_model_segment_resolve(m, &b, setting, &segment, NULL, &err) != MTRL_OK) return NAN;
    real *logits = xmalloc(sizeof(real) * at * (size_t)V);
    int *order = xmalloc(sizeof(int) * (size_t)V);
    uint8_t *tab = patches_on_(m, t);
    mtrl_model_logits(m, t->ids, (int)at, segment, logits);
    mtrl_model_set_patches(m, NULL, 0);
    free(tab);
    double lp = sampled_logp_(logits + (at - 1) * (size_t)V, V, t->ids[at], temp, top_p, order);
    free(order);
    free(logits);
    return lp;
}

static int tools_equal_(const mtrl_traj *a, const mtrl_traj *b, char *why, size_t cap) {
    if (a->n_tools != b->n_tools) {
        snprintf(why, cap, "the recording has %u tool calls, the re-execution %u", a->n_tools, b->n_tools);
        return 0;
    }
    for (uint32_t k = 0; k < a->n_tools; k++) {
        const mtrl_tool_call *x = &a->tools[k], *y = &b->tools[k];
        const char *what = NULL;
        if (x->turn != y->turn) what = "turn";
        else if (strcmp(x->name ? x->name : "", y->name ? y->name : "")) what = "name";
        else if (x->args_len != y->args_len || (x->args_len && memcmp(x->args, y->args, x->args_len))) what = "arguments";
        else if (x->result_len != y->result_len || (x->result_len && memcmp(x->result, y->result, x->result_len)))
            what = "result";
        else if (x->status != y->status) what = "status";
        else if (strcmp(x->error ? x->error : "", y->error ? y->error : "")) what = "error";
        if (what) {
            snprintf(why, cap, "tool call %u: the %s differs (a different env answer to the same call)", k + 1, what);
            return 0;
        }
    }
    return 1;
}

// The episodes' pictures, pixel for pixel (their tokens name rows of them, so equal tokens with
// another picture are another observation).
static int pictures_equal_(const mtrl_traj *a, const mtrl_traj *b, char *why, size_t cap) {
    if (a->n_images != b->n_images) {
        snprintf(why, cap, "the recording has %u pictures and the re-execution %u", a->n_images, b->n_images);
        return 0;
    }
    for (uint32_t i = 0; i < a->n_images; i++) {
        const mtrl_traj_image *x = &a->images[i], *y = &b->images[i];
        if (x->width != y->width || x->height != y->height || memcmp(x->rgb, y->rgb, 3u * x->width * x->height)) {
            snprintf(why, cap, "picture %u differs (%u x %u recorded, %u x %u re-executed)", i + 1, x->width, x->height,
                     y->width, y->height);
            return 0;
        }
    }
    return 1;
}

static void compare_(replay_reexec *r, const replay_session *s, mtrl_model *m) {
    const mtrl_traj *a = &s->t, *b = &r->re;
    size_t n = (size_t)(a->n_tokens < b->n_tokens ? a->n_tokens : b->n_tokens);
    r->kind = REPLAY_SAME;
    r->at = -1;
    char da[256], db[256];
    int routed = a->routing_width && a->routing_width == b->routing_width && a->flags == b->flags && a->routing && b->routing;
    size_t rw = routed ? mtrl_traj_routing_row_bytes(a) : 0;
    for (size_t i = 0; i < n; i++) {
        if (a->ids[i] == b->ids[i] && a->kind[i] == b->kind[i] && f32_same_(a->logprob[i], b->logprob[i]) &&
            a->version[i] == b->version[i]) {
            if (!routed || !memcmp(a->routing + i * rw, b->routing + i * rw, rw)) continue;
            uint32_t j = 0;
            while (j < a->routing_width && mtrl_traj_routing_id(a, i, j) == mtrl_traj_routing_id(b, i, j)) j++;
            r->kind = REPLAY_DIV_ROUTING;
            r->at = (long)i;
            tok_desc_(a, i, da, sizeof da);
            snprintf(r->why, sizeof r->why,
                     "different routing: the same token and log-prob, but MoE slot %u (MoE layer %u, choice %u) took "
                     "expert %u in the recording and %u in the re-execution\nrecorded     %s",
                     j, j / (uint32_t)m->dims.k + 1, j % (uint32_t)m->dims.k, mtrl_traj_routing_id(a, i, j),
                     mtrl_traj_routing_id(b, i, j), da);
            return;
        }
        r->at = (long)i;
        tok_desc_(a, i, da, sizeof da);
        tok_desc_(b, i, db, sizeof db);
        if (a->kind[i] == MTRL_TOK_MODEL && b->kind[i] == MTRL_TOK_MODEL) {
            if (a->ids[i] == b->ids[i] && !f32_same_(a->logprob[i], b->logprob[i])) {
                r->kind = REPLAY_DIV_LOGITS;
                snprintf(r->why, sizeof r->why,
                         "different logits: the same token was sampled but its log-prob differs\n"
                         "recorded     %s\nre-executed  %s\nΔ log p = %.3e",
                         da, db, (double)b->logprob[i] - (double)a->logprob[i]);
            } else if (a->ids[i] != b->ids[i]) {
                r->kind = REPLAY_DIV_LOGITS;
                double now = recorded_logp_now_(m, a, i, mtrl_config_segment(&s->cfg), s->cfg.actor.temperature,
                                                s->cfg.actor.top_p);
                char extra[256] = "";
                if (isfinite(now) || isinf(now))
                    snprintf(extra, sizeof extra,
                             "\nunder these weights the recorded token has log-prob %.9g (chunked forward; recorded %.9g)",
                             now, (double)a->logprob[i]);
                snprintf(r->why, sizeof r->why,
                         "different logits: a different token was sampled from the same random number\n"
                         "recorded     %s\nre-executed  %s%s",
                         da, db, extra);
            } else {
                r->kind = REPLAY_DIV_VERSION;
                snprintf(r->why, sizeof r->why,
                         "the same token and log-prob, but a different weight version stamp\n"
                         "recorded     %s\nre-executed  %s\n(the actor received new weights here)",
                         da, db);
            }
        } else if (a->kind[i] == b->kind[i] && a->ids[i] == b->ids[i] && f32_same_(a->logprob[i], b->logprob[i])) {
            r->kind = REPLAY_DIV_VERSION;
            snprintf(r->why, sizeof r->why,
                     "the same token, but a different weight version stamp\nrecorded     %s\nre-executed  %s", da, db);
        } else {
            r->kind = REPLAY_DIV_ENV;
            snprintf(r->why, sizeof r->why,
                     "a different env observation: the token is part of what the env returned (%s), not "
                     "something the model sampled\nrecorded     %s\nre-executed  %s",
                     a->kind[i] == MTRL_TOK_PROMPT || b->kind[i] == MTRL_TOK_PROMPT ? "the prompt from reset(seed)"
                                                                                   : "a tool observation",
                     da, db);
        }
        return;
    }
    if (a->n_tokens != b->n_tokens) {
        r->kind = REPLAY_DIV_LENGTH;
        r->at = (long)n;
        if (a->n_tokens < b->n_tokens && (a->status == MTRL_EP_ABORTED || a->status == MTRL_EP_REJECTED)) {
            r->prefix_ok = 1;
            snprintf(r->why, sizeof r->why,
                     "no divergence: the %zu recorded tokens are an exact prefix of the re-execution; the recording "
                     "stopped there (%s: %s) and the re-execution went on to %" PRIu64 " tokens (%s)",
                     n, mtrl_ep_status_name(a->status), a->reason ? a->reason : "", b->n_tokens,
                     mtrl_ep_status_name(b->status));
        } else {
            snprintf(r->why, sizeof r->why,
                     "every common token is equal, but the recording has %" PRIu64 " tokens (%s) and the re-execution "
                     "%" PRIu64 " (%s)%s",
                     a->n_tokens, mtrl_ep_status_name(a->status), b->n_tokens, mtrl_ep_status_name(b->status),
                     a->n_tokens < b->n_tokens ? ": the env ended the recorded episode earlier" :
                                                 ": the re-executed episode ended earlier (the env said done, or failed)");
        }
        return;
    }
    char why[512];
    if (a->status != b->status) {
        r->kind = REPLAY_DIV_SUMMARY;
        snprintf(r->why, sizeof r->why, "every token is equal, but the status differs: recorded %s%s%s, re-executed %s%s%s",
                 mtrl_ep_status_name(a->status), a->reason ? ": " : "", a->reason ? a->reason : "",
                 mtrl_ep_status_name(b->status), b->reason ? ": " : "", b->reason ? b->reason : "");
    } else if (a->reward != b->reward) {
        r->kind = REPLAY_DIV_SUMMARY;
        snprintf(r->why, sizeof r->why, "every token is equal, but the reward differs: recorded %.17g, re-executed %.17g",
                 a->reward, b->reward);
    } else if (!tools_equal_(a, b, why, sizeof why)) {
        r->kind = REPLAY_DIV_SUMMARY;
        snprintf(r->why, sizeof r->why, "every token is equal, but %s", why);
    } else if (!pictures_equal_(a, b, why, sizeof why)) {
        r->kind = REPLAY_DIV_ENV;
        snprintf(r->why, sizeof r->why, "every token is equal, but %s: the env drew another picture", why);
    }
}

// 1 when env's prompt for the task seed is the recorded one (the trajectory's PROMPT tokens
// after BOS).
static int prompt_matches_(mtrl_env *env, const mtrl_traj *t, uint64_t task_seed) {
    mtrl_env_result res;
    mtrl_error err;
    if (mtrl_env_reset(env, task_seed, &res, &err) != MTRL_OK) return 0;
    uint64_t n = 1;
    while (n < t->n_tokens && t->kind[n] == MTRL_TOK_PROMPT) n++;
    if (n - 1 != res.obs_len) return 0;
    for (uint64_t i = 1; i < n; i++)
        if (t->ids[i] >= 256 || (unsigned char)res.obs[i - 1] != t->ids[i]) return 0;
    return 1;
}

// The experiment as the episode ran, into *cfg (the run's config on entry), with its env open.
// With a [stage.N] ladder each stage has its own context and env keys (a document length, hops):
// the stage the learner was in when the episode arrived (the store's step), or, when the
// recorded prompt says otherwise (an episode of the previous stage that arrived after the
// change), the stage whose env gives the recorded prompt.
static mtrl_status reexec_env_(const replay_session *s, mtrl_config *cfg, mtrl_env **env, mtrl_error *err) {
    const mtrl_config *base = &s->cfg;
    if (base->n_stages == 0) return mtrl_env_open_config(cfg, env, err);
    int first = mtrl_config_stage_of_step(base, s->row.step >= 0 ? (long)s->row.step : 0);
    for (int k = 0; k < base->n_stages; k++) {
        int st = k <= first ? first - k : k; // the arrival's stage, the earlier ones, then the later ones
        mtrl_config c = mtrl_config_stage(base, st);
        mtrl_status r = mtrl_env_open_config(&c, env, err);
        if (r != MTRL_OK) return r;
        if (!s->have_traj || s->t.n_tokens == 0 || prompt_matches_(*env, &s->t, s->t.task_seed)) {
            *cfg = c;
            return MTRL_OK;
        }
        mtrl_env_close(*env);
        *env = NULL;
    }
    // No stage gives the recorded prompt: re-execute in the arrival's stage and let the
    // comparison show where the env differs.
    *cfg = mtrl_config_stage(base, first);
    return mtrl_env_open_config(cfg, env, err);
}

mtrl_status replay_reexec_run(replay_session *s, replay_reexec *r, mtrl_error *err) {
    memset(r, 0, sizeof *r);
    mtrl_traj_init(&r->re);
    r->at = -1;
    const mtrl_store_episode *e = &s->row;
    uint32_t v;
    if (s->have_traj && s->t.n_tokens > 0) {
        const mtrl_traj *t = &s->t;
        v = t->version[0];
        uint32_t lo = v, hi = v;
        for (uint64_t i = 0; i < t->n_tokens; i++) {
            if (t->version[i] < lo) lo = t->version[i];
            if (t->version[i] > hi) hi = t->version[i];
        }
        if (lo != hi)
            snprintf(r->note, sizeof r->note,
                     "the episode spans versions %u..%u (the actor received new weights during it); re-execution "
                     "needs one version: using the first token's, %u, so it can only agree up to the first token "
                     "of another version",
                     lo, hi, v);
    } else {
        if (e->model_tokens == 0)
            return mtrl_error_set(err, MTRL_ERR_NOTFOUND,
                                  "the episode has no trajectory file and no model tokens: its weight version is unknown");
        v = e->version_min;
        snprintf(r->note, sizeof r->note,
                 "no trajectory file: comparing the re-execution with the store row (token digest, count, status, "
                 "reward) only; weights of version %u (the row's version_min)%s",
                 v, e->version_min != e->version_max ? ", though the episode spans versions" : "");
    }
    r->version = v;
    char path[4096] = "", retained[1024];
    int initial = 0;
    if (ckpt_exact_(s, v, path, sizeof path) < 0) {
        if (v != 0) {
            retained_list_(s, retained, sizeof retained);
            return mtrl_error_set(err, MTRL_ERR_NOTFOUND,
                                  "re-execution needs the weights of version %u, and run %lld retains no checkpoint of "
                                  "that version (retained: %s); see [run] checkpoint_every and keep_checkpoints",
                                  v, (long long)s->run, retained);
        }
        initial = 1;
    }
    if (initial) snprintf(r->weights, sizeof r->weights, "version 0: the initial weights, re-created from [run] seed");
    else snprintf(r->weights, sizeof r->weights, "version %u: %s", v, path);
    mtrl_model m;
    int inited = 0;
    mtrl_status st = model_load_(s, &m, &inited, initial ? NULL : path, err);
    if (st == MTRL_OK && m.version != v) {
        st = mtrl_error_set(err, MTRL_ERR_MISMATCH, "%s holds version %u, the run store says %u", path, m.version, v);
    }
    mtrl_env *env = NULL;
    mtrl_config cfg = s->cfg;
    if (st == MTRL_OK) st = reexec_env_(s, &cfg, &env, err);
    if (st == MTRL_OK) {
        mtrl_rollout_params p;
        mtrl_rollout_params_from_config(&p, &cfg, e->actor, e->incarnation);
        uint64_t task_seed = e->seed, group = e->group_id;
        if (s->have_traj) {
            p.seed = s->t.sample_seed;
            task_seed = s->t.task_seed;
            group = s->t.group_id;
        }
        st = mtrl_rollout_run_one(&p, &m, env, task_seed, e->id, group, &r->re, err);
        mtrl_env_close(env);
    }
    if (st == MTRL_OK) {
        if (s->have_traj) {
            compare_(r, s, &m);
        } else {
            uint64_t dg = mtrl_traj_digest_compute(&r->re);
            if (dg == e->digest && (int64_t)r->re.n_tokens == e->tokens && r->re.status == e->status &&
                r->re.reward == e->reward) {
                r->kind = REPLAY_SAME;
                snprintf(r->why, sizeof r->why, "token digest %016" PRIx64 ", %" PRIu64 " tokens, status and reward match the store row",
                         dg, r->re.n_tokens);
            } else {
                r->kind = REPLAY_DIV_DIGEST;
                snprintf(r->why, sizeof r->why,
                         "the store row says %lld tokens, digest %016" PRIx64 ", %s, reward %g; the re-execution gives "
                         "%" PRIu64 " tokens, digest %016" PRIx64 ", %s, reward %g (without the trajectory file the first "
                         "differing token cannot be named)",
                         (long long)e->tokens, e->digest, mtrl_ep_status_name(e->status), e->reward, r->re.n_tokens, dg,
                         mtrl_ep_status_name(r->re.status), r->re.reward);
            }
        }
    }
    if (inited) mtrl_model_free(&m);
    if (st != MTRL_OK) mtrl_traj_free(&r->re);
    return st;
}
