// picture.c: the built-in `picture` env: read a digit out of a generated picture (env ABI 1.1).
//
// Task: a picture of `digits` boxes side by side (each box 6 x 6 pixels, the picture 6·n wide
// and 6 high, black background), each box holding one digit drawn in a 3 x 5 pixel font at
// column 1, row 0 of its box, in one of five grey levels (160..255). The question names a box:
//     prompt:  "box 2?"  with the picture
//     answer:  "7"       (the digit in box 2, counting from 1; surrounding whitespace ignored)
// The answer is only in the pixels: the text never names the digit. Reward 1 for the right
// digit, 0 otherwise. The same seed gives the same picture and question.
// Tool: crop(k) -> "cropped" with a picture of box k alone (6 x 6): the agentic route, since
// finding the k-th box in a row of patch tokens is harder for a small model than reading one
// patch. A bad k is an error observation ("error: box 9 out of range 1..3"); a call past
// max_tool_calls ends the episode with reward 0.
// Config: digits=1..6 boxes (1), max_tool_calls=0..1000 (4). Keys of other built-ins are
// ignored (env_util.h).
// demo: crop(k), then the digit.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/rng.h"
#include "env/builtin/builtin.h"
#include "env/env_util.h"

#define PICTURE_TOOLS "crop"
#define BOX 6 // pixels per box side (a model with [model] image_patch = 6 sees one box per patch)

// 3 x 5 glyphs, one row of 3 bits per line, the top row first.
static const uint8_t font_[10][5] = {
    {7, 5, 5, 5, 7}, {2, 6, 2, 2, 7}, {7, 1, 7, 4, 7}, {7, 1, 7, 1, 7}, {5, 5, 7, 1, 1},
    {7, 4, 7, 1, 7}, {7, 4, 7, 5, 7}, {7, 1, 2, 2, 2}, {7, 5, 7, 5, 7}, {7, 5, 7, 1, 7},
};
static const uint8_t colours_[5][3] = {{255, 255, 255}, {224, 224, 224}, {192, 192, 192}, {176, 176, 176}, {160, 160, 160}};

typedef struct picture_env {
    int boxes, max_tool_calls;
    int digit[6], colour[6], target; // target: 0-based box the question names
    uint8_t rgb[BOX * BOX * 6 * 3];  // the prompt's picture [BOX][6·BOX][3]
    uint8_t crop[BOX * BOX * 3];     // the last crop
    const uint8_t *pic;              // the picture of the last reset/step (NULL: none)
    uint32_t pic_w, pic_h;
    char prompt[32], answer[16], demo_call[32];
    mtrl_env_action demo[2];
    int tool_calls, done;
    env_buf obs;
} picture_env;

void env_picture_draw(uint8_t *rgb, uint32_t stride_px, int digit, const uint8_t colour[3]) {
    for (int y = 0; y < BOX; y++)
        for (int x = 0; x < BOX; x++) {
            uint8_t *p = rgb + ((size_t)y * stride_px + (size_t)x) * 3;
            int gx = x - 1, on = y < 5 && gx >= 0 && gx < 3 && ((font_[digit][y] >> (2 - gx)) & 1);
            p[0] = on ? colour[0] : 0;
            p[1] = on ? colour[1] : 0;
            p[2] = on ? colour[2] : 0;
        }
}

static int picture_create_(const char *config, void **self, char *err, size_t cap) {
    env_config cfg;
    if (env_config_parse(&cfg, "picture", config, err, cap)) return MTRL_ENV_ERR;
    long long boxes, mtc;
    int bad = env_config_int(&cfg, "digits", 1, 1, 6, &boxes, err, cap) ||
              env_config_int(&cfg, "max_tool_calls", 4, 0, 1000, &mtc, err, cap) ||
              env_config_finish(&cfg, "digits, max_tool_calls", err, cap);
    env_config_free(&cfg);
    if (bad) return MTRL_ENV_ERR;
    picture_env *e = xcalloc(1, sizeof *e);
    e->boxes = (int)boxes;
    e->max_tool_calls = (int)mtc;
    e->done = 1;
    *self = e;
    return MTRL_ENV_OK;
}

static void picture_destroy_(void *self) {
    picture_env *e = self;
    if (!e) return;
    env_buf_free(&e->obs);
    free(e);
}

static int picture_reset_(void *self, uint64_t seed, mtrl_env_bytes *prompt, char *err, size_t cap) {
    (void)err, (void)cap;
    picture_env *e = self;
    uint64_t stream = mtrl_rng_stream("env.picture", 0, 0), ctr = 0;
    for (int b = 0; b < e->boxes; b++) {
        e->digit[b] = (int)(mtrl_rng_u64(seed, stream, ctr++) % 10);
        e->colour[b] = (int)(mtrl_rng_u64(seed, stream, ctr++) % 5);
        env_picture_draw(e->rgb + (size_t)b * BOX * 3, (uint32_t)(BOX * e->boxes), e->digit[b], colours_[e->colour[b]]);
    }
    e->target = (int)(mtrl_rng_u64(seed, stream, ctr++) % (uint64_t)e->boxes);
    snprintf(e->prompt, sizeof e->prompt, "box %d?", e->target + 1);
    snprintf(e->answer, sizeof e->answer, "%d", e->digit[e->target]);
    snprintf(e->demo_call, sizeof e->demo_call, "crop(%d)", e->target + 1);
    e->pic = e->rgb;
    e->pic_w = (uint32_t)(BOX * e->boxes);
    e->pic_h = BOX;
    e->tool_calls = 0;
    e->done = 0;
    prompt->data = e->prompt;
    prompt->len = strlen(e->prompt);
    return MTRL_ENV_OK;
}

static int picture_step_(void *self, uint32_t kind, const char *action, size_t len, mtrl_env_step_out *out,
                         char *err, size_t cap) {
    picture_env *e = self;
    env_tool_call c;
    e->pic = NULL;
    switch (env_step_begin("picture", &e->done, &e->tool_calls, e->max_tool_calls, PICTURE_TOOLS, kind, action, len,
                           &e->obs, out, &c, err, cap)) {
    case ENV_STEP_ERR: return MTRL_ENV_ERR;
    case ENV_STEP_DONE: break;
    case ENV_STEP_ANSWER: out->reward = env_answer_is(action, len, e->answer) ? 1.0 : 0.0; break;
    case ENV_STEP_TOOL: {
        int64_t k;
        if (!env_tool_is(&c, "crop")) {
            env_tool_error_unknown(&e->obs, &c, PICTURE_TOOLS);
            out->tool_error = 1;
        } else if (env_parse_i64(c.args, c.args_len, &k) != 0 || k < 1 || k > e->boxes) {
            env_buf_puts(&e->obs, "error: box ");
            env_buf_append_shown(&e->obs, c.args, c.args_len, 16);
            env_buf_printf(&e->obs, " out of range 1..%d", e->boxes);
            out->tool_error = 1;
        } else {
            int b = (int)k - 1;
            env_picture_draw(e->crop, BOX, e->digit[b], colours_[e->colour[b]]);
            env_buf_puts(&e->obs, "cropped"); // no digit in the text: the answer is only in the picture
            e->pic = e->crop;
            e->pic_w = e->pic_h = BOX;
        }
        break;
    }
    }
    env_step_end(&e->obs, 0, out);
    return MTRL_ENV_OK;
}

static int picture_image_(void *self, mtrl_env_image *out, char *err, size_t cap) {
    (void)err, (void)cap;
    picture_env *e = self;
    if (!e->pic) return MTRL_ENV_OK;
    out->data = e->pic;
    out->width = e->pic_w;
    out->height = e->pic_h;
    out->len = (size_t)3 * e->pic_w * e->pic_h;
    return MTRL_ENV_OK;
}

static int picture_demo_(void *self, mtrl_env_demo_out *out, char *err, size_t cap) {
    picture_env *e = self;
    return env_demo_call_answer("picture", e->done, e->demo, e->demo_call, e->answer, out, err, cap);
}

static int picture_describe_(void *self, mtrl_env_bytes *out, char *err, size_t cap) {
    (void)self, (void)err, (void)cap;
    static const char text[] = "crop(k): a picture of box k alone (1 = the leftmost)\n";
    out->data = text;
    out->len = sizeof text - 1;
    return MTRL_ENV_OK;
}

const mtrl_env_api env_picture_api = {
    .abi_version = MTRL_ENV_ABI_VERSION,
    .struct_size = sizeof(mtrl_env_api),
    .name = "picture",
    .version = "1",
    .flags = MTRL_ENV_FLAG_THREAD_SAFE,
    .create = picture_create_,
    .destroy = picture_destroy_,
    .reset = picture_reset_,
    .step = picture_step_,
    .demo = picture_demo_,
    .describe = picture_describe_,
    .image = picture_image_,
};
