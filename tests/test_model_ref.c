/* The GPT-2 reference model (include/tidal/model_ref.h): the parameter table,
 * initialisation, input checks, a finite-difference check of the whole model
 * (embedding, 2 blocks, head, loss) and bit-identical results for any thread
 * count. */
#include "td_test.h"
#include "tidal/model_ref.h"
#include "tidal/model.h"
#include "tidal/ops.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static float *fvec(size_t n) { float *p = calloc(n ? n : 1, sizeof(float)); assert_non_null(p); return p; }

static const td_model_desc tiny = {
    .n_layer = 2, .n_head = 2, .n_embd = 16, .n_positions = 8, .vocab_size = 20, .padded_vocab_size = 24,
};

/* --- layout --------------------------------------------------------------- */

static void test_layout_table(void **state)
{
    /* GPT-2 124M: Hugging Face counts 124,439,808 parameters (V = 50257);
     * padded to 50304 as in llm.c: 124,475,904. */
    td_model_desc g = {.n_layer = 12, .n_head = 12, .n_embd = 768, .n_positions = 1024, .vocab_size = 50257, .padded_vocab_size = 50257};
    TD_ASSERT_OK(td_model_desc_check(&g));
    assert_int_equal(td_model_params_numel(&g), 124439808);
    g.padded_vocab_size = 50304;
    assert_int_equal(td_model_params_numel(&g), 124475904);
    assert_int_equal(td_model_tensor_count(&g), 4 + 12 * 12);

    /* tensors tile the buffer in order; each block is one contiguous span */
    size_t next = 0;
    for (int i = 0; i < td_model_tensor_count(&g); i++) {
        td_model_tensor t;
        td_model_tensor_get(&g, i, &t);
        assert_int_equal(t.offset, next);
        assert_int_equal(t.numel, t.ndim == 2 ? (size_t)t.shape[0] * t.shape[1] : (size_t)t.shape[0]);
        next += t.numel;
        if (t.layer >= 0) {
            size_t off, n;
            td_model_block_span(&g, t.layer, &off, &n);
            assert_true(t.offset >= off && t.offset + t.numel <= off + n);
            if (t.kind == TD_MODEL_LN1_W) assert_int_equal(t.offset, off);
            if (t.kind == TD_MODEL_FCPROJ_B) assert_int_equal(t.offset + t.numel, off + n);
        }
    }
    assert_int_equal(next, td_model_params_numel(&g));

    /* names, shapes and HF orientation of a few */
    td_model_tensor t;
    td_model_tensor_get(&g, 0, &t);
    assert_string_equal(t.name, "wte.weight");
    assert_int_equal(t.shape[0], 50304);
    td_model_tensor_get(&g, 2 + 12 * 3 + 2, &t);
    assert_string_equal(t.name, "h.3.attn.c_attn.weight");
    assert_int_equal(t.kind, TD_MODEL_QKV_W);
    assert_int_equal(t.shape[0], 3 * 768);
    assert_int_equal(t.shape[1], 768);
    assert_true(t.hf_transposed);
    td_model_tensor_get(&g, 2 + 12 * 11 + 11, &t);
    assert_string_equal(t.name, "h.11.mlp.c_proj.bias");
    assert_false(t.hf_transposed);
    td_model_tensor_get(&g, 2 + 12 * 11 + 10, &t);
    assert_string_equal(t.name, "h.11.mlp.c_proj.weight");
    assert_int_equal(t.shape[0], 768);
    assert_int_equal(t.shape[1], 4 * 768);
    td_model_tensor_get(&g, td_model_tensor_count(&g) - 1, &t);
    assert_string_equal(t.name, "ln_f.bias");
    assert_int_equal(t.layer, -1);

    /* the block view points at the table's offsets */
    float *base = (float *)(uintptr_t)4096; /* never dereferenced */
    td_model_block v;
    size_t off, n;
    td_model_block_span(&g, 5, &off, &n);
    td_model_block_view(&g, base, &v);
    td_model_tensor_get(&g, 2 + 12 * 5 + 6, &t);
    assert_string_equal(t.name, "h.5.ln_2.weight");
    assert_ptr_equal(v.ln2_w, base + (t.offset - off));
    td_model_tensor_get(&g, 2 + 12 * 5 + 11, &t);
    assert_ptr_equal(v.fcproj_b, base + (t.offset - off));
}

static void test_config_and_batch_errors(void **state)
{
    td_model_desc c = tiny;
    c.n_embd = 15;
    assert_int_equal(td_model_desc_check(&c), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "not a multiple of the 2 heads"));
    c = tiny;
    c.padded_vocab_size = 19;
    assert_int_equal(td_model_desc_check(&c), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "padded vocabulary 19 is smaller than the vocabulary 20"));
    c = tiny;
    c.n_layer = 0;
    assert_int_equal(td_model_desc_check(&c), TD_ERR_INVALID);

    int tok[6] = {1, 2, 3, 4, 5, 6}, tgt[6] = {2, 3, 4, 5, 6, -1};
    TD_ASSERT_OK(td_model_check_batch(&tiny, tok, tgt, 2, 3));
    assert_int_equal(td_model_check_batch(&tiny, tok, tgt, 1, 9), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "sequence <= 8"));
    tok[4] = 20;
    assert_int_equal(td_model_check_batch(&tiny, tok, tgt, 2, 3), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "token 20 at batch 1, position 1 is outside the vocabulary [0, 20)"));
    tok[4] = 5;
    tgt[0] = 21;
    assert_int_equal(td_model_check_batch(&tiny, tok, tgt, 2, 3), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "target 21 at batch 0, position 0"));
    /* forward refuses too, before touching anything */
    float loss = -1;
    assert_int_equal(td_model_forward(&tiny, NULL, tok, tgt, 2, 3, NULL, &loss, NULL), TD_ERR_INVALID);
    assert_true(loss == -1);
}

/* --- init ----------------------------------------------------------------- */

static void test_init(void **state)
{
    const td_model_desc c = {.n_layer = 4, .n_head = 4, .n_embd = 64, .n_positions = 32, .vocab_size = 500, .padded_vocab_size = 512};
    const size_t n = td_model_params_numel(&c);
    float *p = fvec(n), *q = fvec(n);
    td_model_init(&c, p, 7);
    for (int i = 0; i < td_model_tensor_count(&c); i++) {
        td_model_tensor t;
        td_model_tensor_get(&c, i, &t);
        /* tensor by tensor, into another buffer: the same bits */
        td_model_init_tensor(&c, i, q + t.offset, 7);
        const float *x = p + t.offset;
        size_t used = t.kind == TD_MODEL_WTE ? (size_t)c.vocab_size * c.n_embd : t.numel;
        double s = 0, s2 = 0;
        for (size_t k = 0; k < used; k++) { s += x[k]; s2 += (double)x[k] * x[k]; }
        const double mean = s / used, std = sqrt(s2 / used - mean * mean);
        switch (t.kind) {
        case TD_MODEL_LN1_W: case TD_MODEL_LN2_W: case TD_MODEL_LNF_W:
            assert_true(mean == 1.0 && std == 0.0);
            break;
        case TD_MODEL_LN1_B: case TD_MODEL_LN2_B: case TD_MODEL_LNF_B: case TD_MODEL_QKV_B:
        case TD_MODEL_ATTPROJ_B: case TD_MODEL_FC_B: case TD_MODEL_FCPROJ_B:
            assert_true(mean == 0.0 && std == 0.0);
            break;
        default: {
            const double want = t.kind == TD_MODEL_ATTPROJ_W || t.kind == TD_MODEL_FCPROJ_W
                                    ? 0.02 / sqrt(2.0 * c.n_layer) : 0.02;
            if (fabs(std - want) > 0.05 * want || fabs(mean) > 0.1 * want)
                fail_msg("%s: mean %g std %g, want std %g", t.name, mean, std, want);
        }
        }
        if (t.kind == TD_MODEL_WTE)
            for (size_t k = used; k < t.numel; k++) assert_true(x[k] == 0.0f);
    }
    assert_memory_equal(p, q, n * sizeof(float));
    td_model_init(&c, q, 8);
    assert_memory_not_equal(p, q, n * sizeof(float));
    free(p);
    free(q);
}

/* --- the whole model ------------------------------------------------------ */

typedef struct model {
    td_model_desc cfg;
    int B, T;
    int *tok, *tgt;
    float *params, *grads, *acts, *scratch;
    size_t n_params;
} model;

static void model_make(model *m, const td_model_desc *cfg, int B, int T, uint64_t seed,
                       float noise)
{
    m->cfg = *cfg;
    m->B = B;
    m->T = T;
    m->n_params = td_model_params_numel(cfg);
    m->params = fvec(m->n_params);
    m->grads = fvec(m->n_params);
    m->acts = fvec(td_model_acts_numel(cfg, B, T));
    m->scratch = fvec(td_model_scratch_numel(cfg, B, T));
    m->tok = malloc((size_t)B * T * sizeof(int));
    m->tgt = malloc((size_t)B * T * sizeof(int));
    td_rng rng;
    td_rng_seed(&rng, seed);
    for (int i = 0; i < B * T; i++) {
        m->tok[i] = (int)td_rng_below(&rng, (uint64_t)cfg->vocab_size);
        m->tgt[i] = (int)td_rng_below(&rng, (uint64_t)cfg->vocab_size);
    }
    m->tgt[1] = TD_OPS_IGNORE_INDEX; /* one masked target */
    td_model_init(cfg, m->params, seed);
    /* Noise on every parameter (padding rows of wte included) so that
     * LayerNorm weights, biases and activations are generic, not 1 and 0. */
    for (size_t i = 0; i < m->n_params; i++)
        m->params[i] += noise * (float)(2.0 * td_rng_uniform(&rng) - 1.0);
}

static void model_free(model *m)
{
    free(m->params); free(m->grads); free(m->acts); free(m->scratch); free(m->tok); free(m->tgt);
}

static double model_loss(model *m)
{
    float loss;
    TD_ASSERT_OK(td_model_forward(&m->cfg, m->params, m->tok, m->tgt, m->B, m->T, m->acts, &loss, NULL));
    /* in double, from the per-token losses, for the finite differences */
    const float *l = td_model_losses(&m->cfg, m->B, m->T, m->acts);
    double s = 0;
    int n = 0;
    for (int i = 0; i < m->B * m->T; i++)
        if (m->tgt[i] >= 0) { s += l[i]; n++; }
    assert_true(fabs(s / n - loss) <= 1e-6 * fabs(loss));
    return s / n;
}

static void model_grads(model *m)
{
    int n;
    float loss;
    memset(m->grads, 0, m->n_params * sizeof(float));
    TD_ASSERT_OK(td_model_forward(&m->cfg, m->params, m->tok, m->tgt, m->B, m->T, m->acts, &loss, &n));
    assert_int_equal(n, m->B * m->T - 1);
    TD_ASSERT_OK(td_model_backward(&m->cfg, m->params, m->grads, m->tok, m->tgt, 1.0f / (float)n,
                                     m->B, m->T, m->acts, m->scratch));
}

static void test_loss_at_init_is_log_vocab(void **state)
{
    const td_model_desc c = {.n_layer = 2, .n_head = 4, .n_embd = 64, .n_positions = 32, .vocab_size = 300, .padded_vocab_size = 320};
    model m;
    model_make(&m, &c, 2, 32, 3, 0.0f);
    const double loss = model_loss(&m);
    /* near-zero logits: the loss of a uniform guess */
    assert_true(fabs(loss - log(300.0)) < 0.05);
    model_free(&m);
}

/* Central differences of the mean loss against the backward, at a few
 * coordinates of every tensor, plus one directional derivative along a
 * random direction over all parameters at once. */
static void fd_whole_model(const td_model_desc *cfg)
{
    model m;
    model_make(&m, cfg, 2, 5, 5, 0.25f);
    model_grads(&m);
    td_rng rng;
    td_rng_seed(&rng, 99);
    const float h = 1e-2f;
    const double atol = 3e-4, rtol = 1e-2;
    double worst = 0;
    int checked = 0;
    for (int i = 0; i < td_model_tensor_count(&m.cfg); i++) {
        td_model_tensor t;
        td_model_tensor_get(&m.cfg, i, &t);
        for (int s = 0; s < 6; s++) {
            const size_t k = t.offset + td_rng_below(&rng, t.numel);
            const float saved = m.params[k], up = saved + h, down = saved - h;
            m.params[k] = up;
            const double lp = model_loss(&m);
            m.params[k] = down;
            const double lm = model_loss(&m);
            m.params[k] = saved;
            const double num = (lp - lm) / ((double)up - down), ana = m.grads[k];
            const double err = fabs(num - ana);
            worst = fmax(worst, err);
            checked++;
            if (err > atol + rtol * fmax(fabs(num), fabs(ana)))
                fail_msg("%s[%zu]: numeric %.8g, analytic %.8g", t.name, k - t.offset, num, ana);
        }
    }
    printf("  fd whole model: %d coords, max |diff| %.2e\n", checked, worst);

    /* Directional: d/de L(p + e u) at 0 equals grad . u, along a random u
     * over all parameters at once and then over each tensor alone (every
     * coordinate of it counts, so one wrong row or head shows).  Richardson's
     * extrapolation of the central differences at e and e / 2 removes their
     * e^2 error, which the curvature of a wide model makes 1e-3 of the slope. */
    float *u = fvec(m.n_params), *p0 = fvec(m.n_params);
    memcpy(p0, m.params, m.n_params * sizeof(float));
    for (size_t k = 0; k < m.n_params; k++) u[k] = (float)(2.0 * td_rng_uniform(&rng) - 1.0);
    const int nt = td_model_tensor_count(&m.cfg);
    double worst_dir = 0;
    for (int i = -1; i < nt; i++) {
        size_t lo = 0, hi = m.n_params;
        const char *name = "all parameters";
        if (i >= 0) {
            td_model_tensor t;
            td_model_tensor_get(&m.cfg, i, &t);
            lo = t.offset;
            hi = t.offset + t.numel;
            name = t.name;
        }
        double num[2], ana[2];
        for (int r = 0; r < 2; r++) {
            const double e = r ? 2e-3 : 4e-3;
            double lp, gu = 0; /* grad . (p+ - p-) / 2e, the perturbation as rounded to float */
            for (size_t k = lo; k < hi; k++) m.params[k] = p0[k] + (float)e * u[k];
            lp = model_loss(&m);
            for (size_t k = lo; k < hi; k++) {
                gu += (double)m.grads[k] * ((double)m.params[k] - p0[k]);
                m.params[k] = p0[k] - (float)e * u[k];
                gu -= (double)m.grads[k] * ((double)m.params[k] - p0[k]);
            }
            num[r] = (lp - model_loss(&m)) / (2 * e);
            ana[r] = gu / (2 * e);
            memcpy(m.params + lo, p0 + lo, (hi - lo) * sizeof(float));
        }
        const double n = (4 * num[1] - num[0]) / 3, a = (4 * ana[1] - ana[0]) / 3;
        if (i < 0) printf("  directional: numeric %.8g, analytic %.8g\n", n, a);
        worst_dir = fmax(worst_dir, fabs(n - a) / (2e-3 * fabs(a) + 5e-4));
        if (fabs(n - a) > 2e-3 * fabs(a) + 5e-4)
            fail_msg("%s: directional derivative numeric %.8g, analytic %.8g", name, n, a);
    }
    memcpy(m.params, p0, m.n_params * sizeof(float));
    printf("  directional, tensor by tensor: worst |diff| %.2f of the tolerance\n", worst_dir);

    /* no gradient reaches the padding rows of wte (and lm_head) or the unused positions */
    for (int i = 0; i < td_model_tensor_count(&m.cfg); i++) {
        td_model_tensor t;
        td_model_tensor_get(&m.cfg, i, &t);
        size_t used = t.kind == TD_MODEL_WTE || t.kind == TD_MODEL_LM_HEAD ? (size_t)m.cfg.vocab_size * m.cfg.n_embd
                      : t.kind == TD_MODEL_WPE ? (size_t)m.T * m.cfg.n_embd : t.numel;
        for (size_t k = used; k < t.numel; k++) assert_true(m.grads[t.offset + k] == 0.0f);
    }
    free(u);
    free(p0);
    model_free(&m);
}

static void test_whole_model_finite_differences(void **state) { fd_whole_model(&tiny); }

/* --- LLaMA and Qwen2 --------------------------------------------------------- */

/* A small LLaMA-family model: 4 heads of 8, NKV key/value heads. */
static td_model_desc small_llama(const char *family, int nkv, int untied, int scaled)
{
    td_model_desc c = {.n_layer = 2, .n_head = 4, .n_embd = 32, .n_positions = 16, .vocab_size = 20,
                           .padded_vocab_size = 24};
    td_model_desc_set_family(&c, family);
    c.n_kv_head = nkv;
    c.n_inner = 24;
    c.norm_eps = !strcmp(family, "qwen2") ? 1e-6f : 1e-5f;
    c.rope_theta = !strcmp(family, "qwen2") ? 1e6f : 500000.0f;
    c.untied_head = untied;
    /* inv_freq of hs 8 at theta 5e5: wavelengths 6.3, 168, 4.5e3, 1.2e5; with
     * original 512, high 4, low 1: one kept, one blended, two divided. */
    if (scaled) c.rope_scaling = (td_rope_scaling){.factor = 8, .low_freq_factor = 1, .high_freq_factor = 4,
                                                   .original_max_positions = 512};
    TD_ASSERT_OK(td_model_desc_check(&c));
    return c;
}

static void test_llama_layout_and_presets(void **state)
{
    /* Parameter counts of the published models (Hugging Face's num_parameters). */
    static const struct { const char *name; size_t params; int tensors; } want[] = {
        {"llama-3.2-1b", 1235814400u, 2 + 6 * 16}, {"llama-3.1-8b", 8030261248u, 3 + 6 * 32},
        {"qwen2.5-0.5b", 494032768u, 2 + 7 * 24}, {"smollm2-135m", 134515008u, 2 + 6 * 30},
        {"qwen2.5-7b", 7615616512u, 3 + 7 * 28},
        {"llama-3.2-3b", 3212749824u, 2 + 6 * 28}, {"qwen2.5-1.5b", 1543714304u, 2 + 7 * 28},
        {"smollm2-360m", 361821120u, 2 + 6 * 32}, {"smollm2-1.7b", 1711376384u, 2 + 6 * 24},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        td_model_desc c;
        TD_ASSERT_OK(td_model_preset(want[i].name, &c));
        TD_ASSERT_OK(td_model_desc_check(&c));
        if (td_model_params_numel(&c) != want[i].params)
            fail_msg("%s: %zu params, want %zu", want[i].name, td_model_params_numel(&c), want[i].params);
        assert_int_equal(td_model_tensor_count(&c), want[i].tensors);
    }
    for (const char *const *n = td_model_preset_names(); *n; n++) {
        td_model_desc c;
        TD_ASSERT_OK(td_model_preset(*n, &c));
        TD_ASSERT_OK(td_model_desc_check(&c));
    }
    /* tensors tile the buffer; names and shapes of a Qwen2 block */
    td_model_desc q = small_llama("qwen2", 2, 1, 0);
    size_t next = 0;
    for (int i = 0; i < td_model_tensor_count(&q); i++) {
        td_model_tensor t;
        td_model_tensor_get(&q, i, &t);
        assert_int_equal(t.offset, next);
        next += t.numel;
    }
    assert_int_equal(next, td_model_params_numel(&q));
    td_model_tensor t;
    td_model_tensor_get(&q, 1 + 7 + 1, &t);
    assert_string_equal(t.name, "model.layers.1.self_attn.qkv_proj.weight");
    assert_int_equal(t.shape[0], (4 + 2 * 2) * 8);
    assert_int_equal(t.shape[1], 32);
    td_model_tensor_get(&q, 1 + 7 + 2, &t);
    assert_string_equal(t.name, "model.layers.1.self_attn.qkv_proj.bias");
    td_model_tensor_get(&q, 1 + 7 + 5, &t);
    assert_string_equal(t.name, "model.layers.1.mlp.gate_up_proj.weight");
    assert_int_equal(t.shape[0], 48);
    td_model_tensor_get(&q, td_model_tensor_count(&q) - 1, &t);
    assert_string_equal(t.name, "lm_head.weight");
    int hi[3];
    assert_int_equal(td_model_head_tensors(&q, hi), 2);
    assert_int_equal(hi[1], td_model_tensor_count(&q) - 1);
    /* errors name what is wrong */
    td_model_desc c = q;
    c.n_kv_head = 3;
    assert_int_equal(td_model_desc_check(&c), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "num_key_value_heads must divide"));
    c = q;
    c.qkv_bias = 0; /* a Qwen2 without its biases is a LLaMA */
    assert_int_equal(td_model_desc_check(&c), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "describe one without as llama"));
    c = tiny;
    c.untied_head = 1;
    assert_int_equal(td_model_desc_check(&c), TD_ERR_INVALID);
    assert_int_equal(td_model_preset("llama-9", &c), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "qwen2.5-0.5b"));
}

/* Whole-model finite differences: GQA with 1, 2 and 4 query heads a
 * key/value head, llama3 rope scaling, tied and untied heads, Qwen2 biases. */
static void test_llama_finite_differences(void **state)
{
    const td_model_desc cases[] = {
        small_llama("llama", 4, 0, 0), /* 1 query head a key/value head, tied */
        small_llama("llama", 2, 1, 1), /* 2, untied, llama3 scaling */
        small_llama("llama", 1, 0, 1), /* 4 (multi-query), tied, scaling */
        small_llama("qwen2", 2, 1, 0), /* Qwen2: q/k/v biases, untied */
        small_llama("qwen2", 1, 0, 0), /* Qwen2 tied */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        printf("  %s, %d key/value heads, %s head%s\n", td_model_family_name(td_model_family_of(&cases[i])), cases[i].n_kv_head,
               cases[i].untied_head ? "untied" : "tied", cases[i].rope_scaling.factor > 0 ? ", llama3 rope scaling" : "");
        fd_whole_model(&cases[i]);
    }
}

/* A rotary-family model of any shape: NH query heads of hs channels over
 * NKV key/value heads, width C (NH hs need not be C). */
static td_model_desc small_rotary(const char *family, int C, int NH, int NKV, int hs, int untied)
{
    td_model_desc c = {.n_layer = 2, .n_head = NH, .n_embd = C, .n_positions = 16, .vocab_size = 23,
                       .padded_vocab_size = 32};
    TD_ASSERT_OK(td_model_desc_set_family(&c, family));
    c.n_kv_head = NKV;
    c.head_dim = hs;
    c.n_inner = 40;
    c.norm_eps = !strcmp(family, "llama") ? 1e-5f : 1e-6f;
    c.rope_theta = !strcmp(family, "gemma") ? 10000.0f : 1e6f;
    c.untied_head = untied;
    TD_ASSERT_OK(td_model_desc_check(&c));
    return c;
}

/* Every parameter's gradient against central differences over the shapes
 * the rotary families allow: LLaMA, Qwen2 and Gemma; tied and untied heads;
 * heads of 8, 12, 16 and 24; 1, 2 and 4 query heads a key/value head; heads
 * that split the width (NH hs = C) and heads that do not (wider or
 * narrower). */
static void test_rotary_shapes_finite_differences(void **state)
{
    static const struct { const char *family; int C, NH, NKV, hs, untied; } cases[] = {
        {"llama", 96, 4, 2, 24, 1}, /* LLaMA and Qwen2: heads split the width */
        {"llama", 48, 4, 1, 12, 0}, /* 12: not a multiple of 8 */
        {"qwen2", 96, 4, 2, 24, 1},
        {"qwen2", 24, 2, 1, 12, 0},
        {"gemma", 48, 4, 2, 24, 1}, /* the transformers check's untied case */
        {"gemma", 48, 4, 2, 24, 0},
        {"gemma", 48, 4, 1, 16, 0},
        {"gemma", 48, 2, 2, 24, 1}, /* 2 x 24 = 48: heads split the width */
        {"gemma", 32, 4, 4, 12, 1}, /* 48 over 32 */
        {"gemma", 64, 4, 2, 8, 1},  /* 32 over 64: narrower */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const td_model_desc c = small_rotary(cases[i].family, cases[i].C, cases[i].NH, cases[i].NKV, cases[i].hs,
                                             cases[i].untied);
        printf("  %s: width %d, %d heads of %d over %d key/value, %s head\n", cases[i].family, c.n_embd, c.n_head,
               cases[i].hs, cases[i].NKV, c.untied_head ? "untied" : "tied");
        fd_whole_model(&c);
    }
}

/* The head and the loss over chunks of rows (the trainer's loss chunks)
 * give the losses, dx and the head's parameter gradients of one call over
 * all rows, bit for bit: rows are independent, and every gradient sum over
 * rows (the output matrix's GEMM, the final norm's gain and bias) adds the
 * rows one by one in ascending order, into random start values here. */
static void test_head_chunks_are_bit_identical(void **state)
{
    const td_model_desc cases[] = {tiny, small_llama("llama", 2, 1, 1), small_llama("qwen2", 1, 0, 0)};
    const int N = 37;
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const td_model_desc *d = &cases[k];
        const int C = d->n_embd, V = d->vocab_size, Vp = d->padded_vocab_size;
        const size_t np = td_model_params_numel(d), NC = (size_t)N * C;
        float *params = fvec(np), *x = fvec(NC), *g0 = fvec(np), *gw = fvec(np), *gc = fvec(np);
        float *dxw = fvec(NC), *dxc = fvec(NC), *lw = fvec(N), *lc = fvec(N), *lse = fvec(N);
        float *logits = fvec((size_t)N * Vp), *lnf = fvec(NC), *mean = fvec(N), *rstd = fvec(N), *dlnf = fvec(NC);
        int32_t tgt[37];
        td_model_init(d, params, 5);
        td_rng r;
        td_rng_seed(&r, 11 + k);
        for (size_t i = 0; i < NC; i++) x[i] = (float)(td_rng_uniform(&r) * 4 - 2);
        for (size_t i = 0; i < np; i++) g0[i] = (float)(td_rng_uniform(&r) - 0.5) * 0.2f;
        for (int i = 0; i < N; i++) tgt[i] = i % 9 == 4 ? -1 : (int32_t)td_rng_below(&r, (uint64_t)V);
        int hi[3], nh = td_model_head_tensors(d, hi);
        const float *head[3];
        float *gwh[3], *gch[3];
        for (int j = 0; j < nh; j++) {
            td_model_tensor t;
            td_model_tensor_get(d, hi[j], &t);
            head[j] = params + t.offset;
            gwh[j] = gw + t.offset;
            gch[j] = gc + t.offset;
        }
        const int rows[] = {37, 1, 5, 16};
        for (size_t c = 0; c < sizeof rows / sizeof rows[0]; c++) {
            float *g = c ? gc : gw, *dx = c ? dxc : dxw, *l = c ? lc : lw, **gh = c ? gch : gwh;
            memcpy(g, g0, np * sizeof(float));
            memset(dx, 0, NC * sizeof(float));
            for (int r0 = 0; r0 < N; r0 += rows[c]) {
                int n = N - r0 < rows[c] ? N - r0 : rows[c];
                const float *xr = x + (size_t)r0 * C;
                td_model_head_forward(d, logits, lnf, mean, rstd, xr, head, n);
                td_ops_crossentropy_forward(l + r0, lse, logits, tgt + r0, n, V, Vp);
                td_ops_crossentropy_backward(logits, logits, lse, tgt + r0, 1.0f / 33, n, V, Vp);
                td_model_head_backward(d, dx + (size_t)r0 * C, gh, dlnf, logits, xr, lnf, mean, rstd, head, n);
            }
            if (!c) continue;
            assert_memory_equal(lc, lw, N * sizeof(float));
            assert_memory_equal(dxc, dxw, NC * sizeof(float));
            assert_memory_equal(gc, gw, np * sizeof(float));
        }
        free(params); free(x); free(g0); free(gw); free(gc); free(dxw); free(dxc); free(lw); free(lc); free(lse);
        free(logits); free(lnf); free(mean); free(rstd); free(dlnf);
    }
}

/* The block API is what the whole model runs: re-running a block from its
 * kept input (activation checkpointing) reproduces its activations and output
 * bit for bit, and backward through it gives the model's gradients. */
static void test_block_recompute_matches(void **state)
{
    model m;
    model_make(&m, &tiny, 2, 6, 13, 0.25f);
    model_grads(&m);
    const int B = m.B, T = m.T, C = m.cfg.n_embd;
    const size_t NC = (size_t)B * T * C, nacts = td_model_block_acts_numel(&m.cfg, B, T);
    /* layout: x_0, acts_0, x_1, acts_1, x_2, ... */
    const float *x1 = m.acts + NC + nacts, *x2 = x1 + NC + nacts;
    float *acts = fvec(nacts), *y = fvec(NC);
    td_model_block w;
    td_model_block_acts a;
    size_t off, n;
    td_model_block_span(&m.cfg, 1, &off, &n);
    td_model_block_view(&m.cfg, m.params + off, &w);
    td_model_block_acts_view(&m.cfg, B, T, acts, &a);
    td_model_block_forward(&m.cfg, &w, &a, x1, y, NULL, B, T);
    assert_memory_equal(y, x2, NC * sizeof(float));
    assert_memory_equal(acts, x1 + NC, nacts * sizeof(float));

    /* Block 1's gradients from the model's backward equal a backward through
     * the block API fed with dL/dx2, rebuilt here from the ops. */
    const int N = B * T, Vp = m.cfg.padded_vocab_size, V = m.cfg.vocab_size;
    float *logits = fvec((size_t)N * Vp), *lnf = fvec(NC), *mean = fvec(N), *rstd = fvec(N);
    float *losses = fvec(N), *lse = fvec(N), *dx2 = fvec(NC), *dlnf = fvec(NC);
    float *wte_grad = fvec((size_t)Vp * C), *lnf_grad = fvec(2 * (size_t)C);
    td_model_tensor lnfw;
    td_model_tensor_get(&m.cfg, td_model_tensor_count(&m.cfg) - 2, &lnfw);
    td_ops_head_forward(logits, lnf, mean, rstd, x2, m.params + lnfw.offset, m.params + lnfw.offset + C,
                        m.params, N, C, Vp);
    td_ops_crossentropy_forward(losses, lse, logits, m.tgt, N, V, Vp);
    td_ops_crossentropy_backward(logits, logits, lse, m.tgt, 1.0f / (float)(N - 1), N, V, Vp);
    td_ops_head_backward(dx2, lnf_grad, lnf_grad + C, wte_grad, dlnf, logits, x2, lnf, mean, rstd,
                         m.params + lnfw.offset, m.params, N, C, Vp);
    float *g = fvec(n), *dx1 = fvec(NC), *scratch = fvec(td_model_block_scratch_numel(&m.cfg, B, T));
    td_model_block gv;
    td_model_block_view(&m.cfg, g, &gv);
    td_model_block_backward(&m.cfg, &w, &gv, &a, x1, dx2, dx1, scratch, NULL, B, T);
    assert_memory_equal(g, m.grads + off, n * sizeof(float));
    assert_memory_equal(lnf_grad, m.grads + lnfw.offset, 2 * (size_t)C * sizeof(float));
    free(logits); free(lnf); free(mean); free(rstd); free(losses); free(lse); free(dx2); free(dlnf);
    free(wte_grad); free(lnf_grad); free(dx1);
    free(acts); free(y); free(g); free(scratch);
    model_free(&m);
}

/* Logits without targets are the same; all targets masked gives loss 0 and
 * no gradient; two micro-batches accumulate to the gradient of the whole
 * batch (up to summation order). */
static void test_targets_masks_and_micro_batches(void **state)
{
    model m;
    model_make(&m, &tiny, 2, 6, 17, 0.25f);
    const int N = m.B * m.T, Vp = m.cfg.padded_vocab_size;
    const size_t nl = (size_t)N * Vp;
    float loss;
    int n = -1;
    TD_ASSERT_OK(td_model_forward(&m.cfg, m.params, m.tok, m.tgt, m.B, m.T, m.acts, &loss, &n));
    float *logits = malloc(nl * sizeof(float));
    memcpy(logits, td_model_logits(&m.cfg, m.B, m.T, m.acts), nl * sizeof(float));
    TD_ASSERT_OK(td_model_forward(&m.cfg, m.params, m.tok, NULL, m.B, m.T, m.acts, &loss, &n));
    assert_memory_equal(logits, td_model_logits(&m.cfg, m.B, m.T, m.acts), nl * sizeof(float));
    assert_true(loss == 0.0f && n == 0);
    assert_int_equal(td_model_backward(&m.cfg, m.params, m.grads, m.tok, NULL, 1.0f, m.B, m.T,
                                         m.acts, m.scratch), TD_ERR_INVALID);

    int *masked = malloc((size_t)N * sizeof(int));
    for (int i = 0; i < N; i++) masked[i] = TD_OPS_IGNORE_INDEX;
    memset(m.grads, 0, m.n_params * sizeof(float));
    TD_ASSERT_OK(td_model_forward(&m.cfg, m.params, m.tok, masked, m.B, m.T, m.acts, &loss, &n));
    assert_true(loss == 0.0f && n == 0);
    TD_ASSERT_OK(td_model_backward(&m.cfg, m.params, m.grads, m.tok, masked, 1.0f, m.B, m.T, m.acts, m.scratch));
    for (size_t k = 0; k < m.n_params; k++) assert_true(m.grads[k] == 0.0f);

    /* whole batch vs its two halves, each with dloss = 1 / (targets in the batch) */
    model_grads(&m);
    const int n_all = N - 1;
    float *whole = malloc(m.n_params * sizeof(float));
    memcpy(whole, m.grads, m.n_params * sizeof(float));
    memset(m.grads, 0, m.n_params * sizeof(float));
    for (int half = 0; half < 2; half++) {
        const int *tok = m.tok + half * m.T, *tgt = m.tgt + half * m.T;
        TD_ASSERT_OK(td_model_forward(&m.cfg, m.params, tok, tgt, 1, m.T, m.acts, &loss, &n));
        TD_ASSERT_OK(td_model_backward(&m.cfg, m.params, m.grads, tok, tgt, 1.0f / (float)n_all, 1,
                                         m.T, m.acts, m.scratch));
    }
    double worst = 0;
    for (size_t k = 0; k < m.n_params; k++)
        worst = fmax(worst, fabs(m.grads[k] - whole[k]) / (1e-3 + fabs(whole[k])));
    assert_true(worst < 1e-4);
    free(logits); free(masked); free(whole);
    model_free(&m);
}

/* td_rng_jump(k) is k steps: against stepping around the switch from
 * stepping to the polynomial (256), and composed (a then b is a + b) for
 * jumps too long to step. */
static void test_rng_jump(void **state)
{
    const uint64_t ks[] = {0, 1, 2, 255, 256, 257, 1000, 65537, 300001};
    for (size_t i = 0; i < sizeof ks / sizeof *ks; i++) {
        td_rng a, b;
        td_rng_seed(&a, 42 + i);
        b = a;
        for (uint64_t k = 0; k < ks[i]; k++) (void)td_rng_next(&a);
        td_rng_jump(&b, ks[i]);
        assert_memory_equal(a.s, b.s, sizeof a.s);
        assert_true(td_rng_next(&a) == td_rng_next(&b));
    }
    const uint64_t x = (1ull << 40) + 12345, y = (1ull << 37) + 999;
    td_rng a, b, c;
    td_rng_seed(&a, 7);
    b = c = a;
    td_rng_jump(&a, x);
    td_rng_jump(&a, y);
    td_rng_jump(&b, x + y);
    assert_memory_equal(a.s, b.s, sizeof a.s);
    td_rng_jump(&c, x);
    assert_memory_not_equal(c.s, b.s, sizeof c.s);
}

/* A tensor's init is its own stream, Box-Muller pair by pair, whatever the
 * threads: td_model_init_tensor jumps each thread's share of the stream
 * to its first pair; a large tensor of odd size (the last pair cut) gets the
 * bits of the one-pair-at-a-time loop with 1, 3 and 8 threads. */
static void test_init_is_the_serial_stream(void **state)
{
    const td_model_desc c = {.n_layer = 1, .n_head = 1, .n_embd = 127, .n_positions = 16, .vocab_size = 4099,
                                 .padded_vocab_size = 4160};
    td_model_tensor t;
    td_model_tensor_get(&c, 0, &t);
    assert_int_equal(t.kind, TD_MODEL_WTE);
    const size_t n = (size_t)c.vocab_size * c.n_embd; /* 520573: odd */
    float *want = fvec(t.numel), *got = fvec(t.numel);
    td_rng rng;
    td_rng_seed(&rng, 11 ^ (0x9E3779B97F4A7C15ull * 1));
    for (size_t i = 0; i < n; i += 2) {
        const double u1 = 1.0 - td_rng_uniform(&rng), u2 = td_rng_uniform(&rng);
        const double r = 0.02 * sqrt(-2.0 * log(u1)), a = 6.283185307179586 * u2;
        want[i] = (float)(r * cos(a));
        if (i + 1 < n) want[i + 1] = (float)(r * sin(a));
    }
    const int saved = omp_get_max_threads();
    const int team[] = {1, 3, 8};
    for (int k = 0; k < 3; k++) {
        omp_set_num_threads(team[k]);
        memset(got, 0xff, t.numel * sizeof(float));
        td_model_init_tensor(&c, 0, got, 11);
        assert_memory_equal(got, want, t.numel * sizeof(float)); /* padding rows zero in both */
    }
    omp_set_num_threads(saved);
    free(want);
    free(got);
}

/* A range of a tensor's init (td_model_init_range: a ZeRO-3 rank's shard)
 * is that slice of td_model_init_tensor's values, to the bit, for every
 * tensor of a model with adapters (normal, constant, padding rows, LoRA A
 * and B): ranges from odd and even elements (a Box-Muller pair cut), across
 * the vocabulary's padding, wholly in it, empty, and past the end (clipped),
 * with 1 and 3 threads; elements outside the range stay untouched. */
static void test_init_range_is_the_slice(void **state)
{
    (void)state;
    td_model_desc c = {.n_layer = 2, .n_head = 1, .n_embd = 33, .n_positions = 16, .vocab_size = 4099,
                       .padded_vocab_size = 4160};
    TD_ASSERT_OK(td_model_lora_set(&c, 4, 8.0f, 0.0f, NULL));
    const int saved = omp_get_max_threads();
    for (int i = 0; i < td_model_tensor_count(&c); i++) {
        td_model_tensor t;
        td_model_tensor_get(&c, i, &t);
        float *whole = fvec(t.numel), *got = fvec(t.numel + 2);
        td_model_init_tensor(&c, i, whole, 5);
        const size_t n = t.numel, v = (size_t)c.vocab_size * c.n_embd;
        const size_t ranges[][2] = {{0, n}, {1, n - 1}, {n / 3, n / 3 + 1}, {n / 3 + 1, n / 2}, {n - 1, 1},
                                    {n, 0}, {n / 2, n}, {v - 3, 100}, {v + 1, 7}};
        for (int k = 0; k < 2; k++) {
            omp_set_num_threads(k ? 3 : 1);
            for (size_t r = 0; r < sizeof ranges / sizeof *ranges; r++) {
                size_t b = ranges[r][0], cnt = ranges[r][1];
                if (b > n) continue;
                size_t want = cnt < n - b ? cnt : n - b;
                for (size_t e = 0; e < n + 2; e++) got[e] = -7.0f;
                td_model_init_range(&c, i, got + 1, b, cnt, 5);
                assert_memory_equal(got + 1, whole + b, want * sizeof(float));
                assert_true(got[0] == -7.0f && got[1 + want] == -7.0f);
            }
        }
        free(whole);
        free(got);
    }
    omp_set_num_threads(saved);
}

static void test_bit_identical_across_threads(void **state)
{
    const td_model_desc c = {.n_layer = 2, .n_head = 4, .n_embd = 64, .n_positions = 32, .vocab_size = 100, .padded_vocab_size = 128};
    model m;
    model_make(&m, &c, 3, 32, 21, 0.05f);
    const int saved = omp_get_max_threads();
    float *first = NULL, first_loss = 0;
    for (int threads = 1; threads <= 3; threads++) {
        omp_set_num_threads(threads);
        model_grads(&m);
        float loss;
        TD_ASSERT_OK(td_model_forward(&m.cfg, m.params, m.tok, m.tgt, m.B, m.T, m.acts, &loss, NULL));
        if (!first) {
            first = malloc(m.n_params * sizeof(float));
            memcpy(first, m.grads, m.n_params * sizeof(float));
            first_loss = loss;
        } else {
            assert_memory_equal(&loss, &first_loss, sizeof loss);
            assert_memory_equal(first, m.grads, m.n_params * sizeof(float));
        }
    }
    omp_set_num_threads(saved);
    free(first);
    model_free(&m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layout_table),
        cmocka_unit_test(test_config_and_batch_errors),
        cmocka_unit_test(test_init),
        cmocka_unit_test(test_init_range_is_the_slice),
        cmocka_unit_test(test_loss_at_init_is_log_vocab),
        cmocka_unit_test(test_whole_model_finite_differences),
        cmocka_unit_test(test_llama_layout_and_presets),
        cmocka_unit_test(test_llama_finite_differences),
        cmocka_unit_test(test_rotary_shapes_finite_differences),
        cmocka_unit_test(test_block_recompute_matches),
        cmocka_unit_test(test_head_chunks_are_bit_identical),
        cmocka_unit_test(test_targets_masks_and_micro_batches),
        cmocka_unit_test(test_bit_identical_across_threads),
        cmocka_unit_test(test_rng_jump),
        cmocka_unit_test(test_init_is_the_serial_stream),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
