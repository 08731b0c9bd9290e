// kernel_opts.h: which kernel runs each op on a GPU, and the GPU's precisions, as one struct.
//
// A CUDA context owns one (mtrl_cuda_ctx_opts); the model's backend copies the model's into it
// when it creates the context. An experiment fills it from its [kernels] section
// (common/config_schema.h, `--set kernels.key=value`; `mtrl check --keys` lists the keys, and the
// resolved INI stored with the run in runs.db holds them). Nothing reads the environment.
//
// Every field's 0 is the default: a zeroed struct chooses the kernels the project measured best
// (docs/kernel-lab.md, docs/perf.md), so dims or contexts made without a config behave as runs do.
// The other values keep one general fallback per op, named by method (simt: CUDA cores; mma:
// warp-level tensor cores; wgmma: Hopper's warpgroup tensor cores), and the lab's variants that
// tests and kernels/lab/bench_cuda.cu still compare against the default.
//
// Choosers read the fields at each launch, so a test or a benchmark may change them between
// calls through mtrl_cuda_ctx_opts.
#ifndef MTRL_KERNEL_OPTS_H
#define MTRL_KERNEL_OPTS_H

// The method of an op's kernel. AUTO: the fastest that takes the shape.
enum { MTRL_KOPT_AUTO = 0, MTRL_KOPT_SIMT = 1, MTRL_KOPT_MMA = 2 };
// Precision of the projection and expert GEMMs (gemm): MODEL follows the model's [model] gemm.
enum { MTRL_KGEMM_MODEL = 0, MTRL_KGEMM_TF32 = 1, MTRL_KGEMM_FP32 = 2, MTRL_KGEMM_BF16 = 3 };

typedef struct mtrl_kernel_opts {
    // Causal attention (MLA's training and prefill forms): AUTO (wgmma on compute capability 9.0
    // for the naive shapes, mma elsewhere and for the absorbed forward, simt for other shapes),
    // MMA (never wgmma) or SIMT (the first kernel, every shape).
    int attn;
    // The mma forward's tile configuration, numbered as docs/kernel-lab.md measured them: 0 the
    // default, 1..6 the lab's others (1: Q in registers; 3: 64-key stages; ...).
    int attn_fwd_config;
    int attn_dkv_rows;      // query rows per tile of the mma dK / dV of Dk = 192: 0 (32) or 64
    int attn_dq_first;      // 1: the mma dQ's first configuration (one row tile per warp)
    int attn_dkv_in_step;   // 1: wgmma dK / dV with its warpgroups in step (no ping-pong)
    // One-token decode of KDA and MLA: AUTO (the tiled v2 kernels where they take the shape) or
    // SIMT (the first kernels, every shape).
    int decode;
    int kda_fwd;            // KDA chunked forward: AUTO (mma v3 at K = V = 128) or SIMT (v2)
    int kda_bwd;            // KDA chunked backward: AUTO (mma v3 at K = V = 128) or SIMT (v2)
    int kda_bwd_tile;       // its per-tile pass: AUTO (mma) or SIMT (v2's)
    int kda_tile_threads;   // threads of the mma per-tile pass: 0 (512) or 256
    int kda_fwd_pieces;     // pieces of the v3 forward overlapped with its prep: 0 auto, N forced
    int kda_bwd_pieces;     // pieces of the v3 backward's state-gradient pass: 0 auto, N forced
    // Sequence pieces of the chunk-parallel KDA forward (kda_cp_cuda.cu): 0 auto (the chooser
    // mtrl_kda_cp_pieces, by heads, length and SM count), 1 the sequential forward, N forced.
    int kda_seq_pieces;
    int kda_plain_bf16;     // 1: v3's records in plain bf16 instead of bf16x3 (forward only)
    int kda_cluster;        // v3 forward state pass in clusters of 2, 4 or 8 blocks; 0 = none
    int kda_warps;          // warps per block of v3's state passes: 0 (4), 1, 2, 4 or 8
    int moe_lanes;          // GEMM lanes (streams) of the MoE experts: 0 = all, 1 = one stream
    int gemm;               // MTRL_KGEMM_*: the dense and expert GEMMs' precision
    int latent_fp32;        // 1: MLA latent caches in fp32 instead of bf16
    // 1: causal attention on fp32 operands (mtrl_attn_causal_fwd_f32: a check of the model against
    // an fp32 reference, e.g. an import against transformers; needs latent_fp32). 0: bf16 operands.
    int attn_fp32;
} mtrl_kernel_opts;

#endif
