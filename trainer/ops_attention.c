/* Causal multi-head self-attention on the CPU (see include/tidal/ops.h).
 *
 * Memory trade-off: the textbook reference (llm.c's train_gpt2.c) keeps the
 * pre-softmax scores and the softmax weights, 2 x (B,NH,T,T) floats per layer
 * (GPT-2 124M at B=8, T=1024: 2 x 384 MiB per layer, 9 GiB for 12 layers),
 * and backward needs two more such buffers.  Here forward keeps only the
 * log-sum-exp of each score row, lse (B,NH,T) (384 KiB per layer there), and
 * backward recomputes each weight as p = exp(q.k / sqrt(hs) - lse), as
 * FlashAttention does; that costs one more q.k product per pair (t, t2) in
 * backward and nothing in memory.  The softmax backward needs
 * D[t] = sum_t2 p[t2] dp[t2], which equals dout[t] . out[t] (FlashAttention-2),
 * so one pass over t2 suffices and no row buffer is needed.  The CUDA
 * attention saves the same lse, so this is also the contract it is tested on.
 *
 * Forward finds a row's max score in a first pass and accumulates
 * exp(s - max) weighted values in a second (recomputing q.k rather than
 * storing a row), then normalises: the exact softmax, no online rescaling.
 *
 * Parallelism and order: forward rows (b, h, t) are independent.  Backward
 * adds into dk[t2] and dv[t2] from every t >= t2, so a thread owns a whole
 * head (b, h) and runs t, then t2, in ascending order: the same sums in the
 * same order for any thread count. */
#include "tidal/ops.h"

#include <math.h>
#include <string.h>

#include "ops_internal.h"

void td_ops_attention_forward(float *out, float *lse, const float *qkv, int B, int T, int C,
                              int NH)
{
    const int hs = C / NH;
    const float scale = 1.0f / sqrtf((float)hs);
    const size_t C3 = 3 * (size_t)C;
#pragma omp parallel for collapse(3) schedule(dynamic, 8)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                const float *base = qkv + (size_t)b * T * C3;         // (T, 3C)
                const float *q = base + t * C3 + h * hs;                // (hs)
                float *o = out + ((size_t)b * T + t) * C + h * hs;     // (hs)
                float max = -INFINITY;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float s = td_ops_dot(q, base + t2 * C3 + C + h * hs, hs) * scale;
                    if (s > max) max = s;
                }
                float sum = 0.0f;
                memset(o, 0, (size_t)hs * sizeof(float));
                for (int t2 = 0; t2 <= t; t2++) {
                    const float s = td_ops_dot(q, base + t2 * C3 + C + h * hs, hs) * scale;
                    const float p = expf(s - max);
                    sum += p;
                    td_ops_axpy(o, p, base + t2 * C3 + 2 * C + h * hs, hs);
                }
                const float inv = 1.0f / sum;
                for (int i = 0; i < hs; i++) o[i] *= inv;
                lse[((size_t)b * NH + h) * T + t] = max + logf(sum);
            }
}

void td_ops_attention_backward(float *dqkv, const float *dout, const float *qkv,
                               const float *out, const float *lse, int B, int T, int C, int NH)
{
    const int hs = C / NH;
    const float scale = 1.0f / sqrtf((float)hs);
    const size_t C3 = 3 * (size_t)C;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++) {
            const float *base = qkv + (size_t)b * T * C3;  // (T, 3C)
            float *dbase = dqkv + (size_t)b * T * C3;      // (T, 3C)
            for (int t = 0; t < T; t++) {
                const float *q = base + t * C3 + h * hs;
                float *dq = dbase + t * C3 + h * hs;
                const float *o = out + ((size_t)b * T + t) * C + h * hs;
                const float *dO = dout + ((size_t)b * T + t) * C + h * hs;
                const float row_lse = lse[((size_t)b * NH + h) * T + t];
                const float D = td_ops_dot(dO, o, hs);  // sum_t2 p dp
                for (int t2 = 0; t2 <= t; t2++) {
                    const float *k = base + t2 * C3 + C + h * hs;
                    const float *v = base + t2 * C3 + 2 * C + h * hs;
                    const float p = expf(td_ops_dot(q, k, hs) * scale - row_lse);
                    const float dp = td_ops_dot(dO, v, hs);   // d loss / d p
                    const float ds = p * (dp - D) * scale;    // d loss / d (q.k)
                    td_ops_axpy(dq, ds, k, hs);
                    td_ops_axpy(dbase + t2 * C3 + C + h * hs, ds, q, hs);   // dk[t2]
                    td_ops_axpy(dbase + t2 * C3 + 2 * C + h * hs, p, dO, hs); // dv[t2]
                }
            }
        }
}
