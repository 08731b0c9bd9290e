// bench_cuda.cu: `mtrl bench ops --device cuda` (mtrl_bench_ops_cuda): times the CUDA kernels
// with CUDA events (warm-up, median of repeats, random inputs, working sets far above the 60 MB
// L2 or rotated among several copies) and prints time, achieved TFLOP/s or GB/s and the fraction
// of the ceilings measured in the same run (bf16 GEMM 8192³ through cuBLAS; device-to-device
// copy, bytes read + written). The reference ceilings (docs/perf.md) are 755 TFLOP/s, 4.17 TB/s.
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <ctime>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/lab/bench_cuda.h"

namespace {

struct Bench {
    mtrl_cuda_ctx *c;
    cudaEvent_t a, b;
    int reps = 5;
    double gemm_tflops = 755.0, copy_tbps = 4.17;  // replaced by this run's measurements
    std::string anchors;  // the JSON of shared/bench/anchors_gpu.py from the same machine (--anchors)
    bool kda_fwd_only = false;  // --kda-fwd-only: the forward's rows without v2 and the backward
};

// A number of the anchors' JSON (a flat object written by anchors_gpu.py): "key": value.
bool anchor(const Bench &B, const std::string &key, double *v) {
    size_t at = B.anchors.find("\"" + key + "\"");
    if (at == std::string::npos) return false;
    at = B.anchors.find(':', at);
    if (at == std::string::npos) return false;
    char *end = nullptr;
    *v = strtod(B.anchors.c_str() + at + 1, &end);
    return end != B.anchors.c_str() + at + 1;
}

// The line under a row that compares it with its anchor: ours / theirs for a time (lower is
// better), or for a rate (higher is better), with the docs/perf.md target of that ratio.
// With --anchors given and no number under `key`: one line that says so (and the anchor's
// recorded failure, "key_error": "..." or "key_oom": true, where tools/anchors_kda_attn.py wrote one).
void vs(const Bench &B, const std::string &key, double ours, const char *what, const char *target) {
    double theirs;
    if (B.anchors.empty()) return;
    if (!anchor(B, key, &theirs) || theirs <= 0) {
        std::string why = "not in the anchors' JSON";
        size_t at = B.anchors.find("\"" + key + "_error\"");
        if (at != std::string::npos && (at = B.anchors.find('"', B.anchors.find(':', at))) != std::string::npos) {
            size_t end = B.anchors.find('"', at + 1);
            why = "failed: " + B.anchors.substr(at + 1, std::min<size_t>(end - at - 1, 120));
        } else if (B.anchors.find("\"" + key + "_oom\"") != std::string::npos) {
            why = "out of device memory";
        }
        printf("%-34s %-34s %11s %s: anchor %s %s (target %s)\n", "", "", "--", what, key.c_str(), why.c_str(), target);
        fflush(stdout);
        return;
    }
    // "key_padded": the backend refused Dk != Dv and was timed with V zero-padded to Dk
    const char *pad = B.anchors.find("\"" + key + "_padded\"") != std::string::npos ? ", V padded to Dk" : "";
    printf("%-34s %-34s %10.2fx %s (anchor %.3g%s; target %s)\n", "", "", ours / theirs, what, theirs, pad, target);
    fflush(stdout);
}

// Device memory in use (all of the device's, this process's allocations and context), GiB.
double gib_in_use() {
    size_t free_b, total_b;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return (total_b - free_b) / 1073741824.0;
}
double gib_free() {
    size_t free_b, total_b;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return free_b / 1073741824.0;
}
// Gives the context's scratch back (it is grow-only), so that a later row's memory is its own.
void drop_scratch(Bench &B) {
    CUDA_CHECK(cudaStreamSynchronize(B.c->stream));
    CUDA_CHECK(cudaDeviceSynchronize());
    if (B.c->scratch) CUDA_CHECK(cudaFree(B.c->scratch));
    B.c->scratch = nullptr;
    B.c->scratch_bytes = 0;
}

template <class F>
double time_ms(Bench &B, F fn, int warm = 1, int reps = -1) {
    if (reps < 0) reps = B.reps;
    for (int i = 0; i < warm; i++) fn();
    CUDA_CHECK(cudaStreamSynchronize(B.c->stream));
    std::vector<float> t;
    for (int r = 0; r < reps; r++) {
        CUDA_CHECK(cudaEventRecord(B.a, B.c->stream));
        fn();
        CUDA_CHECK(cudaEventRecord(B.b, B.c->stream));
        CUDA_CHECK(cudaEventSynchronize(B.b));
        float ms;
        CUDA_CHECK(cudaEventElapsedTime(&ms, B.a, B.b));
        t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

__global__ void fill_k(size_t n, float *p, float lo, float hi, uint32_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)(i * 2654435761u) ^ (seed * 0x9e3779b9u);
        h ^= h >> 15; h *= 0x2c1b3c6du; h ^= h >> 12; h *= 0x297a2d39u; h ^= h >> 15;
        p[i] = lo + (hi - lo) * ((h >> 8) * (1.f / 16777216.f));
    }
}
__global__ void scale_k(size_t n, float *p, float s) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] *= s;
}
static uint32_t seed_ = 1;
float *rnd(Bench &B, size_t n, float lo, float hi) {
    float *p = (float *)mtrl_cuda_malloc(n * sizeof(float));
    fill_k<<<4096, 256, 0, B.c->stream>>>(n, p, lo, hi, seed_++);
    CUDA_LAUNCH_CHECK();
    return p;
}
mtrl_bf16 *rnd_bf16(Bench &B, size_t n, float lo, float hi) {
    float *t = rnd(B, n, lo, hi);
    mtrl_bf16 *p = (mtrl_bf16 *)mtrl_cuda_malloc(n * 2);
    mtrl_cuda_f32_to_bf16(B.c, n, t, p);
    mtrl_cuda_sync(B.c);
    mtrl_cuda_free(t);
    return p;
}

void row(const char *what, const char *shape, double ms, double work, const char *unit,
         double ceiling) {
    double rate = work / (ms * 1e-3);
    if (!strcmp(unit, "TFLOP/s")) rate /= 1e12;
    else if (!strcmp(unit, "GB/s")) rate /= 1e9;
    else if (!strcmp(unit, "Mtok/s")) rate /= 1e6;
    if (ceiling > 0)
        printf("%-34s %-34s %10.3f ms %10.1f %-7s %5.1f%% of ceiling\n", what, shape, ms, rate,
               unit, 100.0 * rate / ceiling);
    else
        printf("%-34s %-34s %10.3f ms %10.1f %-7s\n", what, shape, ms, rate, unit);
    fflush(stdout);
}

void bench_ceilings(Bench &B) {
    size_t n = (size_t)1 << 31;  // 2 GiB
    void *x = mtrl_cuda_malloc(n), *y = mtrl_cuda_malloc(n);
    CUDA_CHECK(cudaMemsetAsync(x, 1, n, B.c->stream));
    double ms = time_ms(B, [&] { CUDA_CHECK(cudaMemcpyAsync(y, x, n, cudaMemcpyDeviceToDevice, B.c->stream)); }, 2, 10);
    B.copy_tbps = 2.0 * n / (ms * 1e-3) / 1e12;
    printf("%-34s %-34s %10.3f ms %10.1f GB/s    (ceiling used below: %.2f TB/s)\n", "copy (read + write)",
           "2 GiB", ms, 2.0 * n / (ms * 1e-3) / 1e9, B.copy_tbps);
    mtrl_cuda_free(x);
    mtrl_cuda_free(y);
    int m = 8192;
    mtrl_bf16 *A = rnd_bf16(B, (size_t)m * m, -1, 1), *Bm = rnd_bf16(B, (size_t)m * m, -1, 1);
    mtrl_bf16 *C = (mtrl_bf16 *)mtrl_cuda_malloc((size_t)m * m * 2);
    ms = time_ms(B, [&] { mtrl_gemm(B.c, 0, 0, m, m, m, 1.f, A, m, Bm, m, MTRL_BF16, 0.f, C, m, MTRL_BF16); }, 3, 10);
    B.gemm_tflops = 2.0 * m * m * (double)m / (ms * 1e-3) / 1e12;
    printf("%-34s %-34s %10.3f ms %10.1f TFLOP/s (ceiling used below)\n", "bf16 GEMM (cuBLAS)", "8192^3",
           ms, B.gemm_tflops);
    mtrl_cuda_free(A);
    mtrl_cuda_free(Bm);
    mtrl_cuda_free(C);
}

// KDA chunk forward / forward+backward at H heads, K = V = 128.
// Lets a scope change the context's kernel options (kernels/kernel_opts.h: the variants a
// benchmark compares), then puts back what the caller had.
struct scoped_opts {
    mtrl_cuda_ctx *c;
    mtrl_kernel_opts prev;
    explicit scoped_opts(mtrl_cuda_ctx *ctx) : c(ctx), prev(ctx->opts) {}
    ~scoped_opts() { c->opts = prev; }
    scoped_opts(const scoped_opts &) = delete;
    scoped_opts &operator=(const scoped_opts &) = delete;
};

// KDA inputs of T tokens (K = V = 128) as the layer feeds the core: q and k L2-normalised (q then
// scaled by K^-1/2), g in the chunked kernels' range, β in (0, 1).
void kda_inputs_(Bench &B, int T, int H, float **q, float **k, float **v, float **g, float **beta) {
    const int K = 128;
    size_t nqk = (size_t)T * H * K;
    *q = rnd(B, nqk, -1, 1), *k = rnd(B, nqk, -1, 1), *v = rnd(B, nqk, -1, 1);
    *g = rnd(B, nqk, -4.9f, -0.01f), *beta = rnd(B, (size_t)T * H, 0.05f, 0.95f);
    mtrl_l2norm_fwd(B.c, T * H, K, *q, 1e-6f, *q, NULL);
    mtrl_l2norm_fwd(B.c, T * H, K, *k, 1e-6f, *k, NULL);
    scale_k<<<4096, 256, 0, B.c->stream>>>(nqk, *q, 1.f / sqrtf((float)K));
}

// The bf16-input forwards (mtrl_kda_chunk_fwd_bf16 / _cp_bf16) on bf16 copies of the same inputs,
// beside the fp32-input rows: the sequential default (ms) and the chunk-parallel chooser's (mc) at
// the same T, H. The prep reads q, k, v, g once: bf16 halves those bytes, ~1 KB of the ~4 KB a
// token and head moves through the prep (with the bf16x3 record), so the difference is the prep's.
void bench_kda_bf16in_(Bench &B, int T, int H, const float *const *in, const float *beta, float *o, float *Sf,
                       double ms, double mc, double flops, const char *shape, double *m_seq, double *m_cp) {
    const int K = 128, V = 128;
    const size_t nqk = (size_t)T * H * K;
    mtrl_bf16 *b[4];
    for (int i = 0; i < 4; i++) {
        b[i] = (mtrl_bf16 *)mtrl_cuda_malloc(nqk * 2);
        mtrl_cuda_f32_to_bf16(B.c, nqk, in[i], b[i]);
    }
    mtrl_cuda_sync(B.c);
    double m1 = time_ms(B, [&] {
        mtrl_kda_chunk_fwd_bf16(B.c, T, H, K, V, b[0], b[1], b[2], b[3], beta, NULL, o, Sf, NULL);
    });
    row("  fwd bf16 in", shape, m1, flops, "TFLOP/s", B.gemm_tflops);
    printf("%-34s %-34s bf16 in / fp32 in (default) time %.3f\n", "", "", m1 / ms);
    const int np = mtrl_kda_cp_pieces(B.c, T, H, K, V, MTRL_KDA_CP_AUTO);
    double m2 = time_ms(B, [&] {
        mtrl_kda_chunk_fwd_cp_bf16(B.c, MTRL_KDA_CP_AUTO, T, H, K, V, b[0], b[1], b[2], b[3], beta, NULL, o, Sf, NULL);
    });
    char what[64];
    snprintf(what, sizeof what, "  fwd bf16 in, cp auto: %d pieces", np);
    row(what, shape, m2, flops, "TFLOP/s", B.gemm_tflops);
    printf("%-34s %-34s bf16 in / fp32 in (chunk-parallel, %d pieces) time %.3f\n", "", "", np, m2 / mc);
    for (int i = 0; i < 4; i++) mtrl_cuda_free(b[i]);
    *m_seq = m1;
    *m_cp = m2;
}

// KDA forward+backward of T tokens in segments of `seg` (the learner's form for long sequences):
// a forward over the segments keeps only each segment's incoming state; the backward, last
// segment first, recomputes a segment's forward storing its tile states, then runs its backward
// with the state gradient of the segment after it (exact: the same gradients as one call). The
// inputs and o are the caller's (fp32 at the op's interface). Prints the time and the device
// memory in use at the end (nothing is freed in between, the context's scratch is grow-only: the
// high-water of the step), split into the op's fp32 interface tensors and the rest (P2: one 1M
// layer at H = 16 in <= 40 GiB).
void bench_kda_segmented(Bench &B, int T, int H, int seg, float *q, float *k, float *v, float *g, float *beta, float *o) {
    const int K = 128, V = 128;
    seg = std::min(seg, T);
    const int ns = (T + seg - 1) / seg;
    const size_t nqk = (size_t)T * H * K, HKV = (size_t)H * K * V;
    drop_scratch(B);  // the forward rows' records (scratch sized for the whole T)
    float *dout = rnd(B, nqk, -1, 1);
    float *dq = (float *)mtrl_cuda_malloc(nqk * 4), *dk = (float *)mtrl_cuda_malloc(nqk * 4),
          *dv = (float *)mtrl_cuda_malloc(nqk * 4), *dg = (float *)mtrl_cuda_malloc(nqk * 4),
          *db = (float *)mtrl_cuda_malloc((size_t)T * H * 4);
    float *Sb = (float *)mtrl_cuda_malloc((ns + 1) * HKV * 4);    // each segment's incoming state
    float *dS = (float *)mtrl_cuda_malloc(2 * HKV * 4);           // the state gradient, ping-pong
    float *St = (float *)mtrl_cuda_malloc((size_t)((seg + 15) / 16) * HKV * 4);
    mtrl_cuda_sync(B.c);
    auto fwd = [&] {
        for (int s = 0; s < ns; s++) {
            size_t t0 = (size_t)s * seg;
            int n = (int)std::min<size_t>(seg, T - t0);
            mtrl_kda_chunk_fwd(B.c, n, H, K, V, q + t0 * H * K, k + t0 * H * K, v + t0 * H * V, g + t0 * H * K,
                               beta + t0 * H, s ? Sb + s * HKV : NULL, o + t0 * H * V, Sb + (s + 1) * HKV, NULL);
        }
    };
    auto bwd = [&] {
        for (int s = ns - 1; s >= 0; s--) {
            size_t t0 = (size_t)s * seg;
            int n = (int)std::min<size_t>(seg, T - t0);
            const float *S0 = s ? Sb + s * HKV : NULL;
            float *dSin = s == ns - 1 ? NULL : dS + ((s + 1) & 1) * HKV, *dSout = dS + (s & 1) * HKV;
            mtrl_kda_chunk_fwd(B.c, n, H, K, V, q + t0 * H * K, k + t0 * H * K, v + t0 * H * V, g + t0 * H * K,
                               beta + t0 * H, S0, o + t0 * H * V, NULL, St);
            mtrl_kda_chunk_bwd(B.c, n, H, K, V, q + t0 * H * K, k + t0 * H * K, v + t0 * H * V, g + t0 * H * K,
                               beta + t0 * H, S0, St, dout + t0 * H * V, dSin, dq + t0 * H * K, dk + t0 * H * K,
                               dv + t0 * H * V, dg + t0 * H * K, db + t0 * H, dSout);
        }
    };
    char shape[64], what[80];
    snprintf(shape, sizeof shape, "T=%d H=%d K=V=128", T, H);
    double mf = time_ms(B, fwd, 1, 1);
    double mb = time_ms(B, bwd, 1, 1);
    snprintf(what, sizeof what, "KDA fwd+bwd, %d segments of %d", ns, seg);
    row(what, shape, mf + mb, (double)T, "Mtok/s", 0);
    printf("%-34s %-34s forward (states at segment ends) %.3f ms, backward (recompute + bwd) %.3f ms\n", "", "", mf, mb);
    std::string ak = "kda_H" + std::to_string(H) + "_T" + std::to_string(T);
    vs(B, ak + "_fwdbwd_ms", mf + mb, "the time of fla chunk_kda fwd+bwd", "P2 <= 0.8x");
    const double used = gib_in_use();
    const double iface = (10.0 * nqk + 2.0 * T * H) * 4 / 1073741824.0;  // q k v g o dout, dq dk dv dg; beta, dbeta: T x H
    printf("%-34s %-34s device memory in use %.1f GiB at the end (high-water: nothing freed): the op's fp32 interface\n"
           "%-34s %-34s tensors %.1f GiB (q k v g beta o dout, 5 gradients), the rest %.1f GiB (segment S_tiles, states, scratch,\n"
           "%-34s %-34s context); P2 (<= 40 GiB for one layer): %.2fx (with bf16 at the interface, not measured: ~%.1f GiB)\n",
           "", "", used, "", "", iface, used - iface, "", "", used / 40.0, used - iface / 2);
    void *ps[] = {dout, dq, dk, dv, dg, db, Sb, dS, St};
    for (void *p : ps) mtrl_cuda_free(p);
    drop_scratch(B);
}

void bench_kda(Bench &B, int T, int H) {
    const int K = 128, V = 128;
    size_t nqk = (size_t)T * H * K, nt = (T + 15) / 16;
    float *q, *k, *v, *g, *beta;
    kda_inputs_(B, T, H, &q, &k, &v, &g, &beta);
    float *o = (float *)mtrl_cuda_malloc(nqk * 4), *Sf = (float *)mtrl_cuda_malloc((size_t)H * K * V * 4);
    mtrl_cuda_sync(B.c);
    char shape[64];
    snprintf(shape, sizeof shape, "T=%d H=%d K=V=128", T, H);
    // Nominal work of the 16-tile algorithm per tile and head: X, P, W, U (4 x 16x16x128 x2),
    // Δ, Q⁺S, S' (3 x 16x128x128 x2), PΔ (16x16x128 x2) = 1.77 MFLOP.
    double flops = (double)nt * H * (4.0 * 65536 + 3.0 * 524288 + 65536);
    double ms = time_ms(B, [&] { mtrl_kda_chunk_fwd(B.c, T, H, K, V, q, k, v, g, beta, NULL, o, Sf, NULL); });
    char what[64];
    int ver = mtrl_kda_chunk_fwd_version(B.c, H, K, V);
    snprintf(what, sizeof what, "KDA chunk fwd (v%d%s)", ver, ver == 3 && !B.c->opts.kda_plain_bf16 ? " bf16x3" : "");
    row(what, shape, ms, flops, "TFLOP/s", B.gemm_tflops);
    std::string ak = "kda_H" + std::to_string(H) + "_T" + std::to_string(T);
    // P1: <= 0.5x fla at H = 16 from 64K on, <= 0.8x FlashKDA at H = 64 and 96 (8K), never
    // above 1.0x of either (anchors of tools/anchors_kda_attn.py: fla chunk_kda and FlashKDA
    // forward, bf16, lower-bounded gate, in the same call)
    auto kda_fwd_vs = [&](double t, const char *whose) {
        char w1[96], w2[96];
        snprintf(w1, sizeof w1, "%sthe time of fla chunk_kda fwd", whose);
        snprintf(w2, sizeof w2, "%sthe time of FlashKDA fwd", whose);
        vs(B, ak + "_fwd_ms", t, w1, H <= 16 && T >= 65536 ? "P1 <= 0.5x" : "P1 never above 1.0x");
        vs(B, "flashkda_H" + std::to_string(H) + "_T" + std::to_string(T) + "_fwd_ms", t, w2,
           H >= 64 ? "P1 <= 0.8x" : "P1 never above 1.0x");
    };
    kda_fwd_vs(ms, "");
    row("  (tokens)", "", ms, (double)T, "Mtok/s", 0);
    double bytes = 4.0 * (4 * nqk + (size_t)T * H + nqk);  // q k v g beta read, o written
    row("  (bytes floor: inputs + o)", "", ms, bytes, "GB/s", B.copy_tbps * 1e3);
    if (K == 128 && V == 128) {
        // the chunk-parallel forward (mtrl_kda_chunk_fwd_cp) at the chooser's piece count and at
        // 2, 4, 8, 16, 32 pieces, against the sequential default above
        static const int pcs[] = {MTRL_KDA_CP_AUTO, 2, 4, 8, 16, 32};
        double mc_auto = 0;
        for (int pc : pcs) {
            const int np = mtrl_kda_cp_pieces(B.c, T, H, K, V, pc);
            double mc = time_ms(B, [&] { mtrl_kda_chunk_fwd_cp(B.c, pc, T, H, K, V, q, k, v, g, beta, NULL, o, Sf, NULL); });
            snprintf(what, sizeof what, "  chunk-parallel, %s%d pieces", pc == MTRL_KDA_CP_AUTO ? "auto: " : "", np);
            row(what, shape, mc, flops, "TFLOP/s", B.gemm_tflops);
            printf("%-34s %-34s sequential / chunk-parallel (%d pieces) time %.3f\n", "", "", np, ms / mc);
            // the chooser's form is what the CUDA backend runs ([kernels] kda_seq_pieces = 0)
            if (pc == MTRL_KDA_CP_AUTO) {
                mc_auto = mc;
                kda_fwd_vs(mc, "chunk-parallel auto / ");
            }
        }
        // v3 only: the bf16-input entries refuse the kda_fwd = simt option
        if (mtrl_kda_chunk_fwd_version(B.c, H, K, V) == 3) {
            const float *in[4] = {q, k, v, g};
            double m_seq, m_cp;
            bench_kda_bf16in_(B, T, H, in, beta, o, Sf, ms, mc_auto, flops, shape, &m_seq, &m_cp);
            kda_fwd_vs(m_seq, "bf16 in / ");
            kda_fwd_vs(m_cp, "bf16 in, chunk-parallel auto / ");
        }
    }
    if (K == 128 && V == 128) {
        // the default (v3 bf16x3 where the shape allows it) against v2 (kda_fwd = simt, fp32
        // SIMT) and v3 with plain bf16 operands (kda_records = bf16)
        double m2 = 0, m4 = 0;
        {
            // the default in one piece and in 4 (kda_fwd_pieces; default: up to 8 from 256
            // tiles on at H <= 16, the prep of later pieces beside the state pass)
            static const int pcs[] = {1, 4};
            for (int pc : pcs) {
                scoped_opts so(B.c);
                B.c->opts.kda_fwd_pieces = pc;
                double mp = time_ms(B, [&] { mtrl_kda_chunk_fwd(B.c, T, H, K, V, q, k, v, g, beta, NULL, o, Sf, NULL); });
                snprintf(what, sizeof what, "  default, kda_fwd_pieces=%d", pc);
                row(what, shape, mp, flops, "TFLOP/s", B.gemm_tflops);
                printf("%-34s %-34s default / kda_fwd_pieces=%d time %.3f\n", "", "", pc, ms / mp);
            }
        }
        if (!B.kda_fwd_only && T > 262144) {
            printf("%-34s %-34s v2 (kda_fwd = simt) not run above T = 262144 (its fp32 scratch)\n", "", shape);
        } else if (!B.kda_fwd_only) {
            scoped_opts so(B.c);
            B.c->opts.kda_fwd = MTRL_KOPT_SIMT;
            m2 = time_ms(B, [&] { mtrl_kda_chunk_fwd(B.c, T, H, K, V, q, k, v, g, beta, NULL, o, Sf, NULL); });
            row("  v2 (kda_fwd = simt)", shape, m2, flops, "TFLOP/s", B.gemm_tflops);
        }
        {
            scoped_opts so(B.c);
            B.c->opts.kda_fwd = MTRL_KOPT_AUTO;
            B.c->opts.kda_plain_bf16 = 1;
            m4 = time_ms(B, [&] { mtrl_kda_chunk_fwd(B.c, T, H, K, V, q, k, v, g, beta, NULL, o, Sf, NULL); });
            row("  v3 bf16 (kda_records = bf16)", shape, m4, flops, "TFLOP/s", B.gemm_tflops);
        }  // the caller's options again
        if (m2 > 0)
            printf("%-34s %-34s default / v2 time %.3f, v3 bf16 / v2 %.3f, default / v3 bf16 %.3f\n", "", "",
                   ms / m2, m4 / m2, ms / m4);
    }
    if (B.kda_fwd_only) {
        mtrl_cuda_free(q); mtrl_cuda_free(k); mtrl_cuda_free(v); mtrl_cuda_free(g); mtrl_cuda_free(beta);
        mtrl_cuda_free(o); mtrl_cuda_free(Sf);
        return;
    }
    // forward storing the tile states, then backward: the whole sequence where its S_tiles,
    // dout and the gradients fit beside the inputs, else (1M at H = 16: 64 GiB of S_tiles) in
    // segments with the state carried (bench_kda_segmented)
    {
        double need = (nt * H * K * V * 4.0 + 5.0 * nqk * 4 + (size_t)T * H * 4 + (size_t)H * K * V * 4) / 1073741824.0;
        double fr = gib_free();
        if (need * 1.15 > fr) {
            printf("%-34s %-34s fwd+bwd of the whole sequence does not fit: S_tiles, dout, gradients %.1f GiB, %.1f GiB free\n",
                   "", shape, need, fr);
            bench_kda_segmented(B, T, H, 65536, q, k, v, g, beta, o);
            mtrl_cuda_free(q); mtrl_cuda_free(k); mtrl_cuda_free(v); mtrl_cuda_free(g); mtrl_cuda_free(beta);
            mtrl_cuda_free(o); mtrl_cuda_free(Sf);
            return;
        }
    }
    float *St = (float *)mtrl_cuda_malloc(nt * H * K * V * 4);
    float *dout = rnd(B, nqk, -1, 1);
    float *dq = (float *)mtrl_cuda_malloc(nqk * 4), *dk = (float *)mtrl_cuda_malloc(nqk * 4),
          *dv = (float *)mtrl_cuda_malloc(nqk * 4), *dg = (float *)mtrl_cuda_malloc(nqk * 4),
          *db = (float *)mtrl_cuda_malloc((size_t)T * H * 4), *dS0 = (float *)mtrl_cuda_malloc((size_t)H * K * V * 4);
    double ms_fs = time_ms(B, [&] { mtrl_kda_chunk_fwd(B.c, T, H, K, V, q, k, v, g, beta, NULL, o, Sf, St); });
    double ms_b = time_ms(B, [&] {
        mtrl_kda_chunk_bwd(B.c, T, H, K, V, q, k, v, g, beta, NULL, St, dout, NULL, dq, dk, dv, dg, db, dS0);
    }, 1, 3);
    row("KDA chunk fwd (storing S_tiles)", shape, ms_fs, (double)T, "Mtok/s", 0);
    row("KDA chunk bwd", shape, ms_b, (double)T, "Mtok/s", 0);
    {
        // the v2 kernels: pass 3 in fp32 SIMT (kda_bwd_tile = simt), then pass 2 too (kda_bwd = simt)
        scoped_opts so(B.c);
        B.c->opts.kda_bwd_tile = MTRL_KOPT_SIMT;
        double mbt = time_ms(B, [&] {
            mtrl_kda_chunk_bwd(B.c, T, H, K, V, q, k, v, g, beta, NULL, St, dout, NULL, dq, dk, dv, dg, db, dS0);
        }, 1, 3);
        row("  pass 3 SIMT (kda_bwd_tile)", shape, mbt, (double)T, "Mtok/s", 0);
        B.c->opts.kda_bwd = MTRL_KOPT_SIMT;
        double mb2 = time_ms(B, [&] {
            mtrl_kda_chunk_bwd(B.c, T, H, K, V, q, k, v, g, beta, NULL, St, dout, NULL, dq, dk, dv, dg, db, dS0);
        }, 1, 3);
        row("  v2 bwd (kda_bwd, kda_bwd_tile)", shape, mb2, (double)T, "Mtok/s", 0);
        printf("%-34s %-34s default bwd / v2 bwd time %.3f, pass 3 SIMT / v2 %.3f\n", "", "", ms_b / mb2, mbt / mb2);
    }  // the caller's options again
    row("KDA chunk fwd+bwd", shape, ms_fs + ms_b, (double)T, "Mtok/s", 0);
    vs(B, ak + "_fwdbwd_ms", ms_fs + ms_b, "the time of fla chunk_kda fwd+bwd", "P2 <= 0.8x");
    printf("%-34s %-34s device memory in use %.1f GiB (inputs, grads, S_tiles, scratch)\n", "", "", gib_in_use());
    void *ps[] = {q, k, v, g, beta, o, Sf, St, dout, dq, dk, dv, dg, db, dS0};
    for (void *p : ps) mtrl_cuda_free(p);
}

// Selects the decode kernels for the launchers (the option decode): 1 forces v1 (simt), 2 leaves
// the default (v2 where the shape allows it).
void set_decode_version(mtrl_cuda_ctx *c, int version) {
    c->opts.decode = version == 1 ? MTRL_KOPT_SIMT : MTRL_KOPT_AUTO;
}

// KDA decode step, v2 and v1: B sequences x H heads, K = V = 128, fp32 state read + written.
// NR state copies rotate (each >= 67 MB at B = 64, so the working set is >= 4x the L2). Two
// timings: one launch between two events (median), and NR x 4 launches back to back divided by
// their count (launch gaps overlap the previous kernel, as in a decode loop over layers).
void bench_kda_step(Bench &B, int Bsz, int H) {
    const int K = 128, V = 128;
    size_t nS = (size_t)Bsz * H * K * V;
    float *q = rnd(B, (size_t)Bsz * H * K, -0.1f, 0.1f), *k = rnd(B, (size_t)Bsz * H * K, -0.1f, 0.1f),
          *v = rnd(B, (size_t)Bsz * H * V, -1, 1), *g = rnd(B, (size_t)Bsz * H * K, -1.f, -0.01f),
          *beta = rnd(B, (size_t)Bsz * H, 0.1f, 0.9f), *o = (float *)mtrl_cuda_malloc((size_t)Bsz * H * V * 4);
    const int NR = 4;
    float *S[NR];
    for (int i = 0; i < NR; i++) S[i] = rnd(B, nS, -0.1f, 0.1f);
    char shape[64];
    snprintf(shape, sizeof shape, "B=%d H=%d K=V=128", Bsz, H);
    double bytes = 2.0 * nS * 4 + 4.0 * Bsz * H * (3 * K + 2 * V + 1);
    for (int version = 2; version >= 1; version--) {
        set_decode_version(B.c, version);
        int it = 0;
        double ms = time_ms(B, [&] { mtrl_kda_step(B.c, Bsz, H, K, V, q, k, v, g, beta, S[it++ % NR], o); }, 2, 20);
        const int nb = 4 * NR;
        double ms_b2b = time_ms(B, [&] {
            for (int i = 0; i < nb; i++) mtrl_kda_step(B.c, Bsz, H, K, V, q, k, v, g, beta, S[i % NR], o);
        }, 1, 5) / nb;
        char what[64];
        snprintf(what, sizeof what, "KDA decode step v%d%s", mtrl_kda_step_version(B.c, H, K, V),
                 version == 2 && mtrl_kda_step_version(B.c, H, K, V) == 1 ? " (v2 n/a)" : "");
        row(what, shape, ms, bytes, "GB/s", B.copy_tbps * 1e3);
        snprintf(what, sizeof what, "  (%d launches back to back, each)", nb);
        row(what, "", ms_b2b, bytes, "GB/s", B.copy_tbps * 1e3);
    }
    set_decode_version(B.c, 2);
    printf("%-34s %-34s bytes per step %.1f MB (state read + written, inputs, o)\n", "", "", bytes / 1e6);
    for (int i = 0; i < NR; i++) mtrl_cuda_free(S[i]);
    void *ps[] = {q, k, v, g, beta, o};
    for (void *p : ps) mtrl_cuda_free(p);
}

// Causal attention (with_v1: also v1, forced). mode 1 (absorbed): MQA over the 576-wide latent (Hk = 1, Dv = 512 aliased);
// mode 0: MHA with H heads of Dk = Dv = 128 (SDPA's shape in the anchors); mode 2 (naive MLA,
// keys and values up-projected per head): MHA with Dk = d_n + d_r = 192, Dv = d_v = 128, the
// small preset's dims. fwd+bwd is counted as 3.5 x the forward for every mode (the anchors'
// convention); at Dk = 192, Dv = 128 the backward's products are (3 Dk + 2 Dv) / (Dk + Dv) = 2.6
// forwards, so that row understates its TFLOP/s by 3%.
void bench_attn(Bench &B, int T, int H, int mode, int with_v1) {
    const int absorbed = mode == 1, naive = mode == 2;
    int Hk = absorbed ? 1 : H, Dk = absorbed ? 576 : naive ? 192 : 128, Dv = absorbed ? 512 : 128;
    int ldk = Hk * Dk, ldv = absorbed ? ldk : Hk * Dv;
    mtrl_bf16 *q = rnd_bf16(B, (size_t)T * H * Dk, -1, 1), *k = rnd_bf16(B, (size_t)T * ldk, -1, 1);
    mtrl_bf16 *v = absorbed ? k : rnd_bf16(B, (size_t)T * ldv, -1, 1);
    mtrl_bf16 *dout = rnd_bf16(B, (size_t)T * H * Dv, -1, 1);
    float *o = (float *)mtrl_cuda_malloc((size_t)T * H * Dv * 4), *lse = (float *)mtrl_cuda_malloc((size_t)T * H * 4);
    float *dq = (float *)mtrl_cuda_malloc((size_t)T * H * Dk * 4), *dk = (float *)mtrl_cuda_malloc((size_t)T * ldk * 4);
    float *dv = absorbed ? dk : (float *)mtrl_cuda_malloc((size_t)T * ldv * 4);
    CUDA_CHECK(cudaMemsetAsync(dk, 0, (size_t)T * ldk * 4, B.c->stream));
    if (!absorbed) CUDA_CHECK(cudaMemsetAsync(dv, 0, (size_t)T * ldv * 4, B.c->stream));
    float scale = 1.f / sqrtf(absorbed || naive ? 192.f : 128.f);
    char shape[80];
    snprintf(shape, sizeof shape,
             absorbed ? "T=%d H=%d MQA Dk=576 Dv=512" : naive ? "T=%d H=%d Dk=192 Dv=128" : "T=%d H=%d Dk=Dv=128",
             T, H);
    double fl = (double)T * T * H * (Dk + Dv);  // causal: half of 2 T² H (Dk + Dv)
    // v3 (wgmma: H100 / H200, not the absorbed shape), v2 (attn = mma) and v1 (attn = simt) on
    // the same inputs
    for (int version = 3; version >= (with_v1 ? 1 : 2); version--) {
        if (version == 3 && (absorbed || B.c->cc != 90)) continue;
        B.c->opts.attn = version == 1 ? MTRL_KOPT_SIMT : version == 2 ? MTRL_KOPT_MMA : MTRL_KOPT_AUTO;
        int vf = mtrl_attn_causal_version(B.c, H, Hk, Dk, Dv, absorbed, 0);
        int vb = mtrl_attn_causal_version(B.c, H, Hk, Dk, Dv, absorbed, 1);
        char what[80];
        double ms = time_ms(B, [&] { mtrl_attn_causal_fwd(B.c, T, T, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv, o, lse); }, 1, 3);
        snprintf(what, sizeof what, "%s fwd v%d",
                 absorbed ? "MLA attention (absorbed)" : naive ? "MLA attention (naive)" : "attention (MHA shape)", vf);
        row(what, shape, ms, fl, "TFLOP/s", B.gemm_tflops);
        // the anchors (tools/anchors_kda_attn.py, the same FLOP count): SDPA at H = 16, D = 128
        // for the MHA shape (keys sdpa_<backend>_T<T>_...), and at Dk = 192, Dv = 128 for the
        // naive shape at the heads in the key (sdpa_<backend>_naive_H<H>_T<T>_...)
        bool same = (mode == 0 && H == 16) || naive;
        std::string sk = naive ? "_naive_H" + std::to_string(H) + "_T" + std::to_string(T) : "_T" + std::to_string(T);
        if (same) {
            vs(B, "sdpa_cudnn" + sk + "_fwd_tflops", fl / (ms * 1e-3) / 1e12, "the TFLOP/s of SDPA cuDNN fwd", "P4 >= 1.0x");
            vs(B, "sdpa_fa2" + sk + "_fwd_tflops", fl / (ms * 1e-3) / 1e12, "the TFLOP/s of SDPA FA2 fwd", "P4 never below 1.0x");
        }
        double msb = time_ms(B, [&] {
            mtrl_attn_causal_bwd(B.c, T, T, H, Hk, Dk, Dv, scale, q, k, ldk, v, ldv, o, lse, dout, dq, dk, dv);
        }, 1, 3);
        // fwd+bwd counted as 3.5 x the forward (the anchors' convention: bwd = 2.5 x fwd)
        snprintf(what, sizeof what, "  fwd+bwd (fwd v%d, bwd v%d)", vf, vb);
        row(what, shape, ms + msb, 3.5 * fl, "TFLOP/s", B.gemm_tflops);
        if (same) {
            double r = 3.5 * fl / ((ms + msb) * 1e-3) / 1e12;
            vs(B, "sdpa_cudnn" + sk + "_fwdbwd_tflops", r, "the TFLOP/s of SDPA cuDNN fwd+bwd", "P4 >= 1.0x");
            vs(B, "sdpa_fa2" + sk + "_fwdbwd_tflops", r, "the TFLOP/s of SDPA FA2 fwd+bwd", "P4 never below 1.0x");
        }
        snprintf(what, sizeof what, "  bwd alone (v%d)", vb);
        row(what, shape, msb, 2.5 * fl, "TFLOP/s", B.gemm_tflops);
    }
    B.c->opts.attn = MTRL_KOPT_AUTO;
    mtrl_cuda_free(q); mtrl_cuda_free(k); mtrl_cuda_free(dout); mtrl_cuda_free(o); mtrl_cuda_free(lse);
    mtrl_cuda_free(dq); mtrl_cuda_free(dk);
    if (!absorbed) { mtrl_cuda_free(v); mtrl_cuda_free(dv); }
}

// MLA absorbed decode, v2 and v1: Bsz sequences of Tk cached positions (bf16 latent rows of
// dc + dr = 576), H heads, one query token each. The rate counts the latent-cache bytes only
// (read once); each shape reads >= 1.2 GB, far above the L2, so no rotation is needed.
void bench_decode(Bench &B, int Bsz, int Tk, int H) {
    const int dn = 128, dr = 64, dv = 128, dc = 512, ld = dc + dr;
    size_t rows = (size_t)Bsz * Tk;
    double lat_bytes = (double)rows * ld * 2;
    size_t free_b, total_b;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    if (3.5 * lat_bytes > (double)free_b) {  // the bf16 cache plus its fp32 staging while filled
        printf("%-34s B=%d Tk=%d: skipped (%.1f GB of latents does not fit)\n", "MLA absorbed decode", Bsz,
               Tk, lat_bytes / 1e9);
        return;
    }
    mtrl_bf16 *lat = rnd_bf16(B, rows * ld, -1, 1);
    float *q = rnd(B, (size_t)Bsz * H * (dn + dr), -1, 1), *W = rnd(B, (size_t)H * (dn + dv) * dc, -0.05f, 0.05f);
    float *a = (float *)mtrl_cuda_malloc((size_t)Bsz * H * dv * 4);
    std::vector<long long> st(Bsz);
    std::vector<int> len(Bsz, Tk);
    for (int b = 0; b < Bsz; b++) st[b] = (long long)b * Tk;
    long long *d_st = (long long *)mtrl_cuda_malloc(sizeof(long long) * Bsz);
    int *d_len = (int *)mtrl_cuda_malloc(sizeof(int) * Bsz);
    mtrl_cuda_upload(d_st, st.data(), sizeof(long long) * Bsz);
    mtrl_cuda_upload(d_len, len.data(), sizeof(int) * Bsz);
    char shape[80];
    snprintf(shape, sizeof shape, "B=%d Tk=%d H=%d bf16 latent", Bsz, Tk, H);
    for (int version = 2; version >= 1; version--) {
        set_decode_version(B.c, version);
        int runs = mtrl_mla_decode_version(B.c, H, dr, dc, MTRL_BF16, ld);
        auto call = [&] {
            mtrl_mla_decode_absorbed(B.c, Bsz, H, dn, dr, dv, dc, 1.f / sqrtf(192.f), q, W, lat, MTRL_BF16, ld, d_st,
                                     d_len, Tk, a);
        };
        double ms = time_ms(B, call, 2, version == 2 ? 10 : 3);
        char what[64];
        snprintf(what, sizeof what, "MLA absorbed decode v%d%s", runs, version == 2 && runs == 1 ? " (v2 n/a)" : "");
        row(what, shape, ms, lat_bytes, "GB/s", B.copy_tbps * 1e3);
        if (version == 2) {  // steady state: the host's launch work overlaps the previous call
            const int nb = 4;
            double ms_b2b = time_ms(B, [&] { for (int i = 0; i < nb; i++) call(); }, 1, 5) / nb;
            snprintf(what, sizeof what, "  (%d calls back to back, each)", nb);
            row(what, "", ms_b2b, lat_bytes, "GB/s", B.copy_tbps * 1e3);
        }
    }
    set_decode_version(B.c, 2);
    printf("%-34s %-34s latent bytes read %.2f GB\n", "", "", lat_bytes / 1e9);
    mtrl_cuda_free(lat); mtrl_cuda_free(q); mtrl_cuda_free(W); mtrl_cuda_free(a);
    mtrl_cuda_free(d_st); mtrl_cuda_free(d_len);
}

// One cuBLAS GEMM per non-empty expert on nl GEMM lanes (as mtrl_moe_experts_* run them):
// Y_e [rows][F] = X_e W[e]ᵀ, bf16 operands, W [E][F][D].
void lanes_gemm(Bench &B, int nl, int E, const int *off, int D, int F, const mtrl_bf16 *X, const mtrl_bf16 *W,
                float *Y) {
    mtrl_ctx_lanes_fork(B.c, nl);
    for (int e = 0; e < E; e++) {
        int r0 = off[e], n = off[e + 1] - r0;
        if (n > 0)
            mtrl_gemm_lane(B.c, e % nl, 0, 1, n, F, D, 1.f, X + (size_t)r0 * D, D, W + (size_t)e * F * D, D, MTRL_BF16,
                           0.f, Y + (size_t)r0 * F, F, MTRL_F32);
    }
    mtrl_ctx_lanes_join(B.c, nl);
}

// Expert GEMMs: E experts x rows each (or skewed), D -> F, bf16 operands, one GEMM per expert;
// then the full SwiGLU experts forward and forward+backward at D = 2048, I = 1024.
void bench_moe(Bench &B, int E, int rows, int D, int F) {
    size_t R = (size_t)E * rows;
    mtrl_bf16 *X = rnd_bf16(B, R * D, -1, 1), *W = rnd_bf16(B, (size_t)E * F * D, -0.05f, 0.05f);
    float *Y = (float *)mtrl_cuda_malloc(R * F * 4);
    for (int skew = 0; skew < 2; skew++) {
        std::vector<int> off(E + 1, 0);
        long s = 0;
        for (int e = 0; e < E; e++) {
            int r = skew ? (int)((double)R * (e + 1) / (E * (E + 1) / 2.0)) : rows;
            off[e] = (int)s;
            s += r;
        }
        off[E] = (int)R;
        // One cuBLAS call per expert on one stream, then on the GEMM lanes (cuda_common.cuh) as
        // mtrl_moe_experts_* run them.
        char shape[80];
        snprintf(shape, sizeof shape, "E=%d rows=%zu %d->%d %s", E, R, D, F, skew ? "skewed" : "balanced");
        double ms_lane[2];
        for (int li = 0; li < 2; li++) {
            const int nl = li ? mtrl_ctx_lanes(B.c) : 1;
            ms_lane[li] = time_ms(B, [&] { lanes_gemm(B, nl, E, off.data(), D, F, X, W, Y); });
            char what[64];
            snprintf(what, sizeof what, "expert GEMMs (cuBLAS loop, %d lane%s)", nl, nl == 1 ? "" : "s");
            row(what, shape, ms_lane[li], 2.0 * R * D * F, "TFLOP/s", B.gemm_tflops);
        }
        double ms = ms_lane[1];
        // the anchor: torch._grouped_mm on 64 experts x 8192 rows, 2048 -> 1024, balanced
        if (!skew && E == 64 && rows == 8192 && D == 2048 && F == 1024)
            vs(B, "grouped_mm_tflops", 2.0 * R * D * F / (ms * 1e-3) / 1e12, "the TFLOP/s of torch._grouped_mm", "P6 >= 1.0x");
    }
    mtrl_cuda_free(Y);
    // full SwiGLU experts, balanced, I = F
    int I = F;
    mtrl_bf16 *W3 = rnd_bf16(B, (size_t)E * I * D, -0.05f, 0.05f), *W2 = rnd_bf16(B, (size_t)E * D * I, -0.05f, 0.05f);
    float *u1 = (float *)mtrl_cuda_malloc(R * I * 4), *u3 = (float *)mtrl_cuda_malloc(R * I * 4),
          *Yp = (float *)mtrl_cuda_malloc(R * D * 4);
    std::vector<int> off(E + 1);
    for (int e = 0; e <= E; e++) off[e] = e * rows;
    char shape[80];
    snprintf(shape, sizeof shape, "E=%d rows=%zu D=%d I=%d", E, R, D, I);
    double ms = time_ms(B, [&] { mtrl_moe_experts_fwd(B.c, E, D, I, off.data(), X, W, W3, W2, MTRL_BF16, u1, u3, Yp); }, 1, 3);
    row("SwiGLU experts fwd (bf16)", shape, ms, 6.0 * R * D * I, "TFLOP/s", B.gemm_tflops);
    float *dX = (float *)mtrl_cuda_malloc(R * D * 4), *dW1 = (float *)mtrl_cuda_malloc((size_t)E * I * D * 4),
          *dW3 = (float *)mtrl_cuda_malloc((size_t)E * I * D * 4), *dW2 = (float *)mtrl_cuda_malloc((size_t)E * I * D * 4);
    double msb = time_ms(B, [&] {
        mtrl_moe_experts_bwd(B.c, E, D, I, off.data(), X, W, W3, W2, MTRL_BF16, u1, u3, Yp, dX, dW1, dW3, dW2);
    }, 1, 3);
    row("SwiGLU experts bwd (bf16)", shape, msb, 12.0 * R * D * I, "TFLOP/s", B.gemm_tflops);
    void *ps[] = {X, W, W3, W2, u1, u3, Yp, dX, dW1, dW3, dW2};
    for (void *p : ps) mtrl_cuda_free(p);
}

// The experts as the `small` learner step at 64K runs them: 64 experts, d 1024, I 512, top-6 of
// a 51,456-token segment (~4,824 rows each), fp32 operands with TF32 (the default GEMM format),
// forward and backward, on one GEMM lane and on the default lanes.
void bench_moe_model(Bench &B) {
    const int E = 64, D = 1024, I = 512, rows = 51456 * 6 / 64;
    const size_t R = (size_t)E * rows;
    float *X = rnd(B, R * D, -1, 1), *W1 = rnd(B, (size_t)E * I * D, -0.05f, 0.05f),
          *W3 = rnd(B, (size_t)E * I * D, -0.05f, 0.05f), *W2 = rnd(B, (size_t)E * D * I, -0.05f, 0.05f);
    float *u1 = (float *)mtrl_cuda_malloc(R * I * 4), *u3 = (float *)mtrl_cuda_malloc(R * I * 4),
          *Yp = (float *)mtrl_cuda_malloc(R * D * 4), *dX = (float *)mtrl_cuda_malloc(R * D * 4),
          *dW1 = (float *)mtrl_cuda_malloc((size_t)E * I * D * 4), *dW3 = (float *)mtrl_cuda_malloc((size_t)E * I * D * 4),
          *dW2 = (float *)mtrl_cuda_malloc((size_t)E * I * D * 4);
    std::vector<int> off(E + 1);
    for (int e = 0; e <= E; e++) off[e] = e * rows;
    char shape[80];
    snprintf(shape, sizeof shape, "E=%d rows=%zu D=%d I=%d TF32", E, R, D, I);
    mtrl_cuda_ctx_set_tf32(B.c, 1);
    const int was = B.c->opts.moe_lanes;
    for (int li = 0; li < 2; li++) {
        B.c->opts.moe_lanes = li ? was : 1;
        const int nl = mtrl_ctx_lanes(B.c);
        double ms = time_ms(B, [&] { mtrl_moe_experts_fwd(B.c, E, D, I, off.data(), X, W1, W3, W2, MTRL_F32, u1, u3, Yp); }, 1, 5);
        char what[64];
        snprintf(what, sizeof what, "model's experts fwd, %d lane%s", nl, nl == 1 ? "" : "s");
        row(what, shape, ms, 6.0 * R * D * I, "TFLOP/s", B.gemm_tflops);
        double msb = time_ms(B, [&] {
            mtrl_moe_experts_bwd(B.c, E, D, I, off.data(), X, W1, W3, W2, MTRL_F32, u1, u3, Yp, dX, dW1, dW3, dW2);
        }, 1, 5);
        snprintf(what, sizeof what, "model's experts bwd, %d lane%s", nl, nl == 1 ? "" : "s");
        row(what, shape, msb, 12.0 * R * D * I, "TFLOP/s", B.gemm_tflops);
    }
    mtrl_cuda_ctx_set_tf32(B.c, 0);
    void *ps[] = {X, W1, W3, W2, u1, u3, Yp, dX, dW1, dW3, dW2};
    for (void *p : ps) mtrl_cuda_free(p);
}

// The grouped experts (own kernels, device offsets: moe/experts_mma.cu) against the per-expert
// cuBLAS chains on the GEMM lanes, in the same run, at 16, 128, 1024 and 8192 rows per expert,
// balanced and skewed (expert e gets ∝ e + 1 rows, as bench_moe; at 16 rows the first experts get
// none). Rows: one grouped GEMM X W[e]ᵀ (D -> F, bf16: the shape of torch._grouped_mm in
// tools/anchors_grouped_mm.py, whose JSON keys the --anchors lines read), then the full SwiGLU
// experts forward and backward (I = F) on both paths, in bf16 and, with tf32, fp32 operands as
// TF32 (the model's default). The grouped rows name their kernel: mma (mma.sync, moe/experts_mma.cu)
// and, on an H100 / H200, wgmma (the bf16 forward on warpgroup MMA + TMA, moe/sm90a/experts_wgmma.cu),
// each forced through the option moe in the same run. Each block of rows ends with the paths
// mtrl_moe_experts_fwd_path / mtrl_moe_experts_path pick.
void bench_moe_grouped(Bench &B, int E, int D, int F, bool tf32) {
    const int rows_list[4] = {16, 128, 1024, 8192};
    const int I = F;
    const size_t Rmax = (size_t)E * 8192;
    mtrl_bf16 *Xh = rnd_bf16(B, Rmax * D, -1, 1), *W1h = rnd_bf16(B, (size_t)E * I * D, -0.05f, 0.05f),
              *W3h = rnd_bf16(B, (size_t)E * I * D, -0.05f, 0.05f), *W2h = rnd_bf16(B, (size_t)E * D * I, -0.05f, 0.05f);
    float *Xf = nullptr, *W1f = nullptr, *W3f = nullptr, *W2f = nullptr;
    if (tf32) {
        Xf = rnd(B, Rmax * D, -1, 1);
        W1f = rnd(B, (size_t)E * I * D, -0.05f, 0.05f);
        W3f = rnd(B, (size_t)E * I * D, -0.05f, 0.05f);
        W2f = rnd(B, (size_t)E * D * I, -0.05f, 0.05f);
    }
    float *u1 = (float *)mtrl_cuda_malloc(Rmax * I * 4), *u3 = (float *)mtrl_cuda_malloc(Rmax * I * 4),
          *Yp = (float *)mtrl_cuda_malloc(Rmax * D * 4), *dX = (float *)mtrl_cuda_malloc(Rmax * D * 4),
          *dW1 = (float *)mtrl_cuda_malloc((size_t)E * I * D * 4), *dW3 = (float *)mtrl_cuda_malloc((size_t)E * I * D * 4),
          *dW2 = (float *)mtrl_cuda_malloc((size_t)E * I * D * 4);
    int *d_off = (int *)mtrl_cuda_malloc(sizeof(int) * (E + 1));
    for (int rows : rows_list)
        for (int skew = 0; skew < 2; skew++) {
            const size_t R = (size_t)E * rows;
            std::vector<int> off(E + 1, 0);
            long s = 0;
            for (int e = 0; e < E; e++) {
                off[e] = (int)s;
                s += skew ? (int)((double)R * (e + 1) / (E * (E + 1) / 2.0)) : rows;
            }
            off[E] = (int)R;
            mtrl_cuda_upload(d_off, off.data(), sizeof(int) * (E + 1));
            char shape[96];
            snprintf(shape, sizeof shape, "E=%d %d/exp %s %d->%d", E, rows, skew ? "skewed" : "balanced", D, F);
            double flop = 2.0 * R * D * F;
            char key[128];
            snprintf(key, sizeof key, "grouped_mm_E%d_K%d_N%d_rows%d_%s_tflops", E, D, F, rows, skew ? "skewed" : "balanced");
            const int kern[2] = {MTRL_KOPT_MMA, MTRL_KOPT_WGMMA};
            const char *kname[2] = {"mma", "wgmma"};
            for (int ki = 0; ki < 2; ki++) {
                scoped_opts so(B.c);
                B.c->opts.moe = kern[ki];
                if (mtrl_moe_grouped_kernel(B.c, E, (long)R, MTRL_BF16) != kern[ki]) continue;  // no wgmma here
                double ms_g = time_ms(B, [&] { mtrl_moe_grouped_gemm(B.c, E, (long)R, d_off, F, D, Xh, W1h, MTRL_BF16, Yp); });
                char what[64];
                snprintf(what, sizeof what, "grouped GEMM bf16 (%s)", kname[ki]);
                row(what, shape, ms_g, flop, "TFLOP/s", B.gemm_tflops);
                vs(B, key, flop / (ms_g * 1e-3) / 1e12, "the TFLOP/s of torch._grouped_mm", "P6 >= 1.0x");
                if (kern[ki] != MTRL_KOPT_WGMMA) continue;
                // torch's contract: bf16 out (half the bytes the fp32 row above stores; u1 as the buffer)
                double ms_h = time_ms(B, [&] { mtrl_moe_grouped_gemm_bf16(B.c, E, (long)R, d_off, F, D, Xh, W1h, u1); });
                row("grouped GEMM bf16, bf16 out (wgmma)", shape, ms_h, flop, "TFLOP/s", B.gemm_tflops);
                vs(B, key, flop / (ms_h * 1e-3) / 1e12, "the TFLOP/s of torch._grouped_mm (both bf16 out)", "P6 >= 1.0x");
            }
            const int nl = mtrl_ctx_lanes(B.c);
            double ms_l = time_ms(B, [&] { lanes_gemm(B, nl, E, off.data(), D, F, Xh, W1h, Yp); });
            row("grouped GEMM bf16 (cuBLAS lanes)", shape, ms_l, flop, "TFLOP/s", B.gemm_tflops);
            vs(B, key, flop / (ms_l * 1e-3) / 1e12, "the TFLOP/s of torch._grouped_mm", "P6 >= 1.0x");
            for (int prec = 0; prec < (tf32 ? 2 : 1); prec++) {
                const int type = prec ? MTRL_F32 : MTRL_BF16;
                const void *X = prec ? (const void *)Xf : Xh, *W1 = prec ? (const void *)W1f : W1h,
                           *W3 = prec ? (const void *)W3f : W3h, *W2 = prec ? (const void *)W2f : W2h;
                mtrl_cuda_ctx_set_tf32(B.c, prec);
                const char *pn = prec ? "TF32" : "bf16";
                double t[4];
                if (!prec) {  // bf16 on wgmma (the backward's dm and dX; dW on mma), where the device runs it
                    scoped_opts so(B.c);
                    B.c->opts.moe = MTRL_KOPT_WGMMA;
                    if (mtrl_moe_grouped_kernel(B.c, E, (long)R, type) == MTRL_KOPT_WGMMA) {
                        double ms = time_ms(B, [&] {
                            mtrl_moe_experts_grouped_fwd(B.c, E, D, I, (long)R, d_off, X, W1, W3, W2, type, u1, u3, Yp);
                        });
                        row("experts fwd bf16 grouped wgmma", shape, ms, 6.0 * R * D * I, "TFLOP/s", B.gemm_tflops);
                        ms = time_ms(B, [&] {
                            mtrl_moe_experts_grouped_bwd(B.c, E, D, I, (long)R, d_off, X, W1, W3, W2, type, u1, u3, Yp, dX,
                                                         dW1, dW3, dW2);
                        });
                        row("experts bwd bf16 grouped wgmma", shape, ms, 12.0 * R * D * I, "TFLOP/s", B.gemm_tflops);
                    }
                }
                {
                    scoped_opts so(B.c);
                    B.c->opts.moe = MTRL_KOPT_MMA;
                    t[0] = time_ms(B, [&] {
                        mtrl_moe_experts_grouped_fwd(B.c, E, D, I, (long)R, d_off, X, W1, W3, W2, type, u1, u3, Yp);
                    });
                }
                t[1] = time_ms(B, [&] { mtrl_moe_experts_fwd(B.c, E, D, I, off.data(), X, W1, W3, W2, type, u1, u3, Yp); });
                {
                    scoped_opts so(B.c);
                    B.c->opts.moe = MTRL_KOPT_MMA;
                    t[2] = time_ms(B, [&] {
                        mtrl_moe_experts_grouped_bwd(B.c, E, D, I, (long)R, d_off, X, W1, W3, W2, type, u1, u3, Yp, dX,
                                                     dW1, dW3, dW2);
                    });
                }
                t[3] = time_ms(B, [&] {
                    mtrl_moe_experts_bwd(B.c, E, D, I, off.data(), X, W1, W3, W2, type, u1, u3, Yp, dX, dW1, dW3, dW2);
                });
                const char *names[4] = {"experts fwd %s grouped mma", "experts fwd %s lanes", "experts bwd %s grouped mma",
                                        "experts bwd %s lanes"};
                for (int i = 0; i < 4; i++) {
                    char what[64];
                    snprintf(what, sizeof what, names[i], pn);
                    row(what, shape, t[i], (i < 2 ? 6.0 : 12.0) * R * D * I, "TFLOP/s", B.gemm_tflops);
                }
                int path = mtrl_moe_experts_path(B.c, E, D, I, (long)R, type);
                int fpath = mtrl_moe_experts_fwd_path(B.c, E, D, I, (long)R, type);
                int fk = mtrl_moe_grouped_kernel(B.c, E, (long)R, type);
                printf("%-34s %-34s chooser: fwd %s, bwd %s (fwd+bwd grouped mma %.3f ms, lanes %.3f ms)\n", "", "",
                       fpath == MTRL_MOE_LANES ? "lanes" : fk == MTRL_KOPT_WGMMA ? "grouped wgmma" : "grouped mma",
                       path == MTRL_MOE_GROUPED ? "grouped" : "lanes", t[0] + t[2], t[1] + t[3]);
                fflush(stdout);
            }
            mtrl_cuda_ctx_set_tf32(B.c, 0);
        }
    void *ps[] = {Xh, W1h, W3h, W2h, Xf, W1f, W3f, W2f, u1, u3, Yp, dX, dW1, dW3, dW2, d_off};
    for (void *p : ps) mtrl_cuda_free(p);
}

void bench_small_ops(Bench &B) {
    int N = 65536, D = 2304;
    float *x = rnd(B, (size_t)N * D, -2, 2), *w = rnd(B, D, 0.5f, 1.5f), *y = (float *)mtrl_cuda_malloc((size_t)N * D * 4);
    double ms = time_ms(B, [&] { mtrl_rmsnorm_fwd(B.c, N, D, x, w, 1e-5f, y, NULL); }, 2, 10);
    row("RMSNorm fwd", "N=65536 D=2304", ms, 2.0 * N * D * 4, "GB/s", B.copy_tbps * 1e3);
    mtrl_cuda_free(x); mtrl_cuda_free(y); mtrl_cuda_free(w);
    int Nl = 4096, V = 163840;
    float *l = rnd(B, (size_t)Nl * V, -5, 5), *lp = (float *)mtrl_cuda_malloc(Nl * 4), *ent = (float *)mtrl_cuda_malloc(Nl * 4);
    std::vector<int> tg(Nl);
    for (int i = 0; i < Nl; i++) tg[i] = (i * 7919) % V;
    int *d_tg = (int *)mtrl_cuda_malloc(sizeof(int) * Nl);
    mtrl_cuda_upload(d_tg, tg.data(), sizeof(int) * Nl);
    ms = time_ms(B, [&] { mtrl_logprob_fwd(B.c, Nl, V, l, d_tg, lp, ent); }, 2, 10);
    row("log-prob + entropy fwd", "N=4096 V=163840", ms, 4.0 * Nl * V, "GB/s", B.copy_tbps * 1e3);
    mtrl_cuda_free(l); mtrl_cuda_free(lp); mtrl_cuda_free(ent); mtrl_cuda_free(d_tg);
}

// Whether the comma-separated list has the item k (its first occurrence must be a whole item).
bool list_has(const char *list, const char *k) {
    const char *p = strstr(list, k);
    return p && (p == list || p[-1] == ',') && (p[strlen(k)] == 0 || p[strlen(k)] == ',');
}

std::vector<int> parse_list(const char *s) {
    std::vector<int> v;
    while (s && *s) {
        v.push_back(atoi(s));
        const char *c = strchr(s, ',');
        s = c ? c + 1 : nullptr;
    }
    return v;
}

// The varlen KDA forward (mtrl_kda_chunk_fwd_varlen: one prep and one state-pass launch for n
// packed pieces of `len` tokens, each from zero) against the per-piece launches the model ran
// before it (mtrl_kda_chunk_fwd per piece), in the training form (o and every tile's state, what
// the learner's forward stores) and the prefill form (o only); then the short conv's forward
// (mtrl_shortconv_fwd_varlen against mtrl_shortconv_fwd per piece); then both backwards, varlen
// against per piece.
void bench_kda_varlen(Bench &B, int n, int len, int H) {
    const int K = 128, V = 128, T = n * len;
    size_t nqk = (size_t)T * H * K, ntl = (size_t)n * ((len + 15) / 16), ns = (size_t)H * K * V;
    float *q, *k, *v, *g, *beta;
    kda_inputs_(B, T, H, &q, &k, &v, &g, &beta);
    float *o = (float *)mtrl_cuda_malloc(nqk * 4), *St = (float *)mtrl_cuda_malloc(ntl * ns * 4);
    std::vector<int> offs(n + 1);
    for (int i = 0; i <= n; i++) offs[i] = i * len;
    mtrl_cuda_sync(B.c);
    auto per_piece = [&](float *st) {
        for (int i = 0; i < n; i++) {
            size_t x = (size_t)i * len, t = (size_t)i * ((len + 15) / 16);
            mtrl_kda_chunk_fwd(B.c, len, H, K, V, q + x * H * K, k + x * H * K, v + x * H * V, g + x * H * K,
                               beta + x * H, NULL, o + x * H * V, NULL, st ? st + t * ns : NULL);
        }
    };
    char shape[64], what[64];
    snprintf(shape, sizeof shape, "%d x %d H=%d K=V=128", n, len, H);
    double flops = (double)ntl * H * (4.0 * 65536 + 3.0 * 524288 + 65536);  // bench_kda's nominal work
    for (int train = 1; train >= 0; train--) {
        float *st = train ? St : NULL;
        double mp = time_ms(B, [&] { per_piece(st); });
        double mv = time_ms(B, [&] { mtrl_kda_chunk_fwd_varlen(B.c, n, offs.data(), H, K, V, q, k, v, g, beta, o, NULL, st); });
        snprintf(what, sizeof what, "KDA fwd per piece (%s)", train ? "o, S_tiles" : "o");
        row(what, shape, mp, flops, "TFLOP/s", B.gemm_tflops);
        snprintf(what, sizeof what, "KDA fwd varlen (%s)", train ? "o, S_tiles" : "o");
        row(what, shape, mv, flops, "TFLOP/s", B.gemm_tflops);
        printf("%-34s %-34s varlen / per piece time %.3f\n", "", "", mv / mp);
    }
    // the layer's short conv over the same pack (C = H K channels, W = 4; q as its input)
    const int C = H * K, W = 4;
    float *cw = rnd(B, (size_t)C * W, -0.5f, 0.5f);
    double cp = time_ms(B, [&] {
        for (int i = 0; i < n; i++)
            mtrl_shortconv_fwd(B.c, len, C, W, q + (size_t)i * len * C, cw, NULL, o + (size_t)i * len * C, NULL);
    });
    double cl = time_ms(B, [&] { mtrl_shortconv_fwd_varlen(B.c, n, offs.data(), C, W, q, cw, o); });
    row("short conv fwd per piece", shape, cp, 2.0 * nqk * sizeof(float), "GB/s", B.copy_tbps * 1e3);
    row("short conv fwd varlen", shape, cl, 2.0 * nqk * sizeof(float), "GB/s", B.copy_tbps * 1e3);
    printf("%-34s %-34s varlen / per piece time %.3f\n", "", "", cl / cp);
    // The backward over the same pack on the training form's tile states (the learner's): the
    // varlen op (mtrl_kda_chunk_bwd_varlen: four launches for the pack) against mtrl_kda_chunk_bwd
    // per piece; then the short conv's (mtrl_shortconv_bwd_varlen against mtrl_shortconv_bwd per
    // piece; dw accumulates across the repeats, as in the model).
    float *dout = rnd(B, nqk, -1, 1), *dq = (float *)mtrl_cuda_malloc(nqk * 4), *dk = (float *)mtrl_cuda_malloc(nqk * 4),
          *dv = (float *)mtrl_cuda_malloc(nqk * 4), *dg = (float *)mtrl_cuda_malloc(nqk * 4),
          *db = (float *)mtrl_cuda_malloc((size_t)T * H * 4), *dcw = rnd(B, (size_t)C * W, -0.5f, 0.5f);
    mtrl_kda_chunk_fwd_varlen(B.c, n, offs.data(), H, K, V, q, k, v, g, beta, NULL, NULL, St);
    mtrl_cuda_sync(B.c);
    double bp = time_ms(B, [&] {
        for (int i = 0; i < n; i++) {
            size_t x = (size_t)i * len, t = (size_t)i * ((len + 15) / 16), xk = x * H * K;
            mtrl_kda_chunk_bwd(B.c, len, H, K, V, q + xk, k + xk, v + xk, g + xk, beta + x * H, NULL, St + t * ns,
                               dout + xk, NULL, dq + xk, dk + xk, dv + xk, dg + xk, db + x * H, NULL);
        }
    });
    double bv = time_ms(B, [&] {
        mtrl_kda_chunk_bwd_varlen(B.c, n, offs.data(), H, K, V, q, k, v, g, beta, St, dout, dq, dk, dv, dg, db);
    });
    row("KDA bwd per piece (on S_tiles)", shape, bp, (double)T, "Mtok/s", 0);
    row("KDA bwd varlen (on S_tiles)", shape, bv, (double)T, "Mtok/s", 0);
    printf("%-34s %-34s varlen / per piece time %.3f\n", "", "", bv / bp);
    double cbp = time_ms(B, [&] {
        for (int i = 0; i < n; i++) {
            size_t x = (size_t)i * len * C;
            mtrl_shortconv_bwd(B.c, len, C, W, q + x, cw, NULL, dout + x, o + x, dcw, NULL);
        }
    });
    double cbv = time_ms(B, [&] { mtrl_shortconv_bwd_varlen(B.c, n, offs.data(), C, W, q, cw, dout, o, dcw); });
    row("short conv bwd per piece", shape, cbp, 3.0 * nqk * sizeof(float), "GB/s", B.copy_tbps * 1e3);
    row("short conv bwd varlen", shape, cbv, 3.0 * nqk * sizeof(float), "GB/s", B.copy_tbps * 1e3);
    printf("%-34s %-34s varlen / per piece time %.3f\n", "", "", cbv / cbp);
    mtrl_cuda_sync(B.c);
    float *bufs[] = {q, k, v, g, beta, o, St, cw, dout, dq, dk, dv, dg, db, dcw};
    for (float *b : bufs) mtrl_cuda_free(b);
}

// The varlen causal attention (mtrl_attn_causal_fwd_varlen / _bwd_varlen: one launch per kernel for
// n packed pieces of `len` tokens, each over its own keys) against mtrl_attn_causal_fwd / _bwd once
// per piece, the learner's naive MLA shape (Hk = H, Dk = d_n + d_r = 192, Dv = d_v = 128), with the
// options' default kernels (v3 on an H100 / H200). dk, dv accumulate across the repeats, as in
// the model. Work: the causal pairs of the pieces, 2 (Dk + Dv) FLOPs each per head forward, the
// backward counted as 2.5 forwards (bench_attn's convention).
void bench_attn_varlen(Bench &B, int n, int len, int H) {
    const int Dk = 192, Dv = 128, T = n * len, ldk = H * Dk, ldv = H * Dv;
    mtrl_bf16 *q = rnd_bf16(B, (size_t)T * H * Dk, -1, 1), *k = rnd_bf16(B, (size_t)T * ldk, -1, 1);
    mtrl_bf16 *v = rnd_bf16(B, (size_t)T * ldv, -1, 1), *dout = rnd_bf16(B, (size_t)T * H * Dv, -1, 1);
    float *o = (float *)mtrl_cuda_malloc((size_t)T * H * Dv * 4), *lse = (float *)mtrl_cuda_malloc((size_t)T * H * 4);
    float *dq = (float *)mtrl_cuda_malloc((size_t)T * H * Dk * 4), *dk = (float *)mtrl_cuda_malloc((size_t)T * ldk * 4);
    float *dv = (float *)mtrl_cuda_malloc((size_t)T * ldv * 4);
    CUDA_CHECK(cudaMemsetAsync(dk, 0, (size_t)T * ldk * 4, B.c->stream));
    CUDA_CHECK(cudaMemsetAsync(dv, 0, (size_t)T * ldv * 4, B.c->stream));
    std::vector<int> offs(n + 1);
    for (int i = 0; i <= n; i++) offs[i] = i * len;
    const float scale = 1.f / sqrtf((float)Dk);
    const int vf = mtrl_attn_causal_version(B.c, H, H, Dk, Dv, 0, 0), vb = mtrl_attn_causal_version(B.c, H, H, Dk, Dv, 0, 1);
    char shape[64], what[64];
    snprintf(shape, sizeof shape, "%d x %d H=%d Dk=192 Dv=128", n, len, H);
    const double fl = (double)n * len * (len + 1) * H * (Dk + Dv);  // causal pairs x 2 (Dk + Dv)
    double fp = time_ms(B, [&] {
        for (int i = 0; i < n; i++) {
            size_t x = (size_t)i * len;
            mtrl_attn_causal_fwd(B.c, len, len, H, H, Dk, Dv, scale, q + x * H * Dk, k + x * ldk, ldk, v + x * ldv, ldv,
                                 o + x * H * Dv, lse + x * H);
        }
    });
    double fv = time_ms(B, [&] {
        mtrl_attn_causal_fwd_varlen(B.c, n, offs.data(), NULL, H, H, Dk, Dv, scale, q, k, ldk, v, ldv, o, lse);
    });
    snprintf(what, sizeof what, "MLA attn fwd per piece (v%d)", vf);
    row(what, shape, fp, fl, "TFLOP/s", B.gemm_tflops);
    snprintf(what, sizeof what, "MLA attn fwd varlen (v%d)", vf);
    row(what, shape, fv, fl, "TFLOP/s", B.gemm_tflops);
    printf("%-34s %-34s varlen / per piece time %.3f\n", "", "", fv / fp);
    double bp = time_ms(B, [&] {
        for (int i = 0; i < n; i++) {
            size_t x = (size_t)i * len;
            mtrl_attn_causal_bwd(B.c, len, len, H, H, Dk, Dv, scale, q + x * H * Dk, k + x * ldk, ldk, v + x * ldv, ldv,
                                 o + x * H * Dv, lse + x * H, dout + x * H * Dv, dq + x * H * Dk, dk + x * ldk,
                                 dv + x * ldv);
        }
    });
    double bv = time_ms(B, [&] {
        mtrl_attn_causal_bwd_varlen(B.c, n, offs.data(), NULL, H, H, Dk, Dv, scale, q, k, ldk, v, ldv, o, lse, dout, dq,
                                    dk, dv);
    });
    snprintf(what, sizeof what, "MLA attn bwd per piece (v%d)", vb);
    row(what, shape, bp, 2.5 * fl, "TFLOP/s", B.gemm_tflops);
    snprintf(what, sizeof what, "MLA attn bwd varlen (v%d)", vb);
    row(what, shape, bv, 2.5 * fl, "TFLOP/s", B.gemm_tflops);
    printf("%-34s %-34s varlen / per piece time %.3f\n", "", "", bv / bp);
    mtrl_cuda_sync(B.c);
    void *bufs[] = {q, k, v, dout, o, lse, dq, dk, dv};
    for (void *b : bufs) mtrl_cuda_free(b);
}

// The piece_io forms (the actor's packed prefill: n pieces of `len` tokens, each continuing its own
// state and conv windows): mtrl_kda_chunk_fwd per piece from its S0 to its S_final (the launches
// the model ran before) against one mtrl_kda_chunk_fwd_varlen_io (the states updated in place, as
// the model calls it), o only (a prefill keeps no tile states); then the short conv per piece from
// its window against mtrl_shortconv_fwd_varlen_io.
void bench_varlen_io(Bench &B, int n, int len, int H) {
    const int K = 128, V = 128, T = n * len;
    size_t nqk = (size_t)T * H * K, ntl = (size_t)n * ((len + 15) / 16), ns = (size_t)H * K * V;
    float *q, *k, *v, *g, *beta;
    kda_inputs_(B, T, H, &q, &k, &v, &g, &beta);
    float *o = (float *)mtrl_cuda_malloc(nqk * 4);
    float *S = rnd(B, (size_t)n * ns, -0.1f, 0.1f), *Sf = (float *)mtrl_cuda_malloc((size_t)n * ns * 4);
    std::vector<int> offs(n + 1);
    for (int i = 0; i <= n; i++) offs[i] = i * len;
    std::vector<float *> sp(n);
    for (int i = 0; i < n; i++) sp[i] = S + (size_t)i * ns;
    mtrl_cuda_sync(B.c);
    char shape[64];
    snprintf(shape, sizeof shape, "%d x %d H=%d K=V=128", n, len, H);
    double flops = (double)ntl * H * (4.0 * 65536 + 3.0 * 524288 + 65536);  // bench_kda's nominal work
    double mp = time_ms(B, [&] {
        for (int i = 0; i < n; i++) {
            size_t x = (size_t)i * len;
            mtrl_kda_chunk_fwd(B.c, len, H, K, V, q + x * H * K, k + x * H * K, v + x * H * V, g + x * H * K,
                               beta + x * H, sp[i], o + x * H * V, Sf + (size_t)i * ns, NULL);
        }
    });
    // in place: every repeat advances the states again (the same work each time)
    double mv = time_ms(B, [&] {
        mtrl_kda_chunk_fwd_varlen_io(B.c, n, offs.data(), H, K, V, q, k, v, g, beta, (const float *const *)sp.data(),
                                     o, sp.data(), NULL);
    });
    row("KDA fwd per piece from S0 (o, Sf)", shape, mp, flops, "TFLOP/s", B.gemm_tflops);
    row("KDA fwd varlen_io (o, S in place)", shape, mv, flops, "TFLOP/s", B.gemm_tflops);
    printf("%-34s %-34s varlen_io / per piece time %.3f\n", "", "", mv / mp);
    const int C = H * K, W = 4;
    size_t nw = (size_t)(W - 1) * C;
    float *cw = rnd(B, (size_t)C * W, -0.5f, 0.5f), *win = rnd(B, (size_t)n * nw, -1, 1);
    std::vector<float *> wp(n);
    for (int i = 0; i < n; i++) wp[i] = win + (size_t)i * nw;
    double cp = time_ms(B, [&] {
        for (int i = 0; i < n; i++)
            mtrl_shortconv_fwd(B.c, len, C, W, q + (size_t)i * len * C, cw, wp[i], o + (size_t)i * len * C, wp[i]);
    });
    double cl = time_ms(B, [&] {
        mtrl_shortconv_fwd_varlen_io(B.c, n, offs.data(), C, W, q, cw, (const float *const *)wp.data(), wp.data(), o);
    });
    row("short conv fwd per piece (window)", shape, cp, 2.0 * nqk * sizeof(float), "GB/s", B.copy_tbps * 1e3);
    row("short conv fwd varlen_io", shape, cl, 2.0 * nqk * sizeof(float), "GB/s", B.copy_tbps * 1e3);
    printf("%-34s %-34s varlen_io / per piece time %.3f\n", "", "", cl / cp);
    mtrl_cuda_sync(B.c);
    float *bufs[] = {q, k, v, g, beta, o, S, Sf, cw, win};
    for (float *b : bufs) mtrl_cuda_free(b);
}

}  // namespace

extern "C" int mtrl_bench_ops_cuda(int argc, char **argv) {
    const char *only = "copy,gemm,kda,varlen,step,attn,decode,moe,ops";
    std::vector<int> kdaT = {8192, 65536, 262144}, attnT = {8192, 32768};
    int reps = 5, H = 16;
    const char *decode_shapes = "1x1048576,8x131072,64x32768,16x524288";  // MLA decode, B x Tk
    const char *anchors_path = nullptr;
    bool kda_fwd_only = false;
    const char *attn_shapes = "absorbed,mha,naive";
    int attn_v1 = 1;  // --attn-v1 0: no v1 pass (its backward takes minutes at 128K)
    int naive_heads = 8;  // --naive-heads: the naive MLA attention rows' heads (P4's anchors: 16)
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : nullptr;
        if (i == 1 && !strcmp(a, "ops")) continue;  // tolerate the sub-command word
        if (!strcmp(a, "--device")) { i++; continue; }
        if (!strcmp(a, "--only") && val) { only = val; i++; }
        else if (!strcmp(a, "--kda-T") && val) { kdaT = parse_list(val); i++; }
        else if (!strcmp(a, "--attn-T") && val) { attnT = parse_list(val); i++; }
        else if (!strcmp(a, "--attn-shapes") && val) { attn_shapes = val; i++; }
        else if (!strcmp(a, "--attn-v1") && val) { attn_v1 = atoi(val); i++; }
        else if (!strcmp(a, "--naive-heads") && val) { naive_heads = atoi(val); i++; }
        else if (!strcmp(a, "--reps") && val) { reps = atoi(val); i++; }
        else if (!strcmp(a, "--heads") && val) { H = atoi(val); i++; }
        else if (!strcmp(a, "--decode-shapes") && val) { decode_shapes = val; i++; }
        else if (!strcmp(a, "--anchors") && val) { anchors_path = val; i++; }
        else if (!strcmp(a, "--kda-fwd-only")) kda_fwd_only = true;
        else {
            fprintf(stderr, "usage: mtrl bench ops --device cuda [--only copy,gemm,kda,varlen,step,attn,decode,moe,ops] "
                            "[--kda-T 8192,65536] [--attn-T 8192,32768] [--attn-shapes absorbed,mha,naive] [--attn-v1 0|1] [--naive-heads 8] "
                            "[--heads 16] [--decode-shapes 1x1048576,8x131072] "
                            "[--reps N] [--anchors anchors.json] [--kda-fwd-only]\n");
            return 2;
        }
    }
    if (mtrl_cuda_device_count() <= 0) {
        fprintf(stderr, "mtrl bench ops: no CUDA device\n");
        return 77;
    }
    auto want = [&](const char *k) { return list_has(only, k); };
    Bench B;
    if (anchors_path) {
        // The anchors of the same machine and command (tools/gpu_bench.sh runs them first): each
        // kernel's row is followed by its ratio to the anchor.
        FILE *f = fopen(anchors_path, "rb");
        if (!f) {
            fprintf(stderr, "mtrl bench ops: --anchors %s: %s\n", anchors_path, strerror(errno));
            return 2;
        }
        char buf[4096];
        size_t n;
        while ((n = fread(buf, 1, sizeof buf, f)) > 0) B.anchors.append(buf, n);
        fclose(f);
        if (B.anchors.find('{') == std::string::npos) {
            fprintf(stderr, "mtrl bench ops: --anchors %s: not the JSON of anchors_gpu.py\n", anchors_path);
            return 2;
        }
    }
    B.c = mtrl_cuda_ctx_create(0, NULL);
    B.reps = reps < 1 ? 1 : reps;
    B.kda_fwd_only = kda_fwd_only;
    CUDA_CHECK(cudaEventCreate(&B.a));
    CUDA_CHECK(cudaEventCreate(&B.b));
    cudaDeviceProp p;
    CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
    time_t now = time(NULL);
    char when[64];
    strftime(when, sizeof when, "%Y-%m-%d %H:%M UTC", gmtime(&now));
    printf("mtrl bench ops --device cuda: %s, %d SMs, %.0f MB L2, CUDA runtime %d; %s; median of %d repeats\n",
           p.name, p.multiProcessorCount, p.l2CacheSize / 1e6, CUDART_VERSION, when, B.reps);
    printf("%-34s %-34s %13s %18s\n", "kernel", "shape", "time", "rate");
    if (want("copy") || want("gemm")) bench_ceilings(B);
    else
        printf("%-34s %-34s (ceilings not measured in this run: %.2f TB/s copy, %.0f TFLOP/s bf16 from "
               "docs/perf.md; add copy,gemm to --only to measure them)\n", "", "", B.copy_tbps, B.gemm_tflops);
    if (want("kda"))
        for (int T : kdaT) bench_kda(B, T, H);
    if (want("varlen")) {  // the learner's packs: R1's 512 x 128 and 64 x 1024
        bench_kda_varlen(B, 512, 128, H);
        bench_kda_varlen(B, 64, 1024, H);
        bench_attn_varlen(B, 512, 128, 8);  // the naive MLA attention at small's 8 heads
        bench_attn_varlen(B, 64, 1024, 8);
    }
    if (want("varlen")) {  // the actor's packed prefill: ~100 episodes' tool results, prompts
        bench_varlen_io(B, 100, 32, H);
        bench_varlen_io(B, 100, 256, H);
    }
    if (want("step")) {
        bench_kda_step(B, 64, H);
        bench_kda_step(B, 256, H);
    }
    if (want("attn")) {
        auto shape = [&](const char *k) { return list_has(attn_shapes, k); };
        for (int T : attnT) {
            if (shape("absorbed")) bench_attn(B, T, H, 1, attn_v1);
            if (shape("mha")) bench_attn(B, T, H, 0, attn_v1);
            if (shape("naive")) bench_attn(B, T, naive_heads, 2, attn_v1);  // naive MLA (default: small's 8 heads)
        }
    }
    if (want("decode"))
        for (const char *p = decode_shapes; p && *p;) {  // "BxT,BxT,..."
            int bb = atoi(p);
            const char *x = strchr(p, 'x');
            const char *cm = strchr(p, ',');
            int tt = x && (!cm || x < cm) ? atoi(x + 1) : 0;
            if (bb > 0 && tt > 0) bench_decode(B, bb, tt, H);
            p = cm ? cm + 1 : nullptr;
        }
    if (want("moe")) {
        bench_moe(B, 64, 8192, 2048, 1024);
        bench_moe_model(B);
        bench_moe_grouped(B, 64, 1024, 512, true);    // small: d 1024, expert width 512
        bench_moe_grouped(B, 64, 2048, 1024, false);  // the anchor's shape
    }
    if (want("ops")) bench_small_ops(B);
    CUDA_CHECK(cudaEventDestroy(B.a));
    CUDA_CHECK(cudaEventDestroy(B.b));
    mtrl_cuda_ctx_destroy(B.c);
    return 0;
}
