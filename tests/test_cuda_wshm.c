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
//     cuda --preset small` measures the same kernels at small's size).
// Skips (77) without a GPU.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "model/model.h"
#include "model/model_wshm.h"
#include "common/timeutil.h"
#include "common/tokenizer.h"
#include "common/weights_shm.h"
#include "tests/testhelp.h"
#include "tests/testmodel.h"
#include "tests/testwshm.h"

// --reader NAME NONCE VERSION SLOT BF16: copies the version out and writes its digest and the
// copy's seconds to stdout (digest 0 when it could not).
static int reader_main_(char **argv) {
    int bf16 = atoi(argv[6]);
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
    mtrl_model_dims d = test_model_dims("preset = tiny\n", MTRL_VOCAB);
    mtrl_model m;
    mtrl_error err;
    TEST_EQ_INT(mtrl_model_init_on(&m, &d, 5, MTRL_DEVICE_CUDA, 0, &err), MTRL_OK);
    test_model_perturb(&m, 11);
    mtrl_model_to_device(&m);
    mtrl_wshm_layout lay;
    mtrl_model_wshm_layout(&m, bf16, &lay);
    mtrl_wshm *ch;
    mtrl_model_wshm_dev *dev;
    TEST_EQ_INT(mtrl_wshm_create(&ch, MTRL_WSHM_DEVICE, lay.slot_bytes, lay.hash, &err), MTRL_OK);
    TEST_EQ_INT(mtrl_model_wshm_dev_create(&dev, &m, &lay, ch, &err), MTRL_OK);
    m.version = 17;
    int slot = mtrl_model_wshm_dev_publish(dev, &m, ch, m.version);
    uint64_t want = test_wshm_zmq_digest(&m, bf16); // mtrl_model_save* refresh the host mirror
    if (!bf16) TEST_CHECK(want == test_wshm_digest(&m));
    uint64_t got = read_in_child_(ch, 17, slot, bf16);
    TEST_CHECKF(got == want, "version 17: the reader's weights %016llx, the ZeroMQ path's %016llx", (unsigned long long)got,
                (unsigned long long)want);
    // Two more versions, the slots alternating, nobody waited for; the last one is read.
    for (int k = 0; k < 2; k++) {
        test_model_perturb(&m, 100 + (uint64_t)k);
        mtrl_model_to_device(&m);
        m.version++;
        int s2 = mtrl_model_wshm_dev_publish(dev, &m, ch, m.version);
        TEST_EQ_INT(s2, slot ^ 1);
        slot = s2;
    }
    want = test_wshm_zmq_digest(&m, bf16);
    got = read_in_child_(ch, m.version, slot, bf16);
    TEST_CHECKF(got == want, "version %u: the reader's weights %016llx, the ZeroMQ path's %016llx", m.version,
                (unsigned long long)got, (unsigned long long)want);
    // Version 17 and 19 share a slot: 17 is gone from it.
    mtrl_wshm_ticket t;
    TEST_EQ_INT(mtrl_wshm_read_begin(ch, 17, slot, &t, NULL, &err), MTRL_ERR_NOTFOUND);
    mtrl_model_wshm_dev_free(dev);
    mtrl_wshm_close(ch);
    mtrl_model_wshm_layout_free(&lay);
    mtrl_model_free(&m);
}

int main(int argc, char **argv) {
    if (argc == 7 && !strcmp(argv[1], "--reader")) return reader_main_(argv);
    if (mtrl_model_cuda_devices() == 0) test_skip("no CUDA device");
    test_ipc(1);
    test_ipc(0);
    return test_report();
}
