// rollout.c: batched tool-use episodes on the decode form (see rollout.h).
#include "actor/rollout.h"

#include "common/chat.h"
#include "actor/episode_mem.h"

#include "env/env_config.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/hash.h"
#include "common/image.h"
#include "common/log.h"
#include "model/model_plan.h"
#include "common/rng.h"
#include "common/timeutil.h"
#include "common/tokenizer.h"
#include "kernels/ref/ops_ref.h"

typedef struct slot {
    int active;
    mtrl_env *env;
    mtrl_decode_state st;
    mtrl_traj traj;
    real *logits;          // [V]: the distribution of the next token
    uint32_t logits_version; // the weights that computed them (the next model token's version)
    uint8_t *rrow;         // [max_tokens + 2][n_moe][k] routing scratch (record_routing)
    uint64_t turn_start;   // first token of the current model turn
    int64_t tool_open;     // position of the open TOOL_OPEN, or -1
    uint32_t turn;         // tool calls so far
    int needs_decode;      // the last sampled token must be fed to the model
    uint32_t *pend;        // [max_tokens + 3] tokens to feed at the end of the step (a tool result)
    int pend_n, pend_skip; // ... how many, and how many of them are in the trajectory already
    int pend_at;           // ... how many of them the rounds of the flush have fed so far
    uint8_t pend_kind;
    const struct slot *copy_of; // the group's first slot, whose prompt state this one copies after the flush
    uint8_t *ptab;         // the episode's patch table (its pictures' patches, traj.h), ptab_rows rows
    size_t ptab_rows;
} slot;

struct mtrl_rollout {
    mtrl_rollout_params p;
    mtrl_chat chat;        // opened by init when p.chat was NULL (chat.tok then non-NULL)
    mtrl_model *m;
    slot *slots;
    int n;
    int stop_new;
    uint64_t next_group;   // counter of groups started by this actor incarnation
    uint64_t next_episode;
    // scratch for the batched decode
    mtrl_decode_state **dstates;
    uint32_t *dtokens;
    real *dlogits;
    uint8_t *drouting;     // [slots][n_moe][k]
    int *dslot;
    uint32_t *ptok;        // prefill tokens
    // scratch for the batched prefill of the step's pending feeds
    slot **fslot;
    mtrl_decode_state **fstates;
    const uint32_t **ftok;
    int *flen;
    uint8_t **frout;
    real *flogits;         // [slots][V]
    uint8_t *ctab;         // the patch table of one batched prefill (every slot's pictures)
    size_t ctab_cap;
    uint32_t **fmap;       // [slots] feeds with their patch tokens moved to the slot's rows of ctab
    // the memory account (params device_budget > 0; mem.slot == NULL when off)
    mtrl_epmem mem;
    mtrl_decode_state **mstates; // [slots] the slots' states, as the account sees them
    uint8_t *idle;         // [slots] which slots the account may park now
};

void mtrl_rollout_params_from_config(mtrl_rollout_params *p, const mtrl_config *cfg, uint32_t actor_id,
                                     uint32_t incarnation) {
    memset(p, 0, sizeof *p);
    p->seed = (uint64_t)cfg->run.seed;
    p->actor_id = actor_id;
    p->incarnation = incarnation;
    p->group_size = (int)cfg->algo.group_size;
    int g = p->group_size;
    p->slots = (int)((cfg->actor.episodes_in_flight + g - 1) / g * g);
    p->max_tokens = (int)cfg->actor.max_tokens;
    p->max_turn_tokens = (int)cfg->actor.max_turn_tokens;
    p->temperature = cfg->actor.temperature;
    p->top_p = cfg->actor.top_p;
    p->record_routing = cfg->actor.routing_replay;
    p->device_budget = (size_t)cfg->actor.device_budget_mb << 20;
    p->prefill_rounds = (int)cfg->actor.prefill_rounds;
    p->host_budget = (size_t)cfg->actor.host_budget_mb << 20;
}

mtrl_status mtrl_rollout_init(mtrl_rollout **out, const mtrl_rollout_params *p, const mtrl_config *cfg, mtrl_model *m,
                              mtrl_error *err) {
    mtrl_rollout *r = xcalloc(1, sizeof *r);
    r->p = *p;
    // Memory accounting: every episode in flight holds a decode state of max_tokens (KDA states,
    // conv windows, the MLA latent cache); prefill and decode share one scratch
    // (mtrl_model_infer_bytes). When the states do not all fit in 90% of the device's free
    // memory, episodes get the capacity that fits and end `truncated` there, with the reason,
    // instead of the actor running out of memory at 1M tokens. With a device budget the
    // account (episode_mem.h) sizes the states instead.
    if (!p->device_budget) {
        size_t free_b = 0, total_b = 0, scratch_b = 0, peak_b = 0;
        mtrl_model_mem_info(m, &free_b, &total_b, &scratch_b, &peak_b);
        size_t fixed = mtrl_decode_state_bytes(m, 0), per_tok = mtrl_decode_state_bytes(m, 1) - fixed;
        double budget = 0.9 * (double)free_b - (double)(512u << 20) -
                        (double)mtrl_model_infer_bytes(m, p->slots, p->max_tokens);
        double fit = per_tok > 0 ? (budget / p->slots - (double)fixed) / (double)per_tok : 1e18;
        if (free_b > 0 && fit < p->max_tokens) {
            if (fit < 64) {
                mtrl_status st = mtrl_error_set(err, MTRL_ERR_NOMEM,
                    "actor: %d episodes in flight of [actor] max_tokens = %d need %.2f GiB of decode state, "
                    "%.2f GiB free: lower episodes_in_flight or max_tokens", p->slots, p->max_tokens,
                    (double)p->slots * (double)mtrl_decode_state_bytes(m, p->max_tokens) / (1 << 30),
                    (double)free_b / (1 << 30));
                free(r);
                return st;
            }
            r->p.max_tokens = (int)fit;
            r->p.memory_capped = 1;
            LOG_WARN("actor: %d episodes of %d tokens do not fit %.2f GiB free: episodes end truncated at %d tokens",
                     p->slots, p->max_tokens, (double)free_b / (1 << 30), r->p.max_tokens);
        }
    }
    p = &r->p;
    r->m = m;
    if (!p->chat) {
        mtrl_status st = mtrl_chat_init(&r->chat, &cfg->model, (uint32_t)m->dims.V, err);
        if (st != MTRL_OK) {
            free(r);
            return st;
        }
        r->p.chat = &r->chat;
    }
    r->next_group = p->first_group;
    r->next_episode = p->first_episode;
    r->n = p->slots;
    r->slots = xcalloc((size_t)r->n, sizeof(slot));
    int V = m->dims.V;
    for (int i = 0; i < r->n; i++) {
        slot *s = &r->slots[i];
        mtrl_status st = mtrl_env_open_config(cfg, &s->env, err);
        if (st != MTRL_OK) {
            mtrl_rollout_free(r);
            return st;
        }
        if (!p->device_budget) mtrl_decode_state_init(&s->st, m, p->max_tokens);
        mtrl_traj_init(&s->traj);
        s->logits = xcalloc((size_t)V, sizeof(real));
        s->rrow = xcalloc((size_t)(p->max_tokens + 2) * (size_t)(m->dims.n_moe * m->dims.k) + 1, 1);
        s->pend = xcalloc((size_t)p->max_tokens + 3, sizeof(uint32_t));
    }
    r->fslot = xcalloc((size_t)r->n, sizeof(*r->fslot));
    r->fstates = xcalloc((size_t)r->n, sizeof(*r->fstates));
    r->ftok = xcalloc((size_t)r->n, sizeof(*r->ftok));
    r->flen = xcalloc((size_t)r->n, sizeof(int));
    r->frout = xcalloc((size_t)r->n, sizeof(*r->frout));
    r->flogits = xcalloc((size_t)r->n * V, sizeof(real));
    r->fmap = xcalloc((size_t)r->n, sizeof(*r->fmap));
    r->dstates = xcalloc((size_t)r->n, sizeof(*r->dstates));
    r->dtokens = xcalloc((size_t)r->n, sizeof(uint32_t));
    r->dlogits = xcalloc((size_t)r->n * V, sizeof(real));
    r->dslot = xcalloc((size_t)r->n, sizeof(int));
    r->drouting = xcalloc((size_t)r->n * (size_t)(m->dims.n_moe * m->dims.k) + 1, 1);
    r->ptok = xcalloc((size_t)p->max_tokens + 2, sizeof(uint32_t));
    if (p->device_budget) {
        r->mstates = xcalloc((size_t)r->n, sizeof(*r->mstates));
        r->idle = xcalloc((size_t)r->n, 1);
        for (int i = 0; i < r->n; i++) r->mstates[i] = &r->slots[i].st;
        mtrl_status st = mtrl_epmem_init(&r->mem, m, r->mstates, r->n, p->max_tokens, p->device_budget, p->host_budget,
                                         64, err);
        if (st != MTRL_OK) {
            mtrl_rollout_free(r);
            return st;
        }
    }
    *out = r;
    return MTRL_OK;
}

const mtrl_epmem *mtrl_rollout_mem(const mtrl_rollout *r) { return r->mem.slot ? &r->mem : NULL; }

void mtrl_rollout_free(mtrl_rollout *r) {
    if (!r) return;
    mtrl_epmem_free(&r->mem); // the states it allocated; the loop below then frees none twice
    free(r->mstates);
    free(r->idle);
    for (int i = 0; i < r->n; i++) {
        slot *s = &r->slots[i];
        if (s->env) mtrl_env_close(s->env);
        mtrl_decode_state_free(&s->st);
        mtrl_traj_free(&s->traj);
        free(s->logits);
        free(s->rrow);
        free(s->pend);
        free(s->ptab);
    }
    free(r->slots);
    free(r->ctab);
    free(r->fmap);
    free(r->fslot);
    free(r->fstates);
    free(r->ftok);
    free(r->flen);
    free(r->frout);
    free(r->flogits);
    free(r->dstates);
    free(r->dtokens);
    free(r->dlogits);
    free(r->dslot);
    free(r->drouting);
    free(r->ptok);
    if (r->chat.tok) mtrl_chat_free(&r->chat);
    free(r);
}

void mtrl_rollout_stop_new(mtrl_rollout *r) { r->stop_new = 1; }

void mtrl_rollout_counters(const mtrl_rollout *r, uint64_t *next_group, uint64_t *next_episode) {
    *next_group = r->next_group;
    *next_episode = r->next_episode;
}
int mtrl_rollout_slot_count(const mtrl_rollout *r) { return r->n; }
mtrl_traj *mtrl_rollout_slot(mtrl_rollout *r, int i) { return r->slots[i].active ? &r->slots[i].traj : NULL; }

// ---- one episode's steps (shared by the batched engine and run_one) ------------------------------------

static const mtrl_chat *chat_of_(const mtrl_rollout_params *p) { return p->chat ? p->chat : &mtrl_chat_bytes; }

// The env calls, timed into p->times when it is set (mtrl_rollout_times).
static mtrl_status env_reset_(const mtrl_rollout_params *p, mtrl_env *env, uint64_t seed, mtrl_env_result *res,
                              mtrl_error *err) {
    double t0 = p->times ? mtrl_time_mono() : 0;
    mtrl_status st = mtrl_env_reset(env, seed, res, err);
    if (p->times) p->times->tools_s += mtrl_time_mono() - t0;
    return st;
}

static mtrl_status env_step_(const mtrl_rollout_params *p, mtrl_env *env, uint32_t kind, const char *text, size_t n,
                             mtrl_env_result *res, mtrl_error *err) {
    double t0 = p->times ? mtrl_time_mono() : 0;
    mtrl_status st = mtrl_env_step(env, kind, text, n, res, err);
    if (p->times) p->times->tools_s += mtrl_time_mono() - t0;
    return st;
}

// Feeds tok[skip..n) as tokens of a kind that carries no loss into the trajectory, and all n
// into the model state (tok[0..skip) were appended already, when they were sampled). With
// routing recorded, every fed token's row comes from the prefill.
static void fed_(mtrl_model *m, slot *s, const uint32_t *tok, int n, int skip, uint8_t kind);

static void feed_(mtrl_model *m, slot *s, const uint32_t *tok, int n, int skip, uint8_t kind) {
    mtrl_model_set_patches(m, s->ptab, (int)s->ptab_rows);
    mtrl_model_prefill(m, &s->st, tok, n, s->logits, s->traj.routing_width ? s->rrow : NULL);
    mtrl_model_set_patches(m, NULL, 0);
    fed_(m, s, tok, n, skip, kind);
}

// The slot's patch table after its trajectory gained pictures (or was replaced by a resume).
static void ptab_sync_(slot *s) {
    size_t rows = mtrl_traj_patch_rows(&s->traj);
    if (rows == s->ptab_rows) return;
    size_t pb = (size_t)3 * s->traj.image_patch * s->traj.image_patch;
    s->ptab = xrealloc(s->ptab, rows * pb + 1);
    mtrl_traj_patch_table(&s->traj, s->ptab);
    s->ptab_rows = rows;
}

// The picture that came with a prompt or observation, as tokens at out (at most room of them):
// stored in the trajectory once (traj.h) and in the slot's patch table. Returns the count, 0
// without a picture, -1 when the model takes no pictures, -2 when it does not fit (why says so).
static int image_tokens_(const mtrl_model *m, slot *s, const mtrl_env_result *res, uint32_t *out, long room, char *why,
                         size_t cap) {
    if (!res->image) return 0;
    int P = m->dims.image_patch;
    if (P <= 0) {
        snprintf(why, cap, "env '%s' sent a %u x %u picture, but the model takes none ([model] image_patch = 0)",
                 mtrl_env_name(s->env), res->image_w, res->image_h);
        return -1;
    }
    size_t nt = mtrl_image_token_count(res->image_w, res->image_h, P);
    if ((long)nt > room) {
        snprintf(why, cap, "a %u x %u picture of %zu tokens does not fit the token budget", res->image_w, res->image_h,
                 nt);
        return -2;
    }
    uint32_t first = mtrl_traj_add_image(&s->traj, P, res->image, res->image_w, res->image_h);
    mtrl_image_tokens(res->image_w, res->image_h, P, first, out);
    ptab_sync_(s);
    return (int)nt;
}

// The same, at the end of the step, batched with the other slots' (flush_).
static void queue_(slot *s, const uint32_t *tok, int n, int skip, uint8_t kind) {
    memcpy(s->pend, tok, sizeof(uint32_t) * (size_t)n);
    s->pend_n = n;
    s->pend_at = 0;
    s->pend_skip = skip;
    s->pend_kind = kind;
}

// After the prefill of tok[0..n) into s (its logits and routing rows in s->logits, s->rrow):
// the trajectory gets the tokens.
static void fed_(mtrl_model *m, slot *s, const uint32_t *tok, int n, int skip, uint8_t kind) {
    mtrl_traj *t = &s->traj;
    uint8_t *rr = t->routing_width ? s->rrow : NULL;
    uint64_t first = t->n_tokens - (uint64_t)skip;
    s->logits_version = m->version;
    for (int i = skip; i < n; i++)
        mtrl_traj_append(t, tok[i], 0.0f, m->version, kind, rr ? rr + (size_t)i * t->routing_width : NULL);
    for (int i = 0; rr && i < skip; i++) memcpy(t->routing + (first + (uint64_t)i) * t->routing_width, rr + (size_t)i * t->routing_width, t->routing_width);
    // the next model turn starts after the prompt or the tool's result
    s->turn_start = t->n_tokens;
}

// A group's episodes share their prompt: one prefill per group, the others copy its state, logits
// and routing rows (the prefill is deterministic, so this is exactly what their own would give).
static void copy_prompt_(mtrl_model *m, slot *s, const slot *twin) {
    mtrl_decode_state_copy(&s->st, &twin->st, m);
    memcpy(s->logits, twin->logits, sizeof(real) * (size_t)m->dims.V);
    s->logits_version = twin->logits_version;
    const mtrl_traj *tw = &twin->traj;
    mtrl_traj *t = &s->traj;
    for (uint64_t i = 0; i < tw->n_tokens; i++)
        mtrl_traj_append(t, tw->ids[i], 0.0f, tw->version[i], MTRL_TOK_PROMPT,
                         t->routing_width ? tw->routing + i * tw->routing_width : NULL);
    s->turn_start = t->n_tokens;
}

static void finish_(slot *s, mtrl_ep_status status, double reward, const char *reason) {
    s->traj.status = status;
    s->traj.reward = reward;
    if (reason) mtrl_traj_set_reason(&s->traj, "%s", reason);
    s->traj.end_wall = mtrl_time_wall();
    s->active = 0;
}

// Starts an episode in s: env reset, BOS + prompt prefilled. Returns 0 when the episode ended
// at once (env failure or a prompt over the budget).
// twin: the group's first slot, started just before with the same task (NULL for the first).
// defer: queue the prompt for the batched prefill of the groups started together (flush_), or
// with a twin whose queued prompt is the same, copy the twin's state after that prefill.
static int start_(const mtrl_rollout_params *p, mtrl_model *m, slot *s, const slot *twin, uint64_t task_seed,
                  uint64_t episode_id, uint64_t group_id, uint32_t *buf, int defer) {
    mtrl_traj_reset(&s->traj);
    mtrl_traj *t = &s->traj;
    t->episode_id = episode_id;
    t->group_id = group_id;
    t->task_seed = task_seed;
    t->actor_id = p->actor_id;
    t->incarnation = p->incarnation;
    t->sample_seed = p->seed;
    t->sample_stream = mtrl_rng_stream("sample", episode_id, 0);
    t->start_wall = mtrl_time_wall();
    mtrl_traj_set_env(t, mtrl_env_name(s->env));
    if (p->record_routing) {
        mtrl_traj_set_routing(t, (uint32_t)(m->dims.n_moe * m->dims.k), 0);
        memset(s->rrow, 0, t->routing_width);
    }
    s->active = 1;
    s->turn = 0;
    s->tool_open = -1;
    s->needs_decode = 0;
    s->pend_n = s->pend_at = 0;
    s->copy_of = NULL;
    s->ptab_rows = 0;
    mtrl_decode_state_reset(&s->st, m);
    mtrl_env_result res;
    mtrl_error err;
    if (env_reset_(p, s->env, task_seed, &res, &err) != MTRL_OK) {
        finish_(s, MTRL_EP_ABORTED, 0, err.msg);
        return 0;
    }
    // The prompt leaves room for one generated token.
    long np = mtrl_chat_prompt(chat_of_(p), res.obs, res.obs_len, buf, (size_t)(p->max_tokens - 1));
    if (np < 0) {
        char why[128];
        snprintf(why, sizeof why, "prompt of %zu bytes does not fit the budget of %d tokens", res.obs_len, p->max_tokens);
        finish_(s, MTRL_EP_TRUNCATED, 0, why);
        return 0;
    }
    // then its picture (docs/multimodal.md: the picture last, next to what the model writes
    // after it)
    char why[256];
    int ni = image_tokens_(m, s, &res, buf + np, (long)p->max_tokens - 1 - np, why, sizeof why);
    if (ni < 0) {
        finish_(s, ni == -1 ? MTRL_EP_ABORTED : MTRL_EP_TRUNCATED, 0, why);
        return 0;
    }
    int n = (int)np + ni;
    if (!defer) feed_(m, s, buf, n, 0, MTRL_TOK_PROMPT);
    else if (twin && twin->active && twin->pend_n == n && twin->pend_kind == MTRL_TOK_PROMPT &&
             !memcmp(twin->pend, buf, sizeof(uint32_t) * (size_t)n))
        s->copy_of = twin;
    else queue_(s, buf, n, 0, MTRL_TOK_PROMPT);
    return 1;
}

// Bytes of the model tokens in [from, to) (specials dropped) into out (cap bytes, NUL-terminated).
static size_t turn_bytes_(const mtrl_rollout_params *p, const mtrl_traj *t, uint64_t from, uint64_t to, char *out,
                          size_t cap) {
    return mtrl_chat_text(chat_of_(p), t->ids + from, (size_t)(to - from), out, cap);
}

// Samples the next token of s and acts on it. Returns 1 when the token must be fed to the
// model by a decode step, 0 when the episode ended or the model state was advanced by a prefill.
// defer: queue a tool result for the step's batched prefill instead of prefilling it now.
static int advance_(const mtrl_rollout_params *p, mtrl_model *m, slot *s, uint32_t *buf, int defer) {
    mtrl_traj *t = &s->traj;
    uint64_t pos = t->n_tokens;
    double u = mtrl_rng_uniform(t->sample_seed, t->sample_stream, pos);
    real lp;
    int tok = mtrl_ref_sample_logits(m->dims.V, s->logits, (real)p->temperature, (real)p->top_p, u, &lp);
    // The routing of a sampled token is known once it is fed to the model: a zero row now,
    // filled in after the decode (or the prefill of a tool result).
    // The token's version is that of the weights whose logits it was sampled from: after a
    // weight swap the first token still comes from the old weights' logits.
    mtrl_traj_append(t, (uint32_t)tok, (float)lp, s->logits_version, MTRL_TOK_MODEL, t->routing_width ? s->rrow : NULL);
    char text[4096];
    int role = mtrl_chat_role(chat_of_(p), (uint32_t)tok);
    if (role == MTRL_CHAT_END) {
        turn_bytes_(p, t, s->turn_start, t->n_tokens - 1, text, sizeof text);
        mtrl_env_result res;
        mtrl_error err;
        if (env_step_(p, s->env, MTRL_ENV_ACTION_ANSWER, text, strlen(text), &res, &err) != MTRL_OK) {
            finish_(s, MTRL_EP_ABORTED, 0, err.msg);
            return 0;
        }
        mtrl_traj_add_turn_reward(t, res.reward);
        finish_(s, MTRL_EP_COMPLETE, res.reward, NULL);
        return 0;
    }
    if (role == MTRL_CHAT_CALL_OPEN && s->tool_open < 0) s->tool_open = (int64_t)pos;
    if (role == MTRL_CHAT_CALL_CLOSE && s->tool_open >= 0) {
        char call_id[256];
        mtrl_chat_call(chat_of_(p), t->ids + s->tool_open + 1, (size_t)(pos - (uint64_t)s->tool_open - 1), text, sizeof text,
                       call_id, sizeof call_id);
        mtrl_env_result res;
        mtrl_error err;
        uint32_t turn = s->turn++;
        if (env_step_(p, s->env, MTRL_ENV_ACTION_TOOL, text, strlen(text), &res, &err) != MTRL_OK) {
            mtrl_traj_add_tool_call(t, turn, "", text, (uint32_t)strlen(text), NULL, 0, 0, (int32_t)err.code, err.msg);
            finish_(s, MTRL_EP_ABORTED, 0, err.msg);
            return 0;
        }
        char name[64];
        size_t nl = strcspn(text, "(");
        snprintf(name, sizeof name, "%.*s", (int)(nl < 63 ? nl : 63), text);
        mtrl_traj_add_tool_call(t, turn, name, text, (uint32_t)strlen(text), res.obs, (uint32_t)res.obs_len,
                                res.latency_s, res.tool_error ? 1 : 0, res.tool_error ? "tool error" : NULL);
        mtrl_traj_add_turn_reward(t, res.reward);
        if (res.done) {
            finish_(s, MTRL_EP_COMPLETE, res.reward, NULL);
            return 0;
        }
        // The call's closing token the model sampled, then the framed observation, cut to the
        // budget: its bytes first to what is left after the framing (a token covers at least
        // one byte), then halved until the whole fits.
        long cap = (long)p->max_tokens - (long)t->n_tokens;
        long frame = mtrl_chat_result(chat_of_(p), call_id, "", 0, buf + 1, cap > 0 ? (size_t)cap : 0);
        if (frame < 0 || cap - frame < 1) {
            finish_(s, MTRL_EP_TRUNCATED, 0, "token budget spent by a tool observation");
            return 0;
        }
        // A picture that came with it goes before the framing's last id (the bytes template's
        // RESULT_CLOSE), after the text, which is cut to what the picture leaves.
        long pic = res.image && m->dims.image_patch > 0
                       ? (long)mtrl_image_token_count(res.image_w, res.image_h, m->dims.image_patch) : 0;
        long room = cap - pic;
        size_t n = room - frame > 0 ? (res.obs_len < (size_t)(room - frame) ? res.obs_len : (size_t)(room - frame)) : 0;
        long k;
        while ((k = mtrl_chat_result(chat_of_(p), call_id, res.obs, n, buf + 1, (size_t)(room > 0 ? room : 0))) < 0 && n)
            n /= 2;
        if (k < 0) {
            finish_(s, MTRL_EP_TRUNCATED, 0, "token budget spent by a tool observation and its picture");
            return 0;
        }
        buf[0] = (uint32_t)tok;
        uint32_t last = buf[k];
        char why[256];
        int ni = image_tokens_(m, s, &res, buf + k, cap - k, why, sizeof why);
        if (ni < 0) {
            finish_(s, ni == -1 ? MTRL_EP_ABORTED : MTRL_EP_TRUNCATED, 0, why);
            return 0;
        }
        buf[k + ni] = last;
        k += ni;
        if (defer) queue_(s, buf, (int)k + 1, 1, MTRL_TOK_TOOL); // turn_start moves when it is fed
        else feed_(m, s, buf, (int)k + 1, 1, MTRL_TOK_TOOL);
        s->tool_open = -1;
        return 0;
    }
    if ((int)t->n_tokens >= p->max_tokens) {
        finish_(s, MTRL_EP_TRUNCATED, 0, p->memory_capped ? "the actor's memory budget reached" : "token budget reached");
        return 0;
    }
    if ((int)(t->n_tokens - s->turn_start) >= p->max_turn_tokens) {
        finish_(s, MTRL_EP_TRUNCATED, 0, "turn token limit reached");
        return 0;
    }
    return 1;
}

// ---- the batched engine --------------------------------------------------------------------------------

static void flush_(mtrl_rollout *r, const mtrl_rollout_events *ev, int rounds, int prompts);

// ---- the memory account's part (episode_mem.h; only with a device budget) ----

// Slot i's episode ended (or never started): the caller hears of it, its state is freed.
static void ended_(mtrl_rollout *r, int i, const mtrl_rollout_events *ev) {
    if (r->mem.slot) mtrl_epmem_release(&r->mem, i);
    if (ev && ev->end) ev->end(ev->user, &r->slots[i].traj);
}

// The first state of every episode of the group g0 .. g0+G-1, all or none.
#define MEM_FIRST_CAP 1024
static int mem_admit_(mtrl_rollout *r, int g0, int G) {
    for (int i = g0; i < g0 + G; i++) {
        mtrl_error err;
        if (r->mem.slot[i].where != MTRL_EPMEM_NONE) mtrl_epmem_release(&r->mem, i);
        if (mtrl_epmem_admit(&r->mem, i, MEM_FIRST_CAP, NULL, &err) != MTRL_OK) {
            for (int j = g0; j < i; j++) mtrl_epmem_release(&r->mem, j);
            return 0;
        }
    }
    return 1;
}

// Slot i's state holds need positions (r->idle says whom the account may park for it); when
// even parking cannot make room the episode ends truncated with the account's reason.
static int mem_reserve_(mtrl_rollout *r, int i, int need, const mtrl_rollout_events *ev) {
    mtrl_error err;
    if (mtrl_epmem_reserve(&r->mem, i, need, r->idle, &err) == MTRL_OK) return 1;
    finish_(&r->slots[i], MTRL_EP_TRUNCATED, 0, err.msg);
    ended_(r, i, ev);
    return 0;
}

// Positions a state at pos needs for the model turn that follows (within max_tokens).
static int mem_turn_need_(const mtrl_rollout *r, int pos) {
    long want = (long)pos + r->p.max_turn_tokens + 1;
    return want < r->p.max_tokens ? (int)want : r->p.max_tokens;
}

// Room in slot i's state for the next len tokens of its feed. 1: go ahead (its state on the
// device, large enough). 0: not in this round: it waits, its state parked in host memory, until
// episodes that hold the device end; or it ended truncated (the reason says why), when nothing
// else will free room (it alone does not fit, no other episode is on the device) or the host
// budget cannot take its state.
static int mem_feed_room_(mtrl_rollout *r, int i, int len, const mtrl_rollout_events *ev) {
    mtrl_epmem *a = &r->mem;
    mtrl_error err;
    // The feed and the model turn after it (at most max_turn_tokens), so that the decode steps
    // of a turn never wait for a growth while the other episodes hold the room.
    int need = mem_turn_need_(r, mtrl_epmem_pos(a, i) + len);
    r->idle[i] = 0; // a member of this round stays on the device
    if (mtrl_epmem_fits(a, i, need, r->idle)) {
        if (mtrl_epmem_unpark(a, i, need, r->idle, &err) != MTRL_OK) { // cannot happen after fits; wait
            r->idle[i] = 1;
            return 0;
        }
        return mem_reserve_(r, i, need, ev);
    }
    if (mtrl_epmem_fits_alone(a, need) && mtrl_epmem_others_on_device(a, i) > 0 &&
        (mtrl_epmem_parked(a, i) || mtrl_epmem_park(a, i, &err) == MTRL_OK)) {
        r->idle[i] = 1;
        return 0;
    }
    if (!mtrl_epmem_parked(a, i)) return mem_reserve_(r, i, need, ev); // truncates with the account's reason
    finish_(&r->slots[i], MTRL_EP_TRUNCATED, 0, "the actor's device budget cannot hold the episode's decode state");
    ended_(r, i, ev);
    return 0;
}

static void start_groups_(mtrl_rollout *r, const mtrl_rollout_events *ev) {
    int G = r->p.group_size;
    for (int g0 = 0; g0 + G <= r->n && !r->stop_new; g0 += G) {
        if (r->p.max_groups && r->next_group - r->p.first_group >= r->p.max_groups) break;
        int idle = 1;
        for (int i = g0; i < g0 + G; i++) idle &= !r->slots[i].active;
        if (!idle) continue;
        if (r->mem.slot && !mem_admit_(r, g0, G)) break; // the group waits for room
        uint64_t gi = r->next_group++;
        uint64_t task_seed = mtrl_rng_u64(r->p.seed, mtrl_rng_stream("task", r->p.actor_id, r->p.incarnation), gi);
        uint64_t group_id = ((uint64_t)r->p.actor_id << 48) | ((uint64_t)(r->p.incarnation & 0xffff) << 32) | (gi & 0xffffffff);
        for (int i = g0; i < g0 + G; i++) {
            uint64_t eid = ((uint64_t)r->p.actor_id << 48) | ((uint64_t)(r->p.incarnation & 0xffff) << 32) |
                           (r->next_episode++ & 0xffffffff);
            slot *s = &r->slots[i];
            int live = start_(&r->p, r->m, s, i > g0 ? &r->slots[g0] : NULL, task_seed, eid, group_id, r->ptok, 1);
            if (ev && ev->begin) ev->begin(ev->user, &s->traj);
            if (!live) ended_(r, i, ev);
        }
    }
    // The prompts of every group started here in one prefill, whole, then the groups' copies.
    flush_(r, ev, 0, 1);
    for (int i = 0; i < r->n; i++) {
        slot *s = &r->slots[i];
        if (!s->copy_of) continue;
        if (s->active && !s->copy_of->active) { // the twin ended in the flush (a device budget)
            finish_(s, MTRL_EP_TRUNCATED, 0, "the actor's device budget cannot hold the group's prompt");
            ended_(r, i, ev);
        }
        // With a device budget, when the twin waits for room or the copy does not fit now, the
        // episode prefills its prompt itself (the same result) and waits for room like any feed.
        if (s->active && r->mem.slot &&
            (s->copy_of->pend_n > 0 || !mtrl_epmem_fits(&r->mem, i, mem_turn_need_(r, s->copy_of->st.pos), NULL))) {
            const slot *tw = s->copy_of; // its prompt: still queued, or fed (then its trajectory so far)
            queue_(s, tw->pend_n ? tw->pend : tw->traj.ids, tw->pend_n ? tw->pend_n : (int)tw->traj.n_tokens, 0,
                   MTRL_TOK_PROMPT);
            s->copy_of = NULL;
            continue;
        }
        if (s->active && r->mem.slot && !mem_reserve_(r, i, mem_turn_need_(r, s->copy_of->st.pos), ev)) {
            s->copy_of = NULL;
            continue;
        }
        if (s->active) copy_prompt_(r->m, s, s->copy_of);
        s->copy_of = NULL;
    }
}

// The step's queued feeds, batched (mtrl_model_prefill_many): a tool result is a prefill of a few
// tokens, and one each would cost a pass over every layer apiece. A long feed (a 1M-token
// document) goes in rounds of one prefill segment per sequence, at most one segment's worth of
// tokens a round, with ev->tick between rounds: the caller's heartbeats keep going through
// minutes of prefill. After [actor] prefill_rounds rounds the step's flush stops and the rest
// waits for the next step, whose decode the other episodes take part in. The pieces start at multiples of MTRL_PREFILL_SEGMENT of each feed, where
// one whole prefill would cut its segments, so the rounds change no result.
// The pictures of a batched prefill of k feeds: one patch table for the call, each slot's rows
// at its own offset, its feed's patch tokens moved by that offset in a copy (the trajectory
// keeps the episode's own numbering). Returns 0 when no feed holds a picture.
static int flush_patches_(mtrl_rollout *r, int k) {
    size_t rows = 0, pb = (size_t)3 * r->m->dims.image_patch * r->m->dims.image_patch;
    int any = 0;
    for (int j = 0; j < k; j++) {
        int has = 0;
        for (int i = 0; i < r->flen[j] && !has; i++) has = mtrl_img_token_is(r->ftok[j][i]);
        if (!has) continue;
        const slot *s = r->fslot[j];
        if (rows + s->ptab_rows > r->ctab_cap) {
            r->ctab_cap = 2 * (rows + s->ptab_rows);
            r->ctab = xrealloc(r->ctab, r->ctab_cap * pb + 1);
        }
        memcpy(r->ctab + rows * pb, s->ptab, s->ptab_rows * pb);
        if (rows) {
            uint32_t *c = xmalloc(sizeof(uint32_t) * (size_t)r->flen[j]);
            for (int i = 0; i < r->flen[j]; i++) {
                uint32_t id = r->ftok[j][i];
                c[i] = mtrl_img_token_is_patch(id) ? id + (uint32_t)rows : id;
            }
            r->fmap[j] = c;
            r->ftok[j] = c;
        }
        rows += s->ptab_rows;
        any = 1;
    }
    if (any) mtrl_model_set_patches(r->m, r->ctab, (int)rows);
    return any;
}

// rounds: at most this many (0: until every feed taken is fed). prompts: only the feeds of
// prompts (the groups just started, whose other episodes copy the state once it is whole).
static void flush_(mtrl_rollout *r, const mtrl_rollout_events *ev, int rounds, int prompts) {
    int V = r->m->dims.V;
    for (int round = 0; !rounds || round < rounds; round++) {
        int k = 0, total = 0, more = 0;
        // With the account: every episode waiting for its feed may be parked for another's room.
        for (int i = 0; r->mem.slot && i < r->n; i++)
            r->idle[i] = r->slots[i].active && r->slots[i].pend_at < r->slots[i].pend_n;
        for (int i = 0; i < r->n; i++) {
            slot *s = &r->slots[i];
            if (!s->active || s->pend_at >= s->pend_n || (prompts && s->pend_kind != MTRL_TOK_PROMPT)) continue;
            int len = s->pend_n - s->pend_at;
            if (len > MTRL_PREFILL_SEGMENT) len = MTRL_PREFILL_SEGMENT;
            if (k > 0 && total + len > MTRL_PREFILL_SEGMENT) {
                more = 1;
                continue;
            }
            if (r->mem.slot && !mem_feed_room_(r, i, len, ev)) continue;
            r->fslot[k] = s;
            r->fstates[k] = &s->st;
            r->ftok[k] = s->pend + s->pend_at;
            r->flen[k] = len;
            r->frout[k] = s->traj.routing_width ? s->rrow + (size_t)s->pend_at * s->traj.routing_width : NULL;
            total += len;
            k++;
        }
        if (!k) return;
        int pics = flush_patches_(r, k);
        double t0 = mtrl_time_mono();
        mtrl_model_prefill_many(r->m, r->fstates, k, r->ftok, r->flen, r->flogits, r->frout);
        if (pics) {
            mtrl_model_set_patches(r->m, NULL, 0);
            for (int j = 0; j < k; j++) {
                free(r->fmap[j]);
                r->fmap[j] = NULL;
            }
        }
        if (r->p.times) {
            r->p.times->prefill_s += mtrl_time_mono() - t0;
            r->p.times->prefill_tokens += (uint64_t)total;
        }
        for (int j = 0; j < k; j++) {
            slot *s = r->fslot[j];
            s->pend_at += r->flen[j];
            if (s->pend_at < s->pend_n) {
                more = 1;
                continue;
            }
            memcpy(s->logits, r->flogits + (size_t)j * V, sizeof(real) * (size_t)V);
            fed_(r->m, s, s->pend, s->pend_n, s->pend_skip, s->pend_kind);
            s->pend_n = s->pend_at = 0;
        }
        if (more && ev && ev->tick) ev->tick(ev->user);
    }
}

int mtrl_rollout_step(mtrl_rollout *r, const mtrl_rollout_events *ev) {
    start_groups_(r, ev);
    int nd = 0;
    for (int i = 0; i < r->n; i++) {
        slot *s = &r->slots[i];
        if (!s->active || s->pend_n > 0) continue; // pend_n > 0: its feed is not (all) in the state yet
        if (advance_(&r->p, r->m, s, r->ptok, 1)) {
            if (r->mem.slot) {
                memset(r->idle, 0, (size_t)r->n);
                if (!mem_reserve_(r, i, s->st.pos + 1, ev)) continue;
            }
            r->dstates[nd] = &s->st;
            r->dtokens[nd] = s->traj.ids[s->traj.n_tokens - 1];
            r->dslot[nd] = i;
            nd++;
        } else if (!s->active) {
            ended_(r, i, ev);
        }
    }
    if (nd > 0) {
        size_t rw = (size_t)(r->m->dims.n_moe * r->m->dims.k);
        uint8_t *rout = r->p.record_routing ? r->drouting : NULL;
        double t0 = mtrl_time_mono();
        mtrl_model_decode(r->m, r->dstates, nd, r->dtokens, r->dlogits, rout);
        if (r->p.times) {
            r->p.times->decode_s += mtrl_time_mono() - t0;
            r->p.times->decode_tokens += (uint64_t)nd;
            r->p.times->decode_steps++;
        }
        int V = r->m->dims.V;
        for (int j = 0; j < nd; j++) {
            slot *s = &r->slots[r->dslot[j]];
            memcpy(s->logits, r->dlogits + (size_t)j * V, sizeof(real) * V);
            s->logits_version = r->m->version;
            if (rout) memcpy(s->traj.routing + (s->traj.n_tokens - 1) * rw, rout + (size_t)j * rw, rw);
        }
    }
    flush_(r, ev, r->p.prefill_rounds, 0);
    int live = 0;
    for (int i = 0; i < r->n; i++) live += r->slots[i].active;
    return live;
}

mtrl_status mtrl_rollout_run_one(const mtrl_rollout_params *p, mtrl_model *m, mtrl_env *env, uint64_t task_seed,
                                 uint64_t episode_id, uint64_t group_id, mtrl_traj *out, mtrl_error *err) {
    (void)err;
    slot s;
    memset(&s, 0, sizeof s);
    s.env = env;
    mtrl_decode_state_init(&s.st, m, p->max_tokens);
    mtrl_traj_init(&s.traj);
    s.logits = xcalloc((size_t)m->dims.V, sizeof(real));
    s.rrow = xcalloc((size_t)(p->max_tokens + 2) * (size_t)(m->dims.n_moe * m->dims.k) + 1, 1);
    uint32_t *buf = xcalloc((size_t)p->max_tokens + 2, sizeof(uint32_t));
    if (start_(p, m, &s, NULL, task_seed, episode_id, group_id, buf, 0)) {
        while (s.active) {
            if (advance_(p, m, &s, buf, 0)) {
                mtrl_decode_state *one[1] = {&s.st};
                uint32_t last = s.traj.ids[s.traj.n_tokens - 1];
                uint8_t *rr = s.traj.routing_width ? s.traj.routing + (s.traj.n_tokens - 1) * s.traj.routing_width : NULL;
                mtrl_model_decode(m, one, 1, &last, s.logits, rr);
                s.logits_version = m->version;
            }
        }
    }
    mtrl_traj_swap(out, &s.traj);
    mtrl_traj_free(&s.traj);
    mtrl_decode_state_free(&s.st);
    free(s.ptab);
    free(s.logits);
    free(s.rrow);
    free(buf);
    return MTRL_OK;
}

// ---- snapshot / resume ---------------------------------------------------------------------------------------

#define SNAP_MAGIC "MTRLSNAP"
#define SNAP_VERSION 1u

static void put_reals_(mtrl_wbuf *b, const real *x, size_t n) {
    for (size_t i = 0; i < n; i++) mtrl_wbuf_f32(b, (float)x[i]);
}

static int get_reals_(mtrl_rbuf *rb, real *x, size_t n, const char *field) {
    if (!mtrl_rbuf_need(rb, 4 * (uint64_t)n, field)) return 0;
    for (size_t i = 0; i < n; i++) x[i] = (real)mtrl_rbuf_f32(rb, field);
    return 1;
}

// The shape numbers a snapshot must agree on with the model it resumes into.
static void snap_shape_(const mtrl_model *m, uint32_t s[8]) {
    const mtrl_model_dims *d = &m->dims;
    int nk = 0;
    for (int l = 0; l < d->L; l++) nk += d->mixer[l] == 'K';
    s[0] = (uint32_t)d->L; s[1] = (uint32_t)nk; s[2] = (uint32_t)d->H; s[3] = (uint32_t)d->D;
    s[4] = (uint32_t)d->W; s[5] = (uint32_t)d->dc; s[6] = (uint32_t)d->dr; s[7] = (uint32_t)d->V;
}

mtrl_status mtrl_rollout_snapshot(mtrl_rollout *r, int i, mtrl_wbuf *out, mtrl_error *err) {
    if (i < 0 || i >= r->n || !r->slots[i].active)
        return mtrl_error_set(err, MTRL_ERR_STATE, "snapshot: slot %d has no episode in flight", i);
    slot *s = &r->slots[i];
    const mtrl_model_dims *d = &r->m->dims;
    if (s->pend_n > 0) // a feed pending (parked, or between a long one's rounds): tokens ahead of the state
        return mtrl_error_set(err, MTRL_ERR_STATE, "snapshot: slot %d has a feed not yet prefilled", i);
    size_t start = out->len;
    mtrl_wbuf_bytes(out, SNAP_MAGIC, 8);
    mtrl_wbuf_u32(out, SNAP_VERSION);
    uint32_t shape[8];
    snap_shape_(r->m, shape);
    for (int k = 0; k < 8; k++) mtrl_wbuf_u32(out, shape[k]);
    // The trajectory as a whole-episode record; an in-flight episode has no final status, so it
    // travels as ABORTED with this reason and comes back OPEN.
    mtrl_traj *t = &s->traj;
    mtrl_ep_status keep = t->status;
    t->status = MTRL_EP_ABORTED;
    mtrl_traj_set_reason(t, "in-flight snapshot");
    mtrl_wbuf tb;
    mtrl_wbuf_init(&tb);
    mtrl_traj_encode(&tb, t);
    t->status = keep;
    mtrl_traj_set_reason(t, "%s", "");
    mtrl_wbuf_u64(out, tb.len);
    mtrl_wbuf_bytes(out, tb.data, tb.len);
    mtrl_wbuf_free(&tb);
    mtrl_wbuf_u64(out, s->turn_start);
    mtrl_wbuf_u64(out, (uint64_t)s->tool_open);
    mtrl_wbuf_u32(out, s->turn);
    mtrl_wbuf_u32(out, (uint32_t)s->st.pos);
    int nk = (int)shape[1], nm = d->L - nk;
    size_t S_sz = (size_t)d->H * d->D * d->D, C_sz = (size_t)3 * (d->W - 1) * d->H * d->D, lw = (size_t)d->dc + d->dr;
    // The state as host arrays (it may live on a GPU): latents packed, pos rows per layer.
    real *hS = xmalloc(sizeof(real) * ((size_t)nk * S_sz + 1)), *hC = xmalloc(sizeof(real) * ((size_t)nk * C_sz + 1));
    real *hL = xmalloc(sizeof(real) * ((size_t)nm * (size_t)s->st.pos * lw + 1));
    mtrl_decode_state_download(r->m, &s->st, hS, hC, hL);
    put_reals_(out, hS, (size_t)nk * S_sz);
    put_reals_(out, hC, (size_t)nk * C_sz);
    put_reals_(out, hL, (size_t)nm * (size_t)s->st.pos * lw);
    free(hS);
    free(hC);
    free(hL);
    put_reals_(out, s->logits, (size_t)d->V);
    mtrl_wbuf_u32(out, mtrl_crc32c(0, out->data + start, out->len - start));
    return MTRL_OK;
}

uint64_t mtrl_rollout_adopt(mtrl_rollout *r, int i) {
    MTRL_CHECKF(i >= 0 && i < r->n && r->slots[i].active, "adopt: slot %d has no episode", i);
    mtrl_traj *t = &r->slots[i].traj;
    uint64_t old = t->episode_id;
    t->actor_id = r->p.actor_id;
    t->incarnation = r->p.incarnation;
    t->episode_id = ((uint64_t)r->p.actor_id << 48) | ((uint64_t)(r->p.incarnation & 0xffff) << 32) |
                    (r->next_episode++ & 0xffffffff);
    return old;
}

int mtrl_rollout_reincarnate(mtrl_rollout *r, uint32_t incarnation) {
    r->p.incarnation = incarnation;
    int n = 0;
    for (int i = 0; i < r->n; i++)
        if (r->slots[i].active) {
            mtrl_rollout_adopt(r, i);
            n++;
        }
    return n;
}

mtrl_status mtrl_rollout_resume(mtrl_rollout *r, int i, const void *buf, size_t n, mtrl_error *err) {
    if (i < 0 || i >= r->n || r->slots[i].active)
        return mtrl_error_set(err, MTRL_ERR_STATE, "resume: slot %d is not idle", i);
    if (n < 12 + 4 || memcmp(buf, SNAP_MAGIC, 8))
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "resume: not an episode snapshot (bad magic)");
    const uint8_t *p = buf;
    if (mtrl_crc32c(0, p, n - 4) != mtrl_le32(p + n - 4))
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "resume: snapshot CRC mismatch (torn or corrupt)");
    mtrl_rbuf rb;
    mtrl_rbuf_init(&rb, p, n - 4, "episode snapshot", err);
    mtrl_rbuf_take(&rb, 8, "magic");
    uint32_t ver = mtrl_rbuf_u32(&rb, "version");
    if (ver != SNAP_VERSION) return mtrl_error_set(err, MTRL_ERR_FORMAT, "resume: snapshot version %u, expected %u", ver, SNAP_VERSION);
    uint32_t shape[8], want[8];
    snap_shape_(r->m, want);
    for (int k = 0; k < 8; k++) shape[k] = mtrl_rbuf_u32(&rb, "shape");
    if (rb.status != MTRL_OK) return rb.status;
    if (memcmp(shape, want, sizeof shape))
        return mtrl_error_set(err, MTRL_ERR_MISMATCH, "resume: the snapshot was taken with another model shape");
    slot *s = &r->slots[i];
    const mtrl_model_dims *d = &r->m->dims;
    uint64_t tlen = mtrl_rbuf_u64(&rb, "trajectory length");
    const uint8_t *tp = mtrl_rbuf_take(&rb, tlen, "trajectory");
    if (!tp) return rb.status;
    mtrl_traj_limits lim = mtrl_traj_limits_default();
    mtrl_status st = mtrl_traj_decode(&s->traj, tp, tlen, &lim, err);
    if (st != MTRL_OK) return st;
    s->traj.status = MTRL_EP_OPEN;
    mtrl_traj_set_reason(&s->traj, "%s", "");
    s->ptab_rows = 0;
    ptab_sync_(s);
    s->turn_start = mtrl_rbuf_u64(&rb, "turn start");
    s->tool_open = (int64_t)mtrl_rbuf_u64(&rb, "tool open");
    s->turn = mtrl_rbuf_u32(&rb, "turn");
    uint32_t pos = mtrl_rbuf_u32(&rb, "position");
    if (rb.status != MTRL_OK) return rb.status;
    if (r->mem.slot) {
        if (r->mem.slot[i].where != MTRL_EPMEM_NONE) mtrl_epmem_release(&r->mem, i);
        if ((st = mtrl_epmem_admit(&r->mem, i, (int)pos + 1, NULL, err)) != MTRL_OK) return mtrl_error_wrap(err, "resume");
    }
    // Between generation steps every token has been fed to the model: positions == tokens.
    if (pos > (uint32_t)s->st.cap || pos != s->traj.n_tokens)
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "resume: %u positions for %llu tokens (decode state capacity %d)", pos,
                              (unsigned long long)s->traj.n_tokens, s->st.cap);
    int nk = (int)shape[1], nm = d->L - nk;
    size_t S_sz = (size_t)d->H * d->D * d->D, C_sz = (size_t)3 * (d->W - 1) * d->H * d->D, lw = (size_t)d->dc + d->dr;
    real *hS = xmalloc(sizeof(real) * ((size_t)nk * S_sz + 1)), *hC = xmalloc(sizeof(real) * ((size_t)nk * C_sz + 1));
    real *hL = xmalloc(sizeof(real) * ((size_t)nm * pos * lw + 1));
    int ok = get_reals_(&rb, hS, (size_t)nk * S_sz, "KDA states") && get_reals_(&rb, hC, (size_t)nk * C_sz, "conv windows") &&
             get_reals_(&rb, hL, (size_t)nm * pos * lw, "MLA latents") && get_reals_(&rb, s->logits, (size_t)d->V, "logits");
    if (ok && rb.status == MTRL_OK) mtrl_decode_state_upload(r->m, &s->st, (int)pos, hS, hC, hL);
    free(hS);
    free(hC);
    free(hL);
    if (!ok || rb.status != MTRL_OK) return rb.status != MTRL_OK ? rb.status : MTRL_ERR_FORMAT;
    // The env: reset with the task seed, then the recorded tool calls, checking every result.
    mtrl_env_result res;
    if ((st = mtrl_env_reset(s->env, s->traj.task_seed, &res, err)) != MTRL_OK) return mtrl_error_wrap(err, "resume");
    for (uint32_t k = 0; k < s->traj.n_tools; k++) {
        const mtrl_tool_call *tc = &s->traj.tools[k];
        if ((st = mtrl_env_step(s->env, MTRL_ENV_ACTION_TOOL, (const char *)tc->args, tc->args_len, &res, err)) != MTRL_OK)
            return mtrl_error_wrap(err, "resume: re-running tool call %u", k);
        if (res.obs_len != tc->result_len || (res.obs_len && memcmp(res.obs, tc->result, res.obs_len)))
            return mtrl_error_set(err, MTRL_ERR_MISMATCH,
                                  "resume: the env answered tool call %u differently than recorded (not deterministic)", k);
    }
    s->needs_decode = 0;
    s->active = 1;
    return MTRL_OK;
}
