// fsutil.c: small file-system helpers (see fsutil.h).
#include "common/fsutil.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

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

FILE *mtrl_file_atomic_begin(const char *path, char *tmp, size_t cap) {
    if (snprintf(tmp, cap, "%s.tmp", path) >= (int)cap) {
        errno = ENAMETOOLONG;
        return NULL;
    }
    return fopen(tmp, "wb");
}

int mtrl_file_atomic_end(FILE *f, const char *tmp, const char *path, int bad) {
    bad |= fflush(f) != 0;
    bad |= fsync(fileno(f)) != 0;
    bad |= fclose(f) != 0;
    int where = bad ? MTRL_FILE_WRITE_FAILED : rename(tmp, path) != 0 ? MTRL_FILE_RENAME_FAILED : 0;
    if (where) {
        int saved = errno;
        unlink(tmp);
        errno = saved;
    }
    return where;
}
