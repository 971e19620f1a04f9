/* Internal to the trainer (train.c, footprint.c, plan.c, save.c): the
 * trainer's state and the sizing rules that the trainer and `tidal plan`
 * share, so what the plan says fits is what the trainer allocates. */
#ifndef TIDAL_TRAIN_IMPL_H
#define TIDAL_TRAIN_IMPL_H

#include "tidal/family.h"
#include "tidal/trainer.h"

struct td_trainer {
    td_train_config cfg;
    td_backend *backend;
    td_topo *topo;
    td_hostpool *pool;
    td_hostmem *hostmem;               /* pageable optimizer state, on the AdamW team's node */
    size_t host_peak_bytes;            /* the largest host footprint sampled (td_trainer_host_usage) */
    td_arena *arena;
    td_copy_engine *engine;
    td_memmgr *mm;
    td_adam_cpu *adam;                 /* the host's AdamW: the AdamW thread's team when there is one */
    td_adam_cpu *adam_main;            /* the driving thread's team (its sums, the cpu backend's "GPU" chunks):
                                          adam itself without an AdamW thread, else a second team, so the
                                          two threads never share one */
    td_optim optim;
    td_microbatch_fn microbatch_fn;    /* td_trainer_set_microbatch_fn */
    void *microbatch_ctx;
    /* The two-pass CPU AdamW leaves param chunks [pending_next, pending_end)
     * to the next forward, each updated just before its first access
     * (catch_up); pending_end 0: nothing pending. */
    int pending_next, pending_end;
    td_adam_coeffs pending_coeffs;
    int ckpt_blocks;                   /* blocks [0, ckpt_blocks) are recomputed in backward */
    td_setup_times setup;              /* td_trainer_create's phases */
    td_train_budget budget;            /* as td_train_budget_resolve decided it */

    int n_tensors;                     /* 4 + 12 L */
    int *pid, *gid, *sid, *mid, *vid;  /* memmgr ids per model tensor: param, grad, fp32 master
                                          (-1 when the params are fp32 themselves), adam m, v; a frozen
                                          tensor (--freeze) has its param id alone (the OTHER role), the
                                          others -1 */
    int *gid_live, n_live;             /* the grad ids of the trainable tensors, in model order */
    size_t nonmodel_bytes;
    td_dtype dt, gdt;                  /* params and activations; grads */
    void *ops_cuda;                    /* td_ops_cuda on the cuda backend, else NULL */
    const td_model_exec *exec;         /* the model family's compute on this backend (family.h) */
    td_model_run run;                  /* its shape and buffers: scratch, constants, stream */
    td_model_lora_drop lora_drop;      /* LoRA dropout's key (model.h): run.lora_drop points here while a
                                          training micro-batch runs with a dropout above 0 */

    /* Activations (device, from the arena); dt unless marked fp32. */
    char *resid;                       /* (L+1, N, C): every block's input, then the last output */
    char *acts;                        /* one block's acts shared by the recomputed blocks, then one
                                          each for the others (block_acts) */
    size_t acts_bytes;                 /* one block's */
    void *lnf;                         /* (loss_rows,C): one chunk's */
    float *lnf_mean, *lnf_rstd;        /* (loss_rows), (loss_rows) fp32 */
    void *logits;                      /* (loss_rows,Vp): one chunk's, overwritten by its dlogits */
    int loss_rows;                     /* rows of a chunk of the head and loss (td_train_loss_rows) */
    int want_row;                      /* >= 0: the head copies this row's logits to h_row (sampling) */
    float *losses, *lse;               /* (N), (N) fp32 */
    void *dres[2];                     /* (N,C) gradient of the residual stream */
    char *scratch;                     /* the model's scratch (its exec's scratch_bytes) */
    size_t scratch_bytes;
    int32_t *tokens, *targets;         /* (N) */
    int32_t *positions;                /* (N): each token's position in its packed document */
    int packed;                        /* this micro-batch's rows hold several documents: run.pos is set */
    void *workspace;                   /* cuBLASLt's (cuda), then the model's constants (consts_bytes) */
    /* Host (pinned, for async copies). */
    int32_t *h_tokens, *h_targets, *h_positions;
    int32_t *batches;                  /* grad_accum > 1: the step's micro-batches (tokens, targets,
                                          positions of each), read before the first so that the loss
                                          is weighted by the step's count of targets */
    float *h_losses;
    void *h_row;                       /* one row of logits */
    /* The GPU AdamW of the optimizer chunks placed on the device
     * (optim_place.c): optim_on_gpu[k] for param chunk k; gpu_opt: how many. */
    int gpu_opt;
    uint8_t *optim_on_gpu;
    uint8_t *optim_on_disk;            /* optim_on_disk[k]: what of param chunk k is on disk, TD_TRAIN_DISK_* (NULL: none) */
    double *h_sumsq;                   /* per chunk grad sumsq: [0, chunks) host, [chunks, 2 chunks) device */
    int *group, *group_start;          /* model tensors of each param chunk: group[group_start[k] ..) */
    void **ptrs;                       /* scratch for access pointers */
    int *gids_scratch;
    double *dev_acc, *dev_sumsq_scratch;
    /* Weight decay by tensor (decay.c): param chunk k's elements that take
     * no decay, no_decay[no_decay_start[k] .. no_decay_start[k+1]) (chunk
     * indices, sorted); dev_no_decay: the same list on the device (cuda
     * backend with GPU optimizer chunks, from the arena), else NULL.  All
     * NULL with --decay-all. */
    td_adam_range *no_decay, *dev_no_decay;
    int *no_decay_start, n_no_decay;
    /* ZeRO-3 over cfg.ranks > 1 ranks (train.c): rs_left[k], grad tensors of
     * param chunk k the last micro-batch has still to finish (then its
     * grads are reduce-scattered); sumsq_all, every rank's per-chunk grad
     * sumsq of its shard (ranks x chunks).  The no-decay lists above are
     * then this rank's shard's, in shard coordinates. */
    td_comm *comm;
    int rank, ranks;
    /* The shard group (cfg.shard_ranks): scomm over the ranks this rank
     * shares every chunk with (comm itself, or this host's ranks under
     * --shard node), this rank shard_rank of shard_ranks; xcomm over the
     * ranks on other hosts holding the same shard (replica_rank its index,
     * NULL when the shard group is the job), whose grads are summed too.
     * rcomm: the shard group again, for the grads' reduce-scatters alone
     * (TD_REDUCE_COMM=own; NULL where they share scomm, the default).
     * NCCL runs one communicator's collectives in the order they were
     * issued, whatever their streams: on scomm a gather issued after a
     * reduce-scatter waits for it, and the reduce-scatter for the backward
     * that makes its grads.  On two communicators each keeps its own
     * order (docs/distributed.md). */
    td_comm *scomm, *xcomm, *rcomm;
    int shard_rank, shard_ranks, replica_rank;
    int node_rank;                     /* the launcher's host index (-1: not given) */
    uint64_t host_id;                  /* a hash of the host's name, NUMA nodes and node_rank (share_cores) */
    size_t dev_free0, dev_used_peak;   /* cuda: free device memory once the context was made; the most the
                                          process has held beyond it at a step's end (cudaMemGetInfo) */
    int *rs_left;
    double *sumsq_all;
    /* The host's AdamW on a thread of its own (adam_worker.h,
     * cfg.adam_thread): jobs[k] is param chunk k's update as handed over;
     * ov_left[k], grad tensors of host chunk k the last micro-batch has
     * still to finish (then the chunk is handed over as its grads go to the
     * host); ov_coeffs[ov_cur], the coefficients of the updates handed over
     * (two: a step's hand-over begins while the last step's updates may
     * still run); main_core, the core kept for this thread (-1: none). */
    struct td_adam_worker *worker;
    struct td_adam_job *jobs;
    int *ov_left;
    td_adam_coeffs ov_coeffs[2];
    int ov_cur;
    int main_core;
    int worker_pinned;                 /* the AdamW thread has pinned itself (adam_job; that thread's alone) */
    int ov_early;                      /* this step's chunks went over in its backward: their grad sums
                                          were taken on the device (h_sumsq[chunks + k]), and the
                                          next forward takes their updates back (catch_up) */
    double adam_cpu_ms, adam_wait_ms;  /* this step's: CPU AdamW run, and the driving thread's wait for it */
};

/* Param chunk k's host update as the AdamW thread runs it: the host copies
 * (the memmgr's peek), the ticket of the grads' last write-back, which it
 * waits for first, whether it also adds the grads' sumsq (into h_sumsq[k])
 * for the global norm, and whether it then frees the grads' slot. */
typedef struct td_adam_job {
    td_adam_chunk ch;
    td_copy_ticket grads;
    td_copy_ticket params;    /* the params' host copy's last write-back (ZeRO-3 writes it back after gathers) */
    const td_adam_coeffs *c;
    int stats;
    int consumes;     /* the grads are transient: their staging slot is freed after */
    int disk;         /* its master, m and v live on disk: acquired from the disk tier when it runs */
    int grads_disk, params_disk; /* its grad / param chunk when that lives on disk too (acquired then), else -1 */
    int master_is_params;        /* fp32 params: the master is the param chunk */
    double landed_ms; /* when its run found the grads and params landed (td_now_ms) */
    double state_ms;  /* and its state read from disk (landed_ms when none of it is there) */
} td_adam_job;

/* Whether the host's AdamW runs on a thread of its own: cfg.adam_thread on,
 * or auto with the cuda backend on one rank (the backend resolved). */
int td_train_adam_overlap(const td_train_config *cfg);
/* Whether the host's grads are transient (memmgr.h, grad_slots): the
 * AdamW thread consumes each chunk's grads as they land, once a step (no
 * clipping or loss scale, no gradient accumulation), so they need no host
 * copy of their own, only TD_TRAIN_GRAD_SLOTS staging slots. */
#define TD_TRAIN_GRAD_SLOTS 8
int td_train_grads_transient(const td_train_config *cfg);
/* The CPU AdamW team's threads: --threads, else the local cores, less the
 * one kept for the thread driving the GPU when the AdamW has its own. */
int td_train_adam_threads(const td_train_config *cfg, td_topo *topo);

/* Elements a chunk's shard is rounded to (shard.h's align). */
size_t td_train_shard_align(const td_train_config *cfg);


/* The ranges, from the layout (decay.c); after td_memmgr_layout. */
td_status td_train_decay_setup(td_trainer *t);
void td_train_decay_free(td_trainer *t);
/* AdamW of param chunk k (role index) in one call on the team `cpu`, its
 * no-decay ranges with c less decay. */
td_status td_train_adam_chunk_cpu(td_trainer *t, td_adam_cpu *cpu, int k, const td_adam_coeffs *c,
                                  const td_adam_chunk *ch);
#ifdef TD_HAVE_CUDA
td_status td_train_adam_chunk_cuda(td_trainer *t, int k, const td_adam_coeffs *c, const td_adam_chunk *ch, void *stream);
#endif

/* cuBLASLt's workspace on the cuda backend (0 elsewhere): the start of the
 * workspace buffer; the model's constants follow it. */
size_t td_train_cublas_workspace_bytes(const td_train_config *cfg);

/* The non-model buffers of a run, in allocation order (one list for the
 * trainer and for `tidal plan`).  The sizes depend on the backend: the CUDA
 * ops keep activations in the compute precision and have their own scratch
 * needs and a cuBLASLt workspace. */
#define ACT_BUFFERS 15
typedef struct td_act_plan {
    size_t bytes[ACT_BUFFERS];
    td_role role[ACT_BUFFERS];
    int n;
    int ckpt_blocks;  /* blocks recomputed in backward */
    size_t total;
} td_act_plan;

/* The device bytes of the model state: params + grads, all roles, and the
 * largest chunk (the layout's, from a planning or a live memmgr). */
typedef struct td_state_bytes { size_t param_grad, all, largest; } td_state_bytes;


/* Registers every tensor of the model in each role (ids: 5 * count ints:
 * param, grad, master or -1, m, v); see footprint.c. */
td_status td_train_register_model(td_memmgr *mm, const td_train_config *cfg, int *ids);
/* Chunk sizes around one block's parameters unless the caller chose. */
td_memmgr_params td_train_chunk_params(const td_train_config *cfg);
/* The model state's device bytes of a laid-out (or planning) memmgr. */
td_state_bytes td_train_state_of(td_memmgr *mm);
/* The non-model buffers for this budget (--ckpt auto's choice included). */
void td_train_plan_activations(const td_train_config *cfg, size_t budget, const td_state_bytes *sb, td_act_plan *p);
/* Per-chunk optimizer placement (optim_place.c). */
/* A planning memmgr with the model registered and laid out (ids: 5 * count). */
td_status td_train_plan_memmgr(const td_train_config *cfg, td_memmgr **mm, int **ids);
/* That memmgr with the optimizer's slack order over its param chunks (order:
 * chunk count + 1 entries, the first `optim_chunks` of them set): what the
 * plan, `tidal plan --layout` and the trainer's placement each start from.
 * td_train_ordered_free frees what it holds (the struct itself is the
 * caller's). */
typedef struct td_train_ordered {
    td_memmgr *mm;
    int *ids, *order;
    int optim_chunks;
} td_train_ordered;
td_status td_train_ordered_make(const td_train_config *cfg, td_train_ordered *out);
void td_train_ordered_free(td_train_ordered *o);
/* Param (= optimizer) chunk indices, the one to keep on the GPU first (the
 * least CPU slack) first; returns the count. */
int td_train_optim_order(const td_train_config *cfg, td_memmgr *mm, const int *pid, int *order);
/* How many optimizer chunks the policy puts on the GPU: cuda all, cpu none,
 * static the (1 - offload_optim_frac) share, auto what the budget leaves
 * room for beside the non-model buffers (min_device: the plan's minimum). */
int td_train_optim_gpu_count(const td_train_config *cfg, td_memmgr *mm, const int *order, size_t nonmodel,
                             size_t min_device, size_t budget);
/* Device bytes of the first `gpu` chunks of order: optimizer state, param +
 * grad, and their param elements. */
void td_train_optim_gpu_bytes(td_memmgr *mm, td_dtype param_dtype, const int *order, int gpu, size_t *state_bytes,
                              size_t *pg_bytes, size_t *numel);
/* on_gpu[k] for each param chunk k (n_out of them; td_free it): the first
 * `gpu` chunks of the slack order. */
td_status td_train_optim_homes(const td_train_config *cfg, int gpu, uint8_t **on_gpu, int *n_out);
/* The trainer's placement, before its layout: t->optim_on_gpu, t->gpu_opt,
 * t->optim_on_disk (disk_chunks of them, td_train_disk_pick) and the
 * memmgr's optimizer homes. */
td_status td_train_place_optimizer(td_trainer *t, const td_train_plan *plan);
/* ---- the host side (hostplan.c) ---- */
#define TD_TRAIN_STAGING 5
/* The pinned staging buffers the trainer takes, in order (alloc_activations). */
void td_train_staging_sizes(const td_train_config *cfg, size_t sizes[TD_TRAIN_STAGING]);
/* The pinned pool's slab size for the pinned chunk copies of a planned layout. */
size_t td_train_host_slab_bytes(td_memmgr *mm, const td_train_config *cfg);
/* The homes td_train_place_optimizer gives the trainer's layout (the first
 * gpu_chunks of the slack order's optimizer state on the device, the
 * chunks of td_train_disk_pick's marks (NULL: none) on disk, the rest of
 * the optimizer state on the host: pageable), set on a planned layout for
 * the host plan (order: its td_train_optim_order). */
td_status td_train_host_homes(td_memmgr *mm, const int *order, int gpu_chunks, const uint8_t *marks);
/* ---- the disk tier (diskplan.c) ---- */
/* The roles of the disk tier's slot pools, in the order the layout takes
 * them (memmgr.h, td_memmgr_disk_plan). */
#define TD_TRAIN_DISK_POOLS 5
extern const td_tensor_role td_train_disk_pool_roles[TD_TRAIN_DISK_POOLS];
/* marks[k] (n param chunks) for the chunks the disk tier takes of each
 * kind: counts[0] optimizer chunks (of those not on_gpu, NULL: none),
 * counts[1] grad chunks, counts[2] param chunks, each spread evenly over
 * the chunks of the common size, then the larger ones. */
#define TD_TRAIN_DISK_OPTIM 1u
#define TD_TRAIN_DISK_GRAD 2u
#define TD_TRAIN_DISK_PARAM 4u
td_status td_train_disk_pick(const td_train_config *cfg, td_memmgr *mm, const uint8_t *on_gpu, int n,
                             const int counts[3], uint8_t *marks);
/* The plan's disk_* fields, and its host_* fields with the chunks on disk
 * that make the host fit (its homes set on mm: gpu chunks of the slack
 * order on the device); after td_train_host_plan without any. */
td_status td_train_plan_disk(const td_train_config *cfg, td_memmgr *mm, const int *order, int gpu, size_t budget,
                             td_train_plan *p);
/* The pageable optimizer state's pages first touched (zeroed) by the
 * threads of an AdamW team like the trainer's, each the pages it will
 * update: NUMA placement inside the local nodes, and no page faults in the
 * first step (after td_memmgr_layout, before the params are initialised). */
td_status td_train_first_touch(td_memmgr *mm, const td_train_config *cfg, td_topo *topo);
/* The host_* fields of the plan from a planned layout with its homes set. */
td_status td_train_host_plan(td_memmgr *mm, const td_train_config *cfg, size_t budget, td_train_plan *p);
/* The node_* fields of the plan (the host all local ranks share) from a
 * planned layout with its homes set, after td_train_host_plan. */
td_status td_train_node_plan(td_memmgr *mm, const td_train_config *cfg, td_train_plan *p);

/* fp32 values into a buffer of dtype dt (round to nearest even), and back. */
void td_train_from_f32(void *dst, td_dtype dt, const float *src, size_t n);
void td_train_to_f32(float *dst, const void *src, td_dtype dt, size_t n);

#endif
