/* The chunk manager: residency, eviction, write-back, prefetch, the warm-up
 * tracer and the plan (see include/tidal/memmgr.h). */
#include "memmgr_impl.h"
#include "tidal/util.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

td_memmgr_params td_memmgr_default_params(void)
{
    return (td_memmgr_params){
        .min_chunk_numel = (size_t)1 << 20,
        .max_chunk_numel = (size_t)64 << 20,
        .placement = TD_PLACEMENT_AUTO,
        .eviction = TD_EVICT_BELADY,
        .prefetch = -1,
        .grad_slots = -1,
    };
}

const char *td_placement_name(td_placement p)
{
    static const char *names[] = {"cuda", "cpu", "static", "auto"};
    return (unsigned)p <= TD_PLACEMENT_AUTO ? names[p] : "unknown";
}

td_status td_placement_parse(const char *name, td_placement *out)
{
    for (int p = 0; p <= TD_PLACEMENT_AUTO; p++)
        if (name && !strcmp(name, td_placement_name((td_placement)p))) { *out = (td_placement)p; return TD_OK; }
    return td_error_set(TD_ERR_INVALID, "unknown policy '%s'; use cuda, cpu, static or auto", name ? name : "");
}

static td_status place_initial(td_memmgr *m);

td_status td_memmgr_plan_layout(td_memmgr *m)
{
    if (m->laid_out || m->n_chunks) return td_error_set(TD_ERR_STATE, "memmgr: layout already made");
    td_status st = mm_layout(m);
    if (st == TD_OK) st = place_initial(m);
    m->gplan_valid = 0;
    return st;
}

td_status td_memmgr_set_chunk_home(td_memmgr *m, int chunk, td_chunk_home home)
{
    if (m->laid_out)
        return td_error_set(TD_ERR_STATE, "memmgr: chunk %d's home is set before td_memmgr_layout allocates the host "
                            "copies by it", chunk);
    if (chunk < 0 || chunk >= m->n_chunks)
        return td_error_set(TD_ERR_INVALID, "memmgr: no chunk %d (%d chunks; td_memmgr_plan_layout first)", chunk,
                            m->n_chunks);
    if (home != TD_HOME_HOST && home != TD_HOME_DEVICE && home != TD_HOME_DISK)
        return td_error_set(TD_ERR_INVALID, "memmgr: chunk %d: bad home %d", chunk, (int)home);
    td_tensor_role role = m->chunks[chunk].role;
    if (home == TD_HOME_DISK && !mm_is_optim_role(role) && role != TD_TENSOR_PARAM && role != TD_TENSOR_GRAD)
        return td_error_set(TD_ERR_INVALID, "memmgr: chunk %d (%s): only optimizer state (master, m, v), params and "
                            "grads are homed on disk", chunk, td_tensor_role_name(role));
    m->chunks[chunk].home = home;
    m->gplan_valid = 0; /* the transient grads follow the optimizer's homes */
    return TD_OK;
}

/* The rule of memmgr.h: only the CPU optimizer's own state is pageable. */
static int wants_pageable(const mm_chunk *ch) { return mm_is_optim_role(ch->role) && ch->home == TD_HOME_HOST; }

int td_memmgr_chunk_pageable(const td_memmgr *m, int c)
{
    return m->laid_out ? m->chunks[c].pageable : wants_pageable(&m->chunks[c]);
}

/* ---- transient grads (params.grad_slots) ------------------------------------ */

/* A grad chunk whose optimizer chunk is homed on the host: its grads go
 * down once a step for the CPU AdamW and nothing else. */
static size_t host_bytes_of(const td_memmgr *m, int c);

static int wants_transient(const td_memmgr *m, const mm_chunk *ch)
{
    if (ch->role != TD_TENSOR_GRAD || m->params.grad_slots <= 0) return 0;
    if (ch->home == TD_HOME_DISK) return 0; /* its host side is the disk tier's slot */
    if (ch->index >= m->role_count[TD_TENSOR_ADAM_M]) return 0;
    /* a rank past a small chunk's end holds none of it: no copy to stage (and no consumer) */
    if (!host_bytes_of(m, (int)(ch - m->chunks))) return 0;
    return m->chunks[m->role_first[TD_TENSOR_ADAM_M] + ch->index].home != TD_HOME_DEVICE; /* the CPU AdamW's */
}

/* The slots the layout gives the transient grads, and their bytes: the
 * size that pins the least, the chunks larger than it (the embedding's)
 * keeping a copy each; none when no size beats a copy for every chunk. */
static int cmp_desc(const void *a, const void *b)
{
    size_t x = *(const size_t *)a, y = *(const size_t *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

static int plan_gslots_now(const td_memmgr *m, size_t *slot_bytes)
{
    int n = 0, S = m->params.grad_slots;
    if (slot_bytes) *slot_bytes = 0;
    if (S <= 0) return 0; /* off (-1, the default, is the trainer's auto: it gives a count or 0) */
    for (int c = 0; c < m->n_chunks; c++) n += wants_transient(m, &m->chunks[c]);
    if (n <= S) return 0;
    size_t *b = td_malloc((size_t)n * sizeof *b, TD_ROLE_META);
    if (!b) return 0; /* a copy each: what it costs is planned too */
    size_t all = 0;
    for (int c = 0, i = 0; c < m->n_chunks; c++)
        if (wants_transient(m, &m->chunks[c])) all += b[i++] = td_align_up(host_bytes_of(m, c), TD_HOSTPOOL_ALIGN);
    qsort(b, (size_t)n, sizeof *b, cmp_desc);
    size_t best = all, above = 0, size = 0;
    for (int i = 0; i + S < n; above += b[i++]) { /* slots of b[i]; b[0..i) keep copies */
        size_t cost = above + (size_t)S * b[i];
        if (cost < best) best = cost, size = b[i];
    }
    td_free(b);
    if (!size) return 0;
    if (slot_bytes) *slot_bytes = size;
    return S;
}

/* The same, computed once per set of homes (a plan asks for every chunk). */
static int plan_gslots(const td_memmgr *m, size_t *slot_bytes)
{
    td_memmgr *w = (td_memmgr *)m; /* the cache only */
    if (!m->gplan_valid) {
        w->gplan_n = plan_gslots_now(m, &w->gplan_bytes);
        w->gplan_valid = 1;
    }
    if (slot_bytes) *slot_bytes = m->gplan_bytes;
    return m->gplan_n;
}

int td_memmgr_grad_slots(const td_memmgr *m, size_t *slot_bytes)
{
    if (m->laid_out) {
        if (slot_bytes) *slot_bytes = m->gslot_bytes;
        return m->n_gslots;
    }
    return plan_gslots(m, slot_bytes);
}

int td_memmgr_chunk_transient(const td_memmgr *m, int c)
{
    if (c < 0 || c >= m->n_chunks) return 0;
    if (m->laid_out) return m->chunks[c].transient;
    size_t size;
    return plan_gslots(m, &size) > 0 && wants_transient(m, &m->chunks[c]) &&
           td_align_up(host_bytes_of(m, c), TD_HOSTPOOL_ALIGN) <= size;
}

/* A transient chunk's host copy, checked: a slot a consumer freed is no
 * longer the chunk's (ch->host NULL then).  With `take`, a chunk without
 * one takes a free slot, waiting for a consumer to free one. */
static td_status host_of(td_memmgr *m, mm_chunk *ch, int take)
{
    if (!ch->transient) return TD_OK;
    int c = (int)(ch - m->chunks);
    double t0 = 0;
    pthread_mutex_lock(&m->gslot_lock);
    if (ch->gslot >= 0 && (m->gslots[ch->gslot].owner != c || m->gslots[ch->gslot].state == MM_GSLOT_FREE)) {
        ch->gslot = -1;
        ch->host = NULL;
    }
    while (take && ch->gslot < 0) {
        int lent = 0;
        for (int i = 0; i < m->n_gslots && ch->gslot < 0; i++) {
            struct mm_gslot *g = &m->gslots[i];
            lent |= g->state == MM_GSLOT_LENT;
            if (g->state != MM_GSLOT_FREE) continue;
            if (g->owner >= 0 && m->chunks[g->owner].gslot == i) { /* its old owner learns now */
                m->chunks[g->owner].gslot = -1;
                m->chunks[g->owner].host = NULL;
            }
            g->owner = c;
            g->state = MM_GSLOT_HELD;
            ch->gslot = i;
            ch->host = g->buf;
        }
        if (ch->gslot >= 0) break;
        if (!lent) {
            pthread_mutex_unlock(&m->gslot_lock);
            return td_error_set(TD_ERR_STATE, "memmgr: grad chunk %d needs a staging slot and all %d are held by "
                                "chunks no consumer has peeked at (transient grads need each chunk's grads to be "
                                "consumed as they arrive: no gradient accumulation, no global norm first; a budget that evicts "
                                "grads before they are whole may need more slots: `tidal train --grad-slots`, "
                                "0 for a host copy each)",
                                c, m->n_gslots);
        }
        if (!t0) t0 = td_now_ms();
        pthread_cond_wait(&m->gslot_freed, &m->gslot_lock);
    }
    pthread_mutex_unlock(&m->gslot_lock);
    if (t0) { /* take: the driving thread's write-back waited for a consumer */
        double t1 = td_now_ms();
        m->stats.slot_wait_ms += t1 - t0;
        /* a diagnostic, as in td_memmgr_access: a track too many does not fail the write-back */
        if (td_memmgr_timeline_host(m, "driving thread", t0, t1, "grad chunk %d waits for a staging slot", c))
            td_error_clear();
    }
    if (!ch->host)
        return td_error_set(TD_ERR_STATE, "memmgr: the host copy of grad chunk %d ('%s', ...) was consumed; it has "
                            "none until its next write-back", c, m->tensors[ch->tensors[0]].name);
    return TD_OK;
}

/* Every tensor of a transient chunk FREE: its grads are spent, the slot too. */
static void drop_spent_slot(td_memmgr *m, mm_chunk *ch)
{
    if (!ch->transient || ch->n_free < ch->n_tensors) return;
    pthread_mutex_lock(&m->gslot_lock);
    if (ch->gslot >= 0 && m->gslots[ch->gslot].owner == (int)(ch - m->chunks) &&
        m->gslots[ch->gslot].state == MM_GSLOT_HELD) {
        m->gslots[ch->gslot].state = MM_GSLOT_FREE;
        pthread_cond_broadcast(&m->gslot_freed);
    }
    pthread_mutex_unlock(&m->gslot_lock);
}

td_status td_memmgr_grad_consumed(td_memmgr *m, const void *host)
{
    if (!m->gslot_sync) return td_error_set(TD_ERR_STATE, "memmgr: grads consumed, but there are no transient grads");
    pthread_mutex_lock(&m->gslot_lock);
    for (int i = 0; i < m->n_gslots; i++)
        if (m->gslots[i].buf == host && m->gslots[i].state == MM_GSLOT_LENT) {
            m->gslots[i].state = MM_GSLOT_FREE;
            pthread_cond_broadcast(&m->gslot_freed);
            pthread_mutex_unlock(&m->gslot_lock);
            return TD_OK;
        }
    pthread_mutex_unlock(&m->gslot_lock);
    return td_error_set(TD_ERR_STATE, "memmgr: grads consumed at %p, which is no staging slot lent to a consumer",
                        host);
}

/* ZeRO-3: every rank's host holds its shard of the optimizer state, the
 * params and the grads; the optimizer state is the shard on the device
 * too, params and grads are whole there (gathered). */
static int optim_sharded(const td_memmgr *m, const mm_chunk *ch)
{
    return m->params.shard_ranks > 1 && mm_is_optim_role(ch->role);
}

static int role_gathered(const td_memmgr *m, td_tensor_role r)
{
    return m->params.shard_ranks > 1 && (r == TD_TENSOR_PARAM || r == TD_TENSOR_GRAD);
}

static int host_sharded(const td_memmgr *m, const mm_chunk *ch)
{
    return optim_sharded(m, ch) || role_gathered(m, ch->role);
}

td_status td_memmgr_chunk_shard(const td_memmgr *m, int c, td_shard_layout *out)
{
    if (c < 0 || c >= m->n_chunks) return td_error_set(TD_ERR_INVALID, "memmgr: no chunk %d (%d chunks)", c, m->n_chunks);
    int ranks = m->params.shard_ranks > 1 ? m->params.shard_ranks : 1;
    return td_shard_layout_make(m->chunks[c].used_numel, ranks, ranks > 1 ? m->params.shard_align : 1, out);
}

size_t td_memmgr_chunk_host_range(const td_memmgr *m, int c, size_t *begin, size_t *end)
{
    const mm_chunk *ch = &m->chunks[c];
    *begin = 0;
    *end = ch->used_numel;
    td_shard_layout l;
    if (host_sharded(m, ch) && td_memmgr_chunk_shard(m, c, &l) == TD_OK)
        td_shard_range(&l, m->params.shard_rank, begin, end);
    return *end - *begin;
}

/* The host copy's bytes: the used elements, or the rank's shard of them. */
static size_t host_bytes_of(const td_memmgr *m, int c)
{
    const mm_chunk *ch = &m->chunks[c];
    size_t b, e, n = td_memmgr_chunk_host_range(m, c, &b, &e);
    size_t (*fmt)(size_t, void *) = m->role_bytes[ch->role];
    (void)b;
    (void)e;
    return fmt ? fmt(n, m->role_ctx[ch->role]) : n * td_dtype_bytes(ch->dtype);
}

td_status td_memmgr_create(td_arena *arena, td_hostpool *pool, td_copy_engine *engine,
                           const td_memmgr_params *params, td_memmgr **out)
{
    *out = NULL;
    td_memmgr_params p = params ? *params : td_memmgr_default_params();
    if (p.offload_param_frac < 0 || p.offload_param_frac > 1 || p.offload_optim_frac < 0 || p.offload_optim_frac > 1)
        return td_error_set(TD_ERR_INVALID, "offload fractions must lie in [0, 1] (got %g and %g)",
                            p.offload_param_frac, p.offload_optim_frac);
    if (p.shard_ranks > 1 && (p.shard_rank < 0 || p.shard_rank >= p.shard_ranks))
        return td_error_set(TD_ERR_INVALID, "memmgr: shard rank %d of %d ranks", p.shard_rank, p.shard_ranks);
    if (p.shard_ranks > 1 && arena && (!p.shard_comm.all_gather || !p.shard_comm.reduce_scatter))
        return td_error_set(TD_ERR_INVALID, "memmgr: %d shards of every param and grad chunk need the collectives "
                            "that join them (td_memmgr_params.shard_comm)", p.shard_ranks);
    td_memmgr *m = td_calloc(1, sizeof *m, TD_ROLE_META);
    if (!m) return TD_ERR_NOMEM;
    m->arena = arena;
    m->pool = pool;
    m->hostmem = p.hostmem;
    m->engine = engine;
    m->backend = engine ? td_copy_backend(engine) : NULL;
    m->params = p;
    m->params.trace_out = NULL;
    m->params.disk_dirs = NULL;
    if (p.trace_out && !(m->params.trace_out = td_strdup(p.trace_out, TD_ROLE_META))) {
        td_free(m);
        return TD_ERR_NOMEM;
    }
    *out = m;
    if (p.n_disk_dirs < 0 || (p.n_disk_dirs && !p.disk_dirs))
        return td_error_set(TD_ERR_INVALID, "memmgr: %d disk directories", p.n_disk_dirs);
    if (p.n_disk_dirs) {
        if (!(m->disk_dirs = td_calloc((size_t)p.n_disk_dirs, sizeof *m->disk_dirs, TD_ROLE_META))) goto nomem;
        for (int i = 0; i < p.n_disk_dirs; i++)
            if (!(m->disk_dirs[i] = td_strdup(p.disk_dirs[i] ? p.disk_dirs[i] : "", TD_ROLE_META))) goto nomem;
        m->params.disk_dirs = (const char *const *)m->disk_dirs;
    }
    return TD_OK;
nomem:
    td_memmgr_destroy(m);
    *out = NULL;
    return TD_ERR_NOMEM;
}

static void release_spares(td_memmgr *m, mm_pool *pool);
static uint64_t next_use_of(td_memmgr *m, int c, uint64_t last_use);

void td_memmgr_destroy(td_memmgr *m)
{
    if (!m) return;
    mm_tl_close(m);
    mm_disk_free(m); /* its I/O ended before the sets' buffers go back */
    if (m->engine) {
        td_copy_drain(m->engine);
        td_queue_sync(m->backend, TD_QUEUE_COMPUTE);
    }
    for (int i = 0; m->backend && i < 2 * MM_MEASURE_LOADS; i++) td_event_free(m->backend, m->measure.ev[i]);
    for (int i = 0; m->backend && i < 2; i++) td_event_free(m->backend, m->measure.step_ev[i]);
    for (int c = 0; c < m->n_chunks; c++) {
        mm_chunk *ch = &m->chunks[c];
        if (ch->dev) td_slot_release(ch->pool->slots, ch->dev);
        if (ch->transient) continue; /* a staging slot, below */
        if (ch->host && ch->pageable) td_hostmem_release(m->hostmem, ch->host);
        else if (ch->host) td_hostpool_release(m->pool, ch->host);
    }
    for (int i = 0; m->gslots && i < m->n_gslots; i++) /* a layout that failed may have counted them only */
        if (m->gslots[i].buf) td_hostpool_release(m->pool, m->gslots[i].buf);
    td_free(m->gslots);
    if (m->gslot_sync) {
        pthread_cond_destroy(&m->gslot_freed);
        pthread_mutex_destroy(&m->gslot_lock);
    }
    if (m->own_hostmem) td_hostmem_destroy(m->hostmem);
    for (int i = 0; i < m->n_pools; i++) {
        release_spares(m, &m->pools[i]);
        td_free(m->pools[i].spare);
        td_slot_pool_destroy(m->pools[i].slots);
    }
    td_free(m->pools);
    for (int i = 0; i < m->n_tensors; i++) td_free(m->tensors[i].name);
    td_free(m->tensors);
    if (m->chunks && m->n_chunks) td_free(m->chunks[0].tensors); /* one array for all chunks */
    td_free(m->chunks);
    td_free(m->trace_seq);
    td_free(m->trace_write);
    td_free(m->trace_nonmodel);
    td_free(m->trace_nm_peak);
    td_nextuse_destroy(m->nextuse);
    td_evictor_destroy(m->evictor);
    td_free((char *)m->params.trace_out);
    for (int i = 0; m->disk_dirs && i < m->params.n_disk_dirs; i++) td_free(m->disk_dirs[i]);
    td_free(m->disk_dirs);
    td_free(m->optim_homes);
    td_free(m);
}

/* ---- placement -------------------------------------------------------------- */


td_status td_memmgr_set_optim_homes(td_memmgr *m, const uint8_t *on_device, int n)
{
    if (m->n_chunks) return td_error_set(TD_ERR_STATE, "memmgr: optimizer homes are set before the layout");
    if (n < 0 || (n && !on_device)) return td_error_set(TD_ERR_INVALID, "memmgr: %d optimizer homes", n);
    uint8_t *h = td_malloc((size_t)n + 1, TD_ROLE_META);
    if (!h) return TD_ERR_NOMEM;
    if (n) memcpy(h, on_device, (size_t)n);
    td_free(m->optim_homes);
    m->optim_homes = h;
    m->n_optim_homes = n;
    return TD_OK;
}

/* Homes before the warm-up: every policy but AUTO decides here for good;
 * the optimizer chunks' homes given by td_memmgr_set_optim_homes are final
 * under every policy (with their param and grad chunks on the device too). */
static td_status place_initial(td_memmgr *m)
{
    int n_optim = m->role_count[TD_TENSOR_ADAM_M];
    if (m->optim_homes && m->n_optim_homes != n_optim)
        return td_error_set(TD_ERR_INVALID, "memmgr: optimizer homes for %d chunks, but the layout made %d",
                            m->n_optim_homes, n_optim);
    for (int c = 0; c < m->n_chunks; c++) {
        mm_chunk *ch = &m->chunks[c];
        td_chunk_home home = TD_HOME_HOST;
        switch (m->params.placement) {
        case TD_PLACEMENT_CUDA: home = TD_HOME_DEVICE; break;
        case TD_PLACEMENT_CPU: home = TD_HOME_HOST; break;
        case TD_PLACEMENT_AUTO: home = TD_HOME_HOST; break; /* decided after the warm-up */
        case TD_PLACEMENT_STATIC: {
            /* The last fraction of each role's list is offloaded: the first
             * blocks stay resident, so a step starts without waiting. */
            double frac = mm_is_optim_role(ch->role) ? m->params.offload_optim_frac : m->params.offload_param_frac;
            int count = m->role_count[ch->role];
            int keep = count - (int)(frac * count + 0.5);
            home = ch->index < keep ? TD_HOME_DEVICE : TD_HOME_HOST;
            break;
        }
        }
        if (m->optim_homes && ch->index < n_optim) {
            int h = m->optim_homes[ch->index], o = h & 3;
            if (mm_is_optim_role(ch->role)) home = o == TD_HOME_DEVICE ? TD_HOME_DEVICE : o == TD_HOME_DISK ? TD_HOME_DISK
                                                                                                       : TD_HOME_HOST;
            else if (o == TD_HOME_DEVICE && (ch->role == TD_TENSOR_PARAM || ch->role == TD_TENSOR_GRAD))
                home = TD_HOME_DEVICE;
            else if (o != TD_HOME_DEVICE &&
                     ((ch->role == TD_TENSOR_PARAM && (h & TD_OPTIM_HOME_PARAM_DISK)) ||
                      (ch->role == TD_TENSOR_GRAD && (h & TD_OPTIM_HOME_GRAD_DISK))))
                home = TD_HOME_DISK;
        }
        ch->home = home;
    }
    return TD_OK;
}

td_status td_memmgr_layout(td_memmgr *m)
{
    td_status st = TD_OK;
    if (m->laid_out) return td_error_set(TD_ERR_STATE, "memmgr: layout already made");
    if (!m->pool) return td_error_set(TD_ERR_STATE, "memmgr: a planning manager (no pool) only plans layouts");
    if (!m->n_chunks) { /* else td_memmgr_plan_layout made it, and homes may have been set since */
        TD_TRY(mm_layout(m));
        TD_TRY(place_initial(m));
        m->gplan_valid = 0;
    }
    if (!m->hostmem) {
        TD_TRY(td_hostmem_create(NULL, &m->hostmem));
        m->own_hostmem = 1;
    }
    uint64_t *bytes = td_malloc((size_t)m->n_chunks * sizeof *bytes, TD_ROLE_META);
    if (!bytes) { st = TD_ERR_NOMEM; goto cleanup; }
    for (int c = 0; c < m->n_chunks; c++) bytes[c] = m->chunks[c].bytes;
    st = td_evictor_create(TD_EVICT_LRU, (uint32_t)m->n_chunks, bytes, &m->evictor); /* no future known yet */
    td_free(bytes);
    if (st) goto cleanup;
    for (int i = 0; i < 2 * MM_MEASURE_LOADS; i++) TD_TRY(td_event_create(m->backend, &m->measure.ev[i]));
    for (int i = 0; i < 2; i++) TD_TRY(td_event_create(m->backend, &m->measure.step_ev[i]));
    m->n_gslots = plan_gslots(m, &m->gslot_bytes); /* the homes are final now */
    for (int c = 0; c < m->n_chunks; c++) {
        mm_chunk *ch = &m->chunks[c];
        td_role role = mm_is_optim_role(ch->role) ? TD_ROLE_OPTIM : TD_ROLE_CHUNK;
        ch->host_bytes = host_bytes_of(m, c); /* the homes are final now: a shard or the whole */
        size_t hb, he;
        td_memmgr_chunk_host_range(m, c, &hb, &he);
        ch->host_begin = hb;
        ch->gathered = role_gathered(m, ch->role);
        td_shard_layout sl;
        if (ch->gathered) {
            TD_TRY(td_memmgr_chunk_shard(m, c, &sl));
            ch->shard_numel = sl.shard_numel;
        }
        ch->gslot = -1;
        if (m->n_gslots && wants_transient(m, ch) && td_align_up(ch->host_bytes, TD_HOSTPOOL_ALIGN) <= m->gslot_bytes) {
            ch->transient = 1; /* its host copy: a staging slot, lent at its write-back */
        } else if (ch->home == TD_HOME_DISK) {
            /* no host copy: a place in the scratch file and a slot when used (mm_disk_setup) */
        } else if (wants_pageable(ch)) {
            /* Zero pages, untouched: the AdamW thread that updates a page
             * touches it first (NUMA first touch inside the local nodes). */
            size_t hb = ch->host_bytes ? ch->host_bytes : 1; /* a rank past a small chunk's end holds none of it */
            TD_TRY(td_hostmem_alloc(m->hostmem, hb, role, &ch->host));
            ch->pageable = 1;
            m->stats.host_pageable_bytes += td_hostmem_round(hb);
        } else { /* a rank past a small chunk's end holds none of it: a byte stands in */
            TD_TRY(td_hostpool_alloc(m->pool, ch->host_bytes ? ch->host_bytes : 1, role, &ch->host));
            memset(ch->host, 0, ch->host_bytes);
            m->stats.host_chunk_bytes += ch->host_bytes;
        }
    }
    if (m->n_gslots) {
        m->gslots = td_calloc((size_t)m->n_gslots, sizeof *m->gslots, TD_ROLE_META);
        if (!m->gslots) TD_FAIL(TD_ERR_NOMEM, "memmgr: out of memory for %d staging slots", m->n_gslots);
        pthread_mutex_init(&m->gslot_lock, NULL);
        pthread_cond_init(&m->gslot_freed, NULL);
        m->gslot_sync = 1;
        for (int i = 0; i < m->n_gslots; i++) {
            m->gslots[i].owner = -1;
            TD_TRY(td_hostpool_alloc(m->pool, m->gslot_bytes, TD_ROLE_STAGING, &m->gslots[i].buf));
            memset(m->gslots[i].buf, 0, m->gslot_bytes);
        }
    }
    TD_TRY(mm_disk_setup(m));
    m->laid_out = 1;
    return TD_OK;
cleanup:
    return st; /* td_memmgr_destroy frees what was taken */
}

/* ---- device slots --------------------------------------------------------- */

static td_status pool_for(td_memmgr *m, mm_chunk *ch, mm_pool **out)
{
    for (int i = 0; i < m->n_pools; i++)
        if (m->pools[i].bytes == ch->bytes) { *out = &m->pools[i]; return TD_OK; }
    mm_pool *grown = td_malloc((size_t)(m->n_pools + 1) * sizeof *grown, TD_ROLE_META);
    if (!grown) return TD_ERR_NOMEM;
    if (m->n_pools) memcpy(grown, m->pools, (size_t)m->n_pools * sizeof *grown);
    mm_pool *p = &grown[m->n_pools];
    *p = (mm_pool){ .bytes = ch->bytes };
    td_status st = td_slot_pool_create(m->arena, ch->bytes, TD_ROLE_CHUNK, &p->slots);
    if (st) { td_free(grown); return st; }
    /* Chunks point at their pool: re-aim them at the moved array. */
    for (int c = 0; c < m->n_chunks; c++)
        if (m->chunks[c].pool) m->chunks[c].pool = grown + (m->chunks[c].pool - m->pools);
    td_free(m->pools);
    m->pools = grown;
    *out = &m->pools[m->n_pools++];
    return TD_OK;
}

static td_status push_spare(mm_pool *p, void *ptr, td_copy_ticket fence)
{
    if (p->n_spare == p->cap_spare) {
        int cap = p->cap_spare ? 2 * p->cap_spare : 16;
        mm_spare *grown = td_malloc((size_t)cap * sizeof *grown, TD_ROLE_META);
        if (!grown) return TD_ERR_NOMEM;
        if (p->n_spare) memcpy(grown, p->spare, (size_t)p->n_spare * sizeof *grown);
        td_free(p->spare);
        p->spare = grown;
        p->cap_spare = cap;
    }
    p->spare[p->n_spare++] = (mm_spare){ ptr, fence };
    return TD_OK;
}

/* Spare slots go back to the arena.  The compute queue (the only other user
 * of arena memory) waits for their fences, and whatever is later carved from
 * that memory waits for trim_fence. */
static void release_spares(td_memmgr *m, mm_pool *pool)
{
    if (!pool->n_spare) return;
    while (pool->n_spare) {
        mm_spare *s = &pool->spare[--pool->n_spare];
        td_copy_order(m->engine, TD_QUEUE_COMPUTE, &s->fence);
        td_slot_release(pool->slots, s->ptr);
    }
    td_slot_pool_trim(pool->slots);
    td_copy_mark(m->engine, TD_QUEUE_COMPUTE, &m->trim_fence);
}

static void release_all_spares(td_memmgr *m)
{
    for (int i = 0; i < m->n_pools; i++) release_spares(m, &m->pools[i]);
}

static int chunk_dirty(const mm_chunk *ch)
{
    /* FREE tensors hold no payload: a chunk of only FREE tensors is never written back. */
    return ch->dev && ch->dev_ver > ch->host_ver && ch->n_free < ch->n_tensors;
}

/* ---- gathered chunks (ZeRO-3: memmgr.h, shard_ranks) ---------------------- */

/* Bytes from a gathered chunk's slot start to element e. */
static size_t elem_bytes(const mm_chunk *ch, size_t e) { return e * td_dtype_bytes(ch->dtype); }

/* Zeroes the slot outside this rank's shard, on queue q. */
static td_status zero_others(td_memmgr *m, mm_chunk *ch, td_queue q)
{
    size_t n = ch->host_bytes / td_dtype_bytes(ch->dtype), end = ch->host_begin + n;
    size_t padded = ch->shard_numel * (size_t)m->params.shard_ranks;
    td_status st = TD_OK;
    if (ch->host_begin) st = td_backend_memset_async(m->backend, q, ch->dev, 0, elem_bytes(ch, ch->host_begin));
    if (!st && end < padded)
        st = td_backend_memset_async(m->backend, q, (char *)ch->dev + elem_bytes(ch, end), 0, elem_bytes(ch, padded - end));
    return st;
}

/* Work just queued on q wrote the device copy: its next access, a
 * write-back and the slot's next owner wait for it. */
static td_status written_by(td_memmgr *m, mm_chunk *ch, td_queue q)
{
    td_copy_ticket t;
    td_status st = td_copy_mark(m->engine, q, &t);
    if (st) return st;
    ch->load = t;
    ch->fence = t;
    return TD_OK;
}

/* The other ranks' shards of a param chunk whose own shard is current on
 * the device: all-gathered in place on the H2D queue, after the chunk's
 * load and last use. */
static td_status gather(td_memmgr *m, mm_chunk *ch)
{
    td_status st;
    if ((st = td_copy_order(m->engine, TD_QUEUE_H2D, &ch->load)) ||
        (st = td_copy_order(m->engine, TD_QUEUE_H2D, &ch->writeback)) ||
        (st = td_copy_order(m->engine, TD_QUEUE_H2D, &ch->fence)))
        return st;
    td_memmgr_comm *c = &m->params.shard_comm;
    if ((st = c->all_gather(c->ctx, ch->dev, ch->shard_numel, ch->dtype, TD_QUEUE_H2D)))
        return td_error_prefix(st, "memmgr: gathering param chunk %d: ", (int)(ch - m->chunks));
    ch->partial = 0;
    m->stats.gathers++;
    m->stats.bytes_gathered += elem_bytes(ch, ch->shard_numel * (size_t)(m->params.shard_ranks - 1));
    return written_by(m, ch, TD_QUEUE_H2D);
}

/* A grad chunk's contributions summed over the ranks into each shard's
 * owner, in place on the D2H queue after its last use; the other shards
 * zeroed, so that grads added later are counted once. */
static td_status reduce(td_memmgr *m, mm_chunk *ch)
{
    td_status st;
    if ((st = td_copy_order(m->engine, TD_QUEUE_D2H, &ch->load)) ||
        (st = td_copy_order(m->engine, TD_QUEUE_D2H, &ch->fence)))
        return st;
    td_memmgr_comm *c = &m->params.shard_comm;
    if ((st = c->reduce_scatter(c->ctx, ch->dev, ch->shard_numel, ch->dtype, TD_QUEUE_D2H)))
        return td_error_prefix(st, "memmgr: reducing grad chunk %d: ", (int)(ch - m->chunks));
    if ((st = zero_others(m, ch, TD_QUEUE_D2H))) return st;
    ch->unreduced = 0;
    m->stats.reduce_scatters++;
    m->stats.bytes_reduced += elem_bytes(ch, ch->shard_numel * (size_t)(m->params.shard_ranks - 1));
    return written_by(m, ch, TD_QUEUE_D2H);
}

/* After the load of a gathered chunk's shard (on the H2D queue): a param
 * chunk's other shards from their owners, a grad chunk's zeroed (the sums
 * of the other shards are their owners'). */
static td_status complete_load(td_memmgr *m, mm_chunk *ch)
{
    if (ch->role == TD_TENSOR_PARAM) return gather(m, ch);
    td_status st = zero_others(m, ch, TD_QUEUE_H2D);
    ch->unreduced = 0;
    return st ? st : written_by(m, ch, TD_QUEUE_H2D);
}

static td_status start_writeback(td_memmgr *m, mm_chunk *ch)
{
    td_event *e0, *e1;
    int tl_index;
    void *host = ch->host;
    td_status st = ch->on_disk ? mm_disk_copy_begin(m, ch, 1, &host) : host_of(m, ch, 1);
    if (st) return st;
    if (!ch->on_disk) host = ch->host;
    if (ch->gathered && ch->unreduced && (st = reduce(m, ch))) {
        if (ch->on_disk) mm_disk_copy_end(m, ch, NULL);
        return st;
    }
    mm_tl_copy_events(m, &e0, &e1, &tl_index);
    st = td_copy_submit_timed(m->engine, TD_COPY_D2H, host, (char *)ch->dev + elem_bytes(ch, ch->gathered ? ch->host_begin : 0),
                              ch->host_bytes, &ch->fence, e0, e1, &ch->writeback);
    if (ch->on_disk) mm_disk_copy_end(m, ch, st ? NULL : &ch->writeback); /* its slot: written once this lands */
    if (st) return st;
    mm_tl_copy(m, MM_TL_WRITEBACK, (int)(ch - m->chunks), tl_index);
    ch->host_ver = ch->dev_ver;
    ch->fence = ch->writeback;
    m->stats.writebacks++;
    m->stats.bytes_d2h += ch->host_bytes;
    return TD_OK;
}

/* Gives up the device copy (writing it back first if it is dirty); the slot
 * becomes a spare of its pool, fenced by the chunk's last use. */
static td_status evict(td_memmgr *m, mm_chunk *ch)
{
    td_status st;
    if (chunk_dirty(ch) && (st = start_writeback(m, ch))) return st;
    if ((st = push_spare(ch->pool, ch->dev, ch->fence))) return st;
    td_evictor_remove(m->evictor, (uint32_t)(ch - m->chunks));
    ch->dev = NULL;
    ch->dev_ver = ch->host_ver;
    ch->partial = ch->unreduced = 0; /* what the next load brings is whole */
    m->stats.evictions++;
    mm_tl_instant(m, MM_TL_EVICT, (int)(ch - m->chunks), 0);
    return TD_OK;
}

static size_t nonmodel_bytes(td_memmgr *m)
{
    td_arena_stats s;
    td_arena_get_stats(m->arena, &s);
    return s.used_bytes - s.used[TD_ROLE_CHUNK] - s.used[TD_ROLE_OPTIM];
}

static td_status budget_error(td_memmgr *m, mm_chunk *ch, uint64_t min_next_use)
{
    char need[32], budget[32], held[512];
    td_arena_describe(m->arena, held, sizeof held);
    td_arena_stats s;
    td_arena_get_stats(m->arena, &s);
    size_t pinned = 0;
    int n_pinned = 0;
    for (int c = 0; c < m->n_chunks; c++)
        if (m->chunks[c].dev && (m->chunks[c].pins || m->chunks[c].home == TD_HOME_DEVICE)) {
            pinned += m->chunks[c].bytes;
            n_pinned++;
        }
    char p[32], nm[32], min[32];
    size_t minimum = pinned + ch->bytes + nonmodel_bytes(m);
    if (minimum <= s.budget_bytes) /* enough bytes, but split: room for one more chunk avoids it */
        minimum = s.budget_bytes + ch->bytes;
    return td_error_set(TD_ERR_BUDGET,
                        "memmgr: no room for chunk %d (%s %s #%d, %s)%s: %d chunks in use or homed on the device "
                        "hold %s, non-model buffers %s; %s; this access needs a budget of at least %s "
                        "(--gpu-budget %s is too small), or offload more (--policy cpu) or lower --micro-batch",
                        (int)(ch - m->chunks), td_dtype_name(ch->dtype), td_tensor_role_name(ch->role), ch->index,
                        td_format_bytes(ch->bytes, need, sizeof need),
                        min_next_use ? " without evicting a chunk needed sooner" : "", n_pinned,
                        td_format_bytes(pinned, p, sizeof p), td_format_bytes(nonmodel_bytes(m), nm, sizeof nm), held,
                        td_format_bytes(minimum, min, sizeof min), td_format_bytes(s.budget_bytes, budget, sizeof budget));
}

/* When every host-homed chunk is pinned or gone and the arena is still too
 * full (or too fragmented), a device-homed chunk not in use may leave: home
 * is the plan's preference, not a pin; it comes back at its next use.  The
 * one needed last goes. */
static int64_t device_homed_victim(td_memmgr *m)
{
    int64_t best = -1;
    uint64_t best_next = 0;
    for (int c = 0; c < m->n_chunks; c++) {
        mm_chunk *ch = &m->chunks[c];
        if (!ch->dev || ch->pins || ch->home != TD_HOME_DEVICE) continue;
        uint64_t next = next_use_of(m, c, ch->last_use);
        if (best < 0 || next > best_next) { best = c; best_next = next; }
    }
    return best;
}

/* A device slot for `ch`, evicting what the policy gives up.  `after`: the
 * ticket the slot's previous user left.  With min_next_use > 0 (prefetch),
 * only chunks needed later than that may go, and failure is quiet. */
static td_status get_slot(td_memmgr *m, mm_chunk *ch, uint64_t min_next_use, void **ptr, td_copy_ticket *after)
{
    td_status st;
    if (!ch->pool && (st = pool_for(m, ch, &ch->pool))) return st;
    mm_pool *pool = ch->pool;
    for (;;) {
        if (pool->n_spare) {
            mm_spare s = pool->spare[--pool->n_spare];
            *ptr = s.ptr;
            *after = s.fence;
            return TD_OK;
        }
        st = td_slot_acquire(pool->slots, ptr);
        if (st == TD_OK) {
            *after = m->trim_fence;
            return TD_OK;
        }
        if (st != TD_ERR_BUDGET) return st;
        /* Spares of other sizes are free room first; then a victim. */
        int had_spares = 0;
        for (int i = 0; i < m->n_pools; i++) had_spares |= m->pools[i].n_spare > 0;
        if (had_spares) {
            release_all_spares(m);
            continue;
        }
        int64_t v = td_evictor_pick(m->evictor, min_next_use);
        if (v < 0 && min_next_use) return TD_ERR_BUDGET; /* a prefetch that does not fit: no message needed */
        if (v < 0) v = device_homed_victim(m);
        if (v < 0) return budget_error(m, ch, min_next_use);
        if ((st = evict(m, &m->chunks[v]))) return st;
    }
}

/* A load's size for the prefetch window: what it moves, or under sharding
 * the device slot's bytes, which every rank shares (the window must be
 * every rank's; a rank's shard of a small chunk may be empty). */
static size_t load_bytes(const td_memmgr *m, const mm_chunk *ch)
{
    return m->params.shard_ranks > 1 ? ch->bytes : ch->host_bytes;
}

/* Makes the device copy current: a load (H2D) into a new slot or over a
 * stale one, or zeros for a chunk of only FREE tensors. */
static td_status materialize(td_memmgr *m, mm_chunk *ch, uint64_t min_next_use, int prefetch)
{
    td_status st;
    ch->partial = ch->unreduced = 0; /* whatever the slot held is replaced */
    td_copy_ticket after = {0};
    if (!ch->dev) {
        void *ptr;
        if ((st = get_slot(m, ch, min_next_use, &ptr, &after))) return st;
        ch->dev = ptr;
    } else {
        after = ch->fence; /* stale in place: overwrite after its last use */
    }
    if (ch->n_free == ch->n_tensors) {
        if ((st = td_copy_order(m->engine, TD_QUEUE_COMPUTE, &after))) return st;
        if ((st = td_backend_memset_async(m->backend, TD_QUEUE_COMPUTE, ch->dev, 0, ch->bytes))) return st;
        if ((st = td_copy_mark(m->engine, TD_QUEUE_COMPUTE, &ch->fence))) return st;
        ch->load = ch->fence;
        ch->dev_ver = (ch->host_ver > ch->dev_ver ? ch->host_ver : ch->dev_ver) + 1;
        return TD_OK;
    }
    void *host = ch->host;
    if (ch->on_disk) { /* its bytes from disk into its slot (read ahead, or now) */
        if (prefetch && !mm_disk_chunk_ready(m, ch))
            return td_error_set(TD_ERR_STATE, "memmgr: chunk %d's read from disk has not landed", (int)(ch - m->chunks));
        if ((st = mm_disk_copy_begin(m, ch, 0, &host))) return st;
    } else if ((st = host_of(m, ch, 0))) {
        return st;
    } else {
        host = ch->host;
    }
    /* The host copy may still be arriving from this chunk's own write-back. */
    if ((st = td_copy_order(m->engine, TD_QUEUE_H2D, &ch->writeback))) {
        if (ch->on_disk) mm_disk_copy_end(m, ch, NULL);
        return st;
    }
    td_event *e0 = NULL, *e1 = NULL;
    int tl_index = -1;
    mm_measure *ms = &m->measure;
    if (!m->warmed_up && m->in_step && !prefetch && ms->n < MM_MEASURE_LOADS && ms->ev[0]) {
        e0 = ms->ev[2 * ms->n];
        e1 = ms->ev[2 * ms->n + 1];
        ms->bytes[ms->n++] = load_bytes(m, ch);
    } else {
        mm_tl_copy_events(m, &e0, &e1, &tl_index);
    }
    void *dst = (char *)ch->dev + elem_bytes(ch, ch->gathered ? ch->host_begin : 0);
    /* a gathered chunk's load ends with its gather: timed to there (the prefetch window counts it) */
    st = td_copy_submit_timed(m->engine, TD_COPY_H2D, dst, host, ch->host_bytes, &after, e0, ch->gathered ? NULL : e1,
                              &ch->load);
    if (ch->on_disk) mm_disk_copy_end(m, ch, st ? NULL : &ch->load); /* its slot is kept until the upload lands */
    if (st) return st;
    mm_tl_copy(m, MM_TL_LOAD, (int)(ch - m->chunks), tl_index);
    ch->fence = ch->load;
    if (ch->gathered) {
        if ((st = complete_load(m, ch))) return st;
        if (e1 && (st = td_event_record(m->backend, e1, TD_QUEUE_H2D))) return st;
    }
    ch->dev_ver = ch->host_ver;
    m->stats.loads++;
    m->stats.bytes_h2d += ch->host_bytes;
    if (prefetch) m->stats.prefetches++;
    else m->stats.demand_loads++;
    return TD_OK;
}

static int needs_load(const mm_chunk *ch) { return !ch->dev || ch->host_ver > ch->dev_ver; }

/* ---- positions, tracer and plan ----------------------------------------- */

static uint64_t next_use_of(td_memmgr *m, int c, uint64_t last_use)
{
    if (!m->nextuse) return TD_NEXTUSE_NEVER;
    if (!m->off_trace && td_nextuse_valid(m->nextuse, last_use) &&
        td_nextuse_chunk_at(m->nextuse, last_use) == (uint32_t)c)
        return td_nextuse_after(m->nextuse, last_use);
    return td_nextuse_of(m->nextuse, (uint32_t)c, m->pos);
}

static void offer(td_memmgr *m, int c)
{
    mm_chunk *ch = &m->chunks[c];
    if (!ch->dev || ch->pins || ch->home == TD_HOME_DEVICE) {
        td_evictor_remove(m->evictor, (uint32_t)c);
        return;
    }
    td_evictor_update(m->evictor, (uint32_t)c, ch->last_use, next_use_of(m, c, ch->last_use), chunk_dirty(ch));
}

static td_status trace_record(td_memmgr *m, int c, int write, size_t pinned_bytes)
{
    if (m->trace_len == m->trace_cap) {
        size_t cap = m->trace_cap ? 2 * m->trace_cap : 1024;
        uint32_t *seq = td_malloc(cap * sizeof *seq, TD_ROLE_META);
        uint8_t *wr = td_malloc(cap, TD_ROLE_META);
        uint64_t *nm = td_malloc(cap * sizeof *nm, TD_ROLE_META);
        uint64_t *pk = td_malloc(cap * sizeof *pk, TD_ROLE_META);
        if (!seq || !wr || !nm || !pk) {
            td_free(seq); td_free(wr); td_free(nm); td_free(pk);
            return TD_ERR_NOMEM;
        }
        if (m->trace_len) {
            memcpy(seq, m->trace_seq, m->trace_len * sizeof *seq);
            memcpy(wr, m->trace_write, m->trace_len);
            memcpy(nm, m->trace_nonmodel, m->trace_len * sizeof *nm);
            memcpy(pk, m->trace_nm_peak, m->trace_len * sizeof *pk);
        }
        td_free(m->trace_seq); td_free(m->trace_write); td_free(m->trace_nonmodel); td_free(m->trace_nm_peak);
        m->trace_seq = seq; m->trace_write = wr; m->trace_nonmodel = nm; m->trace_nm_peak = pk;
        m->trace_cap = cap;
    }
    size_t nonmodel = nonmodel_bytes(m);
    m->trace_seq[m->trace_len] = (uint32_t)c;
    m->trace_write[m->trace_len] = (uint8_t)write;
    m->trace_nonmodel[m->trace_len] = nonmodel;
    m->trace_nm_peak[m->trace_len] = m->nm_peak_since > nonmodel ? m->nm_peak_since : nonmodel;
    m->nm_peak_since = nonmodel;
    m->trace_len++;
    m->chunks[c].accesses++;
    if (pinned_bytes + nonmodel > m->min_budget) m->min_budget = pinned_bytes + nonmodel;
    return TD_OK;
}

/* Moves the cursor past chunk c's access; leaves the recorded order if the
 * run does (then next uses come from "first use at or after now"). */
static void advance(td_memmgr *m, int c)
{
    if (!m->nextuse || m->off_trace) { m->pos++; return; }
    if (td_nextuse_chunk_at(m->nextuse, m->pos) == (uint32_t)c) { m->pos++; return; }
    m->off_trace = 1;
    m->pos++;
}

td_status td_memmgr_step_begin(td_memmgr *m)
{
    if (!m->laid_out) return td_error_set(TD_ERR_STATE, "memmgr: step begun before td_memmgr_layout");
    if (m->in_step) return td_error_set(TD_ERR_STATE, "memmgr: step %llu begun twice", (unsigned long long)m->step);
    m->in_step = 1;
    m->off_trace = 0;
    if (m->disk) mm_disk_release_held(m); /* the sets a host access kept go back to the AdamW */
    /* Step k covers positions [k * len, (k + 1) * len); step 0 is the warm-up. */
    m->pos = m->warmed_up ? m->step * m->trace_len : 0;
    td_memmgr_get_stats(m, &m->step_start); /* also folds the arena's peak into the run's */
    td_arena_reset_peak(m->arena);          /* per-step peaks from here */
    td_status st;
    if (!m->warmed_up && m->measure.step_ev[0] &&
        (st = td_event_record(m->backend, m->measure.step_ev[0], TD_QUEUE_COMPUTE)))
        return st;
    return mm_tl_step_begin(m);
}

/* Warm-up timing: load time per MiB from the timed demand loads, and
 * compute time per access from the step's span on the compute queue. */
static td_status measure_warmup(td_memmgr *m)
{
    mm_measure *ms = &m->measure;
    td_status st;
    if (!ms->step_ev[0]) return TD_OK;
    if ((st = td_event_record(m->backend, ms->step_ev[1], TD_QUEUE_COMPUTE))) return st;
    if ((st = td_event_sync(m->backend, ms->step_ev[1]))) return st;
    float step_ms = 0;
    if ((st = td_event_elapsed_ms(m->backend, ms->step_ev[0], ms->step_ev[1], &step_ms))) return st;
    ms->step_ms = step_ms;
    double load_ms = 0, mib = 0;
    for (int i = 0; i < ms->n; i++) {
        float ms_i = 0;
        if ((st = td_event_sync(m->backend, ms->ev[2 * i + 1]))) return st;
        if ((st = td_event_elapsed_ms(m->backend, ms->ev[2 * i], ms->ev[2 * i + 1], &ms_i))) return st;
        load_ms += ms_i;
        mib += (double)ms->bytes[i] / (double)TD_MiB;
    }
    ms->load_ms_per_mib = mib > 0 ? load_ms / mib : 0;
    return TD_OK;
}

/* Prefetch far enough ahead that a load (at the measured rate) finishes
 * within the compute of the accesses before its use: window = ceil(load
 * time of an average chunk / compute time per access) + 1, in [1, 64].  The
 * free budget bounds it too: a prefetch never evicts a chunk needed sooner.
 * On the cpu backend the window is MM_PREFETCH_DEFAULT, not measured: its
 * copies are memcpys whose rate says nothing of a GPU's, and a window from
 * the machine's load of the moment would make the chunk schedule, and with
 * it the bits, differ from run to run (under ZeRO-3 a grad chunk evicted
 * between micro-batches is reduce-scattered then accumulated into, summing
 * its terms in another order than one reduce-scattered once). */
#define MM_PREFETCH_DEFAULT 4
static int prefetch_window(td_memmgr *m)
{
    if (m->params.prefetch >= 0) return m->params.prefetch;
    if (m->backend && td_backend_get_kind(m->backend) == TD_BACKEND_CPU) return MM_PREFETCH_DEFAULT;
    const mm_measure *ms = &m->measure;
    if (m->trace_len == 0 || ms->step_ms <= 0 || ms->load_ms_per_mib <= 0) return MM_PREFETCH_DEFAULT;
    double bytes = 0;
    for (size_t i = 0; i < m->trace_len; i++) bytes += (double)load_bytes(m, &m->chunks[m->trace_seq[i]]);
    double chunk_load_ms = ms->load_ms_per_mib * bytes / (double)m->trace_len / (double)TD_MiB;
    double access_ms = ms->step_ms / (double)m->trace_len;
    double w = access_ms > 0 ? chunk_load_ms / access_ms + 1.0 : 64.0;
    if (w < 1) w = 1;
    if (w > 64) w = 64;
    return (int)(w + 0.999);
}

static td_status write_trace(td_memmgr *m)
{
    td_trace_writer *w = NULL;
    td_status st = td_trace_writer_open(m->params.trace_out, &w);
    if (st) return st;
    st = td_trace_writer_comment(w, "warm-up step recorded by tidal's chunk manager");
    for (int c = 0; st == TD_OK && c < m->n_chunks; c++) st = td_trace_writer_chunk(w, (uint32_t)c, m->chunks[c].bytes);
    if (st == TD_OK) st = td_trace_writer_step(w);
    uint64_t last_nm = 0;
    for (size_t i = 0; st == TD_OK && i < m->trace_len; i++) {
        /* A spike between accesses (logits, say) as a peak then the level. */
        if (m->trace_nm_peak[i] > m->trace_nonmodel[i] && m->trace_nm_peak[i] != last_nm) {
            st = td_trace_writer_nonmodel(w, m->trace_nm_peak[i]);
            last_nm = m->trace_nm_peak[i];
        }
        if (st == TD_OK && m->trace_nonmodel[i] != last_nm) {
            st = td_trace_writer_nonmodel(w, m->trace_nonmodel[i]);
            last_nm = m->trace_nonmodel[i];
        }
        if (st == TD_OK) st = td_trace_writer_access(w, m->trace_seq[i], m->trace_write[i]);
    }
    td_status close_st = td_trace_writer_close(w);
    return st ? st : close_st;
}

/* AUTO: keep resident the most-used chunks the budget leaves room for, after
 * the warm-up's peak (chunks in use + non-model) and one spare chunk for the
 * prefetch to land in. */
static void place_auto(td_memmgr *m)
{
    td_arena_stats s;
    td_arena_get_stats(m->arena, &s);
    size_t largest = 0;
    for (int c = 0; c < m->n_chunks; c++)
        if (m->chunks[c].accesses && m->chunks[c].bytes > largest) largest = m->chunks[c].bytes;
    size_t reserve = m->min_budget + largest;
    /* Chunks homed on the device at layout (optimizer chunks placed by
     * td_memmgr_set_optim_homes, their params and grads) keep their room. */
    for (int c = 0; c < m->n_chunks; c++)
        if (m->chunks[c].home == TD_HOME_DEVICE) reserve += m->chunks[c].bytes;
    size_t room = s.budget_bytes > reserve ? s.budget_bytes - reserve : 0;
    /* Pick by accesses per byte, most first (ties: lower id), by selection. */
    char *picked = td_calloc((size_t)m->n_chunks, 1, TD_ROLE_META);
    if (!picked) return; /* stays all-host: correct, only slower */
    for (;;) {
        int best = -1;
        for (int c = 0; c < m->n_chunks; c++) {
            mm_chunk *ch = &m->chunks[c];
            /* Optimizer homes are final at layout (host copies of host-homed
             * optimizer state may be pageable: they never cross PCIe). */
            if (picked[c] || !ch->accesses || ch->bytes > room || ch->home == TD_HOME_DEVICE || mm_is_optim_role(ch->role))
                continue;
            if (best < 0 || ch->accesses * m->chunks[best].bytes > m->chunks[best].accesses * ch->bytes) best = c;
        }
        if (best < 0) break;
        picked[best] = 1;
        room -= m->chunks[best].bytes;
        m->chunks[best].home = TD_HOME_DEVICE;
    }
    td_free(picked);
}

td_status td_memmgr_step_end(td_memmgr *m)
{
    td_status st = TD_OK;
    if (!m->in_step) return td_error_set(TD_ERR_STATE, "memmgr: step ended without td_memmgr_step_begin");
    m->in_step = 0;
    m->step++;
    m->stats.steps++;
    TD_TRY(mm_tl_step_end(m));
    /* This step's figures: deltas of the counters, peaks of the arena. */
    td_memmgr_stats now;
    td_memmgr_get_stats(m, &now);
    m->last_step = now;
    m->last_step.loads -= m->step_start.loads;
    m->last_step.evictions -= m->step_start.evictions;
    m->last_step.writebacks -= m->step_start.writebacks;
    m->last_step.bytes_h2d -= m->step_start.bytes_h2d;
    m->last_step.bytes_d2h -= m->step_start.bytes_d2h;
    m->last_step.prefetches -= m->step_start.prefetches;
    m->last_step.demand_loads -= m->step_start.demand_loads;
    m->last_step.stalls -= m->step_start.stalls;
    m->last_step.stall_ms -= m->step_start.stall_ms;
    m->last_step.slot_wait_ms -= m->step_start.slot_wait_ms;
    m->last_step.accesses -= m->step_start.accesses;
    m->last_step.disk_read_bytes -= m->step_start.disk_read_bytes;
    m->last_step.disk_write_bytes -= m->step_start.disk_write_bytes;
    m->last_step.disk_wait_ms -= m->step_start.disk_wait_ms;
    m->last_step.gathers -= m->step_start.gathers;
    m->last_step.reduce_scatters -= m->step_start.reduce_scatters;
    m->last_step.bytes_gathered -= m->step_start.bytes_gathered;
    m->last_step.bytes_reduced -= m->step_start.bytes_reduced;
    td_arena_stats as;
    td_arena_get_stats(m->arena, &as);
    memcpy(m->last_step_peak, as.peak, sizeof as.peak);
    m->last_step_peak_total = as.peak_bytes;
    if (m->warmed_up || m->trace_len == 0) return TD_OK;
    /* The warm-up step is over: make the plan. */
    TD_TRY(measure_warmup(m));
    if (m->params.shard_ranks > 1 && m->params.shard_comm.agree_max) {
        /* Sharded, every rank loads (and gathers) in the same order: one
         * prefetch window for all, from the slowest rank's rates. */
        double v[2] = {m->measure.load_ms_per_mib, m->measure.step_ms};
        TD_TRY(m->params.shard_comm.agree_max(m->params.shard_comm.ctx, v, 2));
        m->measure.load_ms_per_mib = v[0];
        m->measure.step_ms = v[1];
    }
    TD_TRY(td_nextuse_create(m->trace_seq, m->trace_len, (uint32_t)m->n_chunks, 0, &m->nextuse));
    uint64_t *bytes = td_malloc((size_t)m->n_chunks * sizeof *bytes, TD_ROLE_META);
    if (!bytes) { st = TD_ERR_NOMEM; goto cleanup; }
    for (int c = 0; c < m->n_chunks; c++) bytes[c] = m->chunks[c].bytes;
    td_evictor *ev = NULL;
    st = td_evictor_create(m->params.eviction, (uint32_t)m->n_chunks, bytes, &ev);
    td_free(bytes);
    if (st) goto cleanup;
    td_evictor_destroy(m->evictor);
    m->evictor = ev;
    if (m->params.placement == TD_PLACEMENT_AUTO) place_auto(m);
    m->warmed_up = 1;
    m->pos = m->trace_len; /* the start of step 1, for the next uses below */
    for (int c = 0; c < m->n_chunks; c++) offer(m, c);
    m->prefetch_window = prefetch_window(m);
    if (m->params.trace_out) TD_TRY(write_trace(m));
    return TD_OK;
cleanup:
    return st;
}

size_t td_memmgr_min_budget(const td_memmgr *m) { return m->min_budget; }

/* ---- access and release ------------------------------------------------- */

static td_status check_ids(td_memmgr *m, const int *ids, int n, const char *what)
{
    if (!m->laid_out) return td_error_set(TD_ERR_STATE, "memmgr: %s before td_memmgr_layout", what);
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= m->n_tensors)
            return td_error_set(TD_ERR_INVALID, "memmgr: %s of tensor id %d (%d registered)", what, ids[i], m->n_tensors);
        for (int j = 0; j < i; j++)
            if (ids[j] == ids[i])
                return td_error_set(TD_ERR_INVALID, "memmgr: %s names tensor '%s' twice", what, m->tensors[ids[i]].name);
    }
    return TD_OK;
}

static td_status check_transitions(td_memmgr *m, const int *ids, int n, td_tensor_state to)
{
    for (int i = 0; i < n; i++) {
        td_status st = td_tensor_state_check(m->tensors[ids[i]].name, m->tensors[ids[i]].state, to);
        if (st) return st;
    }
    return TD_OK;
}

/* Applies a checked state change and keeps the chunk counts. */
static void set_state(td_memmgr *m, int id, td_tensor_state to)
{
    mm_tensor *t = &m->tensors[id];
    mm_chunk *ch = &m->chunks[t->chunk];
    ch->n_free += (to == TD_TENSOR_FREE) - (t->state == TD_TENSOR_FREE);
    ch->pins += (to == TD_TENSOR_COMPUTE) - (t->state == TD_TENSOR_COMPUTE);
    t->state = to;
    drop_spent_slot(m, ch);
    if (ch->on_disk && ch->n_free == ch->n_tensors) mm_disk_discard(m, ch); /* spent: not worth a write */
}

/* Distinct chunks of ids, in first-mention order; returns how many. */
static int chunks_of(td_memmgr *m, const int *ids, int n, int *out)
{
    int k = 0;
    for (int i = 0; i < n; i++) {
        int c = m->tensors[ids[i]].chunk, seen = 0;
        for (int j = 0; j < k && !seen; j++) seen = out[j] == c;
        if (!seen) out[k++] = c;
    }
    return k;
}

/* Loads ahead; a load that finds no room stops it quietly (the access will
 * load), any other failure (a collective's) is the access's. */
static td_status prefetch(td_memmgr *m)
{
    if (!m->nextuse || m->off_trace || m->prefetch_window <= 0) return TD_OK;
    for (uint64_t p = m->pos; p < m->pos + (uint64_t)m->prefetch_window; p++) {
        int c = (int)td_nextuse_chunk_at(m->nextuse, p);
        mm_chunk *ch = &m->chunks[c];
        if (ch->expect_write || ch->pins || ch->n_free == ch->n_tensors) continue; /* empty: zeroed at access */
        if (!needs_load(ch)) {
            /* resident with only this rank's shard current: the others gathered ahead too */
            td_status st = ch->partial ? gather(m, ch) : TD_OK;
            if (st) return st;
            continue;
        }
        /* A param on disk still being read: this prefetch stops here, a later access loads it. */
        if (ch->on_disk && !mm_disk_chunk_ready(m, ch)) return TD_OK;
        int was_candidate = td_evictor_contains(m->evictor, (uint32_t)c);
        td_evictor_remove(m->evictor, (uint32_t)c); /* never its own victim */
        /* Only chunks next used after p may make room for it (Belady-safe). */
        td_status st = materialize(m, ch, p + 1, 1);
        if (st == TD_OK || was_candidate) {
            ch->last_use = m->pos;
            offer(m, c);
        }
        if (st == TD_ERR_BUDGET) { td_error_clear(); return TD_OK; } /* no room yet: stop here */
        if (st) return st;
    }
    return TD_OK;
}

td_status td_memmgr_access(td_memmgr *m, const int *ids, int n, td_tensor_state state, unsigned flags,
                           void **dev_ptrs)
{
    td_status st;
    /* With a timeline: the host's time in here (waits, the loads it issues) */
    double entered = m->tl ? td_now_ms() : 0;
    if (m->disk) mm_disk_pump(m); /* the disk tier reads ahead while the GPU works */
    uint64_t loads_before = m->stats.loads;
    int local[64], *cs = n <= 64 ? local : td_malloc((size_t)n * sizeof *cs, TD_ROLE_META);
    if (!cs) return TD_ERR_NOMEM;
    if ((st = check_ids(m, ids, n, "access")) || (st = check_transitions(m, ids, n, state))) goto out;
    for (int i = 0; i < n; i++) {
        const mm_tensor *t = &m->tensors[ids[i]];
        const mm_chunk *ch = &m->chunks[t->chunk];
        if (ch->on_disk && mm_is_optim_role(ch->role)) {
            st = td_error_set(TD_ERR_STATE, "memmgr: device access to '%s' (%s chunk %d): it is homed on disk (the "
                              "CPU AdamW's alone)", t->name, td_tensor_role_name(ch->role), ch->index);
            goto out;
        }
        if (ch->pageable) {
            st = td_error_set(TD_ERR_STATE, "memmgr: device access to '%s' (%s chunk %d): its host copy is pageable "
                              "(optimizer state homed on the host is the CPU AdamW's alone); home the chunk on the "
                              "device before td_memmgr_layout (td_memmgr_set_chunk_home) to use it there",
                              t->name, td_tensor_role_name(ch->role), ch->index);
            goto out;
        }
    }
    int k = chunks_of(m, ids, n, cs);
    /* Pin first, so that making room for one never evicts another. */
    for (int i = 0; i < k; i++) td_evictor_remove(m->evictor, (uint32_t)cs[i]);
    for (int i = 0; i < k; i++) {
        mm_chunk *ch = &m->chunks[cs[i]];
        ch->pins++;
        /* A chunk of only FREE tensors is handed out zeroed, also when resident. */
        int empty = ch->n_free == ch->n_tensors;
        if (((needs_load(ch) || empty) && (st = materialize(m, ch, 0, 0))) || (ch->partial && (st = gather(m, ch)))) {
            for (int j = 0; j <= i; j++) m->chunks[cs[j]].pins--;
            for (int j = 0; j < k; j++) offer(m, cs[j]);
            goto out;
        }
    }
    size_t pinned_bytes = 0;
    if (!m->warmed_up && m->in_step)
        for (int c = 0; c < m->n_chunks; c++) pinned_bytes += m->chunks[c].pins ? m->chunks[c].bytes : 0;
    for (int i = 0; i < k; i++) {
        mm_chunk *ch = &m->chunks[cs[i]];
        ch->pins--;
        int done = 1;
        td_copy_done(m->engine, &ch->load, &done);
        if (!done) m->stats.stalls++;
        if ((st = td_copy_order(m->engine, TD_QUEUE_COMPUTE, &ch->load))) goto out;
        /* A write waits for the write-back still reading the slot.  A read
         * runs beside it (both only read): the grads' sums of squares, say,
         * while their write-back goes to the host, where waiting held up
         * the next block's backward.  The fence left at release must still
         * imply the write-back is over; release sees to it. */
        if (flags & TD_ACCESS_WRITE) {
            if ((st = td_copy_order(m->engine, TD_QUEUE_COMPUTE, &ch->writeback))) goto out;
        } else {
            int wb_done;
            if ((st = td_copy_done(m->engine, &ch->writeback, &wb_done))) goto out;
            if (!wb_done) ch->read_beside_wb = 1; /* a finished one needs no order */
        }
        if (m->in_step) {
            if (!m->warmed_up && (st = trace_record(m, cs[i], (flags & TD_ACCESS_WRITE) != 0, pinned_bytes))) goto out;
            ch->last_use = m->pos;
            advance(m, cs[i]);
        }
        m->stats.accesses++;
    }
    for (int i = 0; i < n; i++) {
        set_state(m, ids[i], state);
        mm_tensor *t = &m->tensors[ids[i]];
        const mm_chunk *ch = &m->chunks[t->chunk];
        /* an optimizer shard: its start (the chunk's owner updates it whole) */
        dev_ptrs[i] = (char *)ch->dev + (optim_sharded(m, ch) ? 0 : mm_tensor_byte_offset(m, t));
    }
    for (int i = 0; i < k; i++) {
        mm_chunk *ch = &m->chunks[cs[i]];
        if (flags & TD_ACCESS_WRITE) {
            ch->dev_ver = (ch->dev_ver > ch->host_ver ? ch->dev_ver : ch->host_ver) + 1;
            /* gathered: a param's own shard is what the writer changes; a grad gains this rank's terms */
            if (ch->gathered && ch->role == TD_TENSOR_PARAM) ch->partial = 1;
            if (ch->gathered && ch->role == TD_TENSOR_GRAD) ch->unreduced = 1;
        }
        offer(m, cs[i]);
    }
    if (m->in_step && (st = prefetch(m))) goto out;
    if (m->tl) {
        td_arena_stats as;
        td_arena_get_stats(m->arena, &as);
        mm_tl_instant(m, MM_TL_MEMORY, -1, (double)as.used_bytes);
        double left = td_now_ms();
        /* a diagnostic: a track too many does not fail the access */
        if (left - entered >= MM_TL_ACCESS_MIN_MS &&
            td_memmgr_timeline_host(m, "driving thread", entered, left, "access chunk %d: %llu loads issued",
                                    k ? cs[0] : -1, (unsigned long long)(m->stats.loads - loads_before)))
            td_error_clear();
    }
out:
    if (cs != local) td_free(cs);
    return st;
}

td_status td_memmgr_set_state(td_memmgr *m, const int *ids, int n, td_tensor_state to)
{
    td_status st;
    if ((st = check_ids(m, ids, n, "state change")) || (st = check_transitions(m, ids, n, to))) return st;
    if (to == TD_TENSOR_COMPUTE)
        return td_error_set(TD_ERR_STATE, "memmgr: tensor '%s' enters COMPUTE only through td_memmgr_access",
                            m->tensors[ids[0]].name);
    return td_memmgr_release(m, ids, n, to);
}

td_status td_memmgr_release(td_memmgr *m, const int *ids, int n, td_tensor_state to)
{
    td_status st;
    if ((st = check_ids(m, ids, n, "release")) || (st = check_transitions(m, ids, n, to))) return st;
    if (to == TD_TENSOR_COMPUTE)
        return td_error_set(TD_ERR_STATE, "memmgr: release to COMPUTE; use td_memmgr_access");
    int unpinned = 0;
    for (int i = 0; i < n; i++) {
        int was = m->tensors[ids[i]].state == TD_TENSOR_COMPUTE;
        set_state(m, ids[i], to);
        unpinned |= was && m->chunks[m->tensors[ids[i]].chunk].pins == 0;
    }
    /* The kernels that used these chunks may still run: fence their slots. */
    td_copy_ticket mark = {0};
    if (unpinned && (st = td_copy_mark(m->engine, TD_QUEUE_COMPUTE, &mark))) return st;
    for (int i = 0; i < n; i++) {
        mm_chunk *ch = &m->chunks[m->tensors[ids[i]].chunk];
        if (ch->pins == 0 && ch->dev && mark.seq) {
            ch->fence = mark;
            /* Read beside its write-back (td_memmgr_access): the D2H queue,
             * which holds that write-back, marks the fence after these
             * kernels too, so the slot's next owner waits for both. */
            if (ch->read_beside_wb) {
                if ((st = td_copy_order(m->engine, TD_QUEUE_D2H, &mark))) return st;
                if ((st = td_copy_mark(m->engine, TD_QUEUE_D2H, &ch->fence))) return st;
                ch->read_beside_wb = 0;
            }
        }
        offer(m, (int)(ch - m->chunks));
    }
    return TD_OK;
}

td_status td_memmgr_writeback_async(td_memmgr *m, const int *ids, int n)
{
    td_status st;
    if ((st = check_ids(m, ids, n, "write-back"))) return st;
    for (int i = 0; i < n; i++) {
        mm_chunk *ch = &m->chunks[m->tensors[ids[i]].chunk];
        if (ch->pins || !chunk_dirty(ch)) continue;
        if ((st = start_writeback(m, ch))) return st;
        offer(m, (int)(ch - m->chunks));
    }
    return TD_OK;
}

td_status td_memmgr_reduce_async(td_memmgr *m, const int *ids, int n)
{
    td_status st;
    if ((st = check_ids(m, ids, n, "reduce"))) return st;
    for (int i = 0; i < n; i++) {
        mm_chunk *ch = &m->chunks[m->tensors[ids[i]].chunk];
        if (!ch->gathered || ch->role != TD_TENSOR_GRAD || !ch->dev || !ch->unreduced) continue;
        if (ch->pins)
            return td_error_set(TD_ERR_STATE, "memmgr: grad chunk %d reduced while in COMPUTE (release its tensors "
                                "first)", (int)(ch - m->chunks));
        if ((st = reduce(m, ch))) return st;
        offer(m, (int)(ch - m->chunks));
    }
    return TD_OK;
}

td_status td_memmgr_expect_host_write(td_memmgr *m, int chunk)
{
    if (!m->laid_out || chunk < 0 || chunk >= m->n_chunks)
        return td_error_set(TD_ERR_INVALID, "memmgr: a host write expected of chunk %d (%d chunks)", chunk, m->n_chunks);
    m->chunks[chunk].expect_write = 1;
    return TD_OK;
}

td_status td_memmgr_written_on(td_memmgr *m, int id, td_queue q)
{
    td_status st;
    if ((st = check_ids(m, &id, 1, "written on a queue"))) return st;
    mm_chunk *ch = &m->chunks[m->tensors[id].chunk];
    if (!ch->dev || ch->pins)
        return td_error_set(TD_ERR_STATE, "memmgr: chunk %d written on a queue while %s", (int)(ch - m->chunks),
                            ch->dev ? "still in COMPUTE" : "not resident");
    td_copy_ticket t;
    if ((st = td_copy_mark(m->engine, q, &t))) return st;
    ch->load = t;  /* the next access waits for it */
    ch->fence = t; /* and so do the slot's next owner and a write-back */
    return TD_OK;
}

td_status td_memmgr_order_after_use(td_memmgr *m, int id, td_queue q)
{
    td_status st;
    if ((st = check_ids(m, &id, 1, "ordered after its use"))) return st;
    mm_chunk *ch = &m->chunks[m->tensors[id].chunk];
    if (!ch->dev)
        return td_error_set(TD_ERR_STATE, "memmgr: chunk %d ordered after its use while not resident",
                            (int)(ch - m->chunks));
    /* fence: the last release's kernels, or the load or write-back after them */
    if ((st = td_copy_order(m->engine, q, &ch->load))) return st;
    if ((st = td_copy_order(m->engine, q, &ch->writeback))) return st;
    return td_copy_order(m->engine, q, &ch->fence);
}

/* The host waits for a ticket; under sharding one behind a collective
 * through the communicator's bounded wait (a peer that stopped answering
 * fails the wait instead of hanging it). */
static td_status wait_ticket(td_memmgr *m, const td_copy_ticket *t)
{
    const td_memmgr_comm *c = &m->params.shard_comm;
    int done = 1;
    td_status st;
    if (m->params.shard_ranks > 1 && c->wait && t->seq && (st = td_copy_done(m->engine, t, &done))) return st;
    if (!done) {
        double t0 = td_now_ms();
        st = c->wait(c->ctx, (td_queue)t->queue);
        m->comm_wait_ms += td_now_ms() - t0;
        if (st) return st;
    }
    return td_copy_wait(m->engine, t);
}

/* A valid host copy of one chunk: checks, then waits (see host_access). */
static td_status host_sync(td_memmgr *m, mm_chunk *ch, unsigned flags)
{
    td_status st;
    if (ch->pins)
        return td_error_set(TD_ERR_STATE, "memmgr: host access to chunk %d ('%s', ...) while it is in COMPUTE on the "
                            "device", (int)(ch - m->chunks), m->tensors[ch->tensors[0]].name);
    if (chunk_dirty(ch) && (st = start_writeback(m, ch))) return st;
    if ((st = host_of(m, ch, 0))) return st;
    if ((st = wait_ticket(m, &ch->writeback))) return st;
    if (flags & TD_ACCESS_WRITE) {
        /* The upload in flight reads this host copy (or the disk slot): let it finish first. */
        if ((st = wait_ticket(m, &ch->load))) return st;
        ch->host_ver = (ch->host_ver > ch->dev_ver ? ch->host_ver : ch->dev_ver) + 1;
        ch->expect_write = 0;
        offer(m, (int)(ch - m->chunks));
    }
    return TD_OK;
}

/* A FREE tensor holds no payload: host writes to it would be dropped when
 * its chunk is next handed out zeroed. */
static td_status check_host_write(td_memmgr *m, int id)
{
    if (m->tensors[id].state != TD_TENSOR_FREE) return TD_OK;
    return td_error_set(TD_ERR_STATE, "memmgr: host write to '%s' while it is FREE; move it to HOLD first "
                        "(td_memmgr_set_state)", m->tensors[id].name);
}

td_status td_memmgr_host_access(td_memmgr *m, const int *ids, int n, unsigned flags, void **host_ptrs)
{
    td_status st;
    if ((st = check_ids(m, ids, n, "host access"))) return st;
    for (int i = 0; i < n; i++) {
        const mm_chunk *ch = &m->chunks[m->tensors[ids[i]].chunk];
        if (host_sharded(m, ch))
            return td_error_set(TD_ERR_STATE, "memmgr: host access to '%s': its %s chunk %d holds only rank %d's shard "
                                "on this host; use td_memmgr_chunk_host_access with td_memmgr_chunk_host_range",
                                m->tensors[ids[i]].name, td_tensor_role_name(ch->role), ch->index,
                                m->params.shard_rank);
        if (m->chunks[m->tensors[ids[i]].chunk].pins)
            return td_error_set(TD_ERR_STATE, "memmgr: host access to '%s' while its chunk is in COMPUTE on the device",
                                m->tensors[ids[i]].name);
        if ((flags & TD_ACCESS_WRITE) && (st = check_host_write(m, ids[i]))) return st;
    }
    for (int i = 0; i < n; i++) {
        mm_tensor *t = &m->tensors[ids[i]];
        mm_chunk *ch = &m->chunks[t->chunk];
        void *base = ch->host;
        if ((st = host_sync(m, ch, flags))) return st;
        if (ch->on_disk && (st = mm_disk_host_access(m, ch, flags, &base))) return st;
        host_ptrs[i] = (char *)base + mm_tensor_byte_offset(m, t);
    }
    return TD_OK;
}

td_status td_memmgr_chunk_host_access(td_memmgr *m, int chunk, unsigned flags, void **host)
{
    td_status st;
    if (!m->laid_out || chunk < 0 || chunk >= m->n_chunks)
        return td_error_set(TD_ERR_INVALID, "memmgr: host access to chunk %d (%d chunks)", chunk, m->n_chunks);
    mm_chunk *ch = &m->chunks[chunk];
    for (int j = 0; (flags & TD_ACCESS_WRITE) && j < ch->n_tensors; j++)
        if ((st = check_host_write(m, ch->tensors[j]))) return st;
    if ((st = host_sync(m, ch, flags))) return st;
    if (ch->on_disk) return mm_disk_host_access(m, ch, flags, host);
    *host = ch->host;
    return TD_OK;
}

td_status td_memmgr_chunk_host_peek(td_memmgr *m, int chunk, void **host, td_copy_ticket *written)
{
    td_status st;
    if (!m->laid_out || chunk < 0 || chunk >= m->n_chunks)
        return td_error_set(TD_ERR_INVALID, "memmgr: host peek at chunk %d (%d chunks)", chunk, m->n_chunks);
    mm_chunk *ch = &m->chunks[chunk];
    if (ch->on_disk && mm_is_optim_role(ch->role))
        return td_error_set(TD_ERR_STATE, "memmgr: host peek at chunk %d ('%s', ...): it is homed on disk; "
                            "td_memmgr_disk_acquire gives it", chunk, m->tensors[ch->tensors[0]].name);
    if (ch->pins)
        return td_error_set(TD_ERR_STATE, "memmgr: host peek at chunk %d ('%s', ...) while it is in COMPUTE on the "
                            "device", chunk, m->tensors[ch->tensors[0]].name);
    if (chunk_dirty(ch) && (st = start_writeback(m, ch))) return st;
    if (ch->on_disk) { /* its bytes: the disk tier's (td_memmgr_disk_chunk_acquire, after `written`) */
        *host = NULL;
        if (written) *written = ch->writeback;
        return TD_OK;
    }
    if ((st = host_of(m, ch, 0))) return st;
    if (ch->transient) { /* lent: the reader frees the slot (td_memmgr_grad_consumed) */
        pthread_mutex_lock(&m->gslot_lock);
        m->gslots[ch->gslot].state = MM_GSLOT_LENT;
        pthread_mutex_unlock(&m->gslot_lock);
    }
    *host = ch->host;
    if (written) *written = ch->writeback;
    return TD_OK;
}

td_status td_memmgr_chunk_host_written(td_memmgr *m, int chunk)
{
    if (!m->laid_out || chunk < 0 || chunk >= m->n_chunks)
        return td_error_set(TD_ERR_INVALID, "memmgr: host write of chunk %d (%d chunks)", chunk, m->n_chunks);
    mm_chunk *ch = &m->chunks[chunk];
    if (ch->pins)
        return td_error_set(TD_ERR_STATE, "memmgr: host write of chunk %d ('%s', ...) while it is in COMPUTE on the "
                            "device", chunk, m->tensors[ch->tensors[0]].name);
    ch->host_ver = (ch->host_ver > ch->dev_ver ? ch->host_ver : ch->dev_ver) + 1;
    ch->expect_write = 0; /* the write td_memmgr_expect_host_write announced: prefetches may load it again */
    offer(m, chunk);
    return TD_OK;
}

/* ---- non-model memory ----------------------------------------------------- */

td_status td_memmgr_alloc_nonmodel(td_memmgr *m, size_t bytes, td_role role, void **ptr)
{
    for (;;) {
        td_status st = td_arena_alloc(m->arena, bytes, role, ptr);
        if (st == TD_OK && !m->warmed_up && m->in_step) {
            size_t nm = nonmodel_bytes(m);
            if (nm > m->nm_peak_since) m->nm_peak_since = nm;
        }
        if (st != TD_ERR_BUDGET) return st;
        int had_spares = 0;
        for (int i = 0; i < m->n_pools; i++) had_spares |= m->pools[i].n_spare > 0;
        if (had_spares) {
            release_all_spares(m);
        } else {
            int64_t v = td_evictor_pick(m->evictor, 0);
            if (v < 0) v = device_homed_victim(m);
            if (v < 0) return td_error_prefix(TD_ERR_BUDGET, "memmgr: every chunk not in use is already on the host; ");
            if ((st = evict(m, &m->chunks[v]))) return st;
        }
        /* Memory reused for activations: the compute queue already waits (release_spares). */
    }
}

td_status td_memmgr_free_nonmodel(td_memmgr *m, void *ptr)
{
    td_status st = td_arena_release(m->arena, ptr);
    if (st) return st;
    /* A chunk slot carved from this memory must wait for the kernels that used it. */
    return td_copy_mark(m->engine, TD_QUEUE_COMPUTE, &m->trim_fence);
}

/* ---- queries ---------------------------------------------------------------- */

void td_memmgr_get_stats(const td_memmgr *m, td_memmgr_stats *out)
{
    *out = m->stats;
    out->stall_ms = 0;
    td_copy_stats cs;
    td_copy_get_stats(m->engine, &cs);
    out->stall_ms = cs.host_wait_ms + m->comm_wait_ms;
    td_arena_stats s;
    td_arena_get_stats(m->arena, &s);
    out->device_chunk_bytes = s.used[TD_ROLE_CHUNK] + s.used[TD_ROLE_OPTIM];
    size_t peak = s.peak_bytes > m->peak_total ? s.peak_bytes : m->peak_total;
    ((td_memmgr *)m)->peak_total = peak;
    out->device_peak_bytes = peak;
    if (m->disk) {
        pthread_mutex_lock(&m->disk->lock);
        out->disk_read_bytes = m->disk->read_bytes;
        out->disk_write_bytes = m->disk->write_bytes;
        out->disk_wait_ms = m->disk->wait_ms;
        pthread_mutex_unlock(&m->disk->lock);
    }
}

size_t td_memmgr_step_json(const td_memmgr *m, char *buf, size_t buf_bytes)
{
    const td_memmgr_stats *s = &m->last_step;
    const struct { const char *key; double value; } fields[] = {
        {"step", (double)(m->step ? m->step - 1 : 0)}, {"accesses", (double)s->accesses},
        {"loads", (double)s->loads}, {"evictions", (double)s->evictions}, {"writebacks", (double)s->writebacks},
        {"bytes_h2d", (double)s->bytes_h2d}, {"bytes_d2h", (double)s->bytes_d2h},
        {"prefetches", (double)s->prefetches}, {"demand_loads", (double)s->demand_loads},
        {"stalls", (double)s->stalls}, {"stall_ms", s->stall_ms}, {"slot_wait_ms", s->slot_wait_ms},
        {"gathers", (double)s->gathers}, {"reduce_scatters", (double)s->reduce_scatters},
        {"bytes_gathered", (double)s->bytes_gathered}, {"bytes_reduced", (double)s->bytes_reduced},
        {"prefetch_window", (double)m->prefetch_window}, {"device_peak_bytes", (double)m->last_step_peak_total},
        {"disk_read_bytes", (double)s->disk_read_bytes}, {"disk_write_bytes", (double)s->disk_write_bytes},
        {"disk_wait_ms", s->disk_wait_ms},
    };
    cJSON *j = cJSON_CreateObject(), *peak = cJSON_CreateObject();
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
        cJSON_AddNumberToObject(j, fields[i].key, fields[i].value);
    for (int r = 0; r < TD_ROLE_COUNT; r++)
        cJSON_AddNumberToObject(peak, td_role_name((td_role)r), (double)m->last_step_peak[r]);
    cJSON_AddItemToObject(j, "peak_bytes", peak);
    char *text = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    int n = buf_bytes ? snprintf(buf, buf_bytes, "%s", text ? text : "{}") : 0;
    cJSON_free(text);
    if (n < 0) n = 0;
    return buf_bytes == 0 ? 0 : (size_t)n < buf_bytes ? (size_t)n : buf_bytes - 1;
}

int td_memmgr_tensor_count(const td_memmgr *m) { return m->n_tensors; }
int td_memmgr_chunk_count(const td_memmgr *m) { return m->n_chunks; }
size_t td_memmgr_chunk_numel(const td_memmgr *m) { return m->chunk_numel; }
size_t td_memmgr_padding_bytes(const td_memmgr *m) { return m->padding_bytes; }
int td_memmgr_tensor_chunk(const td_memmgr *m, int id) { return m->tensors[id].chunk; }
size_t td_memmgr_tensor_offset(const td_memmgr *m, int id) { return m->tensors[id].offset; }
size_t td_memmgr_tensor_numel(const td_memmgr *m, int id) { return m->tensors[id].numel; }
const char *td_memmgr_tensor_name(const td_memmgr *m, int id) { return m->tensors[id].name; }
td_tensor_state td_memmgr_tensor_state(const td_memmgr *m, int id) { return m->tensors[id].state; }
size_t td_memmgr_chunk_bytes(const td_memmgr *m, int c) { return m->laid_out ? m->chunks[c].host_bytes : host_bytes_of(m, c); }
size_t td_memmgr_chunk_slot_bytes(const td_memmgr *m, int c) { return m->chunks[c].bytes; }
size_t td_memmgr_chunk_numel_used(const td_memmgr *m, int c) { return m->chunks[c].used_numel; }
td_tensor_role td_memmgr_chunk_role(const td_memmgr *m, int c) { return m->chunks[c].role; }
td_chunk_home td_memmgr_chunk_home(const td_memmgr *m, int c) { return m->chunks[c].home; }

int td_memmgr_role_chunk(const td_memmgr *m, td_tensor_role role, int index)
{
    if ((unsigned)role >= TD_TENSOR_ROLE_COUNT || index < 0 || index >= m->role_count[role]) return -1;
    return m->role_first[role] + index;
}

int td_memmgr_role_chunk_count(const td_memmgr *m, td_tensor_role role)
{
    return (unsigned)role < TD_TENSOR_ROLE_COUNT ? m->role_count[role] : 0;
}
