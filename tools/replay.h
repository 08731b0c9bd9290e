// replay.h: the pieces of `mtrl replay` (tools/cmd_replay.c renders, tools/replay_model.c
// rescores and re-executes, tools/replay_text.c has the text and path helpers both use).
// Internal to the mtrl command; not a library API.
//
// One replay session: the run store opened read-only, the episode's store row, its trajectory
// (when the learner kept a file), the run's resolved config and retained checkpoints. Paths the
// store holds (trajectory files, checkpoints) are used as stored when they exist, else relative
// to the directory of the database (runs started with a relative out_dir).
#ifndef MTRL_TOOLS_REPLAY_H
#define MTRL_TOOLS_REPLAY_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/config.h"
#include "common/status.h"
#include "common/store.h"
#include "common/tokenizer.h"
#include "common/traj.h"
#include "learner/algo.h"

// ---- the session ------------------------------------------------------------------------------

typedef struct replay_session {
    const char *db;
    mtrl_store *store;
    int64_t run;
    mtrl_store_run run_row;
    char *config_text;           // the run's stored config (free())
    mtrl_config cfg;             // resolved from config_text
    mtrl_tokenizer *tok;         // the run's tokenizer ([model] tokenizer; NULL: bytes)
    int have_cfg;
    char cfg_err[1024];          // why have_cfg is 0
    mtrl_store_episode row;
    int have_traj;               // the trajectory was read from its file
    mtrl_traj t;
    char traj_file[4096];        // resolved path of the trajectory file
    mtrl_store_checkpoint *ckpts; // retained or not, as the store lists them (step order)
    size_t n_ckpts;
} replay_session;

// Resolves a path the store holds (see the file top) into out; db: the run store's path.
void replay_resolve_path(const char *db, const char *stored, char *out, size_t cap);

// ---- turn structure ---------------------------------------------------------------------------

// One model turn: MODEL tokens [begin, end). A turn ends after a TOOL_CLOSE that closes a
// TOOL_OPEN of the same turn (a tool call: arguments are the tokens strictly between), after
// EOS (the answer), or where the episode stops (cut). The observation that answered a tool call
// is the run of TOOL tokens [obs_begin, obs_end) after it (empty when the env ended the episode
// or the budget left no room).
typedef struct replay_turn {
    size_t begin, end;
    long open, close;            // positions of TOOL_OPEN / TOOL_CLOSE, or -1
    int eos;                     // ended with EOS (the final answer)
    long tool;                   // index into t->tools of this turn's call, or -1
    size_t obs_begin, obs_end;
} replay_turn;

typedef struct replay_layout {
    size_t prompt_end;           // PROMPT tokens [0, prompt_end)
    replay_turn *turns;          // (n_turns) owned
    size_t n_turns;
    size_t n_other;              // tokens outside the prompt/turn/observation pattern (PAD, ...)
} replay_layout;

void replay_layout_build(const mtrl_traj *t, replay_layout *L);
void replay_layout_free(replay_layout *L);

// ---- rescore ----------------------------------------------------------------------------------

#define REPLAY_WORST 10

// Which weights scored the tokens of one recorded version.
typedef struct replay_weights {
    uint32_t want;               // the version the tokens were generated with
    uint32_t used;               // the version of the weights that scored them
    int found;                   // 1 = exact, 0 = substituted (see note)
    int initial;                 // the initial weights re-created from [run] seed (version 0)
    char path[4096];             // checkpoint file ("" for initial weights)
    char note[256];              // "exact", "nearest newer retained", ...
} replay_weights;

typedef struct replay_rescore {
    size_t T;
    float *learner;              // (T) learner log-prob of each token (0 for token 0)
    float *adjusted;             // (T) under the actor's temperature/top-p, or NULL (see .c)
    uint8_t *mask;               // (T) model tokens (token 0 never)
    uint32_t *used;              // (T) version of the weights that scored each token
    replay_weights *w;           // (n_w) one per distinct recorded version
    size_t n_w;
    char source[4352];           // one line describing the weights (--version / --checkpoint)
    mtrl_algo_mismatch mm;
    size_t worst[REPLAY_WORST];
    mtrl_algo_mismatch mm_adj;   // over adjusted (when non-NULL)
    double temperature, top_p;
    int routing;                 // the recorded routing was replayed (R3)
    char routing_note[160];
} replay_rescore;

typedef struct replay_rescore_opts {
    int have_version;
    uint32_t version;            // --version V
    const char *checkpoint;      // --checkpoint PATH
} replay_rescore_opts;

// Rescores s->t. MTRL_ERR_NOTFOUND when no weights can be had (named in err).
mtrl_status replay_rescore_run(replay_session *s, const replay_rescore_opts *o, replay_rescore *r, mtrl_error *err);
void replay_rescore_free(replay_rescore *r);

// ---- re-execution -----------------------------------------------------------------------------

typedef enum replay_diverge {
    REPLAY_SAME = 0,
    REPLAY_DIV_LOGITS = 1,       // a MODEL token: different log-prob or a different token sampled
    REPLAY_DIV_ENV = 2,          // a PROMPT/TOOL token differs: the env observed something else
    REPLAY_DIV_VERSION = 3,      // same token, different weight version stamp
    REPLAY_DIV_LENGTH = 4,       // one stream is a strict prefix of the other
    REPLAY_DIV_SUMMARY = 5,      // tokens equal; status, reward or tool log differ
    REPLAY_DIV_DIGEST = 6,       // no trajectory file: the token digest differs from the row's
    REPLAY_DIV_ROUTING = 7,      // same token and log-prob, a different expert choice (recorded routing)
} replay_diverge;

typedef struct replay_reexec {
    uint32_t version;            // weights used
    char weights[4352];          // description of the weights
    char note[512];              // e.g. the episode spans versions 3..4: used the first token's
    mtrl_traj re;                // the re-executed episode
    replay_diverge kind;
    long at;                     // first differing token, -1 when none
    char why[2048];              // the explanation (empty when identical)
    int prefix_ok;               // an aborted recording is an exact prefix of the re-execution
} replay_reexec;

mtrl_status replay_reexec_run(replay_session *s, replay_reexec *r, mtrl_error *err);
void replay_reexec_free(replay_reexec *r);

// ---- text helpers shared by the renderers -----------------------------------------------------

// The tokenizer the text views below decode with: the run's own ([model] tokenizer, e.g. a
// BPE for an imported model), set once by mtrl replay when it opens the run; NULL (the default):
// bytes.
void replay_text_use(const mtrl_tokenizer *tok);
// Writes the display text of token ids: their bytes as UTF-8 where they form valid sequences,
// other bytes and control characters as \xNN (\n and \t kept, or escaped when escape_ws),
// specials as <|name|>. colour: wrap specials in dim ANSI.
void replay_put_ids(FILE *f, const uint32_t *ids, size_t n, int colour, int escape_ws);
void replay_put_bytes(FILE *f, const uint8_t *b, size_t n, int escape_ws);
// Length of the valid UTF-8 sequence at b[0..n) (2..4), or 0 when b[0] does not start one.
size_t replay_utf8_len(const uint8_t *b, size_t n);
// Writes b[0..n): valid UTF-8 sequences as they are, a byte >= 0x80 that starts none through
// invalid_fmt (printf of the byte), an ASCII byte as ascii() returns it (NULL: the byte itself;
// buf has room for 16 characters). The text view and the JSON output differ only in those two.
typedef const char *(*replay_ascii_fn)(uint8_t c, char *buf, const void *u);
void replay_put_escaped(FILE *f, const uint8_t *b, size_t n, replay_ascii_fn ascii, const void *u,
                        const char *invalid_fmt);
// The display text of one token into out (cap bytes).
void replay_token_text(uint32_t id, char *out, size_t cap);
// Writes rgb [h][w][3] as an 8-bit RGB PNG at path (replay_png.c, libpng). 0, or -1 with the
// reason in err (a file that could not be finished is removed).
int replay_png_write(const char *path, const uint8_t *rgb, uint32_t w, uint32_t h, char *err, size_t cap);

#endif
