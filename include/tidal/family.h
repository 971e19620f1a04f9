/* A model family: one table that says everything family-specific about a
 * model, owned by model/ (ggml-backend style: a struct of function pointers
 * and data).  Everything outside model/ works through it and never asks
 * which family it holds: the trainer runs the family's block, head and
 * embedding through td_model_exec, checkpoint/ reads and writes its
 * Hugging Face tensors and config.json through model.h's td_model_hf_* and
 * td_model_config_*, the plan sizes its buffers from the same table.
 *
 * A family is one file, model/family_<name>.c, defining
 *     const td_model_family td_family_<name> = { ... };
 * The build lists every model/family_*.c in the registry (model/family.c),
 * so adding the file is all it takes: the presets, `--model`, config.json's
 * model_type, checkpoints and training find it.  docs/model.md walks
 * through an example.
 *
 * What a family gives:
 *   - its name (config.json's model_type), architecture (config.json's
 *     architectures[0]) and presets;
 *   - the description's rules: the defaults a new description of the family
 *     gets, the checks beyond the common ones (model.c), a one-line summary;
 *   - its parameters: which kinds (td_model_param) are before, in and after
 *     each block, in layout order, each kind's shape and initialisation,
 *     tidal's name of each;
 *   - Hugging Face: the name of every tensor in the files, which tidal
 *     tensor it is (part of: q/k/v of a fused qkv, gate/up of a fused
 *     gate_up) and whether it is stored transposed; the names a file may
 *     carry that are not parameters; config.json in and out;
 *   - its compute: the CPU reference (td_model_cpu: fp32 on host memory,
 *     the oracle) and, in CUDA builds, the GPU one (td_model_exec), each with
 *     the buffers it needs (its footprint).
 * Families with one block structure share implementations: LLaMA, Qwen2
 * and Gemma run model/rotary.c's rotary decoder, told apart by `traits`.
 *
 * Ownership: tables are static, immutable and live for the process.
 * Thread-safety: every function here is reentrant. */
#ifndef TIDAL_FAMILY_H
#define TIDAL_FAMILY_H

#include <stddef.h>

#include "tidal/dtype.h"
#include "tidal/hf_config.h"
#include "tidal/model_ref.h"
#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_ops_cuda td_ops_cuda; /* ops_cuda.h */

/* The make-up of a family's block, as data: what model/'s shared code reads
 * (the rotary decoder, rotary.h; the key/value-cache decoder, decode.h). */
typedef enum td_model_norm { TD_MODEL_NORM_LAYER, TD_MODEL_NORM_RMS } td_model_norm;
typedef struct td_model_traits {
    td_model_norm norm; /* LayerNorm (weight and bias) or RMSNorm (weight) */
    float norm_offset;  /* RMSNorm's gain is norm_offset + weight: 0, Gemma's 1 */
    int gated;          /* the MLP: down(act(gate) * up) from a fused gate|up (1), or proj(act(fc)) (0) */
    td_ops_glu act;     /* its activation: SiLU or the tanh GELU */
    int rope;           /* rotary positions on q and k (1), or a learned table wpe (0) */
    int embed_scaled;   /* the embedding is multiplied by sqrt(C), rounded to the compute dtype (Gemma) */
} td_model_traits;

/* A preset: a name and the description it stands for (its family and
 * padded vocabulary are filled in by td_model_preset). */
typedef struct td_family_preset {
    const char *name;
    td_model_desc desc;
} td_family_preset;

/* Where a tensor sits in the layout. */
typedef enum td_model_section {
    TD_MODEL_SECTION_EMBED, /* before block 0: the embeddings */
    TD_MODEL_SECTION_BLOCK, /* in each block */
    TD_MODEL_SECTION_FINAL, /* after the last block: the final norm, an untied head */
} td_model_section;

/* Which rows of a tidal tensor a Hugging Face tensor is. */
typedef enum td_model_hf_split {
    TD_MODEL_HF_WHOLE, /* all of it */
    TD_MODEL_HF_Q,     /* rows [0, NH hs) of a fused qkv (weight or bias) */
    TD_MODEL_HF_K,     /* the next NKV hs rows */
    TD_MODEL_HF_V,     /* the last NKV hs rows */
    TD_MODEL_HF_GATE,  /* rows [0, H) of a fused gate_up */
    TD_MODEL_HF_UP,    /* rows [H, 2H) */
} td_model_hf_split;

/* One tensor of the Hugging Face files. */
typedef struct td_model_hf_part {
    td_model_param kind;     /* the tidal tensor it is, or is part of */
    td_model_hf_split split;
    int transposed;          /* stored (in, out), as GPT-2's Conv1D weights */
    const char *name;        /* in a block: after "<hf_block_prefix><layer>." */
} td_model_hf_part;
#define TD_MODEL_HF_PARTS_MAX 24

/* How a tensor starts: std > 0 draws N(0, std) (an embedding's or head's
 * padding rows >= V stay 0), else every element is `value`. */
typedef struct td_model_init_rule {
    double std;
    float value;
} td_model_init_rule;

/* A family's CPU reference: fp32, host memory, ops.h's conventions (a
 * backward ADDS into dx and every gradient).  model_ref.h's functions of
 * the same names call these. */
typedef struct td_model_cpu {
    size_t (*acts_numel)(const td_model_desc *d, int B, int T);
    void (*acts_view)(const td_model_desc *d, int B, int T, float *base, td_model_block_acts *out);
    /* scratch of block_backward, and the head_backward's dlnf (N,C) */
    size_t (*scratch_numel)(const td_model_desc *d, int B, int T);
    /* pos (B,T) or NULL: each token's position in its packed document (ops.h) */
    void (*block_forward)(const td_model_desc *d, const td_model_block *w, const td_model_block_acts *a,
                          const float *x, float *y, const int *pos, int B, int T);
    void (*block_backward)(const td_model_desc *d, const td_model_block *w, const td_model_block *g,
                           const td_model_block_acts *a, const float *x, const float *dy, float *dx,
                           float *scratch, const int *pos, int B, int T);
    /* p, g: the embedding's tensors in layout order */
    void (*embed_forward)(const td_model_desc *d, const float *const *p, const int *tokens, const int *pos,
                          float *out, int B, int T);
    void (*embed_backward)(const td_model_desc *d, float *const *g, const float *dout, const int *tokens,
                           const int *pos, int B, int T);
    /* p, g: td_model_head_tensors' order; lnf_mean may be NULL where the norm keeps none */
    void (*head_forward)(const td_model_desc *d, float *logits, float *lnf, float *lnf_mean, float *lnf_rstd,
                         const float *x, const float *const *p, int N);
    void (*head_backward)(const td_model_desc *d, float *dx, float *const *g, float *dlnf, const float *dlogits,
                          const float *x, const float *lnf, const float *lnf_mean, const float *lnf_rstd,
                          const float *const *p, int N);
} td_model_cpu;

/* One call's shape and buffers, the same for every call of a step. */
typedef struct td_model_run {
    const td_model_desc *desc;
    int B, T;              /* N = B T rows */
    td_dtype dt;           /* params and activations (the CPU reference: F32) */
    td_dtype gdt;          /* param gradients: dt or F32 */
    td_ops_cuda *ops;      /* CUDA: the ops context (ops_cuda.h); CPU: NULL */
    void *stream;          /* CUDA: the compute stream; CPU: NULL */
    const void *consts;    /* the family's constants on the device (consts_bytes of them), or NULL */
    void *scratch;         /* scratch_bytes of device memory, 256-byte aligned */
    size_t scratch_bytes;
    const int *pos;        /* (B,T) on the device: each token's position in its document when rows hold
                              packed documents (ops.h), or NULL: one document a row */
    const td_model_lora_drop *lora_drop; /* host memory: LoRA dropout's key of the block call (model.h; its
                              layer set before each), or NULL: no dropout (eval, a dropout of 0) */
} td_model_run;

/* What the head's final norm keeps for its backward: lnf (N,C) in dt,
 * mean (N) (LayerNorm only; else unused) and rstd (N) in fp32. */
typedef struct td_model_head_acts {
    void *lnf;
    float *mean, *rstd;
} td_model_head_acts;

/* A family's compute on one backend, over device pointers: what the trainer
 * and the block probe run.  Tensors are arrays in layout order: the
 * embedding's (td_model_embed_tensor_count), one block's
 * (td_model_block_tensor_count), the head's (td_model_head_tensors). */
typedef struct td_model_exec {
    /* One block's activations kept for its backward. */
    size_t (*block_acts_bytes)(const td_model_desc *d, int B, int T, td_dtype dt);
    /* Scratch of every call below, attention run att_seqs sequences at a
     * time (1 .. B: fewer need less, the results are the same). */
    size_t (*scratch_bytes)(const td_model_desc *d, int B, int T, td_dtype dt, int att_seqs);
    /* Constants the calls read (RoPE's frequencies): their bytes, and the
     * host copy to upload once (consts_fill writes consts_bytes). */
    size_t (*consts_bytes)(const td_model_desc *d);
    void (*consts_fill)(const td_model_desc *d, void *host);
    /* out (B,T,C) from the tokens; g += its gradient from dout. */
    td_status (*embed_forward)(const td_model_run *r, void *const *p, const int *tokens, void *out);
    td_status (*embed_backward)(const td_model_run *r, void *const *g, const int *tokens, const void *dout);
    /* y (B,T,C) = block(x), the acts filled; y NULL: the acts only (the
     * recompute of a checkpointed block; its last projection skipped). */
    td_status (*block_forward)(const td_model_run *r, void *const *p, void *acts, const void *x, void *y);
    /* From dy: dx WRITTEN (not added), every tensor of g +=. */
    td_status (*block_backward)(const td_model_run *r, void *const *p, void *const *g, void *acts, const void *x,
                                const void *dy, void *dx);
    /* logits (N,Vp) = the final norm of x, times the output matrix. */
    td_status (*head_forward)(const td_model_run *r, void *const *p, const void *x, void *logits,
                              const td_model_head_acts *h);
    /* From dlogits: dx += (the caller zeroes it), g +=. */
    td_status (*head_backward)(const td_model_run *r, void *const *p, void *const *g, const void *x,
                               const void *dlogits, const td_model_head_acts *h, void *dx);
} td_model_exec;

struct td_model_family {
    const char *name;         /* config.json's model_type: "gpt2", "llama", "qwen2", "gemma" */
    const char *title;        /* how people write it: "GPT-2", "LLaMA", "Qwen2", "Gemma" (help, messages) */
    const char *architecture; /* config.json's architectures[0]: "GPT2LMHeadModel", ... */
    const char *summary;      /* what its block is, one line */
    td_model_traits traits;   /* its block's make-up */
    const td_family_preset *presets;
    int n_presets;

    /* --- the description --- */
    /* The family's own fields of a new description, its sizes kept. */
    void (*defaults)(td_model_desc *d);
    /* After model.c's common checks (sizes, heads, widths): the family's. */
    td_status (*check)(const td_model_desc *d);
    int (*describe)(const td_model_desc *d, char *buf, size_t n);

    /* --- the parameters --- */
    /* The kinds of a section in layout order (at most TD_MODEL_BLOCK_TENSORS). */
    int (*kinds)(const td_model_desc *d, td_model_section s, td_model_param *out);
    /* tidal's shape of a kind: weights (out, in); returns ndim (1 or 2). */
    int (*shape)(const td_model_desc *d, td_model_param kind, int shape[2]);
    td_model_init_rule (*init)(const td_model_desc *d, td_model_param kind);
    /* tidal's name of each kind (a block's after "<hf_block_prefix><layer>."). */
    const char *const *names;

    /* --- Hugging Face --- */
    const char *hf_block_prefix;    /* "h.", "model.layers." */
    const char *hf_optional_prefix; /* a prefix files may put before every name ("transformer."), or NULL */
    /* A section's tensors in the files, in save_pretrained's order. */
    int (*hf_parts)(const td_model_desc *d, td_model_section s, td_model_hf_part out[TD_MODEL_HF_PARTS_MAX]);
    /* Block tensors a file may carry that are not parameters (GPT-2's mask
     * buffers), after the block prefix; NULL-terminated, or NULL. */
    const char *const *hf_ignored;
    /* config.json: the family's keys (model.c reads model_type and
     * tidal_padded_vocab_size, writes architectures and model_type). */
    td_status (*config_read)(const td_hf_config *c, td_model_desc *d);
    td_status (*config_write)(const td_model_desc *d, td_hf_config *c);

    /* --- compute --- */
    const td_model_cpu *cpu;
    const td_model_exec *cuda; /* NULL in builds without CUDA */
};

/* The compute that runs d on the cuda backend (cuda 1: the family's CUDA
 * exec, NULL in builds without CUDA) or on the CPU (cuda 0: the CPU
 * reference over host memory, fp32). */
const td_model_exec *td_model_exec_of(const td_model_desc *d, int cuda);

/* What a description stores for f: NULL for the zero description's family
 * (GPT-2), so that one model has one description (memcmp-equal). */
const td_model_family *td_model_family_stored(const td_model_family *f);

/* The embedding's scale: sqrt(C) rounded to dt as transformers rounds it
 * (torch.tensor(C ** 0.5, dtype)) when the traits say so, else 1. */
float td_model_embed_scale(const td_model_desc *d, td_dtype dt);

/* --- helpers for family implementations (model/family.c) --- */

/* The shapes every family shares for its kinds (fc_rows: FC_W's rows, H or
 * 2H for a fused gate|up); returns ndim. */
int td_model_shape_common(const td_model_desc *d, td_model_param kind, int fc_rows, int shape[2]);
/* N(0, 0.02) for matrices, 1 for norm weights, 0 for biases. */
td_model_init_rule td_model_init_common(const td_model_desc *d, td_model_param kind);

#ifdef __cplusplus
}
#endif
#endif
