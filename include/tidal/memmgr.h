/* The chunk manager: what lives where, and moving it there before it is needed.
 *
 * Tensors (params, grads, optimizer state, other buffers) are registered
 * once, then packed into chunks: one list of chunks per role, filled in
 * registration order, every chunk of the model holding the same number of
 * elements (searched to waste the fewest padding bytes; a tensor larger
 * than that gets a chunk of its own).  Registering grads, master, m and v in
 * the same order as the params therefore gives every role the same layout:
 * chunk i of each role holds the same tensors, which is what a per-chunk
 * optimizer needs.
 *
 * Every chunk has a host copy and, while resident, a device copy (a slot in
 * the arena), with a dirty bit per side.  Only what crosses PCIe is pinned:
 * the host copy of a chunk is PAGEABLE (td_hostmem, NUMA-local to the CPU
 * AdamW, not from the pinned pool) iff its role is MASTER, ADAM_M or ADAM_V
 * and its home is TD_HOME_HOST when td_memmgr_layout runs; such a chunk is
 * the CPU optimizer's alone and is never accessed on the device
 * (td_memmgr_access refuses it).  Every other chunk's host copy is pinned.
 * td_memmgr_set_chunk_home before the layout decides it per chunk (the
 * per-chunk GPU optimizer homes its chunks' state on the device).
 * Each tensor has a state (tensor_state.h); a chunk with any tensor in
 * COMPUTE is pinned on the device.
 *
 *   td_memmgr_access(ids, COMPUTE, flags)  makes the chunks resident (waiting
 *       on a prefetch in flight, else loading now, evicting as needed; the
 *       compute queue is ordered after the load, the host does not wait) and
 *       returns device pointers.  TD_ACCESS_WRITE marks the device copy dirty.
 *   td_memmgr_release(ids, to)  ends the use; the chunk becomes evictable
 *       once no tensor of it is in COMPUTE.
 *   td_memmgr_host_access(ids, flags)  a valid host copy for the CPU (the
 *       optimizer): waits for a write-back in flight, or copies back now;
 *       TD_ACCESS_WRITE makes the device copy stale (reloaded at next access)
 *       and is refused for FREE tensors.
 *
 * FREE means "no payload": a chunk whose tensors are all FREE is handed out
 * zero-filled by the next access, never loaded, never written back.
 *   td_memmgr_writeback_async(ids)  starts copying dirty chunks to the host
 *       now (grads leaving the GPU while backward continues).
 *
 * Steps: td_memmgr_step_begin / _end bracket a training step.  The first step
 * is the warm-up: the tracer records the chunk access sequence and the
 * non-model bytes live in the arena at each access; at its end the plan is
 * made: the next-use table for Belady eviction (wrapping into the next step),
 * the placement of the `auto` policy, and the prefetch window.  From then on
 * each access issues the loads of the next chunks early.
 *
 * Device memory: only through the arena (chunk slots by td_slot_pool, one
 * pool per chunk size); td_memmgr_alloc_nonmodel gives activations and
 * workspaces room by evicting chunks when the arena is full.  The budget is
 * never exceeded: a request that cannot be met even with every unpinned
 * chunk evicted fails with TD_ERR_BUDGET and says what would fit.
 *
 * Thread-safety: one thread drives a manager (the step loop).  The optimizer
 * threads may read and write host copies they obtained with host_access. */
#ifndef TIDAL_MEMMGR_H
#define TIDAL_MEMMGR_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "tidal/arena.h"
#include "tidal/copy.h"
#include "tidal/diskio.h"
#include "tidal/dtype.h"
#include "tidal/hostmem.h"
#include "tidal/hostpool.h"
#include "tidal/policy.h"
#include "tidal/shard.h"
#include "tidal/status.h"
#include "tidal/tensor_state.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_memmgr td_memmgr;

typedef enum td_tensor_role {
    TD_TENSOR_PARAM,
    TD_TENSOR_GRAD,
    TD_TENSOR_MASTER,
    TD_TENSOR_ADAM_M,
    TD_TENSOR_ADAM_V,
    TD_TENSOR_OTHER,
    TD_TENSOR_ROLE_COUNT
} td_tensor_role;

const char *td_tensor_role_name(td_tensor_role r);

typedef enum td_placement {
    TD_PLACEMENT_CUDA,    /* everything resident: a plain GPU trainer */
    TD_PLACEMENT_CPU,     /* everything homed on the host; chunks visit the device */
    TD_PLACEMENT_STATIC,  /* user fractions offloaded */
    TD_PLACEMENT_AUTO,    /* after warm-up: keep resident what the budget allows */
} td_placement;

const char *td_placement_name(td_placement p);
td_status td_placement_parse(const char *name, td_placement *out);

/* Where a chunk lives between uses. */
typedef enum td_chunk_home {
    TD_HOME_HOST,    /* loaded for use, evictable */
    TD_HOME_DEVICE,  /* resident from first use on, never evicted */
    TD_HOME_DISK,    /* in a scratch file under params.disk_dirs, read into a slot while it is used (the CPU AdamW,
                        an upload, a host access): optimizer state, and params and grads when not sharded
                        (see "The disk tier" below) */
} td_chunk_home;

#define TD_ACCESS_READ  0u
#define TD_ACCESS_WRITE 1u

/* The collectives of sharded chunks (params.shard_ranks > 1), supplied by
 * the caller (the trainer passes its communicator's).  In place on a
 * device chunk of shard_ranks shards of shard_numel elements each, on
 * queue q after the queue's earlier work; every rank calls them in the same
 * order.  The chunk manager stays free of any communicator. */
typedef struct td_memmgr_comm {
    void *ctx;
    /* every rank's shard (this rank's at shard_rank x shard_numel) into every rank's buf */
    td_status (*all_gather)(void *ctx, void *buf, size_t shard_numel, td_dtype dt, td_queue q);
    /* the sum over the ranks of shard r into rank r's shard r (the other shards: anything after) */
    td_status (*reduce_scatter)(void *ctx, void *buf, size_t shard_numel, td_dtype dt, td_queue q);
    /* n host values replaced by their maximum over the ranks (decisions every rank must share) */
    td_status (*agree_max)(void *ctx, double *v, int n);
    /* The host waits for queue q, collectives included, failing (not
     * hanging) when a peer stops answering; the manager's host waits for
     * a copy behind a collective go through it.  NULL: td_queue_sync. */
    td_status (*wait)(void *ctx, td_queue q);
} td_memmgr_comm;

typedef struct td_memmgr_params {
    size_t min_chunk_numel, max_chunk_numel; /* search range; 0: 1Mi..64Mi elements */
    size_t chunk_numel;                      /* fixed size, skips the search; 0: search */
    td_placement placement;                  /* default AUTO */
    double offload_param_frac;               /* STATIC: fraction of param/grad chunks homed on the host */
    double offload_optim_frac;               /* STATIC: fraction of optimizer-state chunks on the host */
    td_evict_policy eviction;                /* default BELADY (LRU during warm-up) */
    int prefetch;                            /* look-ahead in accesses; -1 auto (default): sized from the
                                                warm-up's measured load time per chunk and compute time per
                                                access; 0 off */
    const char *trace_out;                   /* write the warm-up trace here (tidal-trace 1), or NULL */
    td_hostmem *hostmem;                     /* pageable host copies (see above); NULL: the manager maps its
                                                own, without NUMA binding.  Must outlive the manager. */
    /* Transient grads: with grad_slots > 0, the grad chunks whose optimizer
     * chunk is homed on the host have no host copy of their own.  A
     * write-back takes one of grad_slots pinned staging slots (of the size
     * that pins least: chunks larger than it, the embedding's, keep a copy
     * each), which the chunk keeps until a consumer that
     * peeked at it (td_memmgr_chunk_host_peek: the CPU AdamW) gives it
     * back with td_memmgr_grad_consumed, or until all the chunk's tensors
     * are FREE; a write-back that finds every slot taken waits for a
     * consumer, and fails if none holds one (nothing would ever free it).
     * For a schedule whose grads are written once a step and read once:
     * no gradient accumulation, no global norm before the update.  Off
     * when there are no more such chunks than slots, or <= 0 (default -1:
     * the trainer reads it as auto, td_train_resolve_grad_slots). */
    int grad_slots;
    /* ZeRO-3 (shard.h): with shard_ranks > 1 the host copy of every
     * chunk is rank shard_rank's shard of the chunk's used elements
     * (td_memmgr_chunk_host_range), so the ranks' hosts hold each byte of
     * the model state once:
     *   - optimizer chunks (MASTER, ADAM_M, ADAM_V) are the shard alone on
     *     the device too (a slot of 1/N the padded chunk): each rank's
     *     AdamW updates its shard;
     *   - param and grad chunks ("gathered") have a device slot padded to
     *     a multiple of shard_ranks x shard_align elements that holds the
     *     whole chunk: N shards of S elements, this rank's at
     *     shard_rank x S.  A load copies the rank's shard over PCIe; a
     *     param chunk is then all-gathered in place (shard_comm), a grad
     *     chunk's other shards are zeroed.  A device write to a param
     *     chunk changes the rank's shard alone (the GPU AdamW): the other
     *     shards are gathered from their owners before its next use.  A
     *     device write to a grad chunk adds this rank's contributions:
     *     before its shard goes to the host (a write-back) or
     *     td_memmgr_reduce_async, the chunk is reduce-scattered in place
     *     (the sum of every rank's over each shard into its owner's) and
     *     its other shards zeroed, so a later write adds to a sum no rank
     *     counts twice.
     * Collectives run in the order the chunk manager meets these events;
     * every rank must make the same accesses, releases, host writes and
     * write-backs in the same order with the same budget (the trainer
     * does), and the plan's measured inputs (the prefetch window's) are
     * agreed with shard_comm.agree_max.  A sharded chunk is used only
     * whole on the host: td_memmgr_chunk_host_access (td_memmgr_host_access
     * refuses its tensors); td_memmgr_access gives an optimizer chunk's
     * shard start for each of its tensors, a gathered chunk's tensors their
     * own addresses.  0 or 1: no sharding. */
    int shard_ranks, shard_rank;
    size_t shard_align;                      /* elements; 0 means 1 */
    /* The disk tier (chunks homed on TD_HOME_DISK): their scratch file is
     * striped over these directories (copied at create; diskio.h). */
    const char *const *disk_dirs;
    int n_disk_dirs;
    int disk_sets;                           /* slots a role (pinned buffers; default 4, at least 3) */
    int disk_buffered;                       /* 1: through the page cache (default: O_DIRECT where the filesystem
                                                has it, else the page cache, said in td_memmgr_disk_describe) */
    td_dio_method disk_method;               /* io_uring or threads (default auto) */
    td_memmgr_comm shard_comm;               /* the collectives; a live manager needs them when shard_ranks > 1 */
} td_memmgr_params;

td_memmgr_params td_memmgr_default_params(void);

typedef struct td_memmgr_stats {
    uint64_t loads, evictions, writebacks;        /* chunk transfers */
    uint64_t bytes_h2d, bytes_d2h;
    uint64_t prefetches, demand_loads;            /* loads issued ahead / at the access */
    uint64_t stalls;                              /* accesses whose load was not finished yet */
    double stall_ms;                              /* host time spent waiting on copies */
    double slot_wait_ms;                          /* time write-backs waited for a transient grad
                                                     slot (a consumer to finish with one) */
    uint64_t steps, accesses;
    size_t device_chunk_bytes, device_peak_bytes; /* chunk slots held now; arena peak */
    size_t host_chunk_bytes;                      /* pinned host copies */
    size_t host_pageable_bytes;                   /* pageable host copies (page-rounded) */
    uint64_t disk_read_bytes, disk_write_bytes;   /* the disk tier's reads and writes (whole 4 KiB blocks) */
    double disk_wait_ms;                          /* time its users waited for a read, a write or a free set */
    /* Sharded param and grad chunks (params.shard_ranks > 1): the
     * all-gathers of params and reduce-scatters of grads, and the bytes of
     * the other ranks' shards each moves over the devices' links ((N - 1)
     * S elements a collective: what this rank receives in a gather, sends
     * in a reduce-scatter). */
    uint64_t gathers, reduce_scatters;
    uint64_t bytes_gathered, bytes_reduced;
} td_memmgr_stats;

td_status td_memmgr_create(td_arena *arena, td_hostpool *pool, td_copy_engine *engine,
                           const td_memmgr_params *params, td_memmgr **out);
/* Waits for copies in flight and returns every byte it took. */
void td_memmgr_destroy(td_memmgr *m);

/* Registration (before td_memmgr_layout).  Names are copied.  A tensor
 * starts FREE with zeroed contents. */
td_status td_memmgr_register(td_memmgr *m, const char *name, size_t numel, td_dtype dtype, td_tensor_role role,
                             int *id_out);
/* Per-chunk optimizer placement, decided before the layout and fixed for the
 * run: optimizer chunk i (chunk i of MASTER, ADAM_M and ADAM_V, which hold
 * the same tensors as param chunk i) is homed on the device when
 * on_device[i] is TD_HOME_DEVICE (1; then param and grad chunk i are too: a
 * GPU optimizer updates them there, so its grads never go down and its
 * params never come up), on disk when it is TD_HOME_DISK (2), else (0) on
 * the host, under every placement policy; or'ed with
 * TD_OPTIM_HOME_GRAD_DISK / _PARAM_DISK, grad / param chunk i on disk too; AUTO's after-warm-up placement
 * leaves optimizer chunks alone.  n: each optimizer role's chunk count as
 * the layout makes it (a planning manager with the same registrations gives
 * it); the layout fails otherwise.  Copied. */
td_status td_memmgr_set_optim_homes(td_memmgr *m, const uint8_t *on_device, int n);
#define TD_OPTIM_HOME_GRAD_DISK 4u
#define TD_OPTIM_HOME_PARAM_DISK 8u
/* A role whose chunks hold their elements in a format of their own (an
 * optimizer state quantized in blocks, say): a chunk of `numel` elements of
 * this role takes bytes_of(numel, ctx) bytes.  The packing is in elements as
 * for every role (so chunk i still holds the same tensors as chunk i of the
 * params); a tensor of such a role has no address of its own: every access
 * gives the chunk's start.  Before the layout. */
td_status td_memmgr_set_role_format(td_memmgr *m, td_tensor_role role, size_t (*bytes_of)(size_t numel, void *ctx),
                                    void *ctx);
/* Packs the tensors into chunks (unless td_memmgr_plan_layout did) and
 * allocates the host copies: pinned, or pageable (see above). */
td_status td_memmgr_layout(td_memmgr *m);
/* A chunk's home, after td_memmgr_plan_layout and before td_memmgr_layout
 * (which allocates the host copies by it); the policy's choice otherwise. */
td_status td_memmgr_set_chunk_home(td_memmgr *m, int chunk, td_chunk_home home);
/* 1 when the chunk's host copy is (or, planned, will be) pageable. */
int td_memmgr_chunk_pageable(const td_memmgr *m, int chunk);
/* 1 when the chunk is a transient grad chunk (params.grad_slots): its host
 * copy is a staging slot, lent while it is written back and consumed. */
int td_memmgr_chunk_transient(const td_memmgr *m, int chunk);
/* The staging slots of the transient grads (0 when off) and their bytes
 * each; planned or live.  They are pinned after the chunks' host copies. */
int td_memmgr_grad_slots(const td_memmgr *m, size_t *slot_bytes);
/* A consumer is done with a transient grad chunk's host copy (`host`, as
 * td_memmgr_chunk_host_peek gave it): the slot is free for the next
 * write-back.  Thread-safe: the one call another thread may make. */
td_status td_memmgr_grad_consumed(td_memmgr *m, const void *host);
void td_memmgr_print_layout(td_memmgr *m, FILE *f);
/* The layout and the initial homes without memory.  A manager created
 * with NULL arena, pool and engine (`tidal plan`) can do this and answer the
 * layout queries, nothing else; a live manager may plan first, set homes
 * (td_memmgr_set_chunk_home), then td_memmgr_layout. */
td_status td_memmgr_plan_layout(td_memmgr *m);

/* Layout queries. */
int td_memmgr_tensor_count(const td_memmgr *m);
int td_memmgr_chunk_count(const td_memmgr *m);
size_t td_memmgr_chunk_numel(const td_memmgr *m);         /* the searched size */
size_t td_memmgr_padding_bytes(const td_memmgr *m);       /* bytes wasted by the layout */
int td_memmgr_tensor_chunk(const td_memmgr *m, int id);
size_t td_memmgr_tensor_offset(const td_memmgr *m, int id); /* elements into its chunk */
size_t td_memmgr_tensor_numel(const td_memmgr *m, int id);
const char *td_memmgr_tensor_name(const td_memmgr *m, int id); /* as registered */
td_tensor_state td_memmgr_tensor_state(const td_memmgr *m, int id);
/* A chunk's bytes up to the end of its last tensor: its host copy, what
 * every copy moves, and what a per-chunk optimizer updates (chunk i of
 * mirrored roles holds the same elements).  The device slot is the
 * capacity, td_memmgr_chunk_slot_bytes (the layout's common size, so slots
 * of one size are reused by any chunk). */
size_t td_memmgr_chunk_bytes(const td_memmgr *m, int chunk);
size_t td_memmgr_chunk_slot_bytes(const td_memmgr *m, int chunk);
size_t td_memmgr_chunk_numel_used(const td_memmgr *m, int chunk);
/* The elements [*begin, *end) of the chunk its host copy (and device copy)
 * holds: [0, used) unsharded, the rank's shard of them for an optimizer
 * chunk when params.shard_ranks > 1; the copy's element 0 is chunk element
 * *begin.  Returns end - begin. */
size_t td_memmgr_chunk_host_range(const td_memmgr *m, int chunk, size_t *begin, size_t *end);
/* The shard layout of the chunk's used elements over params.shard_ranks
 * ranks (1 rank when unsharded): what the collectives of its params and
 * grads move (td_shard_layout.shard_numel per rank). */
td_status td_memmgr_chunk_shard(const td_memmgr *m, int chunk, td_shard_layout *out);
td_tensor_role td_memmgr_chunk_role(const td_memmgr *m, int chunk);
td_chunk_home td_memmgr_chunk_home(const td_memmgr *m, int chunk);
/* Chunk `index` of a role's list, -1 if none: chunk i of every role holds
 * the same tensors when the roles were registered alike. */
int td_memmgr_role_chunk(const td_memmgr *m, td_tensor_role role, int index);
int td_memmgr_role_chunk_count(const td_memmgr *m, td_tensor_role role);

td_status td_memmgr_access(td_memmgr *m, const int *ids, int n, td_tensor_state state, unsigned flags,
                           void **dev_ptrs);
td_status td_memmgr_release(td_memmgr *m, const int *ids, int n, td_tensor_state to);
/* A state change that moves nothing (e.g. READY_FOR_REDUCE -> HOLD). */
td_status td_memmgr_set_state(td_memmgr *m, const int *ids, int n, td_tensor_state to);
td_status td_memmgr_host_access(td_memmgr *m, const int *ids, int n, unsigned flags, void **host_ptrs);
/* The same for a whole chunk (td_memmgr_chunk_bytes of it: up to its last
 * tensor, alignment gaps included: the per-chunk optimizer's view).  For a
 * write no tensor of it may be FREE. */
td_status td_memmgr_chunk_host_access(td_memmgr *m, int chunk, unsigned flags, void **host);
/* A chunk's host copy without waiting, for a reader on another thread: the
 * write-back of a dirty chunk is started, and `written` is the ticket that
 * reader waits for (td_copy_wait) before it reads.  The caller keeps the
 * chunk's host copy and its device copy unwritten meanwhile, and records a
 * write to the host copy afterwards with td_memmgr_chunk_host_access
 * (TD_ACCESS_WRITE), which makes the device copy stale. */
td_status td_memmgr_chunk_host_peek(td_memmgr *m, int chunk, void **host, td_copy_ticket *written);
td_status td_memmgr_writeback_async(td_memmgr *m, const int *ids, int n);
/* The grad chunks holding these tensors reduce-scattered now (on the D2H
 * queue) where they hold contributions not yet summed over the ranks,
 * without a write-back: for grads that stay on the device (a GPU AdamW's).
 * Their next access waits for it.  Nothing without sharding. */
td_status td_memmgr_reduce_async(td_memmgr *m, const int *ids, int n);
/* The chunk's host copy will be written (a deferred CPU update) before its
 * next use: prefetches leave it alone until that write (a host access with
 * TD_ACCESS_WRITE), rather than load what the write replaces.  Under
 * sharding the order of loads is every rank's, so a load must not depend on
 * when an update finished. */
td_status td_memmgr_expect_host_write(td_memmgr *m, int chunk);
/* The device copy of the chunk holding tensor `id` was just written by work
 * queued on q (a collective on the H2D queue, say), after td_memmgr_release:
 * its next access orders the compute queue after that work, and its slot is
 * neither reused nor written back before it ends. */
td_status td_memmgr_written_on(td_memmgr *m, int id, td_queue q);
/* Orders queue q after every use of the device copy of the chunk holding
 * tensor `id` queued so far: its load, the kernels of its last release, a
 * write-back.  For work on another queue that overwrites the copy (an
 * all-gather in place, say) while the compute queue goes on with other
 * chunks.  The chunk must be resident (accessed, so still in COMPUTE). */
td_status td_memmgr_order_after_use(td_memmgr *m, int id, td_queue q);

/* Device memory for non-model buffers, evicting chunks to make room. */
td_status td_memmgr_alloc_nonmodel(td_memmgr *m, size_t bytes, td_role role, void **ptr);
td_status td_memmgr_free_nonmodel(td_memmgr *m, void *ptr);

/* step_begin starts a new peak window in the arena (td_arena_reset_peak);
 * the run's peak stays in td_memmgr_stats.device_peak_bytes. */
td_status td_memmgr_step_begin(td_memmgr *m);
td_status td_memmgr_step_end(td_memmgr *m);

void td_memmgr_get_stats(const td_memmgr *m, td_memmgr_stats *out);
/* The last finished step as one JSON object (no newline): step, accesses,
 * loads, evictions, writebacks, bytes_h2d, bytes_d2h, prefetches,
 * demand_loads, stalls, stall_ms, slot_wait_ms, gathers, reduce_scatters,
 * bytes_gathered, bytes_reduced, prefetch_window, device_peak_bytes,
 * disk_read_bytes, disk_write_bytes, disk_wait_ms and peak_bytes per arena
 * role (written with cJSON).  Returns the length written (truncated to
 * buf_bytes - 1; 2 KiB always hold it). */
size_t td_memmgr_step_json(const td_memmgr *m, char *buf, size_t buf_bytes);

/* Timeline: from now on, every step's chunk loads, write-backs, evictions,
 * arena use and the compute ranges named below go to `path` as Chrome trace
 * JSON (open in https://ui.perfetto.dev or chrome://tracing).  Times come
 * from device events, synchronised at each step's end (a timeline costs a
 * sync per step; without one nothing waits).  Written until destroy. */
td_status td_memmgr_timeline_open(td_memmgr *m, const char *path);
/* Marks a compute range on the compute queue ("block 3 forward"); begin = 1
 * opens it, begin = 0 closes the innermost open range (ranges nest). */
td_status td_memmgr_timeline_range(td_memmgr *m, const char *name, int begin);
/* Host work on the timeline, on a track of its own (its name, e.g. "CPU
 * AdamW"; at most TD_TIMELINE_HOST_TRACKS of them), from t0_ms to t1_ms of
 * td_now_ms's clock: a span named by the printf format `name` (formatted
 * only when a timeline is open).  Nothing without a timeline.  Call it from
 * the thread that drives the memmgr. */
enum { TD_TIMELINE_HOST_TRACKS = 4 };
td_status td_memmgr_timeline_host(td_memmgr *m, const char *track, double t0_ms, double t1_ms, const char *name, ...)
    __attribute__((format(printf, 5, 6)));
/* ---- the disk tier ----------------------------------------------------------------
 * Chunks homed on TD_HOME_DISK (td_memmgr_set_chunk_home between
 * td_memmgr_plan_layout and td_memmgr_layout, or td_memmgr_set_optim_homes)
 * have no host copy of their own: td_memmgr_layout places them in one
 * scratch file striped over params.disk_dirs (diskio.h: O_DIRECT,
 * preallocated, unnamed, a lock file beside it) and takes, for each role
 * with chunks there, a pool of params.disk_sets slots (pinned buffers the
 * size of the role's largest disk chunk).  A chunk is read into a slot when
 * it is used (a chunk never written reads as zeros without I/O) and
 * written back from it when it changed.  Optimizer state (master, m, v) is
 * the CPU AdamW's alone: it acquires optimizer chunk i (all three) and
 * releases it after the update, which starts the writes.  Params and grads
 * also cross PCIe: an upload reads the param chunk into its slot first (a
 * prefetch waits for that read to land), a write-back lands in the grad
 * chunk's slot and is written from there; the CPU AdamW acquires them per
 * chunk (td_memmgr_disk_chunk_acquire).  With params.shard_ranks > 1 a
 * chunk on disk is the rank's shard of it, as its host copy would be.  The manager reads ahead, into the slots
 * no one uses, the next optimizer chunks in the order
 * td_memmgr_disk_set_order gives (the AdamW's) and the params of the next
 * accesses by its next-use table, taking first the slot whose chunk comes
 * back last; it does so on every acquire, release and device access, so
 * the drive keeps reading while the AdamW and the GPU work.
 * td_memmgr_host_access and td_memmgr_chunk_host_access work on disk chunks
 * too: the slot is kept (or td_memmgr_disk_release_held, or the next
 * step) until later host accesses to other disk chunks need it: a caller
 * may use the pointers of up to four chunks at once, and of as many of one
 * role as its pool has slots but one (a checkpoint streams through them).  An I/O error fails the call that
 * meets it with the engine's message (the directory, the file, the error);
 * it stays failed.  acquire, release, ready and flush are thread-safe. */
int td_memmgr_chunk_on_disk(const td_memmgr *m, int chunk);
/* The disk tier as laid out (or, on a planning manager, as it would be):
 * the slots of each pool (the count returned; 0: no chunk on disk), each
 * slot's pinned bytes by role (0 for a role with no disk chunk; the pools
 * are allocated after the staging slots of the transient grads, roles
 * PARAM, GRAD, MASTER, ADAM_M, ADAM_V in turn), and the scratch file's
 * bytes (each disk chunk rounded up to 4 KiB).  Either pointer may be NULL. */
int td_memmgr_disk_plan(const td_memmgr *m, size_t slot_bytes[TD_TENSOR_ROLE_COUNT], size_t *file_bytes);
/* The optimizer chunk indices in the order their users take them, for the
 * read-ahead (default: ascending).  Users may take them out of the order
 * (each index once a round: a step); the read-ahead keeps the ones passed
 * over and reads from the first not yet taken. */
td_status td_memmgr_disk_set_order(td_memmgr *m, const int *index, int n);
/* The index the read-ahead serves first: the first of the order not yet
 * taken this round (the next round's first when all were); -1 without a
 * disk tier or an order. */
int td_memmgr_disk_next(td_memmgr *m);
/* Optimizer chunk `index`'s disk chunks in slots (waits for their reads):
 * host[0] master, host[1] m, host[2] v; NULL for a role of the index not on
 * disk.  Held until td_memmgr_disk_release. */
td_status td_memmgr_disk_acquire(td_memmgr *m, int index, void *host[3]);
/* written: the user changed them (their writes start now). */
td_status td_memmgr_disk_release(td_memmgr *m, int index, int written);
/* One disk chunk of any role: READ its bytes; MODIFY them (no device copy
 * may still read the slot); OVERWRITE every byte (nothing is read).  The
 * bytes of a param or grad are the host copy's: a grad's write-back must
 * have landed (td_memmgr_chunk_host_peek gives its ticket).  A release with
 * `written` starts the write; a param's device copy is then stale only
 * after td_memmgr_chunk_host_written. */
typedef enum td_disk_access { TD_DISK_READ, TD_DISK_MODIFY, TD_DISK_OVERWRITE } td_disk_access;
td_status td_memmgr_disk_chunk_acquire(td_memmgr *m, int chunk, td_disk_access how, void **host);
td_status td_memmgr_disk_chunk_release(td_memmgr *m, int chunk, int written);
/* Whether td_memmgr_disk_acquire(index) would find its bytes already read
 * (1 too for an index with nothing on disk). */
int td_memmgr_disk_ready(td_memmgr *m, int index);
/* The slots host accesses kept, let go (their writes start). */
void td_memmgr_disk_release_held(td_memmgr *m);
/* Every changed chunk written, every I/O ended; the engine's first failure. */
td_status td_memmgr_disk_flush(td_memmgr *m);
/* The engine's first failure, without waiting (TD_OK when none). */
td_status td_memmgr_disk_status(td_memmgr *m);
/* The engine and the scratch file: one line each, then what making the
 * file found (lock files of ended runs removed); "" without a disk tier. */
const char *td_memmgr_disk_describe(const td_memmgr *m);
/* A write to the chunk's bytes made elsewhere (the disk tier's slot, by
 * another thread): the host side is the newer from now on, the device copy
 * stale (reloaded at its next access, or loaded ahead again: it ends a
 * td_memmgr_expect_host_write).  No load may be in flight from it. */
td_status td_memmgr_chunk_host_written(td_memmgr *m, int chunk);

/* Device bytes the chunks need at the least: the largest set pinned at once
 * in the warm-up step plus its non-model bytes (0 before warm-up). */
size_t td_memmgr_min_budget(const td_memmgr *m);

#ifdef __cplusplus
}
#endif
#endif
