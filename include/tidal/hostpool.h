/* The pinned host pool: page-locked host memory for chunks and staging.
 *
 * Pinning is slow (it walks and locks every page) and pinned memory is a
 * scarce, system-wide resource, so tidal pins in large slabs, once, and
 * sub-allocates inside them; no tensor is ever pinned by itself.  A slab is
 * mapped on the NUMA node nearest the GPU (topo.h), then registered with the
 * backend (cudaHostRegister on cuda).  Inside a slab the same best-fit,
 * coalescing range allocator as the device arena hands out 4 KiB-aligned
 * blocks.  Why not a jemalloc arena on pinned extents: tidal's pinned
 * allocations are few and large (chunks of MiBs, staging buffers), made
 * before the first step and kept; jemalloc's strengths (size classes, thread
 * caches for small objects) buy nothing here, and Debian's jemalloc replaces
 * the process's malloc as a side effect.  See docs/architecture.md.
 * Bytes are counted per role (alloc.h) as held by live blocks, rounded to
 * 4 KiB; `pinned_bytes` is the slabs' total.  When a new slab would pass
 * the pin limit, or the OS refuses to pin, the error says how much is
 * pinned and which limit was hit.
 * Thread-safety: all calls are thread-safe (one mutex per pool). */
#ifndef TIDAL_HOSTPOOL_H
#define TIDAL_HOSTPOOL_H

#include <stddef.h>

#include "tidal/alloc.h"
#include "tidal/backend.h"
#include "tidal/status.h"
#include "tidal/topo.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TD_HOSTPOOL_ALIGN 4096
#define TD_HOSTPOOL_SLAB_GRAIN ((size_t)2 << 20) /* slab sizes are rounded up to whole huge pages */

typedef struct td_hostpool td_hostpool;

typedef struct td_hostpool_params {
    size_t slab_bytes;       /* default 256 MiB; a larger request gets its own slab */
    size_t pin_limit_bytes;  /* default 0: 80% of physical RAM */
} td_hostpool_params;

typedef struct td_hostpool_stats {
    size_t pinned_bytes, limit_bytes;
    size_t used_bytes, peak_bytes;
    size_t used[TD_ROLE_COUNT], peak[TD_ROLE_COUNT];
    int slabs, live_blocks;
} td_hostpool_stats;

td_hostpool_params td_hostpool_default_params(void);

/* `topo` may be NULL (no NUMA placement).  Pins nothing until the first alloc.
 * With `b` NULL, a planning pool: it maps and pins nothing and hands out
 * addresses that must never be dereferenced, but places blocks in slabs
 * exactly as a real pool with the same params would, so its pinned_bytes
 * after a sequence of allocations is what that sequence pins (`tidal
 * plan`'s host.pinned_bytes); its pin limit defaults to no limit. */
td_status td_hostpool_create(td_backend *b, td_topo *topo, const td_hostpool_params *params, td_hostpool **out);
/* Unpins and unmaps every slab; all blocks must have been released. */
void td_hostpool_destroy(td_hostpool *p);

td_status td_hostpool_alloc(td_hostpool *p, size_t bytes, td_role role, void **ptr);
td_status td_hostpool_release(td_hostpool *p, void *ptr);   /* NULL is a no-op */
/* Unpins slabs that hold no block; returns the bytes unpinned. */
size_t td_hostpool_trim(td_hostpool *p);

void td_hostpool_get_stats(td_hostpool *p, td_hostpool_stats *out);

#ifdef __cplusplus
}
#endif
#endif
