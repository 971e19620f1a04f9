/* Accounting host allocator and fault injection (see include/tidal/alloc.h).
 *
 * Each block carries a 16-byte header with its size, role and site (an index
 * into a fixed table of call sites) so that td_free can uncount it; counters
 * are atomics, so any thread may allocate.  A site is found by its string's
 * address (a literal per call site) with open addressing; a full table counts
 * further sites under entry 0, "(other sites)". */
#include "tidal/alloc.h"
#include "tidal/status.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct block_header {
    size_t bytes;
    uint32_t role;
    uint32_t magic;
} block_header;

#define HEADER_MAGIC 0x7d41a11cu

static atomic_size_t used_by_role[TD_ROLE_COUNT], peak_by_role[TD_ROLE_COUNT];
static atomic_size_t live_allocs;

#define SITES 1024 /* tidal has a few hundred call sites */
typedef struct site_entry {
    _Atomic(const char *) site;
    atomic_uint role;
    atomic_size_t live, peak, allocs;
} site_entry;
static site_entry sites[SITES];

static void raise_peak(atomic_size_t *peak, size_t now)
{
    size_t p = atomic_load_explicit(peak, memory_order_relaxed);
    while (now > p && !atomic_compare_exchange_weak(peak, &p, now)) {}
}

/* The table index of site (claimed on first use); 0 when the table is full. */
static uint32_t site_index(const char *site, td_role role)
{
    if (!site) return 0;
    uintptr_t h = (uintptr_t)site;
    h ^= h >> 17;
    h *= 0x9e3779b97f4a7c15ull;
    for (uint32_t probe = 0; probe < SITES; probe++) {
        uint32_t i = 1 + (uint32_t)((h + probe) % (SITES - 1));
        const char *cur = atomic_load(&sites[i].site);
        if (cur == site) return i;
        if (!cur) {
            const char *expect = NULL;
            if (atomic_compare_exchange_strong(&sites[i].site, &expect, site)) {
                atomic_store(&sites[i].role, (unsigned)role);
                return i;
            }
            if (expect == site) return i;
        }
    }
    return 0;
}

static atomic_long fault_target[TD_FAULT_KIND_COUNT];
static atomic_long fault_seen[TD_FAULT_KIND_COUNT];

const char *td_role_name(td_role role)
{
    static const char *names[TD_ROLE_COUNT] = {
        "chunks", "optimizer", "activations", "workspace",
        "communication", "staging", "metadata",
    };
    return (unsigned)role < TD_ROLE_COUNT ? names[role] : "unknown";
}

void td_fault_arm(td_fault_kind kind, long n)
{
    atomic_store(&fault_seen[kind], 0);
    atomic_store(&fault_target[kind], n);
}

long td_fault_count(td_fault_kind kind) { return atomic_load(&fault_seen[kind]); }

int td_fault_hit(td_fault_kind kind)
{
    long seen = atomic_fetch_add(&fault_seen[kind], 1) + 1;
    long target = atomic_load(&fault_target[kind]);
    return target > 0 && seen == target;
}

void td_fault_disarm_all(void)
{
    for (int k = 0; k < TD_FAULT_KIND_COUNT; k++)
        td_fault_arm((td_fault_kind)k, 0);
}

void *td_malloc_at(size_t bytes, td_role role, const char *site)
{
    if ((unsigned)role >= TD_ROLE_COUNT) role = TD_ROLE_META;
    if (td_fault_hit(TD_FAULT_HOST_ALLOC)) {
        td_error_set(TD_ERR_FAULT, "injected host allocation failure (%zu bytes, %s)",
                     bytes, td_role_name(role));
        return NULL;
    }
    if (bytes > SIZE_MAX - sizeof(block_header)) {
        td_error_set(TD_ERR_NOMEM, "host allocation of %zu bytes overflows", bytes);
        return NULL;
    }
    block_header *h = malloc(sizeof *h + bytes);
    if (!h) {
        td_error_set(TD_ERR_NOMEM, "host allocation of %zu bytes for %s failed "
                     "(%zu bytes already allocated)", bytes, td_role_name(role),
                     td_host_used_total());
        return NULL;
    }
    uint32_t at = site_index(site, role);
    h->bytes = bytes;
    h->role = (uint32_t)role | at << 8;
    h->magic = HEADER_MAGIC;
    raise_peak(&peak_by_role[role], atomic_fetch_add(&used_by_role[role], bytes) + bytes);
    raise_peak(&sites[at].peak, atomic_fetch_add(&sites[at].live, bytes) + bytes);
    atomic_fetch_add(&sites[at].allocs, 1);
    atomic_fetch_add(&live_allocs, 1);
    return h + 1;
}

void *td_calloc_at(size_t n, size_t size, td_role role, const char *site)
{
    if (size && n > SIZE_MAX / size) {
        td_error_set(TD_ERR_NOMEM, "host allocation of %zu x %zu bytes overflows", n, size);
        return NULL;
    }
    void *p = td_malloc_at(n * size, role, site);
    if (p) memset(p, 0, n * size);
    return p;
}

void td_free(void *ptr)
{
    if (!ptr) return;
    block_header *h = (block_header *)ptr - 1;
    if (h->magic != HEADER_MAGIC) abort(); /* not ours, or a double free */
    h->magic = 0;
    uint32_t at = h->role >> 8;
    atomic_fetch_sub(&used_by_role[h->role & 0xff], h->bytes);
    atomic_fetch_sub(&sites[at].live, h->bytes);
    atomic_fetch_sub(&sites[at].allocs, 1);
    atomic_fetch_sub(&live_allocs, 1);
    free(h);
}

char *td_strdup_at(const char *s, td_role role, const char *site)
{
    size_t n = strlen(s) + 1;
    char *d = td_malloc_at(n, role, site);
    if (d) memcpy(d, s, n);
    return d;
}

size_t td_host_used(td_role role) { return atomic_load(&used_by_role[role]); }

size_t td_host_used_total(void)
{
    size_t total = 0;
    for (int r = 0; r < TD_ROLE_COUNT; r++) total += atomic_load(&used_by_role[r]);
    return total;
}

size_t td_host_live_allocs(void) { return atomic_load(&live_allocs); }

size_t td_host_used_peak(td_role role) { return atomic_load(&peak_by_role[role]); }

void td_host_peak_reset(void)
{
    for (int r = 0; r < TD_ROLE_COUNT; r++) atomic_store(&peak_by_role[r], atomic_load(&used_by_role[r]));
    for (int i = 0; i < SITES; i++) atomic_store(&sites[i].peak, atomic_load(&sites[i].live));
}

static int by_peak(const void *a, const void *b)
{
    const td_host_site *x = a, *y = b;
    return x->peak_bytes < y->peak_bytes ? 1 : x->peak_bytes > y->peak_bytes ? -1 : 0;
}

int td_host_sites(td_host_site *out, int max)
{
    td_host_site all[SITES];
    int n = 0;
    for (int i = 0; i < SITES; i++) {
        size_t peak = atomic_load(&sites[i].peak);
        if (!peak) continue;
        const char *site = atomic_load(&sites[i].site);
        all[n++] = (td_host_site){.site = site ? site : "(other sites)", .role = (td_role)atomic_load(&sites[i].role),
                                  .live_bytes = atomic_load(&sites[i].live), .peak_bytes = peak,
                                  .live_allocs = atomic_load(&sites[i].allocs)};
    }
    qsort(all, (size_t)n, sizeof *all, by_peak);
    if (n > max) n = max > 0 ? max : 0;
    memcpy(out, all, (size_t)n * sizeof *all);
    return n;
}
