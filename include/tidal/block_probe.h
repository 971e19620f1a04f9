/* One transformer block on the device, set up to be timed: its params and
 * grads, its activations and the buffers its forward and backward read and
 * write, all from one arena of exactly their size, with random params,
 * input and output gradient, and an ops context.  `tidal plan` times the whole block;
 * `tidal bench ops` times each op on the same buffers.  CUDA builds only. */
#ifndef TIDAL_BLOCK_PROBE_H
#define TIDAL_BLOCK_PROBE_H

#include "tidal/arena.h"
#include "tidal/backend.h"
#include "tidal/ops_cuda.h"

typedef struct td_block_probe {
    td_gpt_ref_config mc;      /* the model's shape, one layer */
    int B, T, N;
    td_dtype dt;
    td_arena *arena;
    td_ops_cuda *ops;
    void *stream;              /* the backend's compute queue */
    td_ops_cuda_block w, g;    /* params, grads */
    td_ops_cuda_block_acts a;
    void *x, *y, *dy, *dx;     /* (N,C) each */
    void *big;                 /* (N,4C): an MLP-wide gradient */
    void *scratch;
    size_t scratch_bytes;
} td_block_probe;

/* The bytes td_block_probe_create reserves on the device. */
size_t td_block_probe_bytes(const td_gpt_ref_config *model, int B, int T, td_dtype dt);
/* TD_ERR_BUDGET (from the arena) when the device cannot hold it. */
td_status td_block_probe_create(td_backend *b, const td_gpt_ref_config *model, int B, int T, td_dtype dt,
                                td_block_probe **out);
void td_block_probe_destroy(td_block_probe *p); /* NULL is a no-op */
/* Forward (filling the acts) and backward of the block, each the best of
 * `repeat` runs after one warm-up, in ms, timed with events on the stream. */
td_status td_block_probe_time(td_block_probe *p, int repeat, double *fwd_ms, double *bwd_ms);
td_status td_block_probe_forward(td_block_probe *p);
td_status td_block_probe_backward(td_block_probe *p);

#endif
