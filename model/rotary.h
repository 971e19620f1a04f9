/* The rotary decoder: the block, head, parameters, Hugging Face names and
 * config.json keys that the LLaMA-style families share (LLaMA, Qwen2,
 * Gemma), so that each family's file holds only what is its own.  Private
 * to model/.
 *
 *   x = embed[tokens] (* sqrt(C), Gemma)
 *   x = x + o_proj(gqa_attention(rope(qkv_proj(rmsnorm_1(x)))))
 *   x = x + down_proj(act(gate) * up),  (gate | up) = gate_up_proj(rmsnorm_2(x))
 *   logits = rmsnorm_f(x) @ (lm_head or embed)^T
 * with NKV key/value heads (grouped-query attention), heads of hs channels
 * (NH hs need not be C), rotary embeddings on q and k (theta, optional
 * llama3 scaling), optional q/k/v biases and no other bias.  tidal fuses
 * q|k|v into one (QKV, C) weight, QKV = (NH + 2 NKV) hs, and gate|up into
 * one (2H, C) weight; the Hugging Face files hold them split
 * (q_proj/k_proj/v_proj, gate_proj/up_proj). */
#ifndef TIDAL_MODEL_ROTARY_H
#define TIDAL_MODEL_ROTARY_H

#include "tidal/family.h"

/* d's block make-up (its family's traits): the gain offset, the GLU's
 * activation, the embedding's scale tell the families apart. */
const td_model_traits *td_rotary_traits(const td_model_desc *d);

/* The CPU reference and (CUDA builds) the GPU compute. */
extern const td_model_cpu td_rotary_cpu;
#ifdef TD_HAVE_CUDA
extern const td_model_exec td_rotary_cuda;
#define TD_ROTARY_CUDA_ENTRY .cuda = &td_rotary_cuda,
#else
#define TD_ROTARY_CUDA_ENTRY
#endif

/* The checks every rotary decoder needs: an even head size up to
 * TD_MODEL_MAX_HEAD_SIZE, a valid llama3 rope scaling. */
td_status td_rotary_check(const td_model_desc *d);
int td_rotary_describe(const td_model_desc *d, char *buf, size_t n);
int td_rotary_kinds(const td_model_desc *d, td_model_section s, td_model_param *out);
int td_rotary_shape(const td_model_desc *d, td_model_param kind, int shape[2]);
int td_rotary_hf_parts(const td_model_desc *d, td_model_section s, td_model_hf_part out[TD_MODEL_HF_PARTS_MAX]);
extern const char *const td_rotary_names[TD_MODEL_PARAM_COUNT];
extern const char *const td_rotary_hf_ignored[];

/* The table entries every rotary decoder shares (in a td_model_family's
 * initializer, beside its own name, traits, presets, checks, init and
 * config.json reader and writer). */
#define TD_ROTARY_FAMILY_ENTRIES                                                                                      \
    .describe = td_rotary_describe, .kinds = td_rotary_kinds, .shape = td_rotary_shape, .names = td_rotary_names,    \
    .hf_block_prefix = "model.layers.", .hf_parts = td_rotary_hf_parts, .hf_ignored = td_rotary_hf_ignored,         \
    .cpu = &td_rotary_cpu, TD_ROTARY_CUDA_ENTRY

/* config.json: the keys LlamaConfig, Qwen2Config and their kin share
 * (hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
 * num_key_value_heads, head_dim, max_position_embeddings, vocab_size,
 * rms_norm_eps, rope_theta, rope_scaling / rope_parameters,
 * tie_word_embeddings, pad_token_id), with transformers' defaults for what
 * is absent (rms_norm_eps `eps`, rope_theta 10000, untied, no padding token).  head_dim_default 0: the
 * heads split the width (a head_dim must be hidden_size /
 * num_attention_heads); else any head_dim, this one when absent. */
td_status td_rotary_config_read(const td_hf_config *c, td_model_desc *d, float eps, int head_dim_default);
td_status td_rotary_config_write(const td_model_desc *d, td_hf_config *c);

#endif
