/* One transformer block on the device, set up to be timed: its params and
 * grads, its activations and the buffers its forward and backward read and
 * write, all from one arena of exactly their size, with random params,
 * input and output gradient, and an ops context.  The block is the model's
 * own: GPT-2's (LayerNorm, multi-head attention, GELU MLP) or a LLaMA-family
 * one (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, Qwen2's q/k/v
 * biases), at the description's widths, heads and key/value heads, composed
 * from the same CUDA ops the trainer runs.  `tidal plan` times the whole
 * block; `tidal bench ops` times each op on the same buffers.  CUDA builds only. */
#ifndef TIDAL_BLOCK_PROBE_H
#define TIDAL_BLOCK_PROBE_H

#include "tidal/arena.h"
#include "tidal/backend.h"
#include "tidal/ops_cuda.h"

typedef struct td_block_probe {
    td_model_desc mc;      /* the model's description, one layer */
    int B, T, N;
    td_dtype dt;
    td_arena *arena;
    td_ops_cuda *ops;
    void *stream;              /* the backend's compute queue */
    td_ops_cuda_block w, g;    /* params, grads (td_ops_cuda_block_view of the family) */
    td_ops_cuda_block_acts a;
    float *inv_freq;           /* LLaMA family: RoPE's table (hs/2) on the device; GPT-2: NULL */
    void *x, *y, *dy, *dx;     /* (N,C) each */
    void *big;                 /* (N, max(fc out, QKV)): the MLP's widest gradient (4C; gate|up 2H), or dqkv */
    /* LLaMA family, for timing its ops one by one (GPT-2: NULL): */
    void *mid;                 /* (N,H): the gradient of silu(gate) * up */
    void *dres, *dc;           /* (N,C): the residual's gradient and a norm's input gradient */
    void *scratch;
    size_t scratch_bytes;
} td_block_probe;

/* The bytes td_block_probe_create reserves on the device. */
size_t td_block_probe_bytes(const td_model_desc *model, int B, int T, td_dtype dt);
/* TD_ERR_BUDGET (from the arena) when the device cannot hold it. */
td_status td_block_probe_create(td_backend *b, const td_model_desc *model, int B, int T, td_dtype dt,
                                td_block_probe **out);
void td_block_probe_destroy(td_block_probe *p); /* NULL is a no-op */
/* Forward (filling the acts), backward and recompute (the forward without
 * its last projection, as backward reruns a checkpointed block; rec_ms may
 * be NULL) of the block, each the best of `repeat` runs after one warm-up,
 * in ms, timed with events on the stream;
 * first the block runs at full load for TD_BLOCK_PROBE_HEAT_MS, so the
 * times are the ones a step-long run sustains under the GPU's power limit,
 * not a cold GPU's burst. */
#define TD_BLOCK_PROBE_HEAT_MS 500.0
td_status td_block_probe_time(td_block_probe *p, int repeat, double *fwd_ms, double *bwd_ms, double *rec_ms);
td_status td_block_probe_forward(td_block_probe *p);
td_status td_block_probe_recompute(td_block_probe *p); /* the forward, y not written */
td_status td_block_probe_backward(td_block_probe *p);

#endif
