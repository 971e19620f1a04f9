/* The key/value-cache decoder (decode.h) against the reference model's
 * forward over the whole sequence: at every position, its logits equal the
 * forward's logits there (to float summation order), for GPT-2 and for the
 * rotary decoder's families (RMSNorm, SwiGLU, rotary positions, grouped
 * key/value heads, Qwen2's q/k/v biases, an untied head, Gemma's 1 + w
 * gains, GeGLU, scaled embedding and heads that do not split the width); a reset starts over; bad
 * tokens and a full cache are refused by name. */
#include "td_test.h"
#include "tidal/decode.h"
#include "tidal/model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Decodes T random tokens one at a time and compares each position's
 * logits with td_model_forward's; the largest difference relative to the
 * logits' scale. */
static double decode_against_forward(const td_model_desc *cfg, int T, uint64_t seed)
{
    size_t n = td_model_params_numel(cfg);
    float *params = malloc(n * sizeof(float));
    assert_non_null(params);
    td_model_init(cfg, params, seed);
    /* larger than init's 0.02 so that attention is far from uniform */
    for (size_t i = 0; i < n; i++) params[i] *= 4.0f;
    int *tokens = malloc((size_t)T * sizeof(int));
    srand((unsigned)seed);
    for (int t = 0; t < T; t++) tokens[t] = rand() % cfg->vocab_size;
    float *acts = malloc(td_model_acts_numel(cfg, 1, T) * sizeof(float));
    assert_non_null(acts);
    TD_ASSERT_OK(td_model_forward(cfg, params, tokens, NULL, 1, T, acts, NULL, NULL));
    const float *ref = td_model_logits(cfg, 1, T, acts);
    td_decoder *d;
    TD_ASSERT_OK(td_decoder_create(cfg, params, T, &d));
    float *logits = malloc((size_t)cfg->vocab_size * sizeof(float));
    double worst = 0, scale = 0;
    for (int pass = 0; pass < 2; pass++) { /* the second after a reset: the same */
        td_decoder_reset(d);
        for (int t = 0; t < T; t++) {
            TD_ASSERT_OK(td_decoder_step(d, tokens[t], logits));
            assert_int_equal(td_decoder_position(d), t + 1);
            for (int v = 0; v < cfg->vocab_size; v++) {
                double r = ref[(size_t)t * cfg->padded_vocab_size + v];
                worst = fmax(worst, fabs(logits[v] - r));
                scale = fmax(scale, fabs(r));
            }
        }
    }
    /* full: the next token is refused, naming the cache */
    assert_int_equal(td_decoder_step(d, tokens[0], logits), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "full"));
    td_decoder_reset(d);
    assert_int_equal(td_decoder_step(d, cfg->vocab_size, logits), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "outside the vocabulary"));
    td_error_clear();
    td_decoder_destroy(d);
    free(logits);
    free(acts);
    free(tokens);
    free(params);
    assert_true(scale > 0.5); /* logits of some size, not all near zero */
    return worst / scale;
}

static void test_decode_gpt2(void **state)
{
    td_model_desc c;
    TD_ASSERT_OK(td_model_preset("tiny", &c));
    c.n_layer = 3;
    c.n_embd = 64;
    c.n_head = 4;
    c.n_positions = 40;
    c.vocab_size = 97;
    c.padded_vocab_size = 128;
    double err = decode_against_forward(&c, 37, 11);
    print_message("gpt2: largest difference %.2e of the logits' scale\n", err);
    assert_true(err < 1e-5);
}

static void test_decode_llama_family(void **state)
{
    td_model_desc c;
    TD_ASSERT_OK(td_model_preset("tiny-llama", &c));
    c.n_layer = 2;
    c.n_embd = 64;
    c.n_head = 8;
    c.n_kv_head = 2;           /* grouped: four query heads a key/value head */
    c.n_inner = 96;
    c.n_positions = 64;
    c.vocab_size = 101;
    c.padded_vocab_size = 128;
    double err = decode_against_forward(&c, 45, 12);
    print_message("llama: largest difference %.2e\n", err);
    assert_true(err < 1e-5);
    TD_ASSERT_OK(td_model_desc_set_family(&c, "qwen2")); /* q, k, v biases, and its own head */
    c.qkv_bias = 1;
    c.untied_head = 1;
    c.rope_theta = 1e6f;
    err = decode_against_forward(&c, 33, 13);
    print_message("qwen2 (biases, untied head): largest difference %.2e\n", err);
    assert_true(err < 1e-5);
    /* Gemma: 1 + w gains, GeGLU, the embedding times sqrt(C), heads of 12 over a width of 64 */
    TD_ASSERT_OK(td_model_desc_set_family(&c, "gemma"));
    c.head_dim = 12;
    c.untied_head = 0;
    err = decode_against_forward(&c, 21, 14);
    print_message("gemma (heads of 12 over 64): largest difference %.2e\n", err);
    assert_true(err < 1e-5);
}

static void test_decode_refusals(void **state)
{
    td_model_desc c;
    TD_ASSERT_OK(td_model_preset("tiny", &c));
    td_decoder *d = NULL;
    float p = 0;
    assert_int_equal(td_decoder_create(&c, &p, c.n_positions + 1, &d), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "positions"));
    assert_null(d);
    td_error_clear();
    assert_true(td_decoder_bytes(&c, 64) > td_decoder_bytes(&c, 32)); /* the cache grows with the positions */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_decode_gpt2),
        cmocka_unit_test(test_decode_llama_family),
        cmocka_unit_test(test_decode_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
