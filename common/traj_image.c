// traj_image.c: an episode's pictures, stored once by digest (see traj.h "pictures").
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/hash.h"
#include "common/image.h"
#include "common/traj.h"

static uint32_t patches_of_(const mtrl_traj *t, const mtrl_traj_image *im) {
    return (uint32_t)mtrl_image_patch_count(im->width, im->height, (int)t->image_patch);
}

uint32_t mtrl_traj_add_image(mtrl_traj *t, int P, const uint8_t *rgb, uint32_t w, uint32_t h) {
    MTRL_CHECKF(P >= 1 && P <= 64 && w >= 1 && h >= 1 && w <= 4096 && h <= 4096, "picture %u x %u, patch %d", w, h,
                P);
    MTRL_CHECKF(!t->n_images || t->image_patch == (uint32_t)P, "patch side %d after %u in one episode", P,
                t->image_patch);
    size_t len = (size_t)3 * w * h;
    uint64_t dg = mtrl_hash64(rgb, len, MTRL_TRAJ_IMAGE_SEED);
    uint32_t first = 0;
    for (uint32_t i = 0; i < t->n_images; i++) {
        const mtrl_traj_image *im = &t->images[i];
        if (im->digest == dg && im->width == w && im->height == h && !memcmp(im->rgb, rgb, len)) return im->first_patch;
        first = im->first_patch + patches_of_(t, im);
    }
    if (t->n_images == t->cap_images) {
        t->cap_images = t->cap_images ? 2 * t->cap_images : 4;
        t->images = xrealloc(t->images, (size_t)t->cap_images * sizeof *t->images);
    }
    t->image_patch = (uint32_t)P;
    mtrl_traj_image *im = &t->images[t->n_images++];
    im->digest = dg;
    im->width = w;
    im->height = h;
    im->rgb = xmalloc(len);
    memcpy(im->rgb, rgb, len);
    im->first_patch = first;
    return first;
}

size_t mtrl_traj_patch_rows(const mtrl_traj *t) {
    if (!t->n_images) return 0;
    const mtrl_traj_image *last = &t->images[t->n_images - 1];
    return (size_t)last->first_patch + patches_of_(t, last);
}

void mtrl_traj_patch_table(const mtrl_traj *t, uint8_t *out) {
    size_t pb = (size_t)3 * t->image_patch * t->image_patch;
    for (uint32_t i = 0; i < t->n_images; i++) {
        const mtrl_traj_image *im = &t->images[i];
        mtrl_image_patches(im->rgb, im->width, im->height, (int)t->image_patch, out + (size_t)im->first_patch * pb);
    }
}

mtrl_status mtrl_traj_images_check(const mtrl_traj *t, mtrl_error *err) {
    if (!t->n_images) return MTRL_OK; // ids are opaque to an episode without pictures (traj.h)
    size_t rows = mtrl_traj_patch_rows(t);
    for (uint64_t i = 0; i < t->n_tokens; i++) {
        uint32_t id = t->ids[i];
        if (!mtrl_img_token_is(id) || id == MTRL_IMG_START || id == MTRL_IMG_ROW || id == MTRL_IMG_END) continue;
        if (!mtrl_img_token_is_patch(id) || mtrl_img_patch_row(id) >= rows)
            return mtrl_error_set(err, MTRL_ERR_FORMAT,
                                  "episode %llu: token %llu (id %#x) names patch row %u, but its %u pictures have %zu "
                                  "patch rows", (unsigned long long)t->episode_id, (unsigned long long)i, id,
                                  mtrl_img_token_is_patch(id) ? mtrl_img_patch_row(id) : 0u, t->n_images, rows);
    }
    return MTRL_OK;
}

void mtrl_traj_copy_images(mtrl_traj *a, const mtrl_traj *b) {
    MTRL_CHECK(a->n_images == 0);
    for (uint32_t i = 0; i < b->n_images; i++)
        mtrl_traj_add_image(a, (int)b->image_patch, b->images[i].rgb, b->images[i].width, b->images[i].height);
}
