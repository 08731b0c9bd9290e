// mtrl-test: cpu
// Hugging Face I/O below the model (docs/hf-import.md), on tests/fixtures/kimi_linear_tiny/
// (made by tools/make_kimi_fixture.py with transformers and tiktoken; no Python here):
//  - the mapped reader opens the sharded fixture through its index and converts bf16 and f32;
//    the sharded writer round-trips f32 exactly and bf16 rounded to nearest even;
//  - bad files are refused naming the file and the tensor: a truncated shard, a header length
//    out of range, a wrong dtype, a shape mismatch (both shapes), a tensor the index names but
//    its shard lacks, a shard tensor the index does not name;
//  - config.json maps onto [model] keys ([model] from), a conflicting INI key is refused naming
//    both, and each unsupported config field (q_lora_rank, n_group, tie_word_embeddings,
//    attention_bias, model_type, an unknown field) is refused by name;
//  - the fixture's tiktoken tokenizer, opened through the tokenizer interface ([model] tokenizer
//    = auto), gives exactly the tiktoken library's ids for a varied corpus and decodes back;
//  - the kimi chat template frames prompts and tool results with Kimi's tokens and turns a call
//    functions.NAME:IDX<|tool_call_argument_begin|>ARGS into the env action NAME(ARGS); a
//    malformed call reaches the env as written.
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/chat.h"
#include "common/bf16.h"
#include "common/bpe.h"
#include "common/config.h"
#include "common/hf_config.h"
#include "common/safetensors.h"
#include "common/tokenizer.h"
#include "tests/testhelp.h"

static char fixture_[4096], tmp_[4096];

static void write_file_(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) { perror(path); exit(1); }
    fwrite(data, 1, n, f);
    fclose(f);
}

static char *read_file_(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); exit(1); }
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)len + 1);
    if (fread(b, 1, (size_t)len, f) != (size_t)len) exit(1);
    b[len] = 0;
    fclose(f);
    if (n) *n = (size_t)len;
    return b;
}

// A folder under the test's temp folder holding a copy of the fixture's files.
static void copy_fixture_(const char *dir) {
    mkdir(dir, 0755);
    const char *files[] = {"config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                           "model.safetensors.index.json", "tiktoken.model", "tokenizer_config.json", NULL};
    for (int i = 0; files[i]; i++) {
        char a[8192], b[8192];
        snprintf(a, sizeof a, "%s/%s", fixture_, files[i]);
        snprintf(b, sizeof b, "%s/%s", dir, files[i]);
        size_t n;
        char *d = read_file_(a, &n);
        write_file_(b, d, n);
        free(d);
    }
}

// A one-tensor safetensors file with a hand-written header.
static void write_raw_st_(const char *path, const char *header, const void *data, size_t n) {
    size_t hl = strlen(header);
    unsigned char len8[8];
    for (int k = 0; k < 8; k++) len8[k] = (unsigned char)((uint64_t)hl >> (8 * k));
    FILE *f = fopen(path, "wb");
    fwrite(len8, 1, 8, f);
    fwrite(header, 1, hl, f);
    fwrite(data, 1, n, f);
    fclose(f);
}

static void test_reader_(void) {
    mtrl_st s;
    mtrl_error err;
    TEST_CHECKF(mtrl_st_open(&s, fixture_, &err) == MTRL_OK, "%s", err.msg);
    TEST_EQ_INT(s.n_files, 2);
    TEST_CHECK(s.n > 100);
    int i = mtrl_st_find(&s, "model.layers.0.self_attn.A_log");
    TEST_CHECK(i >= 0 && s.t[i].dtype == MTRL_ST_F32 && s.t[i].ndim == 4);
    int j = mtrl_st_find(&s, "model.embed_tokens.weight");
    TEST_CHECK(j >= 0 && s.t[j].dtype == MTRL_ST_BF16);
    float a[2];
    TEST_CHECKF(mtrl_st_read(&s, i, MTRL_DT_F32, 4, (int64_t[]){1, 1, 2, 1}, a, &err) == MTRL_OK, "%s", err.msg);
    TEST_CHECK(a[0] >= 0 && a[0] <= 2 && a[1] >= 0 && a[1] <= 2); // the fixture's A_log in [0, 2)
    // bf16 widens exactly: every value read has a zero low half.
    int64_t es[2] = {s.t[j].shape[0], s.t[j].shape[1]};
    float *emb = malloc(sizeof(float) * (size_t)(es[0] * es[1]));
    TEST_CHECK(mtrl_st_read(&s, j, MTRL_DT_F32, 2, es, emb, &err) == MTRL_OK);
    int exact = 1;
    for (int64_t k = 0; k < es[0] * es[1]; k++) exact &= mtrl_bf16_to_f32(mtrl_bf16_from_f32(emb[k])) == emb[k];
    TEST_CHECK(exact);
    TEST_CHECK(s.bytes_read == s.t[i].nbytes + s.t[j].nbytes);
    // A shape mismatch names the file, the tensor and both shapes.
    TEST_CHECK(mtrl_st_read(&s, j, MTRL_DT_F32, 2, (int64_t[]){es[0], es[1] + 1}, emb, &err) == MTRL_ERR_MISMATCH);
    TEST_CHECKF(strstr(err.msg, "model.embed_tokens.weight") && strstr(err.msg, "[762, 32]") && strstr(err.msg, "[762, 33]") &&
                    strstr(err.msg, ".safetensors"), "%s", err.msg);
    TEST_CHECK(mtrl_st_read_name(&s, "no.such.tensor", MTRL_DT_F32, 1, (int64_t[]){1}, a, &err) == MTRL_ERR_NOTFOUND);
    TEST_CHECK(strstr(err.msg, "no.such.tensor") != NULL);
    TEST_CHECK(mtrl_st_unread(&s, 0) >= 0);
    free(emb);
    mtrl_st_close(&s);
}

static void test_writer_(void) {
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/w", tmp_);
    mkdir(dir, 0755);
    float x[6] = {1.0f, -2.5f, 3.14159265f, 1e-8f, 65504.0f, -0.0f};
    double y[4] = {0.1, 0.2, 0.3, 0.4};
    mtrl_st_entry e[3] = {{"a", 2, {2, 3}, MTRL_DT_F32, x}, {"b", 1, {4}, MTRL_DT_F64, y}, {"c.d", 1, {6}, MTRL_DT_F32, x}};
    mtrl_error err;
    uint64_t bytes = 0;
    // 30-byte shards: every tensor its own shard, with the index.
    TEST_CHECKF(mtrl_st_write(dir, e, 3, MTRL_DT_F32, 30, NULL, 0, &bytes, &err) == MTRL_OK, "%s", err.msg);
    TEST_EQ_INT(bytes, 4 * 16);
    mtrl_st s;
    TEST_CHECKF(mtrl_st_open(&s, dir, &err) == MTRL_OK, "%s", err.msg);
    TEST_EQ_INT(s.n_files, 3);
    float got[6];
    double gy[4];
    TEST_CHECK(mtrl_st_read_name(&s, "a", MTRL_DT_F32, 2, (int64_t[]){2, 3}, got, &err) == MTRL_OK && !memcmp(got, x, sizeof x));
    TEST_CHECK(mtrl_st_read_name(&s, "b", MTRL_DT_F64, 1, (int64_t[]){4}, gy, &err) == MTRL_OK);
    for (int i = 0; i < 4; i++) TEST_CHECK(gy[i] == (double)(float)y[i]);
    mtrl_st_close(&s);
    // bf16: one file, values rounded to nearest even.
    char dir2[4200];
    snprintf(dir2, sizeof dir2, "%s/w2", tmp_);
    mkdir(dir2, 0755);
    const char *meta[] = {"format", "pt"};
    TEST_CHECK(mtrl_st_write(dir2, e, 1, MTRL_DT_BF16, 1 << 20, meta, 1, NULL, &err) == MTRL_OK);
    char single[4300];
    snprintf(single, sizeof single, "%s/model.safetensors", dir2);
    TEST_CHECK(access(single, F_OK) == 0);
    TEST_CHECK(mtrl_st_open(&s, dir2, &err) == MTRL_OK && s.n_files == 1);
    TEST_CHECK(mtrl_st_read_name(&s, "a", MTRL_DT_F32, 2, (int64_t[]){2, 3}, got, &err) == MTRL_OK);
    for (int i = 0; i < 6; i++) TEST_CHECK(got[i] == mtrl_bf16_to_f32(mtrl_bf16_from_f32(x[i])));
    mtrl_st_close(&s);
}

static void expect_open_fail_(const char *path, mtrl_status code, const char *a, const char *b) {
    mtrl_st s;
    mtrl_error err = {0};
    mtrl_status st = mtrl_st_open(&s, path, &err);
    TEST_CHECKF(st == code, "open %s: got %d (%s), want %d", path, st, err.msg, code);
    TEST_CHECKF((!a || strstr(err.msg, a)) && (!b || strstr(err.msg, b)), "message '%s' should name '%s' and '%s'", err.msg,
                a ? a : "", b ? b : "");
    TEST_CHECK(s.n == 0 && s.n_files == 0); // nothing left open
}

static void test_bad_files_(void) {
    char dir[4200], p[4400];
    // A truncated shard: the tensor running past the end is named.
    snprintf(dir, sizeof dir, "%s/trunc", tmp_);
    copy_fixture_(dir);
    snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", dir);
    struct stat sb;
    stat(p, &sb);
    TEST_CHECK(truncate(p, sb.st_size - 100) == 0);
    expect_open_fail_(dir, MTRL_ERR_FORMAT, "model-00002-of-00002.safetensors", "truncated");
    TEST_CHECK(truncate(p, 5) == 0);
    expect_open_fail_(dir, MTRL_ERR_FORMAT, "model-00002-of-00002.safetensors", "truncated");
    // A header length past the end of the file.
    unsigned char junk[16] = {0xff, 0xff, 0, 0, 0, 0, 0, 0, '{', '}'};
    snprintf(p, sizeof p, "%s/hdr.safetensors", tmp_);
    write_file_(p, junk, sizeof junk);
    expect_open_fail_(p, MTRL_ERR_FORMAT, "hdr.safetensors", "header length");
    // A tensor of a dtype mtrl does not read: opens, but reading it names file and tensor.
    int32_t iv[2] = {1, 2};
    snprintf(p, sizeof p, "%s/i32.safetensors", tmp_);
    write_raw_st_(p, "{\"w\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[0,8]}}", iv, 8);
    mtrl_st s;
    mtrl_error err;
    TEST_CHECK(mtrl_st_open(&s, p, &err) == MTRL_OK);
    float f[2];
    TEST_CHECK(mtrl_st_read_name(&s, "w", MTRL_DT_F32, 1, (int64_t[]){2}, f, &err) == MTRL_ERR_FORMAT);
    TEST_CHECKF(strstr(err.msg, "i32.safetensors") && strstr(err.msg, "tensor w") && strstr(err.msg, "I32"), "%s", err.msg);
    mtrl_st_close(&s);
    // F16 converts exactly: 1, -2, 0.5, the smallest subnormal 2^-24, 65504, -inf.
    uint16_t hv[6] = {0x3c00, 0xc000, 0x3800, 0x0001, 0x7bff, 0xfc00};
    char p16[4400];
    snprintf(p16, sizeof p16, "%s/f16.safetensors", tmp_);
    write_raw_st_(p16, "{\"h\":{\"dtype\":\"F16\",\"shape\":[6],\"data_offsets\":[0,12]}}", hv, 12);
    double hd[6];
    TEST_CHECK(mtrl_st_open(&s, p16, &err) == MTRL_OK);
    TEST_CHECK(mtrl_st_read_name(&s, "h", MTRL_DT_F64, 1, (int64_t[]){6}, hd, &err) == MTRL_OK);
    TEST_CHECK(hd[0] == 1.0 && hd[1] == -2.0 && hd[2] == 0.5 && hd[3] == ldexp(1.0, -24) && hd[4] == 65504.0 &&
               isinf(hd[5]) && hd[5] < 0);
    mtrl_st_close(&s);
    // Byte counts that do not match the shape.
    write_raw_st_(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", iv, 8);
    expect_open_fail_(p, MTRL_ERR_FORMAT, "i32.safetensors", "tensor w");
    // The index names a tensor its shard lacks, and a shard holds one the index does not name.
    snprintf(dir, sizeof dir, "%s/idx", tmp_);
    copy_fixture_(dir);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    size_t n;
    char *idx = read_file_(p, &n);
    char *at = strstr(idx, "\"model.norm.weight\"");
    TEST_CHECK(at != NULL);
    memcpy(at + 1, "model.nrom", 10); // the index now names model.nrom.weight
    write_file_(p, idx, n);
    expect_open_fail_(dir, MTRL_ERR_NOTFOUND, "model.nrom.weight", "model-0000");
    memcpy(at + 1, "model.norm", 10);
    char *bias = strstr(idx, "\"model.layers.1.block_sparse_moe.gate.e_score_correction_bias\"");
    TEST_CHECK(bias != NULL);
    memcpy(bias + 1, "xodel", 5);
    write_file_(p, idx, n);
    expect_open_fail_(dir, MTRL_ERR_NOTFOUND, "xodel.layers.1.block_sparse_moe.gate.e_score_correction_bias", NULL);
    free(idx);
    // A folder with no checkpoint.
    snprintf(dir, sizeof dir, "%s/empty", tmp_);
    mkdir(dir, 0755);
    expect_open_fail_(dir, MTRL_ERR_NOTFOUND, "empty", "model.safetensors");
}

static mtrl_status load_cfg_(mtrl_config *cfg, const char *extra, char *msg, size_t cap) {
    char text[8192];
    snprintf(text, sizeof text, "[env]\nname = calc\n[model]\nfrom = %s\n%s", fixture_, extra);
    mtrl_config_errors errs = {0};
    mtrl_status st = mtrl_config_load_text(cfg, "t.ini", text, NULL, 0, &errs);
    msg[0] = 0;
    for (int i = 0; i < errs.n; i++) snprintf(msg + strlen(msg), cap - strlen(msg), "%s\n", errs.msgs[i]);
    mtrl_config_errors_free(&errs);
    return st;
}

// Writes a copy of the fixture's config.json with one field's text replaced.
static void config_variant_(const char *dir, const char *from, const char *to) {
    mkdir(dir, 0755);
    char p[8192];
    snprintf(p, sizeof p, "%s/config.json", fixture_);
    char *c = read_file_(p, NULL);
    char *at = strstr(c, from);
    TEST_CHECKF(at != NULL, "config.json has no %s", from);
    if (!at) { free(c); return; }
    char *out = malloc(strlen(c) + strlen(to) + 1);
    sprintf(out, "%.*s%s%s", (int)(at - c), c, to, at + strlen(from));
    snprintf(p, sizeof p, "%s/config.json", dir);
    write_file_(p, out, strlen(out));
    free(out);
    free(c);
}

static void test_config_(void) {
    mtrl_hf_config h;
    mtrl_error err;
    TEST_CHECKF(mtrl_hf_config_read(&h, fixture_, &err) == MTRL_OK, "%s", err.msg);
    TEST_EQ_STR(mtrl_hf_config_get(&h, "hybrid"), "KKMK");
    TEST_EQ_STR(mtrl_hf_config_get(&h, "experts"), "12");
    TEST_EQ_STR(mtrl_hf_config_get(&h, "vocab"), "762");
    TEST_EQ_STR(mtrl_hf_config_get(&h, "kda_gate"), "kimi");
    TEST_EQ_STR(mtrl_hf_config_get(&h, "dense_layers"), "1");
    TEST_EQ_INT(h.bos_id, 506);
    mtrl_config cfg;
    char msg[4096];
    TEST_CHECKF(load_cfg_(&cfg, "", msg, sizeof msg) == MTRL_OK, "%s", msg);
    TEST_EQ_INT(cfg.model.layers, 4);
    TEST_EQ_INT(cfg.model.d_model, 32);
    TEST_EQ_INT(cfg.model.vocab, 762);
    TEST_EQ_STR(cfg.model.hybrid, "KKMK");
    TEST_EQ_INT(cfg.model.kda_heads, 2);
    TEST_EQ_INT(cfg.model.mla_latent_dim, 16);
    TEST_EQ_INT(cfg.model.mla_gate, 0);
    TEST_EQ_INT(cfg.model.expert_inter, 16);
    TEST_EQ_INT(cfg.model.dense_inter, 48);
    TEST_CHECK(cfg.model.rho == 2.446);
    // An INI key that agrees is fine; one that conflicts names both.
    TEST_CHECKF(load_cfg_(&cfg, "d_model = 32\n", msg, sizeof msg) == MTRL_OK, "%s", msg);
    TEST_CHECK(load_cfg_(&cfg, "d_model = 64\n", msg, sizeof msg) != MTRL_OK);
    TEST_CHECKF(strstr(msg, "d_model") && strstr(msg, "hidden_size") && strstr(msg, "conflicts"), "%s", msg);
    TEST_CHECK(load_cfg_(&cfg, "mla_gate = true\n", msg, sizeof msg) != MTRL_OK);
    // The resolved config loads again to the same config (what actors receive).
    TEST_CHECK(load_cfg_(&cfg, "", msg, sizeof msg) == MTRL_OK);
    char *ini = mtrl_config_to_ini(&cfg);
    mtrl_config again;
    mtrl_config_errors errs = {0};
    TEST_CHECK(mtrl_config_load_text(&again, "resolved", ini, NULL, 0, &errs) == MTRL_OK);
    TEST_CHECK(mtrl_config_hash(&again) == mtrl_config_hash(&cfg));
    mtrl_config_errors_free(&errs);
    free(ini);
    // Unsupported fields, each refused by name.
    static const struct { const char *from, *to, *name; } bad[] = {
        {"\"q_lora_rank\": null", "\"q_lora_rank\": 64", "q_lora_rank"},
        {"\"num_expert_group\": 1", "\"num_expert_group\": 2", "num_expert_group"},
        {"\"tie_word_embeddings\": false", "\"tie_word_embeddings\": true", "tie_word_embeddings"},
        {"\"attention_bias\": false", "\"attention_bias\": true", "attention_bias"},
        {"\"model_type\": \"kimi_linear\"", "\"model_type\": \"llama\"", "model_type"},
        {"\"use_cache\": true", "\"use_cache\": true, \"sliding_window\": 4096", "sliding_window"},
        {"\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"", "hidden_act"},
        {"\"linear_attention\",\n    \"full", "\"mamba\",\n    \"full", "layer_types"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char dir[4300];
        snprintf(dir, sizeof dir, "%s/cfg%zu", tmp_, i);
        config_variant_(dir, bad[i].from, bad[i].to);
        mtrl_error e2 = {0};
        mtrl_status st = mtrl_hf_config_read(&h, dir, &e2);
        TEST_CHECKF(st == MTRL_ERR_USAGE && strstr(e2.msg, bad[i].name) && strstr(e2.msg, "config.json"),
                    "%s: got %d '%s'", bad[i].name, st, e2.msg);
    }
    char dir[4300];
    snprintf(dir, sizeof dir, "%s/cfgjson", tmp_);
    config_variant_(dir, "\"vocab_size\": 762", "\"vocab_size\": 762,,");
    TEST_CHECK(mtrl_hf_config_read(&h, dir, &err) == MTRL_ERR_FORMAT && strstr(err.msg, "config.json:"));
}

// expected_tokens.txt: "tokens NAME MODE HEX" then "ids ...".
static void test_tokenizer_(void) {
    mtrl_config cfg;
    char msg[4096];
    TEST_CHECK(load_cfg_(&cfg, "", msg, sizeof msg) == MTRL_OK);
    mtrl_tokenizer *tok;
    mtrl_error err;
    TEST_CHECKF(mtrl_tokenizer_open(&tok, &cfg.model, 762, &err) == MTRL_OK, "%s", err.msg);
    TEST_CHECK(!mtrl_tokenizer_is_bytes(tok));
    // The vocabulary must fit the model's.
    mtrl_tokenizer *small;
    TEST_CHECK(mtrl_tokenizer_open(&small, &cfg.model, 700, &err) == MTRL_ERR_MISMATCH && strstr(err.msg, "700"));
    // Special mode through the BPE module itself (the interface encodes env text as ordinary).
    char tk[4400], tc[4400];
    snprintf(tk, sizeof tk, "%s/tiktoken.model", fixture_);
    snprintf(tc, sizeof tc, "%s/tokenizer_config.json", fixture_);
    mtrl_bpe_tiktoken_opts o = {.config_path = tc, .n_reserved = MTRL_BPE_KIMI_RESERVED};
    mtrl_bpe *bpe;
    TEST_CHECK(mtrl_bpe_init_tiktoken(&bpe, tk, &o, &err) == MTRL_OK);
    char path[4400];
    snprintf(path, sizeof path, "%s/expected_tokens.txt", fixture_);
    char *all = read_file_(path, NULL);
    int cases = 0, exact = 0;
    char *save = NULL;
    for (char *line = strtok_r(all, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char name[128], mode[32], hex[8192];
        if (sscanf(line, "tokens %127s %31s %8191s", name, mode, hex) != 3) continue;
        char *ids_line = strtok_r(NULL, "\n", &save);
        if (!ids_line || strncmp(ids_line, "ids", 3)) break;
        size_t nb = strcmp(hex, "-") ? strlen(hex) / 2 : 0;
        char *text = malloc(nb + 1);
        for (size_t i = 0; i < nb; i++) sscanf(hex + 2 * i, "%2hhx", (unsigned char *)&text[i]);
        uint32_t want[4096];
        size_t nw = 0;
        for (char *p = ids_line + 3; *p;) {
            char *end;
            long v = strtol(p, &end, 10);
            if (end == p) break;
            want[nw++] = (uint32_t)v;
            p = end;
        }
        uint32_t *got = malloc(sizeof(uint32_t) * (nb + 1));
        size_t ng = 0;
        if (!strcmp(mode, "special")) TEST_CHECK(mtrl_bpe_encode(bpe, text, nb, MTRL_BPE_SPECIAL, got, &ng, &err) == MTRL_OK);
        else ng = mtrl_tokenizer_encode(tok, text, nb, got);
        int same = ng == nw && !memcmp(got, want, sizeof(uint32_t) * nw);
        TEST_CHECKF(same, "case %s: %zu ids, the tiktoken library's %zu", name, ng, nw);
        exact += same;
        char *back = malloc(nb + 64);
        size_t bl = 0;
        TEST_CHECK(mtrl_bpe_decode(bpe, got, ng, 0, back, nb + 64, &bl, &err) == MTRL_OK);
        TEST_CHECKF(bl == nb && !memcmp(back, text, nb), "case %s: decode round trip", name);
        free(back);
        free(got);
        free(text);
        cases++;
    }
    printf("tokenizer: %d of %d cases id for id with the tiktoken library\n", exact, cases);
    TEST_CHECK(cases >= 20);
    free(all);
    mtrl_bpe_free(bpe);
    // One id at a time as replay shows it: the pieces of a text put it back together, a
    // special token gives its name, an id with neither says so; the bytes tokenizer likewise.
    const char *text = "def f(x):\n    return x  # \xe4\xb8\x96\xe7\x95\x8c";
    uint32_t ids[64];
    size_t n = mtrl_tokenizer_encode(tok, text, strlen(text), ids);
    char joined[256] = "", piece[64];
    int special;
    for (size_t i = 0; i < n; i++) {
        size_t len = mtrl_tokenizer_piece(tok, ids[i], piece, sizeof piece, &special);
        TEST_EQ_INT(special, 0);
        TEST_EQ_INT((long)len, (long)strlen(piece));
        strncat(joined, piece, sizeof joined - strlen(joined) - 1);
    }
    TEST_EQ_STR(joined, text);
    uint32_t end;
    TEST_CHECK(mtrl_tokenizer_special(tok, "<|im_end|>", &end, &err) == MTRL_OK);
    mtrl_tokenizer_piece(tok, end, piece, sizeof piece, &special);
    TEST_EQ_INT(special, 1);
    TEST_EQ_STR(piece, "<|im_end|>");
    mtrl_tokenizer_piece(tok, 0xfffffff0u, piece, sizeof piece, &special);
    TEST_EQ_INT(special, -1);
    TEST_EQ_STR(piece, "");
    mtrl_tokenizer_piece(NULL, 'A', piece, sizeof piece, &special);
    TEST_CHECK(special == 0 && !strcmp(piece, "A"));
    mtrl_tokenizer_piece(NULL, MTRL_TOK_EOS, piece, sizeof piece, &special);
    TEST_CHECK(special == 1 && !strcmp(piece, mtrl_tok_special_name(MTRL_TOK_EOS)));
    mtrl_tokenizer_free(tok);
}

static void test_chat_(void) {
    mtrl_config cfg;
    char msg[4096];
    TEST_CHECK(load_cfg_(&cfg, "", msg, sizeof msg) == MTRL_OK);
    mtrl_chat c;
    mtrl_error err;
    TEST_CHECKF(mtrl_chat_init(&c, &cfg.model, 762, &err) == MTRL_OK, "%s", err.msg);
    TEST_EQ_INT(c.kind, MTRL_CHAT_KIMI);
    uint32_t ids[256];
    long n = mtrl_chat_prompt(&c, "What is 3+4?", 12, ids, 256);
    TEST_CHECK(n > 6 && ids[0] == c.user && ids[n - 1] == c.middle && ids[n - 2] != c.middle);
    TEST_CHECK(mtrl_chat_prompt(&c, "What is 3+4?", 12, ids, 5) == -1);
    // An env prompt holding a special token's text stays text.
    n = mtrl_chat_prompt(&c, "<|im_end|>", 10, ids, 256);
    int ends = 0;
    for (long i = 0; i < n; i++) ends += ids[i] == c.im_end;
    TEST_EQ_INT(ends, 1); // only the framing's own
    TEST_EQ_INT(mtrl_chat_role(&c, c.call_open), MTRL_CHAT_CALL_OPEN);
    TEST_EQ_INT(mtrl_chat_role(&c, c.call_close), MTRL_CHAT_CALL_CLOSE);
    TEST_EQ_INT(mtrl_chat_role(&c, c.im_end), MTRL_CHAT_END);
    TEST_EQ_INT(mtrl_chat_role(&c, 'a'), MTRL_CHAT_TEXT);
    // functions.calc:0 <arg> {"expr": "3+4"}  ->  calc({"expr": "3+4"})
    uint32_t call[128];
    size_t k = mtrl_tokenizer_encode(c.tok, "functions.calc:0", 16, call);
    call[k++] = c.arg;
    const char *args = "{\"expr\": \"3+4\"}";
    k += mtrl_tokenizer_encode(c.tok, args, strlen(args), call + k);
    char action[256], id[64];
    mtrl_chat_call(&c, call, k, action, sizeof action, id, sizeof id);
    TEST_EQ_STR(action, "calc({\"expr\": \"3+4\"})");
    TEST_EQ_STR(id, "functions.calc:0");
    // Malformed (no argument token): the env gets the text as the model wrote it.
    k = mtrl_tokenizer_encode(c.tok, "calc(3+4)", 9, call);
    mtrl_chat_call(&c, call, k, action, sizeof action, id, sizeof id);
    TEST_EQ_STR(action, "calc(3+4)");
    TEST_EQ_STR(id, "");
    long r = mtrl_chat_result(&c, "functions.calc:0", "7", 1, ids, 256);
    TEST_CHECK(r > 8 && ids[0] == c.section_end && ids[1] == c.im_end && ids[2] == c.system && ids[r - 1] == c.middle);
    char text[256];
    mtrl_chat_text(&c, ids, (size_t)r, text, sizeof text);
    TEST_EQ_STR(text, "tool## Return of functions.calc:0\n7assistant");
    mtrl_chat_free(&c);
    // bytes stays the default without from, and a mismatched pair is refused.
    mtrl_config plain;
    mtrl_config_errors errs = {0};
    TEST_CHECK(mtrl_config_load_text(&plain, "p", "[env]\nname = calc\n", NULL, 0, &errs) == MTRL_OK);
    TEST_CHECK(mtrl_chat_init(&c, &plain.model, MTRL_VOCAB, &err) == MTRL_OK && c.kind == MTRL_CHAT_BYTES);
    mtrl_chat_free(&c);
    snprintf(plain.model.chat_template, sizeof plain.model.chat_template, "kimi");
    TEST_CHECK(mtrl_chat_init(&c, &plain.model, MTRL_VOCAB, &err) == MTRL_ERR_USAGE);
    mtrl_config_errors_free(&errs);
}

int main(void) {
    const char *src = getenv("MTRL_SRC");
    snprintf(fixture_, sizeof fixture_, "%s/tests/fixtures/kimi_linear_tiny", src ? src : "..");
    snprintf(tmp_, sizeof tmp_, "/tmp/mtrl_test_st_XXXXXX");
    if (!mkdtemp(tmp_)) { perror("mkdtemp"); return 1; }
    test_reader_();
    test_writer_();
    test_bad_files_();
    test_config_();
    test_tokenizer_();
    test_chat_();
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp_);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmp_);
    return test_report();
}
