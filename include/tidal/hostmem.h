/* Pageable host memory for what only the CPU touches, and the process's
 * host footprint measured.
 *
 * The fp32 master, m and v of a chunk whose optimizer runs on the CPU never
 * cross PCIe, so they need not be pinned (pinned memory is locked, cannot be
 * swapped or compacted, and the pin limit caps it).  td_hostmem hands out
 * such buffers: one anonymous mapping each, page-rounded, bound to the NUMA
 * node(s) of the topology's local set (where the CPU AdamW team runs,
 * topo.h) and advised to use transparent huge pages where the kernel offers
 * them.  Pages are zero and untouched until first written, so the first
 * touch (and with it the page's node inside the local set) is the AdamW
 * thread's that updates it (td_adam_cpu_init, or its first update).
 * Bytes are counted per role (alloc.h), with the peak; every allocation is
 * a fallible host allocation for the fault tests (TD_FAULT_HOST_ALLOC).
 *
 * td_host_heap_stats measures the whole process heap: jemalloc's
 * stats.allocated and stats.resident when tidal is linked with jemalloc
 * (the Makefile links it when jemalloc.h is found, except in sanitizer
 * builds), else glibc's mallinfo2 (in use; resident = in use + free in
 * arenas; in ASan builds, ASan's allocator statistics), and says which.
 * Thread-safety: all calls are thread-safe (one mutex per allocator). */
#ifndef TIDAL_HOSTMEM_H
#define TIDAL_HOSTMEM_H

#include <stddef.h>

#include "tidal/alloc.h"
#include "tidal/status.h"
#include "tidal/topo.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_hostmem td_hostmem;

typedef struct td_hostmem_stats {
    size_t used_bytes, peak_bytes;                 /* page-rounded bytes of live buffers */
    size_t used[TD_ROLE_COUNT], peak[TD_ROLE_COUNT];
    int live_blocks;
    int huge_pages;                                /* 1 when transparent huge pages were advised */
} td_hostmem_stats;

/* `topo` may be NULL: plain anonymous pages, no NUMA binding. */
td_status td_hostmem_create(td_topo *topo, td_hostmem **out);
/* Unmaps every buffer still live. */
void td_hostmem_destroy(td_hostmem *h);

/* Zeroed, page-aligned, `bytes` rounded up to the page size. */
td_status td_hostmem_alloc(td_hostmem *h, size_t bytes, td_role role, void **ptr);
td_status td_hostmem_release(td_hostmem *h, void *ptr);   /* NULL is a no-op */
/* The bytes an allocation of `bytes` takes (the page rounding), for plans. */
size_t td_hostmem_round(size_t bytes);

void td_hostmem_get_stats(td_hostmem *h, td_hostmem_stats *out);

/* ---- the process heap -------------------------------------------------------- */

typedef struct td_heap_stats {
    size_t allocated_bytes;  /* in live malloc blocks */
    size_t resident_bytes;   /* the heap's resident pages (jemalloc), or in use + free in arenas */
    const char *source;      /* "jemalloc" or "mallinfo2" */
} td_heap_stats;

td_status td_host_heap_stats(td_heap_stats *out);
/* "jemalloc" when linked with it, else "mallinfo2 (tidal built without jemalloc)". */
const char *td_host_heap_source(void);

/* ---- the machine's RAM --------------------------------------------------------- */

/* The host memory this process may use: MemTotal of /proc/meminfo, lowered
 * to the cgroup's limit when one is set (v2 memory.max, v1
 * memory.limit_in_bytes), because some virtual machines grow MemTotal as
 * memory is used while the cgroup holds the real cap.  `source` (at least
 * 96 bytes) says which figure was used. */
td_status td_host_ram(size_t *bytes, char *source, size_t source_bytes);
/* This process's resident memory now and at its most (VmRSS and VmHWM of
 * /proc/self/status): everything it holds, the CUDA driver's and the
 * libraries' own pages included, which the plan does not itemize. */
td_status td_host_rss(size_t *now, size_t *peak);
/* The same from given texts (tests): meminfo's contents, and the cgroup
 * limit file's (NULL or "max": none). */
td_status td_host_ram_parse(const char *meminfo, const char *cgroup_limit, const char *cgroup_name,
                            size_t *bytes, char *source, size_t source_bytes);

#ifdef __cplusplus
}
#endif
#endif
