/* Causal multi-head attention on the GPU through batched cuBLASLt GEMMs
 * (see ops_cuda.h and, for the formulas, ops.h / docs/model.md), and the
 * entry points of both attention paths (this one and flash.cu).
 *
 * Grouped-query attention (NKV key/value heads, group = NH / NKV query heads
 * each; a qkv row holds NH query heads, then NKV key heads, then NKV value
 * heads): the split copies each query head's key/value head beside it, so
 * the forward and the score products are the multi-head ones; dK and dV of
 * a key/value head are single GEMMs over its group, whose heads lie side by
 * side (dK = Q_group dS_group^T, a contraction over group x T), so the group
 * is summed in the GEMM's fp32 accumulator.  NKV = NH is GPT-2's layout and
 * the same calls as before.
 *
 * Per group of G sequences, in scratch (layout below), with BH = G * NH heads:
 *   split    qkv (B,T,3C) -> Q, K, V (BH, T, hsp)      hsp = hs rounded up to 8
 *   forward  S = K^T Q / sqrt(hs)  (BH, T, Tp) fp32    Tp = T rounded up to 8
 *            P = exp(S - lse), lse = logsumexp of each row over t2 <= t
 *                (and t2 >= t - pos[t] with packed documents),
 *                P = 0 elsewhere                       (BH, T, Tp) in dt
 *            O = P V, merged back to out (B,T,C)
 *   backward S again; P = exp(S - lse);  dV = P^T dO;  dP = dO V^T (fp32);
 *            dS = P (dP - D) / sqrt(hs) with D = dout . out per row (written
 *            over P);  dQ = dS K;  dK = dS^T Q;  merged into dqkv (B,T,3C).
 * The full T x T products are computed and the future masked (P = dS = 0),
 * as llm.c does: simple and at GEMM speed, twice the causal work.  Only lse
 * (B,NH,T) is kept between forward and backward, as on the CPU.
 * Rows and heads are padded to multiples of 8 elements so that every
 * cuBLASLt operand is 16-byte aligned whatever T and hs are.
 *
 * The row kernels (softmax, dS) run one warp per row of S. */
#include "kernels.cuh"

#include <math.h>

namespace tdc {
namespace {

constexpr int kThreads = 256;
constexpr int kRowWarps = 8;

inline int pad8(int x) { return (x + 7) / 8 * 8; }

/* Scratch for a group of G sequences: 7 head matrices (Q, K, V, and O in the
 * forward or dO, dQ, dK, dV in the backward) in dt, S in fp32, P in dt. */
struct AttLayout {
    size_t mat_elems, sq_elems;
    size_t bytes(td_dtype dt) const
    {
        return 7 * align_up(mat_elems * dtype_bytes(dt)) + align_up(sq_elems * sizeof(float)) +
               align_up(sq_elems * dtype_bytes(dt));
    }
};

AttLayout att_layout(int G, int T, int NH, int hs)
{
    AttLayout l;
    l.mat_elems = (size_t)G * NH * T * pad8(hs);
    l.sq_elems = (size_t)G * NH * T * pad8(T);
    return l;
}

/* dst_m (BH, T, hsp) = head h of matrix m of src rows (b0 + g, t): query
 * head h (column h * hs), then, for NMAT 3, the key and value heads of its
 * group (columns C + kv * hs and C + KV + kv * hs, kv = h / group, KV = NKV
 * hs); row stride src_stride. */
template <typename T, int NMAT>
__global__ void heads_split_kernel(T *dst0, T *dst1, T *dst2, const T *src, int b0, int G, int T_,
                                   int C, int NH, int group, int hs, int hsp, size_t src_stride)
{
    const size_t total = (size_t)G * NH * T_ * hs;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (size_t)gridDim.x * blockDim.x) {
        const int i = (int)(idx % hs);
        const size_t r = idx / hs; /* (g, h, t) */
        const int t = (int)(r % T_), h = (int)(r / T_ % NH), g = (int)(r / T_ / NH);
        const T *row = src + ((size_t)(b0 + g) * T_ + t) * src_stride;
        const size_t d = r * hsp + i;
        dst0[d] = row[(size_t)h * hs + i];
        if (NMAT > 1) {
            const size_t kv = (size_t)C + (size_t)(h / group) * hs + i, KV = (size_t)(NH / group) * hs;
            dst1[d] = row[kv];
            dst2[d] = row[kv + KV];
        }
    }
}

/* The inverse: rows (b0 + g, t) of dst (row stride dst_stride) get query
 * head h of src0 and, for NMAT 3, key/value head kv = h / group of src1 and
 * src2 (laid out (G, NKV, T, hsp)) from the group's first head, written or
 * added. */
template <typename T, int NMAT, bool ADD>
__global__ void heads_merge_kernel(T *dst, const T *src0, const T *src1, const T *src2, int b0, int G,
                                   int T_, int C, int NH, int group, int hs, int hsp, size_t dst_stride)
{
    const size_t total = (size_t)G * NH * T_ * hs;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (size_t)gridDim.x * blockDim.x) {
        const int i = (int)(idx % hs);
        const size_t r = idx / hs;
        const int t = (int)(r % T_), h = (int)(r / T_ % NH), g = (int)(r / T_ / NH);
        T *row = dst + ((size_t)(b0 + g) * T_ + t) * dst_stride;
        T *o = row + (size_t)h * hs + i;
        const size_t s = r * hsp + i;
        *o = ADD ? from_f32<T>(to_f32(*o) + to_f32(src0[s])) : src0[s];
        if (NMAT > 1 && h % group == 0) {
            const int NKV = NH / group, kv = h / group;
            const size_t skv = (((size_t)g * NKV + kv) * T_ + t) * hsp + i;
            T *ok = row + (size_t)C + (size_t)kv * hs + i, *ov = ok + (size_t)NKV * hs;
            *ok = ADD ? from_f32<T>(to_f32(*ok) + to_f32(src1[skv])) : src1[skv];
            *ov = ADD ? from_f32<T>(to_f32(*ov) + to_f32(src2[skv])) : src2[skv];
        }
    }
}

/* The first key row r = (bh, t) of a group starting at sequence b0 reads:
 * its document's start with packed documents, else 0. */
__device__ __forceinline__ int row_start(const int *pos, int r, int b0, int NH, int T_)
{
    const int t = r % T_;
    return pos ? t - pos[(size_t)(b0 + r / T_ / NH) * T_ + t] : 0;
}

/* One warp per row r = (bh, t) of S: lse over start <= t2 <= t, P = exp(S -
 * lse) masked.  lse indexes (B,NH,T) rows from the group's first. */
template <typename T>
__global__ void __launch_bounds__(kRowWarps * 32)
    softmax_forward_kernel(T *P, float *lse, const float *S, const int *pos, int b0, int NH, int rows, int T_, int Tp)
{
    const int lane = threadIdx.x % 32, r = blockIdx.x * kRowWarps + threadIdx.x / 32;
    if (r >= rows) return;
    const int t = r % T_, t0 = row_start(pos, r, b0, NH, T_);
    const float *s = S + (size_t)r * Tp;
    float m = -INFINITY, l = 0.0f; /* running max and sum of exp(s - m) of this lane */
    for (int t2 = t0 + lane; t2 <= t; t2 += 32) {
        const float x = s[t2];
        if (x > m) {
            l = l * expf(m - x) + 1.0f;
            m = x;
        } else {
            l += expf(x - m);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), l2 = __shfl_xor_sync(0xffffffffu, l, o);
        const float mm = fmaxf(m, m2);
        if (mm == -INFINITY) continue; /* both lanes empty so far */
        l = l * expf(m - mm) + l2 * expf(m2 - mm);
        m = mm;
    }
    const float row_lse = m + logf(l);
    T *p = P + (size_t)r * Tp;
    for (int t2 = lane; t2 < T_; t2 += 32)
        p[t2] = from_f32<T>(t2 <= t && t2 >= t0 ? expf(s[t2] - row_lse) : 0.0f);
    if (lane == 0) lse[r] = row_lse;
}

/* Backward: P = exp(S - lse) masked. */
template <typename T>
__global__ void __launch_bounds__(kRowWarps * 32)
    probs_kernel(T *P, const float *S, const float *lse, const int *pos, int b0, int NH, int rows, int T_, int Tp)
{
    const int lane = threadIdx.x % 32, r = blockIdx.x * kRowWarps + threadIdx.x / 32;
    if (r >= rows) return;
    const int t = r % T_, t0 = row_start(pos, r, b0, NH, T_);
    const float row_lse = lse[r];
    const float *s = S + (size_t)r * Tp;
    T *p = P + (size_t)r * Tp;
    for (int t2 = lane; t2 < T_; t2 += 32)
        p[t2] = from_f32<T>(t2 <= t && t2 >= t0 ? expf(s[t2] - row_lse) : 0.0f);
}

/* Backward: dS = P (dP - D) * scale masked, over P in place;
 * D = dout[b,t,h,:] . out[b,t,h,:]. */
template <typename T>
__global__ void __launch_bounds__(kRowWarps * 32)
    dscores_kernel(T *PdS, const float *dP, const T *dout, const T *out, const int *pos, int b0, int rows, int T_,
                   int Tp, int C, int NH, int hs, float scale)
{
    const int lane = threadIdx.x % 32, r = blockIdx.x * kRowWarps + threadIdx.x / 32;
    if (r >= rows) return;
    const int t = r % T_, bh = r / T_, h = bh % NH, b = b0 + bh / NH, t0 = row_start(pos, r, b0, NH, T_);
    const size_t off = ((size_t)b * T_ + t) * C + (size_t)h * hs;
    float D = 0.0f;
    for (int i = lane; i < hs; i += 32) D += to_f32(dout[off + i]) * to_f32(out[off + i]);
    D = warp_sum(D);
    const float *dp = dP + (size_t)r * Tp;
    T *p = PdS + (size_t)r * Tp;
    for (int t2 = lane; t2 < T_; t2 += 32)
        p[t2] = from_f32<T>(t2 <= t && t2 >= t0 ? to_f32(p[t2]) * (dp[t2] - D) * scale : 0.0f);
}

struct Group {
    void *q, *k, *v, *x1, *x2, *x3, *x4; /* x1: O (forward) or dO; x2..x4: dQ, dK, dV */
    float *S;
    void *P;
};

Group carve_group(void *scratch, size_t bytes, const AttLayout &l, td_dtype dt)
{
    Carve cv{(char *)scratch, bytes};
    Group g;
    const size_t mb = l.mat_elems * dtype_bytes(dt);
    g.q = cv.take(mb);
    g.k = cv.take(mb);
    g.v = cv.take(mb);
    g.x1 = cv.take(mb);
    g.x2 = cv.take(mb);
    g.x3 = cv.take(mb);
    g.x4 = cv.take(mb);
    g.S = (float *)cv.take(l.sq_elems * sizeof(float));
    g.P = cv.take(l.sq_elems * dtype_bytes(dt));
    return g;
}

/* Sequences per group that fit in scratch_bytes (0 if not even one). */
int group_seqs(int B, int T, int NH, int hs, td_dtype dt, size_t scratch_bytes)
{
    int G = B;
    while (G > 0 && att_layout(G, T, NH, hs).bytes(dt) > scratch_bytes) G--;
    return G;
}

/* A batched GEMM over BH heads with the strides of the group's buffers. */
Gemm head_gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void *A,
               long long lda, long long sa, const void *B, long long ldb, long long sb, void *D,
               long long ldd, long long sd, int BH, cudaDataType_t ab, cudaDataType_t dtype,
               float alpha)
{
    Gemm g;
    g.ta = ta;
    g.tb = tb;
    g.m = m;
    g.n = n;
    g.k = k;
    g.A = A;
    g.lda = lda;
    g.stride_a = sa;
    g.B = B;
    g.ldb = ldb;
    g.stride_b = sb;
    g.D = D;
    g.ldd = ldd;
    g.stride_d = sd;
    g.batch = BH;
    g.ab_type = ab;
    g.d_type = dtype;
    g.alpha = alpha;
    return g;
}

td_status check_args(const char *op, td_ops_cuda *ctx, int B, int T, int NH, int NKV, int hs, td_dtype dt)
{
    td_status st = check_dtype(op, dt);
    if (st != TD_OK) return st;
    if (!ctx) return td_error_set(TD_ERR_INVALID, "%s: NULL context", op);
    if (B < 0 || T < 0 || NH <= 0 || NKV <= 0 || hs <= 0 || NH % NKV)
        return td_error_set(TD_ERR_INVALID,
                            "%s: B %d, T %d, NH %d, NKV %d, hs %d: need B, T >= 0, hs >= 1 and the key/value "
                            "heads NKV to divide the query heads NH",
                            op, B, T, NH, NKV, hs);
    return TD_OK;
}

/* The GPT-2 entry points' check: C split into NH heads. */
td_status check_heads(const char *op, int C, int NH)
{
    if (C <= 0 || NH <= 0 || C % NH)
        return td_error_set(TD_ERR_INVALID, "%s: C %d, NH %d: need C a multiple of NH", op, C, NH);
    return TD_OK;
}

} // namespace
} // namespace tdc

using namespace tdc;

extern "C" size_t td_ops_cuda_attention_gqa_scratch_bytes(int seqs, int T, int NH, int NKV, int hs, td_dtype dt)
{
    if (seqs <= 0 || T <= 0 || NH <= 0 || NKV <= 0 || hs <= 0 || NH % NKV) return 0;
    if (flash_applies(dt, hs)) return flash_scratch_bytes(seqs, T, NH);
    return att_layout(seqs, T, NH, hs).bytes(dt);
}

extern "C" size_t td_ops_cuda_attention_scratch_bytes(int seqs, int T, int C, int NH, td_dtype dt)
{
    if (C <= 0 || NH <= 0 || C % NH) return 0;
    return td_ops_cuda_attention_gqa_scratch_bytes(seqs, T, NH, NH, C / NH, dt);
}

extern "C" td_status td_ops_cuda_attention_gqa_forward(td_ops_cuda *ctx, void *out, float *lse, const void *qkv,
                                                       const int *pos, int B, int T, int NH, int NKV, int hs,
                                                       td_dtype dt, void *scratch, size_t scratch_bytes,
                                                       void *stream)
{
    const char *op = "attention forward";
    td_status st = check_args(op, ctx, B, T, NH, NKV, hs, dt);
    if (st != TD_OK || B == 0 || T == 0) return st;
    if (!out || !lse || !qkv) return td_error_set(TD_ERR_INVALID, "%s: NULL tensor", op);
    st = check_scratch(op, scratch, scratch_bytes, td_ops_cuda_attention_gqa_scratch_bytes(1, T, NH, NKV, hs, dt));
    if (st != TD_OK) return st;
    cudaStream_t s = (cudaStream_t)stream;
    if (flash_applies(dt, hs)) return flash_forward(dt, out, lse, qkv, pos, B, T, NH, NKV, hs, s);
    const int C = NH * hs, group = NH / NKV, hsp = pad8(hs), Tp = pad8(T);
    const int G = group_seqs(B, T, NH, hs, dt, scratch_bytes);
    const float scale = 1.0f / sqrtf((float)hs);
    const Group buf = carve_group(scratch, scratch_bytes, att_layout(G, T, NH, hs), dt);
    const cudaDataType_t type = cuda_type(dt);
    const long long mat = (long long)T * hsp, sq = (long long)T * Tp;
    const size_t row = (size_t)C + 2 * (size_t)NKV * hs;
    return dispatch(dt, [&](auto tag) -> td_status {
        using X = decltype(tag);
        for (int b0 = 0; b0 < B; b0 += G) {
            const int nb = B - b0 < G ? B - b0 : G, BH = nb * NH, rows = BH * T;
            const unsigned grid = grid_for((size_t)rows * hs, kThreads);
            heads_split_kernel<X, 3><<<grid, kThreads, 0, s>>>((X *)buf.q, (X *)buf.k, (X *)buf.v,
                                                              (const X *)qkv, b0, nb, T, C, NH, group, hs, hsp,
                                                              row);
            td_status st2 = check_launch("attention forward (split heads)");
            if (st2 != TD_OK) return st2;
            /* S (t2 x t per head, column-major) = K^T Q * scale */
            st2 = gemm(ctx, head_gemm(CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, buf.k, hsp, mat, buf.q, hsp, mat,
                                      buf.S, Tp, sq, BH, type, CUDA_R_32F, scale),
                       s, "attention forward (Q K^T)");
            if (st2 != TD_OK) return st2;
            softmax_forward_kernel<X><<<(rows + kRowWarps - 1) / kRowWarps, kRowWarps * 32, 0, s>>>(
                (X *)buf.P, lse + (size_t)b0 * NH * T, buf.S, pos, b0, NH, rows, T, Tp);
            st2 = check_launch("attention forward (softmax)");
            if (st2 != TD_OK) return st2;
            /* O (i x t per head) = V P */
            st2 = gemm(ctx, head_gemm(CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, buf.v, hsp, mat, buf.P, Tp, sq,
                                      buf.x1, hsp, mat, BH, type, type, 1.0f),
                       s, "attention forward (P V)");
            if (st2 != TD_OK) return st2;
            heads_merge_kernel<X, 1, false><<<grid, kThreads, 0, s>>>(
                (X *)out, (const X *)buf.x1, nullptr, nullptr, b0, nb, T, C, NH, group, hs, hsp, (size_t)C);
            st2 = check_launch("attention forward (merge heads)");
            if (st2 != TD_OK) return st2;
        }
        return TD_OK;
    });
}

extern "C" td_status td_ops_cuda_attention_forward(td_ops_cuda *ctx, void *out, float *lse, const void *qkv, int B,
                                                   int T, int C, int NH, td_dtype dt, void *scratch,
                                                   size_t scratch_bytes, void *stream)
{
    td_status st = check_heads("attention forward", C, NH);
    if (st != TD_OK) return st;
    return td_ops_cuda_attention_gqa_forward(ctx, out, lse, qkv, NULL, B, T, NH, NH, C / NH, dt, scratch,
                                             scratch_bytes, stream);
}

extern "C" td_status td_ops_cuda_attention_gqa_backward(td_ops_cuda *ctx, void *dqkv, const void *dout,
                                                        const void *qkv, const void *out, const float *lse,
                                                        const int *pos, int B, int T, int NH, int NKV, int hs,
                                                        td_ops_cuda_write mode,
                                                        td_dtype dt, void *scratch, size_t scratch_bytes,
                                                        void *stream)
{
    const char *op = "attention backward";
    td_status st = check_args(op, ctx, B, T, NH, NKV, hs, dt);
    if (st != TD_OK || B == 0 || T == 0) return st;
    if (!dqkv || !dout || !qkv || !out || !lse) return td_error_set(TD_ERR_INVALID, "%s: NULL tensor", op);
    st = check_scratch(op, scratch, scratch_bytes, td_ops_cuda_attention_gqa_scratch_bytes(1, T, NH, NKV, hs, dt));
    if (st != TD_OK) return st;
    cudaStream_t s = (cudaStream_t)stream;
    if (flash_applies(dt, hs))
        return flash_backward(dt, dqkv, dout, qkv, out, lse, pos, B, T, NH, NKV, hs, mode == TD_OPS_CUDA_ADD, scratch,
                              scratch_bytes, s);
    const int C = NH * hs, group = NH / NKV, hsp = pad8(hs), Tp = pad8(T);
    const int G = group_seqs(B, T, NH, hs, dt, scratch_bytes);
    const float scale = 1.0f / sqrtf((float)hs);
    const Group buf = carve_group(scratch, scratch_bytes, att_layout(G, T, NH, hs), dt);
    const cudaDataType_t type = cuda_type(dt);
    const long long mat = (long long)T * hsp, sq = (long long)T * Tp;
    const size_t row = (size_t)C + 2 * (size_t)NKV * hs;
    return dispatch(dt, [&](auto tag) -> td_status {
        using X = decltype(tag);
        for (int b0 = 0; b0 < B; b0 += G) {
            const int nb = B - b0 < G ? B - b0 : G, BH = nb * NH, rows = BH * T;
            const unsigned grid = grid_for((size_t)rows * hs, kThreads);
            const unsigned row_grid = (rows + kRowWarps - 1) / kRowWarps;
            void *dO = buf.x1, *dQ = buf.x2, *dK = buf.x3, *dV = buf.x4;
            const float *row_lse = lse + (size_t)b0 * NH * T;
            heads_split_kernel<X, 3><<<grid, kThreads, 0, s>>>((X *)buf.q, (X *)buf.k, (X *)buf.v,
                                                              (const X *)qkv, b0, nb, T, C, NH, group, hs, hsp,
                                                              row);
            td_status st2 = check_launch("attention backward (split q, k, v)");
            if (st2 != TD_OK) return st2;
            heads_split_kernel<X, 1><<<grid, kThreads, 0, s>>>((X *)dO, nullptr, nullptr, (const X *)dout,
                                                              b0, nb, T, C, NH, group, hs, hsp, (size_t)C);
            st2 = check_launch("attention backward (split dout)");
            if (st2 != TD_OK) return st2;
            st2 = gemm(ctx, head_gemm(CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, buf.k, hsp, mat, buf.q, hsp, mat,
                                      buf.S, Tp, sq, BH, type, CUDA_R_32F, scale),
                       s, "attention backward (Q K^T)");
            if (st2 != TD_OK) return st2;
            probs_kernel<X><<<row_grid, kRowWarps * 32, 0, s>>>((X *)buf.P, buf.S, row_lse, pos, b0, NH, rows, T, Tp);
            st2 = check_launch("attention backward (probabilities)");
            if (st2 != TD_OK) return st2;
            /* dV (i x t2) of a key/value head = dO P^T over its group: the
             * group's heads side by side make one product of depth group T */
            st2 = gemm(ctx, head_gemm(CUBLAS_OP_N, CUBLAS_OP_T, hs, T, group * T, dO, hsp, group * mat, buf.P, Tp,
                                      group * sq, dV, hsp, mat, nb * NKV, type, type, 1.0f),
                       s, "attention backward (dV)");
            if (st2 != TD_OK) return st2;
            /* dP (t2 x t) = V^T dO, over S */
            st2 = gemm(ctx, head_gemm(CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, buf.v, hsp, mat, dO, hsp, mat,
                                      buf.S, Tp, sq, BH, type, CUDA_R_32F, 1.0f),
                       s, "attention backward (dP)");
            if (st2 != TD_OK) return st2;
            dscores_kernel<X><<<row_grid, kRowWarps * 32, 0, s>>>((X *)buf.P, buf.S, (const X *)dout,
                                                                 (const X *)out, pos, b0, rows, T, Tp, C, NH,
                                                                 hs, scale);
            st2 = check_launch("attention backward (dS)");
            if (st2 != TD_OK) return st2;
            /* dQ (i x t) = K dS;  dK (i x t2) = Q dS^T over the group, as dV */
            st2 = gemm(ctx, head_gemm(CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, buf.k, hsp, mat, buf.P, Tp, sq,
                                      dQ, hsp, mat, BH, type, type, 1.0f),
                       s, "attention backward (dQ)");
            if (st2 != TD_OK) return st2;
            st2 = gemm(ctx, head_gemm(CUBLAS_OP_N, CUBLAS_OP_T, hs, T, group * T, buf.q, hsp, group * mat, buf.P,
                                      Tp, group * sq, dK, hsp, mat, nb * NKV, type, type, 1.0f),
                       s, "attention backward (dK)");
            if (st2 != TD_OK) return st2;
            if (mode == TD_OPS_CUDA_ADD)
                heads_merge_kernel<X, 3, true><<<grid, kThreads, 0, s>>>(
                    (X *)dqkv, (const X *)dQ, (const X *)dK, (const X *)dV, b0, nb, T, C, NH, group, hs, hsp, row);
            else
                heads_merge_kernel<X, 3, false><<<grid, kThreads, 0, s>>>(
                    (X *)dqkv, (const X *)dQ, (const X *)dK, (const X *)dV, b0, nb, T, C, NH, group, hs, hsp, row);
            st2 = check_launch("attention backward (merge heads)");
            if (st2 != TD_OK) return st2;
        }
        return TD_OK;
    });
}

extern "C" td_status td_ops_cuda_attention_backward(td_ops_cuda *ctx, void *dqkv, const void *dout, const void *qkv,
                                                    const void *out, const float *lse, int B, int T, int C, int NH,
                                                    td_ops_cuda_write mode, td_dtype dt, void *scratch,
                                                    size_t scratch_bytes, void *stream)
{
    td_status st = check_heads("attention backward", C, NH);
    if (st != TD_OK) return st;
    return td_ops_cuda_attention_gqa_backward(ctx, dqkv, dout, qkv, out, lse, NULL, B, T, NH, NH, C / NH, mode, dt,
                                              scratch, scratch_bytes, stream);
}
