// mtrl-test: cpu fault
// CURVE authentication of actors (common/wire/wire_auth.h) with real sockets on tcp://127.0.0.1:*:
// key files round-trip with mode 0600 and are never overwritten; an allow-listed actor talks
// both ways; an actor whose key is not listed, an actor without CURVE and an actor with the
// wrong server key get nothing through (and the learner counts each failed handshake); the ZAP
// handler refuses NULL and PLAIN outright; bad key files and allow-lists are reported with
// file:line; a CURVE ROUTER without a ZAP handler is refused. Also `mtrl keygen`, the actor's
// CURVE flags and the ephemeral key of `mtrl run`'s local actors.
//
// "Nothing got through" is a bounded poll of the ROUTER (1500 ms) after a bounded wait for the
// refusal itself, which must happen: no assertion rests on a sleep.
#include <dirent.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "common/timeutil.h"
#include "common/wire/wire.h"
#include "common/wire/wire_auth.h"
#include "tests/testhelp.h"
#include "tests/testproc.h"

static char dir_[256];

static const char *path_(const char *name) {
    static char buf[4][512];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", dir_, name);
    return buf[k];
}

static void write_file_(const char *name, const char *text, mode_t mode) {
    const char *p = path_(name);
    FILE *f = fopen(p, "w");
    TEST_CHECK(f != NULL);
    if (!f) return;
    fputs(text, f);
    fclose(f);
    chmod(p, mode);
}

static mode_t mode_of_(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 ? (sb.st_mode & 07777) : (mode_t)-1;
}

// The learner side: a context, the ZAP handler, a CURVE ROUTER watched by the handler.
typedef struct learner_ {
    void *ctx;
    mtrl_wire_auth_server *auth;
    mtrl_wire_sock sock;
} learner_;

static int learner_open_(learner_ *l, const char *key, const char *allow) {
    memset(l, 0, sizeof *l);
    l->ctx = zmq_ctx_new();
    mtrl_wire_sockopts so = mtrl_wire_sockopts_default();
    mtrl_error err;
    mtrl_status st = mtrl_wire_auth_server_init(&l->auth, l->ctx, key, allow, &so, &err);
    TEST_CHECKF(st == MTRL_OK, "server init: %s", err.msg);
    if (st) return 0;
    TEST_EQ_INT(so.curve_server, 1);
    st = mtrl_wire_router_open(&l->sock, l->ctx, "tcp://127.0.0.1:*", NULL, &so, &err);
    TEST_CHECKF(st == MTRL_OK, "router open: %s", err.msg);
    if (st) return 0;
    st = mtrl_wire_auth_server_monitor(l->auth, &l->sock, &err);
    TEST_CHECKF(st == MTRL_OK, "monitor: %s", err.msg);
    TEST_CHECK(!strncmp(l->sock.endpoint, "tcp://127.0.0.1:", 16));
    return st == MTRL_OK;
}

static void learner_close_(learner_ *l) {
    mtrl_wire_sock_close(&l->sock);
    mtrl_wire_auth_server_free(l->auth);
    TEST_EQ_INT(zmq_ctx_term(l->ctx), 0);
}

static mtrl_wire_auth_stats auth_stats_(mtrl_wire_auth_server *a) {
    mtrl_wire_auth_stats s;
    mtrl_wire_auth_server_stats(a, &s);
    return s;
}

static mtrl_wire_auth_stats stats_(learner_ *l) { return auth_stats_(l->auth); }

// An actor DEALER with opts (CURVE or not) that sends one HELLO.
static void actor_hello_(learner_ *l, mtrl_wire_sock *d, const mtrl_wire_sockopts *so) {
    mtrl_error err;
    mtrl_status st = mtrl_wire_dealer_open(d, l->ctx, l->sock.endpoint, 7, 1, NULL, so, &err);
    TEST_CHECKF(st == MTRL_OK, "dealer open: %s", err.msg);
    mtrl_wire_out o;
    mtrl_wire_out_init(&o);
    mtrl_wire_encode_hello(&o, 7, 1, MTRL_WIRE_CAP_CURVE);
    // The DEALER queues it until a handshake succeeds, which for a refused actor is never.
    TEST_EQ_INT(mtrl_wire_send(d, NULL, &o, &err), MTRL_OK);
    mtrl_wire_out_free(&o);
}

// Nothing reaches the ROUTER within 1500 ms.
static void expect_nothing_(learner_ *l, const char *who) {
    mtrl_wire_in in;
    mtrl_error err;
    mtrl_status st = mtrl_wire_recv(&l->sock, 1500, &in, NULL, &err);
    TEST_CHECKF(st == MTRL_ERR_TIMEOUT, "%s: a message got through (status %d)", who, (int)st);
}

static mtrl_wire_sockopts client_opts_(const char *server_pub, const char *key) {
    mtrl_wire_sockopts so = mtrl_wire_sockopts_default();
    mtrl_error err;
    mtrl_status st = mtrl_wire_auth_client_opts(&so, server_pub, key, &err);
    TEST_CHECKF(st == MTRL_OK, "client opts: %s", err.msg);
    return so;
}

static char *pub_z85_(const char *pub_file, char out[41]) {
    uint8_t k[32];
    mtrl_error err;
    out[0] = '\0';
    if (mtrl_wire_key_load_public(k, pub_file, &err) == MTRL_OK) mtrl_wire_key_z85(k, out);
    return out;
}

// ---- (a) key files ------------------------------------------------------------------------------

static void test_keygen_(void) {
    mtrl_error err;
    TEST_EQ_INT(mtrl_wire_keypair_write(path_("learner"), &err), MTRL_OK);
    TEST_EQ_INT(mtrl_wire_keypair_write(path_("actor1"), &err), MTRL_OK);
    TEST_EQ_INT(mtrl_wire_keypair_write(path_("stranger"), &err), MTRL_OK);
    TEST_EQ_INT(mtrl_wire_keypair_write(path_("impostor"), &err), MTRL_OK);
    TEST_EQ_INT(mode_of_(path_("learner.key")), 0600);
    TEST_EQ_INT(mode_of_(path_("learner.pub")), 0644);
    mtrl_wire_keypair kp;
    uint8_t pub[32];
    TEST_EQ_INT(mtrl_wire_keypair_load(&kp, path_("learner.key"), &err), MTRL_OK);
    TEST_EQ_INT(mtrl_wire_key_load_public(pub, path_("learner.pub"), &err), MTRL_OK);
    TEST_CHECK(memcmp(pub, kp.public_key, 32) == 0);
    // a .key also gives its public key
    TEST_EQ_INT(mtrl_wire_key_load_public(pub, path_("learner.key"), &err), MTRL_OK);
    TEST_CHECK(memcmp(pub, kp.public_key, 32) == 0);
    // two keypairs differ
    mtrl_wire_keypair kp2;
    TEST_EQ_INT(mtrl_wire_keypair_load(&kp2, path_("actor1.key"), &err), MTRL_OK);
    TEST_CHECK(memcmp(kp2.public_key, kp.public_key, 32) != 0);

    // never overwritten: contents unchanged, message names the file
    char *before = test_slurp(path_("learner.key"), NULL);
    TEST_EQ_INT(mtrl_wire_keypair_write(path_("learner"), &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "learner.key exists; refusing to overwrite it");
    char *after = test_slurp(path_("learner.key"), NULL);
    TEST_EQ_STR(after, before);
    free(before);
    free(after);
    // an existing .pub alone also stops it, and no half pair is left behind
    write_file_("lonely.pub", "# placeholder\n", 0644);
    TEST_EQ_INT(mtrl_wire_keypair_write(path_("lonely"), &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "lonely.pub exists");
    TEST_CHECK(access(path_("lonely.key"), F_OK) != 0);
    // no temporary files left
    DIR *d = opendir(dir_);
    struct dirent *e;
    int tmps = 0;
    while (d && (e = readdir(d)))
        if (strstr(e->d_name, ".tmp")) tmps++;
    if (d) closedir(d);
    TEST_EQ_INT(tmps, 0);

    // the allow-list: actor1 only (as `public = KEY`, with a comment and a bare duplicate)
    char a1[41], text[256];
    pub_z85_(path_("actor1.pub"), a1);
    snprintf(text, sizeof text, "# actors allowed in\n\npublic = %s\n%s\n", a1, a1);
    write_file_("allow.txt", text, 0644);
    mtrl_wire_allow al;
    mtrl_wire_allow_init(&al);
    TEST_EQ_INT(mtrl_wire_allow_load(&al, path_("allow.txt"), &err), MTRL_OK);
    TEST_EQ_INT(al.n, 1);
    TEST_CHECK(mtrl_wire_allow_has(&al, kp2.public_key));
    TEST_CHECK(!mtrl_wire_allow_has(&al, kp.public_key));
    mtrl_wire_allow_free(&al);
    // the same as a folder of .pub files
    mkdir(path_("allow.d"), 0755);
    char *a1_file = test_slurp(path_("actor1.pub"), NULL);
    write_file_("allow.d/actor1.pub", a1_file, 0644);
    free(a1_file);
    write_file_("allow.d/README", "not a key\n", 0644);
    mtrl_wire_allow_init(&al);
    TEST_EQ_INT(mtrl_wire_allow_load(&al, path_("allow.d"), &err), MTRL_OK);
    TEST_EQ_INT(al.n, 1);
    TEST_CHECK(mtrl_wire_allow_has(&al, kp2.public_key));
    mtrl_wire_allow_free(&al);
    mtrl_wire_key_wipe(&kp, sizeof kp);
    mtrl_wire_key_wipe(&kp2, sizeof kp2);
}

// ---- (f) bad key files and allow-lists ------------------------------------------------------------

static void expect_key_error_(const char *name, mtrl_status want, const char *needle) {
    mtrl_wire_keypair kp;
    mtrl_error err = {0};
    mtrl_status st = mtrl_wire_keypair_load(&kp, path_(name), &err);
    TEST_CHECKF(st == want, "%s: status %d, want %d (%s)", name, (int)st, (int)want, err.msg);
    TEST_CONTAINS(err.msg, needle);
}

static void expect_allow_error_(const char *name, const char *needle) {
    mtrl_wire_allow al;
    mtrl_wire_allow_init(&al);
    mtrl_error err = {0};
    TEST_CHECKF(mtrl_wire_allow_load(&al, path_(name), &err) != MTRL_OK, "%s loaded", name);
    TEST_CONTAINS(err.msg, needle);
    mtrl_wire_allow_free(&al);
}

static void test_bad_files_(void) {
    char pub[41], sec[41], text[512];
    TEST_EQ_INT(zmq_curve_keypair(pub, sec), 0);
    char other_pub[41], other_sec[41];
    TEST_EQ_INT(zmq_curve_keypair(other_pub, other_sec), 0);

    snprintf(text, sizeof text, "public = abc\nsecret = %s\n", sec);
    write_file_("short.key", text, 0600);
    expect_key_error_("short.key", MTRL_ERR_FORMAT, "short.key:1: public key is 3 characters; expected 40 (Z85)");

    snprintf(text, sizeof text, "# a comment\npublic = %s\nsecret = ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~\n", pub);
    write_file_("badz85.key", text, 0600);
    expect_key_error_("badz85.key", MTRL_ERR_FORMAT, "badz85.key:3: secret key is not valid Z85");

    expect_key_error_("missing.key", MTRL_ERR_NOTFOUND, "missing.key: cannot open the key file");

    snprintf(text, sizeof text, "public = %s\nsecret = %s\n", pub, sec);
    write_file_("open.key", text, 0644);
    expect_key_error_("open.key", MTRL_ERR_USAGE, "open.key: secret key file is readable by group or others (mode 0644)");

    snprintf(text, sizeof text, "public = %s\nsecret = %s\n", other_pub, sec);
    write_file_("mixed.key", text, 0600);
    expect_key_error_("mixed.key", MTRL_ERR_FORMAT, "mixed.key: the public key does not belong to the secret key");

    snprintf(text, sizeof text, "public = %s\n", pub);
    write_file_("only.pub", text, 0600);
    expect_key_error_("only.pub", MTRL_ERR_FORMAT, "only.pub: no 'secret = KEY' line");

    snprintf(text, sizeof text, "public = %s\nkey = %s\n", pub, sec);
    write_file_("field.key", text, 0600);
    expect_key_error_("field.key", MTRL_ERR_FORMAT, "field.key:2: unknown field 'key'");

    snprintf(text, sizeof text, "public = %s\npublic = %s\nsecret = %s\n", pub, pub, sec);
    write_file_("twice.key", text, 0600);
    expect_key_error_("twice.key", MTRL_ERR_FORMAT, "twice.key:2: second 'public' line (first on line 1)");

    // allow-lists: a bad line names file:line, a bad .pub in a folder names that file
    snprintf(text, sizeof text, "# ok\n%s\n%.39s\n", pub, other_pub);
    write_file_("allow-short.txt", text, 0644);
    expect_allow_error_("allow-short.txt", "allow-short.txt:3: public key is 39 characters; expected 40 (Z85)");
    write_file_("allow-words.txt", "# ok\nactor one\n", 0644);
    expect_allow_error_("allow-words.txt", "allow-words.txt:2: expected a public key or 'public = KEY'");
    snprintf(text, sizeof text, "%s\nsecret = %s\n", pub, sec);
    write_file_("allow-secret.txt", text, 0600);
    expect_allow_error_("allow-secret.txt", "allow-secret.txt:2: a secret key does not belong in an allow-list");
    mkdir(path_("allow-bad.d"), 0755);
    snprintf(text, sizeof text, "public = %s\n", pub);
    write_file_("allow-bad.d/good.pub", text, 0644);
    write_file_("allow-bad.d/broken.pub", "public = ,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,\n", 0644);
    expect_allow_error_("allow-bad.d", "allow-bad.d/broken.pub:1: public key is not valid Z85");
    expect_allow_error_("no-such-allow", "no-such-allow: cannot open the allow-list");

    // the server needs an allow-list and a good key
    void *ctx = zmq_ctx_new();
    mtrl_wire_auth_server *auth = NULL;
    mtrl_wire_sockopts so = mtrl_wire_sockopts_default();
    mtrl_error err;
    TEST_EQ_INT(mtrl_wire_auth_server_init(&auth, ctx, path_("learner.key"), "", &so, &err), MTRL_ERR_USAGE);
    TEST_CONTAINS(err.msg, "allow-list");
    TEST_EQ_INT(mtrl_wire_auth_server_init(&auth, ctx, path_("short.key"), path_("allow.txt"), &so, &err),
                MTRL_ERR_FORMAT);
    TEST_CONTAINS(err.msg, "short.key:1:");
    TEST_CHECK(auth == NULL);
    TEST_EQ_INT(so.curve_server, 0); // untouched on error
    // the actor side names the file too
    TEST_CHECK(mtrl_wire_auth_client_opts(&so, path_("learner.pub"), path_("badz85.key"), &err) != MTRL_OK);
    TEST_CONTAINS(err.msg, "badz85.key:3:");
    TEST_EQ_INT(so.curve_client, 0);
    TEST_EQ_INT(zmq_ctx_term(ctx), 0);
}

// ---- (g) no CURVE server without a ZAP handler ---------------------------------------------------

// router_open must fail with `want`; a socket it opened anyway is closed, or zmq_ctx_term would wait.
static void expect_router_refused_(void *ctx, const mtrl_wire_sockopts *so, mtrl_status want, const char *needle) {
    mtrl_wire_sock s;
    mtrl_error err = {0};
    mtrl_status st = mtrl_wire_router_open(&s, ctx, "tcp://127.0.0.1:*", NULL, so, &err);
    TEST_CHECKF(st == want, "router open: status %d, want %d (%s)", (int)st, (int)want, err.msg);
    if (st == MTRL_OK) mtrl_wire_sock_close(&s);
    else TEST_CHECK(s.sock == NULL);
    if (needle && st != MTRL_OK) TEST_CONTAINS(err.msg, needle);
}

static void test_no_zap_(void) {
    void *ctx = zmq_ctx_new();
    mtrl_wire_keypair kp;
    mtrl_error err;
    TEST_EQ_INT(mtrl_wire_keypair_new(&kp, &err), MTRL_OK);
    mtrl_wire_sockopts so = mtrl_wire_sockopts_default();
    so.curve_server = 1;
    memcpy(so.curve_secret_key, kp.secret_key, 32);
    expect_router_refused_(ctx, &so, MTRL_ERR_STATE, "no ZAP handler");

    // a handler in another context does not count
    void *ctx2 = zmq_ctx_new();
    mtrl_wire_auth_server *auth = NULL;
    mtrl_wire_allow al;
    mtrl_wire_allow_init(&al);
    mtrl_wire_sockopts so2 = mtrl_wire_sockopts_default();
    TEST_EQ_INT(mtrl_wire_auth_server_start(&auth, ctx2, &kp, &al, &so2, &err), MTRL_OK);
    expect_router_refused_(ctx, &so, MTRL_ERR_STATE, "no ZAP handler");
    // one handler per context
    mtrl_wire_auth_server *again = NULL;
    TEST_EQ_INT(mtrl_wire_auth_server_start(&again, ctx2, &kp, &al, &so2, &err), MTRL_ERR_STATE);
    TEST_CONTAINS(err.msg, "already runs");
    // with the handler in its own context it opens
    mtrl_wire_sock s;
    TEST_EQ_INT(mtrl_wire_router_open(&s, ctx2, "tcp://127.0.0.1:*", NULL, &so2, &err), MTRL_OK);
    mtrl_wire_sock_close(&s);
    mtrl_wire_auth_server_free(auth);
    // and a stopped handler is gone at once: CURVE is refused again
    expect_router_refused_(ctx2, &so2, MTRL_ERR_STATE, "no ZAP handler");
    // a CURVE server needs a secret key
    so.curve_server = 1;
    memset(so.curve_secret_key, 0, 32);
    expect_router_refused_(ctx, &so, MTRL_ERR_USAGE, "without a secret key");
    mtrl_wire_allow_free(&al);
    mtrl_wire_key_wipe(&kp, sizeof kp);
    TEST_EQ_INT(zmq_ctx_term(ctx2), 0);
    TEST_EQ_INT(zmq_ctx_term(ctx), 0);
}

// ---- the handler on its own: RFC 27 requests by hand ----------------------------------------------

// Sends a ZAP request and returns the status code ("200"/"400") in status, user id in user.
static void zap_ask_(void *req, const char *domain, const char *mech, const void *cred, size_t cred_len, int n_cred,
                     char status[4], char user[64]) {
    const char *f[] = {"1.0", "1", domain, "192.0.2.7", "peer", mech};
    for (int i = 0; i < 6; i++) zmq_send(req, f[i], strlen(f[i]), ZMQ_SNDMORE);
    for (int i = 0; i < n_cred; i++) zmq_send(req, cred, cred_len, i + 1 < n_cred ? ZMQ_SNDMORE : 0);
    if (n_cred == 0) zmq_send(req, "", 0, 0); // (an empty credentials frame)
    char buf[6][128];
    memset(buf, 0, sizeof buf);
    zmq_pollitem_t it = {req, 0, ZMQ_POLLIN, 0};
    TEST_EQ_INT(zmq_poll(&it, 1, 5000), 1);
    for (int i = 0; i < 6; i++) {
        int k = zmq_recv(req, buf[i], sizeof buf[i] - 1, ZMQ_DONTWAIT);
        if (k < 0) break;
    }
    TEST_EQ_STR(buf[0], "1.0");
    TEST_EQ_STR(buf[1], "1");
    snprintf(status, 4, "%.3s", buf[2]);
    snprintf(user, 64, "%.63s", buf[4]);
}

static void test_handler_direct_(void) {
    void *ctx = zmq_ctx_new();
    mtrl_wire_keypair server, actor;
    mtrl_error err;
    TEST_EQ_INT(mtrl_wire_keypair_new(&server, &err), MTRL_OK);
    TEST_EQ_INT(mtrl_wire_keypair_new(&actor, &err), MTRL_OK);
    mtrl_wire_allow al;
    mtrl_wire_allow_init(&al);
    mtrl_wire_allow_add(&al, actor.public_key);
    mtrl_wire_auth_server *auth = NULL;
    mtrl_wire_sockopts so = mtrl_wire_sockopts_default();
    TEST_EQ_INT(mtrl_wire_auth_server_start(&auth, ctx, &server, &al, &so, &err), MTRL_OK);
    void *req = zmq_socket(ctx, ZMQ_REQ);
    int zero = 0;
    zmq_setsockopt(req, ZMQ_LINGER, &zero, sizeof zero);
    TEST_EQ_INT(zmq_connect(req, "inproc://zeromq.zap.01"), 0);
    char status[4], user[64], z[41];
    mtrl_wire_key_z85(actor.public_key, z);

    zap_ask_(req, "mtrl", "CURVE", actor.public_key, 32, 1, status, user);
    TEST_EQ_STR(status, "200");
    TEST_EQ_STR(user, z);
    zap_ask_(req, "mtrl", "CURVE", server.public_key, 32, 1, status, user);
    TEST_EQ_STR(status, "400");
    TEST_EQ_STR(user, "");
    zap_ask_(req, "mtrl", "NULL", NULL, 0, 0, status, user);
    TEST_EQ_STR(status, "400");
    mtrl_wire_auth_stats st = auth_stats_(auth);
    TEST_CONTAINS(st.last_refused_reason, "mechanism NULL is not allowed");
    TEST_EQ_STR(st.last_refused_address, "192.0.2.7");
    zap_ask_(req, "mtrl", "PLAIN", "admin", 5, 2, status, user);
    TEST_EQ_STR(status, "400");
    st = auth_stats_(auth);
    TEST_CONTAINS(st.last_refused_reason, "mechanism PLAIN is not allowed");
    zap_ask_(req, "other", "CURVE", actor.public_key, 32, 1, status, user);
    TEST_EQ_STR(status, "400");
    st = auth_stats_(auth);
    TEST_CONTAINS(st.last_refused_reason, "ZAP domain 'other'");
    zap_ask_(req, "mtrl", "CURVE", actor.public_key, 31, 1, status, user);
    TEST_EQ_STR(status, "400");
    // a key allowed at run time
    mtrl_wire_auth_server_allow(auth, server.public_key);
    zap_ask_(req, "mtrl", "CURVE", server.public_key, 32, 1, status, user);
    TEST_EQ_STR(status, "200");
    st = auth_stats_(auth);
    TEST_EQ_INT(st.requests, 7);
    TEST_EQ_INT(st.accepted, 2);
    TEST_EQ_INT(st.refused, 5);

    zmq_close(req);
    // stopping is prompt even with nothing to wake the thread but the stop itself
    double t0 = mtrl_time_mono();
    mtrl_wire_auth_server_free(auth);
    TEST_CHECKF(mtrl_time_mono() - t0 < 1.0, "stop took %.3f s", mtrl_time_mono() - t0);
    mtrl_wire_auth_server_free(NULL);
    mtrl_wire_allow_free(&al);
    mtrl_wire_key_wipe(&server, sizeof server);
    mtrl_wire_key_wipe(&actor, sizeof actor);
    TEST_EQ_INT(zmq_ctx_term(ctx), 0);
}

// ---- (b) - (e) over TCP ---------------------------------------------------------------------------

static void test_tcp_(void) {
    learner_ l;
    if (!learner_open_(&l, path_("learner.key"), path_("allow.txt"))) return;
    mtrl_error err;
    char a1[41];
    pub_z85_(path_("actor1.pub"), a1);

    // (b) an allow-listed actor: HELLO in, a reply out, and the learner knows its key
    {
        mtrl_wire_sockopts so = client_opts_(path_("learner.pub"), path_("actor1.key"));
        mtrl_wire_sock d;
        actor_hello_(&l, &d, &so);
        mtrl_wire_in in;
        mtrl_status st = mtrl_wire_recv(&l.sock, 5000, &in, NULL, &err);
        TEST_CHECKF(st == MTRL_OK, "the allow-listed actor's HELLO did not arrive: %s", err.msg);
        if (st == MTRL_OK) {
            TEST_EQ_INT(in.hdr.type, MTRL_WIRE_HELLO);
            char who[41];
            TEST_EQ_INT(mtrl_wire_auth_peer_key(&l.sock, who), 1);
            TEST_EQ_STR(who, a1);
            mtrl_wire_out o;
            mtrl_wire_out_init(&o);
            mtrl_wire_encode_hello(&o, 0, 0, 0); // a HELLO-sized reply
            mtrl_wire_peer peer = in.peer;
            TEST_EQ_INT(mtrl_wire_send(&l.sock, &peer, &o, &err), MTRL_OK);
            mtrl_wire_out_free(&o);
            mtrl_wire_in back;
            st = mtrl_wire_recv(&d, 5000, &back, NULL, &err);
            TEST_CHECKF(st == MTRL_OK, "the reply did not arrive: %s", err.msg);
            if (st == MTRL_OK) TEST_EQ_INT(back.hdr.type, MTRL_WIRE_HELLO);
        }
        mtrl_wire_auth_stats s = stats_(&l);
        TEST_CHECK(s.accepted >= 1);
        TEST_EQ_INT(s.refused, 0);
        mtrl_wire_sock_close(&d);
        mtrl_wire_key_wipe(&so, sizeof so);
    }

    // (c) a valid key that is not on the list
    {
        mtrl_wire_auth_stats s0 = stats_(&l), s;
        mtrl_wire_sockopts so = client_opts_(path_("learner.pub"), path_("stranger.key"));
        mtrl_wire_sock d;
        actor_hello_(&l, &d, &so);
        TEST_CHECKF(mtrl_wire_auth_server_wait(l.auth, s0.refused + 1, s0.handshakes_failed + 1, 5000, &s),
                    "no refusal counted within 5 s");
        expect_nothing_(&l, "a key not on the allow-list");
        char stranger[41];
        pub_z85_(path_("stranger.pub"), stranger);
        TEST_EQ_STR(s.last_refused_key, stranger);
        TEST_EQ_STR(s.last_refused_address, "127.0.0.1");
        TEST_CONTAINS(s.last_refused_reason, "not on the allow-list");
        mtrl_wire_sock_close(&d);
        mtrl_wire_key_wipe(&so, sizeof so);
    }

    // (d) an actor without CURVE: refused at the greeting (mechanism mismatch), before ZAP
    {
        mtrl_wire_auth_stats s0 = stats_(&l), s;
        mtrl_wire_sock d;
        actor_hello_(&l, &d, NULL);
        TEST_CHECKF(mtrl_wire_auth_server_wait(l.auth, 0, s0.handshakes_failed + 1, 5000, &s),
                    "no failed handshake seen within 5 s");
        expect_nothing_(&l, "a NULL-mechanism actor");
        TEST_CONTAINS(s.last_failed_reason, "mechanism mismatch");
        mtrl_wire_sock_close(&d);
    }

    // (e) an actor that has the wrong server key: the server cannot open its HELLO
    {
        mtrl_wire_auth_stats s0 = stats_(&l), s;
        mtrl_wire_sockopts so = client_opts_(path_("impostor.pub"), path_("actor1.key"));
        mtrl_wire_sock d;
        actor_hello_(&l, &d, &so);
        TEST_CHECKF(mtrl_wire_auth_server_wait(l.auth, 0, s0.handshakes_failed + 1, 5000, &s),
                    "no failed handshake seen within 5 s");
        expect_nothing_(&l, "an actor with the wrong server key");
        TEST_CONTAINS(s.last_failed_reason, "cryptographic");
        TEST_EQ_INT(s.accepted, s0.accepted); // ZAP never saw it
        mtrl_wire_sock_close(&d);
        mtrl_wire_key_wipe(&so, sizeof so);
    }
    learner_close_(&l);
}

// ---- the command line ---------------------------------------------------------------------------

static void test_cli_(void) {
    const char *bin = getenv("MTRL_BIN");
    if (!bin) {
        printf("MTRL_BIN not set: command-line checks skipped\n");
        return;
    }
    test_result r = test_run_in(dir_, (char *[]){(char *)bin, "keygen", "cli", NULL});
    TEST_EQ_INT(r.rc, 0);
    char z[41];
    pub_z85_(path_("cli.pub"), z);
    TEST_EQ_INT(strlen(r.out), 41);
    TEST_CHECK(!strncmp(r.out, z, 40));
    TEST_EQ_INT(mode_of_(path_("cli.key")), 0600);
    test_result_free(&r);
    r = test_run_in(dir_, (char *[]){(char *)bin, "keygen", "cli", NULL});
    TEST_EQ_INT(r.rc, 2);
    TEST_CONTAINS(r.err, "cli.key exists; refusing to overwrite it");
    test_result_free(&r);

    // the actor's flags are checked before it connects anywhere
    r = test_run_in(dir_, (char *[]){(char *)bin, "actor", "--connect", "tcp://127.0.0.1:9", "--curve-key", "cli.key", NULL});
    TEST_EQ_INT(r.rc, 2);
    TEST_CONTAINS(r.err, "needs both --curve-server-key");
    test_result_free(&r);
    r = test_run_in(dir_, (char *[]){(char *)bin, "actor", "--connect", "tcp://127.0.0.1:9", "--curve-server-key",
                                     "learner.pub", "--curve-key", "badz85.key", NULL});
    TEST_EQ_INT(r.rc, 2);
    TEST_CONTAINS(r.err, "badz85.key:3: secret key is not valid Z85");
    test_result_free(&r);
    r = test_run_in(dir_, (char *[]){(char *)bin, "actor", "--connect", "tcp://127.0.0.1:9", "--curve-server-key",
                                     "nope.pub", "--curve-key", "cli.key", NULL});
    TEST_EQ_INT(r.rc, 2);
    TEST_CONTAINS(r.err, "nope.pub: cannot open");
    test_result_free(&r);
}

// ---- process-wide pieces: the actor's hand-off and `mtrl run`'s local actors -----------------------

static void test_process_wide_(void) {
    // client credentials set by the front door reach the actor's options
    mtrl_wire_sockopts so = client_opts_(path_("learner.pub"), path_("actor1.key"));
    mtrl_wire_auth_client_set(&so);
    mtrl_wire_sockopts got = mtrl_wire_sockopts_default();
    mtrl_wire_auth_client_apply(&got);
    TEST_EQ_INT(got.curve_client, 1);
    TEST_CHECK(!memcmp(got.curve_server_key, so.curve_server_key, 32));
    TEST_CHECK(!memcmp(got.curve_secret_key, so.curve_secret_key, 32));
    mtrl_wire_sockopts off = mtrl_wire_sockopts_default();
    mtrl_wire_auth_client_set(&off);
    got = mtrl_wire_sockopts_default();
    mtrl_wire_auth_client_apply(&got);
    TEST_EQ_INT(got.curve_client, 0);

    // `mtrl run`: an ephemeral key in a private folder, trusted by servers started afterwards
    // (the allow-list on disk knows nothing of it)
    mtrl_wire_auth_local lc;
    mtrl_error err;
    TEST_EQ_INT(mtrl_wire_auth_local_init(&lc, dir_, path_("learner.key"), &err), MTRL_OK);
    TEST_EQ_INT(mode_of_(lc.dir), 0700);
    TEST_EQ_INT(mode_of_(lc.key_file), 0600);
    learner_ l;
    if (learner_open_(&l, path_("learner.key"), path_("allow.txt"))) {
        mtrl_wire_sockopts lo = client_opts_(lc.server_pub, lc.key_file);
        mtrl_wire_sock d;
        actor_hello_(&l, &d, &lo);
        mtrl_wire_in in;
        mtrl_status st = mtrl_wire_recv(&l.sock, 5000, &in, NULL, &err);
        TEST_CHECKF(st == MTRL_OK, "the local actor's HELLO did not arrive: %s", err.msg);
        mtrl_wire_sock_close(&d);
        learner_close_(&l);
    }
    char dir_copy[1024];
    snprintf(dir_copy, sizeof dir_copy, "%s", lc.dir);
    mtrl_wire_auth_local_free(&lc);
    TEST_CHECK(access(dir_copy, F_OK) != 0);
    mtrl_wire_auth_local_free(&lc); // twice is harmless
}

int main(void) {
    if (!zmq_has("curve")) test_skip("libzmq without CURVE");
    snprintf(dir_, sizeof dir_, "/tmp/mtrl-auth-XXXXXX");
    TEST_CHECK(mkdtemp(dir_) != NULL);
    test_keygen_();
    test_bad_files_();
    test_no_zap_();
    test_handler_direct_();
    test_tcp_();
    test_cli_();
    test_process_wide_();
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir_);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir_);
    return test_report();
}
