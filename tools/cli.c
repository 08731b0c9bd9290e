// cli.c: shared helpers of the subcommands (see cli.h).
#include "tools/cli.h"

#include <stdarg.h>
#include <string.h>

int cli_usage_error(const char *name, const char *usage, const char *fmt, ...) {
    fprintf(stderr, "mtrl %s: ", name);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\nusage: %s\n", usage);
    return 2;
}

int cli_is_help(const char *arg) { return !strcmp(arg, "-h") || !strcmp(arg, "--help"); }

int cli_collect_sets(int argc, char **argv, const char **sets, int max) {
    int n = 0;
    for (int i = 1; i < argc && n < max; i++) {
        if (!strcmp(argv[i], "--set") && i + 1 < argc) sets[n++] = argv[++i];
        else if (!strncmp(argv[i], "--set=", 6)) sets[n++] = argv[i] + 6;
    }
    return n;
}
