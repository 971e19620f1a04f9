/* The trainer: a GPT-2 model whose params, grads and optimizer state live in
 * the chunk manager, trained block by block under a device budget.
 *
 * One optimizer step = grad_accum micro-batches of B sequences of T tokens:
 *   forward   embedding, then block by block: access the block's params
 *             (COMPUTE), run it, release them (HOLD_AFTER_FWD); the input of
 *             every block is kept (activation checkpointing) or all of each
 *             block's activations (--ckpt off);
 *   head      final LayerNorm, logits against the tied embedding, fused
 *             softmax cross-entropy, and its backward at once;
 *   backward  blocks in reverse: access params and grads, recompute the
 *             block's activations from its kept input if checkpointing, run
 *             its backward; grads of the last micro-batch become
 *             READY_FOR_REDUCE and start for the host at once;
 *   optimizer the global grad norm from every grad chunk (exact clipping and
 *             overflow detection), then AdamW chunk by chunk: the optimizer
 *             chunks placed on the GPU (td_train_plan.optim_gpu_chunks: the
 *             least CPU slack first) on the device, where their grads stay;
 *             the others on the host (fp32 master, m, v), writing the new
 *             params into the param chunk's host copy, which the next step
 *             uploads: in the next step's forward, each chunk just before
 *             its first use (without clipping and loss scale, during this
 *             step's backward instead).  With the AdamW thread
 *             (cfg.adam_thread) the host's updates run on that thread,
 *             from the backward on when nothing waits for the global norm,
 *             and the next forward waits for each chunk's just before its
 *             first use.
 * On several ranks (td_train_config.ranks, ZeRO-3) each rank runs its slice
 * of the global batch; a chunk's grads are reduce-scattered as soon as the
 * last micro-batch's backward finishes them, each rank's AdamW updates its
 * shard of every chunk (on the GPU for the chunks placed there, else on the
 * host in the next forward), and each chunk's params are all-gathered on
 * the device just before the next forward first uses them.
 * The first step is the chunk manager's warm-up (it records the access order
 * and plans placement, eviction and prefetch).  Activations are taken from
 * the arena once, at creation: no step allocates.
 *
 * Numerics do not depend on where chunks live: a seeded run gives the same
 * losses bit for bit under every policy and budget that fits.
 * Thread-safety: one thread drives a trainer. */
#ifndef TIDAL_TRAINER_H
#define TIDAL_TRAINER_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "tidal/alloc.h"
#include "tidal/backend.h"
#include "tidal/parallel.h"
#include "tidal/dtype.h"
#include "tidal/model_ref.h"
#include "tidal/memmgr.h"
#include "tidal/model.h"
#include "tidal/optim.h"
#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_trainer td_trainer;

typedef enum td_ckpt_mode { TD_CKPT_AUTO, TD_CKPT_ON, TD_CKPT_OFF } td_ckpt_mode;

/* td_train_config.gpu_budget's two sizes that are not byte counts (see
 * td_train_budget_resolve). */
#define TD_GPU_BUDGET_DEFAULT 0
#define TD_GPU_BUDGET_MAX SIZE_MAX

typedef enum td_shard_mode { TD_SHARD_AUTO, TD_SHARD_WORLD, TD_SHARD_NODE } td_shard_mode;
const char *td_shard_mode_name(td_shard_mode m);
td_status td_shard_mode_parse(const char *name, td_shard_mode *out); /* auto, world, node */
/* Where the grads' reduce-scatters run under ZeRO-3: on the gathers'
 * communicator (SHARED, the default), or on a communicator of their own
 * beside it (OWN: a second set of NCCL buffers out of each GPU's budget);
 * td_train_default_config takes it from TD_REDUCE_COMM (shared, own),
 * INVALID when that names neither (td_train_config_check says so). */
typedef enum td_reduce_comm { TD_REDUCE_COMM_SHARED, TD_REDUCE_COMM_OWN, TD_REDUCE_COMM_INVALID } td_reduce_comm;

typedef struct td_train_config {
    td_model_desc model;
    int micro_batch, seq_len, grad_accum;
    uint64_t seed;
    td_dtype precision;           /* the cpu backend computes in fp32 */
    td_ckpt_mode ckpt;
    int ckpt_blocks;              /* TD_CKPT_ON: recompute the first ckpt_blocks blocks and keep the
                                     others' activations (0: all of them) */
    int loss_chunk;               /* rows of the B*T whose logits exist at once: the head and the loss run
                                     over chunks of this many rows, forward and backward of one chunk
                                     before the next, so the (rows, padded vocab) logits are the only ones
                                     held (0: auto, td_train_loss_rows; at least B*T: one chunk) */
    td_backend_kind backend;
    size_t gpu_budget;            /* device bytes; TD_GPU_BUDGET_DEFAULT (0): what the run needs with all of it
                                     resident, plus an eighth, capped by free device memory minus a margin;
                                     TD_GPU_BUDGET_MAX: all of that free memory (td_train_budget_resolve) */
    size_t host_pin_limit;        /* 0: 80% of the host RAM */
    size_t host_ram;              /* host memory the run may use; 0: MemTotal, or the cgroup's limit when
                                     lower (td_host_ram) */
    size_t cpu_device_bytes;      /* the cpu backend's "device" region (a host region standing for a GPU's
                                     memory); 0: td_backend_default_params' (4 GiB, or TD_CPU_DEVICE_BYTES),
                                     raised to gpu_budget when that is larger (td_train_backend_params) */
    td_memmgr_params mm;          /* placement, fractions, eviction, prefetch, trace_out; disk_dirs (--offload-dir):
                                     the disk tier, where the optimizer state the host's RAM cannot hold lives */
    size_t disk_bytes;            /* the disk space the plan may use for the disk tier (--disk-bytes): 0, the
                                     free space of mm.disk_dirs; given without directories, the plan places
                                     state on a disk it does not have (tidal plan only) */
    td_optim_params optim;        /* optim.state: how AdamW's m and v are stored (--optim-state) */
    size_t save_shard_bytes;      /* checkpoints: weights above this go to Hugging Face shards (0: 5 GB) */
    int decay_all;                /* 1: weight decay on every tensor; 0: on the matrices only (2-D weights,
                                     embeddings included), not on norm gains and biases (docs/training.md) */
    int threads;                  /* CPU AdamW and ops; 0: all local cores */
    int adam_thread;              /* the host's AdamW on a thread of its own, beside the GPU work (each chunk as
                                     its grads land, or, with clipping, as the next forward needs it):
                                     1 on, -1 off, 0 auto: on with the cuda backend.  The AdamW
                                     team then leaves one of the local cores to the thread driving the GPU.
                                     The results are the same either way. */
    /* Data parallelism with ZeRO-3 (docs/distributed.md): `ranks` processes
     * (0 or 1: one), this one `rank`.  Every chunk is split over the ranks:
     * each rank's host keeps its shard of the fp32 master and the AdamW
     * moments and updates it alone; params are all-gathered into the device
     * chunk after each update, grads reduce-scattered right after their
     * last use in the backward.  micro_batch is per rank (the global batch
     * is ranks x micro_batch x grad_accum).  The plan needs only the
     * counts (per-rank bytes); the trainer joins the job `dist` describes
     * (its rank and size must be these) with a communicator of its own on
     * its backend (GPU dist->local_rank on cuda), whose waits for a peer
     * end after comm_timeout_ms (0: td_comm_default_params'), and before it
     * allocates anything checks that every rank passed the same `agree`
     * settings (td_comm_agree: flags, model, data), failing on every rank
     * with a message naming the first difference.  The pointers are used
     * during td_trainer_create only. */
    int ranks, rank;
    int local_ranks;              /* of them on this host (0: unknown, taken as 1): each plans against 1/local_ranks
                                     of the host's RAM and pin limit (--host-ram, --host-pin-limit) */
    /* The ranks each chunk is split over (--shard): every rank of the job
     * (WORLD: the job holds each byte of the model state once), or each
     * host's (NODE: each host holds it once, its local_ranks the shards,
     * the hosts' copies of a shard's grads summed over the network; the
     * job's ranks must be numbered host by host).  AUTO (the default):
     * NODE where the job spans hosts and each host holds the model state,
     * else WORLD (td_train_resolve_shard). */
    td_shard_mode shard;
    td_reduce_comm reduce_comm;
    /* The communicator's own device memory (NCCL's buffers), out of
     * gpu_budget: 0 plans it (td_train_comm_device_bytes); the trainer
     * measures it and plans with that. */
    size_t comm_device_bytes;
    /* The heap the libraries hold once the backend (and on CUDA its context)
     * and the topology exist, beside tidal's own (td_train_library_heap):
     * the host plan's heap allowance is at least this plus the growth a run
     * adds after.  0: not measured, the allowance's constants alone.  The
     * trainer and `tidal plan` each measure it at that point. */
    size_t library_heap_bytes;
    const td_dist_env *dist;
    int comm_timeout_ms;
    const td_dist_setting *agree;
    size_t n_agree;
    /* Frozen tensors (--freeze, docs/training.md): n_freeze glob patterns
     * (fnmatch) over the Hugging Face names of the model's tensors, e.g.
     * "model.layers.*.mlp.*".  A tensor a pattern matches takes no
     * gradient and no optimizer state anywhere: its chunks hold its
     * storage alone (the OTHER role), are loaded for the forward and the
     * backward's input gradient and are never written back.  A fused
     * tensor (q|k|v, gate|up) is frozen when every part is; a pattern that
     * freezes some parts only, or matches nothing, is an error.  The
     * strings must outlive the config's use. */
    const char *const *freeze;
    int n_freeze;
} td_train_config;

td_train_config td_train_default_config(void);
/* frozen[i] (td_model_tensor_count entries) = 1 when cfg's --freeze
 * patterns freeze layout tensor i; TD_ERR_INVALID names a pattern that
 * matches nothing or splits a fused tensor. */
td_status td_train_frozen(const td_train_config *cfg, uint8_t *frozen);
int td_train_frozen_count(const td_train_config *cfg, const uint8_t *frozen);
/* Rows of one chunk of the head and loss (cfg->loss_chunk, or auto: the
 * logits of a chunk at most TD_TRAIN_LOSS_CHUNK_BYTES, but at least
 * TD_TRAIN_LOSS_CHUNK_MIN_ROWS rows, which keep the head's GEMMs efficient;
 * the B*T rows split evenly, rounded up to 64): the same losses, bit for
 * bit on the cpu backend, as one chunk of all rows. */
#define TD_TRAIN_LOSS_CHUNK_BYTES ((size_t)256 << 20)
#define TD_TRAIN_LOSS_CHUNK_MIN_ROWS 2048
int td_train_loss_rows(const td_train_config *cfg);
/* The CPU threads a run takes when cfg->threads is 0: the cores this
 * process may run on (its affinity mask, at most topo's physical cores near
 * the device; topo may be NULL), less those other processes keep busy
 * (their share of the last 100 ms, measured once a process), at least one:
 * on a busy host a team larger than the idle cores waits at every barrier.
 * `why` (may be NULL) says how the count was chosen. */
struct td_topo;
int td_train_default_threads(const struct td_topo *topo, char *why, size_t why_bytes);
/* The backend a run of cfg creates: its kind, and on the cpu backend a
 * device region of cfg->cpu_device_bytes (or the default, raised to a
 * --gpu-budget that is larger), so that a budget given is a budget the
 * region holds. */
td_backend_params td_train_backend_params(const td_train_config *cfg);
/* TD_OK or TD_ERR_INVALID naming the bad value. */
td_status td_train_config_check(const td_train_config *c);

/* A micro-batch: tokens and targets, B*T int32 each (targets < 0 are
 * ignored: they take no part in the loss or its gradient), and positions,
 * B*T int32, which the trainer fills with 0 .. T-1 on every row before the
 * call: a batch of packed documents writes each token's position in its
 * document instead (0 at each document's first token; ops.h), and then
 * positions restart and attention does not cross documents.  The trainer
 * checks them (each row starts at 0, and each position is 0 or the one
 * before plus 1). */
typedef td_status (*td_batch_fn)(void *ctx, int32_t *tokens, int32_t *targets, int32_t *positions);

typedef struct td_step_result {
    long step;                    /* optimizer steps taken, this one included */
    double loss;                  /* mean cross-entropy over the step's targets that count (not negative) */
    long targets;                 /* how many counted, over every rank and micro-batch */
    double lr, grad_norm;
    int skipped;                  /* overflow: no update */
    double step_ms, tokens_per_s;
    /* The CPU AdamW of the chunks whose updates this step took (on the
     * AdamW thread, or run on the driving thread), and how long the driving
     * thread waited for the AdamW thread: the CPU AdamW the GPU work did
     * not hide. */
    double adam_cpu_ms, adam_wait_ms;
    td_memmgr_stats mm;           /* the run's totals so far */
    /* cuda: the device memory the process holds beyond its CUDA context
     * (free memory once the backend made its context, less free memory now:
     * the arena, the communicator's buffers, the libraries' handles, kernel
     * modules loaded since), now and at the most of any step's end; one
     * process a GPU.  0 on the cpu backend. */
    size_t device_process_bytes, device_process_peak_bytes;
    /* The host footprint's peak (td_trainer_host_usage) of every rank on
     * this host, added (this process's alone on one rank). */
    size_t host_node_peak_bytes;
    /* The resident memory's peak (VmHWM) of every rank on this host, added:
     * the footprint above and what the plan does not itemize (the CUDA
     * driver's, NCCL's and the libraries' own pages). */
    size_t host_node_rss_peak_bytes;
} td_step_result;

td_status td_trainer_create(const td_train_config *cfg, td_trainer **out);
/* The host's AdamW: its threads, whether it runs on a thread of its own
 * (cfg.adam_thread), and the transient grads' staging slots (0: a host
 * copy each). */
int td_trainer_adam_threads(const td_trainer *t, int *own_thread, int *grad_slots);
/* Where the host side runs: the GPU-local NUMA node(s) and cores the AdamW
 * team is bound to, thread i to core i of them (td_topo_describe), and the
 * core kept for the thread that drives the GPU beside the AdamW thread (-1:
 * none is kept, the OS places it). */
const char *td_trainer_host_cores(const td_trainer *t, int *driver_core);
/* The trainer's communicator (cfg.ranks > 1), else NULL. */
td_comm *td_trainer_comm(td_trainer *t);
/* The ranks each chunk is split over (1: one rank). */
int td_trainer_shard_ranks(const td_trainer *t);
void td_trainer_destroy(td_trainer *t);

/* One optimizer step over cfg.grad_accum micro-batches from next_batch.  A
 * LoRA dropout (model.h) keys row b of micro-batch k on rank r as the
 * step's sample (k ranks + r) B + b: the order td_loader deals a global
 * batch in, so N ranks draw the masks of one rank with N times the batch. */
td_status td_trainer_step(td_trainer *t, td_batch_fn next_batch, void *ctx, td_step_result *out);
/* Called in td_trainer_step after each micro-batch's forward and backward
 * have been issued, when a step has several (cfg.grad_accum > 1): k of
 * accum, k from 1 to accum, on the thread that runs the step.  For progress
 * within long steps (the GPU may still be running the micro-batch); fn
 * NULL: none. */
typedef void (*td_microbatch_fn)(void *ctx, int k, int accum);
void td_trainer_set_microbatch_fn(td_trainer *t, td_microbatch_fn fn, void *ctx);
/* With clipping or a loss scale, or with the AdamW thread, a step's CPU
 * AdamW finishes chunk by chunk in the next step's forward, each chunk just
 * before its first use, so that the CPU updates while the GPU computes (the
 * same result).  This runs (or waits for) what is still pending, so that the
 * host copies of params, master and AdamW state are current.  eval, save,
 * load and next_logits call it themselves. */
td_status td_trainer_finish_update(td_trainer *t);
/* How many param chunks' updates of the last step are not yet applied: held
 * by the AdamW thread (running, queued, or done and not yet taken back) or
 * deferred to the next forward.  0 after td_trainer_finish_update.  Not
 * thread-safe against td_trainer_step (call it between steps). */
int td_trainer_updates_pending(td_trainer *t);
/* Mean loss over the targets that count (not negative) of `batches`
 * micro-batches, without updating (eval); *targets (may be NULL) gets how
 * many counted. */
td_status td_trainer_eval(td_trainer *t, td_batch_fn next_batch, void *ctx, int batches, double *loss,
                          uint64_t *targets);

/* The footprint of a run, from the layout alone (nothing of the model is
 * allocated): what `tidal plan` prints. */
typedef struct td_train_plan {
    size_t params;                              /* model parameters */
    size_t frozen_params;                       /* of them frozen (--freeze): their storage alone, in the
                                                   OTHER role's chunks; no grads, master, m or v */
    int chunks;
    size_t chunk_numel, padding_bytes;
    size_t chunk_numel_least_padding;           /* where the chunk size was made smaller for the budget
                                                   (td_train_resolve_chunks): the least-padding size,
                                                   whose device minimum the budget did not hold; else 0 */
    size_t role_bytes[TD_TENSOR_ROLE_COUNT];    /* all chunks of each role, as device slots */
    size_t host_role_bytes[TD_TENSOR_ROLE_COUNT]; /* the same up to each chunk's last tensor: the host
                                                   copies (no tail padding; none for transient grads) */
    int host_grad_slots;                        /* transient grads (td_train_grads_transient): the host
                                                   chunks' grads have no copy of their own, only these
                                                   pinned staging slots (in host_staging_bytes), consumed
                                                   by the AdamW thread as they land; 0: a copy each */
    size_t host_grad_slot_bytes;                /* each slot: the largest such grad chunk */
    size_t nonmodel_bytes;                      /* activations + workspace + staging, device */
    size_t activation_bytes, workspace_bytes, staging_bytes;
    int ckpt;                                   /* ckpt_blocks > 0 */
    int ckpt_blocks;                            /* blocks recomputed in backward (--ckpt auto: the fewest
                                                   that leave room for the model state, see below) */
    size_t working_set_bytes;                   /* the most chunk bytes one access pins */
    size_t largest_chunk_bytes;
    size_t min_device_bytes;                    /* non-model + working set + two of the largest chunk
                                                   (one to prefetch into, one for fragmentation), + the
                                                   GPU optimizer chunks (all roles) */
    size_t full_device_bytes;                   /* non-model + every param and grad chunk + the GPU
                                                   optimizer chunks' state */
    /* Host (docs/architecture.md, "Where each byte lives"): exactly what
     * the trainer pins (the pinned pool's slabs: chunk copies of params,
     * grads and device-homed optimizer state, the staging buffers, slab
     * rounding), and what it maps pageable (optimizer state homed on the
     * host) plus the heap it takes (metadata, loader, tokenizer, the
     * libraries; on the cpu backend the "device" region too). */
    size_t host_pinned_bytes;                   /* the slabs' total: what --host-pin-limit must allow */
    size_t host_pinned_chunk_bytes;             /* of which chunk host copies (4 KiB blocks) */
    size_t host_pinned_optimizer_bytes;         /* of those, optimizer state homed on the device */
    size_t host_staging_bytes;                  /* of which staging buffers (4 KiB blocks), the transient
                                                   grads' slots included */
    size_t host_slab_bytes;                     /* the slab size the trainer asks for */
    int host_slabs;
    size_t host_pageable_bytes;                 /* optimizer state + heap (+ cpu device region) */
    size_t host_pageable_state_bytes;           /* of which optimizer state (page-rounded) */
    size_t host_heap_bytes;                     /* of which the heap allowance */
    size_t host_library_heap_bytes;             /* of that, the libraries' (the constant, or as measured) */
    int host_library_heap_measured;             /* 1: the measured heap (config's library_heap_bytes) set it */
    size_t host_device_region_bytes;            /* of which the cpu backend's device region (0 on cuda) */
    size_t host_bytes;                          /* pinned + pageable */
    double flops_per_step;                      /* forward + backward (+ recompute), all micro-batches */
    double h2d_bytes_per_step, d2h_bytes_per_step; /* with the chunks that stay on the device kept */
    double adam_bytes_per_step;                 /* CPU AdamW memory traffic (adam_bytes_per_param x adam_cpu_params) */
    double adam_bytes_per_param;                /* DRAM bytes the CPU AdamW moves a param (fp32 state: 28) */
    double adam_cpu_params;                     /* params the CPU AdamW updates a step */
    int optim_chunks;                           /* optimizer chunks (one per param chunk) */
    int optim_gpu_chunks;                       /* of them on the GPU (policy cuda: all; cpu: none; static: the
                                                   1 - --offload-optim-frac share; auto: what the budget allows),
                                                   those with the least CPU slack (the first the next forward needs) */
    size_t optim_gpu_state_bytes;               /* their master, m and v on the device */
    int gpu_optimizer;                          /* every optimizer chunk on the GPU */
    /* The disk tier (docs/training.md, "The disk tier"): with directories
     * (cfg.mm.disk_dirs) or cfg.disk_bytes, the CPU AdamW's optimizer chunks
     * the host's RAM (td_train_host_limits) cannot hold, the fewest that
     * make the run fit, spread over the AdamW's order (a chunk larger than
     * the common size last: it sets the size of its pool's slots); then
     * grads, then params (one rank), when the state alone is not enough. */
    int disk_chunks;                            /* optimizer chunks homed on disk (0: no disk tier) */
    int disk_grad_chunks, disk_param_chunks;    /* grad and param chunks there too (when the state was not enough) */
    size_t disk_bytes;                          /* their scratch file (4 KiB blocks) */
    int disk_sets;                              /* slots in each pool (pinned, in host_staging_bytes) */
    size_t disk_set_bytes;                      /* a slot of each pool, together */
    /* A step's reads and writes: optimizer state once each way; grads each
     * micro-batch (written back, and read back from the second on); params
     * read at each upload (two a micro-batch), written once.  Of them,
     * disk_stream_bytes_per_step run beside the CPU AdamW (the state both
     * ways, the last grads' write and read, the params' write). */
    double disk_read_bytes_per_step, disk_write_bytes_per_step, disk_stream_bytes_per_step;
    size_t disk_free_bytes;                     /* the space there: cfg.disk_bytes, or the directories' free space
                                                   (the least of them times their count: the file is striped evenly) */
    int disk_fits;                              /* disk_bytes within disk_free_bytes */
    /* Several ranks (ZeRO-3, docs/distributed.md).  The host_* figures
     * above are this rank's: its shard of every chunk (params, grads,
     * master, m, v).  The host these ranks share holds node_bytes: each
     * local rank's own model-state bytes (its shards) and the rest
     * (staging, slabs' rounding, heap, the cpu backend's device region) as
     * this rank's, local_ranks times. */
    int shard_ranks;                            /* the ranks each chunk is split over (1: none) */
    int local_ranks;                            /* the ranks on this host */
    size_t node_bytes, node_state_bytes;        /* the host's total, and of it the model state */
    /* Each step, each rank: h2d/d2h_bytes_per_step above are its shards
     * over its PCIe link; the other ranks' shards reach its device in
     * all-gathers of params and leave in reduce-scatters of grads, over the
     * devices' links (NVLink, or the network between hosts). */
    double gather_bytes_per_step, reduce_bytes_per_step;
    size_t comm_device_bytes;                   /* the communicator's own device memory the budget must leave
                                                   (NCCL's buffers, planned; the run measures them) */
} td_train_plan;

/* Whether cfg plans a disk tier: directories (cfg.mm.disk_dirs) or
 * cfg.disk_bytes given. */
int td_train_disk_tier(const td_train_config *cfg);

/* DRAM bytes the CPU AdamW moves for one param: the state read and written
 * (fp32 master + m + v: 12 bytes each way for fp32 state), the grad read and,
 * with 16-bit params, the param written: 28 for fp32 state either way. */
double td_train_adam_bytes_per_param(const td_train_config *cfg);

/* ZeRO-3's shard group: how many ranks each chunk is split over (1: one
 * rank), and this rank's index among them (AUTO unresolved counts as WORLD). */
int td_train_shard_ranks(const td_train_config *cfg);
/* cfg->shard AUTO resolved: NODE when the job spans hosts (local_ranks
 * below ranks) and the plan with NODE fits each host's RAM and pin limit
 * (td_train_host_limits), else WORLD.  A mode given is kept. */
td_status td_train_resolve_shard(td_train_config *cfg);
int td_train_shard_rank(const td_train_config *cfg);
/* The device memory a run's communicator takes beside the arena: none on
 * one rank or on the cpu backend; NCCL's buffers otherwise (as measured,
 * cfg->comm_device_bytes, or TD_TRAIN_NCCL_PLAN_BYTES a communicator). */
/* NCCL's buffers and kernels as planned: above the 861 MiB measured on two
 * H200s over NVLink, so what the plan accepts the measured run accepts. */
#define TD_TRAIN_NCCL_PLAN_BYTES ((size_t)1 << 30)
size_t td_train_comm_device_bytes(const td_train_config *cfg);
/* The process heap now less tidal's own td_malloc bytes: what the libraries
 * (the CUDA driver and runtime, cuBLAS, hwloc, OpenMP) hold; 0 where the
 * heap is not measured by jemalloc. */
size_t td_train_library_heap(void);

/* budget: the device budget to plan for (0: unknown; ckpt auto assumes on).
 * --ckpt auto: when the model state can stay on the device with every block
 * recomputed (all of it, and then AdamW runs on the GPU; or else the param
 * and grad chunks), recompute the fewest blocks that leave it that room and
 * keep the activations of the others.  When chunks must stream anyway, keep
 * every block's activations if they take at most a quarter of the budget,
 * else recompute every block. */
td_status td_train_plan_make(const td_train_config *cfg, size_t budget, td_train_plan *out);
/* cfg->mm.grad_slots (memmgr.h's transient grads; -1, the default, is
 * auto) resolved for a budget as the plan and the trainer resolve it: 0
 * (a host copy per grad chunk) when the grads are not transient, or when
 * the plan with copies fits the host's RAM and pin limit
 * (td_train_host_limits); else 8 staging slots, the host's least.  A count
 * given (>= 0) is kept. */
td_status td_train_resolve_grad_slots(td_train_config *cfg, size_t budget);
/* cfg->mm.chunk_numel, when the layout picks it (0 and the default search
 * range), resolved for a budget as the plan and the trainer resolve it:
 * the layout's pick, the least padding between the largest block tensor
 * and a block; or, where the budget does not hold that plan's device
 * minimum, the largest block tensor's size when that plan needs less of
 * the device.  Call after td_train_resolve_grad_slots. */
td_status td_train_resolve_chunks(td_train_config *cfg, size_t budget);
/* The least device bytes any plan of cfg needs, whatever its budget: the
 * non-model buffers (under --ckpt auto with every block recomputed), plus
 * every param and grad under --policy cuda, else the params and grads of
 * the working set's largest access and two chunks of the largest param
 * tensor.  Never above the plan's min_device_bytes (full_device_bytes
 * under --policy cuda), and it grows with the layers, where the device's
 * need does not quite (the layout's chunk size, --ckpt auto's choice and
 * the GPU optimizer chunks change with them). */
size_t td_train_device_floor_bytes(const td_train_config *cfg);

/* What a run may take: the device budget it plans for, the device's free
 * memory, the host's RAM and pin limit (td_train_host_limits). */
typedef struct td_train_limits {
    size_t budget_bytes, device_free_bytes, ram_bytes, pin_limit_bytes;
} td_train_limits;
/* Plans cfg for lim->budget_bytes (into *p) and says whether it fits:
 * *host_fits when its pinned bytes are within the pin limit and all its
 * host bytes within the RAM (planned against lim's RAM and pin limit), and
 * a disk tier's file within its disk; *fits when the host fits and the device's need
 * (min_device_bytes, full_device_bytes under --policy cuda) is within the
 * budget, the budget within the free memory.  host_fits may be NULL. */
td_status td_train_plan_fits(const td_train_config *cfg, const td_train_limits *lim, td_train_plan *p, int *fits,
                             int *host_fits);
/* `tidal plan --largest`: the most layers in [1, TD_TRAIN_LARGEST_LAYERS]
 * of cfg's shape (cfg->model.n_layer ignored) that fit lim (0: none), and
 * its plan (when not 0).  The host's bound is found by doubling then
 * bisecting the layers (the host's bytes grow with them, up to a few KiB
 * of the layout's padding), and below it the largest count that fits the
 * device too: every count from the top down until one fits, within a
 * budget of plans, then a bisection with a window above it (largest.c). */
#define TD_TRAIN_LARGEST_LAYERS 4096
td_status td_train_largest_layers(const td_train_config *cfg, const td_train_limits *lim, int *layers,
                                  td_train_plan *p);
/* The largest model of cfg's kind that fits lim, at cfg's optimizer state
 * type, batch and run options: the most layers of cfg's width and heads
 * (td_train_largest_layers), and of the presets of cfg's family (with cfg's
 * vocabulary and sequence) the largest that fits and every one that does. */
#define TD_TRAIN_LARGEST_PRESETS 64
typedef struct td_train_largest {
    int layers;                                  /* 0: no layer count fits */
    td_train_plan plan;                          /* of that count (zero when none) */
    const char *preset;                          /* the largest preset that fits; NULL: none */
    td_train_plan preset_plan;                   /* its plan */
    const char *presets_fit[TD_TRAIN_LARGEST_PRESETS]; /* every preset that fits, smallest first */
    int n_presets_fit;
} td_train_largest;
td_status td_train_largest_model(const td_train_config *cfg, const td_train_limits *lim, td_train_largest *out);
/* What a run leaves of the machine's RAM (td_host_ram; --host-ram is taken
 * as given): the system's share, TD_HOST_RESERVE_PERCENT of it and at least
 * TD_HOST_RESERVE_MIN (the kernel's slabs and page tables, other
 * processes, the page cache the data file needs), and each local rank's
 * pages the plan does not itemize (the CUDA driver's and the libraries'
 * mappings beyond the heap allowance; the program's on the cpu backend);
 * at most half of the RAM. */
#define TD_HOST_RESERVE_PERCENT 5
#define TD_HOST_RESERVE_MIN ((size_t)2 << 30)
#define TD_HOST_RESERVE_PROCESS_CUDA ((size_t)512 << 20)
#define TD_HOST_RESERVE_PROCESS_CPU ((size_t)64 << 20)
size_t td_train_host_reserve(const td_train_config *cfg, size_t ram);
/* The host bytes a run may take (cfg->host_ram, else td_host_ram less
 * td_train_host_reserve) and the pin limit (cfg->host_pin_limit, else 80%
 * of that); `source` (160+ bytes) says where the RAM figure came from. */
td_status td_train_host_limits(const td_train_config *cfg, size_t *ram, size_t *pin_limit, char *source,
                               size_t source_bytes);

/* ---- the device budget ----------------------------------------------------
 * One decision for every command and caller: td_trainer_create, `tidal
 * plan`, `tune`, `eval` and `generate` all resolve cfg->gpu_budget here.
 *   given    (any other byte count) taken as it is; it must be at least
 *            TD_ARENA_ALIGN bytes (whether the run fits it is the plan's
 *            and the trainer's question: td_train_plan_fits)
 *   max      the cap: the device's free memory less the margin, rounded
 *            down to TD_ARENA_ALIGN
 *   default  for a run, td_train_default_budget at the cap; for a search
 *            (tune, plan --largest: the model or layout varies), the cap
 * The margin is what the CUDA context, cuBLAS and NCCL take outside the
 * arena: max(512 MiB, 2% of the total) on cuda, 0 on the cpu backend.
 * `b` is the backend the run will use; NULL (a device this machine lacks:
 * `tidal plan --backend cuda` without a GPU) resolves only a given budget.
 * A default or max budget fails with TD_ERR_DEVICE_MEM when the free memory
 * is not above the margin. */
typedef enum td_budget_use {
    TD_BUDGET_USE_RUN,      /* the default sizes the run resident plus an eighth */
    TD_BUDGET_USE_SEARCH,   /* the default is the cap */
} td_budget_use;

typedef enum td_budget_origin {
    TD_BUDGET_GIVEN,        /* cfg->gpu_budget bytes */
    TD_BUDGET_DEFAULT,      /* the run resident plus an eighth, at most the cap */
    TD_BUDGET_CAP,          /* the free memory less the margin (max, or a search's default) */
} td_budget_origin;

typedef struct td_train_budget {
    size_t budget_bytes;          /* what the arena reserves */
    td_budget_origin origin;
    size_t free_bytes, total_bytes; /* the device's when resolved (0 without a backend) */
    size_t margin_bytes;          /* left outside the arena (0 without a backend) */
    size_t cap_bytes;             /* free less margin, aligned (0 for a given budget) */
} td_train_budget;

td_status td_train_budget_resolve(const td_train_config *cfg, td_backend *b, td_budget_use use, td_train_budget *out);
const char *td_budget_origin_name(td_budget_origin o);  /* "given", "default", "max" */

/* The default's size: the device bytes the run needs with all of it
 * resident (the non-model buffers --ckpt auto keeps, every param and grad
 * chunk, and the optimizer state too when AdamW then runs on the GPU) plus
 * an eighth, so other work can share the device; `cap` when that is more.
 * No device is asked: td_train_budget_resolve gives it the cap. */
td_status td_train_default_budget(const td_train_config *cfg, size_t cap, size_t *budget);
/* The rates of this machine the step's bound is made of: host<->device
 * copy (GB/s, pinned), the CPU AdamW (G params/s on the run's threads and
 * dtypes, measured at the run's scale: td_train_adam_probe_params params,
 * 1 to 4 GiB of state, DRAM, not cache; the median of the passes of a
 * second or more after a warm one) and the DRAM bandwidth it reached (GB/s:
 * the rate times the kernel's bytes a param; the fastest pass's too), matmul
 * compute (GFLOP/s, the model's MLP matmul) and, on the device, one block's
 * forward and backward at the run's shape (ms; 0 when not measured).  Takes
 * two or three seconds. */
typedef struct td_train_rates {
    double copy_gbs, adam_gps, dram_gbs, gflops, block_fwd_ms, block_bwd_ms;
    double block_recompute_ms; /* the forward of a checkpointed block in backward: no last projection */
    /* Host DRAM GB/s the CPU AdamW and the copy engine (both directions at
     * once) moved together while both ran: the AdamW's bytes plus the
     * copies' (the median of spans of two passes).  0: not measured. */
    double dram_loaded_gbs;
    double dram_loaded_adam_gbs, dram_loaded_copy_gbs; /* its two shares: the AdamW's, the copies' */
    double dram_fastest_gbs;  /* the fastest AdamW pass's DRAM GB/s: how far the host's bursts reach */
    size_t adam_probe_params; /* the AdamW probe's size (params) */
    /* The disk tier's directories (cfg.mm.disk_dirs), direct I/O through its
     * own engine (td_dio_measure): write, read and both at once, GB/s; 0 when
     * there are none. */
    double disk_write_gbs, disk_read_gbs, disk_mixed_gbs;
    int disk_direct;          /* measured with O_DIRECT (else through the page cache) */
    /* The devices' link (ZeRO-3's gathers and reduce-scatters): GB/s one
     * device receives from another (cuda: peer copies between GPUs 0 and
     * 1; without a second GPU, or on the cpu backend: host memory copies).
     * 0: not measured (one rank). */
    double link_gbs;
    const char *link_what;    /* how it was measured */
} td_train_rates;
/* The AdamW probe's size: the model's params, from 64 Mi to 256 Mi (the
 * probe takes less where that would be over a quarter of the host memory
 * the run may use, td_train_host_limits, or where the host refuses it). */
#define TD_TRAIN_ADAM_PROBE_PARAMS ((size_t)64 << 20)
#define TD_TRAIN_ADAM_PROBE_MAX_PARAMS ((size_t)256 << 20)
size_t td_train_adam_probe_params(const td_train_config *cfg);
td_status td_train_measure_rates(td_backend *b, const td_train_config *cfg, td_train_rates *out);
/* The disk tier's part of the rates (disk_*: td_dio_measure over
 * cfg->mm.disk_dirs; nothing without directories).  td_train_measure_rates
 * calls it. */
td_status td_train_measure_disk(const td_train_config *cfg, td_train_rates *r);
/* One block's forward and backward at cfg's micro-batch and sequence, on
 * the device (the cuda backend; a no-op on the cpu backend): the part of
 * the rates that depends on the shape. */
td_status td_train_measure_block(td_backend *b, const td_train_config *cfg, td_train_rates *r);

/* The lower bound of a step (docs/performance.md): max(compute with
 * everything resident plus the CPU AdamW time it cannot hide, PCIe bytes /
 * copy rate, CPU AdamW time, host DRAM time), each overlapping the others
 * at best.  The CPU AdamW hides only within one micro-batch's compute (the
 * last backward and the next step's first forward: before, the grads are
 * not whole; after, the params are needed), so with grad accumulation the
 * rest of it is exposed_adam_ms; with one micro-batch that is 0 whenever
 * the AdamW term does not exceed the compute.  With clipping or a loss
 * scale the update waits for every grad (the global norm, the overflow
 * check), so the AdamW hides only within the next step's first forward.
 * The CPU AdamW term is the
 * params the host's optimizer chunks hold, at the measured DRAM bandwidth
 * over the path's bytes a param (td_train_adam_bytes_per_param); the host
 * DRAM term is those bytes plus the step's copies' (up and down), at the
 * rate the AdamW and the copies reached together (dram_loaded_gbs). */
typedef struct td_train_bound {
    double compute_ms, pcie_ms, adam_ms, dram_ms, bound_ms;
    /* The disk tier's reads and writes of a step at the measured rates (both
     * at once: the mixed rate); they run beside the CPU AdamW, which waits
     * for each chunk's read, so the AdamW's stretch is the larger of the two
     * and what of it exceeds its window is exposed. */
    double disk_ms;
    double link_ms;              /* several ranks: gather and reduce-scatter bytes / link_gbs */
    double exposed_adam_ms;      /* the CPU AdamW (or the disk beside it) beyond what it can hide in (see above) */
    double adam_gparams_per_s;   /* the rate adam_ms assumes */
    double tokens_per_s;         /* at bound_ms */
} td_train_bound;
void td_train_bound_of(const td_train_config *cfg, const td_train_plan *p, const td_train_rates *r,
                       td_train_bound *out);
/* The disk tier's traffic is the same in every step, the compute grows
 * with the micro-batches: the least --grad-accum at which the step's bound
 * is within `within` (0.10: 10%) of the same step's with the disk term
 * left out (the state in RAM), searched up to 65536 (0: not within then,
 * or no disk term); *at: the bound there.  cfg's plan at that accumulation
 * is made for it (more micro-batches keep a host copy of every grad, which
 * may move more state to disk). */
td_status td_train_disk_hiding_accum(const td_train_config *cfg, size_t budget, const td_train_rates *r,
                                     double within, int *accum, td_train_bound *at);

/* The layout as td_memmgr_print_layout prints it, as the run lays it out
 * under plan p (td_train_plan_make of cfg): its grad staging (auto's
 * choice) and its optimizer chunks' homes (the GPU AdamW's on the device). */
td_status td_train_plan_print_layout(const td_train_config *cfg, const td_train_plan *p, FILE *f);

/* Checkpoints (docs/checkpoints.md): model.safetensors with Hugging Face
 * GPT-2 names plus config.json (transformers loads the directory), and with
 * `state` train_state.safetensors (master, m, v per param; step, loss scale
 * and the caller's metadata).  Written chunk by chunk from the host copies,
 * atomically: a crash leaves the previous checkpoint loadable.
 * meta: NULL or pairs key, value, ..., NULL (e.g. the data position). */
td_status td_trainer_save(td_trainer *t, const char *dir, int state, const char *const *meta);
/* The same, also copying files into the checkpoint: the tokenizer the run
 * was trained with (paths whose names are vocab.json, merges.txt or
 * tokenizer.json; NULL-terminated; files NULL for none), so that generation
 * from the directory needs no tokenizer flags. */
td_status td_trainer_save_files(td_trainer *t, const char *dir, int state, const char *const *meta,
                                const char *const *files);
/* Loads weights (HF GPT-2 layout, with or without "transformer."), and
 * with `state` the optimizer state too, so the run continues bit-exactly.
 * The model's shape must match the trainer's.  reader_out (may be NULL)
 * keeps the reader open for the caller's metadata (td_ckpt_reader_meta). */
struct td_ckpt_reader;
td_status td_trainer_load(td_trainer *t, const char *dir, int state, struct td_ckpt_reader **reader_out);
/* The model config.json of a checkpoint directory describes. */
td_status td_trainer_checkpoint_model(const char *dir, td_model_desc *out);

/* Logits of the last position of tokens[0, n) (n <= seq_len, batch row 0)
 * into logits (vocab_size floats), for sampling. */
td_status td_trainer_next_logits(td_trainer *t, const int32_t *tokens, int n, float *logits);

const td_train_config *td_trainer_config(const td_trainer *t);
td_memmgr *td_trainer_memmgr(td_trainer *t);
td_backend *td_trainer_backend(td_trainer *t);
td_arena *td_trainer_arena(td_trainer *t);
td_hostpool *td_trainer_hostpool(td_trainer *t);
/* The budget the trainer was created with, as td_train_budget_resolve
 * decided it (td_arena_get_stats gives what it holds). */
const td_train_budget *td_trainer_budget(const td_trainer *t);
/* Blocks whose activations backward recomputes (0: none). */
int td_trainer_checkpointing(const td_trainer *t);
/* Optimizer chunks updated on the GPU (the rest by the CPU AdamW); *total:
 * all of them (may be NULL). */
int td_trainer_optim_gpu_chunks(const td_trainer *t, int *total);
/* A LoRA run's adapters (cfg.model.lora) as a PEFT adapter folder in dir
 * (made as `mkdir -p`): adapter_config.json (base_model_name_or_path:
 * base, or null), adapter_model.safetensors with PEFT's tensor names
 * ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"),
 * fp32; with state, adapter_train_state.safetensors: the AdamW moments, the
 * step and meta's key/value pairs (NULL-terminated), for a resume; fp32 or
 * bf16 moments.  On several ranks every rank calls it: the adapters and
 * their moments are gathered from the ranks' shards and rank 0 writes;
 * td_trainer_load_adapter gives each rank its part, for any rank count. */
td_status td_trainer_save_adapter(td_trainer *t, const char *dir, const char *base, int state,
                                  const char *const *meta);
/* The adapters of such a folder into the run (its LoRA rank and targets
 * must be the folder's: a shape that differs is an error naming the
 * tensor), and with state the moments and the step (then the run's LoRA
 * dropout must be the folder's: its masks go on where they stopped). */
td_status td_trainer_load_adapter(td_trainer *t, const char *dir, int state);
/* A LoRA run's merged model as a Hugging Face checkpoint in dir (no train
 * state): the base's weights with each targeted module's W + s B A, the
 * description without adapters. */
td_status td_trainer_save_merged(td_trainer *t, const char *dir);
/* The same merged model's weights into out, in the layout of the model
 * description without adapters (td_model_params_numel of it, fp32): what a
 * decoder of the base model runs. */
td_status td_trainer_merged_params(td_trainer *t, float *out);
/* A metadata value of dir's adapter train state into buf, or NULL. */
const char *td_trainer_adapter_meta(const char *dir, const char *key, char *buf, size_t n);
/* Memmgr ids of model tensor `index`: param, grad, adam m, adam v (-1 but
 * the param for a frozen tensor, --freeze). */
void td_trainer_tensor_ids(const td_trainer *t, int index, int *param, int *grad, int *m, int *v);
/* The optimizer's state (step, scaler) for checkpoints. */
td_optim *td_trainer_optim(td_trainer *t);

/* Where td_trainer_create's time went, in milliseconds of td_now_ms's
 * clock: the backend, the job (several ranks), the plan, the device arena
 * and the chunk manager; laying out the chunks, which maps and pins the host
 * slabs; first-touching the pageable optimizer state on its NUMA node;
 * drawing the initial weights into the host copies; the rest (activations,
 * the kernels' set-up, the AdamW teams). */
typedef struct td_setup_times {
    double backend_ms, pin_ms, touch_ms, init_ms, rest_ms, total_ms;
} td_setup_times;
void td_trainer_setup_times(const td_trainer *t, td_setup_times *out);

/* The host footprint now and its peak over the samples so far (taken at
 * creation's end and after every step): pinned slabs, pageable optimizer
 * state, the heap as td_host_heap_stats measures it, and the cpu backend's
 * "device" region (host pages it maps; 0 on cuda). */
#define TD_HOST_USAGE_SITES 8
typedef struct td_host_usage {
    size_t pinned_bytes, pageable_bytes;        /* slabs; td_hostmem mappings */
    size_t heap_allocated_bytes, heap_resident_bytes;
    size_t device_region_bytes;                 /* td_backend_host_mapped_bytes */
    size_t total_bytes;                         /* pinned + pageable + heap allocated + device region */
    size_t peak_bytes;                          /* the largest total sampled */
    size_t rss_bytes, rss_peak_bytes;           /* the process's resident memory, now and at most (td_host_rss) */
    const char *heap_source;                    /* "jemalloc" or "mallinfo2" */
    /* tidal's own part of the heap (td_malloc, alloc.h), by role: live now
     * and the most live at once since the process started; and the
     * allocation sites with the largest peaks, largest first. */
    size_t heap_role_bytes[TD_ROLE_COUNT], heap_role_peak_bytes[TD_ROLE_COUNT];
    td_host_site heap_sites[TD_HOST_USAGE_SITES];
    int n_heap_sites;
} td_host_usage;
td_status td_trainer_host_usage(td_trainer *t, td_host_usage *out);
/* The footprint as one JSON object (no newline), for the step log. */
size_t td_host_usage_json(const td_host_usage *u, char *buf, size_t buf_bytes);

#ifdef __cplusplus
}
#endif
#endif
