// check.c: invariant failures and never-NULL allocation (see check.h).
#include "common/check.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

_Noreturn void mtrl_check_fail(const char *file, int line, const char *cond, const char *fmt, ...) {
    fprintf(stderr, "%s:%d: check failed: %s", file, line, cond);
    if (fmt) {
        fputs(": ", stderr);
        va_list ap;
        va_start(ap, fmt);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
    }
    fputc('\n', stderr);
    fflush(stderr);
    abort();
}

void *mtrl_xmalloc_(size_t n, const char *file, int line) {
    void *p = malloc(n ? n : 1);
    if (!p) mtrl_check_fail(file, line, "malloc", "out of memory allocating %zu bytes", n);
    return p;
}

void *mtrl_xcalloc_(size_t count, size_t size, const char *file, int line) {
    void *p = calloc(count ? count : 1, size ? size : 1);
    if (!p) mtrl_check_fail(file, line, "calloc", "out of memory allocating %zu x %zu bytes", count, size);
    return p;
}

void *mtrl_xrealloc_(void *p, size_t n, const char *file, int line) {
    void *q = realloc(p, n ? n : 1);
    if (!q) mtrl_check_fail(file, line, "realloc", "out of memory allocating %zu bytes", n);
    return q;
}

char *mtrl_xstrdup_(const char *s, const char *file, int line) {
    size_t n = strlen(s) + 1;
    char *d = mtrl_xmalloc_(n, file, line);
    memcpy(d, s, n);
    return d;
}
