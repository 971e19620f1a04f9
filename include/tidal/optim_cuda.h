/* optim on the GPU: AdamW for chunks whose optimizer state lives on the GPU,
 * and the grad sum of squares of chunks whose grads stay there.
 *
 * Same semantics as the CPU engine (optim.h), same td_adam_coeffs from
 * td_optim_begin_step, and the same IEEE operations in the same order
 * (explicit round-to-nearest intrinsics, fused multiply-adds where the CPU
 * kernels fuse, RNE 16-bit outputs from convert.h), so a chunk
 * updated here is bit-identical to the CPU update of the same chunk, for
 * every state type (fp32, bf16, int8: chunk->state, moment buffers in the
 * layout of td_adam_moment_bytes, on the device).
 *
 * All pointers in a td_adam_chunk are device pointers, the no-decay range
 * list (chunk->no_decay) included: the kernel reads it, so a caller keeps it
 * in device memory for the call's lifetime on the stream; `stream` is a
 * cudaStream_t (NULL: the legacy default stream), e.g. from
 * td_backend_native_queue.  Calls are asynchronous on the stream; errors of
 * the launch are returned, errors of the kernel surface at the next
 * synchronisation.  Available only in CUDA builds (TD_HAVE_CUDA).
 * Thread-safety: reentrant; ordering is the stream's. */
#ifndef TIDAL_OPTIM_CUDA_H
#define TIDAL_OPTIM_CUDA_H

#include "tidal/optim.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The fused update of one chunk (device pointers). */
td_status td_adam_update_cuda(const td_adam_coeffs *c, const td_adam_chunk *chunk, void *stream);

/* Doubles of device scratch td_grad_sumsq_cuda needs (one per block). */
#define TD_GRAD_SUMSQ_CUDA_SCRATCH 1024

/* Adds the sum of squares (in double) of `numel` device grads to *dev_acc
 * (one device double).  Deterministic: fixed block partition and a fixed
 * reduction order, no atomics.  Summing several chunks into one dev_acc on
 * one stream and copying it back once gives td_grad_stats.sumsq; a non-finite
 * grad makes it non-finite, as on the CPU.  dev_scratch: device memory of
 * TD_GRAD_SUMSQ_CUDA_SCRATCH doubles, free for the duration of the call. */
td_status td_grad_sumsq_cuda(const void *grad, td_dtype dtype, size_t numel, double *dev_acc,
                             double *dev_scratch, void *stream);

#ifdef __cplusplus
}
#endif
#endif
