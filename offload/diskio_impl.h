/* Private to the disk I/O engine (diskio.c, diskio_uring.c): the request
 * table and the transfers both back ends take from it. */
#ifndef TIDAL_DISKIO_IMPL_H
#define TIDAL_DISKIO_IMPL_H

#include "tidal/diskio.h"

#include <pthread.h>
#include <sys/types.h>

#define DIO_REQS 256       /* requests in the table: a submit waits for the slot's previous owner */
#define DIO_MAX_DIRS 16

/* One transfer: at most a piece, within one stripe of one directory's file. */
typedef struct dio_xfer {
    int fd;
    int dir;                /* index into the file's directories */
    td_dio_file *file;
    uint64_t off;           /* in that directory's file */
    char *buf;
    size_t len, done;
    int write;
    int req;                /* its request's slot */
    int starve;             /* injected short transfer: its continuation moves nothing */
} dio_xfer;

typedef struct dio_req {
    uint64_t seq;           /* the ticket; 0: the slot is free */
    td_dio_file *file;
    char *buf;
    uint64_t off, bytes;    /* the logical range */
    uint64_t issued;        /* bytes cut into transfers so far */
    int pending;            /* transfers not ended */
    int write;
    int queued;             /* in the FIFO of requests with transfers to issue */
    int ended;              /* every transfer ended */
    td_status st;
    char msg[512];
} dio_req;

struct td_dio {
    td_dio_params p;
    td_dio_method method;
    char describe[256];
    pthread_mutex_t lock;
    pthread_cond_t work;    /* transfers to issue, or stop */
    pthread_cond_t ended;   /* a request ended, or a slot came free */
    dio_req reqs[DIO_REQS];
    uint64_t next_seq;      /* the last ticket given */
    int fifo[DIO_REQS], fifo_head, fifo_n;
    int stop;
    int active;             /* requests not ended */
    td_status failed;       /* the first failure (sticky) */
    char failed_msg[512];
    void (*notify)(void *);
    void *notify_ctx;
    td_dio_stats stats;
    pthread_t *threads;
    int n_threads;
    void *uring;            /* diskio_uring.c's state */
};

struct td_dio_file {
    td_dio *io;
    int n;
    size_t stripe, bytes, per_dir;
    struct dio_dir {
        char dir[512], lock[600], data[600];
        int fd, lock_fd, direct, reg;
        char fs[16];
    } d[DIO_MAX_DIRS];
    char describe[DIO_MAX_DIRS * 700];
    char notes[2048];
};

/* io->lock held: the next transfer to issue (1), or none (0). */
int dio_next_xfer(td_dio *io, dio_xfer *x);
/* A transfer ended: result >= 0 bytes moved by its last call... see diskio.c:
 * err 0 and x->done == x->len: done; err > 0: an errno; err < 0: short.
 * Takes io->lock. */
void dio_xfer_end(td_dio *io, dio_xfer *x, int err);
/* Before a transfer's first system call: an injected fault's errno (> 0),
 * -1 for an injected short transfer (x->len halved and x->starve set), or 0. */
int dio_fault(dio_xfer *x);

/* diskio_uring.c (only when built with liburing): start the ring and its
 * thread, or say why not (TD_ERR_UNSUPPORTED with the reason). */
td_status dio_uring_start(td_dio *io);
void dio_uring_stop(td_dio *io);

#endif
