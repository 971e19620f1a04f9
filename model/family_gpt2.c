/* GPT-2 (GPT2LMHeadModel) as a model family (see include/tidal/family.h).
 *
 * Token + learned position embedding; L pre-LayerNorm blocks
 *   x = x + attn_proj(attention(qkv(ln_1(x))));  x = x + fc_proj(gelu(fc(ln_2(x))))
 * with causal attention scaled by 1/sqrt(hs), GELU tanh approximation, MLP
 * 4C, biases everywhere; final LayerNorm and a head tied to the token
 * embedding, logits = ln_f(x) @ wte^T.  Hugging Face keeps c_attn, c_proj
 * and c_fc as Conv1D, (in, out): the parts say which to transpose.
 * Initialisation: N(0, 0.02), the two residual projections N(0, 0.02 /
 * sqrt(2 L)), LayerNorm weights 1, biases 0.
 *
 * The CPU block is here; the CUDA block is model/cuda/block.cu's
 * (td_ops_cuda_block_*), the head and embedding the CUDA ops'. */
#include "tidal/family.h"
#include "lora.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "tidal/ops.h"
#ifdef TD_HAVE_CUDA
#include "tidal/arena.h"
#include "tidal/ops_cuda.h"
#include "tidal/util.h"
#endif

/* --- the description --------------------------------------------------------- */

static const td_family_preset presets[] = {
    {"tiny", {.n_layer = 2, .n_embd = 128, .n_head = 4, .n_positions = 256, .vocab_size = 256}},
    {"gpt2-124m", {.n_layer = 12, .n_embd = 768, .n_head = 12, .n_positions = 1024, .vocab_size = 50257}},
    {"gpt2-350m", {.n_layer = 24, .n_embd = 1024, .n_head = 16, .n_positions = 1024, .vocab_size = 50257}},
    {"gpt2-774m", {.n_layer = 36, .n_embd = 1280, .n_head = 20, .n_positions = 1024, .vocab_size = 50257}},
    {"gpt2-1.5b", {.n_layer = 48, .n_embd = 1600, .n_head = 25, .n_positions = 1024, .vocab_size = 50257}},
    {"gpt-2.7b", {.n_layer = 32, .n_embd = 2560, .n_head = 32, .n_positions = 1024, .vocab_size = 50257}},
    {"gpt-4b", {.n_layer = 32, .n_embd = 3200, .n_head = 25, .n_positions = 1024, .vocab_size = 50257}},
    {"gpt-6.7b", {.n_layer = 32, .n_embd = 4096, .n_head = 32, .n_positions = 1024, .vocab_size = 50257}},
    {"gpt-13b", {.n_layer = 40, .n_embd = 5120, .n_head = 40, .n_positions = 1024, .vocab_size = 50257}},
};

static void defaults(td_model_desc *d)
{
    d->n_kv_head = d->n_inner = d->head_dim = 0;
    d->norm_eps = d->rope_theta = 0;
    memset(&d->rope_scaling, 0, sizeof d->rope_scaling);
    d->qkv_bias = d->untied_head = 0;
}

static td_status check(const td_model_desc *d)
{
    if (d->untied_head || d->qkv_bias || td_model_kv_heads(d) != d->n_head || td_model_mlp_width(d) != 4 * d->n_embd ||
        td_model_norm_eps(d) != TD_OPS_LN_EPS || d->rope_scaling.factor != 0 ||
        td_model_head_size(d) * d->n_head != d->n_embd)
        return td_error_set(TD_ERR_INVALID, "a gpt2 model is LayerNorm (eps 1e-5), GELU, learned positions, "
                            "MLP 4 x width, all heads with their own keys and values, heads splitting the width "
                            "and a tied head; describe other blocks with another family (llama, qwen2, gemma)");
    return TD_OK;
}

static int describe(const td_model_desc *d, char *buf, size_t n)
{
    return snprintf(buf, n, "gpt2: %d layers, %d wide, %d heads, vocab %d", d->n_layer, d->n_embd, d->n_head,
                    d->vocab_size);
}

/* --- the parameters ---------------------------------------------------------- */

static int kinds(const td_model_desc *d, td_model_section s, td_model_param *out)
{
    (void)d;
    switch (s) {
    case TD_MODEL_SECTION_EMBED: out[0] = TD_MODEL_WTE; out[1] = TD_MODEL_WPE; return 2;
    case TD_MODEL_SECTION_BLOCK:
        for (int k = TD_MODEL_LN1_W; k <= TD_MODEL_FCPROJ_B; k++) out[k - TD_MODEL_LN1_W] = (td_model_param)k;
        return TD_MODEL_FCPROJ_B - TD_MODEL_LN1_W + 1;
    default: out[0] = TD_MODEL_LNF_W; out[1] = TD_MODEL_LNF_B; return 2;
    }
}

static int shape(const td_model_desc *d, td_model_param kind, int s[2])
{
    return td_model_shape_common(d, kind, td_model_mlp_width(d), s);
}

static td_model_init_rule init(const td_model_desc *d, td_model_param kind)
{
    if (kind == TD_MODEL_ATTPROJ_W || kind == TD_MODEL_FCPROJ_W)
        return (td_model_init_rule){.std = 0.02 / sqrt(2.0 * d->n_layer)};
    return td_model_init_common(d, kind);
}

static const char *const names[TD_MODEL_PARAM_COUNT] = {
    "wte.weight", "wpe.weight",
    "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
    "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
    "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias",
    "ln_f.weight", "ln_f.bias", "lm_head.weight",
};

/* One whole tensor per kind, under tidal's name; Conv1D weights transposed. */
static int hf_parts(const td_model_desc *d, td_model_section s, td_model_hf_part out[TD_MODEL_HF_PARTS_MAX])
{
    td_model_param k[TD_MODEL_BLOCK_TENSORS];
    const int n = kinds(d, s, k);
    for (int i = 0; i < n; i++)
        out[i] = (td_model_hf_part){k[i], TD_MODEL_HF_WHOLE,
                                    k[i] == TD_MODEL_QKV_W || k[i] == TD_MODEL_ATTPROJ_W || k[i] == TD_MODEL_FC_W ||
                                        k[i] == TD_MODEL_FCPROJ_W,
                                    names[k[i]]};
    return n;
}

static const char *const hf_ignored[] = {"attn.bias", "attn.masked_bias", NULL};

/* --- config.json (GPT2Config) ------------------------------------------------ */

/* GPT2Config, refusing variants tidal would compute differently. */
static td_status config_read(const td_hf_config *c, td_model_desc *d)
{
    td_status st = TD_OK;
    const char *w = td_hf_config_where(c);
    TD_TRY(td_hf_config_int(c, "n_layer", 1, &d->n_layer));
    TD_TRY(td_hf_config_int(c, "n_head", 1, &d->n_head));
    TD_TRY(td_hf_config_int(c, "n_embd", 1, &d->n_embd));
    TD_TRY(td_hf_config_int(c, "n_positions", 1, &d->n_positions));
    TD_TRY(td_hf_config_int(c, "vocab_size", 1, &d->vocab_size));
    static const char *const gelu[] = {"gelu_new", "gelu_pytorch_tanh", NULL};
    TD_TRY(td_hf_config_one_of(c, "activation_function", gelu,
                               "tidal computes GELU with the tanh approximation (gelu_new)"));
    double eps = 1e-5, inner = 4.0 * d->n_embd;
    TD_TRY(td_hf_config_number(c, "layer_norm_epsilon", &eps));
    if (fabs(eps - 1e-5) > 1e-12)
        TD_FAIL(TD_ERR_INVALID, "%s: layer_norm_epsilon %g is not supported; tidal's LayerNorm uses 1e-5", w, eps);
    TD_TRY(td_hf_config_number(c, "n_inner", &inner));
    if (inner != 4.0 * d->n_embd) /* n_embd is not yet checked: 4x can pass INT_MAX */
        TD_FAIL(TD_ERR_INVALID, "%s: n_inner must be null or 4 * n_embd = %lld; tidal's MLP is 4x wide", w,
                4LL * d->n_embd);
    TD_TRY(td_hf_config_must_be(c, "scale_attn_weights", 1, "tidal scales by 1/sqrt(head_dim)"));
    TD_TRY(td_hf_config_must_be(c, "scale_attn_by_inverse_layer_idx", 0, "tidal scales every layer alike"));
    TD_TRY(td_hf_config_must_be(c, "tie_word_embeddings", 1, "tidal's GPT-2 head is tied to wte"));
    if (d->n_embd % d->n_head)
        TD_FAIL(TD_ERR_INVALID, "%s: n_embd %d is not a multiple of n_head %d", w, d->n_embd, d->n_head);
cleanup:
    return st;
}

static td_status config_write(const td_model_desc *d, td_hf_config *c)
{
    td_status st = TD_OK;
    TD_TRY(td_hf_config_set_int(c, "n_layer", d->n_layer));
    TD_TRY(td_hf_config_set_int(c, "n_head", d->n_head));
    TD_TRY(td_hf_config_set_int(c, "n_embd", d->n_embd));
    TD_TRY(td_hf_config_set_int(c, "n_positions", d->n_positions));
    TD_TRY(td_hf_config_set_int(c, "n_ctx", d->n_positions));
    TD_TRY(td_hf_config_set_int(c, "vocab_size", d->vocab_size));
    TD_TRY(td_hf_config_set_null(c, "n_inner"));
    TD_TRY(td_hf_config_set_string(c, "activation_function", "gelu_new"));
    TD_TRY(td_hf_config_set_number(c, "layer_norm_epsilon", 1e-5));
    TD_TRY(td_hf_config_set_number(c, "initializer_range", 0.02));
    /* tidal trains without dropout; say so, so a model loaded for training matches. */
    TD_TRY(td_hf_config_set_number(c, "resid_pdrop", 0.0));
    TD_TRY(td_hf_config_set_number(c, "embd_pdrop", 0.0));
    TD_TRY(td_hf_config_set_number(c, "attn_pdrop", 0.0));
    TD_TRY(td_hf_config_set_bool(c, "scale_attn_weights", 1));
    TD_TRY(td_hf_config_set_bool(c, "scale_attn_by_inverse_layer_idx", 0));
    TD_TRY(td_hf_config_set_bool(c, "reorder_and_upcast_attn", 0));
    TD_TRY(td_hf_config_set_bool(c, "tie_word_embeddings", 1));
    TD_TRY(td_hf_config_set_int(c, "bos_token_id", d->vocab_size - 1));
    TD_TRY(td_hf_config_set_int(c, "eos_token_id", d->vocab_size - 1));
cleanup:
    return st;
}

/* --- the CPU reference ------------------------------------------------------- */

static size_t acts_numel(const td_model_desc *d, int B, int T)
{
    return (size_t)B * (size_t)T * (15 * (size_t)d->n_embd + 4 + (size_t)d->n_head);
}

static void acts_view(const td_model_desc *d, int B, int T, float *base, td_model_block_acts *out)
{
    const size_t N = (size_t)B * T, C = (size_t)d->n_embd;
    float *p = base;
    out->ln1 = p;      p += N * C;
    out->ln1_mean = p; p += N;
    out->ln1_rstd = p; p += N;
    out->qkv = p;      p += N * 3 * C;
    out->atty = p;     p += N * C;
    out->att_lse = p;  p += N * (size_t)d->n_head;
    out->res2 = p;     p += N * C;
    out->ln2 = p;      p += N * C;
    out->ln2_mean = p; p += N;
    out->ln2_rstd = p; p += N;
    out->fch = p;      p += N * 4 * C;
    out->fch_gelu = p;
}

static size_t scratch_numel(const td_model_desc *d, int B, int T) { return (size_t)B * T * 10 * (size_t)d->n_embd; }

static void zero(float *p, size_t n) { memset(p, 0, n * sizeof(float)); }

static void block_forward(const td_model_desc *d, const td_model_block *w, const td_model_block_acts *a,
                          const float *x, float *y, const int *pos, int B, int T)
{
    const int C = d->n_embd, NH = d->n_head, N = B * T;
    td_ops_layernorm_forward(a->ln1, a->ln1_mean, a->ln1_rstd, x, w->ln1_w, w->ln1_b, N, C);
    td_ops_matmul_forward(a->qkv, a->ln1, w->qkv_w, w->qkv_b, N, C, 3 * C);        // (N,3C)
    td_lora_forward(d, w, a, TD_MODEL_QKV_W, a->ln1, a->qkv, 3 * C, N);            // + adapters (LoRA)
    td_ops_attention_gqa_forward(a->atty, a->att_lse, a->qkv, pos, B, T, NH, NH, C / NH); // (N,C)
    td_ops_matmul_forward(a->res2, a->atty, w->attproj_w, w->attproj_b, N, C, C);  // attn branch
    td_lora_forward(d, w, a, TD_MODEL_ATTPROJ_W, a->atty, a->res2, C, N);
    td_ops_residual_forward(a->res2, a->res2, x, (size_t)N * C);                   // x + branch
    td_ops_layernorm_forward(a->ln2, a->ln2_mean, a->ln2_rstd, a->res2, w->ln2_w, w->ln2_b, N, C);
    td_ops_matmul_forward(a->fch, a->ln2, w->fc_w, w->fc_b, N, C, 4 * C);          // (N,4C)
    td_lora_forward(d, w, a, TD_MODEL_FC_W, a->ln2, a->fch, 4 * C, N);
    td_ops_gelu_forward(a->fch_gelu, a->fch, (size_t)N * 4 * C);
    if (!y) { /* a recompute: the acts only (and c_proj's adapter input) */
        td_lora_forward(d, w, a, TD_MODEL_FCPROJ_W, a->fch_gelu, NULL, C, N);
        return;
    }
    td_ops_matmul_forward(y, a->fch_gelu, w->fcproj_w, w->fcproj_b, N, 4 * C, C);  // mlp branch
    td_lora_forward(d, w, a, TD_MODEL_FCPROJ_W, a->fch_gelu, y, C, N);
    td_ops_residual_forward(y, y, a->res2, (size_t)N * C);                         // res2 + branch
}

static void block_backward(const td_model_desc *d, const td_model_block *w, const td_model_block *g,
                           const td_model_block_acts *a, const float *x, const float *dy, float *dx,
                           float *scratch, const int *pos, int B, int T)
{
    const int C = d->n_embd, NH = d->n_head, N = B * T;
    const size_t NC = (size_t)N * C;
    float *d4a = scratch;           // (N,4C): dfch_gelu, later dqkv (N,3C)
    float *d4b = d4a + 4 * NC;      // (N,4C): dfch
    float *dres2 = d4b + 4 * NC;    // (N,C)
    float *dc = dres2 + NC;         // (N,C): dln2, then datty, then dln1

    // y = res2 + fc_proj(gelu(fc(ln2(res2)))): both paths get dy
    zero(d4a, 4 * NC);
    td_ops_matmul_backward(d4a, g->fcproj_w, g->fcproj_b, dy, a->fch_gelu, w->fcproj_w, N, 4 * C, C);
    td_lora_backward(d, w, g, a, TD_MODEL_FCPROJ_W, a->fch_gelu, dy, C, d4a, N);
    zero(d4b, 4 * NC);
    td_ops_gelu_backward(d4b, a->fch, d4a, 4 * NC);
    zero(dc, NC);
    td_ops_matmul_backward(dc, g->fc_w, g->fc_b, d4b, a->ln2, w->fc_w, N, C, 4 * C);
    td_lora_backward(d, w, g, a, TD_MODEL_FC_W, a->ln2, d4b, 4 * C, dc, N);
    memcpy(dres2, dy, NC * sizeof(float));
    td_ops_layernorm_backward(dres2, g->ln2_w, g->ln2_b, dc, a->res2, w->ln2_w, a->ln2_mean,
                              a->ln2_rstd, N, C);
    // res2 = x + attn_proj(attention(qkv(ln1(x)))): both paths get dres2
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < NC; i++) dx[i] += dres2[i];
    zero(dc, NC);
    td_ops_matmul_backward(dc, g->attproj_w, g->attproj_b, dres2, a->atty, w->attproj_w, N, C, C);
    td_lora_backward(d, w, g, a, TD_MODEL_ATTPROJ_W, a->atty, dres2, C, dc, N);
    float *dqkv = d4a;
    zero(dqkv, 3 * NC);
    td_ops_attention_gqa_backward(dqkv, dc, a->qkv, a->atty, a->att_lse, pos, B, T, NH, NH, C / NH);
    zero(dc, NC);
    td_ops_matmul_backward(dc, g->qkv_w, g->qkv_b, dqkv, a->ln1, w->qkv_w, N, C, 3 * C);
    td_lora_backward(d, w, g, a, TD_MODEL_QKV_W, a->ln1, dqkv, 3 * C, dc, N);
    td_ops_layernorm_backward(dx, g->ln1_w, g->ln1_b, dc, x, w->ln1_w, a->ln1_mean, a->ln1_rstd,
                              N, C);
}

static void embed_forward(const td_model_desc *d, const float *const *p, const int *tokens, const int *pos, float *out,
                          int B, int T)
{
    td_ops_encoder_forward(out, tokens, pos, p[0], p[1], B, T, d->n_embd);
}

static void embed_backward(const td_model_desc *d, float *const *g, const float *dout, const int *tokens,
                           const int *pos, int B, int T)
{
    td_ops_encoder_backward(g[0], g[1], dout, tokens, pos, B, T, d->n_embd);
}

static void head_forward(const td_model_desc *d, float *logits, float *lnf, float *lnf_mean, float *lnf_rstd,
                         const float *x, const float *const *p, int N)
{
    td_ops_head_forward(logits, lnf, lnf_mean, lnf_rstd, x, p[0], p[1], p[2], N, d->n_embd, d->padded_vocab_size);
}

static void head_backward(const td_model_desc *d, float *dx, float *const *g, float *dlnf, const float *dlogits,
                          const float *x, const float *lnf, const float *lnf_mean, const float *lnf_rstd,
                          const float *const *p, int N)
{
    td_ops_head_backward(dx, g[0], g[1], g[2], dlnf, dlogits, x, lnf, lnf_mean, lnf_rstd, p[0], p[2], N, d->n_embd,
                         d->padded_vocab_size);
}

static const td_model_cpu cpu = {acts_numel, acts_view, scratch_numel, block_forward, block_backward,
                                 embed_forward, embed_backward, head_forward, head_backward};

/* --- the CUDA compute -------------------------------------------------------- */

#ifdef TD_HAVE_CUDA
static size_t cuda_acts_bytes(const td_model_desc *d, int B, int T, td_dtype dt)
{
    return td_ops_cuda_block_acts_bytes(d, B, T, dt);
}

/* The block's; the head's dlnf (N,C) and its op scratch; the embedding's sort. */
static size_t cuda_scratch_bytes(const td_model_desc *d, int B, int T, td_dtype dt, int att_seqs)
{
    const size_t N = (size_t)B * T, C = (size_t)d->n_embd;
    size_t s = td_ops_cuda_block_scratch_bytes(d, B, T, dt, att_seqs);
    size_t head = td_align_up(N * C * td_dtype_bytes(dt), TD_ARENA_ALIGN) + td_ops_cuda_head_scratch_bytes((int)N, (int)C);
    size_t enc = td_ops_cuda_encoder_scratch_bytes(B, T, d->padded_vocab_size);
    return s > head ? (s > enc ? s : enc) : (head > enc ? head : enc);
}

static size_t cuda_consts_bytes(const td_model_desc *d) { (void)d; return 0; }
static void cuda_consts_fill(const td_model_desc *d, void *host) { (void)d, (void)host; }

static td_status cuda_embed_forward(const td_model_run *r, void *const *p, const int *tokens, void *out)
{
    return td_ops_cuda_encoder_forward(out, tokens, r->pos, p[0], p[1], r->B, r->T, r->desc->n_embd, r->dt, r->stream);
}

static td_status cuda_embed_backward(const td_model_run *r, void *const *g, const int *tokens, const void *dout)
{
    return td_ops_cuda_encoder_backward(g[0], g[1], dout, tokens, r->pos, r->B, r->T, r->desc->n_embd,
                                        r->desc->padded_vocab_size, r->dt, r->gdt, r->scratch, r->scratch_bytes,
                                        r->stream);
}

static td_status cuda_block_forward(const td_model_run *r, void *const *p, void *acts, const void *x, void *y)
{
    td_ops_cuda_block w;
    td_ops_cuda_block_acts a;
    td_ops_cuda_block_from(r->desc, p, &w); /* the twelve and the adapters, by role */
    td_ops_cuda_block_acts_view(r->desc, r->B, r->T, r->dt, acts, &a);
    a.lora_drop = r->lora_drop;
    return td_ops_cuda_block_forward(r->ops, r->desc, &w, &a, x, y, r->pos, r->B, r->T, r->dt, r->scratch, r->scratch_bytes,
                                     r->stream);
}

static td_status cuda_block_backward(const td_model_run *r, void *const *p, void *const *g, void *acts, const void *x,
                                     const void *dy, void *dx)
{
    td_ops_cuda_block w, gw;
    td_ops_cuda_block_acts a;
    td_ops_cuda_block_from(r->desc, p, &w);
    td_ops_cuda_block_from(r->desc, g, &gw);
    td_ops_cuda_block_acts_view(r->desc, r->B, r->T, r->dt, acts, &a);
    a.lora_drop = r->lora_drop;
    return td_ops_cuda_block_backward(r->ops, r->desc, &w, &gw, &a, x, dy, dx, r->pos, r->B, r->T, TD_OPS_CUDA_SET, r->dt,
                                      r->gdt, r->scratch, r->scratch_bytes, r->stream);
}

static td_status cuda_head_forward(const td_model_run *r, void *const *p, const void *x, void *logits,
                                   const td_model_head_acts *h)
{
    return td_ops_cuda_head_forward(r->ops, logits, h->lnf, h->mean, h->rstd, x, p[0], p[1], p[2], r->B * r->T,
                                    r->desc->n_embd, r->desc->padded_vocab_size, r->dt, r->stream);
}

static td_status cuda_head_backward(const td_model_run *r, void *const *p, void *const *g, const void *x,
                                    const void *dlogits, const td_model_head_acts *h, void *dx)
{
    const int N = r->B * r->T, C = r->desc->n_embd;
    const size_t dlnf = td_align_up((size_t)N * (size_t)C * td_dtype_bytes(r->dt), TD_ARENA_ALIGN);
    return td_ops_cuda_head_backward(r->ops, dx, g[0], g[1], g[2], r->scratch, dlogits, x, h->lnf, h->mean, h->rstd,
                                     p[0], p[2], N, C, r->desc->padded_vocab_size, r->dt, r->gdt,
                                     (char *)r->scratch + dlnf, r->scratch_bytes - dlnf, r->stream);
}

static const td_model_exec cuda = {cuda_acts_bytes, cuda_scratch_bytes, cuda_consts_bytes, cuda_consts_fill,
                                   cuda_embed_forward, cuda_embed_backward, cuda_block_forward, cuda_block_backward,
                                   cuda_head_forward, cuda_head_backward};
#define CUDA_EXEC (&cuda)
#else
#define CUDA_EXEC NULL
#endif

const td_model_family td_family_gpt2 = {
    .name = "gpt2",
    .title = "GPT-2",
    .architecture = "GPT2LMHeadModel",
    .summary = "LayerNorm, learned positions, multi-head attention, GELU MLP 4 x width, biases, tied head",
    .traits = {.norm = TD_MODEL_NORM_LAYER, .gated = 0, .act = TD_OPS_GLU_GELU_TANH, .rope = 0},
    .presets = presets,
    .n_presets = (int)(sizeof presets / sizeof presets[0]),
    .defaults = defaults,
    .check = check,
    .describe = describe,
    .kinds = kinds,
    .shape = shape,
    .init = init,
    .names = names,
    .hf_block_prefix = "h.",
    .hf_optional_prefix = "transformer.",
    .hf_parts = hf_parts,
    .hf_ignored = hf_ignored,
    .config_read = config_read,
    .config_write = config_write,
    .cpu = &cpu,
    .cuda = CUDA_EXEC,
};
