/* Weight decay by tensor, where practitioners put it: on the matrices (every
 * 2-D weight, the embeddings and an untied lm_head included), not on norm
 * gains and biases — nanoGPT's configure_optimizers (dim >= 2 decays), llm.c,
 * and the transformers Trainer (everything but biases and LayerNorm/RMSNorm
 * weights).  --decay-all (td_train_config.decay_all) decays everything.
 *
 * The optimizer sees chunks, and a chunk mixes tensors of both groups, so
 * at setup the trainer lists each param chunk's elements that take no decay
 * (the non-matrix tensors, neighbours merged) and hands the list to AdamW
 * with the chunk (td_adam_chunk.no_decay): one call per chunk, whose kernel
 * runs those elements with decay_mul 1 and no L2 term, exactly what
 * td_adam_coeffs_make gives for weight_decay 0.  AdamW is element-wise, so
 * this equals torch.optim.AdamW with two param groups bit for bit, for
 * every --optim-state (int8: the kernel requantizes a scale block that
 * straddles a boundary whole; bf16: v's stochastic rounding keeps hashing
 * the element's index in the chunk, so the cut changes nothing).  Padding
 * between tensors decays (its grads are zero and its params stay zero
 * either way).
 *
 * On the GPU the kernel reads the list from device memory: one copy of all
 * chunks' lists (16 bytes a range, a few ranges a block) taken from the
 * arena at setup like the trainer's other device buffers, so the budget
 * counts it.  Passing the list by value in the launch would cap the ranges
 * a chunk may hold (kernel parameters are 4 KiB), and --chunk-mb sets how
 * many tensors a chunk holds. */
#include "train_impl.h"
#include "tidal/alloc.h"
#include "tidal/arena.h"
#include "tidal/util.h"
#ifdef TD_HAVE_CUDA
#include "tidal/optim_cuda.h"
#endif

#include <stdlib.h>
#include <string.h>

typedef struct chunk_range { int chunk; td_adam_range r; } chunk_range;

static int by_chunk_begin(const void *a, const void *b)
{
    const chunk_range *x = a, *y = b;
    if (x->chunk != y->chunk) return x->chunk < y->chunk ? -1 : 1;
    return x->r.begin < y->r.begin ? -1 : x->r.begin > y->r.begin;
}

/* The device copy of the lists, for the GPU optimizer chunks. */
static td_status upload(td_trainer *t)
{
#ifdef TD_HAVE_CUDA
    if (t->cfg.backend != TD_BACKEND_CUDA || !t->gpu_opt || !t->n_no_decay) return TD_OK;
    size_t bytes = (size_t)t->n_no_decay * sizeof *t->no_decay;
    td_status st = td_memmgr_alloc_nonmodel(t->mm, bytes, TD_ROLE_WORKSPACE, (void **)&t->dev_no_decay);
    if (st) return td_error_prefix(st, "the no-decay ranges of the GPU optimizer chunks (%zu bytes): ", bytes);
    t->nonmodel_bytes += td_align_up(bytes, TD_ARENA_ALIGN);
    st = td_backend_copy_async(t->backend, TD_QUEUE_COMPUTE, t->dev_no_decay, t->no_decay, bytes);
    return st ? st : td_queue_sync(t->backend, TD_QUEUE_COMPUTE);
#else
    (void)t;
    return TD_OK;
#endif
}

td_status td_train_decay_setup(td_trainer *t)
{
    if (t->cfg.decay_all) return TD_OK; /* no lists: every element decays, as before */
    td_memmgr *mm = t->mm;
    const int n = t->n_tensors, chunks = td_memmgr_role_chunk_count(mm, TD_TENSOR_PARAM);
    const int first = td_memmgr_role_chunk(mm, TD_TENSOR_PARAM, 0);
    chunk_range *cr = td_malloc(((size_t)n + 1) * sizeof *cr, TD_ROLE_META);
    t->no_decay = td_malloc(((size_t)n + 1) * sizeof *t->no_decay, TD_ROLE_META);
    t->no_decay_start = td_calloc((size_t)chunks + 1, sizeof(int), TD_ROLE_META);
    if (!cr || !t->no_decay || !t->no_decay_start) {
        td_free(cr);
        return td_error_set(TD_ERR_NOMEM, "weight decay by tensor: the no-decay lists of %d tensors", n);
    }
    int m = 0;
    for (int i = 0; i < n; i++) {
        td_model_tensor tt;
        td_model_tensor_get(&t->cfg.model, i, &tt);
        if (tt.matrix || !tt.numel || t->gid[i] < 0) continue; /* frozen: not in a param chunk */
        size_t off = td_memmgr_tensor_offset(mm, t->pid[i]);
        cr[m++] = (chunk_range){td_memmgr_tensor_chunk(mm, t->pid[i]) - first, {off, off + tt.numel}};
    }
    qsort(cr, (size_t)m, sizeof *cr, by_chunk_begin);
    /* Merge neighbours that touch: fewer, longer ranges. */
    int kept = 0;
    for (int i = 0; i < m; i++) {
        if (kept && cr[kept - 1].chunk == cr[i].chunk && cr[kept - 1].r.end >= cr[i].r.begin) {
            if (cr[i].r.end > cr[kept - 1].r.end) cr[kept - 1].r.end = cr[i].r.end;
        } else
            cr[kept++] = cr[i];
    }
    if (t->ranks > 1) { /* ZeRO-3: the part of each list in this rank's shard, in shard coordinates */
        int in = 0;
        for (int i = 0; i < kept; i++) {
            size_t b, e;
            td_memmgr_chunk_host_range(mm, td_memmgr_role_chunk(mm, TD_TENSOR_ADAM_M, cr[i].chunk), &b, &e);
            if (cr[i].r.end <= b || cr[i].r.begin >= e) continue;
            cr[in] = cr[i];
            cr[in].r.begin = (cr[i].r.begin > b ? cr[i].r.begin : b) - b;
            cr[in].r.end = (cr[i].r.end < e ? cr[i].r.end : e) - b;
            in++;
        }
        kept = in;
    }
    t->n_no_decay = kept;
    for (int i = 0; i < kept; i++) {
        t->no_decay[i] = cr[i].r;
        t->no_decay_start[cr[i].chunk + 1]++;
    }
    for (int k = 0; k < chunks; k++) t->no_decay_start[k + 1] += t->no_decay_start[k];
    td_free(cr);
    return upload(t);
}

void td_train_decay_free(td_trainer *t)
{
    td_free(t->no_decay);
    td_free(t->no_decay_start);
    /* dev_no_decay goes with the arena. */
}

/* Chunk k's list (base: the host or the device copy). */
static td_adam_chunk with_ranges(const td_trainer *t, int k, const td_adam_chunk *ch, const td_adam_range *base)
{
    td_adam_chunk c = *ch;
    if (base) {
        c.no_decay = base + t->no_decay_start[k];
        c.n_no_decay = t->no_decay_start[k + 1] - t->no_decay_start[k];
    }
    return c;
}

td_status td_train_adam_chunk_cpu(td_trainer *t, td_adam_cpu *cpu, int k, const td_adam_coeffs *c,
                                  const td_adam_chunk *ch)
{
    td_adam_chunk w = with_ranges(t, k, ch, t->no_decay);
    return td_adam_cpu_update(cpu, c, &w, 1);
}

#ifdef TD_HAVE_CUDA
td_status td_train_adam_chunk_cuda(td_trainer *t, int k, const td_adam_coeffs *c, const td_adam_chunk *ch, void *stream)
{
    if (t->no_decay && t->n_no_decay && !t->dev_no_decay)
        return td_error_set(TD_ERR_INVALID, "GPU AdamW of param chunk %d: its no-decay ranges were not uploaded (the "
                            "trainer places GPU optimizer chunks before td_train_decay_setup)", k);
    td_adam_chunk w = with_ranges(t, k, ch, t->dev_no_decay);
    return td_adam_update_cuda(c, &w, stream);
}
#endif
