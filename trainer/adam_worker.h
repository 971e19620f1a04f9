/* Internal to the trainer: the CPU AdamW on a thread of its own.
 *
 * The thread that drives the GPU must not run the CPU AdamW itself: it is
 * held in the backward until the last chunks are issued (it waits for
 * evictions and loads under the budget), so an AdamW it runs starts only
 * when the backward ends, and the step takes compute + AdamW instead of
 * their maximum.  The worker takes param chunks by index, in the order they
 * are handed over, lowest index first among those waiting (param chunks:
 * the order the next forward needs them), and runs `fn(ctx, k)` for each on its own thread
 * (whose OpenMP team is the AdamW team); the driving thread goes on issuing
 * GPU work and waits for chunk k only where it needs chunk k's result.
 *
 * A job's failure is kept with its message: td_adam_worker_wait on that
 * chunk returns it (the message set on the waiting thread), and the jobs
 * handed over after it are not run (their wait says why); for each job
 * not run (so too those queued at destroy), `drop(ctx, k)` lets go of
 * what the job would have (a staging slot someone may be waiting for).
 * Thread-safety: one thread submits and waits; fn runs on the worker. */
#ifndef TIDAL_ADAM_WORKER_H
#define TIDAL_ADAM_WORKER_H

#include "tidal/status.h"

typedef struct td_adam_worker td_adam_worker;
typedef td_status (*td_adam_job_fn)(void *ctx, int k);
typedef void (*td_adam_drop_fn)(void *ctx, int k);

/* A worker for jobs 0 .. slots-1 (each at most once until waited for). */
td_status td_adam_worker_create(int slots, td_adam_job_fn fn, td_adam_drop_fn drop, void *ctx, td_adam_worker **out);
/* Lets the job running finish, drops the ones queued, joins the thread. */
void td_adam_worker_destroy(td_adam_worker *w);
/* Whether job k's inputs are in (non-blocking; called on the worker's
 * thread).  With one set, the worker runs the lowest-index job that is
 * ready and, while none is, the one handed over first (its inputs, queued
 * first, land first): it never sits waiting on one job's copy while
 * another's has landed.  Set it before the first submit. */
typedef int (*td_adam_ready_fn)(void *ctx, int k);
void td_adam_worker_set_ready(td_adam_worker *w, td_adam_ready_fn ready);
/* Queues job k; TD_ERR_STATE if it is queued or done and not yet waited for. */
td_status td_adam_worker_submit(td_adam_worker *w, int k);
/* Until job k has run; its status (TD_OK for a job never submitted).  The
 * job is then forgotten: k may be submitted again. */
td_status td_adam_worker_wait(td_adam_worker *w, int k);
/* When job k ran and how long its wait blocked, on td_now_ms's clock (all
 * 0 for a job never submitted, or one not run after a failure). */
typedef struct td_adam_job_times {
    double submitted_ms, started_ms, ended_ms; /* started == ended: not run */
    double waited_ms;                          /* the waiting thread blocked this long */
} td_adam_job_times;
/* td_adam_worker_wait, with job k's times into *times. */
td_status td_adam_worker_wait_timed(td_adam_worker *w, int k, td_adam_job_times *times);
/* Whether job k was handed over and not yet waited for. */
int td_adam_worker_pending(td_adam_worker *w, int k);
/* Whether job k has run (a wait would not block). */
int td_adam_worker_finished(td_adam_worker *w, int k);

#endif
