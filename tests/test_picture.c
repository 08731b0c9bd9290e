// mtrl-test: cpu timeout=300
// Pictures end to end on the CPU (docs/multimodal.md):
//  - the `picture` env (ABI 1.1): the same seed gives the same picture and question; the digit
//    asked for is drawn in the named box of the picture (read back by matching the font) and in
//    crop(k)'s picture; the demo solves the task; a bad crop is an error observation; in-process
//    and isolated alike;
//  - trajectories: a picture is stored once (by digest), patch rows follow the pictures' order;
//    an episode with pictures survives encode/decode bit for bit; a tampered picture (digest),
//    a wrong byte count or a patch token past the pictures' rows is refused (MTRL_ERR_FORMAT);
//  - the rollout on a tiny model with [model] image_patch = 6 after a short supervised warm-up on
//    picture demos (the learner's batch path with pictures): episodes carry their pictures and
//    image tokens in prompts and tool results, and each re-executed alone (replay --reexec) is
//    identical, pictures included; a model without image_patch aborts such episodes with the
//    reason.
#include <stdlib.h>
#include <string.h>

#include "env/env_host.h"
#include "actor/rollout.h"
#include "common/config.h"
#include "common/hash.h"
#include "common/image.h"
#include "common/tokenizer.h"
#include "env/builtin/builtin.h"
#include "env/env_config.h"
#include "learner/train.h"
#include "tests/testhelp.h"

static const uint8_t white_[3] = {255, 255, 255};

// The digit a 6 x 6 box at rgb (stride_px a row) shows, by matching each glyph's lit pixels;
// -1 when none matches.
static int read_box_(const uint8_t *rgb, uint32_t stride_px) {
    for (int d = 0; d < 10; d++) {
        uint8_t ref[6 * 6 * 3];
        env_picture_draw(ref, 6, d, white_);
        int same = 1;
        for (int y = 0; y < 6 && same; y++)
            for (int x = 0; x < 6 && same; x++) {
                const uint8_t *p = rgb + ((size_t)y * stride_px + (size_t)x) * 3;
                same = (p[0] + p[1] + p[2] > 0) == (ref[(y * 6 + x) * 3] > 0);
            }
        if (same) return d;
    }
    return -1;
}

static void test_env_(int isolate) {
    mtrl_env_opts o;
    mtrl_env_opts_default(&o);
    o.isolate = isolate;
    mtrl_env *e;
    mtrl_error err;
    TEST_CHECKF(mtrl_env_open(&e, "picture", "digits=3;max_tool_calls=3;ops=1", &o, &err) == MTRL_OK, "%s", err.msg);
    mtrl_env_result r;
    int seen[10] = {0};
    for (uint64_t seed = 1; seed <= 30; seed++) {
        TEST_EQ_INT(mtrl_env_reset(e, seed, &r, &err), MTRL_OK);
        int k = 0;
        TEST_CHECK(sscanf(r.obs, "box %d?", &k) == 1 && k >= 1 && k <= 3);
        TEST_CHECK(r.image && r.image_w == 18 && r.image_h == 6);
        if (!r.image) break;
        uint8_t first[18 * 6 * 3];
        memcpy(first, r.image, sizeof first);
        int digit = read_box_(r.image + (size_t)(k - 1) * 6 * 3, 18);
        TEST_CHECK(digit >= 0);
        if (digit >= 0) seen[digit]++;
        mtrl_env_demo_out d;
        TEST_EQ_INT(mtrl_env_demo(e, &d, &err), MTRL_OK);
        TEST_EQ_INT(d.count, 2);
        char want[16];
        snprintf(want, sizeof want, "crop(%d)", k);
        TEST_CHECK(d.actions[0].len == strlen(want) && !memcmp(d.actions[0].data, want, d.actions[0].len));
        TEST_CHECK(d.actions[1].len == 1 && d.actions[1].data[0] == '0' + digit);
        // a bad box, then the right crop: box k alone, the same digit
        TEST_EQ_INT(mtrl_env_step(e, MTRL_ENV_ACTION_TOOL, "crop(9)", 7, &r, &err), MTRL_OK);
        TEST_EQ_INT(r.tool_error, 1);
        TEST_CONTAINS(r.obs, "error: box 9 out of range 1..3");
        TEST_CHECK(r.image == NULL);
        TEST_EQ_INT(mtrl_env_step(e, MTRL_ENV_ACTION_TOOL, want, strlen(want), &r, &err), MTRL_OK);
        TEST_CHECK(r.image && r.image_w == 6 && r.image_h == 6);
        if (r.image) TEST_EQ_INT(read_box_(r.image, 6), digit);
        char ans[2] = {(char)('0' + digit), 0};
        TEST_EQ_INT(mtrl_env_step(e, MTRL_ENV_ACTION_ANSWER, ans, 1, &r, &err), MTRL_OK);
        TEST_EQ_INT(r.done, 1);
        TEST_EQ_INT((int)r.reward, 1);
        // the same seed: the same picture and question
        TEST_EQ_INT(mtrl_env_reset(e, seed, &r, &err), MTRL_OK);
        TEST_CHECK(r.image && !memcmp(r.image, first, sizeof first));
    }
    int kinds = 0;
    for (int dg = 0; dg < 10; dg++) kinds += seen[dg] > 0;
    TEST_CHECKF(kinds >= 6, "only %d different digits in 30 tasks", kinds);
    mtrl_env_close(e);
}

static void test_traj_(void) {
    mtrl_traj t, u;
    mtrl_traj_init(&t);
    mtrl_traj_init(&u);
    uint8_t a[12 * 6 * 3], b[6 * 6 * 3];
    for (size_t i = 0; i < sizeof a; i++) a[i] = (uint8_t)(i * 7);
    for (size_t i = 0; i < sizeof b; i++) b[i] = (uint8_t)(i * 3 + 1);
    t.episode_id = 9;
    mtrl_traj_append(&t, MTRL_TOK_BOS, 0, 0, MTRL_TOK_PROMPT, NULL);
    uint32_t ids[64];
    TEST_EQ_INT(mtrl_traj_add_image(&t, 6, a, 12, 6), 0);
    mtrl_image_tokens(12, 6, 6, 0, ids);
    for (size_t i = 0; i < mtrl_image_token_count(12, 6, 6); i++) mtrl_traj_append(&t, ids[i], 0, 0, MTRL_TOK_PROMPT, NULL);
    TEST_EQ_INT(mtrl_traj_add_image(&t, 6, b, 6, 6), 2);
    TEST_EQ_INT(mtrl_traj_add_image(&t, 6, a, 12, 6), 0); // stored once
    TEST_EQ_INT(t.n_images, 2);
    TEST_EQ_INT(mtrl_traj_patch_rows(&t), 3);
    mtrl_image_tokens(6, 6, 6, 2, ids);
    for (size_t i = 0; i < mtrl_image_token_count(6, 6, 6); i++) mtrl_traj_append(&t, ids[i], 0, 0, MTRL_TOK_TOOL, NULL);
    t.status = MTRL_EP_COMPLETE;
    mtrl_wbuf w, w2;
    mtrl_wbuf_init(&w);
    mtrl_wbuf_init(&w2);
    mtrl_traj_encode(&w, &t);
    mtrl_traj_limits lim = mtrl_traj_limits_default();
    mtrl_error err;
    TEST_EQ_INT(mtrl_traj_decode(&u, w.data, w.len, &lim, &err), MTRL_OK);
    char why[128];
    TEST_CHECKF(mtrl_traj_equal(&t, &u, why, sizeof why), "%s", why);
    mtrl_traj_encode(&w2, &u);
    TEST_CHECK(w2.len == w.len && !memcmp(w.data, w2.data, w.len));
    // the patch table is the pictures' patches in order
    uint8_t tab[3 * 108];
    mtrl_traj_patch_table(&u, tab);
    TEST_CHECK(tab[0] == a[0] && tab[3] == a[3] && tab[2 * 108] == b[0] && tab[2 * 108 + 18] == b[18]);
    // a tampered pixel: the digest no longer matches
    size_t at = w.len - 5;
    w.data[at] ^= 1;
    TEST_EQ_INT(mtrl_traj_decode(&u, w.data, w.len, &lim, &err), MTRL_ERR_FORMAT);
    TEST_CONTAINS(err.msg, "digest mismatch");
    w.data[at] ^= 1;
    lim.max_images = 1;
    TEST_EQ_INT(mtrl_traj_decode(&u, w.data, w.len, &lim, &err), MTRL_ERR_LIMIT);
    TEST_CONTAINS(err.msg, "max_images");
    lim = mtrl_traj_limits_default();
    // a patch token past the pictures' rows
    mtrl_traj_append(&t, MTRL_IMG_PATCH0 + 3, 0, 0, MTRL_TOK_TOOL, NULL);
    mtrl_wbuf_reset(&w);
    mtrl_traj_encode(&w, &t);
    TEST_EQ_INT(mtrl_traj_decode(&u, w.data, w.len, &lim, &err), MTRL_ERR_FORMAT);
    TEST_CONTAINS(err.msg, "names patch row 3, but its 2 pictures have 3 patch rows");
    mtrl_wbuf_free(&w);
    mtrl_wbuf_free(&w2);
    mtrl_traj_free(&t);
    mtrl_traj_free(&u);
}

typedef struct collected {
    mtrl_traj eps[64];
    int n;
} collected;

static void on_end_(void *u, mtrl_traj *t) {
    collected *c = u;
    if (c->n < 64) {
        mtrl_traj_init(&c->eps[c->n]);
        mtrl_traj_swap(&c->eps[c->n], t);
        c->n++;
    }
}

static void run_(const char *text, int warmup, collected *c, mtrl_config *cfg, mtrl_model *m, mtrl_rollout_params *p) {
    mtrl_config_errors errs = {0};
    TEST_EQ_INT(mtrl_config_load_text(cfg, "t.ini", text, NULL, 0, &errs), MTRL_OK);
    mtrl_config_errors_free(&errs);
    mtrl_model_dims d;
    mtrl_model_dims_from_config(&d, cfg, MTRL_VOCAB, NULL);
    mtrl_model_init(m, &d, 3);
    mtrl_rollout_params_from_config(p, cfg, 1, 5);
    mtrl_error err;
    mtrl_env *env;
    TEST_EQ_INT(mtrl_env_open_config(cfg, &env, &err), MTRL_OK);
    double first = 0, last = 0;
    for (int s = 0; s < warmup; s++) {
        mtrl_traj demos[8], *dp[8];
        for (int i = 0; i < 8; i++) {
            mtrl_traj_init(&demos[i]);
            TEST_EQ_INT(mtrl_train_demo_episode_images(env, 50 + 8 * (uint64_t)s + (uint64_t)i, 64, d.image_patch,
                                                       &demos[i], &err), MTRL_OK);
            dp[i] = &demos[i];
        }
        double loss = mtrl_train_sft_step(m, cfg, dp, 8, 5e-3);
        if (s == 0) first = loss;
        last = loss;
        for (int i = 0; i < 8; i++) mtrl_traj_free(&demos[i]);
    }
    if (warmup) {
        printf("warm-up on picture demos: loss %.3f -> %.3f over %d steps\n", first, last, warmup);
        TEST_CHECK(last < first);
    }
    mtrl_env_close(env);
    mtrl_rollout *r;
    TEST_EQ_INT(mtrl_rollout_init(&r, p, cfg, m, &err), MTRL_OK);
    mtrl_rollout_events ev = {c, NULL, on_end_, NULL};
    for (int k = 0; k < 400 && c->n < 24; k++) mtrl_rollout_step(r, &ev);
    mtrl_rollout_stop_new(r);
    while (mtrl_rollout_step(r, &ev) > 0) {}
    mtrl_rollout_free(r);
}

static void test_rollout_(void) {
    static const char text[] = "[run]\nseed = 5\n[model]\nimage_patch = 6\n[env]\nname = picture\ndigits = 2\n"
                               "max_tool_calls = 2\n[actor]\nepisodes_in_flight = 8\nmax_tokens = 64\n"
                               "max_turn_tokens = 16\n[algo]\ngroup_size = 2\n";
    mtrl_config cfg;
    mtrl_model m;
    mtrl_rollout_params p;
    collected c = {0};
    run_(text, 40, &c, &cfg, &m, &p);
    TEST_CHECK(c.n >= 24);
    mtrl_error err;
    mtrl_env *env;
    TEST_EQ_INT(mtrl_env_open_config(&cfg, &env, &err), MTRL_OK);
    int with_crop = 0, same = 0;
    for (int i = 0; i < c.n; i++) {
        mtrl_traj *t = &c.eps[i];
        TEST_CHECK(t->n_images >= 1 && t->image_patch == 6);
        TEST_EQ_INT(mtrl_traj_images_check(t, &err), MTRL_OK);
        TEST_CHECK(t->n_tokens > 9 && t->ids[1] == 'b' && t->ids[7] == MTRL_IMG_START); // "box k?" then the picture
        with_crop += t->n_images >= 2;
        mtrl_traj again;
        mtrl_traj_init(&again);
        mtrl_rollout_run_one(&p, &m, env, t->task_seed, t->episode_id, t->group_id, &again, &err);
        int eq = again.n_tokens == t->n_tokens && again.status == t->status && again.reward == t->reward &&
                 again.n_images == t->n_images;
        for (uint64_t k = 0; eq && k < t->n_tokens; k++)
            eq = again.ids[k] == t->ids[k] && again.logprob[k] == t->logprob[k] && again.kind[k] == t->kind[k];
        for (uint32_t k = 0; eq && k < t->n_images; k++) eq = again.images[k].digest == t->images[k].digest;
        same += eq;
        mtrl_traj_free(&again);
    }
    printf("rollout with pictures: %d episodes, %d with a cropped picture, %d identical when re-executed alone\n", c.n,
           with_crop, same);
    TEST_CHECK(with_crop >= 4); // tool results with pictures went through the batched prefill
    TEST_EQ_INT(same, c.n);
    for (int i = 0; i < c.n; i++) mtrl_traj_free(&c.eps[i]);
    mtrl_env_close(env);
    mtrl_model_free(&m);

    // A model that takes no pictures: each such episode is aborted with the reason.
    static const char text0[] = "[run]\nseed = 5\n[env]\nname = picture\n[actor]\nepisodes_in_flight = 2\n"
                                "max_tokens = 32\n[algo]\ngroup_size = 2\n";
    collected c0 = {0};
    run_(text0, 0, &c0, &cfg, &m, &p);
    TEST_CHECK(c0.n >= 2);
    for (int i = 0; i < c0.n; i++) {
        TEST_EQ_INT(c0.eps[i].status, MTRL_EP_ABORTED);
        TEST_CONTAINS(c0.eps[i].reason, "but the model takes none ([model] image_patch = 0)");
        mtrl_traj_free(&c0.eps[i]);
    }
    mtrl_model_free(&m);
}

int main(int argc, char **argv) {
    mtrl_env_host_main(argc, argv); // the isolated envs below start this program as their child
    test_env_(0);
    test_env_(1);
    test_traj_();
    test_rollout_();
    return test_report();
}
