/* Accounting host allocator and fault injection (see include/tidal/alloc.h).
 *
 * Each block carries a 16-byte header with its size and role so that td_free
 * can uncount it; counters are atomics, so any thread may allocate. */
#include "tidal/alloc.h"
#include "tidal/status.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

typedef struct block_header {
    size_t bytes;
    uint32_t role;
    uint32_t magic;
} block_header;

#define HEADER_MAGIC 0x7d41a11cu

static atomic_size_t used_by_role[TD_ROLE_COUNT];
static atomic_size_t live_allocs;

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

void *td_malloc(size_t bytes, td_role role)
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
    h->bytes = bytes;
    h->role = (uint32_t)role;
    h->magic = HEADER_MAGIC;
    atomic_fetch_add(&used_by_role[role], bytes);
    atomic_fetch_add(&live_allocs, 1);
    return h + 1;
}

void *td_calloc(size_t n, size_t size, td_role role)
{
    if (size && n > SIZE_MAX / size) {
        td_error_set(TD_ERR_NOMEM, "host allocation of %zu x %zu bytes overflows", n, size);
        return NULL;
    }
    void *p = td_malloc(n * size, role);
    if (p) memset(p, 0, n * size);
    return p;
}

void td_free(void *ptr)
{
    if (!ptr) return;
    block_header *h = (block_header *)ptr - 1;
    if (h->magic != HEADER_MAGIC) abort(); /* not ours, or a double free */
    h->magic = 0;
    atomic_fetch_sub(&used_by_role[h->role], h->bytes);
    atomic_fetch_sub(&live_allocs, 1);
    free(h);
}

char *td_strdup(const char *s, td_role role)
{
    size_t n = strlen(s) + 1;
    char *d = td_malloc(n, role);
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
