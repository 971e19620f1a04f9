/* Matmul with bias through cuBLASLt, forward and backward (see ops_cuda.h).
 *
 * Row-major (N,OC) is column-major (OC,N), so with W (OC,C) read by cuBLASLt
 * as the column-major (C,OC) matrix Wc:
 *   forward  out^T (OC,N)   = Wc^T (OC,C)  @ inp^T (C,N)     ta=T tb=N m=OC n=N  k=C
 *   dinp     dinp^T (C,N)   = Wc   (C,OC)  @ dout^T (OC,N)   ta=N tb=N m=C  n=N  k=OC
 *   dweight  dW^T  (C,OC)  += inp^T (C,N)  @ dout (N,OC)     ta=N tb=T m=C  n=OC k=N
 * with fp32 accumulation (CUBLAS_COMPUTE_32F), beta = 1 where the result is
 * added.  Epilogues: BIAS (bias broadcast over rows), and for 16-bit types
 * GELU_AUX_BIAS, which writes gelu(x) to out and x (the pre-activation) to
 * the aux matrix in the same pass; when cuBLASLt has no fused kernel for a
 * shape (aux rows must be a multiple of 8 elements) the forward runs the
 * GEMM with BIAS into pre_gelu and a GELU kernel after it.  fp32 never fuses:
 * its GELU is then exactly the CPU's formula.  The backward of the layer that
 * reads gelu(pre) fuses GELU's derivative the same way (DGELU, pre as aux),
 * else runs the GELU backward kernel over the GEMM's output.
 *
 * The bias gradient is a column sum of dout without atomics: P row partitions
 * (a function of N only) summed by blocks of 32 columns x 8 row lanes into
 * fp32 partials (256 columns, 8 a thread with 16-byte loads, where rows are
 * 16-byte aligned: the same sums in the same order), then the P partials of
 * each column by 8 lanes (lane j: partials j, j + 8, ...) added in order
 * (partials_final, kernels.cuh).  cuBLASLt's BGRADB epilogue (the bias
 * gradient in the dweight GEMM) was measured instead on an H200 at W1's and
 * W2's shapes: it takes a 16-bit bias only (no fp32 gradient), and it made
 * the GEMM slower by 13-42 us at W1's shapes (2-60 at W2's), as much as the
 * two kernels here take: no gain. */
#include "kernels.cuh"

namespace tdc {
namespace {

template <typename T>
__global__ void __launch_bounds__(256)
    colsum_partial_kernel(float *part, const T *x, int N, int M, int rows_per_part)
{
    __shared__ float sh[8][33];
    const int c = blockIdx.x * 32 + threadIdx.x, p = blockIdx.y;
    const int r0 = p * rows_per_part, r1 = min(N, r0 + rows_per_part);
    float acc = 0.0f;
    if (c < M)
        for (int r = r0 + threadIdx.y; r < r1; r += 8) acc += to_f32(x[(size_t)r * M + c]);
    sh[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < M) {
        float t = 0.0f;
        for (int j = 0; j < 8; j++) t += sh[j][threadIdx.x];
        part[(size_t)p * M + c] = t;
    }
}

/* The same partial sums, 8 columns a thread with 16-byte loads (x 16-byte
 * aligned, M % 8 == 0): a warp reads 256 contiguous columns of a row where
 * the kernel above reads 32.  Each column's order is the one above (lane ty
 * sums rows r0 + ty, r0 + ty + 8, ...; the 8 lanes are added in order), so
 * the bits are the same. */
template <typename T>
__global__ void __launch_bounds__(256)
    colsum_partial_vec_kernel(float *part, const T *x, int N, int M, int rows_per_part)
{
    __shared__ float sh[8][32 * VN + 1];
    const int c = (blockIdx.x * 32 + threadIdx.x) * VN, p = blockIdx.y;
    const int r0 = p * rows_per_part, r1 = min(N, r0 + rows_per_part);
    float acc[VN] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (c < M)
        for (int r = r0 + threadIdx.y; r < r1; r += 8) {
            float f[VN];
            load8(f, x + (size_t)r * M, (size_t)c, (size_t)M, true);
#pragma unroll
            for (int j = 0; j < VN; j++) acc[j] += f[j];
        }
#pragma unroll
    for (int j = 0; j < VN; j++) sh[threadIdx.y][threadIdx.x * VN + j] = acc[j];
    __syncthreads();
    /* the 256 columns' lane sums by all 256 threads, one column each */
    const int col = threadIdx.y * 32 + threadIdx.x, cc = blockIdx.x * 32 * VN + col;
    if (cc < M) {
        float t = 0.0f;
        for (int j = 0; j < 8; j++) t += sh[j][col];
        part[(size_t)p * M + cc] = t;
    }
}

} // namespace

int colsum_parts(int N)
{
    const int p = (N + 63) / 64;
    return p < 1 ? 1 : p > 256 ? 256 : p;
}

size_t colsum_scratch_bytes(int N, int M)
{
    if (N <= 0 || M <= 0) return 0;
    return align_up((size_t)colsum_parts(N) * M * sizeof(float));
}

td_status colsum(td_dtype dt, td_dtype gdt, void *out, const void *x, int N, int M, void *scratch,
                 cudaStream_t s)
{
    if (N <= 0 || M <= 0) return TD_OK;
    const int P = colsum_parts(N), rows_per_part = (N + P - 1) / P;
    float *part = (float *)scratch;
    return dispatch2(dt, gdt, [&](auto tt, auto gt) {
        using T = decltype(tt);
        using G = decltype(gt);
        if (M % VN == 0 && aligned16(x))
            colsum_partial_vec_kernel<T><<<dim3((M + 32 * VN - 1) / (32 * VN), P), dim3(32, 8), 0, s>>>(
                part, (const T *)x, N, M, rows_per_part);
        else
            colsum_partial_kernel<T><<<dim3((M + 31) / 32, P), dim3(32, 8), 0, s>>>(part, (const T *)x, N, M,
                                                                                  rows_per_part);
        td_status st = check_launch("bias gradient (partial sums)");
        if (st != TD_OK) return st;
        partials_final<G>((G *)out, part, nullptr, nullptr, P, M, s);
        return check_launch("bias gradient");
    });
}

} // namespace tdc

using namespace tdc;

extern "C" td_status td_ops_cuda_matmul_forward(td_ops_cuda *ctx, void *out, void *pre_gelu,
                                                const void *inp, const void *weight, const void *bias,
                                                const void *residual, int N, int C, int OC, td_dtype dt,
                                                void *stream)
{
    td_status st = check_dtype("matmul forward", dt);
    if (st != TD_OK) return st;
    if (!ctx || !out || !inp || !weight)
        return td_error_set(TD_ERR_INVALID, "matmul forward: NULL context or tensor");
    if (pre_gelu && residual)
        return td_error_set(TD_ERR_INVALID, "matmul forward: GELU and a residual input together");
    if (C <= 0) return td_error_set(TD_ERR_INVALID, "matmul forward: C = %d, need C >= 1", C);
    if (N <= 0 || OC <= 0) return TD_OK;
    cudaStream_t s = (cudaStream_t)stream;
    const cudaDataType_t type = cuda_type(dt);
    Gemm g;
    g.ta = CUBLAS_OP_T;
    g.tb = CUBLAS_OP_N;
    g.m = OC;
    g.n = N;
    g.k = C;
    g.A = weight;
    g.lda = C;
    g.B = inp;
    g.ldb = C;
    g.ab_type = g.d_type = type;
    g.ldd = OC;
    g.bias = bias;
    /* cuBLASLt wants the aux matrix's rows a multiple of 8 elements */
    if (pre_gelu && ctx->fuse_gelu && dt != TD_DTYPE_F32 && OC % 8 == 0 && aligned16(pre_gelu)) {
        g.D = out;
        g.aux = pre_gelu;
        g.aux_ld = OC;
        g.epilogue = bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
        st = gemm(ctx, g, s, "matmul forward (fused GELU)");
        if (st != TD_ERR_UNSUPPORTED) return st;
        td_error_clear(); /* no fused kernel for this shape: unfused below */
        g.aux = nullptr;
        g.aux_ld = 0;
    }
    g.D = pre_gelu ? pre_gelu : out;
    g.epilogue = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    if (residual) {
        g.C = residual;
        g.beta = 1.0f;
    }
    st = gemm(ctx, g, s, "matmul forward");
    if (st != TD_OK || !pre_gelu) return st;
    return td_ops_cuda_gelu_forward(out, pre_gelu, (size_t)N * OC, dt, stream);
}

extern "C" size_t td_ops_cuda_matmul_scratch_bytes(int N, int OC) { return colsum_scratch_bytes(N, OC); }

/* Both backward entry points: with pre_gelu, the layer's input was
 * gelu(pre_gelu) and dinp is set to (dout @ weight) * gelu'(pre_gelu). */
static td_status matmul_backward(td_ops_cuda *ctx, void *dinp, void *dweight, void *dbias, const void *dout,
                                 const void *inp, const void *weight, const void *pre_gelu, int N, int C, int OC,
                                 td_ops_cuda_write dinp_mode, td_dtype dt, td_dtype gdt, void *scratch,
                                 size_t scratch_bytes, void *stream)
{
    td_status st = check_dtypes("matmul backward", dt, gdt);
    if (st != TD_OK) return st;
    if (!ctx || !dout || !inp || !weight) /* dweight, dbias NULL: a frozen weight's (no gradient) */
        return td_error_set(TD_ERR_INVALID, "matmul backward: NULL context or tensor");
    if (N <= 0 || C <= 0 || OC <= 0) return TD_OK;
    if (dbias) {
        st = check_scratch("matmul backward", scratch, scratch_bytes, td_ops_cuda_matmul_scratch_bytes(N, OC));
        if (st != TD_OK) return st;
    }
    cudaStream_t s = (cudaStream_t)stream;
    const cudaDataType_t type = cuda_type(dt);
    if (dinp) {
        Gemm g;
        g.ta = CUBLAS_OP_N;
        g.tb = CUBLAS_OP_N;
        g.m = C;
        g.n = N;
        g.k = OC;
        g.A = weight;
        g.lda = C;
        g.B = dout;
        g.ldb = OC;
        g.D = dinp;
        g.ldd = C;
        g.ab_type = g.d_type = type;
        g.beta = dinp_mode == TD_OPS_CUDA_ADD ? 1.0f : 0.0f;
        bool done = false;
        /* GELU's derivative in the GEMM's epilogue (DGELU, the pre-activation
         * as its aux input), as the forward fuses GELU: same conditions */
        if (pre_gelu && ctx->fuse_gelu && dt != TD_DTYPE_F32 && C % 8 == 0 && aligned16(pre_gelu)) {
            g.aux = (void *)pre_gelu;
            g.aux_ld = C;
            g.epilogue = CUBLASLT_EPILOGUE_DGELU;
            st = gemm(ctx, g, s, "matmul backward (dinp, fused GELU backward)");
            if (st != TD_ERR_UNSUPPORTED && st != TD_OK) return st;
            done = st == TD_OK;
            if (!done) td_error_clear(); /* no fused kernel for this shape: unfused below */
            g.aux = nullptr;
            g.aux_ld = 0;
            g.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
        }
        if (!done) {
            st = gemm(ctx, g, s, "matmul backward (dinp)");
            if (st == TD_OK && pre_gelu)
                st = td_ops_cuda_gelu_backward(dinp, pre_gelu, dinp, (size_t)N * C, TD_OPS_CUDA_SET, dt, stream);
            if (st != TD_OK) return st;
        }
    }
    if (!dweight) return dbias ? colsum(dt, gdt, dbias, dout, N, OC, scratch, s) : TD_OK;
    Gemm g;
    g.ta = CUBLAS_OP_N;
    g.tb = CUBLAS_OP_T;
    g.m = C;
    g.n = OC;
    g.k = N;
    g.A = inp;
    g.lda = C;
    g.B = dout;
    g.ldb = OC;
    g.D = dweight;
    g.ldd = C;
    g.ab_type = type;
    g.d_type = cuda_type(gdt);
    g.beta = 1.0f;
    st = gemm(ctx, g, s, "matmul backward (dweight)");
    if (st != TD_OK || !dbias) return st;
    return colsum(dt, gdt, dbias, dout, N, OC, scratch, s);
}

extern "C" td_status td_ops_cuda_matmul_backward(td_ops_cuda *ctx, void *dinp, void *dweight,
                                                 void *dbias, const void *dout, const void *inp,
                                                 const void *weight, int N, int C, int OC,
                                                 td_ops_cuda_write dinp_mode, td_dtype dt, td_dtype gdt,
                                                 void *scratch, size_t scratch_bytes, void *stream)
{
    return matmul_backward(ctx, dinp, dweight, dbias, dout, inp, weight, nullptr, N, C, OC, dinp_mode, dt, gdt,
                           scratch, scratch_bytes, stream);
}

extern "C" td_status td_ops_cuda_matmul_backward_gelu(td_ops_cuda *ctx, void *dinp, void *dweight, void *dbias,
                                                      const void *dout, const void *inp, const void *weight,
                                                      const void *pre_gelu, int N, int C, int OC, td_dtype dt,
                                                      td_dtype gdt, void *scratch, size_t scratch_bytes,
                                                      void *stream)
{
    if (!dinp || !pre_gelu)
        return td_error_set(TD_ERR_INVALID, "matmul backward through GELU: NULL dinp or pre-activation");
    if (dinp == pre_gelu)
        return td_error_set(TD_ERR_INVALID, "matmul backward through GELU: dinp must not alias the pre-activation");
    return matmul_backward(ctx, dinp, dweight, dbias, dout, inp, weight, pre_gelu, N, C, OC, TD_OPS_CUDA_SET, dt,
                           gdt, scratch, scratch_bytes, stream);
}
