// check.h: the invariant tier of errors (docs/architecture.md §9).
//
// MTRL_CHECK(cond) and MTRL_CHECKF(cond, fmt, ...) print file:line, the failed condition and
// an optional explanation, then abort. They guard what cannot happen if the program is correct;
// anything that comes from outside returns an mtrl_status instead (status.h).
// xmalloc/xcalloc/xrealloc never return NULL: running out of host memory is fatal here.
#ifndef MTRL_CHECK_H
#define MTRL_CHECK_H

#include <stddef.h>

_Noreturn void mtrl_check_fail(const char *file, int line, const char *cond, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#define MTRL_CHECK(cond)                                                   \
    do { if (!(cond)) mtrl_check_fail(__FILE__, __LINE__, #cond, NULL); } while (0)
#define MTRL_CHECKF(cond, ...)                                             \
    do { if (!(cond)) mtrl_check_fail(__FILE__, __LINE__, #cond, __VA_ARGS__); } while (0)

void *mtrl_xmalloc_(size_t n, const char *file, int line);
void *mtrl_xcalloc_(size_t count, size_t size, const char *file, int line);
void *mtrl_xrealloc_(void *p, size_t n, const char *file, int line);
char *mtrl_xstrdup_(const char *s, const char *file, int line);
#define xmalloc(n) mtrl_xmalloc_((n), __FILE__, __LINE__)
#define xcalloc(c, s) mtrl_xcalloc_((c), (s), __FILE__, __LINE__)
#define xrealloc(p, n) mtrl_xrealloc_((p), (n), __FILE__, __LINE__)
#define xstrdup(s) mtrl_xstrdup_((s), __FILE__, __LINE__)

#endif
