// env_loader.c: built-in lookup, dlopen and the ABI checks (see env_loader.h).
#include "env/env_loader.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "env/builtin/builtin.h"

static const struct {
    const char *name;
    const mtrl_env_api *api;
} builtins_[] = {
    {"retrieval", &env_retrieval_api},
    {"calc", &env_calc_api},
    {"http", &env_http_api},
    {"picture", &env_picture_api},
    {"corpus", &env_corpus_api},
};

const char *env_builtin_names(void) { return "retrieval, calc, http, picture, corpus"; }

const mtrl_env_api *env_builtin_find(const char *name) {
    for (size_t i = 0; i < sizeof builtins_ / sizeof builtins_[0]; i++)
        if (!strcmp(builtins_[i].name, name)) return builtins_[i].api;
    return NULL;
}

int env_loader_is_path(const char *s) {
    size_t n = strlen(s);
    return strchr(s, '/') != NULL || (n > 3 && !strcmp(s + n - 3, ".so"));
}

mtrl_status env_loader_check(const mtrl_env_api *t, const char *where, mtrl_env_api *copy, mtrl_error *err) {
    uint32_t maj = MTRL_ENV_ABI_MAJOR_OF(t->abi_version), min = MTRL_ENV_ABI_MINOR_OF(t->abi_version);
    if (maj != MTRL_ENV_ABI_MAJOR)
        return mtrl_error_set(err, MTRL_ERR_PLUGIN,
                              "env plug-in %s was built for env ABI %u.%u but this host speaks %u.%u; "
                              "rebuild it against this mtrl's env/mtrl_env.h",
                              where, maj, min, MTRL_ENV_ABI_MAJOR, MTRL_ENV_ABI_MINOR);
    if (min > MTRL_ENV_ABI_MINOR)
        return mtrl_error_set(err, MTRL_ERR_PLUGIN,
                              "env plug-in %s needs env ABI %u.%u, newer than this host's %u.%u; "
                              "update mtrl, or rebuild the plug-in against this mtrl's env/mtrl_env.h",
                              where, maj, min, MTRL_ENV_ABI_MAJOR, MTRL_ENV_ABI_MINOR);
    if (t->struct_size < MTRL_ENV_API_MIN_SIZE)
        return mtrl_error_set(err, MTRL_ERR_PLUGIN,
                              "env plug-in %s: its table's struct_size %u is smaller than the %zu bytes env "
                              "ABI %u.%u requires (through create, destroy, reset, step); set struct_size = "
                              "sizeof(mtrl_env_api) and rebuild against env/mtrl_env.h",
                              where, t->struct_size, (size_t)MTRL_ENV_API_MIN_SIZE, MTRL_ENV_ABI_MAJOR,
                              MTRL_ENV_ABI_MINOR);
    // Copy only what the plug-in has; members it does not know stay NULL.
    memset(copy, 0, sizeof *copy);
    size_t n = t->struct_size < sizeof *copy ? t->struct_size : sizeof *copy;
    memcpy(copy, t, n);
    const char *missing = !copy->create ? "create" : !copy->destroy ? "destroy" : !copy->reset ? "reset"
                        : !copy->step ? "step" : NULL;
    if (missing)
        return mtrl_error_set(err, MTRL_ERR_PLUGIN,
                              "env plug-in %s: required callback '%s' is NULL; every env must set create, "
                              "destroy, reset and step",
                              where, missing);
    if (!copy->name || !copy->name[0]) copy->name = "unnamed";
    if (!copy->version) copy->version = "";
    return MTRL_OK;
}

mtrl_status env_loader_open(env_loaded *out, const char *name, mtrl_error *err) {
    memset(out, 0, sizeof *out);
    if (!env_loader_is_path(name)) {
        const mtrl_env_api *t = env_builtin_find(name);
        if (!t)
            return mtrl_error_set(err, MTRL_ERR_NOTFOUND,
                                  "unknown env '%s'; built-in envs are %s, or give the path of a plug-in .so "
                                  "([env] name = plugin, plugin = path/to/env.so)",
                                  name, env_builtin_names());
        size_t wn = strlen(name) + 16;
        out->where = xmalloc(wn);
        snprintf(out->where, wn, "built-in '%s'", name);
        mtrl_status st = env_loader_check(t, out->where, &out->api, err);
        if (st != MTRL_OK) env_loader_close(out);
        return st;
    }

    size_t wn = strlen(name) + 3;
    out->where = xmalloc(wn);
    snprintf(out->where, wn, "'%s'", name);
    dlerror();
    out->dl = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!out->dl) {
        const char *why = dlerror();
        mtrl_error_set(err, MTRL_ERR_PLUGIN,
                       "env plug-in '%s' could not be loaded: %s; check the path and that it is a shared "
                       "library built for this machine (cc -shared -fPIC -I<mtrl>/env -o env.so env.c)",
                       name, why ? why : "unknown dlopen error");
        env_loader_close(out);
        return MTRL_ERR_PLUGIN;
    }
    dlerror();
    void *sym = dlsym(out->dl, MTRL_ENV_PLUGIN_SYMBOL);
    const char *why = dlerror();
    if (!sym || why) {
        mtrl_error_set(err, MTRL_ERR_PLUGIN,
                       "env plug-in '%s' does not export '%s'; define MTRL_ENV_EXPORT const mtrl_env_api "
                       "*%s(uint32_t host_abi_version) with C linkage (see env/examples/README.md)",
                       name, MTRL_ENV_PLUGIN_SYMBOL, MTRL_ENV_PLUGIN_SYMBOL);
        env_loader_close(out);
        return MTRL_ERR_PLUGIN;
    }
    // ISO C forbids converting void* to a function pointer; dlsym's contract (POSIX) makes it
    // valid, and copying the bits through memcpy keeps -Wpedantic quiet.
    mtrl_env_plugin_fn entry;
    memcpy(&entry, &sym, sizeof entry);
    const mtrl_env_api *t = entry(MTRL_ENV_ABI_VERSION);
    if (!t) {
        mtrl_error_set(err, MTRL_ERR_PLUGIN,
                       "env plug-in '%s': %s(0x%x) returned NULL, so it refuses env ABI %u.%u; rebuild it "
                       "against this mtrl's env/mtrl_env.h",
                       name, MTRL_ENV_PLUGIN_SYMBOL, MTRL_ENV_ABI_VERSION, MTRL_ENV_ABI_MAJOR, MTRL_ENV_ABI_MINOR);
        env_loader_close(out);
        return MTRL_ERR_PLUGIN;
    }
    mtrl_status st = env_loader_check(t, out->where, &out->api, err);
    if (st != MTRL_OK) env_loader_close(out);
    return st;
}

void env_loader_close(env_loaded *l) {
    if (l->dl) dlclose(l->dl);
    free(l->where);
    memset(l, 0, sizeof *l);
}
