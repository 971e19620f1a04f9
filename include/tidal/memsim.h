/* The offline memory simulator: replays a chunk access trace (trace.h) under
 * a device budget with an eviction policy (policy.h) and counts what moves.
 *
 * Model (docs/memory-manager.md, "Trace format and the simulator"):
 *  - Chunks start host-only and clean.  An access needs its chunk resident:
 *    if it is not, it is loaded on demand (a stall).  `access .. w` leaves
 *    the device copy dirty; evicting a dirty chunk writes it back (D2H)
 *    first, after which it is clean; evicting a clean one is free.
 *  - At every moment, resident chunk bytes + live non-model bytes <= budget.
 *    Room is made by evicting the policy's victims.  A `nonmodel` line over
 *    the budget, or an access whose chunk plus the non-model bytes exceed
 *    it, is an error naming that line (TD_ERR_BUDGET).
 *  - It is a planner: the policy sees the whole trace.  Belady's "next use"
 *    wraps past the end into the last step (td_trace_period_start).
 *  - Prefetch N: after serving access i, loads for the accesses i+1..i+N are
 *    issued in order, each only if it fits the budget from now until its
 *    use (against the most non-model bytes live in between), evicting only
 *    chunks whose next use comes after it; else issuing stops until the next
 *    access.  Each prefetched chunk is later a prefetch hit, or wasted if it
 *    was evicted before its use.  The model has no clock: a stall is a demand
 *    load, whatever its size.
 * The simulator reports every move through an optional callback, so tests
 * (and `tidal memsim --log`) can replay and check the schedule.
 *
 * Ownership: the simulator borrows the trace and allocates only for the
 * duration of td_memsim_run.  Thread-safety: reentrant. */
#ifndef TIDAL_MEMSIM_H
#define TIDAL_MEMSIM_H

#include <stdint.h>

#include "tidal/policy.h"
#include "tidal/status.h"
#include "tidal/trace.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum td_memsim_event_kind {
    TD_MEMSIM_LOAD,     /* chunk copied host -> device (prefetch: ahead of need) */
    TD_MEMSIM_EVICT,    /* chunk dropped from the device (writeback: copied back first) */
    TD_MEMSIM_ACCESS,   /* the trace's access, served with its chunk resident */
    TD_MEMSIM_NONMODEL, /* live non-model bytes changed to `bytes` */
    TD_MEMSIM_STEP,     /* a step line */
} td_memsim_event_kind;

typedef struct td_memsim_event {
    td_memsim_event_kind kind;
    uint32_t chunk;        /* LOAD, EVICT, ACCESS */
    uint32_t line;         /* trace line of the item being served */
    uint64_t pos;          /* index of the access being served (LOAD, EVICT, ACCESS) or next (others) */
    uint64_t target;       /* LOAD with prefetch: the access it is for; else pos */
    uint64_t bytes;        /* chunk bytes, or the new non-model bytes */
    uint64_t device_bytes; /* resident chunk bytes + non-model bytes after the event */
    uint8_t prefetch;      /* LOAD issued ahead of need */
    uint8_t writeback;     /* EVICT of a dirty chunk */
    uint8_t write;         /* ACCESS w */
} td_memsim_event;

typedef void (*td_memsim_event_fn)(void *ctx, const td_memsim_event *ev);

typedef struct td_memsim_params {
    uint64_t budget_bytes;
    td_evict_policy policy;     /* default belady */
    uint32_t prefetch;          /* lookahead in accesses; 0: demand loads only (default) */
    td_memsim_event_fn on_event; /* optional, called for every event in order */
    void *ctx;
} td_memsim_params;

td_memsim_params td_memsim_default_params(void);

typedef struct td_memsim_counts {
    uint64_t accesses;
    uint64_t loads;           /* H2D transfers = demand_loads + prefetch_loads */
    uint64_t demand_loads;    /* stalls: the access waited for its chunk */
    uint64_t prefetch_loads;
    uint64_t prefetch_hits;   /* accesses served by a prefetched chunk */
    uint64_t prefetch_wasted; /* prefetched chunks evicted before their use */
    uint64_t evictions;
    uint64_t writebacks;      /* D2H transfers: evictions of dirty chunks */
    uint64_t bytes_h2d, bytes_d2h;
} td_memsim_counts;

typedef struct td_memsim_result {
    td_memsim_counts total;
    /* The steady state: from the last step line followed by an access to the
     * end (all zero when the trace has no step line). */
    td_memsim_counts last_step;
    uint64_t steps, chunks;
    uint64_t peak_device_bytes;   /* max over time of resident chunk + non-model bytes */
    uint64_t peak_chunk_bytes, peak_nonmodel_bytes;
    uint64_t compulsory_loads;    /* distinct chunks accessed: no policy loads fewer */
    uint64_t dirtyings;           /* clean -> dirty transitions of device copies */
    uint64_t resident_end, resident_bytes_end;
    uint64_t dirty_end;           /* still dirty on the device at the end (never written back) */
} td_memsim_result;

/* Runs the simulation.  Errors: TD_ERR_BUDGET for a trace that cannot fit
 * (the message names the trace line and the budget it would need),
 * TD_ERR_INVALID for bad parameters, TD_ERR_NOMEM. */
td_status td_memsim_run(const td_trace *t, const td_memsim_params *p, td_memsim_result *out);

/* The smallest budget the trace runs under (max over accesses of chunk bytes
 * + non-model bytes, and over non-model lines): what the error asks for. */
uint64_t td_memsim_min_budget(const td_trace *t);

#ifdef __cplusplus
}
#endif
#endif
