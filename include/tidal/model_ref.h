/* The reference model on the CPU: a model of any family (model.h,
 * family.h) composed from the CPU reference ops (ops.h), fp32, over
 * caller-owned buffers: the oracle for the CUDA ops and the compute of the
 * cpu backend.
 *
 * Two levels of use:
 *   - the whole model over flat buffers (tests, simple trainers):
 *       td_model_forward / td_model_backward with params, grads, acts and
 *       scratch buffers sized by the *_numel functions;
 *   - one block at a time (the offloading step loop, which holds a block's
 *     params wherever its chunk lives and may recompute a block's
 *     activations from its input, i.e. activation checkpointing):
 *       td_model_block_forward / td_model_block_backward over views,
 *       td_model_embed_* and td_model_head_*.
 * Each call runs the family's CPU reference (family.h, td_model_cpu).
 *
 * The forward keeps every activation a block's backward needs; the
 * backward runs the residual-stream gradient through two ping-pong
 * buffers, block by block in reverse.
 *
 * Ownership: the caller owns every buffer; nothing here allocates.
 * Thread-safety: reentrant; each op runs its own OpenMP region.
 * Determinism: bit-identical results for any thread count (see ops.h). */
#ifndef TIDAL_MODEL_REF_H
#define TIDAL_MODEL_REF_H

#include <stddef.h>
#include <stdint.h>

#include "tidal/model.h"
#include "tidal/ops.h"
#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* --- one block ------------------------------------------------------------ */

/* What a block's forward keeps for its backward (N = B*T rows), carved by
 * the family (td_model_block_acts_view); a field it does not keep is NULL.
 * GPT-2: every field, qkv (N,3C), fch and fch_gelu (N,4C).  The rotary
 * decoder (LLaMA, Qwen2, Gemma): no means (RMSNorm), qkv (N,QKV) after
 * RoPE, atty (N,NH hs), fch the gate|up (N,2H), fch_gelu act(gate) * up (N,H). */
typedef struct td_model_block_acts {
    float *ln1, *ln1_mean, *ln1_rstd; /* (N,C), (N), (N) */
    float *qkv;                       /* (N,QKV) */
    float *atty;                      /* (N,NH hs) attention output, heads side by side */
    float *att_lse;                   /* (B,NH,T) */
    float *res2;                      /* (N,C) x + attention branch */
    float *ln2, *ln2_mean, *ln2_rstd; /* (N,C), (N), (N) */
    float *fch, *fch_gelu;            /* the MLP's first product and its activation */
    /* LoRA (model.h): drop(x) A^T of each target j at lora_xa + j N R, and
     * (N,R) scratch for the backward; NULL without LoRA */
    float *lora_xa, *lora_dxa;
    /* LoRA dropout (model.h): this call's key, NULL for none (eval,
     * inference, a dropout of 0), and with it scratch for a dropped input
     * (N, the widest target's in: td_model_lora_drop_numel floats), which
     * the caller gives (the exec: after the block's backward scratch). */
    const td_model_lora_drop *lora_drop;
    float *lora_xd;
} td_model_block_acts;

/* Floats of lora_xd above: N times the widest targeted input when the
 * model's LoRA dropout is above 0, else 0. */
size_t td_model_lora_drop_numel(const td_model_desc *cfg, int B, int T);

/* One block's acts (floats), and the view of them at base. */
size_t td_model_block_acts_numel(const td_model_desc *cfg, int B, int T);
void td_model_block_acts_view(const td_model_desc *cfg, int B, int T, float *base,
                                td_model_block_acts *out);
/* Scratch for one block's backward, and for the head's backward (its dlnf). */
size_t td_model_block_scratch_numel(const td_model_desc *cfg, int B, int T);

/* y (B,T,C) = block(x (B,T,C)), filling acts.  y must not alias x: backward needs x.
 * y NULL: the acts only, as a checkpointed block's recompute needs them (the
 * last projection, whose output nothing of backward reads, is skipped).
 * pos (B,T) or NULL: the documents packed in each row (ops.h); RoPE and
 * attention follow them. */
void td_model_block_forward(const td_model_desc *cfg, const td_model_block *w,
                              const td_model_block_acts *acts, const float *x, float *y,
                              const int *pos, int B, int T);
/* From dy (B,T,C): dx (B,T,C) += d/dx, and every tensor of g +=.  Needs the x
 * and acts of the matching forward; scratch of td_model_block_scratch_numel. */
void td_model_block_backward(const td_model_desc *cfg, const td_model_block *w,
                               const td_model_block *g, const td_model_block_acts *acts,
                               const float *x, const float *dy, float *dx, float *scratch,
                               const int *pos, int B, int T);

/* --- the embedding and the head ---------------------------------------------- */

/* out (B,T,C) = the embedding of tokens (B,T); emb: the embedding's tensors
 * in layout order (wte [, wpe]).  pos (B,T) or NULL: each token's position
 * in its packed document (ops.h), what a learned position table reads. */
void td_model_embed_forward(const td_model_desc *cfg, float *out, const int *tokens, const int *pos,
                            const float *const *emb, int B, int T);
/* gemb += its gradient from dout (B,T,C). */
void td_model_embed_backward(const td_model_desc *cfg, float *const *gemb, const float *dout, const int *tokens,
                             const int *pos, int B, int T);

/* lnf (N,C) = the final norm of x (saving lnf_mean (LayerNorm) and lnf_rstd (N));
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
