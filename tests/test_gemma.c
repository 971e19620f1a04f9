/* The Gemma family (model/family_gemma.c) on the CPU: its presets' shapes
 * and parameter counts (Gemma 2B and 7B as Hugging Face reports them), its
 * initialisation (gains 0: RMSNorm scales by 1 + w), the model's loss
 * against a reference written here in double from GemmaForCausalLM's
 * definition (the embedding times sqrt(C), RMSNorm with 1 + w, rotary
 * q and k, multi-query attention with heads of 12 over a width of 16,
 * GeGLU with the tanh GELU, a tied head), its gradients against finite
 * differences, config.json in and out (Gemma 2B's published file is the
 * preset; GemmaConfig's defaults; variants refused with the key named),
 * and a checkpoint round trip under the Hugging Face names.  The trainer
 * on Gemma is in test_llama_train.c; transformers itself checks it in
 * tests/gpu/check_gemma_hf.py. */
#include "td_test.h"
#include "tidal/checkpoint.h"
#include "tidal/model_ref.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static float *fvec(size_t n) { float *p = calloc(n ? n : 1, sizeof(float)); assert_non_null(p); return p; }

/* 2 layers, width 16, 2 query heads of 12 over 1 key/value head, GeGLU 24 wide. */
static td_model_desc small_gemma(void)
{
    td_model_desc d = {.n_layer = 2, .n_head = 2, .n_embd = 16, .n_positions = 16, .vocab_size = 20,
                       .padded_vocab_size = 64};
    TD_ASSERT_OK(td_model_desc_set_family(&d, "gemma"));
    d.n_kv_head = 1;
    d.head_dim = 12;
    d.n_inner = 24;
    d.norm_eps = 1e-6f;
    d.rope_theta = 10000.0f;
    TD_ASSERT_OK(td_model_desc_check(&d));
    return d;
}

static void test_presets_and_layout(void **state)
{
    td_model_desc d;
    TD_ASSERT_OK(td_model_preset("gemma-2b", &d));
    assert_int_equal(td_model_params_numel(&d) - (size_t)(d.padded_vocab_size - d.vocab_size) * d.n_embd,
                     2506172416u);
    TD_ASSERT_OK(td_model_preset("gemma-7b", &d));
    assert_int_equal(td_model_params_numel(&d) - (size_t)(d.padded_vocab_size - d.vocab_size) * d.n_embd,
                     8537680896u);
    assert_int_equal(td_model_attn_width(&d), 4096); /* 16 heads of 256 over a width of 3072 */
    char line[256];
    td_model_desc_describe(&d, line, sizeof line);
    assert_non_null(strstr(line, "gemma: 28 layers, 3072 wide, 16 heads of 256"));

    TD_ASSERT_OK(td_model_preset("tiny-gemma", &d));
    TD_ASSERT_OK(td_model_desc_check(&d));
    /* embedding, then 6 a block (no biases), then the final norm: the head is tied */
    assert_int_equal(td_model_tensor_count(&d), 1 + 6 * 2 + 1);
    int hi[3];
    assert_int_equal(td_model_head_tensors(&d, hi), 2);
    assert_int_equal(hi[1], 0);
    td_model_tensor t;
    td_model_tensor_get(&d, 2, &t); /* block 0's q|k|v: (4 + 2) heads of 48 */
    assert_int_equal(t.kind, TD_MODEL_QKV_W);
    assert_int_equal(t.shape[0], (4 + 2 * 1) * 48);
    assert_int_equal(t.shape[1], 128);
    assert_string_equal(t.name, "model.layers.0.self_attn.qkv_proj.weight");
    td_model_tensor_get(&d, 3, &t); /* o_proj reads the 4 heads of 48 */
    assert_int_equal(t.kind, TD_MODEL_ATTPROJ_W);
    assert_int_equal(t.shape[0], 128);
    assert_int_equal(t.shape[1], 192);
    td_model_tensor_get(&d, 5, &t);
    assert_int_equal(t.shape[0], 2 * 384); /* gate | up */

    /* init: every gain 0 (1 + w = 1), matrices N(0, 0.02), the padding rows 0 */
    float *p = fvec(td_model_params_numel(&d));
    td_model_init(&d, p, 7);
    for (int i = 0; i < td_model_tensor_count(&d); i++) {
        td_model_tensor_get(&d, i, &t);
        double ss = 0;
        for (size_t k = 0; k < t.numel; k++) ss += (double)p[t.offset + k] * p[t.offset + k];
        if (t.kind == TD_MODEL_LN1_W || t.kind == TD_MODEL_LN2_W || t.kind == TD_MODEL_LNF_W) assert_true(ss == 0);
        else if (t.kind != TD_MODEL_WTE) assert_true(fabs(sqrt(ss / t.numel) - 0.02) < 0.003);
    }
    free(p);

    /* the rules: no biases; heads of an even size */
    td_model_desc bad = d;
    bad.qkv_bias = 1;
    assert_int_equal(td_model_desc_check(&bad), TD_ERR_INVALID);
    bad = d;
    bad.head_dim = 47;
    assert_int_equal(td_model_desc_check(&bad), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "must be even"));
}

/* --- the reference, in double, from GemmaForCausalLM's definition ------------ */

static const float *tensor(const td_model_desc *d, const float *params, td_model_param kind, int layer)
{
    for (int i = 0; i < td_model_tensor_count(d); i++) {
        td_model_tensor t;
        td_model_tensor_get(d, i, &t);
        if (t.kind == kind && t.layer == layer) return params + t.offset;
    }
    fail_msg("no tensor of kind %d in layer %d", (int)kind, layer);
    return NULL;
}

/* y = x (1 + w) / sqrt(mean(x^2) + eps), one row of C. */
static void ref_rmsnorm(double *y, const double *x, const float *w, int C, double eps)
{
    double ss = 0;
    for (int i = 0; i < C; i++) ss += x[i] * x[i];
    const double r = 1 / sqrt(ss / C + eps);
    for (int i = 0; i < C; i++) y[i] = x[i] * r * (1.0 + w[i]);
}

/* y (rows, OC) = x (rows, IC) @ W (OC, IC)^T */
static void ref_matmul(double *y, const double *x, const float *W, int rows, int IC, int OC)
{
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < OC; o++) {
            double s = 0;
            for (int i = 0; i < IC; i++) s += x[(size_t)r * IC + i] * W[(size_t)o * IC + i];
            y[(size_t)r * OC + o] = s;
        }
}

/* Rotate-half RoPE at position t over one head of hs. */
static void ref_rope(double *h, int t, int hs, double theta)
{
    for (int i = 0; i < hs / 2; i++) {
        const double f = pow(theta, -2.0 * i / hs), c = cos(t * f), s = sin(t * f);
        const double a = h[i], b = h[i + hs / 2];
        h[i] = a * c - b * s;
        h[i + hs / 2] = b * c + a * s;
    }
}

static double gelu_tanh(double x) { return 0.5 * x * (1 + tanh(sqrt(2 / M_PI) * (x + 0.044715 * x * x * x))); }

/* The mean cross-entropy of one sequence of T tokens (targets: the next tokens). */
static double ref_loss(const td_model_desc *d, const float *params, const int *tok, const int *tgt, int T)
{
    const int C = d->n_embd, NH = d->n_head, NKV = td_model_kv_heads(d), hs = td_model_head_size(d);
    const int A = NH * hs, QKV = (NH + 2 * NKV) * hs, H = td_model_mlp_width(d), V = d->vocab_size;
    const double eps = d->norm_eps, theta = d->rope_theta;
    double *x = calloc((size_t)T * C, 8), *n = calloc((size_t)T * C, 8), *qkv = calloc((size_t)T * QKV, 8);
    double *att = calloc((size_t)T * A, 8), *o = calloc((size_t)T * C, 8), *gu = calloc((size_t)T * 2 * H, 8);
    double *hh = calloc((size_t)T * H, 8), *logit = calloc((size_t)V, 8), *sc = calloc((size_t)T, 8);
    const float *wte = tensor(d, params, TD_MODEL_WTE, -1);
    for (int t = 0; t < T; t++)
        for (int c = 0; c < C; c++) x[(size_t)t * C + c] = wte[(size_t)tok[t] * C + c] * sqrt((double)C);
    for (int l = 0; l < d->n_layer; l++) {
        for (int t = 0; t < T; t++)
            ref_rmsnorm(n + (size_t)t * C, x + (size_t)t * C, tensor(d, params, TD_MODEL_LN1_W, l), C, eps);
        ref_matmul(qkv, n, tensor(d, params, TD_MODEL_QKV_W, l), T, C, QKV);
        for (int t = 0; t < T; t++)
            for (int h = 0; h < NH + NKV; h++) ref_rope(qkv + (size_t)t * QKV + (size_t)h * hs, t, hs, theta);
        for (int h = 0; h < NH; h++) {
            const int kv = h / (NH / NKV);
            for (int t = 0; t < T; t++) {
                const double *q = qkv + (size_t)t * QKV + (size_t)h * hs;
                double mx = -1e300, z = 0;
                for (int u = 0; u <= t; u++) {
                    const double *k = qkv + (size_t)u * QKV + (size_t)(NH + kv) * hs;
                    double s = 0;
                    for (int i = 0; i < hs; i++) s += q[i] * k[i];
                    sc[u] = s / sqrt((double)hs);
                    mx = fmax(mx, sc[u]);
                }
                for (int u = 0; u <= t; u++) z += exp(sc[u] - mx);
                for (int i = 0; i < hs; i++) {
                    double s = 0;
                    for (int u = 0; u <= t; u++)
                        s += exp(sc[u] - mx) / z * qkv[(size_t)u * QKV + (size_t)(NH + NKV + kv) * hs + i];
                    att[(size_t)t * A + (size_t)h * hs + i] = s;
                }
            }
        }
        ref_matmul(o, att, tensor(d, params, TD_MODEL_ATTPROJ_W, l), T, A, C);
        for (size_t i = 0; i < (size_t)T * C; i++) x[i] += o[i];
        for (int t = 0; t < T; t++)
            ref_rmsnorm(n + (size_t)t * C, x + (size_t)t * C, tensor(d, params, TD_MODEL_LN2_W, l), C, eps);
        ref_matmul(gu, n, tensor(d, params, TD_MODEL_FC_W, l), T, C, 2 * H);
        for (int t = 0; t < T; t++)
            for (int i = 0; i < H; i++)
                hh[(size_t)t * H + i] = gelu_tanh(gu[(size_t)t * 2 * H + i]) * gu[(size_t)t * 2 * H + H + i];
        ref_matmul(o, hh, tensor(d, params, TD_MODEL_FCPROJ_W, l), T, H, C);
        for (size_t i = 0; i < (size_t)T * C; i++) x[i] += o[i];
    }
    double loss = 0;
    for (int t = 0; t < T; t++) {
        ref_rmsnorm(n, x + (size_t)t * C, tensor(d, params, TD_MODEL_LNF_W, -1), C, eps);
        ref_matmul(logit, n, wte, 1, C, V); /* tied: the embedding's first V rows */
        double mx = -1e300, z = 0;
        for (int v = 0; v < V; v++) mx = fmax(mx, logit[v]);
        for (int v = 0; v < V; v++) z += exp(logit[v] - mx);
        loss += log(z) + mx - logit[tgt[t]];
    }
    free(x); free(n); free(qkv); free(att); free(o); free(gu); free(hh); free(logit); free(sc);
    return loss / T;
}

typedef struct model { td_model_desc d; float *p, *g, *acts, *scratch; int tok[10], tgt[10]; } model;
enum { B = 2, T = 5 };

static void model_make(model *m)
{
    m->d = small_gemma();
    const size_t np = td_model_params_numel(&m->d);
    m->p = fvec(np), m->g = fvec(np);
    m->acts = fvec(td_model_acts_numel(&m->d, B, T));
    m->scratch = fvec(td_model_scratch_numel(&m->d, B, T));
    td_model_init(&m->d, m->p, 11);
    td_rng rng;
    td_rng_seed(&rng, 12);
    /* perturbed away from init so that every gain and matrix matters */
    for (size_t k = 0; k < np; k++) m->p[k] += (float)(td_rng_uniform(&rng) - 0.5) * 0.4f;
    for (int i = 0; i < B * T; i++) {
        m->tok[i] = (int)td_rng_below(&rng, (uint64_t)m->d.vocab_size);
        m->tgt[i] = (int)td_rng_below(&rng, (uint64_t)m->d.vocab_size);
    }
}

static double model_loss(model *m)
{
    float loss;
    TD_ASSERT_OK(td_model_forward(&m->d, m->p, m->tok, m->tgt, B, T, m->acts, &loss, NULL));
    return loss;
}

static void model_free(model *m) { free(m->p); free(m->g); free(m->acts); free(m->scratch); }

static void test_loss_against_reference(void **state)
{
    model m;
    model_make(&m);
    /* the padding rows past V do not take part: zero them as the files do not hold them */
    const double got = model_loss(&m);
    const double want = (ref_loss(&m.d, m.p, m.tok, m.tgt, T) + ref_loss(&m.d, m.p, m.tok + T, m.tgt + T, T)) / 2;
    printf("  tidal %.9g, reference %.9g\n", got, want);
    assert_true(fabs(got - want) <= 1e-5 * fabs(want));
    model_free(&m);
}

/* Central differences at a few coordinates of every tensor, and one
 * directional derivative over all of them. */
static void test_gradients(void **state)
{
    model m;
    model_make(&m);
    model_loss(&m);
    TD_ASSERT_OK(td_model_backward(&m.d, m.p, m.g, m.tok, m.tgt, 1.0f / (B * T), B, T, m.acts, m.scratch));
    td_rng rng;
    td_rng_seed(&rng, 13);
    const float h = 1e-2f;
    for (int i = 0; i < td_model_tensor_count(&m.d); i++) {
        td_model_tensor t;
        td_model_tensor_get(&m.d, i, &t);
        size_t rows = t.kind == TD_MODEL_WTE ? (size_t)m.d.vocab_size * m.d.n_embd : t.numel;
        for (int s = 0; s < 6; s++) {
            const size_t k = t.offset + td_rng_below(&rng, rows);
            const float saved = m.p[k];
            m.p[k] = saved + h;
            const double lp = model_loss(&m);
            m.p[k] = saved - h;
            const double lm = model_loss(&m);
            m.p[k] = saved;
            const double num = (lp - lm) / (2.0 * h), ana = m.g[k];
            if (fabs(num - ana) > 3e-4 + 1e-2 * fmax(fabs(num), fabs(ana)))
                fail_msg("%s[%zu]: numeric %.8g, analytic %.8g", t.name, k - t.offset, num, ana);
        }
    }
    const size_t np = td_model_params_numel(&m.d);
    float *u = fvec(np), *p0 = fvec(np);
    memcpy(p0, m.p, np * sizeof(float));
    double gu = 0;
    for (size_t k = 0; k < np; k++) gu += (double)m.g[k] * (u[k] = (float)(2.0 * td_rng_uniform(&rng) - 1.0));
    const double e = 1e-3;
    for (size_t k = 0; k < np; k++) m.p[k] = p0[k] + (float)e * u[k];
    const double lp = model_loss(&m);
    for (size_t k = 0; k < np; k++) m.p[k] = p0[k] - (float)e * u[k];
    const double lm = model_loss(&m);
    printf("  directional: numeric %.8g, analytic %.8g\n", (lp - lm) / (2 * e), gu);
    assert_true(fabs((lp - lm) / (2 * e) - gu) < 2e-3 * fabs(gu) + 1e-4);
    free(u);
    free(p0);
    model_free(&m);
}

/* The padding token (config.json's pad_token_id; transformers' embedding is
 * nn.Embedding(padding_idx=pad_token_id)): its embedding row takes nothing
 * from the input lookup.  With pad set to a token of the inputs, every other
 * gradient is the same, bit for bit; untied, its row's gradient is 0; tied,
 * it is the head's part alone: an untied copy of the model (lm_head = the
 * embedding) gives it as lm_head's row. */
static void backward_of(const td_model_desc *d, float *p, float *g, model *m)
{
    float loss;
    memset(g, 0, td_model_params_numel(d) * sizeof(float));
    float *acts = fvec(td_model_acts_numel(d, B, T)), *scratch = fvec(td_model_scratch_numel(d, B, T));
    TD_ASSERT_OK(td_model_forward(d, p, m->tok, m->tgt, B, T, acts, &loss, NULL));
    TD_ASSERT_OK(td_model_backward(d, p, g, m->tok, m->tgt, 1.0f / (B * T), B, T, acts, scratch));
    free(acts);
    free(scratch);
}

static void test_padding_token(void **state)
{
    model m;
    model_make(&m);
    const td_model_desc tied = m.d;
    td_model_desc padded = tied, untied = tied;
    untied.untied_head = 1;
    padded.has_pad_token = 1;
    padded.pad_token = m.tok[3];
    const int C = tied.n_embd, pad = padded.pad_token;
    const size_t np = td_model_params_numel(&tied), nu = td_model_params_numel(&untied);
    const size_t row = (size_t)pad * C, wte_n = (size_t)tied.padded_vocab_size * C; /* wte is tensor 0 */
    float *g0 = fvec(np), *g1 = fvec(np), *pu = fvec(nu), *gu = fvec(nu), *gp = fvec(nu);
    backward_of(&tied, m.p, g0, &m);
    backward_of(&padded, m.p, g1, &m);
    assert_memory_equal(g1, g0, row * sizeof(float));
    assert_memory_equal(g1 + row + C, g0 + row + C, (np - row - C) * sizeof(float));
    /* untied: lm_head after the tied layout, a copy of the embedding */
    memcpy(pu, m.p, np * sizeof(float));
    memcpy(pu + np, m.p, wte_n * sizeof(float));
    td_model_desc untied_padded = untied;
    untied_padded.has_pad_token = 1;
    untied_padded.pad_token = pad;
    backward_of(&untied, pu, gu, &m);
    backward_of(&untied_padded, pu, gp, &m);
    for (int c = 0; c < C; c++) {
        assert_true(gu[row + c] != 0.0f); /* without it, the lookup reached the row */
        assert_true(gp[row + c] == 0.0f);
        const float head = gu[np + row + c];
        if (!(fabsf(g1[row + c] - head) <= 1e-6f * fabsf(head) + 1e-9f))
            fail_msg("tied, channel %d of the padding row: %.9g, the head's part %.9g", c, g1[row + c], head);
        assert_true(fabsf(g0[row + c] - (head + gu[row + c])) <= 1e-5f * (fabsf(head) + fabsf(gu[row + c])) + 1e-9f);
    }
    assert_memory_equal(gp + row + C, gu + row + C, (nu - row - C) * sizeof(float));
    free(g0); free(g1); free(pu); free(gu); free(gp);
    model_free(&m);
}

/* --- config.json and checkpoints ---------------------------------------------- */

static char tmp_root[256];

static int setup_dir(void **state)
{
    snprintf(tmp_root, sizeof tmp_root, "/tmp/td_gemma_XXXXXX");
    return mkdtemp(tmp_root) ? 0 : -1;
}

static int teardown_dir(void **state)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp_root);
    return system(cmd) == 0 ? 0 : -1;
}

static const char *write_config(const char *json)
{
    static char path[512];
    snprintf(path, sizeof path, "%s/config.json", tmp_root);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(json, f);
    fclose(f);
    return path;
}

#define GEMMA_BASE "\"model_type\": \"gemma\", \"hidden_size\": 64, \"intermediate_size\": 96, " \
                   "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"max_position_embeddings\": 128, " \
                   "\"vocab_size\": 100"

static void expect_error(const char *json, const char *piece)
{
    td_model_desc d;
    assert_int_equal(td_model_config_read(write_config(json), &d), TD_ERR_INVALID);
    if (!strstr(td_error_msg(), piece)) fail_msg("message lacks '%s': %s", piece, td_error_msg());
}

static void test_config_json(void **state)
{
    /* google/gemma-2b's config.json is the preset */
    td_model_desc d, preset;
    TD_ASSERT_OK(td_model_config_read(write_config(
        "{\"architectures\": [\"GemmaForCausalLM\"], \"attention_bias\": false, \"attention_dropout\": 0.0, "
        "\"bos_token_id\": 2, \"eos_token_id\": 1, \"head_dim\": 256, \"hidden_act\": \"gelu\", "
        "\"hidden_size\": 2048, \"initializer_range\": 0.02, \"intermediate_size\": 16384, "
        "\"max_position_embeddings\": 8192, \"model_type\": \"gemma\", \"num_attention_heads\": 8, "
        "\"num_hidden_layers\": 18, \"num_key_value_heads\": 1, \"pad_token_id\": 0, \"rms_norm_eps\": 1e-06, "
        "\"rope_scaling\": null, \"rope_theta\": 10000.0, \"torch_dtype\": \"bfloat16\", "
        "\"transformers_version\": \"4.38.0.dev0\", \"use_cache\": true, \"vocab_size\": 256000}"), &d));
    TD_ASSERT_OK(td_model_preset("gemma-2b", &preset));
    d.padded_vocab_size = preset.padded_vocab_size;
    assert_memory_equal(&d, &preset, sizeof d);
    /* GemmaConfig's defaults: heads of 256, a tied head, eps 1e-6, padding token 0 */
    TD_ASSERT_OK(td_model_config_read(write_config("{" GEMMA_BASE "}"), &d));
    assert_int_equal(td_model_head_size(&d), 256);
    assert_true(!d.untied_head && d.norm_eps == 1e-6f && td_model_kv_heads(&d) == 4);
    assert_true(d.has_pad_token && d.pad_token == 0);
    /* pad_token_id null: none; negative: from the end, as torch's padding_idx */
    TD_ASSERT_OK(td_model_config_read(write_config("{" GEMMA_BASE ", \"pad_token_id\": null}"), &d));
    assert_false(d.has_pad_token);
    TD_ASSERT_OK(td_model_config_read(write_config("{" GEMMA_BASE ", \"pad_token_id\": -1}"), &d));
    assert_true(d.has_pad_token && d.pad_token == d.vocab_size - 1);
    expect_error("{" GEMMA_BASE ", \"pad_token_id\": 1e9}", "\"pad_token_id\" 1e+09 is not a token");
    expect_error("{" GEMMA_BASE ", \"pad_token_id\": 1.5}", "is not a token of the vocabulary");
    /* out and back in: the same description */
    const td_model_desc s = small_gemma();
    td_hf_config *c;
    TD_ASSERT_OK(td_hf_config_create("test", &c));
    TD_ASSERT_OK(td_model_config_put(&s, c));
    char *text;
    TD_ASSERT_OK(td_hf_config_print(c, &text));
    td_hf_config_free(c);
    assert_non_null(strstr(text, "\"GemmaForCausalLM\""));
    assert_non_null(strstr(text, "\"hidden_activation\":\t\"gelu_pytorch_tanh\""));
    TD_ASSERT_OK(td_model_config_read(write_config(text), &d));
    td_free(text);
    assert_memory_equal(&d, &s, sizeof d);
    td_model_desc padded = s; /* a padding token goes out and comes back */
    padded.has_pad_token = 1;
    padded.pad_token = 7;
    TD_ASSERT_OK(td_hf_config_create("test", &c));
    TD_ASSERT_OK(td_model_config_put(&padded, c));
    TD_ASSERT_OK(td_hf_config_print(c, &text));
    td_hf_config_free(c);
    assert_non_null(strstr(text, "\"pad_token_id\":\t7"));
    TD_ASSERT_OK(td_model_config_read(write_config(text), &d));
    td_free(text);
    assert_memory_equal(&d, &padded, sizeof d);
    /* what tidal does not compute is refused, the key named */
    expect_error("{" GEMMA_BASE ", \"hidden_activation\": \"gelu\"}", "hidden_activation \"gelu\" is not supported");
    expect_error("{" GEMMA_BASE ", \"attention_bias\": true}", "\"attention_bias\" must be false");
    expect_error("{" GEMMA_BASE ", \"head_dim\": 33}", "must be even");
    expect_error("{" GEMMA_BASE ", \"num_key_value_heads\": 3}", "does not divide");
}

/* Weights out under the Hugging Face names and back, element for element. */
static void test_checkpoint_round_trip(void **state)
{
    const td_model_desc d = small_gemma();
    assert_int_equal(td_model_hf_count(&d), 1 + 9 * d.n_layer + 1);
    td_model_hf_tensor q, o;
    TD_ASSERT_OK(td_model_hf_get(&d, td_model_hf_find(&d, "model.layers.1.self_attn.q_proj.weight"), &q));
    assert_true(q.hf_shape[0] == 2 * 12 && q.hf_shape[1] == 16 && q.offset == 0);
    TD_ASSERT_OK(td_model_hf_get(&d, td_model_hf_find(&d, "model.layers.1.self_attn.v_proj.weight"), &q));
    assert_true(q.hf_shape[0] == 12 && q.offset == (uint64_t)(2 + 1) * 12 * 16);
    TD_ASSERT_OK(td_model_hf_get(&d, td_model_hf_find(&d, "model.layers.0.self_attn.o_proj.weight"), &o));
    assert_true(o.hf_shape[0] == 16 && o.hf_shape[1] == 24);
    assert_int_equal(td_model_hf_find(&d, "lm_head.weight"), -1);
    assert_true(td_model_hf_ignorable(&d, "lm_head.weight"));

    const size_t np = td_model_params_numel(&d);
    float *p = fvec(np), *back = fvec(np);
    td_model_init(&d, p, 5);
    for (int i = 0; i < td_model_tensor_count(&d); i++) { /* gains that are not 0, padding rows 0 */
        td_model_tensor t;
        td_model_tensor_get(&d, i, &t);
        for (size_t k = 0; k < t.numel; k++) p[t.offset + k] += 0.01f * (float)(k % 7);
        if (t.kind == TD_MODEL_WTE) memset(p + t.offset + (size_t)d.vocab_size * d.n_embd, 0,
                                           (t.numel - (size_t)d.vocab_size * d.n_embd) * sizeof(float));
    }
    char dir[600];
    snprintf(dir, sizeof dir, "%s/ckpt", tmp_root);
    td_ckpt_write_options wo = td_ckpt_write_default_options();
    wo.train_state = 0;
    td_ckpt_writer *w;
    TD_ASSERT_OK(td_ckpt_writer_begin(dir, &d, &wo, &w));
    for (int i = 0; i < td_model_hf_count(&d); i++) {
        td_model_hf_tensor h;
        TD_ASSERT_OK(td_model_hf_get(&d, i, &h));
        td_model_tensor t;
        td_model_tensor_get(&d, h.tensor, &t);
        TD_ASSERT_OK(td_ckpt_writer_put_weight(w, i, TD_DTYPE_F32, p + t.offset + h.offset));
    }
    TD_ASSERT_OK(td_ckpt_writer_commit(w));
    td_ckpt_reader *r;
    TD_ASSERT_OK(td_ckpt_reader_open(dir, NULL, &r));
    assert_memory_equal(td_ckpt_reader_config(r), &d, sizeof d);
    for (int i = 0; i < td_model_hf_count(&d); i++) {
        td_model_hf_tensor h;
        TD_ASSERT_OK(td_model_hf_get(&d, i, &h));
        td_model_tensor t;
        td_model_tensor_get(&d, h.tensor, &t);
        TD_ASSERT_OK(td_ckpt_reader_get_weight(r, i, TD_DTYPE_F32, back + t.offset + h.offset));
    }
    td_ckpt_reader_close(r);
    assert_memory_equal(back, p, np * sizeof(float));
    free(p);
    free(back);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_presets_and_layout),
        cmocka_unit_test(test_loss_against_reference),
        cmocka_unit_test(test_gradients),
        cmocka_unit_test(test_padding_token),
        cmocka_unit_test(test_config_json),
        cmocka_unit_test(test_checkpoint_round_trip),
    };
    return cmocka_run_group_tests(tests, setup_dir, teardown_dir);
}
