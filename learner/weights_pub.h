// weights_pub.h: the learner's end of the same-host weight channel ([learner] publish, issue 21).
//
// With publish = auto or shm the learner keeps a weight channel (common/weights_shm.h): a HOST
// one (two slots in POSIX shared memory, filled from the parameters by the CPU) for a model on
// the CPU, a DEVICE one (two slots in GPU memory shared by CUDA IPC, filled by one kernel on the
// model's stream, no host round trip) for a model on a GPU. Each publish writes the slot not
// announced last and the learner sends every actor that reads the channel a WEIGHTS_AT message
// (version, slot, the channel's name and nonce): tens of bytes instead of the whole model. The
// ZeroMQ chunks (safetensors, learner.c) stay for publish = zmq and for the actors that answer
// WEIGHTS_AT with WEIGHTS_REQ (another host: the name does not open there).
#ifndef MTRL_WEIGHTS_PUB_H
#define MTRL_WEIGHTS_PUB_H

#include <stdint.h>

#include "common/config.h"
#include "model/model.h"
#include "model/model_wshm.h"
#include "common/status.h"
#include "common/weights_shm.h"
#include "common/wire/wire.h"

typedef struct mtrl_weights_pub {
    mtrl_wshm *ch;             // NULL: every actor gets ZeroMQ chunks
    mtrl_wshm_layout lay;
    mtrl_model_wshm_dev *dev;  // the device slots of a DEVICE channel
    uint32_t version;          // the last publish: version and slot
    int slot;
    int published;             // a publish happened
} mtrl_weights_pub;

// Creates the channel for the model as [learner] publish says (zmq: none). Under auto a channel
// that cannot be created (a /dev/shm too small, say) is logged and leaves every actor on ZeroMQ;
// under shm it is the error (MTRL_ERR_NOMEM / _IO naming the segment).
mtrl_status mtrl_weights_pub_init(mtrl_weights_pub *p, const mtrl_model *m, const mtrl_cfg_learner *cfg,
                                  mtrl_error *err);
// Writes the model's current weights into the channel under m->version (nothing without one).
void mtrl_weights_pub_publish(mtrl_weights_pub *p, mtrl_model *m);
// The WEIGHTS_AT announcement of the last publish; 0 when there is nothing to announce.
int mtrl_weights_pub_announce(const mtrl_weights_pub *p, mtrl_wire_out *o);
void mtrl_weights_pub_free(mtrl_weights_pub *p);

#endif
