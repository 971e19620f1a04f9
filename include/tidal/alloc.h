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

void *td_malloc(size_t bytes, td_role role);        /* NULL + message on failure */
void *td_calloc(size_t n, size_t size, td_role role);
void  td_free(void *ptr);                           /* NULL is a no-op */
char *td_strdup(const char *s, td_role role);

size_t td_host_used(td_role role);   /* live pageable bytes of that role */
size_t td_host_used_total(void);
size_t td_host_live_allocs(void);    /* live td_malloc blocks (leak checks) */

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
