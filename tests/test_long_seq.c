/* Long sequences on the GPU: the device memory a LLaMA or Qwen2 run plans
 * (activations and workspace) is linear in the sequence.  At a fixed number
 * of tokens a micro-batch (B x T), 16-bit runs use flash attention, whose
 * scratch holds a row per query (no T x T matrix), so 8 sequences of 1024
 * tokens and one of 8192 plan the same bytes.  fp32 runs take the batched
 * GEMM attention, which holds T x T scores per sequence: the control that
 * shows the measure sees a T^2 term where there is one. */
#include "td_test.h"
#include "tidal/model.h"
#include "tidal/trainer.h"

#include <string.h>

#ifdef TD_HAVE_CUDA
/* Activation and workspace bytes of `preset` at B x T in precision dt on the
 * cuda backend, every block's activations kept (--ckpt off). */
static size_t nonmodel_bytes(const char *preset, int B, int T, td_dtype dt)
{
    td_train_config c = td_train_default_config();
    TD_ASSERT_OK(td_model_preset(preset, &c.model));
    c.backend = TD_BACKEND_CUDA;
    c.precision = dt;
    c.micro_batch = B;
    c.seq_len = T;
    c.ckpt = TD_CKPT_OFF;
    td_train_plan p;
    TD_ASSERT_OK(td_train_plan_make(&c, 0, &p));
    return p.activation_bytes + p.workspace_bytes;
}

static const char *const presets[] = {"llama-3.2-1b", "llama-3.1-8b", "qwen2.5-0.5b", "qwen2.5-7b"};
static const int shapes[][2] = {{8, 1024}, {4, 2048}, {2, 4096}, {1, 8192}}; /* B, T: 8192 tokens each */

static void test_16bit_memory_is_linear_in_the_sequence(void **state)
{
    const td_dtype dts[] = {TD_DTYPE_BF16, TD_DTYPE_F16};
    for (size_t m = 0; m < sizeof presets / sizeof *presets; m++)
        for (int d = 0; d < 2; d++) {
            size_t first = nonmodel_bytes(presets[m], shapes[0][0], shapes[0][1], dts[d]);
            for (int s = 1; s < 4; s++) {
                size_t b = nonmodel_bytes(presets[m], shapes[s][0], shapes[s][1], dts[d]);
                /* the same tokens: the same bytes, within 1% (per-sequence rounding) */
                if (b > first + first / 100 || b + first / 100 < first)
                    fail_msg("%s %s: %zu bytes at B%d T%d against %zu at B%d T%d", presets[m],
                             td_dtype_name(dts[d]), b, shapes[s][0], shapes[s][1], first, shapes[0][0],
                             shapes[0][1]);
            }
            /* and one sequence's bytes grow with T, not T^2: 8x the tokens take at most 8x */
            size_t one = nonmodel_bytes(presets[m], 1, 1024, dts[d]), eight = nonmodel_bytes(presets[m], 1, 8192, dts[d]);
            assert_true(eight > one);
            assert_true(eight <= 8 * one);
        }
}

static void test_fp32_attention_holds_the_scores(void **state)
{
    /* The control: fp32 (batched GEMM attention, T x T scores a sequence)
     * plans more at one sequence of 8192 than at eight of 1024. */
    size_t short_seqs = nonmodel_bytes("llama-3.2-1b", 8, 1024, TD_DTYPE_F32);
    size_t long_seq = nonmodel_bytes("llama-3.2-1b", 1, 8192, TD_DTYPE_F32);
    assert_true(long_seq > short_seqs + short_seqs / 4);
}
#else
static void test_16bit_memory_is_linear_in_the_sequence(void **state)
{
    td_test_skip("built without CUDA: the cuda backend's sizes are not in this build");
}

static void test_fp32_attention_holds_the_scores(void **state)
{
    td_test_skip("built without CUDA: the cuda backend's sizes are not in this build");
}
#endif

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_16bit_memory_is_linear_in_the_sequence),
        cmocka_unit_test(test_fp32_attention_holds_the_scores),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
