/* The NCCL communicator (cuda backend): rank 0's ncclUniqueId travels over
 * the rendezvous, every collective is enqueued on the queue's CUDA stream
 * (async: it is complete when an event recorded after it is).  Buffers must
 * be device memory, or pinned host memory the device can address.
 *
 * NCCL's own buffers are cudaMalloc'd by NCCL outside the arena; the
 * arena's default budget leaves a margin for them (docs/distributed.md). */
#include "dist_impl.h"
#include "tidal/alloc.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>

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

static ncclDataType_t nccl_type(td_dtype dt)
{
    return dt == TD_DTYPE_F32 ? ncclFloat32 : dt == TD_DTYPE_BF16 ? ncclBfloat16 : ncclFloat16;
}

static cudaStream_t stream(td_comm *c, td_queue q) { return (cudaStream_t)td_backend_native_queue(c->backend, q); }

static void nccl_destroy(td_comm *base)
{
    nccl_comm *c = (nccl_comm *)base;
    if (c->nc) ncclCommDestroy(c->nc);
    td_rdv_close(base->rdv);
    td_free(c);
}

static td_status nccl_all_gather(td_comm *base, const void *send, void *recv, size_t count, td_dtype dt, td_queue q)
{
    nccl_comm *c = (nccl_comm *)base;
    NC(ncclAllGather(send, recv, count, nccl_type(dt), c->nc, stream(base, q)), "ncclAllGather");
    return TD_OK;
}

static td_status nccl_reduce_scatter(td_comm *base, const void *send, void *recv, size_t count, td_dtype dt,
                                     td_queue q)
{
    nccl_comm *c = (nccl_comm *)base;
    NC(ncclReduceScatter(send, recv, count, nccl_type(dt), ncclSum, c->nc, stream(base, q)), "ncclReduceScatter");
    return TD_OK;
}

static td_status nccl_all_reduce(td_comm *base, const void *send, void *recv, size_t count, td_dtype dt,
                                 td_reduce_op op, td_queue q)
{
    nccl_comm *c = (nccl_comm *)base;
    NC(ncclAllReduce(send, recv, count, nccl_type(dt), op == TD_REDUCE_MAX ? ncclMax : ncclSum, c->nc,
                     stream(base, q)), "ncclAllReduce");
    return TD_OK;
}

static td_status nccl_broadcast(td_comm *base, void *buf, size_t count, td_dtype dt, int root, td_queue q)
{
    nccl_comm *c = (nccl_comm *)base;
    NC(ncclBroadcast(buf, buf, count, nccl_type(dt), root, c->nc, stream(base, q)), "ncclBroadcast");
    return TD_OK;
}

static const td_comm_ops nccl_ops = {
    .destroy = nccl_destroy,
    .all_gather = nccl_all_gather,
    .reduce_scatter = nccl_reduce_scatter,
    .all_reduce = nccl_all_reduce,
    .broadcast = nccl_broadcast,
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
    NC(ncclCommInitRank(&c->nc, c->base.size, id, c->base.rank), "ncclCommInitRank");
    return TD_OK;
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
        if (c->nc) ncclCommDestroy(c->nc);
        td_free(c);
        return st;
    }
    *out = &c->base;
    return TD_OK;
}
