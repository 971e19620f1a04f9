/* The device arena: the only way tidal obtains device memory.
 *
 * One reservation of exactly the budget (--gpu-budget) is taken from the
 * backend at creation; everything else is sub-allocated inside it, so the
 * budget is a hard cap by construction and `peak` is exact.  Two kinds of
 * sub-allocation share the region:
 *   - variable buffers (activations, workspace, communication): best fit
 *     with coalescing, 256-byte aligned, growing up from the bottom;
 *   - fixed-size chunk slots (td_slot_pool): carved from the top, cached
 *     when released so that steady-state chunk traffic allocates nothing.
 * Bytes are counted per role (alloc.h's td_role) as held by the arena: an
 * allocation counts its size rounded up to 256 bytes; a slot pool counts
 * every slot it has carved, in use or cached, until trimmed.
 * A request that does not fit fails with TD_ERR_BUDGET and a message naming
 * the size, the role and what holds the arena; there is never a fallback to
 * managed or host memory.
 * Thread-safety: all calls are thread-safe (one mutex per arena). */
#ifndef TIDAL_ARENA_H
#define TIDAL_ARENA_H

#include <stddef.h>

#include "tidal/alloc.h"
#include "tidal/backend.h"
#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TD_ARENA_ALIGN 256

typedef struct td_arena td_arena;
typedef struct td_slot_pool td_slot_pool;

typedef struct td_arena_stats {
    size_t budget_bytes;           /* the reservation */
    size_t used_bytes, peak_bytes; /* all roles */
    size_t used[TD_ROLE_COUNT], peak[TD_ROLE_COUNT];
    size_t free_bytes, largest_free_bytes;
    int free_blocks, live_blocks;
} td_arena_stats;

/* Reserves exactly budget_bytes (at least TD_ARENA_ALIGN; 0 is refused:
 * the arena has no default, the trainer decides one with
 * td_train_budget_resolve). */
td_status td_arena_create(td_backend *b, size_t budget_bytes, td_arena **out);
/* Releases the reservation and with it every buffer still carved from it
 * (their pointers die too); slot pools must be destroyed first. */
void td_arena_destroy(td_arena *a);

td_status td_arena_alloc(td_arena *a, size_t bytes, td_role role, void **ptr);
/* NULL is a no-op; a pointer the arena did not hand out is an error. */
td_status td_arena_release(td_arena *a, void *ptr);

void td_arena_get_stats(td_arena *a, td_arena_stats *out);
/* Starts a new peak window (peak := used), e.g. per step. */
void td_arena_reset_peak(td_arena *a);
/* One line per role with bytes held and peak, for messages and `tidal plan`. */
void td_arena_describe(td_arena *a, char *buf, size_t buf_bytes);
void *td_arena_base(td_arena *a);
td_backend *td_arena_backend(td_arena *a);

/* Fixed-size slots (chunks).  slot_bytes is rounded up to TD_ARENA_ALIGN. */
td_status td_slot_pool_create(td_arena *a, size_t slot_bytes, td_role role, td_slot_pool **out);
/* Returns every slot to the arena; all must have been released. */
void td_slot_pool_destroy(td_slot_pool *p);
/* A cached slot, else a new one carved from the arena (TD_ERR_BUDGET if none fits). */
td_status td_slot_acquire(td_slot_pool *p, void **ptr);
void td_slot_release(td_slot_pool *p, void *ptr);
/* Gives cached slots back to the arena; returns the bytes given back. */
size_t td_slot_pool_trim(td_slot_pool *p);
size_t td_slot_pool_slot_bytes(const td_slot_pool *p);
int td_slot_pool_in_use(const td_slot_pool *p);
int td_slot_pool_held(const td_slot_pool *p); /* in use + cached */

#ifdef __cplusplus
}
#endif
#endif
