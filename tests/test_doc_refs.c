// mtrl-test: cpu
// test_doc_refs.c: every document a source file cites exists, and so does every section it cites.
//
// Scans the comments of the tree's code (.c .h .cu .cuh: // lines and /* */ blocks; .py .sh
// .cmake, CMakeLists.txt: # lines; .ini: ; and # lines; not the build folders or
// experiments/results) for
//   * a file name ending in .md: it must exist relative to the source root, to docs/, or to the
//     citing file's folder ("docs/model.md", "model.md", "env/examples/README.md");
//   * a section citation "NAME.md §N.M" or "NAME §N.M" (the same with a list: "§6.1, §6.3",
//     ranges "§2.2-2.6", "§2.3/2.4"): docs/NAME.md must exist and have a heading numbered N.M
//     ("## 6. ...", "### 6.1 ..."); NAME without .md counts only when it is a docs file or
//     looks like one (it has a '-' in it, as "rl-systems"), so prose such as "issue 24 §3" is
//     not a citation.
// A failure names the citing file and line. Also checks the checker on text of its own.
#include <ctype.h>
#include <ftw.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tests/testhelp.h"
#include "tests/testproc.h"

static const char *src_;
static int bad_, quiet_;

static int exists_(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

// 1 when docs file `doc` (a path) has a heading numbered `sec` ("6.1"): a line of #s, a space,
// then the number followed by '.', ' ' or the end of the line.
static int has_section_(const char *doc, const char *sec) {
    FILE *f = fopen(doc, "r");
    if (!f) return 0;
    char line[4096];
    size_t n = strlen(sec);
    int found = 0;
    while (!found && fgets(line, sizeof line, f)) {
        const char *p = line;
        if (*p != '#') continue;
        while (*p == '#') p++;
        if (*p != ' ') continue;
        while (*p == ' ') p++;
        found = !strncmp(p, sec, n) && (p[n] == '.' || p[n] == ' ' || p[n] == '\n' || p[n] == '\0');
    }
    fclose(f);
    return found;
}

// Reports one problem at where:line.
static void bad_at_(const char *where, int line, const char *what, const char *name) {
    if (!quiet_) fprintf(stderr, "FAIL %s:%d: %s: %s\n", where, line, what, name);
    bad_++;
}

// The doc that NAME stands for in a citation ("model.md", "architecture"), into out; 0 when NAME
// is not a citation of a document at all.
static int doc_of_(const char *name, char *out, size_t cap) {
    size_t n = strlen(name);
    int md = n > 3 && !strcmp(name + n - 3, ".md");
    const char *base = strrchr(name, '/') ? strrchr(name, '/') + 1 : name;
    if (md) snprintf(out, cap, "%s/docs/%s", src_, base);
    else snprintf(out, cap, "%s/docs/%s.md", src_, base);
    return md || exists_(out) || strchr(base, '-') != NULL;
}

// Checks the .md file names and section citations of one line of text.
static void check_line_(const char *where, const char *dir, int lineno, const char *text) {
    static regex_t md_re, cite_re, sec_re;
    static int compiled;
    if (!compiled) {
        TEST_CHECK(!regcomp(&md_re, "[A-Za-z0-9_./-]*[A-Za-z0-9_-]\\.md", REG_EXTENDED));
        TEST_CHECK(!regcomp(&cite_re, "([A-Za-z0-9_./-]*[A-Za-z0-9_]) (§[0-9][0-9.]*)", REG_EXTENDED));
        TEST_CHECK(!regcomp(&sec_re, "^[,/ –-]*(and |or )?§?([0-9]+(\\.[0-9]+)*)", REG_EXTENDED));
        compiled = 1;
    }
    char name[512], path[4096];
    regmatch_t m[3];
    for (const char *p = text; !regexec(&md_re, p, 1, m, 0); p += m[0].rm_eo) {
        int len = (int)(m[0].rm_eo - m[0].rm_so);
        snprintf(name, sizeof name, "%.*s", len, p + m[0].rm_so);
        if (strstr(name, "://")) continue;
        char a[4096], b[4096], c[4096];
        snprintf(a, sizeof a, "%s/%s", src_, name);
        snprintf(b, sizeof b, "%s/docs/%s", src_, name);
        snprintf(c, sizeof c, "%s/%s", dir, name);
        if (!exists_(a) && !exists_(b) && !exists_(c)) bad_at_(where, lineno, "cites a file that does not exist", name);
    }
    for (const char *p = text; !regexec(&cite_re, p, 3, m, 0); p += m[0].rm_eo) {
        snprintf(name, sizeof name, "%.*s", (int)(m[1].rm_eo - m[1].rm_so), p + m[1].rm_so);
        if (!doc_of_(name, path, sizeof path)) continue;
        if (!exists_(path)) {
            bad_at_(where, lineno, "cites a section of a document that does not exist", name);
            continue;
        }
        // the first section and the list after it
        const char *q = p + m[2].rm_so;
        regmatch_t s[4];
        while (!regexec(&sec_re, q, 4, s, 0)) {
            char sec[64];
            snprintf(sec, sizeof sec, "%.*s", (int)(s[2].rm_eo - s[2].rm_so), q + s[2].rm_so);
            size_t n = strlen(sec);
            while (n && sec[n - 1] == '.') sec[--n] = '\0';
            if (!has_section_(path, sec)) {
                char what[600];
                snprintf(what, sizeof what, "%s §%s", name, sec);
                bad_at_(where, lineno, "cites a section that does not exist", what);
            }
            q += s[0].rm_eo;
            if (*q != ',' && *q != '-' && *q != '/' && strncmp(q, "–", strlen("–")) &&
                strncmp(q, " and §", 6) && strncmp(q, " or §", 5))
                break;
        }
    }
}

// The comment part of one line of a file whose comments start with one of `marks` (at the line's
// start or after a space); in_block: inside a C block comment (updated). NULL: no comment.
static const char *comment_of_(const char *line, const char *marks, int *in_block) {
    const char *p = line;
    while (*p == ' ' || *p == '\t') p++;
    if (*in_block) {
        if (strstr(line, "*/")) *in_block = 0;
        return line;
    }
    for (const char *q = line; *q; q++) {
        if (q != line && q[-1] != ' ' && q[-1] != '\t') continue;
        if (strchr(marks, '/') && q[0] == '/' && q[1] == '/') return q;
        if (strchr(marks, '/') && q[0] == '/' && q[1] == '*') {
            *in_block = !strstr(q, "*/");
            return q;
        }
        if (strchr(marks, q[0]) && q[0] != '/') return q;
    }
    return NULL;
}

// marks: "/" for C's comments, "#" or "#;" for scripts and INI files.
static void check_text_(const char *where, const char *dir, const char *text, const char *marks) {
    int lineno = 1, in_block = 0;
    for (const char *p = text; *p;) {
        const char *e = strchr(p, '\n');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        char *line = strndup(p, n);
        const char *c = comment_of_(line, marks, &in_block);
        if (c) check_line_(where, dir, lineno, c);
        lineno++;
        free(line);
        p += n + (e != NULL);
    }
}

// The comment marks of a code file (check_text_), or NULL for anything else.
static const char *marks_of_(const char *path) {
    static const char *ext[][2] = {{".c", "/"},  {".h", "/"},  {".cu", "/"},     {".cuh", "/"},
                                   {".py", "#"}, {".sh", "#"}, {".cmake", "#"}, {".ini", "#;"}};
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    if (!strcmp(base, "CMakeLists.txt")) return "#";
    const char *dot = strrchr(base, '.');
    if (!dot) return NULL;
    for (size_t i = 0; i < sizeof ext / sizeof *ext; i++)
        if (!strcmp(dot, ext[i][0])) return ext[i][1];
    return NULL;
}

static int files_;

static int visit_(const char *path, const struct stat *sb, int type, struct FTW *ftw) {
    (void)sb;
    const char *rel = path + strlen(src_) + (path[strlen(src_)] == '/');
    const char *base = path + ftw->base;
    if (type == FTW_D) {
        if (ftw->level > 0 && (base[0] == '.' || !strncmp(base, "build", 5) || !strcmp(rel, "experiments/results") ||
                               !strcmp(base, "third_party") || !strcmp(base, "node_modules")))
            return FTW_SKIP_SUBTREE;
        return FTW_CONTINUE;
    }
    const char *marks = type == FTW_F ? marks_of_(path) : NULL;
    if (!marks) return FTW_CONTINUE;
    char *text = test_slurp(path, NULL);
    char dir[4096];
    snprintf(dir, sizeof dir, "%.*s", (int)ftw->base, path);
    if (!strcmp(rel, "tests/test_doc_refs.c")) {
        free(text);  // this file's own examples are checked below, as text
        return FTW_CONTINUE;
    }
    check_text_(rel, dir, text, marks);
    free(text);
    files_++;
    return FTW_CONTINUE;
}

// The checker finds what it must (on text, against this tree's docs).
static void test_checker_(void) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/tests", src_);
    int before = bad_;
    quiet_ = 1;
    check_text_("self", dir, "// model.md §4.3 and docs/architecture.md; architecture §9; model.md §6.1, §6.3, §2.2-2.6\n", "/");
    TEST_EQ_INT(bad_, before);
    check_text_("self", dir, "// rl-systems.md §3\n", "/");  // a document that is not there
    TEST_CHECK(bad_ > before);
    int after = bad_;
    check_text_("self", dir, "// model.md §6.1, §6.9\n", "/");  // a section that is not there
    TEST_EQ_INT(bad_, after + 1);
    after = bad_;
    check_text_("self", dir, "// architecture §42\n// see nothing.md\n", "/");
    TEST_EQ_INT(bad_, after + 2);
    check_text_("self", dir, "// issue 24 §3, P4 §2\n", "/");  // not citations of documents
    TEST_EQ_INT(bad_, after + 2);
    check_text_("self", dir, "    c.md[i] = f(\"share/x/none.md\");\n", "/");  // code, not a comment
    TEST_EQ_INT(bad_, after + 2);
    check_text_("self", dir, "x = 1 # see gone.md\n", "#");
    TEST_EQ_INT(bad_, after + 3);
    quiet_ = 0;
    printf("checker: %d expected problems found in its own examples\n", bad_ - before);
    bad_ = before;
}

int main(void) {
    src_ = getenv("MTRL_SRC");
    if (!src_) {
        fprintf(stderr, "test_doc_refs: MTRL_SRC is not set (ctest sets it)\n");
        return 1;
    }
    test_checker_();
    TEST_CHECK(nftw(src_, visit_, 32, FTW_ACTIONRETVAL | FTW_PHYS) == 0);
    printf("%d source files scanned, %d citations of missing documents or sections\n", files_, bad_);
    TEST_CHECK(files_ > 100);
    TEST_EQ_INT(bad_, 0);
    return test_report();
}
