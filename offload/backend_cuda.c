/* The cuda backend: one device, three non-blocking streams (compute, H2D,
 * D2H), CUDA events with timing, cudaMalloc'd device memory and
 * cudaHostRegister for pinning.  Host C against the CUDA runtime API; kernels
 * live in .cu files elsewhere and take the stream from td_backend_native_queue.
 * Copy streams get the higher priority so a chunk load is not queued behind
 * a long kernel's blocks. */
#include "backend_impl.h"
#include "tidal/alloc.h"
#include "tidal/util.h"

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <string.h>

typedef struct cuda_backend {
    td_backend base;
    int device;
    cudaStream_t stream[TD_QUEUE_COUNT];
    size_t reserved_bytes;
    /* Live reservations, so release can uncount exactly; the arena takes one. */
    struct reservation { void *ptr; size_t bytes; } live[64];
    int live_count;
} cuda_backend;

struct td_event {
    cudaEvent_t ev;
};

#define CU(call, what)                                                                   \
    do {                                                                                 \
        cudaError_t e_ = (call);                                                         \
        if (e_ != cudaSuccess) {                                                         \
            cudaGetLastError(); /* clear sticky-free errors so the next call is clean */ \
            return td_error_set(TD_ERR_BACKEND, "%s: %s (%s) at %s:%d", what,            \
                                cudaGetErrorString(e_), cudaGetErrorName(e_), __FILE__, __LINE__); \
        }                                                                                \
    } while (0)

static cuda_backend *cb(td_backend *b) { return (cuda_backend *)b; }

static void cuda_destroy(td_backend *b)
{
    cuda_backend *c = cb(b);
    cudaSetDevice(c->device);
    for (int q = 0; q < TD_QUEUE_COUNT; q++)
        if (c->stream[q]) {
            cudaStreamSynchronize(c->stream[q]);
            cudaStreamDestroy(c->stream[q]);
        }
    td_free(c);
}

static td_status cuda_mem_info(td_backend *b, size_t *free_bytes, size_t *total_bytes)
{
    CU(cudaSetDevice(cb(b)->device), "cudaSetDevice");
    CU(cudaMemGetInfo(free_bytes, total_bytes), "cudaMemGetInfo");
    return TD_OK;
}

static td_status cuda_dev_reserve(td_backend *b, size_t bytes, void **ptr)
{
    cuda_backend *c = cb(b);
    cudaError_t e = cudaMalloc(ptr, bytes);
    if (e != cudaSuccess) {
        cudaGetLastError();
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        char s[32], f[32], t[32], r[32];
        *ptr = NULL;
        return td_error_set(TD_ERR_DEVICE_MEM,
                            "cannot reserve %s on cuda:%d (%s): %s free of %s, %s already reserved by tidal; "
                            "lower --gpu-budget or free the GPU",
                            td_format_bytes(bytes, s, sizeof s), c->device, cudaGetErrorString(e),
                            td_format_bytes(free_b, f, sizeof f), td_format_bytes(total_b, t, sizeof t),
                            td_format_bytes(c->reserved_bytes, r, sizeof r));
    }
    if (c->live_count == (int)(sizeof c->live / sizeof c->live[0])) {
        cudaFree(*ptr);
        *ptr = NULL;
        return td_error_set(TD_ERR_DEVICE_MEM, "more than %d live device reservations; tidal takes its "
                            "device memory once, through the arena", c->live_count);
    }
    c->live[c->live_count++] = (struct reservation){*ptr, bytes};
    c->reserved_bytes += bytes;
    return TD_OK;
}

static void cuda_dev_release(td_backend *b, void *ptr)
{
    cuda_backend *c = cb(b);
    for (int i = 0; i < c->live_count; i++) {
        if (c->live[i].ptr != ptr) continue;
        c->reserved_bytes -= c->live[i].bytes;
        c->live[i] = c->live[--c->live_count];
        break;
    }
    cudaSetDevice(c->device);
    cudaFree(ptr);
}

static td_status cuda_host_register(td_backend *b, void *ptr, size_t bytes)
{
    cudaError_t e = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
    if (e != cudaSuccess) {
        cudaGetLastError();
        char s[32];
        return td_error_set(TD_ERR_PIN, "cudaHostRegister of %s failed: %s; the host may be out of "
                            "lockable memory (check `ulimit -l` and free RAM)",
                            td_format_bytes(bytes, s, sizeof s), cudaGetErrorString(e));
    }
    return TD_OK;
}

static void cuda_host_unregister(td_backend *b, void *ptr)
{
    if (cudaHostUnregister(ptr) != cudaSuccess) cudaGetLastError();
}

static td_status cuda_copy_async(td_backend *b, td_queue q, void *dst, const void *src, size_t bytes)
{
    CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cb(b)->stream[q]), "cudaMemcpyAsync");
    return TD_OK;
}

static td_status cuda_memset_async(td_backend *b, td_queue q, void *dst, int value, size_t bytes)
{
    CU(cudaMemsetAsync(dst, value, bytes, cb(b)->stream[q]), "cudaMemsetAsync");
    return TD_OK;
}

static td_status cuda_event_create(td_backend *b, td_event **out)
{
    td_event *ev = td_malloc(sizeof *ev, TD_ROLE_META);
    *out = NULL;
    if (!ev) return TD_ERR_NOMEM;
    cudaError_t e = cudaEventCreate(&ev->ev);
    if (e != cudaSuccess) {
        cudaGetLastError();
        td_free(ev);
        return td_error_set(TD_ERR_BACKEND, "cudaEventCreate: %s", cudaGetErrorString(e));
    }
    *out = ev;
    return TD_OK;
}

static void cuda_event_free(td_backend *b, td_event *ev)
{
    cudaEventDestroy(ev->ev);
    td_free(ev);
}

static td_status cuda_event_record(td_backend *b, td_event *ev, td_queue q)
{
    CU(cudaEventRecord(ev->ev, cb(b)->stream[q]), "cudaEventRecord");
    return TD_OK;
}

static td_status cuda_queue_wait_event(td_backend *b, td_queue q, td_event *ev)
{
    CU(cudaStreamWaitEvent(cb(b)->stream[q], ev->ev, 0), "cudaStreamWaitEvent");
    return TD_OK;
}

static td_status cuda_event_query(td_backend *b, td_event *ev, int *done)
{
    cudaError_t e = cudaEventQuery(ev->ev);
    if (e == cudaErrorNotReady) {
        cudaGetLastError();
        *done = 0;
        return TD_OK;
    }
    CU(e, "cudaEventQuery");
    *done = 1;
    return TD_OK;
}

static td_status cuda_event_sync(td_backend *b, td_event *ev)
{
    CU(cudaEventSynchronize(ev->ev), "cudaEventSynchronize");
    return TD_OK;
}

static td_status cuda_event_elapsed_ms(td_backend *b, td_event *start, td_event *end, float *ms)
{
    CU(cudaEventElapsedTime(ms, start->ev, end->ev), "cudaEventElapsedTime");
    return TD_OK;
}

static td_status cuda_queue_sync(td_backend *b, td_queue q)
{
    CU(cudaStreamSynchronize(cb(b)->stream[q]), "cudaStreamSynchronize");
    return TD_OK;
}

static void *cuda_native_queue(td_backend *b, td_queue q) { return cb(b)->stream[q]; }

static td_status cuda_pci_bus_id(td_backend *b, char *buf, size_t buf_bytes)
{
    CU(cudaDeviceGetPCIBusId(buf, (int)buf_bytes, cb(b)->device), "cudaDeviceGetPCIBusId");
    return TD_OK;
}

static const td_backend_ops cuda_ops = {
    .destroy = cuda_destroy,
    .mem_info = cuda_mem_info,
    .dev_reserve = cuda_dev_reserve,
    .dev_release = cuda_dev_release,
    .host_register = cuda_host_register,
    .host_unregister = cuda_host_unregister,
    .copy_async = cuda_copy_async,
    .memset_async = cuda_memset_async,
    .event_create = cuda_event_create,
    .event_free = cuda_event_free,
    .event_record = cuda_event_record,
    .queue_wait_event = cuda_queue_wait_event,
    .event_query = cuda_event_query,
    .event_sync = cuda_event_sync,
    .event_elapsed_ms = cuda_event_elapsed_ms,
    .queue_sync = cuda_queue_sync,
    .native_queue = cuda_native_queue,
    .pci_bus_id = cuda_pci_bus_id,
};

td_status td_backend_cuda_create(const td_backend_params *params, td_backend **out)
{
    td_status st = TD_OK;
    cuda_backend *c = NULL;
    int count = 0;
    *out = NULL;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
        cudaGetLastError();
        return td_error_set(TD_ERR_UNSUPPORTED, "no CUDA device (%s)",
                            e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    }
    if (params->cuda_device < 0 || params->cuda_device >= count)
        return td_error_set(TD_ERR_INVALID, "CUDA device %d does not exist (%d found)", params->cuda_device, count);
    c = td_calloc(1, sizeof *c, TD_ROLE_META);
    if (!c) return TD_ERR_NOMEM;
    c->base.ops = &cuda_ops;
    c->base.kind = TD_BACKEND_CUDA;
    c->device = params->cuda_device;
    snprintf(c->base.name, sizeof c->base.name, "cuda");
    e = cudaSetDevice(c->device);
    if (e != cudaSuccess) TD_FAIL(TD_ERR_BACKEND, "cudaSetDevice(%d): %s", c->device, cudaGetErrorString(e));
    int lo = 0, hi = 0;
    cudaDeviceGetStreamPriorityRange(&lo, &hi); /* hi is the numerically smaller, higher priority */
    for (int q = 0; q < TD_QUEUE_COUNT; q++) {
        e = cudaStreamCreateWithPriority(&c->stream[q], cudaStreamNonBlocking, q == TD_QUEUE_COMPUTE ? lo : hi);
        if (e != cudaSuccess) TD_FAIL(TD_ERR_BACKEND, "cudaStreamCreate: %s", cudaGetErrorString(e));
    }
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, c->device) == cudaSuccess) {
        char t[32];
        snprintf(c->base.description, sizeof c->base.description, "cuda:%d %.100s (%s, sm_%d%d)", c->device,
                 prop.name, td_format_bytes(prop.totalGlobalMem, t, sizeof t), prop.major, prop.minor);
    } else {
        cudaGetLastError();
        snprintf(c->base.description, sizeof c->base.description, "cuda:%d", c->device);
    }
    *out = &c->base;
    return TD_OK;
cleanup:
    cudaGetLastError();
    if (c) cuda_destroy(&c->base);
    return st;
}
