/* Machine topology (hwloc): where the GPU sits, which cores and NUMA node
 * are nearest to it, and placement of memory and threads there.
 *
 * With the cuda backend the GPU's PCI bus id locates its non-I/O ancestor
 * in the hwloc tree; its cpuset and nodeset become "local".  With the cpu
 * backend (or when the GPU cannot be located) the whole machine is local.
 * Pinned slabs are allocated bound to the local NUMA node(s) before they are
 * pinned, so their pages land there; worker threads that touch host memory
 * (the CPU AdamW team, copy workers) bind to the local cores.
 * Thread-safety: after creation, bind and describe calls are thread-safe;
 * td_topo_alloc / td_topo_free calls must be serialised by the caller (the
 * pinned pool does so under its lock). */
#ifndef TIDAL_TOPO_H
#define TIDAL_TOPO_H

#include <stddef.h>

#include "tidal/backend.h"
#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_topo td_topo;

td_status td_topo_create(td_backend *b, td_topo **out);
void td_topo_destroy(td_topo *t);

/* e.g. "NUMA node 0 (16 cores, cpus 0-15) nearest GPU 0000:3b:00.0". */
const char *td_topo_describe(const td_topo *t);
int td_topo_local_cores(const td_topo *t);   /* physical cores in the local set */
int td_topo_numa_nodes(const td_topo *t);    /* NUMA nodes on the machine */

/* Several processes near one NUMA node set (ranks of a job on one host):
 * this one's share, slice `index` of `count` of the local cores (at least
 * one core each), so that their AdamW teams do not share cores; memory
 * stays bound to the same nodes.  count <= 1: nothing changes. */
td_status td_topo_share(td_topo *t, int index, int count);
/* The local NUMA nodes as a list ("0", "0-1"), e.g. to find the processes
 * that share them. */
void td_topo_nodes_string(const td_topo *t, char *buf, size_t buf_bytes);

/* Binds the calling thread to the local cores.  Best effort: on a machine
 * that refuses binding, returns TD_ERR_UNSUPPORTED with the reason. */
td_status td_topo_bind_thread(td_topo *t);
/* Binds thread `index` of a team of `count` to one local core (round robin)
 * so that a static partition of work stays with its first-touched pages. */
td_status td_topo_bind_thread_to_core(td_topo *t, int index, int count);

/* Page-aligned memory bound to the local NUMA node(s); falls back to plain
 * anonymous pages where binding is refused (recorded in the description).
 * Not pinned: see hostpool.h.  NULL + message on failure. */
void *td_topo_alloc(td_topo *t, size_t bytes);
void td_topo_free(td_topo *t, void *ptr, size_t bytes);

#ifdef __cplusplus
}
#endif
#endif
