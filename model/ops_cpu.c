/* CPU reference ops: embedding, LayerNorm, GELU, residual (see
 * include/tidal/ops.h for shapes and conventions; docs/model.md for formulas).
 *
 * Plain loops, written to be read.  Work that is independent per row runs
 * one row per iteration of an OpenMP loop.  Gradients summed over rows (dwte,
 * dwpe, LayerNorm's dweight/dbias) are split by channel instead: a thread owns
 * a block of channels and adds the rows into it in ascending row order, so
 * every sum has the same order for any thread count (bit-identical results)
 * and no thread ever writes where another does. */
#include "tidal/ops.h"

#include <math.h>
#include <string.h>

#include "ops_internal.h"

/* Channels per block of the channel-split reductions: wide enough for the
 * inner loop to vectorise, small enough to give every thread work at C = 128. */
enum { CH_BLOCK = 32 };

static int ch_blocks(int C) { return (C + CH_BLOCK - 1) / CH_BLOCK; }

/* --- embedding ------------------------------------------------------------ */

void td_ops_encoder_forward(float *out, const int *tokens, const int *pos, const float *wte, const float *wpe,
                            int B, int T, int C)
{
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            float *o = out + ((size_t)b * T + t) * C;       // (C)
            const float *e = wte + (size_t)tokens[b * T + t] * C;
            if (!wpe) { memcpy(o, e, (size_t)C * sizeof(float)); continue; } /* rotary models */
            const float *p = wpe + (size_t)(pos ? pos[b * T + t] : t) * C;
            for (int c = 0; c < C; c++) o[c] = e[c] + p[c];
        }
}

void td_ops_encoder_backward(float *dwte, float *dwpe, const float *dout, const int *tokens, const int *pos,
                             int B, int T, int C)
{
    // Two rows may share a token: split by channel, rows in ascending order.
    if (!dwte && !dwpe) return;
#pragma omp parallel for schedule(static)
    for (int blk = 0; blk < ch_blocks(C); blk++) {
        const int c0 = blk * CH_BLOCK, c1 = c0 + CH_BLOCK < C ? c0 + CH_BLOCK : C;
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++) {
                const float *d = dout + ((size_t)b * T + t) * C;
                float *e = dwte ? dwte + (size_t)tokens[b * T + t] * C : NULL; /* NULL: frozen */
                if (!dwpe) {
                    for (int c = c0; c < c1; c++) e[c] += d[c];
                    continue;
                }
                float *p = dwpe + (size_t)(pos ? pos[b * T + t] : t) * C;
                if (!e) {
                    for (int c = c0; c < c1; c++) p[c] += d[c];
                    continue;
                }
                for (int c = c0; c < c1; c++) {
                    e[c] += d[c];
                    p[c] += d[c];
                }
            }
    }
}

/* --- LayerNorm ------------------------------------------------------------ */

void td_ops_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                              const float *weight, const float *bias, int N, int C)
{
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C; // (C)
        float m = 0.0f;
        for (int c = 0; c < C; c++) m += x[c];
        m /= (float)C;
        float v = 0.0f;
        for (int c = 0; c < C; c++) v += (x[c] - m) * (x[c] - m);
        v /= (float)C;                      // biased variance, as GPT-2 / PyTorch
        const float s = 1.0f / sqrtf(v + TD_OPS_LN_EPS);
        float *o = out + (size_t)n * C;
        for (int c = 0; c < C; c++) o[c] = (x[c] - m) * s * weight[c] + bias[c];
        mean[n] = m;
        rstd[n] = s;
    }
}

void td_ops_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                               const float *inp, const float *weight, const float *mean,
                               const float *rstd, int N, int C)
{
    // dinp, per row.  With xhat = (x - mean) * rstd and g = dout * weight:
    //   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C, *d = dout + (size_t)n * C;
        const float m = mean[n], s = rstd[n];
        float g_mean = 0.0f, gx_mean = 0.0f;
        for (int c = 0; c < C; c++) {
            const float g = d[c] * weight[c];
            g_mean += g;
            gx_mean += g * (x[c] - m) * s;
        }
        g_mean /= (float)C;
        gx_mean /= (float)C;
        float *dx = dinp + (size_t)n * C;
        for (int c = 0; c < C; c++) {
            const float xhat = (x[c] - m) * s;
            dx[c] += s * (d[c] * weight[c] - g_mean - xhat * gx_mean);
        }
    }
    // dweight += sum_n dout * xhat, dbias += sum_n dout: channel blocks, rows ascending (NULL: frozen).
    if (!dweight && !dbias) return;
#pragma omp parallel for schedule(static)
    for (int blk = 0; blk < ch_blocks(C); blk++) {
        const int c0 = blk * CH_BLOCK, c1 = c0 + CH_BLOCK < C ? c0 + CH_BLOCK : C;
        for (int n = 0; n < N; n++) {
            const float *x = inp + (size_t)n * C, *d = dout + (size_t)n * C;
            const float m = mean[n], s = rstd[n];
            if (dweight)
                for (int c = c0; c < c1; c++) dweight[c] += d[c] * ((x[c] - m) * s);
            if (dbias)
                for (int c = c0; c < c1; c++) dbias[c] += d[c];
        }
    }
}

/* --- pointwise ------------------------------------------------------------ */

void td_ops_gelu_forward(float *out, const float *inp, size_t n)
{
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) out[i] = td_ops_gelu(inp[i]);
}

void td_ops_gelu_backward(float *dinp, const float *inp, const float *dout, size_t n)
{
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) dinp[i] += td_ops_gelu_grad(inp[i]) * dout[i];
}

void td_ops_scale(float *out, const float *inp, float s, size_t n)
{
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) out[i] = inp[i] * s;
}

void td_ops_residual_forward(float *out, const float *a, const float *b, size_t n)
{
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

void td_ops_residual_backward(float *da, float *db, const float *dout, size_t n)
{
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        da[i] += dout[i];
        db[i] += dout[i];
    }
}
