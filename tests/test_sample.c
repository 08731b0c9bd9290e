// mtrl-test: cpu
// test_sample.c: mtrl_ref_sample_logits (kernels/ref/ops_ref.h) in the fp32 build the actor uses.
//
// Greedy is the argmax (lowest index on ties) with the temperature-1 log-prob; a fixed u gives
// a fixed token; over many counter-RNG uniforms the empirical frequencies match
// softmax(logits/T) (chi-square bound, and the same statistic rejects the wrong temperature);
// top-p never returns a token outside the nucleus, the nucleus is minimal, and frequencies
// match the renormalised nucleus; logp_out is the log-prob of the returned token under the
// distribution actually sampled from.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "kernels/ref/ops_ref.h"
#include "tests/testhelp.h"

#define NDRAW 100000
// Chi-square with <= 9 degrees of freedom exceeds 40 with probability < 1e-5; the draws are
// a fixed Philox stream, so the test is deterministic either way.
#define CHI2_BOUND 40.0

static void softmax_d(int V, const real *l, double temp, double *p) {
    double m = -INFINITY, z = 0;
    for (int v = 0; v < V; v++) m = fmax(m, (double)l[v]);
    for (int v = 0; v < V; v++) { p[v] = exp(((double)l[v] - m) / temp); z += p[v]; }
    for (int v = 0; v < V; v++) p[v] /= z;
}

static double chi2(int V, const long *cnt, const double *p, long n) {
    double s = 0;
    for (int v = 0; v < V; v++) {
        if (p[v] <= 0) continue;
        double e = (double)n * p[v];
        s += ((double)cnt[v] - e) * ((double)cnt[v] - e) / e;
    }
    return s;
}

static void fill_logits(real *l, int V, uint64_t stream, double scale) {
    for (int v = 0; v < V; v++) l[v] = (real)(scale * mtrl_rng_normal(5, stream, (uint64_t)v));
}

static void test_greedy(void) {
    printf("greedy\n");
    const int V = 50;
    real l[50];
    fill_logits(l, V, 1, 2.0);
    l[17] = 9.0f;
    l[31] = 9.0f;  // a tie: the lower index wins
    real lp = 0;
    int tgt = 17;
    real want;
    mtrl_ref_logits_logprob_fwd(1, V, l, &tgt, &want, NULL);
    for (int i = 0; i < 5; i++) {
        int t = mtrl_ref_sample_logits(V, l, 0.0f, 1.0f, mtrl_rng_uniform(9, 1, (uint64_t)i), &lp);
        TEST_EQ_INT(t, 17);
        TEST_CLOSE(lp, want, 0, 1e-6);
    }
    // top_p is irrelevant to greedy; a negative temperature is greedy too.
    TEST_EQ_INT(mtrl_ref_sample_logits(V, l, -1.0f, 0.3f, 0.99, NULL), 17);
}

// Draws NDRAW tokens with uniforms of one stream; counts and checks every logp_out against
// log(q[token]) where q is the intended sampling distribution.
static void draw(int V, const real *l, real temp, real top_p, uint64_t stream, const double *q,
                 long *cnt, double *worst_lp) {
    memset(cnt, 0, sizeof(long) * (size_t)V);
    *worst_lp = 0;
    for (long i = 0; i < NDRAW; i++) {
        real lp;
        int t = mtrl_ref_sample_logits(V, l, temp, top_p, mtrl_rng_uniform(77, stream, (uint64_t)i), &lp);
        if (t < 0 || t >= V) { TEST_CHECKF(0, "token %d out of range", t); return; }
        cnt[t]++;
        double d = q[t] > 0 ? fabs((double)lp - log(q[t])) : INFINITY;
        if (d > *worst_lp) *worst_lp = d;
    }
}

static void test_frequencies(void) {
    printf("frequencies, temperature 0.7\n");
    enum { V = 8 };
    real l[V];
    fill_logits(l, V, 2, 1.5);
    double p[V], p1[V];
    long cnt[V];
    double wlp;
    softmax_d(V, l, 0.7, p);
    softmax_d(V, l, 1.0, p1);
    draw(V, l, 0.7f, 1.0f, 1, p, cnt, &wlp);
    double c2 = chi2(V, cnt, p, NDRAW), c2wrong = chi2(V, cnt, p1, NDRAW);
    printf("  chi2 vs softmax(l/0.7) %.2f (df %d, bound %.0f); vs softmax(l) %.1f; logp_out max err %.2e\n",
           c2, V - 1, CHI2_BOUND, c2wrong, wlp);
    TEST_CHECKF(c2 < CHI2_BOUND, "chi2 %.2f", c2);
    TEST_CHECKF(c2wrong > 10 * CHI2_BOUND, "the test cannot tell temperatures apart: %.2f", c2wrong);
    TEST_CHECKF(wlp < 1e-5, "logp_out %.3e", wlp);

    // Determinism: the same u gives the same token and log-prob.
    for (int i = 0; i < 200; i++) {
        double u = mtrl_rng_uniform(3, 3, (uint64_t)i);
        real a, b;
        int ta = mtrl_ref_sample_logits(V, l, 0.7f, 0.9f, u, &a), tb = mtrl_ref_sample_logits(V, l, 0.7f, 0.9f, u, &b);
        TEST_CHECK(ta == tb && a == b);
    }
    // Extremes of u: 0 takes the first token of the walk (token 0), u -> 1 the last.
    TEST_EQ_INT(mtrl_ref_sample_logits(V, l, 0.7f, 1.0f, 0.0, NULL), 0);
    TEST_EQ_INT(mtrl_ref_sample_logits(V, l, 0.7f, 1.0f, nextafter(1.0, 0.0), NULL), V - 1);
    // Temperature 1, no top-p: logp_out is exactly the learner's log-softmax.
    int t = mtrl_ref_sample_logits(V, l, 1.0f, 1.0f, 0.4, NULL);
    real lp, want;
    mtrl_ref_sample_logits(V, l, 1.0f, 1.0f, 0.4, &lp);
    mtrl_ref_logits_logprob_fwd(1, V, l, &t, &want, NULL);
    TEST_CLOSE(lp, want, 0, 1e-6);
}

static int cmp_desc(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x < y) - (x > y);
}

static void test_top_p(void) {
    printf("top-p 0.75, temperature 1.3\n");
    enum { V = 10 };
    real l[V];
    fill_logits(l, V, 4, 1.2);
    const double top_p = 0.75, temp = 1.3;
    double p[V], sorted[V], q[V];
    softmax_d(V, l, temp, p);
    memcpy(sorted, p, sizeof p);
    qsort(sorted, V, sizeof(double), cmp_desc);
    int n = 0;
    double mass = 0;
    while (n < V && mass < top_p) mass += sorted[n++];
    double thresh = sorted[n - 1];  // smallest probability inside the nucleus
    TEST_CHECK(n >= 2 && n < V);   // a real nucleus with a real tail for this seed
    TEST_CHECK(mass - sorted[n - 1] < top_p);  // minimal
    for (int v = 0; v < V; v++) q[v] = p[v] >= thresh ? p[v] / mass : 0;
    long cnt[V];
    double wlp;
    draw(V, l, (real)temp, (real)top_p, 2, q, cnt, &wlp);
    long outside = 0;
    for (int v = 0; v < V; v++) if (q[v] == 0) outside += cnt[v];
    double c2 = chi2(V, cnt, q, NDRAW);
    printf("  nucleus %d of %d tokens, mass %.4f; outside draws %ld; chi2 %.2f (df %d); logp_out max err %.2e\n",
           n, V, mass, outside, c2, n - 1, wlp);
    TEST_EQ_INT(outside, 0);
    TEST_CHECKF(c2 < CHI2_BOUND, "chi2 %.2f", c2);
    TEST_CHECKF(wlp < 1e-5, "logp_out %.3e", wlp);
    // u -> 1 lands on the least likely nucleus token, never in the tail.
    int last = mtrl_ref_sample_logits(V, l, (real)temp, (real)top_p, nextafter(1.0, 0.0), NULL);
    TEST_CLOSE(p[last], thresh, 1e-12, 0);
    // A tiny top_p keeps only the most likely token.
    int amax = 0;
    for (int v = 1; v < V; v++) if (l[v] > l[amax]) amax = v;
    real lp;
    TEST_EQ_INT(mtrl_ref_sample_logits(V, l, (real)temp, 1e-6f, 0.99, &lp), amax);
    TEST_CLOSE(lp, 0, 0, 1e-7);
}

// A production-size vocabulary: the nucleus and log-probs against a full sort done here.
static void test_large_vocab(void) {
    printf("vocab 163840, top-p 0.9\n");
    const int V = 163840;
    real *l = malloc(sizeof(real) * (size_t)V);
    fill_logits(l, V, 6, 3.0);
    double *p = malloc(sizeof(double) * (size_t)V), *sorted = malloc(sizeof(double) * (size_t)V);
    softmax_d(V, l, 1.0, p);
    memcpy(sorted, p, sizeof(double) * (size_t)V);
    qsort(sorted, (size_t)V, sizeof(double), cmp_desc);
    int n = 0;
    double mass = 0;
    while (n < V && mass < 0.9) mass += sorted[n++];
    const double thresh = sorted[n - 1];
    double worst = 0;
    int outside = 0;
    for (int i = 0; i < 50; i++) {
        real lp;
        int t = mtrl_ref_sample_logits(V, l, 1.0f, 0.9f, mtrl_rng_uniform(1, 8, (uint64_t)i), &lp);
        if (t < 0 || t >= V || p[t] < thresh) { outside++; continue; }
        worst = fmax(worst, fabs((double)lp - log(p[t] / mass)));
    }
    printf("  nucleus %d tokens; 50 draws: outside %d, logp_out max err %.2e\n", n, outside, worst);
    TEST_EQ_INT(outside, 0);
    TEST_CHECKF(worst < 1e-5, "logp_out %.3e", worst);
    free(l);
    free(p);
    free(sorted);
}

int main(void) {
    test_greedy();
    test_frequencies();
    test_top_p();
    test_large_vocab();
    return test_report();
}
