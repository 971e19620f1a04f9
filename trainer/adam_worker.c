/* The CPU AdamW's own thread (adam_worker.h). */
#include "adam_worker.h"
#include "tidal/alloc.h"
#include "tidal/util.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

enum { IDLE, QUEUED, RUNNING, DONE };

struct td_adam_worker {
    td_adam_job_fn fn;
    td_adam_drop_fn drop;
    td_adam_ready_fn ready;
    void *ctx;
    int slots;
    pthread_t thread;
    int started;
    pthread_mutex_t lock;
    pthread_cond_t work, done;
    int count;                      /* jobs QUEUED */
    unsigned char *state;           /* per job */
    td_status *status;
    char (*msg)[512];               /* a failed job's message */
    td_adam_job_times *times;       /* per job: submitted, started, ended */
    uint64_t *order, submits;       /* per job: its submit's sequence number */
    td_status failed;               /* the first failure: later jobs are not run */
    int failed_k;
    int stop;
};

/* The job to run next (w->lock held, w->count > 0): the lowest index
 * waiting (the chunk the next forward needs first) among those whose inputs
 * are in; while none is, the one handed over first. */
static int pick(td_adam_worker *w)
{
    int first = -1;
    for (int k = 0; k < w->slots; k++) {
        if (w->state[k] != QUEUED) continue;
        if (!w->ready || w->ready(w->ctx, k)) return k;
        if (first < 0 || w->order[k] < w->order[first]) first = k;
    }
    return first;
}

static void *worker_main(void *arg)
{
    td_adam_worker *w = arg;
    pthread_mutex_lock(&w->lock);
    for (;;) {
        while (!w->count && !w->stop) pthread_cond_wait(&w->work, &w->lock);
        if (w->stop) break;
        int k = pick(w);
        w->count--;
        td_status st = w->failed;
        if (!st) {
            w->state[k] = RUNNING;
            pthread_mutex_unlock(&w->lock);
            td_error_clear();
            double t0 = td_now_ms();
            st = w->fn(w->ctx, k);
            double t1 = td_now_ms();
            pthread_mutex_lock(&w->lock);
            w->times[k].started_ms = t0;
            w->times[k].ended_ms = t1;
            if (st) {
                snprintf(w->msg[k], sizeof w->msg[k], "%s", td_error_msg());
                w->failed = st;
                w->failed_k = k;
            }
        } else {
            snprintf(w->msg[k], sizeof w->msg[k], "the AdamW of chunk %d was not run: chunk %d's failed first",
                     k, w->failed_k);
            if (w->drop) w->drop(w->ctx, k);
        }
        w->status[k] = st;
        w->state[k] = DONE;
        pthread_cond_broadcast(&w->done);
    }
    for (int k = 0; k < w->slots && w->count; k++) /* stopped: the queued jobs are dropped */
        if (w->state[k] == QUEUED) {
            w->state[k] = IDLE;
            w->count--;
            if (w->drop) w->drop(w->ctx, k);
        }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

td_status td_adam_worker_create(int slots, td_adam_job_fn fn, td_adam_drop_fn drop, void *ctx, td_adam_worker **out)
{
    *out = NULL;
    if (slots < 1 || !fn) return td_error_set(TD_ERR_INVALID, "AdamW worker: %d job slots, fn %p", slots, (void *)fn);
    td_adam_worker *w = td_calloc(1, sizeof *w, TD_ROLE_META);
    if (!w) return TD_ERR_NOMEM;
    w->fn = fn;
    w->drop = drop;
    w->ctx = ctx;
    w->slots = slots;
    w->state = td_calloc((size_t)slots, sizeof *w->state, TD_ROLE_META);
    w->status = td_calloc((size_t)slots, sizeof *w->status, TD_ROLE_META);
    w->msg = td_calloc((size_t)slots, sizeof *w->msg, TD_ROLE_META);
    w->times = td_calloc((size_t)slots, sizeof *w->times, TD_ROLE_META);
    w->order = td_calloc((size_t)slots, sizeof *w->order, TD_ROLE_META);
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->work, NULL);
    pthread_cond_init(&w->done, NULL);
    if (!w->state || !w->status || !w->msg || !w->times || !w->order) {
        td_adam_worker_destroy(w);
        return TD_ERR_NOMEM;
    }
    int rc = pthread_create(&w->thread, NULL, worker_main, w);
    if (rc) {
        td_adam_worker_destroy(w);
        return td_error_set(TD_ERR_NOMEM, "AdamW worker: cannot start its thread (%s)", strerror(rc));
    }
    w->started = 1;
    *out = w;
    return TD_OK;
}

void td_adam_worker_destroy(td_adam_worker *w)
{
    if (!w) return;
    if (w->started) {
        pthread_mutex_lock(&w->lock);
        w->stop = 1;
        pthread_cond_broadcast(&w->work);
        pthread_mutex_unlock(&w->lock);
        pthread_join(w->thread, NULL);
    }
    pthread_cond_destroy(&w->done);
    pthread_cond_destroy(&w->work);
    pthread_mutex_destroy(&w->lock);
    td_free(w->state);
    td_free(w->status);
    td_free(w->msg);
    td_free(w->times);
    td_free(w->order);
    td_free(w);
}

void td_adam_worker_set_ready(td_adam_worker *w, td_adam_ready_fn ready)
{
    pthread_mutex_lock(&w->lock);
    w->ready = ready;
    pthread_mutex_unlock(&w->lock);
}

static td_status check_k(const td_adam_worker *w, int k, const char *what)
{
    if (k < 0 || k >= w->slots)
        return td_error_set(TD_ERR_INVALID, "AdamW worker: %s job %d of %d", what, k, w->slots);
    return TD_OK;
}

td_status td_adam_worker_submit(td_adam_worker *w, int k)
{
    td_status st = check_k(w, k, "submit");
    if (st) return st;
    pthread_mutex_lock(&w->lock);
    if (w->state[k] != IDLE) {
        pthread_mutex_unlock(&w->lock);
        return td_error_set(TD_ERR_STATE, "AdamW worker: chunk %d handed over again before it was waited for", k);
    }
    w->state[k] = QUEUED;
    w->times[k] = (td_adam_job_times){ .submitted_ms = td_now_ms() };
    w->order[k] = ++w->submits;
    w->count++;
    pthread_cond_signal(&w->work);
    pthread_mutex_unlock(&w->lock);
    return TD_OK;
}

td_status td_adam_worker_wait_timed(td_adam_worker *w, int k, td_adam_job_times *times)
{
    if (times) *times = (td_adam_job_times){0};
    td_status st = check_k(w, k, "wait for");
    if (st) return st;
    char msg[512] = "";
    double t0 = td_now_ms();
    pthread_mutex_lock(&w->lock);
    int blocked = w->state[k] == QUEUED || w->state[k] == RUNNING;
    while (w->state[k] == QUEUED || w->state[k] == RUNNING) pthread_cond_wait(&w->done, &w->lock);
    if (w->state[k] == DONE) {
        st = w->status[k];
        if (st) memcpy(msg, w->msg[k], sizeof msg);
        w->state[k] = IDLE;
        if (times) {
            *times = w->times[k];
            if (blocked) times->waited_ms = td_now_ms() - t0;
        }
    }
    pthread_mutex_unlock(&w->lock);
    return st ? td_error_set(st, "%s", msg) : TD_OK;
}

td_status td_adam_worker_wait(td_adam_worker *w, int k) { return td_adam_worker_wait_timed(w, k, NULL); }

static int state_of(td_adam_worker *w, int k)
{
    if (k < 0 || k >= w->slots) return IDLE;
    pthread_mutex_lock(&w->lock);
    int s = w->state[k];
    pthread_mutex_unlock(&w->lock);
    return s;
}

int td_adam_worker_pending(td_adam_worker *w, int k) { return state_of(w, k) != IDLE; }
int td_adam_worker_finished(td_adam_worker *w, int k) { return state_of(w, k) == DONE; }
