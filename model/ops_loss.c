/* The output side of the model on the CPU: softmax, fused softmax
 * cross-entropy over a padded vocabulary, and the tied head (see
 * include/tidal/ops.h).
 *
 * The logits have Vp >= V columns so that the head's matmul has an aligned
 * width (GPT-2's 50257 padded to 50304); the columns >= V are computed and
 * then ignored: they take no part in a softmax and get a zero gradient, so
 * the padded rows of wte receive no gradient from the head either.
 *
 * The cross-entropy keeps no probabilities: forward saves the row's
 * log-sum-exp (N floats instead of N x Vp), backward recomputes
 * p = exp(logit - lse) and may write the gradient over the logits in place. */
#include "tidal/ops.h"

#include <math.h>
#include <string.h>

/* log sum_{v<V} exp(x[v]), shifted by the max for range. */
static float row_logsumexp(const float *x, int V)
{
    float max = -INFINITY;
    for (int v = 0; v < V; v++)
        if (x[v] > max) max = x[v];
    float sum = 0.0f;
    for (int v = 0; v < V; v++) sum += expf(x[v] - max);
    return max + logf(sum);
}

void td_ops_softmax_forward(float *probs, const float *logits, int N, int V, int Vp)
{
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *x = logits + (size_t)n * Vp; // (Vp)
        float *p = probs + (size_t)n * Vp;        // (Vp)
        float max = -INFINITY;
        for (int v = 0; v < V; v++)
            if (x[v] > max) max = x[v];
        float sum = 0.0f;
        for (int v = 0; v < V; v++) {
            p[v] = expf(x[v] - max);
            sum += p[v];
        }
        const float inv = 1.0f / sum;
        for (int v = 0; v < V; v++) p[v] *= inv;
        for (int v = V; v < Vp; v++) p[v] = 0.0f;
    }
}

void td_ops_crossentropy_forward(float *losses, float *lse, const float *logits,
                                 const int *targets, int N, int V, int Vp)
{
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *x = logits + (size_t)n * Vp;
        lse[n] = row_logsumexp(x, V);
        losses[n] = targets[n] < 0 ? 0.0f : lse[n] - x[targets[n]];
    }
}

void td_ops_crossentropy_backward(float *dlogits, const float *logits, const float *lse,
                                  const int *targets, float dloss, int N, int V, int Vp)
{
    // d(lse - x[y]) / dx[v] = softmax(x)[v] - [v == y]
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *x = logits + (size_t)n * Vp;
        float *d = dlogits + (size_t)n * Vp; // may be x: each element is read, then written
        const int y = targets[n];
        if (y < 0) {
            memset(d, 0, (size_t)Vp * sizeof(float));
            continue;
        }
        for (int v = 0; v < V; v++) d[v] = dloss * (expf(x[v] - lse[n]) - (v == y ? 1.0f : 0.0f));
        for (int v = V; v < Vp; v++) d[v] = 0.0f;
    }
}

void td_ops_head_forward(float *logits, float *lnf, float *lnf_mean, float *lnf_rstd,
                         const float *x, const float *lnf_w, const float *lnf_b, const float *wte,
                         int N, int C, int Vp)
{
    td_ops_layernorm_forward(lnf, lnf_mean, lnf_rstd, x, lnf_w, lnf_b, N, C); // (N,C)
    td_ops_matmul_forward(logits, lnf, wte, NULL, N, C, Vp);                 // (N,Vp)
}

void td_ops_head_backward(float *dx, float *dlnf_w, float *dlnf_b, float *dwte, float *dlnf,
                          const float *dlogits, const float *x, const float *lnf,
                          const float *lnf_mean, const float *lnf_rstd, const float *lnf_w,
                          const float *wte, int N, int C, int Vp)
{
    memset(dlnf, 0, (size_t)N * C * sizeof(float));
    td_ops_matmul_backward(dlnf, dwte, NULL, dlogits, lnf, wte, N, C, Vp);
    td_ops_layernorm_backward(dx, dlnf_w, dlnf_b, dlnf, x, lnf_w, lnf_mean, lnf_rstd, N, C);
}
