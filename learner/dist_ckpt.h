// dist_ckpt.h: sharded checkpoints of a learner on several ranks (issue 27, docs/multi-gpu.md).
//
// A checkpoint written by R ranks is R rank files plus an index, all in the project's
// checkpoint format (common/checkpoint.h, safetensors):
//   INDEX.rank<r>of<R>   rank r's shard (learner/dist_plan.h mtrl_dist_shards): for every piece
//                        of a tensor it owns, "<name>@<first element>", "adam_m.<name>@..." and
//                        "adam_v.<name>@...", 1-D, in the tensor's dtype
//   INDEX                what every rank holds alike (the caller's entries: QB β), the caller's
//                        metadata (step, version, ...), and the shard metadata: mtrl.sharded,
//                        shard.ranks, shard.align, shard.total, shard.layout (the SHA-256 of the
//                        table's names, dtypes, shapes and offsets), and per rank its file's
//                        name and SHA-256 (shard.<r>.file, shard.<r>.sha256)
// With expert-parallel ownership (learner/dist_ep.h, mtrl_dist_dp_init_ep) a rank's file holds
// the pieces it OWNS instead: its experts' rows of every routed-expert tensor, then its pieces
// of the non-expert ZeRO shard, each of the three blocks, named as above; the index says so
// with shard.kind = expert_parallel and shard.experts = E (shard.align: the non-expert
// block's). Only the owner's copy of an expert is current (the step updates nothing else):
// these pieces are what the ranks hold of the state, each element written once.
// The rank files are written first, each atomically by its rank; the index last (rank 0,
// after a barrier), so an index names only complete files and a crash in between leaves the
// previous checkpoint the latest. Reading checks the layout digest against the reader's table
// (a checkpoint of other dims is refused, naming both) and each rank file's digest before its
// bytes are used. Any number of ranks reads what any number wrote, with either layout: rank r'
// of R' computes both layouts and copies, from every old piece that overlaps its new range,
// the overlapping part (the reader's ranges are always ZeRO byte ranges: a one-rank range is
// the whole state, what the learner reads before its ranks copy it).
//
//     // every rank:   mtrl_dist_ckpt_write_rank(path, &sh, &table, r, p + sh.rank[r].begin, m_shard, v_shard, &err)
//     // rank 0, then: mtrl_dist_ckpt_write_index(path, &sh, &table, extra, n_extra, meta, n_meta, &err)
//     mtrl_dist_ckpt c;
//     mtrl_dist_ckpt_open(&c, path, &table, &err);                   // any R'
//     mtrl_dist_ckpt_read_shard(&c, &sh2, r2, p_shard, m_shard, v_shard, &err);
//     mtrl_ckpt_read(&c.index, "qb_beta", ...);  mtrl_ckpt_meta(&c.index, "step");
//     mtrl_dist_ckpt_close(&c);
#ifndef MTRL_DIST_CKPT_H
#define MTRL_DIST_CKPT_H

#include <stddef.h>

#include "common/checkpoint.h"
#include "common/status.h"
#include "common/tensor.h"
#include "learner/dist_ep.h"
#include "learner/dist_plan.h"

// The path of rank r's file of the checkpoint with this index (INDEX.rank<r>of<R>).
void mtrl_dist_ckpt_rank_path(char *out, size_t cap, const char *index_path, int rank, int ranks);

// Writes rank `rank`'s file. params, adam_m, adam_v: that rank's shard of each block, byte 0
// being byte sh->rank[rank].begin of the block (a replicated block: block + begin); the bytes
// past the block's total (the last ranks' padding) are not read.
mtrl_status mtrl_dist_ckpt_write_rank(const char *index_path, const mtrl_dist_shards *sh, const mtrl_tt *t, int rank,
                                      const void *params, const void *adam_m, const void *adam_v, mtrl_error *err);
// Writes rank `rank`'s file of the expert-parallel layout l (of table t): params, adam_m,
// adam_v are that rank's WHOLE blocks (t->total bytes each), of which its owned pieces are
// written (dist_ep.h: its experts, then its non-expert shard).
mtrl_status mtrl_dist_ckpt_write_rank_ep(const char *index_path, const mtrl_dist_ep_layout *l, const mtrl_tt *t,
                                         int rank, const void *params, const void *adam_m, const void *adam_v,
                                         mtrl_error *err);
// Writes the index once every rank file is on disk (it reads them for their digests): extra
// (n_extra entries, nullable) and meta (n_meta key/value pairs) as mtrl_ckpt_write_file takes them.
mtrl_status mtrl_dist_ckpt_write_index(const char *index_path, const mtrl_dist_shards *sh, const mtrl_tt *t,
                                       const mtrl_ckpt_entry *extra, int n_extra, const char *const *meta, int n_meta,
                                       mtrl_error *err);

// The index of rank files written by mtrl_dist_ckpt_write_rank_ep with layout l, as above.
mtrl_status mtrl_dist_ckpt_write_index_ep(const char *index_path, const mtrl_dist_ep_layout *l, const mtrl_tt *t,
                                          const mtrl_ckpt_entry *extra, int n_extra, const char *const *meta,
                                          int n_meta, mtrl_error *err);

typedef struct mtrl_dist_ckpt {
    mtrl_ckpt index;            // open: its entries and metadata for the caller
    char path[1024];
    const mtrl_tt *table;
    int ranks;                  // how many ranks wrote it
    int ep;                     // 1: with expert-parallel ownership (written_ep), 0: ZeRO (written)
    mtrl_dist_shards written;   // the layout the checkpoint was written with (ep = 0)
    mtrl_dist_ep_layout written_ep;
    char (*digest)[65];         // [ranks] the rank files' SHA-256
} mtrl_dist_ckpt;

// Opens the index and checks it against table t (the reader's). MTRL_ERR_FORMAT for a file that
// is no sharded checkpoint (an unsharded one is loaded by mtrl_model_load), MTRL_ERR_MISMATCH for
// one of another layout.
mtrl_status mtrl_dist_ckpt_open(mtrl_dist_ckpt *c, const char *index_path, const mtrl_tt *t, mtrl_error *err);
// Fills rank `rank`'s shard of layout sh (any number of ranks, the same table) of the three
// blocks, as mtrl_dist_ckpt_write_rank lays them out: the table's padding inside the range
// zeroed, bytes past the block's total not written. Any pointer may be NULL (not read: e.g. a
// rank of ZeRO-1 that gathers the parameters elsewhere).
mtrl_status mtrl_dist_ckpt_read_shard(mtrl_dist_ckpt *c, const mtrl_dist_shards *sh, int rank, void *params,
                                      void *adam_m, void *adam_v, mtrl_error *err);
void mtrl_dist_ckpt_close(mtrl_dist_ckpt *c);

#endif
