/* LLaMA (LlamaForCausalLM: Llama 3.x, SmolLM2, Mistral-style blocks
 * without a sliding window) as a model family (see include/tidal/family.h):
 * the rotary decoder (model/rotary.h) with no biases, SwiGLU, RMSNorm, a
 * tied or untied head.  Initialisation: every matrix N(0, 0.02)
 * (transformers' initializer_range), norm gains 1, the padding rows of the
 * embedding and lm_head 0. */
#include "rotary.h"

#include <string.h>

/* Llama 3.1/3.2's llama3 rope scaling: factor, low 1, high 4, original 8192. */
#define LLAMA3(f) {.factor = (f), .low_freq_factor = 1.0f, .high_freq_factor = 4.0f, .original_max_positions = 8192}

static const td_family_preset presets[] = {
    /* a small LLaMA-shaped model for tests and trials: GQA 2 query heads a key/value head */
    {"tiny-llama", {.n_layer = 2, .n_embd = 128, .n_head = 4, .n_kv_head = 2, .n_inner = 352, .n_positions = 256,
                    .vocab_size = 256, .norm_eps = 1e-5f, .rope_theta = 10000.0f}},
    {"llama-3.2-1b", {.n_layer = 16, .n_embd = 2048, .n_head = 32, .n_kv_head = 8, .n_inner = 8192,
                      .n_positions = 131072, .vocab_size = 128256, .norm_eps = 1e-5f, .rope_theta = 500000.0f,
                      .rope_scaling = LLAMA3(32.0f)}},
    {"llama-3.2-3b", {.n_layer = 28, .n_embd = 3072, .n_head = 24, .n_kv_head = 8, .n_inner = 8192,
                      .n_positions = 131072, .vocab_size = 128256, .norm_eps = 1e-5f, .rope_theta = 500000.0f,
                      .rope_scaling = LLAMA3(32.0f)}},
    {"llama-3.1-8b", {.n_layer = 32, .n_embd = 4096, .n_head = 32, .n_kv_head = 8, .n_inner = 14336,
                      .n_positions = 131072, .vocab_size = 128256, .norm_eps = 1e-5f, .rope_theta = 500000.0f,
                      .rope_scaling = LLAMA3(8.0f), .untied_head = 1}},
    {"smollm2-135m", {.n_layer = 30, .n_embd = 576, .n_head = 9, .n_kv_head = 3, .n_inner = 1536, .n_positions = 8192,
                      .vocab_size = 49152, .norm_eps = 1e-5f, .rope_theta = 100000.0f}},
    {"smollm2-360m", {.n_layer = 32, .n_embd = 960, .n_head = 15, .n_kv_head = 5, .n_inner = 2560, .n_positions = 8192,
                      .vocab_size = 49152, .norm_eps = 1e-5f, .rope_theta = 100000.0f}},
    {"smollm2-1.7b", {.n_layer = 24, .n_embd = 2048, .n_head = 32, .n_kv_head = 32, .n_inner = 8192,
                      .n_positions = 8192, .vocab_size = 49152, .norm_eps = 1e-5f, .rope_theta = 130000.0f}},
};

static void defaults(td_model_desc *d)
{
    d->qkv_bias = 0;
    d->head_dim = 0;
}

static td_status check(const td_model_desc *d)
{
    if (d->qkv_bias)
        return td_error_set(TD_ERR_INVALID, "a llama model has no q/k/v biases; describe it as qwen2");
    if (td_model_head_size(d) * d->n_head != d->n_embd)
        return td_error_set(TD_ERR_INVALID, "a llama model's heads split its width: head size %d x %d heads is not "
                            "%d", td_model_head_size(d), d->n_head, d->n_embd);
    return td_rotary_check(d);
}

/* LlamaConfig (transformers' defaults for what is absent). */
static td_status config_read(const td_hf_config *c, td_model_desc *d)
{
    td_status st = TD_OK;
    TD_TRY(td_rotary_config_read(c, d, 1e-6f, 0));
    static const char *const silu[] = {"silu", NULL};
    TD_TRY(td_hf_config_one_of(c, "hidden_act", silu, "tidal's SwiGLU uses \"silu\""));
    TD_TRY(td_hf_config_must_be(c, "attention_bias", 0, "tidal's LLaMA has no attention biases (Qwen2 has q/k/v ones)"));
    TD_TRY(td_hf_config_must_be(c, "mlp_bias", 0, "tidal's MLP has no biases"));
    TD_TRY(td_hf_config_must_be(c, "use_sliding_window", 0, "tidal attends over the whole sequence"));
    double tp = 1;
    TD_TRY(td_hf_config_number(c, "pretraining_tp", &tp));
    if (tp != 1) TD_FAIL(TD_ERR_INVALID, "%s: \"pretraining_tp\" must be 1", td_hf_config_where(c));
cleanup:
    return st;
}

static td_status config_write(const td_model_desc *d, td_hf_config *c)
{
    td_status st = TD_OK;
    TD_TRY(td_rotary_config_write(d, c));
    TD_TRY(td_hf_config_set_int(c, "head_dim", td_model_head_size(d)));
    TD_TRY(td_hf_config_set_string(c, "hidden_act", "silu"));
    TD_TRY(td_hf_config_set_bool(c, "attention_bias", 0));
    TD_TRY(td_hf_config_set_bool(c, "mlp_bias", 0));
    TD_TRY(td_hf_config_set_int(c, "pretraining_tp", 1));
cleanup:
    return st;
}

const td_model_family td_family_llama = {
    .name = "llama",
    .title = "LLaMA",
    .architecture = "LlamaForCausalLM",
    .summary = "RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, no biases, tied or untied head",
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
