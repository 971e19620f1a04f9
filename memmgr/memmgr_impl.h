/* Private: the chunk manager's structures, shared by layout.c and memmgr.c. */
#ifndef TIDAL_MEMMGR_IMPL_H
#define TIDAL_MEMMGR_IMPL_H

#include "tidal/memmgr.h"
#include "tidal/trace.h"

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
    size_t numel, bytes;        /* capacity */
    int *tensors, n_tensors;
    int n_free;                 /* tensors in FREE */
    int pins;                   /* tensors in COMPUTE */
    td_chunk_home home;
    void *host;                 /* pinned, always */
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
} mm_chunk;

struct td_memmgr {
    td_arena *arena;
    td_hostpool *pool;
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

    mm_pool *pools;
    int n_pools;
    td_copy_ticket trim_fence;  /* fresh slots were someone's spare: wait for this */

    /* Steps, tracer and plan. */
    int in_step, warmed_up;
    uint64_t step, pos;         /* pos: global access position */
    uint32_t *trace_seq;        /* warm-up access sequence */
    uint8_t *trace_write;
    uint64_t *trace_nonmodel;
    size_t trace_len, trace_cap;
    size_t min_budget;
    td_nextuse *nextuse;
    td_evictor *evictor;
    int off_trace;              /* this step left the recorded sequence */
    int prefetch_window;

    td_memmgr_stats stats;
};

/* layout.c */
td_status mm_layout(td_memmgr *m);

#endif
