/* The link between two GPUs, as ZeRO-3's all-gathers and reduce-scatters
 * use it (tidal/block_probe.h: td_link_probe_cuda): peer copies timed with
 * events, the buffers from an arena on each device. */
#include "tidal/block_probe.h"

#include "tidal/arena.h"
#include "tidal/util.h"

#include <cuda_runtime.h>

#define CK(call, what)                                                                                    \
    do {                                                                                                  \
        cudaError_t e_ = (call);                                                                          \
        if (e_ != cudaSuccess) {                                                                          \
            st = td_error_set(TD_ERR_BACKEND, "link probe: %s: %s", what, cudaGetErrorString(e_));       \
            goto cleanup;                                                                                 \
        }                                                                                                 \
    } while (0)

td_status td_link_probe_cuda(td_backend *b, double *gbytes_per_s, const char **what)
{
    td_status st = TD_OK;
    const size_t bytes = 256 * TD_MiB;
    int n = 0, dev = 0, can = 0, enabled = 0;
    td_backend *pb = NULL;
    td_arena *mine = NULL, *theirs = NULL;
    void *dst = NULL, *src = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    *gbytes_per_s = 0;
    *what = "not measured (one GPU)";
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) {
        cudaGetLastError();
        return TD_OK;
    }
    CK(cudaGetDevice(&dev), "cudaGetDevice");
    int peer = dev == 0 ? 1 : 0;
    CK(cudaDeviceCanAccessPeer(&can, dev, peer), "cudaDeviceCanAccessPeer");
    td_backend_params bp = td_backend_default_params();
    bp.kind = TD_BACKEND_CUDA;
    bp.cuda_device = peer;
    TD_TRY(td_backend_create(&bp, &pb));
    TD_TRY(td_arena_create(pb, bytes + TD_ARENA_ALIGN, &theirs));
    TD_TRY(td_arena_alloc(theirs, bytes, TD_ROLE_STAGING, &src));
    TD_TRY(td_backend_memset_async(pb, TD_QUEUE_COMPUTE, src, 1, bytes));
    TD_TRY(td_queue_sync(pb, TD_QUEUE_COMPUTE));
    CK(cudaSetDevice(dev), "cudaSetDevice"); /* the peer's backend made its device current */
    TD_TRY(td_arena_create(b, bytes + TD_ARENA_ALIGN, &mine));
    TD_TRY(td_arena_alloc(mine, bytes, TD_ROLE_STAGING, &dst));
    if (can) {
        cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
        if (e == cudaSuccess) enabled = 1;
        else if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
        else CK(e, "cudaDeviceEnablePeerAccess");
    }
    cudaStream_t s = (cudaStream_t)td_backend_native_queue(b, TD_QUEUE_COMPUTE);
    CK(cudaEventCreate(&e0), "cudaEventCreate");
    CK(cudaEventCreate(&e1), "cudaEventCreate");
    float best = 0;
    for (int i = 0; i < 5; i++) { /* the first warms up */
        CK(cudaEventRecord(e0, s), "cudaEventRecord");
        CK(cudaMemcpyPeerAsync(dst, dev, src, peer, bytes, s), "cudaMemcpyPeerAsync");
        CK(cudaEventRecord(e1, s), "cudaEventRecord");
        CK(cudaEventSynchronize(e1), "cudaEventSynchronize");
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
        if (i && (best == 0 || ms < best)) best = ms;
    }
    *gbytes_per_s = best > 0 ? (double)bytes / (best * 1e-3) / 1e9 : 0;
    *what = can ? "peer copies from a second GPU (peer-to-peer)" : "peer copies from a second GPU (through the host)";
cleanup:
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    if (enabled) cudaDeviceDisablePeerAccess(peer);
    if (dst) td_arena_release(mine, dst);
    td_arena_destroy(mine);
    if (src) td_arena_release(theirs, src);
    td_arena_destroy(theirs);
    td_backend_free(pb);
    cudaSetDevice(dev);
    return st;
}
