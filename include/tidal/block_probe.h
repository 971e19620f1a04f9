/* One transformer block on the device, set up to be timed: its params and
 * grads, its activations and the buffers its forward and backward read and
 * write, all from one arena of exactly their size, with random params,
 * input and output gradient, and an ops context.  The block is the model's
 * own, run through its family's CUDA compute (family.h, td_model_exec) at
 * the description's widths and heads: what the trainer runs.  `tidal plan`
 * times the whole block; `tidal bench ops` times each op on the same
 * buffers.  CUDA builds only. */
#ifndef TIDAL_BLOCK_PROBE_H
#define TIDAL_BLOCK_PROBE_H

#include "tidal/arena.h"
#include "tidal/backend.h"
#include "tidal/family.h"
#include "tidal/ops_cuda.h"

typedef struct td_block_probe {
    td_model_desc mc;          /* the model's description, one layer */
    int B, T, N;
    td_dtype dt;
    td_arena *arena;
    td_ops_cuda *ops;
    void *stream;              /* the backend's compute queue */
    const td_model_exec *exec; /* the family's CUDA compute */
    td_model_run run;          /* its shape and buffers */
    td_model_lora_drop lora_drop; /* a LoRA dropout's key (a dropout above 0): the step's masks cost their time */
    void *p[TD_MODEL_BLOCK_TENSORS], *gp[TD_MODEL_BLOCK_TENSORS]; /* the block's params, grads (layout order) */
    td_ops_cuda_block w, g;    /* the same by role (td_ops_cuda_block_view) */
    void *acts;                /* the block's activations (the exec's block_acts_bytes) */
    void *x, *y, *dy, *dx;     /* (N,C) each */
    void *consts;              /* the family's constants (RoPE's table), or NULL */
    void *scratch;
    size_t scratch_bytes;
    /* With op_buffers, for timing the ops one by one (else NULL): */
    td_ops_cuda_block_acts a;  /* the acts by field: the caller views `acts` as its block keeps them */
    void *big;                 /* (N, the widest matmul output of the block): dfch, dgate_up, dqkv */
    void *mid;                 /* (N,H): the gradient of an MLP's activation */
    void *dres, *dc;           /* (N, max(C, NH hs)): the residual's gradient and a norm's input gradient */
} td_block_probe;

/* The bytes td_block_probe_create reserves on the device. */
size_t td_block_probe_bytes(const td_model_desc *model, int B, int T, td_dtype dt, int op_buffers);
/* TD_ERR_BUDGET (from the arena) when the device cannot hold it;
 * TD_ERR_UNSUPPORTED when the family has no CUDA compute. */
td_status td_block_probe_create(td_backend *b, const td_model_desc *model, int B, int T, td_dtype dt, int op_buffers,
                                td_block_probe **out);
void td_block_probe_destroy(td_block_probe *p); /* NULL is a no-op */
/* The block's tensors with frozen[k] set (k over the block's tensors, in
 * the model's order) get no gradient: the backward computes their input's
 * gradient alone, as a run that freezes them does (LoRA's base, --freeze). */
void td_block_probe_freeze(td_block_probe *p, const uint8_t *frozen);
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

/* The devices' link for ZeRO-3's collectives: GB/s of 256 MiB peer copies
 * into this backend's GPU from another (GPU 1, or 0 from GPU 1), best of
 * 4, through arenas on both; *what says how (peer-to-peer, or staged through
 * the host where the GPUs cannot reach each other).  0 with one GPU. */
td_status td_link_probe_cuda(td_backend *b, double *gbytes_per_s, const char **what);

#endif
