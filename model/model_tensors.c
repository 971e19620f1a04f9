/* tidal's parameter table (see include/tidal/model.h): every tensor's
 * kind, offset, shape and name in the flat layout, from the family's kinds
 * and shapes, and the seeded initialisation.
 *
 * Layout: the embedding's tensors, then block 0 .. L-1 each as its tensors
 * in the family's order (contiguous: td_model_block_span), then the final
 * ones.  A lookup recomputes sizes from the description (no cache): the
 * tables are small and the callers few outside the set-up. */
#include "lora.h"
#include "tidal/family.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <string.h>

#include "tidal/util.h"

static const td_model_family *fam(const td_model_desc *d) { return td_model_family_of(d); }

/* The family's kinds of a section; a block's LoRA adapters after them. */
static int kinds(const td_model_desc *d, td_model_section s, td_model_param out[TD_MODEL_BLOCK_TENSORS])
{
    int n = fam(d)->kinds(d, s, out);
    return s == TD_MODEL_SECTION_BLOCK ? n + td_lora_kinds(d, out + n) : n;
}

static int kind_shape(const td_model_desc *d, td_model_param kind, int shape[2])
{
    return TD_MODEL_IS_LORA(kind) ? td_lora_shape(d, kind, shape) : fam(d)->shape(d, kind, shape);
}

static size_t kind_numel(const td_model_desc *d, td_model_param kind)
{
    int shape[2] = {1, 1};
    const int ndim = kind_shape(d, kind, shape);
    return ndim == 2 ? (size_t)shape[0] * (size_t)shape[1] : (size_t)shape[0];
}

static size_t section_numel(const td_model_desc *d, td_model_section s)
{
    td_model_param k[TD_MODEL_BLOCK_TENSORS];
    size_t n = 0;
    for (int i = 0, nk = kinds(d, s, k); i < nk; i++) n += kind_numel(d, k[i]);
    return n;
}

int td_model_embed_tensor_count(const td_model_desc *d)
{
    td_model_param k[TD_MODEL_BLOCK_TENSORS];
    return kinds(d, TD_MODEL_SECTION_EMBED, k);
}

int td_model_block_tensor_count(const td_model_desc *d)
{
    td_model_param k[TD_MODEL_BLOCK_TENSORS];
    return kinds(d, TD_MODEL_SECTION_BLOCK, k);
}

int td_model_tensor_count(const td_model_desc *d)
{
    td_model_param k[TD_MODEL_BLOCK_TENSORS];
    return td_model_embed_tensor_count(d) + td_model_block_tensor_count(d) * d->n_layer +
           kinds(d, TD_MODEL_SECTION_FINAL, k);
}

int td_model_head_tensors(const td_model_desc *d, int idx[3])
{
    td_model_param fk[TD_MODEL_BLOCK_TENSORS];
    const int first = td_model_embed_tensor_count(d) + td_model_block_tensor_count(d) * d->n_layer;
    int n = 0, head = 0; /* the output matrix: lm_head, else the embedding (index 0) */
    for (int k = 0, nf = kinds(d, TD_MODEL_SECTION_FINAL, fk); k < nf; k++) {
        if (fk[k] == TD_MODEL_LM_HEAD) head = first + k;
        else if (n < 2) idx[n++] = first + k; /* the final norm's weight [and bias] */
    }
    idx[n++] = head;
    return n;
}

size_t td_model_block_largest_numel(const td_model_desc *d)
{
    td_model_param k[TD_MODEL_BLOCK_TENSORS];
    size_t m = 0;
    for (int i = 0, nk = kinds(d, TD_MODEL_SECTION_BLOCK, k); i < nk; i++)
        if (!TD_MODEL_IS_LORA(k[i]) && kind_numel(d, k[i]) > m) m = kind_numel(d, k[i]);
    return m;
}

/* Where the index-th tensor lies: its section, its layer (-1 outside the
 * blocks), its kind and its place j among the section's kinds (k[] gets
 * the section's kinds).  Only the kinds: no sizes, no names. */
static td_model_section locate(const td_model_desc *d, int index, td_model_param k[TD_MODEL_BLOCK_TENSORS], int *layer,
                               int *j)
{
    const int ne = kinds(d, TD_MODEL_SECTION_EMBED, k);
    *layer = -1;
    if (index < ne) {
        *j = index;
        return TD_MODEL_SECTION_EMBED;
    }
    const int nb = kinds(d, TD_MODEL_SECTION_BLOCK, k);
    if (index < ne + nb * d->n_layer) {
        *j = (index - ne) % nb;
        *layer = (index - ne) / nb;
        return TD_MODEL_SECTION_BLOCK;
    }
    kinds(d, TD_MODEL_SECTION_FINAL, k);
    *j = index - ne - nb * d->n_layer;
    return TD_MODEL_SECTION_FINAL;
}

size_t td_model_tensor_numel(const td_model_desc *d, int index)
{
    td_model_param k[TD_MODEL_BLOCK_TENSORS];
    int layer, j;
    locate(d, index, k, &layer, &j);
    return kind_numel(d, k[j]);
}

td_model_param td_model_tensor_kind(const td_model_desc *d, int index)
{
    td_model_param k[TD_MODEL_BLOCK_TENSORS];
    int layer, j;
    locate(d, index, k, &layer, &j);
    return k[j];
}

void td_model_tensor_get(const td_model_desc *d, int index, td_model_tensor *out)
{
    const td_model_family *f = fam(d);
    memset(out, 0, sizeof *out);
    td_model_param k[TD_MODEL_BLOCK_TENSORS];
    int j;
    const td_model_section s = locate(d, index, k, &out->layer, &j);
    if (s != TD_MODEL_SECTION_EMBED) out->offset = section_numel(d, TD_MODEL_SECTION_EMBED);
    if (s == TD_MODEL_SECTION_BLOCK) out->offset += (size_t)out->layer * section_numel(d, TD_MODEL_SECTION_BLOCK);
    if (s == TD_MODEL_SECTION_FINAL) out->offset += (size_t)d->n_layer * section_numel(d, TD_MODEL_SECTION_BLOCK);
    for (int i = 0; i < j; i++) out->offset += kind_numel(d, k[i]);
    out->kind = k[j];
    out->ndim = kind_shape(d, out->kind, out->shape);
    if (out->ndim == 1) out->shape[1] = 0;
    out->numel = kind_numel(d, out->kind);
    out->matrix = out->ndim == 2;
    /* transposed in the files when its one whole part is (GPT-2's Conv1D) */
    td_model_hf_part parts[TD_MODEL_HF_PARTS_MAX];
    for (int i = 0, np = f->hf_parts(d, s, parts); i < np; i++)
        if (parts[i].kind == out->kind && parts[i].transposed) out->hf_transposed = 1;
    if (TD_MODEL_IS_LORA(out->kind)) { /* "<prefix><layer>.<module>.lora_A.weight" */
        int at = snprintf(out->name, sizeof out->name, "%s%d.", f->hf_block_prefix, out->layer);
        if (at > 0 && (size_t)at < sizeof out->name) td_lora_name(d, out->kind, out->name + at, sizeof out->name - (size_t)at);
        return;
    }
    const char *name = f->names[out->kind] ? f->names[out->kind] : "?";
    if (out->layer >= 0) snprintf(out->name, sizeof out->name, "%s%d.%s", f->hf_block_prefix, out->layer, name);
    else snprintf(out->name, sizeof out->name, "%s", name);
}

size_t td_model_params_numel(const td_model_desc *d)
{
    return section_numel(d, TD_MODEL_SECTION_EMBED) + (size_t)d->n_layer * section_numel(d, TD_MODEL_SECTION_BLOCK) +
           section_numel(d, TD_MODEL_SECTION_FINAL);
}

void td_model_block_span(const td_model_desc *d, int layer, size_t *offset, size_t *numel)
{
    *numel = section_numel(d, TD_MODEL_SECTION_BLOCK);
    *offset = section_numel(d, TD_MODEL_SECTION_EMBED) + (size_t)layer * *numel;
}

void td_model_block_from(const td_model_desc *d, void *const *p, td_model_block *out)
{
    td_model_param bk[TD_MODEL_BLOCK_TENSORS];
    float **slot = (float **)out; /* the struct's pointers follow td_model_param from LN1_W */
    memset(out, 0, sizeof *out);
    for (int k = 0, nb = kinds(d, TD_MODEL_SECTION_BLOCK, bk); k < nb; k++) {
        if (!TD_MODEL_IS_LORA(bk[k])) {
            slot[bk[k] - TD_MODEL_LN1_W] = p[k];
            continue;
        }
        int j = ((int)bk[k] - TD_MODEL_PARAM_COUNT) / 2;
        if (((int)bk[k] - TD_MODEL_PARAM_COUNT) % 2) out->lora_b[j] = p[k];
        else out->lora_a[j] = p[k];
    }
}

void td_model_block_view(const td_model_desc *d, float *block_base, td_model_block *out)
{
    td_model_param bk[TD_MODEL_BLOCK_TENSORS];
    void *p[TD_MODEL_BLOCK_TENSORS];
    float *q = block_base;
    for (int k = 0, nb = kinds(d, TD_MODEL_SECTION_BLOCK, bk); k < nb; k++) {
        p[k] = q;
        q += kind_numel(d, bk[k]);
    }
    td_model_block_from(d, p, out);
}

/* --- initialisation ------------------------------------------------------- */

void td_model_init_tensor(const td_model_desc *d, int index, float *dst, uint64_t seed)
{
    td_model_tensor t;
    td_model_tensor_get(d, index, &t);
    td_model_init_range(d, index, dst, 0, t.numel, seed);
}

void td_model_init_range(const td_model_desc *d, int index, float *dst, size_t begin, size_t count, uint64_t seed)
{
    td_model_tensor t;
    td_model_tensor_get(d, index, &t);
    if (begin > t.numel) begin = t.numel;
    if (count > t.numel - begin) count = t.numel - begin;
    const size_t end = begin + count;
    /* Each tensor's stream from its index in the layout without adapters,
     * so a run with LoRA starts from the base weights of the same seed;
     * the adapters' streams after every base tensor's. */
    const int nt2 = td_lora_kinds(d, (td_model_param[TD_MODEL_BLOCK_TENSORS]){0});
    const int ne = td_model_embed_tensor_count(d), nb = td_model_block_tensor_count(d);
    const int layer = index < ne ? 0 : index >= ne + nb * d->n_layer ? d->n_layer : (index - ne) / nb;
    const int base_count = td_model_tensor_count(d) - nt2 * d->n_layer;
    if (TD_MODEL_IS_LORA(t.kind)) {
        const int stream = base_count + layer * nt2 + ((int)t.kind - TD_MODEL_PARAM_COUNT);
        td_lora_init(d, t.kind, dst, begin, count, seed ^ (0x9E3779B97F4A7C15ull * (uint64_t)(stream + 1)));
        return;
    }
    index -= nt2 * layer; /* the adapters of the blocks before it */
    const td_model_init_rule rule = fam(d)->init(d, t.kind);
    if (!(rule.std > 0)) {
        for (size_t i = 0; i < count; i++) dst[i] = rule.value;
        return;
    }
    const double std = rule.std;
    size_t n = t.numel;
    if (t.kind == TD_MODEL_WTE || t.kind == TD_MODEL_LM_HEAD) /* padding rows stay zero */
        n = (size_t)d->vocab_size * (size_t)d->n_embd;
    if (end > n) memset(dst + (begin > n ? begin : n) - begin, 0, (end - (begin > n ? begin : n)) * sizeof(float));
    if (begin >= n) return;
    const size_t drawn_end = end < n ? end : n;
    td_rng rng;
    td_rng_seed(&rng, seed ^ (0x9E3779B97F4A7C15ull * (uint64_t)(index + 1)));
    /* Box-Muller: pair j turns draws 2j and 2j + 1 of the tensor's stream
     * (u1 in (0, 1], u2 in [0, 1)) into elements 2j and 2j + 1.  Each thread
     * jumps the stream to its first pair (td_rng_jump) and draws its share
     * in order: the serial loop's values whatever the threads and whatever
     * range is asked for, and an 8B model initialises in seconds, the draws
     * parallel as the transform.  The range's pairs: those of elements
     * begin .. drawn_end - 1, each element written only when in range. */
    const size_t first = begin / 2, pairs = (drawn_end + 1) / 2 - first;
#pragma omp parallel if (pairs >= 4096)
    {
        const size_t nt = (size_t)omp_get_num_threads(), me = (size_t)omp_get_thread_num();
        const size_t lo = first + pairs / nt * me + (me < pairs % nt ? me : pairs % nt);
        const size_t hi = lo + pairs / nt + (me < pairs % nt);
        td_rng r = rng;
        td_rng_jump(&r, 2 * lo);
        for (size_t j = lo; j < hi; j++) {
            const double u1 = 1.0 - td_rng_uniform(&r), u2 = td_rng_uniform(&r);
            const double rad = std * sqrt(-2.0 * log(u1)), a = 6.283185307179586 * u2;
            const size_t e0 = 2 * j, e1 = 2 * j + 1;
            if (e0 >= begin) dst[e0 - begin] = (float)(rad * cos(a));
            if (e1 >= begin && e1 < drawn_end) dst[e1 - begin] = (float)(rad * sin(a));
        }
    }
}

void td_model_init(const td_model_desc *d, float *params, uint64_t seed)
{
    const int count = td_model_tensor_count(d);
#pragma omp parallel for schedule(dynamic, 1)
    for (int i = 0; i < count; i++) {
        td_model_tensor t;
        td_model_tensor_get(d, i, &t);
        td_model_init_tensor(d, i, params + t.offset, seed);
    }
}
