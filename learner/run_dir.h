// run_dir.h: the folder of one run under [run] out_dir (issue 28, item 13: the same experiment
// run twice with different --db replaced the first run's checkpoints).
//
// A run writes its checkpoints and its trajectory file into out_dir/<store>-run<id>/, where
// <store> is the run store's file name without its extension (runs.db, run 3: runs-run3/). The
// folder is claimed by a file `.owner` in it that names the store's real path and the run id;
// a folder claimed by another run (a store of the same file name elsewhere, or one recreated
// after a delete) is refused naming that run, never written into. --resume reclaims its own.
#ifndef MTRL_RUN_DIR_H
#define MTRL_RUN_DIR_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

// Creates (or, for the same store and run, reopens) the run's folder and writes its path into
// dir (cap bytes). MTRL_ERR_STATE when another run owns it (the message names that store and
// run and how to separate them), MTRL_ERR_IO when it cannot be created.
mtrl_status mtrl_run_dir_claim(char *dir, size_t cap, const char *out_dir, const char *db, int64_t run, mtrl_error *err);

#endif
