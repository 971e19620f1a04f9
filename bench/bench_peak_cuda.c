/* The device's peaks and the event timing the CUDA benchmarks share
 * (bench_cuda.h).  The peaks are the parts' data-sheet figures (dense, no
 * sparsity): a device reports neither its tensor rate nor, on CUDA 13, its
 * memory clock, so an unknown part needs --peak-tflops and --peak-gbs. */
#include "bench_cuda.h"

#include <cjson/cJSON.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One part: a substring of its name that identifies it (the first match
 * wins, so the more specific names come first), its 16-bit and fp32 dense
 * TFLOP/s and its HBM GB/s. */
static const struct part {
    const char *name_has, *name_too;
    double t16, t32, gbs;
    const char *sheet;
} parts[] = {
    {"H200 NVL", NULL, 835.5, 60.0, 4800, "H200 NVL data sheet"},
    {"H200", NULL, 989.4, 66.9, 4800, "H200 SXM data sheet"},
    {"GH200", NULL, 989.4, 66.9, 4000, "GH200 (96 GB HBM3) data sheet"},
    {"H100", "NVL", 835.5, 60.0, 3900, "H100 NVL data sheet"},
    {"H100", "PCIe", 756.5, 51.2, 2000, "H100 PCIe data sheet"},
    {"H100", NULL, 989.4, 66.9, 3350, "H100 SXM data sheet"},
    {"A100", "80GB PCIe", 312.0, 19.5, 1935, "A100 80GB PCIe data sheet"},
    {"A100", "PCIE", 312.0, 19.5, 1555, "A100 40GB PCIe data sheet"},
    {"A100", "80GB", 312.0, 19.5, 2039, "A100 80GB SXM data sheet"},
    {"A100", NULL, 312.0, 19.5, 1555, "A100 40GB SXM data sheet"},
};

td_status td_bench_peak_get(td_dtype dt, double tflops_opt, double gbs_opt, td_bench_peak *out)
{
    memset(out, 0, sizeof *out);
    int dev = 0;
    struct cudaDeviceProp prop;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess)
        return td_error_set(TD_ERR_BACKEND, "no CUDA device answers (cudaGetDeviceProperties)");
    snprintf(out->device, sizeof out->device, "%s", prop.name);
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        const struct part *p = &parts[i];
        if (!strstr(prop.name, p->name_has) || (p->name_too && !strstr(prop.name, p->name_too))) continue;
        out->tflops = dt == TD_DTYPE_F32 ? p->t32 : p->t16;
        out->gbytes_s = p->gbs;
        out->source = p->sheet;
        break;
    }
    if (tflops_opt > 0) out->tflops = tflops_opt;
    if (gbs_opt > 0) out->gbytes_s = gbs_opt;
    if (tflops_opt > 0 || gbs_opt > 0) out->source = out->source ? "the options over the data sheet" : "the options";
    if (out->tflops <= 0 || out->gbytes_s <= 0)
        return td_error_set(TD_ERR_UNSUPPORTED, "the peaks of the %s are not in tidal's table: give --peak-tflops "
                            "(dense %s tensor TFLOP/s) and --peak-gbs (memory GB/s) from its data sheet", prop.name,
                            td_dtype_name(dt));
    return TD_OK;
}

double td_bench_roofline_ms(const td_bench_peak *p, double flops, double bytes)
{
    double c = flops > 0 ? flops / (p->tflops * 1e12) : 0, m = bytes > 0 ? bytes / (p->gbytes_s * 1e9) : 0;
    return 1e3 * (c > m ? c : m);
}

cJSON *td_bench_peak_json(const td_bench_peak *p)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "device", p->device);
    cJSON_AddNumberToObject(o, "peak_tflops", p->tflops);
    cJSON_AddNumberToObject(o, "peak_gbytes_per_s", p->gbytes_s);
    cJSON_AddStringToObject(o, "source", p->source ? p->source : "");
    return o;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

td_status td_bench_time(td_bench_fn fn, void *ctx, td_ops_cuda *ops, void *stream, int repeat, double *ms)
{
    cudaStream_t s = (cudaStream_t)stream;
    cudaEvent_t e0, e1;
    double *t = malloc((size_t)repeat * sizeof *t);
    if (!t) return td_error_set(TD_ERR_NOMEM, "timing: out of host memory");
    if (cudaEventCreate(&e0) != cudaSuccess) {
        free(t);
        return td_error_set(TD_ERR_BACKEND, "cudaEventCreate failed");
    }
    if (cudaEventCreate(&e1) != cudaSuccess) {
        cudaEventDestroy(e0);
        free(t);
        return td_error_set(TD_ERR_BACKEND, "cudaEventCreate failed");
    }
    td_status st = TD_OK;
    for (int i = 0; i < 2 && !st; i++) st = fn(ctx);
    for (int i = 0; i < 256 && !st && ops && td_ops_cuda_gemm_tuning(ops); i++) {
        st = fn(ctx);
        cudaStreamSynchronize(s);
    }
    for (int i = 0; i < repeat && !st; i++) {
        float f = 0;
        cudaEventRecord(e0, s);
        st = fn(ctx);
        cudaEventRecord(e1, s);
        if (!st && (cudaEventSynchronize(e1) != cudaSuccess || cudaEventElapsedTime(&f, e0, e1) != cudaSuccess))
            st = td_error_set(TD_ERR_BACKEND, "a timed op failed: %s", cudaGetErrorString(cudaGetLastError()));
        t[i] = f;
    }
    if (!st) {
        qsort(t, (size_t)repeat, sizeof *t, cmp_double);
        *ms = t[repeat / 2];
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    free(t);
    return st;
}
