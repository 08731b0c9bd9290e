// wire_auth.h: CURVE keys, allow-lists and the ZAP handler that authenticate remote actors
// (docs/architecture.md §5).
//
// The learner's ROUTER becomes a CURVE server (RFC 26: the stream is encrypted and the server
// proves it holds its secret key), and every client handshake is put to a ZAP handler (RFC 27)
// that this module runs in the learner's zmq context. The handler answers 200 only for a CURVE
// client whose public key is on the allow-list; everything else gets 400: an unknown key,
// mechanism NULL or PLAIN, another ZAP domain, a malformed request. A CURVE server with no ZAP
// handler would let in any client that knows the server's public key ("Stonehouse",
// libzmq src/curve_server.cpp), so mtrl_wire_router_open refuses CURVE until a handler runs and
// sets ZMQ_ZAP_ENFORCE_DOMAIN, which keeps the door shut if the handler goes away later.
//
// Without [learner] curve_key nothing here runs and the wire is plain text, as before: keep the
// endpoint on loopback then (the default, tcp://127.0.0.1:*).
//
// ---- key files --------------------------------------------------------------------------------
// Text, one `name = value` a line; lines starting with '#' and blank lines are ignored:
//     # mtrl CURVE key pair: keep this file private
//     public = rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7
//     secret = JTKVSB%%)wK0E.X)V>+}o?pNmC{O&4W4b!Ni{Lh6
// A key is 40 characters of Z85 (32 bytes). STEM.key holds both lines and has mode 0600;
// loading its secret refuses a file that group or others may read (as ssh does). STEM.pub holds
// only the public line and is what you hand out. Errors name the file and the line:
//     actor1.key:3: secret key is 12 characters; expected 40 (Z85)
//
// ---- allow-lists ------------------------------------------------------------------------------
// Either a file with one public key a line, bare (40 Z85 characters) or as `public = KEY` (so
// `cat actor*.pub > allowed` makes one), '#' comments and blank lines ignored; or a directory:
// every `*.pub` file in it (other files are ignored). A secret key in an allow-list is an error.
//
// ---- usage ------------------------------------------------------------------------------------
// Learner (the handler must outlive the ROUTER and be freed before zmq_ctx_term):
//     mtrl_wire_sockopts so = mtrl_wire_sockopts_default();
//     mtrl_wire_auth_server *auth = NULL;
//     if (key_file[0]) st = mtrl_wire_auth_server_init(&auth, zctx, key_file, allow_path, &so, err);
//     if (!st) st = mtrl_wire_router_open(&sock, zctx, endpoint, &lim, &so, err);
//     ...
//     mtrl_wire_sock_close(&sock); mtrl_wire_auth_server_free(auth); zmq_ctx_term(zctx);
// Actor:
//     mtrl_wire_sockopts so = mtrl_wire_sockopts_default();
//     st = mtrl_wire_auth_client_opts(&so, "learner.pub", "actor1.key", err);
//     if (!st) st = mtrl_wire_dealer_open(&sock, zctx, endpoint, id, incarnation, &lim, &so, err);
//
// Errors: MTRL_ERR_NOTFOUND (a file is missing), MTRL_ERR_FORMAT (a bad key or line, with
// file:line), MTRL_ERR_USAGE (a file to be written exists, a secret key file others can read,
// CURVE missing from libzmq), MTRL_ERR_IO, MTRL_ERR_STATE (a ZAP handler already runs in that
// context).
#ifndef MTRL_WIRE_AUTH_H
#define MTRL_WIRE_AUTH_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "common/wire/wire.h"

#define MTRL_WIRE_KEY_BYTES 32
#define MTRL_WIRE_KEY_Z85_LEN 40

// ---- keys ---------------------------------------------------------------------------------------

typedef struct mtrl_wire_keypair {
    uint8_t public_key[MTRL_WIRE_KEY_BYTES];
    uint8_t secret_key[MTRL_WIRE_KEY_BYTES];
} mtrl_wire_keypair;

// A fresh keypair from libzmq (libsodium). MTRL_ERR_USAGE when libzmq has no CURVE
// (zmq_curve_keypair gives ENOTSUP without libsodium).
mtrl_status mtrl_wire_keypair_new(mtrl_wire_keypair *kp, mtrl_error *err);

// Writes kp to STEM.key (public + secret, mode 0600) and STEM.pub (public, mode 0644). Each
// file is written to a temporary name, synced and then linked into place, so a reader never
// sees half a key and an existing file is never replaced: when STEM.key or STEM.pub exists
// nothing is written (MTRL_ERR_USAGE, naming it).
mtrl_status mtrl_wire_keypair_save(const mtrl_wire_keypair *kp, const char *stem, mtrl_error *err);

// mtrl_wire_keypair_new + mtrl_wire_keypair_save (what `mtrl keygen STEM` does).
mtrl_status mtrl_wire_keypair_write(const char *stem, mtrl_error *err);

// Loads a .key file: both lines required, the public key must belong to the secret key, and the
// file must not be readable by group or others.
mtrl_status mtrl_wire_keypair_load(mtrl_wire_keypair *kp, const char *key_file, mtrl_error *err);

// Loads the public key of a .pub file (a .key file works too: only its public line is read).
mtrl_status mtrl_wire_key_load_public(uint8_t key[MTRL_WIRE_KEY_BYTES], const char *path, mtrl_error *err);

// Z85 text of a key: 40 characters and a NUL.
void mtrl_wire_key_z85(const uint8_t key[MTRL_WIRE_KEY_BYTES], char out[MTRL_WIRE_KEY_Z85_LEN + 1]);

// Overwrites a keypair (or any secret) so it does not linger in memory.
void mtrl_wire_key_wipe(void *p, size_t n);

// ---- allow-lists ------------------------------------------------------------------------------

typedef struct mtrl_wire_allow {
    uint8_t (*keys)[MTRL_WIRE_KEY_BYTES]; // sorted, no duplicates; owned
    size_t n, cap;
} mtrl_wire_allow;

void mtrl_wire_allow_init(mtrl_wire_allow *a);
void mtrl_wire_allow_free(mtrl_wire_allow *a);
// Adds every key of an allow-list file or directory (see the top of this file). On error a
// keeps the keys it had before the call.
mtrl_status mtrl_wire_allow_load(mtrl_wire_allow *a, const char *path, mtrl_error *err);
void mtrl_wire_allow_add(mtrl_wire_allow *a, const uint8_t key[MTRL_WIRE_KEY_BYTES]); // no-op when present
int mtrl_wire_allow_has(const mtrl_wire_allow *a, const uint8_t key[MTRL_WIRE_KEY_BYTES]);

// ---- the learner side: ZAP handler ------------------------------------------------------------

typedef struct mtrl_wire_auth_server mtrl_wire_auth_server;

// What the handler decided and what the ROUTER's monitor saw, for logs and tests.
typedef struct mtrl_wire_auth_stats {
    uint64_t requests;              // ZAP requests answered
    uint64_t accepted;              // ... with 200
    uint64_t refused;               // ... with 400
    uint64_t handshakes_ok;         // monitor (mtrl_wire_auth_server_monitor): handshakes that succeeded
    uint64_t handshakes_failed;     // monitor: handshakes that failed, refusals included; also a wrong
                                    // server key or a client without CURVE, which never reach ZAP
    char last_refused_key[MTRL_WIRE_KEY_Z85_LEN + 1]; // Z85 key of the last refused CURVE client ("" if not CURVE)
    char last_refused_address[64];  // its address as libzmq gave it ("127.0.0.1")
    char last_refused_reason[96];   // "key not on the allow-list", "mechanism NULL is not allowed", ...
    char last_failed_reason[96];    // the last failed handshake the monitor saw
} mtrl_wire_auth_stats;

// Loads the learner's keypair (key_file) and allow-list (allow_path, required), adds the keys
// trusted with mtrl_wire_auth_trust, starts the handler thread on inproc://zeromq.zap.01 in
// zctx and turns opts into a CURVE server's (curve_server = 1, curve_secret_key). On error
// *out is NULL and opts is untouched. MTRL_ERR_STATE when zctx already has a ZAP handler.
// Refusals are logged at WARN (at most one line a second, with a count of those left out).
mtrl_status mtrl_wire_auth_server_init(mtrl_wire_auth_server **out, void *zctx, const char *key_file,
                                       const char *allow_path, mtrl_wire_sockopts *opts, mtrl_error *err);
// The same from memory: allow is copied; kp is not kept (only opts gets the secret key).
mtrl_status mtrl_wire_auth_server_start(mtrl_wire_auth_server **out, void *zctx, const mtrl_wire_keypair *kp,
                                        const mtrl_wire_allow *allow, mtrl_wire_sockopts *opts, mtrl_error *err);

// Watches the ROUTER's handshakes (zmq_socket_monitor on an inproc PAIR read by the handler
// thread): counts them in the stats and logs failed ones, including those ZAP never sees. Call
// once, after mtrl_wire_router_open, from the thread that owns the router. NULL-safe (s = NULL
// does nothing). A zmq socket has one monitor: a later zmq_socket_monitor (wire_monitor.h, as
// the learner uses) replaces this one, and this one replaces an earlier. For tools and tests
// that do not monitor the router otherwise.
mtrl_status mtrl_wire_auth_server_monitor(mtrl_wire_auth_server *s, mtrl_wire_sock *router, mtrl_error *err);

// Allows one more public key from now on (thread-safe).
void mtrl_wire_auth_server_allow(mtrl_wire_auth_server *s, const uint8_t key[MTRL_WIRE_KEY_BYTES]);

// A snapshot of the counters (thread-safe).
void mtrl_wire_auth_server_stats(mtrl_wire_auth_server *s, mtrl_wire_auth_stats *out);

// Waits up to timeout_ms until refused >= min_refused and handshakes_failed >= min_failed;
// returns 1 when they are, 0 on timeout. out (nullable) gets the stats either way.
int mtrl_wire_auth_server_wait(mtrl_wire_auth_server *s, uint64_t min_refused, uint64_t min_failed, int timeout_ms,
                               mtrl_wire_auth_stats *out);

// Stops the thread (at once: a message on its control socket, and a 250 ms poll with a stop
// flag behind it), closes its sockets and frees everything. Call after closing the ROUTER and
// before zmq_ctx_term, which would otherwise wait for these sockets. NULL-safe.
void mtrl_wire_auth_server_free(mtrl_wire_auth_server *s);

// The allow-listed key (Z85) of the peer that sent the message last received on a CURVE
// ROUTER (ZAP handler's User-Id); returns 0 when there is none (not CURVE, nothing received).
int mtrl_wire_auth_peer_key(const mtrl_wire_sock *router, char out[MTRL_WIRE_KEY_Z85_LEN + 1]);

// Process-wide trust: every server started later in this process allows key as if it were on
// its allow-list. This is how `mtrl run` lets its own local actors in (mtrl_wire_auth_local).
void mtrl_wire_auth_trust(const uint8_t key[MTRL_WIRE_KEY_BYTES]);

// ---- the actor side -----------------------------------------------------------------------------

// Turns opts into a CURVE client's: the server's public key from server_pub_file (a .pub), the
// actor's keypair from client_key_file (a .key). On error opts is untouched.
mtrl_status mtrl_wire_auth_client_opts(mtrl_wire_sockopts *opts, const char *server_pub_file,
                                       const char *client_key_file, mtrl_error *err);

// Process-wide client credentials, so the front door can parse `mtrl actor --curve-server-key
// F --curve-key F` and the actor pick them up without a new parameter: set copies the CURVE
// client fields of opts (curve_client = 0 clears them); apply copies them into opts (nothing
// when none were set).
void mtrl_wire_auth_client_set(const mtrl_wire_sockopts *opts);
void mtrl_wire_auth_client_apply(mtrl_wire_sockopts *opts);

// ---- local actors of `mtrl run` -----------------------------------------------------------------
//
// `mtrl run` with curve_key starts its actors as `mtrl actor --curve-server-key SERVER_PUB
// --curve-key KEY_FILE`. mtrl_wire_auth_local_init makes an ephemeral keypair for them, trusts
// its public key process-wide (mtrl_wire_auth_trust: nothing is added to the allow-list on
// disk) and writes, in a fresh private directory OUT_DIR/.curve-XXXXXX (mode 0700):
//     actor.key    the ephemeral keypair (0600)
//     learner.pub  the learner's public key, read from server_key_file
// Call it before the learner starts its handler. mtrl_wire_auth_local_free deletes the files and
// the directory. A run killed with SIGKILL leaves the directory behind; its key is trusted by no
// later learner (the trust lives in the learner process's memory).
typedef struct mtrl_wire_auth_local {
    char dir[1024];
    char key_file[1100];
    char server_pub[1100];
} mtrl_wire_auth_local;

mtrl_status mtrl_wire_auth_local_init(mtrl_wire_auth_local *lc, const char *out_dir, const char *server_key_file,
                                      mtrl_error *err);
void mtrl_wire_auth_local_free(mtrl_wire_auth_local *lc); // NULL-safe; safe on a zeroed or failed one

#endif
