// wire_auth.c: CURVE key files, allow-lists and the ZAP handler (see wire_auth.h).
//
// The handler is one thread that owns three zmq sockets: the REP bound at
// inproc://zeromq.zap.01 (libzmq sends it a request for every CURVE handshake of every socket
// of the context that names a ZAP domain), a PAIR for control messages from the owner, and, once
// mtrl_wire_auth_server_monitor ran, the PAIR end of the ROUTER's monitor. The owner's side
// (init, monitor, free) is one more PAIR; counters and the allow-list are shared under a mutex.
#include "common/wire/wire_auth.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/check.h"
#include "common/log.h"
#include "common/timeutil.h"

#define ZAP_ENDPOINT_ "inproc://zeromq.zap.01"
#define LINE_MAX_ 512

void mtrl_wire_key_wipe(void *p, size_t n) { sodium_memzero(p, n); }

void mtrl_wire_key_z85(const uint8_t key[MTRL_WIRE_KEY_BYTES], char out[MTRL_WIRE_KEY_Z85_LEN + 1]) {
    zmq_z85_encode(out, key, MTRL_WIRE_KEY_BYTES);
}

// ---- keys ---------------------------------------------------------------------------------------

mtrl_status mtrl_wire_keypair_new(mtrl_wire_keypair *kp, mtrl_error *err) {
    char pub[MTRL_WIRE_KEY_Z85_LEN + 1], sec[MTRL_WIRE_KEY_Z85_LEN + 1];
    if (zmq_curve_keypair(pub, sec) != 0) {
        int e = zmq_errno();
        return mtrl_error_set(err, e == ENOTSUP ? MTRL_ERR_USAGE : MTRL_ERR_IO,
                              "zmq: cannot make a CURVE keypair: %s%s", zmq_strerror(e),
                              e == ENOTSUP ? " (this libzmq was built without libsodium)" : "");
    }
    int ok = zmq_z85_decode(kp->public_key, pub) && zmq_z85_decode(kp->secret_key, sec);
    mtrl_wire_key_wipe(sec, sizeof sec);
    MTRL_CHECK(ok);
    return MTRL_OK;
}

// Decodes one key given on line `line` of `path` (line 0: no line to name).
static mtrl_status key_parse_(uint8_t out[MTRL_WIRE_KEY_BYTES], const char *text, const char *what, const char *path,
                              int line, mtrl_error *err) {
    char where[1200];
    if (line > 0) snprintf(where, sizeof where, "%s:%d", path, line);
    else snprintf(where, sizeof where, "%s", path);
    size_t n = strlen(text);
    if (n != MTRL_WIRE_KEY_Z85_LEN)
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: %s key is %zu characters; expected %d (Z85)", where, what, n,
                              MTRL_WIRE_KEY_Z85_LEN);
    if (!zmq_z85_decode(out, text))
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: %s key is not valid Z85 (a character outside the Z85 alphabet "
                                                    "or a group out of range)", where, what);
    return MTRL_OK;
}

static char *trim_(char *s) {
    while (*s == ' ' || *s == '\t') s++;
    size_t n = strlen(s);
    while (n && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\r' || s[n - 1] == '\n')) s[--n] = '\0';
    return s;
}

static mtrl_status open_(FILE **f, const char *path, const char *what, mtrl_error *err) {
    *f = fopen(path, "r");
    if (*f) return MTRL_OK;
    int e = errno;
    return mtrl_error_set(err, e == ENOENT ? MTRL_ERR_NOTFOUND : MTRL_ERR_IO, "%s: cannot open %s: %s", path, what,
                          strerror(e));
}

// Reads the next significant line (not blank, not a comment) into buf; returns 0 at the end, -1
// when a line is too long (an error is set).
static int next_line_(FILE *f, char *buf, size_t cap, int *line, char **out, const char *path, mtrl_error *err) {
    while (fgets(buf, (int)cap, f)) {
        (*line)++;
        size_t n = strlen(buf);
        if (n == cap - 1 && buf[n - 1] != '\n' && !feof(f)) {
            mtrl_error_set(err, MTRL_ERR_FORMAT, "%s:%d: line longer than %zu bytes", path, *line, cap - 2);
            return -1;
        }
        char *s = trim_(buf);
        if (!*s || *s == '#') continue;
        *out = s;
        return 1;
    }
    return 0;
}

// Splits "name = value"; returns 0 when the line has no '='.
static int split_(char *s, char **name, char **value) {
    char *eq = strchr(s, '=');
    if (!eq) return 0;
    *eq = '\0';
    *name = trim_(s);
    *value = trim_(eq + 1);
    return 1;
}

// Reads a key file. want_secret: the secret line is required (and the mode checked).
static mtrl_status keyfile_read_(const char *path, uint8_t pub[MTRL_WIRE_KEY_BYTES], uint8_t sec[MTRL_WIRE_KEY_BYTES],
                                 int want_secret, mtrl_error *err) {
    FILE *f;
    mtrl_status st = open_(&f, path, want_secret ? "the key file" : "the public key file", err);
    if (st) return st;
    if (want_secret) {
        struct stat sb;
        if (fstat(fileno(f), &sb) == 0 && (sb.st_mode & 077)) {
            fclose(f);
            return mtrl_error_set(err, MTRL_ERR_USAGE,
                                  "%s: secret key file is readable by group or others (mode %04o); run: chmod 600 %s",
                                  path, (unsigned)(sb.st_mode & 07777), path);
        }
    }
    char buf[LINE_MAX_], *s;
    int line = 0, pub_line = 0, sec_line = 0, r;
    while ((r = next_line_(f, buf, sizeof buf, &line, &s, path, err)) > 0) {
        char *name, *value;
        if (!split_(s, &name, &value)) {
            st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s:%d: expected 'public = KEY' or 'secret = KEY'", path, line);
            break;
        }
        int is_pub = !strcmp(name, "public"), is_sec = !strcmp(name, "secret");
        if (!is_pub && !is_sec) {
            st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s:%d: unknown field '%s'; expected public or secret", path, line,
                                name);
            break;
        }
        int *seen = is_pub ? &pub_line : &sec_line;
        if (*seen) {
            st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s:%d: second '%s' line (first on line %d)", path, line, name,
                                *seen);
            break;
        }
        *seen = line;
        if (is_sec && !want_secret) continue; // a .key given where a public key is wanted
        st = key_parse_(is_pub ? pub : sec, value, name, path, line, err);
        if (st) break;
    }
    mtrl_wire_key_wipe(buf, sizeof buf);
    fclose(f);
    if (r < 0) return MTRL_ERR_FORMAT;
    if (st) return st;
    if (!pub_line) return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: no 'public = KEY' line", path);
    if (want_secret && !sec_line)
        return mtrl_error_set(err, MTRL_ERR_FORMAT,
                              "%s: no 'secret = KEY' line (is this a .pub file? pass the .key file)", path);
    return MTRL_OK;
}

mtrl_status mtrl_wire_keypair_load(mtrl_wire_keypair *kp, const char *key_file, mtrl_error *err) {
    mtrl_wire_keypair k;
    mtrl_status st = keyfile_read_(key_file, k.public_key, k.secret_key, 1, err);
    if (st == MTRL_OK) {
        // A hand-edited file could pair keys that do not belong together: the handshake would
        // then fail on the far side with no useful message.
        char sec[MTRL_WIRE_KEY_Z85_LEN + 1], pub[MTRL_WIRE_KEY_Z85_LEN + 1];
        uint8_t derived[MTRL_WIRE_KEY_BYTES];
        mtrl_wire_key_z85(k.secret_key, sec);
        if (zmq_curve_public(pub, sec) != 0 || !zmq_z85_decode(derived, pub))
            st = mtrl_error_set(err, MTRL_ERR_USAGE, "%s: cannot derive the public key: %s", key_file,
                                zmq_strerror(zmq_errno()));
        else if (memcmp(derived, k.public_key, sizeof derived))
            st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: the public key does not belong to the secret key", key_file);
        mtrl_wire_key_wipe(sec, sizeof sec);
    }
    if (st == MTRL_OK) *kp = k;
    mtrl_wire_key_wipe(&k, sizeof k);
    return st;
}

mtrl_status mtrl_wire_key_load_public(uint8_t key[MTRL_WIRE_KEY_BYTES], const char *path, mtrl_error *err) {
    uint8_t pub[MTRL_WIRE_KEY_BYTES];
    mtrl_status st = keyfile_read_(path, pub, NULL, 0, err);
    if (st == MTRL_OK) memcpy(key, pub, sizeof pub);
    return st;
}

static int exists_(const char *path) {
    struct stat sb;
    return lstat(path, &sb) == 0;
}

// Writes text to path through a temporary file in the same folder: written, synced, then
// hard-linked to its name. link() fails with EEXIST instead of replacing a file (rename would
// replace it), so publishing is atomic and never clobbers. The folder is synced after.
static mtrl_status file_publish_(const char *path, const char *text, mode_t mode, mtrl_error *err) {
    char tmp[1200];
    if (snprintf(tmp, sizeof tmp, "%s.tmpXXXXXX", path) >= (int)sizeof tmp)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "%s: path too long", path);
    int fd = mkstemp(tmp); // mode 0600 from the start: the secret is never readable by others
    if (fd < 0) return mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot create a file next to it: %s", path, strerror(errno));
    mtrl_status st = MTRL_OK;
    size_t n = strlen(text), done = 0;
    if (fchmod(fd, mode) != 0) st = mtrl_error_set(err, MTRL_ERR_IO, "%s: chmod: %s", tmp, strerror(errno));
    while (!st && done < n) {
        ssize_t w = write(fd, text + done, n - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) st = mtrl_error_set(err, MTRL_ERR_IO, "%s: write: %s", tmp, strerror(errno));
        else done += (size_t)w;
    }
    if (!st && fsync(fd) != 0) st = mtrl_error_set(err, MTRL_ERR_IO, "%s: fsync: %s", tmp, strerror(errno));
    if (close(fd) != 0 && !st) st = mtrl_error_set(err, MTRL_ERR_IO, "%s: close: %s", tmp, strerror(errno));
    if (!st && link(tmp, path) != 0) {
        int e = errno;
        st = e == EEXIST ? mtrl_error_set(err, MTRL_ERR_USAGE, "%s exists; refusing to overwrite it", path)
                         : mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot create: %s", path, strerror(e));
    }
    unlink(tmp);
    if (!st) {
        char dir[1200];
        snprintf(dir, sizeof dir, "%s", path);
        char *slash = strrchr(dir, '/');
        if (slash) *(slash == dir ? slash + 1 : slash) = '\0';
        else snprintf(dir, sizeof dir, ".");
        int dfd = open(dir, O_RDONLY | O_DIRECTORY);
        if (dfd >= 0) {
            fsync(dfd);
            close(dfd);
        }
    }
    return st;
}

static mtrl_status stem_paths_(const char *stem, char *key_path, char *pub_path, size_t cap, mtrl_error *err) {
    if (!stem || !stem[0]) return mtrl_error_set(err, MTRL_ERR_USAGE, "no file name stem given for the key files");
    if (snprintf(key_path, cap, "%s.key", stem) >= (int)cap || snprintf(pub_path, cap, "%s.pub", stem) >= (int)cap)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "%s: path too long", stem);
    return MTRL_OK;
}

mtrl_status mtrl_wire_keypair_save(const mtrl_wire_keypair *kp, const char *stem, mtrl_error *err) {
    char key_path[1100], pub_path[1100];
    mtrl_status st = stem_paths_(stem, key_path, pub_path, sizeof key_path, err);
    if (st) return st;
    // Check both first, so a refusal leaves no half pair behind.
    if (exists_(key_path)) return mtrl_error_set(err, MTRL_ERR_USAGE, "%s exists; refusing to overwrite it", key_path);
    if (exists_(pub_path)) return mtrl_error_set(err, MTRL_ERR_USAGE, "%s exists; refusing to overwrite it", pub_path);
    char pub[MTRL_WIRE_KEY_Z85_LEN + 1], sec[MTRL_WIRE_KEY_Z85_LEN + 1];
    mtrl_wire_key_z85(kp->public_key, pub);
    mtrl_wire_key_z85(kp->secret_key, sec);
    char text[512];
    snprintf(text, sizeof text,
             "# mtrl CURVE key pair (mtrl keygen): keep this file private; hand out the .pub file\n"
             "public = %s\nsecret = %s\n", pub, sec);
    st = file_publish_(key_path, text, 0600, err);
    mtrl_wire_key_wipe(text, sizeof text);
    mtrl_wire_key_wipe(sec, sizeof sec);
    if (st) return st;
    snprintf(text, sizeof text, "# mtrl CURVE public key: put it on the learner's allow-list ([learner] curve_allow)\n"
                                "public = %s\n", pub);
    st = file_publish_(pub_path, text, 0644, err);
    if (st) unlink(key_path); // ours: it did not exist a moment ago
    return st;
}

mtrl_status mtrl_wire_keypair_write(const char *stem, mtrl_error *err) {
    mtrl_wire_keypair kp;
    mtrl_status st = mtrl_wire_keypair_new(&kp, err);
    if (st == MTRL_OK) st = mtrl_wire_keypair_save(&kp, stem, err);
    mtrl_wire_key_wipe(&kp, sizeof kp);
    return st;
}

// ---- allow-lists ----------------------------------------------------------------------------------

void mtrl_wire_allow_init(mtrl_wire_allow *a) { memset(a, 0, sizeof *a); }

void mtrl_wire_allow_free(mtrl_wire_allow *a) {
    if (!a) return;
    free(a->keys);
    memset(a, 0, sizeof *a);
}

// Index of key, or of where it would go (*found says which).
static size_t allow_find_(const mtrl_wire_allow *a, const uint8_t key[MTRL_WIRE_KEY_BYTES], int *found) {
    size_t lo = 0, hi = a->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = memcmp(a->keys[mid], key, MTRL_WIRE_KEY_BYTES);
        if (c == 0) {
            *found = 1;
            return mid;
        }
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    *found = 0;
    return lo;
}

void mtrl_wire_allow_add(mtrl_wire_allow *a, const uint8_t key[MTRL_WIRE_KEY_BYTES]) {
    int found;
    size_t i = allow_find_(a, key, &found);
    if (found) return;
    if (a->n == a->cap) {
        a->cap = a->cap ? 2 * a->cap : 16;
        a->keys = xrealloc(a->keys, a->cap * sizeof a->keys[0]);
    }
    memmove(a->keys + i + 1, a->keys + i, (a->n - i) * sizeof a->keys[0]);
    memcpy(a->keys[i], key, MTRL_WIRE_KEY_BYTES);
    a->n++;
}

int mtrl_wire_allow_has(const mtrl_wire_allow *a, const uint8_t key[MTRL_WIRE_KEY_BYTES]) {
    int found;
    allow_find_(a, key, &found);
    return found;
}

// "public = KEY" or "secret = KEY" (Z85 has '=' but no blanks, so a bare key never matches).
static int named_key_(char *s, const char **name, char **value) {
    static const char *names[] = {"public", "secret"};
    for (int i = 0; i < 2; i++) {
        size_t n = strlen(names[i]);
        if (strncmp(s, names[i], n)) continue;
        char *p = s + n;
        while (*p == ' ' || *p == '\t') p++;
        if (*p != '=') continue;
        *name = names[i];
        *value = trim_(p + 1);
        return 1;
    }
    return 0;
}

static mtrl_status allow_file_(mtrl_wire_allow *a, const char *path, mtrl_error *err) {
    FILE *f;
    mtrl_status st = open_(&f, path, "the allow-list", err);
    if (st) return st;
    char buf[LINE_MAX_], *s;
    int line = 0, r;
    while ((r = next_line_(f, buf, sizeof buf, &line, &s, path, err)) > 0) {
        const char *name;
        char *value = s;
        if (named_key_(s, &name, &value) && !strcmp(name, "secret")) {
            st = mtrl_error_set(err, MTRL_ERR_FORMAT,
                                "%s:%d: a secret key does not belong in an allow-list; use the .pub files", path, line);
            break;
        }
        if (strpbrk(value, " \t")) {
            st = mtrl_error_set(err, MTRL_ERR_FORMAT, "%s:%d: expected a public key or 'public = KEY'", path, line);
            break;
        }
        uint8_t key[MTRL_WIRE_KEY_BYTES];
        st = key_parse_(key, value, "public", path, line, err);
        if (st) break;
        mtrl_wire_allow_add(a, key);
    }
    mtrl_wire_key_wipe(buf, sizeof buf);
    fclose(f);
    return r < 0 ? MTRL_ERR_FORMAT : st;
}

static mtrl_status allow_dir_(mtrl_wire_allow *a, const char *path, mtrl_error *err) {
    DIR *d = opendir(path);
    if (!d) return mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot open the allow-list folder: %s", path, strerror(errno));
    mtrl_status st = MTRL_OK;
    struct dirent *e;
    while (!st && (e = readdir(d))) {
        size_t n = strlen(e->d_name);
        if (e->d_name[0] == '.' || n < 5 || strcmp(e->d_name + n - 4, ".pub")) continue;
        char file[1400];
        if (snprintf(file, sizeof file, "%s/%s", path, e->d_name) >= (int)sizeof file) {
            st = mtrl_error_set(err, MTRL_ERR_USAGE, "%s/%s: path too long", path, e->d_name);
            break;
        }
        uint8_t key[MTRL_WIRE_KEY_BYTES];
        st = mtrl_wire_key_load_public(key, file, err);
        if (!st) mtrl_wire_allow_add(a, key);
    }
    closedir(d);
    return st;
}

mtrl_status mtrl_wire_allow_load(mtrl_wire_allow *a, const char *path, mtrl_error *err) {
    if (!path || !path[0]) return mtrl_error_set(err, MTRL_ERR_USAGE, "no allow-list given");
    struct stat sb;
    if (stat(path, &sb) != 0) {
        int e = errno;
        return mtrl_error_set(err, e == ENOENT ? MTRL_ERR_NOTFOUND : MTRL_ERR_IO, "%s: cannot open the allow-list: %s",
                              path, strerror(e));
    }
    mtrl_wire_allow tmp;
    mtrl_wire_allow_init(&tmp);
    mtrl_status st = S_ISDIR(sb.st_mode) ? allow_dir_(&tmp, path, err) : allow_file_(&tmp, path, err);
    if (st == MTRL_OK)
        for (size_t i = 0; i < tmp.n; i++) mtrl_wire_allow_add(a, tmp.keys[i]);
    mtrl_wire_allow_free(&tmp);
    return st;
}

// ---- process-wide state -------------------------------------------------------------------------

static pthread_mutex_t proc_mu_ = PTHREAD_MUTEX_INITIALIZER;
static mtrl_wire_allow proc_trusted_;     // keys every server started later allows
static mtrl_wire_sockopts proc_client_;   // CURVE client fields set by the front door
static int proc_client_set_;

void mtrl_wire_auth_trust(const uint8_t key[MTRL_WIRE_KEY_BYTES]) {
    pthread_mutex_lock(&proc_mu_);
    mtrl_wire_allow_add(&proc_trusted_, key);
    pthread_mutex_unlock(&proc_mu_);
}

void mtrl_wire_auth_client_set(const mtrl_wire_sockopts *opts) {
    pthread_mutex_lock(&proc_mu_);
    mtrl_wire_key_wipe(&proc_client_, sizeof proc_client_);
    proc_client_set_ = opts && opts->curve_client;
    if (proc_client_set_) proc_client_ = *opts;
    pthread_mutex_unlock(&proc_mu_);
}

void mtrl_wire_auth_client_apply(mtrl_wire_sockopts *opts) {
    pthread_mutex_lock(&proc_mu_);
    if (proc_client_set_) {
        opts->curve_client = 1;
        memcpy(opts->curve_server_key, proc_client_.curve_server_key, sizeof opts->curve_server_key);
        memcpy(opts->curve_public_key, proc_client_.curve_public_key, sizeof opts->curve_public_key);
        memcpy(opts->curve_secret_key, proc_client_.curve_secret_key, sizeof opts->curve_secret_key);
    }
    pthread_mutex_unlock(&proc_mu_);
}

mtrl_status mtrl_wire_auth_client_opts(mtrl_wire_sockopts *opts, const char *server_pub_file,
                                       const char *client_key_file, mtrl_error *err) {
    uint8_t server[MTRL_WIRE_KEY_BYTES];
    mtrl_wire_keypair kp;
    mtrl_status st = mtrl_wire_key_load_public(server, server_pub_file, err);
    if (st == MTRL_OK) st = mtrl_wire_keypair_load(&kp, client_key_file, err);
    if (st) return st;
    opts->curve_client = 1;
    memcpy(opts->curve_server_key, server, sizeof server);
    memcpy(opts->curve_public_key, kp.public_key, sizeof kp.public_key);
    memcpy(opts->curve_secret_key, kp.secret_key, sizeof kp.secret_key);
    mtrl_wire_key_wipe(&kp, sizeof kp);
    return MTRL_OK;
}

// ---- the ZAP handler ------------------------------------------------------------------------------

struct mtrl_wire_auth_server {
    void *ctx;                  // borrowed
    void *rep;                  // handler thread: REP at inproc://zeromq.zap.01
    void *ctl_thread;           // handler thread: its end of the control pair
    void *ctl_owner;            // the owner's end (init, monitor, free)
    pthread_t thread;
    int started;
    atomic_int stop;
    pthread_mutex_t mu;         // guards allow and stats
    pthread_cond_t cv;          // broadcast when stats change
    mtrl_wire_allow allow;
    mtrl_wire_auth_stats stats;
    double last_log;            // handler thread: rate limit of WARN lines
    uint64_t log_skipped;
};

// One WARN line a second at most: a client retrying every 100 ms, or a scan, must not flood the log.
static void warn_limited_(mtrl_wire_auth_server *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void warn_limited_(mtrl_wire_auth_server *s, const char *fmt, ...) {
    double now = mtrl_time_mono();
    if (now - s->last_log < 1.0) {
        s->log_skipped++;
        return;
    }
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (s->log_skipped) LOG_WARN("%s (and %llu more since the last such line)", msg, (unsigned long long)s->log_skipped);
    else LOG_WARN("%s", msg);
    s->last_log = now;
    s->log_skipped = 0;
}

static void frame_text_(zmq_msg_t *m, char *out, size_t cap) {
    size_t n = zmq_msg_size(m);
    if (n >= cap) n = cap - 1;
    const char *p = zmq_msg_data(m);
    for (size_t i = 0; i < n; i++) out[i] = (p[i] >= 0x20 && p[i] < 0x7f) ? p[i] : '?';
    out[n] = '\0';
}

static int frame_is_(zmq_msg_t *m, const char *s) {
    size_t n = strlen(s);
    return zmq_msg_size(m) == n && !memcmp(zmq_msg_data(m), s, n);
}

#define ZAP_FRAMES_ 8

// Answers one ZAP request (RFC 27): version "1.0", request id, domain, address, routing id,
// mechanism, credentials... The reply always goes out (a REP that does not answer is stuck, and
// so would be the handshake waiting on it): 1.0, request id, status, text, user id, metadata.
static void zap_answer_(mtrl_wire_auth_server *s) {
    zmq_msg_t f[ZAP_FRAMES_], extra;
    for (int i = 0; i < ZAP_FRAMES_; i++) zmq_msg_init(&f[i]);
    zmq_msg_init(&extra);
    int n = 0, more = 1;
    while (more) {
        zmq_msg_t *m = n < ZAP_FRAMES_ ? &f[n] : &extra;
        if (zmq_msg_recv(m, s->rep, n == 0 ? ZMQ_DONTWAIT : 0) < 0) {
            if (zmq_errno() == EINTR) continue;
            if (n == 0) goto out; // spurious wake-up: nothing to answer
            break;                // cannot happen: the parts of a message arrive together
        }
        more = zmq_msg_more(m);
        n++;
    }
    int ok = 0;
    char why[96] = "", addr[64] = "", mech[16] = "", key_z85[MTRL_WIRE_KEY_Z85_LEN + 1] = "";
    if (n < 6 || n > ZAP_FRAMES_) snprintf(why, sizeof why, "malformed ZAP request (%d frames)", n);
    else if (!frame_is_(&f[0], "1.0")) snprintf(why, sizeof why, "unknown ZAP version");
    else {
        frame_text_(&f[3], addr, sizeof addr);
        frame_text_(&f[5], mech, sizeof mech);
        if (!frame_is_(&f[2], MTRL_WIRE_ZAP_DOMAIN)) {
            char dom[32];
            frame_text_(&f[2], dom, sizeof dom);
            snprintf(why, sizeof why, "ZAP domain '%s' is not '%s'", dom, MTRL_WIRE_ZAP_DOMAIN);
        } else if (strcmp(mech, "CURVE")) {
            snprintf(why, sizeof why, "mechanism %s is not allowed (CURVE only)", mech);
        } else if (n != 7 || zmq_msg_size(&f[6]) != MTRL_WIRE_KEY_BYTES) {
            snprintf(why, sizeof why, "malformed CURVE credentials");
        } else {
            const uint8_t *key = zmq_msg_data(&f[6]);
            mtrl_wire_key_z85(key, key_z85);
            pthread_mutex_lock(&s->mu);
            ok = mtrl_wire_allow_has(&s->allow, key);
            pthread_mutex_unlock(&s->mu);
            if (!ok) snprintf(why, sizeof why, "key not on the allow-list");
        }
    }

    // Counted before the reply goes out: once a handshake has finished, its verdict is in the
    // stats (the tests rely on it).
    pthread_mutex_lock(&s->mu);
    s->stats.requests++;
    if (ok) s->stats.accepted++;
    else {
        s->stats.refused++;
        snprintf(s->stats.last_refused_key, sizeof s->stats.last_refused_key, "%s", key_z85);
        snprintf(s->stats.last_refused_address, sizeof s->stats.last_refused_address, "%s", addr);
        snprintf(s->stats.last_refused_reason, sizeof s->stats.last_refused_reason, "%s", why);
    }
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);

    // The request id is echoed as is (libzmq sends "1"); the user id of an accepted client is
    // its key, which the ROUTER then shows as the messages' "User-Id" property.
    const char *status = ok ? "200" : "400", *text = ok ? "OK" : why;
    const char *user = ok ? key_z85 : "";
    int fail = 0;
    fail |= zmq_send(s->rep, "1.0", 3, ZMQ_SNDMORE) < 0;
    if (n >= 2) fail |= zmq_send(s->rep, zmq_msg_data(&f[1]), zmq_msg_size(&f[1]), ZMQ_SNDMORE) < 0;
    else fail |= zmq_send(s->rep, "", 0, ZMQ_SNDMORE) < 0;
    fail |= zmq_send(s->rep, status, 3, ZMQ_SNDMORE) < 0;
    fail |= zmq_send(s->rep, text, strlen(text), ZMQ_SNDMORE) < 0;
    fail |= zmq_send(s->rep, user, strlen(user), ZMQ_SNDMORE) < 0;
    fail |= zmq_send(s->rep, "", 0, 0) < 0;
    if (fail) LOG_WARN("wire: ZAP reply not sent: %s", zmq_strerror(zmq_errno()));
    if (ok) LOG_INFO("wire: CURVE client %s from %s accepted", key_z85, addr);
    else warn_limited_(s, "wire: refused %s client %s%sfrom %s: %s", mech[0] ? mech : "a", key_z85,
                       key_z85[0] ? " " : "", addr[0] ? addr : "?", why);
out:
    for (int i = 0; i < ZAP_FRAMES_; i++) zmq_msg_close(&f[i]);
    zmq_msg_close(&extra);
}

static const char *protocol_error_text_(uint32_t code) {
    switch (code) {
    case ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: return "mechanism mismatch (a client without CURVE?)";
    case ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: return "cryptographic error (a client with the wrong server key?)";
    case ZMQ_PROTOCOL_ERROR_ZMTP_KEY_EXCHANGE: return "key exchange failed";
    default: return "protocol error";
    }
}

// One monitor event: a 6-byte frame (u16 event, u32 value, native order) and the endpoint.
static void monitor_event_(mtrl_wire_auth_server *s, void *mon) {
    zmq_msg_t ev, ep;
    zmq_msg_init(&ev);
    zmq_msg_init(&ep);
    if (zmq_msg_recv(&ev, mon, ZMQ_DONTWAIT) < 0) goto out;
    if (zmq_msg_more(&ev) && zmq_msg_recv(&ep, mon, 0) < 0) goto out;
    if (zmq_msg_size(&ev) < 6) goto out;
    uint16_t event;
    uint32_t value;
    memcpy(&event, zmq_msg_data(&ev), 2);
    memcpy(&value, (const uint8_t *)zmq_msg_data(&ev) + 2, 4);
    char where[128];
    frame_text_(&ep, where, sizeof where);
    char why[96] = "";
    if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL)
        snprintf(why, sizeof why, "%s (0x%x)", protocol_error_text_(value), value);
    else if (event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) snprintf(why, sizeof why, "refused by ZAP (status %u)", value);
    else if (event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) snprintf(why, sizeof why, "failed: %s", zmq_strerror((int)value));
    pthread_mutex_lock(&s->mu);
    if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) s->stats.handshakes_ok++;
    else if (why[0]) {
        s->stats.handshakes_failed++;
        snprintf(s->stats.last_failed_reason, sizeof s->stats.last_failed_reason, "%s", why);
    }
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    // ZAP refusals were logged when they were made.
    if (why[0] && event != ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) warn_limited_(s, "wire: failed handshake on %s: %s", where, why);
out:
    zmq_msg_close(&ev);
    zmq_msg_close(&ep);
}

static void close_now_(void *sock) {
    if (!sock) return;
    int zero = 0;
    zmq_setsockopt(sock, ZMQ_LINGER, &zero, sizeof zero);
    zmq_close(sock);
}

static void *zap_thread_(void *arg) {
    mtrl_wire_auth_server *s = arg;
    void *mon = NULL;
    int done = 0;
    while (!done && !atomic_load(&s->stop)) {
        zmq_pollitem_t it[3] = {{s->rep, 0, ZMQ_POLLIN, 0}, {s->ctl_thread, 0, ZMQ_POLLIN, 0}, {mon, 0, ZMQ_POLLIN, 0}};
        // The timeout is the second way out: the stop flag is seen even if a control message
        // could not be sent.
        int rc = zmq_poll(it, mon ? 3 : 2, 250);
        if (rc < 0) {
            if (zmq_errno() == EINTR) continue;
            break; // ETERM: the context is going away
        }
        if (it[1].revents & ZMQ_POLLIN) {
            char cmd[256];
            int k = zmq_recv(s->ctl_thread, cmd, sizeof cmd - 1, ZMQ_DONTWAIT);
            if (k > 0 && cmd[0] == 'S') done = 1;
            else if (k > 1 && cmd[0] == 'M' && !mon) {
                // Connect to the ROUTER's monitor endpoint and tell the owner how it went.
                cmd[k < (int)sizeof cmd - 1 ? k : (int)sizeof cmd - 1] = '\0';
                mon = zmq_socket(s->ctx, ZMQ_PAIR);
                int ok = mon && zmq_connect(mon, cmd + 1) == 0;
                if (!ok && mon) {
                    close_now_(mon);
                    mon = NULL;
                }
                zmq_send(s->ctl_thread, ok ? "ok" : "no", 2, ZMQ_DONTWAIT);
            }
        }
        if (done) break;
        if (it[0].revents & ZMQ_POLLIN) zap_answer_(s);
        if (mon && (it[2].revents & ZMQ_POLLIN)) monitor_event_(s, mon);
    }
    close_now_(mon);
    // Unbinding an inproc endpoint is synchronous, closing is not (the reaper thread unregisters
    // it later): once free returns, the context must have no ZAP handler, so that
    // mtrl_wire_router_open refuses CURVE again.
    zmq_unbind(s->rep, ZAP_ENDPOINT_);
    close_now_(s->rep);
    close_now_(s->ctl_thread);
    s->rep = s->ctl_thread = NULL;
    return NULL;
}

static void server_destroy_(mtrl_wire_auth_server *s) {
    if (s->rep) zmq_unbind(s->rep, ZAP_ENDPOINT_); // when start failed after the bind
    close_now_(s->rep);
    close_now_(s->ctl_thread);
    close_now_(s->ctl_owner);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    mtrl_wire_allow_free(&s->allow);
    free(s);
}

mtrl_status mtrl_wire_auth_server_start(mtrl_wire_auth_server **out, void *zctx, const mtrl_wire_keypair *kp,
                                        const mtrl_wire_allow *allow, mtrl_wire_sockopts *opts, mtrl_error *err) {
    *out = NULL;
    if (!zmq_has("curve"))
        return mtrl_error_set(err, MTRL_ERR_USAGE, "zmq: this libzmq has no CURVE support (built without libsodium)");
    mtrl_wire_auth_server *s = xcalloc(1, sizeof *s);
    s->ctx = zctx;
    s->last_log = -1e30;
    atomic_init(&s->stop, 0);
    pthread_mutex_init(&s->mu, NULL);
    mtrl_time_cond_init_mono(&s->cv);
    mtrl_wire_allow_init(&s->allow);
    if (allow)
        for (size_t i = 0; i < allow->n; i++) mtrl_wire_allow_add(&s->allow, allow->keys[i]);
    pthread_mutex_lock(&proc_mu_);
    for (size_t i = 0; i < proc_trusted_.n; i++) mtrl_wire_allow_add(&s->allow, proc_trusted_.keys[i]);
    pthread_mutex_unlock(&proc_mu_);

    // Sockets are made and bound here, before the thread starts (pthread_create is the memory
    // barrier libzmq asks for when a socket changes threads), so the handler is in place when
    // this returns and the ROUTER can be opened right after.
    mtrl_status st = MTRL_OK;
    char ctl[64];
    snprintf(ctl, sizeof ctl, "inproc://mtrl.zap.ctl.%p", (void *)s);
    s->rep = zmq_socket(zctx, ZMQ_REP);
    s->ctl_owner = zmq_socket(zctx, ZMQ_PAIR);
    s->ctl_thread = zmq_socket(zctx, ZMQ_PAIR);
    if (!s->rep || !s->ctl_owner || !s->ctl_thread) {
        st = mtrl_error_set(err, MTRL_ERR_IO, "zmq: cannot create the ZAP handler's sockets: %s", zmq_strerror(zmq_errno()));
    } else {
        int zero = 0, timeout = 1000;
        zmq_setsockopt(s->rep, ZMQ_LINGER, &zero, sizeof zero);
        zmq_setsockopt(s->rep, ZMQ_SNDTIMEO, &timeout, sizeof timeout);
        zmq_setsockopt(s->ctl_owner, ZMQ_LINGER, &zero, sizeof zero);
        zmq_setsockopt(s->ctl_thread, ZMQ_LINGER, &zero, sizeof zero);
        if (zmq_bind(s->rep, ZAP_ENDPOINT_) != 0) {
            int e = zmq_errno();
            st = e == EADDRINUSE ? mtrl_error_set(err, MTRL_ERR_STATE, "zmq: a ZAP handler already runs in this context")
                                 : mtrl_error_set(err, MTRL_ERR_IO, "zmq: cannot bind %s: %s", ZAP_ENDPOINT_, zmq_strerror(e));
        } else if (zmq_bind(s->ctl_owner, ctl) != 0 || zmq_connect(s->ctl_thread, ctl) != 0) {
            st = mtrl_error_set(err, MTRL_ERR_IO, "zmq: cannot set up the ZAP handler's control socket: %s",
                                zmq_strerror(zmq_errno()));
        }
    }
    if (st == MTRL_OK) {
        int e = pthread_create(&s->thread, NULL, zap_thread_, s);
        if (e) st = mtrl_error_set(err, MTRL_ERR_IO, "cannot start the ZAP handler thread: %s", strerror(e));
        else s->started = 1;
    }
    if (st) {
        server_destroy_(s);
        return st;
    }
    opts->curve_server = 1;
    memcpy(opts->curve_secret_key, kp->secret_key, sizeof opts->curve_secret_key);
    *out = s;
    return MTRL_OK;
}

mtrl_status mtrl_wire_auth_server_init(mtrl_wire_auth_server **out, void *zctx, const char *key_file,
                                       const char *allow_path, mtrl_wire_sockopts *opts, mtrl_error *err) {
    *out = NULL;
    if (!key_file || !key_file[0]) return mtrl_error_set(err, MTRL_ERR_USAGE, "CURVE: no server key file given");
    if (!allow_path || !allow_path[0])
        return mtrl_error_set(err, MTRL_ERR_USAGE, "CURVE: %s: an allow-list of actor keys is required ([learner] "
                                                   "curve_allow: a file of keys or a folder of .pub files)", key_file);
    mtrl_wire_keypair kp;
    mtrl_wire_allow allow;
    mtrl_wire_allow_init(&allow);
    mtrl_status st = mtrl_wire_keypair_load(&kp, key_file, err);
    if (st == MTRL_OK) st = mtrl_wire_allow_load(&allow, allow_path, err);
    if (st == MTRL_OK) st = mtrl_wire_auth_server_start(out, zctx, &kp, &allow, opts, err);
    if (st == MTRL_OK) {
        char pub[MTRL_WIRE_KEY_Z85_LEN + 1];
        mtrl_wire_key_z85(kp.public_key, pub);
        size_t total = (*out)->allow.n;
        LOG_INFO("wire: CURVE on, server key %s (%s); %zu key%s allowed (%zu from %s)", pub, key_file, total,
                 total == 1 ? "" : "s", allow.n, allow_path);
        if (total == 0) LOG_WARN("wire: the allow-list %s is empty: no actor can connect", allow_path);
    }
    mtrl_wire_key_wipe(&kp, sizeof kp);
    mtrl_wire_allow_free(&allow);
    return st;
}

mtrl_status mtrl_wire_auth_server_monitor(mtrl_wire_auth_server *s, mtrl_wire_sock *router, mtrl_error *err) {
    if (!s) return MTRL_OK;
    if (!router || !router->sock) return mtrl_error_set(err, MTRL_ERR_STATE, "wire: monitor: the router is not open");
    char ep[80];
    snprintf(ep, sizeof ep, "inproc://mtrl.zap.mon.%p", (void *)s);
    int events = ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                 ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH;
    if (zmq_socket_monitor(router->sock, ep, events) != 0)
        return mtrl_error_set(err, MTRL_ERR_IO, "zmq: cannot monitor the router: %s", zmq_strerror(zmq_errno()));
    char cmd[96];
    int n = snprintf(cmd, sizeof cmd, "M%s", ep);
    // Wait for the thread to connect, so no handshake after this call goes unseen.
    char ack[4] = "";
    if (zmq_send(s->ctl_owner, cmd, (size_t)n, 0) == n) {
        zmq_pollitem_t it = {s->ctl_owner, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 5000) == 1) zmq_recv(s->ctl_owner, ack, sizeof ack - 1, ZMQ_DONTWAIT);
    }
    if (strncmp(ack, "ok", 2)) {
        zmq_socket_monitor(router->sock, NULL, 0);
        return mtrl_error_set(err, MTRL_ERR_IO, "wire: the ZAP handler did not attach to the router's monitor");
    }
    return MTRL_OK;
}

void mtrl_wire_auth_server_allow(mtrl_wire_auth_server *s, const uint8_t key[MTRL_WIRE_KEY_BYTES]) {
    pthread_mutex_lock(&s->mu);
    mtrl_wire_allow_add(&s->allow, key);
    pthread_mutex_unlock(&s->mu);
}

void mtrl_wire_auth_server_stats(mtrl_wire_auth_server *s, mtrl_wire_auth_stats *out) {
    pthread_mutex_lock(&s->mu);
    *out = s->stats;
    pthread_mutex_unlock(&s->mu);
}

int mtrl_wire_auth_server_wait(mtrl_wire_auth_server *s, uint64_t min_refused, uint64_t min_failed, int timeout_ms,
                               mtrl_wire_auth_stats *out) {
    struct timespec until = mtrl_time_mono_deadline(timeout_ms);
    pthread_mutex_lock(&s->mu);
    int reached;
    while (!(reached = s->stats.refused >= min_refused && s->stats.handshakes_failed >= min_failed))
        if (pthread_cond_timedwait(&s->cv, &s->mu, &until) == ETIMEDOUT) {
            reached = s->stats.refused >= min_refused && s->stats.handshakes_failed >= min_failed;
            break;
        }
    if (out) *out = s->stats;
    pthread_mutex_unlock(&s->mu);
    return reached;
}

void mtrl_wire_auth_server_free(mtrl_wire_auth_server *s) {
    if (!s) return;
    if (s->started) {
        atomic_store(&s->stop, 1);
        zmq_send(s->ctl_owner, "S", 1, ZMQ_DONTWAIT);
        pthread_join(s->thread, NULL);
    }
    server_destroy_(s);
}

int mtrl_wire_auth_peer_key(const mtrl_wire_sock *router, char out[MTRL_WIRE_KEY_Z85_LEN + 1]) {
    out[0] = '\0';
    if (!router || !router->router || !router->in[1]) return 0;
    // The header frame of the last message (in[0] is the identity frame the ROUTER made up).
    const char *user = zmq_msg_gets((zmq_msg_t *)router->in[1], "User-Id");
    if (!user || strlen(user) != MTRL_WIRE_KEY_Z85_LEN) return 0;
    memcpy(out, user, MTRL_WIRE_KEY_Z85_LEN + 1);
    return 1;
}

// ---- local actors of `mtrl run` -------------------------------------------------------------------

mtrl_status mtrl_wire_auth_local_init(mtrl_wire_auth_local *lc, const char *out_dir, const char *server_key_file,
                                      mtrl_error *err) {
    memset(lc, 0, sizeof *lc);
    uint8_t server[MTRL_WIRE_KEY_BYTES];
    mtrl_status st = mtrl_wire_key_load_public(server, server_key_file, err);
    if (st) return st;
    char dir[1024];
    if (snprintf(dir, sizeof dir, "%s/.curve-XXXXXX", out_dir) >= (int)sizeof dir)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "%s: path too long", out_dir);
    if (!mkdtemp(dir)) // mode 0700
        return mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot make a private folder for the local actors' key: %s", out_dir,
                              strerror(errno));
    snprintf(lc->dir, sizeof lc->dir, "%s", dir);
    snprintf(lc->key_file, sizeof lc->key_file, "%s/actor.key", dir);
    snprintf(lc->server_pub, sizeof lc->server_pub, "%s/learner.pub", dir);
    mtrl_wire_keypair kp;
    char stem[1100];
    snprintf(stem, sizeof stem, "%s/actor", dir);
    st = mtrl_wire_keypair_new(&kp, err);
    if (st == MTRL_OK) st = mtrl_wire_keypair_save(&kp, stem, err);
    if (st == MTRL_OK) {
        char pub[MTRL_WIRE_KEY_Z85_LEN + 1], text[256];
        mtrl_wire_key_z85(server, pub);
        snprintf(text, sizeof text, "# the learner's CURVE public key, for this run's local actors\npublic = %s\n", pub);
        st = file_publish_(lc->server_pub, text, 0644, err);
    }
    if (st == MTRL_OK) mtrl_wire_auth_trust(kp.public_key);
    mtrl_wire_key_wipe(&kp, sizeof kp);
    if (st) mtrl_wire_auth_local_free(lc);
    return st;
}

void mtrl_wire_auth_local_free(mtrl_wire_auth_local *lc) {
    if (!lc || !lc->dir[0]) return;
    char pub[1100];
    snprintf(pub, sizeof pub, "%s/actor.pub", lc->dir);
    unlink(lc->key_file);
    unlink(pub);
    unlink(lc->server_pub);
    rmdir(lc->dir);
    memset(lc, 0, sizeof *lc);
}
