/* Frozen tensors (--freeze): which tensors of the layout take no gradient
 * and no optimizer state, from glob patterns over the Hugging Face names.
 * tidal fuses some of the files' tensors (q|k|v, gate|up); such a tensor is
 * frozen when every part of it is, and a pattern that freezes some parts
 * and not the others is refused: the fused tensor has one gradient. */
#include "train_impl.h"
#include "tidal/alloc.h"

#include <fnmatch.h>
#include <string.h>

static int matches(const td_train_config *cfg, const char *name, int *hit)
{
    for (int p = 0; p < cfg->n_freeze; p++) {
        const char *pat = td_model_hf_strip(&cfg->model, cfg->freeze[p]);
        if (!fnmatch(pat, name, 0)) {
            hit[p] = 1;
            return 1;
        }
    }
    return 0;
}

td_status td_train_frozen(const td_train_config *cfg, uint8_t *frozen)
{
    const td_model_desc *d = &cfg->model;
    int n = td_model_tensor_count(d), nh = td_model_hf_count(d);
    memset(frozen, 0, (size_t)n);
    if (d->lora.rank > 0) /* LoRA: the base is frozen, the adapters train */
        for (int i = 0; i < n; i++) frozen[i] = !TD_MODEL_IS_LORA(td_model_tensor_kind(d, i));
    if (cfg->n_freeze <= 0) return TD_OK;
    if (!cfg->freeze) return td_error_set(TD_ERR_INVALID, "%d --freeze patterns but no list", cfg->n_freeze);
    td_status st = TD_OK;
    /* per tidal tensor: 1 a part matched, 2 a part did not (3: both) */
    uint8_t *seen = td_calloc((size_t)n, 1, TD_ROLE_META);
    int *hit = td_calloc((size_t)cfg->n_freeze, sizeof(int), TD_ROLE_META);
    int *first = td_malloc(2 * (size_t)n * sizeof(int), TD_ROLE_META); /* an HF tensor of each kind, per tensor */
    if (!seen || !hit || !first) {
        st = td_error_set(TD_ERR_NOMEM, "resolving --freeze over %d tensors", n);
        goto cleanup;
    }
    for (int i = 0; i < 2 * n; i++) first[i] = -1;
    for (int h = 0; h < nh; h++) {
        td_model_hf_tensor ht;
        TD_TRY(td_model_hf_get(d, h, &ht));
        int m = matches(cfg, ht.name, hit);
        seen[ht.tensor] |= m ? 1 : 2;
        if (first[2 * ht.tensor + !m] < 0) first[2 * ht.tensor + !m] = h;
    }
    for (int i = 0; i < n; i++) {
        if (seen[i] == 3) {
            td_model_hf_tensor a, b;
            td_model_tensor tt;
            TD_TRY(td_model_hf_get(d, first[2 * i], &a));
            TD_TRY(td_model_hf_get(d, first[2 * i + 1], &b));
            td_model_tensor_get(d, i, &tt);
            st = td_error_set(TD_ERR_INVALID, "--freeze: '%s' is frozen but '%s' is not, and tidal holds both in one "
                              "tensor (%s) with one gradient: freeze both or neither", a.name, b.name, tt.name);
            goto cleanup;
        }
        frozen[i] |= seen[i] == 1;
    }
    for (int p = 0; p < cfg->n_freeze; p++)
        if (!hit[p]) {
            td_model_hf_tensor ex;
            TD_TRY(td_model_hf_get(d, nh > 2 ? 2 : 0, &ex));
            st = td_error_set(TD_ERR_INVALID, "--freeze '%s' matches no tensor of the %s model: give a glob over its "
                              "Hugging Face names, e.g. '%s'", cfg->freeze[p], td_model_family_of(d)->name, ex.name);
            goto cleanup;
        }
cleanup:
    td_free(seen);
    td_free(hit);
    td_free(first);
    return st;
}

int td_train_frozen_count(const td_train_config *cfg, const uint8_t *frozen)
{
    int n = td_model_tensor_count(&cfg->model), c = 0;
    for (int i = 0; i < n; i++) c += frozen[i] != 0;
    return c;
}
