// mtrl-test: cpu timeout=120
// test_install: `cmake --install` gives a plug-in author what env/examples/README.md promises
// (issue 28, item 21). Into a temporary prefix P:
//  - P/bin/mtrl runs (--version), P/include/mtrl/mtrl_env.h, P/share/pkgconfig/mtrl-env.pc,
//    P/share/mtrl/examples/reverse.c and P/share/mtrl/experiments/quickstart.ini are there;
//  - pkg-config --cflags mtrl-env (PKG_CONFIG_PATH=P/share/pkgconfig) names P/include/mtrl;
//  - the example plug-in, copied out of P and built with cc and pkg-config against the
//    installed header only (no -I into the source or build tree), is loaded and created by the
//    installed `mtrl check` from an experiment beside it (plugin = reverse.so), exit 0;
//  - the installed quickstart experiment passes the installed `mtrl check`.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/testhelp.h"
#include "tests/testproc.h"

static char dir_[256];

// Runs a shell command in dir_ and returns its exit status; its output goes to out (cap bytes).
static int sh(const char *cmd, char *out, size_t cap) {
    char full[2400];
    snprintf(full, sizeof full, "cd '%s' && { %s ; } 2>&1", dir_, cmd);
    FILE *p = popen(full, "r");
    if (!p) return -1;
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    int st = pclose(p);
    if (st != 0) fprintf(stderr, "$ %s\n%s", cmd, out);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

static void check_file(const char *prefix, const char *rel) {
    char p[600];
    snprintf(p, sizeof p, "%s/%s", prefix, rel);
    TEST_CHECKF(access(p, F_OK) == 0, "%s is not installed", p);
}

int main(void) {
    const char *build = getenv("MTRL_BUILD");
    if (!build) {
        printf("SKIP: MTRL_BUILD not set (run through ctest)\n");
        return 77;
    }
    if (system("command -v cc >/dev/null && command -v pkg-config >/dev/null && command -v cmake >/dev/null") != 0) {
        printf("SKIP: needs cc, pkg-config and cmake on PATH\n");
        return 77;
    }
    snprintf(dir_, sizeof dir_, "/tmp/mtrl_install_XXXXXX");
    if (!mkdtemp(dir_)) {
        perror("mkdtemp");
        return 1;
    }
    char prefix[300], cmd[2000], out[8192];
    snprintf(prefix, sizeof prefix, "%s/prefix", dir_);
    snprintf(cmd, sizeof cmd, "cmake --install '%s' --prefix '%s'", build, prefix);
    TEST_EQ_INT(sh(cmd, out, sizeof out), 0);
    check_file(prefix, "bin/mtrl");
    check_file(prefix, "include/mtrl/mtrl_env.h");
    check_file(prefix, "share/pkgconfig/mtrl-env.pc");
    check_file(prefix, "share/mtrl/examples/reverse.c");
    check_file(prefix, "share/mtrl/examples/README.md");
    check_file(prefix, "share/mtrl/experiments/quickstart.ini");

    snprintf(cmd, sizeof cmd, "'%s/bin/mtrl' --version", prefix);
    TEST_EQ_INT(sh(cmd, out, sizeof out), 0);
    TEST_CONTAINS(out, "mtrl ");
    TEST_CONTAINS(out, "(git ");

    snprintf(cmd, sizeof cmd, "PKG_CONFIG_PATH='%s/share/pkgconfig' pkg-config --cflags mtrl-env", prefix);
    TEST_EQ_INT(sh(cmd, out, sizeof out), 0);
    char want[400], real[300];
    // pkg-config prints the prefix it found from the .pc file's folder; compare the real paths.
    snprintf(cmd, sizeof cmd, "export PKG_CONFIG_PATH='%s/share/pkgconfig' && readlink -f $(pkg-config --variable=includedir mtrl-env)",
             prefix);
    TEST_EQ_INT(sh(cmd, out, sizeof out), 0);
    TEST_CHECK(realpath(prefix, real) != NULL);
    snprintf(want, sizeof want, "%s/include/mtrl\n", real);
    TEST_EQ_STR(out, want);

    // The README's walk-through, in a folder of the user's own, against the installed header only.
    snprintf(cmd, sizeof cmd,
             "mkdir mine && cd mine && export PKG_CONFIG_PATH='%s/share/pkgconfig' && "
             "cp '%s/share/mtrl/examples/reverse.c' . && "
             "cc -shared -fPIC -fvisibility=hidden $(pkg-config --cflags mtrl-env) -o reverse.so reverse.c && "
             "printf '[run]\\nname = mine\\n[model]\\npreset = tiny\\n[env]\\nname = plugin\\nplugin = reverse.so\\n' > mine.ini",
             prefix, prefix);
    TEST_EQ_INT(sh(cmd, out, sizeof out), 0);
    // From another folder: the plug-in is found beside the experiment.
    snprintf(cmd, sizeof cmd, "'%s/bin/mtrl' check mine/mine.ini", prefix);
    TEST_EQ_INT(sh(cmd, out, sizeof out), 0);
    TEST_CONTAINS(out, "/mine/reverse.so\n");
    // The plug-in really is the example env: the check refuses an argument it does not know.
    snprintf(cmd, sizeof cmd, "'%s/bin/mtrl' check mine/mine.ini --set env.args=nope=1", prefix);
    TEST_EQ_INT(sh(cmd, out, sizeof out), 2);
    TEST_CONTAINS(out, "env 'reverse' refused its config");

    snprintf(cmd, sizeof cmd, "'%s/bin/mtrl' check '%s/share/mtrl/experiments/quickstart.ini' >/dev/null", prefix, prefix);
    TEST_EQ_INT(sh(cmd, out, sizeof out), 0);

    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir_);
    if (test_failed_ == 0 && system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir_);
    return test_report();
}
