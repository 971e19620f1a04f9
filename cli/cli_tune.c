/* `tidal tune`: ranks a run's knobs by the plan's model for a device budget
 * (or several), runs the best few, and reports the fastest (see
 * include/tidal/tune.h).  Its own options are taken out of argv here; the
 * rest are `tidal train`'s. */
#include "cli.h"
#include "train_opts.h"
#include "tidal/data.h"
#include "tidal/tune.h"
#include "tidal/util.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char usage[] =
    "usage: tidal tune --data FILE [--model PRESET ...] (--gpu-budget SIZE | --sweep-budget S1,S2,...)\n"
    "                  [--top K] [--steps N] [--write-config FILE] [--plot FILE.svg] [--json] [train options]\n\n"
    "Finds the fastest way to train a model under a device budget.  Every split of the step's\n"
    "sequences into micro-batch x grad-accum (the tokens per step stay), checkpointed blocks (none,\n"
    "a quarter, half, three quarters, all), optimizer share on the GPU and chunk size is planned and\n"
    "ranked by its step bound (`tidal plan`'s model, from rates measured once); the best --top K\n"
    "(default 3) that fit train for --steps N (default 5; the first is the warm-up, the median of the\n"
    "rest counts), then the fastest again at prefetch depths 2, 8 and 16.  Prints a table (tokens/s,\n"
    "device peak, pinned host, bound/step) and the winner's flags.\n\n"
    "tune's own options:\n"
    "  --sweep-budget LIST  device budgets to tune for, e.g. 8GiB,16GiB,24GiB: tokens/s against\n"
    "                       the budget (what more GPU memory is worth); instead of --gpu-budget;\n"
    "                       each budget also runs the smaller budgets' fastest winner if its\n"
    "                       ranking leaves that out\n"
    "  --top K              candidates to run at each budget (default 3)\n"
    "  --write-config FILE  the winner as a --config JSON for `tidal train --config FILE`\n"
    "                       (one budget only)\n"
    "  --plot FILE.svg      tokens/s against the budget as an SVG plot\n"
    "  --json               everything as one JSON object on stdout\n\n"
    "Without --gpu-budget or --sweep-budget, the budget is the free device memory less a margin.\n"
    "The model, run and optimizer options of `tidal train` below are taken too.";

typedef struct tune_opts {
    int top, json, help;
    const char *sweep, *write_config, *plot;
} tune_opts;

/* Takes tune's own options out of argv (rest: the others, in order). */
static int split_args(int argc, char **argv, tune_opts *o, char **rest, int *n_rest)
{
    *n_rest = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        const char **dst = !strcmp(a, "--sweep-budget") ? &o->sweep : !strcmp(a, "--write-config") ? &o->write_config
                         : !strcmp(a, "--plot") ? &o->plot : NULL;
        if (dst || !strcmp(a, "--top")) {
            if (i + 1 >= argc) {
                fprintf(stderr, "tidal tune: %s needs a value\n", a);
                return 2;
            }
            if (dst) {
                *dst = argv[++i];
            } else {
                char *end;
                errno = 0;
                long k = strtol(argv[++i], &end, 10);
                if (errno || *end || end == argv[i] || k < 1 || k > 1000) {
                    fprintf(stderr, "tidal tune: --top '%s': give a count from 1 to 1000\n", argv[i]);
                    return 2;
                }
                o->top = (int)k;
            }
        } else if (!strcmp(a, "--json")) {
            o->json = 1;
        } else {
            rest[(*n_rest)++] = argv[i];
        }
    }
    return -1;
}

static int cmp_size(const void *a, const void *b)
{
    size_t x = *(const size_t *)a, y = *(const size_t *)b;
    return (x > y) - (x < y);
}

/* "8GiB,16GiB,24GiB" -> sorted budgets; errors name the bad item. */
static td_status parse_sweep(const char *text, size_t **out, int *n)
{
    *out = NULL;
    *n = 0;
    size_t len = strlen(text);
    if (!len) return td_error_set(TD_ERR_INVALID, "--sweep-budget is empty; give sizes such as 8GiB,16GiB,24GiB");
    size_t *b = td_malloc((len + 1) * sizeof *b, TD_ROLE_META);
    char *copy = td_malloc(len + 1, TD_ROLE_META);
    if (!b || !copy) {
        td_free(b);
        td_free(copy);
        return TD_ERR_NOMEM;
    }
    memcpy(copy, text, len + 1);
    td_status st = TD_OK;
    int k = 0;
    char *p = copy;
    for (;;) {
        char *comma = strchr(p, ',');
        if (comma) *comma = '\0';
        if (!*p) {
            st = td_error_set(TD_ERR_INVALID, "--sweep-budget '%s': item %d is empty; give sizes separated by "
                              "commas, such as 8GiB,16GiB,24GiB", text, k + 1);
            break;
        }
        if (td_parse_bytes(p, &b[k]) || b[k] == 0) {
            st = td_error_set(TD_ERR_INVALID, "--sweep-budget '%s': item %d ('%s') is not a size; give sizes "
                              "such as 512MiB or 8GiB", text, k + 1, p);
            break;
        }
        for (int j = 0; j < k && !st; j++)
            if (b[j] == b[k]) st = td_error_set(TD_ERR_INVALID, "--sweep-budget '%s': '%s' is given twice", text, p);
        if (st) break;
        k++;
        if (!comma) break;
        p = comma + 1;
    }
    td_free(copy);
    if (st) {
        td_free(b);
        return st;
    }
    qsort(b, (size_t)k, sizeof *b, cmp_size);
    *out = b;
    *n = k;
    return TD_OK;
}

/* A file we will write at the end: checked before any run. */
static td_status check_writable(const char *flag, const char *path)
{
    if (!*path) return td_error_set(TD_ERR_INVALID, "%s: give a file name", flag);
    if (access(path, F_OK) == 0) {
        if (access(path, W_OK) != 0)
            return td_error_set(TD_ERR_IO, "%s %s: %s; choose another path", flag, path, strerror(errno));
        return TD_OK;
    }
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    const char *d = dirname(dir);
    if (access(d, W_OK) != 0)
        return td_error_set(TD_ERR_IO, "%s %s: cannot create a file in %s (%s); choose another path", flag, path, d,
                            strerror(errno));
    return TD_OK;
}

/* ---- batches and progress ------------------------------------------------------- */

typedef struct run_ctx {
    const char *data;
    uint64_t seed;
    int tty, index, count;
    size_t budget;
} run_ctx;

static td_status loader_batch(void *ctx, int32_t *tokens, int32_t *targets, int32_t *positions)
{
    return td_loader_next(ctx, tokens, targets, positions);
}

static td_status open_batches(void *ctx, const td_train_config *cfg, td_batch_fn *fn, void **bctx)
{
    run_ctx *r = ctx;
    td_loader_params lp = td_loader_default_params();
    lp.batch = (uint32_t)cfg->micro_batch;
    lp.seq = (uint32_t)cfg->seq_len;
    lp.seed = r->seed;
    *fn = loader_batch;
    return td_loader_open(r->data, &lp, (td_loader **)bctx);
}

static void close_batches(void *bctx) { td_loader_destroy(bctx); }

static void describe(const td_tune_candidate *c, char *buf, size_t n)
{
    char ck[16], pf[16];
    if (c->plan.ckpt_blocks) snprintf(ck, sizeof ck, "%d", c->plan.ckpt_blocks);
    else snprintf(ck, sizeof ck, "off");
    if (c->cfg.mm.prefetch < 0) snprintf(pf, sizeof pf, "auto");
    else snprintf(pf, sizeof pf, "%d", c->cfg.mm.prefetch);
    snprintf(buf, n, "B %d x %d, ckpt %s, optimizer %d/%d on the device, chunk %zu, prefetch %s", c->cfg.micro_batch,
             c->cfg.grad_accum, ck, c->plan.optim_gpu_chunks, c->plan.optim_chunks, c->plan.chunk_numel, pf);
}

static void progress(void *ctx, const td_tune_candidate *c, int step, int steps)
{
    run_ctx *r = ctx;
    if (!r->tty && step < steps) return;
    char d[160], b[32];
    describe(c, d, sizeof d);
    fprintf(stderr, "%stidal tune: %s: run %d/%d (%s): step %d/%d%s", r->tty ? "\r\033[K" : "",
            td_format_bytes(r->budget, b, sizeof b), r->index, r->count, d, step, steps, r->tty ? "" : "\n");
    fflush(stderr);
}

/* ---- output ------------------------------------------------------------------- */

static void print_table(const td_tune_candidate *runs, int n, size_t budget)
{
    char b[32];
    printf("\nbudget %s\n", td_format_bytes(budget, b, sizeof b));
    printf("  %-3s %-6s %-10s %-10s %-9s %-8s %11s %11s %10s %10s %10s\n", "#", "B x K", "ckpt", "optim dev", "chunk",
           "prefetch", "bound tok/s", "tokens/s", "device", "pinned", "bound/step");
    for (int i = 0; i < n; i++) {
        const td_tune_candidate *c = &runs[i];
        char bk[24], ck[24], og[24], pf[16], dev[32], pin[32];
        snprintf(bk, sizeof bk, "%dx%d", c->cfg.micro_batch, c->cfg.grad_accum);
        if (c->plan.ckpt_blocks) snprintf(ck, sizeof ck, "%d/%d", c->plan.ckpt_blocks, c->cfg.model.n_layer);
        else snprintf(ck, sizeof ck, "off");
        snprintf(og, sizeof og, "%d/%d", c->plan.optim_gpu_chunks, c->plan.optim_chunks);
        if (c->cfg.mm.prefetch < 0) snprintf(pf, sizeof pf, "auto");
        else snprintf(pf, sizeof pf, "%d", c->cfg.mm.prefetch);
        if (c->ran == 1)
            printf("  %-3d %-6s %-10s %-10s %-9zu %-8s %11.0f %11.0f %10s %10s %9.0f%%\n", i + 1, bk, ck, og,
                   c->plan.chunk_numel, pf, c->bound.tokens_per_s, c->tokens_per_s,
                   td_format_bytes(c->device_peak_bytes, dev, sizeof dev), td_format_bytes(c->pinned_bytes, pin, sizeof pin),
                   c->step_ms > 0 ? 100.0 * c->bound.bound_ms / c->step_ms : 0);
        else
            printf("  %-3d %-6s %-10s %-10s %-9zu %-8s %11.0f  failed: %s\n", i + 1, bk, ck, og, c->plan.chunk_numel, pf,
                   c->bound.tokens_per_s, c->error);
    }
}

static cJSON *candidate_json(const td_tune_candidate *c)
{
    cJSON *o = cJSON_CreateObject();
    char flags[512];
    td_tune_flags(c, flags, sizeof flags);
    cJSON_AddStringToObject(o, "flags", flags);
    cJSON_AddNumberToObject(o, "micro_batch", c->cfg.micro_batch);
    cJSON_AddNumberToObject(o, "grad_accum", c->cfg.grad_accum);
    cJSON_AddNumberToObject(o, "ckpt_blocks", c->plan.ckpt_blocks);
    cJSON_AddNumberToObject(o, "optim_gpu_chunks", c->plan.optim_gpu_chunks);
    cJSON_AddNumberToObject(o, "optim_chunks", c->plan.optim_chunks);
    cJSON_AddNumberToObject(o, "chunk_numel", (double)c->plan.chunk_numel);
    cJSON_AddNumberToObject(o, "prefetch", c->cfg.mm.prefetch);
    cJSON_AddNumberToObject(o, "bound_step_ms", c->bound.bound_ms);
    cJSON_AddNumberToObject(o, "bound_tokens_per_s", c->bound.tokens_per_s);
    cJSON_AddNumberToObject(o, "compute_ms", c->bound.compute_ms);
    cJSON_AddNumberToObject(o, "pcie_ms", c->bound.pcie_ms);
    cJSON_AddNumberToObject(o, "adam_ms", c->bound.adam_ms);
    cJSON_AddNumberToObject(o, "dram_ms", c->bound.dram_ms);
    cJSON_AddNumberToObject(o, "exposed_adam_ms", c->bound.exposed_adam_ms);
    cJSON_AddBoolToObject(o, "ran", c->ran == 1);
    if (c->ran == 1) {
        cJSON_AddNumberToObject(o, "tokens_per_s", c->tokens_per_s);
        cJSON_AddNumberToObject(o, "step_ms", c->step_ms);
        cJSON_AddNumberToObject(o, "device_peak_bytes", (double)c->device_peak_bytes);
        cJSON_AddNumberToObject(o, "pinned_bytes", (double)c->pinned_bytes);
        cJSON_AddNumberToObject(o, "bound_over_step", c->step_ms > 0 ? c->bound.bound_ms / c->step_ms : 0);
    } else if (c->ran < 0) {
        cJSON_AddStringToObject(o, "error", c->error);
    }
    return o;
}

/* The winner as a --config file: the options given plus its knobs. */
static td_status write_config(const char *path, cJSON *given, const td_tune_candidate *w)
{
    cJSON *o = cJSON_Duplicate(given, 1);
    if (!o) return TD_ERR_NOMEM;
    static const char *const knobs[] = {"micro-batch", "grad-accum", "ckpt", "policy", "offload-optim-frac",
                                        "offload-param-frac", "prefetch", "chunk-numel", "gpu-budget", "steps",
                                        "config"};
    for (size_t i = 0; i < sizeof knobs / sizeof knobs[0]; i++) cJSON_DeleteItemFromObject(o, knobs[i]);
    char ck[16], budget[32];
    if (w->plan.ckpt_blocks) snprintf(ck, sizeof ck, "%d", w->plan.ckpt_blocks);
    else snprintf(ck, sizeof ck, "off");
    snprintf(budget, sizeof budget, "%zu", w->cfg.gpu_budget);
    cJSON_AddNumberToObject(o, "micro-batch", w->cfg.micro_batch);
    cJSON_AddNumberToObject(o, "grad-accum", w->cfg.grad_accum);
    cJSON_AddStringToObject(o, "ckpt", ck);
    cJSON_AddStringToObject(o, "policy", "auto");
    cJSON_AddNumberToObject(o, "offload-optim-frac", td_tune_optim_frac(w));
    cJSON_AddNumberToObject(o, "prefetch", w->cfg.mm.prefetch);
    cJSON_AddNumberToObject(o, "chunk-numel", (double)w->cfg.mm.chunk_numel);
    cJSON_AddStringToObject(o, "gpu-budget", budget);
    char *text = cJSON_Print(o);
    cJSON_Delete(o);
    if (!text) return TD_ERR_NOMEM;
    FILE *f = fopen(path, "w");
    td_status st = TD_OK;
    if (!f || fprintf(f, "%s\n", text) < 0 || fclose(f) != 0)
        st = td_error_set(TD_ERR_IO, "--write-config %s: %s", path, strerror(errno));
    cJSON_free(text);
    return st;
}

/* ---- the command ------------------------------------------------------------- */

/* `tidal train`'s model, run and optimizer options into cfg (the token
 * file's vocabulary when --data names one: *data), and the options given
 * into `given` as a --config file has them.  -1 to go on, else the exit
 * code (0 after --help).  String options stay valid until td_args_free. */
static int train_options(int argc, char **argv, td_train_config *cfg, const char **data, cJSON *given)
{
    static td_cli_train_opts o; /* string options point into it until td_args_free */
    td_cli_train_opts_defaults(&o);
    td_opt table[] = { TD_CLI_MODEL_OPTS(&o), TD_CLI_RUN_OPTS(&o), TD_CLI_OPTIM_OPTS(&o), {NULL, 0, NULL, NULL, NULL, 0} };
    td_args_find(table, "steps")->help = "steps each candidate trains (default 5: the warm-up, then the median of the "
                                         "rest counts)";
    int rc = td_args_main(table, argc, argv, "tune", usage);
    if (rc >= 0) return rc;
    int data_vocab = 0;
    char note[512];
    td_status st = TD_OK;
    *data = o.data;
    if ((o.data && (st = td_cli_data_vocab(o.data, &data_vocab))) ||
        (st = td_cli_train_config(&o, table, data_vocab, cfg, note))) {
        fprintf(stderr, "tidal tune: %s\n", td_error_msg());
        return o.data && !data_vocab ? 1 : td_cli_config_exit(st);
    }
    if (*note) fprintf(stderr, "tidal tune: %s\n", note);
    for (td_opt *t = table; given && t->name; t++) {
        if (!t->seen || !strcmp(t->name, "config")) continue;
        char v[200];
        if (t->kind == TD_OPT_FLAG) { cJSON_AddBoolToObject(given, t->name, *(int *)t->dst); continue; }
        if (t->kind == TD_OPT_STRING) { cJSON_AddStringToObject(given, t->name, *(const char **)t->dst); continue; }
        td_cli_opt_value(t, v, sizeof v);
        cJSON_AddStringToObject(given, t->name, v);
    }
    return -1;
}

/* The prefetch depths the winner is tried again at: the plan's model does
 * not rank them, and the auto depth can come out short (W6: auto gave 2,
 * 16 ran its step 2.6% faster; docs/performance.md). */
static const int tune_depths[] = {2, 8, 16};
enum { TUNE_DEPTHS = sizeof tune_depths / sizeof tune_depths[0] };

/* Ranks, runs the best `top` that fit, and for the winner tries the
 * prefetch depths (refine).  `carry`: the fastest run of the smaller
 * budgets of a sweep (NULL: none); its knobs fit here too, and when the
 * ranking leaves them out of the best `top` they run as well, so that a
 * budget's winner is never a configuration the smaller budget beat (the
 * ranking is a model; more memory is not worth less).  runs: the run
 * candidates, best first. */
static td_status tune_budget(const td_train_config *cfg, size_t budget, td_backend *b, const td_train_rates *rates,
                             int top, int steps, int refine, const td_tune_candidate *carry, run_ctx *rc,
                             td_tune_candidate **runs, int *n_runs, int *ranked)
{
    td_status st = TD_OK;
    td_tune_candidate *cs = NULL, *out = NULL;
    int n = 0;
    char bs[32];
    *runs = NULL;
    *n_runs = 0;
    TD_TRY(td_tune_candidates(cfg, budget, b, rates, &cs, &n));
    *ranked = n;
    int fit = 0;
    while (fit < n && cs[fit].fits) fit++;
    int k = fit < top ? fit : top, extra = -1;
    if (carry) { /* the smaller budget's winner, planned at this one: the candidate making its choices */
        td_tune_candidate here = *carry;
        here.cfg.gpu_budget = budget;
        if (td_train_plan_make(&here.cfg, budget, &here.plan) == TD_OK)
            for (int i = k; i < fit && extra < 0; i++)
                if (td_tune_same_choice(&cs[i], &here)) extra = i;
        td_error_clear();
    }
    fprintf(stderr, "tidal tune: %s: %d candidates, %d fit; running the best %d%s for %d steps each\n",
            td_format_bytes(budget, bs, sizeof bs), n, fit, k,
            extra >= 0 ? " and the smaller budget's winner" : "", steps);
    out = td_calloc((size_t)k + 1 + TUNE_DEPTHS, sizeof *out, TD_ROLE_META);
    if (!out) TD_FAIL(TD_ERR_NOMEM, "tune: %d runs", k);
    td_tune_data data = { open_batches, close_batches, rc, progress };
    rc->budget = budget;
    if (extra >= 0) cs[k++] = cs[extra]; /* run after the ranked ones */
    rc->count = k + (refine && k ? TUNE_DEPTHS : 0);
    for (int i = 0; i < k; i++) {
        out[i] = cs[i];
        rc->index = i + 1;
        TD_TRY(td_tune_run(&out[i], steps, &data));
    }
    int best = -1;
    for (int i = 0; i < k; i++)
        if (out[i].ran == 1 && (best < 0 || out[i].tokens_per_s > out[best].tokens_per_s)) best = i;
    int m = k;
    if (refine && best >= 0) {
        td_tune_candidate w = out[best];
        for (int j = 0; j < TUNE_DEPTHS; j++) {
            out[m] = w;
            out[m].cfg.mm.prefetch = tune_depths[j];
            out[m].ran = 0;
            rc->index = m + 1;
            TD_TRY(td_tune_run(&out[m], steps, &data));
            m++;
        }
    }
    if (rc->tty) fprintf(stderr, "\n");
    /* Best measured first; failures last. */
    for (int i = 1; i < m; i++)
        for (int j = i; j > 0; j--) {
            td_tune_candidate *x = &out[j - 1], *y = &out[j];
            int swap = (y->ran == 1 && x->ran != 1) || (y->ran == 1 && x->ran == 1 && y->tokens_per_s > x->tokens_per_s);
            if (!swap) break;
            td_tune_candidate tmp = *x;
            *x = *y;
            *y = tmp;
        }
    *runs = out;
    *n_runs = m;
    out = NULL;
cleanup:
    td_free(out);
    td_free(cs);
    return st;
}

/* One `tidal tune`: its options, the budgets and what each budget's runs gave. */
typedef struct tune_state {
    tune_opts o;
    char **rest;
    int n_rest;
    td_train_config cfg;
    const char *data;
    long steps;
    cJSON *given, *report;
    td_backend *b;
    td_train_rates rates;
    size_t *budgets;
    double *best_tps;
    td_tune_candidate **runs;
    int *n_runs, n_budgets;
} tune_state;

/* The options: tune's own, then `tidal train`'s, checked.  -1 to go on,
 * else the exit code. */
static int tune_options(tune_state *ts, int argc, char **argv)
{
    int rc = split_args(argc, argv, &ts->o, ts->rest, &ts->n_rest), steps_given = 0, budget_given = 0;
    if (rc >= 0) return rc;
    for (int i = 0; i < ts->n_rest; i++) {
        steps_given |= !strcmp(ts->rest[i], "--steps");
        budget_given |= !strcmp(ts->rest[i], "--gpu-budget");
    }
    if (!steps_given) { /* a tune run is short; train's default (100) is not */
        ts->rest[ts->n_rest++] = "--steps";
        ts->rest[ts->n_rest++] = "5";
    }
    if ((rc = train_options(ts->n_rest, ts->rest, &ts->cfg, &ts->data, ts->given)) >= 0) return rc;
    const tune_opts *o = &ts->o;
    td_status st = TD_OK;
    if (!ts->data)
        st = td_error_set(TD_ERR_INVALID, "--data FILE is required: the candidates train on it (make one with "
                          "`tidal prepare`)");
    else if (o->sweep && budget_given)
        st = td_error_set(TD_ERR_INVALID, "give --gpu-budget or --sweep-budget, not both");
    else if (o->sweep && o->write_config)
        st = td_error_set(TD_ERR_INVALID, "--write-config saves the winner of one budget; use --gpu-budget with it "
                          "(--json reports every budget's winner)");
    else if (o->sweep && !(st = parse_sweep(o->sweep, &ts->budgets, &ts->n_budgets)))
        for (int i = 0; i < ts->n_budgets && !st; i++) { /* each, as a run would take it (the one decision) */
            td_train_config c = ts->cfg;
            td_train_budget tb;
            c.gpu_budget = ts->budgets[i];
            if ((st = td_train_budget_resolve(&c, NULL, TD_BUDGET_USE_RUN, &tb)))
                st = td_error_prefix(st, "--sweep-budget '%s': ", o->sweep);
        }
    if (!st && o->write_config) st = check_writable("--write-config", o->write_config);
    if (!st && o->plot) st = check_writable("--plot", o->plot);
    cJSON *steps = cJSON_GetObjectItem(ts->given, "steps");
    ts->steps = steps ? atol(steps->valuestring) : 5;
    if (!st && ts->steps < 2)
        st = td_error_set(TD_ERR_INVALID, "--steps %ld: give at least 2 (the first step is the warm-up)", ts->steps);
    if (!st) return -1;
    fprintf(stderr, "tidal tune: %s\n", td_error_msg());
    return 2;
}

/* The backend (the cpu backend's device region holding the largest budget
 * swept, unless --cpu-device-bytes sizes it), the budget when none was
 * swept, and this machine's rates. */
static td_status tune_setup(tune_state *ts)
{
    td_train_config *cfg = &ts->cfg;
    td_status st;
    if (!cfg->cpu_device_bytes && ts->budgets &&
        ts->budgets[ts->n_budgets - 1] > td_backend_default_params().cpu_device_bytes)
        cfg->cpu_device_bytes = ts->budgets[ts->n_budgets - 1];
    td_backend_params bp = td_train_backend_params(cfg);
    if ((st = td_backend_create(&bp, &ts->b))) return st;
    cfg->backend = td_backend_get_kind(ts->b);
    if (!ts->budgets) {
        td_train_budget tb;
        if ((st = td_train_budget_resolve(cfg, ts->b, TD_BUDGET_USE_SEARCH, &tb))) return st;
        if (!(ts->budgets = td_malloc(sizeof *ts->budgets, TD_ROLE_META))) return TD_ERR_NOMEM;
        ts->n_budgets = 1;
        ts->budgets[0] = tb.budget_bytes;
    }
    fprintf(stderr, "tidal tune: measuring this machine's rates (copy, DRAM, compute)\n");
    if ((st = td_train_measure_rates(ts->b, cfg, &ts->rates))) return st;
    ts->best_tps = td_calloc((size_t)ts->n_budgets, sizeof *ts->best_tps, TD_ROLE_META);
    ts->runs = td_calloc((size_t)ts->n_budgets, sizeof *ts->runs, TD_ROLE_META);
    ts->n_runs = td_calloc((size_t)ts->n_budgets, sizeof *ts->n_runs, TD_ROLE_META);
    return ts->best_tps && ts->runs && ts->n_runs ? TD_OK : TD_ERR_NOMEM;
}

/* Every budget tuned, smallest first, into the report. */
static td_status tune_budgets(tune_state *ts)
{
    const td_train_config *cfg = &ts->cfg;
    run_ctx ctx = { .data = ts->data, .seed = cfg->seed, .tty = isatty(fileno(stderr)) };
    cJSON *report = ts->report = cJSON_CreateObject();
    cJSON_AddNumberToObject(report, "params", (double)td_model_params_numel(&cfg->model));
    cJSON_AddNumberToObject(report, "tokens_per_step", (double)cfg->micro_batch * cfg->seq_len * cfg->grad_accum);
    cJSON *mr = cJSON_AddObjectToObject(report, "measured");
    cJSON_AddNumberToObject(mr, "copy_gbytes_per_s", ts->rates.copy_gbs);
    cJSON_AddNumberToObject(mr, "dram_gbytes_per_s", ts->rates.dram_gbs);
    cJSON_AddNumberToObject(mr, "dram_fastest_gbytes_per_s", ts->rates.dram_fastest_gbs);
    cJSON_AddNumberToObject(mr, "adam_probe_params", (double)ts->rates.adam_probe_params);
    cJSON_AddNumberToObject(mr, "dram_loaded_gbytes_per_s", ts->rates.dram_loaded_gbs);
    cJSON_AddNumberToObject(mr, "compute_gflops", ts->rates.gflops);
    cJSON *jb = cJSON_AddArrayToObject(report, "budgets");
    for (int i = 0; i < ts->n_budgets; i++) {
        int ranked = 0;
        const td_tune_candidate *carry = NULL; /* the fastest run of the smaller budgets */
        for (int j = 0; j < i; j++)
            if (ts->best_tps[j] > 0 && (!carry || ts->runs[j][0].tokens_per_s > carry->tokens_per_s))
                carry = &ts->runs[j][0];
        td_status st = tune_budget(cfg, ts->budgets[i], ts->b, &ts->rates, ts->o.top, (int)ts->steps,
                                   ts->n_budgets == 1, carry, &ctx, &ts->runs[i], &ts->n_runs[i], &ranked);
        if (st) return st;
        ts->best_tps[i] = ts->n_runs[i] && ts->runs[i][0].ran == 1 ? ts->runs[i][0].tokens_per_s : 0;
        cJSON *e = cJSON_CreateObject();
        cJSON_AddNumberToObject(e, "budget_bytes", (double)ts->budgets[i]);
        cJSON_AddNumberToObject(e, "candidates", ranked);
        cJSON *jr = cJSON_AddArrayToObject(e, "runs");
        for (int k = 0; k < ts->n_runs[i]; k++) cJSON_AddItemToArray(jr, candidate_json(&ts->runs[i][k]));
        if (ts->best_tps[i] > 0) cJSON_AddItemToObject(e, "winner", candidate_json(&ts->runs[i][0]));
        else cJSON_AddNullToObject(e, "winner");
        cJSON_AddItemToArray(jb, e);
    }
    return TD_OK;
}

static void print_results(const tune_state *ts)
{
    const td_train_config *cfg = &ts->cfg;
    printf("tidal tune: %zu params, %.0f tokens a step; measured copy %.1f GB/s, DRAM %.1f GB/s (%.1f with copies "
           "beside the CPU AdamW), compute %.1f GFLOP/s\n", td_model_params_numel(&cfg->model),
           (double)cfg->micro_batch * cfg->seq_len * cfg->grad_accum, ts->rates.copy_gbs, ts->rates.dram_gbs,
           ts->rates.dram_loaded_gbs, ts->rates.gflops);
    for (int i = 0; i < ts->n_budgets; i++) {
        print_table(ts->runs[i], ts->n_runs[i], ts->budgets[i]);
        char flags[512];
        if (ts->best_tps[i] > 0) {
            td_tune_flags(&ts->runs[i][0], flags, sizeof flags);
            printf("  winner: %.0f tokens/s with %s\n", ts->best_tps[i], flags);
        } else {
            printf("  no candidate trained at this budget\n");
        }
    }
    if (ts->n_budgets > 1) {
        printf("\ntokens/s against the device budget:\n");
        for (int i = 0; i < ts->n_budgets; i++) {
            char bs[32];
            printf("  %12s  %10.0f\n", td_format_bytes(ts->budgets[i], bs, sizeof bs), ts->best_tps[i]);
        }
    }
}

/* --write-config and --plot. */
static td_status write_outputs(const tune_state *ts)
{
    const tune_opts *o = &ts->o;
    td_status st = TD_OK;
    if (o->write_config) {
        if (ts->best_tps[0] <= 0)
            return td_error_set(TD_ERR_BUDGET, "--write-config %s: no candidate trained under the budget; raise it",
                                o->write_config);
        if ((st = write_config(o->write_config, ts->given, &ts->runs[0][0]))) return st;
        fprintf(stderr, "tidal tune: wrote %s (tidal train --config %s)\n", o->write_config, o->write_config);
    }
    if (!o->plot) return TD_OK;
    char title[160];
    double params = (double)td_model_params_numel(&ts->cfg.model);
    snprintf(title, sizeof title, "tidal tune on %s: %.3g%s params, %.0f tokens a step, best of each budget",
             td_backend_describe(ts->b), params >= 1e9 ? params / 1e9 : params / 1e6, params >= 1e9 ? "B" : "M",
             (double)ts->cfg.micro_batch * ts->cfg.seq_len * ts->cfg.grad_accum);
    FILE *f = fopen(o->plot, "w");
    if (!f) return td_error_set(TD_ERR_IO, "--plot %s: %s", o->plot, strerror(errno));
    st = td_tune_plot_svg(f, title, ts->budgets, ts->best_tps, ts->n_budgets);
    if (fclose(f) != 0 && !st) st = td_error_set(TD_ERR_IO, "--plot %s: %s", o->plot, strerror(errno));
    if (!st) fprintf(stderr, "tidal tune: wrote %s\n", o->plot);
    return st;
}

int td_cli_tune_main(int argc, char **argv)
{
    tune_state ts;
    memset(&ts, 0, sizeof ts);
    ts.o.top = 3;
    ts.rest = td_malloc(((size_t)argc + 3) * sizeof *ts.rest, TD_ROLE_META);
    ts.given = cJSON_CreateObject();
    if (!ts.rest || !ts.given) {
        fprintf(stderr, "tidal tune: out of memory\n");
        td_free(ts.rest);
        cJSON_Delete(ts.given);
        return 1;
    }
    int rc = tune_options(&ts, argc, argv);
    if (rc < 0) {
        td_status st;
        rc = 1;
        if (!(st = tune_setup(&ts)) && !(st = tune_budgets(&ts))) {
            if (ts.o.json) st = td_cli_print_json(cJSON_Duplicate(ts.report, 1));
            else print_results(&ts);
        }
        if (!st) st = write_outputs(&ts);
        if (st) fprintf(stderr, "tidal tune: %s\n", td_error_msg());
        else rc = 0;
    }
    for (int i = 0; ts.runs && i < ts.n_budgets; i++) td_free(ts.runs[i]);
    td_free(ts.runs);
    td_free(ts.n_runs);
    td_free(ts.best_tps);
    td_free(ts.budgets);
    cJSON_Delete(ts.given);
    cJSON_Delete(ts.report);
    td_backend_free(ts.b);
    td_free(ts.rest);
    td_args_free();
    return rc;
}
