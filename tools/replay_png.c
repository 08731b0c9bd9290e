// replay_png.c: a recorded picture as a PNG file through libpng (mtrl replay --images).
#include <errno.h>
#include <png.h>
#include <stdio.h>
#include <string.h>

#include "tools/replay.h"

int replay_png_write(const char *path, const uint8_t *rgb, uint32_t w, uint32_t h, char *err, size_t cap) {
    FILE *f = fopen(path, "wb");
    if (!f) {
        snprintf(err, cap, "%s: cannot create: %s", path, strerror(errno));
        return -1;
    }
    png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, NULL, NULL, NULL);
    png_infop info = png ? png_create_info_struct(png) : NULL;
    if (!png || !info || setjmp(png_jmpbuf(png))) {
        // libpng reports its failures by longjmp to here; nothing half-written stays
        png_destroy_write_struct(&png, &info);
        fclose(f);
        remove(path);
        snprintf(err, cap, "%s: libpng could not write the picture", path);
        return -1;
    }
    png_init_io(png, f);
    png_set_IHDR(png, info, w, h, 8, PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
                 PNG_FILTER_TYPE_DEFAULT);
    png_write_info(png, info);
    for (uint32_t y = 0; y < h; y++) png_write_row(png, (png_const_bytep)(rgb + (size_t)y * w * 3));
    png_write_end(png, NULL);
    png_destroy_write_struct(&png, &info);
    if (fclose(f) != 0) {
        remove(path);
        snprintf(err, cap, "%s: write failed: %s", path, strerror(errno));
        return -1;
    }
    return 0;
}
