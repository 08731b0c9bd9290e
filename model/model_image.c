// model_image.c: the patch embedding of image tokens (see model_image.h, model.h).
#include "model/model_image.h"

#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/image.h"
#include "model/backend.h"

void mtrl_model_set_patches(mtrl_model *m, const uint8_t *rows, int n) {
    MTRL_CHECK(n >= 0 && (n == 0 || rows));
    m->img_rows = rows;
    m->img_n = n;
}

void model_image_ids(int T, const uint32_t *tokens, int *tid) {
    for (int t = 0; t < T; t++) tid[t] = mtrl_img_token_is(tokens[t]) ? 0 : (int)tokens[t];
}

// The segment's image tokens: their count, and X [n][F] on the host when x is non-NULL.
static int image_rows_(const mtrl_model *m, int T, const uint32_t *tokens, real *x) {
    int P = m->dims.image_patch, pb = 3 * P * P, F = pb + 4, n = 0;
    for (int t = 0; t < T; t++) {
        uint32_t id = tokens[t];
        if (!mtrl_img_token_is(id)) continue;
        MTRL_CHECKF(P > 0, "image token %#x at position %d of a model without [model] image_patch", id, t);
        if (x) {
            real *r = x + (size_t)n * F;
            memset(r, 0, sizeof(real) * (size_t)F);
            if (mtrl_img_token_is_patch(id)) {
                uint32_t row = mtrl_img_patch_row(id);
                MTRL_CHECKF(row < (uint32_t)m->img_n, "image token names patch row %u of a table of %d (mtrl_model_set_patches)",
                            row, m->img_n);
                const uint8_t *px = m->img_rows + (size_t)row * pb;
                for (int j = 0; j < pb; j++) r[j] = (real)px[j] / (real)255;
                r[pb] = 1;
            } else {
                uint32_t k = id - MTRL_IMG_TOKEN_BASE;
                MTRL_CHECKF(k < 3, "unknown image token %#x at position %d", id, t);
                r[pb + 1 + k] = 1;
            }
        }
        n++;
    }
    return n;
}

// Copies rows between emb (position order) and Y (image-token order), run by run; dir 0: Y to
// emb, 1: emb to Y, 2: zero emb's rows.
static void runs_(mtrl_backend *be, int T, int d, const uint32_t *tokens, real *emb, real *y, int dir) {
    int r = 0;
    for (int t = 0; t < T;) {
        if (!mtrl_img_token_is(tokens[t])) {
            t++;
            continue;
        }
        int t0 = t;
        while (t < T && mtrl_img_token_is(tokens[t])) t++;
        size_t bytes = sizeof(real) * (size_t)(t - t0) * d;
        real *e = emb + (size_t)t0 * d, *yy = y ? y + (size_t)r * d : NULL;
        if (dir == 0) be->copy(be, e, yy, bytes);
        else if (dir == 1) be->copy(be, yy, e, bytes);
        else be->zero(be, e, bytes);
        r += t - t0;
    }
}

void model_image_fwd(mtrl_model *m, int T, const uint32_t *tokens, real *emb) {
    int n = image_rows_(m, T, tokens, NULL);
    if (n == 0) return;
    mtrl_backend *be = m->be;
    int P = m->dims.image_patch, F = 3 * P * P + 4, d = m->dims.d;
    real *xh = xmalloc(sizeof(real) * (size_t)n * F);
    image_rows_(m, T, tokens, xh);
    real *x = be->alloc(be, sizeof(real) * (size_t)n * F), *y = be->alloc(be, sizeof(real) * (size_t)n * d);
    be->upload(be, x, xh, sizeof(real) * (size_t)n * F);
    be->gemm(be, 0, 1, n, d, F, 1, x, F, m->dP.patch_w, F, 0, y, d);
    runs_(be, T, d, tokens, emb, y, 0);
    be->release(be, x);
    be->release(be, y);
    free(xh);
}

void model_image_bwd(mtrl_model *m, int T, const uint32_t *tokens, real *demb) {
    int n = image_rows_(m, T, tokens, NULL);
    if (n == 0) return;
    mtrl_backend *be = m->be;
    int P = m->dims.image_patch, F = 3 * P * P + 4, d = m->dims.d;
    real *xh = xmalloc(sizeof(real) * (size_t)n * F);
    image_rows_(m, T, tokens, xh);
    real *x = be->alloc(be, sizeof(real) * (size_t)n * F), *dy = be->alloc(be, sizeof(real) * (size_t)n * d);
    be->upload(be, x, xh, sizeof(real) * (size_t)n * F);
    runs_(be, T, d, tokens, demb, dy, 1);
    be->gemm(be, 1, 0, d, F, n, 1, dy, d, x, F, 1, m->dG.patch_w, F);
    runs_(be, T, d, tokens, demb, NULL, 2);
    be->release(be, x);
    be->release(be, dy);
    free(xh);
}
