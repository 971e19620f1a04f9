/* The model composed from the CPU reference ops (ops.h): the description of
 * a model (td_model_desc, also spelt td_model_desc: GPT-2, LLaMA or
 * Qwen2), its parameter layout (a size table over one flat fp32 buffer),
 * initialisation, and forward/backward per block and for the whole model.
 * The name is historical: GPT-2 came first and is the case of the
 * description whose family fields are all zero.
 *
 * GPT-2 (family TD_MODEL_GPT2): token + learned position embedding; L
 * pre-LayerNorm blocks
 *   x = x + attn_proj(attention(qkv(ln_1(x))));  x = x + fc_proj(gelu(fc(ln_2(x))))
 * with causal attention scaled by 1/sqrt(hs), GELU tanh approximation, MLP 4C;
 * final LayerNorm and a head tied to the token embedding, logits = ln_f(x) @ wte^T;
 * mean cross-entropy over the targets that are not negative.
 *
 * LLaMA and Qwen2 (TD_MODEL_LLAMA, TD_MODEL_QWEN2): token embedding only; L
 * pre-RMSNorm blocks
 *   x = x + o_proj(gqa_attention(rope(qkv_proj(rmsnorm_1(x)))));
 *   x = x + down_proj(silu(gate) * up),  (gate | up) = gate_up_proj(rmsnorm_2(x))
 * with NKV key/value heads (grouped-query attention), rotary embeddings on q
 * and k (theta, optional llama3 scaling), q/k/v biases for Qwen2 and no other
 * bias; final RMSNorm and a head tied to the embedding or its own lm_head.
 * tidal fuses q|k|v into one (QKV, C) weight, QKV = (NH + 2 NKV) hs, and
 * gate|up into one (2H, C) weight; checkpoints split them into the Hugging
 * Face tensors (td_model_hf_get).
 *
 * Layout: wte (Vp,C), [wpe (maxT,C)], then block 0 .. L-1 each as its
 * tensors in the order of td_model_param (GPT-2: 12; LLaMA 6, Qwen2 7),
 * then the final norm's weight [and bias] [and lm_head (Vp,C)].  A block's
 * tensors are contiguous (td_model_block_span), so a block can be one chunk.
 * Weights are (out, in), as in PyTorch nn.Linear; Hugging Face's GPT-2 keeps
 * c_attn / c_proj / c_fc as Conv1D, (in, out): the table says which to
 * transpose.  wte (and lm_head) has Vp rows here, HF's has V: rows >= V are
 * padding (init 0, gradient always 0).
 *
 * Two levels of use:
 *   - whole model over flat buffers (tests, simple trainers):
 *       td_model_forward / td_model_backward with params, grads, acts and
 *       scratch buffers sized by the *_numel functions;
 *   - one block at a time (the offloading step loop, which holds a block's
 *     params wherever its chunk lives and may recompute a block's activations
 *     from its input, i.e. activation checkpointing):
 *       td_model_block_forward / td_model_block_backward over views.
 *
 * Ownership: the caller owns every buffer; nothing here allocates.
 * Thread-safety: reentrant; each op runs its own OpenMP region.
 * Determinism: bit-identical results for any thread count (see ops.h). */
#ifndef TIDAL_MODEL_REF_H
#define TIDAL_MODEL_REF_H

#include <stddef.h>
#include <stdint.h>

#include "tidal/ops.h"
#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The largest head size the rotary embedding takes (its frequencies live on the stack). */
#define TD_MODEL_MAX_HEAD_SIZE 1024

typedef enum td_model_family { TD_MODEL_GPT2, TD_MODEL_LLAMA, TD_MODEL_QWEN2, TD_MODEL_FAMILY_COUNT } td_model_family;
typedef enum td_model_norm { TD_MODEL_NORM_LAYER, TD_MODEL_NORM_RMS } td_model_norm;
typedef enum td_model_act { TD_MODEL_ACT_GELU, TD_MODEL_ACT_SWIGLU } td_model_act;
typedef enum td_model_pos { TD_MODEL_POS_LEARNED, TD_MODEL_POS_ROPE } td_model_pos;

/* The model's description.  All-zero family fields describe GPT-2, so a
 * GPT-2 configuration needs only the first six. */
typedef struct td_model_desc {
    int n_layer;           /* L */
    int n_head;            /* NH; n_embd must be a multiple of it */
    int n_embd;            /* C */
    int n_positions;       /* maxT: the longest sequence (GPT-2: rows of wpe) */
    int vocab_size;        /* V */
    int padded_vocab_size; /* Vp >= V: rows of wte, columns of the logits */
    /* The block's make-up.  GPT-2 is LayerNorm, GELU, learned positions,
     * biases everywhere, tied head; LLaMA and Qwen2 are RMSNorm, SwiGLU, RoPE
     * (td_model_desc_check refuses other combinations). */
    td_model_family family;
    td_model_norm norm;
    td_model_act act;
    td_model_pos pos;
    int n_kv_head;         /* NKV: key/value heads, dividing NH; 0: NH */
    int n_inner;           /* H: the MLP's width; 0: 4 C (GPT-2 needs 4 C) */
    float norm_eps;        /* 0: 1e-5 (GPT-2 needs 1e-5) */
    float rope_theta;      /* RoPE base (0: 10000) */
    td_rope_scaling rope_scaling; /* factor 0: none; else llama3 scaling */
    int qkv_bias;          /* LLaMA-family: q, k, v projections have biases (Qwen2) */
    int untied_head;       /* 1: its own lm_head (Vp, C); 0: logits against wte */
} td_model_desc;

/* "gpt2", "llama", "qwen2" (the Hugging Face model_type). */
const char *td_model_family_name(td_model_family f);
/* The derived sizes, defaults applied. */
int td_model_kv_heads(const td_model_desc *cfg);      /* NKV */
int td_model_head_size(const td_model_desc *cfg);     /* hs = C / NH */
int td_model_mlp_width(const td_model_desc *cfg);     /* H */
int td_model_qkv_width(const td_model_desc *cfg);     /* (NH + 2 NKV) hs */
float td_model_norm_eps(const td_model_desc *cfg);
float td_model_rope_theta(const td_model_desc *cfg);
/* The block tensors' count (12, 6 or 7) and the tensors before block 0 (2 or 1). */
int td_model_block_tensor_count(const td_model_desc *cfg);
int td_model_embed_tensor_count(const td_model_desc *cfg);
/* The tensors the head reads, as layout indices in the order head_forward
 * takes them: norm weight, [norm bias,] output matrix (wte when tied). */
int td_model_head_tensors(const td_model_desc *cfg, int idx[3]);
/* The largest single tensor inside a block (elements). */
size_t td_model_block_largest_numel(const td_model_desc *cfg);

/* TD_OK, or TD_ERR_INVALID naming the bad field. */
td_status td_model_desc_check(const td_model_desc *cfg);

/* --- parameters ----------------------------------------------------------- */

/* A tensor's role.  LLaMA-family blocks reuse the GPT-2 kinds they share:
 * LN1_W, LN2_W, LNF_W are the RMSNorm weights, QKV_W/QKV_B the fused q|k|v
 * projection, ATTPROJ_W o_proj, FC_W the fused gate|up (2H, C), FCPROJ_W
 * down_proj (C, H). */
typedef enum td_model_param {
    TD_MODEL_WTE,       /* (Vp, C)   wte.weight / model.embed_tokens.weight */
    TD_MODEL_WPE,       /* (maxT, C) wpe.weight (GPT-2 only) */
    TD_MODEL_LN1_W,     /* (C)       h.l.ln_1.weight        -- per block from here */
    TD_MODEL_LN1_B,     /* (C)       h.l.ln_1.bias */
    TD_MODEL_QKV_W,     /* (3C, C)   h.l.attn.c_attn.weight (HF: transposed); LLaMA (QKV, C) */
    TD_MODEL_QKV_B,     /* (3C)      h.l.attn.c_attn.bias; Qwen2 (QKV) */
    TD_MODEL_ATTPROJ_W, /* (C, C)    h.l.attn.c_proj.weight (HF: transposed) */
    TD_MODEL_ATTPROJ_B, /* (C)       h.l.attn.c_proj.bias */
    TD_MODEL_LN2_W,     /* (C)       h.l.ln_2.weight */
    TD_MODEL_LN2_B,     /* (C)       h.l.ln_2.bias */
    TD_MODEL_FC_W,      /* (4C, C)   h.l.mlp.c_fc.weight (HF: transposed); LLaMA (2H, C) */
    TD_MODEL_FC_B,      /* (4C)      h.l.mlp.c_fc.bias */
    TD_MODEL_FCPROJ_W,  /* (C, 4C)   h.l.mlp.c_proj.weight (HF: transposed); LLaMA (C, H) */
    TD_MODEL_FCPROJ_B,  /* (C)       h.l.mlp.c_proj.bias    -- per block to here */
    TD_MODEL_LNF_W,     /* (C)       ln_f.weight / model.norm.weight */
    TD_MODEL_LNF_B,     /* (C)       ln_f.bias */
    TD_MODEL_LM_HEAD,   /* (Vp, C)   lm_head.weight (untied heads only) */
    TD_MODEL_PARAM_COUNT
} td_model_param;

/* The most tensors a block has (GPT-2's). */
#define TD_MODEL_BLOCK_TENSORS 12

typedef struct td_model_tensor {
    td_model_param kind;
    int layer;          /* block index, -1 for the tensors outside the blocks */
    size_t offset;      /* in floats from the start of the flat buffer */
    size_t numel;
    int ndim;           /* 1 or 2 */
    int shape[2];       /* tidal's shape: weights (out, in) */
    int hf_transposed;  /* 1: Hugging Face stores it as (shape[1], shape[0]) */
    int matrix;         /* a 2-D weight (embeddings included): where weight decay goes */
    char name[64];      /* Hugging Face name without "transformer.", e.g. "h.3.attn.c_attn.weight";
                           LLaMA's fused tensors: "model.layers.3.self_attn.qkv_proj.weight",
                           "model.layers.3.mlp.gate_up_proj.weight" */
} td_model_tensor;

/* GPT-2: 4 + 12 L tensors; LLaMA 2 + 6 L (+1 untied); Qwen2 2 + 7 L (+1), in layout order. */
int td_model_tensor_count(const td_model_desc *cfg);
/* The index-th tensor of the layout (0 <= index < count). */
void td_model_tensor_get(const td_model_desc *cfg, int index, td_model_tensor *out);
size_t td_model_params_numel(const td_model_desc *cfg);
/* Block `layer`'s 12 tensors span floats [offset, offset + numel). */
void td_model_block_span(const td_model_desc *cfg, int layer, size_t *offset, size_t *numel);

/* Initialisation of tensor `index` into dst (its numel floats): weights
 * N(0, 0.02) (GPT-2: the two residual projections N(0, 0.02 / sqrt(2 L))),
 * norm weights 1, biases 0, wte and lm_head rows >= V zero.  Each tensor draws from its own
 * stream seeded by (seed, index), so tensors can be initialised in any order,
 * wherever they live, with the same result. */
void td_model_init_tensor(const td_model_desc *cfg, int index, float *dst, uint64_t seed);
/* All tensors into a flat buffer of td_model_params_numel floats. */
void td_model_init(const td_model_desc *cfg, float *params, uint64_t seed);

/* One block's tensors (params or their gradients), in td_model_param
 * order; a LLaMA-family block leaves the ones it lacks NULL. */
typedef struct td_model_block {
    float *ln1_w, *ln1_b, *qkv_w, *qkv_b, *attproj_w, *attproj_b;
    float *ln2_w, *ln2_b, *fc_w, *fc_b, *fcproj_w, *fcproj_b;
} td_model_block;

/* Points `out` into a block's span (block_base = flat + the span's offset). */
void td_model_block_view(const td_model_desc *cfg, float *block_base, td_model_block *out);
/* The same from the block's tensors one by one (p[k]: its k-th tensor in layout order). */
void td_model_block_from(const td_model_desc *cfg, void *const *p, td_model_block *out);

/* --- one block ------------------------------------------------------------ */

/* What a block's forward keeps for its backward (N = B*T rows).  LLaMA:
 * no means (RMSNorm), qkv (N,QKV) after RoPE, fch the gate|up (N,2H),
 * fch_gelu silu(gate) * up (N,H). */
typedef struct td_model_block_acts {
    float *ln1, *ln1_mean, *ln1_rstd; /* (N,C), (N), (N) */
    float *qkv;                       /* (N,3C) */
    float *atty;                      /* (N,C) attention output, heads side by side */
    float *att_lse;                   /* (B,NH,T) */
    float *res2;                      /* (N,C) x + attention branch */
    float *ln2, *ln2_mean, *ln2_rstd; /* (N,C), (N), (N) */
    float *fch, *fch_gelu;            /* (N,4C), (N,4C) */
} td_model_block_acts;

/* GPT-2: 15 C + 4 + NH floats per token; LLaMA: 4 C + QKV + 3 H + NH + 2. */
size_t td_model_block_acts_numel(const td_model_desc *cfg, int B, int T);
void td_model_block_acts_view(const td_model_desc *cfg, int B, int T, float *base,
                                td_model_block_acts *out);
/* Scratch for one block's backward: GPT-2 10 C floats per token; LLaMA
 * max(2H, QKV) + H + 2 C. */
size_t td_model_block_scratch_numel(const td_model_desc *cfg, int B, int T);

/* y (B,T,C) = block(x (B,T,C)), filling acts.  y must not alias x: backward needs x.
 * y NULL: the acts only, as a checkpointed block's recompute needs them (the
 * last projection, whose output nothing of backward reads, is skipped). */
void td_model_block_forward(const td_model_desc *cfg, const td_model_block *w,
                              const td_model_block_acts *acts, const float *x, float *y,
                              int B, int T);
/* From dy (B,T,C): dx (B,T,C) += d/dx, and every tensor of g +=.  Needs the x
 * and acts of the matching forward; scratch of td_model_block_scratch_numel. */
void td_model_block_backward(const td_model_desc *cfg, const td_model_block *w,
                               const td_model_block *g, const td_model_block_acts *acts,
                               const float *x, const float *dy, float *dx, float *scratch,
                               int B, int T);

/* --- the head ---------------------------------------------------------------- */

/* lnf (N,C) = the final norm of x (saving lnf_mean (GPT-2) and lnf_rstd (N));
 * logits (N,Vp) = lnf @ out^T.  head: the tensors of td_model_head_tensors. */
void td_model_head_forward(const td_model_desc *cfg, float *logits, float *lnf, float *lnf_mean,
                             float *lnf_rstd, const float *x, const float *const *head, int N);
/* From dlogits (N,Vp): dx (N,C) and ghead +=; dlnf (N,C) scratch. */
void td_model_head_backward(const td_model_desc *cfg, float *dx, float *const *ghead, float *dlnf,
                              const float *dlogits, const float *x, const float *lnf, const float *lnf_mean,
                              const float *lnf_rstd, const float *const *head, int N);

/* --- the whole model over flat buffers ------------------------------------ */

/* TD_OK, or TD_ERR_INVALID naming the bad size, token or target: needs
 * B >= 1, 1 <= T <= maxT, tokens in [0, V), targets (if not NULL) in [0, V)
 * or negative (ignored). */
td_status td_model_check_batch(const td_model_desc *cfg, const int *tokens,
                                 const int *targets, int B, int T);

/* Everything forward keeps: the L+1 residual streams, every block's acts, the
 * head's LayerNorm, logits (B,T,Vp), per-token losses and log-sum-exps. */
size_t td_model_acts_numel(const td_model_desc *cfg, int B, int T);
/* Scratch for backward: two residual-gradient buffers and one block's scratch. */
size_t td_model_scratch_numel(const td_model_desc *cfg, int B, int T);
/* The logits (B,T,Vp) and per-token losses (B,T) inside acts. */
float *td_model_logits(const td_model_desc *cfg, int B, int T, float *acts);
float *td_model_losses(const td_model_desc *cfg, int B, int T, float *acts);

/* Forward over tokens (B,T).  With targets (B,T): *loss = mean cross-entropy
 * over the non-negative targets (0 if none) and *n_targets their count
 * (either pointer may be NULL).  With targets NULL: logits only. */
td_status td_model_forward(const td_model_desc *cfg, const float *params, const int *tokens,
                             const int *targets, int B, int T, float *acts, float *loss,
                             int *n_targets);
/* grads (flat, like params) += the gradient of dloss * sum of the per-token
 * losses; dloss = 1 / n_targets gives the gradient of forward's mean loss.
 * Needs the acts of the forward just run with the same tokens and targets;
 * overwrites the logits in acts with their gradient. */
td_status td_model_backward(const td_model_desc *cfg, const float *params, float *grads,
                              const int *tokens, const int *targets, float dloss, int B, int T,
                              float *acts, float *scratch);

#ifdef __cplusplus
}
#endif
#endif
