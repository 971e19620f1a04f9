/* The blocked GEMM for AVX-512 (built with -mavx512f ...; FMA stays unused,
 * see ops_internal.h): 8 x 32 register tile = 16 zmm accumulators. */
#if defined(__x86_64__)
#define TD_GEMM_NAME td_ops_gemm_avx512
#define TD_GEMM_R 8
#define TD_GEMM_J 32
#include "ops_gemm_impl.h"
#endif
