// report_episodes.c: example episodes and the per-tool table of `mtrl report` (see
// report_episodes.h).
#include "tools/report_episodes.h"

#include <sqlite3.h>
#include <stdio.h>
#include <string.h>

#include "common/config.h"
#include "common/log.h"
#include "common/traj.h"
#include "common/trajfile.h"
#include "tools/replay.h"
#include "tools/report_plot.h"

// Text from a model or an env (tool names, abort reasons): escaped to printable text first
// (common/log.h: control bytes, bytes that are not UTF-8), then for XML.
static void esc_text_(FILE *f, const char *s) {
    char buf[1024];
    mtrl_text_escape(buf, sizeof buf, s ? s : "", s ? strlen(s) : 0);
    report_esc(f, buf);
}

static void td_(FILE *f, const char *s) {
    fputs("<td>", f);
    esc_text_(f, s);
    fputs("</td>", f);
}

static const struct {
    const char *kind, *label, *where;
} kinds_[] = {
    {"rewarded", "rewarded", "status IN ('complete','truncated') AND reward > 0"},
    {"unrewarded", "unrewarded", "status IN ('complete','truncated') AND NOT reward > 0"},
    {"failed", "aborted or rejected", "status IN ('aborted','rejected')"},
};

// Whether the run's model takes pictures ([model] image_patch > 0 in its stored config).
static int run_has_pictures_(mtrl_store *s, int64_t run) {
    sqlite3_stmt *st;
    int yes = 0;
    if (sqlite3_prepare_v2(mtrl_store_sqlite(s), "SELECT config FROM runs WHERE id = ?1", -1, &st, NULL) != SQLITE_OK) return 0;
    sqlite3_bind_int64(st, 1, run);
    if (sqlite3_step(st) == SQLITE_ROW && sqlite3_column_type(st, 0) != SQLITE_NULL) {
        mtrl_config cfg;
        mtrl_config_errors errs = {0};
        if (mtrl_config_load_text(&cfg, "run config", (const char *)sqlite3_column_text(st, 0), NULL, 0, &errs) == MTRL_OK)
            yes = cfg.model.image_patch > 0;
        mtrl_config_errors_free(&errs);
    }
    sqlite3_finalize(st);
    return yes;
}

// The pictures of episode id (if it saw any) as PNGs beside the page, one figure each.
static int write_pictures_(FILE *f, const char *dbpath, const char *dir, int64_t run, long long id,
                           const char *stored, int64_t offset) {
    if (!stored || !stored[0] || offset < 0) return 0;
    char path[8192];
    replay_resolve_path(dbpath, stored, path, sizeof path);
    mtrl_trajfile_reader r;
    mtrl_traj_limits lim = mtrl_traj_limits_default();
    mtrl_traj t;
    mtrl_traj_init(&t);
    mtrl_error err;
    mtrl_status st = mtrl_trajfile_reader_open(&r, path, &err);
    if (st == MTRL_OK) {
        st = mtrl_trajfile_read_traj_at(&r, (uint64_t)offset, &lim, &t, &err);
        mtrl_trajfile_reader_close(&r);
    }
    int shown = 0;
    if (st != MTRL_OK) {
        fprintf(f, "<figure data-episode=\"%lld\"><figcaption>episode %lld: ", id, id);
        report_esc(f, err.msg);
        fputs("</figcaption></figure>\n", f);
        shown = 1;
    }
    for (uint32_t i = 0; st == MTRL_OK && i < t.n_images; i++) {
        const mtrl_traj_image *im = &t.images[i];
        char name[128], file[8400], why[256];
        snprintf(name, sizeof name, "ep-%lld-%lld-%u.png", (long long)run, id, i);
        snprintf(file, sizeof file, "%s/%s", dir, name);
        fprintf(f, "<figure data-episode=\"%lld\">", id);
        if (replay_png_write(file, im->rgb, im->width, im->height, why, sizeof why) == 0)
        {
            // small pictures enlarged, pixels kept sharp: the longer side shown at >= 192 px
            uint32_t side = im->width > im->height ? im->width : im->height, k = side && side < 192 ? (191 + side) / side : 1;
            fprintf(f, "<img src=\"%s\" width=\"%u\" height=\"%u\" style=\"image-rendering: pixelated\" "
                       "alt=\"picture %u of episode %lld\"/>",
                    name, k * im->width, k * im->height, i, id);
        }
        else report_esc(f, why);
        fprintf(f, "<figcaption>episode %lld, picture %u: %u x %u</figcaption></figure>\n", id, i, im->width, im->height);
        shown = 1;
    }
    mtrl_traj_free(&t);
    return shown;
}

void report_write_examples(FILE *f, mtrl_store *s, const char *dbpath, const char *dir, int64_t run) {
    sqlite3 *db = mtrl_store_sqlite(s);
    fprintf(f, "<h3 class=\"runhead\">run %lld</h3>\n", (long long)run);
    int rows = 0, n_pic = 0;
    struct { long long id; char path[4096]; int64_t offset; } pic[3 * REPORT_EXAMPLES_PER_KIND];
    for (size_t k = 0; k < sizeof kinds_ / sizeof kinds_[0]; k++) {
        char sql[512];
        snprintf(sql, sizeof sql,
                 "SELECT id, status, reward, tokens, tool_calls, step, abort_reason, traj_path, traj_offset FROM episodes "
                 "WHERE run = ?1 AND %s "
                 "ORDER BY ended DESC, id DESC LIMIT %d",
                 kinds_[k].where, REPORT_EXAMPLES_PER_KIND);
        sqlite3_stmt *st;
        if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) != SQLITE_OK) continue;
        sqlite3_bind_int64(st, 1, run);
        while (sqlite3_step(st) == SQLITE_ROW) {
            if (!rows++)
                fputs("<table class=\"examples\">\n<tr><th>kind</th><th>episode</th><th>status</th><th>reward</th><th>tokens</th>"
                      "<th>tool calls</th><th>step</th><th>reason</th><th>replay it</th></tr>\n", f);
            long long id = sqlite3_column_int64(st, 0);
            fprintf(f, "<tr data-run=\"%lld\" data-episode=\"%lld\" data-kind=\"%s\">", (long long)run, id, kinds_[k].kind);
            char buf[4400];
            td_(f, kinds_[k].label);
            snprintf(buf, sizeof buf, "%lld", id);
            td_(f, buf);
            td_(f, (const char *)sqlite3_column_text(st, 1));
            snprintf(buf, sizeof buf, "%.4g", sqlite3_column_double(st, 2));
            td_(f, sqlite3_column_type(st, 2) == SQLITE_NULL ? "-" : buf);
            snprintf(buf, sizeof buf, "%lld", (long long)sqlite3_column_int64(st, 3));
            td_(f, buf);
            snprintf(buf, sizeof buf, "%lld", (long long)sqlite3_column_int64(st, 4));
            td_(f, buf);
            snprintf(buf, sizeof buf, "%lld", (long long)sqlite3_column_int64(st, 5));
            td_(f, buf);
            td_(f, (const char *)sqlite3_column_text(st, 6));
            snprintf(buf, sizeof buf, "mtrl replay --db %s --run %lld --episode %lld", dbpath, (long long)run, id);
            fputs("<td><code>", f);
            report_esc(f, buf);
            fputs("</code></td></tr>\n", f);
            const char *tp = (const char *)sqlite3_column_text(st, 7);
            if (tp && tp[0] && n_pic < (int)(sizeof pic / sizeof pic[0])) {
                pic[n_pic].id = id;
                snprintf(pic[n_pic].path, sizeof pic[n_pic].path, "%s", tp);
                pic[n_pic].offset = sqlite3_column_type(st, 8) == SQLITE_NULL ? -1 : sqlite3_column_int64(st, 8);
                n_pic++;
            }
        }
        sqlite3_finalize(st);
    }
    if (rows) fputs("</table>\n", f);
    else fputs("<p class=\"note\">no episodes</p>\n", f);
    // Only a run whose env sends pictures has any; the others read no trajectory file.
    if (!run_has_pictures_(s, run)) return;
    for (int i = 0; i < n_pic; i++) write_pictures_(f, dbpath, dir, run, pic[i].id, pic[i].path, pic[i].offset);
}

void report_write_tools(FILE *f, mtrl_store *s, int64_t run) {
    sqlite3 *db = mtrl_store_sqlite(s);
    sqlite3_stmt *st;
    fprintf(f, "<h3 class=\"runhead\">run %lld</h3>\n", (long long)run);
    if (sqlite3_prepare_v2(db,
                           "SELECT name, count(*), coalesce(sum(error IS NOT NULL AND error <> ''), 0), avg(latency), "
                           "max(latency), avg(bytes_in), avg(bytes_out) FROM tool_calls WHERE run = ?1 GROUP BY name "
                           "ORDER BY count(*) DESC, name",
                           -1, &st, NULL) != SQLITE_OK) {
        fprintf(f, "<p class=\"note\">tool calls cannot be read: ");
        report_esc(f, sqlite3_errmsg(db));
        fputs("</p>\n", f);
        return;
    }
    sqlite3_bind_int64(st, 1, run);
    int rows = 0;
    long long other_names = 0, other_calls = 0, other_errors = 0;
    while (sqlite3_step(st) == SQLITE_ROW) {
        // A tool name is what the model wrote: past the most called, the rest are summed.
        if (rows == REPORT_TOOLS_MAX) {
            other_names++;
            other_calls += sqlite3_column_int64(st, 1);
            other_errors += sqlite3_column_int64(st, 2);
            continue;
        }
        if (!rows++)
            fputs("<table class=\"tools\">\n<tr><th>tool</th><th>calls</th><th>errors</th><th>error share</th>"
                  "<th>mean latency (ms)</th><th>max latency (ms)</th><th>mean bytes in</th><th>mean bytes out</th></tr>\n", f);
        const char *name = (const char *)sqlite3_column_text(st, 0);
        long long calls = sqlite3_column_int64(st, 1), errors = sqlite3_column_int64(st, 2);
        fputs("<tr data-tool=\"", f);
        esc_text_(f, name);
        fprintf(f, "\" data-calls=\"%lld\" data-errors=\"%lld\">", calls, errors);
        char buf[64];
        td_(f, name && name[0] ? name : "(unparsed)");
        snprintf(buf, sizeof buf, "%lld", calls);
        td_(f, buf);
        snprintf(buf, sizeof buf, "%lld", errors);
        td_(f, buf);
        snprintf(buf, sizeof buf, "%.1f%%", calls ? 100.0 * (double)errors / (double)calls : 0.0);
        td_(f, buf);
        snprintf(buf, sizeof buf, "%.3f", 1e3 * sqlite3_column_double(st, 3));
        td_(f, buf);
        snprintf(buf, sizeof buf, "%.3f", 1e3 * sqlite3_column_double(st, 4));
        td_(f, buf);
        snprintf(buf, sizeof buf, "%.1f", sqlite3_column_double(st, 5));
        td_(f, buf);
        snprintf(buf, sizeof buf, "%.1f", sqlite3_column_double(st, 6));
        td_(f, buf);
        fputs("</tr>\n", f);
    }
    sqlite3_finalize(st);
    if (other_names)
        fprintf(f, "<tr class=\"other\" data-calls=\"%lld\" data-errors=\"%lld\"><td>%lld other names</td><td>%lld</td>"
                   "<td>%lld</td><td>%.1f%%</td><td></td><td></td><td></td><td></td></tr>\n",
                other_calls, other_errors, other_names, other_calls, other_errors,
                other_calls ? 100.0 * (double)other_errors / (double)other_calls : 0.0);
    if (rows) fputs("</table>\n", f);
    else fputs("<p class=\"note\">no tool calls</p>\n", f);
}
