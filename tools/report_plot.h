// report_plot.h: inline-SVG line panels and heatmaps for `mtrl report` (tools/cmd_report.c).
//
// Everything is written as well-formed XML (every element closed, attributes quoted, text
// escaped), so the page is checkable with a tag-balance check and opens in any browser without
// scripts or network. Each series is one <polyline class="series"> carrying what it plots:
//     data-run, data-metric, data-n (finite points of the series), data-plotted (points drawn),
//     data-steps and data-values (the drawn points, space-separated)
// A series of more than REPORT_MAX_POINTS finite points is drawn as min/max buckets (for each of
// REPORT_MAX_POINTS/2 consecutive slices, its minimum and maximum in step order), so a big run
// keeps its spikes at a bounded size. NaN values (NULL in the store) are skipped.
#ifndef MTRL_TOOLS_REPORT_PLOT_H
#define MTRL_TOOLS_REPORT_PLOT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define REPORT_MAX_POINTS 2000

// Writes s with &, <, >, " and ' escaped (and control bytes other than \n and \t dropped).
void report_esc(FILE *f, const char *s);

// "Nice" axis ticks (Heckbert): a step of 1, 2 or 5 × 10^k covering [lo, hi] with about
// `want` ticks. *t0 is the first tick (<= lo), *step the spacing, return value the tick count.
// integer = 1 keeps the step >= 1 (axis of steps).
int report_nice_ticks(double lo, double hi, int want, int integer, double *t0, double *step);
// A tick label for value v on an axis whose tick spacing is step (no "-0", no float noise).
void report_tick_label(double v, double step, char *out, size_t cap);

typedef struct report_series {
    char label[640];         // legend text
    const char *color;       // CSS colour
    const char *dash;        // stroke-dasharray or "" for solid
    int64_t run;
    char metric[128];
    size_t n;                // points
    const int64_t *x;        // (n) steps, ascending
    const double *y;         // (n) values (NaN = missing)
} report_series;

// One panel: a titled SVG line chart of the series over steps, with axes, nice ticks, a grid,
// markers when few points are drawn, and an HTML legend below it.
void report_line_panel(FILE *f, const char *title, const char *note, const report_series *s, size_t ns);
// The same with a y axis that spans at least y_lo..y_hi (e.g. 0..1 for a fraction, whatever the
// data; a bound that is NaN follows the data).
void report_line_panel_y(FILE *f, const char *title, const char *note, const report_series *s, size_t ns, double y_lo,
                         double y_hi);

typedef enum report_scale {
    REPORT_SCALE_SEQ = 0,    // vmin..vmax, light to dark
    REPORT_SCALE_DIV = 1,    // diverging around `center`: blue below, red above, white at center
} report_scale;

typedef struct report_heat {
    const char *title;
    const char *note;        // one line under the title (may be NULL)
    const char *kind;        // data-kind attribute ("load", "beta", "layer_ratio")
    int64_t run;
    size_t rows, cols;
    const double *v;         // (rows x cols) row-major; NaN = no data
    char (*row_labels)[32];  // (rows) e.g. "L1 e3"
    const int *row_group;    // (rows) group index (a line between groups), or NULL
    const int64_t *steps;    // (cols) the step of each column
    report_scale scale;
    double vmin, vmax, center;
    const char *unit_lo, *unit_hi; // colour-bar end labels (may be NULL: numbers)
} report_heat;

// A heatmap of rows x columns (columns are steps); columns beyond min(400, 30000 / rows) are
// averaged into that many buckets, so a page stays a few MB whatever the run's length. Each cell is a <rect class="cell">; the <svg> carries data-rows, data-cols (before
// bucketing) and data-drawn-cols.
void report_heatmap(FILE *f, const report_heat *h);

#endif
