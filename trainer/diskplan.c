/* The disk tier's plan: which chunks live on disk, what that costs the
 * host (the slots) and the step (its reads and writes), and the gradient
 * accumulation at which that traffic stops mattering.
 *
 * Optimizer state (master, m, v) goes first: the update touches it once a
 * step, while params and grads cross PCIe in every micro-batch.  Grads
 * follow when the state alone is not enough (those that keep a host copy:
 * transient grads take only staging slots), params last (every upload of
 * one is then a read from disk).  Of each
 * kind the fewest chunks that make the host fit its RAM and pin limit (a
 * bisection over the count: each chunk on disk takes its bytes off the
 * host, the slots a fixed amount on).  Which ones: spread evenly over the
 * chunks, so that their reads spread over the AdamW's pass (or the step)
 * and run beside the work on the chunks in RAM; a chunk larger than the
 * common size (the embedding's) only when every other of its kind is on
 * disk already, as it would set the size of every slot of its pool. */
#include "train_impl.h"
#include "tidal/diskio.h"
#include "tidal/util.h"

#include <string.h>

const td_tensor_role td_train_disk_pool_roles[TD_TRAIN_DISK_POOLS] = {TD_TENSOR_PARAM, TD_TENSOR_GRAD,
                                                                      TD_TENSOR_MASTER, TD_TENSOR_ADAM_M,
                                                                      TD_TENSOR_ADAM_V};

int td_train_disk_tier(const td_train_config *cfg) { return cfg->mm.n_disk_dirs > 0 || cfg->disk_bytes > 0; }

/* The candidates of one kind in chunk order, those of the common size
 * first (*regular of them), then the larger ones; returns the count.
 * Optimizer state: every chunk the CPU AdamW updates; grads and params:
 * those homed on the host (not the GPU AdamW's, nor a transient grad's). */
static int candidates(const td_train_config *cfg, td_memmgr *mm, const uint8_t *on_gpu, int n, int kind, int *cand,
                      int *regular)
{
    td_tensor_role role = kind == TD_TRAIN_DISK_PARAM ? TD_TENSOR_PARAM : TD_TENSOR_GRAD;
    int first = td_memmgr_role_chunk(mm, TD_TENSOR_PARAM, 0), c = 0;
    size_t common = 0;
    *regular = 0;
    for (int k = 0; k < n; k++) { /* the common capacity: the layout's, the smallest slot */
        size_t b = td_memmgr_chunk_slot_bytes(mm, first + k);
        if (b < common || !common) common = b;
    }
    for (int pass = 0; pass < 2; pass++) {
        for (int k = 0; k < n; k++) {
            if (on_gpu && on_gpu[k]) continue;
            if (kind != TD_TRAIN_DISK_OPTIM) {
                int ch = td_memmgr_role_chunk(mm, role, k);
                if (ch < 0 || td_memmgr_chunk_home(mm, ch) == TD_HOME_DEVICE || td_memmgr_chunk_transient(mm, ch))
                    continue;
            }
            int big = td_memmgr_chunk_slot_bytes(mm, first + k) > common;
            if (big == pass) cand[c++] = k;
        }
        if (!pass) *regular = c;
    }
    return c;
}

/* `count` of the candidates marked `kind`: spread evenly over the regular
 * ones (the first at half a step in), then the larger. */
static void mark(const int *cand, int total, int regular, int count, uint8_t kind, uint8_t *marks)
{
    if (count > total) count = total;
    int spread = count < regular ? count : regular;
    for (int i = 0; i < spread; i++) marks[cand[(int)(((double)i + 0.5) * regular / spread)]] |= kind;
    for (int i = regular; i < regular + (count - spread); i++) marks[cand[i]] |= kind;
}

td_status td_train_disk_pick(const td_train_config *cfg, td_memmgr *mm, const uint8_t *on_gpu, int n,
                             const int counts[3], uint8_t *marks)
{
    static const uint8_t kinds[3] = {TD_TRAIN_DISK_OPTIM, TD_TRAIN_DISK_GRAD, TD_TRAIN_DISK_PARAM};
    memset(marks, 0, (size_t)n);
    int *cand = td_malloc(((size_t)n + 1) * sizeof *cand, TD_ROLE_META), regular = 0;
    if (!cand) return TD_ERR_NOMEM;
    for (int i = 0; i < 3; i++) {
        if (counts[i] <= 0) continue;
        int total = candidates(cfg, mm, on_gpu, n, kinds[i], cand, &regular);
        mark(cand, total, regular, counts[i], kinds[i], marks);
    }
    td_free(cand);
    return TD_OK;
}

static int host_fits(const td_train_plan *p, size_t ram, size_t pin)
{
    return p->host_bytes <= ram && p->host_pinned_bytes <= pin;
}

/* The search's state: the planning manager, its order and GPU chunks, and
 * the marks each count gives. */
typedef struct disk_search {
    const td_train_config *cfg;
    td_memmgr *mm;
    const int *order;
    int gpu, n;
    size_t budget, ram, pin;
    uint8_t *on_gpu, *marks;
    const td_train_plan *base;
} disk_search;

/* The host plan with counts[] chunks of each kind on disk (the homes set on the planning manager). */
static td_status plan_with(disk_search *s, const int counts[3], td_train_plan *p)
{
    *p = *s->base;
    td_status st = td_train_disk_pick(s->cfg, s->mm, s->on_gpu, s->n, counts, s->marks);
    if (!st) st = td_train_host_homes(s->mm, s->order, s->gpu, s->marks);
    if (!st) st = td_train_host_plan(s->mm, s->cfg, s->budget, p);
    return st;
}

/* The fewest chunks of kind i (the earlier kinds all on disk: counts[]
 * holds them) that fit: bisected over the regular candidates (the host's
 * bytes fall as more go), then the larger ones one at a time; *fits says
 * whether any count did, and counts[i] is the count that fit, or the one
 * that asked the least of the host. */
static td_status fewest(disk_search *s, int i, int *counts, int *fits)
{
    static const uint8_t kinds[3] = {TD_TRAIN_DISK_OPTIM, TD_TRAIN_DISK_GRAD, TD_TRAIN_DISK_PARAM};
    td_status st = TD_OK;
    int *cand = td_malloc(((size_t)s->n + 1) * sizeof *cand, TD_ROLE_META), regular = 0;
    if (!cand) return TD_ERR_NOMEM;
    /* the candidates as the homes stand before this kind moves (of the earlier kinds' choice) */
    int total = candidates(s->cfg, s->mm, s->on_gpu, s->n, kinds[i], cand, &regular);
    td_free(cand);
    td_train_plan q;
    *fits = 0;
    if (!total) { counts[i] = 0; return TD_OK; }
    int lo = 1, hi = regular > 0 ? regular : total;
    counts[i] = hi;
    TD_TRY(plan_with(s, counts, &q));
    if (host_fits(&q, s->ram, s->pin)) {
        while (lo < hi) {
            counts[i] = lo + (hi - lo) / 2;
            TD_TRY(plan_with(s, counts, &q));
            if (host_fits(&q, s->ram, s->pin)) hi = counts[i];
            else lo = counts[i] + 1;
        }
        counts[i] = hi;
        *fits = 1;
        return TD_OK;
    }
    size_t least = q.host_bytes;
    int best = hi;
    for (int d = hi + 1; d <= total; d++) { /* the larger chunks, one more at a time */
        counts[i] = d;
        TD_TRY(plan_with(s, counts, &q));
        if (host_fits(&q, s->ram, s->pin)) { best = d; *fits = 1; break; }
        if (q.host_bytes < least) least = q.host_bytes, best = d;
    }
    counts[i] = best;
cleanup:
    return st;
}

td_status td_train_plan_disk(const td_train_config *cfg, td_memmgr *mm, const int *order, int gpu, size_t budget,
                             td_train_plan *p)
{
    td_status st = TD_OK;
    char src[256];
    p->disk_chunks = p->disk_grad_chunks = p->disk_param_chunks = 0;
    p->disk_bytes = p->disk_set_bytes = 0;
    p->disk_sets = 0;
    p->disk_read_bytes_per_step = p->disk_write_bytes_per_step = p->disk_stream_bytes_per_step = 0;
    p->disk_free_bytes = cfg->disk_bytes;
    if (!cfg->disk_bytes && cfg->mm.n_disk_dirs) { /* striped evenly: the fullest directory sets the room */
        size_t least = SIZE_MAX;
        for (int i = 0; i < cfg->mm.n_disk_dirs; i++) {
            size_t f;
            td_status e = td_dio_dir_free(cfg->mm.disk_dirs[i], &f);
            if (e) return td_error_prefix(e, "--offload-dir: ");
            if (f < least) least = f;
        }
        p->disk_free_bytes = least * (size_t)cfg->mm.n_disk_dirs;
    }
    p->disk_fits = 1;
    disk_search s = { .cfg = cfg, .mm = mm, .order = order, .gpu = gpu, .budget = budget, .base = p };
    if (td_train_host_limits(cfg, &s.ram, &s.pin, src, sizeof src)) { /* unknown RAM: nothing to move */
        td_error_clear();
        return TD_OK;
    }
    if (host_fits(p, s.ram, s.pin)) return TD_OK;
    s.n = td_memmgr_role_chunk_count(mm, TD_TENSOR_PARAM);
    s.on_gpu = td_calloc(2 * ((size_t)s.n + 1), 1, TD_ROLE_META);
    if (!s.on_gpu) return td_error_set(TD_ERR_NOMEM, "the disk tier's plan of %d chunks", s.n);
    s.marks = s.on_gpu + s.n + 1;
    for (int j = 0; j < gpu && j < s.n; j++) s.on_gpu[order[j]] = 1;
    int counts[3] = {0, 0, 0}, fits = 0;
    /* Optimizer state; then, with as much of it there as asks the least of
     * the host (every chunk of the common size, say), grads; then params. */
    for (int i = 0; i < 3 && !fits; i++) TD_TRY(fewest(&s, i, counts, &fits));
    TD_TRY(plan_with(&s, counts, p));
    size_t slot[TD_TENSOR_ROLE_COUNT], file;
    p->disk_sets = td_memmgr_disk_plan(mm, slot, &file);
    for (int r = 0; r < TD_TENSOR_ROLE_COUNT; r++) p->disk_set_bytes += slot[r];
    p->disk_bytes = file;
    p->disk_chunks = counts[0];
    p->disk_grad_chunks = counts[1];
    p->disk_param_chunks = counts[2];
    /* A step's traffic.  Optimizer state: read and written once, beside the
     * CPU AdamW.  Grads: each micro-batch's write-back lands in a slot and
     * is written, and from the second on the chunk comes back (read) to
     * accumulate; the AdamW reads the last.  Params: read for each upload
     * (the forward's and the backward's of every micro-batch), written once
     * by the AdamW (which overwrites them: nothing read).  What runs beside
     * the AdamW: the state, the last grads' write and read, the params' write. */
    double optim = 0, grads = 0, params = 0, K = cfg->grad_accum > 1 ? cfg->grad_accum : 1;
    for (int c = 0; c < td_memmgr_chunk_count(mm); c++) {
        if (!td_memmgr_chunk_on_disk(mm, c)) continue;
        double b = (double)td_align_up(td_memmgr_chunk_bytes(mm, c) ? td_memmgr_chunk_bytes(mm, c) : 1, TD_DIO_ALIGN);
        td_tensor_role r = td_memmgr_chunk_role(mm, c);
        if (r == TD_TENSOR_PARAM) params += b;
        else if (r == TD_TENSOR_GRAD) grads += b;
        else optim += b;
    }
    /* What the slots of params and grads hold at once never needs the disk
     * (a lower bound: the step moves at least the rest). */
    grads = grads > (double)p->disk_sets * (double)slot[TD_TENSOR_GRAD] ? grads - (double)p->disk_sets * (double)slot[TD_TENSOR_GRAD] : 0;
    double params_read = params > (double)p->disk_sets * (double)slot[TD_TENSOR_PARAM]
                             ? params - (double)p->disk_sets * (double)slot[TD_TENSOR_PARAM] : 0;
    p->disk_read_bytes_per_step = optim + K * grads + 2 * K * params_read;
    p->disk_write_bytes_per_step = optim + K * grads + params;
    p->disk_stream_bytes_per_step = 2 * optim + 2 * grads + params;
    p->disk_fits = !p->disk_free_bytes || file <= p->disk_free_bytes;
cleanup:
    td_free(s.on_gpu);
    return st;
}

/* ---- the accumulation that hides it ---------------------------------------------- */

/* The bound at `accum` micro-batches, from the plans at two and three
 * (every figure that grows with them grows linearly: the compute, and the
 * loads of what streams in each micro-batch). */
static void bound_at(const td_train_config *cfg, const td_train_plan *p2, const td_train_plan *p3,
                     const td_train_rates *r, int accum, int disk, td_train_bound *b)
{
    td_train_config c = *cfg;
    td_train_plan p = *p2;
    double k = accum - 2;
    c.grad_accum = accum;
    p.flops_per_step = p2->flops_per_step + k * (p3->flops_per_step - p2->flops_per_step);
    p.h2d_bytes_per_step = p2->h2d_bytes_per_step + k * (p3->h2d_bytes_per_step - p2->h2d_bytes_per_step);
    p.disk_read_bytes_per_step = p2->disk_read_bytes_per_step + k * (p3->disk_read_bytes_per_step - p2->disk_read_bytes_per_step);
    p.disk_write_bytes_per_step = p2->disk_write_bytes_per_step + k * (p3->disk_write_bytes_per_step - p2->disk_write_bytes_per_step);
    if (!disk) p.disk_read_bytes_per_step = p.disk_write_bytes_per_step = p.disk_stream_bytes_per_step = 0;
    td_train_bound_of(&c, &p, r, b);
}

td_status td_train_disk_hiding_accum(const td_train_config *cfg, size_t budget, const td_train_rates *r,
                                     double within, int *accum, td_train_bound *at)
{
    td_status st = TD_OK;
    td_train_plan p1, p2, p3;
    td_train_config c = *cfg;
    *accum = 0;
    memset(at, 0, sizeof *at);
    /* One micro-batch: its own plan (its grads may be transient, which
     * keeps more state in RAM). */
    c.grad_accum = 1;
    if ((st = td_train_plan_make(&c, budget, &p1))) return st;
    td_train_bound with, without;
    td_train_bound_of(&c, &p1, r, &with);
    if (with.disk_ms <= 0) return TD_OK; /* no disk traffic, or no rate to time it */
    p1.disk_read_bytes_per_step = p1.disk_write_bytes_per_step = p1.disk_stream_bytes_per_step = 0;
    td_train_bound_of(&c, &p1, r, &without);
    if (with.bound_ms <= (1 + within) * without.bound_ms) {
        *accum = 1;
        *at = with;
        return TD_OK;
    }
    c.grad_accum = 2;
    if ((st = td_train_plan_make(&c, budget, &p2))) return st;
    c.grad_accum = 3;
    if ((st = td_train_plan_make(&c, budget, &p3))) return st;
    /* Doubling, then bisection: the disk's share of the bound falls as the
     * compute grows. */
    int lo = 1, hi = 2;
    for (;;) {
        bound_at(cfg, &p2, &p3, r, hi, 1, &with);
        bound_at(cfg, &p2, &p3, r, hi, 0, &without);
        if (with.bound_ms <= (1 + within) * without.bound_ms) break;
        if (hi >= 65536) return TD_OK;
        lo = hi;
        hi *= 2;
    }
    while (hi - lo > 1) {
        int mid = lo + (hi - lo) / 2;
        bound_at(cfg, &p2, &p3, r, mid, 1, &with);
        bound_at(cfg, &p2, &p3, r, mid, 0, &without);
        if (with.bound_ms <= (1 + within) * without.bound_ms) hi = mid;
        else lo = mid;
    }
    *accum = hi;
    bound_at(cfg, &p2, &p3, r, hi, 1, at);
    return TD_OK;
}
