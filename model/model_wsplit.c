// model_wsplit.c: the bf16-resident placement of an inference model's weights (model_wsplit.h).
#include "model/model_wsplit.h"

#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "kernels/ref/real.h"

#define ALIGN256(x) (((x) + 255u) & ~(size_t)255u)

// The suffix of a layer tensor's name ("layers.3.kda.conv_q" -> "kda.conv_q"), or the name.
static const char *suffix_(const char *name) {
    if (strncmp(name, "layers.", 7)) return name;
    const char *dot = strchr(name + 7, '.');
    return dot ? dot + 1 : name;
}

int mtrl_wsplit_gemm_only(const char *name, int ndim) {
    if (ndim < 2) return 0;
    // The matrices a non-GEMM entry of the forward or the decode reads (model_fwd.c): keep
    // this list in step with the backend entries that check for bf16-resident pointers.
    static const char *const fp32_[] = {"embed", "attnres.w", "attnres.g", "kda.conv_q", "kda.conv_k", "kda.conv_v",
                                         "mla.wkvb"};
    const char *s = suffix_(name);
    for (size_t i = 0; i < sizeof fp32_ / sizeof *fp32_; i++)
        if (!strcmp(s, fp32_[i])) return 0;
    return 1;
}

void mtrl_wsplit_init(mtrl_wsplit *s, const mtrl_tt *t) {
    memset(s, 0, sizeof *s);
    s->n = t->n;
    s->f32_off = xcalloc((size_t)(t->n > 0 ? t->n : 1), sizeof(size_t));
    s->b16_off = xcalloc((size_t)(t->n > 0 ? t->n : 1), sizeof(size_t));
    for (int i = 0; i < t->n; i++) {
        const mtrl_tensor *x = &t->items[i];
        s->f32_off[i] = s->b16_off[i] = MTRL_WSPLIT_NONE;
        if (mtrl_wsplit_gemm_only(x->name, x->ndim)) {
            s->b16_off[i] = s->b16_bytes;
            s->b16_bytes = ALIGN256(s->b16_bytes + 2 * x->numel);
            s->gemm_numel += x->numel;
        } else {
            s->f32_off[i] = s->f32_bytes;
            s->f32_bytes = ALIGN256(s->f32_bytes + sizeof(real) * x->numel);
        }
    }
}

void mtrl_wsplit_free(mtrl_wsplit *s) {
    if (!s) return;
    free(s->f32_off);
    free(s->b16_off);
    memset(s, 0, sizeof *s);
}

size_t mtrl_wsplit_device_bytes(const mtrl_tt *t, int gemm_bf16, int weights_bf16) {
    if (!weights_bf16) return t->total + (gemm_bf16 ? 2 * (t->total / sizeof(real)) : 0);
    mtrl_wsplit s;
    mtrl_wsplit_init(&s, t);
    size_t n = s.f32_bytes + s.b16_bytes;
    mtrl_wsplit_free(&s);
    return n;
}
