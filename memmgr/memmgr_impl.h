/* Private: the chunk manager's structures, shared by layout.c and memmgr.c. */
#ifndef TIDAL_MEMMGR_IMPL_H
#define TIDAL_MEMMGR_IMPL_H

#include "tidal/diskio.h"
#include "tidal/memmgr.h"
#include "tidal/trace.h"

#include <pthread.h>

#define MM_ALIGN_NUMEL 64 /* tensor offsets: 128 B for 16-bit, 256 B for fp32 elements */

typedef struct mm_tensor {
    char *name;
    size_t numel;
    td_dtype dtype;
    td_tensor_role role;
    int chunk;
    size_t offset; /* elements */
    td_tensor_state state;
} mm_tensor;

/* Device memory of one chunk size: slots taken from the arena, and spare
 * ones (evicted, kept for reuse) with the ticket after which the previous
 * owner's last use is over. */
typedef struct mm_spare { void *ptr; td_copy_ticket fence; } mm_spare;
typedef struct mm_pool {
    size_t bytes;
    td_slot_pool *slots;
    mm_spare *spare;
    int n_spare, cap_spare;
} mm_pool;

typedef struct mm_chunk {
    td_tensor_role role;
    td_dtype dtype;
    int index;                  /* in its role's list */
    size_t numel, bytes;        /* capacity: the device slot */
    size_t used_numel;          /* up to the end of its last tensor (mirrored roles agree) */
    size_t host_bytes;          /* the host copy and every copy: the used elements, no tail padding */
    int *tensors, n_tensors;
    int n_free;                 /* tensors in FREE */
    int pins;                   /* tensors in COMPUTE */
    td_chunk_home home;
    void *host;                 /* pinned, or pageable (optimizer state homed on the host) */
    int pageable;               /* host from the td_hostmem: never on the device */
    int transient;              /* a grad chunk whose host copy is a lent staging slot (or NULL) */
    int gslot;                  /* that slot, -1 none */
    void *dev;                  /* NULL when not resident */
    mm_pool *pool;
    /* Versions: which side holds the newest data.  dev_ver > host_ver: the
     * device copy is dirty; host_ver > dev_ver: the device copy is stale. */
    uint64_t host_ver, dev_ver;
    td_copy_ticket load;        /* H2D in flight into dev */
    td_copy_ticket writeback;   /* D2H in flight from dev */
    td_copy_ticket fence;       /* after this, dev is no longer read or written */
    uint64_t last_use;          /* access position */
    uint64_t accesses;          /* in the warm-up step */
    int read_beside_wb;         /* in use by a read while its write-back ran: the fence at release goes
                                   on the D2H queue, after both */
    /* Homed on disk (optimizer state only, disk.c): no host copy of its own;
     * its bytes live at disk_off of the scratch file, and in a bounce set
     * while used.  disk_written: the file holds its bytes (else they are zeros). */
    int on_disk, disk_written;
    size_t disk_off;
    /* Sharded (params.shard_ranks > 1, memmgr.h): the host copy holds
     * chunk elements [host_begin, host_begin + host numel).  A gathered
     * chunk (param or grad) holds the whole chunk on the device, N shards
     * of shard_numel elements, the host copy at element host_begin. */
    size_t host_begin, shard_numel;
    int gathered;
    int partial;                /* param: this rank's shard on the device is newer than the others'
                                   (gathered before the next use) */
    int unreduced;              /* grad: device contributions not yet summed over the ranks */
    int expect_write;           /* td_memmgr_expect_host_write: no prefetch until the host copy is written */
} mm_chunk;

/* The disk tier (disk.c).  A chunk homed on disk lives in the scratch file
 * and, while it is used, in a slot of its role's pool: pinned buffers the
 * size of the role's largest disk chunk.  A slot's bytes are valid, being
 * read, dirty (newer than the file) or being written; a device copy may be
 * reading it (an upload) or writing it (a write-back, which makes it dirty
 * once it lands). */
#define MM_DISK_HOLDS 4 /* slots a host access keeps (the driving thread's), oldest let go first */
typedef struct mm_dslot {
    int chunk;                  /* the chunk whose bytes it holds (or is reading); -1 none */
    int pins;                   /* users: the CPU AdamW, a host access, a device copy being issued */
    int valid, reading, dirty, writing;
    int copy_busy, copy_dirty;  /* a device copy in flight reads it / writes it (dirty once it lands) */
    td_copy_ticket copy;
    td_dio_ticket rd, wr;
    uint64_t stamp;             /* its last use (the tie-break among victims) */
    void *buf;
} mm_dslot;

typedef struct mm_dpool {
    size_t slot_bytes;          /* 0: no chunk of the role on disk */
    mm_dslot *slots;
    int n;
} mm_dpool;

typedef struct mm_disk {
    td_dio *io;
    td_dio_file *file;
    size_t file_bytes;
    mm_dpool pools[TD_TENSOR_ROLE_COUNT];
    int *order, n_order, *order_pos;    /* optimizer chunk indices in the order the AdamW takes them; per index its place */
    int n_index;                        /* indices (order_pos's length) */
    unsigned char *done;                /* per place in the order: acquired in this round (step) already */
    int n_done, cursor;                 /* how many are; the first place not yet (n_order: none left) */
    const td_nextuse *nextuse;          /* the manager's, and its position, as the driving thread last saw them */
    uint64_t mm_pos;
    int held[MM_DISK_HOLDS], n_held;    /* chunks a host access keeps, oldest first */
    uint64_t clock;
    pthread_mutex_t lock;
    pthread_cond_t cond;                /* an I/O or a copy ended, or a slot came free */
    uint64_t read_bytes, write_bytes;
    double wait_ms;                     /* time users waited for a read, a write or a free slot */
} mm_disk;

/* The timeline (Chrome / Perfetto JSON): copies and compute ranges timed by
 * events from a fixed pool, written out at each step's end. */
/* An access the host spends at least this long in shows on the timeline's
 * "driving thread" track (host waits, the loads it issues). */
#define MM_TL_ACCESS_MIN_MS 0.05
typedef enum mm_tl_kind { MM_TL_LOAD, MM_TL_WRITEBACK, MM_TL_RANGE, MM_TL_EVICT, MM_TL_MEMORY } mm_tl_kind;
typedef struct mm_tl_rec {
    mm_tl_kind kind;
    int chunk;
    int ev0, ev1;        /* indices into the pool; ev1 < 0 for instants */
    double value;
    char name[48];
} mm_tl_rec;
typedef struct mm_timeline {
    FILE *f;
    td_event **events;
    int n_events, used;
    mm_tl_rec *recs;
    int n_recs, cap_recs;
    int open_ranges[16], n_open;
    int base;            /* event at the step's start */
    double t0_ms, step_offset_ms;
    uint64_t dropped;
    char host_tracks[TD_TIMELINE_HOST_TRACKS][32]; /* tids 3, 4, ...: named on first use */
    int n_host_tracks;
    int wrote_any;
} mm_timeline;

/* Load timing of the warm-up, for the prefetch window. */
#define MM_MEASURE_LOADS 32
typedef struct mm_measure {
    td_event *ev[2 * MM_MEASURE_LOADS];
    size_t bytes[MM_MEASURE_LOADS];
    int n;
    td_event *step_ev[2];
    double load_ms_per_mib, step_ms;
} mm_measure;

struct td_memmgr {
    td_arena *arena;
    td_hostpool *pool;
    td_hostmem *hostmem;        /* pageable host copies */
    int own_hostmem;            /* made by the manager (params.hostmem was NULL) */
    td_copy_engine *engine;
    td_backend *backend;
    td_memmgr_params params;

    mm_tensor *tensors;
    int n_tensors, cap_tensors;
    mm_chunk *chunks;
    int n_chunks;
    int laid_out;
    size_t chunk_numel, padding_bytes;
    int role_first[TD_TENSOR_ROLE_COUNT], role_count[TD_TENSOR_ROLE_COUNT];
    size_t (*role_bytes[TD_TENSOR_ROLE_COUNT])(size_t numel, void *ctx); /* opaque formats, or NULL */
    void *role_ctx[TD_TENSOR_ROLE_COUNT];
    uint8_t *optim_homes;        /* td_memmgr_set_optim_homes: optimizer chunk i on the device; NULL: by policy */
    int n_optim_homes;

    mm_pool *pools;
    int n_pools;
    td_copy_ticket trim_fence;  /* fresh slots were someone's spare: wait for this */

    /* Steps, tracer and plan. */
    int in_step, warmed_up;
    uint64_t step, pos;         /* pos: global access position */
    uint32_t *trace_seq;        /* warm-up access sequence */
    uint8_t *trace_write;
    uint64_t *trace_nonmodel;
    uint64_t *trace_nm_peak;    /* peak non-model bytes since the previous access */
    size_t nm_peak_since;
    size_t trace_len, trace_cap;
    size_t min_budget;
    td_nextuse *nextuse;
    td_evictor *evictor;
    int off_trace;              /* this step left the recorded sequence */
    int prefetch_window;

    td_memmgr_stats stats;
    double comm_wait_ms;        /* host waits for copies behind collectives (wait_ticket) */
    td_memmgr_stats step_start;  /* stats at the current step's start */
    td_memmgr_stats last_step;   /* the last finished step's deltas */
    size_t last_step_peak[TD_ROLE_COUNT], last_step_peak_total, peak_total;
    mm_timeline *tl;
    mm_measure measure;

    /* Transient grads (params.grad_slots): the staging slots.  A slot is
     * FREE, HELD by its owner chunk, or LENT to a consumer (peeked), who
     * frees it from its own thread (td_memmgr_grad_consumed); `owner`
     * stays set on a freed slot until the next write-back takes it, so the
     * owner learns that its host copy is gone (host_of). */
    struct mm_gslot { void *buf; int owner; int state; } *gslots;
    int n_gslots;
    size_t gslot_bytes;
    int gplan_valid, gplan_n;   /* planning: the slots the homes so far give (plan_gslots), cached */
    size_t gplan_bytes;
    pthread_mutex_t gslot_lock;
    pthread_cond_t gslot_freed;
    int gslot_sync;             /* lock and condition made */
    mm_disk *disk;              /* the disk tier, when a chunk is homed on disk */
    char **disk_dirs;           /* params.disk_dirs, copied */
};
enum { MM_GSLOT_FREE, MM_GSLOT_HELD, MM_GSLOT_LENT };

/* layout.c */
td_status mm_layout(td_memmgr *m);
/* Bytes from the start of a tensor's chunk to the tensor (0 in opaque formats). */
size_t mm_tensor_byte_offset(const td_memmgr *m, const mm_tensor *t);
static inline int mm_is_optim_role(td_tensor_role r)
{
    return r == TD_TENSOR_MASTER || r == TD_TENSOR_ADAM_M || r == TD_TENSOR_ADAM_V;
}

/* disk.c */
/* The disk chunks' place in the scratch file, the file, the engine and the
 * slot pools (at td_memmgr_layout, when a chunk is homed on disk). */
td_status mm_disk_setup(td_memmgr *m);
void mm_disk_free(td_memmgr *m);
/* A host access to disk chunk ch (the driving thread): its slot (read if
 * need be; for a write, made dirty), kept until MM_DISK_HOLDS later host
 * accesses have gone to other disk chunks. */
td_status mm_disk_host_access(td_memmgr *m, mm_chunk *ch, unsigned flags, void **host);
/* A device copy of a disk chunk (param or grad), on the driving thread:
 * begin gives the slot to copy from (into = 0: an upload, its bytes read
 * first) or into (into = 1: a write-back, all of it overwritten); end says
 * the copy was submitted (ticket), which keeps the slot until it lands (a
 * write-back's slot then becomes dirty and is written), or not (NULL). */
td_status mm_disk_copy_begin(td_memmgr *m, mm_chunk *ch, int into, void **host);
void mm_disk_copy_end(td_memmgr *m, mm_chunk *ch, const td_copy_ticket *ticket);
/* Whether an upload of disk chunk ch would find its bytes read (no wait). */
int mm_disk_chunk_ready(td_memmgr *m, const mm_chunk *ch);
/* Reads ahead while the driving thread works (td_memmgr_access calls it). */
void mm_disk_pump(td_memmgr *m);
/* The slots host accesses kept let go (their writes start). */
void mm_disk_release_held(td_memmgr *m);
/* Disk chunk ch holds no payload now (all its tensors FREE): a slot that
 * nobody uses gives its bytes up unwritten. */
void mm_disk_discard(td_memmgr *m, mm_chunk *ch);

/* timeline.c: all no-ops when no timeline is open. */
void mm_tl_copy_events(td_memmgr *m, td_event **start, td_event **end, int *index);
void mm_tl_copy(td_memmgr *m, mm_tl_kind kind, int chunk, int index);
void mm_tl_instant(td_memmgr *m, mm_tl_kind kind, int chunk, double value);
td_status mm_tl_step_begin(td_memmgr *m);
td_status mm_tl_step_end(td_memmgr *m);
void mm_tl_close(td_memmgr *m);

#endif
