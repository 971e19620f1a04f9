/* The AVX2 + FMA + F16C instance of optim/adam_kernel.h: 8 floats per vector.
 * bf16 rounding is integer arithmetic (RNE, NaN kept quiet); fp16 uses
 * VCVTPS2PH with round-to-nearest-even, which the scalar converter matches.
 * Param outputs use streaming stores when aligned (see adam_kernel.h). */
#include <immintrin.h>
#include <stdint.h>

#define TD_KERNEL_TABLE td_adam_kernels_avx2
#define VW 8
typedef __m256 vf;

static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_loadu(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_storeu(float *p, vf x) { _mm256_storeu_ps(p, x); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vf_sqrt(vf a) { return _mm256_sqrt_ps(a); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_fnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }

static inline vf vf_load_bf16(const uint16_t *p)
{
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline vf vf_load_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* 8 halves (bf16 or fp16 bits) of one vector. */
typedef __m128i vh;
#define TD_NT_BYTES 16 /* alignment a streaming store of vh needs */
static inline vh vf_to_bf16(vf x)
{
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
static inline vh vf_to_f16(vf x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline void vh_storeu(uint16_t *p, vh h) { _mm_storeu_si128((__m128i *)p, h); }
static inline void vh_stream(uint16_t *p, vh h) { _mm_stream_si128((__m128i *)p, h); }
static inline void vf_stream(float *p, vf x) { _mm256_stream_ps(p, x); }
static inline void stream_fence(void) { _mm_sfence(); }

typedef __m256i vi;
static inline vi vi_set1(int32_t x) { return _mm256_set1_epi32(x); }
static inline vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
static inline vi vi_sub(vi a, vi b) { return _mm256_sub_epi32(a, b); }
static inline vi vi_and(vi a, vi b) { return _mm256_and_si256(a, b); }
static inline vi vi_or(vi a, vi b) { return _mm256_or_si256(a, b); }
static inline vi vi_srli(vi a, int n) { return _mm256_srli_epi32(a, n); }
static inline vi vi_slli(vi a, int n) { return _mm256_slli_epi32(a, n); }
static inline vi vi_min(vi a, vi b) { return _mm256_min_epi32(a, b); }
static inline vi vi_max(vi a, vi b) { return _mm256_max_epi32(a, b); }
static inline int32_t vi_hmax(vi a)
{
    __m128i m = _mm_max_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(m);
}
static inline vf vi_as_vf(vi a) { return _mm256_castsi256_ps(a); }
static inline vi vf_as_vi(vf a) { return _mm256_castps_si256(a); }
static inline vf vf_from_vi(vi a) { return _mm256_cvtepi32_ps(a); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vi vi_select_flt(vf a, vf b, vi x, vi y)
{
    return _mm256_blendv_epi8(y, x, _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_LT_OQ)));
}
static inline vi vi_select_ilt(vi a, vi b, vi x, vi y) { return _mm256_blendv_epi8(y, x, _mm256_cmpgt_epi32(b, a)); }
static inline vi vi_load_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline void vi_store_u8(uint8_t *p, vi x)
{
    __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packus_epi16(w, w));
}
static inline vi vi_mul(vi a, vi b) { return _mm256_mullo_epi32(a, b); }
static inline vi vi_xor(vi a, vi b) { return _mm256_xor_si256(a, b); }
static inline vi vi_iota(uint32_t i) { return _mm256_add_epi32(_mm256_set1_epi32((int32_t)i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
static inline vh vi_to_vh(vi a) { return _mm_packus_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1)); }

typedef struct vs_t { __m256d a, b; } vs_t;
static inline vs_t vs_zero(void) { return (vs_t){_mm256_setzero_pd(), _mm256_setzero_pd()}; }
static inline void vs_add_sq(vs_t *s, vf g)
{
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(g)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(g, 1));
    s->a = _mm256_fmadd_pd(lo, lo, s->a);
    s->b = _mm256_fmadd_pd(hi, hi, s->b);
}
static inline double vs_total(const vs_t *s)
{
    double t[4];
    _mm256_storeu_pd(t, _mm256_add_pd(s->a, s->b));
    return (t[0] + t[1]) + (t[2] + t[3]);
}

#include "adam_kernel.h"
