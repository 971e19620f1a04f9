/* The `tidal` command on bad input: a clear message, a non-zero exit, and
 * nothing lost (a previous checkpoint stays loadable).  Runs the command of
 * the same build (env TIDAL, else ./build/tidal or ./build-san/tidal). */
#include <stdarg.h>
#include "td_test.h"

#include <cjson/cJSON.h>
#include <math.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static char tidal[512], tmp[64];

/* Runs a shell command line, returns its exit status and its stderr+stdout. */
static int sh(char *out, size_t out_bytes, const char *fmt, ...)
{
    char cmd[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    char full[2200];
    snprintf(full, sizeof full, "%s 2>&1", cmd);
    FILE *p = popen(full, "r");
    assert_non_null(p);
    size_t n = fread(out, 1, out_bytes - 1, p);
    out[n] = '\0';
    int rc = pclose(p);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
}

static int setup(void **state)
{
    snprintf(tidal, sizeof tidal, "%s", td_test_tidal());
    snprintf(tmp, sizeof tmp, "/tmp/tidal-cli-XXXXXX");
    if (!mkdtemp(tmp)) return -1;
    char out[4096];
    /* A small corpus and token file for the cases below. */
    int rc = sh(out, sizeof out, "head -c 200000 /usr/share/games/fortunes/fortunes > %s/text && %s prepare --quiet "
                "--input %s/text --out %s/ok.tok", tmp, tidal, tmp, tmp);
    return rc;
}

static int teardown(void **state)
{
    char out[256];
    sh(out, sizeof out, "rm -rf %s", tmp);
    return 0;
}

#define MODEL "--layers 1 --width 32 --heads 2 --seq 32 --micro-batch 2 --backend cpu"

static void test_bad_token_files(void **state)
{
    char out[8192];
    int rc = sh(out, sizeof out, "%s train --data %s/missing.tok " MODEL " --steps 1", tidal, tmp);
    assert_int_not_equal(rc, 0);
    assert_non_null(strstr(out, "missing.tok"));
    rc = sh(out, sizeof out, "head -c 1000 %s/ok.tok > %s/trunc.tok; %s train --data %s/trunc.tok " MODEL " --steps 1",
            tmp, tmp, tidal, tmp);
    assert_int_not_equal(rc, 0);
    assert_non_null(strstr(out, "trunc.tok"));
    rc = sh(out, sizeof out, "cp %s/ok.tok %s/bad.tok; printf 'XX' | dd of=%s/bad.tok bs=1 seek=5000 conv=notrunc "
            "status=none; %s train --data %s/bad.tok " MODEL " --steps 1", tmp, tmp, tmp, tidal, tmp);
    assert_int_not_equal(rc, 0);
    assert_non_null(strstr(out, "bad.tok"));
    rc = sh(out, sizeof out, "%s train --data %s/text " MODEL " --steps 1", tidal, tmp); /* text, not tokens */
    assert_int_not_equal(rc, 0);
}

static void test_bad_flags(void **state)
{
    char out[32768]; /* the whole of train --help */
    assert_int_equal(sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps abc", tidal, tmp), 2);
    assert_non_null(strstr(out, "--steps"));
    assert_int_equal(sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --gpu-budget 12XB", tidal, tmp), 2);
    assert_non_null(strstr(out, "unknown unit"));
    assert_int_equal(sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --policy fast", tidal, tmp), 2);
    assert_non_null(strstr(out, "cuda, cpu, static or auto"));
    assert_int_equal(sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --heads 5", tidal, tmp), 2);
    assert_int_equal(sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --frobnicate", tidal, tmp), 2);
    assert_non_null(strstr(out, "unknown option '--frobnicate'"));
    assert_int_equal(sh(out, sizeof out, "%s train --help", tidal), 0);
    assert_non_null(strstr(out, "--gpu-budget"));
}

static void test_budget_too_small_names_minimum(void **state)
{
    char out[8192];
    int rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps 1 --gpu-budget 64KiB", tidal, tmp);
    assert_int_not_equal(rc, 0);
    assert_non_null(strstr(out, "is below the minimum of"));
    /* tidal plan says the same before a run, exit 3. */
    rc = sh(out, sizeof out, "%s plan --no-measure --data %s/ok.tok " MODEL " --gpu-budget 64KiB", tidal, tmp);
    assert_int_equal(rc, 3);
    assert_non_null(strstr(out, "DOES NOT FIT"));
    assert_non_null(strstr(out, "needs --gpu-budget of at least"));
    rc = sh(out, sizeof out, "%s plan --no-measure --data %s/ok.tok " MODEL " --host-pin-limit 10KiB", tidal, tmp);
    assert_int_equal(rc, 3);
}

/* "57.18 MiB" as printed by td_format_bytes. */
static double approx_bytes(const char *s)
{
    char *end;
    double v = strtod(s, &end);
    while (*end == ' ') end++;
    static const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    for (int k = 0; k < 5; k++, v *= 1024)
        if (!strncmp(end, units[k], strlen(units[k])) && (end[strlen(units[k])] == 0 || end[strlen(units[k])] == ' '))
            return v;
    fail_msg("cannot read the size '%s'", s);
    return 0;
}

/* The host side from the command: bad --host-ram and --optim-state values
 * get clear errors; `tidal plan --json` gives host.pinned_bytes and
 * host.pageable_bytes; a run at --host-pin-limit = host.pinned_bytes trains
 * (its log has the host footprint per step, its end "host: planned X, peak
 * Y" with Y within X), one byte less is refused before the first step
 * naming the limit; the --config key works as the flag; --largest answers
 * for every state type. */
static void test_host_plan_and_limits(void **state)
{
    char out[16384];
    /* --policy cpu: the CPU AdamW owns every optimizer chunk, so its state is pageable */
    const char *model = "--layers 2 --width 64 --heads 2 --seq 32 --micro-batch 2 --backend cpu --gpu-budget 6MiB "
                        "--policy cpu";
    assert_int_equal(sh(out, sizeof out, "%s plan %s --host-ram 12QB", tidal, model), 2);
    assert_non_null(strstr(out, "--host-ram"));
    assert_int_equal(sh(out, sizeof out, "%s plan %s --host-ram 0", tidal, model), 2);
    assert_non_null(strstr(out, "--host-ram"));
    assert_int_equal(sh(out, sizeof out, "%s train --data %s/ok.tok %s --optim-state fp8", tidal, tmp, model), 2);
    assert_non_null(strstr(out, "--optim-state"));
    assert_non_null(strstr(out, "fp8"));
    assert_int_equal(sh(out, sizeof out, "%s train --data %s/ok.tok %s --optim-state int8 --steps 2", tidal, tmp, model), 0);
    assert_non_null(strstr(out, "--optim-state int8"));
    /* where the CPU AdamW runs: its threads, the NUMA node and cores they are bound to */
    const char *cores = strstr(out, "tidal train: CPU AdamW: ");
    assert_non_null(cores);
    assert_non_null(strstr(cores, "NUMA node"));
    /* A host too small for the plan: the plan says so (exit 3) and names the RAM figure. */
    assert_int_equal(sh(out, sizeof out, "%s plan --no-measure %s --host-ram 8MiB", tidal, model), 3);
    assert_non_null(strstr(out, "--host-ram 8.00 MiB"));
    assert_int_equal(sh(out, sizeof out, "%s plan --no-measure --data %s/ok.tok %s --json", tidal, tmp, model), 0);
    cJSON *j = cJSON_Parse(strchr(out, '{'));
    assert_non_null(j);
    size_t pinned = (size_t)td_test_json_num(j, "host", "pinned_bytes"), pageable = (size_t)td_test_json_num(j, "host", "pageable_bytes");
    size_t total = (size_t)td_test_json_num(j, "host", "total_bytes");
    assert_true(pinned > 0 && pageable > 0 && total == pinned + pageable);
    assert_true(td_test_json_num(j, "host", "pinned_bytes_per_param") >= 8.0); /* fp32 params + grads on the cpu backend */
    assert_non_null(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "host"), "ram_source"));
    cJSON_Delete(j);
    int rc = sh(out, sizeof out, "%s train --data %s/ok.tok %s --steps 2 --host-pin-limit %zu", tidal, tmp, model,
                pinned - 1);
    assert_int_equal(rc, 1);
    char want[64];
    snprintf(want, sizeof want, "%zu bytes", pinned - 1);
    assert_non_null(strstr(out, want));
    assert_null(strstr(out, "step 1/"));
    rc = sh(out, sizeof out, "printf '{\"host-pin-limit\": \"%zu\", \"optim-state\": \"fp32\"}' > %s/h.json && "
            "%s train --data %s/ok.tok %s --steps 2 --config %s/h.json --log %s/h.log", pinned, tmp, tidal, tmp, model,
            tmp, tmp);
    if (rc != 0) fail_msg("%s", out);
    char *host = strstr(out, "host: planned ");
    assert_non_null(host);
    char planned[32], peak[32];
    assert_int_equal(sscanf(host, "host: planned %31[^,], peak %31[^(]", planned, peak), 2);
    assert_true(approx_bytes(peak) <= approx_bytes(planned));
    assert_int_equal(sh(out, sizeof out, "tail -n 1 %s/h.log", tmp), 0);
    j = cJSON_Parse(out);
    assert_non_null(j);
    assert_int_equal((size_t)td_test_json_num(j, "host", "pinned_bytes"), pinned);
    assert_true(td_test_json_num(j, "host", "heap_allocated_bytes") > 0 && td_test_json_num(j, "host", "pageable_bytes") > 0);
    assert_true(td_test_json_num(j, "host", "peak_bytes") <= (double)total);
    cJSON_Delete(j);
    /* --largest: a line per state type, the compact ones fitting more layers. */
    rc = sh(out, sizeof out, "%s plan --no-measure --layers 2 --width 64 --heads 2 --seq 32 --micro-batch 2 --backend cpu "
            "--gpu-budget 64MiB --host-ram 1GiB --largest --json", tidal);
    assert_int_equal(rc, 0);
    j = cJSON_Parse(strchr(out, '{'));
    assert_non_null(j);
    cJSON *l = cJSON_GetObjectItem(j, "largest");
    assert_int_equal(cJSON_GetArraySize(l), 3);
    double layers[3];
    for (int k = 0; k < 3; k++) layers[k] = td_test_json_num(cJSON_GetArrayItem(l, k), "layers", NULL);
    assert_true(layers[0] > 0 && layers[1] >= layers[0] && layers[2] >= layers[1]);
    cJSON_Delete(j);
}

/* `tidal plan --layout` prints the layout the run lays out: the grads
 * staged (no host copy) where the plan made them transient, and the
 * optimizer chunks homed as the plan places them (the GPU AdamW's on the
 * device, pinned; the CPU AdamW's on the host, pageable). */
static void test_plan_layout_as_the_run(void **state)
{
    char out[16384];
    const char *model = "--layers 6 --width 64 --heads 2 --seq 32 --micro-batch 2 --backend cpu --gpu-budget 8MiB "
                        "--clip-grad-norm 0 --grad-slots 8";
    const char *grep = "grep -cE '^ *chunk +[0-9]+ +%s .* %s +home %s '";
    char g[128];
    for (int on = 0; on < 2; on++) {
        snprintf(g, sizeof g, grep, "grad", "staged", "host");
        assert_int_equal(sh(out, sizeof out, "%s plan --no-measure --data %s/ok.tok %s --policy cpu --adam-thread %s --layout | %s",
                            tidal, tmp, model, on ? "on" : "off", g), on ? 0 : 1); /* grep's status: found or not */
        if (on && atoi(out) < 1) fail_msg("no staged grad chunk in the layout: %s", out);
    }
    /* all of the optimizer on the GPU (a budget with room), then none */
    for (int cpu = 0; cpu < 2; cpu++) {
        snprintf(g, sizeof g, grep, "adam_m", cpu ? "pageable" : "pinned  ", cpu ? "host" : "device");
        int rc = sh(out, sizeof out, "%s plan --no-measure --data %s/ok.tok --layers 2 --width 64 --heads 2 --seq 32 "
                    "--micro-batch 2 --backend cpu --gpu-budget 512MiB --policy %s --layout | %s", tidal, tmp,
                    cpu ? "cpu" : "cuda", g);
        if (rc || atoi(out) < 1) fail_msg("policy %s: no adam_m chunk homed as placed: %s", cpu ? "cpu" : "cuda", out);
    }
}

/* --adam-thread: a bad value is refused naming the flag; `on` with nothing
 * between the grads and the update (no clipping, no accumulation) makes the
 * grads transient under --grad-slots N (`tidal plan --json`:
 * host.grad_slots, fewer pinned bytes a param; --grad-slots 0 keeps a copy
 * each, a count below -1 is refused), the banner says so, and the run
 * trains through a --config file too, with the losses of the run without
 * it. */
static void test_adam_thread_flag(void **state)
{
    char out[16384];
    const char *model = "--layers 6 --width 64 --heads 2 --seq 32 --micro-batch 2 --backend cpu --gpu-budget 8MiB "
                        "--policy cpu --clip-grad-norm 0 --grad-slots 8";
    assert_int_equal(sh(out, sizeof out, "%s train --data %s/ok.tok %s --adam-thread sometimes", tidal, tmp, model), 2);
    assert_non_null(strstr(out, "--adam-thread 'sometimes': use on, off or auto"));
    assert_int_equal(sh(out, sizeof out, "%s plan --data %s/ok.tok %s --grad-slots -2", tidal, tmp, model), 2);
    assert_non_null(strstr(out, "--grad-slots -2: use -1 (auto), 0 or a count"));
    assert_int_equal(sh(out, sizeof out, "%s plan --data %s/ok.tok %s --clip-grad-norm 1", tidal, tmp, model), 2);
    assert_non_null(strstr(out, "--grad-slots 8: staging slots need grads that are read once as they land"));
    assert_int_equal(sh(out, sizeof out, "%s plan --no-measure --data %s/ok.tok %s --adam-thread on --grad-slots 0 --json", tidal,
                        tmp, model), 0);
    cJSON *j0 = cJSON_Parse(strchr(out, '{'));
    assert_non_null(j0);
    assert_int_equal((int)td_test_json_num(j0, "host", "grad_slots"), 0);
    cJSON_Delete(j0);
    double pp[2];
    for (int on = 0; on < 2; on++) {
        assert_int_equal(sh(out, sizeof out, "%s plan --no-measure --data %s/ok.tok %s --adam-thread %s --json", tidal, tmp, model,
                            on ? "on" : "off"), 0);
        cJSON *j = cJSON_Parse(strchr(out, '{'));
        assert_non_null(j);
        assert_true(on ? td_test_json_num(j, "host", "grad_slots") > 0 : td_test_json_num(j, "host", "grad_slots") == 0);
        pp[on] = td_test_json_num(j, "host", "pinned_bytes_per_param");
        cJSON_Delete(j);
    }
    assert_true(pp[1] < pp[0] - 2.0); /* fp32 grads: 4 bytes a param fewer, less the slots */
    double loss[2];
    for (int on = 0; on < 2; on++) {
        int rc = sh(out, sizeof out, "printf '{\"adam-thread\": \"%s\", \"steps\": 4}' > %s/a.json && %s train --data "
                    "%s/ok.tok %s --config %s/a.json --log %s/a%d.log", on ? "on" : "off", tmp, tidal, tmp, model, tmp,
                    tmp, on);
        if (rc) fail_msg("%s", out);
        if (on) assert_non_null(strstr(out, "thread of its own (--adam-thread), grads transient"));
        else assert_null(strstr(out, "--adam-thread"));
        assert_int_equal(sh(out, sizeof out, "tail -n 1 %s/a%d.log", tmp, on), 0);
        cJSON *j = cJSON_Parse(out);
        assert_non_null(j);
        loss[on] = td_test_json_num(j, "loss", NULL);
        cJSON_Delete(j);
    }
    assert_true(loss[0] == loss[1]);
    /* The run ends with every step's updates done: the timeline holds an
     * AdamW span per chunk and step, the last step's included. */
    int rc = sh(out, sizeof out, "%s train --data %s/ok.tok %s --adam-thread on --steps 3 --trace-timeline %s/t.json "
                "2>&1 | sed -n 's/.*AdamW on the host for all \\([0-9]*\\) param chunks.*/chunks \\1/p'; "
                "echo spans $(grep -o '\"name\":\"AdamW chunk [0-9]*\"' %s/t.json | wc -l)", tidal, tmp, model,
                tmp, tmp);
    assert_int_equal(rc, 0);
    int chunks = 0, spans = -1;
    const char *c = strstr(out, "chunks "), *sp = strstr(out, "spans ");
    assert_non_null(c);
    assert_non_null(sp);
    chunks = atoi(c + 7);
    spans = atoi(sp + 6);
    assert_true(chunks > 1);
    assert_int_equal(spans, 3 * chunks);
}

/* tidal plan --json: the recomputed blocks --ckpt asks for, and the AdamW
 * term from its measured rate (the parameters over it). */
static void test_plan_json(void **state)
{
    char out[8192];
    const char *model = "--layers 3 --width 32 --heads 2 --seq 32 --micro-batch 2 --backend cpu --vocab 64";
    int rc = sh(out, sizeof out, "%s plan %s --ckpt 2 --gpu-budget 64MiB --json", tidal, model);
    assert_int_equal(rc, 0);
    cJSON *j = cJSON_Parse(strchr(out, '{'));
    assert_non_null(j);
    assert_int_equal((int)td_test_json_num(j, "ckpt_blocks", NULL), 2);
    assert_true(cJSON_IsTrue(cJSON_GetObjectItem(j, "checkpointing")));
    /* 64 MiB holds the whole state: every optimizer chunk on the device,
     * nothing for the CPU AdamW. */
    assert_int_equal((int)td_test_json_num(j, "optimizer", "gpu_chunks"), (int)td_test_json_num(j, "optimizer", "chunks"));
    assert_true(td_test_json_num(j, "optimizer", "cpu_params") == 0 && td_test_json_num(j, "estimate", "adam_ms") == 0);
    cJSON_Delete(j);
    /* --policy cpu: every param through the CPU AdamW at the measured rate,
     * which is the measured DRAM bandwidth over 28 bytes a param. */
    rc = sh(out, sizeof out, "%s plan %s --ckpt 2 --gpu-budget 64MiB --policy cpu --json", tidal, model);
    assert_int_equal(rc, 0);
    j = cJSON_Parse(strchr(out, '{'));
    assert_non_null(j);
    double rate = td_test_json_num(j, "measured", "adam_gparams_per_s"), params = td_test_json_num(j, "params", NULL);
    assert_true(rate > 0);
    assert_int_equal((int)td_test_json_num(j, "optimizer", "gpu_chunks"), 0);
    assert_true(td_test_json_num(j, "optimizer", "cpu_params") == params);
    assert_true(fabs(td_test_json_num(j, "measured", "dram_gbytes_per_s") / 28.0 - rate) <= 0.002 + 0.01 * rate);
    /* the rate is the probe's median pass, at the run's scale (this model's
     * params are below the probe's 64 Mi floor) */
    assert_true(td_test_json_num(j, "measured", "dram_fastest_gbytes_per_s") >=
                td_test_json_num(j, "measured", "dram_gbytes_per_s") - 0.01);
    assert_true(td_test_json_num(j, "measured", "adam_probe_params") == 67108864.0); /* 64 Mi: TD_TRAIN_ADAM_PROBE_PARAMS */
    double want = params / (rate * 1e9) * 1e3, got = td_test_json_num(j, "estimate", "adam_ms");
    assert_true(fabs(got - want) <= 0.01 * want + 0.006); /* printed to 0.01 ms, the rate to 0.001 */
    /* Host DRAM: the AdamW's bytes and the step's copies' at the rate the
     * AdamW and the copies reached together; the bound is the largest term. */
    double loaded = td_test_json_num(j, "measured", "dram_loaded_gbytes_per_s");
    assert_true(loaded > 0);
    double moved = params * 28.0 + td_test_json_num(j, "estimate", "h2d_bytes") + td_test_json_num(j, "estimate", "d2h_bytes");
    assert_true(td_test_json_num(j, "estimate", "h2d_bytes") > 0 && td_test_json_num(j, "estimate", "d2h_bytes") > 0);
    want = moved / (loaded * 1e9) * 1e3;
    got = td_test_json_num(j, "estimate", "dram_ms");
    assert_true(fabs(got - want) <= 0.01 * want + 0.006);
    double bound = td_test_json_num(j, "estimate", "step_lower_bound_ms"), most = 0;
    const char *terms[] = {"compute_ms", "pcie_ms", "adam_ms", "dram_ms"};
    for (int i = 0; i < 4; i++) most = fmax(most, td_test_json_num(j, "estimate", terms[i]));
    assert_true(fabs(bound - most) <= 0.006);
    /* The block's times are measured on the cpu backend too, the
     * recompute's (the forward without its last projection) beside them:
     * positive, and sane for this block (well under a second). */
    const char *times[] = {"block_forward_ms", "block_backward_ms", "block_recompute_ms"};
    for (int i = 0; i < 3; i++) {
        double ms = td_test_json_num(j, "measured", times[i]);
        if (!(ms > 0 && ms < 1e3)) fail_msg("%s %g: not a time of this block", times[i], ms);
    }
    double min_bytes = td_test_json_num(j, "device", "min_bytes");
    cJSON_Delete(j);
    /* --no-measure: the same footprint, nothing timed, no estimate */
    rc = sh(out, sizeof out, "%s plan %s --ckpt 2 --gpu-budget 64MiB --policy cpu --json --no-measure", tidal, model);
    assert_int_equal(rc, 0);
    j = cJSON_Parse(strchr(out, '{'));
    assert_non_null(j);
    assert_true(td_test_json_num(j, "device", "min_bytes") == min_bytes);
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(j, "measured")) && cJSON_IsNull(cJSON_GetObjectItem(j, "estimate")));
    cJSON_Delete(j);
    rc = sh(out, sizeof out, "%s plan %s --ckpt 4 --json", tidal, model);
    assert_int_equal(rc, 2);
    assert_non_null(strstr(out, "a block count in [0, 3]"));
    rc = sh(out, sizeof out, "%s plan --no-measure %s --ckpt 0", tidal, model);
    assert_int_equal(rc, 0);
    assert_non_null(strstr(out, "checkpointing off"));
}

/* tidal tune on bad input: a clear error before any run. */
static void test_tune_bad_input(void **state)
{
    char out[8192];
    static const struct { const char *args, *want; } cases[] = {
        {"--sweep-budget 1MiB,,2MiB", "item 2 is empty"},
        {"--sweep-budget 1MiB,lots", "item 2 ('lots') is not a size"},
        {"--sweep-budget ''", "--sweep-budget is empty"},
        {"--sweep-budget 2MiB,2MiB", "given twice"},
        {"--sweep-budget 2MiB,100", "--sweep-budget '2MiB,100': --gpu-budget 100 bytes is below the arena's least"},
        {"--gpu-budget 2MiB --sweep-budget 2MiB,4MiB", "not both"},
        {"--gpu-budget 2MiB --write-config /nonexistent-dir/w.json", "--write-config /nonexistent-dir/w.json: cannot create"},
        {"--sweep-budget 2MiB,4MiB --plot /nonexistent-dir/p.svg", "--plot /nonexistent-dir/p.svg: cannot create"},
        {"--sweep-budget 2MiB,4MiB --write-config w.json", "one budget"},
        {"--gpu-budget 2MiB --top 0", "--top '0'"},
        {"--gpu-budget 2MiB --steps 1", "at least 2"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int rc = sh(out, sizeof out, "%s tune --data %s/ok.tok " MODEL " %s", tidal, tmp, cases[i].args);
        if (!strstr(out, cases[i].want)) fprintf(stderr, "case %zu: %s\n", i, out);
        assert_int_equal(rc, 2);
        assert_non_null(strstr(out, cases[i].want));
        assert_null(strstr(out, "running the best")); /* refused before any run */
    }
    int rc = sh(out, sizeof out, "%s tune " MODEL " --gpu-budget 2MiB", tidal);
    assert_int_equal(rc, 2);
    assert_non_null(strstr(out, "--data FILE is required"));
}

/* tidal tune's winner, written with --write-config, trains with tidal train
 * --config within its budget; every run tune made stayed within it too. */
static void test_tune_config_trains_within_budget(void **state)
{
    static char out[1 << 16];
    size_t budget = 2 << 20;
    int rc = sh(out, sizeof out, "%s tune --data %s/ok.tok " MODEL " --gpu-budget %zu --steps 2 --top 2 "
                "--write-config %s/w.json --json 2>/dev/null", tidal, tmp, budget, tmp);
    assert_int_equal(rc, 0);
    cJSON *j = cJSON_Parse(strchr(out, '{'));
    assert_non_null(j);
    cJSON *b0 = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "budgets"), 0);
    assert_non_null(b0);
    assert_true(td_test_json_num(b0, "budget_bytes", NULL) == (double)budget);
    assert_true(td_test_json_num(b0, "candidates", NULL) > 4);
    cJSON *run;
    int runs = 0, depth_seen[3] = {0};
    cJSON_ArrayForEach(run, cJSON_GetObjectItem(b0, "runs")) {
        runs++;
        int pf = (int)td_test_json_num(run, "prefetch", NULL);
        depth_seen[0] += pf == 2, depth_seen[1] += pf == 8, depth_seen[2] += pf == 16;
        if (!cJSON_IsTrue(cJSON_GetObjectItem(run, "ran"))) continue;
        assert_true(td_test_json_num(run, "device_peak_bytes", NULL) <= (double)budget);
        assert_true(td_test_json_num(run, "tokens_per_s", NULL) > 0 && td_test_json_num(run, "bound_tokens_per_s", NULL) > 0);
        /* The tokens a step stay those asked (micro-batch 2). */
        assert_int_equal((int)(td_test_json_num(run, "micro_batch", NULL) * td_test_json_num(run, "grad_accum", NULL)), 2);
    }
    assert_int_equal(runs, 5); /* the best 2 (auto prefetch), then the winner at prefetch 2, 8 and 16 */
    for (int d = 0; d < 3; d++) assert_int_equal(depth_seen[d], 1);
    double best = td_test_json_num(cJSON_GetObjectItem(b0, "winner"), "tokens_per_s", NULL);
    cJSON_ArrayForEach(run, cJSON_GetObjectItem(b0, "runs"))
        if (cJSON_IsTrue(cJSON_GetObjectItem(run, "ran"))) assert_true(td_test_json_num(run, "tokens_per_s", NULL) <= best);
    cJSON_Delete(j);
    rc = sh(out, sizeof out, "%s train --config %s/w.json --steps 2 --log %s/w.log", tidal, tmp, tmp);
    assert_int_equal(rc, 0);
    assert_non_null(strstr(out, "budget 2.00 MiB"));
    rc = sh(out, sizeof out, "tail -n 1 %s/w.log", tmp);
    j = cJSON_Parse(out);
    assert_non_null(j);
    assert_true(td_test_json_num(j, "device_peak_bytes", NULL) <= (double)budget);
    cJSON_Delete(j);
}

/* Minimal XML well-formedness: every element closed in order, quotes
 * balanced; counts the elements named `count_name`. */
static int svg_well_formed(const char *s, const char *count_name, int *count)
{
    char stack[64][32];
    int depth = 0, roots = 0;
    *count = 0;
    while ((s = strchr(s, '<'))) {
        if (s[1] == '?') {
            if (!(s = strstr(s, "?>"))) return 0;
            continue;
        }
        int closing = s[1] == '/';
        const char *name = s + 1 + closing;
        size_t len = strcspn(name, " \t\n/>");
        if (!len || len >= 32) return 0;
        const char *p = name + len;
        int quoted = 0;
        for (; *p && (quoted || *p != '>'); p++)
            if (*p == '"') quoted = !quoted;
        if (*p != '>') return 0;
        int self = p[-1] == '/';
        if (closing) {
            if (!depth || strncmp(stack[depth - 1], name, len) || stack[depth - 1][len]) return 0;
            depth--;
        } else {
            if (!strncmp(name, count_name, len) && !count_name[len]) (*count)++;
            if (!depth) roots++;
            if (!self) {
                if (depth == 64) return 0;
                memcpy(stack[depth], name, len);
                stack[depth++][len] = '\0';
            }
        }
        s = p + 1;
    }
    return depth == 0 && roots == 1;
}

/* tidal tune --sweep-budget --plot: one point per budget in a well-formed
 * SVG with its axes labelled; the budgets in the JSON, ascending. */
static void test_tune_sweep_plot(void **state)
{
    static char out[1 << 16];
    int rc = sh(out, sizeof out, "%s tune --data %s/ok.tok " MODEL " --sweep-budget 4MiB,1536KiB,2MiB --steps 2 "
                "--top 1 --plot %s/p.svg --json 2>/dev/null", tidal, tmp, tmp);
    assert_int_equal(rc, 0);
    cJSON *j = cJSON_Parse(strchr(out, '{'));
    assert_non_null(j);
    cJSON *bs = cJSON_GetObjectItem(j, "budgets");
    assert_int_equal(cJSON_GetArraySize(bs), 3);
    assert_true(td_test_json_num(cJSON_GetArrayItem(bs, 0), "budget_bytes", NULL) == 1536.0 * 1024);
    assert_true(td_test_json_num(cJSON_GetArrayItem(bs, 2), "budget_bytes", NULL) == 4.0 * 1024 * 1024);
    cJSON_Delete(j);
    /* Each larger budget also runs the fastest of the smaller ones' winners
     * (planned at its budget) when its ranking leaves it out: one run more
     * at most, and among its runs one with that winner's micro-batch,
     * accumulation and recomputed blocks.  At 6 MiB a few recomputing
     * splits fit; at 48 MiB the ranking's best keeps everything on the
     * device, so the carried winner runs beside it there at least. */
    rc = sh(out, sizeof out, "%s tune --data %s/ok.tok --layers 4 --width 128 --heads 4 --seq 64 --micro-batch 8 "
            "--backend cpu --sweep-budget 6MiB,12MiB,48MiB --steps 2 --top 1 --json 2>/dev/null", tidal, tmp);
    assert_int_equal(rc, 0);
    j = cJSON_Parse(strchr(out, '{'));
    assert_non_null(j);
    bs = cJSON_GetObjectItem(j, "budgets");
    cJSON *carry = NULL;
    int carried = 0;
    for (int i = 0; i < 3; i++) {
        cJSON *e = cJSON_GetArrayItem(bs, i), *runs = cJSON_GetObjectItem(e, "runs");
        int n = cJSON_GetArraySize(runs), found = carry == NULL;
        assert_true(n >= 1 && n <= 2);
        for (int k = 0; k < n && !found; k++) {
            cJSON *r = cJSON_GetArrayItem(runs, k);
            found = td_test_json_num(r, "micro_batch", NULL) == td_test_json_num(carry, "micro_batch", NULL) &&
                    td_test_json_num(r, "grad_accum", NULL) == td_test_json_num(carry, "grad_accum", NULL) &&
                    td_test_json_num(r, "ckpt_blocks", NULL) == td_test_json_num(carry, "ckpt_blocks", NULL);
        }
        if (!found) fail_msg("budget %d of 3: no run of the smaller budgets' winner", i + 1);
        assert_true(n == 1 || carry != NULL); /* the smallest budget: the best --top 1 alone */
        carried += n == 2;
        cJSON *w = cJSON_GetObjectItem(e, "winner");
        if (w && cJSON_IsObject(w) && (!carry || td_test_json_num(w, "tokens_per_s", NULL) >
                                                     td_test_json_num(carry, "tokens_per_s", NULL)))
            carry = w;
    }
    assert_true(carried >= 1);
    cJSON_Delete(j);
    rc = sh(out, sizeof out, "cat %s/p.svg", tmp);
    assert_int_equal(rc, 0);
    assert_non_null(strstr(out, "<svg"));
    int circles = 0;
    assert_true(svg_well_formed(out, "circle", &circles));
    assert_int_equal(circles, 3);
    assert_non_null(strstr(out, "device budget (MiB)"));
    assert_non_null(strstr(out, "tokens/s"));
    assert_non_null(strstr(out, "<polyline"));
    /* The checker itself: a broken document fails it. */
    assert_false(svg_well_formed("<svg><circle r=\"1\"></svg>", "circle", &circles));
    /* The text output: tokens/s against the budget, one line each. */
    rc = sh(out, sizeof out, "%s tune --data %s/ok.tok " MODEL " --sweep-budget 1536KiB,2MiB --steps 2 --top 1",
            tidal, tmp);
    assert_int_equal(rc, 0);
    assert_non_null(strstr(out, "tokens/s against the device budget"));
    assert_non_null(strstr(out, "bound/step"));
}

static void test_checkpoint_survives_bad_resume_and_corruption(void **state)
{
    char out[8192];
    int rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps 3 --save %s/ck", tidal, tmp, tmp);
    assert_int_equal(rc, 0);
    /* A corrupt weights file: a clear error naming the file; nothing written. */
    rc = sh(out, sizeof out, "cp -r %s/ck %s/ck2; printf 'garbage!' | dd of=%s/ck2/model.safetensors bs=1 seek=0 "
            "conv=notrunc status=none; %s eval --checkpoint %s/ck2 --data %s/ok.tok --seq 32", tmp, tmp, tmp, tidal,
            tmp, tmp);
    assert_int_not_equal(rc, 0);
    assert_non_null(strstr(out, "model.safetensors"));
    /* Resuming with a different shape is refused; the checkpoint still loads. */
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok --resume %s/ck --width 64 --steps 4", tidal, tmp, tmp);
    assert_int_equal(rc, 2);
    rc = sh(out, sizeof out, "%s eval --checkpoint %s/ck --data %s/ok.tok --seq 32 --batches 2", tidal, tmp, tmp);
    assert_int_equal(rc, 0);
    assert_non_null(strstr(out, "nats/token"));
    /* --save's missing folders are made; a file in its path is refused
     * before the first step, not after the run. */
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps 2 --save %s/new/deep/ck && "
            "test -f %s/new/deep/ck/model.safetensors", tidal, tmp, tmp, tmp);
    assert_int_equal(rc, 0);
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps 2 --save %s/ok.tok/ck", tidal, tmp, tmp);
    assert_int_equal(rc, 2);
    assert_non_null(strstr(out, "--save"));
    assert_non_null(strstr(out, "is not a folder"));
    assert_null(strstr(out, "step 1/"));
}

/* Without --gpu-budget the plan takes the run resident plus an eighth;
 * "max" takes the free memory (less a margin: none on the cpu backend). */
static void test_default_budget(void **state)
{
    char out[8192];
    const char *model = "--layers 3 --width 32 --heads 2 --seq 32 --micro-batch 2 --backend cpu --vocab 64";
    assert_int_equal(sh(out, sizeof out, "%s plan --no-measure %s --json", tidal, model), 0);
    cJSON *j = cJSON_Parse(strchr(out, '{'));
    assert_non_null(j);
    double budget = td_test_json_num(j, "device", "budget_bytes"), all = td_test_json_num(j, "device", "all_resident_bytes");
    double min = td_test_json_num(j, "device", "min_bytes");
    assert_true(budget >= all + all / 8 && budget >= min && budget < td_test_json_num(j, "device", "free_bytes"));
    cJSON_Delete(j);
    assert_int_equal(sh(out, sizeof out, "%s plan --no-measure %s --json --gpu-budget max", tidal, model), 0);
    j = cJSON_Parse(strchr(out, '{'));
    assert_non_null(j);
    assert_true(td_test_json_num(j, "device", "budget_bytes") == floor(td_test_json_num(j, "device", "free_bytes") / 256) * 256);
    cJSON_Delete(j);
    assert_int_equal(sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps 1", tidal, tmp), 0);
    assert_non_null(strstr(out, "(default: the run resident + 1/8; --gpu-budget max takes"));
    /* 0 is not the default (leaving the flag out is): a usage error naming the flag, on every command */
    const char *cmds[] = {"plan", "train", "tune", "eval"}; /* generate runs on the CPU: no budget */
    for (int k = 0; k < 4; k++) {
        assert_int_equal(sh(out, sizeof out, "%s %s --gpu-budget 0 --checkpoint %s/none", tidal, cmds[k], tmp), 2);
        assert_non_null(strstr(out, "--gpu-budget"));
        assert_non_null(strstr(out, "'0' is no budget"));
    }
    assert_int_equal(sh(out, sizeof out, "%s plan --no-measure %s --gpu-budget 0KiB", tidal, model), 2);
    assert_non_null(strstr(out, "'0KiB' is no budget"));
}

/* A checkpoint carries the tokenizer its data was made with: `tidal
 * prepare` keeps vocab.json and merges.txt beside the token file, the save
 * copies them, and generate needs no tokenizer flags. */
static void test_checkpoint_carries_its_tokenizer(void **state)
{
    char out[8192];
    int rc = sh(out, sizeof out, "%s prepare --quiet --input %s/text --out %s/bpe.tok --tokenizer gpt2 "
                "--vocab tests/data/tok/gpt2_prefix/vocab.json --merges tests/data/tok/gpt2_prefix/merges.txt",
                tidal, tmp, tmp);
    assert_int_equal(rc, 0);
    rc = sh(out, sizeof out, "cmp tests/data/tok/gpt2_prefix/merges.txt %s/bpe.tok.tokenizer/merges.txt && "
            "cmp tests/data/tok/gpt2_prefix/vocab.json %s/bpe.tok.tokenizer/vocab.json", tmp, tmp);
    assert_int_equal(rc, 0);
    rc = sh(out, sizeof out, "%s train --data %s/bpe.tok --layers 1 --width 32 --heads 2 --seq 32 --micro-batch 2 "
            "--backend cpu --steps 2 --save %s/bpeck", tidal, tmp, tmp);
    assert_int_equal(rc, 0);
    rc = sh(out, sizeof out, "cmp tests/data/tok/gpt2_prefix/vocab.json %s/bpeck/vocab.json && "
            "cmp tests/data/tok/gpt2_prefix/merges.txt %s/bpeck/merges.txt", tmp, tmp);
    assert_int_equal(rc, 0);
    rc = sh(out, sizeof out, "%s generate --checkpoint %s/bpeck --prompt 'Hello world' --tokens 5", tidal, tmp);
    assert_int_equal(rc, 0);
    assert_non_null(strstr(out, "Hello world"));
    /* Saving again over it keeps them (the files are the checkpoint's own). */
    rc = sh(out, sizeof out, "%s train --data %s/bpe.tok --layers 1 --width 32 --heads 2 --seq 32 --micro-batch 2 "
            "--backend cpu --steps 3 --resume %s/bpeck --save %s/bpeck && test -f %s/bpeck/merges.txt",
            tidal, tmp, tmp, tmp, tmp);
    assert_int_equal(rc, 0);
}

/* Re-running the first command with --resume added continues the run; a
 * shape flag that disagrees with the checkpoint is refused, naming the flag
 * and both values. */
static void test_resume_with_the_original_flags(void **state)
{
    char out[8192];
    int rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --vocab 300 --steps 2 --save %s/rk", tidal, tmp, tmp);
    assert_int_equal(rc, 0);
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --vocab 300 --steps 3 --save %s/rk --resume %s/rk",
            tidal, tmp, tmp, tmp);
    assert_int_equal(rc, 0);
    assert_non_null(strstr(out, "resumed"));
    assert_non_null(strstr(out, "step 3/3"));
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --heads 4 --steps 4 --resume %s/rk", tidal, tmp, tmp);
    assert_int_equal(rc, 2);
    assert_non_null(strstr(out, "--heads 4 differs from the checkpoint"));
    assert_non_null(strstr(out, "which has 2"));
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --vocab 512 --steps 4 --resume %s/rk", tidal, tmp, tmp);
    assert_int_equal(rc, 2);
    assert_non_null(strstr(out, "--vocab 512 differs"));
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok --model gpt2-124m --steps 4 --resume %s/rk", tidal, tmp, tmp);
    assert_int_equal(rc, 2);
    assert_non_null(strstr(out, "--model gpt2-124m (12 layers, 768 wide, 12 heads) differs"));
}

/* A --config JSON takes numbers and booleans wherever the flag takes them. */
static void test_config_numbers_for_string_flags(void **state)
{
    char out[8192];
    int rc = sh(out, sizeof out, "printf '{\"ckpt\": 1, \"layers\": 3, \"width\": 32, \"heads\": 2, "
                "\"seq\": 32, \"micro-batch\": 2, \"backend\": \"cpu\", \"vocab\": 64, \"json\": true, "
                "\"no-measure\": true}' "
                "> %s/c.json && %s plan --config %s/c.json", tmp, tidal, tmp);
    assert_int_equal(rc, 0);
    cJSON *j = cJSON_Parse(strchr(out, '{'));
    assert_non_null(j);
    assert_int_equal((int)td_test_json_num(j, "ckpt_blocks", NULL), 1);
    cJSON_Delete(j);
    rc = sh(out, sizeof out, "printf '{\"ckpt\": [1]}' > %s/c2.json && %s plan --config %s/c2.json", tmp, tidal, tmp);
    assert_int_equal(rc, 2);
    assert_non_null(strstr(out, "must be a string, number or bool"));
    /* A number beyond long long is refused by the flag, not converted (that
     * conversion is undefined: found by fuzz_train_config under clang's
     * UBSan, whose corpus keeps the input). */
    rc = sh(out, sizeof out, "printf '{\"seq\": 1e300}' > %s/c3.json && %s plan --config %s/c3.json", tmp, tidal, tmp);
    assert_int_equal(rc, 2);
    assert_non_null(strstr(out, "is not a valid integer"));
}

/* eval chooses the backend as train does (auto: cpu here). */
static void test_eval_defaults_to_auto(void **state)
{
    char out[8192];
    assert_int_equal(sh(out, sizeof out, "%s eval --help", tidal), 0);
    assert_non_null(strstr(out, "auto (default"));
    assert_int_equal(sh(out, sizeof out, "%s generate --help", tidal), 0);
    assert_non_null(strstr(out, "key/value cache")); /* generate runs on the CPU */
}

/* Non-finite grads (injected) skip their step with a message; too many in a
 * row stop the run non-zero without saving over the last good checkpoint. */
static void test_bad_steps(void **state)
{
    char out[16384];
    int rc = sh(out, sizeof out, "TD_FAULT_NONFINITE_STEP=2,2 %s train --data %s/ok.tok " MODEL " --steps 5 "
                "--log-every 1 --save %s/bad1", tidal, tmp, tmp);
    assert_int_equal(rc, 0);
    assert_non_null(strstr(out, "step 2: loss"));
    assert_non_null(strstr(out, "skipped (1 in a row"));
    assert_non_null(strstr(out, "step 3: loss"));
    assert_non_null(strstr(out, "skipped (2 in a row"));
    assert_null(strstr(out, "step 4: loss"));
    rc = sh(out, sizeof out, "TD_FAULT_NONFINITE_STEP=3,10 %s train --data %s/ok.tok " MODEL " --steps 20 "
            "--save-every 1 --save %s/bad2 --max-bad-steps 3", tidal, tmp, tmp);
    assert_int_equal(rc, 1);
    assert_non_null(strstr(out, "3 steps in a row with a non-finite loss or grads"));
    /* The checkpoint is the last good one: step 2. */
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps 3 --resume %s/bad2", tidal, tmp, tmp);
    assert_int_equal(rc, 0);
    assert_non_null(strstr(out, "at step 2"));
}

/* Within a step of several micro-batches, a line after each one but the
 * last when TD_TRAIN_PROGRESS_S is 0; none in a short run by default (a line
 * comes only once a step has run a minute into a log), and none with one
 * micro-batch a step. */
static void test_progress_within_a_step(void **state)
{
    char out[16384];
    int rc = sh(out, sizeof out, "TD_TRAIN_PROGRESS_S=0 %s train --data %s/ok.tok " MODEL " --steps 2 --grad-accum 3",
                tidal, tmp);
    assert_int_equal(rc, 0);
    for (int s = 1; s <= 2; s++)
        for (int k = 1; k <= 3; k++) {
            char want[64];
            snprintf(want, sizeof want, "step %d/2  micro-batch %d/3  ", s, k);
            if ((strstr(out, want) != NULL) != (k < 3)) fail_msg("'%s' %s in:\n%s", want, k < 3 ? "missing" : "printed", out);
        }
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps 2 --grad-accum 3", tidal, tmp);
    assert_int_equal(rc, 0);
    assert_null(strstr(out, "micro-batch"));
    rc = sh(out, sizeof out, "TD_TRAIN_PROGRESS_S=0 %s train --data %s/ok.tok " MODEL " --steps 2", tidal, tmp);
    assert_int_equal(rc, 0);
    assert_null(strstr(out, "micro-batch"));
    /* not seconds: said, and the default kept (no line in a short run) */
    rc = sh(out, sizeof out, "TD_TRAIN_PROGRESS_S=soon %s train --data %s/ok.tok " MODEL " --steps 2 --grad-accum 3",
            tidal, tmp);
    assert_int_equal(rc, 0);
    assert_non_null(strstr(out, "TD_TRAIN_PROGRESS_S=soon: not seconds"));
    assert_null(strstr(out, "micro-batch"));
}

/* The last step's CPU AdamW updates are waited for at its end: the log's
 * last record says how long (updates_tail_ms), the others do not, and a
 * line names them (every time with TD_TRAIN_PROGRESS_S=0, else only when
 * they took a second or more: not in a run this small). */
static void test_last_step_updates(void **state)
{
    char out[16384];
    const char *opts = "--offload-optim-frac 1 --steps 3";
    int rc = sh(out, sizeof out, "TD_TRAIN_PROGRESS_S=0 %s train --data %s/ok.tok " MODEL " %s --log %s/tail.jsonl",
                tidal, tmp, opts, tmp);
    if (rc) fail_msg("%s", out);
    int chunks = 0;
    const char *said = strstr(out, "step 3: its updates (");
    if (!said || sscanf(said, "step 3: its updates (%d param chunks) finished", &chunks) != 1 || chunks < 1)
        fail_msg("no line of the last step's updates in:\n%s", out);
    assert_null(strstr(out, "step 2: its updates"));
    rc = sh(out, sizeof out, "grep -c updates_tail_ms %s/tail.jsonl; grep -c '\"step\":3,.*\"updates_tail_ms\":[0-9]' "
            "%s/tail.jsonl; wc -l < %s/tail.jsonl", tmp, tmp, tmp);
    assert_int_equal(rc, 0);
    assert_string_equal(out, "1\n1\n3\n");
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " %s", tidal, tmp, opts);
    assert_int_equal(rc, 0);
    assert_null(strstr(out, "its updates"));
}

/* SIGTERM and SIGINT stop at a step boundary, save with --save, and exit
 * 143 / 130; the saved run resumes.  The log's tail: on a loaded machine
 * many steps pass before the signal lands, more than `out` holds. */
static void test_stop_signals(void **state)
{
    char out[16384];
    const char *sig[2] = {"TERM", "INT"};
    int want[2] = {143, 130};
    for (int i = 0; i < 2; i++) {
        int rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps 1000000 --log-every 1 --save %s/sig --overwrite "
                    "> %s/sig.log 2>&1 & p=$!; for i in $(seq 600); do grep -q 'step 3/' %s/sig.log && break; "
                    "sleep 0.1; done; kill -%s $p; wait $p; rc=$?; tail -n 20 %s/sig.log; exit $rc",
                    tidal, tmp, tmp, tmp, tmp, sig[i], tmp);
        assert_int_equal(rc, want[i]);
        assert_non_null(strstr(out, i ? "SIGINT: stopped after step" : "SIGTERM: stopped after step"));
        assert_non_null(strstr(out, "saved"));
    }
    int rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps 1000000 --stop-after 1 --resume %s/sig",
                tidal, tmp, tmp);
    assert_int_equal(rc, 0);
    assert_non_null(strstr(out, "resumed"));
}

/* LLaMA-family models through the command: a preset trains on the cpu
 * backend and saves a Hugging Face directory that eval reads; shape flags
 * that only LLaMA has are refused for GPT-2; --decay-all is accepted; plan
 * describes a published preset. */
static void test_llama_models(void **state)
{
    char out[16384];
    int rc = sh(out, sizeof out, "%s train --data %s/ok.tok --model tiny-llama --layers 1 --kv-heads 1 --mlp-width 96 "
                "--seq 32 --micro-batch 2 --steps 3 --backend cpu --decay-all --save %s/ll", tidal, tmp, tmp);
    if (rc) fail_msg("%s", out);
    assert_non_null(strstr(out, "llama 1 layers"));
    rc = sh(out, sizeof out, "grep -c '\"model_type\":[[:space:]]*\"llama\"' %s/ll/config.json", tmp);
    assert_int_equal(rc, 0);
    rc = sh(out, sizeof out, "%s eval --checkpoint %s/ll --data %s/ok.tok --seq 32 --batches 2 --backend cpu --json",
            tidal, tmp, tmp);
    if (rc) fail_msg("%s", out);
    assert_non_null(strstr(out, "\"loss\""));
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --kv-heads 1 --steps 1", tidal, tmp);
    assert_int_not_equal(rc, 0);
    assert_non_null(strstr(out, "--kv-heads / --mlp-width: a gpt2 model is"));
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok --model tiny-llama --kv-heads 3 --seq 32 --steps 1 --backend cpu",
            tidal, tmp);
    assert_int_not_equal(rc, 0);
    assert_non_null(strstr(out, "num_key_value_heads must divide"));
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok --init %s/ll --kv-heads 2 --seq 32 --steps 1 --backend cpu",
            tidal, tmp, tmp);
    assert_int_not_equal(rc, 0);
    assert_non_null(strstr(out, "--kv-heads 2 differs from the checkpoint"));
    rc = sh(out, sizeof out, "%s plan --no-measure --model qwen2.5-0.5b --seq 512 --micro-batch 1 --backend cpu --gpu-budget 2GiB",
            tidal);
    assert_non_null(strstr(out, "494032768 params: qwen2: 24 layers, 896 wide, 14 heads (2 key/value), MLP 4864"));
    assert_int_equal(sh(out, sizeof out, "%s train --model llama-9b --data %s/ok.tok", tidal, tmp), 2);
    assert_non_null(strstr(out, "smollm2-135m"));
    assert_non_null(strstr(out, "config.json"));
    /* --model with a config.json (or its folder): that architecture from
     * fresh weights, the same as the preset's shape spelt out, step for step;
     * flags still override it. */
    double first[3];
    const char *how[3] = {"--model %s/ll/config.json", "--model %s/ll", "--model tiny-llama --layers 1 --kv-heads 1 "
                          "--mlp-width 96 --vocab %s"};
    char vocab[32] = "";
    rc = sh(out, sizeof out, "sed -n 's/.*\"vocab_size\":[[:space:]]*\\([0-9]*\\).*/\\1/p' %s/ll/config.json", tmp);
    assert_int_equal(rc, 0);
    snprintf(vocab, sizeof vocab, "%d", atoi(out));
    for (int k = 0; k < 3; k++) {
        char model[512];
        snprintf(model, sizeof model, how[k], k < 2 ? tmp : vocab);
        rc = sh(out, sizeof out, "%s train --data %s/ok.tok %s --seq 32 --micro-batch 2 --steps 2 --backend cpu "
                "--decay-all --log %s/m%d.log >/dev/null 2>&1 && head -n 1 %s/m%d.log", tidal, tmp, model, tmp, k, tmp, k);
        if (rc) fail_msg("%s", out);
        cJSON *j = cJSON_Parse(strchr(out, '{'));
        assert_non_null(j);
        first[k] = td_test_json_num(j, "loss", NULL);
        cJSON_Delete(j);
    }
    assert_true(first[0] == first[2] && first[1] == first[2]);
    rc = sh(out, sizeof out, "%s plan --no-measure --model %s/ll/config.json --layers 3 --seq 32 --backend cpu", tidal, tmp);
    assert_int_equal(rc, 0);
    assert_non_null(strstr(out, "llama: 3 layers"));
    rc = sh(out, sizeof out, "%s train --model %s/none/config.json --data %s/ok.tok", tidal, tmp, tmp);
    assert_int_equal(rc, 2);
    assert_non_null(strstr(out, "No such file"));
    rc = sh(out, sizeof out, "printf '{\"model_type\": \"mistral\"}' > %s/m.json && %s train --model %s/m.json "
            "--data %s/ok.tok", tmp, tidal, tmp, tmp);
    assert_int_equal(rc, 2);
    assert_non_null(strstr(out, "model_type \"mistral\""));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_token_files),
        cmocka_unit_test(test_bad_flags),
        cmocka_unit_test(test_budget_too_small_names_minimum),
        cmocka_unit_test(test_plan_json),
        cmocka_unit_test(test_adam_thread_flag),
        cmocka_unit_test(test_plan_layout_as_the_run),
        cmocka_unit_test(test_host_plan_and_limits),
        cmocka_unit_test(test_checkpoint_survives_bad_resume_and_corruption),
        cmocka_unit_test(test_default_budget),
        cmocka_unit_test(test_checkpoint_carries_its_tokenizer),
        cmocka_unit_test(test_resume_with_the_original_flags),
        cmocka_unit_test(test_config_numbers_for_string_flags),
        cmocka_unit_test(test_eval_defaults_to_auto),
        cmocka_unit_test(test_bad_steps),
        cmocka_unit_test(test_progress_within_a_step),
        cmocka_unit_test(test_last_step_updates),
        cmocka_unit_test(test_stop_signals),
        cmocka_unit_test(test_tune_bad_input),
        cmocka_unit_test(test_tune_config_trains_within_budget),
        cmocka_unit_test(test_tune_sweep_plot),
        cmocka_unit_test(test_llama_models),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
