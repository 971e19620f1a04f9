/* Direct disk I/O: bytes that live on local drives, moved in large aligned
 * blocks that bypass the page cache.
 *
 * An engine (td_dio) owns the I/O threads: with io_uring (liburing, when
 * tidal is built with it and the kernel allows it) one thread keeps up to
 * queue_depth transfers in flight on a ring; otherwise `threads` threads
 * each run one pread/pwrite at a time.  Both take the same requests and
 * give the same results; td_dio_describe says which runs and why.
 *
 * A scratch file (td_dio_file) is one logical byte range striped over one
 * or more directories (one file in each, every stripe_bytes to the next
 * directory, so one large request keeps every drive busy).  Each file is
 * opened with O_DIRECT where the filesystem allows it (else, by default,
 * through the page cache: td_dio_file_describe says so), preallocated in
 * full when it is made (a disk without room fails then, naming the
 * directory, the bytes asked and the bytes free) and has no name from the
 * start (O_TMPFILE, or unlinked right after it is made): its space goes
 * back to the filesystem when the process ends, however it ends.  Beside
 * it, in each directory, a lock file `tidal-HOST-PID-N.lock` says who uses
 * the directory (pid, host, start time, bytes) and holds an flock for the
 * process's life.  A lock file whose flock is free belongs to a run that
 * ended without removing it (killed): the next file made in that directory
 * removes it and says so (td_dio_file_notes); one from another host is
 * refused (its owner's liveness cannot be told from here).  Runs sharing a
 * directory never touch each other's files.
 *
 * Requests: td_dio_read / td_dio_write of a byte range of a file, with
 * offset, length and buffer address multiples of TD_DIO_ALIGN; each is cut
 * into transfers of at most piece_bytes within one stripe and completes
 * when all of them have.  A transfer that moves fewer bytes than asked is
 * continued; one that moves none, or fails, fails its request with a
 * message naming the directory, the file, the operation, the offset and
 * the error (ENOSPC: the disk is full).  The first failure is sticky: every
 * later request and wait of the engine fails with it, so no error is lost
 * when nobody waited for the request that met it.
 *
 * Fault injection (alloc.h): TD_FAULT_DISK_NOSPC, _EIO and _SHORT count
 * the transfers, _NODIRECT the files opened; _NOSPC also a preallocation.
 *
 * Memory: the caller's buffers (the chunk manager's pinned slots); the engine takes a fixed table at creation and allocates
 * nothing per request.  Thread-safety: every call is thread-safe; a file
 * is closed after the requests on it are waited for. */
#ifndef TIDAL_DISKIO_H
#define TIDAL_DISKIO_H

#include <stddef.h>
#include <stdint.h>

#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TD_DIO_ALIGN ((size_t)4096)

typedef struct td_dio td_dio;
typedef struct td_dio_file td_dio_file;

typedef enum td_dio_method {
    TD_DIO_AUTO,     /* io_uring where it works, else threads */
    TD_DIO_URING,    /* io_uring only (TD_ERR_UNSUPPORTED when unavailable) */
    TD_DIO_THREADS,  /* pread/pwrite threads */
} td_dio_method;

const char *td_dio_method_name(td_dio_method m);
td_status td_dio_method_parse(const char *name, td_dio_method *out);
/* 1 when this build has io_uring (liburing). */
int td_dio_uring_compiled(void);

typedef struct td_dio_params {
    td_dio_method method;   /* default AUTO */
    int queue_depth;        /* io_uring: transfers in flight (default 32) */
    int threads;            /* threads: I/O threads (default 8) */
    size_t piece_bytes;     /* the largest transfer (default 1 MiB; a multiple of TD_DIO_ALIGN) */
} td_dio_params;

td_dio_params td_dio_default_params(void);
td_status td_dio_create(const td_dio_params *p, td_dio **out);
/* Waits for every request in flight, then stops the threads. */
void td_dio_destroy(td_dio *io);
td_dio_method td_dio_get_method(const td_dio *io);
/* "io_uring, 32 in flight" or "8 pread/pwrite threads (io_uring: <why not>)". */
const char *td_dio_describe(const td_dio *io);
/* Called on an I/O thread after each request ends (done or failed), for a
 * waiter that watches several (the chunk manager's disk tier).  Set it
 * before the first request.  It must not call into the engine. */
void td_dio_set_notify(td_dio *io, void (*fn)(void *ctx), void *ctx);

typedef struct td_dio_stats {
    uint64_t reads, writes;                /* requests */
    uint64_t bytes_read, bytes_written;
    uint64_t transfers, partial;           /* transfers made; those continued after moving part */
} td_dio_stats;
void td_dio_get_stats(td_dio *io, td_dio_stats *out);

/* ---- scratch files ------------------------------------------------------------ */

typedef struct td_dio_file_params {
    size_t stripe_bytes;    /* bytes to each directory in turn (default 4 MiB; a multiple of TD_DIO_ALIGN) */
    int direct;             /* 1 (default): O_DIRECT, buffered where the filesystem refuses it; 2: O_DIRECT or
                               fail; 0: buffered (the page cache) */
} td_dio_file_params;
td_dio_file_params td_dio_file_default_params(void);

/* A scratch file of at least `bytes` (rounded up to whole stripes in each
 * directory), striped over dirs[0 .. n_dirs) (each a directory that exists
 * and is writable; a directory named twice is refused), preallocated, read
 * as zeros until written. */
td_status td_dio_file_create(td_dio *io, const char *const *dirs, int n_dirs, size_t bytes,
                             const td_dio_file_params *p, td_dio_file **out);
/* Closes the files (their space goes back) and removes the lock files. */
void td_dio_file_close(td_dio_file *f);
size_t td_dio_file_bytes(const td_dio_file *f);
/* 1 when every directory's file is read and written with O_DIRECT. */
int td_dio_file_direct(const td_dio_file *f);
/* One line per directory: "DIR: 12.0 GiB, ext4, O_DIRECT" or "..., through
 * the page cache (tmpfs refuses O_DIRECT)". */
const char *td_dio_file_describe(const td_dio_file *f);
/* What the file's creation found and did: lock files of ended runs removed
 * ("" when none). */
const char *td_dio_file_notes(const td_dio_file *f);

typedef struct td_dio_ticket { uint64_t seq; } td_dio_ticket;

/* Async: bytes [offset, offset + bytes) of f into buf / from buf.  All
 * three multiples of TD_DIO_ALIGN, within the file.  The buffer must stay
 * (and, for a write, unchanged) until the ticket completes.  Blocks only
 * while the engine's table of requests is full. */
td_status td_dio_read(td_dio_file *f, size_t offset, void *buf, size_t bytes, td_dio_ticket *t);
td_status td_dio_write(td_dio_file *f, size_t offset, const void *buf, size_t bytes, td_dio_ticket *t);
/* Until the request ends: TD_OK, or TD_ERR_IO with its message (or the
 * engine's first failure).  A zero ticket is complete. */
td_status td_dio_wait(td_dio *io, const td_dio_ticket *t);
/* *done: whether it ended (its status as td_dio_wait's when it did). */
td_status td_dio_done(td_dio *io, const td_dio_ticket *t, int *done);
/* Every request so far. */
td_status td_dio_drain(td_dio *io);
/* The engine's first failure, without waiting (TD_OK when none). */
td_status td_dio_failed(td_dio *io);

/* ---- directories ----------------------------------------------------------------- */

typedef struct td_dio_dir_info {
    size_t free_bytes;        /* what an unprivileged writer may take (statvfs f_bavail) */
    size_t total_bytes;
    char fs[16];              /* the filesystem's type: ext4, xfs, btrfs, tmpfs, ... */
    int direct;               /* 1 when a file there opens with O_DIRECT */
    int in_ram;               /* tmpfs or ramfs: its files take host memory */
} td_dio_dir_info;
/* Free space, filesystem and O_DIRECT support of a directory (a probe file
 * is made and removed).  Errors name the directory. */
td_status td_dio_dir_info_get(const char *dir, td_dio_dir_info *out);
/* Its free space alone (statvfs: no probe file), for plans that ask often. */
td_status td_dio_dir_free(const char *dir, size_t *free_bytes);

/* ---- measuring a drive ------------------------------------------------------------- */

/* Direct read and write rates of a scratch file over dirs: `bytes` written
 * in requests of `block` bytes with `depth` in flight (random bytes, so a
 * compressing drive gains nothing), then read back, then the two at once
 * (the first half read while the second is written: a streaming
 * optimizer's mix), each timed from the first request to the last one's
 * end.  GB/s are 1e9 bytes a second; mixed counts both directions. */
typedef struct td_dio_rates {
    double write_gbs, read_gbs, mixed_gbs;
    size_t bytes;           /* per pass */
    int direct;             /* every directory with O_DIRECT (else the page cache took part) */
    char method[16];        /* the engine's */
} td_dio_rates;
td_status td_dio_measure(td_dio *io, const char *const *dirs, int n_dirs, size_t bytes, size_t block, int depth,
                         td_dio_rates *out);

/* Removes the lock files of this process's open scratch files.
 * Async-signal-safe (unlink only): for a SIGINT / SIGTERM handler.  The
 * data files have no names, so nothing else is left behind. */
void td_dio_signal_cleanup(void);

#ifdef __cplusplus
}
#endif
#endif
