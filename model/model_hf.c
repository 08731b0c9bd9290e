// model_hf.c: the Kimi-Linear safetensors layout <-> the backbone's parameters (see model_hf.h).
#include "model/model_hf.h"

#include <dirent.h>
#include <stdarg.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/check.h"
#include "common/hf_config.h"
#include "model/model_ws.h"
#include "common/safetensors.h"
#include "common/timeutil.h"

#if REAL_IS_F64
#define REAL_DT MTRL_DT_F64
#else
#define REAL_DT MTRL_DT_F32
#endif

enum { HF_PARAM, HF_NEG_BETA }; // a parameter as it is, or the correction bias = -beta

typedef struct hf_tensor {
    char name[128];
    char alt[128];  // another spelling to read (""), e.g. a dense FFN under block_sparse_moe.
    int ndim;
    int64_t shape[4];
    real *dst;      // host block (or m->qb_beta row)
    int kind;
} hf_tensor;

typedef struct hf_list {
    hf_tensor *t;
    int n, cap;
} hf_list;

static hf_tensor *push_(hf_list *L, real *dst, int kind, int ndim, int64_t a, int64_t b, int64_t c, int64_t d,
                        const char *fmt, ...) __attribute__((format(printf, 9, 10)));
static hf_tensor *push_(hf_list *L, real *dst, int kind, int ndim, int64_t a, int64_t b, int64_t c, int64_t d,
                        const char *fmt, ...) {
    if (L->n == L->cap) {
        L->cap = L->cap ? 2 * L->cap : 256;
        L->t = xrealloc(L->t, sizeof *L->t * (size_t)L->cap);
    }
    hf_tensor *t = &L->t[L->n++];
    memset(t, 0, sizeof *t);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->name, sizeof t->name, fmt, ap);
    va_end(ap);
    int64_t s[4] = {a, b, c, d};
    t->ndim = ndim;
    memcpy(t->shape, s, sizeof s);
    t->dst = dst;
    t->kind = kind;
    MTRL_CHECKF(dst, "%s: the model has no tensor for it", t->name);
    return t;
}

// The forms the layout needs; NULL when m has them.
static const char *forms_problem_(const mtrl_model_dims *d) {
    if (d->attnres) return "attnres = true (Kimi Linear has a plain residual stream: attnres = false)";
    if (d->kda_gate != MTRL_KDA_GATE_KIMI && model_n_kda(d) > 0) return "kda_gate = bounded (Kimi Linear's gate is kda_gate = kimi)";
    if (d->mla_gate && model_n_mla(d) > 0) return "mla_gate = true (Kimi Linear's MLA has no output gate)";
    if (d->n_moe > 0 && (!d->router_bias_score || d->score_softmax))
        return "router_bias = logit or router_score = softmax (Kimi Linear routes on sigmoid scores plus e_score_correction_bias: "
               "router_bias = score, router_score = sigmoid)";
    return NULL;
}

// Every tensor of the layout with where it lives in m (host blocks).
static void list_(mtrl_model *m, hf_list *L) {
    const mtrl_model_dims *d = &m->dims;
    int64_t HD = (int64_t)d->H * d->D, V = d->V, dm = d->d;
    mtrl_model_ptrs *P = &m->P;
    push_(L, P->embed, HF_PARAM, 2, V, dm, 0, 0, "model.embed_tokens.weight");
    push_(L, P->lm_head, HF_PARAM, 2, V, dm, 0, 0, "lm_head.weight");
    push_(L, P->final_norm, HF_PARAM, 1, dm, 0, 0, 0, "model.norm.weight");
    for (int l = 0; l < d->L; l++) {
        mtrl_layer_ptrs *x = &P->layer[l];
        const char *pre = "model.layers";
        push_(L, x->norm1, HF_PARAM, 1, dm, 0, 0, 0, "%s.%d.input_layernorm.weight", pre, l);
        push_(L, x->norm2, HF_PARAM, 1, dm, 0, 0, 0, "%s.%d.post_attention_layernorm.weight", pre, l);
        if (d->mixer[l] == 'K') {
#define A(field, sfx, nd, a, b, c, dd) push_(L, x->field, HF_PARAM, nd, a, b, c, dd, "%s.%d.self_attn." sfx, pre, l)
            A(wq, "q_proj.weight", 2, HD, dm, 0, 0);
            A(wk, "k_proj.weight", 2, HD, dm, 0, 0);
            A(wv, "v_proj.weight", 2, HD, dm, 0, 0);
            A(conv_q, "q_conv1d.weight", 3, HD, 1, d->W, 0);
            A(conv_k, "k_conv1d.weight", 3, HD, 1, d->W, 0);
            A(conv_v, "v_conv1d.weight", 3, HD, 1, d->W, 0);
            A(wf1, "f_a_proj.weight", 2, d->D, dm, 0, 0);
            A(wf2, "f_b_proj.weight", 2, HD, d->D, 0, 0);
            A(A_log, "A_log", 4, 1, 1, d->H, 1);
            A(dt_bias, "dt_bias", 1, HD, 0, 0, 0);
            A(wbeta, "b_proj.weight", 2, d->H, dm, 0, 0);
            A(wz1, "g_a_proj.weight", 2, d->D, dm, 0, 0);
            A(wz2, "g_b_proj.weight", 2, HD, d->D, 0, 0);
            A(onorm, "o_norm.weight", 1, d->D, 0, 0, 0);
            A(wo, "o_proj.weight", 2, dm, HD, 0, 0);
        } else {
            A(mq, "q_proj.weight", 2, (int64_t)d->mH * (d->dn + d->dr), dm, 0, 0);
            A(mkva, "kv_a_proj_with_mqa.weight", 2, d->dc + d->dr, dm, 0, 0);
            A(mkv_norm, "kv_a_layernorm.weight", 1, d->dc, 0, 0, 0);
            A(mkvb, "kv_b_proj.weight", 2, (int64_t)d->mH * (d->dn + d->dv), d->dc, 0, 0);
            A(mo, "o_proj.weight", 2, dm, (int64_t)d->mH * d->dv, 0, 0);
#undef A
        }
        if (mtrl_model_is_dense(d, l)) {
            static const char *const nm[3] = {"gate_proj", "up_proj", "down_proj"};
            real *dst[3] = {x->w1, x->w3, x->w2};
            for (int j = 0; j < 3; j++) {
                hf_tensor *t = push_(L, dst[j], HF_PARAM, 2, j < 2 ? d->dense_I : dm, j < 2 ? dm : d->dense_I, 0, 0,
                                     "%s.%d.mlp.%s.weight", pre, l, nm[j]);
                snprintf(t->alt, sizeof t->alt, "%s.%d.block_sparse_moe.%s.weight", pre, l, nm[j]);
            }
            continue;
        }
        int64_t E = d->E, I = d->I, SI = (int64_t)d->n_shared * d->I;
        push_(L, x->router, HF_PARAM, 2, E, dm, 0, 0, "%s.%d.block_sparse_moe.gate.weight", pre, l);
        push_(L, m->qb_beta + (size_t)l * (size_t)E, HF_NEG_BETA, 1, E, 0, 0, 0,
              "%s.%d.block_sparse_moe.gate.e_score_correction_bias", pre, l);
        for (int64_t e = 0; e < E; e++) {
            push_(L, x->ew1 + e * I * dm, HF_PARAM, 2, I, dm, 0, 0, "%s.%d.block_sparse_moe.experts.%lld.w1.weight", pre, l, (long long)e);
            push_(L, x->ew3 + e * I * dm, HF_PARAM, 2, I, dm, 0, 0, "%s.%d.block_sparse_moe.experts.%lld.w3.weight", pre, l, (long long)e);
            push_(L, x->ew2 + e * I * dm, HF_PARAM, 2, dm, I, 0, 0, "%s.%d.block_sparse_moe.experts.%lld.w2.weight", pre, l, (long long)e);
        }
        if (SI > 0) {
            push_(L, x->sw1, HF_PARAM, 2, SI, dm, 0, 0, "%s.%d.block_sparse_moe.shared_experts.gate_proj.weight", pre, l);
            push_(L, x->sw3, HF_PARAM, 2, SI, dm, 0, 0, "%s.%d.block_sparse_moe.shared_experts.up_proj.weight", pre, l);
            push_(L, x->sw2, HF_PARAM, 2, dm, SI, 0, 0, "%s.%d.block_sparse_moe.shared_experts.down_proj.weight", pre, l);
        }
    }
}

static size_t numel_(const hf_tensor *t) {
    size_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= (size_t)t->shape[i];
    return n;
}

mtrl_status mtrl_model_load_hf(mtrl_model *m, const char *dir, mtrl_hf_load_stats *stats, mtrl_error *err) {
    const char *why = forms_problem_(&m->dims);
    if (why) return mtrl_error_set(err, MTRL_ERR_USAGE, "%s: a Kimi-Linear checkpoint needs the model's Kimi forms, but [model] has %s", dir, why);
    double t0 = mtrl_time_mono();
    mtrl_st s;
    mtrl_status st = mtrl_st_open(&s, dir, err);
    if (st != MTRL_OK) return st;
    hf_list L = {0};
    list_(m, &L);
    int *at = xmalloc(sizeof(int) * (size_t)L.n);
    char *placed = xcalloc((size_t)s.n + 1, 1);
    // Every check before the first value is written: the model stays as it was on any error.
    for (int i = 0; i < L.n && st == MTRL_OK; i++) {
        hf_tensor *t = &L.t[i];
        at[i] = mtrl_st_find(&s, t->name);
        if (at[i] < 0 && t->alt[0]) at[i] = mtrl_st_find(&s, t->alt);
        if (at[i] < 0) {
            st = mtrl_error_set(err, MTRL_ERR_NOTFOUND, "%s: tensor %s is missing (the model's [model] section, from config.json, needs it)",
                                dir, t->name);
            break;
        }
        st = mtrl_st_check(&s, at[i], t->ndim, t->shape, err);
        placed[at[i]] = 1;
    }
    for (int i = 0; i < s.n && st == MTRL_OK; i++)
        if (!placed[i])
            st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: tensor %s has no place in the model (not a tensor of the Kimi-Linear layout "
                                "for this config.json; docs/hf-import.md lists the names)", mtrl_st_path_of(&s, i), s.t[i].name);
    for (int i = 0; i < L.n && st == MTRL_OK; i++) {
        hf_tensor *t = &L.t[i];
        st = mtrl_st_read(&s, at[i], REAL_DT, t->ndim, t->shape, t->dst, err);
        if (t->kind == HF_NEG_BETA)
            for (size_t j = 0; j < numel_(t); j++) t->dst[j] = -t->dst[j];
        MTRL_CHECKF(st == MTRL_OK, "%s: %s", t->name, err ? err->msg : "read failed after its checks passed");
    }
    if (st == MTRL_OK) {
        if (m->device != MTRL_DEVICE_CPU) mtrl_model_to_device(m); // parameters and beta
        if (stats) {
            stats->seconds = mtrl_time_mono() - t0;
            stats->bytes = s.bytes_read;
            stats->tensors = L.n;
            stats->files = s.n_files;
        }
    }
    free(placed);
    free(at);
    free(L.t);
    mtrl_st_close(&s);
    return st;
}

// ---- export ---------------------------------------------------------------------------------------------

static int copy_file_(const char *from, const char *to) {
    FILE *a = fopen(from, "rb");
    if (!a) return -1;
    FILE *b = fopen(to, "wb");
    if (!b) {
        fclose(a);
        return -1;
    }
    char buf[1 << 16];
    size_t n;
    int bad = 0;
    while (!bad && (n = fread(buf, 1, sizeof buf, a)) > 0) bad = fwrite(buf, 1, n, b) != n;
    bad |= ferror(a) || fflush(b) != 0 || fsync(fileno(b)) != 0;
    fclose(a);
    bad |= fclose(b) != 0;
    return bad ? -1 : 0;
}

static void remove_dir_(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char p[8192];
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
            snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
            unlink(p);
        }
    closedir(d);
    rmdir(dir);
}

// Files of a model folder that travel with the weights.
static const char *const side_files_[] = {
    "tiktoken.model", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "generation_config.json",
    "chat_template.jinja", "tokenization_kimi.py", NULL,
};

mtrl_status mtrl_model_save_hf(mtrl_model *m, const mtrl_cfg_model *cfg, const char *src_dir, const char *out,
                               mtrl_dtype disk_dtype, size_t max_shard, uint64_t *bytes_out, mtrl_error *err) {
    const char *why = forms_problem_(&m->dims);
    if (why) return mtrl_error_set(err, MTRL_ERR_USAGE, "export to %s: the Kimi-Linear layout has no place for a model with %s", out, why);
    struct stat sb;
    if (stat(out, &sb) == 0) return mtrl_error_set(err, MTRL_ERR_USAGE, "export: %s already exists; give a new folder", out);
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp-%ld", out, (long)getpid());
    remove_dir_(tmp);
    if (mkdir(tmp, 0755) != 0) return mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
    mtrl_model_to_host(m);
    hf_list L = {0};
    list_(m, &L);
    mtrl_st_entry *e = xcalloc((size_t)L.n, sizeof *e);
    real **neg = xcalloc((size_t)L.n, sizeof *neg);
    for (int i = 0; i < L.n; i++) {
        hf_tensor *t = &L.t[i];
        e[i].name = t->name;
        e[i].ndim = t->ndim;
        memcpy(e[i].shape, t->shape, sizeof t->shape);
        e[i].src_dtype = REAL_DT;
        e[i].src = t->dst;
        if (t->kind == HF_NEG_BETA) {
            size_t n = numel_(t);
            neg[i] = xmalloc(sizeof(real) * n);
            for (size_t j = 0; j < n; j++) neg[i][j] = -t->dst[j];
            e[i].src = neg[i];
        }
    }
    long bos = -1, eos = -1, pad = -1;
    mtrl_hf_config src;
    if (src_dir && mtrl_hf_config_read(&src, src_dir, NULL) == MTRL_OK) {
        bos = src.bos_id;
        eos = src.eos_id;
        pad = src.pad_id;
    }
    char path[8400];
    snprintf(path, sizeof path, "%s/config.json", tmp);
    mtrl_status st = mtrl_hf_config_write(path, cfg, m->dims.V, bos, eos, pad, err);
    const char *meta[] = {"format", "pt", "written_by", "mtrl export"};
    if (st == MTRL_OK) st = mtrl_st_write(tmp, e, L.n, disk_dtype, max_shard, meta, 2, bytes_out, err);
    for (int i = 0; src_dir && st == MTRL_OK && side_files_[i]; i++) {
        char from[8400];
        snprintf(from, sizeof from, "%s/%s", src_dir, side_files_[i]);
        if (access(from, F_OK) != 0) continue;
        snprintf(path, sizeof path, "%s/%s", tmp, side_files_[i]);
        if (copy_file_(from, path) != 0) st = mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot copy to %s: %s", from, path, strerror(errno));
    }
    if (st == MTRL_OK && rename(tmp, out) != 0)
        st = mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot rename to %s: %s", tmp, out, strerror(errno));
    if (st != MTRL_OK) remove_dir_(tmp);
    for (int i = 0; i < L.n; i++) free(neg[i]);
    free(neg);
    free(e);
    free(L.t);
    return st;
}
