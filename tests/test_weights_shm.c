// mtrl-test: cpu
// The same-host weight channel (common/weights_shm.h, model/model_wshm.h), with real
// processes (fork) on a real POSIX shared-memory segment:
//  1. a reader process copies every version the writer announces (over a pipe, as the learner
//     announces over ZeroMQ) while the writer keeps publishing newer ones without waiting: every
//     copy that read_end accepts holds exactly the announced version's bytes (each slot word is
//     a digest of (version, index): a torn copy cannot pass), torn copies are caught, and the
//     final version arrives whole;
//  2. opening a name that does not exist, a stale segment (another nonce), a corrupt header and
//     one laid out for another model each fail with their code and a message naming the segment;
//     the segment of a writer whose process is gone is removed by the next create;
//  3. the model's slot (tiny, bf16 and fp32): a reader process with a differently-initialised
//     model of the same dims gets, bit for bit, the parameters and β the ZeroMQ path would give
//     (mtrl_model_save_bf16 / mtrl_model_save, then mtrl_model_load); a model of other dims is
//     refused by the layout hash.
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/checkpoint.h"
#include "common/config.h"
#include "common/hash.h"
#include "model/model.h"
#include "model/model_wshm.h"
#include "common/tokenizer.h"
#include "common/weights_shm.h"
#include "tests/testhelp.h"
#include "tests/testmodel.h"
#include "tests/testwshm.h"

#define WORDS ((size_t)1 << 20) // 8 MB slots: a copy takes long enough for the writer to lap it

static uint64_t word_(uint32_t version, size_t i) { return mtrl_hash64(&i, sizeof i, version); }

typedef struct announce {
    uint32_t version;
    int32_t slot;
} announce;

typedef struct reader_report {
    uint32_t whole, torn, bad, last_version;
} reader_report;

// The reader process: copies each announcement (or the latest when the slot moved on) and checks
// every accepted copy word by word.
static reader_report reader_(int rfd, const char *name, uint64_t nonce) {
    reader_report rep = {0};
    mtrl_wshm *r;
    if (mtrl_wshm_open(&r, name, nonce, 42, WORDS * 8, NULL) != MTRL_OK) {
        rep.bad = 1000;
        return rep;
    }
    uint64_t *copy = malloc(WORDS * 8);
    announce a;
    while (read(rfd, &a, sizeof a) == (ssize_t)sizeof a) {
        for (int tries = 0; tries < 16; tries++) {
            mtrl_wshm_ticket t;
            const void *data;
            mtrl_status st = mtrl_wshm_read_begin(r, a.version, a.slot, &t, &data, NULL);
            if (st == MTRL_OK) {
                memcpy(copy, data, WORDS * 8);
                if (mtrl_wshm_read_end(r, &t)) {
                    size_t wrong = 0;
                    for (size_t i = 0; i < WORDS; i++) wrong += copy[i] != word_(t.version, i);
                    rep.bad += wrong != 0;
                    rep.whole++;
                    rep.last_version = t.version;
                    break;
                }
                rep.torn++;
            }
            if (!mtrl_wshm_latest(r, &a.version, &a.slot)) break;
        }
    }
    free(copy);
    mtrl_wshm_close(r);
    return rep;
}

static void test_versions_across_processes(void) {
    mtrl_wshm *w;
    mtrl_error err;
    TEST_EQ_INT(mtrl_wshm_create(&w, MTRL_WSHM_HOST, WORDS * 8, 42, &err), MTRL_OK);
    int ann[2], res[2];
    TEST_CHECK(pipe(ann) == 0 && pipe(res) == 0);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        close(ann[1]);
        reader_report rep = reader_(ann[0], mtrl_wshm_name(w), mtrl_wshm_nonce(w));
        _exit(write(res[1], &rep, sizeof rep) == (ssize_t)sizeof rep ? 0 : 1);
    }
    close(ann[0]);
    signal(SIGPIPE, SIG_IGN);
    const uint32_t versions = 60;
    for (uint32_t v = 1; v <= versions; v++) {
        int slot;
        uint64_t *p = mtrl_wshm_write_begin(w, &slot);
        TEST_CHECK(slot == (int)((v - 1) & 1)); // alternating: never the slot just announced
        for (size_t i = 0; i < WORDS; i++) p[i] = word_(v, i);
        mtrl_wshm_write_end(w, slot, v);
        announce a = {v, slot};
        TEST_CHECK(write(ann[1], &a, sizeof a) == (ssize_t)sizeof a);
    }
    close(ann[1]);
    reader_report rep = {0};
    TEST_CHECK(read(res[0], &rep, sizeof rep) == (ssize_t)sizeof rep);
    int st;
    waitpid(pid, &st, 0);
    TEST_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    printf("reader: %u whole copies, %u torn (caught), %u wrong, last version %u of %u\n", rep.whole, rep.torn, rep.bad,
           rep.last_version, versions);
    TEST_EQ_INT(rep.bad, 0);
    TEST_CHECK(rep.whole >= 1);
    TEST_EQ_INT(rep.last_version, versions);
    close(res[0]);
    close(res[1]);
    mtrl_wshm_close(w);
}

static void test_refusals(void) {
    mtrl_wshm *w, *r = NULL;
    mtrl_error err;
    TEST_EQ_INT(mtrl_wshm_create(&w, MTRL_WSHM_HOST, 4096, 7, &err), MTRL_OK);
    char name[MTRL_WSHM_NAME_MAX];
    snprintf(name, sizeof name, "%s", mtrl_wshm_name(w));
    uint64_t nonce = mtrl_wshm_nonce(w);
    TEST_EQ_INT(mtrl_wshm_open(&r, "/mtrl-w.no-such-channel", nonce, 7, 4096, &err), MTRL_ERR_NOTFOUND);
    TEST_CHECKF(strstr(err.msg, "/mtrl-w.no-such-channel") != NULL, "%s", err.msg);
    TEST_EQ_INT(mtrl_wshm_open(&r, name, nonce + 1, 7, 4096, &err), MTRL_ERR_MISMATCH);
    TEST_CHECKF(strstr(err.msg, "stale") && strstr(err.msg, name), "%s", err.msg);
    TEST_EQ_INT(mtrl_wshm_open(&r, name, nonce, 8, 4096, &err), MTRL_ERR_MISMATCH);
    TEST_CHECKF(strstr(err.msg, "another model") != NULL, "%s", err.msg);
    TEST_EQ_INT(mtrl_wshm_open(&r, name, nonce, 7, 8192, &err), MTRL_ERR_MISMATCH);
    TEST_EQ_INT(mtrl_wshm_open(&r, "not/a/name", nonce, 7, 4096, &err), MTRL_ERR_FORMAT);
    TEST_CHECK(r == NULL);
    // Nothing written yet: no version to read.
    TEST_EQ_INT(mtrl_wshm_open(&r, name, nonce, 7, 4096, &err), MTRL_OK);
    uint32_t v;
    int s;
    mtrl_wshm_ticket t;
    TEST_CHECK(!mtrl_wshm_latest(r, &v, &s));
    TEST_EQ_INT(mtrl_wshm_read_begin(r, 0, 0, &t, NULL, &err), MTRL_ERR_STATE);
    TEST_EQ_INT(mtrl_wshm_read_begin(r, 0, 5, &t, NULL, &err), MTRL_ERR_FORMAT);
    // Written: a slot that moved on past the announced version says so.
    int slot;
    mtrl_wshm_write_begin(w, &slot);
    mtrl_wshm_write_end(w, slot, 3);
    TEST_EQ_INT(mtrl_wshm_read_begin(r, 2, slot, &t, NULL, &err), MTRL_ERR_NOTFOUND);
    TEST_EQ_INT(mtrl_wshm_read_begin(r, 3, slot, &t, NULL, &err), MTRL_OK);
    TEST_CHECK(mtrl_wshm_read_end(r, &t));
    mtrl_wshm_close(r);
    mtrl_wshm_close(w);
    // A segment that is not a channel (and one too short for a header).
    const char *bogus = "/mtrl-w.test-corrupt";
    shm_unlink(bogus);
    int fd = shm_open(bogus, O_RDWR | O_CREAT | O_EXCL, 0600);
    TEST_CHECK(fd >= 0);
    TEST_CHECK(ftruncate(fd, 100) == 0);
    TEST_EQ_INT(mtrl_wshm_open(&r, bogus, nonce, 7, 4096, &err), MTRL_ERR_FORMAT);
    TEST_CHECKF(strstr(err.msg, "too short") != NULL, "%s", err.msg);
    TEST_CHECK(ftruncate(fd, 3 * 4096) == 0);
    char junk[64];
    memset(junk, 0x5a, sizeof junk);
    TEST_CHECK(pwrite(fd, junk, sizeof junk, 0) == (ssize_t)sizeof junk);
    TEST_EQ_INT(mtrl_wshm_open(&r, bogus, nonce, 7, 4096, &err), MTRL_ERR_FORMAT);
    TEST_CHECKF(strstr(err.msg, "not a weight channel header") && strstr(err.msg, bogus), "%s", err.msg);
    close(fd);
    shm_unlink(bogus);
    // The writer's name goes with it.
    TEST_EQ_INT(mtrl_wshm_open(&r, name, nonce, 7, 4096, &err), MTRL_ERR_NOTFOUND);
    // A channel left by a writer that was killed (its pid gone) is removed by the next create.
    pid_t dead = fork();
    if (dead == 0) _exit(0);
    waitpid(dead, NULL, 0);
    char left[64];
    snprintf(left, sizeof left, "/mtrl-w.%d.00000000deadbeef", (int)dead);
    fd = shm_open(left, O_RDWR | O_CREAT | O_EXCL, 0600);
    TEST_CHECK(fd >= 0);
    close(fd);
    TEST_EQ_INT(mtrl_wshm_create(&w, MTRL_WSHM_HOST, 4096, 7, &err), MTRL_OK);
    fd = shm_open(left, O_RDONLY, 0);
    TEST_CHECKF(fd < 0 && errno == ENOENT, "%s of a dead writer is still there", left);
    if (fd >= 0) close(fd);
    mtrl_wshm_close(w);
}

static void test_model_slot(int bf16) {
    mtrl_model_dims d = test_model_dims("preset = tiny\n", MTRL_VOCAB);
    mtrl_model m;
    mtrl_model_init(&m, &d, 5);
    test_model_perturb(&m, 11);
    mtrl_wshm_layout lay;
    mtrl_model_wshm_layout(&m, bf16, &lay);
    mtrl_wshm *w;
    mtrl_error err;
    TEST_EQ_INT(mtrl_wshm_create(&w, MTRL_WSHM_HOST, lay.slot_bytes, lay.hash, &err), MTRL_OK);
    int slot;
    void *dst = mtrl_wshm_write_begin(w, &slot);
    mtrl_model_wshm_pack_host(&m, &lay, dst);
    mtrl_wshm_write_end(w, slot, 17);
    uint64_t want = test_wshm_zmq_digest(&m, bf16);
    // Another process, another initialisation: only the channel carries the weights.
    uint64_t got = 0;
    TEST_CHECK(test_wshm_reader(w, 17, slot, bf16, &got, sizeof got));
    TEST_CHECKF(got == want, "%s slot: the reader's weights %016llx, the ZeroMQ path's %016llx", bf16 ? "bf16" : "fp32",
                (unsigned long long)got, (unsigned long long)want);
    if (!bf16) TEST_CHECK(want == test_wshm_digest(&m)); // fp32 publishes the parameters as they are
    // A model of other dims (or another element type of the matrices) is refused.
    mtrl_model_dims d2 = test_model_dims("preset = tiny\nlayers = 3\n", MTRL_VOCAB);
    mtrl_model o;
    mtrl_model_init(&o, &d2, 5);
    mtrl_wshm_layout ol, xl;
    mtrl_model_wshm_layout(&o, bf16, &ol);
    mtrl_model_wshm_layout(&m, !bf16, &xl);
    mtrl_wshm *r;
    TEST_EQ_INT(mtrl_wshm_open(&r, mtrl_wshm_name(w), mtrl_wshm_nonce(w), ol.hash, ol.slot_bytes, &err), MTRL_ERR_MISMATCH);
    TEST_EQ_INT(mtrl_wshm_open(&r, mtrl_wshm_name(w), mtrl_wshm_nonce(w), xl.hash, xl.slot_bytes, &err), MTRL_ERR_MISMATCH);
    mtrl_model_wshm_layout_free(&ol);
    mtrl_model_wshm_layout_free(&xl);
    mtrl_model_free(&o);
    mtrl_wshm_close(w);
    mtrl_model_wshm_layout_free(&lay);
    mtrl_model_free(&m);
}

// The reader process of test_model_slot (test_wshm_reader's arguments): writes the digest of
// the weights it copied to stdout, 0 when it could not.
static int reader_main_(char **argv) {
    int bf16 = atoi(argv[6]);
    mtrl_model_dims d = test_model_dims("preset = tiny\n", MTRL_VOCAB);
    mtrl_model a;
    mtrl_model_init(&a, &d, 1234);
    mtrl_wshm_layout al;
    mtrl_model_wshm_layout(&a, bf16, &al);
    mtrl_wshm *r;
    uint64_t got = 0;
    mtrl_wshm_ticket t;
    const void *data;
    mtrl_error err;
    mtrl_status st = mtrl_wshm_open(&r, argv[2], strtoull(argv[3], NULL, 10), al.hash, al.slot_bytes, &err);
    if (st == MTRL_OK) st = mtrl_wshm_read_begin(r, (uint32_t)atoi(argv[4]), atoi(argv[5]), &t, &data, &err);
    if (st == MTRL_OK) {
        mtrl_model_wshm_unpack_host(&a, &al, data);
        if (mtrl_wshm_read_end(r, &t)) got = test_wshm_digest(&a);
    } else {
        fprintf(stderr, "reader: %s\n", err.msg);
    }
    return write(1, &got, sizeof got) == (ssize_t)sizeof got ? 0 : 1;
}

int main(int argc, char **argv) {
    if (argc == 7 && !strcmp(argv[1], "--reader")) return reader_main_(argv);
    test_versions_across_processes();
    test_refusals();
    test_model_slot(1);
    test_model_slot(0);
    return test_report();
}
