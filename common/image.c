// image.c: a picture's patches and tokens (see image.h).
#include "common/image.h"

#include <string.h>

static size_t cells_(uint32_t n, int P) { return ((size_t)n + (size_t)P - 1) / (size_t)P; }

size_t mtrl_image_patch_count(uint32_t w, uint32_t h, int P) { return cells_(h, P) * cells_(w, P); }

size_t mtrl_image_token_count(uint32_t w, uint32_t h, int P) { return 2 + cells_(h, P) * (cells_(w, P) + 1); }

void mtrl_image_tokens(uint32_t w, uint32_t h, int P, uint32_t first_patch, uint32_t *out) {
    size_t rows = cells_(h, P), cols = cells_(w, P), k = 0;
    uint32_t id = MTRL_IMG_PATCH0 + first_patch;
    out[k++] = MTRL_IMG_START;
    for (size_t r = 0; r < rows; r++) {
        for (size_t c = 0; c < cols; c++) out[k++] = id++;
        out[k++] = MTRL_IMG_ROW;
    }
    out[k] = MTRL_IMG_END;
}

void mtrl_image_patches(const uint8_t *rgb, uint32_t w, uint32_t h, int P, uint8_t *out) {
    size_t rows = cells_(h, P), cols = cells_(w, P), pb = (size_t)3 * P * P;
    memset(out, 0, rows * cols * pb);
    for (size_t r = 0; r < rows; r++)
        for (size_t c = 0; c < cols; c++) {
            uint8_t *o = out + (r * cols + c) * pb;
            for (int y = 0; y < P; y++) {
                size_t py = r * (size_t)P + (size_t)y;
                if (py >= h) break;
                size_t x0 = c * (size_t)P, nx = x0 + (size_t)P <= w ? (size_t)P : w - x0;
                memcpy(o + (size_t)y * P * 3, rgb + (py * w + x0) * 3, nx * 3);
            }
        }
}
