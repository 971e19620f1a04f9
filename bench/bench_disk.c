/* `tidal bench disk DIR [DIR ...]`: the direct read and write rates of the
 * drives an --offload-dir run would use, through the disk tier's own I/O
 * engine and scratch files (td_dio_measure): a file of --bytes striped over
 * the directories, written, read back, then read and written at once, with
 * each I/O method this build has (io_uring, pread/pwrite threads). */
#include "../cli/cli.h"
#include "../cli/args.h"
#include "tidal/diskio.h"
#include "tidal/util.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <string.h>

static const char usage[] =
    "usage: tidal bench disk DIR [DIR ...] [--bytes SIZE] [--block SIZE] [--depth N] [--method M] [--json]\n\n"
    "Measures the direct (O_DIRECT) write, read and mixed rates of a scratch file striped over the\n"
    "directories, as `tidal train --offload-dir DIR ...` reads and writes them: large aligned requests,\n"
    "many in flight, random bytes.  The file is preallocated (it needs --bytes free), has no name\n"
    "while it exists, and is gone when the command ends.  GB/s are 1e9 bytes a second; the mixed\n"
    "figure counts both directions.";

/* The arguments that are not options (or their values): the directories. */
static int split_dirs(td_opt *table, int argc, char **argv, char **opts, const char **dirs, int max_dirs, int *n_dirs)
{
    int n = 0;
    *n_dirs = 0;
    for (int i = 0; i < argc; i++) {
        if (!strncmp(argv[i], "--", 2) || !strcmp(argv[i], "-h")) {
            opts[n++] = argv[i];
            td_opt *o = td_args_find(table, argv[i] + 2);
            if (o && o->kind != TD_OPT_FLAG && !strchr(argv[i], '=') && i + 1 < argc) opts[n++] = argv[++i];
            continue;
        }
        if (*n_dirs < max_dirs) dirs[*n_dirs] = argv[i];
        (*n_dirs)++;
    }
    return n;
}

/* The JSON document's head (the directories, the request shape), or the
 * table's for the text form (NULL). */
static cJSON *disk_header(int json, const char *const *dirs, int n_dirs, size_t bytes, size_t block, int depth)
{
    if (!json) {
        char b[32], bl[32];
        printf("disk       %d director%s, %s a pass in requests of %s, %d in flight\n", n_dirs, n_dirs == 1 ? "y" : "ies",
               td_format_bytes(bytes, b, sizeof b), td_format_bytes(block, bl, sizeof bl), depth);
        printf("%-10s %12s %12s %12s\n", "method", "write GB/s", "read GB/s", "mixed GB/s");
        return NULL;
    }
    cJSON *out = cJSON_CreateObject(), *ds = cJSON_AddArrayToObject(out, "dirs");
    for (int i = 0; i < n_dirs; i++) {
        td_dio_dir_info info;
        cJSON *d = cJSON_CreateObject();
        cJSON_AddStringToObject(d, "path", dirs[i]);
        if (td_dio_dir_info_get(dirs[i], &info) == TD_OK) {
            cJSON_AddStringToObject(d, "fs", info.fs);
            cJSON_AddNumberToObject(d, "free_bytes", (double)info.free_bytes);
            cJSON_AddNumberToObject(d, "total_bytes", (double)info.total_bytes);
            cJSON_AddBoolToObject(d, "direct", info.direct);
        }
        cJSON_AddItemToArray(ds, d);
    }
    cJSON_AddNumberToObject(out, "block_bytes", (double)block);
    cJSON_AddNumberToObject(out, "depth", depth);
    cJSON_AddArrayToObject(out, "results");
    return out;
}

/* One I/O method's rates, into out's results or a table row. */
static td_status disk_method(td_dio_method method, const char *const *dirs, int n_dirs, size_t bytes, size_t block,
                             int depth, cJSON *out)
{
    td_dio_params p = td_dio_default_params();
    p.method = method;
    p.queue_depth = depth;
    p.piece_bytes = block < TD_MiB ? block : TD_MiB;
    td_dio *io = NULL;
    td_dio_rates r;
    td_status st = td_dio_create(&p, &io);
    if (!st) st = td_dio_measure(io, (const char **)dirs, n_dirs, bytes, block, depth, &r);
    td_dio_destroy(io);
    if (st) return td_error_prefix(st, "%s: ", td_dio_method_name(method));
    if (out) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "method", r.method);
        cJSON_AddNumberToObject(o, "bytes", (double)r.bytes);
        cJSON_AddBoolToObject(o, "direct", r.direct);
        cJSON_AddNumberToObject(o, "write_gbytes_per_s", r.write_gbs);
        cJSON_AddNumberToObject(o, "read_gbytes_per_s", r.read_gbs);
        cJSON_AddNumberToObject(o, "mixed_gbytes_per_s", r.mixed_gbs);
        cJSON_AddItemToArray(cJSON_GetObjectItem(out, "results"), o);
    } else {
        printf("%-10s %12.3f %12.3f %12.3f%s\n", r.method, r.write_gbs, r.read_gbs, r.mixed_gbs,
               r.direct ? "" : "   (through the page cache: the filesystem refuses O_DIRECT)");
    }
    return TD_OK;
}

int td_bench_disk_main(int argc, char **argv)
{
    size_t bytes = TD_GiB, block = 4 * TD_MiB;
    int depth = 16, json = 0;
    const char *method = "all";
    td_opt table[] = {
        {"bytes", TD_OPT_SIZE, &bytes, "SIZE", "bytes each pass moves (default 1GiB; needs that much free)", 0},
        {"block", TD_OPT_SIZE, &block, "SIZE", "bytes a request (default 4MiB, a multiple of 4KiB)", 0},
        {"depth", TD_OPT_INT, &depth, "N", "requests in flight (default 16)", 0},
        {"method", TD_OPT_STRING, &method, "M", "all (default: each this build and kernel have), auto, io_uring or threads", 0},
        {"json", TD_OPT_FLAG, &json, NULL, "one JSON object on stdout instead of the table", 0},
        {NULL, 0, NULL, NULL, NULL, 0},
    };
    char *opts[256];
    const char *dirs[16];
    int n_dirs = 0;
    if (argc > 256) argc = 256;
    int n = split_dirs(table, argc, argv, opts, dirs, 16, &n_dirs);
    int rc = td_args_main(table, n, opts, "bench disk", usage);
    if (rc >= 0) return rc;
    td_status st = TD_OK;
    td_dio_method methods[2];
    int n_methods = 0;
    if (!n_dirs) st = td_error_set(TD_ERR_INVALID, "name the directory (or directories) to measure");
    else if (n_dirs > 16) st = td_error_set(TD_ERR_INVALID, "%d directories: at most 16", n_dirs);
    else if (!bytes) st = td_error_set(TD_ERR_INVALID, "--bytes must be positive");
    else if (!block || block % TD_DIO_ALIGN) st = td_error_set(TD_ERR_INVALID, "--block %zu: a positive multiple of 4KiB", block);
    else if (depth < 1 || depth > 1024) st = td_error_set(TD_ERR_INVALID, "--depth %d: use 1 to 1024", depth);
    else if (!strcmp(method, "all")) {
        if (td_dio_uring_compiled()) methods[n_methods++] = TD_DIO_URING;
        methods[n_methods++] = TD_DIO_THREADS;
    } else if (!(st = td_dio_method_parse(method, &methods[0]))) {
        n_methods = 1;
    }
    td_args_free();
    if (st) {
        fprintf(stderr, "tidal bench disk: %s\n(tidal bench disk --help lists the options)\n", td_error_msg());
        return 2;
    }
    cJSON *out = disk_header(json, dirs, n_dirs, bytes, block, depth);
    for (int m = 0; m < n_methods; m++)
        if ((st = disk_method(methods[m], dirs, n_dirs, bytes, block, depth, out))) {
            fprintf(stderr, "tidal bench disk: %s\n", td_error_msg());
            rc = 1;
        }
    if (rc < 0) rc = 0;
    if (out && td_cli_print_json(out)) rc = 1;
    return rc;
}
