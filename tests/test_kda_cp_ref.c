// mtrl-test: cpu f64
// test_kda_cp_ref.c: the chunk-parallel decomposition of the KDA forward (kernels/ref/
// kda_cp_ref.h, the reference of kernels/cuda/kda/chunk_parallel.cu) against the sequential chunked
// forward (kda_chunk_fwd) and the token recurrence, in fp64, at every piece count from 1 to the
// tile count (and beyond: clamped): o, S_final and S_tiles within 1e-12 of the sequential form;
// bit for bit where the arithmetic is the same (every output at one piece; the tokens and tile
// states of piece 0 always, and of piece 1 when S0 = NULL). Slow decay (g in (−0.05, 0)) so that a
// piece's transition M_p carries the incoming state into the next pieces (checked: the last
// piece's outputs with S0 ≠ 0 differ from those with S0 = 0 by more than 1e-9, far above the
// agreement required, so a combine without M_p cannot pass), and the project's decay range
// (g in (−5, 0)). T with a partial last tile and T < 16. K != V, so a transposed K x K or K x V
// product cannot pass.
#include "common/rng.h"
#include "kernels/ref/kda_cp_ref.h"
#include "kernels/ref/kda_ref.h"
#include "tests/testhelp.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define H_ 2
#define K_ 8
#define V_ 6

static const uint64_t SEED = 2525;

typedef struct {
    int T;
    double *q, *k, *v, *g, *beta, *S0;
} cp_inputs;

// Rows of length n with unit L2 norm times `scale` (the layer normalises q and k).
static void cp_unit_rows(double *x, size_t rows, int n, uint64_t stream, double scale) {
    for (size_t r = 0; r < rows; r++) {
        double s2 = 0;
        for (int d = 0; d < n; d++) {
            x[r * n + d] = mtrl_rng_normal(SEED, stream, r * n + d);
            s2 += x[r * n + d] * x[r * n + d];
        }
        for (int d = 0; d < n; d++) x[r * n + d] *= scale / sqrt(s2);
    }
}

static cp_inputs cp_make(int T, double g_lo, uint64_t stream) {
    cp_inputs in = {T, NULL, NULL, NULL, NULL, NULL, NULL};
    size_t nk = (size_t)T * H_ * K_, nv = (size_t)T * H_ * V_;
    in.q = malloc(sizeof(double) * nk);
    in.k = malloc(sizeof(double) * nk);
    in.g = malloc(sizeof(double) * nk);
    in.v = malloc(sizeof(double) * nv);
    in.beta = malloc(sizeof(double) * (size_t)T * H_);
    in.S0 = malloc(sizeof(double) * H_ * K_ * V_);
    cp_unit_rows(in.q, (size_t)T * H_, K_, stream * 8 + 1, 1.0 / sqrt((double)K_));
    cp_unit_rows(in.k, (size_t)T * H_, K_, stream * 8 + 2, 1.0);
    for (size_t i = 0; i < nv; i++) in.v[i] = mtrl_rng_normal(SEED, stream * 8 + 3, i);
    for (size_t i = 0; i < nk; i++) in.g[i] = g_lo * (0.001 + 0.998 * mtrl_rng_uniform(SEED, stream * 8 + 4, i));
    for (size_t i = 0; i < (size_t)T * H_; i++) in.beta[i] = 0.02 + 0.96 * mtrl_rng_uniform(SEED, stream * 8 + 5, i);
    for (size_t i = 0; i < H_ * K_ * V_; i++) in.S0[i] = 0.5 * mtrl_rng_normal(SEED, stream * 8 + 6, i);
    return in;
}

static void cp_free(cp_inputs *in) {
    free(in->q); free(in->k); free(in->v); free(in->g); free(in->beta); free(in->S0);
}

typedef struct {
    double *o, *Sf, *St;
} cp_outputs;

static cp_outputs cp_alloc(int T) {
    int nt = mtrl_ref_kda_tile_count(T);
    cp_outputs r = {malloc(sizeof(double) * (size_t)T * H_ * V_), malloc(sizeof(double) * H_ * K_ * V_),
                    malloc(sizeof(double) * (size_t)nt * H_ * K_ * V_)};
    return r;
}
static void cp_outputs_free(cp_outputs *r) { free(r->o); free(r->Sf); free(r->St); }

static double worst_;

// One input set, both S0 cases, every piece count.
static void cp_case(int T, double g_lo, uint64_t stream) {
    cp_inputs in = cp_make(T, g_lo, stream);
    int nt = mtrl_ref_kda_tile_count(T);
    size_t KV = (size_t)K_ * V_, no = (size_t)T * H_ * V_, ns = (size_t)nt * H_ * KV;
    cp_outputs seq = cp_alloc(T), cp = cp_alloc(T), rec = cp_alloc(T), zero = cp_alloc(T);
    for (int with_s0 = 0; with_s0 < 2; with_s0++) {
        const double *S0 = with_s0 ? in.S0 : NULL;
        mtrl_ref_kda_chunk_fwd(T, H_, K_, V_, in.q, in.k, in.v, in.g, in.beta, S0, seq.o, seq.Sf, seq.St);
        mtrl_ref_kda_recurrent_fwd(T, H_, K_, V_, in.q, in.k, in.v, in.g, in.beta, S0, rec.o, rec.Sf, NULL);
        TEST_CHECKF(test_rel_err_d(seq.o, rec.o, no) < 1e-12, "T=%d: sequential chunked vs recurrence", T);
        int last = nt + 2;  // beyond the tile count: clamped to it
        for (int np = 1; np <= last; np++) {
            memset(cp.o, 0xff, sizeof(double) * no);  // NaN: every output must be written
            memset(cp.St, 0xff, sizeof(double) * ns);
            mtrl_ref_kda_chunk_fwd_cp(T, H_, K_, V_, in.q, in.k, in.v, in.g, in.beta, S0, cp.o, cp.Sf, cp.St, np);
            double eo = test_rel_err_d(cp.o, seq.o, no), ef = test_rel_err_d(cp.Sf, seq.Sf, H_ * KV),
                   et = test_rel_err_d(cp.St, seq.St, ns);
            double e = eo > ef ? eo : ef;
            e = e > et ? e : et;
            worst_ = e > worst_ ? e : worst_;
            TEST_CHECKF(e < 1e-12, "T=%d g>%g S0=%d pieces=%d: o %.2e S_final %.2e S_tiles %.2e", T, g_lo,
                        with_s0, np, eo, ef, et);
            TEST_CHECKF(test_rel_err_d(cp.o, rec.o, no) < 1e-12, "T=%d pieces=%d: vs recurrence", T, np);
            int pe = np < nt ? np : nt;
            // bit for bit: everything at one piece; piece 0 always; piece 1 too with S0 = NULL
            int exact_tiles = pe == 1 ? nt : mtrl_ref_kda_cp_bound(nt, with_s0 ? 1 : 2, pe);
            int exact_tok = exact_tiles * KDA_TILE < T ? exact_tiles * KDA_TILE : T;
            TEST_CHECKF(memcmp(cp.o, seq.o, sizeof(double) * exact_tok * H_ * V_) == 0,
                        "T=%d S0=%d pieces=%d: o of the first %d tokens bit for bit", T, with_s0, np, exact_tok);
            TEST_CHECKF(memcmp(cp.St, seq.St, sizeof(double) * exact_tiles * H_ * KV) == 0,
                        "T=%d S0=%d pieces=%d: S_tiles of the first %d tiles bit for bit", T, with_s0, np,
                        exact_tiles);
            if (pe == 1) TEST_CHECK(memcmp(cp.Sf, seq.Sf, sizeof(double) * H_ * KV) == 0);
            if (with_s0 && pe >= 2 && g_lo > -0.1) {
                // the incoming state reached the last piece through the transitions, by far more
                // than the 1e-12 agreement above (which therefore needs M_p)
                mtrl_ref_kda_chunk_fwd_cp(T, H_, K_, V_, in.q, in.k, in.v, in.g, in.beta, NULL, zero.o, zero.Sf, NULL, np);
                size_t t0 = (size_t)KDA_TILE * mtrl_ref_kda_cp_bound(nt, pe - 1, pe);
                double d = test_rel_err_d(cp.o + t0 * H_ * V_, zero.o + t0 * H_ * V_, (T - t0) * H_ * V_);
                TEST_CHECKF(d > 1e-9, "T=%d pieces=%d: S0 changes the last piece by only %.2e", T, np, d);
            }
        }
    }
    cp_outputs_free(&seq); cp_outputs_free(&cp); cp_outputs_free(&rec); cp_outputs_free(&zero);
    cp_free(&in);
}

int main(void) {
    const int Ts[] = {1, 15, 16, 17, 64, 100, 163};
    for (size_t i = 0; i < sizeof Ts / sizeof Ts[0]; i++) {
        cp_case(Ts[i], -0.05, 2 * i);
        cp_case(Ts[i], -5.0, 2 * i + 1);
    }
    printf("chunk-parallel vs sequential, worst of o / S_final / S_tiles: %.2e\n", worst_);
    return test_report();
}
