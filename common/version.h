// version.h: what build of mtrl this is (`mtrl --version`, runs.git_rev in the run store).
#ifndef MTRL_VERSION_H
#define MTRL_VERSION_H

// The release, from CMake's project(VERSION), e.g. "0.1.0".
const char *mtrl_version(void);
// `git describe --always --dirty` of the source tree when this binary was built, e.g.
// "704a5e4c1d2e-dirty"; "unknown" when it was built outside a git checkout.
const char *mtrl_git_rev(void);

#endif
