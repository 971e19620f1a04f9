/* Where each optimizer chunk lives: on the GPU (its master, m and v homed
 * on the device with its param and grad chunk, updated there: its grads
 * never go down, its params never come up) or on the host (the CPU AdamW).
 * Decided once, before the layout, and fixed for the run, so that host
 * copies can be pinned only where something crosses PCIe.
 *
 * Which chunks: the least CPU slack first (td_optim_order_by_slack).  In
 * the step as micro_batch() makes it, the embedding's grads are complete
 * last (the embedding backward ends the step) and the next forward needs it
 * first; the first blocks come next.  A CPU AdamW on those chunks holds up
 * the next forward; the last blocks' grads are ready early in backward and
 * their params are needed late, so the CPU hides their update.
 * How many: --policy cuda all, cpu none, static the (1 - F) share, auto as
 * many as the budget leaves room for after the activations and, where they
 * fit, every param (optim_fit). */
#include "train_impl.h"
#include "tidal/util.h"

#include <string.h>

td_status td_train_plan_memmgr(const td_train_config *cfg, td_memmgr **mm, int **ids)
{
    td_status st = TD_OK;
    td_memmgr_params mp = td_train_chunk_params(cfg);
    *mm = NULL;
    *ids = td_malloc(5 * (size_t)td_model_tensor_count(&cfg->model) * sizeof(int), TD_ROLE_META);
    if (!*ids) return TD_ERR_NOMEM;
    TD_TRY(td_memmgr_create(NULL, NULL, NULL, &mp, mm));
    TD_TRY(td_train_register_model(*mm, cfg, *ids));
    TD_TRY(td_memmgr_plan_layout(*mm));
cleanup:
    return st;
}

td_status td_train_ordered_make(const td_train_config *cfg, td_train_ordered *out)
{
    td_status st = TD_OK;
    memset(out, 0, sizeof *out);
    TD_TRY(td_train_plan_memmgr(cfg, &out->mm, &out->ids));
    out->order = td_malloc(((size_t)td_memmgr_chunk_count(out->mm) + 1) * sizeof *out->order, TD_ROLE_META);
    if (!out->order) TD_FAIL(TD_ERR_NOMEM, "the optimizer's order of %d chunks", td_memmgr_chunk_count(out->mm));
    out->optim_chunks = td_train_optim_order(cfg, out->mm, out->ids, out->order);
cleanup:
    if (st) td_train_ordered_free(out);
    return st;
}

void td_train_ordered_free(td_train_ordered *o)
{
    td_memmgr_destroy(o->mm);
    td_free(o->ids);
    td_free(o->order);
    memset(o, 0, sizeof *o);
}

/* Positions in one step of 2L + 4 accesses (forward: embedding 0, block l
 * at 1 + l, head L + 1; backward: head L + 2, block l at L + 3 + (L-1-l),
 * embedding 2L + 3): when the next forward first needs model tensor i,
 * and when its grad is complete. */
static void tensor_positions(const td_model_desc *mc, int i, uint64_t *need, uint64_t *ready)
{
    uint64_t L = (uint64_t)mc->n_layer;
    int ne = td_model_embed_tensor_count(mc), nb = td_model_block_tensor_count(mc);
    int li = ne + mc->n_layer * nb;
    if (i < ne) { *need = 0; *ready = 2 * L + 3; return; }  /* wte (tied: also the head), GPT-2's wpe */
    if (i >= li) { *need = L + 1; *ready = L + 2; return; } /* the final norm, an untied lm_head */
    uint64_t l = (uint64_t)((i - ne) / nb);
    *need = 1 + l;
    *ready = L + 3 + (L - 1 - l);
}

int td_train_optim_order(const td_train_config *cfg, td_memmgr *mm, const int *pid, int *order)
{
    const td_model_desc *mc = &cfg->model;
    int n = td_memmgr_role_chunk_count(mm, TD_TENSOR_PARAM), first = td_memmgr_role_chunk(mm, TD_TENSOR_PARAM, 0);
    uint64_t *need = td_malloc(2 * ((size_t)n + 1) * sizeof *need, TD_ROLE_META), *ready = need + n + 1;
    if (!need) { /* the model order: correct, only without the slack ranking */
        for (int k = 0; k < n; k++) order[k] = k;
        return n;
    }
    for (int k = 0; k < n; k++) { need[k] = UINT64_MAX; ready[k] = 0; }
    for (int i = 0; i < td_model_tensor_count(mc); i++) {
        int c = td_memmgr_tensor_chunk(mm, pid[i]), k = c - first;
        if (td_memmgr_chunk_role(mm, c) != TD_TENSOR_PARAM) continue; /* frozen: no optimizer chunk */
        uint64_t nd, rd;
        tensor_positions(mc, i, &nd, &rd);
        if (nd < need[k]) need[k] = nd;
        if (rd > ready[k]) ready[k] = rd;
    }
    td_optim_order_by_slack(n, ready, need, 2 * (uint64_t)mc->n_layer + 4, order);
    td_free(need);
    return n;
}

/* Device bytes of chunk k of a role (0 when the role has none). */
static size_t role_chunk_bytes(td_memmgr *mm, td_tensor_role r, int k)
{
    int c = td_memmgr_role_chunk(mm, r, k);
    return c < 0 ? 0 : td_memmgr_chunk_slot_bytes(mm, c);
}

static size_t optim_state_bytes(td_memmgr *mm, int k)
{
    return role_chunk_bytes(mm, TD_TENSOR_MASTER, k) + role_chunk_bytes(mm, TD_TENSOR_ADAM_M, k) +
           role_chunk_bytes(mm, TD_TENSOR_ADAM_V, k);
}

static int optim_fit(td_memmgr *mm, const int *order, int n, size_t nonmodel, size_t min_device, size_t budget);

int td_train_optim_gpu_count(const td_train_config *cfg, td_memmgr *mm, const int *order, size_t nonmodel,
                             size_t min_device, size_t budget)
{
    int n = td_memmgr_role_chunk_count(mm, TD_TENSOR_PARAM);
    switch (cfg->mm.placement) {
    case TD_PLACEMENT_CUDA: return n;
    case TD_PLACEMENT_CPU: return 0;
    case TD_PLACEMENT_STATIC: return n - (int)(cfg->mm.offload_optim_frac * n + 0.5);
    case TD_PLACEMENT_AUTO: break;
    }
    /* --offload-optim-frac F under auto: at least that share on the host. */
    int cap = n - (int)(cfg->mm.offload_optim_frac * n + 0.5);
    int k = optim_fit(mm, order, n, nonmodel, min_device, budget);
    return k < cap ? k : cap;
}

/* Auto's count: see td_train_optim_gpu_count. */
static int optim_fit(td_memmgr *mm, const int *order, int n, size_t nonmodel, size_t min_device, size_t budget)
{
    if (!budget) return 0;
    /* Auto: the params and grads first (resident when they fit, else the
     * streaming minimum), then optimizer chunks in slack order while the
     * whole keeps a sixteenth of the budget to spare.  A chunk on the GPU
     * brings its param and grad chunk when those stream. */
    size_t pg = 0, params = 0, largest = 0;
    for (int c = 0; c < td_memmgr_chunk_count(mm); c++) {
        size_t b = td_memmgr_chunk_slot_bytes(mm, c);
        td_tensor_role r = td_memmgr_chunk_role(mm, c);
        if (r == TD_TENSOR_PARAM || r == TD_TENSOR_GRAD) pg += b;
        if (r == TD_TENSOR_PARAM) params += b;
        if (b > largest) largest = b;
    }
    size_t all = nonmodel;
    for (int c = 0; c < td_memmgr_chunk_count(mm); c++) all += td_memmgr_chunk_slot_bytes(mm, c);
    if (all + all / 16 <= budget) return n; /* everything stays: nothing streams, no slot to prefetch into */
    size_t resident = nonmodel + pg + 2 * largest;
    int pg_fit = resident + resident / 16 <= budget;
    /* Else, where every param fits beside the streaming minimum (which holds
     * a block's params and grads and the spare slots), the optimizer chunks
     * take only the room left after the params: state past it would evict
     * params that the backward reads again, and those reloads, each waiting
     * for a slot the block before frees, hold up every block (W4 on an
     * H100: 6 chunks on the GPU and no param reloaded, 990 ms a step; 19,
     * filling the budget, 1067 ms with 14 blocks' params reloaded). */
    size_t keep_params = min_device + params;
    int p_fit = !pg_fit && keep_params + keep_params / 16 <= budget;
    size_t used = pg_fit ? resident : p_fit ? keep_params : min_device;
    /* Where every param and grad stays, nothing streams: each chunk takes
     * its slot once and keeps it, two of the largest chunks are already
     * counted for alignment and fragmentation, and a sixty-fourth to spare
     * is enough.  The sixteenth kept the embedding's state off the GPU at
     * W3 (1.5B, 24 GiB: 21.97 GiB resident, 0.88 GiB of wte's state), and
     * the next forward waited about 30 ms for its CPU AdamW every step. */
    size_t spare_div = pg_fit ? 64 : 16;
    int k = 0;
    for (; k < n; k++) {
        int c = order[k];
        size_t cost = optim_state_bytes(mm, c);
        if (!pg_fit) cost += role_chunk_bytes(mm, TD_TENSOR_GRAD, c);
        if (!pg_fit && !p_fit) cost += role_chunk_bytes(mm, TD_TENSOR_PARAM, c);
        if (used + cost + (used + cost) / spare_div > budget) break;
        used += cost;
    }
    return k;
}

void td_train_optim_gpu_bytes(td_memmgr *mm, td_dtype param_dtype, const int *order, int gpu, size_t *state_bytes,
                              size_t *pg_bytes, size_t *numel)
{
    *state_bytes = *pg_bytes = *numel = 0;
    for (int j = 0; j < gpu; j++) {
        int k = order[j];
        size_t p = role_chunk_bytes(mm, TD_TENSOR_PARAM, k);
        *state_bytes += optim_state_bytes(mm, k);
        *pg_bytes += p + role_chunk_bytes(mm, TD_TENSOR_GRAD, k);
        *numel += p / td_dtype_bytes(param_dtype);
    }
}

td_status td_train_optim_homes(const td_train_config *cfg, int gpu, uint8_t **on_gpu, int *n_out)
{
    td_status st = TD_OK;
    td_train_ordered o;
    *on_gpu = NULL;
    *n_out = 0;
    TD_TRY(td_train_ordered_make(cfg, &o));
    int n = o.optim_chunks;
    *on_gpu = td_calloc((size_t)n + 1, 1, TD_ROLE_META);
    if (!*on_gpu) TD_FAIL(TD_ERR_NOMEM, "optimizer placement of %d chunks", n);
    for (int j = 0; j < gpu && j < n; j++) (*on_gpu)[o.order[j]] = 1;
    *n_out = n;
cleanup:
    td_train_ordered_free(&o);
    if (st) {
        td_free(*on_gpu);
        *on_gpu = NULL;
    }
    return st;
}

td_status td_train_place_optimizer(td_trainer *t, const td_train_plan *plan)
{
    int n = 0, gpu_chunks = plan->optim_gpu_chunks;
    td_status st = td_train_optim_homes(&t->cfg, gpu_chunks, &t->optim_on_gpu, &n);
    if (st) return st;
    t->gpu_opt = gpu_chunks < n ? gpu_chunks : n;
    int counts[3] = {plan->disk_chunks, plan->disk_grad_chunks, plan->disk_param_chunks};
    if (counts[0] + counts[1] + counts[2] <= 0) return td_memmgr_set_optim_homes(t->mm, t->optim_on_gpu, n);
    /* The disk tier's chunks, picked as the plan picked them, on a planned
     * layout of the same registrations. */
    td_train_ordered o;
    uint8_t *homes = td_malloc((size_t)n + 1, TD_ROLE_META);
    t->optim_on_disk = td_calloc((size_t)n + 1, 1, TD_ROLE_META);
    if (!homes || !t->optim_on_disk) {
        td_free(homes);
        return td_error_set(TD_ERR_NOMEM, "optimizer placement of %d chunks", n);
    }
    if (!(st = td_train_ordered_make(&t->cfg, &o))) {
        st = td_train_disk_pick(&t->cfg, o.mm, t->optim_on_gpu, n, counts, t->optim_on_disk);
        td_train_ordered_free(&o);
    }
    for (int k = 0; k < n; k++) {
        uint8_t d = t->optim_on_disk[k];
        homes[k] = t->optim_on_gpu[k] ? TD_HOME_DEVICE : (d & TD_TRAIN_DISK_OPTIM) ? TD_HOME_DISK : TD_HOME_HOST;
        if (d & TD_TRAIN_DISK_GRAD) homes[k] |= TD_OPTIM_HOME_GRAD_DISK;
        if (d & TD_TRAIN_DISK_PARAM) homes[k] |= TD_OPTIM_HOME_PARAM_DISK;
    }
    if (!st) st = td_memmgr_set_optim_homes(t->mm, homes, n);
    td_free(homes);
    return st;
}
