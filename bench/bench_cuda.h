/* What the CUDA benchmarks share (`tidal bench ops`, `attention`, `head`):
 * the device's peaks, by which an op's time is set beside its roofline, and
 * the timing of a call on a stream.
 *
 * Roofline of an op: the larger of its FLOPs over the peak dense tensor
 * rate of its storage type and its compulsory bytes (each input read once,
 * each output written once) over the peak memory bandwidth; the op's time
 * can be no shorter.  "of roofline" is roofline / measured time. */
#ifndef TIDAL_BENCH_CUDA_H
#define TIDAL_BENCH_CUDA_H

#include <stddef.h>

#include "tidal/dtype.h"
#include "tidal/ops_cuda.h"
#include "tidal/status.h"

struct cJSON;

typedef struct td_bench_peak {
    char device[256];  /* cudaDeviceProp.name */
    double tflops;     /* dense tensor-core TFLOP/s of the storage type (fp32: CUDA cores, no TF32) */
    double gbytes_s;   /* HBM GB/s (1e9 bytes) */
    const char *source; /* where the peaks come from: the data sheet of a named part, or the options */
} td_bench_peak;

/* The current device's peaks for storage type dt: --peak-tflops and
 * --peak-gbs when given (> 0), else the data sheet of a part the device's
 * name identifies (H100 SXM / PCIe / NVL, H200, A100, GH200), else
 * TD_ERR_UNSUPPORTED naming the options to give. */
td_status td_bench_peak_get(td_dtype dt, double tflops_opt, double gbs_opt, td_bench_peak *out);
/* Roofline time of an op in ms (0 when it has neither flops nor bytes). */
double td_bench_roofline_ms(const td_bench_peak *p, double flops, double bytes);
/* The peaks as a JSON object {device, peak_tflops, peak_gbytes_per_s, source}. */
struct cJSON *td_bench_peak_json(const td_bench_peak *p);

/* Median ms of `repeat` timed runs of fn(ctx) after two warm-up runs, with
 * CUDA events on `stream`; with ops (NULL: fn runs no GEMM), the warm-up
 * goes on until the GEMM shapes' tuning has settled (ops_cuda.h). */
typedef td_status (*td_bench_fn)(void *ctx);
td_status td_bench_time(td_bench_fn fn, void *ctx, td_ops_cuda *ops, void *stream, int repeat, double *ms);

#endif
