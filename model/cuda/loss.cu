/* The output side on the GPU: softmax, the fused softmax cross-entropy over
 * a padded vocabulary, and the tied head (see ops_cuda.h, ops.h).
 *
 * One block per row of logits (N rows of Vp).  Pass 1: each thread keeps an
 * online (max, sum of exp) over its columns v < V, eight at a time (their
 * max first, the sum rescaled once when it grows), the block merges them in
 * a fixed order (warp butterflies, then the warps' results in ascending
 * order) into the row's lse; 16-bit logits in base 2 (SoftmaxExp).  Pass 2 (when a gradient or probabilities are
 * wanted) writes every column: exp(x - lse) [- 1 at the target] times dloss
 * for v < V, 0 for v >= V and for an ignored row.  A thread reads each of
 * its elements before writing it and the block synchronises between the
 * passes, so dlogits may be the logits themselves.  (A cluster of 8 blocks
 * a row, each holding its slice of the row in shared memory so that the
 * logits are read once, was slower on an H200: the training head of W1 took
 * 8.84 ms against 7.77, W9's 28.0 against 26.3; the second pass finds most
 * of its row in L2.) */
#include "kernels.cuh"

#include <math.h>

namespace tdc {
namespace {

constexpr int kThreads = 512;

enum RowMode { CE_FORWARD, CE_BACKWARD, CE_FUSED, SOFTMAX };

/* The exponentials of the softmax.  16-bit logits take exp2 of values
 * pre-scaled by log2 e (fewer instructions than expf; its error, a few
 * units of fp32 rounding, is far below the logits' own); fp32 keeps expf,
 * so fp32 losses stay the CPU's within fp32 rounding. */
template <typename T> struct SoftmaxExp {
    static constexpr bool kFast = sizeof(T) == 2;
    static constexpr float kScale = kFast ? 1.4426950408889634f : 1.0f; /* log2 e */
    static __device__ __forceinline__ float exp(float x) { return kFast ? exp2f(x) : expf(x); }
    /* lse in natural units from the scaled max and sum */
    static __device__ __forceinline__ float lse(float m, float l)
    {
        return kFast ? (m + log2f(l)) * 0.6931471805599453f : m + logf(l);
    }
};

/* (m, l) merge of two online softmax states; (-inf, 0) is the empty state. */
template <typename T> __device__ __forceinline__ void merge(float &m, float &l, float m2, float l2)
{
    const float mm = fmaxf(m, m2);
    if (mm == -INFINITY) return;
    l = l * SoftmaxExp<T>::exp(m - mm) + l2 * SoftmaxExp<T>::exp(m2 - mm);
    m = mm;
}

template <typename T, int MODE>
__global__ void __launch_bounds__(kThreads)
    row_softmax_kernel(T *outp, float *losses, float *lse, const T *logits, const int *targets,
                       float dloss, int N, int V, int Vp, bool vec)
{
    using E = SoftmaxExp<T>;
    __shared__ float sm[kThreads / 32], sl[kThreads / 32];
    __shared__ float row_lse;
    const int n = blockIdx.x;
    const T *x = logits + (size_t)n * Vp;
    const int y = MODE == SOFTMAX ? 0 : targets[n];
    float f[VN];

    if (MODE == CE_BACKWARD) {
        if (threadIdx.x == 0) row_lse = lse[n];
    } else {
        /* online (max, sum) in scaled units, 8 elements at a time: their max
         * first, the sum rescaled once if it grew */
        float m = -INFINITY, l = 0.0f;
        for (int v = threadIdx.x * VN; v < V; v += kThreads * VN) {
            load8(f, x, v, Vp, vec);
            const int k = V - v < VN ? V - v : VN;
            float mx = m;
#pragma unroll
            for (int j = 0; j < VN; j++) {
                f[j] *= E::kScale;
                if (j < k) mx = fmaxf(mx, f[j]);
            }
            if (mx > m) {
                l *= E::exp(m - mx);
                m = mx;
            }
#pragma unroll
            for (int j = 0; j < VN; j++)
                if (j < k) l += E::exp(f[j] - m);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            merge<T>(m, l, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, l, o));
        if (threadIdx.x % 32 == 0) {
            sm[threadIdx.x / 32] = m;
            sl[threadIdx.x / 32] = l;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float bm = sm[0], bl = sl[0];
            for (int w = 1; w < kThreads / 32; w++) merge<T>(bm, bl, sm[w], sl[w]);
            row_lse = E::lse(bm, bl);
            if (MODE != SOFTMAX) {
                lse[n] = row_lse;
                losses[n] = y < 0 ? 0.0f : row_lse - to_f32(x[y]);
            }
        }
    }
    __syncthreads();
    if (MODE == CE_FORWARD) return;
    const float L = row_lse * E::kScale;
    T *d = outp + (size_t)n * Vp;
    const bool ignored = MODE != SOFTMAX && y < 0;
    const float scale = MODE == SOFTMAX ? 1.0f : dloss;
    for (int v = threadIdx.x * VN; v < Vp; v += kThreads * VN) {
        load8(f, x, v, Vp, vec);
#pragma unroll
        for (int j = 0; j < VN; j++) {
            const int c = v + j;
            float g = 0.0f;
            if (!ignored && c < V)
                g = scale * (E::exp(f[j] * E::kScale - L) - (MODE != SOFTMAX && c == y ? 1.0f : 0.0f));
            f[j] = g;
        }
        store8(d, v, Vp, vec, f);
    }
}

td_status row_softmax(int mode, void *out, float *losses, float *lse, const void *logits,
                      const int *targets, float dloss, int N, int V, int Vp, td_dtype dt,
                      cudaStream_t s, const char *what)
{
    td_status st = check_dtype(what, dt);
    if (st != TD_OK) return st;
    if (V < 1 || Vp < V)
        return td_error_set(TD_ERR_INVALID, "%s: vocabulary %d, padded %d: need 1 <= V <= Vp", what, V, Vp);
    if (N <= 0) return TD_OK;
    const bool vec = Vp % VN == 0 && aligned16(logits) && (!out || aligned16(out));
    return dispatch(dt, [&](auto tag) {
        using X = decltype(tag);
        const X *in = (const X *)logits;
        X *o = (X *)out;
        switch (mode) {
        case CE_FORWARD:
            row_softmax_kernel<X, CE_FORWARD><<<N, kThreads, 0, s>>>(o, losses, lse, in, targets, dloss, N,
                                                                      V, Vp, vec);
            break;
        case CE_BACKWARD:
            row_softmax_kernel<X, CE_BACKWARD><<<N, kThreads, 0, s>>>(o, losses, lse, in, targets, dloss, N,
                                                                       V, Vp, vec);
            break;
        case CE_FUSED:
            row_softmax_kernel<X, CE_FUSED><<<N, kThreads, 0, s>>>(o, losses, lse, in, targets, dloss, N, V,
                                                                    Vp, vec);
            break;
        default:
            row_softmax_kernel<X, SOFTMAX><<<N, kThreads, 0, s>>>(o, losses, lse, in, targets, dloss, N, V,
                                                                   Vp, vec);
            break;
        }
        return check_launch(what);
    });
}

} // namespace
} // namespace tdc

using namespace tdc;

extern "C" td_status td_ops_cuda_softmax_forward(void *probs, const void *logits, int N, int V, int Vp,
                                                 td_dtype dt, void *stream)
{
    if (!probs || !logits) return td_error_set(TD_ERR_INVALID, "softmax forward: NULL tensor");
    return row_softmax(SOFTMAX, probs, nullptr, nullptr, logits, nullptr, 1.0f, N, V, Vp, dt,
                       (cudaStream_t)stream, "softmax forward");
}

extern "C" td_status td_ops_cuda_crossentropy_forward(float *losses, float *lse, const void *logits,
                                                      const int *targets, int N, int V, int Vp,
                                                      td_dtype dt, void *stream)
{
    if (!losses || !lse || !logits || !targets)
        return td_error_set(TD_ERR_INVALID, "cross-entropy forward: NULL tensor");
    return row_softmax(CE_FORWARD, nullptr, losses, lse, logits, targets, 0.0f, N, V, Vp, dt,
                       (cudaStream_t)stream, "cross-entropy forward");
}

extern "C" td_status td_ops_cuda_crossentropy_backward(void *dlogits, const void *logits, const float *lse,
                                                       const int *targets, float dloss, int N, int V,
                                                       int Vp, td_dtype dt, void *stream)
{
    if (!dlogits || !logits || !lse || !targets)
        return td_error_set(TD_ERR_INVALID, "cross-entropy backward: NULL tensor");
    return row_softmax(CE_BACKWARD, dlogits, nullptr, (float *)lse, logits, targets, dloss, N, V, Vp, dt,
                       (cudaStream_t)stream, "cross-entropy backward");
}

extern "C" td_status td_ops_cuda_crossentropy_fused(float *losses, float *lse, void *logits,
                                                    const int *targets, float dloss, int N, int V, int Vp,
                                                    td_dtype dt, void *stream)
{
    if (!losses || !lse || !logits || !targets)
        return td_error_set(TD_ERR_INVALID, "cross-entropy (fused): NULL tensor");
    return row_softmax(CE_FUSED, logits, losses, lse, logits, targets, dloss, N, V, Vp, dt,
                       (cudaStream_t)stream, "cross-entropy (fused)");
}

extern "C" td_status td_ops_cuda_head_forward(td_ops_cuda *ctx, void *logits, void *lnf, float *lnf_mean,
                                              float *lnf_rstd, const void *x, const void *lnf_w,
                                              const void *lnf_b, const void *wte, int N, int C, int Vp,
                                              td_dtype dt, void *stream)
{
    td_status st = td_ops_cuda_layernorm_forward(lnf, lnf_mean, lnf_rstd, x, lnf_w, lnf_b, N, C, dt, stream);
    if (st != TD_OK) return td_error_prefix(st, "head: ");
    st = td_ops_cuda_matmul_forward(ctx, logits, nullptr, lnf, wte, nullptr, nullptr, N, C, Vp, dt, stream);
    return st == TD_OK ? st : td_error_prefix(st, "head: ");
}

extern "C" size_t td_ops_cuda_head_scratch_bytes(int N, int C) { return td_ops_cuda_layernorm_scratch_bytes(N, C); }

extern "C" td_status td_ops_cuda_head_backward(td_ops_cuda *ctx, void *dx, void *dlnf_w, void *dlnf_b,
                                               void *dwte, void *dlnf, const void *dlogits, const void *x,
                                               const void *lnf, const float *lnf_mean,
                                               const float *lnf_rstd, const void *lnf_w, const void *wte,
                                               int N, int C, int Vp, td_dtype dt, td_dtype gdt,
                                               void *scratch, size_t scratch_bytes, void *stream)
{
    if (!dlnf) return td_error_set(TD_ERR_INVALID, "head backward: NULL dlnf scratch");
    td_status st = td_ops_cuda_matmul_backward(ctx, dlnf, dwte, nullptr, dlogits, lnf, wte, N, C, Vp,
                                               TD_OPS_CUDA_SET, dt, gdt, nullptr, 0, stream);
    if (st != TD_OK) return td_error_prefix(st, "head: ");
    st = td_ops_cuda_layernorm_backward(dx, dlnf_w, dlnf_b, dlnf, x, lnf_w, lnf_mean, lnf_rstd, N, C, dt,
                                        gdt, scratch, scratch_bytes, stream);
    return st == TD_OK ? st : td_error_prefix(st, "head: ");
}
