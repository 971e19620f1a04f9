/* The backend interface: device memory, queues, async copies, events.
 *
 * Two implementations sit behind one small vtable (ggml style):
 *   cuda  separate compute, H2D and D2H streams; CUDA events; cudaMalloc'd
 *         device memory; cudaHostRegister for pinning.
 *   cpu   the "device" is a capacity-limited host region; H2D and D2H copies
 *         run asynchronously on one worker thread per queue; compute is the
 *         calling thread.  A debug mode delays each copy and poisons its
 *         destination (0xFF bytes: NaN in every float format) from the moment
 *         the copy starts until it completes, so code that reads a copy's
 *         destination without waiting on its event reads garbage and fails.
 * The cpu backend is the default where no GPU is found.
 *
 * Queue semantics follow CUDA streams: operations on one queue run in order;
 * td_queue_wait_event orders one queue after an event recorded on another.
 * An event that was never recorded counts as complete.
 *
 * Ownership: the backend owns its queues and worker threads; events are
 * created and freed by the caller.  Device memory taken with dev_reserve is
 * normally taken once, by the arena (arena.h), which is the only way the rest
 * of tidal obtains device bytes.
 * Thread-safety: calls on different queues may come from different threads;
 * one queue must not be driven by two threads at once. */
#ifndef TIDAL_BACKEND_H
#define TIDAL_BACKEND_H

#include <stddef.h>

#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_backend td_backend;
typedef struct td_event td_event;

typedef enum td_queue {
    TD_QUEUE_COMPUTE,  /* kernels; on the cpu backend the calling thread */
    TD_QUEUE_H2D,      /* host to device copies */
    TD_QUEUE_D2H,      /* device to host copies */
    TD_QUEUE_COUNT
} td_queue;

typedef enum td_backend_kind {
    TD_BACKEND_AUTO,   /* cuda if a device is usable, else cpu */
    TD_BACKEND_CPU,
    TD_BACKEND_CUDA,
} td_backend_kind;

typedef struct td_backend_params {
    td_backend_kind kind;
    int cuda_device;           /* device ordinal (cuda) */
    size_t cpu_device_bytes;   /* capacity of the cpu backend's device region */
    int cpu_debug;             /* delay copies and poison their destinations */
    long cpu_debug_delay_us;   /* delay per copy in debug mode */
} td_backend_params;

/* Defaults: AUTO, device 0, cpu device of 4 GiB (env TD_CPU_DEVICE_BYTES),
 * debug off (env TD_CPU_DEBUG=1 turns it on), 2000 us delay
 * (env TD_CPU_DEBUG_DELAY_US). */
td_backend_params td_backend_default_params(void);
/* "auto", "cpu" or "cuda"; TD_ERR_INVALID otherwise. */
td_status td_backend_kind_parse(const char *name, td_backend_kind *out);
/* Whether this build contains the CUDA backend. */
int td_backend_cuda_compiled(void);

td_status td_backend_create(const td_backend_params *params, td_backend **out);
void td_backend_free(td_backend *b);

td_backend_kind td_backend_get_kind(const td_backend *b);
/* "cpu" or "cuda"; td_backend_describe gives the device name and why AUTO
 * chose it, e.g. "cuda:0 NVIDIA H200 (139.8 GiB)". */
const char *td_backend_name(const td_backend *b);
const char *td_backend_describe(const td_backend *b);

/* Free and total device memory as the device reports it now. */
td_status td_backend_mem_info(td_backend *b, size_t *free_bytes, size_t *total_bytes);

/* Device memory.  Fails with TD_ERR_DEVICE_MEM naming the size (fault kind
 * TD_FAULT_DEV_RESERVE). */
td_status td_backend_dev_reserve(td_backend *b, size_t bytes, void **ptr);
void td_backend_dev_release(td_backend *b, void *ptr);

/* Host memory the backend maps to back its device memory: on cpu the
 * "device" reservations, each a header page and its size in whole pages;
 * 0 on cuda. */
size_t td_backend_host_mapped_bytes(td_backend *b);

/* Page-lock host memory for async copies (no-op on cpu); `ptr` must stay
 * valid until unregistered. */
td_status td_backend_host_register(td_backend *b, void *ptr, size_t bytes);
void td_backend_host_unregister(td_backend *b, void *ptr);

/* Async copy on queue q; any direction (host<->device, device<->device). */
td_status td_backend_copy_async(td_backend *b, td_queue q, void *dst, const void *src, size_t bytes);
td_status td_backend_memset_async(td_backend *b, td_queue q, void *dst, int value, size_t bytes);

td_status td_event_create(td_backend *b, td_event **out);
void td_event_free(td_backend *b, td_event *ev);
/* Marks the point on queue q after everything submitted so far. */
td_status td_event_record(td_backend *b, td_event *ev, td_queue q);
/* Queue q waits (without blocking the host) until ev completes. */
td_status td_queue_wait_event(td_backend *b, td_queue q, td_event *ev);
/* *done = 1 if everything before the event's last record has completed. */
td_status td_event_query(td_backend *b, td_event *ev, int *done);
td_status td_event_sync(td_backend *b, td_event *ev);   /* host waits */
/* Milliseconds between two completed events. */
td_status td_event_elapsed_ms(td_backend *b, td_event *start, td_event *end, float *ms);

td_status td_queue_sync(td_backend *b, td_queue q);
td_status td_backend_sync(td_backend *b);

/* The native handle of a queue (cudaStream_t on cuda, NULL on cpu), for
 * kernel launchers that take the stream last. */
void *td_backend_native_queue(td_backend *b, td_queue q);
/* PCI bus id of the device ("0000:3b:00.0"), for NUMA placement;
 * TD_ERR_UNSUPPORTED on cpu. */
td_status td_backend_pci_bus_id(td_backend *b, char *buf, size_t buf_bytes);

#ifdef __cplusplus
}
#endif
#endif
