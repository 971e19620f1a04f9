/* `tidal plan --largest`'s search (td_train_largest_layers) against a
 * brute-force oracle: every layer count up to the host's bound planned, the
 * bound as the plain search probes it (doubling from one layer while the
 * host fits, then bisecting), and the most layers at or below it that fit
 * the device too.  Over narrow shapes, budgets around the device's need,
 * every policy, --ckpt modes, both backends' sizes, two ZeRO-3 ranks and
 * each --optim-state.  On the way: the device floor the search starts
 * below never exceeds a plan's need and grows with the layers.  And the
 * case the plain search took hours over (64 wide at a 64 MiB budget, 4096
 * layers' worth of host) takes seconds. */
#include "td_train_test.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SANITIZE_ADDRESS__)
#define QUICK_MS 60e3 /* instrumented */
#else
#define QUICK_MS 15e3 /* about 4 s on two cores */
#endif

/* One shape; the host's RAM is what host_at layers take, the budget what
 * device_at layers need (0: a budget below one layer's floor). */
typedef struct largest_case {
    int width, heads, micro_batch, seq;
    td_backend_kind backend;
    td_placement placement;
    td_ckpt_mode ckpt;
    int ranks;
    int host_at, device_at;
    int own_range; /* the chunk range given (the trainer's own, one block tensor to one block): no
                      smaller chunk for the budget (td_train_resolve_chunks), so the need goes up and
                      down with the layers as the padding's pick does */
} largest_case;

static td_train_config config_of(const largest_case *k, td_optim_state state)
{
    td_train_config c = td_train_default_config();
    c.model.n_embd = k->width;
    c.model.n_head = k->heads;
    c.micro_batch = k->micro_batch;
    c.seq_len = k->seq;
    c.backend = k->backend;
    c.precision = k->backend == TD_BACKEND_CUDA ? TD_DTYPE_BF16 : TD_DTYPE_F32;
    c.mm.placement = k->placement;
    if (k->placement == TD_PLACEMENT_STATIC) c.mm.offload_optim_frac = 0.5;
    c.ckpt = k->ckpt;
    c.optim.state = state;
    if (k->own_range) {
        size_t off, span, big = td_model_block_largest_numel(&c.model);
        td_model_block_span(&c.model, 0, &off, &span);
        c.mm.min_chunk_numel = big;
        c.mm.max_chunk_numel = span > big ? span : big;
    }
    if (k->ranks > 1) {
        c.ranks = c.local_ranks = k->ranks;
        c.rank = 0;
    }
    return c;
}

static size_t device_need(const td_train_config *c, const td_train_plan *p)
{
    return c->mm.placement == TD_PLACEMENT_CUDA ? p->full_device_bytes : p->min_device_bytes;
}

/* Every layer count's fit, planned once on first use. */
typedef struct oracle {
    td_train_config cfg;
    td_train_limits lim;
    signed char host[TD_TRAIN_LARGEST_LAYERS + 1], fits[TD_TRAIN_LARGEST_LAYERS + 1]; /* -1: not planned */
} oracle;

static size_t floor_at(const td_train_config *cfg, int layers)
{
    td_train_config c = *cfg;
    c.model.n_layer = layers;
    return td_train_device_floor_bytes(&c);
}

static void oracle_plan(oracle *o, int layers)
{
    if (o->host[layers] >= 0) return;
    td_train_config c = o->cfg;
    c.model.n_layer = layers;
    td_train_plan p;
    int fits, host;
    TD_ASSERT_OK(td_train_plan_fits(&c, &o->lim, &p, &fits, &host));
    o->host[layers] = (signed char)host;
    o->fits[layers] = (signed char)fits;
    /* The floor: below the need, and growing with the layers. */
    size_t floor = floor_at(&c, layers);
    if (floor > device_need(&c, &p))
        fail_msg("%d layers: floor %zu above the plan's need %zu", layers, floor, device_need(&c, &p));
    if (layers > 1) assert_true(floor_at(&c, layers - 1) <= floor);
}

static int oracle_host(oracle *o, int layers)
{
    oracle_plan(o, layers);
    return o->host[layers];
}

/* The plain search: the host's bound by its probes, then every count up
 * to it (not only from the top down: all of them), the most that fits. */
static int oracle_largest(oracle *o)
{
    int lo = 0, hi = 1;
    while (oracle_host(o, hi) && hi < TD_TRAIN_LARGEST_LAYERS) {
        lo = hi;
        hi *= 2;
    }
    if (oracle_host(o, hi)) lo = hi;
    while (hi - lo > 1) {
        int mid = lo + (hi - lo) / 2;
        if (oracle_host(o, mid)) lo = mid;
        else hi = mid;
    }
    int best = 0;
    for (int layers = 1; layers <= lo; layers++) {
        oracle_plan(o, layers);
        if (o->fits[layers]) best = layers;
    }
    return best;
}

/* The limits of a case: the budget device_at layers need as planned for
 * `planned_for` (0, unknown: --ckpt auto recomputes every block; SIZE_MAX:
 * everything stays, AdamW on the GPU under auto), the RAM host_at layers
 * take under that budget and a pin limit that allows them. */
static td_train_limits limits_of(const largest_case *k, const td_train_config *cfg, size_t planned_for)
{
    td_train_config c = *cfg;
    td_train_plan p;
    td_train_limits lim = { .device_free_bytes = SIZE_MAX };
    c.model.n_layer = k->device_at ? k->device_at : 1;
    TD_ASSERT_OK(td_train_plan_make(&c, planned_for, &p));
    lim.budget_bytes = k->device_at ? device_need(&c, &p) : floor_at(&c, 1) - 1;
    c.model.n_layer = k->host_at;
    TD_ASSERT_OK(td_train_plan_make(&c, lim.budget_bytes, &p));
    lim.ram_bytes = p.host_bytes;
    lim.pin_limit_bytes = p.host_pinned_bytes;
    return lim;
}

/* Over the cases: answers above 0, and counts below an answer that fit the
 * host but not the device (where a bisection on the fit would go wrong). */
typedef struct tally { int found, holes; } tally;

static void check_case(const largest_case *k, tally *t)
{
    oracle *o = malloc(sizeof *o);
    assert_non_null(o);
    for (int s = 0; s < 2 * TD_OPTIM_STATE_COUNT; s++) {
        size_t planned_for = s < TD_OPTIM_STATE_COUNT ? 0 : SIZE_MAX;
        memset(o, 0, sizeof *o);
        memset(o->host, -1, sizeof o->host);
        memset(o->fits, -1, sizeof o->fits);
        o->cfg = config_of(k, (td_optim_state)(s % TD_OPTIM_STATE_COUNT));
        o->lim = limits_of(k, &o->cfg, planned_for);
        int want = oracle_largest(o), got = -1;
        td_train_plan p;
        TD_ASSERT_OK(td_train_largest_layers(&o->cfg, &o->lim, &got, &p));
        if (got != want)
            fail_msg("%d wide, %d heads, backend %d, policy %s, ckpt %d, %d ranks, state %s, host at %d, device at "
                     "%d (planned for %s budget): %d layers, the scan %d", k->width, k->heads, (int)k->backend,
                     td_placement_name(k->placement), (int)k->ckpt, k->ranks, td_optim_state_name(o->cfg.optim.state),
                     k->host_at, k->device_at, planned_for ? "an unbounded" : "an unknown", got, want);
        for (int layers = 1; layers < want; layers++) t->holes += o->host[layers] == 1 && o->fits[layers] == 0;
        if (got > 0) {
            td_train_config c = o->cfg;
            c.model.n_layer = got;
            td_train_plan q;
            TD_ASSERT_OK(td_train_plan_make(&c, o->lim.budget_bytes, &q));
            assert_int_equal(p.params, q.params); /* the plan of the count it names */
            assert_int_equal(p.host_bytes, q.host_bytes);
            t->found++;
        } else {
            assert_int_equal(p.params, 0);
        }
    }
    free(o);
}

static void test_largest_matches_the_scan(void **state)
{
    static const largest_case cases[] = {
        /* the device binds (the budget: what device_at layers need), the host at host_at */
        {32, 2, 2, 16, TD_BACKEND_CPU, TD_PLACEMENT_AUTO, TD_CKPT_AUTO, 1, 64, 40, 0},
        {64, 4, 2, 32, TD_BACKEND_CPU, TD_PLACEMENT_AUTO, TD_CKPT_AUTO, 1, 64, 12, 0},
        {32, 2, 4, 16, TD_BACKEND_CPU, TD_PLACEMENT_CPU, TD_CKPT_OFF, 1, 48, 30, 0},
        {32, 4, 2, 16, TD_BACKEND_CPU, TD_PLACEMENT_CUDA, TD_CKPT_AUTO, 1, 48, 20, 0},
        {32, 2, 2, 16, TD_BACKEND_CPU, TD_PLACEMENT_STATIC, TD_CKPT_ON, 1, 48, 25, 0},
        {64, 2, 2, 16, TD_BACKEND_CUDA, TD_PLACEMENT_AUTO, TD_CKPT_AUTO, 1, 64, 33, 0},
        {32, 2, 2, 16, TD_BACKEND_CUDA, TD_PLACEMENT_CPU, TD_CKPT_AUTO, 1, 48, 21, 0},
        {32, 2, 2, 16, TD_BACKEND_CPU, TD_PLACEMENT_AUTO, TD_CKPT_AUTO, 2, 48, 17, 0},
        {32, 2, 2, 16, TD_BACKEND_CPU, TD_PLACEMENT_AUTO, TD_CKPT_AUTO, 1, 64, 40, 1},
        {64, 4, 2, 32, TD_BACKEND_CPU, TD_PLACEMENT_AUTO, TD_CKPT_AUTO, 1, 64, 12, 1},
        {32, 2, 4, 16, TD_BACKEND_CPU, TD_PLACEMENT_CPU, TD_CKPT_OFF, 1, 48, 30, 1},
        /* the host binds */
        {32, 2, 2, 16, TD_BACKEND_CPU, TD_PLACEMENT_AUTO, TD_CKPT_AUTO, 1, 21, 60, 0},
        {64, 2, 2, 16, TD_BACKEND_CUDA, TD_PLACEMENT_CUDA, TD_CKPT_AUTO, 1, 37, 80, 0},
        /* nothing fits the device */
        {32, 2, 2, 16, TD_BACKEND_CPU, TD_PLACEMENT_AUTO, TD_CKPT_AUTO, 1, 48, 0, 0},
    };
    tally t = {0};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_case(&cases[i], &t);
    assert_true(t.found > 0 && t.holes > 0);
}

/* Budget above the device's free memory: nothing fits, at once.  --ckpt on
 * with two blocks recomputed: one layer cannot be planned, and the search
 * says so as the plain one did. */
static void test_largest_refusals(void **state)
{
    largest_case k = {32, 2, 2, 16, TD_BACKEND_CPU, TD_PLACEMENT_AUTO, TD_CKPT_AUTO, 1, 48, 30, 0};
    td_train_config c = config_of(&k, TD_OPTIM_STATE_FP32);
    td_train_limits lim = limits_of(&k, &c, 0);
    lim.device_free_bytes = lim.budget_bytes - 1;
    td_train_plan p;
    int layers = -1;
    TD_ASSERT_OK(td_train_largest_layers(&c, &lim, &layers, &p));
    assert_int_equal(layers, 0);
    c.ckpt = TD_CKPT_ON;
    c.ckpt_blocks = 2;
    lim.device_free_bytes = SIZE_MAX;
    assert_int_equal(td_train_largest_layers(&c, &lim, &layers, &p), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "ckpt"));
    td_error_clear();
}

/* 64 wide, 4 heads, a 64 MiB budget and room on the host for 4096 layers:
 * under --ckpt auto the device stops near a thousand layers, under --ckpt
 * off (every block's activations kept) at a few dozen; the plain search
 * reached either by planning every count down from 4096 (hours).  Each
 * state here plans a dozen counts near the answer and the host's probes up
 * to the power of two above it. */
static void test_largest_narrow_is_quick(void **state)
{
    td_train_config c = td_train_default_config();
    c.model.n_embd = 64;
    c.model.n_head = 4;
    c.backend = TD_BACKEND_CPU;
    td_train_limits lim = { .budget_bytes = (size_t)64 << 20, .device_free_bytes = SIZE_MAX,
                            .ram_bytes = (size_t)64 << 30, .pin_limit_bytes = (size_t)48 << 30 };
    double ms = 0;
    for (int s = 0; s < 2 * TD_OPTIM_STATE_COUNT; s++) {
        c.ckpt = s < TD_OPTIM_STATE_COUNT ? TD_CKPT_AUTO : TD_CKPT_OFF;
        c.optim.state = (td_optim_state)(s % TD_OPTIM_STATE_COUNT);
        td_train_plan p;
        int layers = 0, fits = 0;
        double t0 = td_now_ms();
        TD_ASSERT_OK(td_train_largest_layers(&c, &lim, &layers, &p));
        ms += td_now_ms() - t0;
        assert_true(c.ckpt == TD_CKPT_AUTO ? layers > 512 && layers < 4096 : layers > 8 && layers < 512);
        c.model.n_layer = layers; /* it fits, one more does not: a boundary, not an interior point */
        TD_ASSERT_OK(td_train_plan_fits(&c, &lim, &p, &fits, NULL));
        assert_true(fits);
        c.model.n_layer = layers + 1;
        TD_ASSERT_OK(td_train_plan_fits(&c, &lim, &p, &fits, NULL));
        assert_false(fits);
        print_message("--ckpt %s, --optim-state %s: %d layers\n", c.ckpt == TD_CKPT_AUTO ? "auto" : "off",
                      td_optim_state_name(c.optim.state), layers);
    }
    print_message("--largest at 64 wide, 64 MiB, three states, two --ckpt modes: %.0f ms\n", ms);
    if (getenv("TD_TEST_NO_TIMING")) return;
    assert_true(ms < QUICK_MS);
}

/* ---- LoRA and --freeze: against every count planned ----------------------------- */

/* A tiny LLaMA of `width` (4 heads, 2 of key/value), with LoRA rank
 * `lora` (0: none) on q, v and down. */
static td_train_config llama_of(int width, int lora, int micro_batch, int vocab, td_backend_kind backend)
{
    td_train_config c = td_train_default_config();
    TD_ASSERT_OK(td_model_preset("tiny-llama", &c.model));
    c.model.n_embd = width;
    c.model.n_head = 4;
    c.model.n_kv_head = 2;
    c.model.n_inner = 0;
    c.model.head_dim = 0;
    c.model.vocab_size = vocab;
    c.model.padded_vocab_size = td_model_pad_vocab(vocab);
    c.backend = backend;
    c.precision = backend == TD_BACKEND_CUDA ? TD_DTYPE_BF16 : TD_DTYPE_F32;
    c.micro_batch = micro_batch;
    c.seq_len = 32;
    if (c.model.n_positions < c.seq_len) c.model.n_positions = c.seq_len;
    if (lora) TD_ASSERT_OK(td_model_lora_set(&c.model, lora, 2.0f * lora, 0, "q_proj,v_proj,down_proj"));
    return c;
}

/* The brute force: every count in 1..top planned, the most that fits. */
static int brute_largest(const td_train_config *cfg, const td_train_limits *lim, int top)
{
    int best = 0;
    for (int layers = 1; layers <= top; layers++) {
        td_train_config c = *cfg;
        c.model.n_layer = layers;
        td_train_plan p;
        int fits;
        TD_ASSERT_OK(td_train_plan_fits(&c, lim, &p, &fits, NULL));
        if (fits) best = layers;
    }
    return best;
}

/* The search's answer is the brute force's, and planned alone it fits. */
static void expect_brute(const td_train_config *cfg, const td_train_limits *lim, int top, const char *what)
{
    int want = brute_largest(cfg, lim, top), got = -1;
    td_train_plan p;
    TD_ASSERT_OK(td_train_largest_layers(cfg, lim, &got, &p));
    if (got != want) fail_msg("%s: --largest %d layers, every count planned: %d", what, got, want);
    if (got > 0) {
        td_train_config c = *cfg;
        c.model.n_layer = got;
        int fits = 0;
        TD_ASSERT_OK(td_train_plan_fits(&c, lim, &p, &fits, NULL));
        assert_true(fits);
    }
}

/* The device's need of a LoRA run (or a full one) goes up and down with
 * the layers: the chunk size searched per count packs the blocks
 * differently, so a count fits where the one below does not (at 64 wide,
 * micro-batch 2, the budget 20 layers need: 1 to 15 fit, 16 and 17 not,
 * 18 to 20, then 30 alone).  The search finds the brute force's answer, where the
 * bisection with four counts above stopped at 20; the budgets here are the
 * device's need at `at` layers, the RAM what `host_at` take. */
static void test_largest_lora_matches_brute_force(void **state)
{
    static const struct { int width, lora, micro_batch, at, host_at; td_backend_kind backend; } cases[] = {
        {64, 4, 2, 20, 40, TD_BACKEND_CPU},  /* the old search: 20 of 30 (fp32), 13 (bf16), 15 (int8) */
        {64, 4, 1, 20, 40, TD_BACKEND_CPU},
        {64, 4, 4, 20, 40, TD_BACKEND_CUDA}, /* bf16's sizes: 20 of 32 */
        {64, 4, 1, 1, 24, TD_BACKEND_CPU},   /* one layer's need: the old floor (a frozen base's grads) said none */
        {32, 4, 8, 12, 32, TD_BACKEND_CPU},
        {64, 0, 2, 20, 40, TD_BACKEND_CPU},  /* a full fine-tune */
        {32, 0, 4, 7, 32, TD_BACKEND_CUDA},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        for (int s = i ? (int)i % TD_OPTIM_STATE_COUNT : 0; s < (i ? (int)i % TD_OPTIM_STATE_COUNT + 1 : TD_OPTIM_STATE_COUNT); s++) {
            /* every state at the first case, one each at the others */
            td_train_config c = llama_of(cases[i].width, cases[i].lora, cases[i].micro_batch, 1000, cases[i].backend);
            c.optim.state = (td_optim_state)s;
            td_train_plan p;
            td_train_limits lim = { .device_free_bytes = SIZE_MAX };
            c.model.n_layer = cases[i].at;
            TD_ASSERT_OK(td_train_plan_make(&c, 0, &p));
            lim.budget_bytes = p.min_device_bytes;
            c.model.n_layer = cases[i].host_at;
            TD_ASSERT_OK(td_train_plan_make(&c, lim.budget_bytes, &p));
            lim.ram_bytes = p.host_bytes;
            lim.pin_limit_bytes = p.host_pinned_bytes;
            char what[160];
            snprintf(what, sizeof what, "%d wide, LoRA rank %d, micro-batch %d, %s sizes, %s, budget of %d layers",
                     cases[i].width, cases[i].lora, cases[i].micro_batch, cases[i].backend == TD_BACKEND_CUDA ? "cuda" : "cpu",
                     td_optim_state_name(c.optim.state), cases[i].at);
            /* past host_at + 8 the host never fits (its need grows a layer's state at a time) */
            expect_brute(&c, &lim, cases[i].host_at + 8, what);
        }
    /* --freeze of the first block's attention: its grads and state gone */
    static const char *const pat[] = {"model.layers.0.self_attn.*"};
    td_train_config c = llama_of(64, 0, 2, 1000, TD_BACKEND_CPU);
    c.freeze = pat;
    c.n_freeze = 1;
    td_train_plan p;
    td_train_limits lim = { .device_free_bytes = SIZE_MAX };
    c.model.n_layer = 16;
    TD_ASSERT_OK(td_train_plan_make(&c, 0, &p));
    assert_true(p.frozen_params > 0);
    lim.budget_bytes = p.min_device_bytes;
    c.model.n_layer = 32;
    TD_ASSERT_OK(td_train_plan_make(&c, lim.budget_bytes, &p));
    lim.ram_bytes = p.host_bytes;
    lim.pin_limit_bytes = p.host_pinned_bytes;
    expect_brute(&c, &lim, 40, "--freeze of a block's attention");
}

/* A budget a few layers fit only because the base is frozen (128 wide,
 * LLaMA-3's 128256 vocabulary, 256 MiB): the floor counted the frozen
 * embedding's grads, above the budget, and --largest said nothing fits
 * while one layer's plan fits. */
static void test_largest_tiny_budget(void **state)
{
    td_train_config c = llama_of(128, 8, 1, 128256, TD_BACKEND_CPU);
    c.seq_len = 64;
    td_train_limits lim = { .budget_bytes = (size_t)256 << 20, .device_free_bytes = SIZE_MAX };
    td_train_plan p;
    c.model.n_layer = 24; /* the host holds 24 layers */
    TD_ASSERT_OK(td_train_plan_make(&c, lim.budget_bytes, &p));
    lim.ram_bytes = p.host_bytes;
    lim.pin_limit_bytes = p.host_pinned_bytes;
    c.model.n_layer = 1;
    int fits = 0;
    TD_ASSERT_OK(td_train_plan_fits(&c, &lim, &p, &fits, NULL));
    assert_true(fits);
    assert_true(td_train_device_floor_bytes(&c) <= p.min_device_bytes);
    expect_brute(&c, &lim, 30, "128 wide, 128256 vocabulary, LoRA rank 8, 256 MiB");
}

/* The preset rows plan the run asked for: a LoRA preset row's host bytes
 * are that preset's LoRA plan's, far below its full fine-tune's; --freeze
 * is kept too. */
static void test_largest_presets_keep_lora(void **state)
{
    td_train_config c = llama_of(1024, 8, 1, 1000, TD_BACKEND_CPU); /* wide: the layer search plans few counts */
    td_train_limits lim = { .budget_bytes = (size_t)1 << 30, .device_free_bytes = SIZE_MAX,
                            .ram_bytes = (size_t)4 << 30, .pin_limit_bytes = (size_t)3 << 30 };
    td_train_largest l;
    c.model.n_layer = 2;
    TD_ASSERT_OK(td_train_largest_model(&c, &lim, &l));
    assert_non_null(l.preset);
    td_train_config pc = c;
    TD_ASSERT_OK(td_model_preset(l.preset, &pc.model));
    pc.model.vocab_size = c.model.vocab_size;
    pc.model.padded_vocab_size = c.model.padded_vocab_size;
    if (pc.model.n_positions < pc.seq_len) pc.model.n_positions = pc.seq_len;
    td_train_plan full, lora;
    TD_ASSERT_OK(td_train_plan_make(&pc, lim.budget_bytes, &full));
    pc.model.lora = c.model.lora;
    TD_ASSERT_OK(td_train_plan_make(&pc, lim.budget_bytes, &lora));
    print_message("preset %s: LoRA row %zu host bytes, its LoRA plan %zu, a full fine-tune %zu\n", l.preset,
                  l.preset_plan.host_bytes, lora.host_bytes, full.host_bytes);
    assert_true(l.preset_plan.frozen_params > 0);
    assert_int_equal(l.preset_plan.frozen_params, lora.frozen_params);
    assert_int_equal(l.preset_plan.host_bytes, lora.host_bytes);
    assert_true(l.preset_plan.host_bytes < full.host_bytes * 3 / 4);
    /* --freeze of the first block: the preset rows freeze it too */
    static const char *const pat[] = {"model.layers.0.*"};
    c = llama_of(1024, 0, 1, 1000, TD_BACKEND_CPU);
    c.freeze = pat;
    c.n_freeze = 1;
    c.model.n_layer = 2;
    TD_ASSERT_OK(td_train_largest_model(&c, &lim, &l));
    assert_non_null(l.preset);
    assert_true(l.preset_plan.frozen_params > 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_largest_matches_the_scan),
        cmocka_unit_test(test_largest_refusals),
        cmocka_unit_test(test_largest_narrow_is_quick),
        cmocka_unit_test(test_largest_lora_matches_brute_force),
        cmocka_unit_test(test_largest_tiny_budget),
        cmocka_unit_test(test_largest_presets_keep_lora),
    };
    if (getenv("TD_TEST_FILTER")) cmocka_set_test_filter(getenv("TD_TEST_FILTER"));
    return cmocka_run_group_tests(tests, NULL, NULL);
}
