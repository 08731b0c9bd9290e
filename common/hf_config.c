// hf_config.c: config.json <-> [model] keys (see hf_config.h).
#include "common/hf_config.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/fsutil.h"

static void add_key_(mtrl_hf_config *h, const char *key, const char *field, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void add_key_(mtrl_hf_config *h, const char *key, const char *field, const char *fmt, ...) {
    if (h->n_keys >= MTRL_HF_MAX_KEYS) return;
    mtrl_hf_key *k = &h->keys[h->n_keys++];
    snprintf(k->key, sizeof k->key, "%s", key);
    snprintf(k->field, sizeof k->field, "%s", field);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(k->value, sizeof k->value, fmt, ap);
    va_end(ap);
}

const char *mtrl_hf_config_get(const mtrl_hf_config *h, const char *key) {
    for (int i = 0; i < h->n_keys; i++)
        if (!strcmp(h->keys[i].key, key)) return h->keys[i].value;
    return NULL;
}

// Fields read below only to check their one supported value, and fields that do not change what
// the model computes from token ids (generation defaults, bookkeeping, names of derived dims).
static const char *const known_[] = {
    "architectures", "auto_map", "transformers_version", "dtype", "torch_dtype", "initializer_range", "use_cache",
    "model_max_length", "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "_name_or_path",
    "output_attentions", "output_hidden_states", "return_dict", "qk_head_dim", "head_dim", "keys_to_ignore_at_inference",
    "rope_theta", "rope_scaling", "rope_parameters", "use_grouped_topk", "chunk_size_feed_forward",
    "problem_type", "id2label", "label2id", "tie_encoder_decoder", "is_encoder_decoder", "tokenizer_class",
    "moe_router_activation_func", "mla_use_nope", "attention_dropout", "pretraining_tp", "num_nextn_predict_layers",
    "moe_layer_freq", "hidden_act", "tie_word_embeddings", "attention_bias", "q_lora_rank", "n_group", "num_expert_group",
    "topk_group", "num_key_value_heads", "model_type", "full_attn_layers", "kda_layers", "linear_attn_config",
    "layer_types", "mlp_layer_types", "first_k_dense_replace", NULL,
};
// Mapped fields (each under every spelling).
static const char *const mapped_[] = {
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
    "n_shared_experts", "num_shared_experts", "routed_scaling_factor", "num_experts_per_tok", "num_experts_per_token",
    "norm_topk_prob", "moe_renormalize", "rms_norm_eps", "num_local_experts", "num_experts", "linear_head_dim",
    "linear_num_heads", "linear_conv_kernel_dim", NULL,
};

static int in_(const char *const *list, const char *k) {
    for (int i = 0; list[i]; i++)
        if (!strcmp(list[i], k)) return 1;
    return 0;
}

// The first of the spellings present.
static json_t *get_(json_t *root, const char *a, const char *b) {
    json_t *v = json_object_get(root, a);
    return v || !b ? v : json_object_get(root, b);
}

typedef struct rd {
    mtrl_hf_config *h;
    json_t *root;
    mtrl_error *err;
    mtrl_status st;
} rd;

static int fail_(rd *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail_(rd *r, const char *fmt, ...) {
    if (r->st != MTRL_OK) return 0;
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    r->st = mtrl_error_set(r->err, MTRL_ERR_USAGE, "%s: %s (docs/hf-import.md lists what mtrl imports)", r->h->path, msg);
    return 0;
}

// An integer field (either spelling), required unless def >= 0.
static long int_(rd *r, const char *a, const char *b, long def, long lo, long hi) {
    json_t *v = get_(r->root, a, b);
    if (!v || json_is_null(v)) {
        if (def < 0) fail_(r, "%s is missing", a);
        return def;
    }
    if (!json_is_integer(v)) return fail_(r, "%s is not an integer", a), def;
    long x = (long)json_integer_value(v);
    if (x < lo || x > hi) return fail_(r, "%s = %ld is out of the range mtrl takes (%ld..%ld)", a, x, lo, hi), def;
    return x;
}

static double num_(rd *r, const char *a, const char *b, double def) {
    json_t *v = get_(r->root, a, b);
    if (!v || json_is_null(v)) return def;
    if (!json_is_number(v)) return fail_(r, "%s is not a number", a), def;
    return json_number_value(v);
}

static int bool_(rd *r, const char *a, const char *b, int def) {
    json_t *v = get_(r->root, a, b);
    if (!v || json_is_null(v)) return def;
    if (!json_is_boolean(v)) return fail_(r, "%s is not true or false", a), def;
    return json_is_true(v);
}

// A field mtrl implements for one value only: absent, or that value.
static void need_int_(rd *r, const char *a, const char *b, long want, const char *why) {
    json_t *v = json_object_get(r->root, a);
    const char *name = a;
    if (!v && b) v = json_object_get(r->root, name = b);
    if (!v || json_is_null(v)) return;
    if (!json_is_integer(v)) fail_(r, "%s is not an integer: %s; only %ld is supported", name, why, want);
    else if (json_integer_value(v) != want)
        fail_(r, "%s = %lld: %s; only %ld is supported", name, (long long)json_integer_value(v), why, want);
}
static void need_bool_(rd *r, const char *a, int want, const char *why) {
    json_t *v = json_object_get(r->root, a);
    if (!v || json_is_null(v)) return;
    if (!json_is_boolean(v) || json_is_true(v) != want) fail_(r, "%s = %s: %s", a, json_is_true(v) ? "true" : "false", why);
}
static void need_str_(rd *r, const char *a, const char *want, const char *why) {
    json_t *v = json_object_get(r->root, a);
    if (!v || json_is_null(v)) return;
    if (!json_is_string(v) || strcmp(json_string_value(v), want))
        fail_(r, "%s = '%s': %s; only '%s' is supported", a, json_is_string(v) ? json_string_value(v) : "?", why, want);
}

static long token_id_(json_t *v) {
    if (json_is_array(v) && json_array_size(v) > 0) v = json_array_get(v, 0);
    return json_is_integer(v) ? (long)json_integer_value(v) : -1;
}

// layer_types (or linear_attn_config's 1-based lists) as K / M letters.
static void mixers_(rd *r, long L, char *out) {
    json_t *lt = json_object_get(r->root, "layer_types"), *lac = json_object_get(r->root, "linear_attn_config");
    memset(out, 0, (size_t)L + 1);
    if (json_is_array(lt)) {
        if ((long)json_array_size(lt) != L) {
            fail_(r, "layer_types has %zu entries for num_hidden_layers = %ld", json_array_size(lt), L);
            return;
        }
        for (long l = 0; l < L; l++) {
            const char *s = json_string_value(json_array_get(lt, (size_t)l));
            if (s && !strcmp(s, "linear_attention")) out[l] = 'K';
            else if (s && !strcmp(s, "full_attention")) out[l] = 'M';
            else {
                fail_(r, "layer_types[%ld] = '%s': mtrl has linear_attention (KDA) and full_attention (MLA)", l, s ? s : "?");
                return;
            }
        }
        return;
    }
    json_t *kda = json_is_object(lac) ? json_object_get(lac, "kda_layers") : NULL;
    json_t *full = json_is_object(lac) ? json_object_get(lac, "full_attn_layers") : NULL;
    if (json_is_array(kda) && json_is_array(full)) {
        for (int pass = 0; pass < 2; pass++) {
            json_t *a = pass ? full : kda;
            for (size_t i = 0; i < json_array_size(a); i++) {
                json_t *x = json_array_get(a, i);
                long l = json_is_integer(x) ? (long)json_integer_value(x) : 0;
                if (l < 1 || l > L) {
                    fail_(r, "linear_attn_config.%s[%zu] is not a layer 1..%ld", pass ? "full_attn_layers" : "kda_layers", i, L);
                    return;
                }
                out[l - 1] = pass ? 'M' : 'K';
            }
        }
        for (long l = 0; l < L; l++)
            if (!out[l]) {
                fail_(r, "linear_attn_config names no kind for layer %ld", l + 1);
                return;
            }
        return;
    }
    // transformers' default: full attention at every 4th layer after the first.
    for (long l = 0; l < L; l++) out[l] = l && l % 4 == 0 ? 'M' : 'K';
}

// The number of leading dense layers (mlp_layer_types, or first_k_dense_replace, default 1).
static long dense_layers_(rd *r, long L) {
    json_t *mt = json_object_get(r->root, "mlp_layer_types");
    if (json_is_array(mt)) {
        if ((long)json_array_size(mt) != L) return fail_(r, "mlp_layer_types has %zu entries for %ld layers", json_array_size(mt), L), 1;
        long n = 0;
        while (n < L && json_is_string(json_array_get(mt, (size_t)n)) && !strcmp(json_string_value(json_array_get(mt, (size_t)n)), "dense")) n++;
        for (long l = n; l < L; l++) {
            const char *s = json_string_value(json_array_get(mt, (size_t)l));
            if (!s || strcmp(s, "sparse"))
                return fail_(r, "mlp_layer_types[%ld] = '%s': mtrl takes dense layers first, then sparse (MoE) ones", l, s ? s : "?"), 1;
        }
        return n;
    }
    return int_(r, "first_k_dense_replace", NULL, 1, 0, L);
}

mtrl_status mtrl_hf_config_read(mtrl_hf_config *h, const char *dir, mtrl_error *err) {
    memset(h, 0, sizeof *h);
    struct stat sb;
    if (stat(dir, &sb) == 0 && S_ISDIR(sb.st_mode)) snprintf(h->path, sizeof h->path, "%s/config.json", dir);
    else snprintf(h->path, sizeof h->path, "%s", dir);
    json_error_t je;
    json_t *root = json_load_file(h->path, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        if (je.line < 0 || je.position == 0) return mtrl_error_set(err, MTRL_ERR_IO, "%s: %s", h->path, je.text);
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s:%d:%d: %s", h->path, je.line, je.column, je.text);
    }
    rd r = {h, root, err, MTRL_OK};
    if (!json_is_object(root)) fail_(&r, "not a JSON object");
    need_str_(&r, "model_type", "kimi_linear", "mtrl imports the Kimi-Linear layout");
    if (!json_object_get(root, "model_type")) fail_(&r, "model_type is missing (expected 'kimi_linear')");
    json_t *arch = json_object_get(root, "architectures");
    for (size_t i = 0; json_is_array(arch) && i < json_array_size(arch); i++)
        if (!json_is_string(json_array_get(arch, i)) || strcmp(json_string_value(json_array_get(arch, i)), "KimiLinearForCausalLM"))
            fail_(&r, "architectures[%zu] = '%s': mtrl imports KimiLinearForCausalLM", i,
                  json_string_value(json_array_get(arch, i)) ? json_string_value(json_array_get(arch, i)) : "?");
    // Every field must be known: a field mtrl does not read could change the model.
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        if (!in_(known_, key) && !in_(mapped_, key))
            fail_(&r, "field '%s' is not one mtrl imports (a model that needs it would compute differently)", key);
    }
    // Values mtrl implements one way only.
    json_t *q = json_object_get(root, "q_lora_rank");
    if (q && !json_is_null(q))
        fail_(&r, "q_lora_rank = %lld: mtrl's MLA has no low-rank query projection (q_a_proj, q_a_layernorm, q_b_proj); only null is supported",
              json_is_integer(q) ? (long long)json_integer_value(q) : -1LL);
    need_int_(&r, "n_group", "num_expert_group", 1, "mtrl's router has no group-limited top-k");
    need_int_(&r, "topk_group", NULL, 1, "mtrl's router has no group-limited top-k");
    need_bool_(&r, "tie_word_embeddings", 0, "mtrl keeps embed_tokens and lm_head apart; only false is supported");
    need_bool_(&r, "attention_bias", 0, "mtrl's projections have no biases; only false is supported");
    need_bool_(&r, "mla_use_nope", 1, "mtrl's MLA is NoPE (no rotary embedding); only true is supported");
    need_str_(&r, "hidden_act", "silu", "mtrl's FFNs are SwiGLU");
    need_str_(&r, "moe_router_activation_func", "sigmoid", "mtrl imports sigmoid routing with the correction bias");
    need_int_(&r, "moe_layer_freq", NULL, 1, "mtrl has an MoE in every layer after the dense ones");
    need_int_(&r, "num_nextn_predict_layers", NULL, 0, "mtrl has no multi-token-prediction layers");
    need_int_(&r, "pretraining_tp", NULL, 1, "tensor-parallel slicing of the forward is not implemented");
    if (num_(&r, "attention_dropout", NULL, 0) != 0) fail_(&r, "attention_dropout is not 0: mtrl has no dropout");
    json_t *rs = json_object_get(root, "rope_scaling");
    if (rs && !json_is_null(rs)) fail_(&r, "rope_scaling is set: mtrl's MLA is NoPE and takes none");
    long L = int_(&r, "num_hidden_layers", NULL, -1, 1, MTRL_CFG_STR_MAX - 1);
    long mH = int_(&r, "num_attention_heads", NULL, -1, 1, 1024);
    long kvh = int_(&r, "num_key_value_heads", NULL, mH, 1, 1024);
    if (r.st == MTRL_OK && kvh != mH) fail_(&r, "num_key_value_heads = %ld differs from num_attention_heads = %ld: MLA has one latent for all heads", kvh, mH);
    json_t *lac = json_object_get(root, "linear_attn_config");
    if (lac && !json_is_null(lac) && !json_is_object(lac)) fail_(&r, "linear_attn_config is not an object");
    long H = int_(&r, "linear_num_heads", NULL, -2, 1, 1024), D = int_(&r, "linear_head_dim", NULL, -2, 1, 1024);
    long W = int_(&r, "linear_conv_kernel_dim", NULL, -2, 1, 16);
    if (json_is_object(lac)) {
        json_object_foreach(lac, key, v) {
            if (strcmp(key, "num_heads") && strcmp(key, "head_dim") && strcmp(key, "short_conv_kernel_size") &&
                strcmp(key, "kda_layers") && strcmp(key, "full_attn_layers"))
                fail_(&r, "linear_attn_config.%s is not a field mtrl imports", key);
        }
        json_t *x;
        if ((x = json_object_get(lac, "num_heads"))) H = json_is_integer(x) ? (long)json_integer_value(x) : -1;
        if ((x = json_object_get(lac, "head_dim"))) D = json_is_integer(x) ? (long)json_integer_value(x) : -1;
        if ((x = json_object_get(lac, "short_conv_kernel_size"))) W = json_is_integer(x) ? (long)json_integer_value(x) : -1;
    }
    // transformers' defaults where the file has neither spelling.
    if (H == -2) H = 32;
    if (D == -2) D = 128;
    if (W == -2) W = 4;
    if (H < 1 || D < 1 || W < 1 || W > 16) fail_(&r, "linear attention heads %ld, head dim %ld, conv kernel %ld: out of range", H, D, W);
    char mixer[MTRL_CFG_STR_MAX] = "";
    if (r.st == MTRL_OK) mixers_(&r, L, mixer);
    long first_dense = r.st == MTRL_OK ? dense_layers_(&r, L) : 1;
    if (r.st == MTRL_OK && first_dense < 1) fail_(&r, "no dense first layer (first_k_dense_replace = 0): mtrl's first layer is dense");
    long V = int_(&r, "vocab_size", NULL, -1, 2, 1L << 26);
    long d = int_(&r, "hidden_size", NULL, -1, 1, 65536);
    long dense_I = int_(&r, "intermediate_size", NULL, -1, 1, 1L << 20);
    long I = int_(&r, "moe_intermediate_size", NULL, -1, 1, 1L << 20);
    long dc = int_(&r, "kv_lora_rank", NULL, -1, 1, 8192);
    long dr = int_(&r, "qk_rope_head_dim", NULL, -1, 0, 1024);
    long dn = int_(&r, "qk_nope_head_dim", NULL, -1, 1, 1024);
    long dv = int_(&r, "v_head_dim", NULL, -1, 1, 1024);
    long E = int_(&r, "num_experts", "num_local_experts", -1, 1, 256);
    long k = int_(&r, "num_experts_per_token", "num_experts_per_tok", -1, 1, 64);
    // Defaults where a field is absent: KimiLinearConfig's.
    long ns = int_(&r, "num_shared_experts", "n_shared_experts", 1, 0, 16);
    double rho = num_(&r, "routed_scaling_factor", NULL, 2.446);
    int renorm = bool_(&r, "moe_renormalize", "norm_topk_prob", 1);
    double eps = num_(&r, "rms_norm_eps", NULL, 1e-5);
    h->vocab = V;
    h->bos_id = token_id_(json_object_get(root, "bos_token_id"));
    h->eos_id = token_id_(json_object_get(root, "eos_token_id"));
    h->pad_id = token_id_(json_object_get(root, "pad_token_id"));
    if (r.st == MTRL_OK && k > E) fail_(&r, "num_experts_per_token = %ld exceeds num_experts = %ld", k, E);
    if (r.st == MTRL_OK) {
        add_key_(h, "layers", "num_hidden_layers", "%ld", L);
        add_key_(h, "d_model", "hidden_size", "%ld", d);
        add_key_(h, "vocab", "vocab_size", "%ld", V);
        add_key_(h, "hybrid", "layer_types", "%s", mixer);
        add_key_(h, "kda_heads", "linear_num_heads", "%ld", H);
        add_key_(h, "kda_head_dim", "linear_head_dim", "%ld", D);
        add_key_(h, "conv_kernel", "linear_conv_kernel_dim", "%ld", W);
        add_key_(h, "kda_gate", "(Kimi's KDA gate)", "kimi");
        add_key_(h, "mla_heads", "num_attention_heads", "%ld", mH);
        add_key_(h, "mla_nope_dim", "qk_nope_head_dim", "%ld", dn);
        add_key_(h, "mla_rope_dim", "qk_rope_head_dim", "%ld", dr);
        add_key_(h, "mla_v_dim", "v_head_dim", "%ld", dv);
        add_key_(h, "mla_latent_dim", "kv_lora_rank", "%ld", dc);
        add_key_(h, "mla_gate", "(no MLA output gate)", "false");
        add_key_(h, "dense_layers", "first_k_dense_replace", "%ld", first_dense);
        add_key_(h, "dense_inter", "intermediate_size", "%ld", dense_I);
        add_key_(h, "experts", "num_experts", "%ld", E);
        add_key_(h, "top_k", "num_experts_per_token", "%ld", k);
        add_key_(h, "shared_experts", "num_shared_experts", "%ld", ns);
        add_key_(h, "expert_inter", "moe_intermediate_size", "%ld", I);
        add_key_(h, "rho", "routed_scaling_factor", "%.17g", rho);
        add_key_(h, "router_score", "(sigmoid routing)", "sigmoid");
        add_key_(h, "router_bias", "(e_score_correction_bias on the scores)", "score");
        add_key_(h, "router_renorm", "moe_renormalize", "%s", renorm ? "true" : "false");
        add_key_(h, "norm_eps", "rms_norm_eps", "%.17g", eps);
        add_key_(h, "attnres", "(no Attention Residuals)", "false");
        add_key_(h, "mla_kv_norm_eps", "(kv_a_layernorm's own eps)", "1e-6");
        add_key_(h, "g_min", "(the floor a GPU clamps the unbounded gate to)", "-8");
    }
    json_decref(root);
    return r.st;
}

// ---- writing --------------------------------------------------------------------------------------------

static void set_int_(json_t *o, const char *k, long v) { json_object_set_new(o, k, json_integer(v)); }

mtrl_status mtrl_hf_config_write(const char *path, const mtrl_cfg_model *m, long vocab, long bos_id, long eos_id,
                                 long pad_id, mtrl_error *err) {
    json_t *o = json_object();
    json_t *arch = json_array();
    json_array_append_new(arch, json_string("KimiLinearForCausalLM"));
    json_object_set_new(o, "architectures", arch);
    json_object_set_new(o, "model_type", json_string("kimi_linear"));
    json_object_set_new(o, "attention_bias", json_false());
    json_object_set_new(o, "attention_dropout", json_real(0.0));
    if (bos_id >= 0) set_int_(o, "bos_token_id", bos_id);
    if (eos_id >= 0) set_int_(o, "eos_token_id", eos_id);
    if (pad_id >= 0) set_int_(o, "pad_token_id", pad_id);
    json_object_set_new(o, "dtype", json_string("float32"));
    json_object_set_new(o, "hidden_act", json_string("silu"));
    set_int_(o, "hidden_size", m->d_model);
    set_int_(o, "intermediate_size", m->dense_inter);
    set_int_(o, "kv_lora_rank", m->mla_latent_dim);
    json_t *lt = json_array(), *mt = json_array();
    long L = m->layers;
    for (long l = 0; l < L; l++) {
        json_array_append_new(lt, json_string(m->hybrid[l] == 'M' ? "full_attention" : "linear_attention"));
        json_array_append_new(mt, json_string(l < m->dense_layers ? "dense" : "sparse"));
    }
    json_object_set_new(o, "layer_types", lt);
    json_object_set_new(o, "mlp_layer_types", mt);
    set_int_(o, "linear_conv_kernel_dim", m->conv_kernel);
    set_int_(o, "linear_head_dim", m->kda_head_dim);
    set_int_(o, "linear_num_heads", m->kda_heads);
    set_int_(o, "moe_intermediate_size", m->expert_inter);
    json_object_set_new(o, "moe_renormalize", json_boolean(m->router_renorm));
    set_int_(o, "num_attention_heads", m->mla_heads);
    set_int_(o, "num_expert_group", 1);
    set_int_(o, "num_experts", m->experts);
    set_int_(o, "num_experts_per_token", m->top_k);
    set_int_(o, "num_hidden_layers", L);
    set_int_(o, "num_key_value_heads", m->mla_heads);
    set_int_(o, "num_shared_experts", m->shared_experts);
    json_object_set_new(o, "q_lora_rank", json_null());
    set_int_(o, "qk_nope_head_dim", m->mla_nope_dim);
    set_int_(o, "qk_rope_head_dim", m->mla_rope_dim);
    json_object_set_new(o, "rms_norm_eps", json_real(m->norm_eps));
    json_object_set_new(o, "routed_scaling_factor", json_real(m->rho));
    json_object_set_new(o, "tie_word_embeddings", json_false());
    set_int_(o, "topk_group", 1);
    set_int_(o, "v_head_dim", m->mla_v_dim);
    set_int_(o, "vocab_size", vocab);
    char tmp[4200];
    FILE *f = mtrl_file_atomic_begin(path, tmp, sizeof tmp);
    mtrl_status st = MTRL_OK;
    if (!f) st = mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    else {
        int bad = json_dumpf(o, f, JSON_INDENT(2) | JSON_SORT_KEYS | JSON_REAL_PRECISION(17)) != 0 || fputc('\n', f) == EOF;
        if (mtrl_file_atomic_end(f, tmp, path, bad) != 0)
            st = mtrl_error_set(err, MTRL_ERR_IO, "%s: write failed: %s", path, strerror(errno));
    }
    json_decref(o);
    return st;
}
