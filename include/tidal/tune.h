/* Tuning a run for a device budget (`tidal tune`, docs/training.md).
 *
 * The knobs, at the run's tokens per optimizer step:
 *   micro-batch x grad-accum   every split of the step's sequences;
 *   checkpointed blocks        none, a quarter, half, three quarters, all;
 *   optimizer share on the GPU --policy auto with --offload-optim-frac as
 *                              the host's least share (auto keeps as many
 *                              optimizer chunks on the GPU as fit, the least
 *                              CPU slack first);
 *   chunk size                 the searched default, half a block, two blocks;
 *   prefetch depth             the winner again at depths 2 and 8 beside
 *                              the auto depth (the plan's model assumes
 *                              copies overlap fully, so it cannot rank
 *                              depths; only a run can).
 * Each candidate is planned (td_train_plan_make) and ranked by its step
 * bound (td_train_bound_of, from rates measured once); the best few run for
 * a few steps with the trainer, each under the budget; the fastest measured
 * wins.  Everything here is single-threaded. */
#ifndef TIDAL_TUNE_H
#define TIDAL_TUNE_H

#include <stddef.h>
#include <stdio.h>

#include "tidal/trainer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_tune_candidate {
    td_train_config cfg;          /* the run, gpu_budget included */
    td_train_plan plan;
    td_train_bound bound;         /* the plan's model of its step */
    int fits;                     /* the plan's minimum fits the budget and the pin limit */
    /* Measured by td_tune_run: */
    int ran;                      /* 1 measured, -1 failed (error), 0 not run */
    double tokens_per_s;          /* median over the steps after the warm-up */
    double step_ms;               /* median step */
    size_t device_peak_bytes;     /* the arena's peak over the run */
    size_t pinned_bytes;          /* pinned host memory at the end */
    char error[256];
} td_tune_candidate;

/* Every distinct candidate of base's knobs at `budget` (base's tokens per
 * step, model and other settings kept), ranked: those that fit by the
 * bound's tokens/s, best first (ties: the fewer PCIe and CPU AdamW ms, then
 * the larger micro-batch, then the fewer recomputed blocks), then those
 * that do not fit.  rates: measured once (td_train_measure_rates); on the
 * cuda backend the block times are measured again for each micro-batch
 * (b may be NULL to skip that).  *out: td_free it. */
td_status td_tune_candidates(const td_train_config *base, size_t budget, td_backend *b, const td_train_rates *rates,
                             td_tune_candidate **out, int *n);

/* Whether two candidates' plans make the same choices (micro-batch,
 * recomputed blocks, optimizer chunks on the GPU, chunk size, prefetch):
 * such candidates train alike. */
int td_tune_same_choice(const td_tune_candidate *a, const td_tune_candidate *b);

/* A batch source for a candidate's run: opened for its micro-batch and
 * sequence, closed after. */
typedef struct td_tune_data {
    td_status (*open)(void *ctx, const td_train_config *cfg, td_batch_fn *fn, void **batch_ctx);
    void (*close)(void *batch_ctx);
    void *ctx;
    /* Called after each step (may be NULL): progress lines. */
    void (*progress)(void *ctx, const td_tune_candidate *c, int step, int steps);
} td_tune_data;

/* Trains c->cfg for `steps` steps (at least 2: the first is the warm-up)
 * and fills the measured fields.  A run that fails (its budget refused, an
 * error) is recorded in c->ran = -1 and c->error; only a broken batch
 * source is returned as an error. */
td_status td_tune_run(td_tune_candidate *c, int steps, const td_tune_data *data);

/* The flags of c as `tidal train` takes them ("--micro-batch 4 --grad-accum 2
 * --ckpt 12 --policy auto --offload-optim-frac 0.25 --prefetch -1
 * --chunk-numel 0 --gpu-budget 8589934592"); returns the length. */
size_t td_tune_flags(const td_tune_candidate *c, char *buf, size_t buf_bytes);
/* --offload-optim-frac that reproduces c's optimizer share under auto. */
double td_tune_optim_frac(const td_tune_candidate *c);

/* An SVG line plot of tokens/s against the device budget: one point per
 * budget (bytes; tokens_per_s <= 0 marks a budget that did not train,
 * drawn on the axis), axes with ticks and labels, a title. */
td_status td_tune_plot_svg(FILE *f, const char *title, const size_t *budgets, const double *tokens_per_s, int n);

#ifdef __cplusplus
}
#endif
#endif
