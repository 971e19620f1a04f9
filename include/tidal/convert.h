/* Exact conversions between fp32 and the 16-bit float formats (bf16, fp16).
 *
 * Rounding is to nearest, ties to even (RNE), independent of the floating-
 * point environment, and identical on every path that produces 16-bit
 * values in tidal: the scalar CPU code, the AVX2/AVX-512 kernels (F16C
 * instructions for fp16, integer arithmetic for bf16) and the CUDA kernels.
 * Special values are kept: ±Inf stays ±Inf, a finite value that rounds past
 * the largest finite one becomes ±Inf, and a NaN stays a NaN with its sign,
 * its quiet bit set and the top bits of its payload (as x86 F16C does), so
 * an overflow is never hidden by a conversion.  Subnormals are kept exactly
 * (no flush to zero).
 *
 * Header-only (static inline); usable from C and from CUDA device code.
 * Thread-safety: pure functions. */
#ifndef TIDAL_CONVERT_H
#define TIDAL_CONVERT_H

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define TD_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TD_HOST_DEVICE static inline
#endif

TD_HOST_DEVICE uint32_t td_f32_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

TD_HOST_DEVICE float td_f32_from_bits(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* fp32 -> bf16, RNE.  NaN: sign, quiet bit and the top 6 payload bits kept. */
TD_HOST_DEVICE uint16_t td_bf16_from_f32(float x)
{
    uint32_t u = td_f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

TD_HOST_DEVICE float td_f32_from_bf16(uint16_t h)
{
    return td_f32_from_bits((uint32_t)h << 16);
}

/* fp32 -> fp16 (IEEE binary16), RNE, subnormals exact, overflow to Inf.
 * NaN: sign, quiet bit and the top 9 payload bits kept (F16C's VCVTPS2PH). */
TD_HOST_DEVICE uint16_t td_f16_from_f32(float x)
{
    uint32_t u = td_f32_bits(x);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t ax = u & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x03ffu));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to Inf */
    if (ax >= 0x38800000u) {                                   /* normal: >= 2^-14 */
        uint32_t r = ax + 0x0fffu + ((ax >> 13) & 1u);         /* carries into the exponent */
        return (uint16_t)(sign | ((r - 0x38000000u) >> 13));   /* rebias 127 -> 15 */
    }
    uint32_t e = ax >> 23;
    if (e < 102) return (uint16_t)sign; /* < 2^-25: rounds to zero */
    /* Subnormal result: mantissa (with the hidden bit) in units of 2^-24. */
    uint32_t shift = 126 - e; /* 14 .. 24 */
    uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
    uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++; /* may carry into the smallest normal */
    return (uint16_t)(sign | q);
}

/* fp16 -> fp32, exact (every fp16 value is an fp32 value). */
TD_HOST_DEVICE float td_f32_from_f16(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x03ffu;
    if (exp == 0x1f) return td_f32_from_bits(sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0));
    if (exp == 0) {
        if (!mant) return td_f32_from_bits(sign);
        uint32_t e = 113;
        do { mant <<= 1; e--; } while (!(mant & 0x400u));
        return td_f32_from_bits(sign | (e << 23) | ((mant & 0x03ffu) << 13));
    }
    return td_f32_from_bits(sign | ((exp + 112) << 23) | (mant << 13));
}

#endif
