/* fp32 <-> bf16 / fp16 conversions: round to nearest even checked against an
 * independent reference (exact double arithmetic), special values kept
 * (Inf, NaN with its sign and quiet payload, signed zeros, subnormals), the
 * software fp16 conversion equal bit for bit to the CPU's F16C instructions,
 * and every AdamW kernel's 16-bit output equal to the scalar conversion. */
#include "td_test.h"
#include "tidal/optim.h"
#include "tidal/convert.h"

#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Visits a spread of fp32 bit patterns: a stride through all 2^32, and for
 * every upper half the low halves around the bf16 rounding point and the
 * fp16 rounding points of each exponent. */
typedef void (*visit_fn)(uint32_t bits, void *ctx);

static void visit_patterns(visit_fn fn, void *ctx)
{
    for (uint64_t u = 0; u < (1ull << 32); u += 65521) fn((uint32_t)u, ctx);
    static const uint32_t lows[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff, 0x0fff, 0x1000, 0x1001, 0x2000};
    for (uint32_t hi = 0; hi < 65536; hi++)
        for (size_t k = 0; k < sizeof lows / sizeof *lows; k++) fn(hi << 16 | lows[k], ctx);
}

/* ---- bf16 ------------------------------------------------------------------ */

/* The nearest bf16 by exact distance in double, ties to the even one. */
static uint16_t bf16_reference(float x)
{
    uint32_t u = td_f32_bits(x);
    if (isnan(x)) return (uint16_t)((u >> 16) | 0x40);
    uint16_t lo = (uint16_t)(u >> 16), hi = (uint16_t)(lo + 1); /* toward larger magnitude */
    double dx = fabs((double)x), dlo = fabs((double)td_f32_from_bf16(lo));
    if ((lo & 0x7fff) == 0x7f80) return lo; /* Inf */
    /* Next magnitude up: 0x7f80 (Inf) acts as 2^128 for rounding. */
    double dhi = (hi & 0x7fff) == 0x7f80 ? ldexp(1.0, 128) : fabs((double)td_f32_from_bf16(hi));
    if (dx - dlo < dhi - dx) return lo;
    if (dx - dlo > dhi - dx) return hi;
    return (lo & 1) ? hi : lo;
}

static void check_bf16(uint32_t bits, void *ctx)
{
    float x = td_f32_from_bits(bits);
    uint16_t got = td_bf16_from_f32(x), want = bf16_reference(x);
    if (got != want) {
        (*(long *)ctx)++;
        if (*(long *)ctx < 5) print_message("bf16(0x%08x) = 0x%04x, want 0x%04x\n", bits, got, want);
    }
}

static void test_bf16_round_to_nearest_even(void **state)
{
    long bad = 0;
    visit_patterns(check_bf16, &bad);
    assert_int_equal(bad, 0);
    /* Named cases. */
    assert_int_equal(td_bf16_from_f32(1.0f), 0x3f80);
    assert_int_equal(td_bf16_from_f32(td_f32_from_bits(0x3f808000)), 0x3f80); /* tie, even below */
    assert_int_equal(td_bf16_from_f32(td_f32_from_bits(0x3f818000)), 0x3f82); /* tie, even above */
    assert_int_equal(td_bf16_from_f32(td_f32_from_bits(0x3f808001)), 0x3f81);
    assert_int_equal(td_bf16_from_f32(INFINITY), 0x7f80);
    assert_int_equal(td_bf16_from_f32(-INFINITY), 0xff80);
    assert_int_equal(td_bf16_from_f32(td_f32_from_bits(0x7f7fffff)), 0x7f80); /* FLT_MAX rounds to Inf */
    assert_int_equal(td_bf16_from_f32(-0.0f), 0x8000);
    assert_int_equal(td_bf16_from_f32(td_f32_from_bits(0x00000001)), 0x0000); /* smallest subnormal */
    assert_int_equal(td_bf16_from_f32(td_f32_from_bits(0x00018000)), 0x0002); /* subnormal tie to even */
    /* NaN stays NaN: signalling with a low payload, quiet, negative. */
    assert_int_equal(td_bf16_from_f32(td_f32_from_bits(0x7f800001)), 0x7fc0);
    assert_int_equal(td_bf16_from_f32(td_f32_from_bits(0x7fc00000)), 0x7fc0);
    assert_int_equal(td_bf16_from_f32(td_f32_from_bits(0xffa00000)), 0xffe0);
    for (uint32_t h = 0; h < 65536; h++) /* every bf16 survives a round trip */
        if (((h >> 7) & 0xff) != 0xff || !(h & 0x7f)) assert_int_equal(td_bf16_from_f32(td_f32_from_bf16((uint16_t)h)), h);
}

/* ---- fp16 ------------------------------------------------------------------- */

/* The value of the nearest fp16 (RNE), in double; Inf past the range. */
static double f16_reference_value(float x)
{
    double d = fabs((double)x), r;
    if (d >= 65520.0) return copysign(INFINITY, x);
    if (d < ldexp(1.0, -14)) {
        r = nearbyint(d * ldexp(1.0, 24)) * ldexp(1.0, -24); /* subnormal grid */
    } else {
        int e;
        frexp(d, &e); /* d = f * 2^e, f in [0.5, 1) */
        double ulp = ldexp(1.0, e - 11);
        r = nearbyint(d / ulp) * ulp;
    }
    return copysign(r, x);
}

static void check_f16(uint32_t bits, void *ctx)
{
    float x = td_f32_from_bits(bits);
    uint16_t h = td_f16_from_f32(x);
    int bad;
    if (isnan(x))
        bad = h != (uint16_t)(((bits >> 16) & 0x8000) | 0x7e00 | ((bits >> 13) & 0x3ff));
    else
        bad = (double)td_f32_from_f16(h) != f16_reference_value(x) || (h >> 15) != (bits >> 31);
    if (bad) {
        (*(long *)ctx)++;
        if (*(long *)ctx < 5) print_message("f16(0x%08x) = 0x%04x\n", bits, h);
    }
}

static void test_f16_round_to_nearest_even(void **state)
{
    long bad = 0;
    visit_patterns(check_f16, &bad);
    assert_int_equal(bad, 0);
    assert_int_equal(td_f16_from_f32(1.0f), 0x3c00);
    assert_int_equal(td_f16_from_f32(65504.0f), 0x7bff);
    assert_int_equal(td_f16_from_f32(65519.996f), 0x7bff);
    assert_int_equal(td_f16_from_f32(65520.0f), 0x7c00);
    assert_int_equal(td_f16_from_f32(ldexpf(1.0f, -24)), 0x0001);
    assert_int_equal(td_f16_from_f32(ldexpf(1.0f, -25)), 0x0000);               /* tie to even (0) */
    assert_int_equal(td_f16_from_f32(ldexpf(3.0f, -25)), 0x0002);               /* tie to even (2) */
    assert_int_equal(td_f16_from_f32(ldexpf(1023.5f, -24)), 0x0400);            /* carries into normal */
    assert_int_equal(td_f16_from_f32(-INFINITY), 0xfc00);
    /* fp16 -> fp32 is exact for every value, and round-trips. */
    for (uint32_t h = 0; h < 65536; h++) {
        float x = td_f32_from_f16((uint16_t)h);
        uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
        if (e == 0x1f && m) {
            assert_true(isnan(x));
            continue;
        }
        double want = e == 0 ? ldexp((double)m, -24) : e == 0x1f ? INFINITY : ldexp(1024.0 + m, (int)e - 25);
        assert_true((double)x == (h & 0x8000 ? -want : want));
        assert_int_equal(td_f16_from_f32(x), h);
    }
}

/* ---- agreement with F16C -------------------------------------------------------- */

__attribute__((target("f16c"))) static uint16_t hw_f16(float x)
{
    return (uint16_t)_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), 0);
}

__attribute__((target("f16c"))) static uint32_t hw_f32(uint16_t h)
{
    return td_f32_bits(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h))));
}

static void check_hw(uint32_t bits, void *ctx)
{
    float x = td_f32_from_bits(bits);
    if (hw_f16(x) != td_f16_from_f32(x)) {
        (*(long *)ctx)++;
        if (*(long *)ctx < 5) print_message("F16C(0x%08x) = 0x%04x, software 0x%04x\n", bits, hw_f16(x), td_f16_from_f32(x));
    }
}

static void test_f16_matches_f16c(void **state)
{
    if (!td_optim_isa_supported(TD_OPTIM_ISA_AVX2)) td_test_skip("needs CPU flag f16c (with avx2 and fma)");
    long bad = 0;
    visit_patterns(check_hw, &bad);
    assert_int_equal(bad, 0);
    for (uint32_t h = 0; h < 65536; h++) assert_int_equal(hw_f32((uint16_t)h), td_f32_bits(td_f32_from_f16((uint16_t)h)));
}

/* ---- the kernels' conversions ------------------------------------------------------ */

/* An identity step (no grad, no decay, zero step size) copies master into
 * param_out through each kernel's own store path; the result must be the
 * scalar conversion, bit for bit, for specials too.  Loads of fp16/bf16 are
 * checked through the sum of squares of one element. */
static void test_kernel_conversions_match_scalar(void **state)
{
    enum { N = 4099 };
    float *master = malloc(N * 4), *m = calloc(N, 4), *v = calloc(N, 4), *g = calloc(N, 4);
    uint16_t *out = malloc(N * 2);
    td_rng rng;
    td_rng_seed(&rng, 7);
    static const uint32_t specials[] = {0x7f800000, 0xff800000, 0x7fc00000, 0xffc00001, 0x7fd12345, 0x7f7fffff,
                                        0x477ff000, 0x477fefff, 0x00000001, 0x80000000, 0x3f808000, 0x3f818000,
                                        0x387fc000, 0x33000000, 0x33000001, 0xc77ff000};
    td_adam_coeffs c = {.grad_mul = 0, .l2 = 0, .decay_mul = 1, .beta1 = 0, .one_minus_beta1 = 0, .beta2 = 0,
                        .one_minus_beta2 = 0, .step_size = 0, .rsqrt_bc2 = 1, .eps = 1};
    for (int isa = TD_OPTIM_ISA_SCALAR; isa < TD_OPTIM_ISA_COUNT; isa++) {
        if (!td_optim_isa_supported((td_optim_isa)isa)) continue;
        for (int dt = TD_DTYPE_BF16; dt <= TD_DTYPE_F16; dt++) {
            for (int i = 0; i < N; i++) {
                uint32_t b = i < 16 ? specials[i] : (uint32_t)td_rng_next(&rng);
                if ((b & 0x7f800000) == 0x7f800000 && (b & 0x7fffff)) b |= 0x400000; /* quiet: the multiply quiets */
                master[i] = td_f32_from_bits(b);
            }
            memset(m, 0, N * 4);
            memset(v, 0, N * 4);
            td_adam_chunk ch = {master, m, v, g, TD_DTYPE_F32, out, (td_dtype)dt, N, TD_OPTIM_STATE_FP32, NULL, 0};
            float before[N];
            memcpy(before, master, sizeof before);
            td_adam_update_range((td_optim_isa)isa, &c, &ch, 0, N);
            for (int i = 0; i < N; i++) {
                uint16_t want = dt == TD_DTYPE_BF16 ? td_bf16_from_f32(before[i]) : td_f16_from_f32(before[i]);
                if (out[i] != want)
                    fail_msg("%s %s: element %d 0x%08x -> 0x%04x, want 0x%04x", td_optim_isa_name(isa),
                             td_dtype_name(dt), i, td_f32_bits(before[i]), out[i], want);
            }
        }
        for (uint32_t h = 0; h < 65536; h++)
            for (int dt = TD_DTYPE_BF16; dt <= TD_DTYPE_F16; dt++) {
                uint16_t hh = (uint16_t)h;
                float x = dt == TD_DTYPE_BF16 ? td_f32_from_bf16(hh) : td_f32_from_f16(hh);
                double s = td_grad_sumsq_range((td_optim_isa)isa, &hh, (td_dtype)dt, 0, 1);
                if (isnan(x)) assert_true(isnan(s));
                else assert_true(s == (double)x * (double)x);
            }
    }
    free(master), free(m), free(v), free(g), free(out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bf16_round_to_nearest_even),
        cmocka_unit_test(test_f16_round_to_nearest_even),
        cmocka_unit_test(test_f16_matches_f16c),
        cmocka_unit_test(test_kernel_conversions_match_scalar),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
