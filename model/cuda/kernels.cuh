/* Internal to the CUDA ops (the .cu files beside it): storage types, dtype
 * dispatch, 8-element vector access, warp reductions, scratch carving, the
 * context and its cuBLASLt GEMM.  Not a public header. */
#ifndef TIDAL_OPS_CUDA_IMPL_CUH
#define TIDAL_OPS_CUDA_IMPL_CUH

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "tidal/ops_cuda.h"

namespace tdc {

/* --- storage types: fp32 arithmetic, one rounding at the store ------------ */

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }

inline size_t dtype_bytes(td_dtype dt) { return dt == TD_DTYPE_F32 ? 4 : 2; }

inline cudaDataType_t cuda_type(td_dtype dt)
{
    return dt == TD_DTYPE_BF16 ? CUDA_R_16BF : dt == TD_DTYPE_F16 ? CUDA_R_16F : CUDA_R_32F;
}

/* TD_OK for a storage type the ops support, else TD_ERR_INVALID naming `op`. */
td_status check_dtype(const char *op, td_dtype dt);
/* Also checks that gdt is dt or fp32. */
td_status check_dtypes(const char *op, td_dtype dt, td_dtype gdt);

/* Calls fn(T{}) with T the storage type of dt (checked before). */
template <typename Fn> td_status dispatch(td_dtype dt, Fn &&fn)
{
    switch (dt) {
    case TD_DTYPE_BF16: return fn(__nv_bfloat16{});
    case TD_DTYPE_F16: return fn(__half{});
    default: return fn(float{});
    }
}

/* Calls fn(T{}, G{}) with G the gradient type: T itself or float. */
template <typename Fn> td_status dispatch2(td_dtype dt, td_dtype gdt, Fn &&fn)
{
    return dispatch(dt, [&](auto t) -> td_status {
        using T = decltype(t);
        if (gdt == TD_DTYPE_F32) return fn(t, float{});
        return fn(t, T{});
    });
}

/* TD_ERR_BACKEND naming the kernel if the last launch failed. */
td_status check_launch(const char *what);
/* TD_ERR_BACKEND naming `what` if err is not cudaSuccess. */
td_status check_cuda(cudaError_t err, const char *what);

/* Whether every pointer is 16-byte aligned (for the vector path). */
inline bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* Blocks for a grid-stride loop over `items`, `threads` per block. */
inline unsigned grid_for(size_t items, int threads)
{
    size_t b = (items + threads - 1) / threads;
    if (b < 1) b = 1;
    if (b > (1u << 20)) b = 1u << 20;
    return (unsigned)b;
}

/* --- 8 consecutive elements: one or two 16-byte accesses when allowed ----- */

constexpr int VN = 8;

/* f[j] = p[i + j] for j < 8; elements at or past n read as 0.  vec: p is
 * 16-byte aligned and i a multiple of 8, so the 16-byte path is legal. */
template <typename T>
__device__ __forceinline__ void load8(float (&f)[VN], const T *p, size_t i, size_t n, bool vec)
{
    if (vec && i + VN <= n) {
        constexpr int per = 16 / sizeof(T);
#pragma unroll
        for (int q = 0; q < VN / per; q++) {
            const int4 raw = *reinterpret_cast<const int4 *>(p + i + q * per);
            T e[per];
            memcpy(e, &raw, sizeof raw); /* register moves, no aliasing questions */
#pragma unroll
            for (int j = 0; j < per; j++) f[q * per + j] = to_f32(e[j]);
        }
    } else {
#pragma unroll
        for (int j = 0; j < VN; j++) f[j] = i + j < n ? to_f32(p[i + j]) : 0.0f;
    }
}

/* p[i + j] = f[j] for j < 8 and i + j < n. */
template <typename T>
__device__ __forceinline__ void store8(T *p, size_t i, size_t n, bool vec, const float (&f)[VN])
{
    if (vec && i + VN <= n) {
        constexpr int per = 16 / sizeof(T);
#pragma unroll
        for (int q = 0; q < VN / per; q++) {
            T e[per];
#pragma unroll
            for (int j = 0; j < per; j++) e[j] = from_f32<T>(f[q * per + j]);
            int4 raw;
            memcpy(&raw, e, sizeof raw);
            *reinterpret_cast<int4 *>(p + i + q * per) = raw;
        }
    } else {
#pragma unroll
        for (int j = 0; j < VN; j++)
            if (i + j < n) p[i + j] = from_f32<T>(f[j]);
    }
}

/* --- GELU, tanh approximation (the CPU's td_ops_gelu, ops_internal.h) ------- */

/* gelu(x) = x sigmoid(2u), u = K (x + A x^3): the GELU op and the GeGLU MLP. */
constexpr float kGeluK = 0.7978845608028654f; /* sqrt(2 / pi) */
constexpr float kGeluA = 0.044715f;
__device__ __forceinline__ float sigmoid2(float u) { return 1.0f / (1.0f + expf(-2.0f * u)); }
__device__ __forceinline__ float gelu_tanh(float x) { return x * sigmoid2(kGeluK * (x + kGeluA * x * x * x)); }
/* d/dx x sig(2u) = sig + x * 2 sig (1 - sig) * du/dx,  du/dx = K (1 + 3 A x^2) */
__device__ __forceinline__ float gelu_tanh_grad(float x)
{
    const float sig = sigmoid2(kGeluK * (x + kGeluA * x * x * x));
    const float du = kGeluK * (1.0f + 3.0f * kGeluA * x * x);
    return sig + x * 2.0f * sig * (1.0f - sig) * du;
}

/* --- sums of row-partition partials (bias, norm-weight gradients) ---------- */

/* out0[c] += sum over p < P of part0[p M + c] (and out1 from part1 when not
 * NULL), for the column sums taken as P row-partition partials: a block of
 * 32 columns x 8 lanes, lane ty adds partials ty, ty + 8, ... in order, then
 * the 8 lanes are added in order (a fixed order: the same bits every run).
 * A column a thread (C / 256 blocks, P dependent loads each) took 8.5 us a
 * bias and 12 a LayerNorm at GPT-2 124M's widths, B16 (ncu, H200); these
 * calls average 4.6 us over a step of Qwen2.5 0.5B at B16. */
template <typename G>
__global__ void __launch_bounds__(256)
    partials_final_kernel(G *out0, const float *part0, G *out1, const float *part1, int P, int M)
{
    __shared__ float sh[2][8][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    float t0 = 0.0f, t1 = 0.0f;
    if (c < M)
        for (int p = threadIdx.y; p < P; p += 8) {
            t0 += part0[(size_t)p * M + c];
            if (out1) t1 += part1[(size_t)p * M + c];
        }
    sh[0][threadIdx.y][threadIdx.x] = t0;
    sh[1][threadIdx.y][threadIdx.x] = t1;
    __syncthreads();
    if (threadIdx.y || c >= M) return;
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        s0 += sh[0][j][threadIdx.x];
        s1 += sh[1][j][threadIdx.x];
    }
    if (out0) out0[c] = from_f32<G>(to_f32(out0[c]) + s0);
    if (out1) out1[c] = from_f32<G>(to_f32(out1[c]) + s1);
}

template <typename G>
inline void partials_final(G *out0, const float *part0, G *out1, const float *part1, int P, int M, cudaStream_t s)
{
    partials_final_kernel<G><<<(M + 31) / 32, dim3(32, 8), 0, s>>>(out0, part0, out1, part1, P, M);
}

/* --- warp reductions (butterfly: every lane gets the result) --------------- */

__device__ __forceinline__ float warp_sum(float x)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ float warp_max(float x)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

/* --- scratch --------------------------------------------------------------- */

constexpr size_t kAlign = 256;
inline size_t align_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

/* Carves 256-byte aligned pieces off a caller's scratch buffer. */
struct Carve {
    char *p;
    size_t left;
    void *take(size_t bytes)
    {
        size_t b = align_up(bytes);
        if (b > left) return nullptr;
        void *r = p;
        p += b;
        left -= b;
        return r;
    }
};

/* TD_ERR_INVALID unless scratch is 256-byte aligned and holds `need` bytes. */
td_status check_scratch(const char *op, const void *scratch, size_t have, size_t need);

/* out = a + b, n elements of dt (any of them may alias). */
td_status add(td_dtype dt, void *out, const void *a, const void *b, size_t n, cudaStream_t s);

/* --- column sums (matmul dbias): out (M) += sum over rows of x (N,M) ------- */

/* Row partitions of the two-pass column sum: a function of N only, so the
 * summation order is fixed by the shape. */
int colsum_parts(int N);
size_t colsum_scratch_bytes(int N, int M);
td_status colsum(td_dtype dt, td_dtype gdt, void *out, const void *x, int N, int M, void *scratch,
                 cudaStream_t s);

/* --- flash attention (ops_cuda_flash.cu) ----------------------------------- */

/* Whether attention runs the flash kernels: 16-bit storage, hs 64 or 128,
 * and TD_OPS_CUDA_ATTENTION is not "gemm" (read on every call, so the size
 * functions and the ops agree). */
bool flash_applies(td_dtype dt, int hs);
/* Backward scratch: D (seqs, NH, T) fp32; the forward needs none. */
size_t flash_scratch_bytes(int seqs, int T, int NH);
/* qkv (B,T,(NH + 2 NKV) hs): NH query heads, then NKV key heads, then NKV
 * value heads; out (B,T,NH hs); NH % NKV == 0 (the caller checks); pos
 * (B,T) the rows' packed documents or NULL (ops.h). */
td_status flash_forward(td_dtype dt, void *out, float *lse, const void *qkv, const int *pos, int B, int T, int NH,
                        int NKV, int hs, cudaStream_t s);
td_status flash_backward(td_dtype dt, void *dqkv, const void *dout, const void *qkv, const void *out,
                         const float *lse, const int *pos, int B, int T, int NH, int NKV, int hs, bool add,
                         void *scratch, size_t scratch_bytes, cudaStream_t s);

} // namespace tdc

/* --- the context and its GEMM ---------------------------------------------- */

/* One cached cuBLASLt plan: descriptors and the algorithm for one shape.
 * While tune is set, the plan's first calls time the heuristic's candidates
 * that give its first choice's bits (context.cu, "Tuning"). */
struct td_ops_cuda_plan_key {
    int ta, tb, m, n, k, batch, ab_type, d_type, epilogue, has_c;
    long long lda, ldb, ldd, stride_a, stride_b, stride_d, aux_ld;
    unsigned align_a, align_b, align_c, align_d, align_bias, align_aux;
};

/* Tuning: at most this many of the heuristic's candidates, each timed this
 * many times (the least counts). */
enum { TD_OPS_CUDA_TUNE_MAX = 8, TD_OPS_CUDA_TUNE_ROUNDS = 3 };

struct td_ops_cuda_plan {
    td_ops_cuda_plan_key key;
    int used;  /* holds descriptors */
    int found; /* an algorithm was found (else cuBLASLt has none for this shape) */
    cublasStatus_t status; /* the heuristic's answer, for the message when none was found */
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo; /* the algorithm calls use (the heuristic's first until tuned) */
    int tune;                  /* 1 while the candidates are being timed */
    int picked;                /* the candidate kept (0: the heuristic's first) */
    int n_cand;                /* candidates, the heuristic's first among them */
    int issued;                /* timed calls issued: n_cand * TD_OPS_CUDA_TUNE_ROUNDS at most */
    cublasLtMatmulAlgo_t cand[TD_OPS_CUDA_TUNE_MAX];
    unsigned char refused[TD_OPS_CUDA_TUNE_MAX]; /* refused at run time: out of the running */
    cudaEvent_t ev[2 * TD_OPS_CUDA_TUNE_MAX * TD_OPS_CUDA_TUNE_ROUNDS]; /* start, end of each timed call */
};

/* A block with LoRA on every module adds some 30 small GEMM shapes to the base
 * model's (its adapters' widths and row ranges): room for both. */
enum { TD_OPS_CUDA_PLANS = 128 };

struct td_ops_cuda {
    cublasLtHandle_t lt;
    void *workspace;
    size_t workspace_bytes;
    int fuse_gelu;
    int fallback_gemm;
    int tune_gemm; /* 0 off, 1 on, 2 on and each settled shape's timings printed */
    int sm_major;  /* the device's compute capability */
    int next_evict;
    td_ops_cuda_plan plans[TD_OPS_CUDA_PLANS];
};

namespace tdc {

/* D = alpha op(A) op(B) + beta C, column-major (cuBLAS) terms, batched with
 * strides, with an optional epilogue (bias, GELU with aux).  C NULL means
 * C = D.  All types: A and B ab_type, C and D d_type, fp32 compute. */
struct Gemm {
    cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
    int m = 0, n = 0, k = 0, batch = 1;
    const void *A = nullptr;
    long long lda = 0, stride_a = 0;
    const void *B = nullptr;
    long long ldb = 0, stride_b = 0;
    const void *C = nullptr;
    void *D = nullptr;
    long long ldd = 0, stride_d = 0;
    cudaDataType_t ab_type = CUDA_R_32F, d_type = CUDA_R_32F;
    float alpha = 1.0f, beta = 0.0f;
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    const void *bias = nullptr;
    void *aux = nullptr;
    long long aux_ld = 0;
};

/* Runs g on stream s: through cuBLASLt, or, for a shape cuBLASLt refuses
 * (or with ctx->fallback_gemm), with the DEFAULT or BIAS epilogue on a simple
 * fallback kernel.  TD_ERR_UNSUPPORTED (message set) for a refused GELU
 * epilogue (the caller falls back to an unfused GEMM); TD_ERR_BACKEND when a
 * cuBLASLt call or a launch fails. */
td_status gemm(td_ops_cuda *ctx, const Gemm &g, cudaStream_t s, const char *what);

} // namespace tdc

#endif
