/* Flash attention for 16-bit storage and head sizes 64, 80, 96 and 128 (the
 * GPT-2 family: 124M..1.5B have hs 64, the 4.1B workload hs 128; LLaMA and
 * Qwen2 hs 64 or 128; 80 and 96 elsewhere, Phi's), causal, in the scheme of FlashAttention-2 (Dao, 2023), with
 * grouped-query attention: NKV key/value heads, each shared by group = NH /
 * NKV consecutive query heads; a row of qkv holds the NH query heads, then
 * the NKV key heads, then the NKV value heads (NKV = NH: GPT-2's q, k, v).
 * Nothing of size T x T touches device memory.  Same contract as the GEMM path (ops_cuda_attention.cu):
 * saves lse (B,NH,T); P and dS are rounded to the storage type before their
 * products; fp32 everywhere else.
 *
 * Every product runs on the tensor cores (16-bit in, fp32 accumulate), and
 * the score tiles stay in registers: an accumulator tile of S is laid out as
 * the A operand of the next product, so P or dS go from S to the next
 * product without shared memory.  A block has 4 warps; each owns 16 of the
 * block's 64 rows.  The streamed tiles (64 rows x hs) go through two
 * shared-memory stages with cp.async: the next tile loads while this one is
 * used.  The products have two engines (SyncMma, WgMma below; the kernels
 * are templates over them): mma.sync m16n8k16 with ldmatrix operands, each
 * warp its 16 rows, on every device; and, where the device runs this
 * file's sm_90a code, wgmma over the block's 64 rows as one warpgroup
 * (hs 64 and 128), 1.5-1.6x faster on an H200 with the same bits.
 *   forward   block = 64 queries of one head; key tiles up to the diagonal;
 *             S = Q K^T, online (max, sum) per row with O rescaled as the max
 *             grows (exp2 of scores pre-scaled by log2 e / sqrt(hs)); O / sum
 *             and lse = max + log(sum) at the end.
 *   backward  D = dout . out per row (a small kernel), then two kernels, so
 *             that every gradient element has one writer (no atomics, the
 *             same bits every run):
 *             dQ: block = 64 queries, key tiles up to the diagonal:
 *                 P = exp(S - lse), dP = dO V^T, dS = P (dP - D) / sqrt(hs),
 *                 dQ += dS K;
 *             dK, dV: block = 64 keys of one key/value head, for each
 *                 query head of its group in ascending order, query tiles
 *                 from the diagonal on, in the transposed orientation (rows
 *                 are keys): S^T = K Q^T, dV += P^T dO, dP^T = V dO^T,
 *                 dK += dS^T Q.  The group's sum stays in the block's fp32
 *                 registers: one writer per element, a fixed order.
 * Packed documents (pos not NULL, ops.h): query t reads keys from its
 * document's start t - pos[t] on.  A query block starts at the key tile of
 * the lowest document start among its rows; a key block of dK/dV stops after
 * the query tile of the last query that can still see one of its keys; in
 * the tiles visited, keys before a row's start are masked like the future
 * (a row that sees no key of a tile leaves its running max and sum alone).
 * Only the tiles that can hold a masked score (the diagonal, every tile with
 * packed documents, in the backward a query tile that runs past T) test each
 * element; the others, most of a long sequence, take a loop without the
 * tests that does the same operations on the same values (the same bits).
 * Grids run the longest tiles (most keys or queries) first (for GQA's dK/dV
 * all heads' longest tiles first, see flash_dkv_kernel).  With NKV = NH
 * every index and every operation is what it was before GQA (group 1): the
 * GPT-2 path gives the same bits at the same speed.
 * Why 64 queries a block: blocks of 128 (each warp two 16-row tiles, every
 * K/V fragment from shared memory serving both) give the same bits but need
 * about 250 registers a thread (ptxas -v), so two blocks an SM, where at hs
 * 64 the 64-query forward fits four and dQ three; at hs 128 dQ spills.
 * Why two passes for the backward (7 products a (query tile, key tile) pair
 * where one pass needs 5): a one pass in which each key block adds its
 * share of dQ into an fp32 sum, the shares taken in a fixed order through a
 * turn per (head, query tile) passed from block to block (so the bits still
 * repeat), gave the same dK and dV bits and dQ within rounding, but was
 * measured slower than the two passes at every shape of bench/kernels.py,
 * most with grouped-query heads: the ordered sums cost more than the two
 * products they save. */
#include "kernels.cuh"
#include "wgmma.cuh"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <type_traits>

namespace tdc {
namespace {

constexpr int BM = 64;  /* rows of a block's own tile */
constexpr int BN = 64;  /* rows of a streamed tile (columns of a score tile) */
/* Equal, so that every key of tile kt comes before every query of a tile qt > kt:
 * the tiles below the diagonal need no causal mask. */
static_assert(BM == BN, "query and key tiles of one size");
constexpr int WARPS = 4;
constexpr int THREADS = 32 * WARPS;
constexpr int PAD = 8;  /* elements of padding per shared row: conflict-free ldmatrix */
constexpr float LOG2E = 1.4426950408889634f;

/* Where the heads of sequence b sit in qkv (rows `rs` elements apart) and in
 * out (rows NH * HS apart). */
template <int HS> struct Heads {
    int NH, NKV;
    __device__ __forceinline__ size_t rs() const { return (size_t)(NH + 2 * NKV) * HS; }
    __device__ __forceinline__ size_t q_col(int h) const { return (size_t)h * HS; }
    __device__ __forceinline__ size_t k_col(int g) const { return (size_t)(NH + g) * HS; }
    __device__ __forceinline__ size_t v_col(int g) const { return (size_t)(NH + NKV + g) * HS; }
    __device__ __forceinline__ int kv_of(int h) const { return h / (NH / NKV); }
    /* k_col(kv_of(h)) - q_col(h): from a query head to its key head in a row
     * (offsets from one base pointer keep the register count of GPT-2's) */
    __device__ __forceinline__ int k_from_q(int h) const { return (NH + kv_of(h) - h) * HS; }
};

template <int HS> __host__ __device__ constexpr int pitch()
{
    static_assert(HS % 16 == 0, "head sizes in whole mma steps of 16");
    return HS + PAD;
}
template <int HS> __host__ __device__ constexpr size_t tile_bytes() { return (size_t)BM * pitch<HS>() * 2; }

__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
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

/* Two floats rounded to T, the first in the low half. */
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

template <typename T> __device__ __forceinline__ float2 unpack2(uint32_t v)
{
    T e[2];
    memcpy(e, &v, 4);
    return make_float2(to_f32(e[0]), to_f32(e[1]));
}

/* Rows r0 .. r0+63 of a head matrix (row i at src + i * stride, HS wide)
 * into dst (pitch HS + PAD); rows at or past T are zero.  vec: 16-byte
 * cp.async (asynchronous: commit, then wait), else element copies. */
template <typename T, int HS>
__device__ __forceinline__ void load_rows(T *dst, const T *src, size_t stride, int r0, int T_, bool vec)
{
    constexpr int CH = HS / 8, ITERS = BM * CH / THREADS;
    static_assert(BM * CH % THREADS == 0, "a tile is whole iterations of the block");
#pragma unroll
    for (int it = 0; it < ITERS; it++) {
        const int idx = threadIdx.x + it * THREADS, row = idx / CH, c8 = (idx % CH) * 8;
        T *d = dst + row * pitch<HS>() + c8;
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

/* The first key a query row may read: its document's start (0 without pos). */
__device__ __forceinline__ int doc_start(const int *pos, int row) { return pos ? row - pos[row] : 0; }

/* The key tile of the lowest document start among rows q0 .. q0+BM-1 (below
 * T) of a sequence's pos; 0 without pos.  Every thread of the block calls it. */
__device__ __forceinline__ int first_key_tile(const int *pos, int q0, int T_)
{
    __shared__ int lo;
    if (!pos) return 0;
    if (threadIdx.x == 0) lo = q0;
    __syncthreads();
    if (threadIdx.x < BM && q0 + (int)threadIdx.x < T_) atomicMin(&lo, doc_start(pos, q0 + threadIdx.x));
    __syncthreads();
    const int first = lo / BN;
    __syncthreads(); /* lo is read by all before a later call rewrites it */
    return first;
}

/* One past the query tile of the last query (below T) whose document starts
 * at or before key k_last, the last key of a key block; n_tiles without pos. */
__device__ __forceinline__ int query_tile_end(const int *pos, int k0, int k_last, int T_, int n_tiles)
{
    __shared__ int hi;
    if (!pos) return n_tiles;
    if (threadIdx.x == 0) hi = k0;
    __syncthreads();
    for (int r = k0 + threadIdx.x; r < T_; r += blockDim.x)
        if (doc_start(pos, r) <= k_last) atomicMax(&hi, r);
    __syncthreads();
    const int end = hi / BM + 1;
    __syncthreads();
    return end;
}

template <int R> __device__ __forceinline__ void zero(float (&acc)[R][4])
{
#pragma unroll
    for (int n = 0; n < R; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
}

/* Key/value tile kt ready in shared stage kt & 1 (returned), with tile kt + 1
 * (when kt < last) loading into the other stage: the forward's and dQ's loop
 * over the key tiles. */
template <typename T, int HS, typename E>
__device__ __forceinline__ int kv_stage(T *Ks, T *Vs, const T *k_base, const T *v_base, size_t rs, int kt, int first,
                                        int last, int T_, bool vec)
{
    const int st = (kt - first) & 1;
    if (kt < last) {
        E::load(Ks + (st ^ 1) * E::TILE, k_base, rs, (kt + 1) * BN, T_, vec);
        E::load(Vs + (st ^ 1) * E::TILE, v_base, rs, (kt + 1) * BN, T_, vec);
        commit();
        wait<1>();
    } else {
        wait<0>();
    }
    E::ready();
    __syncthreads();
    return st;
}

/* s (16 x 64) = A B^T: A the warp's 16 rows (pitch HS + PAD, HS wide), B a
 * 64-row tile.  s[n] is the m16n8 accumulator of columns [8n, 8n + 8).  The
 * head's 16-column steps go two at a time (one ldmatrix x4 of B serves
 * both); an odd last one (hs 80) takes an x2 of its own. */
template <typename T, int HS>
__device__ __forceinline__ void mm_abt(float (&s)[BN / 8][4], const T *A, const T *B)
{
    constexpr int QP = pitch<HS>();
    const int lane = threadIdx.x % 32;
    zero(s);
#pragma unroll
    for (int k = 0; k + 1 < HS / 16; k += 2) {
        uint32_t a0[4], a1[4];
        ldsm_x4(a0, A + (lane % 16) * QP + k * 16 + (lane / 16) * 8);
        ldsm_x4(a1, A + (lane % 16) * QP + (k + 1) * 16 + (lane / 16) * 8);
#pragma unroll
        for (int n = 0; n < BN / 8; n++) {
            uint32_t b[4];
            ldsm_x4(b, B + (n * 8 + lane % 8) * QP + k * 16 + (lane / 8) * 8);
            mma<T>(s[n], a0, b[0], b[1]);
            mma<T>(s[n], a1, b[2], b[3]);
        }
    }
    if constexpr (HS / 16 % 2) {
        constexpr int k = HS / 16 - 1;
        uint32_t a0[4];
        ldsm_x4(a0, A + (lane % 16) * QP + k * 16 + (lane / 16) * 8);
#pragma unroll
        for (int n = 0; n < BN / 8; n++) {
            uint32_t b[2];
            ldsm_x2(b, B + (n * 8 + lane % 8) * QP + k * 16 + ((lane / 8) % 2) * 8);
            mma<T>(s[n], a0, b[0], b[1]);
        }
    }
}

/* acc (16 x HS) += X B: X (16 x 64) the score-layout registers x, rounded to
 * T; B a 64-row tile read as (64 x HS) row-major. */
template <typename T, int HS>
__device__ __forceinline__ void mm_xb(float (&acc)[HS / 8][4], const float (&x)[BN / 8][4], const T *B)
{
    constexpr int QP = pitch<HS>();
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
        const uint32_t a[4] = {pack2<T>(x[2 * kk][0], x[2 * kk][1]), pack2<T>(x[2 * kk][2], x[2 * kk][3]),
                               pack2<T>(x[2 * kk + 1][0], x[2 * kk + 1][1]),
                               pack2<T>(x[2 * kk + 1][2], x[2 * kk + 1][3])};
#pragma unroll
        for (int n = 0; n < HS / 8; n += 2) {
            uint32_t b[4];
            ldsm_x4_t(b, B + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * QP + n * 8 + (lane / 16) * 8);
            mma<T>(acc[n], a, b[0], b[1]);
            mma<T>(acc[n + 1], a, b[2], b[3]);
        }
    }
}

/* The warp's 16 x HS accumulator into rows row0 (c0, c1) and row0 + 8 (c2,
 * c3) of dst (row stride `stride`), times mul0 / mul1, added to what is
 * there when `add`; rows at or past T skipped. */
template <typename T, int HS>
__device__ __forceinline__ void store_rows(T *dst, size_t stride, int row0, int T_, const float (&acc)[HS / 8][4],
                                           float mul0, float mul1, bool add)
{
    const int c2 = 2 * (threadIdx.x % 4);
    const bool vec = ((uintptr_t)dst & 3u) == 0 && stride % 2 == 0; /* pairs as one 32-bit access */
#pragma unroll
    for (int n = 0; n < HS / 8; n++)
#pragma unroll
        for (int hi = 0; hi < 2; hi++) {
            const int row = row0 + 8 * hi;
            if (row >= T_) continue;
            const float mul = hi ? mul1 : mul0;
            float v0 = acc[n][2 * hi] * mul, v1 = acc[n][2 * hi + 1] * mul;
            T *d = dst + (size_t)row * stride + n * 8 + c2;
            if (vec) {
                uint32_t *d32 = reinterpret_cast<uint32_t *>(d);
                if (add) {
                    const float2 old = unpack2<T>(*d32);
                    v0 += old.x;
                    v1 += old.y;
                }
                *d32 = pack2<T>(v0, v1);
            } else {
                d[0] = from_f32<T>(add ? to_f32(d[0]) + v0 : v0);
                d[1] = from_f32<T>(add ? to_f32(d[1]) + v1 : v1);
            }
        }
}

/* --- the products' engines ------------------------------------------------------------ */

/* mma.sync m16n8k16 on ldmatrix operands (sm_80 on): tiles of 64 rows
 * padded to pitch HS + PAD; each warp multiplies its own 16 rows. */
template <int HS> struct SyncMma {
    static constexpr int TILE = BM * pitch<HS>(); /* elements */
    static constexpr size_t TILE_BYTES = tile_bytes<HS>();
    static constexpr size_t SLACK = 0;
    template <typename T> static __device__ __forceinline__ T *tiles(unsigned char *raw) { return (T *)raw; }
    template <typename T>
    static __device__ __forceinline__ void load(T *dst, const T *src, size_t stride, int r0, int T_, bool vec)
    {
        load_rows<T, HS>(dst, src, stride, r0, T_, vec);
    }
    /* the loads waited for, before the barrier that hands them to all warps */
    static __device__ __forceinline__ void ready() {}
    /* s = A B^T for this warp's 16 of A's 64 rows */
    template <typename T> static __device__ __forceinline__ void abt(float (&s)[BN / 8][4], const T *A, const T *B)
    {
        mm_abt<T, HS>(s, A + (threadIdx.x / 32) * 16 * pitch<HS>(), B);
    }
    template <typename T>
    static __device__ __forceinline__ void xb(float (&acc)[HS / 8][4], const float (&x)[BN / 8][4], const T *B)
    {
        mm_xb<T, HS>(acc, x, B);
    }
};

/* wgmma (sm_90a, wgmma.cuh): the block's four warps are one warpgroup, and
 * a product is m64nNk16 steps over all 64 rows with B (and the A of A B^T)
 * read from shared memory through matrix descriptors; X of X B (P, dS) goes
 * in from registers, as the softmax left it: wgmma's accumulator layout is
 * mma.sync's, each warp 16 rows.  A warp's rows, their order of products
 * and the fp32 sums are those of SyncMma: the same bits (test_ops_cuda's
 * test_attention_engines).  Tiles are 64 rows in the 128-byte swizzle: HS/64 atoms
 * of 64 rows x 128 B (a row's 64 elements), the 16-byte chunk c of row r
 * at r * 128 + (c ^ r % 8) * 16, atoms 1024-byte aligned.  One layout
 * serves a tile's two uses: K-major in A B^T (the head dimension is the
 * contraction: a 16-wide step is 32 bytes into the atom) and MN-major with
 * the transpose bit in X B (rows are the contraction: a step is 16 rows,
 * 2048 bytes; atoms LBO = 8 KiB apart, 8-row groups SBO = 1 KiB).  Each
 * product is waited for before the next: a backward that issued dP beside
 * S and let dV run while dS was taken gave the same bits but was measured
 * slower on an H200 (`tidal bench attention`, 16k tokens): hs 64 11-14%
 * (its dK/dV took 177 registers, two blocks an SM where 160 fit three),
 * hs 128 no faster. */
template <int HS> struct WgMma {
    static_assert(HS % 64 == 0, "whole 128-byte atoms");
    static constexpr int TILE = BM * HS;
    static constexpr size_t TILE_BYTES = (size_t)BM * HS * 2;
    static constexpr size_t SLACK = 1024; /* to align the first tile */
    static constexpr uint32_t ATOM = BM * 128;
    template <typename T> static __device__ __forceinline__ T *tiles(unsigned char *raw)
    {
        return (T *)(raw + ((1024u - (smem_addr(raw) & 1023u)) & 1023u));
    }
    /* 16-byte aligned rows only (the engine is chosen where they are) */
    template <typename T>
    static __device__ __forceinline__ void load(T *dst, const T *src, size_t stride, int r0, int T_, bool)
    {
        constexpr int CH = HS / 8, ITERS = BM * CH / THREADS;
        const uint32_t d0 = smem_addr(dst);
#pragma unroll
        for (int it = 0; it < ITERS; it++) {
            const int idx = threadIdx.x + it * THREADS, row = idx / CH, c = idx % CH;
            const bool in = r0 + row < T_;
            const T *s = src + (size_t)(in ? r0 + row : 0) * stride + c * 8;
            const uint32_t d = d0 + (c / 8) * ATOM + row * 128 + (((c % 8) ^ (row % 8)) << 4);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(s), "r"(in ? 16 : 0));
        }
    }
    /* what cp.async wrote, made visible to wgmma's (async proxy) reads */
    static __device__ __forceinline__ void ready()
    {
#ifdef TD_WGMMA
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
    }
    static __device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lbo, uint32_t sbo)
    {
        return (uint64_t)((addr & 0x3FFFFu) >> 4) | (uint64_t)((lbo >> 4) & 0x3FFFu) << 16 |
               (uint64_t)((sbo >> 4) & 0x3FFFu) << 32 | (uint64_t)1 << 62; /* 128-byte swizzle */
    }
    /* registers the wgmma reads or writes asynchronously stay where they are */
    template <int R> static __device__ __forceinline__ void pin(float (&x)[R])
    {
#pragma unroll
        for (int i = 0; i < R; i++) asm volatile("" : "+f"(x[i])::"memory");
    }
#ifdef TD_WGMMA
    /* the products issued since the last fence, committed and waited for */
    template <int R> static __device__ __forceinline__ void finish(float (&d)[R])
    {
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        pin(d);
    }
#endif
    template <typename T> static __device__ __forceinline__ void abt(float (&s)[BN / 8][4], const T *A, const T *B)
    {
#ifdef TD_WGMMA
        float(&d)[BN / 2] = reinterpret_cast<float(&)[BN / 2]>(s);
        const uint32_t a = smem_addr(A), b = smem_addr(B);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int k = 0; k < HS / 16; k++) {
            const uint32_t off = (k / 4) * ATOM + (k % 4) * 32;
            wgmma_ss<T>(d, desc(a + off, 16, 1024), desc(b + off, 16, 1024), k > 0);
        }
        finish(d);
#else
        __trap();
#endif
    }
    template <typename T>
    static __device__ __forceinline__ void xb(float (&acc)[HS / 8][4], const float (&x)[BN / 8][4], const T *B)
    {
#ifdef TD_WGMMA
        float(&d)[HS / 2] = reinterpret_cast<float(&)[HS / 2]>(acc);
        uint32_t p[BN / 16][4];
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            p[kk][0] = pack2<T>(x[2 * kk][0], x[2 * kk][1]);
            p[kk][1] = pack2<T>(x[2 * kk][2], x[2 * kk][3]);
            p[kk][2] = pack2<T>(x[2 * kk + 1][0], x[2 * kk + 1][1]);
            p[kk][3] = pack2<T>(x[2 * kk + 1][2], x[2 * kk + 1][3]);
        }
        const uint32_t b = smem_addr(B);
        pin(d);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) wgmma_rs_t<T, HS>(d, p[kk], desc(b + kk * 16 * 128, ATOM, 1024));
        finish(d);
#else
        __trap();
#endif
    }
};

/* --- forward -------------------------------------------------------------------------- */

template <typename E> constexpr size_t fwd_smem_bytes() { return 5 * E::TILE_BYTES + E::SLACK; }

template <typename T, int HS, typename E>
/* Four blocks an SM at hs 64 (128 registers; ptxas would take 133 and fit
 * three).  At hs 128 the bound of one block lets ptxas take more registers
 * (238 where it took 177), two blocks an SM either way: the forward ran
 * 1.17-1.20x faster with it on an H200 (`tidal bench attention --seq T
 * --head-dim 128 --heads 16 --kv-heads 4 or 16`, T 1024..8192). */
__global__ void __launch_bounds__(THREADS, HS == 64 ? 4 : 1)
    flash_forward_kernel(T *out, float *lse, const T *qkv, const int *pos, int T_, Heads<HS> hd, float scale_log2,
                         bool vec)
{
    extern __shared__ __align__(128) unsigned char smem_raw[];
    constexpr int NO = HS / 8;
    T *Qs = E::template tiles<T>(smem_raw), *Ks = Qs + E::TILE, *Vs = Ks + 2 * E::TILE;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, c2 = 2 * (lane % 4);
    const int qt = gridDim.x - 1 - blockIdx.x, q0 = qt * BM, bh = blockIdx.y, b = bh / hd.NH, h = bh % hd.NH;
    const int C = hd.NH * HS;
    const size_t rs = hd.rs();
    const T *q_base = qkv + (size_t)b * T_ * rs + (size_t)h * HS;
    const T *k_base = q_base + hd.k_from_q(h), *v_base = k_base + hd.NKV * HS;
    const int row0 = q0 + warp * 16 + lane / 4, row1 = row0 + 8;
    if (pos) pos += (size_t)b * T_;
    const int kt0 = first_key_tile(pos, q0, T_);
    const int start0 = row0 < T_ ? doc_start(pos, row0) : 0, start1 = row1 < T_ ? doc_start(pos, row1) : 0;

    E::load(Qs, q_base, rs, q0, T_, vec);
    E::load(Ks, k_base, rs, kt0 * BN, T_, vec);
    E::load(Vs, v_base, rs, kt0 * BN, T_, vec);
    commit();
    float o[NO][4];
    zero(o);
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

    for (int kt = kt0; kt <= qt; kt++) {
        const int st = kv_stage<T, HS, E>(Ks, Vs, k_base, v_base, rs, kt, kt0, qt, T_, vec);
        const T *Kt = Ks + st * E::TILE, *Vt = Vs + st * E::TILE;
        float s[BN / 8][4];
        E::abt(s, Qs, Kt);
        /* scale, causal mask on the diagonal tile, online max and sum */
        if (kt == qt || pos) {
#pragma unroll
            for (int n = 0; n < BN / 8; n++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int key = kt * BN + n * 8 + c2 + (j & 1);
                    s[n][j] *= scale_log2;
                    if (kt == qt && key > (j < 2 ? row0 : row1)) s[n][j] = -INFINITY;
                    if (pos && key < (j < 2 ? start0 : start1)) s[n][j] = -INFINITY; /* another document */
                }
        } else {
            /* below the diagonal, one document: nothing to mask.  __fmul_rn
             * is the same product, but one that ptxas cannot fuse with the
             * subtraction in exp2f below (in the masked loop a select stands
             * between them): the same bits */
#pragma unroll
            for (int n = 0; n < BN / 8; n++)
#pragma unroll
                for (int j = 0; j < 4; j++) s[n][j] = __fmul_rn(s[n][j], scale_log2);
        }
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int n = 0; n < BN / 8; n++) {
            mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
            mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        /* a row that has seen no key yet (all masked) keeps max -inf: its
         * exponentials are taken against 0, so they are 0, not NaN */
        const float base0 = mx0 == -INFINITY ? 0.0f : mx0, base1 = mx1 == -INFINITY ? 0.0f : mx1;
        const float a0 = exp2f(m0 - base0), a1 = exp2f(m1 - base1);
        m0 = mx0;
        m1 = mx1;
        float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
        for (int n = 0; n < BN / 8; n++) {
            s[n][0] = exp2f(s[n][0] - base0);
            s[n][1] = exp2f(s[n][1] - base0);
            s[n][2] = exp2f(s[n][2] - base1);
            s[n][3] = exp2f(s[n][3] - base1);
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
        E::xb(o, s, Vt); /* O += P V */
        __syncthreads();        /* this stage is reloaded next iteration */
    }
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    store_rows<T, HS>(out + (size_t)b * T_ * C + (size_t)h * HS, C, row0, T_, o, 1.0f / l0, 1.0f / l1, false);
    if (lane % 4 == 0) {
        const float ln2 = 0.69314718055994531f;
        if (row0 < T_) lse[(size_t)bh * T_ + row0] = (m0 + log2f(l0)) * ln2;
        if (row1 < T_) lse[(size_t)bh * T_ + row1] = (m1 + log2f(l1)) * ln2;
    }
}

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

/* The same D with 16-byte loads (dout and out 16-byte aligned; hs a multiple
 * of 8): 8 lanes a (row, head), items in memory order (b, t, h), so a warp
 * reads 4 heads' contiguous bytes; each lane sums its 8-element slices in
 * order, then the 8 lanes by butterflies.  The per-warp kernel above makes
 * 2-byte loads, a warp a head: 45 us a layer of W1, against 17 at the
 * bandwidth. */
template <typename T>
__global__ void __launch_bounds__(256)
    rowdot_vec_kernel(float *D, const T *dout, const T *out, int b0, int items, int T_, int C, int NH, int hs)
{
    const int g = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 8), lane = threadIdx.x % 8;
    float d = 0.0f;
    int t = 0, h = 0, bl = 0;
    if (g < items) {
        h = g % NH;
        t = (g / NH) % T_;
        bl = g / (NH * T_);
        const size_t off = ((size_t)(b0 + bl) * T_ + t) * C + (size_t)h * hs;
        for (int c = lane * VN; c < hs; c += 8 * VN) {
            float a[VN], o[VN];
            load8(a, dout + off, (size_t)c, (size_t)hs, true);
            load8(o, out + off, (size_t)c, (size_t)hs, true);
#pragma unroll
            for (int j = 0; j < VN; j++) d += a[j] * o[j];
        }
    }
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
    if (g < items && lane == 0) D[((size_t)bl * NH + h) * T_ + t] = d;
}

template <typename E> constexpr size_t bwd_smem_bytes()
{
    return 6 * E::TILE_BYTES + E::SLACK + 4 * BM * sizeof(float) + 2 * BM * sizeof(int);
}

/* dQ of 64 queries: key tiles 0 .. the diagonal. */
template <typename T, int HS, typename E>
__global__ void __launch_bounds__(THREADS)
    flash_dq_kernel(T *dqkv, const T *dout, const T *qkv, const float *lse, const float *D, const int *pos, int b0,
                    int T_, Heads<HS> hd, float scale, bool vec, bool add)
{
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *Qs = E::template tiles<T>(smem_raw), *dOs = Qs + E::TILE, *Ks = dOs + E::TILE, *Vs = Ks + 2 * E::TILE;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, c2 = 2 * (lane % 4);
    const int NH = hd.NH, qt = gridDim.x - 1 - blockIdx.x, q0 = qt * BM, bhl = blockIdx.y, b = b0 + bhl / NH,
              h = bhl % NH;
    const int C = NH * HS;
    const size_t rs = hd.rs();
    const T *q_base = qkv + (size_t)b * T_ * rs + (size_t)h * HS;
    const T *k_base = q_base + hd.k_from_q(h), *v_base = k_base + hd.NKV * HS;
    const T *do_base = dout + (size_t)b * T_ * C + (size_t)h * HS;
    const float *lse_h = lse + ((size_t)b * NH + h) * T_, *D_h = D + (size_t)bhl * T_;
    const int row0 = q0 + warp * 16 + lane / 4, row1 = row0 + 8;
    const float scale_log2 = scale * LOG2E;
    const float lse0 = row0 < T_ ? lse_h[row0] * LOG2E : 0.0f, lse1 = row1 < T_ ? lse_h[row1] * LOG2E : 0.0f;
    const float D0 = row0 < T_ ? D_h[row0] : 0.0f, D1 = row1 < T_ ? D_h[row1] : 0.0f;
    if (pos) pos += (size_t)b * T_;
    const int kt0 = first_key_tile(pos, q0, T_);
    const int start0 = row0 < T_ ? doc_start(pos, row0) : 0, start1 = row1 < T_ ? doc_start(pos, row1) : 0;

    E::load(Qs, q_base, rs, q0, T_, vec);
    E::load(dOs, do_base, C, q0, T_, vec);
    E::load(Ks, k_base, rs, kt0 * BN, T_, vec);
    E::load(Vs, v_base, rs, kt0 * BN, T_, vec);
    commit();
    float dq[HS / 8][4];
    zero(dq);
    /* no document mask and all 64 rows below T: the tiles below the diagonal mask nothing */
    const bool plain = !pos && q0 + BM <= T_;

    for (int kt = kt0; kt <= qt; kt++) {
        const int st = kv_stage<T, HS, E>(Ks, Vs, k_base, v_base, rs, kt, kt0, qt, T_, vec);
        const T *Kt = Ks + st * E::TILE, *Vt = Vs + st * E::TILE;
        float s[BN / 8][4], dp[BN / 8][4];
        E::abt(s, Qs, Kt); /* S */
        /* P = exp(S - lse) in s: a tile that masks nothing takes it before dP
         * (its exponentials beside dP's products), a masked tile after (of
         * the orders tried, the one where ptxas needs the fewest registers) */
        const bool lean = kt < qt && plain;
        if (lean) {
#pragma unroll
            for (int n = 0; n < BN / 8; n++)
#pragma unroll
                for (int j = 0; j < 4; j++) s[n][j] = exp2f(s[n][j] * scale_log2 - (j < 2 ? lse0 : lse1));
        }
        E::abt(dp, dOs, Vt); /* dP = dO V^T */
        if (!lean) {
#pragma unroll
            for (int n = 0; n < BN / 8; n++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int row = j < 2 ? row0 : row1, key = kt * BN + n * 8 + c2 + (j & 1);
                    const bool masked = key > row || row >= T_ || key < (j < 2 ? start0 : start1);
                    s[n][j] = masked ? 0.0f : exp2f(s[n][j] * scale_log2 - (j < 2 ? lse0 : lse1));
                }
        }
#pragma unroll
        for (int n = 0; n < BN / 8; n++)
#pragma unroll
            for (int j = 0; j < 4; j++) s[n][j] = s[n][j] * (dp[n][j] - (j < 2 ? D0 : D1)) * scale; /* dS */
        E::xb(dq, s, Kt); /* dQ += dS K */
        __syncthreads();
    }
    store_rows<T, HS>(dqkv + (size_t)b * T_ * rs + hd.q_col(h), rs, row0, T_, dq, 1.0f, 1.0f, add);
}

/* dK, dV of 64 keys of key/value head g: for each query head of g's group in
 * ascending order, query tiles from the diagonal to the end.  The (head,
 * tile) pairs form one sequence, double-buffered across head boundaries.
 * Block order: KT_MAJOR false, the grid is (key tiles, heads), a head's key
 * tiles adjacent (GPT-2's order); true, (heads, key tiles), every head's
 * first, longest tile before any second one.  A GQA block does group times
 * the work of a multi-head one, so in (key tiles, heads) order the last
 * heads' long tiles start late and leave the GPU idling at the end: on an
 * H100, key-tile-major runs GQA backward 4% (B16 T1024, 32 heads, 8 kv,
 * hs 64) to 20% (B1 T4096) faster, while GPT-2's order stays the better one
 * for its B32 1.5B shape (6%; there a head's Q and dO tiles stay in L2
 * between its adjacent key tiles). */
template <typename T, int HS, bool KT_MAJOR, typename E>
__global__ void __launch_bounds__(THREADS)
    flash_dkv_kernel(T *dqkv, const T *dout, const T *qkv, const float *lse, const float *D, const int *pos, int b0,
                     int T_, Heads<HS> hd, float scale, bool vec, bool add)
{
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *Ks = E::template tiles<T>(smem_raw), *Vs = Ks + E::TILE, *Qs = Vs + E::TILE, *dOs = Qs + 2 * E::TILE;
    float *lse_s = (float *)(dOs + 2 * E::TILE), *D_s = lse_s + 2 * BM; /* two stages each */
    int *start_s = (int *)(D_s + 2 * BM);
    const int NH = hd.NH, group = NH / hd.NKV;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, c2 = 2 * (lane % 4);
    const int kt = KT_MAJOR ? blockIdx.y : blockIdx.x, k0 = kt * BN, n_tiles = KT_MAJOR ? gridDim.y : gridDim.x,
              bgl = KT_MAJOR ? blockIdx.x : blockIdx.y, bl = bgl / hd.NKV,
              b = b0 + bl, g = bgl % hd.NKV, h_first = g * group, h_end = h_first + group;
    const size_t rs = hd.rs(), C = (size_t)NH * HS;
    const T *seq = qkv + (size_t)b * T_ * rs;
    const T *k_base = seq + hd.k_col(g), *v_base = seq + hd.v_col(g);
    const int key0 = k0 + warp * 16 + lane / 4; /* and key0 + 8 */
    const float scale_log2 = scale * LOG2E;
    if (pos) pos += (size_t)b * T_;
    const int q_end = query_tile_end(pos, k0, k0 + BN - 1, T_, n_tiles);

    auto stage_rows = [&](int h, int qt, int st) {
        const float *lse_h = lse + ((size_t)b * NH + h) * T_, *D_h = D + ((size_t)bl * NH + h) * T_;
        E::load(Qs + st * E::TILE, seq + hd.q_col(h), rs, qt * BM, T_, vec);
        E::load(dOs + st * E::TILE, dout + (size_t)b * T_ * C + (size_t)h * HS, C, qt * BM, T_, vec);
        if (threadIdx.x < BM) {
            const int q = qt * BM + threadIdx.x;
            lse_s[st * BM + threadIdx.x] = q < T_ ? lse_h[q] * LOG2E : 0.0f;
            D_s[st * BM + threadIdx.x] = q < T_ ? D_h[q] : 0.0f;
            start_s[st * BM + threadIdx.x] = q < T_ ? doc_start(pos, q) : 0;
        }
    };
    E::load(Ks, k_base, rs, k0, T_, vec);
    E::load(Vs, v_base, rs, k0, T_, vec);
    stage_rows(h_first, kt, 0);
    commit();
    float dk[HS / 8][4], dv[HS / 8][4];
    zero(dk);
    zero(dv);
    int st = 0;
    for (int h = h_first, qt = kt; h < h_end; st ^= 1) {
        /* the next (head, tile) pair, staged while this one is used */
        int nh = h, nqt = qt + 1;
        if (nqt == q_end) {
            nh++;
            nqt = kt;
        }
        if (nh < h_end) {
            stage_rows(nh, nqt, st ^ 1);
            commit();
            wait<1>();
        } else {
            wait<0>();
        }
        E::ready();
        __syncthreads();
        const T *Qt = Qs + st * E::TILE, *dOt = dOs + st * E::TILE;
        const float *lse_t = lse_s + st * BM, *D_t = D_s + st * BM;
        const int *start_t = start_s + st * BM;
        float s[BN / 8][4]; /* S^T: rows are keys, columns queries */
        E::abt(s, Ks, Qt);
        if (qt > kt && !pos && (qt + 1) * BM <= T_) {
            /* every query after every key, one document, all below T: no mask */
#pragma unroll
            for (int n = 0; n < BN / 8; n++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    s[n][j] = exp2f(s[n][j] * scale_log2 - lse_t[n * 8 + c2 + (j & 1)]); /* P^T */
        } else {
#pragma unroll
            for (int n = 0; n < BN / 8; n++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int ql = n * 8 + c2 + (j & 1), q = qt * BM + ql, key = key0 + (j < 2 ? 0 : 8);
                    const bool masked = q < key || q >= T_ || key < start_t[ql];
                    s[n][j] = masked ? 0.0f : exp2f(s[n][j] * scale_log2 - lse_t[ql]); /* P^T */
                }
        }
        E::xb(dv, s, dOt); /* dV += P^T dO */
        float dp[BN / 8][4];
        E::abt(dp, Vs, dOt); /* dP^T = V dO^T */
#pragma unroll
        for (int n = 0; n < BN / 8; n++)
#pragma unroll
            for (int j = 0; j < 4; j++) s[n][j] *= (dp[n][j] - D_t[n * 8 + c2 + (j & 1)]) * scale; /* dS^T */
        E::xb(dk, s, Qt); /* dK += dS^T Q */
        __syncthreads();
        h = nh;
        qt = nqt;
    }
    T *base = dqkv + (size_t)b * T_ * rs;
    store_rows<T, HS>(base + hd.k_col(g), rs, key0, T_, dk, 1.0f, 1.0f, add);
    store_rows<T, HS>(base + hd.v_col(g), rs, key0, T_, dv, 1.0f, 1.0f, add);
}

/* Raises a kernel's dynamic shared memory limit (above 48 KiB needs it). */
template <typename K> td_status allow_smem(K kernel, size_t bytes, const char *what)
{
    return check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes), what);
}

/* Calls fn(T{}, HS) for a head size the kernels are built for. */
template <typename T, typename Fn> td_status dispatch_hs(int hs, Fn &&fn)
{
    switch (hs) {
    case 64: return fn(T{}, std::integral_constant<int, 64>{});
    case 80: return fn(T{}, std::integral_constant<int, 80>{});
    case 96: return fn(T{}, std::integral_constant<int, 96>{});
    default: return fn(T{}, std::integral_constant<int, 128>{});
    }
}

/* Calls fn(T{}, HS) for the 16-bit storage types and the head sizes. */
template <typename Fn> td_status dispatch16(td_dtype dt, int hs, Fn &&fn)
{
    if (dt == TD_DTYPE_BF16) return dispatch_hs<__nv_bfloat16>(hs, fn);
    return dispatch_hs<__half>(hs, fn);
}

/* Whether the image the device runs is this file's sm_90a compile (the
 * wgmma engine's): each device compile of the file sets its own value. */
#ifdef TD_WGMMA
__device__ int wgmma_image = 1;
#else
__device__ int wgmma_image = 0;
#endif

/* The wgmma engine where the device runs the sm_90a code, the head size is
 * whole 128-byte atoms, rows are 16-byte aligned and TD_OPS_CUDA_ATTENTION
 * is not "mma" (which keeps the mma.sync engine everywhere). */
bool use_wgmma(int hs, bool vec)
{
    if (hs % 64 || !vec) return false;
    const char *force = getenv("TD_OPS_CUDA_ATTENTION");
    if (force && !strcmp(force, "mma")) return false;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
        (void)cudaGetLastError();
        return false;
    }
    static int image[64]; /* per device: 0 not asked yet, 1 no, 2 yes */
    if (!image[dev]) {
        int v = 0;
        const bool ok = cudaMemcpyFromSymbol(&v, wgmma_image, sizeof v) == cudaSuccess;
        if (!ok) (void)cudaGetLastError();
        image[dev] = ok && v ? 2 : 1;
    }
    return image[dev] == 2;
}

template <typename X, int HS, typename E>
td_status forward_on(X *out, float *lse, const X *qkv, const int *pos, int B, int T, int NH, int NKV, float scale_log2,
                     bool vec, cudaStream_t s)
{
    const int tiles = (T + BM - 1) / BM;
    const size_t smem = fwd_smem_bytes<E>();
    td_status st = allow_smem(flash_forward_kernel<X, HS, E>, smem, "flash attention forward: shared memory limit");
    if (st != TD_OK) return st;
    flash_forward_kernel<X, HS, E><<<dim3(tiles, B * NH), THREADS, smem, s>>>(out, lse, qkv, pos, T, Heads<HS>{NH, NKV},
                                                                              scale_log2, vec);
    return check_launch("flash attention forward");
}

/* flash_backward's arguments but the gradient's and the type's */
struct Backward {
    const void *dout, *qkv, *out;
    const float *lse;
    const int *pos;
    int B, T, NH, NKV;
    float scale;
    bool add;
    void *scratch;
    size_t scratch_bytes;
    bool vec;
};

template <typename X, int HS, typename E> td_status backward_on(X *dqkv, const Backward &a, cudaStream_t s)
{
    const int T = a.T, NH = a.NH, NKV = a.NKV, tiles = (T + BM - 1) / BM, C = NH * HS;
    int G = a.B;
    while (G > 1 && flash_scratch_bytes(G, T, NH) > a.scratch_bytes) G--;
    float *D = (float *)a.scratch;
    const X *dout = (const X *)a.dout, *qkv = (const X *)a.qkv;
    const Heads<HS> hd{NH, NKV};
    const size_t smem = bwd_smem_bytes<E>();
    const bool kt_major = NKV < NH; /* see flash_dkv_kernel */
    td_status st = allow_smem(flash_dq_kernel<X, HS, E>, smem, "flash attention backward: shared memory limit");
    if (st == TD_OK)
        st = allow_smem(kt_major ? flash_dkv_kernel<X, HS, true, E> : flash_dkv_kernel<X, HS, false, E>, smem,
                        "flash attention backward: shared memory limit");
    if (st != TD_OK) return st;
    for (int b0 = 0; b0 < a.B; b0 += G) {
        const int nb = a.B - b0 < G ? a.B - b0 : G, rows = nb * NH * T;
        if (aligned16(dout) && aligned16(a.out) && C % VN == 0)
            rowdot_vec_kernel<X><<<(rows + 31) / 32, 256, 0, s>>>(D, dout, (const X *)a.out, b0, rows, T, C, NH, HS);
        else
            rowdot_kernel<X><<<(rows + 7) / 8, 256, 0, s>>>(D, dout, (const X *)a.out, b0, rows, T, C, NH, HS);
        st = check_launch("flash attention backward (dout . out)");
        if (st != TD_OK) return st;
        flash_dq_kernel<X, HS, E><<<dim3(tiles, nb * NH), THREADS, smem, s>>>(dqkv, dout, qkv, a.lse, D, a.pos, b0, T,
                                                                               hd, a.scale, a.vec, a.add);
        st = check_launch("flash attention backward (dQ)");
        if (st != TD_OK) return st;
        if (kt_major)
            flash_dkv_kernel<X, HS, true, E><<<dim3(nb * NKV, tiles), THREADS, smem, s>>>(
                dqkv, dout, qkv, a.lse, D, a.pos, b0, T, hd, a.scale, a.vec, a.add);
        else
            flash_dkv_kernel<X, HS, false, E><<<dim3(tiles, nb * NKV), THREADS, smem, s>>>(
                dqkv, dout, qkv, a.lse, D, a.pos, b0, T, hd, a.scale, a.vec, a.add);
        st = check_launch("flash attention backward (dK, dV)");
        if (st != TD_OK) return st;
    }
    return TD_OK;
}

} // namespace

bool flash_applies(td_dtype dt, int hs)
{
    if (dt != TD_DTYPE_BF16 && dt != TD_DTYPE_F16) return false;
    if (hs != 64 && hs != 80 && hs != 96 && hs != 128) return false;
    const char *force = getenv("TD_OPS_CUDA_ATTENTION");
    return !(force && !strcmp(force, "gemm"));
}

size_t flash_scratch_bytes(int seqs, int T, int NH) { return align_up((size_t)seqs * NH * T * sizeof(float)); }

td_status flash_forward(td_dtype dt, void *out, float *lse, const void *qkv, const int *pos, int B, int T, int NH,
                        int NKV, int hs, cudaStream_t s)
{
    const float scale_log2 = 1.0f / sqrtf((float)hs) * LOG2E;
    const bool vec = aligned16(qkv), wg = use_wgmma(hs, vec);
    return dispatch16(dt, hs, [&](auto tag, auto hs_c) -> td_status {
        using X = decltype(tag);
        constexpr int HS = decltype(hs_c)::value;
        if constexpr (HS % 64 == 0) {
            if (wg)
                return forward_on<X, HS, WgMma<HS>>((X *)out, lse, (const X *)qkv, pos, B, T, NH, NKV, scale_log2,
                                                    vec, s);
        }
        return forward_on<X, HS, SyncMma<HS>>((X *)out, lse, (const X *)qkv, pos, B, T, NH, NKV, scale_log2, vec, s);
    });
}

td_status flash_backward(td_dtype dt, void *dqkv, const void *dout, const void *qkv, const void *out,
                         const float *lse, const int *pos, int B, int T, int NH, int NKV, int hs, bool add,
                         void *scratch, size_t scratch_bytes, cudaStream_t s)
{
    const Backward a = {dout, qkv, out, lse, pos, B, T, NH, NKV, 1.0f / sqrtf((float)hs), add, scratch, scratch_bytes,
                        aligned16(qkv) && aligned16(dout)};
    const bool wg = use_wgmma(hs, a.vec);
    return dispatch16(dt, hs, [&](auto tag, auto hs_c) -> td_status {
        using X = decltype(tag);
        constexpr int HS = decltype(hs_c)::value;
        if constexpr (HS % 64 == 0) {
            if (wg) return backward_on<X, HS, WgMma<HS>>((X *)dqkv, a, s);
        }
        return backward_on<X, HS, SyncMma<HS>>((X *)dqkv, a, s);
    });
}

} // namespace tdc
