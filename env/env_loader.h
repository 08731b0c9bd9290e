// env_loader.h: finds an env's callback table: a built-in by name, or a plug-in .so by path
// (internal to env/; the actor uses env_host.h).
//
// A name containing '/' or ending in ".so" is a path; anything else must be a built-in
// (retrieval, calc, http, picture). A plug-in is loaded with dlopen(RTLD_NOW | RTLD_LOCAL) and checked
// (mtrl_env.h, "the entry point"); every refusal returns MTRL_ERR_PLUGIN with a message that
// names the file and says what to do. The table is copied into env_loaded.api, zero-extended
// past the plug-in's struct_size, so optional callbacks a plug-in's older minor lacks read as
// NULL.
#ifndef MTRL_ENV_LOADER_H
#define MTRL_ENV_LOADER_H

#include "common/status.h"
#include "env/mtrl_env.h"

typedef struct env_loaded {
    mtrl_env_api api; // copy of the table, zero-extended
    void *dl;         // dlopen handle; NULL for built-ins
    char *where;      // "built-in 'calc'" or the plug-in path (owned)
} env_loaded;

// "retrieval, calc, http, picture"
const char *env_builtin_names(void);
// The table of a built-in, or NULL.
const mtrl_env_api *env_builtin_find(const char *name);

// 1 when name_or_path names a file rather than a built-in.
int env_loader_is_path(const char *name_or_path);

mtrl_status env_loader_open(env_loaded *out, const char *name_or_path, mtrl_error *err);
// Checks a table as the loader does (used for plug-ins and built-ins alike); copies it into
// *copy on success. where names the source in messages.
mtrl_status env_loader_check(const mtrl_env_api *t, const char *where, mtrl_env_api *copy, mtrl_error *err);
// dlclose()s a plug-in. Call only after every instance it created was destroyed.
void env_loader_close(env_loaded *l);

#endif
