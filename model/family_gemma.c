/* Gemma (GemmaForCausalLM: Gemma 1, 2B and 7B) as a model family (see
 * include/tidal/family.h): the rotary decoder (model/rotary.h) with
 *   - the embedding multiplied by sqrt(C), rounded to the compute dtype as
 *     transformers rounds it (torch.tensor(hidden_size ** 0.5, dtype));
 *   - RMSNorm with the gain 1 + w (GemmaRMSNorm: its weights start at 0);
 *   - GeGLU: down(gelu_tanh(gate) * up) (hidden_activation
 *     "gelu_pytorch_tanh");
 *   - heads of head_dim channels, which need not split the width (Gemma 7B:
 *     16 heads of 256 over a width of 3072), so q_proj is (NH hs, C) and
 *     o_proj (C, NH hs);
 *   - multi-query or grouped-query attention, no biases, a tied head by default.
 * Everything else is the decoder's: its Hugging Face names are LLaMA's. */
#include "rotary.h"

#include <string.h>

static const td_family_preset presets[] = {
    /* a small Gemma-shaped model for tests and trials: multi-query, heads of
     * 48 over a width of 128 (not C / NH), GeGLU 384 wide */
    {"tiny-gemma", {.n_layer = 2, .n_embd = 128, .n_head = 4, .n_kv_head = 1, .head_dim = 48, .n_inner = 384,
                    .n_positions = 256, .vocab_size = 256, .norm_eps = 1e-6f, .rope_theta = 10000.0f}},
    {"gemma-2b", {.n_layer = 18, .n_embd = 2048, .n_head = 8, .n_kv_head = 1, .head_dim = 256, .n_inner = 16384,
                  .n_positions = 8192, .vocab_size = 256000, .norm_eps = 1e-6f, .rope_theta = 10000.0f,
                  .has_pad_token = 1, .pad_token = 0}},
    {"gemma-7b", {.n_layer = 28, .n_embd = 3072, .n_head = 16, .n_kv_head = 16, .head_dim = 256, .n_inner = 24576,
                  .n_positions = 8192, .vocab_size = 256000, .norm_eps = 1e-6f, .rope_theta = 10000.0f,
                  .has_pad_token = 1, .pad_token = 0}},
};

static void defaults(td_model_desc *d) { d->qkv_bias = 0; }

static td_status check(const td_model_desc *d)
{
    if (d->qkv_bias) return td_error_set(TD_ERR_INVALID, "a gemma model has no q/k/v biases");
    return td_rotary_check(d);
}

/* The gains start at 0: GemmaRMSNorm scales by 1 + w. */
static td_model_init_rule init(const td_model_desc *d, td_model_param kind)
{
    if (kind == TD_MODEL_LN1_W || kind == TD_MODEL_LN2_W || kind == TD_MODEL_LNF_W)
        return (td_model_init_rule){.value = 0.0f};
    return td_model_init_common(d, kind);
}

/* GemmaConfig (transformers' defaults for what is absent: head_dim 256, a
 * tied head, pad_token_id 0).  Gemma's MLP reads hidden_activation (absent: tanh GELU);
 * hidden_act is not read by transformers' Gemma, so not here either. */
static td_status config_read(const td_hf_config *c, td_model_desc *d)
{
    td_status st = TD_OK;
    TD_TRY(td_rotary_config_read(c, d, 1e-6f, 256));
    if (!td_hf_config_has(c, "tie_word_embeddings")) d->untied_head = 0;
    if (!td_hf_config_present(c, "pad_token_id")) { /* GemmaConfig's default; null is none */
        d->has_pad_token = 1;
        d->pad_token = 0;
    }
    static const char *const gelu_tanh[] = {"gelu_pytorch_tanh", "gelu_new", NULL};
    TD_TRY(td_hf_config_one_of(c, "hidden_activation", gelu_tanh,
                               "tidal's GeGLU computes GELU with the tanh approximation (gelu_pytorch_tanh)"));
    TD_TRY(td_hf_config_must_be(c, "attention_bias", 0, "tidal's Gemma has no attention biases"));
    TD_TRY(td_hf_config_must_be(c, "use_sliding_window", 0, "tidal attends over the whole sequence"));
cleanup:
    return st;
}

static td_status config_write(const td_model_desc *d, td_hf_config *c)
{
    td_status st = TD_OK;
    TD_TRY(td_rotary_config_write(d, c));
    TD_TRY(td_hf_config_set_int(c, "head_dim", td_model_head_size(d)));
    TD_TRY(td_hf_config_set_string(c, "hidden_act", "gelu_pytorch_tanh"));
    TD_TRY(td_hf_config_set_string(c, "hidden_activation", "gelu_pytorch_tanh"));
    TD_TRY(td_hf_config_set_bool(c, "attention_bias", 0));
cleanup:
    return st;
}

const td_model_family td_family_gemma = {
    .name = "gemma",
    .title = "Gemma",
    .architecture = "GemmaForCausalLM",
    .summary = "RMSNorm with gain 1 + w, embedding times sqrt(width), RoPE, multi- or grouped-query attention with "
               "free head size, GeGLU MLP (tanh GELU), no biases, tied head",
    .traits = {.norm = TD_MODEL_NORM_RMS, .norm_offset = 1.0f, .gated = 1, .act = TD_OPS_GLU_GELU_TANH, .rope = 1,
               .embed_scaled = 1},
    .presets = presets,
    .n_presets = (int)(sizeof presets / sizeof presets[0]),
    .defaults = defaults,
    .check = check,
    .init = init,
    .config_read = config_read,
    .config_write = config_write,
    TD_ROTARY_FAMILY_ENTRIES
};
