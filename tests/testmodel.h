// testmodel.h: model dimensions from a few lines of INI, for the model tests (header-only).
#ifndef MTRL_TESTMODEL_H
#define MTRL_TESTMODEL_H

#include <stdio.h>
#include <string.h>

#include "common/config.h"
#include "common/model/model.h"

// The dims of "[model]\n<model_ini>" (an [env] section is added, as the config requires); a bad
// config prints its errors and returns zeroed dims, which the caller's checks then catch.
static inline mtrl_model_dims test_model_dims(const char *model_ini, int vocab) {
    mtrl_config cfg;
    char text[2048];
    snprintf(text, sizeof text, "[env]\nname = calc\n[model]\n%s", model_ini);
    mtrl_config_errors errs = {0};
    mtrl_status st = mtrl_config_load_text(&cfg, "test", text, NULL, 0, &errs);
    if (st != MTRL_OK) mtrl_config_errors_print(&errs, stderr);
    mtrl_config_errors_free(&errs);
    mtrl_model_dims d;
    memset(&d, 0, sizeof d);
    mtrl_error err;
    if (st == MTRL_OK && mtrl_model_dims_from_config(&d, &cfg.model, vocab, &err) != MTRL_OK) {
        fprintf(stderr, "%s\n", err.msg);
        memset(&d, 0, sizeof d);
    }
    return d;
}

#endif
