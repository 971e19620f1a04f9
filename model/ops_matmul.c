/* Matmul with bias, forward and backward (see include/tidal/ops.h), on the
 * blocked GEMM of ops_gemm_impl.h, picking its instruction-set variant at run
 * time.  All three products are the same GEMM with different strides:
 *   forward  out    (N,OC) += inp (N,C)     @ weight^T  (B(k=c, n=oc) = weight[oc*C + c])
 *   dinp     dinp   (N,C)  += dout (N,OC)   @ weight    (B(k=oc, n=c) = weight[oc*C + c])
 *   dweight  dweight(OC,C) += dout^T (OC,N) @ inp       (A(m=oc, k=n) = dout[n*OC + oc])
 * so each output element is owned by one thread and summed over k in
 * ascending order: over c for out, over oc for dinp, over the rows n for
 * dweight.  dbias sums over rows n in ascending order, OC split across threads. */
#include "tidal/ops.h"

#include <stdlib.h>
#include <string.h>

#include "ops_internal.h"

int td_ops_isa_supported(td_ops_isa isa)
{
    switch (isa) {
    case TD_OPS_ISA_GENERIC: return 1;
#if defined(__x86_64__)
    case TD_OPS_ISA_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case TD_OPS_ISA_AVX512:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               td_ops_isa_supported(TD_OPS_ISA_AVX2);
#endif
    default: return 0;
    }
}

const char *td_ops_isa_name(td_ops_isa isa)
{
    static const char *const names[TD_OPS_ISA_COUNT] = {"generic", "avx2", "avx512"};
    return (unsigned)isa < TD_OPS_ISA_COUNT ? names[isa] : "?";
}

td_ops_gemm_fn *td_ops_gemm_get(td_ops_isa isa)
{
    switch (isa) {
    case TD_OPS_ISA_GENERIC: return td_ops_gemm_generic;
#if defined(__x86_64__)
    case TD_OPS_ISA_AVX2: return td_ops_gemm_avx2;
    case TD_OPS_ISA_AVX512: return td_ops_gemm_avx512;
#endif
    default: return NULL;
    }
}

td_ops_isa td_ops_isa_best(void)
{
    const char *forced = getenv("TD_OPS_ISA");
    if (forced && *forced)
        for (int i = 0; i < TD_OPS_ISA_COUNT; i++)
            if (!strcmp(forced, td_ops_isa_name((td_ops_isa)i)) && td_ops_isa_supported((td_ops_isa)i))
                return (td_ops_isa)i;
    for (int i = TD_OPS_ISA_COUNT - 1; i > 0; i--)
        if (td_ops_isa_supported((td_ops_isa)i)) return (td_ops_isa)i;
    return TD_OPS_ISA_GENERIC;
}

const char *td_ops_matmul_isa(void) { return td_ops_isa_name(td_ops_isa_best()); }

void td_ops_matmul_forward(float *out, const float *inp, const float *weight, const float *bias,
                           int N, int C, int OC)
{
    // out (N,OC) starts at the bias, then the GEMM adds inp @ weight^T
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        float *row = out + (size_t)n * OC;
        if (bias) memcpy(row, bias, (size_t)OC * sizeof(float));
        else memset(row, 0, (size_t)OC * sizeof(float));
    }
    td_ops_gemm_get(td_ops_isa_best())(N, OC, C, out, (size_t)OC, inp, (size_t)C, 1, weight, 1,
                                       (size_t)C);
}

/* Column blocks of dbias: wide enough to vectorise, many enough to share. */
enum { DBIAS_COLS = 64 };

void td_ops_matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                            const float *inp, const float *weight, int N, int C, int OC)
{
    td_ops_gemm_fn *gemm = td_ops_gemm_get(td_ops_isa_best());
    if (dinp) // dinp (N,C) += dout (N,OC) @ weight (OC,C)
        gemm(N, C, OC, dinp, (size_t)C, dout, (size_t)OC, 1, weight, (size_t)C, 1);
    // dweight (OC,C) += dout^T (OC,N) @ inp (N,C): the reduction runs over the rows n (NULL: frozen)
    if (dweight) gemm(OC, C, N, dweight, (size_t)C, dout, 1, (size_t)OC, inp, (size_t)C, 1);
    if (dbias) {
        const int blocks = (OC + DBIAS_COLS - 1) / DBIAS_COLS;
#pragma omp parallel for schedule(static)
        for (int blk = 0; blk < blocks; blk++) {
            const int o0 = blk * DBIAS_COLS, o1 = o0 + DBIAS_COLS < OC ? o0 + DBIAS_COLS : OC;
            for (int n = 0; n < N; n++) { // rows in ascending order, every column
                const float *d = dout + (size_t)n * OC;
                for (int o = o0; o < o1; o++) dbias[o] += d[o];
            }
        }
    }
}
