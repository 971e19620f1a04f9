/* The registry of model families (see include/tidal/family.h) and the
 * helpers their tables share.
 *
 * The build passes TD_FAMILY_LIST, one TD_FAMILY(name) for every
 * model/family_<name>.c (the Makefile's FAMILIES), so a new family file is
 * registered by being there; each defines td_family_<name>. */
#include "tidal/family.h"

#include <math.h>
#include <string.h>

#include "tidal/convert.h"

#ifndef TD_FAMILY_LIST
#error "TD_FAMILY_LIST is not defined: build with the Makefile, which lists model/family_*.c"
#endif

#define TD_FAMILY(n) extern const td_model_family td_family_##n;
TD_FAMILY_LIST
#undef TD_FAMILY

#define TD_FAMILY(n) &td_family_##n,
static const td_model_family *const registry[] = {TD_FAMILY_LIST};
#undef TD_FAMILY

enum { N_FAMILIES = sizeof registry / sizeof registry[0] };

int td_model_family_count(void) { return N_FAMILIES; }

const td_model_family *td_model_family_at(int i) { return i >= 0 && i < N_FAMILIES ? registry[i] : NULL; }

const td_model_family *td_model_family_find(const char *name)
{
    for (int i = 0; name && i < N_FAMILIES; i++)
        if (!strcmp(registry[i]->name, name)) return registry[i];
    return NULL;
}

/* The zero description's family. */
extern const td_model_family td_family_gpt2;

const td_model_family *td_model_family_of(const td_model_desc *d)
{
    return d && d->family ? d->family : &td_family_gpt2;
}

const td_model_family *td_model_family_stored(const td_model_family *f)
{
    return f == &td_family_gpt2 ? NULL : f;
}

const char *td_model_family_name(const td_model_family *f) { return f ? f->name : "unknown"; }
const char *td_model_family_title(const td_model_family *f) { return f && f->title ? f->title : td_model_family_name(f); }

/* The CPU reference over the family's td_model_cpu (model_ref.c). */
extern const td_model_exec td_model_cpu_exec;

const td_model_exec *td_model_exec_of(const td_model_desc *d, int cuda)
{
    return cuda ? td_model_family_of(d)->cuda : &td_model_cpu_exec;
}

int td_model_shape_common(const td_model_desc *d, td_model_param kind, int fc_rows, int shape[2])
{
    const int C = d->n_embd, H = td_model_mlp_width(d), QKV = td_model_qkv_width(d);
    switch (kind) {
    case TD_MODEL_WTE: case TD_MODEL_LM_HEAD: shape[0] = d->padded_vocab_size; shape[1] = C; return 2;
    case TD_MODEL_WPE: shape[0] = d->n_positions; shape[1] = C; return 2;
    case TD_MODEL_QKV_W: shape[0] = QKV; shape[1] = C; return 2;
    case TD_MODEL_QKV_B: shape[0] = QKV; return 1;
    case TD_MODEL_ATTPROJ_W: shape[0] = C; shape[1] = td_model_attn_width(d); return 2;
    case TD_MODEL_FC_W: shape[0] = fc_rows; shape[1] = C; return 2;
    case TD_MODEL_FC_B: shape[0] = H; return 1;
    case TD_MODEL_FCPROJ_W: shape[0] = C; shape[1] = H; return 2;
    default: shape[0] = C; return 1; /* norm weights and biases, C-wide biases */
    }
}

td_model_init_rule td_model_init_common(const td_model_desc *d, td_model_param kind)
{
    (void)d;
    switch (kind) {
    case TD_MODEL_LN1_W: case TD_MODEL_LN2_W: case TD_MODEL_LNF_W:
        return (td_model_init_rule){.value = 1.0f};
    case TD_MODEL_LN1_B: case TD_MODEL_LN2_B: case TD_MODEL_LNF_B: case TD_MODEL_QKV_B:
    case TD_MODEL_ATTPROJ_B: case TD_MODEL_FC_B: case TD_MODEL_FCPROJ_B:
        return (td_model_init_rule){.value = 0.0f};
    default:
        return (td_model_init_rule){.std = 0.02};
    }
}

float td_model_embed_scale(const td_model_desc *d, td_dtype dt)
{
    if (!td_model_family_of(d)->traits.embed_scaled) return 1.0f;
    const float s = (float)sqrt((double)d->n_embd);
    return dt == TD_DTYPE_BF16 ? td_f32_from_bf16(td_bf16_from_f32(s))
         : dt == TD_DTYPE_F16  ? td_f32_from_f16(td_f16_from_f32(s)) : s;
}
