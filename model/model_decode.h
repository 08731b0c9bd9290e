// model_decode.h: the driver of the batched decode step (model.h mtrl_model_decode), internal to
// model. A step reads nothing back while it runs: its per-row arguments (token ids, positions,
// the rows' KDA states, conv windows and latent caches, layer by layer) are written to one
// backend block before it (model_ws.h seg_decode), its logits, routing and routing statistics
// are read back once after it, and the statistics are added to the model's counters then, in
// the order and precision the segment forward adds them (so every value is what it was).
//
// With a backend that records (CUDA with [kernels] decode_graph = on, backend.h graph_*), each
// (batch size, key-length bucket, outputs wanted) is launched kernel by kernel the first time it
// is seen (its scratch grows to size), recorded the second, and replayed from then on: the
// recording reads the argument block, the states and the parameters in place, so other rows,
// longer contexts within the bucket and new weight versions replay without a new recording. A
// step that cannot be recorded (an image token, a profile being taken, m->decode_eager, an entry
// that needs the host) runs launched. The kernels and their arguments are the same either way, so a replay
// gives the launched step's bits.
#ifndef MTRL_MODEL_DECODE_H
#define MTRL_MODEL_DECODE_H

#include <stdint.h>

#include "common/arena.h"
#include "model/model.h"

typedef struct model_decode model_decode;

// One step of B rows on the decode scratch `ar` (sized by the caller for B rows; its layout for
// B rows is the same at every call). *dp: the driver's state, created at the first call.
void model_decode_step(mtrl_model *m, model_decode **dp, mtrl_arena *ar, mtrl_decode_state *const *states, int B,
                       const uint32_t *tokens, real *logits, uint8_t *routing_out);
// Frees the state and its recordings (NULL is fine).
void model_decode_free(mtrl_model *m, model_decode *dp);
// How many steps the driver has replayed and recorded, and how many ran launched (tests,
// benchmarks); NULL counts nothing.
void model_decode_counts(const model_decode *dp, long *replayed, long *recorded, long *launched);

#endif
