// env_config.h: opens the env an experiment's [env] section names (built-in or plug-in,
// isolated or not), for the actor, the learner's warm-up and replay alike.
#ifndef MTRL_ENV_CONFIG_H
#define MTRL_ENV_CONFIG_H

#include "common/config.h"
#include "env/env_host.h"

mtrl_status mtrl_env_open_config(const mtrl_config *cfg, mtrl_env **out, mtrl_error *err);

#endif
