/* The model's description: the presets by name and the padded vocabulary.
 * A model is a td_gpt_ref_config (gpt_ref.h): layers, heads, width,
 * positions and vocabulary of the GPT-2 architecture.
 * Thread-safety: pure functions. */
#ifndef TIDAL_MODEL_H
#define TIDAL_MODEL_H

#include "tidal/gpt_ref.h"
#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Presets: tiny, gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b, gpt-2.7b,
 * gpt-4b, gpt-6.7b, gpt-13b.  Vocabulary 50257 padded to 50304, 1024
 * positions (tiny: 2 layers, 128 wide, 4 heads, 256 positions, vocab 256). */
td_status td_model_preset(const char *name, td_gpt_ref_config *out);
/* Names of the presets, NULL-terminated. */
const char *const *td_model_preset_names(void);
/* The vocabulary rounded up to a multiple of 64 (the logits' width). */
int td_model_pad_vocab(int vocab);

#ifdef __cplusplus
}
#endif
#endif
