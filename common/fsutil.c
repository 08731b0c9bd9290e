// fsutil.c: small file-system helpers (see fsutil.h).
#include "common/fsutil.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

int mtrl_mkdir_p(const char *path) {
    char buf[4096];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) {
        errno = ENAMETOOLONG;
        return -1;
    }
    for (char *p = buf + 1; *p; p++)
        if (*p == '/') {
            *p = '\0';
            if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
            *p = '/';
        }
    return mkdir(buf, 0755) != 0 && errno != EEXIST ? -1 : 0;
}
