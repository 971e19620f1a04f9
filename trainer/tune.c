/* Candidates, their ranking by the plan's model, their runs, and the plot
 * (see include/tidal/tune.h). */
#include "tidal/tune.h"
#include "tidal/arena.h"
#include "tidal/hostpool.h"
#include "tidal/util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- candidates ------------------------------------------------------------ */

static size_t pin_limit_of(const td_train_config *c)
{
    if (c->host_pin_limit) return c->host_pin_limit;
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? (size_t)pages * (size_t)page / 10 * 8 : SIZE_MAX;
}

/* The same knobs once: a candidate whose plan makes the same choices as an
 * earlier one (micro-batch, recomputed blocks, optimizer chunks on the GPU,
 * chunk size) adds nothing. */
int td_tune_same_choice(const td_tune_candidate *a, const td_tune_candidate *b)
{
    return a->cfg.micro_batch == b->cfg.micro_batch && a->plan.ckpt_blocks == b->plan.ckpt_blocks &&
           a->plan.optim_gpu_chunks == b->plan.optim_gpu_chunks && a->plan.chunk_numel == b->plan.chunk_numel &&
           a->cfg.mm.prefetch == b->cfg.mm.prefetch;
}

static double side_ms(const td_tune_candidate *c) { return c->bound.pcie_ms + c->bound.adam_ms; }

static int rank_cmp(const void *pa, const void *pb)
{
    const td_tune_candidate *a = pa, *b = pb;
    if (a->fits != b->fits) return b->fits - a->fits;
    double ta = a->bound.tokens_per_s, tb = b->bound.tokens_per_s;
    /* Bounds within a part in a thousand tie: the rates' own noise. */
    if (fabs(ta - tb) > 1e-3 * (ta > tb ? ta : tb)) return ta > tb ? -1 : 1;
    if (fabs(side_ms(a) - side_ms(b)) > 1e-6) return side_ms(a) < side_ms(b) ? -1 : 1;
    if (a->cfg.micro_batch != b->cfg.micro_batch) return b->cfg.micro_batch - a->cfg.micro_batch;
    if (a->plan.ckpt_blocks != b->plan.ckpt_blocks) return a->plan.ckpt_blocks - b->plan.ckpt_blocks;
    return a->plan.chunk_numel < b->plan.chunk_numel ? -1 : a->plan.chunk_numel > b->plan.chunk_numel;
}

td_status td_tune_candidates(const td_train_config *base, size_t budget, td_backend *b, const td_train_rates *rates,
                             td_tune_candidate **out, int *n_out)
{
    td_status st = TD_OK;
    const td_model_desc *mc = &base->model;
    int L = mc->n_layer, seqs = base->micro_batch * base->grad_accum;
    *out = NULL;
    *n_out = 0;
    int mbs[32], n_mb = 0;
    for (int B = seqs; B >= 1 && n_mb < 32; B--)
        if (seqs % B == 0) mbs[n_mb++] = B;
    int ckpts[5] = {0, L / 4, L / 2, 3 * L / 4, L}, n_ck = 5;
    static const double fracs[5] = {0.0, 0.25, 0.5, 0.75, 1.0};
    size_t off, span;
    td_model_block_span(mc, 0, &off, &span);
    size_t chunks[3] = {0, span / 2 > 4096 ? span / 2 : 4096, 2 * span};
    int cap = n_mb * n_ck * 5 * 3, n = 0;
    td_tune_candidate *cs = td_calloc((size_t)cap, sizeof *cs, TD_ROLE_META);
    if (!cs) return TD_ERR_NOMEM;
    size_t pin_limit = pin_limit_of(base);
    for (int i = 0; i < n_mb; i++) {
        td_train_rates r = *rates;
        td_train_config shape = *base;
        shape.micro_batch = mbs[i];
        shape.grad_accum = seqs / mbs[i];
        if (b) TD_TRY(td_train_measure_block(b, &shape, &r));
        for (int k = 0; k < n_ck; k++)
            for (int f = 0; f < 5; f++)
                for (int z = 0; z < 3; z++) {
                    td_tune_candidate *c = &cs[n];
                    memset(c, 0, sizeof *c);
                    c->cfg = shape;
                    c->cfg.gpu_budget = budget;
                    c->cfg.ckpt = ckpts[k] ? TD_CKPT_ON : TD_CKPT_OFF;
                    c->cfg.ckpt_blocks = ckpts[k];
                    c->cfg.mm.placement = TD_PLACEMENT_AUTO;
                    c->cfg.mm.offload_optim_frac = fracs[f];
                    c->cfg.mm.offload_param_frac = 0;
                    c->cfg.mm.prefetch = -1;
                    c->cfg.mm.chunk_numel = chunks[z];
                    if (td_train_config_check(&c->cfg)) continue;
                    TD_TRY(td_train_plan_make(&c->cfg, budget, &c->plan));
                    td_train_bound_of(&c->cfg, &c->plan, &r, &c->bound);
                    c->fits = c->plan.min_device_bytes <= budget && c->plan.host_pinned_bytes <= pin_limit;
                    int dup = 0;
                    for (int j = 0; j < n && !dup; j++) dup = td_tune_same_choice(&cs[j], c);
                    if (!dup) n++;
                }
    }
    qsort(cs, (size_t)n, sizeof *cs, rank_cmp);
    *out = cs;
    *n_out = n;
    return TD_OK;
cleanup:
    td_free(cs);
    return st;
}

/* ---- runs -------------------------------------------------------------------- */

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

td_status td_tune_run(td_tune_candidate *c, int steps, const td_tune_data *data)
{
    td_status st = TD_OK;
    td_trainer *t = NULL;
    td_batch_fn fn = NULL;
    void *bctx = NULL;
    double *ms = NULL;
    if (steps < 2) return td_error_set(TD_ERR_INVALID, "tune: --steps %d; at least 2 (the first is the warm-up)", steps);
    ms = td_malloc((size_t)steps * sizeof *ms, TD_ROLE_META);
    if (!ms) return TD_ERR_NOMEM;
    c->ran = -1;
    if ((st = data->open(data->ctx, &c->cfg, &fn, &bctx))) goto out;
    td_status run = td_trainer_create(&c->cfg, &t);
    td_step_result r = {0};
    for (int s = 0; run == TD_OK && s < steps; s++) {
        if ((run = td_trainer_step(t, fn, bctx, &r))) break;
        ms[s] = r.step_ms;
        if (data->progress) data->progress(data->ctx, c, s + 1, steps);
    }
    if (run) {
        snprintf(c->error, sizeof c->error, "%s", td_error_msg());
    } else {
        qsort(ms + 1, (size_t)steps - 1, sizeof *ms, cmp_double);
        c->step_ms = ms[1 + (steps - 1) / 2];
        double tokens = (double)c->cfg.micro_batch * c->cfg.seq_len * c->cfg.grad_accum;
        c->tokens_per_s = c->step_ms > 0 ? tokens / (c->step_ms * 1e-3) : 0;
        c->device_peak_bytes = r.mm.device_peak_bytes;
        td_hostpool_stats hs;
        td_hostpool_get_stats(td_trainer_hostpool(t), &hs);
        c->pinned_bytes = hs.pinned_bytes;
        c->ran = 1;
    }
    td_trainer_destroy(t);
    data->close(bctx);
out:
    td_free(ms);
    return st;
}

double td_tune_optim_frac(const td_tune_candidate *c)
{
    int n = c->plan.optim_chunks;
    return n ? (double)(n - c->plan.optim_gpu_chunks) / n : 0;
}

size_t td_tune_flags(const td_tune_candidate *c, char *buf, size_t buf_bytes)
{
    char ckpt[16];
    if (c->plan.ckpt_blocks == 0) snprintf(ckpt, sizeof ckpt, "off");
    else snprintf(ckpt, sizeof ckpt, "%d", c->plan.ckpt_blocks);
    int len = snprintf(buf, buf_bytes, "--micro-batch %d --grad-accum %d --ckpt %s --policy auto "
                       "--offload-optim-frac %.6g --prefetch %d --chunk-numel %zu --gpu-budget %zu",
                       c->cfg.micro_batch, c->cfg.grad_accum, ckpt, td_tune_optim_frac(c), c->cfg.mm.prefetch,
                       c->cfg.mm.chunk_numel, c->cfg.gpu_budget);
    return len > 0 ? (size_t)len : 0;
}

/* ---- the plot ---------------------------------------------------------------- */

/* A round step for about `want` ticks over [0, hi]: 1, 2 or 5 times a power of ten. */
static double nice_step(double hi, int want)
{
    double raw = hi / want, p = pow(10, floor(log10(raw > 0 ? raw : 1)));
    double m = raw / p;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * p;
}

static void tick_label(char *buf, size_t n, double v)
{
    if (v >= 1e6) snprintf(buf, n, "%.3gM", v / 1e6);
    else if (v >= 1e3) snprintf(buf, n, "%.3gk", v / 1e3);
    else snprintf(buf, n, "%.3g", v);
}

td_status td_tune_plot_svg(FILE *f, const char *title, const size_t *budgets, const double *tps, int n)
{
    if (n < 1) return td_error_set(TD_ERR_INVALID, "plot: no budgets");
    const double W = 720, H = 440, left = 80, right = 30, top = 50, bottom = 70;
    const double pw = W - left - right, ph = H - top - bottom;
    /* x: the budget in GiB (MiB when all are under 1 GiB), from 0; y:
     * tokens/s, from 0. */
    double xmax = 0, ymax = 0, unit = (double)TD_GiB;
    for (int i = 0; i < n; i++)
        if ((double)budgets[i] > xmax) xmax = (double)budgets[i];
    if (xmax < (double)TD_GiB) unit = (double)TD_MiB;
    xmax = 0;
    for (int i = 0; i < n; i++) {
        double g = (double)budgets[i] / unit;
        if (g > xmax) xmax = g;
        if (tps[i] > ymax) ymax = tps[i];
    }
    if (xmax <= 0) xmax = 1;
    if (ymax <= 0) ymax = 1;
    double xs = nice_step(xmax, 6), ys = nice_step(ymax, 5);
    xmax = ceil(xmax / xs) * xs;
    ymax = ceil(ymax * 1.05 / ys) * ys;
    fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
               "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" "
               "font-family=\"sans-serif\" font-size=\"13\">\n", W, H, W, H);
    fprintf(f, "<rect x=\"0\" y=\"0\" width=\"%.0f\" height=\"%.0f\" fill=\"white\"/>\n", W, H);
    fprintf(f, "<text x=\"%.1f\" y=\"28\" text-anchor=\"middle\" font-size=\"16\">", W / 2);
    for (const char *p = title; p && *p; p++) { /* escaped: the title carries the user's model name */
        if (*p == '<') fputs("&lt;", f);
        else if (*p == '>') fputs("&gt;", f);
        else if (*p == '&') fputs("&amp;", f);
        else fputc(*p, f);
    }
    fprintf(f, "</text>\n");
    /* Grid and ticks. */
    char lab[32];
    for (double y = 0; y <= ymax + ys / 2; y += ys) {
        double py = top + ph - y / ymax * ph;
        tick_label(lab, sizeof lab, y);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#dddddd\"/>\n", left, py, left + pw, py);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n", left - 5, py, left, py);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n", left - 8, py + 4, lab);
    }
    for (double x = 0; x <= xmax + xs / 2; x += xs) {
        double px = left + x / xmax * pw;
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#dddddd\"/>\n", px, top, px, top + ph);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n", px, top + ph, px,
                top + ph + 5);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%g</text>\n", px, top + ph + 20, x);
    }
    /* Axes and their labels. */
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n", left, top + ph, left + pw,
            top + ph);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n", left, top, left, top + ph);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">device budget (%s)</text>\n", left + pw / 2, H - 20,
            unit == (double)TD_GiB ? "GiB" : "MiB");
    fprintf(f, "<text x=\"20\" y=\"%.1f\" text-anchor=\"middle\" transform=\"rotate(-90 20 %.1f)\">tokens/s</text>\n",
            top + ph / 2, top + ph / 2);
    /* The line through the budgets that trained, then one point per budget. */
    fprintf(f, "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"2\" points=\"");
    for (int i = 0; i < n; i++)
        if (tps[i] > 0)
            fprintf(f, "%.1f,%.1f ", left + (double)budgets[i] / unit / xmax * pw,
                    top + ph - tps[i] / ymax * ph);
    fprintf(f, "\"/>\n");
    for (int i = 0; i < n; i++) {
        double px = left + (double)budgets[i] / unit / xmax * pw;
        double py = top + ph - (tps[i] > 0 ? tps[i] : 0) / ymax * ph;
        char b[32];
        td_format_bytes(budgets[i], b, sizeof b);
        if (tps[i] > 0) {
            tick_label(lab, sizeof lab, round(tps[i]));
            fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"4\" fill=\"#1f77b4\"><title>%s: %.0f tokens/s</title></circle>\n",
                    px, py, b, tps[i]);
            fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" font-size=\"11\">%s</text>\n", px, py - 9, lab);
        } else {
            fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"4\" fill=\"white\" stroke=\"#d62728\" stroke-width=\"2\">"
                       "<title>%s: does not train</title></circle>\n", px, py, b);
        }
    }
    fprintf(f, "</svg>\n");
    return ferror(f) ? td_error_set(TD_ERR_IO, "plot: write failed") : TD_OK;
}
