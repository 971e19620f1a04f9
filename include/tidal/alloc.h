/* Host memory accounting and fault injection.
 *
 * Every pageable host byte tidal allocates goes through td_malloc/td_free
 * (redis zmalloc style), so `td_host_used()` is exact per role at any moment.
 * Pinned host memory is counted by the pinned pool (hostpool.h) under the
 * same roles.  Device bytes are counted by the arena (arena.h).
 *
 * Fault injection (SQLite style): td_fault_arm(kind, n) makes the n-th
 * fallible operation of that kind, counted from the arm call, fail.  Tests
 * loop n = 1, 2, ... until an operation sequence completes without reaching
 * n, checking each time that the failure surfaced as an error and that
 * nothing leaked.  Thread-safe. */
#ifndef TIDAL_ALLOC_H
#define TIDAL_ALLOC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What bytes are for.  Shared by the device arena, the pinned pool and the
 * host allocator so that one table reports the whole footprint. */
typedef enum td_role {
    TD_ROLE_CHUNK,       /* model chunks: params, grads */
    TD_ROLE_OPTIM,       /* optimizer state: master, m, v */
    TD_ROLE_ACTIVATION,  /* activations and checkpoints */
    TD_ROLE_WORKSPACE,   /* cuBLAS workspace, scratch */
    TD_ROLE_COMM,        /* communication buffers (NCCL) */
    TD_ROLE_STAGING,     /* upload / download staging buffers */
    TD_ROLE_META,        /* bookkeeping */
    TD_ROLE_COUNT
} td_role;

const char *td_role_name(td_role role);

/* Each allocation is counted under its role and its site (the file:line of
 * the td_malloc call, which the macros below pass), so that a footprint can
 * say which code holds the heap: td_host_sites.  NULL + message on failure. */
void *td_malloc_at(size_t bytes, td_role role, const char *site);
void *td_calloc_at(size_t n, size_t size, td_role role, const char *site);
char *td_strdup_at(const char *s, td_role role, const char *site);
void  td_free(void *ptr);                           /* NULL is a no-op */

#define TD_ALLOC_STR_(x) #x
#define TD_ALLOC_STR(x) TD_ALLOC_STR_(x)
#define TD_ALLOC_SITE __FILE__ ":" TD_ALLOC_STR(__LINE__)
#define td_malloc(bytes, role) td_malloc_at((bytes), (role), TD_ALLOC_SITE)
#define td_calloc(n, size, role) td_calloc_at((n), (size), (role), TD_ALLOC_SITE)
#define td_strdup(s, role) td_strdup_at((s), (role), TD_ALLOC_SITE)

size_t td_host_used(td_role role);   /* live pageable bytes of that role */
size_t td_host_used_total(void);
size_t td_host_live_allocs(void);    /* live td_malloc blocks (leak checks) */
/* The most bytes of that role live at once since the start (or the last
 * td_host_peak_reset, which sets every peak, by role and by site, to the
 * bytes live now). */
size_t td_host_used_peak(td_role role);
void   td_host_peak_reset(void);

/* One allocation site's bytes: live now and the most live at once. */
typedef struct td_host_site {
    const char *site;     /* "dir/file.c:123", or "(other sites)" once the table is full */
    td_role role;         /* the role of its first allocation */
    size_t live_bytes, peak_bytes;
    size_t live_allocs;
} td_host_site;
/* The sites with the largest peaks, largest first: at most max of them into
 * out; returns how many. */
int td_host_sites(td_host_site *out, int max);

typedef enum td_fault_kind {
    TD_FAULT_HOST_ALLOC,   /* td_malloc / td_calloc */
    TD_FAULT_PIN,          /* pinning host memory (slab creation) */
    TD_FAULT_DEV_RESERVE,  /* device reservation (arena creation) */
    TD_FAULT_NONFINITE_GRAD, /* an optimizer step's grads read as non-finite (trainer) */
    /* Disk I/O (diskio.h): each counts the transfers the I/O engine makes
     * (a read or write of at most a piece), or, for NODIRECT, the files it
     * opens. */
    TD_FAULT_DISK_NOSPC,     /* a transfer fails with ENOSPC (also a file's preallocation) */
    TD_FAULT_DISK_EIO,       /* a transfer fails with EIO */
    TD_FAULT_DISK_SHORT,     /* a transfer moves half its bytes, and its continuation none */
    TD_FAULT_DISK_NODIRECT,  /* opening a file with O_DIRECT fails with EINVAL (a filesystem without it) */
    TD_FAULT_KIND_COUNT
} td_fault_kind;

/* Arm: the n-th (1-based) operation of `kind` from now fails. n = 0 disarms. */
void td_fault_arm(td_fault_kind kind, long n);
/* How many operations of `kind` ran since the last arm (reached or not). */
long td_fault_count(td_fault_kind kind);
/* Called by fallible operations: returns 1 if this one must fail. */
int  td_fault_hit(td_fault_kind kind);
void td_fault_disarm_all(void);

#ifdef __cplusplus
}
#endif
#endif
