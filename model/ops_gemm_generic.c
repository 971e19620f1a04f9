/* The blocked GEMM with the base flags only (SSE2 on x86-64, or any other
 * architecture): 4 x 8 register tile = 8 xmm accumulators. */
#define TD_GEMM_NAME td_ops_gemm_generic
#define TD_GEMM_R 4
#define TD_GEMM_J 8
#include "ops_gemm_impl.h"
