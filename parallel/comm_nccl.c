/* The NCCL communicator (cuda backend): rank 0's ncclUniqueId travels over
 * the rendezvous, every collective is enqueued on the queue's CUDA stream
 * (async: it is complete when an event recorded after it is).  Buffers must
 * be device memory, or pinned host memory the device can address.
 *
 * Timeouts: a blocking NCCL communicator waits forever for a peer that died
 * inside a collective.  This one is non-blocking (ncclConfig_t blocking = 0):
 * every call may return ncclInProgress, and the host then polls
 * ncclCommGetAsyncError; td_comm_wait polls the stream the same way.  When
 * nothing completes within the timeout (--comm-timeout), the communicator is
 * aborted (ncclCommAbort ends its kernels, so the stream drains) and the
 * error names the ranks whose rendezvous link has closed, when any has.
 *
 * NCCL's own buffers are cudaMalloc'd by NCCL outside the arena; the
 * arena's default budget leaves a margin for them (docs/distributed.md). */
#include "parallel_impl.h"
#include "tidal/alloc.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include "tidal/util.h"

typedef struct nccl_comm {
    td_comm base;
    ncclComm_t nc;
    int device;
} nccl_comm;

#define NC(call, what)                                                                                       \
    do {                                                                                                     \
        ncclResult_t r_ = (call);                                                                            \
        if (r_ != ncclSuccess)                                                                               \
            return td_error_set(TD_ERR_BACKEND, "%s on rank %d (device %d): %s%s", what, c->base.rank,      \
                                c->device, ncclGetErrorString(r_),                                           \
                                r_ == ncclSystemError || r_ == ncclRemoteError ? " (another rank may have failed; " \
                                "NCCL_DEBUG=WARN says more)" : "");                                          \
    } while (0)

/* A timeout or an asynchronous error: abort (NCCL's way out of a
 * collective that will never finish) and say which peers are gone. */
static td_status fail(nccl_comm *c, const char *what, ncclResult_t r, int timed_out)
{
    char dead[560], why[480] = "";
    int failed = td_rdv_dead_peers(c->base.rdv, dead, sizeof dead);
    if (c->nc) ncclCommAbort(c->nc);
    c->nc = NULL;
    c->base.failed_seq = c->base.seq ? c->base.seq : 1; /* nothing runs on an aborted communicator */
    /* as the CPU communicator does: rank 0 names the rank it lost to the others */
    if (c->base.rank == 0 && failed > 0)
        td_rdv_notify_fault(c->base.rdv, failed, "its connection closed while NCCL was waiting for it");
    else if (c->base.rank > 0 && failed == 0 &&
             td_rdv_fault_notice(c->base.rdv, 2000, &failed, why, sizeof why))
        snprintf(dead, sizeof dead, "rank %d, which rank 0 reports: %s", failed, why);
    td_rdv_shutdown(c->base.rdv); /* the other ranks fail at once instead of at their timeout */
    if (timed_out)
        return td_error_set(TD_ERR_IO, "%s on rank %d (device %d): no progress for %.1f s%s%s%s; the communicator "
                            "was aborted (raise --comm-timeout if a step can take longer)", what, c->base.rank,
                            c->device, c->base.timeout_ms / 1000.0, *dead ? " (lost: " : " (a peer rank died or hangs",
                            dead, ")");
    return td_error_set(TD_ERR_BACKEND, "%s on rank %d (device %d): %s%s%s%s", what, c->base.rank, c->device,
                        ncclGetErrorString(r), *dead ? " (lost: " : " (another rank may have failed; NCCL_DEBUG=WARN "
                        "says more", dead, ")");
}

/* Polls a non-blocking call (result r) to its end within the timeout. */
static td_status settle(nccl_comm *c, ncclResult_t r, const char *what)
{
    double deadline = td_now_ms() + c->base.timeout_ms;
    while (r == ncclInProgress) {
        if (td_now_ms() > deadline) return fail(c, what, r, 1);
        td_sleep_us(50);
        ncclResult_t q = ncclCommGetAsyncError(c->nc, &r);
        if (q != ncclSuccess) r = q;
    }
    return r == ncclSuccess ? TD_OK : fail(c, what, r, 0);
}

static ncclDataType_t nccl_type(td_dtype dt)
{
    return dt == TD_DTYPE_F32 ? ncclFloat32 : dt == TD_DTYPE_BF16 ? ncclBfloat16 : ncclFloat16;
}

static cudaStream_t stream(td_comm *c, td_queue q) { return (cudaStream_t)td_backend_native_queue(c->backend, q); }

static void nccl_destroy(td_comm *base)
{
    nccl_comm *c = (nccl_comm *)base;
    /* finalize flushes what is in flight (polled, bounded); abort when it will not end */
    if (c->nc && settle(c, ncclCommFinalize(c->nc), "ncclCommFinalize") == TD_OK) ncclCommDestroy(c->nc);
    td_rdv_close(base->rdv);
    td_free(c);
}

static td_status nccl_all_gather(td_comm *base, const void *send, void *recv, size_t count, td_dtype dt, td_queue q)
{
    nccl_comm *c = (nccl_comm *)base;
    return settle(c, ncclAllGather(send, recv, count, nccl_type(dt), c->nc, stream(base, q)), "ncclAllGather");
}

static td_status nccl_reduce_scatter(td_comm *base, const void *send, void *recv, size_t count, td_dtype dt,
                                     td_queue q)
{
    nccl_comm *c = (nccl_comm *)base;
    return settle(c, ncclReduceScatter(send, recv, count, nccl_type(dt), ncclSum, c->nc, stream(base, q)),
                  "ncclReduceScatter");
}

static td_status nccl_all_reduce(td_comm *base, const void *send, void *recv, size_t count, td_dtype dt,
                                 td_reduce_op op, td_queue q)
{
    nccl_comm *c = (nccl_comm *)base;
    return settle(c, ncclAllReduce(send, recv, count, nccl_type(dt), op == TD_REDUCE_MAX ? ncclMax : ncclSum, c->nc,
                                   stream(base, q)), "ncclAllReduce");
}

static td_status nccl_broadcast(td_comm *base, void *buf, size_t count, td_dtype dt, int root, td_queue q)
{
    nccl_comm *c = (nccl_comm *)base;
    return settle(c, ncclBroadcast(buf, buf, count, nccl_type(dt), root, c->nc, stream(base, q)), "ncclBroadcast");
}

/* The stream's work, collectives included, within the timeout: a
 * collective that a dead peer never completes is aborted, not waited on. */
static td_status nccl_wait(td_comm *base, td_queue q)
{
    nccl_comm *c = (nccl_comm *)base;
    cudaStream_t s = stream(base, q);
    if (!c->nc) return td_error_set(TD_ERR_STATE, "rank %d: the NCCL communicator was aborted", base->rank);
    double deadline = td_now_ms() + base->timeout_ms;
    for (;;) {
        cudaError_t e = cudaStreamQuery(s);
        if (e == cudaSuccess) return TD_OK;
        if (e != cudaErrorNotReady)
            return td_error_set(TD_ERR_BACKEND, "waiting for the stream of queue %d on rank %d: %s", (int)q,
                                base->rank, cudaGetErrorString(e));
        ncclResult_t r = ncclSuccess, a = ncclCommGetAsyncError(c->nc, &r);
        if (a != ncclSuccess) r = a;
        if (r != ncclSuccess && r != ncclInProgress) return fail(c, "a collective", r, 0);
        if (td_now_ms() > deadline) return fail(c, "a collective", r, 1);
        td_sleep_us(100);
    }
}

static const td_comm_ops nccl_ops = {
    .destroy = nccl_destroy,
    .all_gather = nccl_all_gather,
    .reduce_scatter = nccl_reduce_scatter,
    .all_reduce = nccl_all_reduce,
    .broadcast = nccl_broadcast,
    .wait = nccl_wait,
};

static td_status init(nccl_comm *c)
{
    ncclUniqueId id;
    td_status st;
    cudaError_t e = cudaGetDevice(&c->device);
    if (e != cudaSuccess) return td_error_set(TD_ERR_BACKEND, "cudaGetDevice: %s", cudaGetErrorString(e));
    /* NVLink multicast (NVLS) can take every GPU of a shared host out of
     * service; off unless the user turns it on (before NCCL reads it). */
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    if (c->base.rank == 0) NC(ncclGetUniqueId(&id), "ncclGetUniqueId");
    if ((st = td_rdv_bcast(c->base.rdv, &id, sizeof id))) return td_error_prefix(st, "sending the NCCL id: ");
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0; /* so that a peer that never comes is a timeout, not a hang */
    return settle(c, ncclCommInitRankConfig(&c->nc, c->base.size, id, c->base.rank, &config), "ncclCommInitRankConfig");
}

td_status td_comm_nccl_create(td_comm *base, td_comm **out)
{
    nccl_comm *c = td_calloc(1, sizeof *c, TD_ROLE_COMM);
    if (!c) return TD_ERR_NOMEM;
    c->base = *base;
    c->base.ops = &nccl_ops;
    c->base.name = "nccl";
    td_status st = init(c);
    if (st) {
        if (c->nc) ncclCommAbort(c->nc);
        td_free(c);
        return st;
    }
    *out = &c->base;
    return TD_OK;
}
