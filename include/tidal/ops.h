/* GPT-2 reference ops on the CPU: fp32, forward and backward, OpenMP.
 *
 * These are the readable oracle for the CUDA ops (every CUDA op is tested
 * against its counterpart here) and the compute of the cpu backend.  They are
 * written to be read first and to be fast enough to train a small model
 * second: the matmul is blocked and vectorised, the rest are plain loops.
 *
 * Shape letters, used in every comment below:
 *   B  batch size             T   sequence length (<= maxT, the rows of wpe)
 *   C  channels (width)       NH  attention heads, hs = C / NH head size
 *   N  rows = B * T           OC  output channels of a matmul
 *   V  vocabulary             Vp  padded vocabulary (>= V): rows of wte and
 *                                 columns of the logits; columns >= V are ignored
 * All tensors are dense, row-major, fp32.  Token and target ids are int.
 *
 * Packed sequences.  The ops that depend on a token's position (the learned
 * position embedding, RoPE, attention) take pos (B,T) int: each token's
 * position in its document, 0 at the document's first token, so that one
 * row of T tokens can hold several documents.  Token t of row b is in the
 * document that starts at t - pos[b,t]; its position term is that of
 * pos[b,t], and attention reads keys t2 with t - pos[b,t] <= t2 <= t only
 * (never another document's).  Documents are contiguous: pos[b,0] = 0 and
 * pos[b,t] is 0 or pos[b,t-1] + 1 (the caller's to check).  pos NULL is one
 * document per row, pos[b,t] = t.
 *
 * Conventions:
 *   - A forward writes its outputs (overwrites); a backward ADDS into every
 *     gradient it produces (input and parameter gradients alike), so the
 *     caller zeroes gradients once and branches of the residual stream and
 *     micro-batches accumulate.  The one exception is
 *     td_ops_crossentropy_backward, which writes dlogits (in place allowed).
 *   - Outputs must not alias inputs unless a function says so.
 *   - Deterministic: every output element, including the parameter-gradient
 *     reductions over rows, is computed by exactly one thread in a fixed
 *     order, so results are bit-identical for any OpenMP thread count (and, for
 *     the matmul, for every instruction-set variant: no FMA contraction, the
 *     same summation order).  docs/model.md describes each op's order.
 *   - Preconditions (token ids in [0, Vp), targets in [0, V) or negative,
 *     T <= maxT, C % NH == 0) are the caller's to check; the whole-model
 *     functions of model_ref.h check them and return errors.
 * Thread-safety: every function is reentrant and runs its own OpenMP
 * parallel loop (called from inside a parallel region, the matmul runs
 * serially).  Nothing allocates: the matmul and attention use at most about
 * 100 KiB of stack per thread. */
#ifndef TIDAL_OPS_H
#define TIDAL_OPS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A target below zero (conventionally this value) is ignored by the loss. */
#define TD_OPS_IGNORE_INDEX (-1)
/* LayerNorm epsilon (GPT-2). */
#define TD_OPS_LN_EPS 1e-5f

/* --- embedding ------------------------------------------------------------ */

/* out (B,T,C) = wte[tokens[b,t]] (Vp,C) + wpe[pos[b,t]] (maxT,C); wpe NULL
 * (rotary models): no position term. */
void td_ops_encoder_forward(float *out, const int *tokens, const int *pos, const float *wte, const float *wpe,
                            int B, int T, int C);
/* dwte[tokens[b,t]] += dout[b,t]; dwpe[pos[b,t]] += dout[b,t] (dwpe may be NULL). */
void td_ops_encoder_backward(float *dwte, float *dwpe, const float *dout, const int *tokens, const int *pos,
                             int B, int T, int C);

/* --- LayerNorm ------------------------------------------------------------ */

/* Per row of inp (N,C): out = (inp - mean) * rstd * weight (C) + bias (C),
 * rstd = 1 / sqrt(var + 1e-5) with the biased variance.  Saves mean, rstd (N). */
void td_ops_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                              const float *weight, const float *bias, int N, int C);
/* dinp (N,C), dweight (C), dbias (C) += from dout (N,C). */
void td_ops_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                               const float *inp, const float *weight, const float *mean,
                               const float *rstd, int N, int C);

/* --- matmul --------------------------------------------------------------- */

/* out (N,OC) = inp (N,C) @ weight (OC,C)^T + bias (OC); bias may be NULL. */
void td_ops_matmul_forward(float *out, const float *inp, const float *weight, const float *bias,
                           int N, int C, int OC);
/* dinp (N,C) += dout (N,OC) @ weight;  dweight (OC,C) += dout^T @ inp;
 * dbias (OC) += column sums of dout.  dinp and dbias may be NULL (skipped). */
void td_ops_matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                            const float *inp, const float *weight, int N, int C, int OC);
/* The instruction set the matmul runs with here: "avx512", "avx2" or "generic". */
const char *td_ops_matmul_isa(void);

/* --- attention ------------------------------------------------------------ */

/* Causal multi-head self-attention.  qkv (B,T,3C) holds q, k, v side by side,
 * head h in channels [h*hs, (h+1)*hs) of each.  out (B,T,C), heads side by side:
 *   out[b,t,h] = sum_{t2<=t} softmax_t2(q[t].k[t2] / sqrt(hs)) v[t2].
 * One document per row (the gqa calls below take packed rows).
 * Saves lse (B,NH,T), the log-sum-exp of each row of scaled scores; backward
 * recomputes the attention weights from it instead of keeping (B,NH,T,T). */
void td_ops_attention_forward(float *out, float *lse, const float *qkv, int B, int T, int C,
                              int NH);
/* dqkv (B,T,3C) += from dout (B,T,C); needs the forward's out and lse. */
void td_ops_attention_backward(float *dqkv, const float *dout, const float *qkv,
                               const float *out, const float *lse, int B, int T, int C, int NH);

/* Grouped-query attention: NKV key/value heads (NH % NKV == 0), query head h
 * reading key/value head h / (NH / NKV); head size hs.  qkv (B,T,(NH+2 NKV) hs)
 * holds the NH query heads, then the NKV key heads, then the NKV value heads;
 * out (B,T,NH hs), lse (B,NH,T).  pos (B,T) or NULL: the rows' documents
 * (above); the sum runs over t - pos[b,t] <= t2 <= t.  NKV = NH, pos NULL is
 * td_ops_attention_forward. */
void td_ops_attention_gqa_forward(float *out, float *lse, const float *qkv, const int *pos, int B, int T, int NH,
                                  int NKV, int hs);
void td_ops_attention_gqa_backward(float *dqkv, const float *dout, const float *qkv, const float *out,
                                   const float *lse, const int *pos, int B, int T, int NH, int NKV, int hs);

/* --- pointwise ------------------------------------------------------------ */

/* out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), n elements. */
void td_ops_gelu_forward(float *out, const float *inp, size_t n);
/* dinp += gelu'(inp) * dout. */
void td_ops_gelu_backward(float *dinp, const float *inp, const float *dout, size_t n);
/* out = a + b; out may alias a or b. */
void td_ops_residual_forward(float *out, const float *a, const float *b, size_t n);
/* da += dout; db += dout. */
void td_ops_residual_backward(float *da, float *db, const float *dout, size_t n);

/* out = s * inp, n elements; out may be inp (Gemma's embedding scale). */
void td_ops_scale(float *out, const float *inp, float s, size_t n);

/* --- the rotary decoder's ops (RMSNorm, gated MLP, RoPE) -------------------- */

/* Per row of inp (N,C): out = inp * rstd * (w_offset + weight) (C), rstd = 1 /
 * sqrt(mean(inp^2) + eps), the mean and the product in fp32 as transformers'
 * LlamaRMSNorm (w_offset 0) and GemmaRMSNorm (w_offset 1: the gain 1 + w)
 * do (in the input's dtype, fp32 here).  Saves rstd (N). */
void td_ops_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight, float w_offset, int N,
                            int C, float eps);
/* dinp (N,C), dweight (C) += from dout (N,C). */
void td_ops_rmsnorm_backward(float *dinp, float *dweight, const float *dout, const float *inp,
                             const float *weight, float w_offset, const float *rstd, int N, int C);

/* The gated MLP's activation of the gate. */
typedef enum td_ops_glu {
    TD_OPS_GLU_SILU,      /* SwiGLU: silu(x) = x / (1 + exp(-x)) (LLaMA, Qwen2) */
    TD_OPS_GLU_GELU_TANH, /* GeGLU: GELU's tanh approximation, as td_ops_gelu_forward (Gemma) */
} td_ops_glu;

/* gate_up (N,2H): the gate projection in columns [0,H), the up projection in
 * [H,2H) (one matmul computes both); out (N,H) = act(gate) * up. */
void td_ops_glu_forward(float *out, const float *gate_up, int N, int H, td_ops_glu act);
/* dgate_up (N,2H) += from dout (N,H). */
void td_ops_glu_backward(float *dgate_up, const float *dout, const float *gate_up, int N, int H, td_ops_glu act);

/* Rotary position embedding's frequencies, transformers' layout: inv_freq[i]
 * = theta^(-2i/hs) for i < hs/2, then rope_scaling of type llama3 when factor
 * > 0 (Llama 3.1/3.2: wavelengths above original_max_positions / low_freq_factor
 * divided by factor, below original_max_positions / high_freq_factor kept,
 * smoothly between). */
typedef struct td_rope_scaling {
    float factor;                  /* 0: none */
    float low_freq_factor, high_freq_factor;
    int original_max_positions;
} td_rope_scaling;
void td_ops_rope_inv_freq(float *inv_freq, int hs, float theta, const td_rope_scaling *scaling);
/* In place on heads of hs channels at x (B,T, heads*hs) with rows `stride`
 * floats apart, the token at [b,t] rotated by p * inv_freq, p = pos[b,t]
 * (pos NULL: p = t), in the rotate-half layout (transformers'
 * apply_rotary_pos_emb): for i < hs/2,
 *   x'[i] = x[i] cos - x[i + hs/2] sin,  x'[i + hs/2] = x[i + hs/2] cos + x[i] sin. */
void td_ops_rope_forward(float *x, const float *inv_freq, const int *pos, int B, int T, int heads, int hs,
                         size_t stride);
/* The gradient through it: the inverse rotation, in place on dx. */
void td_ops_rope_backward(float *dx, const float *inv_freq, const int *pos, int B, int T, int heads, int hs,
                          size_t stride);

/* --- softmax and loss ----------------------------------------------------- */

/* probs (N,Vp) = softmax over the first V columns of logits (N,Vp); columns >= V get 0. */
void td_ops_softmax_forward(float *probs, const float *logits, int N, int V, int Vp);
/* Fused softmax cross-entropy.  losses (N) = lse - logits[n, targets[n]] with
 * lse (N) = log sum_{v<V} exp(logits[n,v]) saved; a row whose target is
 * negative is ignored (loss 0).  Columns >= V never take part. */
void td_ops_crossentropy_forward(float *losses, float *lse, const float *logits,
                                 const int *targets, int N, int V, int Vp);
/* dlogits (N,Vp) = dloss * (softmax(logits) - onehot(target)) for each kept
 * row: the gradient of dloss * sum_n losses[n].  Ignored rows and columns >= V
 * get 0.  WRITES dlogits (no accumulation); dlogits may be logits itself. */
void td_ops_crossentropy_backward(float *dlogits, const float *logits, const float *lse,
                                  const int *targets, float dloss, int N, int V, int Vp);

/* --- the head ------------------------------------------------------------- */

/* lnf (N,C) = LayerNorm(x; lnf_w, lnf_b) saving lnf_mean, lnf_rstd (N);
 * logits (N,Vp) = lnf @ wte^T (the input embedding, tied). */
void td_ops_head_forward(float *logits, float *lnf, float *lnf_mean, float *lnf_rstd,
                         const float *x, const float *lnf_w, const float *lnf_b, const float *wte,
                         int N, int C, int Vp);
/* From dlogits (N,Vp): dwte (Vp,C), dlnf_w, dlnf_b (C), dx (N,C) +=.
 * dlnf (N,C) is scratch, overwritten. */
void td_ops_head_backward(float *dx, float *dlnf_w, float *dlnf_b, float *dwte, float *dlnf,
                          const float *dlogits, const float *x, const float *lnf,
                          const float *lnf_mean, const float *lnf_rstd, const float *lnf_w,
                          const float *wte, int N, int C, int Vp);

#ifdef __cplusplus
}
#endif
#endif
