// fsutil.h: small file-system helpers shared by the learner, the actor and the commands.
#ifndef MTRL_FSUTIL_H
#define MTRL_FSUTIL_H

#include <stddef.h>

// mkdir -p: creates path and its missing parents (mode 0755). 0 on success (also when it already
// exists), -1 with errno set otherwise.
int mtrl_mkdir_p(const char *path);

// The canonical absolute path of path (symlinks and "."/".." resolved), into out (cap bytes),
// also for a file that does not exist yet: then its folder is resolved, and a dangling symlink
// is followed to the name it would create. Two names of one file (a symlink, a relative and an
// absolute spelling) give the same result; hard links do not. 0, or -1 with errno set (the
// folder does not exist, ELOOP, ENAMETOOLONG).
int mtrl_path_real(const char *path, char *out, size_t cap);

// Writing a file so that a reader sees the old one or the whole new one, never a torn one:
// mtrl_file_atomic_begin opens "<path>.tmp" (written into tmp, cap bytes) for writing; write to
// it, then mtrl_file_atomic_end flushes, fsyncs and closes it and renames it over path. bad != 0
// says a write already failed. On failure the temp file is removed, path is untouched, errno
// says why, and the result tells where: MTRL_FILE_WRITE_FAILED or MTRL_FILE_RENAME_FAILED.
#include <stdio.h>
#define MTRL_FILE_WRITE_FAILED 1
#define MTRL_FILE_RENAME_FAILED 2
FILE *mtrl_file_atomic_begin(const char *path, char *tmp, size_t cap); // NULL with errno set
int mtrl_file_atomic_end(FILE *f, const char *tmp, const char *path, int bad);

#endif
