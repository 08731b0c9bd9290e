// env_config.c: the [env] section to an open env (see env_config.h).
#include "env/env_config.h"

#include <stdio.h>
#include <string.h>

#include "common/check.h"

int mtrl_env_config_isolated(const mtrl_config *cfg) {
    const char *v = cfg->env.isolate;
    return !strcmp(v, "true") || (!strcmp(v, "auto") && !strcmp(cfg->env.name, "plugin"));
}

// [env] opened in-process or isolated; the two entry points below differ only there.
static mtrl_status open_config_(const mtrl_config *cfg, int isolate, mtrl_env **out, mtrl_error *err) {
    const mtrl_cfg_env *e = &cfg->env;
    // Built-ins ignore the keys of the other built-ins, so the whole section passes through;
    // `args` carries what the schema does not know (plug-in keys).
    char conf[2048];
    snprintf(conf, sizeof conf,
             "digits=%ld;ops=%ld;doc_tokens=%ld;inline_doc=%d;demo_search=%d;key_digits=%ld;max_tool_calls=%ld;max_obs_bytes=%ld;"
             "task=%s;hops=%ld;hops_min=%ld;files=%ld;file_tokens=%ld;credit=%.17g;%s%s%s"
             "allow_loopback=%d;timeout_ms=%ld%s%s",
             e->digits, e->ops, e->doc_tokens, e->inline_doc, e->demo_search, e->key_digits, e->max_tool_calls, e->max_obs_bytes,
             e->task, e->hops, e->hops_min, e->files, e->file_tokens, e->credit,
             e->base_url[0] ? "base_url=" : "", e->base_url, e->base_url[0] ? ";" : "", e->allow_loopback, e->timeout_ms,
             e->args[0] ? ";" : "", e->args);
    mtrl_env_opts o;
    mtrl_env_opts_default(&o);
    o.isolate = isolate;
    o.call_timeout_ms = (int)e->step_timeout_ms;
    o.image_max_side = (uint32_t)cfg->model.image_max_side;
    const char *name = !strcmp(e->name, "plugin") ? e->plugin : e->name;
    // A plug-in is opened with only its own keys (`args`): it may refuse unknown ones. The
    // host holds it to max_tool_calls (built-ins get the key and hold themselves to it).
    if (!strcmp(e->name, "plugin")) {
        o.max_tool_calls = e->max_tool_calls;
        return mtrl_env_open(out, name, e->args, &o, err);
    }
    return mtrl_env_open(out, name, conf, &o, err);
}

mtrl_status mtrl_env_open_config(const mtrl_config *cfg, mtrl_env **out, mtrl_error *err) {
    return open_config_(cfg, mtrl_env_config_isolated(cfg), out, err);
}

mtrl_status mtrl_env_check_config(const mtrl_config *cfg, char **tools, mtrl_error *err) {
    if (tools) *tools = NULL;
    mtrl_env *env = NULL;
    mtrl_status st = open_config_(cfg, 1, &env, err);
    const char *text;
    size_t len;
    mtrl_error derr;
    if (st == MTRL_OK && tools && mtrl_env_describe(env, &text, &len, &derr) == MTRL_OK) {
        *tools = xmalloc(len + 1);
        memcpy(*tools, text, len);
        (*tools)[len] = '\0';
    }
    mtrl_env_close(env);
    return st;
}
