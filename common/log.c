// log.c: stderr logging and the progress line (see log.h).
#include "common/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "common/timeutil.h"

static mtrl_log_level log_level_ = MTRL_LOG_INFO;
static int log_level_read_;
static char log_tag_[64] = "mtrl";
static mtrl_progress *log_live_; // a progress line currently on screen

void mtrl_log_set_level(mtrl_log_level level) { log_level_ = level; log_level_read_ = 1; }

mtrl_log_level mtrl_log_get_level(void) {
    if (!log_level_read_) {
        log_level_read_ = 1;
        const char *e = getenv("MTRL_LOG");
        if (e) {
            if (!strcmp(e, "debug")) log_level_ = MTRL_LOG_DEBUG;
            else if (!strcmp(e, "warn")) log_level_ = MTRL_LOG_WARN;
            else if (!strcmp(e, "error")) log_level_ = MTRL_LOG_ERROR;
            else log_level_ = MTRL_LOG_INFO;
        }
    }
    return log_level_;
}

void mtrl_log_set_tag(const char *tag) { snprintf(log_tag_, sizeof log_tag_, "%s", tag); }

int mtrl_term_interactive(void) {
    const char *term = getenv("TERM");
    return isatty(2) && !(term && !strcmp(term, "dumb"));
}

int mtrl_term_color(void) {
    const char *nc = getenv("NO_COLOR");
    return mtrl_term_interactive() && !(nc && nc[0]);
}

void mtrl_logv(mtrl_log_level level, const char *fmt, va_list ap) {
    if (level < mtrl_log_get_level()) return;
    static const char letters[] = "DIWE";
    static const char *colors[] = {"\033[2m", "", "\033[33m", "\033[31m"};
    struct timeval tv;
    gettimeofday(&tv, NULL);
    struct tm tm;
    gmtime_r(&tv.tv_sec, &tm);
    char ts[32];
    strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%S", &tm);
    char line[4096];
    int n = snprintf(line, sizeof line, "%s.%03dZ %c %s: ", ts, (int)(tv.tv_usec / 1000), letters[level], log_tag_);
    if (n < 0) n = 0;
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    int color = mtrl_term_color() && colors[level][0];
    if (log_live_ && log_live_->drawn) { fputs("\r\033[K", stderr); log_live_->drawn = 0; }
    fprintf(stderr, "%s%s%s\n", color ? colors[level] : "", line, color ? "\033[0m" : "");
    fflush(stderr);
}

void mtrl_log(mtrl_log_level level, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    mtrl_logv(level, fmt, ap);
    va_end(ap);
}

void mtrl_progress_init(mtrl_progress *p, double plain_every) {
    p->interactive = mtrl_term_interactive();
    p->last_draw = -1e30;
    p->plain_every = plain_every;
    p->drawn = 0;
}

void mtrl_progress_update(mtrl_progress *p, int force, const char *fmt, ...) {
    double now = mtrl_time_mono();
    double every = p->interactive ? 0.1 : p->plain_every;
    if (!force && now - p->last_draw < every) return;
    p->last_draw = now;
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (p->interactive) {
        fprintf(stderr, "\r\033[K%s", line);
        p->drawn = 1;
        log_live_ = p;
    } else {
        fprintf(stderr, "%s\n", line);
    }
    fflush(stderr);
}

void mtrl_progress_end(mtrl_progress *p) {
    if (p->interactive && p->drawn) fputc('\n', stderr);
    p->drawn = 0;
    if (log_live_ == p) log_live_ = NULL;
    fflush(stderr);
}
