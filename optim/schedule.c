/* Learning-rate schedules: linear warmup, then constant, cosine, linear,
 * Noam or exponential decay to a floor.  Closed forms in double, indexed by
 * the 1-based AdamW step, so a resumed run gets the same lr as an unbroken
 * one and a skipped (overflow) step does not advance the schedule. */
#include "tidal/optim.h"

#include <math.h>
#include <string.h>

/* Warmup: lr * t / W for t <= W.  After it, the decay clock k = t - W - 1
 * starts at 0, so the first step after warmup (or step 1 without warmup)
 * runs at the peak lr. */
static const char *const decay_names[TD_LR_DECAY_COUNT] = {"constant", "cosine", "linear", "noam", "exponential"};

const char *td_lr_decay_name(td_lr_decay d) { return (unsigned)d < TD_LR_DECAY_COUNT ? decay_names[d] : "?"; }

td_status td_lr_decay_parse(const char *name, td_lr_decay *out)
{
    for (int i = 0; i < TD_LR_DECAY_COUNT; i++)
        if (name && !strcmp(name, decay_names[i])) {
            *out = (td_lr_decay)i;
            return TD_OK;
        }
    return td_error_set(TD_ERR_INVALID, "unknown lr schedule '%s': use constant, cosine, linear, noam or exponential",
                        name ? name : "(null)");
}

td_lr_schedule td_lr_schedule_default(void)
{
    return (td_lr_schedule){.decay = TD_LR_DECAY_CONSTANT, .lr = 1e-4, .min_lr = 0.0, .warmup_steps = 0,
                            .total_steps = 0, .gamma = 1.0};
}

td_status td_lr_schedule_check(const td_lr_schedule *s)
{
    if (!s) return td_error_set(TD_ERR_INVALID, "lr schedule is NULL");
    if ((unsigned)s->decay >= TD_LR_DECAY_COUNT) return td_error_set(TD_ERR_INVALID, "bad lr decay %d", (int)s->decay);
    if (!(s->lr > 0 && isfinite(s->lr))) return td_error_set(TD_ERR_INVALID, "lr %g: use a finite lr > 0", s->lr);
    if (!(s->min_lr >= 0 && s->min_lr <= s->lr))
        return td_error_set(TD_ERR_INVALID, "min lr %g: use 0 <= min lr <= lr (%g)", s->min_lr, s->lr);
    if (s->warmup_steps < 0) return td_error_set(TD_ERR_INVALID, "warmup steps %ld < 0", s->warmup_steps);
    if ((s->decay == TD_LR_DECAY_COSINE || s->decay == TD_LR_DECAY_LINEAR) && s->total_steps < s->warmup_steps + 2)
        return td_error_set(TD_ERR_INVALID,
                            "%s decay needs total steps (%ld) >= warmup steps (%ld) + 2: raise --steps or lower "
                            "--warmup",
                            decay_names[s->decay], s->total_steps, s->warmup_steps);
    if (s->decay == TD_LR_DECAY_EXPONENTIAL && !(s->gamma > 0 && s->gamma <= 1))
        return td_error_set(TD_ERR_INVALID, "exponential decay factor %g: use 0 < gamma <= 1 (e.g. 0.999)", s->gamma);
    return TD_OK;
}

double td_lr_at(const td_lr_schedule *s, long step)
{
    double t = (double)(step < 1 ? 1 : step), w = (double)s->warmup_steps;
    if (s->decay != TD_LR_DECAY_NOAM && t <= w) return s->lr * t / w;
    double lr = s->lr, floor = s->min_lr;
    switch (s->decay) {
    case TD_LR_DECAY_COSINE:
    case TD_LR_DECAY_LINEAR: {
        /* k = 0 on the first step after warmup, so that step runs at the peak. */
        double span = (double)s->total_steps - w - 1; /* >= 1 (checked) */
        double p = (t - w - 1) / span;
        p = p < 0 ? 0 : p > 1 ? 1 : p;
        double f = s->decay == TD_LR_DECAY_COSINE ? 0.5 * (1.0 + cos(M_PI * p)) : 1.0 - p;
        return floor + (lr - floor) * f;
    }
    case TD_LR_DECAY_NOAM: {
        /* Warmup and decay in one formula: min(t/W', sqrt(W'/t)), peak at t = W'. */
        double wp = w < 1 ? 1 : w;
        double f = t / wp < sqrt(wp / t) ? t / wp : sqrt(wp / t);
        return t <= wp ? lr * f : fmax(floor, lr * f);
    }
    case TD_LR_DECAY_EXPONENTIAL: return fmax(floor, lr * pow(s->gamma, t - w - 1));
    default: return lr;
    }
}
