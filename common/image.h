// image.h: pictures as tokens of the backbone's stream (docs/multimodal.md).
//
// An RGB8 picture of w x h pixels (env ABI 1.1, env/mtrl_env.h "images") is cut into P x P
// patches, rows = ceil(h / P) by cols = ceil(w / P), the right and bottom edges padded with
// black. In the token stream it reads
//     IMG_START  p(0,0) p(0,1) .. p(0,cols-1) IMG_ROW  p(1,0) .. IMG_ROW  ..  IMG_END
// one row break after every row of patches, so a stack without positions (NoPE) sees where a
// row ends. The ids live above every vocabulary (MTRL_IMG_TOKEN_BASE): the model embeds them
// through its patch embedding (model.h mtrl_model_set_patches), never samples them, and gives
// no log-prob to them. A patch token names a row of a patch table: PATCH0 + i is row i, the
// P x P x 3 bytes of one patch in raster order (pixel rows top to bottom, R G B per pixel).
#ifndef MTRL_IMAGE_H
#define MTRL_IMAGE_H

#include <stddef.h>
#include <stdint.h>

#define MTRL_IMG_TOKEN_BASE 0x40000000u
#define MTRL_IMG_START (MTRL_IMG_TOKEN_BASE + 0u)
#define MTRL_IMG_ROW (MTRL_IMG_TOKEN_BASE + 1u)
#define MTRL_IMG_END (MTRL_IMG_TOKEN_BASE + 2u)
#define MTRL_IMG_PATCH0 (MTRL_IMG_TOKEN_BASE + 16u)
// Patch rows a stream may name (PATCH0 + i, i below this).
#define MTRL_IMG_PATCH_MAX (1u << 28)

static inline int mtrl_img_token_is(uint32_t id) { return id >= MTRL_IMG_TOKEN_BASE; }
static inline int mtrl_img_token_is_patch(uint32_t id) {
    return id >= MTRL_IMG_PATCH0 && id < MTRL_IMG_PATCH0 + MTRL_IMG_PATCH_MAX;
}

// Patches of a w x h picture (rows * cols) and its tokens (2 + rows * (cols + 1)).
size_t mtrl_image_patch_count(uint32_t w, uint32_t h, int P);
size_t mtrl_image_token_count(uint32_t w, uint32_t h, int P);
// Writes the picture's tokens to out [mtrl_image_token_count]; its patches are the rows
// first_patch, first_patch + 1, ... of the patch table, in raster order.
void mtrl_image_tokens(uint32_t w, uint32_t h, int P, uint32_t first_patch, uint32_t *out);
// Cuts rgb [h][w][3] into out [mtrl_image_patch_count][P][P][3] (padding 0).
void mtrl_image_patches(const uint8_t *rgb, uint32_t w, uint32_t h, int P, uint8_t *out);
// The patch-table row a patch token names.
static inline uint32_t mtrl_img_patch_row(uint32_t id) { return id - MTRL_IMG_PATCH0; }

#endif
