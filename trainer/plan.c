/* `tidal plan`'s footprint of a run, from the layout alone: nothing of the
 * model is allocated (see td_train_plan_make in include/tidal/trainer.h). */
#include "train_impl.h"
#include "tidal/arena.h"
#include "tidal/util.h"

#include <string.h>

/* Chunk bytes of the union of the chunks holding ids. */
static size_t chunks_bytes(td_memmgr *mm, const int *ids, int n)
{
    int seen[64], k = 0;
    size_t bytes = 0;
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0) continue; /* a frozen tensor's grad: none */
        int c = td_memmgr_tensor_chunk(mm, ids[i]), dup = 0;
        for (int j = 0; j < k && !dup; j++) dup = seen[j] == c;
        if (dup) continue;
        if (k < 64) seen[k++] = c;
        bytes += td_memmgr_chunk_slot_bytes(mm, c);
    }
    return bytes;
}

/* --grad-slots auto: a host copy per grad chunk when the host holds them,
 * else TD_TRAIN_GRAD_SLOTS slots, the host's least.  With copies a
 * write-back never waits for the CPU AdamW to free a slot; with slots the
 * thread driving the GPU waits whenever the AdamW is more than the slots
 * behind the backward (W4's step on an H200: 1240 ms with 8 slots, 1135 ms
 * with copies).  *copies holds the plan with copies when *planned: the
 * auto plan reuses it rather than planning the same twice. */
static td_status resolve_grad_slots(td_train_config *cfg, size_t budget, td_train_plan *copies, int *planned)
{
    *planned = 0;
    if (cfg->mm.grad_slots >= 0) return TD_OK;
    if (!td_train_grads_transient(cfg)) {
        cfg->mm.grad_slots = 0;
        return TD_OK;
    }
    cfg->mm.grad_slots = TD_TRAIN_GRAD_SLOTS;
    size_t ram = 0, pin_limit = 0;
    char src[256];
    if (td_train_host_limits(cfg, &ram, &pin_limit, src, sizeof src)) { /* unknown: the host's least */
        td_error_clear();
        return TD_OK;
    }
    td_train_config c = *cfg;
    c.mm.grad_slots = 0;
    td_status st = td_train_plan_make(&c, budget, copies);
    if (st) return st;
    *planned = 1;
    /* (with a disk tier, copies that send state to disk cost more than slots do) */
    if (copies->host_pinned_bytes <= pin_limit && copies->host_bytes <= ram && !copies->disk_chunks) cfg->mm.grad_slots = 0;
    return TD_OK;
}

td_status td_train_resolve_grad_slots(td_train_config *cfg, size_t budget)
{
    td_train_plan p;
    int planned;
    return resolve_grad_slots(cfg, budget, &p, &planned);
}

td_status td_train_resolve_shard(td_train_config *cfg)
{
    if (cfg->shard != TD_SHARD_AUTO) return TD_OK;
    cfg->shard = TD_SHARD_WORLD;
    if (cfg->ranks <= 1 || cfg->local_ranks <= 1 || cfg->local_ranks >= cfg->ranks) return TD_OK; /* one host, or one a host */
    td_train_config c = *cfg;
    c.shard = TD_SHARD_NODE;
    td_train_plan p;
    size_t ram = 0, pin_limit = 0;
    char src[256];
    td_status st = td_train_plan_make(&c, cfg->gpu_budget == TD_GPU_BUDGET_MAX ? 0 : cfg->gpu_budget, &p);
    if (!st) st = td_train_host_limits(&c, &ram, &pin_limit, src, sizeof src);
    if (st) return st;
    if (p.host_bytes <= ram && p.host_pinned_bytes <= pin_limit) cfg->shard = TD_SHARD_NODE;
    return TD_OK;
}

/* The chunk size is the layout's own choice (td_train_chunk_params): the
 * least padding between the largest block tensor and a whole block. */
static int chunk_auto(const td_train_config *cfg)
{
    td_memmgr_params d = td_memmgr_default_params();
    return !cfg->mm.chunk_numel && cfg->mm.min_chunk_numel == d.min_chunk_numel &&
           cfg->mm.max_chunk_numel == d.max_chunk_numel;
}

static td_status plan_layout(const td_train_config *cfg, size_t budget, td_train_plan *out);

/* An auto chunk size (chunk_auto) as the trainer takes it, its plan into
 * *out.  The least padding can mean a chunk of a whole block or two; the
 * device then holds two of the largest chunk beside the working set (one
 * to prefetch into, one for the holes), and at wide blocks that alone can
 * be gigabytes past a budget the smallest chunk, the largest block tensor,
 * fits (8192 wide, B 16: 25.3 GiB against 24 at the padding's choice).
 * Where the budget does not hold the padding's choice, the smallest is
 * planned too and taken when it needs less of the device; cfg then names
 * it (mm.chunk_numel), so the layout that follows is that plan's. */
static td_status resolve_chunks(td_train_config *cfg, size_t budget, td_train_plan *out)
{
    td_status st = plan_layout(cfg, budget, out);
    if (st || !budget || cfg->mm.placement == TD_PLACEMENT_CUDA || out->min_device_bytes <= budget) return st;
    td_memmgr_params range = td_train_chunk_params(cfg);
    td_train_config c = *cfg;
    c.mm.min_chunk_numel = range.min_chunk_numel;
    td_train_plan *q = td_malloc(sizeof *q, TD_ROLE_META);
    if (!q) return TD_ERR_NOMEM;
    size_t chunk = out->chunk_numel;
    while (chunk / 8 * 7 >= range.min_chunk_numel) {
        c.mm.max_chunk_numel = chunk / 8 * 7;
        if ((st = plan_layout(&c, budget, q))) break;
        chunk = q->chunk_numel;
        if (q->min_device_bytes < out->min_device_bytes) {
            size_t pick = out->chunk_numel_least_padding ? out->chunk_numel_least_padding : out->chunk_numel;
            cfg->mm.chunk_numel = chunk;
            *out = *q;
            out->chunk_numel_least_padding = pick;
            if (out->min_device_bytes <= budget) break;
        }
    }
    td_free(q);
    return st;
}

td_status td_train_resolve_chunks(td_train_config *cfg, size_t budget)
{
    if (!chunk_auto(cfg)) return TD_OK;
    td_train_plan *p = td_malloc(sizeof *p, TD_ROLE_META);
    if (!p) return TD_ERR_NOMEM;
    td_status st = resolve_chunks(cfg, budget, p);
    td_free(p);
    return st;
}

td_status td_train_plan_make(const td_train_config *cfg, size_t budget, td_train_plan *out)
{
    td_status st;
    memset(out, 0, sizeof *out);
    out->disk_fits = 1; /* no disk tier: nothing to fit there */
    if ((st = td_train_config_check(cfg))) return st;
    if (cfg->shard == TD_SHARD_AUTO && cfg->ranks > 1) { /* planned as the trainer resolves it */
        td_train_config c = *cfg;
        if ((st = td_train_resolve_shard(&c))) return st;
        return td_train_plan_make(&c, budget, out);
    }
    if (cfg->mm.grad_slots < 0) { /* auto: planned as the trainer resolves it */
        td_train_config c = *cfg;
        int planned;
        if ((st = resolve_grad_slots(&c, budget, out, &planned))) return st;
        return planned && c.mm.grad_slots == 0 ? TD_OK : td_train_plan_make(&c, budget, out);
    }
    if (chunk_auto(cfg)) { /* planned as the trainer resolves it */
        td_train_config c = *cfg;
        return resolve_chunks(&c, budget, out);
    }
    return plan_layout(cfg, budget, out);
}

/* td_train_plan_make with every auto choice resolved: the layout's plan. */
static td_status plan_layout(const td_train_config *cfg, size_t budget, td_train_plan *out)
{
    td_status st;
    td_train_ordered o = {0};
    memset(out, 0, sizeof *out);
    out->disk_fits = 1; /* no disk tier: nothing to fit there */
    if ((st = td_train_ordered_make(cfg, &o))) goto cleanup;
    td_memmgr *mm = o.mm;
    /* The communicator's device memory comes out of the budget: the arena
     * (chunks, activations) has the rest. */
    out->comm_device_bytes = td_train_comm_device_bytes(cfg);
    size_t whole_budget = budget;
    budget = budget > out->comm_device_bytes ? budget - out->comm_device_bytes : 0;
    const int *order = o.order;
    const td_model_desc *mc = &cfg->model;
    int n = td_model_tensor_count(mc), L = mc->n_layer;
    const int *pid = o.ids, *gid = o.ids + n;
    out->params = td_model_params_numel(mc);
    out->frozen_params = 0;
    for (int i = 0; i < n; i++)
        if (gid[i] < 0) out->frozen_params += td_model_tensor_numel(mc, i);
    out->chunks = td_memmgr_chunk_count(mm);
    out->chunk_numel = td_memmgr_chunk_numel(mm);
    out->padding_bytes = td_memmgr_padding_bytes(mm);
    size_t largest = 0, state_all = 0;
    for (int c = 0; c < out->chunks; c++) {
        size_t b = td_memmgr_chunk_slot_bytes(mm, c);
        out->role_bytes[td_memmgr_chunk_role(mm, c)] += b;
        if (!td_memmgr_chunk_transient(mm, c)) out->host_role_bytes[td_memmgr_chunk_role(mm, c)] += td_memmgr_chunk_bytes(mm, c);
        state_all += b;
        if (b > largest) largest = b;
    }
    /* Transient grads: no host copies, staging slots (in host_staging_bytes). */
    out->host_grad_slots = td_memmgr_grad_slots(mm, &out->host_grad_slot_bytes);
    td_act_plan ap;
    /* frozen tensors' storage (the OTHER role) moves and sits as params do */
    size_t frozen_bytes = out->role_bytes[TD_TENSOR_OTHER];
    td_state_bytes sb = { .param_grad = out->role_bytes[TD_TENSOR_PARAM] + out->role_bytes[TD_TENSOR_GRAD] + frozen_bytes,
                       .all = state_all, .largest = largest };
    td_train_plan_activations(cfg, budget ? budget : 0, &sb, &ap);
    out->ckpt_blocks = ap.ckpt_blocks;
    out->ckpt = ap.ckpt_blocks > 0;
    for (int i = 0; i < ap.n; i++) {
        size_t b = td_align_up(ap.bytes[i], TD_ARENA_ALIGN);
        if (ap.role[i] == TD_ROLE_ACTIVATION) out->activation_bytes += b;
        else if (ap.role[i] == TD_ROLE_WORKSPACE) out->workspace_bytes += b;
        else out->staging_bytes += b;
    }
    out->nonmodel_bytes = ap.total;
    /* The step's accesses, as micro_batch() makes them; each pins the union. */
    int nb = td_model_block_tensor_count(mc), ne = td_model_embed_tensor_count(mc), hi[3];
    int nh = td_model_head_tensors(mc, hi);
    int set[2 * TD_MODEL_BLOCK_TENSORS];
    int emb[2] = {pid[0], pid[1]}, gemb[2] = {gid[0], gid[1]}, head[6];
    for (int k = 0; k < nh; k++) {
        head[k] = pid[hi[k]];
        head[nh + k] = gid[hi[k]];
    }
    size_t ws = chunks_bytes(mm, emb, ne);
    if (chunks_bytes(mm, head, 2 * nh) > ws) ws = chunks_bytes(mm, head, 2 * nh);
    if (chunks_bytes(mm, gemb, ne) > ws) ws = chunks_bytes(mm, gemb, ne);
    for (int l = 0; l < L; l++) {
        for (int k = 0; k < nb; k++) {
            set[k] = pid[ne + l * nb + k];
            set[nb + k] = gid[ne + l * nb + k];
        }
        size_t b = chunks_bytes(mm, set, 2 * nb);
        if (b > ws) ws = b;
    }
    out->working_set_bytes = ws;
    out->largest_chunk_bytes = largest;
    /* One chunk to prefetch into, one more for fragmentation: chunks of
     * different sizes (a tensor larger than the chunk size has its own) leave
     * holes the others cannot use. */
    out->min_device_bytes = ap.total + ws + 2 * largest;
    out->full_device_bytes = ap.total + out->role_bytes[TD_TENSOR_PARAM] + out->role_bytes[TD_TENSOR_GRAD] + frozen_bytes;
    /* Work: 6 flops per param per token (2 forward, 4 backward) plus
     * attention's 12 L T C per token; a recomputed block adds its forward
     * but the last projection (H x C: nothing of backward reads its output). */
    double tokens = (double)cfg->micro_batch * cfg->seq_len * cfg->grad_accum;
    double fwd = 2.0 * (double)out->params + 4.0 * L * (double)cfg->seq_len * mc->n_embd;
    double rec = fwd / L - 2.0 * (double)td_model_mlp_width(mc) * mc->n_embd;
    /* a frozen weight's backward is its input's gradient alone: 2 flops, not 4 */
    out->flops_per_step = tokens * (3.0 * fwd - 2.0 * (double)out->frozen_params + (double)out->ckpt_blocks * rec);
    double params_bytes = (double)(out->role_bytes[TD_TENSOR_PARAM] + frozen_bytes), grads_bytes = (double)out->role_bytes[TD_TENSOR_GRAD];
    /* Optimizer chunks on the GPU (optim_place.c): their params and grads
     * stay on the device, their state takes room beside them. */
    out->optim_chunks = o.optim_chunks;
    out->optim_gpu_chunks = td_train_optim_gpu_count(cfg, mm, order, ap.total, out->min_device_bytes, budget);
    size_t gpu_pg = 0, gpu_numel = 0;
    td_train_optim_gpu_bytes(mm, cfg->precision, order, out->optim_gpu_chunks, &out->optim_gpu_state_bytes, &gpu_pg,
                             &gpu_numel);
    if (out->optim_gpu_chunks) { /* their chunks stay: the working set streams beside them */
        size_t stay = gpu_pg > ws ? gpu_pg : ws;
        out->min_device_bytes += stay - ws + out->optim_gpu_state_bytes;
        out->full_device_bytes += out->optim_gpu_state_bytes;
    }
    /* --policy auto keeps every chunk that fits: a budget that holds them
     * all needs no slot to prefetch into and leaves no holes (nothing is
     * evicted), so the minimum is never above the all-resident footprint. */
    if (cfg->mm.placement == TD_PLACEMENT_AUTO && out->min_device_bytes > out->full_device_bytes)
        out->min_device_bytes = out->full_device_bytes;
    out->gpu_optimizer = out->optim_chunks > 0 && out->optim_gpu_chunks == out->optim_chunks;
    out->min_device_bytes += out->comm_device_bytes;
    out->full_device_bytes += out->comm_device_bytes;
    double room = whole_budget > out->min_device_bytes ? (double)(whole_budget - out->min_device_bytes) : 0;
    double resident = cfg->mm.placement == TD_PLACEMENT_CPU ? 0
                    : cfg->mm.placement == TD_PLACEMENT_CUDA ? params_bytes + grads_bytes
                    : room < params_bytes + grads_bytes ? room : params_bytes + grads_bytes;
    if (resident < (double)gpu_pg) resident = (double)gpu_pg;
    double streamed = params_bytes + grads_bytes - resident;
    if (streamed < 0) streamed = 0;
    /* Traffic: what does not stay on the device is loaded in forward and in
     * backward of every micro-batch; the grads of the host's optimizer
     * chunks go down once a step and their new params come up once (the
     * CPU AdamW writes them); the GPU's chunks move nothing. */
    double gpu_share = params_bytes > 0 ? (double)gpu_pg / (params_bytes + grads_bytes) : 0;
    /* (frozen storage streams with the params but is never updated: no new copy comes up) */
    double loads = (params_bytes - (double)frozen_bytes) * (1 - gpu_share) + streamed * cfg->grad_accum;
    double downs = grads_bytes * (1 - gpu_share);
    /* Several ranks: a load moves this rank's shard over PCIe and the other
     * ranks' shards over the devices' links (the gather); a GPU AdamW's
     * chunks, updated on their own devices, are gathered once a step; every
     * grad chunk is reduce-scattered once a step (each its shard's sum),
     * the host AdamW's shards going down. */
    int N = cfg->ranks > 1 ? td_train_shard_ranks(cfg) : 1;
    double pshare = N > 1 && params_bytes > 0 ? (double)out->host_role_bytes[TD_TENSOR_PARAM] / params_bytes : 1;
    double gshare = N > 1 ? 1.0 / N : 1;
    out->h2d_bytes_per_step = loads * pshare;
    out->d2h_bytes_per_step = downs * gshare;
    out->shard_ranks = N;
    out->local_ranks = cfg->ranks > 1 && cfg->local_ranks > 1 ? cfg->local_ranks : 1;
    if (N > 1) {
        double others = (double)(N - 1) / N;
        double gpu_params = params_bytes + grads_bytes > 0 ? (double)gpu_pg * params_bytes / (params_bytes + grads_bytes) : 0;
        out->gather_bytes_per_step = (loads + gpu_params) * others;
        /* grads that stream are reduced at each micro-batch's eviction, the others once a step */
        out->reduce_bytes_per_step = grads_bytes * (streamed > 0 ? cfg->grad_accum : 1) * others;
    }
    /* The GPU chunks' elements include their padding: at most every param. */
    size_t trainable = out->params - out->frozen_params;
    out->adam_cpu_params = gpu_numel >= trainable ? 0 : (double)(trainable - gpu_numel);
    out->adam_bytes_per_param = td_train_adam_bytes_per_param(cfg);
    out->adam_bytes_per_step = out->adam_bytes_per_param * out->adam_cpu_params;
    /* The host: the optimizer homes the trainer gives (optim_place.c; the
     * host-homed state is pageable), then every pinned and pageable byte by
     * the trainer's own sequence. */
    if ((st = td_train_host_homes(mm, order, out->optim_gpu_chunks, NULL))) goto cleanup;
    /* the host copies as these homes give them (a GPU AdamW's grads keep theirs) */
    memset(out->host_role_bytes, 0, sizeof out->host_role_bytes);
    for (int c = 0; c < out->chunks; c++)
        if (!td_memmgr_chunk_transient(mm, c)) out->host_role_bytes[td_memmgr_chunk_role(mm, c)] += td_memmgr_chunk_bytes(mm, c);
    out->host_grad_slots = td_memmgr_grad_slots(mm, &out->host_grad_slot_bytes);
    if ((st = td_train_host_plan(mm, cfg, budget, out))) goto cleanup;
    /* The disk tier: what the host cannot hold of the CPU AdamW's state. */
    if (td_train_disk_tier(cfg) && (st = td_train_plan_disk(cfg, mm, order, out->optim_gpu_chunks, budget, out)))
        goto cleanup;
    if ((st = td_train_node_plan(mm, cfg, out))) goto cleanup;
cleanup:
    td_train_ordered_free(&o);
    return st;
}

/* Which tensors train (0: frozen, --freeze or a LoRA base) into trains[];
 * patterns that cannot be resolved at this count (one names a layer past
 * it) leave the LoRA base's alone frozen: fewer frozen, a higher floor is
 * still no plan's need, as that count cannot be planned. */
static void floor_trains(const td_train_config *cfg, uint8_t *trains, int n)
{
    if (td_train_frozen(cfg, trains) != TD_OK) {
        td_error_clear();
        td_train_config c = *cfg;
        c.n_freeze = 0;
        if (td_train_frozen(&c, trains) != TD_OK) {
            td_error_clear();
            memset(trains, 0, (size_t)n);
        }
    }
    for (int i = 0; i < n; i++) trains[i] = !trains[i];
}

/* td_train_plan_make's device need at its least, term by term: a chunk
 * holds at least its tensors, so an access of the working set pins at
 * least the bytes of its params and grads (the embedding's params or its
 * grads, the head's params and grads, or a block's; a frozen tensor, of
 * --freeze or a LoRA base, has no grad), the largest chunk is at least the
 * largest param tensor, and under --policy cuda every param and grad
 * stays; the non-model buffers are --ckpt on's or off's, or auto's fewest
 * (every block recomputed).  With more layers only the blocks' count grows
 * (the residual streams and the activations kept, the params), and each
 * block added only adds terms (which of its tensors freeze depends on its
 * name, not on the count). */
size_t td_train_device_floor_bytes(const td_train_config *cfg)
{
    const td_model_desc *mc = &cfg->model;
    td_train_config least = *cfg;
    if (least.ckpt == TD_CKPT_AUTO) { /* its fewest: every block recomputed */
        least.ckpt = TD_CKPT_ON;
        least.ckpt_blocks = 0;
    }
    td_act_plan fewest;
    td_train_plan_activations(&least, 0, NULL, &fewest); /* on and off ask nothing of the state */
    size_t E = td_dtype_bytes(cfg->precision);
    int n = td_model_tensor_count(mc), ne = td_model_embed_tensor_count(mc), nb = td_model_block_tensor_count(mc);
    uint8_t *trains = td_malloc((size_t)n, TD_ROLE_META);
    if (!trains) return fewest.total; /* out of memory: the activations alone are still a floor */
    floor_trains(cfg, trains, n);
    size_t all = 0, big = 0, embed_p = 0, embed_g = 0, head = 0, access = 0;
    for (int i = 0; i < n; i++) {
        size_t t = td_model_tensor_numel(mc, i);
        all += t + (trains[i] ? t : 0);
        if (t > big) big = t;
        if (i < ne) {
            embed_p += t;
            embed_g += trains[i] ? t : 0;
        }
    }
    int hi[3], nh = td_model_head_tensors(mc, hi);
    for (int k = 0; k < nh; k++) {
        size_t t = td_model_tensor_numel(mc, hi[k]);
        head += t + (trains[hi[k]] ? t : 0);
    }
    access = embed_p > embed_g ? embed_p : embed_g;
    if (head > access) access = head;
    for (int l = 0; l < mc->n_layer; l++) {
        size_t b = 0;
        for (int k = 0; k < nb; k++) {
            int i = ne + l * nb + k;
            size_t t = td_model_tensor_numel(mc, i);
            b += t + (trains[i] ? t : 0);
        }
        if (b > access) access = b;
    }
    td_free(trains);
    size_t resident = fewest.total + E * all;
    if (cfg->mm.placement == TD_PLACEMENT_CUDA) return resident;
    size_t streamed = fewest.total + E * access + 2 * E * big;
    /* --policy auto's minimum is at most the all-resident footprint (td_train_plan_make) */
    return cfg->mm.placement == TD_PLACEMENT_AUTO && resident < streamed ? resident : streamed;
}

td_status td_train_plan_fits(const td_train_config *cfg, const td_train_limits *lim, td_train_plan *p, int *fits,
                             int *host_fits)
{
    td_train_config c = *cfg;
    if (td_train_disk_tier(cfg)) { /* the disk tier takes what lim's RAM cannot hold (as td_train_host_limits reads it) */
        size_t k = cfg->ranks > 1 && cfg->local_ranks > 1 ? (size_t)cfg->local_ranks : 1;
        c.host_ram = lim->ram_bytes * k;
        c.host_pin_limit = lim->pin_limit_bytes * k;
    }
    td_status st = td_train_plan_make(&c, lim->budget_bytes, p);
    if (st) return st;
    size_t dev = cfg->mm.placement == TD_PLACEMENT_CUDA ? p->full_device_bytes : p->min_device_bytes;
    int host = p->host_pinned_bytes <= lim->pin_limit_bytes && p->host_bytes <= lim->ram_bytes && p->disk_fits;
    *fits = host && lim->budget_bytes >= dev && lim->budget_bytes <= lim->device_free_bytes;
    if (host_fits) *host_fits = host;
    return TD_OK;
}

td_status td_train_plan_print_layout(const td_train_config *cfg, const td_train_plan *p, FILE *f)
{
    td_status st = TD_OK;
    td_train_ordered o;
    td_train_config c = *cfg;
    if (c.mm.grad_slots < 0) c.mm.grad_slots = p->host_grad_slots; /* auto, as the plan resolved it (0: copies) */
    if (!c.mm.chunk_numel) c.mm.chunk_numel = p->chunk_numel;      /* the chunk size it resolved */
    TD_TRY(td_train_ordered_make(&c, &o));
    {
        int n = td_memmgr_role_chunk_count(o.mm, TD_TENSOR_PARAM);
        int counts[3] = {p->disk_chunks, p->disk_grad_chunks, p->disk_param_chunks};
        uint8_t *marks = td_calloc(2 * ((size_t)n + 1), 1, TD_ROLE_META);
        if (!marks) TD_FAIL(TD_ERR_NOMEM, "the layout of %d chunks", n);
        for (int j = 0; j < p->optim_gpu_chunks && j < n; j++) marks[o.order[j]] = 1;
        st = td_train_disk_pick(&c, o.mm, marks, n, counts, marks + n + 1);
        if (!st) st = td_train_host_homes(o.mm, o.order, p->optim_gpu_chunks, marks + n + 1); /* the trainer's homes */
        td_free(marks);
        if (st) goto cleanup;
    }
    td_memmgr_print_layout(o.mm, f);
cleanup:
    td_train_ordered_free(&o);
    return st;
}

td_status td_train_default_budget(const td_train_config *cfg, size_t cap, size_t *budget)
{
    td_train_plan p, q;
    td_status st = td_train_plan_make(cfg, cap, &p);
    if (st) return st;
    size_t state = 0;
    for (int r = 0; r < TD_TENSOR_ROLE_COUNT; r++) state += p.role_bytes[r];
    /* Resident: every chunk (and AdamW's state when it runs on the GPU), with
     * two of the largest chunk for fragmentation, as the plan's minimum has. */
    size_t need = p.nonmodel_bytes + (p.gpu_optimizer ? state : p.role_bytes[TD_TENSOR_PARAM] +
                                                                    p.role_bytes[TD_TENSOR_GRAD] +
                                                                    2 * p.largest_chunk_bytes + p.optim_gpu_state_bytes);
    need = td_align_up(need + need / 8, TD_ARENA_ALIGN);
    *budget = cap;
    if (need >= cap) return TD_OK;
    /* The smaller budget must make the choices the cap made (the kept
     * activations, where AdamW runs); else take the cap. */
    if ((st = td_train_plan_make(cfg, need, &q))) return st;
    if (q.optim_gpu_chunks == p.optim_gpu_chunks && q.ckpt_blocks == p.ckpt_blocks && need >= q.min_device_bytes &&
        need >= q.full_device_bytes)
        *budget = need;
    return TD_OK;
}
