/* What the `tidal` command promises a user: exit status 2 for a usage
 * error, 1 for a failure, 0 for success (and 3 for a plan that does not
 * fit) across every subcommand; nothing overwritten silently (--save onto
 * another run's checkpoint is refused, naming what is there); and figures
 * that are true or absent (a preset's vocabulary replaced is said, the
 * plan's minimum is never above its all-resident footprint, nothing
 * measured means no estimate, the cpu backend is not spoken of as a GPU).
 * Runs the command of the same build (env TIDAL, else ./build/tidal). */
#include <stdarg.h>
#include "td_test.h"
#include "tidal/model.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

static char tidal[512], tmp[64];

/* Runs a shell command line; its exit status, and stdout+stderr in out. */
static int sh(char *out, size_t out_bytes, const char *fmt, ...)
{
    char cmd[2048], full[2200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
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
    snprintf(tmp, sizeof tmp, "/tmp/tidal-exit-XXXXXX");
    if (!mkdtemp(tmp)) return -1;
    char out[4096];
    return sh(out, sizeof out, "head -c 100000 /usr/share/games/fortunes/fortunes > %s/text && %s prepare --quiet "
              "--input %s/text --out %s/ok.tok", tmp, tidal, tmp, tmp);
}

static int teardown(void **state)
{
    char out[256];
    sh(out, sizeof out, "rm -rf %s", tmp);
    return 0;
}

#define MODEL "--layers 1 --width 32 --heads 2 --seq 32 --micro-batch 2 --backend cpu"

/* Each line: the exit status a command line must give. */
static void test_exit_status_every_command(void **state)
{
    char out[16384];
    struct { int rc; const char *args; } cases[] = {
        {2, ""},
        {0, "--help"},
        {2, "frobnicate"},
        {0, "version"},
        {0, "bench --help"},
        {2, "bench"},
        {2, "bench nosuch"},
        {2, "bench copy --frobnicate"},
        {2, "bench adam --threads x"},
        {0, "train --help"},
        {2, "train " MODEL},                                   /* no --data */
        {2, "train --data @/ok.tok " MODEL " --steps 0"},
        {2, "train --data @/ok.tok " MODEL " --threads -2"},
        {2, "train --data @/ok.tok " MODEL " --policy fast"},
        {1, "train --data @/missing.tok " MODEL},             /* a file that is not there: a failure */
        {1, "train --data @/text " MODEL},                    /* not a token file */
        {0, "plan --help"},
        {2, "plan " MODEL " --heads 5"},
        {3, "plan --no-measure " MODEL " --gpu-budget 64KiB"},
        {0, "eval --help"},
        {2, "eval --data @/ok.tok"},                          /* no --checkpoint */
        {2, "eval --checkpoint @/none --data @/ok.tok --split sideways"},
        {1, "eval --checkpoint @/none --data @/ok.tok"},
        {0, "generate --help"},
        {2, "generate --checkpoint @/none --temperature nan"},
        {2, "generate --checkpoint @/none --temperature -1"},
        {2, "generate --checkpoint @/none --tokens 0"},
        {2, "generate --checkpoint @/none --threads -1"},
        {1, "generate --checkpoint @/none"},
        {0, "prepare --help"},
        {2, "prepare --input @/text"},                        /* no --out */
        {2, "prepare --input @/text --out @/x.tok --tokenizer klingon"},
        {1, "prepare --input @/missing --out @/x.tok"},
        {0, "tune --help"},
        {2, "tune " MODEL " --top 0"},
        {2, "tune " MODEL " --data @/ok.tok --sweep-budget 1MiB,,2MiB"},
        {0, "memsim --help"},
        {2, "memsim --budget 1MiB"},                          /* no --trace */
        {1, "memsim --trace @/missing.trace --budget 1MiB"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char args[1024] = "";
        for (const char *a = cases[i].args; *a; a++) { /* '@' is the test's folder */
            size_t n = strlen(args);
            if (*a == '@') snprintf(args + n, sizeof args - n, "%s", tmp);
            else snprintf(args + n, sizeof args - n, "%c", *a);
        }
        int rc = sh(out, sizeof out, "%s %s", tidal, args);
        if (rc != cases[i].rc) fail_msg("tidal %s: exit %d, want %d\n%s", args, rc, cases[i].rc, out);
        if (rc == 2 && strncmp(cases[i].args, "bench", 5) && *cases[i].args) /* a usage error says what was wrong */
            assert_non_null(strstr(out, "tidal"));
    }
}

/* --save onto a checkpoint of another run is refused, naming its model and
 * step, and the checkpoint stays; its own --resume, or --overwrite, go on. */
static void test_save_refuses_another_runs_checkpoint(void **state)
{
    char out[16384];
    assert_int_equal(sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps 3 --save %s/ck", tidal, tmp, tmp), 0);
    int rc = sh(out, sizeof out, "%s train --data %s/ok.tok --layers 1 --width 64 --heads 2 --seq 32 --micro-batch 2 "
                "--backend cpu --steps 2 --save %s/ck", tidal, tmp, tmp);
    assert_int_equal(rc, 2);
    assert_non_null(strstr(out, "holds a checkpoint"));
    assert_non_null(strstr(out, "32 wide"));
    assert_non_null(strstr(out, "step 3"));
    assert_non_null(strstr(out, "--overwrite"));
    assert_null(strstr(out, "step 1/")); /* refused before any step */
    assert_int_equal(sh(out, sizeof out, "grep -q '\"n_embd\":[[:space:]]*32' %s/ck/config.json", tmp), 0);
    /* its own run continues into it, through another spelling of the path */
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps 4 --resume %s/ck --save %s/../%s/ck", tidal,
            tmp, tmp, tmp, strrchr(tmp, '/') + 1);
    if (rc) fail_msg("%s", out);
    /* --init from it into it is another run */
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok --steps 2 --init %s/ck --save %s/ck --backend cpu --seq 32", tidal,
            tmp, tmp, tmp);
    assert_int_equal(rc, 2);
    assert_non_null(strstr(out, "step 4"));
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok --layers 1 --width 64 --heads 2 --seq 32 --micro-batch 2 "
            "--backend cpu --steps 2 --save %s/ck --overwrite", tidal, tmp, tmp);
    if (rc) fail_msg("%s", out);
    assert_int_equal(sh(out, sizeof out, "grep -q '\"n_embd\":[[:space:]]*64' %s/ck/config.json", tmp), 0);
    /* --resume and --init together */
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok --steps 3 --resume %s/ck --init %s/ck", tidal, tmp, tmp, tmp);
    assert_int_equal(rc, 2);
    assert_non_null(strstr(out, "give one of them"));
}

/* A preset trained on a token file of another vocabulary: the command says
 * what the model became; --vocab keeps the preset's. */
static void test_preset_vocabulary_is_said(void **state)
{
    char out[16384];
    int rc = sh(out, sizeof out, "%s plan --no-measure --data %s/ok.tok --model gpt2-124m --seq 32 --backend cpu "
                "--gpu-budget 4GiB --json", tidal, tmp);
    assert_true(rc == 0 || rc == 3);
    assert_non_null(strstr(out, "--model gpt2-124m has a vocabulary of 50257 tokens (124.5M params)"));
    assert_non_null(strstr(out, "the token file's is 257"));
    assert_non_null(strstr(out, "--vocab 50257"));
    cJSON *j = cJSON_Parse(strchr(out, '{'));
    assert_non_null(j);
    double params = td_test_json_num(j, "params", NULL);
    cJSON_Delete(j);
    assert_true(params < 100e6); /* as said: the byte vocabulary's model */
    assert_non_null(strstr(out, "86.1M params"));
    rc = sh(out, sizeof out, "%s plan --no-measure --data %s/ok.tok --model gpt2-124m --vocab 50257 --seq 32 "
            "--backend cpu --gpu-budget 4GiB", tidal, tmp);
    assert_null(strstr(out, "has a vocabulary"));
    assert_non_null(strstr(out, "124475904 params"));
}

/* The plan's figures: the minimum never above all-resident under --policy
 * auto (and a run at that budget trains), no estimate when nothing was
 * measured, and the cpu backend spoken of as such. */
static void test_plan_figures(void **state)
{
    char out[16384];
    int rc = sh(out, sizeof out, "%s plan --no-measure " MODEL " --json", tidal);
    assert_int_equal(rc, 0);
    cJSON *j = cJSON_Parse(strchr(out, '{'));
    assert_non_null(j);
    double min = td_test_json_num(j, "device", "min_bytes"), full = td_test_json_num(j, "device", "all_resident_bytes");
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(j, "estimate")));
    cJSON_Delete(j);
    assert_true(min <= full);
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps 2 --gpu-budget %.0f", tidal, tmp, min);
    if (rc) fail_msg("%s", out);
    rc = sh(out, sizeof out, "%s plan --no-measure " MODEL, tidal);
    assert_int_equal(rc, 0);
    assert_non_null(strstr(out, "no step estimate"));
    assert_null(strstr(out, "lower bound"));
    assert_null(strstr(out, " 0.0 ms"));
    assert_null(strstr(out, "PCIe"));
    assert_null(strstr(out, "GPU"));
    /* measured: every figure of the estimate is there, none of them 0 tokens/s */
    rc = sh(out, sizeof out, "%s plan " MODEL " --policy cpu", tidal);
    assert_int_equal(rc, 0);
    const char *lb = strstr(out, "lower bound ");
    assert_non_null(lb);
    assert_true(strtod(lb + strlen("lower bound "), NULL) > 0);
    assert_null(strstr(out, "at most 0 tokens/s"));
    /* a pin limit that RAM cannot give is not "raise --host-pin-limit" */
    rc = sh(out, sizeof out, "%s plan --no-measure " MODEL " --host-ram 1MiB", tidal);
    assert_int_equal(rc, 3);
    assert_null(strstr(out, "raise --host-pin-limit"));
    assert_non_null(strstr(out, "more than the host's RAM"));
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps 1 --host-ram 1MiB", tidal, tmp);
    assert_int_equal(rc, 1);
    assert_null(strstr(out, "raise --host-pin-limit"));
    assert_non_null(strstr(out, "the host has"));
    rc = sh(out, sizeof out, "%s plan --no-measure " MODEL " --host-pin-limit 4KiB", tidal);
    assert_int_equal(rc, 3);
    assert_non_null(strstr(out, "raise --host-pin-limit"));
    /* a training run on the cpu backend says nothing of a GPU or of PCIe */
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps 2 --policy cpu", tidal, tmp);
    if (rc) fail_msg("%s", out);
    assert_null(strstr(out, "GPU"));
    assert_null(strstr(out, "PCIe"));
    assert_non_null(strstr(out, "CPU thread"));
}

/* The cpu backend's "device" holds the budget asked for (or
 * --cpu-device-bytes), so budgets above its 4 GiB default plan and run. */
static void test_cpu_device_size(void **state)
{
    char out[16384];
    int rc = sh(out, sizeof out, "%s plan --no-measure " MODEL " --gpu-budget 6GiB --json", tidal);
    assert_true(rc == 0 || rc == 3); /* the host's RAM decides the rest */
    cJSON *j = cJSON_Parse(strchr(out, '{'));
    assert_non_null(j);
    assert_true(cJSON_IsTrue(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "device"), "fits")));
    assert_true(td_test_json_num(j, "device", "free_bytes") >= 6.0 * (1 << 30));
    cJSON_Delete(j);
    /* tune sweeps budgets above the region's default there too */
    rc = sh(out, sizeof out, "%s tune --data %s/ok.tok " MODEL " --sweep-budget 4GiB,5GiB --top 1 --steps 2 "
            "--host-ram 64GiB --json 2>/dev/null", tidal, tmp);
    if (rc) fail_msg("%s", out);
    j = cJSON_Parse(strchr(out, '{'));
    assert_non_null(j);
    cJSON *b, *budgets = cJSON_GetObjectItem(j, "budgets");
    assert_int_equal(cJSON_GetArraySize(budgets), 2);
    cJSON_ArrayForEach(b, budgets) assert_true(cJSON_IsObject(cJSON_GetObjectItem(b, "winner")));
    cJSON_Delete(j);
    rc = sh(out, sizeof out, "%s plan --no-measure " MODEL " --gpu-budget 8MiB --cpu-device-bytes 4MiB", tidal);
    assert_int_equal(rc, 3);
    assert_non_null(strstr(out, "that much free device memory"));
    rc = sh(out, sizeof out, "%s train --data %s/ok.tok " MODEL " --steps 1 --gpu-budget 8MiB --cpu-device-bytes 4MiB",
            tidal, tmp);
    assert_int_equal(rc, 1);
    assert_non_null(strstr(out, "--cpu-device-bytes"));
}

/* Help that cannot mislead: plan lists no training-run options, tune one
 * default for --steps; every family of the registry shows in --model's
 * help under its title with all its presets (a new family is listed
 * without an edit to cli/). */
static void test_help(void **state)
{
    char out[32768];
    assert_int_equal(sh(out, sizeof out, "%s plan --help", tidal), 0);
    /* as options (a line "  --save ..."), not words in another option's help */
    const char *none[] = {"\n  --save ", "\n  --resume ", "\n  --log ", "\n  --trace-timeline ", "\n  --stop-after "};
    for (size_t i = 0; i < sizeof none / sizeof none[0]; i++)
        if (strstr(out, none[i])) fail_msg("tidal plan --help lists %s", none[i] + 3);
    assert_non_null(strstr(out, "\n  --gpu-budget ")); /* the form the check looks for */
    assert_int_equal(sh(out, sizeof out, "%s tune --help", tidal), 0);
    assert_null(strstr(out, "default 100"));
    assert_int_equal(sh(out, sizeof out, "%s train --help", tidal), 0);
    for (int i = 0; i < td_model_family_count(); i++) {
        char title[64];
        snprintf(title, sizeof title, "%s: ", td_model_family_title(td_model_family_at(i)));
        if (!strstr(out, title)) fail_msg("tidal train --help does not list the family '%s'", title);
    }
    for (const char *const *p = td_model_preset_names(); *p; p++) {
        char word[96], last[96], dflt[96];
        snprintf(word, sizeof word, " %s,", *p);
        snprintf(last, sizeof last, " %s;", *p);
        snprintf(dflt, sizeof dflt, " %s (default)", *p);
        if (!strstr(out, word) && !strstr(out, last) && !strstr(out, dflt)) fail_msg("tidal train --help does not list the preset %s", *p);
    }
    assert_non_null(strstr(out, " tiny (default),"));
    assert_int_equal(sh(out, sizeof out, "%s --help", tidal), 0);
    assert_non_null(strstr(out, "tokenizer.json"));
    assert_non_null(strstr(out, "exit status"));
}

/* prepare refuses a binary file given as the input. */
static void test_prepare_refuses_binary(void **state)
{
    char out[8192];
    int rc = sh(out, sizeof out, "%s prepare --input %s --out %s/bin.tok", tidal, tidal, tmp);
    assert_int_equal(rc, 1);
    assert_non_null(strstr(out, "is not text"));
    assert_int_equal(sh(out, sizeof out, "test -e %s/bin.tok", tmp), 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_exit_status_every_command),
        cmocka_unit_test(test_save_refuses_another_runs_checkpoint),
        cmocka_unit_test(test_preset_vocabulary_is_said),
        cmocka_unit_test(test_plan_figures),
        cmocka_unit_test(test_cpu_device_size),
        cmocka_unit_test(test_help),
        cmocka_unit_test(test_prepare_refuses_binary),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
