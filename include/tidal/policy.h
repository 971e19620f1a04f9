/* Eviction policies: which resident chunk to give up when room is needed.
 *
 * Two objects, shared by the offline simulator (memsim.h) and the live chunk
 * manager, so that what `tidal memsim` predicts is what a run does:
 *
 *  - td_nextuse: the next-use table of an access sequence, built once.  The
 *    sequence is periodic: after its last access it repeats accesses
 *    [period_start, n) forever.  The live manager passes one recorded step
 *    with period_start = 0 (every step repeats the warm-up step); the
 *    simulator passes the whole trace with period_start at its last step, so
 *    "next use" wraps into the next step.  Positions are global and keep
 *    counting past n (step k of a live run starts at k * n).
 *
 *  - td_evictor: the set of evictable chunks (resident, not pinned) ranked
 *    by the policy.  The caller reports what it knows about each candidate
 *    (last use, next use, dirty) and asks for victims:
 *      lru    the least recently used first;
 *      belady the furthest next use first (never used again counts as
 *             furthest), and at equal next use a clean chunk before a dirty
 *             one (a clean chunk's host copy is valid: evicting it is free),
 *             then the lower id.
 *    With the wrapped next use, two candidates tie only when neither is used
 *    again at all.  Both policies honour `min_next_use`: a chunk whose next
 *    use comes before it is not a victim (a prefetch for position j passes
 *    j + 1 so it never evicts what is needed before j).
 *
 * On uniform-size chunks, Belady with these next uses gives the minimum
 * number of loads for the trace (it is Belady's MIN: the wrapped next uses of
 * chunks not used again within the trace all lie past its end, so the order
 * of the uses within the trace is unchanged).  With mixed sizes it is the
 * usual heuristic (evict furthest first until the new chunk fits).
 *
 * Ownership: both objects own their arrays (TD_ROLE_META).
 * Thread-safety: none inside an object; the caller serializes. */
#ifndef TIDAL_POLICY_H
#define TIDAL_POLICY_H

#include <stddef.h>
#include <stdint.h>

#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum td_evict_policy {
    TD_EVICT_LRU,
    TD_EVICT_BELADY,
    TD_EVICT_POLICY_COUNT
} td_evict_policy;

const char *td_evict_policy_name(td_evict_policy p); /* "lru", "belady" */
td_status td_evict_policy_parse(const char *name, td_evict_policy *out);

/* ---- next-use table ---------------------------------------------------- */

#define TD_NEXTUSE_NEVER UINT64_MAX

typedef struct td_nextuse td_nextuse;

/* seq[0..n) are chunk ids < n_chunks (copied); period_start <= n (n: no
 * period, nothing is used after the end).  O(n + n_chunks) time and memory. */
td_status td_nextuse_create(const uint32_t *seq, size_t n, uint32_t n_chunks, size_t period_start,
                            td_nextuse **out);
void td_nextuse_destroy(td_nextuse *t); /* NULL is a no-op */

size_t td_nextuse_length(const td_nextuse *t);       /* n */
size_t td_nextuse_period_start(const td_nextuse *t);
/* Whether `pos` is an access: pos < n, or any pos when there is a period. */
int td_nextuse_valid(const td_nextuse *t, uint64_t pos);
/* The chunk accessed at `pos` (which must be valid). */
uint32_t td_nextuse_chunk_at(const td_nextuse *t, uint64_t pos);
/* The next access to the chunk accessed at `pos`, after pos; NEVER if none.
 * O(1). */
uint64_t td_nextuse_after(const td_nextuse *t, uint64_t pos);
/* The first access to `chunk` at a position >= pos; NEVER if none.
 * O(log uses of chunk). */
uint64_t td_nextuse_of(const td_nextuse *t, uint32_t chunk, uint64_t pos);

/* ---- evictor ----------------------------------------------------------- */

typedef struct td_evictor td_evictor;

/* chunk_bytes[n_chunks] (copied) sizes the victims in td_evictor_make_room. */
td_status td_evictor_create(td_evict_policy policy, uint32_t n_chunks, const uint64_t *chunk_bytes,
                            td_evictor **out);
void td_evictor_destroy(td_evictor *e); /* NULL is a no-op */
td_evict_policy td_evictor_policy(const td_evictor *e);

/* Makes `chunk` a candidate, or updates it.  last_use: the position of its
 * latest access (or of its load, for a prefetched chunk); it must not go
 * back in time.  next_use: its next access (TD_NEXTUSE_NEVER if none).
 * dirty: the device copy is newer than the host copy. */
td_status td_evictor_update(td_evictor *e, uint32_t chunk, uint64_t last_use, uint64_t next_use, int dirty);
/* No longer a candidate (evicted, or pinned by an access in progress).
 * A chunk that is not a candidate is a no-op. */
void td_evictor_remove(td_evictor *e, uint32_t chunk);

int td_evictor_contains(const td_evictor *e, uint32_t chunk);
uint32_t td_evictor_count(const td_evictor *e);
uint64_t td_evictor_bytes(const td_evictor *e);          /* bytes of all candidates */
/* What was last reported for `chunk` (also after it was removed). */
uint64_t td_evictor_next_use(const td_evictor *e, uint32_t chunk);
int td_evictor_dirty(const td_evictor *e, uint32_t chunk);

/* The policy's first victim among candidates whose next use is >= min_next_use
 * (0: any), or -1 if there is none.  Does not remove it. */
int64_t td_evictor_pick(const td_evictor *e, uint64_t min_next_use);
/* Bytes of candidates with next use >= min_next_use, counting stops once it
 * reaches `enough` (so the cost is bounded by the victims needed plus the
 * candidates skipped). */
uint64_t td_evictor_freeable(const td_evictor *e, uint64_t min_next_use, uint64_t enough);

/* The planner's step: picks victims in policy order until need_bytes fit in
 * free_bytes plus the victims' bytes, removes them from the candidates and
 * writes them to victims[] (capacity: the candidate count suffices).  If the
 * eligible candidates cannot free enough, nothing is removed and the result
 * is TD_ERR_BUDGET (a hot loop that expects refusals, such as a prefetcher,
 * asks td_evictor_freeable first).  The caller moves the bytes (writing back
 * the dirty victims). */
td_status td_evictor_make_room(td_evictor *e, uint64_t need_bytes, uint64_t free_bytes, uint64_t min_next_use,
                               uint32_t *victims, uint32_t *n_victims);

/* ---- optimizer placement ------------------------------------------------ */

/* The optimizer chunks in the order to keep them on the GPU: the least CPU
 * slack first.  Chunk k's grads are complete at position ready[k] of a step
 * of `period` accesses and the next step first needs its new params at
 * position need[k]; a CPU optimizer has (period - ready[k]) + need[k]
 * accesses to update it without holding up the next forward (the chunks
 * the next forward needs first — the embedding, the first blocks — have
 * the least).  Ties: the lower index.  order: n indices. */
void td_optim_order_by_slack(int n, const uint64_t *ready, const uint64_t *need, uint64_t period, int *order);

#ifdef __cplusplus
}
#endif
#endif
