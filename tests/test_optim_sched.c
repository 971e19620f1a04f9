/* LR schedules equal their closed forms at every step, start above zero,
 * peak at the end of warmup, never pass the floor, and reject bad settings. */
#include "td_test.h"
#include "tidal/optim.h"

#include <math.h>
#include <string.h>

/* The closed forms, written out again independently of schedule.c. */
static double closed_form(const td_lr_schedule *s, long t)
{
    double W = (double)s->warmup_steps, T = (double)s->total_steps, lr = s->lr, lo = s->min_lr;
    switch (s->decay) {
    case TD_LR_DECAY_CONSTANT: return t <= W ? lr * t / W : lr;
    case TD_LR_DECAY_COSINE:
        if (t <= W) return lr * t / W;
        if (t >= T) return lo;
        return lo + (lr - lo) * (1 + cos(M_PI * (t - W - 1) / (T - W - 1))) / 2;
    case TD_LR_DECAY_LINEAR:
        if (t <= W) return lr * t / W;
        if (t >= T) return lo;
        return lo + (lr - lo) * (T - t) / (T - W - 1);
    case TD_LR_DECAY_NOAM: {
        double w = W < 1 ? 1 : W;
        if (t <= w) return lr * t / w;
        double x = lr * sqrt(w) / sqrt((double)t);
        return x > lo ? x : lo;
    }
    case TD_LR_DECAY_EXPONENTIAL: {
        if (t <= W) return lr * t / W;
        double x = lr * pow(s->gamma, t - W - 1);
        return x > lo ? x : lo;
    }
    default: return NAN;
    }
}

static void test_schedules_equal_closed_form(void **state)
{
    int seeds = td_test_seeds(50);
    for (int seed = 1; seed <= seeds; seed++) {
        td_rng r;
        td_rng_seed(&r, (uint64_t)seed);
        for (int d = 0; d < TD_LR_DECAY_COUNT; d++) {
            td_lr_schedule s = td_lr_schedule_default();
            s.decay = (td_lr_decay)d;
            s.lr = pow(10, -5 + 4 * td_rng_uniform(&r));
            s.min_lr = td_rng_below(&r, 3) ? s.lr * td_rng_uniform(&r) * 0.5 : 0;
            s.warmup_steps = (long)td_rng_below(&r, 3) * (long)td_rng_below(&r, 200);
            s.total_steps = s.warmup_steps + 2 + (long)td_rng_below(&r, 2000);
            s.gamma = 0.9 + 0.1 * td_rng_uniform(&r);
            TD_ASSERT_OK(td_lr_schedule_check(&s));
            double peak = 0;
            for (long t = 1; t <= s.total_steps + 50; t++) {
                double got = td_lr_at(&s, t), want = closed_form(&s, t);
                if (!(fabs(got - want) <= 1e-12 * s.lr))
                    fail_msg("seed %d %s step %ld: %.17g, closed form %.17g", seed, td_lr_decay_name(s.decay), t, got, want);
                assert_true(got > 0 || (s.min_lr == 0 && t >= s.total_steps && d != TD_LR_DECAY_CONSTANT));
                assert_true(got <= s.lr * (1 + 1e-15));
                if (t > s.warmup_steps && t > 1) {
                    assert_true(got >= s.min_lr * (1 - 1e-15));
                    assert_true(got <= td_lr_at(&s, t - 1) * (1 + 1e-15) || t <= s.warmup_steps + 1); /* non-increasing */
                }
                if (got > peak) peak = got;
            }
            assert_true(td_lr_at(&s, 1) > 0);                     /* the first step learns */
            assert_true(fabs(peak - s.lr) <= 1e-12 * s.lr);       /* the peak is lr */
            if (s.warmup_steps) assert_true(fabs(td_lr_at(&s, s.warmup_steps) - s.lr) <= 1e-12 * s.lr);
            if (d == TD_LR_DECAY_COSINE || d == TD_LR_DECAY_LINEAR)
                assert_true(fabs(td_lr_at(&s, s.total_steps) - s.min_lr) <= 1e-12 * s.lr);
            assert_true(td_lr_at(&s, 0) == td_lr_at(&s, 1));
        }
    }
}

static void test_named_points(void **state)
{
    td_lr_schedule s = {TD_LR_DECAY_COSINE, 1e-3, 1e-4, 10, 111, 1};
    assert_true(td_lr_at(&s, 1) == 1e-4);                               /* lr / W */
    assert_true(td_lr_at(&s, 10) == 1e-3 && td_lr_at(&s, 11) == 1e-3);  /* the peak, then decay from it */
    assert_true(fabs(td_lr_at(&s, 61) - 5.5e-4) < 1e-15);               /* half way: the mean */
    assert_true(td_lr_at(&s, 111) == 1e-4);
    s.decay = TD_LR_DECAY_LINEAR;
    assert_true(fabs(td_lr_at(&s, 36) - (1e-4 + 9e-4 * 0.75)) < 1e-15);
    s = (td_lr_schedule){TD_LR_DECAY_NOAM, 1e-3, 0, 100, 0, 1};
    assert_true(fabs(td_lr_at(&s, 400) - 5e-4) < 1e-15);                /* sqrt(100/400) */
    s = (td_lr_schedule){TD_LR_DECAY_EXPONENTIAL, 1e-3, 0, 0, 0, 0.5};
    assert_true(td_lr_at(&s, 1) == 1e-3 && td_lr_at(&s, 3) == 2.5e-4);
    s = td_lr_schedule_default();
    assert_true(td_lr_at(&s, 1) == 1e-4 && td_lr_at(&s, 1000000) == 1e-4);
}

static void test_bad_settings(void **state)
{
    td_lr_schedule s = {TD_LR_DECAY_COSINE, 1e-3, 0, 100, 101, 1};
    assert_int_equal(td_lr_schedule_check(&s), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "total steps"));
    s.total_steps = 102;
    TD_ASSERT_OK(td_lr_schedule_check(&s));
    assert_true(td_lr_at(&s, 101) == 1e-3 && td_lr_at(&s, 102) == 0);
    s = (td_lr_schedule){TD_LR_DECAY_CONSTANT, 0, 0, 0, 0, 1};
    assert_int_equal(td_lr_schedule_check(&s), TD_ERR_INVALID);
    s = (td_lr_schedule){TD_LR_DECAY_CONSTANT, 1e-3, 2e-3, 0, 0, 1};
    assert_int_equal(td_lr_schedule_check(&s), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "min lr"));
    s = (td_lr_schedule){TD_LR_DECAY_EXPONENTIAL, 1e-3, 0, 0, 0, 1.5};
    assert_int_equal(td_lr_schedule_check(&s), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "gamma"));
    s = (td_lr_schedule){TD_LR_DECAY_CONSTANT, 1e-3, 0, -1, 0, 1};
    assert_int_equal(td_lr_schedule_check(&s), TD_ERR_INVALID);
    td_lr_decay d;
    for (int i = 0; i < TD_LR_DECAY_COUNT; i++) {
        TD_ASSERT_OK(td_lr_decay_parse(td_lr_decay_name((td_lr_decay)i), &d));
        assert_int_equal(d, i);
    }
    assert_int_equal(td_lr_decay_parse("step", &d), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "cosine"));
}

/* --optim-state names and the bytes a moment buffer takes. */
static void test_optim_state_names_and_bytes(void **unused)
{
    (void)unused;
    td_optim_state st;
    for (int i = 0; i < TD_OPTIM_STATE_COUNT; i++) {
        TD_ASSERT_OK(td_optim_state_parse(td_optim_state_name((td_optim_state)i), &st));
        assert_int_equal(st, i);
    }
    assert_int_equal(td_optim_state_parse("int4", &st), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "int4"));
    assert_non_null(strstr(td_error_msg(), "int8"));
    assert_int_equal(td_optim_state_parse(NULL, &st), TD_ERR_INVALID);
    assert_int_equal(td_optim_default_params().state, TD_OPTIM_STATE_FP32);
    assert_int_equal(td_adam_moment_bytes(TD_OPTIM_STATE_FP32, 1000), 4000);
    assert_int_equal(td_adam_moment_bytes(TD_OPTIM_STATE_BF16, 1000), 2000);
    /* int8: codes padded to 4 bytes, then a scale per started block */
    assert_int_equal(td_adam_moment_bytes(TD_OPTIM_STATE_INT8, TD_ADAM_INT8_BLOCK), TD_ADAM_INT8_BLOCK + 4);
    assert_int_equal(td_adam_moment_bytes(TD_OPTIM_STATE_INT8, TD_ADAM_INT8_BLOCK + 1),
                     TD_ADAM_INT8_BLOCK + 4 + 8);
    assert_true(1024 % TD_ADAM_INT8_BLOCK == 0);
    assert_true(td_adam_state_bytes_per_param(TD_OPTIM_STATE_FP32) == 12.0);
    assert_true(td_adam_state_bytes_per_param(TD_OPTIM_STATE_INT8) < 6.1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_schedules_equal_closed_form),
        cmocka_unit_test(test_named_points),
        cmocka_unit_test(test_bad_settings),
        cmocka_unit_test(test_optim_state_names_and_bytes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
