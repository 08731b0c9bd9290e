// mtrl-test: cpu
// BPE tokenizer (common/bpe.h) against the tiktoken and tokenizers libraries: the fixture
// tests/fixtures/bpe/ (made once by tools/make_bpe_fixture.py) holds one vocabulary as a
// tiktoken file and as a tokenizer.json, and the ids each library gives for a varied corpus
// (code, CJK, emoji, combining marks, whitespace runs, numbers, specials, invalid UTF-8). Both
// loaders must give exactly those ids and decode back to the bytes; bad files must fail with an
// error naming the file and the line or entry. Prints encode speed on about 1 MB (no assertion).
#include <jansson.h>
#include <time.h>
#include <unistd.h>

#include "common/bpe.h"
#include "tests/testhelp.h"

static char fixture_[1024];

static const char *fx_(const char *name) {
    static char buf[4][1200];
    static int k;
    char *b = buf[k++ & 3];
    snprintf(b, sizeof buf[0], "%s/%s", fixture_, name);
    return b;
}

// The three references of cases.txt: the tiktoken library, tokenizers with tokenizer.json and
// with tokenizer_gpt2.json.
enum { REF_TIKTOKEN, REF_HF, REF_GPT2, N_REF };
static const char *const ref_names_[N_REF] = {"tiktoken", "hf", "gpt2"};
static const char *const ref_files_[N_REF] = {"tiktoken.model", "tokenizer.json", "tokenizer_gpt2.json"};

typedef struct tcase {
    char name[64];
    unsigned char *text;
    size_t n;
    int special;
    uint32_t *ids[N_REF];
    size_t n_ids[N_REF];
    int has[N_REF]; // 0: "-", the library cannot take the text (invalid UTF-8)
} tcase;

static uint32_t *parse_ids_(const char *s, size_t *n) {
    size_t cap = 16;
    uint32_t *ids = malloc(cap * sizeof *ids);
    *n = 0;
    for (char *end; *s && *s != '\n'; s = end) {
        while (*s == ' ') s++;
        if (!*s || *s == '\n') break;
        unsigned long v = strtoul(s, &end, 10);
        if (end == s) break;
        if (*n == cap) ids = realloc(ids, (cap *= 2) * sizeof *ids);
        ids[(*n)++] = (uint32_t)v;
    }
    return ids;
}

static size_t load_cases_(tcase **out) {
    FILE *f = fopen(fx_("cases.txt"), "r");
    TEST_CHECKF(f != NULL, "%s", fx_("cases.txt"));
    if (!f) return 0;
    static char line[1 << 16];
    tcase *cs = NULL;
    size_t n = 0;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        if (strncmp(line, "case ", 5) == 0) {
            cs = realloc(cs, (n + 1) * sizeof *cs);
            memset(&cs[n], 0, sizeof cs[n]);
            snprintf(cs[n].name, sizeof cs[n].name, "%s", line + 5);
            n++;
        } else if (strncmp(line, "text ", 5) == 0 || strcmp(line, "text") == 0) {
            const char *h = line[4] ? line + 5 : "";
            size_t len = strlen(h) / 2;
            cs[n - 1].text = calloc(1, len + 1); // zeroed: valgrind saw PCRE2's JIT code read the spare byte
            for (size_t i = 0; i < len; i++) {
                unsigned v;
                sscanf(h + 2 * i, "%2x", &v);
                cs[n - 1].text[i] = (unsigned char)v;
            }
            cs[n - 1].n = len;
        } else if (strncmp(line, "mode ", 5) == 0) {
            cs[n - 1].special = strcmp(line + 5, "special") == 0;
        } else {
            for (int r = 0; r < N_REF; r++) {
                size_t l = strlen(ref_names_[r]);
                if (strncmp(line, ref_names_[r], l) != 0 || line[l] != ' ') continue;
                cs[n - 1].has[r] = strcmp(line + l, " -") != 0;
                cs[n - 1].ids[r] = parse_ids_(line + l, &cs[n - 1].n_ids[r]);
            }
        }
    }
    fclose(f);
    *out = cs;
    return n;
}

static int same_ids_(const uint32_t *a, size_t na, const uint32_t *b, size_t nb, const char *what, const char *name) {
    if (na == nb && memcmp(a, b, na * sizeof *a) == 0) return 1;
    size_t i = 0;
    while (i < na && i < nb && a[i] == b[i]) i++;
    fprintf(stderr, "  %s %s: %zu ids, want %zu; first difference at %zu (got %u, want %u)\n", what, name, na, nb,
            i, i < na ? a[i] : 0, i < nb ? b[i] : 0);
    return 0;
}

// Every case: the ids the library gave, and decode gives the bytes back. Where the tokenizers
// library cannot take the text (invalid UTF-8), tokenizer.json has the tiktoken library's ids
// (the same vocabulary and merge rule) and tokenizer_gpt2.json only the round trip.
static void check_cases_(const mtrl_bpe *t, const tcase *cs, size_t n, int ref) {
    for (size_t c = 0; c < n; c++) {
        const tcase *k = &cs[c];
        int r = k->has[ref] ? ref : ref == REF_HF ? REF_TIKTOKEN : -1;
        const uint32_t *want = r >= 0 ? k->ids[r] : NULL;
        size_t n_want = r >= 0 ? k->n_ids[r] : 0;
        uint32_t *ids = malloc((k->n + 1) * sizeof *ids);
        size_t n_ids = 0;
        mtrl_error err = {0};
        mtrl_status st = mtrl_bpe_encode(t, k->text, k->n, k->special ? MTRL_BPE_SPECIAL : 0, ids, &n_ids, &err);
        TEST_CHECKF(st == MTRL_OK, "%s: %s", k->name, err.msg);
        if (want)
            TEST_CHECKF(same_ids_(ids, n_ids, want, n_want, ref_names_[ref], k->name), "%s (%s)", k->name,
                        ref_files_[ref]);
        char *back = malloc(k->n + 1);
        size_t len = 0;
        st = mtrl_bpe_decode(t, ids, n_ids, 0, back, k->n + 1, &len, &err);
        TEST_CHECKF(st == MTRL_OK && len == k->n && memcmp(back, k->text, k->n) == 0, "%s: decode round trip",
                    k->name);
        free(back);
        free(ids);
    }
}

static void write_file_(const char *path, const char *data) {
    FILE *f = fopen(path, "w");
    fputs(data, f);
    fclose(f);
}

// A tiktoken file of the 256 bytes plus extra lines; loading it must fail naming want1 and want2.
static void bad_tiktoken_(const char *dir, const char *extra, int skip_byte, mtrl_status code, const char *want1,
                          const char *want2) {
    char path[1200];
    snprintf(path, sizeof path, "%s/bad.tiktoken", dir);
    FILE *f = fopen(path, "w");
    for (int b = 0; b < 256; b++) {
        if (b == skip_byte) continue;
        unsigned char c = (unsigned char)b;
        static const char a64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        fprintf(f, "%c%c== %d\n", a64[c >> 2], a64[(c & 3) << 4], b);
    }
    fputs(extra, f);
    fclose(f);
    mtrl_bpe *t = (mtrl_bpe *)1;
    mtrl_error err = {0};
    mtrl_status st = mtrl_bpe_init_tiktoken(&t, path, NULL, &err);
    TEST_CHECKF(st == code, "extra '%s': got %d (%s)", extra, st, err.msg);
    TEST_CHECK(t == NULL);
    TEST_CONTAINS(err.msg, path);
    TEST_CONTAINS(err.msg, want1);
    if (want2) TEST_CONTAINS(err.msg, want2);
    mtrl_bpe_free(t);
}

// The fixture's tokenizer.json changed by edit(); loading must fail naming want.
static void bad_hf_(const char *dir, void (*edit)(json_t *), const char *want) {
    json_error_t jerr;
    json_t *root = json_load_file(fx_("tokenizer.json"), 0, &jerr);
    TEST_CHECK(root != NULL);
    if (!root) return;
    edit(root);
    char path[1200];
    snprintf(path, sizeof path, "%s/bad_tokenizer.json", dir);
    TEST_CHECK(json_dump_file(root, path, JSON_COMPACT) == 0);
    json_decref(root);
    mtrl_bpe *t = NULL;
    mtrl_error err = {0};
    mtrl_status st = mtrl_bpe_init_hf(&t, path, &err);
    TEST_CHECKF(st != MTRL_OK && t == NULL, "want an error naming '%s'", want);
    TEST_CONTAINS(err.msg, path);
    TEST_CONTAINS(err.msg, want);
}

static void no_merges_(json_t *r) { json_object_del(json_object_get(r, "model"), "merges"); }
static void bad_merge_(json_t *r) {
    json_t *m = json_object_get(json_object_get(r, "model"), "merges");
    json_array_set_new(json_array_get(m, 5), 1, json_string("zzzq"));
}
static void no_vocab_entry_(json_t *r) { // the token merges[0] makes
    json_t *model = json_object_get(r, "model"), *m0 = json_array_get(json_object_get(model, "merges"), 0);
    char both[64];
    snprintf(both, sizeof both, "%s%s", json_string_value(json_array_get(m0, 0)),
             json_string_value(json_array_get(m0, 1)));
    json_object_del(json_object_get(model, "vocab"), both);
}
static void normalizer_(json_t *r) { json_object_set_new(r, "normalizer", json_pack("{s:s}", "type", "NFC")); }
static void unigram_(json_t *r) { json_object_set_new(json_object_get(r, "model"), "type", json_string("Unigram")); }
static void lstrip_(json_t *r) {
    json_object_set_new(json_array_get(json_object_get(r, "added_tokens"), 2), "lstrip", json_true());
}
static void merge_form_(json_t *r) {
    json_t *m = json_object_get(json_object_get(r, "model"), "merges");
    json_array_set_new(m, 3, json_string("abc"));
}

static double now_(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// Encode and decode n bytes; prints MB/s. Returns 1 when decode gives the bytes back.
static int timed_(const mtrl_bpe *t, const char *what, const unsigned char *text, size_t n, unsigned flags) {
    uint32_t *ids = malloc(n * sizeof *ids);
    size_t n_ids = 0;
    mtrl_error err = {0};
    double t0 = now_();
    mtrl_status st = mtrl_bpe_encode(t, text, n, flags, ids, &n_ids, &err);
    double t1 = now_();
    TEST_CHECKF(st == MTRL_OK, "%s: %s", what, err.msg);
    char *back = malloc(n + 1);
    size_t len = 0;
    double t2 = now_();
    st = mtrl_bpe_decode(t, ids, n_ids, 0, back, n + 1, &len, &err);
    double t3 = now_();
    int ok = st == MTRL_OK && len == n && memcmp(back, text, n) == 0;
    printf("bench %-28s %8zu bytes -> %7zu ids: encode %7.1f ms (%6.1f MB/s), decode %5.2f ms\n", what, n, n_ids,
           (t1 - t0) * 1e3, n / 1e6 / (t1 - t0), (t3 - t2) * 1e3);
    free(back);
    free(ids);
    return ok;
}

int main(void) {
    const char *src = getenv("MTRL_SRC");
    snprintf(fixture_, sizeof fixture_, "%s/tests/fixtures/bpe", src ? src : "..");
    tcase *cs = NULL;
    size_t n_cases = load_cases_(&cs);
    TEST_CHECK(n_cases >= 25);

    // ---- the tiktoken file with Kimi's layout: 256 reserved specials, named by the config ----
    mtrl_bpe_tiktoken_opts opts = {.config_path = fx_("tokenizer_config.json"), .n_reserved = MTRL_BPE_KIMI_RESERVED};
    mtrl_bpe *tk = NULL, *hf = NULL, *gpt2 = NULL;
    mtrl_error err = {0};
    TEST_CHECKF(mtrl_bpe_init_tiktoken(&tk, fx_("tiktoken.model"), &opts, &err) == MTRL_OK, "%s", err.msg);
    TEST_CHECKF(mtrl_bpe_init_hf(&hf, fx_("tokenizer.json"), &err) == MTRL_OK, "%s", err.msg);
    TEST_CHECKF(mtrl_bpe_init_hf(&gpt2, fx_("tokenizer_gpt2.json"), &err) == MTRL_OK, "%s", err.msg);
    if (!tk || !hf || !gpt2) return test_report();
    check_cases_(tk, cs, n_cases, REF_TIKTOKEN);
    check_cases_(hf, cs, n_cases, REF_HF);
    check_cases_(gpt2, cs, n_cases, REF_GPT2);
    mtrl_bpe_free(gpt2);

    // The fixture was made with the same pattern as MTRL_BPE_PATTERN_KIMI.
    json_error_t jerr;
    json_t *root = json_load_file(fx_("tokenizer.json"), 0, &jerr);
    json_t *split = json_array_get(json_object_get(json_object_get(root, "pre_tokenizer"), "pretokenizers"), 0);
    TEST_EQ_STR(json_string_value(json_object_get(json_object_get(split, "pattern"), "Regex")), MTRL_BPE_PATTERN_KIMI);
    json_decref(root);

    // ---- ids, specials, lookups ----
    uint32_t n_ranks = mtrl_bpe_n_ids(tk) - MTRL_BPE_KIMI_RESERVED, id = 0;
    TEST_CHECK(n_ranks > 3000);
    TEST_EQ_INT(mtrl_bpe_n_ids(hf), n_ranks + MTRL_BPE_KIMI_RESERVED);
    TEST_CHECK(mtrl_bpe_special_id(tk, "[BOS]", &id, &err) == MTRL_OK && id == n_ranks);
    TEST_CHECK(mtrl_bpe_special_id(hf, "<|im_end|>", &id, &err) == MTRL_OK && id == n_ranks + 2);
    char reserved[64];
    snprintf(reserved, sizeof reserved, "<|reserved_token_%u|>", n_ranks + 44); // unnamed by the config
    TEST_CHECK(mtrl_bpe_special_id(tk, reserved, &id, &err) == MTRL_OK && id == n_ranks + 44);
    TEST_CHECK(mtrl_bpe_special_id(tk, "<|nope|>", &id, &err) == MTRL_ERR_NOTFOUND);
    TEST_CONTAINS(err.msg, "<|nope|>");
    TEST_CONTAINS(err.msg, "tiktoken.model");
    TEST_CHECK(mtrl_bpe_is_special(tk, n_ranks + 1) && !mtrl_bpe_is_special(tk, 65));
    size_t len = 0;
    const unsigned char *b = mtrl_bpe_token_bytes(hf, 'A', &len);
    TEST_CHECK(b && len == 1 && b[0] == 'A');
    b = mtrl_bpe_token_bytes(tk, n_ranks + 1, &len);
    TEST_CHECK(b && len == 5 && memcmp(b, "[EOS]", 5) == 0);
    TEST_CHECK(mtrl_bpe_token_bytes(tk, 1u << 30, &len) == NULL);

    // decode: unknown ids are named, specials can be skipped, truncation is snprintf-like
    uint32_t ids[8] = {'h', 'i', n_ranks + 1, '!'};
    char out[16];
    TEST_CHECK(mtrl_bpe_decode(tk, ids, 4, 0, out, sizeof out, &len, &err) == MTRL_OK && len == 8);
    TEST_EQ_STR(out, "hi[EOS]!");
    TEST_CHECK(mtrl_bpe_decode(tk, ids, 4, MTRL_BPE_SKIP_SPECIAL, out, sizeof out, &len, &err) == MTRL_OK);
    TEST_EQ_STR(out, "hi!");
    TEST_CHECK(mtrl_bpe_decode(tk, ids, 4, 0, out, 4, &len, &err) == MTRL_OK && len == 8);
    TEST_EQ_STR(out, "hi[");
    ids[1] = 999999;
    TEST_CHECK(mtrl_bpe_decode(tk, ids, 4, 0, out, sizeof out, &len, &err) == MTRL_ERR_FORMAT);
    TEST_CONTAINS(err.msg, "id 999999 (position 1)");

    // Caller-given specials and patterns; patterns PCRE2 cannot take are refused by name.
    mtrl_bpe_special extra[] = {{"<eot>", 5000}};
    mtrl_bpe_tiktoken_opts o2 = {.pattern = "\\p{L}+|\\p{N}|[^\\p{L}\\p{N}]+", .specials = extra, .n_specials = 1};
    mtrl_bpe *t2 = NULL;
    TEST_CHECKF(mtrl_bpe_init_tiktoken(&t2, fx_("tiktoken.model"), &o2, &err) == MTRL_OK, "%s", err.msg);
    if (t2) {
        uint32_t got[32];
        size_t n_got = 0;
        TEST_CHECK(mtrl_bpe_encode(t2, "ab<eot>12", 9, MTRL_BPE_SPECIAL, got, &n_got, &err) == MTRL_OK);
        TEST_CHECK(n_got >= 4 && got[n_got - 3] == 5000 && got[n_got - 2] == '1' && got[n_got - 1] == '2');
        mtrl_bpe_free(t2);
    }
    const char *bad_pats[][2] = {{"[^a&&b]", "negated intersection"},
                                 {"(ab", "does not compile"},
                                 {"[\\S]", "\\S inside a character class"},
                                 {"[abc", "unterminated character class"}};
    for (int i = 0; i < 4; i++) {
        mtrl_bpe_tiktoken_opts o3 = {.pattern = bad_pats[i][0]};
        t2 = (mtrl_bpe *)1;
        TEST_CHECK(mtrl_bpe_init_tiktoken(&t2, fx_("tiktoken.model"), &o3, &err) == MTRL_ERR_FORMAT && !t2);
        TEST_CONTAINS(err.msg, bad_pats[i][1]);
        TEST_CONTAINS(err.msg, "tiktoken.model");
    }

    // ---- bad files name the file and the line or entry ----
    char dir[] = "/tmp/mtrl_test_bpe_XXXXXX";
    TEST_CHECK(mkdtemp(dir) != NULL);
    bad_tiktoken_(dir, "QUJD\n", -1, MTRL_ERR_FORMAT, ":257:", "expected 'BASE64 RANK'");
    bad_tiktoken_(dir, "QUJD 300 7\n", -1, MTRL_ERR_FORMAT, ":257:", "expected");
    bad_tiktoken_(dir, "QUJD x1\n", -1, MTRL_ERR_FORMAT, ":257:", "not a number");
    bad_tiktoken_(dir, "\nQU@D 300\n", -1, MTRL_ERR_FORMAT, ":258:", "not base64");
    bad_tiktoken_(dir, "QUJD 65\n", -1, MTRL_ERR_FORMAT, ":257: rank 65 was already given at line 66", NULL);
    bad_tiktoken_(dir, "QQ== 300\n", -1, MTRL_ERR_FORMAT, ":257:", "already has rank 65 (line 66)");
    bad_tiktoken_(dir, "QUJD 999999999\n", -1, MTRL_ERR_LIMIT, ":257:", "over the limit");
    bad_tiktoken_(dir, "", 7, MTRL_ERR_FORMAT, "no token for the byte 0x07", NULL);
    char path[1200];
    snprintf(path, sizeof path, "%s/empty.tiktoken", dir);
    write_file_(path, "\n\n");
    mtrl_bpe *t3 = NULL;
    TEST_CHECK(mtrl_bpe_init_tiktoken(&t3, path, NULL, &err) == MTRL_ERR_FORMAT && !t3);
    TEST_CONTAINS(err.msg, "no ranks");
    TEST_CHECK(mtrl_bpe_init_tiktoken(&t3, "/nonexistent/tiktoken.model", NULL, &err) == MTRL_ERR_IO);
    TEST_CONTAINS(err.msg, "/nonexistent/tiktoken.model");
    snprintf(path, sizeof path, "%s/config.json", dir);
    char json[256];
    snprintf(json, sizeof json, "{\"added_tokens_decoder\": {\"%u\": {\"content\": \"[BOS]\"}, \"65\": {\"content\": \"x\"}}}",
             n_ranks);
    write_file_(path, json);
    mtrl_bpe_tiktoken_opts o4 = {.config_path = path, .n_reserved = 4};
    TEST_CHECK(mtrl_bpe_init_tiktoken(&t3, fx_("tiktoken.model"), &o4, &err) == MTRL_ERR_FORMAT && !t3);
    TEST_CONTAINS(err.msg, "id 65 is already a token");
    TEST_CONTAINS(err.msg, path);
    write_file_(path, "{\"added_tokens_decoder\": {\"3256\": {\"content\": \"[BOS]\"},}");
    TEST_CHECK(mtrl_bpe_init_tiktoken(&t3, fx_("tiktoken.model"), &o4, &err) == MTRL_ERR_FORMAT && !t3);
    TEST_CONTAINS(err.msg, "bad JSON");
    TEST_CONTAINS(err.msg, ":1:");

    snprintf(path, sizeof path, "%s/trunc.json", dir);
    write_file_(path, "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0,\n \"b\"");
    TEST_CHECK(mtrl_bpe_init_hf(&t3, path, &err) == MTRL_ERR_FORMAT && !t3);
    TEST_CONTAINS(err.msg, "trunc.json:2:");
    TEST_CONTAINS(err.msg, "bad JSON");
    TEST_CHECK(mtrl_bpe_init_hf(&t3, "/nonexistent/tokenizer.json", &err) == MTRL_ERR_IO);
    TEST_CONTAINS(err.msg, "/nonexistent/tokenizer.json");
    bad_hf_(dir, no_merges_, "model.merges is missing");
    bad_hf_(dir, bad_merge_, "model.merges[5]");
    bad_hf_(dir, no_vocab_entry_, "model.merges[0]: '");
    bad_hf_(dir, no_vocab_entry_, "is not in the vocab");
    bad_hf_(dir, normalizer_, "normalizer 'NFC' is not supported yet");
    bad_hf_(dir, unigram_, "model.type 'Unigram'");
    bad_hf_(dir, lstrip_, "added_tokens[2] ('<|im_end|>'): lstrip is not supported yet");
    bad_hf_(dir, merge_form_, "model.merges[3] is not a pair");
    unlink(path);
    snprintf(path, sizeof path, "%s/bad.tiktoken", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/bad_tokenizer.json", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/empty.tiktoken", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    rmdir(dir);

    // ---- about 1 MB of the varied corpus, and pathological pieces ----
    size_t big_n = 0, cap = 1 << 20;
    unsigned char *big = malloc(cap + 4096);
    for (size_t c = 0; big_n < cap; c = (c + 1) % n_cases) {
        memcpy(big + big_n, cs[c].text, cs[c].n);
        big_n += cs[c].n;
    }
    TEST_CHECK(timed_(tk, "tiktoken corpus", big, big_n, MTRL_BPE_SPECIAL));
    TEST_CHECK(timed_(hf, "tokenizer.json corpus", big, big_n, MTRL_BPE_SPECIAL));
    for (size_t i = 0; i < big_n; i++) big[i] = (unsigned char)"supercalifragilisticexpialidocious"[i % 34];
    TEST_CHECK(timed_(tk, "one 1 MB word", big, big_n, 0));
    memset(big, ' ', big_n);
    TEST_CHECK(timed_(tk, "1 MB of spaces", big, big_n, 0));
    for (size_t i = 0; i < big_n; i++) big[i] = (unsigned char)(i * 2654435761u >> 13);
    TEST_CHECK(timed_(tk, "1 MB of random bytes", big, big_n, 0));
    free(big);

    for (size_t c = 0; c < n_cases; c++) {
        free(cs[c].text);
        for (int r = 0; r < N_REF; r++) free(cs[c].ids[r]);
    }
    free(cs);
    mtrl_bpe_free(tk);
    mtrl_bpe_free(hf);
    return test_report();
}
