/* The LLaMA family on the cuda backend: the trainer's block, head and setup
 * calls for a LLaMA or Qwen2 model, over the composition in
 * model/llama_block_cuda.c (train.c calls these where its GPT-2 CUDA calls
 * are, when the model's family is not GPT-2).  Same buffers as GPT-2's: the
 * block's activations in the acts slot the plan sized for this family
 * (footprint.c), the head's dlnf at the start of the scratch and the op
 * scratch after it; RoPE's table after cuBLASLt's workspace. */
#include "train_impl.h"
#include "tidal/arena.h"
#include "tidal/ops_cuda.h"
#include "tidal/util.h"

#include <string.h>

static void *stream_of(td_trainer *t) { return td_backend_native_queue(t->backend, TD_QUEUE_COMPUTE); }

td_status td_train_llama_cuda_setup(td_trainer *t)
{
    t->rope_inv = (float *)((char *)t->workspace + TD_OPS_CUDA_WORKSPACE_BYTES);
    return td_ops_cuda_rope_table(&t->cfg.model, t->rope_inv, stream_of(t));
}

/* The block's tensors (layout order) as td_ops_cuda_block's fields. */
static void view(const td_trainer *t, void *const *p, td_ops_cuda_block *w)
{
    td_model_block b;
    td_model_block_from(&t->cfg.model, p, &b);
    /* td_model_block and td_ops_cuda_block list the same twelve roles in one order */
    void **dst = (void **)w;
    float **src = (float **)&b;
    for (size_t i = 0; i < sizeof *w / sizeof(void *); i++) dst[i] = src[i];
}

td_status td_train_llama_cuda_block_forward(td_trainer *t, void *const *p, void *acts, const void *x, void *y)
{
    const td_model_desc *mc = &t->cfg.model;
    int B = t->cfg.micro_batch, T = t->cfg.seq_len;
    td_ops_cuda_block w;
    td_ops_cuda_block_acts a;
    view(t, p, &w);
    td_ops_cuda_llama_block_acts_view(mc, B, T, t->dt, acts, &a);
    return td_ops_cuda_llama_block_forward(t->ops_cuda, mc, &w, &a, t->rope_inv, x, y, B, T, t->dt, t->scratch,
                                           t->scratch_bytes, stream_of(t));
}

td_status td_train_llama_cuda_block_backward(td_trainer *t, void *const *p, void *const *g, void *acts,
                                             const void *x, const void *dy, void *dx)
{
    const td_model_desc *mc = &t->cfg.model;
    int B = t->cfg.micro_batch, T = t->cfg.seq_len;
    td_ops_cuda_block w, gw;
    td_ops_cuda_block_acts a;
    view(t, p, &w);
    view(t, g, &gw);
    td_ops_cuda_llama_block_acts_view(mc, B, T, t->dt, acts, &a);
    return td_ops_cuda_llama_block_backward(t->ops_cuda, mc, &w, &gw, &a, t->rope_inv, x, dy, dx, B, T, t->dt, t->gdt,
                                            t->scratch, t->scratch_bytes, stream_of(t));
}

/* p: the final norm's weight and the output matrix (td_model_head_tensors). */
td_status td_train_llama_cuda_head_forward(td_trainer *t, void *const *p, const void *x, double dloss, int train)
{
    const td_model_desc *mc = &t->cfg.model;
    int N = t->cfg.micro_batch * t->cfg.seq_len, V = mc->vocab_size, Vp = mc->padded_vocab_size;
    td_status st = td_ops_cuda_llama_head_forward(t->ops_cuda, mc, t->logits, t->lnf, t->lnf_rstd, x, p[0], p[1], N,
                                                  t->dt, stream_of(t));
    if (st) return st;
    if (train)
        return td_ops_cuda_crossentropy_fused(t->losses, t->lse, t->logits, t->targets, (float)dloss, N, V, Vp, t->dt,
                                              stream_of(t));
    return td_ops_cuda_crossentropy_forward(t->losses, t->lse, t->logits, t->targets, N, V, Vp, t->dt, stream_of(t));
}

/* dx (zeroed by the caller) and g += from the dlogits over t->logits. */
td_status td_train_llama_cuda_head_backward(td_trainer *t, void *const *p, void *const *g, const void *x, void *dx)
{
    const td_model_desc *mc = &t->cfg.model;
    int N = t->cfg.micro_batch * t->cfg.seq_len;
    size_t dlnf = td_align_up((size_t)N * (size_t)mc->n_embd * td_dtype_bytes(t->dt), TD_ARENA_ALIGN);
    return td_ops_cuda_llama_head_backward(t->ops_cuda, mc, dx, g[0], g[1], t->scratch, t->logits, x, t->lnf,
                                           t->lnf_rstd, p[0], p[1], N, t->dt, t->gdt, t->scratch + dlnf,
                                           t->scratch_bytes - dlnf, stream_of(t));
}
