// testproc.h: running the mtrl command from a test and reading what it wrote.
//     test_result r = test_run_in(dir, (char *[]){bin, "replay", "--db", db, NULL});
//     ... r.rc, r.out (stdout), r.err (stderr) ...; test_result_free(&r);
// The command runs in `dir` with OMP_NUM_THREADS=1; its output goes through files in dir.
#ifndef MTRL_TESTPROC_H
#define MTRL_TESTPROC_H

#include <fcntl.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

// A file's contents, NUL-terminated ("" when it cannot be read); *len (nullable) = its size.
static inline char *test_slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return strdup("");
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    size_t got = fread(b, 1, (size_t)n, f);
    b[got] = 0;
    fclose(f);
    if (len) *len = got;
    return b;
}

// Removes a test's temporary folder once every check passed (failed: the count of failed
// checks; a failed run keeps the folder to inspect), saying so when it cannot.
static inline void test_tmpdir_done(const char *dir, int failed) {
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (failed == 0 && system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

// Runs cmd through the shell, what it writes on stdout into out[cap] (NUL-terminated; add
// 2>&1 to cmd for stderr too); returns its exit status, -1 when it could not run or did not exit.
static inline int test_shell(const char *cmd, char *out, size_t cap) {
    out[0] = 0;
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    int rc = pclose(p);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

// Sleeps ms milliseconds (for polling loops, never for timing assertions).
static inline void test_sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

// Starts argv in the background with stdout and stderr appended to log; returns the pid.
static inline pid_t test_start_logged(char *const argv[], const char *log) {
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        dup2(fd, 1);
        dup2(fd, 2);
        setenv("OMP_NUM_THREADS", "1", 1);
        execv(argv[0], argv);
        _exit(127);
    }
    return pid;
}

// How many times `what` occurs in the file at path.
static inline int test_log_count(const char *path, const char *what) {
    char *text = test_slurp(path, NULL);
    int n = 0;
    for (const char *p = text; (p = strstr(p, what)); p++) n++;
    free(text);
    return n;
}

// Polls (up to `seconds`) until `what` occurs `count` times in the file; 1 when it does.
static inline int test_log_wait(const char *path, const char *what, int count, double seconds) {
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        if (test_log_count(path, what) >= count) return 1;
        clock_gettime(CLOCK_MONOTONIC, &t);
        if ((double)(t.tv_sec - t0.tv_sec) + 1e-9 * (double)(t.tv_nsec - t0.tv_nsec) > seconds) return 0;
        test_sleep_ms(50);
    }
}

// The first "tcp://..." endpoint a log mentions (the learner logs the one it bound), "" if none.
static inline void test_log_endpoint(const char *log, char *out, size_t cap) {
    char *text = test_slurp(log, NULL);
    const char *p = strstr(text, "tcp://");
    snprintf(out, cap, "%.*s", p ? (int)strcspn(p, ",\n ") : 0, p ? p : "");
    free(text);
}

typedef struct test_result {
    int rc; // exit status, or 128 + signal
    char *out, *err;
} test_result;

static inline void test_result_free(test_result *r) {
    free(r->out);
    free(r->err);
}

static inline test_result test_run_in(const char *dir, char *const argv[]) {
    char o[512], e[512];
    snprintf(o, sizeof o, "%s/stdout.txt", dir);
    snprintf(e, sizeof e, "%s/stderr.txt", dir);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        if (chdir(dir) != 0) _exit(126);
        int fo = open(o, O_WRONLY | O_CREAT | O_TRUNC, 0644), fe = open(e, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fo, 1);
        dup2(fe, 2);
        setenv("OMP_NUM_THREADS", "1", 1);
        execv(argv[0], argv);
        _exit(127);
    }
    int st;
    waitpid(pid, &st, 0);
    test_result r;
    r.rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    r.out = test_slurp(o, NULL);
    r.err = test_slurp(e, NULL);
    return r;
}

// The first column of the first row of a query on a run store opened read-only (waits for a
// writer up to 5 s), or -1 when the store or the query fails or returns no row.
static inline long long test_query_int(const char *db, const char *sql) {
    sqlite3 *h;
    long long v = -1;
    if (sqlite3_open_v2(db, &h, SQLITE_OPEN_READONLY, NULL) != SQLITE_OK) {
        sqlite3_close(h);
        return -1;
    }
    sqlite3_busy_timeout(h, 5000);
    sqlite3_stmt *st = NULL;
    if (sqlite3_prepare_v2(h, sql, -1, &st, NULL) == SQLITE_OK && sqlite3_step(st) == SQLITE_ROW) v = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    sqlite3_close(h);
    return v;
}

// The first column of every row of a query on a run store opened read-only (waits for a writer
// up to 5 s), up to cap values into v: how many, 0 when the store or the query fails.
static inline int test_query_doubles(const char *db, const char *sql, double *v, int cap) {
    sqlite3 *h;
    int n = 0;
    if (sqlite3_open_v2(db, &h, SQLITE_OPEN_READONLY, NULL) == SQLITE_OK) {
        sqlite3_busy_timeout(h, 5000);
        sqlite3_stmt *st = NULL;
        if (sqlite3_prepare_v2(h, sql, -1, &st, NULL) == SQLITE_OK)
            while (n < cap && sqlite3_step(st) == SQLITE_ROW) v[n++] = sqlite3_column_double(st, 0);
        sqlite3_finalize(st);
    }
    sqlite3_close(h);
    return n;
}

#endif
