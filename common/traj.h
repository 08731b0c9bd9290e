// traj.h: the one trajectory representation (docs/architecture.md §4): on the wire, on disk, in replay.
//
// An mtrl_traj holds one episode: a header (ids, env, seeds, routing shape), the token stream as
// a struct of arrays, and a summary (rewards, status, reason, tool-call log, wall times). The
// actor builds one by appending tokens; the learner rebuilds it from wire messages (wire.h) or
// a trajectory file (trajfile.h) with the decoders below. The same bytes mean the same thing
// in all three places: the BEGIN, CHUNK and END wire payloads are exactly the header, token
// slice and summary encodings, and a file record is the whole-episode encoding.
//
// Ownership: an mtrl_traj owns every array and string it points to; mtrl_traj_free releases
// them. Token arrays are read-only views for callers: append through mtrl_traj_append*, which
// also keeps version_min/version_max and n_model current. Strings (env, reason, tool names,
// tool errors) may be NULL, meaning empty.
//
// Errors: the encoders cannot fail (they append to an mtrl_wbuf that grows through xrealloc).
// The decoders take untrusted bytes: every count and length is checked against an
// mtrl_traj_limits cap and against the bytes that remain BEFORE anything is allocated, and a
// failure returns MTRL_ERR_FORMAT (malformed, truncated, non-canonical) or MTRL_ERR_LIMIT (over
// a cap) with a message naming the encoding, the byte offset and the field:
//     "token slice: at byte 20: count: 300000 tokens over max_chunk_tokens=262144"
// A failed decode leaves the token arrays of its target as they were (the slice decoder
// validates everything before it appends). Decoders are strict, so an accepted input
// re-encodes to the same bytes (decode∘encode = identity; the fuzzers check it).
//
// ---- encodings (little-endian, format version MTRL_TRAJ_FORMAT) ------------------------------
// Every encoding starts with u32 tag, u16 format (= 1), u16 flags. Strings and blobs are a u32
// length then bytes (strings: no NUL inside). f32/f64 travel as their IEEE-754 bits.
//
// header "TBEG" (the BEGIN payload):
//     flags bit0 = MTRL_TRAJ_ROUTING_U16 (other bits 0)
//     u64 episode_id, u64 group_id, u64 task_seed, u32 actor_id, u32 incarnation,
//     u64 sample_seed, u64 sample_stream, u32 routing_width, f64 start_wall, str env
// token slice "TCHK" (the CHUNK payload):
//     flags bit0 = MTRL_TRAJ_ROUTING_U16
//     u64 offset (index of the first token in the episode), u32 count, u32 routing_width,
//     ids[count] u32, logprob[count] f32, kind[count] u8 (each <= MTRL_TOK_PAD),
//     u32 n_runs, n_runs x {u32 length >= 1, u32 version}: the per-token versions run-length
//         coded; lengths sum to count and adjacent runs have different versions,
//     routing[count][routing_width] u8, or u16 when the flag is set
// summary "TEND" (the END payload): flags bit0 = MTRL_TRAJ_IMAGES (other bits 0)
//     u64 total_tokens, u64 digest, u32 status (mtrl_ep_status, not OPEN), f64 reward,
//     f64 end_wall, u32 n_turn_rewards, f64[n_turn_rewards], str reason,
//     u32 n_tools, n_tools x {u32 turn, i32 status, f64 latency, str name, blob args,
//                             blob result, str error}
//     with MTRL_TRAJ_IMAGES (set exactly when the episode has pictures):
//     u32 image_patch (1..64), u32 n_images (>= 1), n_images x {u64 digest, u32 width,
//         u32 height, blob rgb (3 * width * height bytes)}: each distinct picture once, in the
//         order of first appearance, digest = mtrl_hash64(rgb, len, MTRL_TRAJ_IMAGE_SEED)
//         (checked, and no two alike). The stream's patch tokens name rows of the episode's patch
//         table: the pictures' patches (common/image.h) one after the other in this order.
// episode "TRAJ" (one trajectory-file record): flags 0, then a header, one token slice with
//     offset 0 holding every token, and a summary, in that order, nothing after. The decoder
//     also checks that the summary's total_tokens and digest match the tokens.
//
// ---- digest of the token stream --------------------------------------------------------------
//     h = MTRL_TRAJ_DIGEST_SEED
//     for each token i in order:
//         h = mtrl_hash64(rec_i, 13, h)   rec_i = id u32 | logprob bits u32 | version u32 | kind u8
//         if routing_width > 0:
//             h = mtrl_hash64(routing row i, routing_width * id_bytes, h)   (u16 ids little-endian)
//     digest = mtrl_hash64(n_tokens as u64 LE, 8, h)
// Tokens are hashed one by one, so the digest is the same however the stream is cut into
// chunks: mtrl_traj_digest_update may be called on any consecutive slices.
#ifndef MTRL_TRAJ_H
#define MTRL_TRAJ_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "common/trajbuf.h"

#define MTRL_TRAJ_FORMAT 1
#define MTRL_TRAJ_DIGEST_SEED 0x6d74726c2d747231ULL // "mtrl-tr1"
#define MTRL_TRAJ_ROUTING_U16 1u                      // routing ids are 2 bytes (experts > 256)
#define MTRL_TRAJ_IMAGES 1u                           // summary flag: an image section follows
#define MTRL_TRAJ_IMAGE_SEED 0x6d74726c2d696d31ULL    // "mtrl-im1"

typedef enum mtrl_tok_kind {
    MTRL_TOK_PROMPT = 0, // from env.reset; no loss
    MTRL_TOK_MODEL = 1,  // sampled by the policy; the only kind that carries loss
    MTRL_TOK_TOOL = 2,   // tool observation tokens; no loss
    MTRL_TOK_PAD = 3,    // padding; no loss
} mtrl_tok_kind;

typedef enum mtrl_ep_status {
    MTRL_EP_OPEN = 0,      // still streaming; never a final status, never in a summary
    MTRL_EP_COMPLETE = 1,  // the env said done
    MTRL_EP_TRUNCATED = 2, // the token budget ran out
    MTRL_EP_ABORTED = 3,   // the actor died, timed out or restarted; never trained on
    MTRL_EP_REJECTED = 4,  // malformed or inconsistent (gap, digest); never trained on
} mtrl_ep_status;

// "open", "complete", "truncated", "aborted", "rejected" (store and logs use these words).
const char *mtrl_ep_status_name(mtrl_ep_status s);
// The inverse; returns -1 for an unknown word.
int mtrl_ep_status_parse(const char *name);

typedef struct mtrl_traj_limits {
    uint64_t max_tokens;        // tokens per episode
    uint32_t max_chunk_tokens;  // tokens per slice (one CHUNK)
    uint32_t max_tool_calls;    // tool calls per episode
    uint32_t max_tool_bytes;    // bytes per tool argument or result
    uint32_t max_string;        // bytes per string (env, reason, tool name, tool error)
    uint32_t max_routing_width; // expert ids per token (n_moe_layers x top_k)
    uint32_t max_turns;         // per-turn rewards per episode
    uint32_t max_images;        // distinct pictures per episode
    uint32_t max_image_bytes;   // bytes of one picture (3 * width * height)
} mtrl_traj_limits;

// 2^21 tokens, 2^18 per chunk, 65536 tool calls of 16 MiB each way, 4 KiB strings, routing
// width 4096, 65536 turns, 4096 pictures of up to 48 MiB (4096 x 4096 RGB8).
mtrl_traj_limits mtrl_traj_limits_default(void);

typedef struct mtrl_tool_call {
    uint32_t turn;       // turn the call belongs to
    int32_t status;      // 0 = ok, otherwise the env's status code
    double latency;      // seconds
    char *name;          // owned; NULL = empty
    uint8_t *args;       // owned argument bytes
    uint32_t args_len;
    uint8_t *result;     // owned result bytes
    uint32_t result_len;
    char *error;         // owned; NULL when the call succeeded
} mtrl_tool_call;

typedef struct mtrl_traj {
    // ---- header (BEGIN)
    uint64_t episode_id;
    uint64_t group_id;       // episodes of the same task and seed group (group-relative advantages)
    uint64_t task_seed;      // env.reset seed
    char *env;               // env name; owned
    uint32_t actor_id;
    uint32_t incarnation;    // bumps on every actor restart
    uint64_t sample_seed;    // sampler RNG seed and stream, so replay can re-execute sampling
    uint64_t sample_stream;
    uint32_t routing_width;  // expert ids per token (n_moe_layers x top_k); 0 = no routing
    uint32_t flags;          // MTRL_TRAJ_ROUTING_U16
    double start_wall;       // wall seconds (mtrl_time_wall)

    // ---- tokens (struct of arrays, n_tokens each; owned)
    uint64_t n_tokens;
    uint64_t cap_tokens;
    uint32_t *ids;           // (n_tokens)
    float *logprob;          // (n_tokens) under the behaviour policy
    uint32_t *version;       // (n_tokens) weight version that produced the token
    uint8_t *kind;           // (n_tokens) mtrl_tok_kind
    uint8_t *routing;        // (n_tokens, routing_width * id_bytes); NULL when width is 0
    uint64_t cap_routing;    // routing bytes allocated
    uint64_t n_model;        // tokens of kind MODEL
    uint32_t version_min;    // over MODEL tokens; 0/0 when there are none
    uint32_t version_max;

    // ---- summary (END)
    mtrl_ep_status status;
    char *reason;            // why aborted/rejected/truncated; owned
    double reward;           // final reward
    double *turn_rewards;    // (n_turn_rewards) owned
    uint32_t n_turn_rewards, cap_turn_rewards;
    mtrl_tool_call *tools;   // (n_tools) owned
    uint32_t n_tools, cap_tools;
    double end_wall;
    uint64_t digest;         // as claimed by the last summary decoded; see mtrl_traj_digest_compute

    // ---- pictures (summary, MTRL_TRAJ_IMAGES; docs/multimodal.md)
    uint32_t image_patch;          // P of the stream's patch tokens; 0 = no pictures
    struct mtrl_traj_image *images; // (n_images) distinct pictures, first appearance first; owned
    uint32_t n_images, cap_images;
} mtrl_traj;

typedef struct mtrl_traj_image {
    uint64_t digest;      // mtrl_hash64(rgb, 3 * width * height, MTRL_TRAJ_IMAGE_SEED)
    uint32_t width, height;
    uint8_t *rgb;         // [height][width][3]; owned
    uint32_t first_patch; // its first row in the episode's patch table (the patches before it)
} mtrl_traj_image;

void mtrl_traj_init(mtrl_traj *t);
void mtrl_traj_free(mtrl_traj *t);  // NULL-safe; leaves t initialised and empty
void mtrl_traj_reset(mtrl_traj *t); // empties t, keeps the token and routing buffers for reuse
void mtrl_traj_swap(mtrl_traj *a, mtrl_traj *b);

void mtrl_traj_set_env(mtrl_traj *t, const char *env);
void mtrl_traj_set_reason(mtrl_traj *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
// Routing shape; only while the trajectory has no tokens. u16 = 1 for 2-byte expert ids.
void mtrl_traj_set_routing(mtrl_traj *t, uint32_t width, int u16);
static inline uint32_t mtrl_traj_routing_id_bytes(const mtrl_traj *t) {
    return (t->flags & MTRL_TRAJ_ROUTING_U16) ? 2u : 1u;
}
static inline size_t mtrl_traj_routing_row_bytes(const mtrl_traj *t) {
    return (size_t)t->routing_width * mtrl_traj_routing_id_bytes(t);
}
// Expert id j (0 <= j < routing_width) of token i.
uint32_t mtrl_traj_routing_id(const mtrl_traj *t, uint64_t i, uint32_t j);

void mtrl_traj_reserve(mtrl_traj *t, uint64_t n_tokens);
// Appends one token. routing_row holds routing_width ids of id_bytes each (little-endian), or
// is NULL when routing_width is 0. An invalid kind is a programming error (aborts).
void mtrl_traj_append(mtrl_traj *t, uint32_t id, float logprob, uint32_t version, uint8_t kind,
                      const uint8_t *routing_row);
// Appends n tokens from parallel arrays (routing: n rows, may be NULL when width is 0).
void mtrl_traj_append_n(mtrl_traj *t, uint64_t n, const uint32_t *ids, const float *logprob,
                        const uint32_t *version, const uint8_t *kind, const uint8_t *routing);
void mtrl_traj_add_turn_reward(mtrl_traj *t, double r);
// An episode succeeded when it earned the env's full reward, 1: the built-ins give 1 for the
// right answer and below 1 for partial credit (corpus and retrieval credit=), which is not success.
static inline int mtrl_traj_success(const mtrl_traj *t) { return t->reward >= 1.0; }
// Copies name, args, result and error (error NULL or "" = success).
void mtrl_traj_add_tool_call(mtrl_traj *t, uint32_t turn, const char *name, const void *args,
                             uint32_t args_len, const void *result, uint32_t result_len,
                             double latency, int32_t status, const char *error);

// ---- pictures (traj_image.c) -------------------------------------------------------------------
// The picture rgb [h][w][3], cut into P x P patches, joins the episode: stored once (a picture
// already there, by digest and bytes, is not stored again) and given rows of the patch table.
// Returns its first patch row; its tokens are mtrl_image_tokens(w, h, P, first_patch, ...). P
// must be the same for every picture of an episode (a programming error otherwise).
uint32_t mtrl_traj_add_image(mtrl_traj *t, int P, const uint8_t *rgb, uint32_t w, uint32_t h);
// Rows of the episode's patch table, and the table itself: out [rows][3P²] (common/image.h).
size_t mtrl_traj_patch_rows(const mtrl_traj *t);
void mtrl_traj_patch_table(const mtrl_traj *t, uint8_t *out);
// Checks the stream of an episode with pictures against them: every image token is IMG_START /
// IMG_ROW / IMG_END or names a row of the patch table; MTRL_ERR_FORMAT naming the token
// otherwise (the model would refuse it). Without pictures token ids stay opaque to this layer,
// as they always were (MTRL_OK): their range against the vocabulary is the model's to know.
mtrl_status mtrl_traj_images_check(const mtrl_traj *t, mtrl_error *err);
// Copies b's pictures into a (which has none), e.g. the episodes of a group sharing a prompt.
void mtrl_traj_copy_images(mtrl_traj *a, const mtrl_traj *b);

// ---- digest ----------------------------------------------------------------------------------

typedef struct mtrl_traj_digest {
    uint64_t h;        // running hash
    uint64_t n;        // tokens fed
} mtrl_traj_digest;

void mtrl_traj_digest_init(mtrl_traj_digest *d);
// Feeds tokens [first, first + count) of t (must be the next tokens of the stream).
void mtrl_traj_digest_update(mtrl_traj_digest *d, const mtrl_traj *t, uint64_t first, uint64_t count);
uint64_t mtrl_traj_digest_final(const mtrl_traj_digest *d);
// The digest of all of t's tokens.
uint64_t mtrl_traj_digest_compute(const mtrl_traj *t);

// ---- encoders (append to out) ----------------------------------------------------------------

// A borrowed view of `count` consecutive tokens, written with `offset` as their position.
typedef struct mtrl_traj_slice {
    const mtrl_traj *t;
    uint64_t first;   // index into t's arrays
    uint32_t count;
    uint64_t offset;  // position written into the encoding (normally == first)
} mtrl_traj_slice;

static inline mtrl_traj_slice mtrl_traj_slice_of(const mtrl_traj *t, uint64_t first, uint32_t count) {
    mtrl_traj_slice s = {t, first, count, first};
    return s;
}

void mtrl_traj_header_encode(mtrl_wbuf *out, const mtrl_traj *t);
void mtrl_traj_slice_encode(mtrl_wbuf *out, const mtrl_traj_slice *s);
// Writes total_tokens = t->n_tokens and a freshly computed digest.
void mtrl_traj_summary_encode(mtrl_wbuf *out, const mtrl_traj *t);
// Writes the given total and digest (for relaying a decoded summary unchanged).
void mtrl_traj_summary_encode_with(mtrl_wbuf *out, const mtrl_traj *t, uint64_t total_tokens,
                                   uint64_t digest);
void mtrl_traj_encode(mtrl_wbuf *out, const mtrl_traj *t);

// ---- decoders (untrusted bytes; see the file top) --------------------------------------------

// Resets t and fills the header fields.
mtrl_status mtrl_traj_header_decode(mtrl_traj *t, const void *buf, size_t n,
                                    const mtrl_traj_limits *lim, mtrl_error *err);

// Reads a slice's fixed fields without validating the rest.
typedef struct mtrl_traj_slice_info {
    uint64_t offset;
    uint32_t count;
    uint32_t routing_width;
    uint32_t flags;
} mtrl_traj_slice_info;
mtrl_status mtrl_traj_slice_peek(const void *buf, size_t n, mtrl_traj_slice_info *info, mtrl_error *err);

// Validates a slice and appends its tokens to t. The slice's routing width and flags must equal
// t's; its offset must equal expect_offset unless that is UINT64_MAX; t->n_tokens + count must
// stay within lim->max_tokens. *offset (may be NULL) receives the slice's offset. On failure t
// is unchanged.
mtrl_status mtrl_traj_slice_decode(mtrl_traj *t, const void *buf, size_t n, uint64_t expect_offset,
                                   const mtrl_traj_limits *lim, uint64_t *offset, mtrl_error *err);

// Fills t's summary fields (status, reason, rewards, tools, end_wall, digest) and returns the
// claimed total token count and digest for the caller to compare with the tokens it holds.
// The tokens are not touched. On failure the summary fields are cleared.
mtrl_status mtrl_traj_summary_decode(mtrl_traj *t, const void *buf, size_t n,
                                     const mtrl_traj_limits *lim, uint64_t *total_tokens,
                                     uint64_t *digest, mtrl_error *err);

// Resets t and decodes a whole episode; checks token count and digest (MTRL_ERR_FORMAT).
mtrl_status mtrl_traj_decode(mtrl_traj *t, const void *buf, size_t n, const mtrl_traj_limits *lim,
                             mtrl_error *err);

// ---- comparison ------------------------------------------------------------------------------

// 1 when a and b hold the same episode bit for bit (floats compared by their bits); otherwise 0
// and, when why is non-NULL, the first difference ("tokens[17].logprob differs").
int mtrl_traj_equal(const mtrl_traj *a, const mtrl_traj *b, char *why, size_t why_cap);

#endif
