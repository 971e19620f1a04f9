/* `tidal train` on several ranks (ZeRO-3, cpu backend): N ranks give the
 * losses one rank gives on the same global batch (fp32, within 1e-5
 * relative over 20 steps, grad-accum 2, clipping on, chunks whose lengths
 * do not divide by the rank count), `--nproc 2` gives the bits of an
 * environment launch (RANK, WORLD_SIZE, ... set by the test as torchrun
 * would), a checkpoint saved on 2 ranks continues the single-rank run on 1
 * and on 3 ranks (and one saved on 1 on 2; with int8 and bf16 moments
 * too), a killed or stopped rank makes
 * the other exit non-zero within --comm-timeout naming it, ranks with
 * different flags are refused naming the flag, and a busy MASTER_PORT gives
 * a clear error.  Runs the command of the same build (env TIDAL, else
 * ./build/tidal or ./build-san/tidal); every wait is bounded. */
#include "td_test.h"
#include "td_proc.h"
#include "td_ranks.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static char tidal[512], tmp[64];

/* A tiny GPT-2 whose chunks (1000-element capacity; 64-element shard
 * alignment) hold lengths that 2 and 3 do not divide; grad-accum 2 and
 * clipping that bites. */
#define MODEL "--layers 2 --width 32 --heads 2 --seq 32 --backend cpu --lr 3e-3 --grad-accum 2 " \
              "--chunk-numel 1000 --clip-grad-norm 0.5 --threads 1"

static int run(const char *out, const char *fmt, const char *args)
{
    pid_t p = td_proc_start(out, -1, 0, 0, fmt, tidal, args);
    return td_proc_finish(p, 240, args);
}

static int setup(void **state)
{
    (void)state;
    snprintf(tidal, sizeof tidal, "%s", td_test_tidal());
    if (td_proc_tmpdir(tmp, sizeof tmp, "tidal-zero3")) return -1;
    const char *fortunes = "/usr/share/games/fortunes/fortunes";
    char text[128];
    snprintf(text, sizeof text, "head -c 100000 %s", fortunes);
    if (td_proc_prepare(tidal, tmp, text, "ok")) return -1;
    snprintf(text, sizeof text, "head -c 20000 %s", fortunes); /* another file: the first fifth of it */
    return td_proc_prepare(tidal, tmp, text, "other");
}

static int teardown(void **state)
{
    (void)state;
    return td_proc_rmdir(tmp);
}

/* The single-rank reference: micro-batch 6, 20 steps (made once). */
#define STEPS 20
static double ref_loss[STEPS], ref_norm[STEPS];
static void reference(void)
{
    if (ref_loss[0] != 0) return;
    char out[256], args[2048], log[256];
    snprintf(out, sizeof out, "%s/ref.out", tmp);
    snprintf(log, sizeof log, "%s/ref.jsonl", tmp);
    snprintf(args, sizeof args, "--data %s/ok.tok " MODEL " --micro-batch 6 --steps %d --log %s", tmp, STEPS, log);
    assert_int_equal(run(out, "%s train %s", args), 0);
    assert_int_equal(td_proc_read_log(log, ref_loss, ref_norm, STEPS), STEPS);
}

/* 2 and 3 ranks (--nproc) with micro-batch 3 and 2: one rank's losses and
 * grad norms of the same global batch; each rank's AdamW on the CPU
 * (--policy cpu), and on 2 ranks with half the optimizer chunks homed on
 * the "device" (their shards updated there: the GPU AdamW's path) and 3
 * ranks with all of them (--policy cuda); and 2 ranks under a budget that
 * evicts chunks, in the cpu backend's debug mode; and two of them again
 * with each rank's shard updates on its AdamW thread (--adam-thread on),
 * to their losses bit for bit; and the evicting run with the cpu backend's
 * prefetch window given (--prefetch 4), to its losses bit for bit. */
static void test_ranks_match_one_rank(void **state)
{
    (void)state;
    reference();
    /* the budget that evicts: the plan's minimum for one rank of 2, and a little */
    char tight[96], pout[256], pargs[1024];
    snprintf(pout, sizeof pout, "%s/tight.out", tmp);
    snprintf(pargs, sizeof pargs, "--data %s/ok.tok " MODEL " --micro-batch 3 --nproc 2 --policy cpu --ckpt off --json --no-measure",
             tmp);
    assert_int_equal(run(pout, "%s plan %s", pargs), 0);
    const char *mb = strstr(td_proc_slurp(pout), "\"min_bytes\":");
    assert_non_null(mb);
    snprintf(tight, sizeof tight, "--policy cpu --ckpt off --gpu-budget %ld", strtol(mb + 12, NULL, 10) + 8192);
    char tight_thread[160], tight_window[160];
    snprintf(tight_thread, sizeof tight_thread, "%s --adam-thread on", tight);
    snprintf(tight_window, sizeof tight_window, "%s --prefetch 4", tight);
    /* c 5 and 6: each rank's shard updates on its AdamW thread, against the
     * same runs without it (c 1 and 4), bit for bit.  c 7: the evicting run
     * with the prefetch window fixed at the cpu backend's 4, bit for bit
     * the run that leaves it to the manager (c 4): on the cpu backend the
     * window is not measured.  A measured one came out 2 or 3 with the
     * machine's load, and under an evicting budget the window decides
     * which grad chunks are reduce-scattered between micro-batches, so the
     * losses differed from step 5 on by about 1e-9 from run to run. */
    /* c 8: the evicting run with the grads' reduce-scatters on a
     * communicator of their own (TD_REDUCE_COMM=own) instead of the
     * gathers', bit for bit: the same sums, whichever communicator carries
     * them. */
    const char *const policy[] = {"--policy cpu", "--policy cpu", "--policy static --offload-optim-frac 0.5",
                                  "--policy cuda", tight, "--policy cpu --adam-thread on", tight_thread, tight_window,
                                  tight};
    static const int ranks_of[] = {2, 3, 2, 3, 2, 3, 2, 2, 2}, same_as[] = {-1, -1, -1, -1, -1, 1, 4, 4, 4};
    double losses[9][STEPS];
    for (int c = 0; c < 9; c++) {
        int n = ranks_of[c];
        char out[256], args[2048], log[256];
        double loss[STEPS], norm[STEPS];
        snprintf(out, sizeof out, "%s/n%d_%d.out", tmp, n, c);
        snprintf(log, sizeof log, "%s/n%d_%d.jsonl", tmp, n, c);
        snprintf(args, sizeof args, "--data %s/ok.tok " MODEL " --micro-batch %d --steps %d --nproc %d --log %s %s",
                 tmp, 6 / n, STEPS, n, log, policy[c]);
        /* the last: chunks evicted and reloaded, under the cpu backend's debug
         * mode (a copy's destination poisoned until it lands: a collective or
         * an update that reads a chunk before its copy is done fails) */
        int rc = run(out, c == 8   ? "env TD_REDUCE_COMM=own TD_CPU_DEBUG=1 TD_CPU_DEBUG_DELAY_US=100 %s train %s"
                          : c == 4 || c >= 6 ? "env TD_CPU_DEBUG=1 TD_CPU_DEBUG_DELAY_US=100 %s train %s"
                                             : "%s train %s",
                     args);
        if (rc) fail_msg("%d ranks, %s: exit %d: %s", n, policy[c], rc, td_proc_slurp(out));
        assert_int_equal(td_proc_read_log(log, loss, norm, STEPS), STEPS);
        memcpy(losses[c], loss, sizeof loss);
        if (same_as[c] >= 0 && memcmp(losses[same_as[c]], loss, sizeof loss))
            for (int s = 0; s < STEPS; s++)
                if (losses[same_as[c]][s] != loss[s])
                    fail_msg("%d ranks, %s: step %d's loss %a, not the bits %a of the run with %s", n, policy[c], s + 1,
                             loss[s], losses[same_as[c]][s], policy[same_as[c]]);
        if (c == 4) { /* the window the manager chose on the cpu backend: 4, whatever the timing */
            const char *w = strstr(td_proc_slurp(log), "\"prefetch_window\":");
            assert_non_null(w);
            assert_int_equal(atoi(w + 18), 4);
        }
        td_proc_expect_close(ref_loss, loss, STEPS, 1e-5, n == 2 ? "loss, 2 ranks" : "loss, 3 ranks");
        /* The norm of a step whose grads cancel heavily (this data's step
         * 18 spikes to 15.8) carries the sums' reduction order further: 1e-3. */
        td_proc_expect_close(ref_norm, norm, STEPS, 1e-3, n == 2 ? "grad norm, 2 ranks" : "grad norm, 3 ranks");
        /* rank 0 alone prints progress: one final "step 20/20" line */
        const char *o = td_proc_slurp(out), *first = strstr(o, "step 20/20");
        assert_non_null(first);
        assert_null(strstr(first + 1, "step 20/20"));
        assert_non_null(strstr(o, "ZeRO-3"));
        assert_non_null(strstr(o, c == 8 ? "reduce-scattered on a communicator of their own"
                                         : "reduce-scattered on the gathers' communicator"));
    }
}

/* 4 ranks, and 4 ranks on two simulated hosts (two launches of --nproc 2
 * with NNODES=2 and NODE_RANK 0 and 1, each its own --host-ram): chunks
 * split over the 4 (--shard world) and over each host's 2, the hosts'
 * copies of a shard summed over the "network" (--shard node); and one rank
 * a host (--nproc 1, still a launch that joins the job); each gives one
 * rank's losses with the same global batch (micro-batch 4). */
static void test_four_ranks_and_two_hosts(void **state)
{
    (void)state;
    enum { N = 12 };
    double ref[N], got[N];
    char out[256], log[256], args[2048];
    snprintf(out, sizeof out, "%s/ref4.out", tmp);
    snprintf(log, sizeof log, "%s/ref4.jsonl", tmp);
    snprintf(args, sizeof args, "--data %s/ok.tok " MODEL " --micro-batch 4 --steps %d --log %s", tmp, N, log);
    assert_int_equal(run(out, "%s train %s", args), 0);
    assert_int_equal(td_proc_read_log(log, ref, NULL, N), N);
    snprintf(out, sizeof out, "%s/four.out", tmp);
    snprintf(log, sizeof log, "%s/four.jsonl", tmp);
    snprintf(args, sizeof args, "--data %s/ok.tok " MODEL " --micro-batch 1 --steps %d --nproc 4 --policy cpu --log %s",
             tmp, N, log);
    int rc = run(out, "%s train %s", args);
    if (rc) fail_msg("4 ranks: exit %d: %s", rc, td_proc_slurp(out));
    assert_int_equal(td_proc_read_log(log, got, NULL, N), N);
    td_proc_expect_close(ref, got, N, 1e-5, "loss, 4 ranks");
    {   /* the host's peak: its 4 ranks' footprints added (rank 0's the largest: the hub's buffers) */
        const char *l = td_proc_slurp(log), *node = strstr(l, "\"host_node_peak_bytes\":"), *host = strstr(l, "\"host\":{");
        assert_non_null(node);
        assert_non_null(host);
        const char *own = strstr(host, "\"peak_bytes\":");
        assert_non_null(own);
        double n = strtod(node + strlen("\"host_node_peak_bytes\":"), NULL), o = strtod(own + strlen("\"peak_bytes\":"), NULL);
        if (!(n >= 2 * o && n <= 4 * o)) fail_msg("the host's peak %.0f for 4 ranks, rank 0's %.0f", n, o);
    }
    static const char *const shard[] = {"node", "world", "world"};
    static const int per_host[] = {2, 2, 1};
    for (int c = 0; c < 3; c++) {
        char hout[2][256];
        int port = td_test_free_port();
        pid_t p[2];
        snprintf(log, sizeof log, "%s/hosts_%s%d.jsonl", tmp, shard[c], per_host[c]);
        for (int h = 0; h < 2; h++) {
            snprintf(hout[h], sizeof hout[h], "%s/hosts_%s%d_%d.out", tmp, shard[c], per_host[c], h);
            snprintf(args, sizeof args, "--data %s/ok.tok " MODEL " --micro-batch %d --steps %d --nproc %d --shard %s "
                     "--host-ram %dGiB --comm-timeout 60 --log %s", tmp, 2 / per_host[c], N, per_host[c], shard[c],
                     6 + 2 * h, log);
            p[h] = td_proc_start(hout[h], -1, 0, 0, "env NNODES=2 NODE_RANK=%d MASTER_ADDR=127.0.0.1 MASTER_PORT=%d "
                                 "%s train %s", h, port, tidal, args);
        }
        for (int h = 0; h < 2; h++) {
            rc = td_proc_finish(p[h], 300, "a simulated host");
            if (rc) fail_msg("--shard %s, host %d: exit %d: %s", shard[c], h, rc, td_proc_slurp(hout[h]));
        }
        assert_int_equal(td_proc_read_log(log, got, NULL, N), N); /* rank 0's, on host 0 */
        char what[64];
        snprintf(what, sizeof what, "loss, two hosts of %d ranks, --shard %s", per_host[c], shard[c]);
        td_proc_expect_close(ref, got, N, 1e-5, what);
        /* rank 0 says how the chunks are split */
        char split[32];
        snprintf(split, sizeof split, "split over %d ranks", c == 1 ? 4 : 2);
        if (!strstr(td_proc_slurp(hout[0]), split)) fail_msg("%s: no '%s' in %s", what, split, td_proc_slurp(hout[0]));
    }
}

/* `tidal plan --nproc N` on one host: the host holds each byte of the model
 * state once whatever N, so its bytes a param (host.node_state_bytes and
 * the whole host.node_bytes) for N = 1, 2 and 4 agree within 3%, and the
 * state is at most 16.2 bytes a param with fp32 AdamW state, 10.2 with bf16
 * and 8.2 with int8 (transient grads: no clipping, the AdamW thread). */
static void test_plan_node_bytes(void **state)
{
    (void)state;
    static const char *const st[] = {"fp32", "bf16", "int8"};
    static const double most[] = {16.2, 10.2, 8.2};
    for (int s = 0; s < 3; s++) {
        double node_pp[3], state_pp[3];
        for (int i = 0, n = 1; n <= 4; i++, n *= 2) {
            char out[256], args[1024];
            snprintf(out, sizeof out, "%s/pnode%d_%d.out", tmp, s, n);
            snprintf(args, sizeof args, "--model llama-3.1-8b --seq 1024 --micro-batch 1 --backend cpu --gpu-budget 256MiB "
                     "--host-ram 2TiB --optim-state %s%s --json --no-measure --nproc %d", st[s],
                     s ? " --clip-grad-norm 0 --adam-thread on --grad-slots 8" : "", n);
            int rc = run(out, "%s plan %s", args);
            const char *o = td_proc_slurp(out);
            if (rc != 0 && rc != 3) fail_msg("plan --nproc %d: exit %d: %s", n, rc, o);
            cJSON *root = cJSON_Parse(o);
            if (!root) fail_msg("plan --nproc %d: not JSON: %s", n, o);
            double params = td_test_json_num(root, "params", NULL);
            node_pp[i] = td_test_json_num(root, "host", "node_bytes") / params;
            state_pp[i] = td_test_json_num(root, "host", "node_state_bytes") / params;
            /* each rank holds about 1/N of it */
            double rank_pp = (double)td_test_json_num(root, "host", "total_bytes") / params;
            assert_true(rank_pp < node_pp[i] / n * 1.03);
            cJSON_Delete(root);
            if (state_pp[i] > most[s]) fail_msg("%s state, %d ranks: %.3f bytes a param on the host (at most %.1f)",
                                                st[s], n, state_pp[i], most[s]);
        }
        for (int i = 1; i < 3; i++) {
            if (fabs(node_pp[i] / node_pp[0] - 1) > 0.03 || fabs(state_pp[i] / state_pp[0] - 1) > 0.03)
                fail_msg("%s state: the host's bytes a param with %d ranks (%.3f, state %.3f) are not within 3%% of one "
                         "rank's (%.3f, state %.3f)", st[s], 1 << i, node_pp[i], state_pp[i], node_pp[0], state_pp[0]);
        }
    }
}

/* No clipping (nothing waits for the global norm; W7's setting): 2 ranks
 * with each rank's AdamW on its thread, which gets each shard in the
 * backward once it is reduce-scattered and written back, give one rank's
 * losses, and the bits of the same 2 ranks without the thread. */
static void test_no_clipping(void **state)
{
    (void)state;
    enum { N = 8 };
    double one[N], on[N], off[N];
    char timeline[300];
    snprintf(timeline, sizeof timeline, "--micro-batch 3 --nproc 2 --adam-thread on --trace-timeline %s/noclip.json", tmp);
    const char *const mode[] = {"--micro-batch 6", timeline, "--micro-batch 3 --nproc 2 --adam-thread off"};
    double *const loss[] = {one, on, off};
    for (int c = 0; c < 3; c++) {
        char out[256], log[256], args[2048];
        snprintf(out, sizeof out, "%s/noclip%d.out", tmp, c);
        snprintf(log, sizeof log, "%s/noclip%d.jsonl", tmp, c);
        snprintf(args, sizeof args,
                 "--data %s/ok.tok " MODEL " --clip-grad-norm 0 --grad-accum 1 --policy cpu --steps %d --log %s %s", tmp,
                 N, log, mode[c]);
        /* 2 ranks in the cpu backend's debug mode (a copy's destination
         * poisoned until it lands): an update that reads a shard before its
         * reduce-scatter and write-back are done fails */
        int rc = run(out, c ? "env TD_CPU_DEBUG=1 TD_CPU_DEBUG_DELAY_US=100 %s train %s" : "%s train %s", args);
        if (rc) fail_msg("%s: exit %d: %s", mode[c], rc, td_proc_slurp(out));
        assert_int_equal(td_proc_read_log(log, loss[c], NULL, N), N);
    }
    td_proc_expect_close(one, on, N, 1e-5, "no clipping, 2 ranks, AdamW thread");
    if (memcmp(on, off, sizeof on)) fail_msg("no clipping, 2 ranks: the AdamW thread changed the losses");
    for (int r = 0; r < 2; r++) { /* a timeline per rank (noclip.rankR.json), with its CPU AdamW slices */
        char path[300];
        snprintf(path, sizeof path, "%s/noclip.rank%d.json", tmp, r);
        FILE *f = fopen(path, "r");
        if (!f) fail_msg("no timeline %s", path);
        static char text[1 << 22];
        size_t n = fread(text, 1, sizeof text - 1, f);
        fclose(f);
        text[n] = '\0';
        cJSON *doc = cJSON_Parse(text);
        if (!doc) fail_msg("%s (%zu bytes): not JSON", path, n);
        cJSON_Delete(doc);
        assert_non_null(strstr(text, "\"AdamW chunk "));
        /* the driving thread's host time: an access that loads a chunk waits
         * for its shard's copy (a 100 us debug delay) and its gather */
        assert_non_null(strstr(text, "\"access chunk "));
    }
}

/* `tidal bench scaling`: 2 ranks against one rank with twice the
 * grad-accum, the same global batch: both runs' figures, losses equal to
 * 1e-5; flags that are the benchmark's own, or a missing --data, refused. */
static void test_bench_scaling(void **state)
{
    (void)state;
    char out[256], args[2048];
    snprintf(out, sizeof out, "%s/scaling.out", tmp);
    snprintf(args, sizeof args, "--nproc 2 --json --steps 4 --warmup 1 -- --data %s/ok.tok " MODEL " --micro-batch 3",
             tmp);
    int rc = run(out, "%s bench scaling %s", args);
    const char *o = td_proc_slurp(out);
    if (rc) fail_msg("bench scaling: exit %d: %s", rc, o);
    const char *j = strstr(o, "{\"nproc\":2");
    if (!j) fail_msg("no JSON object: %s", o);
    assert_non_null(strstr(j, "\"grad_accum\":2")); /* MODEL's, and the one rank's x2 */
    assert_non_null(strstr(j, "\"grad_accum\":4}"));
    /* The figures are measured and consistent: each run moves the same
     * global batch (2 ranks x B3 x accum 2 = 1 rank x B3 x accum 4, of T32)
     * a step, so tokens/s x step time gives 384 tokens for both (medians
     * of the same steps: to the printed rounding), and the speedup and
     * efficiency are the ratio of the two rates. */
    cJSON *root = cJSON_Parse(j);
    assert_non_null(root);
    assert_true(td_test_json_num(root, "loss_max_rel_diff", NULL) <= 1e-5);
    double r_ms = td_test_json_num(root, "ranks", "step_ms"), r_tps = td_test_json_num(root, "ranks", "tokens_per_s");
    double o_ms = td_test_json_num(root, "one", "step_ms"), o_tps = td_test_json_num(root, "one", "tokens_per_s");
    assert_true(r_ms > 0 && o_ms > 0 && r_tps > 0 && o_tps > 0);
    assert_true(fabs(r_tps * r_ms / 1e3 - 384) <= 384 * 0.02);
    assert_true(fabs(o_tps * o_ms / 1e3 - 384) <= 384 * 0.02);
    double speedup = td_test_json_num(root, "speedup", NULL);
    assert_true(fabs(speedup - r_tps / o_tps) <= 1e-3 * speedup);
    assert_true(fabs(td_test_json_num(root, "efficiency", NULL) - speedup / 2) <= 1e-3 * speedup);
    /* never above 100% without the reason beside it */
    const cJSON *note = cJSON_GetObjectItem(root, "efficiency_note");
    assert_true(speedup / 2 <= 1 ? note == NULL : cJSON_IsString(note) && strstr(note->valuestring, "above 100%"));
    assert_true(td_test_json_num(root, "ranks", "device_peak_bytes") > 0);
    cJSON_Delete(root);
    snprintf(args, sizeof args, "--nproc 2 -- --data %s/ok.tok " MODEL " --steps 3", tmp);
    assert_int_equal(run(out, "%s bench scaling %s", args), 2);
    assert_non_null(strstr(td_proc_slurp(out), "--steps is this benchmark's"));
    assert_int_equal(run(out, "%s bench scaling %s", "--nproc 2 -- " MODEL), 2);
    assert_non_null(strstr(td_proc_slurp(out), "--data"));
}

/* torchrun's variables, set here for two children, against --nproc 2: the
 * same bits (the same reduction order). */
static void test_env_launch_matches_nproc(void **state)
{
    (void)state;
    char out[2][256], log[256], log2[256], args[1024];
    snprintf(log, sizeof log, "%s/env.jsonl", tmp);
    snprintf(args, sizeof args, "--data %s/ok.tok " MODEL " --micro-batch 3 --steps 6 --log %s", tmp, log);
    int port = td_test_free_port();
    pid_t p[2];
    for (int r = 0; r < 2; r++) {
        snprintf(out[r], sizeof out[r], "%s/env%d.out", tmp, r);
        p[r] = td_proc_start(out[r], r, 2, port, "%s train %s", tidal, args);
    }
    for (int r = 0; r < 2; r++) {
        int rc = td_proc_finish(p[r], 240, "an environment-launched rank");
        if (rc) fail_msg("rank %d: exit %d: %s", r, rc, td_proc_slurp(out[r]));
    }
    assert_null(strstr(td_proc_slurp(out[1]), "step 6/6")); /* rank 1 prints no progress */
    char o[256];
    snprintf(o, sizeof o, "%s/np.out", tmp);
    snprintf(log2, sizeof log2, "%s/np.jsonl", tmp);
    snprintf(args, sizeof args, "--data %s/ok.tok " MODEL " --micro-batch 3 --steps 6 --nproc 2 --log %s", tmp, log2);
    assert_int_equal(run(o, "%s train %s", args), 0);
    double a[6], b[6];
    assert_int_equal(td_proc_read_log(log, a, NULL, 6), 6);
    assert_int_equal(td_proc_read_log(log2, b, NULL, 6), 6);
    for (int i = 0; i < 6; i++) assert_true(a[i] == b[i]);
}

/* Saved on 2 ranks after 10 steps (half the optimizer shards on the
 * "device"), resumed on 1 and on 3: the single-rank run's steps 11..20;
 * saved on 1, resumed on 2 likewise. */
static void test_resume_on_other_rank_counts(void **state)
{
    (void)state;
    reference();
    struct { int save_n, resume_n; } cases[] = {{2, 1}, {2, 3}, {1, 2}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        char out[256], args[2048], log[256], ck[256];
        int sn = cases[c].save_n, rn = cases[c].resume_n;
        snprintf(ck, sizeof ck, "%s/ck%d", tmp, sn);
        snprintf(out, sizeof out, "%s/save%d.out", tmp, sn);
        if (c != 1) { /* case 1 resumes case 0's checkpoint */
            snprintf(args, sizeof args, "--data %s/ok.tok " MODEL " --micro-batch %d --steps %d --stop-after 10 "
                     "--save %s%s", tmp, 6 / sn, STEPS, ck,
                     sn > 1 ? " --nproc 2 --policy static --offload-optim-frac 0.5" : "");
            int rc = run(out, "%s train %s", args);
            if (rc) fail_msg("save on %d: exit %d: %s", sn, rc, td_proc_slurp(out));
        }
        snprintf(out, sizeof out, "%s/resume%d_%d.out", tmp, sn, rn);
        snprintf(log, sizeof log, "%s/resume%d_%d.jsonl", tmp, sn, rn);
        char np[32] = "";
        if (rn > 1) snprintf(np, sizeof np, " --nproc %d", rn);
        snprintf(args, sizeof args, "--data %s/ok.tok " MODEL " --micro-batch %d --steps %d --resume %s --log %s%s",
                 tmp, 6 / rn, STEPS, ck, log, np);
        int rc = run(out, "%s train %s", args);
        if (rc) fail_msg("save on %d, resume on %d: exit %d: %s", sn, rn, rc, td_proc_slurp(out));
        double loss[STEPS];
        assert_int_equal(td_proc_read_log(log, loss, NULL, STEPS), STEPS - 10);
        char what[64];
        snprintf(what, sizeof what, "saved on %d, resumed on %d", sn, rn);
        td_proc_expect_close(ref_loss + 10, loss, STEPS - 10, 1e-5, what);
    }
}

/* --optim-state int8 and bf16: the moments' shards (int8: shards start on a
 * scale block, so a rank's blocks are one rank's) give one rank's losses,
 * and a checkpoint of 2 ranks continues them on 3. */
static void test_compact_state_shards(void **state)
{
    (void)state;
    for (int bf = 0; bf < 2; bf++) {
        const char *st = bf ? "bf16" : "int8";
        char out[256], args[2048], log[3][256], ck[256];
        double ref[12], a[12], b[12];
        snprintf(ck, sizeof ck, "%s/ck_%s", tmp, st);
        for (int k = 0; k < 3; k++) snprintf(log[k], sizeof log[k], "%s/%s%d.jsonl", tmp, st, k);
        snprintf(out, sizeof out, "%s/%s.out", tmp, st);
        snprintf(args, sizeof args, "--data %s/ok.tok " MODEL " --optim-state %s --micro-batch 6 --steps 12 --log %s",
                 tmp, st, log[0]);
        assert_int_equal(run(out, "%s train %s", args), 0);
        snprintf(args, sizeof args, "--data %s/ok.tok " MODEL " --optim-state %s --micro-batch 3 --steps 12 "
                 "--stop-after 6 --save %s --nproc 2 --log %s", tmp, st, ck, log[1]);
        int rc = run(out, "%s train %s", args);
        if (rc) fail_msg("%s on 2 ranks: exit %d: %s", st, rc, td_proc_slurp(out));
        snprintf(args, sizeof args, "--data %s/ok.tok " MODEL " --optim-state %s --micro-batch 2 --steps 12 "
                 "--resume %s --nproc 3 --log %s", tmp, st, ck, log[2]);
        rc = run(out, "%s train %s", args);
        if (rc) fail_msg("%s resumed on 3 ranks: exit %d: %s", st, rc, td_proc_slurp(out));
        assert_int_equal(td_proc_read_log(log[0], ref, NULL, 12), 12);
        assert_int_equal(td_proc_read_log(log[1], a, NULL, 12), 6);
        assert_int_equal(td_proc_read_log(log[2], b, NULL, 12), 6);
        /* bf16: v's stochastic rounding hashes the index in the shard, not the
         * chunk: the same in distribution, apart by rounding noise */
        td_proc_expect_close(ref, a, 6, bf ? 1e-4 : 1e-5, bf ? "bf16 moments, 2 ranks" : "int8 moments, 2 ranks");
        td_proc_expect_close(ref + 6, b, 6, bf ? 1e-4 : 1e-5, bf ? "bf16 moments, resumed on 3" : "int8 moments, resumed on 3");
    }
}

/* Rank 1 killed (SIGKILL) mid-run, and separately stopped (SIGSTOP): rank 0
 * exits non-zero within --comm-timeout, naming rank 1. */
static void test_dead_or_hung_rank(void **state)
{
    (void)state;
    for (int hang = 0; hang < 2; hang++) {
        char out[2][256], log[256], args[1024];
        snprintf(log, sizeof log, "%s/dead%d.jsonl", tmp, hang);
        snprintf(args, sizeof args, "--data %s/ok.tok " MODEL " --micro-batch 3 --steps 100000 --comm-timeout 3 "
                 "--log %s", tmp, log);
        int port = td_test_free_port();
        pid_t p[2];
        for (int r = 0; r < 2; r++) {
            snprintf(out[r], sizeof out[r], "%s/dead%d_%d.out", tmp, hang, r);
            p[r] = td_proc_start(out[r], r, 2, port, "%s train %s", tidal, args);
        }
        /* until rank 0 has logged two steps: the ranks are in the step loop */
        double t0 = td_proc_now_s(), loss[4];
        while (td_proc_read_log(log, loss, NULL, 4) < 2 && td_proc_now_s() - t0 < 120) usleep(20000);
        kill(p[1], hang ? SIGSTOP : SIGKILL);
        double t1 = td_proc_now_s();
        int rc = td_proc_finish(p[0], 60, "rank 0 after rank 1 stopped");
        double took = td_proc_now_s() - t1;
        if (hang) {
            kill(p[1], SIGKILL);
            kill(p[1], SIGCONT);
        }
        td_proc_finish(p[1], 30, "rank 1");
        const char *o = td_proc_slurp(out[0]);
        if (rc == 0 || !strstr(o, "rank 1")) fail_msg("rank 0 exit %d (want non-zero) naming rank 1: %s", rc, o);
        /* at once for a closed connection; the timeout (3 s) plus teardown for a hung one */
        assert_true(took < (hang ? 3 + 20 : 20));
    }
}

/* Under --nproc: a rank killed from outside ends the job; the launcher exits
 * non-zero naming it, and no rank is left. */
static void test_nproc_killed_rank(void **state)
{
    (void)state;
    char out[256], args[1024], cmd[1024];
    snprintf(out, sizeof out, "%s/npk.out", tmp);
    snprintf(args, sizeof args, "--data %s/ok.tok " MODEL " --micro-batch 3 --steps 100000 --comm-timeout 5 --nproc 2",
             tmp);
    pid_t p = td_proc_start(out, -1, 0, 0, "%s train %s", tidal, args);
    /* rank 1: the child of the launcher with RANK=1 in its environment */
    pid_t victim = 0;
    double t0 = td_proc_now_s();
    while (!victim && td_proc_now_s() - t0 < 60) {
        usleep(100000);
        snprintf(cmd, sizeof cmd, "for c in $(cat /proc/%d/task/*/children 2>/dev/null); do "
                 "tr '\\0' '\\n' < /proc/$c/environ 2>/dev/null | grep -qx RANK=1 && echo $c; done", (int)p);
        FILE *f = popen(cmd, "r");
        if (f) {
            int v = 0;
            if (fscanf(f, "%d", &v) == 1) victim = v;
            pclose(f);
        }
    }
    assert_true(victim > 0);
    usleep(300000); /* into the step loop or the start: either must end the job */
    kill(victim, SIGKILL);
    int rc = td_proc_finish(p, 60, "the --nproc launcher after a rank was killed");
    assert_int_not_equal(rc, 0);
    assert_non_null(strstr(td_proc_slurp(out), "rank 1"));
    snprintf(cmd, sizeof cmd, "kill -0 %d 2>/dev/null", (int)victim);
    assert_int_not_equal(system(cmd), 0);
}

/* One rank with another --lr, or another data file: both refused at start
 * naming the difference. */
static void test_mismatched_flags(void **state)
{
    (void)state;
    /* c 0: --lr; c 1: the data file; c 2: TD_REDUCE_COMM */
    static const char *const what[] = {"--lr and both values", "data file", "TD_REDUCE_COMM"};
    for (int c = 0; c < 3; c++) {
        char out[2][256], args[2048];
        int port = td_test_free_port();
        pid_t p[2];
        for (int r = 0; r < 2; r++) {
            snprintf(out[r], sizeof out[r], "%s/mm%d_%d.out", tmp, c, r);
            snprintf(args, sizeof args, "--data %s/%s " MODEL " --micro-batch 3 --steps 2 --comm-timeout 20%s", tmp,
                     c == 1 && r ? "other.tok" : "ok.tok", !c && r ? " --lr 0.001" : "");
            p[r] = td_proc_start(out[r], r, 2, port, "%s%s train %s", c == 2 && r ? "env TD_REDUCE_COMM=own " : "",
                                 tidal, args);
        }
        for (int r = 0; r < 2; r++) {
            int rc = td_proc_finish(p[r], 120, "a rank with a mismatched flag");
            const char *o = td_proc_slurp(out[r]);
            int named = c == 2   ? strstr(o, "ranks disagree on TD_REDUCE_COMM") != NULL
                        : c == 1 ? strstr(o, "ranks disagree on the data file") != NULL
                                 : strstr(o, "ranks disagree on --lr") && strstr(o, "'0.003'") && strstr(o, "'0.001'");
            if (rc == 0 || !named) fail_msg("rank %d: exit %d, want a refusal naming the %s: %s", r, rc, what[c], o);
            assert_null(strstr(o, "step 1/2"));
        }
    }
    /* a value that names neither: refused before anything starts */
    char out[256], args[512];
    snprintf(out, sizeof out, "%s/rc_bad.out", tmp);
    snprintf(args, sizeof args, "--data %s/ok.tok " MODEL " --micro-batch 3 --steps 2 --nproc 2", tmp);
    assert_int_not_equal(run(out, "env TD_REDUCE_COMM=both %s train %s", args), 0);
    assert_non_null(strstr(td_proc_slurp(out), "TD_REDUCE_COMM=both: use shared"));
}

/* MASTER_PORT already taken on rank 0's host: a clear error, at once. */
static void test_busy_port(void **state)
{
    (void)state;
    int s = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(s >= 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    assert_int_equal(bind(s, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(s, 1), 0);
    socklen_t len = sizeof a;
    assert_int_equal(getsockname(s, (struct sockaddr *)&a, &len), 0);
    char out[256], args[1024];
    snprintf(out, sizeof out, "%s/busy.out", tmp);
    snprintf(args, sizeof args, "--data %s/ok.tok " MODEL " --micro-batch 3 --steps 2 --comm-timeout 5", tmp);
    pid_t p = td_proc_start(out, 0, 2, ntohs(a.sin_port), "%s train %s", tidal, args);
    int rc = td_proc_finish(p, 60, "rank 0 on a busy port");
    close(s);
    const char *o = td_proc_slurp(out);
    if (rc == 0 || !strstr(o, "already in use")) fail_msg("exit %d, want 'already in use': %s", rc, o);
}

/* `tidal plan --nproc N`: each rank's host holds 1/N of the optimizer state
 * (page-rounded shards) and plans against 1/N of the host's RAM. */
static void test_plan_per_rank(void **state)
{
    (void)state;
    char out[256], args[1024];
    long opt[4] = {0}, ram[4] = {0};
    for (int n = 1; n <= 4; n *= 2) {
        snprintf(out, sizeof out, "%s/plan%d.out", tmp, n);
        snprintf(args, sizeof args, "--layers 4 --width 256 --heads 4 --seq 64 --vocab 512 --backend cpu "
                 "--gpu-budget 256MiB --policy cpu --json --no-measure --nproc %d", n);
        assert_int_equal(run(out, "%s plan %s", args), 0);
        const char *o = td_proc_slurp(out), *k = strstr(o, "\"pageable_optimizer_bytes\":");
        assert_non_null(k);
        opt[n - 1] = strtol(k + 27, NULL, 10);
        const char *r = strstr(o, "\"ram_bytes\":");
        assert_non_null(r);
        ram[n - 1] = strtol(r + 12, NULL, 10);
        if (n > 1) {
            char want[64];
            snprintf(want, sizeof want, "\"ranks\":%d", n);
            assert_non_null(strstr(o, want));
        }
    }
    /* 1/N up to a page per shard and the shards' rounding */
    assert_true(opt[1] < opt[0] / 2 + opt[0] / 20);
    assert_true(opt[3] < opt[0] / 4 + opt[0] / 10);
    assert_true(opt[3] > opt[0] / 4 - opt[0] / 20);
    /* N local ranks share the host's RAM less the system's share and each
     * process's (64 MiB on the cpu backend): ram[0] + 64 MiB is the host's
     * figure less the system's */
    long host = ram[0] + (64L << 20);
    assert_int_equal(ram[1], (host - 2 * (64L << 20)) / 2);
    assert_int_equal(ram[3], (host - 4 * (64L << 20)) / 4);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ranks_match_one_rank),
        cmocka_unit_test(test_four_ranks_and_two_hosts),
        cmocka_unit_test(test_plan_node_bytes),
        cmocka_unit_test(test_no_clipping),
        cmocka_unit_test(test_bench_scaling),
        cmocka_unit_test(test_env_launch_matches_nproc),
        cmocka_unit_test(test_resume_on_other_rank_counts),
        cmocka_unit_test(test_compact_state_shards),
        cmocka_unit_test(test_dead_or_hung_rank),
        cmocka_unit_test(test_nproc_killed_rank),
        cmocka_unit_test(test_mismatched_flags),
        cmocka_unit_test(test_busy_port),
        cmocka_unit_test(test_plan_per_rank),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
