// wire.h: the actor <-> learner protocol over ZeroMQ (docs/architecture.md §5), encode and decode in one
// place.
//
// Three layers, usable on their own:
//   1. Pure encode/decode (bytes in, bytes out; no sockets; fuzzed by tests/fuzz/fuzz_wire.c).
//   2. Thin socket helpers over libzmq: a learner ROUTER and an actor DEALER with the options
//      the reliability notes call for, multipart send, receive with a timeout.
//   3. The learner's episode assembler: BEGIN / CHUNK / END in, whole mtrl_traj episodes out,
//      each COMPLETE/TRUNCATED (safe to train on) or REJECTED/ABORTED (never trained on).
//
// ---- messages ---------------------------------------------------------------------------------
// A message is one header frame of exactly MTRL_WIRE_HDR_SIZE bytes, then at most one payload
// frame (absent when the payload is empty); on the ROUTER side the peer's identity frame comes
// first. Header, little-endian:
//     0  u8[4] magic "MTRL"          16 u64 payload length
//     4  u16   protocol version      24 u64 id (episode id for BEGIN/CHUNK/END, else a request id)
//     6  u16   type                  32 u32 crc32c of the payload (0 for an empty payload)
//     8  u32   flags (must be 0)     36 u32 reserved (must be 0)
//     12 u32   seq (CHUNK: 0,1,2...; END: the number of CHUNKs sent; others: 0 or caller's)
// Payloads, little-endian (str = u32 length + bytes, no NUL):
//     HELLO         u16 protocol version, u16 0, u32 actor_id, u32 incarnation, u64 capabilities
//     WELCOME       u64 run_id, u64 config_hash, u32 weight_version, u64 credit_bytes,
//                   str config_text (the resolved experiment, so the actor builds the same
//                   model and env)
//     CREDIT        u64 credit_bytes (more bytes the actor may send)
//     BEGIN         the traj.h header encoding      (id = episode id)
//     CHUNK         the traj.h token slice encoding (id = episode id, seq = chunk number)
//     END           the traj.h summary encoding     (id = episode id, seq = chunks sent)
//     WEIGHTS_REQ   u32 version wanted
//     WEIGHTS       u32 version, u32 chunk_index, u32 chunk_count, u64 blob_bytes (whole blob),
//                   u64 offset (of this chunk in the blob), u64 digest (mtrl_crc32c of this
//                   chunk's bytes: fast in hardware, as gigabytes pass per publish), u64 n,
//                   n raw bytes
//     ROUTING_STATS u32 version (of the weights routed with), u32 layers, u32 experts,
//                   u64 counts[layers * experts] (tokens per expert), u32 batches[layers] and
//                   f64 beta_sum[layers * experts] (QB: the β each decode batch implied, summed;
//                   finite)
//     HEARTBEAT     empty
//     ACTOR_STATS   u32 layout version (MTRL_WIRE_ACTOR_STATS_VERSION), u32 field count (that
//                   version's: MTRL_WIRE_ACTOR_STATS_FIELDS), then that many f64, each finite
//                   and >= 0: where the actor's time went since its previous ACTOR_STATS
//                   (mtrl_wire_actor_stats). A later layout appends fields under a new version;
//                   a decoder refuses a version it does not know (MTRL_ERR_MISMATCH). A learner
//                   older than the type drops the message as unknown and counts it invalid: the
//                   rest of the protocol is unchanged.
//     BYE           str reason (may be empty)
//     ERROR         i32 code (mtrl_status), str text
//     WEIGHTS_AT    u32 version, u32 slot, u64 nonce, str channel name (at most 63 bytes): the
//                   weights of that version are in that slot of the same-host weight channel
//                   (common/weights_shm.h); an actor that cannot open it answers WEIGHTS_REQ and
//                   gets WEIGHTS chunks from then on
// Every length is checked against mtrl_wire_limits before anything is allocated. Decoders are
// strict (reserved fields zero, nothing trailing), so an accepted message re-encodes to the
// same bytes.
//
// Ownership: an mtrl_wire_msg owns what it decoded (strings, counts, the embedded mtrl_traj)
// except WEIGHTS data, which points into the payload bytes passed to mtrl_wire_decode
// (borrowed: valid while those bytes are). mtrl_wire_msg_free releases the rest.
//
// Errors: decoders return MTRL_ERR_FORMAT / MTRL_ERR_LIMIT / MTRL_ERR_MISMATCH (protocol
// version) with "wire <TYPE>: at byte N: ..." messages. Socket helpers return MTRL_ERR_IO,
// MTRL_ERR_PEER (peer unknown or gone: ROUTER_MANDATORY), MTRL_ERR_TIMEOUT. Nothing here
// aborts on peer input.
#ifndef MTRL_WIRE_H
#define MTRL_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "common/traj.h"
#include "common/trajbuf.h"

#define MTRL_WIRE_VERSION 1
#define MTRL_WIRE_HDR_SIZE 40
#define MTRL_WIRE_MAGIC "MTRL"

typedef enum mtrl_wire_type {
    MTRL_WIRE_HELLO = 1,
    MTRL_WIRE_WELCOME = 2,
    MTRL_WIRE_CREDIT = 3,
    MTRL_WIRE_BEGIN = 4,
    MTRL_WIRE_CHUNK = 5,
    MTRL_WIRE_END = 6,
    MTRL_WIRE_WEIGHTS_REQ = 7,
    MTRL_WIRE_WEIGHTS = 8,
    MTRL_WIRE_ROUTING_STATS = 9,
    MTRL_WIRE_HEARTBEAT = 10,
    MTRL_WIRE_BYE = 11,
    MTRL_WIRE_ERROR = 12,
    MTRL_WIRE_ACTOR_STATS = 13,
    MTRL_WIRE_WEIGHTS_AT = 14,
} mtrl_wire_type;
#define MTRL_WIRE_TYPE_MAX 14

// "HELLO", "CHUNK", ...; "UNKNOWN" for anything else.
const char *mtrl_wire_type_name(uint16_t type);

// HELLO capability bits.
#define MTRL_WIRE_CAP_ROUTING 1u     // the actor records routing
#define MTRL_WIRE_CAP_ROUTING_U16 2u // ... with 2-byte expert ids
#define MTRL_WIRE_CAP_CURVE 4u       // the actor can do CURVE

// ACTOR_STATS: the actor's time since its previous report, by part (mtrl bench rl, the
// learner's actor_* metrics). wall_s covers the whole interval; prefill_s, decode_s and tools_s
// are inside its rollout (mtrl_model_prefill_many, mtrl_model_decode, env reset/step), wait_s
// in its socket poll (waiting for weights or credit, loading weights); the rest is "other".
// Counts travel as f64 (exact below 2^53).
typedef struct mtrl_wire_actor_stats {
    double wall_s, prefill_s, decode_s, tools_s, wait_s;
    double prefill_tokens, decode_tokens, decode_steps;
} mtrl_wire_actor_stats;
#define MTRL_WIRE_ACTOR_STATS_VERSION 1
#define MTRL_WIRE_ACTOR_STATS_FIELDS 8

typedef struct mtrl_wire_limits {
    uint64_t max_payload;         // bytes per payload frame (also ZMQ_MAXMSGSIZE)
    uint32_t max_text;            // BYE / ERROR text
    uint32_t max_config;          // WELCOME config text
    uint32_t max_routing_cells;   // ROUTING_STATS layers x experts
    uint32_t max_weight_chunks;   // WEIGHTS chunk_count
    uint64_t max_episode_bytes;   // assembler: payload bytes per episode
    uint32_t max_open_per_actor;  // assembler: open episodes per actor incarnation
    mtrl_traj_limits traj;        // for BEGIN / CHUNK / END payloads
} mtrl_wire_limits;

// 64 MiB payloads, 4 KiB text, 1 MiB config, 2^20 routing cells, 65536 weight chunks, 1 GiB
// per episode, 64 open episodes per actor, mtrl_traj_limits_default().
mtrl_wire_limits mtrl_wire_limits_default(void);

// ---- 1. encode / decode ----------------------------------------------------------------------

typedef struct mtrl_wire_hdr {
    uint16_t version;
    uint16_t type;
    uint32_t flags;
    uint32_t seq;
    uint64_t length;  // payload bytes
    uint64_t id;
    uint32_t crc;     // crc32c of the payload
} mtrl_wire_hdr;

// An encoded message ready to send: hdr plus payload (payload.len == 0: no payload frame).
// Reuse one across messages: the payload buffer keeps its allocation.
typedef struct mtrl_wire_out {
    uint8_t hdr[MTRL_WIRE_HDR_SIZE];
    mtrl_wbuf payload;
} mtrl_wire_out;

void mtrl_wire_out_init(mtrl_wire_out *o);
void mtrl_wire_out_free(mtrl_wire_out *o);

void mtrl_wire_encode_hello(mtrl_wire_out *o, uint32_t actor_id, uint32_t incarnation, uint64_t caps);
void mtrl_wire_encode_welcome(mtrl_wire_out *o, uint64_t run_id, uint64_t config_hash, uint32_t weight_version,
                              uint64_t credit_bytes, const char *config_text);
void mtrl_wire_encode_credit(mtrl_wire_out *o, uint64_t credit_bytes);
void mtrl_wire_encode_begin(mtrl_wire_out *o, const mtrl_traj *t);
// Tokens [first, first + count) of t as chunk number seq.
void mtrl_wire_encode_chunk(mtrl_wire_out *o, const mtrl_traj *t, uint32_t seq, uint64_t first, uint32_t count);
// seq = the number of CHUNK messages sent for this episode.
void mtrl_wire_encode_end(mtrl_wire_out *o, const mtrl_traj *t, uint32_t seq);
void mtrl_wire_encode_weights_req(mtrl_wire_out *o, uint64_t request_id, uint32_t version);
// Computes the chunk digest.
void mtrl_wire_encode_weights(mtrl_wire_out *o, uint32_t version, uint32_t chunk_index, uint32_t chunk_count,
                              uint64_t blob_bytes, uint64_t offset, const void *data, uint64_t n);
// batches and beta_sum may be NULL (zeros: loads only).
void mtrl_wire_encode_routing_stats(mtrl_wire_out *o, uint32_t version, uint32_t layers, uint32_t experts,
                                    const uint64_t *counts, const uint32_t *batches, const double *beta_sum);
void mtrl_wire_encode_heartbeat(mtrl_wire_out *o);
void mtrl_wire_encode_actor_stats(mtrl_wire_out *o, const mtrl_wire_actor_stats *s);
void mtrl_wire_encode_bye(mtrl_wire_out *o, const char *reason);
void mtrl_wire_encode_error(mtrl_wire_out *o, int32_t code, const char *text);
void mtrl_wire_encode_weights_at(mtrl_wire_out *o, uint32_t version, uint32_t slot, uint64_t nonce, const char *name);

// Decodes and checks a header frame: size, magic, protocol version (MTRL_ERR_MISMATCH), type,
// flags, reserved, and the payload length against the per-type cap.
mtrl_status mtrl_wire_hdr_decode(const void *buf, size_t n, const mtrl_wire_limits *lim, mtrl_wire_hdr *h,
                                 mtrl_error *err);
// Checks a payload against its header: length and CRC.
mtrl_status mtrl_wire_payload_check(const mtrl_wire_hdr *h, const void *payload, size_t n, mtrl_error *err);

typedef struct mtrl_wire_msg {
    mtrl_wire_hdr hdr;
    // HELLO
    uint16_t proto;
    uint32_t actor_id, incarnation;
    uint64_t caps;
    // WELCOME (also credit_bytes for CREDIT, weight_version for WEIGHTS_REQ/WEIGHTS/ROUTING_STATS)
    uint64_t run_id, config_hash, credit_bytes;
    uint32_t weight_version;
    char *text;              // WELCOME config text, BYE reason, ERROR text; owned, may be NULL
    // BEGIN: traj header; CHUNK: traj holds the slice's tokens (chunk_offset = its offset);
    // END: traj summary, end_tokens / end_digest as claimed
    mtrl_traj traj;
    uint64_t chunk_offset, end_tokens, end_digest;
    // WEIGHTS
    uint32_t chunk_index, chunk_count;
    uint64_t blob_bytes, blob_offset, chunk_digest;
    const uint8_t *data;     // borrowed from the decoded payload
    uint64_t data_len;
    // ROUTING_STATS
    uint32_t layers, experts;
    uint64_t *counts;        // (layers, experts) owned
    uint32_t *qb_batches;    // (layers) owned
    double *qb_beta_sum;     // (layers, experts) owned
    // ACTOR_STATS
    mtrl_wire_actor_stats actor_stats;
    // ERROR
    int32_t code;
    // WEIGHTS_AT (weight_version; text = the channel name)
    uint32_t slot;
    uint64_t nonce;
} mtrl_wire_msg;

void mtrl_wire_msg_init(mtrl_wire_msg *m);
void mtrl_wire_msg_free(mtrl_wire_msg *m);
// Header + payload bytes into m (reset first). A CHUNK's slice is decoded into an empty traj
// with the slice's routing shape.
mtrl_status mtrl_wire_decode(const void *hdr, size_t hdr_len, const void *payload, size_t payload_len,
                             const mtrl_wire_limits *lim, mtrl_wire_msg *m, mtrl_error *err);
// Re-encodes a decoded message (decode then encode gives the same bytes).
void mtrl_wire_msg_encode(mtrl_wire_out *o, const mtrl_wire_msg *m);

// Counters for everything a peer sent; never reset by this module.
typedef struct mtrl_wire_stats {
    uint64_t messages;       // messages seen
    uint64_t bytes;          // payload bytes seen
    uint64_t invalid;        // malformed, oversized or out-of-protocol messages dropped
    uint64_t duplicates;     // duplicate BEGIN / CHUNK ignored
    uint64_t late;           // messages for an episode already closed, ignored
    uint64_t completed;      // episodes handed back COMPLETE or TRUNCATED
    uint64_t rejected;       // episodes handed back REJECTED
    uint64_t aborted;        // episodes handed back ABORTED
    char last_reason[256];   // the last invalid message or rejection, for logs
} mtrl_wire_stats;

// Counts an invalid message and keeps its reason.
void mtrl_wire_stats_invalid(mtrl_wire_stats *s, const char *reason);

// ---- 2. sockets ------------------------------------------------------------------------------

typedef struct mtrl_wire_sockopts {
    int linger_ms;             // ZMQ_LINGER (bounded, so zmq_ctx_term cannot hang): 500
    int send_timeout_ms;       // ZMQ_SNDTIMEO: 5000
    int heartbeat_ivl_ms;      // ZMQ_HEARTBEAT_IVL: 1000 (0 = off)
    int heartbeat_timeout_ms;  // ZMQ_HEARTBEAT_TIMEOUT: 5000
    int reconnect_ivl_ms;      // DEALER ZMQ_RECONNECT_IVL: 100
    int reconnect_ivl_max_ms;  // DEALER ZMQ_RECONNECT_IVL_MAX: 32000
    // CURVE (RFC 26), binary 32-byte keys. All zero (the default) = the NULL mechanism, no
    // encryption, as before. Fill these through common/wire/wire_auth.h rather than by hand.
    // The ROUTER reads only the server fields, the DEALER only the client fields.
    int curve_server;                  // ROUTER: be a CURVE server (needs a ZAP handler, below)
    int curve_client;                  // DEALER: be a CURVE client
    uint8_t curve_secret_key[32];      // own secret key (server or client)
    uint8_t curve_public_key[32];      // client: own public key (the server's allow-list has it)
    uint8_t curve_server_key[32];      // client: the server's public key
} mtrl_wire_sockopts;

// The values above; CURVE off.
mtrl_wire_sockopts mtrl_wire_sockopts_default(void);

// The ZAP domain the ROUTER names in its authentication requests (ZMQ_ZAP_DOMAIN).
#define MTRL_WIRE_ZAP_DOMAIN "mtrl"

typedef struct mtrl_wire_peer {
    uint8_t id[256];  // ZeroMQ routing id
    size_t len;
} mtrl_wire_peer;

typedef struct mtrl_wire_sock {
    void *ctx;                // borrowed zmq context
    void *sock;               // owned zmq socket
    int router;               // 1 = learner ROUTER, 0 = actor DEALER
    mtrl_wire_limits lim;
    char endpoint[256];       // ZMQ_LAST_ENDPOINT (the bound port when binding "tcp://...:*")
    mtrl_wire_peer self_id;   // DEALER: the routing id this incarnation uses
    void *in[3];              // received frames (zmq_msg_t, heap): identity, header, payload
    int in_ready;
} mtrl_wire_sock;

// Learner side: ROUTER bound to endpoint, ZMQ_ROUTER_MANDATORY=1, ZMQ_ROUTER_HANDOVER=1,
// ZMQ_MAXMSGSIZE = lim->max_payload (a larger frame disconnects the peer), bounded linger,
// heartbeats. opts may be NULL for the defaults.
// With opts->curve_server: ZMQ_CURVE_SERVER, ZMQ_CURVE_SECRETKEY, ZMQ_ZAP_DOMAIN
// (MTRL_WIRE_ZAP_DOMAIN) and ZMQ_ZAP_ENFORCE_DOMAIN=1 are set before the bind. A CURVE server
// with no ZAP handler would let in every client that knows its public key ("Stonehouse"), so
// this refuses (MTRL_ERR_STATE) unless a ZAP handler is bound at inproc://zeromq.zap.01 in
// zmq_ctx (common/wire/wire_auth.h starts one), and (MTRL_ERR_USAGE) when libzmq lacks CURVE or
// ZMQ_ZAP_ENFORCE_DOMAIN.
mtrl_status mtrl_wire_router_open(mtrl_wire_sock *s, void *zmq_ctx, const char *endpoint,
                                  const mtrl_wire_limits *lim, const mtrl_wire_sockopts *opts, mtrl_error *err);
// Actor side: DEALER connected to endpoint with a fresh ZMQ_ROUTING_ID per incarnation
// ("a<actor>.i<incarnation>.<random>"), reconnect backoff, heartbeats, bounded linger.
// With opts->curve_client: ZMQ_CURVE_SERVERKEY, ZMQ_CURVE_PUBLICKEY and ZMQ_CURVE_SECRETKEY are
// set before the connect. A refused handshake is not an error here: the DEALER keeps retrying
// and nothing gets through (the learner counts the refusal).
mtrl_status mtrl_wire_dealer_open(mtrl_wire_sock *s, void *zmq_ctx, const char *endpoint, uint32_t actor_id,
                                  uint32_t incarnation, const mtrl_wire_limits *lim, const mtrl_wire_sockopts *opts,
                                  mtrl_error *err);
void mtrl_wire_sock_close(mtrl_wire_sock *s); // NULL-safe

// Sends one message; peer is required on the ROUTER (identity frame first), ignored on the
// DEALER. MTRL_ERR_PEER when the ROUTER does not know the peer (or it went away),
// MTRL_ERR_TIMEOUT when the send would block past send_timeout_ms.
mtrl_status mtrl_wire_send(mtrl_wire_sock *s, const mtrl_wire_peer *peer, const mtrl_wire_out *o, mtrl_error *err);
// The same for an encoded header (MTRL_WIRE_HDR_SIZE bytes) and a payload that ZeroMQ borrows
// instead of copying: ffn(payload, hint) is called exactly once, from any thread, when ZeroMQ no
// longer needs it (also when the send fails). See wire_shared.h.
mtrl_status mtrl_wire_send_borrowed(mtrl_wire_sock *s, const mtrl_wire_peer *peer, const uint8_t *hdr, void *payload,
                                    size_t n, void (*ffn)(void *data, void *hint), void *hint, mtrl_error *err);

// A received message: header decoded, payload checked (length, CRC) but not decoded. Borrowed
// from the socket: valid until the next mtrl_wire_recv or close.
typedef struct mtrl_wire_in {
    mtrl_wire_peer peer;      // ROUTER: who sent it
    mtrl_wire_hdr hdr;
    const uint8_t *hdr_bytes;
    const uint8_t *payload;
    size_t payload_len;
} mtrl_wire_in;

// Waits up to timeout_ms (-1 = forever) for one message. MTRL_ERR_TIMEOUT when none came.
// A malformed message (bad frame count, header or payload) is consumed, counted in stats (may
// be NULL) and returned as its error with in->peer set, so the caller can drop that peer.
mtrl_status mtrl_wire_recv(mtrl_wire_sock *s, int timeout_ms, mtrl_wire_in *in, mtrl_wire_stats *stats,
                           mtrl_error *err);

// Hangs up the TCP connection that the last message received on the ROUTER came from (also one
// that mtrl_wire_recv returned as malformed), so a hostile or broken peer stops costing the
// learner: shutdown(2) of its socket, which libzmq sees as the peer's hang-up (the fd stays
// libzmq's; it closes it). The fd comes from the message's metadata and is checked to be a
// socket connected to the message's Peer-Address, so a number reused since is left alone.
// MTRL_ERR_STATE when no message came from a TCP peer, MTRL_ERR_PEER when that connection is
// gone already.
mtrl_status mtrl_wire_sock_disconnect_last(mtrl_wire_sock *s, mtrl_error *err);

// ---- 3. episode assembler (learner) ----------------------------------------------------------
//
// Feed it every BEGIN / CHUNK / END with the sender's actor id and incarnation (from its
// HELLO). Episodes are keyed by (actor id, incarnation, episode id). Rules:
//   - BEGIN opens an episode (its header's actor id and incarnation must match the sender's);
//     a repeated BEGIN for an open episode is a duplicate and ignored.
//   - CHUNK seq must be the next one: a lower seq is a duplicate (ignored); a higher seq is a
//     gap and the episode is REJECTED. Its slice offset must equal the tokens received.
//   - END seq must equal the chunks received; its token count and digest must match the
//     tokens received, or the episode is REJECTED. Otherwise it closes with the status the
//     actor reported (COMPLETE / TRUNCATED / ABORTED).
//   - Caps: payload bytes per episode (max_episode_bytes) and open episodes per actor
//     incarnation (max_open_per_actor): over either, the episode is REJECTED.
//   - A message from a newer incarnation of an actor aborts the older incarnation's open
//     episodes; messages from an older incarnation after that are invalid.
//   - Messages for a recently closed episode are "late" and ignored; for an unknown episode
//     they are invalid.
// Closed episodes wait in a queue for mtrl_wire_asm_pop, with status and reason set. Rejected
// and aborted episodes keep the tokens received so far: record them, never train on them.
typedef struct mtrl_wire_asm mtrl_wire_asm;

mtrl_wire_asm *mtrl_wire_asm_new(const mtrl_wire_limits *lim);
void mtrl_wire_asm_free(mtrl_wire_asm *a); // NULL-safe; drops open and queued episodes

// Returns MTRL_OK when the message was used or ignored as a duplicate/late; otherwise the
// error (also counted in the stats) - the episode, if known, is then REJECTED.
mtrl_status mtrl_wire_asm_feed(mtrl_wire_asm *a, uint32_t actor_id, uint32_t incarnation, const mtrl_wire_hdr *h,
                               const void *payload, size_t n, mtrl_error *err);
// Aborts every open episode of the actor (incarnation MTRL_WIRE_ANY_INCARNATION = all of them)
// with the reason; returns how many were aborted.
#define MTRL_WIRE_ANY_INCARNATION UINT32_MAX
size_t mtrl_wire_asm_abort_actor(mtrl_wire_asm *a, uint32_t actor_id, uint32_t incarnation, const char *reason);
// Moves the oldest closed episode into *out (its previous contents are freed) and returns 1,
// or returns 0 when none is waiting.
int mtrl_wire_asm_pop(mtrl_wire_asm *a, mtrl_traj *out);
// Hands a finished trajectory back (t is left empty): the next BEGIN reuses its token and
// routing buffers instead of faulting in fresh memory. Up to 4 are kept; the rest are freed.
void mtrl_wire_asm_recycle(mtrl_wire_asm *a, mtrl_traj *t);

size_t mtrl_wire_asm_open_count(const mtrl_wire_asm *a, uint32_t actor_id, uint32_t incarnation);
uint64_t mtrl_wire_asm_open_bytes(const mtrl_wire_asm *a); // payload bytes held by open episodes
const mtrl_wire_stats *mtrl_wire_asm_stats(const mtrl_wire_asm *a);

#endif
