/* Raw cudaMemcpyAsync on pinned memory, its own two streams: the peer the
 * copy engine is measured against. */
#include "copy_raw.h"
#include "tidal/util.h"

#include <cuda_runtime_api.h>
#include <stdio.h>

static cudaStream_t up_stream, down_stream;

static int fail(cudaError_t e, const char *what, char *err, size_t err_bytes)
{
    snprintf(err, err_bytes, "%s: %s", what, cudaGetErrorString(e));
    return -1;
}

int raw_copy_cuda_ms(raw_mode mode, void *dev_dst, const void *host_src, void *host_dst, const void *dev_src,
                     size_t bytes, double *ms, char *err, size_t err_bytes)
{
    cudaError_t e;
    if (!up_stream) {
        if ((e = cudaStreamCreateWithFlags(&up_stream, cudaStreamNonBlocking))) return fail(e, "stream", err, err_bytes);
        if ((e = cudaStreamCreateWithFlags(&down_stream, cudaStreamNonBlocking))) return fail(e, "stream", err, err_bytes);
    }
    double t0 = td_now_ms();
    if (mode != RAW_D2H && (e = cudaMemcpyAsync(dev_dst, host_src, bytes, cudaMemcpyHostToDevice, up_stream)))
        return fail(e, "cudaMemcpyAsync H2D", err, err_bytes);
    if (mode != RAW_H2D && (e = cudaMemcpyAsync(host_dst, dev_src, bytes, cudaMemcpyDeviceToHost, down_stream)))
        return fail(e, "cudaMemcpyAsync D2H", err, err_bytes);
    if ((e = cudaStreamSynchronize(up_stream))) return fail(e, "sync", err, err_bytes);
    if ((e = cudaStreamSynchronize(down_stream))) return fail(e, "sync", err, err_bytes);
    *ms = td_now_ms() - t0;
    return 0;
}

void raw_copy_cuda_shutdown(void)
{
    if (up_stream) cudaStreamDestroy(up_stream);
    if (down_stream) cudaStreamDestroy(down_stream);
    up_stream = down_stream = NULL;
}
