// status.h: status codes and error messages for everything a user or peer can get wrong.
//
// Two error tiers (docs/architecture.md §9). Invariants abort through check.h. Everything that comes
// from outside (a config, a file, a wire message, a plug-in, a tool call) returns an
// mtrl_status and fills an mtrl_error whose message names the input and says what to do:
//     "experiments/x.ini:3: unknown key 'lr' in [learner]; did you mean 'lr_max'?"
// Functions that take an mtrl_error *err may be passed NULL when the caller only needs the code.
#ifndef MTRL_STATUS_H
#define MTRL_STATUS_H

#include <stddef.h>

typedef enum mtrl_status {
    MTRL_OK = 0,
    MTRL_ERR_USAGE = -1,   // bad command line or config value
    MTRL_ERR_IO = -2,      // a file or socket could not be read or written
    MTRL_ERR_NOMEM = -3,   // an allocation failed
    MTRL_ERR_FORMAT = -4,  // a file or message is malformed, torn or corrupt
    MTRL_ERR_LIMIT = -5,   // a length or count is over its configured cap
    MTRL_ERR_PLUGIN = -6,  // an env plug-in was refused or failed
    MTRL_ERR_TIMEOUT = -7, // a peer or child did not answer in time
    MTRL_ERR_PEER = -8,    // a peer broke the protocol or went away
    MTRL_ERR_MISMATCH = -9,// shapes, config hash or versions do not match
    MTRL_ERR_NOTFOUND = -10, // a named thing (episode, run, file, key) does not exist
    MTRL_ERR_STATE = -11,  // the call is not valid in the current state
} mtrl_status;

#define MTRL_ERROR_MSG_MAX 1024

typedef struct mtrl_error {
    mtrl_status code;
    char msg[MTRL_ERROR_MSG_MAX];
} mtrl_error;

// Formats the message into err (when non-NULL) and returns code, so a caller can write
//     return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: record %d: bad CRC", path, i);
mtrl_status mtrl_error_set(mtrl_error *err, mtrl_status code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

// Prefixes an existing message with more context ("while loading X: ...").
mtrl_status mtrl_error_wrap(mtrl_error *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

void mtrl_error_clear(mtrl_error *err);

// A short stable name for a code ("usage", "io", "format", ...).
const char *mtrl_status_name(mtrl_status code);

#endif
