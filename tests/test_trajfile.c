// mtrl-test: cpu fault timeout=120
// test_trajfile: length+CRC framed trajectory files (common/trajfile.h): write and read back,
// torn tails at every byte of the last record (reported precisely, truncated by the next
// writer), bit flips (CRC errors), a second writer refused, a failed append leaves no torn
// record.
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/hash.h"
#include "common/trajfile.h"
#include "tests/fuzz/trajgen.h"
#include "tests/testhelp.h"

#define N_EP 8

static char dir_[256];
static mtrl_traj eps_[N_EP];
static uint64_t offs_[N_EP + 1]; // offs_[N_EP] = file size
static uint8_t *file_;           // the whole good file
static size_t file_len_;

static void path_of(char *buf, size_t cap, const char *name) { snprintf(buf, cap, "%s/%s", dir_, name); }

static void write_bytes(const char *path, const uint8_t *p, size_t n) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    TEST_CHECK(fd >= 0);
    if (fd < 0) return;
    TEST_CHECK(write(fd, p, n) == (ssize_t)n);
    close(fd);
}

static uint8_t *read_bytes(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *p = malloc((size_t)len + 1);
    *n = fread(p, 1, (size_t)len, f);
    fclose(f);
    return p;
}

static uint64_t file_size(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 ? (uint64_t)st.st_size : 0;
}

// Iterates path; returns the number of good records, the final return code in *last and the
// message in err.
static int iterate(const char *path, int *last, mtrl_error *err) {
    mtrl_trajfile_reader r;
    TEST_EQ_INT(mtrl_trajfile_reader_open(&r, path, err), MTRL_OK);
    int good = 0, rc;
    const uint8_t *d;
    size_t n;
    uint64_t off;
    mtrl_traj_limits lim = mtrl_traj_limits_default();
    mtrl_traj t;
    mtrl_traj_init(&t);
    while ((rc = mtrl_trajfile_next(&r, &d, &n, &off, err)) == 1) {
        if (good < N_EP) {
            TEST_EQ_INT(off, offs_[good]);
            TEST_EQ_INT(mtrl_traj_decode(&t, d, n, &lim, err), MTRL_OK);
            TEST_CHECK(mtrl_traj_equal(&t, &eps_[good], NULL, 0));
        }
        good++;
    }
    *last = rc;
    mtrl_traj_free(&t);
    mtrl_trajfile_reader_close(&r);
    return good;
}

static void test_write_read(void) {
    char path[300];
    path_of(path, sizeof path, "traj.bin");
    tg_rng rng = {2024};
    mtrl_trajfile_writer w;
    mtrl_error err;
    TEST_EQ_INT(mtrl_trajfile_writer_open(&w, path, 0, &err), MTRL_OK);
    TEST_EQ_INT(w.size, 0);
    mtrl_wbuf scratch;
    mtrl_wbuf_init(&scratch);
    for (int i = 0; i < N_EP; i++) {
        mtrl_traj_init(&eps_[i]);
        tg_traj(&eps_[i], &rng, 20 + tg_below(&rng, 60), i % 2 ? 4 : 0, i % 4 == 3, tg_below(&rng, 3));
        TEST_EQ_INT(mtrl_trajfile_append_traj(&w, &eps_[i], &scratch, &offs_[i], &err), MTRL_OK);
        if (i == 3) TEST_EQ_INT(mtrl_trajfile_sync(&w, &err), MTRL_OK);
    }
    offs_[N_EP] = w.size;
    TEST_EQ_INT(w.records, N_EP);
    TEST_EQ_INT(offs_[0], 0);
    // A second writer on the same file is refused while the first holds it.
    mtrl_trajfile_writer w2;
    TEST_EQ_INT(mtrl_trajfile_writer_open(&w2, path, 0, &err), MTRL_ERR_STATE);
    TEST_CONTAINS(err.msg, "another writer has this trajectory file open");
    TEST_EQ_INT(mtrl_trajfile_writer_close(&w, &err), MTRL_OK);
    TEST_EQ_INT(file_size(path), offs_[N_EP]);

    // Random access by offset, in reverse order.
    mtrl_trajfile_reader r;
    TEST_EQ_INT(mtrl_trajfile_reader_open(&r, path, &err), MTRL_OK);
    mtrl_traj_limits lim = mtrl_traj_limits_default();
    mtrl_traj t;
    mtrl_traj_init(&t);
    for (int i = N_EP - 1; i >= 0; i--) {
        TEST_EQ_INT(mtrl_trajfile_read_traj_at(&r, offs_[i], &lim, &t, &err), MTRL_OK);
        char why[128];
        TEST_CHECKF(mtrl_traj_equal(&t, &eps_[i], why, sizeof why), "episode %d: %s", i, why);
    }
    // An offset that is not a record start is a CRC error, not garbage.
    TEST_EQ_INT(mtrl_trajfile_read_traj_at(&r, offs_[2] + 4, &lim, &t, &err), MTRL_ERR_FORMAT);
    TEST_CONTAINS(err.msg, "length CRC mismatch");
    TEST_EQ_INT(mtrl_trajfile_read_traj_at(&r, offs_[N_EP] + 100, &lim, &t, &err), MTRL_ERR_FORMAT);
    TEST_CONTAINS(err.msg, "past the end of the file");
    mtrl_traj_free(&t);
    mtrl_trajfile_reader_close(&r);

    int last = 0;
    TEST_EQ_INT(iterate(path, &last, &err), N_EP);
    TEST_EQ_INT(last, 0);

    // Reopening for append continues after the last record.
    TEST_EQ_INT(mtrl_trajfile_writer_open(&w, path, 1, &err), MTRL_OK);
    TEST_EQ_INT(w.size, offs_[N_EP]);
    TEST_EQ_INT(w.records, N_EP);
    mtrl_trajfile_writer_close(&w, &err);
    file_ = read_bytes(path, &file_len_);
    TEST_EQ_INT(file_len_, offs_[N_EP]);
    mtrl_wbuf_free(&scratch);

    // The on-disk frame, byte by byte (TFRecord layout).
    char p2[300];
    path_of(p2, sizeof p2, "abc.bin");
    TEST_EQ_INT(mtrl_trajfile_writer_open(&w, p2, 0, &err), MTRL_OK);
    uint64_t off = 99;
    TEST_EQ_INT(mtrl_trajfile_append(&w, "abc", 3, &off, &err), MTRL_OK);
    TEST_EQ_INT(off, 0);
    mtrl_trajfile_writer_close(&w, &err);
    size_t n = 0;
    uint8_t *b = read_bytes(p2, &n);
    TEST_EQ_INT(n, 12 + 3 + 4);
    if (b && n == 19) {
        uint8_t len[8] = {3, 0, 0, 0, 0, 0, 0, 0};
        TEST_CHECK(memcmp(b, len, 8) == 0);
        TEST_EQ_INT(mtrl_le32(b + 8), mtrl_trajfile_crc_mask(mtrl_crc32c(0, len, 8)));
        TEST_CHECK(memcmp(b + 12, "abc", 3) == 0);
        TEST_EQ_INT(mtrl_le32(b + 15), mtrl_trajfile_crc_mask(mtrl_crc32c(0, "abc", 3)));
    }
    free(b);
    TEST_EQ_INT(mtrl_trajfile_crc_mask(0), 0xa282ead8u);
    unlink(p2);
}

// Cut the file at every byte inside the last record.
static void test_torn_tail(void) {
    char path[300];
    path_of(path, sizeof path, "torn.bin");
    uint64_t start = offs_[N_EP - 1], end = offs_[N_EP];
    uint64_t len = end - start - 16;
    int reopened = 0;
    for (uint64_t cut = start + 1; cut < end; cut++) {
        write_bytes(path, file_, (size_t)cut);
        mtrl_error err;
        int last = 0;
        int good = iterate(path, &last, &err);
        TEST_EQ_INT(good, N_EP - 1);
        TEST_EQ_INT(last, MTRL_ERR_FORMAT);
        char want[700];
        uint64_t remain = cut - start;
        if (remain < 12)
            snprintf(want, sizeof want, "%s: record %d at byte %llu: truncated: record header needs 12 bytes, %llu remain",
                     path, N_EP - 1, (unsigned long long)start, (unsigned long long)remain);
        else if (remain - 12 < len)
            snprintf(want, sizeof want, "%s: record %d at byte %llu: truncated: header says %llu bytes, %llu remain", path,
                     N_EP - 1, (unsigned long long)start, (unsigned long long)len, (unsigned long long)(remain - 12));
        else
            snprintf(want, sizeof want, "%s: record %d at byte %llu: truncated: data CRC missing (header says %llu bytes, "
                     "%llu remain)", path, N_EP - 1, (unsigned long long)start, (unsigned long long)len,
                     (unsigned long long)(remain - 12));
        TEST_EQ_STR(err.msg, want);
        // read_at says the same, without the record number.
        mtrl_trajfile_reader r;
        mtrl_trajfile_reader_open(&r, path, &err);
        const uint8_t *d;
        size_t n;
        TEST_EQ_INT(mtrl_trajfile_read_at(&r, start, &d, &n, &err), MTRL_ERR_FORMAT);
        TEST_CONTAINS(err.msg, "record at byte");
        TEST_CONTAINS(err.msg, "truncated");
        TEST_CHECK(d == NULL);
        TEST_EQ_INT(mtrl_trajfile_read_at(&r, offs_[N_EP - 2], &d, &n, &err), MTRL_OK);
        mtrl_trajfile_reader_close(&r);
        // The next writer cuts the torn tail away (a subset of cuts: each reopen fsyncs).
        if (cut < start + 14 || cut > end - 6 || cut % 37 == 0) {
            mtrl_trajfile_writer w;
            TEST_EQ_INT(mtrl_trajfile_writer_open(&w, path, 0, &err), MTRL_OK);
            TEST_EQ_INT(w.size, start);
            TEST_EQ_INT(w.records, N_EP - 1);
            TEST_EQ_INT(file_size(path), start);
            // ... and appending after it gives a clean file again.
            uint64_t off = 0;
            mtrl_wbuf b;
            mtrl_wbuf_init(&b);
            TEST_EQ_INT(mtrl_trajfile_append_traj(&w, &eps_[N_EP - 1], &b, &off, &err), MTRL_OK);
            TEST_EQ_INT(off, start);
            mtrl_wbuf_free(&b);
            mtrl_trajfile_writer_close(&w, &err);
            TEST_EQ_INT(iterate(path, &last, &err), N_EP);
            TEST_EQ_INT(last, 0);
            reopened++;
        }
    }
    printf("torn tail: %llu cuts checked, %d reopened\n", (unsigned long long)(end - start - 1), reopened);
    // A zero-filled tail (the file system extended the file, the data never landed).
    uint8_t *z = calloc(1, file_len_ + 300);
    memcpy(z, file_, file_len_);
    write_bytes(path, z, file_len_ + 300);
    mtrl_trajfile_writer w;
    mtrl_error err;
    TEST_EQ_INT(mtrl_trajfile_writer_open(&w, path, 0, &err), MTRL_OK);
    TEST_EQ_INT(w.size, file_len_);
    TEST_EQ_INT(w.records, N_EP);
    mtrl_trajfile_writer_close(&w, &err);
    // A last record whose data is damaged: dropped as torn.
    memcpy(z, file_, file_len_);
    z[end - 10] ^= 0x20;
    write_bytes(path, z, file_len_);
    TEST_EQ_INT(mtrl_trajfile_writer_open(&w, path, 0, &err), MTRL_OK);
    TEST_EQ_INT(w.size, start);
    TEST_EQ_INT(w.records, N_EP - 1);
    mtrl_trajfile_writer_close(&w, &err);
    free(z);
    unlink(path);
}

static void test_bit_flips(void) {
    char path[300];
    path_of(path, sizeof path, "flip.bin");
    uint8_t *c = malloc(file_len_);
    mtrl_error err;
    int last = 0;
    // A flipped data bit in record 3.
    uint64_t rec = offs_[3];
    memcpy(c, file_, file_len_);
    c[rec + 12 + 40] ^= 0x08;
    write_bytes(path, c, file_len_);
    TEST_EQ_INT(iterate(path, &last, &err), 3);
    TEST_EQ_INT(last, MTRL_ERR_FORMAT);
    char want[700];
    snprintf(want, sizeof want, "%s: record 3 at byte %llu: data CRC mismatch", path, (unsigned long long)rec);
    TEST_EQ_STR(err.msg, want);
    // The other records stay readable by offset; a middle data error is not a torn tail, so
    // the writer keeps it (readers report it).
    mtrl_trajfile_reader r;
    mtrl_trajfile_reader_open(&r, path, &err);
    const uint8_t *d;
    size_t n;
    TEST_EQ_INT(mtrl_trajfile_read_at(&r, offs_[4], &d, &n, &err), MTRL_OK);
    TEST_EQ_INT(mtrl_trajfile_read_at(&r, offs_[3], &d, &n, &err), MTRL_ERR_FORMAT);
    mtrl_trajfile_reader_close(&r);
    mtrl_trajfile_writer w;
    TEST_EQ_INT(mtrl_trajfile_writer_open(&w, path, 0, &err), MTRL_OK);
    TEST_EQ_INT(w.size, file_len_);
    mtrl_trajfile_writer_close(&w, &err);
    // A flipped bit in record 5's length: the reader says so; the writer refuses to truncate
    // good records after it.
    memcpy(c, file_, file_len_);
    c[offs_[5] + 1] ^= 0x01;
    write_bytes(path, c, file_len_);
    TEST_EQ_INT(iterate(path, &last, &err), 5);
    snprintf(want, sizeof want, "%s: record 5 at byte %llu: length CRC mismatch", path, (unsigned long long)offs_[5]);
    TEST_CONTAINS(err.msg, want);
    TEST_EQ_INT(mtrl_trajfile_writer_open(&w, path, 0, &err), MTRL_ERR_FORMAT);
    TEST_CONTAINS(err.msg, "corrupt, not torn");
    TEST_EQ_INT(file_size(path), file_len_);
    // A bit flipped inside the record's data CRC itself.
    memcpy(c, file_, file_len_);
    c[offs_[6] - 2] ^= 0x40;
    write_bytes(path, c, file_len_);
    TEST_EQ_INT(iterate(path, &last, &err), 5);
    TEST_CONTAINS(err.msg, "record 5 at byte");
    TEST_CONTAINS(err.msg, "data CRC mismatch");
    free(c);
    unlink(path);
}

// A write that fails part-way (disk full) leaves the file as it was.
static void test_failed_append(void) {
    char path[300];
    path_of(path, sizeof path, "full.bin");
    write_bytes(path, file_, file_len_);
    mtrl_trajfile_writer w;
    mtrl_error err;
    TEST_EQ_INT(mtrl_trajfile_writer_open(&w, path, 0, &err), MTRL_OK);
    w.fault_budget = 100;
    uint64_t off = 0;
    mtrl_status st = mtrl_trajfile_append_traj(&w, &eps_[0], NULL, &off, &err);
    TEST_EQ_INT(st, MTRL_ERR_IO);
    TEST_CONTAINS(err.msg, strerror(ENOSPC));
    TEST_EQ_INT(file_size(path), file_len_);
    TEST_EQ_INT(w.size, file_len_);
    w.fault_budget = -1;
    TEST_EQ_INT(mtrl_trajfile_append_traj(&w, &eps_[0], NULL, &off, &err), MTRL_OK);
    TEST_EQ_INT(off, file_len_);
    mtrl_trajfile_writer_close(&w, &err);
    int last = 0;
    TEST_EQ_INT(iterate(path, &last, &err), N_EP + 1);
    TEST_EQ_INT(last, 0);
    unlink(path);
    // Opening a missing file for reading names it.
    mtrl_trajfile_reader r;
    TEST_EQ_INT(mtrl_trajfile_reader_open(&r, path, &err), MTRL_ERR_NOTFOUND);
    TEST_CONTAINS(err.msg, "full.bin");
}

int main(void) {
    snprintf(dir_, sizeof dir_, "/tmp/mtrl_trajfile_XXXXXX");
    if (!mkdtemp(dir_)) {
        perror("mkdtemp");
        return 1;
    }
    test_write_read();
    if (file_) {
        test_torn_tail();
        test_bit_flips();
        test_failed_append();
    }
    char path[300];
    path_of(path, sizeof path, "traj.bin");
    unlink(path);
    rmdir(dir_);
    for (int i = 0; i < N_EP; i++) mtrl_traj_free(&eps_[i]);
    free(file_);
    return test_report();
}
