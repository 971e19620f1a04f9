/* LoRA dropout (model.h's td_model_lora_drop, PEFT's lora_dropout): the
 * mask drops a fraction P over a large tensor and every field of its key
 * draws another; tests/gpu/lora_mask.py (peft's oracle) prints tidal's
 * masks and hashes; a block's forward adds s (drop(x) A^T) B^T with the
 * hash's mask, its recompute draws the same one, and its gradients (the
 * adapters' and the input's) match finite differences; in the trainer the
 * losses differ from P = 0's yet are the same bits run after run,
 * offloaded and recomputed alike, micro-batches and ranks drawing the
 * masks of the global batch (ZeRO-3 on 2 ranks within 1e-5 of 1 rank, and
 * a resume from the saved folder keeps P); eval never drops; a P outside
 * [0, 1) is a usage error. */
#include "td_proc.h"
#include "td_train_test.h"
#include "tidal/model.h"
#include "tidal/model_ref.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static td_model_desc desc(const char *family)
{
    td_model_desc d = { .n_layer = 2, .n_head = 4, .n_embd = 32, .n_positions = 32, .vocab_size = 61,
                        .padded_vocab_size = 64 };
    td_model_desc_set_family(&d, family);
    if (strcmp(family, "gpt2")) {
        d.n_kv_head = 2;
        d.n_inner = 40;
        d.norm_eps = 1e-6f;
        d.rope_theta = 10000.0f;
        d.qkv_bias = !strcmp(family, "qwen2");
    }
    return d;
}

/* --- the mask ------------------------------------------------------------------ */

static double dropped_fraction(const td_model_lora_drop *k, int module, int rows, int cols, float p)
{
    size_t n = 0;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) n += (size_t)td_model_lora_dropped(k, module, r, c, p);
    return (double)n / ((double)rows * cols);
}

/* Over 2^19 elements the dropped share is P within 5 sigma; P = 0 drops
 * nothing; a key differing in any one field (seed, step, layer, module,
 * sample, position, column) draws a mask agreeing with the first one as
 * two independent ones do (P^2 + (1-P)^2). */
static void test_mask_drops_p_and_every_field_counts(void **state)
{
    (void)state;
    enum { ROWS = 256, COLS = 2048 };
    const td_model_lora_drop k = {.seed = 1337, .step = 3, .sample0 = 5, .layer = 2, .T = 16};
    static const float ps[] = {0.05f, 0.1f, 0.5f, 0.9f};
    for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) {
        const double p = ps[i], f = dropped_fraction(&k, 4, ROWS, COLS, ps[i]);
        const double sigma = sqrt(p * (1 - p) / (ROWS * COLS));
        if (!(fabs(f - p) <= 5 * sigma)) fail_msg("P %.2f: dropped %.5f of %d elements", p, f, ROWS * COLS);
    }
    assert_true(dropped_fraction(&k, 4, 8, 256, 0.0f) == 0.0);
    /* each field alone changes the mask */
    const float p = 0.3f;
    for (int field = 0; field < 7; field++) {
        td_model_lora_drop o = k;
        int module = 4, dr = 0, dc = 0;
        switch (field) {
        case 0: o.seed++; break;
        case 1: o.step++; break;
        case 2: o.layer++; break;
        case 3: module++; break;
        case 4: o.sample0++; dr = 0; break;
        case 5: dr = 1; break; /* the next position of the same sample (T = 16 > rows' span below) */
        case 6: dc = 1; break;
        }
        size_t same = 0, n = 0;
        for (int r = 0; r < 15; r++) /* positions 0..14 of one sample: rows r and r + dr share it */
            for (int c = 0; c < 4096; c++, n++)
                same += td_model_lora_dropped(&k, 4, r, c, p) == td_model_lora_dropped(&o, module, r + dr, c + dc, p);
        const double agree = (double)same / n, want = p * p + (1 - p) * (1 - p);
        if (!(fabs(agree - want) <= 0.02))
            fail_msg("field %d: masks agree on %.4f (independent: %.4f)", field, agree, want);
    }
    /* the module keys lora_mask.py's users give: the place among the block's linear modules */
    static const struct { const char *family, *targets; int index[7]; } keys[] = {
        {"llama", NULL, {0, 1, 2, 3, 4, 5, 6}}, {"qwen2", "v_proj,up_proj", {2, 5}}, {"gpt2", NULL, {0, 1, 2, 3}},
        {"gpt2", "c_fc", {2}}};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        td_model_desc d = desc(keys[i].family);
        TD_ASSERT_OK(td_model_lora_set(&d, 2, 2, 0.1f, keys[i].targets));
        for (int j = 0; j < td_model_lora_count(&d); j++) {
            td_model_lora_target tg;
            td_model_lora_target_get(&d, j, &tg);
            if (tg.module_index != keys[i].index[j])
                fail_msg("%s %s: module index %d, want %d", keys[i].family, tg.module, tg.module_index,
                         keys[i].index[j]);
        }
    }
    /* the hash of model.h's formula: row r of a call is sample sample0 + r / T, position r % T */
    const uint64_t h = td_model_lora_drop_hash(k.seed, k.step, k.layer, 4, k.sample0 + 1, 3, 77);
    assert_int_equal(td_model_lora_dropped(&k, 4, 16 + 3, 77, p), (float)(h >> 40) < p * 16777216.0f);
}

/* tests/gpu/lora_mask.py (the Python copy that check_lora_peft.py puts
 * into peft) prints the masks and hashes tidal draws. */
static void test_python_copy_draws_the_same_masks(void **state)
{
    (void)state;
    if (system("python3 -c 'import struct' >/dev/null 2>&1")) td_test_skip("needs python3 (lora_mask.py)\n");
    static const struct { uint64_t seed; int64_t step, sample0; int layer, module, T; float p; } keys[] = {
        {1337, 1, 0, 0, 0, 16, 0.1f},
        {0, 0, 0, 0, 0, 1, 0.5f},
        {0xfedcba9876543210ull, 123456789, 4000000000ll, 79, 6, 7, 0.3333f},
    };
    enum { ROWS = 12, COLS = 70 };
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        char cmd[512], line[COLS + 8];
        snprintf(cmd, sizeof cmd, "python3 tests/gpu/lora_mask.py mask %llu %lld %d %d %lld %d %d %d %.9g",
                 (unsigned long long)keys[i].seed, (long long)keys[i].step, keys[i].layer, keys[i].module,
                 (long long)keys[i].sample0, keys[i].T, ROWS, COLS, (double)keys[i].p);
        FILE *f = popen(cmd, "r");
        assert_non_null(f);
        const td_model_lora_drop k = {.seed = keys[i].seed, .step = keys[i].step, .sample0 = keys[i].sample0,
                                      .layer = keys[i].layer, .T = keys[i].T};
        int rows = 0;
        while (fgets(line, sizeof line, f)) {
            assert_true(rows < ROWS);
            for (int c = 0; c < COLS; c++) {
                const char want = td_model_lora_dropped(&k, keys[i].module, rows, c, keys[i].p) ? '0' : '1';
                if (line[c] != want)
                    fail_msg("key %zu row %d column %d: python %c, tidal %c (%s)", i, rows, c, line[c], want, cmd);
            }
            rows++;
        }
        assert_int_equal(pclose(f), 0);
        assert_int_equal(rows, ROWS);
        snprintf(cmd, sizeof cmd, "python3 tests/gpu/lora_mask.py hash %llu %lld %d %d %lld %d %d",
                 (unsigned long long)keys[i].seed, (long long)keys[i].step, keys[i].layer, keys[i].module,
                 (long long)keys[i].sample0 + 3, 5, 1000 + (int)i);
        f = popen(cmd, "r");
        assert_non_null(f);
        assert_non_null(fgets(line, sizeof line, f));
        assert_int_equal(pclose(f), 0);
        const uint64_t h = td_model_lora_drop_hash(keys[i].seed, keys[i].step, keys[i].layer, keys[i].module,
                                                   keys[i].sample0 + 3, 5, 1000 + (int)i);
        assert_int_equal(strtoull(line, NULL, 10), h);
    }
}

/* --- one block ----------------------------------------------------------------- */

typedef struct {
    td_model_desc d;
    int B, T;
    float *p, *g, *acts, *xd, *scratch, *x, *dx, *wy;
    td_model_block w, gw;
    td_model_block_acts a;
    td_model_lora_drop key;
} block_case;

static void block_setup(block_case *c, const char *family, const char *targets, float p)
{
    memset(c, 0, sizeof *c);
    c->d = desc(family);
    c->B = 2, c->T = 4;
    TD_ASSERT_OK(td_model_lora_set(&c->d, 3, 6.0f, p, targets));
    const int N = c->B * c->T, C = c->d.n_embd;
    size_t np = td_model_params_numel(&c->d), off, span;
    c->p = calloc(np, 4), c->g = calloc(np, 4);
    td_model_init(&c->d, c->p, 11);
    td_rng r;
    td_rng_seed(&r, 3);
    for (int i = 0; i < td_model_tensor_count(&c->d); i++) { /* B non-zero */
        td_model_tensor t;
        td_model_tensor_get(&c->d, i, &t);
        if (TD_MODEL_IS_LORA(t.kind) && ((int)t.kind - TD_MODEL_PARAM_COUNT) % 2)
            for (size_t e = 0; e < t.numel; e++) c->p[t.offset + e] = (float)(td_rng_uniform(&r) - 0.5) * 0.4f;
    }
    td_model_block_span(&c->d, 1, &off, &span);
    td_model_block_view(&c->d, c->p + off, &c->w);
    td_model_block_view(&c->d, c->g + off, &c->gw);
    c->acts = calloc(td_model_block_acts_numel(&c->d, c->B, c->T), 4);
    c->xd = calloc(td_model_lora_drop_numel(&c->d, c->B, c->T) + 1, 4);
    c->scratch = calloc(td_model_block_scratch_numel(&c->d, c->B, c->T), 4);
    c->x = calloc((size_t)N * C, 4), c->dx = calloc((size_t)N * C, 4), c->wy = calloc((size_t)N * C, 4);
    for (int i = 0; i < N * C; i++) {
        c->x[i] = (float)(td_rng_uniform(&r) * 2 - 1);
        c->wy[i] = (float)(td_rng_uniform(&r) * 2 - 1);
    }
    td_model_block_acts_view(&c->d, c->B, c->T, c->acts, &c->a);
    c->key = (td_model_lora_drop){.seed = 42, .step = 7, .sample0 = 6, .layer = 1, .T = c->T};
    c->a.lora_drop = &c->key;
    c->a.lora_xd = c->xd;
}

static void block_free(block_case *c)
{
    free(c->p); free(c->g); free(c->acts); free(c->xd); free(c->scratch); free(c->x); free(c->dx); free(c->wy);
}

/* sum(y . wy) of the block's forward, in double */
static double block_loss(block_case *c)
{
    const int N = c->B * c->T, C = c->d.n_embd;
    float *y = calloc((size_t)N * C, 4);
    td_model_block_forward(&c->d, &c->w, &c->a, c->x, y, NULL, c->B, c->T);
    double s = 0;
    for (int i = 0; i < N * C; i++) s += (double)y[i] * c->wy[i];
    free(y);
    return s;
}

/* GPT-2's c_attn alone: qkv (kept in the acts, before attention) with the
 * adapters minus without equals s (drop(ln1) A^T) B^T, the mask evaluated
 * element by element from td_model_lora_dropped, within 1e-5; a recompute
 * (y NULL) keeps the same xa, bit for bit. */
static void test_block_forward_adds_the_dropped_update(void **state)
{
    (void)state;
    block_case c;
    block_setup(&c, "gpt2", "c_attn", 0.4f);
    const int N = c.B * c.T, C = c.d.n_embd, R = c.d.lora.rank, Q = 3 * C;
    const float s = c.d.lora.alpha / (float)R, keep = 1.0f / (1.0f - 0.4f);
    td_model_lora_target tg;
    td_model_lora_target_get(&c.d, 0, &tg);
    assert_int_equal(tg.module_index, 0);
    block_loss(&c);
    float *with = malloc((size_t)N * Q * 4), *xa = malloc((size_t)N * R * 4);
    memcpy(with, c.a.qkv, (size_t)N * Q * 4);
    memcpy(xa, c.a.lora_xa, (size_t)N * R * 4);
    td_model_block_forward(&c.d, &c.w, &c.a, c.x, NULL, NULL, c.B, c.T); /* the recompute */
    assert_memory_equal(xa, c.a.lora_xa, (size_t)N * R * 4);
    td_model_block b = c.w;
    b.lora_a[0] = b.lora_b[0] = NULL; /* the base module alone */
    td_model_block_forward(&c.d, &b, &c.a, c.x, NULL, NULL, c.B, c.T);
    size_t dropped = 0;
    for (int n = 0; n < N; n++) {
        double u[8] = {0};
        for (int r = 0; r < R; r++)
            for (int k = 0; k < C; k++) {
                const int drop = td_model_lora_dropped(&c.key, tg.module_index, n, k, 0.4f);
                dropped += drop && r == 0;
                u[r] += drop ? 0.0 : (double)(c.a.ln1[(size_t)n * C + k] * keep) * c.w.lora_a[0][(size_t)r * C + k];
            }
        for (int o = 0; o < Q; o++) {
            double want = 0;
            for (int r = 0; r < R; r++) want += s * u[r] * c.w.lora_b[0][(size_t)o * R + r];
            const double got = (double)with[(size_t)n * Q + o] - c.a.qkv[(size_t)n * Q + o];
            if (!(fabs(got - want) <= 1e-5 + 1e-5 * fabs(want)))
                fail_msg("row %d, output %d: the update %.9g, want %.9g", n, o, got, want);
        }
    }
    assert_true(dropped > 0 && dropped < (size_t)N * C / 2); /* P 0.4 of 256 inputs */
    free(with); free(xa);
    block_free(&c);
}

/* With dropout on (a fixed key), the gradients of A, B and the block's
 * input x from td_model_block_backward against central differences of
 * sum(y . wy); dA differs from the one without dropout. */
static void test_block_gradients_by_finite_differences(void **state)
{
    (void)state;
    static const struct { const char *family, *targets; } cases[] = {
        {"llama", NULL}, {"qwen2", "q_proj,v_proj,down_proj"}, {"gpt2", NULL}, {"gpt2", "c_proj"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        block_case c;
        block_setup(&c, cases[k].family, cases[k].targets, 0.3f);
        const int N = c.B * c.T, C = c.d.n_embd;
        block_loss(&c);
        td_model_block_backward(&c.d, &c.w, &c.gw, &c.a, c.x, c.wy, c.dx, c.scratch, NULL, c.B, c.T);
        td_rng r;
        td_rng_seed(&r, 17);
        int checked = 0;
        const int first = td_model_embed_tensor_count(&c.d) + td_model_block_tensor_count(&c.d);
        for (int i = first; i < first + td_model_block_tensor_count(&c.d); i++) { /* block 1's */
            td_model_tensor t;
            td_model_tensor_get(&c.d, i, &t);
            if (!TD_MODEL_IS_LORA(t.kind)) continue;
            for (int q = 0; q < 3; q++) {
                size_t e = t.offset + td_rng_below(&r, t.numel);
                const float eps = 1e-2f, was = c.p[e];
                c.p[e] = was + eps;
                const double lp = block_loss(&c);
                c.p[e] = was - eps;
                const double lm = block_loss(&c);
                c.p[e] = was;
                const double fd = (lp - lm) / (2.0 * eps);
                if (!(fabs(fd - c.g[e]) <= 2e-3 + 2e-2 * fabs(fd)))
                    fail_msg("%s %s: analytic %.6g, finite difference %.6g", cases[k].family, t.name, c.g[e], fd);
                checked++;
            }
        }
        for (int q = 0; q < 8; q++) { /* the input: the base's path and the adapters' dropped one */
            size_t e = td_rng_below(&r, (uint64_t)N * C);
            const float eps = 1e-2f, was = c.x[e];
            c.x[e] = was + eps;
            const double lp = block_loss(&c);
            c.x[e] = was - eps;
            const double lm = block_loss(&c);
            c.x[e] = was;
            const double fd = (lp - lm) / (2.0 * eps);
            if (!(fabs(fd - c.dx[e]) <= 2e-3 + 2e-2 * fabs(fd)))
                fail_msg("%s x[%zu]: analytic %.6g, finite difference %.6g", cases[k].family, e, c.dx[e], fd);
            checked++;
        }
        assert_true(checked >= 14);
        /* without the key: other gradients of A */
        size_t np = td_model_params_numel(&c.d);
        float *g0 = malloc(np * 4);
        memcpy(g0, c.g, np * 4);
        memset(c.g, 0, np * 4);
        memset(c.dx, 0, (size_t)N * C * 4);
        c.a.lora_drop = NULL;
        block_loss(&c);
        td_model_block_backward(&c.d, &c.w, &c.gw, &c.a, c.x, c.wy, c.dx, c.scratch, NULL, c.B, c.T);
        double most = 0;
        for (size_t e = 0; e < np; e++) most = fmax(most, fabs((double)g0[e] - c.g[e]));
        assert_true(most > 1e-3);
        free(g0);
        block_free(&c);
    }
}

/* --- the trainer --------------------------------------------------------------- */

static td_train_config run_config(float p)
{
    td_train_config c = td_train_default_config();
    c.model = desc("llama");
    c.model.n_layer = 3;
    TD_ASSERT_OK(td_model_lora_set(&c.model, 4, 8.0f, p, NULL));
    c.micro_batch = 2;
    c.seq_len = 16;
    c.backend = TD_BACKEND_CPU;
    c.mm.min_chunk_numel = 1024;
    c.mm.max_chunk_numel = 8192;
    c.optim.lr.lr = 1e-2;
    c.optim.lr.warmup_steps = 0;
    c.threads = 2;
    return c;
}

/* P 0.3: the losses differ from P 0's (from step 2: B starts at zero) and
 * are the same bits on a second run, and streamed through a tight budget
 * with every block recomputed; micro-batch 4 equals 2 micro-batches of 2
 * within 1e-5 (the masks follow the sample's place in the step). */
static void test_trainer_deterministic_and_keyed_by_sample(void **state)
{
    (void)state;
    enum { STEPS = 4 };
    td_train_config c = run_config(0.3f), z = run_config(0.0f);
    double a[STEPS], b[STEPS], zero[STEPS], off[STEPS];
    td_test_train(&c, STEPS, 7, a, NULL);
    td_test_train(&c, STEPS, 7, b, NULL);
    td_test_train(&z, STEPS, 7, zero, NULL);
    assert_memory_equal(a, b, sizeof a);
    assert_memory_equal(&a[0], &zero[0], sizeof a[0]); /* B = 0: the first forward is the base's */
    for (int s = 1; s < STEPS; s++)
        if (!(fabs(a[s] - zero[s]) > 1e-5 * fabs(zero[s])))
            fail_msg("step %d: P 0.3 %.9g, P 0 %.9g: the dropout changed nothing", s + 1, a[s], zero[s]);
    td_train_config v = td_test_offloaded_config(&c, 7);
    td_memmgr_stats st;
    td_test_train(&v, STEPS, 7, off, &st);
    assert_memory_equal(off, a, sizeof a);
    assert_true(st.evictions > 0);
    td_train_config m4 = c, m2 = c;
    m4.micro_batch = 4;
    m2.grad_accum = 2;
    double l4[STEPS], l2[STEPS];
    td_test_train(&m4, STEPS, 9, l4, NULL);
    td_test_train(&m2, STEPS, 9, l2, NULL);
    td_proc_expect_close(l4, l2, STEPS, 1e-5, "micro-batch 4 against 2 x 2, P 0.3");
}

/* Eval never drops: after training with P 0.5, the eval loss is the one
 * of the same adapters in a P 0 trainer, bit for bit; the folder's train
 * state resumes only with its P; a P of 1 or more, or below 0, set
 * straight into the config is refused before the first step. */
static void test_eval_does_not_drop(void **state)
{
    (void)state;
    td_train_config c = run_config(0.5f), z = run_config(0.0f);
    td_trainer *t;
    TD_ASSERT_OK(td_trainer_create(&c, &t));
    td_test_batches b = td_test_batches_of(&c, 5);
    for (int s = 0; s < 3; s++) {
        td_step_result r;
        TD_ASSERT_OK(td_trainer_step(t, td_test_next_batch, &b, &r));
    }
    char dir[] = "/tmp/td_lora_drop_XXXXXX", ad[300], cmd[400];
    assert_non_null(mkdtemp(dir));
    snprintf(ad, sizeof ad, "%s/ad", dir);
    double with, again, without;
    td_test_batches e = td_test_batches_of(&c, 1234);
    TD_ASSERT_OK(td_trainer_eval(t, td_test_next_batch, &e, 2, &with, NULL));
    e = td_test_batches_of(&c, 1234);
    TD_ASSERT_OK(td_trainer_eval(t, td_test_next_batch, &e, 2, &again, NULL));
    assert_memory_equal(&with, &again, sizeof with);
    TD_ASSERT_OK(td_trainer_save_adapter(t, ad, NULL, 1, NULL));
    td_trainer_destroy(t);
    TD_ASSERT_OK(td_trainer_create(&z, &t));
    /* its train state goes on with the folder's P alone */
    assert_int_equal(td_trainer_load_adapter(t, ad, 1), TD_ERR_INVALID);
    if (!strstr(td_error_msg(), "trained with --lora-dropout 0.5 and this run has 0"))
        fail_msg("resuming P 0.5 with P 0: %s", td_error_msg());
    TD_ASSERT_OK(td_trainer_load_adapter(t, ad, 0)); /* the adapters alone: any P */
    e = td_test_batches_of(&c, 1234);
    TD_ASSERT_OK(td_trainer_eval(t, td_test_next_batch, &e, 2, &without, NULL));
    td_trainer_destroy(t);
    assert_memory_equal(&with, &without, sizeof with);
    snprintf(cmd, sizeof cmd, "%s/adapter_config.json", ad);
    char *j = td_test_slurp(cmd, NULL);
    assert_non_null(strstr(j, "\"lora_dropout\":\t0.5"));
    free(j);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
    static const float bad[] = {1.0f, 1.5f, -0.1f};
    for (int i = 0; i < 3; i++) {
        td_train_config x = run_config(0.0f);
        x.model.lora.dropout = bad[i];
        t = NULL;
        assert_int_not_equal(td_trainer_create(&x, &t), TD_OK);
        if (!strstr(td_error_msg(), "--lora-dropout")) fail_msg("P %g: %s", (double)bad[i], td_error_msg());
        td_model_desc d = desc("llama");
        assert_int_equal(td_model_lora_set(&d, 4, 8, bad[i], NULL), TD_ERR_INVALID);
        assert_non_null(strstr(td_error_msg(), "give a probability in [0, 1)"));
    }
}

/* --- the command line ---------------------------------------------------------- */

/* `--lora-dropout 0.3` on 2 ranks (ZeRO-3, cpu backend, micro-batch 2)
 * gives one rank's losses (micro-batch 4) within 1e-5, which differ from
 * P 0's; the folder the 2 ranks save carries lora_dropout, and a run
 * resumed from it on 1 rank (no --lora-dropout given) continues the
 * one-rank run within 1e-5.  Bad P: exit 2 naming --lora-dropout, as is a
 * resume that gives another P than its folder's. */
static void test_cli_two_ranks_resume_and_bad_input(void **state)
{
    (void)state;
    enum { N = 6 };
    char dir[64], log[256];
    const char *o, *tidal = td_test_tidal();
    assert_int_equal(td_proc_tmpdir(dir, sizeof dir, "tidal-lora-drop"), 0);
    char run[512];
    snprintf(run, sizeof run, "--init %s/base --seq 32 --backend cpu --lora-rank 4 --lr 1e-2 --schedule constant "
             "--warmup 0", dir);
    int rc = td_proc_run(dir, "prepare", &o, "cat docs/*.md | head -c 60000 > %s/text && %s prepare --quiet --input %s/text "
                 "--out %s/text.tok && %s train --data %s/text.tok --model tiny-llama --layers 2 --seq 32 "
                 "--backend cpu --steps 2 --save %s/base", dir, tidal, dir, dir, tidal, dir, dir);
    if (rc) fail_msg("prepare and base: %s", o);
    double one[N], zero[N], got[N];
    snprintf(log, sizeof log, "%s/one.jsonl", dir);
    rc = td_proc_run(dir, "one", &o, "%s train --data %s/text.tok %s --lora-dropout 0.3 --steps %d --micro-batch 4 --log %s",
             tidal, dir, run, N, log);
    if (rc || td_proc_read_log(log, one, NULL, N) != N) fail_msg("one rank: exit %d: %s", rc, o);
    snprintf(log, sizeof log, "%s/zero.jsonl", dir);
    rc = td_proc_run(dir, "zero", &o, "%s train --data %s/text.tok %s --steps %d --micro-batch 4 --log %s", tidal, dir, run, N,
             log);
    if (rc || td_proc_read_log(log, zero, NULL, N) != N) fail_msg("P 0: exit %d: %s", rc, o);
    /* dropout changes the run: some step's loss moves by more than 1e-4 of
     * P 0's (not a given step's: the corpus is the docs' text, and on one
     * version of it the two runs' last losses came within 1.4e-5 while the
     * steps before differed by 1e-3) */
    double moved = 0.0;
    for (int i = 0; i < N; i++) moved = fmax(moved, fabs(one[i] - zero[i]) / fabs(zero[i]));
    if (!(moved > 1e-4)) fail_msg("--lora-dropout 0.3 left every loss within %g of P 0's", moved);
    snprintf(log, sizeof log, "%s/two.jsonl", dir);
    rc = td_proc_run(dir, "two", &o, "%s train --data %s/text.tok %s --lora-dropout 0.3 --steps %d --micro-batch 2 --nproc 2 "
             "--save %s/ad --log %s", tidal, dir, run, N / 2, dir, log);
    if (rc || td_proc_read_log(log, got, NULL, N / 2) != N / 2) fail_msg("two ranks: exit %d: %s", rc, o);
    td_proc_expect_close(one, got, N / 2, 1e-5, "LoRA dropout, 2 ranks against 1");
    char path[300];
    snprintf(path, sizeof path, "%s/ad/adapter_config.json", dir);
    char *j = td_test_slurp(path, NULL);
    if (!strstr(j, "\"lora_dropout\":\t0.3")) fail_msg("adapter_config.json without lora_dropout 0.3: %s", j);
    free(j);
    snprintf(log, sizeof log, "%s/resumed.jsonl", dir);
    snprintf(run, sizeof run, "--seq 32 --backend cpu --lora-rank 4 --lr 1e-2 --schedule constant --warmup 0");
    rc = td_proc_run(dir, "resumed", &o, "%s train --data %s/text.tok %s --steps %d --micro-batch 4 --resume %s/ad --log %s",
             tidal, dir, run, N, dir, log);
    if (rc || td_proc_read_log(log, got, NULL, N / 2) != N / 2) fail_msg("resumed: exit %d: %s", rc, o);
    td_proc_expect_close(one + N / 2, got, N / 2, 1e-5, "resumed on 1 rank, P from the folder");
    rc = td_proc_run(dir, "other", &o, "%s train --data %s/text.tok %s --steps %d --lora-dropout 0.1 --resume %s/ad", tidal,
             dir, run, N, dir);
    if (rc != 2 || !strstr(o, "--lora-dropout")) fail_msg("a resume with another P: exit %d (want 2): %s", rc, o);
    static const char *const bad[] = {"1", "-0.1", "1.5", "nan"};
    for (int i = 0; i < 4; i++) {
        rc = td_proc_run(dir, "bad", &o, "%s train --data %s/text.tok %s --steps 1 --lora-dropout %s", tidal, dir, run, bad[i]);
        if (rc != 2 || !strstr(o, "--lora-dropout") || !strstr(o, "[0, 1)"))
            fail_msg("--lora-dropout %s: exit %d (want 2): %s", bad[i], rc, o);
    }
    td_proc_rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mask_drops_p_and_every_field_counts),
        cmocka_unit_test(test_python_copy_draws_the_same_masks),
        cmocka_unit_test(test_block_forward_adds_the_dropped_update),
        cmocka_unit_test(test_block_gradients_by_finite_differences),
        cmocka_unit_test(test_trainer_deterministic_and_keyed_by_sample),
        cmocka_unit_test(test_eval_does_not_drop),
        cmocka_unit_test(test_cli_two_ranks_resume_and_bad_input),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
