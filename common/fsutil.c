// fsutil.c: small file-system helpers (see fsutil.h).
#include "common/fsutil.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
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

static int copy_out_(char *out, size_t cap, const char *a, const char *b) {
    if (snprintf(out, cap, "%s%s", a, b) >= (int)cap) {
        errno = ENAMETOOLONG;
        return -1;
    }
    return 0;
}

int mtrl_path_real(const char *path, char *out, size_t cap) {
    char cur[PATH_MAX], res[PATH_MAX];
    if (copy_out_(cur, sizeof cur, path, "")) return -1;
    for (int hops = 0; hops < 40; hops++) {
        if (realpath(cur, res)) return copy_out_(out, cap, res, "");
        if (errno != ENOENT) return -1;
        char *slash = strrchr(cur, '/');
        char link[PATH_MAX];
        ssize_t k = readlink(cur, link, sizeof link - 1);
        if (k >= 0) { // a dangling symlink: where it points is the file that would be created
            link[k] = '\0';
            if (link[0] == '/' || !slash) {
                if (copy_out_(cur, sizeof cur, link, "")) return -1;
            } else {
                slash[1] = '\0';
                char dir[PATH_MAX];
                memcpy(dir, cur, (size_t)(slash - cur) + 2);
                if (copy_out_(cur, sizeof cur, dir, link)) return -1;
            }
            continue;
        }
        // A name that does not exist yet: its folder's real path, then the name.
        const char *base = slash ? slash + 1 : cur;
        if (slash == cur) {
            res[0] = '\0';
        } else {
            if (slash) *slash = '\0';
            if (!realpath(slash ? cur : ".", res)) return -1;
            if (!strcmp(res, "/")) res[0] = '\0';
        }
        char tail[PATH_MAX];
        if (copy_out_(tail, sizeof tail, "/", base)) return -1;
        return copy_out_(out, cap, res, tail);
    }
    errno = ELOOP;
    return -1;
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
