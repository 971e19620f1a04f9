/* The model in Hugging Face's files (see include/tidal/model.h): the
 * tensors of model.safetensors from the family's parts (which tidal tensor
 * each is, or which rows of a fused one), and config.json read and written
 * through the family's keys. */
#include "tidal/family.h"

#include <stdio.h>
#include <string.h>

static const td_model_family *fam(const td_model_desc *d) { return td_model_family_of(d); }

static int parts(const td_model_desc *d, td_model_section s, td_model_hf_part out[TD_MODEL_HF_PARTS_MAX])
{
    return fam(d)->hf_parts(d, s, out);
}

int td_model_hf_count(const td_model_desc *d)
{
    td_model_hf_part p[TD_MODEL_HF_PARTS_MAX];
    return parts(d, TD_MODEL_SECTION_EMBED, p) + parts(d, TD_MODEL_SECTION_BLOCK, p) * d->n_layer +
           parts(d, TD_MODEL_SECTION_FINAL, p);
}

/* The rows of a part of a fused (rows, ...) tensor: first row and count. */
static void split_rows(const td_model_desc *d, td_model_hf_split s, int64_t *row0, int64_t *rows)
{
    const int64_t hs = td_model_head_size(d), q = (int64_t)d->n_head * hs;
    const int64_t kv = (int64_t)td_model_kv_heads(d) * hs, H = td_model_mlp_width(d);
    switch (s) {
    case TD_MODEL_HF_Q: *row0 = 0; *rows = q; return;
    case TD_MODEL_HF_K: *row0 = q; *rows = kv; return;
    case TD_MODEL_HF_V: *row0 = q + kv; *rows = kv; return;
    case TD_MODEL_HF_GATE: *row0 = 0; *rows = H; return;
    case TD_MODEL_HF_UP: *row0 = H; *rows = H; return;
    default: *row0 = 0; *rows = -1; return;
    }
}

/* The layout index of the tensor of `kind` in a section (layer for blocks), or -1. */
static int tensor_of(const td_model_desc *d, td_model_section s, int layer, td_model_param kind)
{
    td_model_param k[TD_MODEL_BLOCK_TENSORS];
    const td_model_family *f = fam(d);
    /* a block's stride in the layout counts its LoRA adapters (after the family's tensors) */
    const int ne = td_model_embed_tensor_count(d), nb = td_model_block_tensor_count(d);
    const int first = s == TD_MODEL_SECTION_EMBED ? 0 : s == TD_MODEL_SECTION_BLOCK ? ne + layer * nb
                                                                                    : ne + nb * d->n_layer;
    for (int j = 0, n = f->kinds(d, s, k); j < n; j++)
        if (k[j] == kind) return first + j;
    return -1;
}

td_status td_model_hf_get(const td_model_desc *d, int index, td_model_hf_tensor *out)
{
    const int count = td_model_hf_count(d);
    memset(out, 0, sizeof *out);
    if (index < 0 || index >= count)
        return td_error_set(TD_ERR_INVALID, "Hugging Face tensor index %d out of range (0..%d)", index, count - 1);
    td_model_hf_part ep[TD_MODEL_HF_PARTS_MAX], bp[TD_MODEL_HF_PARTS_MAX], fp[TD_MODEL_HF_PARTS_MAX];
    const int ne = parts(d, TD_MODEL_SECTION_EMBED, ep), nb = parts(d, TD_MODEL_SECTION_BLOCK, bp);
    parts(d, TD_MODEL_SECTION_FINAL, fp);
    const int L = d->n_layer;
    td_model_hf_part part;
    int layer = -1;
    td_model_section s;
    if (index < ne) {
        part = ep[index], s = TD_MODEL_SECTION_EMBED;
    } else if (index < ne + nb * L) {
        layer = (index - ne) / nb;
        part = bp[(index - ne) % nb], s = TD_MODEL_SECTION_BLOCK;
    } else {
        part = fp[index - ne - nb * L], s = TD_MODEL_SECTION_FINAL;
    }
    out->tensor = tensor_of(d, s, layer, part.kind);
    if (out->tensor < 0)
        return td_error_set(TD_ERR_INVALID, "the %s family's Hugging Face tensor '%s' names a tensor its layout "
                            "lacks", fam(d)->name, part.name);
    td_model_tensor t;
    td_model_tensor_get(d, out->tensor, &t);
    out->layer = layer;
    out->ndim = t.ndim;
    out->shape[0] = t.shape[0];
    out->shape[1] = t.ndim == 2 ? t.shape[1] : 0;
    if (layer >= 0) snprintf(out->name, sizeof out->name, "%s%d.%s", fam(d)->hf_block_prefix, layer, part.name);
    else snprintf(out->name, sizeof out->name, "%s", part.name);
    int64_t row0, rows;
    split_rows(d, part.split, &row0, &rows);
    if (rows >= 0) {
        out->shape[0] = rows;
        out->offset = (uint64_t)row0 * (uint64_t)(t.ndim == 2 ? t.shape[1] : 1);
    }
    out->transposed = part.transposed;
    out->hf_shape[0] = out->transposed ? out->shape[1] : out->shape[0];
    out->hf_shape[1] = out->transposed ? out->shape[0] : out->shape[1];
    if (t.kind == TD_MODEL_WTE || t.kind == TD_MODEL_LM_HEAD) out->hf_shape[0] = d->vocab_size;
    out->numel = (uint64_t)out->shape[0] * (uint64_t)(out->ndim == 2 ? out->shape[1] : 1);
    out->hf_numel = (uint64_t)out->hf_shape[0] * (uint64_t)(out->ndim == 2 ? out->hf_shape[1] : 1);
    return TD_OK;
}

/* "123." -> 123 and the rest after the dot; no sign, no leading zeros. */
static int parse_layer(const char *s, const char **rest)
{
    if (s[0] < '0' || s[0] > '9' || (s[0] == '0' && s[1] >= '0' && s[1] <= '9')) return -1;
    long v = 0;
    while (*s >= '0' && *s <= '9') {
        v = v * 10 + (*s++ - '0');
        if (v > 1000000) return -1;
    }
    if (*s != '.') return -1;
    *rest = s + 1;
    return (int)v;
}

const char *td_model_hf_strip(const td_model_desc *d, const char *name)
{
    const char *pre = fam(d)->hf_optional_prefix;
    if (!pre) return name;
    return strncmp(name, pre, strlen(pre)) ? name : name + strlen(pre);
}

int td_model_hf_layer(const td_model_desc *d, const char *name, const char **rest)
{
    const char *pre = fam(d)->hf_block_prefix;
    name = td_model_hf_strip(d, name);
    if (strncmp(name, pre, strlen(pre))) return -1;
    return parse_layer(name + strlen(pre), rest);
}

int td_model_hf_find(const td_model_desc *d, const char *name)
{
    name = td_model_hf_strip(d, name);
    td_model_hf_part p[TD_MODEL_HF_PARTS_MAX];
    const int ne = parts(d, TD_MODEL_SECTION_EMBED, p), hb = parts(d, TD_MODEL_SECTION_BLOCK, p);
    const int count = td_model_hf_count(d), L = d->n_layer;
    const char *rest;
    int layer = td_model_hf_layer(d, name, &rest);
    if (layer >= 0) {
        if (layer >= L) return -1;
        for (int k = 0; k < hb; k++)
            if (!strcmp(rest, p[k].name)) return ne + layer * hb + k;
        return -1;
    }
    for (int i = 0; i < count; i = i == ne - 1 ? ne + hb * L : i + 1) { /* outside the blocks */
        td_model_hf_tensor t;
        if (td_model_hf_get(d, i, &t) == TD_OK && !strcmp(name, t.name)) return i;
    }
    return -1;
}

int td_model_hf_ignorable(const td_model_desc *d, const char *name)
{
    name = td_model_hf_strip(d, name);
    if (!strcmp(name, "lm_head.weight") && !d->untied_head) return 1; /* a tied head saved anyway */
    const char *rest;
    int layer = td_model_hf_layer(d, name, &rest);
    const char *const *ign = fam(d)->hf_ignored;
    if (layer < 0 || layer >= d->n_layer || !ign) return 0;
    for (int i = 0; ign[i]; i++)
        if (!strcmp(rest, ign[i])) return 1;
    return 0;
}

/* --- config.json ---------------------------------------------------------- */

td_status td_model_config_get(const td_hf_config *c, td_model_desc *out)
{
    td_status st = TD_OK;
    memset(out, 0, sizeof *out);
    const char *type = "gpt2";
    TD_TRY(td_hf_config_string(c, "model_type", 0, &type));
    const td_model_family *f = td_model_family_find(type);
    if (!f) {
        char list[256];
        size_t k = 0;
        list[0] = '\0';
        for (int i = 0, n = td_model_family_count(); i < n && k < sizeof list; i++)
            k += (size_t)snprintf(list + k, sizeof list - k, "%s%s", i == 0 ? "" : i == n - 1 ? " and " : ", ",
                                  td_model_family_at(i)->name);
        TD_FAIL(TD_ERR_INVALID, "%s: model_type \"%s\" is not supported; tidal loads %s models",
                td_hf_config_where(c), type, list);
    }
    out->family = td_model_family_stored(f);
    if (f->defaults) f->defaults(out);
    TD_TRY(f->config_read(c, out));
    out->padded_vocab_size = out->vocab_size;
    TD_TRY(td_hf_config_int(c, "tidal_padded_vocab_size", 0, &out->padded_vocab_size));
cleanup:
    return st;
}

td_status td_model_config_put(const td_model_desc *d, td_hf_config *c)
{
    td_status st = TD_OK;
    const td_model_family *f = fam(d);
    TD_TRY(td_hf_config_set_strings1(c, "architectures", f->architecture));
    TD_TRY(td_hf_config_set_string(c, "model_type", f->name));
    TD_TRY(f->config_write(d, c));
    TD_TRY(td_hf_config_set_int(c, "tidal_padded_vocab_size", d->padded_vocab_size));
cleanup:
    return st;
}

td_status td_model_config_read(const char *path, td_model_desc *out)
{
    td_status st = TD_OK;
    td_hf_config *c = NULL;
    TD_TRY(td_hf_config_load(path, &c));
    TD_TRY(td_model_config_get(c, out));
    st = td_model_desc_check(out);
    if (st) td_error_prefix(st, "%s: ", path);
cleanup:
    td_hf_config_free(c);
    return st;
}
