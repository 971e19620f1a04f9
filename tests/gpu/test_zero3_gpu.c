/* `tidal train` on several GPUs (ZeRO-3 over NCCL, one rank a GPU, each
 * rank's host holding its shard of every chunk): 2 ranks give the losses
 * one rank gives on the same global batch — in fp32 within 1e-4 relative
 * over 12 steps (the sums' order differs: each rank's half of the batch,
 * then NCCL's reduce-scatter), with each rank's AdamW on the CPU (its
 * shards, on the AdamW thread), on the GPU (its shards in device slots),
 * and under a budget that evicts chunks (shard loads and all-gathers into
 * reloaded slots, grads reduce-scattered at eviction; with the prefetch
 * window fixed, the AdamW thread's run gives the bits of the runs without
 * it where those repeat); in bf16 without
 * clipping within bf16 noise; each rank moves about half of one rank's
 * bytes over PCIe; each process's device memory (cudaMemGetInfo, and
 * nvidia-smi's per-process figure) stays within the budget plus the CUDA
 * context; two simulated hosts (two launches with NNODES=2, a GPU each)
 * train as one job; LoRA with dropout on 2 GPUs gives one GPU's losses;
 * and a rank killed mid-run makes the other exit
 * non-zero within --comm-timeout, naming it.  Needs 2 GPUs: with fewer the
 * tests skip (NCCL takes one GPU a rank).  The CPU path of the same logic
 * is tests/test_zero3_train.c. */
#include "td_proc.h"
#include "td_ranks.h"
#include "td_test.h"

#include "tidal/parallel.h"

#include "tidal/backend.h"

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <sys/wait.h>
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

/* A number `key` ("\"bytes_h2d\":") of the last line of a --log (rank 0's own). */
static long long log_last(const char *name, const char *key)
{
    char path[256];
    snprintf(path, sizeof path, "%s/%s.jsonl", tmp, name);
    const char *s = td_proc_slurp(path), *last = NULL;
    for (const char *p = s; (p = strstr(p, key)); p++) last = p;
    if (!last) fail_msg("%s: no %s in %s", name, key, path);
    return strtoll(last + strlen(key), NULL, 10);
}
static long long log_peak(const char *name) { return log_last(name, "\"device_peak_bytes\":"); }

/* Whether pid is root or one of its descendants (/proc's parent links). */
static int descends(long long pid, pid_t root)
{
    for (int hops = 0; pid > 1 && hops < 64; hops++) {
        if (pid == (long long)root) return 1;
        char path[64], buf[512];
        snprintf(path, sizeof path, "/proc/%lld/stat", pid);
        FILE *f = fopen(path, "r");
        if (!f) return 0;
        size_t n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[n] = '\0';
        const char *close = strrchr(buf, ')'); /* the name may hold spaces and parentheses */
        long long ppid;
        if (!close || sscanf(close + 1, " %*c %lld", &ppid) != 1) return 0;
        pid = ppid;
    }
    return 0;
}

/* nvidia-smi's largest per-process device memory now among root's
 * processes (other work on the machine's GPUs is not the run's), in MiB;
 * 0 if none. */
static long long smi_max_mib(pid_t root)
{
    FILE *p = popen("nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null", "r");
    if (!p) return 0;
    long long most = 0, pid, mib;
    while (fscanf(p, "%lld, %lld", &pid, &mib) == 2)
        if (mib > most && descends(pid, root)) most = mib;
    pclose(p);
    return most;
}

/* The device memory of a process holding only a CUDA context (a child
 * that makes the backend, as a rank does, and asks nvidia-smi), in MiB. */
static long long context_mib(void)
{
    int fd[2];
    assert_int_equal(pipe(fd), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        td_backend_params bp = td_backend_default_params();
        bp.kind = TD_BACKEND_CUDA;
        td_backend *b = NULL;
        long long mib = 0;
        if (td_backend_create(&bp, &b) == TD_OK) {
            char cmd[160], line[128];
            snprintf(cmd, sizeof cmd, "nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits");
            FILE *p = popen(cmd, "r");
            long long q, m;
            while (p && fgets(line, sizeof line, p))
                if (sscanf(line, "%lld, %lld", &q, &m) == 2 && q == (long long)getpid()) mib = m;
            if (p) pclose(p);
        }
        if (write(fd[1], &mib, sizeof mib) != (ssize_t)sizeof mib) _exit(1);
        _exit(0);
    }
    close(fd[1]);
    long long mib = 0;
    if (read(fd[0], &mib, sizeof mib) != (ssize_t)sizeof mib) mib = 0;
    close(fd[0]);
    waitpid(pid, NULL, 0);
    return mib;
}

static void test_two_gpus_match_one(void **state)
{
    (void)state;
    need_two_gpus();
    double ref[STEPS], got[STEPS];
    train("ref_fp32", "--precision fp32 --micro-batch 4", ref);

    /* the plan's minimum on each of 2 ranks: its arena's part and NCCL's (planned) */
    char out[256], cmd[1024], tight[160];
    snprintf(out, sizeof out, "%s/plan.out", tmp);
    pid_t p = td_proc_start(out, -1, 0, 0, "%s plan --data %s/text.tok " MODEL " --precision fp32 --micro-batch 2 "
                            "--nproc 2 --policy cpu --ckpt off --json", tidal, tmp);
    assert_int_equal(td_proc_finish(p, 120, "plan --nproc 2"), 0);
    const char *plan = td_proc_slurp(out), *mb = strstr(plan, "\"min_bytes\":"), *cb = strstr(plan, "\"comm_bytes\":");
    assert_non_null(mb);
    assert_non_null(cb);
    long long min = strtoll(mb + strlen("\"min_bytes\":"), NULL, 10);
    long long planned = strtoll(cb + strlen("\"comm_bytes\":"), NULL, 10);
    long long budget = 0;

    static const char *const name[] = {"cpu_adam", "gpu_adam", "half_gpu_adam", "evicting"};
    const char *policy[] = {"--policy cpu", "--policy cuda", "--policy static --offload-optim-frac 0.5", tight};
    for (int c = 0; c < 4; c++) {
        if (c == 3) { /* the budget that evicts: the arena's minimum, NCCL's share as the runs measured it, 1 MiB */
            long long measured = log_last("cpu_adam", "\"comm_device_bytes\":");
            print_message("NCCL's device memory a rank: planned %lld bytes, measured %lld\n", planned, measured);
            assert_true(measured > 0 && measured <= planned); /* what the plan accepts, the ranks accept */
            budget = min - planned + measured + (1 << 20);
            snprintf(tight, sizeof tight, "--policy cpu --ckpt off --gpu-budget %lld", budget);
        }
        snprintf(cmd, sizeof cmd, "--precision fp32 --micro-batch 2 --nproc 2 %s", policy[c]);
        const char *o = train(name[c], cmd, got);
        if (!strstr(o, "ZeRO-3")) fail_msg("%s: no ZeRO-3 in the banner: %s", name[c], o);
        double worst = td_proc_expect_close(ref, got, STEPS, 1e-4, name[c]);
        print_message("2 GPUs, fp32, %s: worst relative loss difference %.3g (loss %.4f -> %.4f)\n", policy[c], worst,
                      got[0], got[STEPS - 1]);
    }
    long long peak = log_peak("evicting") + log_last("evicting", "\"comm_device_bytes\":");
    print_message("evicting budget %lld bytes a GPU: rank 0's device peak with NCCL's share %lld\n", budget, peak);
    assert_true(peak <= budget);
    /* The evicting run with its prefetch window fixed (a measured one
     * follows the copies' timing, and under eviction the window decides
     * which grad chunks are reduce-scattered between micro-batches, so the
     * sums' order): twice without the AdamW thread and once with it.  When
     * the two without it agree bit for bit (the kernels and NCCL repeat
     * their sums), the one with it must too: the thread updating shards
     * beside the backward and the loads may change no bit. */
    double off1[STEPS], off2[STEPS], on[STEPS];
    char fixed[256];
    snprintf(fixed, sizeof fixed, "--precision fp32 --micro-batch 2 --nproc 2 %s --prefetch 3 --adam-thread off", tight);
    train("evicting_off1", fixed, off1);
    train("evicting_off2", fixed, off2);
    snprintf(fixed, sizeof fixed, "--precision fp32 --micro-batch 2 --nproc 2 %s --prefetch 3 --adam-thread on", tight);
    train("evicting_on", fixed, on);
    if (memcmp(off1, off2, sizeof off1))
        print_message("evicting, --prefetch 3: two runs without the AdamW thread differ in their bits (the CUDA path "
                      "does not repeat its sums); the thread's run checked within 1e-4 only\n");
    else
        for (int s = 0; s < STEPS; s++)
            if (on[s] != off1[s])
                fail_msg("evicting, --prefetch 3: step %d's loss %a with the AdamW thread, %a without it (twice)", s + 1,
                         on[s], off1[s]);
    td_proc_expect_close(ref, on, STEPS, 1e-4, "evicting, the AdamW thread");
    /* Each rank's PCIe bytes: its shards, about half of one rank's (the
     * same --policy cpu, every chunk streamed): the last step's loads. */
    train("one_cpu_adam", "--precision fp32 --micro-batch 4 --policy cpu", ref);
    long long one = log_last("one_cpu_adam", "\"bytes_h2d\":"), two = log_last("cpu_adam", "\"bytes_h2d\":");
    long long gathered = log_last("cpu_adam", "\"bytes_gathered\":");
    print_message("a step's loads over PCIe: one GPU %lld bytes, each of 2 GPUs %lld (%.2f), gathered over NVLink %lld\n",
                  one, two, (double)two / (double)one, gathered);
    assert_true(two <= one * 0.55 && two >= one * 0.45);
    assert_true(gathered >= two * 0.9);

    /* bf16 without clipping (W7's setting: nothing waits for the norm) */
    train("ref_bf16", "--precision bf16 --micro-batch 4 --clip-grad-norm 0", ref);
    train("bf16", "--precision bf16 --micro-batch 2 --nproc 2 --clip-grad-norm 0", got);
    double worst = td_proc_expect_close(ref, got, STEPS, 2e-2, "bf16, 2 GPUs");
    print_message("2 GPUs, bf16: worst relative loss difference %.3g\n", worst);
    assert_true(got[STEPS - 1] < got[0]); /* it learns */
}

/* LoRA (rank 4 on every module, the base frozen) with dropout 0.2 on 2
 * GPUs: one GPU's losses on the same global batch within the fp32 bound
 * above (each rank hashes the masks of its rows' global sample indices),
 * apart from the run without dropout. */
static void test_two_gpus_lora_dropout(void **state)
{
    (void)state;
    need_two_gpus();
    double ref[STEPS], got[STEPS], none[STEPS];
    train("lora_ref", "--precision fp32 --micro-batch 4 --lora-rank 4 --lora-dropout 0.2", ref);
    train("lora_none", "--precision fp32 --micro-batch 4 --lora-rank 4", none);
    train("lora_two", "--precision fp32 --micro-batch 2 --nproc 2 --lora-rank 4 --lora-dropout 0.2", got);
    double worst = td_proc_expect_close(ref, got, STEPS, 1e-4, "LoRA dropout, 2 GPUs");
    double apart = 0;
    for (int s = 1; s < STEPS; s++) apart = fmax(apart, fabs(ref[s] - none[s]) / fabs(none[s]));
    print_message("2 GPUs, LoRA dropout 0.2: worst relative loss difference %.3g; dropout moved the loss by up to "
                  "%.3g\n", worst, apart);
    assert_true(apart > 1e-5); /* past fp32's noise: the masks act */
}

/* Under a budget of 1 GiB a GPU: the device memory each rank's process
 * holds beyond its CUDA context (cudaMemGetInfo, the log's
 * device_process_peak_bytes) and nvidia-smi's per-process figure, sampled
 * through the run, stay within the budget plus the context (and the
 * kernel modules CUDA loads lazily, at most 256 MiB); NCCL's buffers are
 * measured and taken from the budget. */
static void test_device_memory_within_budget(void **state)
{
    (void)state;
    need_two_gpus();
    const long long budget = 1LL << 30, lazy = 256LL << 20;
    long long ctx = context_mib();
    char out[256], log[256];
    snprintf(out, sizeof out, "%s/budget.out", tmp);
    snprintf(log, sizeof log, "%s/budget.jsonl", tmp);
    pid_t p = td_proc_start(out, -1, 0, 0, "%s train --data %s/text.tok " MODEL " --precision bf16 --micro-batch 8 "
                            "--nproc 2 --gpu-budget %lld --steps 30 --log %s", tidal, tmp, budget, log);
    long long smi = 0;
    int status = 0;
    while (waitpid(p, &status, WNOHANG) == 0) {
        long long m = smi_max_mib(p);
        if (m > smi) smi = m;
        usleep(100000);
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status)) fail_msg("train under 1 GiB a GPU failed: %s", td_proc_slurp(out));
    long long used = log_last("budget", "\"device_process_peak_bytes\":");
    print_message("budget %lld MiB a GPU; a context alone %lld MiB (nvidia-smi); rank 0 beyond its context %.1f MiB "
                  "(cudaMemGetInfo); nvidia-smi's largest of its processes %lld MiB\n", budget >> 20, ctx, used / 1048576.0, smi);
    print_message("%s", td_proc_slurp(out));
    assert_true(used > 0);
    assert_true(used <= budget + lazy);
    assert_true(ctx > 0);
    assert_true(smi > 0); /* the ranks were seen */
    assert_true(smi <= (budget >> 20) + ctx + (lazy >> 20));
}

/* Two simulated hosts on one machine: two launches with NNODES=2, NODE_RANK
 * 0 and 1, a GPU each (CUDA_VISIBLE_DEVICES), one rank a host, chunks split
 * over both (--shard world, over NCCL): one rank's losses of the same
 * global batch within 1e-4. */
static void test_two_hosts(void **state)
{
    (void)state;
    need_two_gpus();
    double ref[STEPS], got[STEPS];
    train("hosts_ref", "--precision fp32 --micro-batch 4", ref);
    char out[2][256], log[256];
    snprintf(log, sizeof log, "%s/hosts.jsonl", tmp);
    int port = td_test_free_port();
    pid_t p[2];
    for (int h = 0; h < 2; h++) {
        snprintf(out[h], sizeof out[h], "%s/hosts%d.out", tmp, h);
        p[h] = td_proc_start(out[h], -1, 0, 0, "env NNODES=2 NODE_RANK=%d MASTER_ADDR=127.0.0.1 MASTER_PORT=%d "
                             "CUDA_VISIBLE_DEVICES=%d %s train --data %s/text.tok " MODEL " --precision fp32 "
                             "--micro-batch 2 --nproc 1 --shard world --steps %d --log %s", h, port, h, tidal, tmp,
                             STEPS, log);
    }
    for (int h = 0; h < 2; h++) {
        int rc = td_proc_finish(p[h], 240, "a simulated host");
        if (rc) fail_msg("host %d: exit %d: %s", h, rc, td_proc_slurp(out[h]));
    }
    assert_int_equal(td_proc_read_log(log, got, NULL, STEPS), STEPS);
    double worst = td_proc_expect_close(ref, got, STEPS, 1e-4, "two hosts, a GPU each");
    print_message("two simulated hosts, a GPU each: worst relative loss difference %.3g\n", worst);
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
        cmocka_unit_test(test_two_gpus_lora_dropout),
        cmocka_unit_test(test_device_memory_within_budget),
        cmocka_unit_test(test_two_hosts),
        cmocka_unit_test(test_killed_rank),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
