/* LayerNorm on the GPU, forward and backward (see ops_cuda.h, ops.h).
 *
 * Forward and the input gradient: one warp per row, 8 channels per lane per
 * step (16-byte accesses when C % 8 == 0 and the tensors are aligned), the
 * row's sums reduced with warp shuffles in fp32; rows are re-read from
 * L1/L2 rather than held, so any C works.  The statistics are the CPU's:
 * mean, biased variance, rstd = 1 / sqrt(var + 1e-5) (IEEE sqrt and division).
 *
 * The weight and bias gradients are sums over rows.  Without atomics: the rows
 * are cut into P partitions (P a function of N only); a block of 32 channels x
 * 8 row lanes sums its partition into fp32 partials in scratch, in an order
 * fixed by the shape, and a second kernel adds the P partials of each channel
 * in ascending order into dweight and dbias.  (Taking the partials in the
 * input-gradient kernel's pass instead, per-warp sums in shared memory over a
 * block's share of rows, ran slower on an H200 at GPT-2 1.5B's B32: 0.51
 * against 0.28 ms; its few resident warps could not hide the rows' latency.)
 * The input gradient lands beside a residual gradient: dinp = dres + the
 * LayerNorm's part (dres may be dinp itself, or NULL for none), so a block's
 * backward needs no copy of its incoming gradient first. */
#include "kernels.cuh"
#include "tidal/ops.h"

namespace tdc {
namespace {

constexpr int kRowWarps = 8; /* rows per block of the row-wise kernels */

template <typename T>
__global__ void __launch_bounds__(kRowWarps * 32)
    layernorm_forward_kernel(T *out, float *mean, float *rstd, const T *inp, const T *weight,
                             const T *bias, int N, int C, bool vec)
{
    const int lane = threadIdx.x % 32, row = blockIdx.x * kRowWarps + threadIdx.x / 32;
    if (row >= N) return;
    const T *x = inp + (size_t)row * C;
    float f[VN], w[VN], b[VN];
    float sum = 0.0f;
    for (int c = lane * VN; c < C; c += 32 * VN) {
        load8(f, x, c, C, vec);
#pragma unroll
        for (int j = 0; j < VN; j++) sum += f[j];
    }
    const float m = warp_sum(sum) / (float)C;
    float var = 0.0f;
    for (int c = lane * VN; c < C; c += 32 * VN) {
        load8(f, x, c, C, vec);
#pragma unroll
        for (int j = 0; j < VN; j++)
            if (c + j < C) var += (f[j] - m) * (f[j] - m);
    }
    const float s = 1.0f / sqrtf(warp_sum(var) / (float)C + TD_OPS_LN_EPS);
    T *o = out + (size_t)row * C;
    for (int c = lane * VN; c < C; c += 32 * VN) {
        load8(f, x, c, C, vec);
        load8(w, weight, c, C, vec);
        load8(b, bias, c, C, vec);
#pragma unroll
        for (int j = 0; j < VN; j++) f[j] = (f[j] - m) * s * w[j] + b[j];
        store8(o, c, C, vec, f);
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = s;
    }
}

/* dinp = dres + rstd * (g - mean(g) - xhat * mean(g * xhat)),  g = dout * weight
 * (dres NULL: 0). */
template <typename T>
__global__ void __launch_bounds__(kRowWarps * 32)
    layernorm_dinp_kernel(T *dinp, const T *dres, const T *dout, const T *inp, const T *weight,
                          const float *mean, const float *rstd, int N, int C, bool vec)
{
    const int lane = threadIdx.x % 32, row = blockIdx.x * kRowWarps + threadIdx.x / 32;
    if (row >= N) return;
    const T *x = inp + (size_t)row * C, *d = dout + (size_t)row * C;
    const float m = mean[row], s = rstd[row];
    float fx[VN], fd[VN], fw[VN], acc[VN];
    float g_sum = 0.0f, gx_sum = 0.0f;
    for (int c = lane * VN; c < C; c += 32 * VN) {
        load8(fx, x, c, C, vec);
        load8(fd, d, c, C, vec);
        load8(fw, weight, c, C, vec);
#pragma unroll
        for (int j = 0; j < VN; j++) { /* out-of-row elements load as 0: g = 0 there */
            const float g = fd[j] * fw[j];
            g_sum += g;
            gx_sum += g * ((fx[j] - m) * s);
        }
    }
    const float g_mean = warp_sum(g_sum) / (float)C, gx_mean = warp_sum(gx_sum) / (float)C;
    T *dx = dinp + (size_t)row * C;
    const T *dr = dres ? dres + (size_t)row * C : nullptr;
    for (int c = lane * VN; c < C; c += 32 * VN) {
        load8(fx, x, c, C, vec);
        load8(fd, d, c, C, vec);
        load8(fw, weight, c, C, vec);
        if (dr) load8(acc, dr, c, C, vec);
        else
#pragma unroll
            for (int j = 0; j < VN; j++) acc[j] = 0.0f;
#pragma unroll
        for (int j = 0; j < VN; j++) {
            const float xhat = (fx[j] - m) * s;
            acc[j] += s * (fd[j] * fw[j] - g_mean - xhat * gx_mean);
        }
        store8(dx, c, C, vec, acc);
    }
}

/* Partial sums over partition blockIdx.y of dout * xhat and dout, per channel. */
template <typename T>
__global__ void __launch_bounds__(256)
    layernorm_dparams_partial_kernel(float *part_w, float *part_b, const T *dout, const T *inp,
                                     const float *mean, const float *rstd, int N, int C,
                                     int rows_per_part)
{
    __shared__ float sw[8][33], sb[8][33];
    const int c = blockIdx.x * 32 + threadIdx.x, p = blockIdx.y;
    const int r0 = p * rows_per_part, r1 = min(N, r0 + rows_per_part);
    float aw = 0.0f, ab = 0.0f;
    if (c < C)
        for (int r = r0 + threadIdx.y; r < r1; r += 8) {
            const float d = to_f32(dout[(size_t)r * C + c]);
            aw += d * ((to_f32(inp[(size_t)r * C + c]) - mean[r]) * rstd[r]);
            ab += d;
        }
    sw[threadIdx.y][threadIdx.x] = aw;
    sb[threadIdx.y][threadIdx.x] = ab;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        float tw = 0.0f, tb = 0.0f;
        for (int j = 0; j < 8; j++) {
            tw += sw[j][threadIdx.x];
            tb += sb[j][threadIdx.x];
        }
        part_w[(size_t)p * C + c] = tw;
        part_b[(size_t)p * C + c] = tb;
    }
}

} // namespace
} // namespace tdc

using namespace tdc;

extern "C" td_status td_ops_cuda_layernorm_forward(void *out, float *mean, float *rstd, const void *inp,
                                                   const void *weight, const void *bias, int N, int C,
                                                   td_dtype dt, void *stream)
{
    td_status st = check_dtype("layernorm forward", dt);
    if (st != TD_OK || N <= 0 || C <= 0) return st;
    if (!out || !mean || !rstd || !inp || !weight || !bias)
        return td_error_set(TD_ERR_INVALID, "layernorm forward: NULL tensor");
    const bool vec = C % VN == 0 && aligned16(out) && aligned16(inp) && aligned16(weight) &&
                     aligned16(bias);
    cudaStream_t s = (cudaStream_t)stream;
    return dispatch(dt, [&](auto tag) {
        using X = decltype(tag);
        layernorm_forward_kernel<X><<<(N + kRowWarps - 1) / kRowWarps, kRowWarps * 32, 0, s>>>(
            (X *)out, mean, rstd, (const X *)inp, (const X *)weight, (const X *)bias, N, C, vec);
        return check_launch("layernorm forward");
    });
}

extern "C" size_t td_ops_cuda_layernorm_scratch_bytes(int N, int C)
{
    if (N <= 0 || C <= 0) return 0;
    return 2 * align_up((size_t)colsum_parts(N) * C * sizeof(float));
}

extern "C" td_status td_ops_cuda_layernorm_backward(void *dinp, void *dweight, void *dbias,
                                                    const void *dout, const void *inp,
                                                    const void *weight, const float *mean,
                                                    const float *rstd, int N, int C, td_dtype dt,
                                                    td_dtype gdt, void *scratch, size_t scratch_bytes,
                                                    void *stream)
{
    return td_ops_cuda_layernorm_backward_res(dinp, dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C,
                                              dt, gdt, scratch, scratch_bytes, stream);
}

extern "C" td_status td_ops_cuda_layernorm_backward_res(void *dinp, const void *dres, void *dweight,
                                                        void *dbias, const void *dout, const void *inp,
                                                        const void *weight, const float *mean,
                                                        const float *rstd, int N, int C, td_dtype dt,
                                                        td_dtype gdt, void *scratch, size_t scratch_bytes,
                                                        void *stream)
{
    td_status st = check_dtypes("layernorm backward", dt, gdt);
    if (st != TD_OK || N <= 0 || C <= 0) return st;
    if (!dinp || !dout || !inp || !weight || !mean || !rstd) /* dweight, dbias NULL: frozen, no gradient */
        return td_error_set(TD_ERR_INVALID, "layernorm backward: NULL tensor");
    st = check_scratch("layernorm backward", scratch, scratch_bytes,
                       td_ops_cuda_layernorm_scratch_bytes(N, C));
    if (st != TD_OK) return st;
    const bool vec = C % VN == 0 && aligned16(dinp) && aligned16(dout) && aligned16(inp) &&
                     aligned16(weight) && (!dres || aligned16(dres));
    const int P = colsum_parts(N), rows_per_part = (N + P - 1) / P;
    Carve cv{(char *)scratch, scratch_bytes};
    float *part_w = (float *)cv.take((size_t)P * C * sizeof(float));
    float *part_b = (float *)cv.take((size_t)P * C * sizeof(float));
    cudaStream_t s = (cudaStream_t)stream;
    return dispatch2(dt, gdt, [&](auto tt, auto gt) {
        using X = decltype(tt);
        using G = decltype(gt);
        layernorm_dinp_kernel<X><<<(N + kRowWarps - 1) / kRowWarps, kRowWarps * 32, 0, s>>>(
            (X *)dinp, (const X *)dres, (const X *)dout, (const X *)inp, (const X *)weight, mean, rstd, N, C, vec);
        td_status st2 = check_launch("layernorm backward (dinp)");
        if (st2 != TD_OK || (!dweight && !dbias)) return st2;
        layernorm_dparams_partial_kernel<X><<<dim3((C + 31) / 32, P), dim3(32, 8), 0, s>>>(
            part_w, part_b, (const X *)dout, (const X *)inp, mean, rstd, N, C, rows_per_part);
        st2 = check_launch("layernorm backward (partial dweight, dbias)");
        if (st2 != TD_OK) return st2;
        partials_final<G>((G *)dweight, part_w, (G *)dbias, part_b, P, C, s);
        return check_launch("layernorm backward (dweight, dbias)");
    });
}
