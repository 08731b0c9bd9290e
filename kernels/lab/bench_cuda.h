// bench_cuda.h: the kernel lab's benchmark (kernels/lab/bench_cuda.cu), outside the library:
// kernels/lab holds what measures and tests the kernels of kernels/cuda, not what the model runs.
#ifndef MTRL_BENCH_CUDA_H
#define MTRL_BENCH_CUDA_H

#ifdef __cplusplus
extern "C" {
#endif

// `mtrl bench ops --device cuda [--only copy,gemm,kda,varlen,step,attn,decode,moe,ops]
// [--kda-T 8192,65536] [--attn-T 8192,32768] [--heads 16] [--decode-shapes 1x1048576,8x131072]
// [--reps N] [--anchors anchors.json]`: times each kernel with CUDA events (warm-up, median of
// repeats) and prints ms, TFLOP/s or GB/s and the fraction of the measured ceilings. The decode
// rows (step, decode) print the v2 and v1 kernels side by side (the context's decode
// option set by the bench). The varlen rows time the KDA forward of packed pieces (512 x 128 and
// 64 x 1024 tokens, from the zero state) in one varlen call against one call per piece, and the
// piece_io forms (100 x 32 and 100 x 256 tokens, each piece from its own state and conv window:
// the actor's prefill) in one varlen_io call against one call per piece. --anchors: the JSON that shared/bench/anchors_gpu.py wrote on the same machine;
// the KDA chunk, attention (MHA shape) and expert-GEMM rows are then followed by their ratio to
// the anchor (fla chunk_kda time, SDPA cuDNN / FA2 TFLOP/s, torch._grouped_mm TFLOP/s) and the
// docs/perf.md target of that ratio. The moe rows also compare the grouped experts with the
// lanes at 16 .. 8192 rows per expert (balanced, skewed) at small's shape and the anchor's; the
// JSON of tools/anchors_grouped_mm.py (merged into --anchors) gives their torch._grouped_mm ratios.
// argv[0] is the word "ops". Returns 0, 2 for bad arguments, 77 when there is no device.
int mtrl_bench_ops_cuda(int argc, char **argv);

#ifdef __cplusplus
}
#endif

#endif
