/* The rotary decoder's families (LLaMA, Qwen2, Gemma) in the trainer on the cpu backend: the
 * step loop composes the block by the model's description, and its losses
 * equal a reference built from the whole-model forward/backward over flat
 * buffers and one AdamW over all params; offloading changes nothing (tight
 * budget vs all resident, bit for bit).  The cuda backend's LLaMA block is
 * checked against these losses by tests/gpu/test_trainer_gpu.c. */
#include "td_train_test.h"
#include "tidal/model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static td_train_config llama_config(const char *family, int nkv, int untied, int scaled, int head_dim)
{
    td_train_config c = td_train_default_config();
    c.model = (td_model_desc){ .n_layer = 3, .n_head = 4, .n_embd = 32, .n_positions = 32,
                                   .vocab_size = 61, .padded_vocab_size = 64 };
    td_model_desc_set_family(&c.model, family);
    c.model.n_kv_head = nkv;
    c.model.n_inner = 40;
    c.model.norm_eps = 1e-6f;
    c.model.rope_theta = 10000.0f;
    c.model.untied_head = untied;
    c.model.head_dim = head_dim; /* 0: C / NH */
    if (scaled) c.model.rope_scaling = (td_rope_scaling){ 8.0f, 1.0f, 4.0f, 64 };
    c.micro_batch = 2;
    c.seq_len = 16;
    c.grad_accum = 1;
    c.backend = TD_BACKEND_CPU;
    c.mm.min_chunk_numel = 1024;
    c.mm.max_chunk_numel = 8192;
    c.optim.lr.lr = 3e-3;
    c.optim.lr.warmup_steps = 0;
    c.threads = 2;
    return c;
}

/* Gemma with heads of 12 over a width of 32 (4 heads: not C / NH), multi-query and grouped. */
static const struct { const char *f; int nkv, untied, scaled, hd; } cases[] = {
    {"llama", 2, 0, 1, 0}, {"llama", 1, 1, 0, 0}, {"qwen2", 4, 1, 0, 0}, {"qwen2", 2, 0, 1, 0},
    {"gemma", 1, 0, 0, 12}, {"gemma", 2, 1, 1, 12},
};

/* The reference: td_model_forward/backward over the whole model and AdamW
 * over every tensor, with the trainer's coefficients and decay rule. */
static void reference_losses(const td_train_config *c, int steps, double *losses)
{
    int n = td_model_tensor_count(&c->model);
    uint8_t *all = malloc((size_t)n);
    memset(all, 1, (size_t)n);
    td_test_reference_train(c, all, steps, losses, NULL);
    free(all);
}

static void test_steps_match_reference(void **state)
{
    enum { STEPS = 4 };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        td_train_config c = llama_config(cases[k].f, cases[k].nkv, cases[k].untied, cases[k].scaled, cases[k].hd);
        c.optim.adam.weight_decay = 0.5; /* large, so a wrong decay group shows */
        double got[STEPS], want[STEPS];
        td_test_train(&c, STEPS, 99, got, NULL);
        reference_losses(&c, STEPS, want);
        for (int s = 0; s < STEPS; s++) {
            if (!(fabs(got[s] - want[s]) <= 2e-6 * fabs(want[s])))
                fail_msg("case %zu (%s) step %d: trainer %.9g, reference %.9g", k, cases[k].f, s,
                         got[s], want[s]);
        }
        assert_true(got[STEPS - 1] < got[0]);
    }
}

static void test_offloading_is_bit_identical(void **state)
{
    enum { STEPS = 3 };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        td_train_config c = llama_config(cases[k].f, cases[k].nkv, cases[k].untied, cases[k].scaled, cases[k].hd);
        c.grad_accum = 2;
        c.mm.placement = TD_PLACEMENT_CUDA;
        c.gpu_budget = 64 * TD_MiB;
        double ref[STEPS], got[STEPS];
        td_test_train(&c, STEPS, 7, ref, NULL);
        td_train_config v = td_test_offloaded_config(&c, 7); /* chunks move all the time */
        td_memmgr_stats st;
        td_test_train(&v, STEPS, 7, got, &st);
        assert_memory_equal(got, ref, sizeof got);
        assert_true(st.evictions > 0);
        /* The AdamW on its own thread, transient grads (no clipping, no
         * accumulation) under the same moving budget: the same losses as
         * the serial path. */
        v.grad_accum = 1;
        v.optim.max_grad_norm = 0;
        double serial[STEPS];
        v.adam_thread = -1;
        td_test_train(&v, STEPS, 7, serial, NULL);
        v.adam_thread = 1;
        td_test_train(&v, STEPS, 7, got, NULL);
        assert_memory_equal(got, serial, sizeof got);
    }
}

/* `tidal plan`'s block probe on the cpu backend times block 0 of the
 * model's own family: it initialised GPT-2's 12 tensors after 2 embeddings,
 * which for a LLaMA-family layout (1 embedding, 6 or 7 tensors a block)
 * wrote the next blocks' tensors past the probe's buffer (an abort in
 * td_free for `tidal plan --model tiny-llama`; ASan names the write). */
static void test_block_probe_times_the_family_block(void **state)
{
    td_backend *b = td_test_backend(0);
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        td_train_config c = llama_config(cases[k].f, cases[k].nkv, cases[k].untied, cases[k].scaled, cases[k].hd);
        td_train_rates r = {0};
        TD_ASSERT_OK(td_train_measure_block(b, &c, &r));
        assert_true(r.block_fwd_ms > 0 && r.block_fwd_ms < 1e3);
        assert_true(r.block_bwd_ms > 0 && r.block_bwd_ms < 1e3);
        assert_true(r.block_recompute_ms > 0 && r.block_recompute_ms < 1e3);
    }
    td_backend_free(b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_steps_match_reference),
        cmocka_unit_test(test_offloading_is_bit_identical),
        cmocka_unit_test(test_block_probe_times_the_family_block),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
