/* The copy engine (see include/tidal/copy.h). */
#include "tidal/copy.h"
#include "tidal/alloc.h"
#include "tidal/util.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

typedef struct ring {
    td_event **events;
    uint64_t *seq_of_slot;  /* seq of the last record in each slot */
    uint64_t next_seq;      /* seqs start at 1 */
    pthread_mutex_t lock;
} ring;

struct td_copy_engine {
    td_backend *backend;
    td_copy_params params;
    ring rings[TD_QUEUE_COUNT];
    _Atomic uint64_t bytes[TD_COPY_DIR_COUNT], copies[TD_COPY_DIR_COUNT], host_waits;
    pthread_mutex_t stats_lock;
    double host_wait_ms;
};

static const td_queue dir_queue[TD_COPY_DIR_COUNT] = { TD_QUEUE_H2D, TD_QUEUE_D2H };

td_copy_params td_copy_default_params(void)
{
    return (td_copy_params){ .chunk_bytes = 64 * TD_MiB, .events_per_queue = 256 };
}

td_status td_copy_engine_create(td_backend *b, const td_copy_params *params, td_copy_engine **out)
{
    td_status st = TD_OK;
    *out = NULL;
    td_copy_engine *e = td_calloc(1, sizeof *e, TD_ROLE_META);
    if (!e) return TD_ERR_NOMEM;
    e->backend = b;
    e->params = params ? *params : td_copy_default_params();
    if (e->params.chunk_bytes == 0) e->params.chunk_bytes = 64 * TD_MiB;
    if (e->params.events_per_queue < 2) e->params.events_per_queue = 256;
    pthread_mutex_init(&e->stats_lock, NULL);
    int n = e->params.events_per_queue;
    for (int q = 0; q < TD_QUEUE_COUNT; q++) {
        ring *r = &e->rings[q];
        pthread_mutex_init(&r->lock, NULL);
        r->next_seq = 1;
        r->events = td_calloc((size_t)n, sizeof *r->events, TD_ROLE_META);
        r->seq_of_slot = td_calloc((size_t)n, sizeof *r->seq_of_slot, TD_ROLE_META);
        if (!r->events || !r->seq_of_slot) { st = TD_ERR_NOMEM; goto cleanup; }
        for (int i = 0; i < n; i++) TD_TRY(td_event_create(b, &r->events[i]));
    }
    *out = e;
    return TD_OK;
cleanup:
    td_copy_engine_destroy(e);
    return st;
}

void td_copy_engine_destroy(td_copy_engine *e)
{
    if (!e) return;
    for (int q = 0; q < TD_QUEUE_COUNT; q++) {
        ring *r = &e->rings[q];
        if (q != TD_QUEUE_COMPUTE) td_queue_sync(e->backend, (td_queue)q);
        if (r->events)
            for (int i = 0; i < e->params.events_per_queue; i++) td_event_free(e->backend, r->events[i]);
        td_free(r->events);
        td_free(r->seq_of_slot);
        pthread_mutex_destroy(&r->lock);
    }
    pthread_mutex_destroy(&e->stats_lock);
    td_free(e);
}

/* Caller holds r->lock.  Records the next event of queue q. */
static td_status record_locked(td_copy_engine *e, td_queue q, td_copy_ticket *out)
{
    ring *r = &e->rings[q];
    uint32_t slot = (uint32_t)(r->next_seq % (uint64_t)e->params.events_per_queue);
    td_status st;
    if (r->seq_of_slot[slot]) { /* reuse: the old record must be complete first */
        st = td_event_sync(e->backend, r->events[slot]);
        if (st) return st;
    }
    st = td_event_record(e->backend, r->events[slot], q);
    if (st) return st;
    r->seq_of_slot[slot] = r->next_seq;
    if (out) *out = (td_copy_ticket){ .seq = r->next_seq, .queue = (uint32_t)q, .slot = slot };
    r->next_seq++;
    return TD_OK;
}

static td_status check_ticket(td_copy_engine *e, const td_copy_ticket *t)
{
    if (t->queue >= TD_QUEUE_COUNT || t->slot >= (uint32_t)e->params.events_per_queue)
        return td_error_set(TD_ERR_INVALID, "copy engine: malformed ticket (queue %u, slot %u)", t->queue, t->slot);
    return TD_OK;
}

/* Whether the ticket's slot still holds its record (else it completed and was reused). */
static int ticket_live(td_copy_engine *e, const td_copy_ticket *t)
{
    ring *r = &e->rings[t->queue];
    pthread_mutex_lock(&r->lock);
    int live = r->seq_of_slot[t->slot] == t->seq;
    pthread_mutex_unlock(&r->lock);
    return live;
}

td_status td_copy_order(td_copy_engine *e, td_queue q, const td_copy_ticket *t)
{
    if (!t || t->seq == 0) return TD_OK;
    td_status st = check_ticket(e, t);
    if (st) return st;
    if ((td_queue)t->queue == q || !ticket_live(e, t)) return TD_OK; /* same-queue order is implicit */
    return td_queue_wait_event(e->backend, q, e->rings[t->queue].events[t->slot]);
}

td_status td_copy_submit(td_copy_engine *e, td_copy_dir dir, void *dst, const void *src, size_t bytes,
                         const td_copy_ticket *after, td_copy_ticket *out)
{
    return td_copy_submit_timed(e, dir, dst, src, bytes, after, NULL, NULL, out);
}

td_status td_copy_submit_timed(td_copy_engine *e, td_copy_dir dir, void *dst, const void *src, size_t bytes,
                               const td_copy_ticket *after, td_event *start, td_event *end, td_copy_ticket *out)
{
    if ((unsigned)dir >= TD_COPY_DIR_COUNT) return td_error_set(TD_ERR_INVALID, "copy engine: no direction %d", (int)dir);
    td_queue q = dir_queue[dir];
    ring *r = &e->rings[q];
    td_status st;
    pthread_mutex_lock(&r->lock);
    if (after && after->seq && (td_queue)after->queue != q) {
        /* The other ring's lock is not needed: slot reuse only ever waits, so
         * ordering on a reused slot's newer record is merely conservative. */
        st = check_ticket(e, after);
        if (st == TD_OK)
            st = td_queue_wait_event(e->backend, q, e->rings[after->queue].events[after->slot]);
        if (st) goto out;
    }
    if (start && (st = td_event_record(e->backend, start, q))) goto out;
    for (size_t done = 0; done < bytes;) {
        size_t piece = bytes - done < e->params.chunk_bytes ? bytes - done : e->params.chunk_bytes;
        st = td_backend_copy_async(e->backend, q, (char *)dst + done, (const char *)src + done, piece);
        if (st) goto out;
        done += piece;
    }
    if (end && (st = td_event_record(e->backend, end, q))) goto out;
    st = record_locked(e, q, out);
    if (st == TD_OK) {
        atomic_fetch_add(&e->bytes[dir], bytes);
        atomic_fetch_add(&e->copies[dir], 1);
    }
out:
    pthread_mutex_unlock(&r->lock);
    return st;
}

td_status td_copy_mark(td_copy_engine *e, td_queue q, td_copy_ticket *out)
{
    if ((unsigned)q >= TD_QUEUE_COUNT) return td_error_set(TD_ERR_INVALID, "copy engine: no queue %d", (int)q);
    ring *r = &e->rings[q];
    pthread_mutex_lock(&r->lock);
    td_status st = record_locked(e, q, out);
    pthread_mutex_unlock(&r->lock);
    return st;
}

td_status td_copy_done(td_copy_engine *e, const td_copy_ticket *t, int *done)
{
    *done = 1;
    if (!t || t->seq == 0) return TD_OK;
    td_status st = check_ticket(e, t);
    if (st || !ticket_live(e, t)) return st;
    return td_event_query(e->backend, e->rings[t->queue].events[t->slot], done);
}

td_status td_copy_wait(td_copy_engine *e, const td_copy_ticket *t)
{
    int done;
    td_status st = td_copy_done(e, t, &done);
    if (st || done) return st;
    double t0 = td_now_ms();
    st = td_event_sync(e->backend, e->rings[t->queue].events[t->slot]);
    double waited = td_now_ms() - t0;
    atomic_fetch_add(&e->host_waits, 1);
    pthread_mutex_lock(&e->stats_lock);
    e->host_wait_ms += waited;
    pthread_mutex_unlock(&e->stats_lock);
    return st;
}

td_status td_copy_drain(td_copy_engine *e)
{
    for (int d = 0; d < TD_COPY_DIR_COUNT; d++) {
        td_status st = td_queue_sync(e->backend, dir_queue[d]);
        if (st) return st;
    }
    return TD_OK;
}

void td_copy_get_stats(td_copy_engine *e, td_copy_stats *out)
{
    for (int d = 0; d < TD_COPY_DIR_COUNT; d++) {
        out->bytes[d] = atomic_load(&e->bytes[d]);
        out->copies[d] = atomic_load(&e->copies[d]);
    }
    out->host_waits = atomic_load(&e->host_waits);
    pthread_mutex_lock(&e->stats_lock);
    out->host_wait_ms = e->host_wait_ms;
    pthread_mutex_unlock(&e->stats_lock);
}

td_backend *td_copy_backend(td_copy_engine *e) { return e->backend; }
