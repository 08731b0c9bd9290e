// mtrl-test: cpu
// The decode step's routing statistics (model/model_decode.h: read back once after each step and
// added to the model's counters then) on the CPU: over steps of changing batch sizes, the loads of
// every MoE layer are the histogram of the routing the steps returned, the QB batch counts grow by
// one per step whose batch QB takes (qb_beta_from_batch: ⌊B k / E⌋ >= 1, ⌊B k / E⌋ + 1 <= B,
// k < E) and the β sums are finite and non-zero where counted; nothing is recorded on the CPU
// (every step launched); and the logits of a batch are those of each row decoded alone.
#include <stdlib.h>
#include <string.h>

#include "model/qb.h"
#include "testhelp.h"
#include "testmodel.h"

#define NS 6

int main(void) {
    mtrl_model_dims d = test_model_dims("preset = tiny\n", 64);
    TEST_CHECK(d.L > 0);
    if (d.L <= 0) return test_report();
    mtrl_model m, m1;
    mtrl_model_init(&m, &d, 3);
    mtrl_model_init(&m1, &d, 3);
    mtrl_qb_set_mode(&m, MTRL_QB_DECODE);
    mtrl_decode_state st[NS], one;
    for (int i = 0; i < NS; i++) {
        mtrl_decode_state_init(&st[i], &m, 64);
        uint32_t p[3] = {(uint32_t)i, (uint32_t)(2 * i + 1), 7};
        mtrl_model_prefill(&m, &st[i], p, 1 + i % 3, NULL, NULL);
    }
    mtrl_decode_state_init(&one, &m1, 64);
    int E = d.E, K = d.k, nmoe = d.n_moe, V = d.V, steps = 0, counted = 0;
    size_t rw = (size_t)nmoe * K;
    long *hist = calloc((size_t)d.L * E, sizeof(long));
    real *lg = malloc(sizeof(real) * NS * V), *l1 = malloc(sizeof(real) * V);
    uint8_t *rt = malloc(NS * rw);
    long alone_diff = 0;
    for (int step = 0; step < 12; step++) {
        int B = 1 + step % NS;
        mtrl_decode_state *sp[NS];
        uint32_t tok[NS];
        for (int b = 0; b < B; b++) {
            sp[b] = &st[(b + step) % NS];
            tok[b] = (uint32_t)((step * 7 + b * 3) % V);
        }
        // the first row alone on a copy of its state (a second model: its counters stay apart)
        mtrl_decode_state_copy(&one, sp[0], &m1);
        mtrl_decode_state *op[1] = {&one};
        mtrl_model_decode(&m1, op, 1, tok, l1, NULL);
        mtrl_model_decode(&m, sp, B, tok, lg, rt);
        alone_diff += memcmp(lg, l1, sizeof(real) * V) != 0;
        for (int b = 0; b < B; b++)
            for (int mi = 0; mi < nmoe; mi++)
                for (int j = 0; j < K; j++) hist[(size_t)(d.first_dense + mi) * E + rt[(size_t)b * rw + (size_t)mi * K + j]]++;
        long q = (long)B * K / E;
        counted += q >= 1 && q + 1 <= B && K < E;
        steps++;
    }
    TEST_CHECKF(!memcmp(hist, m.load, sizeof(long) * (size_t)d.L * E), "loads are not the routing's histogram");
    TEST_CHECKF(alone_diff == 0, "a batch's first row differs from the row alone at %ld of %d steps", alone_diff, steps);
    for (int l = d.first_dense; l < d.L; l++) {
        TEST_EQ_INT(m.qb_count[l], counted);
        double s = 0;
        for (int e = 0; e < E; e++) s += fabs(m.qb_sum[(size_t)l * E + e]);
        TEST_CHECKF(isfinite(s) && (counted == 0 || s > 0), "layer %d: β sums %g over %d batches", l, s, counted);
    }
    long rep, rec, lau;
    mtrl_model_decode_counts(&m, &rep, &rec, &lau);
    TEST_CHECK(rep == 0 && rec == 0 && lau == steps);
    printf("%d steps, %d counted by QB; loads = the routing's histogram; graphs: %ld replayed, %ld launched\n", steps,
           counted, rep, lau);
    for (int i = 0; i < NS; i++) mtrl_decode_state_free(&st[i]);
    mtrl_decode_state_free(&one);
    free(hist);
    free(lg);
    free(l1);
    free(rt);
    mtrl_model_free(&m);
    mtrl_model_free(&m1);
    return test_report();
}
