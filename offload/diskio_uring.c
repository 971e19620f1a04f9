/* The disk I/O engine's io_uring back end (built with liburing: the
 * Makefile's URING switch).  One thread owns the ring: it takes transfers
 * from the request table while fewer than queue_depth are in flight,
 * submits them, and handles their completions (a transfer that moved part
 * of its bytes goes back on the ring for the rest).  Faults are injected
 * where the threads back end injects them, before a transfer's first
 * submission, so both give the same errors. */
#include "diskio_impl.h"
#include "tidal/alloc.h"
#include "tidal/util.h"

#include <errno.h>
#include <liburing.h>
#include <stdio.h>
#include <string.h>

typedef struct uring_slot {
    dio_xfer x;
    size_t stall;    /* injected short transfer: nothing moves past this */
    size_t asked;    /* bytes the submission in flight asked for */
} uring_slot;

typedef struct uring_state {
    struct io_uring ring;
    pthread_t thread;
    int started, ring_up;
    int depth, inflight;
    uring_slot *slots;
    int *free_slots, n_free;
} uring_state;

/* Queues slot s's next submission (the ring is this thread's); 0, or the
 * transfer's end: an errno, -1 short. */
static int prep(uring_state *u, int s)
{
    uring_slot *sl = &u->slots[s];
    dio_xfer *x = &sl->x;
    if (x->done >= sl->stall) return -1;
    size_t want = x->len - x->done;
    if (want > sl->stall - x->done) want = sl->stall - x->done;
    struct io_uring_sqe *sqe = io_uring_get_sqe(&u->ring);
    if (!sqe) return EAGAIN; /* cannot happen: the ring has a place for every slot */
    if (x->write) io_uring_prep_write(sqe, x->fd, x->buf + x->done, (unsigned)want, x->off + x->done);
    else io_uring_prep_read(sqe, x->fd, x->buf + x->done, (unsigned)want, x->off + x->done);
    io_uring_sqe_set_data64(sqe, (uint64_t)s);
    sl->asked = want;
    u->inflight++;
    return 0;
}

static void finish(td_dio *io, uring_state *u, int s, int err)
{
    dio_xfer x = u->slots[s].x;
    u->free_slots[u->n_free++] = s;
    dio_xfer_end(io, &x, err);
}

/* A new transfer into slot s: its fault, then its first submission. */
static void start(td_dio *io, uring_state *u, int s)
{
    uring_slot *sl = &u->slots[s];
    sl->stall = SIZE_MAX;
    int f = dio_fault(&sl->x);
    if (f > 0) { finish(io, u, s, f); return; }
    if (sl->x.starve) sl->stall = td_align_up(sl->x.len / 2, TD_DIO_ALIGN);
    int end = prep(u, s);
    if (end) finish(io, u, s, end);
}

static void complete(td_dio *io, uring_state *u, struct io_uring_cqe *cqe)
{
    int s = (int)io_uring_cqe_get_data64(cqe), res = cqe->res;
    uring_slot *sl = &u->slots[s];
    u->inflight--;
    if (res == -EINTR || res == -EAGAIN) { /* again, as it was */
        int end = prep(u, s);
        if (end) finish(io, u, s, end);
        return;
    }
    if (res < 0) { finish(io, u, s, -res); return; }
    if (res == 0) { finish(io, u, s, -1); return; }
    if ((size_t)res < sl->asked && sl->x.done + (size_t)res < sl->stall) {
        pthread_mutex_lock(&io->lock);
        io->stats.partial++;
        pthread_mutex_unlock(&io->lock);
    }
    sl->x.done += (size_t)res;
    if (sl->x.done == sl->x.len) { finish(io, u, s, 0); return; }
    int end = prep(u, s);
    if (end) finish(io, u, s, end);
}

static void *uring_main(void *arg)
{
    td_dio *io = arg;
    uring_state *u = io->uring;
    for (;;) {
        pthread_mutex_lock(&io->lock);
        while (u->n_free) {
            int s = u->free_slots[u->n_free - 1];
            if (!dio_next_xfer(io, &u->slots[s].x)) break;
            u->n_free--;
            pthread_mutex_unlock(&io->lock);
            start(io, u, s);
            pthread_mutex_lock(&io->lock);
        }
        if (!u->inflight) {
            int quit = io->stop && !io->fifo_n;
            if (!quit) pthread_cond_wait(&io->work, &io->lock);
            pthread_mutex_unlock(&io->lock);
            if (quit) break;
            continue;
        }
        pthread_mutex_unlock(&io->lock);
        io_uring_submit(&u->ring);
        struct io_uring_cqe *cqe;
        int rc = io_uring_wait_cqe(&u->ring, &cqe);
        if (rc == -EINTR) continue;
        if (rc < 0) { /* the ring itself failed: end every transfer in flight with its error */
            for (int s = 0; s < u->depth; s++) {
                int busy = 1;
                for (int i = 0; i < u->n_free; i++) busy &= u->free_slots[i] != s;
                if (busy) finish(io, u, s, -rc);
            }
            u->inflight = 0;
            continue;
        }
        unsigned head, seen = 0;
        io_uring_for_each_cqe(&u->ring, head, cqe) {
            complete(io, u, cqe);
            seen++;
        }
        io_uring_cq_advance(&u->ring, seen);
    }
    return NULL;
}

td_status dio_uring_start(td_dio *io)
{
    uring_state *u = td_calloc(1, sizeof *u, TD_ROLE_META);
    if (!u) return TD_ERR_NOMEM;
    u->depth = io->p.queue_depth;
    u->slots = td_calloc((size_t)u->depth, sizeof *u->slots, TD_ROLE_META);
    u->free_slots = td_calloc((size_t)u->depth, sizeof *u->free_slots, TD_ROLE_META);
    io->uring = u;
    if (!u->slots || !u->free_slots) {
        dio_uring_stop(io);
        return TD_ERR_NOMEM;
    }
    for (int s = u->depth - 1; s >= 0; s--) u->free_slots[u->n_free++] = s;
    int rc = io_uring_queue_init((unsigned)u->depth, &u->ring, 0);
    if (rc < 0) {
        dio_uring_stop(io);
        return td_error_set(TD_ERR_UNSUPPORTED, "the kernel refused a ring (%s%s)", strerror(-rc),
                            rc == -EPERM ? ": io_uring is disabled for this process (kernel.io_uring_disabled, or a "
                                           "container's seccomp filter)" : "");
    }
    u->ring_up = 1;
    rc = pthread_create(&u->thread, NULL, uring_main, io);
    if (rc) {
        dio_uring_stop(io);
        return td_error_set(TD_ERR_NOMEM, "cannot start the io_uring thread (%s)", strerror(rc));
    }
    u->started = 1;
    io->method = TD_DIO_URING;
    snprintf(io->describe, sizeof io->describe, "io_uring, %d transfers in flight", u->depth);
    return TD_OK;
}

/* After the engine's stop flag is set and its requests drained. */
void dio_uring_stop(td_dio *io)
{
    uring_state *u = io->uring;
    if (!u) return;
    if (u->started) {
        pthread_mutex_lock(&io->lock);
        io->stop = 1;
        pthread_cond_broadcast(&io->work);
        pthread_mutex_unlock(&io->lock);
        pthread_join(u->thread, NULL);
    }
    if (u->ring_up) io_uring_queue_exit(&u->ring);
    td_free(u->slots);
    td_free(u->free_slots);
    td_free(u);
    io->uring = NULL;
}
