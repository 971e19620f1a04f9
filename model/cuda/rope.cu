/* Rotary position embeddings on the GPU, forward and backward (see
 * ops_cuda.h; the CPU op is td_ops_rope_* in ops_llama.c).
 *
 * In place on `heads` heads of hs channels in rows `stride` elements apart,
 * transformers' rotate-half layout: channel i < hs/2 of a head pairs with
 * i + hs/2, position p rotated by p * inv_freq[i]: p = pos[row] when the row
 * holds packed documents, else t = row % T.  q and k are
 * rotated by one launch: in a fused qkv row the NH query heads and the NKV
 * key heads are adjacent, so heads = NH + NKV covers both (the value heads
 * after them are left alone).  The frequency table inv_freq (hs/2 floats,
 * fp32, on the device) is td_ops_rope_inv_freq's, computed once on the host
 * with the theta and llama3 scaling; the angle is the fp32 product t *
 * inv_freq[i] as on the CPU and in transformers, its sine and cosine
 * computed here (sincosf, full precision).
 *
 * A thread takes one row, 8 consecutive frequencies (one sincosf each) and
 * up to 8 heads, so the sines and cosines are shared by the heads; 16-byte
 * accesses when hs/2 % 8 == 0, stride % 8 == 0 and x is aligned.  The
 * backward is the inverse rotation (the angle's sine negated). */
#include "kernels.cuh"

namespace tdc {
namespace {

constexpr int kThreads = 256;
constexpr int kHeadsPerThread = 8;

template <typename T>
__global__ void rope_kernel(T *x, const float *inv_freq, const int *pos, int N, int T_, int heads, int hs,
                            size_t stride, float sign, bool vec)
{
    const int half = hs / 2, fgroups = (half + VN - 1) / VN, hchunks = (heads + kHeadsPerThread - 1) / kHeadsPerThread;
    const size_t total = (size_t)N * fgroups * hchunks;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (size_t)gridDim.x * blockDim.x) {
        const int hc = (int)(idx % hchunks), i0 = (int)(idx / hchunks % fgroups) * VN;
        const size_t n = idx / hchunks / fgroups;
        const float t = (float)(pos ? pos[n] : (int)(n % T_));
        float c[VN], s[VN];
#pragma unroll
        for (int j = 0; j < VN; j++) {
            const float angle = i0 + j < half ? t * inv_freq[i0 + j] : 0.0f;
            sincosf(angle, &s[j], &c[j]);
            s[j] *= sign;
        }
        const int h1 = min(heads, (hc + 1) * kHeadsPerThread);
        for (int h = hc * kHeadsPerThread; h < h1; h++) {
            T *p = x + n * stride + (size_t)h * hs;
            float x1[VN], x2[VN], y1[VN], y2[VN];
            load8(x1, p, i0, half, vec);
            load8(x2, p + half, i0, half, vec);
#pragma unroll
            for (int j = 0; j < VN; j++) {
                y1[j] = x1[j] * c[j] - x2[j] * s[j];
                y2[j] = x2[j] * c[j] + x1[j] * s[j];
            }
            store8(p, i0, half, vec, y1);
            store8(p + half, i0, half, vec, y2);
        }
    }
}

td_status rope(const char *op, void *x, const float *inv_freq, const int *pos, int B, int T, int heads, int hs,
               size_t stride, td_dtype dt, float sign, cudaStream_t s)
{
    td_status st = check_dtype(op, dt);
    if (st != TD_OK) return st;
    if (B < 0 || T < 0 || heads < 0 || hs <= 0 || hs % 2 || stride < (size_t)heads * hs)
        return td_error_set(TD_ERR_INVALID,
                            "%s: B %d, T %d, heads %d, hs %d, stride %zu: need an even head size and rows of at "
                            "least heads * hs elements",
                            op, B, T, heads, hs, stride);
    if (B == 0 || T == 0 || heads == 0) return TD_OK;
    if (!x || !inv_freq) return td_error_set(TD_ERR_INVALID, "%s: NULL tensor or frequency table", op);
    const int half = hs / 2, N = B * T;
    const bool vec = half % VN == 0 && stride % VN == 0 && aligned16(x);
    const size_t items = (size_t)N * ((half + VN - 1) / VN) * ((heads + kHeadsPerThread - 1) / kHeadsPerThread);
    return dispatch(dt, [&](auto tag) {
        using X = decltype(tag);
        rope_kernel<X><<<grid_for(items, kThreads), kThreads, 0, s>>>((X *)x, inv_freq, pos, N, T, heads, hs,
                                                                      stride, sign, vec);
        return check_launch(op);
    });
}

} // namespace
} // namespace tdc

using namespace tdc;

extern "C" td_status td_ops_cuda_rope_forward(void *x, const float *inv_freq, const int *pos, int B, int T,
                                              int heads, int hs, size_t stride, td_dtype dt, void *stream)
{
    return rope("rope forward", x, inv_freq, pos, B, T, heads, hs, stride, dt, 1.0f, (cudaStream_t)stream);
}

extern "C" td_status td_ops_cuda_rope_backward(void *dx, const float *inv_freq, const int *pos, int B, int T,
                                               int heads, int hs, size_t stride, td_dtype dt, void *stream)
{
    return rope("rope backward", dx, inv_freq, pos, B, T, heads, hs, stride, dt, -1.0f, (cudaStream_t)stream);
}
