// algo.c: advantages, policy losses with their gradient, and mismatch reports (see algo.h).
#include "learner/algo.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

// ---- configuration ----------------------------------------------------------------------------

mtrl_algo_config mtrl_algo_config_default(void) {
    mtrl_algo_config c;
    memset(&c, 0, sizeof c);
    c.advantage = MTRL_ALGO_ADV_GRPO;
    c.loss = MTRL_ALGO_LOSS_PPO;
    c.correction = MTRL_ALGO_CORR_TIS;
    c.aggregation = MTRL_ALGO_AGG_TOKEN_MEAN;
    c.eps_low = 0.2;
    c.eps_high = 0.28;
    c.dual_clip = 3.0;
    c.tis_cap = 2.0;
    c.seq_mask_low = 0.5;
    c.seq_mask_high = 2.0;
    c.agg_constant = 1024;
    c.entropy_coef = 0.0;
    c.token_mask = 0;
    c.token_mask_low = 0.5;
    c.token_mask_high = 5.0;
    c.token_mask_stale = 0;
    return c;
}

static mtrl_status algo_usage_(char *msg, size_t cap, const char *fmt, ...) {
    if (msg && cap) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, cap, fmt, ap);
        va_end(ap);
    }
    return MTRL_ERR_USAGE;
}

mtrl_status mtrl_algo_config_check(const mtrl_algo_config *c, char *msg, size_t cap) {
    if (msg && cap) msg[0] = '\0';
    if (!c) return algo_usage_(msg, cap, "algo: no config");
    if ((unsigned)c->advantage > MTRL_ALGO_ADV_RLOO)
        return algo_usage_(msg, cap, "algo.advantage = %d: not one of grpo|dr_grpo|rloo", (int)c->advantage);
    if ((unsigned)c->loss > MTRL_ALGO_LOSS_GSPO)
        return algo_usage_(msg, cap, "algo.loss = %d: not one of ppo|cispo|gspo", (int)c->loss);
    if ((unsigned)c->correction > MTRL_ALGO_CORR_SEQ_MASK)
        return algo_usage_(msg, cap, "algo.correction = %d: not one of none|tis|seq_mask", (int)c->correction);
    if ((unsigned)c->aggregation > MTRL_ALGO_AGG_CONSTANT)
        return algo_usage_(msg, cap, "algo.aggregation = %d: not one of token_mean|seq_mean_token_mean|constant",
                           (int)c->aggregation);
    // The negated comparisons also reject NaN.
    if (!(c->eps_low >= 0 && c->eps_low < 1))
        return algo_usage_(msg, cap, "algo.eps_low = %g: must be in [0, 1)", c->eps_low);
    if (!(c->eps_high >= 0 && isfinite(c->eps_high)))
        return algo_usage_(msg, cap, "algo.eps_high = %g: must be >= 0 and finite", c->eps_high);
    // c <= 1 would cap every negative-advantage token below its unclipped loss and silently
    // drop all their gradient (verl asserts clip_ratio_c > 1 for the same reason).
    if (!(c->dual_clip == 0 || (c->dual_clip > 1 && isfinite(c->dual_clip))))
        return algo_usage_(msg, cap, "algo.dual_clip = %g: must be 0 (off) or greater than 1", c->dual_clip);
    if (!(c->tis_cap > 0 && isfinite(c->tis_cap)))
        return algo_usage_(msg, cap, "algo.tis_cap = %g: must be > 0 and finite", c->tis_cap);
    if (!(c->seq_mask_low >= 0 && c->seq_mask_low <= c->seq_mask_high && isfinite(c->seq_mask_high)))
        return algo_usage_(msg, cap, "algo.seq_mask_low = %g, seq_mask_high = %g: need 0 <= low <= high < inf",
                           c->seq_mask_low, c->seq_mask_high);
    if (!(c->agg_constant >= 1 && isfinite(c->agg_constant)))
        return algo_usage_(msg, cap, "algo.agg_constant = %g: must be >= 1", c->agg_constant);
    if (!(c->token_mask_low >= 0 && c->token_mask_low <= 1 && c->token_mask_high >= 1 && isfinite(c->token_mask_high)))
        return algo_usage_(msg, cap, "algo.token_mask_low = %g, token_mask_high = %g: need 0 <= low <= 1 <= high < inf",
                           c->token_mask_low, c->token_mask_high);
    if (c->token_mask_stale < 0)
        return algo_usage_(msg, cap, "algo.token_mask_stale = %ld: must be >= 0", c->token_mask_stale);
    if (!isfinite(c->entropy_coef))
        return algo_usage_(msg, cap, "algo.entropy_coef = %g: must be finite", c->entropy_coef);
    return MTRL_OK;
}

static const char *const algo_adv_names_[] = {"grpo", "dr_grpo", "rloo"};
static const char *const algo_loss_names_[] = {"ppo", "cispo", "gspo"};
static const char *const algo_corr_names_[] = {"none", "tis", "seq_mask"};
static const char *const algo_agg_names_[] = {"token_mean", "seq_mean_token_mean", "constant"};

static int algo_lookup_(const char *const *names, int n, const char *name) {
    if (!name) return -1;
    for (int i = 0; i < n; i++)
        if (strcmp(names[i], name) == 0) return i;
    return -1;
}

#define ALGO_COUNT_(a) ((int)(sizeof(a) / sizeof((a)[0])))

int mtrl_algo_advantage_parse(const char *n) { return algo_lookup_(algo_adv_names_, ALGO_COUNT_(algo_adv_names_), n); }
int mtrl_algo_loss_parse(const char *n) { return algo_lookup_(algo_loss_names_, ALGO_COUNT_(algo_loss_names_), n); }
int mtrl_algo_correction_parse(const char *n) {
    return algo_lookup_(algo_corr_names_, ALGO_COUNT_(algo_corr_names_), n);
}
int mtrl_algo_agg_parse(const char *n) { return algo_lookup_(algo_agg_names_, ALGO_COUNT_(algo_agg_names_), n); }

const char *mtrl_algo_advantage_name(mtrl_algo_advantage a) {
    return (unsigned)a < (unsigned)ALGO_COUNT_(algo_adv_names_) ? algo_adv_names_[a] : "?";
}
const char *mtrl_algo_loss_name(mtrl_algo_loss l) {
    return (unsigned)l < (unsigned)ALGO_COUNT_(algo_loss_names_) ? algo_loss_names_[l] : "?";
}
const char *mtrl_algo_correction_name(mtrl_algo_correction c) {
    return (unsigned)c < (unsigned)ALGO_COUNT_(algo_corr_names_) ? algo_corr_names_[c] : "?";
}
const char *mtrl_algo_agg_name(mtrl_algo_agg g) {
    return (unsigned)g < (unsigned)ALGO_COUNT_(algo_agg_names_) ? algo_agg_names_[g] : "?";
}

// ---- advantages -------------------------------------------------------------------------------

void mtrl_algo_advantages(mtrl_algo_advantage kind, const double *rewards, size_t G, double *adv) {
    if (G == 0) return;
    if (G == 1) {
        adv[0] = 0.0;
        return;
    }
    // All-equal rewards carry no signal (DAPO drops such groups); return exact zeros instead of
    // the rounding residue of R_i - mean, which GRPO would blow up by 1/eps.
    size_t same = 1;
    while (same < G && rewards[same] == rewards[0]) same++;
    if (same == G) {
        for (size_t i = 0; i < G; i++) adv[i] = 0.0;
        return;
    }
    double mean = 0.0;
    for (size_t i = 0; i < G; i++) mean += rewards[i];
    mean /= (double)G;
    double var = 0.0;
    for (size_t i = 0; i < G; i++) var += (rewards[i] - mean) * (rewards[i] - mean);
    var /= (double)G;
    // Scale of (R_i - mean): GRPO divides by the group std; RLOO's leave-one-out baseline
    // R_i - (G·mean - R_i)/(G-1) equals G/(G-1)·(R_i - mean), which avoids the cancellation.
    double scale = 1.0;
    switch (kind) {
    case MTRL_ALGO_ADV_GRPO: scale = 1.0 / (sqrt(var) + MTRL_ALGO_GRPO_EPS); break;
    case MTRL_ALGO_ADV_DR_GRPO: scale = 1.0; break;
    case MTRL_ALGO_ADV_RLOO: scale = (double)G / (double)(G - 1); break;
    }
    for (size_t i = 0; i < G; i++) adv[i] = (rewards[i] - mean) * scale;
}

void mtrl_algo_advantages_broadcast(const double *adv_ep, const size_t *off, size_t n_seq, float *adv_tok) {
    for (size_t i = 0; i < n_seq; i++)
        for (size_t t = off[i]; t < off[i + 1]; t++) adv_tok[t] = (float)adv_ep[i];
}

// ---- policy loss ------------------------------------------------------------------------------

enum { ALGO_CLIP_NONE_, ALGO_CLIP_LOW_, ALGO_CLIP_HIGH_, ALGO_CLIP_DUAL_ };

// The clipped surrogate ℓ = -min(xA, clip(x, lo, hi)A), then min(ℓ, -cA) for A < 0 when c > 0.
// Returns ℓ; *dl_dx = dℓ/dx (0 on a clipped branch); *clip says which clip was taken. Ties take
// the unclipped branch (x == hi with A > 0 keeps its gradient).
static double algo_clip_term_(double x, double a, double lo, double hi, double c, double *dl_dx, int *clip) {
    *clip = ALGO_CLIP_NONE_;
    *dl_dx = 0.0;
    if (a == 0.0) return 0.0;
    if (a > 0.0) {
        if (x > hi) {
            *clip = ALGO_CLIP_HIGH_;
            return -hi * a;
        }
        *dl_dx = -a; // x < lo: min picks x·A, the unclipped branch
        return -x * a;
    }
    if (x < lo) {
        *clip = ALGO_CLIP_LOW_;
        return -lo * a;
    }
    double l = -x * a; // x > hi: min picks x·A (A < 0), unclipped
    if (c > 0.0 && l > -c * a) {
        *clip = ALGO_CLIP_DUAL_;
        return -c * a;
    }
    *dl_dx = -a;
    return l;
}

mtrl_status mtrl_algo_policy_loss(const mtrl_algo_config *cfg, const mtrl_algo_batch *b, double *loss,
                                  float *dlogp, float *dentropy, mtrl_algo_stats *stats) {
    if (mtrl_algo_config_check(cfg, NULL, 0) != MTRL_OK) return MTRL_ERR_USAGE;
    if (!b || !loss || !b->off || (b->n_seq > 0 && (!b->logp || !b->logp_old || !b->logp_behav || !b->adv ||
                                                    !b->mask)))
        return MTRL_ERR_USAGE;
    if (cfg->entropy_coef != 0.0 && !b->entropy) return MTRL_ERR_USAGE;
    if (b->off[0] != 0) return MTRL_ERR_MISMATCH;
    for (size_t i = 0; i < b->n_seq; i++)
        if (b->off[i + 1] < b->off[i]) return MTRL_ERR_MISMATCH;

    const size_t N = b->n_seq;
    size_t n_model = 0;
    for (size_t t = 0; t < b->off[N]; t++) n_model += b->mask[t] != 0;

    const double tok_denom = b->token_denom > 0 ? b->token_denom : (double)n_model;
    const double seq_denom = b->seq_denom > 0 ? b->seq_denom : (double)N;
    const double lo = 1.0 - cfg->eps_low, hi = 1.0 + cfg->eps_high, c = cfg->dual_clip;
    // Compared in log space: exp of a long episode's summed log-ratio could overflow, its mean
    // cannot; log(0) = -inf makes a zero lower bound accept everything.
    const double log_mask_lo = log(cfg->seq_mask_low), log_mask_hi = log(cfg->seq_mask_high);
    const double log_tok_lo = log(cfg->token_mask_low), log_tok_hi = log(cfg->token_mask_high);

    double pg = 0.0, ent = 0.0;
    double sum_ratio = 0, sum_k1 = 0, sum_k3 = 0, sum_abs = 0, sum_w = 0, sum_h = 0;
    size_t n_low = 0, n_high = 0, n_dual = 0, n_masked = 0, n_capped = 0, n_seq_masked = 0, n_tok = 0, n_tok_stale = 0;

    for (size_t i = 0; i < N; i++) {
        const size_t t0 = b->off[i], t1 = b->off[i + 1];
        size_t n_i = 0;
        double sum_lr_old = 0.0, sum_old_behav = 0.0;
        for (size_t t = t0; t < t1; t++) {
            if (!b->mask[t]) continue;
            n_i++;
            sum_lr_old += (double)b->logp[t] - (double)b->logp_old[t];
            sum_old_behav += (double)b->logp_old[t] - (double)b->logp_behav[t];
        }
        if (n_i == 0) {
            for (size_t t = t0; t < t1; t++) {
                if (dlogp) dlogp[t] = 0.0f;
                if (dentropy) dentropy[t] = 0.0f;
            }
            continue;
        }
        double agg;
        switch (cfg->aggregation) {
        case MTRL_ALGO_AGG_SEQ_MEAN_TOKEN_MEAN: agg = 1.0 / (seq_denom * (double)n_i); break;
        case MTRL_ALGO_AGG_CONSTANT: agg = 1.0 / (seq_denom * cfg->agg_constant); break;
        default: agg = 1.0 / tok_denom; break;
        }
        int keep = 1;
        if (cfg->correction == MTRL_ALGO_CORR_SEQ_MASK) {
            double m = sum_old_behav / (double)n_i;
            keep = m >= log_mask_lo && m <= log_mask_hi; // NaN drops the episode
            if (!keep) n_seq_masked++;
        }
        const double s = exp(sum_lr_old / (double)n_i); // gspo's sequence ratio
        double gspo_sum = 0.0; // Σ_t a_t w_t dℓ_t/ds, over the episode

        for (size_t t = t0; t < t1; t++) {
            if (!b->mask[t]) {
                if (dlogp) dlogp[t] = 0.0f;
                if (dentropy) dentropy[t] = 0.0f;
                continue;
            }
            const double lp = b->logp[t], lp_old = b->logp_old[t], lp_b = b->logp_behav[t];
            const double a = b->adv[t];
            const double lr = lp - lp_b;
            sum_k1 += -lr;
            sum_k3 += exp(-lr) - 1.0 + lr;
            sum_abs += fabs(lr);

            double w = 1.0;
            if (cfg->correction == MTRL_ALGO_CORR_TIS) {
                w = exp(lp_old - lp_b);
                if (w > cfg->tis_cap) {
                    w = cfg->tis_cap;
                    n_capped++;
                }
            } else if (!keep) {
                w = 0.0;
                n_masked++;
            }
            int keep_t = keep;
            if (cfg->token_mask && keep) {
                const double lk = lp_old - lp_b;
                const int old = cfg->token_mask_stale > 0 && b->stale && (long)b->stale[t] > cfg->token_mask_stale;
                if (old || !(lk >= log_tok_lo && lk <= log_tok_hi)) { // NaN is outside
                    w = 0.0;
                    keep_t = 0;
                    n_tok++;
                    n_tok_stale += old;
                }
            }
            sum_w += w;

            double l = 0.0, g = 0.0, dl_dx = 0.0;
            int clip = ALGO_CLIP_NONE_;
            switch (cfg->loss) {
            case MTRL_ALGO_LOSS_PPO: {
                const double r = exp(lp - lp_old);
                sum_ratio += r;
                l = algo_clip_term_(r, a, lo, hi, c, &dl_dx, &clip);
                g = dl_dx * r; // dr/dlogp = r
                break;
            }
            case MTRL_ALGO_LOSS_CISPO: {
                const double r = exp(lp - lp_old);
                sum_ratio += r;
                double rc = r;
                if (r < lo) {
                    rc = lo;
                    clip = ALGO_CLIP_LOW_;
                } else if (r > hi) {
                    rc = hi;
                    clip = ALGO_CLIP_HIGH_;
                }
                l = -rc * a * lp;
                g = -rc * a;
                break;
            }
            case MTRL_ALGO_LOSS_GSPO:
                sum_ratio += s;
                l = algo_clip_term_(s, a, lo, hi, c, &dl_dx, &clip);
                gspo_sum += agg * w * dl_dx;
                break;
            }
            if (keep_t) {
                n_low += clip == ALGO_CLIP_LOW_;
                n_high += clip == ALGO_CLIP_HIGH_;
                n_dual += clip == ALGO_CLIP_DUAL_;
                pg += agg * w * l;
            }
            // a masked token's gradient is 0 even when its ratio is NaN (gspo: overwritten below)
            if (dlogp) dlogp[t] = keep_t || !cfg->token_mask ? (float)(agg * w * g) : 0.0f;
            if (b->entropy) {
                ent += agg * (double)b->entropy[t];
                sum_h += b->entropy[t];
            }
            if (dentropy) dentropy[t] = (float)(-cfg->entropy_coef * agg);
        }
        if (cfg->loss == MTRL_ALGO_LOSS_GSPO && dlogp) {
            // ds/dlogp_u = s·M_u/n_i: every model token of the episode gets the same share.
            const float gu = (float)(gspo_sum * s / (double)n_i);
            for (size_t t = t0; t < t1; t++)
                if (b->mask[t]) dlogp[t] = gu;
        }
    }

    const double L = pg - cfg->entropy_coef * ent;
    *loss = L;
    if (stats) {
        memset(stats, 0, sizeof *stats);
        const double nm = n_model ? (double)n_model : 1.0; // all sums are 0 when n_model = 0
        stats->loss = L;
        stats->pg_loss = pg;
        stats->entropy_bonus = ent;
        stats->n_tokens = n_model;
        stats->n_seq = N;
        stats->clip_low_frac = (double)n_low / nm;
        stats->clip_high_frac = (double)n_high / nm;
        stats->dual_clip_frac = (double)n_dual / nm;
        stats->ratio_mean = sum_ratio / nm;
        stats->kl_k1 = sum_k1 / nm;
        stats->kl_k3 = sum_k3 / nm;
        stats->logp_absdiff_mean = sum_abs / nm;
        stats->masked_frac = (double)n_masked / nm;
        stats->n_seq_masked = n_seq_masked;
        stats->tis_capped_frac = (double)n_capped / nm;
        stats->tis_weight_mean = sum_w / nm;
        stats->entropy_mean = sum_h / nm;
        stats->token_masked_frac = (double)n_tok / nm;
        stats->token_stale_frac = (double)n_tok_stale / nm;
    }
    return MTRL_OK;
}

// ---- mismatch report --------------------------------------------------------------------------

// |Δ| used for ranking: NaN ranks above everything so a broken token is always reported.
static double algo_rank_key_(const float *logp, const float *behav, size_t t) {
    double d = fabs((double)logp[t] - (double)behav[t]);
    return isnan(d) ? INFINITY : d;
}

// "u is worse than v": larger key, or equal key and earlier position.
static int algo_worse_(const float *logp, const float *behav, size_t u, size_t v) {
    double ku = algo_rank_key_(logp, behav, u), kv = algo_rank_key_(logp, behav, v);
    return ku > kv || (ku == kv && u < v);
}

// Min-heap on "worse": the root is the least bad of the tokens kept so far.
static void algo_heap_down_(size_t *h, size_t n, size_t i, const float *logp, const float *behav) {
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && algo_worse_(logp, behav, h[m], h[l])) m = l;
        if (r < n && algo_worse_(logp, behav, h[m], h[r])) m = r;
        if (m == i) return;
        size_t tmp = h[i];
        h[i] = h[m];
        h[m] = tmp;
        i = m;
    }
}

static void algo_heap_up_(size_t *h, size_t i, const float *logp, const float *behav) {
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!algo_worse_(logp, behav, h[p], h[i])) return;
        size_t tmp = h[i];
        h[i] = h[p];
        h[p] = tmp;
        i = p;
    }
}

typedef struct algo_acc_ {
    size_t n;
    double sum_abs, max_abs, sum_k1, sum_k3;
} algo_acc_;

static void algo_acc_add_(algo_acc_ *a, double d) {
    double ad = fabs(d);
    a->n++;
    a->sum_abs += ad;
    if (isnan(ad) || isnan(a->max_abs)) a->max_abs = NAN; // a NaN max must not be forgotten
    else if (ad > a->max_abs) a->max_abs = ad;
    a->sum_k1 += -d;
    a->sum_k3 += exp(-d) - 1.0 + d;
}

static void algo_acc_finish_(const algo_acc_ *a, size_t begin, size_t end, mtrl_algo_mismatch_bin *out) {
    out->begin = begin;
    out->end = end;
    out->n = a->n;
    if (a->n == 0) {
        out->absdiff_mean = out->absdiff_max = out->k1 = out->k3 = 0.0;
        return;
    }
    out->absdiff_mean = a->sum_abs / (double)a->n;
    out->absdiff_max = a->max_abs;
    out->k1 = a->sum_k1 / (double)a->n;
    out->k3 = a->sum_k3 / (double)a->n;
}

mtrl_status mtrl_algo_mismatch_report(const float *logp, const float *logp_behav, const uint8_t *mask, size_t T,
                                      size_t n_bins, size_t *worst, size_t n_worst_cap, mtrl_algo_mismatch *out) {
    if (!out || n_bins == 0 || n_bins > MTRL_ALGO_MISMATCH_MAX_BINS) return MTRL_ERR_USAGE;
    if (T > 0 && (!logp || !logp_behav || !mask)) return MTRL_ERR_USAGE;
    if (n_worst_cap > 0 && !worst) return MTRL_ERR_USAGE;
    memset(out, 0, sizeof *out);
    out->n_bins = n_bins;

    algo_acc_ all = {0};
    size_t n_heap = 0;
    for (size_t bin = 0; bin < n_bins; bin++) {
        // floor(bin·T/n_bins) without overflow for any realistic T (T·64 < 2^64).
        const size_t begin = bin * T / n_bins, end = (bin + 1) * T / n_bins;
        algo_acc_ acc = {0};
        for (size_t t = begin; t < end; t++) {
            if (!mask[t]) continue;
            const double d = (double)logp[t] - (double)logp_behav[t];
            algo_acc_add_(&acc, d);
            algo_acc_add_(&all, d);
            if (n_worst_cap == 0) continue;
            if (n_heap < n_worst_cap) {
                worst[n_heap] = t;
                algo_heap_up_(worst, n_heap, logp, logp_behav);
                n_heap++;
            } else if (algo_worse_(logp, logp_behav, t, worst[0])) {
                worst[0] = t;
                algo_heap_down_(worst, n_heap, 0, logp, logp_behav);
            }
        }
        algo_acc_finish_(&acc, begin, end, &out->bins[bin]);
    }
    algo_acc_finish_(&all, 0, T, &out->all);

    // Heap sort: popping the least bad to the back leaves the worst first.
    for (size_t n = n_heap; n > 1; n--) {
        size_t tmp = worst[0];
        worst[0] = worst[n - 1];
        worst[n - 1] = tmp;
        algo_heap_down_(worst, n - 1, 0, logp, logp_behav);
    }
    out->n_worst = n_heap;
    return MTRL_OK;
}
