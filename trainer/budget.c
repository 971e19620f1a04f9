/* The device budget: the one place where --gpu-budget's default, "max" and
 * the margin left outside the arena are decided, for every command that
 * takes a budget (train, plan, tune, eval, generate) and for library users.
 *
 * Why a margin: the arena reserves its budget once, but the CUDA context,
 * cuBLAS and NCCL keep taking device memory of their own afterwards (the
 * context grows with the first kernels, NCCL with its first collectives).
 * A budget of all the free memory would leave them nothing. */
#include "tidal/arena.h"
#include "tidal/trainer.h"
#include "tidal/util.h"

/* max(512 MiB, 2% of total) on cuda; none on the cpu backend, whose
 * "device" region is host memory that nothing else takes from. */
static size_t budget_margin(td_backend_kind kind, size_t total_bytes)
{
    if (kind != TD_BACKEND_CUDA) return 0;
    size_t m = total_bytes / 50;
    return m < 512 * TD_MiB ? 512 * TD_MiB : m;
}

const char *td_budget_origin_name(td_budget_origin o)
{
    switch (o) {
    case TD_BUDGET_GIVEN: return "given";
    case TD_BUDGET_DEFAULT: return "default";
    case TD_BUDGET_CAP: return "max";
    }
    return "?";
}

td_status td_train_budget_resolve(const td_train_config *cfg, td_backend *b, td_budget_use use, td_train_budget *out)
{
    td_status st = TD_OK;
    char f[32], m[32];
    if (!cfg || !out) return td_error_set(TD_ERR_INVALID, "td_train_budget_resolve: NULL config or result");
    if (use != TD_BUDGET_USE_RUN && use != TD_BUDGET_USE_SEARCH)
        return td_error_set(TD_ERR_INVALID, "td_train_budget_resolve: bad use %d", (int)use);
    *out = (td_train_budget){0};
    size_t asked = cfg->gpu_budget;
    if (asked != TD_GPU_BUDGET_DEFAULT && asked != TD_GPU_BUDGET_MAX) { /* given: taken as it is */
        if (asked < TD_ARENA_ALIGN)
            return td_error_set(TD_ERR_INVALID, "--gpu-budget %zu bytes is below the arena's least of %d bytes; give a "
                                "size such as 512MiB, or leave it out for the default", asked, TD_ARENA_ALIGN);
        out->budget_bytes = asked;
        out->origin = TD_BUDGET_GIVEN;
        if (b && (st = td_backend_mem_info(b, &out->free_bytes, &out->total_bytes))) return st;
        if (b) out->margin_bytes = budget_margin(td_backend_get_kind(b), out->total_bytes);
        return TD_OK;
    }
    if (!b)
        return td_error_set(TD_ERR_UNSUPPORTED, "no device here to size the budget from; give --gpu-budget SIZE to "
                            "plan a run for a device this machine lacks");
    if ((st = td_backend_mem_info(b, &out->free_bytes, &out->total_bytes))) return st;
    out->margin_bytes = budget_margin(td_backend_get_kind(b), out->total_bytes);
    if (out->free_bytes <= out->margin_bytes || out->free_bytes - out->margin_bytes < TD_ARENA_ALIGN)
        return td_error_set(TD_ERR_DEVICE_MEM, "only %s of device memory is free, %s the %s margin left for the "
                            "driver and libraries; free the device or give --gpu-budget SIZE explicitly",
                            td_format_bytes(out->free_bytes, f, sizeof f),
                            out->margin_bytes ? "not more than" : "too little beside",
                            td_format_bytes(out->margin_bytes, m, sizeof m));
    out->cap_bytes = (out->free_bytes - out->margin_bytes) / TD_ARENA_ALIGN * TD_ARENA_ALIGN;
    /* The communicator's buffers, once measured (the trainer's), are gone
     * from the free memory already, and they are the budget's too. */
    out->cap_bytes += td_train_comm_device_bytes(cfg) && cfg->comm_device_bytes ? cfg->comm_device_bytes : 0;
    if (asked == TD_GPU_BUDGET_MAX || use == TD_BUDGET_USE_SEARCH) {
        out->budget_bytes = out->cap_bytes;
        out->origin = TD_BUDGET_CAP;
        return TD_OK;
    }
    td_train_config c = *cfg;
    c.backend = td_backend_get_kind(b); /* size the activations for the backend that runs */
    if ((st = td_train_default_budget(&c, out->cap_bytes, &out->budget_bytes))) return st;
    out->origin = TD_BUDGET_DEFAULT;
    return TD_OK;
}
