/* LoRA (model.h's td_model_lora) on the CPU reference and in the trainer:
 * the adapters' gradients by finite differences (LLaMA, Qwen2, GPT-2), a
 * zero B changes nothing, the merged weights evaluate as base + adapters,
 * the trainer's run equals a reference AdamW over the adapters alone with
 * the base bit for bit unchanged (offloaded or resident), PEFT's
 * initialisation and shapes, and bad targets and ranks refused. */
#include "td_proc.h"
#include "td_train_test.h"
#include "tidal/model.h"
#include "tidal/safetensors.h"

#include <unistd.h>

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

static float loss_of(const td_model_desc *d, const float *p, const int *tok, const int *tgt, int B, int T, float *acts)
{
    float loss;
    int n;
    TD_ASSERT_OK(td_model_forward(d, p, tok, tgt, B, T, acts, &loss, &n));
    return loss;
}

static void batch(int V, int n, int *tok, int *tgt, uint64_t seed)
{
    td_rng r;
    td_rng_seed(&r, seed);
    for (int i = 0; i < n; i++) {
        tok[i] = (int)td_rng_below(&r, (uint64_t)V);
        tgt[i] = (tok[i] * 7 + 3) % V;
    }
}

static const struct { const char *family, *targets; } cases[] = {
    {"llama", NULL}, {"qwen2", "q_proj,v_proj,down_proj"}, {"gpt2", NULL}, {"gpt2", "c_proj"},
};

/* dL/dA and dL/dB from td_model_backward against central differences (in
 * double around fp32 losses), B made non-zero so that A's gradient is. */
static void test_gradients_by_finite_differences(void **state)
{
    enum { B = 2, T = 8, N = B * T };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        td_model_desc d = desc(cases[k].family);
        TD_ASSERT_OK(td_model_lora_set(&d, 3, 6.0f, 0.0f, cases[k].targets));
        size_t np = td_model_params_numel(&d);
        float *p = calloc(np, 4), *g = calloc(np, 4), *acts = calloc(td_model_acts_numel(&d, B, T), 4);
        float *scratch = calloc(td_model_scratch_numel(&d, B, T), 4);
        int tok[N], tgt[N];
        batch(d.vocab_size, N, tok, tgt, 5);
        td_model_init(&d, p, 11);
        td_rng r;
        td_rng_seed(&r, 3);
        int n = td_model_tensor_count(&d), checked = 0;
        for (int i = 0; i < n; i++) { /* B non-zero */
            td_model_tensor t;
            td_model_tensor_get(&d, i, &t);
            if (TD_MODEL_IS_LORA(t.kind) && ((int)t.kind - TD_MODEL_PARAM_COUNT) % 2)
                for (size_t e = 0; e < t.numel; e++) p[t.offset + e] = (float)(td_rng_uniform(&r) - 0.5) * 0.2f;
        }
        loss_of(&d, p, tok, tgt, B, T, acts);
        TD_ASSERT_OK(td_model_backward(&d, p, g, tok, tgt, 1.0f / N, B, T, acts, scratch));
        for (int i = 0; i < n; i++) {
            td_model_tensor t;
            td_model_tensor_get(&d, i, &t);
            if (!TD_MODEL_IS_LORA(t.kind)) continue;
            for (int q = 0; q < 3; q++) {
                size_t e = t.offset + td_rng_below(&r, t.numel);
                const float eps = 1e-2f, keep = p[e];
                p[e] = keep + eps;
                double lp = loss_of(&d, p, tok, tgt, B, T, acts);
                p[e] = keep - eps;
                double lm = loss_of(&d, p, tok, tgt, B, T, acts);
                p[e] = keep;
                double fd = (lp - lm) / (2.0 * eps);
                if (!(fabs(fd - g[e]) <= 2e-3 + 2e-2 * fabs(fd)))
                    fail_msg("%s %s: analytic %.6g, finite difference %.6g", cases[k].family, t.name, g[e], fd);
                checked++;
            }
        }
        assert_true(checked >= 6);
        free(p); free(g); free(acts); free(scratch);
    }
}

/* B = 0 (PEFT's start): the same losses as the base model, bit for bit;
 * after the adapters move, the merged weights (W + s B A) evaluate as
 * base + adapters within 1e-5. */
static void test_zero_b_and_merge(void **state)
{
    enum { B = 2, T = 8, N = B * T };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        td_model_desc base = desc(cases[k].family), d = base;
        TD_ASSERT_OK(td_model_lora_set(&d, 4, 8.0f, 0.0f, cases[k].targets));
        size_t np = td_model_params_numel(&d), nb = td_model_params_numel(&base);
        assert_true(np > nb);
        float *p = calloc(np, 4), *m = calloc(nb, 4);
        float *acts = calloc(td_model_acts_numel(&d, B, T), 4), *bacts = calloc(td_model_acts_numel(&base, B, T), 4);
        int tok[N], tgt[N];
        batch(d.vocab_size, N, tok, tgt, 9);
        td_model_init(&d, p, 11);
        td_model_lora_merge(&d, p, m);
        /* the base tensors draw the same values with or without adapters */
        float *b0 = calloc(nb, 4);
        td_model_init(&base, b0, 11);
        assert_memory_equal(m, b0, nb * 4);
        float with = loss_of(&d, p, tok, tgt, B, T, acts), without = loss_of(&base, m, tok, tgt, B, T, bacts);
        assert_memory_equal(&with, &without, sizeof with);
        /* A: kaiming uniform (a = sqrt 5): |a| <= 1 / sqrt(in), not all tiny; B: zero */
        for (int i = 0; i < td_model_tensor_count(&d); i++) {
            td_model_tensor t;
            td_model_tensor_get(&d, i, &t);
            if (!TD_MODEL_IS_LORA(t.kind)) continue;
            int isb = ((int)t.kind - TD_MODEL_PARAM_COUNT) % 2;
            float bound = 1.0f / sqrtf((float)t.shape[1]), big = 0;
            for (size_t e = 0; e < t.numel; e++) {
                float v = fabsf(p[t.offset + e]);
                if (isb) assert_true(v == 0.0f);
                else assert_true(v <= bound);
                if (v > big) big = v;
            }
            if (!isb) assert_true(big > 0.5f * bound);
            assert_non_null(strstr(t.name, isb ? ".lora_B.weight" : ".lora_A.weight"));
            td_rng r;
            td_rng_seed(&r, (uint64_t)i);
            for (size_t e = 0; isb && e < t.numel; e++) p[t.offset + e] = (float)(td_rng_uniform(&r) - 0.5) * 0.3f;
        }
        td_model_lora_merge(&d, p, m);
        with = loss_of(&d, p, tok, tgt, B, T, acts);
        without = loss_of(&base, m, tok, tgt, B, T, bacts);
        if (!(fabsf(with - without) <= 1e-5f * fabsf(with)))
            fail_msg("%s: base + adapters %.9g, merged %.9g", cases[k].family, with, without);
        assert_true(fabsf(with - loss_of(&base, b0, tok, tgt, B, T, bacts)) > 1e-4f); /* the adapters matter */
        free(p); free(m); free(b0); free(acts); free(bacts);
    }
}

static td_train_config run_config(const char *family, const char *targets)
{
    td_train_config c = td_train_default_config();
    c.model = desc(family);
    c.model.n_layer = 3;
    TD_ASSERT_OK(td_model_lora_set(&c.model, 4, 8.0f, 0.0f, targets));
    c.micro_batch = 2;
    c.seq_len = 16;
    c.backend = TD_BACKEND_CPU;
    c.mm.min_chunk_numel = 1024;
    c.mm.max_chunk_numel = 8192;
    c.optim.lr.lr = 1e-2;
    c.optim.lr.warmup_steps = 0;
    c.optim.adam.weight_decay = 0.01;
    c.threads = 2;
    return c;
}

static void test_trainer_matches_reference(void **state)
{
    enum { STEPS = 5 };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        td_train_config c = run_config(cases[k].family, cases[k].targets);
        const td_model_desc *mc = &c.model;
        size_t np = td_model_params_numel(mc);
        float *want = malloc(np * 4), *init = malloc(np * 4);
        double lw[STEPS], lg[STEPS];
        int n = td_model_tensor_count(mc);
        uint8_t *trains = malloc((size_t)n);
        for (int i = 0; i < n; i++) {
            td_model_tensor tt;
            td_model_tensor_get(mc, i, &tt);
            trains[i] = TD_MODEL_IS_LORA(tt.kind); /* the adapters alone */
        }
        td_test_reference_train(&c, trains, STEPS, lw, want);
        free(trains);
        td_model_init(mc, init, c.seed);
        td_trainer *t;
        TD_ASSERT_OK(td_trainer_create(&c, &t));
        td_test_batches b = td_test_batches_of(&c, 99);
        for (int s = 0; s < STEPS; s++) {
            td_step_result r;
            TD_ASSERT_OK(td_trainer_step(t, td_test_next_batch, &b, &r));
            lg[s] = r.loss;
            if (!(fabs(lg[s] - lw[s]) <= 2e-6 * fabs(lw[s])))
                fail_msg("%s step %d: trainer %.9g, reference %.9g", cases[k].family, s, lg[s], lw[s]);
        }
        TD_ASSERT_OK(td_trainer_finish_update(t));
        td_memmgr *mm = td_trainer_memmgr(t);
        for (int i = 0; i < td_model_tensor_count(mc); i++) {
            td_model_tensor tt;
            int pid, gid;
            void *h;
            td_model_tensor_get(mc, i, &tt);
            td_trainer_tensor_ids(t, i, &pid, &gid, NULL, NULL);
            TD_ASSERT_OK(td_memmgr_host_access(mm, &pid, 1, TD_ACCESS_READ, &h));
            if (!TD_MODEL_IS_LORA(tt.kind)) { /* the base: frozen, bit for bit */
                assert_int_equal(gid, -1);
                assert_memory_equal(h, init + tt.offset, tt.numel * 4);
                continue;
            }
            assert_true(gid >= 0);
            int moved = 0;
            for (size_t e = 0; e < tt.numel; e++) moved |= ((float *)h)[e] != init[tt.offset + e];
            assert_true(moved); /* A and B both train (B from zero) */
            for (size_t e = 0; e < tt.numel; e++)
                if (!(fabsf(((float *)h)[e] - want[tt.offset + e]) <= 1e-5f))
                    fail_msg("%s %s[%zu]: trainer %.9g, reference %.9g", cases[k].family, tt.name, e,
                             ((float *)h)[e], want[tt.offset + e]);
        }
        td_trainer_destroy(t);
        free(want); free(init);
    }
}

/* Streaming the frozen base through a tight budget with recomputed blocks:
 * the same losses, bit for bit, as everything resident. */
static void test_offloaded_is_bit_identical(void **state)
{
    enum { STEPS = 3 };
    td_train_config c = run_config("llama", NULL);
    c.mm.placement = TD_PLACEMENT_CUDA;
    c.gpu_budget = 64 * TD_MiB;
    double ref[STEPS], got[STEPS];
    td_test_train(&c, STEPS, 7, ref, NULL);
    td_train_config v = td_test_offloaded_config(&c, 7);
    td_memmgr_stats st;
    td_test_train(&v, STEPS, 7, got, &st);
    assert_memory_equal(got, ref, sizeof got);
    assert_true(st.evictions > 0);
}

static void expect_bad(const char *family, int rank, float alpha, float p, const char *targets, const char *needle)
{
    td_model_desc d = desc(family);
    assert_int_equal(td_model_lora_set(&d, rank, alpha, p, targets), TD_ERR_INVALID);
    if (!strstr(td_error_msg(), needle)) fail_msg("expected '%s' in: %s", needle, td_error_msg());
    assert_int_equal(d.lora.rank, 0);
}

static void test_bad_input(void **state)
{
    expect_bad("llama", 4, 8, 0, "q_proj,qq_proj", "'qq_proj' is no linear module of the LLaMA block");
    expect_bad("llama", 4, 8, 0, "c_attn", "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj");
    expect_bad("gpt2", 4, 8, 0, "q_proj", "c_attn");
    expect_bad("llama", 0, 8, 0, NULL, "at least 1");
    expect_bad("llama", 17, 8, 0, "k_proj", "above self_attn.k_proj's width (16 x 32): at most 16");
    expect_bad("llama", 4, 0, 0, NULL, "--lora-alpha");
    expect_bad("llama", 4, 8, 1.0f, NULL, "--lora-dropout");
    /* GPT-2's c_proj is two modules (attn and mlp); PEFT's target list names it once */
    td_model_desc d = desc("gpt2");
    TD_ASSERT_OK(td_model_lora_set(&d, 2, 2, 0, "c_proj"));
    assert_int_equal(td_model_lora_count(&d), 2);
    char mods[128];
    td_model_lora_modules(&d, mods, sizeof mods);
    assert_string_equal(mods, "c_proj");
    d = desc("llama");
    TD_ASSERT_OK(td_model_lora_set(&d, 2, 2, 0, NULL));
    td_model_lora_modules(&d, mods, sizeof mods);
    assert_string_equal(mods, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj");
    /* v_proj: rows [NH hs + NKV hs, QKV) of the fused q|k|v */
    TD_ASSERT_OK(td_model_lora_set(&d, 2, 2, 0, "v_proj"));
    td_model_lora_target tg;
    td_model_lora_target_get(&d, 0, &tg);
    assert_int_equal(tg.kind, TD_MODEL_QKV_W);
    assert_int_equal(tg.row0, 32 + 16);
    assert_int_equal(tg.rows, 16);
    assert_string_equal(tg.module, "self_attn.v_proj");
    /* a dropout in [0, 1) trains (test_lora_dropout.c); one of 1 or more is refused before the first step */
    td_train_config c = run_config("llama", NULL);
    c.model.lora.dropout = 0.1f;
    td_trainer *t = NULL;
    TD_ASSERT_OK(td_trainer_create(&c, &t));
    td_trainer_destroy(t);
    c.model.lora.dropout = 1.0f;
    assert_int_not_equal(td_trainer_create(&c, &t), TD_OK);
    assert_non_null(strstr(td_error_msg(), "--lora-dropout 1: give a probability in [0, 1)"));
}


/* --save of a LoRA run: a PEFT folder (PEFT's names and shapes, its
 * adapter_config.json); loaded into a fresh run it gives the same
 * adapters, and with its train state the run continues bit for bit. */
static void test_adapter_save_resume(void **state)
{
    enum { STEPS = 5, CUT = 2 };
    for (int k = 0; k < 3; k += 2) { /* llama, gpt2 */
        td_train_config c = run_config(cases[k].family, cases[k].targets);
        double straight[STEPS];
        td_test_train(&c, STEPS, 99, straight, NULL);
        char dir[] = "/tmp/td_lora_XXXXXX", ad[300], path[400];
        assert_non_null(mkdtemp(dir));
        snprintf(ad, sizeof ad, "%s/adapter", dir);
        td_trainer *t;
        TD_ASSERT_OK(td_trainer_create(&c, &t));
        td_test_batches b = td_test_batches_of(&c, 99);
        for (int s = 0; s < CUT; s++) {
            td_step_result r;
            TD_ASSERT_OK(td_trainer_step(t, td_test_next_batch, &b, &r));
        }
        const char *meta[] = {"note", "kept", NULL};
        TD_ASSERT_OK(td_trainer_save_adapter(t, ad, "/models/base", 1, meta));
        td_trainer_destroy(t);
        /* the files as PEFT writes them */
        snprintf(path, sizeof path, "%s/adapter_model.safetensors", ad);
        td_st_reader *f;
        TD_ASSERT_OK(td_st_open(path, &f));
        const char *q = strcmp(cases[k].family, "gpt2")
                          ? "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
                          : "base_model.model.transformer.h.1.attn.c_attn.lora_B.weight";
        const td_st_tensor *x = td_st_find(f, q);
        if (!x) fail_msg("no tensor %s", q);
        assert_int_equal(x->ndim, 2);
        assert_int_equal(x->shape[strcmp(cases[k].family, "gpt2") ? 0 : 1], 4); /* A (R, in), B (out, R) */
        assert_int_equal(td_st_tensor_count(f), 2 * td_model_lora_count(&c.model) * c.model.n_layer);
        td_st_close(f);
        snprintf(path, sizeof path, "%s/adapter_config.json", ad);
        char *cfg = td_test_slurp(path, NULL);
        assert_non_null(strstr(cfg, "\"base_model_name_or_path\":\t\"/models/base\""));
        assert_non_null(strstr(cfg, "\"peft_type\":\t\"LORA\""));
        assert_non_null(strstr(cfg, "\"r\":\t4"));
        assert_non_null(strstr(cfg, "\"lora_alpha\":\t8"));
        assert_non_null(strstr(cfg, strcmp(cases[k].family, "gpt2") ? "\"down_proj\"" : "\"c_fc\""));
        free(cfg);
        char note[16];
        assert_non_null(td_trainer_adapter_meta(ad, "note", note, sizeof note));
        assert_string_equal(note, "kept");
        /* resume: the same losses from the cut on */
        TD_ASSERT_OK(td_trainer_create(&c, &t));
        TD_ASSERT_OK(td_trainer_load_adapter(t, ad, 1));
        assert_int_equal(td_trainer_optim(t)->step, CUT);
        for (int s = CUT; s < STEPS; s++) {
            td_step_result r;
            TD_ASSERT_OK(td_trainer_step(t, td_test_next_batch, &b, &r));
            assert_memory_equal(&r.loss, &straight[s], sizeof(double));
        }
        td_trainer_destroy(t);
        /* another rank's adapters are refused, naming the tensor */
        td_train_config o = c;
        TD_ASSERT_OK(td_model_lora_set(&o.model, 2, 8.0f, 0.0f, cases[k].targets));
        TD_ASSERT_OK(td_trainer_create(&o, &t));
        assert_int_not_equal(td_trainer_load_adapter(t, ad, 0), TD_OK);
        assert_non_null(strstr(td_error_msg(), "lora_A.weight"));
        td_trainer_destroy(t);
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
        assert_int_equal(system(cmd), 0);
    }
}

/* A LoRA run starts from a checkpoint's base weights (--init): with B = 0
 * its first loss is the base's own, bit for bit (the files' tensors land
 * in the base tensors of a layout that also holds adapters). */
static void test_init_from_base_checkpoint(void **state)
{
    for (int k = 0; k < 3; k += 2) {
        td_train_config base = run_config(cases[k].family, NULL);
        base.model.lora = (td_model_lora){0};
        base.seed = 5;
        char dir[] = "/tmp/td_lora_XXXXXX", ck[300];
        assert_non_null(mkdtemp(dir));
        snprintf(ck, sizeof ck, "%s/base", dir);
        td_trainer *t;
        TD_ASSERT_OK(td_trainer_create(&base, &t));
        td_test_batches b = td_test_batches_of(&base, 3);
        td_step_result r, r0, r1;
        TD_ASSERT_OK(td_trainer_step(t, td_test_next_batch, &b, &r));
        TD_ASSERT_OK(td_trainer_save(t, ck, 0, NULL));
        TD_ASSERT_OK(td_trainer_step(t, td_test_next_batch, &b, &r0)); /* the saved weights' loss on batch 2 */
        td_trainer_destroy(t);
        td_train_config c = run_config(cases[k].family, cases[k].targets); /* seed 1337: other fresh weights */
        TD_ASSERT_OK(td_trainer_create(&c, &t));
        TD_ASSERT_OK(td_trainer_load(t, ck, 0, NULL));
        b = td_test_batches_of(&base, 3);
        TD_ASSERT_OK(td_test_next_batch(&b, (int32_t[32]){0}, (int32_t[32]){0}, NULL)); /* skip batch 1 */
        TD_ASSERT_OK(td_trainer_step(t, td_test_next_batch, &b, &r1));
        assert_memory_equal(&r1.loss, &r0.loss, sizeof(double));
        td_trainer_destroy(t);
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
        assert_int_equal(system(cmd), 0);
    }
}

/* The merged checkpoint (td_trainer_save_merged, `tidal merge`) of trained
 * adapters evaluates as base + adapters within 1e-5, on the fused q|k|v
 * and gate|up rows and GPT-2's transposed Conv1D alike. */
static void test_merged_checkpoint_evaluates_alike(void **state)
{
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        td_train_config c = run_config(cases[k].family, cases[k].targets);
        c.optim.lr.lr = 3e-2;
        char dir[] = "/tmp/td_lora_XXXXXX", out[300];
        assert_non_null(mkdtemp(dir));
        snprintf(out, sizeof out, "%s/merged", dir);
        td_trainer *t;
        TD_ASSERT_OK(td_trainer_create(&c, &t));
        td_test_batches b = td_test_batches_of(&c, 99);
        for (int s = 0; s < 4; s++) {
            td_step_result r;
            TD_ASSERT_OK(td_trainer_step(t, td_test_next_batch, &b, &r));
        }
        double with, merged, base_loss;
        td_test_batches e = td_test_batches_of(&c, 1234);
        TD_ASSERT_OK(td_trainer_eval(t, td_test_next_batch, &e, 2, &with, NULL));
        TD_ASSERT_OK(td_trainer_save_merged(t, out));
        td_trainer_destroy(t);
        td_train_config m = c;
        m.model.lora = (td_model_lora){0};
        td_model_desc got;
        TD_ASSERT_OK(td_trainer_checkpoint_model(out, &got));
        assert_int_equal(got.lora.rank, 0);
        assert_int_equal(got.n_layer, c.model.n_layer);
        TD_ASSERT_OK(td_trainer_create(&m, &t));
        TD_ASSERT_OK(td_trainer_eval(t, td_test_next_batch, (e = td_test_batches_of(&c, 1234), &e), 2, &base_loss, NULL));
        TD_ASSERT_OK(td_trainer_load(t, out, 0, NULL));
        e = td_test_batches_of(&c, 1234);
        TD_ASSERT_OK(td_trainer_eval(t, td_test_next_batch, &e, 2, &merged, NULL));
        td_trainer_destroy(t);
        if (!(fabs(with - merged) <= 1e-5 * fabs(with)))
            fail_msg("%s: base + adapters %.9g, merged %.9g", cases[k].family, with, merged);
        assert_true(fabs(with - base_loss) > 1e-4); /* the adapters changed the model */
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
        assert_int_equal(system(cmd), 0);
    }
}

/* Runs the command (td_proc_start: stdout and stderr into DIR/NAME.out);
 * returns its exit status, the output in *out (td_proc_slurp). */
/* `tidal eval` and `tidal generate --checkpoint ADAPTER_DIR` run base +
 * adapters: eval's loss equals the merged checkpoint's (`tidal merge`)
 * within 1e-6 and differs from the base's; generate samples the merged
 * model's text token for token (greedy and seeded); --base overrides the
 * folder's base; a missing base fails as a missing checkpoint does (exit
 * 1) naming it, and --base without an adapter is a usage error (exit 2). */
static void test_eval_and_generate_an_adapter_folder(void **state)
{
    (void)state;
    char dir[64];
    const char *o, *tidal = td_test_tidal();
    assert_int_equal(td_proc_tmpdir(dir, sizeof dir, "tidal-lora-cli"), 0);
    const char *model = "--model tiny-llama --layers 2 --seq 64 --backend cpu";
    int rc = td_proc_run(dir, "prepare", &o, "cat docs/*.md | head -c 200000 > %s/text && %s prepare --quiet --input %s/text "
                 "--out %s/text.tok", dir, tidal, dir, dir);
    if (rc) fail_msg("prepare: %s", o);
    rc = td_proc_run(dir, "base", &o, "%s train --data %s/text.tok %s --steps 10 --lr 3e-3 --save %s/base", tidal, dir, model, dir);
    if (rc) fail_msg("base: %s", o);
    rc = td_proc_run(dir, "lora", &o, "%s train --data %s/text.tok --init %s/base --seq 64 --backend cpu --lora-rank 4 "
             "--lora-alpha 8 --lora-targets q_proj,v_proj,down_proj --steps 10 --lr 1e-2 --save %s/ad", tidal, dir, dir,
             dir);
    if (rc) fail_msg("lora: %s", o);
    rc = td_proc_run(dir, "merge", &o, "%s merge --adapter %s/ad --out %s/merged", tidal, dir, dir);
    if (rc) fail_msg("merge: %s", o);
    static const char *const which[] = {"ad", "merged", "base"};
    double loss[3];
    for (int k = 0; k < 3; k++) {
        rc = td_proc_run(dir, which[k], &o, "%s eval --checkpoint %s/%s --data %s/text.tok --seq 64 --batches 4 --json "
                 "--backend cpu", tidal, dir, which[k], dir);
        const char *l = strstr(o, "\"loss\":");
        if (rc || !l) fail_msg("eval %s: exit %d: %s", which[k], rc, o);
        loss[k] = strtod(l + 7, NULL);
    }
    print_message("eval: adapter folder %.9f, merged %.9f, base %.9f\n", loss[0], loss[1], loss[2]);
    assert_true(fabs(loss[0] - loss[1]) <= 1e-6 * fabs(loss[1]));
    assert_true(fabs(loss[0] - loss[2]) > 1e-6 * fabs(loss[2])); /* the adapters moved it */
    static const char *const how[] = {"--temperature 0", "--temperature 0.9 --seed 7"};
    for (int h = 0; h < 2; h++) {
        char text[2][4096];
        for (int k = 0; k < 2; k++) {
            rc = td_proc_run(dir, "gen", &o, "%s generate --checkpoint %s/%s --prompt 'The model' --tokens 40 %s",
                     tidal, dir, which[k], how[h]);
            if (rc) fail_msg("generate %s: exit %d: %s", which[k], rc, o);
            snprintf(text[k], sizeof text[k], "%s", o);
            char *speed = strstr(text[k], "tidal generate:"); /* the text alone, not the timing on stderr */
            if (speed) *speed = '\0';
        }
        if (strcmp(text[0], text[1])) fail_msg("generate %s: adapter folder '%s', merged '%s'", how[h], text[0], text[1]);
    }
    char from[128], to[128];
    snprintf(from, sizeof from, "%s/base", dir);
    snprintf(to, sizeof to, "%s/base2", dir);
    assert_int_equal(rename(from, to), 0);
    rc = td_proc_run(dir, "moved", &o, "%s eval --checkpoint %s/ad --data %s/text.tok --seq 64 --batches 1 --backend cpu", tidal,
             dir, dir);
    if (rc != 1 || !strstr(o, "the base model")) fail_msg("eval with its base gone: exit %d (want 1): %s", rc, o);
    rc = td_proc_run(dir, "based", &o, "%s eval --checkpoint %s/ad --base %s/base2 --data %s/text.tok --seq 64 --batches 4 "
             "--json --backend cpu", tidal, dir, dir, dir);
    const char *l = strstr(o, "\"loss\":");
    if (rc || !l) fail_msg("eval --base: exit %d: %s", rc, o);
    assert_true(fabs(strtod(l + 7, NULL) - loss[0]) <= 1e-9 * fabs(loss[0]));
    rc = td_proc_run(dir, "nobase", &o, "%s generate --checkpoint %s/merged --base %s/base2 --tokens 2", tidal, dir, dir);
    if (rc != 2 || !strstr(o, "adapter_config.json")) fail_msg("--base without an adapter: exit %d (want 2): %s", rc, o);
    td_proc_rmdir(dir);
}

/* LoRA on 2 ranks (ZeRO-3: each rank's host holds its shard of the
 * adapters, their master and moments): the losses of one rank's run with
 * the same global batch within 1e-6; an adapter folder --saved from the 2
 * ranks (gathered, written by rank 0) and resumed on 2 ranks and on 1
 * continues that run within 1e-6. */
static void test_two_ranks_save_and_resume(void **state)
{
    (void)state;
    enum { N = 8 };
    char dir[64], log[256];
    const char *o, *tidal = td_test_tidal();
    assert_int_equal(td_proc_tmpdir(dir, sizeof dir, "tidal-lora-ranks"), 0);
    const char *run = "--lora-rank 4 --lora-targets q_proj,v_proj,down_proj --seq 64 --backend cpu --lr 1e-2 "
                      "--schedule constant --warmup 0";
    int rc = td_proc_run(dir, "prepare", &o, "cat docs/*.md | head -c 200000 > %s/text && %s prepare --quiet --input %s/text "
                 "--out %s/text.tok", dir, tidal, dir, dir);
    if (rc) fail_msg("prepare: %s", o);
    rc = td_proc_run(dir, "base", &o, "%s train --data %s/text.tok --model tiny-llama --layers 2 --seq 64 --backend cpu "
             "--steps 5 --save %s/base", tidal, dir, dir);
    if (rc) fail_msg("base: %s", o);
    double one[N], got[N];
    snprintf(log, sizeof log, "%s/one.jsonl", dir);
    rc = td_proc_run(dir, "one", &o, "%s train --data %s/text.tok --init %s/base %s --steps %d --micro-batch 4 --log %s", tidal,
             dir, dir, run, N, log);
    if (rc || td_proc_read_log(log, one, NULL, N) != N) fail_msg("one rank: exit %d: %s", rc, o);
    snprintf(log, sizeof log, "%s/two.jsonl", dir);
    rc = td_proc_run(dir, "two", &o, "%s train --data %s/text.tok --init %s/base %s --steps %d --micro-batch 2 --nproc 2 "
             "--save %s/ad --log %s", tidal, dir, dir, run, N / 2, dir, log);
    if (rc || td_proc_read_log(log, got, NULL, N / 2) != N / 2) fail_msg("two ranks: exit %d: %s", rc, o);
    td_proc_expect_close(one, got, N / 2, 1e-6, "LoRA, 2 ranks against 1");
    for (int ranks = 1; ranks <= 2; ranks++) {
        snprintf(log, sizeof log, "%s/resumed%d.jsonl", dir, ranks);
        rc = td_proc_run(dir, "resumed", &o, "%s train --data %s/text.tok %s --steps %d --micro-batch %d --nproc %d --resume "
                 "%s/ad --log %s", tidal, dir, run, N, 4 / ranks, ranks, dir, log);
        if (rc || td_proc_read_log(log, got, NULL, N / 2) != N / 2)
            fail_msg("resumed on %d rank(s): exit %d: %s", ranks, rc, o);
        td_proc_expect_close(one + N / 2, got, N / 2, 1e-6, ranks == 1 ? "resumed on 1 rank" : "resumed on 2 ranks");
    }
    td_proc_rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gradients_by_finite_differences),
        cmocka_unit_test(test_zero_b_and_merge),
        cmocka_unit_test(test_trainer_matches_reference),
        cmocka_unit_test(test_offloaded_is_bit_identical),
        cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_adapter_save_resume),
        cmocka_unit_test(test_init_from_base_checkpoint),
        cmocka_unit_test(test_merged_checkpoint_evaluates_alike),
        cmocka_unit_test(test_eval_and_generate_an_adapter_folder),
        cmocka_unit_test(test_two_ranks_save_and_resume),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
