/* The offline memory simulator (see include/tidal/memsim.h).
 *
 * One pass over the trace's events.  Victims come from the same td_evictor
 * the live manager uses, keyed by the td_nextuse table built once up front,
 * so the cost per access is O(log resident chunks) for Belady and O(1) for
 * LRU, plus the prefetch window's amortized O(1) (see `frontier`). */
#include "tidal/memsim.h"

#include <string.h>

#include "tidal/alloc.h"
#include "tidal/util.h"

enum { F_RESIDENT = 1, F_DIRTY = 2, F_PENDING = 4, F_SEEN = 8 };

typedef struct sim {
    const td_trace *t;
    const td_memsim_params *p;
    td_memsim_result *r;
    const uint64_t *bytes;    /* chunk sizes */
    const uint32_t *seq;      /* access i's chunk */
    size_t n_access;
    td_nextuse *nu;
    td_evictor *ev;
    uint8_t *flags;           /* [chunks] F_* */
    uint32_t *victims;        /* [chunks] scratch for td_evictor_make_room */
    uint64_t *peak_tree;      /* see build_peak_tree (with prefetch only) */
    uint64_t resident_bytes, nonmodel_bytes;
    uint64_t pos;             /* the access being served, or next */
    uint32_t line;            /* the trace line being served */
    /* Prefetch frontier: every access in (pos, frontier] has its chunk
     * resident.  An eviction of a chunk used at or before the frontier pulls
     * it back; a prefetch pass only looks past it. */
    int64_t frontier;
    td_memsim_counts step_mark, pending_mark; /* totals at the last step line with an access, and at the latest */
    int step_pending, have_step_mark;
} sim;

static void emit(sim *s, td_memsim_event ev)
{
    if (!s->p->on_event) return;
    ev.line = s->line;
    ev.device_bytes = s->resident_bytes + s->nonmodel_bytes;
    s->p->on_event(s->p->ctx, &ev);
}

static void note_peak(sim *s)
{
    td_memsim_result *r = s->r;
    uint64_t dev = s->resident_bytes + s->nonmodel_bytes;
    if (dev > r->peak_device_bytes) r->peak_device_bytes = dev;
    if (s->resident_bytes > r->peak_chunk_bytes) r->peak_chunk_bytes = s->resident_bytes;
    if (s->nonmodel_bytes > r->peak_nonmodel_bytes) r->peak_nonmodel_bytes = s->nonmodel_bytes;
}

/* Drops the victims td_evictor_make_room chose, writing back the dirty ones. */
static void evict(sim *s, uint32_t n_victims)
{
    td_memsim_counts *c = &s->r->total;
    for (uint32_t k = 0; k < n_victims; k++) {
        uint32_t v = s->victims[k];
        uint64_t b = s->bytes[v];
        int wb = (s->flags[v] & F_DIRTY) != 0;
        if (wb) {
            c->writebacks++;
            c->bytes_d2h += b;
        }
        if (s->flags[v] & F_PENDING) c->prefetch_wasted++;
        c->evictions++;
        s->flags[v] &= (uint8_t)~(F_RESIDENT | F_DIRTY | F_PENDING);
        s->resident_bytes -= b;
        uint64_t next = td_evictor_next_use(s->ev, v); /* its key when it was removed */
        if (next != TD_NEXTUSE_NEVER && (int64_t)next <= s->frontier) s->frontier = (int64_t)next - 1;
        emit(s, (td_memsim_event){ .kind = TD_MEMSIM_EVICT, .chunk = v, .pos = s->pos, .target = s->pos,
                                   .bytes = b, .writeback = (uint8_t)wb });
    }
}

static td_status make_room(sim *s, uint64_t need, uint64_t min_next_use)
{
    uint64_t cap = s->p->budget_bytes - s->nonmodel_bytes;
    uint32_t n;
    td_status st = td_evictor_make_room(s->ev, need, cap - s->resident_bytes, min_next_use, s->victims, &n);
    evict(s, n);
    return st;
}

static void load(sim *s, uint32_t c, int prefetch, uint64_t target)
{
    td_memsim_counts *k = &s->r->total;
    uint64_t b = s->bytes[c];
    s->flags[c] |= F_RESIDENT;
    s->resident_bytes += b;
    k->loads++;
    k->bytes_h2d += b;
    if (prefetch) {
        k->prefetch_loads++;
        s->flags[c] |= F_PENDING;
    } else {
        k->demand_loads++;
    }
    note_peak(s);
    emit(s, (td_memsim_event){ .kind = TD_MEMSIM_LOAD, .chunk = c, .pos = s->pos, .target = target,
                               .bytes = b, .prefetch = (uint8_t)prefetch });
}

/* The most non-model bytes live at any moment in (access a, access b]. */
static uint64_t peak_nonmodel(const sim *s, uint64_t a, uint64_t b)
{
    uint64_t best = 0;
    size_t n = s->n_access;
    for (size_t lo = a + 1 + n, hi = b + 1 + n; lo < hi; lo /= 2, hi /= 2) {
        if (lo & 1) { if (s->peak_tree[lo] > best) best = s->peak_tree[lo]; lo++; }
        if (hi & 1) { hi--; if (s->peak_tree[hi] > best) best = s->peak_tree[hi]; }
    }
    return best;
}

/* Issues loads for accesses pos+1 .. pos+N in order while they fit, evicting
 * only chunks whose next use is after the access being prefetched.  "Fit"
 * holds from now until that access: against the most non-model bytes live
 * in between, so a prefetched chunk is not pushed out by activations growing
 * before its use. */
static td_status prefetch(sim *s)
{
    td_status st = TD_OK;
    if (!s->p->prefetch || s->n_access == 0) return TD_OK;
    if (s->frontier < (int64_t)s->pos) s->frontier = (int64_t)s->pos;
    uint64_t limit = s->pos + s->p->prefetch;
    if (limit > s->n_access - 1) limit = s->n_access - 1;
    while ((uint64_t)s->frontier < limit) {
        uint64_t j = (uint64_t)s->frontier + 1;
        uint32_t c = s->seq[j];
        if (!(s->flags[c] & F_RESIDENT)) {
            uint64_t nonmodel = peak_nonmodel(s, s->pos, j);
            if (nonmodel < s->nonmodel_bytes) nonmodel = s->nonmodel_bytes;
            /* Room for everything resident plus c under budget - nonmodel. */
            if (nonmodel > s->p->budget_bytes) break; /* the trace fails before then */
            uint64_t room = s->p->budget_bytes - nonmodel;
            if (s->bytes[c] > room) break; /* never fits (its access will say so) */
            /* The resident chunks must fit in what c leaves of the room
             * (not resident + c > room: that sum can pass 2^64). */
            uint64_t left = room - s->bytes[c];
            if (s->resident_bytes > left &&
                td_evictor_freeable(s->ev, j + 1, s->resident_bytes - left) < s->resident_bytes - left)
                break; /* try again after the next access */
            uint32_t n;
            TD_TRY(td_evictor_make_room(s->ev, s->resident_bytes, left, j + 1, s->victims, &n));
            evict(s, n);
            load(s, c, 1, j);
            TD_TRY(td_evictor_update(s->ev, c, s->pos, j, 0));
        }
        s->frontier = (int64_t)j;
    }
cleanup:
    return st;
}

/* peak_tree[n + q] = the most non-model bytes live between access q - 1 and
 * access q, both excluded (spikes included); a segment tree above it. */
static td_status build_peak_tree(sim *s)
{
    size_t n = s->n_access;
    s->peak_tree = td_calloc(2 * n + 2, sizeof *s->peak_tree, TD_ROLE_META);
    if (!s->peak_tree) return td_error_prefix(TD_ERR_NOMEM, "memsim: ");
    const td_trace_event *ev = td_trace_events(s->t);
    size_t n_events = td_trace_event_count(s->t), q = 0;
    uint64_t live = 0, peak = 0;
    for (size_t i = 0; i < n_events; i++) {
        if (ev[i].kind == TD_TRACE_NONMODEL) {
            live = ev[i].nonmodel_bytes;
            if (live > peak) peak = live;
        } else if (ev[i].kind == TD_TRACE_ACCESS) {
            s->peak_tree[n + q++] = peak > live ? peak : live;
            peak = live;
        }
    }
    for (size_t i = n; i-- > 1;)
        s->peak_tree[i] = s->peak_tree[2 * i] > s->peak_tree[2 * i + 1] ? s->peak_tree[2 * i] : s->peak_tree[2 * i + 1];
    return TD_OK;
}

static td_status set_nonmodel(sim *s, uint64_t bytes)
{
    td_status st = TD_OK;
    char a[32], b[32], m[32];
    if (bytes > s->p->budget_bytes)
        TD_FAIL(TD_ERR_BUDGET, "%s:%u: non-model bytes %s exceed the budget %s; raise --budget to at least %s",
                td_trace_name(s->t), s->line, td_format_bytes(bytes, a, sizeof a),
                td_format_bytes(s->p->budget_bytes, b, sizeof b),
                td_format_bytes(td_memsim_min_budget(s->t), m, sizeof m));
    if (s->resident_bytes > s->p->budget_bytes - bytes) { /* resident + bytes could pass 2^64 */
        /* Room for the resident chunks in what the new non-model bytes leave. */
        uint32_t n;
        st = td_evictor_make_room(s->ev, s->resident_bytes, s->p->budget_bytes - bytes, 0, s->victims, &n);
        evict(s, n);
        TD_TRY(st);
    }
    s->nonmodel_bytes = bytes;
    note_peak(s);
    emit(s, (td_memsim_event){ .kind = TD_MEMSIM_NONMODEL, .pos = s->pos, .target = s->pos, .bytes = bytes });
cleanup:
    return st;
}

static void mark_step(sim *s)
{
    s->pending_mark = s->r->total;
    s->step_pending = 1;
    emit(s, (td_memsim_event){ .kind = TD_MEMSIM_STEP, .pos = s->pos, .target = s->pos });
}

static td_status access_chunk(sim *s, uint32_t c, int write)
{
    td_status st = TD_OK;
    td_memsim_counts *k = &s->r->total;
    uint64_t need = s->bytes[c];
    if (s->step_pending) { /* this step has an access: it is the last step so far */
        s->step_mark = s->pending_mark;
        s->step_pending = 0;
        s->have_step_mark = 1;
    }
    if (need > s->p->budget_bytes - s->nonmodel_bytes) {
        char a[32], b[32], d[32], m[32];
        TD_FAIL(TD_ERR_BUDGET, "%s:%u: access to chunk %u (%s) with %s of non-model bytes live does not fit "
                "the budget %s; raise --budget to at least %s", td_trace_name(s->t), s->line, c,
                td_format_bytes(need, a, sizeof a), td_format_bytes(s->nonmodel_bytes, b, sizeof b),
                td_format_bytes(s->p->budget_bytes, d, sizeof d),
                td_format_bytes(td_memsim_min_budget(s->t), m, sizeof m));
    }
    k->accesses++;
    if (!(s->flags[c] & F_RESIDENT)) {
        TD_TRY(make_room(s, need, 0));
        load(s, c, 0, s->pos);
    } else if (s->flags[c] & F_PENDING) {
        k->prefetch_hits++;
        s->flags[c] &= (uint8_t)~F_PENDING;
    }
    if (write && !(s->flags[c] & F_DIRTY)) {
        s->flags[c] |= F_DIRTY;
        s->r->dirtyings++;
    }
    if (!(s->flags[c] & F_SEEN)) {
        s->flags[c] |= F_SEEN;
        s->r->compulsory_loads++;
    }
    TD_TRY(td_evictor_update(s->ev, c, s->pos, td_nextuse_after(s->nu, s->pos), (s->flags[c] & F_DIRTY) != 0));
    emit(s, (td_memsim_event){ .kind = TD_MEMSIM_ACCESS, .chunk = c, .pos = s->pos, .target = s->pos,
                               .bytes = need, .write = (uint8_t)(write != 0) });
    TD_TRY(prefetch(s));
    s->pos++;
cleanup:
    return st;
}

static void counts_sub(td_memsim_counts *out, const td_memsim_counts *a, const td_memsim_counts *b)
{
    const uint64_t *x = (const uint64_t *)a, *y = (const uint64_t *)b;
    uint64_t *o = (uint64_t *)out;
    for (size_t i = 0; i < sizeof *out / sizeof(uint64_t); i++) o[i] = x[i] - y[i];
}

td_memsim_params td_memsim_default_params(void)
{
    return (td_memsim_params){ .policy = TD_EVICT_BELADY };
}

uint64_t td_memsim_min_budget(const td_trace *t)
{
    const td_trace_event *ev = td_trace_events(t);
    size_t n = td_trace_event_count(t);
    uint64_t nonmodel = 0, need = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t x;
        if (ev[i].kind == TD_TRACE_NONMODEL) x = nonmodel = ev[i].nonmodel_bytes;
        else if (ev[i].kind == TD_TRACE_ACCESS) {
            uint64_t b = td_trace_chunk_bytes(t, ev[i].chunk);
            x = b > UINT64_MAX - nonmodel ? UINT64_MAX : b + nonmodel;
        } else continue;
        if (x > need) need = x;
    }
    return need;
}

td_status td_memsim_run(const td_trace *t, const td_memsim_params *p, td_memsim_result *out)
{
    td_status st = TD_OK;
    uint32_t *seq = NULL;
    sim s = { .t = t, .p = p, .r = out, .frontier = -1 };
    memset(out, 0, sizeof *out);
    if ((unsigned)p->policy >= TD_EVICT_POLICY_COUNT)
        TD_FAIL(TD_ERR_INVALID, "memsim: unknown eviction policy %d; use belady or lru", (int)p->policy);
    uint32_t n_chunks = td_trace_chunk_count(t);
    s.bytes = td_trace_chunk_sizes(t);
    TD_TRY(td_trace_access_sequence(t, &seq, &s.n_access));
    s.seq = seq;
    TD_TRY(td_nextuse_create(seq, s.n_access, n_chunks, td_trace_period_start(t), &s.nu));
    TD_TRY(td_evictor_create(p->policy, n_chunks, s.bytes, &s.ev));
    s.flags = td_calloc((size_t)n_chunks + 1, 1, TD_ROLE_META);
    s.victims = td_malloc(((size_t)n_chunks + 1) * sizeof *s.victims, TD_ROLE_META);
    if (!s.flags || !s.victims) TD_FAIL(TD_ERR_NOMEM, "memsim: %s", td_error_msg());
    if (p->prefetch) TD_TRY(build_peak_tree(&s));
    out->chunks = n_chunks;
    out->steps = td_trace_step_count(t);

    const td_trace_event *ev = td_trace_events(t);
    size_t n_events = td_trace_event_count(t);
    for (size_t i = 0; i < n_events; i++) {
        s.line = ev[i].line;
        switch (ev[i].kind) {
        case TD_TRACE_ACCESS: TD_TRY(access_chunk(&s, ev[i].chunk, ev[i].write)); break;
        case TD_TRACE_NONMODEL: TD_TRY(set_nonmodel(&s, ev[i].nonmodel_bytes)); break;
        default: mark_step(&s); break;
        }
    }
    if (s.have_step_mark)
        counts_sub(&out->last_step, &out->total, &s.step_mark);
    for (uint32_t c = 0; c < n_chunks; c++) {
        if (s.flags[c] & F_RESIDENT) {
            out->resident_end++;
            out->resident_bytes_end += s.bytes[c];
        }
        if (s.flags[c] & F_DIRTY) out->dirty_end++;
    }
cleanup:
    td_free(seq);
    td_free(s.flags);
    td_free(s.victims);
    td_free(s.peak_tree);
    td_nextuse_destroy(s.nu);
    td_evictor_destroy(s.ev);
    return st;
}
