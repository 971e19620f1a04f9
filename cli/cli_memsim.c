/* `tidal memsim`: replay a chunk access trace under a budget and an eviction
 * policy, and report what would move (see include/tidal/memsim.h). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include <cjson/cJSON.h>
#include "cli.h"
#include "tidal/memsim.h"
#include "tidal/util.h"

static void json_counts(cJSON *o, const td_memsim_counts *c)
{
    cJSON_AddNumberToObject(o, "accesses", (double)c->accesses);
    cJSON_AddNumberToObject(o, "loads", (double)c->loads);
    cJSON_AddNumberToObject(o, "demand_loads", (double)c->demand_loads);
    cJSON_AddNumberToObject(o, "stalls", (double)c->demand_loads);
    cJSON_AddNumberToObject(o, "prefetch_loads", (double)c->prefetch_loads);
    cJSON_AddNumberToObject(o, "prefetch_hits", (double)c->prefetch_hits);
    cJSON_AddNumberToObject(o, "prefetch_wasted", (double)c->prefetch_wasted);
    cJSON_AddNumberToObject(o, "evictions", (double)c->evictions);
    cJSON_AddNumberToObject(o, "writebacks", (double)c->writebacks);
    cJSON_AddNumberToObject(o, "bytes_h2d", (double)c->bytes_h2d);
    cJSON_AddNumberToObject(o, "bytes_d2h", (double)c->bytes_d2h);
}

static unsigned long long chunk_bytes_total(const td_trace *t)
{
    unsigned long long sum = 0;
    for (uint32_t i = 0; i < td_trace_chunk_count(t); i++) sum += td_trace_chunk_bytes(t, i);
    return sum;
}

static td_status print_json(const char *path, const td_trace *t, const td_memsim_params *p,
                            const td_memsim_result *r, double parse_ms, double sim_ms)
{
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "trace", path);
    cJSON_AddNumberToObject(j, "budget_bytes", (double)p->budget_bytes);
    cJSON_AddStringToObject(j, "policy", td_evict_policy_name(p->policy));
    cJSON_AddNumberToObject(j, "prefetch", p->prefetch);
    cJSON_AddNumberToObject(j, "chunks", (double)r->chunks);
    cJSON_AddNumberToObject(j, "chunk_bytes_total", (double)chunk_bytes_total(t));
    cJSON_AddNumberToObject(j, "steps", (double)r->steps);
    json_counts(j, &r->total);
    cJSON_AddNumberToObject(j, "peak_device_bytes", (double)r->peak_device_bytes);
    cJSON_AddNumberToObject(j, "peak_chunk_bytes", (double)r->peak_chunk_bytes);
    cJSON_AddNumberToObject(j, "peak_nonmodel_bytes", (double)r->peak_nonmodel_bytes);
    cJSON_AddNumberToObject(j, "compulsory_loads", (double)r->compulsory_loads);
    cJSON_AddNumberToObject(j, "dirtyings", (double)r->dirtyings);
    cJSON_AddNumberToObject(j, "dirty_end", (double)r->dirty_end);
    cJSON_AddNumberToObject(j, "resident_end", (double)r->resident_end);
    cJSON_AddNumberToObject(j, "resident_bytes_end", (double)r->resident_bytes_end);
    json_counts(cJSON_AddObjectToObject(j, "last_step"), &r->last_step);
    cJSON_AddNumberToObject(j, "parse_ms", parse_ms);
    cJSON_AddNumberToObject(j, "simulate_ms", sim_ms);
    return td_cli_print_json(j);
}

static void print_table(FILE *f, const char *path, const td_trace *t, const td_memsim_params *p,
                        const td_memsim_result *r, double parse_ms, double sim_ms)
{
    char a[32], b[32], c[32], d[32];
    const td_memsim_counts *k = &r->total;
    fprintf(f, "trace      %s: %llu chunks (%s), %llu steps, %llu accesses\n", path,
            (unsigned long long)r->chunks, td_format_bytes(chunk_bytes_total(t), a, sizeof a),
            (unsigned long long)r->steps, (unsigned long long)k->accesses);
    fprintf(f, "budget     %s, policy %s, prefetch %u\n", td_format_bytes(p->budget_bytes, a, sizeof a),
            td_evict_policy_name(p->policy), p->prefetch);
    fprintf(f, "loads      %llu (stalls %llu, prefetched %llu: %llu used, %llu wasted); compulsory %llu\n",
            (unsigned long long)k->loads, (unsigned long long)k->demand_loads,
            (unsigned long long)k->prefetch_loads, (unsigned long long)k->prefetch_hits,
            (unsigned long long)k->prefetch_wasted, (unsigned long long)r->compulsory_loads);
    fprintf(f, "evictions  %llu, writebacks %llu (dirtied %llu times, %llu still dirty at the end)\n",
            (unsigned long long)k->evictions, (unsigned long long)k->writebacks,
            (unsigned long long)r->dirtyings, (unsigned long long)r->dirty_end);
    fprintf(f, "moved      H2D %s, D2H %s\n", td_format_bytes(k->bytes_h2d, a, sizeof a),
            td_format_bytes(k->bytes_d2h, b, sizeof b));
    fprintf(f, "peak       %s on the device (chunks %s, non-model %s); budget %s\n",
            td_format_bytes(r->peak_device_bytes, a, sizeof a), td_format_bytes(r->peak_chunk_bytes, b, sizeof b),
            td_format_bytes(r->peak_nonmodel_bytes, c, sizeof c), td_format_bytes(p->budget_bytes, d, sizeof d));
    if (r->steps) {
        const td_memsim_counts *l = &r->last_step;
        fprintf(f, "last step  %llu accesses, %llu loads (stalls %llu), %llu writebacks, H2D %s, D2H %s\n",
                (unsigned long long)l->accesses, (unsigned long long)l->loads,
                (unsigned long long)l->demand_loads, (unsigned long long)l->writebacks,
                td_format_bytes(l->bytes_h2d, a, sizeof a), td_format_bytes(l->bytes_d2h, b, sizeof b));
    }
    fprintf(f, "time       parse %.1f ms, simulate %.1f ms\n", parse_ms, sim_ms);
}

static void log_event(void *ctx, const td_memsim_event *ev)
{
    FILE *f = ctx;
    unsigned long long pos = (unsigned long long)ev->pos, dev = (unsigned long long)ev->device_bytes;
    switch (ev->kind) {
    case TD_MEMSIM_LOAD:
        if (ev->prefetch)
            fprintf(f, "%llu load %u prefetch-for %llu device %llu\n", pos, ev->chunk,
                    (unsigned long long)ev->target, dev);
        else
            fprintf(f, "%llu load %u demand device %llu\n", pos, ev->chunk, dev);
        break;
    case TD_MEMSIM_EVICT:
        fprintf(f, "%llu evict %u %s device %llu\n", pos, ev->chunk, ev->writeback ? "writeback" : "clean", dev);
        break;
    case TD_MEMSIM_ACCESS:
        fprintf(f, "%llu access %u %c line %u device %llu\n", pos, ev->chunk, ev->write ? 'w' : 'r', ev->line, dev);
        break;
    case TD_MEMSIM_NONMODEL:
        fprintf(f, "%llu nonmodel %llu line %u device %llu\n", pos, (unsigned long long)ev->bytes, ev->line, dev);
        break;
    case TD_MEMSIM_STEP:
        fprintf(f, "%llu step line %u\n", pos, ev->line);
        break;
    }
}

int td_cli_memsim_main(int argc, char **argv)
{
    const char *trace_path = NULL, *policy_text = "belady", *log_path = NULL;
    size_t budget = 0;
    long prefetch = 0;
    int json = 0;
    td_opt table[] = {
        {"trace", TD_OPT_STRING, &trace_path, "FILE", "the trace ('-' reads standard input)", 0},
        {"budget", TD_OPT_SIZE, &budget, "BYTES", "device bytes for chunks + non-model bytes: 4096, 512MiB, 24GiB", 0},
        {"policy", TD_OPT_STRING, &policy_text, "P", "belady (default: furthest next use, wrapping into the next\n"
                                                     "step; clean before dirty on ties) or lru (baseline)", 0},
        {"prefetch", TD_OPT_LONG, &prefetch, "N", "issue loads up to N accesses ahead when they fit (default 0)", 0},
        {"json", TD_OPT_FLAG, &json, NULL, "print one JSON object instead of the table", 0},
        {"log", TD_OPT_STRING, &log_path, "FILE", "write every load, eviction, access and non-model change ('-': stdout)", 0},
        {NULL, 0, NULL, NULL, NULL, 0},
    };
    int rc = td_args_main(table, argc, argv, "memsim",
                          "usage: tidal memsim --trace FILE --budget BYTES [--policy belady|lru] [--prefetch N]\n"
                          "                    [--json] [--log FILE]\n\n"
                          "Replays a chunk access trace (written by --trace-out, or by hand; format in\n"
                          "docs/memory-manager.md) on a device of BYTES, evicting by the policy, and counts\n"
                          "loads (H2D), evictions, writebacks (D2H of dirty chunks) and the peak.");
    if (rc >= 0) return rc;
    rc = 1;
    td_memsim_params p = td_memsim_default_params();
    td_status st = td_args_require(table, "trace", "budget", NULL);
    if (!st && td_evict_policy_parse(policy_text, &p.policy) != TD_OK)
        st = td_error_prefix(TD_ERR_INVALID, "--policy: ");
    if (!st && (prefetch < 0 || prefetch > (long)UINT32_MAX))
        st = td_error_set(TD_ERR_INVALID, "--prefetch %ld must be a whole number of accesses (0 to %u)", prefetch,
                          UINT32_MAX);
    if (st) {
        fprintf(stderr, "tidal memsim: %s\n(tidal memsim --help lists the options)\n", td_error_msg());
        td_args_free();
        return 2;
    }
    p.budget_bytes = budget;
    p.prefetch = (uint32_t)prefetch;

    td_trace *t = NULL;
    FILE *log = NULL;
    td_memsim_result r;
    double t0 = td_now_ms();
    if (td_trace_load(trace_path, &t) != TD_OK) {
        fprintf(stderr, "tidal memsim: %s\n", td_error_msg());
        goto done;
    }
    double t1 = td_now_ms();
    if (log_path) {
        log = !strcmp(log_path, "-") ? stdout : fopen(log_path, "w");
        if (!log) {
            fprintf(stderr, "tidal memsim: cannot create --log file '%s': %s\n", log_path, strerror(errno));
            goto done;
        }
        p.on_event = log_event;
        p.ctx = log;
    }
    if (td_memsim_run(t, &p, &r) != TD_OK) {
        fprintf(stderr, "tidal memsim: %s\n", td_error_msg());
        goto done;
    }
    double t2 = td_now_ms();
    if (json && print_json(trace_path, t, &p, &r, t1 - t0, t2 - t1)) {
        fprintf(stderr, "tidal memsim: %s\n", td_error_msg());
        goto done;
    }
    if (!json) print_table(stdout, trace_path, t, &p, &r, t1 - t0, t2 - t1);
    rc = 0;
done:
    if (log && log != stdout && fclose(log) != 0 && rc == 0) {
        fprintf(stderr, "tidal memsim: writing --log file '%s' failed: %s\n", log_path, strerror(errno));
        rc = 1;
    }
    fflush(stdout);
    td_trace_destroy(t);
    td_args_free();
    return rc;
}
