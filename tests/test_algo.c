// mtrl-test: cpu
// test_algo.c: learner/algo against hand-computed values and central finite differences.
//
// Hand cases set ratios through log-probs (logp = logp_old + log r, stored as f32), so they
// carry ~1e-7 relative input rounding: they are compared at 1e-6. The finite-difference sweep
// puts every input on a 2^-16 grid and steps by h = 2^-12, so logp ± h is exact in f32 and
// the central difference is limited only by h^2 (~1e-8 relative); it is compared at 1e-5.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "learner/algo.h"
#include "tests/testhelp.h"

// ---- helpers ----------------------------------------------------------------------------------

static mtrl_algo_config cfg_make(mtrl_algo_loss loss, mtrl_algo_agg agg, mtrl_algo_correction corr) {
    mtrl_algo_config c = mtrl_algo_config_default();
    c.loss = loss;
    c.aggregation = agg;
    c.correction = corr;
    return c;
}

static double loss_of(const mtrl_algo_config *c, const mtrl_algo_batch *b, float *dlogp, float *dent,
                      mtrl_algo_stats *st) {
    double L = NAN;
    mtrl_status s = mtrl_algo_policy_loss(c, b, &L, dlogp, dent, st);
    TEST_EQ_INT(s, MTRL_OK);
    return L;
}

// ---- config -----------------------------------------------------------------------------------

static void test_config(void) {
    mtrl_algo_config c = mtrl_algo_config_default();
    // The config schema's [algo] defaults.
    TEST_EQ_INT(c.advantage, MTRL_ALGO_ADV_GRPO);
    TEST_EQ_INT(c.loss, MTRL_ALGO_LOSS_PPO);
    TEST_EQ_INT(c.correction, MTRL_ALGO_CORR_TIS);
    TEST_EQ_INT(c.aggregation, MTRL_ALGO_AGG_TOKEN_MEAN);
    TEST_NEAR(c.eps_low, 0.2, 0);
    TEST_NEAR(c.eps_high, 0.28, 0);
    TEST_NEAR(c.dual_clip, 3.0, 0);
    TEST_NEAR(c.tis_cap, 2.0, 0);
    TEST_NEAR(c.seq_mask_low, 0.5, 0);
    TEST_NEAR(c.seq_mask_high, 2.0, 0);
    TEST_NEAR(c.agg_constant, 1024, 0);
    TEST_NEAR(c.entropy_coef, 0, 0);
    TEST_EQ_INT(mtrl_algo_config_check(&c, NULL, 0), MTRL_OK);

    const char *adv[] = {"grpo", "dr_grpo", "rloo"};
    const char *loss[] = {"ppo", "cispo", "gspo"};
    const char *corr[] = {"none", "tis", "seq_mask"};
    const char *agg[] = {"token_mean", "seq_mean_token_mean", "constant"};
    for (int i = 0; i < 3; i++) {
        TEST_EQ_INT(mtrl_algo_advantage_parse(adv[i]), i);
        TEST_EQ_INT(mtrl_algo_loss_parse(loss[i]), i);
        TEST_EQ_INT(mtrl_algo_correction_parse(corr[i]), i);
        TEST_EQ_INT(mtrl_algo_agg_parse(agg[i]), i);
        TEST_EQ_STR(mtrl_algo_advantage_name((mtrl_algo_advantage)i), adv[i]);
        TEST_EQ_STR(mtrl_algo_loss_name((mtrl_algo_loss)i), loss[i]);
        TEST_EQ_STR(mtrl_algo_correction_name((mtrl_algo_correction)i), corr[i]);
        TEST_EQ_STR(mtrl_algo_agg_name((mtrl_algo_agg)i), agg[i]);
    }
    TEST_EQ_INT(mtrl_algo_advantage_parse("GRPO"), -1);
    TEST_EQ_INT(mtrl_algo_advantage_parse("gae"), -1);
    TEST_EQ_INT(mtrl_algo_loss_parse("ppo "), -1);
    TEST_EQ_INT(mtrl_algo_correction_parse("icepop"), -1);
    TEST_EQ_INT(mtrl_algo_agg_parse("seq_mean"), -1);
    TEST_EQ_INT(mtrl_algo_agg_parse(NULL), -1);
    TEST_EQ_STR(mtrl_algo_loss_name((mtrl_algo_loss)7), "?");

    char msg[256];
    mtrl_algo_config bad = c;
    bad.dual_clip = 0.5;
    TEST_EQ_INT(mtrl_algo_config_check(&bad, msg, sizeof msg), MTRL_ERR_USAGE);
    TEST_CONTAINS(msg, "algo.dual_clip");
    bad = c;
    bad.eps_low = 1.0;
    TEST_EQ_INT(mtrl_algo_config_check(&bad, msg, sizeof msg), MTRL_ERR_USAGE);
    TEST_CONTAINS(msg, "algo.eps_low");
    bad = c;
    bad.eps_high = NAN;
    TEST_EQ_INT(mtrl_algo_config_check(&bad, msg, sizeof msg), MTRL_ERR_USAGE);
    bad = c;
    bad.seq_mask_low = 3.0;
    TEST_EQ_INT(mtrl_algo_config_check(&bad, msg, sizeof msg), MTRL_ERR_USAGE);
    TEST_CONTAINS(msg, "seq_mask_low");
    bad = c;
    bad.agg_constant = 0;
    TEST_EQ_INT(mtrl_algo_config_check(&bad, msg, sizeof msg), MTRL_ERR_USAGE);
    bad = c;
    bad.loss = (mtrl_algo_loss)3;
    TEST_EQ_INT(mtrl_algo_config_check(&bad, msg, sizeof msg), MTRL_ERR_USAGE);
    bad = c;
    bad.dual_clip = 0.0; // off is allowed
    TEST_EQ_INT(mtrl_algo_config_check(&bad, msg, sizeof msg), MTRL_OK);
}

// ---- advantages -------------------------------------------------------------------------------

static void test_advantages(void) {
    // R = {1, 2, 3, 6}: mean 3, deviations {-2, -1, 0, 3}, population variance (4+1+0+9)/4 = 3.5.
    const double R[4] = {1, 2, 3, 6};
    double a[4];
    const double sd = sqrt(3.5) + 1e-6;
    mtrl_algo_advantages(MTRL_ALGO_ADV_GRPO, R, 4, a);
    const double grpo[4] = {-2 / sd, -1 / sd, 0, 3 / sd}; // -1.0690442, -0.5345221, 0, 1.6035663
    TEST_ARRAY_CLOSE(a, grpo, 4, 1e-12, 1e-15);
    TEST_CLOSE(a[3], 1.6035663, 0, 1e-6);
    mtrl_algo_advantages(MTRL_ALGO_ADV_DR_GRPO, R, 4, a);
    const double dr[4] = {-2, -1, 0, 3};
    TEST_ARRAY_CLOSE(a, dr, 4, 0, 1e-15);
    // RLOO: R_i minus the mean of the other three: 1 - 11/3, 2 - 10/3, 3 - 3, 6 - 2.
    mtrl_algo_advantages(MTRL_ALGO_ADV_RLOO, R, 4, a);
    const double rloo[4] = {-8.0 / 3, -4.0 / 3, 0, 4};
    TEST_ARRAY_CLOSE(a, rloo, 4, 0, 1e-14);

    // A second group with a different spread: R = {0, 0, 1, 1} -> mean 0.5, std 0.5.
    const double R2[4] = {0, 0, 1, 1};
    mtrl_algo_advantages(MTRL_ALGO_ADV_GRPO, R2, 4, a);
    TEST_CLOSE(a[0], -0.5 / 0.500001, 0, 1e-15);
    TEST_CLOSE(a[2], 0.5 / 0.500001, 0, 1e-15);
    mtrl_algo_advantages(MTRL_ALGO_ADV_RLOO, R2, 4, a);
    TEST_CLOSE(a[0], -2.0 / 3, 0, 1e-15); // 0 - 2/3
    TEST_CLOSE(a[3], 2.0 / 3, 0, 1e-15);  // 1 - 1/3

    // Degenerate groups: G = 1 and equal rewards give 0, never NaN.
    for (int k = 0; k < 3; k++) {
        double one = 5.0;
        mtrl_algo_advantages((mtrl_algo_advantage)k, &one, 1, &one);
        TEST_NEAR(one, 0.0, 0);
        const double same[3] = {0.7, 0.7, 0.7};
        double out[3] = {9, 9, 9};
        mtrl_algo_advantages((mtrl_algo_advantage)k, same, 3, out);
        TEST_CHECK(out[0] == 0 && out[1] == 0 && out[2] == 0);
    }
    // In place (adv aliases rewards).
    double inplace[4] = {1, 2, 3, 6};
    mtrl_algo_advantages(MTRL_ALGO_ADV_DR_GRPO, inplace, 4, inplace);
    TEST_ARRAY_CLOSE(inplace, dr, 4, 0, 1e-15);

    // Broadcast onto tokens of episodes of 2, 0 and 3 tokens.
    const size_t off[4] = {0, 2, 2, 5};
    const double ep[3] = {1.5, -7, -0.25};
    float tok[5] = {0};
    mtrl_algo_advantages_broadcast(ep, off, 3, tok);
    const float want[5] = {1.5f, 1.5f, -0.25f, -0.25f, -0.25f};
    TEST_ARRAY_CLOSE(tok, want, 5, 0, 0);
}

// ---- PPO --------------------------------------------------------------------------------------

// One episode of 8 tokens; position 3 is a tool token. eps 0.2/0.28 (clip range [0.8, 1.28]),
// dual clip 3. Per model token (r, A) -> ℓ = -min(rA, clip(r)A) [then min(ℓ, -3A) for A < 0],
// dℓ/dlogp = -A r on the unclipped branch, else 0:
//   t0 (1.1,  1)  inside                 ℓ = -1.1    g = -1.1
//   t1 (1.5,  1)  clipped high           ℓ = -1.28   g = 0
//   t2 (0.5, -1)  clipped low            ℓ =  0.8    g = 0
//   t4 (4.0, -1)  dual clip (4 > 3)      ℓ =  3      g = 0
//   t5 (2.0, -1)  above 1.28, A < 0      ℓ =  2      g = 2      (unclipped; 2 < c)
//   t6 (0.5,  1)  below 0.8, A > 0       ℓ = -0.5    g = -0.5   (unclipped)
//   t7 (0.9, -2)  inside                 ℓ =  1.8    g = 1.8
// token_mean over 7 model tokens: L = (-1.1 - 1.28 + 0.8 + 3 + 2 - 0.5 + 1.8)/7 = 4.72/7.
static void test_ppo(void) {
    const double r[8] = {1.1, 1.5, 0.5, 10.0, 4.0, 2.0, 0.5, 0.9};
    const float A[8] = {1, 1, -1, -1, -1, -1, 1, -2};
    const uint8_t M[8] = {1, 1, 1, 0, 1, 1, 1, 1};
    float old[8], lp[8], dl[8], H[8];
    for (int t = 0; t < 8; t++) {
        old[t] = (float)(-2.0 + 0.1 * t);
        lp[t] = (float)(old[t] + log(r[t]));
        H[t] = (float)(0.5 + 0.25 * t);
    }
    const size_t off[2] = {0, 8};
    // The learner's mode: logp_old and logp_behav are the same array, under the default
    // correction (tis), whose weight is then exactly 1.
    mtrl_algo_batch b = {.n_seq = 1, .off = off, .logp = lp, .logp_old = old, .logp_behav = old, .adv = A,
                         .mask = M};
    mtrl_algo_config c = mtrl_algo_config_default();
    mtrl_algo_stats st;
    double L = loss_of(&c, &b, dl, NULL, &st);
    TEST_CLOSE(L, 4.72 / 7, 0, 1e-6);
    const double g[8] = {-1.1 / 7, 0, 0, 0, 0, 2.0 / 7, -0.5 / 7, 1.8 / 7};
    TEST_ARRAY_CLOSE(dl, g, 8, 0, 1e-6);
    TEST_CHECK(dl[1] == 0.0f && dl[2] == 0.0f && dl[3] == 0.0f && dl[4] == 0.0f); // exactly zero
    TEST_EQ_INT(st.n_tokens, 7);
    TEST_CLOSE(st.clip_low_frac, 1.0 / 7, 0, 1e-12);
    TEST_CLOSE(st.clip_high_frac, 1.0 / 7, 0, 1e-12);
    TEST_CLOSE(st.dual_clip_frac, 1.0 / 7, 0, 1e-12);
    TEST_CLOSE(st.ratio_mean, (1.1 + 1.5 + 0.5 + 4 + 2 + 0.5 + 0.9) / 7, 0, 1e-6);
    TEST_CLOSE(st.tis_weight_mean, 1.0, 0, 0);
    TEST_CLOSE(st.tis_capped_frac, 0.0, 0, 0);
    TEST_CLOSE(st.masked_frac, 0.0, 0, 0);
    // Mismatch vs behaviour (= old here): lr = log r.
    double k1 = 0, k3 = 0, ab = 0;
    for (int t = 0; t < 8; t++) {
        if (!M[t]) continue;
        double lr = log(r[t]);
        k1 += -lr;
        k3 += exp(-lr) - 1 + lr; // = 1/r - 1 + log r
        ab += fabs(lr);
    }
    TEST_CLOSE(st.kl_k1, k1 / 7, 0, 1e-6);
    TEST_CLOSE(st.kl_k3, k3 / 7, 0, 1e-6);
    TEST_CLOSE(st.logp_absdiff_mean, ab / 7, 0, 1e-6);
    TEST_CHECK(st.kl_k3 > 0);

    // Correction none gives the same numbers (w = 1).
    mtrl_algo_config cn = c;
    cn.correction = MTRL_ALGO_CORR_NONE;
    TEST_CLOSE(loss_of(&cn, &b, NULL, NULL, NULL), 4.72 / 7, 0, 1e-6);

    // Dual clip off: t4 becomes ℓ = 4 with g = -A r = 4.
    mtrl_algo_config c0 = c;
    c0.dual_clip = 0;
    L = loss_of(&c0, &b, dl, NULL, &st);
    TEST_CLOSE(L, 5.72 / 7, 0, 1e-6);
    TEST_CLOSE(dl[4], 4.0 / 7, 0, 1e-6);
    TEST_CLOSE(st.dual_clip_frac, 0.0, 0, 0);

    // Entropy bonus, token_mean: dL/dH_t = -coef/7 on model tokens, L drops by coef · mean H.
    mtrl_algo_config ce = c;
    ce.entropy_coef = 0.01;
    b.entropy = H;
    float dH[8];
    L = loss_of(&ce, &b, dl, dH, &st);
    double hsum = 0;
    for (int t = 0; t < 8; t++) hsum += M[t] ? H[t] : 0;
    TEST_CLOSE(L, 4.72 / 7 - 0.01 * hsum / 7, 0, 1e-6);
    TEST_CLOSE(st.entropy_mean, hsum / 7, 1e-12, 0);
    TEST_CLOSE(st.entropy_bonus, hsum / 7, 1e-12, 0);
    TEST_CLOSE(st.pg_loss, 4.72 / 7, 0, 1e-6);
    const double gH[8] = {-0.01 / 7, -0.01 / 7, -0.01 / 7, 0, -0.01 / 7, -0.01 / 7, -0.01 / 7, -0.01 / 7};
    TEST_ARRAY_CLOSE(dH, gH, 8, 1e-6, 0);
    TEST_ARRAY_CLOSE(dl, g, 8, 0, 1e-6); // the bonus does not touch dlogp

    // Argument errors write nothing.
    b.entropy = NULL;
    double keep = 123.0;
    TEST_EQ_INT(mtrl_algo_policy_loss(&ce, &b, &keep, dl, dH, NULL), MTRL_ERR_USAGE); // coef without H
    TEST_NEAR(keep, 123.0, 0);
    const size_t bad_off[2] = {1, 8};
    b.off = bad_off;
    TEST_EQ_INT(mtrl_algo_policy_loss(&c, &b, &keep, dl, NULL, NULL), MTRL_ERR_MISMATCH);
    mtrl_algo_config cb = c;
    cb.eps_low = -0.1;
    b.off = off;
    TEST_EQ_INT(mtrl_algo_policy_loss(&cb, &b, &keep, dl, NULL, NULL), MTRL_ERR_USAGE);
    TEST_NEAR(keep, 123.0, 0);
}

// ---- CISPO ------------------------------------------------------------------------------------

// dℓ/dlogp_t = -clip(r_t, 0.8, 1.28) A_t / N for every model token, clipped or not.
static void test_cispo(void) {
    const double r[5] = {1.1, 1.5, 0.5, 0.7, 1.0};
    const float A[5] = {1, 1, -1, 2, 0};
    const float old[5] = {-1, -2, -0.5f, -3, -1};
    const uint8_t M[5] = {1, 1, 1, 1, 1};
    float lp[5], dl[5];
    for (int t = 0; t < 5; t++) lp[t] = (float)(old[t] + log(r[t]));
    const size_t off[2] = {0, 5};
    mtrl_algo_batch b = {.n_seq = 1, .off = off, .logp = lp, .logp_old = old, .logp_behav = old, .adv = A,
                         .mask = M};
    mtrl_algo_config c = cfg_make(MTRL_ALGO_LOSS_CISPO, MTRL_ALGO_AGG_TOKEN_MEAN, MTRL_ALGO_CORR_NONE);
    mtrl_algo_stats st;
    double L = loss_of(&c, &b, dl, NULL, &st);
    const double rc[5] = {1.1, 1.28, 0.8, 0.8, 1.0}; // clip(r)
    double want_L = 0;
    double g[5];
    for (int t = 0; t < 5; t++) {
        g[t] = -rc[t] * A[t] / 5;
        want_L += -rc[t] * A[t] * (double)lp[t] / 5; // the surrogate's value
    }
    TEST_ARRAY_CLOSE(dl, g, 5, 0, 1e-6);
    TEST_CLOSE(dl[1], -1.28 / 5, 0, 1e-7); // clipped high, A > 0: still -1.28/5 (PPO gives 0)
    TEST_CLOSE(dl[2], 0.8 / 5, 0, 1e-7);   // clipped low, A < 0: still 0.8/5
    TEST_CLOSE(dl[3], -1.6 / 5, 0, 1e-7);  // clipped low, A > 0: -0.8·2/5
    TEST_CLOSE(L, want_L, 0, 1e-6);
    TEST_CLOSE(st.clip_low_frac, 2.0 / 5, 0, 1e-12);
    TEST_CLOSE(st.clip_high_frac, 1.0 / 5, 0, 1e-12);
    TEST_CLOSE(st.dual_clip_frac, 0.0, 0, 0);
}

// ---- GSPO -------------------------------------------------------------------------------------

// Episode 0: tokens {model, tool, model}, log-ratios {0.1, -, 0.3}: s0 = e^0.2 = 1.2214 (inside).
// Episode 1: two model tokens with log-ratio 0.5: s1 = e^0.5 = 1.6487 > 1.28, A = 1: clipped.
// token_mean over 4 model tokens: L = (-2 s0 - 2·1.28)/4; every model token of episode 0 gets
// dL/dlogp = (s0/2)·(-1/4 - 1/4) = -s0/4, episode 1 gets 0.
static void test_gspo_hand(void) {
    const float old[5] = {-1, -4, -2, -1, -1.5f};
    const double lr[5] = {0.1, 2.0, 0.3, 0.5, 0.5};
    const uint8_t M[5] = {1, 0, 1, 1, 1};
    const float A[5] = {1, 1, 1, 1, 1};
    float lp[5], dl[5];
    for (int t = 0; t < 5; t++) lp[t] = (float)(old[t] + lr[t]);
    const size_t off[3] = {0, 3, 5};
    mtrl_algo_batch b = {.n_seq = 2, .off = off, .logp = lp, .logp_old = old, .logp_behav = old, .adv = A,
                         .mask = M};
    mtrl_algo_config c = cfg_make(MTRL_ALGO_LOSS_GSPO, MTRL_ALGO_AGG_TOKEN_MEAN, MTRL_ALGO_CORR_NONE);
    mtrl_algo_stats st;
    double L = loss_of(&c, &b, dl, NULL, &st);
    const double s0 = exp(0.2), s1 = exp(0.5);
    TEST_CLOSE(L, (-2 * s0 - 2 * 1.28) / 4, 0, 1e-6);
    const double g[5] = {-s0 / 4, 0, -s0 / 4, 0, 0};
    TEST_ARRAY_CLOSE(dl, g, 5, 0, 1e-6);
    TEST_CLOSE(st.clip_high_frac, 0.5, 0, 1e-12);
    TEST_CLOSE(st.ratio_mean, (2 * s0 + 2 * s1) / 4, 0, 1e-6);

    // seq_mean_token_mean (GSPO as published): L = (1/2)(-s0 - 1.28), episode 0 tokens get
    // (s0/2)·(-1/(2·2) - 1/(2·2)) = -s0/4 again (n_0 = 2 here, so the modes agree on the gradient).
    c.aggregation = MTRL_ALGO_AGG_SEQ_MEAN_TOKEN_MEAN;
    L = loss_of(&c, &b, dl, NULL, NULL);
    TEST_CLOSE(L, (-s0 - 1.28) / 2, 0, 1e-6);
    TEST_ARRAY_CLOSE(dl, g, 5, 0, 1e-6);

    // A < 0 on episode 1: s1 > 1.28 is the unclipped branch, ℓ = s1 per token, and both of its
    // tokens get (s1/2)·(1/4 + 1/4) = s1/4 under token_mean.
    const float A2[5] = {1, 1, 1, -1, -1};
    b.adv = A2;
    c.aggregation = MTRL_ALGO_AGG_TOKEN_MEAN;
    L = loss_of(&c, &b, dl, NULL, NULL);
    TEST_CLOSE(L, (-2 * s0 + 2 * s1) / 4, 0, 1e-6);
    TEST_CLOSE(dl[3], s1 / 4, 0, 1e-6);
    TEST_CLOSE(dl[4], s1 / 4, 0, 1e-6);
}

// ---- aggregation ------------------------------------------------------------------------------

// Two episodes of different lengths, PPO with every ratio inside [0.8, 1.28], so ℓ = -rA and
// dℓ/dlogp = -rA:
//   episode 0: {prompt, model, model}, r {1.0, 1.1}, A = 2    ℓ = {-2, -2.2}      Σ = -4.2, n = 2
//   episode 1: {model, tool, model, model}, r {0.9, 1.0, 1.2}, A = -1
//                                                            ℓ = {0.9, 1.0, 1.2} Σ = 3.1,  n = 3
//   token_mean           (-4.2 + 3.1)/5 = -0.22            gradients ℓ/5
//   seq_mean_token_mean  (-4.2/2 + 3.1/3)/2 = -0.5333...   episode 0 ℓ/4, episode 1 ℓ/6
//   constant (L = 4)     (-4.2 + 3.1)/(2·4) = -0.1375      gradients ℓ/8
static void test_aggregation(void) {
    const double r[7] = {1, 1.0, 1.1, 0.9, 1, 1.0, 1.2};
    const float A[7] = {2, 2, 2, -1, -1, -1, -1};
    const uint8_t M[7] = {0, 1, 1, 1, 0, 1, 1};
    float old[7], lp[7], dl[7];
    for (int t = 0; t < 7; t++) {
        old[t] = (float)(-1.0 - 0.2 * t);
        lp[t] = (float)(old[t] + log(r[t]));
    }
    const size_t off[3] = {0, 3, 7};
    mtrl_algo_batch b = {.n_seq = 2, .off = off, .logp = lp, .logp_old = old, .logp_behav = old, .adv = A,
                         .mask = M};
    const double l[7] = {0, -2, -2.2, 0.9, 0, 1.0, 1.2};
    const double wantL[3] = {-0.22, (-4.2 / 2 + 3.1 / 3) / 2, -1.1 / 8};
    const double div[3][2] = {{5, 5}, {4, 6}, {8, 8}}; // per-token divisor, episode 0 and 1
    for (int g = 0; g < 3; g++) {
        mtrl_algo_config c = cfg_make(MTRL_ALGO_LOSS_PPO, (mtrl_algo_agg)g, MTRL_ALGO_CORR_NONE);
        c.agg_constant = 4;
        double L = loss_of(&c, &b, dl, NULL, NULL);
        TEST_CHECKF(fabs(L - wantL[g]) < 1e-6, "%s: L %.9f want %.9f", mtrl_algo_agg_name(c.aggregation), L,
                    wantL[g]);
        double want[7];
        for (int t = 0; t < 7; t++) want[t] = l[t] / div[g][t < 3 ? 0 : 1];
        TEST_ARRAY_CLOSE(dl, want, 7, 0, 1e-6);
    }
    TEST_CLOSE(wantL[1], -0.53333333333, 0, 1e-10);
}

// ---- corrections ------------------------------------------------------------------------------

// TIS with logp_old = logp (one step per batch: r = 1 exactly), A = 1, cap 2. The raw weights
// π_old/π_behav = {0.5, 1.5, 3} become w = {0.5, 1.5, 2}; ℓ_t = -w_t, so L = -(0.5+1.5+2)/3 and
// dL/dlogp_t = -w_t/3.
static void test_tis(void) {
    const float lp[3] = {-1.0f, -2.0f, -0.5f};
    const double raw[3] = {0.5, 1.5, 3.0};
    float behav[3], dl[3];
    for (int t = 0; t < 3; t++) behav[t] = (float)(lp[t] - log(raw[t]));
    const float A[3] = {1, 1, 1};
    const uint8_t M[3] = {1, 1, 1};
    const size_t off[2] = {0, 3};
    mtrl_algo_batch b = {.n_seq = 1, .off = off, .logp = lp, .logp_old = lp, .logp_behav = behav, .adv = A,
                         .mask = M};
    mtrl_algo_config c = cfg_make(MTRL_ALGO_LOSS_PPO, MTRL_ALGO_AGG_TOKEN_MEAN, MTRL_ALGO_CORR_TIS);
    mtrl_algo_stats st;
    double L = loss_of(&c, &b, dl, NULL, &st);
    TEST_CLOSE(L, -4.0 / 3, 0, 1e-6);
    const double g[3] = {-0.5 / 3, -1.5 / 3, -2.0 / 3};
    TEST_ARRAY_CLOSE(dl, g, 3, 0, 1e-6);
    TEST_CLOSE(st.tis_capped_frac, 1.0 / 3, 0, 1e-12);
    TEST_CLOSE(st.tis_weight_mean, 4.0 / 3, 0, 1e-6);
    TEST_CLOSE(st.ratio_mean, 1.0, 0, 0);
    TEST_CLOSE(st.kl_k1, -(log(0.5) + log(1.5) + log(3.0)) / 3, 0, 1e-6); // mean(behav - logp)
    TEST_CLOSE(st.clip_low_frac + st.clip_high_frac, 0.0, 0, 0);

    // Correction none on the same inputs: w = 1, L = -1.
    c.correction = MTRL_ALGO_CORR_NONE;
    TEST_CLOSE(loss_of(&c, &b, dl, NULL, NULL), -1.0, 0, 1e-7);
    // A lower cap truncates all three: w = 0.4 each (cap below 1 is allowed: pure shrinkage).
    c.correction = MTRL_ALGO_CORR_TIS;
    c.tis_cap = 0.4;
    TEST_CLOSE(loss_of(&c, &b, dl, NULL, &st), -0.4, 0, 1e-7);
    TEST_CLOSE(st.tis_capped_frac, 1.0, 0, 0);
    // logp_old == logp_behav: w = 1 exactly, TIS is a no-op.
    c.tis_cap = 2;
    b.logp_old = behav;
    const double L_tis = loss_of(&c, &b, dl, NULL, &st);
    c.correction = MTRL_ALGO_CORR_NONE;
    TEST_CLOSE(L_tis, loss_of(&c, &b, NULL, NULL, NULL), 0, 0);
    TEST_CLOSE(st.tis_weight_mean, 1.0, 0, 0);
}

// seq_mask with [0.5, 2] on 4 episodes of 2 model tokens, r = 1 (logp = logp_old), per-token
// log(π_old/π_behav):
//   episode 0 {log 1.2, log 1.2}   geometric mean 1.2      kept      A = 1
//   episode 1 {log 3,   log 3}     3 > 2                   dropped   A = 1
//   episode 2 {log .25, log .25}   0.25 < 0.5              dropped   A = -1
//   episode 3 {log 4,   log 0.5}   sqrt(2), inside         kept      A = 2 (one token's ratio is 4)
// ℓ = -A on kept tokens; dropped episodes stay in the denominator: L = (-1·2 - 2·2)/8 = -0.75.
static void test_seq_mask(void) {
    const double q[8] = {1.2, 1.2, 3, 3, 0.25, 0.25, 4, 0.5};
    const float A[8] = {1, 1, 1, 1, -1, -1, 2, 2};
    const uint8_t M[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    float old[8], lp[8], behav[8], dl[8];
    for (int t = 0; t < 8; t++) {
        old[t] = (float)(-1.0 - 0.125 * t);
        lp[t] = old[t];
        behav[t] = (float)(old[t] - log(q[t]));
    }
    const size_t off[5] = {0, 2, 4, 6, 8};
    mtrl_algo_batch b = {.n_seq = 4, .off = off, .logp = lp, .logp_old = old, .logp_behav = behav, .adv = A,
                         .mask = M};
    mtrl_algo_config c = cfg_make(MTRL_ALGO_LOSS_PPO, MTRL_ALGO_AGG_TOKEN_MEAN, MTRL_ALGO_CORR_SEQ_MASK);
    mtrl_algo_stats st;
    double L = loss_of(&c, &b, dl, NULL, &st);
    TEST_CLOSE(L, -0.75, 0, 1e-7);
    const double g[8] = {-1.0 / 8, -1.0 / 8, 0, 0, 0, 0, -2.0 / 8, -2.0 / 8};
    TEST_ARRAY_CLOSE(dl, g, 8, 0, 1e-7);
    TEST_CLOSE(st.masked_frac, 0.5, 0, 0);
    TEST_EQ_INT(st.n_seq_masked, 2);
    TEST_CLOSE(st.tis_weight_mean, 0.5, 0, 0);
    // seq_mean_token_mean still divides by N = 4 episodes: L = (-1 + 0 + 0 - 2)/4.
    c.aggregation = MTRL_ALGO_AGG_SEQ_MEAN_TOKEN_MEAN;
    TEST_CLOSE(loss_of(&c, &b, NULL, NULL, NULL), -0.75, 0, 1e-7);
    // Widened bounds keep everything: L = (-2 - 2 + 2 - 4)/8 = -0.75 by coincidence; use
    // the gradient of episode 2 instead (-A/8 = 1/8).
    c.aggregation = MTRL_ALGO_AGG_TOKEN_MEAN;
    c.seq_mask_low = 0.2;
    c.seq_mask_high = 5;
    loss_of(&c, &b, dl, NULL, &st);
    TEST_CLOSE(dl[4], 1.0 / 8, 0, 1e-7);
    TEST_EQ_INT(st.n_seq_masked, 0);
}

// token_mask (IcePop-style): tokens whose ratio old/behav is outside [0.5, 5] or that are more
// than token_mask_stale versions old carry no loss and no gradient, NaN
// outside; they keep their place in the denominator; with TIS the kept tokens keep their weight.
static void test_token_mask(void) {
    const double q[8] = {1.2, 6, 0.4, 1, 0.55, 4.5, 1, 1};
    const uint32_t stale[8] = {0, 0, 0, 0, 0, 0, 3, 2};
    const float A[8] = {1, 1, 1, 1, -1, -1, 2, 2};
    const uint8_t M[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    float old[8], lp[8], behav[8], dl[8];
    for (int t = 0; t < 8; t++) {
        old[t] = (float)(-1.0 - 0.125 * t);
        lp[t] = old[t];
        behav[t] = (float)(old[t] - log(q[t]));
    }
    const size_t off[3] = {0, 4, 8};
    mtrl_algo_batch b = {.n_seq = 2, .off = off, .logp = lp, .logp_old = old, .logp_behav = behav, .adv = A,
                         .mask = M, .stale = stale};
    mtrl_algo_config c = cfg_make(MTRL_ALGO_LOSS_PPO, MTRL_ALGO_AGG_TOKEN_MEAN, MTRL_ALGO_CORR_NONE);
    c.token_mask = 1;
    c.token_mask_stale = 2;
    mtrl_algo_stats st;
    // r = 1 everywhere, so every kept token's term is -A/8 and its gradient -A/8.
    double L = loss_of(&c, &b, dl, NULL, &st);
    const double g[8] = {-1.0 / 8, 0, 0, -1.0 / 8, 1.0 / 8, 1.0 / 8, 0, -2.0 / 8};
    TEST_ARRAY_CLOSE(dl, g, 8, 0, 1e-7);
    TEST_CLOSE(L, (-1 - 1 + 1 + 1 - 2) / 8.0, 0, 1e-7);
    TEST_CLOSE(st.token_masked_frac, 3.0 / 8, 0, 0);
    TEST_CLOSE(st.token_stale_frac, 1.0 / 8, 0, 0);
    TEST_CLOSE(st.tis_weight_mean, 5.0 / 8, 0, 0);
    // No age limit, or no ages given: only the ratio decides.
    c.token_mask_stale = 0;
    TEST_CLOSE(loss_of(&c, &b, NULL, NULL, &st), (-1 - 1 + 1 + 1 - 2 - 2) / 8.0, 0, 1e-7);
    TEST_CLOSE(st.token_masked_frac, 2.0 / 8, 0, 0);
    c.token_mask_stale = 2;
    b.stale = NULL;
    TEST_CLOSE(loss_of(&c, &b, NULL, NULL, &st), (-1 - 1 + 1 + 1 - 2 - 2) / 8.0, 0, 1e-7);
    b.stale = stale;
    // With TIS the kept tokens are weighted min(q, tis_cap = 2): token 5 (q = 5) gets 2.
    c.correction = MTRL_ALGO_CORR_TIS;
    loss_of(&c, &b, dl, NULL, &st);
    TEST_CLOSE(dl[5], 2.0 / 8, 0, 1e-7);
    TEST_CLOSE(dl[0], -1.2 / 8, 0, 1e-6);
    TEST_CLOSE(dl[1], 0, 0, 0);
    // A NaN behaviour log-prob is outside the bounds: masked, and no NaN reaches the gradient.
    behav[0] = NAN;
    L = loss_of(&c, &b, dl, NULL, &st);
    TEST_CHECK(isfinite(L));
    TEST_CLOSE(dl[0], 0, 0, 0);
    TEST_CLOSE(st.token_masked_frac, 4.0 / 8, 0, 0);
    // Off: nothing masked (TIS as before).
    c.token_mask = 0;
    behav[0] = (float)(old[0] - log(q[0]));
    loss_of(&c, &b, dl, NULL, &st);
    TEST_CLOSE(st.token_masked_frac, 0, 0, 0);
    TEST_CHECK(dl[1] != 0);
    // Bounds must bracket 1.
    char msg[256];
    c.token_mask_low = 1.5;
    TEST_EQ_INT(mtrl_algo_config_check(&c, msg, sizeof msg), MTRL_ERR_USAGE);
    TEST_CONTAINS(msg, "algo.token_mask_low = 1.5");
}

// ---- finite differences over every (loss x aggregation x correction) ---------------------------

typedef struct fd_rng {
    uint64_t s;
} fd_rng;

static double fd_uniform(fd_rng *r) { // xorshift64*, [0, 1)
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    return (double)((r->s * 2685821657736338717ULL) >> 11) / 9007199254740992.0;
}

// A value in [lo, hi) on the 2^-16 grid (exact in f32 for |x| < 128, and so is x ± 2^-12).
static float fd_grid(fd_rng *r, double lo, double hi) {
    return (float)(ldexp(floor(ldexp(lo + (hi - lo) * fd_uniform(r), 16)), -16));
}

// Distance of a log-ratio from the kinks of the clipped term (log 0.8, log 1.28, log 3).
static int fd_far_from_kinks(double lr) {
    const double k[3] = {log(0.8), log(1.28), log(3.0)};
    for (int i = 0; i < 3; i++)
        if (fabs(lr - k[i]) < 0.02) return 0;
    return 1;
}

#define FD_N 5
#define FD_T 30

typedef struct fd_case {
    size_t off[FD_N + 1];
    float lp[FD_T], old[FD_T], behav[FD_T], adv[FD_T], H[FD_T];
    uint8_t M[FD_T];
} fd_case;

// Five episodes of 7, 9, 2 (all tool tokens), 5 and 7 tokens; a quarter of the tokens masked.
// Ratios are re-drawn per episode until every token's log-ratio and the episode's mean are at
// least 0.02 from a kink. Episode 1 is pushed off-policy (π_old/π_behav ~ e^0.875) so seq_mask
// drops it; tis_cap 2 truncates some weights. Episode 3 has per-token (not broadcast) advantages.
static void fd_case_make(fd_case *fc, uint64_t seed) {
    fd_rng rng = {seed};
    const size_t len[FD_N] = {7, 9, 2, 5, 7};
    fc->off[0] = 0;
    for (int i = 0; i < FD_N; i++) fc->off[i + 1] = fc->off[i] + len[i];
    for (int i = 0; i < FD_N; i++) {
        const size_t t0 = fc->off[i], t1 = fc->off[i + 1];
        double a_ep = (fd_uniform(&rng) < 0.5 ? -1 : 1) * (0.3 + 1.7 * fd_uniform(&rng));
        for (;;) {
            double sum = 0;
            size_t n = 0;
            int ok = 1;
            for (size_t t = t0; t < t1; t++) {
                fc->M[t] = i != 2 && fd_uniform(&rng) >= 0.25;
                fc->lp[t] = fd_grid(&rng, -4, -0.05);
                float lr = fd_grid(&rng, -0.9, 1.6);
                fc->old[t] = fc->lp[t] - lr; // exact: both on the grid
                float d = fd_grid(&rng, -0.8, 0.8) + (i == 1 ? 0.875f : 0.0f);
                fc->behav[t] = fc->old[t] - d;
                fc->adv[t] = (float)(i == 3 ? 2 * fd_uniform(&rng) - 1 : a_ep);
                fc->H[t] = fd_grid(&rng, 0, 3);
                if (fc->M[t]) {
                    ok &= fd_far_from_kinks(lr);
                    sum += lr;
                    n++;
                }
            }
            if (ok && (n == 0 || fd_far_from_kinks(sum / (double)n)) && (i == 2 || n > 0)) break;
        }
    }
}

static double fd_loss(const mtrl_algo_config *c, const fd_case *fc) {
    mtrl_algo_batch b = {.n_seq = FD_N, .off = fc->off, .logp = fc->lp, .logp_old = fc->old,
                         .logp_behav = fc->behav, .adv = fc->adv, .mask = fc->M, .entropy = fc->H};
    double L = NAN;
    mtrl_algo_policy_loss(c, &b, &L, NULL, NULL, NULL);
    return L;
}

static void test_finite_differences(void) {
    const float h = 0x1p-12f;
    int n_combos = 0, n_masked_runs = 0;
    for (uint64_t seed = 1; seed <= 3; seed++) {
        fd_case fc;
        fd_case_make(&fc, 0x9E3779B97F4A7C15ULL * seed);
        const size_t T = fc.off[FD_N];
        for (int lo = 0; lo < 3; lo++)
            for (int ag = 0; ag < 3; ag++)
                for (int co = 0; co < 3; co++) {
                    mtrl_algo_config c = cfg_make((mtrl_algo_loss)lo, (mtrl_algo_agg)ag, (mtrl_algo_correction)co);
                    c.agg_constant = 6;
                    c.entropy_coef = 0.01;
                    c.seq_mask_low = 0.7; // episode 1's geometric-mean weight ~2.4 falls outside
                    c.seq_mask_high = 1.4;
                    mtrl_algo_batch b = {.n_seq = FD_N, .off = fc.off, .logp = fc.lp, .logp_old = fc.old,
                                         .logp_behav = fc.behav, .adv = fc.adv, .mask = fc.M, .entropy = fc.H};
                    float dl[FD_T], dH[FD_T];
                    double fd_l[FD_T], fd_h[FD_T];
                    mtrl_algo_stats st;
                    loss_of(&c, &b, dl, dH, &st);
                    n_masked_runs += st.n_seq_masked > 0;
                    for (size_t k = 0; k < T; k++) {
                        // CISPO's clip(r) and every correction weight are stop-gradient: shifting
                        // logp_old and logp_behav with logp keeps them fixed, so the difference
                        // sees only the logπ factor, which is what the returned gradient is.
                        fd_case p = fc, m = fc;
                        p.lp[k] += h;
                        m.lp[k] -= h;
                        if (c.loss == MTRL_ALGO_LOSS_CISPO) {
                            p.old[k] += h, p.behav[k] += h;
                            m.old[k] -= h, m.behav[k] -= h;
                        }
                        fd_l[k] = (fd_loss(&c, &p) - fd_loss(&c, &m)) / (2.0 * h);
                        p = fc, m = fc;
                        p.H[k] += h;
                        m.H[k] -= h;
                        fd_h[k] = (fd_loss(&c, &p) - fd_loss(&c, &m)) / (2.0 * h);
                    }
                    double gmax = 0;
                    for (size_t k = 0; k < T; k++) gmax = fmax(gmax, fabs(dl[k]));
                    TEST_CHECKF(gmax > 1e-3, "%s/%s/%s: gradient vanished", mtrl_algo_loss_name(c.loss),
                                mtrl_algo_agg_name(c.aggregation), mtrl_algo_correction_name(c.correction));
                    double worst = 0;
                    size_t wk = 0;
                    for (size_t k = 0; k < T; k++) {
                        double e = fabs(dl[k] - fd_l[k]) - (1e-5 * fabs(fd_l[k]) + 1e-8);
                        if (e > worst) worst = e, wk = k;
                    }
                    TEST_CHECKF(worst <= 0, "seed %d %s/%s/%s: token %zu dlogp %.9g fd %.9g", (int)seed,
                                mtrl_algo_loss_name(c.loss), mtrl_algo_agg_name(c.aggregation),
                                mtrl_algo_correction_name(c.correction), wk, dl[wk], fd_l[wk]);
                    TEST_ARRAY_CLOSE(dH, fd_h, T, 1e-5, 1e-9);
                    n_combos++;
                }
    }
    TEST_EQ_INT(n_combos, 81);
    TEST_CHECKF(n_masked_runs >= 27, "seq_mask dropped an episode in only %d runs", n_masked_runs);
}

// Data parallel: two calls over halves of the batch with the global denominators add up to the
// whole batch's loss and gradient, for every aggregation.
static void test_global_denominators(void) {
    fd_case fc;
    fd_case_make(&fc, 77);
    const size_t T = fc.off[FD_N], split = 2, ts = fc.off[split];
    size_t n_model = 0;
    for (size_t t = 0; t < T; t++) n_model += fc.M[t];
    for (int ag = 0; ag < 3; ag++) {
        mtrl_algo_config c = cfg_make(MTRL_ALGO_LOSS_GSPO, (mtrl_algo_agg)ag, MTRL_ALGO_CORR_SEQ_MASK);
        c.entropy_coef = 0.02;
        c.seq_mask_low = 0.7;
        c.seq_mask_high = 1.4;
        mtrl_algo_batch all = {.n_seq = FD_N, .off = fc.off, .logp = fc.lp, .logp_old = fc.old,
                               .logp_behav = fc.behav, .adv = fc.adv, .mask = fc.M, .entropy = fc.H};
        float dl[FD_T], dh[FD_T], dl2[FD_T], dh2[FD_T];
        const double L = loss_of(&c, &all, dl, dh, NULL);
        size_t off2[FD_N + 1];
        for (size_t i = split; i <= FD_N; i++) off2[i - split] = fc.off[i] - ts;
        mtrl_algo_batch a = all, z = all;
        a.n_seq = split;
        z.n_seq = FD_N - split;
        z.off = off2;
        z.logp = fc.lp + ts, z.logp_old = fc.old + ts, z.logp_behav = fc.behav + ts;
        z.adv = fc.adv + ts, z.mask = fc.M + ts, z.entropy = fc.H + ts;
        a.token_denom = z.token_denom = (double)n_model;
        a.seq_denom = z.seq_denom = FD_N;
        const double L1 = loss_of(&c, &a, dl2, dh2, NULL);
        const double L2 = loss_of(&c, &z, dl2 + ts, dh2 + ts, NULL);
        TEST_CLOSE(L1 + L2, L, 1e-12, 1e-15);
        TEST_ARRAY_CLOSE(dl2, dl, T, 1e-6, 0);
        TEST_ARRAY_CLOSE(dh2, dh, T, 1e-6, 0);
    }
}

// ---- mismatch report --------------------------------------------------------------------------

// T = 40 in 16 bins: bin b is [floor(2.5 b), floor(2.5 (b+1))), sizes 2,3,2,3,...
// logp = -1 everywhere; logp_behav = -1 + 0.01 b in bin b, so Δ = -0.01 b on every model token
// of bin b: mean |Δ| = 0.01 b, k1 = 0.01 b, k3 = e^{0.01 b} - 1 - 0.01 b. Positions 4, 9, 14, ...
// are tool tokens with behav -9 (must be ignored). Two outliers: position 13 (bin 5) has Δ = +1,
// position 38 (bin 15) has Δ = -0.5. Worst 4 by |Δ|: 13 (1.0), 38 (0.5), 37 (0.15), then the
// exact tie 35/36 (0.14) goes to the earlier position, 35.
static void test_mismatch(void) {
    enum { T = 40 };
    const size_t begin[17] = {0, 2, 5, 7, 10, 12, 15, 17, 20, 22, 25, 27, 30, 32, 35, 37, 40};
    float lp[T], behav[T];
    uint8_t M[T];
    for (size_t b = 0; b < 16; b++)
        for (size_t t = begin[b]; t < begin[b + 1]; t++) {
            lp[t] = -1.0f;
            behav[t] = (float)(-1.0 + 0.01 * (double)b);
            M[t] = t % 5 != 4;
            if (!M[t]) behav[t] = -9.0f;
        }
    behav[13] = -2.0f; // Δ = +1
    behav[38] = -0.5f; // Δ = -0.5
    size_t worst[4];
    mtrl_algo_mismatch m;
    TEST_EQ_INT(mtrl_algo_mismatch_report(lp, behav, M, T, MTRL_ALGO_MISMATCH_BINS, worst, 4, &m), MTRL_OK);
    TEST_EQ_INT(m.n_bins, 16);
    TEST_EQ_INT(m.n_worst, 4);
    const size_t want_worst[4] = {13, 38, 37, 35};
    TEST_ARRAY_CLOSE(worst, want_worst, 4, 0, 0);
    size_t n_total = 0;
    for (size_t b = 0; b < 16; b++) {
        const mtrl_algo_mismatch_bin *bin = &m.bins[b];
        TEST_EQ_INT(bin->begin, begin[b]);
        TEST_EQ_INT(bin->end, begin[b + 1]);
        size_t n = 0;
        for (size_t t = begin[b]; t < begin[b + 1]; t++) n += M[t];
        TEST_EQ_INT(bin->n, n);
        n_total += n;
        if (b == 5 || b == 15) continue; // the outliers' bins, below
        const double x = 0.01 * (double)b;
        TEST_CHECKF(fabs(bin->absdiff_mean - x) < 1e-6 && fabs(bin->absdiff_max - x) < 1e-6 &&
                        fabs(bin->k1 - x) < 1e-6 && fabs(bin->k3 - (exp(x) - 1 - x)) < 1e-7,
                    "bin %zu: mean %g max %g k1 %g k3 %g, want %g / k3 %g", b, bin->absdiff_mean, bin->absdiff_max,
                    bin->k1, bin->k3, x, exp(x) - 1 - x);
    }
    // Bin 5 = [12, 15): position 12 (Δ = -0.05), 13 (Δ = +1), 14 tool.
    TEST_EQ_INT(m.bins[5].n, 2);
    TEST_CLOSE(m.bins[5].absdiff_mean, (0.05 + 1.0) / 2, 0, 1e-6);
    TEST_CLOSE(m.bins[5].absdiff_max, 1.0, 0, 0);
    TEST_CLOSE(m.bins[5].k1, (0.05 - 1.0) / 2, 0, 1e-6);
    TEST_CLOSE(m.bins[5].k3, ((exp(0.05) - 1 - 0.05) + (exp(-1.0) - 1 + 1)) / 2, 0, 1e-7);
    // Bin 15 = [37, 40): 37 (Δ = -0.15), 38 (Δ = -0.5), 39 tool.
    TEST_CLOSE(m.bins[15].absdiff_mean, (0.15 + 0.5) / 2, 0, 1e-6);
    TEST_CLOSE(m.bins[15].absdiff_max, 0.5, 0, 0);
    TEST_CLOSE(m.bins[15].k3, ((exp(0.15) - 1 - 0.15) + (exp(0.5) - 1 - 0.5)) / 2, 0, 1e-7);
    TEST_EQ_INT(m.all.n, n_total);
    TEST_EQ_INT(m.all.n, 32);
    TEST_EQ_INT(m.all.begin, 0);
    TEST_EQ_INT(m.all.end, 40);
    TEST_CLOSE(m.all.absdiff_max, 1.0, 0, 0);

    // More worst slots than model tokens: every model token, worst first.
    size_t many[64];
    TEST_EQ_INT(mtrl_algo_mismatch_report(lp, behav, M, T, 16, many, 64, &m), MTRL_OK);
    TEST_EQ_INT(m.n_worst, 32);
    int sorted = 1;
    for (size_t i = 1; i < m.n_worst; i++) {
        double a = fabs((double)lp[many[i - 1]] - behav[many[i - 1]]), c = fabs((double)lp[many[i]] - behav[many[i]]);
        sorted &= a > c || (a == c && many[i - 1] < many[i]);
        sorted &= M[many[i]] != 0;
    }
    TEST_CHECK(sorted);

    // T < B: 5 tokens in 16 bins, bin b = [floor(5b/16), floor(5(b+1)/16)); most are empty.
    TEST_EQ_INT(mtrl_algo_mismatch_report(lp, behav, M, 5, 16, NULL, 0, &m), MTRL_OK);
    size_t covered = 0, nonempty = 0;
    for (size_t b = 0; b < 16; b++) {
        covered += m.bins[b].end - m.bins[b].begin;
        nonempty += m.bins[b].end > m.bins[b].begin;
        if (m.bins[b].n == 0) TEST_CHECK(m.bins[b].absdiff_mean == 0 && m.bins[b].k3 == 0);
    }
    TEST_EQ_INT(covered, 5);
    TEST_EQ_INT(nonempty, 5);
    TEST_EQ_INT(m.bins[3].begin, 0); // floor(15/16) = 0, floor(20/16) = 1
    TEST_EQ_INT(m.bins[3].end, 1);
    TEST_EQ_INT(m.all.n, 4);

    // A NaN log-prob ranks first and poisons the means.
    lp[20] = NAN;
    TEST_EQ_INT(mtrl_algo_mismatch_report(lp, behav, M, T, 16, worst, 2, &m), MTRL_OK);
    TEST_EQ_INT(worst[0], 20);
    TEST_EQ_INT(worst[1], 13);
    TEST_CHECK(isnan(m.all.absdiff_mean));
    TEST_CHECK(isnan(m.bins[8].absdiff_max));
    TEST_CHECK(!isnan(m.bins[7].absdiff_max));

    TEST_EQ_INT(mtrl_algo_mismatch_report(lp, behav, M, T, 0, NULL, 0, &m), MTRL_ERR_USAGE);
    TEST_EQ_INT(mtrl_algo_mismatch_report(lp, behav, M, T, 65, NULL, 0, &m), MTRL_ERR_USAGE);
    TEST_EQ_INT(mtrl_algo_mismatch_report(lp, behav, M, T, 16, NULL, 3, &m), MTRL_ERR_USAGE);
}

int main(void) {
    test_config();
    test_advantages();
    test_ppo();
    test_cispo();
    test_gspo_hand();
    test_aggregation();
    test_tis();
    test_seq_mask();
    test_token_mask();
    test_finite_differences();
    test_global_denominators();
    test_mismatch();
    return test_report();
}
