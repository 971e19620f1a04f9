/* The CUDA ops' context: the cuBLASLt handle, the caller's workspace, and a
 * cache of cuBLASLt plans (descriptors + the heuristic's algorithm) per GEMM
 * shape, so that a step after the warm-up makes no heuristic query and no
 * host allocation.  Also the shared checks (dtypes, launches, scratch).
 *
 * Row-major tensors are handed to cuBLASLt (column-major) as their
 * transposes; each caller says which products it forms (ops_cuda_matmul.cu,
 * ops_cuda_attention.cu).  The plan key holds everything the heuristic sees:
 * shapes, leading dimensions, batch strides, types, epilogue and the
 * alignment of every pointer (cuBLASLt picks vectorised kernels by alignment,
 * so an unaligned view, e.g. a tensor at an odd offset inside a chunk, gets
 * its own plan instead of a kernel that would fault on it).  A shape
 * cuBLASLt refuses runs on a simple fallback kernel (plain or bias
 * epilogue), so no shape is an error.
 *
 * Tuning: the heuristic's first choice is often not the fastest of the
 * algorithms it lists (measured on an H200 at the GEMMs of GPT-2 124M and
 * 1.5B and of Qwen2.5 0.5B: the fastest of its first 8 was up to 1.23x
 * faster, 2-8 % of each workload's GEMM time).  A plan keeps the listed
 * candidates that compute the same sums in the same order as the first: the
 * same kernel family, split-K count and reduction scheme (they differ only in
 * tiles, stages and cluster shape, and give the same bits: checked for
 * every one at those shapes, and by tests/gpu/test_ops_cuda.c).  Only the
 * linears' kind of GEMM is tuned, where that was checked: on sm_90, 16-bit
 * operands, one matrix (not batched), every dimension at least 128; tiny or
 * batched fp32 shapes (the attention's GEMM path) have candidates that do
 * not give the same bits, and keep the heuristic's choice.  Its first
 * calls take the candidates in turn, TD_OPS_CUDA_TUNE_ROUNDS times each, each
 * call between two events; once every timed call has finished on the device,
 * the candidate with the least time serves every later call.  The calls
 * being real ones, tuning costs no extra work and no memory, works for
 * accumulating GEMMs (beta 1) too, and the results are the same bits
 * whichever candidate is kept; the choice itself follows the timings, so it
 * may differ from run to run. */
#include "kernels.cuh"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tidal/alloc.h"

namespace tdc {

td_status check_dtype(const char *op, td_dtype dt)
{
    if (dt == TD_DTYPE_F32 || dt == TD_DTYPE_BF16 || dt == TD_DTYPE_F16) return TD_OK;
    return td_error_set(TD_ERR_INVALID, "%s: storage type %d is not fp32, bf16 or fp16", op, (int)dt);
}

td_status check_dtypes(const char *op, td_dtype dt, td_dtype gdt)
{
    td_status st = check_dtype(op, dt);
    if (st != TD_OK) return st;
    if (gdt != dt && gdt != TD_DTYPE_F32)
        return td_error_set(TD_ERR_INVALID,
                            "%s: gradient type %s with storage type %s; gradients must be %s or fp32",
                            op, td_dtype_name(gdt), td_dtype_name(dt), td_dtype_name(dt));
    return TD_OK;
}

td_status check_cuda(cudaError_t err, const char *what)
{
    if (err == cudaSuccess) return TD_OK;
    return td_error_set(TD_ERR_BACKEND, "%s failed: %s (%s)", what, cudaGetErrorName(err),
                        cudaGetErrorString(err));
}

td_status check_launch(const char *what)
{
    cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess) return TD_OK;
    return td_error_set(TD_ERR_BACKEND, "kernel launch of %s failed: %s (%s)", what,
                        cudaGetErrorName(err), cudaGetErrorString(err));
}

td_status check_scratch(const char *op, const void *scratch, size_t have, size_t need)
{
    if (need == 0) return TD_OK;
    if (!scratch || have < need)
        return td_error_set(TD_ERR_INVALID,
                            "%s: scratch of %zu bytes given, %zu needed (see its *_scratch_bytes)",
                            op, scratch ? have : (size_t)0, need);
    if ((uintptr_t)scratch % kAlign)
        return td_error_set(TD_ERR_INVALID, "%s: scratch at %p is not %zu-byte aligned", op, scratch,
                            kAlign);
    return TD_OK;
}

/* Largest power of two dividing v, at most 256 (cuBLASLt's default alignment). */
static unsigned pow2_align(uint64_t v)
{
    unsigned al = 1;
    while (al < 256 && v && !(v & al)) al <<= 1;
    return v ? al : 256;
}

static unsigned ptr_align(const void *p) { return pow2_align((uint64_t)(uintptr_t)p); }

static unsigned min_u(unsigned a, unsigned b) { return a < b ? a : b; }

/* The alignment every matrix of an operand keeps: its pointer's, and that
 * of its column and batch strides in bytes. */
static unsigned operand_align(const void *p, long long ld, long long stride, int batch, cudaDataType_t t)
{
    const uint64_t es = t == CUDA_R_32F ? 4 : 2;
    unsigned al = min_u(ptr_align(p), pow2_align((uint64_t)ld * es));
    if (batch > 1) al = min_u(al, pow2_align((uint64_t)stride * es));
    return al;
}

static td_status lt_check(cublasStatus_t s, const char *call, const char *what)
{
    if (s == CUBLAS_STATUS_SUCCESS) return TD_OK;
    return td_error_set(TD_ERR_BACKEND, "%s for %s failed: %s", call, what, cublasLtGetStatusString(s));
}

#define LT_TRY(call, what)                                   \
    do {                                                     \
        st = lt_check((call), #call, (what));                \
        if (st != TD_OK) goto cleanup;                       \
    } while (0)

static bool uses_bias(cublasLtEpilogue_t e)
{
    return e == CUBLASLT_EPILOGUE_BIAS || e == CUBLASLT_EPILOGUE_GELU_BIAS ||
           e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
}

static bool uses_aux(cublasLtEpilogue_t e)
{
    return e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || e == CUBLASLT_EPILOGUE_DGELU;
}

/* Ends a plan's tuning: its events destroyed (an event still waiting in a
 * stream is released when it completes), its algorithm kept. */
static void tune_end(td_ops_cuda_plan *p)
{
    for (int i = 0; i < 2 * TD_OPS_CUDA_TUNE_MAX * TD_OPS_CUDA_TUNE_ROUNDS; i++)
        if (p->ev[i]) {
            cudaEventDestroy(p->ev[i]);
            p->ev[i] = nullptr;
        }
    p->tune = 0;
}

static int config_attr(const cublasLtMatmulAlgo_t *a, cublasLtMatmulAlgoConfigAttributes_t attr)
{
    int32_t v = 0;
    size_t written = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(a, attr, &v, sizeof v, &written) != CUBLAS_STATUS_SUCCESS) return -1000;
    return v;
}

/* The same sums in the same order as ref: the same kernel family, split-K
 * count and reduction scheme. */
static bool same_numerics(const cublasLtMatmulAlgo_t *a, const cublasLtMatmulAlgo_t *ref)
{
    const cublasLtMatmulAlgoConfigAttributes_t attrs[] = {CUBLASLT_ALGO_CONFIG_ID, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                                          CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME};
    for (cublasLtMatmulAlgoConfigAttributes_t at : attrs) {
        int va = config_attr(a, at);
        if (va == -1000 || va != config_attr(ref, at)) return false;
    }
    return true;
}

/* Settles a plan whose timed calls have all been issued, once they have all
 * finished: the candidate with the least time is kept.  Returns whether the
 * plan is still tuning. */
static bool tune_settle(td_ops_cuda_plan *p, bool verbose)
{
    if (!p->tune) return false;
    const int calls = p->n_cand * TD_OPS_CUDA_TUNE_ROUNDS;
    if (p->issued < calls) return true;
    for (int i = 0; i < calls; i++) {
        cudaError_t e = cudaEventQuery(p->ev[2 * i + 1]);
        if (e == cudaErrorNotReady) {
            if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();
            return true;
        }
        if (e != cudaSuccess) { /* keep what the calls use now; the error shows at the next check */
            tune_end(p);
            return false;
        }
    }
    float best = 0.0f;
    int pick = -1;
    for (int c = 0; c < p->n_cand; c++) {
        if (p->refused[c]) continue;
        float least = -1.0f;
        for (int r = 0; r < TD_OPS_CUDA_TUNE_ROUNDS; r++) {
            const int i = r * p->n_cand + c;
            float ms = 0.0f;
            if (cudaEventElapsedTime(&ms, p->ev[2 * i], p->ev[2 * i + 1]) != cudaSuccess) {
                (void)cudaGetLastError();
                continue;
            }
            if (least < 0.0f || ms < least) least = ms;
        }
        if (least >= 0.0f && (pick < 0 || least < best)) {
            best = least;
            pick = c;
        }
    }
    if (pick >= 0) {
        p->algo = p->cand[pick];
        p->picked = pick;
    }
    if (verbose) {
        fprintf(stderr, "gemm tune: m %d n %d k %d batch %d ta %d tb %d epi %d:", p->key.m, p->key.n, p->key.k,
                p->key.batch, p->key.ta, p->key.tb, p->key.epilogue);
        for (int c = 0; c < p->n_cand; c++) {
            float least = -1.0f;
            for (int r = 0; r < TD_OPS_CUDA_TUNE_ROUNDS; r++) {
                const int i = r * p->n_cand + c;
                float ms = 0.0f;
                if (cudaEventElapsedTime(&ms, p->ev[2 * i], p->ev[2 * i + 1]) != cudaSuccess) {
                    (void)cudaGetLastError();
                    continue;
                }
                if (least < 0.0f || ms < least) least = ms;
            }
            fprintf(stderr, " %s%.4f", c == pick ? "*" : "", least);
        }
        fprintf(stderr, "\n");
    }
    tune_end(p);
    return false;
}

static void plan_release(td_ops_cuda_plan *p)
{
    if (!p->used) return;
    if (p->desc) cublasLtMatmulDescDestroy(p->desc);
    if (p->la) cublasLtMatrixLayoutDestroy(p->la);
    if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
    if (p->lc) cublasLtMatrixLayoutDestroy(p->lc);
    tune_end(p);
    memset(p, 0, sizeof *p);
}

static td_status layout_create(cublasLtMatrixLayout_t *l, cudaDataType_t type, int rows, int cols,
                               long long ld, int batch, long long stride, const char *what)
{
    td_status st = TD_OK;
    LT_TRY(cublasLtMatrixLayoutCreate(l, type, (uint64_t)rows, (uint64_t)cols, (int64_t)ld), what);
    if (batch > 1) {
        int32_t count = batch;
        int64_t off = stride;
        LT_TRY(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                                sizeof count),
               what);
        LT_TRY(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &off,
                                                sizeof off),
               what);
    }
cleanup:
    return st;
}

/* Sets the per-call pointers of the epilogue on the plan's descriptor. */
static td_status set_epilogue_pointers(td_ops_cuda_plan *p, const Gemm &g, const char *what)
{
    td_status st = TD_OK;
    cublasLtEpilogue_t e = g.epilogue;
    if (uses_bias(e))
        LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias,
                                              sizeof g.bias),
               what);
    if (uses_aux(e))
        LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                              &g.aux, sizeof g.aux),
               what);
cleanup:
    return st;
}

/* Builds the descriptors of a plan and asks the heuristic for its algorithm. */
static td_status plan_build(td_ops_cuda *ctx, td_ops_cuda_plan *p, const Gemm &g, const char *what)
{
    td_status st = TD_OK;
    cublasLtMatmulPreference_t pref = nullptr;
    cublasLtMatmulHeuristicResult_t result[TD_OPS_CUDA_TUNE_MAX];
    int returned = 0;
    int32_t ta = g.ta, tb = g.tb;
    uint32_t epi = g.epilogue;
    uint64_t ws = ctx->workspace_bytes;
    uint32_t al_a = p->key.align_a, al_b = p->key.align_b, al_c = p->key.align_c,
             al_d = p->key.align_d;
    cublasStatus_t hs;
    bool tunable;

    p->used = 1;
    LT_TRY(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), what);
    LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), what);
    LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), what);
    if (g.epilogue != CUBLASLT_EPILOGUE_DEFAULT)
        LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi),
               what);
    if (uses_bias(g.epilogue)) {
        int32_t bt = g.d_type;
        LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt,
                                              sizeof bt),
               what);
    }
    if (uses_aux(g.epilogue)) {
        int64_t ld = g.aux_ld;
        LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld,
                                              sizeof ld),
               what);
    }
    st = set_epilogue_pointers(p, g, what);
    if (st != TD_OK) goto cleanup;

    /* Stored shapes: op(A) is m x k, op(B) is k x n, C and D are m x n. */
    st = layout_create(&p->la, g.ab_type, g.ta == CUBLAS_OP_N ? g.m : g.k,
                       g.ta == CUBLAS_OP_N ? g.k : g.m, g.lda, g.batch, g.stride_a, what);
    if (st == TD_OK)
        st = layout_create(&p->lb, g.ab_type, g.tb == CUBLAS_OP_N ? g.k : g.n,
                           g.tb == CUBLAS_OP_N ? g.n : g.k, g.ldb, g.batch, g.stride_b, what);
    if (st == TD_OK)
        st = layout_create(&p->lc, g.d_type, g.m, g.n, g.ldd, g.batch, g.stride_d, what);
    if (st != TD_OK) goto cleanup;

    LT_TRY(cublasLtMatmulPreferenceCreate(&pref), what);
    LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                sizeof ws),
           what);
    LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                &al_a, sizeof al_a),
           what);
    LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                &al_b, sizeof al_b),
           what);
    LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                &al_c, sizeof al_c),
           what);
    LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                &al_d, sizeof al_d),
           what);
    /* Any refusal here (no algorithm, or a combination cuBLASLt rejects) marks
     * the shape unsupported: callers with a fused epilogue then fall back. */
    tunable = ctx->tune_gemm && ctx->sm_major == 9 && g.batch == 1 && g.ab_type != CUDA_R_32F && g.m >= 128 &&
              g.n >= 128 && g.k >= 128;
    hs = cublasLtMatmulAlgoGetHeuristic(ctx->lt, p->desc, p->la, p->lb, p->lc, p->lc, pref,
                                        tunable ? TD_OPS_CUDA_TUNE_MAX : 1, result, &returned);
    p->status = hs;
    if (hs == CUBLAS_STATUS_SUCCESS && returned > 0) {
        p->algo = result[0].algo;
        p->found = 1;
        p->cand[p->n_cand++] = result[0].algo;
        for (int i = 1; i < returned; i++)
            if (result[i].state == CUBLAS_STATUS_SUCCESS && same_numerics(&result[i].algo, &result[0].algo))
                p->cand[p->n_cand++] = result[i].algo;
        if (p->n_cand > 1) {
            p->tune = 1;
            for (int i = 0; i < 2 * p->n_cand * TD_OPS_CUDA_TUNE_ROUNDS; i++)
                if (cudaEventCreate(&p->ev[i]) != cudaSuccess) {
                    (void)cudaGetLastError();
                    tune_end(p); /* untimed: the heuristic's choice */
                    break;
                }
        }
    }
cleanup:
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    return st;
}

static td_ops_cuda_plan *plan_find(td_ops_cuda *ctx, const td_ops_cuda_plan_key &key)
{
    for (int i = 0; i < TD_OPS_CUDA_PLANS; i++)
        if (ctx->plans[i].used && !memcmp(&ctx->plans[i].key, &key, sizeof key)) return &ctx->plans[i];
    return nullptr;
}

static td_ops_cuda_plan *plan_slot(td_ops_cuda *ctx)
{
    for (int i = 0; i < TD_OPS_CUDA_PLANS; i++)
        if (!ctx->plans[i].used) return &ctx->plans[i];
    td_ops_cuda_plan *p = &ctx->plans[ctx->next_evict];
    ctx->next_evict = (ctx->next_evict + 1) % TD_OPS_CUDA_PLANS;
    plan_release(p);
    return p;
}

/* --- the fallback GEMM --------------------------------------------------------
 * For the shapes cuBLASLt refuses (in practice: 16-bit leading dimensions
 * that are not a multiple of 8 bytes, which no real model has, but the tests
 * do): 16 x 16 output tiles, k in steps of 16 through shared memory, fp32
 * accumulation in a fixed order.  Correct, not fast. */

template <typename TA>
__device__ __forceinline__ float op_at(const TA *M, long long ld, bool trans, int row, int col)
{
    return to_f32(trans ? M[(long long)row * ld + col] : M[(long long)col * ld + row]);
}

template <typename TA, typename TD>
__global__ void gemm_fallback_kernel(bool ta, bool tb, int m, int n, int k, const TA *A, long long lda, long long sa,
                                     const TA *B, long long ldb, long long sb, const TD *C, TD *D, long long ldd,
                                     long long sd, float alpha, float beta, const TD *bias)
{
    __shared__ float As[16][17], Bs[16][17];
    const int tx = threadIdx.x, ty = threadIdx.y, i = blockIdx.x * 16 + tx, j = blockIdx.y * 16 + ty;
    const long long bt = blockIdx.z;
    A += bt * sa;
    B += bt * sb;
    D += bt * sd;
    if (C) C += bt * sd;
    float acc = 0.0f;
    for (int p0 = 0; p0 < k; p0 += 16) {
        const int ai = blockIdx.x * 16 + tx, ap = p0 + ty, bp = p0 + tx, bj = blockIdx.y * 16 + ty;
        As[tx][ty] = ai < m && ap < k ? op_at(A, lda, ta, ai, ap) : 0.0f; /* op(A)(i, p) */
        Bs[tx][ty] = bp < k && bj < n ? op_at(B, ldb, tb, bp, bj) : 0.0f; /* op(B)(p, j) */
        __syncthreads();
#pragma unroll
        for (int q = 0; q < 16; q++) acc += As[tx][q] * Bs[q][ty];
        __syncthreads();
    }
    if (i >= m || j >= n) return;
    float v = alpha * acc;
    if (beta != 0.0f) v += beta * to_f32(C[(long long)j * ldd + i]);
    if (bias) v += to_f32(bias[i]);
    D[(long long)j * ldd + i] = from_f32<TD>(v);
}

template <typename TA, typename TD> static td_status fallback_typed(const Gemm &g, cudaStream_t s, const char *what)
{
    const TD *c = (const TD *)(g.C ? g.C : g.D);
    const TD *bias = g.epilogue == CUBLASLT_EPILOGUE_BIAS ? (const TD *)g.bias : nullptr;
    dim3 grid((g.m + 15) / 16, (g.n + 15) / 16, g.batch);
    gemm_fallback_kernel<TA, TD><<<grid, dim3(16, 16), 0, s>>>(
        g.ta == CUBLAS_OP_T, g.tb == CUBLAS_OP_T, g.m, g.n, g.k, (const TA *)g.A, g.lda, g.stride_a, (const TA *)g.B,
        g.ldb, g.stride_b, c, (TD *)g.D, g.ldd, g.stride_d, g.alpha, g.beta, bias);
    return check_launch(what);
}

template <typename TA> static td_status fallback_d(const Gemm &g, cudaStream_t s, const char *what)
{
    if (g.d_type == CUDA_R_32F) return fallback_typed<TA, float>(g, s, what);
    if (g.d_type == CUDA_R_16BF) return fallback_typed<TA, __nv_bfloat16>(g, s, what);
    return fallback_typed<TA, __half>(g, s, what);
}

static td_status gemm_fallback(const Gemm &g, cudaStream_t s, const char *what)
{
    if (g.ab_type == CUDA_R_32F) return fallback_d<float>(g, s, what);
    if (g.ab_type == CUDA_R_16BF) return fallback_d<__nv_bfloat16>(g, s, what);
    return fallback_d<__half>(g, s, what);
}

static const char *type_name(cudaDataType_t t)
{
    return t == CUDA_R_16BF ? "bf16" : t == CUDA_R_16F ? "fp16" : "fp32";
}

td_status gemm(td_ops_cuda *ctx, const Gemm &g, cudaStream_t s, const char *what)
{
    td_ops_cuda_plan_key key;
    memset(&key, 0, sizeof key); /* padding too: the key is compared with memcmp */
    key.ta = g.ta;
    key.tb = g.tb;
    key.m = g.m;
    key.n = g.n;
    key.k = g.k;
    key.batch = g.batch;
    key.ab_type = g.ab_type;
    key.d_type = g.d_type;
    key.epilogue = g.epilogue;
    key.has_c = g.C != nullptr && g.C != g.D;
    key.lda = g.lda;
    key.ldb = g.ldb;
    key.ldd = g.ldd;
    key.stride_a = g.batch > 1 ? g.stride_a : 0;
    key.stride_b = g.batch > 1 ? g.stride_b : 0;
    key.stride_d = g.batch > 1 ? g.stride_d : 0;
    key.aux_ld = uses_aux(g.epilogue) ? g.aux_ld : 0;
    key.align_a = operand_align(g.A, g.lda, g.stride_a, g.batch, g.ab_type);
    key.align_b = operand_align(g.B, g.ldb, g.stride_b, g.batch, g.ab_type);
    key.align_d = operand_align(g.D, g.ldd, g.stride_d, g.batch, g.d_type);
    key.align_c = g.C ? operand_align(g.C, g.ldd, g.stride_d, g.batch, g.d_type) : key.align_d;
    key.align_bias = uses_bias(g.epilogue) ? ptr_align(g.bias) : 0;
    key.align_aux = uses_aux(g.epilogue) ? ptr_align(g.aux) : 0;

    if (g.m <= 0 || g.n <= 0 || g.batch <= 0) return TD_OK; /* nothing to compute */
    if (ctx->fallback_gemm) {
        if (g.epilogue == CUBLASLT_EPILOGUE_DEFAULT || g.epilogue == CUBLASLT_EPILOGUE_BIAS)
            return gemm_fallback(g, s, what);
        return td_error_set(TD_ERR_UNSUPPORTED, "%s: the fallback GEMM has no GELU epilogue", what);
    }
    td_status st;
    td_ops_cuda_plan *p = plan_find(ctx, key);
    if (!p) {
        p = plan_slot(ctx);
        p->key = key;
        st = plan_build(ctx, p, g, what);
        if (st != TD_OK) {
            plan_release(p);
            return st;
        }
    } else {
        st = set_epilogue_pointers(p, g, what);
        if (st != TD_OK) return st;
    }
    if (p->found) {
        const void *c = g.C ? g.C : g.D;
        int slot = -1; /* this call's timed slot while tuning */
        if (p->tune && p->issued < p->n_cand * TD_OPS_CUDA_TUNE_ROUNDS) {
            slot = p->issued++;
            if (p->refused[slot % p->n_cand] || cudaEventRecord(p->ev[2 * slot], s) != cudaSuccess) {
                (void)cudaGetLastError();
                p->refused[slot % p->n_cand] = 1;
                slot = -1;
            }
        } else if (p->tune) {
            tune_settle(p, ctx->tune_gemm > 1);
        }
        cublasStatus_t ls = cublasLtMatmul(ctx->lt, p->desc, &g.alpha, g.A, p->la, g.B, p->lb, &g.beta, c, p->lc,
                                           g.D, p->lc, slot >= 0 ? &p->cand[slot % p->n_cand] : &p->algo,
                                           ctx->workspace, ctx->workspace_bytes, s);
        if (slot >= 0) {
            if (ls == CUBLAS_STATUS_SUCCESS && cudaEventRecord(p->ev[2 * slot + 1], s) == cudaSuccess) {
                if (p->issued == p->n_cand * TD_OPS_CUDA_TUNE_ROUNDS) tune_settle(p, ctx->tune_gemm > 1);
                return TD_OK;
            }
            (void)cudaGetLastError();
            /* the candidate refused, or its end cannot be timed: out of the
             * running, and this call runs on the plan's algorithm */
            p->refused[slot % p->n_cand] = 1;
            if (ls == CUBLAS_STATUS_SUCCESS) return TD_OK;
            ls = cublasLtMatmul(ctx->lt, p->desc, &g.alpha, g.A, p->la, g.B, p->lb, &g.beta, c, p->lc, g.D, p->lc,
                                &p->algo, ctx->workspace, ctx->workspace_bytes, s);
        }
        if (ls != CUBLAS_STATUS_NOT_SUPPORTED) return lt_check(ls, "cublasLtMatmul", what);
        tune_end(p);
        p->found = 0; /* refused at run time: never again for this plan */
        p->status = ls;
    }
    if (g.epilogue == CUBLASLT_EPILOGUE_DEFAULT || g.epilogue == CUBLASLT_EPILOGUE_BIAS)
        return gemm_fallback(g, s, what);
    return td_error_set(TD_ERR_UNSUPPORTED,
                        "%s: cuBLASLt has no algorithm (%s) for a %s x %s -> %s GEMM m=%d n=%d k=%d "
                        "(lda %lld, ldb %lld, ldd %lld, batch %d, epilogue %d, alignments "
                        "%u/%u/%u bytes)",
                        what, cublasLtGetStatusString(p->status), type_name(g.ab_type),
                        type_name(g.ab_type), type_name(g.d_type), g.m, g.n, g.k, g.lda, g.ldb, g.ldd,
                        g.batch, (int)g.epilogue, key.align_a, key.align_b, key.align_d);
}

} // namespace tdc

extern "C" td_ops_cuda_params td_ops_cuda_default_params(void)
{
    td_ops_cuda_params p;
    p.workspace = nullptr;
    p.workspace_bytes = 0;
    p.fuse_gelu = 1;
    p.fallback_gemm = 0;
    const char *tune = getenv("TD_OPS_CUDA_GEMM_TUNE");
    p.tune_gemm = !tune ? 1 : !strcmp(tune, "0") ? 0 : !strcmp(tune, "log") ? 2 : 1;
    return p;
}

extern "C" td_status td_ops_cuda_create(const td_ops_cuda_params *params, td_ops_cuda **out)
{
    if (!out) return td_error_set(TD_ERR_INVALID, "td_ops_cuda_create: NULL output");
    *out = nullptr;
    td_ops_cuda_params p = params ? *params : td_ops_cuda_default_params();
    if (p.workspace_bytes && !p.workspace)
        return td_error_set(TD_ERR_INVALID,
                            "td_ops_cuda_create: workspace of %zu bytes but a NULL pointer",
                            p.workspace_bytes);
    if (p.workspace && (uintptr_t)p.workspace % tdc::kAlign)
        return td_error_set(TD_ERR_INVALID,
                            "td_ops_cuda_create: workspace at %p is not 256-byte aligned; take it "
                            "from the arena",
                            p.workspace);
    td_ops_cuda *ctx = (td_ops_cuda *)td_calloc(1, sizeof *ctx, TD_ROLE_META);
    if (!ctx) return td_error_prefix(TD_ERR_NOMEM, "CUDA ops context: ");
    cublasStatus_t ls = cublasLtCreate(&ctx->lt);
    if (ls != CUBLAS_STATUS_SUCCESS) {
        td_free(ctx);
        return td_error_set(TD_ERR_BACKEND,
                            "cublasLtCreate failed: %s; is a CUDA device visible and the cuBLAS "
                            "library installed?",
                            cublasLtGetStatusString(ls));
    }
    ctx->workspace = p.workspace;
    ctx->workspace_bytes = p.workspace ? p.workspace_bytes : 0;
    ctx->fuse_gelu = p.fuse_gelu;
    ctx->fallback_gemm = p.fallback_gemm;
    ctx->tune_gemm = p.tune_gemm;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&ctx->sm_major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        ctx->sm_major = 0; /* unknown: no tuning */
    }
    *out = ctx;
    return TD_OK;
}

extern "C" void td_ops_cuda_free(td_ops_cuda *ctx)
{
    if (!ctx) return;
    for (int i = 0; i < TD_OPS_CUDA_PLANS; i++) tdc::plan_release(&ctx->plans[i]);
    cublasLtDestroy(ctx->lt);
    td_free(ctx);
}

extern "C" int td_ops_cuda_gemm_tuning(td_ops_cuda *ctx)
{
    int n = 0;
    if (!ctx) return 0;
    for (int i = 0; i < TD_OPS_CUDA_PLANS; i++)
        if (ctx->plans[i].used && tdc::tune_settle(&ctx->plans[i], ctx->tune_gemm > 1)) n++;
    return n;
}

extern "C" void td_ops_cuda_gemm_counts(td_ops_cuda *ctx, int *shapes, int *timed, int *retuned)
{
    int n = 0, t = 0, r = 0;
    for (int i = 0; ctx && i < TD_OPS_CUDA_PLANS; i++)
        if (ctx->plans[i].used) {
            n++;
            t += ctx->plans[i].n_cand > 1;
            r += ctx->plans[i].picked != 0;
        }
    if (shapes) *shapes = n;
    if (timed) *timed = t;
    if (retuned) *retuned = r;
}
