/* Internals shared by the CPU reference ops (model/ops_*.c) and their tests.
 *
 * td_ops_gemm_*: the one blocked fp32 GEMM behind td_ops_matmul_*, compiled
 * once per instruction set from ops_gemm_impl.h.  Every variant computes
 *   C[m][n] += sum_{k ascending} A(m,k) * B(k,n)      m < M, n < N, k < K
 * with A(m,k) = a[m*a_ms + k*a_ks] and B(k,n) = b[k*b_ks + n*b_ns], one
 * rounding per multiply and per add (no FMA contraction: the project builds
 * with -std=c11, which implies -ffp-contract=off).  Each C element is owned by
 * one thread and its k-sum never changes order, so the result equals the
 * naive triple loop bit for bit, for any thread count and any variant.
 * c must not overlap a or b.  It runs its own OpenMP loop over tiles, or runs
 * serially when called from inside a parallel region. */
#ifndef TIDAL_OPS_INTERNAL_H
#define TIDAL_OPS_INTERNAL_H

#include <math.h>
#include <stddef.h>

typedef enum td_ops_isa {
    TD_OPS_ISA_GENERIC,  /* whatever the base flags allow (SSE2 on x86-64) */
    TD_OPS_ISA_AVX2,
    TD_OPS_ISA_AVX512,
    TD_OPS_ISA_COUNT
} td_ops_isa;

typedef void td_ops_gemm_fn(int M, int N, int K, float *c, size_t ldc,
                            const float *a, size_t a_ms, size_t a_ks,
                            const float *b, size_t b_ks, size_t b_ns);

td_ops_gemm_fn td_ops_gemm_generic;
#if defined(__x86_64__)
td_ops_gemm_fn td_ops_gemm_avx2;
td_ops_gemm_fn td_ops_gemm_avx512;
/* GELU, tanh approximation: gelu(x) = 0.5 x (1 + tanh u) = x sigmoid(2u),
 * u = K (x + A x^3); written with expf, several times faster than tanhf in
 * glibc.  The GELU op and the GeGLU MLP share these. */
#define TD_OPS_GELU_K 0.7978845608028654f /* sqrt(2 / pi) */
#define TD_OPS_GELU_A 0.044715f
static inline float td_ops_sigmoid2(float u) { return 1.0f / (1.0f + expf(-2.0f * u)); }
static inline float td_ops_gelu(float x)
{
    return x * td_ops_sigmoid2(TD_OPS_GELU_K * (x + TD_OPS_GELU_A * x * x * x));
}
/* d/dx x sig(2u) = sig + x * 2 sig (1 - sig) * du/dx,  du/dx = K (1 + 3 A x^2) */
static inline float td_ops_gelu_grad(float x)
{
    const float sig = td_ops_sigmoid2(TD_OPS_GELU_K * (x + TD_OPS_GELU_A * x * x * x));
    const float du = TD_OPS_GELU_K * (1.0f + 3.0f * TD_OPS_GELU_A * x * x);
    return sig + x * 2.0f * sig * (1.0f - sig) * du;
}

#endif

/* The best variant this CPU runs, or the one forced by the environment
 * variable TD_OPS_ISA=generic|avx2|avx512 (ignored if the CPU lacks it). */
td_ops_isa td_ops_isa_best(void);
/* 1 if this CPU can run the variant. */
int td_ops_isa_supported(td_ops_isa isa);
const char *td_ops_isa_name(td_ops_isa isa);
/* The GEMM of one variant (NULL if not built for this architecture). */
td_ops_gemm_fn *td_ops_gemm_get(td_ops_isa isa);

/* Fixed-order vector helpers: 16 independent lanes, each summed in index
 * order, then folded 8+8, 4+4, 2+2, 1+1.  The order depends on n only, so the
 * compiler can vectorise the lanes without changing a single bit. */
static inline float td_ops_dot(const float *a, const float *b, int n)
{
    float lane[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) lane[j] += a[i + j] * b[i + j];
    for (int j = 0; i + j < n; j++) lane[j] += a[i + j] * b[i + j];
    for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) lane[j] += lane[j + w];
    return lane[0];
}

/* y[i] += alpha * x[i], n elements (no reduction: order-free). */
static inline void td_ops_axpy(float *restrict y, float alpha, const float *restrict x, int n)
{
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) y[i + j] += alpha * x[i + j];
    for (; i < n; i++) y[i] += alpha * x[i];
}

#endif
