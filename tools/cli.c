// cli.c: shared helpers of the subcommands (see cli.h).
#include "tools/cli.h"

#include "common/config.h"
#include "env/env_config.h"

#include <stdarg.h>
#include <stdlib.h>
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

int cli_config_load(const char *name, const char *path, int argc, char **argv, mtrl_config *cfg) {
    const char *sets[64];
    int n_sets = cli_collect_sets(argc, argv, sets, 64);
    mtrl_config_errors errs = {0};
    if (mtrl_config_load(cfg, path, sets, n_sets, &errs) == MTRL_OK) return 1;
    mtrl_config_errors_print(&errs, stderr);
    fprintf(stderr, "mtrl %s: %d problem%s in %s\n", name, errs.n, errs.n == 1 ? "" : "s", path);
    mtrl_config_errors_free(&errs);
    return 0;
}

int cli_env_check(const char *name, const char *path, const mtrl_config *cfg, char **tools) {
    mtrl_error err;
    if (mtrl_env_check_config(cfg, tools, &err) != MTRL_OK) {
        fprintf(stderr, "%s: [env] %s\nmtrl %s: 1 problem in %s\n", path, err.msg, name, path);
        return 0;
    }
    // Each stage gives the env its own keys (hops, files, page...): a combination only a later
    // stage makes would otherwise fail when the run reaches it, after hours of the earlier ones.
    int bad = 0;
    for (int s = 0; s < cfg->n_stages; s++) {
        mtrl_config c = mtrl_config_stage(cfg, s);
        if (mtrl_env_check_config(&c, NULL, &err) == MTRL_OK) continue;
        fprintf(stderr, "%s: [stage.%d] with [env]: %s\n", path, s + 1, err.msg);
        bad++;
    }
    if (bad) fprintf(stderr, "mtrl %s: %d problem%s in %s\n", name, bad, bad == 1 ? "" : "s", path);
    if (bad && tools) {
        free(*tools);
        *tools = NULL;
    }
    return !bad;
}
