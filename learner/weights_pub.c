// weights_pub.c: the learner's end of the same-host weight channel (see weights_pub.h).
#include "learner/weights_pub.h"

#include <string.h>

#include "common/log.h"

mtrl_status mtrl_weights_pub_init(mtrl_weights_pub *p, const mtrl_model *m, const mtrl_cfg_learner *cfg,
                                  mtrl_error *err) {
    memset(p, 0, sizeof *p);
    if (!strcmp(cfg->publish, "zmq")) return MTRL_OK;
    mtrl_model_wshm_layout(m, !strcmp(cfg->publish_dtype, "bf16"), &p->lay);
    int device = m->device == MTRL_DEVICE_CUDA;
    mtrl_status st = mtrl_wshm_create(&p->ch, device ? MTRL_WSHM_DEVICE : MTRL_WSHM_HOST, p->lay.slot_bytes, p->lay.hash, err);
    if (st == MTRL_OK && device) st = mtrl_model_wshm_dev_create(&p->dev, m, &p->lay, p->ch, err);
    if (st == MTRL_OK) {
        LOG_INFO("weights to same-host actors through %s (%s slots of %.1f MB)", mtrl_wshm_name(p->ch),
                 device ? "GPU" : "shared-memory", p->lay.slot_bytes / 1e6);
        return MTRL_OK;
    }
    mtrl_weights_pub_free(p);
    if (!strcmp(cfg->publish, "shm")) return mtrl_error_wrap(err, "[learner] publish = shm");
    LOG_WARN("[learner] publish = auto: %s; every actor gets the weights over ZeroMQ", err->msg);
    return MTRL_OK;
}

void mtrl_weights_pub_publish(mtrl_weights_pub *p, mtrl_model *m) {
    if (!p->ch) return;
    if (p->dev) {
        p->slot = mtrl_model_wshm_dev_publish(p->dev, m, p->ch, m->version);
    } else {
        int slot;
        void *dst = mtrl_wshm_write_begin(p->ch, &slot);
        mtrl_model_wshm_pack_host(m, &p->lay, dst);
        mtrl_wshm_write_end(p->ch, slot, m->version);
        p->slot = slot;
    }
    p->version = m->version;
    p->published = 1;
}

int mtrl_weights_pub_announce(const mtrl_weights_pub *p, mtrl_wire_out *o) {
    if (!p->ch || !p->published) return 0;
    mtrl_wire_encode_weights_at(o, p->version, (uint32_t)p->slot, mtrl_wshm_nonce(p->ch), mtrl_wshm_name(p->ch));
    return 1;
}

void mtrl_weights_pub_free(mtrl_weights_pub *p) {
    mtrl_model_wshm_dev_free(p->dev);
    mtrl_wshm_close(p->ch);
    mtrl_model_wshm_layout_free(&p->lay);
    memset(p, 0, sizeof *p);
}
