/* Loss scaling: none, static, or dynamic (DeepSpeed's rule with
 * hysteresis).  The scaler only decides; td_optim_begin_step applies its
 * decision (skip the step, unscale by the scale the grads were made with). */
#include "tidal/optim.h"

#include <math.h>
#include <string.h>

static const char *const kind_names[] = {"none", "static", "dynamic"};


td_status td_loss_scale_kind_parse(const char *name, td_loss_scale_kind *out)
{
    for (int i = 0; i < 3; i++)
        if (name && !strcmp(name, kind_names[i])) {
            *out = (td_loss_scale_kind)i;
            return TD_OK;
        }
    return td_error_set(TD_ERR_INVALID, "unknown loss scaling '%s': use none, static or dynamic", name ? name : "(null)");
}

td_loss_scaler_params td_loss_scaler_default_params(void)
{
    return (td_loss_scaler_params){.kind = TD_LOSS_SCALE_NONE, .init_scale = 65536.0, .growth_factor = 2.0,
                                   .backoff_factor = 0.5, .growth_interval = 1000, .hysteresis = 2,
                                   .min_scale = 1.0};
}

td_status td_loss_scaler_params_check(const td_loss_scaler_params *p)
{
    if (!p) return td_error_set(TD_ERR_INVALID, "loss scaler parameters are NULL");
    if ((unsigned)p->kind > TD_LOSS_SCALE_DYNAMIC) return td_error_set(TD_ERR_INVALID, "bad loss scaling %d", (int)p->kind);
    if (p->kind != TD_LOSS_SCALE_NONE && !(p->init_scale > 0 && isfinite(p->init_scale)))
        return td_error_set(TD_ERR_INVALID, "loss scale %g: use a finite scale > 0 (e.g. 65536)", p->init_scale);
    if (p->kind == TD_LOSS_SCALE_DYNAMIC) {
        if (!(p->growth_factor >= 1 && isfinite(p->growth_factor)))
            return td_error_set(TD_ERR_INVALID, "loss-scale growth factor %g: use >= 1 (e.g. 2)", p->growth_factor);
        if (!(p->backoff_factor > 0 && p->backoff_factor < 1))
            return td_error_set(TD_ERR_INVALID, "loss-scale backoff factor %g: use 0 < f < 1 (e.g. 0.5)",
                                p->backoff_factor);
        if (p->growth_interval < 1)
            return td_error_set(TD_ERR_INVALID, "loss-scale growth interval %ld: use >= 1 (e.g. 1000)",
                                p->growth_interval);
        if (p->hysteresis < 1)
            return td_error_set(TD_ERR_INVALID, "loss-scale hysteresis %d: use >= 1 (e.g. 2)", p->hysteresis);
        if (!(p->min_scale > 0 && p->min_scale <= p->init_scale))
            return td_error_set(TD_ERR_INVALID, "minimum loss scale %g: use 0 < min <= initial scale (%g)",
                                p->min_scale, p->init_scale);
    }
    return TD_OK;
}

td_status td_loss_scaler_init(td_loss_scaler *s, const td_loss_scaler_params *p)
{
    if (!s || !p) return td_error_set(TD_ERR_INVALID, "td_loss_scaler_init: NULL argument");
    memset(s, 0, sizeof *s);
    td_status st = td_loss_scaler_params_check(p);
    if (st) return st;
    s->params = *p;
    s->scale = p->kind == TD_LOSS_SCALE_NONE ? 1.0 : p->init_scale;
    s->hysteresis_left = p->hysteresis;
    return TD_OK;
}

int td_loss_scaler_update(td_loss_scaler *s, int overflow)
{
    const td_loss_scaler_params *p = &s->params;
    if (overflow) {
        s->overflows++;
        s->clean_steps = 0;
        if (p->kind != TD_LOSS_SCALE_DYNAMIC) return 1;
        if (s->hysteresis_left > 1) {
            s->hysteresis_left--;
        } else {
            s->hysteresis_left = 1;
            s->scale = fmax(s->scale * p->backoff_factor, p->min_scale);
        }
        return 1;
    }
    if (p->kind == TD_LOSS_SCALE_DYNAMIC && ++s->clean_steps >= p->growth_interval) {
        s->clean_steps = 0;
        s->hysteresis_left = p->hysteresis;
        s->scale *= p->growth_factor;
    }
    return 0;
}
