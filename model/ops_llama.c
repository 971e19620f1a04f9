/* The ops of the rotary decoder blocks on the CPU (see include/tidal/ops.h):
 * RMSNorm (with an optional offset on its gain, Gemma's 1 + w), the gated
 * MLP's activation (SwiGLU, GeGLU) and rotary position embeddings.  Grouped-query attention is
 * td_ops_attention_gqa_* (ops_attention.c).
 *
 * Order and determinism follow the GPT-2 ops: every output element, and every
 * parameter-gradient sum over rows, is computed by one thread in a fixed order
 * (rows ascending), so results are bit-identical for any thread count.  RoPE's
 * angles are fp32 products position * inv_freq, as transformers computes them
 * (its cos and sin then in fp32). */
#include "tidal/ops.h"

#include <math.h>

#include "ops_internal.h"

void td_ops_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight, float w_offset, int N,
                            int C, float eps)
{
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C;
        float *y = out + (size_t)n * C;
        float r = 1.0f / sqrtf(td_ops_dot(x, x, C) / (float)C + eps);
        rstd[n] = r;
        for (int i = 0; i < C; i++) y[i] = (w_offset + weight[i]) * (x[i] * r);
    }
}

/* y = w * x * r with r = (mean(x^2) + eps)^-1/2 (w: the gain, offset + weight):
 *   dx_i = r w_i g_i - x_i r^3 / C * sum_j g_j w_j x_j,   dweight_i = sum_n g_i x_i r. */
void td_ops_rmsnorm_backward(float *dinp, float *dweight, const float *dout, const float *inp,
                             const float *weight, float w_offset, const float *rstd, int N, int C)
{
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C, *g = dout + (size_t)n * C;
        float *dx = dinp + (size_t)n * C;
        float r = rstd[n], dot = 0.0f;
        for (int i = 0; i < C; i++) dot += g[i] * (w_offset + weight[i]) * x[i];
        float k = dot * r * r * r / (float)C;
        for (int i = 0; i < C; i++) dx[i] += r * (w_offset + weight[i]) * g[i] - x[i] * k;
    }
    if (!dweight) return; /* frozen */
#pragma omp parallel for schedule(static)
    for (int i = 0; i < C; i++) { /* one thread per column, rows in order, added one by one (as the matmul's
                                      c + a0 b0 + a1 b1 ...): rows split over calls give the same bits */
        float s = dweight[i];
        for (int n = 0; n < N; n++) s += dout[(size_t)n * C + i] * (inp[(size_t)n * C + i] * rstd[n]);
        dweight[i] = s;
    }
}

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* The gate's activation. */
static inline float act(float g, td_ops_glu a) { return a == TD_OPS_GLU_GELU_TANH ? td_ops_gelu(g) : g * sigmoidf(g); }

void td_ops_glu_forward(float *out, const float *gate_up, int N, int H, td_ops_glu a)
{
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *g = gate_up + (size_t)n * 2 * H, *u = g + H;
        float *o = out + (size_t)n * H;
        for (int i = 0; i < H; i++) o[i] = act(g[i], a) * u[i];
    }
}

void td_ops_glu_backward(float *dgate_up, const float *dout, const float *gate_up, int N, int H, td_ops_glu a)
{
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *g = gate_up + (size_t)n * 2 * H, *u = g + H, *d = dout + (size_t)n * H;
        float *dg = dgate_up + (size_t)n * 2 * H, *du = dg + H;
        if (a == TD_OPS_GLU_GELU_TANH) {
            for (int i = 0; i < H; i++) {
                dg[i] += d[i] * u[i] * td_ops_gelu_grad(g[i]);
                du[i] += d[i] * td_ops_gelu(g[i]);
            }
            continue;
        }
        for (int i = 0; i < H; i++) { /* d silu(g) / dg = s (1 + g (1 - s)), s = sigmoid(g) */
            const float sg = sigmoidf(g[i]);
            dg[i] += d[i] * u[i] * sg * (1.0f + g[i] * (1.0f - sg));
            du[i] += d[i] * g[i] * sg;
        }
    }
}

void td_ops_rope_inv_freq(float *inv_freq, int hs, float theta, const td_rope_scaling *scaling)
{
    const int half = hs / 2;
    for (int i = 0; i < half; i++) /* fp32 as torch: 1 / theta ** (arange(0, hs, 2).float() / hs) */
        inv_freq[i] = 1.0f / powf(theta, (float)(2 * i) / (float)hs);
    if (!scaling || !(scaling->factor > 0)) return;
    const double pi = 3.14159265358979323846;
    const float old_len = (float)scaling->original_max_positions;
    const float low_wavelen = old_len / scaling->low_freq_factor, high_wavelen = old_len / scaling->high_freq_factor;
    for (int i = 0; i < half; i++) {
        float f = inv_freq[i], wavelen = (float)(2 * pi) / f;
        float scaled = wavelen > low_wavelen ? f / scaling->factor : f;
        if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) { /* between: a smooth blend */
            float smooth = (old_len / wavelen - scaling->low_freq_factor) /
                           (scaling->high_freq_factor - scaling->low_freq_factor);
            scaled = (1.0f - smooth) * scaled / scaling->factor + smooth * scaled;
        }
        inv_freq[i] = scaled;
    }
}

/* sign +1 rotates by the angle (forward), -1 by its negative (backward). */
static void rope(float *x, const float *inv_freq, const int *pos, int B, int T, int heads, int hs, size_t stride,
                 float sign)
{
    const int half = hs / 2;
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            float *row = x + ((size_t)b * T + t) * stride;
            for (int i = 0; i < half; i++) {
                const int p = pos ? pos[(size_t)b * T + t] : t;
                float angle = (float)p * inv_freq[i], c = cosf(angle), s = sign * sinf(angle);
                for (int h = 0; h < heads; h++) {
                    float *p = row + (size_t)h * hs, x1 = p[i], x2 = p[i + half];
                    p[i] = x1 * c - x2 * s;
                    p[i + half] = x2 * c + x1 * s;
                }
            }
        }
}

void td_ops_rope_forward(float *x, const float *inv_freq, const int *pos, int B, int T, int heads, int hs,
                         size_t stride)
{
    rope(x, inv_freq, pos, B, T, heads, hs, stride, 1.0f);
}

void td_ops_rope_backward(float *dx, const float *inv_freq, const int *pos, int B, int T, int heads, int hs,
                          size_t stride)
{
    rope(dx, inv_freq, pos, B, T, heads, hs, stride, -1.0f);
}
