/* GPT-2 composed from the CPU reference ops (see include/tidal/model_ref.h).
 *
 * Everything lives in caller-owned flat buffers carved by size tables: the
 * parameters by the tensor table, the activations by acts_layout() below.
 * The forward keeps every activation a block's backward needs (no
 * recomputation here; the step loop checkpoints by re-running
 * td_model_block_forward from a kept block input).  The backward runs the
 * residual-stream gradient through two ping-pong buffers, block by block in
 * reverse. */
#include "tidal/model_ref.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <string.h>

#include "tidal/alloc.h"
#include "tidal/ops.h"
#include "tidal/util.h"

/* --- configuration and parameter table ----------------------------------- */

const char *td_model_family_name(td_model_family f)
{
    static const char *names[TD_MODEL_FAMILY_COUNT] = {"gpt2", "llama", "qwen2"};
    return (unsigned)f < TD_MODEL_FAMILY_COUNT ? names[f] : "unknown";
}

static int is_gpt2(const td_model_desc *cfg) { return cfg->family == TD_MODEL_GPT2; }

int td_model_kv_heads(const td_model_desc *cfg) { return cfg->n_kv_head > 0 ? cfg->n_kv_head : cfg->n_head; }
int td_model_head_size(const td_model_desc *cfg) { return cfg->n_embd / cfg->n_head; }
int td_model_mlp_width(const td_model_desc *cfg) { return cfg->n_inner > 0 ? cfg->n_inner : 4 * cfg->n_embd; }
int td_model_qkv_width(const td_model_desc *cfg)
{
    return (cfg->n_head + 2 * td_model_kv_heads(cfg)) * td_model_head_size(cfg);
}
float td_model_norm_eps(const td_model_desc *cfg) { return cfg->norm_eps > 0 ? cfg->norm_eps : TD_OPS_LN_EPS; }
float td_model_rope_theta(const td_model_desc *cfg) { return cfg->rope_theta > 0 ? cfg->rope_theta : 10000.0f; }

td_status td_model_desc_check(const td_model_desc *cfg)
{
    if (!cfg) return td_error_set(TD_ERR_INVALID, "no model configuration given");
    if ((unsigned)cfg->family >= TD_MODEL_FAMILY_COUNT)
        return td_error_set(TD_ERR_INVALID, "model family %d is unknown; use gpt2, llama or qwen2", (int)cfg->family);
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
    if (cfg->n_kv_head < 0 || cfg->n_inner < 0 || cfg->norm_eps < 0 || cfg->rope_theta < 0)
        return td_error_set(TD_ERR_INVALID, "key/value heads %d, MLP width %d, norm eps %g and rope theta %g "
                            "must not be negative", cfg->n_kv_head, cfg->n_inner, cfg->norm_eps, cfg->rope_theta);
    if (cfg->n_head % td_model_kv_heads(cfg))
        return td_error_set(TD_ERR_INVALID, "the %d heads are not a multiple of the %d key/value heads; "
                            "num_key_value_heads must divide num_attention_heads", cfg->n_head, cfg->n_kv_head);
    /* the width first: td_model_mlp_width's 4 x width must not overflow (fuzz_hf_config) */
    if ((int64_t)cfg->n_embd * 4 > INT32_MAX || (int64_t)td_model_mlp_width(cfg) * 2 > INT32_MAX)
        return td_error_set(TD_ERR_INVALID, "width %d / MLP width %d are out of range", cfg->n_embd, cfg->n_inner);
    if (is_gpt2(cfg)) {
        if (cfg->norm != TD_MODEL_NORM_LAYER || cfg->act != TD_MODEL_ACT_GELU || cfg->pos != TD_MODEL_POS_LEARNED ||
            cfg->untied_head || cfg->qkv_bias || td_model_kv_heads(cfg) != cfg->n_head ||
            td_model_mlp_width(cfg) != 4 * cfg->n_embd || td_model_norm_eps(cfg) != TD_OPS_LN_EPS ||
            cfg->rope_scaling.factor != 0)
            return td_error_set(TD_ERR_INVALID, "a gpt2 model is LayerNorm (eps 1e-5), GELU, learned positions, "
                                "MLP 4 x width, all heads with their own keys and values and a tied head; "
                                "describe other blocks as llama or qwen2");
        return TD_OK;
    }
    if (cfg->norm != TD_MODEL_NORM_RMS || cfg->act != TD_MODEL_ACT_SWIGLU || cfg->pos != TD_MODEL_POS_ROPE)
        return td_error_set(TD_ERR_INVALID, "a %s model is RMSNorm, SwiGLU and rotary positions",
                            td_model_family_name(cfg->family));
    if (td_model_head_size(cfg) % 2 || td_model_head_size(cfg) > TD_MODEL_MAX_HEAD_SIZE)
        return td_error_set(TD_ERR_INVALID, "head size %d (width %d / %d heads) must be even and at most %d "
                            "for rotary embeddings", td_model_head_size(cfg), cfg->n_embd, cfg->n_head,
                            TD_MODEL_MAX_HEAD_SIZE);
    const td_rope_scaling *rs = &cfg->rope_scaling;
    if (rs->factor != 0 && !(rs->factor > 0 && rs->low_freq_factor > 0 && rs->high_freq_factor > rs->low_freq_factor &&
                             rs->original_max_positions > 0))
        return td_error_set(TD_ERR_INVALID, "rope_scaling (llama3): factor %g, low_freq_factor %g, high_freq_factor "
                            "%g and original_max_position_embeddings %d must be positive, with high_freq_factor > "
                            "low_freq_factor", rs->factor, rs->low_freq_factor, rs->high_freq_factor,
                            rs->original_max_positions);
    return TD_OK;
}

int td_model_embed_tensor_count(const td_model_desc *cfg) { return is_gpt2(cfg) ? 2 : 1; }

/* A block's kinds in layout order. */
static int block_kinds(const td_model_desc *cfg, td_model_param out[TD_MODEL_BLOCK_TENSORS])
{
    int n = 0;
    if (is_gpt2(cfg)) {
        for (int k = TD_MODEL_LN1_W; k <= TD_MODEL_FCPROJ_B; k++) out[n++] = (td_model_param)k;
        return n;
    }
    out[n++] = TD_MODEL_LN1_W;
    out[n++] = TD_MODEL_QKV_W;
    if (cfg->qkv_bias) out[n++] = TD_MODEL_QKV_B;
    out[n++] = TD_MODEL_ATTPROJ_W;
    out[n++] = TD_MODEL_LN2_W;
    out[n++] = TD_MODEL_FC_W;
    out[n++] = TD_MODEL_FCPROJ_W;
    return n;
}

int td_model_block_tensor_count(const td_model_desc *cfg)
{
    td_model_param k[TD_MODEL_BLOCK_TENSORS];
    return block_kinds(cfg, k);
}

/* The kinds after the blocks. */
static int final_kinds(const td_model_desc *cfg, td_model_param out[2])
{
    out[0] = TD_MODEL_LNF_W;
    if (is_gpt2(cfg)) { out[1] = TD_MODEL_LNF_B; return 2; }
    if (cfg->untied_head) { out[1] = TD_MODEL_LM_HEAD; return 2; }
    return 1;
}

int td_model_tensor_count(const td_model_desc *cfg)
{
    td_model_param f[2];
    return td_model_embed_tensor_count(cfg) + td_model_block_tensor_count(cfg) * cfg->n_layer + final_kinds(cfg, f);
}

int td_model_head_tensors(const td_model_desc *cfg, int idx[3])
{
    const int first = td_model_embed_tensor_count(cfg) + td_model_block_tensor_count(cfg) * cfg->n_layer;
    if (is_gpt2(cfg)) { idx[0] = first; idx[1] = first + 1; idx[2] = 0; return 3; }
    idx[0] = first;
    idx[1] = cfg->untied_head ? first + 1 : 0;
    return 2;
}

/* Shape of one kind, tidal's (out, in) convention. */
static int kind_shape(const td_model_desc *cfg, td_model_param kind, int shape[2])
{
    const int C = cfg->n_embd, H = td_model_mlp_width(cfg), QKV = td_model_qkv_width(cfg);
    const int gpt2 = is_gpt2(cfg);
    switch (kind) {
    case TD_MODEL_WTE: case TD_MODEL_LM_HEAD: shape[0] = cfg->padded_vocab_size; shape[1] = C; return 2;
    case TD_MODEL_WPE: shape[0] = cfg->n_positions; shape[1] = C; return 2;
    case TD_MODEL_QKV_W: shape[0] = QKV; shape[1] = C; return 2;
    case TD_MODEL_QKV_B: shape[0] = QKV; return 1;
    case TD_MODEL_ATTPROJ_W: shape[0] = C; shape[1] = C; return 2;
    case TD_MODEL_FC_W: shape[0] = gpt2 ? H : 2 * H; shape[1] = C; return 2;
    case TD_MODEL_FC_B: shape[0] = H; return 1;
    case TD_MODEL_FCPROJ_W: shape[0] = C; shape[1] = H; return 2;
    default: shape[0] = C; return 1; /* norm weights and biases, C-wide biases */
    }
}

static size_t kind_numel(const td_model_desc *cfg, td_model_param kind)
{
    int shape[2] = {1, 1};
    const int ndim = kind_shape(cfg, kind, shape);
    return ndim == 2 ? (size_t)shape[0] * shape[1] : (size_t)shape[0];
}

static size_t block_numel(const td_model_desc *cfg)
{
    td_model_param k[TD_MODEL_BLOCK_TENSORS];
    size_t n = 0;
    for (int i = 0, nk = block_kinds(cfg, k); i < nk; i++) n += kind_numel(cfg, k[i]);
    return n;
}

size_t td_model_block_largest_numel(const td_model_desc *cfg)
{
    td_model_param k[TD_MODEL_BLOCK_TENSORS];
    size_t m = 0;
    for (int i = 0, nk = block_kinds(cfg, k); i < nk; i++)
        if (kind_numel(cfg, k[i]) > m) m = kind_numel(cfg, k[i]);
    return m;
}

static size_t embed_numel(const td_model_desc *cfg)
{
    return kind_numel(cfg, TD_MODEL_WTE) + (is_gpt2(cfg) ? kind_numel(cfg, TD_MODEL_WPE) : 0);
}

static const char *const gpt2_names[TD_MODEL_PARAM_COUNT] = {
    "wte.weight", "wpe.weight",
    "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
    "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
    "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias",
    "ln_f.weight", "ln_f.bias", "lm_head.weight",
};

/* LLaMA-family names (transformers' LlamaForCausalLM / Qwen2ForCausalLM);
 * the fused tensors have tidal's own names, split on save (td_model_hf_get). */
static const char *const llama_names[TD_MODEL_PARAM_COUNT] = {
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

void td_model_tensor_get(const td_model_desc *cfg, int index, td_model_tensor *out)
{
    memset(out, 0, sizeof *out);
    const int L = cfg->n_layer, ne = td_model_embed_tensor_count(cfg);
    td_model_param bk[TD_MODEL_BLOCK_TENSORS], fk[2];
    const int nb = block_kinds(cfg, bk);
    final_kinds(cfg, fk);
    out->layer = -1;
    if (index < ne) {
        out->kind = (td_model_param)index;
        out->offset = index == 0 ? 0 : kind_numel(cfg, TD_MODEL_WTE);
    } else if (index < ne + nb * L) {
        const int layer = (index - ne) / nb, k = (index - ne) % nb;
        out->kind = bk[k];
        out->layer = layer;
        out->offset = embed_numel(cfg) + (size_t)layer * block_numel(cfg);
        for (int j = 0; j < k; j++) out->offset += kind_numel(cfg, bk[j]);
    } else {
        const int k = index - ne - nb * L;
        out->kind = fk[k];
        out->offset = embed_numel(cfg) + (size_t)L * block_numel(cfg) + (k ? kind_numel(cfg, fk[0]) : 0);
    }
    out->shape[1] = 0;
    out->ndim = kind_shape(cfg, out->kind, out->shape);
    out->numel = kind_numel(cfg, out->kind);
    out->matrix = out->ndim == 2;
    out->hf_transposed = is_gpt2(cfg) && (out->kind == TD_MODEL_QKV_W || out->kind == TD_MODEL_ATTPROJ_W ||
                                          out->kind == TD_MODEL_FC_W || out->kind == TD_MODEL_FCPROJ_W);
    const char *name = (is_gpt2(cfg) ? gpt2_names : llama_names)[out->kind];
    if (out->layer >= 0)
        snprintf(out->name, sizeof out->name, is_gpt2(cfg) ? "h.%d.%s" : "model.layers.%d.%s", out->layer, name);
    else
        snprintf(out->name, sizeof out->name, "%s", name);
}

size_t td_model_params_numel(const td_model_desc *cfg)
{
    td_model_param fk[2];
    size_t n = embed_numel(cfg) + (size_t)cfg->n_layer * block_numel(cfg);
    for (int k = 0, nf = final_kinds(cfg, fk); k < nf; k++) n += kind_numel(cfg, fk[k]);
    return n;
}

void td_model_block_span(const td_model_desc *cfg, int layer, size_t *offset, size_t *numel)
{
    *offset = embed_numel(cfg) + (size_t)layer * block_numel(cfg);
    *numel = block_numel(cfg);
}

void td_model_block_from(const td_model_desc *cfg, void *const *p, td_model_block *out)
{
    td_model_param bk[TD_MODEL_BLOCK_TENSORS];
    float **slot = (float **)out; /* the struct's pointers follow td_model_param from LN1_W */
    memset(out, 0, sizeof *out);
    for (int k = 0, nb = block_kinds(cfg, bk); k < nb; k++) slot[bk[k] - TD_MODEL_LN1_W] = p[k];
}

void td_model_block_view(const td_model_desc *cfg, float *block_base, td_model_block *out)
{
    td_model_param bk[TD_MODEL_BLOCK_TENSORS];
    void *p[TD_MODEL_BLOCK_TENSORS];
    float *q = block_base;
    for (int k = 0, nb = block_kinds(cfg, bk); k < nb; k++) {
        p[k] = q;
        q += kind_numel(cfg, bk[k]);
    }
    td_model_block_from(cfg, p, out);
}

/* --- initialisation ------------------------------------------------------- */

void td_model_init_tensor(const td_model_desc *cfg, int index, float *dst, uint64_t seed)
{
    td_model_tensor t;
    td_model_tensor_get(cfg, index, &t);
    switch (t.kind) {
    case TD_MODEL_LN1_W: case TD_MODEL_LN2_W: case TD_MODEL_LNF_W:
        for (size_t i = 0; i < t.numel; i++) dst[i] = 1.0f;
        return;
    case TD_MODEL_LN1_B: case TD_MODEL_LN2_B: case TD_MODEL_LNF_B: case TD_MODEL_QKV_B:
    case TD_MODEL_ATTPROJ_B: case TD_MODEL_FC_B: case TD_MODEL_FCPROJ_B:
        memset(dst, 0, t.numel * sizeof(float));
        return;
    default: break;
    }
    const double std = is_gpt2(cfg) && (t.kind == TD_MODEL_ATTPROJ_W || t.kind == TD_MODEL_FCPROJ_W)
                           ? 0.02 / sqrt(2.0 * cfg->n_layer)
                           : 0.02;
    size_t n = t.numel;
    if (t.kind == TD_MODEL_WTE || t.kind == TD_MODEL_LM_HEAD) { /* padding rows stay zero */
        n = (size_t)cfg->vocab_size * cfg->n_embd;
        memset(dst + n, 0, (t.numel - n) * sizeof(float));
    }
    td_rng rng;
    td_rng_seed(&rng, seed ^ (0x9E3779B97F4A7C15ull * (uint64_t)(index + 1)));
    /* Box-Muller: pair j turns draws 2j and 2j + 1 of the tensor's stream
     * (u1 in (0, 1], u2 in [0, 1)) into elements 2j and 2j + 1.  Each thread
     * jumps the stream to its first pair (td_rng_jump) and draws its share
     * in order: the serial loop's values whatever the threads, and an 8B
     * model initialises in seconds, the draws parallel as the transform. */
    const size_t pairs = (n + 1) / 2;
#pragma omp parallel if (pairs >= 4096)
    {
        const size_t nt = (size_t)omp_get_num_threads(), me = (size_t)omp_get_thread_num();
        const size_t begin = pairs / nt * me + (me < pairs % nt ? me : pairs % nt);
        const size_t end = begin + pairs / nt + (me < pairs % nt);
        td_rng r = rng;
        td_rng_jump(&r, 2 * begin);
        for (size_t j = begin; j < end; j++) {
            const double u1 = 1.0 - td_rng_uniform(&r), u2 = td_rng_uniform(&r);
            const double rad = std * sqrt(-2.0 * log(u1)), a = 6.283185307179586 * u2;
            dst[2 * j] = (float)(rad * cos(a));
            if (2 * j + 1 < n) dst[2 * j + 1] = (float)(rad * sin(a));
        }
    }
}

void td_model_init(const td_model_desc *cfg, float *params, uint64_t seed)
{
    const int count = td_model_tensor_count(cfg);
#pragma omp parallel for schedule(dynamic, 1)
    for (int i = 0; i < count; i++) {
        td_model_tensor t;
        td_model_tensor_get(cfg, i, &t);
        td_model_init_tensor(cfg, i, params + t.offset, seed);
    }
}

/* --- one block ------------------------------------------------------------ */

size_t td_model_block_acts_numel(const td_model_desc *cfg, int B, int T)
{
    const size_t C = (size_t)cfg->n_embd, NH = (size_t)cfg->n_head;
    if (is_gpt2(cfg)) return (size_t)B * T * (15 * C + 4 + NH);
    const size_t H = (size_t)td_model_mlp_width(cfg), QKV = (size_t)td_model_qkv_width(cfg);
    return (size_t)B * T * (4 * C + QKV + 3 * H + NH + 2);
}

void td_model_block_acts_view(const td_model_desc *cfg, int B, int T, float *base,
                                td_model_block_acts *out)
{
    const size_t N = (size_t)B * T, C = (size_t)cfg->n_embd;
    const int gpt2 = is_gpt2(cfg);
    const size_t QKV = gpt2 ? 3 * C : (size_t)td_model_qkv_width(cfg);
    const size_t H = (size_t)td_model_mlp_width(cfg), FC = gpt2 ? H : 2 * H;
    float *p = base;
    memset(out, 0, sizeof *out);
    out->ln1 = p;      p += N * C;
    if (gpt2) { out->ln1_mean = p; p += N; }
    out->ln1_rstd = p; p += N;
    out->qkv = p;      p += N * QKV;
    out->atty = p;     p += N * C;
    out->att_lse = p;  p += N * (size_t)cfg->n_head;
    out->res2 = p;     p += N * C;
    out->ln2 = p;      p += N * C;
    if (gpt2) { out->ln2_mean = p; p += N; }
    out->ln2_rstd = p; p += N;
    out->fch = p;      p += N * FC;
    out->fch_gelu = p;
}

size_t td_model_block_scratch_numel(const td_model_desc *cfg, int B, int T)
{
    const size_t C = (size_t)cfg->n_embd;
    if (is_gpt2(cfg)) return (size_t)B * T * 10 * C;
    const size_t H = (size_t)td_model_mlp_width(cfg), QKV = (size_t)td_model_qkv_width(cfg);
    return (size_t)B * T * ((2 * H > QKV ? 2 * H : QKV) + H + 2 * C);
}

static void zero(float *p, size_t n) { memset(p, 0, n * sizeof(float)); }

/* The LLaMA-family block (see model_ref.h): RMSNorm, q|k|v in one matmul, RoPE
 * on q and k in place, grouped-query attention, o_proj, RMSNorm, gate|up in
 * one matmul, SwiGLU, down_proj; no biases but Qwen2's q/k/v ones. */
static void llama_block_forward(const td_model_desc *cfg, const td_model_block *w,
                                const td_model_block_acts *a, const float *x, float *y, int B, int T)
{
    const int C = cfg->n_embd, NH = cfg->n_head, NKV = td_model_kv_heads(cfg), hs = td_model_head_size(cfg);
    const int N = B * T, H = td_model_mlp_width(cfg), QKV = td_model_qkv_width(cfg);
    const float eps = td_model_norm_eps(cfg);
    float inv_freq[TD_MODEL_MAX_HEAD_SIZE / 2];
    td_ops_rope_inv_freq(inv_freq, hs, td_model_rope_theta(cfg), &cfg->rope_scaling);
    td_ops_rmsnorm_forward(a->ln1, a->ln1_rstd, x, w->ln1_w, N, C, eps);
    td_ops_matmul_forward(a->qkv, a->ln1, w->qkv_w, w->qkv_b, N, C, QKV);              // (N,QKV)
    td_ops_rope_forward(a->qkv, inv_freq, B, T, NH, hs, (size_t)QKV);                 // q
    td_ops_rope_forward(a->qkv + (size_t)NH * hs, inv_freq, B, T, NKV, hs, (size_t)QKV); // k
    td_ops_attention_gqa_forward(a->atty, a->att_lse, a->qkv, B, T, NH, NKV, hs);     // (N,C)
    td_ops_matmul_forward(a->res2, a->atty, w->attproj_w, NULL, N, C, C);             // attn branch
    td_ops_residual_forward(a->res2, a->res2, x, (size_t)N * C);                      // x + branch
    td_ops_rmsnorm_forward(a->ln2, a->ln2_rstd, a->res2, w->ln2_w, N, C, eps);
    td_ops_matmul_forward(a->fch, a->ln2, w->fc_w, NULL, N, C, 2 * H);                // (N,2H) gate|up
    td_ops_swiglu_forward(a->fch_gelu, a->fch, N, H);                                 // (N,H)
    if (!y) return; /* a recompute: the acts only */
    td_ops_matmul_forward(y, a->fch_gelu, w->fcproj_w, NULL, N, H, C);                // mlp branch
    td_ops_residual_forward(y, y, a->res2, (size_t)N * C);                            // res2 + branch
}

static void llama_block_backward(const td_model_desc *cfg, const td_model_block *w,
                                 const td_model_block *g, const td_model_block_acts *a,
                                 const float *x, const float *dy, float *dx, float *scratch, int B, int T)
{
    const int C = cfg->n_embd, NH = cfg->n_head, NKV = td_model_kv_heads(cfg), hs = td_model_head_size(cfg);
    const int N = B * T, H = td_model_mlp_width(cfg), QKV = td_model_qkv_width(cfg);
    const size_t NC = (size_t)N * C, wide = 2 * (size_t)H > (size_t)QKV ? 2 * (size_t)H : (size_t)QKV;
    float *dA = scratch;                 // (N,2H) dgate_up, later (N,QKV) dqkv
    float *dB = dA + (size_t)N * wide;   // (N,H) d(silu(gate) * up)
    float *dres2 = dB + (size_t)N * H;   // (N,C)
    float *dc = dres2 + NC;              // (N,C): dln2, then datty, then dln1
    float inv_freq[TD_MODEL_MAX_HEAD_SIZE / 2];
    td_ops_rope_inv_freq(inv_freq, hs, td_model_rope_theta(cfg), &cfg->rope_scaling);

    zero(dB, (size_t)N * H);
    td_ops_matmul_backward(dB, g->fcproj_w, NULL, dy, a->fch_gelu, w->fcproj_w, N, H, C);
    zero(dA, (size_t)N * 2 * H);
    td_ops_swiglu_backward(dA, dB, a->fch, N, H);
    zero(dc, NC);
    td_ops_matmul_backward(dc, g->fc_w, NULL, dA, a->ln2, w->fc_w, N, C, 2 * H);
    memcpy(dres2, dy, NC * sizeof(float));
    td_ops_rmsnorm_backward(dres2, g->ln2_w, dc, a->res2, w->ln2_w, a->ln2_rstd, N, C);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < NC; i++) dx[i] += dres2[i];
    zero(dc, NC);
    td_ops_matmul_backward(dc, g->attproj_w, NULL, dres2, a->atty, w->attproj_w, N, C, C);
    zero(dA, (size_t)N * QKV);
    td_ops_attention_gqa_backward(dA, dc, a->qkv, a->atty, a->att_lse, B, T, NH, NKV, hs);
    td_ops_rope_backward(dA, inv_freq, B, T, NH, hs, (size_t)QKV);
    td_ops_rope_backward(dA + (size_t)NH * hs, inv_freq, B, T, NKV, hs, (size_t)QKV);
    zero(dc, NC);
    td_ops_matmul_backward(dc, g->qkv_w, g->qkv_b, dA, a->ln1, w->qkv_w, N, C, QKV);
    td_ops_rmsnorm_backward(dx, g->ln1_w, dc, x, w->ln1_w, a->ln1_rstd, N, C);
}

void td_model_block_forward(const td_model_desc *cfg, const td_model_block *w,
                              const td_model_block_acts *a, const float *x, float *y, int B, int T)
{
    if (!is_gpt2(cfg)) { llama_block_forward(cfg, w, a, x, y, B, T); return; }
    const int C = cfg->n_embd, NH = cfg->n_head, N = B * T;
    td_ops_layernorm_forward(a->ln1, a->ln1_mean, a->ln1_rstd, x, w->ln1_w, w->ln1_b, N, C);
    td_ops_matmul_forward(a->qkv, a->ln1, w->qkv_w, w->qkv_b, N, C, 3 * C);        // (N,3C)
    td_ops_attention_forward(a->atty, a->att_lse, a->qkv, B, T, C, NH);            // (N,C)
    td_ops_matmul_forward(a->res2, a->atty, w->attproj_w, w->attproj_b, N, C, C);  // attn branch
    td_ops_residual_forward(a->res2, a->res2, x, (size_t)N * C);                   // x + branch
    td_ops_layernorm_forward(a->ln2, a->ln2_mean, a->ln2_rstd, a->res2, w->ln2_w, w->ln2_b, N, C);
    td_ops_matmul_forward(a->fch, a->ln2, w->fc_w, w->fc_b, N, C, 4 * C);          // (N,4C)
    td_ops_gelu_forward(a->fch_gelu, a->fch, (size_t)N * 4 * C);
    if (!y) return; /* a recompute: the acts only */
    td_ops_matmul_forward(y, a->fch_gelu, w->fcproj_w, w->fcproj_b, N, 4 * C, C);  // mlp branch
    td_ops_residual_forward(y, y, a->res2, (size_t)N * C);                         // res2 + branch
}

void td_model_block_backward(const td_model_desc *cfg, const td_model_block *w,
                               const td_model_block *g, const td_model_block_acts *a,
                               const float *x, const float *dy, float *dx, float *scratch,
                               int B, int T)
{
    if (!is_gpt2(cfg)) { llama_block_backward(cfg, w, g, a, x, dy, dx, scratch, B, T); return; }
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

/* --- the head -------------------------------------------------------------- */

void td_model_head_forward(const td_model_desc *cfg, float *logits, float *lnf, float *lnf_mean,
                             float *lnf_rstd, const float *x, const float *const *head, int N)
{
    const int C = cfg->n_embd, Vp = cfg->padded_vocab_size;
    if (is_gpt2(cfg)) {
        td_ops_head_forward(logits, lnf, lnf_mean, lnf_rstd, x, head[0], head[1], head[2], N, C, Vp);
        return;
    }
    td_ops_rmsnorm_forward(lnf, lnf_rstd, x, head[0], N, C, td_model_norm_eps(cfg)); // (N,C)
    td_ops_matmul_forward(logits, lnf, head[1], NULL, N, C, Vp);                       // (N,Vp)
}

void td_model_head_backward(const td_model_desc *cfg, float *dx, float *const *ghead, float *dlnf,
                              const float *dlogits, const float *x, const float *lnf, const float *lnf_mean,
                              const float *lnf_rstd, const float *const *head, int N)
{
    const int C = cfg->n_embd, Vp = cfg->padded_vocab_size;
    if (is_gpt2(cfg)) {
        td_ops_head_backward(dx, ghead[0], ghead[1], ghead[2], dlnf, dlogits, x, lnf, lnf_mean, lnf_rstd, head[0],
                             head[2], N, C, Vp);
        return;
    }
    zero(dlnf, (size_t)N * C);
    td_ops_matmul_backward(dlnf, ghead[1], NULL, dlogits, lnf, head[1], N, C, Vp);
    td_ops_rmsnorm_backward(dx, ghead[0], dlnf, x, head[0], lnf_rstd, N, C);
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
    const int L = cfg->n_layer, C = cfg->n_embd, N = B * T;
    const acts_layout l = layout_of(cfg, B, T);
    int hi[3];
    const float *head[3];
    for (int k = 0, nh = td_model_head_tensors(cfg, hi); k < nh; k++) head[k] = params + offset_of(cfg, hi[k]);

    td_ops_encoder_forward(stream_at(&l, acts, 0), tokens, params + offset_of(cfg, 0),
                           is_gpt2(cfg) ? params + offset_of(cfg, 1) : NULL, B, T, C);
    for (int layer = 0; layer < L; layer++) {
        td_model_block w;
        td_model_block_acts a;
        block_views(cfg, params, layer, &w);
        td_model_block_acts_view(cfg, B, T, stream_at(&l, acts, layer) + l.stream, &a);
        td_model_block_forward(cfg, &w, &a, stream_at(&l, acts, layer),
                                 stream_at(&l, acts, layer + 1), B, T);
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
                                  block_scratch, B, T);
        float *tmp = dcur;
        dcur = dnext;
        dnext = tmp;
    }
    td_ops_encoder_backward(grads, is_gpt2(cfg) ? grads + offset_of(cfg, 1) : NULL, dcur, tokens, B, T, C);
    return TD_OK;
}
