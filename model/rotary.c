/* The rotary decoder shared by the LLaMA-style families (see rotary.h):
 * its parameters and Hugging Face names, its config.json keys, and its CPU
 * reference block, head and embedding.  The GPU's is cuda/rotary_cuda.c. */
#include "rotary.h"
#include "lora.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "tidal/ops.h"

const td_model_traits *td_rotary_traits(const td_model_desc *d) { return &td_model_family_of(d)->traits; }


/* --- the description --------------------------------------------------------- */

td_status td_rotary_check(const td_model_desc *d)
{
    const int hs = td_model_head_size(d);
    if (hs % 2 || hs > TD_MODEL_MAX_HEAD_SIZE || hs < 2)
        return td_error_set(TD_ERR_INVALID, "head size %d must be even and at most %d for rotary embeddings", hs,
                            TD_MODEL_MAX_HEAD_SIZE);
    const td_rope_scaling *rs = &d->rope_scaling;
    if (rs->factor != 0 && !(rs->factor > 0 && rs->low_freq_factor > 0 && rs->high_freq_factor > rs->low_freq_factor &&
                             rs->original_max_positions > 0))
        return td_error_set(TD_ERR_INVALID, "rope_scaling (llama3): factor %g, low_freq_factor %g, high_freq_factor "
                            "%g and original_max_position_embeddings %d must be positive, with high_freq_factor > "
                            "low_freq_factor", rs->factor, rs->low_freq_factor, rs->high_freq_factor,
                            rs->original_max_positions);
    return TD_OK;
}

int td_rotary_describe(const td_model_desc *d, char *buf, size_t n)
{
    char hd[32] = "";
    if (td_model_head_size(d) * d->n_head != d->n_embd) snprintf(hd, sizeof hd, " of %d", td_model_head_size(d));
    return snprintf(buf, n, "%s: %d layers, %d wide, %d heads%s (%d key/value), MLP %d, vocab %d, rope theta %g%s, "
                    "%s head%s", td_model_family_name(td_model_family_of(d)), d->n_layer, d->n_embd, d->n_head, hd,
                    td_model_kv_heads(d), td_model_mlp_width(d), d->vocab_size, td_model_rope_theta(d),
                    d->rope_scaling.factor > 0 ? " (llama3 scaling)" : "", d->untied_head ? "untied" : "tied",
                    d->qkv_bias ? ", q/k/v biases" : "");
}

/* --- the parameters ---------------------------------------------------------- */

int td_rotary_kinds(const td_model_desc *d, td_model_section s, td_model_param *out)
{
    int n = 0;
    switch (s) {
    case TD_MODEL_SECTION_EMBED: out[n++] = TD_MODEL_WTE; break;
    case TD_MODEL_SECTION_BLOCK:
        out[n++] = TD_MODEL_LN1_W;
        out[n++] = TD_MODEL_QKV_W;
        if (d->qkv_bias) out[n++] = TD_MODEL_QKV_B;
        out[n++] = TD_MODEL_ATTPROJ_W;
        out[n++] = TD_MODEL_LN2_W;
        out[n++] = TD_MODEL_FC_W;
        out[n++] = TD_MODEL_FCPROJ_W;
        break;
    default:
        out[n++] = TD_MODEL_LNF_W;
        if (d->untied_head) out[n++] = TD_MODEL_LM_HEAD;
    }
    return n;
}

int td_rotary_shape(const td_model_desc *d, td_model_param kind, int shape[2])
{
    return td_model_shape_common(d, kind, 2 * td_model_mlp_width(d), shape);
}

/* tidal's names; the fused tensors' are tidal's own. */
const char *const td_rotary_names[TD_MODEL_PARAM_COUNT] = {
    [TD_MODEL_WTE] = "model.embed_tokens.weight",
    [TD_MODEL_LN1_W] = "input_layernorm.weight",
    [TD_MODEL_QKV_W] = "self_attn.qkv_proj.weight",
    [TD_MODEL_QKV_B] = "self_attn.qkv_proj.bias",
    [TD_MODEL_ATTPROJ_W] = "self_attn.o_proj.weight",
    [TD_MODEL_LN2_W] = "post_attention_layernorm.weight",
    [TD_MODEL_FC_W] = "mlp.gate_up_proj.weight",
    [TD_MODEL_FCPROJ_W] = "mlp.down_proj.weight",
    [TD_MODEL_LNF_W] = "model.norm.weight",
    [TD_MODEL_LM_HEAD] = "lm_head.weight",
};

/* The Hugging Face tensors, in save_pretrained's order. */
int td_rotary_hf_parts(const td_model_desc *d, td_model_section s, td_model_hf_part out[TD_MODEL_HF_PARTS_MAX])
{
    int n = 0;
    switch (s) {
    case TD_MODEL_SECTION_EMBED:
        out[n++] = (td_model_hf_part){TD_MODEL_WTE, TD_MODEL_HF_WHOLE, 0, "model.embed_tokens.weight"};
        break;
    case TD_MODEL_SECTION_BLOCK:
        out[n++] = (td_model_hf_part){TD_MODEL_LN1_W, TD_MODEL_HF_WHOLE, 0, "input_layernorm.weight"};
        out[n++] = (td_model_hf_part){TD_MODEL_QKV_W, TD_MODEL_HF_Q, 0, "self_attn.q_proj.weight"};
        if (d->qkv_bias) out[n++] = (td_model_hf_part){TD_MODEL_QKV_B, TD_MODEL_HF_Q, 0, "self_attn.q_proj.bias"};
        out[n++] = (td_model_hf_part){TD_MODEL_QKV_W, TD_MODEL_HF_K, 0, "self_attn.k_proj.weight"};
        if (d->qkv_bias) out[n++] = (td_model_hf_part){TD_MODEL_QKV_B, TD_MODEL_HF_K, 0, "self_attn.k_proj.bias"};
        out[n++] = (td_model_hf_part){TD_MODEL_QKV_W, TD_MODEL_HF_V, 0, "self_attn.v_proj.weight"};
        if (d->qkv_bias) out[n++] = (td_model_hf_part){TD_MODEL_QKV_B, TD_MODEL_HF_V, 0, "self_attn.v_proj.bias"};
        out[n++] = (td_model_hf_part){TD_MODEL_ATTPROJ_W, TD_MODEL_HF_WHOLE, 0, "self_attn.o_proj.weight"};
        out[n++] = (td_model_hf_part){TD_MODEL_LN2_W, TD_MODEL_HF_WHOLE, 0, "post_attention_layernorm.weight"};
        out[n++] = (td_model_hf_part){TD_MODEL_FC_W, TD_MODEL_HF_GATE, 0, "mlp.gate_proj.weight"};
        out[n++] = (td_model_hf_part){TD_MODEL_FC_W, TD_MODEL_HF_UP, 0, "mlp.up_proj.weight"};
        out[n++] = (td_model_hf_part){TD_MODEL_FCPROJ_W, TD_MODEL_HF_WHOLE, 0, "mlp.down_proj.weight"};
        break;
    default:
        out[n++] = (td_model_hf_part){TD_MODEL_LNF_W, TD_MODEL_HF_WHOLE, 0, "model.norm.weight"};
        if (d->untied_head) out[n++] = (td_model_hf_part){TD_MODEL_LM_HEAD, TD_MODEL_HF_WHOLE, 0, "lm_head.weight"};
    }
    return n;
}

/* Older transformers saved the rotary frequencies with the weights. */
const char *const td_rotary_hf_ignored[] = {"self_attn.rotary_emb.inv_freq", NULL};

/* --- config.json ----------------------------------------------------------------- */

/* The RoPE object `key` (transformers 4's "rope_scaling", or 5's
 * "rope_parameters", which also carries rope_theta): null, type "default",
 * or type "llama3" with its four fields. */
static td_status rope_scaling_read(const td_hf_config *c, const char *key, td_model_desc *d)
{
    td_status st = TD_OK;
    const td_hf_config *rs;
    TD_TRY(td_hf_config_get_object(c, key, &rs));
    if (!rs) return TD_OK;
    TD_TRY(td_hf_config_float(rs, "rope_theta", 0, &d->rope_theta));
    const char *type = NULL;
    if (td_hf_config_has(rs, "rope_type")) TD_TRY(td_hf_config_string(rs, "rope_type", 1, &type));
    else if (td_hf_config_has(rs, "type")) TD_TRY(td_hf_config_string(rs, "type", 1, &type)); /* older transformers */
    if (!type) TD_FAIL(TD_ERR_INVALID, "%s: \"%s\" has no string \"rope_type\"", td_hf_config_where(c), key);
    if (!strcmp(type, "default")) return TD_OK;
    if (strcmp(type, "llama3"))
        TD_FAIL(TD_ERR_INVALID, "%s: %s type \"%s\" is not supported; tidal computes \"llama3\" scaling (or none)",
                td_hf_config_where(c), key, type);
    td_rope_scaling *r = &d->rope_scaling;
    TD_TRY(td_hf_config_float(rs, "factor", 1, &r->factor));
    TD_TRY(td_hf_config_float(rs, "low_freq_factor", 1, &r->low_freq_factor));
    TD_TRY(td_hf_config_float(rs, "high_freq_factor", 1, &r->high_freq_factor));
    TD_TRY(td_hf_config_int(rs, "original_max_position_embeddings", 1, &r->original_max_positions));
    if (!(r->high_freq_factor > r->low_freq_factor))
        TD_FAIL(TD_ERR_INVALID, "%s: \"high_freq_factor\" %g must exceed \"low_freq_factor\" %g",
                td_hf_config_where(rs), r->high_freq_factor, r->low_freq_factor);
cleanup:
    return st;
}

/* pad_token_id: transformers builds the embedding as nn.Embedding(V, C,
 * padding_idx=pad_token_id), whose row takes no gradient from the lookup;
 * null or absent: none (the family may default it: GemmaConfig's is 0).
 * torch counts a negative index from the end. */
static td_status pad_token_read(const td_hf_config *c, td_model_desc *d)
{
    double v = 0;
    if (!td_hf_config_has(c, "pad_token_id")) return TD_OK;
    td_status st = td_hf_config_number(c, "pad_token_id", &v);
    if (st) return st;
    if (v != floor(v) || v < -(double)d->vocab_size || v >= (double)d->vocab_size)
        return td_error_set(TD_ERR_INVALID, "%s: \"pad_token_id\" %g is not a token of the vocabulary [0, %d)",
                            td_hf_config_where(c), v, d->vocab_size);
    d->has_pad_token = 1;
    d->pad_token = v < 0 ? (int)v + d->vocab_size : (int)v;
    return TD_OK;
}

td_status td_rotary_config_read(const td_hf_config *c, td_model_desc *d, float eps, int head_dim_default)
{
    td_status st = TD_OK;
    const char *w = td_hf_config_where(c);
    TD_TRY(td_hf_config_int(c, "hidden_size", 1, &d->n_embd));
    TD_TRY(td_hf_config_int(c, "intermediate_size", 1, &d->n_inner));
    TD_TRY(td_hf_config_int(c, "num_hidden_layers", 1, &d->n_layer));
    TD_TRY(td_hf_config_int(c, "num_attention_heads", 1, &d->n_head));
    d->n_kv_head = d->n_head;
    TD_TRY(td_hf_config_int(c, "num_key_value_heads", 0, &d->n_kv_head));
    TD_TRY(td_hf_config_int(c, "max_position_embeddings", 1, &d->n_positions));
    TD_TRY(td_hf_config_int(c, "vocab_size", 1, &d->vocab_size));
    d->norm_eps = eps;
    TD_TRY(td_hf_config_float(c, "rms_norm_eps", 0, &d->norm_eps));
    d->rope_theta = 10000.0f;
    TD_TRY(td_hf_config_float(c, "rope_theta", 0, &d->rope_theta));
    int tied = 0;
    TD_TRY(td_hf_config_bool(c, "tie_word_embeddings", &tied));
    d->untied_head = !tied;
    TD_TRY(rope_scaling_read(c, "rope_scaling", d));
    TD_TRY(rope_scaling_read(c, "rope_parameters", d)); /* transformers >= 5 */
    TD_TRY(pad_token_read(c, d));
    if (d->n_head % d->n_kv_head)
        TD_FAIL(TD_ERR_INVALID, "%s: \"num_key_value_heads\" %d does not divide \"num_attention_heads\" %d", w,
                d->n_kv_head, d->n_head);
    int head_dim = head_dim_default;
    TD_TRY(td_hf_config_int(c, "head_dim", 0, &head_dim));
    if (head_dim_default) {
        d->head_dim = head_dim;
    } else if (head_dim && (d->n_embd % d->n_head || head_dim != d->n_embd / d->n_head)) {
        TD_FAIL(TD_ERR_INVALID, "%s: \"head_dim\" %d is not hidden_size / num_attention_heads = %d; this family's "
                "heads split the width", w, head_dim, d->n_embd / d->n_head);
    }
    if (!d->head_dim && d->n_embd % d->n_head)
        TD_FAIL(TD_ERR_INVALID, "%s: \"hidden_size\" %d is not a multiple of \"num_attention_heads\" %d", w,
                d->n_embd, d->n_head);
    TD_TRY(td_hf_config_must_be(c, "rope_interleaved", 0, "tidal rotates in transformers' rotate-half layout"));
cleanup:
    return st;
}

td_status td_rotary_config_write(const td_model_desc *d, td_hf_config *c)
{
    td_status st = TD_OK;
    TD_TRY(td_hf_config_set_int(c, "hidden_size", d->n_embd));
    TD_TRY(td_hf_config_set_int(c, "intermediate_size", td_model_mlp_width(d)));
    TD_TRY(td_hf_config_set_int(c, "num_hidden_layers", d->n_layer));
    TD_TRY(td_hf_config_set_int(c, "num_attention_heads", d->n_head));
    TD_TRY(td_hf_config_set_int(c, "num_key_value_heads", td_model_kv_heads(d)));
    TD_TRY(td_hf_config_set_int(c, "max_position_embeddings", d->n_positions));
    TD_TRY(td_hf_config_set_int(c, "vocab_size", d->vocab_size));
    TD_TRY(td_hf_config_set_float(c, "rms_norm_eps", td_model_norm_eps(d)));
    TD_TRY(td_hf_config_set_float(c, "rope_theta", td_model_rope_theta(d)));
    if (d->rope_scaling.factor > 0) {
        td_hf_config *rs;
        TD_TRY(td_hf_config_object(c, "rope_scaling", &rs));
        TD_TRY(td_hf_config_set_string(rs, "rope_type", "llama3"));
        TD_TRY(td_hf_config_set_float(rs, "factor", d->rope_scaling.factor));
        TD_TRY(td_hf_config_set_float(rs, "low_freq_factor", d->rope_scaling.low_freq_factor));
        TD_TRY(td_hf_config_set_float(rs, "high_freq_factor", d->rope_scaling.high_freq_factor));
        TD_TRY(td_hf_config_set_int(rs, "original_max_position_embeddings", d->rope_scaling.original_max_positions));
    } else {
        TD_TRY(td_hf_config_set_null(c, "rope_scaling"));
    }
    TD_TRY(td_hf_config_set_bool(c, "tie_word_embeddings", !d->untied_head));
    if (d->has_pad_token) TD_TRY(td_hf_config_set_int(c, "pad_token_id", d->pad_token));
    else TD_TRY(td_hf_config_set_null(c, "pad_token_id"));
    TD_TRY(td_hf_config_set_number(c, "attention_dropout", 0.0));
    TD_TRY(td_hf_config_set_number(c, "initializer_range", 0.02));
    TD_TRY(td_hf_config_set_bool(c, "use_cache", 1));
cleanup:
    return st;
}

/* --- the CPU reference ------------------------------------------------------- */

typedef struct sizes { size_t N, C, NH, NKV, hs, A, QKV, H; } sizes;

static sizes sizes_of(const td_model_desc *d, int B, int T)
{
    return (sizes){(size_t)B * (size_t)T, (size_t)d->n_embd, (size_t)d->n_head, (size_t)td_model_kv_heads(d),
                   (size_t)td_model_head_size(d), (size_t)td_model_attn_width(d), (size_t)td_model_qkv_width(d),
                   (size_t)td_model_mlp_width(d)};
}

static size_t max2(size_t a, size_t b) { return a > b ? a : b; }

static size_t acts_numel(const td_model_desc *d, int B, int T)
{
    const sizes s = sizes_of(d, B, T);
    return s.N * (3 * s.C + s.A + s.QKV + 3 * s.H + s.NH + 2);
}

static void acts_view(const td_model_desc *d, int B, int T, float *base, td_model_block_acts *out)
{
    const sizes s = sizes_of(d, B, T);
    float *p = base;
    memset(out, 0, sizeof *out);
    out->ln1 = p;      p += s.N * s.C;
    out->ln1_rstd = p; p += s.N;
    out->qkv = p;      p += s.N * s.QKV;
    out->atty = p;     p += s.N * s.A;
    out->att_lse = p;  p += s.N * s.NH;
    out->res2 = p;     p += s.N * s.C;
    out->ln2 = p;      p += s.N * s.C;
    out->ln2_rstd = p; p += s.N;
    out->fch = p;      p += s.N * 2 * s.H;
    out->fch_gelu = p;
}

/* dA (N, max(2H, QKV)), dB (N,H), dres2 (N,C), dc (N, max(C, A)); the head's dlnf (N,C) fits. */
static size_t scratch_numel(const td_model_desc *d, int B, int T)
{
    const sizes s = sizes_of(d, B, T);
    return s.N * (max2(2 * s.H, s.QKV) + s.H + s.C + max2(s.C, s.A));
}

static void zero(float *p, size_t n) { memset(p, 0, n * sizeof(float)); }

static void block_forward(const td_model_desc *d, const td_model_block *w, const td_model_block_acts *a,
                          const float *x, float *y, const int *pos, int B, int T)
{
    const sizes s = sizes_of(d, B, T);
    const int N = (int)s.N, C = (int)s.C, NH = (int)s.NH, NKV = (int)s.NKV, hs = (int)s.hs;
    const int A = (int)s.A, QKV = (int)s.QKV, H = (int)s.H;
    const float eps = td_model_norm_eps(d);
    const td_model_traits *st = td_rotary_traits(d);
    float inv_freq[TD_MODEL_MAX_HEAD_SIZE / 2];
    td_ops_rope_inv_freq(inv_freq, hs, td_model_rope_theta(d), &d->rope_scaling);
    td_ops_rmsnorm_forward(a->ln1, a->ln1_rstd, x, w->ln1_w, st->norm_offset, N, C, eps);
    td_ops_matmul_forward(a->qkv, a->ln1, w->qkv_w, w->qkv_b, N, C, QKV);                 // (N,QKV)
    td_lora_forward(d, w, a, TD_MODEL_QKV_W, a->ln1, a->qkv, QKV, N);                    // + q, k, v adapters
    td_ops_rope_forward(a->qkv, inv_freq, pos, B, T, NH, hs, (size_t)QKV);                    // q
    td_ops_rope_forward(a->qkv + (size_t)NH * hs, inv_freq, pos, B, T, NKV, hs, (size_t)QKV); // k
    td_ops_attention_gqa_forward(a->atty, a->att_lse, a->qkv, pos, B, T, NH, NKV, hs);        // (N,A)
    td_ops_matmul_forward(a->res2, a->atty, w->attproj_w, NULL, N, A, C);                // attn branch
    td_lora_forward(d, w, a, TD_MODEL_ATTPROJ_W, a->atty, a->res2, C, N);
    td_ops_residual_forward(a->res2, a->res2, x, s.N * s.C);                             // x + branch
    td_ops_rmsnorm_forward(a->ln2, a->ln2_rstd, a->res2, w->ln2_w, st->norm_offset, N, C, eps);
    td_ops_matmul_forward(a->fch, a->ln2, w->fc_w, NULL, N, C, 2 * H);                   // (N,2H) gate|up
    td_lora_forward(d, w, a, TD_MODEL_FC_W, a->ln2, a->fch, 2 * H, N);
    td_ops_glu_forward(a->fch_gelu, a->fch, N, H, st->act);                              // (N,H)
    if (!y) { /* a recompute: the acts only (and down_proj's adapter input) */
        td_lora_forward(d, w, a, TD_MODEL_FCPROJ_W, a->fch_gelu, NULL, C, N);
        return;
    }
    td_ops_matmul_forward(y, a->fch_gelu, w->fcproj_w, NULL, N, H, C);                   // mlp branch
    td_lora_forward(d, w, a, TD_MODEL_FCPROJ_W, a->fch_gelu, y, C, N);
    td_ops_residual_forward(y, y, a->res2, s.N * s.C);                                   // res2 + branch
}

static void block_backward(const td_model_desc *d, const td_model_block *w, const td_model_block *g,
                           const td_model_block_acts *a, const float *x, const float *dy, float *dx, float *scratch,
                           const int *pos, int B, int T)
{
    const sizes s = sizes_of(d, B, T);
    const int N = (int)s.N, C = (int)s.C, NH = (int)s.NH, NKV = (int)s.NKV, hs = (int)s.hs;
    const int A = (int)s.A, QKV = (int)s.QKV, H = (int)s.H;
    const size_t NC = s.N * s.C;
    float *dA = scratch;                       // (N,2H) dgate_up, later (N,QKV) dqkv
    float *dB = dA + s.N * max2(2 * s.H, s.QKV); // (N,H) d(act(gate) * up)
    float *dres2 = dB + s.N * s.H;             // (N,C)
    float *dc = dres2 + NC;                    // (N,C) dln2, (N,A) datty, (N,C) dln1
    const td_model_traits *st = td_rotary_traits(d);
    float inv_freq[TD_MODEL_MAX_HEAD_SIZE / 2];
    td_ops_rope_inv_freq(inv_freq, hs, td_model_rope_theta(d), &d->rope_scaling);

    zero(dB, s.N * s.H);
    td_ops_matmul_backward(dB, g->fcproj_w, NULL, dy, a->fch_gelu, w->fcproj_w, N, H, C);
    td_lora_backward(d, w, g, a, TD_MODEL_FCPROJ_W, a->fch_gelu, dy, C, dB, N);
    zero(dA, s.N * 2 * s.H);
    td_ops_glu_backward(dA, dB, a->fch, N, H, st->act);
    zero(dc, NC);
    td_ops_matmul_backward(dc, g->fc_w, NULL, dA, a->ln2, w->fc_w, N, C, 2 * H);
    td_lora_backward(d, w, g, a, TD_MODEL_FC_W, a->ln2, dA, 2 * H, dc, N);
    memcpy(dres2, dy, NC * sizeof(float));
    td_ops_rmsnorm_backward(dres2, g->ln2_w, dc, a->res2, w->ln2_w, st->norm_offset, a->ln2_rstd, N, C);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < NC; i++) dx[i] += dres2[i];
    zero(dc, s.N * s.A);
    td_ops_matmul_backward(dc, g->attproj_w, NULL, dres2, a->atty, w->attproj_w, N, A, C);
    td_lora_backward(d, w, g, a, TD_MODEL_ATTPROJ_W, a->atty, dres2, C, dc, N);
    zero(dA, s.N * s.QKV);
    td_ops_attention_gqa_backward(dA, dc, a->qkv, a->atty, a->att_lse, pos, B, T, NH, NKV, hs);
    td_ops_rope_backward(dA, inv_freq, pos, B, T, NH, hs, (size_t)QKV);
    td_ops_rope_backward(dA + (size_t)NH * hs, inv_freq, pos, B, T, NKV, hs, (size_t)QKV);
    zero(dc, NC);
    td_ops_matmul_backward(dc, g->qkv_w, g->qkv_b, dA, a->ln1, w->qkv_w, N, C, QKV);
    td_lora_backward(d, w, g, a, TD_MODEL_QKV_W, a->ln1, dA, QKV, dc, N);
    td_ops_rmsnorm_backward(dx, g->ln1_w, dc, x, w->ln1_w, st->norm_offset, a->ln1_rstd, N, C);
}

static void embed_forward(const td_model_desc *d, const float *const *p, const int *tokens, const int *pos, float *out,
                          int B, int T)
{
    (void)pos; /* rotary positions: the blocks' */
    td_ops_encoder_forward(out, tokens, NULL, p[0], NULL, B, T, d->n_embd);
    const float s = td_model_embed_scale(d, TD_DTYPE_F32);
    if (s != 1.0f) td_ops_scale(out, out, s, (size_t)B * T * (size_t)d->n_embd);
}

/* dwte[tokens] += s * dout, split by channel with the rows in order, as the
 * encoder's backward sums (bit-identical for any thread count); the padding
 * token's row takes nothing (torch's padding_idx). */
static void embed_backward(const td_model_desc *d, float *const *g, const float *dout, const int *tokens,
                           const int *pos, int B, int T)
{
    (void)pos;
    const float s = td_model_embed_scale(d, TD_DTYPE_F32);
    if (!g[0]) return; /* frozen */
    const int pad = d->has_pad_token ? d->pad_token : -1;
    if (s == 1.0f && pad < 0) {
        td_ops_encoder_backward(g[0], NULL, dout, tokens, NULL, B, T, d->n_embd);
        return;
    }
    enum { CH = 32 };
    const int C = d->n_embd, blocks = (C + CH - 1) / CH;
#pragma omp parallel for schedule(static)
    for (int blk = 0; blk < blocks; blk++) {
        const int c0 = blk * CH, c1 = c0 + CH < C ? c0 + CH : C;
        for (int r = 0; r < B * T; r++) {
            const float *dr = dout + (size_t)r * C;
            if (tokens[r] == pad) continue;
            float *e = g[0] + (size_t)tokens[r] * C;
            for (int c = c0; c < c1; c++) e[c] += s * dr[c];
        }
    }
}

/* p: the final norm's weight, the output matrix. */
static void head_forward(const td_model_desc *d, float *logits, float *lnf, float *lnf_mean, float *lnf_rstd,
                         const float *x, const float *const *p, int N)
{
    (void)lnf_mean;
    td_ops_rmsnorm_forward(lnf, lnf_rstd, x, p[0], td_rotary_traits(d)->norm_offset, N, d->n_embd,
                           td_model_norm_eps(d));                                              // (N,C)
    td_ops_matmul_forward(logits, lnf, p[1], NULL, N, d->n_embd, d->padded_vocab_size);   // (N,Vp)
}

static void head_backward(const td_model_desc *d, float *dx, float *const *g, float *dlnf, const float *dlogits,
                          const float *x, const float *lnf, const float *lnf_mean, const float *lnf_rstd,
                          const float *const *p, int N)
{
    (void)lnf_mean;
    const int C = d->n_embd;
    zero(dlnf, (size_t)N * C);
    td_ops_matmul_backward(dlnf, g[1], NULL, dlogits, lnf, p[1], N, C, d->padded_vocab_size);
    td_ops_rmsnorm_backward(dx, g[0], dlnf, x, p[0], td_rotary_traits(d)->norm_offset, lnf_rstd, N, C);
}

const td_model_cpu td_rotary_cpu = {acts_numel, acts_view, scratch_numel, block_forward, block_backward,
                                     embed_forward, embed_backward, head_forward, head_backward};
