/* The blocked GEMM for AVX2 (built with -mavx2 -mfma; FMA stays unused, see
 * ops_internal.h): 4 x 16 register tile = 8 ymm accumulators. */
#if defined(__x86_64__)
#define TD_GEMM_NAME td_ops_gemm_avx2
#define TD_GEMM_R 4
#define TD_GEMM_J 16
#include "ops_gemm_impl.h"
#endif
