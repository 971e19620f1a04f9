/* The cpu backend: the "device" is a capacity-limited region of host memory,
 * and the H2D and D2H queues are worker threads, so the whole offload stack
 * runs (and is tested) on a machine without a GPU.
 *
 *   compute  the calling thread: copies and memsets run at once, a record
 *            completes at once, a wait blocks the host until the event is done.
 *   H2D/D2H  one worker thread each, consuming a fixed ring of operations
 *            (copy, memset, record, wait) in order.  A full ring blocks the
 *            producer, so no operation allocates.
 *
 * Events follow CUDA: a wait or sync applies to the record that was the most
 * recent one when it was called.  Each record gets a generation number; the
 * records of one event on one queue complete in order, so an event keeps the
 * last completed generation per queue, and a record (gen, queue) is done when
 * done_gen[queue] >= gen.  (One counter for all queues would be wrong: a newer
 * record completing on a fast queue would release waiters of an older record
 * still pending on a slow one.)
 *
 * Debug mode catches missing waits: when a copy or memset starts on a worker
 * (after everything before it on its queue, so legal programs see nothing),
 * its destination is filled with 0xFF, the worker sleeps `cpu_debug_delay_us`,
 * then does the real work.  New device memory is also 0xFF.  Compute-queue
 * operations are synchronous, so there is no window to poison there.
 *
 * Device memory is anonymous host pages mapped per reservation, with a
 * one-page header in front that remembers its size, so a release uncounts
 * exactly without a table; td_backend_host_mapped_bytes gives their sum. */
#include "backend_impl.h"
#include "tidal/alloc.h"
#include "tidal/util.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

enum {
    RING_OPS = 4096,       /* pending operations per copy queue */
    DEV_ALIGN = 4096,      /* device memory alignment and header size */
    POISON = 0xFF,         /* NaN in every float format */
};

#define DEV_MAGIC 0x7d0dece5c0ffee00ull

typedef enum op_kind { OP_COPY, OP_MEMSET, OP_RECORD, OP_WAIT } op_kind;

typedef struct op {
    op_kind kind;
    int value;            /* OP_MEMSET */
    td_queue ev_queue;    /* OP_WAIT: the queue the awaited record was made on */
    void *dst;            /* OP_COPY, OP_MEMSET */
    const void *src;      /* OP_COPY */
    size_t bytes;
    td_event *ev;         /* OP_RECORD, OP_WAIT */
    uint64_t gen;
} op;

typedef struct cpu_backend cpu_backend;

typedef struct worker {
    cpu_backend *owner;
    td_queue queue;
    op *ring;              /* RING_OPS slots; ring[head] is the oldest pending op */
    size_t head, count;
    uint64_t submitted, finished;
    int stop, started;
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t has_work;   /* worker waits: count > 0 or stop */
    pthread_cond_t progress;   /* producers and syncers wait: an op finished */
} worker;

struct td_event {
    uint64_t recorded_gen;              /* the latest record; 0: never recorded */
    td_queue recorded_queue;
    uint64_t done_gen[TD_QUEUE_COUNT];  /* last completed record per queue */
    double done_ms[TD_QUEUE_COUNT];     /* when it completed (td_now_ms) */
    int in_rings;                       /* ops in worker rings that point here */
};

struct cpu_backend {
    td_backend base;
    size_t capacity_bytes;
    size_t reserved_bytes;     /* under dev_lock */
    size_t mapped_bytes;       /* the reservations' pages, headers included; under dev_lock */
    pthread_mutex_t dev_lock;
    int debug;
    long delay_us;
    pthread_mutex_t ev_lock;   /* guards every td_event of this backend */
    pthread_cond_t ev_done;    /* broadcast when a record completes or leaves a ring */
    worker workers[TD_QUEUE_COUNT]; /* the compute slot is unused */
};

typedef struct dev_header {
    size_t bytes;           /* as requested: what the reserved counter holds */
    uint64_t magic;
} dev_header;

static cpu_backend *cpu(td_backend *b) { return (cpu_backend *)b; }

static worker *worker_of(cpu_backend *c, td_queue q)
{
    return q == TD_QUEUE_COMPUTE ? NULL : &c->workers[q];
}

static const char *queue_name(td_queue q)
{
    static const char *names[TD_QUEUE_COUNT] = { "compute", "H2D", "D2H" };
    return names[q];
}

/* --- device memory -------------------------------------------------------- */

static td_status cpu_mem_info(td_backend *b, size_t *free_bytes, size_t *total_bytes)
{
    cpu_backend *c = cpu(b);
    pthread_mutex_lock(&c->dev_lock);
    *free_bytes = c->capacity_bytes - c->reserved_bytes;
    *total_bytes = c->capacity_bytes;
    pthread_mutex_unlock(&c->dev_lock);
    return TD_OK;
}

static td_status cpu_dev_reserve(td_backend *b, size_t bytes, void **ptr)
{
    cpu_backend *c = cpu(b);
    char s[32], cap[32], held[32];
    *ptr = NULL;
    pthread_mutex_lock(&c->dev_lock);
    size_t reserved = c->reserved_bytes;
    int fits = bytes <= c->capacity_bytes - reserved;
    if (fits) c->reserved_bytes += bytes;
    pthread_mutex_unlock(&c->dev_lock);
    if (!fits)
        return td_error_set(TD_ERR_DEVICE_MEM, "cannot reserve %s of device memory on the cpu backend: its device "
                            "region holds %s and %s is already reserved; raise --cpu-device-bytes (or TD_CPU_DEVICE_BYTES) or lower "
                            "--gpu-budget", td_format_bytes(bytes, s, sizeof s),
                            td_format_bytes(c->capacity_bytes, cap, sizeof cap),
                            td_format_bytes(reserved, held, sizeof held));
    /* Mapped, not malloc'd: the host holds exactly these pages (a
     * malloc rounds a large block up to its size class, a quarter more at
     * worst, which `tidal plan` could not foresee). */
    char *base = NULL;
    size_t mapped = bytes <= SIZE_MAX - 2 * (size_t)DEV_ALIGN ? DEV_ALIGN + td_align_up(bytes, DEV_ALIGN) : 0;
    if (mapped) {
        base = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (base == MAP_FAILED) base = NULL;
    }
    if (base) {
        madvise(base, mapped, MADV_HUGEPAGE); /* where the kernel offers them; a hint */
        pthread_mutex_lock(&c->dev_lock);
        c->mapped_bytes += mapped;
        pthread_mutex_unlock(&c->dev_lock);
    }
    if (!base) {
        pthread_mutex_lock(&c->dev_lock);
        c->reserved_bytes -= bytes;
        pthread_mutex_unlock(&c->dev_lock);
        return td_error_set(TD_ERR_DEVICE_MEM, "the host could not back %s of the cpu backend's device region "
                            "(%s already reserved): out of host memory; lower --cpu-device-bytes (or TD_CPU_DEVICE_BYTES) or --gpu-budget",
                            td_format_bytes(bytes, s, sizeof s), td_format_bytes(reserved, held, sizeof held));
    }
    dev_header *h = (dev_header *)base;
    h->bytes = bytes;
    h->magic = DEV_MAGIC;
    *ptr = base + DEV_ALIGN;
    if (c->debug) memset(*ptr, POISON, td_align_up(bytes, DEV_ALIGN)); /* fresh device memory is garbage */
    return TD_OK;
}

static void cpu_dev_release(td_backend *b, void *ptr)
{
    cpu_backend *c = cpu(b);
    dev_header *h = (dev_header *)((char *)ptr - DEV_ALIGN);
    if (h->magic != DEV_MAGIC) abort(); /* not from dev_reserve, or released twice */
    h->magic = 0;
    size_t mapped = DEV_ALIGN + td_align_up(h->bytes, DEV_ALIGN);
    pthread_mutex_lock(&c->dev_lock);
    c->reserved_bytes -= h->bytes;
    c->mapped_bytes -= mapped;
    pthread_mutex_unlock(&c->dev_lock);
    munmap(h, mapped);
}

static size_t cpu_host_mapped_bytes(td_backend *b)
{
    cpu_backend *c = cpu(b);
    pthread_mutex_lock(&c->dev_lock);
    size_t n = c->mapped_bytes;
    pthread_mutex_unlock(&c->dev_lock);
    return n;
}

/* Nothing to pin: every host page is as good as any other to a worker thread. */
static td_status cpu_host_register(td_backend *b, void *ptr, size_t bytes) { return TD_OK; }
static void cpu_host_unregister(td_backend *b, void *ptr) {}

/* --- workers ---------------------------------------------------------------- */

/* Record `gen` of ev, made on queue q, has completed; `from_ring` when a
 * worker ran it (the ring lets go of the event). */
static void event_complete(cpu_backend *c, td_event *ev, td_queue q, uint64_t gen, int from_ring)
{
    pthread_mutex_lock(&c->ev_lock);
    ev->done_gen[q] = gen;
    ev->done_ms[q] = td_now_ms();
    ev->in_rings -= from_ring;
    pthread_cond_broadcast(&c->ev_done);
    pthread_mutex_unlock(&c->ev_lock);
}

/* Caller holds ev_lock. */
static void event_await_locked(cpu_backend *c, td_event *ev, td_queue q, uint64_t gen)
{
    while (ev->done_gen[q] < gen) pthread_cond_wait(&c->ev_done, &c->ev_lock);
}

static void run_op(cpu_backend *c, td_queue q, const op *o)
{
    switch (o->kind) {
    case OP_COPY:
    case OP_MEMSET:
        if (c->debug) {
            memset(o->dst, POISON, o->bytes);
            td_sleep_us(c->delay_us);
        }
        if (o->kind == OP_COPY) memcpy(o->dst, o->src, o->bytes);
        else memset(o->dst, o->value, o->bytes);
        break;
    case OP_RECORD:
        event_complete(c, o->ev, q, o->gen, 1);
        break;
    case OP_WAIT:
        pthread_mutex_lock(&c->ev_lock);
        event_await_locked(c, o->ev, o->ev_queue, o->gen);
        o->ev->in_rings--;
        pthread_cond_broadcast(&c->ev_done); /* td_event_free may be waiting for the ring to let go */
        pthread_mutex_unlock(&c->ev_lock);
        break;
    }
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    pthread_mutex_lock(&w->lock);
    for (;;) {
        while (w->count == 0 && !w->stop) pthread_cond_wait(&w->has_work, &w->lock);
        if (w->count == 0) break; /* stopping, and everything submitted has run */
        op o = w->ring[w->head];
        pthread_mutex_unlock(&w->lock);
        run_op(w->owner, w->queue, &o);
        pthread_mutex_lock(&w->lock);
        w->head = (w->head + 1) % RING_OPS;
        w->count--;
        w->finished++;
        pthread_cond_broadcast(&w->progress);
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

/* Blocks while the ring is full. */
static void worker_push(worker *w, const op *o)
{
    pthread_mutex_lock(&w->lock);
    while (w->count == RING_OPS) pthread_cond_wait(&w->progress, &w->lock);
    w->ring[(w->head + w->count) % RING_OPS] = *o;
    w->count++;
    w->submitted++;
    pthread_cond_signal(&w->has_work);
    pthread_mutex_unlock(&w->lock);
}

static void worker_sync(worker *w)
{
    pthread_mutex_lock(&w->lock);
    uint64_t target = w->submitted;
    while (w->finished < target) pthread_cond_wait(&w->progress, &w->lock);
    pthread_mutex_unlock(&w->lock);
}

/* --- queues and events --------------------------------------------------------- */

static td_status cpu_copy_async(td_backend *b, td_queue q, void *dst, const void *src, size_t bytes)
{
    worker *w = worker_of(cpu(b), q);
    if (!w) memcpy(dst, src, bytes);
    else worker_push(w, &(op){ .kind = OP_COPY, .dst = dst, .src = src, .bytes = bytes });
    return TD_OK;
}

static td_status cpu_memset_async(td_backend *b, td_queue q, void *dst, int value, size_t bytes)
{
    worker *w = worker_of(cpu(b), q);
    if (!w) memset(dst, value, bytes);
    else worker_push(w, &(op){ .kind = OP_MEMSET, .dst = dst, .value = value, .bytes = bytes });
    return TD_OK;
}

static td_status cpu_event_create(td_backend *b, td_event **out)
{
    *out = td_calloc(1, sizeof **out, TD_ROLE_META);
    return *out ? TD_OK : TD_ERR_NOMEM;
}

/* Waits until no worker ring still points at the event (CUDA lets an event be
 * destroyed while recorded work is pending; here the ring holds a pointer). */
static void cpu_event_free(td_backend *b, td_event *ev)
{
    cpu_backend *c = cpu(b);
    pthread_mutex_lock(&c->ev_lock);
    while (ev->in_rings > 0) pthread_cond_wait(&c->ev_done, &c->ev_lock);
    pthread_mutex_unlock(&c->ev_lock);
    td_free(ev);
}

static td_status cpu_event_record(td_backend *b, td_event *ev, td_queue q)
{
    cpu_backend *c = cpu(b);
    worker *w = worker_of(c, q);
    pthread_mutex_lock(&c->ev_lock);
    uint64_t gen = ++ev->recorded_gen;
    ev->recorded_queue = q;
    if (w) ev->in_rings++;
    pthread_mutex_unlock(&c->ev_lock);
    /* Pushed outside ev_lock: a full ring blocks here until its worker, which
     * needs ev_lock to complete records, makes room. */
    if (w) worker_push(w, &(op){ .kind = OP_RECORD, .ev = ev, .gen = gen });
    else event_complete(c, ev, q, gen, 0); /* compute has already done everything before it */
    return TD_OK;
}

static td_status cpu_queue_wait_event(td_backend *b, td_queue q, td_event *ev)
{
    cpu_backend *c = cpu(b);
    worker *w = worker_of(c, q);
    pthread_mutex_lock(&c->ev_lock);
    uint64_t gen = ev->recorded_gen;
    td_queue rq = ev->recorded_queue;
    if (!w) event_await_locked(c, ev, rq, gen); /* compute is the host thread */
    int needed = w && rq != q && ev->done_gen[rq] < gen; /* same queue: FIFO already orders it */
    if (needed) ev->in_rings++;
    pthread_mutex_unlock(&c->ev_lock);
    if (needed) worker_push(w, &(op){ .kind = OP_WAIT, .ev = ev, .gen = gen, .ev_queue = rq });
    return TD_OK;
}

static td_status cpu_event_query(td_backend *b, td_event *ev, int *done)
{
    cpu_backend *c = cpu(b);
    pthread_mutex_lock(&c->ev_lock);
    *done = ev->done_gen[ev->recorded_queue] >= ev->recorded_gen;
    pthread_mutex_unlock(&c->ev_lock);
    return TD_OK;
}

static td_status cpu_event_sync(td_backend *b, td_event *ev)
{
    cpu_backend *c = cpu(b);
    pthread_mutex_lock(&c->ev_lock);
    event_await_locked(c, ev, ev->recorded_queue, ev->recorded_gen);
    pthread_mutex_unlock(&c->ev_lock);
    return TD_OK;
}

static td_status cpu_event_elapsed_ms(td_backend *b, td_event *start, td_event *end, float *ms)
{
    cpu_backend *c = cpu(b);
    td_status st = TD_OK;
    pthread_mutex_lock(&c->ev_lock);
    const td_event *evs[2] = { start, end };
    for (int i = 0; i < 2 && st == TD_OK; i++) {
        const td_event *ev = evs[i];
        if (ev->recorded_gen == 0)
            st = td_error_set(TD_ERR_STATE, "elapsed time: the %s event was never recorded", i ? "end" : "start");
        else if (ev->done_gen[ev->recorded_queue] < ev->recorded_gen)
            st = td_error_set(TD_ERR_STATE, "elapsed time: the %s event (recorded on %s) has not completed; "
                              "sync it first", i ? "end" : "start", queue_name(ev->recorded_queue));
    }
    if (st == TD_OK)
        *ms = (float)(end->done_ms[end->recorded_queue] - start->done_ms[start->recorded_queue]);
    pthread_mutex_unlock(&c->ev_lock);
    return st;
}

static td_status cpu_queue_sync(td_backend *b, td_queue q)
{
    worker *w = worker_of(cpu(b), q);
    if (w) worker_sync(w); /* compute runs synchronously: nothing pending */
    return TD_OK;
}

static void *cpu_native_queue(td_backend *b, td_queue q) { return NULL; }

static td_status cpu_pci_bus_id(td_backend *b, char *buf, size_t buf_bytes)
{
    return td_error_set(TD_ERR_UNSUPPORTED, "the cpu backend has no PCI device");
}

/* --- lifetime ------------------------------------------------------------------ */

/* Finishes everything submitted, joins the workers, frees.  Also undoes a
 * partial creation: workers not started have started == 0. */
static void cpu_destroy(td_backend *b)
{
    cpu_backend *c = cpu(b);
    for (int q = 0; q < TD_QUEUE_COUNT; q++) {
        worker *w = &c->workers[q];
        if (w->started) {
            pthread_mutex_lock(&w->lock);
            w->stop = 1;
            pthread_cond_signal(&w->has_work);
            pthread_mutex_unlock(&w->lock);
            pthread_join(w->thread, NULL);
        }
        td_free(w->ring);
        pthread_cond_destroy(&w->progress);
        pthread_cond_destroy(&w->has_work);
        pthread_mutex_destroy(&w->lock);
    }
    pthread_cond_destroy(&c->ev_done);
    pthread_mutex_destroy(&c->ev_lock);
    pthread_mutex_destroy(&c->dev_lock);
    td_free(c);
}

static const td_backend_ops cpu_ops = {
    .destroy = cpu_destroy,
    .mem_info = cpu_mem_info,
    .dev_reserve = cpu_dev_reserve,
    .dev_release = cpu_dev_release,
    .host_register = cpu_host_register,
    .host_unregister = cpu_host_unregister,
    .copy_async = cpu_copy_async,
    .memset_async = cpu_memset_async,
    .event_create = cpu_event_create,
    .event_free = cpu_event_free,
    .event_record = cpu_event_record,
    .queue_wait_event = cpu_queue_wait_event,
    .event_query = cpu_event_query,
    .event_sync = cpu_event_sync,
    .event_elapsed_ms = cpu_event_elapsed_ms,
    .queue_sync = cpu_queue_sync,
    .native_queue = cpu_native_queue,
    .pci_bus_id = cpu_pci_bus_id,
    .host_mapped_bytes = cpu_host_mapped_bytes,
};

static td_status worker_start(cpu_backend *c, td_queue q)
{
    worker *w = &c->workers[q];
    w->ring = td_malloc(RING_OPS * sizeof *w->ring, TD_ROLE_META);
    if (!w->ring) return td_error_prefix(TD_ERR_NOMEM, "cpu backend %s queue: ", queue_name(q));
    int e = pthread_create(&w->thread, NULL, worker_main, w);
    if (e)
        return td_error_set(TD_ERR_BACKEND, "cannot start the cpu backend's %s worker thread: %s; the process "
                            "may be at its thread limit (ulimit -u)", queue_name(q), strerror(e));
    w->started = 1;
    char name[16];
    snprintf(name, sizeof name, "tidal-%s", queue_name(q));
    pthread_setname_np(w->thread, name); /* cosmetic: shows in top and debuggers */
    return TD_OK;
}

td_status td_backend_cpu_create(const td_backend_params *params, td_backend **out)
{
    td_status st = TD_OK;
    *out = NULL;
    if (params->cpu_device_bytes == 0)
        return td_error_set(TD_ERR_INVALID, "the cpu backend's device region cannot be 0 bytes; "
                            "give --cpu-device-bytes or TD_CPU_DEVICE_BYTES (e.g. 4GiB)");
    if (params->cpu_debug && params->cpu_debug_delay_us < 0)
        return td_error_set(TD_ERR_INVALID, "cpu debug delay of %ld us is negative; set TD_CPU_DEBUG_DELAY_US >= 0",
                            params->cpu_debug_delay_us);
    cpu_backend *c = td_calloc(1, sizeof *c, TD_ROLE_META);
    if (!c) return td_error_prefix(TD_ERR_NOMEM, "creating the cpu backend: ");
    /* Every lock exists before anything can fail, so cpu_destroy undoes any prefix. */
    pthread_mutex_init(&c->dev_lock, NULL);
    pthread_mutex_init(&c->ev_lock, NULL);
    pthread_cond_init(&c->ev_done, NULL);
    for (int q = 0; q < TD_QUEUE_COUNT; q++) {
        worker *w = &c->workers[q];
        w->owner = c;
        w->queue = (td_queue)q;
        pthread_mutex_init(&w->lock, NULL);
        pthread_cond_init(&w->has_work, NULL);
        pthread_cond_init(&w->progress, NULL);
    }
    c->base.ops = &cpu_ops;
    c->base.kind = TD_BACKEND_CPU;
    snprintf(c->base.name, sizeof c->base.name, "cpu");
    c->capacity_bytes = params->cpu_device_bytes;
    c->debug = params->cpu_debug != 0;
    c->delay_us = c->debug ? params->cpu_debug_delay_us : 0;
    for (int q = 0; q < TD_QUEUE_COUNT; q++)
        if (q != TD_QUEUE_COMPUTE) TD_TRY(worker_start(c, (td_queue)q));
    char cap[32];
    td_format_bytes(c->capacity_bytes, cap, sizeof cap);
    if (c->debug)
        snprintf(c->base.description, sizeof c->base.description,
                 "cpu (device region %s, debug: %ld us delay + poison)", cap, c->delay_us);
    else
        snprintf(c->base.description, sizeof c->base.description, "cpu (device region %s)", cap);
    *out = &c->base;
    return TD_OK;
cleanup:
    cpu_destroy(&c->base);
    return st;
}
