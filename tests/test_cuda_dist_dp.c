// mtrl-test: gpu timeout=900
// The data-parallel step (learner/dist_dp.h) on GPU models, on ONE GPU: R ranks as threads of
// this process, each with its own replica of the model on device 0, over the local backend's
// device buffers (learner/dist_comm.h mtrl_dist_comm_init_local_device), and with NCCL a world
// of one. The batch and the comparison are test_dist_dp's (tests/testdp.h); the reference is
// one rank's GPU mtrl_train_rl_step (mtrl_train_sft_step), since GPU sums differ from the CPU's.
//   * every local collective on device buffers, 1 to 4 ranks on device 0, exactly, in rank
//     order (tests/testdist.h; the same checks as the host buffers');
//   * a world of one (local, and NCCL when built with it) equals one rank's step BIT FOR BIT
//     over two clipped steps: one rank runs the same units, sums of squares over the same
//     tensors in the same order, and the collectives of one rank copy;
//   * the RL step over 2 and 3 ranks against one rank over two clipped steps (norm above the
//     clip of 0.05), for tiny with every layer KDA and for tiny as it is (MLA layers: the bf16
//     attention operands), both with true fp32 GEMMs ([model] gemm = fp32): the statistics, the
//     norm, each rank's reduced and clipped gradient shard, every parameter after each step,
//     the replicas equal bit for bit, each rank's shard of both moments after the second step;
//   * the supervised step over 2 ranks.
// Tolerances (test_dp_tol, per case below): the ranks run other units than one rank, so on the
// GPU the GEMMs run over other row counts (cuBLAS may pick other kernels, another fp32
// summation order), the varlen kernels see each sequence at another offset, and the gradients
// are added in another order; with MLA the attention's bf16 operands and probabilities round
// differently where their fp32 inputs differ by that much.
// Before the device check, in any build: the two configurations' layers and GEMM precision.
// Skips (77) without a CUDA device or in a build without CUDA.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "learner/dist_comm.h"
#include "learner/dist_dp.h"
#include "model/model.h"
#include "tests/testdist.h"
#include "tests/testdp.h"
#include "tests/testhelp.h"

static const char *const kda_ = "hybrid = KKKK\ngemm = fp32\n"; // fp32 everywhere
static const char *const mla_ = "gemm = fp32\n";                // tiny's MLA layers: bf16 attention operands

// Host side (any build): the two configurations are what the cases say they are.
static void configs_(void) {
    const char *ini[2] = {kda_, mla_};
    for (int i = 0; i < 2; i++) {
        mtrl_config cfg;
        tdp_config_(&cfg, ini[i], "");
        mtrl_model_dims d;
        TEST_EQ_INT(mtrl_model_dims_from_config(&d, &cfg, MTRL_VOCAB, NULL), MTRL_OK);
        TEST_CHECKF((strchr(d.mixer, 'M') != NULL) == (i == 1), "case %d: layers %s", i, d.mixer);
        TEST_EQ_INT(d.gemm_tf32, 0);
    }
}

#ifdef MTRL_HAVE_CUDA

static void world_local_(int R, int timeout_ms, test_rank_fn fn, void *ctx, const test_dp_setup *u) {
    test_dist_run_local(R, timeout_ms, u->gpu_buffers, fn, ctx);
}

#ifdef MTRL_HAVE_NCCL
static void world_nccl_(int R, int timeout_ms, test_rank_fn fn, void *ctx, const test_dp_setup *u) {
    (void)u; // rank r on GPU r: a world of one is device 0
    test_dist_run_nccl(R, timeout_ms, fn, ctx);
}
#endif

// The local collectives on device buffers of device 0 (every rank there), in rank order.
static void ops_(int R) {
    test_dist_ops *x = calloc(1, sizeof *x);
    x->mem = &test_dist_dev_mem;
    test_dist_run_local(R, 30000, 0, test_dist_ops_rank, x);
    test_dist_ops_check(x, R, 1, "local, device buffers");
    printf("local on device buffers: world of %d on GPU 0: every op checked\n", R);
    free(x);
}

// A CPU model with a device communicator, and a GPU model with a host one, are refused.
typedef struct refusal_ctx {
    int device;
    char msg[MTRL_ERROR_MSG_MAX];
} refusal_ctx;

static void refusal_rank_(mtrl_dist_comm *c, void *p) {
    refusal_ctx *x = p;
    mtrl_config cfg;
    tdp_config_(&cfg, "hybrid = KKKK\ngemm = fp32\n", "");
    mtrl_model m;
    if (tdp_model_(&m, &cfg, MTRL_QB_FROZEN, x->device, 0, x->msg, sizeof x->msg)) return;
    mtrl_dist_dp dp;
    mtrl_error err = {0};
    mtrl_status s = mtrl_dist_dp_init(&dp, c, &m, &err);
    snprintf(x->msg, sizeof x->msg, "%d %.900s", (int)s, err.msg);
    if (s == MTRL_OK) mtrl_dist_dp_free(&dp);
    mtrl_model_free(&m);
}

static void refusals_(void) {
    refusal_ctx x = {.device = MTRL_DEVICE_CPU};
    test_dist_run_local(1, 5000, 0, refusal_rank_, &x);
    TEST_CONTAINS(x.msg, "a CPU model needs a communicator of host buffers");
    x.device = MTRL_DEVICE_CUDA;
    test_dist_run_local(1, 5000, -1, refusal_rank_, &x);
    TEST_CONTAINS(x.msg, "a model on GPU 0 needs a communicator of that GPU's memory");
}

// A world of one runs what one rank runs: every value bit for bit.
static const test_dp_tol exact_ = {0};

// Tolerances of R ranks against one. NOT YET MEASURED on a GPU (this file was written on a
// machine without one): the limits are the CPU's (test_dist_dp: 1e-5 for the statistics,
// gradient shards and moments, measured there at 1e-6) widened for the GPU's other GEMM and
// varlen orders; the run prints every measured value, from which they are to be tightened.
// All-KDA, fp32 GEMMs: the statistics, norm, gradient shards and moments within 1e-4; every
// parameter within 1e-5 relative or 0.5 lr (an AdamW first step turns a gradient near eps into
// an update that rounding moves by up to 2 lr: testdp.h), all but 0.1% within 1e-5 or 1e-3 lr;
// the clip fractions within two tokens' worth of ~450 (5e-3).
static const test_dp_tol kda_tol_ = {.stats = 1e-4, .clip_abs = 5e-3, .grad = 1e-4, .param_rel = 1e-5,
                                     .param_lr_all = 0.5, .param_lr_most = 1e-3, .param_frac = 1e-3, .moments = 1e-4,
                                     .m_elem_rel = 1e-3, .m_elem_abs = 1e-8};
// With tiny's MLA layers: their bf16 attention operands and probabilities round differently
// where the fp32 inputs differ (test_cuda_model: segmented vs unsegmented gradients 1e-2 per
// tensor), so 1e-3 for the statistics, 3e-2 for the gradient shards and moments, every
// parameter within 1e-4 relative or 2.5 lr, all but 1% within 1e-4 or 1e-2 lr.
static const test_dp_tol mla_tol_ = {.stats = 1e-3, .clip_abs = 1e-2, .grad = 3e-2, .param_rel = 1e-4,
                                     .param_lr_all = 2.5, .param_lr_most = 1e-2, .param_frac = 1e-2, .moments = 3e-2,
                                     .m_elem_rel = 1e-2, .m_elem_abs = 1e-6};

static void dp_cases_(void) {
    const char *clip = "grad_clip = 0.05\n[algo]\nmask_truncated = true\n";
    test_dp_setup local = {.device = MTRL_DEVICE_CUDA, .gpu = 0, .world = world_local_, .gpu_buffers = 0};

    local.model_ini = kda_, local.tol = exact_;
    test_dp_compare(&local, 1, clip, 2, 0, "gpu local, all-KDA, rl clipped, world of 1 (exact)");
#ifdef MTRL_HAVE_NCCL
    test_dp_setup nccl = local;
    nccl.world = world_nccl_;
    test_dp_compare(&nccl, 1, clip, 2, 0, "gpu nccl, all-KDA, rl clipped, world of 1 (exact)");
#else
    printf("a build without NCCL: the NCCL world of one is not run\n");
#endif
    local.tol = kda_tol_;
    test_dp_compare(&local, 2, clip, 2, 0, "gpu local, all-KDA, rl token_mean clipped");
    test_dp_compare(&local, 3, clip, 2, 0, "gpu local, all-KDA, rl token_mean clipped");
    test_dp_compare(&local, 2, "grad_clip = 0.05\n", 1, 1, "gpu local, all-KDA, sft");
    local.model_ini = mla_, local.tol = mla_tol_;
    test_dp_compare(&local, 2, clip, 2, 0, "gpu local, tiny with MLA, rl token_mean clipped");
    test_dp_compare(&local, 3, clip, 2, 0, "gpu local, tiny with MLA, rl token_mean clipped");
}

#endif

int main(void) {
    configs_();
    if (mtrl_model_cuda_devices() == 0) {
        if (test_failed_) return test_report(); // the host checks failed: no skip
        test_skip("no CUDA device (or a build without CUDA)");
    }
#ifdef MTRL_HAVE_CUDA
    for (int R = 1; R <= 4; R++) ops_(R);
    refusals_();
    dp_cases_();
#endif
    return test_report();
}
