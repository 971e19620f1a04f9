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

typedef double vs_t;
static inline vs_t vs_zero(void) { return 0.0; }
static inline void vs_add_sq(vs_t *s, vf g) { *s += (double)g * (double)g; }
static inline double vs_total(const vs_t *s) { return *s; }

#include "adam_kernel.h"
