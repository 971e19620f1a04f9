/* Shared by the trainer's tests (CPU and GPU): a synthetic batch source and
 * a run of a few steps. */
#ifndef TD_TRAIN_TEST_H
#define TD_TRAIN_TEST_H

#include "td_test.h"
#include "tidal/trainer.h"

#include <stdint.h>

/* Random tokens; each target is a fixed function of its token, so there is
 * something to learn.  repeat: every batch is the one of `seed`. */
typedef struct td_test_batches { td_rng rng; int vocab; size_t n; int repeat; uint64_t seed; } td_test_batches;

td_status td_test_next_batch(void *ctx, int32_t *tokens, int32_t *targets, int32_t *positions);
/* The batches of c's micro-batch shape and vocabulary, seeded. */
td_test_batches td_test_batches_of(const td_train_config *c, uint64_t seed);
/* `steps` steps of a fresh trainer over batches seeded with data_seed:
 * the losses, and the memory manager's totals after the last. */
void td_test_train(const td_train_config *c, int steps, uint64_t data_seed, double *losses, td_memmgr_stats *stats);
/* c offloaded as far as it goes: every chunk homed on the host, every block
 * recomputed, and the budget 64 KiB above the least one step of c's
 * accesses needed (measured by a step over batches seeded with data_seed),
 * so that chunks move all the time. */
td_train_config td_test_offloaded_config(const td_train_config *c, uint64_t data_seed);
/* The trainer's arithmetic over flat buffers for `steps` steps of c's
 * batches seeded with 99: the whole model's forward and backward, the
 * global norm over the grads of the tensors with trains[i] set, AdamW over
 * those alone (weight decay on 2-D tensors, or on all with c->decay_all);
 * the losses, and the final params in out (td_model_params_numel floats;
 * NULL: not wanted). */
void td_test_reference_train(const td_train_config *c, const uint8_t *trains, int steps, double *losses, float *out);

#endif
