/* `tidal bench copy`: host<->device bandwidth through the copy engine beside
 * raw pinned copies (cudaMemcpyAsync on its own streams), in one run.
 * Each figure is the median over --iters transfers of --bytes each, host
 * wall clock from submit to completion; "both" moves --bytes each way at
 * once and counts both.  The engine's pinned buffers come from the pinned
 * pool and its device buffers from the arena, exactly as in training. */
#include "../cli/cli.h"
#include "../cli/args.h"
#include "copy_raw.h"
#include "tidal/arena.h"
#include "tidal/copy.h"
#include "tidal/hostpool.h"
#include "tidal/topo.h"
#include "tidal/util.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct buffers { void *host_src, *host_dst, *dev_a, *dev_b; size_t bytes; } buffers;

static td_status engine_ms(td_copy_engine *eng, raw_mode mode, const buffers *b, double *ms)
{
    td_copy_ticket up = {0}, down = {0};
    td_status st = TD_OK;
    double t0 = td_now_ms();
    if (mode != RAW_D2H && (st = td_copy_submit(eng, TD_COPY_H2D, b->dev_a, b->host_src, b->bytes, NULL, &up))) return st;
    if (mode != RAW_H2D && (st = td_copy_submit(eng, TD_COPY_D2H, b->host_dst, b->dev_b, b->bytes, NULL, &down))) return st;
    if ((st = td_copy_wait(eng, &up)) || (st = td_copy_wait(eng, &down))) return st;
    *ms = td_now_ms() - t0;
    return TD_OK;
}

/* One run of the benchmark: its options, what it set up, what it measured. */
typedef struct copy_bench {
    size_t bytes, chunk;
    int iters, json, cuda;
    td_backend_params bp;
    td_backend *be;
    td_topo *topo;
    td_hostpool *pool;
    td_arena *arena;
    td_copy_engine *eng;
    buffers buf;
    double raw_gbs[3], eng_gbs[3];
} copy_bench;

static const char *const direction_names[] = {"h2d", "d2h", "both"};

/* -1 to go on, else the exit code. */
static int copy_options(copy_bench *cb, int argc, char **argv)
{
    const char *backend = "auto";
    td_opt table[] = {
        {"bytes", TD_OPT_SIZE, &cb->bytes, "SIZE", "bytes per transfer (default 1GiB on cuda, 256MiB on cpu)", 0},
        {"chunk", TD_OPT_SIZE, &cb->chunk, "SIZE", "the engine's piece size (default 64MiB)", 0},
        {"iters", TD_OPT_INT, &cb->iters, "N", "timed transfers per figure, median reported (default 10)", 0},
        {"backend", TD_OPT_STRING, &backend, "B", "auto (default), cpu or cuda", 0},
        {"json", TD_OPT_FLAG, &cb->json, NULL, "one JSON object on stdout instead of the table", 0},
        {NULL, 0, NULL, NULL, NULL, 0},
    };
    int rc = td_args_main(table, argc, argv, "bench copy",
                          "usage: tidal bench copy [--bytes SIZE] [--chunk SIZE] [--iters N] [--backend auto|cpu|cuda] [--json]\n\n"
                          "Measures H2D, D2H and both directions at once through tidal's copy engine and\n"
                          "through raw copies on the same pinned buffers, and prints GB/s (1e9 bytes/s).");
    if (rc >= 0) return rc;
    td_status st = TD_OK;
    if (td_args_find(table, "bytes")->seen && !cb->bytes) st = td_error_set(TD_ERR_INVALID, "--bytes must be positive");
    else if (!cb->chunk) st = td_error_set(TD_ERR_INVALID, "--chunk must be positive");
    else if (cb->iters < 1 || cb->iters > 100000) st = td_error_set(TD_ERR_INVALID, "--iters %d: use 1 to 100000", cb->iters);
    else if (td_backend_kind_parse(backend, &cb->bp.kind)) st = td_error_prefix(TD_ERR_INVALID, "--backend: ");
    td_args_free();
    if (!st) return -1;
    fprintf(stderr, "tidal bench copy: %s\n(tidal bench copy --help lists the options)\n", td_error_msg());
    return 2;
}

/* The backend, the pinned and device buffers (twice the transfer each side)
 * and the engine. */
static td_status copy_setup(copy_bench *cb)
{
    td_status st = TD_OK;
    td_backend_params *bp = &cb->bp;
    if (!cb->bytes && bp->kind != TD_BACKEND_CPU) cb->bytes = TD_GiB;
    if (bp->kind == TD_BACKEND_CPU || !td_backend_cuda_compiled()) {
        if (!cb->bytes) cb->bytes = 256 * TD_MiB;
        if (bp->cpu_device_bytes < 2 * cb->bytes + TD_MiB) bp->cpu_device_bytes = 2 * cb->bytes + TD_MiB;
    }
    TD_TRY(td_backend_create(bp, &cb->be));
    cb->cuda = td_backend_get_kind(cb->be) == TD_BACKEND_CUDA;
    if (!cb->bytes) cb->bytes = cb->cuda ? TD_GiB : 256 * TD_MiB;
    size_t bytes = cb->buf.bytes = cb->bytes;
    TD_TRY(td_topo_create(cb->be, &cb->topo));
    TD_TRY(td_hostpool_create(cb->be, cb->topo, NULL, &cb->pool));
    TD_TRY(td_hostpool_alloc(cb->pool, bytes, TD_ROLE_STAGING, &cb->buf.host_src));
    TD_TRY(td_hostpool_alloc(cb->pool, bytes, TD_ROLE_STAGING, &cb->buf.host_dst));
    TD_TRY(td_arena_create(cb->be, 2 * td_align_up(bytes, TD_ARENA_ALIGN), &cb->arena));
    TD_TRY(td_arena_alloc(cb->arena, bytes, TD_ROLE_CHUNK, &cb->buf.dev_a));
    TD_TRY(td_arena_alloc(cb->arena, bytes, TD_ROLE_CHUNK, &cb->buf.dev_b));
    td_copy_params cp = td_copy_default_params();
    cp.chunk_bytes = cb->chunk;
    TD_TRY(td_copy_engine_create(cb->be, &cp, &cb->eng));
    for (size_t i = 0; i < bytes; i += 4096) ((unsigned char *)cb->buf.host_src)[i] = (unsigned char)(i / 4096 * 131);
    memset(cb->buf.host_dst, 0, bytes);
cleanup:
    return st;
}

/* Each direction: raw and engine transfers interleaved (so both see the same
 * machine), after two of each untimed; then the data checked. */
static td_status copy_measure(copy_bench *cb)
{
    td_status st = TD_OK;
    size_t bytes = cb->bytes;
    char err[256], sz[32], ck[32];
    fprintf(stderr, "bench copy: %s; host memory %s; %s per transfer, %s pieces, median of %d\n",
            td_backend_describe(cb->be), td_topo_describe(cb->topo), td_format_bytes(bytes, sz, sizeof sz),
            td_format_bytes(cb->chunk, ck, sizeof ck), cb->iters);
    double *samples = malloc(sizeof(double) * 2 * (size_t)cb->iters);
    if (!samples) TD_FAIL(TD_ERR_NOMEM, "out of memory");
    for (int m = 0; m < 3; m++) {
        double *raw = samples, *engs = samples + cb->iters, ms;
        double moved = (double)bytes * (m == RAW_BOTH ? 2 : 1);
        for (int it = -2; it < cb->iters; it++) { /* two warm-ups: first-touch, TLBs, clocks */
            if (raw_copy_ms(cb->cuda, (raw_mode)m, cb->buf.dev_a, cb->buf.host_src, cb->buf.host_dst, cb->buf.dev_b,
                            bytes, it < 0 ? &ms : &raw[it], err, sizeof err))
                TD_FAIL(TD_ERR_BACKEND, "raw copy: %s", err);
            TD_TRY(engine_ms(cb->eng, (raw_mode)m, &cb->buf, it < 0 ? &ms : &engs[it]));
        }
        cb->raw_gbs[m] = moved / (td_median(raw, cb->iters) * 1e-3) / 1e9;
        cb->eng_gbs[m] = moved / (td_median(engs, cb->iters) * 1e-3) / 1e9;
        fprintf(stderr, "  %-4s done\n", direction_names[m]);
    }
    /* The data must have arrived: bring dev_a (last written by an H2D) back. */
    td_copy_ticket t;
    TD_TRY(td_copy_submit(cb->eng, TD_COPY_D2H, cb->buf.host_dst, cb->buf.dev_a, bytes, NULL, &t));
    TD_TRY(td_copy_wait(cb->eng, &t));
    if (memcmp(cb->buf.host_dst, cb->buf.host_src, bytes) != 0) TD_FAIL(TD_ERR_STATE, "data check failed after the copies");
cleanup:
    free(samples);
    return st;
}

static td_status copy_report(const copy_bench *cb)
{
    double one = cb->eng_gbs[0] > cb->eng_gbs[1] ? cb->eng_gbs[0] : cb->eng_gbs[1], both_over_one = cb->eng_gbs[2] / one;
    if (!cb->json) {
        printf("%-10s %12s %14s %11s\n", "direction", "raw GB/s", "engine GB/s", "engine/raw");
        for (int m = 0; m < 3; m++)
            printf("%-10s %12.2f %14.2f %11.3f\n", direction_names[m], cb->raw_gbs[m], cb->eng_gbs[m],
                   cb->eng_gbs[m] / cb->raw_gbs[m]);
        printf("engine, both directions over the faster single one: %.2fx\n", both_over_one);
        return TD_OK;
    }
    cJSON *out = cJSON_CreateObject();
    cJSON_AddStringToObject(out, "backend", td_backend_describe(cb->be));
    cJSON_AddStringToObject(out, "host_memory", td_topo_describe(cb->topo));
    cJSON_AddNumberToObject(out, "bytes", (double)cb->bytes);
    cJSON_AddNumberToObject(out, "chunk_bytes", (double)cb->chunk);
    cJSON_AddNumberToObject(out, "iters", cb->iters);
    cJSON *arr = cJSON_AddArrayToObject(out, "results");
    for (int m = 0; m < 3; m++) {
        cJSON *r = cJSON_CreateObject();
        cJSON_AddStringToObject(r, "direction", direction_names[m]);
        cJSON_AddNumberToObject(r, "raw_gbytes_per_s", cb->raw_gbs[m]);
        cJSON_AddNumberToObject(r, "engine_gbytes_per_s", cb->eng_gbs[m]);
        cJSON_AddNumberToObject(r, "engine_over_raw", cb->eng_gbs[m] / cb->raw_gbs[m]);
        cJSON_AddItemToArray(arr, r);
    }
    cJSON_AddNumberToObject(out, "engine_both_over_one", both_over_one);
    return td_cli_print_json(out);
}

int td_bench_copy_main(int argc, char **argv)
{
    copy_bench cb = { .chunk = 64 * TD_MiB, .iters = 10, .bp = td_backend_default_params() };
    int rc = copy_options(&cb, argc, argv);
    if (rc >= 0) return rc;
    td_status st = copy_setup(&cb);
    if (!st) st = copy_measure(&cb);
    if (!st) st = copy_report(&cb);
    if (st) fprintf(stderr, "tidal bench copy: %s\n", td_error_msg());
    td_copy_engine_destroy(cb.eng);
    if (cb.arena) {
        td_arena_release(cb.arena, cb.buf.dev_a);
        td_arena_release(cb.arena, cb.buf.dev_b);
    }
    td_arena_destroy(cb.arena);
    if (cb.pool) {
        td_hostpool_release(cb.pool, cb.buf.host_src);
        td_hostpool_release(cb.pool, cb.buf.host_dst);
    }
    td_hostpool_destroy(cb.pool);
    td_topo_destroy(cb.topo);
    raw_copy_shutdown();
    td_backend_free(cb.be);
    return st ? 1 : 0;
}
