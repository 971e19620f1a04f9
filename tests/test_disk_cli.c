/* The disk tier through the `tidal` command, as a user runs it (cpu
 * backend, a temporary directory): `tidal bench disk` measures both I/O
 * methods; `tidal plan --offload-dir` reports the disk object and its term
 * in the step bound; `plan --largest --disk-bytes` counts a disk the
 * machine does not have; `tidal train --offload-dir --host-ram` trains
 * with the same losses as without and leaves the directory empty after a
 * normal exit and after SIGTERM or SIGINT; a killed run's lock file is reclaimed by
 * the next run, which says so. */
#include "td_test.h"
#include "td_proc.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char tidal[512], tmp[128], disk[256];

static int sh(char *out, size_t out_bytes, const char *fmt, ...)
{
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    char full[4200];
    snprintf(full, sizeof full, "%s 2>&1", cmd);
    FILE *p = popen(full, "r");
    assert_non_null(p);
    size_t n = fread(out, 1, out_bytes - 1, p);
    out[n] = '\0';
    int rc = pclose(p);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
}

static int count_files(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    return n;
}

static int setup(void **state)
{
    setenv("TD_DISK_PROBE_BYTES", "16MiB", 1); /* the plans' disk probe: a few MiB, not a GiB */
    snprintf(tidal, sizeof tidal, "%s", td_test_tidal());
    if (td_proc_tmpdir(tmp, sizeof tmp, "tidal-disk-cli")) return -1;
    snprintf(disk, sizeof disk, "%s/nvme", tmp);
    if (mkdir(disk, 0700)) return -1;
    char out[4096];
    return sh(out, sizeof out, "head -c 200000 /usr/share/games/fortunes/fortunes > %s/text && %s prepare --quiet "
              "--input %s/text --out %s/ok.tok", tmp, tidal, tmp, tmp);
}

static int teardown(void **state) { return td_proc_rmdir(tmp); }

/* 4 layers, 32 wide, every chunk's AdamW on the CPU. */
#define MODEL "--layers 4 --width 32 --heads 2 --seq 32 --micro-batch 2 --backend cpu --policy cpu --gpu-budget 64MiB " \
              "--chunk-numel 4096 --lr 3e-3 --seed 5"

/* The host bytes `tidal plan` gives MODEL (one rank of `ranks`), and its
 * pageable optimizer state. */
static void host_figures_ranks(int ranks, size_t *host, size_t *state)
{
    char out[1 << 16];
    int rc = sh(out, sizeof out, "%s plan --data %s/ok.tok " MODEL " --no-measure --json --nproc %d", tidal, tmp, ranks);
    assert_int_equal(rc, 0);
    cJSON *j = cJSON_Parse(out);
    assert_non_null(j);
    *host = (size_t)td_test_json_num(j, "host", "total_bytes");
    *state = (size_t)td_test_json_num(j, "host", "pageable_optimizer_bytes");
    cJSON_Delete(j);
}

static void host_figures(size_t *host, size_t *state) { host_figures_ranks(1, host, state); }

static void test_bench_disk(void **state)
{
    char out[1 << 14];
    int rc = sh(out, sizeof out, "%s bench disk %s --bytes 8MiB --block 1MiB --depth 4 --json", tidal, disk);
    assert_int_equal(rc, 0);
    cJSON *j = cJSON_Parse(out);
    if (!j) fail_msg("not JSON: %s", out);
    cJSON *res = cJSON_GetObjectItem(j, "results");
    assert_true(cJSON_GetArraySize(res) >= 1);
    cJSON *r;
    cJSON_ArrayForEach(r, res) {
        assert_true(td_test_json_num(r, "write_gbytes_per_s", NULL) > 0);
        assert_true(td_test_json_num(r, "read_gbytes_per_s", NULL) > 0);
        assert_true(td_test_json_num(r, "mixed_gbytes_per_s", NULL) > 0);
        assert_true(td_test_json_num(r, "bytes", NULL) >= 8 * 1024 * 1024);
    }
    cJSON *d0 = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "dirs"), 0);
    assert_true(td_test_json_num(d0, "free_bytes", NULL) > 0);
    cJSON_Delete(j);
    assert_int_equal(count_files(disk), 0);
    /* The table, and usage errors. */
    rc = sh(out, sizeof out, "%s bench disk %s --bytes 4MiB --method threads", tidal, disk);
    assert_int_equal(rc, 0);
    assert_non_null(strstr(out, "threads"));
    assert_int_equal(sh(out, sizeof out, "%s bench disk --bytes 4MiB", tidal), 2);
    assert_non_null(strstr(out, "name the directory"));
    assert_int_equal(sh(out, sizeof out, "%s bench disk %s --block 1000", tidal, disk), 2);
    assert_int_equal(sh(out, sizeof out, "%s bench disk %s/missing --bytes 4MiB", tidal, disk), 1);
    assert_non_null(strstr(out, "missing"));
}

static void test_plan_disk(void **state)
{
    size_t host, pstate;
    host_figures(&host, &pstate);
    char out[1 << 16];
    /* RAM for all but half the optimizer state: some of it goes to disk. */
    int rc = sh(out, sizeof out, "%s plan --data %s/ok.tok " MODEL " --offload-dir %s --host-ram %zu --json", tidal,
                tmp, disk, host - pstate / 2);
    assert_int_equal(rc, 0);
    cJSON *j = cJSON_Parse(out);
    if (!j) fail_msg("not JSON: %s", out);
    double chunks = td_test_json_num(j, "disk", "chunks"), optim = td_test_json_num(j, "optimizer", "chunks");
    assert_true(chunks > 0 && chunks <= optim);
    assert_true(td_test_json_num(j, "disk", "bytes") > 0);
    assert_true(td_test_json_num(j, "disk", "free_bytes") > td_test_json_num(j, "disk", "bytes"));
    assert_true(td_test_json_num(j, "disk", "read_bytes_per_step") == td_test_json_num(j, "disk", "bytes"));
    cJSON *m = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "disk"), "measured");
    assert_true(td_test_json_num(m, "mixed_gbytes_per_s", NULL) > 0);
    assert_true(td_test_json_num(j, "disk", "disk_ms") > 0);
    assert_true(td_test_json_num(j, "disk", "hide_grad_accum") >= 0);
    assert_true(td_test_json_num(j, "host", "total_bytes") <= (double)(host - pstate / 2));
    assert_true(cJSON_IsTrue(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "disk"), "fits")));
    cJSON_Delete(j);
    /* The table says it. */
    rc = sh(out, sizeof out, "%s plan --data %s/ok.tok " MODEL " --offload-dir %s --host-ram %zu", tidal, tmp, disk,
            host - pstate / 2);
    assert_int_equal(rc, 0);
    assert_non_null(strstr(out, "optimizer chunks"));
    assert_non_null(strstr(out, "on disk"));
    assert_non_null(strstr(out, "disk "));
    /* A drive that is too small: it does not fit (exit 3). */
    rc = sh(out, sizeof out, "%s plan --data %s/ok.tok " MODEL " --offload-dir %s --host-ram %zu --disk-bytes 4KiB "
            "--no-measure", tidal, tmp, disk, host - pstate / 2);
    assert_int_equal(rc, 3);
    assert_non_null(strstr(out, "DOES NOT FIT"));
    assert_int_equal(count_files(disk), 0);
}

/* --largest with a disk on paper trains more layers than without. */
static void test_plan_largest_counts_disk(void **state)
{
    char out[1 << 15];
    const char *shape = "--width 64 --heads 2 --seq 32 --micro-batch 2 --backend cpu --vocab 256 --gpu-budget 64MiB "
                        "--policy cpu --host-ram 160MiB --largest --json";
    int rc = sh(out, sizeof out, "%s plan %s", tidal, shape);
    assert_int_equal(rc, 0);
    cJSON *a = cJSON_Parse(out);
    if (!a) fail_msg("not JSON: %s", out);
    rc = sh(out, sizeof out, "%s plan %s --disk-bytes 2GiB", tidal, shape);
    assert_int_equal(rc, 0);
    cJSON *b = cJSON_Parse(out);
    if (!b) fail_msg("not JSON: %s", out);
    assert_true(td_test_json_num(b, "disk_bytes", NULL) == 2.0 * 1024 * 1024 * 1024);
    cJSON *la = cJSON_GetArrayItem(cJSON_GetObjectItem(a, "largest"), 0);
    cJSON *lb = cJSON_GetArrayItem(cJSON_GetObjectItem(b, "largest"), 0);
    double without = td_test_json_num(la, "layers", NULL), with = td_test_json_num(lb, "layers", NULL);
    print_message("largest at 64 wide, 160 MiB RAM: %.0f layers, %.0f with 2 GiB of disk\n", without, with);
    assert_true(with > without);
    assert_true(td_test_json_num(lb, "disk_bytes", NULL) > 0);
    cJSON_Delete(a);
    cJSON_Delete(b);
}

static void read_losses(const char *log, double *loss, int n)
{
    double got[64];
    int k = td_proc_read_log(log, got, NULL, 64);
    assert_true(k >= n);
    memcpy(loss, got, (size_t)n * sizeof *loss);
}

/* Training with the tier: the losses of the run without it, the steps'
 * disk bytes in the log, nothing left in the directory. */
static void test_train_equal_and_clean(void **state)
{
    size_t host, pstate;
    host_figures(&host, &pstate);
    char out[1 << 15];
    int rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps 4 --log %s/ref.jsonl", tidal, tmp, tmp);
    if (rc) fail_msg("%s", out);
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps 4 --log %s/disk.jsonl --offload-dir %s "
            "--host-ram %zu", tidal, tmp, tmp, disk, host - pstate / 2);
    if (rc) fail_msg("%s", out);
    assert_non_null(strstr(out, "disk tier:"));
    assert_non_null(strstr(out, disk));
    char path[400];
    double ref[4], got[4];
    snprintf(path, sizeof path, "%s/ref.jsonl", tmp);
    read_losses(path, ref, 4);
    snprintf(path, sizeof path, "%s/disk.jsonl", tmp);
    read_losses(path, got, 4);
    for (int s = 0; s < 4; s++)
        if (memcmp(&ref[s], &got[s], sizeof(double)))
            fail_msg("step %d: loss %.17g with --offload-dir, %.17g without", s + 1, got[s], ref[s]);
    /* The steps' disk traffic in the log: the updates of each step (run in
     * the next one's forward: clipping) read and write the state. */
    const char *log = td_proc_slurp(path), *last = strrchr(log, '{') ? log : log;
    for (const char *at = log; (at = strstr(at, "{\"step\":")); at++) last = at;
    const char *w = strstr(last, "\"disk_write_bytes\":"), *r = strstr(last, "\"disk_read_bytes\":");
    assert_non_null(w);
    assert_non_null(r);
    assert_true(atof(w + strlen("\"disk_write_bytes\":")) > 0);
    assert_true(atof(r + strlen("\"disk_read_bytes\":")) > 0);
    assert_int_equal(count_files(disk), 0);
}

/* ZeRO-3 on 2 ranks: each rank's disk holds its shard of the state; the
 * losses are those of the 2 ranks without the disk tier, bit for bit. */
static void test_train_two_ranks(void **state)
{
    size_t host, pstate;
    host_figures_ranks(2, &host, &pstate);
    size_t ram = 2 * (host - pstate / 2); /* the host's: each of its 2 ranks plans against half */
    char out[1 << 15];
    int rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps 3 --nproc 2 --log %s/r2.jsonl", tidal, tmp,
                tmp);
    if (rc) fail_msg("%s", out);
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps 3 --nproc 2 --log %s/r2d.jsonl "
            "--offload-dir %s --host-ram %zu", tidal, tmp, tmp, disk, ram);
    if (rc) fail_msg("%s", out);
    assert_non_null(strstr(out, "disk tier:"));
    char path[400];
    double ref[3], got[3];
    snprintf(path, sizeof path, "%s/r2.jsonl", tmp);
    read_losses(path, ref, 3);
    snprintf(path, sizeof path, "%s/r2d.jsonl", tmp);
    read_losses(path, got, 3);
    for (int s = 0; s < 3; s++)
        if (memcmp(&ref[s], &got[s], sizeof(double)))
            fail_msg("2 ranks, step %d: loss %.17g with --offload-dir, %.17g without", s + 1, got[s], ref[s]);
    assert_int_equal(count_files(disk), 0);
}

/* ZeRO-3 with grads and params on disk too: 192 wide, two micro-batches
 * (every grad keeps a host copy), and the least --host-ram whose plan
 * fits with the tier (bisected over `tidal plan`), which homes on disk
 * the whole state, then grads, then params.  The losses and the
 * checkpoint files are those of the 2 ranks without the tier, to the bit. */
#define WIDE "--layers 4 --width 192 --heads 4 --seq 32 --micro-batch 2 --backend cpu --policy cpu " \
             "--gpu-budget 64MiB --chunk-numel 16384 --lr 3e-3 --seed 5 --grad-accum 2 --nproc 2"

/* The plan of WIDE with the tier at `ram` (NULL when it is not JSON); *fits: the host's. */
static cJSON *wide_plan(size_t ram, int *fits)
{
    static char out[1 << 16];
    sh(out, sizeof out, "%s plan --data %s/ok.tok " WIDE " --no-measure --json --offload-dir %s --host-ram %zu", tidal,
       tmp, disk, ram);
    cJSON *j = cJSON_Parse(out);
    if (!j) fail_msg("not JSON: %s", out);
    *fits = cJSON_IsTrue(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "host"), "fits"));
    return j;
}

static void test_train_two_ranks_params_and_grads(void **state)
{
    char out[1 << 15], path[400], a[400], b[400];
    int fits;
    cJSON *j = wide_plan(SIZE_MAX / 4, &fits);
    size_t hi = 2 * (size_t)td_test_json_num(j, "host", "total_bytes"), lo = 0; /* hi fits (both ranks' share) */
    double state_bytes = td_test_json_num(j, "host", "pageable_optimizer_bytes"); /* a rank's, nothing on disk */
    cJSON_Delete(j);
    while (hi - lo > (1 << 20)) {
        size_t mid = lo + (hi - lo) / 2;
        cJSON_Delete(wide_plan(mid, &fits));
        if (fits) hi = mid;
        else lo = mid;
    }
    j = wide_plan(hi, &fits);
    assert_true(fits);
    double optim = td_test_json_num(j, "optimizer", "chunks"), chunks = td_test_json_num(j, "disk", "chunks");
    double grads = td_test_json_num(j, "disk", "grad_chunks"), params = td_test_json_num(j, "disk", "param_chunks");
    print_message("2 ranks, --host-ram %zu: %.0f optimizer, %.0f grad, %.0f param chunks of %.0f on disk\n", hi, chunks,
                  grads, params, optim);
    assert_true(chunks == optim && grads > 0 && params > 0);
    cJSON_Delete(j);
    int rc = sh(out, sizeof out, "%s train --data %s/ok.tok " WIDE " --steps 3 --log %s/w.jsonl --save %s/w.ck", tidal,
                tmp, tmp, tmp);
    if (rc) fail_msg("%s", out);
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok " WIDE " --steps 3 --log %s/wd.jsonl --save %s/wd.ck "
            "--offload-dir %s --host-ram %zu", tidal, tmp, tmp, tmp, disk, hi);
    if (rc) fail_msg("%s", out);
    if (!strstr(out, "grad and") || !strstr(out, "param chunks on disk")) fail_msg("no grads and params on disk: %s", out);
    double ref[3], got[3];
    snprintf(path, sizeof path, "%s/w.jsonl", tmp);
    read_losses(path, ref, 3);
    snprintf(path, sizeof path, "%s/wd.jsonl", tmp);
    read_losses(path, got, 3);
    for (int s = 0; s < 3; s++)
        if (memcmp(&ref[s], &got[s], sizeof(double)))
            fail_msg("2 ranks, grads and params on disk, step %d: loss %.17g, %.17g without", s + 1, got[s], ref[s]);
    /* Its disk traffic was the grads' and params' too: a step wrote more
     * than the rank's optimizer state (all it writes with state alone). */
    double most = 0;
    for (const char *at = td_proc_slurp(path); (at = strstr(at, "\"disk_write_bytes\":")); at++) {
        double w = atof(at + strlen("\"disk_write_bytes\":"));
        if (w > most) most = w;
    }
    if (most < 1.25 * state_bytes)
        fail_msg("a step wrote at most %.0f bytes to disk, the optimizer state alone is %.0f", most, state_bytes);
    for (const char *f = "model.safetensors"; f; f = strcmp(f, "model.safetensors") ? NULL : "train_state.safetensors") {
        snprintf(a, sizeof a, "%s/w.ck/%s", tmp, f);
        snprintf(b, sizeof b, "%s/wd.ck/%s", tmp, f);
        rc = sh(out, sizeof out, "cmp %s %s", a, b);
        if (rc) fail_msg("the checkpoints' %s differ with grads and params on disk: %s", f, out);
    }
    assert_int_equal(count_files(disk), 0);
}

/* Starts a long run in the background with its --log; waits until it has
 * logged a step. */
static pid_t start_long_run(const char *out_file, const char *log, size_t ram)
{
    pid_t pid = td_proc_start(out_file, -1, 0, 0, "%s train --data %s/ok.tok " MODEL " --steps 100000 --log %s "
                              "--offload-dir %s --host-ram %zu --max-bad-steps 100000", tidal, tmp, log, disk, ram);
    assert_true(pid > 0);
    double t0 = td_proc_now_s();
    while (td_proc_now_s() - t0 < 60) {
        struct stat sb;
        if (stat(log, &sb) == 0 && sb.st_size > 0) return pid;
        usleep(20000);
    }
    kill(pid, SIGKILL);
    fail_msg("the run logged no step in a minute: %s", td_proc_slurp(out_file));
    return pid;
}

static void test_train_signals_and_leftovers(void **state)
{
    size_t host, pstate;
    host_figures(&host, &pstate);
    size_t ram = host - pstate / 2;
    char out_file[400], log[400], out[1 << 15];
    snprintf(out_file, sizeof out_file, "%s/run.out", tmp);
    snprintf(log, sizeof log, "%s/run.jsonl", tmp);
    /* SIGTERM: stops at the step's end, exits 143, nothing left.  Before
     * that, a second run in the same directory beside it: it trains, and
     * leaves the first run's lock (and run) alone. */
    pid_t pid = start_long_run(out_file, log, ram);
    assert_int_equal(count_files(disk), 1); /* its lock file while it runs */
    int rc0 = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps 2 --offload-dir %s --host-ram %zu", tidal,
                 tmp, disk, ram);
    if (rc0) fail_msg("a second run in the same directory: %s", out);
    assert_null(strstr(out, "removed"));
    assert_int_equal(count_files(disk), 1);
    assert_int_equal(kill(pid, 0), 0); /* the first still runs */
    kill(pid, SIGTERM);
    assert_int_equal(td_proc_finish(pid, 60, "a run stopped by SIGTERM"), 143);
    assert_int_equal(count_files(disk), 0);
    /* Two SIGINTs (Ctrl-C twice) at once: the second acts at once (or the
     * two arrive as one: the first's stop), exit 130 either way, still
     * nothing left. */
    unlink(log);
    pid = start_long_run(out_file, log, ram);
    kill(pid, SIGINT);
    kill(pid, SIGINT);
    int rc = td_proc_finish(pid, 60, "a run stopped by two SIGINTs");
    assert_int_equal(rc, 130);
    assert_int_equal(count_files(disk), 0);
    /* SIGKILL leaves its lock file; the next run removes it and says so. */
    unlink(log);
    pid = start_long_run(out_file, log, ram);
    kill(pid, SIGKILL);
    td_proc_finish(pid, 60, "a killed run");
    assert_int_equal(count_files(disk), 1);
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps 2 --offload-dir %s --host-ram %zu", tidal, tmp,
            disk, ram);
    if (rc) fail_msg("%s", out);
    char mark[64];
    snprintf(mark, sizeof mark, "scratch lock of pid %d", (int)pid);
    if (!strstr(out, mark)) fail_msg("the next run did not say it reclaimed pid %d's lock: %s", (int)pid, out);
    assert_int_equal(count_files(disk), 0);
    /* Not a directory, or the same one twice: usage-like errors, named. */
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps 1 --offload-dir %s/nope --host-ram %zu", tidal,
            tmp, tmp, ram);
    assert_int_equal(rc, 1);
    assert_non_null(strstr(out, "nope"));
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps 1 --offload-dir %s --offload-dir %s/ "
            "--host-ram %zu", tidal, tmp, disk, disk, ram);
    assert_int_equal(rc, 1);
    assert_non_null(strstr(out, "same directory"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bench_disk),
        cmocka_unit_test(test_plan_disk),
        cmocka_unit_test(test_plan_largest_counts_disk),
        cmocka_unit_test(test_train_equal_and_clean),
        cmocka_unit_test(test_train_two_ranks),
        cmocka_unit_test(test_train_two_ranks_params_and_grads),
        cmocka_unit_test(test_train_signals_and_leftovers),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
