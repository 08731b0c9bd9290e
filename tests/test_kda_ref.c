// mtrl-test: cpu f64
// test_kda_ref.c: the KDA reference in fp64 against itself three ways (docs/model.md §8).
//   I1  chunked (16-tiles; midpoint/start reference; FSUB/nilpotent T; c < 16 and padded
//       tails; zero and random S0; random g and g ≡ g_min + 1e-3) == token recurrence, 1e-12
//   I2  chunk backward == BPTT (1e-12) == central finite differences for q, k, v, g, β, S0 and,
//       through the gate, f, A_log, dt_bias
//   I5  T by forward substitution == nilpotent product, (I + M) T = I
//   I7  16-tiles == 64-token super-chunks, forward and backward
//   unbounded decay (Kimi's gate, g down to -60): chunked (the token recurrence on chunks
//       below -11) == recurrence forward and backward; FD through kda_gate_kimi_*, exact and
//       clamped
//   plus: kda_step over a sequence == recurrence, prefill (chunked) then decode (step) == full
//   recurrence at splits 1, 15, 16, 17, S_tiles == recurrence states, T = 0 is a no-op;
//   packed pieces (the varlen forward and backward) == each piece alone.
// K != V on purpose, so a transposed K x V product cannot pass.
#include "common/rng.h"
#include "kernels/ref/kda_ref.h"
#include "tests/testhelp.h"

#define G_MIN (-5.0)
#define H_ 2
#define K_ 8
#define V_ 6

typedef struct {
    int T;
    double *q, *k, *v, *g, *beta, *S0;
} inputs;

static uint64_t g_seed = 1234;

static void fill_normal(double *x, size_t n, uint64_t stream, double scale) {
    for (size_t i = 0; i < n; i++) x[i] = scale * mtrl_rng_normal(g_seed, stream, i);
}

// Random L2-normalised rows of length K (scaled by `scale`), as the layer produces q and k.
static void fill_unit_rows(double *x, size_t rows, int K, uint64_t stream, double scale) {
    fill_normal(x, rows * K, stream, 1.0);
    for (size_t r = 0; r < rows; r++) {
        double n2 = 0;
        for (int d = 0; d < K; d++) n2 += x[r * K + d] * x[r * K + d];
        double s = scale / sqrt(n2 + 1e-6);
        for (int d = 0; d < K; d++) x[r * K + d] *= s;
    }
}

enum { G_RANDOM, G_EXTREME };

static inputs make_inputs(int T, int gmode, uint64_t stream) {
    inputs in;
    in.T = T;
    size_t nk = (size_t)(T > 0 ? T : 1) * H_ * K_, nv = (size_t)(T > 0 ? T : 1) * H_ * V_;
    in.q = malloc(sizeof(double) * nk);
    in.k = malloc(sizeof(double) * nk);
    in.g = malloc(sizeof(double) * nk);
    in.v = malloc(sizeof(double) * nv);
    in.beta = malloc(sizeof(double) * (size_t)(T > 0 ? T : 1) * H_);
    in.S0 = malloc(sizeof(double) * H_ * K_ * V_);
    fill_unit_rows(in.q, (size_t)T * H_, K_, stream * 16 + 1, 1.0 / sqrt((double)K_));
    fill_unit_rows(in.k, (size_t)T * H_, K_, stream * 16 + 2, 1.0);
    fill_normal(in.v, (size_t)T * H_ * V_, stream * 16 + 3, 1.0);
    for (size_t i = 0; i < (size_t)T * H_ * K_; i++)
        in.g[i] = gmode == G_EXTREME ? G_MIN + 1e-3
                                     : G_MIN * (0.001 + 0.998 * mtrl_rng_uniform(g_seed, stream * 16 + 4, i));
    for (size_t i = 0; i < (size_t)T * H_; i++)
        in.beta[i] = 0.02 + 0.96 * mtrl_rng_uniform(g_seed, stream * 16 + 5, i);
    fill_normal(in.S0, H_ * K_ * V_, stream * 16 + 6, 0.5);
    return in;
}

static void free_inputs(inputs *in) {
    free(in->q); free(in->k); free(in->v); free(in->g); free(in->beta); free(in->S0);
}

static double rel(const double *a, const double *b, size_t n) { return test_rel_err_d(a, b, n); }
static double maxd(double a, double b) { return a > b ? a : b; }

// ---- I1 -----------------------------------------------------------------------------------

static void test_i1(void) {
    const int Ts[] = {1, 15, 16, 17, 40, 69};
    double worst[2][2] = {{0}};  // [gmode][ref]
    int runs = 0;
    for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++)
        for (int gmode = 0; gmode < 2; gmode++) {
            int T = Ts[ti];
            inputs in = make_inputs(T, gmode, 10 + ti * 2 + gmode);
            size_t KV = (size_t)K_ * V_;
            double *o_ref = malloc(sizeof(double) * T * H_ * V_), *o = malloc(sizeof(double) * T * H_ * V_);
            double *S_all = malloc(sizeof(double) * (T + 1) * H_ * KV);
            double Sf_ref[H_ * K_ * V_], Sf[H_ * K_ * V_];
            double *S_tiles = malloc(sizeof(double) * mtrl_ref_kda_tile_count(T) * H_ * KV);
            for (int with_s0 = 0; with_s0 < 2; with_s0++) {
                const double *S0 = with_s0 ? in.S0 : NULL;
                mtrl_ref_kda_recurrent_fwd(T, H_, K_, V_, in.q, in.k, in.v, in.g, in.beta, S0, o_ref, Sf_ref, S_all);
                for (int ref = 0; ref < 2; ref++)
                    for (int solve = 0; solve < 2; solve++)
                        for (int pad = 0; pad < 2; pad++) {
                            kda_chunk_opts op = {.ref = ref, .solve = solve, .pad_tail = pad};
                            mtrl_ref_kda_chunk_fwd_ex(T, H_, K_, V_, in.q, in.k, in.v, in.g, in.beta, S0, o, Sf, S_tiles, &op);
                            double eo = rel(o, o_ref, (size_t)T * H_ * V_);
                            double es = rel(Sf, Sf_ref, (size_t)H_ * KV);
                            // The stored incoming state of tile n is S_{16 n} of the recurrence.
                            double et = 0;
                            for (int n = 0; n < mtrl_ref_kda_tile_count(T); n++)
                                et = maxd(et, rel(S_tiles + (size_t)n * H_ * KV, S_all + (size_t)n * 16 * H_ * KV, H_ * KV));
                            if (!with_s0 && T <= 16) et = 0;  // S_0 = 0: relative error undefined
                            TEST_CHECKF(eo <= 1e-12 && es <= 1e-12 && et <= 1e-12,
                                        "T=%d g=%d S0=%d ref=%d solve=%d pad=%d: o %.2e S' %.2e tiles %.2e",
                                        T, gmode, with_s0, ref, solve, pad, eo, es, et);
                            worst[gmode][ref] = maxd(worst[gmode][ref], maxd(eo, es));
                            runs++;
                        }
            }
            // The default entry point is the midpoint / forward-substitution / c < 16 path.
            mtrl_ref_kda_chunk_fwd(T, H_, K_, V_, in.q, in.k, in.v, in.g, in.beta, in.S0, o, Sf, NULL);
            mtrl_ref_kda_recurrent_fwd(T, H_, K_, V_, in.q, in.k, in.v, in.g, in.beta, in.S0, o_ref, Sf_ref, NULL);
            TEST_CHECK(rel(o, o_ref, (size_t)T * H_ * V_) <= 1e-12);
            free(o_ref); free(o); free(S_all); free(S_tiles);
            free_inputs(&in);
        }
    printf("I1 chunk == recurrence, %d runs, worst rel err (o, S'): random g mid %.2e start %.2e; "
           "g=g_min+1e-3 mid %.2e start %.2e\n", runs, worst[0][0], worst[0][1], worst[1][0], worst[1][1]);
}

// ---- I2 -----------------------------------------------------------------------------------

// L = Σ dout ⊙ o + Σ dSf ⊙ S_final through the chunked forward.
static double loss_chunk(const inputs *in, const double *dout, const double *dSf, const kda_chunk_opts *op) {
    int T = in->T;
    double *o = malloc(sizeof(double) * T * H_ * V_), Sf[H_ * K_ * V_];
    mtrl_ref_kda_chunk_fwd_ex(T, H_, K_, V_, in->q, in->k, in->v, in->g, in->beta, in->S0, o, Sf, NULL, op);
    double L = 0;
    for (size_t i = 0; i < (size_t)T * H_ * V_; i++) L += dout[i] * o[i];
    for (size_t i = 0; i < H_ * K_ * V_; i++) L += dSf[i] * Sf[i];
    free(o);
    return L;
}

// Central differences of loss_chunk over every entry of x; returns ||fd − an|| / ||an||.
static double fd_check(inputs *in, double *x, size_t n, const double *an, const double *dout,
                       const double *dSf, const kda_chunk_opts *op) {
    const double h = 1e-5;
    double *fd = malloc(sizeof(double) * n);
    for (size_t i = 0; i < n; i++) {
        double x0 = x[i];
        x[i] = x0 + h;
        double lp = loss_chunk(in, dout, dSf, op);
        x[i] = x0 - h;
        double lm = loss_chunk(in, dout, dSf, op);
        x[i] = x0;
        fd[i] = (lp - lm) / (2 * h);
    }
    double e = rel(fd, an, n);
    free(fd);
    return e;
}

typedef struct {
    double *dq, *dk, *dv, *dg, *db, *dS0;
} grads;

static grads grads_alloc(int T) {
    grads g;
    g.dq = malloc(sizeof(double) * T * H_ * K_);
    g.dk = malloc(sizeof(double) * T * H_ * K_);
    g.dg = malloc(sizeof(double) * T * H_ * K_);
    g.dv = malloc(sizeof(double) * T * H_ * V_);
    g.db = malloc(sizeof(double) * T * H_);
    g.dS0 = malloc(sizeof(double) * H_ * K_ * V_);
    return g;
}
static void grads_free(grads *g) { free(g->dq); free(g->dk); free(g->dv); free(g->dg); free(g->db); free(g->dS0); }

// Largest relative error over the six gradient arrays.
static double grads_rel(const grads *a, const grads *b, int T) {
    double e = rel(a->dq, b->dq, (size_t)T * H_ * K_);
    e = maxd(e, rel(a->dk, b->dk, (size_t)T * H_ * K_));
    e = maxd(e, rel(a->dg, b->dg, (size_t)T * H_ * K_));
    e = maxd(e, rel(a->dv, b->dv, (size_t)T * H_ * V_));
    e = maxd(e, rel(a->db, b->db, (size_t)T * H_));
    e = maxd(e, rel(a->dS0, b->dS0, (size_t)H_ * K_ * V_));
    return e;
}

static void chunk_bwd(const inputs *in, const double *dout, const double *dSf, const kda_chunk_opts *op,
                      int store_tiles, grads *gr) {
    int T = in->T;
    double *St = NULL;
    if (store_tiles) {
        St = malloc(sizeof(double) * mtrl_ref_kda_chunk_state_count(T, op) * H_ * K_ * V_);
        double *o = malloc(sizeof(double) * T * H_ * V_);
        mtrl_ref_kda_chunk_fwd_ex(T, H_, K_, V_, in->q, in->k, in->v, in->g, in->beta, in->S0, o, NULL, St, op);
        free(o);
    }
    mtrl_ref_kda_chunk_bwd_ex(T, H_, K_, V_, in->q, in->k, in->v, in->g, in->beta, in->S0, St, dout, dSf,
                     gr->dq, gr->dk, gr->dv, gr->dg, gr->db, gr->dS0, op);
    free(St);
}

static void bptt(const inputs *in, const double *dout, const double *dSf, grads *gr) {
    int T = in->T;
    double *S_all = malloc(sizeof(double) * (T + 1) * H_ * K_ * V_), *o = malloc(sizeof(double) * T * H_ * V_);
    mtrl_ref_kda_recurrent_fwd(T, H_, K_, V_, in->q, in->k, in->v, in->g, in->beta, in->S0, o, NULL, S_all);
    mtrl_ref_kda_recurrent_bwd(T, H_, K_, V_, in->q, in->k, in->v, in->g, in->beta, S_all, dout, dSf,
                      gr->dq, gr->dk, gr->dv, gr->dg, gr->db, gr->dS0);
    free(S_all); free(o);
}

static void test_i2(void) {
    // BPTT == chunk backward across tails, decays, options (cheap), then FD on one case each.
    const int Ts[] = {1, 15, 16, 17, 37};
    double worst_bptt = 0;
    for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++)
        for (int gmode = 0; gmode < 2; gmode++) {
            int T = Ts[ti];
            inputs in = make_inputs(T, gmode, 100 + ti * 2 + gmode);
            double *dout = malloc(sizeof(double) * T * H_ * V_), dSf[H_ * K_ * V_];
            fill_normal(dout, (size_t)T * H_ * V_, 900 + ti, 1.0);
            fill_normal(dSf, H_ * K_ * V_, 950 + ti, 1.0);
            grads gb = grads_alloc(T), gc = grads_alloc(T);
            bptt(&in, dout, dSf, &gb);
            for (int ref = 0; ref < 2; ref++)
                for (int pad = 0; pad < 2; pad++)
                    for (int store = 0; store < 2; store++) {
                        kda_chunk_opts op = {.ref = ref, .pad_tail = pad, .solve = store};
                        chunk_bwd(&in, dout, dSf, &op, store, &gc);
                        double e = grads_rel(&gc, &gb, T);
                        TEST_CHECKF(e <= 1e-12, "T=%d g=%d ref=%d pad=%d store=%d: chunk bwd vs BPTT %.2e",
                                    T, gmode, ref, pad, store, e);
                        worst_bptt = maxd(worst_bptt, e);
                    }
            // dS_final = NULL means zero.
            double zero[H_ * K_ * V_] = {0};
            bptt(&in, dout, zero, &gb);
            mtrl_ref_kda_chunk_bwd(T, H_, K_, V_, in.q, in.k, in.v, in.g, in.beta, in.S0, NULL, dout, NULL,
                          gc.dq, gc.dk, gc.dv, gc.dg, gc.db, gc.dS0);
            TEST_CHECK(grads_rel(&gc, &gb, T) <= 1e-12);
            grads_free(&gb); grads_free(&gc); free(dout);
            free_inputs(&in);
        }
    printf("I2 chunk bwd == BPTT: worst rel err %.2e\n", worst_bptt);

    // Finite differences: every entry of every input, midpoint and start references.
    for (int ref = 0; ref < 2; ref++) {
        int T = 21;
        inputs in = make_inputs(T, G_RANDOM, 300 + ref);
        double *dout = malloc(sizeof(double) * T * H_ * V_), dSf[H_ * K_ * V_];
        fill_normal(dout, (size_t)T * H_ * V_, 960 + ref, 1.0);
        fill_normal(dSf, H_ * K_ * V_, 970 + ref, 1.0);
        kda_chunk_opts op = {.ref = ref};
        grads gc = grads_alloc(T);
        chunk_bwd(&in, dout, dSf, &op, 0, &gc);
        double e[6];
        e[0] = fd_check(&in, in.q, (size_t)T * H_ * K_, gc.dq, dout, dSf, &op);
        e[1] = fd_check(&in, in.k, (size_t)T * H_ * K_, gc.dk, dout, dSf, &op);
        e[2] = fd_check(&in, in.v, (size_t)T * H_ * V_, gc.dv, dout, dSf, &op);
        e[3] = fd_check(&in, in.g, (size_t)T * H_ * K_, gc.dg, dout, dSf, &op);
        e[4] = fd_check(&in, in.beta, (size_t)T * H_, gc.db, dout, dSf, &op);
        e[5] = fd_check(&in, in.S0, (size_t)H_ * K_ * V_, gc.dS0, dout, dSf, &op);
        const char *nm[6] = {"q", "k", "v", "g", "beta", "S0"};
        printf("I2 FD (ref=%s, T=%d): ", ref ? "start" : "mid", T);
        for (int i = 0; i < 6; i++) {
            printf("%s %.1e%s", nm[i], e[i], i < 5 ? ", " : "\n");
            TEST_CHECKF(e[i] <= 1e-8, "FD %s ref=%d: rel err %.2e", nm[i], ref, e[i]);
        }
        grads_free(&gc); free(dout);
        free_inputs(&in);
    }
}

// Through the gate: f, A_log, dt_bias -> g -> chunk -> L.
static double loss_gate(inputs *in, const double *f, const double *A_log, const double *dtb,
                        const double *dout, const double *dSf) {
    mtrl_ref_kda_gate_fwd(in->T, H_, K_, f, A_log, dtb, G_MIN, in->g);
    return loss_chunk(in, dout, dSf, NULL);
}

static void test_gate(void) {
    int T = 19;
    inputs in = make_inputs(T, G_RANDOM, 400);
    size_t nf = (size_t)T * H_ * K_;
    double *f = malloc(sizeof(double) * nf), A_log[H_], dtb[H_ * K_];
    fill_normal(f, nf, 401, 1.0);
    fill_normal(A_log, H_, 402, 0.5);
    fill_normal(dtb, H_ * K_, 403, 1.0);
    double *dout = malloc(sizeof(double) * T * H_ * V_), dSf[H_ * K_ * V_];
    fill_normal(dout, (size_t)T * H_ * V_, 404, 1.0);
    fill_normal(dSf, H_ * K_ * V_, 405, 1.0);

    // The gate lands strictly inside (g_min, 0).
    mtrl_ref_kda_gate_fwd(T, H_, K_, f, A_log, dtb, G_MIN, in.g);
    int inside = 1;
    for (size_t i = 0; i < nf; i++) inside &= in.g[i] > G_MIN && in.g[i] < 0;
    TEST_CHECK(inside);

    grads gc = grads_alloc(T);
    chunk_bwd(&in, dout, dSf, NULL, 0, &gc);
    double *df = malloc(sizeof(double) * nf), dA[H_], ddtb[H_ * K_];
    // Accumulation contract: dA_log and ddt_bias are +=; start them at 1 and subtract after.
    for (int h = 0; h < H_; h++) dA[h] = 1.0;
    for (int i = 0; i < H_ * K_; i++) ddtb[i] = 1.0;
    mtrl_ref_kda_gate_bwd(T, H_, K_, f, A_log, dtb, G_MIN, gc.dg, df, dA, ddtb);
    for (int h = 0; h < H_; h++) dA[h] -= 1.0;
    for (int i = 0; i < H_ * K_; i++) ddtb[i] -= 1.0;

    const double h = 1e-5;
    double *fd = malloc(sizeof(double) * nf);
    double *xs[3] = {f, A_log, dtb}, *an[3] = {df, dA, ddtb};
    size_t ns[3] = {nf, H_, H_ * K_};
    const char *nm[3] = {"f", "A_log", "dt_bias"};
    printf("I2 FD through the gate:");
    for (int a = 0; a < 3; a++) {
        for (size_t i = 0; i < ns[a]; i++) {
            double x0 = xs[a][i];
            xs[a][i] = x0 + h;
            double lp = loss_gate(&in, f, A_log, dtb, dout, dSf);
            xs[a][i] = x0 - h;
            double lm = loss_gate(&in, f, A_log, dtb, dout, dSf);
            xs[a][i] = x0;
            fd[i] = (lp - lm) / (2 * h);
        }
        double e = rel(fd, an[a], ns[a]);
        printf(" %s %.1e", nm[a], e);
        TEST_CHECKF(e <= 1e-8, "gate FD %s: rel err %.2e", nm[a], e);
    }
    printf("\n");
    free(fd); free(df); free(f); free(dout);
    grads_free(&gc);
    free_inputs(&in);
}

// ---- unbounded decay (Kimi Linear's gate) ------------------------------------------------------

// g of every (16-token tile, head) with (tile + head) odd far below the factored chunk form's
// range (down to −60, KDA_G_CHUNK_MIN = −11), the others in (g_min, 0): the chunked form runs
// the token recurrence on the first and the factored form on the second, and must equal the
// recurrence everywhere, forward and backward, with 16- and 64-token chunks.
static void unbounded_g_(inputs *in, uint64_t stream) {
    for (int t = 0; t < in->T; t++)
        for (int h = 0; h < H_; h++)
            for (int d = 0; d < K_; d++) {
                size_t i = ((size_t)t * H_ + h) * K_ + d;
                double u = mtrl_rng_uniform(g_seed, stream, i);
                in->g[i] = ((t / 16 + h) % 2) ? -(0.5 + 59.5 * u) : G_MIN * (0.001 + 0.998 * u);
            }
}

// Kimi's gate g = −e^{A_log} softplus(f + dt_bias) through the chunk: FD of f, A_log, dt_bias.
static double loss_gate_kimi(inputs *in, const double *f, const double *A_log, const double *dtb,
                             const double *dout, const double *dSf, double floor_) {
    mtrl_ref_kda_gate_kimi_fwd(in->T, H_, K_, f, A_log, dtb, floor_, in->g);
    return loss_chunk(in, dout, dSf, NULL);
}

static void test_unbounded(void) {
    const int Ts[] = {17, 37, 70};
    double worst_f = 0, worst_b = 0;
    for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
        int T = Ts[ti];
        inputs in = make_inputs(T, G_RANDOM, 500 + ti);
        unbounded_g_(&in, 510 + ti);
        size_t KV = (size_t)K_ * V_;
        double *o_ref = malloc(sizeof(double) * T * H_ * V_), *o = malloc(sizeof(double) * T * H_ * V_);
        double Sf_ref[H_ * K_ * V_], Sf[H_ * K_ * V_];
        double *dout = malloc(sizeof(double) * T * H_ * V_), dSf[H_ * K_ * V_];
        fill_normal(dout, (size_t)T * H_ * V_, 520 + ti, 1.0);
        fill_normal(dSf, H_ * K_ * V_, 530 + ti, 1.0);
        mtrl_ref_kda_recurrent_fwd(T, H_, K_, V_, in.q, in.k, in.v, in.g, in.beta, in.S0, o_ref, Sf_ref, NULL);
        grads gb = grads_alloc(T), gc = grads_alloc(T);
        bptt(&in, dout, dSf, &gb);
        for (int chunk = 16; chunk <= 64; chunk *= 4)
            for (int store = 0; store < 2; store++) {
                kda_chunk_opts op = {.chunk = chunk};
                mtrl_ref_kda_chunk_fwd_ex(T, H_, K_, V_, in.q, in.k, in.v, in.g, in.beta, in.S0, o, Sf, NULL, &op);
                double ef = maxd(rel(o, o_ref, (size_t)T * H_ * V_), rel(Sf, Sf_ref, H_ * KV));
                chunk_bwd(&in, dout, dSf, &op, store, &gc);
                double eb = grads_rel(&gc, &gb, T);
                TEST_CHECKF(ef <= 1e-12 && eb <= 1e-12, "unbounded g, T=%d chunk=%d store=%d: fwd %.2e bwd %.2e", T,
                            chunk, store, ef, eb);
                worst_f = maxd(worst_f, ef);
                worst_b = maxd(worst_b, eb);
            }
        grads_free(&gb); grads_free(&gc);
        free(o_ref); free(o); free(dout);
        free_inputs(&in);
    }
    printf("unbounded g (down to -60): chunk == recurrence, worst rel err fwd %.2e, bwd %.2e\n", worst_f, worst_b);

    // FD through Kimi's gate and the chunk, exact (no floor) and clamped at -3 (the GPU's form:
    // clamped entries get no gradient). A_log around log 8 and dt_bias around 1: g reaches ~ -20.
    for (int clamp = 0; clamp < 2; clamp++) {
        int T = 21;
        double floor_ = clamp ? -3.0 : -INFINITY;
        inputs in = make_inputs(T, G_RANDOM, 540 + clamp);
        size_t nf = (size_t)T * H_ * K_;
        double *f = malloc(sizeof(double) * nf), A_log[H_], dtb[H_ * K_];
        fill_normal(f, nf, 541, 1.0);
        fill_normal(A_log, H_, 542, 0.3);
        A_log[0] += log(8.0);
        fill_normal(dtb, H_ * K_, 543, 0.5);
        for (int i = 0; i < K_; i++) dtb[i] += 1.0;
        double *dout = malloc(sizeof(double) * T * H_ * V_), dSf[H_ * K_ * V_];
        fill_normal(dout, (size_t)T * H_ * V_, 544, 1.0);
        fill_normal(dSf, H_ * K_ * V_, 545, 1.0);
        mtrl_ref_kda_gate_kimi_fwd(T, H_, K_, f, A_log, dtb, floor_, in.g);
        double gmin = 0;
        int clamped = 0, below = 0;
        for (size_t i = 0; i < nf; i++) {
            gmin = in.g[i] < gmin ? in.g[i] : gmin;
            clamped += in.g[i] == floor_;
            below += in.g[i] < KDA_G_CHUNK_MIN;
        }
        if (clamp) TEST_CHECKF(clamped > 0 && gmin == floor_, "the floor clamped nothing (min g %.3g)", gmin);
        else TEST_CHECKF(below > 0, "no g below the chunk range (min g %.3g)", gmin);
        grads gc = grads_alloc(T);
        chunk_bwd(&in, dout, dSf, NULL, 0, &gc);
        double *df = malloc(sizeof(double) * nf), dA[H_] = {0}, ddtb[H_ * K_] = {0};
        mtrl_ref_kda_gate_kimi_bwd(T, H_, K_, f, A_log, dtb, floor_, gc.dg, df, dA, ddtb);
        const double h = 1e-6;
        double *fd = malloc(sizeof(double) * nf);
        double *xs[3] = {f, A_log, dtb}, *an[3] = {df, dA, ddtb};
        size_t ns[3] = {nf, H_, H_ * K_};
        const char *nm[3] = {"f", "A_log", "dt_bias"};
        printf("FD through the Kimi gate (%s, min g %.3g):", clamp ? "clamped at -3" : "exact", gmin);
        for (int a = 0; a < 3; a++) {
            for (size_t i = 0; i < ns[a]; i++) {
                double x0 = xs[a][i];
                xs[a][i] = x0 + h;
                double lp = loss_gate_kimi(&in, f, A_log, dtb, dout, dSf, floor_);
                xs[a][i] = x0 - h;
                double lm = loss_gate_kimi(&in, f, A_log, dtb, dout, dSf, floor_);
                xs[a][i] = x0;
                fd[i] = (lp - lm) / (2 * h);
            }
            double e = rel(fd, an[a], ns[a]);
            printf(" %s %.1e", nm[a], e);
            TEST_CHECKF(e <= 1e-7, "Kimi gate FD %s (clamp %d): rel err %.2e", nm[a], clamp, e);
        }
        printf("\n");
        free(fd); free(df); free(f); free(dout);
        grads_free(&gc);
        free_inputs(&in);
    }
}

// ---- I5 -----------------------------------------------------------------------------------

static void test_i5(void) {
    double worst_eq = 0, worst_inv = 0;
    const int cs[] = {1, 2, 5, 9, 16};
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++)
        for (int kind = 0; kind < 2; kind++) {
            int c = cs[ci];
            double M[16 * 16] = {0}, T1[16 * 16], T2[16 * 16];
            if (kind == 0) {
                // M of a real tile: M_ij = β_i Σ_d k_id k_jd e^{G_id − G_jd}, i > j.
                inputs in = make_inputs(c, G_RANDOM, 500 + ci);
                double G[16 * K_];
                for (int d = 0; d < K_; d++) {
                    double acc = 0;
                    for (int r = 0; r < c; r++) { acc += in.g[(size_t)r * H_ * K_ + d]; G[r * K_ + d] = acc; }
                }
                for (int i = 0; i < c; i++)
                    for (int j = 0; j < i; j++) {
                        double s = 0;
                        for (int d = 0; d < K_; d++)
                            s += in.k[(size_t)i * H_ * K_ + d] * in.k[(size_t)j * H_ * K_ + d] * exp(G[i * K_ + d] - G[j * K_ + d]);
                        M[i * 16 + j] = in.beta[(size_t)i * H_] * s;
                    }
                free_inputs(&in);
            } else {
                // A harder M: dense strictly lower random entries of size ~0.5.
                for (int i = 0; i < c; i++)
                    for (int j = 0; j < i; j++) M[i * 16 + j] = 0.5 * mtrl_rng_normal(g_seed, 550 + ci, (uint64_t)(i * 16 + j));
            }
            mtrl_ref_kda_ut_solve(c, M, 16, T1, 16, KDA_SOLVE_FSUB);
            mtrl_ref_kda_ut_solve(c, M, 16, T2, 16, KDA_SOLVE_NILPOTENT);
            double num = 0, den = 0, inv = 0;
            int tri = 1;
            for (int i = 0; i < c; i++)
                for (int j = 0; j < c; j++) {
                    num += (T1[i * 16 + j] - T2[i * 16 + j]) * (T1[i * 16 + j] - T2[i * 16 + j]);
                    den += T1[i * 16 + j] * T1[i * 16 + j];
                    if (j > i) tri &= T1[i * 16 + j] == 0 && T2[i * 16 + j] == 0;
                    if (j == i) tri &= T1[i * 16 + j] == 1 && T2[i * 16 + j] == 1;
                    for (int which = 0; which < 2; which++) {
                        const double *Tm = which ? T2 : T1;
                        double s = Tm[i * 16 + j];  // ((I + M) T)_ij
                        for (int l = 0; l < c; l++) s += M[i * 16 + l] * Tm[l * 16 + j];
                        inv = maxd(inv, fabs(s - (i == j)));
                    }
                }
            double eq = sqrt(num / den);
            TEST_CHECKF(tri, "c=%d kind=%d: T not unit lower triangular", c, kind);
            TEST_CHECKF(eq <= 1e-13 && inv <= 1e-12, "c=%d kind=%d: fsub vs nilpotent %.2e, |(I+M)T - I| %.2e",
                        c, kind, eq, inv);
            worst_eq = maxd(worst_eq, eq);
            worst_inv = maxd(worst_inv, inv);
        }
    printf("I5 fsub vs nilpotent rel %.2e, max |(I+M)T - I| %.2e\n", worst_eq, worst_inv);
}

// ---- I7 -----------------------------------------------------------------------------------

static void test_i7(void) {
    const int Ts[] = {16, 64, 69, 100, 130};
    double worst_f = 0, worst_b = 0, worst_rec = 0;
    for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++)
        for (int gmode = 0; gmode < 2; gmode++) {
            int T = Ts[ti];
            inputs in = make_inputs(T, gmode, 600 + ti * 2 + gmode);
            size_t no = (size_t)T * H_ * V_;
            double *o16 = malloc(sizeof(double) * no), *o64 = malloc(sizeof(double) * no), *orec = malloc(sizeof(double) * no);
            double S16[H_ * K_ * V_], S64[H_ * K_ * V_], Srec[H_ * K_ * V_];
            double *dout = malloc(sizeof(double) * no), dSf[H_ * K_ * V_];
            fill_normal(dout, no, 610 + ti, 1.0);
            fill_normal(dSf, H_ * K_ * V_, 620 + ti, 1.0);
            grads g16 = grads_alloc(T), g64 = grads_alloc(T);
            mtrl_ref_kda_recurrent_fwd(T, H_, K_, V_, in.q, in.k, in.v, in.g, in.beta, in.S0, orec, Srec, NULL);
            for (int ref = 0; ref < 2; ref++)
                for (int pad = 0; pad < 2; pad++) {
                    kda_chunk_opts o1 = {.ref = ref, .pad_tail = pad}, o4 = {.ref = ref, .pad_tail = pad, .chunk = 64};
                    mtrl_ref_kda_chunk_fwd_ex(T, H_, K_, V_, in.q, in.k, in.v, in.g, in.beta, in.S0, o16, S16, NULL, &o1);
                    mtrl_ref_kda_chunk_fwd_ex(T, H_, K_, V_, in.q, in.k, in.v, in.g, in.beta, in.S0, o64, S64, NULL, &o4);
                    double ef = maxd(rel(o64, o16, no), rel(S64, S16, H_ * K_ * V_));
                    double er = maxd(rel(o64, orec, no), rel(S64, Srec, H_ * K_ * V_));
                    chunk_bwd(&in, dout, dSf, &o1, 1, &g16);
                    chunk_bwd(&in, dout, dSf, &o4, pad, &g64);
                    double eb = grads_rel(&g64, &g16, T);
                    TEST_CHECKF(ef <= 1e-12 && er <= 1e-12 && eb <= 1e-12,
                                "T=%d g=%d ref=%d pad=%d: 64 vs 16 fwd %.2e bwd %.2e, 64 vs rec %.2e",
                                T, gmode, ref, pad, ef, eb, er);
                    worst_f = maxd(worst_f, ef);
                    worst_b = maxd(worst_b, eb);
                    worst_rec = maxd(worst_rec, er);
                }
            TEST_EQ_INT(mtrl_ref_kda_chunk_state_count(T, &(kda_chunk_opts){.chunk = 64}), (T + 63) / 64);
            grads_free(&g16); grads_free(&g64);
            free(o16); free(o64); free(orec); free(dout);
            free_inputs(&in);
        }
    printf("I7 super-chunk 64 vs 16-tiles: fwd %.2e, bwd %.2e; 64 vs recurrence %.2e\n", worst_f, worst_b, worst_rec);
}

// ---- decode step, prefill + decode, T = 0 ---------------------------------------------------

static void test_step(void) {
    int T = 37;
    inputs in = make_inputs(T, G_RANDOM, 700);
    size_t KV = (size_t)K_ * V_, no = (size_t)T * H_ * V_;
    double *orec = malloc(sizeof(double) * no), *ostep = malloc(sizeof(double) * no), Srec[H_ * K_ * V_];
    mtrl_ref_kda_recurrent_fwd(T, H_, K_, V_, in.q, in.k, in.v, in.g, in.beta, in.S0, orec, Srec, NULL);
    double S[H_ * K_ * V_];
    memcpy(S, in.S0, sizeof S);
    for (int t = 0; t < T; t++)
        mtrl_ref_kda_step(H_, K_, V_, in.q + (size_t)t * H_ * K_, in.k + (size_t)t * H_ * K_, in.v + (size_t)t * H_ * V_,
                 in.g + (size_t)t * H_ * K_, in.beta + (size_t)t * H_, S, ostep + (size_t)t * H_ * V_);
    double e1 = maxd(rel(ostep, orec, no), rel(S, Srec, H_ * KV));
    TEST_CHECKF(e1 <= 1e-15, "kda_step sequence vs recurrence %.2e", e1);

    // Prefill t tokens with the chunked form, decode the rest from its final state (I3, core).
    const int splits[] = {1, 15, 16, 17, 33};
    double worst = 0;
    for (size_t si = 0; si < sizeof splits / sizeof splits[0]; si++) {
        int t0 = splits[si];
        double Sp[H_ * K_ * V_];
        mtrl_ref_kda_chunk_fwd(t0, H_, K_, V_, in.q, in.k, in.v, in.g, in.beta, in.S0, ostep, Sp, NULL);
        for (int t = t0; t < T; t++)
            mtrl_ref_kda_step(H_, K_, V_, in.q + (size_t)t * H_ * K_, in.k + (size_t)t * H_ * K_, in.v + (size_t)t * H_ * V_,
                     in.g + (size_t)t * H_ * K_, in.beta + (size_t)t * H_, Sp, ostep + (size_t)t * H_ * V_);
        double e = maxd(rel(ostep, orec, no), rel(Sp, Srec, H_ * KV));
        TEST_CHECKF(e <= 1e-12, "prefill %d then decode: %.2e", t0, e);
        worst = maxd(worst, e);
    }
    printf("kda_step == recurrence %.2e; prefill+decode == recurrence %.2e\n", e1, worst);

    // T = 0: nothing happens, S_final = S0 (zeros for NULL), dS0 = dS_final.
    double Sf[H_ * K_ * V_], dS0[H_ * K_ * V_], o_guard = 42;
    mtrl_ref_kda_chunk_fwd(0, H_, K_, V_, NULL, NULL, NULL, NULL, NULL, in.S0, &o_guard, Sf, NULL);
    TEST_CHECK(memcmp(Sf, in.S0, sizeof Sf) == 0 && o_guard == 42);
    for (size_t i = 0; i < H_ * KV; i++) Sf[i] = 1;
    mtrl_ref_kda_chunk_fwd(0, H_, K_, V_, NULL, NULL, NULL, NULL, NULL, NULL, NULL, Sf, NULL);
    int zero = 1;
    for (size_t i = 0; i < H_ * KV; i++) zero &= Sf[i] == 0;
    TEST_CHECK(zero);
    mtrl_ref_kda_chunk_bwd(0, H_, K_, V_, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, in.S0, NULL, NULL, NULL, NULL, NULL, dS0);
    TEST_CHECK(memcmp(dS0, in.S0, sizeof dS0) == 0);
    mtrl_ref_kda_recurrent_fwd(0, H_, K_, V_, NULL, NULL, NULL, NULL, NULL, in.S0, NULL, Sf, NULL);
    TEST_CHECK(memcmp(Sf, in.S0, sizeof Sf) == 0);
    free(orec); free(ostep);
    free_inputs(&in);
}

// Packed pieces (mtrl_ref_kda_chunk_fwd_varlen / _bwd_varlen): each piece from the zero state ==
// the token recurrence of that piece alone (o, its final state, its tile states S_tiles[n] = S_{16 n}
// at its place in the list), and the varlen backward == the chunked backward of each piece alone,
// bit for bit. Pieces of 1, 15, 16, 17, 0 (empty: final state zero) and 40 tokens.
static double maxabs_(const double *a, const double *b, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = a[i] - b[i] != a[i] - b[i] ? INFINITY : maxd(m, fabs(a[i] - b[i]));
    return m;
}
// offs [n + 1] of pieces of len[i] tokens laid end to end; returns their tiles in all.
static size_t varlen_offs_(int n, const int *len, int *offs) {
    size_t tiles = 0;
    offs[0] = 0;
    for (int i = 0; i < n; i++) {
        offs[i + 1] = offs[i] + len[i];
        tiles += (size_t)mtrl_ref_kda_tile_count(len[i]);
    }
    return tiles;
}
enum { NP = 6 };
static const int varlen_len_[NP] = {1, 15, 16, 17, 0, 40};
static void test_varlen(void) {
    const int *len = varlen_len_;
    int offs[NP + 1];
    size_t KV = (size_t)K_ * V_, HKV = H_ * KV, tiles = varlen_offs_(NP, len, offs);
    int T = offs[NP];
    inputs in = make_inputs(T, G_RANDOM, 800);
    size_t nk = (size_t)T * H_ * K_, nv = (size_t)T * H_ * V_;
    double *o = malloc(sizeof(double) * nv), *Sf = malloc(sizeof(double) * NP * HKV),
           *St = malloc(sizeof(double) * tiles * HKV), *orec = malloc(sizeof(double) * nv),
           *Sall = malloc(sizeof(double) * (size_t)(T + 1) * HKV), Srec[H_ * K_ * V_];
    for (size_t i = 0; i < NP * HKV; i++) Sf[i] = NAN;
    mtrl_ref_kda_chunk_fwd_varlen(NP, offs, H_, K_, V_, in.q, in.k, in.v, in.g, in.beta, o, Sf, St);
    double worst = 0;
    size_t tile = 0;
    for (int i = 0; i < NP; i++) {
        size_t x = (size_t)offs[i];
        mtrl_ref_kda_recurrent_fwd(len[i], H_, K_, V_, in.q + x * H_ * K_, in.k + x * H_ * K_, in.v + x * H_ * V_,
                                   in.g + x * H_ * K_, in.beta + x * H_, NULL, orec + x * H_ * V_, Srec, Sall);
        worst = maxd(worst, maxabs_(Sf + i * HKV, Srec, HKV));
        for (int n = 0; n < mtrl_ref_kda_tile_count(len[i]); n++)
            worst = maxd(worst, maxabs_(St + (tile + n) * HKV, Sall + (size_t)16 * n * HKV, HKV));
        tile += (size_t)mtrl_ref_kda_tile_count(len[i]);
    }
    worst = maxd(worst, maxabs_(o, orec, nv));
    printf("varlen pieces == each piece's recurrence: max |diff| %.2e\n", worst);
    TEST_CHECKF(worst <= 1e-12, "varlen forward vs recurrence per piece: %.2e", worst);

    double *dout = malloc(sizeof(double) * nv);
    fill_normal(dout, nv, 801, 1.0);
    grads a = grads_alloc(T), b = grads_alloc(T);
    mtrl_ref_kda_chunk_bwd_varlen(NP, offs, H_, K_, V_, in.q, in.k, in.v, in.g, in.beta, St, dout, a.dq, a.dk, a.dv,
                                  a.dg, a.db);
    for (int i = 0; i < NP; i++) {
        size_t x = (size_t)offs[i];
        mtrl_ref_kda_chunk_bwd(len[i], H_, K_, V_, in.q + x * H_ * K_, in.k + x * H_ * K_, in.v + x * H_ * V_,
                               in.g + x * H_ * K_, in.beta + x * H_, NULL, NULL, dout + x * H_ * V_, NULL,
                               b.dq + x * H_ * K_, b.dk + x * H_ * K_, b.dv + x * H_ * V_, b.dg + x * H_ * K_,
                               b.db + x * H_, NULL);
    }
    int same = !memcmp(a.dq, b.dq, sizeof(double) * nk) && !memcmp(a.dk, b.dk, sizeof(double) * nk) &&
               !memcmp(a.dv, b.dv, sizeof(double) * nv) && !memcmp(a.dg, b.dg, sizeof(double) * nk) &&
               !memcmp(a.db, b.db, sizeof(double) * (size_t)T * H_);
    printf("varlen backward == each piece's chunked backward: %s\n", same ? "same bits" : "DIFFERENT");
    TEST_CHECKF(same, "varlen backward differs from the per-piece backward");
    grads_free(&a);
    grads_free(&b);
    free(o); free(Sf); free(St); free(orec); free(Sall); free(dout);
    free_inputs(&in);
}

// The piece_io form (mtrl_ref_kda_chunk_fwd_varlen_io): each piece from its own state == the token
// recurrence of that piece from that state (o, final state, tile states), at 1e-12; with the final
// states written over the initial ones (in place) the same bits as into separate states; a NULL
// entry is the zero state. Pieces of 1, 15, 16, 17, 0 (empty: its state passes through) and 40.
static void test_varlen_io(void) {
    const int *len = varlen_len_;
    int offs[NP + 1];
    size_t KV = (size_t)K_ * V_, HKV = H_ * KV, tiles = varlen_offs_(NP, len, offs);
    inputs in = make_inputs(offs[NP], G_RANDOM, 810);
    int T = offs[NP];
    size_t nv = (size_t)T * H_ * V_;
    double *S0 = malloc(sizeof(double) * NP * HKV), *Sf = malloc(sizeof(double) * NP * HKV),
           *Sin = malloc(sizeof(double) * NP * HKV), *o = malloc(sizeof(double) * nv),
           *o2 = malloc(sizeof(double) * nv), *St = malloc(sizeof(double) * tiles * HKV),
           *orec = malloc(sizeof(double) * nv), *Sall = malloc(sizeof(double) * (size_t)(T + 1) * HKV),
           Srec[H_ * K_ * V_];
    fill_normal(S0, NP * HKV, 811, 0.5);
    const double *S0p[NP];
    double *Sfp[NP], *Sinp[NP];
    for (int i = 0; i < NP; i++) {
        S0p[i] = i == 3 ? NULL : S0 + i * HKV; // piece 3 from the zero state
        Sfp[i] = Sf + i * HKV;
        Sinp[i] = Sin + i * HKV;
    }
    memcpy(Sin, S0, sizeof(double) * NP * HKV);
    memset(Sin + 3 * HKV, 0, sizeof(double) * HKV);
    mtrl_ref_kda_chunk_fwd_varlen_io(NP, offs, H_, K_, V_, in.q, in.k, in.v, in.g, in.beta, S0p, o, Sfp, St);
    mtrl_ref_kda_chunk_fwd_varlen_io(NP, offs, H_, K_, V_, in.q, in.k, in.v, in.g, in.beta,
                                     (const double *const *)Sinp, o2, Sinp, NULL);
    double worst = 0;
    size_t tile = 0;
    for (int i = 0; i < NP; i++) {
        size_t x = (size_t)offs[i];
        mtrl_ref_kda_recurrent_fwd(len[i], H_, K_, V_, in.q + x * H_ * K_, in.k + x * H_ * K_, in.v + x * H_ * V_,
                                   in.g + x * H_ * K_, in.beta + x * H_, S0p[i], orec + x * H_ * V_, Srec, Sall);
        worst = maxd(worst, maxabs_(Sf + i * HKV, Srec, HKV));
        for (int n = 0; n < mtrl_ref_kda_tile_count(len[i]); n++)
            worst = maxd(worst, maxabs_(St + (tile + n) * HKV, Sall + (size_t)16 * n * HKV, HKV));
        tile += (size_t)mtrl_ref_kda_tile_count(len[i]);
    }
    worst = maxd(worst, maxabs_(o, orec, nv));
    int same = !memcmp(o, o2, sizeof(double) * nv) && !memcmp(Sf, Sin, sizeof(double) * NP * HKV);
    printf("varlen pieces from their own states == each piece's recurrence: max |diff| %.2e; in place: %s\n", worst,
           same ? "same bits" : "DIFFERENT");
    TEST_CHECKF(worst <= 1e-12, "varlen_io forward vs recurrence per piece: %.2e", worst);
    TEST_CHECKF(same, "varlen_io in place differs from separate final states");
    free(S0); free(Sf); free(Sin); free(o); free(o2); free(St); free(orec); free(Sall);
    free_inputs(&in);
}

int main(void) {
    test_i1();
    test_i2();
    test_gate();
    test_unbounded();
    test_i5();
    test_i7();
    test_step();
    test_varlen();
    test_varlen_io();
    return test_report();
}
