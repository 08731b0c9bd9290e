// env_wire.h: the request/reply framing between the env host (env_host.c, in the actor) and
// its isolated child (env_child.c), over one AF_UNIX stream socketpair (internal to env/).
//
// Both ends are the same executable (the child is a re-exec of /proc/self/exe), so headers
// are plain structs in native byte order. Every message is a fixed 32-byte header followed by
// `len` payload bytes; the receiver checks len against its cap before allocating.
//   request  OPEN      payload "name_or_path\0config\0"  -> reply payload: u32 caps, "name\0version\0"
//            RESET     seed                              -> reply payload: the prompt
//            STEP      kind, payload = action bytes      -> done, tool_error, reward, payload = obs
//            DEMO                                        -> payload: u32 count, {u32 kind, u64 len, bytes}*
//            DESCRIBE                                    -> payload: the tool list
//            IMAGE     (after RESET / STEP; ABI 1.1 envs)    -> payload: u32 width, u32 height, RGB8 bytes
//                      (empty payload: no picture; the host checks the sizes, the child does not)
//            CLOSE                                       -> empty reply, then the child exits 0
// A reply with status != 0 carries the error message as its payload (status is an mtrl_status).
#ifndef MTRL_ENV_WIRE_H
#define MTRL_ENV_WIRE_H

#include <stddef.h>
#include <stdint.h>

#define ENV_WIRE_MAGIC 0x564e454du // "MENV"
#define ENV_WIRE_MAX_REQUEST ((uint64_t)64 << 20)

// The child is this same executable started with argv[0] = ENV_CHILD_ARGV0 and the socket's fd
// number in ENV_CHILD_FD_VAR; mtrl_env_host_main (env_host.h), called first in its main, notices
// both and serves.
#define ENV_CHILD_ARGV0 "mtrl-env-host"
#define ENV_CHILD_FD_VAR "MTRL_ENV_HOST_FD"
#define ENV_CHILD_FD 3

enum {
    ENV_OP_OPEN = 1,
    ENV_OP_RESET = 2,
    ENV_OP_STEP = 3,
    ENV_OP_DEMO = 4,
    ENV_OP_DESCRIBE = 5,
    ENV_OP_CLOSE = 6,
    ENV_OP_IMAGE = 7,
};

#define ENV_CAP_DEMO 1u
#define ENV_CAP_DESCRIBE 2u
#define ENV_CAP_IMAGE 4u

typedef struct env_wire_req {
    uint32_t magic;
    uint32_t op;
    uint32_t kind;
    uint32_t reserved;
    uint64_t seed;
    uint64_t len;
} env_wire_req;

typedef struct env_wire_rep {
    uint32_t magic;
    int32_t status;
    int32_t done;
    int32_t tool_error;
    double reward;
    uint64_t len;
} env_wire_rep;

_Static_assert(sizeof(env_wire_req) == 32, "request header is 32 bytes");
_Static_assert(sizeof(env_wire_rep) == 32, "reply header is 32 bytes");

// I/O results.
#define ENV_IO_OK 0
#define ENV_IO_ERR (-1)     // errno says why
#define ENV_IO_EOF (-2)     // the peer closed its end (it exited or died)
#define ENV_IO_TIMEOUT (-3) // the deadline passed

// Writes/reads exactly n bytes. deadline is mtrl_time_mono() seconds, or < 0 for none. Writes
// use MSG_NOSIGNAL, so a dead peer gives EPIPE instead of SIGPIPE killing the caller.
int env_wire_write(int fd, const void *p, size_t n, double deadline);
int env_wire_read(int fd, void *p, size_t n, double deadline);

// The child's loop: serves requests on fd until CLOSE or EOF. Returns the exit status.
int env_child_serve(int fd);

#endif
