// env_host.h: the host side of environments, used by the actor: open an env by name or by
// plug-in path, run episodes on it, in-process or isolated in a child process.
//
//     mtrl_env_opts o;
//     mtrl_env_opts_default(&o);
//     o.isolate = 1;
//     mtrl_env *env;
//     if (mtrl_env_open(&env, "calc", "digits=2;ops=2", &o, &err)) -> config/plug-in error, stop
//     mtrl_env_result r;
//     mtrl_env_reset(env, seed, &r, &err);                 r.obs = the prompt
//     mtrl_env_step(env, MTRL_ENV_ACTION_TOOL, "calc(3+4)", 9, &r, &err);  r.obs = "7"
//     mtrl_env_step(env, MTRL_ENV_ACTION_ANSWER, "7", 1, &r, &err);        r.done, r.reward
//     mtrl_env_close(env);
//
// ---- names ----------------------------------------------------------------------------------
// A name containing '/' or ending in ".so" is a plug-in path (dlopen'd, ABI-checked as
// described in mtrl_env.h); otherwise a built-in: retrieval, calc, http. The config string is
// handed to the env's create (key=value pairs separated by newlines or ';').
//
// ---- isolation (opts.isolate = 1) -----------------------------------------------------------
// The env runs in a child process: fork, then at once exec of /proc/self/exe (this same
// program) with argv[0] "mtrl-env-host"; a constructor in env_host.c recognises that start,
// before main runs, and serves requests over an AF_UNIX socketpair (env_wire.h). The child
// loads the plug-in itself, so a plug-in's constructors, crashes and hangs stay there.
// Why fork+exec and not fork alone: the actor holds a ZeroMQ context (I/O threads, locks) and
// possibly a CUDA context and GiBs of mappings; after a plain fork only the forking thread
// exists, any lock another thread held stays locked forever, and RLIMIT_AS would count the
// parent's whole address space. Between fork and exec the child runs only code in this file
// and only async-signal-safe calls (prctl, setrlimit, dup2, open, close_range, sigprocmask,
// execve, _exit); everything it needs (argv, envp, limits) is prepared before fork. Re-running
// our own executable needs no separate binary to install or find (the "reexec" pattern), and
// works for the mtrl command and for test programs alike. Limitation: a program started
// through an explicit loader (ld.so ./prog) or under valgrind re-executes the loader; use
// isolate = 0 there.
// The child gets: PR_SET_PDEATHSIG(SIGKILL) (it dies with the thread that forked it; it also
// exits if the host already died before the prctl), RLIMIT_AS (mem_limit_bytes; skipped
// under AddressSanitizer, whose shadow memory needs a huge address space), RLIMIT_CPU
// (cpu_limit_s of CPU time over the child's life; the host recycles the child at a reset
// once it used half of it), RLIMIT_NOFILE (nofile_limit), RLIMIT_CORE = 0 (no core files from
// crashing plug-ins), stdin from /dev/null, stdout joined to stderr (stdout of mtrl carries
// results), no other inherited descriptor (ZeroMQ sockets stay in the actor), an empty signal
// mask.
// Every reset/step/demo/describe has a deadline (call_timeout_ms; starting the child and
// create has start_timeout_ms). When the child dies or misses the deadline, the call returns
// an error and the episode is aborted, with reasons such as
//     "env crashed: signal 11 (Segmentation fault) during step (env 'x', pid 123; ...)"
//     "env step timed out after 500 ms (env 'x', pid 123; the env host was killed ...)"
// the child is killed and reaped, and the next reset starts a fresh child (counted in
// restarts); the caller carries on with the same mtrl_env. Replies larger than max_obs_bytes
// are refused before allocating (the child is killed: the stream cannot be resynchronised).
// Non-isolated mode (isolate = 0) calls the table directly in this process: fastest, but a
// crash or hang in the env is the actor's.
//
// ---- errors ---------------------------------------------------------------------------------
// Every call returns MTRL_OK or an mtrl_status with err filled:
//   open:  MTRL_ERR_NOTFOUND (unknown built-in), MTRL_ERR_PLUGIN (refused plug-in: message
//          names the file and what to do), MTRL_ERR_USAGE (the env refused its config),
//          MTRL_ERR_IO (could not start the child), MTRL_ERR_TIMEOUT / MTRL_ERR_PLUGIN (the
//          child hung or died while starting).
//   reset/step/demo/describe: MTRL_ERR_PLUGIN (the env failed, crashed, or broke the ABI),
//          MTRL_ERR_TIMEOUT (deadline passed), MTRL_ERR_LIMIT (observation over
//          max_obs_bytes), MTRL_ERR_STATE (step without an episode; demo before reset).
//   Any error from reset/step/demo ends the episode (the message is its abort reason); the
//   next reset starts a new one. A malformed tool call is not an error: it comes back as an
//   observation ("error: unknown tool 'foo'; tools: search, read") with tool_error = 1.
//
// ---- memory and threads ---------------------------------------------------------------------
// Observation, prompt, demo and describe pointers handed out stay valid until the next call on
// the same mtrl_env (or close); copy what you keep. One mtrl_env is used by one thread at a
// time.
#ifndef MTRL_ENV_HOST_H
#define MTRL_ENV_HOST_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "env/mtrl_env.h"

typedef struct mtrl_env mtrl_env;

typedef struct mtrl_env_opts {
    int isolate;              // 1: run the env in a child process (see above)
    int call_timeout_ms;      // isolated: deadline of each reset/step/demo/describe (10000)
    int start_timeout_ms;     // isolated: deadline to start the child and create the env (10000)
    uint64_t mem_limit_bytes; // isolated: RLIMIT_AS of the child, 0 = none (4 GiB)
    int cpu_limit_s;          // isolated: RLIMIT_CPU of the child, 0 = none (3600)
    int nofile_limit;         // isolated: RLIMIT_NOFILE of the child, 0 = inherit (256)
    size_t max_obs_bytes;     // largest prompt/observation/demo accepted, both modes (64 MiB)
    long max_tool_calls;      // tool calls per episode the host lets through to the env; the one past
                              // them ends the episode here, reward 0, without calling the env
                              // ([env] max_tool_calls for plug-ins); -1 = the env's own business (-1)
} mtrl_env_opts;

void mtrl_env_opts_default(mtrl_env_opts *o);

// Process-wide: fn(user) is called about every 100 ms while a call of an isolated env waits for
// its child (up to step_timeout_ms), from the thread that made the call. An actor sends its
// heartbeats from it, so a hung env step costs only that episode, not the actor's standing with
// the learner. NULL = none (the default).
void mtrl_env_wait_hook_set(void (*fn)(void *user), void *user);

// What reset and step report.
typedef struct mtrl_env_result {
    const char *obs;  // prompt (reset) or observation (step); valid until the next call
    size_t obs_len;
    double reward;    // step: this step's reward (final with done = 1); reset: 0
    int done;         // step: the episode is over
    int tool_error;   // step: the action was a malformed/unknown/failed tool call
    double latency_s; // wall time of the call as the host saw it (includes the round trip)
} mtrl_env_result;

// Running counts for logs and the run store.
typedef struct mtrl_env_stats {
    uint64_t episodes; // successful resets
    uint64_t steps;    // successful steps
    uint64_t aborts;   // episodes ended by an error, crash or timeout
    uint64_t restarts; // isolated children started after the first
    double last_latency_s;
    int child_pid;     // isolated: the running child's pid, 0 when none (for logs and tests)
} mtrl_env_stats;

// Opens an env. opts may be NULL (defaults: in-process). On error *out is NULL.
mtrl_status mtrl_env_open(mtrl_env **out, const char *name_or_path, const char *config, const mtrl_env_opts *opts,
                          mtrl_error *err);
// Destroys the env (and stops its child). NULL is a no-op.
void mtrl_env_close(mtrl_env *e);

// Starts an episode. Isolated: starts a fresh child first when the previous one died.
mtrl_status mtrl_env_reset(mtrl_env *e, uint64_t seed, mtrl_env_result *out, mtrl_error *err);
// One action: kind MTRL_ENV_ACTION_TOOL or MTRL_ENV_ACTION_ANSWER, bytes action[0..len).
mtrl_status mtrl_env_step(mtrl_env *e, uint32_t kind, const char *action, size_t len, mtrl_env_result *out,
                          mtrl_error *err);
// The reference solution of the current episode (call after reset, before stepping).
// MTRL_ERR_NOTFOUND when the env has no demo.
mtrl_status mtrl_env_demo(mtrl_env *e, mtrl_env_demo_out *out, mtrl_error *err);
// The env's tool list. MTRL_ERR_NOTFOUND when the env has no describe.
mtrl_status mtrl_env_describe(mtrl_env *e, const char **text, size_t *len, mtrl_error *err);

const char *mtrl_env_name(const mtrl_env *e);    // the env's own name ("calc", "reverse")
const char *mtrl_env_version(const mtrl_env *e); // the env's own version string
int mtrl_env_isolated(const mtrl_env *e);
int mtrl_env_has_demo(const mtrl_env *e);
void mtrl_env_stats_get(const mtrl_env *e, mtrl_env_stats *out);

#endif
