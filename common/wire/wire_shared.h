// wire_shared.h: one encoded message sent to many peers without copying its payload.
//
// Why: a publish of the `small` backbone's weights is ~150 WEIGHTS messages of 32 MiB. Encoding
// them once per version (not once per actor) and handing the same payload bytes to ZeroMQ for
// every actor (zmq_msg_init_data, reference-counted) saves a copy and a checksum pass of the
// whole model per actor. ZeroMQ releases a payload from its I/O thread, whenever the bytes are
// on the wire: the count is atomic, and the last release frees.
//
//   mtrl_wire_shared *m = mtrl_wire_shared_take(&out); // steals out's payload buffer
//   mtrl_wire_shared_send(&sock, &peer, m, &err);     // as often as needed
//   mtrl_wire_shared_release(m);                      // the owner's reference
#ifndef MTRL_WIRE_SHARED_H
#define MTRL_WIRE_SHARED_H

#include "common/status.h"
#include "common/wire/wire.h"

typedef struct mtrl_wire_shared mtrl_wire_shared;

// Takes the encoded message: o's payload buffer moves into the result (o stays usable, empty).
// The caller holds one reference.
mtrl_wire_shared *mtrl_wire_shared_take(mtrl_wire_out *o);
void mtrl_wire_shared_release(mtrl_wire_shared *m); // NULL-safe
// As mtrl_wire_send, with the payload frame borrowed (a reference is held until ZeroMQ is done).
mtrl_status mtrl_wire_shared_send(mtrl_wire_sock *s, const mtrl_wire_peer *peer, mtrl_wire_shared *m, mtrl_error *err);

#endif
