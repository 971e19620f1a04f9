/* `tidal plan`: a run's footprint and whether it fits, before it starts;
 * with --largest, the largest model that fits (td_train_largest_model). */
#include "cli.h"
#include "train_opts.h"
#include "tidal/data.h"
#include "tidal/parallel.h"
#include "tidal/trainer.h"
#include "tidal/util.h"

#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static const char usage[] =
    "usage: tidal plan [--model PRESET | --layers L --width C --heads H] [--gpu-budget SIZE] [options]\n\n"
    "Prints a run's footprint before it starts: bytes per role on the device and the host, the\n"
    "chunk layout (--layout), whether it fits the budget and the host's RAM, and the step time\n"
    "estimated from bandwidths and compute rates measured here in a second or two.  Nothing of\n"
    "the model is allocated.  Takes the model, run and optimizer options of `tidal train` (--data\n"
    "only for its vocabulary; the optimizer's schedule changes nothing here).\n"
    "Exit status: 0 when the run fits, 3 when it does not, 2 for a usage error, 1 for a failure.";

#define CHECK(expr)                  \
    do {                             \
        td_status check_ = (expr);   \
        if (check_) return check_;   \
    } while (0)

/* Everything one plan is made of, and its verdict. */
typedef struct plan_run {
    td_train_config cfg;
    const char *policy;
    td_backend *b;
    int no_device;                 /* --backend cuda on a machine without one: planned, nothing measured */
    int measured;                  /* the rates were measured (not --no-measure, a device here) */
    td_budget_origin origin;       /* given, the default or max */
    size_t budget, free_b, ram, pin_limit, device_peak;
    char ram_src[256];
    td_train_plan p;
    td_train_rates r;
    td_train_bound bd;
    td_train_bound hide;           /* the bound at hide_accum (the disk tier) */
    int hide_accum;                /* the --grad-accum from which the disk costs at most TD_CLI_DISK_HIDE_WITHIN */
    int fits_device, fits_host;
} plan_run;

/* One rank's share: --nproc, or the job this process is a rank of. */
static td_status plan_ranks(td_train_config *cfg, td_opt *table, int nproc)
{
    td_dist_env env;
    if (nproc < 1 || nproc > 65536) return td_error_set(TD_ERR_INVALID, "--nproc %d: give 1 to 65536 ranks", nproc);
    if (!td_cli_seen(table, "nproc") && td_dist_env_read(&env) == TD_OK && env.size > 1) {
        cfg->ranks = env.size;
        cfg->rank = env.rank;
        cfg->local_ranks = env.local_size;
    } else if (nproc > 1) {
        cfg->ranks = nproc;
        cfg->rank = 0; /* the largest shards */
        cfg->local_ranks = nproc;
    }
    td_error_clear();
    return TD_OK;
}

/* The backend, the budget (td_train_budget_resolve) and the host's
 * limits.  --backend cuda on a machine without a GPU still plans (the sizes
 * are the CUDA ops' own) with a budget given; nothing is measured then. */
static td_status plan_limits(plan_run *pr, int largest)
{
    td_train_config *cfg = &pr->cfg;
    td_backend_params bp = td_train_backend_params(cfg);
#ifdef TD_HAVE_CUDA
    if (cfg->backend == TD_BACKEND_CUDA && td_backend_create(&bp, &pr->b) != TD_OK) {
        td_error_clear();
        pr->no_device = 1;
    }
#endif
    if (!pr->no_device) {
        CHECK(pr->b ? TD_OK : td_backend_create(&bp, &pr->b));
        cfg->backend = td_backend_get_kind(pr->b); /* size activations for the backend that will run */
        /* the libraries' heap as the trainer measures it: backend and topology made */
        td_topo *topo = NULL;
        if (!cfg->library_heap_bytes && td_topo_create(pr->b, &topo) == TD_OK) cfg->library_heap_bytes = td_train_library_heap();
        td_topo_destroy(topo);
        td_error_clear();
    }
    td_train_budget tb;
    CHECK(td_train_budget_resolve(cfg, pr->b, largest ? TD_BUDGET_USE_SEARCH : TD_BUDGET_USE_RUN, &tb));
    pr->budget = tb.budget_bytes;
    pr->free_b = tb.free_bytes;
    pr->origin = tb.origin;
    CHECK(td_train_host_limits(cfg, &pr->ram, &pr->pin_limit, pr->ram_src, sizeof pr->ram_src));
    return TD_OK;
}

/* The plan, the rates measured here (unless --no-measure), the bound and
 * whether the run fits the device and the host. */
static td_status plan_make(plan_run *pr, int no_measure)
{
    const td_train_config *cfg = &pr->cfg;
    CHECK(td_train_plan_make(cfg, pr->budget, &pr->p));
    pr->measured = !pr->no_device && !no_measure;
    if (pr->measured) CHECK(td_train_measure_rates(pr->b, cfg, &pr->r));
    td_train_bound_of(cfg, &pr->p, &pr->r, &pr->bd);
    if (pr->p.disk_chunks && pr->bd.disk_ms > 0)
        CHECK(td_train_disk_hiding_accum(cfg, pr->budget, &pr->r, TD_CLI_DISK_HIDE_WITHIN, &pr->hide_accum, &pr->hide));
    const td_train_plan *p = &pr->p;
    size_t need = cfg->mm.placement == TD_PLACEMENT_CUDA ? p->full_device_bytes : p->min_device_bytes;
    pr->fits_device = pr->budget >= need && (pr->no_device || pr->budget <= pr->free_b);
    pr->fits_host = p->host_pinned_bytes <= pr->pin_limit && p->host_bytes <= pr->ram && p->disk_fits;
    pr->device_peak = cfg->mm.placement == TD_PLACEMENT_CUDA ? p->full_device_bytes
                      : cfg->mm.placement == TD_PLACEMENT_CPU ? p->min_device_bytes
                      : p->full_device_bytes < pr->budget ? p->full_device_bytes : pr->budget;
    return TD_OK;
}

/* ---- JSON ----------------------------------------------------------------------- */

#define NUM(o, k, v) cJSON_AddNumberToObject((o), (k), (double)(v))

static void json_device(cJSON *j, const plan_run *pr)
{
    const td_train_plan *p = &pr->p;
    cJSON *d = cJSON_AddObjectToObject(j, "device");
    NUM(d, "budget_bytes", pr->budget);
    if (pr->no_device) cJSON_AddNullToObject(d, "free_bytes");
    else NUM(d, "free_bytes", pr->free_b);
    NUM(d, "activation_bytes", p->activation_bytes);
    NUM(d, "workspace_bytes", p->workspace_bytes);
    NUM(d, "staging_bytes", p->staging_bytes);
    NUM(d, "working_set_bytes", p->working_set_bytes);
    NUM(d, "min_bytes", p->min_device_bytes);
    NUM(d, "all_resident_bytes", p->full_device_bytes);
    NUM(d, "comm_bytes", p->comm_device_bytes);
    NUM(d, "peak_bytes", pr->device_peak);
    cJSON_AddBoolToObject(d, "fits", pr->fits_device);
}

static void json_host(cJSON *j, const plan_run *pr)
{
    const td_train_plan *p = &pr->p;
    const size_t *role = p->host_role_bytes;
    cJSON *h = cJSON_AddObjectToObject(j, "host");
    NUM(h, "param_bytes", role[TD_TENSOR_PARAM]);
    NUM(h, "frozen_bytes", role[TD_TENSOR_OTHER]);
    NUM(h, "grad_bytes", role[TD_TENSOR_GRAD]);
    NUM(h, "grad_slots", p->host_grad_slots);
    NUM(h, "optimizer_bytes", role[TD_TENSOR_ADAM_M] + role[TD_TENSOR_ADAM_V] + role[TD_TENSOR_MASTER]);
    NUM(h, "pinned_bytes", p->host_pinned_bytes);
    NUM(h, "pinned_chunk_bytes", p->host_pinned_chunk_bytes);
    NUM(h, "pinned_optimizer_bytes", p->host_pinned_optimizer_bytes);
    NUM(h, "staging_bytes", p->host_staging_bytes);
    NUM(h, "slab_bytes", p->host_slab_bytes);
    NUM(h, "slabs", p->host_slabs);
    NUM(h, "pageable_bytes", p->host_pageable_bytes);
    NUM(h, "pageable_optimizer_bytes", p->host_pageable_state_bytes);
    NUM(h, "heap_bytes", p->host_heap_bytes);
    NUM(h, "library_heap_bytes", p->host_library_heap_bytes);
    NUM(h, "library_heap_measured_bytes", pr->cfg.library_heap_bytes);
    NUM(h, "device_region_bytes", p->host_device_region_bytes);
    NUM(h, "total_bytes", p->host_bytes);
    NUM(h, "bytes_per_param", (double)(p->host_pinned_chunk_bytes + p->host_pageable_state_bytes) / (double)p->params);
    NUM(h, "pinned_bytes_per_param", (double)p->host_pinned_chunk_bytes / (double)p->params);
    cJSON_AddStringToObject(h, "optim_state", td_optim_state_name(pr->cfg.optim.state));
    cJSON_AddStringToObject(h, "heap_measured_by", td_host_heap_source());
    NUM(h, "ram_bytes", pr->ram);
    cJSON_AddStringToObject(h, "ram_source", pr->ram_src);
    NUM(h, "pin_limit_bytes", pr->pin_limit);
    cJSON_AddBoolToObject(h, "fits", pr->fits_host);
    NUM(h, "shard_ranks", p->shard_ranks);
    NUM(h, "local_ranks", p->local_ranks);
    NUM(h, "node_bytes", p->node_bytes);
    NUM(h, "node_state_bytes", p->node_state_bytes);
    NUM(h, "node_bytes_per_param", (double)p->node_state_bytes / (double)p->params);
}

/* The rates and the step's estimate: null when nothing was measured. */
static void json_estimate(cJSON *j, const plan_run *pr)
{
    if (!pr->measured) {
        cJSON_AddNullToObject(j, "measured");
        cJSON_AddNullToObject(j, "estimate");
        return;
    }
    const td_train_rates *r = &pr->r;
    const td_train_bound *bd = &pr->bd;
    cJSON *m = cJSON_AddObjectToObject(j, "measured");
    NUM(m, "copy_gbytes_per_s", r->copy_gbs);
    NUM(m, "dram_gbytes_per_s", r->dram_gbs);
    NUM(m, "adam_gparams_per_s", bd->adam_gparams_per_s);
    NUM(m, "dram_fastest_gbytes_per_s", r->dram_fastest_gbs);
    NUM(m, "adam_probe_params", r->adam_probe_params);
    NUM(m, "dram_loaded_gbytes_per_s", r->dram_loaded_gbs);
    NUM(m, "dram_loaded_adam_gbytes_per_s", r->dram_loaded_adam_gbs);
    NUM(m, "dram_loaded_copy_gbytes_per_s", r->dram_loaded_copy_gbs);
    NUM(m, "compute_gflops", r->gflops);
    NUM(m, "block_forward_ms", r->block_fwd_ms);
    NUM(m, "block_backward_ms", r->block_bwd_ms);
    NUM(m, "block_recompute_ms", r->block_recompute_ms);
    NUM(m, "link_gbytes_per_s", r->link_gbs);
    cJSON_AddStringToObject(m, "link_measured_by", r->link_what ? r->link_what : "");
    cJSON *e = cJSON_AddObjectToObject(j, "estimate");
    NUM(e, "h2d_bytes", pr->p.h2d_bytes_per_step);
    NUM(e, "d2h_bytes", pr->p.d2h_bytes_per_step);
    NUM(e, "gather_bytes", pr->p.gather_bytes_per_step);
    NUM(e, "reduce_scatter_bytes", pr->p.reduce_bytes_per_step);
    NUM(e, "compute_ms", bd->compute_ms);
    NUM(e, "pcie_ms", bd->pcie_ms);
    NUM(e, "link_ms", bd->link_ms);
    NUM(e, "adam_ms", bd->adam_ms);
    NUM(e, "exposed_adam_ms", bd->exposed_adam_ms);
    NUM(e, "dram_ms", bd->dram_ms);
    NUM(e, "step_lower_bound_ms", bd->bound_ms);
    if (bd->bound_ms > 0) NUM(e, "tokens_per_s_upper_bound", bd->tokens_per_s);
    else cJSON_AddNullToObject(e, "tokens_per_s_upper_bound");
}

static td_status print_json(const plan_run *pr)
{
    const td_train_plan *p = &pr->p;
    cJSON *j = cJSON_CreateObject();
    if (!j) return td_error_set(TD_ERR_NOMEM, "plan: out of memory for the JSON");
    NUM(j, "ranks", pr->cfg.ranks > 1 ? pr->cfg.ranks : 1);
    NUM(j, "rank", pr->cfg.rank);
    NUM(j, "params", p->params);
    NUM(j, "frozen_params", p->frozen_params);
    NUM(j, "chunks", p->chunks);
    NUM(j, "chunk_numel", p->chunk_numel);
    NUM(j, "padding_bytes", p->padding_bytes);
    NUM(j, "chunk_numel_least_padding", p->chunk_numel_least_padding);
    json_device(j, pr);
    json_host(j, pr);
    cJSON_AddBoolToObject(j, "checkpointing", p->ckpt);
    NUM(j, "ckpt_blocks", p->ckpt_blocks);
    NUM(j, "loss_chunk_rows", td_train_loss_rows(&pr->cfg));
    cJSON_AddBoolToObject(j, "gpu_optimizer", p->gpu_optimizer);
    cJSON *o = cJSON_AddObjectToObject(j, "optimizer");
    NUM(o, "chunks", p->optim_chunks);
    NUM(o, "gpu_chunks", p->optim_gpu_chunks);
    NUM(o, "gpu_state_bytes", p->optim_gpu_state_bytes);
    NUM(o, "cpu_params", p->adam_cpu_params);
    NUM(o, "cpu_bytes_per_param", p->adam_bytes_per_param);
    json_estimate(j, pr);
    cJSON_AddItemToObject(j, "disk", td_cli_plan_disk_json(&pr->cfg, p, &pr->r, &pr->bd, pr->hide_accum,
                                                          pr->hide_accum ? &pr->hide : NULL));
    return td_cli_print_json(j);
}

/* ---- text ----------------------------------------------------------------------- */

static int on_cuda(const plan_run *pr) { return pr->cfg.backend == TD_BACKEND_CUDA; }

static void text_model(const plan_run *pr)
{
    const td_train_config *cfg = &pr->cfg;
    const td_train_plan *p = &pr->p;
    char desc[256], a[32];
    td_model_desc_describe(&cfg->model, desc, sizeof desc);
    printf("model        %zu params: %s (padded vocab %d), seq %d\n", p->params, desc, cfg->model.padded_vocab_size,
           cfg->seq_len);
    printf("batch        %d x %d tokens, %d micro-batch%s per step; checkpointing %s", cfg->micro_batch, cfg->seq_len,
           cfg->grad_accum, cfg->grad_accum == 1 ? "" : "es", p->ckpt ? "on" : "off");
    if (p->ckpt) printf(" (%d of %d blocks recomputed)", p->ckpt_blocks, cfg->model.n_layer);
    {
        size_t N = (size_t)cfg->micro_batch * (size_t)cfg->seq_len, R = (size_t)td_train_loss_rows(cfg);
        char lg[32];
        printf("\nloss         %zu chunk%s of %zu rows: %s of logits at a time (--loss-chunk)", (N + R - 1) / R,
               (N + R - 1) / R == 1 ? "" : "s", R,
               td_format_bytes(R * (size_t)cfg->model.padded_vocab_size * td_dtype_bytes(cfg->precision), lg, sizeof lg));
    }
    printf("\nchunks       %d of %zu elements, %s padding\n", p->chunks, p->chunk_numel,
           td_format_bytes(p->padding_bytes, a, sizeof a));
    if (p->chunk_numel_least_padding)
        printf("             (smaller than the least padding's %zu elements: with chunks that large the device's\n"
               "             minimum is above the budget; --chunk-numel chooses)\n", p->chunk_numel_least_padding);
    if (cfg->ranks > 1)
        printf("ranks        %d (ZeRO-3), %d on this host, chunks split over %d; below: rank %d's bytes: its 1/%d\n"
               "             shard of every chunk on the host (16-bit params and grads, fp32 master, AdamW moments),\n"
               "             the device's chunks whole (padded to %d equal shards); global batch %d x %d x %d sequences\n",
               cfg->ranks, p->local_ranks, p->shard_ranks, cfg->rank, p->shard_ranks, p->shard_ranks, cfg->ranks,
               cfg->micro_batch, cfg->grad_accum);
}

static void text_device(const plan_run *pr)
{
    const td_train_plan *p = &pr->p;
    const td_train_config *cfg = &pr->cfg;
    char a[32], b[32], c[32];
    printf("\ndevice (%s)\n", pr->no_device ? "cuda, not present here: planned, nothing measured" : td_backend_describe(pr->b));
    printf("  activations        %12s\n", td_format_bytes(p->activation_bytes, a, sizeof a));
    printf("  workspace          %12s\n", td_format_bytes(p->workspace_bytes, a, sizeof a));
    printf("  staging            %12s\n", td_format_bytes(p->staging_bytes, a, sizeof a));
    printf("  chunks in use      %12s  (the largest set one access pins)\n",
           td_format_bytes(p->working_set_bytes, a, sizeof a));
    printf("  minimum            %12s  (%s)\n", td_format_bytes(p->min_device_bytes, a, sizeof a),
           p->min_device_bytes >= p->full_device_bytes ? "all resident: the chunks in use and two to spare are no less"
           : p->optim_gpu_chunks ? "plus two of the largest chunk: prefetch, fragmentation; the device's optimizer chunks"
                                 : "plus two of the largest chunk: prefetch, fragmentation");
    printf("  all resident       %12s  (every param and grad chunk on the device, with the device's optimizer state)\n",
           td_format_bytes(p->full_device_bytes, a, sizeof a));
    const char *origin = pr->origin == TD_BUDGET_GIVEN ? "" : pr->origin == TD_BUDGET_CAP ? " (max: free minus margin)"
                                                                                         : " (default: the run resident + 1/8)";
    printf("  budget             %12s  of %s free%s -> %s with --policy %s (peak about %s)\n",
           td_format_bytes(pr->budget, a, sizeof a),
           pr->no_device ? "unknown (no device here)" : td_format_bytes(pr->free_b, b, sizeof b), origin,
           pr->fits_device ? "FITS" : "DOES NOT FIT", pr->policy, td_format_bytes(pr->device_peak, c, sizeof c));
    if (!pr->fits_device)
        printf("  -> needs --gpu-budget of at least %s%s\n",
               td_format_bytes(cfg->mm.placement == TD_PLACEMENT_CUDA ? p->full_device_bytes : p->min_device_bytes, a,
                               sizeof a),
               !pr->no_device && pr->budget > pr->free_b ? " and that much free device memory" : "");
}

/* Why the host does not fit, and what would: the pin limit can be raised
 * only up to the RAM. */
static const char *host_verdict(const plan_run *pr)
{
    const td_train_plan *p = &pr->p;
    if (p->host_pinned_bytes > pr->pin_limit && p->host_pinned_bytes <= pr->ram)
        return " -> DOES NOT FIT (raise --host-pin-limit)";
    if (p->host_pinned_bytes > pr->pin_limit)
        return " -> DOES NOT FIT (more than the host's RAM: a smaller model or batch)";
    return "";
}

static void text_host(const plan_run *pr)
{
    const td_train_plan *p = &pr->p;
    char a[32], b[32], c[32];
    printf("\nhost (RAM %s: %s)\n", td_format_bytes(pr->ram, a, sizeof a), pr->ram_src);
    printf(on_cuda(pr) ? "  pinned (crosses PCIe)\n" : "  copy buffers (what moves to and from the cpu backend's device)\n");
    printf("    params           %12s\n", td_format_bytes(p->host_role_bytes[TD_TENSOR_PARAM], a, sizeof a));
    if (p->frozen_params)
        printf("    frozen           %12s  (%.1fM params frozen, --freeze or a LoRA base: storage alone, never written back)\n",
               td_format_bytes(p->host_role_bytes[TD_TENSOR_OTHER], a, sizeof a), (double)p->frozen_params / 1e6);
    printf("    grads            %12s", td_format_bytes(p->host_role_bytes[TD_TENSOR_GRAD], a, sizeof a));
    if (p->host_grad_slots)
        printf("  (the rest transient: %d staging slots of %s, in staging below, consumed\n%29sby the AdamW "
               "thread as they land; a copy each only for chunks larger than a slot\n%29sand the device AdamW's)",
               p->host_grad_slots, td_format_bytes(p->host_grad_slot_bytes, b, sizeof b), "", "");
    printf("\n");
    if (p->host_pinned_optimizer_bytes)
        printf("    optimizer        %12s  (homed on the device: the device AdamW's)\n",
               td_format_bytes(p->host_pinned_optimizer_bytes, a, sizeof a));
    printf("    staging          %12s\n", td_format_bytes(p->host_staging_bytes, a, sizeof a));
    printf("    total            %12s  in %d slab%s of %s; pin limit %s%s\n", td_format_bytes(p->host_pinned_bytes, a, sizeof a),
           p->host_slabs, p->host_slabs == 1 ? "" : "s", td_format_bytes(p->host_slab_bytes, b, sizeof b),
           td_format_bytes(pr->pin_limit, c, sizeof c), host_verdict(pr));
    printf("  pageable (NUMA-local to the CPU AdamW)\n    optimizer        %12s  (fp32 master, m and v as %s)\n",
           td_format_bytes(p->host_pageable_state_bytes, a, sizeof a), td_optim_state_name(pr->cfg.optim.state));
    printf("    heap             %12s  (metadata, loader, libraries%s; measured by %s)\n",
           td_format_bytes(p->host_heap_bytes, a, sizeof a),
           !on_cuda(pr) ? "" : pr->cfg.ranks > 1 ? ", the CUDA runtime, NCCL" : ", the CUDA runtime", td_host_heap_source());
    if (p->host_library_heap_measured)
        printf("%21s%12s  of it the libraries': the %s measured here once the backend and topology\n%35sexist, "
               "plus what a run adds after\n", "", td_format_bytes(p->host_library_heap_bytes, a, sizeof a),
               td_format_bytes(pr->cfg.library_heap_bytes, b, sizeof b), "");
    if (p->host_device_region_bytes)
        printf("    device region    %12s  (the cpu backend's \"device\" is host memory)\n",
               td_format_bytes(p->host_device_region_bytes, a, sizeof a));
    printf("  total              %12s  of %s RAM -> %s\n", td_format_bytes(p->host_bytes, a, sizeof a),
           td_format_bytes(pr->ram, b, sizeof b),
           pr->fits_host ? "FITS" : p->host_bytes > pr->ram ? "DOES NOT FIT (a smaller model or batch, or --optim-state "
                                                              "bf16 or int8)" : "DOES NOT FIT");
    printf("  bytes a param      %.2f on the host, %.2f of them in copy buffers (model state)\n",
           (double)(p->host_pinned_chunk_bytes + p->host_pageable_state_bytes) / (double)p->params,
           (double)p->host_pinned_chunk_bytes / (double)p->params);
    if (pr->cfg.ranks > 1)
        printf("  this host          %12s  for its %d ranks, %.2f bytes a param of model state (each byte %s)\n",
               td_format_bytes(p->node_bytes, a, sizeof a), p->local_ranks, (double)p->node_state_bytes / (double)p->params,
               p->shard_ranks <= p->local_ranks ? "once on this host" : "once in the job");
    if (td_train_disk_tier(&pr->cfg)) td_cli_plan_disk_text(stdout, &pr->cfg, p, &pr->r);
}

static void text_optimizer(const plan_run *pr)
{
    const td_train_plan *p = &pr->p;
    char a[32];
    const char *dev = on_cuda(pr) ? "GPU" : "cpu backend's device";
    printf("\noptimizer    %d of %d chunks on the %s (%s of master, m, v there; their grads stay, their params\n"
           "             are not uploaded), the CPU AdamW updates %.0f params at %.0f bytes a param\n",
           p->optim_gpu_chunks, p->optim_chunks, dev, td_format_bytes(p->optim_gpu_state_bytes, a, sizeof a),
           p->adam_cpu_params, p->adam_bytes_per_param);
}

/* The rates and the bound: only what was measured, never a bound of 0. */
static void text_estimate(const plan_run *pr, int no_measure)
{
    const td_train_rates *r = &pr->r;
    const td_train_bound *bd = &pr->bd;
    const td_train_plan *p = &pr->p;
    char a[32], b[32], c[32];
    if (!pr->measured) {
        printf("\nmeasured here: nothing (%s), so no step estimate\n",
               no_measure ? "--no-measure" : "no CUDA device on this machine; run the plan there for rates");
        return;
    }
    printf("\nmeasured here: copy %.1f GB/s, DRAM %.1f GB/s (CPU AdamW at %zuM params, the median pass: %.2f G\n"
           "               params/s; the fastest pass %.1f GB/s), matmul %.1f GFLOP/s (%s)\n"
           "               DRAM %.1f GB/s with copies up and down beside the CPU AdamW (both together: the AdamW\n"
           "               %.1f GB/s of it, the copies %.1f GB/s)\n",
           r->copy_gbs, r->dram_gbs, r->adam_probe_params >> 20, bd->adam_gparams_per_s, r->dram_fastest_gbs, r->gflops,
           on_cuda(pr) ? "bf16 MLP matmul on the device" : "cpu reference matmul", r->dram_loaded_gbs,
           r->dram_loaded_adam_gbs, r->dram_loaded_copy_gbs);
    if (r->block_fwd_ms > 0)
        printf("               one block at this batch: forward %.2f ms, backward %.2f ms, recompute %.2f ms\n",
               r->block_fwd_ms, r->block_bwd_ms, r->block_recompute_ms);
    else if (on_cuda(pr))
        printf("               one block at this batch: not measured (its buffers exceed the free device "
               "memory); compute from the matmul rate\n");
    printf("step estimate: compute %.3g ms, %s %.3g ms (%s up, %s down), CPU AdamW %.3g ms%s\n", bd->compute_ms,
           on_cuda(pr) ? "PCIe" : "copies", bd->pcie_ms, td_format_bytes((size_t)p->h2d_bytes_per_step, a, sizeof a),
           td_format_bytes((size_t)p->d2h_bytes_per_step, b, sizeof b), bd->adam_ms,
           p->gpu_optimizer ? " (none: all on the device)" : "");
    printf("               host DRAM %.3g ms (the CPU AdamW's bytes and the copies')\n", bd->dram_ms);
    if (pr->cfg.ranks > 1)
        printf("               devices' link %.3g ms (%s gathered in, %s reduce-scattered out, at %.1f GB/s:\n"
               "               %s); the communicator's device memory %s of the budget\n", bd->link_ms,
               td_format_bytes((size_t)p->gather_bytes_per_step, a, sizeof a),
               td_format_bytes((size_t)p->reduce_bytes_per_step, b, sizeof b), r->link_gbs,
               r->link_what ? r->link_what : "not measured", td_format_bytes(p->comm_device_bytes, c, sizeof c));
    td_cli_plan_disk_estimate(stdout, &pr->cfg, p, bd, pr->hide_accum, pr->hide_accum ? &pr->hide : NULL);
    if (bd->exposed_adam_ms > 0)
        printf("               CPU AdamW%s beyond one micro-batch's compute %.3g ms (it hides only there: the\n"
               "               grads are whole in the last backward, the params needed in the first forward)\n",
               bd->disk_ms > bd->adam_ms ? " (its disk reads and writes)" : "", bd->exposed_adam_ms);
    if (bd->bound_ms > 0)
        printf("               lower bound %.3g ms a step (all overlapped), at most %.3g tokens/s\n", bd->bound_ms,
               bd->tokens_per_s);
}

static td_status print_text(const plan_run *pr, int layout, int no_measure)
{
    text_model(pr);
    text_device(pr);
    text_host(pr);
    text_optimizer(pr);
    text_estimate(pr, no_measure);
    if (!layout) return TD_OK;
    printf("\n");
    return td_train_plan_print_layout(&pr->cfg, &pr->p, stdout);
}

/* ---- --largest ------------------------------------------------------------------- */

static cJSON *largest_json(const td_train_config *cfg, const td_train_largest *l)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "optim_state", td_optim_state_name(cfg->optim.state));
    NUM(o, "width", cfg->model.n_embd);
    NUM(o, "heads", cfg->model.n_head);
    NUM(o, "layers", l->layers);
    NUM(o, "params", l->plan.params);
    NUM(o, "host_bytes", l->plan.host_bytes);
    NUM(o, "pinned_bytes", l->plan.host_pinned_bytes);
    NUM(o, "disk_bytes", l->plan.disk_bytes);
    if (l->preset) cJSON_AddStringToObject(o, "preset", l->preset);
    else cJSON_AddNullToObject(o, "preset");
    NUM(o, "preset_params", l->preset_plan.params);
    NUM(o, "preset_host_bytes", l->preset_plan.host_bytes);
    cJSON *fit = cJSON_AddArrayToObject(o, "presets_that_fit");
    for (int i = 0; i < l->n_presets_fit; i++) cJSON_AddItemToArray(fit, cJSON_CreateString(l->presets_fit[i]));
    return o;
}

static void largest_text(const td_train_config *cfg, const td_train_largest *l)
{
    char a[32], b[32], c[32], fit[1024] = "";
    const char *name = td_optim_state_name(cfg->optim.state);
    if (l->layers > 0)
        printf("--optim-state %-5s  %4d layers x %d wide, %d heads: %.2fB params, host %s (%s pinned)%s%s\n", name,
               l->layers, cfg->model.n_embd, cfg->model.n_head, (double)l->plan.params / 1e9,
               td_format_bytes(l->plan.host_bytes, a, sizeof a), td_format_bytes(l->plan.host_pinned_bytes, b, sizeof b),
               l->plan.disk_bytes ? ", disk " : "", l->plan.disk_bytes ? td_format_bytes(l->plan.disk_bytes, c, sizeof c) : "");
    else
        printf("--optim-state %-5s  no layer count fits at %d wide, %d heads\n", name, cfg->model.n_embd,
               cfg->model.n_head);
    for (int i = 0; i < l->n_presets_fit; i++) {
        size_t n = strlen(fit);
        snprintf(fit + n, sizeof fit - n, "%s%s", i ? ", " : "", l->presets_fit[i]);
    }
    if (l->preset)
        printf("                     largest preset %s: %.2fB params, host %s (fit: %s)\n", l->preset,
               (double)l->preset_plan.params / 1e9, td_format_bytes(l->preset_plan.host_bytes, a, sizeof a), fit);
    else
        printf("                     no preset fits\n");
}

/* For each state type, the largest model (td_train_largest_model). */
static td_status print_largest(const plan_run *pr, int json)
{
    td_train_limits lim = { .budget_bytes = pr->budget, .device_free_bytes = pr->no_device ? SIZE_MAX : pr->free_b,
                            .ram_bytes = pr->ram, .pin_limit_bytes = pr->pin_limit };
    char a[32], b[32], c[32], d[32];
    size_t disk_room = 0;
    if (td_train_disk_tier(&pr->cfg)) { /* the disk the plans count: --disk-bytes, or the directories' free space */
        td_train_plan dp;
        td_train_config one = pr->cfg;
        one.model.n_layer = 1;
        CHECK(td_train_plan_make(&one, lim.budget_bytes, &dp));
        disk_room = dp.disk_free_bytes;
    }
    cJSON *j = json ? cJSON_CreateObject() : NULL, *list = NULL;
    if (j) {
        NUM(j, "budget_bytes", lim.budget_bytes);
        NUM(j, "ram_bytes", lim.ram_bytes);
        cJSON_AddStringToObject(j, "ram_source", pr->ram_src);
        NUM(j, "pin_limit_bytes", lim.pin_limit_bytes);
        NUM(j, "disk_bytes", disk_room);
        list = cJSON_AddArrayToObject(j, "largest");
    } else {
        printf("largest models for --gpu-budget %s, host RAM %s (%s), pin limit %s%s%s%s; %d x %d tokens, %s\n\n",
               td_format_bytes(lim.budget_bytes, a, sizeof a), td_format_bytes(lim.ram_bytes, b, sizeof b), pr->ram_src,
               td_format_bytes(lim.pin_limit_bytes, c, sizeof c), disk_room ? ", disk " : "",
               disk_room ? td_format_bytes(disk_room, d, sizeof d) : "",
               disk_room ? " for the optimizer state the RAM cannot hold" : "", pr->cfg.micro_batch, pr->cfg.seq_len,
               td_dtype_name(pr->cfg.precision));
    }
    for (int s = 0; s < TD_OPTIM_STATE_COUNT; s++) {
        td_train_config cfg = pr->cfg;
        cfg.optim.state = (td_optim_state)s;
        td_train_largest l;
        td_status st = td_train_largest_model(&cfg, &lim, &l);
        if (st) {
            cJSON_Delete(j);
            return st;
        }
        if (j) cJSON_AddItemToArray(list, largest_json(&cfg, &l));
        else largest_text(&cfg, &l);
    }
    return j ? td_cli_print_json(j) : TD_OK;
}

/* ---- the command ------------------------------------------------------------------ */

int td_cli_plan_main(int argc, char **argv)
{
    td_cli_train_opts o;
    td_cli_train_opts_defaults(&o);
    int json = 0, layout = 0, largest = 0, nproc = 1, no_measure = 0;
    size_t disk_bytes = 0;
    td_opt table[] = { TD_CLI_MODEL_OPTS(&o), TD_CLI_RUN_OPTS(&o), TD_CLI_OPTIM_OPTS(&o),
                       {"disk-bytes", TD_OPT_SIZE, &disk_bytes, "SIZE", "plan the disk tier for this much disk (a drive you "
                        "do not have here, or less\nthan --offload-dir's free space); without --offload-dir nothing "
                        "is measured", 0},
                       {"json", TD_OPT_FLAG, &json, NULL, "one JSON object instead of the table", 0},
                       {"nproc", TD_OPT_INT, &nproc, "N", "plan one rank of N (ZeRO-3, as `tidal train --nproc N`): its "
                        "share of the optimizer\nstate, the device chunks padded to N shards (under a launcher: the "
                        "job's size)", 0},
                       {"layout", TD_OPT_FLAG, &layout, NULL, "also print the chunk layout", 0},
                       {"no-measure", TD_OPT_FLAG, &no_measure, NULL, "the footprint only: time nothing on this machine "
                        "(no step estimate;\nsaves the second or two the rates take)", 0},
                       {"largest", TD_OPT_FLAG, &largest, NULL, "the largest model that fits the host and the budget, "
                        "for each --optim-state:\nthe most layers at the given width and heads, and each preset", 0},
                       {NULL, 0, NULL, NULL, NULL, 0} };
    int rc = td_args_main(table, argc, argv, "plan", usage);
    if (rc >= 0) return rc;
    plan_run pr;
    memset(&pr, 0, sizeof pr);
    pr.policy = o.policy;
    int data_vocab = 0;
    char note[512];
    td_status st = TD_OK;
    if (o.data && (st = td_cli_data_vocab(o.data, &data_vocab))) goto fail;
    if ((st = td_cli_train_config(&o, table, data_vocab, &pr.cfg, note)) || (st = plan_ranks(&pr.cfg, table, nproc))) {
        rc = td_cli_config_exit(st);
        goto report;
    }
    pr.cfg.disk_bytes = disk_bytes;
    if (*note) fprintf(stderr, "tidal plan: %s\n", note);
    if ((st = plan_limits(&pr, largest))) goto fail;
    if (largest) {
        if ((st = print_largest(&pr, json))) goto fail;
        rc = 0;
        goto out;
    }
    if ((st = plan_make(&pr, no_measure)) || (st = json ? print_json(&pr) : print_text(&pr, layout, no_measure)))
        goto fail;
    rc = pr.fits_device && pr.fits_host ? 0 : 3;
    goto out;
fail:
    rc = 1;
report:
    fprintf(stderr, "tidal plan: %s\n", td_error_msg());
out:
    if (pr.b) td_backend_free(pr.b);
    td_args_free();
    return rc;
}
