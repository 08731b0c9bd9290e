// mtrl_env.h: the environment plug-in ABI. The only header a plug-in needs.
//
// An environment ("env") poses a task to the model and answers its tool calls. mtrl ships
// built-in envs (retrieval, calc, http) and loads others from a shared library (a "plug-in").
// Both sides meet at one table of C callbacks, mtrl_env_api, defined here. This header
// includes only standard headers so a plug-in builds with nothing else of mtrl:
//
//     cc -shared -fPIC -I<mtrl>/env -o myenv.so myenv.c
//
// ---- the entry point ---------------------------------------------------------------------
// A plug-in exports exactly one symbol, MTRL_ENV_PLUGIN_SYMBOL ("mtrl_env_plugin"):
//
//     MTRL_ENV_EXPORT const mtrl_env_api *mtrl_env_plugin(uint32_t host_abi_version);
//
// It returns a pointer to a table with static storage duration (never freed, never changed),
// or NULL to refuse a host it cannot work with. The host loads the file with
// dlopen(RTLD_NOW | RTLD_LOCAL) and refuses it, with a message naming the file and what to do,
// when: the file cannot be loaded (dlerror() is quoted), the symbol is missing, the entry
// point returns NULL, the table's ABI major differs from the host's, its ABI minor is newer
// than the host's (rebuild against the host's header), or struct_size is smaller than
// MTRL_ENV_API_MIN_SIZE (a required callback would be missing).
//
// ---- versioning ---------------------------------------------------------------------------
// abi_version = (major << 16) | minor. The table is append-only: a new minor only adds
// members at the end; a host reads a member only when struct_size says the plug-in's table
// contains it, and treats anything past struct_size as NULL. An incompatible change bumps the
// major. A plug-in sets abi_version = MTRL_ENV_ABI_VERSION and struct_size =
// sizeof(mtrl_env_api) of the header it was built with.
//
// ---- calls, ownership and errors ----------------------------------------------------------
// - create(config) makes one independent env instance and returns it as `void *self`; every
//   other callback gets that pointer back. One instance is used by one thread at a time; the
//   host never calls into the same self concurrently. Different instances may run in
//   different threads only when the table sets MTRL_ENV_FLAG_THREAD_SAFE.
// - config is a NUL-terminated string of key=value pairs separated by newlines or ';'
//   ("doc_tokens=4096;inline_doc=1"). Whitespace around keys and values is not significant.
//   An env should refuse an unknown key or a bad value with an error naming it.
// - Callbacks that can fail return MTRL_ENV_OK (0) or MTRL_ENV_ERR (-1). On failure they
//   write a NUL-terminated message into the host-owned buffer (err, err_cap); err_cap is at
//   least 256. The message should name the input and say what to do
//   ("calc: digits=9 out of range 1..6"). An error from reset/step/demo aborts the episode;
//   the host records the message as the reason. Never longjmp, exit() or throw across a
//   callback, and do not install signal handlers or change process-wide state.
// - Observation memory is owned by the env: every pointer a callback hands back (prompt,
//   observation, demo actions, describe text) must stay valid and unchanged until the next
//   call on the same self (or destroy). The host copies what it keeps. This lets an env return
//   a view of a buffer it already has (a 1 MB document) without copying.
// - Bytes are bytes: observations and actions need not be NUL-terminated and may contain any
//   byte; lengths are explicit. Text should be UTF-8 (the tokenizer is byte-level).
//
// ---- the protocol between model and env ---------------------------------------------------
// reset(seed) starts an episode and returns the task prompt. The same seed must give the same
// task (episodes are replayed and grouped by seed). Then the host calls step() once per model
// action until done:
// - MTRL_ENV_ACTION_TOOL: the bytes the model produced between its tool-call tokens, by
//   convention `name(args)`, e.g. `search(k17)`, `read(120,64)`, `calc(12*7+3)`,
//   `get(/facts/3)`. The observation is the tool's result, shown to the model.
//   A malformed or unknown tool call is the model's mistake, not an env failure: return
//   MTRL_ENV_OK with an observation such as "error: unknown tool 'foo'; tools: search, read",
//   reward 0, done 0 and tool_error 1.
// - MTRL_ENV_ACTION_ANSWER: the model's final text (it stopped with end-of-sequence). The env
//   scores it and returns done = 1 with the reward (1 correct, 0 wrong unless the env
//   documents partial credit); the observation may be empty or a short verdict.
// After done = 1 the host calls reset before the next step.
//
// ---- what the host enforces, and what it asks --------------------------------------------
// - Tool calls: the experiment's [env] max_tool_calls holds for a plug-in too. The host counts
//   the TOOL steps of an episode; the one past the limit never reaches step(): the host ends
//   the episode itself (done = 1, reward 0, tool_error = 1, observation "error: tool call
//   limit (N) reached; episode over"). An env may still end an episode earlier, after its own
//   maximum (done = 1, reward 0).
// - Observation size: a prompt, observation or demo action over 64 MiB aborts the episode
//   ("... over max_obs_bytes"); [env] max_obs_bytes (256) is a key of the built-ins, which cut
//   their observations to it: a plug-in that wants small observations keeps them small itself
//   (the model's context is what [actor] max_tokens allows).
// - stdout is not yours: never write to it (the host's stdout is data, e.g. `mtrl check`'s is
//   an experiment file, and an isolated env's child inherits it). Diagnostics go to stderr,
//   errors into err.
// - Isolation: a plug-in runs in a child process by default ([env] isolate = auto), with
//   memory, CPU-time and file limits and a deadline on every call ([env] step_timeout_ms): a
//   crash or hang costs the episode, not the actor.
//
// demo (optional) returns a reference solution of the current task (after reset, before any
// step): the sequence of actions, each with its kind, that solves it. Used for supervised warm
// start and tests. describe (optional) returns the tool list as text, for the experiment's
// author: `mtrl check` prints it. It is not added to the prompt: the model sees only what
// reset returns, so a prompt that should name the tools names them itself.
#ifndef MTRL_ENV_H
#define MTRL_ENV_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MTRL_ENV_ABI_MAJOR 1u
#define MTRL_ENV_ABI_MINOR 0u
#define MTRL_ENV_ABI_VERSION ((MTRL_ENV_ABI_MAJOR << 16) | MTRL_ENV_ABI_MINOR)
#define MTRL_ENV_ABI_MAJOR_OF(v) ((uint32_t)(v) >> 16)
#define MTRL_ENV_ABI_MINOR_OF(v) ((uint32_t)(v) & 0xffffu)

#define MTRL_ENV_PLUGIN_SYMBOL "mtrl_env_plugin"

// Marks the entry point as exported even when the plug-in builds with -fvisibility=hidden.
#if defined(__GNUC__) || defined(__clang__)
#define MTRL_ENV_EXPORT __attribute__((visibility("default")))
#else
#define MTRL_ENV_EXPORT
#endif

#define MTRL_ENV_OK 0
#define MTRL_ENV_ERR (-1)

// Action kinds passed to step().
#define MTRL_ENV_ACTION_TOOL 1u   // the text between the model's tool-call tokens
#define MTRL_ENV_ACTION_ANSWER 2u // the model's final text

// Capability flags (mtrl_env_api.flags).
#define MTRL_ENV_FLAG_THREAD_SAFE 1u // distinct instances may be used from different threads

// A byte string owned by the env (see "Observation memory" above).
typedef struct mtrl_env_bytes {
    const char *data;
    size_t len;
} mtrl_env_bytes;

// What step() reports. The host zeroes the struct before each call; the env fills it.
typedef struct mtrl_env_step_out {
    mtrl_env_bytes obs; // observation shown to the model (tool result, or a verdict)
    double reward;      // this step's reward; the final reward comes with done = 1
    int32_t done;       // 1: the episode is over
    int32_t tool_error; // 1: the action was a malformed/unknown/failed tool call
    uint64_t reserved[4]; // zero; room for later minors (the host zeroes, the env ignores)
} mtrl_env_step_out;

// One action of a demo: its kind and bytes.
typedef struct mtrl_env_action {
    uint32_t kind; // MTRL_ENV_ACTION_TOOL or MTRL_ENV_ACTION_ANSWER
    const char *data;
    size_t len;
} mtrl_env_action;

typedef struct mtrl_env_demo_out {
    const mtrl_env_action *actions; // owned by the env, valid until the next call on self
    size_t count;
} mtrl_env_demo_out;

typedef struct mtrl_env_api {
    uint32_t abi_version; // MTRL_ENV_ABI_VERSION of the header the plug-in was built with
    uint32_t struct_size; // sizeof(mtrl_env_api) of that header
    const char *name;     // short name ("reverse"); shown in logs and stored with episodes
    const char *version;  // the env's own version ("1.0"); tasks may change between versions
    uint64_t flags;       // MTRL_ENV_FLAG_*

    // Required. Makes an instance from the config string. On success sets *self.
    int (*create)(const char *config, void **self, char *err, size_t err_cap);
    // Required. Frees the instance; self may be NULL.
    void (*destroy)(void *self);
    // Required. Starts an episode for seed; *prompt is the task prompt.
    int (*reset)(void *self, uint64_t seed, mtrl_env_bytes *prompt, char *err, size_t err_cap);
    // Required. Applies one action (kind MTRL_ENV_ACTION_*, bytes action[0..len)).
    int (*step)(void *self, uint32_t kind, const char *action, size_t len, mtrl_env_step_out *out,
                char *err, size_t err_cap);

    // Optional (NULL when absent). A reference solution of the current task.
    int (*demo)(void *self, mtrl_env_demo_out *out, char *err, size_t err_cap);
    // Optional. The tool list as text, one tool per line ("search(text): ..."); `mtrl check`
    // shows it, the model does not see it.
    int (*describe)(void *self, mtrl_env_bytes *out, char *err, size_t err_cap);

    // Later minors append members here.
} mtrl_env_api;

// The smallest struct_size a host accepts: the table up to and including the last required
// callback (step).
#define MTRL_ENV_API_MIN_SIZE (offsetof(mtrl_env_api, step) + sizeof(void (*)(void)))

// The entry point's type.
typedef const mtrl_env_api *(*mtrl_env_plugin_fn)(uint32_t host_abi_version);

#ifdef __cplusplus
}
#endif

#endif
