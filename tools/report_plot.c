// report_plot.c: inline-SVG panels for `mtrl report` (see report_plot.h).
#include "tools/report_plot.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"

void report_esc(FILE *f, const char *s) {
    if (!s) return;
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        switch (c) {
        case '&': fputs("&amp;", f); break;
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '"': fputs("&quot;", f); break;
        case '\'': fputs("&#39;", f); break;
        default:
            if (c < 0x20 && c != '\n' && c != '\t') break; // not allowed in XML 1.0
            fputc(c, f);
        }
    }
}

// ---- ticks --------------------------------------------------------------------------------------

static double nice_(double x, int round) {
    double e = floor(log10(x)), f = x / pow(10, e), nf;
    if (round) nf = f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10;
    else nf = f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10;
    return nf * pow(10, e);
}

int report_nice_ticks(double lo, double hi, int want, int integer, double *t0, double *step) {
    if (!(hi > lo)) {
        double pad = fabs(lo) > 0 ? fabs(lo) * 0.1 : 1.0;
        if (integer && pad < 1) pad = 1;
        lo -= pad;
        hi += pad;
    }
    if (want < 2) want = 2;
    double range = nice_(hi - lo, 0);
    double d = nice_(range / (want - 1), 1);
    if (integer && d < 1) d = 1;
    double a = floor(lo / d) * d, b = ceil(hi / d) * d;
    *t0 = a;
    *step = d;
    return (int)llround((b - a) / d) + 1;
}

void report_tick_label(double v, double step, char *out, size_t cap) {
    if (fabs(v) < step * 1e-9) {
        snprintf(out, cap, "0");
        return;
    }
    double av = fabs(v);
    if (v != 0 && (av >= 1e6 || av < 1e-4 || step < 1e-4)) {
        int prec = 1 + (int)ceil(log10(av / step) + 1e-9);
        if (prec < 1) prec = 1;
        if (prec > 6) prec = 6;
        snprintf(out, cap, "%.*e", prec - 1, v);
        // trim "e-05" -> "e-5"
        char *e = strchr(out, 'e');
        if (e) {
            char *p = e + 1;
            if (*p == '+' ) memmove(p, p + 1, strlen(p));
            if (*p == '-') p++;
            while (*p == '0' && p[1]) memmove(p, p + 1, strlen(p));
        }
        return;
    }
    int dec = step >= 1 ? 0 : (int)ceil(-log10(step) - 1e-9);
    if (dec > 8) dec = 8;
    snprintf(out, cap, "%.*f", dec, v);
    if (!strcmp(out, "-0")) snprintf(out, cap, "0");
}

// ---- line panels --------------------------------------------------------------------------------

#define PW_ 620
#define PH_ 230
#define ML_ 64
#define MR_ 14
#define MT_ 10
#define MB_ 30

typedef struct drawn {
    size_t *idx; // indices into the series that are drawn, in step order
    size_t n;
    size_t finite;
} drawn;

static void downsample_(const report_series *s, drawn *d) {
    size_t nf = 0;
    for (size_t i = 0; i < s->n; i++) nf += isfinite(s->y[i]) != 0;
    d->finite = nf;
    d->idx = xmalloc(sizeof(size_t) * (nf ? nf : 1));
    size_t *fi = xmalloc(sizeof(size_t) * (nf ? nf : 1));
    size_t k = 0;
    for (size_t i = 0; i < s->n; i++)
        if (isfinite(s->y[i])) fi[k++] = i;
    if (nf <= REPORT_MAX_POINTS) {
        memcpy(d->idx, fi, sizeof(size_t) * nf);
        d->n = nf;
    } else {
        size_t B = REPORT_MAX_POINTS / 2, m = 0;
        for (size_t b = 0; b < B; b++) {
            size_t a = b * nf / B, e = (b + 1) * nf / B;
            if (a >= e) continue;
            size_t lo = a, hi = a;
            for (size_t j = a; j < e; j++) {
                if (s->y[fi[j]] < s->y[fi[lo]]) lo = j;
                if (s->y[fi[j]] > s->y[fi[hi]]) hi = j;
            }
            size_t first = lo < hi ? lo : hi, second = lo < hi ? hi : lo;
            d->idx[m++] = fi[first];
            if (second != first) d->idx[m++] = fi[second];
        }
        d->n = m;
    }
    free(fi);
}

void report_line_panel(FILE *f, const char *title, const char *note, const report_series *s, size_t ns) {
    report_line_panel_y(f, title, note, s, ns, NAN, NAN);
}

void report_line_panel_y(FILE *f, const char *title, const char *note, const report_series *s, size_t ns, double y_lo,
                         double y_hi) {
    drawn *dr = xcalloc(ns ? ns : 1, sizeof(drawn));
    double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
    size_t total = 0, max_drawn = 0;
    for (size_t i = 0; i < ns; i++) {
        downsample_(&s[i], &dr[i]);
        total += dr[i].n;
        if (dr[i].n > max_drawn) max_drawn = dr[i].n;
        for (size_t j = 0; j < s[i].n; j++) {
            if (!isfinite(s[i].y[j])) continue;
            double x = (double)s[i].x[j], y = s[i].y[j];
            if (x < x0) x0 = x;
            if (x > x1) x1 = x;
            if (y < y0) y0 = y;
            if (y > y1) y1 = y;
        }
    }
    if (total > 0 && isfinite(y_lo) && y_lo < y0) y0 = y_lo;
    if (total > 0 && isfinite(y_hi) && y_hi > y1) y1 = y_hi;
    fputs("<div class=\"panel\">\n<h3>", f);
    report_esc(f, title);
    fputs("</h3>\n", f);
    if (note && note[0]) {
        fputs("<p class=\"note\">", f);
        report_esc(f, note);
        fputs("</p>\n", f);
    }
    int W = PW_, H = PH_;
    fprintf(f, "<svg class=\"chart\" xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\">\n", W,
            H, W, H);
    if (total == 0) {
        fprintf(f, "<text x=\"%d\" y=\"%d\" class=\"empty\">no data</text>\n</svg>\n", W / 2 - 25, H / 2);
    } else {
        double xt0, xst, yt0, yst;
        int nxt = report_nice_ticks(x0, x1, 8, 1, &xt0, &xst);
        int nyt = report_nice_ticks(y0, y1, 6, 0, &yt0, &yst);
        double xa = xt0, xb = xt0 + xst * (nxt - 1), ya = yt0, yb = yt0 + yst * (nyt - 1);
        // for x, keep the data range itself when the ticks would leave a lot of empty room
        if (x1 > x0) {
            xa = x0 - xt0 <= 0.05 * (x1 - x0) ? xt0 : x0;
            xb = xt0 + xst * (nxt - 1) - x1 <= 0.05 * (x1 - x0) ? xt0 + xst * (nxt - 1) : x1;
        }
        double pw = W - ML_ - MR_, ph = H - MT_ - MB_;
#define SX_(x) (ML_ + ((x) - xa) / (xb - xa) * pw)
#define SY_(y) (MT_ + ph - ((y) - ya) / (yb - ya) * ph)
        fprintf(f, "<rect class=\"frame\" x=\"%d\" y=\"%d\" width=\"%.0f\" height=\"%.0f\"/>\n", ML_, MT_, pw, ph);
        for (int i = 0; i < nyt; i++) {
            double v = yt0 + yst * i;
            char lab[64];
            report_tick_label(v, yst, lab, sizeof lab);
            fprintf(f, "<line class=\"grid\" x1=\"%d\" y1=\"%.1f\" x2=\"%.0f\" y2=\"%.1f\"/>", ML_, SY_(v), ML_ + pw, SY_(v));
            fprintf(f, "<text class=\"yt\" x=\"%d\" y=\"%.1f\">%s</text>\n", ML_ - 5, SY_(v) + 4, lab);
        }
        for (int i = 0; i < nxt; i++) {
            double v = xt0 + xst * i;
            if (v < xa - 1e-9 || v > xb + 1e-9) continue;
            char lab[64];
            report_tick_label(v, xst, lab, sizeof lab);
            fprintf(f, "<line class=\"grid\" x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%.0f\"/>", SX_(v), MT_, SX_(v), MT_ + ph);
            fprintf(f, "<text class=\"xt\" x=\"%.1f\" y=\"%.0f\">%s</text>\n", SX_(v), MT_ + ph + 15, lab);
        }
        fprintf(f, "<text class=\"xl\" x=\"%.0f\" y=\"%d\">step</text>\n", ML_ + pw, H - 2);
        for (size_t i = 0; i < ns; i++) {
            const report_series *q = &s[i];
            fprintf(f, "<polyline class=\"series\" data-run=\"%lld\" data-metric=\"", (long long)q->run);
            report_esc(f, q->metric);
            fprintf(f, "\" data-n=\"%zu\" data-plotted=\"%zu\" stroke=\"%s\"", dr[i].finite, dr[i].n, q->color);
            if (q->dash && q->dash[0]) fprintf(f, " stroke-dasharray=\"%s\"", q->dash);
            fputs(" data-steps=\"", f);
            for (size_t j = 0; j < dr[i].n; j++) fprintf(f, "%s%lld", j ? " " : "", (long long)q->x[dr[i].idx[j]]);
            fputs("\" data-values=\"", f);
            for (size_t j = 0; j < dr[i].n; j++) fprintf(f, "%s%.9g", j ? " " : "", q->y[dr[i].idx[j]]);
            fputs("\" points=\"", f);
            for (size_t j = 0; j < dr[i].n; j++) {
                size_t k = dr[i].idx[j];
                double px = x1 > x0 ? SX_((double)q->x[k]) : ML_ + pw / 2;
                fprintf(f, "%s%.1f,%.1f", j ? " " : "", px, SY_(q->y[k]));
            }
            fputs("\"/>\n", f);
            if (max_drawn <= 60) {
                for (size_t j = 0; j < dr[i].n; j++) {
                    size_t k = dr[i].idx[j];
                    double px = x1 > x0 ? SX_((double)q->x[k]) : ML_ + pw / 2;
                    fprintf(f, "<circle class=\"marker\" cx=\"%.1f\" cy=\"%.1f\" r=\"2.4\" fill=\"%s\"/>", px, SY_(q->y[k]),
                            q->color);
                }
                fputc('\n', f);
            }
        }
#undef SX_
#undef SY_
        fputs("</svg>\n", f);
    }
    fputs("<div class=\"legend\">", f);
    for (size_t i = 0; i < ns; i++) {
        fprintf(f, "<span class=\"key\"><svg xmlns=\"http://www.w3.org/2000/svg\" width=\"26\" height=\"10\"><line x1=\"1\" y1=\"5\" "
                   "x2=\"25\" y2=\"5\" stroke=\"%s\" stroke-width=\"2.5\"",
                s[i].color);
        if (s[i].dash && s[i].dash[0]) fprintf(f, " stroke-dasharray=\"%s\"", s[i].dash);
        fputs("/></svg>", f);
        report_esc(f, s[i].label);
        if (dr[i].finite > dr[i].n) fprintf(f, " (%zu points, drawn as %zu min/max)", dr[i].finite, dr[i].n);
        fputs("</span>", f);
        free(dr[i].idx);
    }
    fputs("</div>\n</div>\n", f);
    free(dr);
}

// ---- heatmaps -----------------------------------------------------------------------------------

static void lerp_rgb_(const unsigned *stops, int n, double t, char *out) {
    if (!(t >= 0)) t = 0;
    if (t > 1) t = 1;
    double p = t * (n - 1);
    int i = (int)p;
    if (i >= n - 1) i = n - 2;
    double u = p - i;
    unsigned a = stops[i], b = stops[i + 1];
    int r = (int)lround(((a >> 16) & 255) * (1 - u) + ((b >> 16) & 255) * u);
    int g = (int)lround(((a >> 8) & 255) * (1 - u) + ((b >> 8) & 255) * u);
    int bl = (int)lround((a & 255) * (1 - u) + (b & 255) * u);
    snprintf(out, 8, "#%02x%02x%02x", r, g, bl);
}

static const unsigned seq_stops_[] = {0xfde725, 0x5ec962, 0x21918c, 0x3b528b, 0x440154}; // viridis, reversed
static const unsigned div_stops_[] = {0x2166ac, 0x92c5de, 0xf7f7f7, 0xf4a582, 0xb2182b};

static void colour_(const report_heat *h, double v, char *out) {
    if (!isfinite(v)) {
        snprintf(out, 8, "#e8e8e8");
        return;
    }
    if (h->scale == REPORT_SCALE_SEQ) {
        double t = h->vmax > h->vmin ? (v - h->vmin) / (h->vmax - h->vmin) : 0.5;
        lerp_rgb_(seq_stops_, 5, t, out);
    } else {
        double half = fmax(h->vmax - h->center, h->center - h->vmin);
        double t = half > 0 ? 0.5 + 0.5 * (v - h->center) / half : 0.5;
        lerp_rgb_(div_stops_, 5, t, out);
    }
}

#define HW_ 1300
#define HL_ 72
#define HR_ 110

void report_heatmap(FILE *f, const report_heat *h) {
    // at most 400 columns, and about 30000 cells per map (a big model's many rows get fewer)
    size_t C = h->cols, R = h->rows, maxc = R ? 30000 / R : 400;
    if (maxc > 400) maxc = 400;
    if (maxc < 20) maxc = 20;
    size_t DC = C > maxc ? maxc : C;
    fputs("<div class=\"panel wide\">\n<h3>", f);
    report_esc(f, h->title);
    fputs("</h3>\n", f);
    if (h->note && h->note[0]) {
        fputs("<p class=\"note\">", f);
        report_esc(f, h->note);
        fputs("</p>\n", f);
    }
    if (R == 0 || C == 0) {
        fputs("<p class=\"empty\">no data</p>\n</div>\n", f);
        return;
    }
    double rh = 330.0 / (double)R;
    if (rh > 16) rh = 16;
    if (rh < 3) rh = 3;
    double ph = rh * (double)R, pw = HW_ - HL_ - HR_, cw = pw / (double)DC;
    int H = (int)ceil(ph) + 36, top = 8;
    fprintf(f,
            "<svg class=\"heat\" xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
            "data-kind=\"%s\" data-run=\"%lld\" data-rows=\"%zu\" data-cols=\"%zu\" data-drawn-cols=\"%zu\">\n",
            HW_, H, HW_, H, h->kind, (long long)h->run, R, C, DC);
    int titles = R * DC <= 6000;
    for (size_t r = 0; r < R; r++) {
        for (size_t c = 0; c < DC; c++) {
            size_t a = c * C / DC, e = (c + 1) * C / DC;
            double sum = 0;
            size_t n = 0;
            for (size_t j = a; j < e; j++) {
                double v = h->v[r * C + j];
                if (isfinite(v)) {
                    sum += v;
                    n++;
                }
            }
            double v = n ? sum / (double)n : NAN;
            char col[8];
            colour_(h, v, col);
            fprintf(f, "<rect class=\"cell\" x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"%s\"", HL_ + c * cw,
                    top + r * rh, cw + 0.02, rh + 0.02, col);
            if (titles) {
                fprintf(f, "><title>%s, step %lld: %.4g</title></rect>", h->row_labels[r], (long long)h->steps[a], v);
            } else {
                fputs("/>", f);
            }
        }
        fputc('\n', f);
    }
    // row labels (every row when they fit, else the first row of each group) and group lines
    for (size_t r = 0; r < R; r++) {
        int first = !h->row_group || r == 0 || h->row_group[r] != h->row_group[r - 1];
        if (h->row_group && first && r > 0)
            fprintf(f, "<line class=\"sep\" x1=\"%d\" y1=\"%.2f\" x2=\"%.0f\" y2=\"%.2f\"/>\n", HL_, top + r * rh, HL_ + pw,
                    top + r * rh);
        if (rh >= 11 || first) {
            fprintf(f, "<text class=\"yt\" x=\"%d\" y=\"%.1f\">", HL_ - 4, top + r * rh + (rh >= 11 ? rh / 2 + 4 : 9));
            report_esc(f, h->row_labels[r]);
            fputs("</text>\n", f);
        }
    }
    // step ticks
    double t0, st;
    int nt = report_nice_ticks((double)h->steps[0], (double)h->steps[C - 1], 10, 1, &t0, &st);
    for (int i = 0; i < nt; i++) {
        double v = t0 + st * i;
        // the column holding step v
        for (size_t c = 0; c < DC; c++) {
            size_t a = c * C / DC, e = (c + 1) * C / DC;
            if ((double)h->steps[a] <= v && v <= (double)h->steps[e - 1]) {
                char lab[64];
                report_tick_label(v, st, lab, sizeof lab);
                fprintf(f, "<text class=\"xt\" x=\"%.1f\" y=\"%.0f\">%s</text>", HL_ + (c + 0.5) * cw, top + ph + 14, lab);
                break;
            }
        }
    }
    fprintf(f, "\n<text class=\"xl\" x=\"%.0f\" y=\"%d\">step</text>\n", HL_ + pw, H - 2);
    // colour bar
    double bx = HL_ + pw + 16, bh = ph < 60 ? 60 : ph;
    if (bh > ph + 20) bh = ph + 20;
    for (int i = 0; i < 24; i++) {
        double t = 1.0 - (i + 0.5) / 24.0;
        char col[8];
        double v = h->scale == REPORT_SCALE_SEQ ? h->vmin + t * (h->vmax - h->vmin)
                                                : h->center + (2 * t - 1) * fmax(h->vmax - h->center, h->center - h->vmin);
        colour_(h, v, col);
        fprintf(f, "<rect x=\"%.1f\" y=\"%.2f\" width=\"14\" height=\"%.2f\" fill=\"%s\"/>", bx, top + i * bh / 24, bh / 24 + 0.05,
                col);
    }
    char lo[64], hi[64];
    double half = fmax(h->vmax - h->center, h->center - h->vmin);
    double vlo = h->scale == REPORT_SCALE_SEQ ? h->vmin : h->center - half;
    double vhi = h->scale == REPORT_SCALE_SEQ ? h->vmax : h->center + half;
    snprintf(lo, sizeof lo, "%.3g", vlo);
    snprintf(hi, sizeof hi, "%.3g", vhi);
    fprintf(f, "\n<text class=\"cb\" x=\"%.1f\" y=\"%.1f\">", bx + 18, (double)top + 9);
    report_esc(f, h->unit_hi ? h->unit_hi : hi);
    fprintf(f, "</text><text class=\"cb\" x=\"%.1f\" y=\"%.1f\">", bx + 18, top + bh);
    report_esc(f, h->unit_lo ? h->unit_lo : lo);
    fputs("</text>\n</svg>\n</div>\n", f);
}
