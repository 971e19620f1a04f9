/* Private: the backend vtable.  Each implementation fills one td_backend_ops
 * and embeds td_backend as the first member of its own struct. */
#ifndef TIDAL_BACKEND_IMPL_H
#define TIDAL_BACKEND_IMPL_H

#include "tidal/backend.h"

typedef struct td_backend_ops {
    void (*destroy)(td_backend *b);
    td_status (*mem_info)(td_backend *b, size_t *free_bytes, size_t *total_bytes);
    td_status (*dev_reserve)(td_backend *b, size_t bytes, void **ptr);
    void (*dev_release)(td_backend *b, void *ptr);
    td_status (*host_register)(td_backend *b, void *ptr, size_t bytes);
    void (*host_unregister)(td_backend *b, void *ptr);
    td_status (*copy_async)(td_backend *b, td_queue q, void *dst, const void *src, size_t bytes);
    td_status (*memset_async)(td_backend *b, td_queue q, void *dst, int value, size_t bytes);
    td_status (*event_create)(td_backend *b, td_event **out);
    void (*event_free)(td_backend *b, td_event *ev);
    td_status (*event_record)(td_backend *b, td_event *ev, td_queue q);
    td_status (*queue_wait_event)(td_backend *b, td_queue q, td_event *ev);
    td_status (*event_query)(td_backend *b, td_event *ev, int *done);
    td_status (*event_sync)(td_backend *b, td_event *ev);
    td_status (*event_elapsed_ms)(td_backend *b, td_event *start, td_event *end, float *ms);
    td_status (*queue_sync)(td_backend *b, td_queue q);
    void *(*native_queue)(td_backend *b, td_queue q);
    td_status (*pci_bus_id)(td_backend *b, char *buf, size_t buf_bytes);
    size_t (*host_mapped_bytes)(td_backend *b); /* optional: NULL maps nothing */
} td_backend_ops;

struct td_backend {
    const td_backend_ops *ops;
    td_backend_kind kind;
    char name[16];
    char description[320];
};

td_status td_backend_cpu_create(const td_backend_params *params, td_backend **out);
#ifdef TD_HAVE_CUDA
td_status td_backend_cuda_create(const td_backend_params *params, td_backend **out);
#endif

#endif
