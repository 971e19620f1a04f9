/* The model's description: the presets by name and the padded vocabulary.
 * A model is a td_model_desc (= td_model_desc, model_ref.h): its family
 * (gpt2, llama, qwen2), layers, heads and key/value heads, width, MLP width,
 * norm, activation, positions (learned or RoPE with theta and llama3
 * scaling), biases, tied or untied head, positions and vocabulary.
 * Hugging Face config.json files are read by checkpoint/ (checkpoint.h).
 * Thread-safety: pure functions. */
#ifndef TIDAL_MODEL_H
#define TIDAL_MODEL_H

#include "tidal/model_ref.h"
#include "tidal/status.h"

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Presets: GPT-2 tiny, gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b, gpt-2.7b,
 * gpt-4b, gpt-6.7b, gpt-13b (vocabulary 50257 padded to 50304, 1024
 * positions; tiny: 2 layers, 128 wide, 4 heads, 256 positions, vocab 256);
 * LLaMA-family tiny-llama (2 layers, 128 wide, 4 heads, 2 key/value heads,
 * MLP 352, vocab 256), llama-3.2-1b, llama-3.2-3b, llama-3.1-8b,
 * qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, smollm2-135m, smollm2-360m,
 * smollm2-1.7b with their published shapes (docs/model.md lists them). */
td_status td_model_preset(const char *name, td_model_desc *out);
/* Sets the family and the norm, activation, positions and q/k/v biases it implies. */
void td_model_desc_set_family(td_model_desc *cfg, td_model_family family);
/* One line describing the model (snprintf's return). */
int td_model_desc_describe(const td_model_desc *cfg, char *buf, size_t n);
/* Names of the presets, NULL-terminated. */
const char *const *td_model_preset_names(void);
/* The vocabulary rounded up to a multiple of 64 (the logits' width). */
int td_model_pad_vocab(int vocab);

#ifdef __cplusplus
}
#endif
#endif
