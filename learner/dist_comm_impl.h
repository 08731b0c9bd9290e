// dist_comm_impl.h: what a backend of learner/dist_comm.h implements (private to
// dist_comm.c and dist_comm_nccl.c). The public calls check their arguments, then call these.
#ifndef MTRL_DIST_COMM_IMPL_H
#define MTRL_DIST_COMM_IMPL_H

#include "learner/dist_comm.h"

typedef struct mtrl_dist_comm_ops {
    const char *name;
    mtrl_status (*barrier)(mtrl_dist_comm *c, mtrl_error *err);
    mtrl_status (*allreduce)(mtrl_dist_comm *c, void *buf, size_t count, mtrl_dtype dtype, mtrl_error *err);
    mtrl_status (*reduce_scatter)(mtrl_dist_comm *c, const float *send, float *recv, size_t count, mtrl_error *err);
    mtrl_status (*allgather)(mtrl_dist_comm *c, const void *send, void *recv, size_t bytes, mtrl_error *err);
    mtrl_status (*broadcast)(mtrl_dist_comm *c, void *buf, size_t bytes, int root, mtrl_error *err);
    mtrl_status (*alltoallv)(mtrl_dist_comm *c, const void *send, const int64_t *send_count, const int64_t *send_offset,
                             void *recv, const int64_t *recv_count, const int64_t *recv_offset, size_t elem_bytes,
                             mtrl_error *err);
    void (*free)(mtrl_dist_comm *c);
} mtrl_dist_comm_ops;

struct mtrl_dist_comm {
    const mtrl_dist_comm_ops *ops;
    int rank, ranks;
    int timeout_ms;
    void *impl; // the backend's state
    int gpu;    // the CUDA device whose memory the buffers are; -1: host memory
    // The local backend on device buffers (mtrl_dist_comm_init_local_device): the stream of its
    // copies and the host memory its inputs are staged in (grow-only), which the peers read.
    void *stream;
    char *stage;
    size_t stage_cap;
};

#endif
