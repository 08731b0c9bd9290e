// trajfile.c: length+CRC framed trajectory files (see trajfile.h).
#include "common/trajfile.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "common/check.h"
#include "common/hash.h"
#include "common/log.h"

uint32_t mtrl_trajfile_crc_mask(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

static uint32_t len_crc_(uint64_t len) {
    uint8_t b[8];
    mtrl_st64(b, len);
    return mtrl_trajfile_crc_mask(mtrl_crc32c(0, b, 8));
}

// pread exactly n bytes; returns 0, or -1 with errno (EIO-like short read reported as 0 = EOF).
static int pread_all_(int fd, void *buf, size_t n, uint64_t off) {
    uint8_t *p = buf;
    while (n) {
        ssize_t k = pread(fd, p, n, (off_t)off);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (k == 0) {
            errno = 0; // the file shrank under us
            return -1;
        }
        p += k;
        n -= (size_t)k;
        off += (uint64_t)k;
    }
    return 0;
}

static mtrl_status file_size_(int fd, const char *path, uint64_t *size, mtrl_error *err) {
    struct stat st;
    if (fstat(fd, &st) != 0)
        return mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
    *size = (uint64_t)st.st_size;
    return MTRL_OK;
}

// What a record header at `pos` says, given the file size.
typedef enum frame_verdict {
    FRAME_OK = 0,
    FRAME_SHORT_HEAD,  // fewer than 12 bytes remain
    FRAME_BAD_LEN_CRC, // the length's CRC does not match
    FRAME_SHORT_DATA,  // the record runs past the end of the file
    FRAME_TOO_LONG,    // the length is over the reader's cap
} frame_verdict;

static frame_verdict frame_head_(int fd, uint64_t size, uint64_t pos, uint64_t max_len, uint64_t *len,
                                 int *io_failed) {
    *len = 0;
    *io_failed = 0;
    uint64_t remain = size - pos;
    if (remain < MTRL_TRAJFILE_HEAD) return FRAME_SHORT_HEAD;
    uint8_t h[MTRL_TRAJFILE_HEAD];
    if (pread_all_(fd, h, sizeof h, pos) != 0) {
        *io_failed = 1;
        return FRAME_SHORT_HEAD;
    }
    *len = mtrl_le64(h);
    if (len_crc_(*len) != mtrl_le32(h + 8)) return FRAME_BAD_LEN_CRC;
    if (*len > max_len) return FRAME_TOO_LONG;
    if (*len + MTRL_TRAJFILE_TAIL > remain - MTRL_TRAJFILE_HEAD) return FRAME_SHORT_DATA;
    return FRAME_OK;
}

// Formats a header verdict as the tail of a message ("truncated: header says ...").
static void verdict_text_(frame_verdict v, uint64_t size, uint64_t pos, uint64_t len, uint64_t max_len,
                          char *buf, size_t cap) {
    uint64_t remain = size - pos;
    switch (v) {
    case FRAME_OK: snprintf(buf, cap, "ok"); break;
    case FRAME_SHORT_HEAD:
        snprintf(buf, cap, "truncated: record header needs %d bytes, %llu remain", MTRL_TRAJFILE_HEAD,
                 (unsigned long long)remain);
        break;
    case FRAME_BAD_LEN_CRC: snprintf(buf, cap, "length CRC mismatch (corrupt record header)"); break;
    case FRAME_TOO_LONG:
        snprintf(buf, cap, "header says %llu bytes, over the reader's cap of %llu", (unsigned long long)len,
                 (unsigned long long)max_len);
        break;
    case FRAME_SHORT_DATA: {
        uint64_t after = remain - MTRL_TRAJFILE_HEAD;
        if (after < len)
            snprintf(buf, cap, "truncated: header says %llu bytes, %llu remain", (unsigned long long)len,
                     (unsigned long long)after);
        else
            snprintf(buf, cap, "truncated: data CRC missing (header says %llu bytes, %llu remain)",
                     (unsigned long long)len, (unsigned long long)after);
        break;
    }
    }
}

// Reads the data and the data CRC of a record whose header was accepted; 1 when the CRC matches.
static mtrl_status frame_data_(int fd, const char *path, uint64_t pos, uint64_t len, mtrl_wbuf *buf,
                               int *crc_ok, mtrl_error *err) {
    mtrl_wbuf_reset(buf);
    uint8_t *p = mtrl_wbuf_grow(buf, (size_t)len + MTRL_TRAJFILE_TAIL);
    if (pread_all_(fd, p, (size_t)len + MTRL_TRAJFILE_TAIL, pos + MTRL_TRAJFILE_HEAD) != 0)
        return mtrl_error_set(err, MTRL_ERR_IO, "%s: record at byte %llu: read failed: %s", path,
                              (unsigned long long)pos, errno ? strerror(errno) : "file shrank while reading");
    buf->len = (size_t)len;
    *crc_ok = mtrl_trajfile_crc_mask(mtrl_crc32c(0, p, (size_t)len)) == mtrl_le32(p + len);
    return MTRL_OK;
}

static int all_zero_(int fd, uint64_t from, uint64_t to) {
    uint8_t b[4096];
    while (from < to) {
        size_t n = (size_t)(to - from < sizeof b ? to - from : sizeof b);
        if (pread_all_(fd, b, n, from) != 0) return 0;
        for (size_t i = 0; i < n; i++)
            if (b[i]) return 0;
        from += n;
    }
    return 1;
}

// ---- writer ----------------------------------------------------------------------------------

static void writer_clear_(mtrl_trajfile_writer *w) {
    memset(w, 0, sizeof *w);
    w->fd = -1;
    w->fault_budget = -1;
}

mtrl_status mtrl_trajfile_writer_open(mtrl_trajfile_writer *w, const char *path, int sync_every,
                                      mtrl_error *err) {
    writer_clear_(w);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot open for writing: %s", path, strerror(errno));
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        close(fd);
        if (e == EWOULDBLOCK)
            return mtrl_error_set(err, MTRL_ERR_STATE,
                                  "%s: another writer has this trajectory file open; only one learner may append to it",
                                  path);
        return mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot lock: %s", path, strerror(e));
    }
    uint64_t size = 0;
    mtrl_status st = file_size_(fd, path, &size, err);
    if (st) {
        close(fd);
        return st;
    }

    // Walk the record headers to find where the valid records end.
    uint64_t pos = 0, records = 0, last = UINT64_MAX, last_len = 0;
    frame_verdict v = FRAME_OK;
    uint64_t len = 0;
    while (pos < size) {
        int io = 0;
        v = frame_head_(fd, size, pos, UINT64_MAX - 64, &len, &io);
        if (io) {
            close(fd);
            return mtrl_error_set(err, MTRL_ERR_IO, "%s: read failed at byte %llu: %s", path,
                                  (unsigned long long)pos, strerror(errno));
        }
        if (v != FRAME_OK) break;
        last = pos;
        last_len = len;
        pos += MTRL_TRAJFILE_HEAD + len + MTRL_TRAJFILE_TAIL;
        records++;
    }
    char why[256] = "";
    uint64_t torn_at = pos, torn_record = records;
    if (pos < size) {
        // A bad length CRC with non-zero bytes after it is damage, not an interrupted append.
        if (v == FRAME_BAD_LEN_CRC && !all_zero_(fd, pos, size)) {
            close(fd);
            return mtrl_error_set(err, MTRL_ERR_FORMAT,
                                  "%s: record %llu at byte %llu: length CRC mismatch with %llu bytes after it; "
                                  "the file is corrupt, not torn, so it is not truncated (copy out the records "
                                  "before it, or move the file aside)",
                                  path, (unsigned long long)records, (unsigned long long)pos,
                                  (unsigned long long)(size - pos));
        }
        verdict_text_(v, size, pos, len, UINT64_MAX, why, sizeof why);
        if (v == FRAME_BAD_LEN_CRC) snprintf(why, sizeof why, "zero-filled tail");
    } else if (last != UINT64_MAX) {
        // The headers are intact; an append cut short after the length can still leave a
        // last record whose data never fully reached the disk (zeros): check its data CRC.
        mtrl_wbuf buf;
        mtrl_wbuf_init(&buf);
        int ok = 0;
        st = frame_data_(fd, path, last, last_len, &buf, &ok, err);
        mtrl_wbuf_free(&buf);
        if (st) {
            close(fd);
            return st;
        }
        if (!ok) {
            torn_at = last;
            torn_record = records - 1;
            records--;
            snprintf(why, sizeof why, "data CRC mismatch in the last record");
        }
    }
    if (torn_at < size) {
        LOG_WARN("%s: dropping a torn tail of %llu bytes at byte %llu (record %llu: %s); "
                 "the previous writer probably stopped mid-append",
                 path, (unsigned long long)(size - torn_at), (unsigned long long)torn_at,
                 (unsigned long long)torn_record, why);
        if (ftruncate(fd, (off_t)torn_at) != 0 || fsync(fd) != 0) {
            int e = errno;
            close(fd);
            return mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot truncate the torn tail at byte %llu: %s", path,
                                  (unsigned long long)torn_at, strerror(e));
        }
        size = torn_at;
    }
    w->fd = fd;
    w->path = xstrdup(path);
    w->size = size;
    w->records = records;
    w->sync_every = sync_every;
    return MTRL_OK;
}

// pwritev everything or fail; honours the test fault budget (ENOSPC once it is spent).
static int pwritev_all_(mtrl_trajfile_writer *w, struct iovec *iov, int cnt, uint64_t off) {
    while (cnt > 0) {
        if (iov->iov_len == 0) {
            iov++;
            cnt--;
            continue;
        }
        struct iovec one = *iov;
        if (w->fault_budget >= 0) {
            if (w->fault_budget == 0) {
                errno = ENOSPC;
                return -1;
            }
            if ((int64_t)one.iov_len > w->fault_budget) one.iov_len = (size_t)w->fault_budget;
        }
        ssize_t k = (w->fault_budget >= 0) ? pwrite(w->fd, one.iov_base, one.iov_len, (off_t)off)
                                            : pwritev(w->fd, iov, cnt, (off_t)off);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (w->fault_budget >= 0) w->fault_budget -= k;
        off += (uint64_t)k;
        size_t left = (size_t)k;
        while (cnt > 0 && left >= iov->iov_len) {
            left -= iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + left;
            iov->iov_len -= left;
        }
    }
    return 0;
}

mtrl_status mtrl_trajfile_append(mtrl_trajfile_writer *w, const void *data, size_t n, uint64_t *offset,
                                 mtrl_error *err) {
    if (w->fd < 0) return mtrl_error_set(err, MTRL_ERR_STATE, "trajectory file writer is not open");
    uint8_t head[MTRL_TRAJFILE_HEAD], tail[MTRL_TRAJFILE_TAIL];
    mtrl_st64(head, (uint64_t)n);
    mtrl_st32(head + 8, len_crc_((uint64_t)n));
    mtrl_st32(tail, mtrl_trajfile_crc_mask(mtrl_crc32c(0, data, n)));
    struct iovec iov[3] = {{head, sizeof head}, {(void *)data, n}, {tail, sizeof tail}};
    uint64_t at = w->size;
    if (pwritev_all_(w, iov, 3, at) != 0) {
        int e = errno;
        // Cut the partial record away so the file never holds a torn record we wrote.
        int cut = ftruncate(w->fd, (off_t)at);
        return mtrl_error_set(err, MTRL_ERR_IO, "%s: cannot append a record of %zu bytes at byte %llu: %s%s", w->path,
                              n, (unsigned long long)at, strerror(e),
                              cut ? "; the partial record could not be cut away (it is a torn tail now)" : "");
    }
    w->size = at + MTRL_TRAJFILE_HEAD + n + MTRL_TRAJFILE_TAIL;
    w->records++;
    w->unsynced++;
    if (offset) *offset = at;
    if (w->sync_every) return mtrl_trajfile_sync(w, err);
    return MTRL_OK;
}

mtrl_status mtrl_trajfile_append_traj(mtrl_trajfile_writer *w, const mtrl_traj *t, mtrl_wbuf *scratch,
                                      uint64_t *offset, mtrl_error *err) {
    mtrl_wbuf tmp;
    mtrl_wbuf_init(&tmp);
    mtrl_wbuf *b = scratch ? scratch : &tmp;
    mtrl_wbuf_reset(b);
    mtrl_traj_encode(b, t);
    mtrl_status st = mtrl_trajfile_append(w, b->data, b->len, offset, err);
    mtrl_wbuf_free(&tmp);
    return st;
}

mtrl_status mtrl_trajfile_sync(mtrl_trajfile_writer *w, mtrl_error *err) {
    if (w->fd < 0) return mtrl_error_set(err, MTRL_ERR_STATE, "trajectory file writer is not open");
    if (w->unsynced == 0) return MTRL_OK;
    if (fsync(w->fd) != 0)
        return mtrl_error_set(err, MTRL_ERR_IO, "%s: fsync failed: %s", w->path, strerror(errno));
    w->unsynced = 0;
    return MTRL_OK;
}

mtrl_status mtrl_trajfile_writer_close(mtrl_trajfile_writer *w, mtrl_error *err) {
    if (!w) return MTRL_OK;
    mtrl_status st = MTRL_OK;
    if (w->fd >= 0) {
        st = mtrl_trajfile_sync(w, err);
        close(w->fd); // also drops the flock
    }
    free(w->path);
    writer_clear_(w);
    return st;
}

// ---- reader ----------------------------------------------------------------------------------

mtrl_status mtrl_trajfile_reader_open(mtrl_trajfile_reader *r, const char *path, mtrl_error *err) {
    memset(r, 0, sizeof *r);
    r->fd = -1;
    r->max_record = 4ull << 30;
    mtrl_wbuf_init(&r->buf);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        return mtrl_error_set(err, e == ENOENT ? MTRL_ERR_NOTFOUND : MTRL_ERR_IO, "%s: cannot open: %s", path,
                              strerror(e));
    }
    r->fd = fd;
    r->path = xstrdup(path);
    return MTRL_OK;
}

void mtrl_trajfile_reader_close(mtrl_trajfile_reader *r) {
    if (!r) return;
    if (r->fd >= 0) close(r->fd);
    free(r->path);
    mtrl_wbuf_free(&r->buf);
    memset(r, 0, sizeof *r);
    r->fd = -1;
}

// Reads and checks one record; `label` is "record 3" or "record".
static mtrl_status read_record_(mtrl_trajfile_reader *r, uint64_t pos, const char *label, uint64_t *next,
                                mtrl_error *err) {
    if (r->fd < 0) return mtrl_error_set(err, MTRL_ERR_STATE, "trajectory file reader is not open");
    uint64_t size = 0;
    mtrl_status st = file_size_(r->fd, r->path, &size, err); // the writer may have appended since
    if (st) return st;
    if (pos >= size)
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: %s at byte %llu: past the end of the file (%llu bytes)",
                              r->path, label, (unsigned long long)pos, (unsigned long long)size);
    uint64_t len = 0;
    int io = 0;
    frame_verdict v = frame_head_(r->fd, size, pos, r->max_record, &len, &io);
    if (io)
        return mtrl_error_set(err, MTRL_ERR_IO, "%s: %s at byte %llu: read failed: %s", r->path, label,
                              (unsigned long long)pos, errno ? strerror(errno) : "file shrank while reading");
    if (v != FRAME_OK) {
        char why[256];
        verdict_text_(v, size, pos, len, r->max_record, why, sizeof why);
        return mtrl_error_set(err, v == FRAME_TOO_LONG ? MTRL_ERR_LIMIT : MTRL_ERR_FORMAT, "%s: %s at byte %llu: %s",
                              r->path, label, (unsigned long long)pos, why);
    }
    int ok = 0;
    st = frame_data_(r->fd, r->path, pos, len, &r->buf, &ok, err);
    if (st) return st;
    if (!ok)
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "%s: %s at byte %llu: data CRC mismatch", r->path, label,
                              (unsigned long long)pos);
    *next = pos + MTRL_TRAJFILE_HEAD + len + MTRL_TRAJFILE_TAIL;
    return MTRL_OK;
}

mtrl_status mtrl_trajfile_read_at(mtrl_trajfile_reader *r, uint64_t offset, const uint8_t **data, size_t *n,
                                  mtrl_error *err) {
    uint64_t next = 0;
    *data = NULL;
    *n = 0;
    mtrl_status st = read_record_(r, offset, "record", &next, err);
    if (st) return st;
    *data = r->buf.data;
    *n = r->buf.len;
    return MTRL_OK;
}

mtrl_status mtrl_trajfile_read_traj_at(mtrl_trajfile_reader *r, uint64_t offset, const mtrl_traj_limits *lim,
                                       mtrl_traj *t, mtrl_error *err) {
    const uint8_t *data;
    size_t n;
    mtrl_status st = mtrl_trajfile_read_at(r, offset, &data, &n, err);
    if (st) return st;
    st = mtrl_traj_decode(t, data, n, lim, err);
    if (st) mtrl_error_wrap(err, "%s: record at byte %llu", r->path, (unsigned long long)offset);
    return st;
}

int mtrl_trajfile_next(mtrl_trajfile_reader *r, const uint8_t **data, size_t *n, uint64_t *offset,
                       mtrl_error *err) {
    *data = NULL;
    *n = 0;
    if (r->fd < 0) return mtrl_error_set(err, MTRL_ERR_STATE, "trajectory file reader is not open");
    uint64_t size = 0;
    mtrl_status st = file_size_(r->fd, r->path, &size, err);
    if (st) return st;
    if (r->pos == size) return 0;
    char label[48];
    snprintf(label, sizeof label, "record %llu", (unsigned long long)r->index);
    uint64_t next = 0;
    st = read_record_(r, r->pos, label, &next, err);
    if (st) return st;
    if (offset) *offset = r->pos;
    r->pos = next;
    r->index++;
    *data = r->buf.data;
    *n = r->buf.len;
    return 1;
}

void mtrl_trajfile_rewind(mtrl_trajfile_reader *r) {
    r->pos = 0;
    r->index = 0;
}
