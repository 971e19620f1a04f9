/* The pinned host pool (see include/tidal/hostpool.h). */
#include "tidal/hostpool.h"
#include "tidal/util.h"
#include "tidal/range.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#define SLAB_GRAIN TD_HOSTPOOL_SLAB_GRAIN

typedef struct slab {
    char *base;
    size_t bytes;
    td_range range;
    struct slab *next;
} slab;

struct td_hostpool {
    td_backend *backend;
    td_topo *topo;
    td_hostpool_params params;
    pthread_mutex_t lock;
    slab *slabs;                   /* newest first */
    /* What the last slab made for want of room says: no slab from
     * `full_from` on (the older ones) holds a free range of `full_bytes` or
     * more.  Allocations only shrink their free space, so it stays true
     * until a release or a trim (which forget it).  An allocation of at
     * least full_bytes stops its walk there: a pool of thousands of slabs
     * (a planning pool for thousands of layers) is not walked whole for
     * every chunk. */
    slab *full_from;
    size_t full_bytes;
    uintptr_t plan_next;           /* a planning pool's next slab address */
    int slab_count;
    size_t pinned_bytes;
    size_t used[TD_ROLE_COUNT], peak[TD_ROLE_COUNT];
    size_t used_total, peak_total;
};

td_hostpool_params td_hostpool_default_params(void)
{
    return (td_hostpool_params){ .slab_bytes = 256 * TD_MiB, .pin_limit_bytes = 0 };
}

static size_t physical_ram(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? (size_t)pages * (size_t)page : 0;
}

td_status td_hostpool_create(td_backend *b, td_topo *topo, const td_hostpool_params *params, td_hostpool **out)
{
    *out = NULL;
    td_hostpool *p = td_calloc(1, sizeof *p, TD_ROLE_META);
    if (!p) return TD_ERR_NOMEM;
    p->backend = b;
    p->topo = topo;
    p->params = params ? *params : td_hostpool_default_params();
    if (p->params.slab_bytes == 0) p->params.slab_bytes = 256 * TD_MiB;
    p->params.slab_bytes = td_align_up(p->params.slab_bytes, SLAB_GRAIN);
    if (p->params.pin_limit_bytes == 0) p->params.pin_limit_bytes = b ? physical_ram() / 10 * 8 : SIZE_MAX;
    pthread_mutex_init(&p->lock, NULL);
    *out = p;
    return TD_OK;
}

static void *map_slab(td_hostpool *p, size_t bytes)
{
    void *m;
    if (!p->backend) { /* a planning pool: disjoint addresses that are never used */
        static const uintptr_t span = (uintptr_t)1 << 44;
        p->plan_next += span;
        return (void *)p->plan_next;
    }
    if (p->topo) {
        m = td_topo_alloc(p->topo, bytes);
    } else {
        m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) {
            char s[32];
            td_error_set(TD_ERR_NOMEM, "cannot map %s of host memory", td_format_bytes(bytes, s, sizeof s));
            return NULL;
        }
    }
    /* Huge pages where the kernel offers them: fewer TLB misses for the CPU
     * AdamW's streams and fewer pages for the driver to lock.  Advice only. */
    if (m) madvise(m, bytes, MADV_HUGEPAGE);
    return m;
}

static void unmap_slab(td_hostpool *p, void *base, size_t bytes)
{
    if (!p->backend) return;
    if (p->topo) td_topo_free(p->topo, base, bytes);
    else munmap(base, bytes);
}

static void slab_free(td_hostpool *p, slab *s)
{
    if (p->backend) td_backend_host_unregister(p->backend, s->base);
    unmap_slab(p, s->base, s->bytes);
    td_range_destroy(&s->range);
    p->pinned_bytes -= s->bytes;
    p->slab_count--;
    td_free(s);
}

/* Caller holds the lock.  Maps, binds and pins one slab of at least `bytes`. */
static td_status slab_new(td_hostpool *p, size_t bytes, slab **out)
{
    td_status st = TD_OK;
    size_t size = td_align_up(bytes > p->params.slab_bytes ? bytes : p->params.slab_bytes, SLAB_GRAIN);
    char need[32], pinned[32], limit[32]; /* for the messages, made when one is */
#define SLAB_SIZES()                                                    \
    (td_format_bytes(size, need, sizeof need), td_format_bytes(p->pinned_bytes, pinned, sizeof pinned), \
     td_format_bytes(p->params.pin_limit_bytes, limit, sizeof limit))
    slab *s = NULL;
    int range_ok = 0, registered = 0;
    if (p->pinned_bytes + size > p->params.pin_limit_bytes && SLAB_SIZES())
        TD_FAIL(TD_ERR_PIN, "cannot pin %s more host memory: %s already pinned in %d slab%s and the pin limit is %s "
                "(--host-pin-limit, default 80%% of RAM); lower the model or batch size, or raise the limit",
                need, pinned, p->slab_count, p->slab_count == 1 ? "" : "s", limit);
    s = td_calloc(1, sizeof *s, TD_ROLE_META);
    if (!s) { st = TD_ERR_NOMEM; goto cleanup; }
    TD_TRY(td_range_init(&s->range, size, TD_HOSTPOOL_ALIGN));
    range_ok = 1;
    s->bytes = size;
    s->base = map_slab(p, size);
    if (!s->base) { st = TD_ERR_NOMEM; goto cleanup; }
    if (p->backend && td_fault_hit(TD_FAULT_PIN) && SLAB_SIZES())
        TD_FAIL(TD_ERR_FAULT, "injected failure pinning %s (%s already pinned)", need, pinned);
    st = p->backend ? td_backend_host_register(p->backend, s->base, size) : TD_OK;
    if (st) {
        SLAB_SIZES();
        struct rlimit rl;
        char lock[48] = "unlimited";
        if (getrlimit(RLIMIT_MEMLOCK, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
            td_format_bytes((size_t)rl.rlim_cur, lock, sizeof lock);
        td_error_prefix(st, "pinning a slab of %s with %s already pinned in %d slab%s (RLIMIT_MEMLOCK %s): ",
                        need, pinned, p->slab_count, p->slab_count == 1 ? "" : "s", lock);
        goto cleanup;
    }
    registered = 1;
    s->next = p->slabs;
    p->slabs = s;
    p->slab_count++;
    p->pinned_bytes += size;
    *out = s;
    return TD_OK;
cleanup:
    if (s) {
        if (registered && p->backend) td_backend_host_unregister(p->backend, s->base);
        if (s->base) unmap_slab(p, s->base, size);
        if (range_ok) td_range_destroy(&s->range);
        td_free(s);
    }
    return st;
}
#undef SLAB_SIZES

static void count(td_hostpool *p, td_role role, size_t bytes, int sign)
{
    if (sign > 0) {
        p->used[role] += bytes;
        p->used_total += bytes;
        if (p->used[role] > p->peak[role]) p->peak[role] = p->used[role];
        if (p->used_total > p->peak_total) p->peak_total = p->used_total;
    } else {
        p->used[role] -= bytes;
        p->used_total -= bytes;
    }
}

td_status td_hostpool_alloc(td_hostpool *p, size_t bytes, td_role role, void **ptr)
{
    td_status st = TD_OK;
    size_t off = 0;
    slab *s;
    *ptr = NULL;
    if ((unsigned)role >= TD_ROLE_COUNT) return td_error_set(TD_ERR_INVALID, "pinned pool: no role %d", (int)role);
    pthread_mutex_lock(&p->lock);
    slab *stop = p->full_from && bytes >= p->full_bytes ? p->full_from : NULL;
    for (s = p->slabs; s != stop; s = s->next) {
        st = td_range_alloc(&s->range, bytes, 0, (uint32_t)role, &off);
        if (st == TD_OK) break;
        if (st != TD_ERR_BUDGET) goto out;
    }
    if (s == stop) {
        slab *older = p->slabs;
        st = slab_new(p, bytes, &s);
        if (st) goto out;
        if (older) { /* none of them holds `bytes` */
            p->full_bytes = bytes;
            p->full_from = older;
        }
        st = td_range_alloc(&s->range, bytes, 0, (uint32_t)role, &off);
        if (st) goto out; /* only TD_ERR_NOMEM of a range node; the slab stays for later */
    }
    count(p, role, td_range_block_bytes(&s->range, off), +1);
    *ptr = s->base + off;
out:
    pthread_mutex_unlock(&p->lock);
    return st;
}

td_status td_hostpool_release(td_hostpool *p, void *ptr)
{
    if (!ptr) return TD_OK;
    td_status st = TD_OK;
    char *c = ptr;
    pthread_mutex_lock(&p->lock);
    slab *s = p->slabs;
    while (s && !(c >= s->base && c < s->base + s->bytes)) s = s->next;
    if (!s) {
        st = td_error_set(TD_ERR_INVALID, "pinned pool: %p was not allocated from this pool", ptr);
    } else {
        size_t bytes;
        uint32_t role;
        st = td_range_free(&s->range, (size_t)(c - s->base), &bytes, &role);
        if (st == TD_OK) count(p, (td_role)role, bytes, -1);
        if (st == TD_OK) p->full_from = NULL; /* a slab has room again */
        else td_error_prefix(st, "pinned pool: releasing %p: ", ptr);
    }
    pthread_mutex_unlock(&p->lock);
    return st;
}

size_t td_hostpool_trim(td_hostpool *p)
{
    size_t given = 0;
    pthread_mutex_lock(&p->lock);
    p->full_from = NULL; /* it may be one of those freed */
    for (slab **link = &p->slabs; *link;) {
        slab *s = *link;
        if (s->range.live_blocks == 0) {
            *link = s->next;
            given += s->bytes;
            slab_free(p, s);
        } else {
            link = &s->next;
        }
    }
    pthread_mutex_unlock(&p->lock);
    return given;
}

void td_hostpool_destroy(td_hostpool *p)
{
    if (!p) return;
    while (p->slabs) {
        slab *s = p->slabs;
        p->slabs = s->next;
        slab_free(p, s);
    }
    pthread_mutex_destroy(&p->lock);
    td_free(p);
}

void td_hostpool_get_stats(td_hostpool *p, td_hostpool_stats *out)
{
    pthread_mutex_lock(&p->lock);
    *out = (td_hostpool_stats){
        .pinned_bytes = p->pinned_bytes, .limit_bytes = p->params.pin_limit_bytes,
        .used_bytes = p->used_total, .peak_bytes = p->peak_total, .slabs = p->slab_count,
    };
    for (slab *s = p->slabs; s; s = s->next) out->live_blocks += s->range.live_blocks;
    memcpy(out->used, p->used, sizeof p->used);
    memcpy(out->peak, p->peak, sizeof p->peak);
    pthread_mutex_unlock(&p->lock);
}
