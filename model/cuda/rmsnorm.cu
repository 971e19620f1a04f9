/* RMSNorm on the GPU, forward and backward (see ops_cuda.h; the CPU op is
 * td_ops_rmsnorm_* in ops_llama.c).
 *
 * The layout of layernorm.cu: forward and the input gradient run one warp
 * per row, 8 channels per lane per step (16-byte accesses when C % 8 == 0
 * and the tensors are aligned), the row's sums reduced with warp shuffles in
 * fp32.  The statistics are the CPU's: rstd = 1 / sqrt(mean(x^2) + eps) (IEEE
 * sqrt and division), out = (w_offset + weight) * (x * rstd): the gain is
 * weight (LLaMA) or 1 + weight (Gemma), added in fp32.
 *
 * The weight gradient, dw_i = sum_n dout_ni x_ni rstd_n, is a sum over rows
 * and takes no atomics: the rows are cut into P partitions (P a function of N
 * only, colsum_parts), a block of 32 channels x 8 row lanes sums its
 * partition into fp32 partials in scratch in an order fixed by the shape, and
 * a second kernel adds the P partials of each channel in ascending order. */
#include "kernels.cuh"

namespace tdc {
namespace {

constexpr int kRowWarps = 8; /* rows per block of the row-wise kernels */

template <typename T>
__global__ void __launch_bounds__(kRowWarps * 32)
    rmsnorm_forward_kernel(T *out, float *rstd, const T *inp, const T *weight, float woff, int N, int C, float eps,
                           bool vec)
{
    const int lane = threadIdx.x % 32, row = blockIdx.x * kRowWarps + threadIdx.x / 32;
    if (row >= N) return;
    const T *x = inp + (size_t)row * C;
    float f[VN], w[VN];
    float ss = 0.0f;
    for (int c = lane * VN; c < C; c += 32 * VN) {
        load8(f, x, c, C, vec);
#pragma unroll
        for (int j = 0; j < VN; j++) ss += f[j] * f[j];
    }
    const float r = 1.0f / sqrtf(warp_sum(ss) / (float)C + eps);
    T *o = out + (size_t)row * C;
    for (int c = lane * VN; c < C; c += 32 * VN) {
        load8(f, x, c, C, vec);
        load8(w, weight, c, C, vec);
#pragma unroll
        for (int j = 0; j < VN; j++) f[j] = (woff + w[j]) * (f[j] * r);
        store8(o, c, C, vec, f);
    }
    if (lane == 0) rstd[row] = r;
}

/* dinp = dres + r w g - x r^3 / C * sum_j g_j w_j x_j,  g = dout (dres NULL: 0). */
template <typename T>
__global__ void __launch_bounds__(kRowWarps * 32)
    rmsnorm_dinp_kernel(T *dinp, const T *dres, const T *dout, const T *inp, const T *weight, float woff,
                        const float *rstd, int N, int C, bool vec)
{
    const int lane = threadIdx.x % 32, row = blockIdx.x * kRowWarps + threadIdx.x / 32;
    if (row >= N) return;
    const T *x = inp + (size_t)row * C, *d = dout + (size_t)row * C;
    const float r = rstd[row];
    float fx[VN], fd[VN], fw[VN], acc[VN];
    float dot = 0.0f;
    for (int c = lane * VN; c < C; c += 32 * VN) {
        load8(fx, x, c, C, vec);
        load8(fd, d, c, C, vec);
        load8(fw, weight, c, C, vec);
#pragma unroll
        for (int j = 0; j < VN; j++) dot += fd[j] * (woff + fw[j]) * fx[j]; /* out-of-row elements load as 0 */
    }
    const float k = warp_sum(dot) * r * r * r / (float)C;
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
        for (int j = 0; j < VN; j++) acc[j] += r * (woff + fw[j]) * fd[j] - fx[j] * k;
        store8(dx, c, C, vec, acc);
    }
}

/* Partial sums over partition blockIdx.y of dout * x * rstd, per channel. */
template <typename T>
__global__ void __launch_bounds__(256)
    rmsnorm_dweight_partial_kernel(float *part, const T *dout, const T *inp, const float *rstd, int N, int C,
                                   int rows_per_part)
{
    __shared__ float sw[8][33];
    const int c = blockIdx.x * 32 + threadIdx.x, p = blockIdx.y;
    const int r0 = p * rows_per_part, r1 = min(N, r0 + rows_per_part);
    float aw = 0.0f;
    if (c < C)
        for (int r = r0 + threadIdx.y; r < r1; r += 8)
            aw += to_f32(dout[(size_t)r * C + c]) * (to_f32(inp[(size_t)r * C + c]) * rstd[r]);
    sw[threadIdx.y][threadIdx.x] = aw;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        float tw = 0.0f;
        for (int j = 0; j < 8; j++) tw += sw[j][threadIdx.x];
        part[(size_t)p * C + c] = tw;
    }
}

} // namespace
} // namespace tdc

using namespace tdc;

extern "C" td_status td_ops_cuda_rmsnorm_forward(void *out, float *rstd, const void *inp, const void *weight,
                                                 float w_offset, int N, int C, float eps, td_dtype dt, void *stream)
{
    td_status st = check_dtype("rmsnorm forward", dt);
    if (st != TD_OK || N <= 0 || C <= 0) return st;
    if (!out || !rstd || !inp || !weight) return td_error_set(TD_ERR_INVALID, "rmsnorm forward: NULL tensor");
    if (!(eps >= 0.0f))
        return td_error_set(TD_ERR_INVALID, "rmsnorm forward: eps %g; need eps >= 0 (rms_norm_eps)", (double)eps);
    const bool vec = C % VN == 0 && aligned16(out) && aligned16(inp) && aligned16(weight);
    cudaStream_t s = (cudaStream_t)stream;
    return dispatch(dt, [&](auto tag) {
        using X = decltype(tag);
        rmsnorm_forward_kernel<X><<<(N + kRowWarps - 1) / kRowWarps, kRowWarps * 32, 0, s>>>(
            (X *)out, rstd, (const X *)inp, (const X *)weight, w_offset, N, C, eps, vec);
        return check_launch("rmsnorm forward");
    });
}

extern "C" size_t td_ops_cuda_rmsnorm_scratch_bytes(int N, int C)
{
    if (N <= 0 || C <= 0) return 0;
    return align_up((size_t)colsum_parts(N) * C * sizeof(float));
}

extern "C" td_status td_ops_cuda_rmsnorm_backward(void *dinp, void *dweight, const void *dout, const void *inp,
                                                  const void *weight, float w_offset, const float *rstd, int N, int C,
                                                  td_dtype dt, td_dtype gdt, void *scratch, size_t scratch_bytes,
                                                  void *stream)
{
    return td_ops_cuda_rmsnorm_backward_res(dinp, dinp, dweight, dout, inp, weight, w_offset, rstd, N, C, dt, gdt,
                                            scratch, scratch_bytes, stream);
}

extern "C" td_status td_ops_cuda_rmsnorm_backward_res(void *dinp, const void *dres, void *dweight, const void *dout,
                                                      const void *inp, const void *weight, float w_offset,
                                                      const float *rstd, int N, int C, td_dtype dt, td_dtype gdt,
                                                      void *scratch, size_t scratch_bytes, void *stream)
{
    td_status st = check_dtypes("rmsnorm backward", dt, gdt);
    if (st != TD_OK || N <= 0 || C <= 0) return st;
    if (!dinp || !dout || !inp || !weight || !rstd) /* dweight NULL: frozen, no gradient */
        return td_error_set(TD_ERR_INVALID, "rmsnorm backward: NULL tensor");
    if (dinp == dout)
        return td_error_set(TD_ERR_INVALID, "rmsnorm backward: dinp may not be dout (dweight reads dout after dinp is "
                                            "written)");
    st = check_scratch("rmsnorm backward", scratch, scratch_bytes, td_ops_cuda_rmsnorm_scratch_bytes(N, C));
    if (st != TD_OK) return st;
    const bool vec = C % VN == 0 && aligned16(dinp) && aligned16(dout) && aligned16(inp) && aligned16(weight) &&
                     (!dres || aligned16(dres));
    const int P = colsum_parts(N), rows_per_part = (N + P - 1) / P;
    float *part = (float *)scratch;
    cudaStream_t s = (cudaStream_t)stream;
    return dispatch2(dt, gdt, [&](auto tt, auto gt) {
        using X = decltype(tt);
        using G = decltype(gt);
        rmsnorm_dinp_kernel<X><<<(N + kRowWarps - 1) / kRowWarps, kRowWarps * 32, 0, s>>>(
            (X *)dinp, (const X *)dres, (const X *)dout, (const X *)inp, (const X *)weight, w_offset, rstd, N, C, vec);
        td_status st2 = check_launch("rmsnorm backward (dinp)");
        if (st2 != TD_OK || !dweight) return st2;
        rmsnorm_dweight_partial_kernel<X><<<dim3((C + 31) / 32, P), dim3(32, 8), 0, s>>>(
            part, (const X *)dout, (const X *)inp, rstd, N, C, rows_per_part);
        st2 = check_launch("rmsnorm backward (partial dweight)");
        if (st2 != TD_OK) return st2;
        partials_final<G>((G *)dweight, part, nullptr, nullptr, P, C, s);
        return check_launch("rmsnorm backward (dweight)");
    });
}
