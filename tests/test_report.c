// mtrl-test: cpu timeout=600
// `mtrl report` on real runs (fork/exec of MTRL_BIN in a mkdtemp directory):
//  1. two short quickstart runs in one database; the report of the newest run is a well-formed
//     page (an XML-style tag-balance check below: every element closed in order, attributes
//     quoted, entities valid), every metric the learner logged is drawn, and each polyline's
//     point count and values equal the run's rows for that metric; the expert heatmaps hold one
//     cell per (layer, expert, step); metrics.csv and experts.csv hold every row;
//  2. --run 1 --run 2 overlays both runs (a polyline per run and metric, a legend naming both);
//  3. a metric of 5000 steps (added to a copy of the database) is drawn as at most 2000 min/max
//     points that keep its extremes;
//  4. errors: unknown run or database -> 1, bad usage -> 2;
//  5. (issue 28, item 19) example episodes with their replay commands, a per-tool table that
//     matches tool_calls, no panel titled with a raw metric name, fraction panels on 0..1.
#include <ctype.h>
#include <fcntl.h>
#include <math.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/testhelp.h"
#include "tests/testproc.h"

static const char *bin_, *src_;
static char dir_[256];

// The helpers of tests/testproc.h under this file's short names.
typedef test_result result;
#define result_free_ test_result_free
static result run_(char *const argv[]) { return test_run_in(dir_, argv); }
static char *slurp_(const char *path) { return test_slurp(path, NULL); }

#define RUN(...) run_((char *const[]){(char *)bin_, __VA_ARGS__, NULL})

#define q_int_ test_query_int

static int make_run_(const char *seed) {
    char ini[1024], sd[64];
    snprintf(ini, sizeof ini, "%s/experiments/quickstart.ini", src_);
    snprintf(sd, sizeof sd, "run.seed=%s", seed);
    result r = RUN("run", ini, "--set", "run.steps=3", "--set", sd, "--set", "run.out_dir=runs", "--set", "run.checkpoint_every=0",
                   "--set", "warmup.steps=3", "--set", "warmup.batch=4", "--set", "run.max_minutes=5", "--db", "runs.db");
    int rc = r.rc;
    if (rc) fprintf(stderr, "mtrl run failed (%d):\n%s\n", rc, r.err);
    result_free_(&r);
    return rc;
}

// ---- an XML-style well-formedness check -----------------------------------------------------------

// Checks that the page is well-formed: after an optional <!DOCTYPE ...>, tags nest and close in
// order (<x .../> closes itself), attribute values are quoted, '&' starts a known or numeric
// entity, and no '<' appears in text. Returns 1, or 0 with a message in why.
static int well_formed_(const char *s, char *why, size_t cap) {
    char stack[256][32];
    int depth = 0, elements = 0;
    size_t i = 0, n = strlen(s);
    while (i < n && strchr(" \t\r\n", s[i])) i++;
    if (!strncmp(s + i, "<!DOCTYPE", 9)) {
        const char *e = strchr(s + i, '>');
        if (!e) return snprintf(why, cap, "unterminated DOCTYPE"), 0;
        i = (size_t)(e - s) + 1;
    }
    while (i < n) {
        if (s[i] == '&') {
            const char *e = strchr(s + i, ';');
            size_t len = e ? (size_t)(e - (s + i)) : 0;
            int ok = e && len >= 2 && len <= 8;
            if (ok && s[i + 1] == '#') {
                for (size_t k = 2; k < len; k++) ok &= (s[i + k] >= '0' && s[i + k] <= '9') || s[i + k] == 'x';
            } else if (ok) {
                ok = !strncmp(s + i, "&amp;", 5) || !strncmp(s + i, "&lt;", 4) || !strncmp(s + i, "&gt;", 4) ||
                     !strncmp(s + i, "&quot;", 6) || !strncmp(s + i, "&apos;", 6);
            }
            if (!ok) return snprintf(why, cap, "bad entity at byte %zu: %.20s", i, s + i), 0;
            i++;
            continue;
        }
        if (s[i] != '<') {
            i++;
            continue;
        }
        if (!strncmp(s + i, "<!--", 4)) {
            const char *e = strstr(s + i, "-->");
            if (!e) return snprintf(why, cap, "unterminated comment"), 0;
            i = (size_t)(e - s) + 3;
            continue;
        }
        int closing = s[i + 1] == '/';
        size_t j = i + 1 + (size_t)closing, k = j;
        while (k < n && (isalnum((unsigned char)s[k]) || s[k] == '-' || s[k] == ':' || s[k] == '_')) k++;
        if (k == j || k - j >= 32) return snprintf(why, cap, "bad tag name at byte %zu: %.30s", i, s + i), 0;
        char name[32];
        memcpy(name, s + j, k - j);
        name[k - j] = 0;
        // attributes: name="value" (no '<' inside the tag, values quoted)
        int self = 0;
        while (k < n && s[k] != '>') {
            if (s[k] == '"' || s[k] == '\'') {
                char q = s[k];
                const char *e = strchr(s + k + 1, q);
                if (!e) return snprintf(why, cap, "unterminated attribute in <%s> at byte %zu", name, k), 0;
                for (const char *p = s + k + 1; p < e; p++)
                    if (*p == '<') return snprintf(why, cap, "'<' in an attribute of <%s> at byte %zu", name, k), 0;
                k = (size_t)(e - s) + 1;
                continue;
            }
            if (s[k] == '<') return snprintf(why, cap, "'<' inside tag <%s> at byte %zu", name, k), 0;
            if (s[k] == '=' && k + 1 < n && s[k + 1] != '"' && s[k + 1] != '\'')
                return snprintf(why, cap, "unquoted attribute in <%s> at byte %zu", name, k), 0;
            if (s[k] == '/' && k + 1 < n && s[k + 1] == '>') self = 1;
            k++;
        }
        if (k >= n) return snprintf(why, cap, "unterminated tag <%s>", name), 0;
        i = k + 1;
        if (closing) {
            if (depth == 0 || strcmp(stack[depth - 1], name))
                return snprintf(why, cap, "</%s> at byte %zu closes <%s>", name, j, depth ? stack[depth - 1] : "(nothing)"), 0;
            depth--;
        } else if (!self) {
            if (depth == 256) return snprintf(why, cap, "nesting too deep"), 0;
            snprintf(stack[depth++], 32, "%s", name);
            elements++;
            if (!strcmp(name, "style")) { // raw text up to </style>
                const char *e = strstr(s + i, "</style>");
                if (!e) return snprintf(why, cap, "unterminated <style>"), 0;
                for (const char *p = s + i; p < e; p++)
                    if (*p == '<' || *p == '&') return snprintf(why, cap, "markup inside <style>"), 0;
                i = (size_t)(e - s);
            }
        } else {
            elements++;
        }
    }
    if (depth) return snprintf(why, cap, "<%s> never closed", stack[depth - 1]), 0;
    if (!elements) return snprintf(why, cap, "no elements"), 0;
    return 1;
}

// The value of attribute `name` inside the tag that starts at tag (NULL-terminated copy, or "").
static void attr_(const char *tag, const char *name, char *out, size_t cap) {
    out[0] = 0;
    const char *end = strchr(tag, '>');
    char pat[64];
    snprintf(pat, sizeof pat, " %s=\"", name);
    const char *p = strstr(tag, pat);
    if (!p || (end && p > end)) return;
    p += strlen(pat);
    const char *q = strchr(p, '"');
    size_t len = (size_t)(q - p) < cap - 1 ? (size_t)(q - p) : cap - 1;
    memcpy(out, p, len);
    out[len] = 0;
}

static size_t count_words_(const char *s) {
    size_t n = 0;
    for (const char *p = s; *p;) {
        while (*p == ' ') p++;
        if (!*p) break;
        n++;
        while (*p && *p != ' ') p++;
    }
    return n;
}

// The <polyline> tag of run/metric, or NULL.
static const char *polyline_(const char *page, long long run, const char *metric) {
    char pat[256];
    snprintf(pat, sizeof pat, "<polyline class=\"series\" data-run=\"%lld\" data-metric=\"%s\" ", run, metric);
    return strstr(page, pat);
}

// Checks every metric of run against its polyline. Returns the number of metrics checked.
static int check_series_(const char *page, const char *db, long long run) {
    sqlite3 *h;
    if (sqlite3_open_v2(db, &h, SQLITE_OPEN_READONLY, NULL) != SQLITE_OK) return 0;
    sqlite3_stmt *st;
    int checked = 0;
    sqlite3_prepare_v2(h, "SELECT name, count(value) FROM metrics WHERE run = ? GROUP BY name", -1, &st, NULL);
    sqlite3_bind_int64(st, 1, run);
    while (sqlite3_step(st) == SQLITE_ROW) {
        const char *name = (const char *)sqlite3_column_text(st, 0);
        long long n = sqlite3_column_int64(st, 1);
        const char *pl = polyline_(page, run, name);
        TEST_CHECKF(pl != NULL, "no polyline for run %lld metric %s", run, name);
        if (!pl) continue;
        char *vals = malloc(1 << 20), *pts = malloc(1 << 20), nbuf[32];
        attr_(pl, "data-n", nbuf, sizeof nbuf);
        attr_(pl, "points", pts, 1 << 20);
        attr_(pl, "data-values", vals, 1 << 20);
        if (n <= 2000) {
            TEST_CHECKF(atoll(nbuf) == n && (long long)count_words_(pts) == n && (long long)count_words_(vals) == n,
                        "run %lld metric %s: %lld rows, data-n %s, %zu points, %zu values", run, name, n, nbuf,
                        count_words_(pts), count_words_(vals));
            // the drawn values are the stored values, in step order
            sqlite3_stmt *v;
            sqlite3_prepare_v2(h, "SELECT value FROM metrics WHERE run = ? AND name = ? AND value IS NOT NULL ORDER BY step", -1, &v,
                               NULL);
            sqlite3_bind_int64(v, 1, run);
            sqlite3_bind_text(v, 2, name, -1, SQLITE_TRANSIENT);
            char *p = vals;
            int same = 1;
            while (sqlite3_step(v) == SQLITE_ROW) {
                double want = sqlite3_column_double(v, 0), got = strtod(p, &p);
                same &= fabs(got - want) <= 1e-7 * fabs(want) + 1e-30;
            }
            sqlite3_finalize(v);
            TEST_CHECKF(same, "run %lld metric %s: drawn values differ from the store", run, name);
        }
        free(vals);
        free(pts);
        checked++;
    }
    sqlite3_finalize(st);
    sqlite3_close(h);
    return checked;
}

static size_t count_(const char *s, const char *needle) {
    size_t n = 0;
    for (const char *p = strstr(s, needle); p; p = strstr(p + 1, needle)) n++;
    return n;
}

static long long lines_(const char *path) {
    char *b = slurp_(path);
    long long n = (long long)count_(b, "\n");
    free(b);
    return n;
}

// Issue 28, item 19: example episodes with the command that replays each, a per-tool table
// that matches tool_calls, every panel titled in words (no raw metric name), and the fraction
// panels on a 0..1 axis.
static void report_item19_(const char *page, const char *db) {
    TEST_CONTAINS(page, "<h2 id=\"episodes\">Example episodes</h2>");
    int examples = 0;
    for (const char *p = strstr(page, "<tr data-run=\"2\" data-episode=\""); p; p = strstr(p + 1, "<tr data-run=\"2\" data-episode=\"")) {
        long long id = atoll(p + strlen("<tr data-run=\"2\" data-episode=\""));
        char sql[160], cmd[200];
        snprintf(sql, sizeof sql, "SELECT count(*) FROM episodes WHERE run = 2 AND id = %lld", id);
        TEST_EQ_INT(q_int_(db, sql), 1);
        snprintf(cmd, sizeof cmd, "<code>mtrl replay --db runs.db --run 2 --episode %lld</code>", id);
        const char *end = strstr(p, "</tr>"), *c = strstr(p, cmd);
        TEST_CHECKF(c && c < end, "episode %lld's row has no replay command", id);
        examples++;
    }
    printf("report: %d example episodes\n", examples);
    TEST_CHECK(examples >= 1 && examples <= 9);
    TEST_CONTAINS(page, "<h2 id=\"tools\">Tools</h2>");
    // the rows (each tool name, then the others summed) add up to the run's tool calls and errors
    long long calls = q_int_(db, "SELECT count(*) FROM tool_calls WHERE run = 2");
    long long errors = q_int_(db, "SELECT count(*) FROM tool_calls WHERE run = 2 AND error IS NOT NULL AND error <> ''");
    const char *tools = strstr(page, "<table class=\"tools\">"), *tend = tools ? strstr(tools, "</table>") : NULL;
    long long sum_calls = 0, sum_errors = 0;
    for (const char *c = tools ? strstr(tools, " data-calls=\"") : NULL; c && c < tend; c = strstr(c + 1, " data-calls=\"")) {
        sum_calls += atoll(c + strlen(" data-calls=\""));
        const char *e = strstr(c, " data-errors=\"");
        if (e) sum_errors += atoll(e + strlen(" data-errors=\""));
    }
    printf("report: %lld tool calls (%lld errors) in the tools table, %lld (%lld) in the store\n", sum_calls, sum_errors, calls, errors);
    if (calls > 0) {
        TEST_CHECK(tools != NULL);
        TEST_EQ_INT(sum_calls, calls);
        TEST_EQ_INT(sum_errors, errors);
    } else {
        TEST_CONTAINS(page, "no tool calls");
    }
    TEST_CHECK(strstr(page, "a metric no panel group names") == NULL);
    for (const char *h = strstr(page, "<h3>"); h; h = strstr(h + 1, "<h3>")) {
        const char *e = strstr(h, "</h3>");
        int raw = 0;
        for (const char *c = h; e && c < e; c++) raw |= *c == '_';
        TEST_CHECKF(!raw, "a panel titled with a raw metric name: %.60s", h);
    }
    const char *panels[] = {"<h3>Clip fractions</h3>", "<h3>Success rate</h3>", "<h3>Masked fraction</h3>"};
    for (int k = 0; k < 3; k++) {
        const char *p = strstr(page, panels[k]), *end = p ? strstr(p, "</svg>") : NULL;
        TEST_CHECKF(p && end, "no panel %s", panels[k]);
        if (!p || !end) continue;
        char lo[64], hi[64];
        const char *first = strstr(p, "class=\"yt\""), *last = first;
        for (const char *y = first; y && y < end; y = strstr(y + 1, "class=\"yt\"")) last = y;
        TEST_CHECK(first && first < end);
        if (!first || first >= end) continue;
        sscanf(strchr(first, '>') + 1, "%63[^<]", lo);
        sscanf(strchr(last, '>') + 1, "%63[^<]", hi);
        TEST_CHECKF(!strcmp(lo, "0") && !strcmp(hi, "1.0"), "%s: y axis %s..%s, not 0..1", panels[k], lo, hi);
    }
}

// ---- pictures --------------------------------------------------------------------------------------

// A run of the picture env (experiments/image-cpu.ini, two steps): its example episodes show
// their pictures, written beside the page as PNG files the page names; a run without pictures
// (the quickstart's, checked by the caller) has no figure.
static void test_pictures_(void) {
    char ini[1024], path[700], why[512];
    snprintf(ini, sizeof ini, "%s/experiments/image-cpu.ini", src_);
    result r = RUN("run", ini, "--set", "run.steps=2", "--set", "warmup.steps=2", "--set", "run.out_dir=img-runs",
                   "--db", "img.db");
    TEST_EQ_INT(r.rc, 0);
    result_free_(&r);
    r = RUN("report", "--db", "img.db", "--out", "img-rep");
    TEST_EQ_INT(r.rc, 0);
    result_free_(&r);
    snprintf(path, sizeof path, "%s/img-rep/index.html", dir_);
    char *page = slurp_(path);
    TEST_CHECK(page != NULL);
    if (!page) return;
    TEST_CHECKF(well_formed_(page, why, sizeof why), "the page with pictures is not well-formed: %s", why);
    int figures = 0;
    for (const char *p = page; (p = strstr(p, "<figure data-episode=\"")); p++) {
        figures++;
        const char *src = strstr(p, "<img src=\"");
        TEST_CHECK(src != NULL);
        if (!src) break;
        char name[128] = "", png[900];
        sscanf(src + 10, "%127[^\"]", name);
        snprintf(png, sizeof png, "%s/img-rep/%s", dir_, name);
        size_t len = 0;
        char *b = test_slurp(png, &len);
        TEST_CHECKF(b && len > 8 && !memcmp(b, "\x89PNG\r\n\x1a\n", 8), "%s is not a PNG", png);
        free(b);
    }
    TEST_CHECKF(figures >= 1, "no picture shown for the picture env's episodes (%d figures)", figures);
    free(page);
}

int main(void) {
    bin_ = getenv("MTRL_BIN");
    src_ = getenv("MTRL_SRC");
    if (!bin_ || !src_) {
        fprintf(stderr, "MTRL_BIN and MTRL_SRC must be set (ctest sets them)\n");
        return 1;
    }
    // the checker itself: it must refuse what it claims to refuse
    char why0[256];
    TEST_CHECK(well_formed_("<!DOCTYPE html>\n<a x=\"1\"><b/>t &amp; &#39;</a>", why0, sizeof why0));
    TEST_CHECK(!well_formed_("<a><b></a></b>", why0, sizeof why0));
    TEST_CHECK(!well_formed_("<a><b></b>", why0, sizeof why0));
    TEST_CHECK(!well_formed_("<a x=1></a>", why0, sizeof why0));
    TEST_CHECK(!well_formed_("<a>x & y</a>", why0, sizeof why0));
    TEST_CHECK(!well_formed_("<a title=\"<b>\"></a>", why0, sizeof why0));
    TEST_CHECK(!well_formed_("<a></a></a>", why0, sizeof why0));
    snprintf(dir_, sizeof dir_, "/tmp/mtrl-report-XXXXXX");
    TEST_CHECK(mkdtemp(dir_) != NULL);
    char db[512], path[600], why[512];
    snprintf(db, sizeof db, "%s/runs.db", dir_);
    TEST_EQ_INT(make_run_("7"), 0);
    TEST_EQ_INT(make_run_("8"), 0);

    // ---- 1. one run -----------------------------------------------------------------------------
    result r = RUN("report", "--db", "runs.db", "--out", "rep");
    TEST_EQ_INT(r.rc, 0);
    TEST_CONTAINS(r.out, "rep/index.html");
    result_free_(&r);
    snprintf(path, sizeof path, "%s/rep/index.html", dir_);
    char *page = slurp_(path);
    TEST_CHECKF(well_formed_(page, why, sizeof why), "index.html is not well-formed: %s", why);
    TEST_CHECK(!strstr(page, "<script"));
    TEST_CHECK(!strstr(page, "<figure")); // the quickstart's episodes have no pictures
    TEST_CHECK(!strstr(page, "http://") || !strstr(page, "src=\"http"));
    int nm = check_series_(page, db, 2);
    long long names = q_int_(db, "SELECT count(DISTINCT name) FROM metrics WHERE run = 2");
    printf("run 2: %d metrics checked against their polylines (%lld in the store)\n", nm, names);
    TEST_EQ_INT(nm, names);
    TEST_CHECK(names >= 20);
    TEST_CHECK(polyline_(page, 2, "reward") && polyline_(page, 2, "mismatch_k3") && polyline_(page, 2, "warmup_loss"));
    TEST_CHECK(!polyline_(page, 1, "reward")); // the default is the newest run only
    TEST_CONTAINS(page, "<h3>Reward</h3>");
    TEST_CONTAINS(page, "<h3>Mismatch KL</h3>");
    TEST_CONTAINS(page, "<h3>Staleness</h3>");
    TEST_CONTAINS(page, "<pre>[run]");
    report_item19_(page, db);
    // heatmaps: one cell per (layer, expert) row and step column
    long long layers = q_int_(db, "SELECT count(DISTINCT layer) FROM experts WHERE run = 2");
    long long experts = q_int_(db, "SELECT count(DISTINCT expert) FROM experts WHERE run = 2");
    long long esteps = q_int_(db, "SELECT count(DISTINCT step) FROM experts WHERE run = 2");
    TEST_CHECK(layers > 0 && experts > 0 && esteps > 0);
    const char *kinds[] = {"load", "beta", "layer_ratio"};
    for (int k = 0; k < 3; k++) {
        char pat[64], rows[32], cols[32];
        snprintf(pat, sizeof pat, "data-kind=\"%s\" data-run=\"2\"", kinds[k]);
        const char *h = strstr(page, pat);
        TEST_CHECKF(h != NULL, "no %s heatmap", kinds[k]);
        if (!h) continue;
        while (h > page && strncmp(h, "<svg", 4)) h--;
        attr_(h, "data-rows", rows, sizeof rows);
        attr_(h, "data-cols", cols, sizeof cols);
        long long want_rows = k == 2 ? layers : layers * experts;
        TEST_EQ_INT(atoll(rows), want_rows);
        TEST_EQ_INT(atoll(cols), esteps);
        const char *end = strstr(h, "</svg>");
        size_t cells = 0;
        for (const char *p = strstr(h, "<rect class=\"cell\""); p && p < end; p = strstr(p + 1, "<rect class=\"cell\"")) cells++;
        TEST_EQ_INT(cells, want_rows * esteps);
    }
    free(page);
    snprintf(path, sizeof path, "%s/rep/metrics.csv", dir_);
    TEST_EQ_INT(lines_(path), 1 + q_int_(db, "SELECT count(*) FROM metrics WHERE run = 2"));
    char *csv = slurp_(path);
    TEST_CHECK(!strncmp(csv, "run,step,name,value\n2,", 22));
    free(csv);
    snprintf(path, sizeof path, "%s/rep/experts.csv", dir_);
    TEST_EQ_INT(lines_(path), 1 + q_int_(db, "SELECT count(*) FROM experts WHERE run = 2"));

    // ---- 2. two runs overlaid ----------------------------------------------------------------------
    r = RUN("report", "--db", "runs.db", "--run", "1", "--run", "2", "--out", "cmp");
    TEST_EQ_INT(r.rc, 0);
    result_free_(&r);
    snprintf(path, sizeof path, "%s/cmp/index.html", dir_);
    page = slurp_(path);
    TEST_CHECKF(well_formed_(page, why, sizeof why), "the comparison page is not well-formed: %s", why);
    TEST_EQ_INT(check_series_(page, db, 1), q_int_(db, "SELECT count(DISTINCT name) FROM metrics WHERE run = 1"));
    TEST_EQ_INT(check_series_(page, db, 2), names);
    TEST_CONTAINS(page, "run 1 (quickstart): reward");
    TEST_CONTAINS(page, "run 2 (quickstart): reward");
    // both runs share the reward panel
    const char *rp = strstr(page, "<h3>Reward</h3>"), *rend = rp ? strstr(rp, "</div>\n</div>") : NULL;
    const char *p1 = polyline_(page, 1, "reward"), *p2 = polyline_(page, 2, "reward");
    TEST_CHECK(rp && rend && p1 > rp && p1 < rend && p2 > rp && p2 < rend);
    free(page);
    snprintf(path, sizeof path, "%s/cmp/metrics.csv", dir_);
    TEST_EQ_INT(lines_(path), 1 + q_int_(db, "SELECT count(*) FROM metrics WHERE run IN (1, 2)"));

    // ---- 3. a long series is drawn as min/max buckets -------------------------------------------------
    char big[600];
    snprintf(big, sizeof big, "%s/big.db", dir_);
    {
        char *b = slurp_(db);
        struct stat sb;
        stat(db, &sb);
        FILE *f = fopen(big, "wb");
        fwrite(b, 1, (size_t)sb.st_size, f);
        fclose(f);
        free(b);
        snprintf(path, sizeof path, "%s-wal", db);
        if (access(path, F_OK) == 0) {
            char wal[700];
            snprintf(wal, sizeof wal, "%s-wal", big);
            b = slurp_(path);
            stat(path, &sb);
            f = fopen(wal, "wb");
            fwrite(b, 1, (size_t)sb.st_size, f);
            fclose(f);
            free(b);
        }
        sqlite3 *h;
        TEST_EQ_INT(sqlite3_open(big, &h), SQLITE_OK);
        sqlite3_exec(h, "BEGIN", NULL, NULL, NULL);
        sqlite3_stmt *st;
        sqlite3_prepare_v2(h, "INSERT INTO metrics(run, step, name, value, wall_time) VALUES (2, ?, 'long_metric', ?, 0)", -1, &st, NULL);
        for (int s = 1; s <= 5000; s++) {
            double v = sin(s * 0.01) + (s == 3333 ? 50.0 : 0.0) + (s == 1234 ? -40.0 : 0.0);
            sqlite3_bind_int(st, 1, s);
            sqlite3_bind_double(st, 2, v);
            sqlite3_step(st);
            sqlite3_reset(st);
        }
        sqlite3_finalize(st);
        TEST_EQ_INT(sqlite3_exec(h, "COMMIT", NULL, NULL, NULL), SQLITE_OK);
        sqlite3_close(h);
    }
    r = RUN("report", "--db", "big.db", "--out", "big");
    TEST_EQ_INT(r.rc, 0);
    result_free_(&r);
    snprintf(path, sizeof path, "%s/big/index.html", dir_);
    page = slurp_(path);
    TEST_CHECKF(well_formed_(page, why, sizeof why), "the big page is not well-formed: %s", why);
    const char *pl = polyline_(page, 2, "long_metric");
    TEST_CHECK(pl != NULL);
    if (pl) {
        char n[32], plotted[32], *vals = malloc(1 << 20);
        attr_(pl, "data-n", n, sizeof n);
        attr_(pl, "data-plotted", plotted, sizeof plotted);
        attr_(pl, "data-values", vals, 1 << 20);
        TEST_EQ_INT(atoll(n), 5000);
        TEST_CHECK(atoll(plotted) <= 2000 && atoll(plotted) >= 1000);
        TEST_EQ_INT(count_words_(vals), atoll(plotted));
        double mx = -1e300, mn = 1e300;
        for (char *p = vals; *p;) {
            char *e;
            double v = strtod(p, &e);
            if (e == p) break;
            p = e;
            if (v > mx) mx = v;
            if (v < mn) mn = v;
        }
        TEST_CHECKF(mx > 50 && mn < -39, "the spikes must survive downsampling: max %g min %g", mx, mn);
        free(vals);
    }
    free(page);

    // ---- 4. errors ----------------------------------------------------------------------------------
    r = RUN("report", "--db", "runs.db", "--run", "9", "--out", "x");
    TEST_EQ_INT(r.rc, 1);
    TEST_CONTAINS(r.err, "run 9 not found");
    result_free_(&r);
    r = RUN("report", "--db", "nothere.db", "--out", "x");
    TEST_EQ_INT(r.rc, 1);
    result_free_(&r);
    r = RUN("report", "--db", "runs.db");
    TEST_EQ_INT(r.rc, 2);
    result_free_(&r);
    r = RUN("report", "--out", "x");
    TEST_EQ_INT(r.rc, 2);
    result_free_(&r);
    r = RUN("report", "--db", "runs.db", "--out", "x", "--run", "abc");
    TEST_EQ_INT(r.rc, 2);
    result_free_(&r);

    test_pictures_();
    if (test_failed_ == 0) {
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir_);
        if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir_);
    } else {
        fprintf(stderr, "left %s for inspection\n", dir_);
    }
    return test_report();
}
