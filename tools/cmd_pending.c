// cmd_pending.c: subcommands whose issue has not landed yet. Each says so plainly and exits 2;
// none pretends to work.
#include <stdio.h>

#include "tools/cli.h"

static int pending_(const char *name, const char *what) {
    fprintf(stderr, "mtrl %s: not available yet: %s has not landed in this build\n", name, what);
    return 2;
}

int cmd_replay(int argc, char **argv) { (void)argc; (void)argv; return pending_("replay", "replay (issue 5)"); }
int cmd_report(int argc, char **argv) { (void)argc; (void)argv; return pending_("report", "report (issue 5)"); }
