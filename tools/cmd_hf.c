// cmd_hf.c: Hugging Face checkpoints in and out (docs/hf-import.md).
//
//   mtrl import DIR [--out FILE] [--logits LOGITS.safetensors] [--device cpu|cuda[:N]]
//               [--set section.key=value ...]
//               (--device: where the model runs and computes the --logits, default cpu; --set: e.g.
//               the [kernels] that compute them)
//       reads DIR (config.json, safetensors shards + index) into the model its config.json
//       describes and prints the load's GB/s; --out writes it as an mtrl checkpoint (what
//       eval and export read). The experiment that trains it sets [model] from = DIR.
//   mtrl export EXPERIMENT.ini CHECKPOINT --out DIR [--dtype f32|bf16] [--shard-mb N]
//               [--logits LOGITS.safetensors] [--set ...]
//       writes an mtrl checkpoint of the experiment's model as a KimiLinearForCausalLM folder
//       (config.json, shards + index, and [model] from's tokenizer files) that transformers'
//       from_pretrained loads. CHECKPOINT "-" exports the experiment's initial weights ([model]
//       from's, or the seed's).
// --logits writes mtrl's fp32 logits of three fixed random token sequences (NAME.ids I32 [T],
// NAME.logits F32 [T][V], NAME = short, chunk, long: 4, 19, 40 tokens) for
// tools/check_hf_export.py to compare with transformers'.
// Exit 0 done, 1 failed (the message names the file and tensor), 2 bad usage or config.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/checkpoint.h"
#include "common/config.h"
#include "model/model.h"
#include "model/model_hf.h"
#include "common/rng.h"
#include "common/safetensors.h"
#include "common/tokenizer.h"
#include "common/check.h"
#include "tools/cli.h"

#define IMPORT_USAGE "mtrl import DIR [--out FILE] [--logits LOGITS.safetensors] [--device cpu|cuda[:N]] [--set section.key=value ...]"
#define EXPORT_USAGE                                                                                          \
    "mtrl export EXPERIMENT.ini CHECKPOINT|- --out DIR [--dtype f32|bf16] [--shard-mb N] [--logits FILE] " \
    "[--set section.key=value ...]"

#if REAL_IS_F64
#define REAL_DT MTRL_DT_F64
#else
#define REAL_DT MTRL_DT_F32
#endif

// The model of cfg on device (MTRL_DEVICE_*, GPU gpu), parameters only.
static int model_open_(const char *name, mtrl_model *m, const mtrl_config *cfg, int device, int gpu) {
    mtrl_model_dims d;
    mtrl_error err;
    if (mtrl_model_dims_from_config(&d, cfg, MTRL_VOCAB, &err) != MTRL_OK ||
        mtrl_model_init_infer_on(m, &d, (uint64_t)cfg->run.seed, device, gpu, &err) != MTRL_OK) {
        fprintf(stderr, "mtrl %s: %s\n", name, err.msg);
        return 2;
    }
    return 0;
}

static int load_from_(const char *name, mtrl_model *m, const char *dir) {
    mtrl_hf_load_stats ls;
    mtrl_error err;
    if (mtrl_model_load_hf(m, dir, &ls, &err) != MTRL_OK) {
        fprintf(stderr, "mtrl %s: %s\n", name, err.msg);
        return 1;
    }
    printf("loaded %s: %d tensors, %.1f MB from %d file%s in %.3f s (%.2f GB/s)\n", dir, ls.tensors, ls.bytes / 1e6, ls.files,
           ls.files == 1 ? "" : "s", ls.seconds, ls.seconds > 0 ? ls.bytes / ls.seconds / 1e9 : 0.0);
    return 0;
}

// mtrl's logits of three fixed sequences (the fixture's lengths) into path.
static int write_logits_(const char *name, mtrl_model *m, const char *path) {
    static const char *const names[3] = {"short", "chunk", "long"};
    static const int lens[3] = {4, 19, 40};
    int V = m->dims.V;
    mtrl_st_entry e[6];
    void *bufs[6] = {0};
    for (int s = 0; s < 3; s++) {
        uint32_t *ids = xmalloc(sizeof(uint32_t) * (size_t)lens[s]);
        float *fids = xmalloc(sizeof(float) * (size_t)lens[s]);
        for (int t = 0; t < lens[s]; t++) {
            ids[t] = (uint32_t)(mtrl_rng_u64(22, mtrl_rng_stream("hf-logits", (uint64_t)s, 0), (uint64_t)t) % (uint64_t)V);
            fids[t] = (float)ids[t];
        }
        real *lg = xmalloc(sizeof(real) * (size_t)lens[s] * (size_t)V);
        mtrl_model_logits(m, ids, lens[s], 0, lg);
        char *n1 = xmalloc(64), *n2 = xmalloc(64);
        snprintf(n1, 64, "%s.ids", names[s]);
        snprintf(n2, 64, "%s.logits", names[s]);
        e[2 * s] = (mtrl_st_entry){n1, 1, {lens[s]}, MTRL_DT_F32, fids};
        e[2 * s + 1] = (mtrl_st_entry){n2, 2, {lens[s], V}, REAL_DT, lg};
        bufs[2 * s] = fids;
        bufs[2 * s + 1] = lg;
        free(ids);
    }
    // One file: the folder is a temp one beside path, the file moved over path.
    char dir[4200], file[4300];
    snprintf(dir, sizeof dir, "%s.tmpdir", path);
    mkdir(dir, 0755);
    mtrl_error err;
    mtrl_status st = mtrl_st_write(dir, e, 6, MTRL_DT_F32, (size_t)1 << 40, NULL, 0, NULL, &err);
    snprintf(file, sizeof file, "%s/model.safetensors", dir);
    if (st == MTRL_OK && rename(file, path) != 0) st = mtrl_error_set(&err, MTRL_ERR_IO, "%s: cannot write", path);
    rmdir(dir);
    for (int i = 0; i < 6; i++) {
        free(bufs[i]);
        free((void *)e[i].name);
    }
    if (st != MTRL_OK) {
        fprintf(stderr, "mtrl %s: %s\n", name, err.msg);
        return 1;
    }
    printf("wrote %s: mtrl's logits of 3 token sequences (ids as F32)\n", path);
    return 0;
}

int cmd_import(int argc, char **argv) {
    const char *dir = NULL, *out = NULL, *logits = NULL, *device = "cpu";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (cli_is_help(a)) {
            printf("usage: %s\n", IMPORT_USAGE);
            return 0;
        }
        if (!strcmp(a, "--out") && v) out = argv[++i];
        else if (!strcmp(a, "--logits") && v) logits = argv[++i];
        else if (!strcmp(a, "--device") && v) device = argv[++i];
        else if (!strcmp(a, "--set") && v) i++; // cli_collect_sets reads them
        else if (!strncmp(a, "--set=", 6)) continue;
        else if (a[0] == '-') return cli_usage_error("import", IMPORT_USAGE, "unknown option '%s'", a);
        else if (dir) return cli_usage_error("import", IMPORT_USAGE, "more than one folder given");
        else dir = a;
    }
    if (!dir) return cli_usage_error("import", IMPORT_USAGE, "give a folder");
    char text[4400];
    // fp32 on a GPU (GEMMs, latents, attention operands): the logits check the model's forms, not
    // TF32's or bf16's rounding (--set may choose otherwise)
    snprintf(text, sizeof text,
             "[model]\nfrom = %s\ngemm = fp32\n[kernels]\nlatent = fp32\nattn_operands = fp32\n[env]\nname = calc\n",
             dir);
    mtrl_config cfg;
    mtrl_config_errors errs = {0};
    const char *sets[64];
    int n_sets = cli_collect_sets(argc, argv, sets, 64);
    if (mtrl_config_load_text(&cfg, dir, text, sets, n_sets, &errs) != MTRL_OK) {
        mtrl_config_errors_print(&errs, stderr);
        mtrl_config_errors_free(&errs);
        return 2;
    }
    int dev, gpu;
    if (mtrl_model_parse_device(device, &dev, &gpu) != 0)
        return cli_usage_error("import", IMPORT_USAGE, "--device %s: expected cpu, cuda or cuda:N", device);
    mtrl_model m;
    int rc = model_open_("import", &m, &cfg, dev, gpu);
    if (!rc) rc = load_from_("import", &m, dir);
    if (!rc && logits) rc = write_logits_("import", &m, logits);
    if (!rc && out) {
        mtrl_error err;
        const char *meta[] = {"hf.from", dir};
        if (mtrl_model_save(&m, out, NULL, NULL, 0, meta, 1, &err) != MTRL_OK) {
            fprintf(stderr, "mtrl import: %s\n", err.msg);
            rc = 1;
        } else {
            printf("wrote %s (%zu parameters); train it with [model] from = %s\n", out, mtrl_model_param_count(&m), dir);
        }
    }
    if (m.params.base) mtrl_model_free(&m);
    return rc;
}

int cmd_export(int argc, char **argv) {
    const char *path = NULL, *ckpt = NULL, *out = NULL, *logits = NULL;
    mtrl_dtype dt = MTRL_DT_F32;
    long shard_mb = 4096;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (cli_is_help(a)) {
            printf("usage: %s\n", EXPORT_USAGE);
            return 0;
        }
        if (!strcmp(a, "--set")) { i++; continue; }
        if (!strncmp(a, "--set=", 6)) continue;
        if (!strcmp(a, "--out") && v) out = argv[++i];
        else if (!strcmp(a, "--logits") && v) logits = argv[++i];
        else if (!strcmp(a, "--dtype") && v) {
            if (!strcmp(v, "f32")) dt = MTRL_DT_F32;
            else if (!strcmp(v, "bf16")) dt = MTRL_DT_BF16;
            else return cli_usage_error("export", EXPORT_USAGE, "--dtype %s: expected f32 or bf16", v);
            i++;
        } else if (!strcmp(a, "--shard-mb") && v) {
            char *end;
            shard_mb = strtol(v, &end, 10);
            if (*end || shard_mb < 1) return cli_usage_error("export", EXPORT_USAGE, "--shard-mb %s: expected a positive number", v);
            i++;
        } else if (a[0] == '-' && a[1]) return cli_usage_error("export", EXPORT_USAGE, "unknown option '%s'", a);
        else if (!path) path = a;
        else if (!ckpt) ckpt = a;
        else return cli_usage_error("export", EXPORT_USAGE, "unexpected argument '%s'", a);
    }
    if (!path || !ckpt || !out) return cli_usage_error("export", EXPORT_USAGE, "give the experiment, the checkpoint and --out DIR");
    mtrl_config cfg;
    if (!cli_config_load("export", path, argc, argv, &cfg)) return 2;
    mtrl_model m;
    int rc = model_open_("export", &m, &cfg, MTRL_DEVICE_CPU, 0);
    if (rc) return rc;
    mtrl_error err;
    if (strcmp(ckpt, "-")) {
        mtrl_ckpt c;
        mtrl_status st = mtrl_ckpt_open_file(&c, ckpt, &err);
        if (st == MTRL_OK) {
            st = mtrl_model_load(&m, &c, 0, &err);
            mtrl_ckpt_close(&c);
        }
        if (st != MTRL_OK) {
            fprintf(stderr, "mtrl export: %s\n", err.msg);
            rc = 1;
        }
    } else if (cfg.model.from[0]) {
        rc = load_from_("export", &m, cfg.model.from);
    }
    if (!rc && logits) rc = write_logits_("export", &m, logits);
    if (!rc) {
        uint64_t bytes = 0;
        if (mtrl_model_save_hf(&m, &cfg.model, cfg.model.from[0] ? cfg.model.from : NULL, out, dt,
                               (size_t)shard_mb << 20, &bytes, &err) != MTRL_OK) {
            fprintf(stderr, "mtrl export: %s\n", err.msg);
            rc = 1;
        } else {
            printf("wrote %s: %.1f MB of %s weights (config.json, safetensors%s)\n", out, bytes / 1e6,
                   dt == MTRL_DT_BF16 ? "bf16" : "f32", cfg.model.from[0] ? ", the tokenizer files of [model] from" : "");
        }
    }
    mtrl_model_free(&m);
    return rc;
}
