/* Fault injection: the n-th host allocation, pin or device reservation
 * fails, for every n a scenario reaches.  Each failure must come back as an
 * error, nothing may leak (td_host_live_allocs and, under ASan, LeakSanitizer)
 * and nothing may crash. */
#include "td_test.h"
#include "tidal/arena.h"
#include "tidal/copy.h"
#include "tidal/hostmem.h"
#include "tidal/hostpool.h"
#include "tidal/topo.h"

#include <stdio.h>
#include <string.h>

/* Builds the whole offload stack, uses it, and tears it down.  Returns the
 * first error; cleans up after itself whatever happens. */
static td_status scenario(void)
{
    td_status st = TD_OK;
    td_backend *b = NULL;
    td_topo *topo = NULL;
    td_hostpool *pool = NULL;
    td_hostmem *hm = NULL;
    void *pageable = NULL;
    td_arena *arena = NULL;
    td_slot_pool *slots = NULL;
    td_copy_engine *eng = NULL;
    void *h = NULL, *h2 = NULL, *act = NULL, *slot[3] = {0};
    td_backend_params bp = td_backend_default_params();
    bp.kind = td_test_backend_kind();
    bp.cpu_device_bytes = 64 * TD_MiB;
    TD_TRY(td_backend_create(&bp, &b));
    TD_TRY(td_topo_create(b, &topo));
    td_hostpool_params hp = { .slab_bytes = 2 * TD_MiB, .pin_limit_bytes = 64 * TD_MiB };
    TD_TRY(td_hostpool_create(b, topo, &hp, &pool));
    TD_TRY(td_hostpool_alloc(pool, TD_MiB, TD_ROLE_CHUNK, &h));
    TD_TRY(td_hostpool_alloc(pool, 3 * TD_MiB, TD_ROLE_STAGING, &h2)); /* second slab */
    TD_TRY(td_hostmem_create(topo, &hm)); /* pageable, on the local node */
    TD_TRY(td_hostmem_alloc(hm, TD_MiB, TD_ROLE_OPTIM, &pageable));
    memset(pageable, 3, TD_MiB);
    TD_TRY(td_arena_create(b, 8 * TD_MiB, &arena));
    TD_TRY(td_slot_pool_create(arena, TD_MiB, TD_ROLE_CHUNK, &slots));
    for (int i = 0; i < 3; i++) TD_TRY(td_slot_acquire(slots, &slot[i]));
    TD_TRY(td_arena_alloc(arena, 12345, TD_ROLE_ACTIVATION, &act));
    td_copy_params cp = td_copy_default_params();
    cp.events_per_queue = 4;
    TD_TRY(td_copy_engine_create(b, &cp, &eng));
    memset(h, 7, TD_MiB);
    td_copy_ticket t;
    TD_TRY(td_copy_submit(eng, TD_COPY_H2D, slot[0], h, TD_MiB, NULL, &t));
    TD_TRY(td_copy_submit(eng, TD_COPY_D2H, h2, slot[0], TD_MiB, &t, &t));
    TD_TRY(td_copy_wait(eng, &t));
    if (memcmp(h, h2, TD_MiB) != 0) TD_FAIL(TD_ERR_STATE, "round trip corrupted data");
cleanup:
    td_copy_engine_destroy(eng);
    for (int i = 0; i < 3; i++) if (slot[i]) td_slot_release(slots, slot[i]);
    td_slot_pool_destroy(slots);
    if (act) td_arena_release(arena, act);
    td_arena_destroy(arena);
    if (h) td_hostpool_release(pool, h);
    if (h2) td_hostpool_release(pool, h2);
    td_hostpool_destroy(pool);
    if (pageable) td_hostmem_release(hm, pageable);
    td_hostmem_destroy(hm);
    td_topo_destroy(topo);
    td_backend_free(b);
    return st;
}

static void sweep(td_fault_kind kind, long min_reached)
{
    size_t live_before = td_host_live_allocs();
    size_t used_before = td_host_used_total();
    long n = 1;
    for (;; n++) {
        td_fault_arm(kind, n);
        td_status st = scenario();
        long reached = td_fault_count(kind);
        td_fault_disarm_all();
        assert_int_equal(td_host_live_allocs(), live_before);
        assert_int_equal(td_host_used_total(), used_before);
        if (reached < n) { /* the n-th operation never came: the scenario ran clean */
            if (st != TD_OK) fail_msg("clean run failed: %s", td_error_msg());
            break;
        }
        if (st == TD_OK) fail_msg("fault %d at n=%ld was swallowed", (int)kind, n);
        assert_true(st == TD_ERR_FAULT || st == TD_ERR_NOMEM);
        assert_true(strlen(td_error_msg()) > 0);
    }
    assert_true(n - 1 >= min_reached); /* the scenario really exercised this kind */
}

static void test_fault_host_alloc(void **state) { sweep(TD_FAULT_HOST_ALLOC, 10); }
static void test_fault_pin(void **state) { sweep(TD_FAULT_PIN, 2); }
static void test_fault_dev_reserve(void **state) { sweep(TD_FAULT_DEV_RESERVE, 1); }

/* The accounting is exact per role: each live block counts its requested
 * bytes under its role alone, and td_free gives them back. */
static void test_host_used_by_role(void **state)
{
    (void)state;
    size_t meta = td_host_used(TD_ROLE_META), staging = td_host_used(TD_ROLE_STAGING);
    size_t total = td_host_used_total();
    void *a = td_malloc(1000, TD_ROLE_META);
    char *b = td_calloc(3, 1000, TD_ROLE_STAGING);
    char *c = td_strdup("tidal", TD_ROLE_META);
    assert_non_null(a);
    assert_non_null(b);
    assert_non_null(c);
    assert_int_equal(td_host_used(TD_ROLE_META), meta + 1006);
    assert_int_equal(td_host_used(TD_ROLE_STAGING), staging + 3000);
    assert_int_equal(td_host_used_total(), total + 4006);
    td_free(b);
    assert_int_equal(td_host_used(TD_ROLE_STAGING), staging);
    assert_int_equal(td_host_used(TD_ROLE_META), meta + 1006);
    td_free(a);
    td_free(c);
    assert_int_equal(td_host_used(TD_ROLE_META), meta);
    assert_int_equal(td_host_used_total(), total);
}

/* Peaks by role and by call site: a block that came and went leaves its
 * bytes in its role's peak and in its site's (named file:line, the largest
 * peak first), live bytes back to where they were; td_host_peak_reset
 * brings every peak down to what is live. */
static void test_host_peaks_and_sites(void **state)
{
    (void)state;
    td_host_peak_reset();
    size_t ws = td_host_used(TD_ROLE_WORKSPACE);
    assert_int_equal(td_host_used_peak(TD_ROLE_WORKSPACE), ws);
    const size_t big = 64u << 20; /* larger than any block the test binary holds */
    char *a = td_malloc(big, TD_ROLE_WORKSPACE);
    const int line = __LINE__ - 1;
    assert_non_null(a);
    void *b = td_calloc(1, 1000, TD_ROLE_WORKSPACE);
    assert_non_null(b);
    td_free(a);
    assert_int_equal(td_host_used_peak(TD_ROLE_WORKSPACE), ws + big + 1000);
    assert_int_equal(td_host_used(TD_ROLE_WORKSPACE), ws + 1000);
    td_host_site top[4];
    int n = td_host_sites(top, 4);
    assert_true(n >= 2);
    char want[64];
    snprintf(want, sizeof want, "test_fault.c:%d", line);
    assert_non_null(strstr(top[0].site, want));
    assert_int_equal(top[0].role, TD_ROLE_WORKSPACE);
    assert_int_equal(top[0].peak_bytes, big);
    assert_int_equal(top[0].live_bytes, 0);
    assert_int_equal(top[0].live_allocs, 0);
    for (int i = 1; i < n; i++) assert_true(top[i].peak_bytes <= top[i - 1].peak_bytes);
    td_host_peak_reset();
    assert_int_equal(td_host_used_peak(TD_ROLE_WORKSPACE), ws + 1000);
    n = td_host_sites(top, 4);
    for (int i = 0; i < n; i++) assert_null(strstr(top[i].site, want)); /* nothing of it is live */
    td_free(b);
    assert_int_equal(td_host_used(TD_ROLE_WORKSPACE), ws);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fault_host_alloc),
        cmocka_unit_test(test_fault_pin),
        cmocka_unit_test(test_fault_dev_reserve),
        cmocka_unit_test(test_host_used_by_role),
        cmocka_unit_test(test_host_peaks_and_sites),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
