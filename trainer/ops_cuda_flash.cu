/* Flash-style causal attention for 16-bit storage and head sizes 64 and 128
 * (the GPT-2 family: 124M..1.5B have hs 64, the 4.1B workload hs 128).
 * Nothing of size T x T touches device memory: tiles of 64 rows x 64 columns
 * live in shared memory and the tensor cores (WMMA, bf16/fp16 in, fp32
 * accumulate) do the products.  Same contract as the GEMM path
 * (ops_cuda_attention.cu): saves lse (B,NH,T), P and dS rounded to the
 * storage type before their products, fp32 everywhere else.
 *
 * A block has 4 warps; each warp owns 16 of the block's 64 rows and does its
 * products with its own 16 x 64 slice of the score tile, so the only
 * block-wide synchronisation is around loading the shared tiles.
 *   forward   block = 64 queries of one head, on mma.sync with register
 *             fragments (FlashAttention-2's scheme, see fwd:: below): one
 *             pass over the key tiles up to the diagonal with an online
 *             (max, sum) per row, O rescaled as the max grows; lse saved.
 *   backward  D = dout . out per row (a small kernel), then two kernels, so
 *             that every gradient element has one writer (no atomics):
 *             dQ: block = 64 queries, key tiles up to the diagonal,
 *                 dQ += dS K with dS = P (dP - D) / sqrt(hs), dP = dO V^T;
 *             dK, dV: block = 64 keys, query tiles from the diagonal on,
 *                 from S^T = K Q^T and dP^T = V dO^T: dV += P^T dO, dK += dS^T Q.
 * Element-wise work on a 16 x 64 slice: lane l takes row l % 16 and the
 * columns [32 (l / 16), +32); the two lanes of a row combine by a shuffle.
 * Grids run the longest tiles (most keys or queries) first. */
#include "ops_cuda_impl.cuh"

#include <math.h>
#include <mma.h>
#include <stdlib.h>
#include <string.h>
#include <type_traits>

namespace tdc {
namespace {

using namespace nvcuda;

constexpr int BM = 64;  /* rows of a block's own tile */
constexpr int BN = 64;  /* columns of a score tile */
constexpr int WARPS = 4;
constexpr int THREADS = 32 * WARPS;
constexpr int SP = BN + 4; /* pitch (floats) of a warp's fp32 score slice */
constexpr int PP = BN + 8; /* pitch (elements) of a warp's 16-bit P / dS slice */

/* Shared memory: NT head tiles (64 x HS, pitch QP), then per warp an fp32
 * region (scores, dP, or the output slice at the end), per warp P and dS
 * slices, then lse and D of 64 rows.  Every piece starts 128-byte aligned
 * and every WMMA pointer lands on a 32-byte boundary. */
template <int HS> struct Layout {
    static constexpr int QP = HS + 8;
    static constexpr int OP = HS + 4;
    static constexpr int TILE = BM * QP;
    static constexpr int FWARP = 2 * 16 * SP > 16 * OP ? 2 * 16 * SP : 16 * OP;
    static constexpr int PWARP = 16 * PP;
    __host__ __device__ static constexpr size_t tiles_bytes(int nt) { return (size_t)nt * TILE * 2; }
    __host__ __device__ static constexpr size_t f_bytes() { return (size_t)WARPS * FWARP * 4; }
    __host__ __device__ static constexpr size_t p_bytes() { return (size_t)WARPS * PWARP * 2; }
    __host__ __device__ static constexpr size_t bytes(int nt) { return tiles_bytes(nt) + f_bytes() + 2 * p_bytes() + 2 * BM * 4; }
};

template <typename T> using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <typename T> using FragBT = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;
template <typename T> using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

/* dst (64 x HS, pitch QP) = rows r0 .. r0+63 of a head matrix whose row i
 * starts at src + i * stride; rows at or past T are zero.  The vector path
 * issues all of a thread's 16-byte loads before its shared-memory stores. */
template <typename T, int HS>
__device__ void load_tile(T *dst, const T *src, size_t stride, int r0, int T_, bool vec)
{
    constexpr int QP = Layout<HS>::QP, CH = HS / 8, ITERS = BM * CH / THREADS;
    static_assert(BM * CH % THREADS == 0, "a tile is whole iterations of the block");
    constexpr int BATCH = 4; /* loads in flight per thread: bounded, for the register budget */
    static_assert(ITERS % BATCH == 0, "whole batches");
    if (vec) {
#pragma unroll
        for (int g = 0; g < ITERS; g += BATCH) {
            int4 v[BATCH];
#pragma unroll
            for (int i = 0; i < BATCH; i++) {
                const int idx = threadIdx.x + (g + i) * THREADS, row = idx / CH, c8 = (idx % CH) * 8;
                v[i] = r0 + row < T_ ? *reinterpret_cast<const int4 *>(src + (size_t)(r0 + row) * stride + c8)
                                     : make_int4(0, 0, 0, 0);
            }
#pragma unroll
            for (int i = 0; i < BATCH; i++) {
                const int idx = threadIdx.x + (g + i) * THREADS, row = idx / CH, c8 = (idx % CH) * 8;
                *reinterpret_cast<int4 *>(dst + row * QP + c8) = v[i];
            }
        }
        return;
    }
    for (int it = 0; it < ITERS; it++) {
        const int idx = threadIdx.x + it * THREADS, row = idx / CH, c8 = (idx % CH) * 8;
        T *d = dst + row * QP + c8;
        if (r0 + row < T_) {
            const T *s = src + (size_t)(r0 + row) * stride + c8;
#pragma unroll
            for (int j = 0; j < 8; j++) d[j] = s[j];
        } else {
            *reinterpret_cast<int4 *>(d) = make_int4(0, 0, 0, 0);
        }
    }
}

/* The warp's 16 rows of A (fragments, k = HS) times B^T, where B is a
 * 64 x HS tile: out (16 x 64, pitch SP) = A B^T. */
template <typename T, int HS>
__device__ __forceinline__ void scores(float *out, const FragA<T> (&a)[HS / 16], const T *B)
{
    constexpr int QP = Layout<HS>::QP;
#pragma unroll
    for (int n = 0; n < BN / 16; n++) {
        FragC acc;
        wmma::fill_fragment(acc, 0.0f);
#pragma unroll
        for (int k = 0; k < HS / 16; k++) {
            FragBT<T> b;
            wmma::load_matrix_sync(b, B + n * 16 * QP + k * 16, QP);
            wmma::mma_sync(acc, a[k], b, acc);
        }
        wmma::store_matrix_sync(out + n * 16, acc, SP, wmma::mem_row_major);
    }
}

/* The same with A's 16 rows read from a shared tile (pitch QP) as needed:
 * fewer registers, for the kernel that holds two sets of accumulators. */
template <typename T, int HS>
__device__ __forceinline__ void scores_s(float *out, const T *A, const T *B)
{
    constexpr int QP = Layout<HS>::QP;
#pragma unroll
    for (int n = 0; n < BN / 16; n++) {
        FragC acc;
        wmma::fill_fragment(acc, 0.0f);
#pragma unroll
        for (int k = 0; k < HS / 16; k++) {
            FragA<T> a;
            FragBT<T> b;
            wmma::load_matrix_sync(a, A + k * 16, QP);
            wmma::load_matrix_sync(b, B + n * 16 * QP + k * 16, QP);
            wmma::mma_sync(acc, a, b, acc);
        }
        wmma::store_matrix_sync(out + n * 16, acc, SP, wmma::mem_row_major);
    }
}

/* acc (16 x HS) += P (16 x 64, pitch PP) times the 64 x HS tile V. */
template <typename T, int HS>
__device__ __forceinline__ void accumulate(FragC (&acc)[HS / 16], const T *P, const T *V)
{
    constexpr int QP = Layout<HS>::QP;
#pragma unroll
    for (int k = 0; k < BN / 16; k++) {
        FragA<T> a;
        wmma::load_matrix_sync(a, P + k * 16, PP);
#pragma unroll
        for (int n = 0; n < HS / 16; n++) {
            FragB<T> b;
            wmma::load_matrix_sync(b, V + k * 16 * QP + n * 16, QP);
            wmma::mma_sync(acc[n], a, b, acc[n]);
        }
    }
}

template <typename T, int HS>
__device__ __forceinline__ void load_rows(FragA<T> (&a)[HS / 16], const T *tile_rows)
{
#pragma unroll
    for (int k = 0; k < HS / 16; k++) wmma::load_matrix_sync(a[k], tile_rows + k * 16, Layout<HS>::QP);
}

/* Writes the warp's 16 x HS accumulator rows to dst rows (row0 + rr) with
 * row stride `stride` (rows at or past T skipped), through the warp's fp32
 * region; adds to what is there when `add`. */
template <typename T, int HS>
__device__ void write_rows(T *dst, size_t stride, int row0, int T_, FragC (&acc)[HS / 16], float *fw, bool add)
{
    constexpr int OP = Layout<HS>::OP;
    __syncwarp();
#pragma unroll
    for (int n = 0; n < HS / 16; n++) wmma::store_matrix_sync(fw + n * 16, acc[n], OP, wmma::mem_row_major);
    __syncwarp();
    const int lane = threadIdx.x % 32;
    for (int rr = 0; rr < 16; rr++) {
        if (row0 + rr >= T_) break;
        T *d = dst + (size_t)(row0 + rr) * stride;
        for (int i = lane; i < HS; i += 32) d[i] = from_f32<T>(add ? to_f32(d[i]) + fw[rr * OP + i] : fw[rr * OP + i]);
    }
    __syncwarp();
}

struct Smem {
    unsigned char *base;
    template <typename T, int HS> __device__ T *tile(int i) const { return (T *)base + (size_t)i * Layout<HS>::TILE; }
    template <int HS> __device__ float *fwarp(int nt, int w) const
    {
        return (float *)(base + Layout<HS>::tiles_bytes(nt)) + (size_t)w * Layout<HS>::FWARP;
    }
    template <typename T, int HS> __device__ T *pwarp(int nt, int which, int w) const
    {
        return (T *)(base + Layout<HS>::tiles_bytes(nt) + Layout<HS>::f_bytes() + which * Layout<HS>::p_bytes()) +
               (size_t)w * Layout<HS>::PWARP;
    }
    template <int HS> __device__ float *rowvals(int nt, int which) const
    {
        return (float *)(base + Layout<HS>::tiles_bytes(nt) + Layout<HS>::f_bytes() + 2 * Layout<HS>::p_bytes()) +
               which * BM;
    }
};

/* --- forward -------------------------------------------------------------------------- */

/* The forward runs on mma.sync (m16n8k16) with fragments in registers, as
 * FlashAttention-2 does: block = 64 queries of one head, 4 warps of 16 rows;
 * key and value tiles of 64 rows stream through two shared-memory stages
 * (cp.async, the next tile loading while this one is used); per tile
 * S = Q K^T stays in registers, the row maximum and sum are updated online
 * (exp2 of scores pre-scaled by log2 e / sqrt(hs)), P is rounded to the
 * storage type in registers and O += P V; O is divided by the row sum at the
 * end.  lse = max + log(sum), as the backward wants it. */
namespace fwd {

constexpr int P = 8; /* padding (elements) of a shared row: conflict-free ldmatrix */

__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

/* d += a b: a 16x16 (row), b 16x8 (col), fp32 accumulate. */
template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1)
{
    if constexpr (std::is_same<T, __nv_bfloat16>::value)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi)
{
    uint32_t r;
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        memcpy(&r, &v, 4);
    } else {
        __half2 v = __floats2half2_rn(lo, hi);
        memcpy(&r, &v, 4);
    }
    return r;
}

/* Rows r0 .. r0+63 of a head matrix (row i at src + i * stride, HS wide)
 * into dst (pitch HS + P); rows at or past T are zero.  vec: 16-byte
 * cp.async (asynchronous: commit and wait), else element copies. */
template <typename T, int HS>
__device__ __forceinline__ void load(T *dst, const T *src, size_t stride, int r0, int T_, bool vec)
{
    constexpr int CH = HS / 8, ITERS = BM * CH / THREADS;
#pragma unroll
    for (int it = 0; it < ITERS; it++) {
        const int idx = threadIdx.x + it * THREADS, row = idx / CH, c8 = (idx % CH) * 8;
        T *d = dst + row * (HS + P) + c8;
        const bool in = r0 + row < T_;
        const T *s = src + (size_t)(in ? r0 + row : 0) * stride + c8;
        if (vec) {
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(d)), "l"(s),
                         "r"(in ? 16 : 0));
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) d[j] = in ? s[j] : from_f32<T>(0.0f);
        }
    }
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <int HS> constexpr size_t smem_bytes() { return (size_t)5 * BM * (HS + P) * 2; }

template <typename T, int HS>
__global__ void __launch_bounds__(THREADS)
    kernel(T *out, float *lse, const T *qkv, int T_, int C, int NH, float scale_log2, bool vec)
{
    extern __shared__ __align__(128) unsigned char smem_raw[];
    constexpr int QP = HS + P, NK = BN / 8, NO = HS / 8;
    T *Qs = (T *)smem_raw, *Ks = Qs + BM * QP, *Vs = Ks + 2 * BM * QP;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c2 = 2 * (lane % 4);
    const int qt = gridDim.x - 1 - blockIdx.x, q0 = qt * BM, bh = blockIdx.y, b = bh / NH, h = bh % NH;
    const size_t rs = 3 * (size_t)C;
    const T *q_base = qkv + (size_t)b * T_ * rs + (size_t)h * HS;
    const T *k_base = q_base + C, *v_base = q_base + 2 * (size_t)C;

    load<T, HS>(Qs, q_base, rs, q0, T_, vec);
    load<T, HS>(Ks, k_base, rs, 0, T_, vec);
    load<T, HS>(Vs, v_base, rs, 0, T_, vec);
    commit();

    uint32_t qa[HS / 16][4];
    float o[NO][4];
#pragma unroll
    for (int n = 0; n < NO; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    const int row0 = q0 + warp * 16 + g, row1 = row0 + 8;

    for (int kt = 0; kt <= qt; kt++) {
        const int st = kt & 1;
        if (kt < qt) {
            load<T, HS>(Ks + (st ^ 1) * BM * QP, k_base, rs, (kt + 1) * BN, T_, vec);
            load<T, HS>(Vs + (st ^ 1) * BM * QP, v_base, rs, (kt + 1) * BN, T_, vec);
            commit();
            wait<1>();
        } else {
            wait<0>();
        }
        __syncthreads();
        if (kt == 0) {
#pragma unroll
            for (int k = 0; k < HS / 16; k++)
                ldsm_x4(qa[k], Qs + (warp * 16 + lane % 16) * QP + k * 16 + (lane / 16) * 8);
        }
        const T *Kt = Ks + st * BM * QP, *Vt = Vs + st * BM * QP;
        /* S (16 x 64) = Q K^T */
        float s[NK][4];
#pragma unroll
        for (int n = 0; n < NK; n++) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
            for (int k = 0; k < HS / 16; k += 2) {
                uint32_t kb[4];
                ldsm_x4(kb, Kt + (n * 8 + lane % 8) * QP + k * 16 + (lane / 8) * 8);
                mma<T>(s[n], qa[k], kb[0], kb[1]);
                mma<T>(s[n], qa[k + 1], kb[2], kb[3]);
            }
        }
        /* scale, causal mask on the diagonal tile, online max and sum */
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int n = 0; n < NK; n++) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                s[n][j] *= scale_log2;
                if (kt == qt) {
                    const int key = kt * BN + n * 8 + c2 + (j & 1), row = j < 2 ? row0 : row1;
                    if (key > row) s[n][j] = -INFINITY;
                }
            }
            mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
            mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float a0 = exp2f(m0 - mx0), a1 = exp2f(m1 - mx1);
        m0 = mx0;
        m1 = mx1;
        float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
        for (int n = 0; n < NK; n++) {
            s[n][0] = exp2f(s[n][0] - mx0);
            s[n][1] = exp2f(s[n][1] - mx0);
            s[n][2] = exp2f(s[n][2] - mx1);
            s[n][3] = exp2f(s[n][3] - mx1);
            ps0 += s[n][0] + s[n][1];
            ps1 += s[n][2] + s[n][3];
        }
        l0 = l0 * a0 + ps0;
        l1 = l1 * a1 + ps1;
#pragma unroll
        for (int n = 0; n < NO; n++) {
            o[n][0] *= a0;
            o[n][1] *= a0;
            o[n][2] *= a1;
            o[n][3] *= a1;
        }
        /* O += P V, P from the score registers */
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            uint32_t pa[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                              pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int n = 0; n < NO; n += 2) {
                uint32_t vb[4];
                ldsm_x4_t(vb, Vt + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * QP + n * 8 + (lane / 16) * 8);
                mma<T>(o[n], pa, vb[0], vb[1]);
                mma<T>(o[n + 1], pa, vb[2], vb[3]);
            }
        }
        __syncthreads(); /* the stage is reloaded next iteration */
    }
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = 1.0f / l0, inv1 = 1.0f / l1;
    T *o_base = out + (size_t)b * T_ * C + (size_t)h * HS;
    const bool ovec = ((uintptr_t)o_base & 3u) == 0; /* pairs as one 32-bit store */
#pragma unroll
    for (int n = 0; n < NO; n++)
#pragma unroll
        for (int hi = 0; hi < 2; hi++) {
            const int row = hi ? row1 : row0;
            const float inv = hi ? inv1 : inv0;
            if (row >= T_) continue;
            T *d = o_base + (size_t)row * C + n * 8 + c2;
            if (ovec) {
                *reinterpret_cast<uint32_t *>(d) = pack2<T>(o[n][2 * hi] * inv, o[n][2 * hi + 1] * inv);
            } else {
                d[0] = from_f32<T>(o[n][2 * hi] * inv);
                d[1] = from_f32<T>(o[n][2 * hi + 1] * inv);
            }
        }
    if (lane % 4 == 0) {
        const float ln2 = 0.69314718055994531f;
        if (row0 < T_) lse[(size_t)bh * T_ + row0] = (m0 + log2f(l0)) * ln2;
        if (row1 < T_) lse[(size_t)bh * T_ + row1] = (m1 + log2f(l1)) * ln2;
    }
}

} // namespace fwd

/* --- backward ------------------------------------------------------------------------- */

/* D (G*NH, T) = dout . out per row of each head, for sequences b0 .. b0+G-1. */
template <typename T>
__global__ void rowdot_kernel(float *D, const T *dout, const T *out, int b0, int rows, int T_, int C, int NH, int hs)
{
    const int lane = threadIdx.x % 32, r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (r >= rows) return;
    const int t = r % T_, bh = r / T_, h = bh % NH, b = b0 + bh / NH;
    const size_t off = ((size_t)b * T_ + t) * C + (size_t)h * hs;
    float d = 0.0f;
    for (int i = lane; i < hs; i += 32) d += to_f32(dout[off + i]) * to_f32(out[off + i]);
    d = warp_sum(d);
    if (lane == 0) D[r] = d;
}

template <typename T, int HS>
__global__ void __launch_bounds__(THREADS)
    flash_dq_kernel(T *dqkv, const T *dout, const T *qkv, const float *lse, const float *D, int b0, int T_, int C,
                    int NH, float scale, bool vec, bool add)
{
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const Smem sm{smem_raw};
    constexpr int NT = 4;
    T *Qs = sm.tile<T, HS>(0), *dOs = sm.tile<T, HS>(1), *Ks = sm.tile<T, HS>(2), *Vs = sm.tile<T, HS>(3);
    float *lse_s = sm.rowvals<HS>(NT, 0), *D_s = sm.rowvals<HS>(NT, 1);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane & 15, half = lane >> 4;
    float *fw = sm.fwarp<HS>(NT, warp), *dw = fw + 16 * SP;
    T *dsw = sm.pwarp<T, HS>(NT, 1, warp);
    const int qt = gridDim.x - 1 - blockIdx.x, q0 = qt * BM, bhl = blockIdx.y, b = b0 + bhl / NH, h = bhl % NH;
    const size_t rs = 3 * (size_t)C;
    const T *q_base = qkv + (size_t)b * T_ * rs + (size_t)h * HS;
    const T *do_base = dout + (size_t)b * T_ * C + (size_t)h * HS;
    const float *lse_h = lse + ((size_t)b * NH + h) * T_, *D_h = D + (size_t)bhl * T_;

    load_tile<T, HS>(Qs, q_base, rs, q0, T_, vec);
    load_tile<T, HS>(dOs, do_base, C, q0, T_, vec);
    if (threadIdx.x < BM) {
        const int qq = q0 + threadIdx.x;
        lse_s[threadIdx.x] = qq < T_ ? lse_h[qq] : 0.0f;
        D_s[threadIdx.x] = qq < T_ ? D_h[qq] : 0.0f;
    }
    __syncthreads();
    FragA<T> qa[HS / 16], doa[HS / 16];
    load_rows<T, HS>(qa, Qs + warp * 16 * Layout<HS>::QP);
    load_rows<T, HS>(doa, dOs + warp * 16 * Layout<HS>::QP);
    const int q = q0 + warp * 16 + r;
    const float row_lse = lse_s[warp * 16 + r], row_D = D_s[warp * 16 + r];

    FragC acc[HS / 16];
#pragma unroll
    for (int n = 0; n < HS / 16; n++) wmma::fill_fragment(acc[n], 0.0f);
    for (int kt = 0; kt <= qt; kt++) {
        __syncthreads();
        load_tile<T, HS>(Ks, q_base + C, rs, kt * BN, T_, vec);
        load_tile<T, HS>(Vs, q_base + 2 * (size_t)C, rs, kt * BN, T_, vec);
        __syncthreads();
        scores<T, HS>(fw, qa, Ks);  /* S */
        scores<T, HS>(dw, doa, Vs); /* dP */
        __syncwarp();
        const float *srow = fw + r * SP + half * 32, *dprow = dw + r * SP + half * 32;
        T *dsrow = dsw + r * PP + half * 32;
        const int key0 = kt * BN + half * 32;
        for (int j = 0; j < 32; j++) {
            float ds = 0.0f;
            if (q < T_ && key0 + j <= q) {
                const float p = expf(srow[j] * scale - row_lse);
                ds = p * (dprow[j] - row_D) * scale;
            }
            dsrow[j] = from_f32<T>(ds);
        }
        __syncwarp();
        accumulate<T, HS>(acc, dsw, Ks); /* dQ += dS K */
    }
    write_rows<T, HS>(dqkv + (size_t)b * T_ * rs + (size_t)h * HS, rs, q0 + warp * 16, T_, acc, fw, add);
}

template <typename T, int HS>
__global__ void __launch_bounds__(THREADS)
    flash_dkv_kernel(T *dqkv, const T *dout, const T *qkv, const float *lse, const float *D, int b0, int T_, int C,
                     int NH, float scale, bool vec, bool add)
{
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const Smem sm{smem_raw};
    constexpr int NT = 4;
    T *Ks = sm.tile<T, HS>(0), *Vs = sm.tile<T, HS>(1), *Qs = sm.tile<T, HS>(2), *dOs = sm.tile<T, HS>(3);
    float *lse_s = sm.rowvals<HS>(NT, 0), *D_s = sm.rowvals<HS>(NT, 1);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane & 15, half = lane >> 4;
    float *fw = sm.fwarp<HS>(NT, warp), *dw = fw + 16 * SP;
    T *pw = sm.pwarp<T, HS>(NT, 0, warp), *dsw = sm.pwarp<T, HS>(NT, 1, warp);
    const int kt = blockIdx.x, k0 = kt * BM, n_tiles = gridDim.x, bhl = blockIdx.y, b = b0 + bhl / NH, h = bhl % NH;
    const size_t rs = 3 * (size_t)C;
    const T *q_base = qkv + (size_t)b * T_ * rs + (size_t)h * HS;
    const T *do_base = dout + (size_t)b * T_ * C + (size_t)h * HS;
    const float *lse_h = lse + ((size_t)b * NH + h) * T_, *D_h = D + (size_t)bhl * T_;

    load_tile<T, HS>(Ks, q_base + C, rs, k0, T_, vec);
    load_tile<T, HS>(Vs, q_base + 2 * (size_t)C, rs, k0, T_, vec);
    const T *k_rows = Ks + warp * 16 * Layout<HS>::QP, *v_rows = Vs + warp * 16 * Layout<HS>::QP;
    const int key = k0 + warp * 16 + r;

    FragC dk[HS / 16], dv[HS / 16];
#pragma unroll
    for (int n = 0; n < HS / 16; n++) {
        wmma::fill_fragment(dk[n], 0.0f);
        wmma::fill_fragment(dv[n], 0.0f);
    }
    for (int qt = kt; qt < n_tiles; qt++) {
        const int q0 = qt * BN;
        __syncthreads();
        load_tile<T, HS>(Qs, q_base, rs, q0, T_, vec);
        load_tile<T, HS>(dOs, do_base, C, q0, T_, vec);
        if (threadIdx.x < BN) {
            const int qq = q0 + threadIdx.x;
            lse_s[threadIdx.x] = qq < T_ ? lse_h[qq] : 0.0f;
            D_s[threadIdx.x] = qq < T_ ? D_h[qq] : 0.0f;
        }
        __syncthreads();
        scores_s<T, HS>(fw, k_rows, Qs);  /* S^T: keys x queries */
        scores_s<T, HS>(dw, v_rows, dOs); /* dP^T */
        __syncwarp();
        const int c0 = half * 32;
        const float *srow = fw + r * SP + c0, *dprow = dw + r * SP + c0;
        T *prow = pw + r * PP + c0, *dsrow = dsw + r * PP + c0;
        for (int j = 0; j < 32; j++) {
            const int qq = q0 + c0 + j;
            float p = 0.0f, ds = 0.0f;
            if (qq < T_ && key <= qq) {
                p = expf(srow[j] * scale - lse_s[c0 + j]);
                ds = p * (dprow[j] - D_s[c0 + j]) * scale;
            }
            prow[j] = from_f32<T>(p);
            dsrow[j] = from_f32<T>(ds);
        }
        __syncwarp();
        accumulate<T, HS>(dv, pw, dOs); /* dV += P^T dO */
        accumulate<T, HS>(dk, dsw, Qs); /* dK += dS^T Q */
    }
    T *dk_base = dqkv + (size_t)b * T_ * rs + C + (size_t)h * HS;
    write_rows<T, HS>(dk_base, rs, k0 + warp * 16, T_, dk, fw, add);
    write_rows<T, HS>(dk_base + C, rs, k0 + warp * 16, T_, dv, fw, add);
}

/* Raises a kernel's dynamic shared memory limit (above 48 KiB needs it). */
template <typename K> td_status allow_smem(K kernel, size_t bytes, const char *what)
{
    return check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes), what);
}

/* Calls fn(T{}, HS) for the 16-bit storage types and the two head sizes. */
template <typename Fn> td_status dispatch16(td_dtype dt, int hs, Fn &&fn)
{
    if (dt == TD_DTYPE_BF16) return hs == 64 ? fn(__nv_bfloat16{}, std::integral_constant<int, 64>{})
                                             : fn(__nv_bfloat16{}, std::integral_constant<int, 128>{});
    return hs == 64 ? fn(__half{}, std::integral_constant<int, 64>{}) : fn(__half{}, std::integral_constant<int, 128>{});
}

} // namespace

bool flash_applies(td_dtype dt, int C, int NH)
{
    if (dt != TD_DTYPE_BF16 && dt != TD_DTYPE_F16) return false;
    if (NH <= 0 || C % NH) return false;
    const int hs = C / NH;
    if (hs != 64 && hs != 128) return false;
    const char *force = getenv("TD_OPS_CUDA_ATTENTION");
    return !(force && !strcmp(force, "gemm"));
}

size_t flash_scratch_bytes(int seqs, int T, int NH) { return align_up((size_t)seqs * NH * T * sizeof(float)); }

td_status flash_forward(td_dtype dt, void *out, float *lse, const void *qkv, int B, int T, int C, int NH,
                        cudaStream_t s)
{
    const int hs = C / NH, tiles = (T + BM - 1) / BM;
    const float scale = 1.0f / sqrtf((float)hs);
    const bool vec = aligned16(qkv);
    return dispatch16(dt, hs, [&](auto tag, auto hs_c) -> td_status {
        using X = decltype(tag);
        constexpr int HS = decltype(hs_c)::value;
        const size_t smem = fwd::smem_bytes<HS>();
        td_status st = allow_smem(fwd::kernel<X, HS>, smem, "flash attention forward: shared memory limit");
        if (st != TD_OK) return st;
        fwd::kernel<X, HS><<<dim3(tiles, B * NH), THREADS, smem, s>>>((X *)out, lse, (const X *)qkv, T, C, NH,
                                                                      scale * 1.4426950408889634f, vec);
        return check_launch("flash attention forward");
    });
}

td_status flash_backward(td_dtype dt, void *dqkv, const void *dout, const void *qkv, const void *out,
                         const float *lse, int B, int T, int C, int NH, bool add, void *scratch,
                         size_t scratch_bytes, cudaStream_t s)
{
    const int hs = C / NH, tiles = (T + BM - 1) / BM;
    const float scale = 1.0f / sqrtf((float)hs);
    const bool vec = aligned16(qkv) && aligned16(dout);
    int G = B;
    while (G > 1 && flash_scratch_bytes(G, T, NH) > scratch_bytes) G--;
    float *D = (float *)scratch;
    return dispatch16(dt, hs, [&](auto tag, auto hs_c) -> td_status {
        using X = decltype(tag);
        constexpr int HS = decltype(hs_c)::value;
        const size_t smem = Layout<HS>::bytes(4);
        td_status st = allow_smem(flash_dq_kernel<X, HS>, smem, "flash attention backward: shared memory limit");
        if (st == TD_OK)
            st = allow_smem(flash_dkv_kernel<X, HS>, smem, "flash attention backward: shared memory limit");
        if (st != TD_OK) return st;
        for (int b0 = 0; b0 < B; b0 += G) {
            const int nb = B - b0 < G ? B - b0 : G, rows = nb * NH * T;
            rowdot_kernel<X><<<(rows + 7) / 8, 256, 0, s>>>(D, (const X *)dout, (const X *)out, b0, rows, T, C, NH, hs);
            st = check_launch("flash attention backward (dout . out)");
            if (st != TD_OK) return st;
            flash_dq_kernel<X, HS><<<dim3(tiles, nb * NH), THREADS, smem, s>>>(
                (X *)dqkv, (const X *)dout, (const X *)qkv, lse, D, b0, T, C, NH, scale, vec, add);
            st = check_launch("flash attention backward (dQ)");
            if (st != TD_OK) return st;
            flash_dkv_kernel<X, HS><<<dim3(tiles, nb * NH), THREADS, smem, s>>>(
                (X *)dqkv, (const X *)dout, (const X *)qkv, lse, D, b0, T, C, NH, scale, vec, add);
            st = check_launch("flash attention backward (dK, dV)");
            if (st != TD_OK) return st;
        }
        return TD_OK;
    });
}

} // namespace tdc
