// mtrl-test: cpu
// Checkpoints written in the background (learner/ckpt_async.h), on the `tiny` preset:
//  1. the file equals, byte for byte, the one a synchronous mtrl_model_save of the same state
//     writes (with and without the optimizer), although the model is changed (a training step's
//     worth of parameters, moments, β, step and version) right after the start: the write is of
//     the snapshot;
//  2. a second start before the first was collected is refused;
//  3. a write into a folder that does not exist is reported by collect, naming the file, and
//     leaves nothing behind; the next checkpoint works again.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/hash.h"
#include "model/model.h"
#include "common/tokenizer.h"
#include "learner/ckpt_async.h"
#include "tests/testhelp.h"
#include "tests/testmodel.h"
#include "tests/testproc.h"

static char dir_[256];

static int same_file_(const char *a, const char *b) {
    size_t na, nb;
    char *x = test_slurp(a, &na), *y = test_slurp(b, &nb);
    int same = na == nb && na > 0 && !memcmp(x, y, na);
    free(x);
    free(y);
    return same;
}

static void scribble_(mtrl_model *m) {
    real *p = m->params.base;
    size_t n = m->params.total / sizeof(real);
    for (size_t i = 0; i < n; i++) {
        p[i] += (real)0.5;
        m->adam_m[i] += 1;
        m->adam_v[i] += 2;
    }
    m->qb_beta[m->dims.E + 1] += 3;
    m->step++;
    m->version++;
}

static void test_equal_to_sync(int with_optimizer) {
    mtrl_model_dims d = test_model_dims("preset = tiny\n", MTRL_VOCAB);
    mtrl_model m;
    mtrl_model_init(&m, &d, 3);
    test_model_perturb(&m, 4);
    for (size_t i = 0; i < m.params.total / sizeof(real); i++) {
        m.adam_m[i] = (real)i * (real)1e-6;
        m.adam_v[i] = (real)i * (real)2e-7;
    }
    m.step = 12;
    m.version = 9;
    const char *meta[] = {"config_hash", "0123456789abcdef", "run", "4", "learner_step", "12"};
    char sync[512], async[512];
    snprintf(sync, sizeof sync, "%s/sync-%d.safetensors", dir_, with_optimizer);
    snprintf(async, sizeof async, "%s/async-%d.safetensors", dir_, with_optimizer);
    mtrl_error err;
    TEST_EQ_INT(mtrl_model_save(&m, sync, NULL, NULL, with_optimizer, meta, 3, &err), MTRL_OK);
    mtrl_ckpt_async *a = mtrl_ckpt_async_new();
    TEST_EQ_INT(mtrl_ckpt_async_start(a, &m, async, 12, with_optimizer, meta, 3, &err), MTRL_OK);
    scribble_(&m); // training goes on
    TEST_EQ_INT(mtrl_ckpt_async_start(a, &m, async, 13, with_optimizer, meta, 3, &err), MTRL_ERR_STATE);
    TEST_CHECK(mtrl_ckpt_async_busy(a));
    mtrl_ckpt_done done;
    TEST_CHECK(mtrl_ckpt_async_collect(a, 1, &done));
    TEST_EQ_INT(done.status, MTRL_OK);
    TEST_CHECKF(same_file_(sync, async), "%s and %s differ", sync, async);
    TEST_EQ_INT(done.step, 12);
    TEST_EQ_INT(done.version, 9);
    char hex[65];
    mtrl_sha256_file_hex(sync, hex);
    TEST_CHECK(!strcmp(hex, done.sha256));
    TEST_CHECK(!mtrl_ckpt_async_collect(a, 1, &done)); // each write is reported once
    TEST_CHECK(!mtrl_ckpt_async_busy(a));
    // The next one (the buffer reused) is of the state as it is now.
    TEST_EQ_INT(mtrl_ckpt_async_start(a, &m, async, 13, with_optimizer, meta, 3, &err), MTRL_OK);
    TEST_CHECK(mtrl_ckpt_async_collect(a, 1, &done));
    TEST_EQ_INT(done.status, MTRL_OK);
    TEST_EQ_INT(done.version, 10);
    TEST_CHECK(!same_file_(sync, async));
    TEST_EQ_INT(mtrl_model_save(&m, sync, NULL, NULL, with_optimizer, meta, 3, &err), MTRL_OK);
    TEST_CHECK(same_file_(sync, async));
    mtrl_ckpt_async_free(a);
    mtrl_model_free(&m);
}

static void test_failure_reported(void) {
    mtrl_model_dims d = test_model_dims("preset = tiny\n", MTRL_VOCAB);
    mtrl_model m;
    mtrl_model_init(&m, &d, 3);
    char bad[512], good[512];
    snprintf(bad, sizeof bad, "%s/no-such-folder/ckpt.safetensors", dir_);
    snprintf(good, sizeof good, "%s/after-failure.safetensors", dir_);
    mtrl_ckpt_async *a = mtrl_ckpt_async_new();
    mtrl_error err;
    TEST_EQ_INT(mtrl_ckpt_async_start(a, &m, bad, 1, 1, NULL, 0, &err), MTRL_OK);
    mtrl_ckpt_done done;
    TEST_CHECK(mtrl_ckpt_async_collect(a, 1, &done));
    TEST_EQ_INT(done.status, MTRL_ERR_IO);
    TEST_CHECKF(strstr(done.err.msg, "no-such-folder/ckpt.safetensors") != NULL, "%s", done.err.msg);
    TEST_CHECK(access(bad, F_OK) != 0);
    TEST_EQ_INT(mtrl_ckpt_async_start(a, &m, good, 2, 0, NULL, 0, &err), MTRL_OK);
    TEST_CHECK(mtrl_ckpt_async_collect(a, 1, &done));
    TEST_EQ_INT(done.status, MTRL_OK);
    TEST_CHECK(access(good, F_OK) == 0);
    mtrl_ckpt_async_free(a);
    mtrl_model_free(&m);
}

int main(void) {
    snprintf(dir_, sizeof dir_, "/tmp/mtrl-ckpt-async-XXXXXX");
    if (!mkdtemp(dir_)) return 1;
    test_equal_to_sync(1);
    test_equal_to_sync(0);
    test_failure_reported();
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir_);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir_);
    return test_report();
}
