// fuzz_trajfile.c: libFuzzer entry for the trajectory-file reader and the writer's torn-tail
// repair (trajfile.h), with the episode decoder behind it (traj.h).
//
// Input: the bytes of a trajectory file (held in a memfd, so nothing touches the disk).
// Properties checked (abort on violation):
//   - iterating never crashes; every record it returns decodes or is refused with a reason, and
//     a record that decodes re-encodes to the same bytes;
//   - reading by offset agrees with iteration;
//   - after a writer opens the file (repairing a torn tail), iteration meets no truncated or
//     corrupt header any more (only data CRC errors of middle records, which the writer does not
//     scan), and a record appended then reads back identically.
//
// Built with clang as fuzz_trajfile (-fsanitize=fuzzer,address,undefined), and inside
// test_fuzz_replay (gcc), which includes this file with LLVMFuzzerTestOneInput renamed.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/log.h"
#include "common/trajfile.h"

static void ft_fail_(const char *what, const char *detail) {
    fprintf(stderr, "fuzz_trajfile: property violated: %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
    abort();
}

// Episodes decoded so far (the replay driver checks valid inputs get through).
static uint64_t ft_decoded_;

// Iterates the whole file; returns the number of good records and leaves the last message in err.
static int ft_iterate_(const char *path, const mtrl_traj_limits *lim, int *last, mtrl_error *err) {
    mtrl_trajfile_reader r;
    if (mtrl_trajfile_reader_open(&r, path, err) != MTRL_OK) ft_fail_("cannot open the memfd for reading", err->msg);
    r.max_record = 1u << 20;
    mtrl_traj t;
    mtrl_traj_init(&t);
    mtrl_wbuf b;
    mtrl_wbuf_init(&b);
    const uint8_t *d;
    size_t n;
    uint64_t off;
    int good = 0, rc;
    while ((rc = mtrl_trajfile_next(&r, &d, &n, &off, err)) == 1) {
        good++;
        mtrl_error e2;
        if (mtrl_traj_decode(&t, d, n, lim, &e2) == MTRL_OK) {
            ft_decoded_++;
            mtrl_wbuf_reset(&b);
            mtrl_traj_encode(&b, &t);
            if (b.len != n || memcmp(b.data, d, n) != 0) ft_fail_("a decoded episode re-encodes differently", NULL);
        } else if (e2.msg[0] == '\0') {
            ft_fail_("an episode refused without a reason", NULL);
        }
        // The same record by offset.
        mtrl_trajfile_reader r2;
        if (mtrl_trajfile_reader_open(&r2, path, &e2) == MTRL_OK) {
            const uint8_t *d2;
            size_t n2;
            mtrl_wbuf_reset(&b);
            mtrl_wbuf_bytes(&b, d, n);
            if (mtrl_trajfile_read_at(&r2, off, &d2, &n2, &e2) != MTRL_OK || n2 != n || memcmp(d2, b.data, n))
                ft_fail_("read_at disagrees with iteration", e2.msg);
            mtrl_trajfile_reader_close(&r2);
        }
    }
    if (rc < 0 && err->msg[0] == '\0') ft_fail_("a bad record without a reason", NULL);
    *last = rc;
    mtrl_wbuf_free(&b);
    mtrl_traj_free(&t);
    mtrl_trajfile_reader_close(&r);
    return good;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static int quiet;
    if (!quiet) {
        mtrl_log_set_level(MTRL_LOG_ERROR); // torn tails are expected here; no warning spam
        quiet = 1;
    }
    int fd = memfd_create("mtrl-fuzz-trajfile", MFD_CLOEXEC);
    if (fd < 0) return 0;
    size_t done = 0;
    while (done < size) {
        ssize_t k = write(fd, data + done, size - done);
        if (k <= 0) {
            close(fd);
            return 0;
        }
        done += (size_t)k;
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    mtrl_traj_limits lim = mtrl_traj_limits_default();
    lim.max_tokens = 1u << 14;
    lim.max_tool_calls = 64;
    lim.max_tool_bytes = 4096;
    lim.max_string = 256;
    lim.max_routing_width = 64;
    lim.max_turns = 64;

    mtrl_error err;
    int last = 0;
    int before = ft_iterate_(path, &lim, &last, &err);

    mtrl_trajfile_writer w;
    if (mtrl_trajfile_writer_open(&w, path, 0, &err) == MTRL_OK) {
        if ((int64_t)w.records < before) ft_fail_("the writer dropped records the reader could read", NULL);
        uint64_t off = 0;
        static const char rec[] = "appended after repair";
        if (mtrl_trajfile_append(&w, rec, sizeof rec, &off, &err) != MTRL_OK) ft_fail_("append failed", err.msg);
        mtrl_trajfile_writer_close(&w, &err);
        int after = ft_iterate_(path, &lim, &last, &err);
        if (last < 0 && !strstr(err.msg, "data CRC mismatch"))
            ft_fail_("after the writer's repair the file still has a torn or corrupt header", err.msg);
        if (last == 0 && after < 1) ft_fail_("the appended record is missing", NULL);
        mtrl_trajfile_reader r;
        if (mtrl_trajfile_reader_open(&r, path, &err) == MTRL_OK) {
            const uint8_t *d;
            size_t n;
            if (mtrl_trajfile_read_at(&r, off, &d, &n, &err) != MTRL_OK || n != sizeof rec || memcmp(d, rec, n))
                ft_fail_("the appended record does not read back", err.msg);
            mtrl_trajfile_reader_close(&r);
        }
    } else if (err.msg[0] == '\0') {
        ft_fail_("the writer refused the file without a reason", NULL);
    }
    close(fd);
    return 0;
}
