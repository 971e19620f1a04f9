/* Pageable host memory, the process heap measured, and the machine's RAM
 * (see include/tidal/hostmem.h). */
#include "tidal/hostmem.h"
#include "tidal/util.h"

#include <errno.h>
#include <inttypes.h>
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifdef TD_HAVE_JEMALLOC
#include <jemalloc/jemalloc.h>
#elif defined(__SANITIZE_ADDRESS__)
/* ASan replaces malloc, so mallinfo2 sees nothing: ask its allocator
 * (sanitizer/allocator_interface.h, not shipped with every compiler). */
size_t __sanitizer_get_current_allocated_bytes(void);
size_t __sanitizer_get_heap_size(void);
#define TD_HEAP_ASAN 1
#endif

typedef struct hm_block {
    void *ptr;
    size_t bytes;
    td_role role;
    struct hm_block *next;
} hm_block;

struct td_hostmem {
    td_topo *topo;
    pthread_mutex_t lock;
    hm_block *blocks;
    int live;
    int huge;
    size_t used[TD_ROLE_COUNT], peak[TD_ROLE_COUNT];
    size_t used_total, peak_total;
};

static size_t page_bytes(void)
{
    long p = sysconf(_SC_PAGESIZE);
    return p > 0 ? (size_t)p : 4096;
}

size_t td_hostmem_round(size_t bytes) { return td_align_up(bytes ? bytes : 1, page_bytes()); }

td_status td_hostmem_create(td_topo *topo, td_hostmem **out)
{
    *out = NULL;
    td_hostmem *h = td_calloc(1, sizeof *h, TD_ROLE_META);
    if (!h) return TD_ERR_NOMEM;
    h->topo = topo;
    pthread_mutex_init(&h->lock, NULL);
    *out = h;
    return TD_OK;
}

static void unmap(td_hostmem *h, void *p, size_t bytes)
{
    if (h->topo) td_topo_free(h->topo, p, bytes);
    else munmap(p, bytes);
}

void td_hostmem_destroy(td_hostmem *h)
{
    if (!h) return;
    while (h->blocks) {
        hm_block *b = h->blocks;
        h->blocks = b->next;
        unmap(h, b->ptr, b->bytes);
        td_free(b);
    }
    pthread_mutex_destroy(&h->lock);
    td_free(h);
}

td_status td_hostmem_alloc(td_hostmem *h, size_t bytes, td_role role, void **ptr)
{
    *ptr = NULL;
    if ((unsigned)role >= TD_ROLE_COUNT) return td_error_set(TD_ERR_INVALID, "host memory: no role %d", (int)role);
    size_t size = td_hostmem_round(bytes);
    char s[32], u[32];
    if (td_fault_hit(TD_FAULT_HOST_ALLOC))
        return td_error_set(TD_ERR_FAULT, "injected failure mapping %s of pageable host memory for %s",
                            td_format_bytes(size, s, sizeof s), td_role_name(role));
    hm_block *b = td_malloc(sizeof *b, TD_ROLE_META);
    if (!b) return TD_ERR_NOMEM;
    pthread_mutex_lock(&h->lock);
    void *p;
    /* Bound to the local node(s) when there is a topology (hwloc maps fresh,
     * zeroed pages for it on Linux), else plain anonymous pages. */
    if (h->topo) {
        p = td_topo_alloc(h->topo, size);
    } else {
        p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) p = NULL;
    }
    if (!p) {
        size_t used = h->used_total;
        pthread_mutex_unlock(&h->lock);
        td_free(b);
        return td_error_set(TD_ERR_NOMEM, "cannot map %s of pageable host memory for %s (%s already mapped); "
                            "lower the model size or use --optim-state bf16 or int8",
                            td_format_bytes(size, s, sizeof s), td_role_name(role), td_format_bytes(used, u, sizeof u));
    }
    /* Huge pages: fewer TLB misses for the AdamW's long streams.  Advice only. */
#ifdef MADV_HUGEPAGE
    if (madvise(p, size, MADV_HUGEPAGE) == 0) h->huge = 1;
#endif
    *b = (hm_block){ .ptr = p, .bytes = size, .role = role, .next = h->blocks };
    h->blocks = b;
    h->live++;
    h->used[role] += size;
    h->used_total += size;
    if (h->used[role] > h->peak[role]) h->peak[role] = h->used[role];
    if (h->used_total > h->peak_total) h->peak_total = h->used_total;
    pthread_mutex_unlock(&h->lock);
    *ptr = p;
    return TD_OK;
}

td_status td_hostmem_release(td_hostmem *h, void *ptr)
{
    if (!ptr) return TD_OK;
    pthread_mutex_lock(&h->lock);
    hm_block **link = &h->blocks;
    while (*link && (*link)->ptr != ptr) link = &(*link)->next;
    hm_block *b = *link;
    if (!b) {
        pthread_mutex_unlock(&h->lock);
        return td_error_set(TD_ERR_INVALID, "host memory: %p was not allocated here", ptr);
    }
    *link = b->next;
    h->live--;
    h->used[b->role] -= b->bytes;
    h->used_total -= b->bytes;
    unmap(h, b->ptr, b->bytes);
    pthread_mutex_unlock(&h->lock);
    td_free(b);
    return TD_OK;
}

void td_hostmem_get_stats(td_hostmem *h, td_hostmem_stats *out)
{
    pthread_mutex_lock(&h->lock);
    *out = (td_hostmem_stats){ .used_bytes = h->used_total, .peak_bytes = h->peak_total, .live_blocks = h->live,
                               .huge_pages = h->huge };
    memcpy(out->used, h->used, sizeof h->used);
    memcpy(out->peak, h->peak, sizeof h->peak);
    pthread_mutex_unlock(&h->lock);
}

/* ---- the process heap -------------------------------------------------------- */

const char *td_host_heap_source(void)
{
#ifdef TD_HAVE_JEMALLOC
    return "jemalloc";
#elif defined(TD_HEAP_ASAN)
    return "asan (sanitizer build, without jemalloc)";
#else
    return "mallinfo2 (tidal built without jemalloc)";
#endif
}

td_status td_host_heap_stats(td_heap_stats *out)
{
    memset(out, 0, sizeof *out);
#ifdef TD_HAVE_JEMALLOC
    /* Statistics are cached until the epoch advances. */
    uint64_t epoch = 1;
    size_t sz = sizeof epoch, allocated = 0, resident = 0, len = sizeof(size_t);
    if (mallctl("epoch", &epoch, &sz, &epoch, sz) != 0 ||
        mallctl("stats.allocated", &allocated, &len, NULL, 0) != 0 ||
        mallctl("stats.resident", &resident, &len, NULL, 0) != 0)
        return td_error_set(TD_ERR_UNSUPPORTED, "jemalloc's statistics are unavailable (mallctl failed)");
    out->allocated_bytes = allocated;
    out->resident_bytes = resident;
    out->source = "jemalloc";
#elif defined(TD_HEAP_ASAN)
    out->allocated_bytes = __sanitizer_get_current_allocated_bytes();
    out->resident_bytes = __sanitizer_get_heap_size();
    out->source = "asan";
#else
    struct mallinfo2 mi = mallinfo2();
    out->allocated_bytes = mi.uordblks + mi.hblkhd;
    out->resident_bytes = mi.arena + mi.hblkhd;
    out->source = "mallinfo2";
#endif
    return TD_OK;
}

/* ---- RAM ---------------------------------------------------------------------- */

td_status td_host_ram_parse(const char *meminfo, const char *cgroup_limit, const char *cgroup_name,
                            size_t *bytes, char *source, size_t source_bytes)
{
    *bytes = 0;
    const char *m = meminfo ? strstr(meminfo, "MemTotal:") : NULL;
    unsigned long long kib = 0;
    if (!m || sscanf(m + 9, "%llu", &kib) != 1 || kib == 0)
        return td_error_set(TD_ERR_UNSUPPORTED, "cannot read MemTotal from /proc/meminfo; give --host-ram SIZE");
    size_t total = (size_t)kib * 1024;
    *bytes = total;
    char a[32], b[32];
    snprintf(source, source_bytes, "MemTotal %s", td_format_bytes(total, a, sizeof a));
    if (cgroup_limit) {
        char *end;
        errno = 0;
        unsigned long long lim = strtoull(cgroup_limit, &end, 10);
        /* "max" (v2) or a page-rounded 2^63 (v1) mean no limit. */
        if (!errno && end != cgroup_limit && lim > 0 && lim < ((unsigned long long)1 << 62) && (size_t)lim < total) {
            *bytes = (size_t)lim;
            snprintf(source, source_bytes, "cgroup limit %s (%s; MemTotal %s)", td_format_bytes((size_t)lim, a, sizeof a),
                     cgroup_name ? cgroup_name : "memory limit", td_format_bytes(total, b, sizeof b));
        } else if (!errno && end != cgroup_limit && lim > 0 && lim < ((unsigned long long)1 << 62)) {
            /* A limit above MemTotal: MemTotal may grow (some VMs), the cgroup is the cap. */
            *bytes = (size_t)lim;
            snprintf(source, source_bytes, "cgroup limit %s (%s; above MemTotal %s, which may grow)",
                     td_format_bytes((size_t)lim, a, sizeof a), cgroup_name ? cgroup_name : "memory limit",
                     td_format_bytes(total, b, sizeof b));
        }
    }
    return TD_OK;
}

static int read_text(const char *path, char *buf, size_t bytes)
{
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t n = fread(buf, 1, bytes - 1, f);
    fclose(f);
    buf[n] = 0;
    return 0;
}

/* The cgroup limit file of this process: v2 (the "0::" line) memory.max,
 * else v1's memory controller memory.limit_in_bytes; each at the process's
 * own cgroup path, then at the mount's root (a cgroup namespace). */
static int cgroup_limit(char *buf, size_t bytes, char *name, size_t name_bytes)
{
    char self[4096];
    if (read_text("/proc/self/cgroup", self, sizeof self) != 0) return -1;
    static const struct { const char *prefix, *mount, *file; } kinds[] = {
        {"0::", "/sys/fs/cgroup", "memory.max"},
        {":memory:", "/sys/fs/cgroup/memory", "memory.limit_in_bytes"},
    };
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        char *line = strstr(self, kinds[k].prefix);
        if (!line) continue;
        char rel[1024];
        if (sscanf(line + strlen(kinds[k].prefix), "%1023[^\n]", rel) != 1) snprintf(rel, sizeof rel, "/");
        char path[2048];
        const char *tries[2] = {rel, ""};
        for (int i = 0; i < 2; i++) {
            snprintf(path, sizeof path, "%s%s/%s", kinds[k].mount, strcmp(tries[i], "/") ? tries[i] : "", kinds[k].file);
            if (read_text(path, buf, bytes) == 0) {
                snprintf(name, name_bytes, "%s", path);
                return 0;
            }
        }
    }
    return -1;
}

td_status td_host_rss(size_t *now, size_t *peak)
{
    char status[8192];
    *now = *peak = 0;
    if (read_text("/proc/self/status", status, sizeof status) != 0)
        return td_error_set(TD_ERR_UNSUPPORTED, "cannot read /proc/self/status for the resident memory");
    const char *rss = strstr(status, "VmRSS:"), *hwm = strstr(status, "VmHWM:");
    unsigned long long a = 0, b = 0;
    if (!rss || !hwm || sscanf(rss + 6, "%llu", &a) != 1 || sscanf(hwm + 6, "%llu", &b) != 1)
        return td_error_set(TD_ERR_UNSUPPORTED, "no VmRSS or VmHWM in /proc/self/status");
    *now = (size_t)a * 1024;
    *peak = (size_t)b * 1024;
    return TD_OK;
}

td_status td_host_ram(size_t *bytes, char *source, size_t source_bytes)
{
    char meminfo[8192], limit[64], name[2100];
    if (read_text("/proc/meminfo", meminfo, sizeof meminfo) != 0) meminfo[0] = 0;
    int have = cgroup_limit(limit, sizeof limit, name, sizeof name) == 0;
    return td_host_ram_parse(meminfo, have ? limit : NULL, have ? name : NULL, bytes, source, source_bytes);
}
