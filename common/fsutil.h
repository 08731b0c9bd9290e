// fsutil.h: small file-system helpers shared by the learner and the commands.
#ifndef MTRL_FSUTIL_H
#define MTRL_FSUTIL_H

// mkdir -p: creates path and its missing parents (mode 0755). 0 on success (also when it already
// exists), -1 with errno set otherwise.
int mtrl_mkdir_p(const char *path);

#endif
