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
// warp-level tensor cores; wgmma: Hopper's warpgroup tensor cores), the precisions, forced work
// splits (pieces, lanes) for the tests and kernels/lab/bench_cuda.cu, and the one form a test
// takes as the default's bit-for-bit reference. Variants that measured slower left the tree
// (docs/kernel-lab.md, "Variants that left").
//
// Choosers read the fields at each launch, so a test or a benchmark may change them between
// calls through mtrl_cuda_ctx_opts.
#ifndef MTRL_KERNEL_OPTS_H
#define MTRL_KERNEL_OPTS_H

// The method of an op's kernel. AUTO: the fastest that takes the shape.
enum { MTRL_KOPT_AUTO = 0, MTRL_KOPT_SIMT = 1, MTRL_KOPT_MMA = 2, MTRL_KOPT_WGMMA = 3 };
// Precision of the projection and expert GEMMs (gemm): MODEL follows the model's [model] gemm.
enum { MTRL_KGEMM_MODEL = 0, MTRL_KGEMM_TF32 = 1, MTRL_KGEMM_FP32 = 2, MTRL_KGEMM_BF16 = 3 };

typedef struct mtrl_kernel_opts {
    // Causal attention (MLA's training and prefill forms): AUTO (wgmma on compute capability 9.0
    // for the naive shapes, mma elsewhere and for the absorbed forward, simt for other shapes),
    // MMA (never wgmma) or SIMT (the first kernel, every shape).
    int attn;
    // One-token decode of KDA and MLA: AUTO (the tiled v2 kernels where they take the shape) or
    // SIMT (the first kernels, every shape).
    int decode;
    int kda_fwd;            // KDA chunked forward: AUTO (mma v3 at K = V = 128) or SIMT (v2)
    int kda_bwd;            // KDA chunked backward: AUTO (mma v3 at K = V = 128) or SIMT (v2)
    int kda_bwd_tile;       // its per-tile pass: AUTO (mma) or SIMT (v2's)
    // Threads of the mma per-tile pass: 0 (512) or 256 (each warp splits its own A fragments:
    // test_cuda_kda's bit-for-bit reference for the default's split once a block).
    int kda_tile_threads;
    int kda_fwd_pieces;     // pieces of the v3 forward overlapped with its prep: 0 auto, N forced
    int kda_bwd_pieces;     // pieces of the v3 backward's state-gradient pass: 0 auto, N forced
    // Sequence pieces of the chunk-parallel KDA forward (kda/chunk_parallel.cu): 0 auto (the chooser
    // mtrl_kda_cp_pieces, by heads, length and SM count), 1 the sequential forward, N forced.
    int kda_seq_pieces;
    int kda_plain_bf16;     // 1: v3's records in plain bf16 instead of bf16x3 (forward only)
    int moe_lanes;          // GEMM lanes (streams) of the MoE experts: 0 = all, 1 = one stream
    // The grouped experts' row GEMMs (forward; backward dm, dX) on bf16 operands
    // (moe/experts_mma.cu): AUTO (wgmma on compute capability 9.0 above 64 rows per expert on
    // average, mma.sync below), MMA (never wgmma) or WGMMA (wgmma wherever the device runs it).
    int moe;
    int gemm;               // MTRL_KGEMM_*: the dense and expert GEMMs' precision
    int latent_fp32;        // 1: MLA latent caches in fp32 instead of bf16
    // 1: causal attention on fp32 operands (mtrl_attn_causal_fwd_f32: a check of the model against
    // an fp32 reference, e.g. an import against transformers; needs latent_fp32). 0: bf16 operands.
    int attn_fp32;
    // 1: the decode step is recorded as a CUDA graph once per batch size and key length and
    // replayed (model/model_decode.c); 0: launched kernel by kernel. The same kernels either way.
    int decode_graph;
} mtrl_kernel_opts;

#endif
