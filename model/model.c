/* Model presets: the published GPT-2 shapes and larger ones of the same
 * architecture, and the published LLaMA 3.x, Qwen2.5 and SmolLM2 shapes (from
 * each model's Hugging Face config.json; see include/tidal/model.h). */
#include "tidal/model.h"

#include <stdio.h>
#include <string.h>

typedef struct preset {
    const char *name;
    td_model_family family;
    int layers, width, heads, kv_heads, inner, positions, vocab;
    float eps, theta;
    float rope_factor;   /* llama3 rope scaling: factor (0: none), low 1, high 4, original 8192 */
    int qkv_bias, tied;
} preset;

static const preset presets[] = {
    {"tiny", TD_MODEL_GPT2, 2, 128, 4, 0, 0, 256, 256, 0, 0, 0, 0, 1},
    {"gpt2-124m", TD_MODEL_GPT2, 12, 768, 12, 0, 0, 1024, 50257, 0, 0, 0, 0, 1},
    {"gpt2-350m", TD_MODEL_GPT2, 24, 1024, 16, 0, 0, 1024, 50257, 0, 0, 0, 0, 1},
    {"gpt2-774m", TD_MODEL_GPT2, 36, 1280, 20, 0, 0, 1024, 50257, 0, 0, 0, 0, 1},
    {"gpt2-1.5b", TD_MODEL_GPT2, 48, 1600, 25, 0, 0, 1024, 50257, 0, 0, 0, 0, 1},
    {"gpt-2.7b", TD_MODEL_GPT2, 32, 2560, 32, 0, 0, 1024, 50257, 0, 0, 0, 0, 1},
    {"gpt-4b", TD_MODEL_GPT2, 32, 3200, 25, 0, 0, 1024, 50257, 0, 0, 0, 0, 1},
    {"gpt-6.7b", TD_MODEL_GPT2, 32, 4096, 32, 0, 0, 1024, 50257, 0, 0, 0, 0, 1},
    {"gpt-13b", TD_MODEL_GPT2, 40, 5120, 40, 0, 0, 1024, 50257, 0, 0, 0, 0, 1},
    /* a small LLaMA-shaped model for tests and trials: GQA 2 query heads a key/value head */
    {"tiny-llama", TD_MODEL_LLAMA, 2, 128, 4, 2, 352, 256, 256, 1e-5f, 10000.0f, 0, 0, 1},
    {"llama-3.2-1b", TD_MODEL_LLAMA, 16, 2048, 32, 8, 8192, 131072, 128256, 1e-5f, 500000.0f, 32.0f, 0, 1},
    {"llama-3.2-3b", TD_MODEL_LLAMA, 28, 3072, 24, 8, 8192, 131072, 128256, 1e-5f, 500000.0f, 32.0f, 0, 1},
    {"llama-3.1-8b", TD_MODEL_LLAMA, 32, 4096, 32, 8, 14336, 131072, 128256, 1e-5f, 500000.0f, 8.0f, 0, 0},
    {"qwen2.5-0.5b", TD_MODEL_QWEN2, 24, 896, 14, 2, 4864, 32768, 151936, 1e-6f, 1000000.0f, 0, 1, 1},
    {"qwen2.5-1.5b", TD_MODEL_QWEN2, 28, 1536, 12, 2, 8960, 131072, 151936, 1e-6f, 1000000.0f, 0, 1, 1},
    {"qwen2.5-7b", TD_MODEL_QWEN2, 28, 3584, 28, 4, 18944, 131072, 152064, 1e-6f, 1000000.0f, 0, 1, 0},
    {"smollm2-135m", TD_MODEL_LLAMA, 30, 576, 9, 3, 1536, 8192, 49152, 1e-5f, 100000.0f, 0, 0, 1},
    {"smollm2-360m", TD_MODEL_LLAMA, 32, 960, 15, 5, 2560, 8192, 49152, 1e-5f, 100000.0f, 0, 0, 1},
    {"smollm2-1.7b", TD_MODEL_LLAMA, 24, 2048, 32, 32, 8192, 8192, 49152, 1e-5f, 130000.0f, 0, 0, 1},
};
enum { N_PRESETS = sizeof presets / sizeof presets[0] };

int td_model_pad_vocab(int vocab) { return (vocab + 63) / 64 * 64; }

const char *const *td_model_preset_names(void)
{
    static const char *names[N_PRESETS + 1];
    for (size_t i = 0; i < N_PRESETS; i++) names[i] = presets[i].name;
    return names;
}

void td_model_desc_set_family(td_model_desc *cfg, td_model_family family)
{
    cfg->family = family;
    int gpt2 = family == TD_MODEL_GPT2;
    cfg->norm = gpt2 ? TD_MODEL_NORM_LAYER : TD_MODEL_NORM_RMS;
    cfg->act = gpt2 ? TD_MODEL_ACT_GELU : TD_MODEL_ACT_SWIGLU;
    cfg->pos = gpt2 ? TD_MODEL_POS_LEARNED : TD_MODEL_POS_ROPE;
    cfg->qkv_bias = family == TD_MODEL_QWEN2;
}

td_status td_model_preset(const char *name, td_model_desc *out)
{
    for (size_t i = 0; i < N_PRESETS; i++) {
        const preset *p = &presets[i];
        if (!name || strcmp(name, p->name)) continue;
        memset(out, 0, sizeof *out);
        *out = (td_model_desc){ .n_layer = p->layers, .n_head = p->heads, .n_embd = p->width,
                                    .n_positions = p->positions, .vocab_size = p->vocab,
                                    .padded_vocab_size = td_model_pad_vocab(p->vocab) };
        if (p->family == TD_MODEL_GPT2) return TD_OK;
        td_model_desc_set_family(out, p->family);
        out->qkv_bias = p->qkv_bias;
        out->n_kv_head = p->kv_heads;
        out->n_inner = p->inner;
        out->norm_eps = p->eps;
        out->rope_theta = p->theta;
        out->untied_head = !p->tied;
        if (p->rope_factor > 0)
            out->rope_scaling = (td_rope_scaling){ .factor = p->rope_factor, .low_freq_factor = 1.0f,
                                                   .high_freq_factor = 4.0f, .original_max_positions = 8192 };
        return TD_OK;
    }
    char list[512];
    size_t k = 0;
    for (size_t i = 0; i < N_PRESETS && k < sizeof list; i++)
        k += (size_t)snprintf(list + k, sizeof list - k, "%s%s", i ? ", " : "", presets[i].name);
    return td_error_set(TD_ERR_INVALID, "unknown model preset '%s'; use one of %s", name ? name : "", list);
}

int td_model_desc_describe(const td_model_desc *cfg, char *buf, size_t n)
{
    if (cfg->family == TD_MODEL_GPT2)
        return snprintf(buf, n, "gpt2: %d layers, %d wide, %d heads, vocab %d", cfg->n_layer, cfg->n_embd,
                        cfg->n_head, cfg->vocab_size);
    return snprintf(buf, n, "%s: %d layers, %d wide, %d heads (%d key/value), MLP %d, vocab %d, rope theta %g%s, "
                    "%s head%s", td_model_family_name(cfg->family), cfg->n_layer, cfg->n_embd, cfg->n_head,
                    td_model_kv_heads(cfg), td_model_mlp_width(cfg), cfg->vocab_size, td_model_rope_theta(cfg),
                    cfg->rope_scaling.factor > 0 ? " (llama3 scaling)" : "", cfg->untied_head ? "untied" : "tied",
                    cfg->qkv_bias ? ", q/k/v biases" : "");
}
