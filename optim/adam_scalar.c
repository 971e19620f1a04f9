/* The portable instance of optim/adam_kernel.h: one float per "vector".
 * fmaf gives the single rounding the vector FMAs give, so this instance is
 * bit-identical to the AVX2 and AVX-512 ones (and is their test oracle). */
#include <math.h>
#include <stdint.h>

#include "tidal/convert.h"

#define TD_KERNEL_TABLE td_adam_kernels_scalar
#define VW 1
typedef float vf;

static inline vf vf_set1(float x) { return x; }
static inline vf vf_loadu(const float *p) { return *p; }
static inline void vf_storeu(float *p, vf x) { *p = x; }
static inline vf vf_mul(vf a, vf b) { return a * b; }
static inline vf vf_div(vf a, vf b) { return a / b; }
static inline vf vf_sqrt(vf a) { return sqrtf(a); }
static inline vf vf_fma(vf a, vf b, vf c) { return fmaf(a, b, c); }
static inline vf vf_fnma(vf a, vf b, vf c) { return fmaf(-a, b, c); }
static inline vf vf_load_bf16(const uint16_t *p) { return td_f32_from_bf16(*p); }
static inline vf vf_load_f16(const uint16_t *p) { return td_f32_from_f16(*p); }
typedef uint16_t vh;
#define TD_NT_BYTES 0 /* no streaming stores */
static inline vh vf_to_bf16(vf x) { return td_bf16_from_f32(x); }
static inline vh vf_to_f16(vf x) { return td_f16_from_f32(x); }
static inline void vh_storeu(uint16_t *p, vh h) { *p = h; }
static inline void vh_stream(uint16_t *p, vh h) { *p = h; }
static inline void vf_stream(float *p, vf x) { *p = x; }
static inline void stream_fence(void) {}

/* Lanes as uint32_t so adds and subtracts wrap as the vector ones do. */
typedef uint32_t vi;
static inline vi vi_set1(int32_t x) { return (uint32_t)x; }
static inline vi vi_add(vi a, vi b) { return a + b; }
static inline vi vi_sub(vi a, vi b) { return a - b; }
static inline vi vi_and(vi a, vi b) { return a & b; }
static inline vi vi_or(vi a, vi b) { return a | b; }
static inline vi vi_srli(vi a, int n) { return a >> n; }
static inline vi vi_slli(vi a, int n) { return a << n; }
static inline vi vi_min(vi a, vi b) { return (int32_t)a < (int32_t)b ? a : b; }
static inline vi vi_max(vi a, vi b) { return (int32_t)a > (int32_t)b ? a : b; }
static inline int32_t vi_hmax(vi a) { return (int32_t)a; }
static inline vf vi_as_vf(vi a) { union { uint32_t u; float f; } c = {a}; return c.f; }
static inline vi vf_as_vi(vf a) { union { float f; uint32_t u; } c = {a}; return c.u; }
static inline vf vf_from_vi(vi a) { return (float)(int32_t)a; }
static inline vf vf_add(vf a, vf b) { return a + b; }
static inline vi vi_select_flt(vf a, vf b, vi x, vi y) { return a < b ? x : y; }
static inline vi vi_select_ilt(vi a, vi b, vi x, vi y) { return (int32_t)a < (int32_t)b ? x : y; }
static inline vi vi_load_u8(const uint8_t *p) { return *p; }
static inline void vi_store_u8(uint8_t *p, vi x) { *p = (uint8_t)x; }
static inline vi vi_mul(vi a, vi b) { return a * b; }
static inline vi vi_xor(vi a, vi b) { return a ^ b; }
static inline vi vi_iota(uint32_t i) { return i; }
static inline vh vi_to_vh(vi a) { return (uint16_t)a; }

typedef double vs_t;
static inline vs_t vs_zero(void) { return 0.0; }
static inline void vs_add_sq(vs_t *s, vf g) { *s += (double)g * (double)g; }
static inline double vs_total(const vs_t *s) { return *s; }

#include "adam_kernel.h"
