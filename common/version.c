// version.c: the build's version and git revision (see version.h). The values come from the
// generated header gen/mtrl_version.h (tools/git_version.cmake), which is rewritten only when
// the revision changes, so only this file recompiles.
#include "common/version.h"

#include "mtrl_version.h"

const char *mtrl_version(void) { return MTRL_VERSION_STRING; }
const char *mtrl_git_rev(void) { return MTRL_GIT_REV_STRING; }
