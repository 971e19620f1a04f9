/* Weight decay by tensor, where practitioners put it: on the matrices (every
 * 2-D weight, the embeddings and an untied lm_head included), not on norm
 * gains and biases — nanoGPT's configure_optimizers (dim >= 2 decays), llm.c,
 * and the transformers Trainer (everything but biases and LayerNorm/RMSNorm
 * weights).  --decay-all (td_train_config.decay_all) decays everything.
 *
 * The optimizer sees chunks, and a chunk mixes tensors of both groups, so
 * the trainer cuts each param chunk into ranges of tensors at creation and
 * runs AdamW over the ranges, the decayed ones with the step's coefficients
 * and the others with the same coefficients less decay (decay_mul 1, l2 0:
 * exactly what td_adam_coeffs_make gives for weight_decay 0).  AdamW is
 * element-wise, so this equals torch.optim.AdamW with two param groups bit
 * for bit.  Padding between tensors in a chunk is left alone (its grads are
 * zero and its params stay zero either way). */
#include "train_impl.h"
#include "tidal/alloc.h"
#ifdef TD_HAVE_CUDA
#include "tidal/optim_cuda.h"
#endif

#include <stdlib.h>
#include <string.h>

static int by_chunk_offset(const void *a, const void *b)
{
    const td_decay_range *x = a, *y = b;
    if (x->chunk != y->chunk) return x->chunk < y->chunk ? -1 : 1;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

td_status td_train_decay_setup(td_trainer *t)
{
    if (t->cfg.decay_all) return TD_OK; /* one range per chunk: the whole chunk, as before */
    td_memmgr *mm = t->mm;
    const int n = t->n_tensors, chunks = td_memmgr_role_chunk_count(mm, TD_TENSOR_PARAM);
    const int first = td_memmgr_role_chunk(mm, TD_TENSOR_PARAM, 0);
    t->decay = td_malloc((size_t)n * sizeof *t->decay, TD_ROLE_META);
    t->decay_start = td_calloc((size_t)chunks + 1, sizeof(int), TD_ROLE_META);
    t->decay_chunks = td_malloc((size_t)n * sizeof *t->decay_chunks, TD_ROLE_META);
    if (!t->decay || !t->decay_start || !t->decay_chunks) return TD_ERR_NOMEM;
    for (int i = 0; i < n; i++) {
        td_gpt_ref_tensor tt;
        td_gpt_ref_tensor_get(&t->cfg.model, i, &tt);
        t->decay[i] = (td_decay_range){ .chunk = td_memmgr_tensor_chunk(mm, t->pid[i]) - first,
                                        .offset = td_memmgr_tensor_offset(mm, t->pid[i]), .numel = tt.numel,
                                        .decay = tt.matrix };
    }
    qsort(t->decay, (size_t)n, sizeof *t->decay, by_chunk_offset);
    /* Merge neighbours of the same group that touch: fewer, longer ranges. */
    int kept = 0;
    for (int i = 0; i < n; i++) {
        td_decay_range *last = kept ? &t->decay[kept - 1] : NULL;
        const td_decay_range *r = &t->decay[i];
        if (last && last->chunk == r->chunk && last->decay == r->decay && last->offset + last->numel == r->offset)
            last->numel += r->numel;
        else
            t->decay[kept++] = *r;
    }
    t->n_decay = kept;
    for (int i = 0; i < kept; i++) t->decay_start[t->decay[i].chunk + 1]++;
    for (int k = 0; k < chunks; k++) t->decay_start[k + 1] += t->decay_start[k];
    return TD_OK;
}

void td_train_decay_free(td_trainer *t)
{
    td_free(t->decay);
    td_free(t->decay_start);
    td_free(t->decay_chunks);
}

/* Elements [off, off + n) of a chunk (fp32 or bf16 moments: an element's
 * moments sit at its index; int8 moments are cut by scale blocks and go
 * through the kernel whole, see td_train_adam_chunk_cpu). */
static td_adam_chunk sub_chunk(const td_adam_chunk *ch, size_t off, size_t n)
{
    td_adam_chunk s = *ch;
    size_t mb = td_adam_moment_bytes(ch->state, 1);
    s.master += off;
    s.m = (char *)ch->m + off * mb;
    s.v = (char *)ch->v + off * mb;
    s.grad = (const char *)ch->grad + off * td_optim_dtype_bytes(ch->grad_dtype);
    if (ch->param_out) s.param_out = (char *)ch->param_out + off * td_optim_dtype_bytes(ch->param_dtype);
    s.numel = n;
    return s;
}

static td_adam_coeffs without_decay(const td_adam_coeffs *c)
{
    td_adam_coeffs nd = *c;
    nd.l2 = 0.0f;
    nd.decay_mul = 1.0f;
    return nd;
}

static td_status int8_unsupported(void)
{
    return td_error_set(TD_ERR_UNSUPPORTED, "--optim-state int8 with weight decay by tensor is not built yet: add "
                                            "--decay-all (decay every tensor) or use --optim-state fp32 or bf16");
}

td_status td_train_adam_chunk_cpu(td_trainer *t, int k, const td_adam_coeffs *c, const td_adam_chunk *ch)
{
    if (!t->decay) return td_adam_cpu_update(t->adam, c, ch, 1);
    if (ch->state == TD_OPTIM_STATE_INT8) return int8_unsupported();
    const td_adam_coeffs nd = without_decay(c);
    for (int group = 1; group >= 0; group--) { /* the decayed ranges, then the others: one team each */
        int n = 0;
        for (int r = t->decay_start[k]; r < t->decay_start[k + 1]; r++)
            if (t->decay[r].decay == group) t->decay_chunks[n++] = sub_chunk(ch, t->decay[r].offset, t->decay[r].numel);
        if (n) {
            td_status st = td_adam_cpu_update(t->adam, group ? c : &nd, t->decay_chunks, n);
            if (st) return st;
        }
    }
    return TD_OK;
}

#ifdef TD_HAVE_CUDA
td_status td_train_adam_chunk_cuda(td_trainer *t, int k, const td_adam_coeffs *c, const td_adam_chunk *ch, void *stream)
{
    if (!t->decay) return td_adam_update_cuda(c, ch, stream);
    if (ch->state == TD_OPTIM_STATE_INT8) return int8_unsupported();
    const td_adam_coeffs nd = without_decay(c);
    for (int r = t->decay_start[k]; r < t->decay_start[k + 1]; r++) {
        td_adam_chunk s = sub_chunk(ch, t->decay[r].offset, t->decay[r].numel);
        td_status st = td_adam_update_cuda(t->decay[r].decay ? c : &nd, &s, stream);
        if (st) return st;
    }
    return TD_OK;
}
#endif
