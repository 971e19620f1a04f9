/* The blocked fp32 GEMM, one definition for every instruction set.
 *
 * Included by ops_matmul.c (generic), ops_gemm_avx2.c and ops_gemm_avx512.c,
 * each defining TD_GEMM_NAME (the function), TD_GEMM_R (rows of the register
 * tile) and TD_GEMM_J (its columns, a multiple of the vector width).  The
 * contract is in ops_internal.h.
 *
 * Structure (the classic one, see Goto & van de Geijn): C is cut into tasks of
 * MB x NB; tasks run in parallel.  A task walks K in blocks of KB: it packs
 * the KB x NB block of B into a contiguous stack panel (this is what lets the
 * inner loop read B along n whatever B's strides are), then sweeps R x J
 * register tiles over it.  A register tile keeps R*J accumulators in vector
 * registers across the whole k block: per k it broadcasts R values of A and
 * does R*J/width vector multiplies and adds.  Plain C: the J loop has a
 * constant trip count, so GCC vectorises it at -O2 and, with the R loop
 * unrolled, keeps the accumulator array in registers.  Partial tiles at the
 * right and bottom edges run a scalar loop with the same summation order. */
#include "ops_internal.h"

#include <omp.h>

#if !defined(TD_GEMM_NAME) || !defined(TD_GEMM_R) || !defined(TD_GEMM_J)
#error "define TD_GEMM_NAME, TD_GEMM_R and TD_GEMM_J before including ops_gemm_impl.h"
#endif

enum { GEMM_MB = 256, GEMM_NB = 64, GEMM_KB = 256 };
_Static_assert(GEMM_NB % TD_GEMM_J == 0 && GEMM_MB % TD_GEMM_R == 0, "tile must divide the block");

/* panel[k][j] = B(k0 + k, n0 + j), row stride GEMM_NB. */
static void pack_panel(float *restrict panel, const float *restrict b, size_t b_ks, size_t b_ns,
                       int kb, int nb)
{
    if (b_ns == 1) {
        for (int k = 0; k < kb; k++)
            for (int j = 0; j < nb; j++) panel[k * GEMM_NB + j] = b[k * b_ks + j];
    } else { /* read along k, B's contiguous direction */
        for (int j = 0; j < nb; j++)
            for (int k = 0; k < kb; k++) panel[k * GEMM_NB + j] = b[k * b_ks + j * b_ns];
    }
}

/* c (R,J) += a (R,kb) @ panel (kb, J). */
/* noipa: compiled on its own, without inter-procedural rewrites of its
 * arguments, GCC keeps every accumulator in a register (inlined or
 * IPA-specialised, it spilled some on AVX2). */
#if defined(__clang__)
__attribute__((noinline))
#else
__attribute__((noipa))
#endif
static void register_tile(float *restrict c, size_t ldc, const float *restrict a, size_t a_ms,
                          size_t a_ks, const float *restrict panel, int kb)
{
    float acc[TD_GEMM_R][TD_GEMM_J];
#pragma GCC unroll 16
    for (int r = 0; r < TD_GEMM_R; r++)
        for (int j = 0; j < TD_GEMM_J; j++) acc[r][j] = c[r * ldc + j];
    for (int k = 0; k < kb; k++) {
        const float *p = panel + k * GEMM_NB;
#pragma GCC unroll 16
        for (int r = 0; r < TD_GEMM_R; r++) {
            const float ar = a[r * a_ms + k * a_ks];
            for (int j = 0; j < TD_GEMM_J; j++) acc[r][j] += ar * p[j];
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < TD_GEMM_R; r++)
        for (int j = 0; j < TD_GEMM_J; j++) c[r * ldc + j] = acc[r][j];
}

/* The same sums for a partial tile (rows <= R, cols <= J). */
static void edge_tile(float *c, size_t ldc, const float *a, size_t a_ms, size_t a_ks,
                      const float *panel, int kb, int rows, int cols)
{
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++) {
            float s = c[r * ldc + j];
            for (int k = 0; k < kb; k++) s += a[r * a_ms + k * a_ks] * panel[k * GEMM_NB + j];
            c[r * ldc + j] = s;
        }
}

void TD_GEMM_NAME(int M, int N, int K, float *c, size_t ldc, const float *a, size_t a_ms,
                  size_t a_ks, const float *b, size_t b_ks, size_t b_ns)
{
    if (M <= 0 || N <= 0 || K <= 0) return;
    const long m_blocks = (M + GEMM_MB - 1) / GEMM_MB, n_blocks = (N + GEMM_NB - 1) / GEMM_NB;
    /* Serial when called from a parallel region (the attention's tiles). */
#pragma omp parallel for schedule(static) if (!omp_in_parallel())
    for (long task = 0; task < m_blocks * n_blocks; task++) {
        const int m0 = (int)(task / n_blocks) * GEMM_MB, n0 = (int)(task % n_blocks) * GEMM_NB;
        const int mb = M - m0 < GEMM_MB ? M - m0 : GEMM_MB;
        const int nb = N - n0 < GEMM_NB ? N - n0 : GEMM_NB;
        float panel[GEMM_KB * GEMM_NB] __attribute__((aligned(64)));
        for (int k0 = 0; k0 < K; k0 += GEMM_KB) { /* ascending: the k-sum order */
            const int kb = K - k0 < GEMM_KB ? K - k0 : GEMM_KB;
            pack_panel(panel, b + (size_t)k0 * b_ks + (size_t)n0 * b_ns, b_ks, b_ns, kb, nb);
            for (int i = 0; i < mb; i += TD_GEMM_R) {
                const float *at = a + (size_t)(m0 + i) * a_ms + (size_t)k0 * a_ks;
                for (int j = 0; j < nb; j += TD_GEMM_J) {
                    float *ct = c + (size_t)(m0 + i) * ldc + (size_t)(n0 + j);
                    if (i + TD_GEMM_R <= mb && j + TD_GEMM_J <= nb)
                        register_tile(ct, ldc, at, a_ms, a_ks, panel + j, kb);
                    else
                        edge_tile(ct, ldc, at, a_ms, a_ks, panel + j, kb,
                                  mb - i < TD_GEMM_R ? mb - i : TD_GEMM_R,
                                  nb - j < TD_GEMM_J ? nb - j : TD_GEMM_J);
                }
            }
        }
    }
}
