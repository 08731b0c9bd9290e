// trajfile.h: append-only trajectory files of length+CRC framed records (TFRecord style).
//
// One episode = one record = the whole-episode encoding of traj.h. A record on disk is
//     u64 length | u32 masked_crc32c(length bytes) | data[length] | u32 masked_crc32c(data)
// all little-endian, where masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8 (TensorFlow's mask:
// a CRC of data that itself holds CRCs stays meaningful). A record's byte offset is its
// identity: the learner stores it in SQLite (episodes.traj_offset) and replay reads it back.
//
// Writer (one per file; the learner): open creates the file if needed, takes an exclusive
// flock on it (a second writer is refused), and walks the record headers. A torn tail left by
// a crash (a partial header, a record running past the end, a zero-filled tail, or a last
// record whose data CRC fails) is truncated away with a warning naming the bytes dropped.
// Damage before the last record is not a torn tail: open refuses with MTRL_ERR_FORMAT instead
// of destroying later records. Append writes one record at the end and returns its offset; if
// the write fails (disk full) the file is cut back to its previous size, so no torn record is
// left behind. Durability: with sync_every the record is fsync'ed before append returns;
// otherwise the caller calls mtrl_trajfile_sync (for example once per learner step).
//
// Reader: read the record at an offset, or iterate from the start. A torn or corrupt record is
// reported precisely with MTRL_ERR_FORMAT and never returned as data:
//     "runs/traj.bin: record 3 at byte 18234: data CRC mismatch"
//     "runs/traj.bin: record 5 at byte 40960: truncated: header says 5012 bytes, 1200 remain"
// (records are numbered from 0; read_at, which does not know the number, says "record at
// byte N"). Record data returned by the reader is borrowed: valid until the next read or close.
#ifndef MTRL_TRAJFILE_H
#define MTRL_TRAJFILE_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "common/traj.h"
#include "common/trajbuf.h"

#define MTRL_TRAJFILE_HEAD 12 // u64 length + u32 masked CRC of the length
#define MTRL_TRAJFILE_TAIL 4  // u32 masked CRC of the data

uint32_t mtrl_trajfile_crc_mask(uint32_t crc);

typedef struct mtrl_trajfile_writer {
    int fd;                 // -1 when closed
    char *path;             // owned copy, for messages
    uint64_t size;          // bytes of valid records = offset of the next record
    uint64_t records;       // records in the file
    int sync_every;         // fsync after every record
    uint64_t unsynced;      // records appended since the last fsync
    int64_t fault_budget;   // tests: bytes that may still be written before writes fail with
                            // ENOSPC; -1 (the default) = no fault injection
} mtrl_trajfile_writer;

// Opens (creating) path for appending. sync_every = 1 fsyncs every record.
mtrl_status mtrl_trajfile_writer_open(mtrl_trajfile_writer *w, const char *path, int sync_every,
                                      mtrl_error *err);
// Appends one record holding n bytes; *offset (may be NULL) receives its byte offset.
mtrl_status mtrl_trajfile_append(mtrl_trajfile_writer *w, const void *data, size_t n, uint64_t *offset,
                                 mtrl_error *err);
// Encodes t (traj.h whole-episode encoding) into scratch (reset first; NULL = a temporary
// buffer) and appends it.
mtrl_status mtrl_trajfile_append_traj(mtrl_trajfile_writer *w, const mtrl_traj *t, mtrl_wbuf *scratch,
                                      uint64_t *offset, mtrl_error *err);
mtrl_status mtrl_trajfile_sync(mtrl_trajfile_writer *w, mtrl_error *err);
// Syncs unsynced records and closes; NULL-safe and safe on a writer that failed to open.
mtrl_status mtrl_trajfile_writer_close(mtrl_trajfile_writer *w, mtrl_error *err);

typedef struct mtrl_trajfile_reader {
    int fd;                 // -1 when closed
    char *path;             // owned copy, for messages
    uint64_t max_record;    // cap on a record's length, checked before allocating (default 4 GiB)
    uint64_t pos;           // iteration: offset of the next record
    uint64_t index;         // iteration: number of the next record
    mtrl_wbuf buf;          // the last record's bytes
} mtrl_trajfile_reader;

mtrl_status mtrl_trajfile_reader_open(mtrl_trajfile_reader *r, const char *path, mtrl_error *err);
void mtrl_trajfile_reader_close(mtrl_trajfile_reader *r); // NULL-safe

// The record at `offset`: *data, *n borrowed until the next read.
mtrl_status mtrl_trajfile_read_at(mtrl_trajfile_reader *r, uint64_t offset, const uint8_t **data,
                                  size_t *n, mtrl_error *err);
// The record at `offset`, decoded into t (mtrl_traj_decode: token count and digest checked).
mtrl_status mtrl_trajfile_read_traj_at(mtrl_trajfile_reader *r, uint64_t offset,
                                       const mtrl_traj_limits *lim, mtrl_traj *t, mtrl_error *err);

// Iteration from the start: returns 1 with the next record (*offset may be NULL), 0 at a clean
// end of file, or a negative mtrl_status for a torn or corrupt record (iteration stays there).
int mtrl_trajfile_next(mtrl_trajfile_reader *r, const uint8_t **data, size_t *n, uint64_t *offset,
                       mtrl_error *err);
void mtrl_trajfile_rewind(mtrl_trajfile_reader *r);

#endif
