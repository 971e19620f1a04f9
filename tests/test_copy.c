/* Copy engine: data arrives intact through split, queued and reordered
 * copies; tickets order queues; the ring of events is reused safely; the two
 * directions overlap.  Run on the cpu backend in its delaying, poisoning
 * debug mode, so any missing wait shows up as corrupted data. */
#include "td_test.h"
#include "tidal/arena.h"
#include "tidal/copy.h"
#include "tidal/hostpool.h"

#include <stdlib.h>
#include <string.h>

typedef struct rig {
    td_backend *b;
    td_hostpool *pool;
    td_arena *arena;
    td_copy_engine *eng;
} rig;

static rig rig_open(int debug, size_t chunk_bytes, int events)
{
    rig r = {0};
    r.b = td_test_backend(debug);
    TD_ASSERT_OK(td_hostpool_create(r.b, NULL, NULL, &r.pool));
    TD_ASSERT_OK(td_arena_create(r.b, 64 * TD_MiB, &r.arena));
    td_copy_params p = td_copy_default_params();
    if (chunk_bytes) p.chunk_bytes = chunk_bytes;
    if (events) p.events_per_queue = events;
    TD_ASSERT_OK(td_copy_engine_create(r.b, &p, &r.eng));
    return r;
}

static void rig_close(rig *r)
{
    td_copy_engine_destroy(r->eng);
    td_arena_destroy(r->arena);
    td_hostpool_destroy(r->pool);
    td_backend_free(r->b);
}

static void fill(unsigned char *p, size_t n, uint64_t seed)
{
    td_rng rng;
    td_rng_seed(&rng, seed);
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)td_rng_next(&rng);
}

/* Host -> device -> host in pieces much smaller than the copy. */
static void test_copy_round_trip_split(void **state)
{
    rig r = rig_open(1, 4096 * 3, 0);
    size_t n = 1000003;
    unsigned char *src, *dst;
    void *dev;
    TD_ASSERT_OK(td_hostpool_alloc(r.pool, n, TD_ROLE_STAGING, (void **)&src));
    TD_ASSERT_OK(td_hostpool_alloc(r.pool, n, TD_ROLE_STAGING, (void **)&dst));
    TD_ASSERT_OK(td_arena_alloc(r.arena, n, TD_ROLE_CHUNK, &dev));
    fill(src, n, 42);
    td_copy_ticket up, down;
    TD_ASSERT_OK(td_copy_submit(r.eng, TD_COPY_H2D, dev, src, n, NULL, &up));
    TD_ASSERT_OK(td_copy_submit(r.eng, TD_COPY_D2H, dst, dev, n, &up, &down)); /* ordered by the ticket */
    TD_ASSERT_OK(td_copy_wait(r.eng, &down));
    assert_memory_equal(src, dst, n);
    int done;
    TD_ASSERT_OK(td_copy_done(r.eng, &up, &done));
    assert_true(done);
    td_copy_stats s;
    td_copy_get_stats(r.eng, &s);
    assert_int_equal(s.bytes[TD_COPY_H2D], n);
    assert_int_equal(s.bytes[TD_COPY_D2H], n);
    assert_int_equal(s.copies[TD_COPY_H2D], 1);
    TD_ASSERT_OK(td_arena_release(r.arena, dev));
    TD_ASSERT_OK(td_hostpool_release(r.pool, src));
    TD_ASSERT_OK(td_hostpool_release(r.pool, dst));
    rig_close(&r);
}

/* Reading a destination before its ticket completes shows the poison. */
static void test_copy_forgotten_wait_is_caught(void **state)
{
    if (td_test_backend_kind() != TD_BACKEND_CPU) td_test_skip("the cpu backend's poison mode only (TD_BACKEND=cpu)");
    rig r = rig_open(1, 0, 0);
    size_t n = 65536;
    unsigned char *src, *dst;
    void *dev;
    TD_ASSERT_OK(td_hostpool_alloc(r.pool, n, TD_ROLE_STAGING, (void **)&src));
    TD_ASSERT_OK(td_hostpool_alloc(r.pool, n, TD_ROLE_STAGING, (void **)&dst));
    TD_ASSERT_OK(td_arena_alloc(r.arena, n, TD_ROLE_CHUNK, &dev));
    memset(src, 0x11, n);
    memset(dst, 0x22, n);
    td_copy_ticket t;
    TD_ASSERT_OK(td_copy_submit(r.eng, TD_COPY_H2D, dev, src, n, NULL, &t));
    TD_ASSERT_OK(td_copy_submit(r.eng, TD_COPY_D2H, dst, dev, n, &t, &t));
    /* Wait until the D2H has begun (its destination is poisoned), not ended. */
    double t0 = td_now_ms();
    while (dst[0] == 0x22 && td_now_ms() - t0 < 5000) td_sleep_us(50);
    int done;
    TD_ASSERT_OK(td_copy_done(r.eng, &t, &done));
    if (!done) assert_int_equal(dst[n / 2], 0xFF); /* a reader that skipped the wait sees garbage */
    TD_ASSERT_OK(td_copy_wait(r.eng, &t));
    assert_int_equal(dst[n / 2], 0x11);
    TD_ASSERT_OK(td_arena_release(r.arena, dev));
    TD_ASSERT_OK(td_hostpool_release(r.pool, src));
    TD_ASSERT_OK(td_hostpool_release(r.pool, dst));
    rig_close(&r);
}

/* Random streams of uploads, device-to-host write-backs and compute marks,
 * with a tiny ticket ring so slots are reused constantly. */
static void test_copy_random_traffic(void **state)
{
    for (int seed = 1; seed <= td_test_seeds(6); seed++) {
        rig r = rig_open(seed % 2, 8192, 3);
        td_rng rng;
        td_rng_seed(&rng, (uint64_t)seed);
        enum { BUFS = 6, BYTES = 40000 };
        unsigned char *host[BUFS], *back[BUFS];
        void *dev[BUFS];
        uint64_t version[BUFS];
        td_copy_ticket up[BUFS] = {{0}};
        for (int i = 0; i < BUFS; i++) {
            TD_ASSERT_OK(td_hostpool_alloc(r.pool, BYTES, TD_ROLE_CHUNK, (void **)&host[i]));
            TD_ASSERT_OK(td_hostpool_alloc(r.pool, BYTES, TD_ROLE_STAGING, (void **)&back[i]));
            TD_ASSERT_OK(td_arena_alloc(r.arena, BYTES, TD_ROLE_CHUNK, &dev[i]));
            version[i] = 0;
        }
        for (int op = 0; op < 60; op++) {
            int i = (int)td_rng_below(&rng, BUFS);
            if (td_rng_below(&rng, 2)) {
                /* The host copy may be rewritten only after its last upload read it. */
                TD_ASSERT_OK(td_copy_wait(r.eng, &up[i]));
                version[i] = td_rng_next(&rng);
                fill(host[i], BYTES, version[i]);
                TD_ASSERT_OK(td_copy_submit(r.eng, TD_COPY_H2D, dev[i], host[i], BYTES, NULL, &up[i]));
            } else {
                td_copy_ticket mark, down;
                TD_ASSERT_OK(td_copy_order(r.eng, TD_QUEUE_COMPUTE, &up[i]));
                TD_ASSERT_OK(td_copy_mark(r.eng, TD_QUEUE_COMPUTE, &mark));
                TD_ASSERT_OK(td_copy_submit(r.eng, TD_COPY_D2H, back[i], dev[i], BYTES, &up[i], &down));
                TD_ASSERT_OK(td_copy_wait(r.eng, &down));
                if (version[i]) {
                    unsigned char *expect = malloc(BYTES);
                    fill(expect, BYTES, version[i]);
                    assert_memory_equal(expect, back[i], BYTES);
                    free(expect);
                }
            }
        }
        TD_ASSERT_OK(td_copy_drain(r.eng));
        for (int i = 0; i < BUFS; i++) {
            TD_ASSERT_OK(td_arena_release(r.arena, dev[i]));
            TD_ASSERT_OK(td_hostpool_release(r.pool, host[i]));
            TD_ASSERT_OK(td_hostpool_release(r.pool, back[i]));
        }
        rig_close(&r);
    }
}

/* With copies delayed, an H2D and a D2H submitted together finish in about
 * the time of one: the directions run on separate queues. */
static void test_copy_directions_overlap(void **state)
{
    if (td_test_backend_kind() != TD_BACKEND_CPU) td_test_skip("the cpu backend's delay mode only (TD_BACKEND=cpu)");
    rig r = rig_open(1, 0, 0);
    size_t n = 4096;
    void *h1, *h2, *d1, *d2;
    TD_ASSERT_OK(td_hostpool_alloc(r.pool, n, TD_ROLE_STAGING, &h1));
    TD_ASSERT_OK(td_hostpool_alloc(r.pool, n, TD_ROLE_STAGING, &h2));
    TD_ASSERT_OK(td_arena_alloc(r.arena, n, TD_ROLE_CHUNK, &d1));
    TD_ASSERT_OK(td_arena_alloc(r.arena, n, TD_ROLE_CHUNK, &d2));
    double best = 1e9;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = td_now_ms();
        td_copy_ticket a, c;
        TD_ASSERT_OK(td_copy_submit(r.eng, TD_COPY_H2D, d1, h1, n, NULL, &a));
        TD_ASSERT_OK(td_copy_submit(r.eng, TD_COPY_D2H, h2, d2, n, NULL, &c));
        TD_ASSERT_OK(td_copy_wait(r.eng, &a));
        TD_ASSERT_OK(td_copy_wait(r.eng, &c));
        double ms = td_now_ms() - t0;
        if (ms < best) best = ms;
    }
    double delay_ms = td_backend_default_params().cpu_debug_delay_us / 1000.0;
    assert_true(best < 1.6 * delay_ms); /* serial would take 2 delays */
    td_copy_stats s;
    td_copy_get_stats(r.eng, &s);
    assert_true(s.host_waits >= 1 && s.host_wait_ms > 0);
    TD_ASSERT_OK(td_arena_release(r.arena, d1));
    TD_ASSERT_OK(td_arena_release(r.arena, d2));
    TD_ASSERT_OK(td_hostpool_release(r.pool, h1));
    TD_ASSERT_OK(td_hostpool_release(r.pool, h2));
    rig_close(&r);
}

static void test_copy_bad_tickets(void **state)
{
    rig r = rig_open(0, 0, 4);
    td_copy_ticket bad = { .seq = 5, .queue = 9, .slot = 0 };
    assert_int_equal(td_copy_wait(r.eng, &bad), TD_ERR_INVALID);
    td_copy_ticket none = {0};
    TD_ASSERT_OK(td_copy_wait(r.eng, &none)); /* an empty ticket is complete */
    assert_int_equal(td_copy_submit(r.eng, (td_copy_dir)7, NULL, NULL, 1, NULL, NULL), TD_ERR_INVALID);
    rig_close(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_copy_round_trip_split),
        cmocka_unit_test(test_copy_forgotten_wait_is_caught),
        cmocka_unit_test(test_copy_random_traffic),
        cmocka_unit_test(test_copy_directions_overlap),
        cmocka_unit_test(test_copy_bad_tickets),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
