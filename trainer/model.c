/* Model presets and the training configuration's defaults and checks. */
#include "tidal/trainer.h"

#include <string.h>

typedef struct preset { const char *name; int layers, width, heads, positions, vocab; } preset;

static const preset presets[] = {
    {"tiny", 2, 128, 4, 256, 256},
    {"gpt2-124m", 12, 768, 12, 1024, 50257},
    {"gpt2-350m", 24, 1024, 16, 1024, 50257},
    {"gpt2-774m", 36, 1280, 20, 1024, 50257},
    {"gpt2-1.5b", 48, 1600, 25, 1024, 50257},
    {"gpt-2.7b", 32, 2560, 32, 1024, 50257},
    {"gpt-4b", 32, 3200, 25, 1024, 50257},
    {"gpt-6.7b", 32, 4096, 32, 1024, 50257},
    {"gpt-13b", 40, 5120, 40, 1024, 50257},
};

int td_model_pad_vocab(int vocab) { return (vocab + 63) / 64 * 64; }

const char *const *td_model_preset_names(void)
{
    static const char *names[sizeof presets / sizeof presets[0] + 1];
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++) names[i] = presets[i].name;
    return names;
}

td_status td_model_preset(const char *name, td_gpt_ref_config *out)
{
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++) {
        const preset *p = &presets[i];
        if (name && !strcmp(name, p->name)) {
            *out = (td_gpt_ref_config){ .n_layer = p->layers, .n_head = p->heads, .n_embd = p->width,
                                        .n_positions = p->positions, .vocab_size = p->vocab,
                                        .padded_vocab_size = td_model_pad_vocab(p->vocab) };
            return TD_OK;
        }
    }
    return td_error_set(TD_ERR_INVALID, "unknown model preset '%s'; use tiny, gpt2-124m, gpt2-350m, gpt2-774m, "
                        "gpt2-1.5b, gpt-2.7b, gpt-4b, gpt-6.7b or gpt-13b", name ? name : "");
}

td_train_config td_train_default_config(void)
{
    td_train_config c = {0};
    td_model_preset("tiny", &c.model);
    c.micro_batch = 4;
    c.seq_len = 64;
    c.grad_accum = 1;
    c.seed = 1337;
    c.precision = TD_DTYPE_F32;
    c.ckpt = TD_CKPT_AUTO;
    c.backend = TD_BACKEND_AUTO;
    c.mm = td_memmgr_default_params();
    c.optim = td_optim_default_params();
    return c;
}

td_status td_train_config_check(const td_train_config *c)
{
    td_status st = td_gpt_ref_config_check(&c->model);
    if (st) return st;
    if (c->micro_batch < 1) return td_error_set(TD_ERR_INVALID, "--micro-batch must be at least 1 (got %d)", c->micro_batch);
    if (c->seq_len < 1 || c->seq_len > c->model.n_positions)
        return td_error_set(TD_ERR_INVALID, "--seq %d must lie in [1, %d] (the model's positions)", c->seq_len,
                            c->model.n_positions);
    if (c->grad_accum < 1) return td_error_set(TD_ERR_INVALID, "--grad-accum must be at least 1 (got %d)", c->grad_accum);
    if ((size_t)c->micro_batch * (size_t)c->seq_len > (size_t)1 << 31)
        return td_error_set(TD_ERR_INVALID, "--micro-batch x --seq is too large");
    if ((unsigned)c->precision >= TD_DTYPE_COUNT) return td_error_set(TD_ERR_INVALID, "bad precision");
    if (c->ckpt_blocks < 0 || c->ckpt_blocks > c->model.n_layer)
        return td_error_set(TD_ERR_INVALID, "--ckpt %d: the model has %d blocks; recompute between 0 and %d of them",
                            c->ckpt_blocks, c->model.n_layer, c->model.n_layer);
    if ((st = td_adam_hparams_check(&c->optim.adam))) return st;
    return td_lr_schedule_check(&c->optim.lr);
}
