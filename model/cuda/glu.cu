/* The gated MLP's activation on the GPU, forward and backward (see
 * ops_cuda.h; the CPU op is td_ops_glu_* in ops_llama.c): SwiGLU (silu of
 * the gate) and GeGLU (its tanh GELU), one kernel templated on the
 * activation.
 *
 * gate_up (N, 2H) is the output of one matmul: the gate projection in
 * columns [0, H) of a row, the up projection in [H, 2H) (the CPU's layout,
 * and what a fused gate|up weight (2H, C) gives).  out (N, H) = silu(gate) *
 * up (or gelu(gate) * up).  Memory-bound: each thread takes 8 consecutive channels of one row,
 * with 16-byte accesses when H % 8 == 0 and the tensors are aligned; fp32
 * arithmetic with expf, one rounding at the store.  The backward's thread
 * reads its gate and up values before it writes their gradients, so with
 * SET the gradient may overwrite gate_up (in place). */
#include "kernels.cuh"

namespace tdc {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <bool GELU>
__device__ __forceinline__ float act(float g) { return GELU ? gelu_tanh(g) : g * sigmoid(g); }

template <typename T, bool GELU>
__global__ void glu_forward_kernel(T *out, const T *gate_up, int N, int H, bool vec)
{
    const size_t groups = (size_t)(H + VN - 1) / VN, total = (size_t)N * groups;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (size_t)gridDim.x * blockDim.x) {
        const size_t n = idx / groups;
        const int c = (int)(idx % groups) * VN;
        const T *g = gate_up + n * 2 * H, *u = g + H;
        float fg[VN], fu[VN];
        load8(fg, g, c, H, vec);
        load8(fu, u, c, H, vec);
#pragma unroll
        for (int j = 0; j < VN; j++) fg[j] = act<GELU>(fg[j]) * fu[j];
        store8(out + n * H, c, H, vec, fg);
    }
}

/* d silu(g) / dg = s (1 + g (1 - s)), s = sigmoid(g); gelu's in kernels.cuh. */
template <typename T, bool GELU, bool ADD>
__global__ void glu_backward_kernel(T *dgate_up, const T *dout, const T *gate_up, int N, int H, bool vec)
{
    const size_t groups = (size_t)(H + VN - 1) / VN, total = (size_t)N * groups;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (size_t)gridDim.x * blockDim.x) {
        const size_t n = idx / groups;
        const int c = (int)(idx % groups) * VN;
        const T *g = gate_up + n * 2 * H, *u = g + H;
        T *dg = dgate_up + n * 2 * H, *du = dg + H;
        float fg[VN], fu[VN], fd[VN], ag[VN], au[VN];
        load8(fg, g, c, H, vec);
        load8(fu, u, c, H, vec);
        load8(fd, dout + n * H, c, H, vec);
        if (ADD) {
            load8(ag, dg, c, H, vec);
            load8(au, du, c, H, vec);
        }
#pragma unroll
        for (int j = 0; j < VN; j++) {
            float dgj, duj;
            if (GELU) {
                dgj = fd[j] * fu[j] * gelu_tanh_grad(fg[j]);
                duj = fd[j] * gelu_tanh(fg[j]);
            } else {
                const float s = sigmoid(fg[j]);
                dgj = fd[j] * fu[j] * s * (1.0f + fg[j] * (1.0f - s));
                duj = fd[j] * fg[j] * s;
            }
            ag[j] = ADD ? ag[j] + dgj : dgj;
            au[j] = ADD ? au[j] + duj : duj;
        }
        store8(dg, c, H, vec, ag);
        store8(du, c, H, vec, au);
    }
}

} // namespace
} // namespace tdc

using namespace tdc;

extern "C" td_status td_ops_cuda_glu_forward(void *out, const void *gate_up, int N, int H, td_ops_glu a,
                                             td_dtype dt, void *stream)
{
    td_status st = check_dtype("glu forward", dt);
    if (st != TD_OK || N <= 0 || H <= 0) return st;
    if (!out || !gate_up) return td_error_set(TD_ERR_INVALID, "glu forward: NULL tensor");
    const bool vec = H % VN == 0 && aligned16(out) && aligned16(gate_up);
    const unsigned grid = grid_for((size_t)N * ((H + VN - 1) / VN), kThreads);
    cudaStream_t s = (cudaStream_t)stream;
    return dispatch(dt, [&](auto tag) {
        using X = decltype(tag);
        if (a == TD_OPS_GLU_GELU_TANH)
            glu_forward_kernel<X, true><<<grid, kThreads, 0, s>>>((X *)out, (const X *)gate_up, N, H, vec);
        else
            glu_forward_kernel<X, false><<<grid, kThreads, 0, s>>>((X *)out, (const X *)gate_up, N, H, vec);
        return check_launch("glu forward");
    });
}

extern "C" td_status td_ops_cuda_glu_backward(void *dgate_up, const void *dout, const void *gate_up, int N, int H,
                                              td_ops_glu a, td_ops_cuda_write mode, td_dtype dt, void *stream)
{
    td_status st = check_dtype("glu backward", dt);
    if (st != TD_OK || N <= 0 || H <= 0) return st;
    if (!dgate_up || !dout || !gate_up) return td_error_set(TD_ERR_INVALID, "glu backward: NULL tensor");
    if (dgate_up == dout) return td_error_set(TD_ERR_INVALID, "glu backward: dgate_up may not be dout");
    if (mode == TD_OPS_CUDA_ADD && dgate_up == gate_up)
        return td_error_set(TD_ERR_INVALID, "glu backward: dgate_up may be gate_up only with TD_OPS_CUDA_SET");
    const bool vec = H % VN == 0 && aligned16(dgate_up) && aligned16(dout) && aligned16(gate_up);
    const unsigned grid = grid_for((size_t)N * ((H + VN - 1) / VN), kThreads);
    const bool add = mode == TD_OPS_CUDA_ADD, gelu = a == TD_OPS_GLU_GELU_TANH;
    cudaStream_t s = (cudaStream_t)stream;
    return dispatch(dt, [&](auto tag) {
        using X = decltype(tag);
        X *dg = (X *)dgate_up;
        const X *d = (const X *)dout, *gu = (const X *)gate_up;
        if (gelu && add) glu_backward_kernel<X, true, true><<<grid, kThreads, 0, s>>>(dg, d, gu, N, H, vec);
        else if (gelu) glu_backward_kernel<X, true, false><<<grid, kThreads, 0, s>>>(dg, d, gu, N, H, vec);
        else if (add) glu_backward_kernel<X, false, true><<<grid, kThreads, 0, s>>>(dg, d, gu, N, H, vec);
        else glu_backward_kernel<X, false, false><<<grid, kThreads, 0, s>>>(dg, d, gu, N, H, vec);
        return check_launch("glu backward");
    });
}
