// testwshm.h: what the weight-channel tests compare (header-only): a digest of a model's
// parameters and β, and the digest an actor's model has after the ZeroMQ path (the published
// blob, mtrl_model_save_bf16 or mtrl_model_save, loaded by mtrl_model_load into a CPU model).
#ifndef MTRL_TESTWSHM_H
#define MTRL_TESTWSHM_H

#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/checkpoint.h"
#include "common/hash.h"
#include "model/model.h"
#include "common/weights_shm.h"
#include "tests/testhelp.h"

static inline uint64_t test_wshm_digest(const mtrl_model *m) {
    uint64_t h = mtrl_hash64(m->params.base, m->params.total, 1);
    return mtrl_hash64(m->qb_beta, sizeof(real) * (size_t)m->dims.L * (size_t)m->dims.E, h);
}

// What an actor holds after the ZeroMQ path: the published blob loaded into a model.
static inline uint64_t test_wshm_zmq_digest(const mtrl_model *src, int bf16) {
    void *blob;
    size_t len;
    mtrl_error err;
    mtrl_status st = bf16 ? mtrl_model_save_bf16(src, &blob, &len, &err) : mtrl_model_save(src, NULL, &blob, &len, 0, NULL, 0, &err);
    TEST_EQ_INT(st, MTRL_OK);
    mtrl_model m;
    mtrl_model_init(&m, &src->dims, 99);
    mtrl_ckpt c;
    TEST_EQ_INT(mtrl_ckpt_open_mem(&c, blob, len, &err), MTRL_OK);
    TEST_EQ_INT(mtrl_model_load(&m, &c, 0, &err), MTRL_OK);
    mtrl_ckpt_close(&c);
    free(blob);
    uint64_t h = test_wshm_digest(&m);
    mtrl_model_free(&m);
    return h;
}

// Runs this test's reader process (exec'ed, as actors are: a fork would inherit OpenMP's and
// CUDA's state half-made): `/proc/self/exe --reader NAME NONCE VERSION SLOT BF16`, which writes
// n bytes of result to its stdout, read into out. 1 when it exited 0 and wrote them.
static inline int test_wshm_reader(const mtrl_wshm *ch, uint32_t version, int slot, int bf16, void *out, size_t n) {
    int res[2];
    if (pipe(res) != 0) return 0;
    char nonce[32], vs[16], ss[16], bs[4];
    snprintf(nonce, sizeof nonce, "%llu", (unsigned long long)mtrl_wshm_nonce(ch));
    snprintf(vs, sizeof vs, "%u", version);
    snprintf(ss, sizeof ss, "%d", slot);
    snprintf(bs, sizeof bs, "%d", bf16);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(res[1], 1);
        execl("/proc/self/exe", "reader", "--reader", mtrl_wshm_name(ch), nonce, vs, ss, bs, (char *)NULL);
        _exit(127);
    }
    close(res[1]);
    int got = read(res[0], out, n) == (ssize_t)n;
    close(res[0]);
    int st;
    waitpid(pid, &st, 0);
    return got && WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

#endif
