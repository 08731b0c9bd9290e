// log.h: diagnostics on stderr, and the progress line.
//
// stdout carries results; stderr carries logs and progress (clig.dev). Each log line is
//     2026-11-30T06:30:45.123Z I learner: step 12 loss 0.53
// Levels: MTRL_LOG_DEBUG < INFO < WARN < ERROR; the threshold comes from the MTRL_LOG
// environment variable (debug, info, warn, error; default info) or mtrl_log_set_level.
// Colour only when stderr is a terminal, TERM is not "dumb" and NO_COLOR is unset.
//
// Every message is escaped before it is written (mtrl_text_escape): text that came from a peer,
// an env or a model (abort reasons, tool errors, addresses) cannot move the cursor, clear the
// screen, recolour the terminal or start a fake log line. Our own format strings hold no
// control characters, so escaping the whole message loses nothing.
//
// The progress line redraws in place (\r, ESC[K, at most 10 times a second) on a terminal and
// prints a plain line at most every `plain_every` seconds otherwise, so logs stay readable.
#ifndef MTRL_LOG_H
#define MTRL_LOG_H

#include <stdarg.h>
#include <stddef.h>

typedef enum mtrl_log_level {
    MTRL_LOG_DEBUG = 0,
    MTRL_LOG_INFO = 1,
    MTRL_LOG_WARN = 2,
    MTRL_LOG_ERROR = 3,
} mtrl_log_level;

void mtrl_log_set_level(mtrl_log_level level);
mtrl_log_level mtrl_log_get_level(void);
// The name shown after the level letter ("learner", "actor 1"); copied.
void mtrl_log_set_tag(const char *tag);

void mtrl_log(mtrl_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void mtrl_logv(mtrl_log_level level, const char *fmt, va_list ap);

// Writes src[0..len) into dst (cap bytes, always NUL-terminated when cap > 0) with everything a
// terminal would act on made visible: \n \r \t as those two characters, other C0 controls and
// DEL as \xHH (ESC is \x1b), C1 controls (U+0080..U+009F) and the bidirectional overrides
// (U+202A..U+202E, U+2066..U+2069) as \uHHHH, bytes that are not UTF-8 as \xHH. Printable
// ASCII and valid UTF-8 otherwise pass unchanged. Output that does not fit ends in "..."
// (never cut inside an escape or a character). Returns the length written.
size_t mtrl_text_escape(char *dst, size_t cap, const char *src, size_t len);

#define LOG_DEBUG(...) mtrl_log(MTRL_LOG_DEBUG, __VA_ARGS__)
#define LOG_INFO(...) mtrl_log(MTRL_LOG_INFO, __VA_ARGS__)
#define LOG_WARN(...) mtrl_log(MTRL_LOG_WARN, __VA_ARGS__)
#define LOG_ERROR(...) mtrl_log(MTRL_LOG_ERROR, __VA_ARGS__)

// 1 when stderr should get colour and redrawn lines (terminal, TERM != dumb, no NO_COLOR for
// colour). mtrl_term_interactive ignores NO_COLOR: redrawing is not colour.
int mtrl_term_color(void);
int mtrl_term_interactive(void);

typedef struct mtrl_progress {
    int interactive;
    double last_draw;
    double plain_every; // seconds between plain lines when not on a terminal
    int drawn;          // a live line is on screen and must be cleared before a log line
} mtrl_progress;

void mtrl_progress_init(mtrl_progress *p, double plain_every);
// Draws the line if enough time passed (force = 1 draws now).
void mtrl_progress_update(mtrl_progress *p, int force, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
// Ends a live line with a newline.
void mtrl_progress_end(mtrl_progress *p);

#endif
