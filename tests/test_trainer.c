/* The trainer end to end on the cpu backend: losses are bit-identical under
 * every placement policy and budget (offloading changes nothing
 * numerically), the first loss matches the whole-model reference, and a
 * small model learns a fixed batch. */
#include "td_train_test.h"
#include "tidal/model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The batch source and runs are shared with the GPU tests. */
typedef td_test_batches batches;
#define next_batch td_test_next_batch

static td_train_config small_config(void)
{
    td_train_config c = td_train_default_config();
    c.model = (td_model_desc){ .n_layer = 3, .n_head = 2, .n_embd = 32, .n_positions = 32,
                                   .vocab_size = 61, .padded_vocab_size = 64 };
    c.micro_batch = 2;
    c.seq_len = 16;
    c.grad_accum = 2;
    c.backend = TD_BACKEND_CPU;
    c.mm.min_chunk_numel = 1024;
    c.mm.max_chunk_numel = 8192;
    c.optim.lr.lr = 3e-3;
    c.threads = 2;
    return c;
}

static void run(const td_train_config *c, int steps, double *losses, td_memmgr_stats *stats)
{
    td_test_train(c, steps, 99, losses, stats);
}

static void test_policies_and_budgets_are_bit_identical(void **state)
{
    enum { STEPS = 4 };
    td_train_config c = small_config();
    c.mm.placement = TD_PLACEMENT_CUDA;
    c.gpu_budget = 64 * TD_MiB;
    double ref[STEPS];
    run(&c, STEPS, ref, NULL);
    struct { td_placement pl; size_t budget; td_ckpt_mode ckpt; double pf; } cases[] = {
        {TD_PLACEMENT_CPU, 64 * TD_MiB, TD_CKPT_OFF, 0},
        {TD_PLACEMENT_CPU, 0, TD_CKPT_ON, 0},     /* 0: the tightest budget found below */
        {TD_PLACEMENT_STATIC, 64 * TD_MiB, TD_CKPT_AUTO, 0.5},
        {TD_PLACEMENT_AUTO, 0, TD_CKPT_ON, 0},
        {TD_PLACEMENT_AUTO, 64 * TD_MiB, TD_CKPT_OFF, 0},
    };
    /* A budget just above one block's params and grads plus activations:
     * chunks must move all the time. */
    size_t tight = 0;
    {
        td_train_config probe = c;
        probe.mm.placement = TD_PLACEMENT_CPU;
        probe.ckpt = TD_CKPT_ON;
        td_trainer *t;
        TD_ASSERT_OK(td_trainer_create(&probe, &t));
        batches b = { .vocab = c.model.vocab_size, .n = (size_t)c.micro_batch * c.seq_len };
        td_rng_seed(&b.rng, 99);
        td_step_result r;
        TD_ASSERT_OK(td_trainer_step(t, next_batch, &b, &r));
        tight = td_memmgr_min_budget(td_trainer_memmgr(t)) + 64 * 1024;
        td_trainer_destroy(t);
    }
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        td_train_config v = c;
        v.mm.placement = cases[k].pl;
        v.gpu_budget = cases[k].budget ? cases[k].budget : tight;
        v.ckpt = cases[k].ckpt;
        v.mm.offload_param_frac = v.mm.offload_optim_frac = cases[k].pf;
        double got[STEPS];
        td_memmgr_stats st;
        run(&v, STEPS, got, &st);
        for (int s = 0; s < STEPS; s++)
            if (memcmp(&got[s], &ref[s], sizeof(double)) != 0)
                fail_msg("case %zu step %d: loss %.17g != %.17g", k, s, got[s], ref[s]);
        if (!cases[k].budget) assert_true(st.evictions > 0); /* the tight budget really moved chunks */
    }
}

/* Recomputing any number of blocks gives the losses of keeping them all,
 * bit for bit, and each kept block costs its activations. */
static void test_partial_checkpointing_is_bit_identical(void **state)
{
    enum { STEPS = 3 };
    td_train_config c = small_config();
    c.ckpt = TD_CKPT_OFF;
    double ref[STEPS];
    run(&c, STEPS, ref, NULL);
    size_t prev = 0;
    for (int nck = 1; nck <= c.model.n_layer; nck++) {
        td_train_config v = c;
        v.ckpt = TD_CKPT_ON;
        v.ckpt_blocks = nck;
        td_trainer *t;
        TD_ASSERT_OK(td_trainer_create(&v, &t));
        assert_int_equal(td_trainer_checkpointing(t), nck);
        td_trainer_destroy(t);
        double got[STEPS];
        run(&v, STEPS, got, NULL);
        for (int s = 0; s < STEPS; s++)
            if (memcmp(&got[s], &ref[s], sizeof(double)) != 0)
                fail_msg("%d blocks recomputed, step %d: loss %.17g != %.17g", nck, s, got[s], ref[s]);
        td_train_plan p;
        TD_ASSERT_OK(td_train_plan_make(&v, 0, &p));
        assert_int_equal(p.ckpt_blocks, nck);
        if (nck > 1) assert_true(p.activation_bytes < prev);
        prev = p.activation_bytes;
    }
    c.ckpt = TD_CKPT_ON;
    c.ckpt_blocks = c.model.n_layer + 1;
    assert_int_equal(td_train_config_check(&c), TD_ERR_INVALID);
}

/* --ckpt auto, against every choice it could make: with the GPU AdamW, it
 * recomputes the fewest blocks that keep the whole state on the device;
 * else the fewest that leave the param and grad chunks (plus two of the
 * largest chunk) their room; when even that does not fit, none if all
 * activations take at most a quarter of the budget, else all. */
static size_t act_bytes_with(const td_train_config *c, int nck)
{
    td_train_config v = *c;
    v.ckpt = nck ? TD_CKPT_ON : TD_CKPT_OFF;
    v.ckpt_blocks = nck;
    td_train_plan p;
    TD_ASSERT_OK(td_train_plan_make(&v, 0, &p));
    return p.nonmodel_bytes;
}

static void check_auto_choice(const td_train_config *c, int gpu)
{
    int L = c->model.n_layer;
    td_train_plan p;
    TD_ASSERT_OK(td_train_plan_make(c, 0, &p)); /* budget unknown: every block recomputed */
    assert_int_equal(p.ckpt_blocks, L);
    size_t state_all = 0;
    for (int r = 0; r < TD_TENSOR_ROLE_COUNT; r++) state_all += p.role_bytes[r];
    size_t pg = p.role_bytes[TD_TENSOR_PARAM] + p.role_bytes[TD_TENSOR_GRAD];
    size_t largest = (p.min_device_bytes - p.nonmodel_bytes - p.working_set_bytes) / 2;
    size_t with[64];
    for (int n = 0; n <= L; n++) with[n] = act_bytes_with(c, n);
    size_t one = (with[0] - with[L]) / (size_t)(L - 1); /* one block's activations */
    size_t lo = with[L], hi = with[0] + state_all * 2;
    int seen_partial = 0;
    for (int k = 0; k <= 200; k++) {
        size_t budget = lo + (hi - lo) / 200 * (size_t)k;
        TD_ASSERT_OK(td_train_plan_make(c, budget, &p));
        size_t a = with[L] + state_all;
        int fits_gpu = gpu && a + a / 16 <= budget;
        int want = -1;
        if (!fits_gpu && with[L] + pg + 2 * largest > budget) want = (size_t)L * one <= budget / 4 ? 0 : L;
        else
            for (int n = 0; n < L && want < 0; n += n ? 1 : 2) {
                a = with[n] + (fits_gpu ? state_all : pg + 2 * largest);
                if (fits_gpu ? a + a / 16 <= budget : a <= budget) want = n;
            }
        if (want < 0) want = L;
        if (p.ckpt_blocks != want)
            fail_msg("budget %zu: auto recomputes %d blocks, the oracle %d", budget, p.ckpt_blocks, want);
        seen_partial |= want > 0 && want < L;
        if (fits_gpu) assert_true(p.gpu_optimizer); /* keeping activations never costs the GPU AdamW */
    }
    assert_true(seen_partial);
}

static void test_auto_checkpointing_keeps_what_fits(void **state)
{
    td_train_config c = small_config();
    c.model.n_layer = 6;
    c.micro_batch = 8;
    c.seq_len = 32;
    c.ckpt = TD_CKPT_AUTO;
    c.mm.placement = TD_PLACEMENT_CPU;
    check_auto_choice(&c, 0);
#ifdef TD_HAVE_CUDA
    c.backend = TD_BACKEND_CUDA;
    c.precision = TD_DTYPE_BF16;
    c.mm.placement = TD_PLACEMENT_AUTO;
    check_auto_choice(&c, 1);
#endif
}

/* Without clipping and loss scaling the optimizer updates each chunk as its
 * grads arrive, last first: the same losses as the exact two-pass path. */
static void test_early_updates_match_two_pass(void **state)
{
    enum { STEPS = 4 };
    td_train_config c = small_config();
    c.mm.placement = TD_PLACEMENT_CPU;
    c.optim.max_grad_norm = 0; /* early, chunk by chunk */
    double early[STEPS], exact[STEPS];
    run(&c, STEPS, early, NULL);
    c.optim.max_grad_norm = 1e30; /* clipping that never clips: the two-pass path */
    run(&c, STEPS, exact, NULL);
    assert_memory_equal(early, exact, sizeof early);
}

/* With clipping, a step leaves its AdamW to the next forward: the params'
 * host copies keep the old values until td_trainer_finish_update (or the
 * next step's first use) writes the new ones; nothing else changes them. */
static void test_updates_wait_for_next_forward(void **state)
{
    td_train_config c = small_config();
    c.mm.placement = TD_PLACEMENT_CPU;
    c.optim.max_grad_norm = 1.0;
    td_trainer *t;
    TD_ASSERT_OK(td_trainer_create(&c, &t));
    td_memmgr *mm = td_trainer_memmgr(t);
    int last = td_model_tensor_count(&c.model) - 1, ids[2];
    td_trainer_tensor_ids(t, 0, &ids[0], NULL, NULL, NULL);    /* wte: the first chunk */
    td_trainer_tensor_ids(t, last, &ids[1], NULL, NULL, NULL); /* ln_f bias: the last */
    float before[2], after[2];
    void *h[2];
    TD_ASSERT_OK(td_memmgr_host_access(mm, ids, 2, TD_ACCESS_READ, h));
    for (int i = 0; i < 2; i++) before[i] = *(float *)h[i];
    batches b = { .vocab = c.model.vocab_size, .n = (size_t)c.micro_batch * c.seq_len };
    td_rng_seed(&b.rng, 5);
    td_step_result r;
    TD_ASSERT_OK(td_trainer_step(t, next_batch, &b, &r));
    TD_ASSERT_OK(td_memmgr_host_access(mm, ids, 2, TD_ACCESS_READ, h));
    for (int i = 0; i < 2; i++) assert_memory_equal(h[i], &before[i], sizeof(float));
    TD_ASSERT_OK(td_trainer_finish_update(t));
    TD_ASSERT_OK(td_memmgr_host_access(mm, ids, 2, TD_ACCESS_READ, h));
    for (int i = 0; i < 2; i++) after[i] = *(float *)h[i];
    assert_true(after[0] != before[0] && after[1] != before[1]);
    TD_ASSERT_OK(td_trainer_finish_update(t)); /* nothing left: a no-op */
    TD_ASSERT_OK(td_memmgr_host_access(mm, ids, 2, TD_ACCESS_READ, h));
    for (int i = 0; i < 2; i++) assert_memory_equal(h[i], &after[i], sizeof(float));
    td_trainer_destroy(t);
}

/* The first loss equals the whole-model reference forward on the same batch. */
static void test_first_loss_matches_reference(void **state)
{
    td_train_config c = small_config();
    c.grad_accum = 1;
    double loss;
    run(&c, 1, &loss, NULL);
    const td_model_desc *mc = &c.model;
    size_t np = td_model_params_numel(mc);
    float *params = malloc(np * sizeof(float));
    td_model_init(mc, params, c.seed);
    batches b = { .vocab = mc->vocab_size, .n = (size_t)c.micro_batch * c.seq_len };
    td_rng_seed(&b.rng, 99);
    int32_t tok[32], tgt[32];
    next_batch(&b, tok, tgt, NULL);
    size_t na = td_model_acts_numel(mc, c.micro_batch, c.seq_len);
    float *acts = malloc(na * sizeof(float));
    float ref;
    TD_ASSERT_OK(td_model_forward(mc, params, tok, tgt, c.micro_batch, c.seq_len, acts, &ref, NULL));
    assert_true(fabs(loss - ref) <= 1e-5 * fabs(ref));
    free(params);
    free(acts);
}

/* A fixed batch is learnt: the loss falls far below its start.  (And the
 * set-up's timing adds up.) */
static void test_learns_a_fixed_batch(void **state)
{
    td_train_config c = small_config();
    c.grad_accum = 1;
    c.mm.placement = TD_PLACEMENT_CPU;
    td_trainer *t;
    const double before = td_now_ms();
    TD_ASSERT_OK(td_trainer_create(&c, &t));
    const double took = td_now_ms() - before;
    /* The set-up's phases partition its time, within the call's. */
    td_setup_times su;
    td_trainer_setup_times(t, &su);
    const double phases[] = {su.backend_ms, su.pin_ms, su.touch_ms, su.init_ms, su.rest_ms};
    double sum = 0;
    for (int i = 0; i < 5; i++) {
        assert_true(phases[i] > 0); /* each phase does work; the clock has nanoseconds */
        sum += phases[i];
    }
    assert_true(su.total_ms > 0 && su.total_ms < 60e3 && fabs(sum - su.total_ms) <= 1e-6 * su.total_ms + 1e-9);
    assert_true(su.total_ms <= took);
    batches b = { .vocab = c.model.vocab_size, .n = (size_t)c.micro_batch * c.seq_len, .repeat = 1, .seed = 5 };
    td_step_result r, first = {0};
    for (int s = 0; s < 60; s++) {
        TD_ASSERT_OK(td_trainer_step(t, next_batch, &b, &r));
        if (s == 0) first = r;
    }
    assert_true(first.loss > 3.5);          /* about log 61 at init */
    assert_true(r.loss < 0.5 * first.loss); /* learnt */
    assert_true(r.grad_norm > 0 && isfinite(r.grad_norm));
    double eval;
    TD_ASSERT_OK(td_trainer_eval(t, next_batch, &b, 1, &eval, NULL));
    assert_true(eval < 0.6 * first.loss);
    td_trainer_destroy(t);
}

static void test_budget_too_small_names_minimum(void **state)
{
    td_train_config c = small_config();
    c.gpu_budget = 64 * 1024;
    td_trainer *t = NULL;
    td_status st = td_trainer_create(&c, &t);
    assert_int_equal(st, TD_ERR_BUDGET);
    assert_null(t);
    assert_non_null(strstr(td_error_msg(), "is below the minimum of"));
    /* The minimum it names works. */
    td_train_plan p;
    TD_ASSERT_OK(td_train_plan_make(&c, c.gpu_budget, &p));
    char want[64];
    char sz[32];
    snprintf(want, sizeof want, "minimum of %s", td_format_bytes(p.min_device_bytes, sz, sizeof sz));
    assert_non_null(strstr(td_error_msg(), want));
    /* A model whose state needs more pinned memory than allowed is refused up front. */
    c = small_config();
    c.host_pin_limit = 100 * 1024;
    assert_int_equal(td_trainer_create(&c, &t), TD_ERR_PIN);
    assert_non_null(strstr(td_error_msg(), "pin limit is 100.00 KiB"));
}

/* `tidal plan`'s minimum is enough: a run at exactly that budget trains,
 * and its measured peak stays within it. */
static void test_plan_minimum_is_enough(void **state)
{
    td_train_config c = small_config();
    c.mm.placement = TD_PLACEMENT_CPU;
    c.ckpt = TD_CKPT_ON;
    td_train_plan p;
    TD_ASSERT_OK(td_train_plan_make(&c, 0, &p));
    assert_int_equal(p.params, td_model_params_numel(&c.model));
    assert_true(p.role_bytes[TD_TENSOR_PARAM] >= p.params * 4);
    assert_int_equal(p.role_bytes[TD_TENSOR_PARAM], p.role_bytes[TD_TENSOR_ADAM_V]); /* mirrored layout */
    assert_true(p.min_device_bytes < p.full_device_bytes);
    c.gpu_budget = p.min_device_bytes;
    double losses[3];
    td_memmgr_stats st;
    run(&c, 3, losses, &st);
    assert_true(st.device_peak_bytes <= p.min_device_bytes);
    assert_true(st.evictions > 0);
#ifdef TD_HAVE_CUDA
    /* The plan knows where AdamW will run (no device needed to plan). */
    td_train_config g = small_config();
    g.backend = TD_BACKEND_CUDA;
    g.precision = TD_DTYPE_BF16;
    g.mm.placement = TD_PLACEMENT_CUDA;
    TD_ASSERT_OK(td_train_plan_make(&g, 0, &p));
    assert_true(p.gpu_optimizer);
    assert_true(p.adam_bytes_per_step == 0 && p.h2d_bytes_per_step == 0);
    assert_true(p.role_bytes[TD_TENSOR_MASTER] > 0); /* bf16 params get an fp32 master */
    g.mm.placement = TD_PLACEMENT_AUTO;
    TD_ASSERT_OK(td_train_plan_make(&g, p.min_device_bytes, &p)); /* too small for the whole state */
    assert_false(p.gpu_optimizer);
    assert_true(p.adam_bytes_per_step > 0);
#endif
    /* Other shapes too: the minimum holds for each. */
    td_rng rng;
    td_rng_seed(&rng, 7);
    for (int k = 0; k < 8; k++) {
        td_train_config v = small_config();
        v.mm.placement = TD_PLACEMENT_CPU;
        v.ckpt = k % 2 ? TD_CKPT_ON : TD_CKPT_OFF;
        v.model.n_layer = 1 + (int)td_rng_below(&rng, 4);
        v.model.n_head = 1 + (int)td_rng_below(&rng, 3);
        v.model.n_embd = v.model.n_head * (8 + 8 * (int)td_rng_below(&rng, 4));
        v.model.vocab_size = 20 + (int)td_rng_below(&rng, 200);
        v.model.padded_vocab_size = td_model_pad_vocab(v.model.vocab_size);
        TD_ASSERT_OK(td_train_plan_make(&v, 0, &p));
        v.gpu_budget = p.min_device_bytes;
        run(&v, 2, losses, &st);
        assert_true(st.device_peak_bytes <= p.min_device_bytes);
    }
}

/* The chunk size the layout picks (least padding, up to a block) can need
 * more of the device than a budget the smallest chunk (the largest block
 * tensor) fits: the plan then takes a smaller one and says which it gave up,
 * the trainer lays the model out at the plan's size, and a run at that
 * budget trains within it, with the losses of the layout's own pick (a
 * chunk's size moves bytes, not arithmetic).  A budget that holds the pick
 * keeps it. */
static void test_chunk_shrinks_for_the_budget(void **state)
{
    int found = 0;
    for (int k = 0; k < 16 && !found; k++) {
        int w = 1 + k % 4;
        td_train_config c = small_config();
        td_memmgr_params d = td_memmgr_default_params();
        c.mm.min_chunk_numel = d.min_chunk_numel; /* the layout's own search: auto */
        c.mm.max_chunk_numel = d.max_chunk_numel;
        c.model.n_embd = 32 * w;
        c.model.n_layer = 2 + k / 4;
        c.mm.placement = TD_PLACEMENT_CPU;
        c.ckpt = TD_CKPT_ON;
        td_train_plan pick, least;
        TD_ASSERT_OK(td_train_plan_make(&c, 0, &pick)); /* no budget: the padding's pick */
        assert_int_equal(pick.chunk_numel_least_padding, 0);
        td_train_config s = c;
        s.mm.chunk_numel = td_model_block_largest_numel(&c.model);
        TD_ASSERT_OK(td_train_plan_make(&s, 0, &least));
        if (least.min_device_bytes >= pick.min_device_bytes) continue; /* no smaller chunk needs less here */
        found = 1;
        /* A budget between the two: the plan shrinks the chunk and fits. */
        size_t budget = least.min_device_bytes;
        td_train_plan p;
        TD_ASSERT_OK(td_train_plan_make(&c, budget, &p));
        assert_true(p.chunk_numel < pick.chunk_numel);
        assert_int_equal(p.chunk_numel_least_padding, pick.chunk_numel);
        assert_true(p.min_device_bytes <= budget);
        td_train_config r = c;
        TD_ASSERT_OK(td_train_resolve_chunks(&r, budget));
        assert_int_equal(r.mm.chunk_numel, p.chunk_numel);
        /* The trainer's layout is the plan's, and the run keeps to the budget. */
        c.gpu_budget = budget;
        td_trainer *t;
        TD_ASSERT_OK(td_trainer_create(&c, &t));
        assert_int_equal(td_memmgr_chunk_numel(td_trainer_memmgr(t)), p.chunk_numel);
        td_trainer_destroy(t);
        double losses[2], ref[2];
        td_memmgr_stats st;
        run(&c, 2, losses, &st);
        assert_true(st.device_peak_bytes <= budget);
        td_train_config big = c;
        big.gpu_budget = pick.min_device_bytes; /* holds the pick: kept */
        TD_ASSERT_OK(td_train_plan_make(&big, big.gpu_budget, &p));
        assert_int_equal(p.chunk_numel, pick.chunk_numel);
        assert_int_equal(p.chunk_numel_least_padding, 0);
        run(&big, 2, ref, NULL);
        assert_memory_equal(losses, ref, sizeof ref);
    }
    assert_true(found);
}

/* Weight decay by tensor with compact AdamW state (bf16, int8) and no
 * --decay-all: each chunk's AdamW call carries its no-decay ranges (norm
 * gains and biases; int8 scale blocks they cut are requantized whole), so
 * the run trains (finite losses that fall), the optimizer chunks give
 * bit-identical losses homed on the device, on the host or split between
 * them, and the ranges matter (--decay-all gives other losses). */
static void test_compact_state_decay_by_tensor(void **state)
{
    enum { STEPS = 10 };
    for (int os = TD_OPTIM_STATE_BF16; os <= TD_OPTIM_STATE_INT8; os++) {
        td_train_config c = small_config();
        c.optim.state = (td_optim_state)os;
        c.optim.adam.weight_decay = 0.5; /* strong: decay by tensor and on everything part at once */
        c.optim.lr.lr = 1e-2;
        c.decay_all = 0;
        c.gpu_budget = 64 * TD_MiB;
        td_train_plan p;
        TD_ASSERT_OK(td_train_plan_make(&c, 0, &p));
        assert_true(p.role_bytes[TD_TENSOR_ADAM_M] * (os == TD_OPTIM_STATE_INT8 ? 3 : 1) < p.params * 4); /* compact */
        double ref[STEPS], losses[STEPS];
        c.mm.placement = TD_PLACEMENT_CPU;
        run(&c, STEPS, ref, NULL);
        for (int s = 0; s < STEPS; s++) assert_true(isfinite(ref[s]));
        print_message("%s state, decay by tensor: loss %.4f -> %.4f in %d steps\n",
                      td_optim_state_name((td_optim_state)os), ref[0], ref[STEPS - 1], STEPS);
        assert_true(ref[STEPS - 1] < ref[0] - 0.2);
        c.mm.placement = TD_PLACEMENT_CUDA; /* every optimizer chunk homed on the device */
        run(&c, STEPS, losses, NULL);
        assert_memory_equal(ref, losses, sizeof ref);
        c.mm.placement = TD_PLACEMENT_STATIC;
        c.mm.offload_optim_frac = 0.5;
        run(&c, STEPS, losses, NULL);
        assert_memory_equal(ref, losses, sizeof ref);
        c.mm.placement = TD_PLACEMENT_CPU;
        c.decay_all = 1;
        run(&c, STEPS, losses, NULL);
        assert_true(memcmp(ref, losses, sizeof ref) != 0);
    }
}

/* Per-chunk optimizer placement (#15): --offload-optim-frac F keeps the
 * (1 - F) share of optimizer chunks on the device, those with the least CPU
 * slack (the embedding's first); losses are bit-identical for every share
 * and policy (with and without clipping: the deferred and the immediate
 * update), fewer bytes go down as the device's share grows, and the budget
 * holds for each. */
static void test_optimizer_share_is_bit_identical(void **state)
{
    enum { STEPS = 3 };
    static const double fracs[] = {1.0, 0.5, 0.25, 0.0};
    for (int clip = 0; clip < 2; clip++) {
        td_train_config c = small_config();
        c.optim.max_grad_norm = clip ? 1.0 : 0.0;
        c.mm.placement = TD_PLACEMENT_STATIC;
        c.mm.offload_param_frac = 0;
        c.mm.offload_optim_frac = 0;
        td_train_plan full;
        TD_ASSERT_OK(td_train_plan_make(&c, (size_t)1 << 32, &full));
        size_t budget = full.full_device_bytes + 2 * full.largest_chunk_bytes + 4 * TD_ARENA_ALIGN;
        double ref[STEPS], losses[STEPS];
        uint64_t last_d2h = UINT64_MAX;
        int last_gpu = -1;
        for (size_t f = 0; f < sizeof fracs / sizeof fracs[0]; f++) {
            c.mm.offload_optim_frac = fracs[f];
            c.gpu_budget = budget;
            td_train_plan p;
            TD_ASSERT_OK(td_train_plan_make(&c, budget, &p));
            assert_int_equal(p.optim_gpu_chunks, p.optim_chunks - (int)(fracs[f] * p.optim_chunks + 0.5));
            assert_true(p.optim_gpu_chunks > last_gpu);
            last_gpu = p.optim_gpu_chunks;
            td_trainer *t;
            TD_ASSERT_OK(td_trainer_create(&c, &t));
            td_memmgr *mm = td_trainer_memmgr(t);
            /* The homes: the share asked, the embedding's chunk (needed first
             * by the next forward) the first kept, param and grad chunk too. */
            int on_dev = 0;
            for (int k = 0; k < p.optim_chunks; k++) {
                int dev = td_memmgr_chunk_home(mm, td_memmgr_role_chunk(mm, TD_TENSOR_ADAM_M, k)) == TD_HOME_DEVICE;
                on_dev += dev;
                assert_int_equal(td_memmgr_chunk_home(mm, td_memmgr_role_chunk(mm, TD_TENSOR_ADAM_V, k)) == TD_HOME_DEVICE, dev);
                if (dev) assert_int_equal(td_memmgr_chunk_home(mm, td_memmgr_role_chunk(mm, TD_TENSOR_GRAD, k)), TD_HOME_DEVICE);
            }
            assert_int_equal(on_dev, p.optim_gpu_chunks);
            if (on_dev)
                assert_int_equal(td_memmgr_chunk_home(mm, td_memmgr_role_chunk(mm, TD_TENSOR_ADAM_M, 0)), TD_HOME_DEVICE);
            batches b = { .vocab = c.model.vocab_size, .n = (size_t)c.micro_batch * c.seq_len };
            td_rng_seed(&b.rng, 99);
            td_step_result r;
            for (int s = 0; s < STEPS; s++) {
                TD_ASSERT_OK(td_trainer_step(t, next_batch, &b, &r));
                losses[s] = r.loss;
            }
            td_trainer_destroy(t);
            if (f == 0) memcpy(ref, losses, sizeof ref);
            assert_memory_equal(ref, losses, sizeof ref);
            assert_true(r.mm.device_peak_bytes <= budget);
            assert_true(r.mm.bytes_d2h < last_d2h);
            last_d2h = r.mm.bytes_d2h;
        }
        assert_int_equal(last_d2h, 0); /* all on the device: no grad goes down */
        /* The other policies: the same losses, each within its budget. */
        td_placement pols[] = {TD_PLACEMENT_AUTO, TD_PLACEMENT_AUTO, TD_PLACEMENT_CPU, TD_PLACEMENT_CUDA};
        size_t budgets[] = {budget, full.min_device_bytes + 3 * full.largest_chunk_bytes, 0, 0};
        for (int i = 0; i < 4; i++) {
            c.mm.placement = pols[i];
            c.mm.offload_optim_frac = 0;
            c.gpu_budget = budgets[i];
            td_memmgr_stats st;
            run(&c, STEPS, losses, &st);
            assert_memory_equal(ref, losses, sizeof ref);
            if (budgets[i]) assert_true(st.device_peak_bytes <= budgets[i]);
        }
    }
}

/* Auto takes as many optimizer chunks as the budget leaves room for: more
 * with a larger budget, all when everything fits, none at the minimum. */
static void test_auto_optimizer_share_follows_the_budget(void **state)
{
    td_train_config c = small_config();
    td_train_plan lo, mid, hi;
    TD_ASSERT_OK(td_train_plan_make(&c, 0, &lo));
    size_t min = lo.min_device_bytes, all = lo.full_device_bytes;
    TD_ASSERT_OK(td_train_plan_make(&c, min, &lo));
    assert_int_equal(lo.optim_gpu_chunks, 0);
    assert_true(lo.adam_cpu_params == (double)lo.params);
    TD_ASSERT_OK(td_train_plan_make(&c, (size_t)1 << 32, &hi));
    assert_true(hi.gpu_optimizer);
    assert_true(hi.adam_cpu_params == 0 && hi.d2h_bytes_per_step == 0);
    size_t between = all + 2 * lo.largest_chunk_bytes + (hi.optim_gpu_state_bytes / 2);
    TD_ASSERT_OK(td_train_plan_make(&c, between + between / 8, &mid));
    assert_true(mid.optim_gpu_chunks > 0 && mid.optim_gpu_chunks < mid.optim_chunks);
    assert_true(mid.d2h_bytes_per_step < lo.d2h_bytes_per_step);
    assert_true(mid.adam_cpu_params < (double)lo.params && mid.adam_cpu_params > 0);
    assert_true(mid.min_device_bytes <= between + between / 8);
    /* A static share that does not fit the budget is refused up front. */
    c.mm.placement = TD_PLACEMENT_STATIC;
    c.mm.offload_optim_frac = 0;
    c.gpu_budget = min;
    td_trainer *t = NULL;
    assert_int_equal(td_trainer_create(&c, &t), TD_ERR_BUDGET);
    assert_non_null(strstr(td_error_msg(), "--gpu-budget"));
}

/* Auto, where the params and grads do not all fit but the params do (with
 * the streaming minimum beside them): the GPU optimizer takes only the room
 * left after every param, so no param is loaded twice in a step: each host
 * -updated param chunk once (its update), the GPU's chunks never.  Filling
 * the budget with optimizer state instead evicted params the backward
 * reads again. */
static void test_auto_share_keeps_params_resident(void **state)
{
    td_train_config c = small_config();
    c.model.n_layer = 6;
    c.grad_accum = 1;
    td_train_plan p;
    TD_ASSERT_OK(td_train_plan_make(&c, 0, &p)); /* no budget: no GPU chunk, the streaming minimum alone */
    size_t keep = p.min_device_bytes + p.role_bytes[TD_TENSOR_PARAM];
    size_t resident = p.nonmodel_bytes + p.role_bytes[TD_TENSOR_PARAM] + p.role_bytes[TD_TENSOR_GRAD] +
                      2 * p.largest_chunk_bytes;
    assert_true(resident > keep);
    for (int q = 0; q < 3; q++) { /* budgets between the two */
        c.gpu_budget = keep + keep / 16 + (resident - keep) * (size_t)(q + 1) / 4;
        TD_ASSERT_OK(td_train_plan_make(&c, c.gpu_budget, &p));
        int n = p.optim_chunks, gpu = p.optim_gpu_chunks;
        if (!(gpu > 0 && gpu < n)) fail_msg("auto put %d of %d optimizer chunks on the GPU", gpu, n);
        td_trainer *t = NULL;
        TD_ASSERT_OK(td_trainer_create(&c, &t));
        assert_int_equal(td_trainer_optim_gpu_chunks(t, NULL), gpu); /* the trainer takes the plan's count */
        td_test_batches b = td_test_batches_of(&c, 5);
        td_step_result r;
        uint64_t before = 0;
        for (int s = 0; s < 4; s++) { /* the last step's loads (the stats count from the start) */
            before = s ? r.mm.loads : 0;
            TD_ASSERT_OK(td_trainer_step(t, td_test_next_batch, &b, &r));
        }
        td_trainer_destroy(t);
        if (r.mm.loads - before != (uint64_t)(n - gpu))
            fail_msg("budget %zu: %d host-updated param chunks, %llu loads in a step (%d of %d chunks on the GPU)",
                     c.gpu_budget, n - gpu, (unsigned long long)(r.mm.loads - before), gpu, n);
        assert_true(r.mm.device_peak_bytes <= c.gpu_budget);
    }
}

/* Auto, where every param and grad stays on the device: the first
 * optimizer chunks join them with a sixty-fourth of the budget to spare
 * (nothing streams), not the sixteenth a streaming run keeps; and the run
 * at that budget stays in it and loads no param twice. */
static void test_auto_share_beside_resident_model(void **state)
{
    td_train_config c = small_config();
    c.model.n_layer = 6;
    c.grad_accum = 1;
    td_train_plan p;
    TD_ASSERT_OK(td_train_plan_make(&c, 0, &p));
    size_t resident = p.nonmodel_bytes + p.role_bytes[TD_TENSOR_PARAM] + p.role_bytes[TD_TENSOR_GRAD] +
                      2 * p.largest_chunk_bytes;
    size_t step = resident / 4096, budget = resident + resident / 16; /* where params and grads stay */
    for (;; budget += step) { /* the smallest budget with an optimizer chunk on the GPU */
        TD_ASSERT_OK(td_train_plan_make(&c, budget, &p));
        if (p.optim_gpu_chunks > 0) break;
        assert_true(budget < 2 * resident);
    }
    assert_int_equal(p.nonmodel_bytes + p.role_bytes[TD_TENSOR_PARAM] + p.role_bytes[TD_TENSOR_GRAD] +
                         2 * p.largest_chunk_bytes,
                     resident); /* the same activations: the model's state alone changed */
    size_t with_one = resident + p.optim_gpu_state_bytes;
    if (budget >= with_one + with_one / 16)
        fail_msg("the first optimizer chunk joined at %zu, past %zu with a sixteenth to spare", budget,
                 with_one + with_one / 16);
    assert_true(budget >= with_one + with_one / 64);
    int n = p.optim_chunks, gpu = p.optim_gpu_chunks;
    c.gpu_budget = budget;
    td_trainer *t = NULL;
    TD_ASSERT_OK(td_trainer_create(&c, &t));
    assert_int_equal(td_trainer_optim_gpu_chunks(t, NULL), gpu);
    td_test_batches b = td_test_batches_of(&c, 5);
    td_step_result r;
    uint64_t before = 0;
    for (int s = 0; s < 4; s++) {
        before = s ? r.mm.loads : 0;
        TD_ASSERT_OK(td_trainer_step(t, td_test_next_batch, &b, &r));
    }
    td_trainer_destroy(t);
    if (r.mm.loads - before != (uint64_t)(n - gpu))
        fail_msg("%d host-updated param chunks, %llu loads in a step", n - gpu, (unsigned long long)(r.mm.loads - before));
    assert_true(r.mm.device_peak_bytes <= budget);
}

/* The step's bound from given rates: with one micro-batch the largest
 * term; with grad accumulation the CPU AdamW hides only within one
 * micro-batch's compute, and the rest adds to the compute; the host DRAM
 * term is the AdamW's bytes and the copies' at the loaded rate. */
static void test_bound_terms(void **state)
{
    td_train_config c = small_config();
    c.mm.placement = TD_PLACEMENT_CPU; /* every param through the CPU AdamW */
    c.optim.max_grad_norm = 0; /* no clipping: the AdamW may start in the backward */
    c.optim.scaler.kind = TD_LOSS_SCALE_NONE;
    for (int K = 1; K <= 4; K *= 2) {
        c.grad_accum = K;
        td_train_plan p;
        TD_ASSERT_OK(td_train_plan_make(&c, 0, &p));
        assert_true(p.adam_cpu_params > 0 && p.h2d_bytes_per_step > 0);
        td_train_rates r = {.copy_gbs = 1e3, .gflops = 1.0, .dram_gbs = 0, .dram_loaded_gbs = 0};
        td_train_bound b;
        td_train_bound_of(&c, &p, &r, &b);
        double compute = b.compute_ms;
        assert_true(compute > 0);
        for (double share = 0.1; share < 3; share += 0.2) { /* AdamW from a tenth of the compute to 3 times it */
            double adam = share * compute;
            r.adam_gps = p.adam_cpu_params / (adam * 1e-3) / 1e9;
            td_train_bound_of(&c, &p, &r, &b);
            assert_true(fabs(b.adam_ms - adam) <= 1e-9 * adam);
            double exposed = adam > compute / K ? adam - compute / K : 0;
            double want = fmax(compute + exposed, fmax(b.pcie_ms, adam));
            if (fabs(b.bound_ms - want) > 1e-9 * want)
                fail_msg("K %d, AdamW %.3f of compute: bound %.6f, want %.6f", K, share, b.bound_ms, want);
            if (K == 1) assert_true(fabs(b.bound_ms - fmax(fmax(compute, adam), b.pcie_ms)) <= 1e-9 * want);
        }
        /* host DRAM: the AdamW's bytes plus the copies', at the loaded rate;
         * it sets the bound when the loaded rate is low */
        r.dram_loaded_gbs = 1e-3;
        td_train_bound_of(&c, &p, &r, &b);
        double bytes = p.adam_cpu_params * p.adam_bytes_per_param + p.h2d_bytes_per_step + p.d2h_bytes_per_step;
        assert_true(fabs(b.dram_ms - bytes / 1e6 * 1e3) <= 1e-9 * b.dram_ms);
        assert_true(b.bound_ms == b.dram_ms);
    }
    /* From block times: every block's forward and backward, and a recompute
     * (a forward without its last projection) for each checkpointed block;
     * the forward's time stands in where the recompute was not measured. */
    c.grad_accum = 2;
    c.ckpt = TD_CKPT_ON;
    c.ckpt_blocks = 0; /* all */
    td_train_plan p;
    TD_ASSERT_OK(td_train_plan_make(&c, 0, &p));
    assert_int_equal(p.ckpt_blocks, c.model.n_layer);
    td_train_rates r = {.copy_gbs = 1e3, .gflops = 1e3, .block_fwd_ms = 2.0, .block_bwd_ms = 5.0};
    td_train_bound b0, b1;
    td_train_bound_of(&c, &p, &r, &b0);
    r.block_recompute_ms = 1.5;
    td_train_bound_of(&c, &p, &r, &b1);
    double L = c.model.n_layer;
    assert_true(fabs(b0.compute_ms - b1.compute_ms - 2 * L * 0.5) <= 1e-9 * b0.compute_ms);
    double head = 6.0 * c.micro_batch * c.seq_len * c.model.n_embd * (double)c.model.padded_vocab_size / 1e12 * 1e3;
    assert_true(fabs(b1.compute_ms - 2 * (L * 7.0 + L * 1.5 + head)) <= 1e-9 * b1.compute_ms);
    /* Clipping (or a loss scale): the AdamW waits for every grad's norm and
     * hides only in the next step's first forward (the blocks' forwards and
     * the head's third; without block times a third of a micro-batch's
     * compute), whatever the accumulation. */
    for (int clip = 0; clip < 2; clip++) {
        c.optim.max_grad_norm = clip ? 1.0 : 0;
        c.optim.scaler.kind = clip ? TD_LOSS_SCALE_NONE : TD_LOSS_SCALE_DYNAMIC;
        for (int timed = 0; timed < 2; timed++) {
            td_train_rates rr = {.copy_gbs = 1e3, .gflops = 1e3, .block_fwd_ms = timed ? 2.0 : 0,
                                 .block_bwd_ms = timed ? 5.0 : 0, .block_recompute_ms = timed ? 1.5 : 0};
            td_train_bound_of(&c, &p, &rr, &b0);
            double fwd = timed ? L * 2.0 + head / 3 : b0.compute_ms / c.grad_accum / 3;
            for (double share = 0.1; share < 3; share += 0.2) {
                double adam = share * b0.compute_ms;
                rr.adam_gps = p.adam_cpu_params / (adam * 1e-3) / 1e9;
                td_train_bound_of(&c, &p, &rr, &b1);
                double exposed = adam > fwd ? adam - fwd : 0;
                if (fabs(b1.exposed_adam_ms - exposed) > 1e-9 * adam + 1e-12 ||
                    fabs(b1.bound_ms - fmax(b1.compute_ms + exposed, fmax(b1.pcie_ms, adam))) > 1e-9 * b1.bound_ms)
                    fail_msg("%s, %s: AdamW %.3f of compute: exposed %.6f (want %.6f), bound %.6f",
                             clip ? "clipping" : "loss scale", timed ? "block times" : "matmul rate", share,
                             b1.exposed_adam_ms, exposed, b1.bound_ms);
            }
        }
    }
}

/* The CPU AdamW probe runs at the run's scale: the model's params, from
 * 64 Mi (beyond the last-level cache) to 256 Mi. */
static void test_adam_probe_params(void **state)
{
    (void)state;
    td_train_config c = small_config();
    assert_true(td_model_params_numel(&c.model) < TD_TRAIN_ADAM_PROBE_PARAMS);
    assert_true(td_train_adam_probe_params(&c) == TD_TRAIN_ADAM_PROBE_PARAMS);
    const char *names[] = {"gpt2-350m", "gpt2-1.5b"};
    for (int i = 0; i < 2; i++) {
        TD_ASSERT_OK(td_model_preset(names[i], &c.model));
        size_t n = td_model_params_numel(&c.model), want = n;
        if (want < TD_TRAIN_ADAM_PROBE_PARAMS) want = TD_TRAIN_ADAM_PROBE_PARAMS;
        if (want > TD_TRAIN_ADAM_PROBE_MAX_PARAMS) want = TD_TRAIN_ADAM_PROBE_MAX_PARAMS;
        if (td_train_adam_probe_params(&c) != want) fail_msg("%s: %zu params, probe %zu, want %zu", names[i], n,
                                                             td_train_adam_probe_params(&c), want);
    }
    assert_true(td_train_adam_probe_params(&c) == TD_TRAIN_ADAM_PROBE_MAX_PARAMS); /* 1.5B */
    TD_ASSERT_OK(td_model_preset("gpt2-350m", &c.model)); /* 354M params... */
    c.model.n_layer = 8; /* ...with 8 blocks ~152M: between the two */
    size_t n = td_model_params_numel(&c.model);
    assert_true(n > TD_TRAIN_ADAM_PROBE_PARAMS && n < TD_TRAIN_ADAM_PROBE_MAX_PARAMS);
    assert_true(td_train_adam_probe_params(&c) == n);
}

/* --gpu-budget's default: all of the run resident plus an eighth, at most
 * the cap; a run at it keeps everything on the device (no eviction). */
static void test_default_budget_keeps_the_run_resident(void **state)
{
    td_train_config c = small_config();
    td_train_plan p;
    size_t budget = 0, cap = (size_t)1 << 32;
    TD_ASSERT_OK(td_train_default_budget(&c, cap, &budget));
    TD_ASSERT_OK(td_train_plan_make(&c, budget, &p));
    /* Everything fits the cap: the optimizer state stays on the device too
     * (then nothing streams and no chunk slot is kept spare). */
    assert_true(p.gpu_optimizer);
    size_t resident = p.full_device_bytes;
    assert_int_equal(budget, td_align_up(resident + resident / 8, TD_ARENA_ALIGN));
    assert_true(budget >= p.min_device_bytes);
    TD_ASSERT_OK(td_train_default_budget(&c, p.full_device_bytes / 2, &budget));
    assert_int_equal(budget, p.full_device_bytes / 2); /* capped */
    double losses[3];
    td_memmgr_stats st;
    c.gpu_budget = 0;
    run(&c, 3, losses, &st);
    assert_int_equal(st.evictions, 0);
    /* A vocabulary whose embedding chunk dwarfs the blocks: the default
     * still trains (it covers the plan's minimum). */
    td_train_config v = small_config();
    v.model.vocab_size = 50257;
    v.model.padded_vocab_size = td_model_pad_vocab(v.model.vocab_size);
    TD_ASSERT_OK(td_train_default_budget(&v, cap, &budget));
    TD_ASSERT_OK(td_train_plan_make(&v, budget, &p));
    assert_true(budget >= p.min_device_bytes && budget >= p.full_device_bytes);
#ifdef TD_HAVE_CUDA
    /* On CUDA the optimizer state comes too when AdamW then runs on the GPU,
     * and the budget keeps the choices the whole device would make. */
    td_train_config g = small_config();
    g.backend = TD_BACKEND_CUDA;
    g.precision = TD_DTYPE_BF16;
    td_train_plan big, at;
    TD_ASSERT_OK(td_train_plan_make(&g, cap, &big));
    assert_true(big.gpu_optimizer);
    TD_ASSERT_OK(td_train_default_budget(&g, cap, &budget));
    assert_true(budget < cap);
    TD_ASSERT_OK(td_train_plan_make(&g, budget, &at));
    assert_true(at.gpu_optimizer);
    assert_int_equal(at.ckpt_blocks, big.ckpt_blocks);
    size_t model_state = 0;
    for (int r = 0; r < TD_TENSOR_ROLE_COUNT; r++) model_state += at.role_bytes[r];
    assert_true(budget >= at.nonmodel_bytes + model_state + (at.nonmodel_bytes + model_state) / 16);
#endif
}

/* td_train_budget_resolve, the one decision of the device budget, on the
 * cpu backend (no margin) with a "device" of 64 MiB: the default, max, a
 * search's default, a given budget, sizes too small to reserve, a device
 * with nothing free, and no device at all.  The trainer takes what it says. */
static void test_budget_resolve(void **state)
{
    td_backend_params bp = td_backend_default_params();
    bp.kind = TD_BACKEND_CPU;
    bp.cpu_device_bytes = 64 * TD_MiB + 100; /* not a multiple of the alignment: the cap rounds down */
    td_backend *b;
    TD_ASSERT_OK(td_backend_create(&bp, &b));
    td_train_config c = small_config();
    td_train_budget tb;
    size_t cap = 64 * TD_MiB, want;
    /* default: the run resident plus an eighth, at most the cap */
    c.gpu_budget = TD_GPU_BUDGET_DEFAULT;
    TD_ASSERT_OK(td_train_budget_resolve(&c, b, TD_BUDGET_USE_RUN, &tb));
    assert_int_equal(tb.origin, TD_BUDGET_DEFAULT);
    assert_int_equal(tb.margin_bytes, 0);
    assert_int_equal(tb.free_bytes, bp.cpu_device_bytes);
    assert_int_equal(tb.total_bytes, bp.cpu_device_bytes);
    assert_int_equal(tb.cap_bytes, cap);
    TD_ASSERT_OK(td_train_default_budget(&c, cap, &want));
    assert_int_equal(tb.budget_bytes, want);
    assert_true(want < cap && want % TD_ARENA_ALIGN == 0);
    /* a search (tune, plan --largest) takes the cap by default */
    TD_ASSERT_OK(td_train_budget_resolve(&c, b, TD_BUDGET_USE_SEARCH, &tb));
    assert_int_equal(tb.origin, TD_BUDGET_CAP);
    assert_int_equal(tb.budget_bytes, cap);
    /* max: the cap, for a run too */
    c.gpu_budget = TD_GPU_BUDGET_MAX;
    TD_ASSERT_OK(td_train_budget_resolve(&c, b, TD_BUDGET_USE_RUN, &tb));
    assert_int_equal(tb.origin, TD_BUDGET_CAP);
    assert_int_equal(tb.budget_bytes, cap);
    /* given: as it is, beyond the free memory too (whether it fits is the plan's question) */
    size_t given[] = {TD_ARENA_ALIGN, 3 * TD_MiB + 7, 128 * TD_MiB};
    for (int i = 0; i < 3; i++) {
        c.gpu_budget = given[i];
        for (int use = 0; use < 2; use++) {
            TD_ASSERT_OK(td_train_budget_resolve(&c, b, (td_budget_use)use, &tb));
            assert_int_equal(tb.origin, TD_BUDGET_GIVEN);
            assert_int_equal(tb.budget_bytes, given[i]);
            assert_int_equal(tb.cap_bytes, 0);
            assert_int_equal(tb.free_bytes, bp.cpu_device_bytes);
        }
    }
    /* too small to reserve */
    c.gpu_budget = TD_ARENA_ALIGN - 1;
    assert_int_equal(td_train_budget_resolve(&c, b, TD_BUDGET_USE_RUN, &tb), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "--gpu-budget 255 bytes is below"));
    /* a device with nothing free: the default and max cannot be sized, a given budget still resolves */
    void *all;
    TD_ASSERT_OK(td_backend_dev_reserve(b, bp.cpu_device_bytes - 100, &all));
    for (int k = 0; k < 2; k++) {
        c.gpu_budget = k ? TD_GPU_BUDGET_MAX : TD_GPU_BUDGET_DEFAULT;
        assert_int_equal(td_train_budget_resolve(&c, b, TD_BUDGET_USE_RUN, &tb), TD_ERR_DEVICE_MEM);
        assert_non_null(strstr(td_error_msg(), "of device memory is free"));
        assert_non_null(strstr(td_error_msg(), "give --gpu-budget SIZE"));
    }
    c.gpu_budget = TD_MiB;
    TD_ASSERT_OK(td_train_budget_resolve(&c, b, TD_BUDGET_USE_RUN, &tb));
    assert_int_equal(tb.free_bytes, 100);
    td_backend_dev_release(b, all);
    td_backend_free(b);
    /* no device (planning for one this machine lacks): only a given budget */
    TD_ASSERT_OK(td_train_budget_resolve(&c, NULL, TD_BUDGET_USE_RUN, &tb));
    assert_int_equal(tb.budget_bytes, TD_MiB);
    assert_int_equal(tb.free_bytes, 0);
    c.gpu_budget = TD_GPU_BUDGET_DEFAULT;
    assert_int_equal(td_train_budget_resolve(&c, NULL, TD_BUDGET_USE_RUN, &tb), TD_ERR_UNSUPPORTED);
    assert_non_null(strstr(td_error_msg(), "no device here"));
    assert_int_equal(td_train_budget_resolve(NULL, NULL, TD_BUDGET_USE_RUN, &tb), TD_ERR_INVALID);
    /* The trainer reserves what the resolution says, and reports how it was decided. */
    td_trainer *t;
    setenv("TD_CPU_DEVICE_BYTES", "64MiB", 1); /* the trainer's own backend: max takes all of it */
    for (int k = 0; k < 3; k++) {
        c.gpu_budget = k == 0 ? TD_GPU_BUDGET_DEFAULT : k == 1 ? TD_GPU_BUDGET_MAX : 48 * TD_MiB;
        TD_ASSERT_OK(td_trainer_create(&c, &t));
        const td_train_budget *r = td_trainer_budget(t);
        td_arena_stats as;
        td_arena_get_stats(td_trainer_arena(t), &as);
        assert_int_equal(as.budget_bytes, r->budget_bytes);
        assert_int_equal(r->origin, k == 0 ? TD_BUDGET_DEFAULT : k == 1 ? TD_BUDGET_CAP : TD_BUDGET_GIVEN);
        assert_int_equal(td_trainer_config(t)->gpu_budget, r->budget_bytes);
        if (k == 2) assert_int_equal(r->budget_bytes, 48 * TD_MiB);
        else assert_true(r->cap_bytes == cap && r->budget_bytes <= cap);
        td_trainer_destroy(t);
    }
    unsetenv("TD_CPU_DEVICE_BYTES");
}

/* The demo corpus is learnt: a small model on Debian's fortunes (byte
 * tokens) gets below 3.0 nats within 200 steps (it starts near log 257 = 5.55). */
#include "tidal/data.h"
#include <dirent.h>

static td_status loader_batch(void *ctx, int32_t *tokens, int32_t *targets, int32_t *positions)
{
    return td_loader_next(ctx, tokens, targets, positions);
}

static void test_fortunes_loss_falls(void **state)
{
    const char *dir = "/usr/share/games/fortunes";
    char path[] = "/tmp/tidal-fortunes-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    td_tokfile_writer *w;
    TD_ASSERT_OK(td_tokfile_writer_open(path, TD_TOKENIZER_BYTE, 257, 256, &w));
    static const char *files[] = {"fortunes", "literature", "riddles", "people", "wisdom", "science"};
    size_t total = 0;
    for (size_t k = 0; k < sizeof files / sizeof files[0]; k++) {
        char name[512];
        snprintf(name, sizeof name, "%s/%s", dir, files[k]);
        FILE *f = fopen(name, "rb");
        if (!f) continue;
        unsigned char buf[4096];
        uint32_t ids[4096];
        size_t n;
        while ((n = fread(buf, 1, sizeof buf, f)) > 0) {
            for (size_t i = 0; i < n; i++) ids[i] = buf[i];
            TD_ASSERT_OK(td_tokfile_writer_append(w, ids, n));
            total += n;
        }
        fclose(f);
    }
    TD_ASSERT_OK(td_tokfile_writer_commit(w));
    if (total < 100000) fail_msg("the fortunes corpus is missing from %s (make deps installs it)", dir);
    td_loader_params lp = td_loader_default_params();
    lp.batch = 8;
    lp.seq = 64;
    lp.seed = 1;
    td_loader *l;
    TD_ASSERT_OK(td_loader_open(path, &lp, &l));
    td_train_config c = td_train_default_config();
    c.model = (td_model_desc){ .n_layer = 2, .n_head = 4, .n_embd = 64, .n_positions = 64,
                                   .vocab_size = 257, .padded_vocab_size = 320 };
    c.micro_batch = 8;
    c.seq_len = 64;
    c.backend = TD_BACKEND_CPU;
    c.gpu_budget = 16 * TD_MiB;
    /* Under ASan the memory of 60 steps (whose last 20 average 3.26 in the
     * plain build), from a uniform guess's ln 257 = 5.55. */
    const int steps = TD_TEST_SANITIZED ? 60 : 200;
    const double below = TD_TEST_SANITIZED ? 3.5 : 3.0;
    c.optim.lr = (td_lr_schedule){ .decay = TD_LR_DECAY_COSINE, .lr = 3e-3, .min_lr = 3e-4, .warmup_steps = 20,
                                   .total_steps = steps };
    td_trainer *t;
    TD_ASSERT_OK(td_trainer_create(&c, &t));
    td_step_result r = {0};
    double last20 = 0;
    for (int s = 0; s < steps; s++) {
        TD_ASSERT_OK(td_trainer_step(t, loader_batch, l, &r));
        if (s >= steps - 20) last20 += r.loss / 20;
    }
    print_message("fortunes: mean loss of steps %d-%d: %.3f (below %.2f)\n", steps - 19, steps, last20, below);
    assert_true(last20 < below);
    td_trainer_destroy(t);
    td_loader_destroy(l);
    unlink(path);
}

/* Save after 3 steps, resume in a fresh trainer: steps 4-6 give the same
 * losses, bit for bit, as an uninterrupted run; the weights alone load too. */
#include "tidal/checkpoint.h"

/* The start of a resume test: `cut` steps of a fresh trainer over the
 * batches of the straight run (seed 99), and a fresh folder for its
 * checkpoint (dir; ckpt, dir/run). */
static td_trainer *train_to_cut(const td_train_config *c, int cut, batches *b, char dir[23], char *ckpt,
                                size_t ckpt_bytes)
{
    strcpy(dir, "/tmp/tidal-ckpt-XXXXXX");
    assert_non_null(mkdtemp(dir));
    snprintf(ckpt, ckpt_bytes, "%s/run", dir);
    *b = (batches){ .vocab = c->model.vocab_size, .n = (size_t)c->micro_batch * c->seq_len };
    td_rng_seed(&b->rng, 99);
    td_trainer *t;
    TD_ASSERT_OK(td_trainer_create(c, &t));
    td_step_result r;
    for (int s = 0; s < cut; s++) TD_ASSERT_OK(td_trainer_step(t, next_batch, b, &r));
    return t;
}

/* Steps [from, to) of t over b give the straight run's losses bit for bit. */
static void expect_straight(td_trainer *t, batches *b, int from, int to, const double *straight, const char *after)
{
    td_step_result r;
    for (int s = from; s < to; s++) {
        TD_ASSERT_OK(td_trainer_step(t, next_batch, b, &r));
        if (memcmp(&r.loss, &straight[s], sizeof r.loss) != 0)
            fail_msg("step %d after %s: %.17g != %.17g", s + 1, after, r.loss, straight[s]);
    }
}

static void test_resume_is_bit_exact(void **state)
{
    enum { STEPS = 6, CUT = 3 };
    td_train_config c = small_config();
    c.mm.placement = TD_PLACEMENT_CPU;
    double straight[STEPS];
    run(&c, STEPS, straight, NULL);

    char dir[23], ckpt[300];
    batches b;
    td_trainer *t = train_to_cut(&c, CUT, &b, dir, ckpt, sizeof ckpt);
    char rng[4][32];
    for (int k = 0; k < 4; k++) snprintf(rng[k], sizeof rng[k], "%llu", (unsigned long long)b.rng.s[k]);
    const char *meta[] = {"rng0", rng[0], "rng1", rng[1], "rng2", rng[2], "rng3", rng[3], NULL};
    TD_ASSERT_OK(td_trainer_save(t, ckpt, 1, meta));
    td_trainer_destroy(t);

    TD_ASSERT_OK(td_trainer_create(&c, &t));
    td_ckpt_reader *rd;
    TD_ASSERT_OK(td_trainer_load(t, ckpt, 1, &rd));
    batches b2 = b;
    for (int k = 0; k < 4; k++) {
        char key[16]; /* "rng" and any int */
        snprintf(key, sizeof key, "rng%d", k);
        uint64_t v;
        TD_ASSERT_OK(td_ckpt_reader_meta_u64(rd, key, &v));
        b2.rng.s[k] = v;
    }
    td_ckpt_reader_close(rd);
    assert_int_equal(td_trainer_optim(t)->step, CUT);
    expect_straight(t, &b2, CUT, STEPS, straight, "resume");
    td_trainer_destroy(t);

    /* Weights only (--init): the same model, a fresh optimizer. */
    td_model_desc mc;
    TD_ASSERT_OK(td_trainer_checkpoint_model(ckpt, &mc));
    assert_memory_equal(&mc, &c.model, sizeof mc);
    TD_ASSERT_OK(td_trainer_create(&c, &t));
    TD_ASSERT_OK(td_trainer_load(t, ckpt, 0, NULL));
    assert_int_equal(td_trainer_optim(t)->step, 0);
    /* A checkpoint of another shape is refused, naming the mismatch. */
    td_train_config other = c;
    other.model.n_embd = 16;
    other.model.n_head = 2;
    td_trainer *t2;
    TD_ASSERT_OK(td_trainer_create(&other, &t2));
    assert_int_not_equal(td_trainer_load(t2, ckpt, 0, NULL), TD_OK);
    assert_non_null(strstr(td_error_msg(), "loading checkpoint"));
    td_trainer_destroy(t2);
    td_trainer_destroy(t);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}


/* A run's losses and, after td_trainer_finish_update, every param's bytes
 * (fp32 on the cpu backend), in tensor order. */
static void run_with_params(const td_train_config *c, int steps, double *losses, float **params, size_t *n_params)
{
    td_trainer *t;
    TD_ASSERT_OK(td_trainer_create(c, &t));
    td_test_batches b = { .vocab = c->model.vocab_size, .n = (size_t)c->micro_batch * c->seq_len };
    td_rng_seed(&b.rng, 99);
    for (int s = 0; s < steps; s++) {
        td_step_result r;
        TD_ASSERT_OK(td_trainer_step(t, td_test_next_batch, &b, &r));
        losses[s] = r.loss;
    }
    TD_ASSERT_OK(td_trainer_finish_update(t));
    td_memmgr *mm = td_trainer_memmgr(t);
    int n = td_model_tensor_count(&c->model);
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        int id;
        td_trainer_tensor_ids(t, i, &id, NULL, NULL, NULL);
        total += td_memmgr_tensor_numel(mm, id);
    }
    float *all = malloc(total * sizeof *all);
    assert_non_null(all);
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        int id;
        void *h;
        td_trainer_tensor_ids(t, i, &id, NULL, NULL, NULL);
        TD_ASSERT_OK(td_memmgr_host_access(mm, &id, 1, TD_ACCESS_READ, &h));
        size_t k = td_memmgr_tensor_numel(mm, id);
        memcpy(all + at, h, k * sizeof *all);
        at += k;
    }
    td_trainer_destroy(t);
    *params = all;
    *n_params = total;
}

/* The AdamW on a thread of its own (--adam-thread on) gives the losses and
 * the params of the same run without it, bit for bit: with and without
 * clipping (updates in the backward, or handed over for the next forward),
 * with gradient accumulation, with part of the optimizer on the device, and
 * under a budget that evicts. */
static void test_adam_thread_is_bit_identical(void **state)
{
    enum { STEPS = 4 };
    struct { double clip; int accum; td_placement pol; double optim_frac; int tight; } cases[] = {
        {0, 1, TD_PLACEMENT_CPU, 0, 0},    {1.0, 1, TD_PLACEMENT_CPU, 0, 0},  {0, 2, TD_PLACEMENT_CPU, 0, 0},
        {1.0, 2, TD_PLACEMENT_CPU, 0, 0},  {0, 1, TD_PLACEMENT_STATIC, 0.5, 0}, {1.0, 1, TD_PLACEMENT_STATIC, 0.5, 0},
        {0, 2, TD_PLACEMENT_AUTO, 1, 1},   {1.0, 1, TD_PLACEMENT_AUTO, 1, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        td_train_config c = small_config();
        c.optim.max_grad_norm = cases[i].clip;
        c.grad_accum = cases[i].accum;
        c.mm.placement = cases[i].pol;
        c.mm.offload_param_frac = 0;
        c.mm.offload_optim_frac = cases[i].optim_frac;
        if (cases[i].tight) {
            td_train_plan p;
            TD_ASSERT_OK(td_train_plan_make(&c, (size_t)1 << 32, &p));
            c.gpu_budget = p.min_device_bytes + 2 * p.largest_chunk_bytes;
        }
        double off[STEPS], on[STEPS];
        float *p_off, *p_on;
        size_t n_off, n_on;
        c.adam_thread = -1;
        run_with_params(&c, STEPS, off, &p_off, &n_off);
        c.adam_thread = 1;
        run_with_params(&c, STEPS, on, &p_on, &n_on);
        if (memcmp(off, on, sizeof off))
            fail_msg("case %zu: losses %.9g %.9g %.9g %.9g against %.9g %.9g %.9g %.9g", i, on[0], on[1], on[2], on[3],
                     off[0], off[1], off[2], off[3]);
        assert_int_equal(n_off, n_on);
        assert_memory_equal(p_off, p_on, n_off * sizeof *p_off);
        /* and the run learned something: the updates happened */
        assert_true(on[STEPS - 1] < on[0]);
        free(p_off);
        free(p_on);
    }
}

/* A step's CPU AdamW figures: with the optimizer on the host, each step
 * after the first takes updates back and reports their CPU time (the first
 * step's updates finish in the second's forward, without clipping); only
 * the AdamW thread makes the driving thread wait; with every optimizer
 * chunk on the device no CPU AdamW runs. */
static void test_step_reports_cpu_adam_time(void **state)
{
    struct { int thread; td_placement pol; int cpu; } cases[] = {
        {1, TD_PLACEMENT_CPU, 1}, {-1, TD_PLACEMENT_CPU, 1}, {1, TD_PLACEMENT_STATIC, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        td_train_config c = small_config();
        c.optim.max_grad_norm = 0;
        c.adam_thread = cases[i].thread;
        c.mm.placement = cases[i].pol;
        c.mm.offload_param_frac = 0;
        c.mm.offload_optim_frac = 0; /* static: every optimizer chunk on the device */
        td_trainer *t;
        TD_ASSERT_OK(td_trainer_create(&c, &t));
        td_test_batches b = { .vocab = c.model.vocab_size, .n = (size_t)c.micro_batch * c.seq_len };
        td_rng_seed(&b.rng, 7);
        for (int s = 0; s < 3; s++) {
            td_step_result r;
            TD_ASSERT_OK(td_trainer_step(t, td_test_next_batch, &b, &r));
            assert_true(r.step_ms > 0 && r.step_ms < 60e3);
            assert_true(r.adam_cpu_ms >= 0 && r.adam_wait_ms >= 0 && r.adam_wait_ms <= r.step_ms);
            if (!cases[i].cpu || cases[i].thread < 0) assert_true(r.adam_wait_ms == 0.0);
            if (!cases[i].cpu) assert_true(r.adam_cpu_ms == 0.0);
            else if (s > 0 && r.adam_cpu_ms <= 0.0) fail_msg("case %zu step %d: no CPU AdamW time", i, s + 1);
        }
        td_trainer_destroy(t);
    }
}

/* The micro-batch hook: called after each micro-batch of a step of several,
 * k = 1 .. accum in order, each step; never with one micro-batch a step. */
typedef struct mb_calls { int k[64], accum[64], n; } mb_calls;

static void note_microbatch(void *ctx, int k, int accum)
{
    mb_calls *c = ctx;
    if (c->n < 64) c->k[c->n] = k, c->accum[c->n] = accum;
    c->n++;
}

static void test_microbatch_hook(void **state)
{
    for (int accum = 1; accum <= 3; accum++) {
        td_train_config c = small_config();
        c.grad_accum = accum;
        td_trainer *t;
        TD_ASSERT_OK(td_trainer_create(&c, &t));
        mb_calls calls = {0};
        td_trainer_set_microbatch_fn(t, note_microbatch, &calls);
        td_test_batches b = td_test_batches_of(&c, 5);
        for (int s = 0; s < 2; s++) {
            td_step_result r;
            TD_ASSERT_OK(td_trainer_step(t, td_test_next_batch, &b, &r));
        }
        assert_int_equal(calls.n, accum > 1 ? 2 * accum : 0);
        for (int i = 0; i < calls.n; i++) {
            assert_int_equal(calls.k[i], i % accum + 1);
            assert_int_equal(calls.accum[i], accum);
        }
        td_trainer_set_microbatch_fn(t, NULL, NULL); /* off again: a step calls nothing */
        td_step_result r;
        TD_ASSERT_OK(td_trainer_step(t, td_test_next_batch, &b, &r));
        assert_int_equal(calls.n, accum > 1 ? 2 * accum : 0);
        td_trainer_destroy(t);
    }
}

/* A step that fails after handing its chunks to the AdamW thread (non-finite
 * grads without clipping: the updates had begun) leaves nothing running
 * behind: td_trainer_finish_update takes every update back, after which
 * the host copies hold still (a save would read them). */
static void test_failed_step_drains_the_adam_thread(void **state)
{
    td_train_config c = small_config();
    c.grad_accum = 1;
    c.optim.max_grad_norm = 0;
    c.mm.placement = TD_PLACEMENT_CPU;
    c.adam_thread = 1;
    td_trainer *t;
    TD_ASSERT_OK(td_trainer_create(&c, &t));
    td_test_batches b = td_test_batches_of(&c, 3);
    td_step_result r;
    TD_ASSERT_OK(td_trainer_step(t, td_test_next_batch, &b, &r));
    td_fault_arm(TD_FAULT_NONFINITE_GRAD, 1);
    assert_int_equal(td_trainer_step(t, td_test_next_batch, &b, &r), TD_ERR_STATE);
    td_fault_disarm_all();
    assert_non_null(strstr(td_error_msg(), "non-finite"));
    /* the chunks handed over in the backward are still the thread's, */
    int held = td_trainer_updates_pending(t);
    print_message("after the failed step: %d param chunk updates held\n", held);
    assert_true(held > 0);
    TD_ASSERT_OK(td_trainer_finish_update(t));
    /* and none after the drain */
    assert_int_equal(td_trainer_updates_pending(t), 0);
    td_memmgr *mm = td_trainer_memmgr(t);
    int id;
    void *h;
    td_trainer_tensor_ids(t, 0, &id, NULL, NULL, NULL);
    TD_ASSERT_OK(td_memmgr_host_access(mm, &id, 1, TD_ACCESS_READ, &h));
    size_t n = td_memmgr_tensor_numel(mm, id);
    float *before = malloc(n * sizeof *before);
    assert_non_null(before);
    memcpy(before, h, n * sizeof *before);
    usleep(20000);
    TD_ASSERT_OK(td_memmgr_host_access(mm, &id, 1, TD_ACCESS_READ, &h));
    assert_memory_equal(before, h, n * sizeof *before);
    free(before);
    td_trainer_destroy(t);
}

/* With the AdamW thread and updates still running at a step's end (no
 * clipping: taken back by the next forward), a checkpoint saved then and
 * an eval in between see the updated weights: the resumed run continues
 * bit for bit, and the eval changes nothing. */
static void test_resume_with_the_adam_thread(void **state)
{
    enum { STEPS = 6, CUT = 3 };
    td_train_config c = small_config();
    c.grad_accum = 1;
    c.optim.max_grad_norm = 0;
    c.mm.placement = TD_PLACEMENT_CPU;
    c.adam_thread = 1;
    double straight[STEPS];
    run(&c, STEPS, straight, NULL);
    char dir[23], ckpt[300];
    batches b;
    td_trainer *t = train_to_cut(&c, CUT, &b, dir, ckpt, sizeof ckpt);
    TD_ASSERT_OK(td_trainer_save(t, ckpt, 1, NULL));
    batches e = { .vocab = c.model.vocab_size, .n = (size_t)c.micro_batch * c.seq_len };
    td_rng_seed(&e.rng, 5);
    double eval_loss;
    TD_ASSERT_OK(td_trainer_eval(t, next_batch, &e, 2, &eval_loss, NULL));
    expect_straight(t, &b, CUT, STEPS, straight, "an eval");
    td_trainer_destroy(t);
    td_rng_seed(&b.rng, 99);
    for (int s = 0; s < CUT; s++) TD_ASSERT_OK(next_batch(&b, (int32_t[64]){0}, (int32_t[64]){0}, NULL));
    TD_ASSERT_OK(td_trainer_create(&c, &t));
    TD_ASSERT_OK(td_trainer_load(t, ckpt, 1, NULL));
    expect_straight(t, &b, CUT, STEPS, straight, "resume");
    td_trainer_destroy(t);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}


/* The head and the loss over chunks of rows give the losses of one chunk
 * of all rows, bit for bit, over steps (so the head's gradients are the
 * same bits too), for GPT-2 and the rotary families, chunks that divide the
 * rows and a ragged last one; sampling's logits come out of whichever
 * chunk holds their row; the plan holds one chunk's logits, not B*T rows'. */
static void test_loss_chunks_are_bit_identical(void **state)
{
    enum { STEPS = 3 };
    const char *families[] = {"gpt2", "llama", "gemma"};
    for (size_t f = 0; f < sizeof families / sizeof families[0]; f++) {
        td_train_config c = small_config();
        td_model_desc_set_family(&c.model, families[f]);
        if (f) {
            c.model.n_kv_head = 1;
            c.model.n_inner = 40;
            c.model.untied_head = f == 1;
        }
        TD_ASSERT_OK(td_model_desc_check(&c.model));
        const int N = c.micro_batch * c.seq_len;
        c.loss_chunk = N;
        double ref[STEPS];
        run(&c, STEPS, ref, NULL);
        td_train_plan whole;
        TD_ASSERT_OK(td_train_plan_make(&c, 0, &whole));
        float want[64], got[64];
        int32_t ctx[13];
        for (int i = 0; i < 13; i++) ctx[i] = (i * 7 + 3) % c.model.vocab_size;
        td_trainer *t;
        TD_ASSERT_OK(td_trainer_create(&c, &t));
        TD_ASSERT_OK(td_trainer_next_logits(t, ctx, 13, want));
        td_trainer_destroy(t);
        const int rows[] = {1, 7, 16, N - 1, N + 5};
        for (size_t k = 0; k < sizeof rows / sizeof rows[0]; k++) {
            td_train_config v = c;
            v.loss_chunk = rows[k];
            assert_int_equal(td_train_loss_rows(&v), rows[k] < N ? rows[k] : N);
            double got_loss[STEPS];
            run(&v, STEPS, got_loss, NULL);
            for (int s = 0; s < STEPS; s++)
                if (memcmp(&got_loss[s], &ref[s], sizeof(double)) != 0)
                    fail_msg("%s, chunks of %d rows, step %d: loss %.17g != %.17g", families[f], rows[k], s,
                             got_loss[s], ref[s]);
            TD_ASSERT_OK(td_trainer_create(&v, &t));
            TD_ASSERT_OK(td_trainer_next_logits(t, ctx, 13, got));
            td_trainer_destroy(t);
            assert_memory_equal(got, want, (size_t)c.model.vocab_size * sizeof(float));
            td_train_plan p;
            TD_ASSERT_OK(td_train_plan_make(&v, 0, &p));
            /* the logits, the final norm's rows and its statistics shrink to the chunk's rows */
            size_t R = (size_t)td_train_loss_rows(&v), F = sizeof(float);
            size_t fewer = (size_t)(N - (int)R) * ((size_t)c.model.padded_vocab_size + (size_t)c.model.n_embd + 2) * F;
            if (whole.activation_bytes - p.activation_bytes + 3 * 256 < fewer || whole.activation_bytes < p.activation_bytes)
                fail_msg("%s, chunks of %zu rows: activations %zu, one chunk %zu: %zu fewer bytes expected",
                         families[f], R, p.activation_bytes, whole.activation_bytes, fewer);
        }
    }
    /* auto: at most TD_TRAIN_LOSS_CHUNK_BYTES of logits but TD_TRAIN_LOSS_CHUNK_MIN_ROWS rows, split evenly */
    td_train_config a = td_train_default_config();
    a.precision = TD_DTYPE_BF16;
    a.model.padded_vocab_size = 50304;
    a.micro_batch = 16;
    a.seq_len = 1024;
    assert_int_equal(td_train_loss_rows(&a), 2368); /* 2668 at most: 7 chunks of 16384 / 7, to 64 */
    a.model.padded_vocab_size = 128256;
    a.micro_batch = 4;
    a.seq_len = 4096;
    assert_int_equal(td_train_loss_rows(&a), 2048);
    a.micro_batch = 1;
    a.seq_len = 1000;
    assert_int_equal(td_train_loss_rows(&a), 1000);
    a.loss_chunk = -1;
    assert_int_equal(td_train_config_check(&a), TD_ERR_INVALID);
}


/* Long sequences: a run's device bytes beside the model (activations,
 * workspace, staging) grow linearly with the sequence, never as T x T: at a
 * fixed micro-batch doubling T at most doubles them, and at a fixed number
 * of tokens (B x T) they stay the same, for a LLaMA-family model on the
 * backends this build plans for (the CUDA plan needs no device). */
static void test_memory_linear_in_sequence(void **state)
{
    td_backend_kind kinds[2] = {TD_BACKEND_CPU, TD_BACKEND_CUDA};
    int nk = 1;
#ifdef TD_HAVE_CUDA
    nk = 2;
#endif
    for (int k = 0; k < nk; k++) {
        td_train_config c = td_train_default_config();
        c.model = (td_model_desc){.n_layer = 2, .n_head = 4, .n_embd = 256, .n_positions = 16384, .vocab_size = 1000,
                                  .padded_vocab_size = 1024};
        td_model_desc_set_family(&c.model, "llama");
        c.model.n_kv_head = 2; /* head size 64: the flash kernels on CUDA */
        c.model.n_inner = 512;
        c.model.rope_theta = 500000.0f;
        c.backend = kinds[k];
        c.precision = k ? TD_DTYPE_BF16 : TD_DTYPE_F32;
        c.ckpt = TD_CKPT_OFF;
        c.micro_batch = 1;
        size_t prev = 0;
        for (int T = 1024; T <= 8192; T *= 2) {
            c.seq_len = T;
            td_train_plan p;
            TD_ASSERT_OK(td_train_plan_make(&c, 0, &p));
            if (prev && p.nonmodel_bytes > 2 * prev + TD_MiB)
                fail_msg("%s backend, T %d: %zu bytes beside the model, T %d: %zu: more than linear", k ? "cuda" : "cpu",
                         T, p.nonmodel_bytes, T / 2, prev);
            prev = p.nonmodel_bytes;
        }
        size_t at_fixed_tokens[2];
        for (int i = 0; i < 2; i++) {
            c.seq_len = i ? 8192 : 1024;
            c.micro_batch = 8192 / c.seq_len;
            td_train_plan p;
            TD_ASSERT_OK(td_train_plan_make(&c, 0, &p));
            at_fixed_tokens[i] = p.nonmodel_bytes;
        }
        if (at_fixed_tokens[1] > at_fixed_tokens[0] + at_fixed_tokens[0] / 64)
            fail_msg("%s backend, 8192 tokens: %zu bytes at T 8192, %zu at 8 x 1024", k ? "cuda" : "cpu",
                     at_fixed_tokens[1], at_fixed_tokens[0]);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_policies_and_budgets_are_bit_identical),
        cmocka_unit_test(test_first_loss_matches_reference),
        cmocka_unit_test(test_early_updates_match_two_pass),
        cmocka_unit_test(test_updates_wait_for_next_forward),
        cmocka_unit_test(test_partial_checkpointing_is_bit_identical),
        cmocka_unit_test(test_loss_chunks_are_bit_identical),
        cmocka_unit_test(test_memory_linear_in_sequence),
        cmocka_unit_test(test_auto_checkpointing_keeps_what_fits),
        cmocka_unit_test(test_learns_a_fixed_batch),
        cmocka_unit_test(test_budget_too_small_names_minimum),
        cmocka_unit_test(test_plan_minimum_is_enough),
        cmocka_unit_test(test_chunk_shrinks_for_the_budget),
        cmocka_unit_test(test_default_budget_keeps_the_run_resident),
        cmocka_unit_test(test_budget_resolve),
        cmocka_unit_test(test_optimizer_share_is_bit_identical),
        cmocka_unit_test(test_compact_state_decay_by_tensor),
        cmocka_unit_test(test_auto_optimizer_share_follows_the_budget),
        cmocka_unit_test(test_auto_share_keeps_params_resident),
        cmocka_unit_test(test_auto_share_beside_resident_model),
        cmocka_unit_test(test_bound_terms),
        cmocka_unit_test(test_adam_probe_params),
        cmocka_unit_test(test_fortunes_loss_falls),
        cmocka_unit_test(test_resume_is_bit_exact),
        cmocka_unit_test(test_adam_thread_is_bit_identical),
        cmocka_unit_test(test_failed_step_drains_the_adam_thread),
        cmocka_unit_test(test_step_reports_cpu_adam_time),
        cmocka_unit_test(test_microbatch_hook),
        cmocka_unit_test(test_resume_with_the_adam_thread),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
