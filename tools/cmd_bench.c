// cmd_bench.c: `mtrl bench ops|model|long|rl`: timings with the command and machine stated.
//
//   mtrl bench model [--device cpu|cuda|cuda:N] [--preset tiny|small | --config EXPERIMENT.ini] [--tokens N] [--seqs B]
//                    [--segment S] [--reps R] [--profile]
//       forward and forward+backward tokens/s (segment: the learner's memory planner's unless
//       --segment is given) of the backbone on random tokens, batched decode
//       tokens/s (B sequences, one token each per step), and peak memory. --profile: one more
//       forward+backward+optimizer step after the timed ones with the model's profile on
//       (model.h: the device synchronised at each phase boundary), printed as a table of
//       phases; the tokens/s above are measured without it
//   mtrl bench long [--device cpu|cuda] [--preset tiny|small | --config EXPERIMENT.ini] [--tokens T] [--decode N]
//                   [--profile]
//       one T-token episode: the actor's prefill time and decode time per token at that context,
//       the learner's forward+backward with the planned segment, and the memory of each.
//       --profile: that learner step timed per phase (the same table as bench model's)
//   --config EXPERIMENT.ini: the experiment's [model] (and its device, unless --device is given)
//   --set section.key=value (model, long, learner, decode, publish): over the experiment or the
//   preset, e.g. --set kernels.gemm=bf16 or --set learner.segment=4096
//   mtrl bench learner [--device cpu|cuda] [--preset tiny|small | --config EXPERIMENT.ini]
//                      [--batches 1x65536,64x1024,512x128,1x262144+200x512] [--reps R] [--profile]
//       the learner's step (mtrl_model_train with [learner] segment) on each batch in turn,
//       in one process: tokens/s against the first batch, tokens recomputed, MFU
//   mtrl bench decode [--device cpu|cuda] [--preset tiny|small | --config EXPERIMENT.ini] [--batches 1,64,256]
//                     [--ctx LO:HI] [--steps N] [--graph on|off|both] [--profile]
//       batched decode at mixed contexts: ms per step against the step's memory roofline, the
//       steps launched kernel by kernel and replayed from CUDA graphs side by side (--graph)
//   mtrl bench publish [--device cpu|cuda] [--preset tiny|small | --config EXPERIMENT.ini] [--dtype bf16|fp32] [--reps R]
//       the cost of publishing one weight version, learner side and actor side, both ways: the
//       ZeroMQ path (safetensors blob + 32 MiB WEIGHTS messages with their CRC; the actor
//       reassembles, parses and loads) and the same-host weight channel (a slot write; the actor
//       copies out: on a GPU the pack kernel on the model's stream and the unpack kernel, device to
//       device, what CUDA IPC maps into the actor). Seconds and GB/s of published bytes, best of R
//   mtrl bench ops --device cuda [...]   the CUDA kernels against the measured ceilings
//   mtrl bench rl EXPERIMENT.ini [--seconds N] [...]   the RL loop end to end (tools/cmd_bench_rl.c)
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/utsname.h>
#include <unistd.h>

#include "common/config.h"
#include "model/model.h"
#include "model/qb.h"
#include "model/model_plan.h"
#include "model/model_wshm.h"
#include "common/check.h"
#include "common/checkpoint.h"
#include "common/hash.h"
#include "common/weights_shm.h"
#include "common/wire/wire.h"
#include "common/rng.h"
#include "common/timeutil.h"
#include "common/tokenizer.h"
#include "tools/cli.h"
#ifdef MTRL_HAVE_CUDA_BENCH
#include "kernels/lab/bench_cuda.h"
#endif

#ifdef MTRL_HAVE_CUDA_BENCH
#define BENCH_OPS_USAGE_ " | mtrl bench ops --device cuda"
#else
#define BENCH_OPS_USAGE_ "" // not in this build
#endif
#define BENCH_USAGE "mtrl bench model [--device cpu|cuda] [--preset tiny|small | --config EXPERIMENT.ini] [--tokens N] [--seqs B] [--segment S] [--reps R] [--profile] [--set section.key=value ...] | mtrl bench long [--device cpu|cuda] [--preset tiny|small | --config EXPERIMENT.ini] [--tokens T] [--decode N] [--profile] | mtrl bench learner [--device cpu|cuda] [--preset tiny|small | --config EXPERIMENT.ini] [--batches 1x65536,64x1024,512x128,1x262144+200x512] [--reps R] [--profile] | mtrl bench decode [--device cpu|cuda] [--preset tiny|small | --config EXPERIMENT.ini] [--batches 1,64,256] [--ctx LO:HI] [--steps N] [--graph on|off|both] [--profile] | mtrl bench publish [--device cpu|cuda] [--preset tiny|small | --config EXPERIMENT.ini] [--dtype bf16|fp32] [--reps R] | mtrl bench rl EXPERIMENT.ini [--seconds N] [--db runs.db] [--set section.key=value ...]" BENCH_OPS_USAGE_

static void print_machine_(void) {
    struct utsname u;
    uname(&u);
    char cpu[256] = "unknown cpu";
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (f) {
        char line[512];
        while (fgets(line, sizeof line, f))
            if (!strncmp(line, "model name", 10)) {
                char *c = strchr(line, ':');
                if (c) snprintf(cpu, sizeof cpu, "%s", c + 2);
                cpu[strcspn(cpu, "\n")] = '\0';
                break;
            }
        fclose(f);
    }
    char when[32];
    mtrl_time_iso(mtrl_time_wall(), when, sizeof when);
    printf("machine: %s, %ld cores, %s %s; %s\n", cpu, sysconf(_SC_NPROCESSORS_ONLN), u.sysname, u.machine, when);
}

void cli_bench_machine(void) { print_machine_(); }

// The model a benchmark runs and its size: the options `bench model` and `bench long` share.
typedef struct bench_src {
    const char *device, *preset, *config;
    int tokens;
    long segment; // [learner] segment of the config (mtrl_config_segment), set by model_open_
    const char *sets[16]; // --set section.key=value, applied over the config or the preset
    int n_sets;
} bench_src;

// Takes option a (with value v) when it is one of bench_src's: 1, else 0.
static int src_opt_(bench_src *s, const char *a, const char *v) {
    if (!v) return 0;
    if (!strcmp(a, "--device")) s->device = v;
    else if (!strcmp(a, "--preset")) s->preset = v;
    else if (!strcmp(a, "--config")) s->config = v;
    else if (!strcmp(a, "--tokens")) s->tokens = atoi(v);
    else if (!strcmp(a, "--set") && s->n_sets < (int)(sizeof s->sets / sizeof *s->sets)) s->sets[s->n_sets++] = v;
    else return 0;
    return 1;
}

// "preset tiny" or "the model of EXPERIMENT.ini", for the report line.
// ", MLA trained naive, prefill absorbed" (model.h mla_absorbed, mla_prefill_naive): which
// attention form the numbers of a model with MLA layers are for; "" without MLA.
static const char *mla_forms_(const mtrl_model_dims *d) {
    if (!strchr(d->mixer, 'M')) return "";
    static const char *forms[4] = {", MLA trained naive, prefill absorbed", ", MLA trained absorbed, prefill absorbed",
                                   ", MLA trained naive, prefill naive", ", MLA trained absorbed, prefill naive"};
    return forms[(d->mla_absorbed ? 1 : 0) + (d->mla_prefill_naive ? 2 : 0)];
}

static const char *src_label_(const bench_src *s, char *buf, size_t cap) {
    snprintf(buf, cap, "%s%s", s->config ? "the model of " : "preset ", s->config ? s->config : s->preset);
    return buf;
}

// The model of --config EXPERIMENT.ini ([model], and its device unless --device is given), or
// of the preset, on the device (cpu, cuda, cuda:N): 0, or the exit code (77: no GPU here).
static int model_open_(bench_src *src, mtrl_model *m) {
    const char *device = src->device, *preset = src->preset, *config = src->config;
    mtrl_config cfg;
    if (config) {
        mtrl_config_errors errs = {0};
        if (mtrl_config_load(&cfg, config, src->sets, src->n_sets, &errs) != MTRL_OK) {
            mtrl_config_errors_print(&errs, stderr);
            mtrl_config_errors_free(&errs);
            return 2;
        }
        if (!device) device = cfg.model.device;
    } else {
        char text[256];
        snprintf(text, sizeof text, "[env]\nname = calc\n[model]\npreset = %s\n", preset);
        mtrl_config_errors errs = {0};
        if (mtrl_config_load_text(&cfg, "--preset", text, src->sets, src->n_sets, &errs) != MTRL_OK) {
            mtrl_config_errors_print(&errs, stderr);
            mtrl_config_errors_free(&errs);
            return 2;
        }
    }
    if (!device) device = "cpu";
    int dev, gpu;
    if (mtrl_model_parse_device(device, &dev, &gpu))
        return cli_usage_error("bench", BENCH_USAGE, "--device %s: expected cpu, cuda or cuda:N", device);
    src->segment = mtrl_config_segment(&cfg);
    mtrl_model_dims d;
    mtrl_error err;
    if (mtrl_model_dims_from_config(&d, &cfg, MTRL_VOCAB, &err) != MTRL_OK) {
        fprintf(stderr, "mtrl bench: %s\n", err.msg);
        return 2;
    }
    if (mtrl_model_init_on(m, &d, 1, dev, gpu, &err) != MTRL_OK) {
        fprintf(stderr, "mtrl bench: %s\n", err.msg);
        return dev == MTRL_DEVICE_CUDA && mtrl_model_cuda_devices() == 0 ? 77 : 2;
    }
    return 0;
}

// *seg: the segment length the learner would use for batch b on m with `setting` ([learner]
// segment or --segment; model_plan.h mtrl_model_segment_resolve: 0 = the whole sequences in one
// segment), the memory plan printed when the planner chose it. 1 when no plan fits.
static int plan_segment_(mtrl_model *m, const mtrl_batch *b, long setting, const char *cmd, int *seg) {
    mtrl_model_plan plan;
    mtrl_error err;
    if (mtrl_model_segment_resolve(m, b, setting, seg, &plan, &err) != MTRL_OK) {
        fprintf(stderr, "mtrl bench %s: %s\n", cmd, err.msg);
        return 1;
    }
    if (setting == MTRL_CFG_SEGMENT_AUTO) mtrl_model_plan_print(&plan, stdout);
    return 0;
}

// mtrl_model_loss_fn of the benchmarks: the gradient coefficients are fixed and already in
// dlogp (the caller fills it before mtrl_model_train), so a unit's loss has nothing to write.
static void bench_loss_(void *user, int i0, int n, const real *logp, const real *ent, real *dlogp, real *dent) {
    (void)user, (void)i0, (void)n, (void)logp, (void)ent, (void)dlogp, (void)dent;
}

// The table of a profiled step that took `step` seconds: each phase that ran, its share of the
// step, and the share no phase took (the drivers' work between phases, the syncs themselves).
static void profile_print_(const mtrl_model_profile *prof, double step) {
    double sum = 0, pass_sum[MTRL_PROF_PASSES] = {0};
    printf("  %-22s %8s %12s %8s\n", "phase", "calls", "total ms", "% step");
    for (int p = 0; p < MTRL_PROF_PASSES; p++)
        for (int k = 0; k < MTRL_PROF_BLOCKS; k++) {
            if (!prof->calls[p][k]) continue;
            char name[64];
            printf("  %-22s %8ld %12.2f %7.1f%%\n", mtrl_model_profile_name(p, k, name, sizeof name), prof->calls[p][k],
                   prof->sec[p][k] * 1e3, 100 * prof->sec[p][k] / step);
            sum += prof->sec[p][k];
            pass_sum[p] += prof->sec[p][k];
        }
    printf("  passes: fwd %.2f ms, recompute %.2f ms, bwd (optimizer included) %.2f ms\n", pass_sum[MTRL_PROF_FWD] * 1e3,
           pass_sum[MTRL_PROF_RECOMPUTE] * 1e3, pass_sum[MTRL_PROF_BWD] * 1e3);
    printf("  sum of phases %.2f ms = %.1f%% of the profiled step; %.2f ms in no phase (state copies, zeroing, "
           "bookkeeping, sync overhead)\n",
           sum * 1e3, 100 * sum / step, (step - sum) * 1e3);
}

// One learner step (forward, backward, AdamW) with the model's profile on, and its table.
// best_fb: the unprofiled forward+backward, for comparison.
static void profile_step_(mtrl_model *m, const mtrl_batch *b, int segment, real *logp, const real *dlogp,
                          double best_fb) {
    mtrl_model_profile prof;
    memset(&prof, 0, sizeof prof);
    m->profile = &prof;
    double t0 = mtrl_time_mono();
    mtrl_model_zero_grads(m);
    mtrl_model_train(m, b, segment, logp, NULL, (real *)dlogp, NULL, bench_loss_, NULL);
    double t1 = mtrl_time_mono();
    mtrl_model_optimizer_step(m, (real)1e-4, (real)0.9, (real)0.95, (real)1e-8, (real)0.1, (real)1);
    double t2 = mtrl_time_mono();
    m->profile = NULL;
    printf("profile: one forward+backward+optimizer step, device synchronised at every phase boundary: %.1f ms "
           "(forward+backward %.1f ms; unprofiled best %.1f ms)\n",
           (t2 - t0) * 1e3, (t1 - t0) * 1e3, best_fb * 1e3);
    profile_print_(&prof, t2 - t0);
}

// Active matmul parameters: every matrix but the embedding (a lookup), the routed experts at
// k/E of theirs (each token runs k of the E).
// The model FLOPs of training on sequences of these lengths (the usual convention: 6 per
// active matmul parameter and token, forward 2 and backward 4, plus causal attention's
// 3 x 2 x mH x (dn+dr+dv) x len/2 per token and MLA layer; KDA's state products, < 1%, left out).
static double train_flops_(const mtrl_model *m, int n, const int *len) {
    const mtrl_model_dims *d = &m->dims;
    double tok = 0, attn = 0;
    int n_mla = 0;
    for (int l = 0; l < d->L; l++) n_mla += d->mixer[l] == 'M';
    for (int i = 0; i < n; i++) {
        tok += len[i];
        attn += (double)len[i] * len[i] / 2.0;
    }
    return 6 * mtrl_model_active_matmul_params(m) * tok + 3.0 * 2 * n_mla * d->mH * (double)(d->dn + d->dr + d->dv) * attn;
}

static int bench_model_(int argc, char **argv) {
    bench_src src = {.preset = "tiny", .tokens = 2048, .segment = MTRL_CFG_SEGMENT_AUTO};
    int seqs = 8, segment = 0, reps = 3, profile = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (src_opt_(&src, a, v)) i++;
        else if (!strcmp(a, "--seqs") && v) { seqs = atoi(v); i++; }
        else if (!strcmp(a, "--segment") && v) { segment = atoi(v); i++; }
        else if (!strcmp(a, "--reps") && v) { reps = atoi(v); i++; }
        else if (!strcmp(a, "--profile")) profile = 1;
        else return cli_usage_error("bench", BENCH_USAGE, "unknown option '%s'", a);
    }
    int tokens = src.tokens;
    if (tokens < seqs || seqs < 1 || reps < 1) return cli_usage_error("bench", BENCH_USAGE, "need tokens >= seqs >= 1 and reps >= 1");
    mtrl_model m;
    int rc = model_open_(&src, &m);
    if (rc) return rc;
    const mtrl_model_dims d = m.dims;
    int per = tokens / seqs;
    uint32_t *tok = malloc(sizeof(uint32_t) * (size_t)seqs * per);
    const uint32_t **toks = malloc(sizeof(*toks) * (size_t)seqs);
    int *len = malloc(sizeof(int) * (size_t)seqs);
    for (int i = 0; i < seqs; i++) {
        for (int t = 0; t < per; t++) tok[(size_t)i * per + t] = (uint32_t)(mtrl_rng_u64(1, (uint64_t)i, (uint64_t)t) % 256);
        toks[i] = tok + (size_t)i * per;
        len[i] = per;
    }
    mtrl_batch b = {seqs, toks, len, NULL};
    real *logp = malloc(sizeof(real) * (size_t)seqs * per), *c = malloc(sizeof(real) * (size_t)seqs * per);
    for (int t = 0; t < seqs * per; t++) c[t] = (real)(1.0 / (seqs * per));
    print_machine_();
    // without --segment, the learner's: [learner] segment (auto: the planner's from the device's
    // free memory)
    if (plan_segment_(&m, &b, segment > 0 ? segment : src.segment, "model", &segment)) {
        free(tok); free(toks); free(len); free(logp); free(c);
        mtrl_model_free(&m);
        return 1;
    }
    char label[1100];
    // the GEMM precision of a GPU run (backend.h: bf16 wins over TF32)
    const char *on = m.device != MTRL_DEVICE_CUDA      ? "cpu"
                     : mtrl_model_gemm_precision(&m) == MTRL_KGEMM_BF16                 ? "cuda (bf16 GEMMs)"
                     : mtrl_model_gemm_precision(&m) == MTRL_KGEMM_TF32                 ? "cuda (TF32 GEMMs)"
                                                       : "cuda";
    printf("model: %s on %s, %zu parameters, %d layers (%s), d=%d, %d experts top-%d%s; batch %d x %d tokens, segment %d, OMP threads %s\n",
           src_label_(&src, label, sizeof label), on,
           mtrl_model_param_count(&m), d.L, d.mixer, d.d, d.E, d.k,
           mla_forms_(&d), seqs, per,
           segment, getenv("OMP_NUM_THREADS") ? getenv("OMP_NUM_THREADS") : "default");
    double best_f = 1e30, best_fb = 1e30;
    mtrl_model_forward(&m, &b, segment, logp, NULL, NULL); // warm-up
    for (int r = 0; r < reps; r++) {
        double t0 = mtrl_time_mono();
        mtrl_model_forward(&m, &b, segment, logp, NULL, NULL);
        double t1 = mtrl_time_mono();
        mtrl_qb_apply(&m);
        // the learner's step: forward, loss and backward unit by unit (model.h mtrl_model_train)
        double t2 = mtrl_time_mono();
        mtrl_model_zero_grads(&m);
        mtrl_model_train(&m, &b, segment, logp, NULL, c, NULL, bench_loss_, NULL);
        double t3 = mtrl_time_mono();
        if (t1 - t0 < best_f) best_f = t1 - t0;
        if (t3 - t2 < best_fb) best_fb = t3 - t2;
        mtrl_qb_apply(&m);
    }
    // Batched decode: each sequence prefilled with 16 tokens, then steps of one token per sequence.
    enum { PRE = 16, STEPS = 16 };
    mtrl_decode_state *st = malloc(sizeof(*st) * (size_t)seqs), **sp = malloc(sizeof(*sp) * (size_t)seqs);
    real *lg = malloc(sizeof(real) * (size_t)seqs * d.V);
    uint32_t *in = malloc(sizeof(uint32_t) * (size_t)seqs);
    double best_d = 1e30;
    for (int r = 0; r < reps; r++) {
        for (int i = 0; i < seqs; i++) {
            if (r == 0) mtrl_decode_state_init(&st[i], &m, PRE + STEPS + 1);
            mtrl_decode_state_reset(&st[i], &m);
            mtrl_model_prefill(&m, &st[i], toks[i], PRE < per ? PRE : per, NULL, NULL);
            sp[i] = &st[i];
        }
        double t0 = mtrl_time_mono();
        for (int s = 0; s < STEPS; s++) {
            for (int i = 0; i < seqs; i++) in[i] = toks[i][(PRE + s) % per];
            mtrl_model_decode(&m, sp, seqs, in, lg, NULL);
        }
        double t1 = mtrl_time_mono();
        if (t1 - t0 < best_d) best_d = t1 - t0;
    }
    for (int i = 0; i < seqs; i++) mtrl_decode_state_free(&st[i]);
    free(st);
    free(sp);
    free(lg);
    free(in);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double ntok = (double)seqs * per;
    printf("forward:          %10.0f tokens/s  (%.3f s for %.0f tokens, best of %d)\n", ntok / best_f, best_f, ntok, reps);
    printf("forward+backward: %10.0f tokens/s  (%.3f s; the learner's step, mtrl_model_train: %ld tokens recomputed)\n",
           ntok / best_fb, best_fb, m.recomputed_tokens);
    printf("decode:           %10.0f tokens/s  (%d sequences x %d steps in %.3f s, %.2f ms per step)\n",
           seqs * (double)STEPS / best_d, seqs, STEPS, best_d, best_d / STEPS * 1e3);
    // Model FLOPs utilisation, the usual convention: 6 FLOPs per active matmul parameter per
    // trained token (forward 2, backward 4; experts count k/E of their parameters, the embedding
    // lookup none) plus causal attention 3 x 2 x mH x (dn+dr + dv) x T/2 per token and MLA layer
    // (training form: per-head keys of dn+dr, values of dv). KDA's state products (< 1% here) are
    // left out. Peaks: the H200's bf16 dense spec (989 TFLOP/s) and the cuBLAS 8192^3 GEMM
    // measured on it (781 TFLOP/s, docs/perf.md).
    double active = mtrl_model_active_matmul_params(&m), flops_tok = train_flops_(&m, seqs, len) / ntok;
    double tflops = flops_tok * ntok / best_fb / 1e12;
    printf("model FLOPs:      %.3g GFLOP per trained token (%.4g M active matmul parameters); %.3g TFLOP/s = MFU %.1f%% "
           "of 989 (spec), %.1f%% of 781 (measured GEMM)\n",
           flops_tok / 1e9, active / 1e6, tflops, 100 * tflops / 989, 100 * tflops / 781);
    printf("memory: parameters %.1f MB (x4 with gradients and AdamW), peak segment activations %.1f MB, peak RSS %.1f MB\n",
           m.params.total / 1e6, m.peak_activation_bytes / 1e6, ru.ru_maxrss / 1e3);
    if (profile) profile_step_(&m, &b, segment, logp, c, best_fb);
    free(tok);
    free(toks);
    free(len);
    free(logp);
    free(c);
    mtrl_model_free(&m);
    return 0;
}


// "1x65536,64x1024,1x262144+200x512": batches separated by commas, each a '+'-joined list of
// COUNTxLEN groups. Fills *len (malloc'ed) with batch `which`'s lengths; returns their number,
// 0 when there is no such batch, -1 for a malformed list.
static int batch_lens_(const char *spec, int which, int **len) {
    const char *p = spec;
    *len = NULL;
    for (int k = 0; k < which; k++) {
        p = strchr(p, ',');
        if (!p) return 0;
        p++;
    }
    int n = 0, cap = 0;
    for (;;) {
        char *e;
        long cnt = strtol(p, &e, 10), l;
        if (e == p || *e != 'x' || cnt < 1 || cnt > 1000000) return -1;
        p = e + 1;
        l = strtol(p, &e, 10);
        if (e == p || l < 1 || l > (1L << 30)) return -1;
        p = e;
        if (n + cnt > cap) {
            cap = (int)(n + cnt) * 2;
            *len = realloc(*len, sizeof(int) * (size_t)cap);
        }
        for (long j = 0; j < cnt; j++) (*len)[n++] = (int)l;
        if (*p == '+') { p++; continue; }
        if (*p == ',' || *p == '\0') return n;
        return -1;
    }
}

// Batch k's text in a --batches list (for the report line).
static const char *spec_item_(const char *spec, int k, char *buf, size_t cap) {
    const char *p = spec;
    for (int i = 0; i < k && p; i++) {
        p = strchr(p, ',');
        if (p) p++;
    }
    size_t l = p ? strcspn(p, ",") : 0;
    snprintf(buf, cap, "%.*s", (int)(l < cap ? l : cap - 1), p ? p : "");
    return buf;
}

// `mtrl bench learner`: the learner's step (mtrl_model_train with [learner] segment, then
// AdamW) on batches of given lengths in one process, so that many short sequences, mixed lengths
// and one long sequence are compared on the same model and device (issue 21 R1).
static int bench_learner_(int argc, char **argv) {
    bench_src src = {.preset = "tiny", .tokens = 0, .segment = MTRL_CFG_SEGMENT_AUTO};
    const char *spec = "1x4096,64x64,8x512";
    int reps = 2, profile = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (src_opt_(&src, a, v)) i++;
        else if (!strcmp(a, "--batches") && v) { spec = v; i++; }
        else if (!strcmp(a, "--reps") && v) { reps = atoi(v); i++; }
        else if (!strcmp(a, "--profile")) profile = 1;
        else return cli_usage_error("bench", BENCH_USAGE, "unknown option '%s'", a);
    }
    int *len = NULL;
    for (int k = 0;; k++) {
        int n = batch_lens_(spec, k, &len);
        free(len);
        if (n == 0) break;
        if (n < 0) return cli_usage_error("bench", BENCH_USAGE, "--batches %s: expected COUNTxLEN[+COUNTxLEN...][,...]", spec);
    }
    if (reps < 1) return cli_usage_error("bench", BENCH_USAGE, "need --reps >= 1");
    mtrl_model m;
    int rc = model_open_(&src, &m);
    if (rc) return rc;
    print_machine_();
    char label[1100];
    printf("learner step: %s on %s, %zu parameters%s; mtrl_model_train with [learner] segment, best of %d\n",
           src_label_(&src, label, sizeof label), m.device == MTRL_DEVICE_CUDA ? "cuda" : "cpu", mtrl_model_param_count(&m),
           mla_forms_(&m.dims), reps);
    double first = 0;
    for (int k = 0; rc == 0; k++) {
        int n = batch_lens_(spec, k, &len);
        if (n <= 0) break;
        size_t total = 0;
        for (int i = 0; i < n; i++) total += (size_t)len[i];
        uint32_t *tok = malloc(sizeof(uint32_t) * total);
        const uint32_t **toks = malloc(sizeof(*toks) * (size_t)n);
        real *logp = malloc(sizeof(real) * total), *c = malloc(sizeof(real) * total);
        for (size_t t = 0; t < total; t++) {
            tok[t] = (uint32_t)(mtrl_rng_u64(1, 3, t) % 256);
            c[t] = (real)(1.0 / (double)total);
        }
        for (int i = 0, o = 0; i < n; o += len[i++]) toks[i] = tok + o;
        mtrl_batch b = {n, toks, len, NULL};
        mtrl_error err;
        int seg = 0;
        if (mtrl_model_segment_resolve(&m, &b, src.segment, &seg, NULL, &err) != MTRL_OK) {
            fprintf(stderr, "mtrl bench learner: batch %d: %s\n", k + 1, err.msg);
            rc = 1;
        } else {
            double best = 1e30, step = 0;
            for (int r = 0; r <= reps; r++) { // the first is a warm-up
                double t0 = mtrl_time_mono();
                mtrl_model_zero_grads(&m);
                mtrl_model_train(&m, &b, seg, logp, NULL, c, NULL, bench_loss_, NULL);
                double t1 = mtrl_time_mono();
                mtrl_model_optimizer_step(&m, (real)1e-5, (real)0.9, (real)0.95, (real)1e-8, (real)0.1, (real)1);
                mtrl_qb_apply(&m);
                double t2 = mtrl_time_mono();
                if (r > 0 && t1 - t0 < best) {
                    best = t1 - t0;
                    step = t2 - t0;
                }
            }
            double tps = (double)total / best, tflops = train_flops_(&m, n, len) / best / 1e12;
            if (k == 0) first = tps;
            printf("batch %-28.*s %7d seqs %9zu tokens  segment %6d: %9.0f tokens/s (%.3f s; with AdamW %.3f s) = %.2fx "
                   "batch 1; %ld tokens recomputed; %.3g TFLOP/s = MFU %.1f%% of 989\n",
                   28, spec_item_(spec, k, label, sizeof label), n, total, seg, tps, best, step, tps / first,
                   m.recomputed_tokens, tflops, 100 * tflops / 989);
            if (profile) profile_step_(&m, &b, seg, logp, c, best);
        }
        free(tok);
        free(toks);
        free(logp);
        free(c);
        free(len);
    }
    mtrl_model_free(&m);
    return rc;
}

// Bytes one decode step must read at least: every matrix but the embedding (whose B rows are
// negligible) once, the routed experts only where a row chose them (distinct[l]: experts hit in
// MoE layer l this step), each sequence's KDA state and conv windows read and written, and its
// MLA latents read (ctx[i] rows per MLA layer).
static double decode_bytes_min_(const mtrl_model *m, int B, const int *ctx, const int *distinct) {
    const mtrl_model_dims *d = &m->dims;
    double wsz = mtrl_model_gemm_precision(m) == MTRL_KGEMM_BF16 ? 2 : sizeof(real), bytes = 0;
    for (int i = 0; i < m->params.n; i++) {
        const mtrl_tensor *t = &m->params.items[i];
        double n = (double)t->nbytes / sizeof(real);
        if (!strcmp(t->name, "embed")) continue;
        double w = t->ndim >= 2 ? wsz : sizeof(real);
        // the same test as the FLOP count's (mtrl_model_active_matmul_params): a name of its own
        // here (".ew", which no tensor has) counted every expert as read at every B
        if (mtrl_model_param_is_routed_expert(t->name)) {
            const char *ly = strstr(t->name, "layers.");
            MTRL_CHECKF(ly, "routed expert tensor %s outside a layer", t->name);
            n *= (double)distinct[atoi(ly + 7)] / d->E;
        }
        bytes += n * w;
    }
    int n_kda = 0, n_mla = 0;
    for (int l = 0; l < d->L; l++) {
        n_kda += d->mixer[l] == 'K';
        n_mla += d->mixer[l] == 'M';
    }
    double st = (double)n_kda * sizeof(real) * ((double)d->H * d->D * d->D + 3.0 * (d->W - 1) * d->H * d->D);
    for (int i = 0; i < B; i++) bytes += 2 * st + (double)n_mla * ctx[i] * (d->dc + d->dr) * (double)mtrl_model_latent_size(m);
    return bytes;
}

// `mtrl bench decode`: batched decode steps (mtrl_model_decode, B sequences, one token each) at
// contexts spread evenly over [lo, hi] (mixed lengths in one batch), for each B of --batches;
// the step time against its memory roofline: the least bytes it must move (decode_bytes_min_:
// weights and latents read, states read and written) at the copy rate (read + write) measured in
// the same run (issue 21 R2). The states' latents are not
// prefilled (the contexts' rows are zeros; the decode reads them all the same). --graph: the
// steps launched kernel by kernel (off), replayed from CUDA graphs (on: [kernels] decode_graph
// = on, model/model_decode.h; the first two steps of each B launch and record), or both, side by
// side on the same states (both, the default: what the graph pays).
static int bench_decode_(int argc, char **argv) {
    bench_src src = {.preset = "tiny", .tokens = 0, .segment = MTRL_CFG_SEGMENT_AUTO};
    const char *batches = "1,8,64", *graph = "both";
    int lo = 1024, hi = 32768, steps = 16, profile = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (src_opt_(&src, a, v)) i++;
        else if (!strcmp(a, "--batches") && v) { batches = v; i++; }
        else if (!strcmp(a, "--ctx") && v) {
            if (sscanf(v, "%d:%d", &lo, &hi) != 2) lo = hi = atoi(v);
            i++;
        } else if (!strcmp(a, "--steps") && v) { steps = atoi(v); i++; }
        else if (!strcmp(a, "--graph") && v) { graph = v; i++; }
        else if (!strcmp(a, "--profile")) profile = 1;
        else return cli_usage_error("bench", BENCH_USAGE, "unknown option '%s'", a);
    }
    if (lo < 1 || hi < lo || steps < 1) return cli_usage_error("bench", BENCH_USAGE, "need 1 <= lo <= hi (--ctx LO:HI) and --steps >= 1");
    int modes = !strcmp(graph, "off") ? 1 : !strcmp(graph, "on") ? 2 : !strcmp(graph, "both") ? 3 : 0; // bit 0 launched, 1 graphs
    if (!modes) return cli_usage_error("bench", BENCH_USAGE, "--graph %s: expected on, off or both", graph);
    if ((modes & 2) && src.n_sets < (int)(sizeof src.sets / sizeof *src.sets)) src.sets[src.n_sets++] = "kernels.decode_graph=on";
    mtrl_model m;
    int rc = model_open_(&src, &m);
    if (rc) return rc;
    const mtrl_model_dims *d = &m.dims;
    print_machine_();
    double rate = mtrl_model_copy_rate(&m, (size_t)1 << 30, 5);
    char label[1100];
    printf("decode: %s on %s (%s weights), %zu parameters; contexts %d..%d; copy rate %.0f GB/s (1 GiB, read + write)\n",
           src_label_(&src, label, sizeof label), m.device == MTRL_DEVICE_CUDA ? "cuda" : "cpu",
           mtrl_model_gemm_precision(&m) == MTRL_KGEMM_BF16 ? "bf16" : "fp32", mtrl_model_param_count(&m), lo, hi, rate / 1e9);
    size_t rw = (size_t)d->n_moe * d->k;
    for (const char *p = batches; rc == 0 && *p;) {
        int B = atoi(p);
        p += strcspn(p, ",");
        if (*p == ',') p++;
        if (B < 1) return cli_usage_error("bench", BENCH_USAGE, "--batches %s: expected B,B,...", batches);
        mtrl_decode_state *st = malloc(sizeof(*st) * (size_t)B), **sp = malloc(sizeof(*sp) * (size_t)B);
        int *ctx = malloc(sizeof(int) * (size_t)B), *distinct = calloc((size_t)d->L, sizeof(int));
        real *lg = malloc(sizeof(real) * (size_t)B * d->V);
        uint32_t *in = malloc(sizeof(uint32_t) * (size_t)B);
        uint8_t *rout = malloc((size_t)B * rw + 1);
        for (int i = 0; i < B; i++) {
            ctx[i] = B == 1 ? hi : lo + (int)((long)(hi - lo) * i / (B - 1));
            mtrl_decode_state_init(&st[i], &m, ctx[i] + 2 * (steps + 3) + 2);
            st[i].pos = ctx[i];
            sp[i] = &st[i];
            in[i] = (uint32_t)(mtrl_rng_u64(5, (uint64_t)i, 0) % 256);
        }
        double dt = 0, dt_mode[2] = {0, 0};
        long rep_mode[2] = {0, 0};
        for (int g = 0; g < 2; g++) {
            if (!(modes >> g & 1)) continue;
            m.decode_eager = !g;
            // warm-up: one launched step (the scratch grows), and with graphs the recording; the
            // last timed step's routing is read back, as the same step as the others
            for (int s = 0; s < 1 + g; s++) mtrl_model_decode(&m, sp, B, in, lg, rout);
            long r0, r1;
            mtrl_model_decode_counts(&m, &r0, NULL, NULL);
            double t0 = mtrl_time_mono();
            for (int s = 0; s < steps; s++) mtrl_model_decode(&m, sp, B, in, lg, rout);
            dt_mode[g] = dt = (mtrl_time_mono() - t0) / steps;
            mtrl_model_decode_counts(&m, &r1, NULL, NULL);
            rep_mode[g] = r1 - r0;
        }
        m.decode_eager = 0;
        // experts the last step's rows chose, per MoE layer
        for (int l = 1; l < d->L; l++) {
            unsigned char hit[256] = {0};
            for (int i = 0; i < B; i++)
                for (int j = 0; j < d->k; j++) hit[rout[(size_t)i * rw + (size_t)(l - 1) * d->k + j]] = 1;
            for (int e = 0; e < d->E && e < 256; e++) distinct[l] += hit[e];
        }
        // the copy rate counts bytes read plus bytes written, and so do the step's bytes (its
        // states are read and written): the same traffic at the same rate, not the reads against
        // half of it (a copy's reads alone are not the limit of a read-mostly step)
        double bytes = decode_bytes_min_(&m, B, ctx, distinct), roof = bytes / rate;
        for (int g = 0; g < 2; g++)
            if (modes >> g & 1)
                printf("B %4d %-8s: %8.3f ms per step, %9.0f tokens/s; moves >= %.2f GB -> roofline %.3f ms = %.1f%% of it"
                       "; %ld of %d steps replayed\n",
                       B, g ? "graph" : "launched", dt_mode[g] * 1e3, B / dt_mode[g], bytes / 1e9, roof * 1e3,
                       100 * roof / dt_mode[g], rep_mode[g], steps);
        if (modes == 3)
            printf("B %4d: graph / launched = %.3f\n", B, dt_mode[1] / dt_mode[0]);
        (void)dt;
        if (profile) {
            mtrl_model_profile prof;
            memset(&prof, 0, sizeof prof);
            m.profile = &prof;
            double p0 = mtrl_time_mono();
            mtrl_model_decode(&m, sp, B, in, lg, NULL);
            double p1 = mtrl_time_mono();
            m.profile = NULL;
            printf("profile: one decode step of B = %d, device synchronised at every phase boundary: %.2f ms\n", B,
                   (p1 - p0) * 1e3);
            profile_print_(&prof, p1 - p0);
        }
        for (int i = 0; i < B; i++) mtrl_decode_state_free(&st[i]);
        free(st); free(sp); free(ctx); free(distinct); free(lg); free(in); free(rout);
    }
    mtrl_model_free(&m);
    return rc;
}

// One long episode, what issue 8's table asks for: the actor's prefill of T tokens (chunked
// form) and its decode time per token at that context, then the learner's forward+backward of
// the T-token sequence with the planner's segment, and the memory of each.
static int bench_long_(int argc, char **argv) {
    bench_src src = {.preset = "tiny", .tokens = 8192, .segment = MTRL_CFG_SEGMENT_AUTO};
    int steps = 16, profile = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (src_opt_(&src, a, v)) i++;
        else if (!strcmp(a, "--decode") && v) { steps = atoi(v); i++; }
        else if (!strcmp(a, "--profile")) profile = 1;
        else return cli_usage_error("bench", BENCH_USAGE, "unknown option '%s'", a);
    }
    int tokens = src.tokens;
    if (tokens < 2 || steps < 1) return cli_usage_error("bench", BENCH_USAGE, "need --tokens >= 2 and --decode >= 1");
    mtrl_model m;
    int rc = model_open_(&src, &m);
    if (rc) return rc;
    print_machine_();
    char label[1100];
    printf("long episode: %s on %s, %zu parameters%s, %d tokens\n", src_label_(&src, label, sizeof label),
           m.device == MTRL_DEVICE_CUDA ? "cuda" : "cpu", mtrl_model_param_count(&m), mla_forms_(&m.dims), tokens);
    uint32_t *tok = malloc(sizeof(uint32_t) * ((size_t)tokens + (size_t)steps));
    for (size_t t = 0; t < (size_t)tokens + (size_t)steps; t++) tok[t] = (uint32_t)(mtrl_rng_u64(1, 7, t) % 256);
    size_t fr0 = 0, tot = 0, scr = 0, peak = 0;
    mtrl_model_mem_info(&m, &fr0, &tot, &scr, &peak);
    // actor: prefill, then decode one token at a time at that context
    mtrl_decode_state st;
    mtrl_decode_state_init(&st, &m, tokens + steps);
    double t0 = mtrl_time_mono();
    mtrl_model_prefill(&m, &st, tok, tokens, NULL, NULL);
    double t1 = mtrl_time_mono();
    real *row = malloc(sizeof(real) * (size_t)m.dims.V);
    mtrl_decode_state *sp[1] = {&st};
    for (int k = 0; k < steps; k++) mtrl_model_decode(&m, sp, 1, &tok[tokens + k], row, NULL);
    double t2 = mtrl_time_mono();
    printf("actor:   prefill %.2f s (%.0f tokens/s); decode %.2f ms per token at %d..%d context; decode state %.1f MiB\n",
           t1 - t0, tokens / (t1 - t0), (t2 - t1) / steps * 1e3, tokens, tokens + steps,
           (double)mtrl_decode_state_bytes(&m, tokens + steps) / (1 << 20));
    mtrl_decode_state_free(&st);
    // learner: the whole sequence, segment from the planner
    const uint32_t *tp[1] = {tok};
    int len[1] = {tokens};
    mtrl_batch b = {1, tp, len, NULL};
    int seg;
    if (plan_segment_(&m, &b, src.segment, "long", &seg)) {
        free(tok);
        free(row);
        mtrl_model_free(&m);
        return 1;
    }
    real *logp = malloc(sizeof(real) * (size_t)tokens), *c = malloc(sizeof(real) * (size_t)tokens);
    for (int t = 0; t < tokens; t++) c[t] = (real)(1.0 / tokens);
    // --profile: this step itself, per phase (a second 1M-token step would cost minutes); its
    // syncs make it a little slower than an unprofiled one
    mtrl_model_profile prof;
    memset(&prof, 0, sizeof prof);
    if (profile) m.profile = &prof;
    double t3 = mtrl_time_mono();
    mtrl_model_forward(&m, &b, seg, logp, NULL, NULL);
    double t4 = mtrl_time_mono();
    mtrl_model_zero_grads(&m);
    mtrl_model_backward(&m, &b, c, NULL);
    double t5 = mtrl_time_mono();
    mtrl_model_mem_info(&m, &fr0, &tot, &scr, &peak);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    printf("learner: segment %d: forward %.2f s, backward %.2f s (%.0f tokens/s forward+backward); peak RSS %.2f GiB",
           seg, t4 - t3, t5 - t4, tokens / (t5 - t3), ru.ru_maxrss / 1048576.0);
    if (peak > 0) printf("; device high-water %.2f GiB", (double)peak / (1 << 30));
    printf("\n");
    if (profile) {
        m.profile = NULL;
        printf("profile: the learner step above (forward + backward), device synchronised at every phase boundary\n");
        profile_print_(&prof, t5 - t3);
    }
    free(logp);
    free(c);
    free(tok);
    free(row);
    mtrl_model_free(&m);
    return 0;
}

// ---- bench publish ---------------------------------------------------------------------------------

#define PUB_CHUNK ((size_t)32 << 20) // learner.c WEIGHTS_CHUNK

static void pub_row_(const char *side, const char *path, double s, double bytes) {
    printf("  %-7s %-36s %9.4f s  %7.2f GB/s\n", side, path, s, s > 0 ? bytes / s / 1e9 : 0);
}

// The ZeroMQ path once: serialise and encode (learner), reassemble, parse and load (actor).
static void pub_zmq_(mtrl_model *m, int bf16, double *learner_s, double *actor_s, size_t *bytes) {
    double t0 = mtrl_time_mono();
    void *blob;
    size_t len;
    mtrl_error err;
    MTRL_CHECKF((bf16 ? mtrl_model_save_bf16(m, &blob, &len, &err) : mtrl_model_save(m, NULL, &blob, &len, 0, NULL, 0, &err)) == MTRL_OK,
                "%s", err.msg);
    size_t n = (len + PUB_CHUNK - 1) / PUB_CHUNK;
    mtrl_wire_out *o = calloc(n, sizeof *o);
    for (size_t c = 0; c < n; c++) {
        size_t off = c * PUB_CHUNK, k = len - off < PUB_CHUNK ? len - off : PUB_CHUNK;
        mtrl_wire_out_init(&o[c]);
        mtrl_wire_encode_weights(&o[c], m->version, (uint32_t)c, (uint32_t)n, len, off, (char *)blob + off, k);
    }
    free(blob);
    double t1 = mtrl_time_mono();
    // the actor: chunks copied into one buffer as they arrive, then parsed and loaded
    uint8_t *buf = malloc(len);
    size_t hdr = 44; // WEIGHTS payload fields before the bytes (wire.h)
    volatile uint32_t crc = 0; // mtrl_wire_recv checks each payload's CRC
    for (size_t c = 0; c < n; c++) {
        crc ^= mtrl_crc32c(0, o[c].payload.data, o[c].payload.len);
        memcpy(buf + c * PUB_CHUNK, o[c].payload.data + hdr, o[c].payload.len - hdr);
    }
    mtrl_ckpt ck;
    MTRL_CHECK(mtrl_ckpt_open_mem(&ck, buf, len, &err) == MTRL_OK);
    MTRL_CHECKF(mtrl_model_load(m, &ck, 0, &err) == MTRL_OK, "%s", err.msg);
    mtrl_ckpt_close(&ck);
    free(buf);
    *actor_s = mtrl_time_mono() - t1;
    *learner_s = t1 - t0;
    *bytes = len;
    for (size_t c = 0; c < n; c++) mtrl_wire_out_free(&o[c]);
    free(o);
}

static int bench_publish_(int argc, char **argv) {
    bench_src src = {.preset = "tiny", .tokens = 0, .segment = MTRL_CFG_SEGMENT_AUTO};
    int reps = 3, bf16 = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (src_opt_(&src, a, v)) i++;
        else if (!strcmp(a, "--reps") && v) { reps = atoi(v); i++; }
        else if (!strcmp(a, "--dtype") && v && (!strcmp(v, "bf16") || !strcmp(v, "fp32"))) { bf16 = !strcmp(v, "bf16"); i++; }
        else return cli_usage_error("bench", BENCH_USAGE, "unknown option '%s'", a);
    }
    if (reps < 1) return cli_usage_error("bench", BENCH_USAGE, "--reps %d: expected >= 1", reps);
    mtrl_model m;
    int rc = model_open_(&src, &m);
    if (rc) return rc;
    print_machine_();
    char label[600];
    mtrl_wshm_layout lay;
    mtrl_model_wshm_layout(&m, bf16, &lay);
    int dev = m.device == MTRL_DEVICE_CUDA;
    printf("publish: %s, %zu parameters, %s matrices, on the %s; best of %d\n", src_label_(&src, label, sizeof label),
           mtrl_model_param_count(&m), bf16 ? "bf16" : "fp32", dev ? "GPU" : "CPU", reps);
    mtrl_wshm *ch;
    mtrl_model_wshm_dev *dslots = NULL;
    mtrl_error err;
    if (mtrl_wshm_create(&ch, dev ? MTRL_WSHM_DEVICE : MTRL_WSHM_HOST, lay.slot_bytes, lay.hash, &err) != MTRL_OK ||
        (dev && mtrl_model_wshm_dev_create(&dslots, &m, &lay, ch, &err) != MTRL_OK)) {
        fprintf(stderr, "mtrl bench publish: %s\n", err.msg);
        mtrl_model_free(&m);
        return 1;
    }
    double zl = 1e30, za = 1e30, cl = 1e30, cs = 1e30, ca = 1e30;
    size_t blob = 0;
    for (int r = 0; r < reps; r++) {
        double l, a;
        pub_zmq_(&m, bf16, &l, &a, &blob);
        zl = l < zl ? l : zl;
        za = a < za ? a : za;
        m.version++;
        double t0 = mtrl_time_mono(), t1;
        int slot;
        if (dev) {
            slot = mtrl_model_wshm_dev_publish(dslots, &m, ch, m.version);
            t1 = mtrl_time_mono();
            uint32_t v;
            int s2;
            while (!mtrl_wshm_latest(ch, &v, &s2) || v != m.version) {} // the stamp of the host callback
        } else {
            void *dst = mtrl_wshm_write_begin(ch, &slot);
            mtrl_model_wshm_pack_host(&m, &lay, dst);
            mtrl_wshm_write_end(ch, slot, m.version);
            t1 = mtrl_time_mono();
        }
        double t2 = mtrl_time_mono();
        cl = t1 - t0 < cl ? t1 - t0 : cl;
        cs = t2 - t0 < cs ? t2 - t0 : cs;
        // The actor's copy: the same unpack a reader runs (on the GPU over the slot that IPC maps).
        mtrl_wshm_ticket t;
        const void *data;
        MTRL_CHECK(mtrl_wshm_read_begin(ch, m.version, slot, &t, &data, &err) == MTRL_OK);
        double t3 = mtrl_time_mono();
        if (dev) mtrl_model_wshm_dev_unpack(dslots, &m, slot);
        else mtrl_model_wshm_unpack_host(&m, &lay, data);
        double t4 = mtrl_time_mono();
        MTRL_CHECK(mtrl_wshm_read_end(ch, &t));
        ca = t4 - t3 < ca ? t4 - t3 : ca;
    }
    printf("  ZeroMQ blob %.3f GB, channel slot %.3f GB\n", blob / 1e9, lay.slot_bytes / 1e9);
    pub_row_("learner", "zmq: serialise + encode chunks", zl, (double)blob);
    pub_row_("learner", dev ? "channel: pack enqueued (host call)" : "channel: slot write", cl, (double)lay.slot_bytes);
    if (dev) pub_row_("learner", "channel: until stamped (pack done)", cs, (double)lay.slot_bytes);
    pub_row_("actor", "zmq: reassemble + parse + load", za, (double)blob);
    pub_row_("actor", dev ? "channel: unpack device to device" : "channel: copy out of the slot", ca, (double)lay.slot_bytes);
    mtrl_model_wshm_dev_free(dslots);
    mtrl_wshm_close(ch);
    mtrl_model_wshm_layout_free(&lay);
    mtrl_model_free(&m);
    return 0;
}

int cmd_bench(int argc, char **argv) {
    // `mtrl bench long --help` (any benchmark) is help too, not an unknown option.
    int help = argc < 2;
    for (int i = 1; i < argc; i++) help |= cli_is_help(argv[i]);
    if (help) {
        printf("usage: %s\n", BENCH_USAGE);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "model")) return bench_model_(argc - 1, argv + 1);
    if (!strcmp(argv[1], "ops")) {
#ifdef MTRL_HAVE_CUDA_BENCH
        return mtrl_bench_ops_cuda(argc - 1, argv + 1);
#else
        fprintf(stderr, "mtrl bench ops: the CUDA kernel benchmarks are not in this build (issue 6)\n");
        return 2;
#endif
    }
    if (!strcmp(argv[1], "long")) return bench_long_(argc - 1, argv + 1);
    if (!strcmp(argv[1], "learner")) return bench_learner_(argc - 1, argv + 1);
    if (!strcmp(argv[1], "decode")) return bench_decode_(argc - 1, argv + 1);
    if (!strcmp(argv[1], "rl")) return cmd_bench_rl(argc - 1, argv + 1);
    if (!strcmp(argv[1], "publish")) return bench_publish_(argc - 1, argv + 1);
    return cli_usage_error("bench", BENCH_USAGE, "unknown benchmark '%s'", argv[1]);
}
