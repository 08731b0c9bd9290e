// dist_launch.c: the launch from a launcher's variables (dist_launch.h): torchrun's, srun's,
// or none; the local rank's GPU; Slurm's compact nodelist and tasks-per-node forms.
//
// Each variable is read once, checked for being a plain decimal in its range, and then checked
// against the others; the first problem found is the error, naming the variable and its value.
#include "learner/dist_launch.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "learner/dist_plan.h"

static const char *env_get_(const char *const *env, const char *name) {
    size_t n = strlen(name);
    for (; env && *env; env++)
        if (!strncmp(*env, name, n) && (*env)[n] == '=') return *env + n + 1;
    return NULL;
}

// The first of the names that is set; *which gets its name.
static const char *env_first_(const char *const *env, const char *const *names, const char **which) {
    for (; *names; names++) {
        const char *v = env_get_(env, *names);
        if (v) {
            *which = *names;
            return v;
        }
    }
    return NULL;
}

// val as a decimal in [lo, hi]: digits only (no sign, no spaces), so "1 " or "0x2" is refused.
static mtrl_status num_(const char *src, const char *var, const char *val, long lo, long hi, int *out, mtrl_error *err) {
    char *end;
    errno = 0;
    long v = strtol(val, &end, 10);
    if (val[0] < '0' || val[0] > '9' || *end || errno)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (%s): %s = '%s' is not a number", src, var, val);
    if (v < lo || v > hi)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (%s): %s = %ld is out of range (%ld .. %ld)", src, var, v, lo,
                              hi);
    *out = (int)v;
    return MTRL_OK;
}

// A host name or an IPv4 address: what ZeroMQ's tcp:// endpoints take and rank 0 can resolve.
static mtrl_status host_set_(mtrl_dist_launch *l, const char *var, const char *val, mtrl_error *err) {
    size_t n = strlen(val);
    if (n == 0 || n >= sizeof l->host)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (%s): %s = '%s': expected a host name or IPv4 address of 1 to "
                              "%zu characters", l->source, var, val, sizeof l->host - 1);
    if (strchr(val, ':'))
        return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (%s): %s = '%s': IPv6 addresses are not supported; give a "
                              "host name or an IPv4 address", l->source, var, val);
    for (size_t i = 0; i < n; i++) {
        char c = val[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '-' ||
              c == '_'))
            return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (%s): %s = '%s': '%c' cannot be in a host name", l->source,
                                  var, val, c);
    }
    memcpy(l->host, val, n + 1);
    return MTRL_OK;
}

// MASTER_PORT + 1 (dist_launch.h: torchrun's agent store holds MASTER_PORT itself).
static mtrl_status port_above_(mtrl_dist_launch *l, const char *val, mtrl_error *err) {
    int p;
    mtrl_status s = num_(l->source, "MASTER_PORT", val, 1, 65535, &p, err);
    if (s != MTRL_OK) return s;
    if (p == 65535)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (%s): MASTER_PORT = 65535: the id goes to MASTER_PORT + 1, past "
                              "the last port", l->source);
    l->port = p + 1;
    return MTRL_OK;
}

// ---- torchrun -----------------------------------------------------------------------------------

static mtrl_status from_torchrun_(mtrl_dist_launch *l, const char *const *env, const char *rank_s,
                                  const char *world_s, mtrl_error *err) {
    l->source = "torchrun";
    l->rank_var = "RANK";
    l->local_rank_var = "LOCAL_RANK";
    l->local_world_var = "LOCAL_WORLD_SIZE";
    if (!rank_s || !world_s)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (torchrun): %s = %s is set but %s is not (a launcher sets both)",
                              rank_s ? "RANK" : "WORLD_SIZE", rank_s ? rank_s : world_s, rank_s ? "WORLD_SIZE" : "RANK");
    mtrl_status s = num_(l->source, "WORLD_SIZE", world_s, 1, MTRL_DIST_RANKS_MAX, &l->world, err);
    if (s == MTRL_OK) s = num_(l->source, "RANK", rank_s, 0, INT_MAX, &l->rank, err);
    if (s != MTRL_OK) return s;
    if (l->rank >= l->world)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (torchrun): RANK = %d is not below WORLD_SIZE = %d", l->rank,
                              l->world);
    const char *lw = env_get_(env, "LOCAL_WORLD_SIZE"), *lr = env_get_(env, "LOCAL_RANK"), *g = env_get_(env, "GROUP_RANK");
    l->local_world = l->world;
    if (lw && (s = num_(l->source, "LOCAL_WORLD_SIZE", lw, 1, l->world, &l->local_world, err)) != MTRL_OK) return s;
    if (l->world % l->local_world)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (torchrun): WORLD_SIZE = %d is not a multiple of "
                              "LOCAL_WORLD_SIZE = %d (torchrun starts as many ranks on every node)", l->world,
                              l->local_world);
    l->local_rank = l->rank % l->local_world;
    if (lr && (s = num_(l->source, "LOCAL_RANK", lr, 0, INT_MAX, &l->local_rank, err)) != MTRL_OK) return s;
    if (l->local_rank >= l->local_world)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (torchrun): LOCAL_RANK = %d is not below LOCAL_WORLD_SIZE = %d",
                              l->local_rank, l->local_world);
    l->node = l->rank / l->local_world;
    if (g && (s = num_(l->source, "GROUP_RANK", g, 0, l->world / l->local_world - 1, &l->node, err)) != MTRL_OK) return s;
    if (l->world == 1) return MTRL_OK;
    const char *addr = env_get_(env, "MASTER_ADDR"), *port = env_get_(env, "MASTER_PORT");
    if (!addr || !port)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (torchrun): WORLD_SIZE = %d but %s is not set (rank 0's host "
                              "and port: the ranks meet there)", l->world, addr ? "MASTER_PORT" : "MASTER_ADDR");
    if ((s = host_set_(l, "MASTER_ADDR", addr, err)) != MTRL_OK) return s;
    return port_above_(l, port, err);
}

// ---- slurm --------------------------------------------------------------------------------------

// The tasks of each node in Slurm's compact form, "2(x3),1" = 2, 2, 2, 1, into counts[]; the
// number of nodes, or an error naming var.
static mtrl_status tasks_per_node_(const char *var, const char *val, int *counts, int cap, int *nodes, mtrl_error *err) {
    int n = 0;
    const char *p = val;
    for (;;) {
        char *end;
        errno = 0;
        long c = strtol(p, &end, 10), rep = 1;
        if (p[0] < '0' || p[0] > '9' || errno || c < 1 || c > MTRL_DIST_RANKS_MAX) goto bad;
        p = end;
        if (!strncmp(p, "(x", 2)) {
            rep = strtol(p + 2, &end, 10);
            if (p[2] < '0' || p[2] > '9' || *end != ')' || rep < 1 || rep > cap) goto bad;
            p = end + 1;
        }
        for (long i = 0; i < rep; i++) {
            if (n == cap)
                return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (slurm): %s = '%s': more than %d nodes", var, val, cap);
            counts[n++] = (int)c;
        }
        if (!*p) break;
        if (*p++ != ',') goto bad;
    }
    *nodes = n;
    return MTRL_OK;
bad:
    return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (slurm): %s = '%s': expected tasks per node as Slurm writes them, "
                          "e.g. 4 or 2(x3),1", var, val);
}

mtrl_status mtrl_dist_nodelist_first(const char *var, const char *list, char *host, size_t cap, mtrl_error *err) {
    size_t at = 0;
    int depth = 0, first_value = 0; // in a bracket; copying its first value still
    const char *why = NULL;
    if (!*list) why = "it is empty";
    for (const char *p = list; *p && !why; p++) {
        char c = *p;
        if (depth == 0 && c == ',') break; // the first host ends at the first top-level comma
        if (c == '[') {
            if (depth) why = "a '[' inside brackets";
            depth = 1, first_value = 1;
            if (p[1] < '0' || p[1] > '9') why = "a bracket that does not start with digits";
            continue;
        }
        if (c == ']') {
            if (!depth) why = "a ']' without its '['";
            depth = 0;
            continue;
        }
        if (depth) {
            if (c == ',' || c == '-') {
                if (p[1] < '0' || p[1] > '9') why = "a range without its end";
                first_value = 0;
                continue;
            }
            if (c < '0' || c > '9') {
                why = "a bracket holding more than digits, ',' and '-'";
                continue;
            }
            if (!first_value) continue;
        }
        if (at + 1 >= cap) why = "a host name too long";
        else host[at++] = c;
    }
    if (!why && depth) why = "a '[' not closed";
    if (!why && at == 0) why = "no host before the first ','";
    host[why ? 0 : at] = 0;
    if (why) return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (slurm): %s = '%s': not a nodelist (%s)", var, list, why);
    return MTRL_OK;
}

static mtrl_status from_slurm_(mtrl_dist_launch *l, const char *const *env, const char *procid, mtrl_error *err) {
    l->source = "slurm";
    l->rank_var = "SLURM_PROCID";
    l->local_rank_var = "SLURM_LOCALID";
    const char *ntasks_var = NULL;
    const char *ntasks = env_first_(env, (const char *const[]){"SLURM_NTASKS", "SLURM_NPROCS", NULL}, &ntasks_var);
    if (!ntasks)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (slurm): SLURM_PROCID = %s is set but SLURM_NTASKS is not "
                              "(run the ranks with srun)", procid);
    mtrl_status s = num_(l->source, ntasks_var, ntasks, 1, MTRL_DIST_RANKS_MAX, &l->world, err);
    if (s == MTRL_OK) s = num_(l->source, "SLURM_PROCID", procid, 0, INT_MAX, &l->rank, err);
    if (s != MTRL_OK) return s;
    if (l->rank >= l->world)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (slurm): SLURM_PROCID = %d is not below %s = %d", l->rank,
                              ntasks_var, l->world);
    l->local_world = 1;
    l->local_world_var = "SLURM_NTASKS";
    if (l->world == 1) return MTRL_OK; // one task: nothing to meet
    const char *localid = env_get_(env, "SLURM_LOCALID");
    if (!localid)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (slurm): %s = %d but SLURM_LOCALID is not set (run the ranks "
                              "with srun)", ntasks_var, l->world);
    if ((s = num_(l->source, "SLURM_LOCALID", localid, 0, l->world - 1, &l->local_rank, err)) != MTRL_OK) return s;

    // The tasks of this node: one number for all (SLURM_NTASKS_PER_NODE) or one per node.
    int counts[MTRL_DIST_RANKS_MAX], nodes = 0;
    const char *tpn = env_first_(env, (const char *const[]){"SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE",
                                                           "SLURM_TASKS_PER_NODE", NULL}, &l->local_world_var);
    if (!tpn)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (slurm): %s = %d but none of SLURM_STEP_TASKS_PER_NODE, "
                              "SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE is set", ntasks_var, l->world);
    int same = !strcmp(l->local_world_var, "SLURM_NTASKS_PER_NODE");
    if (same) s = num_(l->source, l->local_world_var, tpn, 1, l->world, &counts[0], err), nodes = 1;
    else s = tasks_per_node_(l->local_world_var, tpn, counts, MTRL_DIST_RANKS_MAX, &nodes, err);
    if (s != MTRL_OK) return s;
    const char *nodeid = env_get_(env, "SLURM_NODEID");
    if (nodeid) {
        if ((s = num_(l->source, "SLURM_NODEID", nodeid, 0, l->world - 1, &l->node, err)) != MTRL_OK) return s;
    } else { // block placement: the node whose tasks hold this rank
        int first = 0;
        l->node = 0;
        while (first + counts[same ? 0 : l->node] <= l->rank && (same || l->node + 1 < nodes))
            first += counts[same ? 0 : l->node], l->node++;
    }
    if (!same && l->node >= nodes)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (slurm): SLURM_NODEID = %d but %s = '%s' lists %d node(s)",
                              l->node, l->local_world_var, tpn, nodes);
    l->local_world = counts[same ? 0 : l->node];
    if (l->local_rank >= l->local_world)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (slurm): SLURM_LOCALID = %d is not below this node's %d tasks "
                              "(%s = '%s')", l->local_rank, l->local_world, l->local_world_var, tpn);

    // Rank 0's host: the job script's MASTER_ADDR, else the step's first node.
    const char *addr = env_get_(env, "MASTER_ADDR");
    if (addr) s = host_set_(l, "MASTER_ADDR", addr, err);
    else {
        const char *list_var = NULL;
        const char *list = env_first_(env, (const char *const[]){"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                                                                "SLURM_NODELIST", NULL}, &list_var);
        if (!list)
            return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (slurm): %s = %d but neither MASTER_ADDR nor "
                                  "SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST is set (rank 0's host)",
                                  ntasks_var, l->world);
        char first[MTRL_DIST_HOST_MAX];
        s = mtrl_dist_nodelist_first(list_var, list, first, sizeof first, err);
        if (s == MTRL_OK) s = host_set_(l, list_var, first, err);
    }
    if (s != MTRL_OK) return s;
    const char *port = env_get_(env, "MASTER_PORT");
    if (port) return port_above_(l, port, err);
    const char *job_var = NULL;
    const char *job = env_first_(env, (const char *const[]){"SLURM_JOB_ID", "SLURM_JOBID", NULL}, &job_var);
    if (!job)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (slurm): %s = %d but neither MASTER_PORT nor SLURM_JOB_ID is set "
                              "(the rendezvous port)", ntasks_var, l->world);
    int id;
    if ((s = num_(l->source, job_var, job, 0, INT_MAX, &id, err)) != MTRL_OK) return s;
    l->port = 15000 + id % 10000;
    return MTRL_OK;
}

// ---- the public calls ---------------------------------------------------------------------------

mtrl_status mtrl_dist_launch_from_env(mtrl_dist_launch *l, const char *const *env, mtrl_error *err) {
    memset(l, 0, sizeof *l);
    l->source = "none";
    l->world = l->local_world = 1;
    l->rank_var = "RANK";
    l->local_rank_var = "LOCAL_RANK";
    l->local_world_var = "LOCAL_WORLD_SIZE";
    const char *rank = env_get_(env, "RANK"), *world = env_get_(env, "WORLD_SIZE");
    mtrl_status s = MTRL_OK;
    if (rank || world) s = from_torchrun_(l, env, rank, world, err);
    else if ((rank = env_get_(env, "SLURM_PROCID"))) s = from_slurm_(l, env, rank, err);
    if (s != MTRL_OK) return s;
    if (l->world == 1) l->host[0] = 0, l->port = 0;
    return MTRL_OK;
}

mtrl_status mtrl_dist_launch_gpu(const mtrl_dist_launch *l, const int *gpus, int n_gpus, int *gpu, mtrl_error *err) {
    *gpu = -1;
    if (n_gpus <= 0) {
        *gpu = l->local_rank;
        return MTRL_OK;
    }
    char list[256];
    size_t at = 0;
    list[0] = 0;
    for (int i = 0; i < n_gpus && at + 12 < sizeof list; i++) at += (size_t)snprintf(list + at, sizeof list - at, "%s%d", i ? "," : "", gpus[i]);
    if (l->local_rank >= n_gpus)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (%s): %s = %d, but [learner] gpus = %s lists %d GPU(s): local "
                              "rank i runs on the i-th", l->source, l->local_rank_var, l->local_rank, list, n_gpus);
    if (l->local_world > n_gpus)
        return mtrl_error_set(err, MTRL_ERR_USAGE, "launch (%s): %d ranks on this node (%s), but [learner] gpus = %s lists "
                              "%d GPU(s): one rank per GPU", l->source, l->local_world, l->local_world_var, list, n_gpus);
    *gpu = gpus[l->local_rank];
    return MTRL_OK;
}

void mtrl_dist_launch_describe(const mtrl_dist_launch *l, char *buf, size_t cap) {
    if (l->world == 1) {
        snprintf(buf, cap, "%s: one rank (rank 0 of 1)", l->source);
        return;
    }
    snprintf(buf, cap, "%s: rank %d of %d (local %d of %d, node %d), rendezvous %s:%d", l->source, l->rank, l->world,
             l->local_rank, l->local_world, l->node, l->host, l->port);
}

mtrl_dist_rendezvous mtrl_dist_rendezvous_of(const mtrl_dist_launch *l) {
    mtrl_dist_rendezvous rv;
    memset(&rv, 0, sizeof rv);
    snprintf(rv.host, sizeof rv.host, "%s", l->host);
    rv.port = l->port;
    return rv;
}
