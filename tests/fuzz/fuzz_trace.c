/* libFuzzer target: the chunk access trace format (memmgr/trace.c) and the
 * simulator that replays it (memmgr/memsim.c, `tidal memsim`).
 *
 * The input is a trace file.  It is parsed twice, from memory
 * (td_trace_parse) and from a stream (td_trace_read, the path
 * `tidal memsim --trace FILE` takes), and both must agree.  An accepted trace
 * must survive the writer: parse(write(t)) == t.  Then it is replayed under
 * both eviction policies, with and without prefetch, at the budget
 * td_memsim_min_budget says is enough, which must then succeed. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "tidal/memsim.h"
#include "tidal/trace.h"

/* Replays are linear in the accesses; keep each input fast. */
#define REPLAY_MAX_ACCESSES 4096

/* The model's invariant, checked on every event with 128-bit sums of our
 * own: resident chunk bytes + non-model bytes never exceed the budget, and
 * the simulator's device_bytes is that sum (a 64-bit wrap would show). */
typedef struct replay_check {
    const td_trace *t;
    uint64_t budget;
    uint8_t *resident;
    unsigned __int128 resident_bytes, nonmodel;
} replay_check;

static void on_event(void *ctx, const td_memsim_event *ev)
{
    replay_check *c = ctx;
    switch (ev->kind) {
    case TD_MEMSIM_LOAD:
        FUZZ_CHECK(ev->chunk < td_trace_chunk_count(c->t) && !c->resident[ev->chunk]);
        c->resident[ev->chunk] = 1;
        c->resident_bytes += td_trace_chunk_bytes(c->t, ev->chunk);
        break;
    case TD_MEMSIM_EVICT:
        FUZZ_CHECK(ev->chunk < td_trace_chunk_count(c->t) && c->resident[ev->chunk]);
        c->resident[ev->chunk] = 0;
        c->resident_bytes -= td_trace_chunk_bytes(c->t, ev->chunk);
        break;
    case TD_MEMSIM_ACCESS: FUZZ_CHECK(ev->chunk < td_trace_chunk_count(c->t) && c->resident[ev->chunk]); break;
    case TD_MEMSIM_NONMODEL: c->nonmodel = ev->bytes; break;
    case TD_MEMSIM_STEP: break;
    }
    FUZZ_CHECK(c->resident_bytes + c->nonmodel <= c->budget);
    FUZZ_CHECK(ev->device_bytes == (uint64_t)(c->resident_bytes + c->nonmodel));
}

/* One run; returns its status. */
static td_status replay_one(const td_trace *t, uint64_t budget, int policy, uint32_t prefetch)
{
    replay_check c = {t, budget, calloc(td_trace_chunk_count(t) + 1, 1), 0, 0};
    FUZZ_CHECK(c.resident);
    td_memsim_params p = td_memsim_default_params();
    p.budget_bytes = budget;
    p.policy = policy ? TD_EVICT_LRU : TD_EVICT_BELADY;
    p.prefetch = prefetch;
    p.on_event = on_event;
    p.ctx = &c;
    td_memsim_result r;
    td_status st = td_memsim_run(t, &p, &r);
    if (st == TD_OK) {
        FUZZ_CHECK(r.peak_device_bytes <= budget);
        FUZZ_CHECK(r.total.accesses == td_trace_access_count(t));
        FUZZ_CHECK(r.total.loads >= r.compulsory_loads);
    } else {
        FUZZ_CHECK(st == TD_ERR_BUDGET);
    }
    free(c.resident);
    return st;
}

/* td_memsim_min_budget is the threshold: a run fails below it and succeeds
 * at it and above.  It saturates at UINT64_MAX for a trace whose need does
 * not fit 64 bits; such a trace is only checked for not crashing. */
static void replay(const td_trace *t)
{
    if (td_trace_access_count(t) > REPLAY_MAX_ACCESSES) return;
    const uint64_t min = td_memsim_min_budget(t);
    for (int policy = 0; policy < 2; policy++)
        for (uint32_t prefetch = 0; prefetch <= 2; prefetch += 2) {
            td_status at_min = replay_one(t, min, policy, prefetch);
            td_status at_max = replay_one(t, UINT64_MAX, policy, prefetch);
            if (min < UINT64_MAX) {
                if (at_min != TD_OK) fprintf(stderr, "memsim at min budget %llu: %s\n", (unsigned long long)min, td_error_msg());
                FUZZ_CHECK(at_min == TD_OK && at_max == TD_OK);
            }
            if (min > 0) FUZZ_CHECK(replay_one(t, min - 1, policy, prefetch) == TD_ERR_BUDGET || min == UINT64_MAX);
        }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const size_t live = td_host_live_allocs();
    td_trace *a = NULL, *b = NULL, *c = NULL;
    td_status sa = td_trace_parse((const char *)data, size, "fuzz.trace", &a);
    FUZZ_CHECK((sa == TD_OK) == (a != NULL));

    td_status sb;
    if (size) { /* fmemopen refuses an empty buffer */
        FILE *f = fmemopen((void *)data, size, "r");
        FUZZ_CHECK(f);
        sb = td_trace_read(f, "fuzz.trace", &b);
        fclose(f);
    } else {
        sb = td_trace_parse("", 0, "fuzz.trace", &b);
    }
    FUZZ_CHECK(sa == sb);
    if (sa == TD_OK) {
        FUZZ_CHECK(td_trace_equal(a, b));
        char *text = NULL;
        size_t len = 0;
        FILE *w = open_memstream(&text, &len);
        FUZZ_CHECK(w && td_trace_write(a, w) == TD_OK);
        fclose(w);
        if (td_trace_parse(text, len, "rewritten", &c) != TD_OK)
            fprintf(stderr, "written trace does not parse: %s\n%s", td_error_msg(), text);
        FUZZ_CHECK(c && td_trace_equal(a, c));
        free(text);

        uint32_t *seq = NULL;
        size_t n = 0;
        FUZZ_CHECK(td_trace_access_sequence(a, &seq, &n) == TD_OK && n == td_trace_access_count(a));
        for (size_t i = 0; i < n; i++) FUZZ_CHECK(seq[i] < td_trace_chunk_count(a));
        FUZZ_CHECK(td_trace_period_start(a) <= n);
        td_free(seq);
        for (uint32_t i = 0; i < td_trace_chunk_count(a); i++) FUZZ_CHECK(td_trace_chunk_bytes(a, i) > 0);
        replay(a);
    }
    td_trace_destroy(a);
    td_trace_destroy(b);
    td_trace_destroy(c);
    FUZZ_CHECK(td_host_live_allocs() == live);
    return 0;
}
