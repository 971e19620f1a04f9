/* Soak: a tiny model trained for a few hundred steps on the cpu backend,
 * under a budget that keeps chunks moving (evictions, prefetches, deferred
 * AdamW), must hold its memory flat after the warm-up.  After step WARM and
 * after the last step it samples
 *   - the arena: peak and used bytes (the device side of the cpu backend),
 *   - the host pool: pinned and used bytes,
 *   - the accounting allocator: live td_malloc blocks and their bytes,
 *   - the C heap: td_host_heap_stats (jemalloc's stats.allocated, or
 *     mallinfo2() in-use bytes; ASan's allocator under ASan, where glibc's
 *     malloc is not the one in use),
 * and fails when any of them grew: exactly for the first three, beyond a
 * small fixed slack for the heap (libc and OpenMP keep a few buffers of
 * their own).  A second test injects leaks of each kind into the same loop
 * and checks the soak names every one, so a flat result means flat.
 *
 * TD_SOAK_STEPS overrides the step count (default 300; 60 under ASan,
 * which is several times slower). */
#include <malloc.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_train_test.h"
#include "tidal/arena.h"
#include "tidal/hostmem.h"
#include "tidal/hostpool.h"

#if defined(__SANITIZE_ADDRESS__)
#define SOAK_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SOAK_ASAN 1
#endif
#endif
#ifdef SOAK_ASAN
/* From the ASan runtime (declared here: gcc does not always install
 * <sanitizer/allocator_interface.h>). */
size_t __sanitizer_get_current_allocated_bytes(void);
#define SOAK_DEFAULT_STEPS 60
#define LEAK_STEPS 10 /* per injected leak, after the warm-up */
#else
#define SOAK_DEFAULT_STEPS 300
#define LEAK_STEPS 20
#endif

enum { WARM = 10 };
/* Room for a few blocks libc or libgomp might take late; the clean run
 * measures 0 here, and a leak of one 24-byte block per step exceeds it in
 * 300 steps (checked by injecting one into td_trainer_step). */
#define HEAP_SLACK_BYTES ((size_t)4 << 10)

typedef struct soak_sample {
    size_t arena_peak, arena_used, pinned, pool_used;
    size_t host_live, host_bytes, heap;
} soak_sample;

#ifdef TD_HAVE_JEMALLOC
/* jemalloc merges the thread caches' counts into stats.allocated lazily:
 * without them every free is counted at once (read by jemalloc at start). */
const char *malloc_conf = "tcache:false";
#endif

static size_t heap_in_use(void)
{
#ifdef SOAK_ASAN
    return __sanitizer_get_current_allocated_bytes();
#else
    /* jemalloc's stats.allocated when tidal links it (glibc's mallinfo2
     * then sees an empty heap), else mallinfo2's blocks in use. */
    td_heap_stats hs;
    if (td_host_heap_stats(&hs) != TD_OK) fail_msg("heap statistics: %s", td_error_msg());
    return hs.allocated_bytes;
#endif
}

static soak_sample sample(td_trainer *t)
{
    td_arena_stats as;
    td_hostpool_stats ps;
    td_arena_get_stats(td_trainer_arena(t), &as);
    td_hostpool_get_stats(td_trainer_hostpool(t), &ps);
    return (soak_sample){ .arena_peak = as.peak_bytes, .arena_used = as.used_bytes, .pinned = ps.pinned_bytes,
                          .pool_used = ps.used_bytes, .host_live = td_host_live_allocs(),
                          .host_bytes = td_host_used_total(), .heap = heap_in_use() };
}

/* What to leak per step after the warm-up (the self-test); all zero in the soak. */
typedef struct soak_leak {
    size_t heap_bytes, td_bytes, pinned_bytes, arena_bytes;
    void **held; /* freed at the end, so that ASan's leak check stays quiet */
    size_t n_held;
} soak_leak;

static void leak_step(td_trainer *t, soak_leak *lk)
{
    void *p;
    if (lk->heap_bytes) {
        p = malloc(lk->heap_bytes);
        assert_non_null(p);
        memset(p, 1, lk->heap_bytes);
        lk->held[lk->n_held++] = p;
    }
    if (lk->td_bytes) {
        assert_non_null(p = td_malloc(lk->td_bytes, TD_ROLE_META));
        lk->held[lk->n_held++] = p;
    }
    if (lk->pinned_bytes) TD_ASSERT_OK(td_hostpool_alloc(td_trainer_hostpool(t), lk->pinned_bytes, TD_ROLE_META, &p));
    if (lk->arena_bytes) TD_ASSERT_OK(td_arena_alloc(td_trainer_arena(t), lk->arena_bytes, TD_ROLE_META, &p));
}

/* A tiny GPT with chunks small enough that the budget below holds about
 * half of them: every step evicts, prefetches and writes back. */
static td_train_config soak_config(void)
{
    td_train_config c = td_train_default_config();
    c.model = (td_model_desc){ .n_layer = 2, .n_head = 2, .n_embd = 32, .n_positions = 16,
                                   .vocab_size = 61, .padded_vocab_size = 64 };
    c.micro_batch = 2;
    c.seq_len = 16;
    c.grad_accum = 2;
    c.backend = TD_BACKEND_CPU;
    c.ckpt = TD_CKPT_ON;
    c.mm.min_chunk_numel = 1024;
    c.mm.max_chunk_numel = 4096;
    c.optim.lr.lr = 1e-3;
    c.threads = 2;
    td_train_plan plan;
    TD_ASSERT_OK(td_train_plan_make(&c, 0, &plan));
    c.gpu_budget = (plan.min_device_bytes + plan.full_device_bytes) / 2;
    return c;
}

/* Runs `steps` steps; *warm and *end are the samples after step WARM and
 * after the last.  Returns the evictions made after the warm-up. */
static uint64_t soak(int steps, soak_leak *lk, soak_sample *warm, soak_sample *end)
{
    td_train_config c = soak_config();
    td_trainer *t;
    TD_ASSERT_OK(td_trainer_create(&c, &t));
    td_test_batches b = { .vocab = c.model.vocab_size, .n = (size_t)c.micro_batch * c.seq_len };
    td_rng_seed(&b.rng, 7);
    uint64_t evictions_at_warm = 0;
    td_step_result r;
    for (int s = 1; s <= steps; s++) {
        TD_ASSERT_OK(td_trainer_step(t, td_test_next_batch, &b, &r));
        /* finite (neither NaN nor infinite): the run trains, it does not just spin */
        if (!isfinite(r.loss)) fail_msg("step %d: loss %g is not finite", s, r.loss);
        if (s == WARM) {
            *warm = sample(t);
            evictions_at_warm = r.mm.evictions;
        }
        if (s > WARM && lk) leak_step(t, lk);
    }
    *end = sample(t);
    td_trainer_destroy(t); /* the pool and arena go with it, injected blocks included */
    if (lk)
        for (size_t i = 0; i < lk->n_held; i++) { /* one kind per run */
            if (lk->heap_bytes) free(lk->held[i]);
            else td_free(lk->held[i]);
        }
    return r.mm.evictions - evictions_at_warm;
}

/* The names of what grew, "" when flat. */
static void growth(const soak_sample *w, const soak_sample *e, char *buf, size_t n)
{
    buf[0] = '\0';
    size_t k = 0;
#define GREW(field, slack)                                                                                   \
    if (e->field > w->field + (slack) && k < n)                                                              \
        k += (size_t)snprintf(buf + k, n - k, "%s%s %zu -> %zu", k ? ", " : "", #field, w->field, e->field);
    GREW(arena_peak, 0) GREW(arena_used, 0) GREW(pinned, 0) GREW(pool_used, 0)
    GREW(host_live, 0) GREW(host_bytes, 0) GREW(heap, HEAP_SLACK_BYTES)
#undef GREW
}

static int soak_steps(void)
{
    const char *s = getenv("TD_SOAK_STEPS");
    int n = s ? atoi(s) : SOAK_DEFAULT_STEPS;
    return n > WARM + 10 ? n : WARM + 10;
}

static void test_memory_flat_after_warmup(void **state)
{
    const int steps = soak_steps();
    soak_sample w, e;
    double t0 = td_now_ms();
    uint64_t evictions = soak(steps, NULL, &w, &e);
    char grew[512];
    growth(&w, &e, grew, sizeof grew);
    printf("soak: %d steps in %.1f s, %llu evictions after step %d; arena peak %zu, pinned %zu, "
           "td_malloc %zu blocks / %zu B, heap %zu -> %zu B\n",
           steps, (td_now_ms() - t0) / 1e3, (unsigned long long)evictions, WARM, e.arena_peak, e.pinned,
           e.host_live, e.host_bytes, w.heap, e.heap);
    assert_true(evictions > 0); /* the offload path ran every step, not one resident set */
    if (grew[0]) fail_msg("memory grew between step %d and step %d: %s", WARM, steps, grew);
}

/* The soak sees each kind of growth (the test above would pass vacuously
 * if it did not).  Leaks are sized to one small block per step. */
static void test_soak_detects_leaks(void **state)
{
    enum { STEPS = WARM + LEAK_STEPS };
    void *held[2 * STEPS];
    const struct { soak_leak lk; const char *want; } cases[] = {
        {{.heap_bytes = 1024}, "heap"},
        {{.td_bytes = 64}, "host_live"},
        {{.pinned_bytes = 64 << 10}, "pool_used"},
        {{.arena_bytes = 256}, "arena_used"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        soak_leak lk = cases[i].lk;
        lk.held = held;
        soak_sample w, e;
        soak(STEPS, &lk, &w, &e);
        char grew[512];
        growth(&w, &e, grew, sizeof grew);
        if (!strstr(grew, cases[i].want)) fail_msg("leak case %zu: expected %s to grow, got \"%s\"", i, cases[i].want, grew);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_memory_flat_after_warmup),
        cmocka_unit_test(test_soak_detects_leaks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
