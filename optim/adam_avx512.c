/* The AVX-512 (F/BW/VL/DQ) instance of optim/adam_kernel.h: 16 floats per
 * vector.  bf16 rounding is integer arithmetic (RNE, NaN kept quiet; it does
 * not need AVX512_BF16); fp16 uses VCVTPS2PH with round-to-nearest-even.
 * Param outputs use streaming stores when aligned (see adam_kernel.h). */
#include <immintrin.h>
#include <stdint.h>

#define TD_KERNEL_TABLE td_adam_kernels_avx512
#define VW 16
typedef __m512 vf;

static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_loadu(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_storeu(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_sqrt(vf a) { return _mm512_sqrt_ps(a); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_fnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }

static inline vf vf_load_bf16(const uint16_t *p)
{
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline vf vf_load_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* 16 halves (bf16 or fp16 bits) of one vector. */
typedef __m256i vh;
#define TD_NT_BYTES 32 /* alignment a streaming store of vh needs */
static inline vh vf_to_bf16(vf x)
{
    __m512i u = _mm512_castps_si512(x);
    __m512i hi = _mm512_srli_epi32(u, 16);
    __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    __m512i nan = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, nan);
    return _mm512_cvtepi32_epi16(r);
}
static inline vh vf_to_f16(vf x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline void vh_storeu(uint16_t *p, vh h) { _mm256_storeu_si256((__m256i *)p, h); }
static inline void vh_stream(uint16_t *p, vh h) { _mm256_stream_si256((__m256i *)p, h); }
static inline void vf_stream(float *p, vf x) { _mm512_stream_ps(p, x); }
static inline void stream_fence(void) { _mm_sfence(); }

typedef __m512i vi;
static inline vi vi_set1(int32_t x) { return _mm512_set1_epi32(x); }
static inline vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vi vi_sub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
static inline vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
static inline vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
static inline vi vi_srli(vi a, int n) { return _mm512_srli_epi32(a, (unsigned)n); }
static inline vi vi_slli(vi a, int n) { return _mm512_slli_epi32(a, (unsigned)n); }
static inline vi vi_min(vi a, vi b) { return _mm512_min_epi32(a, b); }
static inline vi vi_max(vi a, vi b) { return _mm512_max_epi32(a, b); }
static inline int32_t vi_hmax(vi a) { return _mm512_reduce_max_epi32(a); }
static inline vf vi_as_vf(vi a) { return _mm512_castsi512_ps(a); }
static inline vi vf_as_vi(vf a) { return _mm512_castps_si512(a); }
static inline vf vf_from_vi(vi a) { return _mm512_cvtepi32_ps(a); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vi vi_select_flt(vf a, vf b, vi x, vi y) { return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), y, x); }
static inline vi vi_select_ilt(vi a, vi b, vi x, vi y) { return _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(a, b), y, x); }
static inline vi vi_load_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline void vi_store_u8(uint8_t *p, vi x) { _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(x)); }
static inline vi vi_mul(vi a, vi b) { return _mm512_mullo_epi32(a, b); }
static inline vi vi_xor(vi a, vi b) { return _mm512_xor_si512(a, b); }
static inline vi vi_iota(uint32_t i)
{
    return _mm512_add_epi32(_mm512_set1_epi32((int32_t)i), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}
static inline vh vi_to_vh(vi a) { return _mm512_cvtepi32_epi16(a); }

typedef struct vs_t { __m512d a, b; } vs_t;
static inline vs_t vs_zero(void) { return (vs_t){_mm512_setzero_pd(), _mm512_setzero_pd()}; }
static inline void vs_add_sq(vs_t *s, vf g)
{
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(g));
    __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(g), 1)));
    s->a = _mm512_fmadd_pd(lo, lo, s->a);
    s->b = _mm512_fmadd_pd(hi, hi, s->b);
}
static inline double vs_total(const vs_t *s) { return _mm512_reduce_add_pd(_mm512_add_pd(s->a, s->b)); }

#include "adam_kernel.h"
