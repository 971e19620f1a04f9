/* The offline simulator and the eviction policies it drives.
 *
 * Every run here is replayed event by event by an independent model (the
 * checker below) that asserts: the budget holds after every event, an
 * access finds its chunk resident, loads and evictions are of non-resident
 * and resident chunks, a writeback happens exactly when a dirty chunk is
 * evicted (so every dirtying is written back once, or is still dirty at the
 * end), each victim is the one its policy must choose (recomputed naively),
 * a prefetch never evicts a chunk needed before the one it loads, and the
 * reported counts equal the replayed ones.  On uniform chunk sizes Belady's
 * loads equal the exact optimum (a DP over residency sets), and Belady never
 * loads more than LRU on the corpus or on random traces. */
#include "td_test.h"
#include "tidal/memsim.h"
#include "../cli/cli.h"

#include <cJSON.h>
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *trace_dir(void)
{
    static char dir[512];
    if (!dir[0]) {
        const char *f = __FILE__;
        const char *slash = strrchr(f, '/');
        int n = slash ? (int)(slash - f) : 0;
        snprintf(dir, sizeof dir, "%.*s%sdata/traces", n, f, n ? "/" : "");
    }
    return dir;
}

static int corpus_paths(char paths[][512], int max)
{
    DIR *d = opendir(trace_dir());
    if (!d) fail_msg("cannot open the trace corpus %s", trace_dir());
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < max) {
        size_t len = strlen(e->d_name);
        if (len > 6 && !strcmp(e->d_name + len - 6, ".trace"))
            snprintf(paths[n++], 512, "%.300s/%.200s", trace_dir(), e->d_name);
    }
    closedir(d);
    return n;
}

/* ---- the checker: an independent replay of the schedule --------------------- */

#define MAXC 4096

typedef struct checker {
    const td_trace *t;
    const td_memsim_params *p;
    const uint32_t *seq;   /* access i's chunk */
    size_t n_access, period_start;
    int check_victims;     /* recompute each victim naively (small traces) */
    const td_trace_event *ev;
    size_t n_events, next_event;
    uint64_t pos;          /* the access being served or next */
    int after_access;      /* events now belong to the prefetch pass of `pos` */
    uint8_t resident[MAXC], dirty[MAXC], pending[MAXC];
    uint64_t stamp[MAXC], clock; /* LRU recency */
    uint64_t resident_bytes, nonmodel, peak;
    uint32_t held_victims[MAXC];  /* prefetch-pass victims awaiting their load */
    uint32_t n_held;
    uint32_t expected[MAXC], n_expected, i_expected; /* the victims of the batch in progress */
    int in_batch;
    size_t *event_of;      /* access i's index in the trace's events */
    td_memsim_counts c;
    uint64_t dirtyings;
} checker;

static uint32_t chunk_at(const checker *k, uint64_t q)
{
    size_t n = k->n_access, ps = k->period_start;
    return q < n ? k->seq[q] : k->seq[ps + (q - n) % (n - ps)];
}

/* The wrapped next use of chunk v at or after `from`, by scanning. */
static uint64_t naive_next(const checker *k, uint32_t v, uint64_t from)
{
    uint64_t horizon = k->period_start < k->n_access ? from + 2 * k->n_access + 2 : k->n_access;
    for (uint64_t q = from; q < horizon; q++)
        if (chunk_at(k, q) == v) return q;
    return TD_NEXTUSE_NEVER;
}

/* The most non-model bytes live from now until access j (by scanning). */
static uint64_t peak_nonmodel_until(const checker *k, uint64_t j)
{
    uint64_t peak = k->nonmodel;
    for (size_t e = k->event_of[k->pos] + 1; e < k->event_of[j]; e++)
        if (k->ev[e].kind == TD_TRACE_NONMODEL && k->ev[e].nonmodel_bytes > peak) peak = k->ev[e].nonmodel_bytes;
    return peak;
}

/* The target of the prefetch now being made room for: the first access
 * after pos, within the window, whose chunk is not resident. */
static uint64_t prefetch_target(const checker *k)
{
    for (uint64_t q = k->pos + 1; q <= k->pos + k->p->prefetch && q < k->n_access; q++)
        if (!k->resident[k->seq[q]]) return q;
    fail_msg("eviction in the prefetch pass of access %llu with nothing to prefetch", (unsigned long long)k->pos);
    return 0;
}

/* Policy order among resident chunks, next uses counted from `from`. */
static int victim_before(const checker *k, uint32_t a, uint32_t b, uint64_t from)
{
    if (k->p->policy == TD_EVICT_LRU) return k->stamp[a] < k->stamp[b];
    uint64_t na = naive_next(k, a, from), nb = naive_next(k, b, from);
    if (na != nb) return na > nb;
    if (k->dirty[a] != k->dirty[b]) return k->dirty[a] < k->dirty[b];
    return a < b;
}

/* The victims the policy must choose, in order: resident chunks whose next
 * use is >= min_next, in policy order, until need fits in free; for Belady
 * then without the earlier victims that later, larger ones made unneeded
 * (nearest next use kept first). */
static void expect_victims(checker *k, uint64_t need, uint64_t free_bytes, uint64_t from, uint64_t min_next)
{
    uint32_t cand[MAXC], n = 0;
    for (uint32_t c = 0; c < td_trace_chunk_count(k->t); c++)
        if (k->resident[c] && naive_next(k, c, from) >= min_next) cand[n++] = c;
    for (uint32_t i = 1; i < n; i++) /* insertion sort: small traces */
        for (uint32_t j = i; j > 0 && victim_before(k, cand[j], cand[j - 1], from); j--) {
            uint32_t tmp = cand[j]; cand[j] = cand[j - 1]; cand[j - 1] = tmp;
        }
    uint32_t m = 0;
    unsigned __int128 free_sum = free_bytes; /* free + victims can pass 2^64 */
    while (free_sum < need && m < n) free_sum += td_trace_chunk_bytes(k->t, cand[m++]);
    assert_true(free_sum >= need);
    uint8_t keep[MAXC] = {0};
    if (k->p->policy == TD_EVICT_BELADY && m > 0)
        for (uint32_t i = m - 1; i-- > 0;)
            if (free_sum - td_trace_chunk_bytes(k->t, cand[i]) >= need) {
                free_sum -= td_trace_chunk_bytes(k->t, cand[i]);
                keep[i] = 1;
            }
    k->n_expected = k->i_expected = 0;
    for (uint32_t i = 0; i < m; i++)
        if (!keep[i]) k->expected[k->n_expected++] = cand[i];
}

/* At the first eviction of a batch: what is the room for? */
static void start_batch(checker *k)
{
    uint64_t budget = k->p->budget_bytes, used = k->resident_bytes + k->nonmodel;
    if (k->after_access) { /* a prefetch: room until its use, see peak_nonmodel_until */
        /* The resident chunks must fit in the room the prefetched chunk
         * leaves (resident + chunk could pass 2^64 with chunks near it). */
        uint64_t j = prefetch_target(k), room = budget - peak_nonmodel_until(k, j);
        uint64_t b = td_trace_chunk_bytes(k->t, k->seq[j]);
        assert_true(b <= room);
        expect_victims(k, k->resident_bytes, room - b, k->pos + 1, j + 1);
    } else if (k->ev[k->next_event].kind == TD_TRACE_NONMODEL) {
        expect_victims(k, k->resident_bytes, budget - k->ev[k->next_event].nonmodel_bytes, k->pos, 0);
    } else { /* a demand load */
        assert_int_equal(k->ev[k->next_event].kind, TD_TRACE_ACCESS);
        expect_victims(k, td_trace_chunk_bytes(k->t, k->seq[k->pos]), budget - used, k->pos, 0);
    }
    k->in_batch = 1;
}

static void end_batch(checker *k)
{
    if (!k->in_batch) return;
    if (k->i_expected != k->n_expected)
        fail_msg("%s evicted %u chunks at pos %llu, expected %u", td_evict_policy_name(k->p->policy),
                 k->i_expected, (unsigned long long)k->pos, k->n_expected);
    k->in_batch = 0;
}

static void expect_trace_event(checker *k, td_trace_kind kind)
{
    assert_true(k->next_event < k->n_events);
    const td_trace_event *e = &k->ev[k->next_event];
    if (e->kind != kind)
        fail_msg("simulator reported kind %d, trace event %zu is kind %d", kind, k->next_event, e->kind);
}

static void on_event(void *ctx, const td_memsim_event *ev)
{
    checker *k = ctx;
    const uint64_t budget = k->p->budget_bytes;
    /* After an access and its prefetch pass, the next event that is not part
     * of that pass belongs to the next access. */
    if (k->after_access && ev->pos == k->pos + 1) {
        k->pos++;
        k->after_access = 0;
        k->n_held = 0;
    }
    assert_int_equal(ev->pos, k->pos);
    if (ev->kind != TD_MEMSIM_EVICT) end_batch(k);
    switch (ev->kind) {
    case TD_MEMSIM_LOAD: {
        uint32_t c = ev->chunk;
        assert_false(k->resident[c]);
        assert_int_equal(ev->bytes, td_trace_chunk_bytes(k->t, c));
        k->resident[c] = 1;
        k->resident_bytes += ev->bytes;
        k->c.loads++;
        k->c.bytes_h2d += ev->bytes;
        if (ev->prefetch) {
            /* Ahead of need, within the window, for the first use since pos. */
            assert_true(k->after_access);
            assert_true(ev->target > k->pos && ev->target <= k->pos + k->p->prefetch);
            assert_true(ev->target < k->n_access);
            assert_int_equal(k->seq[ev->target], c);
            assert_int_equal(naive_next(k, c, k->pos + 1), ev->target);
            /* It fits until its use, whatever the non-model bytes do meanwhile. */
            assert_true(peak_nonmodel_until(k, ev->target) <= budget &&
                        k->resident_bytes <= budget - peak_nonmodel_until(k, ev->target));
            for (uint32_t i = 0; i < k->n_held; i++) /* never evicts what is needed first */
                assert_true(naive_next(k, k->held_victims[i], k->pos + 1) > ev->target);
            k->n_held = 0;
            k->pending[c] = 1;
            k->c.prefetch_loads++;
            k->stamp[c] = ++k->clock;
        } else {
            assert_false(k->after_access);
            assert_int_equal(ev->target, k->pos);
            assert_int_equal(k->seq[k->pos], c);
            k->c.demand_loads++;
        }
        break;
    }
    case TD_MEMSIM_EVICT: {
        uint32_t c = ev->chunk;
        assert_true(k->resident[c]);
        assert_int_equal(ev->writeback, k->dirty[c]);
        if (k->check_victims) {
            /* Demand and non-model victims: the policy's choice among all
             * resident chunks.  Prefetch victims: among those not needed up
             * to the access being prefetched. */
            if (!k->in_batch) start_batch(k);
            if (k->i_expected >= k->n_expected || k->expected[k->i_expected] != c)
                fail_msg("%s evicted %u at pos %llu, expected %d", td_evict_policy_name(k->p->policy), c,
                         (unsigned long long)k->pos,
                         k->i_expected < k->n_expected ? (int)k->expected[k->i_expected] : -1);
            k->i_expected++;
            if (k->after_access) k->held_victims[k->n_held++] = c;
        }
        k->resident[c] = 0;
        if (k->dirty[c]) {
            k->c.writebacks++;
            k->c.bytes_d2h += ev->bytes;
        }
        if (k->pending[c]) k->c.prefetch_wasted++;
        k->dirty[c] = k->pending[c] = 0;
        k->resident_bytes -= ev->bytes;
        k->c.evictions++;
        break;
    }
    case TD_MEMSIM_ACCESS: {
        expect_trace_event(k, TD_TRACE_ACCESS);
        const td_trace_event *e = &k->ev[k->next_event++];
        uint32_t c = ev->chunk;
        assert_false(k->after_access);
        assert_true(k->pos < k->n_access);
        assert_int_equal(c, k->seq[k->pos]);
        assert_int_equal(c, e->chunk);
        assert_int_equal(ev->write, e->write);
        assert_int_equal(ev->line, e->line);
        assert_true(k->resident[c]); /* nothing is used before it arrives */
        if (k->pending[c]) {
            k->c.prefetch_hits++;
            k->pending[c] = 0;
        }
        if (e->write && !k->dirty[c]) {
            k->dirty[c] = 1;
            k->dirtyings++;
        }
        k->stamp[c] = ++k->clock;
        k->c.accesses++;
        k->after_access = 1;
        k->n_held = 0;
        break;
    }
    case TD_MEMSIM_NONMODEL:
        expect_trace_event(k, TD_TRACE_NONMODEL);
        assert_false(k->after_access);
        assert_int_equal(ev->bytes, k->ev[k->next_event].nonmodel_bytes);
        assert_int_equal(ev->line, k->ev[k->next_event].line);
        k->next_event++;
        k->nonmodel = ev->bytes;
        break;
    case TD_MEMSIM_STEP:
        expect_trace_event(k, TD_TRACE_STEP);
        assert_false(k->after_access);
        k->next_event++;
        break;
    }
    /* The budget invariant, after every event. */
    assert_int_equal(ev->device_bytes, k->resident_bytes + k->nonmodel);
    if (k->resident_bytes + k->nonmodel > budget)
        fail_msg("budget %llu exceeded: %llu chunk + %llu non-model bytes", (unsigned long long)budget,
                 (unsigned long long)k->resident_bytes, (unsigned long long)k->nonmodel);
    if (k->resident_bytes + k->nonmodel > k->peak) k->peak = k->resident_bytes + k->nonmodel;
}

/* Runs the simulator under the checker and compares the counts. */
static td_status run_checked(const td_trace *t, td_memsim_params p, td_memsim_result *r, int check_victims)
{
    checker *k = calloc(1, sizeof *k);
    assert_true(td_trace_chunk_count(t) <= MAXC);
    uint32_t *seq;
    size_t n;
    TD_ASSERT_OK(td_trace_access_sequence(t, &seq, &n));
    k->t = t;
    k->p = &p;
    k->seq = seq;
    k->n_access = n;
    k->period_start = td_trace_period_start(t);
    k->check_victims = check_victims;
    k->ev = td_trace_events(t);
    k->n_events = td_trace_event_count(t);
    k->event_of = malloc((n + 1) * sizeof *k->event_of);
    for (size_t e = 0, i = 0; e < k->n_events; e++)
        if (k->ev[e].kind == TD_TRACE_ACCESS) k->event_of[i++] = e;
    p.on_event = on_event;
    p.ctx = k;
    size_t live = td_host_live_allocs();
    td_status st = td_memsim_run(t, &p, r);
    assert_int_equal(td_host_live_allocs(), live);
    if (st == TD_OK) {
        assert_int_equal(k->next_event, k->n_events);
        const td_memsim_counts *c = &r->total;
        assert_int_equal(c->accesses, n);
        assert_int_equal(c->loads, k->c.loads);
        assert_int_equal(c->loads, c->demand_loads + c->prefetch_loads);
        assert_int_equal(c->demand_loads, k->c.demand_loads);
        assert_int_equal(c->prefetch_loads, k->c.prefetch_loads);
        assert_int_equal(c->prefetch_hits, k->c.prefetch_hits);
        assert_int_equal(c->prefetch_wasted, k->c.prefetch_wasted);
        assert_int_equal(c->evictions, k->c.evictions);
        assert_int_equal(c->writebacks, k->c.writebacks);
        assert_int_equal(c->bytes_h2d, k->c.bytes_h2d);
        assert_int_equal(c->bytes_d2h, k->c.bytes_d2h);
        assert_int_equal(r->peak_device_bytes, k->peak);
        assert_true(r->peak_device_bytes <= p.budget_bytes);
        assert_int_equal(r->dirtyings, k->dirtyings);
        /* Dirty data is never lost: each dirtying is written back once, or
         * the chunk is still dirty on the device at the end. */
        uint64_t dirty_end = 0, resident_end = 0;
        for (uint32_t i = 0; i < td_trace_chunk_count(t); i++) {
            dirty_end += k->dirty[i];
            resident_end += k->resident[i];
        }
        assert_int_equal(r->dirty_end, dirty_end);
        assert_int_equal(r->resident_end, resident_end);
        assert_int_equal(r->total.writebacks + r->dirty_end, r->dirtyings);
        /* Every prefetched chunk was used, wasted, or is still waiting. */
        uint64_t waiting = 0;
        for (uint32_t i = 0; i < td_trace_chunk_count(t); i++) waiting += k->pending[i];
        assert_int_equal(c->prefetch_hits + c->prefetch_wasted + waiting, c->prefetch_loads);
        assert_true(c->loads >= r->compulsory_loads);
        assert_true(c->evictions <= c->loads);
    }
    td_free(seq);
    free(k->event_of);
    free(k);
    return st;
}

static td_memsim_result run(const td_trace *t, uint64_t budget, td_evict_policy policy, uint32_t prefetch)
{
    td_memsim_params p = td_memsim_default_params();
    p.budget_bytes = budget;
    p.policy = policy;
    p.prefetch = prefetch;
    td_memsim_result r;
    TD_ASSERT_OK(run_checked(t, p, &r, td_trace_access_count(t) <= 400));
    return r;
}

/* ---- random traces --------------------------------------------------------- */

typedef struct gen_opts {
    uint32_t max_chunks;
    int max_accesses;
    int uniform;      /* all chunks the same size */
    int nonmodel;     /* non-model lines, including spikes between accesses */
} gen_opts;

/* A random valid trace and a budget it fits: accesses random, looping
 * (a step pattern repeated with variations) or local; writes, steps and
 * non-model changes mixed in. */
static td_trace *gen_trace(td_rng *rng, const gen_opts *o, uint64_t *budget_out)
{
    td_trace *t;
    TD_ASSERT_OK(td_trace_create("gen", &t));
    uint32_t n = 1 + (uint32_t)td_rng_below(rng, o->max_chunks);
    uint64_t unit = 1 + td_rng_below(rng, 5000), max_size = 0, total = 0;
    for (uint32_t c = 0; c < n; c++) {
        uint64_t b = o->uniform ? unit : 1 + td_rng_below(rng, 5000);
        TD_ASSERT_OK(td_trace_add_chunk(t, c, b, c + 2));
        if (b > max_size) max_size = b;
        total += b;
    }
    /* Budget: from one (largest) chunk to all of them, plus room for non-model bytes. */
    uint64_t budget = max_size + td_rng_below(rng, total - max_size + 1);
    if (o->uniform) budget = unit * (1 + td_rng_below(rng, n)) + td_rng_below(rng, unit);
    uint64_t nm_room = o->nonmodel ? td_rng_below(rng, 3 * max_size + 1) : 0;
    budget += nm_room;
    int len = 1 + (int)td_rng_below(rng, (uint64_t)o->max_accesses);
    int style = (int)td_rng_below(rng, 3);
    uint32_t pattern[64];
    int plen = 1 + (int)td_rng_below(rng, 16);
    for (int i = 0; i < plen; i++) pattern[i] = (uint32_t)td_rng_below(rng, n);
    uint32_t last = 0;
    for (int i = 0; i < len; i++) {
        if (style == 1 && i % plen == 0) TD_ASSERT_OK(td_trace_add_step(t, 0));
        else if (style != 1 && td_rng_below(rng, 12) == 0) TD_ASSERT_OK(td_trace_add_step(t, 0));
        if (o->nonmodel && td_rng_below(rng, 4) == 0) {
            if (td_rng_below(rng, 4) == 0) /* a spike up to the whole budget, then back */
                TD_ASSERT_OK(td_trace_add_nonmodel(t, budget - td_rng_below(rng, max_size + 1), 0));
            TD_ASSERT_OK(td_trace_add_nonmodel(t, td_rng_below(rng, nm_room + 1), 0));
        }
        uint32_t c;
        if (style == 1) c = td_rng_below(rng, 8) ? pattern[i % plen] : (uint32_t)td_rng_below(rng, n);
        else if (style == 2 && td_rng_below(rng, 3)) c = (last + (uint32_t)td_rng_below(rng, 3)) % n;
        else c = (uint32_t)td_rng_below(rng, n);
        last = c;
        TD_ASSERT_OK(td_trace_add_access(t, c, td_rng_below(rng, 3) == 0, 0));
    }
    *budget_out = budget;
    return t;
}

/* ---- exact optimum: DP over residency sets -------------------------------------- */

/* Minimum loads for a uniform-size trace: cost[S] = fewest loads so far that
 * leave exactly set S resident.  Evictions are free and may happen at any
 * time (a superset-min closure before each event), loads only on access. */
static uint64_t optimum_loads(const td_trace *t, uint64_t budget)
{
    uint32_t n = td_trace_chunk_count(t);
    assert_true(n <= 12);
    uint64_t S = td_trace_chunk_bytes(t, 0);
    size_t states = (size_t)1 << n;
    uint64_t *cost = malloc(states * sizeof *cost), *next = malloc(states * sizeof *next);
    const uint64_t INF = UINT64_MAX / 2;
    for (size_t m = 0; m < states; m++) cost[m] = INF;
    cost[0] = 0;
    uint64_t cap = budget / S;
    const td_trace_event *ev = td_trace_events(t);
    for (size_t i = 0; i < td_trace_event_count(t); i++) {
        if (ev[i].kind == TD_TRACE_STEP) continue;
        for (uint32_t b = 0; b < n; b++) /* voluntary evictions */
            for (size_t m = 0; m < states; m++)
                if (!(m & ((size_t)1 << b)) && cost[m | ((size_t)1 << b)] < cost[m]) cost[m] = cost[m | ((size_t)1 << b)];
        if (ev[i].kind == TD_TRACE_NONMODEL) {
            cap = (budget - ev[i].nonmodel_bytes) / S;
            for (size_t m = 0; m < states; m++)
                if ((uint64_t)__builtin_popcountll(m) > cap) cost[m] = INF;
            continue;
        }
        size_t bit = (size_t)1 << ev[i].chunk;
        for (size_t m = 0; m < states; m++) next[m] = INF;
        for (size_t m = 0; m < states; m++) {
            if (cost[m] >= INF) continue;
            if (m & bit) {
                if (cost[m] < next[m]) next[m] = cost[m];
            } else if ((uint64_t)__builtin_popcountll(m) + 1 <= cap && cost[m] + 1 < next[m | bit]) {
                next[m | bit] = cost[m] + 1;
            }
        }
        uint64_t *tmp = cost; cost = next; next = tmp;
    }
    uint64_t best = INF;
    for (size_t m = 0; m < states; m++)
        if (cost[m] < best) best = cost[m];
    free(cost);
    free(next);
    return best;
}

static void test_belady_optimal_on_uniform_sizes(void **state)
{
    int seeds = td_test_seeds(600), checked = 0, nontrivial = 0;
    for (int seed = 1; seed <= seeds; seed++) {
        td_rng rng;
        td_rng_seed(&rng, (uint64_t)seed * 977);
        gen_opts o = { .max_chunks = 7, .max_accesses = 40, .uniform = 1, .nonmodel = seed % 2 };
        uint64_t budget;
        td_trace *t = gen_trace(&rng, &o, &budget);
        td_memsim_result r = run(t, budget, TD_EVICT_BELADY, 0);
        uint64_t best = optimum_loads(t, budget);
        if (r.total.loads != best)
            fail_msg("seed %d: belady loads %llu, optimum %llu", seed, (unsigned long long)r.total.loads,
                     (unsigned long long)best);
        td_memsim_result lru = run(t, budget, TD_EVICT_LRU, 0);
        assert_true(lru.total.loads >= best);
        if (lru.total.loads > best) nontrivial++;
        checked++;
        td_trace_destroy(t);
    }
    /* The traces are hard enough that LRU is often not optimal. */
    assert_true(nontrivial > checked / 5);
}

static void test_belady_never_worse_than_lru_random(void **state)
{
    int seeds = td_test_seeds(1500), mixed_worse = 0, mixed_runs = 0;
    for (int seed = 1; seed <= seeds; seed++) {
        td_rng rng;
        td_rng_seed(&rng, (uint64_t)seed * 7919);
        gen_opts o = { .max_chunks = 40, .max_accesses = 300, .uniform = seed % 2, .nonmodel = (seed / 2) % 2 };
        uint64_t budget;
        td_trace *t = gen_trace(&rng, &o, &budget);
        td_memsim_result b = run(t, budget, TD_EVICT_BELADY, 0);
        td_memsim_result l = run(t, budget, TD_EVICT_LRU, 0);
        if (o.uniform) {
            if (b.total.loads > l.total.loads)
                fail_msg("seed %d: belady %llu loads > lru %llu", seed, (unsigned long long)b.total.loads,
                         (unsigned long long)l.total.loads);
        } else {
            mixed_runs++;
            mixed_worse += b.total.loads > l.total.loads;
            if (b.total.loads > l.total.loads && getenv("TD_DUMP")) {
                char name[64];
                snprintf(name, sizeof name, "/tmp/mixed_%d.trace", seed);
                TD_ASSERT_OK(td_trace_save(t, name));
                print_message("%s budget %llu: belady %llu lru %llu\n", name, (unsigned long long)budget,
                              (unsigned long long)b.total.loads, (unsigned long long)l.total.loads);
            }
        }
        /* Prefetching moves loads earlier but keeps every invariant. */
        for (uint32_t pf = 1; pf <= 16; pf *= 4) {
            td_memsim_result bp = run(t, budget, TD_EVICT_BELADY, pf);
            td_memsim_result lp = run(t, budget, TD_EVICT_LRU, pf);
            assert_true(bp.total.demand_loads <= bp.total.loads);
            (void)lp;
        }
        td_trace_destroy(t);
    }
    /* With mixed sizes Belady is a heuristic (optimal eviction is then
     * NP-hard): it can lose to LRU, rarely (1 in 5000 random traces here,
     * by 1 load, after a non-model spike). */
    print_message("mixed sizes: belady loaded more than lru on %d of %d random traces\n", mixed_worse, mixed_runs);
    assert_true(mixed_worse * 200 <= mixed_runs);
}

static void test_belady_never_worse_than_lru_corpus(void **state)
{
    char paths[64][512];
    int n = corpus_paths(paths, 64);
    assert_true(n >= 8);
    for (int i = 0; i < n; i++) {
        td_trace *t;
        TD_ASSERT_OK(td_trace_load(paths[i], &t));
        uint64_t lo = td_memsim_min_budget(t), total = 0, peak_nm = 0;
        for (uint32_t c = 0; c < td_trace_chunk_count(t); c++) total += td_trace_chunk_bytes(t, c);
        for (size_t e = 0; e < td_trace_event_count(t); e++)
            if (td_trace_events(t)[e].kind == TD_TRACE_NONMODEL && td_trace_events(t)[e].nonmodel_bytes > peak_nm)
                peak_nm = td_trace_events(t)[e].nonmodel_bytes;
        uint64_t hi = total + peak_nm;
        /* 40 budgets from the smallest that fits to everything resident. */
        for (int k = 0; k <= 40; k++) {
            uint64_t budget = lo + (hi - lo) * (uint64_t)k / 40;
            td_memsim_result b = run(t, budget, TD_EVICT_BELADY, 0);
            td_memsim_result l = run(t, budget, TD_EVICT_LRU, 0);
            if (b.total.loads > l.total.loads)
                fail_msg("%s at budget %llu: belady %llu loads > lru %llu", paths[i], (unsigned long long)budget,
                         (unsigned long long)b.total.loads, (unsigned long long)l.total.loads);
            if (k == 40) { /* everything fits: only the compulsory loads, nothing evicted */
                assert_int_equal(b.total.loads, b.compulsory_loads);
                assert_int_equal(b.total.evictions, 0);
                assert_int_equal(l.total.loads, l.compulsory_loads);
            }
            for (uint32_t pf = 1; pf <= 8; pf *= 8) {
                run(t, budget, TD_EVICT_BELADY, pf);
                run(t, budget, TD_EVICT_LRU, pf);
            }
        }
        td_trace_destroy(t);
    }
}

static td_trace *load_corpus(const char *name)
{
    char path[600];
    snprintf(path, sizeof path, "%s/%s", trace_dir(), name);
    td_trace *t;
    TD_ASSERT_OK(td_trace_load(path, &t));
    return t;
}

/* basic.trace under 2.5 MiB (two chunks + 512 KiB), worked out by hand in
 * docs/memory-manager.md. */
static void test_known_schedule(void **state)
{
    td_trace *t = load_corpus("basic.trace");
    td_memsim_result b = run(t, 2621440, TD_EVICT_BELADY, 0);
    assert_int_equal(b.total.loads, 5);
    assert_int_equal(b.total.evictions, 3);
    assert_int_equal(b.total.writebacks, 1);
    assert_int_equal(b.total.bytes_h2d, 5 * TD_MiB);
    assert_int_equal(b.total.bytes_d2h, TD_MiB);
    assert_int_equal(b.peak_device_bytes, 2621440);
    assert_int_equal(b.peak_nonmodel_bytes, 524288);
    assert_int_equal(b.compulsory_loads, 3);
    assert_int_equal(b.last_step.accesses, 5);
    assert_int_equal(b.last_step.loads, 2);
    assert_int_equal(b.dirtyings, 1); /* written twice while resident: one writeback */
    assert_int_equal(b.dirty_end, 0);
    td_memsim_result l = run(t, 2621440, TD_EVICT_LRU, 0);
    assert_int_equal(l.total.loads, 7);
    assert_int_equal(l.total.evictions, 5);
    assert_int_equal(l.total.writebacks, 1);
    td_trace_destroy(t);

    /* LRU's worst case: every access of a loop over one chunk more than fits misses. */
    t = load_corpus("cyclic.trace");
    l = run(t, 4096, TD_EVICT_LRU, 0);
    assert_int_equal(l.total.loads, 30);
    b = run(t, 4096, TD_EVICT_BELADY, 0);
    assert_true(b.total.loads <= 12);
    assert_int_equal(b.total.loads, optimum_loads(t, 4096));
    td_trace_destroy(t);
}

typedef struct victim_log { uint32_t victims[16]; int n; } victim_log;

static void log_victims(void *ctx, const td_memsim_event *ev)
{
    victim_log *v = ctx;
    if (ev->kind == TD_MEMSIM_EVICT && v->n < 16) v->victims[v->n++] = ev->chunk;
}

static victim_log victims_of(const char *text, uint64_t budget, td_evict_policy policy)
{
    td_trace *t;
    TD_ASSERT_OK(td_trace_parse(text, strlen(text), "v", &t));
    victim_log v = {0};
    td_memsim_params p = td_memsim_default_params();
    p.budget_bytes = budget;
    p.policy = policy;
    p.on_event = log_victims;
    p.ctx = &v;
    td_memsim_result r;
    TD_ASSERT_OK(td_memsim_run(t, &p, &r));
    td_trace_destroy(t);
    return v;
}

static void test_belady_ties_and_wrap(void **state)
{
    /* Chunks 0 and 1 are not used again, even after wrapping into the next
     * step (the period is the last step): a tie, broken clean before dirty. */
    victim_log v = victims_of("tidal-trace 1\nchunk 0 1\nchunk 1 1\nchunk 2 1\n"
                              "access 0 w\naccess 1 r\nstep\naccess 2 r\naccess 2 r\n", 2, TD_EVICT_BELADY);
    assert_int_equal(v.n, 1);
    assert_int_equal(v.victims[0], 1);
    v = victims_of("tidal-trace 1\nchunk 0 1\nchunk 1 1\nchunk 2 1\n"
                   "access 0 r\naccess 1 w\nstep\naccess 2 r\naccess 2 r\n", 2, TD_EVICT_BELADY);
    assert_int_equal(v.victims[0], 0);
    /* Both clean: the lower id. */
    v = victims_of("tidal-trace 1\nchunk 0 1\nchunk 1 1\nchunk 2 1\n"
                   "access 1 r\naccess 0 r\nstep\naccess 2 r\n", 2, TD_EVICT_BELADY);
    assert_int_equal(v.victims[0], 0);
    /* Wrap: at the last access neither 0 nor 1 is used again in the trace,
     * but the next step uses 0 first, so 1 goes. */
    v = victims_of("tidal-trace 1\nchunk 0 1\nchunk 1 1\nchunk 2 1\n"
                   "step\naccess 0 r\naccess 1 r\naccess 2 r\n", 2, TD_EVICT_BELADY);
    assert_int_equal(v.n, 1);
    assert_int_equal(v.victims[0], 1);
    /* ... and wrapping looks at the last step, not the first. */
    v = victims_of("tidal-trace 1\nchunk 0 1\nchunk 1 1\nchunk 2 1\nchunk 3 1\n"
                   "step\naccess 0 r\naccess 1 r\naccess 3 r\n"
                   "step\naccess 3 r\naccess 1 r\naccess 0 r\naccess 2 r\n", 3, TD_EVICT_BELADY);
    assert_int_equal(v.n, 1);
    assert_int_equal(v.victims[0], 0);
    /* LRU: the least recently used, whatever comes next. */
    v = victims_of("tidal-trace 1\nchunk 0 1\nchunk 1 1\nchunk 2 1\n"
                   "step\naccess 0 r\naccess 1 r\naccess 2 r\n", 2, TD_EVICT_LRU);
    assert_int_equal(v.victims[0], 0);
}

static void test_budget_errors(void **state)
{
    td_trace *t;
    const char *text = "tidal-trace 1\nchunk 0 100\nchunk 1 300\nstep\nnonmodel 50\naccess 0 r\n"
                       "# the big one\naccess 1 w\nnonmodel 500\nnonmodel 0\n";
    TD_ASSERT_OK(td_trace_parse(text, strlen(text), "fit.trace", &t));
    assert_int_equal(td_memsim_min_budget(t), 500);
    td_memsim_result r;
    td_memsim_params p = td_memsim_default_params();
    p.budget_bytes = 349;
    assert_int_equal(run_checked(t, p, &r, 1), TD_ERR_BUDGET);
    assert_non_null(strstr(td_error_msg(), "fit.trace:8: access to chunk 1 (300 B) with 50 B of non-model bytes "
                                           "live does not fit the budget 349 B; raise --budget to at least 500 B"));
    p.budget_bytes = 499;
    assert_int_equal(run_checked(t, p, &r, 1), TD_ERR_BUDGET);
    assert_non_null(strstr(td_error_msg(), "fit.trace:9: non-model bytes 500 B exceed the budget 499 B"));
    for (int pol = 0; pol < TD_EVICT_POLICY_COUNT; pol++) {
        p.budget_bytes = 500;
        p.policy = (td_evict_policy)pol;
        TD_ASSERT_OK(run_checked(t, p, &r, 1));
        assert_int_equal(r.peak_device_bytes, 500);
        assert_int_equal(r.total.writebacks, 1); /* the spike pushed dirty chunk 1 out */
        assert_int_equal(r.total.evictions, 2);
        p.prefetch = 3;
    }
    p.policy = (td_evict_policy)7;
    assert_int_equal(td_memsim_run(t, &p, &r), TD_ERR_INVALID);
    td_trace_destroy(t);
}

/* Sizes near 2^64 under the largest budget: a non-model line that leaves no
 * room evicts the resident chunk (resident + non-model once wrapped to a
 * small sum and kept it, past the budget); a prefetch whose chunk and the
 * resident ones pass 2^64 together evicts first; an eviction whose victim
 * and the free bytes pass 2^64 together.  Found by fuzz_trace. */
static void test_sizes_near_2_64(void **state)
{
    td_trace *t;
    const char *text = "tidal-trace 1\nchunk 0 60\naccess 0 r\nnonmodel 18446744073709551615\n";
    TD_ASSERT_OK(td_trace_parse(text, strlen(text), "wrap.trace", &t));
    td_memsim_result r;
    td_memsim_params p = td_memsim_default_params();
    p.budget_bytes = UINT64_MAX;
    TD_ASSERT_OK(run_checked(t, p, &r, 1));
    assert_int_equal(r.total.evictions, 1);
    assert_int_equal(r.resident_end, 0);
    td_trace_destroy(t);

    text = "tidal-trace 1\nchunk 0 9223372036854775808\nchunk 1 9223372036854775808\n"
           "access 0 r\naccess 1 r\naccess 0 r\n";
    TD_ASSERT_OK(td_trace_parse(text, strlen(text), "wrap2.trace", &t));
    for (int pol = 0; pol < TD_EVICT_POLICY_COUNT; pol++) {
        p.policy = (td_evict_policy)pol;
        p.prefetch = 2;
        TD_ASSERT_OK(run_checked(t, p, &r, 1));
        assert_true(r.peak_device_bytes == 9223372036854775808ull);
        assert_int_equal(r.total.loads, 3);
    }
    td_trace_destroy(t);

    /* Evicting the huge chunk covers the 10 bytes the non-model line takes;
     * free bytes + the victim's once passed 2^64, read as still short, and
     * the evictor ran out of victims (TD_ERR_STATE).  Found by fuzz_trace. */
    text = "tidal-trace 1\nchunk 0 18446744073709551515\nchunk 1 50\n"
           "access 0 r\naccess 1 r\nnonmodel 60\naccess 1 r\n";
    TD_ASSERT_OK(td_trace_parse(text, strlen(text), "wrap3.trace", &t));
    for (int pol = 0; pol < TD_EVICT_POLICY_COUNT; pol++)
        for (uint32_t pf = 0; pf <= 2; pf += 2) {
            p.policy = (td_evict_policy)pol;
            p.prefetch = pf;
            TD_ASSERT_OK(run_checked(t, p, &r, 1));
            assert_int_equal(r.total.evictions, 1);
            assert_int_equal(r.resident_end, 1);
            assert_int_equal(r.resident_bytes_end, 50);
        }
    td_trace_destroy(t);
}

/* Random budgets, also below what the trace needs and with chunks near the
 * 64-bit limit: the run succeeds exactly when the budget is at least
 * td_memsim_min_budget, and fails naming a line otherwise. */
static void test_budget_threshold_random(void **state)
{
    int seeds = td_test_seeds(400);
    for (int seed = 1; seed <= seeds; seed++) {
        td_rng rng;
        td_rng_seed(&rng, (uint64_t)seed * 104729);
        gen_opts o = { .max_chunks = 12, .max_accesses = 60, .uniform = seed % 3 == 0, .nonmodel = seed % 2 };
        uint64_t fits;
        td_trace *t = gen_trace(&rng, &o, &fits);
        if (seed % 5 == 0) /* a chunk too large for any budget, accessed last */
            TD_ASSERT_OK(td_trace_add_chunk(t, td_trace_chunk_count(t), UINT64_MAX - td_rng_below(&rng, 10), 99));
        if (seed % 5 == 0) TD_ASSERT_OK(td_trace_add_access(t, td_trace_chunk_count(t) - 1, 1, 100));
        uint64_t min = td_memsim_min_budget(t);
        uint64_t budget = td_rng_below(&rng, 2) ? td_rng_below(&rng, fits + 1) : fits;
        if (td_rng_below(&rng, 4) == 0 && min < UINT64_MAX) budget = min - td_rng_below(&rng, 2);
        td_memsim_params p = td_memsim_default_params();
        p.budget_bytes = budget;
        p.policy = (td_evict_policy)(seed % 2);
        p.prefetch = (uint32_t)td_rng_below(&rng, 6);
        td_memsim_result r;
        td_status st = run_checked(t, p, &r, 1);
        if (budget >= min) {
            TD_ASSERT_OK(st);
        } else {
            assert_int_equal(st, TD_ERR_BUDGET);
            assert_non_null(strstr(td_error_msg(), "gen:"));
            assert_non_null(strstr(td_error_msg(), "raise --budget to at least"));
        }
        td_trace_destroy(t);
    }
}

/* The n-th allocation fails, for every n a run reaches: an error, no leak. */
static void test_alloc_failures(void **state)
{
    td_trace *t = load_corpus("gpt_gpu_adam.trace");
    size_t live = td_host_live_allocs();
    int failures = 0;
    for (long n = 1;; n++) {
        td_memsim_params p = td_memsim_default_params();
        p.budget_bytes = td_memsim_min_budget(t) + 100 * TD_MiB;
        p.prefetch = 2;
        td_memsim_result r;
        td_fault_arm(TD_FAULT_HOST_ALLOC, n);
        td_status st = td_memsim_run(t, &p, &r);
        long reached = td_fault_count(TD_FAULT_HOST_ALLOC);
        td_fault_disarm_all();
        assert_int_equal(td_host_live_allocs(), live);
        if (st == TD_OK) {
            assert_true(reached < n);
            break;
        }
        assert_int_equal(st, TD_ERR_NOMEM);
        failures++;
    }
    assert_true(failures >= 5);
    td_trace_destroy(t);
}

static void test_prefetch(void **state)
{
    td_trace *t = load_corpus("gpt_tiny.trace");
    uint64_t total = 0;
    for (uint32_t c = 0; c < td_trace_chunk_count(t); c++) total += td_trace_chunk_bytes(t, c);
    /* Everything fits: with any lookahead only the first access stalls. */
    for (int pol = 0; pol < TD_EVICT_POLICY_COUNT; pol++) {
        td_memsim_result r = run(t, total + 256 * TD_MiB, (td_evict_policy)pol, 1);
        assert_int_equal(r.total.demand_loads, 1);
        assert_int_equal(r.total.loads, r.compulsory_loads);
        assert_int_equal(r.total.prefetch_hits, r.compulsory_loads - 1);
        assert_int_equal(r.total.prefetch_wasted, 0);
    }
    /* Under pressure a lookahead removes stalls without changing what has
     * to move by much. */
    uint64_t budget = td_memsim_min_budget(t) + total / 3;
    td_memsim_result r0 = run(t, budget, TD_EVICT_BELADY, 0);
    td_memsim_result r4 = run(t, budget, TD_EVICT_BELADY, 4);
    assert_int_equal(r0.total.demand_loads, r0.total.loads);
    assert_true(r4.total.demand_loads < r0.total.demand_loads);
    assert_true(r4.total.prefetch_hits > 0);
    print_message("gpt_tiny at %llu MiB: belady stalls %llu -> %llu with prefetch 4 (loads %llu -> %llu)\n",
                  (unsigned long long)(budget >> 20), (unsigned long long)r0.total.demand_loads,
                  (unsigned long long)r4.total.demand_loads, (unsigned long long)r0.total.loads,
                  (unsigned long long)r4.total.loads);
    td_trace_destroy(t);
}

/* ---- the command ------------------------------------------------------------- */

typedef struct captured { int rc; char out[1 << 16]; char err[4096]; } captured;

static void slurp(int fd, char *buf, size_t cap)
{
    lseek(fd, 0, SEEK_SET);
    ssize_t n = read(fd, buf, cap - 1);
    buf[n > 0 ? n : 0] = '\0';
}

/* Runs `tidal memsim ARGS` in this process with stdout and stderr captured. */
static void cli(captured *c, int argc, const char **argv)
{
    char out_path[] = "/tmp/td_memsim_out_XXXXXX", err_path[] = "/tmp/td_memsim_err_XXXXXX";
    int out_fd = mkstemp(out_path), err_fd = mkstemp(err_path);
    assert_true(out_fd >= 0 && err_fd >= 0);
    fflush(stdout);
    fflush(stderr);
    int saved_out = dup(1), saved_err = dup(2);
    dup2(out_fd, 1);
    dup2(err_fd, 2);
    c->rc = td_cli_memsim_main(argc, (char **)argv);
    fflush(stdout);
    fflush(stderr);
    dup2(saved_out, 1);
    dup2(saved_err, 2);
    close(saved_out);
    close(saved_err);
    slurp(out_fd, c->out, sizeof c->out);
    slurp(err_fd, c->err, sizeof c->err);
    close(out_fd);
    close(err_fd);
    remove(out_path);
    remove(err_path);
}

static uint64_t json_u64(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(v)) fail_msg("JSON has no number '%s'", key);
    return (uint64_t)v->valuedouble;
}

static void test_cli(void **state)
{
    static captured c;
    char path[600];
    snprintf(path, sizeof path, "%s/gpt_tiny.trace", trace_dir());
    const char *argv[] = {"--trace", path, "--budget", "400MiB", "--policy", "lru", "--prefetch=2", "--json"};
    cli(&c, 8, argv);
    assert_int_equal(c.rc, 0);
    cJSON *j = cJSON_Parse(c.out);
    if (!j) fail_msg("not JSON: %s", c.out);
    td_trace *t;
    TD_ASSERT_OK(td_trace_load(path, &t));
    td_memsim_result r = run(t, 400 * TD_MiB, TD_EVICT_LRU, 2);
    assert_int_equal(json_u64(j, "budget_bytes"), 400 * TD_MiB);
    assert_string_equal(cJSON_GetObjectItem(j, "policy")->valuestring, "lru");
    assert_int_equal(json_u64(j, "prefetch"), 2);
    assert_int_equal(json_u64(j, "loads"), r.total.loads);
    assert_int_equal(json_u64(j, "evictions"), r.total.evictions);
    assert_int_equal(json_u64(j, "writebacks"), r.total.writebacks);
    assert_int_equal(json_u64(j, "bytes_h2d"), r.total.bytes_h2d);
    assert_int_equal(json_u64(j, "bytes_d2h"), r.total.bytes_d2h);
    assert_int_equal(json_u64(j, "peak_device_bytes"), r.peak_device_bytes);
    assert_int_equal(json_u64(j, "stalls"), r.total.demand_loads);
    assert_int_equal(json_u64(j, "prefetch_loads"), r.total.prefetch_loads);
    assert_int_equal(json_u64(j, "accesses"), td_trace_access_count(t));
    const cJSON *last = cJSON_GetObjectItem(j, "last_step");
    assert_int_equal(json_u64(last, "loads"), r.last_step.loads);
    cJSON_Delete(j);
    td_trace_destroy(t);

    /* The table names the policy and the counts. */
    const char *argv2[] = {"--trace", path, "--budget", "400MiB"};
    cli(&c, 4, argv2);
    assert_int_equal(c.rc, 0);
    assert_non_null(strstr(c.out, "policy belady"));
    assert_non_null(strstr(c.out, "writebacks"));

    /* Usage errors exit 2, runtime errors 1, each with a message. */
    const char *no_budget[] = {"--trace", path};
    cli(&c, 2, no_budget);
    assert_int_equal(c.rc, 2);
    assert_non_null(strstr(c.err, "--budget BYTES is required"));
    const char *bad_budget[] = {"--trace", path, "--budget", "lots"};
    cli(&c, 4, bad_budget);
    assert_int_equal(c.rc, 2);
    assert_non_null(strstr(c.err, "--budget"));
    const char *bad_policy[] = {"--trace", path, "--budget", "1GiB", "--policy", "fifo"};
    cli(&c, 6, bad_policy);
    assert_int_equal(c.rc, 2);
    assert_non_null(strstr(c.err, "use belady or lru"));
    const char *bad_prefetch[] = {"--trace", path, "--budget", "1GiB", "--prefetch", "-1"};
    cli(&c, 6, bad_prefetch);
    assert_int_equal(c.rc, 2);
    const char *missing_value[] = {"--trace", path, "--budget"};
    cli(&c, 3, missing_value);
    assert_int_equal(c.rc, 2);
    assert_non_null(strstr(c.err, "--budget needs a value"));
    const char *unknown[] = {"--trace", path, "--budget", "1GiB", "--fast"};
    cli(&c, 5, unknown);
    assert_int_equal(c.rc, 2);
    const char *too_small[] = {"--trace", path, "--budget", "100MiB"};
    cli(&c, 4, too_small);
    assert_int_equal(c.rc, 1);
    assert_non_null(strstr(c.err, "gpt_tiny.trace:"));
    assert_non_null(strstr(c.err, "raise --budget to at least"));
    const char *missing[] = {"--trace", "/nonexistent.trace", "--budget", "1GiB"};
    cli(&c, 4, missing);
    assert_int_equal(c.rc, 1);
    assert_non_null(strstr(c.err, "/nonexistent.trace"));
    const char *help[] = {"--help"};
    cli(&c, 1, help);
    assert_int_equal(c.rc, 0);
    assert_non_null(strstr(c.out, "usage: tidal memsim"));

    /* --log: one line per event, loads and evictions included. */
    char log_path[] = "/tmp/td_memsim_log_XXXXXX";
    int fd = mkstemp(log_path);
    close(fd);
    snprintf(path, sizeof path, "%s/basic.trace", trace_dir());
    const char *logged[] = {"--trace", path, "--budget", "2621440", "--log", log_path};
    cli(&c, 6, logged);
    assert_int_equal(c.rc, 0);
    FILE *f = fopen(log_path, "r");
    char line[256];
    int loads = 0, writebacks = 0, lines = 0;
    while (fgets(line, sizeof line, f)) {
        lines++;
        loads += strstr(line, " load ") != NULL;
        writebacks += strstr(line, " evict 2 writeback") != NULL;
    }
    fclose(f);
    remove(log_path);
    assert_int_equal(loads, 5);
    assert_int_equal(writebacks, 1);
    assert_true(lines > 20);
}

/* ---- scale ------------------------------------------------------------------- */

/* A GPT-like trace: per step, forward over the blocks (reads), backward in
 * reverse (read params, write grads), non-model bytes rising and falling. */
static td_trace *big_trace(uint32_t blocks, size_t accesses)
{
    td_trace *t;
    TD_ASSERT_OK(td_trace_create("big", &t));
    for (uint32_t c = 0; c < 2 * blocks; c++) TD_ASSERT_OK(td_trace_add_chunk(t, c, 64 * TD_MiB, 0));
    size_t n = 0;
    while (n < accesses) {
        TD_ASSERT_OK(td_trace_add_step(t, 0));
        for (uint32_t b = 0; b < blocks && n < accesses; b++, n++) {
            TD_ASSERT_OK(td_trace_add_access(t, b, 0, 0));
            TD_ASSERT_OK(td_trace_add_nonmodel(t, (uint64_t)(b + 1) * 8 * TD_MiB, 0));
        }
        for (uint32_t b = blocks; b-- > 0 && n + 1 < accesses; n += 2) {
            TD_ASSERT_OK(td_trace_add_access(t, b, 0, 0));
            TD_ASSERT_OK(td_trace_add_access(t, blocks + b, 1, 0));
            TD_ASSERT_OK(td_trace_add_nonmodel(t, (uint64_t)b * 8 * TD_MiB, 0));
        }
    }
    return t;
}

static void test_million_accesses(void **state)
{
    td_trace *t = big_trace(2000, 1000000);
    assert_int_equal(td_trace_access_count(t), 1000000);
    /* 4000 chunks of 64 MiB = 250 GiB of model under a 64 GiB budget. */
    for (int pol = TD_EVICT_POLICY_COUNT; pol-- > 0;) {
        for (uint32_t pf = 0; pf <= 16; pf += 16) {
            td_memsim_params p = td_memsim_default_params();
            p.budget_bytes = 64 * TD_GiB;
            p.policy = (td_evict_policy)pol;
            p.prefetch = pf;
            td_memsim_result r;
            double t0 = td_now_ms();
            TD_ASSERT_OK(td_memsim_run(t, &p, &r));
            double ms = td_now_ms() - t0;
            print_message("1M accesses, 4000 chunks, %s prefetch %u: %.0f ms, %llu loads, %llu stalls\n",
                          td_evict_policy_name(p.policy), pf, ms, (unsigned long long)r.total.loads,
                          (unsigned long long)r.total.demand_loads);
            assert_true(r.peak_device_bytes <= p.budget_bytes);
            assert_int_equal(r.total.writebacks + r.dirty_end, r.dirtyings);
        }
    }
    td_trace_destroy(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_known_schedule),
        cmocka_unit_test(test_belady_ties_and_wrap),
        cmocka_unit_test(test_budget_errors),
        cmocka_unit_test(test_sizes_near_2_64),
        cmocka_unit_test(test_budget_threshold_random),
        cmocka_unit_test(test_alloc_failures),
        cmocka_unit_test(test_prefetch),
        cmocka_unit_test(test_belady_optimal_on_uniform_sizes),
        cmocka_unit_test(test_belady_never_worse_than_lru_random),
        cmocka_unit_test(test_belady_never_worse_than_lru_corpus),
        cmocka_unit_test(test_cli),
        cmocka_unit_test(test_million_accesses),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
