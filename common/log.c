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

// The length of the UTF-8 sequence at s[0..n) and its code point, or 0 when it is not valid
// (overlong forms, surrogates and values past U+10FFFF are not).
static size_t utf8_char_(const unsigned char *s, size_t n, unsigned *cp) {
    unsigned c = s[0];
    size_t k = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 0;
    if (k == 0 || k > n || c > 0xf4) return 0;
    unsigned v = c & (0x7f >> k);
    for (size_t i = 1; i < k; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        v = (v << 6) | (s[i] & 0x3f);
    }
    static const unsigned least[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (v < least[k] || v > 0x10ffff || (v >= 0xd800 && v <= 0xdfff)) return 0;
    *cp = v;
    return k;
}

// The escaped form of the character at s[i] into piece (16 bytes); *used = bytes consumed.
static size_t escape_piece_(const unsigned char *s, size_t len, size_t i, char *piece, size_t *used) {
    unsigned c = s[i], cp = 0;
    *used = 1;
    if (c == '\n' || c == '\r' || c == '\t') {
        piece[0] = '\\';
        piece[1] = c == '\n' ? 'n' : c == '\r' ? 'r' : 't';
        return 2;
    }
    if (c < 0x20 || c == 0x7f) return (size_t)snprintf(piece, 16, "\\x%02x", c);
    if (c < 0x80) {
        piece[0] = (char)c;
        return 1;
    }
    size_t k = utf8_char_(s + i, len - i, &cp);
    if (k == 0) return (size_t)snprintf(piece, 16, "\\x%02x", c);
    *used = k;
    if ((cp >= 0x80 && cp <= 0x9f) || (cp >= 0x202a && cp <= 0x202e) || (cp >= 0x2066 && cp <= 0x2069))
        return (size_t)snprintf(piece, 16, "\\u%04x", cp);
    memcpy(piece, s + i, k);
    return k;
}

size_t mtrl_text_escape(char *dst, size_t cap, const char *src, size_t len) {
    if (cap == 0) return 0;
    const unsigned char *s = (const unsigned char *)src;
    char piece[16];
    size_t total = 0, used;
    for (size_t i = 0; i < len; i += used) total += escape_piece_(s, len, i, piece, &used);
    // All of it when it fits; otherwise whole pieces and "..." after them.
    size_t limit = total < cap ? cap : cap > 3 ? cap - 3 : 0, o = 0;
    for (size_t i = 0; i < len; i += used) {
        size_t pn = escape_piece_(s, len, i, piece, &used);
        if (o + pn >= limit) break;
        memcpy(dst + o, piece, pn);
        o += pn;
    }
    if (total >= cap && o + 3 < cap) {
        memcpy(dst + o, "...", 3);
        o += 3;
    }
    dst[o] = '\0';
    return o;
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
    char msg[4096], line[8192];
    int m = vsnprintf(msg, sizeof msg, fmt, ap);
    size_t mlen = m < 0 ? 0 : (size_t)m < sizeof msg ? (size_t)m : sizeof msg - 1;
    int n = snprintf(line, sizeof line, "%s.%03dZ %c %s: ", ts, (int)(tv.tv_usec / 1000), letters[level], log_tag_);
    if (n < 0) n = 0;
    mtrl_text_escape(line + n, sizeof line - (size_t)n, msg, mlen);
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
