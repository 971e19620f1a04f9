/* `tidal train` on several GPUs (ZeRO-3 over NCCL, one rank a GPU): 2 ranks
 * give the losses one rank gives on the same global batch — in fp32 within
 * 1e-4 relative over 12 steps (the sums' order differs: each rank's half of
 * the batch, then NCCL's reduce-scatter), with each rank's AdamW on the CPU
 * (its shards, on the AdamW thread), on the GPU (its shards in device
 * slots), and under a budget that evicts chunks (all-gathers into reloaded
 * slots); in bf16 without clipping within bf16 noise — and a rank killed mid-run makes the
 * other exit non-zero within --comm-timeout, naming it.  Needs 2 GPUs: with
 * fewer the tests skip, saying so (NCCL takes one GPU a rank).  The CPU path of the same
 * logic is tests/test_zero3_train.c. */
#include "td_proc.h"
#include "td_ranks.h"
#include "td_test.h"

#include "tidal/parallel.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char tidal[512], tmp[64];

/* A small GPT-2 in chunks whose lengths 2 does not divide into the shard
 * alignment, grad-accum 2, clipping that bites. */
#define MODEL "--layers 4 --width 128 --heads 4 --seq 128 --backend cuda --lr 2e-3 --grad-accum 2 " \
              "--chunk-numel 70001 --clip-grad-norm 0.5"
#define STEPS 12

static int setup(void **state)
{
    (void)state;
    snprintf(tidal, sizeof tidal, "%s", td_test_tidal());
    if (td_proc_tmpdir(tmp, sizeof tmp, "tidal-zero3-gpu")) return -1;
    /* text any checkout has: the docs and sources, about 400 KB */
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "cat docs/*.md model/*.c data/*.c trainer/*.c | head -c 400000 > %s/text && "
             "%s prepare --quiet --input %s/text --out %s/text.tok > %s/prepare.out 2>&1", tmp, tidal, tmp, tmp, tmp);
    return system(cmd) == 0 ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    return td_proc_rmdir(tmp);
}

/* Skips the case unless 2 GPUs and NCCL are there (tests/run.sh fails the
 * skip on a machine that has them). */
static void need_two_gpus(void)
{
    int gpus = td_proc_gpu_count();
    if (gpus < 2) td_test_skip("needs 2 GPUs (found %d): ZeRO-3 over NCCL takes one a rank", gpus);
    if (!td_comm_nccl_compiled()) td_test_skip("needs NCCL (this build has none: NCCL=1)");
}

/* Trains `tidal train --data ... MODEL ARGS --steps STEPS --log LOG`; the
 * per-step losses into loss[]; returns the output's text. */
static const char *train(const char *name, const char *args, double *loss)
{
    char out[256], log[256];
    snprintf(out, sizeof out, "%s/%s.out", tmp, name);
    snprintf(log, sizeof log, "%s/%s.jsonl", tmp, name);
    pid_t p = td_proc_start(out, -1, 0, 0, "%s train --data %s/text.tok " MODEL " --steps %d --log %s %s", tidal,
                            tmp, STEPS, log, args);
    int rc = td_proc_finish(p, 240, name);
    if (rc) fail_msg("%s (%s): exit %d: %s", name, args, rc, td_proc_slurp(out));
    if (td_proc_read_log(log, loss, NULL, STEPS) != STEPS) fail_msg("%s: fewer than %d steps logged", name, STEPS);
    return td_proc_slurp(out);
}

/* The device peak of the last line of a --log (rank 0's own). */
static long long log_peak(const char *name)
{
    char path[256];
    snprintf(path, sizeof path, "%s/%s.jsonl", tmp, name);
    const char *s = td_proc_slurp(path), *last = NULL;
    for (const char *p = s; (p = strstr(p, "\"device_peak_bytes\":")); p++) last = p;
    assert_non_null(last);
    return strtoll(last + strlen("\"device_peak_bytes\":"), NULL, 10);
}

static void test_two_gpus_match_one(void **state)
{
    (void)state;
    need_two_gpus();
    double ref[STEPS], got[STEPS];
    train("ref_fp32", "--precision fp32 --micro-batch 4", ref);

    /* the budget that evicts on each of 2 ranks: the plan's minimum and 1 MiB */
    char out[256], cmd[1024], tight[160];
    snprintf(out, sizeof out, "%s/plan.out", tmp);
    pid_t p = td_proc_start(out, -1, 0, 0, "%s plan --data %s/text.tok " MODEL " --precision fp32 --micro-batch 2 "
                            "--nproc 2 --policy cpu --ckpt off --json", tidal, tmp);
    assert_int_equal(td_proc_finish(p, 120, "plan --nproc 2"), 0);
    const char *mb = strstr(td_proc_slurp(out), "\"min_bytes\":");
    assert_non_null(mb);
    long long budget = strtoll(mb + strlen("\"min_bytes\":"), NULL, 10) + (1 << 20);
    snprintf(tight, sizeof tight, "--policy cpu --ckpt off --gpu-budget %lld", budget);

    static const char *const name[] = {"cpu_adam", "gpu_adam", "half_gpu_adam", "evicting"};
    const char *const policy[] = {"--policy cpu", "--policy cuda", "--policy static --offload-optim-frac 0.5", tight};
    for (int c = 0; c < 4; c++) {
        snprintf(cmd, sizeof cmd, "--precision fp32 --micro-batch 2 --nproc 2 %s", policy[c]);
        const char *o = train(name[c], cmd, got);
        if (!strstr(o, "ZeRO-3")) fail_msg("%s: no ZeRO-3 in the banner: %s", name[c], o);
        double worst = td_proc_expect_close(ref, got, STEPS, 1e-4, name[c]);
        print_message("2 GPUs, fp32, %s: worst relative loss difference %.3g (loss %.4f -> %.4f)\n", policy[c], worst,
                      got[0], got[STEPS - 1]);
    }
    long long peak = log_peak("evicting");
    print_message("evicting budget %lld bytes a GPU: rank 0's device peak %lld\n", budget, peak);
    assert_true(peak <= budget);

    /* bf16 without clipping (W7's setting: nothing waits for the norm) */
    train("ref_bf16", "--precision bf16 --micro-batch 4 --clip-grad-norm 0", ref);
    train("bf16", "--precision bf16 --micro-batch 2 --nproc 2 --clip-grad-norm 0", got);
    double worst = td_proc_expect_close(ref, got, STEPS, 2e-2, "bf16, 2 GPUs");
    print_message("2 GPUs, bf16: worst relative loss difference %.3g\n", worst);
    assert_true(got[STEPS - 1] < got[0]); /* it learns */
}

/* Rank 1 killed (SIGKILL) in the step loop: rank 0 exits non-zero within
 * --comm-timeout and its teardown, naming rank 1. */
static void test_killed_rank(void **state)
{
    (void)state;
    need_two_gpus();
    char out[2][256], log[256];
    snprintf(log, sizeof log, "%s/dead.jsonl", tmp);
    int port = td_test_free_port();
    pid_t p[2];
    for (int r = 0; r < 2; r++) {
        snprintf(out[r], sizeof out[r], "%s/dead%d.out", tmp, r);
        p[r] = td_proc_start(out[r], r, 2, port, "%s train --data %s/text.tok " MODEL " --micro-batch 2 "
                             "--steps 100000 --comm-timeout 10 --log %s", tidal, tmp, log);
    }
    double t0 = td_proc_now_s(), loss[4];
    while (td_proc_read_log(log, loss, NULL, 4) < 2 && td_proc_now_s() - t0 < 120) usleep(20000);
    assert_true(td_proc_read_log(log, loss, NULL, 4) >= 2);
    kill(p[1], SIGKILL);
    double t1 = td_proc_now_s();
    int rc = td_proc_finish(p[0], 90, "rank 0 after rank 1 was killed");
    double took = td_proc_now_s() - t1;
    td_proc_finish(p[1], 30, "rank 1");
    const char *o = td_proc_slurp(out[0]);
    print_message("rank 0 exited %d, %.1f s after rank 1 was killed: %s", rc, took, o);
    if (rc == 0 || !strstr(o, "rank 1")) fail_msg("rank 0 exit %d (want non-zero) naming rank 1", rc);
    assert_true(took < 10 + 20);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_two_gpus_match_one),
        cmocka_unit_test(test_killed_rank),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
