// model_image.h: the patch embedding of image tokens inside the backbone (internal to
// model; the public side is model.h mtrl_model_set_patches, the token layout
// common/image.h). Every image token of a segment is embedded by one GEMM of the backend:
//     Y [n][d] = X [n][3P² + 4] · P.patch_wᵀ
// where row r of X is the r-th image token's input: a patch's pixels (v/255: black is 0) with a 1 in
// the bias column, or a one-hot of IMG_START / IMG_ROW / IMG_END. Y's rows replace the token
// embeddings at their positions (contiguous runs: a picture's tokens are consecutive). The
// backward gathers the same rows of ∂L/∂emb, adds ∂L/∂W = dYᵀ X and zeroes them, so the text
// embedding gets nothing from image positions. X is built on the host from the patch table and
// uploaded; X and Y are backend blocks of the call (not the activation arena, whose sizing is
// unchanged).
#ifndef MTRL_MODEL_IMAGE_H
#define MTRL_MODEL_IMAGE_H

#include <stdint.h>

#include "model/model.h"

// tid[t] = tokens[t], with image tokens as 0 (any valid row: embedding_fwd fills it, then
// model_image_fwd overwrites it).
void model_image_ids(int T, const uint32_t *tokens, int *tid);
// Overwrites emb [T][d] (backend memory) at the image tokens' positions. No image token: nothing.
void model_image_fwd(mtrl_model *m, int T, const uint32_t *tokens, real *emb);
// ∂L/∂patch_w += from demb [T][d] at the image positions, which it then zeroes.
void model_image_bwd(mtrl_model *m, int T, const uint32_t *tokens, real *demb);

#endif
