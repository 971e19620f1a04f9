/* Transformer ops on the GPU (GPT-2's block and the rotary decoder's): CUDA kernels and
 * cuBLASLt, forward and backward.
 *
 * Each op computes the same function as its CPU reference in ops.h, with the
 * same shapes, letters (B, T, C, NH, hs, N, OC, V, Vp) and conventions, and
 * is tested against it (tests/gpu/test_ops_cuda.c):
 *   - a forward writes its outputs; a backward ADDS into every parameter
 *     gradient it produces.  Input gradients (dinp of a matmul, of GELU, of
 *     attention, dx of a block) take a td_ops_cuda_write mode: ADD is the CPU
 *     convention, SET overwrites and saves the caller a zeroing pass;
 *   - Linear weights are (out, in); the head is tied to wte;
 *   - attention saves only lse (B,NH,T) and its backward recomputes the
 *     weights; LayerNorm saves mean and rstd (N), RMSNorm rstd (N); the
 *     cross-entropy saves lse (N), ignores rows whose target is negative
 *     and columns >= V (zero gradient there), and writes dlogits (in place
 *     allowed).
 *
 * Precision.  Every tensor argument of an op has the op's storage type `dt`
 * (TD_DTYPE_F32, TD_DTYPE_BF16 or TD_DTYPE_F16) except those typed float
 * below (norm statistics, attention and loss lse, losses, RoPE's frequency
 * table: always fp32)
 * and parameter gradients, which have type `gdt`: dt itself or TD_DTYPE_F32
 * (fp32 gradients of 16-bit parameters).  Arithmetic and every reduction
 * accumulate in fp32; cuBLASLt runs with CUBLAS_COMPUTE_32F (no TF32), so an
 * fp32 op is an fp32 op.  A 16-bit value is rounded once, where it is stored.
 *
 * Memory.  Nothing here allocates device memory: cuBLASLt's workspace is
 * given once to td_ops_cuda_create, and an op that needs temporary device
 * memory takes `scratch` (256-byte aligned, e.g. from the arena) of at least
 * the bytes its *_scratch_bytes function names.  The context allocates host
 * memory once (itself, and its cache of cuBLASLt plans, filled on first use
 * of each shape: the warm-up step).
 *
 * Streams.  Every launcher takes the stream last (a cudaStream_t as void *,
 * NULL for the legacy default stream) and is asynchronous: it returns
 * TD_ERR_BACKEND if a launch or cuBLASLt call fails, TD_ERR_INVALID for bad
 * arguments (checked before anything is launched); errors inside a kernel
 * surface at the next synchronisation.  Pointers are device pointers except
 * the context and the config.  Preconditions as in ops.h (tokens in [0,Vp),
 * targets < V, T <= maxT, C % NH == 0) are the caller's.
 *
 * Packed sequences: the ops that depend on positions (encoder, RoPE,
 * attention, the blocks) take pos (B,T) int on the device, each token's
 * position in its document, or NULL for one document per row; its meaning
 * and preconditions are ops.h's.
 *
 * Determinism: no floating-point atomics; every reduction has an order fixed
 * by the shapes, so a call gives the same bits every time on the same GPU and
 * build (cuBLASLt's choice of algorithm is cached per shape in the context).
 *
 * Thread-safety: a context is used by one host thread and one stream at a
 * time (the workspace and the plan cache are shared by its calls); use one
 * context per stream.  Available only in CUDA builds (TD_HAVE_CUDA). */
#ifndef TIDAL_OPS_CUDA_H
#define TIDAL_OPS_CUDA_H

#include <stddef.h>

#include "tidal/dtype.h"
#include "tidal/model.h"
#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* --- context -------------------------------------------------------------- */

typedef struct td_ops_cuda td_ops_cuda;

/* cuBLASLt workspace that lets it pick its fastest kernels on Hopper. */
#define TD_OPS_CUDA_WORKSPACE_BYTES ((size_t)32 << 20)

typedef struct td_ops_cuda_params {
    void *workspace;        /* device memory for cuBLASLt, owned by the caller, >= 256-byte aligned */
    size_t workspace_bytes; /* 0 allowed (slower GEMM choices) */
    int fuse_gelu;          /* 16-bit matmul + GELU as one cuBLASLt epilogue (default 1) */
    int fallback_gemm;      /* 1: every GEMM on the simple fallback kernel that serves the
                               shapes cuBLASLt refuses (tests; slow) */
    int tune_gemm;          /* 1: the first calls of each GEMM shape of the linears (sm_90,
                               16-bit, not batched) time cuBLASLt's candidates that give the
                               same bits as its heuristic's first choice, and later calls take
                               the fastest; 2: also print each shape's timings to stderr
                               (default 1; the environment's TD_OPS_CUDA_GEMM_TUNE=0 or =log
                               makes it 0 or 2) */
} td_ops_cuda_params;

/* Defaults: no workspace, fuse_gelu 1, fallback_gemm 0, tune_gemm 1 (0 or 2
 * with TD_OPS_CUDA_GEMM_TUNE=0 or =log in the environment). */
td_ops_cuda_params td_ops_cuda_default_params(void);
/* Creates the cuBLASLt handle on the current device.  TD_ERR_BACKEND if
 * cuBLASLt cannot start; TD_ERR_NOMEM if the host context cannot be allocated. */
td_status td_ops_cuda_create(const td_ops_cuda_params *params, td_ops_cuda **out);
void td_ops_cuda_free(td_ops_cuda *ctx); /* NULL is a no-op; the caller frees the workspace */
/* The GEMM shapes whose tuning is still under way: their timed calls not all
 * issued, or not all finished on the device (this call settles those that
 * have).  A benchmark repeats its warm-up until this is 0. */
int td_ops_cuda_gemm_tuning(td_ops_cuda *ctx);
/* How many GEMM shapes the context holds; of those, how many had more than
 * one candidate to time, and how many kept one other than the heuristic's
 * first.  Any pointer may be NULL. */
void td_ops_cuda_gemm_counts(td_ops_cuda *ctx, int *shapes, int *timed, int *retuned);

/* How an input gradient is written. */
typedef enum td_ops_cuda_write {
    TD_OPS_CUDA_ADD, /* grad += (ops.h's convention) */
    TD_OPS_CUDA_SET, /* grad = (no zeroing needed) */
} td_ops_cuda_write;

/* --- embedding ------------------------------------------------------------ */

/* out (B,T,C) = wte[tokens[b,t]] (Vp,C) + wpe[pos[b,t]] (maxT,C); tokens (B,T) int.
 * wpe NULL (rotary models): no position term; the same for dwpe below. */
td_status td_ops_cuda_encoder_forward(void *out, const int *tokens, const int *pos, const void *wte,
                                      const void *wpe, int B, int T, int C, td_dtype dt, void *stream);
/* dwte[tokens[b,t]] += dout[b,t]; dwpe[pos[b,t]] += dout[b,t] (gdt).  Rows
 * sharing a token (or a position) are summed in ascending row order (a
 * stable sort of the tokens, or of the positions). */
size_t td_ops_cuda_encoder_scratch_bytes(int B, int T, int Vp);
td_status td_ops_cuda_encoder_backward(void *dwte, void *dwpe, const void *dout, const int *tokens,
                                       const int *pos, int B, int T, int C, int Vp, td_dtype dt, td_dtype gdt,
                                       void *scratch, size_t scratch_bytes, void *stream);

/* --- LayerNorm ------------------------------------------------------------ */

/* Per row of inp (N,C): out = (inp - mean) * rstd * weight + bias; saves
 * mean, rstd (N, fp32). */
td_status td_ops_cuda_layernorm_forward(void *out, float *mean, float *rstd, const void *inp,
                                        const void *weight, const void *bias, int N, int C,
                                        td_dtype dt, void *stream);
/* dinp (N,C) += (dt); dweight, dbias (C) += (gdt). */
size_t td_ops_cuda_layernorm_scratch_bytes(int N, int C);
td_status td_ops_cuda_layernorm_backward(void *dinp, void *dweight, void *dbias, const void *dout,
                                         const void *inp, const void *weight, const float *mean,
                                         const float *rstd, int N, int C, td_dtype dt, td_dtype gdt,
                                         void *scratch, size_t scratch_bytes, void *stream);
/* The same with the input gradient beside a residual one: dinp (N,C) = dres
 * + (dt).  dres may be dinp (the call above) or NULL (dinp is set); it must
 * not overlap dinp otherwise. */
td_status td_ops_cuda_layernorm_backward_res(void *dinp, const void *dres, void *dweight, void *dbias,
                                             const void *dout, const void *inp, const void *weight,
                                             const float *mean, const float *rstd, int N, int C, td_dtype dt,
                                             td_dtype gdt, void *scratch, size_t scratch_bytes, void *stream);

/* --- RMSNorm (the rotary decoder) ------------------------------------------- */

/* Per row of inp (N,C): out = (w_offset + weight) * (inp * rstd), rstd = 1 /
 * sqrt(mean(inp^2) + eps) in fp32 (td_ops_rmsnorm_forward: w_offset 0 for
 * LLaMA's gain, 1 for Gemma's 1 + w); saves rstd (N, fp32). */
td_status td_ops_cuda_rmsnorm_forward(void *out, float *rstd, const void *inp, const void *weight, float w_offset,
                                      int N, int C, float eps, td_dtype dt, void *stream);
/* dinp (N,C) += (dt); dweight (C) += (gdt), summed over rows without atomics. */
size_t td_ops_cuda_rmsnorm_scratch_bytes(int N, int C);
td_status td_ops_cuda_rmsnorm_backward(void *dinp, void *dweight, const void *dout, const void *inp,
                                       const void *weight, float w_offset, const float *rstd, int N, int C,
                                       td_dtype dt, td_dtype gdt, void *scratch, size_t scratch_bytes, void *stream);
/* The same beside a residual gradient: dinp = dres + (dt); dres may be dinp
 * (the call above) or NULL (dinp set), else must not overlap it. */
td_status td_ops_cuda_rmsnorm_backward_res(void *dinp, const void *dres, void *dweight, const void *dout,
                                           const void *inp, const void *weight, float w_offset, const float *rstd,
                                           int N, int C, td_dtype dt, td_dtype gdt, void *scratch,
                                           size_t scratch_bytes, void *stream);

/* --- matmul (cuBLASLt) ---------------------------------------------------- */

/* out (N,OC) = inp (N,C) @ weight (OC,C)^T + bias (OC) [+ residual (N,OC)].
 * bias and residual may be NULL; residual may be out itself.
 * With pre_gelu (N,OC) given: pre_gelu = inp @ weight^T + bias and
 * out = gelu(pre_gelu) (one cuBLASLt epilogue when fusable, else a second
 * kernel); residual must then be NULL. */
td_status td_ops_cuda_matmul_forward(td_ops_cuda *ctx, void *out, void *pre_gelu, const void *inp,
                                     const void *weight, const void *bias, const void *residual,
                                     int N, int C, int OC, td_dtype dt, void *stream);
/* dinp (N,C) (mode) = dout (N,OC) @ weight;  dweight (OC,C) += dout^T @ inp (gdt);
 * dbias (OC) += column sums of dout (gdt).  dinp and dbias may be NULL. */
size_t td_ops_cuda_matmul_scratch_bytes(int N, int OC);
td_status td_ops_cuda_matmul_backward(td_ops_cuda *ctx, void *dinp, void *dweight, void *dbias,
                                      const void *dout, const void *inp, const void *weight, int N,
                                      int C, int OC, td_ops_cuda_write dinp_mode, td_dtype dt,
                                      td_dtype gdt, void *scratch, size_t scratch_bytes,
                                      void *stream);
/* The backward of a matmul whose input was gelu(pre_gelu) (GPT-2's fc_proj):
 * dinp (N,C) = (dout @ weight) * gelu'(pre_gelu), set (one cuBLASLt epilogue
 * when fusable, as the forward's GELU, else the GELU backward kernel after
 * the GEMM); dweight and dbias as above.  dinp must not alias pre_gelu. */
td_status td_ops_cuda_matmul_backward_gelu(td_ops_cuda *ctx, void *dinp, void *dweight, void *dbias,
                                           const void *dout, const void *inp, const void *weight,
                                           const void *pre_gelu, int N, int C, int OC, td_dtype dt, td_dtype gdt,
                                           void *scratch, size_t scratch_bytes, void *stream);

/* --- attention ------------------------------------------------------------ */

/* Grouped-query attention (LLaMA, Qwen2) as td_ops_attention_gqa_forward:
 * NKV key/value heads (NH % NKV == 0), query head h reading key/value head
 * h / (NH / NKV), head size hs; qkv (B,T,(NH + 2 NKV) hs) holds the NH query
 * heads, then the NKV key heads, then the NKV value heads (the output of one
 * fused matmul; q/k/v biases are that matmul's bias); out (B,T,NH hs), lse
 * (B,NH,T) fp32; pos (B,T) or NULL: the documents of each row, which
 * attention does not cross (ops.h).  The paths and the scratch are those of the multi-head
 * calls below (which are the NKV = NH case): flash for bf16/fp16 with hs 64,
 * 80, 96 or 128, where the dK/dV kernel sums a key/value head's group of query
 * heads in registers (no atomics); the batched-GEMM path otherwise. */
size_t td_ops_cuda_attention_gqa_scratch_bytes(int seqs, int T, int NH, int NKV, int hs, td_dtype dt);
td_status td_ops_cuda_attention_gqa_forward(td_ops_cuda *ctx, void *out, float *lse, const void *qkv,
                                            const int *pos, int B, int T, int NH, int NKV, int hs, td_dtype dt,
                                            void *scratch, size_t scratch_bytes, void *stream);
/* dqkv (B,T,(NH + 2 NKV) hs) (mode) from dout (B,T,NH hs). */
td_status td_ops_cuda_attention_gqa_backward(td_ops_cuda *ctx, void *dqkv, const void *dout, const void *qkv,
                                             const void *out, const float *lse, const int *pos, int B, int T,
                                             int NH, int NKV, int hs, td_ops_cuda_write mode, td_dtype dt,
                                             void *scratch, size_t scratch_bytes, void *stream);

/* Causal self-attention as td_ops_attention_forward: qkv (B,T,3C) -> out
 * (B,T,C), lse (B,NH,T) fp32.  Two paths, chosen by shape:
 *   flash (bf16/fp16 with hs 64, 80, 96 or 128): tiles in shared memory on tensor
 *     cores, nothing T x T in device memory; scratch only for the backward's
 *     row dots (NH*T floats per sequence); the products on wgmma where the
 *     device runs the sm_90a code and hs is 64 or 128 (rows 16-byte
 *     aligned), else on mma.sync (also everywhere with
 *     TD_OPS_CUDA_ATTENTION=mma): the same bits either way;
 *   batched GEMM (otherwise, or when the environment variable
 *     TD_OPS_CUDA_ATTENTION=gemm): S = QK^T/sqrt(hs) in fp32, P in dt and
 *     out = PV through batched cuBLASLt GEMMs over whole T x T score
 *     matrices in scratch.
 * td_ops_cuda_attention_scratch_bytes(seqs, ...) is the scratch to run `seqs`
 * sequences at a time on the path that applies; any scratch of at least one
 * sequence's bytes works, the op runs as many sequences at a time as fit
 * (the same results up to rounding). */
size_t td_ops_cuda_attention_scratch_bytes(int seqs, int T, int C, int NH, td_dtype dt);
td_status td_ops_cuda_attention_forward(td_ops_cuda *ctx, void *out, float *lse, const void *qkv,
                                        int B, int T, int C, int NH, td_dtype dt, void *scratch,
                                        size_t scratch_bytes, void *stream);
/* dqkv (B,T,3C) (mode) from dout (B,T,C), given the forward's qkv, out, lse. */
td_status td_ops_cuda_attention_backward(td_ops_cuda *ctx, void *dqkv, const void *dout,
                                         const void *qkv, const void *out, const float *lse, int B,
                                         int T, int C, int NH, td_ops_cuda_write mode, td_dtype dt,
                                         void *scratch, size_t scratch_bytes, void *stream);

/* --- pointwise ------------------------------------------------------------ */

/* out = gelu(inp) (tanh approximation), n elements; out may be inp. */
td_status td_ops_cuda_gelu_forward(void *out, const void *inp, size_t n, td_dtype dt, void *stream);
/* dinp (mode) = gelu'(inp) * dout.  With SET, dinp may be dout (in place). */
td_status td_ops_cuda_gelu_backward(void *dinp, const void *inp, const void *dout, size_t n,
                                    td_ops_cuda_write mode, td_dtype dt, void *stream);
/* out = a + b; out may alias a or b. */
td_status td_ops_cuda_residual_forward(void *out, const void *a, const void *b, size_t n,
                                       td_dtype dt, void *stream);
/* da += dout; db += dout; either may be NULL (skipped). */
td_status td_ops_cuda_residual_backward(void *da, void *db, const void *dout, size_t n, td_dtype dt,
                                        void *stream);

/* out = s * inp, n elements; out may be inp. */
td_status td_ops_cuda_scale(void *out, const void *inp, float s, size_t n, td_dtype dt, void *stream);

/* out (N,H) = act(gate) * up from gate_up (N,2H): the gate in columns [0,H)
 * of a row, up in [H,2H) (one matmul with a (2H,C) weight computes both);
 * act as td_ops_glu_forward (SiLU: SwiGLU; tanh GELU: GeGLU). */
td_status td_ops_cuda_glu_forward(void *out, const void *gate_up, int N, int H, td_ops_glu act, td_dtype dt,
                                  void *stream);
/* dgate_up (N,2H) (mode) from dout (N,H).  With SET, dgate_up may be gate_up
 * (in place). */
td_status td_ops_cuda_glu_backward(void *dgate_up, const void *dout, const void *gate_up, int N, int H,
                                   td_ops_glu act, td_ops_cuda_write mode, td_dtype dt, void *stream);

/* Rotary position embedding in place, as td_ops_rope_forward: `heads` heads
 * of hs channels (hs even) at x (B,T,...), rows `stride` elements apart,
 * the token at [b,t] rotated by pos[b,t] * inv_freq (pos NULL: t) in the
 * rotate-half layout.  inv_freq
 * (hs/2, fp32, device) is td_ops_rope_inv_freq's table (theta, llama3
 * scaling), computed once on the host.  On a fused qkv (B,T,(NH + 2 NKV) hs)
 * row, heads = NH + NKV and stride = (NH + 2 NKV) hs rotate q and k in one
 * launch. */
td_status td_ops_cuda_rope_forward(void *x, const float *inv_freq, const int *pos, int B, int T, int heads, int hs,
                                   size_t stride, td_dtype dt, void *stream);
/* The gradient through it: the inverse rotation, in place on dx. */
td_status td_ops_cuda_rope_backward(void *dx, const float *inv_freq, const int *pos, int B, int T, int heads,
                                    int hs, size_t stride, td_dtype dt, void *stream);

/* --- softmax and loss ----------------------------------------------------- */

/* probs (N,Vp) = softmax over the first V columns of logits; columns >= V get 0. */
td_status td_ops_cuda_softmax_forward(void *probs, const void *logits, int N, int V, int Vp,
                                      td_dtype dt, void *stream);
/* losses (N) = lse - logits[n, targets[n]], 0 where the target is negative;
 * lse (N) = log sum_{v<V} exp(logits[n,v]).  targets (N) int. */
td_status td_ops_cuda_crossentropy_forward(float *losses, float *lse, const void *logits,
                                           const int *targets, int N, int V, int Vp, td_dtype dt,
                                           void *stream);
/* dlogits (N,Vp) = dloss * (softmax - onehot(target)) for kept rows, 0 for
 * ignored rows and columns >= V.  WRITES dlogits; it may be logits itself. */
td_status td_ops_cuda_crossentropy_backward(void *dlogits, const void *logits, const float *lse,
                                            const int *targets, float dloss, int N, int V, int Vp,
                                            td_dtype dt, void *stream);
/* Both in one pass over the logits (what a training step wants): losses,
 * lse, and dlogits written over `logits` (in place; the logits are gone). */
td_status td_ops_cuda_crossentropy_fused(float *losses, float *lse, void *logits,
                                         const int *targets, float dloss, int N, int V, int Vp,
                                         td_dtype dt, void *stream);

/* --- the head ------------------------------------------------------------- */

/* lnf (N,C) = LayerNorm(x; lnf_w, lnf_b) saving lnf_mean, lnf_rstd (N);
 * logits (N,Vp) = lnf @ wte^T. */
td_status td_ops_cuda_head_forward(td_ops_cuda *ctx, void *logits, void *lnf, float *lnf_mean,
                                   float *lnf_rstd, const void *x, const void *lnf_w,
                                   const void *lnf_b, const void *wte, int N, int C, int Vp,
                                   td_dtype dt, void *stream);
/* From dlogits (N,Vp): dx (N,C) += (dt); dlnf_w, dlnf_b (C), dwte (Vp,C) += (gdt).
 * dlnf (N,C, dt) is scratch, overwritten; `scratch` as below. */
size_t td_ops_cuda_head_scratch_bytes(int N, int C);
td_status td_ops_cuda_head_backward(td_ops_cuda *ctx, void *dx, void *dlnf_w, void *dlnf_b,
                                    void *dwte, void *dlnf, const void *dlogits, const void *x,
                                    const void *lnf, const float *lnf_mean, const float *lnf_rstd,
                                    const void *lnf_w, const void *wte, int N, int C, int Vp,
                                    td_dtype dt, td_dtype gdt, void *scratch, size_t scratch_bytes,
                                    void *stream);

/* --- one transformer block ------------------------------------------------ */

/* A block's tensors on the device, in td_model_block's order and shapes
 * (params in dt, or their gradients in gdt): the 12 roles, then LoRA target
 * j's A (R, in) and B (rows, R) (NULL: none, or a gradient not wanted). */
typedef struct td_ops_cuda_block {
    void *ln1_w, *ln1_b, *qkv_w, *qkv_b, *attproj_w, *attproj_b;
    void *ln2_w, *ln2_b, *fc_w, *fc_b, *fcproj_w, *fcproj_b;
    void *lora_a[TD_MODEL_LORA_MAX], *lora_b[TD_MODEL_LORA_MAX];
} td_ops_cuda_block;

/* The same from a block's tensors one by one (p[k]: its k-th tensor in
 * layout order, NULL where it has none, as a frozen tensor's gradient). */
void td_ops_cuda_block_from(const td_model_desc *cfg, void *const *p, td_ops_cuda_block *out);

/* Points `out` into a block's span laid out as the reference model's (td_model_block_span),
 * with elements of type dt: a block's chunk.  Any family: a LLaMA-family
 * block's fields as the LLaMA block below takes them, the others NULL. */
void td_ops_cuda_block_view(const td_model_desc *cfg, void *block_base, td_dtype dt,
                            td_ops_cuda_block *out);

/* What a block's forward keeps for its backward (td_model_block_acts's
 * fields; the statistics in fp32, the rest in dt). */
typedef struct td_ops_cuda_block_acts {
    void *ln1;                  /* (N,C) */
    float *ln1_mean, *ln1_rstd; /* (N) */
    void *qkv;                  /* (N,3C) */
    void *atty;                 /* (N,C) */
    float *att_lse;             /* (B,NH,T) */
    void *res2;                 /* (N,C) */
    void *ln2;                  /* (N,C) */
    float *ln2_mean, *ln2_rstd; /* (N) */
    void *fch, *fch_gelu;       /* (N,4C), (N,4C) */
    void *lora_xa;              /* LoRA: drop(x) A^T (N,R) of target j at j td_ops_cuda_lora_xa_stride bytes; NULL: none */
    const td_model_lora_drop *lora_drop; /* host memory: LoRA dropout's key of this call (model.h), or NULL: no
                                            dropout (eval, inference); the views set NULL, the exec the run's */
} td_ops_cuda_block_acts;

/* --- LoRA adapters on a block's linear modules (model/cuda/lora.cu) ------------ *
 * The CUDA counterpart of lora.c's td_lora_forward / td_lora_backward, for
 * the blocks above and the rotary decoder's: after module `kind`'s product y
 * (N rows, leading dimension ldy, elements of dt) of input x (N, in), each
 * target j on that module:  xa = x A^T (N,R), kept in the acts;
 * y[:, row0 : row0 + rows] += s xa B^T (s = alpha / R; beta = 1 GEMMs with
 * fp32 accumulation).  Backward from that product's gradient dy:
 * dB += s dy^T xa;  dxa = s dy B (N,R, into the scratch);  dA += dxa^T x;
 * dx += dxa A (dx NULL: none).  A gradient NULL in g is not computed.
 * With a dropout key in the acts (training, P > 0), x above is drop(x)
 * (model.h's hash, the CPU reference's masks): the forward writes it into
 * the scratch, the backward hashes it again for dA and scales dxa A by the
 * mask for dx. */
size_t td_ops_cuda_lora_xa_stride(const td_model_desc *cfg, int B, int T, td_dtype dt);
/* The acts the block keeps for them (every target's xa), carved by the block's acts view after its own. */
size_t td_ops_cuda_lora_acts_bytes(const td_model_desc *cfg, int B, int T, td_dtype dt);
/* Their scratch, in the block's scratch (0 without LoRA): dxa (N,R), and
 * with a dropout above 0 the dropped input (N, the widest targeted input). */
size_t td_ops_cuda_lora_scratch_bytes(const td_model_desc *cfg, int B, int T, td_dtype dt);
/* Whether a LoRA target sits on module `kind` (its product then runs unfused from what follows it). */
int td_ops_cuda_lora_on(const td_model_desc *cfg, td_model_param kind);
/* y NULL: a recompute, xa alone. */
td_status td_ops_cuda_lora_forward(td_ops_cuda *ctx, const td_model_desc *cfg, const td_ops_cuda_block *w,
                                   const td_ops_cuda_block_acts *acts, td_model_param kind, const void *x, void *y,
                                   int ldy, int N, td_dtype dt, void *scratch, void *stream);
td_status td_ops_cuda_lora_backward(td_ops_cuda *ctx, const td_model_desc *cfg, const td_ops_cuda_block *w,
                                    const td_ops_cuda_block *g, const td_ops_cuda_block_acts *acts,
                                    td_model_param kind, const void *x, const void *dy, int ldy, void *dx, int N,
                                    td_dtype dt, td_dtype gdt, void *scratch, void *stream);

/* Bytes of one block's acts, each field 256-byte aligned. */
size_t td_ops_cuda_block_acts_bytes(const td_model_desc *cfg, int B, int T, td_dtype dt);
void td_ops_cuda_block_acts_view(const td_model_desc *cfg, int B, int T, td_dtype dt,
                                 void *base, td_ops_cuda_block_acts *out);
/* Scratch of block forward and backward with attention run `att_seqs`
 * sequences at a time (1 .. B; fewer need less memory, the results are the
 * same).  Pass the bytes you give to the calls below. */
size_t td_ops_cuda_block_scratch_bytes(const td_model_desc *cfg, int B, int T, td_dtype dt,
                                       int att_seqs);
/* y (B,T,C) = block(x), filling acts, as td_model_block_forward; y NULL:
 * the acts only (a recompute: the fc_proj GEMM is skipped); pos: the rows'
 * documents or NULL. */
td_status td_ops_cuda_block_forward(td_ops_cuda *ctx, const td_model_desc *cfg,
                                    const td_ops_cuda_block *w, const td_ops_cuda_block_acts *acts,
                                    const void *x, void *y, const int *pos, int B, int T, td_dtype dt,
                                    void *scratch, size_t scratch_bytes, void *stream);
/* From dy: dx (mode) and every tensor of g += (gdt), as td_model_block_backward. */
td_status td_ops_cuda_block_backward(td_ops_cuda *ctx, const td_model_desc *cfg,
                                     const td_ops_cuda_block *w, const td_ops_cuda_block *g,
                                     const td_ops_cuda_block_acts *acts, const void *x,
                                     const void *dy, void *dx, const int *pos, int B, int T,
                                     td_ops_cuda_write dx_mode, td_dtype dt, td_dtype gdt,
                                     void *scratch, size_t scratch_bytes, void *stream);

/* --- one rotary decoder block and head (model/rotary_cuda.c) ---------------- */

/* The block of the LLaMA-style families (LLaMA, Qwen2; model/rotary.h),
 * as its CPU reference: w and g hold the block's tensors in
 * td_model_block's fields (ln1_w, qkv_w, qkv_b (Qwen2, else NULL),
 * attproj_w = o_proj (C, NH hs), ln2_w, fc_w = gate|up (2H,C), fcproj_w =
 * down (C,H); the others NULL); acts as td_ops_cuda_rotary_block_acts_view
 * carves them (qkv (N,QKV) after RoPE, atty (N, NH hs), fch gate|up (N,2H),
 * fch_gelu (N,H), no means).  inv_freq: td_ops_rope_inv_freq's table (hs/2
 * fp32) on the device.  dx is written (SET). */
size_t td_ops_cuda_rotary_block_acts_bytes(const td_model_desc *cfg, int B, int T, td_dtype dt);
void td_ops_cuda_rotary_block_acts_view(const td_model_desc *cfg, int B, int T, td_dtype dt, void *base,
                                         td_ops_cuda_block_acts *out);
size_t td_ops_cuda_rotary_block_scratch_bytes(const td_model_desc *cfg, int B, int T, td_dtype dt, int att_seqs);
/* y NULL: the acts only (a recompute: the down projection is skipped).
 * pos: the rows' documents (above), or NULL. */
td_status td_ops_cuda_rotary_block_forward(td_ops_cuda *ctx, const td_model_desc *cfg, const td_ops_cuda_block *w,
                                            const td_ops_cuda_block_acts *acts, const float *inv_freq, const void *x,
                                            void *y, const int *pos, int B, int T, td_dtype dt, void *scratch,
                                            size_t scratch_bytes, void *stream);
td_status td_ops_cuda_rotary_block_backward(td_ops_cuda *ctx, const td_model_desc *cfg,
                                             const td_ops_cuda_block *w, const td_ops_cuda_block *g,
                                             const td_ops_cuda_block_acts *acts, const float *inv_freq, const void *x,
                                             const void *dy, void *dx, const int *pos, int B, int T, td_dtype dt,
                                             td_dtype gdt, void *scratch, size_t scratch_bytes, void *stream);
/* The head: lnf = RMSNorm(x; norm_w) saving lnf_rstd; logits (N,Vp) = lnf @ out_w^T
 * (out_w: lm_head, or the embedding when tied).  Backward from dlogits: dx +=
 * (dt), dnorm_w, dout_w += (gdt); dlnf (N,C) is overwritten. */
size_t td_ops_cuda_rotary_head_scratch_bytes(int N, int C, int Vp);
td_status td_ops_cuda_rotary_head_forward(td_ops_cuda *ctx, const td_model_desc *cfg, void *logits, void *lnf,
                                           float *lnf_rstd, const void *x, const void *norm_w, const void *out_w,
                                           int N, td_dtype dt, void *stream);
td_status td_ops_cuda_rotary_head_backward(td_ops_cuda *ctx, const td_model_desc *cfg, void *dx, void *dnorm_w,
                                            void *dout_w, void *dlnf, const void *dlogits, const void *x,
                                            const void *lnf, const float *lnf_rstd, const void *norm_w,
                                            const void *out_w, int N, td_dtype dt, td_dtype gdt, void *scratch,
                                            size_t scratch_bytes, void *stream);

#ifdef __cplusplus
}
#endif
#endif
