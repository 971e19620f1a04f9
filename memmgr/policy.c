/* Next-use tables and evictors (see include/tidal/policy.h).
 *
 * Belady keeps its candidates in an indexed binary max-heap keyed by next use
 * (O(log n) per update, the victim on top); LRU in a doubly linked list,
 * most recent at the head (O(1) per update, victims from the tail).  Both
 * run at millions of accesses per second. */
#include "tidal/policy.h"

#include <string.h>
#include <strings.h>

#include "tidal/alloc.h"

static const char *policy_names[TD_EVICT_POLICY_COUNT] = {"lru", "belady"};

const char *td_evict_policy_name(td_evict_policy p)
{
    return (unsigned)p < TD_EVICT_POLICY_COUNT ? policy_names[p] : "?";
}

td_status td_evict_policy_parse(const char *name, td_evict_policy *out)
{
    for (int i = 0; i < TD_EVICT_POLICY_COUNT; i++)
        if (name && !strcasecmp(name, policy_names[i])) {
            *out = (td_evict_policy)i;
            return TD_OK;
        }
    return td_error_set(TD_ERR_INVALID, "unknown eviction policy '%s'; use belady or lru", name ? name : "");
}

/* ---- next-use table ------------------------------------------------------ */

struct td_nextuse {
    size_t n, period_start;
    uint32_t n_chunks;
    uint32_t *seq;        /* [n] */
    uint64_t *next;       /* [n] next access after i (wrapped), or NEVER */
    uint32_t *occ;        /* [n] positions of each chunk's accesses, grouped by chunk, ascending */
    uint32_t *occ_start;  /* [n_chunks + 1] chunk c's positions are occ[occ_start[c] .. occ_start[c+1]) */
    uint64_t *wrap_first; /* [n_chunks] first access after position n - 1, or NEVER */
};

void td_nextuse_destroy(td_nextuse *t)
{
    if (!t) return;
    td_free(t->seq);
    td_free(t->next);
    td_free(t->occ);
    td_free(t->occ_start);
    td_free(t->wrap_first);
    td_free(t);
}

td_status td_nextuse_create(const uint32_t *seq, size_t n, uint32_t n_chunks, size_t period_start,
                            td_nextuse **out)
{
    td_status st = TD_OK;
    td_nextuse *t = NULL;
    *out = NULL;
    if (n >= UINT32_MAX)
        TD_FAIL(TD_ERR_INVALID, "next-use table: %zu accesses, at most %u supported", n, UINT32_MAX - 1);
    if (period_start > n)
        TD_FAIL(TD_ERR_INVALID, "next-use table: period start %zu is past the end (%zu accesses)",
                period_start, n);
    for (size_t i = 0; i < n; i++)
        if (seq[i] >= n_chunks)
            TD_FAIL(TD_ERR_INVALID, "next-use table: access %zu names chunk %u, but there are %u chunks",
                    i, seq[i], n_chunks);
    t = td_calloc(1, sizeof *t, TD_ROLE_META);
    if (!t) TD_FAIL(TD_ERR_NOMEM, "next-use table: %s", td_error_msg());
    t->n = n;
    t->period_start = period_start;
    t->n_chunks = n_chunks;
    size_t n1 = n ? n : 1;
    t->seq = td_malloc(n1 * sizeof *t->seq, TD_ROLE_META);
    t->next = td_malloc(n1 * sizeof *t->next, TD_ROLE_META);
    t->occ = td_malloc(n1 * sizeof *t->occ, TD_ROLE_META);
    t->occ_start = td_calloc((size_t)n_chunks + 1, sizeof *t->occ_start, TD_ROLE_META);
    t->wrap_first = td_malloc(((size_t)n_chunks + 1) * sizeof *t->wrap_first, TD_ROLE_META);
    if (!t->seq || !t->next || !t->occ || !t->occ_start || !t->wrap_first)
        TD_FAIL(TD_ERR_NOMEM, "next-use table for %zu accesses: %s", n, td_error_msg());
    if (n) memcpy(t->seq, seq, n * sizeof *seq);

    /* Past the end the period repeats: chunk c is next used at
     * n + (its first position in the period - period_start). */
    for (uint32_t c = 0; c < n_chunks; c++) t->wrap_first[c] = TD_NEXTUSE_NEVER;
    for (size_t i = n; i-- > period_start;) t->wrap_first[seq[i]] = n + (i - period_start);
    /* Backward scan: the next use of position i is the latest position seen
     * of its chunk, starting from the wrapped one. */
    uint64_t *last = td_malloc(((size_t)n_chunks + 1) * sizeof *last, TD_ROLE_META);
    if (!last) TD_FAIL(TD_ERR_NOMEM, "next-use table: %s", td_error_msg());
    memcpy(last, t->wrap_first, (size_t)n_chunks * sizeof *last);
    for (size_t i = n; i-- > 0;) {
        t->next[i] = last[seq[i]];
        last[seq[i]] = i;
    }
    td_free(last);
    /* Occurrence lists (counting sort by chunk, stable). */
    for (size_t i = 0; i < n; i++) t->occ_start[seq[i] + 1]++;
    for (uint32_t c = 0; c < n_chunks; c++) t->occ_start[c + 1] += t->occ_start[c];
    uint32_t *fill = td_malloc(((size_t)n_chunks + 1) * sizeof *fill, TD_ROLE_META);
    if (!fill) TD_FAIL(TD_ERR_NOMEM, "next-use table: %s", td_error_msg());
    memcpy(fill, t->occ_start, (size_t)n_chunks * sizeof *fill);
    for (size_t i = 0; i < n; i++) t->occ[fill[seq[i]]++] = (uint32_t)i;
    td_free(fill);
    *out = t;
    t = NULL;
cleanup:
    td_nextuse_destroy(t);
    return st;
}

size_t td_nextuse_length(const td_nextuse *t) { return t->n; }
size_t td_nextuse_period_start(const td_nextuse *t) { return t->period_start; }

int td_nextuse_valid(const td_nextuse *t, uint64_t pos)
{
    return pos < t->n || t->period_start < t->n;
}

/* Maps a position past the end onto the period: returns the position inside
 * [0, n) and sets *shift so that pos = base + *shift (a multiple of the
 * period length).  The sequence from period_start on is periodic, so next
 * uses shift by the same amount. */
static uint64_t fold(const td_nextuse *t, uint64_t pos, uint64_t *shift)
{
    *shift = 0;
    if (pos < t->n) return pos;
    uint64_t period = t->n - t->period_start;
    uint64_t k = (pos - t->n) % period;
    uint64_t base = t->period_start + k;
    *shift = pos - base;
    return base;
}

static uint64_t add_shift(uint64_t v, uint64_t shift)
{
    return v == TD_NEXTUSE_NEVER || v > TD_NEXTUSE_NEVER - 1 - shift ? TD_NEXTUSE_NEVER : v + shift;
}

uint32_t td_nextuse_chunk_at(const td_nextuse *t, uint64_t pos)
{
    uint64_t shift;
    return t->seq[fold(t, pos, &shift)];
}

uint64_t td_nextuse_after(const td_nextuse *t, uint64_t pos)
{
    if (!td_nextuse_valid(t, pos)) return TD_NEXTUSE_NEVER;
    uint64_t shift;
    uint64_t base = fold(t, pos, &shift);
    return add_shift(t->next[base], shift);
}

uint64_t td_nextuse_of(const td_nextuse *t, uint32_t chunk, uint64_t pos)
{
    if (chunk >= t->n_chunks || !td_nextuse_valid(t, pos)) return TD_NEXTUSE_NEVER;
    uint64_t shift;
    uint64_t base = fold(t, pos, &shift);
    /* First occurrence >= base in chunk's sorted list. */
    uint32_t lo = t->occ_start[chunk], hi = t->occ_start[chunk + 1];
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (t->occ[mid] < base) lo = mid + 1;
        else hi = mid;
    }
    uint64_t v = lo < t->occ_start[chunk + 1] ? t->occ[lo] : t->wrap_first[chunk];
    return add_shift(v, shift);
}

/* ---- evictor --------------------------------------------------------------- */

#define NIL UINT32_MAX

struct td_evictor {
    td_evict_policy policy;
    uint32_t n_chunks, count;
    uint64_t total_bytes;
    uint64_t *bytes, *last, *next; /* [n_chunks] */
    uint8_t *dirty, *member;        /* [n_chunks] */
    /* belady: max-heap of candidates, where[c] = c's index in heap */
    uint32_t *heap, *where;
    /* lru: list, head = most recent, tail = least recent */
    uint32_t *prev, *succ;
    uint32_t head, tail;
};

void td_evictor_destroy(td_evictor *e)
{
    if (!e) return;
    td_free(e->bytes);
    td_free(e->last);
    td_free(e->next);
    td_free(e->dirty);
    td_free(e->member);
    td_free(e->heap);
    td_free(e->where);
    td_free(e->prev);
    td_free(e->succ);
    td_free(e);
}

td_status td_evictor_create(td_evict_policy policy, uint32_t n_chunks, const uint64_t *chunk_bytes,
                            td_evictor **out)
{
    td_status st = TD_OK;
    td_evictor *e = NULL;
    *out = NULL;
    if ((unsigned)policy >= TD_EVICT_POLICY_COUNT)
        TD_FAIL(TD_ERR_INVALID, "evictor: unknown policy %d", (int)policy);
    e = td_calloc(1, sizeof *e, TD_ROLE_META);
    if (!e) TD_FAIL(TD_ERR_NOMEM, "evictor: %s", td_error_msg());
    e->policy = policy;
    e->n_chunks = n_chunks;
    e->head = e->tail = NIL;
    size_t n = (size_t)n_chunks + 1;
    e->bytes = td_malloc(n * sizeof *e->bytes, TD_ROLE_META);
    e->last = td_calloc(n, sizeof *e->last, TD_ROLE_META);
    e->next = td_calloc(n, sizeof *e->next, TD_ROLE_META);
    e->dirty = td_calloc(n, 1, TD_ROLE_META);
    e->member = td_calloc(n, 1, TD_ROLE_META);
    if (!e->bytes || !e->last || !e->next || !e->dirty || !e->member)
        TD_FAIL(TD_ERR_NOMEM, "evictor for %u chunks: %s", n_chunks, td_error_msg());
    if (policy == TD_EVICT_BELADY) {
        e->heap = td_malloc(n * sizeof *e->heap, TD_ROLE_META);
        e->where = td_malloc(n * sizeof *e->where, TD_ROLE_META);
        if (!e->heap || !e->where) TD_FAIL(TD_ERR_NOMEM, "evictor for %u chunks: %s", n_chunks, td_error_msg());
    } else {
        e->prev = td_malloc(n * sizeof *e->prev, TD_ROLE_META);
        e->succ = td_malloc(n * sizeof *e->succ, TD_ROLE_META);
        if (!e->prev || !e->succ) TD_FAIL(TD_ERR_NOMEM, "evictor for %u chunks: %s", n_chunks, td_error_msg());
    }
    if (n_chunks) memcpy(e->bytes, chunk_bytes, (size_t)n_chunks * sizeof *e->bytes);
    *out = e;
    e = NULL;
cleanup:
    td_evictor_destroy(e);
    return st;
}

td_evict_policy td_evictor_policy(const td_evictor *e) { return e->policy; }
int td_evictor_contains(const td_evictor *e, uint32_t c) { return c < e->n_chunks && e->member[c]; }
uint32_t td_evictor_count(const td_evictor *e) { return e->count; }
uint64_t td_evictor_bytes(const td_evictor *e) { return e->total_bytes; }
uint64_t td_evictor_next_use(const td_evictor *e, uint32_t c) { return c < e->n_chunks ? e->next[c] : 0; }
int td_evictor_dirty(const td_evictor *e, uint32_t c) { return c < e->n_chunks && e->dirty[c]; }

/* Belady order: a before b when a is used later; at equal next use (only when
 * neither is used again) clean before dirty, then the lower id. */
static int belady_before(const td_evictor *e, uint32_t a, uint32_t b)
{
    if (e->next[a] != e->next[b]) return e->next[a] > e->next[b];
    if (e->dirty[a] != e->dirty[b]) return e->dirty[a] < e->dirty[b];
    return a < b;
}

static void heap_set(td_evictor *e, uint32_t i, uint32_t c)
{
    e->heap[i] = c;
    e->where[c] = i;
}

static void sift_up(td_evictor *e, uint32_t i)
{
    uint32_t c = e->heap[i];
    while (i > 0) {
        uint32_t p = (i - 1) / 2;
        if (!belady_before(e, c, e->heap[p])) break;
        heap_set(e, i, e->heap[p]);
        i = p;
    }
    heap_set(e, i, c);
}

static void sift_down(td_evictor *e, uint32_t i)
{
    uint32_t c = e->heap[i];
    for (;;) {
        uint32_t l = 2 * i + 1, best = l;
        if (l >= e->count) break;
        if (l + 1 < e->count && belady_before(e, e->heap[l + 1], e->heap[l])) best = l + 1;
        if (!belady_before(e, e->heap[best], c)) break;
        heap_set(e, i, e->heap[best]);
        i = best;
    }
    heap_set(e, i, c);
}

static void list_unlink(td_evictor *e, uint32_t c)
{
    if (e->prev[c] != NIL) e->succ[e->prev[c]] = e->succ[c];
    else e->head = e->succ[c];
    if (e->succ[c] != NIL) e->prev[e->succ[c]] = e->prev[c];
    else e->tail = e->prev[c];
}

static void list_push_head(td_evictor *e, uint32_t c)
{
    e->prev[c] = NIL;
    e->succ[c] = e->head;
    if (e->head != NIL) e->prev[e->head] = c;
    else e->tail = c;
    e->head = c;
}

td_status td_evictor_update(td_evictor *e, uint32_t c, uint64_t last_use, uint64_t next_use, int dirty)
{
    if (c >= e->n_chunks)
        return td_error_set(TD_ERR_INVALID, "evictor: chunk %u out of range (%u chunks)", c, e->n_chunks);
    int was = e->member[c];
    uint64_t old_last = e->last[c];
    e->last[c] = last_use;
    e->next[c] = next_use;
    e->dirty[c] = dirty ? 1 : 0;
    if (!was) {
        e->member[c] = 1;
        e->total_bytes += e->bytes[c];
        if (e->policy == TD_EVICT_BELADY) {
            heap_set(e, e->count++, c);
            sift_up(e, e->where[c]);
        } else {
            e->count++;
            list_push_head(e, c);
        }
        return TD_OK;
    }
    if (e->policy == TD_EVICT_BELADY) {
        sift_up(e, e->where[c]);
        sift_down(e, e->where[c]);
    } else if (last_use > old_last && e->head != c) {
        list_unlink(e, c);
        list_push_head(e, c);
    }
    return TD_OK;
}

void td_evictor_remove(td_evictor *e, uint32_t c)
{
    if (c >= e->n_chunks || !e->member[c]) return;
    e->member[c] = 0;
    e->total_bytes -= e->bytes[c];
    if (e->policy == TD_EVICT_BELADY) {
        uint32_t i = e->where[c];
        uint32_t last = e->heap[--e->count];
        if (i < e->count) {
            heap_set(e, i, last);
            sift_up(e, i);
            sift_down(e, e->where[last]);
        }
    } else {
        list_unlink(e, c);
        e->count--;
    }
}

int64_t td_evictor_pick(const td_evictor *e, uint64_t min_next_use)
{
    if (e->policy == TD_EVICT_BELADY) {
        /* The top is used latest: if it is needed too soon, all are. */
        if (e->count && e->next[e->heap[0]] >= min_next_use) return e->heap[0];
        return -1;
    }
    for (uint32_t c = e->tail; c != NIL; c = e->prev[c])
        if (e->next[c] >= min_next_use) return c;
    return -1;
}

/* Sums saturate: chunk sizes come from traces and may add past 2^64. */
static uint64_t add_sat(uint64_t a, uint64_t b)
{
    return b > UINT64_MAX - a ? UINT64_MAX : a + b;
}

uint64_t td_evictor_freeable(const td_evictor *e, uint64_t min_next_use, uint64_t enough)
{
    uint64_t sum = 0;
    if (e->policy == TD_EVICT_BELADY) {
        for (uint32_t i = 0; i < e->count && sum < enough; i++)
            if (e->next[e->heap[i]] >= min_next_use) sum = add_sat(sum, e->bytes[e->heap[i]]);
    } else {
        for (uint32_t c = e->tail; c != NIL && sum < enough; c = e->prev[c])
            if (e->next[c] >= min_next_use) sum = add_sat(sum, e->bytes[c]);
    }
    return sum;
}

/* Counts what is still missing rather than free + freed, which can pass
 * 2^64 when the caller's free bytes and the victims' together exceed it
 * (a room near UINT64_MAX with huge resident chunks). */
td_status td_evictor_make_room(td_evictor *e, uint64_t need_bytes, uint64_t free_bytes, uint64_t min_next_use,
                               uint32_t *victims, uint32_t *n_victims)
{
    *n_victims = 0;
    if (free_bytes >= need_bytes) return TD_OK;
    const uint64_t short_bytes = need_bytes - free_bytes;
    uint64_t can = td_evictor_freeable(e, min_next_use, short_bytes);
    if (can < short_bytes)
        return td_error_set(TD_ERR_BUDGET, "evictor: need %llu more bytes, but the %s candidates not needed "
                            "before position %llu hold only %llu", (unsigned long long)short_bytes,
                            td_evict_policy_name(e->policy), (unsigned long long)min_next_use,
                            (unsigned long long)can);
    uint32_t n = 0;
    uint64_t freed = 0; /* saturating; the loop ends once it reaches short_bytes */
    while (freed < short_bytes) {
        int64_t v = td_evictor_pick(e, min_next_use);
        if (v < 0) { /* freeable said there was enough: an evictor bug */
            *n_victims = n;
            return td_error_set(TD_ERR_STATE, "evictor: ran out of victims after %u", n);
        }
        td_evictor_remove(e, (uint32_t)v);
        victims[n++] = (uint32_t)v;
        freed = add_sat(freed, e->bytes[v]);
    }
    if (e->policy == TD_EVICT_BELADY) {
        /* With mixed sizes a late, large victim can make earlier small ones
         * unnecessary: keep those, nearest next use first.  (Never happens
         * with uniform sizes, where the furthest-first set is minimal.)
         * A saturated freed understates the surplus, so it can only keep
         * fewer victims back than the exact sum would, never too many. */
        uint32_t kept = 0;
        for (uint32_t i = n - 1; i-- > 0;) {
            uint32_t v = victims[i];
            if (freed - short_bytes >= e->bytes[v]) {
                freed -= e->bytes[v];
                td_evictor_update(e, v, e->last[v], e->next[v], e->dirty[v]);
                victims[i] = NIL;
                kept++;
            }
        }
        if (kept) {
            uint32_t m = 0;
            for (uint32_t i = 0; i < n; i++)
                if (victims[i] != NIL) victims[m++] = victims[i];
            n = m;
        }
    }
    *n_victims = n;
    return TD_OK;
}

/* ---- optimizer placement ------------------------------------------------- */

void td_optim_order_by_slack(int n, const uint64_t *ready, const uint64_t *need, uint64_t period, int *order)
{
    /* Insertion sort: a model has at most a few thousand chunks, ordered once. */
    for (int i = 0; i < n; i++) {
        uint64_t s = (period > ready[i] ? period - ready[i] : 0) + need[i];
        int j = i;
        for (; j > 0; j--) {
            int o = order[j - 1];
            uint64_t so = (period > ready[o] ? period - ready[o] : 0) + need[o];
            if (so <= s) break; /* stable: equal slack keeps the lower index first */
            order[j] = o;
        }
        order[j] = i;
    }
}
