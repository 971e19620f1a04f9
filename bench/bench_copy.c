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

int td_bench_copy_main(int argc, char **argv)
{
    size_t bytes = 0, chunk = 64 * TD_MiB;
    int iters = 10, json = 0;
    const char *backend = "auto";
    td_backend_params bp = td_backend_default_params();
    td_opt table[] = {
        {"bytes", TD_OPT_SIZE, &bytes, "SIZE", "bytes per transfer (default 1GiB on cuda, 256MiB on cpu)", 0},
        {"chunk", TD_OPT_SIZE, &chunk, "SIZE", "the engine's piece size (default 64MiB)", 0},
        {"iters", TD_OPT_INT, &iters, "N", "timed transfers per figure, median reported (default 10)", 0},
        {"backend", TD_OPT_STRING, &backend, "B", "auto (default), cpu or cuda", 0},
        {"json", TD_OPT_FLAG, &json, NULL, "one JSON object on stdout instead of the table", 0},
        {NULL, 0, NULL, NULL, NULL, 0},
    };
    int rc = td_args_main(table, argc, argv, "bench copy",
                          "usage: tidal bench copy [--bytes SIZE] [--chunk SIZE] [--iters N] [--backend auto|cpu|cuda] [--json]\n\n"
                          "Measures H2D, D2H and both directions at once through tidal's copy engine and\n"
                          "through raw copies on the same pinned buffers, and prints GB/s (1e9 bytes/s).");
    if (rc >= 0) return rc;
    rc = 1;
    td_status st = TD_OK;
    if (td_args_find(table, "bytes")->seen && !bytes) st = td_error_set(TD_ERR_INVALID, "--bytes must be positive");
    else if (!chunk) st = td_error_set(TD_ERR_INVALID, "--chunk must be positive");
    else if (iters < 1 || iters > 100000) st = td_error_set(TD_ERR_INVALID, "--iters %d: use 1 to 100000", iters);
    else if (td_backend_kind_parse(backend, &bp.kind)) st = td_error_prefix(TD_ERR_INVALID, "--backend: ");
    td_args_free();
    if (st) {
        fprintf(stderr, "tidal bench copy: %s\n(tidal bench copy --help lists the options)\n", td_error_msg());
        return 2;
    }

    td_backend *be = NULL;
    td_topo *topo = NULL;
    td_hostpool *pool = NULL;
    td_arena *arena = NULL;
    td_copy_engine *eng = NULL;
    buffers buf = {0};
    double *samples = NULL;
    cJSON *out = NULL;

    if (!bytes && bp.kind != TD_BACKEND_CPU) bytes = TD_GiB;
    if (bp.kind == TD_BACKEND_CPU || !td_backend_cuda_compiled()) {
        if (!bytes) bytes = 256 * TD_MiB;
        if (bp.cpu_device_bytes < 2 * bytes + TD_MiB) bp.cpu_device_bytes = 2 * bytes + TD_MiB;
    }
    TD_TRY(td_backend_create(&bp, &be));
    int cuda = td_backend_get_kind(be) == TD_BACKEND_CUDA;
    if (!bytes) bytes = cuda ? TD_GiB : 256 * TD_MiB;
    buf.bytes = bytes;
    TD_TRY(td_topo_create(be, &topo));
    TD_TRY(td_hostpool_create(be, topo, NULL, &pool));
    TD_TRY(td_hostpool_alloc(pool, bytes, TD_ROLE_STAGING, &buf.host_src));
    TD_TRY(td_hostpool_alloc(pool, bytes, TD_ROLE_STAGING, &buf.host_dst));
    TD_TRY(td_arena_create(be, 2 * td_align_up(bytes, TD_ARENA_ALIGN), &arena));
    TD_TRY(td_arena_alloc(arena, bytes, TD_ROLE_CHUNK, &buf.dev_a));
    TD_TRY(td_arena_alloc(arena, bytes, TD_ROLE_CHUNK, &buf.dev_b));
    td_copy_params cp = td_copy_default_params();
    cp.chunk_bytes = chunk;
    TD_TRY(td_copy_engine_create(be, &cp, &eng));
    for (size_t i = 0; i < bytes; i += 4096) ((unsigned char *)buf.host_src)[i] = (unsigned char)(i / 4096 * 131);
    memset(buf.host_dst, 0, bytes);

    char sz[32], ck[32];
    td_format_bytes(bytes, sz, sizeof sz);
    td_format_bytes(chunk, ck, sizeof ck);
    fprintf(stderr, "bench copy: %s; host memory %s; %s per transfer, %s pieces, median of %d\n",
            td_backend_describe(be), td_topo_describe(topo), sz, ck, iters);

    samples = malloc(sizeof(double) * 2 * (size_t)iters);
    if (!samples) TD_FAIL(TD_ERR_NOMEM, "out of memory");
    static const char *names[] = {"h2d", "d2h", "both"};
    double raw_gbs[3], eng_gbs[3];
    char err[256];
    for (int m = 0; m < 3; m++) {
        double *raw = samples, *engs = samples + iters, ms;
        double moved = (double)bytes * (m == RAW_BOTH ? 2 : 1);
        for (int w = 0; w < 2; w++) { /* warm-up: first-touch, TLBs, clocks */
            if (raw_copy_ms(cuda, (raw_mode)m, buf.dev_a, buf.host_src, buf.host_dst, buf.dev_b, bytes, &ms, err, sizeof err))
                TD_FAIL(TD_ERR_BACKEND, "raw copy: %s", err);
            TD_TRY(engine_ms(eng, (raw_mode)m, &buf, &ms));
        }
        for (int it = 0; it < iters; it++) { /* interleaved, so both see the same machine */
            if (raw_copy_ms(cuda, (raw_mode)m, buf.dev_a, buf.host_src, buf.host_dst, buf.dev_b, bytes, &raw[it], err, sizeof err))
                TD_FAIL(TD_ERR_BACKEND, "raw copy: %s", err);
            TD_TRY(engine_ms(eng, (raw_mode)m, &buf, &engs[it]));
        }
        raw_gbs[m] = moved / (td_median(raw, iters) * 1e-3) / 1e9;
        eng_gbs[m] = moved / (td_median(engs, iters) * 1e-3) / 1e9;
        fprintf(stderr, "  %-4s done\n", names[m]);
    }
    /* The data must have arrived: bring dev_a (last written by an H2D) back. */
    td_copy_ticket t;
    TD_TRY(td_copy_submit(eng, TD_COPY_D2H, buf.host_dst, buf.dev_a, bytes, NULL, &t));
    TD_TRY(td_copy_wait(eng, &t));
    if (memcmp(buf.host_dst, buf.host_src, bytes) != 0) TD_FAIL(TD_ERR_STATE, "data check failed after the copies");

    double one = eng_gbs[0] > eng_gbs[1] ? eng_gbs[0] : eng_gbs[1];
    double both_over_one = eng_gbs[2] / one;
    if (json) {
        out = cJSON_CreateObject();
        cJSON_AddStringToObject(out, "backend", td_backend_describe(be));
        cJSON_AddStringToObject(out, "host_memory", td_topo_describe(topo));
        cJSON_AddNumberToObject(out, "bytes", (double)bytes);
        cJSON_AddNumberToObject(out, "chunk_bytes", (double)chunk);
        cJSON_AddNumberToObject(out, "iters", iters);
        cJSON *arr = cJSON_AddArrayToObject(out, "results");
        for (int m = 0; m < 3; m++) {
            cJSON *r = cJSON_CreateObject();
            cJSON_AddStringToObject(r, "direction", names[m]);
            cJSON_AddNumberToObject(r, "raw_gbytes_per_s", raw_gbs[m]);
            cJSON_AddNumberToObject(r, "engine_gbytes_per_s", eng_gbs[m]);
            cJSON_AddNumberToObject(r, "engine_over_raw", eng_gbs[m] / raw_gbs[m]);
            cJSON_AddItemToArray(arr, r);
        }
        cJSON_AddNumberToObject(out, "engine_both_over_one", both_over_one);
        char *text = cJSON_Print(out);
        if (!text) TD_FAIL(TD_ERR_NOMEM, "out of memory printing JSON");
        printf("%s\n", text);
        cJSON_free(text);
    } else {
        printf("%-10s %12s %14s %11s\n", "direction", "raw GB/s", "engine GB/s", "engine/raw");
        for (int m = 0; m < 3; m++)
            printf("%-10s %12.2f %14.2f %11.3f\n", names[m], raw_gbs[m], eng_gbs[m], eng_gbs[m] / raw_gbs[m]);
        printf("engine, both directions over the faster single one: %.2fx\n", both_over_one);
    }
    rc = 0;
cleanup:
    if (st) fprintf(stderr, "tidal bench copy: %s\n", td_error_msg());
    cJSON_Delete(out);
    free(samples);
    td_copy_engine_destroy(eng);
    if (arena) { td_arena_release(arena, buf.dev_a); td_arena_release(arena, buf.dev_b); }
    td_arena_destroy(arena);
    if (pool) { td_hostpool_release(pool, buf.host_src); td_hostpool_release(pool, buf.host_dst); }
    td_hostpool_destroy(pool);
    td_topo_destroy(topo);
    raw_copy_shutdown();
    td_backend_free(be);
    return rc;
}
