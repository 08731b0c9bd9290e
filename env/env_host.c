// env_host.c: opening envs and running episodes, in-process or in an isolated child
// (see env_host.h for the contract, env_wire.h for the child protocol).
#include "env/env_host.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/check.h"
#include "common/log.h"
#include "common/timeutil.h"
#include "env/env_loader.h"
#include "env/env_util.h"
#include "env/env_wire.h"

#if defined(__SANITIZE_ADDRESS__)
#define ENV_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ENV_UNDER_ASAN 1
#endif
#endif
#ifndef ENV_UNDER_ASAN
#define ENV_UNDER_ASAN 0
#endif

extern char **environ;

struct mtrl_env {
    char *spec;   // name or path as given
    char *config; // config string as given
    mtrl_env_opts o;
    char name[64], version[64];
    int has_demo, has_describe;
    int in_episode; // a reset succeeded and no step ended or aborted the episode since
    long tool_calls; // tool actions of this episode (opts.max_tool_calls)
    char limit_obs[96]; // the observation of the tool call past opts.max_tool_calls
    mtrl_env_stats st;
    // in-process
    env_loaded lib;
    void *self;
    char cberr[MTRL_ERROR_MSG_MAX]; // the error buffer handed to the env's callbacks
    // isolated
    pid_t pid; // 0 when no child runs
    int fd;    // our end of the socketpair, -1 when none
    uint64_t started; // children started
    env_buf rx;       // last reply payload; observations point into it
    mtrl_env_action *demo;
    size_t demo_cap;
};

void mtrl_env_opts_default(mtrl_env_opts *o) {
    memset(o, 0, sizeof *o);
    o->isolate = 0;
    o->call_timeout_ms = 10000;
    o->start_timeout_ms = 10000;
    o->mem_limit_bytes = (uint64_t)4 << 30;
    o->cpu_limit_s = 3600;
    o->nofile_limit = 256;
    o->max_obs_bytes = (size_t)64 << 20;
    o->max_tool_calls = -1;
}

const char *mtrl_env_name(const mtrl_env *e) { return e->name; }
const char *mtrl_env_version(const mtrl_env *e) { return e->version; }
int mtrl_env_isolated(const mtrl_env *e) { return e->o.isolate; }
int mtrl_env_has_demo(const mtrl_env *e) { return e->has_demo; }
void mtrl_env_stats_get(const mtrl_env *e, mtrl_env_stats *out) {
    *out = e->st;
    out->child_pid = e->pid > 0 ? (int)e->pid : 0;
}

// ---- the child: start, stop, reap -----------------------------------------------------------

// The start of a child, recognised before main runs: argv[0] is ENV_CHILD_ARGV0 and
// ENV_CHILD_FD_VAR names a socket. glibc passes (argc, argv, envp) to constructors.
__attribute__((constructor)) static void env_child_entry_(int argc, char **argv, char **envp) {
    (void)envp;
    if (argc < 1 || !argv || !argv[0] || strcmp(argv[0], ENV_CHILD_ARGV0) != 0) return;
    const char *v = getenv(ENV_CHILD_FD_VAR);
    if (!v) return;
    int fd = atoi(v);
    struct stat sb;
    if (fd < 0 || fstat(fd, &sb) != 0 || !S_ISSOCK(sb.st_mode)) return;
    unsetenv(ENV_CHILD_FD_VAR); // the env's own children are not env hosts
    int status = env_child_serve(fd);
    fflush(NULL);
    _exit(status);
}

// Runs in the child between fork and exec: only async-signal-safe calls, on data prepared
// before fork (the parent may have had other threads holding locks at the time of fork).
typedef struct spawn_plan {
    char **argv, **envp;
    int sock;
    pid_t parent;
    int set_as, set_cpu, set_nofile;
    struct rlimit as, cpu, nofile, core;
    sigset_t empty;
    long max_fd;
} spawn_plan;

static _Noreturn void child_exec_(const spawn_plan *p) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != p->parent) _exit(126); // the host died before prctl took effect
    sigprocmask(SIG_SETMASK, &p->empty, NULL);
    setpgid(0, 0); // terminal signals (Ctrl-C) go to the actor, which closes its envs itself
    if (p->sock != ENV_CHILD_FD) {
        if (dup2(p->sock, ENV_CHILD_FD) < 0) _exit(125);
    } else if (fcntl(ENV_CHILD_FD, F_SETFD, 0) < 0) {
        _exit(125);
    }
    int dn = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (dn > 0) dup2(dn, 0);
    else if (dn == 0) fcntl(0, F_SETFD, 0);
    if (p->sock == 2 && dn >= 0) dup2(dn, 2); // stderr was our socket (the host had closed fd 2)
    dup2(2, 1);
    if (syscall(SYS_close_range, ENV_CHILD_FD + 1, ~0u, 0) != 0)
        for (long fd = ENV_CHILD_FD + 1; fd < p->max_fd; fd++) close((int)fd);
    setrlimit(RLIMIT_CORE, &p->core);
    if (p->set_as) setrlimit(RLIMIT_AS, &p->as);
    if (p->set_cpu) setrlimit(RLIMIT_CPU, &p->cpu);
    if (p->set_nofile) setrlimit(RLIMIT_NOFILE, &p->nofile);
    execve("/proc/self/exe", p->argv, p->envp);
    _exit(127);
}

// Waits up to grace_ms for the child to exit by itself, then kills it. Fills *wstatus and
// returns 0, or -1 when the status is unavailable (SIGCHLD ignored by the program: the kernel
// reaps children itself).
static int child_reap_(pid_t pid, int grace_ms, int *wstatus) {
    double until = mtrl_time_mono() + grace_ms / 1000.0;
    for (;;) {
        pid_t r = waitpid(pid, wstatus, WNOHANG);
        if (r == pid) return 0;
        if (r < 0 && errno != EINTR) return -1;
        if (mtrl_time_mono() >= until) break;
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    kill(pid, SIGKILL);
    for (;;) {
        pid_t r = waitpid(pid, wstatus, 0);
        if (r == pid) return 0;
        if (r < 0 && errno != EINTR) return -1;
    }
}

static void child_forget_(mtrl_env *e) {
    if (e->fd >= 0) close(e->fd);
    e->fd = -1;
    e->pid = 0; // in_episode is the caller's to end (so the abort is counted once)
}

// Kills the child at once (it hung, or broke the protocol).
static void child_kill_(mtrl_env *e) {
    if (e->pid > 0) {
        int ws;
        kill(e->pid, SIGKILL);
        child_reap_(e->pid, 0, &ws);
    }
    child_forget_(e);
}

// Asks the child to destroy its env and exit; kills it when it does not within a second.
static void child_stop_(mtrl_env *e) {
    if (e->pid <= 0) return;
    double deadline = mtrl_time_mono() + 1.0;
    env_wire_req q = {.magic = ENV_WIRE_MAGIC, .op = ENV_OP_CLOSE};
    env_wire_rep rep;
    if (env_wire_write(e->fd, &q, sizeof q, deadline) == ENV_IO_OK) env_wire_read(e->fd, &rep, sizeof rep, deadline);
    close(e->fd);
    e->fd = -1;
    int ws;
    child_reap_(e->pid, 1000, &ws);
    child_forget_(e);
}

// The abort reason after the child's end of the socket closed under us.
static mtrl_status child_died_(mtrl_env *e, const char *what, mtrl_error *err) {
    pid_t pid = e->pid;
    int ws = 0;
    int have = child_reap_(pid, 1000, &ws) == 0;
    child_forget_(e);
    char tail[256];
    snprintf(tail, sizeof tail, " (env '%s', pid %d; a fresh env host starts at the next reset)", e->name, (int)pid);
    if (have && WIFSIGNALED(ws)) {
        int sig = WTERMSIG(ws);
        const char *hint = "";
        char hintbuf[128];
        if (sig == SIGXCPU) {
            snprintf(hintbuf, sizeof hintbuf, "; it used up its CPU time limit (cpu_limit_s = %d)", e->o.cpu_limit_s);
            hint = hintbuf;
        } else if (sig == SIGKILL) {
            hint = "; killed from outside, e.g. by the out-of-memory killer";
        }
        return mtrl_error_set(err, MTRL_ERR_PLUGIN, "env crashed: signal %d (%s) during %s%s%s", sig, strsignal(sig),
                              what, hint, tail);
    }
    if (have && WIFEXITED(ws)) {
        int code = WEXITSTATUS(ws);
        const char *hint = code == 127 ? "; the child could not execute /proc/self/exe: use isolate = 0 where /proc "
                                         "is unavailable or the program runs under a loader"
                                       : "";
        return mtrl_error_set(err, MTRL_ERR_PLUGIN, "env host exited with status %d during %s%s%s", code, what, hint,
                              tail);
    }
    return mtrl_error_set(err, MTRL_ERR_PLUGIN, "env host went away during %s (exit status unavailable)%s", what,
                          tail);
}

static void (*wait_hook_)(void *);
static void *wait_hook_user_;

void mtrl_env_wait_hook_set(void (*fn)(void *user), void *user) {
    wait_hook_ = fn;
    wait_hook_user_ = user;
}

// Waits for the child's reply to start (ENV_IO_OK) or the deadline (ENV_IO_TIMEOUT), calling
// the wait hook every 100 ms meanwhile: a hung env step must not silence the actor's heartbeats
// (issue 28, item 7: with isolate = true, healthy episodes were aborted as "actor stopped
// heartbeating" while one step waited for its watchdog).
static int wait_reply_(int fd, double deadline) {
    for (;;) {
        double now = mtrl_time_mono(), left = deadline - now;
        if (left <= 0) return ENV_IO_TIMEOUT;
        struct pollfd p = {fd, POLLIN, 0};
        int r = poll(&p, 1, left > 0.1 ? 100 : (int)(left * 1000) + 1);
        if (r > 0) return ENV_IO_OK; // readable, or hung up: the read says which
        if (r < 0 && errno != EINTR) return ENV_IO_ERR;
        if (wait_hook_) wait_hook_(wait_hook_user_);
    }
}

// One request/reply exchange with the child under a deadline. The reply payload lands in
// e->rx. On a transport failure the child is gone afterwards and err holds the abort reason;
// a reply with a non-zero status returns that status with the child's message.
static mtrl_status call_(mtrl_env *e, uint32_t op, uint32_t kind, uint64_t seed, const void *payload, size_t len,
                         int timeout_ms, const char *what, env_wire_rep *rep, mtrl_error *err) {
    double deadline = mtrl_time_mono() + timeout_ms / 1000.0;
    env_wire_req q = {.magic = ENV_WIRE_MAGIC, .op = op, .kind = kind, .seed = seed, .len = len};
    int r = env_wire_write(e->fd, &q, sizeof q, deadline);
    if (r == ENV_IO_OK && len) r = env_wire_write(e->fd, payload, len, deadline);
    if (r == ENV_IO_OK) r = wait_reply_(e->fd, deadline);
    if (r == ENV_IO_OK) r = env_wire_read(e->fd, rep, sizeof *rep, deadline);
    if (r == ENV_IO_OK && rep->magic != ENV_WIRE_MAGIC) {
        pid_t pid = e->pid;
        child_kill_(e);
        return mtrl_error_set(err, MTRL_ERR_PLUGIN,
                              "env host sent a malformed reply during %s (env '%s', pid %d; it was killed; did the "
                              "plug-in write to file descriptor %d?)",
                              what, e->name, (int)pid, ENV_CHILD_FD);
    }
    if (r == ENV_IO_OK && rep->len > (uint64_t)e->o.max_obs_bytes + 4096) {
        pid_t pid = e->pid;
        child_kill_(e);
        return mtrl_error_set(err, MTRL_ERR_LIMIT,
                              "env '%s' returned %llu bytes during %s, over max_obs_bytes = %zu (pid %d was killed)",
                              e->name, (unsigned long long)rep->len, what, e->o.max_obs_bytes, (int)pid);
    }
    if (r == ENV_IO_OK) {
        env_buf_clear(&e->rx);
        env_buf_reserve(&e->rx, (size_t)rep->len);
        r = rep->len ? env_wire_read(e->fd, e->rx.data, (size_t)rep->len, deadline) : ENV_IO_OK;
        if (r == ENV_IO_OK) {
            e->rx.len = (size_t)rep->len;
            e->rx.data[e->rx.len] = 0;
        }
    }
    if (r == ENV_IO_TIMEOUT) {
        pid_t pid = e->pid;
        child_kill_(e);
        return mtrl_error_set(err, MTRL_ERR_TIMEOUT,
                              "env %s timed out after %d ms (env '%s', pid %d; the env host was killed and a fresh "
                              "one starts at the next reset)",
                              what, timeout_ms, e->name, (int)pid);
    }
    if (r != ENV_IO_OK) return child_died_(e, what, err);
    if (rep->status != 0) {
        mtrl_status st = rep->status < 0 && rep->status >= MTRL_ERR_STATE ? (mtrl_status)rep->status : MTRL_ERR_PLUGIN;
        const char *msg = e->rx.data ? e->rx.data : "(no message)";
        if (op != ENV_OP_OPEN && st == MTRL_ERR_PLUGIN)
            return mtrl_error_set(err, st, "env '%s' failed during %s: %s", e->name, what, msg);
        return mtrl_error_set(err, st, "%s", msg);
    }
    return MTRL_OK;
}

static mtrl_status child_start_(mtrl_env *e, mtrl_error *err) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        return mtrl_error_set(err, MTRL_ERR_IO, "env '%s': socketpair failed: %s", e->spec, strerror(errno));

    // Everything the child needs is built here, before fork.
    spawn_plan p;
    memset(&p, 0, sizeof p);
    char *argv[2] = {(char *)ENV_CHILD_ARGV0, NULL};
    char fdvar[64];
    snprintf(fdvar, sizeof fdvar, "%s=%d", ENV_CHILD_FD_VAR, ENV_CHILD_FD);
    size_t n = 0;
    while (environ && environ[n]) n++;
    char **envp = xmalloc((n + 2) * sizeof *envp);
    size_t k = 0, vl = strlen(ENV_CHILD_FD_VAR);
    for (size_t i = 0; i < n; i++)
        if (strncmp(environ[i], ENV_CHILD_FD_VAR, vl) != 0 || environ[i][vl] != '=') envp[k++] = environ[i];
    envp[k++] = fdvar;
    envp[k] = NULL;
    p.argv = argv;
    p.envp = envp;
    p.sock = sv[1];
    p.parent = getpid();
    p.core = (struct rlimit){0, 0};
    if (e->o.mem_limit_bytes && !ENV_UNDER_ASAN) {
        p.set_as = 1;
        p.as.rlim_cur = p.as.rlim_max = (rlim_t)e->o.mem_limit_bytes;
    }
    if (e->o.cpu_limit_s > 0) {
        p.set_cpu = 1;
        p.cpu.rlim_cur = (rlim_t)e->o.cpu_limit_s;
        p.cpu.rlim_max = (rlim_t)e->o.cpu_limit_s + 5; // SIGXCPU first, SIGKILL 5 s later
    }
    if (e->o.nofile_limit > 0) {
        p.set_nofile = 1;
        p.nofile.rlim_cur = p.nofile.rlim_max = (rlim_t)e->o.nofile_limit;
    }
    // An unprivileged process cannot raise a hard limit: ask for at most the current one, so
    // setrlimit in the child cannot fail and leave the soft limit unset.
    struct { int on, res; struct rlimit *want; } lims[] = {
        {p.set_as, RLIMIT_AS, &p.as}, {p.set_cpu, RLIMIT_CPU, &p.cpu}, {p.set_nofile, RLIMIT_NOFILE, &p.nofile}};
    for (size_t i = 0; i < sizeof lims / sizeof lims[0]; i++) {
        struct rlimit cur;
        if (!lims[i].on || getrlimit(lims[i].res, &cur) != 0 || cur.rlim_max == RLIM_INFINITY) continue;
        if (lims[i].want->rlim_max > cur.rlim_max) lims[i].want->rlim_max = cur.rlim_max;
        if (lims[i].want->rlim_cur > lims[i].want->rlim_max) lims[i].want->rlim_cur = lims[i].want->rlim_max;
    }
    sigemptyset(&p.empty);
    p.max_fd = sysconf(_SC_OPEN_MAX);
    if (p.max_fd < 0 || p.max_fd > 65536) p.max_fd = 65536;

    pid_t pid = fork();
    if (pid == 0) child_exec_(&p);
    int fork_errno = errno;
    free(envp);
    close(sv[1]);
    if (pid < 0) {
        close(sv[0]);
        return mtrl_error_set(err, MTRL_ERR_IO, "env '%s': fork failed: %s", e->spec, strerror(fork_errno));
    }
    fcntl(sv[0], F_SETFL, fcntl(sv[0], F_GETFL) | O_NONBLOCK);
    e->pid = pid;
    e->fd = sv[0];
    e->started++;
    if (e->started > 1) e->st.restarts++;

    // OPEN: the child loads the env and creates the instance.
    size_t sl = strlen(e->spec), cl = strlen(e->config);
    char *payload = xmalloc(sl + cl + 2);
    memcpy(payload, e->spec, sl + 1);
    memcpy(payload + sl + 1, e->config, cl + 1);
    env_wire_rep rep;
    mtrl_status st = call_(e, ENV_OP_OPEN, 0, 0, payload, sl + cl + 2, e->o.start_timeout_ms, "start", &rep, err);
    free(payload);
    if (st != MTRL_OK) {
        child_stop_(e);
        return st;
    }
    uint32_t caps = 0;
    if (e->rx.len < sizeof caps + 2) {
        child_kill_(e);
        return mtrl_error_set(err, MTRL_ERR_PLUGIN, "env '%s': the env host's start reply is malformed", e->spec);
    }
    memcpy(&caps, e->rx.data, sizeof caps);
    const char *nm = e->rx.data + sizeof caps;
    const char *ver = nm + strnlen(nm, e->rx.len - sizeof caps) + 1;
    snprintf(e->name, sizeof e->name, "%s", nm);
    snprintf(e->version, sizeof e->version, "%s", ver < e->rx.data + e->rx.len ? ver : "");
    e->has_demo = (caps & ENV_CAP_DEMO) != 0;
    e->has_describe = (caps & ENV_CAP_DESCRIBE) != 0;
    return MTRL_OK;
}

// CPU seconds the child used so far (utime + stime from /proc/<pid>/stat), or -1.
static double child_cpu_s_(pid_t pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *p = strrchr(buf, ')'); // the command name may contain spaces
    if (!p) return -1;
    unsigned long ut = 0, stt = 0;
    // After ")": state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
    if (sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &stt) != 2) return -1;
    long hz = sysconf(_SC_CLK_TCK);
    return hz > 0 ? (double)(ut + stt) / (double)hz : -1;
}

// ---- open / close ---------------------------------------------------------------------------

mtrl_status mtrl_env_open(mtrl_env **out, const char *name_or_path, const char *config, const mtrl_env_opts *opts,
                          mtrl_error *err) {
    *out = NULL;
    if (!name_or_path || !name_or_path[0])
        return mtrl_error_set(err, MTRL_ERR_USAGE, "no env named; use one of %s, or the path of a plug-in .so",
                              env_builtin_names());
    mtrl_env *e = xcalloc(1, sizeof *e);
    e->fd = -1;
    if (opts) e->o = *opts;
    else mtrl_env_opts_default(&e->o);
    if (e->o.call_timeout_ms <= 0) e->o.call_timeout_ms = 10000;
    if (e->o.start_timeout_ms <= 0) e->o.start_timeout_ms = 10000;
    if (e->o.max_obs_bytes == 0) e->o.max_obs_bytes = (size_t)64 << 20;
    e->spec = xstrdup(name_or_path);
    e->config = xstrdup(config ? config : "");
    snprintf(e->name, sizeof e->name, "%s", name_or_path);

    mtrl_status st;
    if (e->o.isolate) {
        st = child_start_(e, err);
    } else {
        st = env_loader_open(&e->lib, name_or_path, err);
        if (st == MTRL_OK) {
            e->cberr[0] = 0;
            if (e->lib.api.create(e->config, &e->self, e->cberr, sizeof e->cberr) != MTRL_ENV_OK) {
                e->self = NULL;
                st = mtrl_error_set(err, MTRL_ERR_USAGE, "env '%s' refused its config: %s", e->lib.api.name,
                                    e->cberr[0] ? e->cberr : "(no message)");
            } else {
                snprintf(e->name, sizeof e->name, "%s", e->lib.api.name);
                snprintf(e->version, sizeof e->version, "%s", e->lib.api.version);
                e->has_demo = e->lib.api.demo != NULL;
                e->has_describe = e->lib.api.describe != NULL;
            }
        }
    }
    if (st != MTRL_OK) {
        mtrl_env_close(e);
        return st;
    }
    *out = e;
    return MTRL_OK;
}

void mtrl_env_close(mtrl_env *e) {
    if (!e) return;
    if (e->o.isolate) {
        child_stop_(e);
    } else {
        if (e->self) e->lib.api.destroy(e->self);
        env_loader_close(&e->lib);
    }
    env_buf_free(&e->rx);
    free(e->demo);
    free(e->spec);
    free(e->config);
    free(e);
}

// ---- episodes -------------------------------------------------------------------------------

// Ends the episode after an error; returns st.
static mtrl_status abort_(mtrl_env *e, mtrl_status st) {
    if (e->in_episode) e->st.aborts++;
    e->in_episode = 0;
    return st;
}

static mtrl_status cb_fail_(mtrl_env *e, const char *what, mtrl_error *err) {
    return mtrl_error_set(err, MTRL_ERR_PLUGIN, "env '%s' failed during %s: %s", e->name, what,
                          e->cberr[0] ? e->cberr : "(no message)");
}

mtrl_status mtrl_env_reset(mtrl_env *e, uint64_t seed, mtrl_env_result *out, mtrl_error *err) {
    memset(out, 0, sizeof *out);
    if (e->in_episode) e->st.aborts++; // the caller abandons an unfinished episode
    e->in_episode = 0;
    double t0 = mtrl_time_mono();
    mtrl_status st;
    if (e->o.isolate) {
        if (e->pid > 0 && e->o.cpu_limit_s > 0) {
            double cpu = child_cpu_s_(e->pid);
            if (cpu > 0.5 * e->o.cpu_limit_s) {
                LOG_INFO("env '%s': env host used %.0f s of its %d s CPU limit; starting a fresh one", e->name, cpu,
                         e->o.cpu_limit_s);
                child_stop_(e);
            }
        }
        int ws;
        if (e->pid > 0 && waitpid(e->pid, &ws, WNOHANG) == e->pid) {
            // It died between episodes (killed from outside, or a plug-in thread crashed):
            // nothing was in flight, so say why and start afresh.
            LOG_WARN("env '%s': env host pid %d died between episodes (%s %d); starting a fresh one", e->name,
                     (int)e->pid, WIFSIGNALED(ws) ? "signal" : "exit status",
                     WIFSIGNALED(ws) ? WTERMSIG(ws) : WEXITSTATUS(ws));
            e->pid = 0;
            child_forget_(e);
        }
        if (e->pid <= 0) {
            st = child_start_(e, err);
            if (st != MTRL_OK) return st;
        }
        env_wire_rep rep;
        st = call_(e, ENV_OP_RESET, 0, seed, NULL, 0, e->o.call_timeout_ms, "reset", &rep, err);
        if (st != MTRL_OK) return st;
        out->obs = e->rx.data ? e->rx.data : "";
        out->obs_len = e->rx.len;
    } else {
        mtrl_env_bytes p = {0};
        e->cberr[0] = 0;
        if (e->lib.api.reset(e->self, seed, &p, e->cberr, sizeof e->cberr) != MTRL_ENV_OK)
            return cb_fail_(e, "reset", err);
        if (!p.data && p.len)
            return mtrl_error_set(err, MTRL_ERR_PLUGIN, "env '%s' broke the ABI: reset returned a NULL prompt of %zu "
                                  "bytes", e->name, p.len);
        if (p.len > e->o.max_obs_bytes)
            return mtrl_error_set(err, MTRL_ERR_LIMIT, "env '%s' returned a %zu-byte prompt, over max_obs_bytes = %zu",
                                  e->name, p.len, e->o.max_obs_bytes);
        out->obs = p.data ? p.data : "";
        out->obs_len = p.len;
    }
    out->latency_s = mtrl_time_mono() - t0;
    e->st.last_latency_s = out->latency_s;
    e->st.episodes++;
    e->in_episode = 1;
    e->tool_calls = 0;
    return MTRL_OK;
}

mtrl_status mtrl_env_step(mtrl_env *e, uint32_t kind, const char *action, size_t len, mtrl_env_result *out,
                          mtrl_error *err) {
    memset(out, 0, sizeof *out);
    if (!e->in_episode)
        return mtrl_error_set(err, MTRL_ERR_STATE,
                              "env '%s': step without an episode (the last one ended or was aborted); call "
                              "mtrl_env_reset first",
                              e->name);
    if (kind != MTRL_ENV_ACTION_TOOL && kind != MTRL_ENV_ACTION_ANSWER)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "env '%s': action kind %u is neither TOOL (1) nor ANSWER (2)",
                              e->name, kind);
    if (!action && len) return mtrl_error_set(err, MTRL_ERR_USAGE, "env '%s': NULL action with a length", e->name);
    double t0 = mtrl_time_mono();
    // The limit a built-in enforces itself (env_step_begin), applied by the host to an env that
    // need not know it: the call past it never reaches the env.
    if (kind == MTRL_ENV_ACTION_TOOL && e->o.max_tool_calls >= 0 && ++e->tool_calls > e->o.max_tool_calls) {
        snprintf(e->limit_obs, sizeof e->limit_obs, "error: tool call limit (%ld) reached; episode over", e->o.max_tool_calls);
        out->obs = e->limit_obs;
        out->obs_len = strlen(e->limit_obs);
        out->done = 1;
        out->tool_error = 1;
        e->st.steps++;
        e->in_episode = 0;
        return MTRL_OK;
    }
    if (e->o.isolate) {
        if ((uint64_t)len > ENV_WIRE_MAX_REQUEST)
            return abort_(e, mtrl_error_set(err, MTRL_ERR_LIMIT,
                                            "env '%s': action of %zu bytes is over the %llu-byte request cap", e->name,
                                            len, (unsigned long long)ENV_WIRE_MAX_REQUEST));
        env_wire_rep rep;
        mtrl_status st = call_(e, ENV_OP_STEP, kind, 0, action, len, e->o.call_timeout_ms, "step", &rep, err);
        if (st != MTRL_OK) return abort_(e, st);
        out->obs = e->rx.data ? e->rx.data : "";
        out->obs_len = e->rx.len;
        out->reward = rep.reward;
        out->done = rep.done != 0;
        out->tool_error = rep.tool_error != 0;
    } else {
        mtrl_env_step_out o;
        memset(&o, 0, sizeof o);
        e->cberr[0] = 0;
        if (e->lib.api.step(e->self, kind, action ? action : "", len, &o, e->cberr, sizeof e->cberr) != MTRL_ENV_OK)
            return abort_(e, cb_fail_(e, "step", err));
        if (!o.obs.data && o.obs.len)
            return abort_(e, mtrl_error_set(err, MTRL_ERR_PLUGIN,
                                            "env '%s' broke the ABI: step returned a NULL observation of %zu bytes",
                                            e->name, o.obs.len));
        if (o.obs.len > e->o.max_obs_bytes)
            return abort_(e, mtrl_error_set(err, MTRL_ERR_LIMIT,
                                            "env '%s' returned a %zu-byte observation, over max_obs_bytes = %zu",
                                            e->name, o.obs.len, e->o.max_obs_bytes));
        out->obs = o.obs.data ? o.obs.data : "";
        out->obs_len = o.obs.len;
        out->reward = o.reward;
        out->done = o.done != 0;
        out->tool_error = o.tool_error != 0;
    }
    if (!isfinite(out->reward))
        return abort_(e, mtrl_error_set(err, MTRL_ERR_PLUGIN, "env '%s' returned a non-finite reward", e->name));
    out->latency_s = mtrl_time_mono() - t0;
    e->st.last_latency_s = out->latency_s;
    e->st.steps++;
    if (out->done) e->in_episode = 0;
    return MTRL_OK;
}

mtrl_status mtrl_env_demo(mtrl_env *e, mtrl_env_demo_out *out, mtrl_error *err) {
    memset(out, 0, sizeof *out);
    if (!e->has_demo) return mtrl_error_set(err, MTRL_ERR_NOTFOUND, "env '%s' has no demo", e->name);
    if (!e->in_episode)
        return mtrl_error_set(err, MTRL_ERR_STATE, "env '%s': demo needs an episode; call mtrl_env_reset first",
                              e->name);
    if (!e->o.isolate) {
        mtrl_env_demo_out d = {0};
        e->cberr[0] = 0;
        if (e->lib.api.demo(e->self, &d, e->cberr, sizeof e->cberr) != MTRL_ENV_OK)
            return abort_(e, cb_fail_(e, "demo", err));
        if (d.count && !d.actions)
            return abort_(e, mtrl_error_set(err, MTRL_ERR_PLUGIN, "env '%s' broke the ABI: demo returned NULL actions",
                                            e->name));
        for (size_t i = 0; i < d.count; i++) {
            uint32_t k = d.actions[i].kind;
            if ((k != MTRL_ENV_ACTION_TOOL && k != MTRL_ENV_ACTION_ANSWER) || (!d.actions[i].data && d.actions[i].len))
                return abort_(e, mtrl_error_set(err, MTRL_ERR_PLUGIN,
                                                "env '%s' broke the ABI: demo action %zu is malformed", e->name, i));
        }
        *out = d;
        return MTRL_OK;
    }
    env_wire_rep rep;
    mtrl_status st = call_(e, ENV_OP_DEMO, 0, 0, NULL, 0, e->o.call_timeout_ms, "demo", &rep, err);
    if (st != MTRL_OK) return abort_(e, st);
    // Parse "u32 count, {u32 kind, u64 len, bytes}*" with every length checked against the rest.
    const char *p = e->rx.data, *end = e->rx.data + e->rx.len;
    uint32_t count;
    if (e->rx.len < sizeof count) goto malformed;
    memcpy(&count, p, sizeof count);
    p += sizeof count;
    if (count > e->rx.len / 12) goto malformed;
    if (count > e->demo_cap) {
        e->demo = xrealloc(e->demo, count * sizeof *e->demo);
        e->demo_cap = count;
    }
    for (uint32_t i = 0; i < count; i++) {
        uint32_t kind;
        uint64_t len;
        if ((size_t)(end - p) < sizeof kind + sizeof len) goto malformed;
        memcpy(&kind, p, sizeof kind);
        memcpy(&len, p + sizeof kind, sizeof len);
        p += sizeof kind + sizeof len;
        if (len > (uint64_t)(end - p) || (kind != MTRL_ENV_ACTION_TOOL && kind != MTRL_ENV_ACTION_ANSWER))
            goto malformed;
        e->demo[i] = (mtrl_env_action){kind, p, (size_t)len};
        p += len;
    }
    out->actions = e->demo;
    out->count = count;
    return MTRL_OK;
malformed:
    return abort_(e, mtrl_error_set(err, MTRL_ERR_PLUGIN, "env '%s': malformed demo from the env host", e->name));
}

mtrl_status mtrl_env_describe(mtrl_env *e, const char **text, size_t *len, mtrl_error *err) {
    *text = "";
    *len = 0;
    if (!e->has_describe) return mtrl_error_set(err, MTRL_ERR_NOTFOUND, "env '%s' has no describe", e->name);
    if (!e->o.isolate) {
        mtrl_env_bytes t = {0};
        e->cberr[0] = 0;
        if (e->lib.api.describe(e->self, &t, e->cberr, sizeof e->cberr) != MTRL_ENV_OK)
            return cb_fail_(e, "describe", err);
        *text = t.data ? t.data : "";
        *len = t.data ? t.len : 0;
        return MTRL_OK;
    }
    // describe does not need an episode, so it may start a fresh child.
    if (e->pid <= 0) {
        mtrl_status st = child_start_(e, err);
        if (st != MTRL_OK) return st;
    }
    env_wire_rep rep;
    int was = e->in_episode;
    mtrl_status st = call_(e, ENV_OP_DESCRIBE, 0, 0, NULL, 0, e->o.call_timeout_ms, "describe", &rep, err);
    if (st != MTRL_OK) {
        e->in_episode = was && e->pid > 0; // a crash here also ends the episode
        if (was && !e->in_episode) e->st.aborts++;
        return st;
    }
    *text = e->rx.data ? e->rx.data : "";
    *len = e->rx.len;
    return MTRL_OK;
}
