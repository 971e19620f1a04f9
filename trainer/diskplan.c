/* The disk tier's plan: which optimizer chunks live on disk, what that
 * costs the host (bounce sets) and the step (its reads and writes), and
 * the gradient accumulation at which that traffic stops mattering.
 *
 * Only the CPU AdamW's optimizer state goes to disk: it is touched once a
 * step, by the update, while params and grads cross PCIe in every
 * micro-batch.  The count is the fewest chunks that make the host's plan
 * fit its RAM and pin limit (a bisection over the count: each chunk on
 * disk takes its state off the host, the bounce sets a fixed amount on).
 * Which ones: spread evenly over the chunks the CPU AdamW updates, so that
 * its reads are spread over its pass and run beside the updates of the
 * chunks in RAM; a chunk larger than the common size (the embedding's)
 * only when every other is on disk already, as its buffers would set the
 * size of every bounce set. */
#include "train_impl.h"
#include "tidal/diskio.h"
#include "tidal/util.h"

#include <string.h>

int td_train_disk_tier(const td_train_config *cfg) { return cfg->mm.n_disk_dirs > 0 || cfg->disk_bytes > 0; }

/* The CPU AdamW's optimizer chunks in chunk order, those of the common size
 * first (*regular of them), then the larger ones; returns the count. */
static int disk_candidates(td_memmgr *mm, const uint8_t *on_gpu, int n, int *cand, int *regular)
{
    int first = td_memmgr_role_chunk(mm, TD_TENSOR_PARAM, 0), c = 0;
    size_t common = 0;
    for (int k = 0; k < n; k++) { /* the common capacity: the most frequent slot size is the layout's own */
        size_t b = td_memmgr_chunk_slot_bytes(mm, first + k);
        if (b < common || !common) common = b;
    }
    for (int pass = 0; pass < 2; pass++) {
        for (int k = 0; k < n; k++) {
            if (on_gpu && on_gpu[k]) continue;
            int big = td_memmgr_chunk_slot_bytes(mm, first + k) > common;
            if (big == pass) cand[c++] = k;
        }
        if (!pass) *regular = c;
    }
    return c;
}

td_status td_train_disk_pick(td_memmgr *mm, const uint8_t *on_gpu, int n, int count, uint8_t *on_disk)
{
    memset(on_disk, 0, (size_t)n);
    if (count <= 0) return TD_OK;
    int *cand = td_malloc(((size_t)n + 1) * sizeof *cand, TD_ROLE_META), regular = 0;
    if (!cand) return TD_ERR_NOMEM;
    int total = disk_candidates(mm, on_gpu, n, cand, &regular);
    if (count > total) count = total;
    int spread = count < regular ? count : regular;
    for (int i = 0; i < spread; i++) /* evenly over the regular chunks, the first at half a step in */
        on_disk[cand[(int)(((double)i + 0.5) * regular / spread)]] = 1;
    for (int i = regular; i < regular + (count - spread); i++) on_disk[cand[i]] = 1;
    td_free(cand);
    return TD_OK;
}

/* The homes the trainer gives (gpu chunks of the slack order on the device,
 * `count` on disk) on the planning manager, and its host plan. */
static td_status plan_with(const td_train_config *cfg, td_memmgr *mm, const int *order, int gpu, size_t budget,
                           int count, uint8_t *on_gpu, uint8_t *on_disk, int n, td_train_plan *p)
{
    td_status st = td_train_disk_pick(mm, on_gpu, n, count, on_disk);
    if (!st) st = td_train_host_homes(mm, order, gpu, on_disk);
    if (!st) st = td_train_host_plan(mm, cfg, budget, p);
    return st;
}

static int host_fits(const td_train_plan *p, size_t ram, size_t pin)
{
    return p->host_bytes <= ram && p->host_pinned_bytes <= pin;
}

td_status td_train_plan_disk(const td_train_config *cfg, td_memmgr *mm, const int *order, int gpu, size_t budget,
                             td_train_plan *p)
{
    td_status st = TD_OK;
    size_t ram = 0, pin = 0;
    char src[160];
    p->disk_chunks = 0;
    p->disk_bytes = 0;
    p->disk_sets = 0;
    p->disk_set_bytes = 0;
    p->disk_read_bytes_per_step = p->disk_write_bytes_per_step = 0;
    p->disk_free_bytes = cfg->disk_bytes;
    if (!cfg->disk_bytes && cfg->mm.n_disk_dirs) { /* striped evenly: the fullest directory sets the room */
        size_t least = SIZE_MAX;
        for (int i = 0; i < cfg->mm.n_disk_dirs; i++) {
            size_t f;
            td_status st = td_dio_dir_free(cfg->mm.disk_dirs[i], &f);
            if (st) return td_error_prefix(st, "--offload-dir: ");
            if (f < least) least = f;
        }
        p->disk_free_bytes = least * (size_t)cfg->mm.n_disk_dirs;
    }
    p->disk_fits = 1;
    if (td_train_host_limits(cfg, &ram, &pin, src, sizeof src)) return TD_OK; /* unknown RAM: nothing to move */
    if (host_fits(p, ram, pin)) return TD_OK;
    int n = td_memmgr_role_chunk_count(mm, TD_TENSOR_PARAM);
    uint8_t *on_gpu = td_calloc(2 * ((size_t)n + 1), 1, TD_ROLE_META), *on_disk = on_gpu ? on_gpu + n + 1 : NULL;
    int *cand = td_malloc(((size_t)n + 1) * sizeof *cand, TD_ROLE_META), regular = 0;
    if (!on_gpu || !cand) TD_FAIL(TD_ERR_NOMEM, "the disk tier's plan of %d chunks", n);
    for (int j = 0; j < gpu && j < n; j++) on_gpu[order[j]] = 1;
    int total = disk_candidates(mm, on_gpu, n, cand, &regular);
    /* The fewest that fit: among the chunks of the common size the host's
     * bytes fall as more go (a bisection); a larger chunk sets the size of
     * every bounce set, so it joins only when those do not suffice, and the
     * fewer of them that fit is taken (or, when nothing fits, the plan that
     * asks the least of the host). */
    int lo = 1, hi = regular > 0 ? regular : total;
    td_train_plan q = *p;
    TD_TRY(plan_with(cfg, mm, order, gpu, budget, hi, on_gpu, on_disk, n, &q));
    if (host_fits(&q, ram, pin)) {
        while (lo < hi) {
            int mid = lo + (hi - lo) / 2;
            q = *p;
            TD_TRY(plan_with(cfg, mm, order, gpu, budget, mid, on_gpu, on_disk, n, &q));
            if (host_fits(&q, ram, pin)) hi = mid;
            else lo = mid + 1;
        }
    } else {
        size_t least = q.host_bytes;
        lo = hi;
        for (int d = hi + 1; d <= total; d++) { /* the larger chunks, one more at a time */
            q = *p;
            TD_TRY(plan_with(cfg, mm, order, gpu, budget, d, on_gpu, on_disk, n, &q));
            if (host_fits(&q, ram, pin)) { lo = d; break; }
            if (q.host_bytes < least) least = q.host_bytes, lo = d;
        }
    }
    TD_TRY(plan_with(cfg, mm, order, gpu, budget, lo, on_gpu, on_disk, n, p));
    size_t role[3], file;
    p->disk_sets = td_memmgr_disk_plan(mm, role, &file);
    p->disk_set_bytes = role[0] + role[1] + role[2];
    p->disk_bytes = file;
    p->disk_chunks = lo;
    p->disk_read_bytes_per_step = p->disk_write_bytes_per_step = (double)file;
    p->disk_fits = !p->disk_free_bytes || file <= p->disk_free_bytes;
cleanup:
    td_free(on_gpu);
    td_free(cand);
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
    if (!disk) p.disk_read_bytes_per_step = p.disk_write_bytes_per_step = 0;
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
    p1.disk_read_bytes_per_step = p1.disk_write_bytes_per_step = 0;
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
