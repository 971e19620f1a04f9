/* Device arena and range allocator: the budget is never exceeded, peak is
 * the maximum of live bytes, refusals are clean errors, slots are reused. */
#include "td_test.h"
#include "tidal/arena.h"
#include "tidal/range.h"

#include <stdlib.h>
#include <string.h>

typedef struct live_buf { void *ptr; size_t bytes; td_role role; unsigned char tag; } live_buf;

static size_t aligned(size_t n) { return td_align_up(n ? n : 1, TD_ARENA_ALIGN); }

/* Random allocations and frees under random budgets (property test). */
static void test_arena_random_property(void **state)
{
    td_backend *b = td_test_backend(0);
    int seeds = td_test_seeds(40);
    int on_host = td_backend_get_kind(b) == TD_BACKEND_CPU;
    for (int seed = 1; seed <= seeds; seed++) {
        td_rng rng;
        td_rng_seed(&rng, (uint64_t)seed);
        size_t budget = 4096 + td_rng_below(&rng, 8 * TD_MiB);
        td_arena *a;
        TD_ASSERT_OK(td_arena_create(b, budget, &a));
        live_buf live[256];
        int n_live = 0;
        size_t live_bytes = 0, max_live = 0, by_role[TD_ROLE_COUNT] = {0};
        for (int op = 0; op < 2000; op++) {
            if (n_live < 256 && (n_live == 0 || td_rng_below(&rng, 100) < 55)) {
                /* Mostly small, sometimes huge (over the budget) requests. */
                size_t bytes = td_rng_below(&rng, 10) == 0 ? td_rng_below(&rng, 2 * budget) + 1
                                                           : td_rng_below(&rng, budget / 8 + 1) + 1;
                td_role role = (td_role)td_rng_below(&rng, TD_ROLE_COUNT);
                td_arena_stats before;
                td_arena_get_stats(a, &before);
                void *p;
                td_status st = td_arena_alloc(a, bytes, role, &p);
                if (st != TD_OK) {
                    assert_int_equal(st, TD_ERR_BUDGET);
                    assert_null(p);
                    /* A refusal is honest: nothing free was big enough. */
                    assert_true(before.largest_free_bytes < aligned(bytes));
                    assert_non_null(strstr(td_error_msg(), td_role_name(role)));
                    assert_non_null(strstr(td_error_msg(), "--gpu-budget"));
                    td_arena_stats after;
                    td_arena_get_stats(a, &after);
                    assert_memory_equal(&before, &after, sizeof before);
                    continue;
                }
                char *c = p;
                assert_true(c >= (char *)td_arena_base(a));
                assert_true(c + aligned(bytes) <= (char *)td_arena_base(a) + budget);
                assert_int_equal((uintptr_t)p % TD_ARENA_ALIGN, 0);
                unsigned char tag = (unsigned char)(op & 0xff);
                if (on_host) memset(p, tag, bytes);
                live[n_live++] = (live_buf){p, bytes, role, tag};
                live_bytes += aligned(bytes);
                by_role[role] += aligned(bytes);
                if (live_bytes > max_live) max_live = live_bytes;
            } else {
                int i = (int)td_rng_below(&rng, (uint64_t)n_live);
                if (on_host) { /* nobody else wrote into this block */
                    const unsigned char *c = live[i].ptr;
                    for (size_t k = 0; k < live[i].bytes; k += 61) assert_int_equal(c[k], live[i].tag);
                }
                TD_ASSERT_OK(td_arena_release(a, live[i].ptr));
                live_bytes -= aligned(live[i].bytes);
                by_role[live[i].role] -= aligned(live[i].bytes);
                live[i] = live[--n_live];
            }
            td_arena_stats s;
            td_arena_get_stats(a, &s);
            assert_true(s.used_bytes <= budget);
            assert_int_equal(s.used_bytes, live_bytes);
            assert_int_equal(s.peak_bytes, max_live);
            for (int r = 0; r < TD_ROLE_COUNT; r++) assert_int_equal(s.used[r], by_role[r]);
            assert_int_equal(s.live_blocks, n_live);
        }
        while (n_live) TD_ASSERT_OK(td_arena_release(a, live[--n_live].ptr));
        td_arena_stats s;
        td_arena_get_stats(a, &s);
        assert_int_equal(s.used_bytes, 0);
        assert_int_equal(s.free_blocks, 1); /* everything coalesced back */
        td_arena_destroy(a);
    }
    td_backend_free(b);
}

/* The range allocator keeps its list consistent through random traffic. */
static void test_range_invariants(void **state)
{
    for (int seed = 1; seed <= td_test_seeds(40); seed++) {
        td_rng rng;
        td_rng_seed(&rng, (uint64_t)seed * 7919);
        td_range r;
        size_t size = 256 * (1 + td_rng_below(&rng, 4096));
        TD_ASSERT_OK(td_range_init(&r, size, 256));
        size_t offs[128];
        int n = 0;
        for (int op = 0; op < 3000; op++) {
            if (n < 128 && td_rng_below(&rng, 2)) {
                size_t off;
                if (td_range_alloc(&r, td_rng_below(&rng, size / 4) + 1, (int)td_rng_below(&rng, 2), 7, &off) == TD_OK)
                    offs[n++] = off;
            } else if (n) {
                int i = (int)td_rng_below(&rng, (uint64_t)n);
                uint32_t tag;
                TD_ASSERT_OK(td_range_free(&r, offs[i], NULL, &tag));
                assert_int_equal(tag, 7);
                offs[i] = offs[--n];
            }
            assert_int_equal(td_range_check(&r), 0);
        }
        /* Freeing something twice or not at a block start is refused. */
        if (n) {
            size_t off = offs[0];
            TD_ASSERT_OK(td_range_free(&r, off, NULL, NULL));
            assert_int_equal(td_range_free(&r, off, NULL, NULL), TD_ERR_INVALID);
            offs[0] = offs[--n];
        }
        td_range_destroy(&r);
    }
}

static void test_arena_best_fit_and_top(void **state)
{
    td_range r;
    TD_ASSERT_OK(td_range_init(&r, 10 * 256, 256));
    size_t a, b, c, d, e;
    TD_ASSERT_OK(td_range_alloc(&r, 256, 0, 0, &a));      /* [0] */
    TD_ASSERT_OK(td_range_alloc(&r, 3 * 256, 0, 0, &b));  /* [1..3] */
    TD_ASSERT_OK(td_range_alloc(&r, 256, 0, 0, &c));      /* [4] */
    TD_ASSERT_OK(td_range_alloc(&r, 256, 1, 0, &d));      /* top: [9] */
    assert_int_equal(d, 9 * 256);
    TD_ASSERT_OK(td_range_free(&r, b, NULL, NULL));       /* hole of 3 at [1..3], 4 free at [5..8] */
    TD_ASSERT_OK(td_range_alloc(&r, 2 * 256, 0, 0, &e));  /* best fit: the 3-hole, not the 4-hole */
    assert_int_equal(e, 256);
    assert_int_equal(td_range_largest_free(&r), 4 * 256);
    assert_int_equal(td_range_alloc(&r, 5 * 256, 0, 0, &e), TD_ERR_BUDGET);
    (void)a; (void)c;
    assert_int_equal(td_range_check(&r), 0);
    td_range_destroy(&r);
}

static void test_arena_error_names_holders(void **state)
{
    td_backend *b = td_test_backend(0);
    td_arena *a;
    TD_ASSERT_OK(td_arena_create(b, 4 * TD_MiB, &a));
    void *p, *q;
    TD_ASSERT_OK(td_arena_alloc(a, 3 * TD_MiB, TD_ROLE_CHUNK, &p));
    assert_int_equal(td_arena_alloc(a, 2 * TD_MiB, TD_ROLE_ACTIVATION, &q), TD_ERR_BUDGET);
    const char *m = td_error_msg();
    assert_non_null(strstr(m, "2.00 MiB of activations"));
    assert_non_null(strstr(m, "budget 4.00 MiB"));
    assert_non_null(strstr(m, "chunks 3.00 MiB"));
    assert_non_null(strstr(m, "largest 1.00 MiB"));
    /* Releasing a foreign pointer is an error, not a crash. */
    int x;
    assert_int_equal(td_arena_release(a, &x), TD_ERR_INVALID);
    assert_int_equal(td_arena_release(a, (char *)p + 256), TD_ERR_INVALID);
    TD_ASSERT_OK(td_arena_release(a, p));
    td_arena_destroy(a);
    td_backend_free(b);
}

static void test_arena_reset_peak(void **state)
{
    td_backend *b = td_test_backend(0);
    td_arena *a;
    TD_ASSERT_OK(td_arena_create(b, TD_MiB, &a));
    void *p, *q;
    TD_ASSERT_OK(td_arena_alloc(a, 1000, TD_ROLE_WORKSPACE, &p));
    TD_ASSERT_OK(td_arena_alloc(a, 5000, TD_ROLE_ACTIVATION, &q));
    TD_ASSERT_OK(td_arena_release(a, q));
    td_arena_stats s;
    td_arena_get_stats(a, &s);
    assert_int_equal(s.peak_bytes, aligned(1000) + aligned(5000));
    assert_int_equal(s.peak[TD_ROLE_ACTIVATION], aligned(5000));
    td_arena_reset_peak(a);
    td_arena_get_stats(a, &s);
    assert_int_equal(s.peak_bytes, aligned(1000));
    assert_int_equal(s.peak[TD_ROLE_ACTIVATION], 0);
    TD_ASSERT_OK(td_arena_release(a, p));
    td_arena_destroy(a);
    td_backend_free(b);
}

static void test_slot_pool_reuse(void **state)
{
    td_backend *b = td_test_backend(0);
    td_arena *a;
    TD_ASSERT_OK(td_arena_create(b, 10 * TD_MiB, &a));
    td_slot_pool *pool;
    TD_ASSERT_OK(td_slot_pool_create(a, 3 * TD_MiB - 100, TD_ROLE_CHUNK, &pool));
    assert_int_equal(td_slot_pool_slot_bytes(pool), 3 * TD_MiB);
    void *s[4];
    for (int i = 0; i < 3; i++) TD_ASSERT_OK(td_slot_acquire(pool, &s[i]));
    /* The fourth does not fit: a clean budget error, chunks named. */
    assert_int_equal(td_slot_acquire(pool, &s[3]), TD_ERR_BUDGET);
    assert_non_null(strstr(td_error_msg(), "chunks"));
    /* Slots come from the top, variable buffers from the bottom. */
    void *v;
    TD_ASSERT_OK(td_arena_alloc(a, 1000, TD_ROLE_ACTIVATION, &v));
    assert_ptr_equal(v, td_arena_base(a));
    assert_ptr_equal(s[0], (char *)td_arena_base(a) + 7 * TD_MiB);
    td_slot_release(pool, s[1]);
    void *again;
    TD_ASSERT_OK(td_slot_acquire(pool, &again));
    assert_ptr_equal(again, s[1]); /* the cached slot comes back, no new carve */
    td_arena_stats st;
    td_arena_get_stats(a, &st);
    assert_int_equal(st.used[TD_ROLE_CHUNK], 9 * TD_MiB);
    assert_int_equal(td_slot_pool_in_use(pool), 3);
    td_slot_release(pool, again);
    td_slot_release(pool, s[0]);
    assert_int_equal(td_slot_pool_held(pool), 3);
    assert_int_equal(td_slot_pool_trim(pool), 6 * TD_MiB);
    td_arena_get_stats(a, &st);
    assert_int_equal(st.used[TD_ROLE_CHUNK], 3 * TD_MiB);
    td_slot_release(pool, s[2]);
    td_slot_pool_destroy(pool);
    TD_ASSERT_OK(td_arena_release(a, v));
    td_arena_get_stats(a, &st);
    assert_int_equal(st.used_bytes, 0);
    td_arena_destroy(a);
    td_backend_free(b);
}

/* The arena has no default budget: 0 and sizes below its alignment are
 * refused with a message naming the budget (the trainer sizes defaults,
 * td_train_budget_resolve); so is a budget beyond what the device has. */
static void test_arena_budget_zero_and_overcommit(void **state)
{
    td_backend *b = td_test_backend(0);
    size_t free_b, total_b;
    TD_ASSERT_OK(td_backend_mem_info(b, &free_b, &total_b));
    td_arena *a = (td_arena *)b; /* anything but NULL: a failure must clear it */
    assert_int_equal(td_arena_create(b, 0, &a), TD_ERR_INVALID);
    assert_null(a);
    assert_non_null(strstr(td_error_msg(), "a budget of 0 bytes"));
    assert_int_equal(td_arena_create(b, TD_ARENA_ALIGN - 1, &a), TD_ERR_INVALID);
    assert_null(a);
    assert_non_null(strstr(td_error_msg(), "too small"));
    TD_ASSERT_OK(td_arena_create(b, TD_ARENA_ALIGN, &a)); /* the least */
    td_arena_stats as;
    td_arena_get_stats(a, &as);
    assert_int_equal(as.budget_bytes, TD_ARENA_ALIGN);
    td_arena_destroy(a);
    a = NULL;
    td_status st = td_arena_create(b, total_b + TD_GiB, &a);
    assert_int_equal(st, TD_ERR_DEVICE_MEM);
    assert_null(a);
    assert_non_null(strstr(td_error_msg(), "reserving the budget"));
    td_backend_free(b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_range_invariants),
        cmocka_unit_test(test_arena_best_fit_and_top),
        cmocka_unit_test(test_arena_random_property),
        cmocka_unit_test(test_arena_error_names_holders),
        cmocka_unit_test(test_arena_reset_peak),
        cmocka_unit_test(test_slot_pool_reuse),
        cmocka_unit_test(test_arena_budget_zero_and_overcommit),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
