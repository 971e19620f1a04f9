/* Topology and NUMA placement with hwloc (see include/tidal/topo.h). */
#include "tidal/topo.h"
#include "tidal/alloc.h"
#include "tidal/util.h"

#include <hwloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct td_topo {
    hwloc_topology_t topology;
    hwloc_cpuset_t local_cpus;
    hwloc_nodeset_t local_nodes;
    int local_cores;
    int numa_nodes;
    int membind_refused;
    char description[256];
};

static void describe(td_topo *t, const char *gpu)
{
    char cpus[64], nodes[64];
    hwloc_bitmap_list_snprintf(cpus, sizeof cpus, t->local_cpus);
    hwloc_bitmap_list_snprintf(nodes, sizeof nodes, t->local_nodes);
    snprintf(t->description, sizeof t->description, "NUMA node%s %s of %d (%d cores, cpus %s)%s%s%s",
             hwloc_bitmap_weight(t->local_nodes) == 1 ? "" : "s", nodes, t->numa_nodes, t->local_cores, cpus,
             gpu ? " nearest GPU " : "", gpu ? gpu : "", t->membind_refused ? "; memory binding refused" : "");
}

/* The machine's topology, read once per process (PCI devices included, to
 * find a GPU's node) and copied for each td_topo: a discovery loads and
 * unloads hwloc's plugins (libxml2, PCI) each time, which cost more than a
 * small trainer's whole set-up.  Kept until the process ends. */
static hwloc_topology_t machine_topology;
static pthread_once_t machine_once = PTHREAD_ONCE_INIT;

static void machine_load(void)
{
    hwloc_topology_t m;
    if (hwloc_topology_init(&m) != 0) return;
    hwloc_topology_set_io_types_filter(m, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
    /* The GPU is found by its PCI bus id (the pci component): the vendors'
     * components would only name devices, and loading them starts their
     * runtimes (OpenCL's ICDs, CUDA, NVML, ROCm SMI, Level Zero, the X
     * server), whose heap and threads the process would keep. */
#if HWLOC_API_VERSION >= 0x00020100
    static const char *const skip[] = {"opencl", "gl", "cuda", "nvml", "rsmi", "levelzero"};
    for (size_t i = 0; i < sizeof skip / sizeof *skip; i++)
        hwloc_topology_set_components(m, HWLOC_TOPOLOGY_COMPONENTS_FLAG_BLACKLIST, skip[i]);
#else /* hwloc 2.0 has no per-topology list: its environment variable, unless the user set one */
    setenv("HWLOC_COMPONENTS", "-opencl,-gl,-cuda,-nvml,-rsmi,-levelzero", 0);
#endif
    if (hwloc_topology_load(m) != 0) {
        hwloc_topology_destroy(m);
        return;
    }
    machine_topology = m;
}

td_status td_topo_create(td_backend *b, td_topo **out)
{
    td_status st = TD_OK;
    char busid[32] = {0};
    int have_gpu = 0;
    *out = NULL;
    td_topo *t = td_calloc(1, sizeof *t, TD_ROLE_META);
    if (!t) return TD_ERR_NOMEM;
    pthread_once(&machine_once, machine_load);
    if (!machine_topology || hwloc_topology_dup(&t->topology, machine_topology) != 0) {
        td_free(t);
        return td_error_set(TD_ERR_BACKEND, "hwloc could not read the machine's topology");
    }
    if (b && td_backend_get_kind(b) == TD_BACKEND_CUDA && td_backend_pci_bus_id(b, busid, sizeof busid) == TD_OK)
        have_gpu = 1;
    hwloc_obj_t local = hwloc_get_root_obj(t->topology);
    if (have_gpu) {
        hwloc_obj_t pci = hwloc_get_pcidev_by_busidstring(t->topology, busid);
        hwloc_obj_t anc = pci ? hwloc_get_non_io_ancestor_obj(t->topology, pci) : NULL;
        if (anc && anc->cpuset && !hwloc_bitmap_iszero(anc->cpuset)) local = anc;
    }
    t->local_cpus = hwloc_bitmap_dup(local->cpuset);
    t->local_nodes = hwloc_bitmap_dup(local->nodeset);
    if (!t->local_cpus || !t->local_nodes) TD_FAIL(TD_ERR_NOMEM, "hwloc bitmap allocation failed");
    t->local_cores = hwloc_get_nbobjs_inside_cpuset_by_type(t->topology, t->local_cpus, HWLOC_OBJ_CORE);
    if (t->local_cores <= 0) t->local_cores = hwloc_bitmap_weight(t->local_cpus);
    t->numa_nodes = hwloc_get_nbobjs_by_type(t->topology, HWLOC_OBJ_NUMANODE);
    describe(t, have_gpu ? busid : NULL);
    *out = t;
    return TD_OK;
cleanup:
    td_topo_destroy(t);
    return st;
}

void td_topo_destroy(td_topo *t)
{
    if (!t) return;
    if (t->local_cpus) hwloc_bitmap_free(t->local_cpus);
    if (t->local_nodes) hwloc_bitmap_free(t->local_nodes);
    hwloc_topology_destroy(t->topology);
    td_free(t);
}

td_status td_topo_share(td_topo *t, int index, int count)
{
    if (count <= 1) return TD_OK;
    if (index < 0 || index >= count) return td_error_set(TD_ERR_INVALID, "topology: share %d of %d", index, count);
    int cores = hwloc_get_nbobjs_inside_cpuset_by_type(t->topology, t->local_cpus, HWLOC_OBJ_CORE);
    if (cores <= 0) return TD_OK; /* no core objects: the OS places the threads */
    int first = cores >= count ? index * cores / count : index % cores;
    int last = cores >= count ? (index + 1) * cores / count : first + 1;
    hwloc_cpuset_t set = hwloc_bitmap_alloc();
    if (!set) return td_error_set(TD_ERR_NOMEM, "hwloc bitmap allocation failed");
    for (int c = first; c < last; c++) {
        hwloc_obj_t core = hwloc_get_obj_inside_cpuset_by_type(t->topology, t->local_cpus, HWLOC_OBJ_CORE, (unsigned)c);
        if (core) hwloc_bitmap_or(set, set, core->cpuset);
    }
    if (hwloc_bitmap_iszero(set)) {
        hwloc_bitmap_free(set);
        return TD_OK;
    }
    hwloc_bitmap_free(t->local_cpus);
    t->local_cpus = set;
    t->local_cores = last - first;
    char *gpu = strstr(t->description, "nearest GPU "), busid[32] = {0};
    if (gpu) sscanf(gpu + 12, "%31[^;]", busid);
    describe(t, gpu ? busid : NULL);
    size_t len = strlen(t->description);
    snprintf(t->description + len, sizeof t->description - len, "; share %d of %d", index + 1, count);
    return TD_OK;
}

void td_topo_nodes_string(const td_topo *t, char *buf, size_t buf_bytes)
{
    hwloc_bitmap_list_snprintf(buf, buf_bytes, t->local_nodes);
}

const char *td_topo_describe(const td_topo *t) { return t->description; }
int td_topo_local_cores(const td_topo *t) { return t->local_cores; }
int td_topo_numa_nodes(const td_topo *t) { return t->numa_nodes; }

td_status td_topo_bind_thread(td_topo *t)
{
    if (hwloc_set_cpubind(t->topology, t->local_cpus, HWLOC_CPUBIND_THREAD) != 0)
        return td_error_set(TD_ERR_UNSUPPORTED, "binding a thread to the GPU-local cores was refused");
    return TD_OK;
}

td_status td_topo_bind_thread_to_core(td_topo *t, int index, int count)
{
    int cores = t->local_cores > 0 ? t->local_cores : 1;
    hwloc_obj_t core = hwloc_get_obj_inside_cpuset_by_type(t->topology, t->local_cpus, HWLOC_OBJ_CORE,
                                                            (unsigned)(index % cores));
    if (!core) return td_topo_bind_thread(t);
    (void)count;
    if (hwloc_set_cpubind(t->topology, core->cpuset, HWLOC_CPUBIND_THREAD) != 0)
        return td_error_set(TD_ERR_UNSUPPORTED, "binding thread %d to core %d was refused", index, index % cores);
    return TD_OK;
}

void *td_topo_alloc(td_topo *t, size_t bytes)
{
    void *p = NULL;
    if (!t->membind_refused)
        p = hwloc_alloc_membind(t->topology, bytes, t->local_nodes, HWLOC_MEMBIND_BIND, HWLOC_MEMBIND_BYNODESET);
    if (!p) {
        /* Containers may refuse mbind; placement then falls to first touch. */
        if (!t->membind_refused) {
            t->membind_refused = 1;
            char *gpu = strstr(t->description, "nearest GPU ");
            char busid[32] = {0};
            if (gpu) snprintf(busid, sizeof busid, "%.31s", gpu + 12);
            describe(t, gpu ? busid : NULL);
        }
        p = hwloc_alloc(t->topology, bytes);
    }
    if (!p) {
        char s[32];
        td_error_set(TD_ERR_NOMEM, "cannot map %s of host memory", td_format_bytes(bytes, s, sizeof s));
    }
    return p;
}

void td_topo_free(td_topo *t, void *ptr, size_t bytes)
{
    if (ptr) hwloc_free(t->topology, ptr, bytes);
}
