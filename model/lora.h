/* LoRA inside model/ (lora.c): the adapters as block tensors for the
 * parameter table, and their compute on the CPU reference, which the
 * families' blocks call around each module's product. */
#ifndef TIDAL_MODEL_LORA_H
#define TIDAL_MODEL_LORA_H

#include "tidal/model.h"
#include "tidal/model_ref.h"

/* The adapter kinds of a block, after the family's (2 per target). */
int td_lora_kinds(const td_model_desc *d, td_model_param *out);
int td_lora_shape(const td_model_desc *d, td_model_param kind, int shape[2]);
/* Its name in the block: "<module>.lora_A.weight" (PEFT's, after the block prefix). */
void td_lora_name(const td_model_desc *d, td_model_param kind, char *buf, size_t n);
/* A: PEFT's kaiming uniform from the seeded stream; B: zero. */
/* Elements [begin, begin + count) of an adapter tensor's init (of its
 * stream), into dst[0 .. count). */
void td_lora_init(const td_model_desc *d, td_model_param kind, float *dst, size_t begin, size_t count, uint64_t stream);
/* The acts a block keeps for its adapters (floats), carved after the family's. */
size_t td_lora_acts_numel(const td_model_desc *d, int B, int T);
void td_lora_acts_view(const td_model_desc *d, int B, int T, float *base, td_model_block_acts *a);
/* After the module `kind`'s product y (N rows of ldy) of input x (N,in):
 * every target on that module adds its update to its rows of y (y NULL:
 * the recompute, xa alone). */
void td_lora_forward(const td_model_desc *d, const td_model_block *w, const td_model_block_acts *a,
                     td_model_param kind, const float *x, float *y, int ldy, int N);
/* From that product's gradient dy: the adapters' gradients (where g has
 * them) and dx += the input's share (dx NULL: none wanted). */
void td_lora_backward(const td_model_desc *d, const td_model_block *w, const td_model_block *g,
                      const td_model_block_acts *a, td_model_param kind, const float *x, const float *dy, int ldy,
                      float *dx, int N);

#endif
