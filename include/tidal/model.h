/* The model: its description (td_model_desc), its family, the presets, its
 * parameter table in tidal's layout and in the Hugging Face files, and its
 * config.json.
 *
 * A description is plain data: the family (a table, family.h: GPT-2,
 * LLaMA, Qwen2, Gemma, ...) and the sizes and settings a config.json holds.
 * Everything a family decides — which tensors a block has, their names and
 * shapes, how config.json spells them, how the block computes — is asked of
 * the family; code outside model/ never branches on it.
 *
 * The functions are implemented in model/model.c (the description, the
 * families, the presets), model/model_tensors.c (tidal's tensor table) and
 * model/model_hf.c (the Hugging Face tensors and config.json).
 * Ownership: descriptions are caller-owned values; families and presets
 * are static.  Thread-safety: pure functions. */
#ifndef TIDAL_MODEL_H
#define TIDAL_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "tidal/hf_config.h"
#include "tidal/ops.h"
#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_model_family td_model_family; /* family.h */

/* The largest head size the rotary embedding takes (its frequencies live on the stack). */
#define TD_MODEL_MAX_HEAD_SIZE 1024

/* The model's description.  A zero family is GPT-2, so a GPT-2
 * description needs only the first six fields. */
/* LoRA (docs/training.md, "LoRA"): each targeted linear module of every
 * block (a Hugging Face weight of the block, e.g. q_proj, or a part of
 * tidal's fused q|k|v and gate|up) gets A (R, in) and B (out, R); the
 * module computes x W^T + s (drop(x) A^T) B^T with s = alpha / R, never
 * forming W + s B A.  The adapters are block tensors after the family's
 * (kinds TD_MODEL_LORA_A(j), TD_MODEL_LORA_B(j) for target j in the
 * family's part order): the layout, the flat reference and the trainer
 * carry them like any tensor.  A starts kaiming-uniform (a = sqrt 5) as
 * PEFT's, B at zero. */
#define TD_MODEL_LORA_MAX 8
typedef struct td_model_lora {
    int rank;          /* R; 0: no adapters */
    float alpha;       /* the update's scale is alpha / R */
    float dropout;     /* on the adapters' input while training (0: none) */
    unsigned targets;  /* bit i: the i-th 2-D weight among the family's block parts (td_model_lora_target) */
} td_model_lora;

typedef struct td_model_desc {
    int n_layer;           /* L */
    int n_head;            /* NH */
    int n_embd;            /* C */
    int n_positions;       /* maxT: the longest sequence (GPT-2: rows of wpe) */
    int vocab_size;        /* V */
    int padded_vocab_size; /* Vp >= V: rows of the embedding, columns of the logits */
    const td_model_family *family; /* NULL: GPT-2 */
    int n_kv_head;         /* NKV: key/value heads, dividing NH; 0: NH */
    int n_inner;           /* H: the MLP's width; 0: 4 C */
    int head_dim;          /* hs: a head's width; 0: C / NH */
    float norm_eps;        /* 0: 1e-5 */
    float rope_theta;      /* RoPE base (0: 10000) */
    td_rope_scaling rope_scaling; /* factor 0: none; else llama3 scaling */
    int qkv_bias;          /* the q, k, v projections have biases (Qwen2) */
    int untied_head;       /* 1: its own lm_head (Vp, C); 0: logits against the embedding */
    td_model_lora lora;    /* low-rank adapters on the block's linear modules (rank 0: none) */
    int has_pad_token;     /* 1: pad_token is config.json's pad_token_id (rotary families) */
    int pad_token;         /* its embedding row takes no gradient from the input lookup, as torch's
                            * nn.Embedding(padding_idx) that transformers builds; a tied head's
                            * logits still reach it */
} td_model_desc;

/* --- families and presets (model/model.c) ---------------------------------- */

/* The family named `name` (config.json's model_type: "gpt2", "llama",
 * "qwen2", "gemma", ...), or NULL. */
const td_model_family *td_model_family_find(const char *name);
/* Every family, 0 <= i < td_model_family_count(), in name order. */
int td_model_family_count(void);
const td_model_family *td_model_family_at(int i);
/* d's family (GPT-2 when d->family is NULL). */
const td_model_family *td_model_family_of(const td_model_desc *d);
const char *td_model_family_name(const td_model_family *f);
/* How people write its name ("GPT-2", "LLaMA"; its name where it gives none). */
const char *td_model_family_title(const td_model_family *f);
/* Makes d a model of the family `name` with the family's defaults (its
 * sizes kept); TD_ERR_INVALID naming the families for an unknown name. */
td_status td_model_desc_set_family(td_model_desc *d, const char *name);

/* The preset `name` (every family's: `tidal plan --model NAME` prints any;
 * docs/model.md lists them), its vocabulary padded; TD_ERR_INVALID listing
 * them for an unknown name. */
td_status td_model_preset(const char *name, td_model_desc *out);
/* Names of the presets, NULL-terminated, family by family. */
const char *const *td_model_preset_names(void);
/* The vocabulary rounded up to a multiple of 64 (the logits' width). */
int td_model_pad_vocab(int vocab);

/* TD_OK, or TD_ERR_INVALID naming the bad field: the common rules, then the family's. */
td_status td_model_desc_check(const td_model_desc *d);
/* One line describing the model (snprintf's return). */
int td_model_desc_describe(const td_model_desc *d, char *buf, size_t n);
/* The first setting in which two descriptions are different models (a
 * name for messages: "family", "n_layer", "num_key_value_heads", ...), or
 * NULL when they are the same model; the padded vocabulary is not compared. */
const char *td_model_desc_differs(const td_model_desc *a, const td_model_desc *b);

/* The derived sizes, defaults applied. */
int td_model_kv_heads(const td_model_desc *d);  /* NKV */
int td_model_head_size(const td_model_desc *d); /* hs */
int td_model_attn_width(const td_model_desc *d); /* NH hs: the attention's output, o_proj's input */
int td_model_mlp_width(const td_model_desc *d); /* H */
int td_model_qkv_width(const td_model_desc *d); /* (NH + 2 NKV) hs */
float td_model_norm_eps(const td_model_desc *d);
float td_model_rope_theta(const td_model_desc *d);

/* --- tidal's parameter table (model/model_tensors.c) ------------------------- */

/* A tensor's role, the vocabulary every family's table uses.  A LLaMA-style
 * block reuses the GPT-2 kinds it shares: LN1_W, LN2_W, LNF_W are the
 * RMSNorm weights, QKV_W/QKV_B the fused q|k|v projection, ATTPROJ_W
 * o_proj, FC_W the fused gate|up (2H, C), FCPROJ_W down_proj (C, H). */
typedef enum td_model_param {
    TD_MODEL_WTE,       /* (Vp, C)   the token embedding */
    TD_MODEL_WPE,       /* (maxT, C) learned positions */
    TD_MODEL_LN1_W,     /* (C)       the attention's norm     -- per block from here */
    TD_MODEL_LN1_B,     /* (C) */
    TD_MODEL_QKV_W,     /* (QKV, C)  q | k | v */
    TD_MODEL_QKV_B,     /* (QKV) */
    TD_MODEL_ATTPROJ_W, /* (C, NH hs) the attention's output projection */
    TD_MODEL_ATTPROJ_B, /* (C) */
    TD_MODEL_LN2_W,     /* (C)       the MLP's norm */
    TD_MODEL_LN2_B,     /* (C) */
    TD_MODEL_FC_W,      /* (H, C), or gate | up (2H, C) */
    TD_MODEL_FC_B,      /* (H) */
    TD_MODEL_FCPROJ_W,  /* (C, H) */
    TD_MODEL_FCPROJ_B,  /* (C)                                 -- per block to here */
    TD_MODEL_LNF_W,     /* (C)       the final norm */
    TD_MODEL_LNF_B,     /* (C) */
    TD_MODEL_LM_HEAD,   /* (Vp, C)   an untied head */
    TD_MODEL_PARAM_COUNT
} td_model_param;
/* The adapters of LoRA target j (0 <= j < td_model_lora_count): A (R, in), B (out, R). */
#define TD_MODEL_LORA_A(j) ((td_model_param)(TD_MODEL_PARAM_COUNT + 2 * (j)))
#define TD_MODEL_LORA_B(j) ((td_model_param)(TD_MODEL_PARAM_COUNT + 2 * (j) + 1))
#define TD_MODEL_IS_LORA(k) ((int)(k) >= TD_MODEL_PARAM_COUNT)

/* One LoRA target of a block: the tidal tensor it adapts (a weight), the
 * rows of it that are the module (q of a fused q|k|v: [0, NH hs)), the
 * module's input width and its Hugging Face module path in the block
 * ("self_attn.q_proj", GPT-2's "attn.c_attn"). */
typedef struct td_model_lora_target {
    td_model_param kind;
    int row0, rows, in;
    int module_index; /* its place among the block's linear modules (the family's part order;
                         LLaMA: q k v o gate up down = 0..6, GPT-2: c_attn attn.c_proj c_fc
                         mlp.c_proj = 0..3): LoRA dropout's module key */
    char module[48];
} td_model_lora_target;
/* Targets per block (0 without LoRA), and the j-th. */
int td_model_lora_count(const td_model_desc *d);
void td_model_lora_target_get(const td_model_desc *d, int j, td_model_lora_target *out);
/* Sets d->lora: rank R, alpha, dropout and the targets, a comma list of
 * module names as PEFT's target_modules (the last component: q_proj,
 * k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; GPT-2's c_attn,
 * c_proj, c_fc); NULL: every linear module of the block.  TD_ERR_INVALID naming an unknown module (and the
 * block's), a rank below 1 or above a targeted module's smaller side, a
 * dropout outside [0, 1) or alpha <= 0. */
td_status td_model_lora_set(td_model_desc *d, int rank, float alpha, float dropout, const char *targets);
/* LoRA dropout (PEFT's lora_dropout, training only): target j's update is
 * s (drop(x) A^T) B^T where drop(x)[row, c] = x[row, c] m / (1 - P), m 0 or
 * 1.  The mask is not stored: m is a counter-based hash of the run's seed,
 * the optimizer step, the block, the module (module_index), the row's
 * sample (its index in the step's global batch) and position, and the
 * column, so a forward, its backward and a checkpointed block's recompute
 * draw the same one, on any backend and any number of ranks:
 *   mix(z)  = splitmix64's finalizer: z ^= z >> 30; z *= 0xbf58476d1ce4e5b9;
 *             z ^= z >> 27; z *= 0x94d049bb133111eb; z ^= z >> 31 (mod 2^64)
 *   eat(h, v) = mix(h + 0x9e3779b97f4a7c15 (v + 1))
 *   h = eat(eat(eat(eat(eat(eat(seed, step), layer), module), sample), position), column)
 *   dropped  iff  (float)(h >> 40) < P 2^24,   kept ones scaled by 1 / (1 - P) (fp32).
 * The key of one block call: */
typedef struct td_model_lora_drop {
    uint64_t seed;   /* the run's seed */
    int64_t step;    /* the optimizer step being made (1 for the first) */
    int64_t sample0; /* the step-global index of the call's first row's sample */
    int layer;       /* the block */
    int T;           /* row r is sample sample0 + r / T, position r % T */
} td_model_lora_drop;
/* The hash above for one element (model/lora.c): 1 when it is dropped at probability p. */
int td_model_lora_dropped(const td_model_lora_drop *k, int module_index, int64_t row, int column, float p);
/* The hash itself (its top 24 bits decide). */
uint64_t td_model_lora_drop_hash(uint64_t seed, int64_t step, int layer, int module_index, int64_t sample,
                                 int position, int column);

/* The merged weights: base_params (the layout of d without adapters)
 * from params (d's layout), each targeted weight W + s B A. */
void td_model_lora_merge(const td_model_desc *d, const float *params, float *base_params);
/* The targets' module names, comma separated (PEFT's target_modules). */
int td_model_lora_modules(const td_model_desc *d, char *buf, size_t n);

/* The most tensors a block has (GPT-2's 12 and the adapters of LoRA targets). */
#define TD_MODEL_BLOCK_TENSORS (12 + 2 * TD_MODEL_LORA_MAX)

typedef struct td_model_tensor {
    td_model_param kind;
    int layer;          /* block index, -1 for the tensors outside the blocks */
    size_t offset;      /* in floats from the start of the flat buffer */
    size_t numel;
    int ndim;           /* 1 or 2 */
    int shape[2];       /* tidal's shape: weights (out, in) */
    int hf_transposed;  /* 1: Hugging Face stores it as (shape[1], shape[0]) */
    int matrix;         /* a 2-D weight (embeddings included): where weight decay goes */
    char name[64];      /* tidal's name, e.g. "h.3.attn.c_attn.weight" or a fused
                           "model.layers.3.self_attn.qkv_proj.weight" */
} td_model_tensor;

/* The tensors in layout order: the embedding's, then each block's, then the final ones. */
int td_model_tensor_count(const td_model_desc *d);
/* The index-th tensor of the layout (0 <= index < count). */
void td_model_tensor_get(const td_model_desc *d, int index, td_model_tensor *out);
/* Its elements and its kind alone, as td_model_tensor_get gives them, without
 * the name and offset (the planner asks these of every tensor, many times). */
size_t td_model_tensor_numel(const td_model_desc *d, int index);
td_model_param td_model_tensor_kind(const td_model_desc *d, int index);
size_t td_model_params_numel(const td_model_desc *d);
/* A block's tensors (e.g. GPT-2 12, LLaMA 6) and the tensors before block 0 (e.g. 2 or 1). */
int td_model_block_tensor_count(const td_model_desc *d);
int td_model_embed_tensor_count(const td_model_desc *d);
/* Block `layer`'s tensors span floats [offset, offset + numel): a block can be one chunk. */
void td_model_block_span(const td_model_desc *d, int layer, size_t *offset, size_t *numel);
/* The largest single tensor inside a block (elements). */
size_t td_model_block_largest_numel(const td_model_desc *d);
/* The tensors the head reads, as layout indices in the order the head
 * takes them: the final norm's weight [and bias], then the output matrix
 * (the embedding, index 0, when tied: it comes last). */
int td_model_head_tensors(const td_model_desc *d, int idx[3]);

/* Initialisation of tensor `index` into dst (its numel floats), by the
 * family's rule for its kind (weights N(0, 0.02), ...; rows >= V of an
 * embedding or head zero).  Each tensor draws from its own stream seeded
 * by (seed, index), so tensors can be initialised in any order, wherever
 * they live, with the same result. */
void td_model_init_tensor(const td_model_desc *d, int index, float *dst, uint64_t seed);
/* Elements [begin, begin + count) of that init into dst[0 .. count) (the
 * values td_model_init_tensor writes there; the range is clipped to the
 * tensor), without drawing the rest: a rank's shard of a tensor. */
void td_model_init_range(const td_model_desc *d, int index, float *dst, size_t begin, size_t count, uint64_t seed);
/* All tensors into a flat buffer of td_model_params_numel floats. */
void td_model_init(const td_model_desc *d, float *params, uint64_t seed);

/* One block's tensors (params or their gradients) by role, GPT-2's twelve
 * names; a family's block leaves the ones it lacks NULL. */
typedef struct td_model_block {
    float *ln1_w, *ln1_b, *qkv_w, *qkv_b, *attproj_w, *attproj_b;
    float *ln2_w, *ln2_b, *fc_w, *fc_b, *fcproj_w, *fcproj_b;
    float *lora_a[TD_MODEL_LORA_MAX], *lora_b[TD_MODEL_LORA_MAX]; /* LoRA target j's A and B (NULL: none) */
} td_model_block;

/* Points `out` into a block's span (block_base = flat + the span's offset). */
void td_model_block_view(const td_model_desc *d, float *block_base, td_model_block *out);
/* The same from the block's tensors one by one (p[k]: its k-th tensor in layout order). */
void td_model_block_from(const td_model_desc *d, void *const *p, td_model_block *out);

/* --- the Hugging Face files (model/model_hf.c) ------------------------------- */

/* One tensor of the Hugging Face files: a tidal tensor, or a part of one
 * (q, k, v of a fused qkv; gate, up of a fused gate_up). */
typedef struct td_model_hf_tensor {
    char name[80];        /* its name in the files, e.g. "h.3.mlp.c_fc.weight" (no optional prefix) */
    int tensor;           /* the tidal tensor it is part of (the layout index) */
    uint64_t offset;      /* its first element in that tensor */
    int layer;            /* block index, -1 outside the blocks */
    int ndim;             /* 1 or 2 */
    int64_t shape[2];     /* tidal's layout: Linear weights (out, in); the embedding (Vp, C) */
    int64_t hf_shape[2];  /* as stored: Conv1D (in, out); the embedding (V, C) */
    int transposed;       /* 1: hf_shape is shape reversed */
    uint64_t numel;       /* elements of shape */
    uint64_t hf_numel;    /* elements of hf_shape (less than numel only for a padded vocabulary) */
} td_model_hf_tensor;

/* The tensors of the files, the family's order (GPT-2: 4 + 12 L; LLaMA
 * 2 + 9 L (+1 untied); Qwen2 2 + 12 L (+1); Gemma 2 + 9 L). */
int td_model_hf_count(const td_model_desc *d);
/* The index-th (0 <= index < count). */
td_status td_model_hf_get(const td_model_desc *d, int index, td_model_hf_tensor *out);
/* The index of the tensor with this name (the family's optional prefix
 * allowed), or -1. */
int td_model_hf_find(const td_model_desc *d, const char *name);
/* 1 when a file may carry the tensor `name` although it is no parameter of
 * the model (a tied head saved anyway, GPT-2's mask buffers, older rotary
 * frequencies). */
int td_model_hf_ignorable(const td_model_desc *d, const char *name);
/* The block a name belongs to (the part after "<prefix><layer>." in *rest),
 * or -1 when it names no block. */
int td_model_hf_layer(const td_model_desc *d, const char *name, const char **rest);
/* The name without the family's optional prefix. */
const char *td_model_hf_strip(const td_model_desc *d, const char *name);

/* config.json: the model in `c` (model_type picks the family; a missing
 * model_type is gpt2), unchecked; errors name the file and the key. */
td_status td_model_config_get(const td_hf_config *c, td_model_desc *out);
/* The model into `c`: architectures, model_type, the family's keys and
 * tidal_padded_vocab_size. */
td_status td_model_config_put(const td_model_desc *d, td_hf_config *c);
/* The file at path, read and checked (td_model_desc_check). */
td_status td_model_config_read(const char *path, td_model_desc *out);

#ifdef __cplusplus
}
#endif
#endif
