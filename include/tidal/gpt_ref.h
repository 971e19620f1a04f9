/* The GPT-2 model composed from the CPU reference ops (ops.h): the parameter
 * layout (a size table over one flat fp32 buffer), initialisation, and
 * forward/backward per block and for the whole model.
 *
 * Model: token + learned position embedding; L pre-LayerNorm blocks
 *   x = x + attn_proj(attention(qkv(ln_1(x))));  x = x + fc_proj(gelu(fc(ln_2(x))))
 * with causal attention scaled by 1/sqrt(hs), GELU tanh approximation, MLP 4C;
 * final LayerNorm and a head tied to the token embedding, logits = ln_f(x) @ wte^T;
 * mean cross-entropy over the targets that are not negative.
 *
 * Layout: wte (Vp,C), wpe (maxT,C), then block 0 .. L-1 each as 12 tensors in
 * the order of td_gpt_ref_param, then ln_f weight and bias.  A block's tensors
 * are contiguous (td_gpt_ref_block_span), so a block can be one chunk.
 * Weights are (out, in), as in PyTorch nn.Linear; Hugging Face's GPT-2 keeps
 * c_attn / c_proj / c_fc as Conv1D, (in, out): the table says which to
 * transpose.  wte has Vp rows here, HF's has V: rows >= V are padding (init 0,
 * gradient always 0).
 *
 * Two levels of use:
 *   - whole model over flat buffers (tests, simple trainers):
 *       td_gpt_ref_forward / td_gpt_ref_backward with params, grads, acts and
 *       scratch buffers sized by the *_numel functions;
 *   - one block at a time (the offloading step loop, which holds a block's
 *     params wherever its chunk lives and may recompute a block's activations
 *     from its input, i.e. activation checkpointing):
 *       td_gpt_ref_block_forward / td_gpt_ref_block_backward over views.
 *
 * Ownership: the caller owns every buffer; nothing here allocates.
 * Thread-safety: reentrant; each op runs its own OpenMP region.
 * Determinism: bit-identical results for any thread count (see ops.h). */
#ifndef TIDAL_GPT_REF_H
#define TIDAL_GPT_REF_H

#include <stddef.h>
#include <stdint.h>

#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_gpt_ref_config {
    int n_layer;           /* L */
    int n_head;            /* NH; n_embd must be a multiple of it */
    int n_embd;            /* C */
    int n_positions;       /* maxT: rows of wpe, the longest sequence */
    int vocab_size;        /* V */
    int padded_vocab_size; /* Vp >= V: rows of wte, columns of the logits */
} td_gpt_ref_config;

/* TD_OK, or TD_ERR_INVALID naming the bad field. */
td_status td_gpt_ref_config_check(const td_gpt_ref_config *cfg);

/* --- parameters ----------------------------------------------------------- */

typedef enum td_gpt_ref_param {
    TD_GPT_REF_WTE,       /* (Vp, C)   wte.weight */
    TD_GPT_REF_WPE,       /* (maxT, C) wpe.weight */
    TD_GPT_REF_LN1_W,     /* (C)       h.l.ln_1.weight        -- per block from here */
    TD_GPT_REF_LN1_B,     /* (C)       h.l.ln_1.bias */
    TD_GPT_REF_QKV_W,     /* (3C, C)   h.l.attn.c_attn.weight (HF: transposed) */
    TD_GPT_REF_QKV_B,     /* (3C)      h.l.attn.c_attn.bias */
    TD_GPT_REF_ATTPROJ_W, /* (C, C)    h.l.attn.c_proj.weight (HF: transposed) */
    TD_GPT_REF_ATTPROJ_B, /* (C)       h.l.attn.c_proj.bias */
    TD_GPT_REF_LN2_W,     /* (C)       h.l.ln_2.weight */
    TD_GPT_REF_LN2_B,     /* (C)       h.l.ln_2.bias */
    TD_GPT_REF_FC_W,      /* (4C, C)   h.l.mlp.c_fc.weight (HF: transposed) */
    TD_GPT_REF_FC_B,      /* (4C)      h.l.mlp.c_fc.bias */
    TD_GPT_REF_FCPROJ_W,  /* (C, 4C)   h.l.mlp.c_proj.weight (HF: transposed) */
    TD_GPT_REF_FCPROJ_B,  /* (C)       h.l.mlp.c_proj.bias    -- per block to here */
    TD_GPT_REF_LNF_W,     /* (C)       ln_f.weight */
    TD_GPT_REF_LNF_B,     /* (C)       ln_f.bias */
    TD_GPT_REF_PARAM_COUNT
} td_gpt_ref_param;

#define TD_GPT_REF_BLOCK_TENSORS 12

typedef struct td_gpt_ref_tensor {
    td_gpt_ref_param kind;
    int layer;          /* block index, -1 for the tensors outside the blocks */
    size_t offset;      /* in floats from the start of the flat buffer */
    size_t numel;
    int ndim;           /* 1 or 2 */
    int shape[2];       /* tidal's shape: weights (out, in) */
    int hf_transposed;  /* 1: Hugging Face stores it as (shape[1], shape[0]) */
    char name[64];      /* Hugging Face name without "transformer.", e.g. "h.3.attn.c_attn.weight" */
} td_gpt_ref_tensor;

/* 4 + 12 L tensors, in layout order. */
int td_gpt_ref_tensor_count(const td_gpt_ref_config *cfg);
/* The index-th tensor of the layout (0 <= index < count). */
void td_gpt_ref_tensor_get(const td_gpt_ref_config *cfg, int index, td_gpt_ref_tensor *out);
size_t td_gpt_ref_params_numel(const td_gpt_ref_config *cfg);
/* Block `layer`'s 12 tensors span floats [offset, offset + numel). */
void td_gpt_ref_block_span(const td_gpt_ref_config *cfg, int layer, size_t *offset, size_t *numel);

/* GPT-2 initialisation of tensor `index` into dst (its numel floats): weights
 * N(0, 0.02), the two residual projections N(0, 0.02 / sqrt(2 L)), LayerNorm
 * weights 1, biases 0, wte rows >= V zero.  Each tensor draws from its own
 * stream seeded by (seed, index), so tensors can be initialised in any order,
 * wherever they live, with the same result. */
void td_gpt_ref_init_tensor(const td_gpt_ref_config *cfg, int index, float *dst, uint64_t seed);
/* All tensors into a flat buffer of td_gpt_ref_params_numel floats. */
void td_gpt_ref_init(const td_gpt_ref_config *cfg, float *params, uint64_t seed);

/* One block's 12 tensors (params or their gradients). */
typedef struct td_gpt_ref_block {
    float *ln1_w, *ln1_b, *qkv_w, *qkv_b, *attproj_w, *attproj_b;
    float *ln2_w, *ln2_b, *fc_w, *fc_b, *fcproj_w, *fcproj_b;
} td_gpt_ref_block;

/* Points `out` into a block's span (block_base = flat + the span's offset). */
void td_gpt_ref_block_view(const td_gpt_ref_config *cfg, float *block_base, td_gpt_ref_block *out);

/* --- one block ------------------------------------------------------------ */

/* What a block's forward keeps for its backward (N = B*T rows). */
typedef struct td_gpt_ref_block_acts {
    float *ln1, *ln1_mean, *ln1_rstd; /* (N,C), (N), (N) */
    float *qkv;                       /* (N,3C) */
    float *atty;                      /* (N,C) attention output, heads side by side */
    float *att_lse;                   /* (B,NH,T) */
    float *res2;                      /* (N,C) x + attention branch */
    float *ln2, *ln2_mean, *ln2_rstd; /* (N,C), (N), (N) */
    float *fch, *fch_gelu;            /* (N,4C), (N,4C) */
} td_gpt_ref_block_acts;

/* 15 C + 4 + NH floats per token. */
size_t td_gpt_ref_block_acts_numel(const td_gpt_ref_config *cfg, int B, int T);
void td_gpt_ref_block_acts_view(const td_gpt_ref_config *cfg, int B, int T, float *base,
                                td_gpt_ref_block_acts *out);
/* Scratch for one block's backward: 10 C floats per token. */
size_t td_gpt_ref_block_scratch_numel(const td_gpt_ref_config *cfg, int B, int T);

/* y (B,T,C) = block(x (B,T,C)), filling acts.  y must not alias x: backward needs x. */
void td_gpt_ref_block_forward(const td_gpt_ref_config *cfg, const td_gpt_ref_block *w,
                              const td_gpt_ref_block_acts *acts, const float *x, float *y,
                              int B, int T);
/* From dy (B,T,C): dx (B,T,C) += d/dx, and every tensor of g +=.  Needs the x
 * and acts of the matching forward; scratch of td_gpt_ref_block_scratch_numel. */
void td_gpt_ref_block_backward(const td_gpt_ref_config *cfg, const td_gpt_ref_block *w,
                               const td_gpt_ref_block *g, const td_gpt_ref_block_acts *acts,
                               const float *x, const float *dy, float *dx, float *scratch,
                               int B, int T);

/* --- the whole model over flat buffers ------------------------------------ */

/* TD_OK, or TD_ERR_INVALID naming the bad size, token or target: needs
 * B >= 1, 1 <= T <= maxT, tokens in [0, V), targets (if not NULL) in [0, V)
 * or negative (ignored). */
td_status td_gpt_ref_check_batch(const td_gpt_ref_config *cfg, const int *tokens,
                                 const int *targets, int B, int T);

/* Everything forward keeps: the L+1 residual streams, every block's acts, the
 * head's LayerNorm, logits (B,T,Vp), per-token losses and log-sum-exps. */
size_t td_gpt_ref_acts_numel(const td_gpt_ref_config *cfg, int B, int T);
/* Scratch for backward: two residual-gradient buffers and one block's scratch. */
size_t td_gpt_ref_scratch_numel(const td_gpt_ref_config *cfg, int B, int T);
/* The logits (B,T,Vp) and per-token losses (B,T) inside acts. */
float *td_gpt_ref_logits(const td_gpt_ref_config *cfg, int B, int T, float *acts);
float *td_gpt_ref_losses(const td_gpt_ref_config *cfg, int B, int T, float *acts);

/* Forward over tokens (B,T).  With targets (B,T): *loss = mean cross-entropy
 * over the non-negative targets (0 if none) and *n_targets their count
 * (either pointer may be NULL).  With targets NULL: logits only. */
td_status td_gpt_ref_forward(const td_gpt_ref_config *cfg, const float *params, const int *tokens,
                             const int *targets, int B, int T, float *acts, float *loss,
                             int *n_targets);
/* grads (flat, like params) += the gradient of dloss * sum of the per-token
 * losses; dloss = 1 / n_targets gives the gradient of forward's mean loss.
 * Needs the acts of the forward just run with the same tokens and targets;
 * overwrites the logits in acts with their gradient. */
td_status td_gpt_ref_backward(const td_gpt_ref_config *cfg, const float *params, float *grads,
                              const int *tokens, const int *targets, float dloss, int B, int T,
                              float *acts, float *scratch);

#ifdef __cplusplus
}
#endif
#endif
