/* The model's description (see include/tidal/model.h): the derived sizes,
 * the checks every family shares, the presets of every family, and the
 * comparison of two descriptions.  What differs between families is asked
 * of the family's table (family.h). */
#include "tidal/family.h"

#include <stdio.h>
#include <string.h>

int td_model_pad_vocab(int vocab) { return (vocab + 63) / 64 * 64; }

int td_model_kv_heads(const td_model_desc *d) { return d->n_kv_head > 0 ? d->n_kv_head : d->n_head; }
int td_model_head_size(const td_model_desc *d)
{
    return d->head_dim > 0 ? d->head_dim : d->n_head > 0 ? d->n_embd / d->n_head : 0;
}
int td_model_attn_width(const td_model_desc *d) { return d->n_head * td_model_head_size(d); }
int td_model_mlp_width(const td_model_desc *d) { return d->n_inner > 0 ? d->n_inner : 4 * d->n_embd; }
int td_model_qkv_width(const td_model_desc *d)
{
    return (d->n_head + 2 * td_model_kv_heads(d)) * td_model_head_size(d);
}
float td_model_norm_eps(const td_model_desc *d) { return d->norm_eps > 0 ? d->norm_eps : TD_OPS_LN_EPS; }
float td_model_rope_theta(const td_model_desc *d) { return d->rope_theta > 0 ? d->rope_theta : 10000.0f; }

/* "gemma, gpt2, llama or qwen2" into buf. */
static const char *family_list(char *buf, size_t n)
{
    size_t k = 0;
    buf[0] = '\0';
    for (int i = 0, c = td_model_family_count(); i < c && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, "%s%s", i == 0 ? "" : i == c - 1 ? " or " : ", ",
                              td_model_family_at(i)->name);
    return buf;
}

static int registered(const td_model_family *f)
{
    for (int i = 0; i < td_model_family_count(); i++)
        if (td_model_family_at(i) == f) return 1;
    return 0;
}

td_status td_model_desc_set_family(td_model_desc *d, const char *name)
{
    const td_model_family *f = td_model_family_find(name);
    char list[256];
    if (!f)
        return td_error_set(TD_ERR_INVALID, "model family '%s' is unknown; use %s", name ? name : "",
                            family_list(list, sizeof list));
    d->family = td_model_family_stored(f);
    if (f->defaults) f->defaults(d);
    return TD_OK;
}

/* --- presets ----------------------------------------------------------------- */

td_status td_model_preset(const char *name, td_model_desc *out)
{
    for (int i = 0; name && i < td_model_family_count(); i++) {
        const td_model_family *f = td_model_family_at(i);
        for (int k = 0; k < f->n_presets; k++) {
            if (strcmp(name, f->presets[k].name)) continue;
            *out = f->presets[k].desc;
            out->family = td_model_family_stored(f);
            out->padded_vocab_size = td_model_pad_vocab(out->vocab_size);
            return TD_OK;
        }
    }
    char list[1024];
    size_t k = 0;
    for (const char *const *p = td_model_preset_names(); *p && k < sizeof list; p++)
        k += (size_t)snprintf(list + k, sizeof list - k, "%s%s", k ? ", " : "", *p);
    return td_error_set(TD_ERR_INVALID, "unknown model preset '%s'; use one of %s", name ? name : "", list);
}

const char *const *td_model_preset_names(void)
{
    enum { MAX_PRESETS = 256 };
    static const char *names[MAX_PRESETS + 1];
    int n = 0; /* the same list on every call: concurrent callers write the same values */
    for (int i = 0; i < td_model_family_count(); i++) {
        const td_model_family *f = td_model_family_at(i);
        for (int k = 0; k < f->n_presets && n < MAX_PRESETS; k++) names[n++] = f->presets[k].name;
    }
    names[n] = NULL;
    return names;
}

/* --- checks ------------------------------------------------------------------ */

td_status td_model_desc_check(const td_model_desc *d)
{
    char list[256];
    if (!d) return td_error_set(TD_ERR_INVALID, "no model configuration given");
    if (d->family && !registered(d->family))
        return td_error_set(TD_ERR_INVALID, "the model's family is not one of tidal's (%s)",
                            family_list(list, sizeof list));
    if (d->n_layer < 1 || d->n_head < 1 || d->n_embd < 1 || d->n_positions < 1 || d->vocab_size < 1)
        return td_error_set(TD_ERR_INVALID,
                            "model sizes must be positive: layers %d, heads %d, width %d, "
                            "positions %d, vocabulary %d",
                            d->n_layer, d->n_head, d->n_embd, d->n_positions, d->vocab_size);
    if (d->n_kv_head < 0 || d->n_inner < 0 || d->head_dim < 0 || d->norm_eps < 0 || d->rope_theta < 0)
        return td_error_set(TD_ERR_INVALID, "key/value heads %d, MLP width %d, head size %d, norm eps %g and rope "
                            "theta %g must not be negative", d->n_kv_head, d->n_inner, d->head_dim, d->norm_eps,
                            d->rope_theta);
    if (!d->head_dim && d->n_embd % d->n_head)
        return td_error_set(TD_ERR_INVALID,
                            "width %d is not a multiple of the %d heads; pick a width divisible by "
                            "the head count",
                            d->n_embd, d->n_head);
    if (d->padded_vocab_size < d->vocab_size)
        return td_error_set(TD_ERR_INVALID,
                            "padded vocabulary %d is smaller than the vocabulary %d; pad up (e.g. "
                            "to a multiple of 64)",
                            d->padded_vocab_size, d->vocab_size);
    if (d->n_head % td_model_kv_heads(d))
        return td_error_set(TD_ERR_INVALID, "the %d heads are not a multiple of the %d key/value heads; "
                            "num_key_value_heads must divide num_attention_heads", d->n_head, d->n_kv_head);
    /* the widths first: 4 x width, 2 x MLP width and the q|k|v rows must not
     * overflow (fuzz_hf_config) */
    if (d->n_layer > 100000 || (int64_t)d->n_embd * 4 > INT32_MAX || (int64_t)td_model_mlp_width(d) * 2 > INT32_MAX ||
        ((int64_t)d->n_head + 2 * (int64_t)td_model_kv_heads(d)) * td_model_head_size(d) > INT32_MAX)
        return td_error_set(TD_ERR_INVALID, "layers %d, width %d, MLP width %d or head size %d are out of range",
                            d->n_layer, d->n_embd, d->n_inner, d->head_dim);
    const td_model_family *f = td_model_family_of(d);
    return f->check ? f->check(d) : TD_OK;
}

int td_model_desc_describe(const td_model_desc *d, char *buf, size_t n)
{
    return td_model_family_of(d)->describe(d, buf, n);
}

const char *td_model_desc_differs(const td_model_desc *a, const td_model_desc *b)
{
#define SIZE(field)                                             \
    if (a->field > 0 && a->field != b->field) return #field;
    SIZE(n_layer) SIZE(n_head) SIZE(n_embd) SIZE(n_positions) SIZE(vocab_size)
#undef SIZE
    if (a->n_layer < 1) return NULL; /* a partial description: its sizes alone */
    if (td_model_family_of(a) != td_model_family_of(b)) return "model_type";
    if (td_model_kv_heads(a) != td_model_kv_heads(b)) return "num_key_value_heads";
    if (td_model_mlp_width(a) != td_model_mlp_width(b)) return "intermediate_size";
    if (td_model_head_size(a) != td_model_head_size(b)) return "head_dim";
    if (a->untied_head != b->untied_head) return "tie_word_embeddings";
    if (a->qkv_bias != b->qkv_bias) return "q/k/v biases";
    if (td_model_norm_eps(a) != td_model_norm_eps(b)) return "the norm's eps";
    if (td_model_rope_theta(a) != td_model_rope_theta(b)) return "rope_theta";
    if (memcmp(&a->rope_scaling, &b->rope_scaling, sizeof a->rope_scaling)) return "rope_scaling";
    return NULL;
}
