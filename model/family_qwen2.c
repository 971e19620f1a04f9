/* Qwen2 (Qwen2ForCausalLM: Qwen2, Qwen2.5) as a model family (see
 * include/tidal/family.h): the rotary decoder (model/rotary.h) with
 * biases on the q, k and v projections and none elsewhere, SwiGLU, RMSNorm
 * (eps 1e-6), a tied or untied head; attention over the whole sequence
 * (use_sliding_window false). */
#include "rotary.h"

static const td_family_preset presets[] = {
    {"qwen2.5-0.5b", {.n_layer = 24, .n_embd = 896, .n_head = 14, .n_kv_head = 2, .n_inner = 4864,
                      .n_positions = 32768, .vocab_size = 151936, .norm_eps = 1e-6f, .rope_theta = 1000000.0f,
                      .qkv_bias = 1}},
    {"qwen2.5-1.5b", {.n_layer = 28, .n_embd = 1536, .n_head = 12, .n_kv_head = 2, .n_inner = 8960,
                      .n_positions = 131072, .vocab_size = 151936, .norm_eps = 1e-6f, .rope_theta = 1000000.0f,
                      .qkv_bias = 1}},
    {"qwen2.5-7b", {.n_layer = 28, .n_embd = 3584, .n_head = 28, .n_kv_head = 4, .n_inner = 18944,
                    .n_positions = 131072, .vocab_size = 152064, .norm_eps = 1e-6f, .rope_theta = 1000000.0f,
                    .qkv_bias = 1, .untied_head = 1}},
};

static void defaults(td_model_desc *d)
{
    d->qkv_bias = 1;
    d->head_dim = 0;
}

static td_status check(const td_model_desc *d)
{
    if (!d->qkv_bias)
        return td_error_set(TD_ERR_INVALID, "a qwen2 model has q/k/v biases; describe one without as llama");
    if (td_model_head_size(d) * d->n_head != d->n_embd)
        return td_error_set(TD_ERR_INVALID, "a qwen2 model's heads split its width: head size %d x %d heads is not "
                            "%d", td_model_head_size(d), d->n_head, d->n_embd);
    return td_rotary_check(d);
}

/* Qwen2Config (transformers' defaults for what is absent). */
static td_status config_read(const td_hf_config *c, td_model_desc *d)
{
    td_status st = TD_OK;
    TD_TRY(td_rotary_config_read(c, d, 1e-6f, 0));
    static const char *const silu[] = {"silu", NULL};
    TD_TRY(td_hf_config_one_of(c, "hidden_act", silu, "tidal's SwiGLU uses \"silu\""));
    TD_TRY(td_hf_config_must_be(c, "use_sliding_window", 0, "tidal attends over the whole sequence"));
cleanup:
    return st;
}

static td_status config_write(const td_model_desc *d, td_hf_config *c)
{
    td_status st = TD_OK;
    TD_TRY(td_rotary_config_write(d, c));
    TD_TRY(td_hf_config_set_string(c, "hidden_act", "silu"));
    TD_TRY(td_hf_config_set_bool(c, "use_sliding_window", 0));
    TD_TRY(td_hf_config_set_int(c, "sliding_window", d->n_positions));
    TD_TRY(td_hf_config_set_int(c, "max_window_layers", d->n_layer));
cleanup:
    return st;
}

const td_model_family td_family_qwen2 = {
    .name = "qwen2",
    .title = "Qwen2",
    .architecture = "Qwen2ForCausalLM",
    .summary = "RMSNorm, RoPE, grouped-query attention with q/k/v biases, SwiGLU MLP, tied or untied head",
    .traits = {.norm = TD_MODEL_NORM_RMS, .gated = 1, .act = TD_OPS_GLU_SILU, .rope = 1},
    .presets = presets,
    .n_presets = (int)(sizeof presets / sizeof presets[0]),
    .defaults = defaults,
    .check = check,
    .init = td_model_init_common,
    .config_read = config_read,
    .config_write = config_write,
    TD_ROTARY_FAMILY_ENTRIES
};
