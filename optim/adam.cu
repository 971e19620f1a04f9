/* The GPU AdamW and grad sum-of-squares kernels (optim_cuda.h).
 *
 * The update mirrors optim/adam_kernel.h operation for operation, with
 * explicit _rn intrinsics so that nvcc cannot contract or reorder anything
 * (-fmad=true would otherwise fuse a*b+c where the CPU rounds twice): the
 * GPU result is the CPU result, bit for bit.  fp32 and bf16 state: a
 * grid-stride loop, W contiguous elements per thread per iteration (4 with
 * fp32 state, 8 with bf16: 16-byte accesses to master and moments), the last
 * numel % W elements one per thread.  int8 state: one warp per scale block
 * of TD_ADAM_INT8_BLOCK elements (the block absmax is a warp shuffle), each
 * lane 8 contiguous elements (8-byte code accesses, 16-byte master and grad
 * accesses), mirroring the codes of adam_kernel.h.  Which element a thread
 * takes changes no result: each element's operations are its own, and the
 * absmax is an order-free max.  The wide accesses need every array aligned
 * to them; the launcher checks, and a chunk with an array that is not takes
 * the one-element-per-access path (W = 1; int8: lane l takes elements l,
 * l + 32, ...), as does int8's partial last block.
 *
 * The sum of squares is two kernels: each block reduces a fixed, strided
 * share of the grads (16-byte accesses where the grads are aligned to them)
 * in double into dev_scratch[block], then one block adds
 * the partials in a fixed order into *dev_acc.  No atomics, so the result
 * depends only on the data and numel. */
#include "tidal/optim_cuda.h"
#include "tidal/convert.h"

#include <cuda_runtime.h>
#include <string.h>

namespace {

constexpr int kThreads = 256;

/* ---- wide accesses ------------------------------------------------------------ */

/* An element's bits in the low bits of a word, and back. */
__device__ __forceinline__ uint32_t bits_of(float x) { return __float_as_uint(x); }
__device__ __forceinline__ uint32_t bits_of(uint16_t x) { return x; }
__device__ __forceinline__ uint32_t bits_of(uint8_t x) { return x; }
template <typename T>
__device__ __forceinline__ T of_bits(uint32_t b)
{
    if constexpr (sizeof(T) == 4) return __uint_as_float(b);
    else return (T)b;
}

/* A 4-byte words at p (A = 1, 2 or 4), aligned to 4 A bytes, in one access. */
template <int A>
__device__ __forceinline__ void load_words(const uint32_t *__restrict__ p, uint32_t *w)
{
    if constexpr (A == 4) {
        uint4 u = *reinterpret_cast<const uint4 *>(p);
        w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
    } else if constexpr (A == 2) {
        uint2 u = *reinterpret_cast<const uint2 *>(p);
        w[0] = u.x, w[1] = u.y;
    } else {
        w[0] = *p;
    }
}

/* __stwb is a plain store (st.global.wb) that the compiler cannot split:
 * left to itself, it cuts some 16-byte stores into four. */
template <int A>
__device__ __forceinline__ void store_words(uint32_t *__restrict__ p, const uint32_t *w)
{
    if constexpr (A == 4) __stwb(reinterpret_cast<uint4 *>(p), make_uint4(w[0], w[1], w[2], w[3]));
    else if constexpr (A == 2) __stwb(reinterpret_cast<uint2 *>(p), make_uint2(w[0], w[1]));
    else __stwb(p, w[0]);
}

/* N elements of T at p, in accesses of min(16, N x sizeof(T)) bytes (one
 * element at a time below 4): p is aligned to that (the launcher checks the
 * chunk's arrays, and a wide access starts at a multiple of N). */
template <int N, typename T>
__device__ __forceinline__ void load_n(const T *__restrict__ p, T (&x)[N])
{
    constexpr int kBytes = N * (int)sizeof(T), kPer = 4 / (int)sizeof(T);
    if constexpr (kBytes < 4) {
#pragma unroll
        for (int k = 0; k < N; k++) x[k] = p[k];
    } else {
        constexpr int kWords = kBytes / 4, kAccess = kWords < 4 ? kWords : 4;
        uint32_t w[kWords];
#pragma unroll
        for (int a = 0; a < kWords; a += kAccess) load_words<kAccess>(reinterpret_cast<const uint32_t *>(p) + a, w + a);
#pragma unroll
        for (int k = 0; k < N; k++) x[k] = of_bits<T>(w[k / kPer] >> (8 * (int)sizeof(T) * (k % kPer)));
    }
}

template <int N, typename T>
__device__ __forceinline__ void store_n(T *__restrict__ p, const T (&x)[N])
{
    constexpr int kBytes = N * (int)sizeof(T), kPer = 4 / (int)sizeof(T);
    if constexpr (kBytes < 4) {
#pragma unroll
        for (int k = 0; k < N; k++) p[k] = x[k];
    } else {
        constexpr int kWords = kBytes / 4, kAccess = kWords < 4 ? kWords : 4;
        uint32_t w[kWords] = {};
#pragma unroll
        for (int k = 0; k < N; k++) w[k / kPer] |= bits_of(x[k]) << (8 * (int)sizeof(T) * (k % kPer));
#pragma unroll
        for (int a = 0; a < kWords; a += kAccess) store_words<kAccess>(reinterpret_cast<uint32_t *>(p) + a, w + a);
    }
}

/* Grads [i, i + N) as floats (exact). */
template <int GDT, int N>
__device__ __forceinline__ void load_grads(const void *__restrict__ g, size_t i, float (&x)[N])
{
    if constexpr (GDT == TD_DTYPE_F32) {
        load_n<N>(static_cast<const float *>(g) + i, x);
    } else {
        uint16_t h[N];
        load_n<N>(static_cast<const uint16_t *>(g) + i, h);
#pragma unroll
        for (int k = 0; k < N; k++) x[k] = GDT == TD_DTYPE_BF16 ? td_f32_from_bf16(h[k]) : td_f32_from_f16(h[k]);
    }
}

template <int GDT>
__device__ __forceinline__ float load_grad(const void *__restrict__ g, size_t i)
{
    float x[1];
    load_grads<GDT, 1>(g, i, x);
    return x[0];
}

/* Params [i, i + N) in the output dtype, RNE; PDT == TD_DTYPE_COUNT:
 * no param output. */
template <int PDT, int N>
__device__ __forceinline__ void store_params(void *__restrict__ p, size_t i, const float (&x)[N])
{
    if constexpr (PDT == TD_DTYPE_F32) {
        store_n<N>(static_cast<float *>(p) + i, x);
    } else if constexpr (PDT == TD_DTYPE_BF16 || PDT == TD_DTYPE_F16) {
        uint16_t h[N];
#pragma unroll
        for (int k = 0; k < N; k++) h[k] = PDT == TD_DTYPE_BF16 ? td_bf16_from_f32(x[k]) : td_f16_from_f32(x[k]);
        store_n<N>(static_cast<uint16_t *>(p) + i, h);
    }
}

/* One element, as adam_math in optim/adam_kernel.h. */
template <int L2>
__device__ __forceinline__ void adam_math(const td_adam_coeffs &c, float graw, float &p, float &m, float &v)
{
    float g = __fmul_rn(graw, c.grad_mul);
    if (L2) g = __fmaf_rn(c.l2, p, g);
    p = __fmul_rn(p, c.decay_mul);
    m = __fmaf_rn(c.beta1, m, __fmul_rn(c.one_minus_beta1, g));
    v = __fmaf_rn(c.beta2, v, __fmul_rn(__fmul_rn(c.one_minus_beta2, g), g));
    float d = __fmaf_rn(__fsqrt_rn(v), c.rsqrt_bc2, c.eps);
    p = __fmaf_rn(-c.step_size, __fdiv_rn(m, d), p);
}

/* fp32 or bf16 moments [i, i + N). */
template <int ST, int N>
__device__ __forceinline__ void load_moments(const void *__restrict__ s, size_t i, float (&x)[N])
{
    if constexpr (ST != TD_OPTIM_STATE_BF16) {
        load_n<N>(static_cast<const float *>(s) + i, x);
    } else {
        uint16_t h[N];
        load_n<N>(static_cast<const uint16_t *>(s) + i, h);
#pragma unroll
        for (int k = 0; k < N; k++) x[k] = td_f32_from_bf16(h[k]);
    }
}

/* bf16 v: stochastic rounding from a hash of the index and the step's seed
 * (optim/adam_kernel.h, sr_bits and bf16_round_stochastic). */
__device__ __forceinline__ uint32_t sr_bits(uint32_t seed, size_t i)
{
    uint32_t x = (uint32_t)i ^ seed;
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    return x ^ (x >> 16);
}

__device__ __forceinline__ uint16_t bf16_round_stochastic(float x, uint32_t rnd)
{
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + (rnd >> 16)) >> 16);
}

/* Moments [i, i + N): m (IS_V 0) rounds to nearest even in bf16, v
 * stochastically with the bits of each element's chunk index. */
template <int ST, int IS_V, int N>
__device__ __forceinline__ void store_moments(void *__restrict__ s, size_t i, const float (&x)[N], uint32_t seed)
{
    if constexpr (ST != TD_OPTIM_STATE_BF16) {
        store_n<N>(static_cast<float *>(s) + i, x);
    } else {
        uint16_t h[N];
#pragma unroll
        for (int k = 0; k < N; k++)
            h[k] = IS_V ? bf16_round_stochastic(x[k], sr_bits(seed, i + k)) : td_bf16_from_f32(x[k]);
        store_n<N>(static_cast<uint16_t *>(s) + i, h);
    }
}

/* No-decay ranges (td_adam_chunk.no_decay, device memory): the first range
 * that ends after element i (n when none). */
__device__ __forceinline__ int range_after(const td_adam_range *r, int n, size_t i)
{
    int lo = 0, hi = n;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (r[mid].end <= i) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* Whether element i decays: *at, a cursor from range_after at or before i,
 * moves forward to the first range that ends after i (indices ascend). */
__device__ __forceinline__ bool decays_at(const td_adam_range *r, int n, int *at, size_t i)
{
    while (*at < n && r[*at].end <= i) (*at)++;
    return *at == n || r[*at].begin > i;
}

/* One element with its coefficients: the step's, or nd (no decay: decay_mul
 * 1, no L2 term) inside a no-decay range, as the CPU's segments do. */
template <int L2>
__device__ __forceinline__ void adam_math_at(const td_adam_coeffs &c, const td_adam_coeffs &nd, bool decays,
                                             float graw, float &p, float &m, float &v)
{
    if (decays) adam_math<L2>(c, graw, p, m, v);
    else adam_math<0>(nd, graw, p, m, v);
}

/* Elements [i, i + N): each array in accesses of up to 16 bytes (load_n). */
template <int L2, int GDT, int PDT, int ST, int N>
__device__ __forceinline__ void adam_elems(const td_adam_coeffs &c, const td_adam_coeffs &nd, float *__restrict__ master,
                                           void *__restrict__ m, void *__restrict__ v, const void *__restrict__ grad,
                                           void *__restrict__ out, size_t i, const td_adam_range *__restrict__ rg,
                                           int nr)
{
    float p[N], mm[N], vv[N], g[N];
    load_n<N>(master + i, p);
    load_moments<ST, N>(m, i, mm);
    load_moments<ST, N>(v, i, vv);
    load_grads<GDT, N>(grad, i, g);
    int r = nr ? range_after(rg, nr, i) : 0;
#pragma unroll
    for (int k = 0; k < N; k++) adam_math_at<L2>(c, nd, decays_at(rg, nr, &r, i + k), g[k], p[k], mm[k], vv[k]);
    store_moments<ST, 0, N>(m, i, mm, c.sr_seed);
    store_moments<ST, 1, N>(v, i, vv, c.sr_seed);
    store_n<N>(master + i, p);
    store_params<PDT, N>(out, i, p);
}

/* fp32 or bf16 moments, grid-stride: W contiguous elements per thread per
 * iteration (the arrays aligned for it; W = 1 takes any), the last n % W
 * elements one per thread. */
template <int L2, int GDT, int PDT, int ST, int W>
__global__ void __launch_bounds__(kThreads) adam_kernel(td_adam_coeffs c, td_adam_coeffs nd, float *__restrict__ master,
                                                        void *__restrict__ m, void *__restrict__ v,
                                                        const void *__restrict__ grad, void *__restrict__ out,
                                                        size_t n, const td_adam_range *__restrict__ rg, int nr)
{
    size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x * W;
    for (size_t i = t * W; i + W <= n; i += stride)
        adam_elems<L2, GDT, PDT, ST, W>(c, nd, master, m, v, grad, out, i, rg, nr);
    if constexpr (W > 1) {
        if (t < n % W) adam_elems<L2, GDT, PDT, ST, 1>(c, nd, master, m, v, grad, out, n - n % W + t, rg, nr);
    }
}

/* ---- int8 moments: the codes of optim/adam_kernel.h, line for line ---------- */

constexpr int kQ8BiasM = 15, kQ8BiasV = 31;

__device__ __forceinline__ float q8_pow2(int e) { return __uint_as_float((uint32_t)(127 + e) << 23); }

/* As q8_encode_carry in optim/adam_kernel.h: the code of y in [0, 1] with
 * `carry` added below the kept mantissa bits before they are cut. */
__device__ __forceinline__ uint32_t q8_encode_carry(float y, int bias, uint32_t carry)
{
    uint32_t b = __float_as_uint(y);
    uint32_t normal = (b - ((uint32_t)(127 - bias) << 23) + carry) >> 20;
    if ((int32_t)normal > bias * 8) normal = (uint32_t)(bias * 8); /* signed min, as vi_min */
    float magic = q8_pow2(21 - bias);
    uint32_t sub = __float_as_uint(__fadd_rn(y, magic)) - __float_as_uint(magic);
    return y < q8_pow2(1 - bias) ? sub : normal;
}

/* Rounded to nearest even: half a step, less one when the kept mantissa is even. */
__device__ __forceinline__ uint32_t q8_encode(float y, int bias)
{
    return q8_encode_carry(y, bias, ((1u << 19) - 1) + ((__float_as_uint(y) >> 20) & 1));
}

/* As q8_encode_sr in optim/adam_kernel.h: a normal y rounded up with the
 * probability of its dropped fraction (the top 20 of rnd's bits carry). */
__device__ __forceinline__ uint32_t q8_encode_sr(float y, int bias, uint32_t rnd)
{
    return q8_encode_carry(y, bias, rnd >> 12);
}

__device__ __forceinline__ float q8_decode(uint32_t c, int bias)
{
    uint32_t normal = (c << 20) + ((uint32_t)(127 - bias) << 23);
    uint32_t sub = __float_as_uint(__fmul_rn(__int2float_rn((int)c), q8_pow2(-2 - bias)));
    return __uint_as_float((int32_t)c < 8 ? sub : normal);
}

__device__ __forceinline__ float q8_load_m(uint32_t c, float scale)
{
    float x = __fmul_rn(q8_decode(c & 0x7f, kQ8BiasM), scale);
    return __uint_as_float(__float_as_uint(x) | ((c & 0x80) << 24));
}

__device__ __forceinline__ float q8_load_v(uint32_t c, float scale) { return __fmul_rn(q8_decode(c, kQ8BiasV), scale); }

/* As q8_normalizer in optim/adam_kernel.h: multiply by the reciprocal of
 * the absmax when it is a normal float, else divide by the absmax. */
__device__ __forceinline__ bool q8_normalizer(int32_t absmax_bits, float *factor)
{
    float a = __int_as_float(absmax_bits);
    if (absmax_bits == 0) return *factor = 1.0f, true;
    if (absmax_bits >= 0x00800000 && absmax_bits <= 0x7e800000) return *factor = __fdiv_rn(1.0f, a), true;
    return *factor = a, false;
}

__device__ __forceinline__ float q8_normalize(float x, float factor, bool mul)
{
    float ax = __uint_as_float(__float_as_uint(x) & 0x7fffffffu);
    return mul ? __fmul_rn(ax, factor) : __fdiv_rn(ax, factor);
}

__device__ __forceinline__ uint8_t q8_store_m(float x, float factor, bool mul)
{
    return (uint8_t)(q8_encode(q8_normalize(x, factor, mul), kQ8BiasM) | ((__float_as_uint(x) & 0x80000000u) >> 24));
}

/* v's codes in an update, stochastically rounded (element i of the chunk). */
__device__ __forceinline__ uint8_t q8_store_v_sr(float x, float factor, bool mul, uint32_t seed, size_t i)
{
    return (uint8_t)q8_encode_sr(q8_normalize(x, factor, mul), kQ8BiasV, sr_bits(seed, i));
}

__device__ __forceinline__ float load_f32(const unsigned char *p)
{
    float x;
    memcpy(&x, p, 4); /* scales need not be 4-byte aligned */
    return x;
}

/* Max of a signed int over the warp (order-free). */
__device__ __forceinline__ int32_t warp_max(int32_t x)
{
    for (int o = 16; o > 0; o >>= 1) x = max(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

constexpr int kQ8PerLane = TD_ADAM_INT8_BLOCK / 32;
static_assert(TD_ADAM_INT8_BLOCK % 32 == 0, "a scale block is whole warps' worth of elements");

/* The chunk index of lane `lane`'s k-th element of scale block qb: WIDE,
 * kQ8PerLane contiguous ones (one access per array and lane); else lane,
 * lane + 32, ... (coalesced element by element). */
template <bool WIDE>
__device__ __forceinline__ size_t q8_elem(size_t qb, unsigned lane, int k)
{
    return qb * TD_ADAM_INT8_BLOCK + (WIDE ? (size_t)lane * kQ8PerLane + k : (size_t)k * 32 + lane);
}

/* Scale block qb, by one warp: each lane updates its elements, keeps the
 * new m and v in registers, the absmax is a warp shuffle, then the lanes
 * requantize: no shared memory, no block barrier.  WIDE only for a whole
 * block of aligned arrays; otherwise elements past n take code 0, grad 0
 * and master 0 as the CPU's zero padding does, so the absmax is the CPU's
 * even for NaN scales, and are not stored. */
template <int L2, int GDT, int PDT, bool WIDE>
__device__ __forceinline__ void adam_q8_block(const td_adam_coeffs &c, const td_adam_coeffs &nd,
                                              float *__restrict__ master, uint8_t *__restrict__ mc,
                                              uint8_t *__restrict__ vc, unsigned char *sm, unsigned char *sv,
                                              const void *__restrict__ grad, void *__restrict__ out, size_t n,
                                              const td_adam_range *__restrict__ rg, int nr, size_t qb, unsigned lane)
{
    constexpr int K = kQ8PerLane;
    float old_m = load_f32(sm + qb * 4), old_v = load_f32(sv + qb * 4);
    float p[K], g[K], mm[K], vv[K];
    uint8_t cm[K], cv[K];
    size_t i0 = q8_elem<WIDE>(qb, lane, 0);
    if constexpr (WIDE) {
        load_n<K>(master + i0, p);
        load_n<K>(mc + i0, cm);
        load_n<K>(vc + i0, cv);
        load_grads<GDT, K>(grad, i0, g);
    } else {
#pragma unroll
        for (int k = 0; k < K; k++) {
            size_t i = q8_elem<false>(qb, lane, k);
            bool in = i < n;
            p[k] = in ? master[i] : 0.0f;
            cm[k] = in ? mc[i] : 0;
            cv[k] = in ? vc[i] : 0;
            g[k] = in ? load_grad<GDT>(grad, i) : 0.0f;
        }
    }
    /* A block that straddles a no-decay boundary mixes coefficients
     * element by element and is requantized whole, as on the CPU;
     * padding past n is in no range (it decays, as the CPU's does). */
    int r = nr ? range_after(rg, nr, i0) : 0;
    int32_t am = 0, av = 0;
#pragma unroll
    for (int k = 0; k < K; k++) {
        mm[k] = q8_load_m(cm[k], old_m);
        vv[k] = q8_load_v(cv[k], old_v);
        adam_math_at<L2>(c, nd, decays_at(rg, nr, &r, q8_elem<WIDE>(qb, lane, k)), g[k], p[k], mm[k], vv[k]);
        am = max(am, (int32_t)(__float_as_uint(mm[k]) & 0x7fffffffu));
        av = max(av, (int32_t)(__float_as_uint(vv[k]) & 0x7fffffffu));
    }
    if constexpr (WIDE) {
        store_n<K>(master + i0, p);
        store_params<PDT, K>(out, i0, p);
    } else {
#pragma unroll
        for (int k = 0; k < K; k++) {
            size_t i = q8_elem<false>(qb, lane, k);
            if (i >= n) continue;
            master[i] = p[k];
            store_params<PDT, 1>(out, i, {p[k]});
        }
    }
    am = warp_max(am); /* also orders every lane's read of the old scales before lane 0 writes */
    av = warp_max(av);
    float scale_m = __int_as_float(am), scale_v = __int_as_float(av), fm, fv;
    bool mul_m = q8_normalizer(am, &fm), mul_v = q8_normalizer(av, &fv); /* warp-uniform */
#pragma unroll
    for (int k = 0; k < K; k++) {
        cm[k] = q8_store_m(mm[k], fm, mul_m);
        cv[k] = q8_store_v_sr(vv[k], fv, mul_v, c.sr_seed, q8_elem<WIDE>(qb, lane, k));
    }
    if constexpr (WIDE) {
        store_n<K>(mc + i0, cm);
        store_n<K>(vc + i0, cv);
    } else {
#pragma unroll
        for (int k = 0; k < K; k++) {
            size_t i = q8_elem<false>(qb, lane, k);
            if (i >= n) continue;
            mc[i] = cm[k];
            vc[i] = cv[k];
        }
    }
    if (lane == 0) {
        memcpy(sm + qb * 4, &scale_m, 4);
        memcpy(sv + qb * 4, &scale_v, 4);
    }
}

/* One warp per scale block, grid-stride over blocks; `wide`: the arrays are
 * aligned for adam_q8_block's wide accesses, which every whole block takes. */
template <int L2, int GDT, int PDT>
__global__ void __launch_bounds__(kThreads) adam_q8_kernel(td_adam_coeffs c, td_adam_coeffs nd,
                                                           float *__restrict__ master, uint8_t *__restrict__ mc,
                                                           uint8_t *__restrict__ vc, const void *__restrict__ grad,
                                                           void *__restrict__ out, size_t n,
                                                           const td_adam_range *__restrict__ rg, int nr, bool wide)
{
    unsigned char *sm = mc + ((n + 3) & ~(size_t)3), *sv = vc + ((n + 3) & ~(size_t)3);
    size_t blocks = (n + TD_ADAM_INT8_BLOCK - 1) / TD_ADAM_INT8_BLOCK, whole = wide ? n / TD_ADAM_INT8_BLOCK : 0;
    size_t warps = (size_t)gridDim.x * (kThreads / 32);
    unsigned lane = threadIdx.x & 31;
    for (size_t qb = (size_t)blockIdx.x * (kThreads / 32) + threadIdx.x / 32; qb < blocks; qb += warps) {
        if (qb < whole) adam_q8_block<L2, GDT, PDT, true>(c, nd, master, mc, vc, sm, sv, grad, out, n, rg, nr, qb, lane);
        else adam_q8_block<L2, GDT, PDT, false>(c, nd, master, mc, vc, sm, sv, grad, out, n, rg, nr, qb, lane);
    }
}

/* Whether p allows accesses of n elements of elem_bytes each: aligned to
 * min(16, n x elem_bytes) bytes (load_n). */
bool wide_ok(const void *p, size_t elem_bytes, int n)
{
    size_t bytes = elem_bytes * (size_t)n;
    return (uintptr_t)p % (bytes < 16 ? bytes : 16) == 0;
}

/* Whether every array of the chunk allows accesses of n elements. */
bool chunk_wide_ok(const td_adam_chunk &ch, size_t moment_elem_bytes, int n)
{
    return wide_ok(ch.master, 4, n) && wide_ok(ch.m, moment_elem_bytes, n) && wide_ok(ch.v, moment_elem_bytes, n) &&
           wide_ok(ch.grad, td_dtype_bytes(ch.grad_dtype), n) &&
           (!ch.param_out || wide_ok(ch.param_out, td_dtype_bytes(ch.param_dtype), n));
}

int grid_for(size_t n, int max_blocks)
{
    size_t blocks = (n + kThreads - 1) / kThreads;
    return blocks > (size_t)max_blocks ? max_blocks : (int)(blocks ? blocks : 1);
}

/* Elements per thread and iteration of adam_kernel: 16-byte moment
 * accesses. */
template <int ST>
constexpr int adam_width()
{
    return ST == TD_OPTIM_STATE_BF16 ? 8 : 4;
}

/* Enough blocks to fill any current GPU several times over; the grid-stride
 * loops cover the rest. */
constexpr int kMaxBlocks = 65536;

template <int L2, int GDT, int PDT, int ST>
void launch_state(const td_adam_coeffs &c, const td_adam_coeffs &nd, const td_adam_chunk &ch, cudaStream_t s)
{
    constexpr int W = adam_width<ST>();
    const td_adam_range *rg = ch.n_no_decay ? ch.no_decay : nullptr;
    if (chunk_wide_ok(ch, ST == TD_OPTIM_STATE_BF16 ? 2 : 4, W))
        adam_kernel<L2, GDT, PDT, ST, W><<<grid_for((ch.numel + W - 1) / W, kMaxBlocks), kThreads, 0, s>>>(
            c, nd, ch.master, ch.m, ch.v, ch.grad, ch.param_out, ch.numel, rg, ch.n_no_decay);
    else
        adam_kernel<L2, GDT, PDT, ST, 1><<<grid_for(ch.numel, kMaxBlocks), kThreads, 0, s>>>(
            c, nd, ch.master, ch.m, ch.v, ch.grad, ch.param_out, ch.numel, rg, ch.n_no_decay);
}

template <int L2, int GDT, int PDT>
cudaError_t launch_adam(const td_adam_coeffs &c, const td_adam_chunk &ch, cudaStream_t s)
{
    td_adam_coeffs nd = c; /* no decay: what td_adam_coeffs_make gives for weight_decay 0 */
    nd.l2 = 0.0f;
    nd.decay_mul = 1.0f;
    switch (ch.state) {
    case TD_OPTIM_STATE_BF16: launch_state<L2, GDT, PDT, TD_OPTIM_STATE_BF16>(c, nd, ch, s); break;
    case TD_OPTIM_STATE_INT8: {
        size_t qblocks = (ch.numel + TD_ADAM_INT8_BLOCK - 1) / TD_ADAM_INT8_BLOCK, per = kThreads / 32;
        size_t ctas = (qblocks + per - 1) / per;
        int grid = ctas > kMaxBlocks ? kMaxBlocks : (int)ctas;
        adam_q8_kernel<L2, GDT, PDT><<<grid, kThreads, 0, s>>>(
            c, nd, ch.master, static_cast<uint8_t *>(ch.m), static_cast<uint8_t *>(ch.v), ch.grad, ch.param_out,
            ch.numel, ch.n_no_decay ? ch.no_decay : nullptr, ch.n_no_decay, chunk_wide_ok(ch, 1, kQ8PerLane));
        break;
    }
    default: launch_state<L2, GDT, PDT, TD_OPTIM_STATE_FP32>(c, nd, ch, s); break;
    }
    return cudaGetLastError();
}

template <int L2, int GDT>
cudaError_t launch_pdt(const td_adam_coeffs &c, const td_adam_chunk &ch, int pdt, cudaStream_t s)
{
    switch (pdt) {
    case TD_DTYPE_F32: return launch_adam<L2, GDT, TD_DTYPE_F32>(c, ch, s);
    case TD_DTYPE_BF16: return launch_adam<L2, GDT, TD_DTYPE_BF16>(c, ch, s);
    case TD_DTYPE_F16: return launch_adam<L2, GDT, TD_DTYPE_F16>(c, ch, s);
    default: return launch_adam<L2, GDT, TD_DTYPE_COUNT>(c, ch, s);
    }
}

template <int L2>
cudaError_t launch_gdt(const td_adam_coeffs &c, const td_adam_chunk &ch, int pdt, cudaStream_t s)
{
    switch (ch.grad_dtype) {
    case TD_DTYPE_BF16: return launch_pdt<L2, TD_DTYPE_BF16>(c, ch, pdt, s);
    case TD_DTYPE_F16: return launch_pdt<L2, TD_DTYPE_F16>(c, ch, pdt, s);
    default: return launch_pdt<L2, TD_DTYPE_F32>(c, ch, pdt, s);
    }
}

/* Each block's share in double into partials[block]: with `wide` (grad
 * aligned to 16 bytes) thread t of the grid takes the 16-byte groups t,
 * t + threads, ... (two in flight per iteration: one element per thread
 * would leave the loads too few to cover the memory's latency), then the
 * last numel % W elements one each; else element by element.  The order is
 * fixed by numel and the alignment alone. */
template <int GDT>
__global__ void __launch_bounds__(kThreads) sumsq_partial_kernel(const void *__restrict__ grad, size_t n, bool wide,
                                                                 double *__restrict__ partials)
{
    constexpr int W = GDT == TD_DTYPE_F32 ? 4 : 8; /* one 16-byte access */
    __shared__ double sh[kThreads];
    double acc = 0.0;
    size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
    if (wide) {
        size_t groups = n / W, i = t;
        for (; i + stride < groups; i += 2 * stride) {
            float a[W], b[W];
            load_grads<GDT, W>(grad, i * W, a);
            load_grads<GDT, W>(grad, (i + stride) * W, b);
#pragma unroll
            for (int k = 0; k < W; k++) acc = __fma_rn((double)a[k], (double)a[k], acc);
#pragma unroll
            for (int k = 0; k < W; k++) acc = __fma_rn((double)b[k], (double)b[k], acc);
        }
        if (i < groups) {
            float a[W];
            load_grads<GDT, W>(grad, i * W, a);
#pragma unroll
            for (int k = 0; k < W; k++) acc = __fma_rn((double)a[k], (double)a[k], acc);
        }
        if (t < n % W) {
            double x = load_grad<GDT>(grad, groups * W + t);
            acc = __fma_rn(x, x, acc);
        }
    } else {
        for (size_t i = t; i < n; i += stride) {
            double x = load_grad<GDT>(grad, i);
            acc = __fma_rn(x, x, acc);
        }
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

} // namespace

extern "C" td_status td_adam_update_cuda(const td_adam_coeffs *c, const td_adam_chunk *ch, void *stream)
{
    if (!c || !ch) return td_error_set(TD_ERR_INVALID, "td_adam_update_cuda: NULL coefficients or chunk");
    if ((unsigned)ch->state >= TD_OPTIM_STATE_COUNT)
        return td_error_set(TD_ERR_INVALID, "td_adam_update_cuda: bad optimizer state %d (use fp32, bf16 or int8)",
                            (int)ch->state);
    if ((unsigned)ch->grad_dtype >= TD_DTYPE_COUNT ||
        (ch->param_out && (unsigned)ch->param_dtype >= TD_DTYPE_COUNT))
        return td_error_set(TD_ERR_INVALID, "td_adam_update_cuda: bad grad or param dtype (%d, %d)",
                            (int)ch->grad_dtype, (int)ch->param_dtype);
    if (ch->numel == 0) return TD_OK;
    if (!ch->master || !ch->m || !ch->v || !ch->grad)
        return td_error_set(TD_ERR_INVALID, "td_adam_update_cuda: a chunk of %zu elements has a NULL array",
                            ch->numel);
    /* The list is in device memory: only its shape can be checked here. */
    if (ch->n_no_decay < 0 || (ch->n_no_decay > 0 && !ch->no_decay))
        return td_error_set(TD_ERR_INVALID, "td_adam_update_cuda: %d no-decay ranges at %p (give a device list, or "
                            "NULL and 0)", ch->n_no_decay, (const void *)ch->no_decay);
    int pdt = ch->param_out ? (int)ch->param_dtype : TD_DTYPE_COUNT;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    cudaError_t err = c->l2 != 0.0f ? launch_gdt<1>(*c, *ch, pdt, s) : launch_gdt<0>(*c, *ch, pdt, s);
    if (err != cudaSuccess)
        return td_error_set(TD_ERR_BACKEND, "AdamW kernel launch on %zu elements failed: %s (%s)", ch->numel,
                            cudaGetErrorName(err), cudaGetErrorString(err));
    return TD_OK;
}

extern "C" td_status td_grad_sumsq_cuda(const void *grad, td_dtype dtype, size_t numel, double *dev_acc,
                                        double *dev_scratch, void *stream)
{
    if (!dev_acc || !dev_scratch || (numel && !grad))
        return td_error_set(TD_ERR_INVALID, "td_grad_sumsq_cuda: NULL grad, accumulator or scratch");
    if ((unsigned)dtype >= TD_DTYPE_COUNT)
        return td_error_set(TD_ERR_INVALID, "td_grad_sumsq_cuda: bad grad dtype %d", (int)dtype);
    if (numel == 0) return TD_OK;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    int blocks = grid_for(numel, TD_GRAD_SUMSQ_CUDA_SCRATCH);
    bool wide = wide_ok(grad, 16, 1);
    if (dtype == TD_DTYPE_BF16)
        sumsq_partial_kernel<TD_DTYPE_BF16><<<blocks, kThreads, 0, s>>>(grad, numel, wide, dev_scratch);
    else if (dtype == TD_DTYPE_F16)
        sumsq_partial_kernel<TD_DTYPE_F16><<<blocks, kThreads, 0, s>>>(grad, numel, wide, dev_scratch);
    else
        sumsq_partial_kernel<TD_DTYPE_F32><<<blocks, kThreads, 0, s>>>(grad, numel, wide, dev_scratch);
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
