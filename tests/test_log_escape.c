// mtrl-test: cpu fault timeout=120
// test_log_escape: text from a peer, an env or a model never reaches the log raw (issue 28,
// item 9: "episode 777 aborted: ^[[2J^[[31mFAKE: all runs finished..." was seen on a terminal).
//  1. mtrl_text_escape: C0 controls, DEL, C1 controls, bidi overrides and bytes that are not
//     UTF-8 come out as visible escapes; printable ASCII and UTF-8 pass; truncation is marked and
//     never splits an escape or a character.
//  2. A log line whose argument holds ESC sequences and a newline is one line with no ESC byte.
//  3. A real `mtrl run` with a plug-in whose reset fails with an error text full of terminal
//     escapes (clear screen, red, "\r\n" and a fake log line, a raw 0x9b CSI, U+009B, U+202E):
//     the run finishes, its stderr (learner and actors) holds no control byte but newlines, the
//     aborted episodes are logged with the escapes spelled out, and no event in runs.db holds a
//     control byte either.
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/log.h"
#include "tests/testhelp.h"
#include "tests/testproc.h"

static char dir_[256];

static void check_escape(const char *in, size_t n, const char *want) {
    char out[256];
    size_t got = mtrl_text_escape(out, sizeof out, in, n);
    TEST_EQ_STR(out, want);
    TEST_EQ_INT(got, strlen(want));
}

static void test_escape(void) {
    check_escape("plain text, 1 + 2 = 3", 21, "plain text, 1 + 2 = 3");
    check_escape("\033[2J\033[31mFAKE", 13, "\\x1b[2J\\x1b[31mFAKE");
    check_escape("a\nb\rc\td", 7, "a\\nb\\rc\\td");
    check_escape("nul\0here\x7f", 9, "nul\\x00here\\x7f");
    check_escape("caf\xc3\xa9 \xe2\x86\x92 \xf0\x9f\x99\x82", 14, "caf\xc3\xa9 \xe2\x86\x92 \xf0\x9f\x99\x82");
    check_escape("\xc2\x9b" "31m", 5, "\\u009b31m");             // C1 CSI, UTF-8 encoded
    check_escape("\x9b" "31m", 4, "\\x9b31m");                   // a lone 8-bit CSI byte
    check_escape("\xe2\x80\xae" "evil", 7, "\\u202eevil");       // right-to-left override
    check_escape("\xc0\xaf \xed\xa0\x80 \xf4\x90\x80\x80", 11, "\\xc0\\xaf \\xed\\xa0\\x80 \\xf4\\x90\\x80\\x80");
    check_escape("\xe2\x86", 2, "\\xe2\\x86");                   // a sequence cut short
    // Truncation: "..." at the end, never half an escape.
    char small[12];
    size_t n = mtrl_text_escape(small, sizeof small, "abcdef\033\033\033\033", 10);
    TEST_EQ_STR(small, "abcdef...");
    TEST_EQ_INT(n, 9);
    n = mtrl_text_escape(small, sizeof small, "abcdefghijk", 11); // exactly fits
    TEST_EQ_STR(small, "abcdefghijk");
    n = mtrl_text_escape(small, sizeof small, "abcdefghijkl", 12);
    TEST_EQ_STR(small, "abcdefgh...");
    n = mtrl_text_escape(small, 1, "abc", 3);
    TEST_EQ_STR(small, "");
}

// No byte below 0x20 but '\n', no DEL, no raw 0x9b.
static int count_controls(const char *s, size_t n) {
    int bad = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        bad += (c < 0x20 && c != '\n') || c == 0x7f || c == 0x9b;
    }
    return bad;
}

static void test_log_line(void) {
    char path[320];
    snprintf(path, sizeof path, "%s/log.txt", dir_);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 2);
        mtrl_log_set_tag("learner");
        LOG_WARN("episode %d aborted: %s", 777, "\033[2J\033[31mFAKE: all runs finished\n2026 I learner: done");
        _exit(0);
    }
    int st;
    waitpid(pid, &st, 0);
    size_t n = 0;
    char *text = test_slurp(path, &n);
    TEST_EQ_INT(count_controls(text, n), 0);
    int lines = 0;
    for (size_t i = 0; i < n; i++) lines += text[i] == '\n';
    TEST_EQ_INT(lines, 1);
    TEST_CONTAINS(text, "episode 777 aborted: \\x1b[2J\\x1b[31mFAKE: all runs finished\\n2026 I learner: done");
    free(text);
}

static void test_run(const char *bin) {
    const char *build = getenv("MTRL_BUILD");
    char ini[320], db[320], text[2048];
    snprintf(ini, sizeof ini, "%s/esc.ini", dir_);
    snprintf(db, sizeof db, "%s/esc.db", dir_);
    snprintf(text, sizeof text,
             "[run]\nname = esc\nseed = 3\nsteps = 2\nout_dir = %s/out\ncheckpoint_every = 0\n"
             "[model]\npreset = tiny\n"
             "[env]\nname = plugin\nplugin = %s/lib/libmtrl_env_bad_esc.so\nmax_tool_calls = 1\n"
             "[actor]\ncount = 1\nepisodes_in_flight = 4\nmax_tokens = 24\nmax_turn_tokens = 8\n"
             "[learner]\nbatch_groups = 2\n[algo]\ngroup_size = 2\n",
             dir_, build);
    FILE *f = fopen(ini, "w");
    fputs(text, f);
    fclose(f);
    test_result r = test_run_in(dir_, (char *[]){(char *)bin, "run", ini, "--db", db, NULL});
    size_t n = strlen(r.err);
    TEST_EQ_INT(r.rc, 0);
    TEST_EQ_INT(count_controls(r.err, n), 0);
    TEST_CONTAINS(r.err, "aborted: ");
    TEST_CONTAINS(r.err, "\\x1b[2J\\x1b[31mFAKE: all runs finished\\x1b[0m\\r\\n2026-01-01T00:00:00.000Z I learner: "
                         "run 1 finished\\x9b\\u009b31m\\u202e");
    const char *line = strstr(r.err, "FAKE");
    if (line) {
        const char *eol = strchr(line, '\n');
        printf("logged as: %.*s\n", (int)(eol ? eol - line : 80), line);
    }
    long long aborted = test_query_int(db, "SELECT count(*) FROM episodes WHERE status = 'aborted' AND abort_reason LIKE '%FAKE%'");
    printf("%lld episodes aborted with the escape-laden reason\n", aborted);
    TEST_CHECK(aborted >= 1);
    // Events: no control character (char(27) ESC, char(13) CR, char(10) LF).
    TEST_EQ_INT(test_query_int(db, "SELECT count(*) FROM events WHERE instr(message, char(27)) > 0 OR "
                                   "instr(message, char(13)) > 0 OR instr(message, char(10)) > 0"),
                0);
    if (r.rc != 0) fprintf(stderr, "--- mtrl run stderr ---\n%s\n", r.err);
    test_result_free(&r);
}

int main(void) {
    const char *bin = getenv("MTRL_BIN");
    snprintf(dir_, sizeof dir_, "/tmp/mtrl_esc_XXXXXX");
    if (!mkdtemp(dir_)) {
        perror("mkdtemp");
        return 1;
    }
    test_escape();
    test_log_line();
    if (bin && getenv("MTRL_BUILD")) test_run(bin);
    else printf("SKIP part: MTRL_BIN / MTRL_BUILD not set (run through ctest)\n");
    test_tmpdir_done(dir_, test_failed_);
    return test_report();
}
