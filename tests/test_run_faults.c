// mtrl-test: cpu fault timeout=180
// test_run_faults: a run stops and says so when it cannot keep its data, stops promptly on
// SIGINT in the warm-up, says what a --resume after a kill -9 lost, and never mixes its files
// with another run's (issue 28, items 1, 8, 11, 13).
//  1. Storage full (a 512 KiB tmpfs, mounted by this test when it may: it runs as root in CI's
//     container; otherwise the case is skipped, saying so):
//     a. the run store on it: `mtrl run` exits non-zero saying "stopping the run"; the store
//        never says `finished`, and once there is room again (and the next writer opens it) the
//        run is `failed`.
//     c. (no root needed) every write to the store's WAL fails with EIO from the 300th on (an
//        LD_PRELOAD shim, tests/fixtures/fault/fault_write.c): the same as a.
//     b. the trajectory file on it (its path a symlink into the tmpfs): the same, the message
//        names the trajectory file, and the run stopped long before its steps.
//  8. SIGINT once the warm-up of 100000 steps has begun: the run ends within 20 s (the warm-up
//     alone takes minutes), non-zero, marked `killed`, with far fewer warm-up steps logged.
// 11. `mtrl run` killed with SIGKILL at a step past its last checkpoint (50): `--resume` logs and
//     stores "the previous sitting trained to step T but its last checkpoint is of step 50:
//     steps 51..T are lost and done again"; episodes.trained_step then says which episodes a
//     step trained on: none past 50, exactly the `episodes` metric's sum of steps 1..50, and
//     `complete` episodes never trained on have NULL.
// 13. Two run stores with one out_dir: each run's files are in its own folder <store>-run<id>/;
//     a folder claimed by another store's run (same store file name) is refused naming it, and
//     the first run's checkpoints are untouched. A checkpoint overwritten after its run wrote it
//     is refused by --resume, replay --rescore and --reexec, and eval, each naming the file and
//     "changed since its run wrote it".
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/store.h"
#include "common/timeutil.h"
#include "tests/testhelp.h"
#include "tests/testproc.h"

static char dir_[256];
static const char *bin_;

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

// warmup: [warmup] steps; traj: keep every trajectory.
static void write_experiment(const char *path, const char *out_dir, int steps, int warmup) {
    FILE *f = fopen(path, "w");
    fprintf(f,
            "[run]\nname = faults\nsteps = %d\nout_dir = %s\ncheckpoint_every = 10\nkeep_trajectories = all\n"
            "[model]\npreset = tiny\n[env]\nname = calc\n"
            "[actor]\ncount = 1\nepisodes_in_flight = 4\nmax_tokens = 24\nmax_turn_tokens = 8\n"
            "[learner]\nbatch_groups = 1\n[algo]\ngroup_size = 2\n[warmup]\nsteps = %d\nbatch = 2\n",
            steps, out_dir, warmup);
    fclose(f);
}

static test_result run_mtrl(char *const argv[]) { return test_run_in(dir_, argv); }

static void run_status(const char *db, long long run, char *out, size_t cap) {
    char sql[128];
    snprintf(sql, sizeof sql, "SELECT status FROM runs WHERE id = %lld", run);
    out[0] = 0;
    sqlite3 *h;
    if (sqlite3_open_v2(db, &h, SQLITE_OPEN_READONLY, NULL) == SQLITE_OK) {
        sqlite3_busy_timeout(h, 5000);
        sqlite3_stmt *q = NULL;
        if (sqlite3_prepare_v2(h, sql, -1, &q, NULL) == SQLITE_OK && sqlite3_step(q) == SQLITE_ROW)
            snprintf(out, cap, "%s", (const char *)sqlite3_column_text(q, 0));
        sqlite3_finalize(q);
    }
    sqlite3_close(h);
}

// A 512 KiB tmpfs at dir_/name (into path); 0 when it could not be mounted (not root, no
// CAP_SYS_ADMIN): the case `what` is skipped, saying so.
static int tmpfs_mount(char *path, size_t cap, const char *name, const char *what) {
    snprintf(path, cap, "%s/%s", dir_, name);
    mkdir(path, 0755);
    if (mount("tmpfs", path, "tmpfs", 0, "size=512k") == 0) return 1;
    printf("SKIP %s: cannot mount a tmpfs (%s)\n", what, strerror(errno));
    return 0;
}

// ---- 1a: the run store on a full file system -----------------------------------------------------

static void test_store_full(void) {
    char full[320], ini[320], db[400], st[32];
    if (!tmpfs_mount(full, sizeof full, "full", "store full")) return;
    snprintf(ini, sizeof ini, "%s/store.ini", dir_);
    snprintf(db, sizeof db, "%s/run.db", full);
    write_experiment(ini, "out-store", 300, 0);
    test_result r = run_mtrl((char *[]){(char *)bin_, "run", ini, "--db", db, NULL});
    TEST_CHECKF(r.rc != 0 && r.rc < 128, "mtrl run on a full store: exit %d (stderr %s)", r.rc, r.err);
    TEST_CONTAINS(r.err, "stopping the run");
    TEST_CHECKF(!strstr(r.err, "finished:"), "a run that lost data said finished:\n%s", r.err);
    run_status(db, 1, st, sizeof st);
    TEST_CHECKF(strcmp(st, "finished") != 0, "the full store says the run finished");
    // Room again: the next writer finds the run's lock gone and marks it failed (if the learner
    // could not store `failed` itself).
    TEST_EQ_INT(mount("tmpfs", full, "tmpfs", MS_REMOUNT, "size=8m"), 0);
    mtrl_store *s;
    mtrl_error err;
    TEST_EQ_INT(mtrl_store_open(&s, db, 0, &err), MTRL_OK);
    mtrl_store_close(s);
    run_status(db, 1, st, sizeof st);
    TEST_EQ_STR(st, "failed");
    printf("store full: exit %d, run %s\n", r.rc, st);
    test_result_free(&r);
    umount(full);
}

// ---- 1c: write errors on the run store's WAL (an LD_PRELOAD shim; no root needed) ----------------

static void test_store_eio(void) {
    char ini[320], db[320], shim[600], st[32];
    const char *build = getenv("MTRL_BUILD");
    snprintf(shim, sizeof shim, "%s/lib/libmtrl_fault_write.so", build ? build : ".");
    if (access(shim, R_OK) != 0) {
        TEST_CHECKF(0, "%s: not built (ninja mtrl_fault_write)", shim);
        return;
    }
    snprintf(ini, sizeof ini, "%s/eio.ini", dir_);
    snprintf(db, sizeof db, "%s/eio.db", dir_);
    write_experiment(ini, "out-eio", 300, 0);
    // From the WAL's 300th write on, every write to it fails with EIO (tests/fixtures/fault).
    setenv("LD_PRELOAD", shim, 1);
    setenv("MTRL_TEST_FAULT_PATH", "eio.db-wal", 1);
    setenv("MTRL_TEST_FAULT_AFTER", "300", 1);
    test_result r = run_mtrl((char *[]){(char *)bin_, "run", ini, "--db", db, NULL});
    unsetenv("LD_PRELOAD");
    unsetenv("MTRL_TEST_FAULT_PATH");
    unsetenv("MTRL_TEST_FAULT_AFTER");
    TEST_CHECKF(r.rc != 0 && r.rc < 128, "mtrl run with WAL write errors: exit %d (stderr %s)", r.rc, r.err);
    TEST_CONTAINS(r.err, "stopping the run");
    TEST_CHECKF(!strstr(r.err, "finished:"), "a run that lost data said finished:\n%s", r.err);
    mtrl_store *s;
    mtrl_error err;
    TEST_EQ_INT(mtrl_store_open(&s, db, 0, &err), MTRL_OK); // the next writer: a run left running is failed
    mtrl_store_close(s);
    run_status(db, 1, st, sizeof st);
    TEST_EQ_STR(st, "failed");
    printf("WAL write errors: exit %d, run %s\n", r.rc, st);
    test_result_free(&r);
}

// ---- 1b: the trajectory file on a full file system ------------------------------------------------

static void test_traj_full(void) {
    char full[320], ini[320], db[320], link[400], target[400], st[32], sql[500];
    if (!tmpfs_mount(full, sizeof full, "fulltraj", "trajectory full")) return;
    snprintf(ini, sizeof ini, "%s/traj.ini", dir_);
    snprintf(db, sizeof db, "%s/traj.db", dir_);
    write_experiment(ini, "out-traj", 2000, 0);
    // The run's trajectory file is a symlink into the tmpfs; its checkpoints have room.
    snprintf(link, sizeof link, "%s/out-traj/traj-run1", dir_);
    TEST_EQ_INT(system((snprintf(sql, sizeof sql, "mkdir -p '%s'", link), sql)), 0);
    snprintf(link, sizeof link, "%s/out-traj/traj-run1/traj-run1.bin", dir_);
    snprintf(target, sizeof target, "%s/traj.bin", full);
    TEST_EQ_INT(symlink(target, link), 0);
    test_result r = run_mtrl((char *[]){(char *)bin_, "run", ini, "--db", db, NULL});
    TEST_CHECKF(r.rc != 0 && r.rc < 128, "mtrl run with a full trajectory disk: exit %d (stderr %s)", r.rc, r.err);
    TEST_CONTAINS(r.err, "trajectory file");
    TEST_CONTAINS(r.err, "stopping the run");
    run_status(db, 1, st, sizeof st);
    TEST_EQ_STR(st, "failed");
    long long steps = test_query_int(db, "SELECT MAX(step) FROM metrics WHERE run = 1 AND name = 'reward'");
    TEST_CHECKF(steps < 2000, "the run went on to step %lld with its trajectories lost", steps);
    long long ev = test_query_int(db, "SELECT COUNT(*) FROM events WHERE run = 1 AND message LIKE '%trajectory file%stopping the run%'");
    TEST_CHECKF(ev >= 1, "no event says why the run stopped");
    printf("trajectory full: exit %d, run %s at step %lld\n", r.rc, st, steps);
    test_result_free(&r);
    umount(full);
}

// ---- 8: SIGINT during the warm-up -----------------------------------------------------------------

static void test_warmup_sigint(void) {
    char ini[320], db[320], log[320], st[32];
    snprintf(ini, sizeof ini, "%s/warm.ini", dir_);
    snprintf(db, sizeof db, "%s/warm.db", dir_);
    snprintf(log, sizeof log, "%s/warm.log", dir_);
    write_experiment(ini, "out-warm", 10, 100000);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        if (chdir(dir_) != 0) _exit(126); // out_dir is relative to it
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 1);
        dup2(fd, 2);
        setenv("OMP_NUM_THREADS", "1", 1);
        execv(bin_, (char *[]){(char *)bin_, "run", ini, "--db", db, NULL});
        _exit(127);
    }
    // Wait until the warm-up has taken a few steps, then interrupt it.
    double until = mtrl_time_mono() + 60;
    while (mtrl_time_mono() < until && test_query_int(db, "SELECT COUNT(*) FROM metrics WHERE name = 'warmup_loss'") < 5)
        sleep_ms(50);
    TEST_CHECKF(test_query_int(db, "SELECT COUNT(*) FROM metrics WHERE name = 'warmup_loss'") >= 5, "the warm-up did not start (%s)", log);
    kill(pid, SIGINT);
    int status = 0, ended = 0;
    until = mtrl_time_mono() + 20; // a bound far below the warm-up's minutes, not a timing claim
    while (mtrl_time_mono() < until && !(ended = waitpid(pid, &status, WNOHANG) == pid)) sleep_ms(20);
    TEST_CHECKF(ended, "mtrl run still in its warm-up 20 s after SIGINT");
    if (!ended) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
    }
    TEST_CHECKF(WIFEXITED(status) && WEXITSTATUS(status) != 0, "status 0x%x", status);
    run_status(db, 1, st, sizeof st);
    TEST_EQ_STR(st, "killed");
    long long n = test_query_int(db, "SELECT COUNT(*) FROM metrics WHERE name = 'warmup_loss'");
    TEST_CHECKF(n < 100000, "the warm-up ran all its %lld steps", n);
    printf("warm-up SIGINT: ended after %lld warm-up steps, run %s\n", n, st);
}

// ---- 11: --resume after a kill -9 says what was lost; episodes say whether they were trained -------

static void test_resume_lost(void) {
    char ini[320], db[320], log[320], st[32], sql[400];
    snprintf(ini, sizeof ini, "%s/res.ini", dir_);
    snprintf(db, sizeof db, "%s/res.db", dir_);
    snprintf(log, sizeof log, "%s/res.log", dir_);
    write_experiment(ini, "out-res", 100000, 0);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        if (chdir(dir_) != 0) _exit(126);
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 1);
        dup2(fd, 2);
        setenv("OMP_NUM_THREADS", "1", 1);
        execv(bin_, (char *[]){(char *)bin_, "run", ini, "--db", db, "--set", "run.checkpoint_every=50", NULL});
        _exit(127);
    }
    // Past the checkpoint of step 50, far from the next one: then kill -9 (no final checkpoint).
    double until = mtrl_time_mono() + 120;
    long long at = 0;
    while (mtrl_time_mono() < until &&
           ((at = test_query_int(db, "SELECT coalesce(max(step), 0) FROM metrics WHERE name = 'reward'")) < 53 ||
            test_query_int(db, "SELECT count(*) FROM checkpoints WHERE step = 50") < 1))
        sleep_ms(20);
    kill(pid, SIGKILL);
    int status;
    waitpid(pid, &status, 0);
    TEST_CHECKF(at >= 53 && at < 100, "killed at step %lld (%s)", at, log);
    long long trained_to = test_query_int(db, "SELECT max(trained_step) FROM episodes");
    long long ckpt = test_query_int(db, "SELECT max(step) FROM checkpoints");
    printf("--resume: killed at step %lld, episodes trained to step %lld, last checkpoint %lld\n", at, trained_to, ckpt);
    TEST_EQ_INT(ckpt, 50);
    TEST_CHECK(trained_to > ckpt);
    // Resume only to the checkpoint's step: the run picks up there and ends.
    test_result r = run_mtrl((char *[]){(char *)bin_, "run", ini, "--db", db, "--resume", "--set", "run.steps=50",
                                        "--set", "run.checkpoint_every=50", NULL});
    TEST_CHECKF(r.rc == 0, "--resume: exit %d: %s", r.rc, r.err);
    snprintf(sql, sizeof sql,
             "SELECT count(*) FROM events WHERE message LIKE '--resume: the previous sitting trained to step %lld but its "
             "last checkpoint is of step 50: steps 51..%lld are lost and done again (%% of their episodes marked "
             "untrained; [run] checkpoint_every = 50)'", trained_to, trained_to);
    TEST_EQ_INT(test_query_int(db, sql), 1);
    TEST_CONTAINS(r.err, "steps 51..");
    run_status(db, 1, st, sizeof st);
    TEST_EQ_STR(st, "finished");
    // No episode claims a training that was lost; the trained ones are exactly what steps 1..50
    // trained (their `episodes` metric); episodes never trained (stale, of dropped groups, or of
    // the lost steps) are told apart from the trained though stored `complete`.
    TEST_EQ_INT(test_query_int(db, "SELECT max(trained_step) FROM episodes"), 50);
    TEST_EQ_INT(test_query_int(db, "SELECT count(*) FROM episodes WHERE trained_step IS NOT NULL"),
                test_query_int(db, "SELECT CAST(sum(value) AS INTEGER) FROM metrics WHERE name = 'episodes' AND step <= 50"));
    long long untrained = test_query_int(db, "SELECT count(*) FROM episodes WHERE status = 'complete' AND trained_step IS NULL");
    printf("--resume: %lld complete episodes never trained on (trained_step NULL)\n", untrained);
    TEST_CHECK(untrained > 0);
    test_result_free(&r);
}

// ---- 13: one out_dir, two runs; checkpoint digests --------------------------------------------------

static int copy_file(const char *from, const char *to) {
    char cmd[1000];
    snprintf(cmd, sizeof cmd, "cp '%s' '%s'", from, to);
    return system(cmd);
}

static void test_out_dir_shared(void) {
    char ini[320], db1[320], db2[320], db3[320], c1[400], c2[400], keep[400], msg[1000], sql[400];
    snprintf(ini, sizeof ini, "%s/shared.ini", dir_);
    snprintf(db1, sizeof db1, "%s/a.db", dir_);
    snprintf(db2, sizeof db2, "%s/b.db", dir_);
    mkdir((snprintf(db3, sizeof db3, "%s/other", dir_), db3), 0755);
    snprintf(db3, sizeof db3, "%s/other/a.db", dir_);
    write_experiment(ini, "out-shared", 20, 0);
    test_result r = run_mtrl((char *[]){(char *)bin_, "run", ini, "--db", db1, NULL});
    TEST_EQ_INT(r.rc, 0);
    test_result_free(&r);
    snprintf(c1, sizeof c1, "%s/out-shared/a-run1/ckpt-000010.safetensors", dir_);
    snprintf(keep, sizeof keep, "%s/keep10", dir_);
    TEST_EQ_INT(copy_file(c1, keep), 0);
    // the same experiment into another store: its own folder, the first run's files untouched
    r = run_mtrl((char *[]){(char *)bin_, "run", ini, "--db", db2, NULL});
    TEST_EQ_INT(r.rc, 0);
    test_result_free(&r);
    snprintf(c2, sizeof c2, "%s/out-shared/b-run1/ckpt-000010.safetensors", dir_);
    TEST_CHECK(access(c2, R_OK) == 0);
    TEST_EQ_INT(system((snprintf(msg, sizeof msg, "cmp -s '%s' '%s'", c1, keep), msg)), 0);
    // a second run of the first store: a folder of its own too
    r = run_mtrl((char *[]){(char *)bin_, "run", ini, "--db", db1, NULL});
    TEST_EQ_INT(r.rc, 0);
    test_result_free(&r);
    TEST_CHECK(access((snprintf(msg, sizeof msg, "%s/out-shared/a-run2/ckpt-000010.safetensors", dir_), msg), R_OK) == 0);
    TEST_EQ_INT(system((snprintf(msg, sizeof msg, "cmp -s '%s' '%s'", c1, keep), msg)), 0);
    // a store of the same file name elsewhere: its run 1 would write into a-run1: refused
    r = run_mtrl((char *[]){(char *)bin_, "run", ini, "--db", db3, NULL});
    TEST_CHECKF(r.rc != 0, "a run of another a.db wrote into a-run1");
    snprintf(msg, sizeof msg, "holds the files of run 1 of %s", db1);
    TEST_CONTAINS(r.err, msg);
    TEST_CONTAINS(r.err, "refusing to overwrite");
    test_result_free(&r);
    TEST_EQ_INT(system((snprintf(msg, sizeof msg, "cmp -s '%s' '%s'", c1, keep), msg)), 0);

    // Digests: a.db's run 2 step-20 checkpoint replaced by b's (what the old tree did to it).
    char a20[400], b20[400], ep[32];
    snprintf(a20, sizeof a20, "%s/out-shared/a-run2/ckpt-000020.safetensors", dir_);
    snprintf(b20, sizeof b20, "%s/out-shared/b-run1/ckpt-000020.safetensors", dir_);
    TEST_EQ_INT(copy_file(b20, a20), 0);
    // --resume of run 2 from that file
    r = run_mtrl((char *[]){(char *)bin_, "run", ini, "--db", db1, "--resume", "--set", "run.steps=30", NULL});
    TEST_CHECKF(r.rc != 0, "--resume loaded a changed checkpoint");
    TEST_CONTAINS(r.err, "a-run2/ckpt-000020.safetensors: the checkpoint file changed since its run wrote it");
    test_result_free(&r);
    // eval of it ([run] db names the store that recorded it)
    snprintf(sql, sizeof sql, "run.db=%s", db1);
    r = run_mtrl((char *[]){(char *)bin_, "eval", ini, "--set", sql, "--checkpoint", a20, "--episodes", "2", NULL});
    TEST_CHECKF(r.rc == 1, "eval of a changed checkpoint: exit %d", r.rc);
    TEST_CONTAINS(r.err, "changed since its run wrote it");
    test_result_free(&r);
    // eval of an intact one runs
    r = run_mtrl((char *[]){(char *)bin_, "eval", ini, "--set", sql, "--checkpoint", c1, "--episodes", "2", NULL});
    TEST_EQ_INT(r.rc, 0);
    test_result_free(&r);
    // replay: an episode of run 2 generated by the version that checkpoint holds
    long long v = test_query_int(db1, "SELECT version FROM checkpoints WHERE run = 2 AND step = 20");
    snprintf(sql, sizeof sql,
             "SELECT id FROM episodes WHERE run = 2 AND traj_path IS NOT NULL AND model_tokens > 0 AND version_max = %lld LIMIT 1", v);
    long long id = test_query_int(db1, sql);
    if (id <= 0) { // none of that version came back: rescore any episode with that checkpoint
        id = test_query_int(db1, "SELECT id FROM episodes WHERE run = 2 AND traj_path IS NOT NULL AND model_tokens > 0 LIMIT 1");
        TEST_CHECK(id > 0);
        snprintf(ep, sizeof ep, "%lld", id);
        r = run_mtrl((char *[]){(char *)bin_, "replay", "--db", db1, "--run", "2", "--episode", ep, "--rescore", "--checkpoint", a20, NULL});
        TEST_EQ_INT(r.rc, 1);
        TEST_CONTAINS(r.err, "changed since its run wrote it");
        test_result_free(&r);
    } else {
        snprintf(ep, sizeof ep, "%lld", id);
        const char *modes[] = {"--rescore", "--reexec"};
        for (int k = 0; k < 2; k++) {
            r = run_mtrl((char *[]){(char *)bin_, "replay", "--db", db1, "--run", "2", "--episode", ep, (char *)modes[k], NULL});
            TEST_CHECKF(r.rc == 1, "replay %s of a changed checkpoint: exit %d\n%s", modes[k], r.rc, r.out);
            TEST_CONTAINS(r.err, "a-run2/ckpt-000020.safetensors: the checkpoint file changed since its run wrote it");
            test_result_free(&r);
        }
    }
    printf("out_dir shared: a-run1, a-run2, b-run1 apart; changed checkpoint refused (episode %lld)\n", id);
}

int main(void) {
    bin_ = getenv("MTRL_BIN");
    if (!bin_) {
        printf("SKIP: MTRL_BIN not set (run through ctest)\n");
        return 77;
    }
    snprintf(dir_, sizeof dir_, "/tmp/mtrl_faults_XXXXXX");
    if (!mkdtemp(dir_)) {
        perror("mkdtemp");
        return 1;
    }
    test_warmup_sigint();
    test_resume_lost();
    test_out_dir_shared();
    test_store_full();
    test_store_eio();
    test_traj_full();
    test_tmpdir_done(dir_, test_failed_);
    return test_report();
}
