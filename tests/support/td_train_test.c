/* Shared by the trainer's tests (see td_train_test.h). */
#include "td_train_test.h"
#include "tidal/model.h"
#include "tidal/model_ref.h"
#include "tidal/optim.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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

void td_test_reference_train(const td_train_config *c, const uint8_t *trains, int steps, double *losses, float *out)
{
    const td_model_desc *mc = &c->model;
    const int B = c->micro_batch, T = c->seq_len, N = B * T, n = td_model_tensor_count(mc);
    const size_t np = td_model_params_numel(mc);
    float *p = calloc(np, 4), *g = calloc(np, 4), *m = calloc(np, 4), *v = calloc(np, 4);
    float *acts = calloc(td_model_acts_numel(mc, B, T), 4), *scratch = calloc(td_model_scratch_numel(mc, B, T), 4);
    int32_t *tok = calloc((size_t)N, 4), *tgt = calloc((size_t)N, 4);
    td_model_init(mc, p, c->seed);
    td_test_batches b = td_test_batches_of(c, 99);
    td_adam_cpu *adam;
    td_adam_cpu_params ap = td_adam_cpu_default_params();
    TD_ASSERT_OK(td_adam_cpu_create(&ap, &adam));
    for (int s = 0; s < steps; s++) {
        TD_ASSERT_OK(td_test_next_batch(&b, tok, tgt, NULL));
        float loss;
        int cnt;
        memset(g, 0, np * 4);
        TD_ASSERT_OK(td_model_forward(mc, p, tok, tgt, B, T, acts, &loss, &cnt));
        TD_ASSERT_OK(td_model_backward(mc, p, g, tok, tgt, (float)(1.0 / N), B, T, acts, scratch));
        losses[s] = loss;
        double sumsq = 0;
        for (int i = 0; i < n; i++) {
            td_model_tensor t;
            td_model_tensor_get(mc, i, &t);
            for (size_t e = 0; trains[i] && e < t.numel; e++) sumsq += (double)g[t.offset + e] * g[t.offset + e];
        }
        td_adam_coeffs cd, cn;
        td_adam_hparams nodecay = c->optim.adam;
        nodecay.weight_decay = 0;
        double lr = td_lr_at(&c->optim.lr, s + 1);
        double clip = c->optim.max_grad_norm > 0 ? td_clip_coef(sqrt(sumsq), c->optim.max_grad_norm) : 1.0;
        TD_ASSERT_OK(td_adam_coeffs_make(&c->optim.adam, lr, s + 1, clip, &cd));
        TD_ASSERT_OK(td_adam_coeffs_make(&nodecay, lr, s + 1, clip, &cn));
        for (int i = 0; i < n; i++) {
            td_model_tensor t;
            td_model_tensor_get(mc, i, &t);
            if (!trains[i]) continue;
            td_adam_chunk ch = { .master = p + t.offset, .m = m + t.offset, .v = v + t.offset, .grad = g + t.offset,
                                 .grad_dtype = TD_DTYPE_F32, .param_dtype = TD_DTYPE_F32,
                                 .numel = t.numel };
            TD_ASSERT_OK(td_adam_cpu_update(adam, t.matrix || c->decay_all ? &cd : &cn, &ch, 1));
        }
    }
    if (out) memcpy(out, p, np * 4);
    td_adam_cpu_destroy(adam);
    free(p); free(g); free(m); free(v); free(acts); free(scratch); free(tok); free(tgt);
}
