/* The copy engine: asynchronous host<->device transfers for the memory manager.
 *
 * H2D and D2H copies run on their own backend queues, so loads, write-backs
 * and compute overlap.  A submit returns a ticket (an event recorded after
 * the copy); the caller waits on it, polls it, or orders another queue after
 * it without blocking the host.  Large copies are issued as chunk-sized
 * pieces (default 64 MiB) so that two directions interleave fairly.
 * Events come from a fixed ring per queue, created with the engine: no
 * submit allocates.  A ticket stays valid until its ring slot is reused
 * (`events_per_queue` records later on the same queue); reuse first waits
 * for the old event, so a stale ticket always reads as complete.
 * Thread-safety: submits and marks on one queue are serialised by a mutex
 * per queue; any thread may wait on or query a ticket. */
#ifndef TIDAL_COPY_H
#define TIDAL_COPY_H

#include <stddef.h>
#include <stdint.h>

#include "tidal/backend.h"
#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_copy_engine td_copy_engine;

typedef enum td_copy_dir { TD_COPY_H2D, TD_COPY_D2H, TD_COPY_DIR_COUNT } td_copy_dir;

/* A point on a queue.  Zero-initialised = "nothing": complete at once. */
typedef struct td_copy_ticket {
    uint64_t seq;     /* 0: none */
    uint32_t queue;
    uint32_t slot;
} td_copy_ticket;

typedef struct td_copy_params {
    size_t chunk_bytes;       /* piece size of large copies; default 64 MiB */
    int events_per_queue;     /* ticket ring size; default 256 */
} td_copy_params;

typedef struct td_copy_stats {
    uint64_t bytes[TD_COPY_DIR_COUNT];
    uint64_t copies[TD_COPY_DIR_COUNT];
    uint64_t host_waits;      /* td_copy_wait calls that found the copy unfinished */
    double host_wait_ms;      /* time the host spent in those waits */
} td_copy_stats;

td_copy_params td_copy_default_params(void);
td_status td_copy_engine_create(td_backend *b, const td_copy_params *params, td_copy_engine **out);
/* Waits for every copy in flight, then frees the events. */
void td_copy_engine_destroy(td_copy_engine *e);

/* Copies `bytes` from src to dst in direction `dir`; the copy starts only
 * after `after` (may be NULL or empty), e.g. the compute mark of the kernel
 * that produced a gradient.  `out` (may be NULL) gets the ticket. */
td_status td_copy_submit(td_copy_engine *e, td_copy_dir dir, void *dst, const void *src, size_t bytes,
                         const td_copy_ticket *after, td_copy_ticket *out);
/* The same, also recording the caller's events `start` (after the wait on
 * `after`, before the copy) and `end` (after it), for timelines and
 * bandwidth measurement; either may be NULL. */
td_status td_copy_submit_timed(td_copy_engine *e, td_copy_dir dir, void *dst, const void *src, size_t bytes,
                               const td_copy_ticket *after, td_event *start, td_event *end, td_copy_ticket *out);
/* A ticket for everything submitted to queue q so far (e.g. compute). */
td_status td_copy_mark(td_copy_engine *e, td_queue q, td_copy_ticket *out);
/* Queue q waits for the ticket without blocking the host. */
td_status td_copy_order(td_copy_engine *e, td_queue q, const td_copy_ticket *t);
/* The host waits for the ticket; counted in the stats when it had to wait. */
td_status td_copy_wait(td_copy_engine *e, const td_copy_ticket *t);
td_status td_copy_done(td_copy_engine *e, const td_copy_ticket *t, int *done);
/* Waits for everything on the copy queues. */
td_status td_copy_drain(td_copy_engine *e);

void td_copy_get_stats(td_copy_engine *e, td_copy_stats *out);
td_backend *td_copy_backend(td_copy_engine *e);

#ifdef __cplusplus
}
#endif
#endif
