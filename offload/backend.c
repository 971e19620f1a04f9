/* Backend dispatch: argument checks, fault injection and AUTO selection in
 * one place, so both implementations behave the same at the interface. */
#include "backend_impl.h"
#include "tidal/alloc.h"
#include "tidal/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static long env_long(const char *name, long fallback)
{
    const char *v = getenv(name);
    if (!v || !*v) return fallback;
    char *end;
    long x = strtol(v, &end, 10);
    return *end ? fallback : x;
}

td_backend_params td_backend_default_params(void)
{
    td_backend_params p = {0};
    p.kind = TD_BACKEND_AUTO;
    p.cuda_device = 0;
    p.cpu_device_bytes = 4 * TD_GiB;
    const char *cap = getenv("TD_CPU_DEVICE_BYTES");
    size_t bytes;
    if (cap && td_parse_bytes(cap, &bytes) == TD_OK && bytes > 0) p.cpu_device_bytes = bytes;
    p.cpu_debug = (int)env_long("TD_CPU_DEBUG", 0);
    p.cpu_debug_delay_us = env_long("TD_CPU_DEBUG_DELAY_US", 2000);
    return p;
}

td_status td_backend_kind_parse(const char *name, td_backend_kind *out)
{
    if (!name) return td_error_set(TD_ERR_INVALID, "backend name is missing");
    if (!strcmp(name, "auto")) *out = TD_BACKEND_AUTO;
    else if (!strcmp(name, "cpu")) *out = TD_BACKEND_CPU;
    else if (!strcmp(name, "cuda")) *out = TD_BACKEND_CUDA;
    else return td_error_set(TD_ERR_INVALID, "unknown backend '%s'; use auto, cpu or cuda", name);
    return TD_OK;
}

int td_backend_cuda_compiled(void)
{
#ifdef TD_HAVE_CUDA
    return 1;
#else
    return 0;
#endif
}

td_status td_backend_create(const td_backend_params *params, td_backend **out)
{
    td_backend_params p = params ? *params : td_backend_default_params();
    *out = NULL;
    switch (p.kind) {
    case TD_BACKEND_CPU:
        return td_backend_cpu_create(&p, out);
    case TD_BACKEND_CUDA:
#ifdef TD_HAVE_CUDA
        return td_backend_cuda_create(&p, out);
#else
        return td_error_set(TD_ERR_UNSUPPORTED, "this tidal was built without CUDA (CUDA=0 or no nvcc); "
                            "rebuild with nvcc on PATH or use --backend cpu");
#endif
    case TD_BACKEND_AUTO:
    default: {
        char why[512] = "built without CUDA";
#ifdef TD_HAVE_CUDA
        if (td_backend_cuda_create(&p, out) == TD_OK) return TD_OK;
        snprintf(why, sizeof why, "%s", td_error_msg());
#endif
        td_status st = td_backend_cpu_create(&p, out);
        if (st == TD_OK) {
            char desc[sizeof (*out)->description];
            snprintf(desc, sizeof desc, "%.200s; no GPU: %.100s", (*out)->description, why);
            memcpy((*out)->description, desc, sizeof desc);
            td_error_clear();
        }
        return st;
    }
    }
}

void td_backend_free(td_backend *b)
{
    if (b) b->ops->destroy(b);
}

td_backend_kind td_backend_get_kind(const td_backend *b) { return b->kind; }
const char *td_backend_name(const td_backend *b) { return b->name; }
const char *td_backend_describe(const td_backend *b) { return b->description; }

td_status td_backend_mem_info(td_backend *b, size_t *free_bytes, size_t *total_bytes)
{
    return b->ops->mem_info(b, free_bytes, total_bytes);
}

size_t td_backend_host_mapped_bytes(td_backend *b)
{
    return b->ops->host_mapped_bytes ? b->ops->host_mapped_bytes(b) : 0;
}

td_status td_backend_dev_reserve(td_backend *b, size_t bytes, void **ptr)
{
    *ptr = NULL;
    if (bytes == 0) return td_error_set(TD_ERR_INVALID, "device reservation of 0 bytes");
    if (td_fault_hit(TD_FAULT_DEV_RESERVE)) {
        char s[32];
        return td_error_set(TD_ERR_FAULT, "injected failure reserving %s of device memory on %s",
                            td_format_bytes(bytes, s, sizeof s), b->name);
    }
    return b->ops->dev_reserve(b, bytes, ptr);
}

void td_backend_dev_release(td_backend *b, void *ptr)
{
    if (ptr) b->ops->dev_release(b, ptr);
}

td_status td_backend_host_register(td_backend *b, void *ptr, size_t bytes)
{
    return b->ops->host_register(b, ptr, bytes);
}

void td_backend_host_unregister(td_backend *b, void *ptr)
{
    if (ptr) b->ops->host_unregister(b, ptr);
}

static td_status check_queue(td_queue q)
{
    if ((unsigned)q >= TD_QUEUE_COUNT) return td_error_set(TD_ERR_INVALID, "no queue %d", (int)q);
    return TD_OK;
}

td_status td_backend_copy_async(td_backend *b, td_queue q, void *dst, const void *src, size_t bytes)
{
    if (check_queue(q)) return TD_ERR_INVALID;
    if (bytes == 0) return TD_OK;
    if (!dst || !src) return td_error_set(TD_ERR_INVALID, "copy of %zu bytes with a NULL pointer", bytes);
    return b->ops->copy_async(b, q, dst, src, bytes);
}

td_status td_backend_memset_async(td_backend *b, td_queue q, void *dst, int value, size_t bytes)
{
    if (check_queue(q)) return TD_ERR_INVALID;
    if (bytes == 0) return TD_OK;
    if (!dst) return td_error_set(TD_ERR_INVALID, "memset of %zu bytes with a NULL pointer", bytes);
    return b->ops->memset_async(b, q, dst, value, bytes);
}

td_status td_event_create(td_backend *b, td_event **out) { return b->ops->event_create(b, out); }
void td_event_free(td_backend *b, td_event *ev) { if (ev) b->ops->event_free(b, ev); }

td_status td_event_record(td_backend *b, td_event *ev, td_queue q)
{
    if (check_queue(q)) return TD_ERR_INVALID;
    return b->ops->event_record(b, ev, q);
}

td_status td_queue_wait_event(td_backend *b, td_queue q, td_event *ev)
{
    if (check_queue(q)) return TD_ERR_INVALID;
    return b->ops->queue_wait_event(b, q, ev);
}

td_status td_event_query(td_backend *b, td_event *ev, int *done) { return b->ops->event_query(b, ev, done); }
td_status td_event_sync(td_backend *b, td_event *ev) { return b->ops->event_sync(b, ev); }

td_status td_event_elapsed_ms(td_backend *b, td_event *start, td_event *end, float *ms)
{
    return b->ops->event_elapsed_ms(b, start, end, ms);
}

td_status td_queue_sync(td_backend *b, td_queue q)
{
    if (check_queue(q)) return TD_ERR_INVALID;
    return b->ops->queue_sync(b, q);
}

td_status td_backend_sync(td_backend *b)
{
    for (int q = 0; q < TD_QUEUE_COUNT; q++) {
        td_status st = b->ops->queue_sync(b, (td_queue)q);
        if (st) return st;
    }
    return TD_OK;
}

void *td_backend_native_queue(td_backend *b, td_queue q)
{
    return check_queue(q) ? NULL : b->ops->native_queue(b, q);
}

td_status td_backend_pci_bus_id(td_backend *b, char *buf, size_t buf_bytes)
{
    return b->ops->pci_bus_id(b, buf, buf_bytes);
}
