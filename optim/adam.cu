/* The GPU AdamW and grad sum-of-squares kernels (optim_cuda.h).
 *
 * The update mirrors optim/adam_kernel.h operation for operation, with
 * explicit _rn intrinsics so that nvcc cannot contract or reorder anything
 * (-fmad=true would otherwise fuse a*b+c where the CPU rounds twice): the
 * GPU result is the CPU result, bit for bit.  Memory-bound like the CPU
 * one: a grid-stride loop, one element per thread per iteration, coalesced.
 *
 * The sum of squares is two kernels: each block reduces a fixed, strided
 * share of the grads in double into dev_scratch[block], then one block adds
 * the partials in a fixed order into *dev_acc.  No atomics, so the result
 * depends only on the data and numel. */
#include "tidal/optim_cuda.h"
#include "tidal/convert.h"

#include <cuda_runtime.h>

namespace {

constexpr int kThreads = 256;

template <int GDT>
__device__ __forceinline__ float load_grad(const void *g, size_t i)
{
    if (GDT == TD_OPTIM_DTYPE_BF16) return td_f32_from_bf16(static_cast<const uint16_t *>(g)[i]);
    if (GDT == TD_OPTIM_DTYPE_F16) return td_f32_from_f16(static_cast<const uint16_t *>(g)[i]);
    return static_cast<const float *>(g)[i];
}

/* PDT == TD_OPTIM_DTYPE_COUNT: no param output. */
template <int PDT>
__device__ __forceinline__ void store_param(void *p, size_t i, float x)
{
    if (PDT == TD_OPTIM_DTYPE_BF16) static_cast<uint16_t *>(p)[i] = td_bf16_from_f32(x);
    else if (PDT == TD_OPTIM_DTYPE_F16) static_cast<uint16_t *>(p)[i] = td_f16_from_f32(x);
    else if (PDT == TD_OPTIM_DTYPE_F32) static_cast<float *>(p)[i] = x;
}

template <int L2, int GDT, int PDT>
__global__ void __launch_bounds__(kThreads) adam_kernel(td_adam_coeffs c, float *__restrict__ master,
                                                        float *__restrict__ m, float *__restrict__ v,
                                                        const void *__restrict__ grad, void *__restrict__ out,
                                                        size_t n)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float g = __fmul_rn(load_grad<GDT>(grad, i), c.grad_mul);
        float p = master[i], mm = m[i], vv = v[i];
        if (L2) g = __fmaf_rn(c.l2, p, g);
        p = __fmul_rn(p, c.decay_mul);
        mm = __fmaf_rn(c.beta1, mm, __fmul_rn(c.one_minus_beta1, g));
        vv = __fmaf_rn(c.beta2, vv, __fmul_rn(__fmul_rn(c.one_minus_beta2, g), g));
        float d = __fmaf_rn(__fsqrt_rn(vv), c.rsqrt_bc2, c.eps);
        p = __fmaf_rn(-c.step_size, __fdiv_rn(mm, d), p);
        m[i] = mm;
        v[i] = vv;
        master[i] = p;
        store_param<PDT>(out, i, p);
    }
}

template <int L2, int GDT, int PDT>
cudaError_t launch_adam(const td_adam_coeffs &c, const td_adam_chunk &ch, int blocks, cudaStream_t s)
{
    adam_kernel<L2, GDT, PDT><<<blocks, kThreads, 0, s>>>(c, ch.master, ch.m, ch.v, ch.grad, ch.param_out, ch.numel);
    return cudaGetLastError();
}

template <int L2, int GDT>
cudaError_t launch_pdt(const td_adam_coeffs &c, const td_adam_chunk &ch, int pdt, int blocks, cudaStream_t s)
{
    switch (pdt) {
    case TD_OPTIM_DTYPE_F32: return launch_adam<L2, GDT, TD_OPTIM_DTYPE_F32>(c, ch, blocks, s);
    case TD_OPTIM_DTYPE_BF16: return launch_adam<L2, GDT, TD_OPTIM_DTYPE_BF16>(c, ch, blocks, s);
    case TD_OPTIM_DTYPE_F16: return launch_adam<L2, GDT, TD_OPTIM_DTYPE_F16>(c, ch, blocks, s);
    default: return launch_adam<L2, GDT, TD_OPTIM_DTYPE_COUNT>(c, ch, blocks, s);
    }
}

template <int L2>
cudaError_t launch_gdt(const td_adam_coeffs &c, const td_adam_chunk &ch, int pdt, int blocks, cudaStream_t s)
{
    switch (ch.grad_dtype) {
    case TD_OPTIM_DTYPE_BF16: return launch_pdt<L2, TD_OPTIM_DTYPE_BF16>(c, ch, pdt, blocks, s);
    case TD_OPTIM_DTYPE_F16: return launch_pdt<L2, TD_OPTIM_DTYPE_F16>(c, ch, pdt, blocks, s);
    default: return launch_pdt<L2, TD_OPTIM_DTYPE_F32>(c, ch, pdt, blocks, s);
    }
}

template <int GDT>
__global__ void __launch_bounds__(kThreads) sumsq_partial_kernel(const void *__restrict__ grad, size_t n,
                                                                 double *__restrict__ partials)
{
    __shared__ double sh[kThreads];
    double acc = 0.0;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        double x = load_grad<GDT>(grad, i);
        acc = __fma_rn(x, x, acc);
    }
    sh[threadIdx.x] = acc;
    __syncthreads();
    for (int w = kThreads / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) sh[threadIdx.x] = __dadd_rn(sh[threadIdx.x], sh[threadIdx.x + w]);
        __syncthreads();
    }
    if (threadIdx.x == 0) partials[blockIdx.x] = sh[0];
}

__global__ void __launch_bounds__(kThreads) sumsq_final_kernel(const double *__restrict__ partials, int n,
                                                               double *__restrict__ acc)
{
    __shared__ double sh[kThreads];
    double s = 0.0;
    for (int i = threadIdx.x; i < n; i += kThreads) s = __dadd_rn(s, partials[i]);
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int w = kThreads / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) sh[threadIdx.x] = __dadd_rn(sh[threadIdx.x], sh[threadIdx.x + w]);
        __syncthreads();
    }
    if (threadIdx.x == 0) *acc = __dadd_rn(*acc, sh[0]);
}

int grid_for(size_t n, int max_blocks)
{
    size_t blocks = (n + kThreads - 1) / kThreads;
    return blocks > (size_t)max_blocks ? max_blocks : (int)(blocks ? blocks : 1);
}

} // namespace

extern "C" td_status td_adam_update_cuda(const td_adam_coeffs *c, const td_adam_chunk *ch, void *stream)
{
    if (!c || !ch) return td_error_set(TD_ERR_INVALID, "td_adam_update_cuda: NULL coefficients or chunk");
    if ((unsigned)ch->grad_dtype >= TD_OPTIM_DTYPE_COUNT ||
        (ch->param_out && (unsigned)ch->param_dtype >= TD_OPTIM_DTYPE_COUNT))
        return td_error_set(TD_ERR_INVALID, "td_adam_update_cuda: bad grad or param dtype (%d, %d)",
                            (int)ch->grad_dtype, (int)ch->param_dtype);
    if (ch->numel == 0) return TD_OK;
    if (!ch->master || !ch->m || !ch->v || !ch->grad)
        return td_error_set(TD_ERR_INVALID, "td_adam_update_cuda: a chunk of %zu elements has a NULL array",
                            ch->numel);
    int pdt = ch->param_out ? (int)ch->param_dtype : TD_OPTIM_DTYPE_COUNT;
    /* Enough blocks to fill any current GPU several times over; the
     * grid-stride loop covers the rest. */
    int blocks = grid_for(ch->numel, 65536);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    cudaError_t err = c->l2 != 0.0f ? launch_gdt<1>(*c, *ch, pdt, blocks, s) : launch_gdt<0>(*c, *ch, pdt, blocks, s);
    if (err != cudaSuccess)
        return td_error_set(TD_ERR_BACKEND, "AdamW kernel launch on %zu elements failed: %s (%s)", ch->numel,
                            cudaGetErrorName(err), cudaGetErrorString(err));
    return TD_OK;
}

extern "C" td_status td_grad_sumsq_cuda(const void *grad, td_optim_dtype dtype, size_t numel, double *dev_acc,
                                        double *dev_scratch, void *stream)
{
    if (!dev_acc || !dev_scratch || (numel && !grad))
        return td_error_set(TD_ERR_INVALID, "td_grad_sumsq_cuda: NULL grad, accumulator or scratch");
    if ((unsigned)dtype >= TD_OPTIM_DTYPE_COUNT)
        return td_error_set(TD_ERR_INVALID, "td_grad_sumsq_cuda: bad grad dtype %d", (int)dtype);
    if (numel == 0) return TD_OK;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    int blocks = grid_for(numel, TD_GRAD_SUMSQ_CUDA_SCRATCH);
    if (dtype == TD_OPTIM_DTYPE_BF16)
        sumsq_partial_kernel<TD_OPTIM_DTYPE_BF16><<<blocks, kThreads, 0, s>>>(grad, numel, dev_scratch);
    else if (dtype == TD_OPTIM_DTYPE_F16)
        sumsq_partial_kernel<TD_OPTIM_DTYPE_F16><<<blocks, kThreads, 0, s>>>(grad, numel, dev_scratch);
    else
        sumsq_partial_kernel<TD_OPTIM_DTYPE_F32><<<blocks, kThreads, 0, s>>>(grad, numel, dev_scratch);
    cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess) {
        sumsq_final_kernel<<<1, kThreads, 0, s>>>(dev_scratch, blocks, dev_acc);
        err = cudaGetLastError();
    }
    if (err != cudaSuccess)
        return td_error_set(TD_ERR_BACKEND, "grad sum-of-squares kernel launch on %zu elements failed: %s (%s)",
                            numel, cudaGetErrorName(err), cudaGetErrorString(err));
    return TD_OK;
}
