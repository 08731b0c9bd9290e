// env_config.h: opens the env an experiment's [env] section names (built-in or plug-in,
// isolated or not), for the actor, the learner's warm-up and replay alike.
#ifndef MTRL_ENV_CONFIG_H
#define MTRL_ENV_CONFIG_H

#include "common/config.h"
#include "env/env_host.h"

mtrl_status mtrl_env_open_config(const mtrl_config *cfg, mtrl_env **out, mtrl_error *err);

// 1 when [env] runs isolated: isolate = true, or auto (the default) for a plug-in. A plug-in is
// code the project has not seen: in-process, its crash kills the actor and its hang stalls it
// until mtrl run's supervisor restarts it (issue 28, item 7); isolated, either costs one
// episode, for a round trip over a socketpair per call. Built-ins are in-process by default.
int mtrl_env_config_isolated(const mtrl_config *cfg);

// Loads and creates the env of [env] once, in a child process (the isolated host of env_host.h,
// whatever [env] isolate says), and closes it again: what `mtrl check` and `mtrl run` do before
// anything else, so an unknown name, a plug-in that does not load or speaks another ABI, or one
// that refuses its args is reported as the config error it is (the caller exits 2), not as an
// actor failure after the run started. A crash or hang in the plug-in's constructor or create
// stays in the child. MTRL_OK, or the error mtrl_env_open gave. tools (nullable): the env's
// describe() text (its tool list), malloc'ed, NULL when it has none; `mtrl check` prints it.
mtrl_status mtrl_env_check_config(const mtrl_config *cfg, char **tools, mtrl_error *err);

#endif
