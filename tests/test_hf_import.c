// mtrl-test: cpu
// A Hugging Face KimiLinearForCausalLM into the backbone and back out (docs/hf-import.md), on
// tests/fixtures/kimi_linear_tiny/ (transformers' save_pretrained of a tiny random model, with
// transformers' fp32 logits; no Python here):
//  - [model] from = the fixture gives the model its config; mtrl_model_load_hf fills it; the
//    logits of three token sequences match transformers' within LOGIT_TOL (fp32 both sides);
//  - export (f32 and bf16) -> the folder's tensors equal the fixture's, bit for bit, and a
//    re-import gives the same parameter block and QB beta;
//  - a missing tensor, a tensor with no place, a shape mismatch, a wrong dtype and a truncated
//    shard are refused naming the file and tensor, and the model is left exactly as it was;
//  - `mtrl import DIR --out FILE` and `mtrl export EXP FILE --out DIR` do the same from the CLI.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/chat.h"
#include "common/config.h"
#include "env/env_config.h"
#include "learner/train.h"
#include "model/model.h"
#include "model/model_hf.h"
#include "common/safetensors.h"
#include "common/tokenizer.h"
#include "tests/testhelp.h"
#include "tests/testmodel.h"

// fp32 on both sides; what is left is summation order (GEMMs, the chunked KDA against
// transformers' 64-token chunks, the MLA softmax).
#define LOGIT_TOL 1e-4

static char fixture_[4096], tmp_[4096];

static mtrl_config cfg_(void) {
    char text[8192];
    snprintf(text, sizeof text, "[env]\nname = calc\n[model]\nfrom = %s\n", fixture_);
    mtrl_config cfg;
    mtrl_config_errors errs = {0};
    if (mtrl_config_load_text(&cfg, "t.ini", text, NULL, 0, &errs) != MTRL_OK) {
        mtrl_config_errors_print(&errs, stderr);
        exit(1);
    }
    mtrl_config_errors_free(&errs);
    return cfg;
}

static void model_(mtrl_model *m, const mtrl_config *cfg) {
    mtrl_model_dims d;
    mtrl_error err;
    if (mtrl_model_dims_from_config(&d, cfg, MTRL_VOCAB, &err) != MTRL_OK) {
        fprintf(stderr, "%s\n", err.msg);
        exit(1);
    }
    mtrl_model_init(m, &d, 99);
}

// The largest |mtrl − transformers| of each fixture sequence in worst[3]; checked against tol
// when tol > 0.
static void fixture_logits_(mtrl_model *m, double tol, double worst_of[3]) {
    mtrl_st ex;
    mtrl_error err;
    char path[4200];
    snprintf(path, sizeof path, "%s/expected_logits.safetensors", fixture_);
    TEST_CHECKF(mtrl_st_open(&ex, path, &err) == MTRL_OK, "%s", err.msg);
    static const char *const names[3] = {"short", "chunk", "long"};
    int V = m->dims.V;
    for (int s = 0; s < 3; s++) {
        char n1[64], n2[64];
        snprintf(n1, sizeof n1, "%s.ids", names[s]);
        snprintf(n2, sizeof n2, "%s.logits", names[s]);
        int i = mtrl_st_find(&ex, n1);
        TEST_CHECK(i >= 0);
        if (i < 0) continue;
        int T = (int)ex.t[i].shape[0];
        const int32_t *raw = (const int32_t *)ex.t[i].data; // I32, read as it is
        uint32_t *ids = malloc(sizeof(uint32_t) * (size_t)T);
        for (int t = 0; t < T; t++) memcpy(&ids[t], &raw[t], 4);
        float *want = malloc(sizeof(float) * (size_t)T * (size_t)V);
        TEST_CHECK(mtrl_st_read_name(&ex, n2, MTRL_DT_F32, 2, (int64_t[]){T, V}, want, &err) == MTRL_OK);
        real *got = malloc(sizeof(real) * (size_t)T * (size_t)V);
        mtrl_model_logits(m, ids, T, 0, got);
        double worst = 0;
        for (size_t j = 0; j < (size_t)T * (size_t)V; j++) {
            double d = fabs((double)got[j] - (double)want[j]);
            if (d > worst) worst = d;
        }
        worst_of[s] = worst;
        if (tol > 0) {
            printf("logits %-5s (%2d tokens): max |mtrl - transformers| = %.3g (tolerance %.0e)\n", names[s], T, worst, tol);
            TEST_CHECKF(worst <= tol, "%s: %.3g", names[s], worst);
        }
        free(got);
        free(want);
        free(ids);
    }
    mtrl_st_close(&ex);
}

static void test_logits_(mtrl_model *m) {
    double w[3];
    fixture_logits_(m, LOGIT_TOL, w);
}

// A GPU clamps Kimi's gate at g_min (kernels_cuda.h MTRL_KDA_TC_G_MIN, docs/model-forms.md); the
// CPU is exact. Here the CPU model's gate is clamped as a GPU's (testmodel.h) at the floor an
// import sets ([model] g_min of the mapped config) and at -11: the clamp's own effect on the
// fixture's logits against transformers, measured without a GPU (make_kimi_fixture.py draws
// e^{A_log} up to e^2 and dt_bias ~ N(-2, 1), so some decays pass both floors).
static void test_clamp_effect_(mtrl_model *m) {
    const real floors[2] = {m->dims.g_min, -11}, g_min = m->dims.g_min;
    test_model_clamp_kimi_gate(1);
    for (int i = 0; i < 2; i++) {
        m->dims.g_min = floors[i];
        double w[3];
        fixture_logits_(m, 0, w);
        printf("gate clamped at %.3g (a GPU's form): max |logit - transformers| %.3g / %.3g / %.3g (4 / 19 / 40 "
               "tokens)\n", (double)floors[i], w[0], w[1], w[2]);
        // at the floor an import sets, the GPU's approximation costs the fixture nothing measurable
        if (i == 0) TEST_CHECKF(fmax(w[0], fmax(w[1], w[2])) <= LOGIT_TOL, "clamp at %.3g: %.3g", (double)floors[i], w[2]);
    }
    m->dims.g_min = g_min;
    test_model_clamp_kimi_gate(0);
}

// Every tensor of a and b (two checkpoints) equal, value for value, as f32.
static void same_tensors_(const char *a, const char *b) {
    mtrl_st x, y;
    mtrl_error err;
    TEST_CHECKF(mtrl_st_open(&x, a, &err) == MTRL_OK, "%s", err.msg);
    TEST_CHECKF(mtrl_st_open(&y, b, &err) == MTRL_OK, "%s", err.msg);
    TEST_EQ_INT(x.n, y.n);
    int same = 1;
    for (int i = 0; i < x.n && same; i++) {
        // A dense layer's FFN is mlp.* on the hub and in mtrl's exports, block_sparse_moe.* in
        // what transformers 5 saves; either loads.
        int j = mtrl_st_find(&y, x.t[i].name);
        char alt[256];
        const char *at = strstr(x.t[i].name, ".block_sparse_moe.");
        if (j < 0 && at && !strstr(at, "experts") && !strstr(at, ".gate.")) {
            snprintf(alt, sizeof alt, "%.*s.mlp.%s", (int)(at - x.t[i].name), x.t[i].name, at + strlen(".block_sparse_moe."));
            j = mtrl_st_find(&y, alt);
        }
        TEST_CHECKF(j >= 0, "%s is not in %s", x.t[i].name, b);
        if (j < 0) { same = 0; break; }
        size_t n = 1;
        for (int d = 0; d < x.t[i].ndim; d++) n *= (size_t)x.t[i].shape[d];
        float *p = malloc(4 * n), *q = malloc(4 * n);
        same = mtrl_st_read(&x, i, MTRL_DT_F32, x.t[i].ndim, x.t[i].shape, p, &err) == MTRL_OK &&
               mtrl_st_read(&y, j, MTRL_DT_F32, x.t[i].ndim, x.t[i].shape, q, &err) == MTRL_OK && !memcmp(p, q, 4 * n);
        TEST_CHECKF(same, "tensor %s differs between %s and %s", x.t[i].name, a, b);
        free(p);
        free(q);
    }
    mtrl_st_close(&x);
    mtrl_st_close(&y);
}

static void test_export_(mtrl_model *m, const mtrl_config *cfg) {
    char out[4200];
    mtrl_error err;
    const char *kinds[2] = {"f32", "bf16"};
    for (int k = 0; k < 2; k++) {
        snprintf(out, sizeof out, "%s/export-%s", tmp_, kinds[k]);
        uint64_t bytes = 0;
        TEST_CHECKF(mtrl_model_save_hf(m, &cfg->model, fixture_, out, k ? MTRL_DT_BF16 : MTRL_DT_F32, 200000, &bytes, &err) == MTRL_OK,
                    "%s", err.msg);
        TEST_CHECK(bytes > 0);
        same_tensors_(fixture_, out);
        char p[4400];
        snprintf(p, sizeof p, "%s/model.safetensors.index.json", out);
        TEST_CHECK(access(p, F_OK) == 0); // sharded at 200 kB
        snprintf(p, sizeof p, "%s/tiktoken.model", out);
        TEST_CHECK(access(p, F_OK) == 0);
        snprintf(p, sizeof p, "%s.tmp-%ld", out, (long)getpid());
        TEST_CHECK(access(p, F_OK) != 0); // renamed
        // Re-import: the same parameters and beta.
        mtrl_config c2 = cfg_();
        TEST_CHECK(strlen(out) < sizeof c2.model.from);
        memcpy(c2.model.from, out, strlen(out) + 1);
        mtrl_model m2;
        model_(&m2, &c2);
        TEST_CHECKF(mtrl_model_load_hf(&m2, out, NULL, &err) == MTRL_OK, "%s", err.msg);
        TEST_CHECK(m2.params.total == m->params.total && !memcmp(m2.params.base, m->params.base, m->params.total));
        TEST_CHECK(!memcmp(m2.qb_beta, m->qb_beta, sizeof(real) * (size_t)m->dims.L * (size_t)m->dims.E));
        mtrl_model_free(&m2);
    }
    // An existing folder is never written into.
    TEST_CHECK(mtrl_model_save_hf(m, &cfg->model, fixture_, out, MTRL_DT_F32, 1 << 20, NULL, &err) == MTRL_ERR_USAGE);
}

// A one-file checkpoint with the fixture's tensors, less `drop`, plus `extra`, and `reshape`
// given shape [1][n] (same bytes, another shape).
static void variant_(const char *dir, const char *drop, const char *extra, const char *reshape) {
    mkdir(dir, 0755);
    mtrl_st s;
    mtrl_error err;
    if (mtrl_st_open(&s, fixture_, &err) != MTRL_OK) exit(1);
    mtrl_st_entry *e = calloc((size_t)s.n + 1, sizeof *e);
    float **bufs = calloc((size_t)s.n + 1, sizeof *bufs);
    int n = 0;
    for (int i = 0; i < s.n; i++) {
        if (drop && !strcmp(s.t[i].name, drop)) continue;
        size_t numel = 1;
        for (int d = 0; d < s.t[i].ndim; d++) numel *= (size_t)s.t[i].shape[d];
        bufs[n] = malloc(4 * numel);
        mtrl_st_read(&s, i, MTRL_DT_F32, s.t[i].ndim, s.t[i].shape, bufs[n], &err);
        e[n] = (mtrl_st_entry){s.t[i].name, s.t[i].ndim, {0}, MTRL_DT_F32, bufs[n]};
        memcpy(e[n].shape, s.t[i].shape, sizeof(int64_t) * (size_t)s.t[i].ndim);
        if (reshape && !strcmp(s.t[i].name, reshape)) e[n] = (mtrl_st_entry){s.t[i].name, 2, {1, (int64_t)numel}, MTRL_DT_F32, bufs[n]};
        n++;
    }
    if (extra) {
        bufs[n] = calloc(4, 4);
        e[n++] = (mtrl_st_entry){extra, 1, {4}, MTRL_DT_F32, bufs[n - 1]};
    }
    if (mtrl_st_write(dir, e, n, MTRL_DT_F32, (size_t)1 << 30, NULL, 0, NULL, &err) != MTRL_OK) exit(1);
    for (int i = 0; i < n; i++) free(bufs[i]);
    free(bufs);
    free(e);
    mtrl_st_close(&s);
    char src[8192], dst[8192];
    snprintf(src, sizeof src, "%s/config.json", fixture_);
    snprintf(dst, sizeof dst, "%s/config.json", dir);
    FILE *a = fopen(src, "rb"), *b = fopen(dst, "wb");
    char buf[4096];
    size_t k;
    while ((k = fread(buf, 1, sizeof buf, a)) > 0) fwrite(buf, 1, k, b);
    fclose(a);
    fclose(b);
}

static void expect_refused_(mtrl_model *m, const char *dir, mtrl_status code, const char *a, const char *b) {
    void *before = malloc(m->params.total);
    memcpy(before, m->params.base, m->params.total);
    size_t nb = sizeof(real) * (size_t)m->dims.L * (size_t)m->dims.E;
    real *beta = malloc(nb);
    memcpy(beta, m->qb_beta, nb);
    mtrl_error err = {0};
    mtrl_status st = mtrl_model_load_hf(m, dir, NULL, &err);
    TEST_CHECKF(st == code, "%s: got %d (%s), want %d", dir, st, err.msg, code);
    TEST_CHECKF((!a || strstr(err.msg, a)) && (!b || strstr(err.msg, b)), "message '%s' should name '%s' and '%s'", err.msg,
                a ? a : "", b ? b : "");
    TEST_CHECKF(!memcmp(before, m->params.base, m->params.total) && !memcmp(beta, m->qb_beta, nb),
                "%s: the model changed on a refused load", dir);
    free(before);
    free(beta);
}

static void test_refused_(mtrl_model *m) {
    char dir[4300];
    snprintf(dir, sizeof dir, "%s/missing", tmp_);
    variant_(dir, "model.layers.2.self_attn.kv_b_proj.weight", NULL, NULL);
    expect_refused_(m, dir, MTRL_ERR_NOTFOUND, "model.layers.2.self_attn.kv_b_proj.weight", "missing");
    snprintf(dir, sizeof dir, "%s/unplaced", tmp_);
    variant_(dir, NULL, "model.layers.1.self_attn.q_a_proj.weight", NULL);
    expect_refused_(m, dir, MTRL_ERR_FORMAT, "model.layers.1.self_attn.q_a_proj.weight", "model.safetensors");
    snprintf(dir, sizeof dir, "%s/shape", tmp_);
    variant_(dir, NULL, NULL, "model.layers.3.block_sparse_moe.experts.7.w2.weight");
    expect_refused_(m, dir, MTRL_ERR_MISMATCH, "model.layers.3.block_sparse_moe.experts.7.w2.weight", "[1, 512]");
    // A wrong dtype: A_log's F32 in the shard header patched to I32 (same length).
    snprintf(dir, sizeof dir, "%s/dtype", tmp_);
    variant_(dir, NULL, NULL, NULL);
    char p[4400];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    FILE *f = fopen(p, "r+b");
    char hdr[65536];
    size_t n = fread(hdr, 1, sizeof hdr - 1, f);
    hdr[n] = 0;
    char *at = strstr(hdr + 8, "\"model.layers.0.self_attn.A_log\":{\"dtype\":\"F32\"");
    TEST_CHECK(at != NULL);
    if (at) {
        fseek(f, (long)(at - hdr) + (long)strlen("\"model.layers.0.self_attn.A_log\":{\"dtype\":\""), SEEK_SET);
        fputc('I', f);
    }
    fclose(f);
    expect_refused_(m, dir, MTRL_ERR_FORMAT, "model.layers.0.self_attn.A_log", "I32");
    // A truncated shard.
    struct stat sb;
    stat(p, &sb);
    TEST_CHECK(truncate(p, sb.st_size - 64) == 0);
    expect_refused_(m, dir, MTRL_ERR_FORMAT, "model.safetensors", "truncated");
}

static int run_(const char *cmd) {
    int rc = system(cmd);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

static void test_cli_(void) {
    const char *bin = getenv("MTRL_BIN");
    if (!bin) return;
    char cmd[16384], ckpt[4300], exp[4300], out[4300];
    snprintf(ckpt, sizeof ckpt, "%s/imported.safetensors", tmp_);
    snprintf(cmd, sizeof cmd, "'%s' import '%s' --out '%s' --logits '%s/imp-logits.safetensors'", bin, fixture_, ckpt, tmp_);
    TEST_EQ_INT(run_(cmd), 0);
    snprintf(exp, sizeof exp, "%s/exp.ini", tmp_);
    FILE *f = fopen(exp, "w");
    fprintf(f, "[model]\nfrom = %s\n[env]\nname = calc\n", fixture_);
    fclose(f);
    snprintf(out, sizeof out, "%s/cli-export", tmp_);
    snprintf(cmd, sizeof cmd, "'%s' export '%s' '%s' --out '%s' --shard-mb 1", bin, exp, ckpt, out);
    TEST_EQ_INT(run_(cmd), 0);
    same_tensors_(fixture_, out);
    // The logits mtrl wrote on import are the ones the model computes: the file reads back.
    char lp[4400];
    snprintf(lp, sizeof lp, "%s/imp-logits.safetensors", tmp_);
    mtrl_st s;
    mtrl_error err;
    TEST_CHECK(mtrl_st_open(&s, lp, &err) == MTRL_OK && mtrl_st_find(&s, "long.logits") >= 0);
    mtrl_st_close(&s);
    // A bad folder: exit 1 with the tensor named.
    snprintf(cmd, sizeof cmd, "'%s' import '%s/missing' --out '%s/x.safetensors' 2>&1 | grep -q kv_b_proj", bin, tmp_, tmp_);
    TEST_EQ_INT(run_(cmd), 0);
}

// A run of the imported model (experiments/import-kimi-linear.ini, a few steps) replayed: the
// episode's ids read as the run's BPE tokenizer says (Kimi's chat framing in the prompt), not
// as bytes.
static void test_replay_bpe_(void) {
    const char *bin = getenv("MTRL_BIN"), *src = getenv("MTRL_SRC");
    if (!bin || !src) return;
    char cmd[16384], db[4300], log[4300];
    snprintf(db, sizeof db, "%s/kimi-runs.db", tmp_);
    snprintf(log, sizeof log, "%s/kimi-replay.txt", tmp_);
    snprintf(cmd, sizeof cmd,
             "'%s' run '%s/experiments/import-kimi-linear.ini' --set run.steps=1 --set run.db='%s' --set run.out_dir='%s/kimi-out'"
             " > '%s/kimi-run.log' 2>&1",
             bin, src, db, tmp_, tmp_);
    TEST_EQ_INT(run_(cmd), 0);
    snprintf(cmd, sizeof cmd,
             "'%s' replay --db '%s' --episode $(sqlite3 '%s' 'select id from episodes limit 1') > '%s' 2>&1", bin, db,
             db, log);
    TEST_EQ_INT(run_(cmd), 0);
    FILE *f = fopen(log, "r");
    TEST_CHECK(f != NULL);
    if (!f) return;
    char text[65536];
    size_t n = fread(text, 1, sizeof text - 1, f);
    text[n] = 0;
    fclose(f);
    TEST_CONTAINS(text, "<|im_user|>user<|im_middle|>");
    TEST_CHECK(strstr(text, "showing the ids as bytes") == NULL);
}

// The warm-up's demos in the imported model's own chat template: a calc demo as Kimi's tokens
// starts with the prompt the actors render, its call reads back (mtrl_chat_call) as the env
// action the demo made, the answer ends with the template's end token, the demo earns its reward;
// and a short run with a warm-up of the imported model works end to end.
static void test_demo_chat_(const mtrl_config *cfg) {
    mtrl_chat chat;
    mtrl_error err;
    TEST_CHECKF(mtrl_chat_init(&chat, &cfg->model, 762, &err) == MTRL_OK, "%s", err.msg);
    TEST_EQ_INT(chat.kind, MTRL_CHAT_KIMI);
    mtrl_env *env;
    TEST_CHECKF(mtrl_env_open_config(cfg, &env, &err) == MTRL_OK, "%s", err.msg);
    mtrl_traj t;
    mtrl_traj_init(&t);
    TEST_CHECKF(mtrl_train_demo_episode_chat(env, 5, 512, 0, &chat, &t, &err) == MTRL_OK, "%s", err.msg);
    TEST_NEAR(t.reward, 1, 1e-9);
    mtrl_env_result res;
    TEST_EQ_INT(mtrl_env_reset(env, 5, &res, &err), MTRL_OK);
    uint32_t want[512];
    long np = mtrl_chat_prompt(&chat, res.obs, res.obs_len, want, 512);
    TEST_CHECK(np > 0 && (uint64_t)np < t.n_tokens);
    TEST_CHECK(!memcmp(t.ids, want, sizeof(uint32_t) * (size_t)np));
    size_t open = 0, close = 0;
    for (size_t i = 0; i < t.n_tokens && !close; i++) {
        if (t.ids[i] == chat.call_open) open = i;
        if (t.ids[i] == chat.call_close) close = i;
    }
    TEST_CHECK(open > 0 && close > open && t.ids[open - 1] == chat.section_begin);
    char action[256], call_id[128];
    mtrl_chat_call(&chat, t.ids + open + 1, close - open - 1, action, sizeof action, call_id, sizeof call_id);
    TEST_CHECKF(!strncmp(action, "calc(", 5) && !strncmp(call_id, "functions.calc:", 15), "the call read back as %s (%s)",
                action, call_id);
    TEST_EQ_INT(t.ids[t.n_tokens - 1], chat.end);
    TEST_EQ_INT(t.kind[t.n_tokens - 1], MTRL_TOK_MODEL);
    mtrl_traj_free(&t);
    mtrl_env_close(env);
    mtrl_chat_free(&chat);
    const char *bin = getenv("MTRL_BIN"), *src = getenv("MTRL_SRC");
    if (!bin || !src) return;
    char cmd[16384];
    snprintf(cmd, sizeof cmd,
             "'%s' run '%s/experiments/import-kimi-linear.ini' --set run.steps=1 --set warmup.steps=2 --set run.db='%s/w.db' "
             "--set run.out_dir='%s/w-out' > '%s/w-run.log' 2>&1",
             bin, src, tmp_, tmp_, tmp_);
    TEST_EQ_INT(run_(cmd), 0);
}

int main(void) {
    const char *src = getenv("MTRL_SRC");
    snprintf(fixture_, sizeof fixture_, "%s/tests/fixtures/kimi_linear_tiny", src ? src : "..");
    snprintf(tmp_, sizeof tmp_, "/tmp/mtrl_test_hf_XXXXXX");
    if (!mkdtemp(tmp_)) return 1;
    mtrl_config cfg = cfg_();
    mtrl_model m;
    model_(&m, &cfg);
    mtrl_hf_load_stats ls;
    mtrl_error err;
    TEST_CHECKF(mtrl_model_load_hf(&m, fixture_, &ls, &err) == MTRL_OK, "%s", err.msg);
    printf("loaded the fixture: %d tensors, %llu bytes from %d files in %.4f s (%.2f GB/s)\n", ls.tensors,
           (unsigned long long)ls.bytes, ls.files, ls.seconds, ls.seconds > 0 ? ls.bytes / ls.seconds / 1e9 : 0.0);
    TEST_EQ_INT(ls.files, 2);
    // beta = -e_score_correction_bias, set for the MoE layers only.
    TEST_CHECK(m.qb_beta[0] == 0 && m.qb_beta[(size_t)m.dims.E] != 0);
    test_logits_(&m);
    test_clamp_effect_(&m);
    test_export_(&m, &cfg);
    test_refused_(&m);
    test_cli_();
    test_replay_bpe_();
    test_demo_chat_(&cfg);
    mtrl_model_free(&m);
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp_);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmp_);
    return test_report();
}
