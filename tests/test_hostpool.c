/* Pinned host pool: sub-allocation inside pinned slabs, per-role counts,
 * the pin limit as a clear error, NUMA topology. */
#include "td_test.h"
#include "tidal/hostpool.h"
#include "tidal/topo.h"

#include <string.h>

static void test_hostpool_suballocates_slabs(void **state)
{
    td_backend *b = td_test_backend(0);
    td_topo *topo;
    TD_ASSERT_OK(td_topo_create(b, &topo));
    td_hostpool_params prm = td_hostpool_default_params();
    prm.slab_bytes = 4 * TD_MiB;
    td_hostpool *p;
    TD_ASSERT_OK(td_hostpool_create(b, topo, &prm, &p));
    td_hostpool_stats s;
    td_hostpool_get_stats(p, &s);
    assert_int_equal(s.pinned_bytes, 0); /* nothing pinned until asked */
    void *x[8];
    for (int i = 0; i < 8; i++) {
        TD_ASSERT_OK(td_hostpool_alloc(p, 1000 * (size_t)(i + 1), i % 2 ? TD_ROLE_CHUNK : TD_ROLE_STAGING, &x[i]));
        assert_int_equal((uintptr_t)x[i] % TD_HOSTPOOL_ALIGN, 0);
        memset(x[i], i, 1000 * (size_t)(i + 1));
    }
    td_hostpool_get_stats(p, &s);
    assert_int_equal(s.slabs, 1);           /* eight blocks, one slab: no pin per tensor */
    assert_int_equal(s.pinned_bytes, 4 * TD_MiB);
    assert_int_equal(s.used[TD_ROLE_STAGING], 4096 + 4096 + 8192 + 8192); /* 1000, 3000, 5000, 7000 in 4 KiB pages */
    assert_int_equal(s.used[TD_ROLE_CHUNK], 4096 + 4096 + 8192 + 8192);
    for (int i = 0; i < 8; i++) {
        const unsigned char *c = x[i];
        for (size_t k = 0; k < 1000 * (size_t)(i + 1); k++) assert_int_equal(c[k], i);
    }
    /* A request larger than a slab gets its own slab. */
    void *big;
    TD_ASSERT_OK(td_hostpool_alloc(p, 9 * TD_MiB, TD_ROLE_OPTIM, &big));
    td_hostpool_get_stats(p, &s);
    assert_int_equal(s.slabs, 2);
    assert_int_equal(s.pinned_bytes, 4 * TD_MiB + 10 * TD_MiB); /* 2 MiB grain */
    int foreign;
    assert_int_equal(td_hostpool_release(p, &foreign), TD_ERR_INVALID);
    for (int i = 0; i < 8; i++) TD_ASSERT_OK(td_hostpool_release(p, x[i]));
    TD_ASSERT_OK(td_hostpool_release(p, big));
    td_hostpool_get_stats(p, &s);
    assert_int_equal(s.used_bytes, 0);
    assert_int_equal(s.peak[TD_ROLE_OPTIM], 9 * TD_MiB);
    assert_int_equal(td_hostpool_trim(p), 14 * TD_MiB);
    td_hostpool_get_stats(p, &s);
    assert_int_equal(s.pinned_bytes, 0);
    td_hostpool_destroy(p);
    td_topo_destroy(topo);
    td_backend_free(b);
}

static void test_hostpool_pin_limit_error(void **state)
{
    td_backend *b = td_test_backend(0);
    td_hostpool_params prm = { .slab_bytes = 2 * TD_MiB, .pin_limit_bytes = 5 * TD_MiB };
    td_hostpool *p;
    TD_ASSERT_OK(td_hostpool_create(b, NULL, &prm, &p));
    void *a, *c, *d;
    TD_ASSERT_OK(td_hostpool_alloc(p, 2 * TD_MiB, TD_ROLE_CHUNK, &a));
    TD_ASSERT_OK(td_hostpool_alloc(p, 2 * TD_MiB, TD_ROLE_CHUNK, &c));
    assert_int_equal(td_hostpool_alloc(p, TD_MiB, TD_ROLE_CHUNK, &d), TD_ERR_PIN);
    assert_null(d);
    const char *m = td_error_msg();
    assert_non_null(strstr(m, "4.00 MiB already pinned in 2 slabs"));
    assert_non_null(strstr(m, "pin limit is 5.00 MiB"));
    td_hostpool_stats s;
    td_hostpool_get_stats(p, &s);
    assert_int_equal(s.pinned_bytes, 4 * TD_MiB); /* the refusal changed nothing */
    TD_ASSERT_OK(td_hostpool_release(p, a));
    TD_ASSERT_OK(td_hostpool_alloc(p, TD_MiB, TD_ROLE_CHUNK, &d)); /* fits the freed room */
    TD_ASSERT_OK(td_hostpool_release(p, c));
    TD_ASSERT_OK(td_hostpool_release(p, d));
    td_hostpool_destroy(p);
    td_backend_free(b);
}

static void test_topo_describes_and_binds(void **state)
{
    td_backend *b = td_test_backend(0);
    td_topo *t;
    TD_ASSERT_OK(td_topo_create(b, &t));
    assert_true(td_topo_local_cores(t) >= 1);
    assert_true(td_topo_numa_nodes(t) >= 1);
    assert_non_null(strstr(td_topo_describe(t), "NUMA node"));
    td_status st = td_topo_bind_thread(t);
    assert_true(st == TD_OK || st == TD_ERR_UNSUPPORTED);
    char *m = td_topo_alloc(t, 3 * TD_MiB);
    assert_non_null(m);
    memset(m, 1, 3 * TD_MiB);
    td_topo_free(t, m, 3 * TD_MiB);
    td_topo_destroy(t);
    td_backend_free(b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hostpool_suballocates_slabs),
        cmocka_unit_test(test_hostpool_pin_limit_error),
        cmocka_unit_test(test_topo_describes_and_binds),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
