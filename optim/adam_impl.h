/* Internal to optim/: the per-ISA kernel tables and the instruction-set
 * probe.  Each table is one instance of optim/adam_kernel.h. */
#ifndef TIDAL_OPTIM_ADAM_IMPL_H
#define TIDAL_OPTIM_ADAM_IMPL_H

#include "tidal/optim.h"

typedef struct td_adam_kernels {
    /* Elements [begin, end) of one chunk. */
    void (*update)(const td_adam_coeffs *c, const td_adam_chunk *chunk, size_t begin, size_t end);
    /* Sum of squares, in double, of grads [begin, end). */
    double (*sumsq)(const void *grad, td_dtype dtype, size_t begin, size_t end);
    /* Elements [begin, end) of a moment buffer of `numel` elements from /
     * into fp32 values x[0 .. end - begin) (is_v: v's code; int8: whole
     * blocks). */
    void (*moment_store)(td_optim_state st, int is_v, const float *x, void *buf, size_t numel, size_t begin,
                         size_t end);
    void (*moment_load)(td_optim_state st, int is_v, const void *buf, size_t numel, float *x, size_t begin,
                        size_t end);
} td_adam_kernels;

extern const td_adam_kernels td_adam_kernels_scalar;
extern const td_adam_kernels td_adam_kernels_avx2;
extern const td_adam_kernels td_adam_kernels_avx512;

/* The table of an ISA (AUTO: the best supported). */
const td_adam_kernels *td_adam_kernels_for(td_optim_isa isa);

#endif
