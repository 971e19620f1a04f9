/* Loss scaling and the step controller: an overflow skips the step (no
 * update, no schedule step), backs the scale off (after the hysteresis),
 * clean runs grow it; static and none never change it; the controller's
 * coefficients are the clip, the unscale and the schedule of the right step;
 * and a whole step on real buffers leaves the state untouched on overflow. */
#include "td_test.h"
#include "tidal/optim.h"

#include <math.h>
#include <string.h>

static td_loss_scaler make(td_loss_scale_kind kind, int hysteresis, long interval)
{
    td_loss_scaler_params p = td_loss_scaler_default_params();
    p.kind = kind;
    p.hysteresis = hysteresis;
    p.growth_interval = interval;
    td_loss_scaler s;
    TD_ASSERT_OK(td_loss_scaler_init(&s, &p));
    return s;
}

static void test_dynamic_overflow_halves(void **state)
{
    td_loss_scaler s = make(TD_LOSS_SCALE_DYNAMIC, 1, 1000);
    assert_true(s.scale == 65536.0);
    assert_int_equal(td_loss_scaler_update(&s, 1), 1); /* skipped */
    assert_true(s.scale == 32768.0);
    assert_int_equal(td_loss_scaler_update(&s, 1), 1);
    assert_true(s.scale == 16384.0);
    assert_int_equal(td_loss_scaler_update(&s, 0), 0);
    assert_true(s.scale == 16384.0);
    assert_int_equal(s.overflows, 2);
}

static void test_dynamic_hysteresis(void **state)
{
    td_loss_scaler s = make(TD_LOSS_SCALE_DYNAMIC, 2, 1000); /* the default: 2 */
    assert_int_equal(td_loss_scaler_update(&s, 1), 1);
    assert_true(s.scale == 65536.0);                         /* the first overflow is tolerated */
    assert_int_equal(td_loss_scaler_update(&s, 0), 0);
    assert_int_equal(td_loss_scaler_update(&s, 1), 1);
    assert_true(s.scale == 32768.0);                         /* the second backs off */
    assert_int_equal(td_loss_scaler_update(&s, 1), 1);
    assert_true(s.scale == 16384.0);                         /* and every later one, until growth */
    s = make(TD_LOSS_SCALE_DYNAMIC, 3, 4);
    td_loss_scaler_update(&s, 1), td_loss_scaler_update(&s, 1);
    assert_true(s.scale == 65536.0);
    for (int i = 0; i < 4; i++) td_loss_scaler_update(&s, 0); /* growth refills the hysteresis */
    assert_true(s.scale == 131072.0);
    td_loss_scaler_update(&s, 1), td_loss_scaler_update(&s, 1);
    assert_true(s.scale == 131072.0);
    td_loss_scaler_update(&s, 1);
    assert_true(s.scale == 65536.0);
}

static void test_dynamic_growth_and_floor(void **state)
{
    td_loss_scaler s = make(TD_LOSS_SCALE_DYNAMIC, 1, 1000);
    for (int i = 0; i < 999; i++) assert_int_equal(td_loss_scaler_update(&s, 0), 0);
    assert_true(s.scale == 65536.0);
    td_loss_scaler_update(&s, 0);
    assert_true(s.scale == 131072.0); /* x2 after 1000 clean steps */
    for (int i = 0; i < 500; i++) td_loss_scaler_update(&s, 0);
    td_loss_scaler_update(&s, 1);    /* an overflow restarts the clean run */
    for (int i = 0; i < 999; i++) td_loss_scaler_update(&s, 0);
    assert_true(s.scale == 65536.0);
    td_loss_scaler_update(&s, 0);
    assert_true(s.scale == 131072.0);
    for (int i = 0; i < 40; i++) td_loss_scaler_update(&s, 1);
    assert_true(s.scale == 1.0);      /* never below min_scale */
    td_loss_scaler_params p = td_loss_scaler_default_params();
    p.kind = TD_LOSS_SCALE_DYNAMIC;
    p.min_scale = 1e6;
    assert_int_equal(td_loss_scaler_init(&s, &p), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "minimum loss scale"));
    p = td_loss_scaler_default_params();
    p.kind = TD_LOSS_SCALE_DYNAMIC;
    p.backoff_factor = 1.0;
    assert_int_equal(td_loss_scaler_init(&s, &p), TD_ERR_INVALID);
}

static void test_static_and_none(void **state)
{
    td_loss_scaler s = make(TD_LOSS_SCALE_STATIC, 2, 10);
    for (int i = 0; i < 50; i++) assert_int_equal(td_loss_scaler_update(&s, i % 7 == 0), i % 7 == 0);
    assert_true(s.scale == 65536.0);
    s = make(TD_LOSS_SCALE_NONE, 2, 10);
    assert_true(s.scale == 1.0);
    assert_int_equal(td_loss_scaler_update(&s, 1), 1); /* a NaN grad is still never applied */
    for (int i = 0; i < 50; i++) td_loss_scaler_update(&s, 0);
    assert_true(s.scale == 1.0);
    td_loss_scale_kind k;
    TD_ASSERT_OK(td_loss_scale_kind_parse("dynamic", &k));
    assert_int_equal(k, TD_LOSS_SCALE_DYNAMIC);
    assert_int_equal(td_loss_scale_kind_parse("auto", &k), TD_ERR_INVALID);
}

/* The controller: coefficients of the right step, skip on overflow without
 * advancing the step or the schedule. */
static void test_controller(void **state)
{
    td_optim_params p = td_optim_default_params();
    p.scaler.kind = TD_LOSS_SCALE_DYNAMIC;
    p.scaler.hysteresis = 1;
    p.lr = (td_lr_schedule){TD_LR_DECAY_LINEAR, 1e-3, 0, 4, 100, 1};
    p.max_grad_norm = 1.0;
    td_optim o;
    TD_ASSERT_OK(td_optim_init(&o, &p));
    assert_true(td_optim_loss_scale(&o) == 65536.0);
    td_optim_step st;
    /* Step 1: grads of norm 3 (unscaled) -> clipped to 1. */
    td_grad_stats g = {9.0 * 65536.0 * 65536.0};
    TD_ASSERT_OK(td_optim_begin_step(&o, &g, &st));
    assert_false(st.skip);
    assert_int_equal(st.step, 1);
    assert_true(st.lr == 1e-3 / 4);
    assert_true(st.grad_norm == 3.0);
    assert_true(st.clip_coef == 1.0 / (3.0 + 1e-6));
    td_adam_coeffs want;
    TD_ASSERT_OK(td_adam_coeffs_make(&p.adam, 1e-3 / 4, 1, st.clip_coef / 65536.0, &want));
    assert_memory_equal(&st.coeffs, &want, sizeof want);
    /* Step 2 overflows: skipped, nothing advances, the scale halves. */
    g.sumsq = INFINITY;
    TD_ASSERT_OK(td_optim_begin_step(&o, &g, &st));
    assert_true(st.skip);
    assert_int_equal(st.step, 1);
    assert_int_equal(o.step, 1);
    assert_int_equal(o.skipped_steps, 1);
    assert_true(st.loss_scale == 65536.0);
    assert_true(td_optim_loss_scale(&o) == 32768.0);
    g.sumsq = NAN;
    TD_ASSERT_OK(td_optim_begin_step(&o, &g, &st));
    assert_true(st.skip);
    assert_true(td_optim_loss_scale(&o) == 16384.0);
    /* The next clean step is AdamW step 2, with step 2's lr, unscaled by the new scale. */
    g.sumsq = 0.25 * 16384.0 * 16384.0;
    TD_ASSERT_OK(td_optim_begin_step(&o, &g, &st));
    assert_false(st.skip);
    assert_int_equal(st.step, 2);
    assert_true(st.lr == 2e-3 / 4);
    assert_true(st.grad_norm == 0.5 && st.clip_coef == 1.0);
    TD_ASSERT_OK(td_adam_coeffs_make(&p.adam, 2e-3 / 4, 2, 1.0 / 16384.0, &want));
    assert_memory_equal(&st.coeffs, &want, sizeof want);
    /* Bad settings are refused with a message. */
    p.max_grad_norm = INFINITY;
    assert_int_equal(td_optim_init(&o, &p), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "max grad norm"));
}

/* A whole step on buffers: an Inf in one chunk skips the update of all. */
static void test_overflow_step_leaves_state(void **state)
{
    enum { N = 3000 };
    td_adam_cpu *cpu;
    TD_ASSERT_OK(td_adam_cpu_create(NULL, &cpu));
    static float master[N], m[N], v[N], init[N];
    static uint16_t grad[N], out[N];
    for (int i = 0; i < N; i++) init[i] = 0.001f * (float)i, grad[i] = 0x3f80; /* bf16 1.0 */
    td_adam_chunk ch[2] = {{master, m, v, grad, TD_DTYPE_BF16, out, TD_DTYPE_BF16, 1000, TD_OPTIM_STATE_FP32, NULL, 0},
                           {master + 1000, m + 1000, v + 1000, grad + 1000, TD_DTYPE_BF16, out + 1000,
                            TD_DTYPE_BF16, N - 1000, TD_OPTIM_STATE_FP32, NULL, 0}};
    TD_ASSERT_OK(td_adam_cpu_init(cpu, &ch[0], init, TD_DTYPE_F32));
    TD_ASSERT_OK(td_adam_cpu_init(cpu, &ch[1], init + 1000, TD_DTYPE_F32));
    td_optim_params p = td_optim_default_params();
    p.scaler.kind = TD_LOSS_SCALE_DYNAMIC;
    p.scaler.hysteresis = 1;
    td_optim o;
    TD_ASSERT_OK(td_optim_init(&o, &p));
    grad[2500] = 0x7f80; /* +Inf in the second chunk */
    float before[N];
    uint16_t out_before[N];
    memcpy(before, master, sizeof before);
    memcpy(out_before, out, sizeof out);
    td_grad_stats s = {0};
    for (int j = 0; j < 2; j++) TD_ASSERT_OK(td_adam_cpu_grad_stats(cpu, ch[j].grad, ch[j].grad_dtype, ch[j].numel, &s));
    td_optim_step st;
    TD_ASSERT_OK(td_optim_begin_step(&o, &s, &st));
    assert_true(st.skip);
    if (!st.skip) TD_ASSERT_OK(td_adam_cpu_update(cpu, &st.coeffs, ch, 2));
    assert_memory_equal(master, before, sizeof before);
    assert_memory_equal(out, out_before, sizeof out);
    assert_true(td_optim_loss_scale(&o) == 32768.0);
    grad[2500] = 0x3f80;
    s.sumsq = 0;
    for (int j = 0; j < 2; j++) TD_ASSERT_OK(td_adam_cpu_grad_stats(cpu, ch[j].grad, ch[j].grad_dtype, ch[j].numel, &s));
    TD_ASSERT_OK(td_optim_begin_step(&o, &s, &st));
    assert_false(st.skip);
    TD_ASSERT_OK(td_adam_cpu_update(cpu, &st.coeffs, ch, 2));
    assert_true(master[10] < before[10]); /* a positive grad moves the param down */
    td_adam_cpu_destroy(cpu);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dynamic_overflow_halves),
        cmocka_unit_test(test_dynamic_hysteresis),
        cmocka_unit_test(test_dynamic_growth_and_floor),
        cmocka_unit_test(test_static_and_none),
        cmocka_unit_test(test_controller),
        cmocka_unit_test(test_overflow_step_leaves_state),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
