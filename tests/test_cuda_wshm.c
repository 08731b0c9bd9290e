// mtrl-test: gpu
// The device weight channel (model/model_wshm.h): the learner's slots in GPU memory,
// shared with CUDA IPC, read by another process (exec'ed, as actors are) with its own model
// on the GPU, for the `tiny` preset, bf16 and fp32 matrices:
//   * the reader opens the handles from the channel header, waits for the stamp the learner's
//     host callback writes after the pack kernel, converts the slot device to device into its
//     parameter block and gets, bit for bit, the weights the ZeroMQ path would give (the blob
//     loaded by mtrl_model_load), of the announced version;
//   * the learner publishes two more versions (the slots alternate) without waiting for
//     anyone, and a new reader gets the last one, bit for bit;
//   * the reader prints the rate of its copy (GB/s of the slot; `mtrl bench publish --device
//     cuda --preset small` measures the same kernels at small's size);
//   * the actor's two weight forms under [kernels] gemm = bf16 (issue 21): a reader process
//     fills today's form (fp32 block + the backend's bf16 copy, mtrl_model_init_infer_on) and
//     the bf16-resident one (mtrl_model_init_infer_bf16_on: GEMM matrices as bf16 only) from
//     the same slot, bf16 and fp32, and their logits of a sequence, a prefill and greedy decode
//     steps are bit for bit the same; with the bf16 slot so are their weights (the resident
//     form's widened); the resident form holds fewer device bytes (printed);
//   * in one process, both forms loading the same checkpoint (mtrl_model_load rounds the
//     resident form's matrices once) give the same logits bit for bit.
// Skips (77) without a GPU.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/check.h"
#include "model/backend.h"
#include "model/model.h"
#include "model/model_wshm.h"
#include "common/timeutil.h"
#include "common/tokenizer.h"
#include "common/weights_shm.h"
#include "tests/testhelp.h"
#include "tests/testmodel.h"
#include "tests/testwshm.h"

static int compare_main_(char **argv, int bf16);

// --reader NAME NONCE VERSION SLOT BF16: copies the version out and writes its digest and the
// copy's seconds to stdout (digest 0 when it could not).
static int reader_main_(char **argv) {
    int bf16 = atoi(argv[6]);
    if (bf16 >= 2) return compare_main_(argv, bf16 - 2);
    uint32_t version = (uint32_t)atoi(argv[4]);
    int slot = atoi(argv[5]);
    mtrl_model_dims d = test_model_dims("preset = tiny\n", MTRL_VOCAB);
    mtrl_model m;
    mtrl_error err;
    struct {
        uint64_t digest;
        double seconds, bytes;
    } out = {0, 0, 0};
    if (mtrl_model_init_on(&m, &d, 1234, MTRL_DEVICE_CUDA, 0, &err) != MTRL_OK) {
        fprintf(stderr, "reader: %s\n", err.msg);
        return 1;
    }
    mtrl_wshm_layout lay;
    mtrl_model_wshm_layout(&m, bf16, &lay);
    mtrl_wshm *ch = NULL;
    mtrl_model_wshm_dev *dev = NULL;
    mtrl_status st = mtrl_wshm_open(&ch, argv[2], strtoull(argv[3], NULL, 10), lay.hash, lay.slot_bytes, &err);
    if (st == MTRL_OK) st = mtrl_model_wshm_dev_open(&dev, &m, &lay, ch, &err);
    mtrl_wshm_ticket t;
    double t0 = mtrl_time_mono();
    // The announcement may come before the stamp: the device copy is still running.
    while (st == MTRL_OK && (st = mtrl_wshm_read_begin(ch, version, slot, &t, NULL, &err)) == MTRL_ERR_STATE &&
           mtrl_time_mono() - t0 < 30) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
        st = MTRL_OK;
    }
    if (st == MTRL_OK) {
        double t1 = mtrl_time_mono();
        mtrl_model_wshm_dev_unpack(dev, &m, slot);
        out.seconds = mtrl_time_mono() - t1;
        out.bytes = (double)lay.slot_bytes;
        if (mtrl_wshm_read_end(ch, &t)) {
            mtrl_model_to_host(&m);
            out.digest = test_wshm_digest(&m);
        }
    } else {
        fprintf(stderr, "reader: %s\n", err.msg);
    }
    mtrl_model_wshm_dev_free(dev);
    mtrl_wshm_close(ch);
    mtrl_model_wshm_layout_free(&lay);
    mtrl_model_free(&m);
    return write(1, &out, sizeof out) == (ssize_t)sizeof out ? 0 : 1;
}

// ---- the actor's two weight forms (issue 21) ----------------------------------------------------

enum { CMP_TOKENS = 24, CMP_STEPS = 6 };

typedef struct cmp_out {
    uint64_t digest[2];   // today's form, the bf16-resident form (host mirrors after the copy)
    int logits_same, prefill_same, decode_same, tokens_same;
    double held[2];       // device bytes each model's backend holds after the copy
} cmp_out;

static double held_(mtrl_model *m) {
    size_t peak = 0;
    m->be->mem_info(m->be, NULL, NULL, NULL, &peak);
    return (double)peak;
}

// The logits of a fixed sequence, of a prefill and of CMP_STEPS greedy decode steps of m into
// lg [CMP_TOKENS*V], pf [V], dc [CMP_STEPS][V], tok [CMP_STEPS].
static void cmp_run_(mtrl_model *m, real *lg, real *pf, real *dc, uint32_t *tok) {
    uint32_t seq[CMP_TOKENS];
    for (int i = 0; i < CMP_TOKENS; i++) seq[i] = (uint32_t)((i * 37 + 5) % m->dims.V);
    mtrl_model_logits(m, seq, CMP_TOKENS, CMP_TOKENS, lg);
    mtrl_decode_state st;
    mtrl_decode_state_init(&st, m, CMP_TOKENS + CMP_STEPS + 1);
    mtrl_model_prefill(m, &st, seq, CMP_TOKENS, pf, NULL);
    const real *last = pf;
    for (int k = 0; k < CMP_STEPS; k++) {
        int best = 0;
        for (int v = 1; v < m->dims.V; v++)
            if (last[v] > last[best]) best = v;
        tok[k] = (uint32_t)best;
        mtrl_decode_state *sp = &st;
        mtrl_model_decode(m, &sp, 1, &tok[k], dc + (size_t)k * m->dims.V, NULL);
        last = dc + (size_t)k * m->dims.V;
    }
    mtrl_decode_state_free(&st);
}

// Fills out by comparing the runs of models a and b.
static void cmp_models_(mtrl_model *a, mtrl_model *b, cmp_out *out) {
    size_t V = (size_t)a->dims.V;
    real *r[2][3];
    uint32_t tok[2][CMP_STEPS];
    mtrl_model *m[2] = {a, b};
    for (int i = 0; i < 2; i++) {
        r[i][0] = xmalloc(sizeof(real) * CMP_TOKENS * V);
        r[i][1] = xmalloc(sizeof(real) * V);
        r[i][2] = xmalloc(sizeof(real) * CMP_STEPS * V);
        cmp_run_(m[i], r[i][0], r[i][1], r[i][2], tok[i]);
    }
    out->logits_same = !memcmp(r[0][0], r[1][0], sizeof(real) * CMP_TOKENS * V);
    out->prefill_same = !memcmp(r[0][1], r[1][1], sizeof(real) * V);
    out->decode_same = !memcmp(r[0][2], r[1][2], sizeof(real) * CMP_STEPS * V);
    out->tokens_same = !memcmp(tok[0], tok[1], sizeof tok[0]);
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 3; j++) free(r[i][j]);
}

// The actor's dims: tiny, GEMMs on bf16 operands.
static mtrl_model_dims actor_dims_(void) {
    mtrl_model_dims d = test_model_dims("preset = tiny\n", MTRL_VOCAB);
    d.kern.gemm = MTRL_KGEMM_BF16;
    return d;
}

// --reader ... MODE with MODE = 2 + bf16: both forms from the slot; writes a cmp_out.
static int compare_main_(char **argv, int bf16) {
    uint32_t version = (uint32_t)atoi(argv[4]);
    int slot = atoi(argv[5]);
    mtrl_model_dims d = actor_dims_();
    mtrl_model m[2];
    mtrl_error err;
    cmp_out out;
    memset(&out, 0, sizeof out);
    if (mtrl_model_init_infer_on(&m[0], &d, 1234, MTRL_DEVICE_CUDA, 0, &err) != MTRL_OK ||
        mtrl_model_init_infer_bf16_on(&m[1], &d, 4321, MTRL_DEVICE_CUDA, 0, &err) != MTRL_OK) {
        fprintf(stderr, "reader: %s\n", err.msg);
        return 1;
    }
    mtrl_wshm_layout lay;
    mtrl_model_wshm_layout(&m[0], bf16, &lay);
    mtrl_wshm *ch = NULL;
    mtrl_status st = mtrl_wshm_open(&ch, argv[2], strtoull(argv[3], NULL, 10), lay.hash, lay.slot_bytes, &err);
    mtrl_wshm_ticket t;
    double t0 = mtrl_time_mono();
    while (st == MTRL_OK && (st = mtrl_wshm_read_begin(ch, version, slot, &t, NULL, &err)) == MTRL_ERR_STATE &&
           mtrl_time_mono() - t0 < 30) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
        st = MTRL_OK;
    }
    // One model's mapping of the slots at a time (a process opens a handle once), both copies
    // inside one read ticket.
    for (int i = 0; i < 2 && st == MTRL_OK; i++) {
        mtrl_model_wshm_dev *dev = NULL;
        st = mtrl_model_wshm_dev_open(&dev, &m[i], &lay, ch, &err);
        if (st == MTRL_OK) mtrl_model_wshm_dev_unpack(dev, &m[i], slot);
        mtrl_model_wshm_dev_free(dev);
    }
    if (st == MTRL_OK) {
        if (mtrl_wshm_read_end(ch, &t)) {
            for (int i = 0; i < 2; i++) {
                out.held[i] = held_(&m[i]);
                mtrl_model_to_host(&m[i]);
                out.digest[i] = test_wshm_digest(&m[i]);
            }
            cmp_models_(&m[0], &m[1], &out);
        }
    } else {
        fprintf(stderr, "reader: %s\n", err.msg);
    }
    mtrl_wshm_close(ch);
    mtrl_model_wshm_layout_free(&lay);
    for (int i = 0; i < 2; i++) mtrl_model_free(&m[i]);
    return write(1, &out, sizeof out) == (ssize_t)sizeof out ? 0 : 1;
}

// The learner's side: a tiny GPU model (perturbed by `seed`) and its device channel, version
// `version` published into a slot.
typedef struct {
    mtrl_model m;
    mtrl_wshm_layout lay;
    mtrl_wshm *ch;
    mtrl_model_wshm_dev *dev;
    int slot;
} writer_;

static void writer_open_(writer_ *w, uint64_t seed, int bf16, uint32_t version) {
    mtrl_model_dims d = test_model_dims("preset = tiny\n", MTRL_VOCAB);
    mtrl_error err;
    TEST_EQ_INT(mtrl_model_init_on(&w->m, &d, 5, MTRL_DEVICE_CUDA, 0, &err), MTRL_OK);
    test_model_perturb(&w->m, seed);
    mtrl_model_to_device(&w->m);
    mtrl_model_wshm_layout(&w->m, bf16, &w->lay);
    TEST_EQ_INT(mtrl_wshm_create(&w->ch, MTRL_WSHM_DEVICE, w->lay.slot_bytes, w->lay.hash, &err), MTRL_OK);
    TEST_EQ_INT(mtrl_model_wshm_dev_create(&w->dev, &w->m, &w->lay, w->ch, &err), MTRL_OK);
    w->m.version = version;
    w->slot = mtrl_model_wshm_dev_publish(w->dev, &w->m, w->ch, version);
}

static void writer_close_(writer_ *w) {
    mtrl_model_wshm_dev_free(w->dev);
    mtrl_wshm_close(w->ch);
    mtrl_model_wshm_layout_free(&w->lay);
    mtrl_model_free(&w->m);
}

// Prints how the two actor forms compared (from `what`); returns whether every output was the same.
static int forms_same_(const char *what, const cmp_out *o) {
    printf("actor forms from %s: logits %s, prefill %s, decode %s, tokens %s\n", what, o->logits_same ? "same" : "DIFFER",
           o->prefill_same ? "same" : "DIFFER", o->decode_same ? "same" : "DIFFER", o->tokens_same ? "same" : "DIFFER");
    return o->logits_same && o->prefill_same && o->decode_same && o->tokens_same;
}

static void test_actor_forms(int bf16) {
    writer_ w;
    writer_open_(&w, 23, bf16, 3);
    cmp_out out;
    memset(&out, 0, sizeof out);
    TEST_CHECK(test_wshm_reader(w.ch, w.m.version, w.slot, 2 + bf16, &out, sizeof out));
    TEST_CHECK(forms_same_(bf16 ? "the bf16 slot" : "the fp32 slot", &out));
    printf("  device bytes held: fp32 + bf16 copy %.2f MB, bf16-resident %.2f MB\n", out.held[0] / 1e6,
           out.held[1] / 1e6);
    if (bf16) TEST_CHECKF(out.digest[0] == out.digest[1] && out.digest[0] != 0, "weights %016llx vs %016llx",
                          (unsigned long long)out.digest[0], (unsigned long long)out.digest[1]);
    TEST_CHECK(out.held[1] > 0 && out.held[1] < out.held[0]);
    writer_close_(&w);
}

// Both forms loading one checkpoint (eval's path), in this process.
static void test_actor_forms_ckpt(void) {
    mtrl_model_dims d = actor_dims_();
    mtrl_model src;
    mtrl_model_init(&src, &d, 7);
    test_model_perturb(&src, 41);
    void *blob;
    size_t len;
    mtrl_error err;
    TEST_EQ_INT(mtrl_model_save(&src, NULL, &blob, &len, 0, NULL, 0, &err), MTRL_OK);
    mtrl_model m[2];
    TEST_EQ_INT(mtrl_model_init_infer_on(&m[0], &d, 1, MTRL_DEVICE_CUDA, 0, &err), MTRL_OK);
    TEST_EQ_INT(mtrl_model_init_infer_bf16_on(&m[1], &d, 2, MTRL_DEVICE_CUDA, 0, &err), MTRL_OK);
    TEST_CHECK(m[1].weights_bf16 && !m[0].weights_bf16);
    for (int i = 0; i < 2; i++) {
        mtrl_ckpt c;
        TEST_EQ_INT(mtrl_ckpt_open_mem(&c, blob, len, &err), MTRL_OK);
        TEST_EQ_INT(mtrl_model_load(&m[i], &c, 0, &err), MTRL_OK);
        mtrl_ckpt_close(&c);
    }
    cmp_out out;
    memset(&out, 0, sizeof out);
    cmp_models_(&m[0], &m[1], &out);
    TEST_CHECK(forms_same_("one checkpoint", &out));
    for (int i = 0; i < 2; i++) mtrl_model_free(&m[i]);
    mtrl_model_free(&src);
    free(blob);
}

// Runs a reader process for (version, slot); returns the digest it got.
static uint64_t read_in_child_(const mtrl_wshm *ch, uint32_t version, int slot, int bf16) {
    struct {
        uint64_t digest;
        double seconds, bytes;
    } out = {0, 0, 0};
    TEST_CHECK(test_wshm_reader(ch, version, slot, bf16, &out, sizeof out));
    printf("reader process: version %u (%s) copied device to device in %.3f ms, %.1f GB/s of %.1f MB\n", version,
           bf16 ? "bf16" : "fp32", out.seconds * 1e3, out.seconds > 0 ? out.bytes / out.seconds / 1e9 : 0, out.bytes / 1e6);
    return out.digest;
}

static void test_ipc(int bf16) {
    writer_ w;
    writer_open_(&w, 11, bf16, 17);
    mtrl_model *m = &w.m;
    uint64_t want = test_wshm_zmq_digest(m, bf16); // mtrl_model_save* refresh the host mirror
    if (!bf16) TEST_CHECK(want == test_wshm_digest(m));
    uint64_t got = read_in_child_(w.ch, 17, w.slot, bf16);
    TEST_CHECKF(got == want, "version 17: the reader's weights %016llx, the ZeroMQ path's %016llx", (unsigned long long)got,
                (unsigned long long)want);
    // Two more versions, the slots alternating, nobody waited for; the last one is read.
    for (int k = 0; k < 2; k++) {
        test_model_perturb(m, 100 + (uint64_t)k);
        mtrl_model_to_device(m);
        m->version++;
        int s2 = mtrl_model_wshm_dev_publish(w.dev, m, w.ch, m->version);
        TEST_EQ_INT(s2, w.slot ^ 1);
        w.slot = s2;
    }
    want = test_wshm_zmq_digest(m, bf16);
    got = read_in_child_(w.ch, m->version, w.slot, bf16);
    TEST_CHECKF(got == want, "version %u: the reader's weights %016llx, the ZeroMQ path's %016llx", m->version,
                (unsigned long long)got, (unsigned long long)want);
    // Version 17 and 19 share a slot: 17 is gone from it.
    mtrl_wshm_ticket t;
    mtrl_error err;
    TEST_EQ_INT(mtrl_wshm_read_begin(w.ch, 17, w.slot, &t, NULL, &err), MTRL_ERR_NOTFOUND);
    writer_close_(&w);
}

int main(int argc, char **argv) {
    if (argc == 7 && !strcmp(argv[1], "--reader")) return reader_main_(argv);
    if (mtrl_model_cuda_devices() == 0) test_skip("no CUDA device");
    test_ipc(1);
    test_ipc(0);
    test_actor_forms(1);
    test_actor_forms(0);
    test_actor_forms_ckpt();
    return test_report();
}
