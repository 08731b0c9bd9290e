// weights_shm.c: the same-host weight channel (see weights_shm.h).
#include "common/weights_shm.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/check.h"

#define MAGIC "MTRLWSH1"
#define HEADER_BYTES 4096u
#define PAGE_ROUND(x) (((x) + 4095u) & ~(uint64_t)4095u)
#define STAMP_VALID ((uint64_t)1 << 32)
#define LATEST_SET 0x80u

// The segment's first page. Fixed-width fields only: a reader of another build of the same
// source sees the same bytes (HEADER_BYTES and the magic would change with the layout).
typedef struct header {
    char magic[8];
    uint32_t header_bytes;
    uint32_t kind;
    uint64_t nonce;
    uint64_t layout_hash;
    uint64_t slot_bytes;
    uint64_t slot_offset[MTRL_WSHM_SLOTS]; // HOST: where each slot starts in the segment
    uint64_t segment_bytes;
    int64_t writer_pid;
    _Atomic uint64_t seq[MTRL_WSHM_SLOTS];   // odd while the slot is being written
    _Atomic uint64_t stamp[MTRL_WSHM_SLOTS]; // STAMP_VALID | version of a complete slot
    _Atomic uint64_t latest;                 // version << 8 | LATEST_SET | slot; 0 = nothing yet
    uint8_t ipc[MTRL_WSHM_SLOTS][MTRL_WSHM_IPC_BYTES];
} header;

_Static_assert(sizeof(header) <= HEADER_BYTES, "the channel header must fit its page");

struct mtrl_wshm {
    int writer;
    char name[MTRL_WSHM_NAME_MAX];
    void *base;
    size_t bytes;
    header *h;
};

static mtrl_status map_(mtrl_wshm *w, int fd, size_t bytes, int prot, mtrl_error *err) {
    void *p = mmap(NULL, bytes, prot, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return mtrl_error_set(err, MTRL_ERR_IO, "weight channel %s: mmap of %zu bytes: %s", w->name, bytes, strerror(errno));
    w->base = p;
    w->bytes = bytes;
    w->h = p;
    return MTRL_OK;
}

// Removes the channels of writers that are gone: a learner killed with SIGKILL cannot unlink its
// name, and its slots (gigabytes for `small`) would stay in /dev/shm until reboot. A name holds
// its writer's pid; one whose process no longer exists is stale. (A live process that reused
// the pid keeps the segment: the safe side.)
static void sweep_stale_(void) {
    DIR *d = opendir("/dev/shm");
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        int pid;
        char rest[32];
        if (sscanf(e->d_name, "mtrl-w.%d.%16[0-9a-f]", &pid, rest) != 2 || pid <= 0) continue;
        if (kill(pid, 0) == 0 || errno != ESRCH) continue;
        char name[300];
        snprintf(name, sizeof name, "/%s", e->d_name);
        shm_unlink(name);
    }
    closedir(d);
}

mtrl_status mtrl_wshm_create(mtrl_wshm **out, mtrl_wshm_kind kind, uint64_t slot_bytes, uint64_t layout_hash,
                             mtrl_error *err) {
    *out = NULL;
    sweep_stale_();
    uint64_t nonce = 0;
    if (getrandom(&nonce, sizeof nonce, 0) != (ssize_t)sizeof nonce) nonce = (uint64_t)getpid() * 0x9e3779b97f4a7c15ull ^ (uint64_t)(uintptr_t)&nonce;
    mtrl_wshm *w = xcalloc(1, sizeof *w);
    w->writer = 1;
    snprintf(w->name, sizeof w->name, "/mtrl-w.%d.%016" PRIx64, (int)getpid(), nonce);
    uint64_t slot_at = PAGE_ROUND(slot_bytes);
    uint64_t bytes = HEADER_BYTES + (kind == MTRL_WSHM_HOST ? MTRL_WSHM_SLOTS * slot_at : 0);
    int fd = shm_open(w->name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
        mtrl_status st = mtrl_error_set(err, MTRL_ERR_IO, "weight channel %s: shm_open: %s", w->name, strerror(errno));
        free(w);
        return st;
    }
    mtrl_status st = MTRL_OK;
    int e = ftruncate(fd, (off_t)bytes) ? errno : posix_fallocate(fd, 0, (off_t)bytes);
    if (e)
        st = mtrl_error_set(err, e == ENOSPC ? MTRL_ERR_NOMEM : MTRL_ERR_IO,
                            "weight channel %s: cannot reserve %.2f GB in /dev/shm: %s", w->name, bytes / 1e9, strerror(e));
    if (st == MTRL_OK) st = map_(w, fd, bytes, PROT_READ | PROT_WRITE, err);
    close(fd);
    if (st != MTRL_OK) {
        shm_unlink(w->name);
        free(w);
        return st;
    }
    header *h = w->h;
    memset(h, 0, sizeof *h);
    h->header_bytes = HEADER_BYTES;
    h->kind = (uint32_t)kind;
    h->nonce = nonce;
    h->layout_hash = layout_hash;
    h->slot_bytes = slot_bytes;
    for (int s = 0; s < MTRL_WSHM_SLOTS && kind == MTRL_WSHM_HOST; s++) h->slot_offset[s] = HEADER_BYTES + (uint64_t)s * slot_at;
    h->segment_bytes = bytes;
    h->writer_pid = getpid();
    // The magic last: a reader that opens the name before the header is complete sees no magic.
    atomic_thread_fence(memory_order_release);
    memcpy(h->magic, MAGIC, 8);
    *out = w;
    return MTRL_OK;
}

int mtrl_wshm_next_slot(const mtrl_wshm *w) {
    uint64_t l = atomic_load_explicit(&w->h->latest, memory_order_acquire);
    return l ? (int)((l & 1) ^ 1) : 0;
}

void *mtrl_wshm_write_begin(mtrl_wshm *w, int *slot) {
    MTRL_CHECK(w->writer);
    int s = mtrl_wshm_next_slot(w);
    header *h = w->h;
    uint64_t q = atomic_load_explicit(&h->seq[s], memory_order_relaxed);
    if (!(q & 1)) q++;
    atomic_store_explicit(&h->seq[s], q, memory_order_relaxed);
    // The odd seq is visible before any byte of the new contents.
    atomic_thread_fence(memory_order_seq_cst);
    *slot = s;
    return h->kind == MTRL_WSHM_HOST ? (char *)w->base + h->slot_offset[s] : NULL;
}

void mtrl_wshm_write_end(mtrl_wshm *w, int slot, uint32_t version) {
    header *h = w->h;
    MTRL_CHECK(slot >= 0 && slot < MTRL_WSHM_SLOTS);
    uint64_t q = atomic_load_explicit(&h->seq[slot], memory_order_relaxed);
    MTRL_CHECKF(q & 1, "weight channel slot %d stamped without write_begin", slot);
    atomic_store_explicit(&h->stamp[slot], STAMP_VALID | version, memory_order_relaxed);
    atomic_store_explicit(&h->seq[slot], q + 1, memory_order_release);
    atomic_store_explicit(&h->latest, (uint64_t)version << 8 | LATEST_SET | (uint64_t)slot, memory_order_release);
}

void mtrl_wshm_set_ipc(mtrl_wshm *w, int slot, const void *handle) {
    MTRL_CHECK(w->writer && slot >= 0 && slot < MTRL_WSHM_SLOTS);
    memcpy(w->h->ipc[slot], handle, MTRL_WSHM_IPC_BYTES);
}

mtrl_status mtrl_wshm_open(mtrl_wshm **out, const char *name, uint64_t nonce, uint64_t layout_hash,
                           uint64_t slot_bytes, mtrl_error *err) {
    *out = NULL;
    if (!name || !name[0] || strlen(name) >= MTRL_WSHM_NAME_MAX || name[0] != '/' || strchr(name + 1, '/'))
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "weight channel name '%s': not a shared-memory name", name ? name : "");
    mtrl_wshm *w = xcalloc(1, sizeof *w);
    snprintf(w->name, sizeof w->name, "%s", name);
    int fd = shm_open(name, O_RDONLY, 0);
    if (fd < 0) {
        mtrl_status st = mtrl_error_set(err, errno == ENOENT ? MTRL_ERR_NOTFOUND : MTRL_ERR_IO,
                                        "weight channel %s: %s (a learner on another host, or gone?)", name, strerror(errno));
        free(w);
        return st;
    }
    struct stat sb;
    mtrl_status st = MTRL_OK;
    if (fstat(fd, &sb) != 0) st = mtrl_error_set(err, MTRL_ERR_IO, "weight channel %s: fstat: %s", name, strerror(errno));
    else if ((uint64_t)sb.st_size < HEADER_BYTES)
        st = mtrl_error_set(err, MTRL_ERR_FORMAT, "weight channel %s: %lld bytes, too short for its header", name,
                            (long long)sb.st_size);
    if (st == MTRL_OK) st = map_(w, fd, (size_t)sb.st_size, PROT_READ, err);
    close(fd);
    const header *h = w->h;
    if (st == MTRL_OK) {
        atomic_thread_fence(memory_order_acquire);
        uint64_t slot_at = PAGE_ROUND(h->slot_bytes);
        if (memcmp(h->magic, MAGIC, 8) || h->header_bytes != HEADER_BYTES)
            st = mtrl_error_set(err, MTRL_ERR_FORMAT, "weight channel %s: not a weight channel header (bad magic or size)", name);
        else if (h->nonce != nonce)
            st = mtrl_error_set(err, MTRL_ERR_MISMATCH,
                                "weight channel %s: stale: its nonce %016" PRIx64 " is not the announced %016" PRIx64
                                " (a segment of an earlier learner)", name, h->nonce, nonce);
        else if (h->kind != MTRL_WSHM_HOST && h->kind != MTRL_WSHM_DEVICE)
            st = mtrl_error_set(err, MTRL_ERR_FORMAT, "weight channel %s: unknown kind %u", name, h->kind);
        else if (h->segment_bytes != (uint64_t)sb.st_size ||
                 (h->kind == MTRL_WSHM_HOST &&
                  (h->slot_offset[0] != HEADER_BYTES || h->slot_offset[1] != HEADER_BYTES + slot_at ||
                   h->segment_bytes < HEADER_BYTES + MTRL_WSHM_SLOTS * slot_at)))
            st = mtrl_error_set(err, MTRL_ERR_FORMAT, "weight channel %s: corrupt header: slots do not fit its %lld bytes",
                                name, (long long)sb.st_size);
        else if (h->layout_hash != layout_hash || h->slot_bytes != slot_bytes)
            st = mtrl_error_set(err, MTRL_ERR_MISMATCH,
                                "weight channel %s: laid out for another model (layout %016" PRIx64 ", %" PRIu64
                                " bytes a slot; this model wants %016" PRIx64 ", %" PRIu64 ")",
                                name, h->layout_hash, h->slot_bytes, layout_hash, slot_bytes);
    }
    if (st != MTRL_OK) {
        if (w->base) munmap(w->base, w->bytes);
        free(w);
        return st;
    }
    *out = w;
    return MTRL_OK;
}

mtrl_status mtrl_wshm_read_begin(const mtrl_wshm *r, uint32_t version, int slot, mtrl_wshm_ticket *t,
                                 const void **data, mtrl_error *err) {
    if (slot < 0 || slot >= MTRL_WSHM_SLOTS)
        return mtrl_error_set(err, MTRL_ERR_FORMAT, "weight channel %s: slot %d announced (it has %d)", r->name, slot, MTRL_WSHM_SLOTS);
    header *h = r->h;
    uint64_t q = atomic_load_explicit(&h->seq[slot], memory_order_acquire);
    uint64_t s = atomic_load_explicit(&h->stamp[slot], memory_order_acquire);
    if ((q & 1) || !(s & STAMP_VALID) || (int32_t)((uint32_t)s - version) < 0)
        return mtrl_error_set(err, MTRL_ERR_STATE, "weight channel %s: version %u in slot %d not written yet", r->name, version, slot);
    if ((uint32_t)s != version)
        return mtrl_error_set(err, MTRL_ERR_NOTFOUND, "weight channel %s: slot %d holds version %u now, not %u", r->name, slot,
                              (uint32_t)s, version);
    t->slot = slot;
    t->version = version;
    t->seq = q;
    if (data) *data = h->kind == MTRL_WSHM_HOST ? (const char *)r->base + h->slot_offset[slot] : NULL;
    return MTRL_OK;
}

int mtrl_wshm_read_end(const mtrl_wshm *r, const mtrl_wshm_ticket *t) {
    atomic_thread_fence(memory_order_acquire);
    return atomic_load_explicit(&r->h->seq[t->slot], memory_order_relaxed) == t->seq;
}

int mtrl_wshm_latest(const mtrl_wshm *r, uint32_t *version, int *slot) {
    uint64_t l = atomic_load_explicit(&r->h->latest, memory_order_acquire);
    if (!l) return 0;
    *version = (uint32_t)(l >> 8);
    *slot = (int)(l & 1);
    return 1;
}

const void *mtrl_wshm_ipc(const mtrl_wshm *r, int slot) { return r->h->ipc[slot]; }
const char *mtrl_wshm_name(const mtrl_wshm *w) { return w->name; }
uint64_t mtrl_wshm_nonce(const mtrl_wshm *w) { return w->h->nonce; }
mtrl_wshm_kind mtrl_wshm_kind_of(const mtrl_wshm *w) { return (mtrl_wshm_kind)w->h->kind; }
uint64_t mtrl_wshm_slot_bytes(const mtrl_wshm *w) { return w->h->slot_bytes; }

void mtrl_wshm_close(mtrl_wshm *w) {
    if (!w) return;
    if (w->base) munmap(w->base, w->bytes);
    if (w->writer) shm_unlink(w->name);
    free(w);
}
