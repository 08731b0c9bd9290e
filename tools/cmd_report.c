// cmd_report.c: `mtrl report --db runs.db [--run ID]... --out DIR` writes one self-contained
// HTML page, DIR/index.html (inline SVG: no scripts, no network, readable offline and in any
// browser), and the data behind it as CSV (DIR/metrics.csv: run,step,name,value; DIR/experts.csv:
// run,step,layer,expert,load,bias).
//
// The page: a run summary table (status, duration, steps, episodes by status, tokens, tool
// calls, checkpoints), one panel per metric group (reward, success, losses, entropy, clip
// fractions, ratio, staleness, mismatch KL, episode length, tool calls, throughput, ...; any
// metric the learner logs that no group names gets its own panel), the MoE expert heatmaps
// (per-expert load relative to the layer mean, per-layer max/min load ratio, QB β per expert,
// over steps), each run's resolved config, and its warnings and errors. Several --run options
// overlay the runs in every panel (one colour per run, a legend). The page is well-formed XML
// (XHTML-style), so tools and tests can parse it; report_plot.h says which data-* attributes
// each plot carries.
//
// Exit codes: 0 written; 1 the database or a run cannot be read, or DIR cannot be written; 2 bad
// usage.
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <sqlite3.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/check.h"
#include "common/fsutil.h"
#include "common/store.h"
#include "common/timeutil.h"
#include "tools/cli.h"
#include "tools/report_episodes.h"
#include "tools/report_plot.h"

#define REPORT_USAGE "mtrl report --db runs.db [--run ID]... --out DIR"
#define REPORT_MAX_RUNS 8

// ---- the data of one run ------------------------------------------------------------------------

typedef struct metric_series {
    char *name;
    int64_t *steps;
    double *values;
    size_t n;
    int used;                 // drawn by a group panel
} metric_series;

typedef struct run_data {
    int64_t id;
    mtrl_store_run row;
    char *config;
    metric_series *m;
    size_t n_m;
    int64_t counts[MTRL_EP_REJECTED + 1];
    int64_t episodes, tokens, model_tokens, tool_calls, tool_errors;
    size_t n_ckpt, n_ckpt_files;
    // experts, ordered by step, layer, expert
    size_t n_exp;
    int64_t *e_step;
    int *e_layer, *e_expert;
    double *e_load, *e_bias;
} run_data;

static void run_data_free_(run_data *r) {
    free(r->config);
    for (size_t i = 0; i < r->n_m; i++) {
        free(r->m[i].name);
        free(r->m[i].steps);
        free(r->m[i].values);
    }
    free(r->m);
    free(r->e_step);
    free(r->e_layer);
    free(r->e_expert);
    free(r->e_load);
    free(r->e_bias);
}

static metric_series *metric_find_(run_data *r, const char *name) {
    for (size_t i = 0; i < r->n_m; i++)
        if (!strcmp(r->m[i].name, name)) return &r->m[i];
    return NULL;
}

static int sql_fail_(sqlite3 *db, const char *what) {
    fprintf(stderr, "mtrl report: %s: %s\n", what, sqlite3_errmsg(db));
    return 1;
}

// Returns 0, or an exit code after printing why.
static int run_load_(mtrl_store *s, const char *dbpath, int64_t id, run_data *r) {
    memset(r, 0, sizeof *r);
    r->id = id;
    mtrl_error err;
    if (mtrl_store_run_get(s, id, &r->row, &r->config, &err) != MTRL_OK) {
        if (err.code == MTRL_ERR_NOTFOUND) fprintf(stderr, "mtrl report: run %lld not found in %s\n", (long long)id, dbpath);
        else fprintf(stderr, "mtrl report: %s\n", err.msg);
        return 1;
    }
    char **names;
    size_t nn;
    if (mtrl_store_metric_names(s, id, &names, &nn, &err) != MTRL_OK) {
        fprintf(stderr, "mtrl report: %s\n", err.msg);
        return 1;
    }
    r->m = xcalloc(nn ? nn : 1, sizeof(metric_series));
    r->n_m = nn;
    for (size_t i = 0; i < nn; i++) {
        r->m[i].name = xstrdup(names[i]);
        if (mtrl_store_metric_series(s, id, names[i], &r->m[i].steps, &r->m[i].values, &r->m[i].n, &err) != MTRL_OK) {
            fprintf(stderr, "mtrl report: %s\n", err.msg);
            mtrl_store_strings_free(names, nn);
            return 1;
        }
    }
    mtrl_store_strings_free(names, nn);
    if (mtrl_store_episode_counts(s, id, r->counts, &err) != MTRL_OK) {
        fprintf(stderr, "mtrl report: %s\n", err.msg);
        return 1;
    }
    mtrl_store_checkpoint *ck;
    if (mtrl_store_checkpoints(s, id, &ck, &r->n_ckpt, &err) == MTRL_OK) {
        for (size_t i = 0; i < r->n_ckpt; i++) r->n_ckpt_files += access(ck[i].path, F_OK) == 0;
        free(ck);
    }
    sqlite3 *db = mtrl_store_sqlite(s);
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db, "SELECT count(*), coalesce(sum(tokens),0), coalesce(sum(model_tokens),0) FROM episodes WHERE run = ?",
                           -1, &st, NULL) != SQLITE_OK)
        return sql_fail_(db, "episodes");
    sqlite3_bind_int64(st, 1, id);
    if (sqlite3_step(st) == SQLITE_ROW) {
        r->episodes = sqlite3_column_int64(st, 0);
        r->tokens = sqlite3_column_int64(st, 1);
        r->model_tokens = sqlite3_column_int64(st, 2);
    }
    sqlite3_finalize(st);
    if (sqlite3_prepare_v2(db, "SELECT count(*), coalesce(sum(error IS NOT NULL AND error <> ''),0) FROM tool_calls WHERE run = ?",
                           -1, &st, NULL) != SQLITE_OK)
        return sql_fail_(db, "tool_calls");
    sqlite3_bind_int64(st, 1, id);
    if (sqlite3_step(st) == SQLITE_ROW) {
        r->tool_calls = sqlite3_column_int64(st, 0);
        r->tool_errors = sqlite3_column_int64(st, 1);
    }
    sqlite3_finalize(st);
    if (sqlite3_prepare_v2(db, "SELECT step, layer, expert, load, bias FROM experts WHERE run = ? ORDER BY step, layer, expert", -1,
                           &st, NULL) != SQLITE_OK)
        return sql_fail_(db, "experts");
    sqlite3_bind_int64(st, 1, id);
    size_t cap = 0;
    while (sqlite3_step(st) == SQLITE_ROW) {
        if (r->n_exp == cap) {
            cap = cap ? 2 * cap : 1024;
            r->e_step = xrealloc(r->e_step, sizeof(int64_t) * cap);
            r->e_layer = xrealloc(r->e_layer, sizeof(int) * cap);
            r->e_expert = xrealloc(r->e_expert, sizeof(int) * cap);
            r->e_load = xrealloc(r->e_load, sizeof(double) * cap);
            r->e_bias = xrealloc(r->e_bias, sizeof(double) * cap);
        }
        size_t k = r->n_exp++;
        r->e_step[k] = sqlite3_column_int64(st, 0);
        r->e_layer[k] = sqlite3_column_int(st, 1);
        r->e_expert[k] = sqlite3_column_int(st, 2);
        r->e_load[k] = sqlite3_column_type(st, 3) == SQLITE_NULL ? NAN : sqlite3_column_double(st, 3);
        r->e_bias[k] = sqlite3_column_type(st, 4) == SQLITE_NULL ? NAN : sqlite3_column_double(st, 4);
    }
    sqlite3_finalize(st);
    return 0;
}

// ---- CSV ----------------------------------------------------------------------------------------

static void csv_field_(FILE *f, const char *s) {
    if (!strpbrk(s, ",\"\n\r")) {
        fputs(s, f);
        return;
    }
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"') fputc('"', f);
        fputc(*s, f);
    }
    fputc('"', f);
}

static int write_csv_(const char *dir, run_data *runs, int nr) {
    char path[4096];
    snprintf(path, sizeof path, "%s/metrics.csv", dir);
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "mtrl report: %s: %s\n", path, strerror(errno));
        return 1;
    }
    fputs("run,step,name,value\n", f);
    for (int i = 0; i < nr; i++)
        for (size_t k = 0; k < runs[i].n_m; k++) {
            const metric_series *m = &runs[i].m[k];
            for (size_t j = 0; j < m->n; j++) {
                fprintf(f, "%lld,%lld,", (long long)runs[i].id, (long long)m->steps[j]);
                csv_field_(f, m->name);
                if (isfinite(m->values[j])) fprintf(f, ",%.17g\n", m->values[j]);
                else fputs(",\n", f);
            }
        }
    if (fclose(f) != 0) {
        fprintf(stderr, "mtrl report: %s: %s\n", path, strerror(errno));
        return 1;
    }
    snprintf(path, sizeof path, "%s/experts.csv", dir);
    f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "mtrl report: %s: %s\n", path, strerror(errno));
        return 1;
    }
    fputs("run,step,layer,expert,load,bias\n", f);
    for (int i = 0; i < nr; i++)
        for (size_t k = 0; k < runs[i].n_exp; k++) {
            const run_data *r = &runs[i];
            fprintf(f, "%lld,%lld,%d,%d,", (long long)r->id, (long long)r->e_step[k], r->e_layer[k], r->e_expert[k]);
            if (isfinite(r->e_load[k])) fprintf(f, "%.17g", r->e_load[k]);
            fputc(',', f);
            if (isfinite(r->e_bias[k])) fprintf(f, "%.17g", r->e_bias[k]);
            fputc('\n', f);
        }
    if (fclose(f) != 0) {
        fprintf(stderr, "mtrl report: %s: %s\n", path, strerror(errno));
        return 1;
    }
    return 0;
}

// ---- panels -------------------------------------------------------------------------------------

typedef struct panel_def {
    const char *title;
    const char *note;
    const char *names[6];     // metric names; a name ending in '.' matches every "name.<suffix>"
} panel_def;

static const panel_def panels_[] = {
    {"Reward", "mean final reward of the step's episodes", {"reward"}},
    {"Success rate", "fraction of the step's episodes with the full reward (1)", {"success"}},
    {"Loss", "total loss and its policy-gradient term", {"loss", "pg_loss"}},
    {"Entropy", "mean policy entropy over model tokens (nats)", {"entropy"}},
    {"Clip fractions", "model tokens whose gradient the clip removed", {"clip_low", "clip_high", "clip_dual"}},
    {"Importance ratio", "mean ratio the loss used", {"ratio"}},
    {"Staleness", "weight versions between a token's and the learner's", {"staleness_mean", "staleness_max"}},
    {"Mismatch KL", "learner vs behaviour log-probs over model tokens: k1 = mean(logp_behav - logp), k3 >= 0",
     {"mismatch_k1", "mismatch_k3"}},
    {"Mismatch |Δ log p|", "mean |learner - behaviour| log-prob", {"mismatch_absdiff"}},
    {"Episode length", "mean tokens per trained episode", {"episode_len"}},
    {"Tool calls", "mean tool calls per trained episode", {"tool_calls"}},
    {"Throughput (tokens/s)", "tokens_per_s: episodes' tokens over run time; learner: trained tokens over step time",
     {"tokens_per_s", "learner_tokens_per_s"}},
    {"Episodes per second", NULL, {"episodes_per_s"}},
    {"Episodes per step", "episodes trained at each step", {"episodes"}},
    {"Gradient norm", "before clipping", {"grad_norm"}},
    {"Step time (s)", "step: the learner's training step; cycle: from the previous step's end (its wait for episodes included)",
     {"step_seconds", "cycle_seconds"}},
    {"Publish time (s)", "new weights to the actors: all of it, and serialising them", {"publish_seconds", "publish_serialise_seconds"}},
    {"MoE load violation", "max expert load over the mean, minus 1, per MoE layer and the worst", {"max_violation", "max_violation."}},
    {"Dropped and failed episodes", "cumulative counts", {"stale_dropped", "groups_dropped", "stage_dropped", "episodes_aborted", "episodes_rejected"}},
    {"Masked fraction", "model tokens dropped by seq_mask", {"masked_frac"}},
    {"Weight version", NULL, {"version"}},
    {"Curriculum stage", "the [stage.N] the step was in, and its episode token budget", {"stage", "context"}},
    {"Reward per stage", "mean reward of the steps of each [stage.N]", {"reward.stage."}},
    {"QB actor batches", "decode batches whose routing the actors reported for the step's QB update", {"qb_actor_batches"}},
    {"Warm-up loss", "supervised warm-up on the env's demonstrations (negative steps)", {"warmup_loss"}},
    {"Learner time (s)", "the cycle since the previous step, by part (learner/perf.h)",
     {"learner_wall_seconds", "learner_train_seconds", "learner_wait_seconds", "learner_publish_seconds",
      "learner_checkpoint_seconds", "learner_other_seconds"}},
    {"Learner busy", "(train + publish + checkpoint) / wall of the cycle", {"learner_busy"}},
    {"Actor time (s)", "the actors' reports that arrived in the cycle, summed, by part",
     {"actor_wall_seconds", "actor_prefill_seconds", "actor_decode_seconds", "actor_tools_seconds",
      "actor_wait_seconds", "actor_other_seconds"}},
    {"Tokens per cycle", "generated: MODEL tokens of the episodes committed; trained: through forward + backward",
     {"generated_tokens", "trained_tokens", "actor_prefill_tokens", "actor_decode_tokens"}},
    {"Episodes and decode steps per cycle", NULL, {"episodes_committed", "actor_decode_steps"}},
    {"RL totals", "a sitting's totals from the end of the warm-up, at its last step (mtrl bench rl prints them)", {"rl."}},
};
#define N_PANELS ((int)(sizeof panels_ / sizeof panels_[0]))

// Panels of fractions (values in 0..1): their y axis spans 0..1 whatever the data, so a run
// with no clipping reads as 0 of 1, not as a line in the middle of -1..1.
static const char *const fraction_panels_[] = {"Success rate", "Clip fractions", "Masked fraction", "Learner busy"};

static int fraction_panel_(const char *title) {
    for (size_t i = 0; i < sizeof fraction_panels_ / sizeof fraction_panels_[0]; i++)
        if (!strcmp(fraction_panels_[i], title)) return 1;
    return 0;
}

static const char *palette_[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"};
static const char *dashes_[] = {"", "7 3", "2 3", "9 3 2 3", "4 4", "1 2"};

static int name_matches_(const char *pat, const char *name) {
    size_t n = strlen(pat);
    if (n && pat[n - 1] == '.') return !strncmp(pat, name, n) && name[n];
    return !strcmp(pat, name);
}

static void add_series_(report_series **s, size_t *ns, size_t *cap, const run_data *r, int ri, int nr,
                        const metric_series *m, int mi) {
    if (*ns == *cap) {
        *cap = *cap ? 2 * *cap : 8;
        *s = xrealloc(*s, sizeof **s * *cap);
    }
    report_series *q = &(*s)[(*ns)++];
    memset(q, 0, sizeof *q);
    if (nr == 1) {
        snprintf(q->label, sizeof q->label, "%s", m->name);
        q->color = palette_[mi % 8];
        q->dash = dashes_[mi % 6]; // curves that coincide (loss = pg_loss) stay visible
    } else {
        snprintf(q->label, sizeof q->label, "run %lld (%s): %s", (long long)r->id, r->row.name, m->name);
        q->color = palette_[ri % 8];
        q->dash = dashes_[mi % 6];
    }
    q->run = r->id;
    snprintf(q->metric, sizeof q->metric, "%s", m->name);
    q->n = m->n;
    q->x = m->steps;
    q->y = m->values;
}

static void write_panels_(FILE *f, run_data *runs, int nr) {
    fputs("<h2 id=\"training\">Training</h2>\n<div class=\"grid\">\n", f);
    report_series *s = NULL;
    size_t cap = 0;
    for (int p = 0; p < N_PANELS; p++) {
        size_t ns = 0;
        // the metric names of this panel over all runs, in a stable order
        char *names[64];
        int nn = 0;
        for (int k = 0; k < 6 && panels_[p].names[k]; k++)
            for (int i = 0; i < nr; i++)
                for (size_t j = 0; j < runs[i].n_m; j++) {
                    const char *nm = runs[i].m[j].name;
                    if (!name_matches_(panels_[p].names[k], nm)) continue;
                    int seen = 0;
                    for (int q = 0; q < nn; q++) seen |= !strcmp(names[q], nm);
                    if (!seen && nn < 64) names[nn++] = runs[i].m[j].name;
                }
        if (nn == 0) continue;
        for (int q = 0; q < nn; q++)
            for (int i = 0; i < nr; i++) {
                metric_series *m = metric_find_(&runs[i], names[q]);
                if (!m) continue;
                m->used = 1;
                add_series_(&s, &ns, &cap, &runs[i], i, nr, m, q);
            }
        int frac = fraction_panel_(panels_[p].title);
        report_line_panel_y(f, panels_[p].title, panels_[p].note, s, ns, frac ? 0 : NAN, frac ? 1 : NAN);
    }
    // anything the groups do not name
    for (int i = 0; i < nr; i++)
        for (size_t j = 0; j < runs[i].n_m; j++) {
            if (runs[i].m[j].used) continue;
            const char *nm = runs[i].m[j].name;
            size_t ns = 0;
            for (int k = 0; k < nr; k++) {
                metric_series *m = metric_find_(&runs[k], nm);
                if (!m) continue;
                m->used = 1;
                add_series_(&s, &ns, &cap, &runs[k], k, nr, m, 0);
            }
            // a readable title ("cycle_seconds": "Cycle seconds"); the note names the metric
            char title[128], note[192];
            snprintf(title, sizeof title, "%s", nm);
            for (char *c = title; *c; c++)
                if (*c == '_' || *c == '.') *c = ' ';
            if (title[0] >= 'a' && title[0] <= 'z') title[0] = (char)(title[0] - 'a' + 'A');
            snprintf(note, sizeof note, "metric %s", nm);
            report_line_panel(f, title, note, s, ns);
        }
    free(s);
    fputs("</div>\n", f);
}

// ---- expert heatmaps ----------------------------------------------------------------------------

static void write_experts_(FILE *f, const run_data *r) {
    if (r->n_exp == 0) {
        fprintf(f, "<p class=\"note\">run %lld: no expert statistics (a dense model, or no RL step yet)</p>\n", (long long)r->id);
        return;
    }
    // shape: distinct steps, max layer, max expert
    int64_t *steps = xmalloc(sizeof(int64_t) * r->n_exp);
    size_t C = 0;
    int maxl = 0, maxe = 0, minl = r->e_layer[0];
    for (size_t k = 0; k < r->n_exp; k++) {
        if (C == 0 || steps[C - 1] != r->e_step[k]) steps[C++] = r->e_step[k];
        if (r->e_layer[k] > maxl) maxl = r->e_layer[k];
        if (r->e_layer[k] < minl) minl = r->e_layer[k];
        if (r->e_expert[k] > maxe) maxe = r->e_expert[k];
    }
    int NL = maxl - minl + 1, E = maxe + 1;
    size_t R = (size_t)NL * (size_t)E;
    double *load = xmalloc(sizeof(double) * R * C), *beta = xmalloc(sizeof(double) * R * C);
    for (size_t i = 0; i < R * C; i++) load[i] = beta[i] = NAN;
    size_t c = 0;
    for (size_t k = 0; k < r->n_exp; k++) {
        while (steps[c] != r->e_step[k]) c++;
        size_t row = (size_t)(r->e_layer[k] - minl) * E + (size_t)r->e_expert[k];
        load[row * C + c] = r->e_load[k];
        beta[row * C + c] = r->e_bias[k];
    }
    // per-expert load over the layer's mean (log2, clamped to ±2), per-layer max/min ratio
    double *ratio = xmalloc(sizeof(double) * R * C), *mm = xmalloc(sizeof(double) * (size_t)NL * C);
    for (int l = 0; l < NL; l++)
        for (size_t j = 0; j < C; j++) {
            double sum = 0, mx = -INFINITY, mn = INFINITY;
            int n = 0;
            for (int e = 0; e < E; e++) {
                double v = load[((size_t)l * E + e) * C + j];
                if (!isfinite(v)) continue;
                sum += v;
                n++;
                if (v > mx) mx = v;
                if (v < mn) mn = v;
            }
            double mean = n ? sum / n : NAN;
            for (int e = 0; e < E; e++) {
                double v = load[((size_t)l * E + e) * C + j];
                double q = isfinite(v) && mean > 0 ? log2(v / mean) : NAN;
                if (isfinite(q) || (isinf(q) && q < 0)) q = fmax(-1.0, fmin(1.0, q));
                ratio[((size_t)l * E + e) * C + j] = q;
            }
            mm[(size_t)l * C + j] = !n || mx <= 0 ? NAN : mn > 0 ? fmin(mx / mn, 8.0) : 8.0;
        }
    double bmax = 0;
    for (size_t i = 0; i < R * C; i++)
        if (isfinite(beta[i]) && fabs(beta[i]) > bmax) bmax = fabs(beta[i]);
    char (*labels)[32] = xcalloc(R, sizeof *labels);
    char (*llabels)[32] = xcalloc((size_t)NL, sizeof *llabels);
    int *group = xmalloc(sizeof(int) * R);
    for (size_t i = 0; i < R; i++) {
        snprintf(labels[i], sizeof labels[i], "L%d e%d", (int)(i / E) + minl, (int)(i % E));
        group[i] = (int)(i / E);
    }
    for (int l = 0; l < NL; l++) snprintf(llabels[l], sizeof llabels[l], "layer %d", l + minl);
    double mm_max = 1;
    for (size_t i = 0; i < (size_t)NL * C; i++)
        if (isfinite(mm[i]) && mm[i] > mm_max) mm_max = mm[i];
    if (mm_max < 1.5) mm_max = 1.5;
    char title[512], note[512], top[32];
    snprintf(top, sizeof top, mm_max >= 8 ? "%.3g (or idle)" : "%.3g", mm_max);
    fprintf(f, "<h3 class=\"runhead\">run %lld (", (long long)r->id);
    report_esc(f, r->row.name);
    fprintf(f, "): %d MoE layers × %d experts, %zu steps</h3>\n", NL, E, C);
    snprintf(title, sizeof title, "Run %lld: max/min expert load per layer", (long long)r->id);
    report_heat h = {title, "1 = every expert of the layer got the same number of tokens; capped at 8 (an idle expert shows as 8)",
                     "layer_ratio", r->id, (size_t)NL, C, mm, llabels, NULL, steps, REPORT_SCALE_SEQ, 1.0, mm_max, 0, "1", top};
    report_heatmap(f, &h);
    if (R <= 1024) {
        snprintf(title, sizeof title, "Run %lld: expert load relative to the layer mean", (long long)r->id);
        snprintf(note, sizeof note, "per step, each expert's routed tokens over the mean of its layer (log scale, clamped at 2× and ½×)");
        report_heat h2 = {title, note, "load", r->id, R, C, ratio, labels, group, steps, REPORT_SCALE_DIV, -1, 1, 0,
                          "≤ ½ mean", "≥ 2× mean"};
        report_heatmap(f, &h2);
        snprintf(title, sizeof title, "Run %lld: QB bias β per expert", (long long)r->id);
        snprintf(note, sizeof note, "Quantile Balancing β after each step (routing uses score − β); max |β| = %.3g", bmax);
        report_heat h3 = {title, note, "beta", r->id, R, C, beta, labels, group, steps, REPORT_SCALE_DIV,
                          -(bmax > 0 ? bmax : 1), bmax > 0 ? bmax : 1, 0, NULL, NULL};
        report_heatmap(f, &h3);
    } else {
        fprintf(f, "<p class=\"note\">%zu experts in all: per-expert maps left out (experts.csv has every cell)</p>\n", R);
    }
    free(labels);
    free(llabels);
    free(group);
    free(ratio);
    free(mm);
    free(load);
    free(beta);
    free(steps);
}

// ---- the page -----------------------------------------------------------------------------------

static void fmt_dur_(double s, char *out, size_t cap) {
    if (!(s >= 0)) snprintf(out, cap, "-");
    else if (s < 120) snprintf(out, cap, "%.1f s", s);
    else if (s < 7200) snprintf(out, cap, "%.1f min", s / 60);
    else snprintf(out, cap, "%.2f h", s / 3600);
}

static void td_(FILE *f, const char *s) {
    fputs("<td>", f);
    report_esc(f, s);
    fputs("</td>", f);
}

static void write_summary_(FILE *f, run_data *runs, int nr) {
    fputs("<h2 id=\"runs\">Runs</h2>\n<table class=\"summary\">\n<tr><th></th>", f);
    for (int i = 0; i < nr; i++) {
        fprintf(f, "<th><span class=\"swatch\" style=\"background:%s\"></span>run %lld</th>", palette_[i % 8],
                (long long)runs[i].id);
    }
    fputs("</tr>\n", f);
    char buf[512];
#define ROW_(label, ...)                                                                                               \
    do {                                                                                                               \
        fputs("<tr><th>" label "</th>", f);                                                                            \
        for (int i = 0; i < nr; i++) {                                                                                 \
            run_data *r = &runs[i];                                                                                    \
            (void)r;                                                                                                   \
            snprintf(buf, sizeof buf, __VA_ARGS__);                                                                    \
            td_(f, buf);                                                                                               \
        }                                                                                                              \
        fputs("</tr>\n", f);                                                                                           \
    } while (0)
    ROW_("name", "%s", r->row.name);
    ROW_("status", "%s", mtrl_run_status_name(r->row.status));
    fputs("<tr><th>started</th>", f);
    for (int i = 0; i < nr; i++) {
        mtrl_time_utc(runs[i].row.started, buf, (int)sizeof buf);
        td_(f, buf);
    }
    fputs("</tr>\n<tr><th>duration</th>", f);
    for (int i = 0; i < nr; i++) {
        const run_data *r = &runs[i];
        double end = r->row.ended > 0 ? r->row.ended : (double)time(NULL);
        fmt_dur_(end - r->row.started, buf, sizeof buf);
        if (r->row.ended <= 0) strncat(buf, " (no end recorded)", sizeof buf - strlen(buf) - 1);
        td_(f, buf);
    }
    fputs("</tr>\n", f);
    fputs("<tr><th>steps</th>", f);
    for (int i = 0; i < nr; i++) {
        run_data *r = &runs[i];
        int64_t rl = 0, wu = 0;
        for (size_t k = 0; k < r->n_m; k++)
            for (size_t j = 0; j < r->m[k].n; j++) {
                if (r->m[k].steps[j] > rl) rl = r->m[k].steps[j];
                if (!strcmp(r->m[k].name, "warmup_loss")) wu++;
            }
        if (wu) snprintf(buf, sizeof buf, "%lld RL + %lld warm-up", (long long)rl, (long long)wu);
        else snprintf(buf, sizeof buf, "%lld", (long long)rl);
        td_(f, buf);
    }
    fputs("</tr>\n", f);
    ROW_("episodes", "%lld", (long long)r->episodes);
    ROW_("by status", "%lld complete, %lld truncated, %lld aborted, %lld rejected", (long long)r->counts[MTRL_EP_COMPLETE],
         (long long)r->counts[MTRL_EP_TRUNCATED], (long long)r->counts[MTRL_EP_ABORTED], (long long)r->counts[MTRL_EP_REJECTED]);
    ROW_("tokens", "%lld (%lld model)", (long long)r->tokens, (long long)r->model_tokens);
    ROW_("tool calls", "%lld (%lld with an error)", (long long)r->tool_calls, (long long)r->tool_errors);
    fputs("<tr><th>final reward</th>", f);
    for (int i = 0; i < nr; i++) {
        metric_series *m = metric_find_(&runs[i], "reward");
        if (m && m->n) snprintf(buf, sizeof buf, "%.4g (step %lld)", m->values[m->n - 1], (long long)m->steps[m->n - 1]);
        else snprintf(buf, sizeof buf, "-");
        td_(f, buf);
    }
    fputs("</tr>\n", f);
    ROW_("checkpoints", "%zu (%zu files retained)", r->n_ckpt, r->n_ckpt_files);
    ROW_("host", "%s", r->row.host);
    ROW_("git revision", "%s", r->row.git_rev[0] ? r->row.git_rev : "-");
    ROW_("config hash", "%s", r->row.config_hash);
#undef ROW_
    fputs("</table>\n", f);
}

// The value of series m at `step` (NAN without one; the steps are ascending).
static double metric_at_(const metric_series *m, int64_t step) {
    if (!m) return NAN;
    size_t lo = 0, hi = m->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (m->steps[mid] < step) lo = mid + 1;
        else hi = mid;
    }
    return lo < m->n && m->steps[lo] == step ? m->values[lo] : NAN;
}

// Whether any run climbed a [stage.N] ladder (the learner logs metric `stage`).
static int has_ladder_(run_data *runs, int nr) {
    for (int i = 0; i < nr; i++)
        if (metric_find_(&runs[i], "stage")) return 1;
    return 0;
}

// Runs with a [stage.N] ladder: one row per stage, over the steps the learner logged in it
// (metric `stage`): context, steps, mean reward and success, mean trained episode, learner time.
static void write_ladder_(FILE *f, run_data *runs, int nr) {
    if (!has_ladder_(runs, nr)) return;
    fputs("<h2 id=\"ladder\">Context ladder</h2>\n<table class=\"summary\">\n<tr><th>run</th><th>stage</th><th>context</th>"
          "<th>steps</th><th>reward</th><th>success</th><th>mean trained episode</th><th>learner s per step</th></tr>\n",
          f);
    static const char *cols[] = {"context", "reward", "success", "episode_len", "step_seconds"};
    for (int i = 0; i < nr; i++) {
        run_data *r = &runs[i];
        metric_series *st = metric_find_(r, "stage"), *c[5];
        if (!st) continue;
        for (int k = 0; k < 5; k++) c[k] = metric_find_(r, cols[k]);
        int max_stage = 0;
        for (size_t j = 0; j < st->n; j++)
            if ((int)st->values[j] > max_stage) max_stage = (int)st->values[j];
        for (int s = 1; s <= max_stage; s++) {
            double sum[5] = {0}, ctx = 0;
            long n[5] = {0}, steps = 0;
            for (size_t j = 0; j < st->n; j++) {
                if ((int)st->values[j] != s) continue;
                steps++;
                for (int k = 0; k < 5; k++) {
                    double v = metric_at_(c[k], st->steps[j]);
                    if (v == v) sum[k] += v, n[k]++;
                    if (k == 0 && v > ctx) ctx = v;
                }
            }
            if (!steps) continue;
            char buf[64];
            fprintf(f, "<tr><td><span class=\"swatch\" style=\"background:%s\"></span>run %lld</td><td>%d</td>", palette_[i % 8],
                    (long long)r->id, s);
            snprintf(buf, sizeof buf, "%.0f", ctx);
            td_(f, n[0] ? buf : "-");
            snprintf(buf, sizeof buf, "%ld", steps);
            td_(f, buf);
            static const char *fmt[5] = {"", "%.3f", "%.3f", "%.0f tokens", "%.1f"};
            for (int k = 1; k < 5; k++) {
                snprintf(buf, sizeof buf, fmt[k], n[k] ? sum[k] / (double)n[k] : 0.0);
                td_(f, n[k] ? buf : "-");
            }
            fputs("</tr>\n", f);
        }
    }
    fputs("</table>\n", f);
}

static void write_events_(FILE *f, mtrl_store *s, const run_data *r) {
    sqlite3 *db = mtrl_store_sqlite(s);
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db,
                           "SELECT time, level, message FROM events WHERE run = ? AND level IN ('warn','error') "
                           "ORDER BY time LIMIT 200",
                           -1, &st, NULL) != SQLITE_OK)
        return;
    sqlite3_bind_int64(st, 1, r->id);
    int n = 0;
    while (sqlite3_step(st) == SQLITE_ROW) {
        if (!n++) {
            fprintf(f, "<h3 class=\"runhead\">run %lld</h3>\n<table class=\"events\">\n<tr><th>time</th><th>level</th><th>message</th></tr>\n",
                    (long long)r->id);
        }
        char t[64];
        mtrl_time_utc(sqlite3_column_double(st, 0), t, (int)sizeof t);
        const char *lv = (const char *)sqlite3_column_text(st, 1), *msg = (const char *)sqlite3_column_text(st, 2);
        fprintf(f, "<tr class=\"%s\">", lv && !strcmp(lv, "error") ? "error" : "warn");
        td_(f, t);
        td_(f, lv ? lv : "");
        td_(f, msg ? msg : "");
        fputs("</tr>\n", f);
    }
    sqlite3_finalize(st);
    if (n) fputs("</table>\n", f);
    else fprintf(f, "<p class=\"note\">run %lld: no warnings or errors</p>\n", (long long)r->id);
}

static const char css_[] =
    "body{font:14px/1.4 system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;color:#222;margin:24px 32px;"
    "background:#fff;max-width:1340px}\n"
    "h1{font-size:24px;margin:0 0 4px}h2{font-size:19px;margin:28px 0 10px;border-bottom:1px solid #ddd;padding-bottom:4px}\n"
    "h3{font-size:14px;margin:0 0 2px}h3.runhead{margin:14px 0 6px}\n"
    ".sub{color:#666;margin:0 0 10px}.note{color:#666;font-size:12px;margin:0 0 4px}\n"
    ".grid{display:flex;flex-wrap:wrap;gap:14px}\n"
    ".panel{border:1px solid #e3e3e3;border-radius:6px;padding:10px 12px;width:622px;background:#fcfcfc}\n"
    ".panel.wide{width:auto;margin-bottom:12px}\n"
    "svg text{font:11px system-ui,Helvetica,Arial,sans-serif;fill:#444}\n"
    "svg .yt{text-anchor:end}svg .xt{text-anchor:middle}svg .xl{text-anchor:end;fill:#888}svg .cb{fill:#444}\n"
    "svg .frame{fill:#fff;stroke:#bbb}svg .grid{stroke:#eee}svg .sep{stroke:#fff;stroke-width:1.5}\n"
    "svg .series{fill:none;stroke-width:1.8;stroke-linejoin:round}svg .empty{fill:#999}\n"
    ".legend{font-size:12px;margin-top:2px}.key{margin-right:14px;white-space:nowrap}.key svg{vertical-align:middle;margin-right:4px}\n"
    "table{border-collapse:collapse;font-size:13px}th,td{border:1px solid #e0e0e0;padding:3px 8px;text-align:left;vertical-align:top}\n"
    "table.summary th{background:#f6f6f6}.swatch{display:inline-block;width:10px;height:10px;margin-right:5px;border-radius:2px}\n"
    "tr.error td{color:#b2182b}tr.warn td{color:#8a5a00}\n"
    "pre{background:#f7f7f7;border:1px solid #e3e3e3;padding:8px;max-height:340px;overflow:auto;font-size:12px}\n"
    "nav a{margin-right:12px}code{font-size:12px;background:#f4f4f4;padding:0 3px}\n";

static int write_page_(const char *dir, const char *dbpath, mtrl_store *s, run_data *runs, int nr) {
    char path[4096], tmp[4200];
    snprintf(path, sizeof path, "%s/index.html", dir);
    FILE *f = mtrl_file_atomic_begin(path, tmp, sizeof tmp);
    if (!f) {
        fprintf(stderr, "mtrl report: %s: %s\n", tmp, strerror(errno));
        return 1;
    }
    fputs("<!DOCTYPE html>\n<html xmlns=\"http://www.w3.org/1999/xhtml\" lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n<title>mtrl report: ",
          f);
    for (int i = 0; i < nr; i++) {
        if (i) fputs(", ", f);
        fprintf(f, "run %lld ", (long long)runs[i].id);
        report_esc(f, runs[i].row.name);
    }
    fprintf(f, "</title>\n<style>\n%s</style>\n</head>\n<body>\n<h1>mtrl report</h1>\n<p class=\"sub\">", css_);
    report_esc(f, dbpath);
    char now[64];
    mtrl_time_utc((double)time(NULL), now, (int)sizeof now);
    fprintf(f, " · %d run%s · generated %s · data: <a href=\"metrics.csv\">metrics.csv</a>, <a href=\"experts.csv\">experts.csv</a></p>\n",
            nr, nr == 1 ? "" : "s", now);
    fprintf(f, "<nav><a href=\"#runs\">runs</a>%s<a href=\"#training\">training</a><a href=\"#episodes\">episodes</a>"
               "<a href=\"#tools\">tools</a><a href=\"#experts\">experts</a>"
               "<a href=\"#config\">config</a><a href=\"#events\">events</a></nav>\n",
            has_ladder_(runs, nr) ? "<a href=\"#ladder\">ladder</a>" : "");
    write_summary_(f, runs, nr);
    write_ladder_(f, runs, nr);
    write_panels_(f, runs, nr);
    fputs("<h2 id=\"episodes\">Example episodes</h2>\n", f);
    for (int i = 0; i < nr; i++) report_write_examples(f, s, dbpath, dir, runs[i].id);
    fputs("<h2 id=\"tools\">Tools</h2>\n", f);
    for (int i = 0; i < nr; i++) report_write_tools(f, s, runs[i].id);
    fputs("<h2 id=\"experts\">Experts</h2>\n", f);
    for (int i = 0; i < nr; i++) write_experts_(f, &runs[i]);
    fputs("<h2 id=\"config\">Configuration</h2>\n", f);
    for (int i = 0; i < nr; i++) {
        fprintf(f, "<h3 class=\"runhead\">run %lld (", (long long)runs[i].id);
        report_esc(f, runs[i].row.name);
        fputs(")</h3>\n<pre>", f);
        report_esc(f, runs[i].config ? runs[i].config : "(no config stored)");
        fputs("</pre>\n", f);
    }
    fputs("<h2 id=\"events\">Warnings and errors</h2>\n", f);
    for (int i = 0; i < nr; i++) write_events_(f, s, &runs[i]);
    fputs("</body>\n</html>\n", f);
    if (mtrl_file_atomic_end(f, tmp, path, 0)) {
        fprintf(stderr, "mtrl report: %s: %s\n", path, strerror(errno));
        return 1;
    }
    return 0;
}

int cmd_report(int argc, char **argv) {
    const char *db = NULL, *out = NULL;
    int64_t ids[REPORT_MAX_RUNS];
    int nr = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (cli_is_help(a)) {
            printf("usage: %s\n\n"
                   "Writes DIR/index.html (one self-contained page: inline SVG, no scripts, no network) with\n"
                   "the run summary, every metric over steps, expert load and QB β heatmaps, the config and\n"
                   "the warnings, plus DIR/metrics.csv and DIR/experts.csv. --run may be given up to %d times to\n"
                   "overlay runs (default: the newest run).\n",
                   REPORT_USAGE, REPORT_MAX_RUNS);
            return 0;
        }
        if (!strcmp(a, "--db")) {
            if (i + 1 >= argc) return cli_usage_error("report", REPORT_USAGE, "--db needs a file");
            db = argv[++i];
        } else if (!strcmp(a, "--out")) {
            if (i + 1 >= argc) return cli_usage_error("report", REPORT_USAGE, "--out needs a directory");
            out = argv[++i];
        } else if (!strcmp(a, "--run")) {
            char *end;
            if (i + 1 >= argc) return cli_usage_error("report", REPORT_USAGE, "--run needs a run id");
            errno = 0;
            long long v = strtoll(argv[i + 1], &end, 10);
            if (errno || *end || v <= 0) return cli_usage_error("report", REPORT_USAGE, "--run needs a run id, not '%s'", argv[i + 1]);
            if (nr == REPORT_MAX_RUNS) return cli_usage_error("report", REPORT_USAGE, "at most %d runs", REPORT_MAX_RUNS);
            ids[nr++] = v;
            i++;
        } else {
            return cli_usage_error("report", REPORT_USAGE, "unknown option '%s'", a);
        }
    }
    if (!db) return cli_usage_error("report", REPORT_USAGE, "--db is required");
    if (!out) return cli_usage_error("report", REPORT_USAGE, "--out is required");
    if (access(db, F_OK) != 0) {
        fprintf(stderr, "mtrl report: %s: %s\n", db, strerror(errno));
        return 1;
    }
    mtrl_store *s;
    mtrl_error err;
    if (mtrl_store_open(&s, db, 1, &err) != MTRL_OK) {
        fprintf(stderr, "mtrl report: %s\n", err.msg);
        return 1;
    }
    if (nr == 0) {
        if (mtrl_store_run_latest(s, &ids[0], &err) != MTRL_OK) {
            fprintf(stderr, "mtrl report: %s has no runs\n", db);
            mtrl_store_close(s);
            return 1;
        }
        nr = 1;
    }
    run_data runs[REPORT_MAX_RUNS];
    int rc = 0, loaded = 0;
    for (int i = 0; i < nr && !rc; i++) {
        rc = run_load_(s, db, ids[i], &runs[i]);
        loaded = i + 1;
    }
    if (!rc && mtrl_mkdir_p(out) != 0) {
        fprintf(stderr, "mtrl report: %s: cannot create: %s\n", out, strerror(errno));
        rc = 1;
    }
    if (!rc) rc = write_csv_(out, runs, nr);
    if (!rc) rc = write_page_(out, db, s, runs, nr);
    if (!rc) {
        size_t pts = 0;
        for (int i = 0; i < nr; i++)
            for (size_t k = 0; k < runs[i].n_m; k++) pts += runs[i].m[k].n;
        printf("mtrl report: %s/index.html: %d run%s, %zu metric points; CSV in %s/metrics.csv and %s/experts.csv\n", out, nr,
               nr == 1 ? "" : "s", pts, out, out);
    }
    for (int i = 0; i < loaded; i++) run_data_free_(&runs[i]);
    mtrl_store_close(s);
    return rc;
}
