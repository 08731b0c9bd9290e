// cmd_keygen.c: `mtrl keygen STEM` writes a CURVE keypair for a learner or a remote actor:
// STEM.key (public + secret, mode 0600: stays on that machine) and STEM.pub (the public key:
// goes on the learner's allow-list, or to the actors as --curve-server-key). The public key is
// printed on stdout, so `KEY=$(mtrl keygen actor1)` works. Existing files are never replaced.
#include <string.h>

#include "common/wire/wire_auth.h"
#include "tools/cli.h"

#define KEYGEN_USAGE "mtrl keygen STEM   (writes STEM.key and STEM.pub)"

int cmd_keygen(int argc, char **argv) {
    const char *stem = NULL;
    for (int i = 1; i < argc; i++) {
        if (cli_is_help(argv[i])) {
            printf("usage: %s\n\nWrites a CURVE keypair for authenticated remote actors (README, \"Remote actors\"):\n"
                   "  STEM.key  public and secret key, mode 0600; keep it on the machine that uses it\n"
                   "  STEM.pub  the public key: a learner's goes to its actors (--curve-server-key), an actor's\n"
                   "            onto the learner's allow-list ([learner] curve_allow)\n"
                   "Prints the public key (Z85) on stdout. Refuses to overwrite an existing file.\n", KEYGEN_USAGE);
            return 0;
        }
        if (argv[i][0] == '-') return cli_usage_error("keygen", KEYGEN_USAGE, "unknown option '%s'", argv[i]);
        if (stem) return cli_usage_error("keygen", KEYGEN_USAGE, "more than one STEM given");
        stem = argv[i];
    }
    if (!stem) return cli_usage_error("keygen", KEYGEN_USAGE, "no STEM given");
    mtrl_wire_keypair kp;
    mtrl_error err;
    mtrl_status st = mtrl_wire_keypair_new(&kp, &err);
    if (st == MTRL_OK) st = mtrl_wire_keypair_save(&kp, stem, &err);
    char pub[MTRL_WIRE_KEY_Z85_LEN + 1];
    mtrl_wire_key_z85(kp.public_key, pub);
    mtrl_wire_key_wipe(&kp, sizeof kp);
    if (st != MTRL_OK) {
        fprintf(stderr, "mtrl keygen: %s\n", err.msg);
        return st == MTRL_ERR_USAGE ? 2 : 1;
    }
    printf("%s\n", pub);
    fprintf(stderr, "mtrl keygen: wrote %s.key (secret, mode 0600) and %s.pub\n", stem, stem);
    return 0;
}
