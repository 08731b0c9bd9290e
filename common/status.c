// status.c: error message formatting (see status.h).
#include "common/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

mtrl_status mtrl_error_set(mtrl_error *err, mtrl_status code, const char *fmt, ...) {
    if (!err) return code;
    err->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    return code;
}

mtrl_status mtrl_error_wrap(mtrl_error *err, const char *fmt, ...) {
    if (!err) return MTRL_ERR_STATE;
    char prefix[MTRL_ERROR_MSG_MAX], old[MTRL_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, err->msg, sizeof old);
    // Build "prefix: old" by hand: the result is cut at the buffer's end, on purpose.
    size_t np = strlen(prefix), no = strlen(old), cap = sizeof err->msg - 1, at = 0;
    for (size_t i = 0; i < np && at < cap; i++) err->msg[at++] = prefix[i];
    for (size_t i = 0; i < 2 && at < cap; i++) err->msg[at++] = ": "[i];
    for (size_t i = 0; i < no && at < cap; i++) err->msg[at++] = old[i];
    err->msg[at] = '\0';
    return err->code;
}

void mtrl_error_clear(mtrl_error *err) {
    if (!err) return;
    err->code = MTRL_OK;
    err->msg[0] = '\0';
}

const char *mtrl_status_name(mtrl_status code) {
    switch (code) {
    case MTRL_OK: return "ok";
    case MTRL_ERR_USAGE: return "usage";
    case MTRL_ERR_IO: return "io";
    case MTRL_ERR_NOMEM: return "nomem";
    case MTRL_ERR_FORMAT: return "format";
    case MTRL_ERR_LIMIT: return "limit";
    case MTRL_ERR_PLUGIN: return "plugin";
    case MTRL_ERR_TIMEOUT: return "timeout";
    case MTRL_ERR_PEER: return "peer";
    case MTRL_ERR_MISMATCH: return "mismatch";
    case MTRL_ERR_NOTFOUND: return "notfound";
    case MTRL_ERR_STATE: return "state";
    }
    return "unknown";
}
