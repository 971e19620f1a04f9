/* `tidal bench scaling`: what N ranks (GPUs) buy over one, on the user's own
 * run.  It trains the given `tidal train` flags twice, one run after the
 * other: on N local ranks (--nproc N, ZeRO-3), and on one rank with N times
 * the gradient accumulation, so both take the same global batch of
 * N x micro-batch x grad-accum sequences a step and each GPU holds the same
 * micro-batch under the same budget.  It prints each run's median step time
 * and tokens/s over the steps after the warm-up, its device peak (rank 0's),
 * the speed-up and its efficiency (speed-up / N), and how far apart the two
 * runs' losses are (they differ only in the order of the sums).
 *
 * The runs are separate processes of this program (`tidal train ... --log`),
 * so each starts as a user's would; their logs and output stay in --keep DIR
 * when given (a temporary directory otherwise, removed at the end). */
#include "../cli/args.h"
#include "../cli/cli.h"
#include "tidal/alloc.h"
#include "tidal/util.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *const usage =
    "usage: tidal bench scaling --nproc N [options] -- TRAIN FLAGS...\n\n"
    "Trains the `tidal train` flags after -- twice: on N local ranks (ZeRO-3, one GPU a rank on\n"
    "cuda), then on one rank with N times the --grad-accum, the same global batch; prints each\n"
    "run's median step and tokens/s after the warm-up, its device peak, the speed-up and its\n"
    "efficiency, and how far apart the two runs' losses are.  --steps and --log are this\n"
    "benchmark's; --nproc goes before the --.\n\n"
    "  tidal bench scaling --nproc 2 -- --data data.tok --model gpt2-1.5b --micro-batch 32 \\\n"
    "      --gpu-budget 24GiB --backend cuda --precision bf16";

enum { MAX_STEPS = 10000 };

typedef struct run_figures {
    int steps;
    double step_ms, tokens_per_s;   /* medians after the warm-up */
    double peak_bytes;              /* the last step's device peak (rank 0's) */
    double loss[MAX_STEPS];
} run_figures;

/* The figures of a --log file; the step count read, or -1. */
static int read_log(const char *path, int warmup, run_figures *f)
{
    FILE *in = fopen(path, "r");
    if (!in) return -1;
    static double ms[MAX_STEPS], tps[MAX_STEPS];
    int n = 0, timed = 0;
    char line[1 << 14];
    while (n < MAX_STEPS && fgets(line, sizeof line, in)) {
        cJSON *o = cJSON_Parse(line);
        if (!o) continue;
        const cJSON *loss = cJSON_GetObjectItem(o, "loss"), *sm = cJSON_GetObjectItem(o, "step_ms"),
                    *tp = cJSON_GetObjectItem(o, "tokens_per_s"), *pk = cJSON_GetObjectItem(o, "device_peak_bytes");
        if (cJSON_IsNumber(loss) && cJSON_IsNumber(sm) && cJSON_IsNumber(tp)) {
            f->loss[n] = loss->valuedouble;
            if (n >= warmup) {
                ms[timed] = sm->valuedouble;
                tps[timed++] = tp->valuedouble;
            }
            if (cJSON_IsNumber(pk)) f->peak_bytes = pk->valuedouble;
            n++;
        }
        cJSON_Delete(o);
    }
    fclose(in);
    f->steps = n;
    if (!timed) return n;
    f->step_ms = td_median(ms, timed);
    f->tokens_per_s = td_median(tps, timed);
    return n;
}

/* The value of the last `--name V` / `--name=V` among the flags, or NULL. */
static const char *flag_value(int argc, char **argv, const char *name)
{
    const char *v = NULL;
    size_t len = strlen(name);
    for (int i = 0; i < argc; i++) {
        if (strncmp(argv[i], "--", 2) || strncmp(argv[i] + 2, name, len)) continue;
        const char *rest = argv[i] + 2 + len;
        if (*rest == '=') v = rest + 1;
        else if (!*rest && i + 1 < argc) v = argv[++i];
    }
    return v;
}

/* The run's --grad-accum: its flag, else the --config file's "grad-accum",
 * else 1; 0 with a message when it is not a positive integer. */
static long grad_accum_of(int argc, char **argv)
{
    const char *v = flag_value(argc, argv, "grad-accum"), *cfg = flag_value(argc, argv, "config");
    long k = 1;
    if (v) {
        char *end;
        errno = 0;
        k = strtol(v, &end, 10);
        if (errno || *end || k < 1) {
            fprintf(stderr, "tidal bench scaling: --grad-accum '%s': give a positive integer\n", v);
            return 0;
        }
        return k;
    }
    if (!cfg) return 1;
    FILE *f = fopen(cfg, "r");
    if (!f) {
        fprintf(stderr, "tidal bench scaling: cannot read --config %s: %s\n", cfg, strerror(errno));
        return 0;
    }
    static char text[1 << 16];
    size_t n = fread(text, 1, sizeof text - 1, f);
    text[n] = '\0';
    fclose(f);
    cJSON *o = cJSON_Parse(text);
    const cJSON *ga = o ? cJSON_GetObjectItem(o, "grad-accum") : NULL;
    if (cJSON_IsNumber(ga)) k = (long)ga->valuedouble;
    cJSON_Delete(o);
    if (k < 1) {
        fprintf(stderr, "tidal bench scaling: --config %s: grad-accum must be a positive integer\n", cfg);
        return 0;
    }
    return k;
}

/* Runs `exe train FLAGS EXTRA...` with its output into `out`; its exit status. */
static int train(const char *exe, int argc, char **argv, char **extra, const char *out)
{
    int n_extra = 0;
    while (extra[n_extra]) n_extra++;
    char **args = td_calloc((size_t)(argc + n_extra + 3), sizeof *args, TD_ROLE_META);
    if (!args) return 1;
    int k = 0;
    args[k++] = (char *)exe;
    args[k++] = "train";
    for (int i = 0; i < argc; i++) args[k++] = argv[i];
    for (int i = 0; i < n_extra; i++) args[k++] = extra[i];
    args[k] = NULL;
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        td_free(args);
        return 1;
    }
    if (pid == 0) {
        FILE *o = freopen(out, "w", stdout);
        if (!o || dup2(fileno(stdout), 2) < 0) _exit(127);
        execv(exe, args);
        _exit(127);
    }
    td_free(args);
    int status;
    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR) return 1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* The last lines of a run's output, to say why it failed. */
static void print_tail(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) return;
    static char buf[4096];
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, size > (long)sizeof buf - 1 ? size - (long)sizeof buf + 1 : 0, SEEK_SET);
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fclose(f);
    fprintf(stderr, "%s", buf);
}

/* The figures, as a table or one JSON object.  An efficiency above 100%
 * is never printed bare: the one-rank run then took longer per sequence
 * than each rank, which says more about the host than about the ranks. */
static td_status report(const run_figures *fig, int nproc, int steps, int warmup, long accum, int json)
{
    double worst = 0;
    for (int s = 0; s < steps; s++) {
        double d = fabs(fig[0].loss[s] - fig[1].loss[s]) / fmax(fabs(fig[1].loss[s]), 1e-30);
        if (d > worst || isnan(d)) worst = d;
    }
    double speedup = fig[0].tokens_per_s / fig[1].tokens_per_s, efficiency = speedup / nproc;
    char cores[160], why[400] = "";
    td_train_default_threads(NULL, cores, sizeof cores);
    if (efficiency > 1)
        snprintf(why, sizeof why, "above 100%%: the one-rank run took longer per sequence than each of the %d ranks; "
                 "it is no fair baseline here (this host: %s); on a shared or oversubscribed host compare runs "
                 "with --threads fixed", nproc, cores);
    if (json) {
        cJSON *j = cJSON_CreateObject(), *ranks, *one;
        cJSON_AddNumberToObject(j, "nproc", nproc);
        cJSON_AddNumberToObject(j, "steps", steps);
        cJSON_AddNumberToObject(j, "warmup", warmup);
        cJSON_AddNumberToObject(j, "grad_accum", (double)accum);
        ranks = cJSON_AddObjectToObject(j, "ranks");
        one = cJSON_AddObjectToObject(j, "one");
        for (int r = 0; r < 2; r++) {
            cJSON *o = r ? one : ranks;
            cJSON_AddNumberToObject(o, "step_ms", fig[r].step_ms);
            cJSON_AddNumberToObject(o, "tokens_per_s", fig[r].tokens_per_s);
            cJSON_AddNumberToObject(o, "device_peak_bytes", fig[r].peak_bytes);
        }
        cJSON_AddNumberToObject(one, "grad_accum", (double)(accum * nproc));
        cJSON_AddNumberToObject(j, "speedup", speedup);
        cJSON_AddNumberToObject(j, "efficiency", efficiency);
        if (*why) cJSON_AddStringToObject(j, "efficiency_note", why);
        cJSON_AddNumberToObject(j, "loss_max_rel_diff", worst);
        return td_cli_print_json(j);
    }
    printf("tidal bench scaling: %d ranks against 1 at the same global batch; medians of steps %d-%d\n\n", nproc,
           warmup + 1, steps);
    printf("%-8s %-12s %10s %12s %14s\n", "ranks", "grad-accum", "step ms", "tokens/s", "device peak");
    for (int r = 0; r < 2; r++) {
        char peak[32];
        td_format_bytes((size_t)fig[r].peak_bytes, peak, sizeof peak);
        printf("%-8d %-12ld %10.1f %12.0f %14s\n", r ? 1 : nproc, r ? accum * nproc : accum, fig[r].step_ms,
               fig[r].tokens_per_s, peak);
    }
    printf("\nspeed-up %.2fx on %d ranks (efficiency %.0f%%%s%s); losses within %.2g relative of each other over %d "
           "steps\n", speedup, nproc, 100 * efficiency, *why ? ": " : "", why, worst, steps);
    return TD_OK;
}

/* The options before the --, and the train flags after it: -1 to go on,
 * else the exit code. */
static int scaling_args(int argc, char **argv, int *nproc, int *steps, int *warmup, int *json, const char **keep,
                        int *targc, char ***targv, long *accum)
{
    td_opt table[] = {
        {"nproc", TD_OPT_INT, nproc, "N", "ranks of the first run (one GPU a rank on cuda); required, at least 2", 0},
        {"steps", TD_OPT_INT, steps, "S", "optimizer steps of each run (default 8)", 0},
        {"warmup", TD_OPT_INT, warmup, "W", "untimed first steps (default 3)", 0},
        {"json", TD_OPT_FLAG, json, NULL, "print the figures as one JSON object", 0},
        {"keep", TD_OPT_STRING, keep, "DIR", "keep the runs' logs and output in DIR (created; default: a temporary "
         "directory, removed)", 0},
        {NULL, 0, NULL, NULL, NULL, 0},
    };
    int sep = 0;
    while (sep < argc && strcmp(argv[sep], "--")) sep++;
    int rc = td_args_main(table, sep, argv, "bench scaling", usage);
    if (rc >= 0) return rc;
    td_args_free();
    *targc = sep < argc ? argc - sep - 1 : 0;
    *targv = argv + sep + 1;
    if (*nproc < 2 || *steps <= *warmup || *warmup < 0 || *steps > MAX_STEPS) {
        fprintf(stderr, "tidal bench scaling: %s\n", *nproc < 2 ? "--nproc N: give at least 2 ranks"
                : *steps > MAX_STEPS ? "--steps: at most 10000" : "--steps must exceed --warmup (>= 0)");
        return 2;
    }
    if (!*targc || !flag_value(*targc, *targv, "data")) {
        fprintf(stderr, "tidal bench scaling: give the run's `tidal train` flags after --, --data among them "
                "(tidal bench scaling --help)\n");
        return 2;
    }
    static const char *const ours[] = {"nproc", "steps", "log"};
    for (size_t i = 0; i < sizeof ours / sizeof ours[0]; i++)
        if (flag_value(*targc, *targv, ours[i]) || (i == 0 && getenv("WORLD_SIZE"))) {
            fprintf(stderr, "tidal bench scaling: --%s is this benchmark's%s; drop it from the train flags\n", ours[i],
                    i == 0 ? " (before the --), and it runs as one process, not under a launcher" : "");
            return 2;
        }
    *accum = grad_accum_of(*targc, *targv);
    return *accum ? -1 : 2;
}

/* The directory for the runs' logs: --keep DIR, or a temporary one.  -1,
 * else the exit code. */
static int scaling_dir(const char *keep, char *dir, size_t n)
{
    if (keep) {
        snprintf(dir, n, "%s", keep);
        if (mkdir(dir, 0777) && errno != EEXIST) {
            fprintf(stderr, "tidal bench scaling: cannot create --keep %s: %s\n", dir, strerror(errno));
            return 2;
        }
        return -1;
    }
    const char *tmp = getenv("TMPDIR");
    snprintf(dir, n, "%s/tidal-scaling-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(dir)) {
        fprintf(stderr, "tidal bench scaling: cannot create a temporary directory: %s\n", strerror(errno));
        return 1;
    }
    return -1;
}

int td_bench_scaling_main(int argc, char **argv)
{
    int nproc = 0, steps = 8, warmup = 3, json = 0, targc = 0, rc;
    const char *keep = NULL;
    char **targv = NULL, exe[4096], dir[4096];
    long accum = 0;
    if ((rc = scaling_args(argc, argv, &nproc, &steps, &warmup, &json, &keep, &targc, &targv, &accum)) >= 0) return rc;
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (len <= 0) {
        fprintf(stderr, "tidal bench scaling: cannot find this program (/proc/self/exe) to run `tidal train`\n");
        return 1;
    }
    exe[len] = '\0';
    if ((rc = scaling_dir(keep, dir, sizeof dir)) >= 0) return rc;
    static run_figures fig[2];
    char nproc_s[16], steps_s[16], accum_s[32], log[2][4200], out[2][4200];
    snprintf(nproc_s, sizeof nproc_s, "%d", nproc);
    snprintf(steps_s, sizeof steps_s, "%d", steps);
    snprintf(accum_s, sizeof accum_s, "%ld", accum * nproc);
    static const char *const name[2] = {"ranks", "one"};
    rc = 0;
    for (int r = 0; r < 2 && !rc; r++) {
        snprintf(log[r], sizeof log[r], "%s/%s.jsonl", dir, name[r]);
        snprintf(out[r], sizeof out[r], "%s/%s.out", dir, name[r]);
        char *many[] = {"--steps", steps_s, "--log", log[r], "--nproc", nproc_s, NULL};
        char *one[] = {"--steps", steps_s, "--log", log[r], "--grad-accum", accum_s, NULL};
        fprintf(stderr, "tidal bench scaling: %s, %d steps ...\n", r ? "1 rank, grad-accum x N" : "N ranks", steps);
        int code = train(exe, targc, targv, r ? one : many, out[r]);
        if (code) {
            fprintf(stderr, "tidal bench scaling: the run on %s failed (exit %d); its output (%s) ends:\n",
                    r ? "1 rank" : "the ranks", code, out[r]);
            print_tail(out[r]);
            rc = 1;
        } else if (read_log(log[r], warmup, &fig[r]) != steps) {
            fprintf(stderr, "tidal bench scaling: %s holds %d of %d steps\n", log[r], fig[r].steps, steps);
            rc = 1;
        }
    }
    if (!rc && report(fig, nproc, steps, warmup, accum, json)) {
        fprintf(stderr, "tidal bench scaling: %s\n", td_error_msg());
        rc = 1;
    }
    if (!keep && !rc) { /* a failed run's output stays where the message said */
        for (int r = 0; r < 2; r++) {
            unlink(log[r]);
            unlink(out[r]);
        }
        rmdir(dir);
    }
    return rc;
}
