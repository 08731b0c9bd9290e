// run_dir.c: the folder of one run under [run] out_dir (see run_dir.h).
#include "learner/run_dir.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/fsutil.h"

mtrl_status mtrl_run_dir_claim(char *dir, size_t cap, const char *out_dir, const char *db, int64_t run, mtrl_error *err) {
    char real[4096], stem[256], owner[4200], want[4200];
    if (mtrl_path_real(db, real, sizeof real) != 0)
        return mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot resolve the run store's path: %s", db, strerror(errno));
    const char *base = strrchr(real, '/');
    snprintf(stem, sizeof stem, "%.200s", base ? base + 1 : real);
    char *dot = strrchr(stem, '.');
    if (dot && dot != stem) *dot = 0;
    if (snprintf(dir, cap, "%s/%s-run%lld", out_dir, stem, (long long)run) >= (int)cap)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "[run] out_dir %s: path too long", out_dir);
    if (mtrl_mkdir_p(dir) != 0)
        return mtrl_error_set(err, MTRL_ERR_IO, "[run] out_dir: cannot create %s: %s", dir, strerror(errno));
    snprintf(owner, sizeof owner, "%s/.owner", dir);
    int n = snprintf(want, sizeof want, "run %lld of %s\n", (long long)run, real);
    // O_EXCL: of two learners that start at once, one claims the folder and the other reads it.
    int fd = open(owner, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd >= 0) {
        int ok = write(fd, want, (size_t)n) == n && fsync(fd) == 0;
        close(fd);
        if (!ok) {
            unlink(owner);
            return mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot write: %s", owner, strerror(errno));
        }
        return MTRL_OK;
    }
    if (errno != EEXIST) return mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot create: %s", owner, strerror(errno));
    char have[4200] = {0};
    FILE *f = fopen(owner, "r");
    size_t got = f ? fread(have, 1, sizeof have - 1, f) : 0;
    if (f) fclose(f);
    have[got] = 0;
    if (!strcmp(have, want)) return MTRL_OK; // --resume of this run
    have[strcspn(have, "\n")] = 0;
    return mtrl_error_set(err, MTRL_ERR_STATE,
                          "[run] out_dir: %s holds the files of %s, not of run %lld of %s; refusing to overwrite them "
                          "(give this run another out_dir, e.g. --set run.out_dir=..., or another run store name)",
                          dir, have[0] ? have : "another run", (long long)run, real);
}
