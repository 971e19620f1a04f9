/* The CPU AdamW's own thread (trainer/adam_worker.h): jobs run lowest index
 * first among those waiting, on another thread; a wait returns its job's status with the
 * message; after a failure the later jobs are not run; a job cannot be
 * handed over twice before it is waited for; destroy drops what is queued. */
#include "td_test.h"
#include "../trainer/adam_worker.h"
#include "tidal/util.h"

#include <pthread.h>
#include <string.h>
#include <unistd.h>

typedef struct {
    pthread_mutex_t lock;
    int order[16], n;
    pthread_t ran_on[16];
    int fail_at;          /* this job fails (-1: none) */
    int dropped[16], n_dropped;
    int sleep_us;
    int gate_k, gate_open; /* job gate_k waits until gate_open (-1: no gate) */
    int ready[16];         /* with a ready callback: whose inputs are in */
} log_ctx;

static td_status job(void *ctx, int k)
{
    log_ctx *c = ctx;
    if (c->sleep_us) usleep((useconds_t)c->sleep_us);
    pthread_mutex_lock(&c->lock);
    c->order[c->n++] = k;
    c->ran_on[k] = pthread_self();
    pthread_mutex_unlock(&c->lock);
    for (;;) {
        pthread_mutex_lock(&c->lock);
        int wait = k == c->gate_k && !c->gate_open;
        pthread_mutex_unlock(&c->lock);
        if (!wait) break;
        usleep(1000);
    }
    if (k == c->fail_at) return td_error_set(TD_ERR_IO, "job %d: disk on fire", k);
    return TD_OK;
}

static void dropped(void *ctx, int k)
{
    log_ctx *c = ctx;
    pthread_mutex_lock(&c->lock);
    c->dropped[c->n_dropped++] = k;
    pthread_mutex_unlock(&c->lock);
}

/* The first job runs at once; those handed over while it runs go lowest
 * index first (the order the next forward needs the chunks). */
static void test_jobs_run_lowest_first_on_another_thread(void **state)
{
    log_ctx c = { .lock = PTHREAD_MUTEX_INITIALIZER, .fail_at = -1, .gate_k = 5 };
    td_adam_worker *w;
    TD_ASSERT_OK(td_adam_worker_create(8, job, dropped, &c, &w));
    TD_ASSERT_OK(td_adam_worker_submit(w, 5));
    for (;;) { /* job 5 is running (held at its gate) */
        pthread_mutex_lock(&c.lock);
        int n = c.n;
        pthread_mutex_unlock(&c.lock);
        if (n) break;
        usleep(1000);
    }
    int handed[] = {3, 7, 0, 1}, want[] = {5, 0, 1, 3, 7};
    for (int i = 0; i < 4; i++) TD_ASSERT_OK(td_adam_worker_submit(w, handed[i]));
    for (int i = 0; i < 4; i++) assert_true(td_adam_worker_pending(w, handed[i]));
    assert_false(td_adam_worker_pending(w, 2));
    assert_false(td_adam_worker_finished(w, 5));
    pthread_mutex_lock(&c.lock);
    c.gate_open = 1;
    pthread_mutex_unlock(&c.lock);
    TD_ASSERT_OK(td_adam_worker_wait(w, 7)); /* the last: all have run */
    assert_int_equal(c.n, 5);
    for (int i = 0; i < 5; i++) {
        assert_int_equal(c.order[i], want[i]);
        assert_false(pthread_equal(c.ran_on[want[i]], pthread_self()));
        assert_true(td_adam_worker_finished(w, want[i]) || want[i] == 7);
    }
    assert_false(td_adam_worker_pending(w, 7)); /* waited for: forgotten */
    for (int i = 0; i < 4; i++) TD_ASSERT_OK(td_adam_worker_wait(w, want[i]));
    TD_ASSERT_OK(td_adam_worker_wait(w, 2)); /* never handed over: nothing to wait for */
    /* Again, after the waits. */
    TD_ASSERT_OK(td_adam_worker_submit(w, 5));
    TD_ASSERT_OK(td_adam_worker_wait(w, 5));
    assert_int_equal(c.n, 6);
    assert_int_equal(c.n_dropped, 0);
    td_adam_worker_destroy(w);
}

static void test_failure_reaches_the_waiter(void **state)
{
    log_ctx c = { .lock = PTHREAD_MUTEX_INITIALIZER, .fail_at = 2, .gate_k = -1 };
    td_adam_worker *w;
    TD_ASSERT_OK(td_adam_worker_create(4, job, dropped, &c, &w));
    for (int k = 0; k < 4; k++) TD_ASSERT_OK(td_adam_worker_submit(w, k));
    TD_ASSERT_OK(td_adam_worker_wait(w, 0));
    TD_ASSERT_OK(td_adam_worker_wait(w, 1));
    td_error_clear();
    assert_int_equal(td_adam_worker_wait(w, 2), TD_ERR_IO);
    assert_non_null(strstr(td_error_msg(), "disk on fire"));
    assert_int_equal(td_adam_worker_wait(w, 3), TD_ERR_IO); /* not run after it */
    assert_non_null(strstr(td_error_msg(), "chunk 2's failed first"));
    assert_int_equal(c.n, 3);
    assert_int_equal(c.n_dropped, 1); /* the job not run let go of what it held */
    assert_int_equal(c.dropped[0], 3);
    td_adam_worker_destroy(w);
}

static void test_misuse_is_refused(void **state)
{
    log_ctx c = { .lock = PTHREAD_MUTEX_INITIALIZER, .fail_at = -1, .sleep_us = 20000, .gate_k = -1 };
    td_adam_worker *w;
    assert_int_equal(td_adam_worker_create(0, job, NULL, &c, &w), TD_ERR_INVALID);
    TD_ASSERT_OK(td_adam_worker_create(2, job, NULL, &c, &w));
    TD_ASSERT_OK(td_adam_worker_submit(w, 0));
    assert_int_equal(td_adam_worker_submit(w, 0), TD_ERR_STATE);
    assert_non_null(strstr(td_error_msg(), "again"));
    assert_int_equal(td_adam_worker_submit(w, 2), TD_ERR_INVALID);
    assert_int_equal(td_adam_worker_wait(w, -1), TD_ERR_INVALID);
    TD_ASSERT_OK(td_adam_worker_wait(w, 0));
    td_adam_worker_destroy(w);
}

static int is_ready(void *ctx, int k)
{
    log_ctx *c = ctx;
    pthread_mutex_lock(&c->lock);
    int r = c->ready[k];
    pthread_mutex_unlock(&c->lock);
    return r;
}

/* With a ready callback: the lowest index among the jobs whose inputs are
 * in runs first; while none is, the one handed over first (its copy was
 * queued first). */
static void test_ready_jobs_run_first(void **state)
{
    log_ctx c = { .lock = PTHREAD_MUTEX_INITIALIZER, .fail_at = -1, .gate_k = 9 };
    td_adam_worker *w;
    TD_ASSERT_OK(td_adam_worker_create(12, job, dropped, &c, &w));
    td_adam_worker_set_ready(w, is_ready);
    c.ready[9] = 1;
    TD_ASSERT_OK(td_adam_worker_submit(w, 9)); /* runs at once, held at its gate */
    for (;;) {
        pthread_mutex_lock(&c.lock);
        int n = c.n;
        pthread_mutex_unlock(&c.lock);
        if (n) break;
        usleep(1000);
    }
    /* handed over in this order; 6 and 4 ready, 1, 2, 7 not (yet) */
    int handed[] = {7, 2, 6, 1, 4};
    c.ready[6] = c.ready[4] = 1;
    for (int i = 0; i < 5; i++) TD_ASSERT_OK(td_adam_worker_submit(w, handed[i]));
    pthread_mutex_lock(&c.lock);
    c.gate_open = 1;
    pthread_mutex_unlock(&c.lock);
    for (int i = 0; i < 5; i++) TD_ASSERT_OK(td_adam_worker_wait(w, handed[i]));
    int want[] = {9, 4, 6, 7, 2, 1}; /* the ready ones by index, then the rest as handed over */
    assert_int_equal(c.n, 6);
    for (int i = 0; i < 6; i++)
        if (c.order[i] != want[i]) fail_msg("job %d ran %d-th, %d expected", c.order[i], i + 1, want[i]);
    td_adam_worker_destroy(w);
}

/* A job's times: submitted <= started <= ended, its run as long as the job
 * (20 ms of sleep), the wait as long as it blocked; a job the wait found
 * done did not block; one never handed over has no times. */
static void test_job_times(void **state)
{
    log_ctx c = { .lock = PTHREAD_MUTEX_INITIALIZER, .fail_at = -1, .sleep_us = 20000, .gate_k = -1 };
    td_adam_worker *w;
    TD_ASSERT_OK(td_adam_worker_create(3, job, NULL, &c, &w));
    double t0 = td_now_ms();
    TD_ASSERT_OK(td_adam_worker_submit(w, 0));
    TD_ASSERT_OK(td_adam_worker_submit(w, 1));
    td_adam_job_times a, b, none;
    TD_ASSERT_OK(td_adam_worker_wait_timed(w, 0, &a));
    double t1 = td_now_ms();
    assert_true(a.submitted_ms >= t0 && a.submitted_ms <= a.started_ms && a.started_ms < a.ended_ms);
    assert_true(a.ended_ms - a.started_ms >= 19.0);
    assert_true(a.waited_ms >= 15.0 && a.waited_ms <= t1 - t0 + 0.01);
    while (!td_adam_worker_finished(w, 1)) usleep(1000);
    TD_ASSERT_OK(td_adam_worker_wait_timed(w, 1, &b));
    assert_true(b.started_ms >= a.ended_ms && b.ended_ms - b.started_ms >= 19.0);
    assert_true(b.waited_ms == 0.0); /* it was done: nothing blocked */
    TD_ASSERT_OK(td_adam_worker_wait_timed(w, 2, &none));
    assert_true(none.submitted_ms == 0.0 && none.started_ms == 0.0 && none.ended_ms == 0.0 && none.waited_ms == 0.0);
    td_adam_worker_destroy(w);
}

/* Destroy with jobs queued: the running one finishes, the rest are dropped. */
static void test_destroy_drops_the_queue(void **state)
{
    log_ctx c = { .lock = PTHREAD_MUTEX_INITIALIZER, .fail_at = -1, .sleep_us = 20000, .gate_k = -1 };
    td_adam_worker *w;
    TD_ASSERT_OK(td_adam_worker_create(8, job, dropped, &c, &w));
    for (int k = 0; k < 8; k++) TD_ASSERT_OK(td_adam_worker_submit(w, k));
    td_adam_worker_destroy(w);
    assert_true(c.n < 8);
    for (int i = 0; i < c.n; i++) assert_int_equal(c.order[i], i);
    assert_int_equal(c.n + c.n_dropped, 8); /* each ran or was dropped */
    for (int i = 0; i < c.n_dropped; i++) assert_int_equal(c.dropped[i], c.n + i);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_jobs_run_lowest_first_on_another_thread),
        cmocka_unit_test(test_failure_reaches_the_waiter),
        cmocka_unit_test(test_misuse_is_refused),
        cmocka_unit_test(test_job_times),
        cmocka_unit_test(test_ready_jobs_run_first),
        cmocka_unit_test(test_destroy_drops_the_queue),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
