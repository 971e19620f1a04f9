/* GPT-2 composed from the CPU reference ops (see include/tidal/gpt_ref.h).
 *
 * Everything lives in caller-owned flat buffers carved by size tables: the
 * parameters by the tensor table, the activations by acts_layout() below.
 * The forward keeps every activation a block's backward needs (no
 * recomputation here; the step loop checkpoints by re-running
 * td_gpt_ref_block_forward from a kept block input).  The backward runs the
 * residual-stream gradient through two ping-pong buffers, block by block in
 * reverse. */
#include "tidal/gpt_ref.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "tidal/ops.h"
#include "tidal/util.h"

/* --- configuration and parameter table ----------------------------------- */

td_status td_gpt_ref_config_check(const td_gpt_ref_config *cfg)
{
    if (!cfg) return td_error_set(TD_ERR_INVALID, "no model configuration given");
    if (cfg->n_layer < 1 || cfg->n_head < 1 || cfg->n_embd < 1 || cfg->n_positions < 1 ||
        cfg->vocab_size < 1)
        return td_error_set(TD_ERR_INVALID,
                            "model sizes must be positive: layers %d, heads %d, width %d, "
                            "positions %d, vocabulary %d",
                            cfg->n_layer, cfg->n_head, cfg->n_embd, cfg->n_positions, cfg->vocab_size);
    if (cfg->n_embd % cfg->n_head)
        return td_error_set(TD_ERR_INVALID,
                            "width %d is not a multiple of the %d heads; pick a width divisible by "
                            "the head count",
                            cfg->n_embd, cfg->n_head);
    if (cfg->padded_vocab_size < cfg->vocab_size)
        return td_error_set(TD_ERR_INVALID,
                            "padded vocabulary %d is smaller than the vocabulary %d; pad up (e.g. "
                            "to a multiple of 64)",
                            cfg->padded_vocab_size, cfg->vocab_size);
    return TD_OK;
}

int td_gpt_ref_tensor_count(const td_gpt_ref_config *cfg)
{
    return 4 + TD_GPT_REF_BLOCK_TENSORS * cfg->n_layer;
}

/* Shape of one kind, tidal's (out, in) convention. */
static int kind_shape(const td_gpt_ref_config *cfg, td_gpt_ref_param kind, int shape[2])
{
    const int C = cfg->n_embd;
    switch (kind) {
    case TD_GPT_REF_WTE: shape[0] = cfg->padded_vocab_size; shape[1] = C; return 2;
    case TD_GPT_REF_WPE: shape[0] = cfg->n_positions; shape[1] = C; return 2;
    case TD_GPT_REF_QKV_W: shape[0] = 3 * C; shape[1] = C; return 2;
    case TD_GPT_REF_QKV_B: shape[0] = 3 * C; return 1;
    case TD_GPT_REF_ATTPROJ_W: shape[0] = C; shape[1] = C; return 2;
    case TD_GPT_REF_FC_W: shape[0] = 4 * C; shape[1] = C; return 2;
    case TD_GPT_REF_FC_B: shape[0] = 4 * C; return 1;
    case TD_GPT_REF_FCPROJ_W: shape[0] = C; shape[1] = 4 * C; return 2;
    default: shape[0] = C; return 1; /* LayerNorm weights and biases, C-wide biases */
    }
}

static size_t kind_numel(const td_gpt_ref_config *cfg, td_gpt_ref_param kind)
{
    int shape[2] = {1, 1};
    const int ndim = kind_shape(cfg, kind, shape);
    return ndim == 2 ? (size_t)shape[0] * shape[1] : (size_t)shape[0];
}

static size_t block_numel(const td_gpt_ref_config *cfg)
{
    size_t n = 0;
    for (int k = TD_GPT_REF_LN1_W; k <= TD_GPT_REF_FCPROJ_B; k++) n += kind_numel(cfg, k);
    return n;
}

static const char *const hf_names[TD_GPT_REF_PARAM_COUNT] = {
    "wte.weight", "wpe.weight",
    "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
    "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
    "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias",
    "ln_f.weight", "ln_f.bias",
};

void td_gpt_ref_tensor_get(const td_gpt_ref_config *cfg, int index, td_gpt_ref_tensor *out)
{
    memset(out, 0, sizeof *out);
    const int L = cfg->n_layer;
    const size_t embed = kind_numel(cfg, TD_GPT_REF_WTE) + kind_numel(cfg, TD_GPT_REF_WPE);
    if (index < 2) {
        out->kind = (td_gpt_ref_param)index;
        out->layer = -1;
        out->offset = index == 0 ? 0 : kind_numel(cfg, TD_GPT_REF_WTE);
    } else if (index < 2 + TD_GPT_REF_BLOCK_TENSORS * L) {
        const int layer = (index - 2) / TD_GPT_REF_BLOCK_TENSORS;
        out->kind = (td_gpt_ref_param)(TD_GPT_REF_LN1_W + (index - 2) % TD_GPT_REF_BLOCK_TENSORS);
        out->layer = layer;
        out->offset = embed + (size_t)layer * block_numel(cfg);
        for (int k = TD_GPT_REF_LN1_W; k < (int)out->kind; k++) out->offset += kind_numel(cfg, k);
    } else {
        out->kind = index == 2 + TD_GPT_REF_BLOCK_TENSORS * L ? TD_GPT_REF_LNF_W : TD_GPT_REF_LNF_B;
        out->layer = -1;
        out->offset = embed + (size_t)L * block_numel(cfg) +
                      (out->kind == TD_GPT_REF_LNF_B ? (size_t)cfg->n_embd : 0);
    }
    out->shape[1] = 0;
    out->ndim = kind_shape(cfg, out->kind, out->shape);
    out->numel = kind_numel(cfg, out->kind);
    out->hf_transposed = out->kind == TD_GPT_REF_QKV_W || out->kind == TD_GPT_REF_ATTPROJ_W ||
                         out->kind == TD_GPT_REF_FC_W || out->kind == TD_GPT_REF_FCPROJ_W;
    if (out->layer >= 0)
        snprintf(out->name, sizeof out->name, "h.%d.%s", out->layer, hf_names[out->kind]);
    else
        snprintf(out->name, sizeof out->name, "%s", hf_names[out->kind]);
}

size_t td_gpt_ref_params_numel(const td_gpt_ref_config *cfg)
{
    return kind_numel(cfg, TD_GPT_REF_WTE) + kind_numel(cfg, TD_GPT_REF_WPE) +
           (size_t)cfg->n_layer * block_numel(cfg) + 2 * (size_t)cfg->n_embd;
}

void td_gpt_ref_block_span(const td_gpt_ref_config *cfg, int layer, size_t *offset, size_t *numel)
{
    *offset = kind_numel(cfg, TD_GPT_REF_WTE) + kind_numel(cfg, TD_GPT_REF_WPE) +
              (size_t)layer * block_numel(cfg);
    *numel = block_numel(cfg);
}

void td_gpt_ref_block_view(const td_gpt_ref_config *cfg, float *block_base, td_gpt_ref_block *out)
{
    float **slot[TD_GPT_REF_BLOCK_TENSORS] = {
        &out->ln1_w, &out->ln1_b, &out->qkv_w, &out->qkv_b, &out->attproj_w, &out->attproj_b,
        &out->ln2_w, &out->ln2_b, &out->fc_w, &out->fc_b, &out->fcproj_w, &out->fcproj_b,
    };
    float *p = block_base;
    for (int i = 0; i < TD_GPT_REF_BLOCK_TENSORS; i++) {
        *slot[i] = p;
        p += kind_numel(cfg, (td_gpt_ref_param)(TD_GPT_REF_LN1_W + i));
    }
}

/* --- initialisation ------------------------------------------------------- */

void td_gpt_ref_init_tensor(const td_gpt_ref_config *cfg, int index, float *dst, uint64_t seed)
{
    td_gpt_ref_tensor t;
    td_gpt_ref_tensor_get(cfg, index, &t);
    switch (t.kind) {
    case TD_GPT_REF_LN1_W: case TD_GPT_REF_LN2_W: case TD_GPT_REF_LNF_W:
        for (size_t i = 0; i < t.numel; i++) dst[i] = 1.0f;
        return;
    case TD_GPT_REF_LN1_B: case TD_GPT_REF_LN2_B: case TD_GPT_REF_LNF_B: case TD_GPT_REF_QKV_B:
    case TD_GPT_REF_ATTPROJ_B: case TD_GPT_REF_FC_B: case TD_GPT_REF_FCPROJ_B:
        memset(dst, 0, t.numel * sizeof(float));
        return;
    default: break;
    }
    const double std = t.kind == TD_GPT_REF_ATTPROJ_W || t.kind == TD_GPT_REF_FCPROJ_W
                           ? 0.02 / sqrt(2.0 * cfg->n_layer)
                           : 0.02;
    size_t n = t.numel;
    if (t.kind == TD_GPT_REF_WTE) { /* padding rows stay zero */
        n = (size_t)cfg->vocab_size * cfg->n_embd;
        memset(dst + n, 0, (t.numel - n) * sizeof(float));
    }
    td_rng rng;
    td_rng_seed(&rng, seed ^ (0x9E3779B97F4A7C15ull * (uint64_t)(index + 1)));
    for (size_t i = 0; i < n; i += 2) { /* Box-Muller: two normals per two uniforms */
        const double u1 = 1.0 - td_rng_uniform(&rng), u2 = td_rng_uniform(&rng);
        const double r = std * sqrt(-2.0 * log(u1)), a = 6.283185307179586 * u2;
        dst[i] = (float)(r * cos(a));
        if (i + 1 < n) dst[i + 1] = (float)(r * sin(a));
    }
}

void td_gpt_ref_init(const td_gpt_ref_config *cfg, float *params, uint64_t seed)
{
    const int count = td_gpt_ref_tensor_count(cfg);
#pragma omp parallel for schedule(dynamic, 1)
    for (int i = 0; i < count; i++) {
        td_gpt_ref_tensor t;
        td_gpt_ref_tensor_get(cfg, i, &t);
        td_gpt_ref_init_tensor(cfg, i, params + t.offset, seed);
    }
}

/* --- one block ------------------------------------------------------------ */

size_t td_gpt_ref_block_acts_numel(const td_gpt_ref_config *cfg, int B, int T)
{
    return (size_t)B * T * (15 * (size_t)cfg->n_embd + 4 + (size_t)cfg->n_head);
}

void td_gpt_ref_block_acts_view(const td_gpt_ref_config *cfg, int B, int T, float *base,
                                td_gpt_ref_block_acts *out)
{
    const size_t N = (size_t)B * T, C = (size_t)cfg->n_embd;
    float *p = base;
    out->ln1 = p;      p += N * C;
    out->ln1_mean = p; p += N;
    out->ln1_rstd = p; p += N;
    out->qkv = p;      p += N * 3 * C;
    out->atty = p;     p += N * C;
    out->att_lse = p;  p += N * (size_t)cfg->n_head;
    out->res2 = p;     p += N * C;
    out->ln2 = p;      p += N * C;
    out->ln2_mean = p; p += N;
    out->ln2_rstd = p; p += N;
    out->fch = p;      p += N * 4 * C;
    out->fch_gelu = p;
}

size_t td_gpt_ref_block_scratch_numel(const td_gpt_ref_config *cfg, int B, int T)
{
    return (size_t)B * T * 10 * (size_t)cfg->n_embd;
}

void td_gpt_ref_block_forward(const td_gpt_ref_config *cfg, const td_gpt_ref_block *w,
                              const td_gpt_ref_block_acts *a, const float *x, float *y, int B, int T)
{
    const int C = cfg->n_embd, NH = cfg->n_head, N = B * T;
    td_ops_layernorm_forward(a->ln1, a->ln1_mean, a->ln1_rstd, x, w->ln1_w, w->ln1_b, N, C);
    td_ops_matmul_forward(a->qkv, a->ln1, w->qkv_w, w->qkv_b, N, C, 3 * C);        // (N,3C)
    td_ops_attention_forward(a->atty, a->att_lse, a->qkv, B, T, C, NH);            // (N,C)
    td_ops_matmul_forward(a->res2, a->atty, w->attproj_w, w->attproj_b, N, C, C);  // attn branch
    td_ops_residual_forward(a->res2, a->res2, x, (size_t)N * C);                   // x + branch
    td_ops_layernorm_forward(a->ln2, a->ln2_mean, a->ln2_rstd, a->res2, w->ln2_w, w->ln2_b, N, C);
    td_ops_matmul_forward(a->fch, a->ln2, w->fc_w, w->fc_b, N, C, 4 * C);          // (N,4C)
    td_ops_gelu_forward(a->fch_gelu, a->fch, (size_t)N * 4 * C);
    td_ops_matmul_forward(y, a->fch_gelu, w->fcproj_w, w->fcproj_b, N, 4 * C, C);  // mlp branch
    td_ops_residual_forward(y, y, a->res2, (size_t)N * C);                         // res2 + branch
}

static void zero(float *p, size_t n) { memset(p, 0, n * sizeof(float)); }

void td_gpt_ref_block_backward(const td_gpt_ref_config *cfg, const td_gpt_ref_block *w,
                               const td_gpt_ref_block *g, const td_gpt_ref_block_acts *a,
                               const float *x, const float *dy, float *dx, float *scratch,
                               int B, int T)
{
    const int C = cfg->n_embd, NH = cfg->n_head, N = B * T;
    const size_t NC = (size_t)N * C;
    float *d4a = scratch;           // (N,4C): dfch_gelu, later dqkv (N,3C)
    float *d4b = d4a + 4 * NC;      // (N,4C): dfch
    float *dres2 = d4b + 4 * NC;    // (N,C)
    float *dc = dres2 + NC;         // (N,C): dln2, then datty, then dln1

    // y = res2 + fc_proj(gelu(fc(ln2(res2)))): both paths get dy
    zero(d4a, 4 * NC);
    td_ops_matmul_backward(d4a, g->fcproj_w, g->fcproj_b, dy, a->fch_gelu, w->fcproj_w, N, 4 * C, C);
    zero(d4b, 4 * NC);
    td_ops_gelu_backward(d4b, a->fch, d4a, 4 * NC);
    zero(dc, NC);
    td_ops_matmul_backward(dc, g->fc_w, g->fc_b, d4b, a->ln2, w->fc_w, N, C, 4 * C);
    memcpy(dres2, dy, NC * sizeof(float));
    td_ops_layernorm_backward(dres2, g->ln2_w, g->ln2_b, dc, a->res2, w->ln2_w, a->ln2_mean,
                              a->ln2_rstd, N, C);
    // res2 = x + attn_proj(attention(qkv(ln1(x)))): both paths get dres2
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < NC; i++) dx[i] += dres2[i];
    zero(dc, NC);
    td_ops_matmul_backward(dc, g->attproj_w, g->attproj_b, dres2, a->atty, w->attproj_w, N, C, C);
    float *dqkv = d4a;
    zero(dqkv, 3 * NC);
    td_ops_attention_backward(dqkv, dc, a->qkv, a->atty, a->att_lse, B, T, C, NH);
    zero(dc, NC);
    td_ops_matmul_backward(dc, g->qkv_w, g->qkv_b, dqkv, a->ln1, w->qkv_w, N, C, 3 * C);
    td_ops_layernorm_backward(dx, g->ln1_w, g->ln1_b, dc, x, w->ln1_w, a->ln1_mean, a->ln1_rstd,
                              N, C);
}

/* --- the whole model ------------------------------------------------------ */

/* Offsets (floats) of everything in acts. */
typedef struct acts_layout {
    size_t stream;      /* (N,C) per residual stream x_l; x_l and block l's acts alternate */
    size_t block;       /* one block's acts */
    size_t x0;          /* x_l at x0 + l * (stream + block); block l's acts right after x_l */
    size_t lnf, lnf_mean, lnf_rstd, logits, losses, lse, total;
} acts_layout;

static acts_layout layout_of(const td_gpt_ref_config *cfg, int B, int T)
{
    const size_t N = (size_t)B * T;
    acts_layout l;
    l.stream = N * cfg->n_embd;
    l.block = td_gpt_ref_block_acts_numel(cfg, B, T);
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

size_t td_gpt_ref_acts_numel(const td_gpt_ref_config *cfg, int B, int T)
{
    return layout_of(cfg, B, T).total;
}

size_t td_gpt_ref_scratch_numel(const td_gpt_ref_config *cfg, int B, int T)
{
    /* the head's dlnf (N,C) fits in the block scratch (10 C per token) */
    return 2 * (size_t)B * T * cfg->n_embd + td_gpt_ref_block_scratch_numel(cfg, B, T);
}

float *td_gpt_ref_logits(const td_gpt_ref_config *cfg, int B, int T, float *acts)
{
    return acts + layout_of(cfg, B, T).logits;
}

float *td_gpt_ref_losses(const td_gpt_ref_config *cfg, int B, int T, float *acts)
{
    return acts + layout_of(cfg, B, T).losses;
}

td_status td_gpt_ref_check_batch(const td_gpt_ref_config *cfg, const int *tokens,
                                 const int *targets, int B, int T)
{
    td_status st = td_gpt_ref_config_check(cfg);
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

static size_t offset_of(const td_gpt_ref_config *cfg, int index)
{
    td_gpt_ref_tensor t;
    td_gpt_ref_tensor_get(cfg, index, &t);
    return t.offset;
}

static void block_views(const td_gpt_ref_config *cfg, const float *flat, int layer,
                        td_gpt_ref_block *out)
{
    size_t offset, numel;
    td_gpt_ref_block_span(cfg, layer, &offset, &numel);
    td_gpt_ref_block_view(cfg, (float *)flat + offset, out); /* const again at the call sites */
}

td_status td_gpt_ref_forward(const td_gpt_ref_config *cfg, const float *params, const int *tokens,
                             const int *targets, int B, int T, float *acts, float *loss,
                             int *n_targets)
{
    td_status st = td_gpt_ref_check_batch(cfg, tokens, targets, B, T);
    if (st != TD_OK) return st;
    const int L = cfg->n_layer, C = cfg->n_embd, N = B * T;
    const int lnf_w = td_gpt_ref_tensor_count(cfg) - 2;
    const acts_layout l = layout_of(cfg, B, T);

    td_ops_encoder_forward(stream_at(&l, acts, 0), tokens, params + offset_of(cfg, 0),
                           params + offset_of(cfg, 1), B, T, C);
    for (int layer = 0; layer < L; layer++) {
        td_gpt_ref_block w;
        td_gpt_ref_block_acts a;
        block_views(cfg, params, layer, &w);
        td_gpt_ref_block_acts_view(cfg, B, T, stream_at(&l, acts, layer) + l.stream, &a);
        td_gpt_ref_block_forward(cfg, &w, &a, stream_at(&l, acts, layer),
                                 stream_at(&l, acts, layer + 1), B, T);
    }
    td_ops_head_forward(acts + l.logits, acts + l.lnf, acts + l.lnf_mean, acts + l.lnf_rstd,
                        stream_at(&l, acts, L), params + offset_of(cfg, lnf_w),
                        params + offset_of(cfg, lnf_w + 1), params + offset_of(cfg, 0), N, C,
                        cfg->padded_vocab_size);
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

td_status td_gpt_ref_backward(const td_gpt_ref_config *cfg, const float *params, float *grads,
                              const int *tokens, const int *targets, float dloss, int B, int T,
                              float *acts, float *scratch)
{
    if (!targets)
        return td_error_set(TD_ERR_INVALID, "backward needs the targets the forward used");
    td_status st = td_gpt_ref_check_batch(cfg, tokens, targets, B, T);
    if (st != TD_OK) return st;
    const int L = cfg->n_layer, C = cfg->n_embd, N = B * T;
    const int lnf_w = td_gpt_ref_tensor_count(cfg) - 2;
    const acts_layout l = layout_of(cfg, B, T);
    const size_t NC = (size_t)N * C;
    float *dcur = scratch, *dnext = scratch + NC, *block_scratch = scratch + 2 * NC;

    float *logits = acts + l.logits;
    td_ops_crossentropy_backward(logits, logits, acts + l.lse, targets, dloss, N, cfg->vocab_size,
                                 cfg->padded_vocab_size); /* in place: logits -> dlogits */
    zero(dcur, NC);
    td_ops_head_backward(dcur, grads + offset_of(cfg, lnf_w),
                         grads + offset_of(cfg, lnf_w + 1), grads, block_scratch,
                         logits, stream_at(&l, acts, L), acts + l.lnf, acts + l.lnf_mean,
                         acts + l.lnf_rstd, params + offset_of(cfg, lnf_w), params + offset_of(cfg, 0),
                         N, C, cfg->padded_vocab_size);
    for (int layer = L - 1; layer >= 0; layer--) {
        td_gpt_ref_block w, g;
        td_gpt_ref_block_acts a;
        block_views(cfg, params, layer, &w);
        block_views(cfg, grads, layer, &g);
        td_gpt_ref_block_acts_view(cfg, B, T, stream_at(&l, acts, layer) + l.stream, &a);
        zero(dnext, NC);
        td_gpt_ref_block_backward(cfg, &w, &g, &a, stream_at(&l, acts, layer), dcur, dnext,
                                  block_scratch, B, T);
        float *tmp = dcur;
        dcur = dnext;
        dnext = tmp;
    }
    td_ops_encoder_backward(grads, grads + offset_of(cfg, 1), dcur, tokens, B, T, C);
    return TD_OK;
}
