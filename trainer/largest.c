/* `tidal plan --largest`'s search: the most layers of a shape that fit the
 * host and the device (td_train_largest_layers in trainer.h).
 *
 * Each layer count tried is a plan, and a plan lays the model out: seconds
 * at 4096 narrow layers.  The search gives the answer of the plain
 * one it replaced (the host's bound by doubling then bisecting, then every
 * count below it, from the top, until one fits the device too) while
 * planning few counts.  What it may assume, and what it may not:
 *   - The device's need is not monotone in the layers, so no bisection
 *     finds where it stops fitting: the chunk size is searched per layout
 *     (narrow blocks pack two a chunk at an even count, one at an odd), so
 *     the working set and the largest chunk go up and down by a layer;
 *     --ckpt auto recomputes more blocks as the layers grow, and keeps every
 *     block's activations while they are small; the GPU optimizer chunks
 *     take what the budget leaves.  So every count below the start is still
 *     tried from the top, as before.
 *   - The device's floor (td_train_device_floor_bytes) is monotone: it grows
 *     with the layers and no plan needs less.  No count whose floor exceeds
 *     the budget fits, so the scan starts at the most layers whose floor
 *     fits, bisected without a layout; the counts above it, which the plain
 *     scan tried one by one, are the bulk of its time at narrow widths.
 *   - Nor is the host's need quite monotone (a few KiB of padding), so its
 *     bound is what the plain search's probes make of it: the same probes,
 *     in the same order, except that they stop once one at or above the
 *     scan's start fits the host (the bisection only raises its lower end,
 *     so the bound is at least that probe: the rest cannot lower the start).
 * Below the start every count is planned from the top down until one
 * fits (the brute force's answer: the device's need goes up and down by
 * whole chunks, a count fitting ten above one that does not), while the
 * layers planned stay within SCAN_LAYERS; only past that, at thousands of
 * narrow layers under a loose start, is the edge bisected (descend). */
#include "train_impl.h"

#include <string.h>

/* The most layers whose device floor is within the budget; 0 when none, or
 * when the budget exceeds the device's free memory (then nothing fits). */
static int device_cap(const td_train_config *cfg, const td_train_limits *lim)
{
    if (lim->budget_bytes > lim->device_free_bytes) return 0;
    td_train_config c = *cfg;
    int lo = 0, hi = TD_TRAIN_LARGEST_LAYERS + 1; /* lo's floor fits (or lo is 0), hi's does not (or hi is past) */
    while (hi - lo > 1) {
        c.model.n_layer = lo + (hi - lo) / 2;
        if (td_train_device_floor_bytes(&c) <= lim->budget_bytes) lo = c.model.n_layer;
        else hi = c.model.n_layer;
    }
    return lo;
}

/* The host's bound as the plain search finds it (doubling from one layer
 * while the host fits, then bisecting), or `cap` when that is no lower.
 * The first probe always runs: a shape that cannot be planned at one layer
 * (--ckpt-blocks above 1) fails there, as it did. */
static td_status host_bound(const td_train_config *cfg, const td_train_limits *lim, int cap, int *bound)
{
    td_train_config c = *cfg;
    td_train_plan p;
    int fits, host = 0, lo = 0, hi = 1;
    td_status st;
    for (;;) {
        c.model.n_layer = hi;
        if ((st = td_train_plan_fits(&c, lim, &p, &fits, &host))) return st;
        if (!host || hi >= TD_TRAIN_LARGEST_LAYERS || hi >= cap) break;
        lo = hi;
        hi *= 2;
    }
    if (host) lo = hi;
    while (hi - lo > 1 && lo < cap) {
        c.model.n_layer = lo + (hi - lo) / 2;
        if ((st = td_train_plan_fits(&c, lim, &p, &fits, &host))) return st;
        if (host) lo = c.model.n_layer;
        else hi = c.model.n_layer;
    }
    *bound = lo < cap ? lo : cap;
    return TD_OK;
}

/* Whether `layers` of cfg fit lim (its plan into *p). */
static td_status fits_at(const td_train_config *cfg, const td_train_limits *lim, int layers, td_train_plan *p, int *fits)
{
    td_train_config c = *cfg;
    c.model.n_layer = layers;
    return td_train_plan_fits(&c, lim, p, fits, NULL);
}

/* The exact scan's cost: the layers of every count it plans, summed (a
 * plan's time grows with its layers, about 0.15 ms a layer at narrow
 * widths): every count from the start down at a few dozen layers, a
 * dozen counts near a thousand. */
#define SCAN_LAYERS 16384

/* Past the exact scan, a count near the device's edge fits or not by its
 * layout as well as by its size (the chunk size searched per count packs
 * blocks differently, --ckpt auto's choice, the GPU optimizer chunks), so
 * the counts this far above a boundary the bisection finds are tried too
 * before it is the answer. */
#define EDGE_LAYERS 16

/* The most layers at or below `start` that fit.  First every count from
 * the top down to the first that fits, while their layers sum to at most
 * SCAN_LAYERS: the exact answer, the brute force's.  Past that (thousands
 * of narrow layers below a loose start), from the count the scan stopped
 * at down in doubling steps to the first count that fits, bisection
 * between it and the count above it that did not, then the EDGE_LAYERS
 * counts above the boundary found (a fit there starts the bisection again
 * above it). */
static td_status descend(const td_train_config *cfg, const td_train_limits *lim, int start, int *layers)
{
    td_train_plan p;
    int fits = 0;
    long spent = 0;
    td_status st;
    int n = start;
    for (; n > 0 && spent + n <= SCAN_LAYERS; n--) {
        if ((st = fits_at(cfg, lim, n, &p, &fits))) return st;
        spent += n;
        if (fits) {
            *layers = n;
            return TD_OK;
        }
    }
    start = n; /* every count above it does not fit */
    int lo = 0, hi = start + 1, step = 1;
    for (; n > 0 && !lo; step *= 2) {
        if ((st = fits_at(cfg, lim, n, &p, &fits))) return st;
        if (fits) lo = n;
        else hi = n, n = n - step > 0 ? n - step : n > 1 ? 1 : 0;
    }
    if (!lo) {
        *layers = 0;
        return TD_OK;
    }
    for (;;) {
        while (hi - lo > 1) {
            int mid = lo + (hi - lo) / 2;
            if ((st = fits_at(cfg, lim, mid, &p, &fits))) return st;
            if (fits) lo = mid;
            else hi = mid;
        }
        int above = 0;
        for (int k = lo + 2; k <= lo + EDGE_LAYERS && k <= start && !above; k++) {
            if ((st = fits_at(cfg, lim, k, &p, &fits))) return st;
            if (fits) above = k;
        }
        if (!above) break;
        lo = above;
        hi = start + 1;
    }
    *layers = lo;
    return TD_OK;
}

td_status td_train_largest_layers(const td_train_config *cfg, const td_train_limits *lim, int *layers,
                                  td_train_plan *p)
{
    int start = 0, fits = 0;
    td_status st = host_bound(cfg, lim, device_cap(cfg, lim), &start);
    if (st || (st = descend(cfg, lim, start, layers))) return st;
    memset(p, 0, sizeof *p);
    return *layers ? fits_at(cfg, lim, *layers, p, &fits) : TD_OK;
}

/* The presets of cfg's family, growing as td_model_preset_names lists them,
 * at cfg's vocabulary and sequence: which fit, and the largest. */
static td_status largest_preset(const td_train_config *cfg, const td_train_limits *lim, td_train_largest *out)
{
    size_t best_params = 0;
    for (const char *const *n = td_model_preset_names(); *n; n++) {
        td_train_config pc = *cfg;
        td_status st = td_model_preset(*n, &pc.model);
        if (st) return st;
        if (td_model_family_of(&pc.model) != td_model_family_of(&cfg->model)) continue;
        pc.model.vocab_size = cfg->model.vocab_size;
        pc.model.padded_vocab_size = cfg->model.padded_vocab_size;
        pc.model.lora = cfg->model.lora; /* the run asked for: its adapters (and --freeze, kept with the config) */
        if (pc.model.n_positions < pc.seq_len) pc.model.n_positions = pc.seq_len;
        if (td_train_config_check(&pc) != TD_OK) { /* a shape this run cannot take (--ckpt N past its layers, a rank past its width) */
            td_error_clear();
            continue;
        }
        td_train_plan pp;
        int ok = 0;
        if ((st = td_train_plan_fits(&pc, lim, &pp, &ok, NULL))) {
            if (st != TD_ERR_INVALID) return st;
            td_error_clear(); /* --freeze naming what this preset lacks (a layer past its count) */
            continue;
        }
        if (!ok) continue;
        if (out->n_presets_fit < TD_TRAIN_LARGEST_PRESETS) out->presets_fit[out->n_presets_fit++] = *n;
        if (pp.params > best_params) {
            best_params = pp.params;
            out->preset = *n;
            out->preset_plan = pp;
        }
    }
    return TD_OK;
}

td_status td_train_largest_model(const td_train_config *cfg, const td_train_limits *lim, td_train_largest *out)
{
    memset(out, 0, sizeof *out);
    td_status st = td_train_largest_layers(cfg, lim, &out->layers, &out->plan);
    return st ? st : largest_preset(cfg, lim, out);
}
