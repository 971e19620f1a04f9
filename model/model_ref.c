/* The reference model on the CPU (see include/tidal/model_ref.h): each
 * block, head and embedding call runs the family's CPU reference
 * (family.h, td_model_cpu); the whole model is composed from them here.
 *
 * Everything lives in caller-owned flat buffers carved by size tables: the
 * parameters by the tensor table, the activations by acts_layout() below.
 * The forward keeps every activation a block's backward needs (no
 * recomputation here; the step loop checkpoints by re-running
 * td_model_block_forward from a kept block input).  The backward runs the
 * residual-stream gradient through two ping-pong buffers, block by block in
 * reverse.
 *
 * Last, td_model_cpu_exec: the same calls as a td_model_exec over "device"
 * pointers that are host memory, what the trainer runs on the cpu backend. */
#include "lora.h"
#include "tidal/family.h"

#include <string.h>

#include "tidal/ops.h"

static const td_model_cpu *cpu_of(const td_model_desc *cfg) { return td_model_family_of(cfg)->cpu; }

static void zero(float *p, size_t n) { memset(p, 0, n * sizeof(float)); }

/* --- one block, the embedding, the head ---------------------------------------- */

size_t td_model_block_acts_numel(const td_model_desc *cfg, int B, int T)
{
    return cpu_of(cfg)->acts_numel(cfg, B, T) + td_lora_acts_numel(cfg, B, T); /* the adapters' after the family's */
}

void td_model_block_acts_view(const td_model_desc *cfg, int B, int T, float *base, td_model_block_acts *out)
{
    memset(out, 0, sizeof *out);
    cpu_of(cfg)->acts_view(cfg, B, T, base, out);
    td_lora_acts_view(cfg, B, T, base + cpu_of(cfg)->acts_numel(cfg, B, T), out);
}

size_t td_model_lora_drop_numel(const td_model_desc *cfg, int B, int T)
{
    if (!(cfg->lora.dropout > 0)) return 0;
    int in = 0;
    for (int j = 0; j < td_model_lora_count(cfg); j++) {
        td_model_lora_target tg;
        td_model_lora_target_get(cfg, j, &tg);
        if (tg.in > in) in = tg.in;
    }
    return (size_t)B * (size_t)T * (size_t)in;
}

size_t td_model_block_scratch_numel(const td_model_desc *cfg, int B, int T)
{
    return cpu_of(cfg)->scratch_numel(cfg, B, T);
}

void td_model_block_forward(const td_model_desc *cfg, const td_model_block *w, const td_model_block_acts *a,
                            const float *x, float *y, const int *pos, int B, int T)
{
    cpu_of(cfg)->block_forward(cfg, w, a, x, y, pos, B, T);
}

void td_model_block_backward(const td_model_desc *cfg, const td_model_block *w, const td_model_block *g,
                             const td_model_block_acts *a, const float *x, const float *dy, float *dx, float *scratch,
                             const int *pos, int B, int T)
{
    cpu_of(cfg)->block_backward(cfg, w, g, a, x, dy, dx, scratch, pos, B, T);
}

void td_model_embed_forward(const td_model_desc *cfg, float *out, const int *tokens, const int *pos,
                            const float *const *emb, int B, int T)
{
    cpu_of(cfg)->embed_forward(cfg, emb, tokens, pos, out, B, T);
}

void td_model_embed_backward(const td_model_desc *cfg, float *const *gemb, const float *dout, const int *tokens,
                             const int *pos, int B, int T)
{
    cpu_of(cfg)->embed_backward(cfg, gemb, dout, tokens, pos, B, T);
}

void td_model_head_forward(const td_model_desc *cfg, float *logits, float *lnf, float *lnf_mean, float *lnf_rstd,
                           const float *x, const float *const *head, int N)
{
    cpu_of(cfg)->head_forward(cfg, logits, lnf, lnf_mean, lnf_rstd, x, head, N);
}

void td_model_head_backward(const td_model_desc *cfg, float *dx, float *const *ghead, float *dlnf, const float *dlogits,
                            const float *x, const float *lnf, const float *lnf_mean, const float *lnf_rstd,
                            const float *const *head, int N)
{
    cpu_of(cfg)->head_backward(cfg, dx, ghead, dlnf, dlogits, x, lnf, lnf_mean, lnf_rstd, head, N);
}

/* --- the whole model ------------------------------------------------------ */

/* Offsets (floats) of everything in acts. */
typedef struct acts_layout {
    size_t stream;      /* (N,C) per residual stream x_l; x_l and block l's acts alternate */
    size_t block;       /* one block's acts */
    size_t x0;          /* x_l at x0 + l * (stream + block); block l's acts right after x_l */
    size_t lnf, lnf_mean, lnf_rstd, logits, losses, lse, total;
} acts_layout;

static acts_layout layout_of(const td_model_desc *cfg, int B, int T)
{
    const size_t N = (size_t)B * T;
    acts_layout l;
    l.stream = N * cfg->n_embd;
    l.block = td_model_block_acts_numel(cfg, B, T);
    l.x0 = 0;
    l.lnf = (size_t)cfg->n_layer * (l.stream + l.block) + l.stream; /* after x_L */
    l.lnf_mean = l.lnf + l.stream;
    l.lnf_rstd = l.lnf_mean + N;
    l.logits = l.lnf_rstd + N;
    l.losses = l.logits + N * cfg->padded_vocab_size;
    l.lse = l.losses + N;
    l.total = l.lse + N;
    return l;
}

static float *stream_at(const acts_layout *l, float *acts, int layer)
{
    return acts + l->x0 + (size_t)layer * (l->stream + l->block);
}

size_t td_model_acts_numel(const td_model_desc *cfg, int B, int T)
{
    return layout_of(cfg, B, T).total;
}

size_t td_model_scratch_numel(const td_model_desc *cfg, int B, int T)
{
    /* the head's dlnf (N,C) fits in the block scratch (at least 2 C per token) */
    return 2 * (size_t)B * T * cfg->n_embd + td_model_block_scratch_numel(cfg, B, T);
}

float *td_model_logits(const td_model_desc *cfg, int B, int T, float *acts)
{
    return acts + layout_of(cfg, B, T).logits;
}

float *td_model_losses(const td_model_desc *cfg, int B, int T, float *acts)
{
    return acts + layout_of(cfg, B, T).losses;
}

td_status td_model_check_batch(const td_model_desc *cfg, const int *tokens,
                                 const int *targets, int B, int T)
{
    td_status st = td_model_desc_check(cfg);
    if (st != TD_OK) return st;
    if (B < 1 || T < 1 || T > cfg->n_positions)
        return td_error_set(TD_ERR_INVALID,
                            "batch %d x sequence %d: need a batch >= 1 and 1 <= sequence <= %d "
                            "(the model's positions)",
                            B, T, cfg->n_positions);
    for (int i = 0; i < B * T; i++) {
        if (tokens[i] < 0 || tokens[i] >= cfg->vocab_size)
            return td_error_set(TD_ERR_INVALID,
                                "token %d at batch %d, position %d is outside the vocabulary [0, %d)",
                                tokens[i], i / T, i % T, cfg->vocab_size);
        if (targets && targets[i] >= cfg->vocab_size)
            return td_error_set(TD_ERR_INVALID,
                                "target %d at batch %d, position %d is outside the vocabulary "
                                "[0, %d) (negative targets are ignored)",
                                targets[i], i / T, i % T, cfg->vocab_size);
    }
    return TD_OK;
}

static size_t offset_of(const td_model_desc *cfg, int index)
{
    td_model_tensor t;
    td_model_tensor_get(cfg, index, &t);
    return t.offset;
}

static void block_views(const td_model_desc *cfg, const float *flat, int layer,
                        td_model_block *out)
{
    size_t offset, numel;
    td_model_block_span(cfg, layer, &offset, &numel);
    td_model_block_view(cfg, (float *)flat + offset, out); /* const again at the call sites */
}

td_status td_model_forward(const td_model_desc *cfg, const float *params, const int *tokens,
                             const int *targets, int B, int T, float *acts, float *loss,
                             int *n_targets)
{
    td_status st = td_model_check_batch(cfg, tokens, targets, B, T);
    if (st != TD_OK) return st;
    const int L = cfg->n_layer, N = B * T;
    const acts_layout l = layout_of(cfg, B, T);
    int hi[3];
    const float *head[3];
    for (int k = 0, nh = td_model_head_tensors(cfg, hi); k < nh; k++) head[k] = params + offset_of(cfg, hi[k]);

    const float *emb[TD_MODEL_BLOCK_TENSORS];
    for (int k = 0; k < td_model_embed_tensor_count(cfg); k++) emb[k] = params + offset_of(cfg, k);
    td_model_embed_forward(cfg, stream_at(&l, acts, 0), tokens, NULL, emb, B, T);
    for (int layer = 0; layer < L; layer++) {
        td_model_block w;
        td_model_block_acts a;
        block_views(cfg, params, layer, &w);
        td_model_block_acts_view(cfg, B, T, stream_at(&l, acts, layer) + l.stream, &a);
        td_model_block_forward(cfg, &w, &a, stream_at(&l, acts, layer),
                                 stream_at(&l, acts, layer + 1), NULL, B, T);
    }
    td_model_head_forward(cfg, acts + l.logits, acts + l.lnf, acts + l.lnf_mean, acts + l.lnf_rstd,
                            stream_at(&l, acts, L), head, N);
    double sum = 0.0;
    int count = 0;
    if (targets) {
        td_ops_crossentropy_forward(acts + l.losses, acts + l.lse, acts + l.logits, targets, N,
                                    cfg->vocab_size, cfg->padded_vocab_size);
        for (int i = 0; i < N; i++) /* in row order: the same sum every time */
            if (targets[i] >= 0) {
                sum += acts[l.losses + i];
                count++;
            }
    }
    if (loss) *loss = count ? (float)(sum / count) : 0.0f;
    if (n_targets) *n_targets = count;
    return TD_OK;
}

td_status td_model_backward(const td_model_desc *cfg, const float *params, float *grads,
                              const int *tokens, const int *targets, float dloss, int B, int T,
                              float *acts, float *scratch)
{
    if (!targets)
        return td_error_set(TD_ERR_INVALID, "backward needs the targets the forward used");
    td_status st = td_model_check_batch(cfg, tokens, targets, B, T);
    if (st != TD_OK) return st;
    const int L = cfg->n_layer, C = cfg->n_embd, N = B * T;
    const acts_layout l = layout_of(cfg, B, T);
    const size_t NC = (size_t)N * C;
    float *dcur = scratch, *dnext = scratch + NC, *block_scratch = scratch + 2 * NC;
    int hi[3];
    const float *head[3];
    float *ghead[3];
    for (int k = 0, nh = td_model_head_tensors(cfg, hi); k < nh; k++) {
        head[k] = params + offset_of(cfg, hi[k]);
        ghead[k] = grads + offset_of(cfg, hi[k]);
    }

    float *logits = acts + l.logits;
    td_ops_crossentropy_backward(logits, logits, acts + l.lse, targets, dloss, N, cfg->vocab_size,
                                 cfg->padded_vocab_size); /* in place: logits -> dlogits */
    zero(dcur, NC);
    td_model_head_backward(cfg, dcur, ghead, block_scratch, logits, stream_at(&l, acts, L), acts + l.lnf,
                             acts + l.lnf_mean, acts + l.lnf_rstd, head, N);
    for (int layer = L - 1; layer >= 0; layer--) {
        td_model_block w, g;
        td_model_block_acts a;
        block_views(cfg, params, layer, &w);
        block_views(cfg, grads, layer, &g);
        td_model_block_acts_view(cfg, B, T, stream_at(&l, acts, layer) + l.stream, &a);
        zero(dnext, NC);
        td_model_block_backward(cfg, &w, &g, &a, stream_at(&l, acts, layer), dcur, dnext,
                                  block_scratch, NULL, B, T);
        float *tmp = dcur;
        dcur = dnext;
        dnext = tmp;
    }
    float *gemb[TD_MODEL_BLOCK_TENSORS];
    for (int k = 0; k < td_model_embed_tensor_count(cfg); k++) gemb[k] = grads + offset_of(cfg, k);
    td_model_embed_backward(cfg, gemb, dcur, tokens, NULL, B, T);
    return TD_OK;
}

/* --- the CPU reference as a td_model_exec ------------------------------------- */

static size_t exec_acts_bytes(const td_model_desc *d, int B, int T, td_dtype dt)
{
    (void)dt;
    return td_model_block_acts_numel(d, B, T) * sizeof(float);
}

/* The block's backward and the head's dlnf (the family's scratch_numel);
 * the embedding needs none. */
static size_t exec_scratch_bytes(const td_model_desc *d, int B, int T, td_dtype dt, int att_seqs)
{
    (void)dt, (void)att_seqs;
    return (td_model_block_scratch_numel(d, B, T) + td_model_lora_drop_numel(d, B, T)) * sizeof(float);
}

/* The block's acts at `acts`, with LoRA dropout's key and its scratch after the backward's. */
static void exec_acts(const td_model_run *r, void *acts, td_model_block_acts *a)
{
    td_model_block_acts_view(r->desc, r->B, r->T, acts, a);
    if (!r->lora_drop || !td_model_lora_drop_numel(r->desc, r->B, r->T)) return;
    a->lora_drop = r->lora_drop;
    a->lora_xd = (float *)r->scratch + td_model_block_scratch_numel(r->desc, r->B, r->T);
}

static size_t exec_consts_bytes(const td_model_desc *d) { (void)d; return 0; }
static void exec_consts_fill(const td_model_desc *d, void *host) { (void)d, (void)host; }

static td_status exec_embed_forward(const td_model_run *r, void *const *p, const int *tokens, void *out)
{
    td_model_embed_forward(r->desc, out, tokens, r->pos, (const float *const *)p, r->B, r->T);
    return TD_OK;
}

static td_status exec_embed_backward(const td_model_run *r, void *const *g, const int *tokens, const void *dout)
{
    td_model_embed_backward(r->desc, (float *const *)g, dout, tokens, r->pos, r->B, r->T);
    return TD_OK;
}

static td_status exec_block_forward(const td_model_run *r, void *const *p, void *acts, const void *x, void *y)
{
    td_model_block w;
    td_model_block_acts a;
    td_model_block_from(r->desc, p, &w);
    exec_acts(r, acts, &a);
    td_model_block_forward(r->desc, &w, &a, x, y, r->pos, r->B, r->T);
    return TD_OK;
}

static td_status exec_block_backward(const td_model_run *r, void *const *p, void *const *g, void *acts, const void *x,
                                     const void *dy, void *dx)
{
    td_model_block w, gw;
    td_model_block_acts a;
    td_model_block_from(r->desc, p, &w);
    td_model_block_from(r->desc, g, &gw);
    exec_acts(r, acts, &a);
    zero(dx, (size_t)r->B * (size_t)r->T * (size_t)r->desc->n_embd); /* written, as the CUDA exec does */
    td_model_block_backward(r->desc, &w, &gw, &a, x, dy, dx, r->scratch, r->pos, r->B, r->T);
    return TD_OK;
}

static td_status exec_head_forward(const td_model_run *r, void *const *p, const void *x, void *logits,
                                   const td_model_head_acts *h)
{
    td_model_head_forward(r->desc, logits, h->lnf, h->mean, h->rstd, x, (const float *const *)p, r->B * r->T);
    return TD_OK;
}

static td_status exec_head_backward(const td_model_run *r, void *const *p, void *const *g, const void *x,
                                    const void *dlogits, const td_model_head_acts *h, void *dx)
{
    td_model_head_backward(r->desc, dx, (float *const *)g, r->scratch, dlogits, x, h->lnf, h->mean, h->rstd,
                           (const float *const *)p, r->B * r->T);
    return TD_OK;
}

const td_model_exec td_model_cpu_exec = {exec_acts_bytes, exec_scratch_bytes, exec_consts_bytes, exec_consts_fill,
                                         exec_embed_forward, exec_embed_backward, exec_block_forward,
                                         exec_block_backward, exec_head_forward, exec_head_backward};
