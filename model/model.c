/* Model presets: the published GPT-2 shapes and larger ones of the same
 * architecture (see include/tidal/model.h). */
#include "tidal/model.h"

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
