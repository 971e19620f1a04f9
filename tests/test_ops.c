/* CPU reference ops (include/tidal/ops.h): forward values against hand-computed
 * cases and naive loops, backward against central finite differences, and
 * bit-identical results for any OpenMP thread count and any matmul ISA.
 *
 * Finite differences: the scalar checked is L = sum_i w_i out_i (w random),
 * accumulated in double, so dL/dout = w is what each backward is fed.  The
 * numeric derivative divides by the step actually taken in fp32,
 * (float)(x+h) - (float)(x-h), not 2h.  A coordinate fails when
 * |numeric - analytic| > atol + rtol * max(|numeric|, |analytic|); each op has
 * its own step and tolerances (set a few times above the errors seen). */
#include "td_test.h"
#include "tidal/ops.h"
#include "../model/ops_internal.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* --- helpers -------------------------------------------------------------- */

static float *fvec(size_t n) { float *p = calloc(n ? n : 1, sizeof(float)); assert_non_null(p); return p; }

static float *frand(td_rng *rng, size_t n, float scale)
{
    float *p = fvec(n);
    for (size_t i = 0; i < n; i++) p[i] = scale * (float)(2.0 * td_rng_uniform(rng) - 1.0);
    return p;
}

static float *fcopy(const float *src, size_t n)
{
    float *p = fvec(n);
    memcpy(p, src, n * sizeof(float));
    return p;
}

static double wsum(const float *out, const float *w, size_t n)
{
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += (double)w[i] * out[i];
    return s;
}

static void assert_bits_equal(const float *a, const float *b, size_t n, const char *what)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(float)) != 0)
            fail_msg("%s differs at %zu: %.9g vs %.9g", what, i, a[i], b[i]);
}

typedef double (*loss_fn)(void *ctx);

typedef struct fd_tol { float h; double atol, rtol; int samples; } fd_tol;

/* Compares grad against central differences of f over x, at `samples`
 * coordinates (all of them if x is that small). */
static void fd_check(const char *what, float *x, const float *grad, size_t n, loss_fn f,
                     void *ctx, fd_tol tol, td_rng *rng)
{
    double worst = 0.0, worst_rel = 0.0;
    const size_t count = n <= (size_t)tol.samples ? n : (size_t)tol.samples;
    for (size_t s = 0; s < count; s++) {
        const size_t i = n <= (size_t)tol.samples ? s : td_rng_below(rng, n);
        const float saved = x[i];
        const float up = saved + tol.h, down = saved - tol.h;
        x[i] = up;
        const double lp = f(ctx);
        x[i] = down;
        const double lm = f(ctx);
        x[i] = saved;
        const double num = (lp - lm) / ((double)up - (double)down);
        const double ana = grad[i];
        const double err = fabs(num - ana), mag = fmax(fabs(num), fabs(ana));
        if (err > worst) worst = err;
        if (mag > 0 && err / mag > worst_rel) worst_rel = err / mag;
        if (err > tol.atol + tol.rtol * mag)
            fail_msg("%s[%zu]: numeric %.8g, analytic %.8g (|diff| %.3g > %.3g + %.3g * %.3g)",
                     what, i, num, ana, err, tol.atol, tol.rtol, mag);
    }
    printf("  fd %-22s %4zu coords, max |diff| %.2e, max rel %.2e\n", what, count, worst, worst_rel);
}

/* Runs fn(ctx) with 1, 2 and 3 threads (3 > cores: a different split) and
 * checks that the n floats at out come out bit-identical each time. */
static void check_thread_invariance(const char *what, void (*fn)(void *), void *ctx,
                                    float *out, size_t n)
{
    const int saved = omp_get_max_threads();
    float *first = NULL;
    for (int threads = 1; threads <= 3; threads++) {
        omp_set_num_threads(threads);
        fn(ctx);
        if (!first) first = fcopy(out, n);
        else assert_bits_equal(first, out, n, what);
    }
    omp_set_num_threads(saved);
    free(first);
}

/* --- matmul --------------------------------------------------------------- */

/* The naive loops, in the order the contract fixes (k ascending). */
static void naive_matmul_forward(float *out, const float *inp, const float *w, const float *bias,
                                 int N, int C, int OC)
{
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++) {
            float s = bias ? bias[o] : 0.0f;
            for (int c = 0; c < C; c++) s += inp[(size_t)n * C + c] * w[(size_t)o * C + c];
            out[(size_t)n * OC + o] = s;
        }
}

static void naive_matmul_backward(float *dinp, float *dw, float *db, const float *dout,
                                  const float *inp, const float *w, int N, int C, int OC)
{
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++) {
            float s = dinp[(size_t)n * C + c];
            for (int o = 0; o < OC; o++) s += dout[(size_t)n * OC + o] * w[(size_t)o * C + c];
            dinp[(size_t)n * C + c] = s;
        }
    for (int o = 0; o < OC; o++)
        for (int c = 0; c < C; c++) {
            float s = dw[(size_t)o * C + c];
            for (int n = 0; n < N; n++) s += dout[(size_t)n * OC + o] * inp[(size_t)n * C + c];
            dw[(size_t)o * C + c] = s;
        }
    for (int o = 0; o < OC; o++) {
        float s = db[o];
        for (int n = 0; n < N; n++) s += dout[(size_t)n * OC + o];
        db[o] = s;
    }
}

/* Every ISA variant the CPU runs equals the naive loops bit for bit, on shapes
 * with full tiles, edge tiles, several k blocks (K > 256) and tiny sizes. */
static void test_matmul_equals_naive_loops(void **state)
{
    static const int shapes[][3] = {
        {1, 1, 1}, {3, 5, 7}, {64, 64, 64}, {37, 300, 71}, {130, 24, 520}, {257, 96, 40}, {8, 513, 33},
    };
    td_rng rng;
    td_rng_seed(&rng, 11);
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int N = shapes[s][0], C = shapes[s][1], OC = shapes[s][2];
        float *inp = frand(&rng, (size_t)N * C, 1), *w = frand(&rng, (size_t)OC * C, 1);
        float *bias = frand(&rng, OC, 1), *dout = frand(&rng, (size_t)N * OC, 1);
        float *dinp0 = frand(&rng, (size_t)N * C, 1), *dw0 = frand(&rng, (size_t)OC * C, 1);
        float *db0 = frand(&rng, OC, 1);
        float *ref = fvec((size_t)N * OC), *ref_dinp = fcopy(dinp0, (size_t)N * C);
        float *ref_dw = fcopy(dw0, (size_t)OC * C), *ref_db = fcopy(db0, OC);
        naive_matmul_forward(ref, inp, w, bias, N, C, OC);
        naive_matmul_backward(ref_dinp, ref_dw, ref_db, dout, inp, w, N, C, OC);

        float *out = fvec((size_t)N * OC), *dinp = fcopy(dinp0, (size_t)N * C);
        float *dw = fcopy(dw0, (size_t)OC * C), *db = fcopy(db0, OC);
        td_ops_matmul_forward(out, inp, w, bias, N, C, OC);
        td_ops_matmul_backward(dinp, dw, db, dout, inp, w, N, C, OC);
        assert_bits_equal(ref, out, (size_t)N * OC, "matmul out");
        assert_bits_equal(ref_dinp, dinp, (size_t)N * C, "matmul dinp");
        assert_bits_equal(ref_dw, dw, (size_t)OC * C, "matmul dweight");
        assert_bits_equal(ref_db, db, OC, "matmul dbias");

        for (int isa = 0; isa < TD_OPS_ISA_COUNT; isa++) {
            if (!td_ops_isa_supported((td_ops_isa)isa)) continue;
            td_ops_gemm_fn *gemm = td_ops_gemm_get((td_ops_isa)isa);
            assert_non_null(gemm);
            /* forward through this variant: out = bias, then += inp @ w^T */
            for (int n = 0; n < N; n++) memcpy(out + (size_t)n * OC, bias, OC * sizeof(float));
            gemm(N, OC, C, out, OC, inp, C, 1, w, 1, C);
            assert_bits_equal(ref, out, (size_t)N * OC, td_ops_isa_name((td_ops_isa)isa));
            memcpy(dw, dw0, (size_t)OC * C * sizeof(float));
            gemm(OC, C, N, dw, C, dout, 1, OC, inp, C, 1);
            assert_bits_equal(ref_dw, dw, (size_t)OC * C, td_ops_isa_name((td_ops_isa)isa));
        }
        /* no bias: starts at zero */
        naive_matmul_forward(ref, inp, w, NULL, N, C, OC);
        td_ops_matmul_forward(out, inp, w, NULL, N, C, OC);
        assert_bits_equal(ref, out, (size_t)N * OC, "matmul out without bias");

        free(inp); free(w); free(bias); free(dout); free(dinp0); free(dw0); free(db0);
        free(ref); free(ref_dinp); free(ref_dw); free(ref_db); free(out); free(dinp); free(dw); free(db);
    }
    printf("  matmul ISA here: %s\n", td_ops_matmul_isa());
}

typedef struct mm_ctx { float *inp, *w, *bias, *out, *wt; int N, C, OC; } mm_ctx;

static double mm_loss(void *p)
{
    mm_ctx *c = p;
    td_ops_matmul_forward(c->out, c->inp, c->w, c->bias, c->N, c->C, c->OC);
    return wsum(c->out, c->wt, (size_t)c->N * c->OC);
}

static void test_matmul_gradients(void **state)
{
    td_rng rng;
    td_rng_seed(&rng, 12);
    mm_ctx c = {.N = 6, .C = 20, .OC = 36};
    c.inp = frand(&rng, (size_t)c.N * c.C, 1);
    c.w = frand(&rng, (size_t)c.OC * c.C, 1);
    c.bias = frand(&rng, c.OC, 1);
    c.out = fvec((size_t)c.N * c.OC);
    c.wt = frand(&rng, (size_t)c.N * c.OC, 1);
    float *dinp = fvec((size_t)c.N * c.C), *dw = fvec((size_t)c.OC * c.C), *db = fvec(c.OC);
    td_ops_matmul_backward(dinp, dw, db, c.wt, c.inp, c.w, c.N, c.C, c.OC);
    const fd_tol tol = {1e-2f, 5e-4, 2e-3, 200};
    fd_check("matmul dinp", c.inp, dinp, (size_t)c.N * c.C, mm_loss, &c, tol, &rng);
    fd_check("matmul dweight", c.w, dw, (size_t)c.OC * c.C, mm_loss, &c, tol, &rng);
    fd_check("matmul dbias", c.bias, db, c.OC, mm_loss, &c, tol, &rng);
    free(c.inp); free(c.w); free(c.bias); free(c.out); free(c.wt); free(dinp); free(dw); free(db);
}

/* --- LayerNorm ------------------------------------------------------------ */

static void test_layernorm_forward_values(void **state)
{
    td_rng rng;
    td_rng_seed(&rng, 21);
    const int N = 7, C = 96;
    float *x = frand(&rng, (size_t)N * C, 3), *ones = fvec(C), *zeros = fvec(C);
    for (int c = 0; c < C; c++) { ones[c] = 1.0f; x[c] += 10.0f; } /* row 0 far from zero */
    float *out = fvec((size_t)N * C), *mean = fvec(N), *rstd = fvec(N);
    td_ops_layernorm_forward(out, mean, rstd, x, ones, zeros, N, C);
    for (int n = 0; n < N; n++) {
        double m = 0, v = 0, xm = 0, xv = 0;
        for (int c = 0; c < C; c++) { m += out[n * C + c]; xm += x[n * C + c]; }
        m /= C; xm /= C;
        for (int c = 0; c < C; c++) {
            v += (out[n * C + c] - m) * (out[n * C + c] - m);
            xv += (x[n * C + c] - xm) * (x[n * C + c] - xm);
        }
        v /= C; xv /= C;
        assert_true(fabs(m) < 1e-6);
        assert_true(fabs(v - xv / (xv + 1e-5)) < 1e-5); /* unit variance, but for eps */
        assert_true(fabs(mean[n] - xm) < 1e-5 * fmax(1, fabs(xm)));
        assert_true(fabs(rstd[n] - 1 / sqrt(xv + 1e-5)) < 1e-5 * rstd[n]);
    }
    /* weight and bias scale and shift the normalised row */
    float *w = frand(&rng, C, 2), *b = frand(&rng, C, 2), *out2 = fvec((size_t)N * C);
    td_ops_layernorm_forward(out2, mean, rstd, x, w, b, N, C);
    for (size_t i = 0; i < (size_t)N * C; i++)
        assert_true(fabsf(out2[i] - (out[i] * w[i % C] + b[i % C])) < 1e-5f);
    /* a constant row normalises to the bias (rstd = 1/sqrt(eps), no NaN) */
    for (int c = 0; c < C; c++) x[c] = 4.0f;
    td_ops_layernorm_forward(out2, mean, rstd, x, w, b, 1, C);
    for (int c = 0; c < C; c++) assert_true(out2[c] == b[c]);
    free(x); free(ones); free(zeros); free(out); free(mean); free(rstd); free(w); free(b); free(out2);
}

typedef struct ln_ctx { float *x, *w, *b, *out, *mean, *rstd, *wt; int N, C; } ln_ctx;

static double ln_loss(void *p)
{
    ln_ctx *c = p;
    td_ops_layernorm_forward(c->out, c->mean, c->rstd, c->x, c->w, c->b, c->N, c->C);
    return wsum(c->out, c->wt, (size_t)c->N * c->C);
}

static void test_layernorm_gradients(void **state)
{
    td_rng rng;
    td_rng_seed(&rng, 22);
    ln_ctx c = {.N = 5, .C = 40};
    const size_t n = (size_t)c.N * c.C;
    c.x = frand(&rng, n, 2);
    c.w = frand(&rng, c.C, 1);
    c.b = frand(&rng, c.C, 1);
    c.out = fvec(n); c.mean = fvec(c.N); c.rstd = fvec(c.N);
    c.wt = frand(&rng, n, 1);
    ln_loss(&c);
    float *dx = fvec(n), *dw = fvec(c.C), *db = fvec(c.C);
    td_ops_layernorm_backward(dx, dw, db, c.wt, c.x, c.w, c.mean, c.rstd, c.N, c.C);
    const fd_tol tol = {1e-2f, 3e-4, 3e-3, 200};
    fd_check("layernorm dinp", c.x, dx, n, ln_loss, &c, tol, &rng);
    fd_check("layernorm dweight", c.w, dw, c.C, ln_loss, &c, tol, &rng);
    fd_check("layernorm dbias", c.b, db, c.C, ln_loss, &c, tol, &rng);
    free(c.x); free(c.w); free(c.b); free(c.out); free(c.mean); free(c.rstd); free(c.wt);
    free(dx); free(dw); free(db);
}

/* --- embedding ------------------------------------------------------------ */

typedef struct enc_ctx { int *tok; float *wte, *wpe, *out, *wt; int B, T, C; } enc_ctx;

static double enc_loss(void *p)
{
    enc_ctx *c = p;
    td_ops_encoder_forward(c->out, c->tok, NULL, c->wte, c->wpe, c->B, c->T, c->C);
    return wsum(c->out, c->wt, (size_t)c->B * c->T * c->C);
}

static void test_encoder(void **state)
{
    td_rng rng;
    td_rng_seed(&rng, 31);
    enc_ctx c = {.B = 3, .T = 5, .C = 12};
    const int Vp = 9, maxT = 8;
    const size_t n = (size_t)c.B * c.T * c.C;
    int tok[15];
    for (int i = 0; i < 15; i++) tok[i] = (int)td_rng_below(&rng, 4); /* repeats: scatter-add */
    c.tok = tok;
    c.wte = frand(&rng, (size_t)Vp * c.C, 1);
    c.wpe = frand(&rng, (size_t)maxT * c.C, 1);
    c.out = fvec(n);
    c.wt = frand(&rng, n, 1);
    enc_loss(&c);
    for (int b = 0; b < c.B; b++)
        for (int t = 0; t < c.T; t++)
            for (int ch = 0; ch < c.C; ch++)
                assert_true(c.out[((size_t)b * c.T + t) * c.C + ch] ==
                            c.wte[(size_t)tok[b * c.T + t] * c.C + ch] + c.wpe[(size_t)t * c.C + ch]);
    float *dwte = fvec((size_t)Vp * c.C), *dwpe = fvec((size_t)maxT * c.C);
    td_ops_encoder_backward(dwte, dwpe, c.wt, tok, NULL, c.B, c.T, c.C);
    /* rows never used get no gradient */
    for (int ch = 0; ch < c.C; ch++) {
        for (int v = 4; v < Vp; v++) assert_true(dwte[(size_t)v * c.C + ch] == 0.0f);
        for (int t = c.T; t < maxT; t++) assert_true(dwpe[(size_t)t * c.C + ch] == 0.0f);
    }
    const fd_tol tol = {1e-2f, 3e-5, 1e-4, 400};
    fd_check("encoder dwte", c.wte, dwte, (size_t)Vp * c.C, enc_loss, &c, tol, &rng);
    fd_check("encoder dwpe", c.wpe, dwpe, (size_t)maxT * c.C, enc_loss, &c, tol, &rng);
    free(c.wte); free(c.wpe); free(c.out); free(c.wt); free(dwte); free(dwpe);
}

/* --- attention ------------------------------------------------------------ */

static void test_attention_forward_values(void **state)
{
    td_rng rng;
    td_rng_seed(&rng, 41);
    const int B = 2, C = 12, NH = 3, hs = C / NH;
    /* T = 1: the only weight is 1, the output is v, lse is the score. */
    {
        const int T = 1;
        float *qkv = frand(&rng, (size_t)B * T * 3 * C, 1);
        float *out = fvec((size_t)B * T * C), *lse = fvec((size_t)B * NH * T);
        td_ops_attention_forward(out, lse, qkv, B, T, C, NH);
        for (int b = 0; b < B; b++) {
            const float *row = qkv + (size_t)b * 3 * C;
            for (int c = 0; c < C; c++) assert_true(out[(size_t)b * C + c] == row[2 * C + c]);
            for (int h = 0; h < NH; h++) {
                double s = 0;
                for (int i = 0; i < hs; i++) s += (double)row[h * hs + i] * row[C + h * hs + i];
                assert_true(fabs(lse[b * NH + h] - s / sqrt(hs)) < 1e-6);
            }
        }
        free(qkv); free(out); free(lse);
    }
    /* Equal keys: uniform weights, out[t] = mean of v[0..t]; causal: later
     * tokens do not change earlier outputs. */
    {
        const int T = 6;
        float *qkv = frand(&rng, (size_t)B * T * 3 * C, 1);
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++)
                memcpy(qkv + ((size_t)b * T + t) * 3 * C + C, qkv + (size_t)b * T * 3 * C + C, C * sizeof(float));
        float *out = fvec((size_t)B * T * C), *lse = fvec((size_t)B * NH * T);
        td_ops_attention_forward(out, lse, qkv, B, T, C, NH);
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++)
                for (int c = 0; c < C; c++) {
                    double m = 0;
                    for (int t2 = 0; t2 <= t; t2++) m += qkv[((size_t)b * T + t2) * 3 * C + 2 * C + c];
                    assert_true(fabs(out[((size_t)b * T + t) * C + c] - m / (t + 1)) < 1e-6);
                }
        float *out2 = fvec((size_t)B * T * C);
        for (int c = 0; c < 3 * C; c++) qkv[((size_t)0 * T + T - 1) * 3 * C + c] += 5.0f; /* last token of b=0 */
        td_ops_attention_forward(out2, lse, qkv, B, T, C, NH);
        assert_memory_equal(out, out2, (size_t)(T - 1) * C * sizeof(float));
        free(qkv); free(out); free(out2); free(lse);
    }
}

typedef struct att_ctx { float *qkv, *out, *lse, *wt; int B, T, C, NH; } att_ctx;

static double att_loss(void *p)
{
    att_ctx *c = p;
    td_ops_attention_forward(c->out, c->lse, c->qkv, c->B, c->T, c->C, c->NH);
    return wsum(c->out, c->wt, (size_t)c->B * c->T * c->C);
}

static void test_attention_gradients(void **state)
{
    td_rng rng;
    td_rng_seed(&rng, 42);
    att_ctx c = {.B = 2, .T = 7, .C = 24, .NH = 3}; /* hs = 8 */
    const size_t nqkv = (size_t)c.B * c.T * 3 * c.C, nout = (size_t)c.B * c.T * c.C;
    c.qkv = frand(&rng, nqkv, 1.5f);
    c.out = fvec(nout);
    c.lse = fvec((size_t)c.B * c.NH * c.T);
    c.wt = frand(&rng, nout, 1);
    att_loss(&c);
    float *dqkv = fvec(nqkv);
    td_ops_attention_backward(dqkv, c.wt, c.qkv, c.out, c.lse, c.B, c.T, c.C, c.NH);
    const fd_tol tol = {1e-2f, 2e-4, 3e-3, 400};
    fd_check("attention dqkv", c.qkv, dqkv, nqkv, att_loss, &c, tol, &rng);
    free(c.qkv); free(c.out); free(c.lse); free(c.wt); free(dqkv);
}

/* Straightforward attention in double: scores, softmax, weighted values, and
 * the textbook backward through the stored weights. */
static void naive_attention(double *out, double *dqkv, const float *qkv, const float *dout, int B,
                            int T, int C, int NH)
{
    const int hs = C / NH;
    const double scale = 1.0 / sqrt(hs);
    double *p = malloc((size_t)T * sizeof(double)), *dp = malloc((size_t)T * sizeof(double));
#define Q(b, t, i) qkv[((size_t)(b) * T + (t)) * 3 * C + (i)]
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                double mx = -INFINITY, sum = 0, pdp = 0;
                for (int t2 = 0; t2 <= t; t2++) {
                    p[t2] = 0;
                    for (int i = 0; i < hs; i++) p[t2] += (double)Q(b, t, h * hs + i) * Q(b, t2, C + h * hs + i);
                    p[t2] *= scale;
                    mx = fmax(mx, p[t2]);
                }
                for (int t2 = 0; t2 <= t; t2++) { p[t2] = exp(p[t2] - mx); sum += p[t2]; }
                const float *d = dout + ((size_t)b * T + t) * C + h * hs;
                for (int i = 0; i < hs; i++) out[((size_t)b * T + t) * C + h * hs + i] = 0;
                for (int t2 = 0; t2 <= t; t2++) {
                    p[t2] /= sum;
                    dp[t2] = 0;
                    for (int i = 0; i < hs; i++) {
                        out[((size_t)b * T + t) * C + h * hs + i] += p[t2] * Q(b, t2, 2 * C + h * hs + i);
                        dp[t2] += (double)d[i] * Q(b, t2, 2 * C + h * hs + i);
                        dqkv[((size_t)b * T + t2) * 3 * C + 2 * C + h * hs + i] += p[t2] * d[i];
                    }
                    pdp += p[t2] * dp[t2];
                }
                for (int t2 = 0; t2 <= t; t2++) {
                    const double ds = p[t2] * (dp[t2] - pdp) * scale;
                    for (int i = 0; i < hs; i++) {
                        dqkv[((size_t)b * T + t) * 3 * C + h * hs + i] += ds * Q(b, t2, C + h * hs + i);
                        dqkv[((size_t)b * T + t2) * 3 * C + C + h * hs + i] += ds * Q(b, t, h * hs + i);
                    }
                }
            }
#undef Q
    free(p);
    free(dp);
}

/* Sequences of several query and key tiles (tiles are 64), a partial last tile. */
static void test_attention_matches_naive_across_tiles(void **state)
{
    td_rng rng;
    td_rng_seed(&rng, 43);
    const int B = 2, T = 150, C = 32, NH = 2;
    const size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C;
    float *qkv = frand(&rng, nqkv, 2), *dout = frand(&rng, nout, 1);
    float *out = fvec(nout), *lse = fvec((size_t)B * NH * T), *dqkv = fvec(nqkv);
    double *ref = calloc(nout, sizeof(double)), *ref_d = calloc(nqkv, sizeof(double));
    td_ops_attention_forward(out, lse, qkv, B, T, C, NH);
    td_ops_attention_backward(dqkv, dout, qkv, out, lse, B, T, C, NH);
    naive_attention(ref, ref_d, qkv, dout, B, T, C, NH);
    double worst = 0, worst_d = 0;
    for (size_t i = 0; i < nout; i++) worst = fmax(worst, fabs(out[i] - ref[i]));
    for (size_t i = 0; i < nqkv; i++) worst_d = fmax(worst_d, fabs(dqkv[i] - ref_d[i]) / (1 + fabs(ref_d[i])));
    printf("  attention vs double reference: out %.2e, dqkv %.2e\n", worst, worst_d);
    assert_true(worst < 1e-5);
    assert_true(worst_d < 1e-5);
    free(qkv); free(dout); free(out); free(lse); free(dqkv); free(ref); free(ref_d);
}

/* --- pointwise ------------------------------------------------------------ */

static void test_gelu(void **state)
{
    /* hand values of 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
    const float x[] = {0.0f, 1.0f, -1.0f, 2.0f, 10.0f, -10.0f};
    const double want[] = {0.0, 0.8411919906082768, -0.15880800939172324, 1.9545976940871754, 10.0, 0.0};
    float out[6];
    td_ops_gelu_forward(out, x, 6);
    for (int i = 0; i < 6; i++) assert_true(fabs(out[i] - want[i]) < 2e-6);

    td_rng rng;
    td_rng_seed(&rng, 51);
    const size_t n = 300;
    float *in = frand(&rng, n, 4), *o = fvec(n), *wt = frand(&rng, n, 1), *d = fvec(n);
    td_ops_gelu_backward(d, in, wt, n);
    /* elementwise: check each derivative by its own difference */
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        const float h = 1e-2f, up = in[i] + h, down = in[i] - h;
        float yp, ym;
        td_ops_gelu_forward(&yp, &up, 1);
        td_ops_gelu_forward(&ym, &down, 1);
        const double num = wt[i] * ((double)yp - ym) / ((double)up - down);
        worst = fmax(worst, fabs(num - d[i]));
        if (fabs(num - d[i]) > 2e-4 + 2e-3 * fabs(num))
            fail_msg("gelu'(%g): numeric %g analytic %g", in[i], num, d[i]);
    }
    printf("  fd %-22s %4zu coords, max |diff| %.2e\n", "gelu dinp", n, worst);
    free(in); free(o); free(wt); free(d);
}

static void test_residual(void **state)
{
    td_rng rng;
    td_rng_seed(&rng, 52);
    const size_t n = 1000;
    float *a = frand(&rng, n, 1), *b = frand(&rng, n, 1), *out = fvec(n), *dout = frand(&rng, n, 1);
    float *da = frand(&rng, n, 1), *db = frand(&rng, n, 1), *da0 = fcopy(da, n), *db0 = fcopy(db, n);
    td_ops_residual_forward(out, a, b, n);
    for (size_t i = 0; i < n; i++) assert_true(out[i] == a[i] + b[i]);
    td_ops_residual_forward(a, a, b, n); /* in place */
    assert_memory_equal(a, out, n * sizeof(float));
    td_ops_residual_backward(da, db, dout, n);
    for (size_t i = 0; i < n; i++) {
        assert_true(da[i] == da0[i] + dout[i]);
        assert_true(db[i] == db0[i] + dout[i]);
    }
    free(a); free(b); free(out); free(dout); free(da); free(db); free(da0); free(db0);
}

/* --- softmax and cross-entropy -------------------------------------------- */

static void test_softmax_and_crossentropy_values(void **state)
{
    td_rng rng;
    td_rng_seed(&rng, 61);
    const int N = 4, V = 37, Vp = 48;
    float *logits = frand(&rng, (size_t)N * Vp, 5), *probs = fvec((size_t)N * Vp);
    for (int n = 0; n < N; n++)
        for (int v = V; v < Vp; v++) logits[n * Vp + v] = 1e4f; /* padding must be ignored */
    td_ops_softmax_forward(probs, logits, N, V, Vp);
    for (int n = 0; n < N; n++) {
        double s = 0;
        for (int v = 0; v < V; v++) { assert_true(probs[n * Vp + v] > 0); s += probs[n * Vp + v]; }
        for (int v = V; v < Vp; v++) assert_true(probs[n * Vp + v] == 0.0f);
        assert_true(fabs(s - 1.0) < 1e-6);
    }
    /* uniform logits: loss log V; a negative target is ignored (loss 0) */
    float *flat = fvec((size_t)N * Vp), *losses = fvec(N), *lse = fvec(N);
    for (int n = 0; n < N; n++)
        for (int v = 0; v < Vp; v++) flat[n * Vp + v] = v < V ? 0.25f * (float)n : 1e4f;
    int targets[4] = {0, 36, TD_OPS_IGNORE_INDEX, 5};
    td_ops_crossentropy_forward(losses, lse, flat, targets, N, V, Vp);
    for (int n = 0; n < N; n++)
        if (n == 2) assert_true(losses[n] == 0.0f);
        else assert_true(fabs(losses[n] - log((double)V)) < 1e-6);
    /* the loss is -log of the softmax probability of the target */
    td_ops_crossentropy_forward(losses, lse, logits, targets, N, V, Vp);
    for (int n = 0; n < N; n++)
        if (targets[n] >= 0) assert_true(fabs(losses[n] + log(probs[n * Vp + targets[n]])) < 2e-5);
    /* backward: softmax - onehot, zero on ignored rows and padding, in place */
    float *d = fcopy(logits, (size_t)N * Vp);
    td_ops_crossentropy_backward(d, d, lse, targets, 0.5f, N, V, Vp);
    for (int n = 0; n < N; n++)
        for (int v = 0; v < Vp; v++) {
            const double want = n == 2 || v >= V ? 0.0 : 0.5 * (probs[n * Vp + v] - (v == targets[n]));
            assert_true(fabs(d[n * Vp + v] - want) < 1e-6);
        }
    free(logits); free(probs); free(flat); free(losses); free(lse); free(d);
}

typedef struct xe_ctx { float *logits, *losses, *lse; int *targets; int N, V, Vp; } xe_ctx;

static double xe_loss(void *p)
{
    xe_ctx *c = p;
    td_ops_crossentropy_forward(c->losses, c->lse, c->logits, c->targets, c->N, c->V, c->Vp);
    double s = 0;
    for (int n = 0; n < c->N; n++) s += c->losses[n];
    return 0.75 * s;
}

static void test_crossentropy_gradients(void **state)
{
    td_rng rng;
    td_rng_seed(&rng, 62);
    int targets[5] = {3, TD_OPS_IGNORE_INDEX, 0, 20, 20};
    xe_ctx c = {.N = 5, .V = 21, .Vp = 32, .targets = targets};
    const size_t n = (size_t)c.N * c.Vp;
    c.logits = frand(&rng, n, 3);
    c.losses = fvec(c.N);
    c.lse = fvec(c.N);
    xe_loss(&c);
    float *d = fvec(n);
    td_ops_crossentropy_backward(d, c.logits, c.lse, targets, 0.75f, c.N, c.V, c.Vp);
    const fd_tol tol = {1e-2f, 2e-4, 3e-3, 400};
    fd_check("crossentropy dlogits", c.logits, d, n, xe_loss, &c, tol, &rng); /* all, padding too */
    free(c.logits); free(c.losses); free(c.lse); free(d);
}

/* --- head ----------------------------------------------------------------- */

typedef struct head_ctx { float *x, *lw, *lb, *wte, *logits, *lnf, *mean, *rstd, *wt; int N, C, Vp; } head_ctx;

static double head_loss(void *p)
{
    head_ctx *c = p;
    td_ops_head_forward(c->logits, c->lnf, c->mean, c->rstd, c->x, c->lw, c->lb, c->wte, c->N, c->C, c->Vp);
    return wsum(c->logits, c->wt, (size_t)c->N * c->Vp);
}

static void test_head(void **state)
{
    td_rng rng;
    td_rng_seed(&rng, 71);
    head_ctx c = {.N = 4, .C = 16, .Vp = 24};
    const size_t nx = (size_t)c.N * c.C, nl = (size_t)c.N * c.Vp;
    c.x = frand(&rng, nx, 2);
    c.lw = frand(&rng, c.C, 1);
    c.lb = frand(&rng, c.C, 1);
    c.wte = frand(&rng, (size_t)c.Vp * c.C, 1);
    c.logits = fvec(nl); c.lnf = fvec(nx); c.mean = fvec(c.N); c.rstd = fvec(c.N);
    c.wt = frand(&rng, nl, 1);
    head_loss(&c);
    /* logits = LayerNorm(x) @ wte^T */
    float *ref = fvec(nl);
    naive_matmul_forward(ref, c.lnf, c.wte, NULL, c.N, c.C, c.Vp);
    assert_bits_equal(ref, c.logits, nl, "head logits");
    float *dx = fvec(nx), *dlw = fvec(c.C), *dlb = fvec(c.C), *dwte = fvec((size_t)c.Vp * c.C);
    float *scratch = fvec(nx);
    td_ops_head_backward(dx, dlw, dlb, dwte, scratch, c.wt, c.x, c.lnf, c.mean, c.rstd, c.lw, c.wte,
                         c.N, c.C, c.Vp);
    const fd_tol tol = {1e-2f, 1e-3, 5e-3, 200};
    fd_check("head dx", c.x, dx, nx, head_loss, &c, tol, &rng);
    fd_check("head dlnf_w", c.lw, dlw, c.C, head_loss, &c, tol, &rng);
    fd_check("head dlnf_b", c.lb, dlb, c.C, head_loss, &c, tol, &rng);
    fd_check("head dwte", c.wte, dwte, (size_t)c.Vp * c.C, head_loss, &c, tol, &rng);
    free(c.x); free(c.lw); free(c.lb); free(c.wte); free(c.logits); free(c.lnf); free(c.mean);
    free(c.rstd); free(c.wt); free(ref); free(dx); free(dlw); free(dlb); free(dwte); free(scratch);
}

/* --- determinism across thread counts ------------------------------------- */

/* Shapes big enough that every op splits its work (several GEMM tasks, several
 * channel blocks, several heads), with repeated tokens. */
typedef struct det_ctx {
    int B, T, C, NH, OC, Vp;
    int *tok;
    float *x, *w, *bias, *dout_mm, *qkv, *dout_c, *att_out, *lse, *lnw, *mean, *rstd, *wte, *wpe;
    float *grads; size_t n_grads; /* every gradient, one buffer, compared as a whole */
} det_ctx;

static void det_backwards(void *p)
{
    det_ctx *c = p;
    const int N = c->B * c->T;
    memset(c->grads, 0, c->n_grads * sizeof(float));
    float *g = c->grads;
    float *dx = g; g += (size_t)N * c->C;
    float *dw = g; g += (size_t)c->OC * c->C;
    float *db = g; g += c->OC;
    float *dqkv = g; g += (size_t)N * 3 * c->C;
    float *dln = g; g += (size_t)N * c->C;
    float *dlnw = g; g += c->C;
    float *dlnb = g; g += c->C;
    float *dwte = g; g += (size_t)c->Vp * c->C;
    float *dwpe = g; g += (size_t)c->T * c->C;
    float *fwd = g; /* forward outputs too */
    td_ops_matmul_backward(dx, dw, db, c->dout_mm, c->x, c->w, N, c->C, c->OC);
    td_ops_attention_backward(dqkv, c->dout_c, c->qkv, c->att_out, c->lse, c->B, c->T, c->C, c->NH);
    td_ops_layernorm_backward(dln, dlnw, dlnb, c->dout_c, c->x, c->lnw, c->mean, c->rstd, N, c->C);
    td_ops_encoder_backward(dwte, dwpe, c->dout_c, c->tok, NULL, c->B, c->T, c->C);
    td_ops_matmul_forward(fwd, c->x, c->w, c->bias, N, c->C, c->OC);
}

static void test_backward_bit_identical_across_threads(void **state)
{
    td_rng rng;
    td_rng_seed(&rng, 81);
    det_ctx c = {.B = 3, .T = 150, .C = 160, .NH = 5, .OC = 200, .Vp = 11};
    const int N = c.B * c.T;
    c.tok = malloc((size_t)N * sizeof(int));
    for (int i = 0; i < N; i++) c.tok[i] = (int)td_rng_below(&rng, 5);
    c.x = frand(&rng, (size_t)N * c.C, 1);
    c.w = frand(&rng, (size_t)c.OC * c.C, 1);
    c.bias = frand(&rng, c.OC, 1);
    c.dout_mm = frand(&rng, (size_t)N * c.OC, 1);
    c.qkv = frand(&rng, (size_t)N * 3 * c.C, 1);
    c.dout_c = frand(&rng, (size_t)N * c.C, 1);
    c.att_out = fvec((size_t)N * c.C);
    c.lse = fvec((size_t)c.B * c.NH * c.T);
    c.lnw = frand(&rng, c.C, 1);
    c.mean = fvec(N); c.rstd = fvec(N);
    float *ln_out = fvec((size_t)N * c.C);
    td_ops_attention_forward(c.att_out, c.lse, c.qkv, c.B, c.T, c.C, c.NH);
    td_ops_layernorm_forward(ln_out, c.mean, c.rstd, c.x, c.lnw, c.lnw, N, c.C);
    c.n_grads = (size_t)N * c.C * 2 + (size_t)c.OC * c.C + c.OC + (size_t)N * 3 * c.C + 2 * (size_t)c.C +
                (size_t)c.Vp * c.C + (size_t)c.T * c.C + (size_t)N * c.OC;
    c.grads = fvec(c.n_grads);
    check_thread_invariance("op gradients", det_backwards, &c, c.grads, c.n_grads);
    free(c.tok); free(c.x); free(c.w); free(c.bias); free(c.dout_mm); free(c.qkv); free(c.dout_c);
    free(c.att_out); free(c.lse); free(c.lnw); free(c.mean); free(c.rstd); free(ln_out); free(c.grads);
}

/* --- LLaMA-family ops ---------------------------------------------------------- */

/* GQA: the same as full multi-head attention on the key/value heads repeated
 * for each query head of their group (the double reference), dK and dV the
 * sums over the group; and the gradient against finite differences. */
typedef struct gqa_ctx { float *qkv, *out, *lse, *wt; int B, T, NH, NKV, hs; } gqa_ctx;

static double gqa_loss(void *p)
{
    gqa_ctx *c = p;
    td_ops_attention_gqa_forward(c->out, c->lse, c->qkv, NULL, c->B, c->T, c->NH, c->NKV, c->hs);
    return wsum(c->out, c->wt, (size_t)c->B * c->T * c->NH * c->hs);
}

typedef struct gqa_bits_ctx { float *d; const float *dout, *qkv, *out, *lse; size_t n; int B, T, NH, NKV, hs; } gqa_bits_ctx;

static void gqa_bits(void *p)
{
    gqa_bits_ctx *c = p;
    memset(c->d, 0, c->n * sizeof(float));
    td_ops_attention_gqa_backward(c->d, c->dout, c->qkv, c->out, c->lse, NULL, c->B, c->T, c->NH, c->NKV, c->hs);
}

static void test_gqa_attention(void **state)
{
    td_rng rng;
    td_rng_seed(&rng, 44);
    const int B = 2, T = 90, NH = 6, NKV = 2, hs = 16, C = NH * hs, KV = NKV * hs, R = C + 2 * KV, G = NH / NKV;
    const size_t nqkv = (size_t)B * T * R, nout = (size_t)B * T * C, nfull = (size_t)B * T * 3 * C;
    float *qkv = frand(&rng, nqkv, 2), *dout = frand(&rng, nout, 1), *out = fvec(nout);
    float *lse = fvec((size_t)B * NH * T), *dqkv = fvec(nqkv), *full = fvec(nfull);
    for (size_t r = 0; r < (size_t)B * T; r++) /* each query head with its own copy of its kv head */
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < hs; i++) {
                full[r * 3 * C + h * hs + i] = qkv[r * R + h * hs + i];
                full[r * 3 * C + C + h * hs + i] = qkv[r * R + C + (h / G) * hs + i];
                full[r * 3 * C + 2 * C + h * hs + i] = qkv[r * R + C + KV + (h / G) * hs + i];
            }
    double *ref = calloc(nout, sizeof(double)), *ref_full = calloc(nfull, sizeof(double));
    naive_attention(ref, ref_full, full, dout, B, T, C, NH);
    td_ops_attention_gqa_forward(out, lse, qkv, NULL, B, T, NH, NKV, hs);
    td_ops_attention_gqa_backward(dqkv, dout, qkv, out, lse, NULL, B, T, NH, NKV, hs);
    double worst = 0, worst_d = 0;
    for (size_t i = 0; i < nout; i++) worst = fmax(worst, fabs(out[i] - ref[i]));
    for (size_t r = 0; r < (size_t)B * T; r++)
        for (int i = 0; i < R; i++) {
            double want = 0;
            if (i < C) want = ref_full[r * 3 * C + i];
            else
                for (int h = 0; h < NH; h++) { /* a kv head's gradient sums its group's */
                    int kv = i < C + KV ? i - C : i - C - KV, base = i < C + KV ? C : 2 * C;
                    if (h / G == kv / hs) want += ref_full[r * 3 * C + base + h * hs + kv % hs];
                }
            worst_d = fmax(worst_d, fabs(dqkv[r * R + i] - want) / (1 + fabs(want)));
        }
    printf("  gqa attention (6 query heads, 2 kv heads) vs double reference: out %.2e, dqkv %.2e\n", worst, worst_d);
    assert_true(worst < 1e-5);
    assert_true(worst_d < 1e-5);
    /* Finite differences on a small case. */
    gqa_ctx g = {.B = 1, .T = 6, .NH = 4, .NKV = 2, .hs = 8};
    size_t gn = (size_t)g.B * g.T * (g.NH + 2 * g.NKV) * g.hs, go = (size_t)g.B * g.T * g.NH * g.hs;
    g.qkv = frand(&rng, gn, 1.5f);
    g.out = fvec(go);
    g.lse = fvec((size_t)g.B * g.NH * g.T);
    g.wt = frand(&rng, go, 1);
    gqa_loss(&g);
    float *gd = fvec(gn);
    td_ops_attention_gqa_backward(gd, g.wt, g.qkv, g.out, g.lse, NULL, g.B, g.T, g.NH, g.NKV, g.hs);
    fd_check("gqa attention dqkv", g.qkv, gd, gn, gqa_loss, &g, (fd_tol){1e-2f, 2e-4, 3e-3, 400}, &rng);
    gqa_bits_ctx bc = {.d = dqkv, .dout = dout, .qkv = qkv, .out = out, .lse = lse, .n = nqkv,
                       .B = B, .T = T, .NH = NH, .NKV = NKV, .hs = hs};
    check_thread_invariance("gqa attention dqkv", gqa_bits, &bc, dqkv, nqkv);
    free(g.qkv); free(g.out); free(g.lse); free(g.wt); free(gd);
    free(qkv); free(dout); free(out); free(lse); free(dqkv); free(full); free(ref); free(ref_full);
}

/* Packed rows: attention, RoPE and the position embedding with each row
 * holding several documents (pos restarting at 0) equal the same ops run on
 * each document alone (B = 1, T = its length, pos NULL): every output,
 * lse and gradient, within fp32 rounding (the tiles' sums fall
 * differently).  Document boundaries fall inside and at the edge of the
 * 64-query tiles; one row is a single document, one ends in a document of
 * length 1. */
static void random_docs(td_rng *rng, int *pos, int T, int row)
{
    static const int fixed[][6] = {{63, 1, 64, 2, 0, 0}, {150, 0, 0, 0, 0, 0}};
    int t = 0, d = 0;
    while (t < T) {
        int len = row < 2 && fixed[row][d] ? fixed[row][d] : 1 + (int)td_rng_below(rng, 40);
        d++;
        for (int i = 0; i < len && t < T; i++) pos[t++] = i;
    }
}

static void test_packed_attention_equals_documents_alone(void **state)
{
    td_rng rng;
    td_rng_seed(&rng, 39);
    const int B = 3, T = 150, NH = 4, NKV = 2, hs = 16, C = NH * hs, R = (NH + 2 * NKV) * hs;
    const size_t nqkv = (size_t)B * T * R, nout = (size_t)B * T * C;
    float *qkv = frand(&rng, nqkv, 2), *dout = frand(&rng, nout, 1), *out = fvec(nout), *lse = fvec((size_t)B * NH * T);
    float *dqkv = fvec(nqkv), *rot = fcopy(qkv, nqkv), *drot = frand(&rng, nqkv, 1), *drot_p = fcopy(drot, nqkv);
    int *pos = calloc((size_t)B * T, sizeof(int));
    for (int b = 0; b < B; b++) random_docs(&rng, pos + (size_t)b * T, T, b);
    float inv[8];
    td_ops_rope_inv_freq(inv, hs, 10000.0f, NULL);
    td_ops_rope_forward(rot, inv, pos, B, T, NH + NKV, hs, (size_t)R);
    td_ops_rope_backward(drot_p, inv, pos, B, T, NH + NKV, hs, (size_t)R);
    td_ops_attention_gqa_forward(out, lse, qkv, pos, B, T, NH, NKV, hs);
    td_ops_attention_gqa_backward(dqkv, dout, qkv, out, lse, pos, B, T, NH, NKV, hs);
    double worst = 0, worst_d = 0, worst_r = 0;
    int docs = 0;
    for (int b = 0; b < B; b++)
        for (int t0 = 0; t0 < T;) {
            int len = 1;
            while (t0 + len < T && pos[(size_t)b * T + t0 + len] != 0) len++;
            docs++;
            const size_t r0 = (size_t)b * T + t0;
            float *o1 = fvec((size_t)len * C), *l1 = fvec((size_t)NH * len), *d1 = fvec((size_t)len * R);
            float *rot1 = fcopy(qkv + r0 * R, (size_t)len * R), *drot1 = fcopy(drot + r0 * R, (size_t)len * R);
            td_ops_attention_gqa_forward(o1, l1, qkv + r0 * R, NULL, 1, len, NH, NKV, hs);
            td_ops_attention_gqa_backward(d1, dout + r0 * C, qkv + r0 * R, o1, l1, NULL, 1, len, NH, NKV, hs);
            td_ops_rope_forward(rot1, inv, NULL, 1, len, NH + NKV, hs, (size_t)R);
            td_ops_rope_backward(drot1, inv, NULL, 1, len, NH + NKV, hs, (size_t)R);
            for (size_t i = 0; i < (size_t)len * C; i++) worst = fmax(worst, fabs(out[r0 * C + i] - o1[i]));
            for (int h = 0; h < NH; h++)
                for (int i = 0; i < len; i++)
                    worst = fmax(worst, fabs(lse[((size_t)b * NH + h) * T + t0 + i] - l1[(size_t)h * len + i]));
            for (size_t i = 0; i < (size_t)len * R; i++) {
                worst_d = fmax(worst_d, fabs(dqkv[r0 * R + i] - d1[i]) / (1 + fabs(d1[i])));
                worst_r = fmax(worst_r, fabs(rot[r0 * R + i] - rot1[i]) + fabs(drot_p[r0 * R + i] - drot1[i]));
            }
            free(o1); free(l1); free(d1); free(rot1); free(drot1);
            t0 += len;
        }
    printf("  packed attention vs %d documents alone: out/lse %.2e, dqkv %.2e, rope %.2e\n", docs, worst, worst_d,
           worst_r);
    assert_true(docs > 10);
    assert_true(worst < 1e-5);
    assert_true(worst_d < 1e-5);
    assert_true(worst_r == 0); /* the same angle, the same arithmetic */
    /* the position embedding reads and writes row pos[t] of wpe */
    const int Cc = 8, V = 5;
    int tok[6] = {1, 2, 3, 4, 0, 1}, p6[6] = {0, 1, 2, 0, 1, 0};
    float *wte = frand(&rng, (size_t)V * Cc, 1), *wpe = frand(&rng, 3 * (size_t)Cc, 1), *e = fvec(6 * (size_t)Cc);
    float *g = frand(&rng, 6 * (size_t)Cc, 1), *dwte = fvec((size_t)V * Cc), *dwpe = fvec(3 * (size_t)Cc);
    td_ops_encoder_forward(e, tok, p6, wte, wpe, 1, 6, Cc);
    td_ops_encoder_backward(dwte, dwpe, g, tok, p6, 1, 6, Cc);
    for (int t = 0; t < 6; t++)
        for (int c = 0; c < Cc; c++) assert_true(e[t * Cc + c] == wte[tok[t] * Cc + c] + wpe[p6[t] * Cc + c]);
    for (int c = 0; c < Cc; c++) {
        assert_true(fabsf(dwpe[c] - (g[c] + g[3 * Cc + c] + g[5 * Cc + c])) < 1e-6f);
        assert_true(fabsf(dwpe[Cc + c] - (g[Cc + c] + g[4 * Cc + c])) < 1e-6f);
        assert_true(fabsf(dwpe[2 * Cc + c] - g[2 * Cc + c]) < 1e-6f);
    }
    free(wte); free(wpe); free(e); free(g); free(dwte); free(dwpe);
    free(qkv); free(dout); free(out); free(lse); free(dqkv); free(rot); free(drot); free(drot_p); free(pos);
}

typedef struct rms_ctx { float *x, *w, *out, *rstd, *wt; float off; int N, C; } rms_ctx;

static double rms_loss(void *p)
{
    rms_ctx *c = p;
    td_ops_rmsnorm_forward(c->out, c->rstd, c->x, c->w, c->off, c->N, c->C, 1e-5f);
    return wsum(c->out, c->wt, (size_t)c->N * c->C);
}

/* RMSNorm with the gain w (LLaMA) and 1 + w (Gemma): values against the
 * definition in double, gradients against finite differences. */
static void test_rmsnorm(void **state)
{
    for (int k = 0; k < 2; k++) {
        td_rng rng;
        td_rng_seed(&rng, 45);
        rms_ctx c = {.N = 5, .C = 37, .off = (float)k};
        size_t n = (size_t)c.N * c.C;
        c.x = frand(&rng, n, 2);
        c.w = frand(&rng, c.C, 1);
        c.out = fvec(n);
        c.rstd = fvec(c.N);
        c.wt = frand(&rng, n, 1);
        rms_loss(&c);
        for (int r = 0; r < c.N; r++) { /* against the definition in double */
            double ss = 0;
            for (int i = 0; i < c.C; i++) ss += (double)c.x[r * c.C + i] * c.x[r * c.C + i];
            double rs = 1 / sqrt(ss / c.C + 1e-5);
            assert_true(fabs(c.rstd[r] - rs) <= 1e-6 * rs);
            for (int i = 0; i < c.C; i++)
                assert_true(fabs(c.out[r * c.C + i] - (k + c.w[i]) * c.x[r * c.C + i] * rs) <= 1e-5);
        }
        float *dx = fvec(n), *dw = fvec(c.C);
        td_ops_rmsnorm_backward(dx, dw, c.wt, c.x, c.w, c.off, c.rstd, c.N, c.C);
        const fd_tol tol = {1e-2f, 3e-4, 3e-3, 200};
        fd_check(k ? "rmsnorm (1 + w) dinp" : "rmsnorm dinp", c.x, dx, n, rms_loss, &c, tol, &rng);
        fd_check(k ? "rmsnorm (1 + w) dweight" : "rmsnorm dweight", c.w, dw, c.C, rms_loss, &c, tol, &rng);
        free(c.x); free(c.w); free(c.out); free(c.rstd); free(c.wt); free(dx); free(dw);
    }
}

typedef struct glu_ctx { float *gu, *out, *wt; int N, H; td_ops_glu act; } glu_ctx;

static double glu_loss(void *p)
{
    glu_ctx *c = p;
    td_ops_glu_forward(c->out, c->gu, c->N, c->H, c->act);
    return wsum(c->out, c->wt, (size_t)c->N * c->H);
}

/* SwiGLU and GeGLU (tanh GELU): values against the definitions in double,
 * gradients against finite differences. */
static void test_glu(void **state)
{
    for (int k = 0; k < 2; k++) {
        td_rng rng;
        td_rng_seed(&rng, 46);
        glu_ctx c = {.N = 4, .H = 19, .act = k ? TD_OPS_GLU_GELU_TANH : TD_OPS_GLU_SILU};
        size_t n2 = (size_t)c.N * 2 * c.H, n = (size_t)c.N * c.H;
        c.gu = frand(&rng, n2, 4);
        c.out = fvec(n);
        c.wt = frand(&rng, n, 1);
        glu_loss(&c);
        for (int r = 0; r < c.N; r++)
            for (int i = 0; i < c.H; i++) {
                double g = c.gu[r * 2 * c.H + i], u = c.gu[r * 2 * c.H + c.H + i];
                double a = k ? 0.5 * g * (1 + tanh(sqrt(2 / M_PI) * (g + 0.044715 * g * g * g))) : g / (1 + exp(-g));
                assert_true(fabs(c.out[r * c.H + i] - a * u) <= 1e-5 * (1 + fabs(g * u)));
            }
        float *d = fvec(n2);
        td_ops_glu_backward(d, c.wt, c.gu, c.N, c.H, c.act);
        fd_check(k ? "geglu dgate_up" : "swiglu dgate_up", c.gu, d, n2, glu_loss, &c, (fd_tol){1e-2f, 3e-4, 3e-3, 200},
                 &rng);
        free(c.gu); free(c.out); free(c.wt); free(d);
    }
}

static void test_scale(void **state)
{
    float x[5] = {1.5f, -2.0f, 0.0f, 3.25f, -0.5f}, y[5];
    td_ops_scale(y, x, 45.25f, 5);
    for (int i = 0; i < 5; i++) assert_true(y[i] == x[i] * 45.25f);
    td_ops_scale(x, x, 2.0f, 5); /* in place */
    assert_true(x[0] == 3.0f && x[3] == 6.5f);
}

typedef struct rope_ctx { float *x, *y, *inv, *wt; int B, T, heads, hs; size_t stride; } rope_ctx;

static double rope_loss(void *p)
{
    rope_ctx *c = p;
    size_t n = (size_t)c->B * c->T * c->stride;
    memcpy(c->y, c->x, n * sizeof(float));
    td_ops_rope_forward(c->y, c->inv, NULL, c->B, c->T, c->heads, c->hs, c->stride);
    return wsum(c->y, c->wt, n);
}

static void test_rope(void **state)
{
    td_rng rng;
    td_rng_seed(&rng, 47);
    /* Llama 3.1's frequencies: theta 500000, factor 8 between wavelengths of
     * 8192 / 4 and 8192 / 1 (transformers' _compute_llama3_parameters). */
    float inv[64], plain[64];
    td_rope_scaling s = {.factor = 8, .low_freq_factor = 1, .high_freq_factor = 4, .original_max_positions = 8192};
    td_ops_rope_inv_freq(inv, 128, 500000.0f, &s);
    td_ops_rope_inv_freq(plain, 128, 500000.0f, NULL);
    int kept = 0, divided = 0, blended = 0;
    for (int i = 0; i < 64; i++) {
        double f = pow(500000.0, -2.0 * i / 128), wl = 2 * M_PI / f;
        assert_true(fabs(plain[i] - f) <= 1e-6 * f);
        double want = wl < 8192 / 4.0 ? f : wl > 8192 / 1.0 ? f / 8 : 0;
        if (want == 0) {
            double sm = (8192 / wl - 1) / (4 - 1);
            want = (1 - sm) * f / 8 + sm * f;
            blended++;
        } else if (want == f) kept++;
        else divided++;
        if (fabs(inv[i] - want) > 2e-5 * want) fail_msg("inv_freq[%d] %.9g, want %.9g", i, inv[i], want);
    }
    assert_true(kept > 0 && divided > 0 && blended > 0);
    /* The rotation on two heads inside a wider row (q's heads of a qkv row). */
    rope_ctx c = {.B = 2, .T = 9, .heads = 2, .hs = 8, .stride = 40};
    float inv8[4];
    td_ops_rope_inv_freq(inv8, c.hs, 10000.0f, NULL);
    c.inv = inv8;
    size_t n = (size_t)c.B * c.T * c.stride;
    c.x = frand(&rng, n, 1);
    c.y = fvec(n);
    c.wt = frand(&rng, n, 1);
    rope_loss(&c);
    for (int b = 0; b < c.B; b++)
        for (int t = 0; t < c.T; t++)
            for (int i = 0; i < (int)c.stride; i++) {
                size_t at = ((size_t)b * c.T + t) * c.stride + i;
                if (i >= c.heads * c.hs) { assert_true(c.y[at] == c.x[at]); continue; } /* not a rotated head */
                int h = i / c.hs, j = i % c.hs, half = c.hs / 2, k = j % half;
                double a = (double)t * inv8[k], x1 = c.x[at - j + k], x2 = c.x[at - j + k + half];
                double want = j < half ? x1 * cos(a) - x2 * sin(a) : x2 * cos(a) + x1 * sin(a);
                (void)h;
                assert_true(fabs(c.y[at] - want) <= 1e-5);
            }
    /* The backward is the inverse rotation: it undoes the forward, and it is
     * the gradient. */
    float *back = fcopy(c.y, n);
    td_ops_rope_backward(back, c.inv, NULL, c.B, c.T, c.heads, c.hs, c.stride);
    for (size_t i = 0; i < n; i++) assert_true(fabs(back[i] - c.x[i]) <= 1e-5);
    float *dx = fcopy(c.wt, n);
    td_ops_rope_backward(dx, c.inv, NULL, c.B, c.T, c.heads, c.hs, c.stride);
    fd_check("rope dx", c.x, dx, n, rope_loss, &c, (fd_tol){1e-2f, 3e-4, 3e-3, 300}, &rng);
    free(c.x); free(c.y); free(c.wt); free(back); free(dx);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matmul_equals_naive_loops),
        cmocka_unit_test(test_matmul_gradients),
        cmocka_unit_test(test_layernorm_forward_values),
        cmocka_unit_test(test_layernorm_gradients),
        cmocka_unit_test(test_encoder),
        cmocka_unit_test(test_attention_forward_values),
        cmocka_unit_test(test_attention_gradients),
        cmocka_unit_test(test_attention_matches_naive_across_tiles),
        cmocka_unit_test(test_gelu),
        cmocka_unit_test(test_residual),
        cmocka_unit_test(test_softmax_and_crossentropy_values),
        cmocka_unit_test(test_crossentropy_gradients),
        cmocka_unit_test(test_head),
        cmocka_unit_test(test_backward_bit_identical_across_threads),
        cmocka_unit_test(test_gqa_attention),
        cmocka_unit_test(test_packed_attention_equals_documents_alone),
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_glu),
        cmocka_unit_test(test_scale),
        cmocka_unit_test(test_rope),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
