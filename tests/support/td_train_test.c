/* Shared by the trainer's tests (see td_train_test.h). */
#include "td_train_test.h"

td_status td_test_next_batch(void *ctx, int32_t *tokens, int32_t *targets, int32_t *positions)
{
    (void)positions; /* one document a row */
    td_test_batches *b = ctx;
    if (b->repeat) td_rng_seed(&b->rng, b->seed);
    for (size_t i = 0; i < b->n; i++) {
        tokens[i] = (int32_t)td_rng_below(&b->rng, (uint64_t)b->vocab);
        targets[i] = (tokens[i] * 7 + 3) % b->vocab;
    }
    return TD_OK;
}

td_test_batches td_test_batches_of(const td_train_config *c, uint64_t seed)
{
    td_test_batches b = { .vocab = c->model.vocab_size, .n = (size_t)c->micro_batch * c->seq_len };
    td_rng_seed(&b.rng, seed);
    return b;
}

void td_test_train(const td_train_config *c, int steps, uint64_t data_seed, double *losses, td_memmgr_stats *stats)
{
    td_trainer *t;
    TD_ASSERT_OK(td_trainer_create(c, &t));
    td_test_batches b = { .vocab = c->model.vocab_size, .n = (size_t)c->micro_batch * c->seq_len };
    td_rng_seed(&b.rng, data_seed);
    for (int s = 0; s < steps; s++) {
        td_step_result r;
        TD_ASSERT_OK(td_trainer_step(t, td_test_next_batch, &b, &r));
        losses[s] = r.loss;
        if (stats) *stats = r.mm;
    }
    td_trainer_destroy(t);
}

td_train_config td_test_offloaded_config(const td_train_config *c, uint64_t data_seed)
{
    td_train_config v = *c;
    v.mm.placement = TD_PLACEMENT_CPU;
    v.ckpt = TD_CKPT_ON;
    td_trainer *t;
    TD_ASSERT_OK(td_trainer_create(&v, &t));
    td_test_batches b = td_test_batches_of(c, data_seed);
    td_step_result r;
    TD_ASSERT_OK(td_trainer_step(t, td_test_next_batch, &b, &r));
    v.gpu_budget = td_memmgr_min_budget(td_trainer_memmgr(t)) + 64 * 1024;
    td_trainer_destroy(t);
    return v;
}
