/* The cpu backend itself: its debug mode (a reader that skips a wait sees
 * 0xFF poison, a reader that waits sees the data, legal programs see
 * nothing), its device region (capacity, accounting, poisoned fresh memory),
 * its worker threads (bounded ring, clean shutdown after pending work, no
 * thread or byte leaked when creation fails at any allocation), and its
 * queues driven from several threads. */
#include "td_test.h"

#include <dirent.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

static td_backend *open_cpu(size_t device_bytes, int debug, long delay_us)
{
    td_backend_params p = td_backend_default_params();
    p.kind = TD_BACKEND_CPU;
    p.cpu_device_bytes = device_bytes;
    p.cpu_debug = debug;
    p.cpu_debug_delay_us = delay_us;
    td_backend *b = NULL;
    TD_ASSERT_OK(td_backend_create(&p, &b));
    return b;
}

static int thread_count(void)
{
    DIR *d = opendir("/proc/self/task");
    assert_non_null(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

/* A joined thread leaves /proc/self/task a moment after pthread_join returns. */
static void assert_threads(int expected)
{
    double t0 = td_now_ms();
    while (thread_count() != expected && td_now_ms() - t0 < 1000) td_sleep_us(100);
    assert_int_equal(thread_count(), expected);
}

/* Waits (up to 5 s) until the worker has begun the operation writing `p`,
 * i.e. its first byte turned to poison. */
static void await_poison(const volatile unsigned char *p)
{
    double t0 = td_now_ms();
    while (p[0] != 0xFF) {
        if (td_now_ms() - t0 > 5000) fail_msg("the copy never started");
        td_sleep_us(20);
    }
}

/* Whether now is surely before the real copy of an operation submitted at
 * `submit_ms`: the copy begins at least one delay after its poison, which
 * begins after the submit.  A host stalled longer than that (a loaded
 * machine) makes a round inconclusive, and it is tried again. */
static int before_copy(double submit_ms, double delay_ms) { return td_now_ms() - submit_ms < 0.75 * delay_ms; }

/* What a reader that skipped the wait sees: every byte is poison or the old
 * value, none is the new one. */
static int snapshot_is_garbage(const volatile unsigned char *p, size_t n, double submit_ms, double delay_ms,
                               int old_value, int new_value)
{
    unsigned char *copy = malloc(n);
    assert_non_null(copy);
    for (size_t i = 0; i < n; i++) copy[i] = p[i];
    int conclusive = before_copy(submit_ms, delay_ms);
    if (conclusive) {
        size_t poisoned = 0;
        for (size_t i = 0; i < n; i++) {
            if (copy[i] == new_value) fail_msg("byte %zu already holds the new value before the copy ran", i);
            if (copy[i] != 0xFF && copy[i] != old_value) fail_msg("byte %zu is 0x%02x", i, copy[i]);
            poisoned += copy[i] == 0xFF;
        }
        assert_true(poisoned > 0);
    }
    free(copy);
    return conclusive;
}

/* The bug debug mode exists to catch: a compute "kernel" reading an uploaded
 * buffer without ordering itself after the upload reads poison; one that
 * waits on the upload's event reads the data.  Same for a host reading a
 * download's destination without syncing on its event. */
static void test_forgotten_wait_reads_poison(void **state)
{
    long delay_us = 40000;
    td_backend *b = open_cpu(64 * TD_MiB, 1, delay_us);
    size_t n = 64 * TD_KiB;
    unsigned char *host = malloc(n), *back = malloc(n), *kernel_in = malloc(n);
    assert_non_null(host);
    assert_non_null(back);
    assert_non_null(kernel_in);
    unsigned char *dev;
    TD_ASSERT_OK(td_backend_dev_reserve(b, n, (void **)&dev));
    td_event *ev;
    TD_ASSERT_OK(td_event_create(b, &ev));
    int proven_up = 0, proven_down = 0;
    for (int attempt = 0; attempt < 5 && !(proven_up && proven_down); attempt++) {
        /* Upload, then a kernel that forgot td_queue_wait_event. */
        memset(dev, 0x22, n);
        memset(host, 0x11, n);
        double t0 = td_now_ms();
        TD_ASSERT_OK(td_backend_copy_async(b, TD_QUEUE_H2D, dev, host, n));
        TD_ASSERT_OK(td_event_record(b, ev, TD_QUEUE_H2D));
        await_poison(dev);
        proven_up |= snapshot_is_garbage(dev, n, t0, delay_us / 1000.0, 0x22, 0x11);
        int done;
        TD_ASSERT_OK(td_event_query(b, ev, &done));
        if (before_copy(t0, delay_us / 1000.0)) assert_false(done);
        /* The correct kernel. */
        TD_ASSERT_OK(td_queue_wait_event(b, TD_QUEUE_COMPUTE, ev));
        memcpy(kernel_in, dev, n);
        assert_memory_equal(kernel_in, host, n);

        /* Download, then a host that reads before td_event_sync. */
        memset(back, 0x33, n);
        t0 = td_now_ms();
        TD_ASSERT_OK(td_backend_copy_async(b, TD_QUEUE_D2H, back, dev, n));
        TD_ASSERT_OK(td_event_record(b, ev, TD_QUEUE_D2H));
        await_poison(back);
        proven_down |= snapshot_is_garbage(back, n, t0, delay_us / 1000.0, 0x33, 0x11);
        TD_ASSERT_OK(td_event_sync(b, ev));
        assert_memory_equal(back, host, n);
    }
    assert_true(proven_up && proven_down);
    td_event_free(b, ev);
    td_backend_dev_release(b, dev);
    td_backend_free(b);
    free(host);
    free(back);
    free(kernel_in);
}

/* A memset is poisoned the same way. */
static void test_memset_poisoned_until_done(void **state)
{
    long delay_us = 40000;
    td_backend *b = open_cpu(64 * TD_MiB, 1, delay_us);
    size_t n = 32 * TD_KiB;
    unsigned char *dev;
    TD_ASSERT_OK(td_backend_dev_reserve(b, n, (void **)&dev));
    int proven = 0;
    for (int attempt = 0; attempt < 5 && !proven; attempt++) {
        memset(dev, 0x22, n);
        double t0 = td_now_ms();
        TD_ASSERT_OK(td_backend_memset_async(b, TD_QUEUE_D2H, dev, 0x11, n));
        await_poison(dev);
        proven = snapshot_is_garbage(dev, n, t0, delay_us / 1000.0, 0x22, 0x11);
        TD_ASSERT_OK(td_queue_sync(b, TD_QUEUE_D2H));
        for (size_t i = 0; i < n; i++) assert_int_equal(dev[i], 0x11);
    }
    assert_true(proven);
    td_backend_dev_release(b, dev);
    td_backend_free(b);
}

/* Poison starts only when the operation starts, after its queue
 * predecessors: while the first copy on a queue is in flight, the second
 * one's destination is untouched.  So legal stream-ordered code never sees
 * poison. */
static void test_poison_waits_for_queue_predecessors(void **state)
{
    long delay_us = 40000;
    td_backend *b = open_cpu(64 * TD_MiB, 1, delay_us);
    size_t n = 16 * TD_KiB;
    unsigned char *src = malloc(n), *dst1 = malloc(n), *dst2 = malloc(n);
    assert_non_null(src);
    assert_non_null(dst1);
    assert_non_null(dst2);
    memset(src, 0x11, n);
    memset(dst1, 0x22, n);
    memset(dst2, 0x22, n);
    double t0 = td_now_ms();
    TD_ASSERT_OK(td_backend_copy_async(b, TD_QUEUE_H2D, dst1, src, n));
    TD_ASSERT_OK(td_backend_copy_async(b, TD_QUEUE_H2D, dst2, src, n));
    await_poison(dst1);
    int intact = 1;
    for (size_t i = 0; i < n; i++) intact &= ((volatile unsigned char *)dst2)[i] == 0x22;
    if (before_copy(t0, delay_us / 1000.0)) assert_true(intact); /* else inconclusive: host stalled */
    TD_ASSERT_OK(td_queue_sync(b, TD_QUEUE_H2D));
    assert_memory_equal(dst1, src, n);
    assert_memory_equal(dst2, src, n);
    td_backend_free(b);
    free(src);
    free(dst1);
    free(dst2);
}

/* Fresh device memory is garbage (0xFF) in debug mode: code that reads a
 * buffer it never wrote fails. */
static void test_new_device_memory_is_poisoned(void **state)
{
    td_backend *b = open_cpu(8 * TD_MiB, 1, 0);
    size_t n = TD_MiB + 3;
    unsigned char *dev;
    TD_ASSERT_OK(td_backend_dev_reserve(b, n, (void **)&dev));
    for (size_t i = 0; i < n; i++)
        if (dev[i] != 0xFF) fail_msg("byte %zu of fresh device memory is 0x%02x", i, dev[i]);
    td_backend_dev_release(b, dev);
    td_backend_free(b);
}

/* Reservations are 4096-aligned, counted exactly as requested, and never
 * exceed the capacity, also when threads race for the last bytes. */
typedef struct racer {
    td_backend *b;
    void *got[64];
    int count, unexpected; /* checked by the main thread: cmocka asserts are not thread-safe */
} racer;

static void *race_reserve(void *arg)
{
    racer *r = arg;
    for (int i = 0; i < 64; i++) {
        void *p;
        td_status st = td_backend_dev_reserve(r->b, 10000, &p);
        if (st == TD_OK) r->got[r->count++] = p;
        else if (st != TD_ERR_DEVICE_MEM) r->unexpected++;
    }
    return NULL;
}

static void test_device_region_accounting(void **state)
{
    size_t cap = 1000000;
    td_backend *b = open_cpu(cap, 0, 0);
    size_t free_b, total_b;
    TD_ASSERT_OK(td_backend_mem_info(b, &free_b, &total_b));
    assert_int_equal(total_b, cap);
    assert_int_equal(free_b, cap);
    void *a, *c;
    TD_ASSERT_OK(td_backend_dev_reserve(b, 4097, &a));
    TD_ASSERT_OK(td_backend_dev_reserve(b, 1, &c));
    assert_int_equal((uintptr_t)a % 4096, 0);
    assert_int_equal((uintptr_t)c % 4096, 0);
    memset(a, 1, 4097);
    memset(c, 2, 1);
    TD_ASSERT_OK(td_backend_mem_info(b, &free_b, &total_b));
    assert_int_equal(free_b, cap - 4098);
    td_backend_dev_release(b, a);
    TD_ASSERT_OK(td_backend_mem_info(b, &free_b, &total_b));
    assert_int_equal(free_b, cap - 1);
    td_backend_dev_release(b, c);

    racer r[4] = {{0}};
    pthread_t t[4];
    for (int i = 0; i < 4; i++) {
        r[i].b = b;
        assert_int_equal(pthread_create(&t[i], NULL, race_reserve, &r[i]), 0);
    }
    int total = 0;
    for (int i = 0; i < 4; i++) {
        pthread_join(t[i], NULL);
        total += r[i].count;
        assert_int_equal(r[i].unexpected, 0);
    }
    assert_int_equal(total, (int)(cap / 10000)); /* exactly as many as fit */
    TD_ASSERT_OK(td_backend_mem_info(b, &free_b, &total_b));
    assert_int_equal(free_b, cap % 10000);
    for (int i = 0; i < 4; i++)
        for (int k = 0; k < r[i].count; k++) td_backend_dev_release(b, r[i].got[k]);
    TD_ASSERT_OK(td_backend_mem_info(b, &free_b, &total_b));
    assert_int_equal(free_b, cap);
    td_backend_free(b);
}

static void test_describe_and_stubs(void **state)
{
    td_backend *b = open_cpu(512 * TD_MiB, 1, 2000);
    assert_string_equal(td_backend_describe(b), "cpu (device region 512.00 MiB, debug: 2000 us delay + poison)");
    assert_string_equal(td_backend_name(b), "cpu");
    assert_int_equal(td_backend_get_kind(b), TD_BACKEND_CPU);
    td_backend_free(b);
    b = open_cpu(4 * TD_GiB, 0, 2000);
    assert_string_equal(td_backend_describe(b), "cpu (device region 4.00 GiB)");
    char bus[32];
    assert_int_equal(td_backend_pci_bus_id(b, bus, sizeof bus), TD_ERR_UNSUPPORTED);
    assert_null(td_backend_native_queue(b, TD_QUEUE_H2D));
    int x[4];
    TD_ASSERT_OK(td_backend_host_register(b, x, sizeof x)); /* nothing to pin */
    td_backend_host_unregister(b, x);
    td_backend_free(b);
}

static void test_invalid_params(void **state)
{
    size_t live = td_host_live_allocs();
    td_backend_params p = td_backend_default_params();
    p.kind = TD_BACKEND_CPU;
    td_backend *b = (td_backend *)&p;
    p.cpu_device_bytes = 0;
    assert_int_equal(td_backend_create(&p, &b), TD_ERR_INVALID);
    assert_null(b);
    assert_non_null(strstr(td_error_msg(), "TD_CPU_DEVICE_BYTES"));
    p.cpu_device_bytes = TD_MiB;
    p.cpu_debug = 1;
    p.cpu_debug_delay_us = -5;
    assert_int_equal(td_backend_create(&p, &b), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "-5"));
    assert_int_equal(td_host_live_allocs(), live);
}

/* Creation fails at the n-th host allocation for every n it reaches — before
 * any worker exists, and after the first worker thread runs — returning an
 * error and leaving no byte and no thread behind. */
static void test_create_fault_sweep(void **state)
{
    size_t live = td_host_live_allocs(), used = td_host_used_total();
    int threads = thread_count();
    td_backend_params p = td_backend_default_params();
    p.kind = TD_BACKEND_CPU;
    p.cpu_device_bytes = TD_MiB;
    long n = 1;
    for (;; n++) {
        td_backend *b = NULL;
        td_fault_arm(TD_FAULT_HOST_ALLOC, n);
        td_status st = td_backend_create(&p, &b);
        long reached = td_fault_count(TD_FAULT_HOST_ALLOC);
        td_fault_disarm_all();
        if (reached < n) {
            TD_ASSERT_OK(st);
            assert_threads(threads + 2); /* the H2D and D2H workers */
            td_backend_free(b);
            break;
        }
        if (st == TD_OK) fail_msg("allocation %ld failed but creation succeeded", n);
        assert_null(b);
        assert_true(st == TD_ERR_NOMEM || st == TD_ERR_FAULT);
        assert_true(strlen(td_error_msg()) > 0);
        assert_int_equal(td_host_live_allocs(), live);
        assert_int_equal(td_host_used_total(), used);
        assert_threads(threads);
    }
    assert_true(n - 1 >= 3); /* the struct and both rings, the last after a worker started */
    assert_int_equal(td_host_live_allocs(), live);
    assert_threads(threads);
}

/* td_backend_free finishes what was submitted, then joins the workers. */
static void test_free_finishes_pending_work(void **state)
{
    int threads = thread_count();
    td_backend *b = open_cpu(TD_MiB, 1, 2000);
    enum { COPIES = 4 };
    size_t n = 8 * TD_KiB;
    unsigned char *src = malloc(n), *dst[2][COPIES];
    assert_non_null(src);
    memset(src, 0x5C, n);
    for (int q = 0; q < 2; q++)
        for (int i = 0; i < COPIES; i++) {
            dst[q][i] = calloc(1, n);
            assert_non_null(dst[q][i]);
            TD_ASSERT_OK(td_backend_copy_async(b, q ? TD_QUEUE_D2H : TD_QUEUE_H2D, dst[q][i], src, n));
        }
    td_backend_free(b);
    for (int q = 0; q < 2; q++)
        for (int i = 0; i < COPIES; i++) {
            assert_memory_equal(dst[q][i], src, n);
            free(dst[q][i]);
        }
    free(src);
    assert_threads(threads);
}

/* More operations than the ring holds, queued behind a wait that cannot
 * finish yet: the producer blocks instead of allocating, and every copy
 * still lands in order. */
static void test_full_ring_blocks_producer(void **state)
{
    td_backend *b = open_cpu(256 * TD_MiB, 0, 0);
    size_t big = 128 * TD_MiB;
    void *slow;
    TD_ASSERT_OK(td_backend_dev_reserve(b, big, &slow));
    td_event *ev;
    TD_ASSERT_OK(td_event_create(b, &ev));
    TD_ASSERT_OK(td_backend_memset_async(b, TD_QUEUE_D2H, slow, 1, big)); /* tens of ms: first touch of 128 MiB */
    TD_ASSERT_OK(td_event_record(b, ev, TD_QUEUE_D2H));
    TD_ASSERT_OK(td_queue_wait_event(b, TD_QUEUE_H2D, ev));
    enum { OPS = 3 * 4096 + 5 };
    unsigned char *src = malloc(OPS), *dst = calloc(1, OPS);
    assert_non_null(src);
    assert_non_null(dst);
    for (int i = 0; i < OPS; i++) src[i] = (unsigned char)(i * 31 + 7);
    size_t live = td_host_live_allocs();
    for (int i = 0; i < OPS; i++) TD_ASSERT_OK(td_backend_copy_async(b, TD_QUEUE_H2D, dst + i, src + i, 1));
    assert_int_equal(td_host_live_allocs(), live); /* no allocation per operation */
    int done;
    /* The producer got past the ring only because the worker drained it,
     * which needed the wait, which needed the memset: all done by now. */
    TD_ASSERT_OK(td_event_query(b, ev, &done));
    assert_true(done);
    TD_ASSERT_OK(td_queue_sync(b, TD_QUEUE_H2D));
    assert_memory_equal(dst, src, OPS);
    td_event_free(b, ev);
    td_backend_dev_release(b, slow);
    td_backend_free(b);
    free(src);
    free(dst);
}

/* Compute is the calling thread: its copies are done on return, its records
 * complete at once, and its waits block the host until the event is done. */
static void test_compute_queue_is_the_host(void **state)
{
    long delay_us = 20000;
    td_backend *b = open_cpu(TD_MiB, 1, delay_us);
    size_t n = 4 * TD_KiB;
    unsigned char *src = malloc(n), *dst = malloc(n), *up = malloc(n);
    assert_non_null(src);
    assert_non_null(dst);
    assert_non_null(up);
    memset(src, 0x44, n);
    memset(dst, 0, n);
    TD_ASSERT_OK(td_backend_copy_async(b, TD_QUEUE_COMPUTE, dst, src, n));
    assert_memory_equal(dst, src, n);
    td_event *ev;
    TD_ASSERT_OK(td_event_create(b, &ev));
    TD_ASSERT_OK(td_event_record(b, ev, TD_QUEUE_COMPUTE));
    int done = 0;
    TD_ASSERT_OK(td_event_query(b, ev, &done));
    assert_true(done);
    memset(up, 0, n);
    double t0 = td_now_ms();
    TD_ASSERT_OK(td_backend_copy_async(b, TD_QUEUE_H2D, up, src, n));
    TD_ASSERT_OK(td_event_record(b, ev, TD_QUEUE_H2D));
    TD_ASSERT_OK(td_queue_wait_event(b, TD_QUEUE_COMPUTE, ev));
    assert_true(td_now_ms() - t0 >= 0.9 * delay_us / 1000.0);
    assert_memory_equal(up, src, n);
    td_event_free(b, ev);
    td_backend_free(b);
    free(src);
    free(dst);
    free(up);
}

/* Two host threads drive the two copy queues: one uploads and records, the
 * other orders its downloads after those records without blocking. */
enum { XT_ROUNDS = 24, XT_BYTES = 4096 };

typedef struct xthreads {
    td_backend *b;
    td_event *ev[XT_ROUNDS];
    unsigned char *src[XT_ROUNDS], *dst[XT_ROUNDS];
    unsigned char *dev[XT_ROUNDS];
    atomic_int published;
    td_status st_up, st_down; /* checked by the main thread */
} xthreads;

static void *xt_uploader(void *arg)
{
    xthreads *x = arg;
    for (int r = 0; r < XT_ROUNDS && !x->st_up; r++) {
        x->st_up = td_backend_copy_async(x->b, TD_QUEUE_H2D, x->dev[r], x->src[r], XT_BYTES);
        if (!x->st_up) x->st_up = td_event_record(x->b, x->ev[r], TD_QUEUE_H2D);
        atomic_store(&x->published, r + 1);
    }
    return NULL;
}

static void *xt_downloader(void *arg)
{
    xthreads *x = arg;
    for (int r = 0; r < XT_ROUNDS && !x->st_down; r++) {
        while (atomic_load(&x->published) <= r) td_sleep_us(10);
        x->st_down = td_queue_wait_event(x->b, TD_QUEUE_D2H, x->ev[r]);
        if (!x->st_down) x->st_down = td_backend_copy_async(x->b, TD_QUEUE_D2H, x->dst[r], x->dev[r], XT_BYTES);
    }
    if (!x->st_down) x->st_down = td_queue_sync(x->b, TD_QUEUE_D2H);
    return NULL;
}

static void test_queues_driven_from_two_threads(void **state)
{
    for (int debug = 0; debug < 2; debug++) {
        xthreads x = { .b = open_cpu(TD_MiB, debug, 500) };
        for (int r = 0; r < XT_ROUNDS; r++) {
            TD_ASSERT_OK(td_event_create(x.b, &x.ev[r]));
            TD_ASSERT_OK(td_backend_dev_reserve(x.b, XT_BYTES, (void **)&x.dev[r]));
            x.src[r] = malloc(XT_BYTES);
            x.dst[r] = calloc(1, XT_BYTES);
            assert_non_null(x.src[r]);
            assert_non_null(x.dst[r]);
            memset(x.src[r], r + 1, XT_BYTES);
        }
        atomic_init(&x.published, 0);
        pthread_t up, down;
        assert_int_equal(pthread_create(&up, NULL, xt_uploader, &x), 0);
        assert_int_equal(pthread_create(&down, NULL, xt_downloader, &x), 0);
        pthread_join(up, NULL);
        pthread_join(down, NULL);
        assert_int_equal(x.st_up, TD_OK);
        assert_int_equal(x.st_down, TD_OK);
        for (int r = 0; r < XT_ROUNDS; r++) {
            assert_memory_equal(x.dst[r], x.src[r], XT_BYTES);
            td_event_free(x.b, x.ev[r]);
            td_backend_dev_release(x.b, x.dev[r]);
            free(x.src[r]);
            free(x.dst[r]);
        }
        td_backend_free(x.b);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_forgotten_wait_reads_poison),
        cmocka_unit_test(test_memset_poisoned_until_done),
        cmocka_unit_test(test_poison_waits_for_queue_predecessors),
        cmocka_unit_test(test_new_device_memory_is_poisoned),
        cmocka_unit_test(test_device_region_accounting),
        cmocka_unit_test(test_describe_and_stubs),
        cmocka_unit_test(test_invalid_params),
        cmocka_unit_test(test_create_fault_sweep),
        cmocka_unit_test(test_free_finishes_pending_work),
        cmocka_unit_test(test_full_ring_blocks_producer),
        cmocka_unit_test(test_compute_queue_is_the_host),
        cmocka_unit_test(test_queues_driven_from_two_threads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
