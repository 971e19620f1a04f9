/* AdamW coefficients, grad statistics and the step controller: the scalar
 * decisions made once per step (skip or not, lr, clip coefficient), in
 * double, before any chunk is touched. */
#include "tidal/optim.h"

#include <math.h>
#include <string.h>

static const char *const state_names[TD_OPTIM_STATE_COUNT] = {"fp32", "bf16", "int8"};

const char *td_optim_state_name(td_optim_state s)
{
    return (unsigned)s < TD_OPTIM_STATE_COUNT ? state_names[s] : "?";
}

td_status td_optim_state_parse(const char *name, td_optim_state *out)
{
    for (int i = 0; i < TD_OPTIM_STATE_COUNT; i++)
        if (name && !strcmp(name, state_names[i])) {
            *out = (td_optim_state)i;
            return TD_OK;
        }
    return td_error_set(TD_ERR_INVALID,
                        "unknown optimizer state '%s': use fp32 (exact), bf16 (m and v in bf16) or int8 "
                        "(m and v block-wise quantized)",
                        name ? name : "(null)");
}

td_status td_optim_state_check(td_optim_state s)
{
    if ((unsigned)s < TD_OPTIM_STATE_COUNT) return TD_OK;
    return td_error_set(TD_ERR_INVALID, "optimizer state type %d: use fp32 (exact), bf16 (m and v in bf16) or int8 "
                        "(m and v block-wise quantized)", (int)s);
}

td_dtype td_adam_moment_dtype(td_optim_state s)
{
    switch (s) {
    case TD_OPTIM_STATE_FP32: return TD_DTYPE_F32;
    case TD_OPTIM_STATE_BF16: return TD_DTYPE_BF16;
    default: return TD_DTYPE_COUNT;
    }
}

size_t td_adam_moment_align(td_optim_state s) { return s == TD_OPTIM_STATE_INT8 ? TD_ADAM_INT8_BLOCK : 1; }

size_t td_adam_moment_bytes(td_optim_state s, size_t numel)
{
    switch (s) {
    case TD_OPTIM_STATE_FP32: return numel * 4;
    case TD_OPTIM_STATE_BF16: return numel * 2;
    case TD_OPTIM_STATE_INT8: {
        /* codes, padded to 4 bytes, then one fp32 scale per block */
        size_t blocks = (numel + TD_ADAM_INT8_BLOCK - 1) / TD_ADAM_INT8_BLOCK;
        return ((numel + 3) & ~(size_t)3) + blocks * 4;
    }
    default: return 0;
    }
}

double td_adam_state_bytes_per_param(td_optim_state s)
{
    switch (s) {
    case TD_OPTIM_STATE_FP32: return 12.0;
    case TD_OPTIM_STATE_BF16: return 8.0;
    case TD_OPTIM_STATE_INT8: return 4.0 + 2.0 * (1.0 + 4.0 / TD_ADAM_INT8_BLOCK);
    default: return 0.0;
    }
}

td_adam_hparams td_adam_default_hparams(void)
{
    return (td_adam_hparams){
        .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01, .decay = TD_ADAM_DECAY_DECOUPLED};
}

td_status td_adam_hparams_check(const td_adam_hparams *hp)
{
    if (!hp) return td_error_set(TD_ERR_INVALID, "AdamW hyper-parameters are NULL");
    if (!(hp->beta1 >= 0 && hp->beta1 < 1))
        return td_error_set(TD_ERR_INVALID, "beta1 %g out of range: use 0 <= beta1 < 1 (e.g. 0.9)", hp->beta1);
    if (!(hp->beta2 >= 0 && hp->beta2 < 1))
        return td_error_set(TD_ERR_INVALID, "beta2 %g out of range: use 0 <= beta2 < 1 (e.g. 0.999)", hp->beta2);
    if (!(hp->eps > 0 && isfinite(hp->eps)))
        return td_error_set(TD_ERR_INVALID, "eps %g out of range: use a positive value (e.g. 1e-8)", hp->eps);
    if (!(hp->weight_decay >= 0 && isfinite(hp->weight_decay)))
        return td_error_set(TD_ERR_INVALID, "weight decay %g out of range: use >= 0", hp->weight_decay);
    if (hp->decay != TD_ADAM_DECAY_DECOUPLED && hp->decay != TD_ADAM_DECAY_L2)
        return td_error_set(TD_ERR_INVALID, "bad weight-decay mode %d", (int)hp->decay);
    return TD_OK;
}

/* A step's stochastic-rounding seed: the step through a 32-bit mixer
 * (lowbias32), so neighbouring steps get unrelated streams. */
static uint32_t td_adam_sr_seed(long step)
{
    uint32_t x = (uint32_t)step * 0x9e3779b9u + 0x6a09e667u;
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

td_status td_adam_coeffs_make(const td_adam_hparams *hp, double lr, long step, double grad_mul, td_adam_coeffs *out)
{
    td_status st = td_adam_hparams_check(hp);
    if (st) return st;
    if (!out) return td_error_set(TD_ERR_INVALID, "td_adam_coeffs_make: out is NULL");
    if (step < 1) return td_error_set(TD_ERR_INVALID, "AdamW step %ld: steps count from 1", step);
    if (!(lr >= 0 && isfinite(lr))) return td_error_set(TD_ERR_INVALID, "learning rate %g: use a finite lr >= 0", lr);
    if (!(grad_mul >= 0 && isfinite(grad_mul)))
        return td_error_set(TD_ERR_INVALID, "grad multiplier %g (clip / loss scale) is not finite and >= 0", grad_mul);
    /* Bias corrections in double, as torch computes them in Python floats. */
    double bc1 = 1.0 - pow(hp->beta1, (double)step);
    double bc2 = 1.0 - pow(hp->beta2, (double)step);
    int l2 = hp->decay == TD_ADAM_DECAY_L2;
    *out = (td_adam_coeffs){
        .grad_mul = (float)grad_mul,
        .l2 = l2 ? (float)hp->weight_decay : 0.0f,
        .decay_mul = l2 ? 1.0f : (float)(1.0 - lr * hp->weight_decay),
        .beta1 = (float)hp->beta1,
        .one_minus_beta1 = (float)(1.0 - hp->beta1),
        .beta2 = (float)hp->beta2,
        .one_minus_beta2 = (float)(1.0 - hp->beta2),
        .step_size = (float)(lr / bc1),
        .rsqrt_bc2 = (float)(1.0 / sqrt(bc2)),
        .eps = (float)hp->eps,
        .sr_seed = td_adam_sr_seed(step),
    };
    return TD_OK;
}

/* ---- grad statistics --------------------------------------------------------- */

int td_grad_stats_overflow(const td_grad_stats *s) { return !isfinite(s->sumsq); }

double td_grad_stats_norm(const td_grad_stats *s, double loss_scale) { return sqrt(s->sumsq) / loss_scale; }

double td_clip_coef(double norm, double max_norm)
{
    if (!(max_norm > 0)) return 1.0;
    double c = max_norm / (norm + 1e-6);
    return c < 1.0 ? c : 1.0;
}

/* ---- the step controller ------------------------------------------------------ */

td_optim_params td_optim_default_params(void)
{
    return (td_optim_params){
        .adam = td_adam_default_hparams(),
        .lr = td_lr_schedule_default(),
        .scaler = td_loss_scaler_default_params(),
        .max_grad_norm = 1.0,
    };
}

td_status td_optim_params_check(const td_optim_params *p)
{
    td_status st;
    if (!p) return td_error_set(TD_ERR_INVALID, "optimizer parameters are NULL");
    if ((st = td_adam_hparams_check(&p->adam)) || (st = td_lr_schedule_check(&p->lr)) ||
        (st = td_loss_scaler_params_check(&p->scaler)))
        return st;
    if (!isfinite(p->max_grad_norm))
        return td_error_set(TD_ERR_INVALID, "max grad norm %g: use a finite value (<= 0 turns clipping off)",
                            p->max_grad_norm);
    return td_optim_state_check(p->state);
}

td_status td_optim_init(td_optim *o, const td_optim_params *p)
{
    td_status st = TD_OK;
    if (!o || !p) return td_error_set(TD_ERR_INVALID, "td_optim_init: NULL optimizer or params");
    memset(o, 0, sizeof *o);
    TD_TRY(td_optim_params_check(p));
    TD_TRY(td_loss_scaler_init(&o->scaler, &p->scaler));
    o->params = *p;
cleanup:
    return st;
}

double td_optim_loss_scale(const td_optim *o) { return o->scaler.scale; }

td_status td_optim_begin_step(td_optim *o, const td_grad_stats *global, td_optim_step *out)
{
    if (!o || !global || !out) return td_error_set(TD_ERR_INVALID, "td_optim_begin_step: NULL argument");
    memset(out, 0, sizeof *out);
    out->loss_scale = o->scaler.scale;
    out->grad_norm = td_grad_stats_norm(global, out->loss_scale);
    if (td_loss_scaler_update(&o->scaler, td_grad_stats_overflow(global))) {
        out->skip = 1;
        out->step = o->step;
        out->lr = td_lr_at(&o->params.lr, o->step + 1);
        out->clip_coef = 1.0;
        o->skipped_steps++;
        return TD_OK;
    }
    out->step = o->step + 1;
    out->lr = td_lr_at(&o->params.lr, out->step);
    out->clip_coef = td_clip_coef(out->grad_norm, o->params.max_grad_norm);
    td_status st = td_adam_coeffs_make(&o->params.adam, out->lr, out->step, out->clip_coef / out->loss_scale,
                                       &out->coeffs);
    if (st) return st;
    o->step = out->step;
    return TD_OK;
}
