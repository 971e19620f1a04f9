/* `tidal bench adam`: CPU AdamW throughput beside a STREAM-style memory
 * bandwidth measured in the same run, on the same threads.
 *
 * Two paths, per size and per optimizer state type (--optim-state):
 *   fp32   fp32 grads, no param output: reads master, m, v, grad and writes
 *          master, m, v;
 *   mixed  bf16 grads in, bf16 params out (the offload path): reads master,
 *          m, v and the bf16 grad, writes master, m, v and the bf16 param.
 * Bytes per param: 8 (master read + written) + 4 (fp32 grad, or bf16 grad +
 * bf16 param) + m and v read and written, 4 * td_adam_moment_bytes / numel:
 * fp32 state 28, bf16 state 20, int8 state 16.06 (codes + block scales).
 * Stores to master, m, v hit lines just read, so these counts are the DRAM
 * traffic; the bf16 output lines are also read for ownership by the CPU
 * (not counted, as STREAM does not count it).
 *
 * The bandwidth reference is STREAM's triad a = b + s*c on three arrays of
 * 512 MiB, 12 bytes per element counted, best of 10, with the same OpenMP
 * team and static partition as the optimizer.  Each result's
 * fraction_of_bound = (its bytes / its time) / triad bandwidth, i.e. how close
 * it runs to the time those bytes take at the measured rate.  The figure for
 * a path is the median over its timed steps.  Buffers are allocated per size
 * and first-touched by td_adam_cpu_init, as in training.
 *
 * `--check-dir DIR` instead runs the optimizer on inputs written by
 * tests/gpu/adam_torch_check.py (the torch oracle) and writes its results
 * there; see bench/adam_check.c. */
#include "../cli/cli.h"
#include "../cli/args.h"
#include "adam_check.h"
#include "tidal/alloc.h"
#include "tidal/optim.h"
#include "tidal/convert.h"
#include "tidal/topo.h"
#include "tidal/util.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define STREAM_ELEMS ((size_t)128 << 20) /* 512 MiB per fp32 array */

static const double default_sizes[] = {1e6, 4e6, 16e6, 64e6, 200e6, 1e9};

/* "200M", "1G", "1e9", "4000000": decimal multipliers. */
static int parse_count(const char *s, double *out)
{
    char *end;
    double v = strtod(s, &end);
    if (end == s || !(v > 0)) return -1;
    if (*end == 'k' || *end == 'K') v *= 1e3, end++;
    else if (*end == 'M' || *end == 'm') v *= 1e6, end++;
    else if (*end == 'G' || *end == 'g') v *= 1e9, end++;
    if (*end || v > 1e12) return -1;
    *out = floor(v);
    return 0;
}

static size_t mem_available_bytes(void)
{
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    size_t kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %zu kB", &kb) == 1) break;
    if (f) fclose(f);
    return kb * 1024;
}

/* A 2 MiB-aligned block from the accounting allocator, with transparent huge
 * pages requested (fewer TLB misses when streaming GiBs). */
typedef struct big_buf { void *raw, *ptr; } big_buf;

static td_status big_alloc(big_buf *b, size_t bytes)
{
    b->raw = td_malloc(bytes + 2 * TD_MiB, TD_ROLE_OPTIM);
    if (!b->raw) return td_error_prefix(TD_ERR_NOMEM, "bench buffer of %zu bytes: ", bytes);
    b->ptr = (void *)td_align_up((size_t)b->raw, 2 * TD_MiB);
    madvise(b->ptr, td_align_up(bytes, 2 * TD_MiB), MADV_HUGEPAGE);
    return TD_OK;
}

static void big_free(big_buf *b)
{
    td_free(b->raw);
    b->raw = b->ptr = NULL;
}

__attribute__((target_clones("avx512f", "avx2", "default"))) static void
triad_range(float *restrict a, const float *restrict b, const float *restrict c, size_t lo, size_t hi, float s)
{
#pragma omp simd
    for (size_t i = lo; i < hi; i++) a[i] = b[i] + s * c[i];
}

/* STREAM triad on the optimizer's team and partition; best rate of 10. */
static td_status stream_triad(td_adam_cpu *cpu, double *gbytes_per_s)
{
    td_status st = TD_OK;
    big_buf a = {0}, b = {0}, c = {0};
    size_t n = STREAM_ELEMS;
    TD_TRY(big_alloc(&a, n * 4));
    TD_TRY(big_alloc(&b, n * 4));
    TD_TRY(big_alloc(&c, n * 4));
    float *pa = a.ptr, *pb = b.ptr, *pc = c.ptr;
    int threads = td_adam_cpu_threads(cpu);
    double best = 1e30;
    for (int rep = -1; rep < 10; rep++) {
        double t0 = td_now_ms();
#pragma omp parallel num_threads(threads)
        {
            for (int t = omp_get_thread_num(); t < threads; t += omp_get_num_threads()) {
                size_t lo, hi;
                td_adam_cpu_partition(cpu, n, t, &lo, &hi);
                if (rep < 0) /* first touch by the owning thread */
                    for (size_t i = lo; i < hi; i++) pa[i] = 0.0f, pb[i] = 1.0f, pc[i] = 2.0f;
                else
                    triad_range(pa, pb, pc, lo, hi, 3.0f);
            }
        }
        double ms = td_now_ms() - t0;
        if (rep >= 0 && ms < best) best = ms;
    }
    if (pa[n / 3] != 7.0f) TD_FAIL(TD_ERR_STATE, "stream triad produced a wrong value");
    *gbytes_per_s = 12.0 * (double)n / (best * 1e-3) / 1e9;
cleanup:
    big_free(&a);
    big_free(&b);
    big_free(&c);
    return st;
}

typedef struct result {
    const char *path;
    td_optim_state state;
    double params, bytes_per_param, gparams_per_s, gbytes_per_s, stream_gbytes_per_s, fraction;
    int threads;
} result;

/* The DRAM bytes a param of a path moves with state `st` (see the top). */
static double path_bytes_per_param(td_optim_state st, size_t n)
{
    return 12.0 + 4.0 * (double)td_adam_moment_bytes(st, n) / (double)n;
}

#define REF_BYTES_PER_ELEM 28.0 /* the reference pass: 4 fp32 arrays read, 3 written */

/* The reference pass: the fp32 path's bytes with trivial arithmetic.  Reads
 * a, b, c, d and writes a, b, c in place (a += 0*d ...): 28 bytes per
 * element, all of which really move (no write-allocate reads: the written
 * lines were just read).  `zero` comes from the caller so the compiler
 * cannot drop the stores; the values do not change.  Cloned per ISA so it
 * runs with the widest vectors the CPU has, as the optimizer does. */
__attribute__((target_clones("avx512f", "avx2", "default"))) static void
reference_range(float *restrict a, float *restrict b, float *restrict c, const float *restrict d, size_t lo,
                size_t hi, float zero)
{
#pragma omp simd
    for (size_t i = lo; i < hi; i++) {
        float g = zero * d[i];
        a[i] += g, b[i] += g, c[i] += g;
    }
}

static void reference_pass(td_adam_cpu *cpu, float *a, float *b, float *c, const float *d, size_t n, float zero)
{
    int threads = td_adam_cpu_threads(cpu);
#pragma omp parallel num_threads(threads)
    {
        for (int t = omp_get_thread_num(); t < threads; t += omp_get_num_threads()) {
            size_t lo, hi;
            td_adam_cpu_partition(cpu, n, t, &lo, &hi);
            reference_range(a, b, c, d, lo, hi, zero);
        }
    }
}

/* Times one path at one size, each AdamW step followed by one reference
 * pass over the same buffers, so both see the same machine (memory
 * bandwidth on shared or virtual machines drifts by tens of percent over
 * seconds).  Medians of both. */
static td_status time_path(td_adam_cpu *cpu, const td_adam_hparams *hp, td_adam_chunk *ch, float *ref_d,
                           double min_s, double *adam_ms, double *ref_ms)
{
    td_status st = TD_OK;
    int cap = 2000, n = 0;
    double *ms = malloc(sizeof(double) * 2 * (size_t)cap), t_start = td_now_ms();
    volatile float zero_v = 0.0f;
    if (!ms) return td_error_set(TD_ERR_NOMEM, "out of memory");
    for (long step = 1;; step++) {
        td_adam_coeffs c;
        TD_TRY(td_adam_coeffs_make(hp, 1e-4, step, 1.0 / 1024, &c));
        double t0 = td_now_ms();
        TD_TRY(td_adam_cpu_update(cpu, &c, ch, 1));
        double t1 = td_now_ms();
        reference_pass(cpu, ch->master, (float *)ch->m, (float *)ch->v, ref_d, ch->numel, zero_v);
        double t2 = td_now_ms();
        if (step <= 2) continue; /* warm-up: clocks, TLBs, page tables */
        ms[n] = t1 - t0;
        ms[cap + n] = t2 - t1;
        n++;
        if (n >= cap || (n >= 5 && (td_now_ms() - t_start) * 1e-3 >= min_s)) break;
    }
    *adam_ms = td_median(ms, n);
    *ref_ms = td_median(ms + cap, n);
cleanup:
    free(ms);
    return st;
}

/* Grads and params: deterministic values in [-1, 1), written in parallel. */
static void fill(td_adam_cpu *cpu, void *p, td_dtype dt, size_t n, uint32_t salt)
{
    int threads = td_adam_cpu_threads(cpu);
#pragma omp parallel num_threads(threads)
    {
        for (int t = omp_get_thread_num(); t < threads; t += omp_get_num_threads()) {
            size_t lo, hi;
            td_adam_cpu_partition(cpu, n, t, &lo, &hi);
            for (size_t i = lo; i < hi; i++) {
                uint32_t h = (uint32_t)i * 2654435761u ^ salt;
                h ^= h >> 15;
                h *= 2246822519u;
                float x = (float)(h >> 8) * (2.0f / 16777216.0f) - 1.0f;
                if (dt == TD_DTYPE_F32) ((float *)p)[i] = x;
                else ((uint16_t *)p)[i] = td_bf16_from_f32(x);
            }
        }
    }
}

/* Every path with every state in `states` at one size; out gets 2 results
 * per state.  m and v are allocated at fp32 size (the reference pass runs
 * over them as fp32 arrays); compact states use their first bytes. */
static td_status bench_size(td_adam_cpu *cpu, size_t n, double min_s, const int *states, int n_states, result *out)
{
    td_status st = TD_OK;
    big_buf master = {0}, m = {0}, v = {0}, g = {0};
    td_adam_hparams hp = td_adam_default_hparams();
    TD_TRY(big_alloc(&master, n * 4));
    TD_TRY(big_alloc(&m, n * 4));
    TD_TRY(big_alloc(&v, n * 4));
    TD_TRY(big_alloc(&g, n * 4)); /* fp32 grads; or bf16 grads + bf16 params, one half each */
    for (int k = 0; k < n_states; k++)
        for (int path = 0; path < 2; path++) {
            td_optim_state os = (td_optim_state)states[k];
            td_adam_chunk ch = {.master = master.ptr, .m = m.ptr, .v = v.ptr, .numel = n, .state = os};
            if (path == 0) {
                ch.grad = g.ptr;
                ch.grad_dtype = TD_DTYPE_F32;
            } else {
                ch.grad = g.ptr;
                ch.grad_dtype = TD_DTYPE_BF16;
                ch.param_out = (uint16_t *)g.ptr + n;
                ch.param_dtype = TD_DTYPE_BF16;
            }
            TD_TRY(td_adam_cpu_init(cpu, &ch, NULL, TD_DTYPE_F32)); /* first touch of master, m, v */
            fill(cpu, master.ptr, TD_DTYPE_F32, n, 0x9e3779b9u);
            fill(cpu, g.ptr, ch.grad_dtype, n, 0x85ebca6bu + (uint32_t)path);
            double ms = 0, ref_ms = 0;
            TD_TRY(time_path(cpu, &hp, &ch, g.ptr, min_s, &ms, &ref_ms));
            result *r = &out[k * 2 + path];
            r->path = path == 0 ? "fp32" : "mixed";
            r->state = os;
            r->params = (double)n;
            r->threads = td_adam_cpu_threads(cpu);
            r->bytes_per_param = path_bytes_per_param(os, n);
            r->gparams_per_s = (double)n / (ms * 1e-3) / 1e9;
            r->gbytes_per_s = r->gparams_per_s * r->bytes_per_param;
            r->stream_gbytes_per_s = REF_BYTES_PER_ELEM * (double)n / (ref_ms * 1e-3) / 1e9;
            r->fraction = r->gbytes_per_s / r->stream_gbytes_per_s;
        }
cleanup:
    big_free(&master);
    big_free(&m);
    big_free(&v);
    big_free(&g);
    return st;
}

/* "all" or a comma-separated list of state names. */
static td_status parse_states(const char *text, int *states, int *n)
{
    *n = 0;
    if (!strcmp(text, "all")) {
        for (int i = 0; i < TD_OPTIM_STATE_COUNT; i++) states[(*n)++] = i;
        return TD_OK;
    }
    char buf[64];
    snprintf(buf, sizeof buf, "%s", text);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        td_optim_state s;
        if (td_optim_state_parse(tok, &s)) return td_error_prefix(TD_ERR_INVALID, "--optim-state: ");
        for (int i = 0; i < *n; i++)
            if (states[i] == (int)s) return td_error_set(TD_ERR_INVALID, "--optim-state: '%s' given twice", tok);
        states[(*n)++] = (int)s;
    }
    if (*n == 0) return td_error_set(TD_ERR_INVALID, "--optim-state '%s': name fp32, bf16, int8 or all", text);
    return TD_OK;
}

/* One run of the benchmark: its options and what it measured. */
typedef struct adam_bench {
    double max_params, min_s;
    int json, threads, no_bind, n_states, states[TD_OPTIM_STATE_COUNT];
    const char *check_dir;
    td_optim_isa isa;
    td_adam_cpu *cpu;
    td_backend *be;
    td_topo *topo;
    size_t sizes[16], avail;
    int n_sizes, fit, n_res;
    result *res;
    double triad, stream;
} adam_bench;

/* -1 to go on, else the exit code. */
static int adam_options(adam_bench *ab, int argc, char **argv)
{
    const char *max_text = NULL, *isa_text = "auto", *states_text = "all";
    td_opt table[] = {
        {"max-params", TD_OPT_STRING, &max_text, "N", "largest size (default 1G; k/M/G are powers of 1000); sizes that do\n"
                                                      "not fit in available memory (16 bytes/param) are skipped and reported", 0},
        {"threads", TD_OPT_INT, &ab->threads, "T", "optimizer threads (default: all cores)", 0},
        {"no-bind", TD_OPT_FLAG, &ab->no_bind, NULL, "do not bind thread i to core i (hwloc), as training does", 0},
        {"isa", TD_OPT_STRING, &isa_text, "ISA", "auto (default), scalar, avx2, avx512", 0},
        {"optim-state", TD_OPT_STRING, &states_text, "LIST", "AdamW state types to time: all (default) or a comma list of\n"
                                                              "fp32, bf16, int8", 0},
        {"min-seconds", TD_OPT_DOUBLE, &ab->min_s, "S", "time per figure (default 1.0; at least 5 steps, median reported)", 0},
        {"json", TD_OPT_FLAG, &ab->json, NULL, "one JSON object on stdout", 0},
        {"check-dir", TD_OPT_STRING, &ab->check_dir, "DIR", "run the torch-oracle replay in DIR (tests/gpu/adam_torch_check.py)", 0},
        {NULL, 0, NULL, NULL, NULL, 0},
    };
    int rc = td_args_main(table, argc, argv, "bench adam",
                          "usage: tidal bench adam [--json] [--max-params N] [--threads T] [--isa ISA] [--optim-state LIST]\n"
                          "                        [--min-seconds S] [--no-bind]\n"
                          "       tidal bench adam --check-dir DIR [--isa ISA] [--threads T]\n\n"
                          "CPU AdamW throughput (G params/s, GB/s) for the fp32 path (fp32 grads, no param output)\n"
                          "and the mixed path (bf16 grads in, bf16 params out), each with every optimizer state\n"
                          "type (m and v in fp32: 28 bytes/param; bf16: 20; int8: 16.06), for sizes 1M, 4M, 16M,\n"
                          "64M, 200M, 1G params up to --max-params; GB/s counts each row's own bytes, and\n"
                          "fraction_of_bound = those GB/s / a reference pass's GB/s over the same buffers in\n"
                          "the same run (4 fp32 arrays read, 3 written: the DRAM bound).");
    if (rc >= 0) return rc;
    td_status st = TD_OK;
    if (max_text && parse_count(max_text, &ab->max_params))
        st = td_error_set(TD_ERR_INVALID, "--max-params '%s': a count such as 200M or 1e9", max_text);
    else if (td_args_find(table, "threads")->seen && (ab->threads < 1 || ab->threads > 4096))
        st = td_error_set(TD_ERR_INVALID, "--threads %d: use 1 to 4096", ab->threads);
    else if (td_optim_isa_parse(isa_text, &ab->isa))
        st = td_error_prefix(TD_ERR_INVALID, "--isa: ");
    else if (parse_states(states_text, ab->states, &ab->n_states))
        st = TD_ERR_INVALID;
    else if (!(ab->min_s >= 0 && ab->min_s < 3600))
        st = td_error_set(TD_ERR_INVALID, "--min-seconds %g: use 0 to 3600", ab->min_s);
    if (!st) return -1;
    fprintf(stderr, "tidal bench adam: %s\n(tidal bench adam --help lists the options)\n", td_error_msg());
    td_args_free();
    return 2;
}

/* The AdamW team, bound to the cores unless --no-bind (the cpu backend's
 * placement over the whole machine: no GPU touched). */
static td_status adam_setup(adam_bench *ab)
{
    td_status st = TD_OK;
    td_adam_cpu_params cp = td_adam_cpu_default_params();
    cp.threads = ab->threads;
    cp.isa = ab->isa;
    if (!ab->no_bind) {
        td_backend_params bp = td_backend_default_params();
        bp.kind = TD_BACKEND_CPU;
        TD_TRY(td_backend_create(&bp, &ab->be));
        TD_TRY(td_topo_create(ab->be, &ab->topo));
        cp.topo = ab->topo;
    }
    TD_TRY(td_adam_cpu_create(&cp, &ab->cpu));
cleanup:
    return st;
}

/* Every size that fits 16 bytes a param in nine tenths of the available
 * memory, each path and state type; the stream triad first. */
static td_status adam_measure(adam_bench *ab)
{
    td_status st = TD_OK;
    for (size_t i = 0; i < sizeof default_sizes / sizeof *default_sizes; i++)
        if (default_sizes[i] <= ab->max_params) ab->sizes[ab->n_sizes++] = (size_t)default_sizes[i];
    if (ab->n_sizes == 0 || (double)ab->sizes[ab->n_sizes - 1] < ab->max_params) ab->sizes[ab->n_sizes++] = (size_t)ab->max_params;
    ab->avail = mem_available_bytes();
    while (ab->fit < ab->n_sizes && (ab->avail == 0 || 16.0 * (double)ab->sizes[ab->fit] <= 0.9 * (double)ab->avail))
        ab->fit++;
    fprintf(stderr, "bench adam: %d threads%s, %s kernels, %zu MiB available; %s\n", td_adam_cpu_threads(ab->cpu),
            ab->topo ? " bound to cores" : "", td_optim_isa_name(td_adam_cpu_isa(ab->cpu)), ab->avail >> 20,
            ab->topo ? td_topo_describe(ab->topo) : "no binding");
    TD_TRY(stream_triad(ab->cpu, &ab->triad));
    fprintf(stderr, "  stream triad %.2f GB/s (3 arrays counted)\n", ab->triad);
    ab->res = calloc((size_t)ab->n_sizes * 2 * (size_t)ab->n_states, sizeof *ab->res);
    if (!ab->res) TD_FAIL(TD_ERR_NOMEM, "out of memory");
    for (int s = 0; s < ab->fit; s++) {
        TD_TRY(bench_size(ab->cpu, ab->sizes[s], ab->min_s, ab->states, ab->n_states, ab->res + ab->n_res));
        for (int k = 0; k < 2 * ab->n_states; k++, ab->n_res++) {
            const result *r = &ab->res[ab->n_res];
            fprintf(stderr, "  %-5s %-4s %10zu params  %5.2f B/param  %6.3f Gparams/s  %7.2f GB/s  stream %7.2f GB/s  "
                    "%.3f of bound\n", r->path, td_optim_state_name(r->state), ab->sizes[s], r->bytes_per_param,
                    r->gparams_per_s, r->gbytes_per_s, r->stream_gbytes_per_s, r->fraction);
        }
    }
    for (int s = ab->fit; s < ab->n_sizes; s++)
        fprintf(stderr, "  skipped %zu params: needs %.1f GiB, %.1f GiB available\n", ab->sizes[s],
                16.0 * (double)ab->sizes[s] / (double)TD_GiB, (double)ab->avail / (double)TD_GiB);
    /* The headline bandwidth: the reference pass at the largest size (DRAM). */
    ab->stream = ab->n_res ? ab->res[ab->n_res - 1].stream_gbytes_per_s : 0;
cleanup:
    return st;
}

static td_status adam_report(const adam_bench *ab)
{
    const result *res = ab->res;
    if (!ab->json) {
        printf("stream: %.2f GB/s (AdamW's access pattern, largest size); triad %.2f GB/s; %d threads, %s\n", ab->stream,
               ab->triad, td_adam_cpu_threads(ab->cpu), td_optim_isa_name(td_adam_cpu_isa(ab->cpu)));
        printf("%-6s %-5s %12s %8s %12s %10s %12s %10s\n", "path", "state", "params", "B/param", "Gparams/s", "GB/s",
               "stream GB/s", "of bound");
        for (int i = 0; i < ab->n_res; i++)
            printf("%-6s %-5s %12.0f %8.2f %12.3f %10.2f %12.2f %10.3f\n", res[i].path, td_optim_state_name(res[i].state),
                   res[i].params, res[i].bytes_per_param, res[i].gparams_per_s, res[i].gbytes_per_s,
                   res[i].stream_gbytes_per_s, res[i].fraction);
        return TD_OK;
    }
    cJSON *out = cJSON_CreateObject();
    cJSON_AddNumberToObject(out, "stream_gbytes_per_s", ab->stream);
    cJSON_AddStringToObject(out, "stream_kernel",
                            "a+=0*d, b+=0*d, c+=0*d over the fp32 path's buffers at the largest size: "
                            "4 arrays read, 3 written, 28 bytes/elem, median, interleaved with the AdamW steps");
    cJSON_AddNumberToObject(out, "stream_triad_gbytes_per_s", ab->triad);
    cJSON_AddStringToObject(out, "isa", td_optim_isa_name(td_adam_cpu_isa(ab->cpu)));
    cJSON_AddBoolToObject(out, "threads_bound_to_cores", ab->topo != NULL);
    cJSON_AddStringToObject(out, "host_memory", ab->topo ? td_topo_describe(ab->topo) : "");
    cJSON_AddNumberToObject(out, "bytes_per_param_fp32", 28.0); /* with fp32 state; per row: bytes_per_param */
    cJSON_AddNumberToObject(out, "bytes_per_param_mixed", 28.0);
    cJSON *arr = cJSON_AddArrayToObject(out, "results");
    for (int i = 0; i < ab->n_res; i++) {
        cJSON *r = cJSON_CreateObject();
        cJSON_AddStringToObject(r, "path", res[i].path);
        cJSON_AddStringToObject(r, "state", td_optim_state_name(res[i].state));
        cJSON_AddNumberToObject(r, "bytes_per_param", res[i].bytes_per_param);
        cJSON_AddNumberToObject(r, "params", res[i].params);
        cJSON_AddNumberToObject(r, "threads", res[i].threads);
        cJSON_AddNumberToObject(r, "gparams_per_s", res[i].gparams_per_s);
        cJSON_AddNumberToObject(r, "gbytes_per_s", res[i].gbytes_per_s);
        cJSON_AddNumberToObject(r, "stream_gbytes_per_s", res[i].stream_gbytes_per_s);
        cJSON_AddNumberToObject(r, "fraction_of_bound", res[i].fraction);
        cJSON_AddItemToArray(arr, r);
    }
    cJSON *skipped = cJSON_AddArrayToObject(out, "skipped_params");
    for (int s = ab->fit; s < ab->n_sizes; s++) cJSON_AddItemToArray(skipped, cJSON_CreateNumber((double)ab->sizes[s]));
    return td_cli_print_json(out);
}

int td_bench_adam_main(int argc, char **argv)
{
    adam_bench ab = { .max_params = 1e9, .min_s = 1.0, .isa = TD_OPTIM_ISA_AUTO };
    int rc = adam_options(&ab, argc, argv);
    if (rc >= 0) return rc;
    td_status st = adam_setup(&ab);
    if (!st && ab.check_dir) st = td_adam_check_run(ab.cpu, ab.check_dir);
    else if (!st && !(st = adam_measure(&ab))) st = adam_report(&ab);
    if (st) fprintf(stderr, "tidal bench adam: %s\n", td_error_msg());
    free(ab.res);
    td_adam_cpu_destroy(ab.cpu);
    td_topo_destroy(ab.topo);
    td_backend_free(ab.be);
    td_args_free();
    return st ? 1 : 0;
}
